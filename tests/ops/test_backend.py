"""fmoe.ops.backend: the dispatch rule, and the check of the installed Triton interpreter."""

import pytest
import torch
import triton
import triton.language as tl

from fmoe.ops import backend
from fmoe.ops.backend import interpreter_problem, use_triton


def test_dispatch_rule():
    x = torch.zeros(2)
    assert use_triton("torch", x) is False and use_triton("auto", x) is False  # CPU tensors: the reference
    with pytest.raises(ValueError, match="impl: expected one of"):
        use_triton("cuda", x)


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True),       # torch 2.11's Triton with the newest numpy
    ("3.5.1+git9a1b", "2.4.0rc1", True),
    ("3.6.0", "2.3.5", False),      # numpy before 2.4: the interpreter runs the kernels
    ("3.7.1", "2.4.6", False),      # the CPU pin
    ("3.10.0", "2.10.0", False),    # compared as numbers, not as text
])
def test_interpreter_problem_names_the_versions_and_the_fix(triton_version, numpy_version, refused):
    problem = interpreter_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    if refused:
        assert f"Triton {triton_version}" in problem and f"numpy {numpy_version}" in problem
        assert "install numpy<2.4, or Triton 3.7 or newer" in problem and "impl='torch'" in problem
        assert "(pip install torch==2.13.0 triton==3.7.1, the pair make setup pins on CPU)" in problem  # a command without the checkout too


def test_interpreted_kernels_refuse_an_interpreter_that_cannot_run_them(monkeypatch):
    """impl='triton' on CPU under TRITON_INTERPRET=1 stops with the reason, instead of an
    InterpreterError from inside the first kernel; the reference still runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "INTERPRETER_PROBLEM", "impl='triton' on CPU: the interpreter of Triton 3.6.0 cannot ...")
    x = torch.zeros(2)
    with pytest.raises(RuntimeError, match="the interpreter of Triton 3.6.0 cannot"):
        use_triton("triton", x)
    assert use_triton("torch", x) is False and use_triton("auto", x) is False
    monkeypatch.setattr(backend, "INTERPRETER_PROBLEM", None)
    assert use_triton("triton", x) is True


def test_the_installed_versions_are_checked_once_at_import():
    assert backend.INTERPRETER_PROBLEM == interpreter_problem()


@triton.jit
def _recurrence(a1, x1, a2, x2):
    return a1 * a2, x1 * a2 + x2


@triton.jit
def _scan_kernel(a_ptr, x_ptr, outa_ptr, outx_ptr, R: tl.constexpr, L: tl.constexpr, AXIS: tl.constexpr, REVERSE: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * L + tl.arange(0, L)[None, :]
    a, x = tl.associative_scan((tl.load(a_ptr + offs), tl.load(x_ptr + offs)), AXIS, _recurrence, reverse=REVERSE)
    tl.store(outa_ptr + offs, a)
    tl.store(outx_ptr + offs, x)


@triton.jit
def _scan_1d_kernel(a_ptr, x_ptr, outx_ptr, L: tl.constexpr):
    offs = tl.arange(0, L)
    _, x = tl.associative_scan((tl.load(a_ptr + offs), tl.load(x_ptr + offs)), 0, _recurrence)
    tl.store(outx_ptr + offs, x)


def _recurrence_loop(a, x, axis, reverse):
    """h = a h + x along axis (from its end with reverse), and the products of a."""
    a, x = (t.movedim(axis, 0).flip(0) if reverse else t.movedim(axis, 0) for t in (a, x))
    outa, outx = a.clone(), x.clone()
    for i in range(1, a.shape[0]):
        outa[i], outx[i] = outa[i - 1] * a[i], outx[i - 1] * a[i] + x[i]
    return [(t.flip(0) if reverse else t).movedim(0, axis) for t in (outa, outx)]


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's scan: CPU runs only (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_vectorized_interpreter_scan_gives_the_interpreter_s_own_values(axis, reverse, monkeypatch):
    """tl.associative_scan with a combine of its own (a linear recurrence, not commutative) over
    a [4, 8] tile, along either axis, either way: the vectorized path (installed on import),
    the interpreter's own per-element path and a torch loop give the same values; a 1-D scan too."""
    from triton.runtime.interpreter import ScanOps

    assert backend.vectorize_interpreter_scans() and ScanOps.generic_scan._fmoe
    g = torch.Generator().manual_seed(axis + 2 * reverse)
    a, x = torch.rand(4, 8, generator=g) + 0.5, torch.randn(4, 8, generator=g)
    results = []
    for scan in (ScanOps.generic_scan, ScanOps.generic_scan.__wrapped__):
        monkeypatch.setattr(ScanOps, "generic_scan", scan)
        outa, outx = torch.empty_like(a), torch.empty_like(x)
        _scan_kernel[(1,)](a, x, outa, outx, R=4, L=8, AXIS=axis, REVERSE=reverse)
        results.append((outa, outx))
    want = _recurrence_loop(a, x, axis, reverse)
    for got in results:
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    monkeypatch.undo()
    out = torch.empty(8)
    _scan_1d_kernel[(1,)](a[0], x[0], out, L=8)
    torch.testing.assert_close(out, _recurrence_loop(a[0], x[0], 0, False)[1])


