"""fmoe.train.upcycle: an MoE model started from a dense model's weights computes the dense
model's function (logits and every loss, MTP included), for copies (g = 1) and granular
slices (g = 2, 4), softmax, sigmoid and sqrt(softplus) routing, group-limited routing and a route scale."""

import dataclasses

import re

import pytest
import torch

from fmoe.model import Transformer, TransformerConfig
from fmoe.train.data import make_batch
from fmoe.train.upcycle import granularity, upcycle_

DENSE = TransformerConfig(vocab_size=64, hidden=32, n_layers=3, n_dense=3, ffn_dense=64, n_heads=4, n_kv_heads=2, head_dim=8,
                          mtp_depth=1, init_std=0.1, impl="torch")


def _moe(**kw):
    """The dense model's shape with MoE blocks from layer 1 on (and in the MTP module)."""
    moe = dict(n_dense=1, n_experts=8, k=2, ffn_expert=64, n_shared=0, score="softmax")
    moe.update(kw)
    return dataclasses.replace(DENSE, expert_bias=moe["score"] != "softmax", **moe)


def _dense_model(seed=3, cfg=DENSE):
    model = Transformer(cfg)
    model.reset_parameters(seed=seed)
    return model


def _batch(mtp_depth=1):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (48,), generator=gen)
    return make_batch(ids, torch.tensor([0, 20, 48]), mtp_depth=mtp_depth)


