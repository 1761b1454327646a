"""fmoe.layers.attention: GQA over packed documents with RoPE / YaRN."""

import dataclasses
import math
import re

import pytest
import torch

from fmoe.layers import AttentionConfig, AttentionContext, MaskRows, alibi_slopes, attention, attention_context, document_mask, rope_tables, softmax_scale
from fmoe.ops import apply_rope, positions_from_cu_seqlens, yarn_mscale

H = 32
CFG = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16)
YARN = dataclasses.replace(CFG, yarn_factor=4.0, yarn_original_max_positions=16, yarn_mscale=0.7, yarn_mscale_all_dim=1.0)


def _params(cfg, dtype=torch.float32, device="cpu"):
    N, G, D, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_dim or cfg.head_dim
    shapes = {"wq": (H, N * D), "wk": (H, G * D), "wv": (H, G * Dv), "wo": (N * Dv, H)}
    return {n: (torch.randn(*s, device=device) * s[0] ** -0.5).to(dtype).requires_grad_() for n, s in shapes.items()}


def _ctx(cu, cfg, positions=None):
    cu = torch.as_tensor(cu)
    if positions is None:
        positions = positions_from_cu_seqlens(cu)
    return attention_context(cu.to(positions.device), positions, cfg)


def _temperatures(positions, cfg):
    """[T]: the queries' scale 1 + s log(1 + floor((p + offset) / f)) written out (Llama 4's
    offset 1, Mistral 4's 0)."""
    p, f = positions.tolist(), cfg.temperature_floor
    return torch.tensor([1 + cfg.temperature_scale * math.log(1 + (t + cfg.temperature_offset) // f) for t in p])


def _plain_angles(positions, rot, base=10000.0):
    """Plain RoPE written out: the positions [T, 1] and the inverse frequencies [rot / 2], float64."""
    inv_freq = base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    return positions.double()[:, None], inv_freq


def _unit_rms(t, eps):
    """t over the root mean square of its last dim's channels, no weight."""
    return t / (t.square().mean(-1, keepdim=True) + eps).sqrt()


def _loop_attention(x, p, cfg, cu):
    """Token by token, head by head, each document on its own: the definition."""
    T, (N, G, D) = x.shape[0], (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    positions = positions_from_cu_seqlens(cu)
    local = cfg.window is not None or cfg.chunk is not None
    if local and cfg.local_rope_base is not None:  # a local layer's own plain RoPE: the inverse frequencies written out
        rot = cfg.rot_dim or D
        t, inv_freq = _plain_angles(positions, rot, cfg.local_rope_base)
        angles = t * inv_freq[None, :]
        cos, sin = angles.cos().float(), angles.sin().float()
    else:
        cos, sin = rope_tables(positions, cfg)
    q, k, v = (x @ p["wq"]).view(T, N, D), (x @ p["wk"]).view(T, G, D), (x @ p["wv"]).view(T, G, -1)
    if cfg.clip_qkv is not None:  # each projection clamped to [-c, c] (DBRX)
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    if cfg.v_norm:  # each value head over its channels, no weight (Gemma 4's)
        v = _unit_rms(v, cfg.norm_eps)
    v = v * cfg.v_scale
    if cfg.rope:
        q, k = (apply_rope(t, cos, sin, interleaved=cfg.interleaved, impl="torch") for t in (q, k))
    if cfg.qk_norm == "rms":  # each head's channels / their root mean square, no weight
        q, k = (_unit_rms(t, cfg.norm_eps) for t in (q, k))
    if cfg.temperature_floor is not None:  # the query temperature: 1 + s log(1 + floor((p + offset) / f))
        q = q * _temperatures(positions, cfg)[:, None, None]
    rows = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            first = a if cfg.window is None else max(a, t - cfg.window + 1)  # the sliding window: the newest `window` keys
            if cfg.chunk is not None:  # the chunk: keys from its first token (document positions 0, C, 2C, ...)
                first = a + (t - a) // cfg.chunk * cfg.chunk
            heads = []
            for h in range(N):
                g = h // (N // G)
                scores = (k[first:t + 1, g] @ q[t, h]) * softmax_scale(cfg)
                if cfg.score_softcap is not None:  # each scaled score capped
                    scores = torch.tanh(scores / cfg.score_softcap) * cfg.score_softcap
                if "alibi" in p:  # ALiBi: the head's slope times how far back each key lies (t - first ... 0)
                    scores = scores - p["alibi"][h] * torch.arange(t - first, -1, -1, dtype=scores.dtype)
                if "sinks" in p:  # the sink joins the denominator, with no value
                    weights = torch.exp(scores) / (torch.exp(scores).sum() + torch.exp(p["sinks"][h]))
                else:
                    weights = torch.softmax(scores, dim=0)
                head = weights @ v[first:t + 1, g]
                if cfg.out_norm:  # each head's output over its channels, no weight (Muse Spark's)
                    head = _unit_rms(head, cfg.norm_eps)
                heads.append(head)
            rows.append(torch.cat(heads))
    out = torch.stack(rows)
    if "wg" in p:  # gated attention: each output channel times the sigmoid of its gate
        out = out * torch.sigmoid(x @ p["wg"])
    y = out @ p["wo"]
    return y + p["bo"] if "bo" in p else y


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("cfg", [CFG, YARN, dataclasses.replace(CFG, rot_dim=8, interleaved=True), dataclasses.replace(CFG, window=4),
                                 dataclasses.replace(CFG, chunk=4), dataclasses.replace(CFG, chunk=3, qk_norm="rms", qk_norm_after_rope=True),
                                 dataclasses.replace(CFG, rope=False, temperature_floor=2, temperature_scale=0.5),
                                 dataclasses.replace(CFG, temperature_floor=3, temperature_scale=0.5, temperature_offset=0),
                                 dataclasses.replace(CFG, window=4, local_rope_base=100.0),
                                 dataclasses.replace(CFG, chunk=3, local_rope_base=50.0, rot_dim=8, llama3_factor=8.0, llama3_original_max_positions=4),
                                 dataclasses.replace(YARN, window=4, local_rope_base=100.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0),
                                 dataclasses.replace(CFG, v_dim=12, v_scale=0.7, window=4), dataclasses.replace(CFG, clip_qkv=0.5),
                                 dataclasses.replace(CFG, v_norm=True, v_scale=0.7), dataclasses.replace(CFG, out_norm=True, window=4)],
                         ids=["rope", "yarn", "partial-interleaved", "sliding-window", "chunked", "chunked-rms-norms", "nope-temperature",
                              "rope-temperature-offset-0", "window-local-base", "chunk-local-base-llama3", "window-local-base-yarn",
                              "value-dim-scale", "clip-qkv", "value-norm-scale", "output-norm"])
def test_attention_matches_per_token_loop(cfg, impl):
    _check_against_definition(cfg, impl, _params(cfg), _loop_attention)


def test_llama4_pieces_change_the_output_and_have_their_numbers():
    """The query temperature's worked numbers; chunks, the temperature and the weightless
    norms each change the attention (so the loop test above checks something); the "rms"
    norms are the "head" norms with unit weights, before or after RoPE alike."""
    from fmoe.layers import query_temperature

    floor2 = dataclasses.replace(CFG, rope=False, temperature_floor=2, temperature_scale=0.5)
    want = [1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(4)]
    torch.testing.assert_close(query_temperature(torch.arange(6), floor2), torch.tensor(want))
    llama4 = dataclasses.replace(floor2, temperature_floor=8192, temperature_scale=0.1)  # Llama 4's: 1 below 8191, then 1 + 0.1 ln 2
    assert query_temperature(torch.tensor([8190, 8191, 16383]), llama4).tolist() == pytest.approx([1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)])
    # offset 0 (Mistral 4's, floor(p / L)): 1 below L, then the same steps one position later
    want = [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(3)]
    torch.testing.assert_close(query_temperature(torch.arange(6), dataclasses.replace(floor2, temperature_offset=0)), torch.tensor(want))
    mistral4 = dataclasses.replace(llama4, temperature_offset=0)  # original_max_position_embeddings 8192, llama_4_scaling_beta 0.1
    assert query_temperature(torch.tensor([8191, 8192, 16384]), mistral4).tolist() == pytest.approx([1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)])
    # "power" (Beam's): (1 + (p + offset) / f) ** s, above 1 from position 0 on
    power = dataclasses.replace(floor2, temperature_kind="power")
    torch.testing.assert_close(query_temperature(torch.arange(4), power), torch.tensor([1.5, 2.0, 2.5, 3.0]) ** 0.5)
    torch.testing.assert_close(query_temperature(torch.arange(4), dataclasses.replace(power, temperature_offset=0)), torch.tensor([1.0, 1.5, 2.0, 2.5]) ** 0.5)
    cu = torch.tensor([0, 9, 17], dtype=torch.int32)
    x, p = torch.randn(17, H), {n: t.detach() for n, t in _params(CFG).items()}

    def out(cfg, params=p):
        return attention(x, params, cfg, _ctx(cu, cfg))[0]

    nope = dataclasses.replace(CFG, rope=False)
    window = dataclasses.replace(CFG, window=4)
    for changed, plain in ((dataclasses.replace(CFG, chunk=4), CFG), (floor2, nope), (dataclasses.replace(CFG, qk_norm="rms"), CFG),
                           (dataclasses.replace(CFG, temperature_floor=2, temperature_scale=0.5, temperature_offset=0), CFG),
                           (dataclasses.replace(window, local_rope_base=100.0), window)):
        assert _rel(out(changed), out(plain)) > 1e-2
    # the local layers' base is theirs alone: a full-attention layer of the same config keeps rope_base
    assert _rel(out(dataclasses.replace(CFG, local_rope_base=100.0)), out(CFG)) == 0.0
    # OLMo 3's: YaRN (its cos / sin scaled, the softmax scale plain) in the full layers, plain RoPE at the same base in
    # the window's: a window layer's output is the plain config's, a full layer's YaRN's
    olmo3 = dataclasses.replace(YARN, yarn_mscale=1.0, yarn_mscale_all_dim=0.0)
    assert _rel(out(dataclasses.replace(olmo3, window=4, local_rope_base=10000.0)), out(window)) < 1e-6
    assert _rel(out(dataclasses.replace(olmo3, window=4)), out(window)) > 1e-2
    assert _rel(out(dataclasses.replace(olmo3, local_rope_base=10000.0)), out(olmo3)) == 0.0
    assert _rel(out(dataclasses.replace(window, local_rope_base=10000.0)), out(window)) < 1e-6  # the trunk's base: no change
    assert _rel(out(dataclasses.replace(CFG, chunk=9)), out(CFG)) < 1e-6  # a chunk as long as every document: no change
    ones = dict(p, q_norm=torch.ones(16), k_norm=torch.ones(16))
    for after in (False, True):
        rms, head = dataclasses.replace(CFG, qk_norm="rms", qk_norm_after_rope=after), dataclasses.replace(CFG, qk_norm="head", qk_norm_after_rope=after)
        assert _rel(out(rms), out(head, ones)) < 1e-6
    assert _rel(out(dataclasses.replace(CFG, qk_norm="rms")), out(dataclasses.replace(CFG, qk_norm="rms", qk_norm_after_rope=True))) < 1e-5


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("window", [None, 4])
def test_sinks_and_output_bias_match_per_token_loop(window, impl):
    """gpt-oss's attention: a sink logit per head in each query's denominator, an output bias."""
    cfg = dataclasses.replace(CFG, window=window)
    p = _params(cfg)
    g = torch.Generator().manual_seed(4)
    p.update(sinks=torch.randn(4, generator=g).requires_grad_(), bo=torch.randn(H, generator=g).requires_grad_())
    _check_against_definition(cfg, impl, p, _loop_attention)
    with torch.no_grad():  # the sinks matter: without them (or with -inf sinks) the output differs / is the plain one
        x, cu = torch.randn(17, H), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
        plain = {n: t for n, t in p.items() if n != "sinks"}
        y, y_plain = attention(x, p, cfg, _ctx(cu, cfg))[0], attention(x, plain, cfg, _ctx(cu, cfg))[0]
        assert _rel(y, y_plain) > 1e-2
        y_inf = attention(x, {**p, "sinks": torch.full((4,), float("-inf"))}, cfg, _ctx(cu, cfg))[0]
        assert _rel(y_inf, y_plain) < 1e-6


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("knobs, sinks", [(dict(rope=False), False), (dict(rope=False, window=4), False), (dict(rope=False, score_softcap=0.8), False),
                                          (dict(n_heads=6, rope=False), True), ({}, False)],
                         ids=["alibi", "window", "softcap", "six-heads-sinks", "with-rope"])
def test_alibi_matches_per_token_loop(knobs, sinks, impl):
    """ALiBi (BLOOM's, MPT's): head h's score of a key d tokens back in its document gets
    -m_h d, after the scale and any cap; on a sliding window, beside sinks, with RoPE too."""
    cfg = dataclasses.replace(CFG, **knobs)
    p = _params(cfg)
    p["alibi"] = alibi_slopes(cfg.n_heads) * 4  # steep enough to matter over these short documents
    if sinks:
        p["sinks"] = torch.randn(cfg.n_heads, generator=torch.Generator().manual_seed(4)).requires_grad_()
    _check_against_definition(cfg, impl, p, _loop_attention)
    with torch.no_grad():  # the biases matter; slopes of 0 are the plain layer
        x, cu = torch.randn(17, H), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
        plain = {n: t for n, t in p.items() if n != "alibi"}
        y = attention(x, p, cfg, _ctx(cu, cfg))[0]
        assert _rel(y, attention(x, plain, cfg, _ctx(cu, cfg))[0]) > 1e-2
        assert _rel(attention(x, dict(p, alibi=torch.zeros(cfg.n_heads)), cfg, _ctx(cu, cfg))[0], attention(x, plain, cfg, _ctx(cu, cfg))[0]) < 1e-6


def test_alibi_slopes_are_alibis_numbers():
    """The geometric slopes 2^(-8 h / P): a power of two of heads takes them whole; 6 heads
    take 8's even ones (4's run), then its odd ones; MPT's alibi_bias_max in max_bias."""
    assert alibi_slopes(8).tolist() == [2.0 ** -h for h in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -h for h in (2, 4, 6, 8)]
    assert alibi_slopes(6).tolist() == [2.0 ** -h for h in (2, 4, 6, 8, 1, 3)]
    assert alibi_slopes(1).tolist() == [2.0 ** -8] and alibi_slopes(2, max_bias=16).tolist() == [2.0 ** -8, 2.0 ** -16]
    torch.testing.assert_close(alibi_slopes(3), torch.tensor([2 ** -4, 2 ** -8, 2 ** -2]), rtol=0, atol=0)
    assert alibi_slopes(12).dtype == torch.float32 and torch.allclose(alibi_slopes(16), 2 ** (-0.5 * torch.arange(1.0, 17)))
    with pytest.raises(ValueError, match="n_heads: expected >= 1, got 0"):
        alibi_slopes(0)
    for bad in (0, -1.0, math.inf, True, "8"):
        with pytest.raises(ValueError, match=r"max_bias: expected a positive finite number \(8: ALiBi's\), got "):
            alibi_slopes(4, max_bias=bad)


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("cp", [2, 4])
def test_alibi_under_context_parallel_measures_global_distances(cp, impl):
    """Under context parallel a rank's queries and the gathered keys are far apart in x's
    rows: the distances come from token_index and kv_index, each rank's rows are the whole
    batch's (RoPE on as well: both at once)."""
    cu = torch.tensor([0, 3, 4, 13, 21, 24], dtype=torch.int32)
    cfg = dataclasses.replace(CFG, impl=impl)
    p = {n: t.detach() for n, t in _params(cfg).items()}
    p["alibi"] = alibi_slopes(4) * 4
    x = torch.randn(24, H)
    with torch.no_grad():
        whole, _ = attention(x, p, cfg, _ctx(cu, cfg))
        for rank in range(cp):
            index, ctx = _one_rank_of_cp(x, p, cfg, cu, cp, rank)
            assert ctx.token_index is index
            y, _ = attention(x[index], p, cfg, ctx)
            assert _rel(y, whole[index]) < 1e-5, rank


def test_alibi_bad_inputs():
    p, cu = _params(dataclasses.replace(CFG, rope=False)), torch.tensor([0, 6])
    x, cfg = torch.randn(6, H), dataclasses.replace(CFG, rope=False)
    with pytest.raises(ValueError, match=r"params\['alibi'\]: expected a float \[4\] tensor or none, got torch.float32 \[2\]"):
        attention(x, dict(p, alibi=torch.ones(2)), cfg, _ctx(cu, cfg))
    with pytest.raises(ValueError, match=r"params\['alibi'\]: expected a float \[4\] tensor or none, got torch.int64 \[4\]"):
        attention(x, dict(p, alibi=torch.ones(4, dtype=torch.long)), cfg, _ctx(cu, cfg))
    mla = AttentionConfig(n_heads=4, n_kv_heads=4, head_dim=12, rot_dim=4, kv_rank=6, v_dim=5)
    with pytest.raises(ValueError, match=r"params\['alibi'\]: ALiBi's slopes bias grouped-query attention's scores, not multi-latent attention's"):
        attention(x, dict(_mla_params(mla), alibi=torch.ones(4)), mla, _ctx(cu, mla))


@pytest.mark.parametrize("impl", ["torch", "flex"])
def test_gated_attention_matches_per_token_loop(impl):
    """AFMoE's gated attention: the heads' outputs times sigmoid(x wg), channel by channel, before wo."""
    cfg = dataclasses.replace(CFG, window=4)
    p = _params(cfg)
    p["wg"] = (torch.randn(H, 4 * 16, generator=torch.Generator().manual_seed(5)) * H**-0.5).requires_grad_()
    _check_against_definition(cfg, impl, p, _loop_attention)
    with torch.no_grad():  # the gate matters
        x, cu = torch.randn(17, H), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
        plain = {n: t for n, t in p.items() if n != "wg"}
        assert _rel(attention(x, p, cfg, _ctx(cu, cfg))[0], attention(x, plain, cfg, _ctx(cu, cfg))[0]) > 1e-1
    with pytest.raises(ValueError, match=r"params\['wg'\]: expected torch.float32 \[32, 64\] tensor or none, got torch.float32 \[32, 32\]"):
        attention(x, dict(p, wg=torch.zeros(H, H)), cfg, _ctx(cu, cfg))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("act", ["sigmoid", "softplus"])
def test_the_gate_bias_shifts_each_head_s_pre_activations(act, per_head):
    """bg [N] (Beam's gate_bias): head n's bias added to each of its channels' gate pre-activations (or its one
    gate's); with wg zero each head's output is times gate_act(bg[n]): the ungated layer with head n's rows of wo so
    scaled. A bias without its weight wg is refused."""
    cfg = dataclasses.replace(CFG, gate_act=act, gate_per_head=per_head)
    p, x, cu = {n: t.detach() for n, t in _params(CFG).items()}, torch.randn(6, H), torch.tensor([0, 6])
    bg = torch.tensor([-1.0, 0.5, 2.0, 0.0])
    gate = torch.sigmoid(bg) if act == "sigmoid" else torch.nn.functional.softplus(bg)
    y = attention(x, dict(p, wg=torch.zeros(H, 4 if per_head else 64), bg=bg), cfg, _ctx(cu, cfg))[0]
    scaled = (p["wo"].view(4, 16, H) * gate[:, None, None]).view(64, H)
    torch.testing.assert_close(y, attention(x, dict(p, wo=scaled), CFG, _ctx(cu, CFG))[0])
    with pytest.raises(ValueError, match=re.escape("params['bg']: the output gate's bias per head, needs its weight wg")):
        attention(x, dict(p, bg=bg), cfg, _ctx(cu, cfg))


@pytest.mark.parametrize("knobs", [dict(k_eq_v=True), dict(k_eq_v=True, qk_norm="head"), dict(kv_shared=True, rope=False)], ids=str)
def test_values_of_the_keys_projection_are_the_plain_layer_with_wv_the_keys(knobs):
    """k_eq_v: the values are the keys' projection as it comes (its bias bk added; before the keys' norm and RoPE);
    kv_shared without RoPE: the keys themselves, with no rotation to turn back. Both the plain layer with wv = wk and
    bv = bk."""
    cfg = dataclasses.replace(CFG, **knobs)
    g = torch.Generator().manual_seed(6)
    p = {n: t.detach() for n, t in _params(CFG).items()}
    p.update(bk=torch.randn(32, generator=g), bq=torch.randn(64, generator=g))
    if cfg.qk_norm == "head":
        p.update(q_norm=torch.rand(16, generator=g) + 0.5, k_norm=torch.rand(16, generator=g) + 0.5)
    x, cu = torch.randn(11, H), torch.tensor([0, 4, 11])
    plain = dataclasses.replace(cfg, k_eq_v=False, kv_shared=False)
    want = attention(x, dict(p, wv=p["wk"], bv=p["bk"]), plain, _ctx(cu, plain))[0]
    got = attention(x, {n: t for n, t in p.items() if n != "wv"}, cfg, _ctx(cu, cfg))[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["head", "proj"])
def test_zero_centered_qk_norms_take_a_gain_of_one_plus_the_weight(kind):
    """zero_centered_norms: the q/k RMSNorms' gain is 1 + weight, per head ("head") or over the whole projection
    ("proj"); the weights as given otherwise."""
    from fmoe.layers import qk_norm_shapes

    cfg = dataclasses.replace(CFG, qk_norm=kind)
    p, x, cu = {n: t.detach() for n, t in _params(CFG).items()}, torch.randn(6, H), torch.tensor([0, 6])
    g = torch.Generator().manual_seed(8)
    weights = {n: 0.5 * torch.randn(s, generator=g) for n, s in qk_norm_shapes(cfg).items()}
    got = attention(x, dict(p, **weights), dataclasses.replace(cfg, zero_centered_norms=True), _ctx(cu, cfg))[0]
    want = attention(x, dict(p, **{n: 1 + w for n, w in weights.items()}), cfg, _ctx(cu, cfg))[0]
    torch.testing.assert_close(got, want)
    assert _rel(got, attention(x, dict(p, **weights), cfg, _ctx(cu, cfg))[0]) > 1e-2


def test_alibi_and_sinks_in_blocks_of_one_query_are_the_definition(monkeypatch):
    """The reference with sinks and ALiBi's biases over blocks of queries, at least one a block however few scores
    fmoe.layers._SCORE_ROWS allows: each block's biases from its own queries' positions, the output and gradients
    the per-token definition's."""
    import fmoe.layers as L

    monkeypatch.setattr(L, "_SCORE_ROWS", 1)
    cfg = dataclasses.replace(CFG, rope=False)
    p = _params(cfg)
    p.update(alibi=alibi_slopes(4) * 4, sinks=torch.randn(4, generator=torch.Generator().manual_seed(4)).requires_grad_())
    _check_against_definition(cfg, "torch", p, _loop_attention)


def test_clip_qkv_clamps_q_k_and_v_and_is_checked():
    """DBRX's clip_qkv: a bound the projections pass changes nothing (bit for bit); 0.5 clamps
    most of these unit-scale projections and changes the output (its definition: the loop's
    clamp, test_attention_matches_per_token_loop[clip-qkv]); bad bounds are refused."""
    p, cu = _params(CFG), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    x = torch.randn(17, H)
    with torch.no_grad():
        bound = max(float((x @ p[n]).abs().max()) for n in ("wq", "wk", "wv")) * 1.01
        plain = attention(x, p, CFG, _ctx(cu, CFG))[0]
        loose, tight = (dataclasses.replace(CFG, clip_qkv=c) for c in (bound, 0.5))
        assert torch.equal(attention(x, p, loose, _ctx(cu, loose))[0], plain)
        assert _rel(attention(x, p, tight, _ctx(cu, tight))[0], plain) > 1e-1
        # the clamp comes after the biases: biases of 10 put every q, k and v channel at the bound 0.5, whatever x is,
        # so every query attends evenly to values of 0.5 (clamping before the biases left them near 10)
        N, G, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
        big = dict(p, bq=torch.full((N * D,), 10.0), bk=torch.full((G * D,), 10.0), bv=torch.full((G * D,), 10.0))
        torch.testing.assert_close(attention(x, big, tight, _ctx(cu, tight))[0], torch.full((17, N * D), 0.5) @ p["wo"])
    for bad in (0, -1.0, math.inf, True, "8"):
        with pytest.raises(ValueError, match=r"clip_qkv: expected None or a finite number > 0, got "):
            dataclasses.replace(CFG, clip_qkv=bad)
    with pytest.raises(ValueError, match="clip_qkv: clamps grouped-query attention's q, k and v, not multi-latent attention's"):
        AttentionConfig(n_heads=4, n_kv_heads=4, head_dim=12, rot_dim=4, kv_rank=6, v_dim=5, clip_qkv=8.0)


def _check_against_definition(cfg, impl, p, definition):
    """attention on 3 packed documents against definition(x, p, cfg, cu): the output and, on
    the torch path, the gradients of x and every parameter (relative 1e-5). FlexAttention has
    no CPU backward: its forward here, its gradients in the gpu tests."""
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    x = torch.randn(17, H, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    p_ref = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in p.items()}
    y_ref = definition(x_ref, p_ref, cfg, cu)
    if impl == "flex":
        with torch.no_grad():
            flex_cfg = dataclasses.replace(cfg, impl=impl)
            assert _rel(attention(x, p, flex_cfg, _ctx(cu, flex_cfg))[0], y_ref) < 1e-5
        return
    y, stats = attention(x, p, cfg, _ctx(cu, cfg))
    assert y.shape == x.shape and len(stats.keys()) == 0
    assert _rel(y, y_ref) < 1e-5
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    (y_ref * upstream).sum().backward()
    assert _rel(x.grad, x_ref.grad) < 1e-5
    for n in p:
        if p[n].requires_grad:  # (not ALiBi's constant slopes)
            assert _rel(p[n].grad, p_ref[n].grad) < 1e-5, n


@pytest.mark.parametrize("impl", ["torch", "flex"])
def test_a_document_does_not_depend_on_its_neighbours(impl):
    cfg = dataclasses.replace(YARN, impl=impl)
    p = {n: t.detach() for n, t in _params(cfg).items()}
    doc = torch.randn(9, H)
    alone, _ = attention(doc, p, cfg, _ctx(torch.tensor([0, 9]), cfg))
    packed_x = torch.cat([torch.randn(4, H), doc, torch.randn(6, H)])
    packed, _ = attention(packed_x, p, cfg, _ctx(torch.tensor([0, 4, 13, 19]), cfg))
    torch.testing.assert_close(packed[4:13], alone, rtol=1e-5, atol=1e-6)
    # and a document really attends within itself: changing its first token changes the rest
    doc2 = doc.clone()
    doc2[0] += 1.0
    assert not torch.allclose(attention(doc2, p, cfg, _ctx(torch.tensor([0, 9]), cfg))[0][1:], alone[1:])


def test_the_context_carries_the_positions():
    cu = torch.tensor([0, 3, 8])
    x = torch.randn(8, H)
    p = _params(CFG)
    explicit, _ = attention(x, p, CFG, _ctx(cu, CFG, torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])))
    torch.testing.assert_close(attention(x, p, CFG, _ctx(cu, CFG))[0], explicit)
    # RoPE is relative: shifting a whole document's positions changes nothing...
    torch.testing.assert_close(attention(x, p, CFG, _ctx(cu, CFG, torch.arange(8)))[0], explicit, rtol=1e-4, atol=1e-5)
    # ...but the positions are used: a gap inside the second document changes its last token
    gapped, _ = attention(x, p, CFG, _ctx(cu, CFG, torch.tensor([0, 1, 2, 0, 1, 2, 3, 9])))
    torch.testing.assert_close(gapped[:7], explicit[:7])
    assert not torch.allclose(gapped[7], explicit[7])


