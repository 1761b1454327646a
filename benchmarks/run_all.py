"""Run every benchmark (and, with --gpu-tests, the `gpu` tests) in one go and append what they
print to a results file: the record a GPU session keeps in benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/run_all.py                          # CUDA: all, real shapes
    .venv/bin/python benchmarks/run_all.py --gpu-tests --only bench_routing,bench_rope
    .venv/bin/python benchmarks/run_all.py --smoke --results bench_out/RESULTS-smoke.md
    .venv/bin/python benchmarks/run_all.py --only bench_train_step --extra=--fp8   # a flag of one benchmark

Each benchmark (benchmarks/bench_*.py, or those named by --only) runs as its own process
with the flags given here (--smoke, --out, --profile, and --extra's: every benchmark gets
them all) under a wall-clock limit (--timeout seconds per benchmark), one after the other:
a failure or a timeout is recorded and the next one runs.
The results file gets one section per run: the date (UTC), the device (nvidia-smi's GPU
name, or "cpu (smoke)"), the torch, triton and CUDA versions, the commit when this is a git
checkout, the command line; then per benchmark its command, exit status, wall time and
everything it printed (stdout, then stderr when it wrote any), in a text block. With
--gpu-tests, `pytest -q -m gpu` runs first (TRITON_INTERPRET unset) and its last lines are
recorded the same way. The file is appended to, never rewritten: sessions add their runs.

Exit status: 0 when every part exited 0, else 1 (the file says which did not).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GPU_TEST_TAIL = 60  # lines of the pytest output kept
MAX_TIMEOUT = 7 * 24 * 3600  # a week, far beyond any benchmark: subprocess cannot wait inf or 1e10 s (OverflowError)


def benchmarks() -> list[str]:
    """The benchmark names, bench_<family> (file stems), sorted."""
    return sorted(p.stem for p in HERE.glob("bench_*.py"))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _command_output(cmd: list[str]) -> str:
    """What cmd prints, stripped, or "" when it cannot run or fails."""
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def environment(smoke: bool) -> dict[str, str]:
    """Date, device and versions for the section header (no torch import: a child's job)."""
    gpus = _command_output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    cuda = _command_output([sys.executable, "-c", "import torch; print(torch.version.cuda)"])
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"]) or "not a git checkout"
    if _command_output(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " with uncommitted changes"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": "cpu (smoke)" if smoke else (gpus.replace("\n", "; ") or "no GPU found by nvidia-smi"),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "cuda": cuda if cuda not in ("", "None") else "none",
        "commit": commit,
    }


def shown(cmd: list[str]) -> str:
    """cmd as a shell line, paths inside the repository relative to its root."""
    root = str(ROOT) + os.sep
    return " ".join(shlex.quote(c[len(root):] if c.startswith(root) else c) for c in cmd)


def run_part(cmd: list[str], timeout: float, env: dict) -> dict:
    """Run cmd from the repository root: exit status (None: timed out), seconds, output."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        status = None
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    return {"status": status, "seconds": time.perf_counter() - start, "stdout": out, "stderr": err}


def section(title: str, cmd: list[str], result: dict, timeout: float, tail: int | None = None) -> str:
    """The Markdown of one part: its command, status, time and output."""
    status = f"timed out after {timeout:g} s" if result["status"] is None else f"exit {result['status']}"
    text = result["stdout"].rstrip()
    if result["stderr"].strip():
        text += ("\n" if text else "") + "--- stderr ---\n" + result["stderr"].rstrip()
    if tail is not None:
        lines = text.splitlines()
        text = "\n".join((["[... the first %d lines left out]" % (len(lines) - tail)] if len(lines) > tail else []) + lines[-tail:])
    return f"### {title}\n\n`{shown(cmd)}`: {status}, {result['seconds']:.1f} s\n\n```text\n{text}\n```\n\n"


def default_results(smoke: bool) -> Path:
    """The results file run_all appends to without --results: the record of GPU runs,
    benchmarks/RESULTS.md; a smoke run's (CPU, tiny shapes: no performance numbers) goes to
    the untracked bench_out/RESULTS-smoke.md instead (it was appended to the record)."""
    return ROOT / "bench_out" / "RESULTS-smoke.md" if smoke else HERE / "RESULTS.md"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.strip().split("\n\n")[0].split()))
    parser.add_argument("--smoke", action="store_true", help="each benchmark's --smoke mode (CPU, tiny shapes; times are not performance numbers)")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names (bench_routing,...) instead of all")
    parser.add_argument("--timeout", type=float, default=600.0, help=f"seconds each benchmark may run (default 600, at most {MAX_TIMEOUT}: a week)")
    parser.add_argument("--gpu-tests", action="store_true", help="run `pytest -q -m gpu` first and record its summary")
    parser.add_argument("--results", type=Path, default=None, help="the Markdown file appended to (default benchmarks/RESULTS.md, the "
                                                                    "record; with --smoke bench_out/RESULTS-smoke.md in the repository root)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out",
                        help="where the benchmarks write their CSVs, relative to the current directory as --results is "
                             "(default: bench_out in the repository root)")
    parser.add_argument("--profile", action="store_true", help="each benchmark's --profile: a torch.profiler trace and ops table of "
                                                              "every timed call, in OUT/profile/")
    parser.add_argument("--extra", default="", help="more flags for every benchmark run, one string (a flag only one benchmark takes "
                                                    "needs --only it: --only bench_train_step --extra=--fp8, its fp8 run)")
    args = parser.parse_args(argv)
    names = benchmarks()
    if args.only is not None and not args.only.strip(", "):
        parser.error(f"--only: expected comma-separated benchmark names, got {args.only!r} (leave the flag out to run them all)")
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"--only: unknown benchmarks {unknown}; expected some of {', '.join(names)}")
    if not 0 < args.timeout <= MAX_TIMEOUT:  # nan too
        parser.error(f"--timeout: expected a positive number of seconds, at most {MAX_TIMEOUT} (a week), got {args.timeout:g}")
    if args.results is None:
        args.results = default_results(args.smoke)
    if args.results.is_dir():
        parser.error(f"--results: expected a file to append to, got the directory {str(args.results)!r}")
    try:
        extra = shlex.split(args.extra)
    except ValueError as err:
        parser.error(f"--extra: expected flags as a shell splits them, got {args.extra!r} ({err})")

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --smoke sets it; GPU runs compile
    # the children import this checkout's fmoe, whatever the environment installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    info = environment(args.smoke)
    header = (f"## {info['date']}: {info['device']}\n\n"
              f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, commit {info['commit']}; "
              f"`{shown([sys.executable, str(Path(__file__).resolve()), *argv])}`\n\n")
    if args.smoke:
        header += "SMOKE RUN: CPU, tiny shapes; the times are NOT performance numbers.\n\n"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        f.write(header)
    print(header, end="", flush=True)

    failed = []
    parts = []
    if args.gpu_tests:
        parts.append(("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], GPU_TEST_TAIL))
    for name in chosen:
        # the children run in the repository root: they get --out as an absolute path
        flags = ["--out", str(args.out.absolute())] + (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else []) + extra
        parts.append((name, [sys.executable, str(HERE / f"{name}.py"), *flags], None))
    for title, cmd, tail in parts:
        print(f"== {title}", flush=True)
        result = run_part(cmd, args.timeout, env)
        text = section(title, cmd, result, args.timeout, tail)
        with args.results.open("a") as f:  # written as each part ends: a later timeout keeps it
            f.write(text)
        print(text, end="", flush=True)
        if result["status"] != 0:
            failed.append(title)
    summary = f"All {len(parts)} parts exited 0.\n\n" if not failed else f"Did not exit 0: {', '.join(failed)}.\n\n"
    with args.results.open("a") as f:
        f.write(summary)
    print(summary, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
