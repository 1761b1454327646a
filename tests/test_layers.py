"""fmoe.layers.moe and fmoe.model.MoE against a plain per-token loop over experts."""

import dataclasses
import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F

import fmoe.ops as ops
from fmoe.layers import MoEConfig, dense_mlp, local_experts, moe
from fmoe.model import MoE, TransformerConfig

H, FFN, FS = 32, 16, 32

CONFIGS = {
    "softmax top-2": MoEConfig(n_experts=4, k=2),
    "pre-softmax k=1": MoEConfig(n_experts=4, k=1, pre_softmax=True),
    "sigmoid groups bias shared": MoEConfig(n_experts=8, k=4, score="sigmoid", n_groups=4, topk_groups=2, scale=2.5, align=16),
    "capacity position": MoEConfig(n_experts=4, k=2, capacity_factor=0.75, capacity_policy="position"),
    "capacity probs": MoEConfig(n_experts=4, k=2, capacity_factor=0.5),
    # Llama 4: the raw sigmoid of the top-1 logit scales the expert's input
    "llama4 weights on input": MoEConfig(n_experts=4, k=1, score="sigmoid", normalize=False, weights_on_input=True),
    # the same over padded rows (align) and dropped slots (capacity): those rows get weight 0
    "weights on input capacity align": MoEConfig(n_experts=4, k=2, capacity_factor=0.5, align=16, weights_on_input=True),
    # LongCat-Flash's zero-computation experts: the router chooses among 4 experts and 2 identity experts after them
    "zero experts softmax": MoEConfig(n_experts=4, k=2, zero_experts=2),
    # ... with groups over all 6 choices, the expert bias, shared experts, and the computing experts' capacity
    "zero experts sigmoid groups bias shared capacity": MoEConfig(n_experts=4, k=3, score="sigmoid", zero_experts=2, n_groups=3, topk_groups=2,
                                                                  capacity_factor=0.75),
    "zero experts weights on input": MoEConfig(n_experts=4, k=2, score="sigmoid", normalize=False, zero_experts=1, weights_on_input=True),
    # Kolibri-1: the expert bias added to the logits to choose, the raw sigmoids as weights, a shared expert
    "bias on logits shared": MoEConfig(n_experts=8, k=3, score="sigmoid", normalize=False, bias_on_logits=True),
    # Gemma's GeGLU in the routed and the shared experts
    "geglu shared": MoEConfig(n_experts=4, k=2, glu_act="gelu_tanh"),
    # Nemotron 3's: experts without a gate (routed and shared: relu(x w_up)^2 w_down), sigmoid routing in 2 groups scored by
    # their best 2, the expert bias, the weights x 2.5
    "relu2 sigmoid groups bias shared": MoEConfig(n_experts=8, k=3, score="sigmoid", n_groups=2, topk_groups=1, group_score_topk=2, scale=2.5,
                                                  glu_act="relu2"),
    # Nemotron 3 Super's latent MoE: the routed experts over L = 12 channels between latent_in and latent_out
    "relu2 latent bias shared": MoEConfig(n_experts=8, k=3, score="sigmoid", glu_act="relu2"),
    # Muse Spark's latent MoE: the router's logits scaled, the experts' input normed (zero-centred), each expert's output
    # normed before its weight (prescaled: the gain first); and with padded rows (align) and dropped slots (capacity)
    "muse latent norms bias": MoEConfig(n_experts=8, k=3, score="sigmoid", logit_scale=0.7, norm_eps=1e-5, expert_out_norm_eps=1e-3),
    "muse latent norms capacity align": MoEConfig(n_experts=4, k=2, score="sigmoid", logit_scale=0.7, capacity_factor=0.5, align=16),
}
L = 12  # the latent MoE's channels


def _params(cfg, dtype, device, shared=False, bias=False, latent=False):
    E, He = cfg.n_experts, L if latent else H  # the routed experts' channels
    p = {
        "router": torch.randn(cfg.n_choices, H, device=device) * 0.5,
        "w_gate": torch.randn(E, He, FFN, device=device) * 0.2,
        "w_up": torch.randn(E, He, FFN, device=device) * 0.2,
        "w_down": torch.randn(E, FFN, He, device=device) * 0.2,
    }
    if latent:
        p.update(latent_in=torch.randn(H, L, device=device) * 0.3, latent_out=torch.randn(L, H, device=device) * 0.3)
    if latent and cfg.logit_scale != 1.0:  # Muse Spark's norms around the experts
        p.update(latent_norm=torch.randn(L, device=device) * 0.3, expert_out_norm=torch.randn(L, device=device) * 0.3)
    if shared:
        p.update(
            shared_w_gate=torch.randn(H, FS, device=device) * 0.2, shared_w_up=torch.randn(H, FS, device=device) * 0.2,
            shared_w_down=torch.randn(FS, H, device=device) * 0.2, shared_gate=torch.randn(H, device=device) * 0.2,
        )
    if cfg.glu_act == "relu2":  # experts without a gate
        p = {n: t for n, t in p.items() if n not in ("w_gate", "shared_w_gate")}
    p = {n: (t if n == "router" else t.to(dtype)).requires_grad_() for n, t in p.items()}
    if bias:
        p["expert_bias"] = 0.1 * torch.randn(cfg.n_choices, device=device)
    return p


def _loop_moe(x, params, cfg):
    """Each token through each of its experts, one at a time, in float32 (a zero expert's
    slot: the token times its weight). Returns the output and the routes taken (the
    computing experts' slots after the capacity drop, the zero experts' as chosen)."""
    p = {n: t.float() for n, t in params.items()}
    x = x.float()
    act = functools.partial(F.gelu, approximate="tanh") if cfg.glu_act == "gelu_tanh" else F.silu

    def mlp(x_in, w_gate, w_up, w_down):  # a GLU, or without a gate (relu2)
        h = torch.relu(x_in @ w_up).square() if w_gate is None else act(x_in @ w_gate) * (x_in @ w_up)
        return h @ w_down

    logits = x @ p["router"].T * cfg.logit_scale

    def rms(v, eps):
        return v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps)

    routes = ops.route(logits, cfg.k, score=cfg.score, pre_softmax=cfg.pre_softmax, n_groups=cfg.n_groups,
                       topk_groups=cfg.topk_groups, group_score_topk=cfg.group_score_topk, expert_bias=params.get("expert_bias"), scale=cfg.scale, normalize=cfg.normalize,
                       bias_on_logits=cfg.bias_on_logits, impl="torch")
    if cfg.capacity_factor is not None:  # over the computing experts' slots only
        zero = routes.experts >= cfg.n_experts
        computing = ops.Routes(routes.weights, torch.where(zero, -1, routes.experts))
        computing = ops.drop_by_capacity(computing, cfg.n_experts, cfg.capacity_factor, policy=cfg.capacity_policy)
        routes = ops.Routes(torch.where(zero, routes.weights, computing.weights), torch.where(zero, routes.experts, computing.experts))
    rows = []
    latent = "latent_in" in p
    x_e = x @ p["latent_in"] if latent else x  # the routed experts' input
    if "latent_norm" in p:  # zero-centred
        x_e = rms(x_e, cfg.norm_eps) * (1 + p["latent_norm"])
    out_norm = p.get("expert_out_norm")
    for t in range(x.shape[0]):
        y_t = torch.zeros(x_e.shape[1], device=x.device)
        for j in range(cfg.k):
            e = int(routes.experts[t, j])
            if e < 0:
                continue
            if e >= cfg.n_experts:  # an identity expert, whatever weights_on_input says
                y_t = y_t + routes.weights[t, j] * x[t]
                continue
            w_gate = p["w_gate"][e] if "w_gate" in p else None
            if cfg.weights_on_input:  # the weight scales what the expert sees, its output is summed as is
                y_t = y_t + mlp(routes.weights[t, j] * x_e[t], w_gate, p["w_up"][e], p["w_down"][e])
                continue
            e_out = mlp(x_e[t], w_gate, p["w_up"][e], p["w_down"][e])
            if out_norm is not None:  # the gain first, then the norm
                e_out = rms(e_out * (1 + out_norm), cfg.expert_out_norm_eps)
            y_t = y_t + routes.weights[t, j] * e_out
        if latent:  # the routed sum leaves the latent space
            y_t = y_t @ p["latent_out"]
        if "shared_w_up" in p:
            s = mlp(x[t], p.get("shared_w_gate"), p["shared_w_up"], p["shared_w_down"])
            y_t = y_t + s * torch.sigmoid(x[t] @ p["shared_gate"])
        rows.append(y_t)
    return torch.stack(rows), routes


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_matches_per_token_loop(name, dtype, impl, device):
    cfg = dataclasses.replace(CONFIGS[name], impl=impl)
    extras = dict(shared=True, bias=True) if "shared" in name else {}
    params = _params(cfg, dtype, device, latent="latent" in name, **extras)
    x = torch.randn(13, H, device=device).to(dtype).requires_grad_()
    y, stats = moe(x, params, cfg)
    assert y.dtype == dtype and y.shape == x.shape

    ref_params = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    x_ref = x.detach().clone().requires_grad_()
    y_ref, routes = _loop_moe(x_ref, ref_params, cfg)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(y, y_ref) < tol

    upstream = torch.randn_like(y_ref)
    (y.float() * upstream).sum().backward()
    (y_ref * upstream).sum().backward()
    assert _rel(x.grad, x_ref.grad) < tol
    for n, t in params.items():
        if t.requires_grad:
            # with the weights on the input, the router's gradient is x . the experts' d input,
            # which bfloat16 rounds twice (the experts' dX, then the product): a wider bound
            loose = n == "router" and cfg.weights_on_input and dtype == torch.bfloat16
            assert _rel(t.grad, ref_params[n].grad) < (3e-2 if loose else tol), n

    counts = ops.tokens_per_expert(routes.experts, cfg.n_choices)
    assert torch.equal(stats["tokens_per_expert"], counts)
    assert stats["aux_scores"].shape == (13, cfg.n_choices) and stats["aux_counts"].shape == (cfg.n_choices,)
    if cfg.zero_experts:  # both kinds of expert took slots here (a test that checks both paths)
        assert counts[:cfg.n_experts].sum() > 0 and counts[cfg.n_experts:].sum() > 0
    # the stats hold what their consumers use, nothing more
    assert sorted(stats.keys()) == ["aux_counts", "aux_experts", "aux_scores", "router_logits", "tokens_per_expert"]