def test_gqa_equals_attention_with_repeated_kv_heads():
    p = _params(CFG)
    mha = dataclasses.replace(CFG, n_kv_heads=4)
    D = CFG.head_dim
    repeat = lambda w: w.detach().view(H, 2, D).repeat_interleave(2, dim=1).reshape(H, 4 * D)  # noqa: E731
    p_mha = dict(p, wk=repeat(p["wk"]), wv=repeat(p["wv"]))
    x, cu = torch.randn(10, H), torch.tensor([0, 10])
    torch.testing.assert_close(attention(x, p, CFG, _ctx(cu, CFG))[0], attention(x, p_mha, mha, _ctx(cu, mha))[0])


def test_yarn_softmax_scale_uses_mscale_all_dim():
    expected = yarn_mscale(4.0, 1.0) ** 2 / math.sqrt(16)
    assert softmax_scale(YARN) == pytest.approx(expected)
    assert softmax_scale(YARN) != pytest.approx(yarn_mscale(4.0, 0.7) ** 2 / math.sqrt(16))
    assert softmax_scale(CFG) == pytest.approx(16**-0.5)


def test_softmax_scale_takes_the_config_s_scale_first():
    assert softmax_scale(dataclasses.replace(CFG, scale=0.5)) == 0.5
    assert softmax_scale(dataclasses.replace(YARN, scale=0.25)) == 0.25


def test_rope_tables_written_out_for_reversed_linear_and_proportional_rope():
    """reversed: sin negated; linear_factor f: every frequency / f; rope_proportion p: the
    first int(p D / 2) frequencies turn, the rest are zero (cos 1, sin 0)."""
    t, inv_freq = _plain_angles(torch.arange(6), 16)
    for knobs, freq in ((dict(), inv_freq), (dict(linear_factor=4.0), inv_freq / 4.0),
                        (dict(rope_proportion=0.25), torch.where(torch.arange(8) < 2, inv_freq, 0.0))):
        cos, sin = rope_tables(torch.arange(6), dataclasses.replace(CFG, **knobs))
        torch.testing.assert_close(cos, (t * freq).cos().float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, (t * freq).sin().float(), rtol=1e-6, atol=1e-6)
    cos, sin = rope_tables(torch.arange(6), dataclasses.replace(CFG, reversed=True))
    torch.testing.assert_close(cos, (t * inv_freq).cos().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, -(t * inv_freq).sin().float(), rtol=1e-6, atol=1e-6)
    assert float(sin.abs().max()) > 0.5


def test_yarn_tables_carry_mscale_over_mscale_all_dim():
    cos, sin = rope_tables(torch.arange(3), YARN)
    scale = yarn_mscale(4.0, 0.7) / yarn_mscale(4.0, 1.0)
    assert scale != pytest.approx(1 / scale)
    torch.testing.assert_close(cos[0], torch.full((8,), scale), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[0], torch.zeros(8))


def test_the_mask_s_kind_follows_impl_and_device():
    """A BlockMask for impl "flex" (and "auto" on CUDA); on CPU "auto", "torch" and "triton"
    build the dense [T, T] bool mask."""
    cu = torch.tensor([0, 3, 8])
    dense = document_mask(cu, 8, flex=False)
    for impl in ("auto", "torch", "triton"):
        mask = _ctx(cu, dataclasses.replace(CFG, impl=impl)).mask
        assert isinstance(mask, torch.Tensor) and torch.equal(mask, dense)
    assert not isinstance(_ctx(cu, dataclasses.replace(CFG, impl="flex")).mask, torch.Tensor)


