"""Kernels at sizes whose offsets pass 2**31, on CPU.

The Triton interpreter computes a kernel's int32 arithmetic in numpy int32, so an offset that
wraps on a GPU wraps here too. The tensors are torch.empty of gigabytes (pages never touched
cost no memory); under the `last_program` fixture each launch runs only its last program (the
largest offsets: where a wrap shows first), the storages are not copied back (the interpreter's
copy would touch every page), and every load and store is checked to land inside one of the
launch's own tensors: an access outside them is masked off and recorded. The values the last
program computes are compared with a run whose offsets are small.
"""

import inspect

import numpy as np
import pytest
import torch

from tests.conftest import INTERPRETING

from fmoe.ops import apply_rope, rope_cos_sin, rope_inv_freq, selective_scan

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="runs the Triton interpreter's programs one at a time (CPU)")


@pytest.fixture
def last_program(monkeypatch):
    """Each launch runs its last program only, without copying the storages back; returns the
    list of (kernel, "load" | "store", accesses) outside the launch's tensors."""
    from triton.runtime import interpreter as interp

    if not all(hasattr(interp, name) for name in ("GridExecutor", "InterpreterBuilder", "interpreter_builder", "_patch_lang", "_implicit_cvt")):
        pytest.skip(f"this Triton's interpreter ({interp.__file__}) lacks the pieces the fixture replaces (written for Triton 3.7)")
    outside, launch = [], {}

    def call(self, *args_dev, **kwargs):  # GridExecutor.__call__ with one program and no copy back
        kwargs = {k: v for k, v in kwargs.items() if k in inspect.getfullargspec(self.fn).args}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)  # CPU tensors: their own storages
        for hook in self.pre_run_hooks:
            hook(*args_hst, **kwargs_hst)
        scope = interp._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            launch.update(kernel=self.fn.__name__, regions=[(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                                                            for t in args.values() if isinstance(t, torch.Tensor)])
            args = {name: arg if name in self.constexprs else interp._implicit_cvt(arg) for name, arg in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            interp.interpreter_builder.set_grid_dim(*grid)
            interp.interpreter_builder.set_grid_idx(*(n - 1 for n in grid))
            self.fn(**args)
        finally:
            scope.restore()

    def inside(kind, ptrs, mask):
        live = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)
        ok = np.zeros(ptrs.data.shape, dtype=bool)
        for start, end in launch["regions"]:
            ok |= (ptrs.data >= start) & (ptrs.data < end)
        if (live & ~ok).any():
            outside.append((launch["kernel"], kind, int((live & ~ok).sum())))
        return interp.TensorHandle(live & ok, interp.tl.int1)

    load, store = interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store
    monkeypatch.setattr(interp.GridExecutor, "__call__", call)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load",
                        lambda self, ptrs, mask, *rest: load(self, ptrs, inside("load", ptrs, mask), *rest))
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store",
                        lambda self, ptrs, value, mask, *rest: store(self, ptrs, value, inside("store", ptrs, mask), *rest))
    return outside


def test_selective_scan_rows_past_int32(last_program):
    """66 rows of 4096 tokens at Jamba's 8192 channels: u, dt, y hold B T C = 2.2e9 entries,
    and row 65's offsets pass 2**31 (8.9 GB each, untouched but for the last row). The last
    program (row 65, the last channels) computes what it computes on that row alone. The row
    index was int32: it read row 65 from the other tensors and wrote y outside every tensor."""
    B, T, C, N = 66, 4096, 8192, 16
    u, dt = torch.empty(B, T, C), torch.empty(B, T, C)
    g = torch.Generator().manual_seed(0)
    u[-1] = torch.randn(T, C, generator=g)
    dt[-1] = 0.05 + 0.5 * torch.rand(T, C, generator=g)
    A, b, c = -0.5 - 3 * torch.rand(C, N, generator=g), torch.randn(B, T, N, generator=g), torch.randn(B, T, N, generator=g)
    y = selective_scan(u, dt, A, b, c, impl="triton")[-1, :, -8:]
    assert last_program == []
    alone = selective_scan(u[-1:].clone(), dt[-1:].clone(), A, b[-1:], c[-1:], impl="triton")[0, :, -8:]  # the same channels' program
    assert torch.equal(y, alone) and alone.abs().sum() > 0


def test_rope_of_a_head_major_view_past_int32(last_program):
    """A head-major view [T, H, D] of a [H, T, D] buffer (an HF-style q transposed, B = 1), 128k
    tokens x 128 heads of 192 (6.4 GB): head h starts h T D entries in, past 2**31 from head 86
    on. The last program (the last tokens, the last heads) rotates them as the torch path
    does. Its heads x stride was int32: it read those heads from the output buffer."""
    T, H, D = 131072, 128, 192
    x = torch.empty(H, T, D, dtype=torch.bfloat16).transpose(0, 1)
    x[-16:] = torch.randn(16, H, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(T), rope_inv_freq(D))
    out = apply_rope(x, cos, sin, impl="triton")
    assert last_program == []
    want = apply_rope(x[-1:].contiguous(), cos[-1:], sin[-1:], impl="torch")[0, -8:]  # the last token's last heads
    torch.testing.assert_close(out[-1, -8:], want, rtol=1e-2, atol=1e-2)
    assert want.abs().sum() > 0
