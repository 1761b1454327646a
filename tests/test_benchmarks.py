"""Each benchmark's --smoke mode runs end to end (same code as on a GPU, tiny CPU shapes);
_common.device_ms times the device alone."""

import csv
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE_TIMED = {"bench_loss.py", "bench_moe_layer.py", "bench_rope.py", "bench_routing.py"}  # device_ms columns


def _script_env() -> dict:
    """The environment a benchmark script runs in: without TRITON_INTERPRET (--smoke sets it), importing this checkout's
    fmoe, not whichever tree the environment installed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_benchmark_smoke(script, tmp_path):
    env = _script_env()
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "NOT performance numbers" in out.stdout
    (csv_path,) = tmp_path.glob("*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert rows and all(float(r["ms"]) > 0 for r in rows)
    assert len({r["impl"] for r in rows if r.get("impl")}) >= 3  # ours and two baselines
    if script in DEVICE_TIMED:  # the columns are there, empty on CPU
        assert all(r["device_ms"] == r["device_floor_fraction"] == "" for r in rows)
    if script == "bench_optim.py":  # each ratio against the baseline doing the same work: Muon's against torch's Muon, not AdamW
        ms = {r["impl"]: float(r["ms"]) for r in rows}
        by = {r["impl"]: r for r in rows}
        assert by["muon (matrices)"]["baseline"] == "torch muon (matrices)" and by["fmoe bf16"]["baseline"] == "torch foreach"
        for r in rows:
            assert float(r["ratio_vs_baseline"]) == pytest.approx(ms[r["impl"]] / ms[r["baseline"]]), r
    if script == "bench_hyper_connections.py":  # the bytes its docstring counts (float32): the one stream's backward moves none
        for r in rows:
            T, H, n = int(r["T"]), int(r["H"]), int(r["streams"])
            want = 4 * T * (3 * H if r["impl"] == "one stream" else (2 if r["pass"] == "fwd" else 5) * (n * H + H))
            assert int(r["bytes"]) == want, r
    _smoke_rows_hold(script, rows, out.stdout)


def test_help_says_what_each_benchmark_does_in_whole_sentences():
    """--help's description is the docstring's first paragraph (it was its first line, cut
    mid-sentence): each script hands start / run_cases its whole __doc__; one --help run end to end."""
    import ast

    summary = _common().summary
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree)
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None) in
                 ("start", "run_cases", "run_rate_cases")]
        if path.name.startswith("bench_"):
            assert calls and all(isinstance(c.args[0], ast.Name) and c.args[0].id == "__doc__" for c in calls), path.name
        if calls or path.name in ("run_all.py", "kernel_stats.py"):
            assert summary(doc).endswith(".") and "\n" not in summary(doc), (path.name, summary(doc))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_activation_memory.py"), "--help"], capture_output=True, text=True,
                         env=_script_env(), timeout=300)
    assert out.returncode == 0 and " ".join(out.stdout.split()).count(
        "its cost, and what tensor parallelism with sequence parallelism (tp = 2) leaves on each rank.") == 1, out.stdout


def test_benchmark_flags_are_taken_whole(capsys):
    """_common decides SMOKE (and TRITON_INTERPRET) from a literal "--smoke" before argparse runs: an abbreviation
    argparse took for it (--smok) ran the smoke shapes without the interpreter, and failed there."""
    parser = _common().base_parser("A benchmark.")
    for abbreviated in ("--smok", "--prof", "--ou=x"):
        with pytest.raises(SystemExit):
            parser.parse_args([abbreviated])
        assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err
    assert parser.parse_args(["--smoke", "--out", "x"]).smoke


def _common():
    """benchmarks/_common.py, imported the way the scripts import it."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import _common

    return _common


def test_device_ms_is_none_off_cuda():
    common, calls = _common(), []
    assert common.device_ms(lambda: calls.append(1), torch.device("cpu")) is None and not calls
    assert common.device_columns(lambda: None, torch.device("cpu"), 1e12, 1 << 20) == {"device_ms": None, "device_floor_fraction": None}


