"""examples/train_moe.py with rank 1 one data file short (as a node's stale copy of a text
directory): what tests/parallel/test_train_parallel.py launches to see a fault of one rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/parallel/one_rank_short.py --data=DIR ...
"""

import os
import pathlib
import runpy
import sys

import fmoe.train.data

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"

if os.environ.get("RANK") == "1":
    every_file = fmoe.train.data.list_text_files
    fmoe.train.data.list_text_files = lambda root: every_file(root)[:-1]
sys.argv = [str(SCRIPT), *sys.argv[1:]]
runpy.run_path(str(SCRIPT), run_name="__main__")
