"""Gated delta rule benchmark: fmoe.ops.gated_delta_rule (and gated_linear_attention, the rule
without its delta) with the states' Triton kernels against the same op with the states in
torch, eager and compiled.

    .venv/bin/python benchmarks/bench_delta.py            # CUDA, bf16 inputs, real shapes
    .venv/bin/python benchmarks/bench_delta.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (one packed row of T tokens in documents of DOC tokens, N value heads with q and k
already repeated to them, Dk = Dv = D, chunks of 64; --smoke: T = 96, N = 2, D = 16, float32):
    qwen3-next   T = 16384, DOC = 4096, N = 32, D = 128 (Qwen3-Next-80B's linear layers)
    long doc     T = 16384, DOC = 16384, N = 16, D = 128 (one long document)
    kimi-linear  T = 16384, DOC = 4096, N = 32, D = 128, a decay per key channel (g [1, T, N, D]:
                 Kimi Linear's Kimi Delta Attention; its in-chunk pairs in halves of blocks)
    lightning    T = 16384, DOC = 4096, N = 64, D = 128, gated_linear_attention (MiniMax-Text-01's
                 lightning layers: no delta rule, so no solves; a decay per head)
Implementations:
    fused     impl="triton": the chunks' terms in torch, the states chunk after chunk in one
              Triton kernel (and its backward in another)
    eager     impl="torch": the states chunk after chunk in torch (a few small batched
              matmuls per chunk)
    compiled  torch.compile(dynamic=False) of impl="torch", warmed up before timing; it unrolls
              the loop over the T / 64 chunks, so at T = 16384 its compile outlasted 100 s
              on an H100 machine: timed only with --compiled (with --smoke, the first case's), after
              each case has printed fused and eager

Passes: fwd, and fwd+bwd (the gradients of q, k, v, g and beta for a fixed upstream
gradient). Before timing, each case checks fused against eager (output and gradients).

Table: median ms; on the fused rows the speedups (baseline ms / fused ms); on every row the
fraction of the float32 matmul floor: the chunked algorithm's matmul FLOPs over the float32
matmul rate measured in the same run, divided by the time. FLOPs per token and head (C = 64):
4 C Dk (q k^T and k k^T in the chunk) + C (Dk + Dv) (the two triangular solves) + 8 Dk Dv (the
states' two products, then u and the outputs' read of the state) + 2 C Dv (the outputs from
u), x 3 for fwd+bwd; without the rule (lightning) 4 C D + 4 D D (q k^T, the outputs from v,
the read of the state and its update); the same count for the per-channel case (its halves-of-blocks pair sums
do about half the q k^T and k k^T work, plus the decays' elementwise products). The CSV goes
to OUT/bench_delta.csv.
"""

import time
from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    check_agree,
    case_done,
    finish,
    matmul_rate,
    start,
    timing_row,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmoe.ops import gated_delta_rule, gated_linear_attention  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_eager", "speedup_vs_compiled", "flop_fraction"]
CHUNK = 64


@dataclass
class Case:
    name: str
    T: int
    doc: int
    N: int
    D: int
    channels: bool = False  # a decay per key channel
    rule: bool = True  # False: gated_linear_attention (no delta rule, no beta)


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("qwen3-next", 96, 40, 2, 16), Case("long doc", 96, 96, 2, 16), Case("kimi-linear", 96, 40, 2, 16, True),
                Case("lightning", 96, 40, 2, 16, rule=False)]
    return [Case("qwen3-next", 16384, 4096, 32, 128), Case("long doc", 16384, 16384, 16, 128), Case("kimi-linear", 16384, 4096, 32, 128, True),
            Case("lightning", 16384, 4096, 64, 128, rule=False)]


def flops_per_token_head(D: int, C: int = CHUNK, rule: bool = True) -> int:
    if not rule:  # q k^T, the outputs from v, the read of the state and its update
        return 4 * C * D + 4 * D * D
    return 4 * C * D + C * 2 * D + 8 * D * D + 2 * C * D