@pytest.mark.gpu
def test_device_ms_times_the_device_alone():
    """A 1 GiB copy is the device's either way: device_ms is bench()'s time. 20 launches on one
    element are the host's in bench() (the device waits for each), not in device_ms. A
    function that synchronizes cannot be queued ahead: HostBehind."""
    common, device = _common(), torch.device("cuda")
    src = torch.ones(1 << 29, dtype=torch.bfloat16, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    floor_ms = 2 * src.nbytes / common.copy_bandwidth(device, src.nbytes) * 1e3
    copy_ms = common.device_ms(lambda: dst.copy_(src), device)
    assert abs(copy_ms / floor_ms - 1) < 0.25, (copy_ms, floor_ms)
    del src, dst
    one = torch.zeros(1, device=device)

    def launches():
        for _ in range(20):
            one.add_(1)

    host_ms, alone_ms = common.bench(launches, device), common.device_ms(launches, device)
    assert alone_ms < host_ms, (alone_ms, host_ms)
    with pytest.raises(common.HostBehind, match="synchronizes"):
        common.device_ms(lambda: one.add_(1).item(), device, calls=10)


@pytest.mark.gpu
def test_bench_times_a_slow_call_five_times():
    """A call of 2 SLOW_MS on the device is called MIN_SAMPLES + 2 times (one untimed, one the
    estimate) and its time is the median of MIN_SAMPLES = 5 timed calls, not one."""
    common, calls = _common(), []
    cycles = int(2 * common.SLOW_MS * common._sleep_cycles_per_ms())

    def slow():
        calls.append(1)
        torch.cuda._sleep(cycles)

    ms = common.bench(slow, torch.device("cuda"))
    assert common.MIN_SAMPLES == 5 and len(calls) == 7 and 1.8 * common.SLOW_MS < ms < 2.5 * common.SLOW_MS, (calls, ms)


def test_bench_plans_at_least_five_timed_calls_of_any_length():
    """cuda_plan: do_bench's counts (25 ms of warm-up, 100 ms timed) for short calls, never
    fewer than 5 timed calls (do_bench timed one call of 50 ms or more), exactly 5 and no more
    warm-up from SLOW_MS on: the cost stays bounded (about 100 ms, or 5 + 1 calls)."""
    common = _common()
    assert common.cuda_plan(1.0) == (25, 100) and common.cuda_plan(0.01) == (2500, 10000)
    for ms in (21.0, 50.0, 100.0, 186.0, 249.0):  # do_bench: int(100 / ms) = 4 ... 0 -> 1 sample
        assert common.cuda_plan(ms) == (1, 5), ms
    for ms in (250.0, 474.0, 5000.0):
        assert common.cuda_plan(ms) == (0, 5), ms
    assert common.cuda_plan(0.0) == (250000, 1000000)  # an estimate of 0 ms counts as 1e-4 ms
    for ms in (1e-3, 0.3, 7.0, 19.9, 20.0, 60.0, 300.0, 1e5):
        warmup, timed = common.cuda_plan(ms)
        assert timed >= 5 and (warmup + timed) * ms <= common.WARMUP_MS + common.REP_MS + 6 * ms, (ms, warmup, timed)


def _fake_cuda(monkeypatch, common, clock, queries=None, sleeps=None):
    """torch.cuda's events, synchronize and _sleep on the host (a device of type "cuda" to hand
    to bench and device_ms): an event records the clock, after_sleep.query() answers from
    `queries`, each sleep's cycles go to `sleeps`."""

    class HostEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

        def query(self):
            return queries.pop(0)

    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(common.torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(common.torch.cuda, "_sleep", lambda cycles: sleeps.append(cycles))
    monkeypatch.setattr(common, "_FLUSH", torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(common, "_SLEEP_CYCLES_PER_MS", 1000.0)
    return SimpleNamespace(type="cuda")


@pytest.mark.parametrize("call_ms, calls_made", [(30.0, 7), (8.0, 13), (0.7, 28)])
def test_bench_cuda_path_takes_the_median_of_five_timed_calls(monkeypatch, call_ms, calls_made):
    """bench()'s CUDA path, run on the host with events and perf_counter reading a clock that
    each call moves on by its time (SLOW_MS 20 ms, do_bench's 25 / 100 ms scaled to 5 / 10 ms):
    a 30 ms call (slow) is called 1 + 1 + 5 times, an 8 ms one 1 + 1 + 5 (estimate) + 1
    (warm-up) + 5, a 0.7 ms one 1 + 1 + 5 + int(5 / 0.7) + int(10 / 0.7) (the estimate is the
    5 calls' time over 5); each time is the median of the timed calls (5, 5, 14), one made slow on purpose
    (a median, not the one sample do_bench took). The clock is the test's: timed sleeps made
    the counts and the median depend on the machine's load (a late wake-up: 7 calls, 15.9 ms)."""
    common, calls, clock = _common(), [], [0.0]
    device = _fake_cuda(monkeypatch, common, clock)
    monkeypatch.setattr(common, "SLOW_MS", 20.0)
    monkeypatch.setattr(common, "WARMUP_MS", 5.0)
    monkeypatch.setattr(common, "REP_MS", 10.0)
    monkeypatch.setattr(common, "_l2_flush", lambda device: torch.zeros(4, dtype=torch.int32))

    def fn():
        calls.append(1)
        clock[0] += call_ms * (4 if len(calls) == calls_made - 2 else 1) / 1e3  # one timed call 4x slower

    ms = common.bench(fn, device)
    assert len(calls) == calls_made and ms == pytest.approx(call_ms), (len(calls), ms)


def _run_all_module():
    """benchmarks/run_all.py as a module, to call its functions in this process."""
    spec = importlib.util.spec_from_file_location("run_all_module", ROOT / "benchmarks" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    return run_all


def _run_all(tmp_path, *flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--out", str(tmp_path / "csv"),
                           "--results", str(tmp_path / "RESULTS.md"), *flags], capture_output=True, text=True, env=env, timeout=900)


def test_run_all_appends_each_benchmark_s_output_with_its_environment(tmp_path):
    """benchmarks/run_all.py: a section per run (date, device, versions, command), the
    command, status and printed tables of each part; a second run appends. --profile reaches
    the benchmark: a trace and an ops table of each timed call."""
    first = _run_all(tmp_path, "--only", "bench_rope", "--gpu-tests", "--profile")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    import importlib.metadata

    assert text.startswith("## ") and text.splitlines()[0].endswith(" UTC: cpu (smoke)")
    # the installed package's version (torch.__version__ adds PyPI's CUDA builds' "+cu130", which the package's lacks)
    assert f"torch {importlib.metadata.version('torch')}, triton " in text and "SMOKE RUN" in text
    assert "### gpu tests\n" in text and " skipped" in text  # no CUDA here: every gpu test skips, saying why
    assert "### bench_rope\n\n`" in text and "benchmarks/bench_rope.py --out" in text and "--smoke --profile`: exit 0, " in text
    assert "case " in text and " impl " in text and "fwd+bwd" in text  # the printed table
    assert text.rstrip().endswith("All 2 parts exited 0.")
    assert (tmp_path / "csv" / "bench_rope.csv").is_file()
    rows = list(csv.DictReader((tmp_path / "csv" / "bench_rope.csv").open()))
    traces = sorted((tmp_path / "csv" / "profile").glob("bench_rope-*.json"))
    assert len(traces) == len(rows) >= 6  # each timing (pass x impl) profiled once, under its own label
    assert {t.name for t in traces} >= {"bench_rope-q-fwd-fused.json", "bench_rope-q_interleaved-fwd+bwd-compiled.json"}
    assert all(any(e.get("ph") == "X" for e in json.loads(t.read_text())["traceEvents"]) for t in traces)
    table = (tmp_path / "csv" / "profile" / "bench_rope.txt").read_text()
    assert table.count("\n== ") + table.startswith("== ") == len(traces) and "Self CPU" in table
    second = _run_all(tmp_path, "--only", "bench_loss", "--timeout", "0.5", "--extra=--fp8 --model small")
    assert second.returncode == 1
    again = (tmp_path / "RESULTS.md").read_text()
    assert again.startswith(text) and again.count("\n## ") == 1  # appended: the first run kept
    assert "### bench_loss\n" in again and "timed out after 0.5 s" in again and "--smoke --fp8 --model small`" in again and again.rstrip().endswith("Did not exit 0: bench_loss.")


def test_run_all_refuses_unknown_benchmarks_and_bad_timeouts(tmp_path):
    bad = _run_all(tmp_path, "--only", "bench_routing,bench_nothing")
    assert bad.returncode == 2 and "--only: unknown benchmarks ['bench_nothing']" in bad.stderr
    bad = _run_all(tmp_path, "--timeout", "0")
    assert bad.returncode == 2 and "--timeout: expected a positive number of seconds, at most 604800 (a week), got 0" in bad.stderr
    for empty in ("", ","):  # an unset shell variable: not every benchmark
        bad = _run_all(tmp_path, f"--only={empty}")
        assert bad.returncode == 2 and f"--only: expected comma-separated benchmark names, got {empty!r}" in bad.stderr
    assert not (tmp_path / "RESULTS.md").exists()


def test_run_all_refuses_a_timeout_it_cannot_wait_for_before_writing(tmp_path):
    """subprocess cannot wait inf or 1e10 seconds (OverflowError, once the section header was
    appended): refused with the others, nothing written."""
    for timeout, shown in (("inf", "inf"), ("1e10", "1e+10"), ("nan", "nan"), ("604801", "604801")):
        bad = _run_all(tmp_path, "--only", "bench_rope", f"--timeout={timeout}")
        assert bad.returncode == 2, bad.stderr[-2000:]
        assert f"--timeout: expected a positive number of seconds, at most 604800 (a week), got {shown}" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "RESULTS.md").exists()


def test_run_all_refuses_bad_extra_flags_and_a_directory_to_append_to_before_writing(tmp_path):
    bad = _run_all(tmp_path, '--extra="')
    assert bad.returncode == 2 and """--extra: expected flags as a shell splits them, got '"' (No closing quotation)""" in bad.stderr
    (tmp_path / "dir").mkdir()
    bad = _run_all(tmp_path, "--results", str(tmp_path / "dir"))  # the last --results counts
    assert bad.returncode == 2 and f"--results: expected a file to append to, got the directory {str(tmp_path / 'dir')!r}" in bad.stderr
    assert not (tmp_path / "RESULTS.md").exists() and not list((tmp_path / "dir").iterdir())


def test_run_all_help_says_extra_goes_to_every_benchmark():
    """--extra's flags reach every benchmark run (a flag of one, bench_train_step's --fp8, fails
    the others): the help says so, and shows it with --only."""
    help_text = " ".join(subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--help"], capture_output=True, text=True,
                                        check=True, timeout=60).stdout.split())
    assert "--extra EXTRA more flags for every benchmark run, one string" in help_text, help_text
    assert "--only bench_train_step --extra=--fp8" in help_text, help_text


def test_run_all_takes_out_relative_to_the_callers_directory(tmp_path):
    """As --results: the benchmarks, which run in the repository root, get it as an absolute path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--only", "bench_rope", "--timeout", "0.01",
                          "--out", "csv", "--results", "RESULTS.md"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]  # timed out: only its command line is looked at
    text = (tmp_path / "RESULTS.md").read_text()
    assert f"benchmarks/bench_rope.py --out {shlex.quote(str(tmp_path / 'csv'))} --smoke`: timed out" in text, text


def test_bench_routing_runs_the_cases_named():
    _common()  # benchmarks/ on the path
    import bench_routing

    cases = bench_routing.make_cases(False, torch.device("cpu"))
    names = lambda spec: [c.name for c in bench_routing.select_cases(cases, spec)]  # noqa: E731
    assert names(None) == ["dsv3 T=16384", "qwen3 T=16384", "kolibri T=16384", "dsv4 T=16384", "dsv3 T=65536", "qwen3 T=65536",
                           "kolibri T=65536", "dsv4 T=65536"]
    assert names("dsv4") == ["dsv4 T=16384", "dsv4 T=65536"]
    assert names("kolibri") == ["kolibri T=16384", "kolibri T=65536"]
    assert names("dsv3") == ["dsv3 T=16384", "dsv3 T=65536"]
    assert names("qwen3 T=65536, dsv3 T=16384") == ["dsv3 T=16384", "qwen3 T=65536"]
    for bad in ("nope", "", "dsv3 T=8"):
        with pytest.raises(ValueError, match="--cases: expected names among"):
            bench_routing.select_cases(cases, bad)


def test_select_picks_names_and_groups_in_order():
    select = _common().select
    names = ["fmoe compiled", "fmoe eager", "reference ops"]
    assert select(names, None, "--impls") == names
    assert select(names, "reference ops, fmoe compiled", "--impls") == ["fmoe compiled", "reference ops"]
    assert select(names, "fmoe", "--impls", {"fmoe": names[:2]}) == names[:2]
    for bad in ("fmoe", "", " , ", "fmoe compiled,nope"):
        with pytest.raises(ValueError, match=r"--impls: expected names among \['fmoe compiled', 'fmoe eager', 'reference ops'\]"):
            select(names, bad, "--impls")


def test_bench_train_step_refuses_an_unknown_implementation(tmp_path):
    env = _script_env()
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), "--smoke", "--out", str(tmp_path),
                          "--impls", "fmoe compiled,nope"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "--impls: expected names among" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(tmp_path.glob("*.csv"))


def test_bench_scan_times_the_implementations_named(tmp_path):
    """bench_scan --impls fused,eager: only their rows, the fused rows' speedup over eager
    filled and over the (untimed) loop empty; an unknown name is refused."""
    env = _script_env()
    script = str(ROOT / "benchmarks" / "bench_scan.py")
    out = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path), "--impls", "eager,fused"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "bench_scan.csv")))
    assert {r["impl"] for r in rows} == {"fused", "eager"} and len(rows) == 2 * 2 * 2  # 2 cases, 2 passes
    fused = [r for r in rows if r["impl"] == "fused"]
    assert all(float(r["speedup_vs_eager"]) > 0 and r["speedup_vs_loop"] == "" for r in fused)
    out = subprocess.run([sys.executable, script, "--smoke", "--out", str(tmp_path / "bad"), "--impls", "fused,scan"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 1 and out.stderr.strip() == "--impls: expected names among ['eager', 'fused', 'loop'], got 'fused,scan'"


def _train_step_row(model: str, out) -> dict:
    """The one CSV row of bench_train_step.py --smoke --model <model> --impls "fmoe eager"."""
    env = _script_env()
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), "--smoke", "--model", model, "--out", str(out),
                          "--impls", "fmoe eager"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (row,) = list(csv.DictReader(open(pathlib.Path(out) / "bench_train_step.csv")))
    return row


@pytest.fixture(scope="module")
def plain_train_step_row(tmp_path_factory):
    """The default smoke model's row (--model large), run once for the hybrid models' tests."""
    return _train_step_row("large", tmp_path_factory.mktemp("large"))


@pytest.mark.parametrize("kind", ["falcon_h1", "jamba"])
def test_bench_train_step_times_the_hybrid_models(kind, tmp_path, plain_train_step_row):
    """--model falcon_h1 (a Mamba-2 mixer beside the attention in both blocks) and jamba (a
    Mamba-1 mixer in block 0, the scan's kernels through the interpreter) with --smoke: the
    tiny model of its kind, eager, makes no host sync in its step; its row, labelled
    "<kind> (smoke)", counts the model's parameters and FLOPs (the mixers':
    tests/train/test_metrics.py) beside the default smoke model's (labelled "smoke")."""
    hybrid, plain = _train_step_row(kind, tmp_path), plain_train_step_row  # --smoke: the tiny models (SMOKE_FALCON_H1 or SMOKE_JAMBA, SMOKE)
    assert hybrid["model"] == f"{kind} (smoke)" and plain["model"] == "smoke"  # the rows told apart
    assert hybrid["impl"] == "fmoe eager" and int(hybrid["syncs/step"]) == 0 and int(hybrid["fwd+bwd reads"]) == 0
    assert int(hybrid["params"]) > int(plain["params"]) and float(hybrid["flops_per_token"]) > float(plain["flops_per_token"])


def test_the_readme_lists_every_benchmark_and_what_the_lease_parts_run():
    """README's Benchmarks section named 18 of the 20 scripts, and called gpu_lease.sh's parts a
    and b "the same" as run_all.py, which runs every one."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Benchmarks"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert [s for s in scripts if f"benchmarks/{s}" not in section] == []
    lease = (ROOT / "benchmarks" / "gpu_lease.sh").read_text()
    in_a_b = set()
    for part in ("a", "b"):
        body = re.search(rf"^\s*{part}\)\n(.*?);;", lease, re.S | re.M).group(1)
        in_a_b.update(re.findall(r"bench_\w+", body))
    said = re.search(r"gpu_lease\.sh b\s+# the core of it \((\d+) benchmarks", section)
    assert said and int(said.group(1)) == len(in_a_b) < len(scripts)


def test_bench_scan_counts_the_bytes_of_the_tensors_it_runs():
    """scan_bytes counts each tensor at its own element size: with bf16 u, dt, b, c (the GPU
    run) y and dy float32, A float32 [C, N], T = 32, C = 8, N = 16: fwd u 2 + dt 2 + y 4 = 8 T C
    plus A 4 C N and b, c 2 T N each; fwd+bwd adds the inputs again, dy 4 T C and the gradients
    (u, dt, b, c bf16, A float32): 20 T C + small, not 12 and 32 T C (all float32)."""
    _common()
    import bench_scan

    T, C, N = 32, 8, bench_scan.N
    inputs = bench_scan.scan_inputs(T, C, torch.device("cpu"), torch.bfloat16)
    y, grad_y = torch.zeros(1, T, C), torch.zeros(1, T, C)
    grads = [torch.zeros_like(t) for t in inputs]
    small = 4 * C * N + 2 * 2 * T * N  # A, b, c
    fwd, fwd_bwd = bench_scan.scan_bytes(inputs, y, grad_y, grads)
    assert fwd == 8 * T * C + small and fwd_bwd == fwd + (2 + 2 + 4 + 2 + 2) * T * C + 2 * small
    assert fwd_bwd == 20 * T * C + 3 * small
    inputs32 = bench_scan.scan_inputs(T, C, torch.device("cpu"), torch.float32)
    small32 = 4 * C * N + 2 * 4 * T * N
    assert bench_scan.scan_bytes(inputs32, y, grad_y, [torch.zeros_like(t) for t in inputs32]) == (12 * T * C + small32, 32 * T * C + 3 * small32)


def test_bench_sparse_attention_counts_the_real_slots_and_3x_for_fwd_bwd():
    """attention_flops counts 2 N (D + Dv) per slot the index fills (the query at position p
    has min(J, p + 1); -1 slots are no work), and fwd+bwd = 3 x fwd (no recomputation). The
    smoke v3.2-tp8 case (T = S = 48, J = 8, N = 3, D = 32, Dv = 24): 1 + ... + 8 + 40 x 8 = 356
    slots, not 48 x 8 = 384; long-ctx (16 queries at the end of 96 keys): every slot, 128."""
    _common()
    import bench_sparse_attention as bsa

    v32, long_ctx = bsa.make_cases(True)
    for case, slots in ((v32, 36 + 40 * 8), (long_ctx, 16 * 8)):
        _, _, index = bsa.inputs(case, torch.device("cpu"), torch.float32)
        D = case.Dv + case.Dr
        assert int((index >= 0).sum()) == slots
        assert bsa.attention_flops(index, case.N, D, case.Dv) == (2 * 3 * slots * 56, 3 * 2 * 3 * slots * 56)
    index = torch.tensor([[0, -1, -1], [1, 0, -1], [2, 1, 0], [3, 2, 1]])  # J = 3, positions 0..3
    assert bsa.attention_flops(index, 1, 4, 2) == (2 * 9 * 6, 3 * 2 * 9 * 6)


def test_bench_block_sparse_counts_the_own_blocks_causal_keys_and_3x():
    """block_keys_per_query: query t sees t % block + 1 keys of its own block and min(topk - 1,
    t // block) earlier blocks whole. Smoke (T = 48, blocks of 4, 3 kept): the first 12 queries
    1 ... 12 keys (78), the other 36 2 x 4 + 2.5 on average (378): 456 / 48 = 9.5, not the
    min(12, t + 1) count's 10.375. layer_flops: projections 2 T H (2 N D + 2 G D) plus the
    attention's 2 T N keys 2 D, fwd+bwd exactly 3x fwd."""
    _common()
    import bench_block_sparse as bbs

    assert bbs.block_keys_per_query(48, 4, 3) == 9.5
    assert bbs.block_keys_per_query(8, 4, 3) == 4.5  # t < K: t + 1
    T, H, N, G, D, keys = 48, 32, 2, 1, 16, 9.5
    fwd = 2 * T * H * (2 * N * D + 2 * G * D) + 2 * T * N * keys * 2 * D
    assert bbs.layer_flops(T, H, N, G, D, keys, False) == fwd == 294912 + 58368
    assert bbs.layer_flops(T, H, N, G, D, keys, True) == 3 * fwd


def test_bench_moa_counts_3x_for_fwd_bwd_and_smoke_runs_the_triton_kernels(tmp_path):
    """layer_flops: the projections' 2 T H (2 N D + 2 G D) plus the attention's 2 T N keys 2 D,
    fwd+bwd 3x for both (it was 3.5x for the attention). Smoke shape (T = 48, H = 32, N = 4,
    G = 2, D = 16, documents of 16: 8.5 keys): 589824 + 104448. The smoke run's moa row runs
    impl "triton" (the kernels through the interpreter), not "auto" (torch on CPU)."""
    _common()
    import bench_moa

    assert bench_moa.layer_flops(48, 32, 4, 2, 16, 8.5, False) == 589824 + 104448
    assert bench_moa.layer_flops(48, 32, 4, 2, 16, 8.5, True) == 3 * (589824 + 104448)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moa.py"), "--smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=_script_env(), timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {(r["pass"], r["impl"]): r for r in csv.DictReader(open(tmp_path / "bench_moa.csv"))}
    assert rows[("fwd", "moa")]["layer_impl"] == "triton" and rows[("fwd", "loop")]["layer_impl"] == "torch"
    assert float(rows[("fwd", "moa")]["flops"]) == 589824 + 104448 and float(rows[("fwd+bwd", "moa")]["flops"]) == 3 * (589824 + 104448)


def test_bench_moe_layer_runs_fmoe_gathers_backward_by_gather_too(monkeypatch):
    """The "fmoe gather" row's fwd+bwd call is wrapped whole (bench_moe_layer.within): permute's
    forward and unpermute's backward (the weighted row kernel) both launch under "gather"; the
    backward ran under "scatter" when only the forward was wrapped."""
    _common()
    import bench_moe_layer as bml
    from fmoe.layers import MoEConfig, moe
    from fmoe.ops import dispatch

    log, launch = [], dispatch._launch_permute_rows

    def spy(src, slot_of_row, K, weights=None, *args, **kwargs):
        log.append(("unpermute bwd" if weights is not None else "permute fwd", dispatch.PERMUTE_BY))
        return launch(src, slot_of_row, K, weights, *args, **kwargs)

    monkeypatch.setattr(dispatch, "_launch_permute_rows", spy)
    shape = bml.Shape("A (smoke)", 32, 32, 8, 2, 16)
    torch.manual_seed(0)
    p = bml.make_params(shape, torch.float32, torch.device("cpu"))
    x = torch.randn(32, 32, requires_grad=True)
    cfg = MoEConfig(n_experts=8, k=2, aux_scores=False, impl="triton")
    bml.within("fmoe gather", lambda: torch.autograd.grad(moe(x, p, cfg)[0], [x, *p.values()], torch.randn(32, 32)))()
    assert log == [("permute fwd", "gather"), ("unpermute bwd", "gather")] and dispatch.PERMUTE_BY == "scatter", log


def test_bench_moe_layer_strong_baseline_is_sync_free_and_combines_in_the_activations_dtype(monkeypatch):
    """strong_moe counts tokens per expert without torch.bincount (a host sync on CUDA) and
    never makes a float32 tensor of T k H (the weighted rows) from bf16 activations; its
    output and gradients match the per-expert loop's (float32)."""
    _common()
    import bench_moe_layer as bml

    def no_bincount(*args, **kwargs):
        raise AssertionError("torch.bincount: reads the max to the host on CUDA")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    shape = bml.Shape("A (smoke)", 32, 32, 8, 2, 16)
    torch.manual_seed(0)
    p = bml.make_params(shape, torch.float32, torch.device("cpu"))
    x = torch.randn(32, 32, requires_grad=True)
    leaves, dy = [x, *p.values()], torch.randn(32, 32)
    strong, loop = bml.strong_moe(x, p, 2), bml.loop_moe(x, p, 2)
    for a, b in zip((strong, *torch.autograd.grad(strong, leaves, dy)), (loop, *torch.autograd.grad(loop, leaves, dy))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    big = []
    pb = {n: (t.detach().to(torch.bfloat16) if n != "router" else t.detach()) for n, t in p.items()}

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= 32 * 2 * 32:
                big.append((getattr(func, "__name__", str(func)), tuple(out.shape)))
            return out

    xb = x.detach().to(torch.bfloat16)
    with Watch():
        y = bml.strong_moe(xb, pb, 2)
    assert y.dtype == torch.bfloat16 and big == [], big


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_bench_moe_layer_titan_baseline_matches_the_loop_and_gathers(monkeypatch, shared):
    """titan_moe (torchtitan's pattern: torch.gather dispatch, float32 weighting, scatter_add onto
    the shared experts' output) gives the per-expert loop's output and gradients, with and
    without shared experts, reading nothing on the host (no torch.bincount), and gathers x's
    rows with torch.gather (whose backward is a scatter_add), not x[token]."""
    _common()
    import bench_moe_layer as bml

    monkeypatch.setattr(torch, "bincount", lambda *a, **k: (_ for _ in ()).throw(AssertionError("torch.bincount: a host read on CUDA")))
    shape = bml.Shape("A (smoke)", 32, 32, 8, 2, 16, n_shared=shared)
    torch.manual_seed(0)
    p = bml.make_params(shape, torch.float32, torch.device("cpu"))
    x = torch.randn(32, 32, requires_grad=True)
    leaves, dy = [x, *p.values()], torch.randn(32, 32)
    titan, loop, strong = bml.titan_moe(x, p, 2), bml.loop_moe(x, p, 2), bml.strong_moe(x, p, 2)
    expected = (loop, *torch.autograd.grad(loop, leaves, dy))
    for got in (titan, strong):
        for a, b in zip((got, *torch.autograd.grad(got, leaves, dy, retain_graph=got is titan)), expected):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert titan.grad_fn.name() == "ScatterAddBackward0"  # onto the shared output (or zeros): no add after

    on_x = []  # the functions called on x itself

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if args and args[0] is x:
                on_x.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Watch():
        bml.titan_moe(x, p, 2)
    assert "gather" in on_x and "__getitem__" not in on_x, on_x


def test_bench_decode_counts_the_routed_experts_and_the_rows_a_position_sees():
    """floor_bytes counts the experts the step routed to (routed_experts: each block's distinct
    experts, at most min(E, B k)) and the rows the decoded position sees, itself included:
    P + 1 full, min(P + 1, window) in a sliding window, P % chunk + 1 in a chunk (smoke: P = 8,
    chunks of 4: just itself)."""
    _common()
    import bench_decode as bd

    cfgs = bd.configs(True)
    chunked, window = cfgs["gqa-chunked"], cfgs["gqa-window"]
    assert [bd.visible_rows(chunked, i, 8) for i in range(4)] == [1, 1, 1, 9]  # blocks 0-2 chunked, 3 NoPE (full)
    assert [bd.visible_rows(window, i, 8) for i in range(4)] == [4, 9, 4, 9]
    assert bd.visible_rows(chunked, 0, 6) == 3 and bd.visible_rows(window, 0, 2) == 3
    torch.manual_seed(0)
    model = bd.Transformer(chunked).eval()
    B, P = 2, 8
    ids = torch.randint(0, chunked.vocab_size, (B, P + 1))
    cache = model.kv_cache(P + 1, batch=B)
    with torch.no_grad():
        for b in range(B):
            model.decode(ids[b, :P], cache, seqs=b)

    def step():
        cache.lengths = [P] * B
        return model.decode(ids[:, P:], cache)

    used = bd.routed_experts(model, step)
    assert len(used) == 4 and all(chunked.k <= u <= min(chunked.n_experts, B * chunked.k) for u in used), used
    cache.lengths = [P] * B
    size, per_expert = 4, 3 * chunked.hidden * chunked.ffn_expert
    row = 2 * chunked.n_kv_heads * chunked.head_dim  # keys and values of one token
    none = bd.floor_bytes(model, cache, B, [0, 0, 0, 0])
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) - model.embed.numel() + B * chunked.hidden
    assert none == size * (dense + B * (1 + 1 + 1 + 9) * row)
    assert bd.floor_bytes(model, cache, B, used) - none == size * sum(used) * per_expert


def _smoke_rows_hold(script: str, rows: list[dict], stdout: str) -> None:
    """The numbers each --smoke CSV row derives, worked by hand for the smoke shapes (float32
    on CPU unless said): the bytes of each floor, the FLOPs behind TFLOP/s, the ratios, and the
    fractions against the copy bandwidth and matmul rate written on the same row."""
    num = lambda r, c: float(r[c])  # noqa: E731
    if script == "bench_routing.py":  # T = 8; fwd: logits + bias + T k (4 + 8); bwd: the k chosen logits, experts, dweights, dlogits
        want = {"dsv3 T=8": (9984, 9216), "qwen3 T=8": (4864, 5120), "kolibri T=8": (14400, 13056), "dsv4 T=8": (9792, 8960)}
        assert {r["case"] for r in rows} == set(want) and len(rows) == 4 * 2 * 3
        for r in rows:
            fwd, bwd = want[r["case"]]
            assert int(r["bytes"]) == (fwd if r["pass"] == "fwd" else fwd + bwd), r
            assert num(r, "floor_ms") == pytest.approx(int(r["bytes"]) / (num(r, "copy_GBps") * 1e9) * 1e3), r
            if r["impl"] == "fused":
                assert num(r, "floor_fraction") == pytest.approx(num(r, "floor_ms") / num(r, "ms")), r
            else:
                assert r["floor_fraction"] == "", r
        assert {(r["case"].split()[0], int(r["E"]), int(r["k"])) for r in rows} == {("dsv3", 256, 8), ("qwen3", 128, 8), ("kolibri", 384, 6),
                                                                                    ("dsv4", 256, 6)}
    if script == "bench_rope.py":  # T = 48, D = 32: x and the result 2 T H D x 4, cos and sin 2 T D/2 x 4; fwd+bwd twice
        pass_bytes = {"q": 12288 * 4 + 6144, "k": 12288 * 2 + 6144, "q interleaved": 12288 * 4 + 6144}
        assert len(rows) == 3 * 3 * 3
        for r in rows:
            assert int(r["bytes"]) == (2 if r["pass"] == "fwd+bwd" else 1) * pass_bytes[r["case"]], r
            assert r["interleaved"] == str(r["case"] == "q interleaved"), r
            assert num(r, "floor_fraction") == pytest.approx(int(r["bytes"]) / (num(r, "copy_GBps") * 1e9) * 1e3 / num(r, "ms")), r
    if script == "bench_loss.py":  # N = 16, V = 1000, H = 32, bf16: ce reads the logits and writes their gradient, 2 x 2 N V
        base = {r["case"]: num(r, "ms") for r in rows if r["impl"] in ("eager", "unfused")}
        assert set(base) == {"ce N=16 V=1000", "ce softcap=30 N=16 V=1000", "linear N=16 H=32 V=1000"}
        for r in rows:
            assert num(r, "speedup") == pytest.approx(base[r["case"]] / num(r, "ms")), r
            if r["case"].startswith("ce"):
                assert int(r["bytes"]) == 64000 and r["TFLOP/s"] == "", r
                assert num(r, "floor_fraction") == pytest.approx(64000 / (num(r, "copy_GBps") * 1e9) * 1e3 / num(r, "ms")), r
            else:  # 6 N H V
                assert num(r, "TFLOP/s") * num(r, "ms") * 1e9 == pytest.approx(6 * 16 * 32 * 1000) and r["bytes"] == "", r
    if script == "bench_optim.py":  # n = 64 48 + 4 32 24 + 33 + 2 17 5 = 6347, the matrices 6314; bytes per parameter:
        n = 6347  # params 4 + 4, grads 4, two moments read and written; a clip one more gradient read
        want = {"fmoe fp32": (28, 8), "fmoe bf16": (20, 4), "torch foreach": (28, 8), "fmoe bf16 + clip factor": (24, 4),
                "fmoe bf16 + fmoe clip": (24, 4), "torch fused + clip": (32, 8)}
        by = {r["impl"]: r for r in rows}
        assert set(by) == {*want, "muon (matrices)", "torch muon (matrices)"} or set(by) == {*want, "muon (matrices)"}
        for impl, (per_param, state) in want.items():
            r = by[impl]
            assert int(r["bytes"]) == per_param * n and int(r["params"]) == n and num(r, "state_GiB") * 2**30 == state * n, r
            assert r["baseline"] == ("torch fused + clip" if "clip" in impl else "torch foreach"), r
        for impl in ("muon (matrices)", "torch muon (matrices)"):
            if impl in by:
                assert int(by[impl]["params"]) == 6314 and num(by[impl], "state_GiB") * 2**30 == 4 * 6314 and by[impl]["bytes"] == "", by[impl]
    if script == "bench_moe_layer.py":  # T = 32, H = 32, E = 8, F = 16 (float32)
        flops = {"A (smoke)": 212992, "deepseek (smoke)": 507904, "nemotron3 (smoke)": 344064}
        timed = [r for r in rows if r.get("pass")]
        fmoe_ms = {(r["shape"], r["pass"]): num(r, "ms") for r in timed if r["impl"] == "fmoe"}
        for r in timed:
            factor = 3 if r["pass"] == "fwd+bwd" else 1
            assert num(r, "TFLOP/s") * num(r, "ms") * 1e9 == pytest.approx(factor * flops[r["shape"]]), r
            assert num(r, "matmul_fraction") == pytest.approx(num(r, "TFLOP/s") / num(r, "matmul_TFLOPs")), r
            want = "" if r["impl"] == "fmoe" else pytest.approx(num(r, "ms") / fmoe_ms[(r["shape"], r["pass"])])
            assert (r["fmoe_speedup"] if r["impl"] == "fmoe" else num(r, "fmoe_speedup")) == want, r
        for shape, pass_name in fmoe_ms:  # the printed goal line names the faster grouped_mm baseline
            ms = {r["impl"]: num(r, "ms") for r in timed if (r["shape"], r["pass"]) == (shape, pass_name)}
            faster = min(("strong", "titan"), key=ms.get)
            assert f"{shape} {pass_name}: fmoe's speedup over the faster grouped_mm baseline ({faster}): " in stdout, (shape, pass_name)
        # x read once and T k rows written, 128 bytes a row: k = 2 then 3; the activations 8 (or 5, no gate) T k F elements
        perm = {"A (smoke)": 4096 + 8192, "deepseek (smoke)": 4096 + 12288, "nemotron3 (smoke)": 4096 + 12288}
        act = {"A (smoke)": 8 * 64 * 16 * 4, "deepseek (smoke)": 8 * 96 * 16 * 4, "nemotron3 (smoke)": 5 * 96 * 16 * 4}
        ops = [r for r in rows if r.get("op")]
        for r in ops:
            if r["op"] == "permute: its plan alone":
                assert r["GB/s"] == r["copy_fraction"] == "", r
                continue
            nbytes = 2 * perm[r["shape"]] if r["op"] == "permute + unpermute" else perm[r["shape"]] if "permute" in r["op"] else act[r["shape"]]
            assert num(r, "GB/s") * num(r, "ms") * 1e6 == pytest.approx(nbytes), r
            assert num(r, "copy_fraction") == pytest.approx(nbytes / (num(r, "copy_GBps") * 1e9) * 1e3 / num(r, "ms")), r
            if r["op"].endswith(" fwd+bwd fused"):
                assert r["fused_speedup"] == "", r
            if r["op"].endswith(" fwd+bwd torch") and r["shape"] != "nemotron3 (smoke)":
                fused = next(o for o in ops if o["shape"] == r["shape"] and o["op"] == r["op"].replace(" torch", " fused"))
                assert num(r, "fused_speedup") == pytest.approx(num(r, "ms") / num(fused, "ms")), r
        assert sorted(r["op"] for r in ops if r["shape"] == "nemotron3 (smoke)" and "fwd+bwd" in r["op"]) == ["relu2 fwd+bwd torch"]
    if script == "bench_train_step.py":  # 32 tokens in two documents of 16: (16^2 + 16^2) / (2 x 32) = 8 keys a query
        _common()
        import bench_train_step as bts
        from fmoe.train import metrics

        flops = metrics.model_flops_per_token(bts.SMOKE, n_avg_keys=8.0)
        assert {r["impl"] for r in rows} == {"fmoe compiled", "fmoe eager", "reference ops"}
        for r in rows:
            assert int(r["tokens"]) == 32 and num(r, "flops_per_token") == pytest.approx(flops), r
            assert num(r, "tokens/s") == pytest.approx(32 / (num(r, "ms") * 1e-3)), r
            assert num(r, "TFLOP/s") == pytest.approx(flops * 32 / (num(r, "ms") * 1e-3) / 1e12), r
            assert num(r, "MFU") == pytest.approx(num(r, "TFLOP/s") / num(r, "matmul_TFLOPs")) and r["MFU_datasheet"] == "", r


def test_the_benchmarks_real_cases_are_the_ones_their_docstrings_list():
    """The GPU shapes, which --smoke never builds: routing's E, k and options per model, rope's
    heads, the MoE layer's shapes and their FLOPs (2 T (k + n_shared) m H F + 2 T H E), the
    train step's 16384 tokens in documents of 16 to T / 4 tokens."""
    _common()
    import bench_moe_layer as bml
    import bench_rope
    import bench_routing
    import bench_train_step as bts

    cases = {c.name: c for c in bench_routing.make_cases(False, torch.device("cpu"))}
    got = {n: (c.T, c.E, c.k, {k: v for k, v in c.options.items() if k != "expert_bias"}, None if "expert_bias" not in c.options else
               tuple(c.options["expert_bias"].shape)) for n, c in cases.items() if n.endswith("T=16384")}
    assert got == {
        "dsv3 T=16384": (16384, 256, 8, dict(score="sigmoid", n_groups=8, topk_groups=4, scale=2.5), (256,)),
        "qwen3 T=16384": (16384, 128, 8, dict(score="softmax", pre_softmax=False), None),
        "kolibri T=16384": (16384, 384, 6, dict(score="sigmoid", normalize=False, bias_on_logits=True), (384,)),
        "dsv4 T=16384": (16384, 256, 6, dict(score="sqrtsoftplus", scale=1.5), (256,)),
    }
    assert [(c.name, c.T, c.H, c.D, c.interleaved) for c in bench_rope.make_cases(False)] == [
        ("q", 16384, 32, 128, False), ("k", 16384, 8, 128, False), ("q interleaved", 16384, 32, 128, True)]
    assert bench_rope.DOC_LEN == 4096

    shapes = bml.make_shapes(False)
    assert [(s.name, s.T, s.H, s.E, s.k, s.F, s.n_shared, s.gated) for s in shapes] == [
        ("A", 16384, 2048, 128, 8, 768, 0, True), ("deepseek", 16384, 2048, 64, 6, 1408, 2, True),
        ("nemotron3", 16384, 2688, 128, 6, 1856, 2, False)]
    assert [s.flops_fwd() for s in shapes] == [2 * 16384 * 8 * 3 * 2048 * 768 + 2 * 16384 * 2048 * 128,
                                               2 * 16384 * 8 * 3 * 2048 * 1408 + 2 * 16384 * 2048 * 64,
                                               2 * 16384 * 8 * 2 * 2688 * 1856 + 2 * 16384 * 2688 * 128]
    p = bml.make_params(bml.make_shapes(True)[1], torch.float32, torch.device("cpu"))
    assert {n: tuple(t.shape) for n, t in p.items() if n.startswith("shared")} == {
        "shared_w_gate": (32, 32), "shared_w_up": (32, 32), "shared_w_down": (32, 32)}  # 2 shared experts of F = 16

    fields = lambda c: (c.vocab_size, c.hidden, c.n_layers, c.n_dense, c.ffn_dense, c.n_experts, c.k, c.ffn_expert, c.n_shared, c.n_heads,  # noqa: E731
                        c.n_kv_heads, c.head_dim, c.mtp_depth)
    assert fields(bts.LARGE) == (32768, 2048, 8, 1, 8192, 64, 6, 1024, 2, 16, 4, 128, 1)
    assert fields(bts.SMALL) == (32768, 1024, 12, 1, 4096, 64, 4, 512, 1, 16, 4, 64, 1)
    batch = bts.make_batch(bts.SMOKE, 100, torch.device("cpu"))
    lengths = batch["cu_seqlens"].diff().tolist()
    assert batch["cu_seqlens"][0] == 0 and sum(lengths) == 100 and all(16 <= n < 25 for n in lengths[:-1]) and 0 < lengths[-1] < 25


def test_bench_optim_times_the_2_6b_parameters_its_docstring_counts():
    """make_params' GPU set (4 layers of attention, a dense MLP, 3 expert stacks and 2 norms),
    built on the meta device: 2,617,262,080 parameters; Muon's matrices all but the norms."""
    _common()
    import bench_optim

    real_randn = torch.randn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randn", lambda *s, device=None, **kw: real_randn(*s, device="meta", **kw))
        params = bench_optim.make_params(False, torch.device("meta"))
    assert sum(p.numel() for p in params) == 2_617_262_080 and len(params) == 44
    assert sum(p.numel() for p in params if p.ndim >= 2) == 2_617_262_080 - 4 * 2 * 2048


def test_bench_optim_s_clipped_rows_run_the_clip_they_name(monkeypatch):
    """IMPLS' clipped rows: "+ clip factor" hands the step clip_factor(grad_norm, 1.0), "+ fmoe
    clip" runs fmoe.optim.clip_grad_norm and "torch fused + clip" torch's clip_grad_norm_, each
    before a plain step; the unclipped rows step alone."""
    _common()
    import bench_optim

    calls = []
    monkeypatch.setattr(bench_optim, "grad_norm", lambda ps: calls.append("grad_norm") or 4.0)
    monkeypatch.setattr(bench_optim, "clip_factor", lambda norm, max_norm: calls.append(("clip_factor", norm, max_norm)) or 0.25)
    monkeypatch.setattr(bench_optim, "clip_grad_norm", lambda ps, max_norm: calls.append(("fmoe clip", max_norm)))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda ps, max_norm: calls.append(("torch clip", max_norm)))

    class Opt:
        def step(self, grad_factor=None):
            calls.append(("step", grad_factor))

    want = {"fmoe fp32": [("step", None)], "fmoe bf16": [("step", None)], "torch fused": [("step", None)],
            "torch foreach": [("step", None)], "fmoe bf16 + clip factor": ["grad_norm", ("clip_factor", 4.0, 1.0), ("step", 0.25)],
            "fmoe bf16 + fmoe clip": [("fmoe clip", 1.0), ("step", None)], "torch fused + clip": [("torch clip", 1.0), ("step", None)]}
    assert list(bench_optim.IMPLS) == list(want)
    for name, (_, clip) in bench_optim.IMPLS.items():
        calls.clear()
        bench_optim.stepper(Opt(), [], clip)()
        assert calls == want[name], name


def test_bench_optim_stops_on_a_step_a_hundredth_off_torch_s(monkeypatch):
    """check_adamw stops the run when fmoe's update differs from torch's by more than 1e-3
    (relative norm): an AdamW at lr 1.01e-3 against torch's 1e-3 is 0.01 off."""
    _common()
    import bench_optim
    from fmoe.optim.adamw import AdamW

    torch.manual_seed(0)
    params = bench_optim.make_params(True, torch.device("cpu"))
    monkeypatch.setitem(bench_optim.IMPLS, "fmoe fp32", (lambda ps, dev: AdamW(ps, lr=1.01e-3, impl="torch"), None))
    with pytest.raises(SystemExit, match=r"fmoe fp32: its step differs from torch's AdamW by (0\.00999|0\.01) \(relative norm of the update\)"):
        bench_optim.check_adamw(params, torch.device("cpu"))


def test_bench_loss_measure_divides_the_baseline_s_time_and_each_peak_by_the_baseline_s(monkeypatch):
    """measure's speedup is the baseline's ms over the row's (fused 2 ms, eager 8 ms: 4x) and its
    ratio the row's peak over the baseline's (100 MiB against 400: 0.25, the quarter the fused
    linear cross-entropy aims at)."""
    _common()
    import bench_loss

    seen, ms, peaks = [], {"fused": 2.0, "eager": 8.0}, {"fused": 100.0, "eager": 400.0}
    monkeypatch.setattr(bench_loss, "bench", lambda fn, device, **kw: ms[kw["label"].removeprefix("c-")])
    monkeypatch.setattr(bench_loss, "peak_mib", lambda fn, device: (fn(), peaks[seen[-1]])[1])
    impls = {name: (lambda name=name: seen.append(name)) for name in ms}
    rows = bench_loss.measure("c", impls, lambda name: (), "eager", torch.device("cpu"), lambda row: {"floor_ms": row["ms"] / 2})
    assert rows == [{"case": "c", "impl": "fused", "ms": 2.0, "peak_MiB": 100.0, "speedup": 4.0, "ratio": 0.25, "floor_ms": 1.0},
                    {"case": "c", "impl": "eager", "ms": 8.0, "peak_MiB": 400.0, "speedup": 1.0, "ratio": 1.0, "floor_ms": 4.0}]


def _lease_parts() -> dict[str, str]:
    """gpu_lease.sh's parts: {letter: its body}."""
    import re

    lease = (ROOT / "benchmarks" / "gpu_lease.sh").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^([a-z])\)\n(.*?)^    ;;", lease, re.S | re.M)}


