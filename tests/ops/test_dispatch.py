"""permute, unpermute: kernels vs reference vs hand-computed plans and a per-token loop."""

import doctest
import math

import pytest
import torch

from fmoe.ops import dispatch
from fmoe.ops.dispatch import PermutePlan, permute, unpermute

# the hand example: T=4, k=2, E=4; expert 3 receives no token, slot (2, 1) is dropped
EXPERTS = [[1, 0], [0, 2], [1, -1], [2, 0]]


def _experts(T, k, E, drop, dtype=torch.int64, device="cpu"):
    """k distinct experts per token (a top-k); with drop, about a third of the slots -1."""
    experts = torch.rand(T, E).argsort(dim=1)[:, :k]
    if drop:
        experts[torch.rand(T, k) < 0.35] = -1
    return experts.to(dtype).to(device)


def _x(T, H, dtype, device="cpu"):
    # distinct rows, so a row in the wrong place cannot go unnoticed
    return (torch.randn(T, H) + torch.arange(T)[:, None]).to(dtype).to(device)


# ---------------------------------------------------------------------------- worked examples


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hand_computed_plan(impl, device):
    x = torch.tensor([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0], [4.0, -4.0]], device=device)
    experts = torch.tensor(EXPERTS, device=device)
    x_perm, plan = permute(x, experts, 4, impl=impl)
    # expert 0: tokens 0, 1, 3; expert 1: tokens 0, 2; expert 2: tokens 1, 3; one spare row
    assert x_perm[:, 0].tolist() == [1.0, 2.0, 4.0, 1.0, 3.0, 2.0, 4.0, 0.0]
    assert torch.equal(x_perm[:, 1], -x_perm[:, 0])
    assert plan.counts.tolist() == [3, 2, 2, 0] and plan.counts.dtype == torch.int64
    assert plan.offsets.tolist() == [3, 5, 7, 7] and plan.offsets.dtype == torch.int32
    assert plan.row_of_slot.tolist() == [[3, 0], [1, 5], [4, -1], [6, 2]]
    assert plan.slot_of_row.tolist() == [1, 2, 7, 0, 4, 3, 6, -1]
    assert plan.row_of_slot.dtype == plan.slot_of_row.dtype == torch.int32


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hand_computed_plan_aligned(impl, device):
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0]], device=device)
    x_perm, plan = permute(x, torch.tensor(EXPERTS, dtype=torch.int32, device=device), 4, align=4, impl=impl)
    assert x_perm.shape == (4 * 2 + 4 * 3, 1)  # R = T*k + E*(align-1)
    pad = 0.0
    assert x_perm[:, 0].tolist() == [1.0, 2.0, 4.0, pad, 1.0, 3.0, pad, pad, 2.0, 4.0, pad, pad] + [pad] * 8
    assert plan.counts.tolist() == [3, 2, 2, 0]
    assert plan.offsets.tolist() == [4, 8, 12, 12]
    assert plan.row_of_slot.tolist() == [[4, 0], [1, 8], [5, -1], [9, 2]]
    assert plan.slot_of_row.tolist() == [1, 2, 7, -1, 0, 4, -1, -1, 3, 6, -1, -1] + [-1] * 8


def test_r_equals_offsets_end_when_nothing_is_dropped():
    experts = torch.tensor([[1, 0], [0, 2], [1, 3], [2, 0]])
    x_perm, plan = permute(torch.randn(4, 3), experts, 4)
    assert x_perm.shape[0] == plan.offsets[-1] == 8
    assert sorted(plan.slot_of_row.tolist()) == list(range(8))


def test_docstring_example():
    result = doctest.testmod(dispatch)
    assert result.attempted >= 1 and result.failed == 0


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("align", [1, 8])
def test_round_trip(impl, align, device):
    T, H, k, E = 9, 5, 3, 6
    x = _x(T, H, torch.float32, device)
    experts = _experts(T, k, E, drop=False, device=device)
    x_perm, plan = permute(x, experts, E, align=align, impl=impl)
    torch.testing.assert_close(unpermute(x_perm, plan, impl=impl), k * x)

    experts = _experts(T, k, E, drop=True, device=device)
    weights = torch.rand(T, k, device=device)
    x_perm, plan = permute(x, experts, E, align=align, impl=impl)
    kept_weight = torch.where(experts >= 0, weights, 0.0).sum(1, keepdim=True)
    torch.testing.assert_close(unpermute(x_perm, plan, weights, impl=impl), kept_weight * x)


