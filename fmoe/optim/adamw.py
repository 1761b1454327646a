"""AdamW with decoupled weight decay, optional bf16 moments and float32 master weights; and
scale_, the in-place multiply of many tensors by a 0-D factor (the clip's) on the same
multi-tensor machinery.

One step for a parameter p with gradient g, step count t (from 1), learning rate lr, moments
m, v (exp_avg, exp_avg_sq), exactly as torch.optim.AdamW:

    p <- p * (1 - lr * weight_decay)
    m <- m + (1 - beta1) * (g - m)                   (= beta1 m + (1 - beta1) g)
    v <- beta2 * v + (1 - beta2) * g * g
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

A step may take a gradient factor c (`step(grad_factor=c)`, a 0-D tensor: the clip factor of
fmoe.optim.clip_factor): g is then c * g in the lines above, formed in float32 as the
gradient is read (.grad itself unchanged). Clipping then costs no pass of its own over the
gradients; with float32 gradients the step equals clip_grad_norm followed by a plain step,
bit for bit.

All arithmetic is float32. With state_dtype=torch.bfloat16 m and v are stored in bf16 (half
the state memory): each step loads them, updates in float32 and stores them rounded, by
default stochastically (state_rounding="stochastic"): up with probability the fraction of a
bf16 step that the float32 value lies above the lower bf16 neighbour, so that a stored moment
is the float32 one on average. Rounded to nearest ("nearest"), a moment whose step change is
under half of bf16's spacing (2^-9 of its value) never moves: with beta2 = 0.999 v changes by
(1 - beta2)(g^2 - v), at most 0.001 v down, and v could never decrease (a constant gradient
left it near g^2 / 4, and after the gradients shrank tenfold it kept its value for thousands
of steps, where float32 states follow them). The "random" bits are a hash of the step's
inputs to the moment, the gradient's float32 bits and the moment's stored bits, with the step
and which moment it is (stochastic_bits): no generator, the same bits however the parameter
is sharded, the same on both paths (their float32 results may differ in the last bit; the
inputs do not), and a resumed run rounds as the uninterrupted one. The other side of keying
on the gradient's bits: a gradient one bit apart (summed in another order: pipeline or
context parallelism against one process) rounds its moments afresh, so two such runs part
faster with bf16 states than with float32 ones (a one-bit change in every gradient moved 44%
of the stored moments a bf16 step; pp 2 and cp 2 were 8e-6 and 5e-6 from one process in loss
after 5 steps, where float32 states kept pp 2 bit-identical and cp 2 within 4e-8). Elements
with the same gradient and moment (the zero gradients of unused rows) round alike in a step:
more variance across them, no bias.

With master_weights=True a float32 copy of each parameter lives in the state
("master"): the update applies to it and the parameter (e.g. bf16) receives it rounded. A
parameter that is not float32 and has no master is updated in float32 and rounded back.

Implementations (impl=): "torch" runs torch._foreach ops, the reference; "triton" a fused
multi-tensor kernel: per bucket of tensors sharing dtypes, step count and alignment, one
launch over chunks of CHUNK elements, every tensor's pointers and size read from an int64
table (rebuilt only when a pointer or size changes); "auto" is Triton on CUDA, torch
otherwise. A bucket with a non-contiguous tensor takes the torch path.

DTensor parameters are updated through their local shards, their states are DTensors laid
out like them.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import local_tensor as _local
from fmoe.ops.backend import use_triton
from fmoe.ops.checks import check_float

STATE_DTYPES = (torch.float32, torch.bfloat16)
STATE_ROUNDINGS = ("stochastic", "nearest")
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B9, 0x7FEB352D, 0x846CA68B  # the step's salt; lowbias32's two multipliers
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch.optim.AdamW's flags that this AdamW does not implement, with the value it assumes
_UNSUPPORTED_FLAGS = dict(maximize=False, amsgrad=False, decoupled_weight_decay=True)
_ROWS = ("param", "grad", "exp_avg", "exp_avg_sq", "master", "numel")  # pointer-table rows
CHUNK = 65536  # elements per program
_META = dict(BLOCK=1024, num_warps=4)  # elements per loop iteration of a program
_ALIGN = 16  # tensors whose addresses (bytes) and size (elements) are multiples of it get vector accesses


# ----------------------------------------------------------------------------------------
# Reference: torch._foreach ops
# ----------------------------------------------------------------------------------------


def _f32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 working copies of the tensors that are not float32 (the others as they are)."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _store(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Round the float32 working copies back into their non-float32 storage."""
    pairs = [(d, s) for d, s in zip(dst, src) if d is not s]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def moment_salt(step: float, moment: int) -> int:
    """The salt of stochastic_bits for a step's moment (0: exp_avg, 1: exp_avg_sq), < 2^31."""
    return ((int(step) * _GOLDEN) ^ (moment * _MIX1)) & 0x7FFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 h in [0, 2^32) and c < 2^32, with no product past 2^48."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


