"""Experts: a SwiGLU MLP per expert over the rows that permute grouped by expert (SPEC.md section 3).

    grouped_mlp(x_perm[R,H], w_gate[E,H,F], w_up[E,H,F], w_down[E,F,H], offsets[E]) -> y_perm[R,H]
    swiglu(gate, up) = silu(gate) * up

Options (gpt-oss's experts): per-expert biases b_gate, b_up [E, F] and b_down [E, H], added
to each expert's rows after its projections, and the clamped SwiGLU

    swiglu(gate, up; alpha, limit, offset) = g sigmoid(alpha g) (u + offset),
        g = min(gate, limit), u = clamp(up, -limit, limit)   (limit None: no clamp)

whose defaults (1, None, 0) are silu(gate) * up; act "silu_cap" (Step 3.7's) caps the
activation instead of the gate, min(g sigmoid(alpha g), limit) (u + offset) with g = gate;
and GeGLU (act "gelu_tanh", Gemma's), the gate through GELU's tanh form instead of silu
(with the same clamps and offset):

    geglu(gate, up) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (u + offset)

and experts without a gate (w_gate None, act "relu2": PLAIN_ACTS; Nemotron 3's), whose
hidden rows are relu(x W_up[e])^2 in x_perm's dtype (relu is exact, the square rounded once).

Expert e owns rows offsets[e-1] .. offsets[e] of x_perm, expert 0 from row 0 (`offsets` are
int32 cumulative group ends, the `offs` of torch._grouped_mm). Experts may own no rows; the
rows past offsets[E-1] belong to none and come out as exact zeros, with zero gradient,
whatever they hold (they are never read). For each expert

    y = (silu(x W_gate[e]) * (x W_up[e])) W_down[e]

with float32 accumulation; gate, up, their SwiGLU and y are rounded to x_perm's dtype,
where every path below stores them.

Paths: "torch" is a per-expert loop, the definition of correctness; it reads offsets on
the host (offsets.tolist(): a device->host sync). Every other path reads nothing on the
host. On CUDA, "auto" runs torch._grouped_mm for the three projections where its fast path
exists (bf16, sm90+, H and F multiples of 8), else the Triton grouped GEMM; "triton" forces
the Triton grouped GEMM. Both put the fused Triton SwiGLU between the projections, whose
backward recomputes silu from gate and up instead of saving the activation. On CPU, "auto"
runs the three projections through torch._grouped_mm (CPU has it for float32, bfloat16 and
float16, rows 16-byte aligned: H and F are zero-padded up to that when they are not) with
the plain-torch SwiGLU between them. torch._grouped_mm leaves the rows past offsets[E-1] of
its output and of dX uninitialised (garbage like 1e38, on CPU too), so that path zeroes
them itself; it stays inside the custom op fmoe::grouped_gemm_fwd, whose fake and autograd
torch.compile traces (torch._grouped_mm's own meta function refuses float32).

Float32 operands multiply in IEEE float32 (tl.dot input_precision="ieee"), not TF32: the
kernels then agree with the reference to float32 rounding, on the GPU and in the
interpreter alike. For bf16/fp16 operands the precision setting has no effect.

Legend: R rows of x_perm, H hidden size, F expert FFN size, E experts; in the generic
grouped GEMM Y[R,N] = X[R,K] @ W[e][K,N], M rows of a tile.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fmoe.ops.backend import DOT_UPCAST, autocast_off, interpreting, next_pow2, transform_of, use_triton
from fmoe.ops.checks import FLOAT_DTYPES, check_device, check_float, checking, holds_values
from fmoe.ops.fp8 import check_fp8, check_fp8_fast_accum, fp8_matmul, fp8_quantize

# ----------------------------------------------------------------------------------------
# 1. Reference (the definition of correctness)
# ----------------------------------------------------------------------------------------


def swiglu_ref(gate, up, alpha: float = 1.0, limit=None, offset: float = 0.0, act: str = "silu"):
    """silu(gate) * up in float32, stored in gate's dtype; with alpha / limit / offset the
    clamped form g sigmoid(alpha g) (u + offset) of the module docstring; act "gelu_tanh":
    GELU's tanh form of g in place of g sigmoid(alpha g) (GeGLU); act "silu_cap": the limit
    caps g sigmoid(alpha g) rather than g."""
    g, u = gate.float(), up.float()
    if limit is not None:
        u = u.clamp(-limit, limit)
        if act != "silu_cap":
            g = g.clamp(max=limit)
    if act == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    else:
        a = torch.nn.functional.silu(g) if alpha == 1.0 else g * torch.sigmoid(alpha * g)
    if act == "silu_cap" and limit is not None:
        a = a.clamp(max=limit)
    return (a * (u + offset if offset else u)).to(gate.dtype)


EXPERT_BIASES = ("b_gate", "b_up", "b_down")  # grouped_mlp's optional per-expert biases: [E, F], [E, F], [E, H]
# the gate's activation: SwiGLU's, GeGLU's (GELU's tanh form), SwiGLU's with the limit capping silu(gate) rather than gate (Step 3.7's)
GLU_ACTS = ("silu", "gelu_tanh", "silu_cap")
# the activations of an MLP without a gate (w_gate None): the squared ReLU, xIELU, GELU's tanh form (transformers' gelu_new), GELU,
# the ReLU (OPT's)
PLAIN_ACTS = ("relu2", "xielu", "gelu_new", "gelu", "relu")
XIELU = (0.5, -1e-6)  # xIELU's constants (beta, eps), as transformers builds Apertus's


def plain_act(up: torch.Tensor, act: str = "relu2", params: Optional[tuple] = None) -> torch.Tensor:
    """An MLP without a gate's activation of x W_up (PLAIN_ACTS) in up's dtype: relu(up)^2, or
    xielu(up, *params) (its (alpha_p, alpha_n, beta, eps)), or GELU's tanh form 0.5 up (1 +
    tanh(sqrt(2 / pi) (up + 0.044715 up^3))) (gelu_new: GPT-2's, Phi-2's), or GELU's exact form
    up Phi(up) (gelu: GPT-NeoX's), or relu(up) (relu: OPT's)."""
    if act not in PLAIN_ACTS:
        raise ValueError(f"act: expected one of {', '.join(PLAIN_ACTS)} (an MLP without a gate), got {act!r}")
    if act == "xielu":
        if params is None or len(params) != 4:
            raise ValueError(f"params: xIELU takes (alpha_p, alpha_n, beta, eps), got {params!r}")
        return xielu(up, *params)
    if act in ("gelu_new", "gelu"):
        return F.gelu(up, approximate="tanh" if act == "gelu_new" else "none")
    if act == "relu":
        return torch.relu(up)
    return torch.relu(up).square()


def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float = 0.5, eps: float = -1e-6) -> torch.Tensor:
    """xIELU (Apertus's MLP activation): a_p x^2 + beta x for x > 0, else a_n (expm1(min(x, eps))
    - x) + beta x, with a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n); alpha_p and
    alpha_n are learned [1] tensors, beta and eps constants. In x's dtype, as transformers'."""
    a_p = F.softplus(alpha_p).to(x.dtype)
    a_n = (beta + F.softplus(alpha_n)).to(x.dtype)
    return torch.where(x > 0, a_p * x * x + beta * x, (torch.expm1(torch.clamp(x, max=eps)) - x) * a_n + beta * x)


def _hidden(gate_RF: Optional[torch.Tensor], up_RF: torch.Tensor, glu, fused: bool = False) -> torch.Tensor:
    """The experts' hidden rows: the SwiGLU of gate and up (fused: the Triton kernel), or
    without a gate (gate None) plain_act(up)."""
    if gate_RF is None:
        return plain_act(up_RF, glu[3])
    return _swiglu_fwd(gate_RF, up_RF, *glu) if fused else swiglu_ref(gate_RF, up_RF, *glu)


_PLAIN_GLU = (1.0, None, 0.0, "silu")  # (alpha, limit, offset, act) of silu(gate) * up
_NO_BIASES = (None,) * len(EXPERT_BIASES)


def _row_experts(offsets_E: torch.Tensor, R: int, biases) -> Optional[torch.Tensor]:
    """[R] the expert owning each row (E past offsets[-1]: the number of ends <= r), computed
    once per call and only when some bias is given; no host read."""
    if all(b is None for b in biases):
        return None
    return torch.searchsorted(offsets_E, torch.arange(R, device=offsets_E.device, dtype=offsets_E.dtype), right=True)


def _plus(y_RX: torch.Tensor, b_EX, expert_R) -> torch.Tensor:
    """y plus the bias of each row's expert (zeros for rows of no expert)."""
    if b_EX is None:
        return y_RX
    return y_RX + torch.cat([b_EX, b_EX.new_zeros(1, b_EX.shape[1])]).index_select(0, expert_R)


