"""Sparse attention (fmoe/ops/sparse.py): a worked example, the reference against dense
attention under the mask the index makes (values and every gradient), the Triton kernels
against the reference (the interpreter on CPU; real shapes on a GPU), their registration,
torch.compile, and the argument checks."""

import contextlib
import math

import pytest
import torch

from fmoe.ops import indexer_scores, sparse_attention
from fmoe.ops.sparse import _sparse_attention_ref
from tests.conftest import DEVICE


def _inputs(T, N, D, S, J, *, dtype=torch.float32, device="cpu", empty=0.3, seed=0):
    """q [T, N, D], kv [S, D], index [T, J] of distinct keys per row with a fraction `empty`
    of -1 slots, and row 1 all empty (a query without keys)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, D, generator=g)
    kv = torch.randn(S, D, generator=g)
    index = torch.stack([torch.randperm(S, generator=g)[:J] for _ in range(T)])
    index = torch.where(torch.rand(T, J, generator=g) < empty, -1, index)
    if T > 1:
        index[1] = -1
    return q.to(device, dtype), kv.to(device, dtype), index.to(device)


def _dense(q, kv, index, v_dim, scale):
    """The definition by dense attention: the [T, S] mask of the keys each row names (a key
    named twice counted twice: its score gets + log 2)."""
    T, N, S = q.shape[0], q.shape[1], kv.shape[0]
    counts = torch.zeros(T, S + 1).scatter_add_(1, torch.where(index >= 0, index, S).long(), torch.ones(index.shape))[:, :S]
    rows = (index >= 0).any(-1).nonzero()[:, 0]  # the queries with keys; the others: o = 0, lse = -inf
    s = torch.einsum("tnd,sd->tns", q.float()[rows], kv.float()) * scale + torch.log(counts[rows])[:, None, :]
    o = torch.zeros(T, N, v_dim).index_copy(0, rows, torch.softmax(s, -1) @ kv.float()[:, :v_dim])
    return o, torch.full((T, N), float("-inf")).index_copy(0, rows, torch.logsumexp(s, -1))


def test_worked_example():
    """One head, D = 2, Dv = 1, scale 1: q = (1, 0); keys (0, 1), (log 3, 5), (7, 7) as rows 0..2.
    Query 0 names keys 0 and 1 (and an empty slot): scores 0 and log 3, p = (1/4, 3/4),
    o = 0/4 + 3/4 log 3, lse = log 4. Query 1 names none: o = 0, lse = -inf."""
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    kv = torch.tensor([[0.0, 1.0], [math.log(3), 5.0], [7.0, 7.0]])
    index = torch.tensor([[0, -1, 1], [-1, -1, -1]])
    for impl in ("torch", "triton"):
        o, lse = sparse_attention(q, kv, index, v_dim=1, scale=1.0, impl=impl)
        torch.testing.assert_close(o.flatten(), torch.tensor([0.75 * math.log(3), 0.0]))
        assert lse[0, 0].item() == pytest.approx(math.log(4)) and lse[1, 0].item() == float("-inf")


@pytest.mark.parametrize("T,N,D,v_dim,S,J", [(9, 3, 12, 8, 20, 5), (5, 1, 16, 16, 7, 7), (6, 4, 6, 2, 11, 1)])
def test_reference_is_dense_attention_under_the_index_mask(T, N, D, v_dim, S, J):
    """Values and every gradient (random upstream gradients on o and lse), a key named twice
    in a row counting twice."""
    q, kv, index = _inputs(T, N, D, S, J)
    index[0, 0] = index[0, -1] = 3  # twice
    q.requires_grad_(), kv.requires_grad_()
    go, glse = torch.randn(T, N, v_dim), torch.randn(T, N)
    got = _sparse_attention_ref(q, kv, index, v_dim, 0.7)
    want = _dense(q, kv, index, v_dim, 0.7)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    live = torch.isfinite(want[1])  # the dense lse's -inf rows have no gradient to give
    grads = [torch.autograd.grad((o * go).sum() + (torch.where(live, lse, 0.0) * glse).sum(), [q, kv]) for o, lse in (got, want)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(grads[0][0][1].abs().max()) == 0.0  # the query without keys


@pytest.mark.parametrize("S,J", [(3, 0), (0, 2)], ids=["no slots", "no keys"])
@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
def test_no_slots_or_no_keys_give_zeros_and_minus_inf(S, J, impl, device):
    """J = 0 (no slot) and S = 0 (no key: every slot -1) are valid: every query is one
    without keys (o = 0, lse = -inf, p = 0), and the backward gives zero gradients."""
    from fmoe.ops import sparse_attention_probs

    T, N, D = 2, 2, 4
    q = torch.randn(T, N, D, device=device, requires_grad=True)
    kv = torch.randn(S, D, device=device, requires_grad=True)
    index = torch.full((T, J), -1, device=device)
    o, lse = sparse_attention(q, kv, index, impl=impl)
    assert torch.equal(o, torch.zeros(T, N, D, device=device))
    assert torch.equal(lse, torch.full((T, N), float("-inf"), device=device))
    dq, dkv = torch.autograd.grad(o.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), [q, kv])
    assert torch.equal(dq, torch.zeros_like(q)) and torch.equal(dkv, torch.zeros_like(kv))
    p = sparse_attention_probs(q, kv, index, lse, impl=impl)
    assert torch.equal(p, torch.zeros(T, J, device=device))


@contextlib.contextmanager
def _deterministic(enabled: bool):
    """torch.use_deterministic_algorithms(enabled) for a with block, then as it was."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("T,N,D,v_dim,S,J", [(7, 3, 12, 8, 20, 5), (3, 70, 20, 16, 9, 9), (5, 2, 8, 8, 40, 33), (3, 2, 70, 64, 6, 2),
                                             (3, 2, 16, 8, 40, 40)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_kernels_match_the_reference(T, N, D, v_dim, S, J, index_dtype, device):
    """Forward and backward, dkv by atomics (the default) and by key (deterministic
    algorithms): heads beyond one block (70 > 64), slots beyond one block (33), no rope
    channels (v_dim = D), a value width that is not a power of two's neighbour (70 = 64 + 6),
    empty slots and a query without keys, keys named twice in a row and by many rows."""
    q, kv, index = _inputs(T, N, D, S, J, device=device)
    index = index.to(index_dtype)
    index[0, 0] = index[0, -1] = 2
    if J == 40:  # each row's best key in the second block of slots: the online softmax rescales what the first block summed
        index[:, 35] = torch.arange(T, device=device) + S - T
        with torch.no_grad():
            kv[S - T:, :D] = 3 * q.mean(1)
    q.requires_grad_(), kv.requires_grad_()
    go, glse = torch.randn(T, N, v_dim, device=device), torch.randn(T, N, device=device)
    results = []
    for impl, deterministic in (("torch", False), ("triton", False), ("triton", True)):
        with _deterministic(deterministic):
            o, lse = sparse_attention(q, kv, index, v_dim=v_dim, scale=0.4, impl=impl)
            finite = torch.isfinite(lse)
            grads = torch.autograd.grad((o * go).sum() + (torch.where(finite, lse, 0.0) * glse).sum(), [q, kv])
        results.append((o, torch.where(finite, lse, 0.0), finite, *grads))
    for got in results[1:]:
        for name, a, b in zip(("o", "lse", "finite", "dq", "dkv"), results[0], got):
            if name == "finite":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("T,N,D,v_dim,S,J", [(7, 3, 12, 8, 20, 5), (4, 17, 20, 16, 9, 9), (5, 2, 8, 8, 40, 33), (3, 70, 20, 16, 9, 9)])