def test_the_lease_parts_name_tests_and_benchmarks_that_exist():
    """Every test node and benchmark a gpu_lease.sh part names exists: part m named a test
    renamed since (test_bench_times_a_slow_call_alone), and pytest ran none of its line."""
    import re

    parts = _lease_parts()
    assert len(parts) >= 20 and "v" in parts
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    named = 0
    for letter, body in parts.items():
        body = re.sub(r"<<'PROBE'.*?^PROBE$", "", body, flags=re.S | re.M)  # a probe's own Python
        aliases = dict(re.findall(r"^\s*(\w+)=(tests/\S+\.py)$", body, re.M))
        for path, name in re.findall(r"(\$\w+|tests/[\w/]+\.py)::(\w+)", body):
            path = aliases.get(path[1:], path) if path.startswith("$") else path
            assert (ROOT / path).is_file() and re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (letter, path, name)
            named += 1
        for path in re.findall(r"\b(tests/[\w/]+\.py)\b", body):
            assert (ROOT / path).is_file(), (letter, path)
        for only in re.findall(r"--only ([\w,\"$%{}#:*]+)", body):
            for name in only.strip('"').split(","):
                assert name.startswith("$") or name in scripts, (letter, name)
        for b in re.findall(r"\b(bench_\w+):\d+", body):
            assert b in scripts, (letter, b)
    assert named >= 6


