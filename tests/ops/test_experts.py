"""grouped_mlp, swiglu: kernels vs reference vs a per-row brute force (SPEC.md section 3)."""

import doctest
import math

import pytest
import torch

from fmoe.ops import experts
from fmoe.ops.experts import grouped_matmul, grouped_mlp, swiglu
from fmoe.train.metrics import HostReads

# (rows per expert, unowned rows past offsets[-1], H, F): E = 1, experts with no rows (first,
# middle, last), R not a multiple of the 16-row interpreter tiles, H and F not multiples of
# the 16-wide tiles (ragged K and N edges), and no unowned rows
CASES = [
    ([13], 0, 16, 16),
    ([5, 0, 7], 3, 32, 16),
    ([0, 17, 1, 9], 5, 48, 32),
    ([20, 0, 30, 0], 10, 40, 24),
    ([9, 16, 33], 0, 16, 32),
]


def _problem(counts, n_unowned, H, F, dtype=torch.float32, device="cpu"):
    """x [R, H], the three weights scaled so activations stay O(1), int32 offsets [E]."""
    E, R = len(counts), sum(counts) + n_unowned
    x = torch.randn(R, H, device=device)
    w_gate = torch.randn(E, H, F, device=device) / H**0.5
    w_up = torch.randn(E, H, F, device=device) / H**0.5
    w_down = torch.randn(E, F, H, device=device) / F**0.5
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return [t.to(dtype) for t in (x, w_gate, w_up, w_down)], offsets


def _run(fn, tensors, offsets, grad_y, **kwargs):
    """fn's output and the gradients of its four tensor inputs under upstream gradient grad_y."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves, offsets, **kwargs)
    (y * grad_y).sum().backward()
    return y, [t.grad for t in leaves]


def _gelu_tanh(g):
    """GELU's tanh form by its formula: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


def _brute_force(x, w_gate, w_up, w_down, offsets, biases=None, alpha=1.0, limit=None, offset=0.0, act="silu"):
    """Each row through its own expert's SwiGLU, one row at a time, float64; zero rows for
    none. biases (b_gate, b_up, b_down) after each projection; alpha, limit, offset: the
    clamped SwiGLU g sigmoid(alpha g) (u + offset), g = min(gate, limit), u = clamp(up, -limit, limit);
    act "gelu_tanh": GeGLU, _gelu_tanh(g) in place of g sigmoid(alpha g); act "silu_cap": the
    limit caps g sigmoid(alpha g), not g."""
    ends = offsets.tolist()
    rows = []
    for r in range(x.shape[0]):
        e = next((e for e, end in enumerate(ends) if r < end), None)
        if e is None:
            rows.append(torch.zeros_like(x[r]))
            continue
        gate, up = x[r] @ w_gate[e], x[r] @ w_up[e]
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[1][e]
        if limit is not None:
            gate, up = (gate if act == "silu_cap" else gate.clamp(max=limit)), up.clamp(-limit, limit)
        activated = _gelu_tanh(gate) if act == "gelu_tanh" else gate * torch.sigmoid(alpha * gate)
        if act == "silu_cap" and limit is not None:
            activated = activated.clamp(max=limit)
        y = (activated * (up + offset)) @ w_down[e]
        rows.append(y if biases is None else y + biases[2][e])
    return torch.stack(rows)


def _assert_unowned_zero(y, grad_x, offsets):
    end = int(offsets[-1])
    assert torch.equal(y[end:], torch.zeros_like(y[end:]))
    assert torch.equal(grad_x[end:], torch.zeros_like(grad_x[end:]))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_per_row_brute_force(case):
    tensors, offsets = _problem(*case)
    grad_y = torch.randn_like(tensors[0])
    y, grads = _run(grouped_mlp, tensors, offsets, grad_y, impl="torch")
    y64, grads64 = _run(_brute_force, [t.double() for t in tensors], offsets, grad_y.double())
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for g, g64 in zip(grads, grads64):
        torch.testing.assert_close(g, g64.float(), rtol=1e-5, atol=1e-5)
    _assert_unowned_zero(y, grads[0], offsets)
    assert y.dtype == torch.float32 and y.shape == tensors[0].shape


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_padding_rows_change_nothing(impl, device):
    """Zero rows padding each expert's group (permute's align) give zero rows and leave the
    weight gradients as they are without them."""
    counts, pads, H, F = [6, 0, 9], [2, 0, 7], 32, 16
    (x, *weights), offsets = _problem(counts, 0, H, F, device=device)
    padded_counts = [c + p for c, p in zip(counts, pads)]
    is_pad = torch.cat([torch.arange(c + p) >= c for c, p in zip(counts, pads)]).to(device)
    x_pad = torch.zeros(len(is_pad), H, device=device)
    x_pad[~is_pad] = x
    offsets_pad = torch.tensor(padded_counts, device=device).cumsum(0).to(torch.int32)
    grad_y = torch.randn(len(is_pad), H, device=device)
    y_pad, grads_pad = _run(grouped_mlp, [x_pad, *weights], offsets_pad, grad_y, impl=impl)
    y, grads = _run(grouped_mlp, [x, *weights], offsets, grad_y[~is_pad], impl=impl)
    assert torch.equal(y_pad[is_pad], torch.zeros_like(y_pad[is_pad]))
    torch.testing.assert_close(y_pad[~is_pad], y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads_pad[0][~is_pad], grads[0], rtol=1e-5, atol=1e-5)
    for g_pad, g in zip(grads_pad[1:], grads[1:]):
        torch.testing.assert_close(g_pad, g, rtol=1e-5, atol=1e-5)