def test_stats_feed_the_losses_and_bias_update(device):
    cfg = MoEConfig(n_experts=8, k=2, score="sigmoid")
    params = _params(cfg, torch.float32, device, bias=True)
    x = torch.randn(24, H, device=device)
    _, stats = moe(x, params, cfg)
    assert stats["aux_scores"].shape == (24, 8) and stats["aux_experts"].shape == (24, 2)
    sig = torch.sigmoid(stats["router_logits"].float())  # a sigmoid router balances on its own scores (SPEC 2), not a softmax
    torch.testing.assert_close(stats["aux_scores"], sig / sig.sum(-1, keepdim=True))
    torch.testing.assert_close(stats["aux_experts"].sort(-1).values, sig.topk(2, dim=-1).indices.sort(-1).values, rtol=0, atol=0)
    torch.testing.assert_close(stats["aux_counts"], ops.tokens_per_expert(stats["aux_experts"], 8))
    aux = ops.load_balancing_loss(stats["aux_scores"], stats["aux_counts"], k=2, n_tokens=24)
    seq = ops.seq_load_balancing_loss(stats["aux_scores"], stats["aux_experts"], torch.tensor([0, 10, 24]), k=2)
    (aux + seq + ops.z_loss(stats["router_logits"])).backward()
    assert params["router"].grad.abs().sum() > 0  # the losses reach the router
    new_bias = ops.update_expert_bias(params["expert_bias"], stats["tokens_per_expert"], 1e-3)
    assert not torch.equal(new_bias, params["expert_bias"])
    _, no_aux = moe(x, params, dataclasses.replace(cfg, aux_scores=False))
    assert "aux_scores" not in no_aux.keys()


