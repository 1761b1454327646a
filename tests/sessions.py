"""subprocess.run for launches of several processes (torchrun and its ranks):

    run = run_in_session([sys.executable, "-m", "torch.distributed.run", ...], capture_output=True, text=True, timeout=300)

The same arguments and CompletedProcess as subprocess.run, but the command runs in a session
of its own, and a timeout (or an interrupt) kills that whole session: subprocess.run kills the
child alone, and torchrun killed alone leaves its ranks running (two ranks hung in a
collective outlived their test, holding the CPU through the rest of the suite)."""

import os
import signal
import subprocess


def run_in_session(cmd, *, timeout: float, capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException:  # the timeout, or ^C: the launcher and every process it started
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)
