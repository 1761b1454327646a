"""What a run records about itself, and how to make it bit-reproducible.

    set_deterministic(True)              the same losses, bit for bit, on the same machine
    run_info() -> dict                   torch / triton / fmoe versions, git commit, host
    write_config(out_dir, config, **extra) -> Path   <out_dir>/config.json

Determinism. PyTorch picks some kernels whose floating-point sums depend on thread or
warp timing (atomic adds, split reductions). set_deterministic(True) asks for the
deterministic ones everywhere (torch.use_deterministic_algorithms; an op that has none
raises instead of silently varying), makes cuBLAS use a fixed workspace
(CUBLAS_WORKSPACE_CONFIG, read when the first cuBLAS handle is made: call this before any
CUDA matmul) and turns cuDNN's autotuner off. fmoe's own kernels need no switch: none sums
floats with atomics (the routing, unpermute and grouped-GEMM backwards are gathers or
per-expert loops; the one atomic, the aux-score counts, adds integers), and the model's
embedding backward uses F.embedding, whose CPU kernel sums in a fixed order where
indexing (`weight[ids]`) does not. Runs are then identical on the same machine, thread
count and library versions; across machines or thread counts they may still differ in the
last bits (a different blocking of a matmul).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

import fmoe


def set_deterministic(enabled: bool = True) -> None:
    """Deterministic kernels for everything torch runs (module docstring); False undoes it."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False


def _git_commit(path: Path) -> Optional[str]:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def run_info() -> dict:
    """torch, triton and fmoe versions, the git commit of fmoe's source tree (None outside a
    git checkout), Python, the host and whether CUDA is available (and which GPU)."""
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fmoe": fmoe.__version__,
        "git_commit": _git_commit(Path(fmoe.__file__).resolve().parent),
        "python": platform.python_version(),
        "host": platform.node(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def write_config(out_dir, config: dict, **extra) -> Path:
    """Write <out_dir>/config.json: {"config": config, **extra, "run": run_info()} (config:
    every knob, e.g. dataclasses.asdict of the loop's Config). Returns the path."""
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a dict of knobs, got {type(config).__name__}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.json"
    path.write_text(json.dumps({"config": config, **extra, "run": run_info()}, indent=2, default=str) + "\n")
    return path
