"""fmoe.train.run.StopRequests: a signal or a time limit asks the loop to stop after its step.
run_script: under torchrun a refusal is said by rank 0 alone, the others hold theirs back."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import pathlib
import threading
import time

import pytest
import torch.distributed as dist

import fmoe.train.run
from fmoe.train.run import ArgumentParser, StopRequests, every_rank, nearest, raise_together, run_script
from tests.sessions import run_in_session


def _handlers():
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)


def test_the_first_signal_is_noted_and_the_second_acts_as_before():
    before = _handlers()
    seen = []
    mine = lambda *a: seen.append("previous")  # noqa: E731
    previous_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        with StopRequests(("SIGTERM", "SIGUSR1"), repeat_seconds=0) as stop:
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


def test_the_same_signal_again_within_repeat_seconds_is_the_same_request():
    """SLURM signals every process of a job step and torchrun passes its own signal on, so a
    rank gets SIGTERM twice, milliseconds apart: the copy is not a second request (it ended
    the rank before its checkpoint); a repeat after repeat_seconds acts as before. (The
    window is a minute and the first arrival is moved back past it: a window of 0.5 s and a
    sleep failed where a loaded machine stalled the test between the two signals.)"""
    seen = []
    mine = lambda *a: seen.append("previous")  # noqa: E731
    previous_usr1 = signal.signal(signal.SIGUSR1, mine)
    try:
        with StopRequests(("SIGUSR1",), repeat_seconds=60) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)  # the launcher's copy
            assert stop.reason() == "SIGUSR1" and seen == [] and signal.getsignal(signal.SIGUSR1) == stop._note
            stop._first[signal.SIGUSR1] -= 61  # the minute has passed
            os.kill(os.getpid(), signal.SIGUSR1)  # a second request
            assert seen == ["previous"] and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
    # a second SIGTERM after the window ends the process, as the default handler does
    code = ("import os, signal, sys, time; from fmoe.train.run import StopRequests\n"
            "with StopRequests(('SIGTERM',), repeat_seconds=60) as stop:\n"
            "    os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGTERM)\n"
            "    print('alive', stop.reason(), flush=True); stop._first[signal.SIGTERM] -= 61\n"
            "    os.kill(os.getpid(), signal.SIGTERM); print('not ended', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == "alive SIGTERM\n", (done.returncode, done.stdout, done.stderr)
    for bad in (-1, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="repeat_seconds: expected seconds >= 0"):
            StopRequests(("SIGTERM",), repeat_seconds=bad)


def test_a_torchrun_rank_whose_launcher_is_gone_is_asked_to_stop(tmp_path):
    """torchrun killed without passing a signal on (SIGKILL, the OOM killer): its ranks are
    orphans that trained on to the end of the run. Under torchrun (TORCHELASTIC_RUN_ID) the
    launcher's end is a stop request; outside it, a parent's end is none."""
    child = ("import os, pathlib, sys, time\nfrom fmoe.train.run import StopRequests\n"
             "with StopRequests(()) as stop:\n"
             "    print(stop.reason(), flush=True); pathlib.Path(sys.argv[1]).touch()\n"
             "    end = time.monotonic() + 30\n"
             "    while stop.reason() is None and time.monotonic() < end and os.getppid() == int(sys.argv[2]):\n"
             "        time.sleep(0.05)\n"
             "    time.sleep(0.2); print(stop.reason(), flush=True)\n")
    launcher = ("import os, pathlib, subprocess, sys, time\n"
                "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], str(os.getpid())])\n"
                "while not pathlib.Path(sys.argv[2]).exists():\n    time.sleep(0.05)\n"
                "print(os.getpid(), flush=True); os._exit(0)\n")
    for run_id, said in (("x", "its launcher's end (torchrun, pid {}, is gone)"), (None, "None")):
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | ({"TORCHELASTIC_RUN_ID": run_id} if run_id else {})
        marker = tmp_path / f"entered_{run_id}"
        out = subprocess.run([sys.executable, "-c", launcher, child, str(marker)], capture_output=True, text=True, timeout=120, env=env)
        lines = out.stdout.split()
        assert len(lines) >= 3, out.stdout + out.stderr
        pid = [line for line in out.stdout.splitlines() if line.isdigit()][0]
        assert out.stdout.splitlines()[0] == "None" and out.stdout.splitlines()[-1] == said.format(pid), out.stdout + out.stderr


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
    for minutes in (-1, float("nan"), float("inf"), True, "90", 10**400):  # 10**400: math.isfinite raised OverflowError
        with pytest.raises(ValueError, match="minutes: expected a time limit in minutes >= 0"):
            StopRequests((), minutes)
    for signals in (None, 5, {"SIGTERM"}):  # None: "'NoneType' object is not iterable"
        with pytest.raises(ValueError, match="signals: expected a sequence of signal names"):
            StopRequests(signals)
    for start in ("x", float("nan"), True, 10**400):  # "x" was taken, and reason() raised a TypeError later
        with pytest.raises(ValueError, match="start: expected time.monotonic"):
            StopRequests((), 1, start=start)


def test_entering_twice_is_refused_and_leaks_no_handler():
    """Entered twice, the inner exit put back the outer's handler and the outer none: the
    handler stayed installed after both exits."""
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopRequests(("SIGUSR2",))
    with stop:
        with pytest.raises(ValueError, match="already entered; it is not reentrant"):
            with stop:
                pass
        assert signal.getsignal(signal.SIGUSR2) == stop._note
    assert signal.getsignal(signal.SIGUSR2) == before


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


def _refuse(argv):
    sys.exit(f"--{argv[0]}: expected a number")


def _timed(main, argv, wait):
    start = time.monotonic()
    try:
        run_script(main, argv, wait=wait)
    except SystemExit as stop:
        return stop.code, time.monotonic() - start
    return "returned", time.monotonic() - start


@pytest.mark.parametrize("rank, world, held", [(None, None, False), ("0", "2", False), ("1", "2", True), ("3", "4", True), ("0", "1", False)])
def test_a_refusal_is_held_back_on_ranks_other_than_0(monkeypatch, rank, world, held):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # another launcher: no store to look at
    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
    # "at once": well before a wait of 30 s (a bound of 0.5 s is a loaded machine's stall)
    code, took = _timed(_refuse, ["lr"], wait=0.5 if held else 30)
    assert code == "--lr: expected a number"  # the message itself, after the wait or at once
    assert took >= 0.5 if held else took < 10, took
    # a clean exit, a --help's SystemExit(0) and other errors pass at once on every rank
    assert _timed(lambda argv: None, [], wait=30)[0] == "returned"
    assert _timed(lambda argv: sys.exit(0), [], wait=30)[1] < 10
    with pytest.raises(KeyError):
        run_script(lambda argv: {}["x"], [], wait=5)


def test_a_missing_extra_is_said_in_one_line():
    """A script that needs an extra (safetensors for an HF folder) printed two chained tracebacks; the library's
    MissingExtra (naming the pip command) is a refusal, its message alone. Another ImportError is not touched."""
    from fmoe.ops.checks import MissingExtra

    def needs_extra(argv):
        try:
            import fmoe_no_such_module  # noqa: F401
        except ImportError as err:
            raise MissingExtra("fmoe.hf reads Hugging Face checkpoints with the safetensors package: pip install 'fmoe[hf]'") from err

    with pytest.raises(SystemExit) as stop:
        run_script(needs_extra, [], wait=5)
    assert stop.value.code == "error: fmoe.hf reads Hugging Face checkpoints with the safetensors package: pip install 'fmoe[hf]'"
    assert stop.value.__cause__ is None and stop.value.__suppress_context__
    with pytest.raises(ModuleNotFoundError, match="fmoe_no_such_module"):
        run_script(lambda argv: __import__("fmoe_no_such_module"), [], wait=5)


@pytest.fixture
def launch_store(monkeypatch):
    """A store where torchrun's agent keeps its own, and the environment torchrun gives its ranks."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in (("TORCHELASTIC_USE_AGENT_STORE", "True"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(store.port)),
                        ("TORCHELASTIC_RUN_ID", "run7"), ("TORCHELASTIC_RESTART_COUNT", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    return store


def _key(restart="0"):
    """Where rank 0 of the fixture's run leaves its refusal, in the given attempt."""
    return f"fmoe.run_script/run7/{restart}/rank 0 refused"


def _rank_0_says_later(store, said, after, restart="0"):
    thread = threading.Thread(target=lambda: (time.sleep(after), store.set(_key(restart), said)))
    thread.start()
    return thread


def test_rank_0_leaves_its_refusal_in_torchrun_s_store(monkeypatch, launch_store):
    monkeypatch.setenv("RANK", "0")
    assert _timed(lambda argv: sys.exit(0), [], wait=5)[0] == 0 and _timed(lambda argv: None, [], wait=5)[0] == "returned"
    assert launch_store.num_keys() == 0  # nothing left for a clean exit
    code, took = _timed(_refuse, ["lr"], wait=30)
    assert code == "--lr: expected a number" and took < 10, took  # said at once
    assert launch_store.check([_key()]) and launch_store.get(_key()) == b"--lr: expected a number"


def test_another_rank_waits_for_rank_0_however_late_and_stays_silent(monkeypatch, launch_store):
    """Rank 0's imports can come seconds after this rank's (a loaded node, a shared file system):
    the rank waits for rank 0's refusal, not a fixed time, then leaves the saying to it."""
    monkeypatch.setenv("RANK", "1")
    code, took = _timed(_refuse, ["lr"], wait=0.5)  # rank 0's refusal not there within this rank's wait: said
    assert code == "--lr: expected a number" and took >= 0.5, took
    # rank 0's comes 0.6 s in, well within the wait (a wait of 1 s failed where a loaded machine stalled the thread)
    thread = _rank_0_says_later(launch_store, "--lr: expected a number", after=0.6)
    code, took = _timed(_refuse, ["lr"], wait=3.0)
    thread.join()
    # rank 0 said it: silent, status 1, after waiting for torchrun's SIGTERM (0.6 s of the thread's, begun a moment
    # before this rank's clock, then the wait)
    assert code == 1 and 3.5 <= took < 10, took


def test_another_rank_says_a_refusal_rank_0_does_not_share(monkeypatch, launch_store):
    monkeypatch.setenv("RANK", "3")
    thread = _rank_0_says_later(launch_store, "--data: no such file", after=0.3)
    code, took = _timed(_refuse, ["lr"], wait=30)
    thread.join()
    assert code == "--lr: expected a number" and 0.25 <= took < 10, took  # at once after rank 0's other refusal (0.3 s in)
    # a previous attempt's refusal (torchrun's restarts) is not this attempt's
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    thread = _rank_0_says_later(launch_store, "--lr: expected a number", after=0.0, restart="0")
    thread.join()
    code, took = _timed(_refuse, ["lr"], wait=0.5)
    assert code == "--lr: expected a number" and took >= 0.5, took


def test_without_a_reachable_store_a_rank_holds_back_for_the_wait(monkeypatch, launch_store):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(fmoe.train.run, "_CONNECT_SECONDS", 0.5)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(unused.getsockname()[1]))
    code, took = _timed(_refuse, ["lr"], wait=0.5)
    assert code == "--lr: expected a number" and took >= 0.5, took


