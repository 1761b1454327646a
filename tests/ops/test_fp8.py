"""fp8_quantize, fp8_matmul and grouped_mlp(fp8=True): against a brute force written from the
definition (fmoe/ops/fp8.py), between paths, under torch.compile, and in the model."""

import doctest
import itertools
import math

import pytest
import torch

from fmoe.ops import fp8 as fp8_module
from fmoe.ops.backend import interpreting
from fmoe.ops import fp8_matmul, fp8_quantize, grouped_mlp
from fmoe.train.metrics import HostReads

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()  # every finite e4m3 value, sorted


def _deq(t, dim=-1):
    """fp8_quantize's values as float32: t_fp8 * scale."""
    t_fp8, scale = fp8_quantize(t, dim)
    return t_fp8.float() * scale


def _brute_quantize(t: torch.Tensor, dim: int) -> torch.Tensor:
    """q(t) along dim from the definition, in float64: s = 2^ceil(log2(amax / 448)) (math.log2
    on Python floats), each value rounded to the nearest e4m3 value of t / s (ties to the
    even mantissa: the one whose bits end in 0), times s."""
    values = E4M3_VALUES.double()
    t64 = t.double().movedim(dim, -1)
    out = torch.empty_like(t64)
    for idx in itertools.product(*map(range, t64.shape[:-1])):
        row = t64[idx]
        amax = float(row.abs().max())
        s = 1.0 if amax == 0 else 2.0 ** math.ceil(math.log2(amax / 448.0))
        for j, v in enumerate((row / s).tolist()):
            dist = (values - v).abs()
            best = torch.nonzero(dist == dist.min()).flatten()
            if len(best) > 1:  # a tie: the even one (its e4m3 bit pattern ends in 0)
                bits = values[best].float().to(torch.float8_e4m3fn).view(torch.uint8)
                best = best[(bits % 2 == 0)]
            out[idx + (j,)] = float(values[best[0]]) * s
    return out.movedim(-1, dim)


def test_doctests():
    assert doctest.testmod(fp8_module, raise_on_error=True).attempted >= 2


def test_quantize_matches_the_definition_and_scales_are_powers_of_two():
    torch.manual_seed(0)
    t = torch.randn(5, 7) * torch.tensor([1e-3, 1.0, 30.0, 448.0, 1e4])[:, None]
    for dim in (0, 1, -1):
        t_fp8, scale = fp8_quantize(t, dim)
        assert t_fp8.dtype == torch.float8_e4m3fn and t_fp8.shape == t.shape
        assert scale.dtype == torch.float32 and scale.shape[dim] == 1
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5), "every scale is a power of two"
        # the largest quantized magnitude of each slice lies in [224, 448]: the scale is the smallest that fits
        top = t_fp8.float().abs().amax(dim=dim, keepdim=True)
        assert torch.all((top >= 224) & (top <= 448)), top
        torch.testing.assert_close((t_fp8.float() * scale).double(), _brute_quantize(t, dim), rtol=0, atol=0)
    # exact ties between neighbouring e4m3 values (scale 1: amax 448) round to the even one
    ties = 0.5 * (E4M3_VALUES[1:] + E4M3_VALUES[:-1])
    row = torch.cat([torch.tensor([448.0]), ties[(ties.abs() < 448)][::7]])[None]
    torch.testing.assert_close(_deq(row).double(), _brute_quantize(row, 1), rtol=0, atol=0)


