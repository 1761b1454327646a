"""tests.sessions.run_in_session: the launches' runner kills what the launcher started."""

import os
import subprocess
import sys
import time

import pytest

from tests.sessions import run_in_session

# a launcher that starts a worker (torchrun its ranks), prints the worker's pid, and both wait
_LAUNCHER = ("import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print(w.pid, flush=True); time.sleep(120)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone but for its parent's wait
        return stat.read().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads a process's state in /proc (Linux)")
def test_a_timeout_kills_the_launcher_s_workers_too(tmp_path):
    """subprocess.run's timeout killed torchrun alone: its two ranks, hung in a collective, ran on for minutes after the
    test, holding the CPU. run_in_session kills the launcher's whole session."""
    out = tmp_path / "out"
    with open(out, "w") as sink, pytest.raises(subprocess.TimeoutExpired):
        run_in_session([sys.executable, "-c", _LAUNCHER], stdout=sink, timeout=3)
    worker = int(out.read_text().split()[0])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
    done = run_in_session([sys.executable, "-c", "print('done')"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.args[0]) == (0, "done\n", sys.executable)