@pytest.mark.parametrize("score, normalize", [("sigmoid", False), ("sigmoid", True), ("softmax", True)])
def test_hash_routing_weights_the_table_s_experts_by_the_router_s_scores(score, normalize, device):
    """A hashed layer: token t takes the experts table[token_ids[t]], weighted by its router's
    scores of them (divided by their sum with normalize): y_t = sum_j w_tj expert_j(x_t)."""
    cfg = MoEConfig(n_experts=4, k=2, score=score, normalize=normalize)
    params = _params(cfg, torch.float32, device)
    table, ids = torch.tensor([[0, 1], [2, 3], [1, 3]], device=device), torch.tensor([0, 1, 2, 0, 1, 2], device=device)
    x = torch.randn(6, H, device=device)
    y = moe(x, dict(params, hash_table=table), cfg, token_ids=ids)[0]
    logits = (x @ params["router"].T).float()
    scores = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    want = []
    for t in range(6):
        chosen = table[ids[t]]
        w = scores[t, chosen] / (scores[t, chosen].sum() if normalize else 1)
        want.append(sum(wj * (F.silu(x[t] @ params["w_gate"][e]) * (x[t] @ params["w_up"][e])) @ params["w_down"][e] for wj, e in zip(w, chosen)))
    torch.testing.assert_close(y, torch.stack(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softmax top-2", "sigmoid groups bias shared", "zero experts softmax"])
def test_padding_is_not_routed_and_the_stats_leave_it_out(name, device):
    """token_mask: the kept tokens' outputs, gradients and stats are those of a batch
    without the padding; the padding takes no expert (its output is the shared experts')."""
    cfg = CONFIGS[name]
    shared = "shared" in name
    params = _params(cfg, torch.float32, device, shared=shared, bias=shared)
    keep = torch.tensor([t % 5 != 2 and t < 15 for t in range(20)], device=device)
    x = torch.randn(20, H, device=device, requires_grad=True)
    part = x.detach()[keep].clone().requires_grad_()
    y, stats = moe(x, params, cfg, token_mask=keep)
    y_part, stats_part = moe(part, params, cfg)
    torch.testing.assert_close(y[keep], y_part, rtol=1e-5, atol=1e-6)
    pad, p = x.detach()[~keep], params
    shared_only = torch.zeros_like(pad)
    if shared:
        shared_only = (F.silu(pad @ p["shared_w_gate"]) * (pad @ p["shared_w_up"])) @ p["shared_w_down"] * torch.sigmoid(pad @ p["shared_gate"])[:, None]
    torch.testing.assert_close(y[~keep], shared_only, rtol=1e-5, atol=1e-6)
    for key in ("tokens_per_expert", "aux_counts"):
        assert torch.equal(stats[key], stats_part[key]), key
    torch.testing.assert_close(stats["aux_scores"][keep], stats_part["aux_scores"])
    assert not stats["aux_scores"][~keep].any() and (stats["aux_experts"][~keep] == -1).all()
    assert int(stats["tokens_per_expert"].sum()) == cfg.k * int(keep.sum())
    upstream = torch.randn_like(y_part)
    (y[keep] * upstream).sum().backward()
    router_grad = params["router"].grad.clone()
    params["router"].grad = None
    (y_part * upstream).sum().backward()
    torch.testing.assert_close(x.grad[keep], part.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(router_grad, params["router"].grad, rtol=1e-5, atol=1e-6)
    for bad in (keep[:10], keep.long()):
        with pytest.raises(ValueError, match=r"token_mask: expected None or a bool tensor \[20\]"):
            moe(x, params, cfg, token_mask=bad)


def test_padding_takes_no_capacity(device):
    """Padding (identical tokens, all to expert 0) first in the batch would fill expert 0's
    capacity under the "position" policy and drop the real tokens sent there; masked, it
    takes none, and each expert keeps its 2 real tokens."""
    E, k = 4, 1
    cfg = MoEConfig(n_experts=E, k=k, capacity_factor=1.0, capacity_policy="position")  # capacity 16 * 1 / 4 = 4
    params = _params(cfg, torch.float32, device)
    with torch.no_grad():
        params["router"].copy_(torch.eye(E, H, device=device) * 10)
    x = torch.zeros(16, H, device=device)
    x[:8, 0] = 1.0  # padding: expert 0
    x[8 + torch.arange(8), torch.arange(8) % E] = 1.0  # real tokens: two per expert
    keep = torch.arange(16, device=device) >= 8
    _, unmasked = moe(x, params, cfg)
    _, masked = moe(x, params, cfg, token_mask=keep)
    assert unmasked["tokens_per_expert"].tolist() == [4, 2, 2, 2]  # expert 0 full of padding
    assert masked["tokens_per_expert"].tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_tokens_give_an_empty_output_and_zero_gradients(impl, device):
    """An empty micro-batch (T = 0): y [0, H] and zero gradients with padded rows (align) and
    the weights on the input alike (weigh_rows indexed the T k = 0 weights for the padding
    rows' slot -1); the module's x [0, H] and [2, 0, H] too."""
    for align in (1, 16):
        for on_input in (False, True):
            cfg = MoEConfig(n_experts=4, k=2, align=align, weights_on_input=on_input, impl=impl)
            params = _params(cfg, torch.float32, device, shared=True)
            x = torch.zeros(0, H, device=device, requires_grad=True)
            y, stats = moe(x, params, cfg)
            assert y.shape == (0, H) and stats["tokens_per_expert"].sum() == 0
            y.sum().backward()
            assert x.grad.shape == (0, H)
            for n, t in params.items():
                assert not t.grad.any(), (align, on_input, n)
    layer = MoE(H, FFN, cfg, shared_ffn=FS, shared_gate=True).to(device)
    for shape in ((0, H), (2, 0, H)):
        y, _ = layer(torch.zeros(shape, device=device))
        assert y.shape == shape
        y.sum().backward()
        assert not layer.experts.w_up.grad.any()


def test_expert_out_norm_eps_0_keeps_a_zero_row_zero(device):
    """prescaled_rms_norm with eps 0 (expert_out_norm_eps accepts it): a zero row stays zero,
    its gradient zero, not NaN (rsqrt(0) = inf); any other row, or any eps > 0, as
    y rsqrt(mean(y^2) + eps) exactly, gradients too. The zero padding rows (align) of a MoE
    with the expert output norm made the expert weights' gradients NaN."""
    from fmoe.layers import prescaled_rms_norm

    w = torch.randn(H, device=device)
    x = torch.randn(3, H, device=device)
    x[1] = 0.0
    for eps in (0.0, 1e-6):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = prescaled_rms_norm(a, w, eps)
        v = b * (w + 1.0)
        want = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
        upstream = torch.randn_like(y)
        (y * upstream).sum().backward()
        (want * upstream).sum().backward()
        if eps == 0.0:  # the zero row: 0 * inf in the formula
            assert not y[1].any() and not a.grad[1].any()
            assert torch.equal(y[[0, 2]], want[[0, 2]]) and torch.equal(a.grad[[0, 2]], b.grad[[0, 2]])
        else:
            assert torch.equal(y, want) and torch.equal(a.grad, b.grad)
    cfg = MoEConfig(n_experts=4, k=2, align=16, expert_out_norm_eps=0.0, impl="torch")
    params = _params(cfg, torch.float32, device)
    params["expert_out_norm"] = (0.3 * torch.randn(H, device=device)).requires_grad_()
    x = torch.randn(5, H, device=device, requires_grad=True)
    y, _ = moe(x, params, cfg)
    y_ref, _ = _loop_moe(x, params, cfg)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    for n, t in {"x": x, **params}.items():
        assert t.grad.isfinite().all(), n


@pytest.mark.parametrize("score", ["softmax", "sparsemixer", "hash"])
def test_random_routing_keeps_the_router_in_the_graph(score, device):
    cfg = MoEConfig(n_experts=4, k=2, score="softmax" if score == "hash" else score, random_routing=True,
                    sparsemixer_eps=0.5 if score == "sparsemixer" else 0.01)  # a wide gap: more than one expert weighed, a gradient
    params = _params(cfg, torch.float32, device)
    kw = {}
    if score == "hash":  # the table chooses, the random logits weigh
        params["hash_table"] = torch.tensor([[0, 1], [2, 3]], device=device)
        kw = dict(token_ids=torch.arange(16, device=device) % 2)
    x = torch.randn(16, H, device=device)
    y1, _ = moe(x, params, cfg, **kw)
    y2, _ = moe(x, params, cfg, **kw)
    assert not torch.equal(y1, y2)  # fresh random routes each call
    (y1 * torch.randn_like(y1)).sum().backward()
    assert params["router"].grad.abs().sum() > 0


def test_moe_bad_inputs(device):
    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, device)
    x = torch.randn(5, H, device=device)
    with pytest.raises(ValueError, match=r"x: expected a 2-D float tensor \[T, H\], got torch.float32 \[1, 5, 32\]"):
        moe(x[None], params, cfg)
    with pytest.raises(ValueError, match=r"x: expected a 2-D float tensor \[T, H\], got torch.int64 \[5, 32\]"):  # said the shape alone
        moe(x.long(), params, cfg)
    # a misspelt name left its feature off (expert_biases: no balancing bias at all); the wrong kinds of cfg and params
    with pytest.raises(ValueError, match=r"params: unknown MoE parameters \['expert_biases'\]; expected names among \['b_down', "):
        moe(x, dict(params, expert_biases=torch.zeros(4, device=device)), cfg)
    with pytest.raises(ValueError, match="cfg: expected a MoEConfig, got dict"):
        moe(x, params, dataclasses.asdict(cfg))
    with pytest.raises(ValueError, match=r"params: expected a dict of tensors \(router, w_gate, w_up, w_down, ...\), got NoneType"):
        moe(x, None, cfg)
    for name in ("router", "router_bias", "expert_scale"):  # an AttributeError ('list' has no shape) before
        with pytest.raises(ValueError, match=rf"params\['{name}'\]: expected a tensor or None, got list"):
            moe(x, dict(params, **{name: [0.0] * 4}), cfg)
    with pytest.raises(ValueError, match=r"params\['router'\]: expected float32 \[4, 32\]"):
        moe(x, dict(params, router=torch.randn(4, H + 1, device=device)), cfg)
    with pytest.raises(ValueError, match=r"params\['w_gate'\]: expected \[4, 32, F\]"):
        moe(x, dict(params, w_gate=params["w_gate"][:, :8]), cfg)
    with pytest.raises(ValueError, match=r"params\['w_gate'\]: dtype torch.bfloat16 differs from x's torch.float32"):
        moe(x, dict(params, w_gate=params["w_gate"].bfloat16()), cfg)
    F_ = params["w_gate"].shape[2]
    with pytest.raises(ValueError, match=rf"params\['w_down'\]: expected \[4, {F_}, 32\] \(experts, FFN, hidden; FFN {F_} as params\['w_gate'\]'s\)"):
        moe(x, dict(params, w_down=params["w_down"][:, :, :8]), cfg)
    with pytest.raises(ValueError, match=rf"params\['w_up'\]: expected \[4, 32, {F_ - 1}\] \(experts, hidden, FFN; FFN {F_ - 1} as params\['w_gate'\]'s\)"):
        moe(x, dict(params, w_gate=params["w_gate"][:, :, 1:]), cfg)  # a gate of another FFN: up named against it
    with pytest.raises(ValueError, match=r"params\['w_gate'\]: experts without a gate \(cfg.glu_act one of \[.*'relu'.*\]\) take none"):
        moe(x, params, dataclasses.replace(cfg, glu_act="relu"))
    with pytest.raises(ValueError, match="align"):
        moe(x, params, dataclasses.replace(cfg, align=0))
    with pytest.raises(ValueError, match="weights_on_input: expected a bool, got 1"):
        dataclasses.replace(cfg, weights_on_input=1)
    with pytest.raises(ValueError, match="bias_on_logits: expected a bool, got 1"):
        dataclasses.replace(cfg, score="sigmoid", bias_on_logits=1)
    for name in ("pre_softmax", "random_routing", "aux_scores", "check_nan"):  # "no" would be truthy
        with pytest.raises(ValueError, match=f"{name}: expected a bool, got 'no'"):
            dataclasses.replace(cfg, **{name: "no"})
    with pytest.raises(ValueError, match="bias_on_logits: applies to score='sigmoid' only, got score='softmax'"):
        dataclasses.replace(cfg, bias_on_logits=True)
    logit_bias = dataclasses.replace(cfg, score="sigmoid", bias_on_logits=True)  # a config without the bias it moves
    with pytest.raises(ValueError, match="bias_on_logits: applies to score='sigmoid' with an expert_bias only"):
        moe(x, params, logit_bias)
    with pytest.raises(ValueError, match="params: shared experts need all of"):
        moe(x, dict(params, shared_w_gate=torch.randn(H, 8, device=device)), cfg)
    zero = dataclasses.replace(cfg, zero_experts=2)  # the router scores the 4 experts and the 2 zero experts
    with pytest.raises(ValueError, match=r"params\['router'\]: expected float32 \[6, 32\] \(cfg.n_experts \+ cfg.zero_experts"):
        moe(x, params, zero)
    with pytest.raises(ValueError, match=r"expert_bias: expected a float32 tensor of shape \(6,\)"):
        moe(x, dict(params, router=torch.randn(6, H, device=device), expert_bias=torch.zeros(4, device=device)), zero)
    with pytest.raises(ValueError, match="zero_experts: expected an int"):
        dataclasses.replace(cfg, zero_experts=1.0)
    # a latent MoE: both projections, in x's dtype, of one L
    with pytest.raises(ValueError, match=r"params\['latent_out'\]: a latent MoE needs latent_in \[H, L\] and latent_out \[L, H\] .* "
                                         r"expected \[12, 32\], got none"):
        moe(x, dict(params, latent_in=torch.randn(H, 12, device=device)), cfg)
    with pytest.raises(ValueError, match=r"params\['latent_out'\]: .* expected \[8, 32\], got torch.float32 \[12, 32\]"):  # latent_in's L
        moe(x, dict(params, latent_in=torch.randn(H, 8, device=device), latent_out=torch.randn(12, H, device=device)), cfg)
    with pytest.raises(ValueError, match="moe_latent: expected >= 1, got 0"):
        TransformerConfig(moe_latent=0)
    # Muse Spark's norms around the experts: the latent's of a latent MoE, the output's of the experts' width
    latent = dict(params, latent_in=torch.randn(H, 12, device=device), latent_out=torch.randn(12, H, device=device))
    with pytest.raises(ValueError, match=r"params\['latent_norm'\]: the norm of a latent MoE's experts' input, needs params\['latent_in'\]"):
        moe(x, dict(params, latent_norm=torch.zeros(H, device=device)), cfg)
    with pytest.raises(ValueError, match=r"params\['latent_norm'\]: expected \[12\] \(a latent MoE's \(latent_in\) experts' width\) or none, got \[32\]"):
        moe(x, dict(latent, latent_norm=torch.zeros(H, device=device)), cfg)
    with pytest.raises(ValueError, match=r"params\['expert_out_norm'\]: expected \[12\] \(the experts' output width\) or none, got \[32\]"):
        moe(x, dict(latent, expert_out_norm=torch.zeros(H, device=device)), cfg)
    for name, value in (("logit_scale", 0.0), ("expert_out_norm_eps", -1.0)):
        with pytest.raises(ValueError, match=f"{name}: expected a"):
            dataclasses.replace(cfg, **{name: value})
    with pytest.raises(ValueError, match="latent_norm: the norm of a latent MoE's experts' input, needs latent > 0"):
        MoE(H, 16, cfg, latent_norm=True)


def test_gpt_oss_moe_matches_per_token_loop():
    """A router bias, expert biases and the clamped SwiGLU: each token through its experts,
    one at a time (gpt-oss's GptOssExperts), values and every gradient."""
    cfg = MoEConfig(n_experts=4, k=2, swiglu_alpha=1.702, swiglu_limit=0.3, swiglu_offset=1.0, impl="torch")
    g = torch.Generator().manual_seed(2)
    params = _params(cfg, torch.float32, "cpu")
    params.update({n: (0.3 * torch.randn(*shape, generator=g)).requires_grad_()
                   for n, shape in (("router_bias", (4,)), ("b_gate", (4, FFN)), ("b_up", (4, FFN)), ("b_down", (4, H)))})
    x = torch.randn(9, H, generator=g)
    y, _ = moe(x, params, cfg)
    p = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    logits = x @ p["router"].T + p["router_bias"]
    top, experts = logits.topk(2, dim=-1)
    weights = torch.softmax(top, dim=-1)  # softmax over the k chosen logits
    rows = []
    for t in range(x.shape[0]):
        y_t = torch.zeros(H)
        for j in range(2):
            e = int(experts[t, j])
            gate = (x[t] @ p["w_gate"][e] + p["b_gate"][e]).clamp(max=0.3)
            up = (x[t] @ p["w_up"][e] + p["b_up"][e]).clamp(-0.3, 0.3)
            y_t = y_t + weights[t, j] * ((gate * torch.sigmoid(1.702 * gate) * (up + 1)) @ p["w_down"][e] + p["b_down"][e])
        rows.append(y_t)
    want = torch.stack(rows)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(y.shape, generator=g)
    (y * upstream).sum().backward()
    (want * upstream).sum().backward()
    for n in params:
        torch.testing.assert_close(params[n].grad, p[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match=r"params\['router_bias'\]: expected float32 \[4\] or none, got torch.bfloat16 \[4\]"):
        moe(x, dict(params, router_bias=params["router_bias"].bfloat16()), cfg)
    with pytest.raises(ValueError, match=r"params\['b_down'\]: expected torch.float32 \[4, 32\]"):
        moe(x, dict(params, b_down=params["b_gate"]), cfg)
    with pytest.raises(ValueError, match="limit: expected > 0"):
        MoEConfig(n_experts=4, k=2, swiglu_limit=-1.0)
    with pytest.raises(ValueError, match="act: expected one of silu, gelu_tanh"):
        MoEConfig(n_experts=4, k=2, glu_act="swish")
    with pytest.raises(ValueError, match=r"shared_swiglu_limit: the shared experts' clamp, limit: expected > 0 \(the SwiGLU clamp\) or None, got -1.0"):
        MoEConfig(n_experts=4, k=2, shared_swiglu_limit=-1.0)


def test_gemma4_router_reads_its_own_input_through_its_norm_and_scales_each_expert():
    """params router_norm [H] and expert_scale [E], route_x: the router reads rmsnorm(route_x)
    * router_norm / sqrt(H), the experts x; each chosen (renormalised) weight times its
    expert's scale; a per-token loop gives the same values and gradients (the scales' too);
    bad shapes are named."""
    cfg = MoEConfig(n_experts=4, k=2, glu_act="gelu_tanh", impl="torch")
    g = torch.Generator().manual_seed(3)
    params = _params(cfg, torch.float32, "cpu")
    params.update(router_norm=(1 + 0.3 * torch.randn(H, generator=g)).requires_grad_(),
                  expert_scale=(1 + 0.3 * torch.randn(4, generator=g)).requires_grad_())
    x, r = torch.randn(7, H, generator=g), torch.randn(7, H, generator=g)
    y, stats = moe(x, params, cfg, route_x=r)
    p = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    logits = (F.rms_norm(r, (H,), eps=cfg.norm_eps) * p["router_norm"] / H**0.5) @ p["router"].T
    top, experts = torch.softmax(logits, -1).topk(2, dim=-1)
    weights = top / top.sum(-1, keepdim=True) * p["expert_scale"][experts]
    want = torch.stack([sum(weights[t, j] * ((F.gelu(x[t] @ p["w_gate"][e], approximate="tanh") * (x[t] @ p["w_up"][e])) @ p["w_down"][e])
                            for j, e in enumerate(experts[t].tolist())) for t in range(7)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["router_logits"], logits, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(y.shape, generator=g)
    (y * upstream).sum().backward()
    (want * upstream).sum().backward()
    for n in params:
        torch.testing.assert_close(params[n].grad, p[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    assert params["router_norm"].grad.abs().sum() > 0 and params["expert_scale"].grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"params\['router_norm'\]: expected float32 \[32\] or none, got torch.float32 \[4\]"):
        moe(x, dict(params, router_norm=torch.ones(4)), cfg)
    with pytest.raises(ValueError, match=r"route_x: expected None or a torch.float32 tensor of x's shape \(7, 32\)"):
        moe(x, params, cfg, route_x=r[:3])


def test_sparsemixer_moe_weighs_within_its_gap_and_balances_on_the_softmax():
    """score "sparsemixer", eps 0.5, logits [1, 3, 2, 0]: the first round keeps every expert
    (expert 1 weighted softmax(l)[1]), the second all but expert 1 (expert 2 weighted by the
    softmax over [1, 2, 0]); the aux scores are the softmax over the experts; no expert bias."""
    cfg = MoEConfig(n_experts=4, k=2, score="sparsemixer", sparsemixer_eps=0.5, impl="torch")
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu").items()}
    params["router"].zero_()
    params["router"][:, 0] = torch.tensor([1.0, 3.0, 2.0, 0.0])
    x = torch.zeros(1, H)
    x[0, 0] = 1.0
    y, stats = moe(x, params, cfg)
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    w1, w2 = torch.softmax(logits, -1)[1], torch.softmax(logits[[0, 2, 3]], -1)[1]
    p = params
    want = sum(w * (F.silu(x[0] @ p["w_gate"][e]) * (x[0] @ p["w_up"][e])) @ p["w_down"][e] for w, e in ((w1, 1), (w2, 2)))
    torch.testing.assert_close(y[0], want, rtol=1e-5, atol=1e-6)
    assert stats["tokens_per_expert"].tolist() == [0, 1, 1, 0]
    torch.testing.assert_close(stats["aux_scores"], torch.softmax(logits, -1)[None])
    with pytest.raises(ValueError, match=re.escape("params['expert_bias']: sparsemixer routing takes no expert bias")):
        moe(x, dict(params, expert_bias=torch.zeros(4)), cfg)


def test_the_norms_eps_default_to_1e_6():
    """norm_eps (the latent norm's) and expert_out_norm_eps default to 1e-6: on inputs whose
    mean square is near it, the output is the loop's with both eps 1e-6."""
    cfg = MoEConfig(n_experts=4, k=2, impl="torch")
    torch.manual_seed(0)
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu", latent=True).items()}
    params["w_down"].mul_(1e-3)
    params.update(latent_norm=0.3 * torch.randn(L), expert_out_norm=0.3 * torch.randn(L))
    x = 1e-3 * torch.randn(5, H)
    y, _ = moe(x, params, cfg)
    y_ref, _ = _loop_moe(x, params, dataclasses.replace(cfg, norm_eps=1e-6, expert_out_norm_eps=1e-6))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)


def test_the_nan_check_runs_only_when_asked():
    """By default (check_nan False, no host sync) a NaN in x flows on into y; with check_nan
    the router's logits are checked and named."""
    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, "cpu")
    x = torch.randn(3, H)
    x[1, 0] = float("nan")
    y, _ = moe(x, params, cfg)
    assert y[1].isnan().any()
    with pytest.raises(ValueError, match=r"^logits: contains NaN in 1 row\(s\), first at row 1"):
        moe(x, params, dataclasses.replace(cfg, check_nan=True))


def test_moe_names_a_tensor_of_the_wrong_dtype_or_layout():
    """The routed experts' biases, the router, the shared experts, the latent projections,
    the output bias, the hash table, route_x and an experts callable's counts: each wrong one
    named as moe's own argument."""
    cfg = MoEConfig(n_experts=4, k=2)
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu", shared=True).items()}
    x = torch.randn(5, H)
    for name, value, said in (
            ("b_up", torch.zeros(4, FFN, dtype=torch.bfloat16),
             "params['b_up']: expected torch.float32 [4, 16] (experts, FFN or hidden) or none, got torch.bfloat16 [4, 16]"),
            ("router", params["router"].bfloat16(),
             "params['router']: expected float32 [4, 32] (cfg.n_experts, x's hidden size), got (4, 32) torch.bfloat16"),
            ("shared_w_up", params["shared_w_up"].bfloat16(), "params['shared_w_up']: expected torch.float32 [32, 32], got torch.bfloat16 [32, 32]"),
            ("out_bias", torch.zeros(H, dtype=torch.long),
             "params['out_bias']: expected a float [32] bias on the block's output or none, got torch.int64 [32]")):
        with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
            moe(x, dict(params, **{name: value}), cfg)
    with pytest.raises(ValueError, match=re.escape("params['latent_out']: a latent MoE needs latent_in [H, L] and latent_out [L, H] in x's "
                                                   "dtype torch.float32, expected [12, 32], got torch.bfloat16 [12, 32]")):
        moe(x, dict(params, latent_in=torch.randn(H, L), latent_out=torch.randn(L, H).bfloat16()), cfg)
    ids = torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match=re.escape("params['hash_table']: expected an int tensor [V, 2] (cfg.k experts per token id), "
                                                   "got torch.int64 [3, 3]")):
        moe(x, dict(params, hash_table=torch.zeros(3, 3, dtype=torch.long)), cfg, token_ids=ids)
    with pytest.raises(ValueError, match=re.escape("expert_bias: hash routing's experts are its table's (params['hash_table']), not with expert_bias")):
        moe(x, dict(params, hash_table=torch.zeros(3, 2, dtype=torch.long), expert_bias=torch.zeros(4)), cfg, token_ids=ids)
    with pytest.raises(ValueError, match=re.escape("route_x: expected None or a torch.float32 tensor of x's shape (5, 32), got torch.bfloat16 (5, 32)")):
        moe(x, params, cfg, route_x=x.bfloat16())
    routed = {n: params[n] for n in ("router", "w_gate", "w_up", "w_down")}
    with pytest.raises(ValueError, match=re.escape("experts: expected counts, an int tensor [4] (slots per expert), got torch.bool [4]")):
        moe(x, routed, cfg, experts=lambda xx, r: (local_experts(xx, r, routed, cfg)[0], torch.ones(4, dtype=torch.bool)))


def test_dense_mlp_biases_and_activations_match_their_formulas():
    """Each bias on its own projection; the clamped SwiGLU g sigmoid(alpha g) (u + offset) of
    the clamped g <= limit and |u| <= limit; the MLPs without a gate act(x w_up + b_up) w_down +
    b_down per act, which take no alpha or offset."""
    g = torch.Generator().manual_seed(5)
    T, F_ = 6, 8
    x = torch.randn(T, H, generator=g)
    wg, wu, wd = (0.3 * torch.randn(*shape, generator=g) for shape in ((H, F_), (H, F_), (F_, H)))
    bg, bu, bd = (0.3 * torch.randn(n, generator=g) for n in (F_, F_, H))
    gate, up = x @ wg + bg, x @ wu + bu
    torch.testing.assert_close(dense_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd), (F.silu(gate) * up) @ wd + bd, rtol=1e-5, atol=1e-6)
    gc, uc = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
    assert (gate > 0.5).any() and (up.abs() > 0.5).any()
    torch.testing.assert_close(dense_mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd, limit=0.5, alpha=1.702, offset=1.0),
                               (gc * torch.sigmoid(1.702 * gc) * (uc + 1.0)) @ wd + bd, rtol=1e-5, atol=1e-6)
    for act, fn in (("relu2", lambda u: torch.relu(u).square()), ("relu", torch.relu), ("gelu", F.gelu),
                    ("gelu_new", functools.partial(F.gelu, approximate="tanh"))):
        torch.testing.assert_close(dense_mlp(x, None, wu, wd, act=act, b_up=bu, b_down=bd), fn(up) @ wd + bd, rtol=1e-5, atol=1e-6, msg=act)
    for kw, said in ((dict(alpha=1.702), "alpha: the SwiGLU's, not of act 'relu2' (an MLP without a gate)"),
                     (dict(offset=1.0), "offset: the SwiGLU's, not of act 'relu2' (an MLP without a gate)")):
        with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
            dense_mlp(x, None, wu, wd, act="relu2", **kw)


def test_moe_shared_experts_take_their_own_knobs_and_the_output_bias():
    """The shared experts (params shared_w_*) are dense_mlp with cfg's shared_swiglu_alpha,
    shared_swiglu_offset and fp8, times sigmoid(x . shared_gate) and cfg.shared_scale, added to
    the routed experts' output; params out_bias is added last."""
    cfg = MoEConfig(n_experts=4, k=2, shared_swiglu_alpha=1.702, shared_swiglu_offset=1.0, shared_scale=0.5, impl="torch")
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu", shared=True).items()}
    routed_only = {n: params[n] for n in ("router", "w_gate", "w_up", "w_down")}
    out_bias = torch.randn(H)
    x = torch.randn(6, H)
    for fp8 in (False, True):
        c = dataclasses.replace(cfg, fp8=fp8)
        routed, _ = moe(x, routed_only, c)
        shared = dense_mlp(x, params["shared_w_gate"], params["shared_w_up"], params["shared_w_down"], alpha=1.702, offset=1.0, fp8=fp8,
                           impl="torch")
        want = routed + 0.5 * shared * torch.sigmoid(x @ params["shared_gate"])[:, None] + out_bias
        torch.testing.assert_close(moe(x, dict(params, out_bias=out_bias), c)[0], want, rtol=1e-5, atol=1e-6)


def test_a_latent_moe_s_projections_run_in_fp8_with_cfg_fp8():
    """cfg.fp8: latent_in and latent_out are fp8_matmul's, like the experts' GEMMs."""
    cfg = MoEConfig(n_experts=4, k=2, fp8=True, impl="torch")
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu", latent=True).items()}
    routed = {n: params[n] for n in ("router", "w_gate", "w_up", "w_down")}
    x = torch.randn(6, H)
    seen = []

    def experts(x_e, routes):
        out = local_experts(x_e, routes, routed, cfg)
        seen.extend((x_e, out[0]))
        return out

    y, _ = moe(x, {n: params[n] for n in ("router", "latent_in", "latent_out")}, cfg, experts=experts)
    assert torch.equal(seen[0], ops.fp8_matmul(x, params["latent_in"], impl="torch"))
    assert torch.equal(y, ops.fp8_matmul(seen[1], params["latent_out"], impl="torch"))


def test_logit_softcap_caps_the_scaled_router_logits():
    cfg = MoEConfig(n_experts=4, k=2, logit_softcap=2.0, logit_scale=3.0)
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu").items()}
    x = torch.randn(6, H)
    _, stats = moe(x, params, cfg)
    logits = x @ params["router"].T * 3.0
    assert (logits.abs() > 2.0).any()
    torch.testing.assert_close(stats["router_logits"], 2.0 * torch.tanh(logits / 2.0))


def test_hash_routing_scales_the_weights_by_cfg_scale():
    cfg = MoEConfig(n_experts=4, k=2, score="sigmoid", normalize=False, scale=2.5)
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu").items()}
    params["hash_table"] = torch.tensor([[0, 1], [2, 3], [1, 3]])
    ids, x = torch.tensor([0, 1, 2, 0, 1, 2]), torch.randn(6, H)
    y = moe(x, params, cfg, token_ids=ids)[0]
    y_unscaled = moe(x, params, dataclasses.replace(cfg, scale=None), token_ids=ids)[0]
    torch.testing.assert_close(y, 2.5 * y_unscaled)


def test_check_clip_qkv_names_a_bad_bound_and_multi_latent_attention():
    from fmoe.layers import check_clip_qkv

    check_clip_qkv(None, 16)
    check_clip_qkv(8.0, None)
    for value in (0.0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match=re.escape(f"clip_qkv: expected None or a finite number > 0, got {value!r}")):
            check_clip_qkv(value, None)
    with pytest.raises(ValueError, match=re.escape("clip_qkv: clamps grouped-query attention's q, k and v, not multi-latent attention's")):
        check_clip_qkv(8.0, 16)


def test_the_z_loss_alone_reaches_the_router_through_the_stats():
    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, "cpu")
    x = torch.randn(6, H)
    _, stats = moe(x, params, cfg)
    ops.z_loss(stats["router_logits"]).backward()
    logits = (x @ params["router"].detach().T).requires_grad_()
    ops.z_loss(logits).backward()
    torch.testing.assert_close(params["router"].grad, logits.grad.T @ x)