# ---------------------------------------------------------------------------- kernels vs reference

# T with 1 and odd sizes, k = 1 and k > 1, E a power of two or not; align 1 and the fp8
# paddings; every case with and without dropped slots, float32 and bf16
GRID = [
    (T, k, E, align)
    for T in (1, 7, 33) for k in (1, 2, 8) for E in (4, 16, 60) for align in (1, 16, 32) if k <= E
]


def _run(x, experts, E, align, y_perm, weights, grad_perm, grad_y, impl):
    """Forward and backward of permute and of a weighted unpermute on fresh leaves."""
    x = x.clone().requires_grad_()
    y_perm = y_perm.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    x_perm, plan = permute(x, experts, E, align=align, impl=impl)
    (x_perm.float() * grad_perm).sum().backward()
    y = unpermute(y_perm, plan, weights, impl=impl)
    (y.float() * grad_y).sum().backward()
    return plan, x_perm, y, x.grad, y_perm.grad, weights.grad


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,k,E,align", GRID)
def test_triton_matches_reference(T, k, E, align, dtype, drop, device):
    H = 24  # not a power of two: the H tile's edge is masked
    R = dispatch.n_rows(T, k, E, align)
    x = _x(T, H, dtype, device)
    experts = _experts(T, k, E, drop, torch.int32 if drop else torch.int64, device)
    args = (
        x, experts, E, align, torch.randn(R, H, device=device).to(dtype), torch.rand(T, k, device=device),
        torch.randn(R, H, device=device), torch.randn(T, H, device=device),
    )
    plan_t, x_perm_t, y_t, dx_t, dy_perm_t, dw_t = _run(*args, impl="triton")
    plan_r, x_perm_r, y_r, dx_r, dy_perm_r, dw_r = _run(*args, impl="torch")

    for name, got, want in zip(PermutePlan._fields, plan_t, plan_r):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert x_perm_t.dtype == dtype and torch.equal(x_perm_t, x_perm_r)
    assert y_t.dtype == dy_perm_t.dtype == dx_t.dtype == dtype and dw_t.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(y_t, y_r, **tol)
    torch.testing.assert_close(dx_t, dx_r, **tol)
    torch.testing.assert_close(dy_perm_t, dy_perm_r, **tol)
    torch.testing.assert_close(dw_t, dw_r, rtol=1e-5, atol=1e-5)
    # rows of no slot (padding, past the end) get exactly zero gradient
    assert (dy_perm_t[plan_t.slot_of_row < 0] == 0).all()


# both ways only move rows, whatever their dtype: each shape once in float32 with every slot
# kept, once in bf16 with slots dropped
@pytest.mark.parametrize("dtype,drop", [(torch.float32, False), (torch.bfloat16, True)], ids=["float32-kept", "bfloat16-dropped"])
@pytest.mark.parametrize("T,k,E,align", [(1, 1, 4, 1), (7, 2, 16, 16), (33, 8, 60, 32), (33, 2, 4, 1)])
def test_scatter_equals_gather(T, k, E, align, dtype, drop, device, monkeypatch):
    """PERMUTE_BY="scatter" (x read once per token, then the empty rows zeroed) gives the
    gather's x_perm, gradients and weight gradients bit for bit, over several H tiles."""
    monkeypatch.setattr(dispatch, "_row_blocks", lambda H: dict(BLOCK_ROWS=4, BLOCK_H=16, num_warps=4))
    H, R = 40, dispatch.n_rows(T, k, E, align)
    experts = _experts(T, k, E, drop, device=device)
    args = (
        _x(T, H, dtype, device), experts, E, align, torch.randn(R, H, device=device).to(dtype), torch.rand(T, k, device=device),
        torch.randn(R, H, device=device), torch.randn(T, H, device=device),
    )
    assert dispatch.PERMUTE_BY == "scatter"  # the default
    monkeypatch.setattr(dispatch, "PERMUTE_BY", "gather")
    gathered = _run(*args, impl="triton")
    monkeypatch.setattr(dispatch, "PERMUTE_BY", "scatter")
    monkeypatch.setattr(dispatch, "_permute_rows_kernel", None)  # the gather kernel cannot run now
    scattered = _run(*args, impl="triton")
    for name, a, b in zip(("plan", "x_perm", "y", "dx", "dy_perm", "dweights"), gathered, scattered):
        for u, v in (zip(a, b) if name == "plan" else [(a, b)]):
            assert torch.equal(u, v), name
    assert (scattered[1][scattered[0].slot_of_row < 0] == 0).all()  # the empty rows, zeroed
    monkeypatch.setattr(dispatch, "PERMUTE_BY", "scattered")
    with pytest.raises(ValueError, match="PERMUTE_BY: expected 'gather' or 'scatter', got 'scattered'"):
        permute(args[0], experts, E, align=align, impl="triton")


