"""grad_norm, clip_grad_norm, param_norm and zero_grad_count on one process (their
multi-process checks are in tests/parallel/test_reduce.py and test_pipeline.py), and
Float32GradAccumulator."""

import fractions
import math
import subprocess
import sys

import numpy
import pytest
import torch
import torch.distributed as dist

from fmoe.optim.adamw import scale_
from fmoe.optim.grads import Float32GradAccumulator, clip_factor, clip_grad_norm, grad_norm, param_norm, zero_grad_count
from tests.parallel.dist import counting_all_reduce

INF = float("inf")


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


def _copies(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, out):
        q.grad = None if p.grad is None else p.grad.clone()
    return out





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


@pytest.mark.parametrize("norm_type", [2.0, 3, INF])
@pytest.mark.parametrize("foreach", [None, False])
def test_one_process_is_torch_bit_for_bit(norm_type, foreach):
    """Without torch.distributed, float32 gradients: torch.nn.utils' own functions, the same
    bits, float32 out."""
    assert not dist.is_initialized()
    params = _params_with_grads(torch.float32)
    ref = _copies(params)
    before = [p.grad.clone() for p in params[:2]]
    norm = grad_norm(params, norm_type=norm_type, foreach=foreach)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))  # grad_norm only reads
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref[:2]], norm_type, foreach=foreach)
    assert norm.dtype == torch.float32 and norm.dim() == 0 and torch.equal(norm, expected.float())

    max_norm = float(norm) / 3
    clipped = clip_grad_norm(params, max_norm, norm_type=norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type, foreach=foreach)
    assert clipped.dtype == torch.float32 and torch.equal(clipped, expected.float())
    for p, q in zip(params, ref):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert not torch.equal(params[0].grad, before[0])  # it did clip


def _low_precision_grads(dtype):
    """Parameters whose gradients' norm torch rounds in their dtype: dtype None mixes a
    float32 one with bf16 ones."""
    g = torch.Generator().manual_seed(5)
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16] if dtype is None else [dtype] * 3
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in zip((4000, 300, 7), dtypes)]
    for q in params:
        q.grad = (torch.randn(q.shape, generator=g) * 3).to(q.dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("foreach, impl", [(None, "torch"), (False, "torch"), (None, "triton")])
def test_one_process_norms_low_precision_gradients_in_float32_as_many_ranks_do(dtype, foreach, impl):
    """bf16 or fp16 gradients on one process: the norm is summed in float32 and float64 as on
    many ranks (torch's rounds each tensor's norm and their total to the gradients' dtype, 0.1%
    off here), and the clip scales every gradient by clip_factor of that norm (mul_'s bits), so
    one process clips as N do."""
    params = _low_precision_grads(dtype)
    grads = [q.grad.clone() for q in params]
    exact = torch.cat([g.double() for g in grads]).norm()
    torch_norm = torch.nn.utils.get_total_norm(grads).double()
    assert abs(torch_norm / exact - 1) > 1e-4, "the case does not tell torch's rounding apart"
    norm = grad_norm(params, foreach=foreach)
    assert norm.dtype == torch.float32 and abs(float(norm) / float(exact) - 1) < 1e-6, (float(norm), float(exact))
    with counting_all_reduce() as calls:
        clipped = clip_grad_norm(params, 10.0, foreach=foreach, impl=impl)
    assert calls == [] and torch.equal(clipped, norm)
    factor = clip_factor(norm, 10.0)
    assert float(factor) < 0.1  # it clips
    for q, g in zip(params, grads):
        assert torch.equal(q.grad, g.clone().mul_(factor))


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("foreach, impl", [(None, "torch"), (False, "torch"), (None, "triton")])
def test_one_process_skips_empty_gradients(norm_type, foreach, impl):
    """An empty gradient (an expert stack with no local experts) adds nothing, as on the
    distributed path: torch's inf norm raised on it. The rest: torch's bits without it."""
    params = _params_with_grads()
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    empty.grad = torch.zeros(0, 4)
    ref = _copies(params)
    norm = grad_norm([params[0], empty, *params[1:]], norm_type=norm_type, foreach=foreach)
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref[:2]], norm_type, foreach=foreach)
    assert torch.equal(norm, expected.float())
    clipped = clip_grad_norm([params[0], empty, *params[1:]], float(norm) / 3, norm_type=norm_type, foreach=foreach, impl=impl)
    expected = torch.nn.utils.clip_grad_norm_(ref, float(norm) / 3, norm_type=norm_type, foreach=foreach)
    assert torch.equal(clipped, expected.float()) and empty.grad.shape == (0, 4)
    for p, q in zip(params, ref):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    only_empty = clip_grad_norm([empty], 1.0, norm_type=norm_type, foreach=foreach, impl=impl)
    assert only_empty.dtype == torch.float32 and float(only_empty) == 0.0
    # bf16 gradients (normed in float32) beside an empty one: skipped too (torch's inf norm raised on it)
    a, e = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(0, 4, dtype=torch.bfloat16))
    a.grad, e.grad = torch.tensor([3.0, -4.0, 1.0], dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.bfloat16)
    assert float(grad_norm([a, e], norm_type=norm_type, foreach=foreach)) == pytest.approx(4.0 if norm_type == INF else math.sqrt(26), rel=1e-6)