# ---------------------------------------------------------------------------- module


def test_module_owns_parameters_and_keeps_router_and_bias_float32():
    cfg = MoEConfig(n_experts=4, k=2, score="sigmoid")
    layer = MoE(H, FFN, cfg, shared_ffn=FS, shared_gate=True, expert_bias=True)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"router", "experts.w_gate", "experts.w_up", "experts.w_down", "shared.w_gate", "shared.w_up", "shared.w_down", "shared_gate"}
    assert "expert_bias" in layer.state_dict()
    layer.expert_bias[0] = 1.0 + 1e-3  # a step bfloat16 cannot hold next to 1.0
    router = layer.router.data.clone()
    layer.to(torch.bfloat16)
    assert layer.experts.w_gate.dtype == torch.bfloat16 and layer.shared_gate.dtype == torch.bfloat16
    assert layer.router.dtype == torch.float32 and torch.equal(layer.router.data, router)
    assert layer.expert_bias.dtype == torch.float32 and layer.expert_bias[0].item() == pytest.approx(1.0 + 1e-3, abs=1e-7)
    x = torch.randn(2, 3, H, dtype=torch.bfloat16)
    y, stats = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert stats["tokens_per_expert"].sum() == 2 * 3 * 2
    # gpt-oss's router bias stays float32 too; the expert biases follow the experts
    layer = MoE(H, FFN, MoEConfig(n_experts=4, k=2), router_bias=True, expert_biases=True).to(torch.bfloat16)
    assert layer.router_bias.dtype == torch.float32 and layer.experts.b_down.dtype == torch.bfloat16
    assert {n for n, _ in layer.named_parameters()} >= {"router_bias", "experts.b_gate", "experts.b_up", "experts.b_down"}
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in layer.named_parameters() if "b_" in n or "bias" in n)


