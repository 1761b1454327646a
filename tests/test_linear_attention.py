"""fmoe.layers.linear_attention (Gated DeltaNet, Kimi Delta Attention, LFM2's short
convolution, MiniMax's lightning attention and Mamba-2's mixer) against a token-by-token
loop written from the papers' recurrence, against transformers' Qwen3.5 GatedDeltaNet, Kimi
Linear KimiDeltaAttention, LFM2, MiniMax and Granite 4.0-H Mamba-2 modules, over packed documents, and in
decoding (LinearStates) against the whole sequence at once."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fmoe.layers import (AttentionConfig, LinearAttentionConfig, LinearStates, attention_context, lightning_decay, linear_attention,
                         linear_attention_shapes)
from fmoe.ops import gated_delta_rule, gated_linear_attention, selective_scan
from fmoe.parallel import cp_kv_index, cp_token_index

H = 24
CFG = LinearAttentionConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6, conv=4, chunk_size=8)
KDA = LinearAttentionConfig(n_k_heads=3, n_v_heads=3, k_head_dim=8, v_head_dim=6, conv=3, chunk_size=8, kind="kda")
# Ling's Kimi Delta Attention (Bailing hybrid): the decay's and the gate's projections whole, the decay bounded in (-5, 0)
LING = dataclasses.replace(KDA, full_rank=True, decay_bound=-5.0)
# LFM2's gated short convolution over 16 channels (8 heads of 2), 3 taps
SHORT = LinearAttentionConfig(n_k_heads=8, n_v_heads=8, k_head_dim=2, v_head_dim=2, conv=3, kind="short_conv")
# MiniMax's lightning attention: 3 heads of 8, a constant decay per head (params["decay"]: layer 1 of 4's)
LIGHT = LinearAttentionConfig(n_k_heads=3, n_v_heads=3, k_head_dim=8, v_head_dim=8, chunk_size=8, kind="lightning")
# Mamba-2's mixer: C and B in 2 groups of a state of 8, read by 4 heads of x of 6, 4 taps with biases
MAMBA = LinearAttentionConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6, conv=4, chunk_size=8, kind="mamba2")
MAMBA_FLOOR = dataclasses.replace(MAMBA, dt_min=0.7)  # Nemotron-H's floor of dt (this high: it binds for some tokens and heads)
MAMBA_BEFORE = dataclasses.replace(MAMBA, gate_norm="before")  # Falcon-H1's norm before the gate
MAMBA_UNNORMED = dataclasses.replace(MAMBA, gate_norm="none")  # Falcon-H1's gate alone (mamba_rms_norm false)
NEG = dataclasses.replace(CFG, neg_eigval=True)  # OLMo Hybrid's write strength 2 sigmoid(x wb), in [0, 2]
# Mamba-1's mixer: 12 channels of x, each with a state of 8 (a decay per state channel), one B and C, dt of rank 3, 4 taps
MAMBA1 = LinearAttentionConfig(n_k_heads=1, n_v_heads=12, k_head_dim=8, v_head_dim=1, conv=4, chunk_size=8, kind="mamba1", dt_rank=3)
MAMBA1_NORMS = dataclasses.replace(MAMBA1, dt_bc_norm="rms")  # Jamba's norms on dt, B and C (with weights)
MAMBA1_UNIT = dataclasses.replace(MAMBA1, dt_bc_norm="rms_unit")  # Falcon Mamba's (without)


def _params(cfg=CFG, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = {}
    for name, shape in linear_attention_shapes(H, cfg).items():
        if name == "A_log":
            p[name] = torch.log(torch.rand(shape, generator=gen) * 15 + 1)
        elif name == "dt_bias":
            p[name] = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("_norm"):
            p[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif name.startswith("conv"):
            p[name] = torch.randn(shape, generator=gen) * 0.5
        else:
            p[name] = torch.randn(shape, generator=gen) / shape[0] ** 0.5
    p = {n: t.to(dtype).requires_grad_() for n, t in p.items()}
    if cfg.kind == "lightning":  # a constant, not a weight
        p["decay"] = lightning_decay(cfg.n_v_heads, 1, 4)
    return p


def _ctx(cu, T):
    positions = torch.cat([torch.arange(int(b) - int(a)) for a, b in zip(cu[:-1], cu[1:])])
    return attention_context(cu, positions, AttentionConfig(n_heads=1, n_kv_heads=1, head_dim=2, impl="torch"))


def _loop(x, p, cfg, cu):
    """Each document token by token, in float64: the conv as a dot with the last K inputs,
    the state S updated by S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk).
    LFM2's short convolution: ((x wc) * sum_j w[K-1-j] (x_{t-j} wb) * (x_{t-j} wv)) wo."""
    p = {n: t.double() for n, t in p.items()}
    x = x.double()
    if cfg.kind == "lightning":  # S <- exp(decay) S + k v^T, o = S^T q; the norm over every head's channels, a sigmoid gate
        N, D, out = cfg.n_v_heads, cfg.v_head_dim, []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            S = torch.zeros(N, D, D, dtype=torch.float64)
            for t in range(a, b):
                q, k, v = (F.silu(x[t] @ p[n]).view(N, D) for n in ("wq", "wk", "wv"))
                S = S * p["decay"].exp()[:, None, None] + k[:, :, None] * v[:, None, :]
                o = torch.einsum("nkv,nk->nv", S, q).reshape(-1)
                o = o * torch.rsqrt(o.square().mean() + cfg.norm_eps) * p["out_norm"]
                out.append((o * torch.sigmoid(x[t] @ p["wz"])) @ p["wo"])
        return torch.stack(out)
    if cfg.kind == "mamba1":  # per channel c: h_c <- exp(-exp(A_log_c) dt_c) h_c + dt_c u_c B, o_c = h_c . C + D_c u_c; silu(z) gate
        K, out = cfg.conv, []

        def norm(t, name):
            if cfg.dt_bc_norm == "none":
                return t
            return t * torch.rsqrt(t.square().mean() + cfg.norm_eps) * (p[name] if cfg.dt_bc_norm == "rms" else 1)

        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            h = torch.zeros(cfg.n_v_heads, cfg.k_head_dim, dtype=torch.float64)
            for t in range(a, b):
                u = F.silu(sum(p["conv_v"][K - 1 - j] * (x[t - j] @ p["wv"]) for j in range(K) if t - j >= a) + p["conv_v_bias"])
                r, Bm, C = norm(u @ p["wdt"], "dt_norm"), norm(u @ p["wk"], "b_norm"), norm(u @ p["wq"], "c_norm")
                dt = F.softplus(r @ p["wa"] + p["dt_bias"])
                h = h * (-p["A_log"].exp() * dt[:, None]).exp() + (dt * u)[:, None] * Bm[None, :]
                out.append(((h @ C + p["D"] * u) * F.silu(x[t] @ p["wz"])) @ p["wo"])
        return torch.stack(out)
    if cfg.kind == "mamba2":  # h <- exp(-exp(A_log) dt) h + dt B x^T, o = h^T C + D x; silu(z) gate, then a norm per group (gate_norm)
        Nk, Nv, Dk, Dv, K = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv
        out = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            S = torch.zeros(Nv, Dk, Dv, dtype=torch.float64)
            for t in range(a, b):
                conv = {n: F.silu(sum(p["conv_" + n][K - 1 - j] * (x[t - j] @ p["w" + n]) for j in range(K) if t - j >= a) + p[f"conv_{n}_bias"])
                        for n in "qkv"}
                C, Bm = (conv[n].view(Nk, Dk).repeat_interleave(Nv // Nk, 0) for n in "qk")
                xv = conv["v"].view(Nv, Dv)
                dt = F.softplus(x[t] @ p["wa"] + p["dt_bias"]).clamp(min=cfg.dt_min)
                S = S * (-p["A_log"].exp() * dt).exp()[:, None, None] + Bm[:, :, None] * (dt[:, None] * xv)[:, None, :]
                o, gate = (torch.einsum("nkv,nk->nv", S, C) + p["D"][:, None] * xv).reshape(-1), F.silu(x[t] @ p["wz"])
                group_norm = lambda o: (o.view(Nk, -1) * torch.rsqrt(o.view(Nk, -1).square().mean(-1, keepdim=True) + cfg.norm_eps)).reshape(-1)  # noqa: E731
                if cfg.gate_norm == "none":
                    o = o * gate
                elif cfg.gate_norm == "before":
                    o = group_norm(o) * p["out_norm"] * gate
                else:
                    o = group_norm(o * gate) * p["out_norm"]
                out.append(o @ p["wo"])
        return torch.stack(out)
    if cfg.kind == "short_conv":
        K = cfg.conv
        return torch.stack([((x[t] @ p["wc"]) * sum(p["conv_v"][K - 1 - j] * (x[t - j] @ p["wb"]) * (x[t - j] @ p["wv"])
                                                      for j in range(K) if t - j >= a)) @ p["wo"]
                            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) for t in range(a, b)])
    Nk, Nv, Dk, Dv, K = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        S = torch.zeros(Nv, Dk, Dv, dtype=torch.float64)
        for t in range(a, b):
            conv = {}
            for n in "qkv":
                w = p["conv_" + n]
                acc = sum(w[K - 1 - j] * (x[t - j] @ p["w" + n]) for j in range(K) if t - j >= a)
                conv[n] = F.silu(acc)
            q = F.normalize(conv["q"].view(Nk, Dk), dim=-1, eps=0).repeat_interleave(Nv // Nk, 0)  # eps aside (1e-6 in the sum)
            k = F.normalize(conv["k"].view(Nk, Dk), dim=-1, eps=0).repeat_interleave(Nv // Nk, 0)
            v = conv["v"].view(Nv, Dv)
            beta = torch.sigmoid(x[t] @ p["wb"]) * (2 if cfg.neg_eigval else 1)
            if cfg.kind == "kda":  # a decay per key channel: rows of S
                f = (x[t] @ p["wf"] if cfg.full_rank else x[t] @ p["wf_a"] @ p["wf_b"]) + p["dt_bias"]
                rate = p["A_log"].exp()[:, None]
                if cfg.decay_bound is None:
                    g = -rate * F.softplus(f).view(Nv, Dk)
                else:
                    g = cfg.decay_bound * torch.sigmoid(rate * f.view(Nv, Dk))
                S = S * g.exp()[:, :, None]
            else:
                g = -p["A_log"].exp() * F.softplus(x[t] @ p["wa"] + p["dt_bias"])
                S = S * g.exp()[:, None, None]
            u = beta[:, None] * (v - torch.einsum("nkv,nk->nv", S, k))
            S = S + k[:, :, None] * u[:, None, :]
            o = torch.einsum("nkv,nk->nv", S, q / Dk ** 0.5)
            o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + cfg.norm_eps) * p["out_norm"]
            if cfg.kind == "kda":
                gate = torch.sigmoid((x[t] @ p["wz"] if cfg.full_rank else x[t] @ p["wz_a"] @ p["wz_b"]).view(Nv, Dv))
            else:
                gate = F.silu((x[t] @ p["wz"]).view(Nv, Dv))
            out.append((o * gate).reshape(-1) @ p["wo"])
    return torch.stack(out)


@pytest.mark.parametrize("cfg", [CFG, KDA, LING, SHORT, LIGHT, MAMBA, MAMBA_FLOOR, MAMBA_BEFORE, MAMBA_UNNORMED, NEG, dataclasses.replace(KDA, neg_eigval=True),
                                 MAMBA1, MAMBA1_NORMS, MAMBA1_UNIT],
                         ids=["gated-deltanet", "kda", "kda-ling", "short-conv", "lightning", "mamba2", "mamba2-dt-floor", "mamba2-norm-before-gate",
                              "mamba2-no-norm", "gated-deltanet-neg", "kda-neg", "mamba1", "mamba1-norms", "mamba1-unit-norms"])
def test_matches_the_token_loop_over_packed_documents(cfg):
    cu = torch.tensor([0, 5, 5, 19, 20, 31], dtype=torch.int32)
    x = torch.randn(31, H)
    p = _params(cfg)
    y, stats = linear_attention(x, p, cfg, _ctx(cu, 31))
    assert stats.is_empty()
    torch.testing.assert_close(y.double(), _loop(x, p, cfg, cu), rtol=2e-4, atol=2e-5)


def test_documents_do_not_see_each_other():
    """A document's outputs and its parameters' gradients are those of the document alone."""
    cu = torch.tensor([0, 9, 26], dtype=torch.int32)
    x = torch.randn(26, H, requires_grad=True)
    p = _params(seed=1)
    grad = torch.randn(26, H)
    y, _ = linear_attention(x, p, CFG, _ctx(cu, 26))
    (y * grad).sum().backward()
    gx = x.grad.clone()
    for a, b in ((0, 9), (9, 26)):
        xa = x.detach()[a:b].clone().requires_grad_()
        ya, _ = linear_attention(xa, p, CFG, _ctx(torch.tensor([0, b - a], dtype=torch.int32), b - a))
        torch.testing.assert_close(ya, y[a:b], rtol=1e-5, atol=1e-6)
        (ya * grad[a:b]).sum().backward()
        torch.testing.assert_close(xa.grad, gx[a:b], rtol=1e-4, atol=1e-5)  # chunks cut elsewhere: rounding


def _matches_module(ref, p, cfg):
    """fmoe's layer with the params p (ref's weights in fmoe's layout) gives transformers'
    module ref's outputs on two sequences of 70 tokens, computed in float64 (ref run in float64:
    fmoe's float32 against the exact values, not against the reference's own float32 rounding,
    which reaches 1.5e-5 on outputs of a few units where fmoe's is 5e-6; the largest of fmoe's
    over every module here is 1.2e-5, on an AVX-512 CPU)."""
    x = torch.randn(2, 70, H)
    with torch.no_grad():
        exact = copy.deepcopy(ref).double()(x.double())
        for b in range(2):
            got, _ = linear_attention(x[b], p, cfg, _ctx(torch.tensor([0, 70], dtype=torch.int32), 70))
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), exact[b], rtol=1e-4, atol=3e-5)


