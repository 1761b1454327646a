"""fmoe.optim.AdamW against torch.optim.AdamW: float32 states step for step, bf16 states
within bf16 rounding, master weights, DTensor shards, closures and parameters without a
gradient, state_dict, errors.

The "triton" cases run the fused kernel (through the interpreter on CPU)."""


import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fmoe.optim.adamw import AdamW
from fmoe.optim.grads import clip_factor, clip_grad_norm, grad_norm

SHAPES = [(), (1,), (7,), (33, 17), (16, 16), (3, 5, 4)]
IMPLS = ["torch", "triton"]
# a step's gradient factor changes the update only as it changes from step to step (Adam's
# m / sqrt(v) does not see a constant one): these do
FACTORS = [1.0, 0.3, 0.05, 0.6, 0.2]
LRS = [1e-2 * (1 + 0.5 * ((i * 7) % 5 - 2) / 2) for i in range(20)]  # changes every step


def make_params(device, dtype=torch.float32, shapes=SHAPES):
    return [torch.randn(s, device=device).to(dtype) for s in shapes]


def grads_at(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in params]


def run(opt_fn, init, steps=20, lrs=LRS, dtype=None, factors=None):
    """Run `steps` steps of opt_fn(params) on copies of init; grads fixed by step; returns params.
    factors: a gradient factor per step (step(grad_factor=...)), or None."""
    params = [p.clone().requires_grad_() for p in init]
    opt = opt_fn(params)
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[i]
        for p, g in zip(params, grads_at(i, params)):
            p.grad = g.to(p.dtype)
        opt.step(**({} if factors is None else dict(grad_factor=torch.tensor(factors[i], device=params[0].device))))
    return [p.detach() for p in params], opt


def max_rel(a, b):
    return max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(a, b))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adamw(impl, wd, device):
    init = make_params(device)
    ours, _ = run(lambda ps: AdamW(ps, weight_decay=wd, impl=impl), init)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, weight_decay=wd, foreach=False), init)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if impl == "torch":  # same ops in the same order as torch's foreach AdamW
        ref_fe, _ = run(lambda ps: torch.optim.AdamW(ps, weight_decay=wd, foreach=True), init)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref_fe))


def test_triton_over_several_chunks_matches_torch_adamw(device, monkeypatch):
    """Chunks of 2048 elements (65536 on a GPU): a tensor of 5000 spans three programs, and
    several blocks in each (the tensors above each fit one chunk: a program that ignored
    its chunk passed)."""
    import fmoe.optim.adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "CHUNK", 2048)
    init = make_params(device, shapes=[(5000,), (3, 700)])
    ours, _ = run(lambda ps: AdamW(ps, weight_decay=0.1, impl="triton"), init, steps=3)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=False), init, steps=3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_states(impl, device):
    init = make_params(device)
    ours, opt = run(lambda ps: AdamW(ps, state_dtype=torch.bfloat16, impl=impl), init)
    ref, ref_opt = run(lambda ps: AdamW(ps, impl="torch"), init)
    for s in opt.state.values():
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16
    # half the state memory
    moments = lambda o: sum(s[k].nbytes for s in o.state.values() for k in ("exp_avg", "exp_avg_sq"))  # noqa: E731
    assert 2 * moments(opt) == moments(ref_opt)
    # really stored in bf16: not the float32 result
    assert any(not torch.equal(a, b) for a, b in zip(ours, ref) if a.numel() > 1)
    # Each step rounds m and v to bf16 (relative error <= 2^-9); the update m/sqrt(v) then
    # carries a relative error of about 2^-9 * 1.5 <= 3e-3 per step, and the parameter moves
    # by at most lr per step: over 20 steps the parameter difference stays within
    # sum(lr) * 3e-3 * (a safety factor 4 for error accumulating through m and v).
    bound = sum(LRS) * 3e-3 * 4
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() <= bound
    # and well above float32 rounding: the bf16 states are not free
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) > 1e-6