@autocast_off
def _matmul_ref(a_MK, b_KN):
    """a @ b accumulated in float32, rounded to a's dtype as the grouped GEMMs store it."""
    return (a_MK.float() @ b_KN.float()).to(a_MK.dtype)


def _expert_spans(offsets_E: torch.Tensor, rows: int):
    """(e, start, end) of each expert's rows, offsets read on the host; under torch.compile the
    ends are unbacked sizes, and the hints tell the compiler what permute guarantees (0 <=
    start <= end <= rows), which inductor needs to slice by them (eager, check=False runs
    unchecked offsets as before)."""
    compiling = torch.compiler.is_compiling()
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if compiling:
            torch._check(end >= start)
            torch._check(end <= rows)
        yield e, start, end
        start = end


def _vmapped(t: torch.Tensor) -> bool:
    """Whether t is batched by torch.func.vmap (under any other torch.func wrappers): offsets
    that differ per example (vmap over a routing), which the loops cannot read on the host."""
    functorch = torch._C._functorch
    if torch.compiler.is_compiling() or functorch.peek_interpreter_stack() is None:  # no torch.func transform running
        return False
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _masked(x_RX: torch.Tensor, offsets_E: torch.Tensor, expert_fn, y_RY: torch.Tensor) -> torch.Tensor:
    """The loops' values with offsets batched by vmap: every expert's expert_fn(x, e) over all
    the rows, each row keeping its own expert's; y_RY (zeros) past offsets[-1]. E times the
    loop's FLOPs, no host read."""
    # each row's expert: the number of ends <= r (E past offsets[-1])
    expert_R = (torch.arange(x_RX.shape[0], device=x_RX.device, dtype=offsets_E.dtype)[:, None] >= offsets_E).sum(-1)
    for e in range(offsets_E.shape[0]):
        y_RY = torch.where((expert_R == e)[:, None], expert_fn(x_RX, e), y_RY)
    return y_RY