def test_a_lease_part_stops_starting_steps_at_its_budget(tmp_path):
    """gpu_lease.sh cuts each pytest and benchmark limit to what is left of $BUDGET (a device
    call runs 600 s at most; part a's limits summed 620 s, j's 670 s, u's 600 s before
    run_all's start) and skips a step that would get under 20 s, saying so. Run with
    python3, nvidia-smi and pkill stood in for (each call recorded, nothing run)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls.txt"
    for name in ("python3", "nvidia-smi", "pkill"):
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\nexit 0\n')
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}")

    work = tmp_path / "checkout"  # the script's working directory (a repository root): nothing of this checkout is touched
    (work / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_lease.sh", work / "benchmarks")

    def run(part, budget):
        calls.write_text("")
        out = tmp_path / f"out_{part}_{budget}"
        done = subprocess.run(["bash", "benchmarks/gpu_lease.sh", part], cwd=work, env=dict(env, OUT=str(out), BUDGET=str(budget)),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout, calls.read_text().splitlines()

    stale = work / "bench_out" / "profile" / "bench_stale.txt"  # a warm machine's ops table of an earlier part
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("old")
    stdout, made = run("v", 540)
    assert not stale.exists() and not (tmp_path / "out_v_540" / stale.name).exists()
    benches = [c for c in made if "benchmarks/run_all.py" in c]
    assert [c.split("--only ")[1] for c in benches] == ["bench_activation_memory --timeout 120", "bench_rope --timeout 50",
                                                        "bench_scan --timeout 120"]
    assert any(c.startswith("python3 -m pytest -q -m gpu -n 6") for c in made)
    stdout, made = run("v", 15)  # the budget spent: the gpu tests get 15 s, no benchmark starts
    assert not [c for c in made if "benchmarks/run_all.py" in c] and any(c.startswith("python3 -m pytest") for c in made)
    # the script counts whole seconds ($SECONDS), so a tick between its start and a step takes
    # a second off what is left: a loaded machine gave 99 for 100 (a CI run failed on it)
    left = [int(n) for n in re.findall(r"not run, (\d+) s left of the part's 15 s", stdout)]
    assert len(left) == 3 and all(10 <= n <= 15 for n in left), stdout
    _, made = run("a", 100)  # part a's limits cut: 100 s for the tests, then what is left
    limits = [int(c.split("--timeout ")[1].split()[0]) for c in made if "benchmarks/run_all.py" in c]
    assert len(limits) == 4 and [limits[0], limits[2], limits[3]] == [60, 60, 90] and 95 <= limits[1] <= 100, limits


def test_run_all_s_smoke_results_stay_out_of_the_record():
    """run_all.py --smoke without --results appended its CPU section to the tracked
    benchmarks/RESULTS.md (the record of GPU runs); it goes to bench_out/RESULTS-smoke.md,
    which git ignores."""
    run_all = _run_all_module()
    assert run_all.default_results(False) == ROOT / "benchmarks" / "RESULTS.md"
    smoke = run_all.default_results(True)
    assert smoke == ROOT / "bench_out" / "RESULTS-smoke.md"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(smoke)], cwd=ROOT, capture_output=True)
    assert ignored.returncode == 0 or not (ROOT / ".git").exists()


def test_a_benchmark_refuses_an_out_it_cannot_write_before_timing(tmp_path):
    """--out naming a file: refused at the start (it failed with FileExistsError as the CSV
    was written, after every timing, and the table was never printed)."""
    (tmp_path / "taken").write_text("")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rope.py"), "--smoke", "--out", str(tmp_path / "taken")],
                          capture_output=True, text=True, env=_script_env(), timeout=120)
    assert done.returncode == 2 and f"--out: expected a directory for the CSV, got {str(tmp_path / 'taken')!r}" in done.stderr
    assert "device:" not in done.stdout  # before the device, the bandwidth and any timing


def test_bench_cpu_path_takes_the_median_after_its_warm_up_calls(monkeypatch):
    """--smoke's bench(): cpu_warmup untimed calls, then the median (not the mean or the
    fastest) of cpu_repeats calls timed by perf_counter, in ms."""
    common, clock, calls = _common(), [0.0], []
    costs = [9.0, 1.0, 2.0, 30.0, 3.0, 4.0]  # ms, the untimed call first
    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def fn():
        clock[0] += costs[len(calls)] / 1e3
        calls.append(1)

    ms = common.bench(fn, torch.device("cpu"), cpu_warmup=1, cpu_repeats=5)
    assert len(calls) == 6 and ms == pytest.approx(3.0), (len(calls), ms)


def test_device_ms_sleeps_ahead_of_the_calls_and_retries_with_4x_the_sleep_and_half_the_calls(monkeypatch):
    """device_ms on the host with a clock the calls move on: the host's 2 ms per call (3 probe
    calls) makes a sleep of 1.5 x 2 x 8 + 1 = 25 ms ahead of 8 calls; the device caught up
    (query() True), so 100 ms ahead of 4 calls (0.5 ms each): their median, not one over the
    first try's events too. With calls=2 the probe is 2 calls (1 ms each: 1.5 x 1 x 2 + 1 = 4
    ms). Caught up in every try: HostBehind, saying the last try's calls and sleep."""
    common, clock, calls, sleeps = _common(), [0.0], [], []
    queries = [True, False]
    device = _fake_cuda(monkeypatch, common, clock, queries, sleeps)

    def fn():
        calls.append(1)
        clock[0] += (2.0 if len(calls) <= 1 + 3 + 8 else 0.5) / 1e3

    assert common.device_ms(fn, device, calls=8) == pytest.approx(0.5)
    assert len(calls) == 1 + 3 + 8 + 4 and sleeps == pytest.approx([25000, 100000], abs=2) and queries == [], (len(calls), sleeps)

    calls.clear(), sleeps.clear()
    queries[:] = [False]

    def one_ms():
        calls.append(1)
        clock[0] += 1e-3

    assert common.device_ms(one_ms, device, calls=2) == pytest.approx(1.0)
    assert len(calls) == 1 + 2 + 2 and sleeps == pytest.approx([4000], abs=2), (len(calls), sleeps)

    sleeps.clear()
    queries[:] = [True, True, True]
    with pytest.raises(common.HostBehind, match=r"in 3 tries \(the last: 2 calls behind 400 ms, the host's estimate 2 ms per call\)"):
        common.device_ms(lambda: clock.__setitem__(0, clock[0] + 2e-3), device, calls=8)
    assert sleeps == pytest.approx([25000, 100000, 400000], abs=2) and queries == []