def _moments(state_rounding, impl, grads, split=False, betas=(0.9, 0.999), device="cpu"):
    """(exp_avg, exp_avg_sq) in float32 after AdamW steps with bf16 moments over `grads`, a
    list of [n] gradients; split: the tensor as two parameters, its two halves."""
    n = grads[0].numel()
    params = [torch.nn.Parameter(torch.zeros(k, device=device)) for k in ((n // 3, n - n // 3) if split else (n,))]
    opt = AdamW(params, lr=0.0, betas=betas, weight_decay=0.0, state_dtype=torch.bfloat16, state_rounding=state_rounding, impl=impl)
    for g in grads:
        for p, part in zip(params, g.split([p.numel() for p in params])):
            p.grad = part.clone()
        opt.step()
    return [torch.cat([opt.state[p][k].float() for p in params]) for k in ("exp_avg", "exp_avg_sq")]


def test_bf16_moments_round_stochastically_and_follow_float32_ones():
    """beta2 = 0.999 (the default): a step changes v by (1 - beta2)(g^2 - v), at most 0.001 v
    down, under half of bf16's spacing (2^-9 v). Rounded to nearest, v never decreased: after
    the gradients shrank tenfold it kept its value for good (float32 states: 6x smaller 2000
    steps later). Rounded stochastically (the default) it is the float32 v on average."""
    g = torch.Generator().manual_seed(0)
    grads = [(1.0 if t < 300 else 0.1) * (1 + 0.1 * torch.randn(2048, generator=g)) for t in range(2300)]

    def means(state_dtype, state_rounding):
        params = [torch.nn.Parameter(torch.zeros(2048))]
        opt = AdamW(params, lr=0.0, weight_decay=0.0, state_dtype=state_dtype, state_rounding=state_rounding, impl="torch")
        out = []
        for t, grad in enumerate(grads):
            params[0].grad = grad
            opt.step()
            if t in (299, 799, 2299):
                out.append(opt.state[params[0]]["exp_avg_sq"].float().mean().item())
        return out

    exact, stochastic, nearest = means(torch.float32, "nearest"), means(torch.bfloat16, "stochastic"), means(torch.bfloat16, "nearest")
    assert exact[2] < exact[0] / 5
    assert all(abs(a / b - 1) < 0.01 for a, b in zip(stochastic, exact)), (stochastic, exact)
    assert nearest[0] == nearest[1] == nearest[2] and nearest[2] > 5 * exact[2], nearest  # stuck


def test_stochastic_rounding_is_the_same_on_both_paths_and_however_the_tensor_is_split(device):
    """The rounding's bits are a hash of the gradient's bits and the stored moment's, with the
    step: the Triton kernel and the torch path store the same moments (their float32 values
    may differ in the last bit, the hash's inputs do not), a tensor stepped as two
    parameters (FSDP2's shards) the same as whole, and the result is not round-to-nearest."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(999, generator=g).to(device) for _ in range(12)]
    ref = _moments("stochastic", "torch", grads, device=device)
    for impl, split in (("triton", False), ("torch", True), ("triton", True)):
        got = _moments("stochastic", impl, grads, split=split, device=device)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (impl, split)
    nearest = _moments("nearest", "torch", grads, device=device)
    assert not torch.equal(nearest[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(_moments("nearest", "triton", grads, device=device), nearest))


def test_stochastic_bf16_rounding_is_unbiased_and_keeps_nan_and_inf():
    """Over many keys a value between two bf16 neighbours rounds up with the probability of
    its place between them; bf16 values stay, NaN stays NaN, +-inf stay."""
    from fmoe.optim.adamw import round_stochastic_bf16

    lo = torch.tensor(1.0)
    step = 2.0**-7  # bf16's spacing at 1
    keys = torch.arange(20000, dtype=torch.int64) * 2654435761 % 2**32
    for frac in (0.1, 0.25, 0.5, 0.9):
        x = torch.full((20000,), 1.0 + frac * step)
        up = (round_stochastic_bf16(x, keys, 12345).float() > lo).float().mean().item()
        assert abs(up - frac) < 0.015, (frac, up)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5, -2.0, 0.0])
    out = round_stochastic_bf16(special, torch.arange(6), 7).float()
    assert out[0].isnan() and out[1:].tolist() == [float("inf"), -float("inf"), 1.5, -2.0, 0.0]
    # NaNs whose payload is only in the low half (cut off, 0x7F80 would read inf) and a negative one: torch's bf16 NaN of them
    nans = torch.tensor([0x7F800001, 0xFF80FFFF - 2**32, 0x7FC00000, 0x7F80FFFF], dtype=torch.int32).view(torch.float32)
    assert nans.isnan().all()
    for k in range(50):
        out = round_stochastic_bf16(nans, torch.arange(4) * 7919 + k, k)
        assert torch.equal(out.view(torch.int16), nans.bfloat16().view(torch.int16)), out.view(torch.int16)


@pytest.mark.parametrize("impl", IMPLS)
def test_master_weights(impl, device):
    bf16 = [p.to(torch.bfloat16) for p in make_params(device, shapes=[(64,), (32, 48)])]
    ref, _ = run(lambda ps: AdamW(ps, impl="torch"), [p.float() for p in bf16], lrs=[1e-4] * 20)
    with_master, opt = run(lambda ps: AdamW(ps, master_weights=True, impl=impl), bf16, lrs=[1e-4] * 20)
    without, _ = run(lambda ps: AdamW(ps, impl=impl), bf16, lrs=[1e-4] * 20)
    assert all(p.dtype == torch.bfloat16 for p in with_master)
    masters = [s["master"] for s in opt.state.values()]
    assert all(m.dtype == torch.float32 for m in masters)
    # with lr 1e-4 most steps are below half a bf16 ulp (2^-9 relative): without a master
    # they are lost, with one they accumulate. Compared: the total update p_20 - p_0.
    moved = lambda ps: [p.float() - p0.float() for p, p0 in zip(ps, bf16)]  # noqa: E731
    # The parameter is the master rounded to bf16.
    err_master, err_without = max_rel(moved(masters), moved(ref)), max_rel(moved(without), moved(ref))
    assert err_master < 1e-2  # only the bf16 gradients differ
    assert err_without > 0.3
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(with_master, masters))


@pytest.mark.parametrize("impl", IMPLS)
def test_closure_and_params_without_grad(impl, device):
    """step(closure) runs the closure with grad enabled (step itself is no_grad) and returns
    its loss; a parameter the loss does not reach (grad None) keeps its value and gets no
    state; the others step as torch.optim.AdamW's do with the same closure."""
    init = make_params(device, shapes=[(8,), (5, 3), (4,)])
    targets = grads_at(0, init)

    def trained(make):
        params = [p.clone().requires_grad_() for p in init]
        opt = make(params)

        def closure():
            opt.zero_grad()
            loss = sum(((p - t) ** 2).sum() for p, t in zip(params[:2], targets))  # params[2] unused
            loss.backward()
            return loss

        losses = [opt.step(closure) for _ in range(3)]
        return params, opt, losses

    params, opt, losses = trained(lambda ps: AdamW(ps, weight_decay=0.1, impl=impl))
    ref, _, ref_losses = trained(lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=False))
    assert all(loss.requires_grad and loss.dim() == 0 for loss in losses)
    torch.testing.assert_close(torch.stack(losses).detach(), torch.stack(ref_losses).detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(params[2].detach(), init[2]) and params[2] not in opt.state
    assert all(opt.state[p]["step"] == 3 for p in params[:2])
    for a, b in zip(params[:2], ref[:2]):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert opt.step() is None  # no closure: no loss


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_state_dict_round_trip(state_dtype, impl, device):
    init = make_params(device, shapes=[(7,), (6, 5)])
    make = lambda ps: AdamW(ps, weight_decay=0.1, state_dtype=state_dtype, impl=impl)  # noqa: E731
    straight, _ = run(make, init, steps=10)
    first, opt = run(make, init, steps=5)
    saved = opt.state_dict()
    params = [p.clone().requires_grad_() for p in first]
    fresh = make(params)
    fresh.load_state_dict(saved)
    for s in fresh.state.values():
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == state_dtype
    for i in range(5, 10):
        for group in fresh.param_groups:
            group["lr"] = LRS[i]
        for p, g in zip(params, grads_at(i, params)):
            p.grad = g
        fresh.step()
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, straight))


@pytest.mark.parametrize("impl", IMPLS)
def test_dtensor(one_rank_mesh, impl):
    mesh = one_rank_mesh
    init = make_params("cpu", shapes=[(8, 3), (5,)])
    factors = FACTORS[:3]  # gradient factors, as the clip gives, on the shards too
    ref, _ = run(lambda ps: AdamW(ps, impl="torch"), init, steps=3, factors=factors)
    placements = [Shard(0), Replicate()]
    params = [distribute_tensor(p.clone(), mesh, [pl]).requires_grad_() for p, pl in zip(init, placements)]
    opt = AdamW(params, impl=impl)
    for i in range(3):
        for group in opt.param_groups:
            group["lr"] = LRS[i]
        for p, g, pl in zip(params, grads_at(i, init), placements):
            p.grad = distribute_tensor(g, mesh, [pl])
        opt.step(grad_factor=torch.tensor(factors[i]))
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.full_tensor().detach(), r, rtol=1e-6, atol=1e-7)
    assert all(type(s["exp_avg"]) is type(params[0]) for s in opt.state.values())
    unfactored, _ = run(lambda ps: AdamW(ps, impl="torch"), init, steps=3)  # the factors do matter
    assert max((a - b).abs().max().item() for a, b in zip(unfactored, ref)) > 1e-4


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_grad_factor_is_clipping_then_step(state_dtype, impl, device):
    """step(grad_factor=clip_factor(grad_norm, max_norm)) with float32 gradients: the same
    parameters and states, bit for bit, as clip_grad_norm then step(); .grad left unscaled.
    max_norm 10 clips most of these steps (norms 6 to 45), not the first: the factor 1 too."""
    init = make_params(device)

    def trained(fold):
        params = [p.clone().requires_grad_() for p in init]
        opt = AdamW(params, weight_decay=0.1, state_dtype=state_dtype, impl=impl)
        factors = []
        for i in range(6):
            grads = [g * (0.2 + 0.3 * i) for g in grads_at(i, params)]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if fold:
                factors.append(clip_factor(grad_norm(params), 10.0))
                opt.step(grad_factor=factors[-1])
                assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # not scaled in place
            else:
                clip_grad_norm(params, 10.0)
                opt.step()
        return params, opt, factors

    folded, opt, factors = trained(True)
    clipped, ref_opt, _ = trained(False)
    assert min(f.item() for f in factors) < 0.5 and max(f.item() for f in factors) == 1.0
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(folded, clipped))
    for a, b in zip(opt.state.values(), ref_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


@pytest.mark.parametrize("factor, message", [
    (0.5, r"expected a tensor \[\] .*got float"), (torch.ones(1), r"expected a 0-D tensor .*got shape \(1,\)"),
    (torch.tensor(1), "expected dtype float32, bfloat16 or float16, got torch.int64"),
])
def test_grad_factor_refusals(factor, message):
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.ones(2)
    with pytest.raises(ValueError, match=f"^grad_factor: {message}"):
        AdamW([w]).step(grad_factor=factor)
    assert torch.equal(w, torch.zeros(2)) and not AdamW([w]).state  # nothing stepped


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(lr=torch.tensor(1e-2)), "lr"),  # accepted, then the step failed halfway (weights decayed, moments written)
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(lr=float("inf")), "lr"),  # inf was accepted (and so for eps and weight_decay)
        (dict(eps=float("inf")), "eps"),
        (dict(weight_decay=float("inf")), "weight_decay"),
        (dict(eps="1e-8"), "eps"),  # a TypeError from a comparison, naming nothing
        (dict(lr=True), "lr"),
        (dict(betas=(0.9, "0.999")), "betas"),
        (dict(betas=0.9), "betas"),
        (dict(state_dtype=torch.float16), "state_dtype"),
        (dict(impl="cuda"), "impl"),
        (dict(master_weights="no"), "master_weights"),  # truthy: masters were kept
        (dict(master_weights=None), "master_weights"),
        (dict(state_rounding="up"), "state_rounding"),
    ],
)
def test_validation(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        AdamW([torch.zeros(2, requires_grad=True)], **kwargs)
    if name in ("state_dtype", "impl", "master_weights", "state_rounding"):
        return  # optimizer-wide, not per group
    with pytest.raises(ValueError, match=f"^{name}:"):  # a param group's own value is checked the same
        AdamW([{"params": [torch.zeros(2, requires_grad=True)], **kwargs}])
    opt = AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match=f"^{name}:"):  # and so is a group added later
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name, value", [
    ("lr", torch.tensor(1e-2)), ("lr", -1.0), ("lr", float("inf")), ("eps", 0.0), ("eps", "1e-8"),
    ("weight_decay", float("nan")), ("betas", (0.9, 1.0)),
])
def test_hyperparameters_set_later_are_checked_before_the_step_changes_anything(name, value):
    """A value set on a group after it was added (by hand, by a scheduler, by a loaded
    state_dict) is checked at step(), before any state or parameter changes: a tensor lr
    failed at the last foreach op with the weights decayed, the moments written and the step
    count advanced; a negative lr was used."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([w], lr=1e-2, weight_decay=0.1)
    w.grad = torch.full((3,), 0.5)
    opt.step()
    before = w.detach().clone()
    saved = {k: v.clone() for k, v in opt.state[w].items()}
    opt.param_groups[0][name] = value
    calls = []
    with pytest.raises(ValueError, match=f"^{name}:"):
        opt.step(lambda: calls.append(1))
    assert not calls  # not even the closure ran
    assert torch.equal(w.detach(), before)
    assert all(torch.equal(opt.state[w][k], v) for k, v in saved.items()) and opt.state[w]["step"].item() == 1.0


@pytest.mark.parametrize("impl", IMPLS)
def test_loaded_state_follows_master_weights(impl):
    """The masters follow the loading optimizer's master_weights: a state saved without them,
    loaded with master_weights=True, gets one from the parameter at the next step (it had
    none, so a bf16 parameter's small updates were lost: 20 steps of ~1e-3 left 1.0 exactly);
    a saved master loaded with master_weights=False is dropped (it went on being used)."""
    def bf16_param():
        p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        p.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
        return p

    p = bf16_param()
    plain = AdamW([p], lr=1e-3, impl=impl)
    plain.step()
    q = bf16_param()
    resumed = AdamW([q], lr=1e-3, master_weights=True, impl=impl)
    resumed.load_state_dict(plain.state_dict())
    assert "master" not in resumed.state[q]
    with torch.no_grad():
        q.fill_(0.75)  # the model loaded after the optimizer: the master copies it at the step
    resumed.step()
    master = resumed.state[q]["master"]
    assert master.dtype == torch.float32 and 0.748 < master[0].item() < 0.75 and torch.equal(q, master.to(q.dtype))
    for _ in range(19):
        resumed.step()
    assert (q < 0.74).all()  # the ~1e-3 steps accumulated in the master and reached the parameter

    r = bf16_param()
    without = AdamW([r], lr=1e-3, master_weights=False, impl=impl)
    without.load_state_dict(resumed.state_dict())
    assert "master" not in without.state[r] and "master" not in without.state_dict()["state"][0]
    with torch.no_grad():
        r.copy_(q)
    without.step()
    assert torch.equal(r, q)  # a step of ~1e-3 is lost on a bf16 value without a master, as asked
    assert "master" not in without.state[r]
    # a float32 parameter never has a master, whatever was saved
    f = torch.nn.Parameter(torch.ones(3))
    as_float = AdamW([f], lr=1e-3, master_weights=True, impl=impl)
    as_float.load_state_dict(resumed.state_dict())
    assert "master" not in as_float.state[f]


@pytest.mark.gpu
@pytest.mark.parametrize("factors", [None, FACTORS])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_foreach_cuda(state_dtype, factors):
    shapes = [(2048, 2048), (2048, 8192), (8, 2048, 768), (2048,), (1001,), (16, 2048, 768), ()]
    init = make_params("cuda", shapes=shapes)  # about 50M parameters
    assert sum(p.numel() for p in init) > 45e6
    fused, _ = run(lambda ps: AdamW(ps, state_dtype=state_dtype, impl="triton"), init, steps=5, factors=factors)
    ref, _ = run(lambda ps: AdamW(ps, state_dtype=state_dtype, impl="torch"), init, steps=5, factors=factors)
    if state_dtype == torch.float32:
        for a, b in zip(fused, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return
    # bf16 states: the kernel's float32 arithmetic (fused multiply-adds, its division and
    # square root) differs from torch's in the last bit, so a moment that lies near the middle
    # of two bf16 values rounds the other way now and then (seen on an H100: 0.3% of one
    # tensor's elements). Each such element then moves by about 2^-9 of its steps (the
    # bound of test_bf16_states); every other element agrees to float32 rounding.
    bound = sum(LRS[:5]) * 3e-3 * 4
    for a, b in zip(fused, ref):
        diff = (a - b).abs()
        assert diff.max().item() <= bound
        assert (diff > 1e-6).float().mean().item() < 0.01


def test_steps_read_no_tensor_on_the_host_after_the_first():
    """The step count is kept as a Python number beside state["step"]: a step reads nothing
    on the host (on a GPU every read is a stall), the first after a load reads it once."""
    from fmoe.train.metrics import HostReads

    w = torch.nn.Parameter(torch.randn(10))
    opt = AdamW([w], lr=1e-2)
    reads = []
    for _ in range(3):
        w.grad = torch.randn(10)
        with HostReads() as r:
            opt.step()
        reads.append(r.count)
    assert reads == [0, 0, 0] and opt.state[w]["step"].item() == 3.0
    fresh = AdamW([w], lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    w.grad = torch.randn(10)
    with HostReads() as r:
        fresh.step()
    assert r.count == 1
    assert fresh.state[w]["step"].item() == 4.0  # the count goes on from the loaded state



@pytest.mark.parametrize("reset", ["in_place", "reassigned"])
def test_a_state_reset_by_hand_counts_its_steps_again_as_torch_s(reset):
    """Resetting a parameter's state by hand (a dead expert re-initialised: its step count
    and moments zeroed in place, or new tensors put in): torch's AdamW reads state["step"],
    and the Python count kept beside it went on from 3, so that the bias correction of the
    steps after was another's. The edited count is read once, then kept again."""
    from fmoe.train.metrics import HostReads

    torch.manual_seed(0)
    start, grads = torch.randn(4, 3), [torch.randn(4, 3) for _ in range(5)]
    params, reads = [], []
    for cls, kwargs in ((AdamW, {}), (torch.optim.AdamW, dict(foreach=False))):
        p = torch.nn.Parameter(start.clone())
        opt = cls([p], lr=1e-2, **kwargs)
        for i, g in enumerate(grads):
            if i == 3:
                state = opt.state[p]
                if reset == "in_place":
                    for value in state.values():
                        value.zero_()
                else:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros(4, 3), exp_avg_sq=torch.zeros(4, 3))
            p.grad = g.clone()
            with HostReads() as r:
                opt.step()
            reads.append(r.count)
        params.append(p.detach())
        assert opt.state[p]["step"].item() == 2.0
    assert torch.equal(params[0], params[1])
    assert reads[:5] == [0, 0, 0, 1, 0]  # ours: the edited count read once


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int64])
def test_params_of_other_dtypes_are_refused(dtype):
    """The step works in float32: a complex parameter lost its imaginary part, an int64 one
    was truncated, a float64 one rounded to float32 every step."""
    message = rf"^params: expected float32, bfloat16 or float16 parameters .*got {dtype} \(a parameter of shape \(2, 3\)\)"
    with pytest.raises(ValueError, match=message):
        AdamW([torch.zeros(2), torch.zeros(2, 3, dtype=dtype)])
    opt = AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match=message):  # a group added later
        opt.add_param_group({"params": torch.zeros(2, 3, dtype=dtype)})
    assert len(opt.param_groups) == 1
    AdamW([torch.zeros(2, dtype=d, requires_grad=True) for d in (torch.float32, torch.bfloat16, torch.float16)])


