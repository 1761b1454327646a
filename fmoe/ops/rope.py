"""Rotary position embeddings and YaRN context extension (SPEC.md section 4).

    rope_inv_freq(D) -> inv_freq[F]                    inv_freq_j = base^(-2j/D), j < F = D/2
    yarn_inv_freq(D, base, factor, L) -> inv_freq[F]
    llama3_inv_freq(D, base, factor, L) -> inv_freq[F]
    longrope_inv_freq(D, base, factors[F]) -> inv_freq[F]
    rope_cos_sin(positions[T], inv_freq[F]) -> cos[T,F], sin[T,F]
    apply_rope(x[..., T, H, D], cos[T,F], sin[T,F]) -> x[..., T, H, D]

cos/sin hold cos(p_t * inv_freq_j) and sin(p_t * inv_freq_j), times `scale`, for explicit
positions p_t (packed documents restart at 0). apply_rope rotates the first R = 2F channels
of each head by those angles and passes channels R..D-1 through unchanged (R < D: the
decoupled RoPE part of multi-latent attention):

    rotate-half (interleaved=False): the pairs are (i, i + F), i < F:
        out = x * [cos, cos] + rotate_half(x) * [sin, sin],  rotate_half(x) = [-x[F:R], x[:F]]
    interleaved=True: the pairs are (2i, 2i + 1):
        out[2i] = x[2i] cos_i - x[2i+1] sin_i,   out[2i+1] = x[2i+1] cos_i + x[2i] sin_i

that is, pair i as the complex number x_a + i x_b times e^{i theta_ti}. Computed in float32,
stored in x's dtype. A rotation is orthogonal, so the gradient is the inverse rotation (the
same kernel with sin negated) of the upstream gradient; it needs no saved activation, which
is what makes the in-place variant (inplace=True: q and k rotated where they lie, e.g.
inside a fused qkv projection) differentiable. cos and sin get no gradient.

YaRN with factor s, original context L and rotation counts beta_fast, beta_slow:

    d(r)   = D ln(L / (2 pi r)) / (2 ln base)
    low    = max(floor(d(beta_fast)), 0);   high = min(ceil(d(beta_slow)), D - 1)
             (truncate=False, gpt-oss: no floor / ceil)
             (if low == high: high += 0.001)
    ramp_j = clamp((j - low) / (high - low), 0, 1)
    inv_freq_j = (base_inv_freq_j / s) ramp_j + base_inv_freq_j (1 - ramp_j)
    mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1
    cos/sin scale = mscale(s, mscale) / mscale(s, mscale_all_dim)    (yarn_cos_sin_scale)
    softmax scale = mscale(s, mscale_all_dim)^2 / sqrt(q_head_dim)    (yarn_softmax_scale)

Llama 3.1's frequency-dependent scaling (rope_type "llama3") with factor s, original context
L, low_freq_factor a and high_freq_factor b (a <= b), each frequency by its wavelength
w_j = 2 pi / base_inv_freq_j:

    w_j < L / b  (fast):   inv_freq_j = base_inv_freq_j                      (kept)
    w_j > L / a  (slow):   inv_freq_j = base_inv_freq_j / s                  (interpolated)
    otherwise:             smooth_j = (L / w_j - a) / (b - a)
                           inv_freq_j = (1 - smooth_j) base_inv_freq_j / s + smooth_j base_inv_freq_j

with no attention scale. Llama 3.1 (D 128, base 5e5, s 8, a 1, b 4, L 8192): frequencies
0..28 kept, 29..34 blended (divided by 1.2075 at 29 up to 5.2573 at 34), 35..63 divided by 8.
a = b has no blend, a step at w = L / a (Llama 4 Scout: s 16, a = b = 1, L 8192: 0..34 kept,
35..63 divided by 16).

LongRoPE (Phi-3's rope_type "longrope", also "su"), with per-frequency factors f_j > 0 over
an original context L, extended to L' positions (s = L' / L):

    inv_freq_j = base_inv_freq_j / f_j
    cos/sin scale = sqrt(1 + ln s / ln L) if s > 1 else 1       (longrope_scale)

A checkpoint holds two sets of factors: the short ones for sequences of at most L positions,
the long ones beyond (the switch is the model's: fmoe.layers.rope_tables). Phi-3.5-mini
(D 96, base 1e4, L 4096, s 32): scale sqrt(1 + ln 32 / ln 4096) = 1.19024; short factors
near 1, long ones up to about 40 for the slowest frequencies.

Legend: T tokens (positions), H heads, D head_dim, R rotated channels (rot_dim), F = R/2
frequencies (pairs), P = D - R pass-through channels, N = prod(leading dims) * T rows of
the [N, H, D] view the kernel works on.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fmoe.ops.backend import next_pow2, use_triton
from fmoe.ops.checks import FLOAT_DTYPES, INDEX_DTYPES, check_bools, check_distinct_memory, check_positive_int

# ----------------------------------------------------------------------------------------
# 0. Frequencies and scales (host-side scalars and [F] tables)
# ----------------------------------------------------------------------------------------


def _check_number(name: str, value, *, above: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (above < value < math.inf):
        raise ValueError(f"{name}: expected a finite number > {above:g}, got {value!r}")
    return float(value)


def _check_ordered(low_name: str, low, high_name: str, high, *, equal: bool = False) -> tuple[float, float]:
    """Two positive finite numbers with high > low, or high >= low with equal (YaRN's rotation
    counts, Llama 3.1's frequency factors)."""
    low, high = _check_number(low_name, low, above=0.0), _check_number(high_name, high, above=0.0)
    if high < low or (high == low and not equal):
        raise ValueError(f"{high_name}: expected {'at least' if equal else 'more than'} {low_name} = {low:g}, got {high:g}")
    return low, high


def _check_dim(dim) -> int:
    check_positive_int("dim", dim, 2)
    if dim % 2:
        raise ValueError(f"dim: expected an even number of rotated channels (pairs), got {dim}")
    return dim


def _base_inv_freq_F(dim: int, base: float) -> torch.Tensor:
    """base^(-2j/dim) in float64 (rounded to float32 once, by the callers)."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def rope_inv_freq(dim: int, *, base: float = 10000.0, device=None) -> torch.Tensor:
    """RoPE inverse frequencies inv_freq_j = base^(-2j/dim), j = 0..dim/2-1.

    Args:
        dim: R, the number of rotated channels (even, >= 2).
        base: the RoPE base theta (> 1).
    Returns:
        [dim/2] float32 (computed in float64, rounded once).
    """
    dim = _check_dim(dim)
    base = _check_number("base", base, above=1.0)
    return _base_inv_freq_F(dim, base).to(device=device, dtype=torch.float32)


def yarn_correction_range(
    dim: int, *, base: float, original_max_positions: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
    truncate: bool = True,
) -> tuple[float, float]:
    """YaRN's (low, high) frequency-index range of the ramp (SPEC.md section 4).

    Frequencies j <= low rotate more than beta_fast times over the original context L and
    keep their frequency; j >= high rotate fewer than beta_slow times and are interpolated
    (divided by the factor); in between the ramp blends the two. DeepSeek-V3 (dim 64, base
    1e4, L 4096): (10, 23). The index turning r times over L is
    d(r) = dim * ln(L / (2 pi r)) / (2 ln(base)).

    truncate: round low down and high up to whole indices (YaRN's paper, DeepSeek-V3); False
    keeps the fractional bounds (gpt-oss, transformers' `truncate: false`).

    Returns:
        (low, high) = (max(d(beta_fast), 0), min(d(beta_slow), dim - 1)): low clamped from
        below only, high from above only; ints when truncate (d rounded before clamping),
        except high = low + 0.001 when they coincide. So high can be below low: an original
        context so short that d(beta_slow) < 0 gives high < 0 = low (dim 64, base 1e4, L 1:
        (0, -6)), and yarn_inv_freq's ramp is then 0 for every j: no frequency is
        interpolated. One so long that d(beta_fast) > dim - 1 gives low > dim - 1 = high
        (dim 4, base 2, L 1e6: (24, 3)), and the ramp is 1 for every j: every frequency is.
    """
    dim = _check_dim(dim)
    base = _check_number("base", base, above=1.0)
    check_positive_int("original_max_positions", original_max_positions)
    # rotations over L; equal (Kimi K2's 1 and 1): the ramp is a step at d(beta) (SPEC.md section 4)
    beta_slow, beta_fast = _check_ordered("beta_slow", beta_slow, "beta_fast", beta_fast, equal=True)

    def d(rotations):  # the frequency index that turns `rotations` times over L positions
        return dim * math.log(original_max_positions / (2 * math.pi * rotations)) / (2 * math.log(base))

    check_bools(truncate=truncate)
    low, high = d(beta_fast), d(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:  # a zero-width ramp would divide by zero
        return low, high + 0.001
    return low, high


def yarn_inv_freq(
    dim: int, *, base: float, factor: float, original_max_positions: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0, device=None, truncate: bool = True,
) -> torch.Tensor:
    """YaRN inverse frequencies: high frequencies kept, low ones divided by `factor`.

    Args:
        dim: R, the number of rotated channels (even, >= 2).
        base: the RoPE base (> 1).
        factor: s, the context extension factor (> 0; 1 gives rope_inv_freq).
        original_max_positions: L, the context length the model was trained at.
        beta_fast, beta_slow: the rotation counts bounding the ramp (32 and 1).
        truncate: whole-index ramp bounds (yarn_correction_range; False: gpt-oss's).
    Returns:
        [dim/2] float32 (computed in float64, rounded once).
    """
    dim = _check_dim(dim)
    factor = _check_number("factor", factor, above=0.0)
    low, high = yarn_correction_range(
        dim, base=base, original_max_positions=original_max_positions, beta_fast=beta_fast, beta_slow=beta_slow,
        truncate=truncate,
    )
    base_F = _base_inv_freq_F(dim, float(base))
    ramp_F = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return ((base_F / factor) * ramp_F + base_F * (1.0 - ramp_F)).to(device=device, dtype=torch.float32)


def llama3_inv_freq(
    dim: int, *, base: float, factor: float, original_max_positions: int, low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0, device=None,
) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (module docstring): wavelengths shorter than
    L / high_freq_factor kept, longer than L / low_freq_factor divided by `factor`, the
    ones between blended by L / wavelength.

    Args:
        dim: R, the number of rotated channels (even, >= 2).
        base: the RoPE base (> 1).
        factor: s, the context extension factor (> 0).
        original_max_positions: L, the context length the model was trained at.
        low_freq_factor, high_freq_factor: a <= b (> 0; Llama 3.1: 1 and 4; Llama 4 Scout: 1
            and 1, a step at wavelength L / a).
    Returns:
        [dim/2] float32 (computed in float64, rounded once).
    """
    dim = _check_dim(dim)
    base = _check_number("base", base, above=1.0)
    factor = _check_number("factor", factor, above=0.0)
    check_positive_int("original_max_positions", original_max_positions)
    low, high = _check_ordered("low_freq_factor", low_freq_factor, "high_freq_factor", high_freq_factor, equal=True)
    base_F = _base_inv_freq_F(dim, base)
    wavelen_F = 2 * math.pi / base_F
    if high == low:  # no blend: kept up to wavelength L / a, divided beyond
        smooth_F = (wavelen_F <= original_max_positions / low).to(base_F.dtype)
    else:
        smooth_F = ((original_max_positions / wavelen_F - low) / (high - low)).clamp(0.0, 1.0)  # 1 fast, 0 slow
    return ((1 - smooth_F) * base_F / factor + smooth_F * base_F).to(device=device, dtype=torch.float32)


def longrope_inv_freq(dim: int, *, base: float, factors, device=None) -> torch.Tensor:
    """LongRoPE's inverse frequencies (module docstring): base^(-2j/dim) / factors[j].

    Args:
        dim: R, the number of rotated channels (even, >= 2).
        base: the RoPE base (> 1).
        factors: dim/2 finite numbers > 0, one per frequency (a checkpoint's short_factor or
            long_factor; all 1 gives rope_inv_freq).
    Returns:
        [dim/2] float32 (computed in float64, rounded once).
    """
    dim = _check_dim(dim)
    base = _check_number("base", base, above=1.0)
    if isinstance(factors, torch.Tensor):  # a tensor of factors, as a list of them
        factors = factors.tolist()
    if isinstance(factors, (str, bytes)) or not hasattr(factors, "__len__") or len(factors) != dim // 2:
        raise ValueError(f"factors: expected {dim // 2} numbers (one per frequency of dim = {dim}), got {factors!r}")
    factors_F = [_check_number(f"factors[{j}]", f, above=0.0) for j, f in enumerate(factors)]
    return (_base_inv_freq_F(dim, base) / torch.tensor(factors_F, dtype=torch.float64)).to(device=device, dtype=torch.float32)


def longrope_scale(max_positions: int, original_max_positions: int) -> float:
    """LongRoPE's cos/sin scale for a context of max_positions extended from
    original_max_positions = L: sqrt(1 + ln(s) / ln(L)) with s = max_positions / L, 1 when
    s <= 1 (Phi-3's attention factor where config.json gives none)."""
    check_positive_int("max_positions", max_positions)
    check_positive_int("original_max_positions", original_max_positions, 2)
    factor = max_positions / original_max_positions
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_positions))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """1 if factor <= 1, else 0.1 * mscale * ln(factor) + 1."""
    return _yarn_mscale(factor, mscale, "mscale")


def _yarn_mscale(factor, mscale, name: str) -> float:
    """yarn_mscale, its mscale checked under the caller's name for it (mscale_all_dim)."""
    factor = _check_number("factor", factor, above=0.0)
    # finite by comparisons (NaN fails both): math.isfinite broke the graph on torch.compile(dynamic=True)'s symbolic floats
    if isinstance(mscale, bool) or not isinstance(mscale, (int, float)) or not -math.inf < mscale < math.inf:
        raise ValueError(f"{name}: expected a finite number, got {mscale!r}")
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_cos_sin_scale(factor: float, *, mscale: float = 1.0, mscale_all_dim: float = 1.0) -> float:
    """YaRN's attention concentration carried by cos/sin (pass as rope_cos_sin's `scale`):
    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim).

    DeepSeek-V3 (mscale = mscale_all_dim = 1) gives 1: its whole concentration goes into the
    softmax scale (yarn_softmax_scale). Plain YaRN, with 0.1 ln(s) + 1 on cos/sin and the
    usual 1/sqrt(d) softmax scale, is mscale=1, mscale_all_dim=0.
    """
    return yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim, "mscale_all_dim")


def yarn_softmax_scale(head_dim: int, *, factor: float, mscale_all_dim: float) -> float:
    """The attention softmax scale under YaRN: yarn_mscale(factor, mscale_all_dim)^2 / sqrt(head_dim).

    head_dim is the query-key dim (DeepSeek-V3: 192 = 128 nope + 64 rope). It takes
    mscale_all_dim, never mscale (a past Megatron bug used mscale).
    """
    check_positive_int("head_dim", head_dim)
    return _yarn_mscale(factor, mscale_all_dim, "mscale_all_dim") ** 2 / math.sqrt(head_dim)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles positions[t] * inv_freq[j], times scale.

    The angles are float32 products, as in the Hugging Face and Megatron models, so that
    rotations match theirs. Their rounding grows with the position: against angles rounded
    once from float64, cos and sin are off by up to 2e-4 below position 4096 and 5e-2 near
    2**20 (1M tokens; transformers' tables 7.5e-2, head dim 128, base 5e5), and past 2**24
    float32 no longer holds every position (2**24 and 2**24 + 1 get one rotation).

    Args:
        positions: [T] int32/int64 explicit positions (packed documents restart at 0).
        inv_freq: [F] float (rope_inv_freq or yarn_inv_freq).
        scale: multiplies cos and sin (yarn_cos_sin_scale; 1 for plain RoPE).
    Returns:
        (cos, sin), each [T, F] float32.
    """
    if not isinstance(positions, torch.Tensor) or positions.ndim != 1 or positions.dtype not in INDEX_DTYPES:
        got = f"{positions.dtype} of shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions: expected a 1-D int32/int64 tensor [T], got {got}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.ndim != 1 or not inv_freq.is_floating_point():
        got = f"{inv_freq.dtype} of shape {tuple(inv_freq.shape)}" if isinstance(inv_freq, torch.Tensor) else type(inv_freq).__name__
        raise ValueError(f"inv_freq: expected a 1-D float tensor [F], got {got}")
    if inv_freq.device != positions.device:
        raise ValueError(f"inv_freq: expected positions' device {positions.device}, got {inv_freq.device}")
    scale = _check_number("scale", scale, above=0.0)
    angles_TF = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos_TF, sin_TF = torch.cos(angles_TF), torch.sin(angles_TF)
    if scale != 1.0:
        cos_TF, sin_TF = cos_TF * scale, sin_TF * scale
    return cos_TF, sin_TF


# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def apply_rope_ref(x, cos_TF, sin_TF, interleaved=False):
    """Plain-torch RoPE of x [..., T, H, D] (SPEC.md section 4), float32 math, x's dtype out.

    Differentiable w.r.t. x, and w.r.t. cos/sin if they require grad (apply_rope detaches
    them on either path: it differentiates x alone).
    """
    R = 2 * cos_TF.shape[-1]
    x_f = x.float()
    rot, rest = x_f[..., :R], x_f[..., R:]
    if interleaved:  # pairs (2i, 2i+1): cos/sin repeated per pair
        cos_TR = cos_TF.float().repeat_interleave(2, dim=-1)
        sin_TR = sin_TF.float().repeat_interleave(2, dim=-1)
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
    else:  # pairs (i, i+F): cos/sin repeated over the two halves
        cos_TR = torch.cat([cos_TF, cos_TF], dim=-1).float()
        sin_TR = torch.cat([sin_TF, sin_TF], dim=-1).float()
        turned = torch.cat([-rot[..., R // 2:], rot[..., : R // 2]], dim=-1)  # rotate_half
    # [T, R] -> [T, 1, R]: the same angles for every head (and every leading batch index)
    out = rot * cos_TR[:, None, :] + turned * sin_TR[:, None, :]
    return torch.cat([out, rest], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------
# 2. Triton kernel (forward, and with INVERSE the backward)
# ----------------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, N, T, H,
    stride_xn, stride_xh, stride_on, stride_oh,
    F: tl.constexpr, P: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate a [BLOCK_T rows, BLOCK_H heads] tile of the [N, H, D] view by its rows' angles.

    Row n has position index n % T. cos/sin are loaded once per row and broadcast over the
    heads. INVERSE rotates by minus the angles (the backward). P > 0 copies the P channels
    after the 2F rotated ones (0 when rotating in place: they are already there).
    """
    rows_T = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads_H = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    f_F = tl.arange(0, BLOCK_F)
    row_ok_T = rows_T < N
    f_ok_F = f_F < F
    cs_off_TF = (rows_T % T).to(tl.int64)[:, None] * F + f_F[None, :]
    cs_mask_TF = row_ok_T[:, None] & f_ok_F[None, :]
    cos_TF = tl.load(cos_ptr + cs_off_TF, mask=cs_mask_TF, other=0.0).to(tl.float32)
    sin_TF = tl.load(sin_ptr + cs_off_TF, mask=cs_mask_TF, other=0.0).to(tl.float32)
    if INVERSE:
        sin_TF = -sin_TF
    cos_THF = cos_TF[:, None, :]
    sin_THF = sin_TF[:, None, :]

    # int64 offsets: rows x stride passes 2**31 at long T, and so do heads x stride in a head-major view
    rows64_T, heads64_H = rows_T.to(tl.int64), heads_H.to(tl.int64)
    x_off_TH = rows64_T[:, None] * stride_xn + heads64_H[None, :] * stride_xh
    o_off_TH = rows64_T[:, None] * stride_on + heads64_H[None, :] * stride_oh
    live_TH = row_ok_T[:, None] & (heads_H[None, :] < H)
    mask_THF = live_TH[:, :, None] & f_ok_F[None, None, :]
    if INTERLEAVED:
        # pair i is the two adjacent channels (2i, 2i+1): one contiguous load of the 2F
        # rotated channels (16-byte accesses), split into the halves of each pair
        r_R = tl.arange(0, 2 * BLOCK_F)
        mask_THR = live_TH[:, :, None] & (r_R < 2 * F)[None, None, :]
        ab_THR = tl.load(x_ptr + x_off_TH[:, :, None] + r_R[None, None, :], mask=mask_THR, other=0.0)
        a_THF, b_THF = tl.split(tl.reshape(ab_THR.to(tl.float32), [BLOCK_T, BLOCK_H, BLOCK_F, 2]))
    else:
        # pair i is (i, i + F): two contiguous half-loads
        a_ptrs = x_ptr + x_off_TH[:, :, None] + f_F[None, None, :]
        a_THF = tl.load(a_ptrs, mask=mask_THF, other=0.0).to(tl.float32)
        b_THF = tl.load(a_ptrs + F, mask=mask_THF, other=0.0).to(tl.float32)

    # (a + ib) e^{i theta}
    ra_THF = (a_THF * cos_THF - b_THF * sin_THF).to(out_ptr.dtype.element_ty)
    rb_THF = (b_THF * cos_THF + a_THF * sin_THF).to(out_ptr.dtype.element_ty)
    if INTERLEAVED:
        out_THR = tl.reshape(tl.join(ra_THF, rb_THF), [BLOCK_T, BLOCK_H, 2 * BLOCK_F])
        tl.store(out_ptr + o_off_TH[:, :, None] + r_R[None, None, :], out_THR, mask=mask_THR)
    else:
        ra_ptrs = out_ptr + o_off_TH[:, :, None] + f_F[None, None, :]
        tl.store(ra_ptrs, ra_THF, mask=mask_THF)
        tl.store(ra_ptrs + F, rb_THF, mask=mask_THF)

    if P > 0:
        p_P = tl.arange(0, BLOCK_P)
        mask_THP = live_TH[:, :, None] & (p_P < P)[None, None, :]
        rest_THP = tl.load(x_ptr + x_off_TH[:, :, None] + 2 * F + p_P[None, None, :], mask=mask_THP, other=0.0)
        tl.store(out_ptr + o_off_TH[:, :, None] + 2 * F + p_P[None, None, :], rest_THP, mask=mask_THP)


_TILE = 4096  # elements per program: 32 per thread of 4 warps (four 16-byte bf16 accesses)


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _blocks(H: int, F: int, P: int) -> dict:
    """A [BLOCK_T, BLOCK_H, head] tile of about _TILE elements, head = 2 BLOCK_F (+ BLOCK_P
    copied channels): all the heads of a row when they fit (cos/sin then read once per
    row), more rows per program when heads are few."""
    block_f = next_pow2(F)
    block_p = next_pow2(P) if P else 1
    per_head = 2 * block_f + (block_p if P else 0)
    block_h = min(next_pow2(H), _pow2_at_most(_TILE // per_head))
    block_t = _pow2_at_most(_TILE // (per_head * block_h))
    return dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_F=block_f, BLOCK_P=block_p, num_warps=4)


def _rows_view(x: torch.Tensor):
    """x [..., T, H, D] as an [N, H, D] view with unit channel stride, or None."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:  # leading dims that do not collapse into one stride
        return None


def _launch(x_NHD, cos_TF, sin_TF, out_NHD, T, interleaved, inverse):
    """Rotate x_NHD into out_NHD, or into x_NHD itself when out_NHD is None."""
    N, H, D = x_NHD.shape
    F = cos_TF.shape[1]
    P = D - 2 * F if out_NHD is not None else 0  # in place the rest is already there
    out_NHD = x_NHD if out_NHD is None else out_NHD
    meta = _blocks(H, F, P)
    grid = (triton.cdiv(N, meta["BLOCK_T"]), triton.cdiv(H, meta["BLOCK_H"]))
    _rope_kernel[grid](
        x_NHD, cos_TF.contiguous(), sin_TF.contiguous(), out_NHD, N, T, H,
        x_NHD.stride(0), x_NHD.stride(1), out_NHD.stride(0), out_NHD.stride(1),
        F=F, P=P, INTERLEAVED=interleaved, INVERSE=inverse, **meta,
    )


# ----------------------------------------------------------------------------------------
# 3. torch.library registration
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("fmoe::rope", mutates_args=())
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool) -> torch.Tensor:
    """x [..., T, H, D] rotated by the angles of cos/sin [T, F] (inverse: by minus them)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        x_NHD = _rows_view(x)
        if x_NHD is None:
            x_NHD = x.contiguous().view(-1, x.shape[-2], x.shape[-1])
        _launch(x_NHD, cos, sin, out.view(x_NHD.shape), x.shape[-3], interleaved, inverse)
    return out


@_rope.register_fake
def _(x, cos, sin, interleaved, inverse):
    return x.new_empty(x.shape)


def _rope_setup_context(ctx, inputs, output):
    _x, cos, sin, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.inverse = interleaved, inverse


def _rope_backward(ctx, grad_out):
    # the transpose of a rotation is the inverse rotation; cos/sin are not differentiated
    cos, sin = ctx.saved_tensors
    return _rope(grad_out, cos, sin, ctx.interleaved, not ctx.inverse), None, None, None, None


_rope.register_autograd(_rope_backward, setup_context=_rope_setup_context)


@torch.library.custom_op("fmoe::rope_", mutates_args=("x",))
def _rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool) -> None:
    """In-place fmoe::rope: x [..., T, H, D] overwritten by its rotation."""
    if not x.numel():
        return
    x_NHD = _rows_view(x)
    if x_NHD is None:  # no [N, H, D] view of x's memory: rotate a copy and write it back
        x.copy_(_rope(x, cos, sin, interleaved, inverse))
    else:
        _launch(x_NHD, cos, sin, None, x.shape[-3], interleaved, inverse)


@_rope_.register_fake
def _(x, cos, sin, interleaved, inverse):
    return None


class _RopeInPlace(torch.autograd.Function):
    """Autograd for fmoe::rope_ (torch.library cannot register autograd on a mutating op), in
    eager only: torch.compile makes wrong gradients of a Function that marks its input dirty
    (before 2.13 where x is a view, q and k inside a qkv buffer; on 2.13 where x is a non-leaf
    input of the compiled region: the rotation's backward skipped), so under the compiler
    apply_rope rotates a copy and writes it back (which the compiler may do in place again).

    The backward needs only cos/sin, never x, so overwriting x is safe; mark_dirty moves
    x's autograd history past the rotation, as for torch's own in-place ops.
    """

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        _rope_(x, cos, sin, interleaved, False)
        ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return x

    @staticmethod
    def backward(ctx, grad_x):
        cos, sin = ctx.saved_tensors
        return _rope(grad_x, cos, sin, ctx.interleaved, True), None, None, None


# ----------------------------------------------------------------------------------------
# 4. Public function
# ----------------------------------------------------------------------------------------


def _check_cos_sin(x, cos, sin):
    T, D = x.shape[-3], x.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor [T, rot_dim/2], got {type(t).__name__}")
        if t.ndim != 2 or t.shape[0] != T or t.shape[1] < 1:
            raise ValueError(
                f"{name}: expected [T, rot_dim/2] with T = x.shape[-3] = {T} and rot_dim/2 >= 1, "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {t.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if 2 * cos.shape[1] > D:
        raise ValueError(
            f"cos: rot_dim = 2 * cos.shape[-1] = {2 * cos.shape[1]} exceeds head_dim = x.shape[-1] = {D}"
        )


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
    interleaved: bool = False, inplace: bool = False, impl: str = "auto",
) -> torch.Tensor:
    """Rotate the first rot_dim channels of every head by the angles of cos/sin (SPEC.md 4).

    Args:
        x: [..., T, H, D] queries or keys, float32 / bfloat16 / float16; leading batch dims
            share the T positions. Any strides with unit channel stride are read in place.
        cos, sin: [T, R/2] from rope_cos_sin; R = rot_dim <= D. Channels R..D-1 pass through
            unchanged. Not differentiated (their gradient is None).
        interleaved: pairs (2i, 2i+1) instead of the rotate-half pairs (i, i + R/2).
        inplace: overwrite x and return it (q and k rotated inside a fused qkv buffer
            without a copy); x's elements must not share memory (no expand). Differentiable like torch's in-place ops: x may be a
            non-leaf that requires grad (the backward needs only cos/sin); a leaf that
            requires grad is refused while grad mode is on. Under torch.compile with grad
            the rotation is written back over x (x.copy_), which the compiler may fuse.
        impl: "auto" (Triton on CUDA, torch otherwise), "triton" or "torch".

    Returns:
        [..., T, H, D] in x's dtype (x itself when inplace).

    Example:
        >>> cos, sin = rope_cos_sin(torch.arange(3), rope_inv_freq(4))
        >>> apply_rope(torch.ones(3, 1, 4), cos, sin).shape
        torch.Size([3, 1, 4])
    """
    if not isinstance(x, torch.Tensor) or x.ndim < 3 or x.dtype not in FLOAT_DTYPES:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor [..., T, heads, head_dim] (>= 3 dims), got {got}")
    _check_cos_sin(x, cos, sin)
    check_bools(interleaved=interleaved, inplace=inplace)
    grad_mode = torch.is_grad_enabled() and x.requires_grad
    if inplace and grad_mode and x.is_leaf:
        raise ValueError(
            "inplace: x is a leaf tensor that requires grad, which cannot be overwritten; "
            "rotate a non-leaf (e.g. the output of the qkv projection) or use inplace=False"
        )
    if inplace:  # a write to one element would rotate the others again
        check_distinct_memory("x", x, "inplace=True overwrites each element with its rotation")

    if use_triton(impl, x, cos, sin):
        if not inplace:
            return _rope(x, cos, sin, interleaved, False)
        if grad_mode and torch.compiler.is_compiling():  # not _RopeInPlace: its docstring
            return x.copy_(_rope(x, cos, sin, interleaved, False))
        if grad_mode:
            return _RopeInPlace.apply(x, cos, sin, interleaved)
        _rope_(x, cos, sin, interleaved, False)
        return x
    # cos and sin detached as the kernel leaves them (no gradient), which also keeps the
    # in-place copy below from overwriting x while autograd holds it for cos's gradient
    out = apply_rope_ref(x, cos.detach(), sin.detach(), interleaved)
    return x.copy_(out) if inplace else out
