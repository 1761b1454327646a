"""The Triton/torch dispatch rule of every op, and small tensor helpers.

    use_triton(impl, *tensors)   "auto" | "triton" | "torch": which implementation runs
    transform_of(*tensors)       the torch.func transform or forward-mode AD the tensors are under, or None
    interpreting()               Triton kernels run through the CPU interpreter
    interpreter_problem()        why the installed Triton interpreter cannot run the kernels, or None
    vectorize_interpreter_scans()   the interpreter's tl.associative_scan one step per position along its axis
    share_interpreter_patches()     the interpreter's helper calls inside a kernel reuse the kernel's patched triton.language
    skip_unasserted_overflow_checks()   the interpreter's integer overflow checks computed only where it asserts them
    cache_interpreter_dtypes()      the interpreter's numpy dtype of each Triton dtype looked up, not rebuilt at every op
    round_interpreter_bfloat16()    the interpreter's casts to bfloat16 rounded to nearest even, as the GPU's (not cut)
    next_pow2(n)                 Triton block sizes
    local_tensor(t)              the local shard of a DTensor (the tensor itself otherwise)
    tanh(x)                      tanh inside a Triton kernel, from one exp (the interpreter has no tanh)
    ieee_dot(a, b)               a @ b inside a Triton kernel, float32 (16-bit tiles right under the interpreter too)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import torch
import triton
import triton.language as tl
from torch.autograd import forward_ad

IMPLS = ("auto", "triton", "torch")


@triton.jit
def tanh(x):
    """tanh(x) in a Triton kernel, float32: (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign, from
    one exp that never overflows (the interpreter has no tanh; -inf gives -1)."""
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


def autocast_off(fn):
    """fn run with torch.autocast off (where it is on, on the CPU or CUDA): an op's torch path
    upcasts as its definition says (float32 sums, logits in h's dtype, ...), as its
    kernels do, which autocast passes by (custom ops); under autocast its float32 matmuls
    and einsums would run in bf16 on the torch path alone."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        on = [device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]
        if not on:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)
    return run


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton 3.7's interpreter multiplies bfloat16 tiles as their raw uint16 bits. Products of
# 16-bit floats are exact in float32, so under the interpreter the kernels' dots multiply the
# float32 upcasts: the same sums the tensor cores form. Fixed when triton is first imported,
# as TRITON_INTERPRET itself is.
DOT_UPCAST = tl.constexpr(interpreting())


@triton.jit
def ieee_dot(a, b):
    """a @ b in float32 in a Triton kernel, float32 operands in IEEE float32 (not TF32); 16-bit
    operands as the tensor cores multiply them, under the interpreter too (DOT_UPCAST)."""
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


def transform_of(*tensors) -> str | None:
    """What the tensors are under that the kernels' custom ops cannot differentiate, or None:
    forward-mode AD (a tensor with a tangent: torch.func.jvp, jacfwd, forward_ad's dual
    tensors), where a custom op with a backward alone gives zero tangents without a word, or
    another torch.func transform (a functorch-wrapped tensor: grad, vjp, jacrev, vmap), where
    it raises torch's "must override the setup_context staticmethod". Not a tensor (None, an
    int) is passed over; None while torch.compile traces (its graphs hold no such tensors)."""
    if torch.compiler.is_compiling():
        return None
    # no dual level entered and no torch.func transform running: nothing to look for (an optimizer's thousands of tensors)
    if getattr(forward_ad, "_current_level", 0) < 0 and torch._C._functorch.peek_interpreter_stack() is None:
        return None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if forward_ad.unpack_dual(t).tangent is not None:
            return "forward-mode AD (torch.func.jvp, jacfwd, forward_ad's dual tensors)"
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return "a torch.func transform (grad, vjp, jacrev, vmap)"
    return None


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """The dispatch rule of every op.

    "auto": Triton for CUDA tensors, the torch reference otherwise. "triton": the kernels,
    on CUDA tensors or, under TRITON_INTERPRET=1, on CPU tensors. "torch": the reference.
    Under forward-mode AD or a torch.func transform (transform_of the tensors: pass every
    differentiable input, None for one left out) "auto" is the reference, which they
    differentiate, and "triton" a ValueError: the kernels have a backward alone (forward mode
    would give zero tangents without a word).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    on_cuda = all(t.is_cuda for t in tensors if t is not None)  # None: an optional input left out
    if impl == "torch":
        return False
    if impl == "auto":
        return on_cuda and transform_of(*tensors) is None
    if (transform := transform_of(*tensors)) is not None:
        raise ValueError(f"impl='triton': the kernels have a backward alone, which {transform} cannot use (forward mode would give "
                         "zero tangents); use impl='torch' or 'auto' (the reference there)")
    if not on_cuda and not interpreting():
        raise ValueError(
            "impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported, to run the kernels on CPU through the interpreter)"
        )
    if not on_cuda and INTERPRETER_PROBLEM is not None:
        raise RuntimeError(INTERPRETER_PROBLEM)
    return True


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string ("3.6.0+git1234", "2.4.0rc1" -> (3, 6), (2, 4))."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in text.split(".")[:2])


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why the Triton interpreter cannot run fmoe's kernels here, or None.

    Triton before 3.7 turns a scalar kernel argument into an index by int() of a 1-element
    numpy array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to
    Python scalars"): every kernel that loops over a runtime count fails. Triton 3.7 (the
    CPU pin, with torch 2.13) or numpy before 2.4 run them. The versions default to the
    installed ones."""
    if triton_version is None or numpy_version is None:
        import numpy
        import triton

        triton_version, numpy_version = triton_version or triton.__version__, numpy_version or numpy.__version__
    if _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        return (f"impl='triton' on CPU: the interpreter of Triton {triton_version} cannot run fmoe's kernels with numpy {numpy_version} "
                "(it converts scalar arguments by int() of a 1-element array, which numpy 2.4 refuses); install numpy<2.4, or "
                "Triton 3.7 or newer (pip install torch==2.13.0 triton==3.7.1, the pair make setup pins on CPU), or use impl='torch'")
    return None


def vectorize_interpreter_scans() -> bool:
    """Make the Triton interpreter run tl.associative_scan with a combine function of its own
    (not a sum or product) one step per position along the scan's axis, the combine applied to
    whole slices, instead of one Python call per element (its generic path: about 0.2 s per
    scan of a [16, 8, 16] tile, which made the selective scan's kernels ten times slower on
    CPU than the token walk they replace). The same values: a combine function is elementwise.
    Applied once, on import of fmoe.ops under TRITON_INTERPRET=1; False (nothing changed) where
    the installed Triton's interpreter has no such generic path.
    """
    try:
        from triton.runtime.interpreter import ScanOps
    except ImportError:
        return False
    if not hasattr(ScanOps, "generic_scan"):
        return False
    if getattr(ScanOps.generic_scan, "_fmoe", False):  # already
        return True
    import numpy as np

    def generic_scan(self, input):
        slices = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in input]
        out = [np.empty_like(x) for x in slices]
        acc = None
        for i in range(slices[0].shape[0]):
            cur = tuple(self.to_tensor(x[i].copy(), arg.dtype) for x, arg in zip(slices, input))
            if acc is not None:
                ret = self.combine_fn.fn(*acc, *cur)
                ret = ret if isinstance(ret, tuple) else (ret,)
                cur = tuple(self.to_tensor(_shaped(r.handle.data if isinstance(r, tl.core.tensor) else r, x[i].shape), arg.dtype)
                            for r, x, arg in zip(ret, slices, input))
            for o, c in zip(out, cur):
                o[i] = c.handle.data.reshape(o[i].shape)
            acc = cur
        return [self.to_tensor(np.moveaxis(o, 0, self.axis), arg.dtype) for o, arg in zip(out, input)]

    def _shaped(value, shape):  # a combine's result as one slice (a 0-d slice: the interpreter's scalars are [1])
        value = np.asarray(value)
        return value.reshape(()).copy() if shape == () else np.broadcast_to(value, shape).copy()

    generic_scan._fmoe, generic_scan.__wrapped__ = True, ScanOps.generic_scan  # the interpreter's own, kept
    ScanOps.generic_scan = generic_scan
    return True


