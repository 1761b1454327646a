"""Helpers shared by the benchmark scripts (benchmarks/bench_<family>.py).

Import this module before torch, triton or fmoe: with `--smoke` on the command line it sets
TRITON_INTERPRET=1, which Triton reads once, when it is first imported, so that the kernels
run on CPU through the interpreter.

Every script: `--smoke` (CPU, tiny shapes, checks that the code runs; its times are not
performance numbers), `--out DIR` (where the CSV goes, default bench_out/) and `--profile`
(after each timing, one more call of the timed function under torch.profiler: its Chrome
trace in OUT/profile/<benchmark>-<label>.json and its ops by self time, the device's on
CUDA, appended to OUT/profile/<benchmark>.txt; the timings are taken before, unprofiled).

Two times per call on CUDA. bench(): the median of at least 5 calls (do_bench's method, more
calls where do_bench's 100 ms would time fewer than 5), events around each call and
nothing queued ahead of them, so a call costs whichever side is slower: for small ops, whose
host cost per call (custom-op dispatch, autograd, Triton's launcher: 100-250 us) exceeds
their kernels', the device waits for each launch and the time is the host's. device_ms():
the same calls queued behind a GPU sleep, which the device then runs back to back: its own
time per call, as inside a busy training step or a CUDA graph, where the host is ahead.
Bytes-floor fractions of small ops are judged on the latter (device_columns: a row's
device_ms and device_floor_fraction cells; empty on CPU).
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

from fmoe.train.profile import activities, ops_table  # noqa: E402


def summary(doc: str) -> str:
    """A module docstring's first paragraph on one line: what --help says the script does."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def base_parser(description: str) -> argparse.ArgumentParser:
    """Argument parser with the flags every benchmark takes; scripts may add their own.
    description: the script's docstring (its first paragraph is shown). Flags are taken whole,
    not abbreviated: SMOKE reads "--smoke" from sys.argv before the parser runs."""
    parser = argparse.ArgumentParser(description=summary(description), allow_abbrev=False)
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


SLOW_MS = 250.0  # bench(): a warm CUDA call this slow skips the 5-call estimate and its warm-up: MIN_SAMPLES timed calls
MIN_SAMPLES = 5  # bench(): every CUDA time is the median of at least this many timed calls
WARMUP_MS, REP_MS = 25.0, 100.0  # bench(): do_bench's defaults, the milliseconds of untimed and of timed calls


def cuda_plan(estimate_ms: float) -> tuple[int, int]:
    """(untimed warm-up calls, timed calls) of bench() on CUDA for a call of about estimate_ms:
    do_bench's (WARMUP_MS of warm-up, REP_MS of timed calls: max(1, int(25 / estimate)) and
    int(100 / estimate)), but never fewer than MIN_SAMPLES timed calls (do_bench timed ONE
    call of 50 ms or more); a call of SLOW_MS or more gets no more warm-up (bench() already
    ran it twice) and exactly MIN_SAMPLES timed calls, so that its cost stays bounded."""
    if estimate_ms >= SLOW_MS:
        return 0, MIN_SAMPLES
    estimate_ms = max(estimate_ms, 1e-4)
    return max(1, int(WARMUP_MS / estimate_ms)), max(MIN_SAMPLES, int(REP_MS / estimate_ms))


def _l2_flush(device: torch.device) -> torch.Tensor:
    """256 MB that bench() zeroes before each timed call: flushes the L2 cache, as do_bench's buffer does."""
    return torch.empty(256 << 18, dtype=torch.int32, device=device)


def bench(fn, device: torch.device, cpu_warmup: int = 1, cpu_repeats: int = 3, *, label: Optional[str] = None) -> float:
    """Median time of fn() in milliseconds.

    CUDA: the median of at least MIN_SAMPLES = 5 timed calls, for any call length, each timed
    by events around it from its launch, behind a zeroed 256 MB buffer that flushes the L2
    cache (outside the events), as triton.testing.do_bench does: where the host's cost of a
    call exceeds the device's, the time is the host's (device_ms gives the device's). How
    many: one untimed call (compiles, autotunes), one timed by the host (the estimate); a
    call under SLOW_MS is then estimated again as do_bench does (5 calls behind their flush,
    between two events), warmed for WARMUP_MS and timed for REP_MS, at least MIN_SAMPLES
    calls (cuda_plan); a call of SLOW_MS or more (a token-by-token reference, a whole train
    step) is timed exactly MIN_SAMPLES times, with no more warm-up: MIN_SAMPLES + 2 calls in
    all. (do_bench's own count, int(100 / estimate) calls, gave a "median" of one sample for
    a call of 50 ms or more.) CPU (--smoke, whose times are not performance numbers):
    cpu_warmup untimed calls, then the median of cpu_repeats calls timed with perf_counter.
    With --profile, one more call is then profiled under `label` (profile_call); a timing
    without a label (the copy-bandwidth and matmul-rate probes) is not.
    """
    if device.type == "cuda":
        fn()  # compiles, autotunes
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate = (time.perf_counter() - start) * 1e3
        flush = _l2_flush(device)  # freed on return, as do_bench's
        if estimate < SLOW_MS:  # do_bench's estimate: 5 calls, each behind its flush
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            for _ in range(5):
                flush.zero_()
                fn()
            last.record()
            torch.cuda.synchronize()
            estimate = first.elapsed_time(last) / 5
        n_warmup, n_timed = cuda_plan(estimate)
        for _ in range(n_warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_timed)]
        for begin, end in events:
            flush.zero_()
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        ms = statistics.median(begin.elapsed_time(end) for begin, end in events)
        del flush
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