def grouped_matmul_ref(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Plain-torch loop over the experts: y[r] = x[r] @ w[e] for expert e's rows, float32
    accumulation rounded to x's dtype, zeros past offsets[-1]. Reads offsets on the host
    (under torch.func.vmap with per-example offsets: _masked, no host read)."""
    y_RN = x_RK.new_zeros(x_RK.shape[0], w_EKN.shape[2])
    if _vmapped(offsets_E):
        return _masked(x_RK, offsets_E, lambda x, e: _matmul_ref(x, w_EKN[e]), y_RN)
    for e, start, end in _expert_spans(offsets_E, x_RK.shape[0]):
        y_RN[start:end] = _matmul_ref(x_RK[start:end], w_EKN[e])
    return y_RN


def grouped_mlp_ref(x_RH, w_gate_EHF, w_up_EHF, w_down_EFH, offsets_E, biases=_NO_BIASES, glu=_PLAIN_GLU, fp8=False):
    """Plain-torch loop over the experts; differentiable through torch autograd. biases:
    (b_gate, b_up, b_down), each [E, F] / [E, F] / [E, H] or None; glu: swiglu_ref's
    (alpha, limit, offset, act); w_gate None: no gate (plain_act of glu's act); fp8: each
    projection by fmoe.ops.fp8_matmul's emulation.

    Reads offsets on the host (offsets.tolist(): one device->host sync); impl="torch" only.
    Under torch.func.vmap with per-example offsets (vmap over a routing): _masked, no host read.
    """
    y_RH = torch.zeros_like(x_RH)  # rows no expert owns stay zero

    def project(a, w_EXY, b_EY, e):
        y = fp8_matmul(a, w_EXY[e], impl="torch") if fp8 else _matmul_ref(a, w_EXY[e])
        return y if b_EY is None else y + b_EY[e]

    b_gate, b_up, b_down = biases
    if _vmapped(offsets_E):
        def expert(x_MH, e):
            h_MF = _hidden(None if w_gate_EHF is None else project(x_MH, w_gate_EHF, b_gate, e), project(x_MH, w_up_EHF, b_up, e), glu)
            return project(h_MF, w_down_EFH, b_down, e)
        return _masked(x_RH, offsets_E, expert, y_RH)
    for e, start, end in _expert_spans(offsets_E, x_RH.shape[0]):
        x_MH = x_RH[start:end]
        h_MF = _hidden(None if w_gate_EHF is None else project(x_MH, w_gate_EHF, b_gate, e), project(x_MH, w_up_EHF, b_up, e), glu)
        y_RH[start:end] = project(h_MF, w_down_EFH, b_down, e)
    return y_RH


# ----------------------------------------------------------------------------------------
# 2. Triton kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b in float32; float32 operands in IEEE float32, not TF32."""
    if DOT_UPCAST:  # the interpreter's 16-bit products (fmoe.ops.backend)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _glu_act(g, alpha, GELU: tl.constexpr):
    """(act(g), act'(g)) in float32: g sigmoid(alpha g), or with GELU its tanh form
    0.5 g (1 + tanh(c (g + 0.044715 g^3)))."""
    if GELU:  # 1 + tanh(y) and 1 - tanh(y) each from e = exp(-2|y|) without cancellation, y = sqrt(2 / pi) (g + 0.044715 g^3)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(y))
        plus = 2.0 * tl.where(y < 0, e, 1.0) / (1.0 + e)
        minus = 2.0 * tl.where(y < 0, 1.0, e) / (1.0 + e)
        act = 0.5 * g * plus
        dact = 0.5 * plus + 0.5 * g * minus * plus * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        sig = tl.sigmoid(alpha * g)
        act = g * sig
        dact = sig * (1.0 + alpha * g * (1.0 - sig))
    return act, dact


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, h_ptr, n, alpha, limit, offset, CLAMP: tl.constexpr, GELU: tl.constexpr, CAP: tl.constexpr,
                       BLOCK: tl.constexpr):
    """h = g sigmoid(alpha g) (u + offset) over n elements, float32 math: silu(gate) * up
    with alpha 1 and offset 0; with CLAMP g = min(gate, limit), u = clamp(up, -limit, limit)
    (with CAP the activation min(g sigmoid(alpha g), limit) instead of g);
    with GELU, GELU's tanh form of g in place of g sigmoid(alpha g)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        if not CAP:
            g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act, _ = _glu_act(g, alpha, GELU)
    if CLAMP and CAP:
        act = tl.minimum(act, limit)
    h = act * (u + offset)
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gate_ptr, up_ptr, grad_h_ptr, grad_gate_ptr, grad_up_ptr, n, alpha, limit, offset,
                       CLAMP: tl.constexpr, GELU: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """d gate = dh (u + offset) act'(g), d up = dh act(g), act(g) = g sigmoid(alpha g) (with
    GELU its tanh form) recomputed from gate; with CLAMP zero where the clamps cut (gate >
    limit, or with CAP act(g) > limit; |up| > limit: torch.clamp's gradient, which passes
    at the bounds)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(grad_h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        dg_pass = g <= limit
        du_pass = (u >= -limit) & (u <= limit)
        if not CAP:
            g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act, dact = _glu_act(g, alpha, GELU)
    if CLAMP and CAP:
        dg_pass = act <= limit
        act = tl.minimum(act, limit)
    grad_gate = dh * (u + offset) * dact
    grad_up = dh * act
    if CLAMP:
        grad_gate = tl.where(dg_pass, grad_gate, 0.0)
        grad_up = tl.where(du_pass, grad_up, 0.0)
    tl.store(grad_gate_ptr + offs, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offs, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_gemm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, offsets_ptr, R, K, N, E,
    TRANS_W: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Y[r, :] = X[r, :] @ B_e for the rows r of each expert e; zeros past offsets[E-1].

    B_e is W[e] of W [E, K, N], or with TRANS_W W[e]^T of W [E, N, K] (dX = dY W^T).
    A program computes one [BLOCK_M, BLOCK_N] tile of Y. Programs run N-tile fastest, so
    the N-tiles of a row tile run together and read its X rows from L2. Row tiles are
    numbered expert by expert (expert e has cdiv(rows of e, BLOCK_M) of them), then come
    the tiles of the unowned rows past offsets[E-1], which store zeros, then idle ones:
    the launch's cdiv(R, BLOCK_M) + E row tiles cover every split of R rows into E groups.
    The map from tile to expert is computed here from offsets: no device->host sync.
    """
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    tile = pid // n_tiles_n
    cols_N = (pid % n_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)

    e_E = tl.arange(0, BLOCK_E)
    end_E = tl.load(offsets_ptr + e_E, mask=e_E < E, other=0)
    start_E = tl.load(offsets_ptr + e_E - 1, mask=(e_E > 0) & (e_E < E), other=0)
    tiles_E = tl.cdiv(end_E - start_E, BLOCK_M)
    tiles_end_E = tl.cumsum(tiles_E, axis=0)
    expert = tl.sum((tiles_end_E <= tile).to(tl.int32), axis=0)  # >= E: past the experts' tiles
    owned = expert < E
    this_E = e_E == expert
    row_lo = tl.sum(tl.where(this_E, start_E + (tile - tiles_end_E + tiles_E) * BLOCK_M, 0), axis=0)
    row_hi = tl.sum(tl.where(this_E, end_E, 0), axis=0)
    unowned_lo = tl.load(offsets_ptr + E - 1) + (tile - tl.sum(tiles_E, axis=0)) * BLOCK_M
    row_lo = tl.where(owned, row_lo, unowned_lo)
    row_hi = tl.where(owned, row_hi, R)
    rows_M = row_lo + tl.arange(0, BLOCK_M)
    # bounds against R too: offsets that break the contract must not write outside Y
    row_ok_M = (rows_M < row_hi) & (rows_M >= 0) & (rows_M < R)

    acc_MN = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows_M = x_ptr + rows_M.to(tl.int64) * K
    w_e = w_ptr + tl.minimum(expert, E - 1).to(tl.int64) * K * N
    k_end = tl.where(owned, K, 0)  # unowned and idle tiles: no K loop, zeros stored
    for k0 in range(0, k_end, BLOCK_K):
        ks_K = k0 + tl.arange(0, BLOCK_K)
        k_ok_K = ks_K < K
        x_MK = tl.load(x_rows_M[:, None] + ks_K[None, :], mask=row_ok_M[:, None] & k_ok_K[None, :], other=0.0)
        w_mask = k_ok_K[:, None] & (cols_N[None, :] < N)
        if TRANS_W:
            w_KN = tl.load(w_e + cols_N[None, :] * K + ks_K[:, None], mask=w_mask, other=0.0)
        else:
            w_KN = tl.load(w_e + ks_K[:, None] * N + cols_N[None, :], mask=w_mask, other=0.0)
        acc_MN = _dot(x_MK, w_KN, acc_MN)
    y_ptrs = y_ptr + rows_M.to(tl.int64)[:, None] * N + cols_N[None, :]
    tl.store(y_ptrs, acc_MN.to(y_ptr.dtype.element_ty), mask=row_ok_M[:, None] & (cols_N[None, :] < N))


@triton.jit
def _grouped_gemm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr, R, K, N,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dW[e] = X_e^T dY_e [K, N] over the rows of expert e; zeros for an expert with none.

    A program computes one [BLOCK_K, BLOCK_N] tile of one expert's dW, looping over that
    expert's rows BLOCK_M at a time; programs run expert-major, so the tiles of one expert
    run together and share its rows of X and dY in L2.
    """
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_expert = tl.cdiv(K, BLOCK_K) * n_tiles_n
    pid = tl.program_id(0)
    expert = pid // tiles_per_expert
    tile = pid % tiles_per_expert
    ks_K = (tile // n_tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols_N = (tile % n_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok_K = ks_K < K
    n_ok_N = cols_N < N
    row_start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    row_end = tl.load(offsets_ptr + expert)

    acc_KN = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows_M = r0 + tl.arange(0, BLOCK_M)
        row_ok_M = (rows_M < row_end) & (rows_M >= 0) & (rows_M < R)
        rows64_M = rows_M.to(tl.int64)
        xt_KM = tl.load(x_ptr + rows64_M[None, :] * K + ks_K[:, None], mask=k_ok_K[:, None] & row_ok_M[None, :], other=0.0)
        dy_MN = tl.load(dy_ptr + rows64_M[:, None] * N + cols_N[None, :], mask=row_ok_M[:, None] & n_ok_N[None, :], other=0.0)
        acc_KN = _dot(xt_KM, dy_MN, acc_KN)
    dw_ptrs = dw_ptr + expert.to(tl.int64) * K * N + ks_K[:, None] * N + cols_N[None, :]
    tl.store(dw_ptrs, acc_KN.to(dw_ptr.dtype.element_ty), mask=k_ok_K[:, None] & n_ok_N[None, :])


@triton.jit
def _zero_unowned_kernel(
    out_ptr, offsets_ptr, n_rows, n_cols, E,
    PER_EXPERT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_C: tl.constexpr,
):
    """Zero the rows of out [n_rows, n_cols] that torch._grouped_mm leaves uninitialised.

    PER_EXPERT=False: out is a grouped GEMM's output [R, N]; zero the rows past
    offsets[E-1]. PER_EXPERT=True: out is a weight gradient viewed as [E, K*N]; zero the
    experts that own no rows. A program covers BLOCK_R rows by CHUNK_C columns; one whose
    rows are all owned stores nothing (its column loop runs zero times), so the cost is
    a launch, not a pass over out.
    """
    rows_B = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range_B = rows_B < n_rows
    if PER_EXPERT:
        end_B = tl.load(offsets_ptr + rows_B, mask=in_range_B, other=0)
        start_B = tl.load(offsets_ptr + rows_B - 1, mask=in_range_B & (rows_B > 0), other=0)
        unowned_B = in_range_B & (end_B <= start_B)
    else:
        unowned_B = in_range_B & (rows_B >= tl.load(offsets_ptr + E - 1))
    c_start = tl.program_id(1) * CHUNK_C
    c_end = tl.where(tl.max(unowned_B.to(tl.int32), axis=0) > 0, tl.minimum(c_start + CHUNK_C, n_cols), 0)
    zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=out_ptr.dtype.element_ty)
    row_ptrs_B = out_ptr + rows_B.to(tl.int64) * n_cols
    for c0 in range(c_start, c_end, BLOCK_C):
        cols_C = c0 + tl.arange(0, BLOCK_C)
        tl.store(row_ptrs_B[:, None] + cols_C[None, :], zeros, mask=unowned_B[:, None] & (cols_C[None, :] < c_end))


_SWIGLU_META = dict(BLOCK=1024, num_warps=4)
_ZERO_META = dict(BLOCK_R=16, BLOCK_C=256, CHUNK_C=4096, num_warps=4)


def _gemm_blocks(dtype: torch.dtype) -> dict:
    """Tiles of the forward / dX kernel. Under the interpreter the smallest tiles tl.dot
    takes, so that the small test shapes span several row, column and K tiles."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4)
    if dtype == torch.float32:  # IEEE float32 runs on FMA units: smaller tiles, no tensor cores
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8)


def _dw_blocks(dtype: torch.dtype) -> dict:
    """Tiles of the dW kernel: BLOCK_K x BLOCK_N outputs, BLOCK_M rows reduced per step."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, num_warps=4)
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128, num_warps=8)


# ----------------------------------------------------------------------------------------
# 3. torch.library registration: opaque to torch.compile, with fake and autograd
# ----------------------------------------------------------------------------------------


def _glu_args(alpha: float, limit: Optional[float], offset: float, act: str = "silu") -> dict:
    """The SwiGLU kernels' (alpha, limit, offset) scalars and CLAMP, GELU and CAP flags."""
    return dict(alpha=alpha, limit=0.0 if limit is None else limit, offset=offset, CLAMP=limit is not None, GELU=act == "gelu_tanh",
                CAP=act == "silu_cap")


@torch.library.custom_op("fmoe::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: Optional[float] = None, offset: float = 0.0,
                act: str = "silu") -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, _SWIGLU_META["BLOCK"]),)](gate, up, h, n, **_glu_args(alpha, limit, offset, act), **_SWIGLU_META)
    return h


