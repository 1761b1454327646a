"""fmoe.optim.muon: Newton-Schulz against the SVD polar factor, Muon's step against a hand
computation, the Muon/AdamW split of a model, and a falling loss."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fmoe.layers import MoEConfig
from fmoe.model import MoE
from fmoe.optim.muon import ADAMW_PATTERNS, Muon, build_optimizers, newton_schulz, shape_scale, split_param_groups

DTYPES = [torch.float32, torch.bfloat16]


def _with_spectrum(batch, m, n, smallest, generator):
    """A matrix (or batch) U diag(s) V^T with singular values from `smallest` to 1."""
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, r, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, r, generator=generator))
    s = torch.logspace(math.log10(smallest), 0, r)
    return U, s, V, U @ torch.diag(s) @ V.mT


def _cosine(a, b):
    return (a * b).sum((-2, -1)) / (a.norm(dim=(-2, -1)) * b.norm(dim=(-2, -1)))


# -----------------------------------------------------------------------------
# newton_schulz

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (4, 24, 40)], ids=["tall", "wide", "batch"])
def test_newton_schulz_random_matrix_is_near_polar_factor(shape, dtype):
    G = 3.0 * torch.randn(shape, generator=torch.Generator().manual_seed(0))
    O = newton_schulz(G, dtype=dtype)
    assert O.dtype == G.dtype and O.shape == G.shape
    # the quintic's coefficients trade exactness for speed: singular values end in ~[0.68, 1.14]
    sv = torch.linalg.svdvals(O)
    assert sv.min() > 0.6 and sv.max() < 1.2, (sv.min(), sv.max())
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert _cosine(O, U @ Vh).min() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
def test_newton_schulz_square_keeps_singular_vectors(dtype):
    # a random square matrix can have a singular value too small for 5 steps to lift (its
    # image stays near 0, harmlessly), so the spectrum is set: from 1e-2 to 1, times 5
    U, s, V, G = _with_spectrum((), 32, 32, 1e-2, torch.Generator().manual_seed(1))
    O = newton_schulz(5.0 * G, dtype=dtype)
    # an odd matrix polynomial: O = U p(S) V^T with the same U and V
    inner = U.mT @ O @ V
    diag = torch.diagonal(inner)
    assert (inner - torch.diag(diag)).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)
    assert diag.min() > 0.5 and diag.max() < 1.5, diag
    assert _cosine(O, U @ V.mT) > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
def test_newton_schulz_orthogonalises_each_matrix_of_a_stack_on_its_own(dtype):
    g = torch.Generator().manual_seed(2)
    G = torch.randn(4, 24, 40, generator=g) * torch.tensor([1e-3, 1.0, 10.0, 1e3]).view(4, 1, 1)
    O = newton_schulz(G, dtype=dtype)
    for e in range(4):
        torch.testing.assert_close(O[e], newton_schulz(G[e], dtype=dtype), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_newton_schulz_rejects_bad_arguments():
    with pytest.raises(ValueError, match="G"):
        newton_schulz(torch.randn(8))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.randn(4, 4), steps=0)


def test_shape_scale():
    assert shape_scale(torch.Size([3, 5]), "moonlight") == pytest.approx(0.2 * math.sqrt(5))
    assert shape_scale(torch.Size([4, 5, 3]), "moonlight") == pytest.approx(0.2 * math.sqrt(5))
    assert shape_scale(torch.Size([3, 5]), "spectral") == 1.0
    assert shape_scale(torch.Size([4, 5, 3]), "spectral") == pytest.approx(math.sqrt(5 / 3))


# -----------------------------------------------------------------------------
# Muon's step

@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale", ["moonlight", "spectral"])
def test_step_matches_hand_computation(nesterov, scale):
    g = torch.Generator().manual_seed(3)
    W0, S0 = torch.randn(3, 5, generator=g), torch.randn(2, 5, 3, generator=g)
    grads = [(torch.randn(3, 5, generator=g), torch.randn(2, 5, 3, generator=g)) for _ in range(3)]
    lr, mu, wd = 0.1, 0.9, 0.5
    W, S = W0.clone().requires_grad_(), S0.clone().requires_grad_()
    opt = Muon([W, S], lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd, scale=scale)
    expected = {"W": W0.clone(), "S": S0.clone()}
    bufs = {"W": torch.zeros(3, 5), "S": torch.zeros(2, 5, 3)}
    for gW, gS in grads:
        W.grad, S.grad = gW.clone(), gS.clone()
        opt.step()
        for name, grad in (("W", gW), ("S", gS)):
            bufs[name] = mu * bufs[name] + grad
            direction = grad + mu * bufs[name] if nesterov else bufs[name]
            s = {"moonlight": 0.2 * 5 ** 0.5, "spectral": 1.0 if name == "W" else (5 / 3) ** 0.5}[scale]
            expected[name] = expected[name] * (1 - lr * wd) - lr * s * newton_schulz(direction)
        torch.testing.assert_close(W.detach(), expected["W"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(S.detach(), expected["S"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[W]["momentum_buffer"], bufs["W"])


def test_newton_schulz_is_the_quintic_iteration_with_its_coefficients():
    """Each step X <- a X + (b A + c A^2) X, A = X X^T, from X = G / (||G||_F + eps), on the wide side
    (a tall G's transpose): (a, b, c) = (3.4445, -4.7750, 2.0315), modded-nanogpt's, computed here in float64."""
    g = torch.Generator().manual_seed(5)
    for shape in ((4, 7), (7, 4), (2, 5, 5)):
        G = torch.randn(*shape, generator=g, dtype=torch.float64)
        for steps in (1, 3):
            X = G.mT if shape[-2] > shape[-1] else G
            X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
            for _ in range(steps):
                A = X @ X.mT
                X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
            want = X.mT if shape[-2] > shape[-1] else X
            torch.testing.assert_close(newton_schulz(G, steps=steps, dtype=torch.float64), want, rtol=1e-12, atol=1e-12)


def test_step_takes_the_group_s_ns_steps_and_ns_dtype():
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))
    for steps, dtype in ((1, torch.float32), (2, torch.float64), (5, torch.bfloat16)):
        W = torch.zeros(5, 3, requires_grad=True)
        W.grad = grad.clone()
        Muon([W], lr=0.1, momentum=0.0, ns_steps=steps, ns_dtype=dtype).step()
        torch.testing.assert_close(W.detach(), -0.1 * 0.2 * 5 ** 0.5 * newton_schulz(grad, steps=steps, dtype=dtype), rtol=0, atol=0)


def _run(nesterov, grads):
    W = torch.zeros(6, 4, requires_grad=True)
    opt = Muon([W], lr=0.1, momentum=0.9, nesterov=nesterov, ns_dtype=torch.float32)
    out = []
    for grad in grads:
        W.grad = grad.clone()
        opt.step()
        out.append(W.detach().clone())
    return out


def test_nesterov_changes_only_later_steps():
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(6, 4, generator=g) for _ in range(2)]
    on, off = _run(True, grads), _run(False, grads)
    # step 1: the directions are (1 + mu) g and g, the same after normalisation
    torch.testing.assert_close(on[0], off[0], rtol=0, atol=1e-6)
    # step 2: g2 + mu (mu g1 + g2) against mu g1 + g2
    assert (on[1] - off[1]).abs().max() > 1e-2


def test_weight_decay_is_decoupled_and_update_ignores_gradient_scale():
    W0 = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    W = W0.clone().requires_grad_()
    opt = Muon([W], lr=0.1, weight_decay=0.3)
    W.grad = torch.zeros_like(W)  # NS(0) = 0: only the decay acts
    opt.step()
    torch.testing.assert_close(W.detach(), W0 * (1 - 0.1 * 0.3), rtol=0, atol=0)
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(6))
    results = []
    for factor in (1e-3, 1e3):  # the decay does not grow with the gradient, nor the update
        V = W0.clone().requires_grad_()
        opt = Muon([V], lr=0.1, weight_decay=0.3, ns_dtype=torch.float32)
        V.grad = factor * grad
        opt.step()
        results.append(V.detach())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["Muon", "DistributedMuon"])
def test_closure_and_params_without_grad(optimizer):
    """step(closure) runs the closure with grad enabled and returns its loss; B, which the
    loss does not reach (grad None), keeps its value and gets no momentum; A steps exactly
    as a Muon over A alone given the same gradient (DistributedMuon in one process too)."""
    from fmoe.parallel import DistributedMuon

    g = torch.Generator().manual_seed(7)
    A0, B0, target = torch.randn(4, 6, generator=g), torch.randn(2, 4, 6, generator=g), torch.randn(4, 6, generator=g)
    A, B = A0.clone().requires_grad_(), B0.clone().requires_grad_()
    opt = dict(Muon=Muon, DistributedMuon=DistributedMuon)[optimizer]([A, B], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = ((A - target) ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.requires_grad and float(loss.detach()) == float(((A0 - target) ** 2).sum())
    assert torch.equal(B.detach(), B0) and B not in opt.state and B.grad is None
    reference = A0.clone().requires_grad_()
    reference.grad = 2 * (A0 - target)
    Muon([reference], lr=0.1).step()
    assert torch.equal(A.detach(), reference.detach())
    assert torch.equal(opt.state[A]["momentum_buffer"], reference.grad)
    assert opt.step() is None  # no closure: no loss


def test_state_dict_round_trip_continues_bit_identically():
    g = torch.Generator().manual_seed(8)
    grads = [(torch.randn(5, 3, generator=g), torch.randn(2, 3, 4, generator=g)) for _ in range(4)]
    params = [torch.randn(5, 3, generator=g).requires_grad_(), torch.randn(2, 3, 4, generator=g).requires_grad_()]
    opt = Muon([{"params": params[:1]}, {"params": params[1:], "lr": 0.05, "scale": "spectral"}], lr=0.1, weight_decay=0.1)

    def step(opt, params, grad_pair):
        for p, grad in zip(params, grad_pair):
            p.grad = grad.clone()
        opt.step()

    for grad_pair in grads[:2]:
        step(opt, params, grad_pair)
    saved = copy.deepcopy(opt.state_dict())
    clones = [p.detach().clone().requires_grad_() for p in params]
    resumed = Muon([{"params": clones[:1]}, {"params": clones[1:]}], lr=1.0, scale="moonlight")
    resumed.load_state_dict(saved)
    assert resumed.param_groups[1]["lr"] == 0.05 and resumed.param_groups[1]["scale"] == "spectral"
    for grad_pair in grads[2:]:
        step(opt, params, grad_pair)
        step(resumed, clones, grad_pair)
    for p, q in zip(params, clones):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(lr=-1.0), "lr"), (dict(lr=float("nan")), "lr"), (dict(momentum=1.0), "momentum"),
     (dict(momentum=-0.1), "momentum"), (dict(weight_decay=-0.1), "weight_decay"),
     (dict(weight_decay=float("nan")), "weight_decay"), (dict(ns_steps=0), "ns_steps"), (dict(ns_steps=2.5), "ns_steps"),
     (dict(scale="rms"), "scale"),
     # accepted: int32 failed only at the first step, "no" stepped as nesterov=True
     (dict(ns_dtype=torch.int32), "ns_dtype"), (dict(ns_dtype="bfloat16"), "ns_dtype"), (dict(nesterov="no"), "nesterov"),
     (dict(nesterov=1), "nesterov")],
)
def test_bad_hyperparameters_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Muon([torch.zeros(3, 3, requires_grad=True)], **kwargs)
    with pytest.raises(ValueError, match=name):  # the same check for a param group's override
        Muon([{"params": [torch.zeros(3, 3, requires_grad=True)], **kwargs}])


def test_a_parameter_twice_is_refused():
    """Muon([p, p]) updated p twice per step (torch only warns); DistributedMuon refused it."""
    p, q = torch.zeros(3, 4, requires_grad=True), torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(3, 4\) appears twice"):
        Muon([p, q, p])
    opt = Muon([p])
    with pytest.raises(ValueError, match="^params: a parameter of shape .* appears twice"):  # in a group added later
        opt.add_param_group({"params": [q, p]})
    assert len(opt.param_groups) == 1


def test_vectors_are_refused():
    with pytest.raises(ValueError, match="params.*AdamW"):
        Muon([torch.zeros(3, 3, requires_grad=True), torch.zeros(3, requires_grad=True)])


# -----------------------------------------------------------------------------
# Splitting a model between Muon and AdamW

def _ids(groups):
    return [{id(p) for p in group["params"]} for group in groups]


def test_split_param_groups_moe():
    model = MoE(32, 16, MoEConfig(n_experts=4, k=2, score="sigmoid"), shared_ffn=32, shared_gate=True, expert_bias=True)
    muon, adamw = split_param_groups(model, muon_lr=0.02, adamw_lr=1e-3, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    assert muon_ids == {id(getattr(part, n)) for part in (model.experts, model.shared) for n in ("w_gate", "w_up", "w_down")}
    assert decay_ids == {id(model.router)}
    assert no_decay_ids == {id(model.shared_gate)}  # 1-D
    assert id(model.expert_bias) not in muon_ids | decay_ids | no_decay_ids  # a buffer
    assert muon[0]["lr"] == 0.02 and muon[0]["weight_decay"] == 0.1
    assert [g["lr"] for g in adamw] == [1e-3, 1e-3] and [g["weight_decay"] for g in adamw] == [0.1, 0.0]


def test_split_param_groups_keeps_bias_stacks_out_of_muon():
    """gpt-oss's experts: b_gate, b_up [E, F] and b_down [E, H] are 2-D, but one bias per
    expert, not an operator: AdamW without weight decay, like the router bias."""
    model = MoE(32, 16, MoEConfig(n_experts=4, k=2, score="softmax"), router_bias=True, expert_biases=True)
    muon, adamw = split_param_groups(model, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    experts = model.experts
    assert muon_ids == {id(experts.w_gate), id(experts.w_up), id(experts.w_down)}
    assert decay_ids == {id(model.router)}
    assert no_decay_ids == {id(model.router_bias), id(experts.b_gate), id(experts.b_up), id(experts.b_down)}


def test_split_param_groups_gives_a_bias_of_any_shape_no_decay():
    """Compressed attention's compress_bias [m, D] (and its indexer's) is a bias by place in a
    run: it went to AdamW through the "bias" pattern but with weight decay, where every other
    bias has none; now no decay, and never Muon, whatever the patterns."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.compress_bias = torch.nn.Parameter(torch.zeros(4, 16))
            self.index_compress_bias = torch.nn.Parameter(torch.zeros(4, 8))
            self.wq = torch.nn.Parameter(torch.zeros(16, 16))

    model = torch.nn.ModuleDict({"attn": Attn(), "proj": torch.nn.Linear(8, 8)})
    for patterns in (ADAMW_PATTERNS, ()):
        muon, adamw = split_param_groups(model, weight_decay=0.1, adamw_patterns=patterns)
        assert [(g["weight_decay"], {id(p) for p in g["params"]}) for g in muon] == [(0.1, {id(model["attn"].wq), id(model["proj"].weight)})]
        assert [(g["weight_decay"], {id(p) for p in g["params"]}) for g in adamw] == [
            (0.0, {id(model["attn"].compress_bias), id(model["attn"].index_compress_bias), id(model["proj"].bias)})]