def test_a_parameter_twice_is_refused():
    """AdamW([p, p]) stepped p twice per step (torch only warns)."""
    p, q = torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(3, 4\) appears twice"):
        AdamW([p, q, p])
    opt = AdamW([p])
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(3, 4\) appears twice"):  # across groups
        opt.add_param_group({"params": [q, p]})
    assert len(opt.param_groups) == 1


def test_params_must_be_an_ordered_collection():
    """AdamW({p, q}) took the set as a list, as torch's constructor does: a set's order
    changes between runs, and a resumed run's states went to other parameters. A TypeError,
    as a group's set is in torch and in Muon, and nothing is added."""
    p, q = torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    for params in ({p, q}, frozenset([p]), [{"params": {p}}]):
        with pytest.raises(TypeError, match="^params: expected an ordered collection of parameters"):
            AdamW(params)
    opt = AdamW([q])
    with pytest.raises(TypeError, match="^params: expected an ordered collection of parameters"):
        opt.add_param_group({"params": {p}})
    assert len(opt.param_groups) == 1


def _stepped(shape=(2, 3), steps=1, **kwargs):
    w = torch.nn.Parameter(torch.ones(shape))
    opt = AdamW([w], lr=1e-2, **kwargs)
    for _ in range(steps):
        w.grad = torch.full(shape, 0.5)
        opt.step()
    return w, opt


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_gradient_elements_stay_finite(impl, device):
    """An element whose gradient has been 0 (an expert row no token reached) has m = v = 0:
    its update m / (sqrt(v) / bc + eps) is 0, not NaN; torch's bits elsewhere."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0], device=device))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.tensor([0.5, 0.0, -1e-3, 0.0], device=device)
    q.grad = p.grad.clone()
    AdamW([p], lr=0.1, impl=impl).step()
    torch.optim.AdamW([q], lr=0.1, foreach=False).step()
    assert p.isfinite().all() and p[1] == 2.0 * (1 - 0.1 * 0.01) and p[3] == 4.0 * (1 - 0.1 * 0.01)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_optimizer_pickled_before_state_rounding_keeps_nearest():
    opt = AdamW([torch.nn.Parameter(torch.zeros(2))], state_dtype=torch.bfloat16, state_rounding="stochastic")
    old = {k: v for k, v in opt.__getstate__().items() if k != "state_rounding"}  # a pickle of before the knob
    restored = AdamW.__new__(AdamW)
    restored.__setstate__(old)
    assert restored.state_rounding == "nearest"


def test_one_state_dict_loads_twice():
    """torch's loader keeps the saved step tensor, which the steps then advanced in place:
    a second load of the same dict started from the first one's count."""
    _, opt = _stepped(steps=3)
    saved = opt.state_dict()
    for _ in range(2):
        w, resumed = _stepped(steps=0)
        resumed.load_state_dict(saved)
        for _ in range(2):
            w.grad = torch.full((2, 3), 0.5)
            resumed.step()
        assert resumed.state[w]["step"].item() == 5.0
    assert saved["state"][0]["step"].item() == 3.0


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "master"])
def test_load_refuses_a_state_of_another_shape(key):
    """It failed at step(), deep in torch, after part of the state had changed."""
    _, opt = _stepped(master_weights=True)
    saved = opt.state_dict()
    saved["state"][0][key] = torch.zeros(5, 3)
    w, fresh = _stepped(steps=0, master_weights=True)
    with pytest.raises(ValueError, match=rf"^state_dict: expected {key} of parameter 0 to have the parameter's shape \(2, 3\), got \(5, 3\)"):
        fresh.load_state_dict(saved)
    assert not fresh.state and fresh.param_groups[0]["lr"] == 1e-2  # nothing loaded
    saved["state"][0][key] = torch.zeros(3, 2)  # as many elements, another shape (a transpose)
    with pytest.raises(ValueError, match=rf"^state_dict: expected {key} of parameter 0 to have the parameter's shape \(2, 3\), got \(3, 2\)"):
        fresh.load_state_dict(saved)


