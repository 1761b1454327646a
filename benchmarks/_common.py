"""Helpers shared by the benchmark scripts (benchmarks/bench_<family>.py).

Import this module before torch, triton or fmoe: with `--smoke` on the command line it sets
TRITON_INTERPRET=1, which Triton reads once, when it is first imported, so that the kernels
run on CPU through the interpreter.

Every script: `--smoke` (CPU, tiny shapes, checks that the code runs; its times are not
performance numbers), `--out DIR` (where the CSV goes, default bench_out/) and `--profile`
(after each timing, one more call of the timed function under torch.profiler: its Chrome
trace in OUT/profile/<benchmark>-<label>.json and its ops by self time, the device's on
CUDA, appended to OUT/profile/<benchmark>.txt; the timings are taken before, unprofiled).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402  (after TRITON_INTERPRET is decided)
import triton.testing  # noqa: E402

from fmoe.train.profile import activities, ops_table  # noqa: E402


def base_parser(description: str) -> argparse.ArgumentParser:
    """Argument parser with the flags every benchmark takes; scripts may add their own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--smoke", action="store_true",
        help="run on CPU with tiny shapes, Triton kernels through the interpreter "
             "(checks the script runs; the times are not performance numbers)",
    )
    parser.add_argument("--out", default="bench_out", help="directory for the CSV (default: bench_out)")
    parser.add_argument("--profile", action="store_true",
                        help="after each timing, profile one more call with torch.profiler: OUT/profile/<benchmark>-<label>.json "
                             "(Chrome traces) and OUT/profile/<benchmark>.txt (each call's ops by self time)")
    return parser


_PROFILE: dict = {}  # with --profile: "dir" (OUT/profile) and the labels used so far


def bench_device(smoke: bool) -> torch.device:
    """CPU for --smoke, else CUDA (exits with a hint when there is none)."""
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the benchmark needs a GPU; use --smoke to run it on CPU")
    return torch.device("cuda")


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu (smoke)"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"


def bench(fn, device: torch.device, cpu_warmup: int = 1, cpu_repeats: int = 3, *, label: Optional[str] = None) -> float:
    """Median time of fn() in milliseconds.

    CUDA: triton.testing.do_bench (it flushes the L2 cache between calls). CPU:
    cpu_warmup untimed calls, then the median of cpu_repeats calls timed with perf_counter.
    With --profile, one more call is then profiled under `label` (profile_call); a timing
    without a label (the copy-bandwidth and matmul-rate probes) is not.
    """
    if device.type == "cuda":
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    else:
        for _ in range(cpu_warmup):
            fn()
        times = []
        for _ in range(cpu_repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
    if _PROFILE and label is not None:
        profile_call(fn, device, label)
    return ms


def profile_call(fn, device: torch.device, label: str) -> Path:
    """One call of fn() under torch.profiler (CPU, and CUDA on a GPU): its Chrome trace to
    OUT/profile/<benchmark>-<label>.json (a label used twice gets _2, _3, ...), its ops by
    self time appended to OUT/profile/<benchmark>.txt under the label. Returns the trace."""
    benchmark = Path(sys.argv[0]).stem
    slug = re.sub(r"[^A-Za-z0-9_.+=-]+", "_", label).strip("_") or "call"
    uses = _PROFILE["labels"][slug] = _PROFILE["labels"].get(slug, 0) + 1
    slug += f"_{uses}" if uses > 1 else ""
    with torch.profiler.profile(activities=activities(device.type), record_shapes=True) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    trace = _PROFILE["dir"] / f"{benchmark}-{slug}.json"
    prof.export_chrome_trace(str(trace))
    with (_PROFILE["dir"] / f"{benchmark}.txt").open("a") as f:
        f.write(f"== {label or slug} ({trace.name})\n{ops_table(prof, device.type, row_limit=25)}\n")
    return trace


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a same-device copy of an nbytes bf16 tensor (read + write)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / (ms * 1e-3)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in dtype, measured now (the rate MFU is a fraction of)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (bench(lambda: a @ b, device) * 1e-3)


def cuda_peak_bytes(fn, device: torch.device):
    """Bytes the CUDA allocator held at its peak while fn() ran, above what it held before
    (one extra, untimed call); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def floor_fraction(nbytes: int, bandwidth: float, ms: float) -> float:
    """Time to move nbytes at the copy bandwidth over the measured time (1.0: at the floor)."""
    return nbytes / bandwidth * 1e3 / ms


def timing_row(case: str, pass_name: str, ms: dict, name: str) -> dict:
    """The first cells of a row of the fused-vs-baselines tables: case, pass, impl, ms, and
    on the fused row its speedups over "eager" and "compiled" (ms: impl -> median ms; without
    a "compiled" entry that speedup is left empty)."""
    fused = name == "fused"
    return {"case": case, "pass": pass_name, "impl": name, "ms": ms[name],
            "speedup_vs_eager": ms["eager"] / ms["fused"] if fused else None,
            "speedup_vs_compiled": ms["compiled"] / ms["fused"] if fused and "compiled" in ms else None}


def case_done(rows: list[dict], columns: list[str]) -> None:
    """Print one case's rows at once, so that a run stopped by a time limit (a GPU lease)
    keeps what it measured; finish() prints every case's rows together at the end."""
    print_table(rows, columns)
    print(flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The error of a against b relative to b, in norm (float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print the given columns of rows as an aligned text table (numbers right-aligned)."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row.get(c), (int, float, type(None))) for row in rows) for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line(columns))
    print(line(["-" * w for w in widths]))
    for r in cells:
        print(line(r))


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write rows (dicts; columns in order of first appearance) as CSV, creating the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def start(description: str, add_arguments=None):
    """The common start of a benchmark's main: parse the flags (add_arguments(parser) adds a
    script's own), pick the device, print it (and the smoke warning), seed, and measure the
    copy bandwidth.

    Returns (args, device, dtype, bandwidth): dtype is float32 for --smoke, else bfloat16;
    bandwidth in bytes per second.
    """
    parser = base_parser(description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    device = bench_device(args.smoke)
    if args.profile:
        _PROFILE.update(dir=Path(args.out) / "profile", labels={})
        _PROFILE["dir"].mkdir(parents=True, exist_ok=True)
        (_PROFILE["dir"] / f"{Path(sys.argv[0]).stem}.txt").unlink(missing_ok=True)  # this run's tables only
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    print(f"device: {device_name(device)}")
    if args.smoke:
        print("SMOKE RUN: CPU, Triton interpreter, tiny shapes; checks that the benchmark runs. "
              "The times below are NOT performance numbers (and CPU peak memory is not measured).")
    copy_bytes = (64 << 20) if args.smoke else (1 << 30)
    bandwidth = copy_bandwidth(device, copy_bytes)
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (copy of {copy_bytes >> 20} MiB, read + write)", flush=True)
    return args, device, dtype, bandwidth


def finish(args, device: torch.device, bandwidth: float, name: str, tables: list, **columns) -> None:
    """Write every table's rows to OUT/<name>.csv, with the device, the copy bandwidth and
    `columns` on each row, then print the tables (the last one last).

    tables: [(rows, printed columns), ...].
    """
    rows = [row for table, _ in tables for row in table]
    for row in rows:
        row.update(device=device_name(device), copy_GBps=bandwidth / 1e9, **columns)
    path = Path(args.out) / f"{name}.csv"
    write_csv(path, rows)
    print(f"wrote {path}")
    for table, printed in tables:
        print()
        print_table(table, printed)
