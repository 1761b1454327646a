"""cross_entropy and linear_cross_entropy (SPEC.md section 6)."""

import math

import pytest
import torch
import torch.nn.functional as TF

from fmoe.ops import loss
from fmoe.ops.backend import interpreting
from fmoe.ops.loss import cross_entropy, linear_cross_entropy

IGNORE = -100
# (N, V): N = 1 and odd sizes; V of one small block, not a power of two, up to 1000
SHAPES = [(1, 5), (16, 5), (7, 100), (37, 1000)]
# the loss of logits made by a matmul: chunks of rows may round a bf16 logit differently
VALUE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-3, atol=2e-3)}


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _labels(N, V, device, dtype=torch.int64):
    """Random labels with every third row (from row 1) ignored."""
    labels = torch.randint(0, V, (N,), device=device, dtype=dtype)
    labels[1::3] = IGNORE
    return labels


def _grads(fn, *inputs, upstream):
    """Loss and gradients of upstream * fn(*clones of inputs) (None where not required)."""
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    value = fn(*leaves)
    (value * upstream).backward()
    return value.detach(), [x.grad for x in leaves]


def _grad_tol(dtype, upstream, labels, reduction="mean"):
    """Gradient tolerances: bf16, a unit in the last place (the interpreter truncates to
    bf16 where the GPU rounds to nearest); both dtypes, the float32 cancellation in the
    label's entry p - 1: a one-ulp difference in lse (~1e-6 at lse ~ 10) moves it by ~1e-6
    times the row's scale."""
    scale = abs(float(upstream))
    if reduction == "mean":
        scale /= max(int((labels != IGNORE).sum()), 1)
    return dict(rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-6 * scale)


def _close_norm(actual, expected, rel):
    """||actual - expected|| <= rel ||expected||: the test for GEMM outputs, whose elements
    come from cancelling sums."""
    err = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert err <= rel, f"relative error {err:.3g} > {rel}"


# ---------------------------------------------------------------------------- reference


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_torch(shape, reduction):
    N, V = shape
    logits = torch.randn(N, V) * 3
    labels = _labels(N, V, "cpu")
    upstream = torch.randn(())
    ours, (g_ours,) = _grads(lambda x: loss.cross_entropy_ref(x, labels, IGNORE, reduction == "mean"), logits.requires_grad_(), upstream=upstream)
    theirs, (g_theirs,) = _grads(lambda x: TF.cross_entropy(x, labels, ignore_index=IGNORE, reduction=reduction), logits, upstream=upstream)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g_ours, g_theirs)


def test_worked_numbers():
    # equal logits: ln V per row; the ignored row counts for neither the sum nor the mean
    logits = torch.tensor([[0.0, 0.0], [5.0, 5.0], [1.0, 2.0]])
    assert cross_entropy(logits, torch.tensor([1, IGNORE, 0])).item() == pytest.approx((math.log(2) + math.log(1 + math.e)) / 2)
    assert cross_entropy(logits, torch.tensor([1, IGNORE, 0]), reduction="sum").item() == pytest.approx(math.log(2) + math.log(1 + math.e))
    assert cross_entropy(torch.zeros(3, 7), torch.tensor([0, 6, 2], dtype=torch.int32)).item() == pytest.approx(math.log(7))
    assert cross_entropy(logits, torch.tensor([7, 1, 7]), ignore_index=7).item() == pytest.approx(math.log(2))


