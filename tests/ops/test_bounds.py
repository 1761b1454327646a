"""Every Triton kernel reads and writes only inside the tensors it is given.

Under the interpreter a kernel's tensors are host memory: a store past a tensor's end lands
in whatever the heap holds there (a crash later, or nothing seen), and a load past it reads
that. On a GPU the same access is another tensor's bytes, a race, or an illegal address.
Here every load, store and atomic of each launch (the lanes its mask leaves on) must
address bytes of the launch's tensor arguments, and the tensors are copied into buffers
with guard bytes before and after (0xFF: NaN in every float dtype, -1 in every int), so a
stray store lands in a guard, not in the heap, and is reported by kernel and argument.
The shapes are odd sizes that leave every block partly filled, and reach a second block
where a kernel loops over blocks; outputs and gradients must equal, bit for bit, those of
the same run without the check.

AdamW's and `scale_`'s multi-tensor launches take a table of pointers: their tensors are
named to the check, not guarded. Outside it: `_zero_unowned_kernel`, which runs after torch._grouped_mm on CUDA only (tests/ops/
test_experts.py::test_zero_unowned puts its tensors inside guards).
"""

from contextlib import contextmanager, nullcontext
from functools import partial
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fmoe.ops as ops
from fmoe.ops import dispatch as dispatch_module
from fmoe.optim import AdamW
from fmoe.optim.adamw import scale_
from tests.conftest import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="guards host copies of the tensors: needs the Triton interpreter (TRITON_INTERPRET=1)")

GUARD = 1 << 12  # bytes before and after each tensor's storage: a multiple of every element size


@contextmanager
def guarded_launches(also=lambda: ()):
    """Within the block, each interpreted kernel launch runs on guarded copies of its tensor
    arguments (one copy per storage, so aliases stay aliases), and every load, store and
    atomic the kernel makes (lanes its mask leaves on) must address bytes of those tensors,
    or of the tensors `also()` returns at the launch (those a pointer table names: they are
    checked, not guarded). Either failure raises an AssertionError naming the kernel and the
    argument nearest the address. Yields the list of kernels launched."""
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder

    launched, launch = [], {}  # launch: the running kernel's name, tensors' (start, end, name) and first stray access
    original = {name: getattr(InterpreterBuilder, name) for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw")}
    original_run = InterpretedFunction.run

    def check(what, ptrs, mask):
        if not launch or launch["stray"] is not None:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)] if mask is not None else addresses.ravel()
        inside = np.zeros(addresses.shape, dtype=bool)
        for begin, end, _ in launch["tensors"]:
            inside |= (addresses >= begin) & (addresses + size <= end)
        if not inside.all():
            bad = int(addresses[~inside][0])
            below = [(begin, end, name) for begin, end, name in launch["tensors"] if begin <= bad]
            where = (f"at {max(below)[2]}'s end + {bad - max(below)[1]} bytes" if below
                     else f"{min(launch['tensors'])[0] - bad} bytes before {min(launch['tensors'])[2]}")
            launch["stray"] = f"{launch['kernel']}: a {what} {where} ({int((~inside).sum())} of {inside.size} lanes)"

    def masked_load(self, ptrs, mask, other, *args):
        check("load", ptrs, mask)
        return original["create_masked_load"](self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        check("store", ptrs, mask)
        return original["create_masked_store"](self, ptrs, value, mask, *args)

    def atomic_rmw(self, op, ptr, val, mask, *args):
        check("atomic", ptr, mask)
        return original["create_atomic_rmw"](self, op, ptr, val, mask, *args)

    def run(self, *args, grid, warmup, **kwargs):
        copies = {}  # storage address -> (the storage as bytes, the guarded buffer)

        def guarded(arg):
            if not isinstance(arg, torch.Tensor):
                return arg
            arg = arg.detach()
            storage = arg.untyped_storage()
            if storage.data_ptr() not in copies:
                data = torch.empty(0, dtype=torch.uint8).set_(storage)
                buffer = torch.full((2 * GUARD + data.numel(),), 0xFF, dtype=torch.uint8)
                buffer[GUARD:GUARD + data.numel()] = data
                copies[storage.data_ptr()] = (data, buffer)
            buffer = copies[storage.data_ptr()][1]
            return torch.empty(0, dtype=arg.dtype).set_(buffer.untyped_storage(), arg.storage_offset() + GUARD // arg.element_size(),
                                                       arg.size(), arg.stride())

        names = list(self.arg_names[:len(args)]) + list(kwargs)
        args = [guarded(a) for a in args]
        kwargs = {key: guarded(value) for key, value in kwargs.items()}
        tensors = [(name, a) for name, a in zip(names, [*args, *kwargs.values()]) if isinstance(a, torch.Tensor)]
        regions = {}  # a storage's data bytes -> the names of its arguments
        for name, a in tensors:
            begin = a.untyped_storage().data_ptr() + GUARD
            regions.setdefault((begin, begin + a.untyped_storage().nbytes() - 2 * GUARD), []).append(name)
        for i, a in enumerate(also()):
            begin = a.untyped_storage().data_ptr()
            regions.setdefault((begin, begin + a.untyped_storage().nbytes()), []).append(f"also()[{i}]")
        launch.update(kernel=self.fn.__name__, stray=None, tensors=[(b, e, " / ".join(n)) for (b, e), n in regions.items()])
        try:
            result = original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            stray = launch["stray"]
            launch.clear()
        launched.append(self.fn.__name__)
        changed = []  # the arguments whose guards a store reached
        for data, buffer in copies.values():
            n = data.numel()
            data.copy_(buffer[GUARD:GUARD + n])
            if not (bool((buffer[:GUARD] == 0xFF).all()) and bool((buffer[GUARD + n:] == 0xFF).all())):
                changed += [name for name, a in tensors if a.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()]
        assert stray is None, stray
        assert not changed, f"{self.fn.__name__}: stores outside {' / '.join(changed)}"
        return result

    InterpretedFunction.run = run
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store
    InterpreterBuilder.create_atomic_rmw = atomic_rmw
    try:
        yield launched
    finally:
        InterpretedFunction.run = original_run
        for name, method in original.items():
            setattr(InterpreterBuilder, name, method)


def _grads(out, inputs, seed=1):
    """The outputs, and the gradients of a random weighting of the float outputs."""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    g = torch.Generator().manual_seed(seed)
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    grads = torch.autograd.grad(sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in floats), inputs,
                                allow_unused=True) if floats else []
    return [o.detach() for o in outs] + [x for x in grads if x is not None]