def test_every_rank_of_one_process_is_its_own():
    """every_rank and raise_together without a process group: this process's refusal and
    facts (the ranks' agreement is tests/parallel/test_train_parallel.py's: data,
    checkpoint and config files, questions)."""
    assert every_rank(None, (3, 10)) == (None, [(3, 10)])
    assert every_rank("data: none", None) == ("data: none", [None])
    assert raise_together(None, "facts") == ["facts"]
    missing = FileNotFoundError(2, "No such file or directory", "x.json")
    with pytest.raises(FileNotFoundError) as raised:  # this process's own exception, as it was
        raise_together(missing, "facts")
    assert raised.value is missing


def _unshared_case(rank, world, shared, private):
    from fmoe.train.run import unshared_dir

    same = unshared_dir(shared)
    dist.barrier()  # rank 0 removed its file
    left = sorted(p.name for p in pathlib.Path(shared).iterdir())
    dist.barrier()  # both looked before rank 0 writes its next file there (a slow rank 1 saw it under load)
    own = unshared_dir(shared if rank == 0 else private, wait_seconds=0.5)  # rank 1 on "its own disk"
    return same, left, own


def _every_rank_case(rank, world):
    said = {}
    said["same"] = every_rank("--x: bad", rank)
    said["first"] = every_rank(f"--x: bad on {rank}", rank)[0]
    said["one"] = every_rank("--y: missing" if rank == 1 else None)[0]
    said["differ"] = every_rank(None, rank, lambda every: f"differ {every}")[0]
    said["agree"] = every_rank(None, "same", lambda every: f"differ {every}")
    for error in (RuntimeError(f"read {rank}"), RuntimeError("read")):
        try:
            raise_together(error)
        except Exception as err:  # noqa: BLE001
            said.setdefault("raised", []).append((type(err).__name__, str(err), err is error))
    return said


