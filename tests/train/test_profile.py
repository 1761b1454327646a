"""fmoe.train.profile: the steps asked for are traced (and no others), with the loop's phases
and each op's time; bad step ranges and a memory snapshot off CUDA are refused."""

import json
import re

import pytest
import torch

from fmoe.train import profile as profile_module
from fmoe.train.profile import StepProfiler, activities, ops_table, parse_steps, phase


def test_steps_parse_as_users_type_them():
    assert parse_steps("") is None
    assert parse_steps("10:12") == (10, 12) and parse_steps("7") == (7, 7) and parse_steps("3:3") == (3, 3)
    for bad in ("3:2", "0:2", "x", "1:y", "1:2:3", ":", "-1"):
        with pytest.raises(ValueError, match=r"--profile: expected START:END steps with 1 <= START <= END \(or one step N\), got "):
            parse_steps(bad)


def test_steps_are_ascii_digits_in_a_string():
    """int() takes "1_0" as 10 and other scripts' digits ("٣": 3); a number or a pair is no spec string."""
    for bad in ("1_0", "٣", "1:٣", "+3", " 4 ", 5, (1, 2)):
        with pytest.raises(ValueError, match=r"--profile: expected START:END steps with 1 <= START <= END \(or one step N\), got "):
            parse_steps(bad)


def test_the_profiler_refuses_steps_parse_steps_would_not_give(tmp_path):
    """Refused when made, not at the first start_step or end_step (a TypeError or an IndexError there)."""
    for bad in ((5, 3), (0, 2), "2:3", (3,), (1, 2, 3), (1.0, 2), 4):
        with pytest.raises(ValueError, match=r"steps: expected None or \(START, END\), ints with 1 <= START <= END as parse_steps returns"):
            StepProfiler(tmp_path, bad)
    assert StepProfiler(tmp_path, [2, 3]).steps == (2, 3)


def _run(profiler, steps):
    """A loop of `steps` steps, each a matmul inside a phase; {step: files written}."""
    x = torch.randn(32, 48)
    written = {}
    for step in range(1, steps + 1):
        profiler.start_step(step)
        with phase("forward_backward"):
            x @ x.t()
        if step % 2:
            with phase("optimizer"):
                x.mul_(1.0)
        written[step] = profiler.end_step(step)
    return written


def _trace(path):
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_the_steps_asked_for_are_traced_with_the_phases_and_the_ops(tmp_path):
    profiler = StepProfiler(tmp_path, (2, 3), rank=1)
    written = _run(profiler, 5)
    files = [tmp_path / "profile" / "trace_rank1.json", tmp_path / "profile" / "ops_rank1.txt"]
    assert written == {1: [], 2: [], 3: files, 4: [], 5: []}  # written once, after the last profiled step
    assert profiler.close() == []
    events = _trace(files[0])
    steps = sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # the logged step numbers; steps 1, 4 and 5 are not there
    phases = [e["name"] for e in events if e["name"].startswith("fmoe.")]
    assert sorted(phases) == ["fmoe.forward_backward", "fmoe.forward_backward", "fmoe.optimizer"]  # the optimizer ran at step 3
    mm = [e for e in events if e["name"] == "aten::mm"]
    assert len(mm) == 2 and all(e["args"]["Input Dims"] == [[32, 48], [48, 32]] for e in mm)
    table = files[1].read_text()
    assert "Self CPU" in table and "aten::mm" in table and "[[32, 48], [48, 32]]" in table


