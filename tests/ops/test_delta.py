"""The gated delta rule and gated linear attention, the rule without the delta
(fmoe/ops/delta.py): worked examples, the chunked form against the
token-by-token loop (forward and backward, packed documents, states, chunk sizes; a decay per
head and per key channel), against transformers' own torch implementations (Qwen3-Next's and
Kimi Linear's), the states' Triton kernels against torch (the interpreter on CPU; real shapes
on a GPU), their registration, and the argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from fmoe.ops import delta, gated_delta_rule, gated_linear_attention
from fmoe.ops.delta import _pair_sums, gated_delta_rule_loop, gated_linear_attention_loop
from fmoe.train.metrics import HostReads


def _inputs(B, T, N, Dk, Dv, *, seed=0, requires_grad=False, channels=False):
    """q, k, v, g, beta; channels: g [B, T, N, Dk], a decay per key channel (Kimi Delta
    Attention), some of them fast (down to exp(-8) a token)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, N, Dk, generator=gen)
    k = F.normalize(torch.randn(B, T, N, Dk, generator=gen), dim=-1)  # as Gated DeltaNet feeds it
    v = torch.randn(B, T, N, Dv, generator=gen)
    g = -F.softplus(torch.randn(B, T, N, *((Dk,) if channels else ()), generator=gen)) * (1 + 3 * channels)
    beta = torch.rand(B, T, N, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def test_worked_example():
    """One head, Dk = Dv = 1, q = k = 1, scale 1: v = (2, 4), decays (1, 0.5), beta (0.5, 1).
    t=1: S' = 0, u = 0.5 (2 - 0) = 1, S = 1, o = 1.  t=2: S' = 0.5, u = 1 (4 - 0.5) = 3.5,
    S = 4, o = 4. A second document restarts from 0: v = 3, beta 1 -> o = 3."""
    ones = torch.ones(1, 3, 1, 1)
    v = torch.tensor([2.0, 4.0, 3.0]).view(1, 3, 1, 1)
    g = torch.tensor([0.0, math.log(0.5), -1.0]).view(1, 3, 1)
    beta = torch.tensor([0.5, 1.0, 1.0]).view(1, 3, 1)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    for fn in (gated_delta_rule_loop, gated_delta_rule):
        o, state = fn(ones, ones, v, g, beta, cu, scale=1.0, final_state=True)
        torch.testing.assert_close(o.flatten(), torch.tensor([1.0, 4.0, 3.0]))
        torch.testing.assert_close(state.flatten(), torch.tensor([3.0]))  # the last document's


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("B,T,N,Dk,Dv,chunk", [(2, 37, 3, 8, 5, 8), (1, 50, 2, 4, 6, 16), (1, 5, 1, 4, 4, 64), (3, 64, 2, 8, 8, 64),
                                               (1, 1, 2, 4, 4, 64), (1, 33, 1, 16, 8, 32), (1, 30, 2, 8, 4, 12)])
def test_chunks_equal_the_loop(B, T, N, Dk, Dv, chunk, channels):
    """Forward, final state and every gradient (a random upstream gradient on both outputs),
    with an initial state, odd lengths and chunks that do not divide T (nor are a power of
    two), a decay per head or per key channel."""
    xs = _inputs(B, T, N, Dk, Dv, requires_grad=True, channels=channels)
    state0 = torch.randn(B, N, Dk, Dv, requires_grad=True)
    grad_o, grad_s = torch.randn(B, T, N, Dv), torch.randn(B, N, Dk, Dv)
    results = []
    for fn, kw in ((gated_delta_rule_loop, {}), (gated_delta_rule, dict(chunk_size=chunk))):
        o, s = fn(*xs, initial_state=state0, final_state=True, **kw)
        grads = torch.autograd.grad((o * grad_o).sum() + (s * grad_s).sum(), [*xs, state0])
        results.append((o, s, *grads))
    for ref, got in zip(*results):  # 1e-5 of each tensor's scale (the chunks' float32 rounding; the loop's is smaller)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.detach().abs().max())))


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
def test_packed_documents_are_independent(channels):
    """With cu_seqlens each document equals its own call (empty documents, one of length 1,
    documents across chunk bounds); the initial state is the first document's only, and the
    final state the last one's."""
    cu = torch.tensor([0, 3, 3, 20, 21, 40], dtype=torch.int32)
    xs = _inputs(1, 40, 2, 8, 4, seed=1, channels=channels)
    state0 = torch.randn(1, 2, 8, 4)
    o, state = gated_delta_rule(*xs, cu, initial_state=state0, final_state=True, chunk_size=8)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        alone, last = gated_delta_rule_loop(*(x[:, a:b] for x in xs), initial_state=state0 if a == 0 else None, final_state=True)
        torch.testing.assert_close(o[:, a:b], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, last, rtol=1e-5, atol=1e-5)
    loop_o = gated_delta_rule_loop(*xs, cu, initial_state=state0)
    torch.testing.assert_close(o, loop_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("rule", [True, False], ids=["delta", "linear"])
def test_a_neighbour_s_strong_decay_leaves_a_document_as_it_is_alone(channels, rule):
    """Document B packed after A in one chunk, A's log-decays -50, -110 a token (or -inf, the floor's): the chunk's
    cumulative sum ran over A into B, and B's own small decays (-0.001) were lost in float32 against A's sum: B 6e-5 to
    2.9e-4 (relative) off B alone. The sums restart at each document: B is B alone, within the chunks' rounding, and so
    are its gradients."""
    fn, ref_fn = (gated_delta_rule, gated_delta_rule_loop) if rule else (gated_linear_attention, gated_linear_attention_loop)
    q, k, v, _, beta = _inputs(1, 64, 2, 8, 8, seed=14, requires_grad=True)
    cu, alone = torch.tensor([0, 40, 64], dtype=torch.int32), slice(40, 64)
    for strong, chunk in ((-50.0, 64), (-110.0, 64), (float("-inf"), 64), (-110.0, 16)):  # 16: A's last tokens in B's chunk
        g = torch.full((1, 64, 2, 8) if channels else (1, 64, 2), -0.001)
        g[:, :40] = strong
        extra = (beta,) if rule else ()
        o, state = fn(q, k, v, g, *extra, cu, impl="torch", chunk_size=chunk, final_state=True)
        o = o[:, alone]
        b_in = [x[:, alone] for x in (q, k, v, g, *extra)]
        want, want_state = ref_fn(*b_in, final_state=True)
        assert float((o - want).detach().abs().max() / want.detach().abs().max()) < 2e-6, (strong, chunk)
        assert float((state - want_state).detach().abs().max() / want_state.detach().abs().max()) < 2e-6, (strong, chunk)
        grad_o = torch.randn_like(o)
        got, ref = (torch.autograd.grad((out * grad_o).sum(), (q, k, v)) for out in (o, fn(*b_in, impl="torch")))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a[:, alone], b[:, alone], rtol=1e-5, atol=1e-6)  # both through slices of q, k, v


def test_packed_gradients_equal_the_loop():
    cu = torch.tensor([0, 10, 30, 45])
    xs = _inputs(1, 45, 2, 8, 4, seed=2, requires_grad=True)
    grad_o = torch.randn(1, 45, 2, 4)
    ref = torch.autograd.grad((gated_delta_rule_loop(*xs, cu) * grad_o).sum(), xs)
    got = torch.autograd.grad((gated_delta_rule(*xs, cu, chunk_size=8) * grad_o).sum(), xs)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module,chunked,recurrent,channels", [
    ("qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", False),
    ("kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", True),
], ids=["qwen3-next", "kimi-linear"])
def test_matches_transformers_torch_implementation(module, chunked, recurrent, channels):
    """transformers' fallbacks (independent implementations: a chunked form and a recurrence),
    Qwen3-Next's for a decay per head and Kimi Linear's for a decay per key channel, with an
    initial state and the final state."""
    theirs = pytest.importorskip(f"transformers.models.{module}", reason="transformers (the test extra) not installed")
    q, k, v, g, beta = _inputs(2, 70, 3, 16, 8, seed=3, channels=channels)
    state0 = torch.randn(2, 3, 16, 8)
    o, state = gated_delta_rule(q, k, v, g, beta, initial_state=state0, final_state=True)
    for name in (chunked, recurrent):
        ref_o, ref_state = getattr(theirs, name)(q, k, v, g, beta, initial_state=state0, output_final_state=True)
        torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-5)


