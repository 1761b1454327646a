"""A pytest plugin: each test's CPU time, and the slowest tests by it after --durations' list.

Under make test's workers a test's wall clock (--durations) counts whatever the other
worker runs beside it: a two-rank export took 28 s alone and 169 s, then 327 s, in two
whole runs. Its CPU time is its own cost to the run: user + system time of the test's
process and of the processes it started and waited for (scripts, torchrun and its ranks,
spawned process groups), from its setup's start to its teardown's end. Processes a test
does not wait for (a pool of compile workers left running) are not counted.

    python -m pytest --durations=15 -p cpu_times   # (tests/conftest.py registers it for the suite)

prints, after the slowest durations, the --durations slowest tests by CPU time (0: all;
none without --durations), the CPU time of every test together, and as many of the
costliest test files (their tests' CPU time summed: where trimming the suite pays). Under pytest-xdist the
workers measure and send each test's time with its teardown report (its user_properties,
("cpu_s", (user, sys))); the controller prints the list.
"""

from __future__ import annotations

import resource

import pytest

_START = pytest.StashKey[tuple]()
_TIMES: dict[str, list[float]] = {}  # nodeid -> [user, sys, wall] of the tests reported to this process


def _cpu() -> tuple[float, float]:
    """(user, sys) seconds of this process and of its waited-for descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_START] = _cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _START in item.stash:
        (user0, sys0), (user1, sys1) = item.stash[_START], _cpu()
        report.user_properties = [*report.user_properties, ("cpu_s", (user1 - user0, sys1 - sys0))]


def pytest_runtest_logreport(report):
    entry = _TIMES.setdefault(report.nodeid, [0.0, 0.0, 0.0])
    entry[2] += report.duration
    for name, value in report.user_properties:
        if name == "cpu_s":  # the teardown report's alone
            entry[0], entry[1] = value


@pytest.hookimpl(trylast=True)  # after --durations' own list
def pytest_terminal_summary(terminalreporter, config):
    n = config.option.durations
    if n is None or n < 0 or not _TIMES:
        return
    ranked = sorted(_TIMES.items(), key=lambda kv: kv[1][0] + kv[1][1], reverse=True)
    terminalreporter.write_sep("=", f"slowest {n or len(ranked)} by CPU time (user + sys, with the processes each test waited for)")
    for nodeid, (user, system, wall) in ranked[: n or None]:
        terminalreporter.write_line(f"{user + system:8.2f}s cpu (sys {system:7.2f}s) {wall:8.2f}s wall  {nodeid}")
    user, system = sum(t[0] for t in _TIMES.values()), sum(t[1] for t in _TIMES.values())
    terminalreporter.write_line(f"every test: {user + system:.0f} s cpu ({user:.0f} s user, {system:.0f} s sys) in {len(_TIMES)} tests")
    by_file: dict[str, list[float]] = {}  # file -> [cpu, tests]
    for nodeid, (user, system, _) in _TIMES.items():
        entry = by_file.setdefault(nodeid.split("::")[0], [0.0, 0])
        entry[0], entry[1] = entry[0] + user + system, entry[1] + 1
    files = sorted(by_file.items(), key=lambda kv: kv[1][0], reverse=True)
    terminalreporter.write_sep("=", f"costliest {min(n or len(files), len(files))} test files by CPU time (their tests' together)")
    for path, (cpu, count) in files[: n or None]:
        terminalreporter.write_line(f"{cpu:8.1f}s cpu {count:5d} tests  {path}")
