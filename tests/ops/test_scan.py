"""fmoe.ops.selective_scan (Mamba-1's scan): a worked example, the Triton kernels (through the
interpreter on CPU) and the chunked torch path against the token-by-token definition, over
packed documents and batch rows, with initial and final states; every gradient."""

import pytest
import torch

from fmoe.ops import selective_scan
from fmoe.ops.scan import selective_scan_loop


def _inputs(B, T, C, N, seed=0, dtype=torch.float32):
    """u, dt (in [0.05, 0.55]), A (in [-3.5, -0.5]), b, c."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, C, generator=g).to(dtype), (0.05 + 0.5 * torch.rand(B, T, C, generator=g)).to(dtype),
            (-0.5 - 3 * torch.rand(C, N, generator=g)).to(dtype), torch.randn(B, T, N, generator=g).to(dtype),
            torch.randn(B, T, N, generator=g).to(dtype)]


@pytest.mark.parametrize("fn", [selective_scan, selective_scan_loop])
def test_no_tokens_stay_in_the_graph(fn):
    """T = 0: y [B, 0, C] needs a gradient, so backward runs (it used to be detached)."""
    inputs = [x.requires_grad_() for x in _inputs(2, 0, 3, 4)]
    y = fn(*inputs)
    assert y.shape == (2, 0, 3) and y.requires_grad
    y.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in inputs)


def test_worked_example():
    """One channel, one state channel, b = c = 1, A = -ln 2 (decay 0.5 per unit of dt), dt = 1:
    u = (2, 4) gives y = (2, 0.5 * 2 + 4 = 5); a second document restarts: u = 3 gives 3, the
    final state 3. From initial state 8: y = (0.5 * 8 + 2 = 6, 7)."""
    ones = torch.ones(1, 3, 1)
    u = torch.tensor([2.0, 4.0, 3.0]).view(1, 3, 1)
    A = torch.tensor([[-torch.log(torch.tensor(2.0))]])
    for impl in ("torch", "triton"):
        y, h = selective_scan(u, ones, A, ones, ones, torch.tensor([0, 2, 3]), final_state=True, impl=impl)
        torch.testing.assert_close(y.flatten(), torch.tensor([2.0, 5.0, 3.0]))
        torch.testing.assert_close(h.flatten(), torch.tensor([3.0]))
        y = selective_scan(u[:, :2], ones[:, :2], A, ones[:, :2], ones[:, :2], initial_state=torch.full((1, 1, 1), 8.0), impl=impl)
        torch.testing.assert_close(y.flatten(), torch.tensor([6.0, 7.0]))
        # two one-token documents (T = 2): the second starts from zero, not from the first's state
        y = selective_scan(u[:, :2], ones[:, :2], A, ones[:, :2], ones[:, :2], torch.tensor([0, 1, 2]), impl=impl)
        torch.testing.assert_close(y.flatten(), torch.tensor([2.0, 4.0]))


@pytest.mark.parametrize("B,T,C,N,packed", [
    (1, 37, 40, 5, True),     # a partial block of channels (40 = 32 + 8), a state under one block, a partial checkpoint chunk
    (2, 20, 8, 16, False),    # two batch rows, each one document
    (1, 16, 33, 3, True),     # T one checkpoint exactly
])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_matches_the_token_loop(B, T, C, N, packed, impl):
    """y, the final state and the gradients of u, dt, A, b, c and the initial state equal
    selective_scan_loop's (the definition), over packed documents (an empty one among them)."""
    xs = [t.requires_grad_() for t in (*_inputs(B, T, C, N, seed=B + T), torch.randn(B, C, N))]
    cu = torch.tensor([0, 9, 9, T - 7, T]) if packed else None
    g = torch.Generator().manual_seed(1)
    grad_y, grad_h = torch.randn(B, T, C, generator=g), torch.randn(B, C, N, generator=g)
    results = []
    for fn, kw in ((selective_scan_loop, {}), (selective_scan, dict(impl=impl, chunk_size=8))):
        y, h = fn(*xs[:5], cu, initial_state=xs[5], final_state=True, **kw)
        assert y.dtype == h.dtype == torch.float32 and y.shape == (B, T, C) and h.shape == (B, C, N)
        results.append((y, h, *torch.autograd.grad((y * grad_y).sum() + (h * grad_h).sum(), xs)))
    for name, want, got in zip(["y", "state", "du", "ddt", "dA", "db", "dc", "dh0"], *results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_a_state_channel_that_forgets_at_once(impl):
    """A = -inf in one (channel, state) pair (A = -exp(A_log) once A_log > 88.7: exp(dt A) = 0, that
    state forgotten every token): y, the final state and the gradients equal the loop's,
    finite (the torch path's chunks gave NaN, and the kernels' padding past T, 0 * -inf), but dt's
    of that channel, NaN in the definition too (d exp(dt A) / d dt = A exp(dt A) = -inf * 0)."""
    u, dt, A, b, c = _inputs(1, 20, 3, 2, seed=5)
    A[0, 0] = float("-inf")
    xs = [t.requires_grad_() for t in (u, dt, b, c)]
    grad_y = torch.randn(1, 20, 3, generator=torch.Generator().manual_seed(2))
    results = []
    for fn, kw in ((selective_scan_loop, {}), (selective_scan, dict(impl=impl, chunk_size=8))):
        y, h = fn(xs[0], xs[1], A, xs[2], xs[3], torch.tensor([0, 7, 20]), final_state=True, **kw)
        results.append((y, h, *torch.autograd.grad((y * grad_y).sum() + h.sum(), xs)))
    for name, want, got in zip(["y", "state", "du", "ddt", "db", "dc"], *results):
        if name == "ddt":
            assert got[..., 0].isnan().all() and got[..., 1:].isfinite().all()
        else:
            assert got.isfinite().all(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=name == "ddt", msg=name)


def test_the_kernels_without_states_and_in_bf16():
    """No initial state, no final state (its gradient zero), bf16 inputs: the kernels' y and
    gradients (in the inputs' dtype) follow the float32 scan of the same values."""
    xs = [t.bfloat16().requires_grad_() for t in _inputs(1, 25, 12, 4, seed=3)]
    grad_y = torch.randn(1, 25, 12)
    y = selective_scan(*xs, impl="triton")
    grads = torch.autograd.grad((y * grad_y).sum(), xs)
    ref = [t.detach().float().requires_grad_() for t in xs]
    y32 = selective_scan_loop(*ref)
    grads32 = torch.autograd.grad((y32 * grad_y).sum(), ref)
    torch.testing.assert_close(y, y32, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads32):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_kernels_pass_opcheck_and_compile():
    """The fmoe::selective_scan registration (fake shapes, autograd, schema), and
    torch.compile(fullgraph=True) of a scan and its backward equal to eager."""
    u, dt, A, b, c = _inputs(1, 19, 6, 4, seed=4)
    starts = torch.zeros(1, 19)
    starts[0, 7] = 1.0
    args = tuple(t.requires_grad_() for t in (u, dt, A, b, c)) + (starts, torch.randn(1, 6, 4).requires_grad_())
    torch.library.opcheck(torch.ops.fmoe.selective_scan.default, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    xs = [t.detach().clone().requires_grad_() for t in (u, dt, A, b, c)]
    cu = torch.tensor([0, 7, 19])

    def loss(*xs):
        return (selective_scan(*xs, cu, impl="triton") ** 2).sum()

    eager = torch.autograd.grad(loss(*xs), xs)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*xs), xs)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(a, u=a["u"][0]), r"u: expected a 3-D tensor"),
    (lambda a: dict(a, dt=a["dt"][:, :5]), r"dt: expected \[1, 6, 4\] \(of u's B, T, C and A's N\)"),
    (lambda a: dict(a, A=a["A"][:, :2]), r"b: expected \[1, 6, 2\]"),
    (lambda a: dict(a, c=a["c"][..., :2]), r"c: expected \[1, 6, 3\]"),
    (lambda a: dict(a, b=a["b"].long()), r"b: expected dtype"),
    (lambda a: dict({k: v.expand(2, *v.shape[1:]) if k != "A" else v for k, v in a.items()}, cu_seqlens=torch.tensor([0, 6])),
     r"cu_seqlens: packed documents need one batch row \(B = 1\), got B = 2"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([], dtype=torch.long)), r"cu_seqlens: expected at least 2 entries \[0, ..., T\], got 0"),
    # bounds that pack no documents (the scan ran over them, reading nothing), and on the meta device (torch's copy failed)
    (lambda a: dict(a, cu_seqlens=torch.tensor([1, 3, 6])), r"^cu_seqlens: must start at 0, starts at 1"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([0, 4, 2, 6])), r"^cu_seqlens: must be non-decreasing"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([0, 3, 5]), impl="triton"), r"^cu_seqlens: must end at the token count 6, ends at 5"),
    (lambda a: dict(a, cu_seqlens=torch.tensor([0, 6], device="meta")), r"^cu_seqlens: a meta tensor holds no offsets to copy to the device of u"),
    # a positive rate (documented <= 0: the state grows without bound), a negative step (softplus's are >= 0)
    (lambda a: dict(a, A=a["A"].abs()), r"^A: expected <= 0 \(a positive rate grows the state without bound\), got "),
    (lambda a: dict(a, dt=-a["dt"], impl="triton"), r"^dt: expected >= 0 \(softplus's\), got -"),
    # a NaN beside the value out of range hid it (max over a NaN is NaN)
    (lambda a: dict(a, A=torch.cat([a["A"][:, :1] * float("nan"), a["A"][:, 1:].abs()], 1)), r"^A: expected <= 0 .*got [0-9]"),
    pytest.param(lambda a: dict(a, dt=torch.where(torch.arange(4) == 0, float("nan"), -a["dt"])), r"^dt: expected >= 0 \(softplus's\), got -",
                 id="dt: a NaN beside a negative"),
    (lambda a: dict(a, check="no"), r"^check: expected a bool, got 'no'"),
    (lambda a: dict(a, initial_state=torch.zeros(1, 4, 2)), r"initial_state: expected \[1, 4, 3\]"),
    (lambda a: dict(a, impl="cuda"), r"impl: expected one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    # the torch path's chunk, checked on the kernels' path too (CUDA's "auto" took '8' and 0)
    (lambda a: dict(a, chunk_size=0, impl="triton"), r"chunk_size: expected >= 1, got 0"),
    (lambda a: dict(a, chunk_size="8", impl="triton"), r"chunk_size: expected an int, got '8'"),
])
def test_bad_arguments_are_named(change, match):
    u, dt, A, b, c = _inputs(1, 6, 4, 3)
    with pytest.raises(ValueError, match=match):
        selective_scan(**change(dict(u=u, dt=dt, A=A, b=b, c=c)))