def test_matches_transformers_qwen3_5_gated_delta_net():
    """transformers' Qwen3.5 module (its torch fallback), weights copied into fmoe's layout:
    in_proj_qkv's rows are q, k and v; conv1d [C, 1, K]'s channels likewise."""
    qwen = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", reason="transformers (the test extra) not installed")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    hf_cfg = Qwen3_5MoeTextConfig(hidden_size=H, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])
    ref = _randomized(qwen.Qwen3_5MoeGatedDeltaNet(hf_cfg, 0))
    Ck, Cv = 16, 24
    qkv = ref.in_proj_qkv.weight.t()
    conv = ref.conv1d.weight[:, 0, :].t()  # [K, C]
    p = dict(wq=qkv[:, :Ck], wk=qkv[:, Ck:2 * Ck], wv=qkv[:, 2 * Ck:], wz=ref.in_proj_z.weight.t(), wb=ref.in_proj_b.weight.t(),
             wa=ref.in_proj_a.weight.t(), conv_q=conv[:, :Ck], conv_k=conv[:, Ck:2 * Ck], conv_v=conv[:, 2 * Ck:], A_log=ref.A_log,
             dt_bias=ref.dt_bias, out_norm=ref.norm.weight, wo=ref.out_proj.weight.t())
    _matches_module(ref, p, dataclasses.replace(CFG, norm_eps=hf_cfg.rms_norm_eps, chunk_size=64))