def test_device_columns_divide_the_bytes_floor_by_device_ms(monkeypatch, capsys):
    """device_floor_fraction = nbytes at the copy bandwidth (ms) over device_ms: 1 MB at 1 GB/s
    is 1 ms, over 2 ms: 0.5; no nbytes, no fraction; HostBehind: both empty, the reason printed."""
    common = _common()
    assert common.floor_fraction(3 * 10**6, 1e9, 2.0) == pytest.approx(1.5)
    monkeypatch.setattr(common, "device_ms", lambda fn, device: 2.0)
    assert common.device_columns(None, None, 1e9, 10**6) == {"device_ms": 2.0, "device_floor_fraction": pytest.approx(0.5)}
    assert common.device_columns(None, None, 1e9) == {"device_ms": 2.0, "device_floor_fraction": None}

    def behind(fn, device):
        raise common.HostBehind("the device caught up")

    monkeypatch.setattr(common, "device_ms", behind)
    assert common.device_columns(None, None, 1e9, 10**6) == {"device_ms": None, "device_floor_fraction": None}
    assert capsys.readouterr().out == "device_ms left empty: the device caught up\n"


def test_timing_row_gives_the_fused_row_its_speedups_over_the_baselines():
    """speedup_vs_<base> = the baseline's ms over fused's (3.0: fused 3x faster), on the fused
    row only; a baseline not timed leaves it empty."""
    common = _common()
    ms = {"fused": 2.0, "eager": 6.0}
    assert common.timing_row("c", "fwd", ms, "fused") == {"case": "c", "pass": "fwd", "impl": "fused", "ms": 2.0,
                                                          "speedup_vs_eager": 3.0, "speedup_vs_compiled": None}
    assert common.timing_row("c", "fwd", ms, "eager") == {"case": "c", "pass": "fwd", "impl": "eager", "ms": 6.0,
                                                          "speedup_vs_eager": None, "speedup_vs_compiled": None}