CASES = {
    "copies": _moe(),
    "g2-softmax": _moe(ffn_expert=32, k=4),
    "g4-sigmoid-groups-scale": _moe(ffn_expert=16, n_experts=16, k=8, score="sigmoid", n_groups=2, topk_groups=1, route_scale=2.5),
    # DeepSeek-V4's router: sqrt(softplus) scores plus the expert bias choose, the chosen renormalised and scaled
    "g2-sqrtsoftplus-scale": _moe(ffn_expert=32, k=4, score="sqrtsoftplus", route_scale=1.5),
    # ...its hashed first MoE block: each token id's experts redrawn as whole virtual groups
    "g2-hash-layer": _moe(ffn_expert=32, k=4, score="sqrtsoftplus", route_scale=1.5, hash_layers=1),
    "g2-shared-expert": _moe(ffn_expert=32, k=2, n_shared=1, shared_gate=True),
    # a GeGLU dense model (Gemma's MLP) into GeGLU experts
    "g2-geglu-shared-expert": _moe(ffn_expert=32, k=2, n_shared=1, mlp_act="gelu_tanh"),
    # an MLP without a gate (Arcee's, Nemotron-H's relu2) into experts without one (Nemotron 3's), with a shared expert
    "g2-relu2-shared-expert": _moe(ffn_expert=32, k=2, n_shared=1, mlp_act="relu2"),
    # Gemma 4's router: over its own norm, each weight times its expert's scale (both one at first)
    "g2-router-norm-expert-scale": _moe(ffn_expert=32, k=2, router_norm=True, router_expert_scale=True),
    # a bias on the MoE blocks' output: zeros at first, kept
    "g2-moe-out-bias": _moe(ffn_expert=32, k=2, moe_out_bias=True),
    # a dense hybrid (Bamba's: Mamba-2 mixers in blocks 0 and 2) into an MoE hybrid (Granite 4.0-H's): the mixers copied
    "g2-mamba2-hybrid": _moe(ffn_expert=32, k=2, linear_layers=(0, 2), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
                             linear_v_dim=16, linear_conv=3),
    # a dense Falcon-H1 (a Mamba-2 mixer beside the attention in every block, its output norm before the gate): both copied
    "g2-falcon-h1": _moe(ffn_expert=32, k=2, linear_layers=(0, 1, 2), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
                         linear_v_dim=16, linear_conv=3, parallel_hybrid=True, linear_gate_norm="before"),
    # a dense Nemotron-H (block 0 a Mamba-2 mixer alone, relu2 MLPs) into Nemotron 3's MoE blocks
    "g2-nemotron-h": _moe(ffn_expert=32, k=2, n_shared=1, mlp_act="relu2", mlp_free_layers=(0,), linear_layers=(0, 2), linear_kind="mamba2",
                          linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=16, linear_conv=3, linear_dt_min=0.05, nope_layers=(1,)),
    # a dense OLMo Hybrid (pre-norm Gated DeltaNet blocks 0 and 2 with beta in [0, 2] beside a post-norm attention block)
    # into MoE blocks of the same placement: the MoE block 2's norms are its pre-norms, block 1's its post-norms
    "g2-olmo-hybrid": _moe(ffn_expert=32, k=2, linear_layers=(0, 2), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=16,
                           linear_conv=3, linear_neg_eigval=True, linear_norm_eps=1e-5, linear_pre_norms=True, pre_norms=False, post_norms=True,
                           qk_norm="proj"),
    # Falcon-40B's blocks without biases (exact-GELU MLPs without a gate, parallel blocks of a LayerNorm with bias per branch)
    # into experts without a gate
    "g2-falcon": _moe(ffn_expert=32, k=2, mlp_act="gelu", layer_norms=True, norm_bias=True, parallel_blocks=True, parallel_norms=True),
    # Muse Glimmer's blocks (zero-centred sandwich norms with their own post-norm eps, a weightless embeddings' norm and a
    # plain final norm, gated attention with weightless q/k norms) into MoE blocks with the same norms and attention
    "g2-muse-glimmer": _moe(ffn_expert=32, k=2, post_norms=True, zero_centered_norms=True, embed_norm=True, post_norm_eps=1e-8,
                            norm_overrides=("embed:unit", "final:plain"), qk_norm="rms", attn_gate=True),
    # MPT's blocks (ALiBi, no MTP module, bias-free LayerNorms, exact-GELU MLPs without a gate) into experts without a gate
    "g2-mpt": _moe(ffn_expert=32, k=2, alibi=True, mtp_depth=0, mlp_act="gelu", layer_norms=True),
    # one sqrt(softplus) weight is normalised (1), unlike one sigmoid's
    "copies-sqrtsoftplus-k1": _moe(k=1, score="sqrtsoftplus"),
    # MiniMax-M3's shared experts' SwiGLU (their output 0 at first) where no block keeps a dense MLP (block 0 its mixer alone)
    "g2-shared-swiglu-mlp-free": _moe(ffn_expert=32, k=2, n_shared=1, mlp_free_layers=(0,), shared_swiglu_alpha=1.702, shared_swiglu_offset=1.0),
    # ...and Step 3.7's shared clamp on the MoE blocks only: the dense block 0's MLP stays the plain one
    "g2-shared-clamp-moe-blocks": _moe(ffn_expert=32, k=2, n_shared=1, shared_swiglu_limit=0.01, shared_swiglu_limit_layers=(1, 2)),
}
# the fields of the blocks' mixers and norms, the dense model's as the MoE's
MIXER = ("mlp_act", "linear_layers", "linear_kind", "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "linear_conv",
         "linear_dt_min", "linear_neg_eigval", "linear_norm_eps", "linear_pre_norms", "linear_gate_norm", "parallel_hybrid", "pre_norms", "post_norms", "qk_norm", "mlp_free_layers",
         "nope_layers", "layer_norms", "norm_bias", "parallel_blocks", "parallel_norms", "zero_centered_norms", "embed_norm", "post_norm_eps",
         "norm_overrides", "attn_gate", "alibi", "mtp_depth")


@pytest.mark.parametrize("case", list(CASES))
def test_the_upcycled_model_computes_the_dense_function(case):
    cfg = CASES[case]
    dense_cfg = dataclasses.replace(DENSE, **{name: getattr(cfg, name) for name in MIXER})
    dense = _dense_model(cfg=dense_cfg)
    moe = Transformer(cfg)
    moe.reset_parameters(seed=5)
    upcycle_(moe, dense.state_dict(), dense_cfg, seed=5)
    batch = _batch(cfg.mtp_depth)
    with torch.no_grad():
        torch.testing.assert_close(moe.logits(batch["input_ids"], batch["cu_seqlens"]),
                                   dense.logits(batch["input_ids"], batch["cu_seqlens"]), rtol=1e-5, atol=1e-5)
        got, stats = moe(batch, moe.context(batch))
        want, _ = dense(batch, dense.context(batch))
    for key in ("lm_sum", "mtp_1_sum")[:1 + cfg.mtp_depth]:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0), key
    assert set(stats.keys()) == {"layer_1", "layer_2", "mtp_1"} - ({"mtp_1"} if not cfg.mtp_depth else set())
    # the experts: slices of the dense FFN, each virtual group one whole copy of it
    g = granularity(cfg, dense_cfg)
    w_up = moe.blocks[1].mlp.experts.w_up
    F = cfg.ffn_expert
    for e in range(cfg.n_experts):
        assert torch.equal(w_up[e], dense.blocks[1].mlp.w_up[:, (e % g) * F:(e % g + 1) * F])
    router = moe.blocks[2].mlp.router
    assert torch.equal(router, router[::g].repeat_interleave(g, dim=0)) and not torch.equal(router[0], router[g])
    if cfg.n_shared:
        assert (moe.blocks[1].mlp.shared.w_down == 0).all() and moe.blocks[1].mlp.shared.w_up.abs().sum() > 0