def test_matches_transformers_olmo_hybrid_gated_delta_net():
    """transformers' OLMo Hybrid module (its torch fallback), weights copied into fmoe's layout:
    q_proj, k_proj, v_proj, g_proj (wz), b_proj, a_proj apart, one conv1d [C, 1, K] over q, k
    and v, beta = 2 sigmoid(x wb) (linear_allow_neg_eigval), o_norm's eps 1e-5; without
    neg_eigval fmoe's output moves."""
    olmo = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid", reason="transformers (the test extra) not installed")
    from transformers import OlmoHybridConfig

    hf_cfg = OlmoHybridConfig(hidden_size=H, num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                              linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              pad_token_id=None, eos_token_id=None)
    ref = _randomized(olmo.OlmoHybridGatedDeltaNet(hf_cfg, 0))
    Ck = 16
    conv = ref.conv1d.weight[:, 0, :].t()  # [K, C]
    p = dict(wq=ref.q_proj.weight.t(), wk=ref.k_proj.weight.t(), wv=ref.v_proj.weight.t(), wz=ref.g_proj.weight.t(), wb=ref.b_proj.weight.t(),
             wa=ref.a_proj.weight.t(), conv_q=conv[:, :Ck], conv_k=conv[:, Ck:2 * Ck], conv_v=conv[:, 2 * Ck:], A_log=ref.A_log,
             dt_bias=ref.dt_bias, out_norm=ref.o_norm.weight, wo=ref.o_proj.weight.t())
    cfg = dataclasses.replace(NEG, norm_eps=1e-5, chunk_size=64)
    _matches_module(ref, p, cfg)
    x = torch.randn(1, 20, H)
    ctx = _ctx(torch.tensor([0, 20], dtype=torch.int32), 20)
    with torch.no_grad():
        want = ref(x)[0]
        assert (linear_attention(x[0], p, dataclasses.replace(cfg, neg_eigval=False), ctx)[0] - want).abs().max() > 1e-2


def test_matches_transformers_kimi_delta_attention():
    """transformers' Kimi Linear module (its torch fallback), weights copied into fmoe's
    layout: the q, k, v convolutions [C, 1, K], A_log [1, 1, N, 1], the low-rank decay
    (f_a, f_b) and gate (g_a, g_b)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear", reason="transformers (the test extra) not installed")
    from transformers import KimiLinearConfig

    hf_cfg = KimiLinearConfig(hidden_size=H, linear_num_heads=3, linear_head_dim=8, linear_conv_kernel_dim=3, num_hidden_layers=1,
                              layer_types=["linear_attention"], mlp_layer_types=["dense"])
    torch.manual_seed(0)
    ref = kimi.KimiLinearDeltaAttention(hf_cfg, 0)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.normal_(0, 0.3)
        ref.forget_gate.A_log.copy_(torch.log(torch.rand(1, 1, 3, 1) * 15 + 1))
    t = lambda m: m.weight.t()  # noqa: E731
    conv = lambda m: m.weight[:, 0, :].t()  # noqa: E731  [K, C]
    gate = ref.forget_gate
    p = dict(wq=t(ref.q_proj), wk=t(ref.k_proj), wv=t(ref.v_proj), wz_a=t(ref.g_a_proj), wz_b=t(ref.g_b_proj), wb=t(ref.b_proj),
             wf_a=t(gate.f_a_proj), wf_b=t(gate.f_b_proj), A_log=gate.A_log.flatten(), dt_bias=gate.dt_bias, out_norm=ref.o_norm.weight,
             wo=t(ref.o_proj))
    convs = conv(ref.conv1d)  # q's, k's, v's channels
    p.update(conv_q=convs[:, :24], conv_k=convs[:, 24:48], conv_v=convs[:, 48:])
    _matches_module(ref, p, LinearAttentionConfig(n_k_heads=3, n_v_heads=3, k_head_dim=8, v_head_dim=8, conv=3, norm_eps=hf_cfg.rms_norm_eps,
                                                  kind="kda"))


def test_matches_transformers_lfm2_short_conv():
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    torch.manual_seed(0)
    hf_cfg = transformers.Lfm2Config(hidden_size=H, conv_L_cache=3, num_hidden_layers=1, layer_types=["conv"])
    ref = Lfm2ShortConv(hf_cfg, 0).eval()
    with torch.no_grad():
        for w in ref.parameters():
            w.normal_(0.0, 0.3)
    B, C, X = ref.in_proj.weight.t().detach().chunk(3, dim=1)  # in_proj's rows: B, C, x
    p = dict(wb=B, wc=C, wv=X, conv_v=ref.conv.weight.detach()[:, 0].t(), wo=ref.out_proj.weight.t().detach())
    _matches_module(ref, p, LinearAttentionConfig(n_k_heads=H, n_v_heads=H, k_head_dim=1, v_head_dim=1, conv=3, kind="short_conv"))


@pytest.mark.parametrize("cfg", [CFG, KDA, LING, SHORT, LIGHT, MAMBA, MAMBA_UNNORMED, NEG, MAMBA1_NORMS],
                         ids=["gated-deltanet", "kda", "kda-ling", "short-conv", "lightning", "mamba2", "mamba2-no-norm", "gated-deltanet-neg", "mamba1"])
def test_decoding_continues_the_states(cfg):
    """A prompt, then steps of one token, of two sequences at once through LinearStates,
    equal each whole sequence's outputs; the conv state holds the last K - 1 projections."""
    p = {n: t.detach() for n, t in _params(cfg, seed=2).items()}
    x = torch.randn(2, 13, H)
    whole = [linear_attention(x[b], p, cfg, _ctx(torch.tensor([0, 13], dtype=torch.int32), 13))[0] for b in range(2)]
    C = cfg.conv_channels
    states = LinearStates(torch.zeros(2, cfg.conv - 1, C), torch.zeros(2, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim))
    ctx = dataclasses.replace(_ctx(torch.tensor([0, 1], dtype=torch.int32), 1), linear_states=states, cu_seqlens=None)
    outs = [linear_attention(x[:, :9].reshape(18, H), p, cfg, ctx)[0].view(2, 9, H)]
    for t in range(9, 13):
        outs.append(linear_attention(x[:, t], p, cfg, ctx)[0].view(2, 1, H))
    got = torch.cat(outs, dim=1)
    for b in range(2):
        torch.testing.assert_close(got[b], whole[b], rtol=1e-5, atol=1e-6)
    def inputs(rows):  # what the convolution reads: q, k and v's projections (Mamba-2's C, B, x), or the short convolution's gated input; none (lightning)
        if cfg.kind in ("lightning", "mamba1"):  # none, or Mamba-1's x alone
            return rows @ p["wv"] if cfg.kind == "mamba1" else rows[..., :0]
        return (rows @ p["wb"]) * (rows @ p["wv"]) if cfg.kind == "short_conv" else torch.cat([rows @ p[n] for n in ("wq", "wk", "wv")], dim=-1)

    torch.testing.assert_close(states.conv, inputs(x[:, 14 - cfg.conv:13]))
    # rows after `tokens` are padding (decoding under tensor parallelism): outputs 0, the states those of the real rows
    padded = LinearStates(torch.zeros_like(states.conv), torch.zeros_like(states.state), tokens=18)
    y, _ = linear_attention(torch.cat([x[:, :9].reshape(18, H), x[:1, 8]]), p, cfg, dataclasses.replace(ctx, linear_states=padded))
    torch.testing.assert_close(y[:18], outs[0].reshape(18, H))
    assert y.shape == (19, H) and not y[18].any()
    torch.testing.assert_close(padded.conv, inputs(x[:, 10 - cfg.conv:9]))