def test_quantize_edges():
    zeros_fp8, scale = fp8_quantize(torch.zeros(2, 3))
    assert torch.all(scale == 1) and torch.all(zeros_fp8.float() == 0)
    # amax exactly 448 * 2^k: scale 2^k; a hair above: 2^(k+1)
    for k in (-3, 0, 5):
        _, s = fp8_quantize(torch.tensor([[448.0 * 2.0**k, 1.0]]))
        assert float(s) == 2.0**k
        above = torch.nextafter(torch.tensor(448.0 * 2.0**k), torch.tensor(math.inf))  # the next float32
        _, s = fp8_quantize(torch.stack([above, torch.tensor(1.0)])[None])
        assert float(s) == 2.0 ** (k + 1)
    # values e4m3 holds come back exactly, in bfloat16 too
    t = torch.tensor([[1.0, -3.0, 0.25, 448.0, -6.0]], dtype=torch.bfloat16)
    t_fp8, s = fp8_quantize(t)
    assert torch.equal(t_fp8.float() * s, t.float())
    # a non-finite input stays non-finite in its row, instead of becoming a finite number
    bad = torch.tensor([[1.0, float("inf")], [1.0, float("nan")], [1.0, 2.0]])
    t_fp8, s = fp8_quantize(bad)
    deq = t_fp8.float() * s
    assert not torch.isfinite(deq[0]).all() and not torch.isfinite(deq[1]).all() and torch.isfinite(deq[2]).all()


def _bits(t_fp8, scale):
    """(the bytes with NaN ones set to 0x7F, the NaN mask, the scale with NaN as -1): what
    two quantizations must share (a NaN's sign bit is free)."""
    nan = torch.isnan(t_fp8.float())
    return t_fp8.view(torch.uint8).masked_fill(nan, 0x7F), nan, scale.nan_to_num(-1.0)


def _special_rows(dtype):
    """Rows that hit every branch of the kernel's bit arithmetic: ties between e4m3 values,
    e4m3 subnormals and their rounding into 2^-6, float32 subnormal inputs, amax exactly at
    and a hair above 448 * 2^k, zeros, infinities and NaN, a huge dynamic range."""
    ties = 0.5 * (E4M3_VALUES[1:] + E4M3_VALUES[:-1])
    rows = [torch.cat([torch.tensor([448.0]), ties[ties.abs() < 448][::3]]),
            torch.tensor([448.0, 2.0**-9 * 7.5, 2.0**-9 * 0.5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-6 * 0.99, -(2.0**-10), 0.0]),
            torch.tensor([448.0 * 8, torch.nextafter(torch.tensor(448.0 * 8), torch.tensor(1e9)).item(), 3.0, -5.0]),
            torch.zeros(4), torch.tensor([1.0, float("inf"), -2.0, 0.5]),
            torch.tensor([1.0, float("nan"), -2.0, 0.5]), torch.tensor([-float("inf"), 1.0, 0.0, -0.0]),
            torch.tensor([3e38, 1e-30, -1.0, 7.0])]
    if dtype != torch.bfloat16 or not interpreting():  # the interpreter reads bf16 subnormals wrong (a GPU does not)
        rows.append(torch.tensor([1e-40, -3e-42, 2e-39, 0.0]))
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in rows]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_kernel_gives_the_torch_bits(dtype):
    """The Triton kernel (impl="triton", the CUDA path) and the torch ops give the same bytes
    and scales, for every special value, slices along and across memory (a weight's columns),
    3-D batches, strided views; both lay t_fp8 out with `dim` innermost."""
    torch.manual_seed(2)
    special = _special_rows(dtype)
    wide = (torch.randn(6, 70) * torch.logspace(-8, 8, 70)).to(dtype)
    batch = torch.randn(3, 20, 33).to(dtype)
    # slices longer than one K block (1024 along memory, 64 across it), the amax and a NaN in the first block: a kernel
    # keeping the last block's amax or NaN flag alone passed every slice of at most 70
    long_rows, long_cols = torch.randn(3, 1100), torch.randn(100, 3)
    long_rows[0, 5], long_rows[1, 7], long_cols[3, 0], long_cols[10, 1] = 40.0, float("nan"), 40.0, float("nan")
    cases = [(special, 1), (special.t(), 0), (wide, 1), (wide, 0), (wide[:, 5:61:2], 1), (wide.t(), 1),
             (batch, 2), (batch, 1), (batch.transpose(1, 2), 2), (torch.randn(5).to(dtype), 0), (batch[:, :, 0], 0),
             (long_rows.to(dtype), 1), (long_cols.to(dtype), 0)]
    for t, dim in cases:
        kernel, ref = fp8_quantize(t, dim, impl="triton"), fp8_quantize(t, dim, impl="torch")
        for a, b in zip(_bits(*kernel), _bits(*ref)):
            assert torch.equal(a, b), (tuple(t.shape), t.stride(), dim)
        for t_fp8 in (kernel[0], ref[0]):
            assert t_fp8.shape == t.shape and t_fp8.stride(dim) == 1 and t_fp8.movedim(dim, -1).is_contiguous()
    assert torch.isnan(fp8_quantize(special, 1, impl="triton")[1]).any(), "a NaN row's scale is NaN, as torch's"
    empty_fp8, empty_scale = fp8_quantize(torch.zeros(0, 4, dtype=dtype), 1, impl="triton")
    assert empty_fp8.shape == (0, 4) and empty_scale.shape == (0, 1)
    for impl in ("triton", "torch"):  # the reference's amax of nothing was an IndexError
        no_values, scale = fp8_quantize(torch.zeros(3, 0, dtype=dtype), 1, impl=impl)
        assert no_values.shape == (3, 0) and torch.equal(scale, torch.ones(3, 1)), "an empty slice's amax is 0: scale 1"
        no_values, scale = fp8_quantize(torch.zeros(0, 3, dtype=dtype), 0, impl=impl)
        assert no_values.shape == (0, 3) and torch.equal(scale, torch.ones(1, 3)), impl