def _assert_close(actual, expected):
    """float32: to float32 rounding. bf16: the paths round gate, up, h and the gradients at
    the same points but sum in different orders, so an intermediate may land one bf16 step
    (2^-8 relative) apart and carry that on: within 2% of the tensor's largest entry."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5)
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2 * float(expected.detach().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(case, dtype, device):
    tensors, offsets = _problem(*case, dtype=dtype, device=device)
    grad_y = torch.randn_like(tensors[0])
    y_tri, grads_tri = _run(grouped_mlp, tensors, offsets, grad_y, impl="triton")
    y_ref, grads_ref = _run(grouped_mlp, tensors, offsets, grad_y, impl="torch")
    assert y_tri.dtype == dtype and all(g.dtype == dtype for g in grads_tri)
    _assert_close(y_tri, y_ref)
    for g_tri, g_ref in zip(grads_tri, grads_ref):
        _assert_close(g_tri, g_ref)
    _assert_unowned_zero(y_tri, grads_tri[0], offsets)
    empty = [e for e, c in enumerate(case[0]) if c == 0]
    for g in grads_tri[1:]:  # experts without rows get exactly zero weight gradients
        assert torch.equal(g[empty], torch.zeros_like(g[empty]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("torch_gmm", [False, True], ids=["triton_gemm", "torch_grouped_mm"])
def test_unowned_rows_are_never_read(torch_gmm, dtype, device):
    """NaN in the rows past offsets[-1] reaches nothing: those rows of y and dx are exact
    zeros, everything else finite and equal to the reference. torch_gmm runs the path that
    impl="auto" takes on Hopper (torch._grouped_mm, which exists on CPU too) on this device,
    checking that its uninitialised rows and empty experts are zeroed."""
    if torch_gmm and device == "cuda" and not experts._grouped_mm_fast(torch.empty(1, 8, device=device, dtype=dtype), 8):
        pytest.skip("torch._grouped_mm has no fast kernel for this dtype on this GPU; auto does not use it")
    (x, *weights), offsets = _problem([7, 0, 12], 9, 32, 16, dtype=dtype, device=device)
    x_nan = x.clone()
    x_nan[19:] = float("nan")
    grad_y = torch.randn_like(x)
    y, grads = _run(experts._grouped_mlp_kernels, [x_nan, *weights], offsets, grad_y, torch_gmm=torch_gmm)
    y_ref, grads_ref = _run(grouped_mlp, [x, *weights], offsets, grad_y, impl="torch")
    _assert_unowned_zero(y, grads[0], offsets)
    _assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.isfinite(g).all()
        _assert_close(g, g_ref)
    for g in grads[1:]:
        assert torch.equal(g[1], torch.zeros_like(g[1]))


def test_empty_experts_weight_gradients_are_zero_whatever_grouped_mm_leaves_there(monkeypatch):
    """torch._grouped_mm leaves the weight-gradient groups of experts with no rows unwritten on
    some GPUs (pytorch/pytorch#172439); CPU's and Hopper's write zeros. With a _grouped_mm that
    leaves NaN there, the dW of an expert owning no rows is still all zero, the others' its own."""
    grouped_mm = torch._grouped_mm

    def unwritten(a, b, offs=None, **kwargs):
        out = grouped_mm(a, b, offs=offs, **kwargs)
        if out.ndim == 3:  # a weight gradient [E, K, N]
            out[offs <= torch.cat([offs.new_zeros(1), offs[:-1]])] = float("nan")
        return out

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    ws = [(torch.randn(3, 16, 16, generator=g) / 4).requires_grad_() for _ in range(3)]  # w_gate, w_up [E, H, F], w_down [E, F, H]
    offsets = torch.tensor([4, 4, 8], dtype=torch.int32)  # expert 1 owns no rows
    want = torch.autograd.grad(grouped_mlp(x, *ws, offsets, impl="torch").sum(), ws)
    monkeypatch.setattr(torch, "_grouped_mm", unwritten)
    got = torch.autograd.grad(grouped_mlp(x, *ws, offsets, impl="auto").sum(), ws)
    for a, b in zip(got, want):
        assert (a[1] == 0).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero", ["kernel", "dispatch"])
def test_zero_unowned(zero, device):
    """What the torch._grouped_mm paths rely on: rows past offsets[-1] zeroed, and the weight
    gradients of experts without rows (left unwritten on some GPUs), nothing else touched.
    "kernel": the Triton kernel; "dispatch": what _zero_unowned runs here (the kernel on
    CUDA, masked_fill on CPU), without a host read."""
    zero_fn = experts._zero_unowned_triton if zero == "kernel" else experts._zero_unowned
    offsets = torch.tensor([3, 3, 20, 20], dtype=torch.int32, device=device)
    guard = 8192  # elements of 7.0 before and after each tensor: a store past a row's end lands there (it corrupted the heap)
    buffers = [torch.full((2 * guard + rows * cols,), 7.0, device=device) for rows, cols in ((37, 300), (4, 5000))]
    out, grad_w = (b[guard:-guard].view(shape) for b, shape in zip(buffers, ((37, 300), (4, 5000))))  # 5000: two column chunks of 4096
    out.fill_(float("nan")), grad_w.fill_(float("nan"))
    with HostReads() as reads:
        zero_fn(out, offsets, per_expert=False)
        zero_fn(grad_w, offsets, per_expert=True)
    assert out[:20].isnan().all() and not out[20:].any()
    assert grad_w[[0, 2]].isnan().all() and not grad_w[[1, 3]].any()
    assert all(bool((b[:guard] == 7).all() and (b[-guard:] == 7).all()) for b in buffers), "stores outside the tensors"
    assert reads.count == 0 or zero == "kernel", reads.sites
    first_empty = torch.full((3, 7), float("nan"), device=device)  # expert 0 owns no row
    zero_fn(first_empty, torch.tensor([0, 4, 4], dtype=torch.int32, device=device), per_expert=True)
    assert not first_empty[[0, 2]].any() and first_empty[1].isnan().all()


def test_all_rows_unowned_and_no_rows(device):
    for R in (0, 5):
        (x, *weights), _ = _problem([0, 0], R, 16, 16, device=device)
        offsets = torch.zeros(2, dtype=torch.int32, device=device)
        for impl in ("torch", "triton", "auto"):
            y, grads = _run(grouped_mlp, [x, *weights], offsets, torch.randn_like(x), impl=impl)
            assert y.shape == (R, 16) and not y.any() and not any(g.any() for g in grads)


# ---------------------------------------------------------------------------- auto on CPU

# CASES, plus H and F whose rows are not 16-byte aligned (torch._grouped_mm's rule: padded)
CPU_CASES = CASES + [([4, 0, 3], 2, 5, 3), ([6, 2], 3, 12, 10)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_auto_on_cpu_matches_the_loop_without_host_reads(case, dtype):
    """impl="auto" on CPU: torch._grouped_mm around the torch SwiGLU, equal to the per-expert
    loop forward and backward; NaN in the rows past offsets[-1] reaches nothing (exact zero
    rows and gradients), experts without rows get exact zero weight gradients, and nothing
    is read on the host (the loop reads offsets)."""
    (x, *weights), offsets = _problem(*case, dtype=dtype)
    x_nan = x.clone()
    x_nan[sum(case[0]):] = float("nan")
    grad_y = torch.randn_like(x)
    with HostReads() as reads:
        y, grads = _run(grouped_mlp, [x_nan, *weights], offsets, grad_y, check=False)
    assert reads.count == 0, reads.sites
    with HostReads() as loop_reads:
        y_ref, grads_ref = _run(grouped_mlp, [x, *weights], offsets, grad_y, check=False, impl="torch")
    assert loop_reads.count == 1  # what "auto" saves: offsets.tolist()
    assert y.dtype == dtype and y.shape == x.shape and all(g.dtype == dtype for g in grads)
    _assert_unowned_zero(y, grads[0], offsets)
    _assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert torch.isfinite(g).all()
        _assert_close(g, g_ref)
    empty = [e for e, c in enumerate(case[0]) if c == 0]
    for g in grads[1:]:
        assert torch.equal(g[empty], torch.zeros_like(g[empty]))


def test_auto_on_cpu_does_not_need_the_interpreter(monkeypatch):
    """The CPU path runs no Triton kernel: the same numbers with TRITON_INTERPRET unset."""
    (x, *weights), offsets = _problem([5, 0, 7], 3, 32, 16)
    grad_y = torch.randn_like(x)
    y, grads = _run(grouped_mlp, [x, *weights], offsets, grad_y)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    y_plain, grads_plain = _run(grouped_mlp, [x, *weights], offsets, grad_y)
    assert torch.equal(y, y_plain) and all(torch.equal(a, b) for a, b in zip(grads, grads_plain))


def test_auto_on_cpu_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) of the CPU path, float32 (torch._grouped_mm's own meta
    function refuses float32: the custom op keeps it out of the trace), forward and backward."""
    def step(x, w_gate, w_up, w_down, offsets):
        return grouped_mlp(x, w_gate, w_up, w_down, offsets)

    tensors, offsets = _problem([6, 0, 11], 4, 32, 16)
    grad_y = torch.randn_like(tensors[0])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    y_c, grads_c = _run(compiled, tensors, offsets, grad_y)
    y_e, grads_e = _run(grouped_mlp, tensors, offsets, grad_y, impl="torch")
    _assert_close(y_c, y_e)
    for g_c, g_e in zip(grads_c, grads_e):
        _assert_close(g_c, g_e)


def test_the_torch_path_compiles_whole_with_inductor():
    """impl="torch" under torch.compile(fullgraph=True) with the default backend (inductor): the
    experts' row spans are read from offsets, sizes the compiler cannot bound by itself; it
    refused to slice by them (GuardOnDataDependentSymNode) until told 0 <= start <= end <= rows."""
    tensors, offsets = _problem([6, 0, 11], 4, 32, 16)
    grad_y = torch.randn_like(tensors[0])
    torch._dynamo.reset()
    mlp = torch.compile(lambda *a, **kw: grouped_mlp(*a, **kw), fullgraph=True)
    y_c, grads_c = _run(mlp, tensors, offsets, grad_y, impl="torch")
    y_e, grads_e = _run(grouped_mlp, tensors, offsets, grad_y, impl="torch")
    for got, want in zip([y_c, *grads_c], [y_e, *grads_e]):
        _assert_close(got, want)
    x, w = torch.randn(17, 32, requires_grad=True), torch.randn(3, 32, 8, requires_grad=True)
    matmul = torch.compile(lambda x, w, o: grouped_matmul(x, w, o, impl="torch", check=False), fullgraph=True)
    upstream = torch.randn(17, 8)
    got = [matmul(x, w, offsets), *torch.autograd.grad((matmul(x, w, offsets) * upstream).sum(), (x, w))]
    eager = grouped_matmul(x, w, offsets, impl="torch")
    for g, want in zip(got, [eager, *torch.autograd.grad((eager * upstream).sum(), (x, w))]):
        torch.testing.assert_close(g, want)


# ---------------------------------------------------------------------------- swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1,), (7, 33), (3, 5, 97)], ids=str)
def test_swiglu_triton_matches_reference(shape, dtype, device):
    gate = (3 * torch.randn(shape, device=device)).to(dtype)
    up = torch.randn(shape, device=device).to(dtype)
    grad_h = torch.randn(shape, device=device).to(dtype)
    _, (h_ref, *_), tol = _swiglu_triton_and_torch(gate, up, grad_h)
    # silu(g) * u against its definition g * sigmoid(g) * u in float64
    g64 = gate.double()
    torch.testing.assert_close(h_ref.double(), g64 * torch.sigmoid(g64) * up.double(), **tol)


def _swiglu_triton_and_torch(gate, up, grad_h, **glu):
    """swiglu's (h, d gate, d up) through the Triton kernels and the torch reference (upstream
    gradient grad_h), checked equal in gate's dtype (float32 tight, bf16 its rounding);
    returns (triton's, torch's, the tolerance)."""
    outs = {}
    for impl in ("triton", "torch"):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        h = swiglu(g, u, impl=impl, **glu)
        (h * grad_h).sum().backward()
        outs[impl] = (h, g.grad, u.grad)
    tol = dict(rtol=1e-5, atol=1e-6) if gate.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3)
    for tri, ref in zip(outs["triton"], outs["torch"]):
        assert tri.dtype == gate.dtype
        torch.testing.assert_close(tri, ref, **tol)
    return outs["triton"], outs["torch"], tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_clamped_swiglu_triton_matches_reference(dtype, device):
    """gpt-oss's g sigmoid(alpha g) (u + offset) in the fused kernels: values and both
    gradients against torch's autograd of the clamps, with elements beyond the limit, at
    it exactly (torch.clamp passes the gradient there) and just inside."""
    limit = 1.5
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([3 * torch.randn(200, generator=g), torch.tensor([limit, -limit, limit - 1e-3, 9.0])]).to(device, dtype)
    up = torch.cat([3 * torch.randn(200, generator=g), torch.tensor([-limit, limit, -9.0, limit + 1e-3])]).to(device, dtype)
    grad_h = torch.randn(gate.shape, generator=g).to(device, dtype)
    (_, grad_gate, grad_up), _, _ = _swiglu_triton_and_torch(gate, up, grad_h, alpha=1.702, limit=limit, offset=1.0)
    assert (grad_gate[gate > limit] == 0).all() and (grad_up[up.abs() > limit] == 0).all()  # the clamps cut the gradient
    assert (grad_gate[gate == limit] != 0).all() and (grad_up[up.abs() == limit] != 0).all()  # and pass it at the bounds
    assert int((gate > limit).sum()) > 10 and int((up.abs() > limit).sum()) > 10


def _swiglu_against_float64(gate, up, grad_h, formula, glu, tol, torch_atol=None):
    """swiglu(gate, up, **glu) on the Triton and the torch path against float64 autograd of
    formula(g, u) (upstream gradient grad_h): the value and both gradients, in gate's dtype,
    within tol (the torch path's atol torch_atol where given); -> {impl: (h, d gate, d up)}."""
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    h64 = formula(g64, u64)
    (h64 * grad_h.double()).sum().backward()
    outs = {}
    for impl in ("triton", "torch"):
        gi, ui = gate.clone().requires_grad_(), up.clone().requires_grad_()
        h = swiglu(gi, ui, impl=impl, **glu)
        (h * grad_h).sum().backward()
        for ours, exact in ((h, h64), (gi.grad, g64.grad), (ui.grad, u64.grad)):
            assert ours.dtype == gate.dtype
            torch.testing.assert_close(ours.double(), exact, **(dict(tol, atol=torch_atol) if impl == "torch" and torch_atol else tol))
        outs[impl] = (h, gi.grad, ui.grad)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_capped_swiglu_triton_matches_its_formula(dtype, device):
    """act "silu_cap" (Step 3.7's experts): min(g sigmoid(alpha g), limit) (clamp(up) +
    offset), the limit on the activation, not on the gate. The fused kernels and the torch
    path against float64 autograd of the formula; the gate's gradient cut where the
    activation passes the limit (not where the gate does), the up's where |up| does; the
    value differs from the gate-clamped form's."""
    limit = 1.5
    g = torch.Generator().manual_seed(6)
    gate = torch.cat([3 * torch.randn(300, generator=g), torch.tensor([1.5, 1.9, 9.0, -9.0])]).to(device, dtype)
    up = torch.cat([3 * torch.randn(300, generator=g), torch.tensor([-limit, limit, -9.0, limit + 1e-3])]).to(device, dtype)
    grad_h = torch.randn(gate.shape, generator=g).to(device, dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3)
    # limits below the activation's minimum (-0.2785 / alpha): the cap is one-sided, no floor at -limit
    for glu in (dict(limit=limit), dict(alpha=1.702, limit=limit, offset=1.0), dict(limit=0.1), dict(alpha=1.702, limit=0.05)):
        alpha, lim = glu.get("alpha", 1.0), glu["limit"]

        def formula(g, u):
            return (g * torch.sigmoid(alpha * g)).clamp(max=lim) * (u.clamp(-lim, lim) + glu.get("offset", 0.0))

        act = gate.double() * torch.sigmoid(alpha * gate.double())
        capped = act >= lim
        for _, grad_gate, grad_up in _swiglu_against_float64(gate, up, grad_h, formula, dict(glu, act="silu_cap"), tol).values():
            assert (grad_gate[capped] == 0).all() and (grad_up[up.abs() > lim] == 0).all()
            assert (grad_gate[(gate > lim) & ~capped] != 0).all()  # a gate past the limit whose activation is not: 1.5 sigmoid(1.5) < 1.5
            assert (grad_gate[act < -lim] != 0).all()  # below -limit the activation passes (a floor cut these)
        assert int(capped.sum()) > 10 and (lim < 1 or int(((gate > lim) & ~capped).sum()) >= 1)
        assert lim > 0.3 or int((act < -lim).sum()) > 10
        assert not torch.allclose(swiglu(gate, up, act="silu_cap", impl="torch", **glu), swiglu(gate, up, impl="torch", **glu))
    # at the limit exactly the gradient passes, as torch.clamp's does at its bound (the limit read off each path's own activation)
    for impl in ("torch", "triton"):
        gate4 = torch.tensor([0.7, 1.3, 2.0, 3.0], device=device)
        limit_at = float(swiglu(gate4, torch.ones_like(gate4), act="silu_cap", limit=100.0, impl=impl)[2])  # silu(2.0)
        g4 = gate4.clone().requires_grad_()
        swiglu(g4, torch.ones_like(gate4), act="silu_cap", limit=limit_at, impl=impl).sum().backward()
        assert g4.grad[2].item() == pytest.approx(torch.sigmoid(gate4[2]).item() * (1 + 2.0 * (1 - torch.sigmoid(gate4[2]).item())), rel=1e-5)
        assert g4.grad[3] == 0 and (g4.grad[:2] != 0).all(), impl
    # min(silu(3), 2) * clamp(5, -2, 2) = 2 * 2; the gate-clamped form gives silu(2) * 2
    assert swiglu(torch.tensor([3.0]), torch.tensor([5.0]), limit=2.0, act="silu_cap").item() == 4.0
    assert swiglu(torch.tensor([0.5]), torch.tensor([1.0]), limit=2.0, act="silu_cap").item() == pytest.approx(0.5 / (1 + math.exp(-0.5)))
    # without a limit it is silu(gate) * up
    assert torch.equal(swiglu(gate, up, act="silu_cap", impl="torch"), swiglu(gate, up, impl="torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_geglu_triton_matches_reference_and_gelu_s_formula(dtype, device):
    """act "gelu_tanh" (GeGLU, Gemma's): the fused kernels' value and both gradients against
    torch's autograd of gelu(approximate="tanh"), over gates out to +-12 (where tanh
    saturates), and the values against GELU's tanh formula in float64; with the clamps
    and offset too; a worked value."""
    g = torch.Generator().manual_seed(4)
    gate = torch.cat([4 * torch.randn(300, generator=g), torch.tensor([0.0, 12.0, -12.0, 1e-4])]).to(device, dtype)
    up = torch.randn(gate.shape, generator=g).to(device, dtype)
    grad_h = torch.randn(gate.shape, generator=g).to(device, dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-3)
    for glu in (dict(), dict(limit=1.5, offset=1.0)):
        lim = glu.get("limit")

        def formula(g, u):
            return _gelu_tanh(g if lim is None else g.clamp(max=lim)) * ((u if lim is None else u.clamp(-lim, lim)) + glu.get("offset", 0.0))

        # torch's float32 gelu is itself 1e-6 off the formula where its tanh nears -1
        _swiglu_against_float64(gate, up, grad_h, formula, dict(glu, act="gelu_tanh"), tol, torch_atol=2 * tol["atol"])
    # 0.5 (1 + tanh(sqrt(2/pi) (1 + 0.044715))) = 0.84119..., times up = 2
    assert swiglu(torch.tensor([1.0]), torch.tensor([2.0]), act="gelu_tanh", impl="torch").item() == pytest.approx(2 * 0.8411920, rel=1e-6)
    assert not torch.allclose(swiglu(gate, up, act="gelu_tanh", impl="torch"), swiglu(gate, up, impl="torch"))


@pytest.mark.parametrize("glu", [{}, dict(alpha=1.702, limit=7.0, offset=1.0), dict(act="gelu_tanh"), dict(limit=0.5, act="silu_cap")],
                         ids=["plain", "clamped", "geglu", "capped"])
def test_swiglu_backward_saves_only_gate_and_up(glu, device):
    gate = torch.randn(6, 40, device=device, requires_grad=True)
    up = torch.randn(6, 40, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate, up, impl="triton", **glu)
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}


# ---------------------------------------------------------------------------- validation


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


GPT_OSS_GLU = dict(alpha=1.702, limit=0.6, offset=1.0)  # a limit these O(1) activations cross


@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_biases_and_clamped_swiglu_match_per_row_brute_force(case, impl):
    """gpt-oss's experts: per-expert biases and the clamped SwiGLU, values and every gradient
    (biases included), on every path; rows of no expert stay zero (no bias there)."""
    (x, wg, wu, wd), offsets = _problem(*case)
    E, F, H = wg.shape[0], wg.shape[2], x.shape[1]
    g = torch.Generator().manual_seed(5)
    biases = [torch.randn(E, F, generator=g), torch.randn(E, F, generator=g), torch.randn(E, H, generator=g)]
    grad_y = torch.randn(x.shape, generator=g)

    def ours(x, wg, wu, wd, bg, bu, bd, offsets):
        return grouped_mlp(x, wg, wu, wd, offsets, b_gate=bg, b_up=bu, b_down=bd, impl=impl, **GPT_OSS_GLU)

    tensors = [x, wg, wu, wd, *biases]
    y, grads = _run(ours, tensors, offsets, grad_y)
    def brute_force(x, wg, wu, wd, bg, bu, bd, offsets):
        return _brute_force(x, wg, wu, wd, offsets, (bg, bu, bd), **GPT_OSS_GLU)

    y64, grads64 = _run(brute_force, [t.double() for t in tensors], offsets, grad_y.double())
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for grad, grad64 in zip(grads, grads64):
        torch.testing.assert_close(grad, grad64.float(), rtol=1e-5, atol=1e-5)
    _assert_unowned_zero(y, grads[0], offsets)
    assert (x @ wg[1] + biases[0][1]).max() > GPT_OSS_GLU["limit"]  # the clamps act
    # GeGLU (Gemma's experts) on every path
    y, grads = _run(lambda *t: grouped_mlp(*t[:4], t[-1], impl=impl, act="gelu_tanh"), tensors[:4], offsets, grad_y)
    y64, grads64 = _run(lambda *t: _brute_force(*t[:4], t[-1], act="gelu_tanh"), [t.double() for t in tensors[:4]], offsets, grad_y.double())
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for grad, grad64 in zip(grads, grads64):
        torch.testing.assert_close(grad, grad64.float(), rtol=1e-5, atol=1e-5)
    # Step 3.7's experts (the limit caps the activation) on every path
    capped = dict(limit=GPT_OSS_GLU["limit"], act="silu_cap")
    y, grads = _run(lambda *t: grouped_mlp(*t[:4], t[-1], impl=impl, **capped), tensors[:4], offsets, grad_y)
    y64, grads64 = _run(lambda *t: _brute_force(*t[:4], t[-1], **capped), [t.double() for t in tensors[:4]], offsets, grad_y.double())
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for grad, grad64 in zip(grads, grads64):
        torch.testing.assert_close(grad, grad64.float(), rtol=1e-5, atol=1e-5)
    assert torch.nn.functional.silu(x @ wg[1]).max() > capped["limit"]  # the cap acts
    # the defaults are the plain SwiGLU, and zero biases change nothing
    plain = grouped_mlp(x, wg, wu, wd, offsets, impl=impl)
    zeros = grouped_mlp(x, wg, wu, wd, offsets, impl=impl, b_gate=0 * biases[0], b_up=0 * biases[1], b_down=0 * biases[2])
    torch.testing.assert_close(zeros, plain, rtol=0, atol=0)


@pytest.mark.parametrize("act", ["relu2", "gelu_new", "gelu", "relu"])
@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_experts_without_a_gate_match_per_row_brute_force(case, impl, act):
    """Nemotron 3's experts: no gate (w_gate None, act "relu2"), relu(x w_up + b_up)^2 w_down +
    b_down per row (acts "gelu_new" and "gelu": GELU's tanh and exact forms, Phi-2's and GPT-NeoX's MLPs'), values and every
    gradient on every path, with and without biases; rows of no expert stay zero; in bf16 each
    path gives the loop's values (_assert_close)."""
    (x, _, wu, wd), offsets = _problem(*case)
    E, F, H = wu.shape[0], wu.shape[2], x.shape[1]
    g = torch.Generator().manual_seed(6)
    b_up, b_down = torch.randn(E, F, generator=g), torch.randn(E, H, generator=g)
    grad_y = torch.randn(x.shape, generator=g)

    def brute_force(x, wu, wd, bu, bd, offsets):
        ends, rows = offsets.tolist(), []
        for r in range(x.shape[0]):
            e = next((e for e, end in enumerate(ends) if r < end), None)
            h = None if e is None else x[r] @ wu[e] + bu[e]
            plain = {"relu2": lambda h: torch.relu(h) ** 2, "gelu_new": _gelu_tanh, "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
                     "relu": torch.relu}
            rows.append(torch.zeros_like(x[r]) if e is None else plain[act](h) @ wd[e] + bd[e])
        return torch.stack(rows)

    def ours(x, wu, wd, bu, bd, offsets):
        return grouped_mlp(x, None, wu, wd, offsets, b_up=bu, b_down=bd, impl=impl, act=act)

    for biases in ([b_up, b_down], [0 * b_up, 0 * b_down]):
        tensors = [x, wu, wd, *biases]
        y, grads = _run(ours, tensors, offsets, grad_y)
        y64, grads64 = _run(brute_force, [t.double() for t in tensors], offsets, grad_y.double())
        torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
        for grad, grad64 in zip(grads, grads64):
            torch.testing.assert_close(grad, grad64.float(), rtol=1e-5, atol=1e-5)
        _assert_unowned_zero(y, grads[0], offsets)
    assert bool(((x @ wu[1]) < 0).any()) and bool(((x @ wu[1]) > 0).any())  # the ReLU cuts some rows' columns
    plain = grouped_mlp(x, None, wu, wd, offsets, impl=impl, act=act)
    _assert_close(plain, grouped_mlp(x, None, wu, wd, offsets, impl="torch", act=act))
    half = [t.bfloat16() for t in (x, wu, wd)]
    _assert_close(grouped_mlp(half[0], None, *half[1:], offsets, impl=impl, act=act),
                  grouped_mlp(half[0], None, *half[1:], offsets, impl="torch", act=act))
    if act == "gelu_new":  # 0.5 (1 + tanh(sqrt(2/pi) (1 + 0.044715))) = 0.84119...
        assert experts.plain_act(torch.tensor([1.0]), act).item() == pytest.approx(0.8411920, rel=1e-6)


def test_xielu_values_and_gradients():
    """xIELU (Apertus's): a_p x^2 + beta x above 0, a_n (expm1(min(x, eps)) - x) + beta x at
    and below, a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n); its learned scalars'
    gradients are autograd's of that formula; plain_act needs its four parameters."""
    x = torch.tensor([-3.0, -1e-7, 0.0, 0.5, 2.0], requires_grad=True)
    alpha_p, alpha_n = torch.tensor([0.2], requires_grad=True), torch.tensor([-1.0], requires_grad=True)
    y = experts.xielu(x, alpha_p, alpha_n, 0.5, -1e-6)
    a_p, a_n = math.log1p(math.exp(0.2)), 0.5 + math.log1p(math.exp(-1.0))
    want = [a_n * (math.expm1(min(v, -1e-6)) - v) + 0.5 * v if v <= 0 else a_p * v * v + 0.5 * v for v in x.tolist()]
    torch.testing.assert_close(y, torch.tensor(want), rtol=1e-6, atol=1e-7)
    y.sum().backward()
    s_p, s_n = 1 / (1 + math.exp(-0.2)), 1 / (1 + math.exp(1.0))  # softplus' derivative
    torch.testing.assert_close(alpha_p.grad, torch.tensor([s_p * (0.25 + 4.0)]))
    torch.testing.assert_close(alpha_n.grad, torch.tensor([s_n * sum(math.expm1(min(v, -1e-6)) - v for v in (-3.0, -1e-7, 0.0))]))
    torch.testing.assert_close(experts.plain_act(x, "xielu", (alpha_p, alpha_n, 0.5, -1e-6)), y)
    _raises(r"params: xIELU takes \(alpha_p, alpha_n, beta, eps\), got None", experts.plain_act, x, "xielu")
    (x_perm, _, wu, wd), off = _problem([3, 4], 1, 16, 8)
    _raises("act: experts with xIELU", grouped_mlp, x_perm, None, wu, wd, off, act="xielu")


def test_clamped_swiglu_values():
    gate, up = torch.tensor([-1.0, 0.5, 3.0]), torch.tensor([-9.0, 0.5, 9.0])
    out = swiglu(gate, up, alpha=1.702, limit=7.0, offset=1.0)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(out, g * torch.sigmoid(1.702 * g) * (u + 1))
    assert out[0] == pytest.approx(-1.0 * torch.sigmoid(torch.tensor(-1.702)).item() * -6.0)
    torch.testing.assert_close(swiglu(gate, up, limit=1.0), torch.nn.functional.silu(gate.clamp(max=1.0)) * up.clamp(-1.0, 1.0))


def test_bad_inputs():
    (x, wg, wu, wd), off = _problem([3, 4], 1, 16, 8)
    _raises("x_perm: expected a 2-D", grouped_mlp, x[0], wg, wu, wd, off)
    _raises("x_perm: expected dtype", grouped_mlp, x.long(), wg, wu, wd, off)
    _raises("w_gate: expected a 3-D", grouped_mlp, x, wg[0], wu, wd, off)
    _raises(r"w_gate: expected shape \[E, H, F\] with E >= 1 and H = 16", grouped_mlp, x, wg[:, :8], wu, wd, off)
    _raises("w_gate: expected shape", grouped_mlp, x, wg[:0], wu[:0], wd[:0], off[:0])
    _raises(r"w_up: expected shape \[E, H, F\] = \[2, 16, 8\] like w_gate, got \[2, 16, 4\]", grouped_mlp, x, wg, wu[..., :4], wd, off)
    _raises("w_up: expected a 3-D", grouped_mlp, x, wg, wu[0], wd, off)
    _raises(r"w_down: expected shape \[E, F, H\] = \[2, 8, 16\], got \[2, 16, 8\]", grouped_mlp, x, wg, wu, wg, off)
    _raises("w_down: expected a 3-D", grouped_mlp, x, wg, wu, wd[0], off)
    _raises("w_gate: dtype bfloat16 differs from x_perm's float32", grouped_mlp, x, wg.bfloat16(), wu, wd, off)
    _raises("w_down: dtype float16 differs from x_perm's float32", grouped_mlp, x, wg, wu, wd.half(), off)
    _raises(r"offsets: expected int32 \[E\] = \(2,\)", grouped_mlp, x, wg, wu, wd, off.long())
    _raises(r"offsets: expected int32 \[E\] = \(2,\)", grouped_mlp, x, wg, wu, wd, off[:1])
    _raises(r"offsets: expected int32 \[E\] = \(2,\)", grouped_mlp, x, wg, wu, wd, [3, 7])
    _raises(r"offsets: must be non-decreasing from 0, but offsets\[1\] = 2 < 3", grouped_mlp, x, wg, wu, wd, torch.tensor([3, 2], dtype=torch.int32))
    _raises(r"offsets: must be non-decreasing from 0, but offsets\[0\] = -1 < 0", grouped_mlp, x, wg, wu, wd, torch.tensor([-1, 2], dtype=torch.int32))
    _raises("offsets: the last expert's rows end at 9, past x_perm's 8 rows", grouped_mlp, x, wg, wu, wd, torch.tensor([3, 9], dtype=torch.int32))
    _raises("impl: expected one of", grouped_mlp, x, wg, wu, wd, off, impl="cuda")
    # swiglu
    _raises("gate: expected a float32, bfloat16 or float16 tensor", swiglu, torch.ones(3, dtype=torch.long), torch.ones(3))
    _raises("up: expected a float32, bfloat16 or float16 tensor", swiglu, torch.ones(3), [1.0, 2.0, 3.0])
    _raises(r"up: expected shape \(3,\) like gate, got \(4,\)", swiglu, torch.ones(3), torch.ones(4))
    _raises("up: dtype bfloat16 differs from gate's float32", swiglu, torch.ones(3), torch.ones(3, dtype=torch.bfloat16))
    _raises("impl: expected one of", swiglu, torch.ones(3), torch.ones(3), impl="fast")
    # biases and the clamped SwiGLU
    _raises(r"b_gate: expected shape \[2, 8\] \(\[E, F\] for b_gate / b_up, \[E, H\] for b_down\), got torch.Size\(\[2, 16\]\)",
            grouped_mlp, x, wg, wu, wd, off, b_gate=torch.zeros(2, 16))
    _raises(r"b_down: expected shape \[2, 16\]", grouped_mlp, x, wg, wu, wd, off, b_down=torch.zeros(2, 8))
    _raises(r"b_up: expected shape \[2, 8\]", grouped_mlp, x, wg, wu, wd, off, b_up=torch.zeros(8, 2))  # as many elements, transposed
    _raises(r"b_down: expected shape \[2, 16\]", grouped_mlp, x, wg, wu, wd, off, b_down=torch.zeros(16, 2))
    _raises("b_up: dtype bfloat16 differs from x_perm's float32", grouped_mlp, x, wg, wu, wd, off, b_up=torch.zeros(2, 8, dtype=torch.bfloat16))
    _raises(r"limit: expected > 0 \(the SwiGLU clamp\) or None, got 0", grouped_mlp, x, wg, wu, wd, off, limit=0)
    _raises("alpha: expected a finite number, got nan", grouped_mlp, x, wg, wu, wd, off, alpha=float("nan"))
    _raises("offset: expected a finite number, got '1'", swiglu, torch.ones(3), torch.ones(3), offset="1")
    _raises("act: expected one of silu, gelu_tanh, silu_cap \\(the gate's activation\\) or relu2, xielu, gelu_new, gelu, relu \\(no gate\\), got 'swish'", grouped_mlp, x, wg, wu, wd, off,
            act="swish")
    # experts without a gate (w_gate None, act relu2)
    _raises("w_gate: act 'relu2' is an MLP without a gate, expected None, got a tensor", grouped_mlp, x, wg, wu, wd, off, act="relu2")
    _raises(r"w_gate: act 'silu' gates the up projection, expected \[E, H, F\], got None", grouped_mlp, x, None, wu, wd, off)
    _raises("b_gate: the gate's bias, expected None with w_gate None", grouped_mlp, x, None, wu, wd, off, act="relu2", b_gate=torch.zeros(2, 8))
    _raises("alpha / limit / offset: knobs of a gated MLP's activation, not of act 'relu2'", grouped_mlp, x, None, wu, wd, off, act="relu2",
            limit=7.0)
    _raises(r"w_up: expected shape \[E, H, F\] with E >= 1 and H = 16", grouped_mlp, x, None, wu[:, :8], wd, off, act="relu2")
    _raises(r"w_down: expected shape \[E, F, H\] = \[2, 8, 16\], got \[2, 16, 8\]", grouped_mlp, x, None, wu, wu, off, act="relu2")
    _raises("act: swiglu gates up by act\\(gate\\)", swiglu, torch.ones(3), torch.ones(3), act="relu2")
    _raises("act: expected one of relu2, xielu, gelu_new, gelu, relu \\(an MLP without a gate\\), got 'silu'", experts.plain_act, torch.ones(3), "silu")
    _raises("alpha: the slope of SwiGLU's sigmoid, expected 1.0 with act 'gelu_tanh'", swiglu, torch.ones(3), torch.ones(3), act="gelu_tanh", alpha=1.7)


# (rows per expert, unowned rows, K, N): an expert without rows, ragged K and N (not 16-byte rows in float32 or bf16)
MATMUL_CASES = [([5, 0, 7], 3, 12, 20), ([9, 16], 0, 16, 8), ([0, 4, 1, 6], 2, 7, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
@pytest.mark.parametrize("case", MATMUL_CASES, ids=str)
def test_grouped_matmul_matches_per_row_brute_force(case, impl, dtype, device):
    """Each row times its own expert's matrix (float64, one row at a time): the output and
    both gradients on every path; rows of no expert zero with zero gradient, NaN there read
    by nothing; experts without rows get exact zero gradients; no host read but "torch"'s."""
    counts, n_unowned, K, N = case
    E, R = len(counts), sum(counts) + n_unowned
    x = torch.randn(R, K, device=device).to(dtype)
    w = (torch.randn(E, K, N, device=device) / K**0.5).to(dtype)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    ends = offsets.tolist()
    x[ends[-1]:] = float("nan")  # unowned rows are never read
    grad_y = torch.randn(R, N, device=device)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rows = [x64[r] @ w64[next(e for e, end in enumerate(ends) if r < end)] if r < ends[-1] else x64.new_zeros(N) for r in range(R)]
    expected = torch.stack(rows)
    (expected * grad_y.double()).sum().backward()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with HostReads() as reads:
        y = grouped_matmul(xl, wl, offsets, impl=impl, check=False)
        (y * grad_y.to(dtype)).sum().backward()
    assert impl == "torch" or reads.count == 0, reads.sites
    assert y.dtype == dtype and y.shape == (R, N)
    owned = slice(0, ends[-1])
    for actual, want in ((y, expected), (xl.grad, x64.grad), (wl.grad, w64.grad)):
        actual = actual[owned] if actual is not wl.grad else actual
        want = want[owned] if want is not w64.grad else want
        _assert_close(actual.float(), want.float()) if dtype == torch.float32 else _assert_close(actual, want.to(dtype))
    assert torch.equal(y[ends[-1]:], torch.zeros_like(y[ends[-1]:])) and torch.equal(xl.grad[ends[-1]:], torch.zeros_like(xl.grad[ends[-1]:]))
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert torch.equal(wl.grad[empty], torch.zeros_like(wl.grad[empty]))


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_strided_offsets_read_as_their_copy(impl, device):
    """offsets taken every other element of a wider tensor: grouped_matmul and grouped_mlp
    give the outputs and gradients of its contiguous copy (the kernels read offsets densely)."""
    (x, w_gate, w_up, w_down), offsets = _problem([5, 0, 7], 3, 32, 16, device=device)
    strided = torch.stack([offsets, offsets.flip(0)], dim=1)[:, 0]  # stride 2, the flip between
    assert strided.stride() == (2,) and torch.equal(strided, offsets)
    grad_y = torch.randn(x.shape[0], 32, device=device)
    for fn, tensors in ((grouped_mlp, (x, w_gate, w_up, w_down)), (grouped_matmul, (x, w_up @ w_down))):
        y, grads = _run(fn, tensors, strided, grad_y, impl=impl)
        y_want, grads_want = _run(fn, tensors, offsets, grad_y, impl=impl)
        for actual, want in zip([y, *grads], [y_want, *grads_want]):
            _assert_close(actual, want)


def test_grouped_matmul_compiles_whole_and_refuses_bad_inputs():
    x, w = torch.randn(6, 12), torch.randn(2, 12, 20)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    compiled = torch.compile(lambda x, w, o: grouped_matmul(x, w, o), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w, offsets), grouped_matmul(x, w, offsets, impl="torch"))
    _raises("x_perm: expected", grouped_matmul, torch.randn(6), w, offsets)
    _raises("w: expected shape \\[E, K, N\\] with E >= 1 and K = 12", grouped_matmul, x, torch.randn(2, 11, 20), offsets)
    _raises("w: dtype bfloat16 differs from x_perm's float32", grouped_matmul, x, w.bfloat16(), offsets)
    _raises("offsets: expected int32 \\[E\\] = \\(2,\\)", grouped_matmul, x, w, offsets.long())
    _raises("offsets: the last expert's rows end at 7", grouped_matmul, x, w, torch.tensor([2, 7], dtype=torch.int32))


def test_docstring_examples():
    assert doctest.testmod(experts).failed == 0


def test_offset_values_unchecked_on_request():
    (x, wg, wu, wd), _ = _problem([3, 4], 1, 16, 8)
    bad = torch.tensor([3, 2], dtype=torch.int32)
    assert grouped_mlp(x, wg, wu, wd, bad, check=False, impl="torch").shape == x.shape


# ---------------------------------------------------------------------------- registration


def test_custom_ops_pass_opcheck(device):
    (x, wg, *_), offsets = _problem([5, 0, 8], 3, 16, 16, device=device)
    gate, up = torch.randn(7, 33, device=device, requires_grad=True), torch.randn(7, 33, device=device, requires_grad=True)
    for glu in ((), (1.702, 0.5, 1.0), (1.0, None, 0.0, "gelu_tanh"), (1.0, 0.5, 0.0, "silu_cap")):  # silu(gate) * up, clamped, GeGLU, capped
        torch.library.opcheck(torch.ops.fmoe.swiglu_fwd.default, (gate, up, *glu))
        torch.library.opcheck(torch.ops.fmoe.swiglu_bwd.default, (torch.randn(7, 33, device=device), gate.detach(), up.detach(), *glu))
    backends = [False, True] if device == "cpu" or experts._grouped_mm_fast(x.bfloat16(), 16) else [False]
    for dtype in (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,):
        for torch_gmm in backends:
            xd, wd = x.to(dtype).requires_grad_(), wg.to(dtype).requires_grad_()
            torch.library.opcheck(torch.ops.fmoe.grouped_gemm_fwd.default, (xd, wd, offsets, torch_gmm))
            grad_y = torch.randn(x.shape[0], 16, device=device, dtype=dtype)
            torch.library.opcheck(torch.ops.fmoe.grouped_gemm_bwd.default, (grad_y, xd.detach(), wd.detach(), offsets, torch_gmm))
            # column-major views (a transposed weight): the fake's outputs are row-major, as the op's (torch.compile checks strides)
            x_cm, w_cm = xd.detach().t().contiguous().t(), wd.detach().transpose(1, 2).contiguous().transpose(1, 2)
            torch.library.opcheck(torch.ops.fmoe.grouped_gemm_bwd.default, (grad_y, x_cm, w_cm, offsets, torch_gmm), test_utils="test_faketensor")
    gate_cm, up_cm = (torch.randn(33, 7, device=device).t() for _ in range(2))  # [7, 33] views in column-major order
    torch.library.opcheck(torch.ops.fmoe.swiglu_fwd.default, (gate_cm, up_cm), test_utils="test_faketensor")
    torch.library.opcheck(torch.ops.fmoe.swiglu_bwd.default, (torch.randn(7, 33, device=device), gate_cm, up_cm), test_utils="test_faketensor")


def test_compiles_without_graph_breaks(device):
    def step(x, w_gate, w_up, w_down, offsets):
        return grouped_mlp(x, w_gate, w_up, w_down, offsets, impl="triton")

    tensors, offsets = _problem([6, 0, 11], 4, 32, 16, device=device)
    grad_y = torch.randn_like(tensors[0])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    y_c, grads_c = _run(compiled, tensors, offsets, grad_y)
    y_e, grads_e = _run(step, tensors, offsets, grad_y)
    torch.testing.assert_close(y_c, y_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)


# ---------------------------------------------------------------------------- GPU, real shape


def _real_problem():
    """R = 16384 tokens x 8 = 131072 rows over E = 128 experts, H = 2048, F = 768, bf16: skewed
    counts, expert 3 without rows, 1000 unowned rows at the end (NaN, never to be read)."""
    R, E, H, F = 131072, 128, 2048, 768
    counts = torch.distributions.Dirichlet(torch.full((E,), 2.0)).sample()
    counts = (counts * (R - 1000)).long()
    counts[3] = 0
    counts[0] += R - 1000 - counts.sum()
    (x, *weights), offsets = _problem(counts.tolist(), 1000, H, F, dtype=torch.bfloat16, device="cuda")
    x[-1000:] = float("nan")
    return x, weights, offsets


def _rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _without_gate(x, w_up, w_down, offsets, **kw):
    """grouped_mlp of experts without a gate (Nemotron 3's relu2)."""
    return grouped_mlp(x, None, w_up, w_down, offsets, act="relu2", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "relu2"])
def test_gpu_real_shape_auto_triton_reference(gated):
    """auto and triton against the loop at the real shape (_real_problem), the SwiGLU experts
    and experts without a gate (relu2, w_gate dropped)."""
    x, weights, offsets = _real_problem()
    fn = grouped_mlp if gated else _without_gate
    weights = weights if gated else weights[1:]
    assert experts._grouped_mm_fast(x, weights[0].shape[2]) == (torch.cuda.get_device_capability()[0] >= 9)
    grad_y = torch.randn_like(x)
    y_auto, grads_auto = _run(fn, [x, *weights], offsets, grad_y)
    y_tri, grads_tri = _run(fn, [x, *weights], offsets, grad_y, impl="triton")
    for y, grads in ((y_auto, grads_auto), (y_tri, grads_tri)):
        _assert_unowned_zero(y, grads[0], offsets)
        assert all(torch.isfinite(g).all() for g in grads)
        for g in grads[1:]:
            assert torch.equal(g[3], torch.zeros_like(g[3]))
    assert _rel_err(y_auto, y_tri) < 1e-2
    for g_auto, g_tri in zip(grads_auto, grads_tri):
        assert _rel_err(g_auto, g_tri) < 1e-2

    # the reference on a few experts: their rows, their weights, their own offsets
    chosen = [0, 3, 64, 127]
    starts = [0] + offsets[:-1].tolist()
    rows = torch.cat([torch.arange(starts[e], int(offsets[e]), device="cuda") for e in chosen])
    sub_offsets = torch.tensor([int(offsets[e]) - starts[e] for e in chosen], device="cuda").cumsum(0).to(torch.int32)
    y_ref, grads_ref = _run(fn, [x[rows], *(w[chosen] for w in weights)], sub_offsets, grad_y[rows], impl="torch")
    for y, grads in ((y_auto, grads_auto), (y_tri, grads_tri)):
        assert _rel_err(y[rows], y_ref) < 1e-2
        assert _rel_err(grads[0][rows], grads_ref[0]) < 1e-2
        for g, g_ref in zip(grads[1:], grads_ref[1:]):
            assert _rel_err(g[chosen], g_ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("glu", [{}, dict(alpha=1.702, limit=1.0, offset=1.0), dict(act="gelu_tanh"), dict(limit=1.0, act="silu_cap")],
                         ids=["plain", "clamped", "geglu", "capped"])
def test_gpu_swiglu_real_shape(glu):
    gate = torch.randn(131072, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    grad_h = torch.randn_like(gate)
    (swiglu(gate, up, **glu) * grad_h).sum().backward()
    g_ref, u_ref = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    h_ref = swiglu(g_ref, u_ref, impl="torch", **glu)
    (h_ref * grad_h).sum().backward()
    torch.testing.assert_close(swiglu(gate, up, **glu), h_ref, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(gate.grad, g_ref.grad, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(up.grad, u_ref.grad, rtol=1.6e-2, atol=1e-3)


def test_more_rows_than_int32_offsets_are_refused():
    """offsets are int32: x_perm of 2**31 rows is refused naming its rows (an expanded view)."""
    x_perm = torch.zeros(1, 4).expand(2**31, 4)
    w = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=r"x_perm: 2147483648 rows, past the int32 row ids of offsets"):
        grouped_matmul(x_perm, w, torch.tensor([0, 2], dtype=torch.int32))


def test_grouped_gemm_programs_write_their_experts_rows_alone(device):
    """The forward kernel's programs of expert 0 alone (a grid of its row tiles) on a NaN-filled
    output write its rows 0..12 and nothing of expert 1's: the interpreter runs programs in
    order, so a tile writing the next expert's first row was overwritten by that expert's
    own later tile and passed every end-to-end test, where a GPU runs them in any order."""
    import triton

    from fmoe.ops.backend import next_pow2

    g = torch.Generator().manual_seed(0)
    R, K, N, E = 24, 16, 16, 2
    offsets = torch.tensor([13, 24], dtype=torch.int32)
    x, w, offsets = torch.randn(R, K, generator=g).to(device), torch.randn(E, K, N, generator=g).to(device), offsets.to(device)
    y = torch.full((R, N), float("nan"), device=device)
    meta = experts._gemm_blocks(x.dtype)
    grid = (triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(13, meta["BLOCK_M"]),)  # expert 0's tiles come first
    experts._grouped_gemm_fwd_kernel[grid](x, w, y, offsets, R, K, N, E, TRANS_W=False, BLOCK_E=next_pow2(E), **meta)
    assert (~y.isnan().all(1)).nonzero().flatten().tolist() == list(range(13))  # every column of rows 0..12, none past
    torch.testing.assert_close(y[:13], x[:13] @ w[0], rtol=1e-5, atol=1e-5)