def test_attention_bad_inputs():
    p = _params(CFG)
    x, cu = torch.randn(6, H), torch.tensor([0, 6])
    ctx = _ctx(cu, CFG)
    with pytest.raises(ValueError, match="^n_kv_heads: the 4 query heads must split evenly over the kv heads, got n_kv_heads = 3"):
        dataclasses.replace(CFG, n_kv_heads=3)  # at construction, not at attention's first call
    for name, value, message in (("n_heads", 0, "expected >= 1, got 0"), ("n_kv_heads", -2, "expected >= 1, got -2"),
                                 ("head_dim", 0, "expected >= 1, got 0"), ("n_heads", 2.0, "expected an int, got 2.0")):
        with pytest.raises(ValueError, match=f"^{name}: {message}"):  # the field itself, as the config is built
            dataclasses.replace(CFG, **{name: value})
    with pytest.raises(ValueError, match=r"params\['wk'\]: expected torch.float32 \[32, 32\]"):
        attention(x, dict(p, wk=torch.randn(H, 16)), CFG, ctx)
    with pytest.raises(ValueError, match=r"ctx: RoPE tables of shape \(5, 8\) do not fit x's 6 tokens"):
        attention(x, p, CFG, _ctx(torch.tensor([0, 5]), CFG))
    with pytest.raises(ValueError, match=r"ctx: RoPE tables of shape \(6, 8\) do not fit x's 6 tokens and rot_dim 8 \(expected \(6, 4\)\)"):
        attention(x, p, dataclasses.replace(CFG, rot_dim=8), ctx)
    with pytest.raises(ValueError, match="ctx: expected the AttentionContext"):
        attention(x, p, CFG, (ctx.cos, ctx.sin, ctx.mask))
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        attention(x[None], p, CFG, ctx)
    with pytest.raises(ValueError, match=r"heads_mean: expected a function of a \[T, n\] tensor .* got float"):
        attention(x, p, CFG, ctx, heads_mean=2.0)
    with pytest.raises(ValueError, match=r"params\['sinks'\]: expected a float \[4\] tensor or none, got torch.float32 \[2\]"):
        attention(x, dict(p, sinks=torch.zeros(2)), CFG, ctx)
    with pytest.raises(ValueError, match=r"params\['bo'\]: expected torch.float32 \[32\] tensor or none, got torch.int64 \[32\]"):
        attention(x, dict(p, bo=torch.zeros(H, dtype=torch.long)), CFG, ctx)
    # the biases in x's dtype: a float32 bo made a bf16 layer's output float32, a float32 bq an error from SDPA
    xb, pb = x.bfloat16(), {name: w.bfloat16() for name, w in p.items()}
    for name, n in (("bo", H), ("bq", 4 * 16), ("bk", 2 * 16), ("bv", 2 * 16)):
        with pytest.raises(ValueError, match=rf"params\['{name}'\]: expected torch.bfloat16 \[{n}\] tensor.*, got torch.float32 \[{n}\]"):
            attention(xb, dict(pb, **{name: torch.zeros(n)}), CFG, ctx)
    assert attention(xb, dict(pb, bo=torch.zeros(H, dtype=torch.bfloat16), bq=torch.zeros(4 * 16, dtype=torch.bfloat16)), CFG, ctx)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^params: expected a dict of tensors \(wq, wk, wv, wo, ...\), got list"):
        attention(x, list(p.values()), CFG, ctx)
    for fn in (lambda cfg: attention(x, p, cfg, ctx), lambda cfg: _ctx(cu, cfg)):
        with pytest.raises(ValueError, match="^cfg: expected an AttentionConfig, got dict"):
            fn(dataclasses.asdict(CFG))
    # flags and eps read from a config: "False" turned reversed and qk_norm_after_rope on, a negative or NaN eps made NaN
    for name, value in (("reversed", "False"), ("qk_norm_after_rope", "False"), ("interleaved", 0)):
        with pytest.raises(ValueError, match=f"^{name}: expected a bool, got {value!r}"):
            dataclasses.replace(CFG, qk_norm="head", **{name: value})
    for name in ("norm_eps", "latent_norm_eps"):
        for value in (-1.0, float("nan"), 0, "1e-6"):
            with pytest.raises(ValueError, match=f"^{name}: expected a positive finite number, got {value!r}"):
                dataclasses.replace(CFG, **{name: value})
    # a global layer's RoPE knobs must be its context's: the tables of another base, scaling or direction rotated silently
    for knobs in (dict(rope_base=500000.0), dict(linear_factor=4.0), dict(reversed=True), dict(yarn_factor=4.0, yarn_original_max_positions=4)):
        name = next(iter(knobs))
        with pytest.raises(ValueError, match=f"^ctx: built with {name} = {getattr(CFG, name)!r}, this layer's is {knobs[name]!r} "):
            attention(x, p, dataclasses.replace(CFG, **knobs), ctx)
    local = dataclasses.replace(CFG, window=4)  # a local layer reads its window's context (checked above), not the RoPE knobs
    attention(x, p, dataclasses.replace(local, rope_base=500000.0), _ctx(cu, local))
    nope = dataclasses.replace(CFG, rope=False, rope_base=500000.0)  # nor a layer without RoPE
    attention(x, p, nope, ctx)
    # a sliding-window layer needs a context built for its window
    with pytest.raises(ValueError, match="ctx: built for the sliding window None and chunk None, this layer attends over window 4"):
        attention(x, p, dataclasses.replace(CFG, window=4), ctx)
    with pytest.raises(ValueError, match="ctx: built for the sliding window 3 and chunk None, this layer attends over window 4"):
        attention(x, p, dataclasses.replace(CFG, window=4), _ctx(cu, dataclasses.replace(CFG, window=3)))
    flex = dataclasses.replace(CFG, impl="flex")
    with pytest.raises(ValueError, match="cfg.impl: FlexAttention has no backward on CPU"):
        attention(x, p, flex, _ctx(cu, flex))
    with pytest.raises(ValueError, match="cfg.impl: FlexAttention has no backward on CPU"):  # x's gradient alone, the weights frozen
        attention(x.clone().requires_grad_(), {n: w.detach() for n, w in p.items()}, flex, _ctx(cu, flex))
    # the context checks shapes (its values were checked where the batch was made)
    with pytest.raises(ValueError, match=r"^rot_dim: expected an even number <= head_dim = 16, got 18"):
        dataclasses.replace(CFG, rot_dim=18)
    with pytest.raises(ValueError, match=r"rot_dim: expected an even number of rotated channels \(pairs\), got 7"):
        dataclasses.replace(CFG, rot_dim=7)  # the config itself refuses an odd one
    for bad in (0, -2, 8.0, True):  # 0 rotated every channel (`rot_dim or head_dim`)
        with pytest.raises(ValueError, match=r"rot_dim: expected an even int >= 2, or None \(every channel; rope=False rotates none\), got"):
            dataclasses.replace(CFG, rot_dim=bad)
    with pytest.raises(ValueError, match="positions: expected a 1-D tensor"):
        attention_context(cu, torch.arange(6)[None], CFG)
    with pytest.raises(ValueError, match="^impl: expected one of auto, triton, torch, flex, got 'nope'"):
        dataclasses.replace(CFG, impl="nope")
    with pytest.raises(ValueError, match=r"mask: expected a \[6, 6\] bool tensor"):
        attention_context(cu, torch.arange(6), CFG, mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask: expected a BlockMask"):
        attention_context(cu, torch.arange(6), flex, mask=ctx.mask)
    # a context of the window's layers alone: the window's mask is its mask, no other built
    windowed = dataclasses.replace(CFG, window=3)
    alone = attention_context(cu, torch.arange(6), windowed, window_only=True)
    assert alone.mask is alone.local_mask and torch.equal(alone.mask, attention_context(cu, torch.arange(6), windowed).local_mask)
    with pytest.raises(ValueError, match=r"window_only: a context of the sliding window's \(chunk's\) layers alone needs cfg.window or cfg.chunk and no mask, got window None, chunk None"):
        attention_context(cu, torch.arange(6), CFG, window_only=True)


def test_context_bad_inputs_name_the_first_missing_or_conflicting_argument():
    cu, index = torch.tensor([0, 16]), torch.arange(8)
    with pytest.raises(ValueError, match=r"^gather_kv: context parallel needs token_index, kv_index and gather_kv together, got only \['token_index'\]"):
        attention_context(cu, torch.arange(8), CFG, token_index=index)
    with pytest.raises(ValueError, match=r"^kv_index: context parallel needs token_index, kv_index and gather_kv together, got only \['token_index', 'gather_kv'\]"):
        attention_context(cu, torch.arange(8), CFG, token_index=index, gather_kv=lambda k, v: (k, v))
    windowed = dataclasses.replace(CFG, window=3)
    mask = _ctx(torch.tensor([0, 6]), windowed).mask
    with pytest.raises(ValueError, match=r"window_only: .* needs cfg.window or cfg.chunk and no mask, got window 3, chunk None and a mask"):
        attention_context(torch.tensor([0, 6]), torch.arange(6), windowed, mask=mask, window_only=True)


def test_local_rope_tables_only_in_a_context_with_a_local_mask():
    """local_rope_base: the tables of plain RoPE at that base over the local layers' head dim
    (local_head_dim), built only where the context holds a window's or chunk's mask."""
    cu = torch.tensor([0, 6])
    ctx = _ctx(cu, dataclasses.replace(CFG, local_rope_base=1000.0))
    assert ctx.local_mask is None and ctx.local_rope_base is None and ctx.local_cos is None and ctx.local_sin is None
    ctx = _ctx(cu, dataclasses.replace(CFG, window=4, local_rope_base=1000.0, local_head_dim=32))
    t, inv_freq = _plain_angles(torch.arange(6), 32, base=1000.0)
    assert ctx.local_rope_base == 1000.0 and ctx.local_cos.shape == (6, 16)
    torch.testing.assert_close(ctx.local_cos, (t * inv_freq).cos().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ctx.local_sin, (t * inv_freq).sin().float(), rtol=1e-6, atol=1e-6)


def test_document_mask_dense_and_block_agree():
    cu = torch.tensor([0, 3, 3, 7, 8])
    dense = document_mask(cu, 8, flex=False)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for a, b in ((0, 3), (3, 7), (7, 8)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(dense, expected)
    block = document_mask(cu, 8, flex=True)
    assert block.mask_mod is not None and tuple(block.shape[-2:]) == (8, 8)
    # the BlockMask's predicate is the dense mask
    q, k = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(block.mask_mod(zero, zero, q, k), expected)


def test_sliding_window_mask_is_the_band_of_each_document():
    """window W: query t sees keys t - W + 1 .. t of its own document; the BlockMask's
    predicate is the dense mask."""
    cu = torch.tensor([0, 3, 3, 9, 10])
    dense = document_mask(cu, 10, flex=False, window=2)
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for a, b in ((0, 3), (3, 9), (9, 10)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril() & ~torch.ones(b - a, b - a, dtype=torch.bool).tril(-2)
    assert torch.equal(dense, expected) and int(dense.sum(1).max()) == 2
    assert torch.equal(document_mask(cu, 10, flex=False, window=100), document_mask(cu, 10, flex=False))  # wider than every document
    block = document_mask(cu, 10, flex=True, window=2)
    q, k = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(block.mask_mod(zero, zero, q, k), expected)
    for bad, message in ((0, "window: expected >= 1, got 0"), (-1, "window: expected >= 1, got -1"),
                         (2.5, "window: expected an int, got 2.5"), (True, "window: expected an int, got True")):
        with pytest.raises(ValueError, match=message):
            document_mask(cu, 10, flex=False, window=bad)
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(CFG, window=bad)


def _chunk_definition(cu, C):
    """[T, T]: key s <= query t, same document, same chunk of C document positions."""
    bounds, T = cu.tolist(), int(cu[-1])
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            allowed[t, a + (t - a) // C * C : t + 1] = True
    return allowed


@pytest.mark.parametrize("cu, block, chunk", [
    ([0, 3, 3, 40, 41, 100, 300], 16, 5),    # chunks narrower than a block, an empty document
    ([0, 300], 16, 64),                      # chunks of whole blocks
    ([0, 16, 32, 48, 64, 200, 256], 16, 24),
    ([0, 5, 130, 250, 300], 128, 100),
])
def test_chunked_mask_is_the_document_mask_of_the_chunks(cu, block, chunk):
    """chunk C: query t sees the keys of its own chunk (document positions p // C equal) up
    to itself; dense, the BlockMask (against create_block_mask on the dense one) and the
    context-parallel form at global indices all agree with that definition."""
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu = torch.tensor(cu)
    T = int(cu[-1])
    dense = document_mask(cu, T, flex=False, chunk=chunk)
    assert torch.equal(dense, _chunk_definition(cu, chunk))
    assert not torch.equal(dense, document_mask(cu, T, flex=False))
    ours, ref = document_mask(cu, T, flex=True, block_size=block, chunk=chunk), _create_block_mask(dense, block)
    for got, want in zip(_block_sets(ours), _block_sets(ref)):
        assert torch.equal(got, want)
    assert torch.equal(_allowed(ours, (T, T)), dense)
    kv_index = cp_kv_index(T, 2)
    for rank in range(2):
        index = cp_token_index(T, 2, rank)
        cp_dense = document_mask(cu, T, flex=False, token_index=index, kv_index=kv_index, chunk=chunk)
        assert torch.equal(cp_dense, dense[index][:, kv_index])
        cp_block = document_mask(cu, T, flex=True, token_index=index, kv_index=kv_index, block_size=block, chunk=chunk)
        assert torch.equal(_allowed(cp_block, cp_dense.shape), cp_dense)
    for bad, message in ((0, "chunk: expected >= 1, got 0"), (2.5, "chunk: expected an int, got 2.5")):
        with pytest.raises(ValueError, match=message):
            document_mask(cu, T, flex=False, chunk=bad)
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(CFG, chunk=bad)


@pytest.mark.parametrize("kind", ["documents", "window", "chunk"])
def test_mask_rows_are_the_dense_mask(kind):
    """document_mask(rows=True): the rule alone (MaskRows), whose rows, blocks of rows and
    values at given keys are the dense mask's, on one process and at a cp rank's global
    indices; FlexAttention's form and the rule together are refused."""
    from fmoe.layers import MaskRows
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu, T = torch.tensor([0, 3, 4, 13, 21, 24]), 24
    kw = {"documents": {}, "window": dict(window=4), "chunk": dict(chunk=5)}[kind]
    kv_index = cp_kv_index(T, 2)
    for cp in ({}, dict(token_index=cp_token_index(T, 2, 1), kv_index=kv_index)):
        dense = document_mask(cu, T, flex=False, **cp, **kw)
        rows = document_mask(cu, T, flex=False, rows=True, **cp, **kw)
        assert isinstance(rows, MaskRows) and rows.shape == tuple(dense.shape)
        assert torch.equal(rows.rows(), dense) and torch.equal(rows.rows(slice(2, 7)), dense[2:7])
        keys = torch.randint(-1, T, (dense.shape[0], 5))
        want = dense.gather(1, keys.clamp(min=0)) & (keys >= 0)
        assert torch.equal(rows.at(slice(None), keys), want) and bool(want.any()) and not bool(want.all())
    with pytest.raises(ValueError, match=r"rows: the mask's rule \(MaskRows\) or FlexAttention's block mask \(flex\), not both"):
        document_mask(cu, T, flex=True, rows=True)
    # DeepSeek sparse attention's context on its kernel's path holds the rule; the reference's the dense mask
    assert isinstance(_ctx(cu, dataclasses.replace(DSA, impl="triton")).mask, MaskRows)
    assert isinstance(_ctx(cu, DSA).mask, torch.Tensor)
    with pytest.raises(ValueError, match=r"mask: expected a \[24, 24\] MaskRows \(cfg.impl = 'triton'\), got Tensor"):
        attention_context(cu, positions_from_cu_seqlens(cu), dataclasses.replace(DSA, impl="triton"), mask=_ctx(cu, DSA).mask)


def test_llama4_attention_knobs_are_checked():
    with pytest.raises(ValueError, match=r"chunk: chunked attention or a sliding window, not both \(window = 4\)"):
        dataclasses.replace(CFG, window=4, chunk=8)
    with pytest.raises(ValueError, match="temperature_floor: expected >= 1, got 0"):
        dataclasses.replace(CFG, temperature_floor=0)
    with pytest.raises(ValueError, match="temperature_scale: expected a finite number, got nan"):
        dataclasses.replace(CFG, temperature_scale=float("nan"))
    for bad in (2, -1, True):
        with pytest.raises(ValueError, match=rf"temperature_offset: expected 0 \(Mistral 4\) or 1 \(Llama 4\), got {bad!r}"):
            dataclasses.replace(CFG, temperature_floor=4, temperature_offset=bad)
    p, x, cu = _params(CFG), torch.randn(6, H), torch.tensor([0, 6])
    rms = dataclasses.replace(CFG, qk_norm="rms")
    with pytest.raises(ValueError, match=r"params\['q_norm'\]: expected none with cfg.qk_norm = 'rms'"):
        attention(x, dict(p, q_norm=torch.ones(16), k_norm=torch.ones(16)), rms, _ctx(cu, rms))
    chunked = dataclasses.replace(CFG, chunk=4)
    with pytest.raises(ValueError, match="ctx: built for the sliding window None and chunk None, this layer attends over window None and chunk 4"):
        attention(x, p, chunked, _ctx(cu, CFG))
    warm = dataclasses.replace(CFG, rope=False, temperature_floor=2)
    with pytest.raises(ValueError, match="ctx: has no positions for cfg.temperature_floor's query scales"):
        attention(x, p, warm, dataclasses.replace(_ctx(cu, warm), positions=None))
    window, based = dataclasses.replace(CFG, window=4), dataclasses.replace(CFG, window=4, local_rope_base=100.0)
    with pytest.raises(ValueError, match="ctx: built with the local layers' RoPE base None, this layer's is 100.0"):
        attention(x, p, based, _ctx(cu, window))
    with pytest.raises(ValueError, match="ctx: built with the local layers' RoPE base 100.0, this layer's is None"):
        attention(x, p, window, _ctx(cu, based))
    for bad in (1.0, float("inf"), True, "100"):
        with pytest.raises(ValueError, match=f"local_rope_base: expected None or a finite number > 1, got {bad!r}"):
            dataclasses.replace(window, local_rope_base=bad)
    with pytest.raises(ValueError, match="local_rope_base: plain RoPE in the local layers is not built beside YaRN with a yarn_mscale_all_dim"):
        dataclasses.replace(YARN, window=4, local_rope_base=100.0)


def test_laguna_attention_knobs_gate_per_head_and_rotate_the_local_layers_own_channels():
    """gate_act / gate_per_head: softplus or sigmoid of one gate per head over its channels;
    local_rot_dim: the local layers' own RoPE over its own channels (tables of that width)."""
    p, x, cu = _params(CFG), torch.randn(6, H), torch.tensor([0, 6])
    based = dataclasses.replace(CFG, window=4, local_rope_base=100.0)
    # a gate per head is the per-channel gate with each head's column repeated over its channels, for either activation
    wg = torch.randn(H, 4)
    for act in ("sigmoid", "softplus"):
        per_head, per_channel = (dataclasses.replace(CFG, gate_act=act, gate_per_head=h) for h in (True, False))
        y = attention(x, dict(p, wg=wg), per_head, _ctx(cu, CFG))[0]
        torch.testing.assert_close(y, attention(x, dict(p, wg=wg.repeat_interleave(16, dim=1)), per_channel, _ctx(cu, CFG))[0])
        assert not torch.allclose(y, attention(x, p, CFG, _ctx(cu, CFG))[0], atol=1e-3)
    with pytest.raises(ValueError, match=r"params\['wg'\]: expected torch.float32 \[32, 64\] tensor or none, got torch.float32 \[32, 4\]"):
        attention(x, dict(p, wg=wg), CFG, _ctx(cu, CFG))
    with pytest.raises(ValueError, match="gate_act: expected one of sigmoid, softplus, got 'tanh'"):
        dataclasses.replace(CFG, gate_act="tanh")
    # the local layers' own rotated channels (Laguna's: all of them, beside the full layers' part): their tables that wide
    part = dataclasses.replace(based, rot_dim=8)
    wide = dataclasses.replace(part, local_rot_dim=16)
    ctx = _ctx(cu, wide)
    assert ctx.cos.shape == (6, 4) and ctx.local_cos.shape == (6, 8)
    with pytest.raises(ValueError, match="ctx: built with the local layers' RoPE over 8 channels, this layer rotates 16"):
        attention(x, p, wide, _ctx(cu, part))
    # the wide local layer is the narrow one on q and k rotated over every channel (the same tables, whole heads)
    whole = dataclasses.replace(based, rot_dim=None)
    torch.testing.assert_close(attention(x, p, wide, ctx)[0], attention(x, p, whole, _ctx(cu, whole))[0])


def test_head_layer_qk_norms_are_a_layernorm_per_head_with_its_own_weights():
    """qk_norm "head_layer" (Command R+'s): a LayerNorm without bias over each head's queries and
    keys before RoPE, each head with its own weights q_norm [N, D], k_norm [G, D]."""
    p, x, cu = _params(CFG), torch.randn(6, H), torch.tensor([0, 6])
    cohere = dataclasses.replace(CFG, qk_norm="head_layer")
    q_norm, k_norm = 1 + 0.3 * torch.randn(4, 16), 1 + 0.3 * torch.randn(2, 16)
    plain = dataclasses.replace(CFG, rope=False)
    got = attention(x, dict(p, q_norm=q_norm, k_norm=k_norm), dataclasses.replace(cohere, rope=False), _ctx(cu, plain))[0]
    # by hand: the normed q and k from the projections, then the plain attention on them (wq, wk folded away)
    q, k = (x @ p["wq"]).view(6, 4, 16), (x @ p["wk"]).view(6, 2, 16)
    q, k = (torch.nn.functional.layer_norm(t, (16,), eps=CFG.norm_eps) * w for t, w in ((q, q_norm), (k, k_norm)))
    scores = torch.einsum("tnd,snd->nts", q, k.repeat_interleave(2, dim=1)) / 4.0
    probs = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = torch.einsum("nts,snd->tnd", probs, (x @ p["wv"]).view(6, 2, 16).repeat_interleave(2, dim=1)).reshape(6, 64) @ p["wo"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"params\['q_norm'\]: expected \[4, 16\], got \[16\]"):
        attention(x, dict(p, q_norm=torch.ones(16), k_norm=k_norm), cohere, _ctx(cu, cohere))
    with pytest.raises(ValueError, match=r"zero_centered_norms: a gain of 1 \+ weight in RMSNorms, not in the LayerNorms of qk_norm 'head_layer'"):
        dataclasses.replace(cohere, zero_centered_norms=True)


@pytest.mark.parametrize("kind", ["head_layer", "layer"])
def test_qk_layer_norms_with_biases(kind):
    """qk_norm_bias: the q/k LayerNorms' biases of their weights' shapes, added after the gain:
    Chameleon's per head ("head_layer": [N, D], [G, D]), Persimmon's one for every head
    ("layer": [D]); against the LayerNorm by hand; checked by name."""
    p, x, cu = _params(CFG), torch.randn(6, H), torch.tensor([0, 6])
    cfg = dataclasses.replace(CFG, qk_norm=kind, qk_norm_bias=True, rope=False)
    shapes = ((4, 16), (2, 16)) if kind == "head_layer" else ((16,), (16,))
    g = torch.Generator().manual_seed(7)
    q_norm, k_norm = (1 + 0.3 * torch.randn(s, generator=g) for s in shapes)
    q_bias, k_bias = (0.3 * torch.randn(s, generator=g) for s in shapes)
    got = attention(x, dict(p, q_norm=q_norm, k_norm=k_norm, q_norm_bias=q_bias, k_norm_bias=k_bias), cfg, _ctx(cu, cfg))[0]
    q, k = (x @ p["wq"]).view(6, 4, 16), (x @ p["wk"]).view(6, 2, 16)
    q, k = (torch.nn.functional.layer_norm(t, (16,), eps=CFG.norm_eps) * w + b for t, w, b in ((q, q_norm, q_bias), (k, k_norm, k_bias)))
    scores = torch.einsum("tnd,snd->nts", q, k.repeat_interleave(2, dim=1)) / 4.0
    probs = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = torch.einsum("nts,snd->tnd", probs, (x @ p["wv"]).view(6, 2, 16).repeat_interleave(2, dim=1)).reshape(6, 64) @ p["wo"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    unbiased = attention(x, dict(p, q_norm=q_norm, k_norm=k_norm), dataclasses.replace(cfg, qk_norm_bias=False), _ctx(cu, cfg))[0]
    assert _rel(unbiased, got) > 1e-2  # the biases matter
    with pytest.raises(ValueError, match=r"params\['q_norm_bias'\]: expected a bias with cfg.qk_norm_bias = True"):
        attention(x, dict(p, q_norm=q_norm, k_norm=k_norm), cfg, _ctx(cu, cfg))
    with pytest.raises(ValueError, match=re.escape(f"params['k_norm_bias']: expected {list(shapes[1])}, got [3]")):
        attention(x, dict(p, q_norm=q_norm, k_norm=k_norm, q_norm_bias=q_bias, k_norm_bias=torch.zeros(3)), cfg, _ctx(cu, cfg))
    with pytest.raises(ValueError, match=r"qk_norm_bias: the q/k LayerNorms' biases \(a bool; True needs qk_norm 'head_layer' or 'layer'\), got True "
                                         r"with qk_norm 'head'"):
        dataclasses.replace(CFG, qk_norm="head", qk_norm_bias=True)
    with pytest.raises(ValueError, match="zero_centered_norms: a gain of 1 \\+ weight in RMSNorms, not in the LayerNorms of qk_norm 'layer'"):
        dataclasses.replace(CFG, qk_norm="layer", zero_centered_norms=True)


def _block_sets(bm):
    """(visited-but-masked, full) [n_q_blocks, n_kv_blocks] bool of a BlockMask (B = H = 1)."""
    out = []
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        num, idx = num[0, 0], idx[0, 0]
        keep = torch.arange(idx.shape[-1])[None, :] < num[:, None]
        out.append(torch.zeros(idx.shape, dtype=torch.bool).scatter_(1, idx.long(), keep))
    return out


def _allowed(bm, shape):
    """The [Tq, Tk] entries a BlockMask lets through: full blocks, and mask_mod inside visited ones."""
    partial, full = _block_sets(bm)
    (bq, bk), (Tq, Tk) = bm.BLOCK_SIZE, shape
    q, k = torch.meshgrid(torch.arange(Tq), torch.arange(Tk), indexing="ij")
    zero = torch.zeros((), dtype=torch.long)
    blocks_q, blocks_k = q // bq, k // bk
    return full[blocks_q, blocks_k] | (partial[blocks_q, blocks_k] & bm.mask_mod(zero, zero, q, k))


def _create_block_mask(dense, block):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: dense[q, k], None, None, *dense.shape, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize("cu, block, has_full, window", [
    ([0, 3, 3, 40, 41, 100, 300], 16, True, None),    # an empty document; T not a multiple of the block
    ([0, 300], 16, True, None),                       # one document
    ([0, *range(1, 300, 2), 300], 16, False, None),   # 1- and 2-token documents: no whole block in one
    ([0, 16, 32, 48, 64, 200, 256], 16, True, None),  # documents on block edges
    ([0, 5, 130, 250, 300], 128, False, None),        # FlexAttention's default block
    # sliding windows: narrower than a block (no full block), a few blocks, on block edges
    ([0, 3, 3, 40, 41, 100, 300], 16, False, 7),
    ([0, 300], 16, True, 50),
    ([0, 16, 32, 48, 64, 200, 256], 16, True, 32),
    ([0, 300], 16, False, 31),                        # one key short of two blocks: no pair is full (one key too wide made some)
    ([0, 5, 130, 250, 300], 128, False, 100),
    ([0, 9], 4, True, None),                          # a last block of one token, which sees itself
    ([0, 16], 4, False, 5),                           # a query block exactly a window past a key block: not visited
])
def test_block_mask_is_create_block_masks_without_the_dense_mask(cu, block, has_full, window):
    """document_mask(flex=True) equals create_block_mask on the dense mask: the same blocks
    visited, the same full blocks, the same entries allowed (with a sliding window too)."""
    cu = torch.tensor(cu)
    T = int(cu[-1])
    dense = document_mask(cu, T, flex=False, window=window)
    ours, ref = document_mask(cu, T, flex=True, block_size=block, window=window), _create_block_mask(dense, block)
    for got, want in zip(_block_sets(ours), _block_sets(ref)):
        assert torch.equal(got, want)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert tuple(ours.shape[-2:]) == (T, T) and torch.equal(_allowed(ours, (T, T)), dense)
    assert bool(_block_sets(ours)[1].any()) == has_full  # full blocks: mask_mod skipped


@pytest.mark.parametrize("T, cp, block, window", [(256, 2, 16, None), (256, 4, 16, None), (48, 2, 16, None), (60, 3, 8, None),
                                                  (256, 2, 16, 40), (60, 3, 8, 5)])
def test_context_parallel_block_mask_covers_every_allowed_entry(T, cp, block, window):
    """Under context parallel: the full blocks are create_block_mask's; the visited ones
    are its own when the cp chunks (T / 2cp) are whole blocks, else a superset; the entries
    let through are the dense mask's (with a sliding window too)."""
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu = torch.tensor([0, 7, 7, 30, 31, 45, T])
    kv_index = cp_kv_index(T, cp)
    for rank in range(cp):
        index = cp_token_index(T, cp, rank)
        dense = document_mask(cu, T, flex=False, token_index=index, kv_index=kv_index, window=window)
        ours = document_mask(cu, T, flex=True, token_index=index, kv_index=kv_index, block_size=block, window=window)
        (partial, full), (ref_partial, ref_full) = _block_sets(ours), _block_sets(_create_block_mask(dense, block))
        assert torch.equal(full, ref_full)
        assert bool((partial | full)[ref_partial].all())
        if (T // (2 * cp)) % block == 0:
            assert torch.equal(partial, ref_partial)
        assert torch.equal(_allowed(ours, dense.shape), dense)


def test_block_mask_memory_does_not_grow_with_t_squared():
    """At T = 16384 the dense mask would be 256 MiB; the BlockMask's build holds < 2 MiB."""
    from fmoe.train.metrics import AllocatedBytes

    T = 16384
    cu = torch.tensor([0, 1000, 1001, 9000, 16000, T])
    with AllocatedBytes() as mem:
        bm = document_mask(cu, T, flex=True)
    assert mem.peak < 2 * 2**20, mem.peak
    assert int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) < (T // 128) ** 2 // 2  # documents and causality prune half


def test_block_size_must_be_a_positive_int():
    for bad in (0, -128, 1.5, True):
        with pytest.raises(ValueError, match="block_size: expected a positive int"):
            document_mask(torch.tensor([0, 8]), 8, flex=True, block_size=bad)


def test_a_context_is_shared_and_reads_no_value_on_the_host():
    from fmoe.train.metrics import HostReads

    cu, positions = torch.tensor([0, 4, 10]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    with HostReads() as reads:
        ctx = attention_context(cu, positions, YARN)
        shifted = attention_context(cu, positions + 1, YARN, mask=ctx.mask)  # another MTP depth
    assert reads.count == 0, reads.sites
    assert isinstance(ctx, AttentionContext) and shifted.mask is ctx.mask
    assert ctx.cos.shape == (10, 8) and ctx.cos.dtype == torch.float32
    torch.testing.assert_close(shifted.cos, rope_tables(positions + 1, YARN)[0])
    torch.testing.assert_close(ctx.sin, rope_tables(positions, YARN)[1])


def test_no_token_on_every_path():
    """T = 0 (an empty batch, cu_seqlens [0] or [0, 0]): an empty [0, H] output on the SDPA and the FlexAttention paths,
    with and without sinks (flex_attention itself refuses an empty length), and zero gradients."""
    for impl, sinks, cu in (("torch", False, [0]), ("flex", False, [0]), ("flex", False, [0, 0]), ("flex", True, [0, 0])):
        cfg = dataclasses.replace(CFG, impl=impl)
        p = _params(cfg)
        if sinks:
            p["sinks"] = torch.zeros(cfg.n_heads, requires_grad=True)
        ctx = attention_context(torch.tensor(cu), torch.zeros(0, dtype=torch.long), cfg)
        with torch.set_grad_enabled(impl == "torch"):  # FlexAttention has no backward on CPU
            out, _ = attention(torch.randn(0, H), p, cfg, ctx)
        assert out.shape == (0, H), (impl, cu)
        if impl == "torch":
            out.sum().backward()
            assert all(w.grad is not None and not w.grad.any() for w in p.values())


@pytest.mark.gpu
@pytest.mark.parametrize("window, sinks, chunk, alibi", [(None, False, None, False), (512, False, None, False), (128, True, None, False),
                                                         (None, False, 1000, False), (512, True, None, True)])
def test_gpu_flex_attention_matches_reference(window, sinks, chunk, alibi):
    """FlexAttention against the reference; with sinks (gpt-oss) the gradient also flows
    through the kernel's log-sum-exp; chunked attention (Llama 4) with chunks that are not
    whole blocks; ALiBi's biases (BLOOM's) in the compiled kernel's score_mod."""
    cfg = AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128, window=window, chunk=chunk, rope=not alibi)
    Hg = 2048
    shapes = {"wq": (Hg, 16 * 128), "wk": (Hg, 4 * 128), "wv": (Hg, 4 * 128), "wo": (16 * 128, Hg)}
    p = {n: (torch.randn(*s, device="cuda") * s[0] ** -0.5).bfloat16() for n, s in shapes.items()}
    if sinks:
        p.update(sinks=torch.randn(16, device="cuda").bfloat16(), bo=torch.randn(Hg, device="cuda").bfloat16())
    x = torch.randn(4096, Hg, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1000, 1001, 3000, 4096], device="cuda", dtype=torch.int32)
    p = {n: t.requires_grad_() for n, t in p.items()}
    if alibi:  # constants: no gradient
        p["alibi"] = alibi_slopes(16, device="cuda")
    upstream = torch.randn_like(x)
    trained = [t for t in p.values() if t.requires_grad]
    flex, _ = attention(x, p, cfg, _ctx(cu, cfg))  # auto: compiled FlexAttention
    g_flex = torch.autograd.grad(flex, trained, upstream)
    ref_cfg = dataclasses.replace(cfg, impl="torch")
    ref, _ = attention(x, p, ref_cfg, _ctx(cu, ref_cfg))
    g_ref = torch.autograd.grad(ref, trained, upstream)
    assert _rel(flex, ref) < 2e-2
    for a, b in zip(g_flex, g_ref):
        assert _rel(a, b) < 3e-2


# ---------------------------------------------------------------------------- context parallel
# Across real ranks (gloo, forward and backward): tests/parallel/test_context.py. Here one
# process plays one rank: its tokens, and a gather_kv that returns the whole batch's keys and
# values in the cp ranks' order (what the all-gather brings) with its own rows in place.


def _one_rank_of_cp(x, p, cfg, cu, cp, rank):
    """(token_index, ctx) of cp rank `rank` of the batch x [T, H] with documents cu."""
    from fmoe.parallel import cp_kv_index, cp_token_index

    T, G, D = x.shape[0], cfg.n_kv_heads, cfg.head_dim
    positions = positions_from_cu_seqlens(cu)
    index, kv_index = cp_token_index(T, cp, rank, device=x.device), cp_kv_index(T, cp, device=x.device)
    with torch.no_grad():
        cos, sin = rope_tables(positions, cfg)
        k_all = apply_rope((x @ p["wk"]).view(T, G, D), cos, sin, interleaved=cfg.interleaved, impl="torch")[kv_index]
        v_all = (x @ p["wv"]).view(T, G, D)[kv_index]
    own_rows = torch.arange(rank * T // cp, (rank + 1) * T // cp, device=x.device)

    def gather_kv(k, v):
        return k_all.index_copy(0, own_rows, k), v_all.index_copy(0, own_rows, v)

    ctx = attention_context(cu, positions[index], cfg, token_index=index, kv_index=kv_index, gather_kv=gather_kv)
    return index, ctx


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_rank_gives_its_rows_of_the_whole_batch(cp, impl):
    cfg = dataclasses.replace(YARN, impl=impl)
    _check_cp_rows(cfg, {n: t.detach() for n, t in _params(cfg).items()}, cp)


def _check_cp_rows(cfg, p, cp):
    """Each of cp ranks' outputs (its two chunks of 24 tokens in 5 documents) are the one
    process's rows of them (forward only: FlexAttention has no CPU backward; gradients:
    tests/parallel)."""
    cu = torch.tensor([0, 3, 4, 13, 21, 24], dtype=torch.int32)  # chunks of 3 (cp=4) or 6 (cp=2)
    x = torch.randn(24, H)
    with torch.no_grad():
        whole, _ = attention(x, p, cfg, _ctx(cu, cfg))
        for rank in range(cp):
            index, ctx = _one_rank_of_cp(x, p, cfg, cu, cp, rank)
            y, _ = attention(x[index], p, cfg, ctx)
            assert _rel(y, whole[index]) < 1e-5, rank


def test_context_parallel_mask_is_the_document_mask_at_global_indices():
    from fmoe.parallel import cp_kv_index, cp_token_index
    from fmoe.train.metrics import HostReads

    cu = torch.tensor([0, 3, 3, 10, 16])
    whole = document_mask(cu, 16, flex=False)
    zero = torch.zeros((), dtype=torch.long)
    for cp in (2, 4):
        kv_index = cp_kv_index(16, cp)
        for rank in range(cp):
            index = cp_token_index(16, cp, rank)
            positions = positions_from_cu_seqlens(cu)[index]  # where the batch is made: values read there
            with HostReads() as reads:
                ctx = attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index, gather_kv=lambda k, v: (k, v))
            assert reads.count == 0, reads.sites
            assert torch.equal(ctx.mask, whole[index][:, kv_index])  # [T/cp, T]
            block = document_mask(cu, 16, flex=True, token_index=index, kv_index=kv_index)
            assert tuple(block.shape[-2:]) == (16 // cp, 16)
            q, k = torch.meshgrid(torch.arange(16 // cp), torch.arange(16), indexing="ij")
            assert torch.equal(block.mask_mod(zero, zero, q, k), ctx.mask)


def test_context_parallel_over_one_rank_is_the_plain_layer():
    cu = torch.tensor([0, 5, 6, 16])
    x, p = torch.randn(16, H), _params(CFG)
    ctx = attention_context(cu, positions_from_cu_seqlens(cu), CFG, token_index=torch.arange(16), kv_index=torch.arange(16), gather_kv=lambda k, v: (k, v))
    assert ctx.gather_kv is not None and _ctx(cu, CFG).gather_kv is None
    torch.testing.assert_close(attention(x, p, CFG, ctx)[0], attention(x, p, CFG, _ctx(cu, CFG))[0], rtol=0, atol=0)


def test_context_parallel_bad_inputs():
    cu, index, kv_index = torch.tensor([0, 16]), torch.arange(8), torch.arange(16)
    positions = torch.arange(8)
    keep = lambda k, v: (k, v)  # noqa: E731
    with pytest.raises(ValueError, match="kv_index: context parallel needs token_index, kv_index and gather_kv together"):
        attention_context(cu, positions, CFG, token_index=index, gather_kv=keep)
    with pytest.raises(ValueError, match="token_index: expected one global index per local token"):
        attention_context(cu, positions, CFG, token_index=kv_index, kv_index=kv_index, gather_kv=keep)
    with pytest.raises(ValueError, match="kv_index: expected dtype int32 or int64"):
        attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index.float(), gather_kv=keep)
    with pytest.raises(ValueError, match="gather_kv: expected a callable"):
        attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index, gather_kv="all-gather")
    with pytest.raises(ValueError, match=r"mask: expected a \[8, 16\] bool tensor"):
        attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index, gather_kv=keep, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_index: expected token_index and kv_index together"):
        document_mask(cu, 16, flex=False, token_index=index)
    # a gather that returns only the local rows does not fit the [8, 16] mask
    ctx = attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index, gather_kv=keep)
    with pytest.raises(ValueError, match="ctx.gather_kv: returned 8 keys and 8 values, the mask has 16 keys"):
        attention(torch.randn(8, H), _params(CFG), CFG, ctx)
    ctx = attention_context(cu, positions, CFG, token_index=index, kv_index=kv_index, gather_kv=lambda k, v: (torch.cat([k, k]), v))
    with pytest.raises(ValueError, match="ctx.gather_kv: returned 16 keys and 8 values, the mask has 16 keys"):
        attention(torch.randn(8, H), _params(CFG), CFG, ctx)


@pytest.mark.gpu
def test_gpu_flex_attention_with_the_context_parallel_block_mask():
    """One rank's share at a real size: compiled FlexAttention with the [T/cp, T] block mask
    against the SDPA reference on the same split (forward and gradients), and its output
    against its rows of the whole batch."""
    cfg = AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128)
    ref_cfg = dataclasses.replace(cfg, impl="torch")
    Hg, T, cp = 2048, 8192, 4
    shapes = {"wq": (Hg, 16 * 128), "wk": (Hg, 4 * 128), "wv": (Hg, 4 * 128), "wo": (16 * 128, Hg)}
    p = {n: (torch.randn(*s, device="cuda") * s[0] ** -0.5).bfloat16().requires_grad_() for n, s in shapes.items()}
    x = torch.randn(T, Hg, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1000, 1001, 5000, T], device="cuda", dtype=torch.int32)  # documents across the chunks
    with torch.no_grad():
        whole, _ = attention(x, p, ref_cfg, _ctx(cu, ref_cfg))
    for rank in (0, cp - 1):
        index, flex_ctx = _one_rank_of_cp(x, p, cfg, cu, cp, rank)  # auto on CUDA: the BlockMask
        _, ref_ctx = _one_rank_of_cp(x, p, ref_cfg, cu, cp, rank)
        assert not isinstance(flex_ctx.mask, torch.Tensor) and tuple(flex_ctx.mask.shape[-2:]) == (T // cp, T)
        x_local = x[index].detach().requires_grad_()
        upstream = torch.randn(T // cp, Hg, device="cuda", dtype=torch.bfloat16)
        flex, _ = attention(x_local, p, cfg, flex_ctx)
        g_flex = torch.autograd.grad(flex, [x_local, *p.values()], upstream)
        ref, _ = attention(x_local, p, ref_cfg, ref_ctx)
        g_ref = torch.autograd.grad(ref, [x_local, *p.values()], upstream)
        assert _rel(flex, ref) < 2e-2 and _rel(flex, whole[index]) < 2e-2, rank
        for a, b in zip(g_flex, g_ref):
            assert _rel(a, b) < 3e-2, rank


# ---------------------------------------------------------------------------- multi-latent attention
MLA = AttentionConfig(n_heads=4, n_kv_heads=4, head_dim=12, rot_dim=4, interleaved=True, q_rank=10, kv_rank=6, v_dim=5,
                      yarn_factor=4.0, yarn_original_max_positions=16, yarn_mscale=0.8, yarn_mscale_all_dim=1.0)


def _mla_params(cfg, dtype=torch.float32, device="cpu"):
    from fmoe.layers import mla_shapes, q_in

    mats, norms = mla_shapes(H, cfg)
    if cfg.gate_on_q:  # the output gate, reading wq_b's input
        mats["wg"] = (q_in(cfg), cfg.n_heads * cfg.v_dim)
    p = {n: (torch.randn(*s, device=device) * s[0] ** -0.5).to(dtype) for n, s in mats.items()}
    p.update({n: 1 + 0.3 * torch.randn(*s, device=device) for n, s in norms.items()})
    return {n: t.requires_grad_() for n, t in p.items()}


def _mla_loop_parts(x, p, cfg, cu):
    """The per-token definitions' pieces of multi-latent attention: the normed q latent (None
    without q_rank), q [T, N, D], the expanded kv [T, N, D - R + v_dim], the rotated q rope
    and shared k rope, the softmax scale (YaRN's mscale_all_dim) and the RoPE tables."""
    T, N, D, R, Dv = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.rot_dim, cfg.v_dim

    def rms(t, w):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + cfg.latent_norm_eps) * w

    q_lat = rms(x @ p["wq_a"], p["q_a_norm"]) if cfg.q_rank else None
    if cfg.q_latent_raw:  # wq_b reads the q latent normed, then as it is
        q_lat = torch.cat([q_lat, x @ p["wq_a"]], dim=-1)
    q = (q_lat @ p["wq_b"]).view(T, N, D) if cfg.q_rank else (x @ p["wq"]).view(T, N, D)
    q_scale, kv_scale = cfg.latent_scales or (1.0, 1.0)  # LongCat-Flash's: the queries', the normed kv latent's
    q = q * q_scale
    kv_a = x @ p["wkv_a"]
    kv = (rms(kv_a[:, :cfg.kv_rank], p["kv_a_norm"]) * kv_scale @ p["wkv_b"]).view(T, N, D - R + Dv)
    cos, sin = rope_tables(positions_from_cu_seqlens(cu), cfg)
    q_rope, k_rope = q[..., D - R:], kv_a[:, cfg.kv_rank:]
    if cfg.rope:
        q_rope = apply_rope(q_rope, cos, sin, interleaved=cfg.interleaved, impl="torch")
        k_rope = apply_rope(k_rope[:, None], cos, sin, interleaved=cfg.interleaved, impl="torch")[:, 0]
    if cfg.temperature_floor is not None:  # Mistral 4's query scale, on every channel after RoPE
        temp = _temperatures(positions_from_cu_seqlens(cu), cfg)[:, None, None]
        q, q_rope = q * temp, q_rope * temp
    scale = (yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2 if cfg.yarn_factor else 1.0) / math.sqrt(D)
    return q_lat, q, kv, q_rope, k_rope, scale, (cos, sin)


def _loop_mla(x, p, cfg, cu):
    """DeepSeek-V3's attention written out per token and head: latents, norms, the rotary
    key shared by all heads, a softmax over q.k (nope + rope) scaled by YaRN's mscale_all_dim."""
    N, D, R = cfg.n_heads, cfg.head_dim, cfg.rot_dim
    q_lat, q, kv, q_rope, k_rope, scale, _ = _mla_loop_parts(x, p, cfg, cu)
    rows = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            heads = []
            for h in range(N):
                score = kv[a:t + 1, h, :D - R] @ q[t, h, :D - R] + k_rope[a:t + 1] @ q_rope[t, h]
                heads.append(torch.softmax(score * scale, dim=0) @ kv[a:t + 1, h, D - R:])
            rows.append(torch.cat(heads))
    out = torch.stack(rows)
    if "wg" in p:  # the output gate, of wq_b's input with gate_on_q
        out = out * torch.sigmoid((q_lat if cfg.gate_on_q else x) @ p["wg"])
    return out @ p["wo"]


MLA_TEMPERATURE = dataclasses.replace(MLA, temperature_floor=2, temperature_scale=0.5, temperature_offset=0)  # Mistral 4's


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("cfg", [MLA, dataclasses.replace(MLA, q_rank=None, interleaved=False, yarn_factor=None), MLA_TEMPERATURE,
                                 dataclasses.replace(MLA, q_latent_raw=True, gate_on_q=True, latent_scales=(0.5, 2.0), latent_norm_eps=1e-2),
                                 dataclasses.replace(MLA, rope=False)],
                         ids=["q-latent-yarn", "full-q-rope", "query-temperature", "raw-q-latent-gate-scales-eps", "nope"])
def test_multi_latent_attention_matches_per_token_loop(cfg, impl):
    _check_against_definition(cfg, impl, _mla_params(cfg), _loop_mla)  # flex: v_dim 5 != q/k dim 12


@pytest.mark.parametrize("cfg", [MLA, MLA_TEMPERATURE], ids=["q-latent-yarn", "query-temperature"])
def test_multi_latent_attention_under_context_parallel(cfg):
    """One cp rank's rows of the whole batch, with the expanded keys and values gathered (the
    query temperature by each rank's own tokens' positions)."""
    from fmoe.layers import _mla_qkv
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu, cp, T = torch.tensor([0, 3, 4, 13, 21, 24], dtype=torch.int32), 2, 24
    p = {n: t.detach() for n, t in _mla_params(cfg).items()}
    x = torch.randn(T, H)
    positions = positions_from_cu_seqlens(cu)
    with torch.no_grad():
        whole, _ = attention(x, p, cfg, _ctx(cu, cfg))
        _, k_all, v_all = _mla_qkv(x, p, cfg, _ctx(cu, cfg))
        kv_index = cp_kv_index(T, cp)
        for rank in range(cp):
            index = cp_token_index(T, cp, rank)
            own = torch.arange(rank * T // cp, (rank + 1) * T // cp)
            ctx = attention_context(cu, positions[index], cfg, token_index=index, kv_index=kv_index,
                                    gather_kv=lambda k, v: (k_all[kv_index].index_copy(0, own, k), v_all[kv_index].index_copy(0, own, v)))
            y, _ = attention(x[index], p, cfg, ctx)
            assert _rel(y, whole[index]) < 1e-5, rank


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("cfg", [MLA, dataclasses.replace(MLA, q_rank=None, interleaved=False, yarn_factor=None), MLA_TEMPERATURE],
                         ids=["q-latent-yarn", "full-q-rope", "query-temperature"])
def test_multi_latent_attention_over_cached_latents_is_the_same_function(cfg, form):
    """latents "absorbed": each query head moved into the latent space, one shared latent key
    and value, the output moved back per head; "expanded": the gathered latents expanded
    per head, ordinary queries. Both the per-token definition, values and gradients, with
    keys [T, 1, kv_rank + R] and values [T, 1, kv_rank] through gather_kv (a cache's form)."""
    cu = torch.tensor([0, 3, 4, 13, 16], dtype=torch.int32)
    p = _mla_params(cfg)
    x = torch.randn(16, H, requires_grad=True)
    seen = []

    def gather_kv(k, v):
        seen.append((tuple(k.shape), tuple(v.shape)))
        return k, v

    ctx = dataclasses.replace(_ctx(cu, cfg), gather_kv=gather_kv, latents=form)
    y, _ = attention(x, p, cfg, ctx)
    want = _loop_mla(x, p, cfg, cu)
    assert seen == [((16, 1, cfg.kv_rank + cfg.rot_dim), (16, 1, cfg.kv_rank))]
    assert _rel(y, want) < 1e-5
    up = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *p.values()], up)
    want_grads = torch.autograd.grad(want, [x, *p.values()], up)
    for name, a, b in zip(["x", *p], grads, want_grads):
        assert _rel(a, b) < 1e-4, name


def test_multi_latent_attention_bad_inputs():
    with pytest.raises(ValueError, match="n_kv_heads: multi-latent attention expands keys and values per head"):
        dataclasses.replace(MLA, n_kv_heads=2)
    with pytest.raises(ValueError, match="rot_dim: multi-latent attention rotates a part"):
        dataclasses.replace(MLA, rot_dim=None)
    with pytest.raises(ValueError, match="qk_norm: not with multi-latent attention"):
        dataclasses.replace(MLA, qk_norm="head")
    with pytest.raises(ValueError, match="q_rank: expected None or a positive int"):  # without kv_rank: grouped-query attention's q latent
        dataclasses.replace(CFG, q_rank=True)
    with pytest.raises(ValueError, match="v_dim: expected a positive int"):
        dataclasses.replace(MLA, v_dim=0)
    for bad in (0, True, 1.5):  # grouped-query attention's value head dim
        with pytest.raises(ValueError, match=f"v_dim: expected None or a positive int \\(the value head dim\\), got {bad!r}"):
            dataclasses.replace(CFG, v_dim=bad)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match=f"v_scale: expected a finite number > 0, got {bad!r}"):
            dataclasses.replace(CFG, v_scale=bad)
    with pytest.raises(ValueError, match="v_scale: scales grouped-query attention's values, not multi-latent attention's"):
        dataclasses.replace(MLA, v_scale=0.5)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    x, p = torch.randn(6, H), {n: t.detach() for n, t in _mla_params(MLA).items()}
    with pytest.raises(ValueError, match=r"params\['wkv_b'\]: expected torch.float32 \[6, 52\]"):
        attention(x, {**p, "wkv_b": p["wkv_b"][:, :5]}, MLA, _ctx(cu, MLA))
    with pytest.raises(ValueError, match=r"params\['q_a_norm'\]: expected a \[10\] norm weight, got nothing"):
        attention(x, {n: t for n, t in p.items() if n != "q_a_norm"}, MLA, _ctx(cu, MLA))
    with pytest.raises(ValueError, match=r"params\['kv_a_norm'\]: expected a \[6\] norm weight, got \[5\]"):
        attention(x, {**p, "kv_a_norm": p["kv_a_norm"][:5]}, MLA, _ctx(cu, MLA))
    with pytest.raises(ValueError, match=r"ctx: RoPE tables of shape \(5, 2\) do not fit x's 6 tokens and rot_dim 4 \(expected \(6, 2\)\)"):
        attention(x, p, MLA, _ctx(torch.tensor([0, 5]), MLA))
    with pytest.raises(ValueError, match=r"params: unknown multi-latent attention parameters \['wk'\]"):
        attention(x, {**p, "wk": p["wo"]}, MLA, _ctx(cu, MLA))
    gqa = {n: t.detach() for n, t in _params(CFG).items()}
    for form in ("absorbed", "expanded"):
        with pytest.raises(ValueError, match="ctx.latents: a cache of latents is multi-latent attention's"):
            attention(x, gqa, CFG, dataclasses.replace(_ctx(cu, CFG), latents=form))
    with pytest.raises(ValueError, match="ctx.latents: expected None, 'absorbed' or 'expanded', got True"):
        attention(x, p, MLA, dataclasses.replace(_ctx(cu, MLA), latents=True, gather_kv=lambda k, v: (k, v)))
    with pytest.raises(ValueError, match="ctx.latents: 'expanded' needs the cache's gather_kv"):
        attention(x, p, MLA, dataclasses.replace(_ctx(cu, MLA), latents="expanded"))


# ---------------------------------------------------------------------------- DeepSeek sparse attention
DSA = dataclasses.replace(MLA, index_topk=3, index_heads=8, index_head_dim=6)


def _dsa_params(cfg):
    from fmoe.layers import index_shapes

    p = _mla_params(cfg)
    for name, shape in index_shapes(H, cfg).items():
        value = 1 + 0.3 * torch.randn(shape) if name == "index_k_norm" else torch.randn(shape) * (0.3 if name == "index_k_bias" else shape[0] ** -0.5)
        p[name] = value.requires_grad_()
    return p


def _loop_dsa(x, p, cfg, cu, with_loss=False):
    """DeepSeek-V3.2's sparse attention written out per query: the indexer's LayerNorm'd key
    and per-head queries from the q latent (RoPE on their first rot_dim channels), each
    earlier key of the document scored sum_h w_h / sqrt(Ni) relu(q_h . k / sqrt(Di)), the
    top index_topk kept (equal scores: the earlier key), and multi-latent attention over those
    keys alone. with_loss: also the indexer's loss, the mean over queries of KL(p || q) over
    the kept keys, p the attention's distribution averaged over heads, q the softmax of the
    indexer's scores (its gradient reaching the indexer's weights only). With index_rope_last
    (HY-V4's) the indexer's RoPE is on its last rot_dim channels; its key's LayerNorm eps is
    index_norm_eps."""
    T, N, D, R, Ni, Di = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.rot_dim, cfg.index_heads, cfg.index_head_dim
    q_lat, q, kv, q_rope, k_rope, scale, (cos, sin) = _mla_loop_parts(x, p, cfg, cu)
    x_, q_lat_ = x.detach(), q_lat.detach()  # the indexer's inputs

    def rope(t):  # [T, n, Di]: the first R channels rotated, or the last R
        if not cfg.index_rope_last:
            return apply_rope(t, cos, sin, interleaved=cfg.index_interleaved, impl="torch")
        return torch.cat([t[..., :Di - R], apply_rope(t[..., Di - R:].contiguous(), cos, sin, interleaved=cfg.index_interleaved, impl="torch")], -1)

    k_raw = x_ @ p["index_wk"]
    k_norm = (k_raw - k_raw.mean(-1, keepdim=True)) / torch.sqrt(k_raw.var(-1, unbiased=False, keepdim=True) + cfg.index_norm_eps)
    k_idx = rope((k_norm * p["index_k_norm"] + p["index_k_bias"])[:, None])[:, 0]
    q_idx = rope((q_lat_ @ p["index_wq"]).view(T, Ni, Di))
    w_idx = x_ @ p["index_w"]
    rows, kls = [], []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            score = sum(w_idx[t, h] / math.sqrt(Ni) * torch.relu(k_idx[a:t + 1] @ q_idx[t, h] / math.sqrt(Di)) for h in range(Ni))
            chosen = torch.sort(score.detach(), descending=True, stable=True).indices[:cfg.index_topk]
            keys = a + chosen
            heads, probs = [], []
            for h in range(N):
                s = kv[keys, h, :D - R] @ q[t, h, :D - R] + k_rope[keys] @ q_rope[t, h]
                probs.append(torch.softmax(s * scale, dim=0))
                heads.append(probs[-1] @ kv[keys, h, D - R:])
            rows.append(torch.cat(heads))
            target = (sum(probs) / N).detach()
            kls.append((target * (target.log() - torch.log_softmax(score[chosen], dim=0))).sum())
    y = torch.stack(rows) @ p["wo"]
    return (y, torch.stack(kls).mean()) if with_loss else y


@pytest.mark.parametrize("cfg", [DSA, dataclasses.replace(DSA, index_interleaved=True, yarn_factor=None, index_topk=1),
                                 dataclasses.replace(DSA, index_rope_last=True, index_norm_eps=0.5)], ids=["halves-yarn", "pairs-top1", "hy_v4-rope-last"])
def test_deepseek_sparse_attention_matches_per_query_loop(cfg):
    """Values and gradients against the definition; the indexer's weights get no gradient
    (its choice is discrete), the other weights theirs through the chosen keys."""
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = _dsa_params(cfg)
    x = torch.randn(17, H, requires_grad=True)
    y, _ = attention(x, p, cfg, _ctx(cu, cfg))
    want = _loop_dsa(x, p, cfg, cu)
    assert _rel(y, want) < 1e-5
    dense = attention(x, {n: t for n, t in p.items() if not n.startswith("index_")}, MLA if cfg is DSA else dataclasses.replace(cfg, index_topk=None,
                      index_heads=64, index_head_dim=128, index_interleaved=False, index_rope_last=False, index_norm_eps=1e-6),
                      _ctx(cu, cfg))[0]
    assert _rel(y, dense) > 1e-2  # the documents of 5 and 11 tokens are attended sparsely
    mla = [n for n in p if not n.startswith("index_")]
    up = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *p.values()], up, allow_unused=True)
    want_grads = torch.autograd.grad(want, [x, *(p[n] for n in mla)], up)
    for name, a, b in zip(["x", *mla], grads, want_grads):
        if not b.any():  # top-1: each query's one key takes all the weight, so the queries' weights get none; the CPU flash
            # kernel's probabilities, exp(score - logsumexp), leave float32 rounding there (relative to x's gradient)
            assert float(a.abs().max()) < 1e-5 * float(want_grads[0].abs().max()), name
            continue
        assert _rel(a, b) < 1e-5, name
    assert grads[1 + len(mla):] == (None,) * (len(p) - len(mla))  # the index_ weights, last in p


