"""clip_grad_norm and Float32GradAccumulator."""

import pytest
import torch

from fmoe.optim.grads import Float32GradAccumulator, clip_grad_norm


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


# ---------------------------------------------------------------------------- clipping


def _params_with_grads(dtype=torch.float32):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in [(3, 4), (5,), (2, 2)]]
    params[0].grad = torch.randn(3, 4).to(dtype)
    params[1].grad = torch.randn(5).to(dtype)  # params[2] has no grad
    return params


@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_norm_clips_and_returns_pre_clip_norm(foreach):
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params[:2]]
    expected = torch.cat([g.flatten() for g in grads]).norm()
    norm = clip_grad_norm(params, 0.5, foreach=foreach)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    torch.testing.assert_close(norm, expected)
    scale = 0.5 / (float(expected) + 1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * scale)
    assert params[2].grad is None
    torch.testing.assert_close(clip_grad_norm(params, 0.5), torch.tensor(0.5), rtol=1e-5, atol=0)


def test_clip_grad_norm_below_max_leaves_grads():
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params[:2]]
    norm = clip_grad_norm(iter(params), 1e3)  # a generator works too
    assert float(norm) < 1e3
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


def test_clip_grad_norm_inf_bf16_and_no_grads():
    params = _params_with_grads(torch.bfloat16)
    expected = max(float(p.grad.float().abs().max()) for p in params[:2])
    norm = clip_grad_norm(params, 1e3, norm_type=float("inf"))
    assert norm.dtype == torch.float32 and float(norm) == expected
    bare = [torch.nn.Parameter(torch.ones(3))]
    norm = clip_grad_norm(bare, 1.0)
    assert norm.dtype == torch.float32 and float(norm) == 0.0 and bare[0].grad is None


def test_clip_grad_norm_bad_max_norm():
    params = _params_with_grads()
    _raises("max_norm: expected a positive number", clip_grad_norm, params, 0.0)
    _raises("max_norm:", clip_grad_norm, params, -1.0)
    _raises("max_norm:", clip_grad_norm, params, float("nan"))


# ---------------------------------------------------------------------------- float32 accumulation


class Toy(torch.nn.Module):
    """A router and an expert, each a vector whose gradient is exactly what is fed in."""

    def __init__(self, n=256, dtype=torch.bfloat16):
        super().__init__()
        self.router = torch.nn.Linear(n, 1, bias=False, dtype=dtype)
        self.expert = torch.nn.Linear(n, 1, bias=False, dtype=dtype)
        self.router_unused = torch.nn.Parameter(torch.zeros(2, dtype=dtype))

    def forward(self, g_router, g_expert):
        # d/dw of w . g is g: each micro-batch's gradient is a bf16 tensor known exactly
        return self.router(g_router).sum() + self.expert(g_expert).sum()


def _micro_batches(count=512, n=256):
    torch.manual_seed(1)
    # small positive gradients: their bf16 running sum soon stops growing (8-bit mantissa)
    return [((1e-3 * (1 + 0.5 * torch.rand(n))).bfloat16(), torch.randn(n).bfloat16()) for _ in range(count)]


def test_float32_accumulation_beats_bf16():
    batches = _micro_batches()
    plain, model = Toy(), Toy()
    model.load_state_dict(plain.state_dict())
    acc = Float32GradAccumulator(model, patterns=("router",))
    assert sorted(acc.params) == ["router.weight", "router_unused"]
    for g_router, g_expert in batches:
        plain(g_router, g_expert).backward()
        model(g_router, g_expert).backward()
    exact = torch.stack([g.double() for g, _ in batches]).sum(0)

    assert model.router.weight.grad is None  # the hook took every micro-batch's grad
    main = acc.main_grads["router.weight"]
    assert main.dtype == torch.float32 and main.shape == (1, 256)
    fp32_error = float(((main.double() - exact).abs() / exact).max())
    bf16_error = float(((plain.router.weight.grad.double() - exact).abs() / exact).max())
    assert fp32_error < 1e-5
    assert bf16_error > 0.05 and fp32_error < bf16_error / 1000

    # the expert does not match: ordinary bf16 accumulation, bit for bit
    assert "expert.weight" not in acc.main_grads
    assert torch.equal(model.expert.weight.grad, plain.expert.weight.grad)
    assert model.expert.weight.grad.dtype == torch.bfloat16

    acc.copy_to_grad()  # cast back to the parameter's dtype
    assert model.router.weight.grad.dtype == torch.bfloat16
    assert torch.equal(model.router.weight.grad, main.bfloat16())
    assert model.router_unused.grad is None  # no gradient arrived: the optimizer skips it


def test_zero_grad_restarts_and_optimizer_step():
    model = Toy()
    acc = Float32GradAccumulator(model, patterns="^router\\.")  # one string, anchored
    assert list(acc.params) == ["router.weight"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _micro_batches(count=4)
    for g_router, g_expert in batches[:2]:
        model(g_router, g_expert).backward()
    acc.copy_to_grad()
    before = model.router.weight.detach().clone()
    opt.step()  # bf16 grads on bf16 params: a torch optimizer accepts them
    assert not torch.equal(model.router.weight, before)
    opt.zero_grad()
    acc.zero_grad()
    assert acc.main_grads == {} and model.router.weight.grad is None
    model(*batches[2]).backward()
    assert torch.equal(acc.main_grads["router.weight"], batches[2][0].float()[None])  # not summed with the old


def test_remove_restores_plain_accumulation():
    model = Toy()
    acc = Float32GradAccumulator(model)
    g_router, g_expert = _micro_batches(count=1)[0]
    model(g_router, g_expert).backward()
    kept = acc.main_grads["router.weight"].clone()
    acc.remove()
    model(g_router, g_expert).backward()
    model(g_router, g_expert).backward()
    assert torch.equal(acc.main_grads["router.weight"], kept)  # no hook ran
    assert model.router.weight.grad.dtype == torch.bfloat16
    assert torch.equal(model.router.weight.grad, (g_router + g_router)[None])


def test_nested_names_and_bad_patterns():
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({
        "router": torch.nn.Linear(2, 2), "experts": torch.nn.Linear(2, 2)}) for _ in range(2)])})
    model.layers[1].router.bias.requires_grad_(False)
    acc = Float32GradAccumulator(model, patterns=["router.weight", r"0\.router\.bias"])
    assert sorted(acc.params) == ["layers.0.router.bias", "layers.0.router.weight", "layers.1.router.weight"]
    acc.remove()
    _raises("patterns: .* match no trainable parameter", Float32GradAccumulator, model, patterns=("gate",))
    _raises("patterns: .* match no trainable parameter", Float32GradAccumulator, model, patterns=r"1\.router\.bias")
    _raises("patterns: expected regular expressions", Float32GradAccumulator, model, patterns=("(",))
    _raises("patterns: expected regular expressions", Float32GradAccumulator, model, patterns=(3,))