def test_pair_sums_of_per_channel_decays():
    """_pair_sums against the direct sum over channels of x_i k_j exp(gamma_i - gamma_j) (j <= i),
    for chunks of a power of two and not; with decays of up to exp(-60) a token, where
    exp(gamma_i) alone underflows and exp(-gamma_j) overflows float32, every entry is still
    finite and exact."""
    gen = torch.Generator().manual_seed(11)
    for C, fast in ((8, 1.0), (13, 1.0), (16, 60.0)):
        x, k = torch.randn(2, C, 4, generator=gen, dtype=torch.float64), torch.randn(2, C, 4, generator=gen, dtype=torch.float64)
        gamma = (-fast * torch.rand(2, C, 4, generator=gen, dtype=torch.float64)).cumsum(-2)
        want = torch.einsum("bid,bjd,bijd->bij", x, k, (gamma[:, :, None] - gamma[:, None]).clamp(max=0).exp()).tril()
        got = _pair_sums(x.float(), k.float(), gamma.float())
        assert got.isfinite().all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        if fast > 1:
            assert not (-gamma.float()).exp().isfinite().all()  # what a factorisation through the chunk's start would meet


def test_fast_per_channel_decay_stays_finite():
    """Decays down to exp(-40) a token in chunks of 32: the chunked form equals the loop."""
    q, k, v, _, beta = _inputs(1, 40, 2, 8, 8, seed=12)
    g = -40 * torch.rand(1, 40, 2, 8, generator=torch.Generator().manual_seed(13))
    o = gated_delta_rule(q, k, v, g, beta, chunk_size=32)
    assert o.isfinite().all()
    torch.testing.assert_close(o, gated_delta_rule_loop(q, k, v, g, beta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("rule", [True, False], ids=["delta", "linear"])
def test_a_zero_decay_forgets_the_state_as_the_loop_does(channels, rule):
    """g = -inf (exp(g) = 0: the state forgotten whole, as A = -exp(A_log) gives once A_log > 88.7)
    at some tokens, among them several in one chunk, a chunk's first and last: the chunks equal
    the loop, output, final state and gradients, nothing NaN (-inf - -inf inside a chunk's
    differences was NaN)."""
    q, k, v, g, beta = _inputs(1, 24, 2, 4, 3, seed=14, channels=channels)
    g = g.clone()
    g[0, [3, 5, 8, 15, 20]] = float("-inf")  # chunks of 8: two in the first, the second's first, the second's last
    if channels:
        g[0, 11, 0, :2] = float("-inf")  # some key channels forgotten, not others
    xs = [x.requires_grad_() for x in (q, k, v, beta, g)]
    state0 = torch.randn(1, 2, 4, 3)
    fn, loop = (gated_delta_rule, gated_delta_rule_loop) if rule else (gated_linear_attention, gated_linear_attention_loop)

    def run(f, **kw):
        x = dict(zip("q k v beta g".split(), xs))
        args = (x["q"], x["k"], x["v"], x["g"]) + ((x["beta"],) if rule else ())
        o, state = f(*args, initial_state=state0, final_state=True, **kw)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + state.sum(),
                                    xs[:3] + xs[3 if rule else 4:])
        return o, state, grads

    want, got = run(loop), run(fn, chunk_size=8)
    assert got[0].isfinite().all() and all(t.isfinite().all() for t in got[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2][-1][g == float("-inf")].eq(0).all()  # a zero decay's gradient: exp(g) = 0 times anything
    for g_got, g_want in zip(got[2], want[2]):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [gated_delta_rule, gated_delta_rule_loop, gated_linear_attention, gated_linear_attention_loop])
def test_no_tokens_stay_in_the_graph(fn):
    """T = 0: an empty output in v's dtype that still needs a gradient (backward runs and
    gives each input an empty one; it used to be detached, so .backward() failed), and a final
    state that is a copy of the initial one, its gradient passed through."""
    q, k, v, g, beta = _inputs(1, 0, 2, 4, 3, requires_grad=True)
    args = (q, k, v, g, beta) if fn in (gated_delta_rule, gated_delta_rule_loop) else (q, k, v, g)
    o = fn(*args)
    assert o.shape == (1, 0, 2, 3) and o.dtype == v.dtype and o.requires_grad
    o.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in args)
    s0 = torch.randn(1, 2, 4, 3, requires_grad=True)
    o, state = fn(*(x.detach() for x in args), initial_state=s0, final_state=True)
    assert state is not s0 and torch.equal(state, s0) and o.shape == (1, 0, 2, 3)
    (state * 2).sum().backward()
    assert torch.equal(s0.grad, torch.full_like(s0, 2.0))


