"""Packed sequences: positions, rolls inside each sequence, MTP targets (SPEC.md section 5).

    positions_from_cu_seqlens(cu_seqlens[N+1]) -> positions[T] int64
    roll_packed(x[..., T, ...], cu_seqlens[N+1], shift=-1, dim=0, fill=0) -> x[..., T, ...]
    mtp_targets(tokens[T], cu_seqlens[N+1], depth) -> depth + 1 TensorDicts [T]

cu_seqlens (int32 / int64) delimits N packed sequences along the token dim: sequence j holds
tokens cu[j] <= t < cu[j+1], with 0 = cu[0] <= cu[1] <= ... <= cu[N] = T (empty sequences
allowed). For a token t of sequence j:

    positions[t] = t - cu[j]
    roll_packed(x, shift)[t] = x[t - shift]   if cu[j] <= t - shift < cu[j+1]
                             = fill           otherwise

shift = -1 reads the next token (next-token labels); every slice along the other dims is
rolled the same way. Rolling by -a then -b equals rolling by -(a+b) (the filled tail of
each sequence only grows). The roll is linear in x: its gradient is the opposite roll
with fill 0, d x = roll_packed(d out, -shift, fill=0).

The kernel is one gather over a contiguous [O, T, I] view of x (O the dims before `dim`,
I the dims after): each program binary-searches cu_seqlens for the sequence of its BLOCK_T
tokens (ceil(log2 N) + 2 loads of cu_seqlens per token, cache hits; no host sync) and
copies [BLOCK_T, BLOCK_I] tiles of the source rows. It moves bits: x is seen as integers
of its element size, so every dtype (bool, ints, floats) shares one kernel per width and
is copied exactly.

Legend: T tokens (the rolled dim), N sequences, O outer = prod(shape[:dim]),
I inner = prod(shape[dim+1:]), D MTP depth.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import check_cu_seqlens, check_device, check_index, check_positive_int, holds_values

if TYPE_CHECKING:  # imported where used: tensordict's import brings torch._dynamo, a second at `import fmoe.ops`
    from tensordict import TensorDict

# the integer dtype the kernel sees x as, by element size
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def sequence_ids(cu_seqlens: torch.Tensor, n_tokens: int, *, index: torch.Tensor | None = None) -> torch.Tensor:
    """[T] int64: the index j of the packed sequence holding each token, cu[j] <= t < cu[j+1].

    index: the tokens t to look up (any shape, int; e.g. a context-parallel rank's global
    indices); None: 0 .. n_tokens - 1. Validated cu_seqlens assumed (no host sync).
    Example: [0, 3, 3, 5], 5 -> [0, 0, 0, 2, 2].
    """
    cu = cu_seqlens.long()
    t = torch.arange(n_tokens, device=cu.device) if index is None else index.to(device=cu.device, dtype=torch.int64)
    # j = #{ends cu[1..N] <= t}: ends of empty sequences before t are counted, so t lands in
    # the one non-empty sequence holding it. Counted over all of cu (cu[0] = 0 <= t), minus
    # one: a search in cu[1:] would make torch.compile specialise a one-document batch's
    # cu_seqlens length (a contiguity check of the N-element slice asks whether N < 2)
    return torch.searchsorted(cu, t, right=True) - 1


def _seq_start_end_ref(cu_seqlens, T):
    """(start [T], end [T]) int64: the bounds cu[j], cu[j+1] of each token's sequence j."""
    cu = cu_seqlens.long()
    seq_T = sequence_ids(cu, T)
    return cu[seq_T], cu[seq_T + 1]


def positions_ref(cu_seqlens, T):
    start_T, _ = _seq_start_end_ref(cu_seqlens, T)
    return torch.arange(T, device=start_T.device) - start_T


def roll_packed_ref(x, cu_seqlens, shift, dim, fill):
    """Plain-torch roll_packed (a gather and a select); differentiable w.r.t. float x."""
    T = x.shape[dim]
    start_T, end_T = _seq_start_end_ref(cu_seqlens.to(x.device), T)
    src_T = torch.arange(T, device=x.device) - shift
    # within [0, T) too: unchecked cu_seqlens (check=False) may bound a sequence outside x
    valid_T = (src_T >= start_T) & (src_T < end_T) & (src_T >= 0) & (src_T < T)
    rolled = x.index_select(dim, src_T.clamp(0, max(T - 1, 0)))
    bcast = [1] * x.ndim
    bcast[dim] = T
    fill_value = torch.full((), fill, dtype=x.dtype, device=x.device)
    return torch.where(valid_T.view(bcast), rolled, fill_value)


# ----------------------------------------------------------------------------------------
# 2. Triton kernel
# ----------------------------------------------------------------------------------------