class HostBehind(RuntimeError):
    """device_ms could not queue its calls ahead of the device."""


_FLUSH: Optional[torch.Tensor] = None  # 256 MB zeroed before each call: flushes the L2 cache, as do_bench does
_SLEEP_CYCLES_PER_MS: Optional[float] = None  # torch.cuda._sleep's clock cycles per ms, measured once


def _sleep_cycles_per_ms() -> float:
    """Clock cycles per ms of torch.cuda._sleep (a GPU spin of so many cycles), measured on
    10**7 cycles (about 6 ms at 1.7 GHz) after one untimed sleep has raised the clocks."""
    global _SLEEP_CYCLES_PER_MS
    if _SLEEP_CYCLES_PER_MS is None:
        cycles = 10**7
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS = cycles / start.elapsed_time(end)
    return _SLEEP_CYCLES_PER_MS


def device_ms(fn, device: torch.device, *, calls: int = 50, probe: int = 3, tries: int = 3) -> Optional[float]:
    """Median device time of fn() in ms with the host queued ahead (None off CUDA).

    What it measures: the device's own time per call, as inside a busy training step or a
    CUDA graph, where the host runs ahead; bench()'s time includes the host's cost where the
    host is the slower side. How: one untimed call; the host's time to queue one call
    ([zero the L2-flush buffer, event, fn(), event], `probe` calls, unsynchronized); then a GPU
    sleep of 1.5x the host's time for `calls` calls (+ 1 ms), an event after it, and the calls,
    each between two events behind its L2 flush. The device reaches them only after the sleep,
    so when the sleep is still running once all are queued (its event not yet reached), the
    device runs them back to back and their events time the device alone.

    fn may run autograd (nothing is captured, only queued) but must not synchronize the host:
    when the sleep ends before the calls are queued, it retries with a 4x longer sleep and half
    the calls (a full launch queue, about a thousand kernels, blocks the host too), and raises
    HostBehind (a RuntimeError) after `tries`.
    """
    if device.type != "cuda":
        return None
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 18, dtype=torch.int32, device=device)  # 256 MB
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]

    def enqueue(n):
        for start, end in events[:n]:
            _FLUSH.zero_()
            start.record()
            fn()
            end.record()

    fn()
    torch.cuda.synchronize()
    probe = min(probe, calls)
    begin = time.perf_counter()
    enqueue(probe)
    host_ms = (time.perf_counter() - begin) * 1e3 / probe
    torch.cuda.synchronize()
    sleep_ms, cycles_per_ms = 1.5 * host_ms * calls + 1.0, _sleep_cycles_per_ms()
    for attempt in range(tries):
        if attempt:
            sleep_ms, calls = 4 * sleep_ms, max(calls // 2, 1)
        after_sleep = torch.cuda.Event()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        after_sleep.record()
        enqueue(calls)
        behind = after_sleep.query()  # the device reached the calls before the host had queued them all
        torch.cuda.synchronize()
        if not behind:
            return statistics.median(start.elapsed_time(end) for start, end in events[:calls])
    raise HostBehind(
        f"expected the host to queue the calls before the device finished a sleep ahead of them; in {tries} tries "
        f"(the last: {calls} calls behind {sleep_ms:.3g} ms, the host's estimate {host_ms:.3g} ms per call) "
        f"the device caught up: fn synchronizes with the host (.item(), .tolist(), nonzero, a copy to the CPU) "
        f"or the host is too slow to run ahead"
    )


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


def device_columns(fn, device: torch.device, bandwidth: float, nbytes: Optional[int] = None) -> dict:
    """A row's device_ms (device_ms(fn)) and device_floor_fraction (nbytes at the copy
    bandwidth over device_ms; empty without nbytes) cells; both empty off CUDA. Where fn
    cannot be queued ahead (HostBehind) they are empty too and the reason is printed: the
    rest of the run goes on."""
    try:
        ms = device_ms(fn, device)
    except HostBehind as err:
        print(f"device_ms left empty: {err}", flush=True)
        ms = None
    fraction = floor_fraction(nbytes, bandwidth, ms) if ms is not None and nbytes else None
    return {"device_ms": ms, "device_floor_fraction": fraction}


def timing_row(case: str, pass_name: str, ms: dict, name: str) -> dict:
    """The first cells of a row of the fused-vs-baselines tables: case, pass, impl, ms, and
    on the fused row its speedups over "eager" and "compiled" (ms: impl -> median ms; a
    baseline without an entry, not timed, leaves its speedup empty)."""
    return {"case": case, "pass": pass_name, "impl": name, "ms": ms[name],
            **{f"speedup_vs_{base}": ms[base] / ms[name] if name == "fused" and base in ms else None for base in ("eager", "compiled")}}


def case_done(rows: list[dict], columns: list[str]) -> None:
    """Print one case's rows at once, so that a run stopped by a time limit (a GPU lease)
    keeps what it measured; finish() prints every case's rows together at the end."""
    print_table(rows, columns)
    print(flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The error of a against b relative to b, in norm (float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_agree(case: str, got: dict, names: tuple[str, str], dtype: torch.dtype, what: str = "") -> None:
    """Exit unless got[a] and got[b] (tuples of tensors: an output and its gradients) agree
    within 1e-4 in float32, 2e-2 in bf16 (the largest rel_err); print the check otherwise."""
    a, b = names
    if len(got[a]) != len(got[b]):  # zip would check the shorter one's tensors alone, without a word
        sys.exit(f"{case}: {a} gave {len(got[a])} tensors and {b} {len(got[b])}; nothing to compare them by")
    worst = max(rel_err(x, y) for x, y in zip(got[a], got[b]))
    if worst > (1e-4 if dtype == torch.float32 else 2e-2):
        sys.exit(f"{case}: {a} and {b} disagree (relative error {worst:.3g})")
    print(f"{case}: checked ({a} vs {b}{what}, relative error {worst:.2g}); timing", flush=True)


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
    try:  # made now: a file in the way failed as the CSV was written, after every timing and before the table
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: expected a directory for the CSV, got {args.out!r} ({err.strerror})")
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


def select(names: list[str], spec: Optional[str], flag: str, groups: Optional[dict[str, list[str]]] = None) -> list[str]:
    """The names that a flag's value picks, in the order of names: spec is comma-separated,
    each item a name or a key of groups (all of that group's names); None picks them all.
    Raises a ValueError naming the flag and the known choices for an unknown or empty pick."""
    if spec is None:
        return list(names)
    groups = groups or {}
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    known = sorted(set(names) | set(groups))
    if not wanted or any(w not in known for w in wanted):
        raise ValueError(f"{flag}: expected names among {known}, got {spec!r}")
    picked = {n for w in wanted for n in groups.get(w, [w])}
    return [n for n in names if n in picked]


def run_cases(doc: str, name: str, make_cases, run_case, columns: list[str]) -> None:
    """The main of a benchmark of one table over its cases: start (doc's first paragraph), then
    run_case(case, device, dtype, bandwidth) -> rows for each of make_cases(smoke), then
    finish (OUT/<name>.csv, the table of `columns`)."""
    args, device, dtype, bandwidth = start(doc)
    rows = [row for case in make_cases(args.smoke) for row in run_case(case, device, dtype, bandwidth)]
    finish(args, device, bandwidth, name, [(rows, columns)])


def run_rate_cases(doc: str, name: str, make_cases, run_case, columns: list[str]) -> None:
    """run_cases for a benchmark whose floor is the matmul rate: the rate measured now (printed,
    and as matmul_TFLOPs on each row) is run_case(case, device, dtype, rate)'s last argument."""
    args, device, dtype, bandwidth = start(doc)
    rate = matmul_rate(device, dtype, 256 if args.smoke else 8192)
    print(f"{str(dtype).removeprefix('torch.')} matmul rate: {rate / 1e12:.1f} TFLOP/s (measured now)", flush=True)
    rows = [row for case in make_cases(args.smoke) for row in run_case(case, device, dtype, rate)]
    finish(args, device, bandwidth, name, [(rows, columns)], matmul_TFLOPs=rate / 1e12)


def time_and_peak(step, device: torch.device, label: str) -> tuple[Optional[float], Optional[int]]:
    """(bench's median ms, cuda_peak_bytes) of step(), or (None, None) where it runs out of
    device memory (said on the output; the cache emptied for the next one)."""
    try:
        return bench(step, device, label=label), cuda_peak_bytes(step, device)
    except torch.OutOfMemoryError:
        print(f"{label}: out of memory", flush=True)
        torch.cuda.empty_cache()
        return None, None


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