def test_dtypes_and_scale():
    """bf16 inputs compute in float32 and return bf16; scale multiplies the queries."""
    q, k, v, g, beta = _inputs(1, 20, 2, 8, 4, seed=4)
    ref = gated_delta_rule(q, k, v, g, beta, scale=0.5)
    torch.testing.assert_close(gated_delta_rule(q * 0.5, k, v, g, beta, scale=1.0), ref)
    torch.testing.assert_close(ref, gated_delta_rule(q, k, v, g, beta) * (0.5 * 8 ** 0.5), rtol=1e-5, atol=1e-6)  # default 1/sqrt(Dk)
    low = gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)), scale=0.5)
    assert low.dtype == torch.bfloat16
    upcast = gated_delta_rule(*(x.bfloat16().float() for x in (q, k, v, g, beta)), scale=0.5)
    torch.testing.assert_close(low, upcast.bfloat16(), rtol=0, atol=0)  # float32 math on the bf16 values, the output rounded once
    torch.testing.assert_close(low.float(), ref, rtol=1.6e-2, atol=1e-2)  # 7.8e-3 apart here: the inputs' rounding


def test_reads_nothing_on_the_host():
    """With check=False (fmoe's layers: make_batch checked the batch's bounds) nothing is read
    on the host; the default check reads cu_seqlens and g's largest value."""
    xs = _inputs(1, 30, 2, 8, 4, requires_grad=True)
    cu = torch.tensor([0, 7, 30])
    with HostReads() as reads:
        o, s = gated_delta_rule(*xs, cu, final_state=True, chunk_size=8, check=False)
        torch.autograd.backward([o, s], [torch.randn_like(o), torch.randn_like(s)])
    assert reads.count == 0, reads.sites
    with HostReads() as reads:
        gated_delta_rule(*xs, cu, chunk_size=8)
    assert reads.count, "the default check reads cu_seqlens and g"


