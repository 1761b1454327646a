"""aux_scores, tokens_per_expert, the balancing losses, z_loss, update_expert_bias."""

import math

import pytest
import torch

import fmoe.ops as F
from fmoe.ops.balance import mask_tokens
from fmoe.train.metrics import HostReads

# (T, E, k): T with 1 and odd sizes, E 4..256, k = 1 and k > 1
SHAPES = [(1, 4, 1), (7, 6, 2), (33, 16, 1), (65, 64, 8), (9, 256, 8), (40, 60, 6)]


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


# ---------------------------------------------------------------------------- aux_scores


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_reference_definition(score):
    logits = torch.randn(21, 10)
    scores, experts, counts = F.aux_scores(logits, 3, score=score, return_counts=True, impl="torch")
    if score == "softmax":
        expected = torch.softmax(logits, -1)
    elif score == "sigmoid":
        expected = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    else:
        s = torch.nn.functional.softplus(logits).sqrt()
        expected = s / s.sum(-1, keepdim=True)
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(scores.sum(-1), torch.ones(21))
    for t in range(21):  # unconstrained top-k, best first, lower id on ties
        assert experts[t].tolist() == sorted(range(10), key=lambda e: (-float(scores[t, e]), e))[:3]
    assert counts.tolist() == [int((experts == e).sum()) for e in range(10)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_aux_scores_triton_matches_reference(shape, score, dtype, device):
    T, E, k = shape
    logits = torch.randn(T, E, device=device).to(dtype)
    x_tri, x_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    s_tri, e_tri, c_tri = F.aux_scores(x_tri, k, score=score, return_counts=True, impl="triton")
    s_ref, e_ref, c_ref = F.aux_scores(x_ref, k, score=score, return_counts=True, impl="torch")
    torch.testing.assert_close(s_tri, s_ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(e_tri, e_ref) and torch.equal(c_tri, c_ref)
    assert c_tri.dtype == torch.int64 and int(c_tri.sum()) == T * k
    upstream = torch.randn_like(s_ref)
    (s_tri * upstream).sum().backward()
    (s_ref * upstream).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(x_tri.grad, x_ref.grad, **tol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_aux_scores_of_underflowed_rows_are_zeros_not_nan(impl, device):
    """Row 0's sigmoids all underflow to 0 in float32: its scores are zeros and its gradient
    zero, not 0 / 0; row 1, tiny but not zero, still sums to 1. (sqrt(softplus) has a floor,
    so the same row scores 1/E each.)"""
    logits = torch.stack([torch.full((6,), -120.0), torch.linspace(-70.0, -60.0, 6)]).to(device).requires_grad_()
    scores, experts = F.aux_scores(logits, 2, score="sigmoid", impl=impl)
    assert torch.equal(scores[0], torch.zeros_like(scores[0])) and experts[0].tolist() == [0, 1]
    torch.testing.assert_close(scores[1].sum(), torch.tensor(1.0, device=device))
    (scores * torch.randn_like(scores)).sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[0], torch.zeros_like(logits.grad[0]))
    floored, _ = F.aux_scores(logits.detach(), 2, score="sqrtsoftplus", impl=impl)
    torch.testing.assert_close(floored[0], torch.full((6,), 1 / 6, device=device))


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_of_nan_and_infinite_logits_agree_on_both_paths(score, device):
    """A NaN logit makes its row's scores all NaN (the normalising sum is NaN), and a +inf
    one gives NaN where it makes the sum inf or NaN (softmax: the row; sqrtsoftplus: inf /
    inf); the kernel left such a row unnormalised (a
    score of 1.0 beside the NaN) with other experts and counts than the reference. Both
    paths now give the same NaN rows, the same top-k (NaN above every number, lowest id
    first, as torch.sort) and the same counts; a finite row is unchanged."""
    logits = torch.randn(4, 6, device=device)
    logits[1, 2], logits[2, 4], logits[3] = float("nan"), float("inf"), float("nan")
    (s_ref, e_ref, c_ref), (s_tri, e_tri, c_tri) = (F.aux_scores(logits, 2, score=score, impl=impl, return_counts=True)
                                                    for impl in ("torch", "triton"))
    assert s_ref.isnan().all(dim=1).tolist() == [False, True, score == "softmax", True]
    assert s_ref.isnan().any(dim=1).tolist() == [False, True, score != "sigmoid", True]  # sigmoid(inf) = 1: a finite row
    assert torch.equal(s_tri.isnan(), s_ref.isnan())
    torch.testing.assert_close(s_tri.nan_to_num(7.0), s_ref.nan_to_num(7.0))
    assert torch.equal(e_tri, e_ref) and torch.equal(c_tri, c_ref) and e_ref[3].tolist() == [0, 1]


def test_transposed_logits_differentiate_as_their_copies(device):
    """aux_scores, z_loss and its masked form on a transposed logits view: the kernels'
    gradients equal the reference's on a contiguous copy (a gradient laid out as the view's
    strides, where the kernels write rows, would scramble them)."""
    E, T, k = 6, 9, 2
    base = torch.randn(E, T, device=device)
    keep = torch.arange(T, device=device) % 3 != 1
    weights = torch.randn(T, E, device=device)
    losses = {
        "aux_scores": lambda x, impl: (F.aux_scores(x, k, score="sigmoid", impl=impl)[0] * weights).sum(),
        "z_loss": lambda x, impl: F.z_loss(x, impl=impl),
        "z_loss mask": lambda x, impl: F.z_loss(x, mask=keep, impl=impl),
    }
    for name, loss in losses.items():
        grads = []
        for impl, logits_of in (("triton", lambda x: x.t()), ("torch", lambda x: x.t().contiguous())):
            x = base.clone().requires_grad_()
            loss(logits_of(x), impl).backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6, msg=name)


def test_aux_scores_bad_inputs():
    _raises("logits: expected a 2-D", F.aux_scores, torch.randn(3, 4, 5), 2)
    _raises(r"k: expected 1\.\.4", F.aux_scores, torch.randn(3, 4), 5)
    _raises("score: expected", F.aux_scores, torch.randn(3, 4), 2, score="tanh")


# ---------------------------------------------------------------------------- counts


def test_tokens_per_expert():
    experts = torch.tensor([[0, 2], [2, -1], [0, 2], [-1, -1]])
    assert F.tokens_per_expert(experts, 5).tolist() == [2, 0, 3, 0, 0]  # experts 1, 3, 4 get none
    assert F.tokens_per_expert(experts.int(), 5).dtype == torch.int64
    _raises("experts: expected an int32/int64", F.tokens_per_expert, experts.float(), 5)
    _raises("n_experts: expected", F.tokens_per_expert, experts, 0)
    # ids outside -1..E-1 are skipped as -1 is (permute's unchecked rule), not counted on a
    # neighbour nor an index error
    out_of_range = torch.tensor([[0, 5], [2, -3], [7, 4]])
    assert F.tokens_per_expert(out_of_range, 5).tolist() == [1, 0, 1, 0, 1]


# ---------------------------------------------------------------------------- switch loss


def test_switch_loss_worked_numbers():
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.4]], requires_grad=True)
    counts = torch.tensor([2, 0])
    loss = F.load_balancing_loss(scores, counts, k=1, n_tokens=2)
    # E / (k n^2) * sum_e P_e c_e = 2 / 4 * (1.5 * 2 + 0.5 * 0)
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(scores.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def test_switch_loss_is_one_when_balanced_and_equals_E_sum_f_P():
    T, E, k = 64, 8, 2
    uniform = torch.full((T, E), 1.0 / E)
    assert F.load_balancing_loss(uniform, torch.full((E,), T * k // E), k=k, n_tokens=T).item() == pytest.approx(1.0)
    scores, experts = F.aux_scores(torch.randn(T, E), k)
    counts = F.tokens_per_expert(experts, E)
    f = counts.float() / (k * T)
    P = scores.mean(0)
    torch.testing.assert_close(F.load_balancing_loss(scores, counts, k=k, n_tokens=T), E * (f * P).sum())


def test_switch_loss_split_over_ranks_adds_up():
    # tokens split over two TP ranks: local scores, group-total counts and n_tokens
    T, E, k = 30, 8, 2
    scores, experts = F.aux_scores(torch.randn(T, E), k)
    counts = F.tokens_per_expert(experts, E)
    whole = F.load_balancing_loss(scores, counts, k=k, n_tokens=T)
    parts = [F.load_balancing_loss(s, counts, k=k, n_tokens=torch.tensor(T)) for s in scores.split([11, 19])]
    torch.testing.assert_close(sum(parts), whole)


def test_switch_loss_of_no_token_is_zero():
    """Every token masked (mask_tokens, n_tokens = mask.sum() = 0, as the MoE layer's docstring
    and the train loop count them): 0 with a zero gradient, as z_loss's mean over no token; it
    gave 0/0, a NaN loss. An int count is >= 1 (0 there is a caller's slip, refused)."""
    logits = torch.randn(5, 4, requires_grad=True)
    scores, experts = F.aux_scores(logits, 2)
    none = torch.zeros(5, dtype=torch.bool)
    scores, experts = mask_tokens(scores, experts, none)
    counts = F.tokens_per_expert(experts, 4)
    loss = F.load_balancing_loss(scores, counts, k=2, n_tokens=none.sum())
    loss.backward(retain_graph=True)
    assert loss.item() == 0.0 and logits.grad is not None and not logits.grad.any(), (loss, logits.grad)
    one = torch.tensor([True, False, False, False, False])  # one token left: the tensor and int forms agree
    scores, experts = F.aux_scores(logits, 2)
    scores, experts = mask_tokens(scores, experts, one)
    counts = F.tokens_per_expert(experts, 4)
    assert F.load_balancing_loss(scores, counts, k=2, n_tokens=one.sum()).item() == F.load_balancing_loss(scores, counts, k=2, n_tokens=1).item() > 0


def test_switch_loss_bad_inputs():
    s = torch.rand(4, 3)
    _raises(r"counts: expected a tensor of shape \(3,\)", F.load_balancing_loss, s, torch.ones(4), k=1, n_tokens=4)
    _raises(r"n_tokens: expected >= 1, got 0", F.load_balancing_loss, s, torch.ones(3), k=1, n_tokens=0)
    _raises("k: expected", F.load_balancing_loss, s, torch.ones(3), k=0, n_tokens=4)
    _raises(r"k: expected 1\.\.3, got 4", F.load_balancing_loss, s, torch.ones(3), k=4, n_tokens=4)  # as route and aux_scores
    _raises(r"k: expected 1\.\.3, got 4", F.seq_load_balancing_loss, s, torch.zeros(4, 4, dtype=torch.long), torch.tensor([0, 4]), k=4)
    _raises("n_tokens: expected an int or a 1-element", F.load_balancing_loss, s, torch.ones(3), k=1, n_tokens=torch.ones(2))



def test_switch_loss_refuses_bool_counts_and_n_tokens():
    """counts are slot counts (int or float) and n_tokens a token count: a bool tensor in
    either (a mask passed where its sum was meant) read as 0/1 counts and gave a loss. The
    refusal is a dtype check, so nothing is read on the host."""
    s = torch.softmax(torch.randn(6, 4), dim=-1)
    counts = torch.tensor([3, 5, 2, 2])
    _raises("counts: expected int or float counts, got torch.bool", F.load_balancing_loss, s, torch.ones(4, dtype=torch.bool), k=2, n_tokens=6)
    _raises("counts: expected int or float counts, got torch.complex64", F.load_balancing_loss, s, torch.ones(4, dtype=torch.complex64), k=2, n_tokens=6)
    _raises(r"n_tokens: expected an int or float tensor \(a token count\), got torch.bool", F.load_balancing_loss, s, counts, k=2, n_tokens=torch.tensor(True))
    with HostReads() as reads:
        F.load_balancing_loss(s, counts, k=2, n_tokens=torch.tensor(6))
        F.load_balancing_loss(s, counts.float(), k=2, n_tokens=torch.tensor(6.0))
    assert reads.count == 0, reads.sites

# ---------------------------------------------------------------------------- sequence loss


def _seq_loss_loop(scores, experts, cu, k):
    E = scores.shape[1]
    terms = []
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        c = F.tokens_per_expert(experts[lo:hi], E).float()
        terms.append(E / (k * (hi - lo)) * (c * scores[lo:hi].mean(0)).sum())
    return torch.stack(terms).mean()


@pytest.mark.parametrize("cu", [[0, 13], [0, 3, 7, 13], [0, 3, 3, 13], [0, 1, 2, 13], [0, 13, 13]], ids=str)
def test_seq_loss_against_per_sequence_loop(cu):
    T, E, k = 13, 8, 2
    logits = torch.randn(T, E, requires_grad=True)
    scores, experts = F.aux_scores(logits, k)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    loss = F.seq_load_balancing_loss(scores, experts, cu_seqlens, k=k)
    expected = _seq_loss_loop(scores, experts, cu, k)
    torch.testing.assert_close(loss, expected)
    upstream = torch.randn(())
    (g1,) = torch.autograd.grad(loss * upstream, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(expected * upstream, logits)
    torch.testing.assert_close(g1, g2)


def test_seq_loss_special_cases():
    T, E, k = 24, 6, 2
    scores, experts = F.aux_scores(torch.randn(T, E), k)
    counts = F.tokens_per_expert(experts, E)
    # one sequence: the switch loss over the whole batch
    torch.testing.assert_close(
        F.seq_load_balancing_loss(scores, experts, torch.tensor([0, T]), k=k),
        F.load_balancing_loss(scores, counts, k=k, n_tokens=T),
    )
    # fixed-length rows: mean of per-row switch losses; dropped slots (-1) do not count
    experts = experts.clone()
    experts[5, 1] = -1
    rows = [F.load_balancing_loss(scores[i:i + 8], F.tokens_per_expert(experts[i:i + 8], E), k=k, n_tokens=8) for i in (0, 8, 16)]
    torch.testing.assert_close(
        F.seq_load_balancing_loss(scores, experts, torch.tensor([0, 8, 16, 24]), k=k), torch.stack(rows).mean()
    )


def test_seq_loss_bad_cu_seqlens():
    scores, experts = F.aux_scores(torch.randn(10, 4), 2)
    _raises("cu_seqlens: must start at 0", F.seq_load_balancing_loss, scores, experts, torch.tensor([1, 10]), k=2)
    _raises(r"cu_seqlens: must be non-decreasing, but cu_seqlens\[2\] = 3 < cu_seqlens\[1\] = 6", F.seq_load_balancing_loss, scores, experts, torch.tensor([0, 6, 3, 10]), k=2)
    _raises("cu_seqlens: must end at the token count 10, ends at 9", F.seq_load_balancing_loss, scores, experts, torch.tensor([0, 4, 9]), k=2)
    _raises("cu_seqlens: expected dtype int32 or int64", F.seq_load_balancing_loss, scores, experts, torch.tensor([0.0, 10.0]), k=2)
    _raises("cu_seqlens: expected at least 2 entries", F.seq_load_balancing_loss, scores, experts, torch.tensor([0]), k=2)
    _raises(r"experts: expected shape \(10, 3\)", F.seq_load_balancing_loss, scores, experts, torch.tensor([0, 10]), k=3)
    # offsets on the meta device (no values to copy) beside scores that hold values: named (torch's "Cannot copy out of meta tensor")
    _raises(r"^cu_seqlens: a meta tensor holds no offsets to copy to the device of scores \(cpu\)", F.seq_load_balancing_loss, scores,
            experts, torch.tensor([0, 10], device="meta"), k=2)


@pytest.mark.parametrize("bad", [4, -2])
def test_seq_loss_ids_out_of_range(bad):
    """Checked, an id outside -1..E-1 is a ValueError; unchecked, it is skipped as -1 is
    (an id E must not count as the next sequence's expert 0, nor index past the counts)."""
    T, E, k = 10, 4, 2
    scores, experts = F.aux_scores(torch.randn(T, E), k)
    cu = torch.tensor([0, 4, T])
    for row in (0, T - 1):  # inside the first sequence, and in the last (whose E-th id is past the end)
        bad_experts, dropped = experts.clone(), experts.clone()
        bad_experts[row, 0], dropped[row, 0] = bad, -1
        _raises(rf"experts: ids must lie in -1..{E - 1}", F.seq_load_balancing_loss, scores, bad_experts, cu, k=k)
        torch.testing.assert_close(F.seq_load_balancing_loss(scores, bad_experts, cu, k=k, check=False),
                                   F.seq_load_balancing_loss(scores, dropped, cu, k=k))


# ---------------------------------------------------------------------------- z-loss


def test_z_loss_worked_numbers():
    # zero logits: logsumexp = ln E for every token
    assert F.z_loss(torch.zeros(5, 8), impl="torch").item() == pytest.approx(math.log(8) ** 2)
    logits = torch.tensor([[0.0, math.log(3.0)]])  # logsumexp = ln 4
    assert F.z_loss(logits).item() == pytest.approx(math.log(4.0) ** 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_z_loss_triton_matches_reference(shape, dtype, device):
    T, E, _ = shape
    logits = (3 * torch.randn(T, E, device=device)).to(dtype)
    x_tri, x_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    z_tri, z_ref = F.z_loss(x_tri, impl="triton"), F.z_loss(x_ref, impl="torch")
    assert z_tri.dtype == torch.float32 and z_tri.shape == ()
    torch.testing.assert_close(z_tri, z_ref, rtol=1e-5, atol=1e-6)
    upstream = torch.randn((), device=device)
    (z_tri * upstream).backward()
    (z_ref * upstream).backward()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(x_tri.grad, x_ref.grad, **tol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_z_loss_rows_of_minus_infinity(impl, device):
    """A row of -inf (a padding row filled so) has logsumexp -inf: z_loss inf on both paths
    (the kernel gave NaN); under a mask that leaves it out it adds nothing, its gradient
    included (the logsumexp's backward at that row was NaN, times the mask's 0)."""
    inf = float("inf")
    z = torch.tensor([[-inf, -inf], [0.0, math.log(3.0)]], device=device)
    assert F.z_loss(z, impl=impl).item() == inf
    x = z.clone().requires_grad_()
    loss = F.z_loss(x, mask=torch.tensor([False, True], device=device), impl=impl)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(4.0) ** 2)
    assert x.grad[0].eq(0).all(), x.grad
    torch.testing.assert_close(x.grad[1], 2 * math.log(4.0) * torch.tensor([0.25, 0.75], device=device))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_z_loss_of_a_plus_infinite_logit_is_inf(impl, device):
    """logsumexp of a row with +inf is +inf (torch's); the kernel gave NaN (inf - inf)."""
    z = torch.tensor([[0.0, float("inf")], [0.0, 0.0]], device=device)
    assert F.z_loss(z, impl=impl).item() == float("inf")


def test_z_loss_bad_inputs():
    _raises("logits: expected a 2-D", F.z_loss, torch.randn(8))
    _raises("logits: z_loss is a mean over tokens", F.z_loss, torch.randn(0, 8))
    _raises("logits: expected dtype", F.z_loss, torch.zeros(2, 3, dtype=torch.int32))


def test_losses_refuse_no_experts():
    """E = 0 is a caller's mistake, refused by name: z_loss would be a logsumexp over nothing
    (-inf, squared to inf), the sequence loss indexed counts of no expert."""
    logits = torch.randn(3, 0)
    for impl in ("torch", "triton"):
        _raises(r"logits: expected at least one expert \(E >= 1\), got shape \(3, 0\)", F.z_loss, logits, impl=impl)
        _raises(r"logits: expected at least one expert", F.z_loss, logits, mask=torch.ones(3, dtype=torch.bool), impl=impl)
        _raises(r"logits: expected at least one expert", F.aux_scores, logits, 1, impl=impl)
    _raises(r"scores: expected at least one expert", F.load_balancing_loss, logits, torch.zeros(0), k=1, n_tokens=3)
    _raises(r"scores: expected at least one expert", F.seq_load_balancing_loss, logits, torch.full((3, 1), -1), torch.tensor([0, 3]), k=1)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_losses_of_no_tokens_are_zero(impl, device):
    """T = 0: z_loss with a mask (no token in it) is 0, as are the switch and sequence
    losses, each with a zero gradient of logits' empty shape; z_loss without a mask is a
    mean over no token and refused (test_z_loss_bad_inputs)."""
    logits = torch.randn(0, 4, device=device, requires_grad=True)
    z = F.z_loss(logits, mask=torch.zeros(0, dtype=torch.bool, device=device), impl=impl)
    scores, experts = F.aux_scores(logits, 2, impl=impl)
    counts = F.tokens_per_expert(experts, 4)
    switch = F.load_balancing_loss(scores, counts, k=2, n_tokens=1)
    seq = F.seq_load_balancing_loss(scores, experts, torch.tensor([0, 0], device=device), k=2)
    for loss in (z, switch, seq):
        assert loss.shape == () and loss.dtype == torch.float32 and float(loss.detach()) == 0.0
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)  # switch and seq share the scores' graph
        assert grad.shape == (0, 4)


# ---------------------------------------------------------------------------- token masks

# a batch of 4 sequences (one empty) whose tokens 3, 8 and the whole last sequence are padding
MASK_CU = [0, 5, 11, 11, 16]
MASK_KEEP = [t not in (3, 8) and t < 11 for t in range(16)]


def _without(cu, keep):
    """cu_seqlens of the batch without the tokens where keep is False."""
    return torch.tensor([sum(keep[:c]) for c in cu], dtype=torch.int32)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_masked_losses_equal_the_losses_of_the_batch_without_the_padding(impl, device):
    """With mask=, each loss and its gradient on the kept tokens are those of the batch
    without the padding; the padding's rows get no gradient."""
    E, k, keep = 6, 2, torch.tensor(MASK_KEEP, device=device)
    logits = 2 * torch.randn(16, E, device=device)
    cu = torch.tensor(MASK_CU, dtype=torch.int32, device=device)
    full, part = logits.clone().requires_grad_(), logits[keep].clone().requires_grad_()
    upstream = torch.randn(3, device=device)
    scores, experts = F.aux_scores(full, k, impl=impl)
    scores_m, experts_m = mask_tokens(scores, experts, keep)
    got = torch.stack([
        F.seq_load_balancing_loss(scores, experts, cu, k=k, mask=keep),
        F.load_balancing_loss(scores_m, F.tokens_per_expert(experts_m, E), k=k, n_tokens=keep.sum()),
        F.z_loss(full, mask=keep, impl=impl),
    ])
    scores_p, experts_p = F.aux_scores(part, k, impl=impl)
    want = torch.stack([
        F.seq_load_balancing_loss(scores_p, experts_p, _without(MASK_CU, MASK_KEEP).to(device), k=k),
        F.load_balancing_loss(scores_p, F.tokens_per_expert(experts_p, E), k=k, n_tokens=int(keep.sum())),
        F.z_loss(part, impl=impl),
    ])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(full.grad[keep], part.grad, rtol=1e-5, atol=1e-7)
    assert not full.grad[~keep].any()
    # the padding's scores and slots are gone; masking twice changes nothing
    assert not scores_m[~keep].any() and (experts_m[~keep] == -1).all() and torch.equal(experts_m[keep], experts[keep])
    twice = mask_tokens(scores_m, experts_m, keep)
    assert torch.equal(twice[0], scores_m) and torch.equal(twice[1], experts_m)
    # an all-True mask is no mask; the unmasked losses differ (the padding counted)
    everything = torch.ones(16, dtype=torch.bool, device=device)
    assert float(F.z_loss(logits, mask=everything, impl=impl)) == pytest.approx(float(F.z_loss(logits, impl=impl)), rel=1e-6)
    assert float(F.seq_load_balancing_loss(scores.detach(), experts, cu, k=k, mask=everything)) == pytest.approx(
        float(F.seq_load_balancing_loss(scores.detach(), experts, cu, k=k)), rel=1e-6)
    assert float(F.z_loss(logits, impl=impl)) != pytest.approx(float(got[2].detach()), rel=1e-3)


def test_masked_losses_of_nothing_are_zero_and_bad_masks_are_refused():
    logits = torch.randn(5, 4, requires_grad=True)
    none = torch.zeros(5, dtype=torch.bool)
    z = F.z_loss(logits, mask=none)
    z.backward()
    assert float(z.detach()) == 0.0 and not logits.grad.any()
    scores, experts = F.aux_scores(logits, 2)
    assert float(F.seq_load_balancing_loss(scores, experts, torch.tensor([0, 2, 5]), k=2, mask=none).detach()) == 0.0
    for bad, fn in ((torch.ones(5, dtype=torch.int64), F.z_loss), (torch.ones(4, dtype=torch.bool), F.z_loss), ([True] * 5, F.z_loss)):
        _raises(r"mask: expected None or a bool tensor \[5\]", fn, logits, mask=bad)
    _raises(r"mask: expected None or a bool tensor \[5\]", F.seq_load_balancing_loss, scores, experts, torch.tensor([0, 5]), k=2,
            mask=torch.ones(6, dtype=torch.bool))
    # mask_tokens, which the MoE layer calls with its token_mask: before, torch's errors from inside
    for bad in (torch.ones(5, dtype=torch.int64), torch.ones(2, dtype=torch.bool)):
        _raises(r"mask: expected None or a bool tensor \[5\]", mask_tokens, scores, experts, bad)
    _raises(r"mask: expected a bool tensor \[T\]", mask_tokens, scores, experts, None)


# ---------------------------------------------------------------------------- expert bias


def test_update_expert_bias_spec_example():
    bias = torch.zeros(4)
    new = F.update_expert_bias(bias, torch.tensor([10, 2, 6, 6]), 1e-3)
    torch.testing.assert_close(new, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]))
    assert new.dtype == torch.float32 and torch.equal(bias, torch.zeros(4))  # pure: input untouched


def test_update_expert_bias_center_and_accumulation():
    counts = torch.tensor([9.0, 1.0, 1.0, 1.0])  # mean 3: sign -> [-1, 1, 1, 1]
    torch.testing.assert_close(F.update_expert_bias(torch.zeros(4), counts, 1e-3, center=True), torch.tensor([-1.5e-3, 0.5e-3, 0.5e-3, 0.5e-3]))
    bias = torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.testing.assert_close(F.update_expert_bias(bias, counts, 0.01), torch.tensor([0.09, 0.21, 0.31, 0.41]))


def test_update_expert_bias_proportional_steps_by_the_relative_error():
    counts = torch.tensor([10, 2, 6, 6])  # mean 6: relative errors [-2/3, 2/3, 0, 0]
    new = F.update_expert_bias(torch.zeros(4), counts, 1e-3, proportional=True)
    torch.testing.assert_close(new, torch.tensor([-2e-3 / 3, 2e-3 / 3, 0.0, 0.0]))
    # far from balance it steps harder than the sign rule, near balance gentler
    collapsed = torch.tensor([32, 0, 0, 0])  # mean 8: errors [-3, 1, 1, 1]
    torch.testing.assert_close(F.update_expert_bias(torch.zeros(4), collapsed, 1e-3, proportional=True), torch.tensor([-3e-3, 1e-3, 1e-3, 1e-3]))
    near = F.update_expert_bias(torch.zeros(4), torch.tensor([9, 7, 8, 8]), 1e-3, proportional=True)
    assert near.abs().max() < 1.3e-4
    # nothing routed (mean 0): no step, no NaN
    assert torch.equal(F.update_expert_bias(torch.zeros(4), torch.zeros(4), 1e-3, proportional=True), torch.zeros(4))


def test_update_expert_bias_steps_counts_past_float32s_integers():
    """Counts 2^25 + 1 and 2^25 - 1 (33M slots an expert: a large step's sum over ranks)
    round to one float32; the update is taken in float64, so each still gets its step."""
    counts = torch.tensor([2**25 + 1, 2**25 - 1])
    bias = torch.zeros(2)
    update = F.update_expert_bias(bias, counts, 1e-3)
    assert update.dtype == torch.float32 and update.tolist() == [-torch.tensor(1e-3).item(), torch.tensor(1e-3).item()]
    proportional = F.update_expert_bias(bias, counts, 1.0, proportional=True)
    torch.testing.assert_close(proportional, torch.tensor([-1.0, 1.0]) / 2**25, rtol=1e-6, atol=0)


def test_update_expert_bias_bad_inputs():
    _raises("bias: expected a 1-D float32", F.update_expert_bias, torch.zeros(4, dtype=torch.float64), torch.ones(4), 1e-3)
    _raises("bias: expected a 1-D float32", F.update_expert_bias, torch.zeros(2, 2), torch.ones(4), 1e-3)
    _raises(r"counts: expected a tensor of shape \(4,\)", F.update_expert_bias, torch.zeros(4), torch.ones(3), 1e-3)
    _raises("rate: expected a finite number >= 0", F.update_expert_bias, torch.zeros(4), torch.ones(4), -1.0)
    _raises("rate: expected a finite number >= 0", F.update_expert_bias, torch.zeros(4), torch.ones(4), math.inf)
    assert F.update_expert_bias(torch.ones(4), torch.tensor([1, 5, 2, 0]), 0.0).tolist() == [1.0] * 4  # a rate of 0 is a rate: no step
    _raises("counts: expected int or float counts, got torch.bool", F.update_expert_bias, torch.zeros(3), torch.tensor([True, False, True]), 1e-3)


@pytest.mark.parametrize("proportional", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_update_expert_bias_of_a_nan_count_is_nan(bad, proportional):
    """A NaN or infinite count (a broken reduction) poisons the update instead of freezing
    it: torch.sign(NaN) is 0, so the sign rule used to return the bias unchanged, silently.
    route(check=True) then names the NaN bias."""
    bias = F.update_expert_bias(torch.zeros(4), torch.tensor([10.0, 2.0, 6.0, bad]), 1e-3, proportional=proportional)
    assert bias.isnan().all()
    with pytest.raises(ValueError, match="expert_bias: contains NaN"):
        F.route(torch.randn(3, 4), 2, score="sigmoid", expert_bias=bias)


# ---------------------------------------------------------------------------- load stats


def test_load_stats_worked_numbers():
    """counts [10, 2, 6, 6] of 32 slots: mean 6, max/mean 10/6, population std sqrt(8),
    cv sqrt(8)/6, 24 of 32 slots kept: a quarter dropped."""
    for counts in (torch.tensor([10, 2, 6, 6]), torch.tensor([10.0, 2.0, 6.0, 6.0]), torch.tensor([10, 2, 6, 6], dtype=torch.int32)):
        for n_slots in (32, torch.tensor(32), torch.tensor(32.0)):
            stats = F.load_stats(counts, n_slots)
            assert list(stats) == ["max_over_mean", "cv", "dropped_fraction"]
            assert all(v.shape == () and v.dtype == torch.float32 for v in stats.values())
            torch.testing.assert_close(stats["max_over_mean"], torch.tensor(10 / 6))
            torch.testing.assert_close(stats["cv"], torch.tensor(8**0.5 / 6))
            torch.testing.assert_close(stats["dropped_fraction"], torch.tensor(0.25))


def test_load_stats_layers_balance_and_edge_cases():
    counts_LE = torch.tensor([[10, 2, 6, 6], [8, 8, 8, 8], [0, 0, 0, 0], [0, 0, 0, 32]])
    stats = F.load_stats(counts_LE, 32)
    assert all(v.shape == (4,) and v.dtype == torch.float32 for v in stats.values())
    torch.testing.assert_close(stats["max_over_mean"], torch.tensor([10 / 6, 1.0, 0.0, 4.0]))
    torch.testing.assert_close(stats["cv"], torch.tensor([8**0.5 / 6, 0.0, 0.0, 3**0.5]))
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor([0.25, 0.0, 1.0, 0.0]))
    for row, counts_E in enumerate(counts_LE):  # each layer as its own [E]
        for name, value in F.load_stats(counts_E, 32).items():
            torch.testing.assert_close(value, stats[name][row])
    # n_slots 0: nothing asked, nothing dropped (it said 1.0, all dropped); counts past the slots asked stay visible (below 0)
    torch.testing.assert_close(F.load_stats(torch.tensor([0, 0]), 0)["dropped_fraction"], torch.tensor(0.0))
    torch.testing.assert_close(F.load_stats(torch.tensor([0, 0]), torch.tensor(0))["dropped_fraction"], torch.tensor(0.0))
    torch.testing.assert_close(F.load_stats(torch.tensor([1, 1]), 0)["dropped_fraction"], torch.tensor(-2.0))
    # half-precision counts (each exact in its dtype) were summed in it: fp16's 100000 slots overflowed (inf), fp16 counts
    # [40000, 40000] summed to inf (nan), bf16 counts summing to 8224 of 8225 slots gave 0.0078
    for counts, n, want in (([10, 10], 100000, 0.9998), ([40000, 40000], 80000, 0.0), ([4096, 4096, 32], 8225, 1 / 8225)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
            if dtype == torch.bfloat16 and counts[0] == 40000:
                continue  # 40000 is not a bf16 value
            got = F.load_stats(torch.tensor(counts, dtype=dtype), n)["dropped_fraction"]
            torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=0, msg=f"{dtype} {counts} of {n}")


def test_load_stats_reads_nothing_on_the_host():
    counts = F.tokens_per_expert(torch.randint(-1, 8, (64, 2)), 8)
    with HostReads() as reads:
        stats = F.load_stats(counts, torch.tensor(128))
        F.load_stats(torch.stack([counts, counts]), 128)
    assert reads.count == 0, reads.sites
    kept = int(counts.sum())
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor(1 - kept / 128))


def test_docstring_examples():
    import doctest

    from fmoe.ops import balance

    assert doctest.testmod(balance).failed == 0


def test_load_stats_bad_inputs():
    _raises(r"counts: expected a tensor \[E\] or \[L, E\] with E >= 1", F.load_stats, [1, 2], 4)
    _raises(r"counts: expected a tensor \[E\] or \[L, E\] with E >= 1", F.load_stats, torch.ones(2, 2, 2), 4)
    _raises(r"counts: expected a tensor \[E\] or \[L, E\] with E >= 1", F.load_stats, torch.ones(3, 0), 4)
    _raises("counts: expected int or float counts", F.load_stats, torch.ones(3, dtype=torch.bool), 4)
    _raises("n_slots: expected an int or a 0-D tensor", F.load_stats, torch.ones(3), torch.tensor([4]))
    _raises("n_slots: expected >= 0", F.load_stats, torch.ones(3), -1)
    _raises("n_slots: expected an int", F.load_stats, torch.ones(3), 4.0)


def test_load_stats_refuses_a_bool_n_slots_tensor():
    """n_slots is a slot count: a bool tensor read as 1 slot (dropped_fraction -23 for the
    counts below). Its value, like any n_slots tensor's, is not checked: load_stats reads
    nothing on the host (a negative one is the caller's error, documented)."""
    counts = torch.tensor([10, 2, 6, 6])
    _raises(r"n_slots: expected an int or float tensor \(a slot count\), got torch.bool", F.load_stats, counts, torch.tensor(True))
    _raises(r"n_slots: expected an int or float tensor \(a slot count\), got torch.complex64", F.load_stats, counts, torch.tensor(32 + 0j))
    with HostReads() as reads:
        F.load_stats(counts, torch.tensor(32))
        F.load_stats(counts, torch.tensor(32.0))
    assert reads.count == 0, reads.sites


# ---------------------------------------------------------------------------- registration


def test_custom_ops_pass_opcheck(device):
    logits = torch.randn(7, 12, device=device, requires_grad=True)
    for sigmoid in (False, True):
        torch.library.opcheck(torch.ops.fmoe.aux_scores_fwd.default, (logits, 3, sigmoid))
    torch.library.opcheck(torch.ops.fmoe.logsumexp_fwd.default, (logits,))


def test_losses_compile_without_graph_breaks(device):
    def losses(logits):
        scores, experts, counts = F.aux_scores(logits, 2, return_counts=True, impl="triton")
        return F.load_balancing_loss(scores, counts, k=2, n_tokens=logits.shape[0]) + F.z_loss(logits, impl="triton")

    logits = torch.randn(10, 8, device=device)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    torch.compile(losses, backend="aot_eager", fullgraph=True)(x1).backward()
    losses(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.gpu
def test_gpu_balance_real_shapes():
    logits = torch.randn(65536, 256, device="cuda", dtype=torch.bfloat16)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    s1, e1, c1 = F.aux_scores(x1, 8, score="sigmoid", return_counts=True)
    s2, e2, c2 = F.aux_scores(x2, 8, score="sigmoid", return_counts=True, impl="torch")
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-7)
    assert int(c1.sum()) == 65536 * 8 and (e1 == e2).all(-1).float().mean() > 0.999
    z1, z2 = F.z_loss(x1), F.z_loss(x2, impl="torch")
    torch.testing.assert_close(z1, z2, rtol=1e-5, atol=1e-6)
    (s1.square().sum() + z1).backward()
    (s2.square().sum() + z2).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1.6e-2, atol=1e-5)


def test_masks_of_the_right_count_but_another_shape_are_refused():
    """A [5, 1] or [1, 5] bool mask holds 5 values but is not the [T] mask the ops take (a
    [T, 1] mask would broadcast against [T, E] scores into a [T, T] selection)."""
    logits = torch.randn(5, 4)
    scores, experts = F.aux_scores(logits, 2)
    for bad in (torch.ones(5, 1, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)):
        _raises(r"mask: expected None or a bool tensor \[5\]", F.z_loss, logits, mask=bad)
        _raises(r"mask: expected None or a bool tensor \[5\]", mask_tokens, scores, experts, bad)
