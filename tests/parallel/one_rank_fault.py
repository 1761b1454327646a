"""An example script with rank 1 seeing its files otherwise than rank 0 (a node's stale or
partial copy): what tests/parallel/test_train_parallel.py launches to see a fault of one rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/parallel/one_rank_fault.py FAULT SCRIPT ARGS...

FAULT: none, short_data (a text directory one file short), older_checkpoint (a run's newest
checkpoint not yet there: the one before it is the newest), other_path (rank 1's copy of a
path is another: FMOE_TEST_OTHER_PATH="OLD=>NEW" replaces OLD by NEW in its arguments),
drift (rank 1's first parameter of fmoe's AdamW moves by 1e-3 after its second step: a
replica that no longer agrees).
SCRIPT: train_moe, evaluate, generate or export_hf (examples/).
"""

import os
import pathlib
import runpy
import sys

import torch

import fmoe.optim
import fmoe.train.checkpoint
import fmoe.train.data

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
fault, script = sys.argv[1], EXAMPLES / f"{sys.argv[2]}.py"
if os.environ.get("RANK") == "1":
    if fault == "short_data":
        every_file = fmoe.train.data.list_text_files
        fmoe.train.data.list_text_files = lambda root: every_file(root)[:-1]
    elif fault == "older_checkpoint":
        newest = fmoe.train.checkpoint.latest

        def older(out_dir, **kwargs):
            found = newest(out_dir, **kwargs)
            steps = sorted(pathlib.Path(out_dir).glob("step_[0-9]*[0-9]"))
            return steps[-2] if found is not None and len(steps) > 1 else found

        fmoe.train.checkpoint.latest = older
    elif fault == "drift":
        adamw_step, steps = fmoe.optim.AdamW.step, []

        def drifting(self, *args, **kwargs):
            out = adamw_step(self, *args, **kwargs)
            steps.append(1)
            if len(steps) == 2:
                with torch.no_grad():
                    p = self.param_groups[0]["params"][0]
                    (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)
            return out

        fmoe.optim.AdamW.step = drifting
    elif fault == "none":  # a check each rank makes of its own part: no fault needed
        pass
    elif fault == "other_path":  # the arguments name a path rank 1 holds another copy of
        old, new = os.environ["FMOE_TEST_OTHER_PATH"].split("=>")
        sys.argv = [arg.replace(old, new) for arg in sys.argv]
    else:
        raise SystemExit(f"one_rank_fault.py: unknown fault {fault!r}")
sys.argv = [str(script), *sys.argv[3:]]
runpy.run_path(str(script), run_name="__main__")
