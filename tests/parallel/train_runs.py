"""Several runs of examples/train_moe.py in one launch: each argument list of a JSON file in
turn, through the script's main, in one process group set up here (main uses a group it
finds and leaves it up). Starting a process, importing torch and fmoe, and joining a gloo
group cost a 4-rank launch about 9 s on 2 cores, more than most of the tests' 5-step runs.

    python -m torch.distributed.run --standalone --nproc-per-node=4 tests/parallel/train_runs.py runs.json
    python tests/parallel/train_runs.py runs.json          # one process (no group)

runs.json: a list of argument lists, e.g. [["--out_dir=a", "--ep=2"], ["--out_dir=b", "--tp=2"]].
A run that fails (a refusal, an exception) ends the launch with its traceback, after a line
on standard error naming it; the runs after it do not start.
"""

import importlib.util
import json
import os
import pathlib
import sys

import torch.distributed as dist

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"


def main(spec: str) -> None:
    runs = json.loads(pathlib.Path(spec).read_text())
    if not isinstance(runs, list) or not all(isinstance(argv, list) and all(isinstance(a, str) for a in argv) for argv in runs):
        raise SystemExit(f"{spec}: expected a JSON list of argument lists (strings)")
    loader = importlib.util.spec_from_file_location("train_moe", SCRIPT)
    script = importlib.util.module_from_spec(loader)
    sys.modules["train_moe"] = script  # its dataclasses look their module up
    loader.loader.exec_module(script)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        # the caller's group: main takes it as it is, without the launcher's variables (a group made otherwise has none)
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name)
    sys.path.insert(0, str(SCRIPT.parents[1]))  # the repository root, for tests.parallel.dist when run by hand
    from tests.parallel.dist import own_groups

    for i, argv in enumerate(runs):
        try:
            with own_groups():  # each run's mesh groups destroyed after it: idle gloo groups' threads cost CPU time
                script.main(argv)
        except BaseException:
            print(f"train_runs: run {i + 1} of {len(runs)} failed: {' '.join(argv)}", file=sys.stderr, flush=True)
            raise
    from fmoe.parallel import leave_ranks

    leave_ranks()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} runs.json")
    main(sys.argv[1])