def test_copy_bandwidth_and_matmul_rate_count_both_sides_of_the_work(monkeypatch):
    """copy_bandwidth counts a copy's read and write (2 x its bytes per time), matmul_rate an
    n^3 matmul's 2 n^3 FLOPs; cuda_peak_bytes is the peak above what was held before."""
    common = _common()
    monkeypatch.setattr(common, "bench", lambda fn, device: (fn(), 0.5)[1])
    assert common.copy_bandwidth(torch.device("cpu"), 1 << 20) == pytest.approx(2 * (1 << 20) / 0.5e-3)
    assert common.matmul_rate(torch.device("cpu"), torch.float32, 4) == pytest.approx(2 * 64 / 0.5e-3)
    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 100), ("max_memory_allocated", 350)):
        monkeypatch.setattr(common.torch.cuda, name, lambda *a, value=value: value)
    assert common.cuda_peak_bytes(lambda: None, SimpleNamespace(type="cuda")) == 250


def test_check_agree_takes_the_worst_tensor_and_the_dtype_s_tolerance(capsys):
    """The largest rel_err (against the second name's tensors) over output and gradients:
    0.02 / 2.02 = 0.0099 passes in bf16 (2e-2), fails in float32 (1e-4)."""
    common = _common()
    got = {"a": (torch.ones(4), torch.ones(4)), "b": (torch.ones(4), torch.full((4,), 1.01))}
    common.check_agree("c", got, ("a", "b"), torch.bfloat16, " grads")
    assert capsys.readouterr().out == "c: checked (a vs b grads, relative error 0.0099); timing\n"
    with pytest.raises(SystemExit) as exc:
        common.check_agree("c", got, ("a", "b"), torch.float32)
    assert exc.value.code == "c: a and b disagree (relative error 0.0099)"
    got["b"] = got["b"][:1]  # an output without its gradient: not compared on the output alone
    with pytest.raises(SystemExit) as exc:
        common.check_agree("c", got, ("a", "b"), torch.bfloat16)
    assert exc.value.code == "c: a gave 2 tensors and b 1; nothing to compare them by"