def test_split_param_groups_keeps_linear_attention_taps_out_of_muon():
    """A Gated DeltaNet block's conv taps [K, C] are a filter per channel, not an operator:
    AdamW with weight decay; its projections go to Muon, A_log, dt_bias, out_norm to AdamW
    without decay."""
    from fmoe.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=20, hidden=16, n_layers=2, n_dense=2, ffn_dense=16, n_heads=2, n_kv_heads=1, head_dim=8,
                                          linear_layers=(0,), linear_k_heads=1, linear_v_heads=2, linear_k_dim=4, linear_v_dim=4))
    muon, adamw = split_param_groups(model, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    attn = model.blocks[0].attn
    assert {id(getattr(attn, n)) for n in ("conv_q", "conv_k", "conv_v")} <= decay_ids
    assert {id(getattr(attn, n)) for n in ("wq", "wk", "wv", "wz", "wb", "wa", "wo")} <= muon_ids
    assert {id(getattr(attn, n)) for n in ("A_log", "dt_bias", "out_norm")} <= no_decay_ids


def test_split_param_groups_sends_torch_convolutions_to_adamw():
    """A torch.nn convolution's weight [out, in, *kernel] is filters, which Muon would take as
    a batch of kernel-sized matrices: AdamW, decayed (its bias undecayed); a Linear's weight
    and a 3-D stack of one's own stay in Muon."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv2 = torch.nn.Conv2d(8, 16, 3)
            self.conv1 = torch.nn.Conv1d(8, 16, 5, bias=False)
            self.up = torch.nn.ConvTranspose1d(4, 4, 2)
            self.lazy = torch.nn.LazyConv2d(4, 3)
            self.proj = torch.nn.Linear(8, 16)
            self.stack = torch.nn.Parameter(torch.randn(4, 8, 8))

    net = Net()
    net.lazy(torch.zeros(1, 2, 5, 5))  # its shapes, once it has seen an input
    muon, adamw = split_param_groups(net, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    assert muon_ids == {id(net.proj.weight), id(net.stack)}
    assert decay_ids == {id(m.weight) for m in (net.conv2, net.conv1, net.up, net.lazy)}
    assert {id(net.conv2.bias), id(net.up.bias), id(net.proj.bias)} <= no_decay_ids


def test_split_param_groups_knows_torch_embeddings_by_type():
    """An nn.Embedding of one's own named `wte` (or an EmbeddingBag `tok`) went to Muon by its name and was decayed
    with decay_embeddings=False; it is a lookup whatever its name: AdamW, undecayed when asked."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(10, 8)
            self.tok = torch.nn.EmbeddingBag(10, 8)
            self.proj = torch.nn.Linear(8, 8)

    net = Net()
    for decay in (True, False):
        muon, adamw = split_param_groups(net, weight_decay=0.1, decay_embeddings=decay)
        (muon_ids,), by_decay = _ids(muon), {group["weight_decay"]: {id(p) for p in group["params"]} for group in adamw}
        lookups = {id(net.wte.weight), id(net.tok.weight)}
        assert muon_ids == {id(net.proj.weight)}
        assert lookups <= by_decay[0.1 if decay else 0.0] and id(net.proj.bias) in by_decay[0.0]


@pytest.mark.parametrize("qk_norm, bias", [("head_layer", False), ("head_layer", True), ("layer", True)])
def test_split_param_groups_keeps_per_head_qk_norms_out_of_muon_and_decay(qk_norm, bias):
    """The q/k LayerNorms' weights (and biases) per head [heads, D] (Cohere's, Chameleon's) or
    shared [D] (Persimmon's) are norms, not operators: AdamW without weight decay, as every
    other norm; the projections go to Muon."""
    from fmoe.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=20, hidden=16, n_layers=2, n_dense=2, ffn_dense=16, n_heads=2, n_kv_heads=1, head_dim=8,
                                          qk_norm=qk_norm, qk_norm_bias=bias, layer_norms=True))
    muon, adamw = split_param_groups(model, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    attn = model.blocks[0].attn
    norms = ("q_norm", "k_norm") + (("q_norm_bias", "k_norm_bias") if bias else ())
    assert {getattr(attn, n).ndim for n in norms} == {2 if qk_norm == "head_layer" else 1}
    assert {id(getattr(attn, n)) for n in norms} <= no_decay_ids
    assert {id(getattr(attn, n)) for n in ("wq", "wk", "wv", "wo")} <= muon_ids


def test_split_param_groups_keeps_mamba1_s_log_decays_out_of_muon_and_decay():
    """Mamba-1's A_log [C, N] is a vector of log-decays per channel, not an operator: AdamW
    without weight decay (as Mamba's own no_weight_decay), beside its projections in Muon."""
    from fmoe.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=20, hidden=16, n_layers=2, n_dense=2, ffn_dense=16, n_heads=2, n_kv_heads=1, head_dim=8,
                                          linear_layers=(0,), linear_kind="mamba1", linear_k_heads=1, linear_v_heads=32, linear_k_dim=4,
                                          linear_v_dim=1))
    muon, adamw = split_param_groups(model, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    attn = model.blocks[0].attn
    assert {id(getattr(attn, n)) for n in ("A_log", "D", "dt_bias", "conv_v_bias")} <= no_decay_ids
    assert {id(getattr(attn, n)) for n in ("wv", "wz", "wdt", "wk", "wq", "wa", "wo")} <= muon_ids
    assert id(attn.conv_v) in decay_ids


def test_split_param_groups_keeps_hyper_connection_weights_out_of_muon():
    """Hyper-connections' weights decide each token's mixing of the streams, as the router
    decides its experts: fn [M, n H] (and the head's) to AdamW with weight decay, base and
    scale without; the blocks' projections stay Muon's."""
    from fmoe.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=20, hidden=16, n_layers=2, n_dense=2, ffn_dense=16, n_heads=2, n_kv_heads=1, head_dim=8,
                                          hyper_connections=2))
    muon, adamw = split_param_groups(model, weight_decay=0.1)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    hcs = [model.hc_head] + [getattr(b, n) for b in model.blocks for n in ("attn_hc", "mlp_hc")]
    assert {id(hc.fn) for hc in hcs} <= decay_ids and {id(p) for hc in hcs for p in (hc.base, hc.scale)} <= no_decay_ids
    assert {id(model.blocks[0].attn.wq), id(model.blocks[1].mlp.w_down)} <= muon_ids