def test_mtp_modules_the_dense_model_lacks_keep_their_initial_values():
    """A dense model without MTP (a Hugging Face one): the MoE's MTP module starts fresh,
    the trunk is still the dense function."""
    dense_cfg = dataclasses.replace(DENSE, mtp_depth=0)
    dense = Transformer(dense_cfg)
    dense.reset_parameters(seed=3)
    moe = Transformer(CASES["g2-softmax"])
    moe.reset_parameters(seed=5)
    fresh = {n: p.clone() for n, p in moe.named_parameters() if n.startswith("mtp.")}
    upcycle_(moe, dense.state_dict(), dense_cfg, seed=5)
    assert fresh and all(torch.equal(p, fresh[n]) for n, p in moe.named_parameters() if n.startswith("mtp."))
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(moe.logits(batch["input_ids"], batch["cu_seqlens"]),
                                   dense.logits(batch["input_ids"], batch["cu_seqlens"]), rtol=1e-5, atol=1e-5)


def test_training_breaks_the_ties():
    """One SGD step on the upcycled model: the experts of a group get different gradients
    (each computes its own slice), so the shared router rows and the copies part."""
    cfg = CASES["g2-softmax"]
    moe = Transformer(cfg)
    moe.reset_parameters(seed=0)
    upcycle_(moe, _dense_model().state_dict(), DENSE, seed=0)
    batch = _batch()
    losses, _ = moe(batch, moe.context(batch))
    losses["lm_sum"].backward()
    grad = moe.blocks[1].mlp.router.grad
    assert grad is not None and not torch.allclose(grad[0], grad[1])


def test_drop_upcycling_draws_a_fraction_of_each_expert_afresh():
    """drop=0.5: in each expert, round(0.5 Fe) channels (its own, the same in its three
    matrices) are drawn from the dense matrix's normal; the rest are the dense slices; the
    same seed draws the same."""
    cfg = CASES["copies"]  # g = 1: every expert a copy of the FFN before the drop
    dense = _dense_model()
    with torch.no_grad():  # a mean away from 0: a fresh draw of mean 0 passed where the dense matrix's is 0 too
        dense.blocks[1].mlp.w_gate.add_(0.3)

    def upcycled(drop, seed=5):
        moe = Transformer(cfg)
        moe.reset_parameters(seed=seed)
        upcycle_(moe, dense.state_dict(), DENSE, seed=seed, drop=drop)
        return moe.blocks[1].mlp.experts

    experts, F = upcycled(0.5), cfg.ffn_expert
    src = dense.blocks[1].mlp
    changed = [(experts.w_gate[e] != src.w_gate).any(0) for e in range(cfg.n_experts)]  # [F] per expert
    for e, gate in enumerate(changed):
        assert int(gate.sum()) == F // 2
        assert torch.equal((experts.w_up[e] != src.w_up).any(0), gate)
        assert torch.equal((experts.w_down[e] != src.w_down).any(1), gate)
        assert torch.equal(experts.w_gate[e][:, ~gate], src.w_gate[:, ~gate])
    assert len({tuple(c.nonzero().flatten().tolist()) for c in changed}) > 1  # the experts drop different channels
    fresh = torch.cat([experts.w_gate[e][:, changed[e]].flatten() for e in range(cfg.n_experts)]).detach()
    assert abs(float(fresh.std()) / float(src.w_gate.detach().std()) - 1) < 0.1
    assert abs(float(fresh.mean()) - float(src.w_gate.detach().mean())) < 0.02 and float(src.w_gate.detach().mean()) > 0.25
    again = upcycled(0.5)
    assert torch.equal(again.w_gate, experts.w_gate) and torch.equal(again.w_down, experts.w_down)
    assert not torch.equal(upcycled(0.5, seed=6).w_gate, experts.w_gate)
    assert (upcycled(1.0).w_gate != src.w_gate).all()
    # a drop that rounds to no channel (round(drop Fe) = 0) started exactly, said to be a Drop-Upcycling start: refused
    assert torch.equal(upcycled(1 / F).w_gate.ne(src.w_gate).any(1).sum(1), torch.ones(cfg.n_experts, dtype=torch.long))  # one each
    for small in (0.4 / F, 1e-9):
        with pytest.raises(ValueError, match=rf"^drop: {small:g} of each expert's {F} channels rounds to none \(round\(drop Fe\) = 0\), so no "
                                             rf"channel would start fresh; {1 / F:.3g} or more draws one \(0: the exact start\)"):
            upcycled(small)
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="drop: expected the fraction of each expert's channels to draw afresh, in \\[0, 1\\]"):
            upcycle_(Transformer(cfg), dense.state_dict(), DENSE, drop=bad)


