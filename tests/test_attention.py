"""fmoe.layers.attention: GQA over packed documents with RoPE / YaRN."""

import dataclasses
import math

import pytest
import torch

from fmoe.layers import AttentionConfig, AttentionContext, attention, attention_context, document_mask, rope_tables, softmax_scale
from fmoe.ops import apply_rope, positions_from_cu_seqlens, yarn_mscale

H = 32
CFG = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16)
YARN = dataclasses.replace(CFG, yarn_factor=4.0, yarn_original_max_positions=16, yarn_mscale=0.7, yarn_mscale_all_dim=1.0)


def _params(cfg, dtype=torch.float32, device="cpu"):
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = {"wq": (H, N * D), "wk": (H, G * D), "wv": (H, G * D), "wo": (N * D, H)}
    return {n: (torch.randn(*s, device=device) * s[0] ** -0.5).to(dtype).requires_grad_() for n, s in shapes.items()}


def _ctx(cu, cfg, positions=None):
    cu = torch.as_tensor(cu)
    if positions is None:
        positions = positions_from_cu_seqlens(cu)
    return attention_context(cu.to(positions.device), positions, cfg)


def _loop_attention(x, p, cfg, cu):
    """Token by token, head by head, each document on its own: the definition."""
    T, (N, G, D) = x.shape[0], (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    cos, sin = rope_tables(positions_from_cu_seqlens(cu), cfg)
    q = apply_rope((x @ p["wq"]).view(T, N, D), cos, sin, interleaved=cfg.interleaved, impl="torch")
    k = apply_rope((x @ p["wk"]).view(T, G, D), cos, sin, interleaved=cfg.interleaved, impl="torch")
    v = (x @ p["wv"]).view(T, G, D)
    rows = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        for t in range(a, b):
            heads = []
            for h in range(N):
                g = h // (N // G)
                weights = torch.softmax((k[a:t + 1, g] @ q[t, h]) * softmax_scale(cfg), dim=0)
                heads.append(weights @ v[a:t + 1, g])
            rows.append(torch.cat(heads))
    return torch.stack(rows) @ p["wo"]


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("impl", ["torch", "flex"])
@pytest.mark.parametrize("cfg", [CFG, YARN, dataclasses.replace(CFG, rot_dim=8, interleaved=True)], ids=["rope", "yarn", "partial-interleaved"])
def test_attention_matches_per_token_loop(cfg, impl):
    cu = torch.tensor([0, 5, 6, 17], dtype=torch.int32)
    x = torch.randn(17, H, requires_grad=True)
    p = _params(cfg)
    x_ref = x.detach().clone().requires_grad_()
    p_ref = {n: t.detach().clone().requires_grad_() for n, t in p.items()}
    y_ref = _loop_attention(x_ref, p_ref, cfg, cu)
    if impl == "flex":  # FlexAttention has no CPU backward: forward here, gradients in the gpu test
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


def test_attention_bad_inputs():
    p = _params(CFG)
    x, cu = torch.randn(6, H), torch.tensor([0, 6])
    ctx = _ctx(cu, CFG)
    with pytest.raises(ValueError, match="cfg.n_kv_heads"):
        attention(x, p, dataclasses.replace(CFG, n_kv_heads=3), ctx)
    with pytest.raises(ValueError, match=r"params\['wk'\]: expected torch.float32 \[32, 32\]"):
        attention(x, dict(p, wk=torch.randn(H, 16)), CFG, ctx)
    with pytest.raises(ValueError, match=r"ctx: RoPE tables of shape \(5, 8\) do not fit x's 6 tokens"):
        attention(x, p, CFG, _ctx(torch.tensor([0, 5]), CFG))
    with pytest.raises(ValueError, match="ctx: expected the AttentionContext"):
        attention(x, p, CFG, (ctx.cos, ctx.sin, ctx.mask))
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        attention(x[None], p, CFG, ctx)
    flex = dataclasses.replace(CFG, impl="flex")
    with pytest.raises(ValueError, match="cfg.impl: FlexAttention has no backward on CPU"):
        attention(x, p, flex, _ctx(cu, flex))
    # the context checks shapes (its values were checked where the batch was made)
    with pytest.raises(ValueError, match="cfg.rot_dim"):
        _ctx(cu, dataclasses.replace(CFG, rot_dim=7))
    with pytest.raises(ValueError, match="positions: expected a 1-D tensor"):
        attention_context(cu, torch.arange(6)[None], CFG)
    with pytest.raises(ValueError, match="cfg.impl: expected one of"):
        _ctx(cu, dataclasses.replace(CFG, impl="nope"))
    with pytest.raises(ValueError, match=r"mask: expected a \[6, 6\] bool tensor"):
        attention_context(cu, torch.arange(6), CFG, mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask: expected a BlockMask"):
        attention_context(cu, torch.arange(6), flex, mask=ctx.mask)


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


@pytest.mark.gpu
def test_gpu_flex_attention_matches_reference():
    cfg = AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128)
    Hg = 2048
    shapes = {"wq": (Hg, 16 * 128), "wk": (Hg, 4 * 128), "wv": (Hg, 4 * 128), "wo": (16 * 128, Hg)}
    p = {n: (torch.randn(*s, device="cuda") * s[0] ** -0.5).bfloat16() for n, s in shapes.items()}
    x = torch.randn(4096, Hg, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1000, 1001, 3000, 4096], device="cuda", dtype=torch.int32)
    p = {n: t.requires_grad_() for n, t in p.items()}
    upstream = torch.randn_like(x)
    flex, _ = attention(x, p, cfg, _ctx(cu, cfg))  # auto: compiled FlexAttention
    g_flex = torch.autograd.grad(flex, list(p.values()), upstream)
    ref_cfg = dataclasses.replace(cfg, impl="torch")
    ref, _ = attention(x, p, ref_cfg, _ctx(cu, ref_cfg))
    g_ref = torch.autograd.grad(ref, list(p.values()), upstream)
    assert _rel(flex, ref) < 2e-2
    for a, b in zip(g_flex, g_ref):
        assert _rel(a, b) < 3e-2