def test_split_param_groups_by_name_pattern():
    model = nn.ModuleDict(dict(
        embed=nn.Embedding(10, 8), proj=nn.Linear(8, 8), norm=nn.LayerNorm(8), lm_head=nn.Linear(8, 10, bias=False),
    ))
    model.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
    muon, adamw = split_param_groups(model)
    (muon_ids,), (decay_ids, no_decay_ids) = _ids(muon), _ids(adamw)
    assert muon_ids == {id(model["proj"].weight)}
    assert decay_ids == {id(model["embed"].weight), id(model["lm_head"].weight)}
    assert no_decay_ids == {id(model["proj"].bias), id(model["norm"].weight), id(model["norm"].bias)}
    muon, adamw = split_param_groups(model, adamw_patterns=("embed",))
    assert _ids(muon)[0] == {id(model["proj"].weight), id(model["lm_head"].weight)}


def test_build_optimizers_builds_muon_by_muon_cls_and_leaves_out_an_empty_side():
    """muon_cls (DistributedMuon for a sharded model) gets the matrices' groups, lr and muon_kwargs; a model with nothing
    for one side gets no optimizer for it, and a frozen one none at all (a pipeline stage --train_only leaves out)."""
    model = nn.ModuleDict(dict(proj=nn.Linear(4, 3), norm=nn.LayerNorm(3)))
    built = []

    def muon_cls(groups, **kwargs):
        built.append(kwargs)
        return Muon(groups, **kwargs)

    optimizers = build_optimizers(model, muon_lr=0.05, adamw_lr=1e-3, muon_cls=muon_cls, ns_steps=3)
    assert [type(o) for o in optimizers] == [Muon, torch.optim.AdamW] and built == [dict(lr=0.05, ns_steps=3)]
    assert {id(p) for g in optimizers[0].param_groups for p in g["params"]} == {id(model["proj"].weight)}
    model["proj"].weight.requires_grad_(False)
    assert [type(o) for o in build_optimizers(model, muon_cls=muon_cls)] == [torch.optim.AdamW] and len(built) == 1
    model.requires_grad_(False)
    assert build_optimizers(model, muon_cls=muon_cls) == []