def test_print_table_aligns_numbers_right_at_four_digits_and_the_csv_keeps_the_columns_order(capsys, tmp_path):
    common = _common()
    rows = [{"impl": "fused", "ms": 1.23456, "n": 7, "x": None}, {"impl": "eager-long", "ms": 12.0, "n": 10, "x": 0.5, "b": "y"}]
    common.print_table(rows, ["impl", "ms", "n", "x"])
    assert capsys.readouterr().out.splitlines() == [
        "impl           ms   n    x",
        "----------  -----  --  ---",
        "fused       1.235   7",
        "eager-long     12  10  0.5",
    ]
    common.write_csv(tmp_path / "sub" / "t.csv", rows)
    assert (tmp_path / "sub" / "t.csv").read_text().splitlines() == ["impl,ms,n,x,b", "fused,1.23456,7,,", "eager-long,12.0,10,0.5,y"]


def test_start_and_finish_record_the_dtype_the_copy_size_and_the_bandwidth_in_gb_per_s(monkeypatch, tmp_path, capsys):
    """start(): --smoke is float32 and a 64 MiB copy, a GPU run bf16 and 1 GiB; finish():
    every row gets the device and copy_GBps (bytes/s over 1e9) and the extra columns, and
    every table is printed; run_rate_cases' rows get matmul_TFLOPs (the rate over 1e12)."""
    common, sizes = _common(), []
    monkeypatch.setattr(common, "copy_bandwidth", lambda device, nbytes: (sizes.append(nbytes), 5e10)[1])
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--smoke", "--out", str(tmp_path)])
    args, device, dtype, bandwidth = common.start("A benchmark.")
    assert (device.type, dtype, bandwidth, sizes) == ("cpu", torch.float32, 5e10, [64 << 20])
    assert "copy bandwidth: 50.0 GB/s (copy of 64 MiB, read + write)" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--out", str(tmp_path)])
    monkeypatch.setattr(common, "bench_device", lambda smoke: torch.device("cpu"))
    assert common.start("A benchmark.")[2] == torch.bfloat16 and sizes[-1] == 1 << 30
    assert "copy bandwidth: 50.0 GB/s (copy of 1024 MiB, read + write)" in capsys.readouterr().out

    first, second = [{"case": "a", "ms": 1.5}], [{"case": "b", "extra": 3}]
    common.finish(SimpleNamespace(out=str(tmp_path)), torch.device("cpu"), 5e10, "bench_x", [(first, ["case", "ms"]), (second, ["extra"])], k=1)
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'bench_x.csv'}\n\ncase   ms\n") and out.rstrip().endswith("extra\n-----\n    3"), out
    assert (tmp_path / "bench_x.csv").read_text().splitlines() == ["case,ms,device,copy_GBps,k,extra", "a,1.5,cpu (smoke),50.0,1,",
                                                                  "b,,cpu (smoke),50.0,1,3"]
    monkeypatch.setattr(common, "start", lambda doc: (SimpleNamespace(smoke=True, out=str(tmp_path)), torch.device("cpu"), torch.float32, 5e10))
    monkeypatch.setattr(common, "matmul_rate", lambda device, dtype, n: (sizes.append(n), 2.5e12)[1])
    common.run_rate_cases("doc", "bench_r", lambda smoke: ["c"], lambda case, device, dtype, rate: [{"case": case, "rate": rate}], ["case"])
    assert sizes[-1] == 256 and "float32 matmul rate: 2.5 TFLOP/s (measured now)" in capsys.readouterr().out
    assert (tmp_path / "bench_r.csv").read_text().splitlines()[1] == "c,2500000000000.0,cpu (smoke),50.0,2.5"