def test_probabilities_of_the_slots(T, N, D, v_dim, S, J, device):
    """sparse_attention_probs: each slot's probability summed over the heads, from the
    forward's lse; the kernel is the reference, each row with keys sums to N (every head's
    distribution to 1), an empty slot and a row without keys give 0, and it carries no
    gradient."""
    from fmoe.ops import sparse_attention_probs

    q, kv, index = _inputs(T, N, D, S, J, device=device)
    q.requires_grad_()
    lse = sparse_attention(q, kv, index, v_dim=v_dim, scale=0.4)[1]
    got = {impl: sparse_attention_probs(q, kv, index, lse, v_dim=v_dim, scale=0.4, impl=impl) for impl in ("torch", "triton")}
    torch.testing.assert_close(got["triton"], got["torch"], rtol=1e-5, atol=1e-6)
    p = got["triton"]
    assert not p.requires_grad and p.dtype == torch.float32 and p.shape == (T, J)
    has = (index >= 0).any(-1)
    torch.testing.assert_close(p.sum(-1)[has], torch.full((int(has.sum()),), float(N), device=device))
    assert float(p[index < 0].abs().max()) == 0.0 and not bool(has[1])
    with pytest.raises(ValueError, match=r"lse: expected sparse_attention's float32 \[%d, %d\]" % (T, N)):
        sparse_attention_probs(q, kv, index, lse[:, :1])
    with pytest.raises(ValueError, match=r"lse: expected sparse_attention's float32 \[%d, %d\], got torch.float64" % (T, N)):
        sparse_attention_probs(q, kv, index, lse.double())
    with pytest.raises(ValueError, match=r"index: expected keys in 0 .. S-1 = %d or -1" % (kv.shape[0] - 1)):  # one past the keys
        sparse_attention_probs(q, kv, torch.full_like(index, kv.shape[0]), lse)
    with pytest.raises(ValueError, match=r"kv: expected \[S, %d\] \(q's D\)" % D):  # sparse_attention's checks
        sparse_attention_probs(q, kv[:, :-1], index, lse)


