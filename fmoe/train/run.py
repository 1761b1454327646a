"""What a run records about itself, how to make it bit-reproducible, and when to stop it.

    set_deterministic(True)              the same losses, bit for bit, on the same machine
    run_info() -> dict                   torch / triton / fmoe versions, git commit, host
    write_config(out_dir, config, **extra) -> Path   <out_dir>/config.json
    OutDirLock(out_dir)                  one run at a time writes an out_dir (OutDirInUse when another holds it)
    with StopRequests(signals, minutes) as stop: ... stop.reason()   a signal or a time limit
    run_script(main, argv)               a script's main(argv): under torchrun, a refusal said once
    every_rank(refusal, facts) -> (refusal, [facts of each rank])   what each rank found reading its own files
    raise_together(error, facts) -> [facts of each rank]   the same, an exception raised on every rank
    ArgumentParser(...)                  argparse's, its errors a SystemExit(message), as run_script expects
    nearest(name, names) -> list[str]    the names a mistyped one may have meant, for "did you mean"

Determinism. PyTorch picks some kernels whose floating-point sums depend on thread or
warp timing (atomic adds, split reductions). set_deterministic(True) asks for the
deterministic ones everywhere (torch.use_deterministic_algorithms; an op that has none
raises instead of silently varying), makes cuBLAS use a fixed workspace
(CUBLAS_WORKSPACE_CONFIG, read when the first cuBLAS handle is made: call this before any
CUDA matmul) and turns cuDNN's autotuner off. fmoe's own kernels follow the same switch:
one sums floats with atomics by default, DeepSeek sparse attention's key gradients
(fmoe.ops.sparse_attention), and under deterministic algorithms sums them by key instead;
the others never do (the routing, unpermute and grouped-GEMM backwards are gathers or
per-expert loops; the aux-score counts' atomics add integers), and the model's
embedding backward uses F.embedding, whose CPU kernel sums in a fixed order where
indexing (`weight[ids]`) does not. Runs are then identical on the same machine, thread
count and library versions; across machines or thread counts they may still differ in the
last bits (a different blocking of a matmul).

Stopping. A job scheduler ends a job at its wall-clock limit, or earlier to make room (a
preemption), after a signal: SIGTERM, then SIGKILL some seconds later (SLURM's KillWait,
Kubernetes' grace period, torchrun's 30 s after it passes SIGTERM on to its workers), or a
signal asked for ahead of the limit (SLURM's --signal=USR1@300). StopRequests notes such a
signal, or a time limit passing, so that the loop stops at the end of its step with a
checkpoint, and --resume continues the run from there. The handler only notes the first
signal (nothing is cut in the middle: a step, a collective, a checkpoint's write). The same
signal again within 5 s is the same request: SLURM signals every process of a job step, and
torchrun passes the signal it got on to its ranks, so under `srun torchrun` (or scancel, or
a time limit) each rank gets it twice, milliseconds apart. A second signal after that acts
as the handler that was there before would (SIGTERM: the process ends), once the process
runs Python again: a rank waiting in a collective is ended by the launcher's SIGKILL
(torchrun's 30 s, SLURM's KillWait). Ranks can receive the signal at different moments: the loop sums
the requests over the ranks with the step's other logged values, so every rank stops after
the same step.
"""

from __future__ import annotations

import argparse
import difflib
import fcntl
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import fmoe
from fmoe.ops.checks import MissingExtra, check_path


def set_deterministic(enabled: bool = True) -> None:
    """Deterministic kernels for everything torch runs (module docstring); False turns torch's
    deterministic algorithms and cuDNN's deterministic mode off again. cudnn.benchmark stays
    off either way, and CUBLAS_WORKSPACE_CONFIG stays set (it only fixes cuBLAS's workspace)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False


def _git_state(package: Path) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD, whether tracked files differ from it) of the git checkout whose top level holds
    `package` (fmoe's source tree) as tracked files, or (None, None): a package installed inside
    another repository (a project's .venv, or `pip install --target` at its top level) is not
    its checkout."""
    try:
        run = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    lines = run.stdout.split("\n")
    if run.returncode != 0 or len(lines) < 2 or Path(lines[0]).resolve() != package.parent:
        return None, None
    try:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", "__init__.py"], cwd=package, capture_output=True,
                                 timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        tracked = False
    if not tracked:
        return None, None
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=package.parent, capture_output=True,
                                text=True, timeout=30)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return lines[1].strip(), dirty