def test_the_pair_must_allow_an_exact_start():
    dense = _dense_model().state_dict()
    bad = [
        (_moe(ffn_expert=48), "ffn_expert: expected a divisor of the dense model's ffn_dense=64"),
        (_moe(ffn_expert=16, n_experts=6, k=4), "n_experts: expected a multiple of the granularity g = ffn_dense / ffn_expert = 4, got 6"),
        (_moe(ffn_expert=32, k=3), "k: expected a multiple of the granularity g = 2"),
        (_moe(ffn_expert=32, k=4, n_groups=8, topk_groups=4), "n_groups: expected routing groups of a multiple of g = 2 experts, got 1"),
        (_moe(ffn_expert=16, n_experts=8, k=4, n_groups=4, topk_groups=2), "n_groups: expected routing groups of a multiple of g = 4"),
        (_moe(pre_softmax=True), "pre_softmax: the weights of a softmax over every expert"),
        (_moe(score="sigmoid", route_normalize=False), "route_normalize: unnormalised sigmoid weights"),
        (_moe(score="sqrtsoftplus", route_normalize=False), "route_normalize: unnormalised sqrtsoftplus weights"),
        (_moe(score="sigmoid", k=1), "k: a single sigmoid weight is not normalised (sigmoids are divided by their sum only when k > 1)"),  # 0.47 off
        (dataclasses.replace(_moe(), score="sparsemixer"), "score: sparsemixer's weights (each slot's own masked softmax) do not sum to a constant"),  # 0.43 off
        (_moe(route_on_input=True), "route_on_input: the routing weight scales each expert's input"),  # 0.32 off
        (_moe(expert_biases=True), "expert_biases: the dense FFN has no biases"),
        (_moe(moe_out_norm=True), "moe_out_norm: a norm on the MoE blocks' output changes the dense block's function"),
        (_moe(expert_out_norm=True), "expert_out_norm: each routed expert's output normed before its weight"),
        (_moe(norm_gate_rank=2), "norm_gate_rank: a MoE block's pre-MLP norm is gated (GatedRMSNorm), a dense block's is not"),
        (_moe(zero_experts=2), "zero_experts: a slot routed to a zero expert passes its token through"),
        (_moe(moe_latent=16), "moe_latent: a latent MoE's experts work in L channels between two projections"),
        (_moe(shortcut_moe=True, n_layers=4, n_dense=0), "shortcut_moe: a pair's MoE output added after the next block"),
        (_moe(swiglu_limit=7.0), "swiglu_alpha, swiglu_limit, swiglu_offset: the dense FFN's SwiGLU is the plain one"),
        (_moe(mlp_act="gelu_tanh"), "mlp_act: the experts' gate activation must be the dense FFN's, 'silu', got 'gelu_tanh'"),
        (_moe(dense_beside_moe=True, post_norms=True), "dense_beside_moe: Gemma 4's MoE blocks keep a dense MLP beside the experts"),
        (DENSE, "cfg: expected a model with MoE layers"),
    ]
    for cfg, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            upcycle_(Transformer(cfg), dense, DENSE)
    clamped = dataclasses.replace(DENSE, shared_swiglu_limit=7.0)  # the dense MLPs' clamp (Step 3.7's dense layers)
    with pytest.raises(ValueError, match="shared_swiglu_limit: the dense FFN's SwiGLU is clamped"):
        upcycle_(Transformer(_moe()), dense, clamped)
    # MiniMax-M3's dense SwiGLU, g sigmoid(alpha g) (u + offset), cut into plain experts (0.22, 1.56 off with the MoE's alike)
    for knobs in (dict(shared_swiglu_alpha=1.7), dict(shared_swiglu_offset=1.0)):
        glu = dataclasses.replace(DENSE, **knobs)
        with pytest.raises(ValueError, match=r"^shared_swiglu_alpha, shared_swiglu_offset: the dense FFN's SwiGLU is g sigmoid\(alpha g\)"):
            upcycle_(Transformer(_moe(**knobs)), dense, glu)
    with pytest.raises(ValueError, match="dense_cfg: expected a dense model"):
        upcycle_(Transformer(_moe()), dense, _moe())
    biased = dataclasses.replace(DENSE, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias: the dense FFN's biases are not carried into the experts"):
        upcycle_(Transformer(_moe(mlp_bias=True)), _dense_model(cfg=biased).state_dict(), biased)
    # the dense model differs elsewhere: a missing parameter, a shape
    with pytest.raises(ValueError, match="dense_state: no 'blocks.2.attn.wq'"):
        upcycle_(Transformer(_moe()), {k: v for k, v in dense.items() if k != "blocks.2.attn.wq"}, DENSE)
    with pytest.raises(ValueError, match=r"dense_state: 'embed' has shape \(80, 32\), the MoE model's is \(64, 32\)"):
        upcycle_(Transformer(_moe()), {**dense, "embed": torch.zeros(80, 32)}, DENSE)
    # ...or its config does, where the shapes can match: a layer more, another RoPE base, norm eps, head split or window
    # gave other logits at the start (1.24, 0.07, 0.89, 2, 2 off)
    for knobs in (dict(vocab_size=80), dict(rope_base=5e5), dict(norm_eps=1e-2), dict(logit_softcap=5.0), dict(window=4),
                  dict(n_heads=2, n_kv_heads=1, head_dim=16)):
        differ = ", ".join(f"{k}={getattr(DENSE, k)!r} \\(here {v!r}\\)" for k, v in knobs.items())
        with pytest.raises(ValueError, match=f"^dense_cfg: the dense model differs from the MoE model outside its MoE blocks: {differ}; "):
            upcycle_(Transformer(_moe(**knobs)), dense, DENSE)
    # ...or a field that acts on the blocks that stay dense (block 0) too: the dense MLPs' SwiGLU (0.23, 1.41, 1.17 off),
    # size and biases; every block's post-norm eps (2.22 off); the copied MTP module's output norm, or the final norm
    # (alike at initialisation; trained apart, the MTP loss 0.08% off)
    post = dataclasses.replace(DENSE, post_norms=True)
    for dense_cfg, knobs in ((DENSE, dict(shared_swiglu_alpha=1.7)), (DENSE, dict(shared_swiglu_offset=1.0)), (DENSE, dict(shared_swiglu_limit=0.01)),
                             (DENSE, dict(ffn_dense=32)), (DENSE, dict(mlp_bias=True)), (post, dict(post_norm_eps=1.0)), (DENSE, dict(mtp_norm=True)),
                             (dataclasses.replace(DENSE, mtp_norm=True), dict(mtp_norm=False))):
        differ = ", ".join(f"{k}={getattr(dense_cfg, k)!r} \\(here {v!r}\\)" for k, v in knobs.items())
        with pytest.raises(ValueError, match=f"^dense_cfg: the dense model differs from the MoE model outside its MoE blocks: {differ}; "):
            upcycle_(Transformer(_moe(post_norms=dense_cfg.post_norms, **knobs)), _dense_model(cfg=dense_cfg).state_dict(), dense_cfg)
    more = dataclasses.replace(DENSE, n_layers=DENSE.n_layers + 1, n_dense=DENSE.n_layers + 1)
    with pytest.raises(ValueError, match=rf"^dense_cfg: .*: n_layers={DENSE.n_layers + 1} \(here {DENSE.n_layers}\)"):
        upcycle_(Transformer(_moe()), _dense_model(cfg=more).state_dict(), more)
    # arguments of another kind, named
    with pytest.raises(ValueError, match=r"^dense_state: expected the dense model's state .*, got Transformer"):
        upcycle_(Transformer(_moe()), _dense_model(), DENSE)
    with pytest.raises(ValueError, match=r"^dense_cfg: expected the dense model's TransformerConfig, got dict"):
        upcycle_(Transformer(_moe()), dense, dataclasses.asdict(DENSE))
    with pytest.raises(ValueError, match=r"^dense_state: 'embed' is a ndarray, expected a tensor"):
        upcycle_(Transformer(_moe()), {**dense, "embed": dense["embed"].numpy()}, DENSE)
    with pytest.raises(ValueError, match=r"dense_state: 'blocks.1.mlp.w_up' has shape \(32, 60\), expected \(32, 64\)"):
        upcycle_(Transformer(_moe()), {**dense, "blocks.1.mlp.w_up": torch.zeros(32, 60)}, DENSE)


def test_a_dense_model_with_hyper_connections_upcycles_to_its_own_function():
    """The streams' weights (every block's and the head's) are the dense model's, copied as
    they are: the upcycled model of 2 x 32 slices computes the dense model's logits."""
    dense_cfg = dataclasses.replace(DENSE, mtp_depth=0, hyper_connections=3, hc_kind="independent")
    dense = Transformer(dense_cfg)
    dense.reset_parameters(seed=3)
    with torch.no_grad():  # streams that differ: scales of 0.5
        for name, p in dense.named_parameters():
            if name.endswith("hc.scale") or name.endswith("hc_head.scale"):
                p.fill_(0.5)
    cfg = dataclasses.replace(dense_cfg, n_dense=1, n_experts=8, k=4, ffn_expert=32, n_shared=0, score="softmax", expert_bias=False)
    moe = Transformer(cfg)
    moe.reset_parameters(seed=5)
    upcycle_(moe, dense.state_dict(), dense_cfg, seed=5)
    assert torch.equal(moe.blocks[2].mlp_hc.fn, dense.blocks[2].mlp_hc.fn) and torch.equal(moe.hc_head.scale, dense.hc_head.scale)
    batch = make_batch(torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 20, 48]))
    with torch.no_grad():
        torch.testing.assert_close(moe.logits(batch["input_ids"], batch["cu_seqlens"]), dense.logits(batch["input_ids"], batch["cu_seqlens"]),
                                   rtol=1e-5, atol=1e-5)