@_swiglu_fwd.register_fake
def _(gate, up, alpha=1.0, limit=None, offset=0.0, act="silu"):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)  # as the op's, of gate.contiguous(): row-major whatever gate's strides


@torch.library.custom_op("fmoe::swiglu_bwd", mutates_args=())
def _swiglu_bwd(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: Optional[float] = None,
                offset: float = 0.0, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, grad_h = gate.contiguous(), up.contiguous(), grad_h.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, _SWIGLU_META["BLOCK"]),)](gate, up, grad_h, grad_gate, grad_up, n,
                                                                      **_glu_args(alpha, limit, offset, act), **_SWIGLU_META)
    return grad_gate, grad_up


@_swiglu_bwd.register_fake
def _(grad_h, gate, up, alpha=1.0, limit=None, offset=0.0, act="silu"):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(up, memory_format=torch.contiguous_format)


def _swiglu_setup_context(ctx, inputs, output):
    gate, up, *glu = inputs
    ctx.save_for_backward(gate, up)  # gate and up only: the backward recomputes the activation
    ctx.glu = glu


def _swiglu_backward(ctx, grad_h):
    gate, up = ctx.saved_tensors
    return (*_swiglu_bwd(grad_h, gate, up, *ctx.glu), None, None, None, None)


_swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