@pytest.mark.parametrize("make, key, value", [
    (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize", True),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad", True),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "decoupled_weight_decay", False),
])
def test_load_refuses_flags_this_adamw_ignores(make, key, value):
    """A state of torch.optim.AdamW(maximize=True) loaded and then stepped as a plain one."""
    w = torch.nn.Parameter(torch.ones(3))
    theirs = make([w])
    w.grad = torch.ones(3)
    theirs.step()
    with pytest.raises(ValueError, match=rf"^state_dict: param group 0 has {key}={value}, which this AdamW does not implement"):
        AdamW([w]).load_state_dict(theirs.state_dict())
    plain = torch.optim.AdamW([w])
    plain.step()
    AdamW([w]).load_state_dict(plain.state_dict())  # torch.optim.AdamW's defaults load


@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False)])
def test_group_flags_this_adamw_ignores_are_refused(key, value):
    """A group with maximize=True was accepted and stepped downhill; the optimizer then
    refused to load its own state_dict."""
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=rf"^{key}: expected {not value} \(this AdamW does not implement {key}={value}\), got {value}"):
        AdamW([{"params": [w], key: value}])
    opt = AdamW([w])
    with pytest.raises(ValueError, match=rf"^{key}:"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], key: value})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], key: not value})  # the value it implements


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_optimizer_steps_as_the_original(copy_with):
    """torch's __getstate__ keeps defaults, state and param_groups: the copy lost
    state_dtype and master_weights, and its first step was an AttributeError."""
    import copy
    import io
    import pickle

    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16, master_weights=True, impl="torch")

    def step(m, o):
        m.zero_grad()
        m(torch.ones(4, 3, dtype=torch.bfloat16)).float().square().sum().backward()
        o.step()

    step(model, opt)
    if copy_with == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    elif copy_with == "pickle":
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    else:
        buffer = io.BytesIO()
        torch.save((model, opt), buffer)
        buffer.seek(0)
        model2, opt2 = torch.load(buffer, weights_only=False)
    assert (opt2.state_dtype, opt2.master_weights, opt2.impl) == (torch.bfloat16, True, "torch")
    for _ in range(2):
        step(model, opt)
        step(model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq", "master"))
        assert opt2.state[q]["exp_avg"].dtype == torch.bfloat16 and opt2.state[q]["step"].item() == 3.0


def test_a_sparse_gradient_changes_nothing():
    """The parameters before the sparse one had their step counted, though none was updated:
    a retry without it bias-corrected as at step 2."""
    w = torch.nn.Parameter(torch.ones(3))
    emb = torch.nn.Embedding(4, 3, sparse=True)
    v = torch.nn.Parameter(torch.ones(2))
    opt = AdamW([{"params": [v]}, {"params": [w, emb.weight]}], lr=0.1)
    v.grad, w.grad = torch.ones(2), torch.ones(3)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match=r"^AdamW does not support sparse gradients \(a parameter of shape \(4, 3\)\)"):
        opt.step()
    assert not opt.state and torch.equal(w.detach(), torch.ones(3)) and torch.equal(v.detach(), torch.ones(2))
    emb.weight.grad = None
    opt.step()
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    reference.param_groups[0]["params"][0].grad = torch.ones(3)
    reference.step()
    assert torch.equal(w.detach(), reference.param_groups[0]["params"][0].detach())