@triton.jit
def _doubled_plus_sum(x):
    return 2.0 * x + tl.sum(x, axis=0)


@triton.jit
def _helper_loop_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr, FAIL: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.load(x_ptr + offs)
    for _ in range(STEPS):
        acc = _doubled_plus_sum(acc) * 0.25
    if FAIL:
        tl.static_assert(N < 0, "fails on purpose")
    tl.store(out_ptr + offs, acc)


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's patches: CPU runs only (TRITON_INTERPRET=1)")
def test_helpers_inside_an_interpreted_kernel_reuse_its_patches(monkeypatch):
    """share_interpreter_patches (installed on import): a kernel calling a @triton.jit helper 5
    times in a loop (itself calling tl.sum, a helper of triton.language.core's module) patches
    the language modules at most 3 times, with 9 calls too (the interpreter's own way: 16 and
    28 times), with
    the same values as the interpreter's own way and a torch loop; after a launch, and after
    one that fails inside, triton.language's builtins are the originals again and the next
    launch patches afresh."""
    from triton.runtime import interpreter

    assert backend.share_interpreter_patches() and interpreter._patch_lang._fmoe
    shared = (interpreter._patch_lang, interpreter.GridExecutor.__call__)
    own = (interpreter._patch_lang.__wrapped__, interpreter.GridExecutor.__call__.__wrapped__)
    patches, patch_core = [], interpreter._patch_lang_core  # the interpreter's own patch: once per language module

    def counted(lang, scope):
        patches.append(lang.__name__)
        return patch_core(lang, scope)

    monkeypatch.setattr(interpreter, "_patch_lang_core", counted)
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    want = x.clone()
    for _ in range(5):
        want = (2 * want + want.sum()) * 0.25
    load = tl.load
    results = {}
    for name, (patch_lang, run_grid) in (("shared", shared), ("own", own), ("shared again", shared)):
        monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
        monkeypatch.setattr(interpreter.GridExecutor, "__call__", run_grid)
        patches.clear()
        out = torch.empty(8)
        _helper_loop_kernel[(1,)](x, out, N=8, STEPS=5, FAIL=False)
        results[name] = (out, len(patches))
        patches.clear()
        _helper_loop_kernel[(1,)](x, torch.empty(8), N=8, STEPS=9, FAIL=False)
        results[name] += (len(patches),)
        assert tl.load is load and triton.language.core.is_builtin(tl.load), name  # put back after the launch
        if name == "shared":
            with pytest.raises(Exception, match="fails on purpose"):
                _helper_loop_kernel[(1,)](x, torch.empty(8), N=8, STEPS=5, FAIL=True)
            assert tl.load is load
    torch.testing.assert_close(results["shared"][0], want)
    for name in ("own", "shared again"):
        torch.testing.assert_close(results[name][0], results["shared"][0], rtol=0, atol=0)
    for name in ("shared", "shared again"):  # the launch's, and at most one for the reductions' module: not one per helper call
        assert max(results[name][1:]) <= 3, results[name]
    assert results["own"][1:] == (16, 28)