def test_upcycle_names_a_bad_model_or_seed():
    """seed: an int, as reset_parameters takes it ("a" and 1.5 were taken); model: a
    Transformer or a list of its parts ([] did nothing, a module of another kind failed in
    an AttributeError)."""
    dense = _dense_model().state_dict()
    for seed in ("a", 1.5, None, True):
        with pytest.raises(ValueError, match=rf"^seed: expected an int \(the seed the model was initialised with\), got {re.escape(repr(seed))}"):
            upcycle_(Transformer(_moe()), dense, DENSE, seed=seed)
    for model, got in (([], "list"), (torch.nn.Linear(2, 2), "Linear"), ([Transformer(_moe()), torch.nn.Linear(2, 2)], r"\['Transformer', 'Linear'\]"),
                       ("model", "str"), ((m for m in [torch.nn.Linear(2, 2)]), r"\['Linear'\]")):
        with pytest.raises(ValueError, match=rf"^model: expected a fmoe.model.Transformer or a sequence of its pipeline chunks, got {got}"):
            upcycle_(model, dense, DENSE)
    upcycle_((part for part in [Transformer(_moe())]), dense, DENSE)  # a generator of chunks, as before
    with torch.device("meta"):  # a model never allocated: the copies into it wrote nothing, without a word
        empty = Transformer(_moe())
    with pytest.raises(ValueError, match=r"^model: 'embed' is a meta tensor holding no values \(a model built on the meta device\): "
                                         r"allocate and initialise it first"):
        upcycle_(empty, dense, DENSE)