_LAUNCH_ENV = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "SLURM_JOB_ID")  # recorded where set


def run_info() -> dict:
    """torch, triton and fmoe versions, the git commit of fmoe's source tree and whether its
    tracked files differ from it (both None outside a git checkout of fmoe's own: installed
    inside another repository, a project's .venv, too), Python, the host, the working
    directory (what relative paths among the knobs are relative to), whether CUDA is
    available (and which GPU), the command line (sys.argv), torch's CPU threads (a
    --deterministic run is the same on the same thread count), the launcher's variables that
    are set (world size, torchrun's run id, OMP_NUM_THREADS, SLURM's job id) and the UTC time."""
    import datetime

    import triton

    commit, dirty = _git_state(Path(fmoe.__file__).resolve().parent)
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fmoe": fmoe.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "host": platform.node(),
        "cwd": os.getcwd(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "argv": list(sys.argv),
        "threads": torch.get_num_threads(),
        "env": {name: os.environ[name] for name in _LAUNCH_ENV if name in os.environ},
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def strict_json(value):
    """value with each non-finite float (a knob such as --clip=inf) as its NON_FINITE string,
    in the dicts, lists and tuples it holds: Python's json wrote Infinity and NaN, which strict
    JSON readers (jq, JavaScript, most languages' parsers) refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class OutDirInUse(ValueError):
    """Another run holds the out_dir (OutDirLock)."""


def _flock_holder(path: Path) -> Optional[int]:
    """The pid of this machine's process that holds an flock on `path` (Linux's /proc/locks,
    by the directory's device and inode), or None where it cannot be told (another system, a
    holder on another machine of a network file system)."""
    try:
        st = path.stat()
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
                return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


class OutDirLock:
    """Holds out_dir (made if missing) for a run while this object lives, or until release():
    an exclusive flock on the directory itself (no file added to it; the kernel drops the lock
    when the process ends, a SIGKILL included). OutDirInUse (a ValueError, the refusal to
    say) when another holder has it: another run, or another lock of this process. Two runs in
    one out_dir (a second started, or a --resume while the run goes on) wrote their
    checkpoints and metrics over each other's, and a resume's cleanup removed the other's
    checkpoint as it was written. The lock is seen by every process of one machine; a network
    file system passes it on only where it supports flock. A directory the lock made is
    removed again at release where it is still empty (a run refused before writing anything
    leaves no out_dir behind). A ValueError naming the directory where it cannot be made or
    written (a read-only file system, no permission, a file of that name): found at the start,
    not at the run's first write, after its data and weights were read."""

    def __init__(self, out_dir):
        self._fd: Optional[int] = None
        self._made = False  # before the path is checked: a refused one is released (__del__) too
        path = Path(check_path("out_dir", out_dir))
        if not str(out_dir):  # Path("") is the working directory: a run would fill it
            raise ValueError("--out_dir: expected a directory, got '' (the working directory: give it as '.')")
        self._path, self._made = path, not path.exists()
        if path.exists() and not path.is_dir():
            raise ValueError(f"--out_dir: {out_dir} exists and is not a directory")
        for doing, act in (("made", lambda: path.mkdir(parents=True, exist_ok=True)),
                           ("written", lambda: tempfile.TemporaryFile(dir=path).close())):  # a read-only mount passes mkdir and flock
            try:
                act()
            except OSError as err:
                self.release()
                raise ValueError(f"--out_dir: {out_dir} cannot be {doing}: {err.strerror or err}") from None
        self._fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(path)
            self.release()
            if holder == os.getpid():  # "another run (pid <its own>)" named this process as another run
                raise OutDirInUse(f"--out_dir: {out_dir} is in use: this process holds it (another OutDirLock of it, not "
                                  "released): release() that one first, or give another --out_dir") from None
            raise OutDirInUse(f"--out_dir: {out_dir} is in use: another run {'' if holder is None else f'(pid {holder}) '}is writing it "
                              "(it holds the directory until it ends); wait for it to end, or give another --out_dir") from None

    def release(self) -> None:
        if self._made:  # removed while still held: unlocked first, another run could take it and lose it to the rmdir
            self._made = False
            try:
                self._path.rmdir()  # only where nothing was written into it
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None

    def __del__(self):
        self.release()