def _zero_unowned(out_2d: torch.Tensor, offsets_E: torch.Tensor, per_expert: bool) -> None:
    """Zero, in place, what torch._grouped_mm leaves unwritten (see _zero_unowned_kernel):
    the rows past offsets[E-1], or with per_expert the experts whose group is empty. The
    kernel on CUDA; masked_fill on CPU, interpreter or not (the interpreted kernel would
    make the CPU path 30x slower). Neither reads a value on the host."""
    if out_2d.is_cuda:
        _zero_unowned_triton(out_2d, offsets_E, per_expert)
        return
    if per_expert:
        starts_E = torch.cat([offsets_E.new_zeros(1), offsets_E[:-1]])
        unowned = offsets_E <= starts_E
    else:
        unowned = torch.arange(out_2d.shape[0], device=out_2d.device) >= offsets_E[-1]
    out_2d.masked_fill_(unowned[:, None], 0)


def _zero_unowned_triton(out_2d: torch.Tensor, offsets_E: torch.Tensor, per_expert: bool) -> None:
    n_rows, n_cols = out_2d.shape
    grid = (triton.cdiv(n_rows, _ZERO_META["BLOCK_R"]), triton.cdiv(n_cols, _ZERO_META["CHUNK_C"]))
    _zero_unowned_kernel[grid](
        out_2d, offsets_E, n_rows, n_cols, offsets_E.shape[0], PER_EXPERT=per_expert, **_ZERO_META,
    )


FP8_OFF, FP8_ON, FP8_FAST = 0, 1, 2  # the grouped GEMMs' fp8 mode: off, on, on with use_fast_accum


def _gemm(a_RK: torch.Tensor, w: torch.Tensor, offsets_E: torch.Tensor, trans_w: bool, torch_gmm: bool, fp8: int = 0) -> torch.Tensor:
    """out[R, N] = a @ W[e] (or a @ W[e]^T) per expert, zeros past offsets[E-1]; fp8 (FP8_OFF,
    FP8_ON, FP8_FAST): of the operands quantized over the contracted dim (_fp8_gemm)."""
    if fp8:
        return _fp8_gemm(a_RK, w, offsets_E, trans_w, torch_gmm, fp8 == FP8_FAST)
    if torch_gmm:
        out_RN = torch._grouped_mm(a_RK, w.transpose(-2, -1) if trans_w else w, offs=offsets_E)
        _zero_unowned(out_RN, offsets_E, per_expert=False)
        return out_RN
    R, K = a_RK.shape
    E = w.shape[0]
    N = w.shape[1] if trans_w else w.shape[2]
    out_RN = torch.empty(R, N, dtype=a_RK.dtype, device=a_RK.device)
    meta = _gemm_blocks(a_RK.dtype)
    grid = (triton.cdiv(N, meta["BLOCK_N"]) * (triton.cdiv(R, meta["BLOCK_M"]) + E),)
    _grouped_gemm_fwd_kernel[grid](a_RK, w, out_RN, offsets_E, R, K, N, E, TRANS_W=trans_w, BLOCK_E=next_pow2(E), **meta)
    return out_RN


def _fp8_gemm(a_RK: torch.Tensor, w: torch.Tensor, offsets_E: torch.Tensor, trans_w: bool, torch_gmm: bool, fast_accum: bool = False) -> torch.Tensor:
    """_gemm of q(a) and q(W[e]) (fmoe.ops.fp8: a per row, each expert's matrix per output
    column, both over the contracted dim): torch._scaled_grouped_mm on CUDA with torch_gmm
    (fast_accum: its use_fast_accum), else the dequantized (exact) float32 operands through
    the float32 grouped GEMM, rounded to a's dtype."""
    w_EOC = w if trans_w else w.transpose(-2, -1)  # [E, out, contracted]
    a_fp8, scale_a = fp8_quantize(a_RK, 1)
    w_fp8, scale_w = fp8_quantize(w_EOC, 2)  # [E, out, contracted] row-major: the Triton kernel reads w's strides
    if torch_gmm and a_RK.is_cuda:
        out_RN = torch._scaled_grouped_mm(a_fp8, w_fp8.transpose(-2, -1), scale_a.reshape(-1), scale_w.squeeze(-1),
                                          offs=offsets_E, out_dtype=a_RK.dtype, use_fast_accum=fast_accum)
        _zero_unowned(out_RN, offsets_E, per_expert=False)
        return out_RN
    out_RN = _gemm(a_fp8.float() * scale_a, w_fp8.float() * scale_w, offsets_E, True, torch_gmm and not a_RK.is_cuda)
    return out_RN.to(a_RK.dtype)


def _gemm_dw(x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_E: torch.Tensor, torch_gmm: bool) -> torch.Tensor:
    """dW[E, K, N]: dW[e] = x_e^T dy_e over the rows of expert e, zeros for one with none."""
    (R, K), N, E = x_RK.shape, dy_RN.shape[1], offsets_E.shape[0]
    if torch_gmm:
        dw_EKN = torch._grouped_mm(x_RK.t(), dy_RN, offs=offsets_E)
        # zero on Hopper, but left unwritten on some GPUs (pytorch/pytorch#172439)
        _zero_unowned(dw_EKN.view(E, K * N), offsets_E, per_expert=True)
        return dw_EKN
    dw_EKN = torch.empty(E, K, N, dtype=x_RK.dtype, device=x_RK.device)
    meta = _dw_blocks(x_RK.dtype)
    grid = (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    _grouped_gemm_dw_kernel[grid](x_RK, dy_RN, dw_EKN, offsets_E, R, K, N, **meta)
    return dw_EKN


@torch.library.custom_op("fmoe::grouped_gemm_fwd", mutates_args=())
def _grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, torch_gmm: bool, fp8: int = 0) -> torch.Tensor:
    """y[R, N] = x[R, K] @ w[e][K, N] for the rows of each expert e; zeros past offsets[-1].

    torch_gmm: torch._grouped_mm (CUDA bf16 sm90+, or CPU) instead of the Triton kernel
    (with fp8: torch._scaled_grouped_mm on CUDA). fp8 (FP8_OFF, FP8_ON, FP8_FAST): x and w
    quantized over K (_fp8_gemm).
    """
    x, w, offsets = x.contiguous(), w.contiguous(), offsets.contiguous()  # the kernels read offsets densely
    if x.numel() == 0 or w.numel() == 0:  # nothing to multiply: zeros (torch._grouped_mm rejects empty operands)
        return x.new_zeros(x.shape[0], w.shape[2])
    return _gemm(x, w, offsets, False, torch_gmm, fp8)