def test_a_refusal_leaves_the_model_as_it_was():
    """Every check comes before the first write: a refusal of the pair's configs, of a dense
    tensor that is missing, of another shape or not a tensor (among the last upcycle_ reads:
    one copied, one cut into experts), or of a later pipeline part, leaves every part's
    parameters and buffers as they were."""
    dense = _dense_model().state_dict()
    bad = [(_moe(expert_out_norm=True), dense, "expert_out_norm: "), (_moe(shared_swiglu_alpha=1.7), dense, "dense_cfg: the dense model differs")]
    for name, whose in (("mtp.0.block.mlp_norm.weight", ""), ("mtp.0.block.mlp.w_down", " to upcycle")):
        bad += [(_moe(), {k: v for k, v in dense.items() if k != name}, f"dense_state: no {name!r}{whose}"),
                (_moe(), {**dense, name: torch.zeros(3)}, f"dense_state: {name!r} has shape \\(3,\\)"),
                (_moe(), {**dense, name: dense[name].numpy()}, f"dense_state: {name!r} is a ndarray, expected a tensor"),
                # a tensor on the meta device (a dense model built there, never loaded): the model was half written, then torch failed
                (_moe(), {**dense, name: dense[name].to("meta")}, f"dense_state: {name!r} is a meta tensor holding no values")]
    for cfg, state, message in bad:
        parts = [Transformer(_moe()), Transformer(cfg)]  # the first part passes its own checks
        for part in parts:
            part.reset_parameters(seed=5)
        before = [{n: t.clone() for n, t in [*part.named_parameters(), *part.named_buffers()]} for part in parts]
        with pytest.raises(ValueError, match=message):
            upcycle_(parts, state, DENSE, seed=5)
        for part, was in zip(parts, before):
            assert all(torch.equal(t, was[n]) for n, t in [*part.named_parameters(), *part.named_buffers()]), message