def test_the_ops_table_has_every_op_and_shape_by_self_time(tmp_path):
    """ops_rank{r}.txt: every op and shape pair the steps ran (150 matmul shapes here: a
    step's hundreds were cut to the first 100 rows), the rows by self time, the largest first;
    on CUDA the kernels are recorded too."""
    profiler = StepProfiler(tmp_path, (1, 1))
    profiler.start_step(1)
    for n in range(1, 151):
        torch.randn(n, 8) @ torch.randn(8, 4)
    ops = profiler.end_step(1)[1].read_text()
    shapes = re.findall(r"aten::mm .*?\[\[(\d+), 8\], \[8, 4\]\]", ops)
    assert sorted(int(n) for n in shapes) == list(range(1, 151)), len(shapes)
    assert ops.splitlines()[1].split()[:4] == ["Name", "Self", "CPU", "%"]
    rows = [line for line in ops.splitlines()[3:] if line.strip() and not line.startswith(("-", "Self CPU time total"))]
    percents = [float(line.split()[1].rstrip("%")) for line in rows]  # op names have no spaces
    assert len(percents) > 150 and percents == sorted(percents, reverse=True), percents[:10]
    assert activities("cpu") == [torch.profiler.ProfilerActivity.CPU]
    assert activities("cuda") == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def test_a_run_that_ends_inside_the_steps_writes_on_close(tmp_path):
    profiler = StepProfiler(tmp_path, (2, 9))
    assert all(files == [] for files in _run(profiler, 3).values())
    files = profiler.close()
    assert [f.name for f in files] == ["trace_rank0.json", "ops_rank0.txt"]
    assert sorted(e["name"] for e in _trace(files[0]) if e["name"].startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert profiler.close() == []  # once


def test_no_steps_record_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, None)
    assert all(files == [] for files in _run(profiler, 3).values()) and profiler.close() == []
    assert not (tmp_path / "profile").exists()


def test_a_memory_snapshot_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match="--memory_snapshot: records the CUDA allocator; this run is on cpu"):
        StepProfiler(tmp_path, (1, 1), device_type="cpu", memory=True)


@pytest.mark.gpu
def test_a_memory_snapshot_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the allocator's history is a CUDA feature")
    import pickle

    profiler = StepProfiler(tmp_path, (1, 1), device_type="cuda", memory=True)
    profiler.start_step(1)
    x = torch.randn(1024, 1024, device="cuda")
    (x @ x).sum().item()
    files = profiler.end_step(1)
    assert [f.name for f in files] == ["trace_rank0.json", "ops_rank0.txt", "memory_rank0.pickle"]
    snapshot = pickle.loads(files[2].read_bytes())
    assert snapshot["device_traces"] and any(e["action"] == "alloc" for e in snapshot["device_traces"][0])
    assert "Self CUDA" in files[1].read_text()