def _mixed_tensors():
    """Every case of scale_'s buckets: float32, bf16 and fp16, sizes that are and are not
    multiples of 16, a strided tensor (the foreach fallback) and an empty one."""
    g = torch.Generator().manual_seed(3)
    shapes = [((33, 17), torch.float32), ((64,), torch.bfloat16), ((7,), torch.bfloat16), ((5, 3), torch.float16),
              ((32, 4), torch.float32), ((0,), torch.float32), ((33, 40), torch.float32)]  # 1320: past one block of 1024
    out = [torch.randn(s, generator=g).to(dt) for s, dt in shapes]
    out.append(torch.randn(6, 8, generator=g).t())  # strided
    return out


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_scale_is_mul_bit_for_bit(impl, factor_dtype):
    """scale_ gives each tensor t.mul_(factor)'s bits: the product in float32, rounded to the
    tensor's dtype, whatever the mix of dtypes (a bf16 factor read as its float32 value)."""
    tensors = _mixed_tensors()
    factor = torch.tensor(0.3129, dtype=factor_dtype)
    expected = [t.clone().mul_(factor) for t in tensors]
    scale_(tensors, factor, impl=impl)
    for t, e in zip(tensors, expected):
        assert t.dtype == e.dtype and torch.equal(t, e)
    assert not torch.equal(tensors[1], _mixed_tensors()[1])  # it did scale
    base = torch.arange(1.0, 13.0).view(3, 4)  # a strided view (the foreach fallback): its own elements, none of the rest
    scale_([base[:, :2]], torch.tensor(10.0, dtype=factor_dtype), impl=impl)
    assert base.tolist() == [[10.0, 20.0, 3.0, 4.0], [50.0, 60.0, 7.0, 8.0], [90.0, 100.0, 11.0, 12.0]]