def _lagging_case(rank, world, shared):
    """Rank 1 on a network file system whose cache shows rank 0's file only at the third look."""
    from fmoe.train.run import unshared_dir

    real, looks = pathlib.Path.exists, []

    def lagging(self, *args, **kwargs):
        if self.name.startswith(".fmoe_shared_") and len(looks) < 2:
            looks.append(self.name)
            return False
        return real(self, *args, **kwargs)

    if rank == 1:
        pathlib.Path.exists = lagging
    try:
        return unshared_dir(shared, wait_seconds=30)
    finally:
        pathlib.Path.exists = real


def _two_rank_cases(rank, world, root):
    """Every two-rank case of this file, in one spawn."""
    return dict(unshared=_unshared_case(rank, world, f"{root}/shared", f"{root}/private"), every_rank=_every_rank_case(rank, world),
                lagging=_lagging_case(rank, world, f"{root}/lagging"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """(the cases' directory, each rank's results of _two_rank_cases)."""
    from tests.parallel.dist import run_distributed

    root = tmp_path_factory.mktemp("two_ranks")
    for name in ("shared", "private", "lagging"):
        (root / name).mkdir()
    return root, run_distributed(_two_rank_cases, 2, str(root))


def test_a_rank_that_does_not_see_rank_0_s_out_dir_is_refused_on_every_rank(two_ranks):
    """Two nodes whose out_dir is each one's own disk at the same path ran to their first
    checkpoint and failed there (rank 1: the step directory rank 0 made does not exist, among
    gloo errors). unshared_dir finds it at the start, on every rank; a shared one passes,
    leaving nothing behind."""
    tmp_path, results = two_ranks
    results = [r["unshared"] for r in results]
    said = (f"rank 1: --out_dir: {tmp_path / 'private'} on {socket.gethostname()} does not hold the file rank 0 wrote in it "
            "(.fmoe_shared_")
    for same, left, own in results:
        assert same is None and left == []
        assert own.startswith(said) and own.endswith("): every rank must see the same out_dir, on a file system the nodes share, "
                                                     "not a node's own disk"), own
    assert results[0][2] == results[1][2] and list((tmp_path / "shared").iterdir()) == []


def test_argument_parser_errors_are_system_exits_with_the_message():
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--n", type=int, required=True)
    for argv, said in ((["--n=x"], "argument --n: invalid int value: 'x'"), ([], "the following arguments are required: --n"),
                       (["--n=1", "--zzz=2"], "unrecognized arguments: --zzz=2")):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(argv)
        assert stop.value.code == f"usage: tool [-h] --n N\ntool: error: {said}"
    assert parser.parse_args(["--n=3"]).n == 3
    parser.add_argument("--tokens", type=int)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--n=1", "--max_new_tokens", "5", "--x=1"])
    assert stop.value.code.endswith("tool: error: unrecognized arguments: --max_new_tokens 5 --x=1; did you mean --tokens?")
    with pytest.raises(SystemExit) as stop:  # one quoted argument that holds several: one unknown, named whole
        parser.parse_args(["--n=1", "--tokns=2 --lr=3"])
    assert stop.value.code.endswith("tool: error: unrecognized arguments: '--tokns=2 --lr=3'; did you mean --tokens?")
    for wait in (-1, True, "5", float("nan")):
        with pytest.raises(ValueError, match="wait: expected seconds >= 0"):
            run_script(_refuse, ["lr"], wait=wait)


def _catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler of its own for sig (Linux's /proc/<pid>/status)."""
    caught = next(line for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def test_torchrun_s_sigterm_ends_a_rank_during_its_wait_without_a_word():
    """torchrun stops the other ranks with SIGTERM once rank 0 fails: a waiting rank ends at once,
    silent, even where the run had noted SIGTERM for a clean stop (StopRequests)."""
    script = ("import sys; from fmoe.train.run import StopRequests, run_script\n"
              "def main(argv):\n    StopRequests(('SIGTERM',)).__enter__()\n    print('waiting', flush=True)\n    sys.exit('--x: refused')\n"
              "run_script(main, [], wait=60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})
    assert proc.stdout.readline() == "waiting\n"
    # SIGTERM once the rank is in its wait, SIGTERM's default action back (no longer caught: /proc's SigCgt); a fixed
    # 0.5 s sleep sent it to StopRequests' handler where a loaded machine stalled the child
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _catches(proc.pid, signal.SIGTERM):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM and err == "", err


def test_under_torchrun_the_ranks_meet_in_its_agent_s_store(tmp_path):
    """The ranks of a real launch reach the store torchrun's agent keeps, under the same run and
    attempt: rank 1 sees what rank 0 refused with."""
    script = ("import os, sys, time\nfrom datetime import timedelta\nimport fmoe.train.run as run\n"
              "store = run._launch_store()\n"
              "if os.environ['RANK'] == '0':\n"
              "    try:\n        run.run_script(lambda argv: sys.exit('--x: refused'), [])\n"
              "    finally:\n        store.wait(['seen'], timedelta(seconds=120))  # until rank 1 has looked\n"
              "else:\n    print('rank 1 saw:', run._rank_0_refusal(store, time.monotonic() + 120), flush=True)\n    store.set('seen', '1')\n")
    (tmp_path / "meet.py").write_text(script)
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(tmp_path / "meet.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "rank 1 saw: --x: refused\n" in run.stdout, (run.stdout, run.stderr[-3000:])
    assert run.stderr.count("--x: refused") == 1, run.stderr[-3000:]  # rank 0's, once


def test_nearest_names_begun_then_close():
    assert nearest("stepz", ("seed", "steps")) == ["steps"]
    assert nearest("ffn", ("hidden", "ffn_dense", "ffn_expert")) == ["ffn_dense", "ffn_expert"]
    assert nearest("model.n_expert", ("model.k", "model.n_experts", "model.ffn_expert", "model.expert_bias", "lr")) == [
        "model.n_experts", "model.ffn_expert", "model.expert_bias"]
    assert nearest("zzz", ("steps", "seed")) == [] and nearest("", ("steps",)) == []
    assert nearest("s", ("seed", "steps", "stop_at", "sx")) == ["seed", "steps", "stop_at"]  # at most n
    for args, match in [((5, ["a"]), "name: expected a str"), (("a", "ab"), "names: expected a sequence of str"), (("a", [1]), "names: expected"),
                        (("a", ["a"], 0), "n: expected a positive int"), (("a", ["a"], -1), "n: expected"), (("a", ["a"], True), "n: expected")]:
        with pytest.raises(ValueError, match=match):  # a TypeError, or difflib's "n must be > 0"
            nearest(*args)


def test_run_path_is_relative_to_where_the_run_started(tmp_path):
    """A run's relative path knobs (--init_from_hf) were read against the reader's directory."""
    from fmoe.train.run import run_path

    assert run_path({"run": {"cwd": str(tmp_path)}}, "hf/qwen3") == tmp_path / "hf" / "qwen3"
    assert run_path({"run": {"cwd": str(tmp_path)}}, "/abs/hf") == pathlib.Path("/abs/hf")  # absolute: as it is
    assert run_path({"config": {}}, "hf") == pathlib.Path("hf")  # no record of where it started
    for record in (None, "x", {"cwd": None}, {"cwd": 5}):  # an AttributeError on .get for the first two
        assert run_path({"run": record}, "hf") == pathlib.Path("hf")
    for path in (None, 5):
        with pytest.raises(ValueError, match="path: expected a path"):
            run_path({}, path)


def test_write_config_and_run_script_name_their_bad_inputs(tmp_path, monkeypatch):
    from fmoe.train.run import run_script, write_config

    with pytest.raises(ValueError, match="out_dir: expected a path"):
        write_config(None, {})
    assert write_config(tmp_path, {"a": 1}) == tmp_path / "config.json"
    monkeypatch.setenv("WORLD_SIZE", "two")  # int()'s message named neither; a refusal in one line, not a traceback
    with pytest.raises(SystemExit, match="WORLD_SIZE: expected an int in the environment .* got 'two'"):
        run_script(lambda argv: None, [])


def test_config_json_is_strict_json_and_a_model_knob_s_infinity_comes_back(tmp_path):
    """--clip=inf (a legal knob) was written as Infinity, which jq and other strict JSON
    readers refuse: non-finite floats are the strings "inf", "-inf" and "nan", and
    run_config reads a float model knob's back as the number."""
    import json
    import math

    from fmoe.model import TransformerConfig
    from fmoe.train.checkpoint import run_config
    from fmoe.train.run import write_config

    model = dict(TransformerConfig(yarn_beta_fast=math.inf).__dict__)
    path = write_config(tmp_path, {"clip": math.inf, "floor": -math.inf, "seq": (1.0, math.nan), "model": model}, vocab_size=256)

    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    config = json.loads(path.read_text(), parse_constant=refuse)["config"]
    assert (config["clip"], config["floor"], config["seq"]) == ("inf", "-inf", [1.0, "nan"])
    assert config["model"]["yarn_beta_fast"] == "inf"
    cfg, _ = run_config(tmp_path, impl=model["impl"])
    assert cfg.yarn_beta_fast == math.inf and cfg == TransformerConfig(**{**model, "vocab_size": 256})


def test_the_git_commit_is_fmoe_s_own_not_a_project_s_it_is_installed_in(tmp_path):
    """run_info's git_commit came from any repository above the package: fmoe installed in a
    project's .venv recorded the project's commit as its own. Only a checkout whose top level
    holds the fmoe package, tracked, counts: the package installed at a project's top level
    (`pip install --target .`) recorded the project's commit too."""
    from fmoe.train.run import run_info

    root = pathlib.Path(fmoe.train.run.__file__).resolve().parents[2]
    here = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True, text=True)
    if here.returncode != 0 or pathlib.Path(here.stdout.splitlines()[0]).resolve() != root:
        pytest.skip(f"fmoe at {root} is not a git checkout's top level: {here.stderr.strip()}")
    assert run_info()["git_commit"] == here.stdout.splitlines()[1]
    project = tmp_path / "project"
    site = project / ".venv" / "lib" / "site-packages"
    shutil.copytree(root / "fmoe", site / "fmoe", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "a project"]):
        subprocess.run(git + args, cwd=project, check=True, capture_output=True)
    shutil.copytree(site / "fmoe", project / "fmoe")  # installed at its top level, untracked
    script = "import fmoe.train.run as run; print(run.__file__); print(run.run_info()['git_commit'])"
    for where in (site, project):
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(where)})
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.splitlines() == [str(where / "fmoe" / "train" / "run.py"), "None"]


def test_set_deterministic_turns_the_modes_on_and_off():
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        for enabled in (True, False, True, False):
            fmoe.train.run.set_deterministic(enabled)
            assert torch.are_deterministic_algorithms_enabled() is enabled and torch.backends.cudnn.deterministic is enabled
            assert torch.backends.cudnn.benchmark is False
        with pytest.raises(ValueError, match="enabled: expected a bool, got 1"):
            fmoe.train.run.set_deterministic(1)
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_run_info_records_the_launcher_s_variables_that_are_set(monkeypatch):
    """config.json's env: where a segment came from (its SLURM job, its torchrun run)."""
    launcher = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc", "OMP_NUM_THREADS": "3", "SLURM_JOB_ID": "4242"}
    for name in launcher:
        monkeypatch.delenv(name, raising=False)
    assert fmoe.train.run.run_info()["env"] == {}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    assert fmoe.train.run.run_info()["env"] == launcher


def test_saved_config_is_the_record_or_nothing(tmp_path):
    """The loop's readers of a run's config.json (the resume checks, write_config keeping the
    earlier segments) take {} for a missing, damaged or foreign file."""
    from fmoe.train.run import saved_config, write_config

    assert saved_config(tmp_path / "none") == {}
    for text in ("[1, 2]", "{not json", "[" * 100_000):
        (tmp_path / "config.json").write_text(text)
        assert saved_config(tmp_path) == {}
    write_config(tmp_path, {"lr": 0.1})
    assert saved_config(tmp_path)["config"] == {"lr": 0.1} and "earlier_runs" not in saved_config(tmp_path)
    # each resumed segment keeps every run before it, oldest first (a second resume kept only the last), with its knobs
    runs = [{**saved_config(tmp_path)["run"], "config": {"lr": 0.1}}]
    for lr in (0.2, 0.3):
        write_config(tmp_path, {"lr": lr})
        saved = saved_config(tmp_path)
        assert saved["config"] == {"lr": lr} and saved["earlier_runs"] == runs
        runs.append({**saved["run"], "config": {"lr": lr}})
    assert len(runs) == 3 and [r["config"]["lr"] for r in saved["earlier_runs"]] == [0.1, 0.2]


def test_an_out_dir_the_lock_made_is_removed_while_still_held(tmp_path, monkeypatch):
    """release() unlocked, then removed the empty directory it had made: a run that took the
    lock between the two lost its out_dir. The directory goes first, the lock after."""
    from fmoe.train import run as run_module

    closed = []
    real_close = os.close
    monkeypatch.setattr(run_module.os, "close", lambda fd: (closed.append((tmp_path / "made").exists()), real_close(fd)))
    run_module.OutDirLock(tmp_path / "made").release()
    assert closed == [False] and not (tmp_path / "made").exists()


def test_an_out_dir_lock_refused_its_path_leaves_no_error_behind(monkeypatch):
    """A path that is not one: the ValueError, and then an AttributeError of the half-made
    lock's __del__ printed as an ignored exception."""
    import gc

    from fmoe.train.run import OutDirLock

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match="out_dir"):
        OutDirLock(123)
    gc.collect()
    assert unraisable == []


def test_set_deterministic_fixes_cublas_s_workspace_unless_one_is_given(monkeypatch):
    """CUBLAS_WORKSPACE_CONFIG (module docstring): set to :4096:8 where unset, a given one kept, left set by False."""
    import torch

    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        fmoe.train.run.set_deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        fmoe.train.run.set_deterministic(False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # it only fixes the workspace: stays
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        fmoe.train.run.set_deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the user's own: kept
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_git_state_is_the_checkout_s_own_and_dirty_means_tracked_changes(tmp_path):
    """_git_state: a package tracked in a subfolder of another repository (vendored) is not that
    repository's checkout; in fmoe's own checkout git_dirty is False until a tracked file changes
    (an untracked file, a run's out_dir in the checkout, is no change)."""
    from fmoe.train.run import _git_state

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]

    def repo(top, package):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("x = 1\n")
        for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "a"]):
            subprocess.run(git + args, cwd=top, check=True, capture_output=True)
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=top, capture_output=True, text=True, check=True).stdout.strip()

    vendored = tmp_path / "project"
    repo(vendored, vendored / "lib" / "fmoe")  # tracked, but the checkout's top level is project/, not lib/
    assert _git_state((vendored / "lib" / "fmoe").resolve()) == (None, None)
    own = tmp_path / "own"
    head = repo(own, own / "fmoe")
    package = (own / "fmoe").resolve()
    assert _git_state(package) == (head, False)
    (own / "runs").mkdir()
    (own / "runs" / "metrics.jsonl").write_text("{}\n")  # untracked: not dirty
    assert _git_state(package) == (head, False)
    (package / "__init__.py").write_text("x = 2\n")  # a tracked file changed
    assert _git_state(package) == (head, True)


