"""DeepSeek-V4 attention benchmark: fmoe.layers.attention of V4's three layer kinds on the sparse
kernel (impl "auto" on CUDA) against the dense reference, blocked and whole.

    .venv/bin/python benchmarks/bench_dsv4_attention.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_dsv4_attention.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases: one tensor-parallel rank of DeepSeek-V4-Flash's attention (16 of its 64 heads of 512,
one kv head that is its values, RoPE on the last 64 channels, a q latent of 1024, hidden 4096,
sinks, a window of 128) over one 4096-token document:
    sliding  the window alone
    csa      compressed sparse attention: overlapping runs of 4, each query's best 512 entries
             by an indexer of 64 heads of 128 (its loss on: the training step's)
    hca      heavily compressed attention: runs of 128, every complete run's entry
--smoke: 4 heads of 32 (RoPE on 8), q latent 32, hidden 64, 48 tokens, window 8; CSA runs of 4,
the best 4 by 2 indexer heads of 16; HCA runs of 8; float32.

Implementations:
    kernel     impl "triton" (CUDA's "auto"): each query over its window's keys and its entries
               alone (fmoe.ops.sparse_attention over the rows [keys, entries], the sinks as
               sigmoid(lse - sink))
    reference  impl "torch": the dense reference with sinks over blocks of queries whose scores
               hold about 2^26 floats, each recomputed in the backward
    dense      impl "torch" with the blocks off: the heads' [T, T + S] scores and probabilities
               of every query at once (what the layers ran before the blocks)

Passes: fwd (no gradient) and fwd+bwd (the output's gradient for a fixed upstream one, plus
the CSA indexer's loss). Each case first checks kernel against reference (output and every
gradient) on a shorter document (the first 512 tokens). Table: median ms, the kernel's
speedups over both, CUDA peak memory of the pass, and the floor fraction: the layer's matmul
FLOPs at the bf16 rate measured in the same run over the measured time (forward: 2 per
multiply-add of wq_a, wq_b, wk, wo, the compressors' and the indexer's projections, and 4 N D
per attended key or entry, the mean over the queries; fwd+bwd: 3 x that). An implementation
that runs out of memory gets an empty row.

The CSV goes to OUT/bench_dsv4_attention.csv.
"""

from dataclasses import dataclass, replace
from typing import Optional

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    case_done,
    check_agree,
    run_rate_cases,
    time_and_peak,
)

import torch  # noqa: E402
import fmoe.layers as layers  # noqa: E402
from fmoe.layers import AttentionConfig, attention, attention_context, compress_shapes, gqa_q_shapes, out_shapes  # noqa: E402
from fmoe.ops import positions_from_cu_seqlens  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_reference", "speedup_vs_dense", "peak_GiB", "floor_fraction"]


@dataclass
class Case:
    name: str
    T: int
    H: int
    N: int
    D: int
    rot: int
    q_rank: int
    window: int
    rate: Optional[int] = None  # compressed entries every `rate` tokens
    topk: Optional[int] = None  # CSA: the entries each query chooses
    index_heads: int = 64
    index_dim: int = 128


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        base = Case("sliding", 48, 64, 4, 32, 8, 32, 8, index_heads=2, index_dim=16)
        return [base, replace(base, name="csa", rate=4, topk=4), replace(base, name="hca", rate=8)]
    base = Case("sliding", 4096, 4096, 16, 512, 64, 1024, 128)
    return [base, replace(base, name="csa", rate=4, topk=512), replace(base, name="hca", rate=128)]


def config(case: Case, impl: str) -> AttentionConfig:
    compress = {} if case.rate is None else dict(compress_rate=case.rate)
    if case.topk is not None:
        compress.update(compress_topk=case.topk, index_heads=case.index_heads, index_head_dim=case.index_dim, index_loss=True)
    return AttentionConfig(n_heads=case.N, n_kv_heads=1, head_dim=case.D, rot_dim=case.rot, rope_last=True, q_rank=case.q_rank, qk_norm="head_k",
                           kv_shared=True, window=case.window, impl=impl, **compress)