def test_the_router_rows_are_the_models_own_initial_rows():
    """Virtual group j's g router rows are row j of the router the model was initialised with
    (init_value(seed, name)): with the same seed, upcycle_ keeps the initialisation's first E / g
    rows, each repeated g times (an exact start holds for any tied rows, so the function alone
    does not pin which rows are used)."""
    cfg = CASES["g2-softmax"]  # g = 2, E = 8
    moe = Transformer(cfg)
    moe.reset_parameters(seed=5)
    before = {n: p.detach().clone() for n, p in moe.named_parameters() if n.endswith("mlp.router")}
    assert len(before) == 3  # blocks 1, 2 and the MTP block
    upcycle_(moe, _dense_model().state_dict(), DENSE, seed=5)
    params = dict(moe.named_parameters())
    for name, was in before.items():
        assert torch.equal(params[name], was[: cfg.n_experts // 2].repeat_interleave(2, dim=0)), name


def test_a_hashed_blocks_table_with_g1_is_the_initialisations_own():
    """g = 1: each token id's experts are already whole groups, so the hashed block's table is
    the one reset_parameters drew with the same seed (the module docstring's promise)."""
    cfg = _moe(k=2, score="sqrtsoftplus", route_scale=1.5, hash_layers=1)  # copies: g = 1
    moe = Transformer(cfg)
    moe.reset_parameters(seed=5)
    before = {n: b.clone() for n, b in moe.named_buffers() if n.endswith("hash_table")}
    assert before
    dense = _dense_model()
    upcycle_(moe, dense.state_dict(), DENSE, seed=5)
    for name, b in moe.named_buffers():
        if name in before:
            assert torch.equal(b, before[name]), name


def test_a_dense_model_without_mtp_upcycles_into_one_with_an_mtp_norm():
    """A dense model without MTP modules (a Hugging Face one) into an MoE model whose fresh MTP
    module has its own output norm (mtp_norm=True): nothing of the dense model is copied into
    the MTP module, so mtp_norm may differ; the trunk is still the dense function."""
    dense_cfg = dataclasses.replace(DENSE, mtp_depth=0)
    dense = _dense_model(cfg=dense_cfg)
    moe = Transformer(_moe(ffn_expert=32, k=4, mtp_norm=True))
    moe.reset_parameters(seed=5)
    upcycle_(moe, dense.state_dict(), dense_cfg, seed=5)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(moe.logits(batch["input_ids"], batch["cu_seqlens"]),
                                   dense.logits(batch["input_ids"], batch["cu_seqlens"]), rtol=1e-5, atol=1e-5)


def test_drop_upcycling_rounds_the_channel_count():
    """round(drop Fe) channels per expert, not int(drop Fe): 1.7 / Fe draws 2 channels afresh,
    0.7 / Fe one (the check that refuses a drop rounding to none uses round too)."""
    cfg = CASES["copies"]
    dense = _dense_model()
    F = cfg.ffn_expert
    src = dense.blocks[1].mlp.w_gate
    for drop, n in ((1.7 / F, 2), (0.7 / F, 1)):
        moe = Transformer(cfg)
        moe.reset_parameters(seed=5)
        upcycle_(moe, dense.state_dict(), DENSE, seed=5, drop=drop)
        changed = (moe.blocks[1].mlp.experts.w_gate != src).any(1).sum(1)  # [E]: channels drawn afresh per expert
        assert changed.tolist() == [n] * cfg.n_experts, (drop, changed)