def test_matches_transformers_minimax_lightning_attention():
    """transformers' MiniMax module (its blocks of block_size tokens, 5 here, over 70), weights
    copied into fmoe's layout: qkv_proj's rows per head its q's, k's and v's; the decay of
    its layer (2 of 4) its slope_rate buffer, negated."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    hf_cfg = transformers.MiniMaxConfig(hidden_size=H, num_attention_heads=3, head_dim=8, num_hidden_layers=4, block_size=5)
    torch.manual_seed(0)
    ref = MiniMaxLightningAttention(hf_cfg, 2).eval()
    with torch.no_grad():
        for w in ref.parameters():
            w.normal_(0.0, 0.3)
    assert torch.equal(ref.slope_rate.flatten(), -lightning_decay(3, 2, 4))
    t = lambda m: m.weight.t().detach()  # noqa: E731
    q, k, v = t(ref.qkv_proj).view(H, 3, 3, 8).unbind(2)  # per head: q, k, v
    p = dict(wq=q.reshape(H, 24), wk=k.reshape(H, 24), wv=v.reshape(H, 24), wz=t(ref.output_gate), out_norm=ref.norm.weight.detach(),
             wo=t(ref.out_proj), decay=lightning_decay(3, 2, 4))
    x = torch.randn(2, 70, H)
    cos_sin = (torch.ones(1, 70, 8), torch.zeros(1, 70, 8))
    with torch.no_grad():
        want = ref(x, cos_sin, None)[0]
    for b in range(2):
        got, _ = linear_attention(x[b], p, LIGHT, _ctx(torch.tensor([0, 70], dtype=torch.int32), 70))
        torch.testing.assert_close(got, want[b], rtol=1e-4, atol=1e-5)


def _mamba2_params(ref) -> dict:
    """A transformers Mamba-2 mixer's weights (4 heads of 6, 2 groups of 8) in fmoe's layout:
    in_proj's rows are z, x, B, C and dt; conv1d [C, 1, K] over x, B, C with its bias; its
    gated norm's weight where it has one."""
    t = lambda m: m.weight.t().detach()  # noqa: E731
    z, xs, Bm, C, dt = t(ref.in_proj).split([24, 24, 16, 16, 4], dim=1)
    conv, bias = ref.conv1d.weight.detach()[:, 0].t(), ref.conv1d.bias.detach()  # [K, x | B | C]
    return dict(wq=C, wk=Bm, wv=xs, wz=z, wa=dt, conv_q=conv[:, 40:], conv_k=conv[:, 24:40], conv_v=conv[:, :24], conv_q_bias=bias[40:],
                conv_k_bias=bias[24:40], conv_v_bias=bias[:24], A_log=ref.A_log.detach(), dt_bias=ref.dt_bias.detach(), D=ref.D.detach(),
                **({"out_norm": ref.norm.weight.detach()} if hasattr(ref.norm, "weight") else {}), wo=t(ref.out_proj))  # none: Falcon-H1's unnormed


def _randomized(ref):
    """ref with every weight drawn from N(0, 0.3^2), A = exp(A_log) in [1, 16]."""
    torch.manual_seed(0)
    with torch.no_grad():
        for w in ref.parameters():
            w.normal_(0.0, 0.3)
        ref.A_log.copy_(torch.log(torch.rand(4) * 15 + 1))
    return ref.eval()


def test_matches_transformers_granite_4_mamba2_mixer():
    """transformers' Granite 4.0-H Mamba-2 layer (its torch fallback: chunks of 16 over 70
    tokens), weights copied into fmoe's layout (_mamba2_params); the gated norm per group."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    hf_cfg = transformers.GraniteMoeHybridConfig(hidden_size=H, mamba_n_heads=4, mamba_d_head=6, mamba_expand=1, mamba_n_groups=2,
                                                 mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16, num_hidden_layers=1,
                                                 layer_types=["mamba"])
    ref = _randomized(GraniteMoeHybridMambaLayer(hf_cfg, 0))
    _matches_module(ref, _mamba2_params(ref), dataclasses.replace(MAMBA, norm_eps=hf_cfg.rms_norm_eps, impl="torch"))


def test_matches_transformers_nemotron_h_mamba2_mixer():
    """transformers' Nemotron-H Mamba-2 mixer (its torch fallback), whose dt has the floor
    time_step_min (0.7 here, binding for some tokens and heads): fmoe's mamba2 with dt_min."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hf_cfg = transformers.NemotronHConfig(hidden_size=H, mamba_num_heads=4, mamba_head_dim=6, n_groups=2, ssm_state_size=8, conv_kernel=4,
                                          chunk_size=16, time_step_min=0.7, layers_block_type=["linear_attention"])
    ref = _randomized(NemotronHMamba2Mixer(hf_cfg, 0))
    p = _mamba2_params(ref)
    x = torch.randn(70, H)
    assert 0 < float((F.softplus(x @ p["wa"] + p["dt_bias"]) < 0.7).float().mean()) < 1  # the floor binds, not everywhere
    _matches_module(ref, p, dataclasses.replace(MAMBA, norm_eps=hf_cfg.layer_norm_epsilon, dt_min=0.7, impl="torch"))