def test_run_info_records_the_whole_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["scripts/train_moe.py", "--lr=0.01", "--steps=3"])
    assert fmoe.train.run.run_info()["argv"] == ["scripts/train_moe.py", "--lr=0.01", "--steps=3"]


@contextlib.contextmanager
def _held_elsewhere(out_dir):
    """An OutDirLock on out_dir held by another Python process while active; yields its pid."""
    code = f"import sys; from fmoe.train.run import OutDirLock; lock = OutDirLock({str(out_dir)!r}); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.communicate("", timeout=60)


def test_an_out_dir_is_held_against_every_other_lock_and_its_holder_named(tmp_path):
    """A second OutDirLock (this process's, another's) is refused while the first holds it, naming another process's pid."""
    from fmoe.train.run import OutDirInUse, OutDirLock

    out = tmp_path / "run"
    lock = OutDirLock(out)
    with pytest.raises(OutDirInUse, match="this process holds it"):
        OutDirLock(out)
    lock.release()
    other = tmp_path / "other"
    with _held_elsewhere(other) as pid:
        with pytest.raises(OutDirInUse, match=rf"^--out_dir: {other} is in use: another run \(pid {pid}\) is writing it"):
            OutDirLock(other)
    OutDirLock(other).release()  # its process ended: free again


def test_an_out_dir_lock_refuses_what_is_no_writable_directory(tmp_path, monkeypatch):
    """The checks test_train_loop.py makes through a training run, here in-process: '' (the working directory),
    a file, a directory that cannot be written (removed again where the lock made it)."""
    import errno
    import tempfile

    from fmoe.train.run import OutDirLock

    with pytest.raises(ValueError, match="^--out_dir: expected a directory, got ''"):
        OutDirLock("")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"^--out_dir: {tmp_path / 'file'} exists and is not a directory$"):
        OutDirLock(tmp_path / "file")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ValueError, match=f"^--out_dir: {tmp_path / 'ro'} cannot be written: Read-only file system$") as refused:
        OutDirLock(tmp_path / "ro")
    # removed at the refusal, not at the half-made lock's __del__ (its traceback, kept here, holds it)
    assert not (tmp_path / "ro").exists() and refused.value