@triton.jit
def _int_ops_kernel(x_ptr, out_ptr, N: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * SCALE + 1 - offs)


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's overflow checks: CPU runs only (TRITON_INTERPRET=1)")
def test_the_interpreter_s_overflow_checks_run_only_where_asserted(monkeypatch):
    """skip_unasserted_overflow_checks (installed on import): without the interpreter's debug
    option (its default), whose device_assert drops every check, an int32 kernel's +, - and *
    hand it nothing (the interpreter's own way: a check per op), with the same values, an
    overflow's wrapped ones included; with debug on, an overflow stops the kernel, saying so."""
    import dataclasses

    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    assert backend.skip_unasserted_overflow_checks() and semantic.binary_op_sanitize_overflow_impl._fmoe
    skipping = semantic.binary_op_sanitize_overflow_impl
    asserts, device_assert = [], semantic.device_assert

    def counted(cond, msg, mask):
        asserts.append(msg)
        return device_assert(cond, msg, mask)

    monkeypatch.setattr(semantic, "device_assert", counted)
    x = torch.arange(-8, 8, dtype=torch.int32) * 1000
    results = {}
    for name, check, scale in (("skipping", skipping, 3), ("own", skipping.__wrapped__, 3),
                               ("skipping, overflow", skipping, 1 << 20), ("own, overflow", skipping.__wrapped__, 1 << 20)):
        monkeypatch.setattr(semantic, "binary_op_sanitize_overflow_impl", check)
        asserts.clear()
        out = torch.empty_like(x)
        _int_ops_kernel[(1,)](x, out, N=16, SCALE=scale)
        results[name] = (out, len(asserts))
    for scale, names in ((3, ("skipping", "own")), (1 << 20, ("skipping, overflow", "own, overflow"))):
        want = x.long() * scale + 1 - torch.arange(16)
        want = ((want + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # int32's wrap
        for name in names:
            torch.testing.assert_close(results[name][0], want, rtol=0, atol=0, msg=name)
    assert results["skipping"][1] == results["skipping, overflow"][1] == 0, results
    assert results["own"][1] >= 3 and results["own, overflow"][1] >= 3, results  # the *, + and - of int32 tiles
    monkeypatch.setattr(semantic, "binary_op_sanitize_overflow_impl", skipping)
    monkeypatch.setattr(interpreter.interpreter_builder, "options", dataclasses.replace(interpreter.interpreter_builder.options, debug=True))
    out = torch.empty_like(x)
    _int_ops_kernel[(1,)](x, out, N=16, SCALE=3)  # no overflow: no assert fails
    torch.testing.assert_close(out, results["skipping"][0], rtol=0, atol=0)
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _int_ops_kernel[(1,)](x, torch.empty_like(x), N=16, SCALE=1 << 20)


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's dtype table: CPU runs only (TRITON_INTERPRET=1)")
def test_the_interpreter_s_dtype_table_gives_its_own_dtypes(monkeypatch):
    """cache_interpreter_dtypes (installed on import): the numpy dtype of every Triton dtype, of
    a block of it and of pointers to it is the interpreter's own, kept in a table of element
    types (pointer types, unhashable, asked of the interpreter each time); a kernel gives the
    same values either way."""
    from triton.runtime import interpreter

    assert backend.cache_interpreter_dtypes() and interpreter._get_np_dtype._fmoe
    cached = interpreter._get_np_dtype
    own = cached.__wrapped__
    monkeypatch.setattr(cached, "table", {})
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16, tl.bfloat16,
               tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    kinds = [*scalars, *(tl.block_type(t, [4, 2]) for t in scalars), *(tl.pointer_type(t) for t in scalars),
             tl.block_type(tl.pointer_type(tl.float32), [8])]
    for _ in range(2):
        for kind in kinds:
            assert cached(kind) == own(kind), kind
    assert cached.table.keys() == set(scalars), cached.table
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    results = []
    for fn in (cached, own):
        monkeypatch.setattr(interpreter, "_get_np_dtype", fn)
        out = torch.empty(8)
        _helper_loop_kernel[(1,)](x, out, N=8, STEPS=3, FAIL=False)
        results.append(out)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@triton.jit
def _to_bfloat16_kernel(x_ptr, cast_ptr, stored_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(cast_ptr + i, x.to(tl.bfloat16))
    tl.store(stored_ptr + i, x)  # a float32 stored to a bfloat16 pointer: cast by the store


def _bfloat16_cases(device):
    """Random magnitudes over float32's range, ties (1 + 2**-8 rounds to even: 1; 1 + 3 * 2**-8
    to 1 + 2**-6), a sum torch rounds up, specials and subnormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 10.0 ** torch.randint(-40, 38, (1000,), generator=g).float()
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1.005859375, float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0,
                            1e-40, -3e-39, 2.0**-133])
    return torch.cat([x, special, torch.zeros(1024 - 1000 - special.numel())]).to(device)


def _bfloat16_bits(t):
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int16)  # one NaN's bits


def test_kernels_round_float32_to_bfloat16_to_nearest_even(device, monkeypatch):
    """A kernel's cast of float32 to bfloat16, explicit or by a store, rounds to the nearest even
    as torch's conversion does, bit for bit, on a GPU and (round_interpreter_bfloat16,
    installed on import) under the interpreter, whose own cast cuts the mantissa."""
    x = _bfloat16_cases(device)
    want = _bfloat16_bits(x.to(torch.bfloat16))
    assert x.to(torch.bfloat16)[1000:1003].tolist() == [1.0, 1.015625, 1.0078125]
    cast, stored = (torch.empty(1024, dtype=torch.bfloat16, device=device) for _ in range(2))
    _to_bfloat16_kernel[(1,)](x, cast, stored, N=1024)
    assert torch.equal(_bfloat16_bits(cast), want) and torch.equal(_bfloat16_bits(stored), want)
    if backend.interpreting():  # the interpreter's own cast truncates: the test above is not vacuous
        from triton.runtime import interpreter

        assert backend.round_interpreter_bfloat16() and interpreter.InterpreterBuilder.cast_impl._fmoe
        monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", interpreter.InterpreterBuilder.cast_impl.__wrapped__)
        _to_bfloat16_kernel[(1,)](x, cast, stored, N=1024)
        assert cast[1000:1003].tolist() == [1.0, 1.0078125, 1.0]  # cut: 1 + 3 * 2**-8 and 1.00586 one step down
        assert (_bfloat16_bits(cast) != want).sum() > 400


def test_next_pow2_is_the_smallest_power_of_two_at_least_n():
    assert [backend.next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 1000, 1024)] == [1, 1, 2, 4, 4, 8, 8, 16, 1024, 1024]


def test_interpreter_problem_fills_in_the_missing_version_alone():
    """One version given, the other the installed one's (not None into the version parser)."""
    import numpy

    assert interpreter_problem("3.7.1") is None
    assert interpreter_problem(numpy_version=numpy.__version__) == interpreter_problem()
    problem = interpreter_problem("3.6.0", None)
    assert (problem is not None) == (backend._version(numpy.__version__) >= (2, 4))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    """impl='triton' on CPU tensors without TRITON_INTERPRET=1: a ValueError saying what to set."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"impl='triton' needs CUDA tensors \(or TRITON_INTERPRET=1"):
        use_triton("triton", torch.zeros(2))


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's patches: CPU runs only (TRITON_INTERPRET=1)")
def test_interpreter_patches_are_installed_once():
    """Each patch applied again (a second import path, a test calling it) leaves the interpreter's
    own function one wrap below: never a patch wrapping a patch."""
    from triton.runtime import interpreter
    from triton.runtime.interpreter import ScanOps

    for _ in range(2):
        assert backend.vectorize_interpreter_scans() and backend.share_interpreter_patches()
        assert backend.skip_unasserted_overflow_checks() and backend.cache_interpreter_dtypes() and backend.round_interpreter_bfloat16()
    for fn in (ScanOps.generic_scan, interpreter._patch_lang, interpreter.interpreter_semantic.binary_op_sanitize_overflow_impl,
               interpreter._get_np_dtype, interpreter.InterpreterBuilder.cast_impl):
        assert fn._fmoe and not getattr(fn.__wrapped__, "_fmoe", False), fn


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's bfloat16 cast: CPU runs only (TRITON_INTERPRET=1)")
def test_interpreted_bfloat16_cast_keeps_a_nan_whose_payload_is_in_the_low_bits():
    """float32 NaNs whose payload lies in the 16 bits a bfloat16 drops (0x7F800001: a
    signalling NaN) stay NaN (quieted), as torch's conversion keeps them, never inf."""
    bits = torch.tensor([0x7F800001, 0x7F80FFFF, -0x007FFFFF, 0x7FC00000] * 4, dtype=torch.int32)  # the third: 0xFF800001
    x = bits.view(torch.float32)
    cast, stored = (torch.empty(16, dtype=torch.bfloat16) for _ in range(2))
    _to_bfloat16_kernel[(1,)](x, cast, stored, N=16)
    assert x.to(torch.bfloat16).isnan().all()
    assert cast.isnan().all() and stored.isnan().all(), (cast, stored)


# GPU-only: these three cannot be run on a CPU machine (need CUDA tensors); NOT VERIFIED (no device in this session).
@pytest.mark.gpu
def test_dispatch_rule_on_cuda(monkeypatch):
    """CUDA tensors: 'auto' is Triton, except beside a CPU tensor (every tensor must be on CUDA)
    and under forward-mode AD (the reference, which it differentiates); 'triton' on CUDA is not
    refused for the interpreter's problem (the interpreter does not run there)."""
    from torch.autograd import forward_ad

    x, cpu = torch.zeros(2, device="cuda"), torch.zeros(2)
    assert use_triton("auto", x) is True and use_triton("auto", x, None) is True
    assert use_triton("auto", x, cpu) is False and use_triton("auto", cpu, x) is False
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        assert use_triton("auto", dual) is False
    monkeypatch.setattr(backend, "INTERPRETER_PROBLEM", "impl='triton' on CPU: the interpreter of Triton 3.6.0 cannot ...")
    assert use_triton("triton", x) is True


@pytest.mark.skipif(not backend.interpreting(), reason="the interpreter's patches: CPU runs only (TRITON_INTERPRET=1)")
def test_a_helper_called_outside_a_launch_after_one_is_patched():
    """share_interpreter_patches: once a launch is done (or failed), a @triton.jit helper called
    from Python outside any launch patches triton.language for itself as the interpreter does
    (the finished launch's patches are not taken as still in place)."""
    import math

    import numpy as np

    _helper_loop_kernel[(1,)](torch.randn(8), torch.empty(8), N=8, STEPS=1, FAIL=False)
    got = backend.tanh(0.5)
    got = np.asarray(got.handle.data if hasattr(got, "handle") else got).reshape(-1)[0]
    assert abs(float(got) - math.tanh(0.5)) < 1e-6
