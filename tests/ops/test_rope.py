"""RoPE and YaRN: the SPEC's worked numbers, a complex-number rotation, kernels vs reference."""

import math

import pytest
import torch

from fmoe.ops.checks import check_distinct_memory
from fmoe.ops.rope import (
    apply_rope,
    apply_rope_ref,
    llama3_inv_freq,
    longrope_inv_freq,
    longrope_scale,
    rope_cos_sin,
    rope_inv_freq,
    yarn_correction_range,
    yarn_cos_sin_scale,
    yarn_inv_freq,
    yarn_mscale,
    yarn_softmax_scale,
)


def _cos_sin(T, R, device="cpu", base=10000.0, offset=0):
    positions = torch.arange(offset, offset + T, device=device)
    return rope_cos_sin(positions, rope_inv_freq(R, base=base, device=device))


def _complex_rotation(x, cos_TF, sin_TF, interleaved):
    """x [..., T, H, D] with each pair (a, b) as a + ib times cos + i sin, in float64."""
    F = cos_TF.shape[1]
    R = 2 * F
    x64 = x.double()
    if interleaved:
        a, b = x64[..., 0:R:2], x64[..., 1:R:2]
    else:
        a, b = x64[..., :F], x64[..., F:R]
    z = torch.complex(a, b) * torch.complex(cos_TF.double(), sin_TF.double())[:, None, :]
    if interleaved:
        rot = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot, x64[..., R:]], dim=-1)


# ---------------------------------------------------------------------------- reference


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("lead,T,H,D,R", [((), 9, 2, 8, 8), ((2,), 5, 3, 12, 8), ((2, 3), 4, 1, 6, 2)], ids=str)
def test_reference_is_the_complex_rotation(lead, T, H, D, R, interleaved):
    x = torch.randn(*lead, T, H, D)
    cos, sin = _cos_sin(T, R, offset=3)
    expected = _complex_rotation(x, cos, sin, interleaved)
    torch.testing.assert_close(apply_rope_ref(x, cos, sin, interleaved).double(), expected, rtol=1e-6, atol=1e-6)


def test_reference_rotate_half_worked_example():
    # D = 4, one token at position 1, base 1: inv_freq = [1, 1], theta = 1 for both pairs;
    # pairs (0, 2) and (1, 3)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    cos, sin = rope_cos_sin(torch.tensor([1]), torch.ones(2))
    c, s = math.cos(1.0), math.sin(1.0)
    expected = torch.tensor([[[1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s]]])
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)
    # interleaved: pairs (0, 1) and (2, 3)
    expected = torch.tensor([[[1 * c - 2 * s, 2 * c + 1 * s, 3 * c - 4 * s, 4 * c + 3 * s]]])
    torch.testing.assert_close(apply_rope(x, cos, sin, interleaved=True), expected)


# ---------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,R", [(16, 16), (64, 64), (48, 32)], ids=str)
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("lead,T", [((), 1), ((), 7), ((), 33), ((2,), 7)], ids=str)
def test_triton_matches_reference(lead, T, H, D, R, interleaved, dtype, device):
    x = torch.randn(*lead, T, H, D, device=device).to(dtype)
    cos, sin = _cos_sin(T, R, device=device)
    x_tri = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    y_tri = apply_rope(x_tri, cos, sin, interleaved=interleaved, impl="triton")
    y_ref = apply_rope(x_ref, cos, sin, interleaved=interleaved, impl="torch")
    assert y_tri.dtype == dtype and y_tri.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(y_tri, y_ref, **tol)
    assert torch.equal(y_tri[..., R:], x[..., R:])  # the pass-through channels, bit for bit

    grad_y = torch.randn_like(y_ref)
    y_tri.backward(grad_y)
    y_ref.backward(grad_y)
    assert x_tri.grad.dtype == dtype
    torch.testing.assert_close(x_tri.grad, x_ref.grad, **tol)