def params(case: Case, cfg: AttentionConfig, device, dtype) -> dict:
    """The layer's weights, seeded, in dtype (the compressors' biases float32), requiring gradients."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {**gqa_q_shapes(case.H, cfg), "wk": (case.H, case.D), **out_shapes(case.H, cfg), **compress_shapes(case.H, cfg)}
    p = {n: (torch.randn(*s, device=device, generator=g) * s[0] ** -0.5).to(torch.float32 if n.endswith("bias") else dtype) for n, s in shapes.items()}
    p.update(q_a_norm=torch.ones(case.q_rank, device=device, dtype=dtype), k_norm=torch.ones(case.D, device=device, dtype=dtype),
             sinks=torch.randn(case.N, device=device, generator=g))
    return {n: t.requires_grad_() for n, t in p.items()}


def layer_flops(case: Case, T: int) -> float:
    """The forward's matmul FLOPs of the layer over one document of T tokens (module docstring)."""
    H, N, D, Q = case.H, case.N, case.D, case.q_rank
    pos = torch.arange(T, dtype=torch.float64)
    attended = torch.clamp(pos + 1, max=case.window)  # the window's keys
    per_token = 2 * (H * Q + Q * N * D + H * D + N * D * H)
    if case.rate is not None:
        seen = torch.floor((pos + 1) / case.rate)  # the complete runs a query sees
        width = 2 * D if case.topk is not None else D
        per_token += 2 * 2 * H * width
        if case.topk is not None:  # the chosen entries, and the indexer's compressor, queries, weights and scores
            Ni, Di = case.index_heads, case.index_dim
            per_token += 2 * (2 * H * 2 * Di + Q * Ni * Di + H * Ni) + 2 * Ni * Di * float(seen.mean())
            seen = torch.clamp(seen, max=case.topk)
        attended = attended + seen
    return T * (per_token + 4 * N * D * float(attended.mean()))


def run_case(case: Case, device: torch.device, dtype: torch.dtype, rate: float) -> list[dict]:
    p = params(case, config(case, "torch"), device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(case.T, case.H, device=device, generator=g).to(dtype).requires_grad_()
    up = torch.randn(case.T, case.H, device=device, generator=g).to(dtype)
    cfgs = {"kernel": config(case, "triton"), "reference": config(case, "torch"), "dense": config(case, "torch")}

    def call(name, n):
        cfg = cfgs[name]
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        ctx = attention_context(cu, positions_from_cu_seqlens(cu), cfg)
        rows = layers._SCORE_ROWS
        layers._SCORE_ROWS = 1 << 62 if name == "dense" else rows
        try:
            y, stats = attention(x[:n], p, cfg, ctx)
        finally:
            layers._SCORE_ROWS = rows
        return y, stats

    def fwd_bwd(name, n=case.T):
        y, stats = call(name, n)
        loss = (y * up[:n]).sum() + (stats["index_loss"] if "index_loss" in stats.keys() else 0.0)
        return y.detach(), *torch.autograd.grad(loss, [x, *p.values()])

    n_check = min(case.T, 512)
    outs = {name: fwd_bwd(name, n_check) for name in ("kernel", "reference")}
    check_agree(case.name, outs, ("kernel", "reference"), dtype, f" on {n_check} tokens")
    del outs

    def fwd(name):
        with torch.no_grad():
            return call(name, case.T)[0]

    flops = layer_flops(case, case.T)
    rows = []
    for pass_name, step, pass_flops in (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3 * flops)):
        ms = {}
        for name in cfgs:  # out of memory (the dense scores [N, T, T + S] and their probabilities): an empty row
            ms[name], peak = time_and_peak(lambda name=name: step(name), device, f"{case.name}-{pass_name}-{name}")
            rows.append({"case": case.name, "pass": pass_name, "impl": name, "ms": ms[name], "peak_GiB": None if peak is None else peak / 2**30,
                         "floor_fraction": None if ms[name] is None else pass_flops / rate * 1e3 / ms[name], "T": case.T, "N": case.N,
                         "D": case.D, "window": case.window, "rate": case.rate, "topk": case.topk, "dtype": str(dtype).removeprefix("torch.")})
        kernel_row = rows[-len(cfgs)]
        for base in ("reference", "dense"):
            kernel_row[f"speedup_vs_{base}"] = ms[base] / ms["kernel"] if ms[base] and ms["kernel"] else None
    case_done(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    run_rate_cases(__doc__, "bench_dsv4_attention", make_cases, run_case, COLUMNS)