def _leaf(*shape, gen, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()


def _route(gen, dtype=torch.float32):
    logits = _leaf(33, 12, gen=gen, dtype=dtype)
    bias = 0.05 * torch.randn(12, generator=gen)
    runs = [ops.route(logits, 3, impl="triton"),
            ops.route(logits, 4, score="sigmoid", n_groups=4, topk_groups=2, expert_bias=bias, scale=2.5, group_score_topk=2, impl="triton"),
            ops.route(logits, 2, score="sqrtsoftplus", impl="triton"),
            ops.route(logits, 2, pre_softmax=True, impl="triton")]
    return [x for r in runs for x in _grads((r.weights, r.experts), [logits])]


def _balance(gen):
    logits = _leaf(33, 7, gen=gen)
    scores, experts, counts = ops.aux_scores(logits, 3, score="sigmoid", return_counts=True, impl="triton")
    return _grads((scores, experts, counts), [logits]) + _grads(ops.z_loss(logits, mask=torch.arange(33) % 5 != 0, impl="triton"), [logits])


def _dispatch(gen, by="scatter", dtype=torch.float32):
    x = _leaf(19, 5, gen=gen, dtype=dtype)
    experts = torch.randint(-1, 5, (19, 3), generator=gen)  # 5 experts: a partial block of them
    weights = torch.rand(19, 3, generator=gen).requires_grad_()
    with patch.object(dispatch_module, "PERMUTE_BY", by):
        x_perm, plan = ops.permute(x, experts, 5, align=4, impl="triton")
        y = ops.unpermute(x_perm * 1.5, plan, weights, impl="triton")
        return _grads((x_perm, y), [x, weights])


def _experts(gen, dtype=torch.float32):
    offsets = torch.tensor([5, 5, 12, 19], dtype=torch.int32)
    x = _leaf(19, 5, gen=gen, dtype=dtype)
    w_gate, w_up, w_down = (_leaf(4, *shape, gen=gen, dtype=dtype) for shape in ((5, 7), (5, 7), (7, 5)))
    b_gate, b_up, b_down = (_leaf(4, n, gen=gen, dtype=dtype) for n in (7, 7, 5))
    gate, up = _leaf(5, 301, gen=gen, dtype=dtype), _leaf(5, 301, gen=gen, dtype=dtype)  # 1505 elements: a partial block of the elementwise kernels
    y = ops.grouped_mlp(x, w_gate, w_up, w_down, offsets, b_gate=b_gate, b_up=b_up, b_down=b_down, limit=7.0, impl="triton")
    z = ops.grouped_matmul(x, w_gate, offsets, impl="triton")
    h = ops.swiglu(gate, up, impl="triton")
    return _grads((y, z, h), [x, w_gate, w_up, w_down, b_gate, b_up, b_down, gate, up])


def _rope(gen, dtype=torch.float32):
    x = _leaf(2, 7, 3, 48, gen=gen, dtype=dtype)
    inv_freq = ops.rope_inv_freq(24, base=100.0)  # 12 frequencies: a partial block of them
    cos, sin = (t.clone() for t in ops.rope_cos_sin(torch.arange(7), inv_freq))  # storages of their own: nothing after them
    return (_grads(ops.apply_rope(x, cos, sin, impl="triton"), [x])
            + _grads(ops.apply_rope(x, cos, sin, interleaved=True, impl="triton"), [x]))


def _loss(gen, dtype=torch.float32):
    logits = _leaf(9, 37, gen=gen, dtype=dtype)
    labels = torch.randint(0, 37, (9,), generator=gen)
    labels[2] = -100
    h, w, b = _leaf(9, 8, gen=gen, dtype=dtype), _leaf(37, 8, gen=gen, dtype=dtype), _leaf(37, gen=gen, dtype=dtype)
    return (_grads(ops.cross_entropy(logits, labels, impl="triton"), [logits])
            + _grads(ops.cross_entropy(logits, labels, softcap=3.0, reduction="sum", impl="triton"), [logits])
            + _grads(ops.linear_cross_entropy(h, w, labels, bias=b, chunk_rows=4, impl="triton"), [h, w, b]))


def _packed(gen):
    x = _leaf(11, 3, gen=gen)
    cu = torch.tensor([0, 4, 5, 11])
    tokens = torch.randint(0, 50, (11,), generator=gen)
    targets = ops.mtp_targets(tokens, cu, 2, impl="triton")
    return _grads(ops.roll_packed(x, cu, shift=-2, impl="triton"), [x]) + [t[key] for t in targets for key in t.keys()]


def _delta(gen):
    B, T, N, Dk, Dv = 1, 11, 2, 5, 3
    q, k, v = _leaf(B, T, N, Dk, gen=gen), F.normalize(torch.randn(B, T, N, Dk, generator=gen), dim=-1).requires_grad_(), _leaf(B, T, N, Dv, gen=gen)
    g = (-F.softplus(torch.randn(B, T, N, generator=gen))).requires_grad_()
    g_channels = (-0.2 * torch.rand(B, T, N, Dk, generator=gen)).requires_grad_()
    beta = torch.rand(B, T, N, generator=gen).requires_grad_()
    cu = torch.tensor([0, 6, 11])
    o, state = ops.gated_delta_rule(q, k, v, g, beta, cu, final_state=True, chunk_size=4, impl="triton")
    o2 = ops.gated_linear_attention(q, k, v, g_channels, chunk_size=4, impl="triton")
    return _grads((o, state, o2), [q, k, v, g, g_channels, beta])


def _scan(gen):
    B, T, C, N = 1, 11, 5, 3
    u, b, c = _leaf(B, T, C, gen=gen), _leaf(B, T, N, gen=gen), _leaf(B, T, N, gen=gen)
    dt = (0.05 + 0.5 * torch.rand(B, T, C, generator=gen)).requires_grad_()
    A = (-0.5 - 3 * torch.rand(C, N, generator=gen)).requires_grad_()
    y, state = ops.selective_scan(u, dt, A, b, c, torch.tensor([0, 7, 11]), final_state=True, chunk_size=4, impl="triton")
    return _grads((y, state), [u, dt, A, b, c])


def _sparse(gen, deterministic=False):
    T, N, D, S, J, Dv = 7, 3, 12, 10, 5, 8
    q, kv = _leaf(T, N, D, gen=gen), _leaf(S, D, gen=gen)
    index = torch.stack([torch.randperm(S, generator=gen)[:J] for _ in range(T)])
    index = torch.where(torch.rand(T, J, generator=gen) < 0.3, -1, index)
    o, lse = ops.sparse_attention(q, kv, index, v_dim=Dv, impl="triton")
    probs = ops.sparse_attention_probs(q.detach(), kv.detach(), index, lse.detach(), v_dim=Dv, impl="triton")
    scores = ops.indexer_scores(q.detach(), torch.rand(T, N, generator=gen), kv.detach(), impl="triton")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)  # on: dkv by key (a sort of the slots); off: atomic adds per query
    try:
        return _grads((o, lse), [q, kv]) + [probs, scores]
    finally:
        torch.use_deterministic_algorithms(before)