@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_over_several_head_tiles_matches_reference(interleaved, device, monkeypatch):
    """Tiles of 32 elements: 3 heads of 16 channels split into head tiles of 2 (the grid's second
    axis past 0, which every shape above keeps at one tile), ragged in T and H."""
    import fmoe.ops.rope as rope_mod

    monkeypatch.setattr(rope_mod, "_TILE", 32)
    x = torch.randn(5, 3, 16, device=device)
    cos, sin = _cos_sin(5, 16, device=device)
    x_tri, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_tri = apply_rope(x_tri, cos, sin, interleaved=interleaved, impl="triton")
    y_ref = apply_rope(x_ref, cos, sin, interleaved=interleaved, impl="torch")
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-6)
    grad_y = torch.randn_like(y_ref)
    y_tri.backward(grad_y)
    y_ref.backward(grad_y)
    torch.testing.assert_close(x_tri.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_backward_is_the_inverse_rotation(impl, interleaved, device):
    x = torch.randn(2, 11, 3, 24, device=device, requires_grad=True)
    cos, sin = _cos_sin(11, 16, device=device)
    grad_y = torch.randn_like(x)
    apply_rope(x, cos, sin, interleaved=interleaved, impl=impl).backward(grad_y)
    inverse = apply_rope_ref(grad_y, cos, -sin, interleaved)
    torch.testing.assert_close(x.grad, inverse, rtol=1e-5, atol=1e-6)
    # and undoes the forward
    y = apply_rope(x.detach(), cos, sin, interleaved=interleaved, impl=impl)
    torch.testing.assert_close(apply_rope_ref(y, cos, -sin, interleaved), x.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rotation_preserves_norms(impl, interleaved, device):
    x = torch.randn(40, 4, 32, device=device)
    cos, sin = _cos_sin(40, 24, device=device, offset=1000)
    y = apply_rope(x, cos, sin, interleaved=interleaved, impl=impl)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # each pair keeps its own norm
    pairs = (lambda t: torch.stack([t[..., 0:24:2], t[..., 1:24:2]], -1)) if interleaved else (
        lambda t: torch.stack([t[..., :12], t[..., 12:24]], -1))
    torch.testing.assert_close(pairs(y).norm(dim=-1), pairs(x).norm(dim=-1))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_packed_positions_restart_per_document(impl, device):
    lengths = [5, 1, 9]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    inv_freq = rope_inv_freq(16, device=device)
    x = torch.randn(2, sum(lengths), 3, 20, device=device)
    packed = apply_rope(x, *rope_cos_sin(positions, inv_freq), impl=impl)
    start = 0
    for n in lengths:
        alone = apply_rope(x[:, start:start + n], *rope_cos_sin(torch.arange(n, device=device), inv_freq), impl=impl)
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=0)
        start += n
    # position 0 is the identity
    first = packed[:, :1]
    torch.testing.assert_close(first, x[:, :1])


def test_int32_and_int64_positions_agree():
    inv_freq = rope_inv_freq(8)
    p = torch.tensor([0, 3, 70000])
    for a, b in zip(rope_cos_sin(p, inv_freq), rope_cos_sin(p.int(), inv_freq)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_tokens(impl, device):
    x = torch.randn(0, 2, 8, device=device, requires_grad=True)
    cos, sin = _cos_sin(0, 8, device=device)
    y = apply_rope(x, cos, sin, impl=impl)
    assert y.shape == (0, 2, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape


# ---------------------------------------------------------------------------- in place


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_inplace_without_grad(impl, interleaved, device):
    x = torch.randn(2, 6, 3, 24, device=device, dtype=torch.bfloat16)
    cos, sin = _cos_sin(6, 16, device=device)
    expected = apply_rope(x, cos, sin, interleaved=interleaved, impl=impl)
    y = x.clone()
    ptr = y.data_ptr()
    out = apply_rope(y, cos, sin, interleaved=interleaved, inplace=True, impl=impl)
    assert out is y and y.data_ptr() == ptr
    assert torch.equal(y, expected)
    # a leaf that requires grad may be rotated in place while grad mode is off
    leaf = x.float().requires_grad_()
    with torch.no_grad():
        apply_rope(leaf, cos, sin, interleaved=interleaved, inplace=True, impl=impl)
    torch.testing.assert_close(leaf.detach(), expected.float(), rtol=1.6e-2, atol=1e-5)


def _qkv_step(w, x, cos, sin, Hq, Hk, D, inplace, impl):
    """q and k rotated inside the fused [T, (Hq + 2 Hk) D] projection (strided views)."""
    T = x.shape[0]
    qkv = x @ w
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D:].view(T, Hk, D)
    if inplace:
        apply_rope(q, cos, sin, inplace=True, impl=impl)
        apply_rope(k, cos, sin, inplace=True, impl=impl)
    else:
        q, k = apply_rope(q, cos, sin, impl=impl), apply_rope(k, cos, sin, impl=impl)
    scores = torch.einsum("thd,skd->hts", q[:, :Hk], k)
    return (scores.sum() + (v * q[:, :Hk]).sum()), qkv


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_inplace_on_a_fused_qkv_buffer_with_autograd(impl, device):
    T, Hq, Hk, D, C = 7, 4, 2, 16, 12
    x = torch.randn(T, C, device=device)
    w = torch.randn(C, (Hq + 2 * Hk) * D, device=device)
    cos, sin = _cos_sin(T, 8, device=device)
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    loss_in, qkv_in = _qkv_step(w1, x, cos, sin, Hq, Hk, D, True, impl)
    loss_out, qkv_out = _qkv_step(w2, x, cos, sin, Hq, Hk, D, False, impl)
    torch.testing.assert_close(loss_in, loss_out)
    # the buffer now holds rotated q and k and the untouched v
    rot_q = apply_rope_ref(qkv_out[:, : Hq * D].view(T, Hq, D), cos, sin).flatten(1)
    torch.testing.assert_close(qkv_in[:, : Hq * D], rot_q)
    assert torch.equal(qkv_in[:, (Hq + Hk) * D:], qkv_out[:, (Hq + Hk) * D:])
    loss_in.backward()
    loss_out.backward()
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_layout_without_a_rows_view(impl, device):
    # [B, T, H, D] transposed from [T, B, H, D]: B and T do not merge into one stride
    base = torch.randn(5, 2, 3, 16, device=device)
    x = base.transpose(0, 1)
    cos, sin = _cos_sin(5, 16, device=device)
    expected = apply_rope_ref(x, cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin, impl=impl), expected)
    apply_rope(x, cos, sin, inplace=True, impl=impl)
    torch.testing.assert_close(base.transpose(0, 1), expected)


def test_inplace_refuses_a_leaf_that_requires_grad(device):
    x = torch.randn(4, 2, 8, device=device, requires_grad=True)
    cos, sin = _cos_sin(4, 8, device=device)
    for impl in ("torch", "triton"):
        _raises("inplace: x is a leaf tensor that requires grad", apply_rope, x, cos, sin, inplace=True, impl=impl)


def test_inplace_refuses_elements_that_share_memory(device):
    """GQA keys expanded over the heads (stride 0), or rows overlapping through as_strided:
    an in-place rotation would rotate a shared element more than once (the kernel did so
    silently once the heads spanned more than one program, e.g. 600 heads); a ValueError
    names x on both paths. The views a fused qkv buffer gives (a slice, a step, a transpose)
    are rotated in place as before, and so is a buffer with gaps between its rows."""
    cos, sin = _cos_sin(5, 8, device=device)
    shared = [torch.randn(5, 1, 8, device=device).expand(5, 600, 8),
              torch.randn(5 * 8 + 3 * 8, device=device).as_strided((5, 3, 8), (8, 8, 1))]
    for impl in ("torch", "triton"):
        for x in shared:
            _raises("x: inplace=True overwrites each element with its rotation: elements of x share memory", apply_rope, x, cos, sin,
                    inplace=True, impl=impl)
        torch.testing.assert_close(apply_rope(shared[0], cos, sin, impl=impl), apply_rope(shared[0].contiguous(), cos, sin, impl=impl))
        buffer = torch.randn(5, 3, 24, device=device)
        views = [buffer[..., :8], buffer[..., ::3], buffer.transpose(0, 1).transpose(0, 1)[..., 8:16],
                 torch.randn(200, device=device).as_strided((5, 2, 8), (24, 9, 1))[:, :, :8]]
        for view in views:
            expected = apply_rope(view.contiguous(), cos, sin, impl="torch")
            assert apply_rope(view, cos, sin, inplace=True, impl=impl) is view
            torch.testing.assert_close(view, expected)


def test_distinct_memory_is_checked_element_by_element_past_the_simple_views():
    """Strides (3, 2) over a 2 x 2 tensor interleave its dims (offsets 0, 2, 3, 5: distinct)
    and pass; strides (1, 1) over a 3 x 2 tensor give offsets 0, 1, 1, 2, 2, 3 and are
    refused."""
    check_distinct_memory("y", torch.empty(8).as_strided((2, 2), (3, 2)), "why")
    check_distinct_memory("y", torch.empty(0).as_strided((0, 4), (0, 0)), "why")  # no element: nothing shared
    with pytest.raises(ValueError, match=r"y: why: elements of y share memory \(strides \(1, 1\), shape \(3, 2\)"):
        check_distinct_memory("y", torch.empty(8).as_strided((3, 2), (1, 1)), "why")
    # every small layout: refused exactly where two elements share an offset (equal strides, a stride 0, overlaps)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        shape = torch.randint(1, 4, (3,), generator=gen).tolist()
        strides = torch.randint(0, 7, (3,), generator=gen).tolist()
        y = torch.empty(200).as_strided(shape, strides)
        offsets = [i * strides[0] + j * strides[1] + k * strides[2] for i in range(shape[0]) for j in range(shape[1]) for k in range(shape[2])]
        if len(set(offsets)) == len(offsets):
            check_distinct_memory("y", y, "why")
        else:
            with pytest.raises(ValueError, match="y: why: elements of y share memory"):
                check_distinct_memory("y", y, "why")


def test_inplace_compiles_with_dynamic_token_counts():
    """apply_rope(inplace=True) under torch.compile(fullgraph=True, dynamic=True): the check
    that x's elements own their memory sorted symbolic strides, which the compiler cannot
    trace. One graph over three token counts, values and gradients equal to eager's."""
    from torch._dynamo.utils import counters

    def step(x, cos, sin):
        return apply_rope(x * 1.0, cos, sin, inplace=True, impl="torch")

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (5, 9, 14):
        cos, sin = _cos_sin(T, 8)
        x = torch.randn(T, 2, 8)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = compiled(a, cos, sin), step(b, cos, sin)
        torch.testing.assert_close(ya, yb)
        grad_y = torch.randn_like(ya)
        ya.backward(grad_y)
        yb.backward(grad_y)
        torch.testing.assert_close(a.grad, b.grad)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cos_and_sin_get_no_gradient(impl, inplace, device):
    """cos and sin that require grad are not differentiated on either path (their gradient
    stays None), and the in-place rotation's backward runs: x's gradient is the inverse
    rotation of the upstream one, as without them requiring grad."""
    cos, sin = _cos_sin(3, 4, device=device)
    cos.requires_grad_(), sin.requires_grad_()
    x = torch.randn(3, 2, 4, device=device, requires_grad=True)
    y = apply_rope(x * 1.0, cos, sin, inplace=inplace, impl=impl)  # x * 1.0: a non-leaf, as inplace asks
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    assert cos.grad is None and sin.grad is None
    torch.testing.assert_close(x.grad, apply_rope_ref(grad_y, cos.detach(), -sin.detach()))


# ---------------------------------------------------------------------------- frequencies, YaRN


def test_rope_inv_freq_and_cos_sin_values():
    torch.testing.assert_close(rope_inv_freq(4, base=100.0), torch.tensor([1.0, 0.1]))
    inv = rope_inv_freq(128, base=500000.0)
    assert inv.dtype == torch.float32 and inv.shape == (64,)
    expected = torch.tensor([500000.0 ** (-2 * j / 128) for j in range(64)], dtype=torch.float64)
    torch.testing.assert_close(inv, expected.float(), rtol=0, atol=0)  # rounded once from float64
    wide = torch.tensor([1e6 ** (-2 * j / 96) for j in range(48)], dtype=torch.float64)  # where float32 maths rounds 27 of them apart
    assert torch.equal(rope_inv_freq(96, base=1e6), wide.float())
    positions = torch.tensor([0, 1, 2, 0, 5])
    cos, sin = rope_cos_sin(positions, torch.tensor([1.0, 0.5]), scale=2.0)
    assert cos.shape == sin.shape == (5, 2) and cos.dtype == sin.dtype == torch.float32
    angles = positions[:, None].double() * torch.tensor([1.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(cos, 2 * torch.cos(angles).float())
    torch.testing.assert_close(sin, 2 * torch.sin(angles).float())


def test_yarn_deepseek_v3_numbers():
    dsv3 = dict(base=10000.0, original_max_positions=4096)
    assert yarn_correction_range(64, **dsv3) == (10, 23)
    assert yarn_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1) == pytest.approx(1.368888, abs=1e-6)
    assert yarn_mscale(40, 1.0) ** 2 == pytest.approx(1.87385, abs=1e-5)
    assert yarn_softmax_scale(192, factor=40, mscale_all_dim=1.0) == pytest.approx(0.135234, abs=1e-6)
    assert yarn_softmax_scale(192, factor=40, mscale_all_dim=1.0) == pytest.approx(1.87385 / math.sqrt(192), rel=1e-5)
    assert yarn_cos_sin_scale(40, mscale=1.0, mscale_all_dim=1.0) == 1.0

    # inv_freq, pair by pair: kept below low = 10, divided by 40 from high = 23, a linear
    # blend between
    inv = yarn_inv_freq(64, factor=40, **dsv3)
    for j in range(32):
        base_j = 10000.0 ** (-2 * j / 64)
        ramp = min(max((j - 10) / (23 - 10), 0.0), 1.0)
        assert inv[j].item() == pytest.approx(base_j / 40 * ramp + base_j * (1 - ramp), rel=1e-6)
    assert torch.equal(inv[:11], rope_inv_freq(64)[:11])
    torch.testing.assert_close(inv[23:], rope_inv_freq(64)[23:] / 40)


def test_llama3_scaling_numbers():
    """Llama 3.1's (D 128, base 5e5, factor 8, a 1, b 4, L 8192): wavelengths 2 pi base^(2j/D)
    under L / b = 2048 kept (j <= 28), over L / a = 8192 divided by 8 (j >= 35), a blend by
    (L / wavelength - a) / (b - a) between."""
    llama31 = dict(base=500000.0, factor=8.0, original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    inv, base_F = llama3_inv_freq(128, **llama31), rope_inv_freq(128, base=500000.0)
    assert torch.equal(inv[:29], base_F[:29])
    torch.testing.assert_close(inv[35:], base_F[35:] / 8, rtol=1e-7, atol=0)
    for j in range(29, 35):
        base_j = 500000.0 ** (-2 * j / 128)
        smooth = (8192 * base_j / (2 * math.pi) - 1) / (4 - 1)
        assert 0 < smooth < 1 and inv[j].item() == pytest.approx((1 - smooth) * base_j / 8 + smooth * base_j, rel=1e-6)
    assert [round(float(b / i), 4) for b, i in zip(base_F[29:35], inv[29:35])] == [1.2075, 1.5534, 2.0263, 2.6945, 3.6843, 5.2573]
    _raises("high_freq_factor: expected at least low_freq_factor = 5", llama3_inv_freq, 8, **dict(llama31, low_freq_factor=5.0))
    # Llama 4 Scout's (factor 16, a = b = 1): a step at wavelength L, no blend; as transformers computes it
    scout = dict(llama31, factor=16.0, high_freq_factor=1.0)
    inv = llama3_inv_freq(128, **scout)
    wavelen = 2 * math.pi / base_F.double()
    assert int((wavelen <= 8192).sum()) == 35 and torch.equal(inv[:35], base_F[:35])
    torch.testing.assert_close(inv[35:], base_F[35:] / 16, rtol=1e-7, atol=0)
    _raises("factor: expected a finite number > 0", llama3_inv_freq, 8, **dict(llama31, factor=0.0))
    _raises("original_max_positions", llama3_inv_freq, 8, **dict(llama31, original_max_positions=0))


def test_longrope_numbers():
    """LongRoPE divides frequency j by its own factor f_j; its cos/sin scale is
    sqrt(1 + ln s / ln L) (Phi-3.5-mini's L 4096, s 32: 1.19024), 1 where s <= 1."""
    factors = [1.0, 2.0, 4.0, 8.0]
    inv, base_F = longrope_inv_freq(8, base=10000.0, factors=factors), rope_inv_freq(8)
    torch.testing.assert_close(inv, base_F / torch.tensor(factors), rtol=1e-7, atol=0)
    assert inv.dtype == torch.float32 and inv[3].item() == pytest.approx(10000.0 ** (-6 / 8) / 8, rel=1e-7)
    assert torch.equal(longrope_inv_freq(8, base=10000.0, factors=(1, 1, 1, 1)), base_F)
    assert torch.equal(longrope_inv_freq(8, base=10000.0, factors=torch.tensor(factors)), inv)  # a tensor as its list
    assert longrope_scale(131072, 4096) == pytest.approx(1.19024, abs=1e-5)
    assert longrope_scale(4096, 4096) == longrope_scale(100, 4096) == 1.0
    _raises(r"factors: expected 4 numbers \(one per frequency of dim = 8\)", longrope_inv_freq, 8, base=1e4, factors=[1.0] * 3)
    _raises("factors: expected 4 numbers", longrope_inv_freq, 8, base=1e4, factors="abcd")
    _raises(r"factors\[2\]: expected a finite number > 0, got 0.0", longrope_inv_freq, 8, base=1e4, factors=[1.0, 1.0, 0.0, 1.0])
    _raises(r"factors\[0\]: expected a finite number > 0", longrope_inv_freq, 8, base=1e4, factors=[math.inf, 1.0, 1.0, 1.0])
    _raises("base: expected a finite number > 1", longrope_inv_freq, 8, base=1.0, factors=factors)
    _raises("original_max_positions: expected >= 2", longrope_scale, 8, 1)
    _raises("max_positions: expected an int", longrope_scale, 8.0, 4)


def test_yarn_softmax_scale_uses_mscale_all_dim_not_mscale():
    s, d = 40.0, 192
    mscale, mscale_all_dim = 0.707, 1.0  # different on purpose
    scale = yarn_softmax_scale(d, factor=s, mscale_all_dim=mscale_all_dim)
    assert scale == pytest.approx((0.1 * mscale_all_dim * math.log(s) + 1) ** 2 / math.sqrt(d), rel=1e-12)
    assert scale != pytest.approx((0.1 * mscale * math.log(s) + 1) ** 2 / math.sqrt(d), rel=1e-3)
    assert yarn_softmax_scale(d, factor=s, mscale_all_dim=mscale) != pytest.approx(scale, rel=1e-3)
    # the cos/sin scale is the ratio of the two
    ratio = (0.1 * mscale * math.log(s) + 1) / (0.1 * mscale_all_dim * math.log(s) + 1)
    assert yarn_cos_sin_scale(s, mscale=mscale, mscale_all_dim=mscale_all_dim) == pytest.approx(ratio, rel=1e-12)
    # plain YaRN (all of the concentration on cos/sin)
    assert yarn_cos_sin_scale(s, mscale=1.0, mscale_all_dim=0.0) == pytest.approx(0.1 * math.log(s) + 1)


def test_yarn_without_extension():
    for factor in (1.0, 0.5):
        assert yarn_mscale(factor, 1.0) == 1.0 and yarn_mscale(factor, 3.0) == 1.0
        assert yarn_softmax_scale(128, factor=factor, mscale_all_dim=1.0) == pytest.approx(1 / math.sqrt(128))
        assert yarn_cos_sin_scale(factor, mscale=2.0, mscale_all_dim=1.0) == 1.0
    inv = yarn_inv_freq(128, base=500000.0, factor=1.0, original_max_positions=8192)
    torch.testing.assert_close(inv, rope_inv_freq(128, base=500000.0), rtol=1e-7, atol=0)


def test_yarn_correction_range_bounds():
    # low clamps at 0 (a short original context: d(beta_fast) < 0); high clamps at D - 1
    assert yarn_correction_range(64, base=10000.0, original_max_positions=8) == (0, 1)
    assert yarn_correction_range(16, base=10.0, original_max_positions=1000) == (5, 15)
    # low == high gets a 0.001-wide ramp: d(1) = 2 ln(4 / 2 pi) / (2 ln 1e4) = -0.049 -> 0
    assert yarn_correction_range(2, base=10000.0, original_max_positions=4) == (0, 0.001)
    inv = yarn_inv_freq(2, base=10000.0, factor=4.0, original_max_positions=4)
    assert inv.tolist() == [1.0]  # j = 0 sits at low: ramp 0, frequency kept


def test_yarn_correction_range_can_put_high_below_low():
    """Each bound is clamped on one side only (SPEC.md section 4), so high can fall below low.
    D 64, base 1e4, L 1: d(1) = 64 ln(1 / 2 pi) / (2 ln 1e4) = -6.39 -> -6 < 0 = low, and the
    ramp (j - 0) / (-6 - 0) clamps to 0: every frequency kept. D 4, base 2, L 1e6: d(32) =
    24.56 -> 24 > 3 = high, and the ramp (j - 24) / (3 - 24) >= 1: every frequency divided."""
    def d(dim, base, L, r):
        return dim * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))

    assert round(d(64, 1e4, 1, 1), 2) == -6.39 and round(d(4, 2.0, 10**6, 32), 2) == 24.56
    assert yarn_correction_range(64, base=1e4, original_max_positions=1) == (0, -6)
    low, high = yarn_correction_range(64, base=1e4, original_max_positions=1, truncate=False)
    assert low == 0 and high == pytest.approx(d(64, 1e4, 1, 1))
    assert yarn_correction_range(4, base=2.0, original_max_positions=10**6) == (24, 3)
    for truncate in (True, False):
        short = yarn_inv_freq(64, base=1e4, factor=8.0, original_max_positions=1, truncate=truncate)
        assert torch.equal(short, rope_inv_freq(64, base=1e4))  # ramp 0: none interpolated
        long = yarn_inv_freq(4, base=2.0, factor=8.0, original_max_positions=10**6, truncate=truncate)
        torch.testing.assert_close(long, rope_inv_freq(4, base=2.0) / 8, rtol=1e-7, atol=0)  # ramp 1: all


def test_yarn_with_equal_betas_is_a_step():
    """beta_fast == beta_slow (Kimi K2's 1 and 1: D 64, base 50000, L 4096): low and high are
    d(1) = 19.16 rounded down and up, so frequencies j <= 19 are kept and j >= 20 divided by
    the factor; without truncation the ramp is 0.001 wide at d(1) itself."""
    d1 = 64 * math.log(4096 / (2 * math.pi)) / (2 * math.log(50000.0))
    assert round(d1, 2) == 19.16
    assert yarn_correction_range(64, base=50000.0, original_max_positions=4096, beta_fast=1.0, beta_slow=1.0) == (19, 20)
    low, high = yarn_correction_range(64, base=50000.0, original_max_positions=4096, beta_fast=1.0, beta_slow=1.0, truncate=False)
    assert low == pytest.approx(d1) and high == pytest.approx(d1 + 0.001)
    inv = yarn_inv_freq(64, base=50000.0, factor=32.0, original_max_positions=4096, beta_fast=1.0, beta_slow=1.0)
    base = rope_inv_freq(64, base=50000.0)
    assert torch.equal(inv[:20], base[:20])
    torch.testing.assert_close(inv[20:], base[20:] / 32, rtol=1e-7, atol=0)


def test_yarn_without_truncation():
    """gpt-oss (truncate: false): the fractional bounds d(beta_fast), d(beta_slow), low clamped
    at 0 and high at D - 1 all the same; gpt-oss's own (D 64, base 150000, L 4096): (8.09, 17.40)."""
    def d(dim, base, L, r):
        return dim * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = yarn_correction_range(64, base=150000.0, original_max_positions=4096, truncate=False)
    assert (low, high) == (pytest.approx(d(64, 150000.0, 4096, 32)), pytest.approx(d(64, 150000.0, 4096, 1)))
    assert (round(low, 2), round(high, 2)) == (8.09, 17.40)
    assert yarn_correction_range(64, base=150000.0, original_max_positions=4096) == (8, 18)
    assert yarn_correction_range(64, base=10000.0, original_max_positions=8, truncate=False)[0] == 0  # clamped
    assert yarn_correction_range(16, base=10.0, original_max_positions=1000, truncate=False)[1] == 15
    fractional = yarn_inv_freq(64, base=150000.0, factor=32.0, original_max_positions=4096, truncate=False)
    whole = yarn_inv_freq(64, base=150000.0, factor=32.0, original_max_positions=4096)
    j = torch.arange(32, dtype=torch.float64)
    base_F = 150000.0 ** (-2 * j / 64)
    ramp = ((j - low) / (high - low)).clamp(0, 1)
    torch.testing.assert_close(fractional, (base_F / 32 * ramp + base_F * (1 - ramp)).float(), rtol=1e-7, atol=0)
    assert not torch.equal(fractional, whole)
    _raises("truncate: expected a bool", yarn_correction_range, 8, base=1e4, original_max_positions=64, truncate="no")


# ---------------------------------------------------------------------------- validation


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_bad_inputs():
    yarn = dict(base=10000.0, factor=4.0, original_max_positions=4096)
    for fn, kw in ((rope_inv_freq, {}), (yarn_inv_freq, yarn)):
        _raises("dim: expected an even number", fn, 7, **kw)
        _raises(r"dim: expected >= 2, got 0", fn, 0, **kw)
        _raises("dim: expected an int", fn, 8.0, **kw)
        _raises(r"base: expected a finite number > 1", fn, 8, **{**kw, "base": 1.0})
    _raises(r"factor: expected a finite number > 0", yarn_inv_freq, 8, **{**yarn, "factor": 0.0})
    _raises(r"factor: expected a finite number > 0", yarn_inv_freq, 8, **{**yarn, "factor": -2.0})
    _raises(r"original_max_positions: expected >= 1, got 0", yarn_inv_freq, 8, **{**yarn, "original_max_positions": 0})
    _raises("beta_fast: expected at least beta_slow = 2, got 1", yarn_inv_freq, 8, **yarn, beta_fast=1.0, beta_slow=2.0)
    _raises(r"beta_slow: expected a finite number > 0", yarn_correction_range, 8, base=1e4, original_max_positions=64, beta_slow=0.0)
    _raises(r"factor: expected a finite number > 0", yarn_mscale, 0.0)
    _raises("mscale: expected a finite number", yarn_mscale, 2.0, float("nan"))
    _raises("^mscale_all_dim: expected a finite number, got '1'", yarn_softmax_scale, 64, factor=4.0, mscale_all_dim="1")
    _raises("^mscale_all_dim: expected a finite number, got nan", yarn_cos_sin_scale, 4.0, mscale=1.0, mscale_all_dim=math.nan)
    _raises("^mscale: expected a finite number, got inf", yarn_cos_sin_scale, 4.0, mscale=math.inf, mscale_all_dim=1.0)
    _raises(r"head_dim: expected >= 1", yarn_softmax_scale, 0, factor=2.0, mscale_all_dim=1.0)

    inv = rope_inv_freq(8)
    _raises("positions: expected a 1-D int32/int64 tensor", rope_cos_sin, torch.arange(4.0), inv)
    _raises("positions: expected a 1-D int32/int64 tensor", rope_cos_sin, torch.zeros(2, 3, dtype=torch.long), inv)
    _raises("inv_freq: expected a 1-D float tensor", rope_cos_sin, torch.arange(4), torch.arange(4))
    _raises("inv_freq: expected a 1-D float tensor", rope_cos_sin, torch.arange(4), inv[None])
    _raises(r"scale: expected a finite number > 0", rope_cos_sin, torch.arange(4), inv, scale=0.0)

    x = torch.randn(5, 2, 8)
    cos, sin = _cos_sin(5, 8)
    _raises(r"x: expected a float32/bfloat16/float16 tensor \[..., T, heads, head_dim\]", apply_rope, torch.randn(5, 8), cos, sin)
    _raises("x: expected a float32/bfloat16/float16 tensor", apply_rope, x.double(), cos, sin)
    _raises("x: expected a float32/bfloat16/float16 tensor", apply_rope, x.long(), cos, sin)
    _raises(r"cos: expected \[T, rot_dim/2\] with T = x.shape\[-3\] = 5", apply_rope, x, cos[:4], sin[:4])
    _raises(r"cos: expected \[T, rot_dim/2\] with T = x.shape\[-3\] = 5", apply_rope, x, cos[None], sin[None])
    _raises(r"sin: expected \[T, rot_dim/2\] with T = x.shape\[-3\] = 5", apply_rope, x, cos, sin[:3])
    _raises(r"sin: expected cos's shape \(5, 4\), got \(5, 2\)", apply_rope, x, cos, sin[:, :2])
    _raises("cos: expected dtype", apply_rope, x, cos.double(), sin)
    c16, s16 = _cos_sin(5, 16)
    _raises(r"cos: rot_dim = 2 \* cos.shape\[-1\] = 16 exceeds head_dim = x.shape\[-1\] = 8", apply_rope, x, c16, s16)
    for impl in ("torch", "triton"):  # the smallest misfits on each path: one pair past head_dim, one position more than T
        c10, s10 = _cos_sin(5, 10)
        _raises(r"cos: rot_dim = 2 \* cos.shape\[-1\] = 10 exceeds head_dim = x.shape\[-1\] = 8", apply_rope, x, c10, s10, impl=impl)
        c6, s6 = _cos_sin(6, 8)
        _raises(r"cos: expected \[T, rot_dim/2\] with T = x.shape\[-3\] = 5 and rot_dim/2 >= 1, got shape \(6, 4\)", apply_rope, x, c6, s6,
                impl=impl)
    _raises("inv_freq: expected positions' device cpu, got meta", rope_cos_sin, torch.arange(3), rope_inv_freq(4, device="meta"))
    _raises("interleaved: expected a bool", apply_rope, x, cos, sin, interleaved=1)
    _raises("inplace: expected a bool", apply_rope, x, cos, sin, inplace="yes")
    _raises("impl: expected one of", apply_rope, x, cos, sin, impl="cuda")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = _cos_sin(3, 4)
    _raises("impl='triton' needs CUDA tensors", apply_rope, torch.randn(3, 1, 4), cos, sin, impl="triton")


# ---------------------------------------------------------------------------- torch.library, compile


def test_custom_ops_pass_opcheck(device):
    cos, sin = _cos_sin(7, 12, device=device)
    for interleaved in (False, True):
        for inverse in (False, True):
            x = torch.randn(2, 7, 3, 16, device=device, requires_grad=True)
            torch.library.opcheck(torch.ops.fmoe.rope.default, (x, cos, sin, interleaved, inverse))
            torch.library.opcheck(torch.ops.fmoe.rope_.default, (x.detach().clone(), cos, sin, interleaved, inverse))
    strided = torch.randn(7, 3, 40, device=device)[..., 4:20]  # unit channel stride, not contiguous
    torch.library.opcheck(torch.ops.fmoe.rope.default, (strided, cos, sin, False, False))


def test_compiles_without_graph_breaks(device):
    """Out of place and in place (under the compiler the rotated copy written back: torch
    compiles the in-place autograd.Function into wrong gradients), against eager: x a
    non-leaf made inside the compiled region, and one made before it (its gradient came
    back unrotated)."""

    def step(q, k, cos, sin):
        q = apply_rope(q, cos, sin, impl="triton")
        k = apply_rope(k, cos, sin, interleaved=True, impl="triton")
        return (q[:, :2] * k).sum() + q.square().sum()

    def step_inplace(qk, cos, sin):
        qk = qk * 1.0  # a non-leaf buffer: its q and k are rotated where they lie
        apply_rope(qk[:, :4], cos, sin, inplace=True, impl="triton")
        return (qk * qk.detach().flip(-1)).sum()

    T = 9
    cos, sin = _cos_sin(T, 12, device=device)
    q, k = torch.randn(T, 4, 16, device=device), torch.randn(T, 2, 16, device=device)
    q1, k1, q2, k2 = (t.clone().requires_grad_() for t in (q, k, q, k))
    torch.compile(step, backend="aot_eager", fullgraph=True)(q1, k1, cos, sin).backward()
    step(q2, k2, cos, sin).backward()
    torch.testing.assert_close(q1.grad, q2.grad)
    torch.testing.assert_close(k1.grad, k2.grad)

    qk = torch.randn(T, 6, 16, device=device)
    a, b = qk.clone().requires_grad_(), qk.clone().requires_grad_()
    out_c = torch.compile(step_inplace, backend="aot_eager", fullgraph=True)(a, cos, sin)
    out_e = step_inplace(b, cos, sin)
    torch.testing.assert_close(out_c, out_e)
    out_c.backward()
    out_e.backward()
    torch.testing.assert_close(a.grad, b.grad)

    def rotate_inplace(qk, cos, sin):  # qk made before the compiled region: a non-leaf input of it
        return apply_rope(qk[:, :4], cos, sin, inplace=True, impl="triton")

    grad_y = torch.randn(T, 4, 16, device=device)
    grads = []
    for fn in (torch.compile(rotate_inplace, backend="aot_eager", fullgraph=True), rotate_inplace):
        leaf = qk.clone().requires_grad_()
        (fn(leaf * 1.0, cos, sin) * grad_y).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert not torch.allclose(grads[1][:, :4], grad_y)  # the rotation's backward counts


# ---------------------------------------------------------------------------- GPU, real shape


@pytest.mark.gpu
def test_gpu_real_shape():
    T, H, D = 16384, 32, 128
    positions = torch.cat([torch.arange(10000), torch.arange(T - 10000)]).cuda()
    inv_freq = yarn_inv_freq(D, base=10000.0, factor=40.0, original_max_positions=4096, device="cuda")
    cos, sin = rope_cos_sin(positions, inv_freq, scale=yarn_cos_sin_scale(40.0, mscale=0.707))
    x = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    for interleaved in (False, True):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1 = apply_rope(x1, cos, sin, interleaved=interleaved)  # auto: Triton on CUDA
        y2 = apply_rope(x2, cos, sin, interleaved=interleaved, impl="torch")
        torch.testing.assert_close(y1, y2, rtol=1.6e-2, atol=1e-5)
        y1.backward(grad_y)
        y2.backward(grad_y)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1.6e-2, atol=1e-5)
        y3 = x.clone()
        apply_rope(y3, cos, sin, interleaved=interleaved, inplace=True)
        assert torch.equal(y3, y1)


