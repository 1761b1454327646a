"""The ops under torch's function transforms: forward-mode AD (torch.func.jvp, forward_ad's
dual tensors), torch.func.grad and vmap, and a double backward (create_graph=True).

The kernels and the CPU's torch._grouped_mm path are custom ops with a backward alone: under
forward-mode AD torch gives them zero tangents without a word, and torch.func.grad raised
torch's "must override the setup_context staticmethod". "auto" takes the reference there,
"triton" refuses."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fmoe.ops as F
from fmoe.layers import MoEConfig
from fmoe.model import MoE
from fmoe.ops.backend import transform_of

# torch's forward-mode decompositions script themselves on first use (torch 2.13's own deprecation)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

R, H, FF, E = 9, 8, 12, 3


def _experts():
    x = torch.randn(R, H)
    weights = [torch.randn(E, H, FF) / 3, torch.randn(E, H, FF) / 3, torch.randn(E, FF, H) / 3]
    return x, weights, torch.tensor([3, 3, 8], dtype=torch.int32)  # an empty expert, a row of none


def test_transform_of_names_forward_mode_and_the_function_transforms():
    x = torch.randn(3)
    seen = {}

    def note(tag):
        def f(t):
            seen[tag] = transform_of(None, 2, t)  # not tensors: passed over
            return t * 2
        return f

    note("plain")(x)
    torch.func.jvp(note("jvp"), (x,), (torch.ones(3),))
    torch.func.grad(lambda t: note("grad")(t).sum())(x)
    torch.func.vmap(note("vmap"))(torch.randn(2, 3))
    with fwAD.dual_level():
        note("dual")(fwAD.make_dual(x, torch.ones(3)))
    assert seen["plain"] is None
    assert seen["jvp"] == seen["dual"] == "forward-mode AD (torch.func.jvp, jacfwd, forward_ad's dual tensors)"
    assert seen["grad"] == seen["vmap"] == "a torch.func transform (grad, vjp, jacrev, vmap)"


@pytest.mark.parametrize("along", ["x_perm", "w_up", "w_down"])
def test_forward_mode_ad_through_the_experts_gives_the_reference_s_tangents(along):
    """The CPU's "auto" grouped_mlp and grouped_matmul (torch._grouped_mm in a custom op) gave a tangent of zeros."""
    x, (w_gate, w_up, w_down), offsets = _experts()
    inputs = dict(x_perm=x, w_up=w_up, w_down=w_down)
    tangent = torch.randn_like(inputs[along])

    def mlp(impl):
        return lambda t: F.grouped_mlp(**{**inputs, along: t}, w_gate=w_gate, offsets=offsets, impl=impl)

    out, auto = torch.func.jvp(mlp("auto"), (inputs[along],), (tangent,))
    ref_out, ref = torch.func.jvp(mlp("torch"), (inputs[along],), (tangent,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(auto, ref)
    assert ref[:8].abs().amax() > 0.1 and (ref[8:] == 0).all()  # the row of no expert has none
    with fwAD.dual_level():  # forward_ad's dual tensors alike
        dual = mlp("auto")(fwAD.make_dual(inputs[along], tangent))
        torch.testing.assert_close(fwAD.unpack_dual(dual).tangent, ref)
    if along != "w_down":  # grouped_matmul alike (K = 8, N = 12: torch._grouped_mm's aligned rows on CPU)
        def matmul(impl):
            return lambda t: F.grouped_matmul(**{"x_perm": x, "w": w_up, along.replace("w_up", "w"): t}, offsets=offsets, impl=impl)

        _, auto = torch.func.jvp(matmul("auto"), (inputs[along],), (tangent,))
        _, ref = torch.func.jvp(matmul("torch"), (inputs[along],), (tangent,))
        torch.testing.assert_close(auto, ref)
        assert ref.abs().amax() > 0.1


def test_an_moe_layer_under_jvp_and_func_grad_matches_the_reference():
    """fmoe.model.MoE with the default impl: its jvp along the experts' weights was zero on CPU, and torch.func.grad raised."""
    layers = {impl: MoE(16, 8, MoEConfig(n_experts=4, k=2, score="sigmoid", impl=impl), shared_ffn=16) for impl in ("auto", "torch")}
    layers["torch"].load_state_dict(layers["auto"].state_dict())
    x = torch.randn(9, 16)
    params = {n: p.detach() for n, p in layers["auto"].named_parameters()}
    tangent = torch.randn_like(params["experts.w_up"])

    def out(impl):
        return lambda w: torch.func.functional_call(layers[impl], {**params, "experts.w_up": w}, (x,))[0]

    _, auto = torch.func.jvp(out("auto"), (params["experts.w_up"],), (tangent,))
    _, ref = torch.func.jvp(out("torch"), (params["experts.w_up"],), (tangent,))
    torch.testing.assert_close(auto, ref)
    assert ref.abs().amax() > 1e-3

    loss = lambda p: torch.func.functional_call(layers["auto"], p, (x,))[0].square().sum()  # noqa: E731
    grads = torch.func.grad(loss)(params)
    layers["auto"](x)[0].square().sum().backward()
    for name, p in layers["auto"].named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize("transform", ["jvp", "grad"])
def test_the_kernels_refuse_forward_mode_and_the_function_transforms(transform):
    """impl='triton' (CPU: the interpreter) under forward-mode AD gave zero tangents without a word."""
    logits, labels = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 0])
    ops = {
        "route": lambda t: F.route(t, 2, impl="triton").weights.sum(),
        "cross_entropy": lambda t: F.cross_entropy(t, labels, impl="triton"),
        "apply_rope": lambda t: F.apply_rope(t.reshape(6, 1, 5)[..., :4], *F.rope_cos_sin(torch.arange(6), F.rope_inv_freq(4)), impl="triton").sum(),
    }
    said = "forward-mode AD" if transform == "jvp" else "a torch.func transform"
    for name, op in ops.items():
        with pytest.raises(ValueError, match=f"impl='triton': the kernels have a backward alone, which {said}"):
            if transform == "jvp":
                torch.func.jvp(op, (logits,), (torch.ones_like(logits),))
            else:
                torch.func.grad(op)(logits)
        op(logits)  # outside a transform: the kernels


