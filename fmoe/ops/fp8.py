"""FP8 matmuls: a linear layer's GEMMs in float8 (e4m3) with row-wise power-of-two scales.

    fp8_quantize(t, dim) -> (t_fp8, scale)         t ~= t_fp8 * scale, one scale per slice along dim
    fp8_matmul(x[..., K], w[K, N]) -> y[..., N]    y = q(x) q(w), dy's GEMM in fp8, dw's in x's dtype
    grouped_mlp(..., fp8=True)                     the experts' GEMMs the same way (fmoe.ops.experts)

Quantization (q). A slice of t along `dim` (the contraction dim of the GEMM it feeds) gets
the scale s = the smallest power of two with amax(|slice|) / s <= 448 (e4m3's largest
finite value; s = 1 for an all-zero slice), and its values become round_e4m3(t / s),
clamped to +-448. Power-of-two scales make t / s and t_fp8 * s exact, so a product of two
quantized values is exact in float32 and the only roundings are e4m3's own and the
float32 sums (torchao's rowwise recipe, MXFP8 and DeepSeek-V3.1's UE8M0 scales are powers of
two for the same reason; DeepSeek-V3's own kernels scale by amax / 448). Against torchao's
rowwise scales bit for bit, two corners differ: torchao clamps amax below 1e-12 (a row of
amax under about 1e-15 becomes zeros; here scales go down to 2^-126), and its log2 can round
an amax just above 448 * 2^k to the smaller scale (then saturates to 448) where this takes the
larger one (3 in 2 million random float32 amax values).

The GEMMs of y = x w (x [M, K], w [K, N]; "row-wise": one scale per row of each operand
along the contracted dim):

    forward   y  = q_K(x) q_K(w)          x per row over K, w per column over K
    backward  dx = q_N(dy) q_N(w)^T       dy per row over N, w per row over N
              dw = x^T dy                 in x's dtype (float32 accumulation), not fp8

so two of the three GEMMs run in fp8, and the weight gradient, whose error would
accumulate in the weights, stays in the compute dtype (torchao's "rowwise with high
precision grad_weight").

Parallel runs. Each token's scale depends only on its own row, so a split of the tokens
(FSDP, context or expert parallel) quantizes exactly as one process does. A power-of-two
scale changes no quantized value except in e4m3's subnormal range (|t / s| < 2^-6: values
2^14 to 2^15 times smaller than the slice's amax) and e4m3 is a floating-point format, so the shares
of a contracted dim that tensor and expert-tensor parallelism multiply quantize as the
whole does but for such tiny values. What tensor parallelism does change: a gradient that
is summed over the tp ranks after a GEMM (the input gradient of a projection every rank
holds whole: multi-latent attention's latent projections, Kimi Delta Attention's low-rank
ones) is quantized as each rank's partial sum, not as the sum; the result is as close to
one process's as two fp8 roundings of the same GEMM are, not equal to it.

Paths: "auto" / "triton" run torch._scaled_mm on the quantized operands (cuBLAS on CUDA,
for bfloat16 x with K and N multiples of 16; CPU runs it for any float dtype), "torch" the
float32 emulation that defines the values: the dequantized operands (exact) multiplied in
float32, rounded to x's dtype. Where the CUDA fast path does not apply, "auto" emulates
too. The GEMMs are the vendor's. The quantization: on CUDA outside torch.compile, one
Triton kernel per operand (_quantize_kernel: the amax pass and the quantize pass over each
slice, one byte written per value, any input strides, the output laid out as the GEMM reads
it), the same bits as the torch ops; under torch.compile the torch ops, in a
torch.autograd.Function (no custom op), so the compiler traces them with the GEMM and fuses
each operand's amax, scale and cast. grouped_mlp's quantization runs inside its
grouped-GEMM custom op, always by the kernel on CUDA.

Legend: M rows (tokens), K contracted dim, N output dim; R rows of x_perm, E experts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import IMPLS, autocast_off, next_pow2, transform_of, use_triton
from fmoe.ops.checks import FLOAT_DTYPES

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_EXPONENT = -126  # scales stay normal float32 numbers: 2^-126 at least


# ----------------------------------------------------------------------------------------
# 1. Reference: quantization and the emulated GEMMs (the definition of correctness)
# ----------------------------------------------------------------------------------------


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales, the smallest power of two s >= amax / 448 (1 where amax is 0, NaN or
    infinite where amax is): computed exactly with frexp, no log2 rounding."""
    ratio = amax.float() / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)
    exponent = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp(min=_MIN_EXPONENT)  # 0.5 * 2^e is 2^(e-1) exactly
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    return torch.where(torch.isfinite(ratio), scale, ratio)