@pytest.mark.gpu
def test_gpu_a_head_major_view_past_int32():
    """A head-major view [T, H, D] of a [H, T, D] buffer (an HF-style q transposed, B = 1) at
    128k tokens, 128 heads of 192: head h starts h T D elements in, past 2**31 from head 86
    on. Each head's rotation is the torch path's on a contiguous copy of the last tokens.
    Its offsets were int32 (heads x stride): heads 86-127 were read from other memory."""
    T, H, D = 131072, 128, 192
    x = torch.randn(H, T, D, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    cos, sin = rope_cos_sin(torch.arange(T, device="cuda"), rope_inv_freq(D, base=10000.0, device="cuda"))
    last = slice(T - 3, T)
    want = apply_rope(x[last].contiguous(), cos[last], sin[last], impl="torch")
    got = apply_rope(x, cos, sin)[last].clone()  # auto: Triton on CUDA
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
    apply_rope(x, cos, sin, inplace=True)
    assert torch.equal(x[last], got)


def test_yarn_scales_compile_with_symbolic_floats():
    """torch.compile(dynamic=True) makes the Python floats of a compiled function symbolic: the finiteness checks of
    yarn_cos_sin_scale (its mscale) and of an attention's config (temperature_scale, built with each context) called
    math.isfinite on them, a graph break (fullgraph=True: an error, in every YaRN model without attn_scale)."""
    from fmoe.layers import AttentionConfig

    def step(x, pos, factor):
        scale = yarn_cos_sin_scale(factor, mscale=1.0, mscale_all_dim=0.0)
        cfg = AttentionConfig(n_heads=2, n_kv_heads=2, head_dim=4, temperature_scale=factor / 8)
        return apply_rope(x, *rope_cos_sin(pos, rope_inv_freq(4), scale=scale), impl="torch") * cfg.temperature_scale

    x, pos = torch.randn(5, 2, 4), torch.arange(5)
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    for factor in (4.0, 8.0):
        torch.testing.assert_close(compiled(x, pos, factor), step(x, pos, factor))
    for bad in (float("nan"), float("inf")):  # still refused, eager or compiled
        with pytest.raises(ValueError, match="mscale: expected a finite number"):
            yarn_cos_sin_scale(4.0, mscale=bad)
        with pytest.raises(ValueError, match="temperature_scale: expected a finite number"):
            AttentionConfig(n_heads=2, n_kv_heads=2, head_dim=4, temperature_scale=bad)