def test_scale_kernel_over_several_chunks_is_mul(monkeypatch):
    """Chunks of 2048 elements (65536 on a GPU): 5000 elements span three programs."""
    import fmoe.optim.adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "CHUNK", 2048)
    tensors = [torch.randn(5000), torch.randn(3, 1700).to(torch.bfloat16)]
    factor = torch.tensor(0.3129)
    expected = [t.clone().mul_(factor) for t in tensors]
    scale_(tensors, factor, impl="triton")
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_scale_kernel_rounds_the_factor_as_torch_does_on_cuda(monkeypatch):
    """On CUDA torch casts a 0-D CUDA factor to the tensor's dtype before it multiplies; the
    kernel's branch for that rule (taken on CUDA) gives t * round(factor) bit for bit, which
    differs from the float32 factor's product for bf16 and fp16."""
    import fmoe.optim.adamw as adamw

    monkeypatch.setattr(adamw, "_torch_rounds_factor", lambda device: True)
    tensors = _mixed_tensors()
    factor = torch.tensor(0.3129)
    expected = [t.clone().mul_(factor.to(t.dtype)) for t in tensors[:-1]]  # a CPU scalar of t's dtype, read exactly
    unrounded = [t.clone().mul_(factor) for t in tensors[:-1]]
    scale_(tensors, factor, impl="triton")
    for t, e in zip(tensors, expected):
        assert t.dtype == e.dtype and torch.equal(t, e)
    assert not torch.equal(tensors[1], unrounded[1]) and not torch.equal(tensors[3], unrounded[3])


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_clip_with_the_kernel_is_torch_bit_for_bit(norm_type):
    """clip_grad_norm's one-process path with the multi-tensor kernel (impl="triton", the
    CUDA default) returns torch's norm and leaves torch's gradients, bit for bit, for float32
    gradients."""
    params = _params_with_grads(torch.float32)
    ref = _copies(params)
    norm = clip_grad_norm(params, 0.5, norm_type=norm_type, impl="triton")
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
    assert norm.dtype == torch.float32 and torch.equal(norm, expected.float())
    for p, q in zip(params, ref):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert not torch.equal(params[0].grad, _params_with_grads(torch.float32)[0].grad)  # it did clip


@pytest.mark.gpu
def test_scale_and_clip_on_cuda_are_torch_bit_for_bit():
    """On CUDA "auto" takes the kernel: the bits of mul_ for a model's mix (bf16 matrices, a
    float32 router, an odd-sized tensor) at real sizes; the clip of that mix scales by
    clip_factor of the float32 norm (mul_'s bits), of float32 gradients alone as torch's
    clip_grad_norm_, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [((64, 2048, 768), torch.bfloat16), ((2048, 8192), torch.bfloat16), ((64, 2048), torch.float32), ((1001,), torch.bfloat16)]
    tensors = [torch.randn(s, generator=g, device="cuda").to(dt) for s, dt in shapes]
    factor = torch.tensor(0.0371, device="cuda")
    expected = [t.clone().mul_(factor) for t in tensors]
    scale_(tensors, factor)
    differ = [(tuple(t.shape), t.dtype, (t.float() - e.float()).abs().max().item()) for t, e in zip(tensors, expected) if not torch.equal(t, e)]
    assert not differ, f"(shape, dtype, max difference) of the tensors that differ from mul_: {differ}"
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    exact = torch.cat([t.double().flatten() for t in tensors]).norm()
    norm = clip_grad_norm(params, 1.0)
    assert abs(float(norm) / float(exact) - 1) < 1e-6, (float(norm), float(exact))
    factor = clip_factor(norm, 1.0)
    assert all(torch.equal(p.grad, t.clone().mul_(factor)) for p, t in zip(params, tensors))
    floats = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float32)) for t in tensors]
    for p, t in zip(floats, tensors):
        p.grad = t.float()
    ref = _copies(floats)
    assert torch.equal(clip_grad_norm(floats, 1.0), torch.nn.utils.clip_grad_norm_(ref, 1.0).float())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(floats, ref))


def test_scale_and_clip_refusals():
    t = torch.ones(3)
    _raises("factor: expected a 0-D floating tensor", scale_, [t], torch.ones(2))
    _raises("factor: expected a 0-D floating tensor", scale_, [t], 0.5)
    _raises("impl: expected one of", scale_, [t], torch.tensor(0.5), impl="cuda")
    _raises("impl: expected one of", clip_grad_norm, _params_with_grads(), 1.0, impl="cuda")
    assert torch.equal(t, torch.ones(3))


@pytest.mark.parametrize("max_norm", [0.5, 1e3, math.inf])
def test_clip_factor_is_the_clips_scale(max_norm):
    """clip_factor(grad_norm, max_norm) is the factor clip_grad_norm scales float32 gradients
    by, bit for bit (1 below max_norm; inf: no clipping, train_moe's --clip=inf): what
    AdamW.step(grad_factor=...) takes instead."""
    params = _params_with_grads()
    before = [p.grad.clone() for p in params[:2]]
    factor = clip_factor(grad_norm(params), max_norm)
    assert factor.dtype == torch.float32 and factor.dim() == 0
    assert (float(factor) == 1.0) == (max_norm > 1.0)
    clip_grad_norm(params, max_norm)
    assert all(torch.equal(p.grad, g * factor) for p, g in zip(params, before))
    _raises("max_norm: expected a positive number", clip_factor, factor, 0.0)
    _raises(r"norm: expected a 0-D tensor \[\] \(grad_norm's\), got shape \(2,\)", clip_factor, torch.ones(2), 1.0)
    _raises(r"norm: expected a tensor \[\] \(grad_norm's\), got float", clip_factor, 5.0, 1.0)
    _raises("norm: expected dtype float32, bfloat16 or float16, got torch.int64", clip_factor, torch.tensor(5), 1.0)


def test_a_copy_also_in_parameters_is_scaled_once_and_not_counted():
    """copies given in parameters too (a last pipeline stage's parameters with its tied
    embedding): the norm leaves them out and their gradient is scaled once, as param_norm and
    zero_grad_count read the same pair; before, the copy was counted and scaled twice."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])
    norm = clip_grad_norm([a, b], 1.0, copies=[a, a])
    assert float(norm) == 2.0  # b's alone
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 4.0]) * (1.0 / (2.0 + 1e-6)))
    torch.testing.assert_close(b.grad, torch.tensor([0.0, 1.0]))
    assert float(param_norm([a, b], copies=[a])) == 0.0 and int(zero_grad_count([a, b], copies=[a])) == 1


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_clip_grad_norm_below_max_leaves_grads(impl):
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params[:2]]
    norm = clip_grad_norm(iter(params), 1e3, impl=impl)  # a generator works too; the kernel's factor is clamped to 1 as torch's
    assert float(norm) < 1e3
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    assert torch.equal(grad_norm(params[0]), torch.linalg.vector_norm(grads[0]))  # one tensor works too