def test_scale_does_not_change_values_above_subnormals():
    """The property the parallel tests rely on: quantizing a slice of a row, with its own
    (smaller) power-of-two scale, gives the same values as quantizing the whole row, except
    for values in e4m3's subnormal range of that scale."""
    torch.manual_seed(1)
    row = torch.randn(1, 64)
    row[0, :32] *= 3e-4  # the first half's amax is ~3000x smaller: a scale 2^11-2^12 smaller
    whole, half = _deq(row), _deq(row[:, :32])
    _, s_whole = fp8_quantize(row, 1)
    normal = (row[:, :32] / s_whole).abs() >= 2.0**-6  # e4m3's smallest normal
    assert normal.sum() > 5 and (~normal).sum() > 5
    assert torch.equal(half[normal], whole[:, :32][normal])
    assert not torch.equal(half, whole[:, :32]), "the subnormal ones differ: the check has teeth"


def _brute_matmul_grads(x, w, grad_y):
    """y, dx, dw from the module docstring's definition with the brute-force quantizer, float64."""
    y = _brute_quantize(x, 1) @ _brute_quantize(w, 0)
    dx = _brute_quantize(grad_y, 1) @ _brute_quantize(w, 1).t()
    dw = x.double().t() @ grad_y.double()
    return y, dx, dw