_CANONICAL_NAN = 0x7FC00000  # a quiet NaN's float32 bits: a NaN rounded to bf16 stays one (0x7FC0)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of float32 x as int64 in [0, 2^32)."""
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def moment_key(grad: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """The input of stochastic_bits for a moment's rounding: the float32 gradient's bits xor
    the stored (bf16) moment's 16 bits, before the step (int64 in [0, 2^32))."""
    return _bits(grad) ^ (_bits(stored.float()) >> 16)


def stochastic_bits(key: torch.Tensor, salt: int) -> torch.Tensor:
    """16 pseudo-random bits [0, 2^16) per key (int64 in [0, 2^32)): lowbias32 (an integer
    hash: xor-shifts and two multiplies) of key ^ salt, its low half. The Triton kernel
    computes the same in uint32."""
    h = key ^ salt
    h = h ^ (h >> 16)
    h = _mul32(h, _MIX1)
    h = h ^ (h >> 15)
    h = _mul32(h, _MIX2)
    h = h ^ (h >> 16)
    return h & 0xFFFF


def round_stochastic_bf16(x: torch.Tensor, key: torch.Tensor, salt: int) -> torch.Tensor:
    """float32 x rounded to bf16 up (in magnitude) when its low 16 bits plus
    stochastic_bits(key, salt) carry into the high half, else down: up with probability the
    low half's fraction of a bf16 step; NaN stays NaN (whatever its payload: one only in
    the low half, cut off, would read inf), inf stays inf."""
    bits = _bits(x)
    up = (bits + stochastic_bits(key, salt)) & 0xFFFF0000
    bits = torch.where(x.isnan(), _CANONICAL_NAN, up)
    return ((bits >> 16).to(torch.int32) << 16).view(torch.float32).to(torch.bfloat16)  # exact: the low half is 0


def _store_moments(dst: list[torch.Tensor], src: list[torch.Tensor], grads: list[torch.Tensor], salt: Optional[int]) -> None:
    """Round the float32 moments back into their storage: stochastically with a salt into
    bf16 (round_stochastic_bf16, keyed by the float32 gradients and dst's values before the
    step), else to nearest (_store)."""
    if salt is None or not dst or dst[0].dtype != torch.bfloat16:
        _store(dst, src)
        return
    torch._foreach_copy_(dst, [round_stochastic_bf16(t, moment_key(g, d), salt) for d, t, g in zip(dst, src, grads)])


def _adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step, factor=None, stochastic=False):
    """One AdamW step with torch._foreach ops, in the order of torch.optim.AdamW(foreach=True);
    factor (a float32 0-D tensor or None) multiplies float32 copies of the gradients;
    stochastic: bf16 moments rounded stochastically (module docstring)."""
    p32, g32, m32, v32 = _f32(params), _f32(grads), _f32(exp_avgs), _f32(exp_avg_sqs)
    if factor is not None:
        g32 = torch._foreach_mul(g32, factor)
    torch._foreach_mul_(p32, 1 - lr * weight_decay)
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, 1 - beta2)
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p32, m32, denom, -lr / (1 - beta1**step))
    _store(params, p32)
    for moment, (dst, src) in enumerate(((exp_avgs, m32), (exp_avg_sqs, v32))):
        _store_moments(dst, src, g32, moment_salt(step, moment) if stochastic else None)


# ----------------------------------------------------------------------------------------
# Triton kernel: many tensors, one launch
# ----------------------------------------------------------------------------------------


@triton.jit
def _round_to(x, TY: tl.constexpr):
    """float32 x rounded to nearest even in TY. bf16 by bit arithmetic, NaN a quiet NaN
    0x7FC0 (a payload only in the low half, cut off, would read inf): the interpreter's plain
    cast truncates, a GPU's rounds; this rounds on both."""
    if TY == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(TY)