def test_clip_grad_norm_inf_bf16_and_no_grads():
    params = _params_with_grads(torch.bfloat16)
    expected = max(float(p.grad.float().abs().max()) for p in params[:2])
    norm = clip_grad_norm(params, 1e3, norm_type=INF)
    assert norm.dtype == torch.float32 and float(norm) == expected
    bare = [torch.nn.Parameter(torch.ones(3))]
    norm = clip_grad_norm(bare, 1.0)
    assert norm.dtype == torch.float32 and float(norm) == 0.0 and bare[0].grad is None
    for p in (2.0, INF):
        norm = grad_norm([], norm_type=p)
        assert norm.dtype == torch.float32 and norm.dim() == 0 and float(norm) == 0.0


def test_bad_arguments_name_the_argument():
    params = _params_with_grads()
    _raises("max_norm: expected a positive number", clip_grad_norm, params, 0.0)
    _raises("max_norm:", clip_grad_norm, params, -1.0)
    _raises("max_norm:", clip_grad_norm, params, float("nan"))
    _raises("max_norm:", clip_grad_norm, params, True)
    for fn, args in ((grad_norm, ()), (clip_grad_norm, (1.0,))):
        _raises("norm_type: expected a number > 0 or inf", fn, params, *args, norm_type=0)
        _raises("norm_type:", fn, params, *args, norm_type="inf")
        _raises("parameters: expected a tensor or an iterable", fn, 3, *args)
        _raises(r"parameters\[1\]: expected a tensor", fn, [params[0], "w"], *args)
        _raises("group: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got str", fn, params, *args, group="dp")
    for foreach in (None, False):  # torch's own clip (foreach=False) reads no impl: checked all the same
        _raises("impl: expected one of", clip_grad_norm, params, 1.0, impl="trition", foreach=foreach)
    assert params[0].grad is not None and not torch.equal(params[0].grad, torch.zeros(3, 4))  # nothing clipped