def test_named_parameters_are_checked_as_parameters():
    """torch's optimizers take (name, tensor) pairs; the checks looked only at tensors, so a
    named complex parameter lost its imaginary part, a named float64 one stepped in float32,
    and one named twice stepped twice per step."""
    p = torch.nn.Parameter(torch.ones(2, 3))
    for dtype in (torch.complex64, torch.float64):
        with pytest.raises(ValueError, match=rf"^params: expected float32, bfloat16 or float16 parameters .*got {dtype}"):
            AdamW([("w", torch.zeros(2, dtype=dtype, requires_grad=True))])
    with pytest.raises(ValueError, match=r"^params: a parameter of shape \(2, 3\) appears twice"):
        AdamW([("a", p), ("b", p)])
    with pytest.raises(ValueError, match=r"^params: expected tensors or \(name, tensor\) pairs .*not a mix"):
        AdamW([("a", p), torch.nn.Parameter(torch.ones(2))])
    model, plain_model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    plain_model.load_state_dict(model.state_dict())
    named, plain = AdamW(model.named_parameters(), lr=0.1), AdamW(plain_model.parameters(), lr=0.1)
    for _ in range(2):
        for m, opt in ((model, named), (plain_model, plain)):
            m(torch.ones(4, 3)).square().sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    assert named.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    assert [s["step"].item() for s in named.state.values()] == [2.0, 2.0]


