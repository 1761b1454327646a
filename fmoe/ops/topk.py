"""Top-k helpers shared by the routing and balancing ops (torch and Triton).

    sort_desc(x, dim=-1)       indices sorting x descending; ties keep the lower index first
    sort_key(score) (Triton)   an order-preserving int32 image of a float32 score
    key_score(key) (Triton)    the score back from its image
    NO_KEY, NO_ID              the image of an unavailable lane; an id larger than any expert
    rows_per_program(n)        rows per one-warp program of the row-wise kernels

Selection in the kernels works on the int32 images of float32 scores: integer max and
equality are exact, and an unavailable lane (NO_KEY) sorts below every score, -inf
included. Each pick is two warp reductions: the best image, then the lowest id holding it
(the references' tie rule, sort_desc).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_KEY = tl.constexpr(-(2**31))
NO_ID = tl.constexpr(2**30)


def sort_desc(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices that sort x descending along dim; ties keep the lower index first."""
    return torch.sort(x, dim=dim, descending=True, stable=True).indices


@triton.jit
def sort_key(score):
    """The int32 image of a float32 score: a >= b exactly when sort_key(a) >= sort_key(b).
    A NaN of either sign is above every number, as in torch.sort (NaNs tie with each other)."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with +0.0, as in the reference
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(score != score, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))


@triton.jit
def key_score(key):
    """The float32 score whose image is key (the inverse of sort_key)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


def rows_per_program(row_elems: int) -> int:
    """Rows per one-warp program: about 16 elements of the padded rows per lane, and at
    least 2 rows. A row then never leaves its warp, so its many reductions are shuffles,
    never shared memory. Chosen by the SASS per row (benchmarks/kernel_stats.py): 1-4
    warps of one row each cost more in the forward, and one row per warp made the
    backward 5x longer."""
    return max(2, min(128, 512 // row_elems))