def rule_inputs(T: int, N: int, D: int, device, dtype, channels: bool = False) -> list[torch.Tensor]:
    """q, k (unit rows), v [1, T, N, D], g = -softplus(...) [1, T, N] (channels: [1, T, N, D])
    and beta in [0, 1] [1, T, N], seeded."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, N, D, device=device, generator=g)
    k = F.normalize(torch.randn(1, T, N, D, device=device, generator=g), dim=-1)
    v = torch.randn(1, T, N, D, device=device, generator=g)
    gate = -F.softplus(torch.randn(1, T, N, *((D,) if channels else ()), device=device, generator=g))
    beta = torch.rand(1, T, N, device=device, generator=g)
    return [t.to(dtype) for t in (q, k, v, gate, beta)]


def run_case(case: Case, device: torch.device, dtype: torch.dtype, rate: float, compiled: bool) -> list[dict]:
    T, N, D = case.T, case.N, case.D
    torch._dynamo.reset()
    inputs = [t.requires_grad_() for t in rule_inputs(T, N, D, device, dtype, case.channels)][:None if case.rule else 4]
    cu = torch.arange(0, T + 1, case.doc, device=device)
    if cu[-1] != T:
        cu = torch.cat([cu, torch.tensor([T], device=device)])
    grad_o = torch.randn(1, T, N, D, device=device, dtype=dtype)

    def rule(impl):
        op = gated_delta_rule if case.rule else gated_linear_attention
        return lambda *xs: op(*xs, cu, chunk_size=CHUNK, impl=impl, check=False)  # no host read of cu in the timing

    impls = {"fused": rule("triton"), "eager": rule("torch"), "compiled": torch.compile(rule("torch"), dynamic=False)}
    outs = {}
    for name in ("fused", "eager"):
        o = impls[name](*inputs)
        outs[name] = (o.detach(), *torch.autograd.grad(o, inputs, grad_o))
    check_agree(case.name, outs, ("fused", "eager"), dtype)

    def fwd(name):
        with torch.no_grad():
            return impls[name](*inputs)

    def fwd_bwd(name):
        return torch.autograd.grad(impls[name](*inputs), inputs, grad_o)

    flops = T * N * flops_per_token_head(D, rule=case.rule)
    passes = (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3 * flops))

    def timed(names, ms):
        for pass_name, step, _ in passes:
            ms[pass_name].update({name: bench(lambda name=name: step(name), device, label=f"{case.name}-{pass_name}-{name}")
                                  for name in names})

    def table(ms):
        return [{**timing_row(case.name, pass_name, ms[pass_name], name),
                 "flop_fraction": n_flops / rate * 1e3 / ms[pass_name][name],
                 "T": T, "doc": case.doc, "N": N, "D": D, "dtype": str(dtype).removeprefix("torch."), "flops": n_flops}
                for pass_name, _, n_flops in passes for name in ms[pass_name]]

    ms = {pass_name: {} for pass_name, _, _ in passes}
    timed(("fused", "eager"), ms)
    if not compiled:
        rows = table(ms)
        case_done(rows, COLUMNS)
        return rows
    case_done(table(ms), COLUMNS)  # kept if the compile below outlasts a time limit
    # torch.compile unrolls the op's loop over the T / CHUNK chunks: at T = 16384 a long compile
    begin = time.perf_counter()
    fwd_bwd("compiled")  # compiles the forward and backward graphs
    fwd("compiled")
    print(f"{case.name}: torch.compile of impl='torch' ({T // CHUNK} chunk steps) took {time.perf_counter() - begin:.0f} s; timing",
          flush=True)
    timed(("compiled",), ms)
    rows = table(ms)
    case_done(rows, COLUMNS)
    return rows


def main() -> None:
    def add_arguments(parser):
        parser.add_argument("--compiled", action="store_true",
                            help="also time torch.compile of the torch form (its compile takes minutes at the real shapes)")

    args, device, dtype, bandwidth = start(__doc__, add_arguments)
    rate = matmul_rate(device, torch.float32, 256 if args.smoke else 8192)
    print(f"float32 matmul rate: {rate / 1e12:.1f} TFLOP/s (measured now)", flush=True)
    rows = []
    for i, case in enumerate(make_cases(args.smoke)):  # --smoke compiles once: a cold compile of each case took a minute on CPU
        rows += run_case(case, device, dtype, rate, compiled=args.compiled or (args.smoke and i == 0))
    finish(args, device, bandwidth, "bench_delta", [(rows, COLUMNS)], fp32_matmul_TFLOPs=rate / 1e12)


if __name__ == "__main__":
    main()
