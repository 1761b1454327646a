"""Profile a few training steps: a torch.profiler trace, the ops' table, and on CUDA a
memory snapshot (examples/train_moe.py --profile=START:END, --memory_snapshot).

    steps = parse_steps("10:12")                       # (10, 12): steps 10, 11 and 12 (1-based, as logged)
    profiler = StepProfiler(out_dir, steps, rank=rank, device_type=device.type)
    for step in range(first, last + 1):
        profiler.start_step(step)
        with phase("forward_backward"): ...            # named ranges in the trace
        written = profiler.end_step(step)               # after the last profiled step: the files written

Each rank writes into out_dir/profile/:
- trace_rank{r}.json: the Chrome trace of the steps (open in https://ui.perfetto.dev or
  chrome://tracing), one "ProfilerStep#N" range per step N, the loop's phases (`phase`) inside;
- ops_rank{r}.txt: every op's calls and time over the steps, by self time (the device's on
  CUDA, the host's otherwise), with its input shapes;
- memory_rank{r}.pickle (memory=True, CUDA only): the allocator's history over the steps, for
  https://pytorch.org/memory_viz.

The profiled steps run slower than the others (the profiler records every op)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fmoe.ops.checks import check_bools, check_path, check_positive_int

PHASE_PREFIX = "fmoe."  # the loop's ranges in a trace: fmoe.forward_backward, fmoe.optimizer, ...


def parse_steps(spec: str) -> Optional[tuple[int, int]]:
    """"START:END" (1-based steps, both profiled) or "N" (that step alone), in ASCII digits ->
    (START, END); "" (or None) -> None. ValueError naming --profile for anything else."""
    if spec is None or spec == "":
        return None
    # ASCII digits alone: int() would also take "1_0" (10), "+3", " 4 " and other scripts' digits
    parts = spec.split(":") if isinstance(spec, str) else []
    if not 1 <= len(parts) <= 2 or not all(p.isascii() and p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        raise ValueError(f"--profile: expected START:END steps with 1 <= START <= END (or one step N), got {spec!r}")
    return int(parts[0]), int(parts[-1])


def activities(device_type: str) -> list:
    """What torch.profiler records on a device: the host's ops, and on CUDA the kernels."""
    out = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        out.append(torch.profiler.ProfilerActivity.CUDA)
    return out


def ops_table(prof: torch.profiler.profile, device_type: str, *, row_limit: int = -1, by_shape: bool = False) -> str:
    """prof's ops by self time (the device's on CUDA, the host's otherwise), by input shape
    with by_shape (the profile must record_shapes); the first row_limit rows (-1: every op,
    as ops_rank{r}.txt has them: a step records hundreds of op and shape pairs)."""
    sort = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=by_shape).table(sort_by=sort, row_limit=row_limit, max_name_column_width=60)


def phase(name: str):
    """A named range of the loop (fmoe.<name>) in a profiler trace; costs next to nothing
    when no profiler records."""
    if not isinstance(name, str):
        raise ValueError(f"name: expected the phase's name (a str), got {type(name).__name__}")
    return torch.profiler.record_function(PHASE_PREFIX + name)


class StepProfiler:
    """Records steps steps[0]..steps[1] (see the module docstring; steps=None: none), a pair of
    1-based steps as parse_steps returns (ValueError otherwise); start_step / end_step around
    every step, profiled or not (a step started past END while recording ends the recording
    first, as a missed end_step would have). rank: the file names' rank, an int >= 0.
    device_type: torch.device's type ("cuda": the kernels too). memory: also the CUDA
    allocator's history (ValueError on another device)."""

    def __init__(self, out_dir, steps: Optional[tuple[int, int]], *, rank: int = 0, device_type: str = "cpu", memory: bool = False):
        if steps is not None:
            pair = isinstance(steps, (tuple, list)) and len(steps) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            if not pair or not 1 <= steps[0] <= steps[1]:
                raise ValueError(f"steps: expected None or (START, END), ints with 1 <= START <= END as parse_steps returns, got {steps!r}")
            steps = tuple(steps)
        check_path("out_dir", out_dir, "the run's directory")
        check_positive_int("rank", rank, 0)
        check_bools(memory=memory)
        if not isinstance(device_type, str) or not device_type:
            raise ValueError(f"device_type: expected a device type such as 'cuda' or 'cpu', got {device_type!r}")
        if memory and device_type != "cuda":
            raise ValueError(f"--memory_snapshot: records the CUDA allocator; this run is on {device_type}")
        self.dir, self.steps, self.rank, self.device_type, self.memory = Path(out_dir) / "profile", steps, rank, device_type, memory
        self.prof: Optional[torch.profiler.profile] = None

    def start_step(self, step: int) -> None:
        """Call before step `step` (1-based) runs: the first profiled one starts the recording,
        the next ones each open their own range."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step: expected the step about to run (an int >= 1), got {step!r}")
        if self.prof is not None and step > self.steps[1]:  # end_step(END) was missed: write what was recorded
            self.close()
        if self.prof is not None:
            self.prof.step_num = step - 1  # step() counts on from here: the range is named after `step`, whatever came before
            self.prof.step()  # closes the last step's "ProfilerStep#N" range, opens this one's
            return
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        # a schedule that always records: the profiler then names each step's range "ProfilerStep#N"
        self.prof = torch.profiler.profile(activities=activities(self.device_type), record_shapes=True,
                                           schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        self.prof.step_num = step  # "ProfilerStep#N" names the logged step N
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.prof.start()

    def end_step(self, step: int) -> list[Path]:
        """Call after step `step`: a profiled step is closed, and after the last one (or
        the run's last step, `close`) the files are written; returns them ([] otherwise)."""
        return self.close() if self.prof is not None and step >= self.steps[1] else []

    def close(self) -> list[Path]:
        """Stop recording and write the files (the run ended inside the profiled steps)."""
        if self.prof is None:
            return []
        prof, self.prof = self.prof, None
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace, ops = self.dir / f"trace_rank{self.rank}.json", self.dir / f"ops_rank{self.rank}.txt"
        prof.export_chrome_trace(str(trace))
        ops.write_text(ops_table(prof, self.device_type, by_shape=True) + "\n")
        written = [trace, ops]
        if self.memory:
            snapshot = self.dir / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snapshot)
        return written