def test_a_parametrized_router_stays_float32_when_the_module_is_cast():
    """With torch.nn.utils.parametrize on the router, .to(bfloat16) made its original bf16 (the float32 value was
    restored into the parametrization's computed tensor, and lost): the forward then refused the bf16 router. Its
    originals stay float32 now, their gradients too, and a parametrization of two originals (weight_norm's) as well."""

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 1.5 * w

    layer = MoE(H, FFN, MoEConfig(n_experts=4, k=2))
    router = layer.router.detach().clone()
    torch.nn.utils.parametrize.register_parametrization(layer, "router", Scale())
    x = torch.randn(5, H)
    layer(x)[0].sum().backward()
    layer.to(torch.bfloat16)
    original = layer.parametrizations.router.original
    assert original.dtype == torch.float32 and torch.equal(original.data, router)
    assert original.grad.dtype == torch.float32 and layer.experts.w_up.dtype == torch.bfloat16
    assert layer.router.dtype == torch.float32 and torch.equal(layer.router, 1.5 * router)
    y, stats = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and stats["tokens_per_expert"].sum() == 10

    biased = MoE(H, FFN, MoEConfig(n_experts=4, k=2, score="sigmoid"), expert_bias=True)
    with torch.no_grad():
        biased.expert_bias.fill_(1.0 + 1e-3)  # a step bfloat16 cannot hold next to 1.0
    torch.nn.utils.parametrize.register_parametrization(biased, "expert_bias", Scale())  # a buffer's original
    biased.to(torch.bfloat16)
    original = biased.parametrizations.expert_bias.original
    assert original.dtype == torch.float32 and torch.equal(original, torch.full((4,), 1.0 + 1e-3))

    normed = torch.nn.utils.parametrizations.weight_norm(MoE(H, FFN, MoEConfig(n_experts=4, k=2)), "router").to(torch.bfloat16)
    assert {n: t.dtype for n, t in normed.parametrizations.router.named_parameters()} == {"original0": torch.float32, "original1": torch.float32}
    assert normed(x.to(torch.bfloat16))[0].dtype == torch.bfloat16


def test_module_matches_the_functional_layer():
    cfg = MoEConfig(n_experts=4, k=2, score="sigmoid")
    layer = MoE(H, FFN, cfg, shared_ffn=FS, shared_gate=True, expert_bias=True)
    with torch.no_grad():
        layer.expert_bias.copy_(0.1 * torch.randn(4))
    x = torch.randn(7, H)
    params = {"router": layer.router, "w_gate": layer.experts.w_gate, "w_up": layer.experts.w_up, "w_down": layer.experts.w_down,
              "expert_bias": layer.expert_bias, "shared_w_gate": layer.shared.w_gate, "shared_w_up": layer.shared.w_up,
              "shared_w_down": layer.shared.w_down, "shared_gate": layer.shared_gate}
    y, stats = layer(x)
    y_fn, stats_fn = moe(x, params, cfg)
    torch.testing.assert_close(y, y_fn)
    assert torch.equal(stats["tokens_per_expert"], stats_fn["tokens_per_expert"])


def test_module_with_every_bias_and_router_gain_matches_the_functional_layer():
    """A module holding a router bias, expert biases, Gemma 4's router norm and expert scales and an output bias passes
    every one of them to moe, and its expert bias (x [2, 3, H] in, of x's shape out); reset_parameters starts the biases
    and the expert bias at 0 and the router norm and expert scales at 1; a cast keeps the router's tensors float32."""
    cfg = MoEConfig(n_experts=4, k=2, impl="torch")
    torch.manual_seed(0)
    layer = MoE(H, FFN, cfg, router_bias=True, expert_biases=True, router_norm=True, expert_scale=True, out_bias=True, expert_bias=True)
    names = ("router_bias", "router_norm", "expert_scale", "out_bias", "experts.b_gate", "experts.b_up", "experts.b_down")
    with torch.no_grad():
        for name in names:
            layer.get_parameter(name).copy_(1 + 0.3 * torch.randn(layer.get_parameter(name).shape))
        layer.expert_bias.copy_(0.1 * torch.randn(4))
    x = torch.randn(2, 3, H)
    params = {n.removeprefix("experts."): p for n, p in layer.named_parameters()} | {"expert_bias": layer.expert_bias}
    y, stats = layer(x)
    y_fn, stats_fn = moe(x.reshape(6, H), params, cfg)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(6, H), y_fn)
    assert torch.equal(stats["tokens_per_expert"], stats_fn["tokens_per_expert"])
    layer.reset_parameters()
    assert torch.equal(layer.expert_bias, torch.zeros(4))
    for name in names:
        p = layer.get_parameter(name)
        assert torch.equal(p, (torch.ones_like if name in ("router_norm", "expert_scale") else torch.zeros_like)(p)), name
    layer.to(torch.bfloat16)
    assert {n: layer.get_parameter(n).dtype for n in ("router", *names)} == dict(
        router=torch.float32, router_bias=torch.float32, router_norm=torch.float32, expert_scale=torch.float32, out_bias=torch.bfloat16,
        **{f"experts.{n}": torch.bfloat16 for n in ("b_gate", "b_up", "b_down")})