@pytest.mark.parametrize("rule", [True, False], ids=["delta rule", "linear attention"])
@pytest.mark.parametrize("bounds", [[1, 3, 6], [0, 4, 2, 6], [0, 3, 5]], ids=["not from 0", "decreasing", "short of T"])
def test_bounds_that_pack_no_documents_are_refused(rule, bounds):
    """cu_seqlens' values are read (check=True, the default): bounds not from 0, going down or
    ending before T gave the rule over no valid packing (2.69 off the right bounds' output), and
    a meta tensor failed in torch's copy. check=False trusts them, reading nothing."""
    q, k, v, g, beta = _inputs(1, 6, 2, 8, 4)
    rest = (beta,) if rule else ()
    run = gated_delta_rule if rule else gated_linear_attention
    loop = gated_delta_rule_loop if rule else gated_linear_attention_loop
    cu = torch.tensor(bounds)
    for fn in (run, loop):
        with pytest.raises(ValueError, match=r"^cu_seqlens: must (start at 0|be non-decreasing|end at the token count 6)"):
            fn(q, k, v, g, *rest, cu)
        with pytest.raises(ValueError, match=r"^cu_seqlens: a meta tensor holds no offsets to copy to the device of q \(cpu\)"):
            fn(q, k, v, g, *rest, torch.tensor([0, 6], device="meta"))
    assert run(q, k, v, g, *rest, cu, check=False).shape == (1, 6, 2, 4)
    for fn in (run, loop):
        for flag in ("no", 0):  # "no" ran the checks, 0 skipped them
            with pytest.raises(ValueError, match=rf"^check: expected a bool, got {flag!r}"):
                fn(q, k, v, g, *rest, cu, check=flag)
    # a decay past 1 (g > 0, documented <= 0): the state grows without bound
    up = g.clone()
    up[0, 3, 1] = 0.5
    for fn in (run, loop):
        with pytest.raises(ValueError, match=r"^g: expected the log of each token's decay of the state, <= 0 .*got a largest value of 0.5"):
            fn(q, k, v, up, *rest)
    assert run(q, k, v, up, *rest, check=False).isfinite().all()
    up[0, 0, 0] = float("nan")  # a NaN beside the positive value hid it (max over a NaN is NaN)
    for fn in (run, loop):
        with pytest.raises(ValueError, match=r"^g: expected the log .*got a largest value of 0.5"):
            fn(q, k, v, up, *rest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_are_contiguous(dtype):
    """o and the final state are contiguous, as the loop's (o.view(B, T, N * Dv) failed on the
    chunked form's transposed o); the scan's y and state through it alike."""
    from fmoe.ops import selective_scan

    q, k, v, g, beta = _inputs(2, 7, 2, 4, 3)
    v = v.to(dtype)
    for o, state in (gated_delta_rule(q, k, v, g, beta, chunk_size=4, final_state=True),
                     gated_linear_attention(q, k, v, g, chunk_size=4, final_state=True),
                     gated_delta_rule_loop(q, k, v, g, beta, final_state=True)):
        assert o.dtype == dtype and o.is_contiguous() and state.is_contiguous()
        assert o.view(2, 7, 6).shape == (2, 7, 6)
    y, h = selective_scan(q[..., 0, :3].to(dtype), -g[..., 0, None].expand(2, 7, 3), -torch.rand(3, 2), k[..., 0, :2], q[..., 1, :2],
                          final_state=True, impl="torch")
    assert y.is_contiguous() and h.is_contiguous() and y.view(14, 3).shape == (14, 3)


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_compiles_whole(impl, channels):
    """torch.compile(fullgraph=True) traces the chunked form (with the states' kernels: their
    custom ops), forward and backward."""
    xs = _inputs(1, 24, 2, 16, 16, seed=8, requires_grad=True, channels=channels)
    cu = torch.tensor([0, 9, 24])

    def step(*xs):
        return gated_delta_rule(*xs, cu, chunk_size=8, impl=impl).square().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(*xs).backward()
    got = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    step(*xs).backward()
    for x, g in zip(xs, got):
        torch.testing.assert_close(g, x.grad)


def test_the_torch_path_compiles_once_for_every_chunk_count():
    """torch.compile(dynamic=True, fullgraph=True) of the torch path: the states' loop over the chunks, traced, made a
    graph per chunk count (ceil(T / chunk_size)) and the 9th count failed on the recompile limit; it is one op of its own
    there (fmoe::delta_states_ref, its backward the kernels' recurrence in torch): outputs and gradients equal eager's
    for 4 chunk counts, in at most 2 graphs (dynamo's own specialisations; the loop made 4)."""
    from torch._dynamo.utils import counters

    def step(q, k, v, g, beta, cu):  # gated_linear_attention's states are the same op without w_k (opcheck below)
        return gated_delta_rule(q, k, v, g, beta, cu, chunk_size=2, impl="torch", check=False)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (5, 9, 13, 17):  # chunk counts 3, 5, 7, 9
        xs = _inputs(1, T, 2, 4, 4, seed=T, requires_grad=True)
        cu = torch.tensor([0, T // 2, T])
        grad_o = torch.randn(1, T, 2, 4)
        outs = [f(*xs, cu) for f in (compiled, step)]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(*(torch.autograd.grad((out * grad_o).sum(), xs[:4]) for out in outs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_projections_made_in_the_compiled_region_compile_with_dynamic_sizes():
    """q, k and v reshaped from projections made inside the compiled region (a block's own),
    torch.compile(dynamic=True): the chunks' zero padding (F.pad) failed in the backward
    ("view size is not compatible with input tensor's size and stride"; a lightning
    attention model could not train; gated_delta_rule's chunks the same). Values and
    gradients equal eager's for two T."""
    N, D = 2, 3

    def block(x, W, g, cu):
        T = x.shape[0]
        q, k, v = (F.silu(x @ W[i]).reshape(1, T, N, D) for i in range(3))
        return gated_linear_attention(q, k, v, g, cu, chunk_size=4, scale=1.0, impl="torch", check=False)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for T in (12, 17):
        x0, W0 = torch.randn(T, 5, generator=gen), torch.randn(3, 5, N * D, generator=gen)
        g = -torch.rand(1, T, N, generator=gen)
        cu = torch.tensor([0, 4, T])
        results = []
        for fn in (compiled, block):
            x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
            out = fn(x, W, g, cu)
            results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (x, W))))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the states' Triton kernels


@pytest.mark.parametrize("B,T,N,Dk,Dv,chunk,packed,channels", [
    (2, 37, 3, 8, 5, 8, False, False),     # small tiles, Dv under one block
    (1, 45, 2, 80, 40, 16, True, False),   # Dk in two halves (80 > 64), Dv in 3 blocks, packed documents
    (1, 70, 2, 16, 24, 64, True, False),   # a chunk's rows in two blocks of 32 (and a partial chunk)
    (2, 37, 3, 8, 5, 8, False, True),      # a decay per key channel: a factor per row of the state
    (1, 45, 2, 80, 40, 16, True, True),    # ... in both halves of Dk
    (1, 45, 2, 80, 40, 16, False, "slow"),  # ... slow enough that a chunk keeps 0.1-1 of its state (the fast ones keep e^-50: a
                                            # half's decays read for the other's passed)
])
def test_triton_states_equal_torch(B, T, N, Dk, Dv, chunk, packed, channels):
    """impl="triton" (the states' kernels, through the interpreter on CPU) against "torch":
    outputs, final state and every gradient, with an initial state."""
    xs = _inputs(B, T, N, Dk, Dv, seed=5, requires_grad=True, channels=bool(channels))
    if channels == "slow":
        xs[3] = (xs[3].detach() * 0.0125).requires_grad_()
    state0 = torch.randn(B, N, Dk, Dv, requires_grad=True)
    cu = torch.tensor([0, 9, 9, 30, T]) if packed else None
    grad_o, grad_s = torch.randn(B, T, N, Dv), torch.randn(B, N, Dk, Dv)
    results = []
    for impl in ("torch", "triton"):
        o, s = gated_delta_rule(*xs, cu, initial_state=state0, final_state=True, chunk_size=chunk, impl=impl)
        grads = torch.autograd.grad((o * grad_o).sum() + (s * grad_s).sum(), [*xs, state0])
        results.append((o, s, *grads))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_triton_states_without_a_final_state_gradient():
    """Only the outputs used (the final state's gradient is zero) and no initial state; the
    forward without autograd runs the kernel alone."""
    xs = _inputs(1, 33, 2, 16, 16, seed=6, requires_grad=True)
    grad_o = torch.randn(1, 33, 2, 16)
    ref = torch.autograd.grad((gated_delta_rule(*xs, chunk_size=16, impl="torch") * grad_o).sum(), xs)
    got = torch.autograd.grad((gated_delta_rule(*xs, chunk_size=16, impl="triton") * grad_o).sum(), xs)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(gated_delta_rule(*xs, chunk_size=16, impl="triton"), gated_delta_rule(*xs, chunk_size=16, impl="torch"))


def test_states_kernels_pass_opcheck():
    """The fmoe::delta_states registration: fake shapes, autograd, schema."""
    R, M, C, K, V = 3, 4, 8, 16, 16
    g = torch.Generator().manual_seed(7)
    w_v, w_k, k_out = (0.3 * torch.randn(R, M, C, d, generator=g) for d in (V, K, K))
    keep, state0 = torch.rand(R, M, K, generator=g), torch.randn(R, K, V, generator=g)  # keep: a factor per row of the state
    args = tuple(t.requires_grad_() for t in (w_v, w_k, k_out, keep, state0))
    torch.library.opcheck(torch.ops.fmoe.delta_states.default, args)
    torch.library.opcheck(torch.ops.fmoe.delta_states_bwd.default, (w_k.detach(), k_out.detach(), keep.detach(), torch.randn(R, M + 1, K, V, generator=g)))
    # without the rule (gated_linear_attention): w_k None
    torch.library.opcheck(torch.ops.fmoe.delta_states.default, (w_v, None, k_out, keep, state0))
    torch.library.opcheck(torch.ops.fmoe.delta_states_bwd.default, (None, k_out.detach(), keep.detach(), torch.randn(R, M + 1, K, V, generator=g)))
    # the torch path's ops under torch.compile: the same registrations, and the same values as the kernels'
    for rule in (w_k, None):
        torch.library.opcheck(torch.ops.fmoe.delta_states_ref.default, (w_v, rule, k_out, keep, state0))
        grad_states = torch.randn(R, M + 1, K, V, generator=g)
        plain = None if rule is None else rule.detach()
        torch.library.opcheck(torch.ops.fmoe.delta_states_bwd_ref.default, (plain, k_out.detach(), keep.detach(), grad_states))
        for a, b in zip(torch.ops.fmoe.delta_states_bwd_ref(plain, k_out.detach(), keep.detach(), grad_states),
                        torch.ops.fmoe.delta_states_bwd(plain, k_out.detach(), keep.detach(), grad_states)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_states_without_the_rule_equal_a_zero_w_k(impl):
    """w_k None (gated_linear_attention: the kernels' RULE False, the torch loop without the
    recall) gives the states, and the gradients of w_v, k_out, keep and state0, that a zero
    w_k gives."""
    R, M, C, K, V = 3, 4, 8, 80, 24
    g = torch.Generator().manual_seed(8)
    w_v, k_out = (0.3 * torch.randn(R, M, C, d, generator=g) for d in (V, K))
    keep, state0 = torch.rand(R, M, K, generator=g), torch.randn(R, K, V, generator=g)
    grad = torch.randn(R, M + 1, K, V, generator=g)
    results = []
    for w_k in (torch.zeros(R, M, C, K), None):
        xs = [t.clone().requires_grad_() for t in (w_v, k_out, keep, state0)]
        states = delta._states(xs[0], w_k, xs[1], xs[2], xs[3], impl)
        results.append((states, *torch.autograd.grad((states * grad).sum(), xs)))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T,docs,channels,seed,rule", [(8192, [0, 5000, 8000, 8192], False, 9, True), (4096, [0, 3000, 4096], True, 10, True),
                                                      (8192, [0, 5000, 8192], False, 11, False)], ids=["qwen3-next", "kimi-linear", "lightning"])
def test_gpu_real_shape(T, docs, channels, seed, rule):
    """On CUDA at real heads (32 heads of Dk = Dv = 128): Qwen3-Next's (a decay per head), 8192
    packed tokens in documents of 5000, 3000 and 192; Kimi Linear's (a decay per key channel),
    4096 tokens in documents of 3000 and 1096; gated linear attention (no rule: MiniMax's
    lightning attention), 8192 tokens in documents of 5000 and 3192. The kernels (impl
    "auto") against the torch states, bf16 inputs, forward and backward."""
    N, D = 32, 128
    xs = [x.cuda().bfloat16().requires_grad_() for x in _inputs(1, T, N, D, D, seed=seed, channels=channels)][:5 if rule else 4]
    cu = torch.tensor(docs, device="cuda")
    grad_o = torch.randn(1, T, N, D, device="cuda", dtype=torch.bfloat16)
    results = []
    for impl in ("auto", "torch"):
        o = (gated_delta_rule if rule else gated_linear_attention)(*xs, cu, impl=impl)
        results.append((o, *torch.autograd.grad((o.float() * grad_o.float()).sum(), xs)))
    for got, ref in zip(*results):
        assert (got.float() - ref.float()).norm() / ref.float().norm() < 1e-2


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(a, k=a["k"][..., :4]), r"k: expected shape \[1, 6, 2, 8\]"),
    (lambda a: dict(a, v=a["v"][0]), r"v: expected a 4-D tensor"),
    (lambda a: dict(a, g=a["g"][..., None]), r"g: expected shape \[1, 6, 2, 8\] \(\[B, T, N\] or \[B, T, N, Dk\] of q's B, T, N, Dk\), got \[1, 6, 2, 1\]"),
    (lambda a: dict(a, g=a["g"][:, :, 0]), r"g: expected a 3-D tensor \[B, T, N\] or \[B, T, N, Dk\], got shape \(1, 6\)"),
    (lambda a: dict(a, g=a["g"][:, :5]), r"g: expected shape \[1, 6, 2\] \(\[B, T, N\] or \[B, T, N, Dk\]"),
    (lambda a: dict(a, beta=a["beta"][:, :5]), r"beta: expected shape \[1, 6, 2\]"),
    (lambda a: dict(a, q=a["q"].long()), r"q: expected dtype"),
    (lambda a: dict(a, q=a["q"].expand(2, -1, -1, -1), k=a["k"].expand(2, -1, -1, -1), v=a["v"].expand(2, -1, -1, -1),
                    g=a["g"].expand(2, -1, -1), beta=a["beta"].expand(2, -1, -1), cu_seqlens=torch.tensor([0, 6])), r"cu_seqlens: packed documents need one batch row"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([0.0, 6.0])), r"cu_seqlens: expected dtype int"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([0])), r"cu_seqlens: expected at least 2 entries \[0, ..., T\], got 1"),
    (lambda a: dict(a, initial_state=torch.zeros(1, 2, 4, 4)), r"initial_state: expected \[1, 2, 8, 4\]"),
    (lambda a: dict(a, scale=0.0), r"scale: expected a positive number"),
    (lambda a: dict(a, chunk_size=0), r"chunk_size: expected >= 1"),
    (lambda a: dict(a, beta=None), r"beta: expected a tensor \[B, T, N\], got NoneType"),
    # every argument without its batch dim: q is named first (beta was)
    (lambda a: {n: t[0] if n != "cu_seqlens" else t for n, t in a.items()}, r"q: expected a 4-D tensor \[B, T, N, Dk\], got shape \(6, 2, 8\)"),
])
def test_bad_arguments_are_named(change, match):
    q, k, v, g, beta = _inputs(1, 6, 2, 8, 4)
    args = change(dict(q=q, k=k, v=v, g=g, beta=beta))
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(**args)


