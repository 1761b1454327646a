"""Test setup: Triton kernels run through the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is decided here, at
collection start. With CUDA the kernels are compiled and tests run on the GPU.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist

# subprocesses (torchrun runs of examples/, benchmark scripts) import this checkout's fmoe,
# not whichever one the environment has installed (an editable install of another clone)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# under pytest-xdist (make test: a worker per core) each worker's torch, and the scripts it runs (OMP_NUM_THREADS,
# which torchrun keeps), take its share of the cores: N workers of N threads each would contend for them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
# where the Triton-vs-reference tests run: the GPU when kernels compile for it
DEVICE = "cuda" if HAS_CUDA and not INTERPRETING else "cpu"


def pytest_configure(config):
    """The slowest tests by CPU time after --durations' wall-clock list (tests/cpu_times.py)."""
    from tests import cpu_times

    config.pluginmanager.register(cpu_times, "cpu_times")


def pytest_report_header(config):
    """The reason Triton-interpreter tests will fail here, at the top of the run (None: none)."""
    from fmoe.ops.backend import INTERPRETER_PROBLEM

    return f"WARNING: {INTERPRETER_PROBLEM}" if INTERPRETING and INTERPRETER_PROBLEM is not None else None


# the files that take longest (--durations), run first: under make test's workers (a file per worker, started in this
# order: --no-loadscope-reorder) the last files to start are then short ones, not a long one on one worker while the
# other has nothing left to run
_LONGEST_FIRST = ("tests/test_train_loop.py", "tests/parallel/test_train_parallel.py", "tests/test_hf.py", "tests/test_benchmarks.py",
                  "tests/parallel/test_model_parallel.py", "tests/test_export_hf.py", "tests/test_model.py", "tests/test_evaluate.py",
                  "tests/test_generate.py")


def pytest_collection_modifyitems(config, items):
    first = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the other files in their order
    if HAS_CUDA and not INTERPRETING:
        return
    reason = "needs a CUDA device with compiled Triton kernels (run `make test-gpu` on a GPU machine)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def op_shapes():
    """A recorder of the ops run while it is active: `with op_shapes() as rec:`, then
    rec.shapes() (every tensor any op returned, its shape, in order) or rec.shapes(op, ...)
    (those of the ops named: torch.ops.aten.mm.default, ...). Shapes only: works on meta tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []  # (op, shape)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen += [(func, tuple(o.shape)) for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
            return out

        def shapes(self, *ops):
            return [shape for func, shape in self.seen if not ops or func in ops]

    return OpShapes


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_rank_mesh():
    """A gloo process group of one rank in this process and its 1-D CPU DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