def test_linear_cross_entropy_s_kernels_refuse_a_double_backward():
    """A gradient penalty through the Triton linear_cross_entropy got gradients without a graph: the penalty's share of
    the weights' gradient was lost without a word. The reference's double backward is right."""
    h, w, labels = torch.randn(7, 6, requires_grad=True), torch.randn(11, 6, requires_grad=True), torch.randint(0, 11, (7,))
    with pytest.raises(RuntimeError, match=r"a double backward \(create_graph=True, a gradient penalty\) needs impl='torch'"):
        torch.autograd.grad(F.linear_cross_entropy(h, w, labels, impl="triton"), h, create_graph=True)
    (gh,) = torch.autograd.grad(F.linear_cross_entropy(h, w, labels, impl="triton"), h)  # a first-order gradient still
    (ref_gh,) = torch.autograd.grad(torch.nn.functional.cross_entropy(h @ w.T, labels), h, create_graph=True)
    torch.testing.assert_close(gh, ref_gh.detach())
    (gh,) = torch.autograd.grad(F.linear_cross_entropy(h, w, labels, impl="torch"), h, create_graph=True)
    penalty, ref_penalty = gh.square().sum(), ref_gh.square().sum()
    torch.testing.assert_close(torch.autograd.grad(penalty, w)[0], torch.autograd.grad(ref_penalty, w)[0])


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_vmap_over_route_with_its_nan_check(impl):
    """route's NaN check read values, which vmap cannot ("data-dependent control flow"): it is passed over there, as
    under torch.compile."""
    logits = torch.randn(3, 5, 4)
    mapped = torch.func.vmap(lambda t: F.route(t, 2, impl=impl).weights)(logits)
    torch.testing.assert_close(mapped, torch.stack([F.route(t, 2, impl=impl).weights for t in logits]))
    with pytest.raises(ValueError, match="NaN logits cannot be routed"):  # outside vmap it is checked
        F.route(torch.full((2, 4), float("nan")), 2, impl=impl)


@pytest.mark.gpu
def test_auto_takes_the_reference_on_cuda_under_forward_mode_ad_and_func_grad():
    """On CUDA "auto" runs the kernels, whose forward-mode tangents would be zeros: under jvp and torch.func.grad it
    takes the reference, the same tangents and gradients as impl='torch'."""
    logits, labels = torch.randn(64, 16, device="cuda"), torch.randint(0, 16, (64,), device="cuda")
    ops = {
        "route": lambda impl: lambda t: F.route(t, 4, impl=impl).weights,
        "cross_entropy": lambda impl: lambda t: F.cross_entropy(t, labels, impl=impl),
        "z_loss": lambda impl: lambda t: F.z_loss(t, impl=impl),
    }
    tangent = torch.randn_like(logits)
    for name, op in ops.items():
        _, auto = torch.func.jvp(op("auto"), (logits,), (tangent,))
        _, ref = torch.func.jvp(op("torch"), (logits,), (tangent,))
        torch.testing.assert_close(auto, ref, msg=name)
        assert ref.abs().amax() > 0, name
        loss = lambda impl: lambda t: op(impl)(t).float().square().sum()  # noqa: E731
        torch.testing.assert_close(torch.func.grad(loss("auto"))(logits), torch.func.grad(loss("torch"))(logits), msg=name)