# ---------------------------------------------------------------------------- gated linear attention (no delta rule)


def test_linear_attention_worked_example():
    """One head, Dk = Dv = 1, q = k = 1, scale 1: v = (2, 4), decays (1, 0.5). t=1: S = 2,
    o = 2. t=2: S = 0.5 * 2 + 4 = 5, o = 5. A second document restarts: v = 3 -> o = 3, and
    the final state is the last document's, 3. gated_delta_rule needs its beta."""
    ones = torch.ones(1, 3, 1, 1)
    v = torch.tensor([2.0, 4.0, 3.0]).view(1, 3, 1, 1)
    g = torch.tensor([0.0, math.log(0.5), -1.0]).view(1, 3, 1)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    for fn in (gated_linear_attention_loop, gated_linear_attention):
        o, state = fn(ones, ones, v, g, cu, scale=1.0, final_state=True)
        torch.testing.assert_close(o.flatten(), torch.tensor([2.0, 5.0, 3.0]))
        torch.testing.assert_close(state.flatten(), torch.tensor([3.0]))
    for fn in (gated_delta_rule, gated_delta_rule_loop):
        with pytest.raises(ValueError, match=r"beta: expected a tensor|beta: expected a 3-D tensor"):
            fn(ones, ones, v, g, None)


@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
def test_linear_attention_loop_is_its_attention_form(channels):
    """The loop against the attention form in float64, with two documents and an initial
    state of the first: o_t = sum_{j <= t, one document} (scale q_t . (k_j exp(gamma_t - gamma_j))) v_j
    + (scale q_t exp(gamma_t)) S0 (the S0 term in the first document only), gamma the
    document's cumulative log-decays (per key channel with channels)."""
    T, N, Dk, Dv, cut = 9, 2, 3, 2, 4
    q, k, v, g, _ = _inputs(1, T, N, Dk, Dv, seed=20, channels=channels)
    state0 = torch.randn(1, N, Dk, Dv)
    cu = torch.tensor([0, cut, T])
    o = gated_linear_attention_loop(q, k, v, g, cu, scale=0.7, initial_state=state0)
    g4 = (g if channels else g[..., None].expand(1, T, N, Dk)).double()
    want = torch.zeros(1, T, N, Dv, dtype=torch.float64)
    for a, b in ((0, cut), (cut, T)):
        gamma = g4[0, a:b].cumsum(0)  # [L, N, Dk]
        for t in range(b - a):
            for j in range(t + 1):
                w = (0.7 * q[0, a + t].double() * k[0, a + j].double() * (gamma[t] - gamma[j]).exp()).sum(-1)  # [N]
                want[0, a + t] += w[:, None] * v[0, a + j].double()
            if a == 0:
                want[0, t] += torch.einsum("nk,nkv->nv", 0.7 * q[0, t].double() * gamma[t].exp(), state0[0].double())
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("channels", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("B,T,N,Dk,Dv,chunk,packed", [(2, 37, 3, 8, 5, 8, False), (1, 45, 2, 16, 8, 16, True), (1, 1, 2, 4, 4, 64, False),
                                                    (1, 45, 2, 80, 24, 16, True)])  # the last: Dk in the kernels' two halves
def test_linear_attention_chunks_equal_the_loop(B, T, N, Dk, Dv, chunk, packed, channels, impl):
    """Forward, final state and every gradient with an initial state, packed documents
    (one empty), chunks that do not divide T; the states in torch or in their Triton
    kernels (the interpreter on CPU)."""
    q, k, v, g, _ = _inputs(B, T, N, Dk, Dv, seed=21, requires_grad=True, channels=channels)
    xs = [q, k, v, g]
    state0 = torch.randn(B, N, Dk, Dv, requires_grad=True)
    cu = torch.tensor([0, 9, 9, 30, T]) if packed else None
    grad_o, grad_s = torch.randn(B, T, N, Dv), torch.randn(B, N, Dk, Dv)
    results = []
    for fn, kw in ((gated_linear_attention_loop, {}), (gated_linear_attention, dict(chunk_size=chunk, impl=impl))):
        o, s = fn(*xs, cu, initial_state=state0, final_state=True, **kw)
        grads = torch.autograd.grad((o * grad_o).sum() + (s * grad_s).sum(), [*xs, state0])
        results.append((o, s, *grads))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.detach().abs().max())))