def test_a_latent_moe_computes_its_float32_projections_in_the_input_s_dtype():
    """A latent MoE whose experts are bf16 beside float32 latent_in / latent_out (FSDP2's mixed precision leaves the module's
    own weights so) runs its bf16 input through the projections cast to bf16, as moe does with bf16 ones."""
    cfg = MoEConfig(n_experts=4, k=2, impl="torch")
    torch.manual_seed(0)
    layer = MoE(H, FFN, cfg, latent=8)
    layer.experts.to(torch.bfloat16)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    y, _ = layer(x)
    params = {n.removeprefix("experts."): p.to(torch.bfloat16) if n.startswith("latent") else p for n, p in layer.named_parameters()}
    assert layer.latent_in.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, moe(x, params, cfg)[0], rtol=0, atol=0)


def test_shared_swiglu_limit_clamps_the_shared_experts_in_the_module_and_the_functional_layer():
    """MoEConfig.shared_swiglu_limit (Step 3.7's share_expert clamp, with glu_act "silu_cap"):
    the shared experts are min(silu(x wg), L) clamp(x wu, -L, L) wd, in the module and in
    moe's params path alike, the routed experts unclamped (swiglu_limit None); dense_mlp
    refuses a limit without a gate."""
    cfg = MoEConfig(n_experts=4, k=2, glu_act="silu_cap", shared_swiglu_limit=0.3, impl="torch")
    torch.manual_seed(0)
    layer = MoE(H, FFN, cfg, shared_ffn=FS)
    x = 4 * torch.randn(7, H)
    params = {"router": layer.router, "w_gate": layer.experts.w_gate, "w_up": layer.experts.w_up, "w_down": layer.experts.w_down,
              "shared_w_gate": layer.shared.w_gate, "shared_w_up": layer.shared.w_up, "shared_w_down": layer.shared.w_down}
    gate, up = x @ layer.shared.w_gate, x @ layer.shared.w_up
    assert (torch.nn.functional.silu(gate) > 0.3).any() and (up.abs() > 0.3).any()
    shared = (torch.nn.functional.silu(gate).clamp(max=0.3) * up.clamp(-0.3, 0.3)) @ layer.shared.w_down
    routed, _ = moe(x, {n: params[n] for n in ("router", "w_gate", "w_up", "w_down")}, dataclasses.replace(cfg, shared_swiglu_limit=None))
    y, _ = layer(x)
    y_fn, _ = moe(x, params, cfg)
    torch.testing.assert_close(y, routed + shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_fn, y)
    with pytest.raises(ValueError, match="limit: the SwiGLU's clamp, not of act 'relu2' \\(an MLP without a gate\\), got 1.0"):
        dense_mlp(x, None, params["shared_w_up"], params["shared_w_down"], act="relu2", limit=1.0)


def test_layers_name_a_weight_on_another_device_than_x():
    """moe, attention and dense_mlp check each weight's device against x's: a weight left on
    the meta device gave uninitialised memory with a CPU x (torch's matmul of the two: an
    inf among the outputs of one run), others (a bias, a gate, sinks, token_mask) a
    RuntimeError deep in torch."""
    from fmoe.layers import AttentionConfig, attention, attention_context

    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, "cpu", shared=True, bias=True)
    params.update(router_bias=torch.zeros(4), shared_gate=torch.zeros(H))
    x = torch.randn(5, H)
    for name in params:
        with pytest.raises(ValueError, match=rf"^params\['{name}'\]: expected device cpu like x, got meta \(a weight never materialised"):
            moe(x, dict(params, **{name: params[name].to("meta")}), cfg)
    with pytest.raises(ValueError, match=r"^token_mask: expected device cpu like x, got meta"):
        moe(x, params, cfg, token_mask=torch.ones(5, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match=r"^params\['router'\]: expected device meta like x, got cpu"):
        moe(x.to("meta"), params, cfg)
    acfg = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(0)
    ap = {n: 0.1 * torch.randn(*shape, generator=g) for n, shape in dict(wq=(H, 32), wk=(H, 16), wv=(H, 16), wo=(32, H), bo=(H,),
                                                                              sinks=(4,)).items()}
    ctx = attention_context(torch.tensor([0, 5]), torch.arange(5), acfg)
    assert attention(x, ap, acfg, ctx)[0].shape == (5, H)
    for name in ap:
        with pytest.raises(ValueError, match=rf"^params\['{name}'\]: expected device cpu like x, got meta"):
            attention(x, dict(ap, **{name: ap[name].to("meta")}), acfg, ctx)
    wg, wu, wd, b = torch.randn(H, 5), torch.randn(H, 5), torch.randn(5, H), torch.zeros(5)
    for i, name in enumerate(("w_gate", "w_up", "w_down")):
        args = [wg, wu, wd]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=rf"^{name}: expected device cpu like x, got meta"):
            dense_mlp(x, *args)
    with pytest.raises(ValueError, match=r"^b_up: expected device cpu like x, got meta"):
        dense_mlp(x, wg, wu, wd, b_up=b.to("meta"))


def test_moe_with_shared_expert_weights_runs_under_autocast():
    """moe with params['shared_w_*'] (no shared callable) under torch.autocast: the shared
    experts' matmuls give bf16, and moe refused its own output ("shared: expected shared(x) ->
    torch.float32 [7, 32] (x's), got torch.bfloat16"); y is in x's dtype, as with the routed
    experts alone, and near the float32 output."""
    cfg = MoEConfig(n_experts=4, k=2)
    params = {n: t.detach() for n, t in _params(cfg, torch.float32, "cpu", shared=True).items()}
    x = torch.randn(7, H)
    want, _ = moe(x, params, cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = moe(x, params, cfg)
        routed, _ = moe(x, {n: t for n, t in params.items() if not n.startswith("shared")}, cfg)
    assert got.dtype == routed.dtype == torch.float32
    assert (got - want).abs().max() < 0.03 * want.abs().max()


def test_dense_mlp_bad_inputs():
    """dense_mlp names the argument whose shape or dtype is off (the matmuls' own errors did not, and x [1, T, H]
    or a w_down [F, H + 1] ran, giving an output of another shape)."""
    T, F_ = 7, 5
    x, wg, wu, wd = torch.randn(T, H), torch.randn(H, F_), torch.randn(H, F_), torch.randn(F_, H)
    assert dense_mlp(x, wg, wu, wd).shape == (T, H) and dense_mlp(x, None, wu, wd, act="relu2").shape == (T, H)
    for args, message in (((x[None], wg, wu, wd), r"x: expected a tensor \[T, H\], got \[1, 7, 32\]"),
                          ((x[0], wg, wu, wd), r"x: expected a tensor \[T, H\], got \[32\]"),
                          ((x, torch.randn(H + 1, F_), wu, wd), r"w_gate: expected \[32, 5\] \(FFN 5 as w_up's, H 32 as x's\), got \[33, 5\]"),
                          ((x, wg, torch.randn(H + 1, F_), wd), r"w_up: expected \[32, F\] \(x's hidden size, FFN\), got \[33, 5\]"),
                          ((x, wg, wu, torch.randn(F_, H + 1)), r"w_down: expected \[5, 32\] .*, got \[5, 33\]"),
                          ((x, wg.bfloat16(), wu, wd), "w_gate: dtype torch.bfloat16 differs from x's torch.float32"),
                          ((x, None, wu, wd), "w_gate: a gated MLP's .* is required, got None")):
        with pytest.raises(ValueError, match=message):
            dense_mlp(*args)


def test_experts_and_shared_callables_are_the_one_way_in():
    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, "cpu", shared=True)
    x = torch.randn(9, H)
    y_ref, _ = moe(x, params, cfg)
    calls = {"experts": 0, "shared": 0}

    def experts(x_TH, routes):  # e.g. an expert-parallel dispatcher bound to its weights
        calls["experts"] += 1
        return local_experts(x_TH, routes, params, cfg)

    def shared(x_TH):  # e.g. a tensor-parallel module
        calls["shared"] += 1
        return dense_mlp(x_TH, params["shared_w_gate"], params["shared_w_up"], params["shared_w_down"])

    routed_only = {n: params[n] for n in ("router", "shared_gate")}
    y, stats = moe(x, routed_only, cfg, experts=experts, shared=shared)
    torch.testing.assert_close(y, y_ref)
    assert calls == {"experts": 1, "shared": 1}  # each computed once, the gate applied in moe
    # the module hands its children in: its shared experts run once per call
    layer = MoE(H, FFN, cfg, shared_ffn=FS)
    seen = []
    layer.shared.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    layer(x)
    assert seen == [(9, H)]
    with pytest.raises(ValueError, match="shared: given together with params"):
        moe(x, params, cfg, shared=shared)
    with pytest.raises(ValueError, match="experts: expected a callable"):
        moe(x, params, cfg, experts="local")
    with pytest.raises(ValueError, match="drop: expected a callable"):
        moe(x, params, cfg, drop=1)