def refuse_link(path) -> None:
    """A ValueError naming `path`, a file a run writes itself (config.json, metrics.jsonl),
    where it is a link: a run directory from elsewhere would have the run's writes go through
    it into any file of this machine (--resume emptied a shell's rc file and wrote metrics in)."""
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"out_dir: {str(path)!r} is a link (to {os.readlink(path)!r}); a run writes its own {path.name}: remove the link")


def saved_config(out_dir) -> dict:
    """The record <out_dir>/config.json holds (write_config's), or {} where there is none or
    it is not a JSON object (a damaged file, another program's)."""
    try:
        record = json.loads((Path(out_dir) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def write_config(out_dir, config: dict, **extra) -> Path:
    """Write <out_dir>/config.json: {"config": config, **extra, "run": run_info()} (config:
    every knob, e.g. dataclasses.asdict of the loop's Config), strict JSON: a non-finite
    float is written as the string "inf", "-inf" or "nan" (NON_FINITE; float() reads each
    back). Where config.json already holds a run (a resumed run writes it again), that run's
    record is kept, with those before it, in "earlier_runs" (oldest first): which code,
    machine and knobs (its "config") trained each segment. Returns the path."""
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict of knobs, got {type(config).__name__}")
    out_dir = Path(check_path("out_dir", out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.json"
    refuse_link(path)
    before, earlier = saved_config(out_dir), []
    if isinstance(before.get("run"), dict):
        kept = before.get("earlier_runs")
        # the segment's knobs too: a resume with another --lr (or a default it left out) kept no trace of the earlier one's
        earlier = [*(kept if isinstance(kept, list) else []), {**before["run"], "config": before.get("config")}]
    record = {"config": config, **extra, "run": run_info(), **({"earlier_runs": earlier} if earlier else {})}
    record = json.loads(json.dumps(record, default=str))  # default's strings first
    path.write_text(json.dumps(strict_json(record), indent=2, allow_nan=False) + "\n")
    return path


def run_path(run: dict, path) -> Path:
    """A path knob of a run's config.json (e.g. config.init_from_hf) as the run read it: a
    relative one is relative to the directory the run started in (run_info's cwd, recorded
    under "run"), wherever this reads it; an absolute one, or a config without the record,
    as it is.

    >>> str(run_path({"run": {"cwd": "/data/runs"}}, "hf/qwen3")), str(run_path({}, "hf/qwen3"))
    ('/data/runs/hf/qwen3', 'hf/qwen3')
    """
    check_path("path", path)
    record = run.get("run") if isinstance(run, dict) else None
    cwd = record.get("cwd") if isinstance(record, dict) else None
    return Path(cwd, path) if isinstance(cwd, str) and cwd else Path(path)


# a process cannot catch these: no handler can note them
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def _signal(name) -> signal.Signals:
    sig = getattr(signal, name, None) if isinstance(name, str) and name.startswith("SIG") else None
    if not isinstance(sig, signal.Signals) or name in _UNCATCHABLE:
        raise ValueError(f"signals: expected names of signals a process can catch (e.g. SIGTERM, SIGUSR1), got {name!r}")
    return sig


class StopRequests:
    """Requests to stop a run at the end of its step: the first of `signals` received, or
    `minutes` passed since `start` (module docstring).

    Args:
        signals: signal names, e.g. ("SIGTERM", "SIGUSR1"); () for none.
        minutes: the time limit, > 0; 0 for none.
        start: time.monotonic() at the start the limit counts from (default: now).
        repeat_seconds: a signal again within this many seconds of its first arrival is the
            same request, ignored (module docstring); a later one acts as before. >= 0.

    Use as a context manager: entering installs the handlers (from the main thread only, as
    Python requires), leaving puts the previous ones back. reason() is None until a stop is
    requested, then the signal's name or the time limit, e.g. "SIGTERM" or "the time limit of
    90 minutes"; under torchrun (TORCHELASTIC_RUN_ID set) also its launcher's end: the
    torchrun process that started this rank (its parent when made) is gone, killed without
    passing a signal on (SIGKILL, the OOM killer), where its ranks trained on as orphans to
    the end of the run.
    """

    def __init__(self, signals: Sequence[str] = ("SIGTERM", "SIGUSR1"), minutes: float = 0.0, *, start: Optional[float] = None,
                 repeat_seconds: float = 5.0):
        if not isinstance(signals, (list, tuple)) or not all(isinstance(name, str) for name in signals):
            raise ValueError(f"signals: expected a sequence of signal names like ('SIGTERM', 'SIGUSR1'), got {signals!r}")
        self._signals = list(dict.fromkeys(_signal(name) for name in signals))
        if not _finite(minutes) or minutes < 0:
            raise ValueError(f"minutes: expected a time limit in minutes >= 0 (0: none), got {minutes!r}")
        self.minutes = float(minutes)
        if start is not None and not _finite(start):
            raise ValueError(f"start: expected time.monotonic() at the start (a finite number) or None, got {start!r}")
        self.start = time.monotonic() if start is None else float(start)
        if not _finite(repeat_seconds) or repeat_seconds < 0:
            raise ValueError(f"repeat_seconds: expected seconds >= 0 within which a signal again is the same request, got {repeat_seconds!r}")
        self.repeat_seconds = float(repeat_seconds)
        self.signal: Optional[str] = None  # the first signal received
        self._previous: dict = {}
        self._first: dict = {}  # signal -> time.monotonic() of its first arrival
        # a torchrun rank's launcher: when it dies (SIGKILL, the OOM killer) its ranks are orphans that trained on to the end
        self._launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None

    def __enter__(self) -> "StopRequests":
        if self._previous:  # entered twice: the inner exit would put back the outer's handler as "previous", and the outer none
            raise ValueError("StopRequests: already entered; it is not reentrant (leave it first, or make another)")
        try:
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._note)
        except ValueError as err:  # not the main thread
            self.__exit__()
            raise ValueError(f"StopRequests: signal handlers can only be installed from the main thread ({err})") from err
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        sig, now = signal.Signals(signum), time.monotonic()
        first = self._first.get(sig)
        if first is None:  # its first arrival
            self._first[sig] = now
            if self.signal is None:
                self.signal = sig.name
            return
        if now - first < self.repeat_seconds:  # the same request again (a launcher's copy of it)
            return
        previous = self._previous.get(sig)  # a second request acts as before
        handler = signal.SIG_DFL if previous is None else previous
        signal.signal(sig, handler)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(sig)

    def reason(self) -> Optional[str]:
        """Why the run should stop after this step, or None."""
        if self.signal is not None:
            return self.signal
        if self.minutes and time.monotonic() - self.start >= 60 * self.minutes:
            return f"the time limit of {self.minutes:g} minutes"
        if self._launcher is not None and os.getppid() != self._launcher:
            return f"its launcher's end (torchrun, pid {self._launcher}, is gone)"
        return None


_CONNECT_SECONDS = 5.0  # to torchrun's store, already up when the ranks start
_REFUSED = "rank 0 refused"  # the key rank 0 sets to its refusal, for the other ranks


def _launch_store():
    """The store of the torchrun launch this process is a rank of (its agent's TCPStore at
    MASTER_ADDR:MASTER_PORT, which torchrun names with TORCHELASTIC_USE_AGENT_STORE=True),
    its keys under this run and attempt; None outside one, or where it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=_CONNECT_SECONDS))
    except (KeyError, ValueError, RuntimeError):
        return None
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"fmoe.run_script/{attempt}", store)


def _rank_0_refusal(store, deadline: float) -> Optional[str]:
    """What rank 0 refused with, once it has (its key in the launch's store), or None if it has
    not by `deadline` (time.monotonic()), or the store has gone."""
    while True:
        try:
            if store.check([_REFUSED]):
                return store.get(_REFUSED).decode()
        except RuntimeError:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def run_script(main: Callable[[list[str]], None], argv: list[str], *, wait: float = 60.0) -> None:
    """main(argv), so that under torchrun a refusal is said once, not once per rank.

    A script refuses bad arguments with SystemExit(message) (`sys.exit("--knob: expected ...")`,
    or an ArgumentParser below), and every rank of a launch checks the same arguments. On
    rank 0, and outside torchrun (WORLD_SIZE unset or 1), main runs as it is; under torchrun
    rank 0 also leaves its refusal in the launch's store (the agent's TCPStore) before it
    exits. Another rank that refuses (SIGTERM's default action restored first) waits for
    rank 0's, however late its imports or checks come, up to `wait` seconds:
      - rank 0 refused with the same message: rank 0 says it, torchrun ends this rank with
        SIGTERM (or after another `wait`, it ends itself: status 1, not a word);
      - rank 0 refused otherwise, or not within `wait` (a file missing on one node's disk):
        this rank's refusal comes out.
    Without torchrun's store (another launcher setting RANK and WORLD_SIZE) such a rank holds
    its refusal back for `wait` seconds, for the launcher to end it once rank 0 has failed.
    A missing extra (fmoe.ops.checks.MissingExtra, naming its pip command) is such a refusal
    too: its message alone, not two chained tracebacks.
    Exit status 0 (SystemExit(None) or (0), a --help) and every other exception pass at once.
    A RANK or WORLD_SIZE in the environment that is no int is refused (SystemExit naming it).
    """
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
        raise ValueError(f"wait: expected seconds >= 0, got {wait!r}")
    try:
        rank, world = (_environ_int(name, default) for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")))
    except ValueError as err:  # a launcher's variable left in a shell: a refusal, not a traceback
        raise SystemExit(str(err)) from None
    try:
        try:
            main(argv)
        except MissingExtra as err:
            raise SystemExit(f"error: {err}") from None
    except SystemExit as stop:
        if world <= 1 or stop.code in (None, 0):
            raise
        if rank == 0:
            store = _launch_store()
            if store is not None:
                try:
                    store.set(_REFUSED, str(stop.code))
                except RuntimeError:
                    pass  # the store has gone: the other ranks say theirs after their wait
            raise
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a run's StopRequests may have noted SIGTERM instead
        deadline = time.monotonic() + wait
        store = _launch_store()
        if store is None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise
        if _rank_0_refusal(store, deadline) != str(stop.code):
            raise
        time.sleep(wait)
        raise SystemExit(1) from None


def every_rank(refusal: Optional[str], facts=None, differ: Optional[Callable[[list], str]] = None) -> tuple[Optional[str], list]:
    """What the ranks found about something each read itself (its data files, its own
    checkpoint file), in one all_gather_object over the default group, called by every rank:
    (the refusal of the first rank that made one, as "rank r: ..." where the ranks' refusals
    differ, else differ([facts of rank 0, rank 1, ...]) where the facts (hashable) differ,
    else None; [facts of rank 0, rank 1, ...]). The same on every rank: a refusal raised by
    one rank alone left the others waiting in their next collective. One process (no
    group): (refusal, [facts])."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return refusal, [facts]
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (refusal, facts))
    refused = [(rank, said) for rank, (said, _) in enumerate(views) if said is not None]
    every = [f for _, f in views]
    if refused:
        rank, said = refused[0]
        refusal = said if all(other == said for other, _ in views) else f"rank {rank}: {said}"
    elif differ is not None and len(set(every)) > 1:
        refusal = differ(every)
    return refusal, every


def per_rank(every: list, prefix: str = "") -> str:
    """Each rank's values of the keys in which the ranks' dicts (every: each rank's as sorted
    JSON) differ, as "rank 0: k=v, ...; rank 1: ..." (a key a rank lacks: "(not given)")."""
    given = [json.loads(e) for e in every]

    def value(g, k):
        return g.get(k, "(not given)")

    differ = [k for k in sorted({k for g in given for k in g}) if any(value(g, k) != value(given[0], k) for g in given)]
    return "; ".join(f"rank {r}: " + ", ".join(f"{prefix}{k}={value(g, k)}" for k in differ) for r, g in enumerate(given))


def command_line_facts(knobs: dict) -> str:
    """A rank's command-line knobs (name -> value) as every_rank compares them: sorted JSON."""
    return json.dumps(knobs, sort_keys=True, default=str)


def command_lines_differ(every: list) -> str:
    """The refusal for ranks whose command lines differ (every: each rank's command_line_facts)."""
    return (f"the ranks' command lines differ ({per_rank(every, '--')}): every rank must run the same one "
            "(torchrun: the same command on every node)")


def same_command_lines(knobs: dict) -> Optional[str]:
    """Under torch.distributed, called by every rank right after the process group starts:
    command_lines_differ's refusal where the ranks' knobs (name -> value; the paths each rank
    reads itself left out by the caller, their files compared by what they hold) differ, the
    same on every rank; None where they agree, and on one process. A rank given another
    setting trained or scored on without a word, or hung in a collective the others skipped."""
    return every_rank(None, command_line_facts(knobs), command_lines_differ)[0]


def unshared_dir(path, *, wait_seconds: float = 10.0) -> Optional[str]:
    """Under torch.distributed, called by every rank once rank 0 has made `path` (a run's
    out_dir): a refusal where some rank does not see a file rank 0 writes there (a node's own
    disk at the same path, where the run failed at its first checkpoint, the step directory
    rank 0 made missing on the other nodes), the same on every rank; None where every rank
    sees it, and on one process. A rank that does not see it at once looks again for up to
    wait_seconds (a network file system's caches). Rank 0 removes the file again."""
    import secrets
    import socket

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    names = [f".fmoe_shared_{secrets.token_hex(8)}" if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        (Path(path) / names[0]).touch()
    dist.broadcast_object_list(names, src=0)
    mark = Path(path) / names[0]
    deadline = time.monotonic() + wait_seconds
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    refusal, _ = every_rank(None if mark.exists() else (
        f"--out_dir: {path} on {socket.gethostname()} does not hold the file rank 0 wrote in it ({mark.name}): every rank must "
        "see the same out_dir, on a file system the nodes share, not a node's own disk"))
    if dist.get_rank() == 0:
        mark.unlink(missing_ok=True)
    return refusal


def raise_together(error: Optional[BaseException], facts=None, differ: Optional[Callable[[list], str]] = None) -> list:
    """every_rank for an exception a rank caught (None where it read well): `error` raised
    on every rank where any rank has one (another rank's refusal as a ValueError of its
    text, "rank r: ..."; facts that differ: a ValueError of differ's), else [facts of rank
    0, rank 1, ...]. Every rank calls it."""
    refusal, every = every_rank(None if error is None else str(error), facts, differ)
    if refusal is not None:
        if error is not None and str(error) == refusal:
            raise error
        raise ValueError(refusal)
    return every


def _finite(x) -> bool:
    """x is a finite int or float (not a bool); False for an int too large for a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range
        return False


def _environ_int(name: str, default: str) -> int:
    """The environment variable `name` (launchers set RANK, WORLD_SIZE) as an int, or a
    ValueError naming it."""
    value = os.environ.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an int in the environment (as torchrun sets it), got {value!r}") from None


def nearest(name: str, names: Sequence[str], n: int = 3) -> list[str]:
    """Up to n of `names` that a mistyped `name` may have meant: those it begins (in their
    order), then the closest by difflib's ratio (>= 0.6). E.g. "stepz" in ("seed", "steps")
    -> ["steps"]; "ffn" in ("hidden", "ffn_dense", "ffn_expert") -> ["ffn_dense", "ffn_expert"]."""
    if not isinstance(name, str):
        raise ValueError(f"name: expected a str, got {type(name).__name__}")
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(other, str) for other in names):
        raise ValueError(f"names: expected a sequence of str, got {names!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive int, got {n!r}")
    begun = [other for other in names if name and other.startswith(name)]
    return list(dict.fromkeys(begun + difflib.get_close_matches(name, names, n=n, cutoff=0.6)))[:n]


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors exit with SystemExit(usage + message), status 1,
    rather than writing to standard error first: run_script can then hold a rank's copy back.
    An unrecognized option gets the options it may have meant (nearest)."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:  # argparse's own message joins them with spaces: one quoted argument would read as several
            options = [option[2:] for action in self._actions for option in action.option_strings if option.startswith("--")]
            near = dict.fromkeys(f"--{option}" for arg in unknown if arg.startswith("--")
                                 for option in nearest(arg[2:].partition("=")[0], options))
            self.error(f"unrecognized arguments: {shlex.join(unknown)}" + (f"; did you mean {' or '.join(near)}?" if near else ""))
        return parsed

    def error(self, message: str):
        sys.exit(f"{self.format_usage()}{self.prog}: error: {message}")
