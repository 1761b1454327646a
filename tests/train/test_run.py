"""fmoe.train.run.StopRequests: a signal or a time limit asks the loop to stop after its step."""

import os
import signal
import threading
import time

import pytest

from fmoe.train.run import StopRequests


def _handlers():
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)


def test_the_first_signal_is_noted_and_the_second_acts_as_before():
    before = _handlers()
    seen = []
    mine = lambda *a: seen.append("previous")  # noqa: E731
    previous_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        with StopRequests(("SIGTERM", "SIGUSR1")) as stop:
            assert stop.reason() is None
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.reason() == "SIGUSR1" and seen == []  # noted, the process goes on
            # the handler that was there before is back for the second one
            os.kill(os.getpid(), signal.SIGUSR1)
            assert seen == ["previous"] and stop.reason() == "SIGUSR1"
            os.kill(os.getpid(), signal.SIGTERM)  # another signal of the list: the first one stays the reason
            assert stop.reason() == "SIGUSR1"
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
    assert _handlers() == before  # leaving put every handler back


def test_leaving_puts_the_handlers_back_when_no_signal_came():
    before = _handlers()
    with StopRequests(("SIGTERM",)):
        assert signal.getsignal(signal.SIGTERM) != before[0]
        assert signal.getsignal(signal.SIGUSR1) == before[1]  # not asked for: untouched
    assert _handlers() == before


def test_the_time_limit_counts_from_the_start():
    with StopRequests((), minutes=1.5, start=time.monotonic() - 60) as stop:
        assert stop.reason() is None  # a minute of 1.5
    with StopRequests((), minutes=1.5, start=time.monotonic() - 91) as stop:
        assert stop.reason() == "the time limit of 1.5 minutes"
    with StopRequests((), minutes=0, start=time.monotonic() - 1e6) as stop:
        assert stop.reason() is None  # 0: no limit


def test_bad_requests_are_refused():
    for signals in (("SIGKILL",), ("SIGSTOP",), ("TERM",), ("SIG_DFL",), ("SIGNOPE",), "SIGTERM", (15,)):
        with pytest.raises(ValueError, match="signals: expected"):
            StopRequests(signals)
    for minutes in (-1, float("nan"), float("inf"), True, "90"):
        with pytest.raises(ValueError, match="minutes: expected a time limit in minutes >= 0"):
            StopRequests((), minutes)


def test_handlers_need_the_main_thread():
    errors = []

    def enter():
        try:
            with StopRequests(("SIGTERM",)):
                pass
        except ValueError as err:
            errors.append(str(err))

    before = _handlers()
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]
    assert _handlers() == before