def test_indexer_keys_rotate_their_last_channels_with_index_rope_last_and_norm_with_its_eps():
    """HY-V4's indexer (index_rope_last): its key's first index_head_dim - rot_dim channels are
    the LayerNorm's output as they are, the last rot_dim rotated (DeepSeek-V3.2's: the first
    rotated, the rest as they are); index_norm_eps is the LayerNorm's eps."""
    from fmoe.layers import index_keys

    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = {n: t.detach() for n, t in _dsa_params(DSA).items()}
    x = 0.01 * torch.randn(17, H)  # keys of a small spread: the eps shows
    R, Di = DSA.rot_dim, DSA.index_head_dim
    ctx = _ctx(cu, DSA)
    k_raw = x @ p["index_wk"]
    for eps in (1e-6, 1e-3):
        normed = torch.nn.functional.layer_norm(k_raw, (Di,), p["index_k_norm"], p["index_k_bias"], eps=eps)
        first = index_keys(x, p, dataclasses.replace(DSA, index_norm_eps=eps), ctx.cos, ctx.sin)
        last = index_keys(x, p, dataclasses.replace(DSA, index_norm_eps=eps, index_rope_last=True), ctx.cos, ctx.sin)
        torch.testing.assert_close(first[:, R:], normed[:, R:], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(last[:, :Di - R], normed[:, :Di - R], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(last[:, Di - R:], apply_rope(normed[:, None, Di - R:].contiguous(), ctx.cos, ctx.sin, impl="torch")[:, 0],
                                   rtol=1e-5, atol=1e-6)
        assert float((last[1:, Di - R:] - normed[1:, Di - R:]).abs().max()) > 1e-2  # rotated past position 0
    wide = index_keys(x, p, dataclasses.replace(DSA, index_norm_eps=1e-3), ctx.cos, ctx.sin)
    assert float((wide - index_keys(x, p, DSA, ctx.cos, ctx.sin)).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="index_rope_last: a knob of DeepSeek sparse attention's indexer, needs index_topk"):
        dataclasses.replace(MLA, index_rope_last=True)
    with pytest.raises(ValueError, match="index_norm_eps: expected a positive finite number, got 0"):
        dataclasses.replace(DSA, index_norm_eps=0)


def test_deepseek_sparse_attention_with_topk_over_the_document_is_multi_latent_attention():
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    cfg = dataclasses.replace(DSA, index_topk=11)  # the longest document: every earlier key is kept
    p = {n: t.detach() for n, t in _dsa_params(cfg).items()}
    x = torch.randn(17, H)
    plain = attention(x, {n: t for n, t in p.items() if not n.startswith("index_")}, MLA, _ctx(cu, MLA))[0]
    torch.testing.assert_close(attention(x, p, cfg, _ctx(cu, cfg))[0], plain, rtol=1e-5, atol=1e-6)


def test_index_slots_keep_the_topk_allowed_keys_as_worked_by_hand():
    from fmoe.layers import index_slots, slots_mask

    def index_mask(scores, mask, topk, **kw):  # the choice as a [T, S] mask
        return slots_mask(index_slots(scores, mask, topk, **kw), scores.shape[1])

    scores = torch.tensor([[5.0, 1.0, 9.0, 0.0], [2.0, 7.0, 1.0, 3.0], [0.0, 0.0, 4.0, 8.0]])
    mask = torch.tensor([[True, False, False, False], [True, True, True, False], [True, True, True, True]])
    # each row's keys best first, -1 where the row allows fewer: row 0 allows one key (kept though key 2
    # scores higher); row 1 keeps 7 and 2, not the masked 3; row 2 keeps 8 and 4
    assert index_slots(scores, mask, 2).tolist() == [[0, -1], [1, 0], [3, 2]]
    assert index_mask(scores, mask, 2).tolist() == [[True, False, False, False], [True, True, False, False], [False, False, True, True]]
    assert index_mask(scores, mask, 4).equal(mask)
    # equal scores go to the earlier key, wherever the row has other keys
    ties = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0]])
    assert index_mask(ties, torch.ones(1, 5, dtype=torch.bool), 3).tolist() == [[True, True, False, True, False]]
    assert index_mask(ties, torch.tensor([[False, True, True, True, True]]), 2).tolist() == [[False, True, False, True, False]]
    # ...the earlier token, with the columns in another order (key_order: the columns in token order)
    perm = torch.tensor([3, 4, 0, 2, 1])  # column j holds token perm[j]
    got = index_mask(ties[:, perm], torch.ones(1, 5, dtype=torch.bool), 3, key_order=torch.argsort(perm))
    assert got.tolist() == [[True, False, True, False, True]]  # tokens 3, 0, 1: columns 0, 2, 4
    assert index_mask(ties[:, perm], torch.ones(1, 5, dtype=torch.bool), 3).tolist() == [[True, True, True, False, False]]


def test_the_choice_is_made_for_blocks_of_queries_alike():
    """The indexer's scores and top-k run over blocks of queries (never the [T, heads, S]
    product at once): blocks of 1 and 3 queries choose what one block of all 17 does."""
    from fmoe.layers import _index_choice, _mla_q_latent, index_keys

    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = {n: t.detach() for n, t in _dsa_params(DSA).items()}
    x = torch.randn(17, H)
    ctx = _ctx(cu, DSA)
    keys = index_keys(x, p, DSA, ctx.cos, ctx.sin)
    whole = _index_choice(x, _mla_q_latent(x, p, DSA), keys, p, DSA, ctx, ctx.mask)
    assert torch.equal(whole, attention(x, p, DSA, ctx)[1]["index_choice"])
    for rows in (DSA.index_heads * 17, 3 * DSA.index_heads * 17):  # blocks of 1 and 3 queries
        assert torch.equal(_index_choice(x, _mla_q_latent(x, p, DSA), keys, p, DSA, ctx, ctx.mask, rows=rows), whole)
    # ...and so do the indexer's loss (each block recomputed in the backward) and its gradients
    from fmoe.layers import _index_loss_blocks, index_loss, index_scores

    pg = _dsa_params(DSA)
    indexer = [n for n in pg if n.startswith("index_")]
    keys_g, q_lat = index_keys(x, pg, DSA, ctx.cos, ctx.sin), _mla_q_latent(x, pg, DSA).detach()
    target = torch.rand(17, 3)
    want = index_loss(index_scores(x, q_lat, keys_g, pg, DSA, ctx.cos, ctx.sin, slots=whole), target, whole >= 0)
    want_grads = torch.autograd.grad(want, [pg[n] for n in indexer])
    for rows in (3 * DSA.index_head_dim, 1 << 26):  # blocks of 1 query, one block
        keys_g = index_keys(x, pg, DSA, ctx.cos, ctx.sin)
        got = _index_loss_blocks(x, q_lat, keys_g, whole, target, pg, DSA, ctx, n_queries=17, rows=rows)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for a, b in zip(torch.autograd.grad(got, [pg[n] for n in indexer]), want_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_index_scores_of_slots_are_the_whole_scores_of_those_keys_and_0_in_an_empty_slot():
    """index_scores with slots=: each query's scores of the keys its slots name, those of the
    [T, S] product, and 0 where a slot is empty (-1: the first queries see fewer than
    index_topk keys)."""
    from fmoe.layers import _index_choice, _mla_q_latent, index_keys, index_scores

    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = {n: t.detach() for n, t in _dsa_params(DSA).items()}
    x = torch.randn(17, H)
    ctx = _ctx(cu, DSA)
    keys, q_lat = index_keys(x, p, DSA, ctx.cos, ctx.sin), _mla_q_latent(x, p, DSA)
    slots = _index_choice(x, q_lat, keys, p, DSA, ctx, ctx.mask)
    assert slots[0].tolist() == [0, -1, -1] and int((slots < 0).sum()) == 2 + 1 + 2 + 2 + 1
    whole = index_scores(x, q_lat, keys, p, DSA, ctx.cos, ctx.sin)
    got = index_scores(x, q_lat, keys, p, DSA, ctx.cos, ctx.sin, slots=slots)
    torch.testing.assert_close(got, torch.where(slots >= 0, whole.gather(1, slots.clamp(min=0)), 0.0), rtol=1e-5, atol=1e-6)
    assert bool((got[slots < 0] == 0).all()) and float(got[slots >= 0].abs().min()) > 0


def test_the_indexer_loss_worked_by_hand():
    """index_loss of two queries: the first keeps keys 0 and 1 of targets 0 and 3 (p = [0, 1]:
    the kept key of target 0 adds 0, not NaN), the second keeps none (it adds 0); the sum over
    the queries divided by T, or by n_queries; the gradient softmax - p over the kept keys."""
    from fmoe.layers import index_loss

    scores = torch.tensor([[1.0, 2.0, 0.0], [4.0, 5.0, 6.0]], requires_grad=True)
    target = torch.tensor([[0.0, 3.0, 1.0], [1.0, 1.0, 1.0]])
    keep = torch.tensor([[True, True, False], [False, False, False]])
    kl = math.log(1 + math.exp(-1))  # -log softmax([1, 2])[1]
    loss = index_loss(scores, target, keep)
    assert float(loss.detach()) == pytest.approx(kl / 2, rel=1e-6)
    assert float(index_loss(scores, target, keep, n_queries=4).detach()) == pytest.approx(kl / 4, rel=1e-6)
    grad, = torch.autograd.grad(loss, scores)
    low = 1 / (1 + math.e)
    torch.testing.assert_close(grad, torch.tensor([[low, -low, 0.0], [0.0, 0.0, 0.0]]) / 2)


def test_attach_loss_passes_x_through_and_gives_the_loss_the_gradient_1():
    """attach_loss(x, loss): x's values in a tensor of its own (not a view of x), x's gradient
    passed through, the loss's gradient 1 as if added to the final loss; a loss other than a
    0-D tensor refused."""
    from fmoe.layers import attach_loss

    x, w = torch.randn(3, 4, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    y = attach_loss(x * 1.0, (w * 3.0).square())
    assert torch.equal(y, x) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    (y * torch.arange(12.0).view(3, 4)).sum().backward()
    assert torch.equal(x.grad, torch.arange(12.0).view(3, 4)) and float(w.grad) == 2 * 9 * 2.0
    for bad, shape in ((torch.ones(1), "torch.Size([1])"), (torch.ones(2, 1), "torch.Size([2, 1])"), (0.5, "None")):
        with pytest.raises(ValueError, match=re.escape(f"loss: expected a 0-D tensor, got {type(bad).__name__} of shape {shape}")):
            attach_loss(x, bad)


def test_the_indexer_loss_is_the_definition_s_and_trains_the_indexer_alone():
    """index_loss: stats["index_loss"] is the per-query definition's KL, its gradient reaches
    the indexer's weights alone (as the definition's), and the output and its gradients are
    those without it."""
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    cfg = dataclasses.replace(DSA, index_loss=True)
    p = _dsa_params(cfg)
    x = torch.randn(17, H, requires_grad=True)
    y, stats = attention(x, p, cfg, _ctx(cu, cfg))
    want, want_loss = _loop_dsa(x, p, cfg, cu, with_loss=True)
    assert sorted(stats.keys()) == ["index_choice", "index_loss"]
    assert float(stats["index_loss"].detach()) == pytest.approx(float(want_loss.detach()), rel=1e-5)
    assert float(want_loss.detach()) > 1e-3
    everything = [x, *p.values()]
    grads = torch.autograd.grad(stats["index_loss"], everything, allow_unused=True)
    want_grads = torch.autograd.grad(want_loss, everything, allow_unused=True)
    for name, a, b in zip(["x", *p], grads, want_grads):
        if name.startswith("index_"):
            assert _rel(a, b) < 1e-5 and float(a.abs().max()) > 0, name
        else:
            assert a is None and b is None, name  # x and the q latent enter detached
    up = torch.randn_like(y)
    plain_y = attention(x, p, DSA, _ctx(cu, DSA))[0]
    assert torch.equal(y, plain_y)
    for a, b in zip(torch.autograd.grad(y, everything, up, allow_unused=True), torch.autograd.grad(plain_y, everything, up, allow_unused=True)):
        assert (a is None and b is None) or torch.equal(a, b)
    with torch.no_grad():  # no gradients, no loss
        assert list(attention(x, p, cfg, _ctx(cu, cfg))[1].keys()) == ["index_choice"]
    import fmoe.layers as L  # the target read for blocks of 4 queries (fmoe.layers._SCORE_ROWS): the same loss

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(L, "_SCORE_ROWS", 4 * cfg.n_heads * 17)
        assert float(attention(x, p, cfg, _ctx(cu, cfg))[1]["index_loss"].detach()) == pytest.approx(float(want_loss.detach()), rel=1e-5)
    # under tensor parallel the target is over every rank's heads (heads_mean: here two ranks of two heads each)
    halves = [dataclasses.replace(cfg, n_heads=2, n_kv_heads=2)] * 2
    parts = {n: [t] * 2 for n, t in p.items()}
    for name in ("wq_b", "wkv_b"):  # per-head columns
        heads = p[name].view(p[name].shape[0], cfg.n_heads, -1)
        parts[name] = [heads[:, :2].flatten(1), heads[:, 2:].flatten(1)]
    parts["wo"] = list(p["wo"].chunk(2, dim=0))
    sums = []

    def heads_mean(t):  # rank 0's call records its heads' sum; rank 1's averages both
        sums.append(t)
        return t if len(sums) == 1 else (sums[0] + sums[1]) / 2

    tp_losses = [attention(x, {n: v[r] for n, v in parts.items()}, halves[r], _ctx(cu, halves[r]), heads_mean=heads_mean)[1]["index_loss"]
                 for r in range(2)]
    assert float(tp_losses[1].detach()) == pytest.approx(float(want_loss.detach()), rel=1e-5)
    assert abs(float(tp_losses[0].detach()) - float(want_loss.detach())) > 1e-4 * float(want_loss.detach())  # half of the heads: not the target


def test_a_layer_without_an_indexer_attends_to_the_keys_another_chose():
    """index_shared (GLM-5's "shared" layers): no indexer weights; given an indexer layer's
    stats["index_choice"], the same function as that layer's attention with its weights."""
    from fmoe.layers import index_shapes

    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    shared = dataclasses.replace(DSA, index_shared=True)
    assert index_shapes(H, shared) == {}
    p = _dsa_params(DSA)
    mla_p = {n: t for n, t in p.items() if not n.startswith("index_")}
    x = torch.randn(17, H, requires_grad=True)
    y, stats = attention(x, p, DSA, _ctx(cu, DSA))
    choice = stats["index_choice"]  # slots: each query's keys, best first, -1 where its document has fewer
    assert choice.dtype == torch.int64 and choice.shape == (17, DSA.index_topk)
    assert (choice >= 0).sum(-1).tolist() == [1, 2, 3, 3, 3, 1, 1, 2, *[3] * 9]  # documents of 5, 1 and 11 tokens
    y_shared, shared_stats = attention(x, mla_p, shared, _ctx(cu, shared), index_choice=choice)
    assert torch.equal(y_shared, y) and len(shared_stats.keys()) == 0
    up = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y_shared, [x, *mla_p.values()], up), torch.autograd.grad(y, [x, *mla_p.values()], up)):
        assert torch.equal(a, b)
    other = torch.where(torch.arange(3) == 0, -1, choice)  # another choice: the best key left out
    assert _rel(attention(x, mla_p, shared, _ctx(cu, shared), index_choice=other)[0], y) > 1e-2
    # a sliding-window layer reusing a full layer's choice: only the chosen keys inside its own window
    local = dataclasses.replace(shared, window=2)
    t = torch.arange(17)[:, None]
    in_window = (choice >= 0) & (t - choice < 2)
    assert int(((choice >= 0) & ~in_window).sum()) > 10  # most of the choice is outside the window
    with torch.no_grad():
        y_local = attention(x, mla_p, local, _ctx(cu, local), index_choice=choice)[0]
        torch.testing.assert_close(y_local, attention(x, mla_p, local, _ctx(cu, local), index_choice=torch.where(in_window, choice, -1))[0],
                                   rtol=0, atol=0)
        assert _rel(y_local, attention(x, mla_p, shared, _ctx(cu, shared), index_choice=choice)[0]) > 1e-2
    with pytest.raises(ValueError, match=r"index_choice: expected the keys an earlier layer chose .* got None with index_shared = True"):
        attention(x, mla_p, shared, _ctx(cu, shared))
    with pytest.raises(ValueError, match=r"index_choice: expected .* got a choice with index_shared = False"):
        attention(x, p, DSA, _ctx(cu, DSA), index_choice=choice)
    with pytest.raises(ValueError, match=r"index_choice: expected a \[17, 3\] int64 tensor of key slots"):
        attention(x, mla_p, shared, _ctx(cu, shared), index_choice=choice[:5])
    with pytest.raises(ValueError, match="index_loss: a layer of index_shared has no indexer of its own to train"):
        dataclasses.replace(shared, index_loss=True)
    assert isinstance(_ctx(cu, DSA).index_choices, dict) and _ctx(cu, MLA).index_choices is None


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_deepseek_sparse_attention_under_context_parallel(impl):
    """cp = 2 in one process: each rank's queries choose among every rank's keys (the
    indexer's keys gathered too) the keys the whole batch's rows choose, equal scores going
    to the earlier token although the gathered keys are in rank order; the ranks' outputs are
    the whole batch's rows, and their indexer losses (each its queries' sum over the whole
    batch's count) and those losses' gradients add up to the whole batch's. With the sparse
    kernel ("triton") the gathered rows are the latents and rotated keys."""
    from fmoe.layers import _mla_latent_qkv, _mla_qkv, index_keys
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu, cp, T = torch.tensor([0, 3, 4, 24], dtype=torch.int32), 2, 24  # the last document crosses every chunk edge
    # one indexer head: about half of its ReLUs are 0, and where its head weight is negative
    # the zero scores are the highest, so equal scores decide many choices of 2 keys
    cfg = dataclasses.replace(DSA, index_heads=1, index_topk=2, index_loss=True, impl=impl)
    p = _dsa_params(cfg)
    x = torch.randn(T, H)
    positions = positions_from_cu_seqlens(cu)
    whole_ctx = _ctx(cu, cfg)
    whole, stats = attention(x, p, cfg, whole_ctx)
    indexer = [n for n in p if n.startswith("index_")]
    want_grads = torch.autograd.grad(stats["index_loss"], [p[n] for n in indexer])
    kv_index = cp_kv_index(T, cp)
    k_all, v_all = (t[kv_index] for t in (_mla_latent_qkv(x, p, cfg, whole_ctx)[1:3] if impl == "triton" else _mla_qkv(x, p, cfg, whole_ctx)[1:]))
    i_all = index_keys(x, p, cfg, whole_ctx.cos, whole_ctx.sin)[kv_index]
    losses, unordered = [], 0
    for rank in range(cp):
        index = cp_token_index(T, cp, rank)
        own = torch.arange(rank * T // cp, (rank + 1) * T // cp)

        def gather_kv(k, v):  # every rank's rows, this rank's own (differentiable) in its place
            if v.shape[-1] == 0:  # the indexer's keys
                return i_all[:, None].index_copy(0, own, k), v.new_zeros(T, 1, 0)
            return k_all.index_copy(0, own, k), v_all.index_copy(0, own, v)

        ctx = attention_context(cu, positions[index], cfg, token_index=index, kv_index=kv_index, gather_kv=gather_kv)
        assert torch.equal(ctx.key_order, torch.argsort(kv_index))
        y, rank_stats = attention(x[index], p, cfg, ctx)
        assert _rel(y, whole[index]) < 1e-5, rank
        rank_choice = rank_stats["index_choice"]  # slots of the gathered rows: their tokens are kv_index's
        assert torch.equal(torch.where(rank_choice >= 0, kv_index[rank_choice.clamp(min=0)], -1), stats["index_choice"][index]), rank
        losses.append(rank_stats["index_loss"])
        with torch.no_grad():  # the gathered keys' own order breaks the ties otherwise
            rank_order = attention(x[index], p, cfg, dataclasses.replace(ctx, key_order=None))[1]["index_choice"]
        unordered += int((rank_order != rank_stats["index_choice"]).any(-1).sum())
    assert unordered > 0
    assert float(sum(losses).detach()) == pytest.approx(float(stats["index_loss"].detach()), rel=1e-5) and float(stats["index_loss"].detach()) > 1e-3
    for name, a, b in zip(indexer, torch.autograd.grad(sum(losses), [p[n] for n in indexer]), want_grads):
        assert _rel(a, b) < 1e-5, name


@pytest.mark.parametrize("sinks", [False, True])
def test_deepseek_sparse_attention_kernel_is_the_reference(sinks):
    """impl="triton" (CUDA's "auto"): the absorbed queries over each one's chosen latents
    (fmoe.ops.sparse_attention), against the dense reference (impl="torch"): the output, the
    choice, the indexer's loss and every gradient (a random upstream gradient on the output,
    the loss's own), for a layer with an indexer and one reusing its choice; with attention
    sinks (HY-V4's) too, the kernel's output scaled by sigmoid(lse - sink) per head."""
    from fmoe.layers import index_shapes

    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = _dsa_params(DSA)
    if sinks:  # large enough to take a visible share of each head's softmax
        p["sinks"] = (torch.randn(DSA.n_heads) + 1.0).requires_grad_()
    x = torch.randn(17, H, requires_grad=True)
    up = torch.randn(17, H)
    mla = [n for n in p if not n.startswith("index_")]
    runs = {}
    for impl in ("torch", "triton"):
        cfg = dataclasses.replace(DSA, index_loss=True, impl=impl)
        y, stats = attention(x, p, cfg, _ctx(cu, cfg))
        shared = dataclasses.replace(DSA, index_shared=True, impl=impl)
        y_shared = attention(x, {n: p[n] for n in mla}, shared, _ctx(cu, shared), index_choice=stats["index_choice"])[0]
        grads = torch.autograd.grad((y * up).sum() + (y_shared * up.flip(0)).sum() + stats["index_loss"], [x, *p.values()])
        runs[impl] = (y, y_shared, stats["index_loss"], *grads)
        assert torch.equal(stats["index_choice"], runs.setdefault("choice", stats["index_choice"]))
    for name, a, b in zip(["y", "y_shared", "index_loss", "x", *p], runs["torch"], runs["triton"]):
        assert _rel(b, a) < 2e-5, name
    assert set(index_shapes(H, DSA)) <= set(p) and float(runs["torch"][2].detach()) > 1e-3


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_deepseek_sparse_attention_over_cached_latents_is_the_same_function(form, impl):
    """The indexer's key travels with the latent through gather_kv (a cache's rows: latent,
    rotated key, indexer key), and the output is the per-query definition's; with the sparse
    kernel ("triton") each query reads its chosen rows of the cache, both forms absorbed."""
    cu = torch.tensor([0, 3, 4, 13, 16], dtype=torch.int32)
    p = {n: t.detach() for n, t in _dsa_params(DSA).items()}
    x = torch.randn(16, H)
    seen = []

    def gather_kv(k, v):
        seen.append((tuple(k.shape), tuple(v.shape)))
        return k, v

    cfg = dataclasses.replace(DSA, impl=impl)
    ctx = dataclasses.replace(_ctx(cu, cfg), gather_kv=gather_kv, latents=form)
    with torch.no_grad():
        y, _ = attention(x, p, cfg, ctx)
        want = _loop_dsa(x, p, DSA, cu)
    assert seen == [((16, 1, DSA.kv_rank + DSA.rot_dim + DSA.index_head_dim), (16, 1, DSA.kv_rank))]
    assert _rel(y, want) < 1e-5


DSA_BAD_KNOBS = [  # (config, change, message)
    (MLA, dict(index_heads=4), "index_heads: a knob of DeepSeek sparse attention's indexer, needs index_topk"),
    (MLA, dict(index_loss=True), "index_loss: a knob of DeepSeek sparse attention's indexer, needs index_topk"),
    (DSA, dict(index_topk=0), "index_topk: expected >= 1, got 0"),
    (DSA, dict(q_rank=None), "index_topk: DeepSeek sparse attention's indexer reads the q latent"),
    (DSA, dict(index_head_dim=2), "index_head_dim: the indexer rotates rot_dim = 4 of its channels"),
    (DSA, dict(impl="flex"), "impl: DeepSeek sparse attention's top-k mask is a dense mask"),
    (DSA, dict(index_interleaved=1), "index_interleaved: expected a bool"),
    (DSA, dict(index_loss=1), "index_loss: expected a bool, got 1"),
]


_CSA = dict(n_kv_heads=1, kv_shared=True, compress_rate=4, compress_topk=2, q_rank=8, index_head_dim=16)
_BLOCKS = dict(index_topk_blocks=2, index_heads=2, index_head_dim=16)
ATTENTION_BAD_KNOBS = [  # (config, change, message): refused as the config is built
    (CFG, dict(local_rot_dim=8), r"^local_rot_dim: the channels the local layers' own RoPE rotates, needs local_rope_base"),
    (CFG, dict(window=4, local_rope_base=100.0, local_rot_dim=7), r"^local_rot_dim: expected an even int in 2..head_dim = 16, or None, got 7"),
    (CFG, dict(window=4, local_rope_base=100.0, local_head_dim=8, local_rot_dim=12),
     r"^local_rot_dim: expected an even int in 2..head_dim = 8, or None, got 12"),
    (CFG, dict(gate_per_head=1), r"^gate_per_head: expected a bool, got 1"),
    (CFG, dict(fp8=1), r"^fp8: expected a bool \(True: the projections' GEMMs in fp8, fmoe.ops.fp8_matmul\), got 1"),
    (CFG, dict(llama3_factor=8.0, yarn_factor=4.0), r"^llama3_factor: one RoPE scaling at a time, not with yarn_factor"),
    (CFG, dict(llama3_factor=0.0), r"^llama3_factor: expected a finite number > 0, got 0.0"),
    (CFG, dict(llama3_factor=8.0, llama3_original_max_positions=0), r"^llama3_original_max_positions: expected >= 1, got 0"),
    (CFG, dict(longrope_short_factors=(1.0,) * 8, longrope_short_scale=math.inf), r"^longrope_short_scale: expected a finite number > 0, got inf"),
    (MLA, dict(out_norm=True), r"^out_norm: each grouped-query attention head's output normed \(a bool; True needs kv_rank None\), got True"),
    (CFG, dict(v_norm=True, v_dim=8), r"^v_norm: a knob of grouped-query attention's values \(a bool; True needs kv_rank and v_dim None\), got True"),
    (CFG, dict(k_eq_v=True, v_dim=8), r"^k_eq_v: a knob of grouped-query attention's values"),
    (CFG, dict(score_softcap=0.0), r"^score_softcap: expected None or a positive finite number, without index_topk \(the sparse kernel has no cap\), got 0.0"),
    (CFG, dict(score_softcap=math.inf), r"^score_softcap: expected None or a positive finite number, .*got inf"),
    (DSA, dict(score_softcap=30.0), r"^score_softcap: expected None or a positive finite number, without index_topk"),
    (CFG, dict(rope_proportion=0.5, rot_dim=8), r"^rope_proportion: proportional RoPE over every channel of each head, not with yarn_factor, "
                                               r"llama3_factor, longrope_short_factors or a rot_dim"),
    (CFG, dict(linear_factor=math.inf), r"^linear_factor: expected None or a positive finite number \(positions read as p / factor\), got inf"),
    (CFG, dict(linear_factor=2.0, longrope_short_factors=(1.0,) * 8),
     r"^linear_factor: one RoPE scaling at a time, not with yarn_factor, llama3_factor or longrope_short_factors"),
    (CFG, dict(scale=math.inf), r"^scale: expected None or a positive finite number, got inf"),
    (CFG, dict(yarn_factor=4.0, yarn_beta_fast=0.5, yarn_beta_slow=1.0), r"^yarn_beta_fast: expected at least beta_slow = 1, got 0.5"),
    (CFG, dict(yarn_factor=4.0, yarn_original_max_positions=0), r"^yarn_original_max_positions: expected >= 1, got 0"),
    (CFG, dict(yarn_factor=4.0, yarn_mscale_all_dim=math.nan), r"^yarn_mscale_all_dim: expected a finite number, got nan"),
    (CFG, dict(rope=False, yarn_factor=-1.0), r"^yarn_factor: expected a finite number > 0, got -1.0"),  # no RoPE: YaRN still scales the softmax
    (CFG, dict(qk_norm="layer", zero_centered_norms=True), r"^zero_centered_norms: a gain of 1 \+ weight in RMSNorms, not in the LayerNorms of qk_norm 'layer'"),
    (CFG, dict(qk_norm="head", qk_norm_bias=True),
     r"^qk_norm_bias: the q/k LayerNorms' biases \(a bool; True needs qk_norm 'head_layer' or 'layer'\), got True with qk_norm 'head'"),
    (MLA, dict(latent_scales=(1.0, 2.0, 3.0)), r"^latent_scales: expected None or two finite numbers > 0 \(the queries', the kv latent's\), got \(1.0, 2.0, 3.0\)"),
    (MLA, dict(q_rank=None, latent_scales=(1.0, 2.0)), r"^latent_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank"),
    (MLA, dict(rot_dim=12), r"^rot_dim: multi-latent attention rotates a part of each head, expected rot_dim < head_dim = 12, got 12"),
    (CFG, dict(index_local_blocks=2), r"^index_local_blocks: a knob of block-sparse attention, needs index_topk_blocks"),
    (MLA, dict(index_shared=True), r"^index_shared: a knob of DeepSeek sparse attention's indexer, needs index_topk"),
    (DSA, dict(index_shared=True, index_loss=True), r"^index_loss: a layer of index_shared has no indexer of its own to train"),
    (DSA, dict(index_norm_eps=math.inf), r"^index_norm_eps: expected a positive finite number, got inf"),
    (CFG, dict(n_heads=4, moa_experts=3, moa_topk=2, qk_norm="head_layer"), r"^qk_norm: not with a mixture of attention heads \(moa_experts\)"),
    (CFG, dict(rope_last=True, rot_dim=8, **_BLOCKS), r"^rope_last: RoPE on the last rot_dim channels of grouped-query attention's heads, .* or index_topk_blocks"),
    (CFG, dict(score_softcap=30.0, **_BLOCKS), r"^score_softcap: not with block-sparse attention \(index_topk_blocks\)"),
    (MLA, dict(index_topk_blocks=2, index_heads=4, index_head_dim=12), r"^index_topk_blocks: block-sparse attention chooses blocks per kv head .*not with kv_rank"),
    (CFG, dict(compress_rate=4, kv_shared=True), r"^compress_rate: heavily compressed attention's entries are one shared key-value head's, .*got kv_shared=True, n_kv_heads=2"),
    (CFG, dict(_CSA, index_shared=True), r"^index_shared: a knob of DeepSeek sparse attention's indexer, needs index_topk \(compressed sparse attention's indexer"),
]


@pytest.mark.parametrize("cfg, change, message", ATTENTION_BAD_KNOBS + DSA_BAD_KNOBS)
def test_attention_config_knobs_are_checked(cfg, change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cfg, **change)


def test_attention_config_takes_its_knobs_bounds():
    """The largest or widest value each check allows is taken (the bounds are inclusive where the docstring says so)."""
    assert dataclasses.replace(CFG, rope_proportion=1.0).rope_proportion == 1.0
    assert dataclasses.replace(CFG, window=4, local_rope_base=100.0, local_head_dim=32, local_rot_dim=32).local_rot_dim == 32
    assert dataclasses.replace(CFG, qk_norm="head_k", qk_norm_after_rope=True).qk_norm_after_rope is True
    assert dataclasses.replace(DSA, index_head_dim=4).index_head_dim == 4  # index_head_dim = rot_dim
    blocks = dataclasses.replace(CFG, index_local_blocks=2, **_BLOCKS)  # every chosen block a local one; index_head_dim = head_dim
    assert (blocks.index_local_blocks, blocks.index_head_dim) == (2, 16)
    assert dataclasses.replace(CFG, **dict(_CSA, rope=False, index_head_dim=8)).index_head_dim == 8  # no RoPE: no rot_dim bound on the indexer


def test_attention_config_defaults():
    """The knobs' defaults are the reference models' (transformers' YaRN and Llama 3.1 defaults, Llama 4's temperature tuning)."""
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16)
    assert (cfg.rope_base, cfg.norm_eps, cfg.latent_norm_eps, cfg.impl, cfg.gate_act) == (10000.0, 1e-6, 1e-6, "auto", "sigmoid")
    assert (cfg.yarn_original_max_positions, cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_mscale, cfg.yarn_mscale_all_dim, cfg.yarn_truncate) \
        == (4096, 32.0, 1.0, 1.0, 1.0, True)
    assert (cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor, cfg.llama3_original_max_positions) == (1.0, 4.0, 8192)
    assert (cfg.temperature_scale, cfg.temperature_offset, cfg.temperature_kind) == (0.1, 1, "log")
    assert cfg.has_wv and not dataclasses.replace(cfg, k_eq_v=True).has_wv and not dataclasses.replace(cfg, n_kv_heads=1, kv_shared=True).has_wv