def test_a_missed_end_step_does_not_record_past_end_and_steps_are_named_by_their_number(tmp_path):
    """start_step alone over steps 1..5 with steps (2, 3) recorded steps 2, 3, 4 and 5 (nothing
    stopped at END); a step started twice was named by the profiler's own count (#1, #2, #3
    for two steps)."""
    profiler = StepProfiler(tmp_path, (2, 3))
    x = torch.randn(8, 8)
    for step in range(1, 6):
        profiler.start_step(step)  # end_step never called
        x @ x
    files = [tmp_path / "profile" / "trace_rank0.json", tmp_path / "profile" / "ops_rank0.txt"]
    assert all(f.is_file() for f in files) and profiler.close() == []  # written when step 4 started
    assert sorted(e["name"] for e in _trace(files[0]) if e["name"].startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    again = StepProfiler(tmp_path / "again", (1, 2))
    for step in (1, 1, 2):  # step 1 started twice (a retried step)
        again.start_step(step)
        x @ x
    names = sorted(e["name"] for e in _trace(again.close()[0]) if e["name"].startswith("ProfilerStep#"))
    assert names == ["ProfilerStep#1", "ProfilerStep#1", "ProfilerStep#2"]


def test_bad_arguments_name_themselves(tmp_path):
    """These escaped as TypeErrors from pathlib or a comparison, or were taken silently."""
    for kw, match in [(dict(out_dir=None), "out_dir: expected the run's directory"), (dict(out_dir=5), "out_dir: expected"),
                      (dict(rank="x"), "rank: expected an int, got 'x'"), (dict(rank=-1), "rank: expected >= 0, got -1"), (dict(rank=True), "rank: expected an int"),
                      (dict(device_type=None), "device_type: expected"), (dict(device_type=""), "device_type: expected"),
                      (dict(memory="yes", device_type="cuda"), "memory: expected a bool")]:
        with pytest.raises(ValueError, match=match):
            StepProfiler(**{"out_dir": tmp_path, "steps": (1, 1), **kw})
    profiler = StepProfiler(tmp_path, (1, 1))
    for step in ("1", None, 1.5, 0, True):
        with pytest.raises(ValueError, match="step: expected the step about to run"):
            profiler.start_step(step)
    assert profiler.prof is None
    with pytest.raises(ValueError, match="name: expected the phase's name"):
        phase(5)


def test_the_profiler_refuses_bool_steps(tmp_path):
    """A bool is an int to isinstance: (True, 2) was taken as steps 1..2."""
    for bad in ((True, 2), (1, True), [False, 3]):
        with pytest.raises(ValueError, match=r"steps: expected None or \(START, END\), ints with 1 <= START <= END as parse_steps returns"):
            StepProfiler(tmp_path, bad)


def test_only_cuda_records_the_kernels():
    """The CUDA activity on a CUDA device only: another accelerator's run records the host's ops."""
    for device_type in ("cpu", "mps", "xpu", "meta"):
        assert activities(device_type) == [torch.profiler.ProfilerActivity.CPU], device_type
    assert activities("cuda") == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def test_the_ops_table_sorts_by_the_devices_self_time_on_cuda():
    """On CUDA the rows are by the kernels' self time (the host's would rank launch overheads first)."""
    class Recorded:  # a profile: the arguments key_averages and table were given
        def key_averages(self, group_by_input_shape):
            self.by_shape = group_by_input_shape
            return self

        def table(self, **kwargs):
            self.kwargs = kwargs
            return "table"

    for device_type, sort in (("cuda", "self_device_time_total"), ("cpu", "self_cpu_time_total")):
        prof = Recorded()
        assert ops_table(prof, device_type, by_shape=True) == "table"
        assert prof.kwargs["sort_by"] == sort and prof.kwargs["row_limit"] == -1 and prof.by_shape is True


def test_the_ops_table_names_the_loops_phases_in_full(tmp_path):
    """Names up to 60 characters are not cut: the phase fmoe.forward_backward (21) is a row of its own."""
    profiler = StepProfiler(tmp_path, (1, 1))
    profiler.start_step(1)
    with phase("forward_backward"):
        torch.randn(8, 8) @ torch.randn(8, 8)
    ops = profiler.end_step(1)[1].read_text()
    assert any(line.split()[:1] == ["fmoe.forward_backward"] for line in ops.splitlines()), ops[:2000]


def test_a_memory_snapshot_records_the_steps_and_stops_after(tmp_path, monkeypatch):
    """memory=True (CUDA's allocator, stood in for here): the history starts with the first
    profiled step, is dumped to memory_rank{r}.pickle after the last, then stops recording,
    and the snapshot is among the files returned."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append(("record", a, kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: (calls.append(("dump", path)), open(path, "wb").close()))
    monkeypatch.setattr(profile_module, "activities", lambda device_type: [torch.profiler.ProfilerActivity.CPU])  # no CUDA here
    profiler = StepProfiler(tmp_path, (2, 2), rank=3, device_type="cuda", memory=True)
    profiler.start_step(1)
    assert profiler.end_step(1) == [] and calls == []
    profiler.start_step(2)
    assert calls == [("record", (), {"max_entries": 1_000_000})]
    torch.randn(8, 8) @ torch.randn(8, 8)
    files = profiler.end_step(2)
    snapshot = tmp_path / "profile" / "memory_rank3.pickle"
    assert [f.name for f in files] == ["trace_rank3.json", "ops_rank3.txt", "memory_rank3.pickle"] and files[2] == snapshot
    assert calls[1:] == [("dump", str(snapshot)), ("record", (), {"enabled": None})]  # recording stopped after the dump