def test_kernels_in_bf16_match_the_reference(device):
    """bf16 q and kv: the kernels' o, lse, dq, dkv, the slots' probabilities and the indexer's
    scores follow the reference of the same values (float32 products of bf16 numbers; under
    the interpreter, whose own bf16 products are wrong by about 1e9, too)."""
    from fmoe.ops import sparse_attention_probs

    q, kv, index = _inputs(6, 3, 24, 20, 5, dtype=torch.bfloat16, device=device)
    q.requires_grad_(), kv.requires_grad_()
    go = torch.randn(6, 3, 16, device=device, dtype=torch.bfloat16)
    got = {}
    for impl in ("torch", "triton"):
        o, lse = sparse_attention(q, kv, index, v_dim=16, scale=0.3, impl=impl)
        grads = torch.autograd.grad((o * go).float().sum(), [q, kv])
        probs = sparse_attention_probs(q, kv, index, lse, v_dim=16, scale=0.3, impl=impl)
        got[impl] = (o.float(), lse, *(g.float() for g in grads), probs)
    for name, want, have in zip(("o", "lse", "dq", "dkv", "probs"), got["torch"], got["triton"]):
        torch.testing.assert_close(have, want, rtol=2e-2, atol=2e-2, msg=name)  # one bf16 ulp of the outputs
    qi, w, k = torch.randn(5, 3, 16, device=device).bfloat16(), torch.randn(5, 3, device=device), torch.randn(7, 16, device=device).bfloat16()
    torch.testing.assert_close(indexer_scores(qi, w, k, impl="triton"), indexer_scores(qi, w, k, impl="torch"), rtol=1e-5, atol=1e-5)