def _fp8(gen):
    t = 3 * torch.randn(5, 300, generator=gen)
    x = _leaf(19, 32, gen=gen)
    w_gate, w_up, w_down = _leaf(4, 32, 16, gen=gen), _leaf(4, 32, 16, gen=gen), _leaf(4, 16, 32, gen=gen)
    offsets = torch.tensor([5, 5, 12, 19], dtype=torch.int32)
    y = ops.grouped_mlp(x, w_gate, w_up, w_down, offsets, fp8=True, impl="triton")
    return [q.float() if q.dtype.itemsize == 1 else q for dim in (0, 1) for q in ops.fp8_quantize(t, dim, impl="triton")] + _grads(y, [x, w_gate, w_up, w_down])


CASES = {"route": _route, "balance": _balance, "dispatch": _dispatch, "dispatch-gather": partial(_dispatch, by="gather"),
         "experts": _experts, "rope": _rope, "loss": _loss,
         "packed": _packed, "delta": _delta, "scan": _scan, "sparse": _sparse, "sparse-deterministic": partial(_sparse, deterministic=True),
         "fp8": _fp8}
CASES |= {f"{name}-bf16": partial(CASES[name], dtype=torch.bfloat16) for name in ("route", "dispatch", "experts", "rope", "loss")}  # 2-byte elements


