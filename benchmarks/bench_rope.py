"""RoPE benchmark: fmoe.ops.apply_rope's Triton kernel against the torch reference.

    .venv/bin/python benchmarks/bench_rope.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_rope.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (T tokens, H heads, D head_dim, all channels rotated, one packed batch whose
positions restart at 0 every 4096 tokens), T = 16384 and D = 128 (--smoke: T = 48, D = 32,
float32):
    q              the queries: H = 32, rotate-half
    k              the keys of grouped-query attention: H = 8, rotate-half
    q interleaved  H = 32, pairs (2i, 2i+1)

Implementations:
    fused     apply_rope(impl="triton"): the Triton kernel (its backward: the same kernel
              rotating by minus the angles)
    eager     apply_rope(impl="torch"): the plain-torch reference
    compiled  torch.compile(dynamic=False) of the reference, warmed up before timing

Passes: fwd (x requires grad), bwd (the gradient of x for a fixed upstream gradient, on a
forward graph built once and retained) and fwd+bwd. Before timing, each case checks the
fused kernel against the reference (output and gradient).

Table: median ms per implementation; on the fused rows the speedups (baseline ms / fused
ms); on every row the fraction of the bandwidth floor, (bytes / copy bandwidth) / ms, with
the copy bandwidth measured in the same run, then device_ms, the device's own time per call
with the host queued ahead (_common.device_ms; ms is the host's where launching a call takes
longer than its kernels), and device_floor_fraction, the same fraction over device_ms (both
empty on CPU). Bytes per pass: read x (or the upstream gradient) and write the result, T*H*D
elements each, plus cos and sin once, T*D/2 float32 each. The CSV goes to OUT/bench_rope.csv.
"""

import sys
from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    device_columns,
    floor_fraction,
    run_cases,
    timing_row,
)

import torch  # noqa: E402
from fmoe.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_eager", "speedup_vs_compiled", "floor_fraction",
           "device_ms", "device_floor_fraction"]
DOC_LEN = 4096  # packed documents: positions restart every DOC_LEN tokens


@dataclass
class Case:
    name: str
    T: int
    H: int
    D: int
    interleaved: bool


def make_cases(smoke: bool) -> list[Case]:
    T, D, Hq, Hk = (48, 32, 4, 2) if smoke else (16384, 128, 32, 8)
    return [Case("q", T, Hq, D, False), Case("k", T, Hk, D, False), Case("q interleaved", T, Hq, D, True)]


def check(case: Case, fused, eager, x: torch.Tensor, grad_y: torch.Tensor) -> None:
    """Exits when the fused kernel and the reference disagree (output or gradient)."""
    y_f, y_r = fused(x), eager(x)
    (gx_f,) = torch.autograd.grad(y_f, x, grad_y)
    (gx_r,) = torch.autograd.grad(y_r, x, grad_y)
    tol = dict(rtol=1e-5, atol=1e-6) if x.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    try:
        torch.testing.assert_close(y_f, y_r, **tol)
        torch.testing.assert_close(gx_f, gx_r, **tol)
    except AssertionError as err:
        sys.exit(f"{case.name}: fused and eager disagree:\n{err}")


def run_case(case: Case, device: torch.device, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    T, H, D = case.T, case.H, case.D
    torch._dynamo.reset()  # one compile per case, never near dynamo's recompile limit
    positions = torch.arange(T, device=device) % DOC_LEN
    cos, sin = rope_cos_sin(positions, rope_inv_freq(D, device=device))
    x = torch.randn(T, H, D, device=device, dtype=dtype, requires_grad=True)
    grad_y = torch.randn(T, H, D, device=device, dtype=dtype)

    def rope(impl):
        return lambda t: apply_rope(t, cos, sin, interleaved=case.interleaved, impl=impl)

    impls = {"fused": rope("triton"), "eager": rope("torch"), "compiled": torch.compile(rope("torch"), dynamic=False)}
    check(case, impls["fused"], impls["eager"], x, grad_y)
    print(f"{case.name}: checked; timing", flush=True)

    graphs = {name: fn(x) for name, fn in impls.items()}  # forward graphs for the bwd pass

    def fwd(name):
        return impls[name](x)

    def bwd(name):
        return torch.autograd.grad(graphs[name], x, grad_y, retain_graph=True)

    def fwd_bwd(name):
        return torch.autograd.grad(impls[name](x), x, grad_y)

    fwd_bwd("compiled")  # compiles the forward and backward graphs

    pass_bytes = 2 * T * H * D * x.element_size() + 2 * T * (D // 2) * cos.element_size()
    rows = []
    for pass_name, step, nbytes in (("fwd", fwd, pass_bytes), ("bwd", bwd, pass_bytes), ("fwd+bwd", fwd_bwd, 2 * pass_bytes)):
        ms = {name: bench(lambda name=name: step(name), device, label=f"{case.name}-{pass_name}-{name}") for name in impls}
        for name in impls:
            rows.append({
                **timing_row(case.name, pass_name, ms, name),
                "floor_fraction": floor_fraction(nbytes, bandwidth, ms[name]),
                **device_columns(lambda name=name: step(name), device, bandwidth, nbytes),
                "T": T, "H": H, "D": D, "interleaved": case.interleaved, "dtype": str(dtype).removeprefix("torch."),
                "bytes": nbytes, "floor_ms": nbytes / bandwidth * 1e3,
            })
    return rows


def main() -> None:
    run_cases(__doc__, "bench_rope", make_cases, run_case, COLUMNS)


if __name__ == "__main__":
    main()