def test_kernels_are_deterministic_when_asked(device):
    """Under torch.use_deterministic_algorithms(True) (fmoe.train.set_deterministic) the dkv
    kernel sums each key's rows in one program, in slot order: bit-identical runs. (By
    default the atomics' order may differ from run to run on a GPU.)"""
    q, kv, index = _inputs(6, 4, 12, 5, 5, device=device, empty=0.0)  # every row names every key
    q.requires_grad_(), kv.requires_grad_()
    go = torch.randn(6, 4, 8, device=device)
    with _deterministic(True):
        runs = [torch.autograd.grad((sparse_attention(q, kv, index, v_dim=8, impl="triton")[0] * go).sum(), [q, kv]) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_registration_and_compile(device):
    """torch.library.opcheck of the forward (and its autograd), and torch.compile(fullgraph=True)
    of forward and backward giving eager's values."""
    from fmoe.ops.sparse import _sparse_attention_fwd

    q, kv, index = _inputs(5, 2, 12, 9, 4, device=device)
    torch.library.opcheck(_sparse_attention_fwd, (q.requires_grad_(), kv.requires_grad_(), index, 8, 0.5),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def loss(q, kv):
        o, lse = sparse_attention(q, kv, index, v_dim=8, scale=0.5, check=False, impl="triton")
        return (o * o).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    eager, compiled = loss(q, kv), torch.compile(loss, backend="aot_eager", fullgraph=True)(q, kv)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(eager, [q, kv]), torch.autograd.grad(compiled, [q, kv])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    q, kv, index = _inputs(4, 2, 8, 6, 3)
    cases = [
        (dict(q=q[0]), "q: expected a 3-D tensor"),
        (dict(kv=kv[:, :5]), r"kv: expected \[S, 8\] \(q's D\)"),
        (dict(kv=kv.double()), "kv: expected dtype float32"),
        (dict(index=index.float()), "index: expected dtype int32 or int64"),
        (dict(index=index[:3]), r"index: expected \[4, J\] \(q's T\)"),
        (dict(index=index + 7), r"index: expected keys in 0 .. S-1 = 5 or -1 \(an empty slot\), got values in"),
        (dict(index=torch.full_like(index, -2)), r"index: expected keys in 0 .. S-1 = 5 or -1 \(an empty slot\), got values in -2 .. -2"),
        (dict(index=torch.full_like(index, 6)), r"index: expected keys in 0 .. S-1 = 5 or -1 \(an empty slot\), got values in 6 .. 6"),
        (dict(kv=kv.bfloat16()), r"kv: expected \[S, 8\] \(q's D\) in torch.float32 on cpu, got \[6, 8\] torch.bfloat16"),
        (dict(v_dim=9), "v_dim: expected an int in 1 .. D = 8"),
        (dict(scale=0.0), "scale: expected a positive number"),
        (dict(impl="cuda"), "impl: expected one of"),
        (dict(check="no"), "check: expected a bool, got 'no'"),  # it ran the check
    ]
    for change, message in cases:
        args = dict(q=q, kv=kv, index=index) | change
        kw = {k: args.pop(k) for k in ("v_dim", "scale", "impl", "check") if k in args}
        with pytest.raises(ValueError, match=message):
            sparse_attention(args["q"], args["kv"], args["index"], **kw)
    # check=False reads no value on the host: tests/ops/test_checks.py


@pytest.mark.parametrize("impl,deterministic", [("torch", False), ("triton", False), ("triton", True)],
                         ids=["torch", "triton", "triton-deterministic"])
def test_unchecked_keys_outside_kv_are_empty_slots(impl, deterministic, device):
    """check=False: an index value outside -1 .. S-1 (S, S + 3, -5) is an empty slot, as -1
    is: o, lse, dq, dkv and the slots' probabilities are those of the index with -1 there, and
    no row outside kv is read (kv is the first S rows of a buffer whose next rows hold 3: a
    read of them would change the scores) or written (dkv, by atomics or by key)."""
    from fmoe.ops import sparse_attention_probs

    T, N, D, S = 4, 2, 8, 5
    q, _, index = _inputs(T, N, D, S, 3, device=device, empty=0.0)
    buf = torch.full((S + 8, D), 3.0, device=device)
    buf[:S] = torch.randn(S, D, device=device)
    kv = buf[:S].requires_grad_()
    q.requires_grad_()
    index[0, 1], index[2, 0], index[3, 2] = S, S + 3, -5
    masked = torch.where((index >= 0) & (index < S), index, -1)
    go = torch.randn(T, N, D, device=device)
    got = []
    for idx, check in ((index, False), (masked, True)):
        with _deterministic(deterministic):
            o, lse = sparse_attention(q, kv, idx, scale=0.5, check=check, impl=impl)
            finite = torch.isfinite(lse)
            grads = torch.autograd.grad((o * go).sum() + torch.where(finite, lse, 0.0).sum(), [q, kv])
        p = sparse_attention_probs(q, kv, idx, lse.detach(), scale=0.5, check=check, impl=impl)
        got.append((o, torch.where(finite, lse, 0.0), *grads, p))
    for name, have, want in zip(("o", "lse", "dq", "dkv", "probs"), *got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=name)
    assert float(got[0][-1][masked < 0].abs().max()) == 0.0
    # checked (the default), sparse_attention_probs reads the index's values as sparse_attention does
    with pytest.raises(ValueError, match=r"index: expected keys in 0 .. S-1 = 4 or -1 \(an empty slot\), got values in -5 .. 8"):
        sparse_attention_probs(q, kv, index, got[1][1], scale=0.5, impl=impl)


@pytest.mark.gpu
def test_gpu_kernels_at_deepseek_v32_shapes():
    """bf16 at DeepSeek-V3.2's absorbed shapes (one tp rank's 16 heads of 576 = 512 + 64
    channels, 2048 slots, 4096 keys) against the float32 reference, dkv by atomics and by key."""
    T, N, D, Dv, S, J = 256, 16, 576, 512, 4096, 2048
    q, kv, index = _inputs(T, N, D, S, J, dtype=torch.bfloat16, device="cuda", empty=0.1)
    q.requires_grad_(), kv.requires_grad_()
    go = torch.randn(T, N, Dv, device="cuda", dtype=torch.bfloat16)
    x32, y32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    outs = []
    for x, y, deterministic in ((x32, y32, False), (q, kv, False), (q, kv, True)):
        with _deterministic(deterministic):
            o, _ = sparse_attention(x, y, index, v_dim=Dv, scale=192**-0.5, impl="triton" if x.dtype == torch.bfloat16 else "torch")
            outs.append((o, *torch.autograd.grad((o.float() * go.float()).sum(), [x, y])))
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm()) < 2e-2


# -------------------------------------------------------------------- the indexer's scores


def test_indexer_scores_worked_example():
    """Two heads, D = 2, scale 1: q = (1, 0) and (0, 1), weights 2 and -1; keys (3, -1) and
    (-2, 4). Head 0's products 3, -2 -> relu 3, 0; head 1's -1, 4 -> 0, 4. Scores:
    2 * 3 - 1 * 0 = 6 and 2 * 0 - 1 * 4 = -4."""
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    w = torch.tensor([[2.0, -1.0]])
    k = torch.tensor([[3.0, -1.0], [-2.0, 4.0]])
    for impl in ("torch", "triton"):
        assert indexer_scores(q, w, k, scale=1.0, impl=impl).tolist() == [[6.0, -4.0]], impl


@pytest.mark.parametrize("T,N,D,S", [(5, 3, 24, 70), (70, 2, 16, 9), (65, 4, 128, 130), (1, 1, 8, 1)])
def test_indexer_scores_kernel_matches_the_reference(T, N, D, S, device):
    """Blocks of queries and keys beyond one (64), D not a power of two (24) and below tl.dot's
    16 (8), one query and one key; no gradient, whatever the inputs', and no host read."""
    from fmoe.train.metrics import HostReads

    g = torch.Generator().manual_seed(T + S)
    q, w, k = (torch.randn(*shape, generator=g).to(device).requires_grad_() for shape in ((T, N, D), (T, N), (S, D)))
    want = indexer_scores(q, w, k, scale=0.3, impl="torch")
    with HostReads() as reads:
        got = indexer_scores(q, w, k, scale=0.3, impl="triton")
    assert reads.count == 0, reads.sites
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32 and got.shape == (T, S) and not got.requires_grad and not want.requires_grad
    # the definition, head by head; scale defaults to 1 / sqrt(D)
    by_head = sum(w[:, n, None] * torch.relu(q[:, n] @ k.T * D**-0.5) for n in range(N))
    torch.testing.assert_close(indexer_scores(q, w, k, impl="triton"), by_head.detach(), rtol=1e-5, atol=1e-5)


def test_indexer_scores_auto_takes_the_kernel_for_16_bit_inputs_alone(monkeypatch):
    """impl="auto" where Triton runs (CUDA; here forced): the kernel for 16-bit q and k, the
    reference (torch's float32 products, faster than the IEEE kernel) for float32."""
    from fmoe.ops import sparse

    calls = []
    real = sparse._indexer_scores_ref
    monkeypatch.setattr(sparse, "use_triton", lambda impl, *tensors: impl != "torch")
    monkeypatch.setattr(sparse, "_indexer_scores_ref", lambda *a: calls.append(a[0].dtype) or real(*a))
    q, w, k = torch.randn(3, 2, 16), torch.randn(3, 2), torch.randn(5, 16)
    want = real(q.bfloat16(), w, k.bfloat16(), 0.25)
    torch.testing.assert_close(indexer_scores(q.bfloat16(), w, k.bfloat16()), want, rtol=1e-5, atol=1e-5)
    assert calls == []
    indexer_scores(q, w, k)
    indexer_scores(q, w, k, impl="triton")
    assert calls == [torch.float32]


def test_indexer_scores_registration_and_compile(device):
    from fmoe.ops.sparse import _indexer_scores

    q, w, k = torch.randn(9, 2, 16, device=device), torch.randn(9, 2, device=device), torch.randn(70, 16, device=device)
    torch.library.opcheck(_indexer_scores, (q, w, k, 0.25), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda q, w, k: indexer_scores(q, w, k, impl="triton"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, w, k), indexer_scores(q, w, k, impl="triton"), rtol=0, atol=0)


def test_indexer_scores_bad_inputs():
    q, w, k = torch.randn(4, 2, 8), torch.randn(4, 2), torch.randn(6, 8)
    cases = [
        (dict(q=q[0]), "q: expected a 3-D tensor"),
        (dict(w=w[:3]), r"w: expected \[4, 2\] \(q's T and N\)"),
        (dict(w=w.long()), "w: expected dtype"),
        (dict(k=k[:, :5]), r"k: expected \[S, 8\] \(q's D\) in torch.float32"),
        (dict(k=k.double()), "k: expected dtype float32"),
        (dict(k=k.bfloat16()), r"k: expected \[S, 8\] \(q's D\) in torch.float32 on cpu, got \[6, 8\] torch.bfloat16"),
        (dict(scale=-1.0), "scale: expected a positive number"),
        (dict(impl="cuda"), "impl: expected one of"),
    ]
    for change, message in cases:
        args = dict(q=q, w=w, k=k) | change
        kw = {key: args.pop(key) for key in ("scale", "impl") if key in args}
        with pytest.raises(ValueError, match=message):
            indexer_scores(args["q"], args["w"], args["k"], **kw)
    # no head (N = 0): zeros, a sum of nothing (the reference returned None); no query, no key: empty
    for impl in ("torch", "auto"):
        out = indexer_scores(q[:, :0], w[:, :0], k, impl=impl)
        assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(4, 6))
    assert indexer_scores(q[:0], w[:0], k).shape == (0, 6) and indexer_scores(q, w, k[:0]).shape == (4, 0)