def test_profile_call_names_each_label_s_traces_and_bench_profiles_only_labelled_timings(monkeypatch, tmp_path, capsys):
    """With --profile: a label's first trace is <benchmark>-<label>.json, a second _2; bench()
    without a label (the bandwidth and rate probes) profiles nothing; time_and_peak hands its
    label to bench() and gives (None, None) on out of memory, saying so."""
    common = _common()
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])
    monkeypatch.setattr(common, "_PROFILE", {"dir": tmp_path, "labels": {}})
    common.bench(lambda: torch.ones(2) + 1, torch.device("cpu"), 0, 1)
    assert list(tmp_path.iterdir()) == []
    traces = [common.profile_call(lambda: torch.ones(2) + 1, torch.device("cpu"), "q fwd/fused") for _ in range(2)]
    assert [t.name for t in traces] == ["bench_x-q_fwd_fused.json", "bench_x-q_fwd_fused_2.json"]
    table = (tmp_path / "bench_x.txt").read_text()
    assert table.startswith("== q fwd/fused (bench_x-q_fwd_fused.json)\n") and "== q fwd/fused (bench_x-q_fwd_fused_2.json)\n" in table
    labels = []

    def fake_bench(fn, device, label=None):
        labels.append(label)
        if label == "big":
            raise torch.OutOfMemoryError("out")
        return 1.5

    monkeypatch.setattr(common, "bench", fake_bench)
    assert common.time_and_peak(lambda: None, torch.device("cpu"), "x") == (1.5, None) and labels == ["x"]
    capsys.readouterr()
    assert common.time_and_peak(lambda: None, torch.device("cpu"), "big") == (None, None)
    assert capsys.readouterr().out == "big: out of memory\n"


def test_run_all_main_records_each_part_and_counts_a_timeout_as_a_failure(monkeypatch, tmp_path):
    """main() with run_part stood in for: the smoke note in the header, the children's
    environment without TRITON_INTERPRET and with this checkout first on PYTHONPATH, a week's
    --timeout accepted, a timed-out part's section and the summary naming it; the gpu tests'
    output cut to its last 60 lines; the part count with --gpu-tests."""
    run_all, seen = _run_all_module(), []

    def run_part(cmd, timeout, env):
        seen.append((cmd, timeout, env))
        out = "\n".join(f"line {i}" for i in range(70)) if "pytest" in cmd else "table"
        return {"status": None if "bench_loss" in cmd[1] else 0, "seconds": 1.5, "stdout": out + "\n", "stderr": " \n"}

    monkeypatch.setattr(run_all, "run_part", run_part)
    monkeypatch.setattr(run_all, "environment", lambda smoke: dict(date="D", device="cpu (smoke)", torch="T", triton="TR", cuda="none", commit="C"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    results, out = tmp_path / "R.md", tmp_path / "csv"
    assert run_all.main(["--smoke", "--only", "bench_rope,bench_loss", "--timeout", "604800", "--results", str(results), "--out", str(out)]) == 1
    text = results.read_text()
    assert text.startswith("## D: cpu (smoke)\n\ntorch T, triton TR, CUDA none, commit C; `")
    assert "`\n\nSMOKE RUN: CPU, tiny shapes; the times are NOT performance numbers.\n\n### bench_rope\n\n" in text
    assert f"benchmarks/bench_rope.py --out {out} --smoke`: exit 0, 1.5 s\n\n```text\ntable\n```\n\n" in text
    assert f"benchmarks/bench_loss.py --out {out} --smoke`: timed out after 604800 s, 1.5 s\n\n```text\ntable\n```\n\n" in text
    assert text.endswith("Did not exit 0: bench_loss.\n\n")
    assert [t for _, t, _ in seen] == [604800.0, 604800.0]
    assert all("TRITON_INTERPRET" not in env and env["PYTHONPATH"] == f"{run_all.ROOT}{os.pathsep}/elsewhere" for _, _, env in seen)
    results.unlink()
    assert run_all.main(["--gpu-tests", "--only", "bench_rope", "--results", str(results), "--out", str(out)]) == 0
    text = results.read_text()
    assert "SMOKE RUN" not in text and text.endswith("All 2 parts exited 0.\n\n")
    assert "```text\n[... the first 10 lines left out]\nline 10\nline 11\n" in text and "\nline 9\n" not in text


def test_run_all_sections_keep_a_timed_out_part_s_output_and_cut_only_beyond_the_tail():
    """run_part on a timeout: status None and what the part printed before it (stdout and
    stderr); section's tail note only when there are more lines than the tail."""
    run_all = _run_all_module()
    script = "import sys, time; print('before', flush=True); print('oops', file=sys.stderr, flush=True); time.sleep(60)"
    result = run_all.run_part([sys.executable, "-c", script], 3.0, dict(os.environ))
    assert result["status"] is None and result["stdout"] == "before\n" and result["stderr"] == "oops\n", result
    three = {"status": 0, "seconds": 0.0, "stdout": "a\nb\nc\n", "stderr": ""}
    assert run_all.section("t", ["x"], three, 1.0, tail=3).endswith("```text\na\nb\nc\n```\n\n")
    assert run_all.section("t", ["x"], three, 1.0, tail=2).endswith("```text\n[... the first 1 lines left out]\nb\nc\n```\n\n")
    assert run_all.section("t", ["x"], dict(three, stderr="e\n"), 1.0).endswith("```text\na\nb\nc\n--- stderr ---\ne\n```\n\n")


def test_run_all_environment_names_no_cuda_and_uncommitted_changes(monkeypatch):
    """torch.version.cuda None (a CPU build): "none"; a dirty checkout: the commit "with
    uncommitted changes"; nvidia-smi's GPUs joined by "; ", none: said so."""
    run_all = _run_all_module()
    answers = {"nvidia-smi": "", sys.executable: "None", "rev-parse": "abc123", "status": " M x.py"}
    monkeypatch.setattr(run_all, "_command_output", lambda cmd: answers[cmd[1] if cmd[0] == "git" else cmd[0]])
    info = run_all.environment(False)
    assert (info["cuda"], info["commit"], info["device"]) == ("none", "abc123 with uncommitted changes", "no GPU found by nvidia-smi")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", info["date"]), info["date"]
    answers.update({"nvidia-smi": "H100, 550\nH100, 550", sys.executable: "12.8", "status": ""})
    info = run_all.environment(False)
    assert (info["cuda"], info["commit"], info["device"]) == ("12.8", "abc123", "H100, 550; H100, 550")
    assert run_all.environment(True)["device"] == "cpu (smoke)"


def _kernel_stats():
    _common()  # benchmarks/ on the path
    import kernel_stats

    return kernel_stats


def test_kernel_stats_reads_registers_spills_and_instruction_counts(monkeypatch):
    """compile_stats with triton.compile, ptxas and cuobjdump stood in for: registers and spill
    stores from ptxas -v (-1 and 0 when absent), SASS counted by opcode before its first dot
    (SHFL.BFLY and SHFL.IDX are shuffles, LDS.U.128 a shared load); _aligned marks pointers
    and i32 scalars divisible by 16, not floats or constexprs."""
    ks = _kernel_stats()
    sass = "\n".join(f"        /*{i:04x}*/                   {op} ;" for i, op in
                     enumerate(["MOV R1, c[0x0][0x28]", "SHFL.BFLY PT, R3, R2, 0x10, 0x1f", "LDS.U.128 R4, [R0]", "SHFL.IDX PT, R5", "EXIT"]))
    info = ["ptxas info    : Used 40 registers, 8 bytes spill stores, 4 bytes spill loads"]

    def run(cmd, **kwargs):
        return SimpleNamespace(stderr=info[0], stdout=sass if "cuobjdump" in str(cmd[0]) else "")

    monkeypatch.setattr(ks, "ASTSource", lambda **kwargs: kwargs)
    monkeypatch.setattr(ks.triton, "compile", lambda src, target, options: SimpleNamespace(asm={"ptx": "ptx", "cubin": b"cubin"}))
    monkeypatch.setattr(ks.subprocess, "run", run)
    kernel = SimpleNamespace(arg_names=["x_ptr", "T", "scale", "BLOCK"])
    ptrs, scalars = {"x_ptr": "*bf16"}, {"T": "i32", "scale": "fp32"}
    assert ks.compile_stats(kernel, ptrs, scalars, {"BLOCK": 4}, 4) == dict(regs=40, spill=8, sass=5, shfl=2, lds=1)
    info[0] = ""
    assert ks.compile_stats(kernel, ptrs, scalars, {"BLOCK": 4}, 4) == dict(regs=-1, spill=0, sass=5, shfl=2, lds=1)
    assert ks._aligned(kernel, ptrs, scalars) == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}


def test_kernel_stats_prints_the_warp_instructions_per_row_of_a_program(monkeypatch, capsys):
    """A row per kernel: warps, rows per program (BLOCK_T, else BLOCK_R, else BLOCK_S), the
    stats, and SASS x warps / rows ("-" without rows); refused under TRITON_INTERPRET=1."""
    ks = _kernel_stats()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ks, "cases", lambda: iter([("a b", None, {}, {}, {"BLOCK_T": 4, "BLOCK_S": 64, "num_warps": 2}),
                                                   ("c", None, {}, {}, {"num_warps": 4})]))
    monkeypatch.setattr(ks, "compile_stats", lambda kernel, ptrs, scalars, const, num_warps: dict(regs=40, spill=0, sass=100, shfl=3, lds=2))
    with pytest.raises(SystemExit, match="unset TRITON_INTERPRET"):
        ks.main([])
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("TRITON_INTERPRET")
    ks.main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["kernel", "warps", "rows/prog", "regs", "spill", "B", "SASS", "SHFL", "LDS", "warp-instr/row"]
    assert [line.split() for line in lines[1:]] == [["a_b", "2", "4", "40", "0", "100", "3", "2", "50"], ["c", "4", "-", "40", "0", "100", "3", "2", "-"]]