def test_muon_and_adamw_train_a_moe():
    torch.manual_seed(0)
    model = MoE(32, 16, MoEConfig(n_experts=4, k=2, impl="torch"))
    x, target = torch.randn(64, 32), 0.1 * torch.randn(64, 32)
    optimizers = build_optimizers(model, muon_lr=0.02, adamw_lr=1e-2)
    assert [type(o) for o in optimizers] == [Muon, torch.optim.AdamW]
    losses = []
    for _ in range(30):
        loss = F.mse_loss(model(x)[0], target)
        losses.append(loss.item())
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_expert_stack_steps_on_its_local_matrices(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(9)
    W0, grad = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    plain = W0.clone().requires_grad_()
    plain.grad = grad.clone()
    Muon([plain], lr=0.1, weight_decay=0.1).step()
    W = nn.Parameter(distribute_tensor(W0.clone(), one_rank_mesh, [Shard(0)]))  # sharded over experts
    W.grad = distribute_tensor(grad.clone(), one_rank_mesh, [Shard(0)])
    Muon([W], lr=0.1, weight_decay=0.1).step()
    assert torch.equal(W.detach().to_local(), plain.detach())
    split_matrix = nn.Parameter(distribute_tensor(W0.clone(), one_rank_mesh, [Shard(1)]))
    with pytest.raises(ValueError, match="params.*matrix dim"):
        Muon([split_matrix])


def test_split_param_groups_for_adamw_only_and_undecayed_embeddings():
    """The train loop's one helper: muon=False puts every matrix in AdamW; norms, biases and
    gates never decay; decay_embeddings=False spares the embedding and the heads too."""
    model = nn.ModuleDict(dict(
        embed=nn.Embedding(10, 8), proj=nn.Linear(8, 8), norm=nn.LayerNorm(8), lm_head=nn.Linear(8, 10, bias=False),
    ))
    muon, adamw = split_param_groups(model, muon=False, weight_decay=0.1)
    (decay_ids, no_decay_ids) = _ids(adamw)
    assert muon == [] and [g["weight_decay"] for g in adamw] == [0.1, 0.0]
    assert decay_ids == {id(model["embed"].weight), id(model["proj"].weight), id(model["lm_head"].weight)}
    assert no_decay_ids == {id(model["proj"].bias), id(model["norm"].weight), id(model["norm"].bias)}
    _, adamw = split_param_groups(model, muon=False, weight_decay=0.1, decay_embeddings=False)
    (decay_ids, no_decay_ids) = _ids(adamw)
    assert decay_ids == {id(model["proj"].weight)}
    assert no_decay_ids == {id(model["proj"].bias), id(model["norm"].weight), id(model["norm"].bias),
                            id(model["embed"].weight), id(model["lm_head"].weight)}
    muon, adamw = split_param_groups(model, decay_embeddings=False)  # with Muon: the heads stay in AdamW, undecayed
    assert _ids(muon)[0] == {id(model["proj"].weight)} and len(adamw) == 1


def test_split_param_groups_takes_one_string_as_one_pattern():
    """adamw_patterns="embed" is the pattern "embed" (its characters were patterns: every
    name containing an "e" went to AdamW), through build_optimizers too."""
    model = nn.ModuleDict(dict(embed=nn.Embedding(10, 8), proj=nn.Linear(8, 8, bias=False), lm_head=nn.Linear(8, 10, bias=False)))
    muon, adamw = split_param_groups(model, adamw_patterns="embed")
    assert _ids(muon)[0] == {id(model["proj"].weight), id(model["lm_head"].weight)}
    assert _ids(adamw)[0] == {id(model["embed"].weight)}
    muon_opt, _ = build_optimizers(model, adamw_patterns="embed")
    assert {id(p) for p in muon_opt.param_groups[0]["params"]} == {id(model["proj"].weight), id(model["lm_head"].weight)}
    for bad in (3, [b"embed"], ["embed", None]):
        with pytest.raises(ValueError, match="^adamw_patterns: expected a string or an iterable of strings"):
            split_param_groups(model, adamw_patterns=bad)


def test_decay_embeddings_changes_weight_decay_only():
    """decay_embeddings=False leaves the embedding and head matrices undecayed in whichever
    optimizer adamw_patterns gives them: an lm_head outside the patterns stays in Muon (it
    moved to AdamW)."""
    model = nn.ModuleDict(dict(embed=nn.Embedding(10, 8), proj=nn.Linear(8, 8, bias=False), lm_head=nn.Linear(8, 10, bias=False)))
    for decay in (True, False):
        muon, adamw = split_param_groups(model, adamw_patterns=("embed",), weight_decay=0.1, decay_embeddings=decay)
        if decay:
            assert [(ids, g["weight_decay"]) for ids, g in zip(_ids(muon), muon)] == [
                ({id(model["proj"].weight), id(model["lm_head"].weight)}, 0.1)]
            assert [(ids, g["weight_decay"]) for ids, g in zip(_ids(adamw), adamw)] == [({id(model["embed"].weight)}, 0.1)]
        else:
            assert [(ids, g["weight_decay"]) for ids, g in zip(_ids(muon), muon)] == [
                ({id(model["proj"].weight)}, 0.1), ({id(model["lm_head"].weight)}, 0.0)]
            assert [(ids, g["weight_decay"]) for ids, g in zip(_ids(adamw), adamw)] == [({id(model["embed"].weight)}, 0.0)]


# -----------------------------------------------------------------------------
# Refusals

@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=float("inf")), "lr"), (dict(weight_decay=float("inf")), "weight_decay"),  # accepted: the weights went inf
    (dict(lr="0.02"), "lr"), (dict(momentum="0.9"), "momentum"), (dict(weight_decay=None), "weight_decay"),  # TypeErrors
    (dict(lr=True), "lr"), (dict(lr=torch.tensor(0.02)), "lr"), (dict(momentum=float("nan")), "momentum"),
])
def test_hyperparameters_must_be_finite_numbers(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        Muon([torch.zeros(3, 3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("name, value", [("lr", float("nan")), ("momentum", 1.5), ("weight_decay", -1.0), ("ns_steps", 0)])
def test_hyperparameters_set_later_are_checked_at_step(name, value):
    """A value set on a group after it was added was used unchecked (NaN lr: NaN weights)."""
    w = torch.ones(3, 4, requires_grad=True)
    opt = Muon([w])
    opt.param_groups[0][name] = value
    w.grad = torch.ones(3, 4)
    calls = []
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        opt.step(lambda: calls.append(1))
    assert not calls and torch.equal(w.detach(), torch.ones(3, 4)) and not opt.state


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_non_floating_params_are_refused(dtype):
    """A complex gradient's imaginary part was dropped; an int64 parameter failed at step."""
    with pytest.raises(ValueError, match=rf"^params: expected floating-point parameters, got {dtype} \(a parameter of shape \(2, 3\)\)"):
        Muon([torch.zeros(2, 3, dtype=dtype)])


def test_params_must_be_tensors():
    with pytest.raises(ValueError, match="^params: expected tensors, got float"):  # an AttributeError
        Muon([1.0])


def test_params_must_be_an_ordered_collection():
    """A set (its order, and so a checkpoint's parameter indices, changes between runs) is
    torch's TypeError, as in AdamW, at the top level too."""
    w = nn.Parameter(torch.zeros(3, 3))
    for params in ({w}, [{"params": {w}}]):
        with pytest.raises(TypeError, match="^params: expected an ordered collection"):
            Muon(params)
    opt = Muon([nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(TypeError, match="^params: expected an ordered collection"):
        opt.add_param_group({"params": {w}})
    assert len(opt.param_groups) == 1


def test_sparse_gradient_is_refused_before_any_update():
    dense, sparse = torch.ones(3, 4, requires_grad=True), torch.ones(5, 3, requires_grad=True)
    opt = Muon([dense, sparse])
    dense.grad, sparse.grad = torch.ones(3, 4), torch.ones(5, 3).to_sparse()
    with pytest.raises(RuntimeError, match="^Muon does not support sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3, 4)) and not opt.state


def test_newton_schulz_refuses_non_floating_input_and_bad_steps():
    for G in (torch.ones(3, 3, dtype=torch.int64), torch.ones(3, 3, dtype=torch.complex64)):  # int64 gave zeros
        with pytest.raises(ValueError, match=f"^G: expected a floating-point tensor, got {G.dtype}"):
            newton_schulz(G)
    for steps in (True, 2.5, "5"):
        with pytest.raises(ValueError, match="^steps: expected an int >= 1"):
            newton_schulz(torch.randn(3, 3), steps=steps)


def test_an_optimizer_loaded_from_another_s_state_dict_owns_its_momentum():
    """opt2.load_state_dict(opt1.state_dict()) in memory: each steps its own buffers (torch's
    loader kept the tensors, and both optimizers then moved both buffers)."""
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, generator=g).requires_grad_() for _ in range(2)]
    opt1, opt2 = Muon(params[:1], lr=0.1), Muon(params[1:], lr=0.1)
    params[0].grad = torch.randn(4, 3, generator=g)
    opt1.step()
    opt2.load_state_dict(opt1.state_dict())
    before = opt2.state[params[1]]["momentum_buffer"].clone()
    params[0].grad = torch.randn(4, 3, generator=g)
    opt1.step()
    assert torch.equal(opt2.state[params[1]]["momentum_buffer"], before)
    assert not torch.equal(opt1.state[params[0]]["momentum_buffer"], before)


def test_load_refuses_a_momentum_buffer_of_another_shape():
    """torch's loader took a buffer of another parameter's shape; the next step then failed
    inside torch (or broadcast a [1, n] parameter's update from a [3, n] buffer)."""
    a = nn.Parameter(torch.randn(3, 4))
    opt = Muon([a])
    a.grad = torch.randn(3, 4)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for shape in ((5, 4), (1, 4)):
        b = nn.Parameter(torch.randn(shape))
        with pytest.raises(ValueError, match=rf"^state_dict: expected momentum_buffer of parameter 0 to have the parameter's shape "
                                             rf"\({shape[0]}, 4\), got \(3, 4\)"):
            Muon([b]).load_state_dict(saved)
    same = Muon([nn.Parameter(torch.randn(3, 4))])
    same.load_state_dict(saved)
    assert torch.equal(next(iter(same.state.values()))["momentum_buffer"], opt.state[a]["momentum_buffer"])


def test_named_parameters_step_as_parameters():
    """Muon(model.named_parameters()), which torch's optimizers take, was refused as "expected
    tensors, got tuple"; the names are kept as torch keeps them, and the checks see the tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))
    twin = copy.deepcopy(model)
    named, plain = Muon(model.named_parameters(), lr=0.1), Muon(twin.parameters(), lr=0.1)
    for m, opt in ((model, named), (twin, plain)):
        for _ in range(2):
            m(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert named.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "1.weight"]
    with pytest.raises(ValueError, match=r"^params: Muon takes matrices \(ndim >= 2\), got shape \(3,\)"):
        Muon([("w", nn.Parameter(torch.zeros(3, 3))), ("b", nn.Parameter(torch.zeros(3)))])
    w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(3, 3\) appears twice"):
        Muon([("a", w), ("b", w)])


def test_default_lr_is_on_the_default_scale_s():
    """The defaults paired modded-nanogpt's lr 0.02 (for scale="spectral") with the moonlight
    scale, which takes AdamW's lr: updates 6x (at 1024) to 13x (at 4096) both recipes'."""
    w = nn.Parameter(torch.zeros(4, 4))
    opt = Muon([w])
    assert opt.defaults["scale"] == "moonlight" and opt.defaults["lr"] == 1e-3
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4))
    muon, adamw = split_param_groups(model)
    assert {g["lr"] for g in muon} == {g["lr"] for g in adamw} == {3e-4}


def test_split_param_groups_refuses_flags_that_are_not_bools_and_a_model_that_is_not_a_module():
    """muon="no" and decay_embeddings="no" (a config's string) are truthy: the matrices went to
    Muon and the embeddings were decayed, without a word; a list of parameters failed on an
    AttributeError. As AdamW's master_weights and Muon's nesterov, each is a ValueError."""
    model = nn.ModuleDict({"embed": nn.Embedding(5, 4), "proj": nn.Linear(4, 4)})
    for kwargs, match in [({"muon": "no"}, "^muon: expected a bool, got 'no'$"),
                          ({"decay_embeddings": "False"}, "^decay_embeddings: expected a bool, got 'False'$")]:
        with pytest.raises(ValueError, match=match):
            split_param_groups(model, **kwargs)
    with pytest.raises(ValueError, match="^decay_embeddings: expected a bool, got 'no'$"):
        build_optimizers(model, decay_embeddings="no")
    with pytest.raises(ValueError, match=r"^model: expected an nn.Module .*got list$"):
        split_param_groups(list(model.parameters()))


def test_newton_schulz_refuses_a_bad_dtype_or_eps():
    with pytest.raises(ValueError, match=r"^dtype: expected a floating torch.dtype .*got torch.int32"):  # torch's RuntimeError
        newton_schulz(torch.randn(3, 3), dtype=torch.int32)
    for eps in (-1.0, math.nan, "1e-7", 0, 0.0):  # 0: a zero matrix (a parameter's first gradient, all 0) came back NaN
        with pytest.raises(ValueError, match="^eps: expected a finite eps > 0"):
            newton_schulz(torch.randn(3, 3), eps=eps)
    assert newton_schulz(torch.randn(3, 3), eps=1e-30, dtype=torch.float32).dtype == torch.float32
    assert newton_schulz(torch.zeros(3, 3), dtype=torch.float32).eq(0).all()


def test_load_refuses_a_group_the_step_would_refuse():
    """A saved group with a tensor lr, or another optimizer's group, loaded and every step
    after it failed."""
    a = nn.Parameter(torch.randn(3, 4))
    opt = Muon([a], lr=0.1)
    a.grad = torch.randn(3, 4)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = torch.tensor(0.1)
    with pytest.raises(ValueError, match=r"^state_dict: param group 0: lr: expected a number \(a tensor lr"):
        opt.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^state_dict: param group 0 has no 'momentum' \(another optimizer's state\)"):
        opt.load_state_dict(torch.optim.Adam([a]).state_dict())
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]["lr"]) is float