@triton.jit
def _round_state(x, key, salt, TY: tl.constexpr, STOCHASTIC: tl.constexpr):
    """A moment's float32 x into its storage TY: stochastically into bf16 with STOCHASTIC
    (round_stochastic_bf16's, stochastic_bits of key (uint32, moment_key's) in uint32), else
    _round_to."""
    if STOCHASTIC and TY == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        h = key ^ salt.to(tl.uint32)
        h = h ^ (h >> 16)
        h = h * tl.full(h.shape, 0x7FEB352D, tl.uint32)
        h = h ^ (h >> 15)
        h = h * tl.full(h.shape, 0x846CA68B, tl.uint32)
        h = h ^ (h >> 16)
        bits = tl.where(x != x, 0x7FC00000, bits + (h & 0xFFFF))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return _round_to(x, TY)


@triton.jit
def _adamw_kernel(
    table_ptr, chunk_tensor_ptr, factor_ptr, n_tensors,
    decay, beta1, beta2, eps, step_size, bc2_sqrt, salt_m, salt_v,
    PARAM_TY: tl.constexpr, GRAD_TY: tl.constexpr, STATE_TY: tl.constexpr, STOCHASTIC: tl.constexpr,
    MASTER: tl.constexpr, FACTOR: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program c updates elements [j*CHUNK, (j+1)*CHUNK) of tensor i = chunk_tensor[c].

    table[r, i] (int64, [6, n_tensors]): addresses of param, grad, exp_avg, exp_avg_sq,
    master (rows 0-4) and the element count (row 5) of tensor i. j is c minus the first
    chunk of tensor i, stored in the high bits: chunk_tensor[c] = j << 32 | i.
    """
    c = tl.program_id(0)
    entry = tl.load(chunk_tensor_ptr + c)
    i = entry & 0xFFFFFFFF
    start = (entry >> 32) * CHUNK
    numel = tl.load(table_ptr + 5 * n_tensors + i)
    p_addr = tl.load(table_ptr + i)
    g_addr = tl.load(table_ptr + n_tensors + i)
    m_addr = tl.load(table_ptr + 2 * n_tensors + i)
    v_addr = tl.load(table_ptr + 3 * n_tensors + i)
    w_addr = tl.load(table_ptr + 4 * n_tensors + i)
    p_ptr = p_addr.to(tl.pointer_type(PARAM_TY))
    g_ptr = g_addr.to(tl.pointer_type(GRAD_TY))
    m_ptr = m_addr.to(tl.pointer_type(STATE_TY))
    v_ptr = v_addr.to(tl.pointer_type(STATE_TY))
    w_ptr = w_addr.to(tl.pointer_type(tl.float32))
    if FACTOR:
        factor = tl.load(factor_ptr)
    if ALIGNED:  # every address and size of the launch is a multiple of 16: vector accesses
        numel = tl.multiple_of(numel, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    for off in tl.range(0, tl.minimum(numel - start, CHUNK), BLOCK):  # a small tensor's chunk stops early
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < numel
        if MASTER:
            p = tl.load(w_ptr + idx, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if FACTOR:
            g = g * factor
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if STOCHASTIC:  # moment_key: the gradient's bits and the stored moment's, before the step
            g_bits = g.to(tl.uint32, bitcast=True)
            key_m = g_bits ^ (m.to(tl.uint32, bitcast=True) >> 16)
            key_v = g_bits ^ (v.to(tl.uint32, bitcast=True) >> 16)
        else:
            key_m = 0
            key_v = 0
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(m_ptr + idx, _round_state(m, key_m, salt_m, STATE_TY, STOCHASTIC), mask=mask)
        tl.store(v_ptr + idx, _round_state(v, key_v, salt_v, STATE_TY, STOCHASTIC), mask=mask)
        if MASTER:
            tl.store(w_ptr + idx, p, mask=mask)
        tl.store(p_ptr + idx, _round_to(p, PARAM_TY), mask=mask)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _tables(tensors: list[list[torch.Tensor]], numels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's pointer table [6, N] and per-chunk entries (j << 32 | i), on device."""
    device = tensors[0][0].device
    table = torch.tensor([[t.data_ptr() for t in row] for row in tensors] + [numels], dtype=torch.int64)
    chunks = torch.tensor([-(-n // CHUNK) for n in numels])
    tensor_of = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    entries = ((torch.arange(len(tensor_of)) - first[tensor_of]) << 32) | tensor_of
    return table.to(device, non_blocking=True), entries.to(device, non_blocking=True)


class _TableCache:
    """Device pointer tables per bucket, reused while every address and size is unchanged."""

    def __init__(self):
        self._tables = {}

    def get(self, bucket_key, tensors, numels):
        key = (tuple(t.data_ptr() for row in tensors for t in row), tuple(numels))
        hit = self._tables.get(bucket_key)
        if hit is None or hit[0] != key:
            hit = self._tables[bucket_key] = (key, _tables(tensors, numels))
        return hit[1]


def _adamw_triton(cache, bucket, params, grads, exp_avgs, exp_avg_sqs, masters, *, lr, beta1, beta2, eps, weight_decay, step,
                  factor=None, stochastic=False):
    """Fused launches for contiguous tensors sharing param, grad and state dtypes (masters:
    a float32 tensor per param, or None for all; factor: a float32 0-D tensor on their
    device, or None); bucket: their key in the cache. The
    tensors whose addresses and size are multiples of 16 go in one launch with vector
    accesses, the others (if any) in a second one without."""
    rows = [params, grads, exp_avgs, exp_avg_sqs, masters or params]
    columns = list(zip(*rows))
    for aligned in (True, False):
        cols = [c for c in columns if (c[0].numel() % _ALIGN == 0 and all(t.data_ptr() % _ALIGN == 0 for t in c)) == aligned]
        numels = [c[0].numel() for c in cols]
        if sum(numels) == 0:
            continue
        table, entries = cache.get((bucket, aligned), [list(row) for row in zip(*cols)], numels)
        _adamw_kernel[(entries.numel(),)](
            table, entries, table if factor is None else factor, len(cols),
            1 - lr * weight_decay, beta1, beta2, eps, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
            moment_salt(step, 0), moment_salt(step, 1),
            PARAM_TY=_TL[params[0].dtype], GRAD_TY=_TL[grads[0].dtype], STATE_TY=_TL[exp_avgs[0].dtype],
            STOCHASTIC=stochastic and exp_avgs[0].dtype == torch.bfloat16,
            MASTER=masters is not None, FACTOR=factor is not None, ALIGNED=aligned, CHUNK=CHUNK, **_META,
        )


# ----------------------------------------------------------------------------------------
# Scaling many tensors in place: one launch per dtype
# ----------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(table_ptr, chunk_tensor_ptr, factor_ptr, n_tensors, TY: tl.constexpr, ALIGNED: tl.constexpr,
                  ROUND_FACTOR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program c multiplies elements [j*CHUNK, (j+1)*CHUNK) of tensor i = chunk_tensor[c] in
    place by factor_ptr[0] (first rounded to TY with ROUND_FACTOR): in float32, rounded to
    nearest even in TY. table [2, n_tensors] (int64): each tensor's address, then its
    element count; chunk_tensor[c] = j << 32 | i (the tables above)."""
    c = tl.program_id(0)
    entry = tl.load(chunk_tensor_ptr + c)
    i = entry & 0xFFFFFFFF
    start = (entry >> 32) * CHUNK
    numel = tl.load(table_ptr + n_tensors + i)
    t_ptr = tl.load(table_ptr + i).to(tl.pointer_type(TY))
    factor = tl.load(factor_ptr).to(tl.float32)
    if ROUND_FACTOR:
        factor = factor.to(TY).to(tl.float32)
    if ALIGNED:  # every address and size of the launch is a multiple of 16: vector accesses
        numel = tl.multiple_of(numel, 16)
        t_ptr = tl.multiple_of(t_ptr, 16)
    for off in tl.range(0, tl.minimum(numel - start, CHUNK), BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < numel
        x = tl.load(t_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(t_ptr + idx, _round_to(x * factor, TY), mask=mask)


_SCALE_TABLES = _TableCache()  # gradients keep their addresses from step to step (the caching allocator)


def scale_(tensors: Sequence[torch.Tensor], factor: torch.Tensor, *, impl: str = "auto") -> None:
    """Multiply every tensor in place by the 0-D tensor `factor`, each product formed in
    float32 and rounded to the tensor's dtype: the bits of t.mul_(factor), whatever the
    dtypes (torch's own rule for a 0-D factor: the tensor keeps its dtype). Torch's rule
    differs by device, and so does this: on CUDA a 0-D CUDA factor is an input like any
    other, cast to the tensor's dtype before the multiply (a bf16 gradient is multiplied by
    the factor rounded to bf16), on CPU it is a scalar kept in float32.

    impl "auto": on CUDA one Triton launch per dtype (and per alignment) over every
    contiguous float32 / bf16 / fp16 tensor; torch._foreach_mul_ otherwise (CPU, other
    dtypes, strided tensors). "triton" forces the kernel (CPU tensors under
    TRITON_INTERPRET=1), "torch" the foreach op. No host sync.
    """
    if not isinstance(factor, torch.Tensor) or factor.dim() != 0 or not factor.is_floating_point():
        raise ValueError(f"factor: expected a 0-D floating tensor, got {getattr(factor, 'shape', type(factor).__name__)}")
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    fused = use_triton(impl, *tensors, factor)
    buckets: dict = {}
    for t in tensors:
        kernel = fused and t.dtype in _TL and t.is_contiguous()
        aligned = t.numel() % _ALIGN == 0 and t.data_ptr() % _ALIGN == 0
        buckets.setdefault((t.device, t.dtype, kernel, kernel and aligned), []).append(t)
    for (device, dtype, kernel, aligned), group in buckets.items():
        here = factor.to(device)
        if not kernel:
            torch._foreach_mul_(group, here)
            continue
        numels = [t.numel() for t in group]
        table, entries = _SCALE_TABLES.get((device, dtype, aligned), [group], numels)
        _scale_kernel[(entries.numel(),)](table, entries, here, len(group), TY=_TL[dtype], ALIGNED=aligned,
                                          ROUND_FACTOR=_torch_rounds_factor(device), CHUNK=CHUNK, **_META)


def _torch_rounds_factor(device: torch.device) -> bool:
    """Whether t.mul_(factor) on `device` rounds a 0-D factor on the same device to t's dtype
    first: on CUDA (TensorIterator casts it like any input), not on CPU (a CPU scalar)."""
    return device.type == "cuda"


# ----------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------


def check_number(name: str, value, expected: str, ok: Callable[[float], bool]) -> None:
    """ValueError naming `name` unless value is a finite real number (not a bool, not a
    tensor: the step's foreach ops and kernels take a number) for which ok(value) holds."""
    if isinstance(value, torch.Tensor):  # float(lr) would read it on the host every step
        raise ValueError(f"{name}: expected a number (a tensor {name} is not supported: float({name})), got a tensor {list(value.shape)}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_hyperparameters(group: dict) -> None:
    """ValueError naming the first bad hyperparameter of an AdamW param group: lr >= 0,
    betas two values in [0, 1), eps > 0, weight_decay >= 0, each a finite number (NaN, inf,
    strings and tensors fail). Plain Python: step() runs it on every group, reading nothing
    on the host."""
    check_number("lr", group["lr"], "a finite learning rate >= 0", lambda v: v >= 0.0)
    betas = group["betas"]
    if (isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas: expected two values in [0, 1), got {betas!r}")
    check_number("eps", group["eps"], "a finite eps > 0", lambda v: v > 0.0)
    check_number("weight_decay", group["weight_decay"], "a finite weight_decay >= 0", lambda v: v >= 0.0)


def unsupported_flag(group: dict) -> Optional[str]:
    """The first of torch.optim.Adam's flags that this AdamW does not implement
    (_UNSUPPORTED_FLAGS: maximize, amsgrad, decoupled_weight_decay=False) that `group` sets
    to another value than the one implemented, or None."""
    return next((key for key, value in _UNSUPPORTED_FLAGS.items() if group.get(key, value) != value), None)


def split_names(params) -> tuple[list, Optional[list]]:
    """(tensors, names) of a param group's `params`: a tensor or a list of tensors (names
    None), or a list of (name, tensor) pairs, which torch's optimizers take too
    (model.named_parameters(); the names are kept as the group's param_names, in its state
    dict). The checks then see the tensors: a named complex parameter, or one named twice,
    was let through. ValueError for a mix of the two forms, as torch refuses it."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    named = [isinstance(p, tuple) for p in params]
    if not any(named):
        return params, None
    if not all(named) or any(len(p) != 2 for p in params):
        raise ValueError("params: expected tensors or (name, tensor) pairs (model.named_parameters()), not a mix, got "
                         f"{[type(p).__name__ if not isinstance(p, tuple) else f'a tuple of {len(p)}' for p in params[:4]]}")
    return [p for _, p in params], [name for name, _ in params]


def with_names(param_group: dict, params: list, names: Optional[list]) -> dict:
    """param_group with its checked tensors `params` and, for named parameters, their
    names (split_names), as torch's add_param_group stores them."""
    return {**param_group, "params": params, **({"param_names": names} if names is not None else {})}


def check_saved_groups(state_dict: dict, check: Callable[[dict], None]) -> None:
    """ValueError, before a load, for a saved param group that the optimizer's `check` (its
    check_hyperparameters) refuses, naming the group: a state dict of torch's own optimizer
    with a tensor lr loaded, and every later step was refused. A group without one of the
    keys: another optimizer's state."""
    for n, group in enumerate(state_dict["param_groups"]):
        try:
            check(group)
        except KeyError as err:
            raise ValueError(f"state_dict: param group {n} has no {err.args[0]!r} (another optimizer's state)") from None
        except ValueError as err:
            raise ValueError(f"state_dict: param group {n}: {err}") from None


def check_ordered(params) -> None:
    """TypeError for a set of parameters (the optimizer's `params` or a group's), as torch's
    add_param_group and AdamW refuse a group's: a set's order changes between runs, and with
    it a checkpoint's parameter indices (a resumed run's states went to other parameters)
    and DistributedMuon's owners (ranks that disagree on them hang). torch's constructor
    took a top-level set as a list. Shared by AdamW, Muon and fmoe.parallel's
    DistributedMuon."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"params: expected an ordered collection of parameters (a list), got a {type(params).__name__} "
                        "(its order changes between runs)")


def check_params_once(params: list, param_groups: list[dict]) -> None:
    """ValueError for a tensor of `params` (a group being added) listed twice, or already in
    param_groups: torch only warns within a group, and a step updated it twice."""
    seen = {id(q) for g in param_groups for q in g["params"]}
    for p in params:
        if isinstance(p, torch.Tensor):
            if id(p) in seen:
                raise ValueError(f"params: a parameter of shape {tuple(p.shape)} appears twice")
            seen.add(id(p))


def check_state_shapes(param_groups: list[dict], state_dict: dict, shapes: dict[str, Callable[[torch.Tensor], torch.Size]]) -> None:
    """ValueError naming the parameter's index, before a load: a saved state entry of
    `shapes` (key -> the shape it must have, from its parameter) of another shape (torch's
    loader took it, and the next step failed inside torch). Other group sizes: torch's
    loader's own ValueError."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in param_groups for p in group["params"]]
    for i, p in zip(saved_ids, params):
        for key, value in state_dict["state"].get(i, {}).items():
            if key in shapes and isinstance(value, torch.Tensor) and value.shape != shapes[key](p):
                raise ValueError(f"state_dict: expected {key} of parameter {i} to have the parameter's shape "
                                 f"{tuple(shapes[key](p))}, got {tuple(value.shape)}")


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with bf16 moments, float32 master weights, a fused
    multi-tensor Triton step on CUDA and DTensor parameters.

    Args:
        params: parameters or parameter groups, as for any torch optimizer ((name,
            parameter) pairs too: model.named_parameters()).
        lr, betas, eps, weight_decay: as torch.optim.AdamW; per group.
        state_dtype: dtype in which exp_avg and exp_avg_sq are stored, torch.float32 or
            torch.bfloat16 (half the state memory; the update is still float32).
        state_rounding: how bf16 moments are rounded when stored, "stochastic" (the
            default: unbiased, module docstring) or "nearest" (even; a moment whose change
            is under half a bf16 step stays where it is). No effect on float32 states.
        master_weights: keep a float32 copy of each non-float32 parameter in the state
            ("master"), update it and round it into the parameter. A loaded state follows
            this setting, not the saved one (load_state_dict). From its first step the
            master is the parameter's value: an in-place edit of the parameter (p.copy_)
            is overwritten by the next step; to change a parameter, change
            state[p]["master"] too (or load a state dict).
        impl: "auto" (Triton on CUDA, torch._foreach otherwise), "triton" or "torch".

    Parameters are float32, bfloat16 or float16 (the step works in float32), each in the
    optimizer once.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        state_dtype: torch.dtype = torch.float32,
        state_rounding: str = "stochastic",
        master_weights: bool = False,
        impl: str = "auto",
    ):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: expected torch.float32 or torch.bfloat16, got {state_dtype}")
        if state_rounding not in STATE_ROUNDINGS:
            raise ValueError(f"state_rounding: expected one of {STATE_ROUNDINGS}, got {state_rounding!r}")
        if impl not in ("auto", "triton", "torch"):
            raise ValueError(f"impl: expected 'auto', 'triton' or 'torch', got {impl!r}")
        if not isinstance(master_weights, bool):  # "no" is truthy: it turned masters on
            raise ValueError(f"master_weights: expected True or False, got {master_weights!r}")
        try:
            betas = tuple(betas)
        except TypeError:  # not two values: add_param_group's check names it
            pass
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_ordered(params)
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.state_rounding = state_rounding
        self.master_weights = master_weights
        self.impl = impl
        self._cache = _TableCache()
        # each parameter's step count as a Python number, beside state["step"] (a CPU tensor,
        # the checkpointed form): buckets are keyed by it without reading a tensor each step.
        # Held with the tensor and its version: a state["step"] edited or replaced since (an
        # optimizer reset by hand) is read again, as torch's AdamW reads it
        self._steps: dict = {}

    def __getstate__(self) -> dict:
        """torch's keeps defaults, state and param_groups only: a deepcopy, pickle or
        torch.save of the optimizer lost state_dtype, master_weights and impl, and the
        copy's first step failed."""
        return {**super().__getstate__(), "state_dtype": self.state_dtype, "state_rounding": self.state_rounding,
                "master_weights": self.master_weights, "impl": self.impl}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("state_rounding", "nearest")  # pickled before the setting: the rounding it was made with
        self._cache = _TableCache()
        self._steps = {}  # read again from state["step"] at the next step

    def add_param_group(self, param_group: dict) -> None:
        """Checks the group's own lr, betas, eps and weight_decay as the constructor checks
        its defaults (a ValueError naming the first bad one) and its parameters (float32,
        bfloat16 or float16, each in the optimizer once), then adds it. A group asking for
        maximize=True, amsgrad=True or decoupled_weight_decay=False (torch.optim.Adam's
        flags, which this AdamW does not implement) is refused: the step would ignore it."""
        check_hyperparameters({**self.defaults, **param_group})
        key = unsupported_flag(param_group)
        if key is not None:
            raise ValueError(f"{key}: expected {_UNSUPPORTED_FLAGS[key]} (this AdamW does not implement {key}={param_group[key]!r}), "
                             f"got {param_group[key]!r}")
        check_ordered(param_group["params"])
        params, names = split_names(param_group["params"])
        for p in params:
            if isinstance(p, torch.Tensor) and p.dtype not in PARAM_DTYPES:  # complex lost its imaginary part, int64 truncated, float64 rounded
                raise ValueError(f"params: expected float32, bfloat16 or float16 parameters (the step works in float32; "
                                 f"torch.optim.AdamW takes float64), got {p.dtype} (a parameter of shape {tuple(p.shape)})")
        check_params_once(params, self.param_groups)  # not a tensor: torch's TypeError
        super().add_param_group(with_names(param_group, params, names))

    def _wants_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype != torch.float32

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            self._steps[p] = (0.0, state["step"], state["step"]._version)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        if "master" not in state and self._wants_master(p):
            # a fresh state, or one loaded from a run without masters: made here, at the first
            # step, so that it copies the parameter as loaded whatever the order of the loads
            state["master"] = p.detach().float()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to the parameter's dtype; here the moments
        keep state_dtype and the master float32 (bf16 moments load bit for bit), and the
        step count is copied (torch's loader keeps the saved tensor, which the steps would
        then advance in place).

        The masters follow this optimizer's master_weights, not the saved state's: a saved
        master is dropped where master_weights is False (or the parameter is float32), the
        parameter then carrying on from its own value (the master rounded, as saved); a
        missing one is made from the parameter at the next step, as a fresh state's is.

        ValueError, before anything changes, for a saved exp_avg, exp_avg_sq or master whose
        shape is not its parameter's, for a param group with maximize=True,
        amsgrad=True or decoupled_weight_decay=False (torch.optim.Adam's state), which this
        AdamW does not implement, and for a group's hyperparameter that step() would refuse
        (a tensor lr: check_hyperparameters). torch.optim.AdamW's own state dicts load."""
        saved_groups = state_dict["param_groups"]
        for n, group in enumerate(saved_groups):
            key = unsupported_flag(group)
            if key is not None:
                raise ValueError(f"state_dict: param group {n} has {key}={group[key]!r}, which this AdamW does not implement")
        check_saved_groups(state_dict, check_hyperparameters)
        dtypes = dict(exp_avg=self.state_dtype, exp_avg_sq=self.state_dtype, master=torch.float32)
        check_state_shapes(self.param_groups, state_dict, {key: lambda p: p.shape for key in dtypes})
        saved_ids = [i for group in saved_groups for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        super().load_state_dict(state_dict)
        self._steps = {}  # read again from the loaded state["step"] at the next step
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key in dtypes:
                    self.state[p][key] = value.to(device=p.device, dtype=dtypes[key], copy=True)
                elif key == "step":  # a fresh CPU tensor: step() fills it in place
                    self.state[p][key] = torch.as_tensor(value, dtype=torch.float32, device="cpu").clone()
            if not self._wants_master(p) and p in self.state:
                self.state[p].pop("master", None)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *, grad_factor: Optional[torch.Tensor] = None):
        """One optimizer step over the parameters that have a gradient (the others keep
        their values and state). closure: as for any torch optimizer, re-evaluates the model
        (with grad enabled) before the step; its loss is returned (None without one).

        grad_factor: a 0-D float32 / bf16 / fp16 tensor c by which every gradient is
        multiplied, in float32, as the step reads it; .grad is left as it was. On the
        parameters' device nothing is read on the host (another device's is copied there).
        With c = fmoe.optim.clip_factor(norm, max_norm) this is clipping without a pass of
        its own over the gradients.

        Every group's lr, betas, eps and weight_decay are checked first, as add_param_group
        checks them (a value set on a group later, by hand or by a scheduler, included): a
        ValueError naming the first bad one, before the closure runs or anything changes.
        A sparse gradient, or impl="triton" on tensors it cannot run on: an error before
        anything changes.
        """
        if grad_factor is not None:
            check_float("grad_factor", grad_factor, 0, "[] (e.g. fmoe.optim.clip_factor's)")
        for group in self.param_groups:  # values set on a group since it was added (a tensor lr failed mid-step)
            check_hyperparameters(group)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # before any state changes (a refused step counted the earlier parameters' steps)
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"AdamW does not support sparse gradients (a parameter of shape {tuple(p.shape)})")
        # impl="triton" on CPU tensors without the interpreter: refused here, not in _update after the step counts moved
        use_triton(self.impl, *(_local(p) for group in self.param_groups for p in group["params"] if p.grad is not None))
        factors = {}  # the factor as float32 on each parameter device, made once per step
        for group in self.param_groups:
            buckets = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                counted, cached = state["step"], self._steps.get(p)
                fresh = cached is not None and cached[1] is counted and cached[2] == counted._version
                step = (cached[0] if fresh else float(counted)) + 1  # read after a load or an edit of state["step"]
                counted.fill_(step)
                self._steps[p] = (step, counted, counted._version)
                master = state.get("master")
                key = (p.device, p.dtype, p.grad.dtype, master is not None, step)
                buckets.setdefault(key, []).append((p, state))
                if grad_factor is not None and p.device not in factors:
                    factors[p.device] = _local(grad_factor).to(device=p.device, dtype=torch.float32)
            for (*bucket, step), items in buckets.items():
                self._update(group, (id(group), *bucket), items, step, factors.get(bucket[0]))
        return loss

    def _update(self, group: dict, bucket: tuple, items: list, step: float, factor: Optional[torch.Tensor]) -> None:
        """Update the (param, state) items of one bucket: same group, dtypes and step;
        factor: the gradient factor on their device (float32 0-D) or None."""
        params = [_local(p) for p, _ in items]
        grads = [_local(p.grad) for p, _ in items]
        exp_avgs = [_local(s["exp_avg"]) for _, s in items]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for _, s in items]
        masters = [_local(s["master"]) for _, s in items] if "master" in items[0][1] else None
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step, factor=factor,
                     stochastic=self.state_rounding == "stochastic")
        tensors = params + grads + exp_avgs + exp_avg_sqs + (masters or [])
        if use_triton(self.impl, *params) and all(t.is_contiguous() for t in tensors):
            _adamw_triton(self._cache, bucket, params, grads, exp_avgs, exp_avg_sqs, masters, **hyper)
        elif masters is None:
            _adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, **hyper)
        else:
            _adamw_foreach(masters, grads, exp_avgs, exp_avg_sqs, **hyper)
            torch._foreach_copy_(params, masters)