@pytest.mark.parametrize("rms_norm,before", [(False, True), (True, True), (True, False)], ids=["no-norm", "norm-before-gate", "norm-after-gate"])
def test_matches_transformers_falcon_h1_mamba2_mixer(rms_norm, before):
    """transformers' Falcon-H1 mixer (its torch path), whose output norm is optional
    (mamba_rms_norm) and may come before the gate (mamba_norm_before_gate): fmoe's mamba2
    with gate_norm "none", "before" or "after"; x's channels (mamba_d_ssm, 24) apart from
    hidden_size. Its multipliers are 1 here (fmoe.hf folds them into the weights)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    hf_cfg = transformers.FalconH1Config(hidden_size=H, mamba_d_ssm=24, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                                         mamba_chunk_size=16, num_hidden_layers=1, mamba_rms_norm=rms_norm, mamba_norm_before_gate=before)
    ref = FalconH1Mixer(hf_cfg, 0)
    ref.register_buffer("mup_vector", compute_mup_vector(hf_cfg), persistent=False)
    ref = _randomized(ref)
    p = _mamba2_params(ref)
    assert ("out_norm" in p) == rms_norm
    gate_norm = "none" if not rms_norm else "before" if before else "after"
    _matches_module(ref, p, dataclasses.replace(MAMBA, norm_eps=hf_cfg.rms_norm_eps, gate_norm=gate_norm, impl="torch"))


def _mamba1_params(ref) -> dict:
    """A transformers Mamba-1 mixer's weights (12 channels, a state of 8, dt of rank 3) in
    fmoe's layout: in_proj's rows are x and z; conv1d [C, 1, K] with its bias; x_proj's rows
    dt, B and C; dt_proj's weight and bias; Jamba's norms' weights where it has them."""
    t = lambda m: m.weight.t().detach()  # noqa: E731
    xs, z = t(ref.in_proj).chunk(2, dim=1)
    dt, Bm, C = t(ref.x_proj).split([3, 8, 8], dim=1)
    norms = {}
    if isinstance(getattr(getattr(ref, "dt_layernorm", None), "weight", None), torch.nn.Parameter):  # Jamba's (Falcon Mamba's are weightless buffers)
        norms = dict(dt_norm=ref.dt_layernorm.weight.detach(), b_norm=ref.b_layernorm.weight.detach(), c_norm=ref.c_layernorm.weight.detach())
    return dict(wv=xs, wz=z, conv_v=ref.conv1d.weight.detach()[:, 0].t(), conv_v_bias=ref.conv1d.bias.detach(), wdt=dt, wk=Bm, wq=C,
                wa=t(ref.dt_proj), dt_bias=ref.dt_proj.bias.detach(), A_log=ref.A_log.detach(), D=ref.D.detach(), **norms, wo=t(ref.out_proj))


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba"])
def test_matches_transformers_mamba1_mixer(family):
    """transformers' Mamba-1 mixers (their torch selective scan, token by token): Mamba's
    (no norms: fmoe's mamba1), Falcon Mamba's (dt, B and C RMS-normed without weights:
    dt_bc_norm "rms_unit") and Jamba's (with weights: "rms"), weights copied into fmoe's
    layout (_mamba1_params), A = exp(A_log) in [1, 16] per channel and state channel."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    if family == "jamba":
        from transformers.models.jamba.modeling_jamba import JambaMambaMixer as Mixer
        hf_cfg, norm, eps = transformers.JambaConfig(hidden_size=H, mamba_expand=1, mamba_d_state=8, mamba_d_conv=4, mamba_dt_rank=3,
                                                     num_hidden_layers=1, attn_layer_period=2, attn_layer_offset=1), "rms", "rms_norm_eps"
    else:
        from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
        from transformers.models.mamba.modeling_mamba import MambaMixer
        config = transformers.FalconMambaConfig if family == "falcon_mamba" else transformers.MambaConfig
        hf_cfg = config(hidden_size=H, state_size=8, expand=1, conv_kernel=4, time_step_rank=3, num_hidden_layers=1)
        Mixer, norm, eps = (FalconMambaMixer, "rms_unit", "mixer_rms_eps") if family == "falcon_mamba" else (MambaMixer, "none", "layer_norm_epsilon")
    # Falcon Mamba's own initialisation (its constructor's default) reads its norms before it makes them; the weights are drawn here
    ref = Mixer(hf_cfg, 0) if family == "jamba" else Mixer(hf_cfg, 0, initialize_mixer_weights=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for w in ref.parameters():
            w.normal_(0.0, 0.3)
        ref.A_log.copy_(torch.log(torch.rand(H, 8) * 15 + 1))
    p = _mamba1_params(ref.eval())
    assert ("dt_norm" in p) == (family == "jamba")
    cfg = dataclasses.replace(MAMBA1, n_v_heads=H, dt_bc_norm=norm, norm_eps=getattr(hf_cfg, eps), impl="torch")
    _matches_module(ref, p, cfg)


def test_lightning_decay():
    """MiniMax's slopes: 2^(-8/N) to the powers 1 .. N, times 1 - layer / (L - 1 + 1e-5) + 1e-5
    (negated: log-decays); checked arguments."""
    want = -torch.tensor([2.0 ** (-8 / 4 * (h + 1)) for h in range(4)]) * (1 - 1 / (3 + 1e-5) + 1e-5)
    torch.testing.assert_close(lightning_decay(4, 1, 4), want)
    assert lightning_decay(4, 0, 1).dtype == torch.float32 and bool((lightning_decay(8, 5, 6) < 0).all())
    for args, match in (((4, 4, 4), r"layer: expected an int in \[0, 4\), got 4"), ((0, 0, 4), r"n_heads: expected >= 1"),
                        ((4, 0, 0), r"n_layers: expected >= 1")):
        with pytest.raises(ValueError, match=match):
            lightning_decay(*args)


def test_bf16():
    """bf16 weights and inputs stay bf16 and follow the float32 computation on the same
    (rounded) values: the layer computes its conv, norms, gates and rule in float32."""
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    x = torch.randn(30, H).bfloat16()
    p = {n: t.detach().bfloat16() for n, t in _params(seed=3).items()}
    want, _ = linear_attention(x.float(), {n: t.float() for n, t in p.items()}, CFG, _ctx(cu, 30))
    got, _ = linear_attention(x, p, CFG, _ctx(cu, 30))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).norm() / want.norm() < 0.03  # the bf16 projections rounded: about 1%


@pytest.mark.parametrize("change,match", [
    (dict(n_v_heads=3), r"n_v_heads: 3 value heads do not split over 2 key heads"),
    (dict(conv=0), r"conv: expected >= 1"),
    (dict(norm_eps=0.0), r"norm_eps: expected a positive number"),
    (dict(kind="mamba"), r"kind: expected one of \('gated_deltanet', 'kda', 'short_conv', 'lightning', 'mamba2', 'mamba1'\), got 'mamba'"),
    (dict(dt_rank=2), r"dt_rank: a knob of Mamba-1's mixer, needs kind 'mamba1', got 'gated_deltanet'"),
    (dict(dt_bc_norm="rms"), r"dt_bc_norm: a knob of Mamba-1's mixer, needs kind 'mamba1', got 'gated_deltanet'"),
    (dict(dt_bc_norm="layer"), r"dt_bc_norm: expected one of \('none', 'rms', 'rms_unit'\) \(Mamba-1's RMS norms on dt, B and C: none, with "
                               r"weights, without\), got 'layer'"),
    (dict(kind="mamba1", n_k_heads=1, v_head_dim=1), r"dt_rank: expected an int >= 1 \(the rank of Mamba-1's dt projection\), got None"),
    (dict(kind="mamba1", n_k_heads=1, v_head_dim=1, dt_rank=True), r"dt_rank: expected an int >= 1"),
    (dict(kind="mamba1", dt_rank=2), r"n_k_heads / v_head_dim: Mamba-1's B and C are one group of k_head_dim \(its state\) read by n_v_heads "
                                     r"channels of one dim each, got 2 groups and channels of 6"),
    (dict(kind="mamba2", gate_norm="first"), r"gate_norm: expected one of \('after', 'before', 'none'\) \(Mamba-2's output norm after its gate, "
                                             r"before it, or none\), got 'first'"),
    (dict(gate_norm="none"), r"gate_norm: where Mamba-2's output norm sits, needs kind 'mamba2', got 'gated_deltanet'"),
    (dict(kind="lightning"), r"n_k_heads / k_head_dim: lightning attention has as many key as value heads, of one dim, got 2 x 8 beside 4 x 6"),
    (dict(kind="short_conv"), r"n_k_heads / k_head_dim: a short convolution's channels are n_v_heads x v_head_dim, the key fields the same, got 2 x 8"),
    (dict(kind="kda"), r"n_v_heads: Kimi Delta Attention has as many key as value heads, got 2 and 4"),
    (dict(full_rank=True), r"full_rank: a variant of Kimi Delta Attention, needs kind 'kda', got 'gated_deltanet'"),
    (dict(decay_bound=-5.0), r"decay_bound: a variant of Kimi Delta Attention, needs kind 'kda', got 'gated_deltanet'"),
    (dict(full_rank=1), r"full_rank: expected a bool, got 1"),
    (dict(decay_bound=0.0), r"decay_bound: expected None or a finite number < 0 \(the bounded decay's least log-decay\), got 0.0"),
    (dict(decay_bound=float("-inf")), r"decay_bound: expected None or a finite number < 0"),
    (dict(dt_min=0.1), r"dt_min: the floor of Mamba-2's dt, needs kind 'mamba2', got 'gated_deltanet'"),
    (dict(dt_min=-0.1), r"dt_min: expected a finite number >= 0 \(Mamba-2's floor of dt; 0: none\), got -0.1"),
    (dict(neg_eigval=1), r"neg_eigval: expected a bool, got 1"),
    (dict(kind="mamba2", neg_eigval=True), r"neg_eigval: the delta rule's write strength in \[0, 2\], needs kind 'gated_deltanet' or 'kda', got 'mamba2'"),
    (dict(kind="short_conv", n_k_heads=4, k_head_dim=6, neg_eigval=True), r"neg_eigval: .* needs kind 'gated_deltanet' or 'kda', got 'short_conv'"),
    (dict(gate_norm="before"), r"gate_norm: where Mamba-2's output norm sits, needs kind 'mamba2', got 'gated_deltanet'"),
    (dict(kind="mamba2", dt_min=float("inf")), r"dt_min: expected a finite number >= 0 .*, got inf"),
    (dict(kind="mamba2", dt_min=True), r"dt_min: expected a finite number >= 0 .*, got True"),
    (dict(impl="cuda"), r"impl: expected one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    (dict(kind="kda", n_v_heads=2, decay_bound="-1"), r"decay_bound: expected None or a finite number < 0 .*, got '-1'"),
    (dict(kind="lightning", n_v_heads=2), r"n_k_heads / k_head_dim: lightning attention has as many key as value heads, of one dim, got 2 x 8 beside 2 x 6"),
    (dict(kind="short_conv", n_v_heads=2), r"n_k_heads / k_head_dim: a short convolution's channels .* got 2 x 8 beside 2 x 6"),
    (dict(chunk_size=0), r"chunk_size: expected >= 1, got 0"),
    (dict(k_head_dim=0), r"k_head_dim: expected >= 1, got 0"),
    (dict(norm_eps=float("inf")), r"norm_eps: expected a positive number, got inf"),
    (dict(kind="mamba1", n_k_heads=1, v_head_dim=1, dt_rank=0), r"dt_rank: expected an int >= 1 .*, got 0"),
    (dict(kind="mamba1", n_k_heads=1, dt_rank=2), r"n_k_heads / v_head_dim: .* got 1 groups and channels of 6"),
])
def test_config_checks(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **change)


def test_argument_checks():
    x = torch.randn(5, H)
    p = _params()
    ctx = _ctx(torch.tensor([0, 5], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=r"params\['wz'\]: expected a tensor \[24, 24\]"):
        linear_attention(x, dict(p, wz=p["wz"][:, :3]), CFG, ctx)
    with pytest.raises(ValueError, match=r"ctx: linear attention needs the micro-batch's cu_seqlens"):
        linear_attention(x, p, CFG, dataclasses.replace(ctx, cu_seqlens=None))
    light = _params(LIGHT)
    with pytest.raises(ValueError, match=r"params\['decay'\]: expected lightning attention's log-decay per head, a tensor \[3\]"):
        linear_attention(x, dict(light, decay=light["decay"][:2]), LIGHT, ctx)
    with pytest.raises(ValueError, match=r"heads_mean: expected a function of a \[T, n\] tensor"):
        linear_attention(x, light, LIGHT, ctx, heads_mean=2.0)
    with pytest.raises(ValueError, match=r"heads_sum: expected a function of a \[T, n\] tensor \(fmoe.parallel.HeadShard.sum\) or None, got int"):
        linear_attention(x, _params(MAMBA1), MAMBA1, ctx, heads_sum=2)
    with pytest.raises(ValueError, match=r"ctx.linear_cp: lightning needs its gated_linear_attention"):
        class OldCP:  # a context-parallel exchange without the rule-free form
            token_index = conv_halo = gated_delta_rule = staticmethod(lambda *a, **k: None)
        linear_attention(x, light, LIGHT, dataclasses.replace(ctx, linear_cp=OldCP()))
    with pytest.raises(ValueError, match=r"ctx.linear_cp: mamba1 needs its selective_scan \(fmoe.parallel.ContextParallel\), got OldCP without it"):
        linear_attention(x, _params(MAMBA1), MAMBA1, dataclasses.replace(ctx, linear_cp=OldCP()))
    with pytest.raises(ValueError, match=r"cfg: expected a LinearAttentionConfig"):
        linear_attention(x, p, AttentionConfig(n_heads=1, n_kv_heads=1, head_dim=2), ctx)
    bad = LinearStates(torch.zeros(2, 2, 64), torch.zeros(2, 4, 8, 6))
    with pytest.raises(ValueError, match=r"ctx.linear_states: conv \[2, 2, 64\]"):
        linear_attention(x, p, CFG, dataclasses.replace(ctx, linear_states=bad))
    unequal = LinearStates(torch.zeros(1, 3, 40), torch.zeros(2, 4, 8, 6))  # one sequence's conv, two sequences' states
    with pytest.raises(ValueError, match=r"ctx.linear_states: conv \[1, 3, 40\] and state \[2, 4, 8, 6\] do not fit 5 tokens"):
        linear_attention(x, p, CFG, dataclasses.replace(ctx, linear_states=unequal))
    # x's rows against the context's tokens (its cu_seqlens would describe other tokens: 4 of 5 ran, 6 an IndexError)
    for T in (4, 6):
        with pytest.raises(ValueError, match=rf"ctx: built for 5 tokens \(its RoPE tables' rows\), x has {T}"):
            linear_attention(torch.randn(T, H), p, CFG, ctx)
    # params: a mapping of tensors in x's dtype (torch's matmul error, or an AttributeError, before)
    with pytest.raises(ValueError, match=r"params\['wq'\]: expected x's dtype torch.float32, got torch.bfloat16"):
        linear_attention(x, {n: t.detach().bfloat16() for n, t in p.items()}, CFG, ctx)
    with pytest.raises(ValueError, match=r"params: expected a dict of tensors \(linear_attention_shapes' names\), got list"):
        linear_attention(x, list(p.values()), CFG, ctx)
    # decoding's states: a LinearStates of tensors, tokens within x's rows (a TypeError, an AttributeError or silence before)
    good = dict(conv=torch.zeros(1, 3, 56), state=torch.zeros(1, 4, 8, 6))
    for states, said in ((LinearStates(**good, tokens="2"), r"ctx.linear_states.tokens: expected None or an int in 0..5 .*, got '2'"),
                         (LinearStates(**good, tokens=-1), r"ctx.linear_states.tokens: .* got -1"),
                         (LinearStates(**good, tokens=7), r"ctx.linear_states.tokens: .* got 7"),
                         (LinearStates(**dict(good, conv=None)), r"ctx.linear_states: expected a LinearStates of conv and state tensors "
                                                                  r"\(fmoe.model.KVCache's\), got conv NoneType, state Tensor"),
                         (tuple(good.values()), r"ctx.linear_states: expected a LinearStates .*, got tuple")):
        with pytest.raises(ValueError, match=said):
            linear_attention(x, p, CFG, dataclasses.replace(ctx, linear_states=states))
    with pytest.raises(ValueError, match=r"params\['wz'\]: expected x's dtype torch.float32, got torch.bfloat16"):
        linear_attention(x, dict(p, wz=p["wz"].detach().bfloat16()), CFG, ctx)
    # two sequences' states and 5 tokens: not T / 2 each
    with pytest.raises(ValueError, match=r"ctx.linear_states: conv \[2, 3, 56\] and state \[2, 4, 8, 6\] do not fit 5 tokens of cfg's layer "
                                         r"\(expected \[S, 3, 56\], T a multiple of S\)"):
        linear_attention(x, p, CFG, dataclasses.replace(ctx, linear_states=LinearStates(torch.zeros(2, 3, 56), torch.zeros(2, 4, 8, 6))))
    with pytest.raises(ValueError, match=r"ctx: a context-parallel context \(gather_kv\) without linear_cp: linear attention needs the rule's exchange"):
        linear_attention(x, p, CFG, dataclasses.replace(ctx, gather_kv=lambda k, v: (k, v)))


@pytest.mark.parametrize("cfg", [CFG, MAMBA, MAMBA1, SHORT, LIGHT, KDA], ids=lambda c: c.kind)
def test_no_token(cfg):
    """T = 0 (a rank's empty share, an empty micro-batch): an empty output, as every kind gives
    (Mamba-1's reshape of 0 elements into [1, 0, -1] raised before)."""
    p = _params(cfg)
    y, _ = linear_attention(torch.randn(0, H), p, cfg, _ctx(torch.tensor([0, 0], dtype=torch.int32), 0))
    assert y.shape == (0, H)
    y.sum().backward()
    assert all(t.grad is None or not t.grad.any() for t in p.values() if t.requires_grad)


def test_config_defaults():
    cfg = LinearAttentionConfig(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6)
    assert (cfg.conv, cfg.norm_eps, cfg.chunk_size, cfg.impl, cfg.kind) == (4, 1e-6, 64, "auto", "gated_deltanet")
    assert (cfg.gate_norm, cfg.dt_bc_norm) == ("after", "none")
    assert (cfg.full_rank, cfg.decay_bound, cfg.dt_min, cfg.neg_eigval, cfg.dt_rank, cfg.fp8) == (False, None, 0.0, False, None, False)
    assert (cfg.k_channels, cfg.v_channels, cfg.conv_channels) == (16, 24, 56)
    assert (SHORT.conv_channels, LIGHT.conv_channels, MAMBA.conv_channels, MAMBA1.conv_channels) == (16, 0, 56, 12)


def test_lightning_decay_refuses_a_negative_or_bool_layer():
    for layer in (-1, True):
        with pytest.raises(ValueError, match=rf"layer: expected an int in \[0, 4\), got {layer}"):
            lightning_decay(4, layer, 4)


class _OneProcessSplit:
    """fmoe.parallel.ContextParallel's exchange as cp rank `rank` of `cp` in one process: conv_halo
    records each rank's rows (rows, shared by the ranks) and reads the K - 1 rows before each chunk
    from them (zeros where not recorded yet: run every rank twice); the rules over the whole
    split, at cp = 1 only."""

    def __init__(self, cp, rank, rows):
        self.cp, self.rank, self.rows = cp, rank, rows

    def token_index(self, n_local, device=None):
        return cp_token_index(n_local * self.cp, self.cp, self.rank, device=device)

    def conv_halo(self, x, n):
        index = self.token_index(x.shape[0]).tolist()
        self.rows.update(zip(index, x.detach()))
        L = x.shape[0] // 2
        return torch.stack([torch.stack([self.rows.get(i, x.new_zeros(x.shape[1])) for i in range(s - n, s)]) if n else x.new_zeros(0, x.shape[1])
                            for s in (index[0], index[L])])

    def gated_delta_rule(self, *args, **kwargs):
        assert self.cp == 1
        return gated_delta_rule(*args, **kwargs)

    def gated_linear_attention(self, *args, **kwargs):
        assert self.cp == 1
        return gated_linear_attention(*args, **kwargs)

    def selective_scan(self, *args, **kwargs):
        assert self.cp == 1
        return selective_scan(*args, **kwargs)


def _over_split(cfg, cp, p, x, cu):
    """linear_attention over a context-parallel split of x's T tokens (documents cu) in one
    process (_OneProcessSplit): each rank's rows of its outputs, in rank order, and their indices."""
    T, rows = x.shape[0], {}
    positions = torch.cat([torch.arange(int(b) - int(a)) for a, b in zip(cu[:-1], cu[1:])])
    for _ in range(2):
        ys, index = [], []
        for rank in range(cp):
            split = _OneProcessSplit(cp, rank, rows)
            i = split.token_index(T // cp)
            ctx = attention_context(cu, positions[i], AttentionConfig(n_heads=1, n_kv_heads=1, head_dim=2, impl="torch"), token_index=i,
                                    kv_index=cp_kv_index(T, cp), gather_kv=lambda k, v: (k, v), linear_cp=split)
            ys.append(linear_attention(x[i], p, cfg, ctx)[0])
            index.append(i)
    return torch.cat(ys), torch.cat(index)


@pytest.mark.parametrize("cfg", [SHORT, dataclasses.replace(MAMBA1, conv=3)], ids=["short-conv", "mamba1"])
def test_convolution_over_a_context_parallel_split_reads_the_rows_before_each_chunk(cfg):
    """Over 2 ranks (chunks 0, 3 and 1, 2 of 6 tokens), documents of 7, 4 and 13 tokens: the
    short convolution's rows (no rule) equal the whole batch's; Mamba-1's (whose scan needs the
    whole split) over cp = 1 (its chunks 12 tokens each, a document across the two)."""
    cu = torch.tensor([0, 7, 11, 24], dtype=torch.int32)
    x = torch.randn(24, H)
    p = {n: t.detach() for n, t in _params(cfg).items()}
    whole, _ = linear_attention(x, p, cfg, _ctx(cu, 24))
    y, index = _over_split(cfg, 2 if cfg.kind == "short_conv" else 1, p, x, cu)
    torch.testing.assert_close(y, whole[index], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [CFG, LIGHT, MAMBA], ids=lambda c: c.kind)
def test_rules_over_a_context_parallel_split_of_one_rank(cfg):
    """cp = 1 through linear_cp (the convolution's halos from the chunk before, the rule across the
    split): the whole batch's outputs, documents cut by the chunks' boundary (12) and not."""
    cu = torch.tensor([0, 3, 14, 24], dtype=torch.int32)
    x = torch.randn(24, H)
    p = {n: t.detach() for n, t in _params(cfg).items()}
    y, index = _over_split(cfg, 1, p, x, cu)
    torch.testing.assert_close(y, linear_attention(x, p, cfg, _ctx(cu, 24))[0], rtol=1e-5, atol=1e-6)


def _shard(p, cfg, shard, of):
    """Tensor parallelism's slice of the params (shard of `of`): the heads' (Mamba-1's channels')
    columns of the input projections (Mamba-1's rows of wdt, wk, wq), their rows of wo, their
    entries of the per-head weights."""
    def cut(t, dim):
        n = t.shape[dim] // of
        return t.narrow(dim, shard * n, n)
    rows = ("wo", "out_norm", "decay", "conv_v_bias", "wdt", "dt_bias", "A_log", "D") + (("wk", "wq") if cfg.kind == "mamba1" else ())
    whole = ("dt_norm", "b_norm", "c_norm")  # Mamba-1's norms of dt, B and C: after the sum over the shards
    return {n: t if n in whole else cut(t, 0 if n in rows else t.ndim - 1) for n, t in p.items()}


@pytest.mark.parametrize("cfg", [LIGHT, MAMBA1_NORMS], ids=["lightning", "mamba1"])
def test_tensor_parallel_shards_sum_to_the_whole_layer(cfg):
    """Lightning attention's heads (its norm over every head's channels through heads_mean) and
    Mamba-1's channels (dt, B and C from every channel through heads_sum) in 3 shards: the
    shards' outputs sum to the whole layer's. The collectives stand in with what the other
    shards gave (each shard run twice)."""
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    x = torch.randn(17, H)
    p = {n: t.detach() for n, t in _params(cfg).items()}
    whole, _ = linear_attention(x, p, cfg, _ctx(cu, 17))
    of, seen = 3, {}
    sub = dataclasses.replace(cfg, n_v_heads=cfg.n_v_heads // of, **({} if cfg.kind == "mamba1" else dict(n_k_heads=1)))
    for _ in range(2):
        ys = []
        for shard in range(of):
            def collective(t, shard=shard):
                seen[shard] = t
                return sum(seen.get(s, torch.zeros_like(t)) for s in range(of)) / (of if cfg.kind == "lightning" else 1)
            kw = dict(heads_mean=collective) if cfg.kind == "lightning" else dict(heads_sum=collective)
            ys.append(linear_attention(x, _shard(p, cfg, shard, of), sub, _ctx(cu, 17), **kw)[0])
    torch.testing.assert_close(sum(ys), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, MAMBA, MAMBA1, SHORT, LIGHT, KDA], ids=lambda c: c.kind)
def test_decoding_no_real_token_outputs_zeros_and_keeps_the_states(cfg):
    """Decoding with tokens=0 (every row padding) or x of no rows: zero outputs, the states
    as they were (a RuntimeError of a reshape of 0 elements, every kind but lightning, before)."""
    p = {n: t.detach() for n, t in _params(cfg, seed=6).items()}
    conv, state = torch.randn(2, cfg.conv - 1, cfg.conv_channels), torch.randn(2, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim)
    ctx = dataclasses.replace(_ctx(torch.tensor([0, 1], dtype=torch.int32), 1), cu_seqlens=None)
    for x, tokens in ((torch.randn(3, H), 0), (torch.randn(0, H), None), (torch.randn(0, H), 0)):
        states = LinearStates(conv.clone(), state.clone(), tokens=tokens)
        y, stats = linear_attention(x, p, cfg, dataclasses.replace(ctx, linear_states=states))
        assert y.shape == x.shape and y.dtype == x.dtype and not y.any() and not stats.keys()
        assert torch.equal(states.conv, conv) and torch.equal(states.state, state)


def test_decoding_with_one_tap():
    """conv = 1: no convolution state ([S, 0, C]), the prompt then single steps equal the whole sequences."""
    cfg = dataclasses.replace(CFG, conv=1)
    p = {n: t.detach() for n, t in _params(cfg, seed=4).items()}
    x = torch.randn(2, 7, H)
    whole = [linear_attention(x[b], p, cfg, _ctx(torch.tensor([0, 7], dtype=torch.int32), 7))[0] for b in range(2)]
    states = LinearStates(torch.zeros(2, 0, 56), torch.zeros(2, 4, 8, 6))
    ctx = dataclasses.replace(_ctx(torch.tensor([0, 1], dtype=torch.int32), 1), linear_states=states, cu_seqlens=None)
    outs = [linear_attention(x[:, :5].reshape(10, H), p, cfg, ctx)[0].view(2, 5, H)]
    for t in (5, 6):
        outs.append(linear_attention(x[:, t], p, cfg, ctx)[0].view(2, 1, H))
        assert states.conv.shape == (2, 0, 56)
    got = torch.cat(outs, dim=1)
    for b in range(2):
        torch.testing.assert_close(got[b], whole[b], rtol=1e-5, atol=1e-6)


def test_decoding_tokens_equal_to_the_rows_is_no_padding():
    p = {n: t.detach() for n, t in _params(seed=5).items()}
    x = torch.randn(6, H)
    ctx = dataclasses.replace(_ctx(torch.tensor([0, 1], dtype=torch.int32), 1), cu_seqlens=None)
    ys = []
    for tokens in (None, 6):
        states = LinearStates(torch.zeros(2, 3, 56), torch.zeros(2, 4, 8, 6), tokens=tokens)
        ys.append(linear_attention(x, p, CFG, dataclasses.replace(ctx, linear_states=states))[0])
    torch.testing.assert_close(ys[1], ys[0], rtol=0, atol=0)
    assert ys[1].any(dim=1).all()
