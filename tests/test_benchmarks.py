"""Each benchmark's --smoke mode runs end to end (same code as on a GPU, tiny CPU shapes);
_common.device_ms times the device alone."""

import csv
import json
import os
import pathlib
import shlex
import subprocess
import sys

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
    if script == "bench_hyper_connections.py":  # the bytes its docstring counts (float32): the one stream's backward moves none
        for r in rows:
            T, H, n = int(r["T"]), int(r["H"]), int(r["streams"])
            want = 4 * T * (3 * H if r["impl"] == "one stream" else (2 if r["pass"] == "fwd" else 5) * (n * H + H))
            assert int(r["bytes"]) == want, r


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
def test_bench_times_a_slow_call_alone():
    """A call of 2 SLOW_MS on the device is called twice (one untimed) and timed once, not do_bench's dozen."""
    common, calls = _common(), []
    cycles = int(2 * common.SLOW_MS * common._sleep_cycles_per_ms())

    def slow():
        calls.append(1)
        torch.cuda._sleep(cycles)

    ms = common.bench(slow, torch.device("cuda"))
    assert len(calls) == 2 and 1.8 * common.SLOW_MS < ms < 2.5 * common.SLOW_MS, (calls, ms)


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
    import torch

    assert text.startswith("## ") and text.splitlines()[0].endswith(" UTC: cpu (smoke)")
    assert f"torch {torch.__version__}, triton " in text and "SMOKE RUN" in text
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