def test_deepseek_sparse_attention_bad_inputs():
    from fmoe.layers import index_loss

    cu = torch.tensor([0, 6], dtype=torch.int32)
    x, p = torch.randn(6, H), {n: t.detach() for n, t in _dsa_params(DSA).items()}
    with pytest.raises(ValueError, match=r"params\['index_w'\]: expected a float \[32, 8\] tensor \(the indexer of cfg.index_topk\), got nothing"):
        attention(x, {n: t for n, t in p.items() if n != "index_w"}, DSA, _ctx(cu, DSA))
    with pytest.raises(ValueError, match=r"params: unknown multi-latent attention parameters \['index_w'\]"):
        attention(x, {n: t for n, t in p.items() if n.startswith(("w", "q_a", "kv_a"))} | {"index_w": p["index_w"]}, MLA, _ctx(cu, MLA))
    with pytest.raises(ValueError, match="n_queries: expected a positive int"):
        index_loss(torch.zeros(6, 3), torch.ones(6, 3), torch.ones(6, 3, dtype=torch.bool), n_queries=0)
    with pytest.raises(ValueError, match=r"keep: expected bool \[T, J\] like scores \[6, 3\]"):
        index_loss(torch.zeros(6, 3), torch.ones(6, 3), torch.ones(6, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"keep: expected bool \[T, J\] like scores \[6, 3\] and target \[6, 3\], got torch.float32 \[6, 3\]"):
        index_loss(torch.zeros(6, 3), torch.ones(6, 3), torch.ones(6, 3))
    flex = dataclasses.replace(MLA, impl="flex")  # a context built for another layer: FlexAttention's block mask
    with pytest.raises(ValueError, match="ctx: DeepSeek sparse attention .* needs the dense mask"):
        attention(x, p, DSA, _ctx(cu, flex))
    # the context of a DSA config holds the dense mask, whatever impl "auto" picks for the others
    assert isinstance(_ctx(cu, DSA).mask, torch.Tensor)


@pytest.mark.gpu
def test_gpu_multi_latent_flex_attention_matches_reference():
    """FlexAttention (compiled, v_dim != q/k dim) against the SDPA path, forward and backward, bf16."""
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32, device="cuda")
    x = torch.randn(300, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = _mla_params(MLA, torch.bfloat16, "cuda")
    outs = []
    for impl in ("torch", "flex"):
        cfg = dataclasses.replace(MLA, impl=impl)
        xi = x.detach().clone().requires_grad_()
        pi = {n: t.detach().clone().requires_grad_() for n, t in p.items()}
        y, _ = attention(xi, pi, cfg, _ctx(cu, cfg))
        y.float().square().sum().backward()
        outs.append((y, xi.grad, pi["wkv_b"].grad))
    for a, b in zip(*outs):
        assert _rel(a, b) < 2e-2


@pytest.mark.gpu
def test_gpu_deepseek_sparse_attention_kernel_matches_reference():
    """DSA on CUDA: impl="auto" (the sparse kernels over the absorbed form) against the dense
    reference (impl="torch"), bf16, 64 keys per query in documents of up to 200 tokens: the
    same choice, the output, the indexer loss and the gradients."""
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32, device="cuda")
    cfg = dataclasses.replace(DSA, index_topk=64, index_loss=True)
    x = torch.randn(300, H, device="cuda", dtype=torch.bfloat16)
    p = {n: t.detach().to("cuda", torch.bfloat16) for n, t in _dsa_params(cfg).items()}
    outs = []
    for impl in ("torch", "auto"):
        c = dataclasses.replace(cfg, impl=impl)
        xi = x.clone().requires_grad_()
        pi = {n: t.clone().requires_grad_() for n, t in p.items()}
        y, stats = attention(xi, pi, c, _ctx(cu, c))
        (y.float().square().sum() + stats["index_loss"]).backward()
        outs.append((stats["index_choice"], y, stats["index_loss"], xi.grad, pi["wkv_b"].grad, pi["index_wq"].grad))
    assert torch.equal(outs[0][0], outs[1][0])
    for name, a, b in zip(("y", "index_loss", "x", "wkv_b", "index_wq"), outs[0][1:], outs[1][1:]):
        assert _rel(b, a) < 2e-2, name


def test_proj_qk_norm_averages_q_and_k_statistics_in_one_call():
    """qk_norm="proj" (OLMoE) normalises q and k over their whole projections; under tensor
    parallelism heads_mean averages the statistics over the ranks: q's and k's mean squares
    go in one call ([T, 2]: one all-reduce per layer), and a mean that changes nothing gives
    the output of one process holding every head."""
    cfg = dataclasses.replace(CFG, qk_norm="proj")
    torch.manual_seed(0)
    p = _params(cfg)
    p.update(q_norm=1 + 0.3 * torch.randn(cfg.n_heads * cfg.head_dim), k_norm=1 + 0.3 * torch.randn(cfg.n_kv_heads * cfg.head_dim))
    x, cu = torch.randn(7, H), torch.tensor([0, 3, 7])
    calls = []
    y = attention(x, p, cfg, _ctx(cu, cfg), heads_mean=lambda ms: calls.append(ms.shape) or ms)[0]
    assert calls == [torch.Size([7, 2])]
    torch.testing.assert_close(y, attention(x, p, cfg, _ctx(cu, cfg))[0], rtol=0, atol=0)
    # the statistics are q's and k's own: doubling k's mean square changes the output
    other = attention(x, p, cfg, _ctx(cu, cfg), heads_mean=lambda ms: ms * torch.tensor([1.0, 2.0]))[0]
    assert (other - y).abs().max() > 1e-3


LONGROPE = dataclasses.replace(CFG, rot_dim=8, longrope_short_factors=(1.0, 1.5, 2.0, 3.0), longrope_long_factors=(2.0, 4.0, 8.0, 16.0),
                               longrope_original_max_positions=6, longrope_short_scale=1.1, longrope_long_scale=1.3)


class _LinearCP:
    """Stands in for fmoe.parallel.ContextParallel: only its presence matters to the tables."""
    token_index = conv_halo = gated_delta_rule = staticmethod(lambda *a, **k: None)


def test_longrope_switches_per_document_and_reads_the_global_document_under_context_parallel():
    """Each document of more than longrope_original_max_positions (6) positions gets the long
    factors and scale, the others the short ones, written out; a context-parallel rank holding
    only the first 4 tokens of a long document still gives them the long ones (the global
    cu_seqlens' span), where its positions alone would say short; decoding reads each
    sequence's largest position."""
    cu = torch.tensor([0, 5, 14, 20], dtype=torch.int32)  # documents of 5, 9 and 6 positions: short, long, short
    positions = positions_from_cu_seqlens(cu)
    ctx = attention_context(cu, positions, LONGROPE)
    base = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    for a, b, kind in ((0, 5, "short"), (5, 14, "long"), (14, 20, "short")):
        factors, scale = torch.tensor(getattr(LONGROPE, f"longrope_{kind}_factors"), dtype=torch.float64), getattr(LONGROPE, f"longrope_{kind}_scale")
        angles = torch.arange(b - a, dtype=torch.float64)[:, None] * (base / factors)[None, :]
        torch.testing.assert_close(ctx.cos[a:b], (angles.cos() * scale).float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ctx.sin[a:b], (angles.sin() * scale).float(), rtol=1e-6, atol=1e-6)
    # one document alone: its own length decides, as a model run on it alone
    torch.testing.assert_close(attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), LONGROPE).cos, ctx.cos[5:14])
    # a context-parallel rank's tokens (the first 4 of the long document and the last 3 of the third)
    rows = torch.tensor([5, 6, 7, 8, 17, 18, 19])
    split = attention_context(cu, positions[rows], LONGROPE, token_index=rows, kv_index=torch.arange(20), gather_kv=lambda k, v: (k, v),
                              linear_cp=_LinearCP())
    torch.testing.assert_close(split.cos, ctx.cos[rows])
    torch.testing.assert_close(split.sin, ctx.sin[rows])
    alone = rope_tables(positions[rows[:4]], LONGROPE)[0]  # those 4 positions alone: 4 <= 6, the short factors
    assert (alone - ctx.cos[rows[:4]]).abs().max() > 0.1
    # decoding: a cache of 2 sequences of 16 rows, the new tokens at positions 3 (row 3) and 8 (row 24): short, long
    decode = attention_context(torch.tensor([0, 16, 32], dtype=torch.int32), torch.tensor([3, 8]), LONGROPE, token_index=torch.tensor([3, 24]),
                               kv_index=torch.arange(32), gather_kv=lambda k, v: (k, v))
    torch.testing.assert_close(decode.cos, torch.stack([rope_tables(torch.arange(4), LONGROPE)[0][3], rope_tables(torch.arange(9), LONGROPE)[0][8]]))
    # without long factors (nor a long scale of its own), the short ones everywhere
    short = dataclasses.replace(LONGROPE, longrope_long_factors=None, longrope_long_scale=1.1)
    torch.testing.assert_close(attention_context(cu, positions, short).cos[5:14], rope_tables(torch.arange(9), short)[0])
    assert (rope_tables(torch.arange(9), short)[0] - ctx.cos[5:14]).abs().max() > 0.1


def test_longrope_long_scale_without_long_factors_scales_the_long_documents():
    """No long factors but a long scale of its own: a sequence longer than
    longrope_original_max_positions gets the short factors and the long scale."""
    cfg = dataclasses.replace(LONGROPE, longrope_long_factors=None)
    t, base = _plain_angles(torch.arange(9), 8)
    angles = t * (base / torch.tensor(cfg.longrope_short_factors, dtype=torch.float64))[None, :]
    for T, scale in ((9, 1.3), (6, 1.1)):
        cos, sin = rope_tables(torch.arange(T), cfg)
        torch.testing.assert_close(cos, (angles[:T].cos() * scale).float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, (angles[:T].sin() * scale).float(), rtol=1e-6, atol=1e-6)