# ---------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape, dtype, reduction, device):
    N, V = shape
    logits = (3 * torch.randn(N, V, device=device)).to(dtype).requires_grad_()
    labels = _labels(N, V, device, torch.int32 if N % 2 else torch.int64)
    upstream = torch.randn((), device=device)
    l_tri, (g_tri,) = _grads(lambda x: cross_entropy(x, labels, reduction=reduction, impl="triton"), logits, upstream=upstream)
    l_ref, (g_ref,) = _grads(lambda x: cross_entropy(x, labels, reduction=reduction, impl="torch"), logits, upstream=upstream)
    assert l_tri.dtype == torch.float32 and l_tri.shape == ()
    assert g_tri.dtype == dtype
    torch.testing.assert_close(l_tri, l_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_tri, g_ref, **_grad_tol(dtype, upstream, labels, reduction))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_softcap_is_the_loss_of_the_capped_logits(shape, dtype, device, monkeypatch):
    """softcap c: the loss and gradient of c tanh(logits / c), against torch's autograd of it,
    on the Triton path (one block and, with 32-column steps, a loop over the vocabulary;
    -inf logits stay masked out) and on the torch path."""
    N, V = shape
    logits = (8 * torch.randn(N, V, device=device)).to(dtype)
    logits[0, 0] = float("-inf")  # capped, but still no probability
    logits.requires_grad_()
    labels = _labels(N, V, device)
    labels[0] = V - 1
    upstream = torch.randn((), device=device)
    capped = lambda x: TF.cross_entropy(torch.tanh(x.float() / 5.0) * 5.0, labels.long(), ignore_index=IGNORE)  # noqa: E731
    l_want, (g_want,) = _grads(capped, logits, upstream=upstream)
    tol = _grad_tol(dtype, upstream, labels)
    for impl, block in (("triton", None), ("triton", 32), ("torch", None)):
        if block is not None:
            monkeypatch.setattr(loss, "_MAX_BLOCK_V", block)
        l_got, (g_got,) = _grads(lambda x: cross_entropy(x, labels, softcap=5.0, impl=impl), logits, upstream=upstream)
        torch.testing.assert_close(l_got, l_want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_got, g_want, **tol)
    assert g_got[0, 0] == 0
    assert (cross_entropy(logits, labels, impl="triton") - l_want).abs() > 1e-2  # the cap counts at these logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_softcap_matches_the_unfused_capped_logits(dtype, device):
    """linear_cross_entropy's softcap: each chunk's logits capped in the kernel, the value and
    the three gradients (h, weight, bias) those of the whole capped logits; the in-place
    backward of cross_entropy likewise."""
    N, H, V = 23, 16, 50
    h = torch.randn(N, H, device=device).to(dtype).requires_grad_()
    w = torch.randn(V, H, device=device).to(dtype).requires_grad_()
    b = torch.randn(V, device=device).to(dtype).requires_grad_()
    labels = _labels(N, V, device)
    upstream = torch.randn((), device=device)
    whole = lambda a, c, d: TF.cross_entropy(torch.tanh((a @ c.T + d).float() / 3.0) * 3.0, labels, ignore_index=IGNORE)  # noqa: E731
    expected, grads_ref = _grads(whole, h, w, b, upstream=upstream)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    for impl, chunk_rows in (("torch", None), ("triton", 1), ("triton", 7)):
        fused = lambda a, c, d: linear_cross_entropy(a, c, labels, bias=d, chunk_rows=chunk_rows, impl=impl, softcap=3.0)  # noqa: E731
        value, grads = _grads(fused, h, w, b, upstream=upstream)
        torch.testing.assert_close(value, expected, **VALUE_TOL[dtype])
        for got, want in zip(grads, grads_ref):
            _close_norm(got, want, rel)
    logits = (h @ w.T + b).detach()
    l_in, (g_in,) = _grads(lambda x: cross_entropy(x, labels, softcap=3.0, inplace_grad=True, impl="triton"), logits.requires_grad_(),
                           upstream=upstream)
    l_ref, (g_ref,) = _grads(lambda x: cross_entropy(x, labels, softcap=3.0, impl="torch"), logits, upstream=upstream)
    torch.testing.assert_close(l_in, l_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_in, g_ref, **_grad_tol(dtype, upstream, labels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("V", [100, 1000])
def test_triton_loops_over_the_vocabulary(V, dtype, device, monkeypatch):
    # 32-column steps: 4 and 32 of them, the last one ragged
    monkeypatch.setattr(loss, "_MAX_BLOCK_V", 32)
    assert loss._ce_blocks(V)["BLOCK_V"] == 32
    N = 11
    logits = (4 * torch.randn(N, V, device=device)).to(dtype)
    logits[0, -1] = 30.0  # the row's max in its last, partial step
    logits[2, :40] = float("-inf")  # a row whose first steps see only -inf
    logits.requires_grad_()
    labels = _labels(N, V, device)
    labels[0], labels[2] = V - 1, 50
    upstream = torch.randn((), device=device)
    l_tri, (g_tri,) = _grads(lambda x: cross_entropy(x, labels, impl="triton"), logits, upstream=upstream)
    l_ref, (g_ref,) = _grads(lambda x: cross_entropy(x, labels, impl="torch"), logits, upstream=upstream)
    torch.testing.assert_close(l_tri, l_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_tri, g_ref, **_grad_tol(dtype, upstream, labels))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_rows_ignored_give_zero_loss_and_zero_gradient(reduction, impl, device):
    logits = torch.randn(6, 50, device=device, requires_grad=True)
    labels = torch.full((6,), IGNORE, device=device)
    value = cross_entropy(logits, labels, reduction=reduction, impl=impl)
    (value * 3.0).backward()
    assert value.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    if reduction == "mean":  # where torch gives NaN (a 0 / 0)
        assert torch.isnan(TF.cross_entropy(logits.detach(), labels, ignore_index=IGNORE))
    empty = cross_entropy(torch.zeros(0, 50, device=device), torch.zeros(0, dtype=torch.long, device=device), impl=impl)
    assert empty.item() == 0.0


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_ignored_rows_holding_nan_or_inf_get_zero_gradient(impl, softcap, device):
    """An ignored row's logits are never read into the loss: NaN or inf there leaves the loss
    and the other rows' gradients as with finite values, and its own gradient exactly zero."""
    logits = torch.randn(4, 50, device=device)
    labels = torch.tensor([3, IGNORE, IGNORE, 7], device=device)
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    poisoned[2, 0], poisoned[2, 9] = float("inf"), -float("inf")
    results = []
    for x in (logits, poisoned):
        x = x.clone().requires_grad_()
        value = cross_entropy(x, labels, softcap=softcap, impl=impl)
        value.backward()
        results.append((value, x.grad))
    (value, grad), (value_p, grad_p) = results
    torch.testing.assert_close(value_p, value)
    assert torch.equal(grad_p[1:3], torch.zeros_like(grad_p[1:3]))
    torch.testing.assert_close(grad_p, grad)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rows_of_huge_logits_keep_their_loss_and_gradient(impl, device):
    """The loss is (max - x[label]) + log-sum and the softmax exp((x - max) - log-sum): a row of float32's min in every
    column (a masked row) is log V with the gradient 1/V - onehot, and adding 1e6 to every logit changes nothing beyond
    float32's spacing there, where logsumexp(x) - x[label] lost log-sum to rounding (loss 0 or -inf, gradient 1 or inf)."""
    torch.manual_seed(0)
    base = torch.randn(3, 7, dtype=torch.float64, device=device)
    labels = torch.tensor([1, 4, 6], device=device)
    for logits in (torch.full((3, 7), torch.finfo(torch.float32).min, dtype=torch.float64, device=device), base + 1e6, base - 1e6):
        x32 = logits.float()
        ref_value, (ref_grad,) = _grads(lambda x: TF.cross_entropy(x, labels), (x32.double() - x32.double().amax(1, keepdim=True)).requires_grad_(),
                                        upstream=1.0)
        for fn in (lambda x: cross_entropy(x, labels, impl=impl),
                   lambda x: linear_cross_entropy(x, torch.eye(7, device=device), labels, impl=impl, chunk_rows=2)):
            value, (grad,) = _grads(fn, x32.requires_grad_(), upstream=1.0)
            torch.testing.assert_close(value.double(), ref_value, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_sum_is_mean_times_valid_rows(impl, device):
    logits = torch.randn(20, 30, device=device)
    labels = _labels(20, 30, device)
    n_valid = int((labels != IGNORE).sum())
    mean = cross_entropy(logits, labels, impl=impl)
    total = cross_entropy(logits, labels, reduction="sum", impl=impl)
    torch.testing.assert_close(total, mean * n_valid)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_packed_documents_sum_to_the_separate_losses(impl, device):
    # next-token labels per document, the last position of each ignored (nothing follows)
    V = 40
    docs = [torch.randint(0, V, (n,), device=device) for n in (9, 14)]
    logits = [torch.randn(len(d), V, device=device, requires_grad=True) for d in docs]
    labels = [torch.cat([d[1:], d.new_full((1,), IGNORE)]) for d in docs]
    separate = sum(cross_entropy(x, y, reduction="sum", impl=impl) for x, y in zip(logits, labels))
    g_sep = torch.autograd.grad(separate, logits)
    packed_logits = torch.cat([x.detach() for x in logits]).requires_grad_()
    packed = cross_entropy(packed_logits, torch.cat(labels), reduction="sum", impl=impl)
    packed.backward()
    torch.testing.assert_close(packed, separate)
    torch.testing.assert_close(packed_logits.grad, torch.cat(g_sep))


def test_forward_only(device):
    logits = torch.randn(9, 70, device=device)
    labels = _labels(9, 70, device)
    with torch.no_grad():
        a = cross_entropy(logits.clone().requires_grad_(), labels, impl="triton")
    b = cross_entropy(logits, labels, impl="triton")
    assert not a.requires_grad and not b.requires_grad
    torch.testing.assert_close(a, cross_entropy(logits, labels, impl="torch"))
    torch.testing.assert_close(b, a)


def test_strided_rows(device):
    # columns 0..99 of a wider buffer: the kernel reads (and with inplace_grad writes) them
    # in place, at the buffer's row stride
    wide = torch.randn(8, 128, device=device)
    labels = _labels(8, 100, device)
    expected, (g_ref,) = _grads(lambda x: cross_entropy(x[:, :100], labels, impl="torch"), wide.requires_grad_(), upstream=1.0)
    torch.testing.assert_close(cross_entropy(wide[:, :100], labels, impl="triton"), expected)
    value, (g_wide,) = _grads(lambda x: cross_entropy(x[:, :100], labels, inplace_grad=True, impl="triton"), wide, upstream=1.0)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(g_wide, g_ref)  # zeros in columns 100..127
    transposed = torch.randn(100, 8, device=device).T  # column stride 8: copied first
    torch.testing.assert_close(cross_entropy(transposed, labels, impl="triton"), cross_entropy(transposed, labels, impl="torch"))


def test_backward_runs_twice_and_inplace_grad_once(device):
    """The gradient is made from the saved logits: a second backward (retain_graph) gives it
    again. With inplace_grad the first backward wrote it over the logits: a second refuses."""
    logits = torch.randn(5, 12, device=device, requires_grad=True)
    labels = _labels(5, 12, device)
    value = cross_entropy(logits, labels, impl="triton")
    value.backward(retain_graph=True)
    first = logits.grad.clone()
    logits.grad = None
    (2 * value).backward()
    torch.testing.assert_close(logits.grad, 2 * first)

    x = logits.detach().clone().requires_grad_()
    value = cross_entropy(x, labels, impl="triton", inplace_grad=True)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward only"):
        value.backward()


# ---------------------------------------------------------------------------- inplace_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_grad_writes_the_gradient_into_the_logits(dtype, device):
    N, V = 13, 300
    logits = (2 * torch.randn(N, V, device=device)).to(dtype)
    labels = _labels(N, V, device)
    upstream = torch.randn((), device=device)
    l_ref, (g_ref,) = _grads(lambda x: cross_entropy(x, labels, impl="torch"), logits.requires_grad_(), upstream=upstream)

    x = logits.detach().clone().requires_grad_()
    value = cross_entropy(x, labels, impl="triton", inplace_grad=True)
    assert torch.equal(x.detach(), logits.detach())  # the forward leaves them as they are
    (value * upstream).backward()
    torch.testing.assert_close(value.detach(), l_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, g_ref, **_grad_tol(dtype, upstream, labels))
    assert x.grad.data_ptr() == x.data_ptr()  # the gradient lives in the logits' memory

    # a non-leaf: the gradient flows on into the op that made the logits
    z = logits.detach().clone().requires_grad_()
    (cross_entropy(z * 2, labels, impl="triton", inplace_grad=True) * upstream).backward()
    _, (g_z,) = _grads(lambda t: cross_entropy(t * 2, labels, impl="torch"), logits, upstream=upstream)
    torch.testing.assert_close(z.grad, g_z, **_grad_tol(dtype, 2 * upstream, labels))

    # the torch path leaves the logits alone
    kept = logits.detach().clone()
    cross_entropy(kept, labels, impl="torch", inplace_grad=True)
    assert torch.equal(kept, logits.detach())


def test_inplace_grad_refuses_logits_another_backward_needs(device):
    z = torch.randn(4, 9, device=device, requires_grad=True)
    value = cross_entropy(torch.tanh(z), _labels(4, 9, device), impl="triton", inplace_grad=True)  # tanh saves its output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()
    _raises("logits: inplace_grad needs unit column stride", cross_entropy, torch.randn(9, 4, device=device).T, _labels(4, 9, device), impl="triton", inplace_grad=True)


def test_inplace_grad_takes_any_column_stride_where_none_is_read(device):
    """No rows, or a single column (contiguous tensors whose strides came from a transpose):
    as without inplace_grad."""
    for x in (torch.empty_strided((0, 5), (1, 0), device=device), torch.randn(1, 4, device=device).T):  # strides (1, 0), (1, 4)
        x.requires_grad_()
        labels = torch.zeros(x.shape[0], dtype=torch.long, device=device)
        assert x.is_contiguous() and x.stride(-1) != 1
        value = cross_entropy(x, labels, impl="triton", inplace_grad=True)
        value.backward()
        assert value.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


# ---------------------------------------------------------------------------- labels and bad inputs


def test_labels_out_of_range():
    logits = torch.randn(4, 10)
    _raises(r"labels: 1 label\(s\) outside \[0, 10\) that are not ignore_index=-100, first labels\[2\] = 10", cross_entropy, logits, torch.tensor([0, 9, 10, IGNORE]))
    _raises(r"labels: 2 label\(s\).*first labels\[0\] = -1", cross_entropy, logits, torch.tensor([-1, 9, -5, 3]))
    assert cross_entropy(logits, torch.tensor([-1, 9, -1, 3]), ignore_index=-1).isfinite()
    _raises("labels: 1 label", linear_cross_entropy, torch.randn(4, 3), torch.randn(10, 3), torch.tensor([0, 1, 2, 12]))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unchecked_out_of_range_label_gives_nan_not_a_fault(impl, device):
    logits = torch.randn(4, 10, device=device, requires_grad=True)
    for labels in ([0, 1, 10, 3], [0, -7, 2, 3]):
        value = cross_entropy(logits, torch.tensor(labels, device=device), check=False, impl=impl)
        assert torch.isnan(value)
    h, weight = torch.randn(4, 3, device=device), torch.randn(10, 3, device=device)
    assert torch.isnan(linear_cross_entropy(h, weight, torch.tensor([0, 1, 2, 12], device=device), check=False, impl=impl))


def test_bad_inputs():
    x, y = torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    _raises("logits: expected a 2-D tensor", cross_entropy, torch.randn(2, 4, 10), y)
    _raises("logits: expected dtype", cross_entropy, x.long(), y)
    _raises("logits: expected a tensor", cross_entropy, [[0.0]], y)
    _raises("logits: expected at least one class", cross_entropy, torch.randn(4, 0), y)
    _raises("labels: expected dtype int32 or int64", cross_entropy, x, y.float())
    _raises("labels: expected a 1-D tensor", cross_entropy, x, y[None])
    _raises("labels: expected 4 labels, one per row, got 3", cross_entropy, x, y[:3])
    _raises("ignore_index: expected an int", cross_entropy, x, y, ignore_index=-100.0)
    _raises("ignore_index: expected an int", cross_entropy, x, y, ignore_index=True)
    # a comparison with int32 labels would wrap 2**40 to 0 and drop row 0 (the kernel would count it): refused
    _raises(r"ignore_index: expected an int that torch.int32 labels can hold, in \[-2147483648, 2147483647\], got 1099511627776",
            cross_entropy, x, y.int(), ignore_index=2**40)
    _raises("ignore_index: expected an int that torch.int64 labels can hold", linear_cross_entropy, torch.randn(4, 3), torch.randn(10, 3), y,
            ignore_index=2**63)
    # inplace_grad writes each row's gradient over its logits: rows sharing memory (an expand) would overwrite each other's
    _raises(r"logits: inplace_grad writes each row's gradient over it: rows must not share memory \(row stride >= 10\), got strides \(0, 1\)",
            cross_entropy, x[:1].expand(4, 10), y, inplace_grad=True, impl="triton")
    _raises(r"logits: inplace_grad writes each row's gradient over it: rows must not share memory \(row stride >= 10\), got strides \(5, 1\)",
            cross_entropy, torch.randn(25).as_strided((4, 10), (5, 1)), y, inplace_grad=True, impl="triton")  # rows overlapping by half
    _raises("reduction: expected one of", cross_entropy, x, y, reduction="none")
    _raises("impl: expected one of", cross_entropy, x, y, impl="cuda")
    _raises("softcap: expected None or a positive finite number, got 0", cross_entropy, x, y, softcap=0)
    _raises("softcap: expected None or a positive finite number, got inf", cross_entropy, x, y, softcap=float("inf"))
    _raises("softcap: expected None or a positive finite number, got True", linear_cross_entropy, torch.randn(4, 3), torch.randn(10, 3), y,
            softcap=True)

    h, w = torch.randn(4, 3), torch.randn(10, 3)
    _raises("h: expected a 2-D tensor", linear_cross_entropy, h[0], w, y)
    _raises("h: expected dtype", linear_cross_entropy, h.long(), w, y)
    _raises("weight: expected a 2-D tensor", linear_cross_entropy, h, w[0], y)
    _raises(r"weight: expected shape \[V, 3\] to match h's hidden size, got \(10, 4\)", linear_cross_entropy, h, torch.randn(10, 4), y)
    _raises("weight: expected h's dtype torch.float32, got torch.bfloat16", linear_cross_entropy, h, w.bfloat16(), y)
    _raises("weight: expected at least one class", linear_cross_entropy, h, torch.randn(0, 3), y)
    _raises("labels: expected 4 labels", linear_cross_entropy, h, w, y[:2])
    _raises("labels: expected dtype int32 or int64", linear_cross_entropy, h, w, y.float())
    _raises("ignore_index: expected an int", linear_cross_entropy, h, w, y, ignore_index=None)
    _raises("reduction: expected one of", linear_cross_entropy, h, w, y, reduction="batchmean")
    _raises("chunk_rows: expected >= 1, got 0", linear_cross_entropy, h, w, y, chunk_rows=0)
    _raises("chunk_rows: expected an int", linear_cross_entropy, h, w, y, chunk_rows=2.0)
    _raises("accumulate_dtype: expected torch.float32 or weight's dtype", linear_cross_entropy, h.bfloat16(), w.bfloat16(), y, accumulate_dtype=torch.float16)


# ---------------------------------------------------------------------------- linear_cross_entropy


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_unfused(dtype, chunk_rows, device):
    N, H, V = 37, 24, 100
    h = torch.randn(N, H, device=device).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, device=device)).to(dtype).requires_grad_()
    labels = _labels(N, V, device)
    upstream = torch.randn((), device=device)
    expected, (dh_ref, dw_ref) = _grads(lambda a, b: loss.linear_cross_entropy_ref(a, b, labels, IGNORE, True), h, w, upstream=upstream)
    accumulators = [torch.float32] if dtype == torch.float32 else [torch.float32, dtype]
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    for accumulate_dtype in accumulators:
        fused = lambda a, b: linear_cross_entropy(a, b, labels, chunk_rows=chunk_rows, accumulate_dtype=accumulate_dtype, impl="triton")  # noqa: E731
        value, (dh, dw) = _grads(fused, h, w, upstream=upstream)
        assert value.dtype == torch.float32 and dh.dtype == dw.dtype == dtype
        torch.testing.assert_close(value, expected, **VALUE_TOL[dtype])
        _close_norm(dh, dh_ref, rel)
        _close_norm(dw, dw_ref, rel)


def test_linear_default_chunk_keeps_its_logits_within_256_mib(op_shapes):
    """chunk_rows' default: as many rows as keep a chunk's logits [rows, V] within 256 MiB, in
    the weight's dtype: 1024 rows of a 131072 vocabulary in bf16, 512 in float32 (shapes only:
    meta tensors, the logits GEMMs' outputs recorded)."""
    V, N = 131072, 1500
    for dtype, rows in ((torch.bfloat16, 1024), (torch.float32, 512)):
        h, w = torch.zeros(N, 2, dtype=dtype, device="meta"), torch.zeros(V, 2, dtype=dtype, device="meta")
        with op_shapes() as rec:
            linear_cross_entropy(h, w, torch.zeros(N, dtype=torch.long, device="meta"), impl="torch", check=False)
        logits = set(rec.shapes(torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
        assert logits == {(rows, V), (N % rows, V)}, (dtype, logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_with_a_bias_matches_the_unfused_logits_plus_bias(dtype, device):
    """h @ weight.T + bias (an LM head with a bias): the value and the three gradients equal
    F.cross_entropy's of the whole logits, every chunking; the bias's gradient alone when only
    it requires grad; a bias of the wrong length or dtype is refused by name."""
    N, H, V = 23, 16, 50
    h = torch.randn(N, H, device=device).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, device=device)).to(dtype).requires_grad_()
    b = torch.randn(V, device=device).to(dtype).requires_grad_()
    labels = _labels(N, V, device)
    upstream = torch.randn((), device=device)
    whole = lambda a, c, d: TF.cross_entropy((a @ c.T + d).float(), labels, ignore_index=IGNORE)  # noqa: E731
    expected, grads_ref = _grads(whole, h, w, b, upstream=upstream)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    for impl, chunk_rows in (("torch", None), ("triton", 1), ("triton", 7), ("triton", 64)):
        fused = lambda a, c, d: linear_cross_entropy(a, c, labels, bias=d, chunk_rows=chunk_rows, impl=impl)  # noqa: E731
        value, grads = _grads(fused, h, w, b, upstream=upstream)
        torch.testing.assert_close(value, expected, **VALUE_TOL[dtype])
        assert grads[2].dtype == dtype
        for got, want in zip(grads, grads_ref):
            _close_norm(got, want, rel)
    _, (_, _, db) = _grads(lambda a, c, d: linear_cross_entropy(a, c, labels, bias=d, chunk_rows=5, impl="triton"), h.detach(), w.detach(), b,
                           upstream=upstream)
    _close_norm(db, grads_ref[2], rel)
    without = linear_cross_entropy(h, w, labels, impl="triton")
    assert (without - expected).abs() > 1e-2  # the bias counts
    if dtype == torch.bfloat16:  # the bias gradient summed over the chunks in float32 and rounded once: the same for any chunking
        g = torch.Generator().manual_seed(8)
        h2, labels2 = torch.randn(256, H, generator=g).to(device, dtype), torch.randint(0, V, (256,), generator=g).to(device)
        by_chunks = []
        for rows in (256, 8):
            b2 = b.detach().clone().requires_grad_()
            linear_cross_entropy(h2, w.detach(), labels2, bias=b2, chunk_rows=rows, impl="triton", reduction="sum").backward()
            by_chunks.append(b2.grad)
        assert torch.equal(*by_chunks) and by_chunks[0].abs().max() > 10  # sums of hundreds of rows (bf16 per chunk: 1.5e-2 apart)
    _raises(r"bias: expected None or \[50\] \(one per row of weight\)", linear_cross_entropy, h, w, labels, bias=b[:-1])
    _raises(r"bias: expected None or \[50\]", linear_cross_entropy, h, w, labels, bias=b.double())
    _raises(r"bias: expected None or \[50\]", linear_cross_entropy, h, w, labels, bias=b[:, None])  # as many elements: per row if N = V


@pytest.mark.parametrize("needs", [(True, False), (False, True), (False, False)], ids=["h", "weight", "neither"])
def test_linear_with_one_or_no_input_requiring_grad(needs, device):
    N, H, V = 10, 8, 30
    h = torch.randn(N, H, device=device).requires_grad_(needs[0])
    w = torch.randn(V, H, device=device).requires_grad_(needs[1])
    labels = _labels(N, V, device)
    fused = lambda a, b: linear_cross_entropy(a, b, labels, chunk_rows=4, impl="triton")  # noqa: E731
    unfused = lambda a, b: loss.linear_cross_entropy_ref(a, b, labels, IGNORE, True)  # noqa: E731
    if not any(needs):
        value = fused(h, w)
        assert not value.requires_grad
        torch.testing.assert_close(value, unfused(h, w))
        return
    upstream = torch.randn((), device=device)
    value, grads = _grads(fused, h, w, upstream=upstream)
    expected, grads_ref = _grads(unfused, h, w, upstream=upstream)
    torch.testing.assert_close(value, expected)
    for grad, grad_ref, need in zip(grads, grads_ref, needs):
        assert (grad is not None) == need
        if need:
            torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_reductions_and_ignored_rows(reduction, device):
    N, H, V = 12, 8, 30
    h = torch.randn(N, H, device=device, requires_grad=True)
    w = torch.randn(V, H, device=device, requires_grad=True)
    for labels in (_labels(N, V, device), torch.full((N,), IGNORE, device=device)):
        upstream = torch.randn((), device=device)
        fused = lambda a, b: linear_cross_entropy(a, b, labels, reduction=reduction, chunk_rows=5, impl="triton")  # noqa: E731
        unfused = lambda a, b: cross_entropy(a @ b.T, labels, reduction=reduction, impl="torch")  # noqa: E731
        value, (dh, dw) = _grads(fused, h, w, upstream=upstream)
        expected, (dh_ref, dw_ref) = _grads(unfused, h, w, upstream=upstream)
        torch.testing.assert_close(value, expected)
        torch.testing.assert_close(dh, dh_ref)
        torch.testing.assert_close(dw, dw_ref)
    assert value.item() == 0.0 and not dh.any() and not dw.any()  # the all-ignored case
    no_rows = torch.zeros(0, H, device=device, requires_grad=True)
    empty = linear_cross_entropy(no_rows, w, labels[:0], reduction=reduction, impl="triton")
    empty.backward()
    assert empty.item() == 0.0 and no_rows.grad.shape == (0, H)


def test_linear_default_chunks(device, monkeypatch):
    # the default keeps a chunk's logits within _CHUNK_BYTES: here 3 rows of 30 float32
    monkeypatch.setattr(loss, "_CHUNK_BYTES", 3 * 30 * 4)
    h = torch.randn(10, 8, device=device, requires_grad=True)
    w = torch.randn(30, 8, device=device, requires_grad=True)
    labels = _labels(10, 30, device)
    value, (dh, dw) = _grads(lambda a, b: linear_cross_entropy(a, b, labels, impl="triton"), h, w, upstream=1.0)
    expected, (dh_ref, dw_ref) = _grads(lambda a, b: linear_cross_entropy(a, b, labels, impl="torch"), h, w, upstream=1.0)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(dh, dh_ref)
    torch.testing.assert_close(dw, dw_ref)
    value = linear_cross_entropy(h, w, labels, impl="triton")
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward only"):
        value.backward()


# ---------------------------------------------------------------------------- memory on CPU


def _cpu_peak_bytes(fn):
    """Peak of the bytes the CPU allocator holds while fn runs, over what it held before
    (the profiler's allocation events; the CPU allocator has no cache)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.skipif(not interpreting(), reason="measures CPU allocations of the interpreted kernels; on a GPU the gpu tests measure CUDA memory")
def test_cross_entropy_memory_on_cpu():
    """Forward + backward hold one gradient buffer in the logits' dtype and no float32 N x V
    tensor. (linear_cross_entropy's memory is left to the gpu test: on CPU the GEMMs'
    packing buffers, as large as the weight, would dominate it.)"""
    N, V = 64, 4096
    labels = _labels(N, V, "cpu")
    logits = torch.randn(N, V, dtype=torch.bfloat16)

    def ce_step(fn, **kwargs):
        x = logits.clone().requires_grad_()
        return _cpu_peak_bytes(lambda: fn(x, labels, **kwargs).backward())

    f32_NV = N * V * 4
    assert ce_step(cross_entropy, impl="triton") < 0.55 * f32_NV
    assert ce_step(cross_entropy, impl="triton", inplace_grad=True) < 0.05 * f32_NV
    assert ce_step(TF.cross_entropy) > 1.4 * f32_NV  # torch: log-softmax and two gradient buffers


# ---------------------------------------------------------------------------- registration


def test_custom_ops_pass_opcheck(device):
    N, V, H = 7, 12, 5
    logits = torch.randn(N, V, device=device, requires_grad=True)
    labels = _labels(N, V, device)
    h = torch.randn(N, H, device=device, requires_grad=True)
    w = torch.randn(V, H, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.fmoe.cross_entropy_fwd.default, (logits, labels, IGNORE, True))
    torch.library.opcheck(torch.ops.fmoe.cross_entropy_fwd.default, (logits.detach(), labels, IGNORE, False))
    torch.library.opcheck(torch.ops.fmoe.cross_entropy_fwd.default, (logits, labels, IGNORE, True, 2.0))  # a softcap
    _, lse = torch.ops.fmoe.cross_entropy_fwd(logits.detach(), labels, IGNORE, True)  # [2, N]: what the backward reads
    grad_loss = torch.tensor(0.5, device=device)
    torch.library.opcheck(torch.ops.fmoe.cross_entropy_bwd.default, (grad_loss, logits.detach(), labels, lse, IGNORE, True))
    torch.library.opcheck(torch.ops.fmoe.cross_entropy_bwd_.default, (grad_loss, logits.detach().clone(), labels, lse, IGNORE, False))
    # linear_cross_entropy's forward returns the gradients it computed, which its backward
    # then scales in place; opcheck's AOT test returns every output to the caller, where such
    # a mutation is invalid. The public function never exposes those outputs: its
    # torch.compile is tested below.
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fmoe.linear_cross_entropy_fwd.default, (h, w, labels, IGNORE, True, 3, True, True, True), test_utils=no_aot)
    torch.library.opcheck(torch.ops.fmoe.linear_cross_entropy_fwd.default, (h.detach(), w.detach(), labels, IGNORE, False, 3, False, False, True))
    torch.library.opcheck(torch.ops.fmoe.linear_cross_entropy_fwd.default, (h, w, labels, IGNORE, True, 3, True, True, True, None, False, 2.0),
                          test_utils=no_aot)


def test_custom_ops_refuse_an_lse_or_labels_they_would_read_past(device):
    """The kernels read labels by row and both rows of the forward's [2, N] lse by offset: a
    logsumexp of shape [N] (what torch computes) or short labels would be read past their end,
    giving gradients from whatever memory follows, so the ops refuse them."""
    N, V = 7, 12
    logits = torch.randn(N, V, device=device)
    labels = _labels(N, V, device)
    grad_loss = torch.tensor(0.5, device=device)
    _, lse = torch.ops.fmoe.cross_entropy_fwd(logits, labels, IGNORE, True)
    expected = torch.func.grad(lambda x: TF.cross_entropy(x, labels, ignore_index=IGNORE))(logits) * 0.5
    torch.testing.assert_close(torch.ops.fmoe.cross_entropy_bwd(grad_loss, logits, labels, lse, IGNORE, True), expected)
    for bad in (torch.logsumexp(logits, dim=-1), lse.double(), lse[:, :-1], lse.t().contiguous().t()):
        with pytest.raises(ValueError, match="lse: expected the forward's"):
            torch.ops.fmoe.cross_entropy_bwd(grad_loss, logits, labels, bad, IGNORE, True)
        with pytest.raises(ValueError, match="lse: expected the forward's"):
            torch.ops.fmoe.cross_entropy_bwd_(grad_loss, logits.clone(), labels, bad, IGNORE, True)
    for op in (lambda lab: torch.ops.fmoe.cross_entropy_fwd(logits, lab, IGNORE, True),
               lambda lab: torch.ops.fmoe.cross_entropy_bwd(grad_loss, logits, lab, lse, IGNORE, True)):
        with pytest.raises(ValueError, match=r"labels: expected shape \[N\] = \[7\]"):
            op(labels[:-1])


def test_compile_without_graph_breaks(device):
    N, V, H = 9, 40, 6
    labels = _labels(N, V, device)

    def losses(logits, h, w):
        return (
            cross_entropy(logits, labels, impl="triton")
            + cross_entropy(logits * 2, labels, reduction="sum", impl="triton", inplace_grad=True)
            + linear_cross_entropy(h, w, labels, chunk_rows=4, impl="triton")
        )

    inputs = [torch.randn(N, V, device=device), torch.randn(N, H, device=device), torch.randn(V, H, device=device)]
    compiled, (g1, g2, g3) = _grads(torch.compile(losses, backend="aot_eager", fullgraph=True), *[x.requires_grad_() for x in inputs], upstream=1.5)
    eager, (r1, r2, r3) = _grads(losses, *inputs, upstream=1.5)
    torch.testing.assert_close(compiled, eager)
    for a, b in ((g1, r1), (g2, r2), (g3, r3)):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------- GPU


def _cuda_peak_extra(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpu_cross_entropy_real_shape():
    N, V = 8192, 131072
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 4
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::7] = IGNORE
    expected = TF.cross_entropy(logits.float(), labels, ignore_index=IGNORE)
    torch.testing.assert_close(cross_entropy(logits, labels), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cross_entropy(logits, labels), TF.cross_entropy(logits, labels, ignore_index=IGNORE).float(), rtol=1e-2, atol=1e-2)

    x = logits.clone().requires_grad_()
    extra = _cuda_peak_extra(lambda: cross_entropy(x, labels).backward())
    assert extra < N * V * 4, f"{extra / 2**30:.2f} GiB"  # no float32 N x V copy: one bf16 gradient buffer
    y = logits.float().requires_grad_()
    TF.cross_entropy(y, labels, ignore_index=IGNORE).backward()
    torch.testing.assert_close(x.grad, y.grad.bfloat16(), rtol=1.6e-2, atol=1e-30)

    x.grad = None
    del y
    extra = _cuda_peak_extra(lambda: cross_entropy(x, labels, inplace_grad=True).backward())
    assert extra < N * V * 4 / 100, f"{extra / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_gpu_linear_cross_entropy_real_shape():
    N, H, V = 8192, 4096, 131072
    h = (torch.randn(N, H, device="cuda") / 8).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") / 8).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::5] = IGNORE

    unfused = _cuda_peak_extra(lambda: TF.cross_entropy(h @ w.T, labels, ignore_index=IGNORE).backward())
    dh_ref, dw_ref = h.grad, w.grad
    h.grad = w.grad = None
    # the float32 accumulator adds V x H x 4 bytes, and V x H x 2 while it is rounded
    for accumulate_dtype, ratio in ((torch.bfloat16, 0.25), (torch.float32, 0.65)):
        fused = _cuda_peak_extra(lambda: linear_cross_entropy(h, w, labels, accumulate_dtype=accumulate_dtype).backward())
        assert fused < ratio * unfused, f"{accumulate_dtype}: {fused / 2**30:.2f} GiB vs unfused {unfused / 2**30:.2f} GiB"
        _close_norm(h.grad, dh_ref, 2e-2)
        _close_norm(w.grad, dw_ref, 2e-2)
        h.grad = w.grad = None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_torch_path_past_one_chunk_takes_the_rows_chunk_by_chunk(reduction):
    """linear_cross_entropy's torch path with more rows than chunk_rows: each chunk's logits
    recomputed in the backward; the value and every gradient are the unfused computation's
    (ignored rows, a chunk of ignored rows only, a bias and a cap included)."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 8, 11
    h, w, b = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((N, H), (V, H), (V,)))
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    labels[8:16] = -100  # the second chunk of 8 rows ignored whole
    got = linear_cross_entropy(h, w, labels, bias=b, softcap=4.0, chunk_rows=8, reduction=reduction, impl="torch")
    want = loss.linear_cross_entropy_ref(h, w, labels, -100, reduction == "mean", b, 4.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, c in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


def test_the_torch_path_sums_its_chunks_gradients_as_accumulate_dtype_says():
    """bf16 over 256 chunks on the torch path: with accumulate_dtype=torch.float32 dweight is
    summed in float32 and rounded once (it was summed in bf16, the argument unread: 5x the
    unfused rounding here), and dbias is summed in float32 whatever accumulate_dtype is, as
    on the Triton path; the default sums dweight in bf16, rounded once per chunk. Eager and
    the compiled op (fmoe::linear_ce_chunks_ref) sum alike."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 4096, 8, 16
    h = (torch.randn(N, H, generator=g) + 0.5).bfloat16()
    w, b = (0.1 * torch.randn(V, H, generator=g)).bfloat16(), (0.1 * torch.randn(V, generator=g)).bfloat16()
    labels = torch.multinomial(1 / torch.arange(1.0, V + 1), N, replacement=True, generator=g)  # Zipf-like: dweight's rows large
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    TF.cross_entropy(h.double() @ w64.T + b64, labels, reduction="sum").backward()

    def errors(fn, **kw):
        wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
        fn(h, wg, bg, **kw).backward()
        return [((got.grad.double() - want.grad).norm() / want.grad.norm()).item() for got, want in ((wg, w64), (bg, b64))]

    def loss_(a, c, d, **kw):
        return linear_cross_entropy(a, c, labels, bias=d, reduction="sum", impl="torch", check=False, **kw)

    unfused = errors(loss_)  # one chunk: the unfused computation's rounding
    compiled = torch.compile(loss_, backend="aot_eager", fullgraph=True)
    for fn in (loss_, compiled):
        fp32 = errors(fn, chunk_rows=16, accumulate_dtype=torch.float32)
        default = errors(fn, chunk_rows=16)
        assert fp32[0] < 1.2 * unfused[0] and fp32[1] < 1.2 * unfused[1], (fp32, unfused)
        assert default[1] < 1.2 * unfused[1] and default[0] > 2 * unfused[0], (default, unfused)


def test_the_torch_path_holds_one_chunk_s_logits():
    """N = 2048 rows over V = 8192 (64 MiB of float32 logits, 192 MiB with their copies, at
    once before), 128 rows a chunk, forward and backward in a fresh process: the peak grows
    by far less than one set of the logits."""
    import subprocess
    import sys

    script = """
import resource, torch
torch.set_num_threads(1)
from fmoe.ops import linear_cross_entropy
h, w = torch.randn(2048, 16, requires_grad=True), torch.randn(8192, 16, requires_grad=True)
labels = torch.randint(0, 8192, (2048,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
linear_cross_entropy(h, w, labels, chunk_rows=128, impl="torch").backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 40, out.stdout  # MiB


def test_linear_ce_chunks_compile_once_for_every_chunk_count():
    """torch.compile(dynamic=True, fullgraph=True) of the chunked torch path: its loop over the chunks, traced, made a graph
    per chunk count (ceil(N / chunk_rows)) and the 9th failed on the recompile limit; the chunks are ops of their own there
    (fmoe::linear_ce_chunks_ref and its backward, the same reference chunk by chunk): loss and every gradient (bias and
    softcap, ignored rows) equal eager's for 4 chunk counts, in at most 2 graphs (the loop made 4)."""
    from torch._dynamo.utils import counters

    def step(h, w, b, labels):  # check=False: an unchecked label out of range gets a NaN loss and no gradient, as eager's
        return linear_cross_entropy(h, w, labels, bias=b, softcap=5.0, chunk_rows=4, impl="torch", reduction="sum", check=False)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for N in (9, 17, 25, 33):  # 3, 5, 7, 9 chunks
        h, w, b = (torch.randn(*shape, generator=gen, requires_grad=True) for shape in ((N, 8), (12, 8), (12,)))
        labels = torch.randint(0, 12, (N,), generator=gen)
        labels[::5] = -100
        losses = [f(h, w, b, labels) for f in (compiled, step)]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        if N == 33:  # the last: a label out of range (12 classes) in a row of its own
            bad = labels.clone()
            bad[-1] = 12
            nan_losses = [f(h, w, b, bad) for f in (compiled, step)]
            assert all(loss_.isnan() for loss_ in nan_losses)
            for a, c in zip(*(torch.autograd.grad(loss_, (h, w, b)) for loss_ in nan_losses)):
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        for a, c in zip(*(torch.autograd.grad(loss_, (h, w, b)) for loss_ in losses)):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    h, w, b = torch.randn(9, 8, generator=gen), torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    labels = torch.randint(0, 12, (9,), generator=gen)
    for bias, cap in ((b, 5.0), (None, None)):
        for fp32 in (False, True):
            torch.library.opcheck(torch.ops.fmoe.linear_ce_chunks_ref.default, (h.requires_grad_(), w.requires_grad_(), labels, -100, bias, cap, 4, fp32))
            torch.library.opcheck(torch.ops.fmoe.linear_ce_chunks_ref_bwd.default, (torch.tensor(1.5), h.detach(), w.detach(), labels, -100, bias, cap, 4,
                                                                                    fp32))