def _grads(fn, x, w, grad_y, **kw):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, **kw)
    dx, dw = torch.autograd.grad(y, (x, w), grad_y)
    return y, dx, dw


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_matmul_matches_the_definition(impl):
    torch.manual_seed(2)
    x, w = torch.randn(9, 12), torch.randn(12, 10) * 0.3
    grad_y = torch.randn(9, 10)
    got = _grads(fp8_matmul, x, w, grad_y, impl=impl)
    for g, want in zip(got, _brute_matmul_grads(x, w, grad_y)):
        torch.testing.assert_close(g.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_path_equals_the_emulation(dtype):
    """impl="auto" on CPU runs torch._scaled_mm; "torch" emulates: the same values up to the
    order of the float32 sums (bf16: the same rounding of those)."""
    torch.manual_seed(3)
    x, w = torch.randn(33, 48).to(dtype), (torch.randn(48, 40) * 0.2).to(dtype)
    grad_y = torch.randn(33, 40).to(dtype)
    fast, ref = _grads(fp8_matmul, x, w, grad_y, impl="auto"), _grads(fp8_matmul, x, w, grad_y, impl="torch")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(fast, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
    # the error against the exact product is fp8's (3 mantissa bits): a few percent, not zero
    exact = x.float() @ w.float()
    rel = float((fast[0].detach().float() - exact).norm() / exact.norm())
    assert 5e-3 < rel < 6e-2, rel


def test_matmul_shapes_and_empty():
    torch.manual_seed(4)
    x, w = torch.randn(2, 3, 16), torch.randn(16, 8)
    y = fp8_matmul(x, w)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y.reshape(6, 8), fp8_matmul(x.reshape(6, 16), w))
    empty = torch.zeros(0, 16, requires_grad=True)
    out = fp8_matmul(empty, w)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert empty.grad.shape == (0, 16)
    # K = 0: an empty sum, zeros as x @ w (reshape(-1, 0) was ambiguous), and its gradients empty
    x0, w0 = torch.zeros(2, 3, 0, requires_grad=True), torch.zeros(0, 4, requires_grad=True)
    for impl in ("auto", "torch"):
        y0 = fp8_matmul(x0, w0, impl=impl)
        assert torch.equal(y0, torch.zeros(2, 3, 4))
        y0.sum().backward()
        assert x0.grad.shape == (2, 3, 0) and w0.grad.shape == (0, 4)


def test_bad_input_names_the_argument():
    x, w = torch.randn(4, 8), torch.randn(8, 2)
    with pytest.raises(ValueError, match="^x:"):
        fp8_matmul(torch.ones(4, 8, dtype=torch.int64), w)
    with pytest.raises(ValueError, match=r"^w: expected a 2-D tensor \[K, N\] with K = 8"):
        fp8_matmul(x, torch.randn(7, 2))
    with pytest.raises(ValueError, match="^w: expected x's dtype"):
        fp8_matmul(x, w.double())
    with pytest.raises(ValueError, match="^impl:"):
        fp8_matmul(x, w, impl="cuda")
    with pytest.raises(ValueError, match="^t:"):
        fp8_quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="^dim:"):
        fp8_quantize(x, 2)
    with pytest.raises(ValueError, match="^fp8: expected a bool"):
        grouped_mlp(torch.randn(3, 8), torch.randn(2, 8, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 8),
                    torch.tensor([1, 3], dtype=torch.int32), fp8="rowwise")


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_compiles_whole_and_equals_eager(impl):
    """No custom op: the compiler traces the quantization (the amax, the scale, the cast) with
    the GEMMs, one graph, the same values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(5)
    x, w, grad_y = torch.randn(8, 16), torch.randn(16, 24), torch.randn(8, 24)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda a, b: fp8_matmul(a, b, impl=impl), fullgraph=True, backend=counter)
    for a, b in zip(_grads(compiled, x, w, grad_y), _grads(fp8_matmul, x, w, grad_y, impl=impl)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the autograd.Function's forward and backward bodies, traced as subgraphs of the one graph
    ops = {str(node.target) for graph in counter.graphs for module in graph.modules() if hasattr(module, "graph")
           for node in module.graph.nodes if node.op in ("call_function", "call_method")}
    assert counter.frame_count == 1 and any("frexp" in op for op in ops) and any("amax" in op for op in ops), ops


# -------------------------------------------------------------------- the experts' GEMMs


def _expert_problem(counts, n_unowned, H, F, dtype=torch.float32):
    torch.manual_seed(6)
    E, R = len(counts), sum(counts) + n_unowned
    x = torch.randn(R, H)
    ws = [torch.randn(E, H, F) / H**0.5, torch.randn(E, H, F) / H**0.5, torch.randn(E, F, H) / F**0.5]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t.to(dtype) for t in (x, *ws)], offsets, torch.randn(R, H).to(dtype)


def _expert_grads(tensors, offsets, grad_y, **kw):
    leaves = [t.clone().requires_grad_() for t in tensors]
    y = grouped_mlp(*leaves, offsets, **kw)
    return [y, *torch.autograd.grad(y, leaves, grad_y)]


def _per_row_fp8(x, w_gate, w_up, w_down, offsets, grad_y):
    """Each expert's rows through three fp8_matmul emulations (the definition) with torch's
    silu, one expert at a time, gradients by autograd through them."""
    leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    xl, wg, wu, wd = leaves
    rows, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        xe = xl[start:end]
        gate, up = fp8_matmul(xe, wg[e], impl="torch"), fp8_matmul(xe, wu[e], impl="torch")
        h = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
        rows.append(fp8_matmul(h, wd[e], impl="torch"))
        start = end
    rows.append(torch.zeros(x.shape[0] - start, x.shape[1], dtype=x.dtype))
    y = torch.cat(rows)
    return [y, *torch.autograd.grad(y, leaves, grad_y)]


CASES = [([5, 0, 7], 3, 32, 16), ([0, 17, 1, 9], 5, 40, 24), ([13], 0, 20, 12)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
def test_grouped_fp8_matches_the_per_expert_definition(case, impl):
    """auto (CPU: dequantized operands through torch._grouped_mm), triton (the interpreted
    grouped GEMM in float32) and torch (the loop of fp8_matmul) against the definition, with
    the unowned rows zero and ragged H and F (padded on the CPU path)."""
    tensors, offsets, grad_y = _expert_problem(*case)
    got = _expert_grads(tensors, offsets, grad_y, fp8=True, impl=impl)
    want = _per_row_fp8(*tensors, offsets, grad_y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    assert torch.all(got[0][int(offsets[-1]):] == 0)
    plain = _expert_grads(tensors, offsets, grad_y, impl=impl)[0]
    assert not torch.allclose(plain, got[0], rtol=1e-3, atol=1e-3), "fp8 changed the values: it ran"


def test_grouped_fp8_bf16_paths_agree_and_read_nothing_on_the_host():
    tensors, offsets, grad_y = _expert_problem([6, 0, 9], 2, 32, 16, dtype=torch.bfloat16)
    with HostReads() as host:
        auto = _expert_grads(tensors, offsets, grad_y, fp8=True, check=False)
    assert host.count == 0, host.sites
    ref = _expert_grads(tensors, offsets, grad_y, fp8=True, impl="torch")
    for a, b in zip(auto, ref):
        assert a.dtype == torch.bfloat16
        assert float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm()) < 1e-2


def test_grouped_fp8_compiles_whole():
    tensors, offsets, grad_y = _expert_problem([4, 3], 1, 16, 16)
    fn = torch.compile(lambda *t: grouped_mlp(*t, check=False, fp8=True), fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in tensors]
    y = fn(*leaves, offsets)
    grads = torch.autograd.grad(y, leaves, grad_y)
    for a, b in zip([y, *grads], _expert_grads(tensors, offsets, grad_y, fp8=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _args_of(fn, ops):
    """{op: [the value of one argument in each call of op that fn() makes]}, ops {op: (the
    argument's place, its name, its default)}: what reached the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {op: [] for op in ops}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                at, name, default = ops[func]
                seen[func].append(args[at] if len(args) > at else kwargs.get(name, default))
            return func(*args, **kwargs)

    with Record():
        fn()
    return seen


def _grouped_modes(fn):
    """The fp8 mode (experts.FP8_OFF / ON / FAST) of each grouped-GEMM custom-op call fn()
    makes, forward and backward (fp8's place: after (grad_y,) x, w, offsets, torch_gmm)."""
    fwd, bwd = torch.ops.fmoe.grouped_gemm_fwd.default, torch.ops.fmoe.grouped_gemm_bwd.default
    seen = _args_of(fn, {fwd: (4, "fp8", 0), bwd: (5, "fp8", 0)})
    return {"fwd": seen[fwd], "bwd": seen[bwd]}


def test_grouped_fast_accum_reaches_the_scaled_gemm_and_changes_nothing_off_cuda(monkeypatch):
    """fp8_fast_accum reaches every grouped GEMM (forward and input gradient) as the mode
    FP8_FAST and _fp8_gemm as fast_accum=True (on CUDA torch._scaled_grouped_mm's
    use_fast_accum, checked by a `gpu` test); elsewhere the values are fp8's own, bit for
    bit, on every path. Refused without fp8, or not a bool."""
    from fmoe.ops import experts

    tensors, offsets, grad_y = _expert_problem(*CASES[1])
    for impl in ("auto", "triton", "torch"):
        slow = _expert_grads(tensors, offsets, grad_y, fp8=True, impl=impl)
        fast = _expert_grads(tensors, offsets, grad_y, fp8=True, fp8_fast_accum=True, impl=impl)
        assert all(torch.equal(a, b) for a, b in zip(slow, fast)), impl
    seen = []
    real = experts._fp8_gemm
    monkeypatch.setattr(experts, "_fp8_gemm", lambda *a, **kw: seen.append(a[5] if len(a) > 5 else kw.get("fast_accum")) or real(*a, **kw))
    modes = _grouped_modes(lambda: _expert_grads(tensors, offsets, grad_y, fp8=True, fp8_fast_accum=True))
    assert modes == {"fwd": [experts.FP8_FAST] * 3, "bwd": [experts.FP8_FAST] * 3} and seen == [True] * 6, (modes, seen)
    assert _grouped_modes(lambda: _expert_grads(tensors, offsets, grad_y, fp8=True)) == {"fwd": [experts.FP8_ON] * 3, "bwd": [experts.FP8_ON] * 3}
    with pytest.raises(ValueError, match="fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True"):
        grouped_mlp(*tensors, offsets, fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fp8_fast_accum: expected a bool"):
        grouped_mlp(*tensors, offsets, fp8=True, fp8_fast_accum=1)


# -------------------------------------------------------------------- the model's knob


def _fp8_calls(model, batch):
    """How many fp8 GEMMs one forward makes: torch._scaled_mm calls (fp8_matmul on CPU, the
    dense projections) and grouped GEMM calls with fp8 set (experts)."""
    dense, grouped = torch.ops.aten._scaled_mm.default, torch.ops.fmoe.grouped_gemm_fwd.default
    seen = _args_of(lambda: model(batch), {dense: (0, "self", None), grouped: (4, "fp8", 0)})
    return {"dense": len(seen[dense]), "grouped": sum(bool(m) for m in seen[grouped]), "grouped_plain": sum(not m for m in seen[grouped])}


def test_model_knob_reaches_every_projection_it_names():
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch

    kw = dict(vocab_size=64, hidden=32, n_layers=3, n_dense=1, ffn_dense=48, n_experts=4, k=2, ffn_expert=16, n_shared=1,
              n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1, attn_gate=True)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (40,))
    batch = make_batch(ids, torch.tensor([0, 25, 40]), mtp_depth=1)
    out = {}
    for fp8 in (False, True):
        model = Transformer(TransformerConfig(fp8=fp8, **kw))
        model.reset_parameters(seed=0)
        out[fp8] = (_fp8_calls(model, batch), model(batch))
    calls = out[True][0]
    blocks = 3 + 1  # trunk and MTP blocks: wq, wk, wv, the gate's wg and wo each
    moe_blocks = 2 + 1  # the MTP block is a MoE block
    assert calls == {"dense": 5 * blocks + 3 * 1 + 3 * moe_blocks, "grouped": 3 * moe_blocks, "grouped_plain": 0}, calls
    assert out[False][0] == {"dense": 0, "grouped": 0, "grouped_plain": 3 * moe_blocks}
    # a Gated DeltaNet block's projections: q, k, v, the write strength's, the decay's, the gate's and the output's
    linear = Transformer(TransformerConfig(fp8=True, **dict(kw, linear_layers=(0,), linear_k_heads=2, linear_v_heads=2, linear_k_dim=8,
                                                            linear_v_dim=8)))
    linear.reset_parameters(seed=0)
    assert _fp8_calls(linear, batch)["dense"] == calls["dense"] - 5 + 7
    # fp8_layers: only block 1 (a MoE block with a shared expert): its attention, shared expert and
    # routed experts; block 0, block 2 and the MTP block stay in the compute dtype
    some = Transformer(TransformerConfig(fp8=True, fp8_layers=(1,), **kw))
    some.reset_parameters(seed=0)
    assert _fp8_calls(some, batch) == {"dense": 5 + 3, "grouped": 3, "grouped_plain": 3 * (moe_blocks - 1)}
    assert [some.cfg.is_fp8(i) for i in (0, 1, 2, None)] == [False, True, False, False]
    with pytest.raises(ValueError, match="fp8_layers: the blocks whose GEMMs run in fp8, needs fp8=True"):
        TransformerConfig(fp8_layers=(1,), **kw)
    # fp8_fast_accum: the fp8 blocks' routed experts (block 1 here), not the MTP block's (not fp8)
    from fmoe.layers import MoEConfig
    from fmoe.ops.experts import FP8_FAST, FP8_OFF

    fast = Transformer(TransformerConfig(fp8=True, fp8_layers=(1,), fp8_fast_accum=True, **kw))
    fast.reset_parameters(seed=0)
    assert _grouped_modes(lambda: fast(batch))["fwd"] == [FP8_FAST] * 3 + [FP8_OFF] * 6  # blocks 1, 2, the MTP block
    assert fast.blocks[1].mlp.cfg.fp8_fast_accum and not fast.mtp[0].block.mlp.cfg.fp8_fast_accum
    with pytest.raises(ValueError, match="fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True"):
        TransformerConfig(fp8_fast_accum=True, **kw)
    with pytest.raises(ValueError, match="fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True"):
        MoEConfig(n_experts=4, k=2, fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fp8_layers: expected distinct block indices in 0..2"):
        TransformerConfig(fp8=True, fp8_layers=(3,), **kw)
    plain, quantized = (out[f][1][0]["lm_sum"].detach() for f in (False, True))
    assert abs(float(quantized) - float(plain)) / abs(float(plain)) < 2e-2
    # the quantization reads nothing on the host: the fp8 model's forward and backward stay sync-free
    with HostReads() as host:
        model(batch)[0]["lm_sum"].backward()
    assert host.count == 0, host.sites


# -------------------------------------------------------------------- on a GPU


def _cuda_grads(fn, tensors, grad_y):
    leaves = [t.clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    return [y, *torch.autograd.grad(y, leaves, grad_y)]


@pytest.mark.gpu
def test_gpu_scaled_mm_equals_the_emulation():
    """cuBLAS's row-wise fp8 GEMMs (bf16 out) against the float32 emulation of the same
    quantized operands: equal up to the bf16 rounding of the outputs; dw (a bf16 GEMM) too."""
    torch.manual_seed(7)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2048, 1536, device="cuda") / 2048**0.5).to(torch.bfloat16)
    grad_y = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    assert fp8_module._fast_path(x, 2048, 1536) == (torch.cuda.get_device_capability() >= (8, 9))
    fast = _cuda_grads(lambda a, b: fp8_matmul(a, b), (x, w), grad_y)
    ref = _cuda_grads(lambda a, b: fp8_matmul(a, b, impl="torch"), (x, w), grad_y)
    for a, b in zip(fast, ref):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("align", [1, 16])
def test_gpu_scaled_grouped_mm_equals_the_emulation(align):
    """torch._scaled_grouped_mm (sm90) against the float32 emulation through the Triton
    grouped GEMM, with expert row groups of any size (align 1: the expert-parallel layout)
    and aligned to 16, an empty expert and unowned rows."""
    from fmoe.ops import experts

    torch.manual_seed(8)
    counts = [(c + align - 1) // align * align for c in (300, 0, 17, 1000, 129)]
    E, H, F = len(counts), 512, 256
    R = sum(counts) + 5
    x = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(E, *s, device="cuda") / s[0] ** 0.5).to(torch.bfloat16) for s in ((H, F), (H, F), (F, H))]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    grad_y = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)
    assert experts._grouped_mm_fast(x, F) == (torch.cuda.get_device_capability()[0] >= 9)
    fast = _cuda_grads(lambda *t: grouped_mlp(*t, offsets, fp8=True), (x, *ws), grad_y)
    ref = _cuda_grads(lambda *t: grouped_mlp(*t, offsets, fp8=True, impl="triton"), (x, *ws), grad_y)
    for a, b in zip(fast, ref):
        assert torch.isfinite(a).all()
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
    assert torch.all(fast[0][int(offsets[-1]):] == 0) and torch.all(fast[1][int(offsets[-1]):] == 0)