def _plain_rms_norm(x, w, b, zero_centered, eps=1e-6):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (y * (w.float() + 1.0 if zero_centered else w.float()) + b.float()).to(x.dtype)


@pytest.mark.parametrize("eps", [1e-6, 1e-2], ids=["eps_1e-6", "eps_1e-2"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["gain", "zero_centered"])
def test_the_low_precision_rms_norm_s_double_backward_is_the_plain_form_s(zero_centered, eps):
    """rms_norm_saving_input (fmoe.model.RMSNorm's path for bf16 and float16) took its saved inverse rms as a constant
    in a double backward: a gradient penalty's gradient in x came out -0.598 against the finite difference's +15.34,
    without a word. Float64 inputs (the norm computes in float32 inside) keep bf16 rounding out of the comparison."""
    from fmoe.layers import rms_norm_saving_input

    x0, w, b = torch.randn(5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    up = torch.randn(5, 16, dtype=torch.float64)

    def penalty(norm):
        x = x0.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad((norm(x) * up).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), x)[0]

    ours = penalty(lambda x: rms_norm_saving_input(x, w, eps, zero_centered=zero_centered, bias=b))
    plain = penalty(lambda x: _plain_rms_norm(x, w, b, zero_centered, eps))
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    assert plain.abs().amax() > 1.0


def test_the_low_precision_rms_norm_under_jvp_vmap_and_func_grad():
    """A bf16 RMSNorm raised torch's "must override the setup_context staticmethod" under every torch.func transform
    (vmap alone too, so torch.func.grad of any bf16 Transformer) and "implement the jvp function" with dual tensors."""
    from fmoe.layers import rms_norm_saving_input

    for zero_centered in (False, True):
        x, w, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
        ours = lambda x, w, b: rms_norm_saving_input(x, w, 1e-6, zero_centered=zero_centered, bias=b)  # noqa: E731
        plain = lambda x, w, b: _plain_rms_norm(x, w, b, zero_centered)  # noqa: E731
        tangents = (torch.randn_like(x), torch.randn_like(w), torch.randn_like(b))
        y, dy = torch.func.jvp(ours, (x, w, b), tangents)
        ref_y, ref_dy = torch.func.jvp(plain, (x, w, b), tangents)
        assert torch.equal(y, ref_y) and torch.equal(dy, ref_dy)
        with fwAD.dual_level():
            dual = fwAD.unpack_dual(ours(fwAD.make_dual(x, tangents[0]), w, b)).tangent
        _, ref_dual = torch.func.jvp(lambda t: plain(t, w, b), (x,), (tangents[0],))
        assert torch.equal(dual, ref_dual)
        assert torch.equal(torch.func.vmap(lambda t: ours(t, w, b))(x[:, None])[:, 0], ours(x, w, b))
        grads = torch.func.grad(lambda x, w, b: ours(x, w, b).float().square().sum(), argnums=(0, 1, 2))(x, w, b)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        ours(*leaves).float().square().sum().backward()
        for g, leaf in zip(grads, leaves):
            assert torch.equal(g, leaf.grad)


def test_fp8_matmul_under_func_grad_and_vmap_and_refusing_forward_mode():
    """fp8_matmul (every impl, so every fp8=True layer) raised torch's "must override the setup_context staticmethod"
    under torch.func. grad and vmap now take it; forward-mode AD has no tangent there and says so."""
    x, w = torch.randn(4, 16), torch.randn(16, 8)
    for impl in ("auto", "torch"):
        gx, gw = torch.func.grad(lambda x, w: F.fp8_matmul(x, w, impl=impl).square().sum(), argnums=(0, 1))(x, w)
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        F.fp8_matmul(*leaves, impl=impl).square().sum().backward()
        assert torch.equal(gx, leaves[0].grad) and torch.equal(gw, leaves[1].grad)
        with pytest.warns(UserWarning, match="batching rule") if impl == "auto" else _no_warning():
            mapped = torch.func.vmap(lambda t: F.fp8_matmul(t, w, impl=impl))(x[:, None])[:, 0]
        assert torch.equal(mapped, F.fp8_matmul(x, w, impl=impl))
        with pytest.raises(ValueError, match=r"x, w: forward-mode AD .* has no tangent here: fp8_matmul's gradient"):
            torch.func.jvp(lambda t: F.fp8_matmul(t, w, impl=impl), (x,), (torch.ones_like(x),))
        with pytest.raises(ValueError, match=r"x, w: forward-mode AD .* has no tangent here"):  # w's tangent, inside grad over x
            torch.func.grad(lambda x: torch.func.jvp(lambda v: F.fp8_matmul(x, v, impl=impl), (w,), (torch.ones_like(w),))[1].sum())(x)
    grads = torch.func.grad(lambda p, layer: torch.func.functional_call(layer, p, (x,))[0].sum(), argnums=0)
    layer = MoE(16, 8, MoEConfig(n_experts=4, k=2, fp8=True), shared_ffn=16)
    assert set(grads({n: p.detach() for n, p in layer.named_parameters()}, layer)) == {n for n, _ in layer.named_parameters()}


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_vmap_over_the_counting_ops_and_per_example_routing():
    """Every op that counts tokens per expert scattered into an unbatched zeros in place, which vmap refuses
    ("scatter_add_ ... is not possible"): tokens_per_expert, the balance losses, permute, drop_by_capacity and
    group-limited routing. grouped_mlp / grouped_matmul read per-example offsets on the host. Each now equals a loop."""
    B, T, n_exp, k = 3, 6, 4, 2
    logits = torch.randn(B, T, n_exp)
    x = torch.randn(B, T, H)
    w_gate, w_up, w_down = torch.randn(n_exp, H, FF) / 3, torch.randn(n_exp, H, FF) / 3, torch.randn(n_exp, FF, H) / 3
    w = torch.randn(n_exp, H, 5)

    b_gate, b_up, b_down = torch.randn(n_exp, FF), torch.randn(n_exp, FF), torch.randn(n_exp, H)
    mask = torch.tensor([True, True, False, True, True, True])

    def chain(logits, x):
        routes = F.route(logits, k, n_groups=2, topk_groups=1)
        x_perm, plan = F.permute(x, routes.experts, n_exp, align=4)  # padded rows past each expert's: zeros
        y = F.grouped_mlp(x_perm, w_gate, w_up, w_down, plan.offsets, b_gate=b_gate, b_up=b_up, b_down=b_down)
        mm = F.grouped_matmul(x_perm, w, plan.offsets)
        scores, _ = F.aux_scores(logits, k)
        counts = F.tokens_per_expert(routes.experts, n_exp)
        return (y, mm, counts, F.load_balancing_loss(scores, counts, k=k, n_tokens=T),
                F.seq_load_balancing_loss(scores, routes.experts, torch.tensor([0, 2, T]), k=k, mask=mask),
                F.drop_by_capacity(routes, n_exp, 1.0).experts)

    mapped = torch.func.vmap(chain)(logits, x)
    looped = [torch.stack(outs) for outs in zip(*(chain(logits[b], x[b]) for b in range(B)))]
    assert len(mapped) == len(looped) == 6
    for name, m, loop in zip(["grouped_mlp", "grouped_matmul", "tokens_per_expert", "load_balancing_loss", "seq_load_balancing_loss",
                              "drop_by_capacity"], mapped, looped):
        torch.testing.assert_close(m, loop, msg=name)
    assert not torch.equal(looped[2][0], looped[2][1]) or not torch.equal(looped[2][1], looped[2][2])  # the examples route apart


def test_per_example_gradients_and_an_ensemble_of_moe_layers_under_vmap():
    """vmap(grad) for per-example gradients and a stack_module_state ensemble of MoE layers raised at permute."""
    from copy import deepcopy

    torch.manual_seed(0)
    layers = [MoE(16, 8, MoEConfig(n_experts=4, k=2)) for _ in range(3)]
    params, buffers = torch.func.stack_module_state(layers)
    base = deepcopy(layers[0]).to("meta")
    x = torch.randn(6, 16)
    ensemble = torch.func.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,))[0])(params, buffers)
    torch.testing.assert_close(ensemble, torch.stack([layer(x)[0] for layer in layers]))

    layer = layers[0]
    own = {n: p.detach() for n, p in layer.named_parameters()}
    loss = lambda p, t: torch.func.functional_call(layer, p, (t[None],))[0].square().sum()  # noqa: E731
    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(own, x)
    for i in (0, 5):
        layer.zero_grad()
        layer(x[i : i + 1])[0].square().sum().backward()
        for name, p in layer.named_parameters():
            torch.testing.assert_close(per_example[name][i], p.grad, msg=f"{name}, example {i}")
