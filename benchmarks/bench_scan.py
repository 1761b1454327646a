"""Selective scan benchmark: fmoe.ops.selective_scan (Mamba-1's scan) by its Triton kernels
against the same op in its chunked torch form (gated_linear_attention with a head per channel).

    .venv/bin/python benchmarks/bench_scan.py            # CUDA, bf16 inputs, real shapes
    .venv/bin/python benchmarks/bench_scan.py --smoke    # CPU + Triton interpreter, tiny shapes
    .venv/bin/python benchmarks/bench_scan.py --impls fused,eager   # only the implementations named

Cases (one packed row of T tokens in documents of DOC tokens, C channels, a state of N = 16;
--smoke: T = 40, C = 40, float32):
    jamba-mini   T = 4096, DOC = 1024, C = 8192 (Jamba Mini's and Falcon-Mamba-7B's mixer: hidden 4096, expand 2)
    mamba-2.8b   T = 2048, DOC = 2048, C = 5120 (mamba-2.8b's: hidden 2560, expand 2)
Implementations:
    fused     impl="triton": one program per block of 32 channels walks the tokens with its
              states in registers (a checkpoint every 16 tokens); the backward recomputes each
              checkpoint's chunk
    eager     impl="torch": the chunked form, chunks of 16 (for every channel, the pairs of a
              chunk's tokens, T C 16 numbers, and each token's decays per state channel, T C N)
    loop      selective_scan_loop: token after token in torch, the form of transformers' Mamba
              and Jamba without the mamba_ssm package

The loop takes seconds per call at these shapes (thousands of tokens, a few torch ops each):
bench() times such a call 5 times (the median), after an untimed one and the host-timed estimate.

Passes: fwd, and fwd+bwd (the gradients of u, dt, A, b and c for a fixed upstream gradient).
Before timing, each case checks fused against eager (output and gradients).

Table: median ms; on the fused rows the speedups over eager and the loop (where timed); on every row the fraction of the
bytes floor (scan_bytes: the scan's own inputs and outputs, each read or written once, at the
element sizes of the tensors the run uses, at the copy bandwidth measured in the same run: fwd
reads u, dt, A, b, c and writes y; fwd+bwd adds the backward's reads of u, dt, A, b, c and dy
and writes of du, ddt, dA, db, dc. On CUDA u, dt, b, c and their gradients are bf16, A, y and
dy float32: 8 T C + small bytes fwd, 20 T C + small fwd+bwd; --smoke, all float32: 12 T C and
32 T C + small) and the peak memory the pass allocated (CUDA only). The CSV goes to
OUT/bench_scan.csv.
"""

from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    case_done,
    check_agree,
    cuda_peak_bytes,
    finish,
    floor_fraction,
    select,
    start,
    timing_row,
)

import sys  # noqa: E402

import torch  # noqa: E402
from fmoe.ops import selective_scan  # noqa: E402
from fmoe.ops.scan import selective_scan_loop  # noqa: E402

IMPLS = ["fused", "eager", "loop"]
COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_eager", "speedup_vs_loop", "floor_fraction", "peak_GB"]
CHUNK = 16
N = 16


@dataclass
class Case:
    name: str
    T: int
    doc: int
    C: int


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("jamba-mini", 40, 16, 40), Case("mamba-2.8b", 40, 40, 24)]
    return [Case("jamba-mini", 4096, 1024, 8192), Case("mamba-2.8b", 2048, 2048, 5120)]


def scan_inputs(T: int, C: int, device, dtype) -> list[torch.Tensor]:
    """u, dt in [0.001, 0.1] (Mamba's initial range), A = -(1 .. N) (its S4D-real start), b, c,
    seeded."""
    g = torch.Generator(device=device).manual_seed(0)
    u = torch.randn(1, T, C, device=device, generator=g)
    dt = torch.exp(torch.empty(1, T, C, device=device).uniform_(-6.9, -2.3, generator=g))
    A = -torch.arange(1, N + 1, device=device, dtype=torch.float32).expand(C, N).contiguous()
    b, c = (torch.randn(1, T, N, device=device, generator=g) for _ in range(2))
    return [u.to(dtype), dt.to(dtype), A, b.to(dtype), c.to(dtype)]