@triton.jit
def _roll_packed_kernel(
    x_ptr, cu_ptr, fill_ptr, out_ptr, T, INNER, n_seqs, n_steps, shift,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """out[o, t, :] = x[o, t - shift, :] if t - shift is in t's sequence, else fill.

    Program pid takes tokens [BLOCK_T * (pid % blocks), ...) of outer slice pid // blocks,
    so consecutive programs walk along T. x and out are [O, T, INNER] integer views."""
    pid = tl.program_id(0)
    t_blocks = tl.cdiv(T, BLOCK_T)
    o = pid // t_blocks
    t_T = (pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok_T = t_T < T

    # binary search keeping cu[lo] <= t < cu[hi]: n_steps = ceil(log2 N) halvings leave
    # hi = lo + 1. mid always lies in [0, N], so the loads need no mask, even for t >= T.
    lo_T = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi_T = tl.zeros([BLOCK_T], dtype=tl.int32) + n_seqs
    for _ in range(n_steps):
        mid_T = (lo_T + hi_T) >> 1
        below_T = tl.load(cu_ptr + mid_T).to(tl.int32) <= t_T
        lo_T = tl.where(below_T, mid_T, lo_T)
        hi_T = tl.where(below_T, hi_T, mid_T)
    start_T = tl.load(cu_ptr + lo_T).to(tl.int32)
    end_T = tl.load(cu_ptr + hi_T).to(tl.int32)
    src_T = t_T - shift
    # within [0, T) too: unchecked cu_seqlens may bound a sequence outside x (never read there)
    valid_T = t_ok_T & (src_T >= start_T) & (src_T < end_T) & (src_T >= 0) & (src_T < T)

    fill = tl.load(fill_ptr).to(out_ptr.dtype.element_ty)
    slice_off = o.to(tl.int64) * T * INNER
    src_off_T = slice_off + tl.where(valid_T, src_T, 0).to(tl.int64) * INNER
    dst_off_T = slice_off + t_T.to(tl.int64) * INNER
    i_I = tl.arange(0, BLOCK_I)
    for i0 in range(0, INNER, BLOCK_I):
        cols_I = i0 + i_I
        col_ok_I = cols_I < INNER
        v = tl.load(x_ptr + src_off_T[:, None] + cols_I[None, :], mask=valid_T[:, None] & col_ok_I[None, :], other=0)
        v = tl.where(valid_T[:, None], v, fill)
        tl.store(
            out_ptr + dst_off_T[:, None] + cols_I[None, :], v.to(out_ptr.dtype.element_ty),
            mask=t_ok_T[:, None] & col_ok_I[None, :],
        )


def _roll_blocks(inner: int) -> dict:
    """A [BLOCK_T, BLOCK_I] tile of up to 2048 elements on 4 warps and a loop over I
    (hidden states [T, 2048]: 2 x 1024, 16 per thread, two 16-byte accesses in bf16).
    Small I packs more tokens per program, at most 512: the search keeps three int32 per
    token live, and 2048 tokens took 168-199 registers for ids and masks (512: 38-40,
    benchmarks/kernel_stats.py)."""
    block_i = min(next_pow2(inner), 1024)
    return dict(BLOCK_T=min(512, 2048 // block_i), BLOCK_I=block_i, num_warps=4)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration (the backward is the same op, rolled the other way)
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::roll_packed", mutates_args=())
def _roll_packed_op(
    x: torch.Tensor, cu_seqlens: torch.Tensor, shift: int, dim: int, fill: Union[int, float, bool]
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T = x.shape[dim]
    outer, inner = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    if x.numel() == 0:
        return out
    bits = _BITS[x.element_size()]
    fill_1 = torch.full((1,), fill, dtype=x.dtype, device=x.device)
    n_seqs = cu_seqlens.numel() - 1
    meta = _roll_blocks(inner)
    grid = (outer * triton.cdiv(T, meta["BLOCK_T"]),)
    _roll_packed_kernel[grid](
        x.view(bits), cu_seqlens.contiguous(), fill_1.view(bits), out.view(bits),
        T, inner, n_seqs, (n_seqs - 1).bit_length(), shift, **meta,
    )
    return out


@_roll_packed_op.register_fake
def _(x, cu_seqlens, shift, dim, fill):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _roll_setup_context(ctx, inputs, output):
    _x, cu_seqlens, shift, dim, _fill = inputs
    ctx.save_for_backward(cu_seqlens)
    ctx.shift, ctx.dim = shift, dim


def _roll_backward(ctx, grad_out):
    (cu_seqlens,) = ctx.saved_tensors
    return _roll_packed_op(grad_out, cu_seqlens, -ctx.shift, ctx.dim, 0), None, None, None, None


_roll_packed_op.register_autograd(_roll_backward, setup_context=_roll_setup_context)


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------


def _check_fill(fill, dtype: torch.dtype, name: str = "fill", of: str = "x") -> None:
    """fill must be a number that x's dtype can hold (truncation of floats to ints is fine);
    name and of: the argument and the tensor its caller calls them."""
    if not isinstance(fill, (int, float)):
        raise ValueError(f"{name}: expected a number (int, float or bool), got {fill!r}")
    if dtype == torch.bool or dtype.is_complex:
        return
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float fill is symbolic
    if dtype.is_floating_point:
        fits = not -math.inf < fill < math.inf or abs(fill) <= torch.finfo(dtype).max  # nan and +-inf fit a float
    else:
        info = torch.iinfo(dtype)
        fits = info.min <= fill <= info.max  # False for nan and +-inf
    if not fits:
        raise ValueError(f"{name}: {fill!r} does not fit {of}'s dtype {dtype}")


def _roll(x, cu_seqlens, shift, dim, fill, impl):
    """roll_packed on validated inputs (cu_seqlens already on x's device)."""
    # every |shift| >= T fills everything; clamping keeps t - shift in the kernel's int32
    T = x.shape[dim]
    shift = max(-T, min(T, shift))
    if use_triton(impl, x, cu_seqlens):
        return _roll_packed_op(x, cu_seqlens, shift, dim, fill)
    return roll_packed_ref(x, cu_seqlens, shift, dim, fill)


def roll_packed(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    shift: int = -1,
    dim: int = 0,
    fill: Union[int, float, bool] = 0,
    check: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Roll x along `dim` inside every packed sequence (SPEC.md section 5).

    out[t] = x[t - shift] when t - shift lies in t's sequence, else `fill`: shift = -1 gives
    each token the next one's value (next-token labels), the last token of each sequence
    gets `fill`; shift = +1 gives the previous one's. |shift| >= a sequence's length fills it
    all. Differentiable for float x (the gradient is the opposite roll with fill 0).

    Args:
        x: any dtype and rank >= 1, the packed tokens along `dim`: ids [T], masks [T] bool,
            hidden states [T, H] (dim=0) or [B, T, H] (dim=1).
        cu_seqlens: [N + 1] int32/int64, 0 = cu[0] <= cu[1] <= ... <= cu[N] = x.shape[dim];
            moved to x's device.
        shift: any int. dim: the token dim, negative counts from the end.
        fill: a number, cast to x's dtype (floats to ints truncate; it must fit).
        check: raise a ValueError unless cu_seqlens' values are as above (one device->host
            sync; skipped under torch.compile). Unchecked values are trusted, except that
            no token reads outside x: one whose t - shift lies outside 0 .. T-1 gets fill.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Example:
        >>> cu = torch.tensor([0, 3, 7, 10])
        >>> roll_packed(torch.arange(1, 11), cu).tolist()
        [2, 3, 0, 5, 6, 7, 0, 9, 10, 0]
        >>> roll_packed(torch.arange(1, 11), cu, shift=1, fill=-1).tolist()
        [-1, 1, 2, -1, 4, 5, 6, -1, 8, 9]
    """
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        raise ValueError(f"x: expected a tensor of rank >= 1 holding the tokens along dim, got {getattr(x, 'shape', type(x).__name__)}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: expected an int in {-x.ndim}..{x.ndim - 1} for a {x.ndim}-D x, got {dim!r}")
    dim %= x.ndim
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise ValueError(f"shift: expected an int, got {shift!r}")
    _check_fill(fill, x.dtype)
    if x.element_size() not in _BITS:
        raise ValueError(f"x: dtype {x.dtype} ({x.element_size()} bytes per element) is not supported")
    check_cu_seqlens(cu_seqlens, x.shape[dim], check=check, like=("x", x))
    signed = _SIGNED.get(x.dtype)
    if signed is not None:  # torch's index ops lack uint16/32/64 (a token file's ids): the same bits as the signed type's
        fill = torch.tensor(fill, dtype=x.dtype).view(signed).item()
        return _roll(x.view(signed), cu_seqlens.to(x.device), shift, dim, fill, impl).view(x.dtype)
    return _roll(x, cu_seqlens.to(x.device), shift, dim, fill, impl)


_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def positions_from_cu_seqlens(
    cu_seqlens: torch.Tensor, *, n_tokens: Optional[int] = None, check: bool = True
) -> torch.Tensor:
    """Position of every token inside its sequence: positions[t] = t - cu[j] for t in j.

    Args:
        cu_seqlens: [N + 1] int32/int64, 0 = cu[0] <= ... <= cu[N] = T.
        n_tokens: T. Without it T is read from cu_seqlens[-1] (one device->host sync, and a
            data-dependent shape under torch.compile, check or not); with it and
            check=False nothing waits on the device.
        check: raise a ValueError unless cu_seqlens' values are as above (one device->host
            sync; skipped under torch.compile).

    Returns:
        positions [T] int64 on cu_seqlens' device (the dtype of torch indices, embeddings
        and rope_cos_sin).

    Example:
        >>> positions_from_cu_seqlens(torch.tensor([0, 3, 7, 10])).tolist()
        [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    """
    if n_tokens is None:
        check_index("cu_seqlens", cu_seqlens, 1, "[n_seqs + 1]")
        if not holds_values(cu_seqlens):
            raise ValueError("n_tokens: needed where cu_seqlens holds no values (a meta or fake tensor) to read T from; pass n_tokens=T")
        n_tokens = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
    else:
        check_positive_int("n_tokens", n_tokens, 0)
    check_cu_seqlens(cu_seqlens, n_tokens, check=check)
    return positions_ref(cu_seqlens, n_tokens)


def mtp_targets(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    depth: int,
    *,
    loss_mask: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    check: bool = True,
    impl: str = "auto",
) -> list[TensorDict]:
    """Inputs and targets of the main model and of `depth` MTP modules (SPEC.md section 5).

    Entry k of the returned list (k = 0: the main next-token model; k = 1..depth: the k-th
    MTP module, the SPEC's MTP depth d = k - 1) is a TensorDict of batch size [T] holding
    the main model's quantities rolled k more times inside every sequence, R^k =
    roll_packed(., shift=-k):

        input_ids  = R^k(tokens)          fill 0              token t + k (DeepSeek-V3's
                                                              module k embeds it)
        positions  = R^k(positions)       fill 0              its position
        labels     = R^(k+1)(tokens)      fill ignore_index   token t + k + 1, to predict
        loss_mask  = R^(k+1)(loss_mask)   fill 0 / False      whether that label counts

    so the main labels are the next tokens and each MTP depth's labels, loss mask and
    position ids are the main model's rolled once more per depth. The last k + 1 tokens of
    every sequence never count at entry k. Filled input_ids / positions (0) are valid
    embedding and RoPE indices; they sit at the end of their sequence, so under causal
    attention they reach no counted token.

    Args:
        tokens: [T] int32/int64 packed token ids.
        cu_seqlens: [N + 1] int32/int64 sequence bounds (0, ..., T).
        depth: D >= 0, the number of MTP modules.
        loss_mask: [T] (bool, int or float), aligned with tokens: nonzero where token t
            may be predicted (False on padding or prompt tokens); default all True. The
            labels are not masked with it: weight each depth's per-token loss by its
            loss_mask (filled labels also equal ignore_index).
        positions: [T] int32/int64, default positions_from_cu_seqlens(cu_seqlens).
        ignore_index: the fill of labels (cross_entropy's default ignore_index).
        check, impl: as in roll_packed.

    Returns:
        depth + 1 TensorDicts, keys input_ids, positions, labels, loss_mask.

    Example (cu_seqlens [0, 3, 5], tokens [a b c d e], entry 1, the first MTP module):
        input_ids [b c 0 e 0], positions [1 2 0 1 0], labels [c -100 -100 -100 -100],
        loss_mask [1 0 0 0 0].
    """
    check_index("tokens", tokens, 1, "[T]")
    T = tokens.shape[0]
    check_positive_int("depth", depth, 0)
    if loss_mask is None:
        loss_mask = torch.ones(T, dtype=torch.bool, device=tokens.device)
    elif not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != (T,):
        raise ValueError(f"loss_mask: expected a tensor of shape ({T},), got {getattr(loss_mask, 'shape', type(loss_mask).__name__)}")
    check_device("loss_mask", loss_mask, tokens.device, "tokens")
    check_cu_seqlens(cu_seqlens, T, check=check, like=("tokens", tokens))
    if positions is None:
        positions = positions_ref(cu_seqlens.to(tokens.device), T)
    else:
        check_index("positions", positions, 1, "[T]")
        if positions.shape != (T,):
            raise ValueError(f"positions: expected shape ({T},), got {tuple(positions.shape)}")
        check_device("positions", positions, tokens.device, "tokens")
    _check_fill(ignore_index, tokens.dtype, "ignore_index", "tokens")  # the labels' fill
    cu = cu_seqlens.to(tokens.device)

    def roll(x, k, fill):
        return _roll(x, cu, -k, 0, fill, impl) if k else x

    from tensordict import TensorDict

    return [
        TensorDict(
            input_ids=roll(tokens, k, 0),
            positions=roll(positions, k, 0),
            labels=roll(tokens, k + 1, ignore_index),
            loss_mask=roll(loss_mask, k + 1, 0),
            batch_size=[T],
        )
        for k in range(depth + 1)
    ]