@pytest.mark.parametrize("case", CASES)
def test_kernels_stay_inside_their_tensors(case):
    """The op's kernels, forward and backward, under the check: no access outside a tensor,
    and the same outputs and gradients, bit for bit, as the run without it."""
    with guarded_launches() as launched:  # first: a stray store without guards may corrupt the heap and crash
        got = CASES[case](torch.Generator().manual_seed(0))
    want = CASES[case](torch.Generator().manual_seed(0))
    assert launched, f"{case}: no Triton kernel ran"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{case} output {i} ({sorted(set(launched))}): {m}")


@pytest.mark.parametrize("offsets", [[2, 4000], [7, 9], [3, -1], [4, 2]])
def test_expert_kernels_stay_inside_their_tensors_for_offsets_unchecked_on_request(offsets):
    """check=False (and torch.compile, which skips the host check) hands the grouped GEMMs
    offsets as given: ones past the rows, negative, or decreasing give wrong rows, never an
    access outside a tensor, forward and backward."""
    gen = torch.Generator().manual_seed(1)
    x, w = _leaf(5, 16, gen=gen), _leaf(2, 16, 8, gen=gen)
    w_gate, w_up, w_down = _leaf(2, 16, 8, gen=gen), _leaf(2, 16, 8, gen=gen), _leaf(2, 8, 16, gen=gen)
    off = torch.tensor(offsets, dtype=torch.int32)
    with guarded_launches() as launched:
        ops.grouped_matmul(x, w, off, check=False, impl="triton").sum().backward()
        ops.grouped_mlp(x, w_gate, w_up, w_down, off, check=False, impl="triton").sum().backward()
    assert {"_grouped_gemm_fwd_kernel", "_grouped_gemm_dw_kernel"} <= set(launched)