def test_experts_and_shared_callables_outputs_are_checked():
    """What a callable of one's own returns is checked against its contract (no host read):
    a y of other rows broadcast or failed inside moe, counts of another length mislabelled
    the load (tokens_per_expert), float64 came out of a float32 layer, and a bare tensor
    failed to unpack."""
    cfg = MoEConfig(n_experts=4, k=2)
    params = _params(cfg, torch.float32, "cpu", shared=True)
    x = torch.randn(6, H)
    routed_only = {"router": params["router"]}

    def good(x_TH, routes):
        return local_experts(x_TH, routes, params, cfg)

    def shared(x_TH):
        return dense_mlp(x_TH, params["shared_w_gate"], params["shared_w_up"], params["shared_w_down"])

    assert moe(x, routed_only, cfg, experts=good, shared=shared)[0].shape == (6, H)
    for bad, said in ((lambda xx, r: good(xx, r)[0], re.escape("experts: expected experts(x, routes) -> (y, counts), got Tensor")),
                      (lambda xx, r: (*good(xx, r), None), re.escape("experts: expected experts(x, routes) -> (y, counts), got tuple of 3")),
                      (lambda xx, r: (good(xx, r)[0][:3], good(xx, r)[1]), rf"experts: expected y torch.float32 \[6, {H}\] \(its input's\), got torch.float32 \[3, {H}\]"),
                      (lambda xx, r: (good(xx, r)[0].double(), good(xx, r)[1]), "experts: expected y torch.float32 .* got torch.float64"),
                      (lambda xx, r: (good(xx, r)[0], torch.zeros(3, dtype=torch.long)), r"experts: expected counts, an int tensor \[4\] .* got torch.int64 \[3\]"),
                      (lambda xx, r: (good(xx, r)[0], good(xx, r)[1].float()), r"experts: expected counts, an int tensor \[4\]")):
        with pytest.raises(ValueError, match=f"^{said}"):
            moe(x, routed_only, cfg, experts=bad)
    with pytest.raises(ValueError, match=rf"^shared: expected shared\(x\) -> torch.float32 \[6, {H}\] \(x's\), got torch.float32 \[1, {H}\]"):
        moe(x, routed_only, cfg, experts=good, shared=lambda xx: shared(xx)[:1])
    # a shared gate names what it lacks: the shared experts, not its shape
    with pytest.raises(ValueError, match=r"^params\['shared_gate'\]: the gate of shared experts, needs them"):
        moe(x, {"router": params["router"], "shared_gate": params["shared_gate"]}, cfg, experts=good)
    with pytest.raises(ValueError, match=rf"^params\['shared_gate'\]: expected \[{H}\], got \(3,\)"):
        moe(x, {"router": params["router"], "shared_gate": torch.randn(3)}, cfg, experts=good, shared=shared)


def test_moe_capacity_drop_callable():
    """drop= replaces drop_by_capacity (sequence parallelism passes one over the whole
    micro-batch): called once with the routes and cfg's capacity, its routes are the ones
    computed; without a capacity factor it is not called."""
    torch.manual_seed(0)
    E, T = 4, 9
    x = torch.randn(T, H)
    params = {"router": torch.randn(E, H) * 0.1, "w_gate": torch.randn(E, H, FFN) * 0.1,
              "w_up": torch.randn(E, H, FFN) * 0.1, "w_down": torch.randn(E, FFN, H) * 0.1}
    cfg = MoEConfig(n_experts=E, k=2, capacity_factor=1.0, capacity_policy="position")
    calls = []

    def keep_first_expert(routes, n_experts, capacity_factor, *, policy):
        calls.append((routes.experts.shape, n_experts, capacity_factor, policy))
        keep = routes.experts == 0
        return ops.Routes(torch.where(keep, routes.weights, 0.0), torch.where(keep, routes.experts, -1))

    _, stats = moe(x, params, cfg, drop=keep_first_expert)
    assert calls == [((T, 2), E, 1.0, "position")]
    assert stats["tokens_per_expert"][1:].sum() == 0 and stats["tokens_per_expert"][0] > 0
    moe(x, params, dataclasses.replace(cfg, capacity_factor=None, capacity_policy="probs"), drop=keep_first_expert)
    assert len(calls) == 1


def test_module_bad_config():
    assert MoE(H, FFN, MoEConfig(n_experts=4, k=2), expert_bias=True).expert_bias.dtype == torch.float32  # softmax takes one too
    with pytest.raises(ValueError, match="shared_gate: needs shared experts"):
        MoE(H, FFN, MoEConfig(n_experts=4, k=2), shared_gate=True)


def test_modules_name_a_bad_size():
    """Sizes are ints >= 1 (shared_ffn >= 0, 0: none). Before, a negative one failed in
    torch.empty ("negative dimension"), a float in its TypeError, and ffn=0 built experts
    whose output is always 0 while the stats counted their slots."""
    from fmoe.model import DenseMLP, GroupedExperts

    cfg = MoEConfig(n_experts=4, k=2)
    for build, said in ((lambda: MoE(H, 0, cfg), "ffn: expected >= 1, got 0"), (lambda: MoE(-1, FFN, cfg), "hidden: expected >= 1, got -1"),
                        (lambda: MoE(H, 2.0, cfg), "ffn: expected an int, got 2.0"),
                        (lambda: MoE(H, FFN, cfg, shared_ffn=-1), "shared_ffn: expected >= 0, got -1"),
                        (lambda: DenseMLP(H, -1, "auto"), "ffn: expected >= 1, got -1"), (lambda: DenseMLP(0, FFN, "auto"), "hidden: expected >= 1, got 0"),
                        (lambda: GroupedExperts(0, H, FFN, cfg), "n_experts: expected >= 1, got 0"),
                        (lambda: GroupedExperts(4, H, 0, cfg), "ffn: expected >= 1, got 0")):
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            build()
    assert MoE(H, FFN, cfg, shared_ffn=0).shared is None


def test_moe_config_refuses_at_construction_what_moe_would_refuse_at_its_first_call():
    for kw, said in ((dict(k=0), "k: expected 1..8, got 0"), (dict(k=9), "k: expected 1..8, got 9"), (dict(k=2.0), "k: expected an int, got 2.0"),
                     (dict(score="bogus"), "score: expected one of softmax, sigmoid, sqrtsoftplus, sparsemixer, got 'bogus'"),
                     (dict(impl="bogus"), "impl: expected one of auto, triton, torch, got 'bogus'"), (dict(align=0), "align: expected >= 1, got 0"),
                     (dict(scale=-1.0), "scale: expected a positive finite number, got -1.0"),
                     (dict(n_groups=3, topk_groups=1), "n_groups: the 8 experts must split evenly into groups")):
        with pytest.raises(ValueError, match=re.escape(said)):
            MoEConfig(n_experts=8, **{"k": 2, **kw})
    with pytest.raises(ValueError, match=re.escape("n_experts: sparsemixer routing chooses 2 experts per token, expected n_experts + "
                                                   "zero_experts >= 2, got 1")):
        MoEConfig(n_experts=1, k=2, score="sparsemixer")
    assert MoEConfig(n_experts=1, k=2, zero_experts=1, score="sparsemixer").n_choices == 2
    assert MoEConfig(n_experts=8, k=10, zero_experts=2).n_choices == 10  # k counts the zero experts' choices too
    with pytest.raises(ValueError, match=re.escape("glu_act: experts with xIELU (its learned scalars) are not built")):
        MoEConfig(n_experts=4, k=2, glu_act="xielu")


def test_module_refuses_at_construction_what_moe_would_refuse_at_its_first_call():
    """The knobs of cfg that moe() refuses with the module's own arguments (its expert bias,
    its hash table), refused when the module is made, not at its first forward."""
    for cfg, kw, said in (
            (MoEConfig(n_experts=4, k=2, score="sigmoid", bias_on_logits=True), {},
             "cfg.bias_on_logits: applies to score='sigmoid' with an expert_bias only, expected expert_bias=True, got False"),
            (MoEConfig(n_experts=4, k=2, zero_experts=2), dict(hash_vocab=10),
             "cfg.zero_experts: hash routing's experts are its table's (hash_vocab), not with cfg.zero_experts"),
            (MoEConfig(n_experts=4, k=2, score="sparsemixer"), dict(hash_vocab=10),
             "cfg.score: hash routing's experts are its table's (hash_vocab), not with cfg.score"),
            (MoEConfig(n_experts=4, k=2, pre_softmax=True), dict(hash_vocab=10),
             "cfg.pre_softmax: hash routing's experts are its table's (hash_vocab), not with cfg.pre_softmax"),
            (MoEConfig(n_experts=4, k=2, score="sparsemixer"), dict(expert_bias=True),
             "expert_bias: sparsemixer routing (cfg.score='sparsemixer') takes no expert bias; set expert_bias=False"),
            (MoEConfig(n_experts=4, k=2, score="sigmoid"), dict(expert_bias=True, hash_vocab=10),
             "expert_bias: a hashed MoE's experts are its table's (hash_vocab), the bias would choose nothing; set expert_bias=False")):
        with pytest.raises(ValueError, match=re.escape(said)):
            MoE(H, FFN, cfg, **kw)
    # a hashed block of a model with the bias on the logits: its table chooses, it owns no bias (TransformerConfig.hash_layers)
    hashed = MoE(H, FFN, MoEConfig(n_experts=4, k=2, score="sigmoid", bias_on_logits=True), hash_vocab=10)
    y, _ = hashed(torch.randn(3, H), token_ids=torch.tensor([1, 2, 3]))
    assert y.shape == (3, H)
    table = MoE(H, FFN, MoEConfig(n_experts=4, k=2), hash_vocab=64).hash_table  # every expert of 0..3 drawn
    assert set(table.flatten().tolist()) == {0, 1, 2, 3} and (table[:, 0] != table[:, 1]).all()