@pytest.mark.gpu
def test_gpu_fast_accum_is_asked_for_and_stays_near_the_emulation(monkeypatch):
    """fp8_fast_accum calls torch._scaled_grouped_mm with use_fast_accum=True (forward and
    input gradient) and, at an expert shape of the benchmarks (H 2048, F 768), stays within
    2% of the float32 emulation, output and gradients (fp8's own error against the exact
    product is about 6%: bench_fp8)."""
    torch.manual_seed(9)
    E, H, F, rows = 8, 2048, 768, 1024
    x = torch.randn(E * rows, H, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(E, *s, device="cuda") / s[0] ** 0.5).to(torch.bfloat16) for s in ((H, F), (H, F), (F, H))]
    offsets = torch.full((E,), rows, device="cuda").cumsum(0).to(torch.int32)
    grad_y = torch.randn(E * rows, H, device="cuda", dtype=torch.bfloat16)
    # torch._scaled_grouped_mm runs inside fmoe's grouped-GEMM custom ops, below a dispatch
    # mode's view: the Python function is wrapped instead
    seen, real = [], torch._scaled_grouped_mm
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **kw: seen.append(kw.get("use_fast_accum", False)) or real(*a, **kw))
    fast = _cuda_grads(lambda *t: grouped_mlp(*t, offsets, fp8=True, fp8_fast_accum=True), (x, *ws), grad_y)
    monkeypatch.undo()
    assert seen == [True] * 6, seen
    ref = _cuda_grads(lambda *t: grouped_mlp(*t, offsets, fp8=True, impl="triton"), (x, *ws), grad_y)
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(fast, ref)]
    assert all(e < 2e-2 for e in errors), f"relative errors of y, dx, dW_gate, dW_up, dW_down: {errors}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_quantize_kernel_gives_the_torch_bits(dtype):
    """The compiled kernel (its bit arithmetic, the subnormal rounding by adding 2^14, div_rn)
    against torch's ops on the GPU: the special rows (bf16 subnormals included, which the
    interpreter cannot read) and real-size rows and weight columns."""
    torch.manual_seed(0)
    special = _special_rows(dtype).cuda()
    x = (torch.randn(4096, 2048, device="cuda") * torch.logspace(-6, 6, 2048, device="cuda")).to(dtype)
    w = torch.randn(8, 2048, 768, device="cuda").to(dtype)
    for t, dim in ((special, 1), (special.t(), 0), (x, 1), (w, 1), (w, 2), (w.transpose(1, 2), 2)):
        kernel, ref = fp8_quantize(t, dim), fp8_quantize(t, dim, impl="torch")
        for a, b in zip(_bits(*kernel), _bits(*ref)):
            assert torch.equal(a, b), (tuple(t.shape), t.stride(), dim)


@pytest.mark.gpu
def test_gpu_fp8_model_step_makes_no_host_sync():
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(vocab_size=512, hidden=256, n_layers=2, n_dense=1, ffn_dense=512, n_experts=8, k=2, ffn_expert=128,
                            n_shared=1, n_heads=4, n_kv_heads=2, head_dim=64, mtp_depth=1, fp8=True)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.reset_parameters(seed=0)
    batch = make_batch(torch.randint(0, 512, (1024,)), torch.tensor([0, 300, 1024]), mtp_depth=1).to("cuda")
    ctx = model.context(batch)  # the batch's attention context, built before the step as the loop does

    def step(b):
        losses = model(b, ctx)[0]
        return losses["lm_sum"] + losses["mtp_1_sum"]  # every parameter gets a gradient, the MTP block's too

    step(batch).backward()  # warm-up: compiles FlexAttention, allocates
    model.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step(batch)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