def test_optim_does_not_import_parallel():
    """Layering: parallel, optim and train are siblings; fmoe.parallel imports fmoe.optim only."""
    code = "import sys, fmoe.optim; bad = [m for m in sys.modules if m.startswith('fmoe.parallel')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- parameter norm, zero gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_param_norm_on_one_process(dtype):
    """The norm of the concatenated values, summed in float32 even for bf16 weights."""
    params = _params_with_grads(dtype)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape))
    copy = torch.nn.Parameter(torch.full((4,), 100.0, dtype=dtype))
    with counting_all_reduce() as calls:
        norm = param_norm(params + [copy], copies=[copy])  # a copy in the list is not counted
    assert calls == []
    assert norm.dtype == torch.float32 and norm.dim() == 0 and not norm.requires_grad
    exact = torch.cat([p.detach().double().flatten() for p in params]).norm()
    torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)
    assert torch.equal(param_norm(params[1]), torch.linalg.vector_norm(params[1].detach(), dtype=torch.float32))  # one tensor
    assert float(param_norm([])) == 0.0


def test_zero_grad_count_counts_elements():
    params = _params_with_grads()  # [3, 4] and [5] with grads, [2, 2] without
    params[0].grad[0, 1] = 0.0
    params[0].grad[2, :] = -0.0  # -0.0 == 0 too
    params[1].grad[3] = 1e-45  # the smallest float32 subnormal is not zero
    count = zero_grad_count(params)
    assert count.dtype == torch.int64 and count.dim() == 0
    expected = sum(int((p.grad == 0).sum()) if p.grad is not None else p.numel() for p in params)
    assert int(count) == expected == 1 + 4 + 4
    copy = torch.nn.Parameter(torch.zeros(7))  # no grad, but a copy: not counted
    assert int(zero_grad_count(iter(params + [copy]), copies=copy)) == 9
    bf16 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    bf16.grad = torch.tensor([1e-30, 0.0, 1.0]).bfloat16()  # bf16 keeps float32's exponent range
    assert int(zero_grad_count([bf16])) == 1
    assert int(zero_grad_count([])) == 0


def test_param_norm_and_zero_count_refusals():
    params = _params_with_grads()
    for fn in (param_norm, zero_grad_count):
        _raises("parameters: expected a tensor or an iterable", fn, 3)
        _raises(r"parameters\[1\]: expected a tensor", fn, [params[0], "w"])
        _raises(r"parameters\[0\]: expected a tensor", fn, params, copies=["w"])
        _raises("group: expected a torch.distributed ProcessGroup or a 1-D DeviceMesh, got str", fn, params, group="dp")
        _raises("group: with pp_group, pass the group of this pipeline stage's ranks", fn, params, pp_group="pp")
    _raises(r"parameters\[1\]: expected floating-point values, got torch.int64", param_norm, [params[0], torch.tensor([3, 4])])


# ---------------------------------------------------------------------------- a world of one rank