def test_linear_attention_reads_nothing_on_the_host_and_compiles_whole():
    q, k, v, g, _ = _inputs(1, 24, 2, 8, 4, seed=22, requires_grad=True)
    xs, cu = [q, k, v, g], torch.tensor([0, 7, 24])
    with HostReads() as reads:
        o, s = gated_linear_attention(*xs, cu, final_state=True, chunk_size=8, check=False)
        torch.autograd.backward([o, s], [torch.randn_like(o), torch.randn_like(s)])
    assert reads.count == 0, reads.sites

    def step(*xs):
        o, s = gated_linear_attention(*xs, cu, final_state=True, chunk_size=8)
        return (o * 2).sum() + (s * 3).sum()

    eager = torch.autograd.grad(step(*xs), xs)
    compiled = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(*xs), xs)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(a, g=a["g"][:, :5]), r"g: expected shape \[1, 6, 2\] \(\[B, T, N\] or \[B, T, N, Dk\]"),
    (lambda a: dict(a, k=a["k"][..., :4]), r"k: expected shape \[1, 6, 2, 8\]"),
    (lambda a: dict(a, initial_state=torch.zeros(1, 2, 4, 4)), r"initial_state: expected \[1, 2, 8, 4\]"),
    (lambda a: dict(a, chunk_size=0), r"chunk_size: expected >= 1"),
])
def test_linear_attention_bad_arguments_are_named(change, match):
    q, k, v, g, _ = _inputs(1, 6, 2, 8, 4)
    with pytest.raises(ValueError, match=match):
        gated_linear_attention(**change(dict(q=q, k=k, v=v, g=g)))