def test_a_triton_step_it_cannot_run_changes_nothing(monkeypatch):
    """impl="triton" on CPU tensors without the interpreter was refused inside the update,
    after every parameter's step count had moved: a retry bias-corrected as at step 2."""
    import fmoe.ops.backend

    monkeypatch.setattr(fmoe.ops.backend, "interpreting", lambda: False)
    w = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([w], lr=0.1, impl="triton")
    w.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"^impl='triton' needs CUDA tensors"):
        opt.step()
    assert not opt.state and torch.equal(w.detach(), torch.ones(3))


def test_load_refuses_a_group_the_step_would_refuse():
    """torch.optim.AdamW with a tensor lr saves it; the state loaded and every later step
    was refused, the optimizer's state already replaced."""
    w = torch.nn.Parameter(torch.ones(3))
    theirs = torch.optim.AdamW([w], lr=torch.tensor(0.01))
    w.grad = torch.ones(3)
    theirs.step()
    _, mine = _stepped(shape=(3,))
    before = mine.state_dict()
    with pytest.raises(ValueError, match=r"^state_dict: param group 0: lr: expected a number \(a tensor lr is not supported"):
        mine.load_state_dict(theirs.state_dict())
    assert type(mine.param_groups[0]["lr"]) is float and torch.equal(mine.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    sgd = torch.optim.SGD([w], lr=0.1).state_dict()
    with pytest.raises(ValueError, match=r"^state_dict: param group 0 has no 'betas' \(another optimizer's state\)"):
        mine.load_state_dict(sgd)