def test_world_of_one_rank_issues_no_collective(one_rank_mesh):
    mesh = one_rank_mesh
    """torch.distributed initialised with one rank: plain grads as torch does; DTensor grads
    by the distributed rule (counted once); never an all_reduce; a Partial grad refused."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    params = _params_with_grads()
    ref = _copies(params)
    with counting_all_reduce() as calls:
        norm = clip_grad_norm(params, 0.5, group=mesh)
        expected = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        assert torch.equal(norm, expected.float())
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(params[:2], ref[:2]))

        full = torch.randn(4, 3)
        w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
        w.grad = distribute_tensor(full, mesh, [Shard(0)])
        plain = torch.nn.Parameter(torch.zeros(5))
        plain.grad = torch.randn(5)
        both = torch.cat([full.flatten(), plain.grad])
        for p in (2.0, 3.0, INF):
            got = grad_norm([w, plain], norm_type=p)
            assert got.dtype == torch.float32 and got.dim() == 0
            torch.testing.assert_close(got, torch.linalg.vector_norm(both, p), rtol=1e-6, atol=0)
        kept = (w.grad.to_local().clone(), plain.grad.clone())
        norm = clip_grad_norm([w, plain], 1.0)
        torch.testing.assert_close(norm, both.norm(), rtol=1e-6, atol=0)
        coef = 1.0 / (float(norm) + 1e-6)
        torch.testing.assert_close(w.grad.to_local(), full * coef)
        torch.testing.assert_close(plain.grad, both[12:] * coef)
        scaled = (w.grad.to_local().clone(), plain.grad.clone())
        w.grad.to_local().copy_(kept[0])
        plain.grad.copy_(kept[1])
        assert torch.equal(clip_grad_norm([w, plain], 1.0, impl="triton"), norm)  # the kernel's scale, the same bits
        assert torch.equal(w.grad.to_local(), scaled[0]) and torch.equal(plain.grad, scaled[1])
    assert calls == []

    partial = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Shard(0)]))
    partial.grad = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    _raises(r"parameters\[1\]: .*Partial", grad_norm, [plain, partial])

    # param_norm and zero_grad_count: the DTensor shard counted once, no collective
    with torch.no_grad():
        w.to_local().copy_(full)
    grad = full.clone()
    grad[1] = 0.0
    w.grad = distribute_tensor(grad, mesh, [Shard(0)])
    bare = torch.nn.Parameter(distribute_tensor(torch.ones(2, 5), mesh, [Shard(1)]))  # no grad: 10 elements
    with counting_all_reduce() as calls:
        norm = param_norm([w, plain])
        count = zero_grad_count([w, plain, bare])
    assert calls == []
    assert norm.dtype == torch.float32 and count.dtype == torch.int64
    torch.testing.assert_close(norm, torch.cat([full.flatten(), plain.detach()]).norm(), rtol=1e-6, atol=0)
    assert int(count) == 3 + int((plain.grad == 0).sum()) + 10
    _raises(r"parameters\[0\]: its gradient has a Partial placement", zero_grad_count, [partial])
    _raises(r"parameters\[0\]: its value has a Partial placement", param_norm,
            [DTensor.from_local(torch.ones(2), mesh, [Partial()])])


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
    acc.zero_grad()  # its own .grad too, before (or without) the optimizer's zero_grad
    assert acc.main_grads == {} and model.router.weight.grad is None
    opt.zero_grad()
    model(*batches[2]).backward()
    assert torch.equal(acc.main_grads["router.weight"], batches[2][0].float()[None])  # not summed with the old


def test_copy_to_grad_of_a_float32_parameter_is_a_copy():
    """A float32 parameter (fmoe keeps routers in float32): its .grad is a copy of the float32
    sum, so clipping .grad in place leaves main_grads as they were."""
    model = torch.nn.Linear(3, 2)
    acc = Float32GradAccumulator(model, patterns=("weight",))
    model(torch.ones(1, 3)).sum().backward()
    acc.copy_to_grad()
    before = acc.main_grads["weight"].clone()
    assert torch.equal(model.weight.grad, before) and model.weight.grad.data_ptr() != acc.main_grads["weight"].data_ptr()
    clip_grad_norm(model.parameters(), 0.1)
    assert torch.equal(acc.main_grads["weight"], before) and not torch.equal(model.weight.grad, before)


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


def test_patterns_that_are_not_strings_name_the_argument():
    """patterns=3 was a TypeError from list(3); a bytes pattern compiled, then failed on the
    first name with a TypeError."""
    model = torch.nn.ModuleDict({"router": torch.nn.Linear(2, 2)})
    _raises("^patterns: expected a regular expression or an iterable of them, got 3", Float32GradAccumulator, model, patterns=3)
    _raises("^model: expected a torch.nn.Module .its named_parameters are matched., got list", Float32GradAccumulator, list(model.parameters()))
    _raises("^patterns: expected regular expressions", Float32GradAccumulator, model, patterns=[b"router"])
    _raises("^patterns: expected a regular expression or an iterable", Float32GradAccumulator, model, patterns=None)


@pytest.mark.parametrize("foreach", [None, False])
def test_float64_and_complex_tensors_are_normed(one_rank_mesh, foreach):
    """param_norm takes complex values, and the distributed rule (DTensor gradients) any
    floating gradient: both asked torch's norms for a float32 result of float64 or complex
    values, which torch refuses (a RuntimeError from linalg.vector_norm)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    values = [torch.tensor([3 + 4j, 1 - 2j]), torch.tensor([2.0, -6.0], dtype=torch.float64), torch.tensor([0.5, 1.5])]
    params = [torch.nn.Parameter(v) for v in values]
    flat = torch.cat([v.to(torch.complex128).flatten() for v in values])
    torch.testing.assert_close(param_norm(params).double(), flat.abs().norm(), rtol=1e-6, atol=0)
    grads = []
    for v in values:
        w = torch.nn.Parameter(distribute_tensor(torch.zeros_like(v), one_rank_mesh, [Shard(0)]))
        w.grad = distribute_tensor(v, one_rank_mesh, [Shard(0)])
        grads.append(w)
    for p in (2.0, 3.0, INF):
        got = grad_norm(grads, norm_type=p, foreach=foreach)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), torch.linalg.vector_norm(flat, p), rtol=1e-6, atol=0)