@pytest.mark.gpu
def test_gpu_indexer_scores_at_deepseek_v32_shapes():
    """DeepSeek-V3.2's indexer (64 heads of 128 channels) over 4096 keys: float32 within 1e-5 of
    the reference, bf16 (tensor cores) within 1% of it (relative norm)."""
    T, N, D, S = 512, 64, 128, 4096
    q, w, k = torch.randn(T, N, D, device="cuda"), torch.randn(T, N, device="cuda") * N**-0.5, torch.randn(S, D, device="cuda")
    want = indexer_scores(q, w, k, impl="torch")
    torch.testing.assert_close(indexer_scores(q, w, k, impl="triton"), want, rtol=1e-5, atol=1e-4)
    got = indexer_scores(q.bfloat16(), w, k.bfloat16(), impl="triton")
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_the_indexer_reference_sums_a_group_of_heads_at_a_time():
    """indexer_scores' torch path at T = S = 1024 over 64 heads, in a fresh process: its peak
    grows by the products of a group of 4 heads (16 MiB, twice) and a few [T, S] sums (4 MiB
    each), not by the [T, N, S] products of every head at once (256 MiB, twice: 512 MiB)."""
    import subprocess
    import sys

    script = """
import resource, torch
torch.set_num_threads(1)
from fmoe.ops import indexer_scores
q, w, k = torch.randn(1024, 64, 16), torch.randn(1024, 64), torch.randn(1024, 16)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
indexer_scores(q, w, k, impl="torch")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 64, out.stdout  # MiB