@pytest.mark.parametrize("T,k,E,align", [(37, 3, 11, 1), (37, 3, 11, 8), (50, 4, 16, 32), (5, 2, 3, 4)])
def test_plan_kernels_with_small_tiles(T, k, E, align, device, monkeypatch):
    """The three plan kernels with tiles small enough that every loop runs several times:
    many chunks of 4 slots, the scan down them 2 chunks a step in programs of 4 experts, the
    group starts and the offsets 4 experts a step, and the -1 fill striding over R > S."""
    monkeypatch.setattr(
        dispatch, "_plan_blocks",
        lambda E: dict(BLOCK_S=4, BLOCK_E=dispatch.next_pow2(E), SCAN_C=2, SCAN_E=4, RANK_E=4, num_warps=1),
    )
    for drop in (False, True):
        experts = _experts(T, k, E, drop, device=device)
        got = torch.ops.fmoe.permute_plan(experts, E, align)
        want = dispatch.permute_plan_ref(experts, E, align)
        for name, g, w in zip(PermutePlan._fields, got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unweighted_and_low_precision_weights(impl, device):
    T, k, E, H = 11, 3, 5, 7
    experts = _experts(T, k, E, drop=True, device=device)
    x_perm, plan = permute(_x(T, H, torch.bfloat16, device), experts, E, align=4, impl=impl)
    y_perm = torch.randn(x_perm.shape, device=device).to(torch.bfloat16).requires_grad_()
    weights = torch.rand(T, k, device=device).to(torch.bfloat16).requires_grad_()
    grad_y = torch.randn(T, H, device=device).to(torch.bfloat16)

    unpermute(y_perm, plan, impl=impl).backward(grad_y)
    grad_unweighted = y_perm.grad.clone()
    y_perm.grad = None
    unpermute(y_perm, plan, weights, impl=impl).backward(grad_y)
    assert weights.grad.dtype == torch.bfloat16
    row = plan.row_of_slot.long()
    dots = (grad_y.float()[:, None, :] * y_perm.detach().float()[row.clamp(min=0)]).sum(-1)
    torch.testing.assert_close(weights.grad.float(), torch.where(row >= 0, dots, 0.0), rtol=1e-2, atol=1e-3)
    used = plan.slot_of_row >= 0
    slot = plan.slot_of_row[used].long()
    # unweighted: each row gets its token's gradient as is
    assert torch.equal(grad_unweighted[used], grad_y[slot // k])
    assert (grad_unweighted[~used] == 0).all()
    want = (grad_y[slot // k].float() * weights.detach().reshape(-1)[slot].float()[:, None]).to(torch.bfloat16)
    # one bf16 ulp: the Triton interpreter rounds float32 -> bf16 toward zero, a GPU to nearest
    torch.testing.assert_close(y_perm.grad[used], want, rtol=1e-2, atol=0)
    assert (y_perm.grad[~used] == 0).all()


def test_h_loop_with_a_small_tile(monkeypatch, device):
    """H spans several BLOCK_H tiles with a ragged last one (real hidden sizes do)."""
    monkeypatch.setattr(dispatch, "_row_blocks", lambda H: dict(BLOCK_ROWS=4, BLOCK_H=16, num_warps=4))
    T, k, E, H = 13, 2, 5, 40
    experts = _experts(T, k, E, drop=True, device=device)
    args = (
        _x(T, H, torch.float32, device), experts, E, 8, torch.randn(dispatch.n_rows(T, k, E, 8), H, device=device),
        torch.rand(T, k, device=device), torch.randn(dispatch.n_rows(T, k, E, 8), H, device=device),
        torch.randn(T, H, device=device),
    )
    for got, want in zip(_run(*args, impl="triton")[1:], _run(*args, impl="torch")[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("align", [1, 4])
def test_against_per_token_loop(impl, align, device):
    T, k, E, H = 10, 3, 7, 6
    experts = _experts(T, k, E, drop=True, device=device)
    x = _x(T, H, torch.float32, device).requires_grad_()
    x_perm, plan = permute(x, experts, E, align=align, impl=impl)
    ids = experts.tolist()

    # rows by expert, then token, then slot; groups padded to the alignment
    rows, want_perm, offsets = {}, [], []
    for e in range(E):
        for t in range(T):
            for j in range(k):
                if ids[t][j] == e:
                    rows[t, j] = len(want_perm)
                    want_perm.append(x[t].detach())
        while len(want_perm) % align:
            want_perm.append(torch.zeros(H, device=device))
        offsets.append(len(want_perm))
    want_perm += [torch.zeros(H, device=device)] * (x_perm.shape[0] - len(want_perm))
    assert torch.equal(x_perm, torch.stack(want_perm))
    assert plan.offsets.tolist() == offsets
    assert plan.row_of_slot.tolist() == [[rows.get((t, j), -1) for j in range(k)] for t in range(T)]

    grad_perm = torch.randn_like(x_perm)
    x_perm.backward(grad_perm)
    for t in range(T):
        want = sum((grad_perm[rows[t, j]] for j in range(k) if (t, j) in rows), torch.zeros(H, device=device))
        torch.testing.assert_close(x.grad[t], want)

    y_perm = torch.randn_like(x_perm, requires_grad=True)
    weights = torch.rand(T, k, device=device, requires_grad=True)
    y = unpermute(y_perm, plan, weights, impl=impl)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    want_dy_perm = torch.zeros_like(y_perm)
    for t in range(T):
        want = torch.zeros(H, device=device)
        for j in range(k):
            if (t, j) in rows:
                r = rows[t, j]
                want = want + weights[t, j].detach() * y_perm[r].detach()
                want_dy_perm[r] = weights[t, j].detach() * grad_y[t]
                torch.testing.assert_close(weights.grad[t, j], (grad_y[t] * y_perm[r].detach()).sum())
            else:
                assert weights.grad[t, j] == 0
        torch.testing.assert_close(y[t], want)
    torch.testing.assert_close(y_perm.grad, want_dy_perm)


# ---------------------------------------------------------------------------- properties


def test_deterministic(device):
    T, k, E, H = 300, 4, 16, 40
    experts = _experts(T, k, E, drop=True, device=device)
    x = _x(T, H, torch.bfloat16, device)
    R = dispatch.n_rows(T, k, E, 16)
    args = (x, experts, E, 16, torch.randn(R, H, device=device).to(torch.bfloat16), torch.rand(T, k, device=device),
            torch.randn(R, H, device=device), torch.randn(T, H, device=device))
    first, second = _run(*args, impl="triton"), _run(*args, impl="triton")
    for a, b in zip(first[0] + first[1:], second[0] + second[1:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tokens_that_choose_no_expert(impl, align, device):
    """experts [T, 0] (k = 0: every token's slots taken out before, e.g. all to zero
    experts): no row holds a token; align > 1 still pads each expert's group, as the kernels
    do (the reference divided by k = 0)."""
    x = torch.randn(3, 4, device=device, requires_grad=True)
    x_perm, plan = permute(x, torch.zeros(3, 0, dtype=torch.long, device=device), 2, align=align, impl=impl)
    assert x_perm.shape == (2 * (align - 1), 4) and (x_perm == 0).all()
    assert plan.counts.tolist() == [0, 0] and plan.offsets.tolist() == [0, 0] and (plan.slot_of_row == -1).all()
    y = unpermute(x_perm, plan, torch.rand(3, 0, device=device), impl=impl)
    assert torch.equal(y, torch.zeros(3, 4, device=device))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_batch(impl, device):
    x_perm, plan = permute(torch.randn(0, 4, device=device), torch.zeros(0, 2, dtype=torch.long, device=device), 3, align=4, impl=impl)
    assert x_perm.shape == (9, 4) and (x_perm == 0).all()
    assert plan.counts.tolist() == [0, 0, 0] and plan.offsets.tolist() == [0, 0, 0]
    assert plan.row_of_slot.shape == (0, 2) and (plan.slot_of_row == -1).all()
    assert unpermute(x_perm, plan, torch.rand(0, 2, device=device), impl=impl).shape == (0, 4)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_dropped_slots_reach_no_gradient(impl, device):
    """A dropped slot (-1) contributes nothing, its weight's gradient included, whatever its
    weight holds or row 0 (which the reference's gather reads for it) holds: before, a NaN
    weight on a dropped slot made the kept row's gradient NaN on the torch path."""
    x, experts = torch.randn(2, 3, device=device), torch.tensor([[0], [-1]], device=device)
    for weight, row0 in ((float("nan"), 1.0), (float("inf"), 1.0), (0.5, float("inf"))):
        x_perm, plan = permute(x, experts, 2, impl=impl)
        y_perm = x_perm.detach().clone()
        y_perm[0] = row0
        y_perm.requires_grad_()
        weights = torch.tensor([[2.0], [weight]], device=device, requires_grad=True)
        y = unpermute(y_perm, plan, weights, impl=impl)
        assert y[1].eq(0).all(), y  # the dropped token's output
        y.backward(torch.ones_like(y))
        assert y_perm.grad[0].eq(2.0).all() and y_perm.grad[1:].eq(0).all(), y_perm.grad
        assert weights.grad[1].item() == 0.0, weights.grad


def test_kernels_drop_unchecked_out_of_range_ids(device):
    # permute checks ids (a host sync); under torch.compile it cannot, and the kernels must
    # then not write outside the plan
    experts = torch.tensor([[0, 5], [1, 0]], device=device)
    _, _, row_of_slot, slot_of_row = torch.ops.fmoe.permute_plan(experts, 2, 1)
    assert row_of_slot.tolist() == [[0, -1], [2, 1]]
    assert slot_of_row.tolist() == [0, 3, 2, -1]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unchecked_out_of_range_ids_are_dropped(impl, device):
    """check=False: ids outside -1..E-1 get no row, in the reference as in the kernels."""
    x = torch.randn(3, 4, device=device)
    experts = torch.tensor([[0, 5], [1, 0], [-4, 1]], device=device)
    with pytest.raises(ValueError, match=r"experts: ids must lie in -1\.\.1"):
        permute(x, experts, 2, impl=impl)
    x_perm, plan = permute(x, experts, 2, check=False, impl=impl)
    assert plan.row_of_slot.tolist() == [[0, -1], [2, 1], [-1, 3]]
    assert plan.counts.tolist() == [2, 2] and plan.offsets.tolist() == [2, 4]
    assert torch.equal(x_perm[:4], x[[0, 1, 1, 2]]) and not x_perm[4:].any()


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_bad_inputs():
    x, experts = torch.randn(4, 8), torch.tensor(EXPERTS)
    _raises("x: expected a 2-D", permute, torch.randn(8), experts, 4)
    _raises("x: expected dtype", permute, x.long(), experts, 4)
    _raises("experts: expected a 2-D", permute, x, experts.flatten(), 4)
    _raises("experts: expected dtype int32 or int64", permute, x, experts.float(), 4)
    _raises("experts: expected 4 rows", permute, x, experts[:3], 4)
    _raises("n_experts: expected >= 1, got 0", permute, x, experts, 0)
    _raises(r"experts: ids must lie in -1\.\.1", permute, x, experts, 2)
    _raises(r"experts: ids must lie in -1\.\.3", permute, x, experts - 1, 4)
    for align in (0, -16, 1.5, True, "16"):
        _raises("align: expected a positive integer", permute, x, experts, 4, align=align)
    _raises("impl: expected one of", permute, x, experts, 4, impl="cuda")

    x_perm, plan = permute(x, experts, 4, align=4)
    weights = torch.rand(4, 2)
    _raises("plan: expected the PermutePlan", unpermute, x_perm, tuple(plan))
    _raises("y_perm: expected the plan's 20 rows", unpermute, x_perm[:-1], plan)
    _raises("y_perm: expected a 2-D", unpermute, x_perm.flatten(), plan)
    _raises("y_perm: expected dtype", unpermute, x_perm.double(), plan)
    _raises(r"weights: expected the plan's shape \(4, 2\)", unpermute, x_perm, plan, weights.T)
    _raises(r"weights: expected the plan's shape \(4, 2\), got \(4, 1\)", unpermute, x_perm, plan, weights[:, :1])  # not broadcast
    _raises("weights: expected dtype", unpermute, x_perm, plan, weights.long())
    _raises("impl: expected one of", unpermute, x_perm, plan, impl="fast")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unweighted_unpermute_saves_no_rows(impl):
    """y_perm is needed only for the weights' gradient: unweighted, unpermute saves no [R, H]
    tensor for the backward (it would outlive the forward for nothing)."""
    x = torch.randn(4, 8, requires_grad=True)
    y_perm, plan = permute(x, torch.tensor(EXPERTS), 4, impl=impl)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
        unpermute(y_perm, plan, None, impl=impl).sum().backward()
    assert tuple(y_perm.shape) not in saved, saved
    if impl == "triton":  # the kernel's backward reads y_perm for the weights' gradient: the hook sees it saved
        weighted = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (weighted.append(tuple(t.shape)), t)[1], lambda t: t):
            unpermute(y_perm, plan, torch.rand(4, 2), impl=impl)
        assert tuple(y_perm.shape) in weighted, weighted


# ---------------------------------------------------------------------------- registration


def test_custom_ops_pass_opcheck(device):
    T, k, E, H = 9, 3, 5, 6
    experts = _experts(T, k, E, drop=True, device=device)
    for ids in (experts, experts.int()):
        torch.library.opcheck(torch.ops.fmoe.permute_plan.default, (ids, E, 4))
    counts, offsets, row_of_slot, slot_of_row = torch.ops.fmoe.permute_plan(experts, E, 4)
    R = slot_of_row.shape[0]
    x = torch.randn(T, H, device=device, requires_grad=True)
    y_perm = torch.randn(R, H, device=device, requires_grad=True)
    weights = torch.rand(T, k, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.fmoe.permute_fwd.default, (x, row_of_slot, slot_of_row))
    torch.library.opcheck(torch.ops.fmoe.unpermute_fwd.default, (y_perm, row_of_slot, slot_of_row, weights))
    torch.library.opcheck(torch.ops.fmoe.unpermute_fwd.default, (y_perm, row_of_slot, slot_of_row, None))
    torch.library.opcheck(
        torch.ops.fmoe.unpermute_bwd.default,
        (torch.randn(T, H, device=device), y_perm.detach(), weights.detach(), row_of_slot, slot_of_row),
    )


def test_compiles_without_graph_breaks(device):
    T, k, E, H = 10, 2, 6, 8

    def step(x, experts, weights):
        x_perm, plan = permute(x, experts, E, align=16, impl="triton")
        return unpermute(x_perm * 2, plan, weights, impl="triton")

    experts = _experts(T, k, E, drop=True, device=device)
    x, weights, grad_y = torch.randn(T, H, device=device), torch.rand(T, k, device=device), torch.randn(T, H, device=device)
    x1, w1 = x.clone().requires_grad_(), weights.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y1 = torch.compile(step, backend="aot_eager", fullgraph=True)(x1, experts, w1)
    y1.backward(grad_y)
    y2 = step(x2, experts, w2)
    y2.backward(grad_y)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_one_graph_for_every_token_count():
    """torch.compile(dynamic=True): permute then unpermute keep one graph as T changes (a size
    formatted into a check's message, built on every call, fixed T: a graph per T, and with
    fullgraph=True the 9th token count failed on the recompile limit)."""
    from torch._dynamo.utils import counters

    E, k, H = 4, 2, 8

    def step(x, experts, weights):
        x_perm, plan = permute(x, experts, E, check=False)
        return unpermute(x_perm * 2, plan, weights)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    for T in (5, 7, 11, 13):
        x, experts, weights = torch.randn(T, H), torch.randint(0, E, (T, k)), torch.rand(T, k)
        torch.testing.assert_close(compiled(x, experts, weights), step(x, experts, weights))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("by", ["gather", "scatter"])
def test_gpu_real_shape(by, monkeypatch):
    monkeypatch.setattr(dispatch, "PERMUTE_BY", by)
    T, k, E, H, align = 16384, 8, 128, 2048, 16
    experts = torch.rand(T, E, device="cuda").topk(k, dim=1).indices
    experts[torch.rand(T, k, device="cuda") < 0.05] = -1
    R = dispatch.n_rows(T, k, E, align)
    args = (
        torch.randn(T, H, device="cuda", dtype=torch.bfloat16), experts, E, align,
        torch.randn(R, H, device="cuda", dtype=torch.bfloat16), torch.rand(T, k, device="cuda"),
        torch.randn(R, H, device="cuda"), torch.randn(T, H, device="cuda"),
    )
    plan_t, *out_t = _run(*args, impl="auto")  # Triton on CUDA
    plan_r, *out_r = _run(*args, impl="torch")
    for name, got, want in zip(PermutePlan._fields, plan_t, plan_r):
        assert torch.equal(got, want), name
    assert torch.equal(out_t[0], out_r[0])  # x_perm
    for name, got, want in zip(("y", "dx", "dy_perm"), out_t[1:4], out_r[1:4]):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5, msg=name)
    torch.testing.assert_close(out_t[4], out_r[4], rtol=1e-4, atol=1e-4)  # d weights: 2048-term dots


def test_slot_ranks_worked_example():
    # 3 tokens, k = 2, E = 3; slot 3 dropped (-1), slot 5 an unchecked id out of range (7)
    experts = torch.tensor([[1, 0], [1, -1], [0, 7]])
    key, rank, counts = dispatch.slot_ranks(experts, 3)
    assert key.tolist() == [1, 0, 1, 3, 0, 3]
    assert rank.tolist() == [0, 0, 1, 0, 1, 1]  # by token within each expert
    assert counts.tolist() == [2, 2, 0, 2]
    # a priority order: slot 2 before slot 0 in expert 1, slot 4 before slot 1 in expert 0
    _, rank, _ = dispatch.slot_ranks(experts, 3, torch.tensor([2, 4, 5, 3, 0, 1]))
    assert rank.tolist() == [1, 1, 0, 1, 0, 0]


def test_expert_capacity_is_megatrons_ceiling():
    from fmoe.ops.routing import expert_capacity

    assert expert_capacity(10, 2, 4, 1.0) == 5 and expert_capacity(10, 2, 4, 1.1) == 6 and expert_capacity(3, 1, 8, 1.0) == 1
    # the ceiling of the float product, as Megatron's (README): 200 / 4 x 1.1 = 55.00000000000001 keeps 56
    assert expert_capacity(100, 2, 4, 1.1) == 56 == math.ceil(100 * 2 / 4 * 1.1)


def test_more_rows_than_int32_row_ids_are_refused_before_any_work():
    """The plan's row ids and offsets are int32: T K rows past 2**31 - 1 (x of a terabyte at
    real widths) are refused naming the rows, before the ids are read (expanded views here:
    no memory)."""
    x = torch.zeros(1, 4).expand(2**28, 4)
    experts = torch.zeros(1, 1, dtype=torch.long).expand(2**28, 8)
    with pytest.raises(ValueError, match=r"experts: \[268435456, 8\] slots make 2147483648 rows of x_perm \(align 1\), past the plan's int32"):
        permute(x, experts, 4)
    with pytest.raises(ValueError, match=r"2147483655 rows of x_perm \(align 4\)"):
        permute(x[:2**28 - 1], experts[:2**28 - 1], 5, align=4)  # 2**31 - 8 slots and 5 x 3 rows of padding