@pytest.mark.parametrize("number", [numpy.float32(0.5), numpy.int64(1), fractions.Fraction(1, 2)], ids=["float32", "int64", "Fraction"])
def test_numpy_numbers_are_numbers(number):
    """max_norm and norm_type take any real number, as lr_at and AdamW do (numpy scalars were
    refused as not positive); bools, NaN and values <= 0 stay refused."""
    params, ref = _params_with_grads(), _params_with_grads()
    assert torch.equal(clip_grad_norm(params, number), clip_grad_norm(ref, float(number)))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params[:2], ref[:2]))  # params[2] has no grad
    norm = grad_norm(params)
    assert torch.equal(clip_factor(norm, number), clip_factor(norm, float(number)))
    assert torch.equal(grad_norm(params, norm_type=number * 4), grad_norm(params, norm_type=float(number * 4)))
    for bad in (numpy.float32("nan"), numpy.float32(0.0), numpy.int64(-1), numpy.True_, True):
        _raises("max_norm: expected a positive number", clip_grad_norm, params, bad)
        _raises("max_norm: expected a positive number", clip_factor, norm, bad)
        _raises("norm_type: expected a number > 0 or inf", grad_norm, params, norm_type=bad)


def test_inf_max_norm_leaves_an_infinite_gradient_as_it_is():
    """max_norm=inf is documented as no clipping (train_moe's --clip=inf), but torch's factor
    inf / (inf + 1e-6) is NaN: an infinite gradient came back all NaN, finite entries too."""
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([math.inf, 1.0])
    norm = clip_grad_norm([w], math.inf)
    assert float(norm) == math.inf and torch.equal(w.grad, torch.tensor([math.inf, 1.0]))
    for bad in (math.inf, math.nan):
        factor = clip_factor(torch.tensor(bad), math.inf)
        assert factor.dtype == torch.float32 and factor.dim() == 0 and float(factor) == 1.0
    assert float(clip_factor(torch.tensor(math.inf), 1.0)) == 0.0  # a finite max_norm still clips as torch does