def _quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_fp8 in t's layout, float32 scale with dim kept as 1): module docstring's q."""
    if t.shape[dim]:
        amax = t.abs().amax(dim=dim, keepdim=True)
    else:  # empty slices (K = 0): amax 0, scale 1, as the kernel gives (amax of nothing is an error)
        amax = t.new_zeros(t.shape[:dim] + (1,) + t.shape[dim:][1:])
    scale = pow2_scale(amax)
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


# ----------------------------------------------------------------------------------------
# 1b. The quantization kernel (the same bits as _quantize)
# ----------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(q):
    """The e4m3fn byte (in an int32) of float32 q, |q| <= 448 or NaN, rounded to nearest even.
    Assembled by hand rather than by a cast, so the interpreter gives the GPU's bits."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(q)
    a_bits = a.to(tl.int32, bitcast=True)
    # normal (|q| >= 2^-6): float32's 23 mantissa bits rounded to 3, ties to even; a carry
    # moves into the exponent; the exponent rebiased from 127 to 7
    kept = (a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20
    normal = (((kept >> 3) - 120) << 3) | (kept & 7)
    # subnormal: a multiple of 2^-9 (float32's ulp at 2^14), 8 of them being 2^-6's byte
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    byte = tl.where(a < 0.015625, sub, normal)
    return tl.where(q != q, 0x7F, byte) | sign


@triton.jit
def _quantize_kernel(t_ptr, out_ptr, scale_ptr, R, K, stride_tb, stride_tr, stride_tk, stride_ob, stride_or, stride_ok,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slices r of batch b of t [B, R, K] (any strides), each over K: the scale (pow2_scale of
    its amax) to scale[b, r], its values t / scale clamped to +-448 as e4m3 bytes to out
    (uint8, any strides). Two passes over K: the amax, then the bytes. Program pid: batch
    pid // cdiv(R, BLOCK_R), its block pid % cdiv(R, BLOCK_R) of BLOCK_R slices."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(R, BLOCK_R)
    b, pid_r = pid // n_blocks, pid % n_blocks
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    t_rows = t_ptr + b.to(tl.int64) * stride_tb + rows.to(tl.int64)[:, None] * stride_tr
    out_rows = out_ptr + b.to(tl.int64) * stride_ob + rows.to(tl.int64)[:, None] * stride_or
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    nan = tl.zeros([BLOCK_R], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        x = tl.load(t_rows + ks.to(tl.int64)[None, :] * stride_tk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        nan = nan | tl.max((x != x).to(tl.int32), axis=1)
    # pow2_scale by the bits of amax / 448: the smallest power of two at least that (its
    # exponent field, +1 unless it is one); 1 for 0, 2^-126 below the normal numbers
    ratio = tl.div_rn(amax, 448.0)
    bits = ratio.to(tl.int32, bitcast=True)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    field = tl.where(mantissa == 0, exponent, exponent + 1)
    field = tl.where(exponent == 0, tl.where(mantissa == 0, 127, 1), field)
    big = field >= 255  # amax / 448 infinite (or NaN), or rounding up to 2^128: infinite
    scale = tl.where(big, float("inf"), (field << 23).to(tl.float32, bitcast=True))
    inv = tl.where(big, 0.0, ((254 - field) << 23).to(tl.float32, bitcast=True))  # 1 / scale, exactly
    scale = tl.where(nan != 0, float("nan"), scale)
    inv = tl.where(nan != 0, float("nan"), inv)
    tl.store(scale_ptr + b.to(tl.int64) * R + rows, scale, mask=row_ok)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        x = tl.load(t_rows + ks.to(tl.int64)[None, :] * stride_tk, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_rows + ks.to(tl.int64)[None, :] * stride_ok, _e4m3_bits(q).to(tl.uint8), mask=mask)


def _quantize_triton(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize by _quantize_kernel: t_fp8 laid out with `dim` innermost (row-major over the
    other dims in their order), which is the layout torch._scaled_mm and
    torch._scaled_grouped_mm read each operand in; the scale as _quantize's."""
    moved = t.movedim(dim, -1)
    shape = moved.shape
    rows = shape[-2] if moved.ndim >= 2 else 1
    view = moved.reshape(math.prod(shape[:-2]), rows, shape[-1])  # [B, R, K], sizes explicit: K or R may be 0
    B, R, K = view.shape
    out = torch.empty(B, R, K, dtype=E4M3, device=t.device)
    scale = torch.empty(B, R, dtype=torch.float32, device=t.device)
    if B * R:  # empty slices (K = 0) too: amax 0, scale 1
        rows_inner = view.stride(2) != 1 and view.stride(1) == 1  # slices along memory: a weight's columns
        block_r, block_k = (64, 64) if rows_inner else (4, min(1024, next_pow2(K)))
        grid = (B * triton.cdiv(R, block_r),)
        _quantize_kernel[grid](view, out.view(torch.uint8), scale, R, K, *view.stride(), *out.stride(), BLOCK_R=block_r, BLOCK_K=block_k)
    return out.reshape(shape).movedim(-1, dim), scale.reshape(*shape[:-1], 1).movedim(-1, dim)


def _quantize_fast(t: torch.Tensor, dim: int, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize's bits: the kernel where use_triton(impl, t) picks it, except while
    torch.compile traces (the torch ops, for it to fuse)."""
    if use_triton(impl, t) and not torch.compiler.is_compiling():
        return _quantize_triton(t, dim)
    t_fp8, scale = _quantize(t.movedim(dim, -1).contiguous(), -1)  # the kernel's layout: dim innermost
    return t_fp8.movedim(-1, dim), scale.movedim(-1, dim)


def _dequantized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """q(t) along dim as exact float32 values."""
    t_fp8, scale = _quantize(t, dim)
    return t_fp8.float() * scale


def fp8_mm_ref(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """q_K(a) @ q_K(b) in float32, rounded to a's dtype: the emulation of one fp8 GEMM."""
    return (_dequantized(a_MK, 1) @ _dequantized(b_KN, 0)).to(a_MK.dtype)


# ----------------------------------------------------------------------------------------
# 2. The fast path: torch._scaled_mm on the quantized operands
# ----------------------------------------------------------------------------------------


def _scaled_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """q_K(a) @ q_K(b) by torch._scaled_mm: each operand quantized with K innermost (a
    row-major, b column-major, as cuBLAS reads them), scales [M, 1] and [1, N]."""
    a_fp8, scale_a = _quantize_fast(a_MK, 1)
    b_fp8, scale_b = _quantize_fast(b_KN, 0)  # K innermost: b column-major
    return torch._scaled_mm(a_fp8, b_fp8, scale_a=scale_a, scale_b=scale_b, out_dtype=a_MK.dtype)


@autocast_off
def _gemm(a_MK: torch.Tensor, b_KN: torch.Tensor, scaled_mm: bool) -> torch.Tensor:
    if a_MK.shape[0] == 0 or a_MK.shape[1] == 0 or b_KN.shape[1] == 0:  # nothing to multiply
        return a_MK.new_zeros(a_MK.shape[0], b_KN.shape[1])
    return _scaled_mm(a_MK, b_KN) if scaled_mm else fp8_mm_ref(a_MK, b_KN)


class _FP8MatMul(torch.autograd.Function):
    """y = q_K(x) q_K(w) in x's dtype; backward dx = q_N(dy) q_N(w)^T in x's dtype, dw = x^T dy
    in w's dtype (float32 accumulation). Plain torch ops, no custom op: torch.compile traces
    the quantization with the GEMMs and fuses each operand's amax, scale and cast. torch.func
    takes it (grad, vjp, jacrev; vmap by torch's generated rule); forward-mode AD has no
    tangent to take (fp8_matmul refuses it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, scaled_mm: bool):
        return _gemm(x, w, scaled_mm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, scaled_mm = inputs
        ctx.save_for_backward(x, w)
        ctx.scaled_mm = scaled_mm

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        grad_y = grad_y.to(x.dtype)
        grad_x = _gemm(grad_y, w.t(), ctx.scaled_mm)
        if ctx.scaled_mm:  # the vendor's GEMM in the compute dtype
            grad_w = (x.t() @ grad_y).to(w.dtype)
        else:
            grad_w = (x.float().t() @ grad_y.float()).to(w.dtype)
        return grad_x, grad_w, None


# ----------------------------------------------------------------------------------------
# 3. Public functions
# ----------------------------------------------------------------------------------------


def fp8_quantize(t: torch.Tensor, dim: int = -1, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization with power-of-two scales (module docstring).

    Args:
        t: a float32 / bfloat16 / float16 tensor of at least one dim, any strides.
        dim: the dim each scale covers (a GEMM's contracted dim).
        impl: "auto" (the Triton kernel on CUDA, except under torch.compile; torch ops
            otherwise), "triton" or "torch": the same bits.

    Returns:
        (t_fp8, scale): t_fp8 float8_e4m3fn of t's shape, laid out with `dim` innermost
        (stride 1; the other dims row-major in their order: the layout torch._scaled_mm and
        torch._scaled_grouped_mm take an operand in); scale float32 of t's shape with `dim`
        of size 1, a power of two per slice; t_fp8.float() * scale is the quantized t (t
        itself wherever t / scale is an e4m3 value; e4m3 keeps 3 mantissa bits, so 600
        becomes 576 below).

    Example:
        >>> t_fp8, scale = fp8_quantize(torch.tensor([[1.0, -3.0, 600.0]]))
        >>> scale, t_fp8.float() * scale
        (tensor([[2.]]), tensor([[  1.,  -3., 576.]]))
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.ndim == 0:
        got = f"{t.dtype} of {t.ndim} dims" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"t: expected a float32 / bfloat16 / float16 tensor of at least 1 dim, got {got}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -t.ndim <= dim < t.ndim:
        raise ValueError(f"dim: expected an int in {-t.ndim}..{t.ndim - 1} (t has {t.ndim} dims), got {dim!r}")
    return _quantize_fast(t, dim, impl)


def _fast_path(x: torch.Tensor, K: int, N: int) -> bool:
    """Whether torch._scaled_mm runs the GEMMs: CPU always; CUDA for bfloat16 with K and N
    multiples of 16 (cuBLAS's row-wise fp8 rule) on a GPU with fp8 tensor cores (sm89+)."""
    if x.device.type == "cpu":
        return True
    return (x.is_cuda and x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """x @ w with the forward and input-gradient GEMMs in fp8 (module docstring).

    Args:
        x: [..., K] float32 / bfloat16 / float16.
        w: [K, N], x's dtype and device.
        impl: "auto" or "triton" (torch._scaled_mm where it runs: CPU, or CUDA bfloat16
            with K and N multiples of 16; the emulation elsewhere) or "torch" (the float32
            emulation of the quantized GEMMs, the definition of the values).

    Returns:
        y [..., N] in x's dtype: q_K(x) q_K(w) accumulated in float32. Differentiable: dx =
        q_N(dy) q_N(w)^T (fp8), dw = x^T dy (x's dtype, float32 accumulation); torch.func's
        grad, vjp and vmap take it, forward-mode AD (jvp, dual tensors) raises a ValueError.

    Example:
        >>> fp8_matmul(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [0.5]]))
        tensor([[4.]])
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.ndim == 0:
        got = f"{x.dtype} of {x.ndim} dims" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a float32 / bfloat16 / float16 tensor [..., K], got {got}")
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or w.shape[0] != x.shape[-1]:
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"w: expected a 2-D tensor [K, N] with K = {x.shape[-1]} (x's last dim), got {got}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w: expected x's dtype and device ({x.dtype}, {x.device}), got {w.dtype}, {w.device}")
    K, N = w.shape
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    # each input apart: under an outer torch.func transform the first wrapped input answers for both
    if (transform := next((t for v in (x, w) if (t := transform_of(v)) and t.startswith("forward-mode")), None)) is not None:
        raise ValueError(f"x, w: {transform} has no tangent here: fp8_matmul's gradient is the quantized GEMMs' "
                         "backward alone (a straight-through estimate); take forward-mode AD without fp8 (x @ w)")
    fast = impl != "torch" and _fast_path(x, K, N)
    y = _FP8MatMul.apply(x.reshape(x.shape[:-1].numel(), K), w, fast)  # not -1: K = 0 leaves it ambiguous
    return y.reshape(*x.shape[:-1], N)


def matmul(x: torch.Tensor, w: torch.Tensor, *, fp8: bool, impl: str = "auto") -> torch.Tensor:
    """x @ w, or with fp8 fp8_matmul(x, w): the layers' projections (fmoe.layers). impl: a
    layer's ("flex" and the like run as "auto"; "torch" emulates)."""
    if not fp8:
        return x @ w
    return fp8_matmul(x, w, impl="torch" if impl == "torch" else "auto")


def check_fp8(value) -> bool:
    """The fp8 knob as a bool; ValueError otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"fp8: expected a bool (True: the projections' GEMMs in fp8, fmoe.ops.fp8_matmul), got {value!r}")
    return value


def check_fp8_fast_accum(value, fp8: bool) -> bool:
    """The fp8_fast_accum knob as a bool, refused without fp8; ValueError otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"fp8_fast_accum: expected a bool (True: the experts' fp8 GEMMs with the tensor cores' own accumulator), got {value!r}")
    if value and not fp8:
        raise ValueError("fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True")
    return value