def test_files_a_run_writes_itself_are_refused_as_links(tmp_path):
    from fmoe.train.run import refuse_link, write_config

    target = tmp_path / "bashrc"
    target.write_text("keep\n")
    (tmp_path / "config.json").symlink_to(target)
    with pytest.raises(ValueError, match=r"out_dir: '.*config.json' is a link \(to '.*bashrc'\); a run writes its own config.json"):
        refuse_link(tmp_path / "config.json")
    with pytest.raises(ValueError, match="is a link"):
        write_config(tmp_path, {})
    assert target.read_text() == "keep\n"
    refuse_link(tmp_path / "none.json")  # missing or a plain file: fine
    refuse_link(target)


def test_write_config_takes_a_dict_and_records_other_values_as_strings(tmp_path):
    import json

    from fmoe.train.run import write_config

    for bad in ([("lr", 0.1)], None, "lr=0.1"):
        with pytest.raises(ValueError, match="config: expected a dict of knobs"):
            write_config(tmp_path, bad)
    path = write_config(tmp_path, {"data": pathlib.Path("/data/x.bin")}, started_from=pathlib.Path("ckpt"))
    record = json.loads(path.read_text())
    assert record["config"] == {"data": "/data/x.bin"} and record["started_from"] == "ckpt"


def test_the_default_repeat_window_is_five_seconds():
    """A launcher's copy of a signal seconds later (a loaded node) is still the same request; 5 s after it is a second one."""
    seen = []
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *a: seen.append("previous"))
    try:
        with StopRequests(("SIGUSR1",)) as stop:
            assert stop.repeat_seconds == 5.0
            os.kill(os.getpid(), signal.SIGUSR1)
            stop._first[signal.SIGUSR1] -= 4  # 4 s later: the same request
            os.kill(os.getpid(), signal.SIGUSR1)
            assert seen == [] and stop.reason() == "SIGUSR1"
            stop._first[signal.SIGUSR1] -= 2  # 6 s after the first: a second request
            os.kill(os.getpid(), signal.SIGUSR1)
            assert seen == ["previous"]
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def test_the_time_limit_is_not_reached_before_its_minutes():
    with StopRequests((), minutes=1.5, start=time.monotonic() - 88) as stop:  # 88 s of 90
        assert stop.reason() is None
    with StopRequests((), minutes=10, start=time.monotonic() - 595) as stop:  # 595 s of 600
        assert stop.reason() is None