def test_longrope_knobs_are_checked():
    for knobs, match in ((dict(longrope_long_scale=2.0), "longrope_long_scale: a knob of LongRoPE, needs longrope_short_factors"),
                         (dict(longrope_short_factors=(1.0,) * 3, rot_dim=8), r"longrope_short_factors: expected 4 numbers"),
                         (dict(longrope_short_factors=(1.0,) * 8, longrope_long_factors=(1.0,) * 7), r"longrope_long_factors: expected 8 numbers"),
                         (dict(longrope_short_factors=(1.0,) * 8, longrope_long_factors=(-1.0,) * 8), r"longrope_long_factors\[0\]: expected a finite"),
                         (dict(longrope_short_factors="12345678"), "longrope_short_factors: expected a tuple of numbers, got str"),
                         (dict(longrope_short_factors=(1.0,) * 8, longrope_short_scale=0.0), "longrope_short_scale: expected a finite number > 0"),
                         (dict(longrope_short_factors=(1.0,) * 8, longrope_original_max_positions=0), "longrope_original_max_positions: expected >= 1"),
                         (dict(longrope_short_factors=(1.0,) * 8, yarn_factor=2.0), "longrope_short_factors: one RoPE scaling at a time, not with yarn"),
                         (dict(longrope_short_factors=(1.0,) * 8, llama3_factor=2.0), "one RoPE scaling at a time"),
                         (dict(longrope_short_factors=(1.0,) * 8, rope_base=1.0), "rope_base: expected a finite number > 1")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(CFG, **knobs)
    # a config read back from JSON holds lists: kept as tuples (the config is hashed)
    assert dataclasses.replace(CFG, longrope_short_factors=[1.0] * 8).longrope_short_factors == (1.0,) * 8


# MiniMax-M3's block-sparse attention: an indexer head per kv head, RoPE on the first 8 of its 12 channels (and of the heads')
BLOCKS = dataclasses.replace(CFG, rot_dim=8, index_topk_blocks=2, index_block_size=3, index_heads=2, index_head_dim=12)


def _block_params(cfg, zero_centered=False):
    """_params and the indexer's weights (not trained: no gradient wanted), its norms about 1
    (about 0 for gains 1 + weight)."""
    g = torch.Generator().manual_seed(11)
    p = _params(cfg)
    Ni, Di = cfg.index_heads, cfg.index_head_dim
    p["index_wq"] = torch.randn(H, Ni * Di, generator=g) * H ** -0.5
    p["index_wk"] = torch.randn(H, Di, generator=g) * H ** -0.5
    for name in ("index_q_norm", "index_k_norm"):
        p[name] = (0.0 if zero_centered else 1.0) + 0.3 * torch.randn(Di, generator=g)
    return p


def _without_blocks(cfg):
    return dataclasses.replace(cfg, index_topk_blocks=None, index_block_size=128, index_local_blocks=1, index_heads=64, index_head_dim=128)


def _loop_indexer(x, p, cfg, cu):
    """The indexer's queries [T, G, Di] and keys [T, Di] written out (RMS norms of gain w, or
    1 + w with zero_centered_norms; RoPE as the heads', on interleaved pairs with interleaved), and the RoPE tables (cos, sin)."""
    T, G, Di = x.shape[0], cfg.n_kv_heads, cfg.index_head_dim
    cos, sin = rope_tables(positions_from_cu_seqlens(cu), cfg)
    zc = 1.0 if cfg.zero_centered_norms else 0.0

    def rms(t, w):
        return t / (t.square().mean(-1, keepdim=True) + cfg.norm_eps).sqrt() * (w + zc)

    iq = apply_rope(rms((x @ p["index_wq"]).view(T, G, Di), p["index_q_norm"]), cos, sin, interleaved=cfg.interleaved, impl="torch")
    ik = apply_rope(rms((x @ p["index_wk"])[:, None], p["index_k_norm"]), cos, sin, interleaved=cfg.interleaved, impl="torch")[:, 0]
    return iq, ik, cos, sin


def _loop_choice(iq, ik, t, a, g, cfg):
    """Query t's (of the document starting at a) blocks for indexer head g: (each block's best
    q . k over its keys up to t [own + 1], differentiable; the chosen blocks: the
    index_local_blocks ending at its own first, then the best, the earlier on a tie)."""
    bs = cfg.index_block_size
    own = (t - a) // bs
    best = torch.stack([torch.stack([iq[t, g] @ ik[s] for s in range(a + blk * bs, min(a + (blk + 1) * bs, t + 1))]).max()
                        for blk in range(own + 1)])
    rank = best.detach().tolist()
    for back in range(cfg.index_local_blocks):
        rank[max(own - back, 0)] = math.inf
    return best, sorted(range(own + 1), key=lambda blk: (-rank[blk], blk))[:cfg.index_topk_blocks]


def _loop_block_attention(x, p, cfg, cu):
    """Block-sparse attention query by query, kv head by kv head, each document on its own:
    the indexer's query of head g against every earlier key of the document, the best score of
    each block of index_block_size positions, the index_local_blocks blocks ending at the
    query's own first, then the best (the earlier block on a tie), index_topk_blocks in all;
    the heads of g attend to those blocks' earlier keys alone."""
    T, (N, G, D), bs = x.shape[0], (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), cfg.index_block_size
    with torch.no_grad():
        iq, ik, cos, sin = _loop_indexer(x, p, cfg, cu)
    q, k, v = (apply_rope((x @ p[w]).view(T, n, D), cos, sin, interleaved=cfg.interleaved, impl="torch") if w != "wv" else (x @ p[w]).view(T, n, D)
               for w, n in (("wq", N), ("wk", G), ("wv", G)))
    rows = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            heads = []
            for g in range(G):
                with torch.no_grad():
                    _, chosen = _loop_choice(iq, ik, t, a, g, cfg)
                keys = torch.tensor([s for s in range(a, t + 1) if (s - a) // bs in chosen])
                for h in range(g * (N // G), (g + 1) * (N // G)):
                    weights = torch.softmax((k[keys, g] @ q[t, h]) * softmax_scale(cfg), dim=0)
                    heads.append(weights @ v[keys, g])
            rows.append(torch.cat(heads))
    return torch.stack(rows) @ p["wo"]


@pytest.mark.parametrize("knobs", [{}, dict(index_local_blocks=0), dict(index_topk_blocks=3, index_block_size=2, index_local_blocks=2),
                                   dict(index_topk_blocks=1, index_block_size=4), dict(zero_centered_norms=True), dict(interleaved=True)],
                         ids=["m3", "no-local", "three-of-pairs", "one-block", "zero-centred", "interleaved"])
def test_block_sparse_attention_matches_per_token_loop(knobs):
    """MiniMax-M3's block-sparse attention: the output and every trained gradient match the
    query-by-query definition (3 documents, the longest of 11 tokens: several blocks, a few
    chosen); the indexer's weights get no gradient; the blocks matter (all of them chosen is
    plain attention, which differs)."""
    cfg = dataclasses.replace(BLOCKS, **knobs)
    p = _block_params(cfg, zero_centered=cfg.zero_centered_norms)
    _check_against_definition(cfg, "torch", p, _loop_block_attention)
    x, cu = torch.randn(17, H), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    trained = dict(p, index_wq=p["index_wq"].clone().requires_grad_())
    attention(x, trained, cfg, _ctx(cu, cfg))[0].sum().backward()
    assert trained["index_wq"].grad is None and trained["wq"].grad is not None
    with torch.no_grad():
        y = attention(x, p, cfg, _ctx(cu, cfg))[0]
        plain = {n: t for n, t in p.items() if not n.startswith("index_")}
        dense = _without_blocks(cfg)
        full = attention(x, plain, dense, _ctx(cu, dense))[0]
        every = dataclasses.replace(cfg, index_topk_blocks=11)
        assert _rel(y, full) > 1e-2 and _rel(attention(x, p, every, _ctx(cu, every))[0], full) < 1e-6


@pytest.mark.parametrize("knobs", [dict(index_loss=True), dict(index_local_blocks=0, index_topk_blocks=1, index_block_size=4),
                                   dict(index_topk_blocks=3, index_block_size=2, index_local_blocks=2, index_loss=True)],
                         ids=["m3-loss", "one-block", "three-of-pairs-loss"])
def test_block_sparse_attention_on_the_sparse_kernel_matches_the_reference(knobs):
    """Where Triton runs (the interpreter here) each query's heads attend to the keys of their
    chosen blocks alone, through fmoe.ops.sparse_attention kv head by kv head over rows
    [v | k] named by block_index_slots, the context's mask kept as its rule (MaskRows): the
    output, the indexer's loss and every gradient (the weights', the tokens', the indexer's)
    equal the dense reference's."""
    cfg = dataclasses.replace(BLOCKS, **knobs)
    p = {n: t.detach().requires_grad_() for n, t in _block_params(cfg).items()}
    x, cu = torch.randn(17, H, requires_grad=True), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    upstream, out = torch.randn(17, H), {}
    for impl in ("torch", "triton"):
        c = dataclasses.replace(cfg, impl=impl)
        ctx = _ctx(cu, c)
        assert isinstance(ctx.mask, MaskRows) == (impl == "triton")
        y, stats = attention(x, p, c, ctx)
        loss = stats["index_loss"] if cfg.index_loss else 0.0
        out[impl] = (y, *torch.autograd.grad((y * upstream).sum() + loss, [x, *p.values()], allow_unused=True))
    for name, a, b in zip(["y", "x", *p], out["triton"], out["torch"]):
        if name.startswith("index_") and not cfg.index_loss:  # nothing differentiates the indexer without its loss
            assert a is None and b is None, name
        else:
            assert _rel(a, b) < 1e-5, name


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("cp", [2, 4])
def test_block_sparse_attention_under_context_parallel_counts_blocks_per_document(cp, impl):
    """Under context parallel a rank's queries choose among every rank's keys: the indexer's
    keys travel beside the kv heads' through gather_kv, each key's block is counted from its
    document's start (cu_seqlens and kv_index), and each rank's rows are the whole batch's;
    on the sparse kernel too (the chosen blocks' keys found among the gathered rows by the
    context's key_order)."""
    from fmoe.parallel import cp_kv_index, cp_token_index

    cu = torch.tensor([0, 3, 4, 13, 21, 24], dtype=torch.int32)
    cfg = dataclasses.replace(BLOCKS, index_block_size=2, impl=impl)
    p = _block_params(cfg)
    x, T = torch.randn(24, H), 24
    positions, kv_index = positions_from_cu_seqlens(cu), cp_kv_index(T, cp)
    ranks = [cp_token_index(T, cp, rank) for rank in range(cp)]
    sent = []  # each rank's keys (with the indexer's channels) and values, as it hands them to gather_kv

    def context(rank, gather_kv):
        return attention_context(cu, positions[ranks[rank]], cfg, token_index=ranks[rank], kv_index=kv_index, gather_kv=gather_kv)

    with torch.no_grad():
        whole, _ = attention(x, p, cfg, _ctx(cu, cfg))
        for rank in range(cp):  # what each rank sends: its keys alone (the output of this pass unused)
            attention(x[ranks[rank]], p, cfg, context(rank, lambda k, v: sent.append((k, v)) or (k.new_zeros(T, *k.shape[1:]), v.new_zeros(T, *v.shape[1:]))))
        k_all, v_all = (torch.cat([s[j] for s in sent]) for j in (0, 1))
        assert k_all.shape == (T, cfg.n_kv_heads, cfg.head_dim + cfg.index_head_dim // cfg.n_kv_heads)  # 6 channels of the indexer's 12 per head
        for rank in range(cp):
            y, _ = attention(x[ranks[rank]], p, cfg, context(rank, lambda k, v: (k_all, v_all)))
            assert _rel(y, whole[ranks[rank]]) < 1e-5, rank
    # the indexer's loss: each rank's queries' share of the micro-batch's, the shares adding up to one process's
    trained, lossy = {n: t.requires_grad_(n == "index_wq") for n, t in p.items()}, dataclasses.replace(cfg, index_loss=True)
    shares = [attention(x[ranks[rank]], trained, lossy, context(rank, lambda k, v: (k_all, v_all)))[1]["index_loss"] for rank in range(cp)]
    whole_loss = attention(x, trained, lossy, _ctx(cu, lossy))[1]["index_loss"]
    assert abs(float(sum(shares).detach()) - float(whole_loss.detach())) < 1e-5 * float(whole_loss.detach())


def test_block_sparse_attention_bad_knobs_and_inputs():
    """Each misuse names its field: knobs without index_topk_blocks, an indexer head count
    other than the kv heads', more always-kept blocks than chosen ones, what block-sparse
    attention does not combine with; missing or misshapen indexer weights, sinks, ALiBi's slopes."""
    cases = [(dict(CFG.__dict__, index_block_size=64), r"index_block_size: a knob of block-sparse attention, needs index_topk_blocks"),
             (dict(BLOCKS.__dict__, index_heads=4), r"index_heads: block-sparse attention's indexer has one head per kv head, expected n_kv_heads = 2"),
             (dict(BLOCKS.__dict__, index_local_blocks=3), r"index_local_blocks: expected an int in \[0, index_topk_blocks = 2\]"),
             (dict(BLOCKS.__dict__, index_topk_blocks=0), r"index_topk_blocks: expected >= 1, got 0"),
             (dict(BLOCKS.__dict__, index_head_dim=6), r"index_head_dim: the indexer rotates rot_dim = 8 of its channels, expected index_head_dim >= 8"),
             (dict(BLOCKS.__dict__, window=4), r"window: not with block-sparse attention"),
             (dict(BLOCKS.__dict__, impl="flex"), r"impl: block-sparse attention's choice is a dense mask"),
             (dict(BLOCKS.__dict__, index_topk=4), r"index_topk_blocks: block-sparse attention, not with DeepSeek sparse attention"),
             (dict(BLOCKS.__dict__, index_shared=True), r"index_shared: a knob of DeepSeek sparse attention's indexer, not of block-sparse attention"),
             (dict(BLOCKS.__dict__, rope=False), r"rope: block-sparse attention's indexer rotates its queries and keys")]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            AttentionConfig(**fields)
    p, cu, x = _block_params(BLOCKS), torch.tensor([0, 6]), torch.randn(6, H)
    with pytest.raises(ValueError, match=r"params\['index_wk'\]: expected torch.float32 \[32, 12\] \(the indexer of cfg.index_topk_blocks\), got nothing"):
        attention(x, {n: t for n, t in p.items() if n != "index_wk"}, BLOCKS, _ctx(cu, BLOCKS))
    with pytest.raises(ValueError, match=r"params\['index_wq'\]: expected torch.float32 \[32, 24\] .*got torch.float32 \[32, 12\]"):
        attention(x, dict(p, index_wq=p["index_wk"]), BLOCKS, _ctx(cu, BLOCKS))
    with pytest.raises(ValueError, match=r"params: unknown attention parameters \['index_wq'\]"):
        attention(x, {"index_wq": p["index_wq"], **_params(CFG)}, CFG, _ctx(cu, CFG))
    with pytest.raises(ValueError, match=r"params\['sinks'\]: not with block-sparse attention"):
        attention(x, dict(p, sinks=torch.zeros(4)), BLOCKS, _ctx(cu, BLOCKS))
    with pytest.raises(ValueError, match=r"params\['alibi'\]: not with block-sparse attention"):
        attention(x, dict(p, alibi=torch.ones(4)), BLOCKS, _ctx(cu, BLOCKS))
    with pytest.raises(ValueError, match=r"ctx: block-sparse attention \(cfg.index_topk_blocks\) needs the dense mask"):
        attention(x, p, BLOCKS, _ctx(cu, dataclasses.replace(CFG, rot_dim=8, impl="flex")))


@pytest.mark.gpu
def test_gpu_block_sparse_attention_matches_the_cpu_layer():
    """Block-sparse attention on CUDA (MiniMax-M3's heads, 4 kv heads, blocks of 128, 4 of them
    chosen, over 4096 tokens in 3 documents; float32, so the choice is the same) gives the CPU
    layer's output and gradients, both ways: the dense reference under a [kv heads, 1, T, S]
    mask through CUDA's SDPA, and the compiled sparse kernel over each query's chosen blocks."""
    cfg = AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128, rot_dim=64, index_topk_blocks=4, index_block_size=128, index_heads=4,
                          index_head_dim=128, impl="torch")
    Hg, g = 512, torch.Generator().manual_seed(3)
    shapes = {"wq": (Hg, 16 * 128), "wk": (Hg, 4 * 128), "wv": (Hg, 4 * 128), "wo": (16 * 128, Hg), "index_wq": (Hg, 4 * 128), "index_wk": (Hg, 128)}
    p = {n: torch.randn(*s, generator=g) * s[0] ** -0.5 for n, s in shapes.items()}
    p.update(index_q_norm=torch.ones(128), index_k_norm=torch.ones(128))
    x, cu = torch.randn(4096, Hg, generator=g), torch.tensor([0, 1000, 1001, 4096], dtype=torch.int32)
    upstream = torch.randn(4096, Hg, generator=g)
    outs = []
    for device, impl in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        q = {n: t.to(device).requires_grad_(not n.startswith("index_")) for n, t in p.items()}
        c = dataclasses.replace(cfg, impl=impl)
        y, _ = attention(x.to(device), q, c, _ctx(cu.to(device), c))
        grads = torch.autograd.grad(y, [t for t in q.values() if t.requires_grad], upstream.to(device))
        outs.append([y.cpu(), *(t.cpu() for t in grads)])
    for cuda in outs[1:]:
        for a, b in zip(outs[0], cuda):
            assert _rel(b, a) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_gpu_deepseek_v4_layers_on_the_sparse_kernel_match_the_cpu_layer(kind):
    """DeepSeek-V4's layers on CUDA (16 heads of 512 sharing one kv head that is its values, RoPE on 64 channels, sinks, a
    window of 128; CSA: runs of 4, each query's best 64 entries by an indexer of 8 heads of 64, its loss on; HCA: runs of 16)
    over 1024 tokens in 2 documents, in float32 (the same choice): the compiled sparse kernel (impl "auto") gives the CPU
    reference's output, indexer loss and gradients."""
    from fmoe.layers import compress_shapes, gqa_q_shapes, out_shapes

    knobs = dict(csa=dict(compress_rate=4, compress_topk=64, index_heads=8, index_head_dim=64, index_loss=True), hca=dict(compress_rate=16))
    cfg = AttentionConfig(n_heads=16, n_kv_heads=1, head_dim=512, rot_dim=64, rope_last=True, q_rank=256, qk_norm="head_k", kv_shared=True,
                          window=128, impl="torch", **knobs.get(kind, {}))
    Hg, g = 512, torch.Generator().manual_seed(5)
    shapes = {**gqa_q_shapes(Hg, cfg), "wk": (Hg, 512), **out_shapes(Hg, cfg), **compress_shapes(Hg, cfg)}
    p = {n: torch.randn(*s, generator=g) * s[0] ** -0.5 for n, s in shapes.items()}
    p.update(q_a_norm=torch.ones(256), k_norm=torch.ones(512), sinks=torch.randn(16, generator=g))
    x, cu = torch.randn(1024, Hg, generator=g), torch.tensor([0, 700, 1024], dtype=torch.int32)
    upstream = torch.randn(1024, Hg, generator=g)
    outs = []
    for device, impl in (("cpu", "torch"), ("cuda", "auto")):
        q = {n: t.to(device).requires_grad_() for n, t in p.items()}
        c = dataclasses.replace(cfg, impl=impl)
        y, stats = attention(x.to(device), q, c, _ctx(cu.to(device), c))
        loss = stats["index_loss"] if "index_loss" in stats.keys() else torch.zeros((), device=device)
        grads = torch.autograd.grad((y * upstream.to(device)).sum() + loss, list(q.values()), allow_unused=True)
        outs.append([y.cpu(), loss.cpu(), *(None if t is None else t.cpu() for t in grads)])
    for name, a, b in zip(["y", "index_loss", *p], *outs):
        assert (a is None and b is None) or _rel(b, a) < 1e-4, name


def _loop_block_index_loss(x, p, cfg, cu):
    """Block-sparse attention's indexer loss query by query and kv head by kv head: the
    heads' attention mass on each chosen block (their sum, renormalised), and the indexer's
    softmax over the chosen blocks' best q . k / sqrt(index_head_dim), differentiable in the
    indexer's weights; KL summed over the kv heads, averaged over the queries."""
    T, (N, G, D), (Di, bs) = x.shape[0], (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), (cfg.index_head_dim, cfg.index_block_size)
    iq, ik, cos, sin = _loop_indexer(x, p, cfg, cu)
    with torch.no_grad():
        q = apply_rope((x @ p["wq"]).view(T, N, D), cos, sin, impl="torch")
        k = apply_rope((x @ p["wk"]).view(T, G, D), cos, sin, impl="torch")
    total = 0.0
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            for g in range(G):
                best, chosen = _loop_choice(iq, ik, t, a, g, cfg)
                keys = [s for s in range(a, t + 1) if (s - a) // bs in chosen]
                with torch.no_grad():
                    mass = torch.zeros(len(chosen))
                    for h in range(g * (N // G), (g + 1) * (N // G)):
                        weights = torch.softmax((k[keys, g] @ q[t, h]) * softmax_scale(cfg), dim=0)
                        for w, s in zip(weights, keys):
                            mass[chosen.index((s - a) // bs)] += w
                    target = mass / mass.sum()
                log_q = torch.log_softmax(best[chosen] * Di ** -0.5, dim=0)
                total = total + (target * (target.log() - log_q)).sum()
    return total / T


@pytest.mark.parametrize("block", [None, 3])
def test_block_sparse_indexer_loss_matches_its_definition_and_trains_the_indexer_alone(block, monkeypatch):
    """With index_loss, block-sparse attention returns its indexer's loss: for each query and
    kv head the KL divergence of the indexer's softmax over the chosen blocks' scores from
    the heads' attention mass on them, averaged over the queries; its value and its gradient
    in every indexer weight match the query-by-query definition, and it reaches nothing else
    (the tokens and the attention's weights get none of it). block: the dense reference's
    target read for blocks of that many queries (fmoe.layers._SCORE_ROWS; None: all at once)."""
    import fmoe.layers as L

    cfg = dataclasses.replace(BLOCKS, index_loss=True, index_local_blocks=1, index_topk_blocks=3)
    if block is not None:
        monkeypatch.setattr(L, "_SCORE_ROWS", block * cfg.n_heads * 17)
    p = {n: t.detach().requires_grad_() for n, t in _block_params(cfg).items()}
    x, cu = torch.randn(17, H, requires_grad=True), torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    y, stats = attention(x, p, cfg, _ctx(cu, cfg))
    loss = stats["index_loss"]
    index = [n for n in p if n.startswith("index_")]
    ref_p = {n: t.detach().clone().requires_grad_(n in index) for n, t in p.items()}
    ref = _loop_block_index_loss(x.detach(), ref_p, cfg, cu)
    value, ref_value = float(loss.detach()), float(ref.detach())
    assert loss.dtype == torch.float32 and loss.shape == () and value > 0 and abs(value - ref_value) < 1e-5 * ref_value
    grads = torch.autograd.grad(loss, [p[n] for n in index] + [x, p["wq"], p["wk"]], allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [ref_p[n] for n in index])
    for name, a, b in zip(index, grads, ref_grads):
        assert _rel(a, b) < 1e-4, name
    assert all(g is None for g in grads[len(index):])  # the tokens and the attention's weights: none
    with torch.no_grad():  # no gradients: no loss
        assert "index_loss" not in attention(x, p, cfg, _ctx(cu, cfg))[1].keys()
    frozen = {n: t.detach() if n in index else t for n, t in p.items()}  # nothing of the indexer to train: no loss either
    assert "index_loss" not in attention(x, frozen, cfg, _ctx(cu, cfg))[1].keys()


def test_block_index_keep_slots_and_target_of_chosen_blocks_worked_by_hand():
    """One query at place 4 of its document (keys at places 0-4: blocks of 2, [0, 0, 1, 1, 2]), kv head 0 choosing blocks
    2 then 0, kv head 1 block 1 and an empty slot (-1): the keys each kv head's queries see (an empty slot names no
    block), the sparse kernel's columns (-1 past the query and in an empty slot), and the attention's mass on each chosen
    block summed over the kv head's two query heads (0 and 1 for kv head 0, 2 and 3 for 1; 0 in an empty slot)."""
    from fmoe.layers import block_index_keep, block_index_slots, block_index_target

    cfg = dataclasses.replace(BLOCKS, index_block_size=2)
    chosen, kv_pos = torch.tensor([[[2, 0]], [[1, -1]]]), torch.arange(5)
    keep = block_index_keep(chosen, kv_pos, torch.ones(1, 5, dtype=torch.bool), cfg)
    assert keep.tolist() == [[[True, True, False, False, True]], [[False, False, True, True, False]]]
    assert block_index_slots(chosen, torch.tensor([4]), torch.tensor([0]), None, cfg).tolist() == [[[4, -1, 0, 1]], [[2, 3, -1, -1]]]
    probs = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * torch.tensor([1.0, 10.0, 100.0, 1000.0])[:, None, None]  # [4 heads, 1, 5]
    assert block_index_target(probs, chosen, kv_pos, cfg).tolist() == [[[55.0, 33.0]], [[7700.0, 0.0]]]


def test_the_indexer_s_keys_spread_over_the_kv_heads_pad_after_their_channels():
    """_spread_keys: the indexer's keys [T, Di] as [T, G, ceil(Di / G)] to ride beside the G kv heads' keys (context
    parallel, the cache): read back in order, their Di channels first, zeros after them (Di = 9 over 2 heads: 5 + 5)."""
    from fmoe.layers import _spread_keys

    keys = torch.arange(1.0, 19.0).view(2, 9)
    spread = _spread_keys(keys, 2)
    assert spread.shape == (2, 2, 5)
    assert torch.equal(spread.flatten(1)[:, :9], keys) and not spread.flatten(1)[:, 9:].any()
    assert torch.equal(_spread_keys(keys[:, :8], 2), keys[:, :8].view(2, 2, 4))


# ---------------------------------------------------------------- mixture of attention heads

MOA = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, moa_experts=3, moa_topk=2)


def _moa_params(cfg, bo=False):
    """Each attention expert's wq [E, H, G D] and wo [E, G D, H], the shared wk, wv, the
    float32 router [H, E] (and an output bias), all trained."""
    gen = torch.Generator().manual_seed(5)
    E, GD = cfg.moa_experts, cfg.n_kv_heads * cfg.head_dim
    shapes = {"wq": (E, H, GD), "wk": (H, GD), "wv": (H, GD), "wo": (E, GD, H), "moa_router": (H, E)}
    p = {n: torch.randn(*s, generator=gen) * s[-2] ** -0.5 for n, s in shapes.items()}
    if bo:
        p["bo"] = 0.1 * torch.randn(H, generator=gen)
    return {n: t.requires_grad_() for n, t in p.items()}


def _loop_moa(x, p, cfg, cu):
    """JetMoE's mixture of attention heads, token by token: the k experts of the highest
    router logits, weighted by the softmax of those logits; slot j's expert e makes G query
    heads x wq[e], head g attending with kv head g over the document's earlier keys; their
    outputs through wo[e], times the slot's weight, summed over the slots."""
    T, G, D, k = x.shape[0], cfg.n_kv_heads, cfg.head_dim, cfg.moa_topk
    cos, sin = rope_tables(positions_from_cu_seqlens(cu), cfg)
    keys = apply_rope((x @ p["wk"]).view(T, G, D), cos, sin, impl="torch")
    values = (x @ p["wv"]).view(T, G, D)
    if cfg.qk_norm == "rms":
        keys = _unit_rms(keys, cfg.norm_eps)
    top = (x @ p["moa_router"]).topk(k, dim=-1)
    gates = torch.softmax(top.values, dim=-1)
    rows = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            first = a if cfg.window is None else max(a, t - cfg.window + 1)
            y = 0
            for j in range(k):
                e = int(top.indices[t, j])
                q = apply_rope((x[t] @ p["wq"][e]).view(1, G, D), cos[t:t + 1], sin[t:t + 1], impl="torch")[0]
                if cfg.qk_norm == "rms":
                    q = _unit_rms(q, cfg.norm_eps)
                heads = [torch.softmax(keys[first:t + 1, g] @ q[g] * softmax_scale(cfg), dim=0) @ values[first:t + 1, g] for g in range(G)]
                y = y + gates[t, j] * (torch.cat(heads) @ p["wo"][e])
            rows.append(y)
    y = torch.stack(rows)
    return y + p["bo"] if "bo" in p else y


@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
@pytest.mark.parametrize("cfg", [MOA, dataclasses.replace(MOA, moa_experts=4, moa_topk=1, n_heads=2),
                                 dataclasses.replace(MOA, window=4, qk_norm="rms", qk_norm_after_rope=True)], ids=["k2", "k1", "window-rms"])
def test_mixture_of_attention_heads_matches_per_token_loop(cfg, impl):
    """The output and the gradients of x and of every weight (the router's through the
    slots' weights) as the token-by-token definition's, on the reference, the CPU's grouped
    GEMMs and the Triton kernels (interpreted); the router's balance loss in stats."""
    cfg = dataclasses.replace(cfg, impl=impl)
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    p = _moa_params(cfg, bo=True)
    x = torch.randn(17, H, requires_grad=True)
    x_ref, p_ref = x.detach().clone().requires_grad_(), {n: t.detach().clone().requires_grad_() for n, t in p.items()}
    y, stats = attention(x, p, cfg, _ctx(cu, cfg))
    y_ref = _loop_moa(x_ref, p_ref, cfg, cu)
    assert _rel(y, y_ref) < 1e-5
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward(retain_graph=True)
    (y_ref * upstream).sum().backward()
    assert _rel(x.grad, x_ref.grad) < 1e-5
    for n in p:
        if n == "moa_router" and cfg.moa_topk == 1:  # one slot: weight 1, no gradient through it
            assert p[n].grad is None or float(p[n].grad.abs().max()) == 0.0
            continue
        assert _rel(p[n].grad, p_ref[n].grad) < 1e-5, n
    # the router's switch loss: E / (k T^2) sum_e (sum_t softmax(logits)[t, e]) (slots routed to e)
    logits = x.detach() @ p["moa_router"].detach()
    counts = torch.bincount(logits.topk(cfg.moa_topk, dim=-1).indices.flatten(), minlength=cfg.moa_experts).float()
    T, E, k = x.shape[0], cfg.moa_experts, cfg.moa_topk
    expected = (torch.softmax(logits, dim=-1).sum(0) * counts).sum() * E / (k * T * T)
    torch.testing.assert_close(stats["moa_aux_loss"].detach(), expected)
    p["moa_router"].grad = None
    stats["moa_aux_loss"].backward()
    assert float(p["moa_router"].grad.abs().max()) > 0


def test_mixture_of_attention_heads_of_equal_experts_is_grouped_query_attention():
    """With every expert's query and output projections the same, routing changes nothing:
    the layer is grouped-query attention with those projections (the slots' weights add up
    to 1), whatever the router."""
    cfg = MOA
    p = {n: t.detach() for n, t in _moa_params(cfg).items()}
    p["wq"], p["wo"] = p["wq"][:1].expand_as(p["wq"]).clone(), p["wo"][:1].expand_as(p["wo"]).clone()
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    x = torch.randn(12, H)
    plain = AttentionConfig(n_heads=2, n_kv_heads=2, head_dim=16)
    with torch.no_grad():
        y, _ = attention(x, p, cfg, _ctx(cu, cfg))
        y_plain, _ = attention(x, {"wq": p["wq"][0], "wk": p["wk"], "wv": p["wv"], "wo": p["wo"][0]}, plain, _ctx(cu, plain))
        p["moa_router"] = torch.randn_like(p["moa_router"])
        y_rerouted, _ = attention(x, p, cfg, _ctx(cu, cfg))
    assert _rel(y, y_plain) < 1e-5 and _rel(y_rerouted, y_plain) < 1e-5


@pytest.mark.parametrize("cp", [2, 4])
def test_mixture_of_attention_heads_under_context_parallel(cp):
    """Each rank's rows are the whole batch's: the routing is per token, the keys and
    values shared by every expert."""
    _check_cp_rows(MOA, {n: t.detach() for n, t in _moa_params(MOA).items()}, cp)
    # the router's balance loss: this rank's share, over every rank's counts and tokens (cp ranks of the same tokens: 1 / cp of one process's)
    from types import SimpleNamespace

    ranks = SimpleNamespace(cp=cp, sum_counts=lambda counts: counts * cp)
    p, cu, x = _moa_params(MOA), torch.tensor([0, 5, 11]), torch.randn(11, H)
    whole = attention(x, p, MOA, _ctx(cu, MOA))[1]["moa_aux_loss"]
    share = attention(x, p, MOA, dataclasses.replace(_ctx(cu, MOA), linear_cp=ranks))[1]["moa_aux_loss"]
    torch.testing.assert_close(share * cp, whole)


def test_mixture_of_attention_heads_bad_inputs():
    p = {n: t.detach() for n, t in _moa_params(MOA).items()}
    cu = torch.tensor([0, 6])
    x, ctx = torch.randn(6, H), _ctx(cu, MOA)
    for change, message in [(dict(n_heads=6), "n_heads: a mixture of attention heads has moa_topk x n_kv_heads = 4 query heads"),
                            (dict(moa_topk=4), "moa_topk: expected"), (dict(moa_experts=0), "moa_experts: expected"),
                            (dict(qk_norm="proj"), "qk_norm: not with a mixture of attention heads"),
                            (dict(fp8=True), "fp8: not with a mixture of attention heads")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(MOA, **change)
    with pytest.raises(ValueError, match="moa_topk: the attention experts per token of a mixture of attention heads, needs moa_experts"):
        dataclasses.replace(CFG, moa_topk=2)
    with pytest.raises(ValueError, match=re.escape("params['wq']: expected torch.float32 [3, 32, 32]")):
        attention(x, dict(p, wq=p["wq"][0]), MOA, ctx)
    with pytest.raises(ValueError, match=re.escape("params['moa_router']: the attention experts' router, expected float32 [32, 3], got torch.bfloat16")):
        attention(x, dict(p, moa_router=p["moa_router"].bfloat16()), MOA, ctx)
    with pytest.raises(ValueError, match=re.escape("params['moa_router']: the attention experts' router, expected float32 [32, 3], got nothing")):
        attention(x, {n: t for n, t in p.items() if n != "moa_router"}, MOA, ctx)
    with pytest.raises(ValueError, match=re.escape("params['bq']: not with a mixture of attention heads")):
        attention(x, dict(p, bq=torch.zeros(64)), MOA, ctx)
    with pytest.raises(ValueError, match=re.escape("params['wg']: not with a mixture of attention heads")):
        attention(x, dict(p, wg=torch.zeros(H, 64)), MOA, ctx)
    with pytest.raises(ValueError, match=re.escape("params: unknown attention parameters ['moa_router']")):
        attention(x, dict(_params(CFG), moa_router=p["moa_router"]), CFG, ctx)


@pytest.mark.gpu
def test_gpu_mixture_of_attention_heads_matches_the_cpu_layer():
    """A mixture of attention heads on CUDA (JetMoE-8B's experts and heads at a smaller hidden
    size: 8 experts, 2 per token, 16 kv heads of 128, over 4096 tokens in 3 documents; float32,
    so the routing is the same) gives the CPU layer's output, balance loss and gradients, on
    the grouped GEMMs with FlexAttention ("auto") and the Triton kernels with the SDPA reference."""
    cfg = AttentionConfig(n_heads=32, n_kv_heads=16, head_dim=128, moa_experts=8, moa_topk=2, impl="torch")
    Hg, g = 512, torch.Generator().manual_seed(3)
    shapes = {"wq": (8, Hg, 2048), "wk": (Hg, 2048), "wv": (Hg, 2048), "wo": (8, 2048, Hg), "moa_router": (Hg, 8)}
    p = {n: torch.randn(*s, generator=g) * s[-2] ** -0.5 for n, s in shapes.items()}
    x, cu = torch.randn(4096, Hg, generator=g), torch.tensor([0, 1000, 1001, 4096], dtype=torch.int32)
    upstream = torch.randn(4096, Hg, generator=g)
    outs = []
    for device, impl in (("cpu", "torch"), ("cuda", "auto"), ("cuda", "triton")):
        q = {n: t.to(device).requires_grad_() for n, t in p.items()}
        c = dataclasses.replace(cfg, impl=impl)
        y, stats = attention(x.to(device), q, c, _ctx(cu.to(device), c))
        grads = torch.autograd.grad((y * upstream.to(device)).sum() + stats["moa_aux_loss"], list(q.values()))
        outs.append([y.cpu(), stats["moa_aux_loss"].detach().cpu(), *(t.cpu() for t in grads)])
    for cuda in outs[1:]:
        for a, b in zip(outs[0], cuda):
            assert _rel(b, a) < 1e-4


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_grouped_output_projection_is_a_block_diagonal_then_dense_projection(kind):
    """o_groups g, o_rank r (DeepSeek-V4's grouped output projection): the heads' outputs in g groups of contiguous
    heads, each through its wo_a[i], then wo, equal the plain projection by wo' = blockdiag(wo_a) wo (the same linear
    map): the output and the q/k/v weights' gradients, for grouped-query and multi-latent attention."""
    from fmoe.layers import mla_shapes

    torch.manual_seed(0)
    if kind == "gqa":
        plain = dataclasses.replace(CFG, v_dim=8)
        p = _params(plain)
    else:
        plain = AttentionConfig(n_heads=4, n_kv_heads=4, head_dim=12, rot_dim=4, q_rank=10, kv_rank=6, v_dim=5)
        mats, norms = mla_shapes(H, plain)
        p = {n: (torch.randn(*s) * s[0] ** -0.5).requires_grad_() for n, s in mats.items()}
        p.update({n: torch.ones(s, requires_grad=True) for n, s in norms.items()})
    grouped = dataclasses.replace(plain, o_groups=2, o_rank=3)
    N, Dv = plain.n_heads, plain.v_dim
    wo_a = torch.randn(2, N * Dv // 2, 3, requires_grad=True)
    wo = torch.randn(6, H, requires_grad=True)
    pg = {**{n: t.detach().clone().requires_grad_() for n, t in p.items() if n != "wo"}, "wo_a": wo_a, "wo": wo}
    pp = {**{n: t.detach().clone().requires_grad_() for n, t in p.items() if n != "wo"}, "wo": torch.block_diag(*wo_a) @ wo}
    x, cu = torch.randn(13, H), torch.tensor([0, 6, 13])
    y_g, _ = attention(x, pg, grouped, _ctx(cu, grouped))
    y_p, _ = attention(x, pp, plain, _ctx(cu, plain))
    torch.testing.assert_close(y_g, y_p, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_g)
    (y_g * g).sum().backward()
    (y_p * g).sum().backward()
    for name in pg:
        if name not in ("wo", "wo_a"):
            torch.testing.assert_close(pg[name].grad, pp[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    assert wo_a.grad is not None and float(wo_a.grad.abs().max()) > 0
    # the plain projection's shapes are refused beside the grouped config, and the other way round
    with pytest.raises(ValueError, match=re.escape(f"params['wo_a']: expected torch.float32 [2, {N * Dv // 2}, 3], got nothing")):
        attention(x, pp, grouped, _ctx(cu, grouped))
    with pytest.raises(ValueError, match=re.escape(f"params['wo']: expected torch.float32 [6, 32], got torch.float32 [{N * Dv}, 32]")):
        attention(x, {**pp, "wo_a": wo_a}, grouped, _ctx(cu, grouped))
    with pytest.raises(ValueError, match="params: unknown .*wo_a"):
        attention(x, {**pp, "wo_a": wo_a}, plain, _ctx(cu, plain))


def test_grouped_output_projection_matches_transformers_deepseek_v4():
    """fmoe.layers.out_projection against DeepSeek-V4's o_a_proj (DeepseekV4GroupedLinear) and o_b_proj of the same
    weights: o_a_proj's [g r, N D / g] rows are group i's wo_a[i] transposed, o_b_proj's weight wo's."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4", reason="transformers (the test extra) not installed")
    from fmoe.layers import out_projection

    g, r, N, D = 4, 5, 8, 6
    torch.manual_seed(0)
    o_a, o_b = v4.DeepseekV4GroupedLinear(N * D // g, g * r, g), torch.nn.Linear(g * r, H, bias=False)
    out = torch.randn(11, N * D)
    want = o_b(o_a(out.reshape(11, g, -1)).flatten(1))
    cfg = AttentionConfig(n_heads=N, n_kv_heads=1, head_dim=D, o_groups=g, o_rank=r)
    params = {"wo_a": o_a.weight.detach().view(g, r, -1).transpose(1, 2), "wo": o_b.weight.detach().T}
    torch.testing.assert_close(out_projection(out, params, cfg), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("knobs, message", [
    (dict(o_groups=2), r"o_groups and o_rank: the grouped output projection's groups and rank, give both or neither \(got o_groups=2, o_rank=None\)"),
    (dict(o_rank=4), r"o_groups and o_rank: .*\(got o_groups=None, o_rank=4\)"),
    (dict(o_groups=3, o_rank=4), r"o_groups: groups of whole heads, expected a divisor of n_heads = 4, got 3"),
    (dict(o_groups=0, o_rank=4), r"o_groups: expected"),
    (dict(o_groups=2, o_rank=0), r"o_rank: expected"),
    (dict(o_groups=2, o_rank=4, fp8=True), r"fp8: the grouped output projection \(o_groups\) runs its group products in the model's dtype"),
    (dict(o_groups=2, o_rank=4, moa_experts=3, moa_topk=2), r"o_groups: not with a mixture of attention heads"),
])
def test_grouped_output_projection_knobs_are_checked(knobs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **knobs)


@pytest.mark.parametrize("knobs", [dict(), dict(rot_dim=8, qk_norm="head"), dict(interleaved=True, window=4, qk_norm="rms")], ids=str)
def test_shared_key_value_heads_are_the_keys_and_turn_back_with_the_query(knobs):
    """kv_shared (DeepSeek-V4's): no wv, the values are the keys after their norm and RoPE, each head's output rotated
    back at its query's position. Against the same layer written out (the values the rotated keys, the output rotated by
    the negated sine), and, what the inverse rotation is for, the output depends on the positions' differences alone:
    every position moved by 5 leaves it as it is (without the inverse rotation it changes)."""
    cfg = dataclasses.replace(CFG, kv_shared=True, **knobs)
    torch.manual_seed(0)
    p = {n: t for n, t in _params(cfg).items() if n != "wv"}
    if cfg.qk_norm == "head":
        p.update(q_norm=torch.rand(16) + 0.5, k_norm=torch.rand(16) + 0.5)
    x, cu = torch.randn(13, H), torch.tensor([0, 6, 13])
    positions = positions_from_cu_seqlens(cu)
    y, _ = attention(x, p, cfg, _ctx(cu, cfg, positions))
    # written out: the keys normed and rotated are the values; the outputs rotated back
    ctx = _ctx(cu, cfg, positions)
    with torch.no_grad():
        def norm(t, w):
            return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + cfg.norm_eps) * (1 if w is None else w)

        def written_out(ctx, turn_back=True):
            q = (x @ p["wq"]).view(13, 4, 16)
            k = (x @ p["wk"]).view(13, 2, 16)
            if cfg.qk_norm is not None:
                q, k = norm(q, p.get("q_norm")), norm(k, p.get("k_norm"))
            q, k = (apply_rope(t, ctx.cos, ctx.sin, interleaved=cfg.interleaved, impl="torch") for t in (q, k))
            out = F_sdpa(q, k, k, ctx.mask if cfg.window is None else ctx.local_mask, cfg)
            if turn_back:
                out = apply_rope(out, ctx.cos, -ctx.sin, interleaved=cfg.interleaved, impl="torch")
            return out.reshape(13, 64) @ p["wo"]

        want = written_out(ctx)
        moved_ctx = _ctx(cu, cfg, positions + 5)
        # without the turn back the rotated values move the output with the positions
        assert (written_out(moved_ctx, turn_back=False) - written_out(ctx, turn_back=False)).abs().max() > 1e-3
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y_moved, _ = attention(x, p, cfg, moved_ctx)
    torch.testing.assert_close(y_moved, y, rtol=1e-4, atol=1e-5)


def _dsv4_attention_layer(kind="sliding_attention", seed=0):
    """A DeepSeek-V4 attention layer of transformers of `kind` (one kv head of 16 whose keys are its values, RoPE on its
    last 8 channels in pairs, a q latent of 12, the grouped output projection of 2 groups of rank 5, sinks, a window of 5;
    heavily_compressed_attention: a compressor of runs of 4 too, the compress RoPE at 160000; compressed_sparse_attention:
    overlapping runs of 2, each query's best 2 entries by an indexer of 8 heads of 8), every weight random, and fmoe's
    AttentionConfig and params of the same weights."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4", reason="transformers (the test extra) not installed")
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, head_dim=16, q_lora_rank=12,
                          partial_rotary_factor=0.5, layer_types=[kind], sliding_window=5, o_groups=2, o_lora_rank=5,
                          compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, rms_norm_eps=1e-5,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, index_n_heads=8, index_head_dim=8, index_topk=2)
    hf._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = v4.DeepseekV4Attention(hf, 0).eval()
    with torch.no_grad():
        for name, w in layer.named_parameters():
            w.copy_(torch.rand_like(w) + 0.5 if "norm" in name else torch.randn_like(w) * (0.5 if w.ndim < 2 else w.shape[-1] ** -0.5))
    compressed, sparse = kind == "heavily_compressed_attention", kind == "compressed_sparse_attention"
    knobs = (dict(rope_base=160000.0, compress_rate=4) if compressed else
             dict(rope_base=160000.0, compress_rate=2, compress_topk=2, index_heads=8, index_head_dim=8, index_rope_last=True, index_interleaved=True)
             if sparse else {})
    cfg = AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=16, q_rank=12, rot_dim=8, rope_last=True, interleaved=True, qk_norm="head_k",
                          kv_shared=True, o_groups=2, o_rank=5, window=5, norm_eps=1e-5, latent_norm_eps=1e-5, impl="torch", **knobs)
    w = {n: t.detach() for n, t in layer.named_parameters()}
    params = {"wq_a": w["q_a_proj.weight"].T, "q_a_norm": w["q_a_norm.weight"], "wq_b": w["q_b_proj.weight"].T, "wk": w["kv_proj.weight"].T,
              "k_norm": w["kv_norm.weight"], "wo_a": w["o_a_proj.weight"].view(2, 5, -1).transpose(1, 2), "wo": w["o_b_proj.weight"].T,
              "sinks": w["sinks"]}
    if compressed or sparse:
        params.update(compress_wkv=w["compressor.kv_proj.weight"].T, compress_wg=w["compressor.gate_proj.weight"].T,
                      compress_bias=w["compressor.position_bias"], compress_norm=w["compressor.kv_norm.weight"])
    if sparse:  # the indexer's queries, head weights and compressor
        index = "compressor.indexer."
        params.update(index_wq=w[index + "q_b_proj.weight"].T, index_w=w[index + "scorer.weights_proj.weight"].T,
                      index_compress_wkv=w[index + "kv_proj.weight"].T, index_compress_wg=w[index + "gate_proj.weight"].T,
                      index_compress_bias=w[index + "position_bias"], index_compress_norm=w[index + "kv_norm.weight"])
    return v4, hf, layer, cfg, {n: t.contiguous().clone().requires_grad_() for n, t in params.items()}


def _dsv4_reference(v4, hf, layer, x, cu, rope):
    """transformers' DeepSeek-V4 attention layer over each document of x [T, H] (cu) on its own, under its window of 5,
    with its `rope` tables ("main" or "compress"): [T, H]."""
    rotary, want = v4.DeepseekV4RotaryEmbedding(hf), []
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            xs, pos = x[a:b][None], torch.arange(b - a)[None]
            allowed = (pos[0][:, None] >= pos[0][None]) & (pos[0][:, None] - pos[0][None] < 5)
            mask = torch.zeros(b - a, b - a).masked_fill(~allowed, float("-inf"))[None, None]
            want.append(layer(xs, {rope: rotary(xs, pos, layer_type=rope)}, pos, mask)[0][0])
    return torch.cat(want)


@pytest.mark.parametrize("impl", ["torch", "flex"])
def test_deepseek_v4_sliding_attention_matches_transformers(impl):
    """DeepSeek-V4's attention (its sliding layers): the queries from a normed q latent (q_rank on grouped-query attention)
    and normed per head without weights, the one key head normed with weights (qk_norm "head_k"), RoPE on each head's last
    8 channels in pairs (rope_last), values the keys, sinks, a window of 5, the grouped output projection. fmoe's layer
    against transformers' DeepseekV4Attention of the same weights, over two documents each run on its own there (the
    SDPA reference with its gradients reaching every weight, and FlexAttention's forward)."""
    v4, hf, layer, cfg, params = _dsv4_attention_layer()
    cfg = dataclasses.replace(cfg, impl=impl)
    x, cu = torch.randn(15, H), torch.tensor([0, 9, 15])
    want = _dsv4_reference(v4, hf, layer, x, cu, "main")
    with torch.set_grad_enabled(impl == "torch"):  # FlexAttention has no backward on CPU
        y, _ = attention(x, params, cfg, _ctx(cu, cfg))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    if impl == "torch":
        y.square().sum().backward()
        assert all(float(t.grad.abs().max()) > 0 for t in params.values())


def test_heavily_compressed_attention_matches_transformers_deepseek_v4():
    """DeepSeek-V4's HCA layers (compress_rate): the layer's keys under its window of 5 and, after them, one compressed entry
    per complete run of 4 tokens of each document (softmax-weighted sums of a projection, by place in the run, normed and
    rotated at the run's start), seen from the run's last position on; against transformers' DeepseekV4Attention of a
    heavily_compressed_attention layer (its compressor stateless) with the same weights, two documents (of 11 and 6 tokens:
    2 and 1 complete runs, tails left out) each run on its own there; gradients reach every weight, the compressor's too."""
    v4, hf, layer, cfg, params = _dsv4_attention_layer("heavily_compressed_attention")
    x, cu = torch.randn(17, H), torch.tensor([0, 11, 17])
    want = _dsv4_reference(v4, hf, layer, x, cu, "compress")
    y, _ = attention(x, params, cfg, _ctx(cu, cfg))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    # the entries matter: without them (the keys under the window alone) the output moves
    plain = dataclasses.replace(cfg, compress_rate=None)
    y_plain, _ = attention(x, {n: t for n, t in params.items() if not n.startswith("compress")}, plain, _ctx(cu, plain))
    assert (y_plain - y).abs().max() > 1e-3
    y.square().sum().backward()
    assert all(float(t.grad.abs().max()) > 0 for t in params.values())


def test_compressed_sparse_attention_matches_transformers_deepseek_v4():
    """DeepSeek-V4's CSA layers (compress_topk): overlapping entries of runs of 2 tokens (the previous run's first halves
    beside the run's second halves), each query attending to the 2 of the entries it sees that its lightning indexer (8 heads
    of 8, its own overlapping compressor, RoPE on the last 8 channels in pairs) scores highest, beside its keys under the
    window of 5; against transformers' DeepseekV4Attention of a compressed_sparse_attention layer (stateless) with the same
    weights, two documents (of 11 and 6 tokens: 5 and 3 complete runs) each run on its own there. The choice matters (all
    the seen entries, or the best one alone, move the output), gradients reach the attention's and the compressor's weights
    and none the indexer's (its choice has none)."""
    v4, hf, layer, cfg, params = _dsv4_attention_layer("compressed_sparse_attention")
    x, cu = torch.randn(17, H), torch.tensor([0, 11, 17])
    want = _dsv4_reference(v4, hf, layer, x, cu, "compress")
    y, _ = attention(x, params, cfg, _ctx(cu, cfg))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    for topk in (1, 8):
        other = dataclasses.replace(cfg, compress_topk=topk)
        with torch.no_grad():
            assert (attention(x, params, other, _ctx(cu, other))[0] - y).abs().max() > 1e-3, topk
    y.square().sum().backward()
    assert all(float(t.grad.abs().max()) > 0 for n, t in params.items() if not n.startswith("index_")), [n for n, t in params.items() if t.grad is None]
    assert all(t.grad is None for n, t in params.items() if n.startswith("index_"))


@pytest.mark.parametrize("kind", ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"])
def test_deepseek_v4_attention_on_the_sparse_kernel_is_the_reference(kind, monkeypatch):
    """impl="triton" (CUDA's "auto"; the interpreter here) on DeepSeek-V4's layers: each query over its window's keys and
    the entries it attends to alone (fmoe.ops.sparse_attention, the one kv head its own values, the sinks on the kernel's
    output), against the dense reference (impl="torch"): the output, the CSA indexer's loss (its target the kernel's
    probabilities with the sinks) and every gradient, x's included, over two documents (of 11 and 6 tokens); the kernel
    reads each query's window of 5 keys and its entries: 5 + 2 slots (CSA), 5 + 17 // 4 (HCA), 5."""
    import fmoe.layers as L

    slots = []
    kernel = L.sparse_attention
    monkeypatch.setattr(L, "sparse_attention", lambda q, kv, index, **kw: slots.append(index.shape) or kernel(q, kv, index, **kw))
    v4, hf, layer, cfg, params = _dsv4_attention_layer(kind)
    x, cu = torch.randn(17, H, requires_grad=True), torch.tensor([0, 11, 17])
    up = torch.randn(17, H)
    runs = {}
    for impl in ("torch", "triton"):
        run = dataclasses.replace(cfg, impl=impl, index_loss=kind == "compressed_sparse_attention")
        y, stats = attention(x, params, run, _ctx(cu, run))
        loss = stats["index_loss"] if "index_loss" in stats.keys() else torch.zeros(())
        grads = torch.autograd.grad((y * up).sum() + loss, [x, *params.values()], allow_unused=True)
        runs[impl] = (y, loss, *grads)
    for name, a, b in zip(["y", "index_loss", "x", *params], runs["torch"], runs["triton"]):
        if a is None:
            assert b is None, name
            continue
        assert _rel(b, a) < 2e-5, name
    assert kind != "compressed_sparse_attention" or float(runs["torch"][1].detach()) > 1e-3
    entries = {"sliding_attention": 0, "heavily_compressed_attention": 17 // 4, "compressed_sparse_attention": 2}[kind]
    assert slots == [(17, 5 + entries)]


@pytest.mark.parametrize("layout", ["tokens", "split", "ring"])
def test_a_window_s_keys_from_its_rule_are_the_dense_mask_s(layout):
    """A sliding window's keys per query found from its rule (MaskRows) alone, in O(T W) (fmoe.layers._window_slots, the
    sparse kernel's slots of DeepSeek-V4's layers): the same columns as the dense mask allows, each row's in position
    order, -1 after them; over documents of 1 to 13 tokens and windows of 1 to 9, with the keys in token order ("tokens"),
    a context-parallel split's queries over keys gathered in rank order ("split"), and a decode's rings (keys of other
    sequences, dead rows past the documents, repeated, and a few new tokens: "ring")."""
    import fmoe.layers as L

    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        lengths = torch.randint(1, 14, (4,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        n, W = int(cu[-1]), int(torch.randint(1, 10, (1,), generator=g))
        kw = {}
        if layout == "split":  # this rank's queries (every other token), the keys in a permuted order
            kw = dict(token_index=torch.arange(trial % 2, n, 2), kv_index=torch.randperm(n, generator=g))
        elif layout == "ring":  # rows of the last W positions of each document, dead rows (past cu[-1]), then the new ones
            ends = cu[1:] - 1
            held = torch.cat([torch.arange(max(int(e) - W + 1, int(s)), int(e) + 1) for s, e in zip(cu[:-1], ends)])
            dead = torch.full((3,), n)
            kw = dict(token_index=ends, kv_index=torch.cat([held[torch.randperm(held.numel(), generator=g)], dead]))
            cu = torch.cat([cu, torch.tensor([n + 1])])
        n_kv = n if "kv_index" not in kw else kw["kv_index"].numel()
        rule = document_mask(cu, n_kv, flex=False, window=W, rows=True, **kw)
        dense = document_mask(cu, n_kv, flex=False, window=W, **kw)
        assert isinstance(rule, MaskRows) and dense.sum(1).max() <= W
        slots = L._window_slots(rule, W)
        assert slots.shape == (dense.shape[0], W)
        for t in range(dense.shape[0]):
            cols = slots[t][slots[t] >= 0]
            assert (slots[t][len(cols):] == -1).all()
            assert sorted(cols.tolist()) == dense[t].nonzero().flatten().tolist(), (layout, trial, t)
            assert (rule.kv_pos[cols].diff() > 0).all()


@pytest.mark.parametrize("kind", ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"])
def test_deepseek_v4_attention_on_the_kernel_never_makes_a_dense_mask(kind, op_shapes):
    """A context built for DeepSeek-V4's layers where the sparse kernel runs (impl "triton"; CUDA's "auto") holds the
    masks' rules (MaskRows), and the layer, forward and backward, makes no tensor of a query per key ([..., T, keys]
    or [..., T, keys + entries]): the window's keys come from the rule, the entries' from their own (the context and the
    layer run under a record of every op's output; the dense reference, impl "torch", makes such tensors, so the record
    would see one)."""
    _, _, _, cfg, params = _dsv4_attention_layer(kind)
    T, cu = 17, torch.tensor([0, 11, 17])
    entries = T // cfg.compress_rate if cfg.compress_rate else 0
    dense_widths = {T, T + entries}
    found = {}
    for impl in ("torch", "triton"):
        run = dataclasses.replace(cfg, impl=impl, index_loss=kind == "compressed_sparse_attention")
        x = torch.randn(T, H, requires_grad=True)
        with op_shapes() as rec:
            ctx = _ctx(cu, run)
            y, stats = attention(x, params, run, ctx)
            (y.square().sum() + (stats["index_loss"] if "index_loss" in stats.keys() else 0)).backward()
        if impl == "triton":
            assert isinstance(ctx.mask, MaskRows) and isinstance(ctx.local_mask, MaskRows)
        found[impl] = [s for s in rec.shapes() if len(s) >= 2 and s[-2] == T and s[-1] in dense_widths]
    assert found["torch"] and not found["triton"], found


def test_the_reference_with_sinks_reads_the_mask_s_rule_a_block_at_a_time(monkeypatch, op_shapes):
    """A layer with sinks that no sparse kernel takes (here DeepSeek-V4's attention without its window, as its MTP
    block's) in a context holding the mask's rule (MaskRows: impl "triton", CUDA's "auto"): the reference attends over
    blocks of 3 queries, each making its own rows of the mask, with the output and gradients of the dense mask's
    (impl "torch"); no [T, T] tensor is made (the dense run's context makes one: the record would see it)."""
    import fmoe.layers as L

    _, _, _, cfg, params = _dsv4_attention_layer("sliding_attention")
    T, cu = 17, torch.tensor([0, 11, 17])
    monkeypatch.setattr(L, "_SCORE_ROWS", 3 * cfg.n_heads * T)
    x, up = torch.randn(T, H, requires_grad=True), torch.randn(T, H)
    runs = {}
    for impl in ("torch", "triton"):
        run = dataclasses.replace(cfg, window=None, impl=impl)
        with op_shapes() as rec:
            ctx = _ctx(cu, run)
            y, _ = attention(x, params, run, ctx)
            grads = torch.autograd.grad((y * up).sum(), [x, *params.values()])
        assert isinstance(ctx.mask, MaskRows) == (impl == "triton")
        runs[impl] = (y, *grads, [s for s in rec.shapes() if s[-2:] == (T, T)])
    for name, a, b in zip(["y", "x", *params], runs["torch"][:-1], runs["triton"][:-1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert runs["torch"][-1] and not runs["triton"][-1], (runs["torch"][-1], runs["triton"][-1])


def test_the_reference_with_sinks_runs_in_blocks_of_queries(monkeypatch):
    """The dense reference with sinks (DeepSeek-V4's CSA layer here, its indexer's loss on: the heads' probabilities of the
    chosen entries read block by block) over blocks of queries, each recomputed in the backward, when the scores of every
    query hold more than fmoe.layers._SCORE_ROWS floats: the output, the indexer's loss and every gradient are the
    whole product's, and nothing autograd keeps for the backward is as large as the scores of every query [N, T, S]
    (S the keys and the entries), where the whole product keeps two such (the probabilities, and their copy by kv head)."""
    import fmoe.layers as L

    v4, hf, layer, cfg, params = _dsv4_attention_layer("compressed_sparse_attention")
    cfg = dataclasses.replace(cfg, index_loss=True)
    x, cu = torch.randn(17, H).requires_grad_(), torch.tensor([0, 11, 17])
    N, S = cfg.n_heads, 17 + 17 // 2
    runs = {}
    for rows in (None, 3 * N * S):  # everything at once; blocks of 3 queries (6 blocks)
        if rows is not None:
            monkeypatch.setattr(L, "_SCORE_ROWS", rows)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage().nbytes()) or t, lambda t: t):
            y, stats = attention(x, params, cfg, _ctx(cu, cfg))
        (y.square().sum() + stats["index_loss"]).backward()
        runs[rows] = (y.detach(), stats["index_loss"].detach(), {n: t.grad.clone() for n, t in [("x", x), *params.items()]},
                      sum(n >= N * 17 * S * 4 for n in kept))
        x.grad = None
        for t in params.values():
            t.grad = None
    (y0, loss0, grads0, big0), (y1, loss1, grads1, big1) = runs.values()
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-7)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-6, msg=n)
    assert (big0, big1) == (2, 0)


def _dsv4_entry_probs(v4, hf, layer, x, cu):
    """transformers' DeepSeek-V4 CSA layer's attention probabilities on the compressed entries (the sinks' share in their
    softmax, dropped), summed over its heads, over each document of x [T, H] (cu) on its own under its window of 5: [T, S]
    in fmoe's slots (each document's complete runs in order, S = T // compress_rate, the unused ones 0)."""
    rotary, m = v4.DeepseekV4RotaryEmbedding(hf), hf.compress_rates["compressed_sparse_attention"]
    probs = torch.zeros(x.shape[0], x.shape[0] // m)
    base = 0
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            xs, pos = x[a:b][None], torch.arange(b - a)[None]
            allowed = (pos[0][:, None] >= pos[0][None]) & (pos[0][:, None] - pos[0][None] < 5)
            mask = torch.zeros(b - a, b - a).masked_fill(~allowed, float("-inf"))[None, None]
            weights = layer(xs, {"compress": rotary(xs, pos, layer_type="compress")}, pos, mask)[1][0].sum(0)  # [t, t + entries]
            n = (b - a) // m
            assert weights.shape == (b - a, b - a + n)
            probs[a:b, base:base + n] = weights[:, b - a:]
            base += n
    return probs


def test_compressed_sparse_attention_trains_its_indexer_by_its_loss():
    """DeepSeek-V4's CSA indexer trained as DeepSeek sparse attention's is (index_loss): stats["index_loss"] is the mean over
    the queries of KL(p || softmax(I)) over each query's chosen entries, p the attention's probabilities of them summed over
    its heads (transformers' DeepseekV4Attention's attention weights, the sinks in their softmax) and renormalised, I the
    indexer's scores of them (fmoe.layers.index_scores against its own entries); a query that sees no entry adds 0. The
    output is the layer's without the loss; the loss's gradient reaches the indexer's weights alone (every one of them, its
    compressor's through its entries), not x nor the attention's; and descending it lowers it."""
    from fmoe.layers import compressed_choice, compressed_entries, index_scores

    v4, hf, layer, cfg, params = _dsv4_attention_layer("compressed_sparse_attention")
    x, cu = torch.randn(17, H).requires_grad_(), torch.tensor([0, 11, 17])
    train = dataclasses.replace(cfg, index_loss=True)
    ctx = _ctx(cu, cfg)
    y, stats = attention(x, params, train, ctx)
    with torch.no_grad():
        torch.testing.assert_close(y, attention(x, params, cfg, ctx)[0], rtol=0, atol=0)
        q_lat = layer.q_a_norm(layer.q_a_proj(x))  # transformers' normed q latent
        keys, keep = compressed_entries(x, params, cfg, ctx, prefix="index_compress_")
        slots = compressed_choice(x, q_lat, keys, params, cfg, ctx, keep)
        scores = index_scores(x, q_lat, keys, params, cfg, ctx.cos, ctx.sin, slots=slots)
    chosen = slots >= 0
    assert slots.shape == (17, 2) and 0 < int(chosen.sum()) < 34  # some queries see no entry, or one
    probs = _dsv4_entry_probs(v4, hf, layer, x.detach(), cu)
    target = torch.where(chosen, probs.gather(1, slots.clamp(min=0)), 0.0)
    want = 0.0
    for t in range(17):
        if chosen[t].any():
            p = target[t][chosen[t]] / target[t][chosen[t]].sum()
            want += float((p * (p.log() - scores[t][chosen[t]].log_softmax(0))).sum())
    loss = stats["index_loss"]
    assert loss.shape == () and loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(want / 17, rel=1e-4, abs=1e-7) and float(loss.detach()) > 1e-3
    loss.backward()
    assert x.grad is None
    trained = {n for n, t in params.items() if t.grad is not None}
    assert trained == {n for n in params if n.startswith("index_")}, trained
    assert all(float(params[n].grad.abs().max()) > 0 for n in trained)
    indexer = {n: t for n, t in params.items() if n.startswith("index_")}
    opt = torch.optim.Adam(list(indexer.values()), lr=3e-2)
    for _ in range(30):
        opt.zero_grad()
        attention(x, params, train, ctx)[1]["index_loss"].backward()
        opt.step()
    with torch.enable_grad():
        after = float(attention(x, params, train, ctx)[1]["index_loss"].detach())
    assert after < 0.5 * float(loss.detach()), (float(loss.detach()), after)


def test_compressed_sparse_entries_overlap_the_previous_run():
    """fmoe.layers.compressed_entries of compressed sparse attention written out: runs of 3 tokens of documents of 7 and 6
    tokens (runs 0-2, 3-5; 7-9, 10-12); a document's first entry is a softmax over its run's second halves alone, a later
    one over the previous run's first halves (with the bias's first half) and its own run's second halves (the bias's
    second half); the slots and what each query sees are heavily compressed attention's."""
    from fmoe.layers import compressed_entries

    cfg = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=4, kv_shared=True, compress_rate=3, compress_topk=2, q_rank=6, index_heads=2,
                          index_head_dim=4, impl="torch", rope=False)
    torch.manual_seed(0)
    p = {"compress_wkv": torch.randn(H, 8), "compress_wg": torch.randn(H, 8), "compress_bias": torch.randn(3, 8), "compress_norm": torch.rand(4) + 0.5}
    x, cu = torch.randn(13, H), torch.tensor([0, 7, 13])
    entries, keep = compressed_entries(x, p, cfg, _ctx(cu, cfg))
    assert entries.shape == (4, 4) and keep.shape == (13, 4)
    c, g = x @ p["compress_wkv"], x @ p["compress_wg"]
    for s, (first, prev) in enumerate(((0, None), (3, 0), (7, None), (10, 7))):
        run_c, run_g = c[first:first + 3, 4:], g[first:first + 3, 4:] + p["compress_bias"][:, 4:]
        if prev is not None:
            run_c = torch.cat([c[prev:prev + 3, :4], run_c])
            run_g = torch.cat([g[prev:prev + 3, :4] + p["compress_bias"][:, :4], run_g])
        e = (run_c * run_g.softmax(0)).sum(0)
        torch.testing.assert_close(entries[s], e * torch.rsqrt(e.square().mean() + cfg.norm_eps) * p["compress_norm"], rtol=1e-5, atol=1e-6)
    seen = {t: [s for s in range(4) if keep[t, s]] for t in range(13)}
    assert seen == {0: [], 1: [], 2: [0], 3: [0], 4: [0], 5: [0, 1], 6: [0, 1], 7: [], 8: [], 9: [2], 10: [2], 11: [2], 12: [2, 3]}


def test_compressed_sparse_entries_rotate_as_their_keys_and_the_indexer_s_as_its_queries():
    """Each entry rotated at its run's first position (0 and 3 in both documents of 7 and 6
    tokens): the compressor's as the keys are (the first rot_dim channels, in halves here),
    the indexer's (prefix "index_compress_") as the indexer's queries (index_rope_last: its
    last rot_dim channels, index_interleaved: on pairs), whatever the keys do."""
    from fmoe.layers import compressed_entries

    cfg = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=8, rot_dim=4, kv_shared=True, compress_rate=3, compress_topk=2, q_rank=6,
                          index_heads=2, index_head_dim=8, index_rope_last=True, index_interleaved=True, impl="torch")
    torch.manual_seed(0)
    p = {}
    for prefix in ("compress_", "index_compress_"):
        p.update({prefix + "wkv": torch.randn(H, 16), prefix + "wg": torch.randn(H, 16), prefix + "bias": torch.randn(3, 16),
                  prefix + "norm": torch.rand(8) + 0.5})
    x, cu = torch.randn(13, H), torch.tensor([0, 7, 13])
    ctx, plain = _ctx(cu, cfg), dataclasses.replace(cfg, rope=False)
    cos, sin = ctx.cos[[0, 3, 7, 10]], ctx.sin[[0, 3, 7, 10]]
    keys, indexer = compressed_entries(x, p, cfg, ctx)[0], compressed_entries(x, p, cfg, ctx, prefix="index_compress_")[0]
    raw_keys, raw_indexer = compressed_entries(x, p, plain, _ctx(cu, plain))[0], compressed_entries(x, p, plain, _ctx(cu, plain), prefix="index_compress_")[0]
    torch.testing.assert_close(keys, torch.cat([apply_rope(raw_keys[:, None, :4], cos, sin, impl="torch")[:, 0], raw_keys[:, 4:]], -1))
    torch.testing.assert_close(indexer, torch.cat([raw_indexer[:, :4], apply_rope(raw_indexer[:, None, 4:].contiguous(), cos, sin, interleaved=True,
                                                                                      impl="torch")[:, 0]], -1))
    assert float((keys[[1, 3]] - raw_keys[[1, 3]]).abs().max()) > 1e-2 and torch.equal(indexer[:, :4], raw_indexer[:, :4])


def test_compressed_sparse_attention_bad_knobs_and_contexts():
    """compress_topk's knobs by name (it needs compress_rate and the q latent, its indexer has no key norm and rotates as
    the keys do); its parameters' shapes; a context over gathered keys without the entries' cache (context parallel) is
    refused (not built)."""
    base = dict(n_heads=2, n_kv_heads=1, head_dim=8, kv_shared=True, compress_rate=3, compress_topk=2, q_rank=6, index_heads=2, index_head_dim=8,
                impl="torch")
    for overrides, message in ((dict(compress_rate=None), r"compress_topk: .* needs compress_rate"),
                               (dict(q_rank=None), r"compress_topk: compressed sparse attention's indexer reads the normed q latent, needs q_rank"),
                               (dict(compress_topk=0), r"compress_topk: expected >= 1, got 0"),
                               (dict(index_norm_eps=1e-5), r"index_norm_eps: a knob of DeepSeek sparse attention's indexer, needs index_topk"),
                               (dict(index_loss=1), r"index_loss: expected a bool, got 1"),
                               (dict(index_head_dim=4, rot_dim=6), r"index_head_dim: the indexer rotates rot_dim = 6 of its channels")):
        with pytest.raises(ValueError, match=message):
            AttentionConfig(**{**base, **overrides})
    from fmoe.layers import compress_shapes, gqa_q_shapes

    cfg = AttentionConfig(**base)
    assert compress_shapes(H, cfg) == {"compress_wkv": (H, 16), "compress_wg": (H, 16), "compress_bias": (3, 16), "compress_norm": (8,),
                                       "index_wq": (6, 16), "index_w": (H, 2), "index_compress_wkv": (H, 16), "index_compress_wg": (H, 16),
                                       "index_compress_bias": (3, 16), "index_compress_norm": (8,)}
    torch.manual_seed(0)
    p = {n: t for n, t in _params(cfg).items() if n not in ("wv", "wq")}
    p.update({n: torch.randn(*shape) for n, shape in {**compress_shapes(H, cfg), **gqa_q_shapes(H, cfg)}.items()}, q_a_norm=torch.ones(6))
    x, cu = torch.randn(9, H), torch.tensor([0, 9])
    ctx = _ctx(cu, cfg)
    assert attention(x, p, cfg, ctx)[0].shape == (9, H)
    with pytest.raises(ValueError, match=r"ctx: compressed attention \(cfg.compress_rate\) over gathered keys needs the entries' cache"):
        attention(x, p, cfg, dataclasses.replace(ctx, gather_kv=lambda k, v: (k, v)))


@pytest.mark.parametrize("kind", ["heavily_compressed_attention", "compressed_sparse_attention"])
def test_compressed_attention_over_a_context_split_is_the_whole_layer(kind):
    """Context parallel's form of DeepSeek-V4's compressed layers on one rank whose tokens come in a shuffled order (the
    split's token_index, its gathered rows' kv_index the same): the compressor's (and the indexer's) inputs gathered and
    put back in token order, the entries made at the runs' positions, each query's documents and positions its own. The
    outputs are the plain layer's rows in that order, and so are the gradients of every weight the plain layer trains."""
    v4, hf, layer, cfg, params = _dsv4_attention_layer(kind)
    x, cu = torch.randn(17, H), torch.tensor([0, 11, 17])
    y, _ = attention(x, params, cfg, _ctx(cu, cfg))
    y.square().sum().backward()
    grads = {n: t.grad.clone() for n, t in params.items() if t.grad is not None}
    for t in params.values():
        t.grad = None
    order = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    ctx = attention_context(cu, positions_from_cu_seqlens(cu)[order], cfg, token_index=order, kv_index=order, gather_kv=lambda k, v: (k, v))
    y_split, _ = attention(x[order], params, cfg, ctx)
    torch.testing.assert_close(y_split, y[order], rtol=1e-5, atol=1e-6)
    y_split.square().sum().backward()
    assert set(grads) == {n for n, t in params.items() if t.grad is not None}
    for n, g in grads.items():
        assert float((params[n].grad - g).abs().max()) < 1e-6 * float(g.abs().max()), n  # float32 sums in another order


def test_compressed_entries_are_the_documents_complete_runs():
    """fmoe.layers.compressed_entries written out: the runs of 3 tokens of documents of 7, 2 and 6 tokens (runs 0-2, 3-5;
    none; 9-11, 12-14), the tail tokens in none; 5 slots (T // 3), the last unused; each query sees its own document's runs
    that end at or before it. The entries are in x's dtype (bf16 tokens: bf16 entries)."""
    from fmoe.layers import compressed_entries

    cfg = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=8, kv_shared=True, compress_rate=3, impl="torch", rope=False)
    torch.manual_seed(0)
    p = {"compress_wkv": torch.randn(H, 8), "compress_wg": torch.randn(H, 8), "compress_bias": torch.randn(3, 8), "compress_norm": torch.rand(8) + 0.5}
    x, cu = torch.randn(15, H), torch.tensor([0, 7, 9, 15])
    entries, keep = compressed_entries(x, p, cfg, _ctx(cu, cfg))
    assert entries.shape == (5, 8) and keep.shape == (15, 5)
    for s, first in enumerate((0, 3, 9, 12)):
        run = x[first:first + 3]
        weights = (run @ p["compress_wg"] + p["compress_bias"]).softmax(0)
        e = (run @ p["compress_wkv"] * weights).sum(0)
        torch.testing.assert_close(entries[s], e * torch.rsqrt(e.square().mean() + cfg.norm_eps) * p["compress_norm"], rtol=1e-5, atol=1e-6)
    seen = {t: [s for s in range(5) if keep[t, s]] for t in range(15)}
    assert seen == {0: [], 1: [], 2: [0], 3: [0], 4: [0], 5: [0, 1], 6: [0, 1], 7: [], 8: [], 9: [], 10: [], 11: [2], 12: [2], 13: [2], 14: [2, 3]}
    low = {n: t if n == "compress_bias" else t.bfloat16() for n, t in p.items()}  # bf16 tokens and weights, the bias float32
    entries_bf16, keep_bf16 = compressed_entries(x.bfloat16(), low, cfg, _ctx(cu, cfg))
    assert entries_bf16.dtype == torch.bfloat16 and torch.equal(keep_bf16, keep)
    torch.testing.assert_close(entries_bf16[:4].float(), entries[:4], rtol=2e-2, atol=3e-2)


def test_heavily_compressed_attention_refuses_gathered_keys_and_a_flex_context():
    """Heavily compressed attention has no compressor state for decoding nor an exchange of entries under context parallel:
    a context with gather_kv is refused by name, as is one of FlexAttention's block masks (the entries ride the dense mask),
    and ALiBi's slopes."""
    from fmoe.layers import compress_shapes

    cfg = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=8, kv_shared=True, compress_rate=3, impl="torch")
    torch.manual_seed(0)
    p = {n: t for n, t in _params(cfg).items() if n != "wv"}
    p.update({n: torch.randn(*shape) for n, shape in compress_shapes(H, cfg).items()})
    x, cu = torch.randn(9, H), torch.tensor([0, 9])
    ctx = _ctx(cu, cfg)
    with pytest.raises(ValueError, match=r"ctx: compressed attention \(cfg.compress_rate\) over gathered keys needs the entries' cache \(decoding"):
        attention(x, p, cfg, dataclasses.replace(ctx, gather_kv=lambda k, v: (k, v)))
    with pytest.raises(ValueError, match=r"ctx: heavily compressed attention \(cfg.compress_rate\) needs the dense mask"):
        attention(x, p, cfg, _ctx(cu, dataclasses.replace(cfg, compress_rate=None, impl="flex")))
    with pytest.raises(ValueError, match=r"params\['alibi'\]: ALiBi's distances are the keys'"):
        attention(x, {**p, "alibi": torch.ones(2)}, cfg, ctx)
    with pytest.raises(ValueError, match=re.escape("params['compress_bias']: expected a float [3, 8] tensor (the compressor of cfg.compress_rate), got nothing")):
        attention(x, {n: t for n, t in p.items() if n != "compress_bias"}, cfg, ctx)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_on_the_last_channels_is_rope_on_the_first_of_the_channels_turned_around(interleaved):
    """rope_last (DeepSeek-V4's [nope | rope] heads) against the leading RoPE of the same heads with each head's channels
    reordered [last rot_dim | first head_dim - rot_dim]: wq and wk's columns, the k_norm weights, and with kv_shared (the
    output in the keys' channels) wo's rows reordered alike; outputs and gradients equal. Its knobs are checked."""
    base = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, rot_dim=6, interleaved=interleaved, qk_norm="head_k", kv_shared=True, impl="torch")
    last = dataclasses.replace(base, rope_last=True)
    order = torch.cat([torch.arange(10, 16), torch.arange(10)])  # each head's channels as the leading RoPE sees them

    def heads(t, n, dim):  # the head_dim-long runs of t's dim turned around
        return t.unflatten(dim, (n, 16)).index_select(dim + 1, order).flatten(dim, dim + 1)

    torch.manual_seed(0)
    p = {n: t for n, t in _params(base).items() if n != "wv"}
    p["k_norm"] = (torch.rand(16) + 0.5).requires_grad_()
    turned = {"wq": heads(p["wq"], 4, 1), "wk": heads(p["wk"], 2, 1), "k_norm": p["k_norm"][order], "wo": heads(p["wo"], 4, 0)}
    turned = {n: t.detach().requires_grad_() for n, t in turned.items()}
    x, cu = torch.randn(13, H), torch.tensor([0, 6, 13])
    y_last, _ = attention(x, p, last, _ctx(cu, last))
    y_first, _ = attention(x, turned, base, _ctx(cu, base))
    torch.testing.assert_close(y_last, y_first, rtol=1e-5, atol=1e-5)
    y_last.square().sum().backward()
    y_first.square().sum().backward()
    torch.testing.assert_close(heads(p["wq"].grad, 4, 1), turned["wq"].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p["k_norm"].grad[order], turned["k_norm"].grad, rtol=1e-4, atol=1e-5)
    # the leading RoPE of the same weights is another function
    assert (attention(x, p, base, _ctx(cu, base))[0] - y_last).abs().max() > 1e-3


@pytest.mark.parametrize("knobs, message", [
    (dict(rope_last=1), r"rope_last: expected a bool, got 1"),
    (dict(rope_last=True), r"rope_last: rotates the last rot_dim channels of each head, needs rot_dim < head_dim = 16, got rot_dim None"),
    (dict(rope_last=True, rot_dim=16), r"rope_last: .*got rot_dim 16"),
    # the local layers' own table under the same rule (it failed at the first forward)
    (dict(rope_last=True, rot_dim=8, local_rope_base=100.0, local_rot_dim=16),
     r"local_rot_dim: with rope_last the local layers turn the last 16 channels of each head, which needs fewer than their head_dim = 16"),
    (dict(rope_last=True, n_kv_heads=4, kv_rank=6, rot_dim=4), r"rope_last: .* not with kv_rank"),
    (dict(q_rank=0), r"q_rank: expected None or a positive int \(the q latent's width\), got 0"),
    (dict(q_rank=8, n_heads=4, moa_experts=3, moa_topk=2), r"q_rank: not with a mixture of attention heads"),
    (dict(q_rank=8, gate_on_q=True), r"gate_on_q: a knob of multi-latent attention's q latent, a bool, True needs q_rank and kv_rank"),
    (dict(qk_norm="head_q"), r"qk_norm: expected None, 'head', 'proj', 'rms', 'head_layer', 'layer' or 'head_k', got 'head_q'"),
    (dict(compress_rate=1, kv_shared=True, n_kv_heads=1), r"compress_rate: expected >= 2, got 1"),
    (dict(compress_rate=4), r"compress_rate: heavily compressed attention's entries are one shared key-value head's, needs kv_shared and n_kv_heads = 1"),
    (dict(compress_rate=4, kv_shared=True, n_kv_heads=1, impl="flex"), r"compress_rate: heavily compressed attention runs the dense reference"),
])
def test_deepseek_v4_attention_knobs_are_checked(knobs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **knobs)


def test_a_q_latent_and_head_k_norms_take_their_own_params():
    """Grouped-query attention with q_rank reads wq_a, q_a_norm, wq_b in place of wq (a wq is refused, a missing one
    named); qk_norm "head_k" takes k_norm alone (a q_norm is refused)."""
    _, _, _, cfg, params = _dsv4_attention_layer()
    x, cu = torch.randn(7, H), torch.tensor([0, 7])
    ctx = _ctx(cu, cfg)
    with pytest.raises(ValueError, match=re.escape("params['wq_b']: expected torch.float32 [12, 64], got nothing")):
        attention(x, {n: t for n, t in params.items() if n != "wq_b"}, cfg, ctx)
    with pytest.raises(ValueError, match=re.escape("params['q_a_norm']: expected a [12] norm weight, got nothing")):
        attention(x, {n: t for n, t in params.items() if n != "q_a_norm"}, cfg, ctx)
    with pytest.raises(ValueError, match=r"params: unknown attention parameters \['wq'\]"):
        attention(x, {**params, "wq": torch.randn(H, 64)}, cfg, ctx)
    with pytest.raises(ValueError, match=re.escape("params['q_norm']: expected none with cfg.qk_norm = 'head_k'")):
        attention(x, {**params, "q_norm": torch.ones(16)}, cfg, ctx)
    with pytest.raises(ValueError, match=re.escape("params['k_norm']: expected a weight with cfg.qk_norm = 'head_k'")):
        attention(x, {n: t for n, t in params.items() if n != "k_norm"}, cfg, ctx)


def F_sdpa(q_TND, k_TGD, v_TGD, mask, cfg):
    """Grouped-query attention of q [T, N, D] over k, v [T, G, D] under a bool mask [T, S] -> [T, N, D]."""
    r = q_TND.shape[1] // k_TGD.shape[1]
    k, v = (t.repeat_interleave(r, dim=1).transpose(0, 1) for t in (k_TGD, v_TGD))
    scores = q_TND.transpose(0, 1) @ k.transpose(1, 2) * softmax_scale(cfg)
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("knobs, message", [
    (dict(kv_shared=1), r"kv_shared: expected a bool, got 1"),
    (dict(kv_shared=True, k_eq_v=True), r"k_eq_v: not with kv_shared"),
    (dict(kv_shared=True, v_dim=8), r"v_dim: not with kv_shared"),
    (dict(kv_shared=True, v_norm=True), r"v_norm: not with kv_shared"),
    # the values times a constant: the cache, the compressed entries and the shared kernel read the keys unscaled (decoding 0.01-0.06 off)
    (dict(kv_shared=True, v_scale=0.7), r"v_scale: not with kv_shared"),
    (dict(kv_shared=True, n_kv_heads=4, kv_rank=6, rot_dim=4), r"kv_rank: not with kv_shared"),
    (dict(kv_shared=True, n_heads=4, moa_experts=3, moa_topk=2), r"moa_experts: not with kv_shared"),
])
def test_shared_key_value_heads_knobs_are_checked(knobs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **knobs)


def test_flex_attention_takes_a_new_softcap_in_the_same_process():
    """FlexAttention compiles its score_mod; a float cap captured there came back symbolic once a process had seen two
    caps (dynamo's automatic dynamic), which its kernel refused (the second call raised). The cap rides as a tensor: three
    caps in a row, each the SDPA reference's output."""
    torch.manual_seed(0)
    p = {n: t.detach() * (4 if n in ("wq", "wk") else 1) for n, t in _params(CFG).items()}  # scores past the caps
    x, cu = torch.randn(11, H), torch.tensor([0, 5, 11])
    for cap in (0.5, 1.7, 3.0):
        cfg = dataclasses.replace(CFG, score_softcap=cap)
        flex_cfg = dataclasses.replace(cfg, impl="flex")
        with torch.no_grad():
            want, _ = attention(x, p, cfg, _ctx(cu, cfg))
            got, _ = attention(x, p, flex_cfg, _ctx(cu, flex_cfg))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