@_grouped_gemm_fwd.register_fake
def _(x, w, offsets, torch_gmm, fp8=0):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("fmoe::grouped_gemm_bwd", mutates_args=())
def _grouped_gemm_bwd(
    grad_y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, torch_gmm: bool, fp8: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx[R, K] = dy @ w[e]^T, zeros past offsets[-1], with fp8 of dy and w quantized over
    N; dw[E, K, N] = x_e^T dy_e, in x's dtype either way)."""
    grad_y, x, w, offsets = grad_y.contiguous(), x.contiguous(), w.contiguous(), offsets.contiguous()
    if x.numel() == 0 or w.numel() == 0:
        return torch.zeros_like(x), torch.zeros_like(w)
    return _gemm(grad_y, w, offsets, True, torch_gmm, fp8), _gemm_dw(x, grad_y, offsets, torch_gmm)


@_grouped_gemm_bwd.register_fake
def _(grad_y, x, w, offsets, torch_gmm, fp8=0):  # row-major, as the op's of x.contiguous() and w.contiguous() (a transposed w's too)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w, memory_format=torch.contiguous_format)


def _grouped_gemm_setup_context(ctx, inputs, output):
    x, w, offsets, torch_gmm, fp8 = inputs
    ctx.save_for_backward(x, w, offsets)
    ctx.torch_gmm, ctx.fp8 = torch_gmm, fp8


def _grouped_gemm_backward(ctx, grad_y):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = _grouped_gemm_bwd(grad_y, x, w, offsets, ctx.torch_gmm, ctx.fp8)
    return grad_x, grad_w, None, None, None


_grouped_gemm_fwd.register_autograd(_grouped_gemm_backward, setup_context=_grouped_gemm_setup_context)


def _grouped_mlp_kernels(x_RH, w_gate_EHF, w_up_EHF, w_down_EFH, offsets_E, torch_gmm: bool, biases=_NO_BIASES, glu=_PLAIN_GLU, fp8=FP8_OFF):
    """The CUDA (or interpreted) path: three grouped GEMMs around the fused SwiGLU (either
    form), or two around plain_act without a gate; biases added to each expert's rows."""
    b_gate, b_up, b_down = biases
    expert_R = _row_experts(offsets_E, x_RH.shape[0], biases)
    gate_RF = None if w_gate_EHF is None else _plus(_grouped_gemm_fwd(x_RH, w_gate_EHF, offsets_E, torch_gmm, fp8), b_gate, expert_R)
    up_RF = _plus(_grouped_gemm_fwd(x_RH, w_up_EHF, offsets_E, torch_gmm, fp8), b_up, expert_R)
    h_RF = _hidden(gate_RF, up_RF, glu, fused=True)
    return _plus(_grouped_gemm_fwd(h_RF, w_down_EFH, offsets_E, torch_gmm, fp8), b_down, expert_R)


def _grouped_mlp_cpu(x_RH, w_gate_EHF, w_up_EHF, w_down_EFH, offsets_E, biases=_NO_BIASES, glu=_PLAIN_GLU, fp8=FP8_OFF):
    """The CPU path of "auto": torch._grouped_mm's three projections (inside the custom op)
    around the plain-torch SwiGLU; no host read, and torch.compile traces it whole.

    torch._grouped_mm wants 16-byte aligned rows; H and F are padded with zero columns up to
    that where they are not. The zeros add nothing to any sum, the padded columns of h meet
    zero rows of w_down, and the padding's slices give the gradients back their shapes.
    """
    H, F = x_RH.shape[1], w_up_EHF.shape[2]
    multiple = 16 // x_RH.element_size()
    pad_H, pad_F = -H % multiple, -F % multiple
    b_gate, b_up, b_down = biases
    expert_R = _row_experts(offsets_E, x_RH.shape[0], biases)
    if pad_H or pad_F:
        pad = torch.nn.functional.pad
        x_RH = pad(x_RH, (0, pad_H))
        w_gate_EHF, w_up_EHF = (None if w is None else pad(w, (0, pad_F, 0, pad_H)) for w in (w_gate_EHF, w_up_EHF))
        w_down_EFH = pad(w_down_EFH, (0, pad_H, 0, pad_F))
        b_gate, b_up = (None if b is None else pad(b, (0, pad_F)) for b in (b_gate, b_up))
    gate_RF = None if w_gate_EHF is None else _plus(_grouped_gemm_fwd(x_RH, w_gate_EHF, offsets_E, True, fp8), b_gate, expert_R)
    up_RF = _plus(_grouped_gemm_fwd(x_RH, w_up_EHF, offsets_E, True, fp8), b_up, expert_R)
    y_RH = _grouped_gemm_fwd(_hidden(gate_RF, up_RF, glu), w_down_EFH, offsets_E, True, fp8)
    return _plus(y_RH[:, :H] if pad_H else y_RH, b_down, expert_R)


def _grouped_mm_fast(x_RH: torch.Tensor, F: int) -> bool:
    """Whether torch._grouped_mm has its fast kernel here: bf16 on sm90+ with 16-byte
    aligned rows (H and F multiples of 8)."""
    return (
        x_RH.is_cuda and x_RH.dtype == torch.bfloat16 and x_RH.shape[1] % 8 == 0 and F % 8 == 0
        and torch.cuda.get_device_properties(x_RH.device).major >= 9
    )


# ----------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} differs from {ref_name}'s {str(ref.dtype).removeprefix('torch.')}")
    check_device(name, t, ref.device, ref_name)


def _check_offsets(offsets: torch.Tensor, E: int, R: int, x_perm: torch.Tensor, check: bool) -> None:
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.shape != (E,):
        got = f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise ValueError(f"offsets: expected int32 [E] = ({E},) cumulative ends of the experts' rows, got {got}")
    check_device("offsets", offsets, x_perm.device, "x_perm")
    if R > torch.iinfo(torch.int32).max:  # the kernels' row ids, as offsets, are int32
        raise ValueError(f"x_perm: {R} rows, past the int32 row ids of offsets (2**31 - 1)")
    if not checking(check, offsets):
        return
    ends = offsets.tolist()  # one device->host sync
    for e, (lo, hi) in enumerate(zip([0] + ends, ends)):
        if hi < lo:
            raise ValueError(f"offsets: must be non-decreasing from 0, but offsets[{e}] = {hi} < {lo}")
    if ends[-1] > R:
        raise ValueError(f"offsets: the last expert's rows end at {ends[-1]}, past x_perm's {R} rows")


def grouped_mlp(
    x_perm: torch.Tensor,
    w_gate: Optional[torch.Tensor],
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets: torch.Tensor,
    *,
    check: bool = True,
    impl: str = "auto",
    b_gate: Optional[torch.Tensor] = None,
    b_up: Optional[torch.Tensor] = None,
    b_down: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    limit: Optional[float] = None,
    offset: float = 0.0,
    fp8: bool = False,
    fp8_fast_accum: bool = False,
    act: str = "silu",
) -> torch.Tensor:
    """SwiGLU expert MLPs over rows grouped by expert (SPEC.md section 3).

    Args:
        x_perm: [R, H] float32 / bfloat16 / float16, rows grouped by expert (fmoe.ops.permute).
        w_gate, w_up: [E, H, F], x_perm's dtype and device; w_gate None: experts without a
            gate, relu(x W_up[e])^2 W_down[e] (act "relu2", which it needs).
        w_down: [E, F, H].
        offsets: [E] int32, cumulative end of each expert's rows (plan.offsets): expert e
            owns rows offsets[e-1] .. offsets[e]; rows past offsets[-1] belong to no expert.
        check: raise a ValueError unless offsets are non-decreasing from 0 and end within R
            (one device->host sync; skipped under torch.compile).
        impl: "auto" (CUDA: torch._grouped_mm where it is fast, else Triton; CPU:
            torch._grouped_mm with a torch SwiGLU; both without host reads; under
            forward-mode AD or a torch.func transform the per-expert loop, which they
            differentiate), "triton", or "torch" (the per-expert loop, which reads offsets
            on the host).
        b_gate, b_up: optional [E, F] biases of the gate and up projections, b_down [E, H]
            of the down projection (x_perm's dtype and device), added to each expert's rows.
        alpha, limit, offset: the clamped SwiGLU (module docstring; gpt-oss: 1.702, 7.0,
            1.0); the defaults are silu(gate) * up. The fused Triton SwiGLU computes either
            form (the CPU path of "auto" runs it in plain torch).
        act: the gate's activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh
            form, Gemma's; with alpha 1) or "silu_cap" (SwiGLU whose limit caps the
            activation, min(silu(gate), limit), not the gate: Step 3.7's); or with w_gate None "relu2" (PLAIN_ACTS; alpha,
            limit, offset and b_gate at their defaults).
        fp8: each projection's forward and input-gradient GEMMs in fp8, as
            fmoe.ops.fp8_matmul (x_perm's rows and each expert's columns quantized over the
            contracted dim, power-of-two scales; the weight gradients in x_perm's dtype):
            torch._scaled_grouped_mm on CUDA where "auto" would run torch._grouped_mm and H
            and F are multiples of 16 (give permute align=16 so that each expert's rows
            start on a multiple of 16), else the dequantized operands' float32 grouped GEMM
            (the CPU path, the Triton kernel, and "torch"'s loop of fp8_matmul), which gives
            the same values up to the order of the float32 sums.
        fp8_fast_accum: with fp8, torch._scaled_grouped_mm's use_fast_accum: the tensor
            cores' own accumulator over the whole contraction, not promoted to float32 along
            the way. About 3.3x the default's speed for an expert GEMM on an H100
            (benchmarks/RESULTS.md), its error against the float32 emulation larger by an
            amount the `gpu` test prints; the CPU, the Triton kernel and the emulation are
            unchanged by it. Refused without fp8.

    Returns:
        y_perm [R, H] in x_perm's dtype: y = (silu(x W_gate[e]) * (x W_up[e])) W_down[e] (without
        a gate relu(x W_up[e])^2 W_down[e])
        (with the biases and SwiGLU options above) for each expert's rows, exact zeros (and
        zero gradient) for rows of no expert. Differentiable with respect to x_perm, the
        three weights and the biases.

    Example:
        >>> x, w = torch.ones(3, 8), torch.full((2, 8, 4), 0.25)
        >>> grouped_mlp(x, w, w, torch.full((2, 4, 8), 0.25), torch.tensor([1, 2], dtype=torch.int32))[:, 0]
        tensor([3.5232, 3.5232, 0.0000])
    """
    check_float("x_perm", x_perm, 2, "[R, H]")
    R, H = x_perm.shape
    glu = check_glu(alpha, limit, offset, act)
    if act == "xielu":
        raise ValueError("act: experts with xIELU (its learned scalars) are not built; xIELU is a dense MLP's (fmoe.layers.dense_mlp)")
    if (w_gate is None) != (act in PLAIN_ACTS):
        raise ValueError(f"w_gate: act {act!r} " + ("is an MLP without a gate, expected None, got a tensor" if w_gate is not None
                                                     else f"gates the up projection, expected [E, H, F], got None (none: act one of {PLAIN_ACTS})"))
    first, lead = ("w_up", w_up) if w_gate is None else ("w_gate", w_gate)  # the tensor that sets E and F
    check_float(first, lead, 3, "[E, H, F]")
    E, _, F = lead.shape
    if E == 0 or lead.shape[1] != H:
        raise ValueError(f"{first}: expected shape [E, H, F] with E >= 1 and H = {H} (x_perm's last dim), got {tuple(lead.shape)}")
    check_float("w_up", w_up, 3, "[E, H, F]")
    if w_up.shape != (E, H, F):
        raise ValueError(f"w_up: expected shape [E, H, F] = {[E, H, F]} like w_gate, got {list(w_up.shape)}")
    check_float("w_down", w_down, 3, "[E, F, H]")
    if w_down.shape != (E, F, H):
        raise ValueError(f"w_down: expected shape [E, F, H] = {[E, F, H]}, got {list(w_down.shape)}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w is not None:
            _check_like(name, w, "x_perm", x_perm)
    if w_gate is None and b_gate is not None:
        raise ValueError("b_gate: the gate's bias, expected None with w_gate None (experts without a gate)")
    _check_offsets(offsets, E, R, x_perm, check)
    biases = (b_gate, b_up, b_down)
    for name, b, shape in zip(("b_gate", "b_up", "b_down"), biases, ((E, F), (E, F), (E, H))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} ([E, F] for b_gate / b_up, [E, H] for b_down), got {getattr(b, 'shape', type(b).__name__)}")
        _check_like(name, b, "x_perm", x_perm)
    check_fp8(fp8)
    fp8 = FP8_FAST if check_fp8_fast_accum(fp8_fast_accum, fp8) else (FP8_ON if fp8 else FP8_OFF)

    if use_triton(impl, x_perm, w_gate, w_up, w_down, offsets, *biases):
        torch_gmm = impl == "auto" and _grouped_mm_fast(x_perm, F) and (not fp8 or (H % 16 == 0 and F % 16 == 0))
        return _grouped_mlp_kernels(x_perm, w_gate, w_up, w_down, offsets, torch_gmm, biases, glu, fp8)
    # meta: shapes only (the loop below reads offsets); torch._grouped_mm's custom op is not for torch.func (transform_of)
    if impl == "auto" and x_perm.device.type in ("cpu", "meta") and transform_of(x_perm, w_gate, w_up, w_down, *biases) is None:
        return _grouped_mlp_cpu(x_perm, w_gate, w_up, w_down, offsets, biases, glu, fp8)
    if not holds_values(offsets):
        raise ValueError(f"impl: 'torch' loops over the experts by offsets read on the host, which a meta or fake offsets does not "
                         f"hold; impl='auto' gives the shapes")
    return grouped_mlp_ref(x_perm, w_gate, w_up, w_down, offsets, biases, glu, fp8)


def grouped_matmul(x_perm: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, check: bool = True, impl: str = "auto") -> torch.Tensor:
    """One linear map per expert over the rows permute grouped by expert: a routed linear
    layer (JetMoE's mixture of attention heads routes its query and output projections so).

    Args:
        x_perm: [R, K] float rows, expert e's rows offsets[e-1] .. offsets[e] (grouped_mlp's).
        w: [E, K, N] each expert's matrix, x_perm's dtype and device.
        offsets: [E] int32 cumulative ends of the experts' rows (grouped_mlp's).
        check: raise a ValueError unless offsets are non-decreasing and end within x_perm's
            rows (one device->host sync; skipped under torch.compile).
        impl: "auto" | "triton" | "torch" (grouped_mlp's paths: the Triton grouped GEMM or
            torch._grouped_mm on CUDA, torch._grouped_mm on CPU with K and N zero-padded to
            16-byte rows, the per-expert loop; only "torch" reads offsets on the host).
    Returns:
        y_perm [R, N] in x_perm's dtype: x_perm[r] @ w[e] with float32 accumulation for expert
        e's rows, exact zeros (and zero gradient) for rows of no expert. Differentiable with
        respect to x_perm and w.

    Example:
        >>> grouped_matmul(torch.ones(3, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)]), torch.tensor([1, 2], dtype=torch.int32))
        tensor([[1., 1.],
                [2., 2.],
                [0., 0.]])
    """
    check_float("x_perm", x_perm, 2, "[R, K]")
    R, K = x_perm.shape
    check_float("w", w, 3, "[E, K, N]")
    E, _, N = w.shape
    if E == 0 or w.shape[1] != K:
        raise ValueError(f"w: expected shape [E, K, N] with E >= 1 and K = {K} (x_perm's last dim), got {tuple(w.shape)}")
    _check_like("w", w, "x_perm", x_perm)
    _check_offsets(offsets, E, R, x_perm, check)
    if use_triton(impl, x_perm, w, offsets):
        return _grouped_gemm_fwd(x_perm, w, offsets, impl == "auto" and _grouped_mm_fast(x_perm, N), FP8_OFF)
    # torch._grouped_mm wants 16-byte aligned rows: zero columns added, cut after (not under torch.func: transform_of)
    if impl == "auto" and x_perm.device.type in ("cpu", "meta") and transform_of(x_perm, w) is None:
        multiple = 16 // x_perm.element_size()
        pad_K, pad_N = -K % multiple, -N % multiple
        if pad_K or pad_N:
            x_perm, w = F.pad(x_perm, (0, pad_K)), F.pad(w, (0, pad_N, 0, pad_K))
        y_RN = _grouped_gemm_fwd(x_perm, w, offsets, True, FP8_OFF)
        return y_RN[:, :N] if pad_N else y_RN
    return grouped_matmul_ref(x_perm, w, offsets)


def check_glu(alpha, limit, offset, act: str = "silu") -> tuple:
    """(alpha, limit, offset, act): three floats (limit None or > 0) and the gate's activation
    (GLU_ACTS; "gelu_tanh" with alpha 1), or the activation of an MLP without a gate
    (PLAIN_ACTS, the three at their defaults 1, None, 0); ValueError naming the bad one."""
    def number(name, v):
        # abs(v) < inf rather than math.isfinite: under torch.compile a float that changed since an
        # earlier compile comes back symbolic, which math.isfinite would break the graph on
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) < math.inf:
            raise ValueError(f"{name}: expected a finite number, got {v!r}")
        return float(v)

    alpha, offset = number("alpha", alpha), number("offset", offset)
    if limit is not None:
        limit = number("limit", limit)
        if limit <= 0:
            raise ValueError(f"limit: expected > 0 (the SwiGLU clamp) or None, got {limit!r}")
    if act in PLAIN_ACTS and (alpha, limit, offset) != (1.0, None, 0.0):
        raise ValueError(f"alpha / limit / offset: knobs of a gated MLP's activation, not of act {act!r} (no gate), got {alpha!r} / {limit!r} / {offset!r}")
    if act not in GLU_ACTS + PLAIN_ACTS:
        raise ValueError(f"act: expected one of {', '.join(GLU_ACTS)} (the gate's activation) or {', '.join(PLAIN_ACTS)} (no gate), got {act!r}")
    if act == "gelu_tanh" and alpha != 1.0:
        raise ValueError(f"alpha: the slope of SwiGLU's sigmoid, expected 1.0 with act 'gelu_tanh' (GELU has none), got {alpha!r}")
    return alpha, limit, offset, act


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, impl: str = "auto", alpha: float = 1.0, limit: Optional[float] = None,
           offset: float = 0.0, act: str = "silu") -> torch.Tensor:
    """silu(gate) * up, float32 math, in gate's dtype; any shape (gate and up alike).
    alpha, limit, offset: the clamped form g sigmoid(alpha g) (u + offset), g = min(gate,
    limit), u = clamp(up, -limit, limit) (gpt-oss: 1.702, 7.0, 1.0). act "gelu_tanh":
    GeGLU, gelu_tanh(gate) * up (Gemma's; GELU's tanh form in place of g sigmoid(alpha g)).
    act "silu_cap": the limit caps the activation instead of the gate, min(g sigmoid(alpha
    g), limit) (clamp(up, -limit, limit) + offset) with g = gate (Step 3.7's experts).

    The Triton backward recomputes the activation from gate and up: only they are saved.

    Example:
        >>> swiglu(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0]))
        tensor([0.0000, 1.4621])
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a float32, bfloat16 or float16 tensor, got {got}")
    if up.shape != gate.shape:
        raise ValueError(f"up: expected shape {tuple(gate.shape)} like gate, got {tuple(up.shape)}")
    _check_like("up", up, "gate", gate)
    glu = check_glu(alpha, limit, offset, act)
    if act in PLAIN_ACTS:
        raise ValueError(f"act: swiglu gates up by act(gate), expected one of {', '.join(GLU_ACTS)}, got {act!r} (an MLP without a gate: plain_act)")
    if use_triton(impl, gate, up):
        return _swiglu_fwd(gate, up, *glu)
    return swiglu_ref(gate, up, *glu)