@pytest.mark.parametrize("dtype,state_dtype,masters", [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, True)], ids=str)
def test_optimizer_kernels_stay_inside_their_tensors(dtype, state_dtype, masters, monkeypatch):
    """AdamW's and scale_'s multi-tensor launches, over tensors of odd sizes (one over two
    chunks of 2048 elements, one of 48: the aligned launch), for two steps."""
    import fmoe.optim.adamw as adamw_module

    monkeypatch.setattr(adamw_module, "CHUNK", 2048)

    def steps(check):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 901), (7,), (48,), (3, 5))]
        opt = AdamW(params, lr=0.1, weight_decay=0.1, state_dtype=state_dtype, master_weights=masters, impl="triton")
        named = lambda: [t for p in params for t in (p, p.grad, *opt.state[p].values()) if isinstance(t, torch.Tensor) and t.dim()]  # noqa: E731
        with check(named) as launched:
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                scale_([p.grad for p in params], torch.tensor(0.75), impl="triton")
                opt.step()
        return [t.clone() for t in named()], launched

    got, launched = steps(guarded_launches)
    want, _ = steps(lambda also: nullcontext([]))
    assert set(launched) == {"_scale_kernel", "_adamw_kernel"}, launched
    assert len(got) == len(want) == 4 * (4 + masters)  # param, grad, two moments (and the master), for 4 params
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_check_catches_a_load_or_store_past_the_end():
    """The check itself: a kernel told its tensor is one element longer reads, or writes, its
    guard, and the error names the kernel and the argument; within bounds it runs as without."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    @triton.jit
    def unmasked_load_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs), mask=offs < n)

    x, out = torch.arange(5.0), torch.zeros(5)
    with guarded_launches() as launched:
        add_one_kernel[(1,)](x, out, 5, BLOCK=8)
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        with pytest.raises(AssertionError, match=r"^add_one_kernel: a load at x_ptr's end \+ 0 bytes \(1 of 6 lanes\)"):
            add_one_kernel[(1,)](x, out, 6, BLOCK=8)
        with pytest.raises(AssertionError, match=r"^unmasked_load_kernel: a load at x_ptr's end \+ 0 bytes \(3 of 8 lanes\)"):
            unmasked_load_kernel[(1,)](x, out, 5, BLOCK=8)
    assert launched == ["add_one_kernel", "add_one_kernel", "unmasked_load_kernel"]
    with guarded_launches():
        short = torch.zeros(4)
        with pytest.raises(AssertionError, match=r"^add_one_kernel: a store at out_ptr's end \+ 0 bytes \(1 of 5 lanes\)"):
            add_one_kernel[(1,)](x, short, 5, BLOCK=8)
    assert short.tolist() == [1.0, 2.0, 3.0, 4.0], "the store past the end went to the guard, the rest back to the tensor"


MODELS = ("all moe, triton", "dsa", "gated deltanet", "jamba")  # MoE, rope, CE; sparse attention; the delta rule; the scan


@pytest.mark.parametrize("name", MODELS)
def test_a_models_kernels_stay_inside_their_tensors(name):
    """A reference model's step with every op on its kernels (tests/test_model.py's variant,
    impl="triton"): the layers hand the kernels views and strides of their own, and the
    check holds for them too; the loss and every gradient as without the check."""
    import dataclasses

    from fmoe.model import Transformer
    from fmoe.train.data import make_batch
    from tests.test_model import VARIANTS

    cfg = dataclasses.replace(VARIANTS[name], impl="triton")

    def step():
        torch.manual_seed(0)
        model = Transformer(cfg)
        batch = make_batch(torch.randint(0, cfg.vocab_size, (13,)), torch.tensor([0, 5, 13]), mtp_depth=cfg.mtp_depth)
        losses, stats = model(batch, model.context(batch))
        loss = losses["lm_sum"] + sum(losses[f"mtp_{d}_sum"] for d in range(1, cfg.mtp_depth + 1))
        for s in stats.values():
            loss = loss + ops.z_loss(s["router_logits"], impl="triton")
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    with guarded_launches() as launched:
        got = step()
    want = step()
    assert launched, f"{name}: no Triton kernel ran"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name} tensor {i} ({sorted(set(launched))}): {m}")