def scan_bytes(inputs, y: torch.Tensor, grad_y: torch.Tensor, grads) -> tuple[int, int]:
    """(fwd, fwd+bwd) bytes floor from the tensors a run uses (their element sizes): the forward
    reads every input (u, dt, A, b, c) and writes y; the backward reads the inputs again and
    dy, and writes every input's gradient."""
    fwd = sum(t.nbytes for t in inputs) + y.nbytes
    bwd = sum(t.nbytes for t in inputs) + grad_y.nbytes + sum(t.nbytes for t in grads)
    return fwd, fwd + bwd


def run_case(case: Case, device: torch.device, dtype: torch.dtype, bandwidth: float, names: list[str]) -> list[dict]:
    T, C = case.T, case.C
    inputs = [t.requires_grad_() for t in scan_inputs(T, C, device, dtype)]
    cu = torch.arange(0, T + 1, case.doc, device=device)
    if cu[-1] != T:
        cu = torch.cat([cu, torch.tensor([T], device=device)])
    grad_y = torch.randn(1, T, C, device=device)
    # check=False: no host read of cu in the timing (the model's layers pass it too)
    impls = {name: (lambda *xs, impl=impl: selective_scan(*xs, cu, chunk_size=CHUNK, impl=impl, check=False)) for name, impl in (("fused", "triton"),
                                                                                                                  ("eager", "torch"))}
    outs = {}
    for name in impls:  # the loop's agreement is tests/ops/test_scan.py's
        y = impls[name](*inputs)
        outs[name] = (y.detach(), *torch.autograd.grad(y, inputs, grad_y))
    check_agree(case.name, outs, ("fused", "eager"), dtype)
    fwd_bytes, fwd_bwd_bytes = scan_bytes(inputs, outs["fused"][0], grad_y, outs["fused"][1:])
    del outs
    impls["loop"] = lambda *xs: selective_scan_loop(*xs, cu, check=False)
    impls = {name: impls[name] for name in names}

    def fwd(name):
        with torch.no_grad():
            return impls[name](*inputs)

    def fwd_bwd(name):
        return torch.autograd.grad(impls[name](*inputs), inputs, grad_y)

    rows = []
    for pass_name, step, nbytes in (("fwd", fwd, fwd_bytes), ("fwd+bwd", fwd_bwd, fwd_bwd_bytes)):
        ms = {name: bench(lambda name=name: step(name), device, label=f"{case.name}-{pass_name}-{name}") for name in impls}
        for name in impls:
            peak = cuda_peak_bytes(lambda name=name: step(name), device)
            rows.append({**timing_row(case.name, pass_name, ms, name), "speedup_vs_loop": ms["loop"] / ms[name] if name == "fused" and "loop" in ms else None,
                         "floor_fraction": floor_fraction(nbytes, bandwidth, ms[name]),
                         "peak_GB": None if peak is None else peak / 1e9, "T": T, "doc": case.doc, "C": C, "N": N,
                         "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes})
    case_done(rows, COLUMNS)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__, lambda parser: parser.add_argument(
        "--impls", default=None, help=f"comma-separated implementations to time among {IMPLS} (default all; each case checks fused against eager)"))
    try:
        names = select(IMPLS, args.impls, "--impls")
    except ValueError as err:
        sys.exit(str(err))
    rows = []
    for case in make_cases(args.smoke):
        rows += run_case(case, device, dtype, bandwidth, names)
    finish(args, device, bandwidth, "bench_scan", [(rows, COLUMNS)])


if __name__ == "__main__":
    main()