def share_interpreter_patches() -> bool:
    """Make a @triton.jit helper called inside a kernel that the Triton interpreter runs reuse
    the kernel's patched triton.language instead of patching it again at each call.

    The interpreter replaces triton.language's builtins with its numpy ones when it launches a
    kernel (and puts them back after), and again at every call of a helper inside it (the
    helper's module: the same triton.language), by inspect.getmembers over the whole module:
    about 2.6 ms a call, which a helper inside a K loop (a GEMM's dot) pays per iteration and
    program; a third of the grouped MLP's time on CPU. Where the helper's language modules are
    among those patched since the launch began, nothing is done; a helper of other modules
    (triton.language.standard's reductions use triton.language.core) is patched the first time
    as before. The same values: the second patch only replaced patched builtins by equal ones.
    Applied once, on import of fmoe.ops under TRITON_INTERPRET=1; False (nothing changed) where
    the installed Triton's interpreter lacks the functions this relies on.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    if getattr(interpreter._patch_lang, "_fmoe", False):  # already
        return True
    import inspect
    import weakref

    original, launch_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = {"langs": None, "by_fn": weakref.WeakKeyDictionary()}  # langs: the language modules patched since the running
    # launch began (None: no launch running); by_fn: each function's language modules

    def languages(fn) -> frozenset:
        langs = state["by_fn"].get(fn)
        if langs is None:  # found once per function, not at every call (the grouped MLP: 0.55 s to 0.52 s)
            langs = state["by_fn"][fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs

    def patch_lang(fn):
        langs = languages(fn)
        if state["langs"] is not None and langs <= state["langs"]:  # a helper inside the running launch: patched already
            return interpreter._LangPatchScope()
        scope = original(fn)
        if state["langs"] is not None:  # the launch's own patch (which it restores when its grid is done), or a helper's of other modules
            state["langs"] |= langs
        return scope

    def run_grid(self, *args, **kwargs):
        state["langs"] = frozenset()
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            state["langs"] = None

    patch_lang._fmoe, patch_lang.__wrapped__ = True, original
    run_grid.__wrapped__ = launch_grid
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, run_grid
    return True


def skip_unasserted_overflow_checks() -> bool:
    """Make the Triton interpreter compute its integer overflow check of a +, - or * only where
    it asserts the result: under its debug option.

    The interpreter's semantic checks every int32 add, sub and mul of a kernel for overflow (its
    sanitize_overflow option): it casts both operands to int64, applies the op again, compares
    the result with the type's bounds and hands that to device_assert, which without the debug
    option (the interpreter's default) returns at once. So the check is computed and dropped:
    six more interpreted ops per integer op; the grouped MLP's forward and backward on CPU took
    0.88 s with them and 0.55 s without (48 rows of 32, 4 experts of 24; runs taken in turn).
    With debug on, the check runs and asserts as before. The same values either way: the check
    writes nothing. Applied once, on import of fmoe.ops under TRITON_INTERPRET=1; False (nothing
    changed) where the installed Triton's interpreter lacks what this relies on.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None or not hasattr(semantic, "binary_op_sanitize_overflow_impl") or not hasattr(semantic, "builder"):
        return False
    check = semantic.binary_op_sanitize_overflow_impl
    if getattr(check, "_fmoe", False):  # already
        return True

    def sanitize_overflow(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:  # device_assert would drop the check
            return None
        return check(lhs, rhs, binary_op)

    sanitize_overflow._fmoe, sanitize_overflow.__wrapped__ = True, check
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow  # the interpreter's semantic alone, not the compiler's
    return True


def cache_interpreter_dtypes() -> bool:
    """Make the Triton interpreter look up the numpy dtype of a Triton dtype in a table kept
    between calls. Its own function builds a dict of every dtype at each call, and a kernel's
    ops ask it 7706 times in one forward and backward of the grouped MLP (48 rows of 32, 4
    experts of 24): 0.60 s on CPU with the interpreter's function, 0.52 s with the table (runs
    taken in turn). A block type's is its element type's, as there. The same dtypes: the table
    holds what the interpreter's function returned. Applied once, on import of fmoe.ops under
    TRITON_INTERPRET=1; False (nothing changed) where the interpreter has no such function.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return False
    if getattr(original, "_fmoe", False):  # already
        return True

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block type: unhashable, its element's
        if isinstance(key, tl.pointer_type):  # the interpreter's first answer (pointer types are unhashable too)
            return original(key)
        try:
            return np_dtype.table[key]
        except KeyError:
            np_dtype.table[key] = value = original(key)
            return value
        except TypeError:  # an unhashable type of another kind: the interpreter's own way
            return original(tt_dtype)

    np_dtype._fmoe, np_dtype.__wrapped__, np_dtype.table = True, original, {}  # table: element type -> numpy dtype
    interpreter._get_np_dtype = np_dtype
    return True


def round_interpreter_bfloat16() -> bool:
    """Make the Triton interpreter round a cast of float32 to bfloat16 to the nearest even, as a GPU does (Triton's default rounding of a narrowing cast, and of a store
    to a bfloat16 pointer), instead of cutting the mantissa: Triton 3.7's interpreter truncates,
    so about half of every bfloat16 result of a kernel came out one step nearer zero than the
    torch reference's on CPU (swiglu's 1.1 x silu(-0.7)-like products, a bfloat16 sum of
    1 + 3 * 2**-9: 1.0 where torch gives 1.0078125). The values are torch's conversion's, bit
    for bit (NaN, inf and subnormals included), computed on the bits in numpy (no tensor, so
    no host read is counted). Casts with an explicit rounding mode (rtz) are left to the
    interpreter. Applied once, on import of fmoe.ops under TRITON_INTERPRET=1; False (nothing
    changed) where the interpreter has no such cast.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or handle is None:
        return False
    if getattr(original, "_fmoe", False):  # already
        return True
    import numpy as np

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            f32 = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = f32.view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even; past the top: inf
            quiet = (bits >> 16) | 0x40  # a NaN stays one (quiet), its sign kept
            return handle(np.where(np.isnan(f32), quiet, rounded).astype(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._fmoe, cast_impl.__wrapped__ = True, original
    builder.cast_impl = cast_impl  # its create_fp_trunc calls self.cast_impl
    return True


def local_tensor(t):
    """The local shard of a DTensor (differentiable: DTensor.to_local), the tensor itself
    otherwise (None stays None). Layers and optimizers compute on plain local tensors of
    the DTensors that fmoe.parallel sets up."""
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

    return t.to_local() if isinstance(t, DTensor) else t


# the installed versions' problem, found once (a constant to torch.compile, which traces use_triton)
INTERPRETER_PROBLEM = interpreter_problem()
if interpreting():
    vectorize_interpreter_scans()
    share_interpreter_patches()
    skip_unasserted_overflow_checks()
    cache_interpreter_dtypes()
    round_interpreter_bfloat16()