@pytest.mark.gpu
def test_gpu_jamba_mini_s_channels():
    """On CUDA at half of Jamba Mini's mixer (4096 channels, a state of 16; the chunked torch
    path holds T C 16 and T C N numbers per tensor) over 2048 packed tokens in documents of 1500 and
    548: the kernels (impl "auto") against that path, forward and backward, the inputs bf16."""
    xs = [t.cuda().bfloat16().requires_grad_() for t in _inputs(1, 2048, 4096, 16, seed=9)]
    cu = torch.tensor([0, 1500, 2048], device="cuda")
    grad_y = torch.randn(1, 2048, 4096, device="cuda")
    results = []
    for impl in ("auto", "torch"):
        y = selective_scan(*xs, cu, impl=impl, chunk_size=16)
        results.append((y, *torch.autograd.grad((y * grad_y).sum(), xs)))
    for got, want in zip(*results):
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("B, backward", [(66, False), (33, True)])
def test_gpu_offsets_past_int32(B, backward):
    """At Jamba's 8192 channels and a state of 16, B rows of 4096 tokens put the kernels'
    offsets past 2**31: the forward's (u, dt, y: B T C, 2.2e9 at B = 66) or the backward's
    (the partial sums of b's and c's gradients: B C/8 T N, 2.2e9 at B = 33; 55 GB in all).
    Rows are independent: the last row gives what it gives alone (its offsets small). The
    row index was int32: the forward read row 65 from other tensors and wrote y outside
    every tensor, the backward wrote db and dc outside them."""
    T, C, N = 4096, 8192, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    u, b, c = (torch.randn(B, T, n, device="cuda", generator=g) for n in (C, N, N))
    dt = 0.05 + 0.5 * torch.rand(B, T, C, device="cuda", generator=g)
    A = -0.5 - 3 * torch.rand(C, N, device="cuda", generator=g)
    rows = [(u, dt, b, c), tuple(t[-1:].clone() for t in (u, dt, b, c))]
    outs = []
    for u_, dt_, b_, c_ in rows:
        with torch.set_grad_enabled(backward):
            xs = [t.requires_grad_(backward) for t in (u_, dt_, b_, c_)]
            y = selective_scan(xs[0], xs[1], A, xs[2], xs[3])
            out = [y[-1:].clone()]  # copies: a view would keep the whole tensor
            if backward:
                grad_y = torch.ones_like(y)
                out += [grad[-1:].clone() for grad in torch.autograd.grad(y, xs, grad_y)]
                del grad_y
            outs.append([t.detach() for t in out])
            del y, xs
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_infinite_rate_is_reported_as_inf():
    """checks.largest keeps +inf (not nan_to_num's default, the largest finite float32): an
    A holding +inf is reported as inf, not as 3.40282e+38."""
    u, dt, A, b, c = _inputs(1, 6, 4, 3)
    A = A.detach().abs()
    A[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^A: expected <= 0 \(a positive rate grows the state without bound\), got inf$"):
        selective_scan(u=u, dt=dt, A=A, b=b, c=c)


def test_an_initial_state_on_another_device_is_named():
    u, dt, A, b, c = _inputs(1, 6, 4, 3)
    with pytest.raises(ValueError, match=r"^initial_state: expected \[1, 4, 3\] on cpu, got \[1, 4, 3\] on meta$"):
        selective_scan(u=u, dt=dt, A=A, b=b, c=c, initial_state=torch.zeros(1, 4, 3, device="meta"))