def test_moe_config_errors_name_its_own_fields():
    """MoEConfig's SwiGLU checks name its fields (glu_act, swiglu_*), not the op's arguments
    (act, limit), as the shared_swiglu_* ones did; a TransformerConfig's name its own
    (mlp_act); capacity_policy without capacity_factor, which would do nothing, is refused
    as sparsemixer_eps without sparsemixer is; each knob out of its range is named (a negative
    count of zero experts, an infinite eps or logit scale, a zero or bool shared scale, a zero
    cap or capacity, an unknown capacity policy, a fp8 that is not a bool, fp8_fast_accum
    without fp8), and the knobs sparsemixer routing does not take."""
    for kw, said in ((dict(glu_act="tanh"), "glu_act: expected one of silu, gelu_tanh, silu_cap (the gate's activation)"),
                     (dict(glu_act="relu2", swiglu_limit=7.0), "swiglu_limit: the routed experts' clamp, alpha / limit / offset: knobs of "
                                                              "a gated MLP's activation, not of act 'relu2' (no gate), got 1.0 / 7.0 / 0.0"),
                     (dict(glu_act="relu2", swiglu_offset=1.0), "swiglu_offset: the routed experts' up's offset, alpha / limit / offset"),
                     (dict(swiglu_limit=-1.0), "swiglu_limit: the routed experts' clamp, limit: expected > 0 (the SwiGLU clamp) or None"),
                     (dict(glu_act="gelu_tanh", swiglu_alpha=1.702), "swiglu_alpha: the routed experts' gate's sigmoid gain, alpha: the slope"),
                     (dict(capacity_policy="position"), "capacity_policy: the slots the capacity drop keeps, needs capacity_factor "
                                                        "(got capacity_policy='position', capacity_factor None)"),
                     (dict(zero_experts=-1), "zero_experts: expected >= 0, got -1"),
                     (dict(norm_eps=math.inf), "norm_eps: expected a finite number >= 0, got inf"),
                     (dict(expert_out_norm_eps=math.inf), "expert_out_norm_eps: expected a finite number >= 0, got inf"),
                     (dict(logit_scale=math.inf), "logit_scale: expected a positive finite number, got inf"),
                     (dict(shared_scale=0.0), "shared_scale: expected a positive finite number, got 0.0"),
                     (dict(shared_scale=True), "shared_scale: expected a positive finite number, got True"),
                     (dict(logit_softcap=0.0), "logit_softcap: expected None or a positive finite number, got 0.0"),
                     (dict(capacity_factor=0.0), "capacity_factor: expected None or a positive finite number, got 0.0"),
                     (dict(capacity_factor=1.0, capacity_policy="bogus"), "capacity_policy: expected 'probs' or 'position', got 'bogus'"),
                     (dict(fp8="yes"), "fp8: expected a bool"),
                     (dict(fp8_fast_accum=True), "fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True"),
                     (dict(sparsemixer_eps=0.1), "sparsemixer_eps: the gap of sparsemixer routing, needs score='sparsemixer' (got score='softmax')"),
                     (dict(score="sparsemixer", k=1), "k: sparsemixer routing chooses 2 experts per token, got k=1"),
                     (dict(score="sparsemixer", normalize=False), "normalize: a knob of route, not of sparsemixer routing (score='sparsemixer'), got False"),
                     (dict(score="sparsemixer", scale=2.0), "scale: a knob of route, not of sparsemixer routing (score='sparsemixer'), got 2.0"),
                     (dict(score="sparsemixer", sparsemixer_eps=-0.1), "sparsemixer_eps: expected a finite number >= 0, got -0.1")):
        with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
            MoEConfig(**{"n_experts": 4, "k": 2, **kw})
    assert MoEConfig(n_experts=4, k=2, capacity_factor=1.0, capacity_policy="position").capacity_policy == "position"
    for kw, said in ((dict(mlp_act="relu2", swiglu_limit=7.0), "swiglu_limit: the routed experts' clamp, alpha / limit / offset"),
                     (dict(capacity_policy="position"), "capacity_policy: the slots the capacity drop keeps, needs capacity_factor")):
        with pytest.raises(ValueError, match=re.escape(said)):
            TransformerConfig(**kw)


@pytest.mark.gpu
def test_gpu_layer_at_shape_a():
    # shape A of the layer benchmark: auto (Triton + torch._grouped_mm) against the reference ops
    T, Hg, E, k, Fe = 16384, 2048, 128, 8, 768
    cfg = MoEConfig(n_experts=E, k=k)
    p = {
        "router": torch.randn(E, Hg, device="cuda") * Hg**-0.5,
        "w_gate": (torch.randn(E, Hg, Fe, device="cuda") * Hg**-0.5).bfloat16(),
        "w_up": (torch.randn(E, Hg, Fe, device="cuda") * Hg**-0.5).bfloat16(),
        "w_down": (torch.randn(E, Fe, Hg, device="cuda") * Fe**-0.5).bfloat16(),
    }
    p = {n: t.requires_grad_() for n, t in p.items()}
    x = torch.randn(T, Hg, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(T, Hg, device="cuda", dtype=torch.bfloat16)
    leaves = [x, *p.values()]
    y_auto, _ = moe(x, p, cfg)
    g_auto = torch.autograd.grad(y_auto, leaves, upstream)
    y_ref, _ = moe(x, p, dataclasses.replace(cfg, impl="torch"))
    g_ref = torch.autograd.grad(y_ref, leaves, upstream)
    assert _rel(y_auto, y_ref) < 1e-2
    for a, b in zip(g_auto, g_ref):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("kind, T, limit", [("gqa", 4096, 250), ("mla", 4096, 250), ("window", 4096, 250), ("alibi", 8192, 1200)])
def test_the_cpu_reference_attention_keeps_no_scores_per_head(kind, T, limit):
    """The reference attention (SDPA under the dense mask) at T = 4096 over 4 query heads,
    forward and backward, in a fresh process: its peak memory grows by about the mask's
    (T^2 bool and its float copy, ~80 MiB), not by float32 scores and probabilities per head
    (12 N T^2 bytes: SDPA's math path, which 3-D inputs took, 789 MiB here, 3.1 GB at T = 8192,
    and multi-latent attention's value head dim other than its query's, 785 MiB); with a sliding
    window too. ALiBi's blocked path (sinks, caps, biases: float32 scores per head, a block of
    queries at a time) at T = 8192, 4 heads: each block makes its own biases (the [N, T, S]
    biases of every query at once took it from 824 MiB to 1837)."""
    import subprocess
    import sys

    knobs = dict(gqa="n_kv_heads=2, head_dim=8", mla="n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5",
                 window="n_kv_heads=2, head_dim=8, window=256", alibi="n_kv_heads=2, head_dim=8, alibi=True")[kind]
    script = f"""
import resource, torch
torch.set_num_threads(1)
from fmoe.model import Transformer, TransformerConfig
from fmoe.train.data import make_batch
T = {T}
cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=1, n_dense=1, n_heads=4, ffn_dense=32, mtp_depth=0, {knobs})
model = Transformer(cfg)
batch = make_batch(torch.randint(0, 64, (T,)), torch.tensor([0, T // 2, T]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
losses, _ = model(batch, model.context(batch))
losses["lm_sum"].backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < limit, out.stdout  # MiB


@pytest.mark.parametrize("knobs", [dict(), dict(window=64, window_layers=(1, 2)), dict(dtype=torch.bfloat16), dict(mtp_depth=2)],
                         ids=["full", "window", "bf16", "mtp"])
def test_the_cpu_reference_attention_makes_one_float_mask_per_context(knobs, monkeypatch):
    """Every layer's SDPA call turned the context's bool [T, T] mask into a float copy of its
    own and kept it for the backward (4 T^2 bytes a layer: 256 MiB at T = 8192); the layers
    now share one per mask (and dtype), made once per context: the saved [T, T] masks of a
    4-layer model are as many as its distinct masks (the MTP depths' blocks use the trunk's),
    and the losses and gradients are the bits of the bool masks'."""
    import fmoe.layers as L
    from fmoe.model import Transformer
    from fmoe.train.data import make_batch

    dtype = knobs.pop("dtype", torch.float32)
    T = 192
    knobs.setdefault("mtp_depth", 0)
    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=4, n_dense=4, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dense=32, **knobs)
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    batch = make_batch(torch.randint(0, 64, (T,)), torch.tensor([0, 50, T]), mtp_depth=cfg.mtp_depth)

    def run():
        model.zero_grad()
        masks = set()

        def keep(t):
            if t.shape == (T, T) and t.is_floating_point():
                masks.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            losses, _ = model(batch, model.context(batch))
        sum(losses[k] for k in losses.keys() if k.endswith("_sum")).backward()
        return len(masks), torch.stack([losses[k].detach() for k in sorted(losses.keys())]), [p.grad.clone() for p in model.parameters()]

    n_masks, loss, grads = run()
    assert n_masks == (2 if "window" in knobs else 1)
    monkeypatch.setattr(L, "_additive_mask", lambda ctx, mask, dtype: mask)  # SDPA's own copy, a layer at a time
    n_before, loss_before, grads_before = run()
    assert n_before == 4 + cfg.mtp_depth
    assert torch.equal(loss, loss_before)
    for g, g_before in zip(grads, grads_before):
        assert torch.equal(g, g_before)


@pytest.mark.parametrize("knobs", [dict(attn_sinks=True), dict(attn_softcap=20.0), dict(alibi=True)], ids=["sinks", "softcap", "alibi"])
def test_the_reference_s_one_block_of_many_scores_is_recomputed_in_the_backward(knobs, monkeypatch):
    """The reference with sinks, a softcap or ALiBi's biases over one block of queries (its
    scores within fmoe.layers._SCORE_ROWS) kept that block's float32 scores and probabilities
    [N, T, S] for the backward in every layer (784 MiB a layer at 4 heads, T = 4096, with
    sinks), where past one block nothing was kept: past fmoe.layers._KEPT_SCORES scores the
    one block is recomputed too. Nothing kept is as large as the scores then, and the losses
    and gradients are the kept block's bits."""
    import fmoe.layers as L
    from fmoe.model import Transformer
    from fmoe.train.data import make_batch

    T, N = 64, 4
    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=2, n_dense=2, n_heads=N, n_kv_heads=2, head_dim=8, ffn_dense=32, **knobs)
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = make_batch(torch.randint(0, 64, (T,)), torch.tensor([0, 20, T]))
    runs = []
    for kept_scores in (None, N * T * T - 1):  # as many as the model's (kept); one fewer (recomputed)
        if kept_scores is not None:
            monkeypatch.setattr(L, "_KEPT_SCORES", kept_scores)
        model.zero_grad()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.untyped_storage().nbytes()) or t, lambda t: t):
            losses, _ = model(batch, model.context(batch))
        losses["lm_sum"].backward()
        runs.append((max(sizes), losses["lm_sum"].detach(), [p.grad.clone() for p in model.parameters()]))
    (largest_kept, loss_kept, grads_kept), (largest, loss, grads) = runs
    assert largest_kept >= 4 * N * T * T > largest
    assert torch.equal(loss, loss_kept)
    for g, g_kept in zip(grads, grads_kept):
        assert torch.equal(g, g_kept)