def test_stop_requests_can_be_entered_again_once_left():
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopRequests(("SIGUSR2",))
    for _ in range(2):
        with stop:
            assert signal.getsignal(signal.SIGUSR2) == stop._note
        assert signal.getsignal(signal.SIGUSR2) == before


def test_a_handler_python_did_not_install_is_put_back_as_the_default(monkeypatch):
    """signal.signal returns None for a handler installed outside Python (an embedding program):
    leaving, and a second request, put SIG_DFL there (signal.signal(sig, None) is a TypeError)."""
    real = signal.signal
    before = signal.getsignal(signal.SIGUSR2)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: (real(sig, handler), None)[1])
    try:
        with StopRequests(("SIGUSR2",)):
            pass
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        real(signal.SIGUSR2, before)


def test_one_process_or_no_world_size_is_no_launch(monkeypatch, launch_store):
    """WORLD_SIZE=1 (or unset): main runs as it is, its refusal said at once and left in no store."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, took = _timed(_refuse, ["lr"], wait=30)
    assert code == "--lr: expected a number" and took < 10 and launch_store.num_keys() == 0
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")  # a RANK left in a shell, no WORLD_SIZE: one process
    code, took = _timed(_refuse, ["lr"], wait=20)
    assert code == "--lr: expected a number" and took < 10, took


def test_a_store_that_cannot_be_named_or_written_is_none(monkeypatch, launch_store):
    """TORCHELASTIC_USE_AGENT_STORE without MASTER_ADDR: no store (not a KeyError); rank 0's store gone at its
    set: its refusal is still said."""
    monkeypatch.delenv("MASTER_ADDR")
    assert fmoe.train.run._launch_store() is None
    monkeypatch.setenv("RANK", "1")
    assert _timed(_refuse, ["lr"], wait=0.2)[0] == "--lr: expected a number"

    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(fmoe.train.run, "_launch_store", Gone)
    monkeypatch.setenv("RANK", "0")
    assert _timed(_refuse, ["lr"], wait=5)[0] == "--lr: expected a number"


def test_every_rank_agrees_on_the_first_refusal_and_raise_together_raises_it_everywhere(two_ranks):
    for rank, said in enumerate(r["every_rank"] for r in two_ranks[1]):
        assert said["same"] == ("--x: bad", [0, 1])  # the same refusal: said without a rank
        assert said["first"] == "rank 0: --x: bad on 0"  # the first rank's
        assert said["one"] == "rank 1: --y: missing"
        assert said["differ"] == "differ [0, 1]" and said["agree"] == (None, ["same", "same"])
        # different errors: rank 0's text as a ValueError on every rank; the same error: each rank's own
        assert said["raised"] == [("ValueError", "rank 0: read 0", False), ("RuntimeError", "read", True)]


def test_nearest_takes_difflib_s_ratio_from_0_6():
    assert nearest("abcd", ["abxy"]) == []  # a ratio of 0.5
    assert nearest("abcde", ["abcxy"]) == ["abcxy"]  # 0.6


def test_a_stray_positional_argument_gets_no_option_suggested():
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--tokens", type=int)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["tokns"])
    assert stop.value.code.endswith("tool: error: unrecognized arguments: tokns")


def test_the_holder_named_is_the_flock_s_not_a_posix_lock_s(tmp_path):
    """/proc/locks lists POSIX (fcntl) locks of the same inode too: the holder named is the process holding the flock,
    not one holding a POSIX lock on the directory (here this process, which was then told it held the directory itself)."""
    import fcntl

    from fmoe.train.run import OutDirInUse, OutDirLock

    out = tmp_path / "run"
    with _held_elsewhere(out) as pid:
        fd = os.open(out, os.O_RDONLY)
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a POSIX read lock, listed before the flock
            with pytest.raises(OutDirInUse, match=rf"another run \(pid {pid}\) is writing it"):
                OutDirLock(out)
        finally:
            os.close(fd)


def test_a_rank_that_sees_rank_0_s_file_late_is_not_refused(two_ranks):
    """A network file system's cache: a rank that does not see the file at once looks again within wait_seconds."""
    root, results = two_ranks
    assert [r["lagging"] for r in results] == [None, None]
    assert list((root / "lagging").iterdir()) == []


def test_a_window_of_0_lets_every_repeat_act_even_at_the_same_clock_reading(monkeypatch):
    """repeat_seconds=0: no repeat is the same request, a coarse clock's equal reading included (a frozen clock here)."""
    import types

    monkeypatch.setattr(fmoe.train.run, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    seen = []
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *a: seen.append("previous"))
    try:
        with StopRequests(("SIGUSR1",), repeat_seconds=0) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.reason() == "SIGUSR1" and seen == ["previous"]
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
