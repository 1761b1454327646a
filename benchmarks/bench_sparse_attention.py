"""Sparse attention benchmark: fmoe.ops.sparse_attention's Triton kernels (DeepSeek sparse
attention in multi-latent attention's absorbed form) against the two ways torch computes
the same function.

    .venv/bin/python benchmarks/bench_sparse_attention.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_sparse_attention.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (T queries of N heads over S keys, J chosen keys each, rows of D = 512 latent + 64
rotated channels, the latent the value: Dv = 512; one tensor-parallel rank's heads):
    v3.2-tp8     T = 4096, S = 4096, J = 2048, N = 16 (DeepSeek-V3.2's 128 heads over tp = 8; its
                 index_topk): a 4k micro-batch, each query choosing among the earlier keys
    long-ctx     T = 1024 queries at the end of a 32768-token context, J = 2048, N = 16
--smoke: T = S = 48, J = 8, N = 3, D = 24 + 8, float32.

Implementations:
    fused   impl="triton": the forward's online softmax over blocks of gathered rows; dq, and
            the keys' gradients added by atomics (the default; not the deterministic kernel)
    gather  impl="torch" (the reference): every slot's row gathered into [T, J, D], then
            einsums; autograd
    dense   what fmoe's DSA layers ran before the kernel: SDPA over all S keys under the choice
            as a [T, S] boolean mask (the math or memory-efficient kernel torch picks)

Passes: fwd, and fwd+bwd (dq and dkv for a fixed upstream gradient). Each case first checks
fused against gather (output and gradients) on its first 256 queries; an implementation
that runs out of memory gets an empty row (the gather at v3.2-tp8 needs T J D float32 rows
and their gradient: about 40 GiB). Table: median ms, the speedups over gather and
dense, CUDA peak memory of the pass, and the floor fraction: the larger of two lower bounds
on the time over the measured time. The bytes bound: each tensor read or written once (fwd:
q, kv, index, o; fwd+bwd adds the backward's q, kv, index, do, dq and dkv; the slots' rows
are gathered again per query, but from L2: kv is 4.5 MiB at v3.2-tp8); the FLOPs bound
(attention_flops): 2 N (D + Dv) per real slot (index >= 0, counted from the index the run uses:
the query at position p has min(J, p + 1) of them, the rest -1; at v3.2-tp8 1536.25 per query
on average, not J = 2048) for fwd, x 3 for fwd+bwd (the backward's dV, dP, dQ, dK: twice the
forward, no recomputation counted, as fmoe.train.metrics counts attention), at the bf16
matmul rate measured in the same run.

A second table times DSA's lightning indexer, fmoe.ops.indexer_scores: the scores [T, S] of
64 heads of 128 channels (DeepSeek-V3.2's) over every key, at v3.2-tp8's and long-ctx's T and
S. Rows: the kernel in bf16 and in float32 (the layers' dtype), against the torch einsums
in float32 (what the layers run: a [T, 64, S] product; impl="auto" keeps float32 there) and
in bf16. Floor: the
FLOPs 2 T S N D at the matmul rate of the row's dtype measured in the same run (float32:
no TF32). --smoke: 4 heads of 16 channels, float32 alone.

The CSV goes to OUT/bench_sparse_attention.csv.
"""

from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    check_agree,
    case_done,
    cuda_peak_bytes,
    finish,
    matmul_rate,
    start,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmoe.ops import indexer_scores, sparse_attention  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_gather", "speedup_vs_dense", "peak_GiB", "floor_fraction", "bound"]
INDEXER_COLUMNS = ["case", "impl", "ms", "speedup_vs_torch_fp32", "peak_GiB", "floor_fraction"]


@dataclass
class Case:
    name: str
    T: int
    S: int
    J: int
    N: int
    Dv: int
    Dr: int


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("v3.2-tp8", 48, 48, 8, 3, 24, 8), Case("long-ctx", 16, 96, 8, 3, 24, 8)]
    return [Case("v3.2-tp8", 4096, 4096, 2048, 16, 512, 64), Case("long-ctx", 1024, 32768, 2048, 16, 512, 64)]


def inputs(case: Case, device, dtype):
    """q [T, N, D], kv [S, D] and each query's J keys among the earlier ones (the last T of
    S tokens; a query with fewer earlier keys leaves -1 slots), seeded."""
    g = torch.Generator(device=device).manual_seed(0)
    D = case.Dv + case.Dr
    q = torch.randn(case.T, case.N, D, device=device, generator=g).to(dtype)
    kv = torch.randn(case.S, D, device=device, generator=g).to(dtype)
    pos = torch.arange(case.S - case.T, case.S, device=device)  # the queries' positions among the keys
    scores = torch.rand(case.T, case.S, device=device, generator=g).masked_fill(torch.arange(case.S, device=device)[None, :] > pos[:, None], -1.0)
    best = torch.topk(scores, case.J, dim=-1)
    index = torch.where(best.values >= 0, best.indices, -1)
    return q, kv, index


def attention_flops(index: torch.Tensor, N: int, D: int, Dv: int) -> tuple[int, int]:
    """(fwd, fwd+bwd) useful FLOPs of sparse attention over index [T, J] (-1: an empty slot):
    per real slot and head 2 D (scores) + 2 Dv (weighted values); fwd+bwd 3x that (the
    backward's four products, dV, dP, dQ, dK, twice the forward; no recomputation counted)."""
    fwd = 2 * N * int((index >= 0).sum()) * (D + Dv)
    return fwd, 3 * fwd


def run_case(case: Case, device: torch.device, dtype: torch.dtype, rate: float, bandwidth: float) -> list[dict]:
    q, kv, index = inputs(case, device, dtype)
    q.requires_grad_(), kv.requires_grad_()
    D, scale = case.Dv + case.Dr, 192**-0.5
    grad_o = torch.randn(case.T, case.N, case.Dv, device=device, dtype=dtype)
    mask = torch.zeros(case.T, case.S + 1, dtype=torch.bool, device=device).scatter_(1, torch.where(index >= 0, index, case.S), True)[:, :case.S]

    def fused():
        return sparse_attention(q, kv, index, v_dim=case.Dv, scale=scale, check=False, impl="triton")[0]

    def gather():
        return sparse_attention(q, kv, index, v_dim=case.Dv, scale=scale, check=False, impl="torch")[0]

    def dense():
        q_NTD = q.transpose(0, 1)
        o = F.scaled_dot_product_attention(q_NTD, kv[None], kv[None, :, :case.Dv], attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)

    impls = {"fused": fused, "gather": gather, "dense": dense}
    outs = {}
    rows_checked = slice(0, min(case.T, 256))  # the first 256 queries: the gather of every slot's row is T J D floats
    for name, impl in (("fused", "triton"), ("gather", "torch")):
        x = q[rows_checked].detach().requires_grad_()
        o = sparse_attention(x, kv, index[rows_checked], v_dim=case.Dv, scale=scale, check=False, impl=impl)[0]
        outs[name] = (o.detach(), *torch.autograd.grad(o, [x, kv], grad_o[rows_checked]))
    check_agree(case.name, outs, ("fused", "gather"), dtype, f" on {rows_checked.stop} queries")

    def fwd(name):
        with torch.no_grad():
            return impls[name]()

    def fwd_bwd(name):
        return torch.autograd.grad(impls[name](), [q, kv], grad_o)

    elem = torch.finfo(dtype).bits // 8
    q_bytes, kv_bytes, o_bytes = case.T * case.N * D * elem, case.S * D * elem, case.T * case.N * case.Dv * elem
    fwd_bytes = q_bytes + kv_bytes + index.nbytes + o_bytes
    bwd_bytes = 2 * (q_bytes + kv_bytes) + index.nbytes + o_bytes  # q, kv, index, do read; dq, dkv written
    fwd_flops, fwd_bwd_flops = attention_flops(index, case.N, D, case.Dv)
    rows = []
    for pass_name, step, nbytes, flops in (("fwd", fwd, fwd_bytes, fwd_flops), ("fwd+bwd", fwd_bwd, fwd_bytes + bwd_bytes, fwd_bwd_flops)):
        ms = {}
        floor_ms = {"bytes": nbytes / bandwidth * 1e3, "flops": flops / rate * 1e3}
        bound = max(floor_ms, key=floor_ms.get)
        for name in impls:
            try:
                ms[name] = bench(lambda name=name: step(name), device, label=f"{case.name}-{pass_name}-{name}")
                peak = cuda_peak_bytes(lambda name=name: step(name), device)
            except torch.OutOfMemoryError:  # the gather's [T, J, D] rows and their gradient at the real shapes
                print(f"{case.name} {pass_name} {name}: out of memory", flush=True)
                ms[name] = peak = None
                torch.cuda.empty_cache()
            rows.append({"case": case.name, "pass": pass_name, "impl": name, "ms": ms[name],
                         "peak_GiB": None if peak is None else peak / 2**30,
                         "floor_fraction": None if ms[name] is None else floor_ms[bound] / ms[name], "bound": bound,
                         "T": case.T, "S": case.S, "J": case.J, "N": case.N, "D": D, "Dv": case.Dv, "dtype": str(dtype).removeprefix("torch."),
                         "flops": flops, "bytes": nbytes})
        fused_row = rows[-len(impls)]
        for base in ("gather", "dense"):
            fused_row[f"speedup_vs_{base}"] = ms[base] / ms["fused"] if ms[base] and ms["fused"] else None
    case_done(rows, COLUMNS)
    return rows


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def run_indexer(case: Case, device: torch.device, dtype: torch.dtype, rates: dict, smoke: bool) -> list[dict]:
    """indexer_scores' kernel against torch's einsums, in dtype and in float32 (the second table)."""
    N, D = (4, 16) if smoke else (64, 128)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(case.T, N, D, device=device, generator=g)
    w = torch.randn(case.T, N, device=device, generator=g) * N**-0.5
    k = torch.randn(case.S, D, device=device, generator=g)
    impls = {}
    for ty in dict.fromkeys((dtype, torch.float32)):
        q_ty, k_ty = q.to(ty), k.to(ty)
        for impl in ("triton", "torch"):
            impls[f"{'fused' if impl == 'triton' else 'torch'} {_short(ty)}"] = lambda q_ty=q_ty, k_ty=k_ty, impl=impl: indexer_scores(q_ty, w, k_ty, impl=impl)
    outs = {name: (fn(),) for name, fn in impls.items()}
    check_agree(f"{case.name} indexer", outs, ("fused fp32", "torch fp32"), torch.float32)
    if dtype != torch.float32:
        check_agree(f"{case.name} indexer", outs, (f"fused {_short(dtype)}", "torch fp32"), dtype)
    del outs
    flops = 2 * case.T * case.S * N * D
    ms, rows = {}, []
    for name, fn in impls.items():
        try:
            ms[name] = bench(fn, device, label=f"{case.name}-indexer-{name}")
            peak = cuda_peak_bytes(fn, device)
        except torch.OutOfMemoryError:  # the einsums' [T, N, S] products in float32
            print(f"{case.name} indexer {name}: out of memory", flush=True)
            ms[name] = peak = None
            torch.cuda.empty_cache()
        rate = rates[torch.float32 if name.endswith("fp32") else dtype]
        rows.append({"case": case.name, "impl": name, "ms": ms[name], "peak_GiB": None if peak is None else peak / 2**30,
                     "floor_fraction": None if ms[name] is None else flops / rate * 1e3 / ms[name],
                     "T": case.T, "S": case.S, "N": N, "D": D})
    for row in rows:
        if row["impl"].startswith("fused") and row["ms"] and ms.get("torch fp32"):
            row["speedup_vs_torch_fp32"] = ms["torch fp32"] / row["ms"]
    case_done(rows, INDEXER_COLUMNS)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    rates = {ty: matmul_rate(device, ty, 256 if args.smoke else 8192) for ty in dict.fromkeys((dtype, torch.float32))}
    for ty, r in rates.items():
        print(f"{str(ty).removeprefix('torch.')} matmul rate: {r / 1e12:.1f} TFLOP/s (measured now)", flush=True)
    rate = rates[dtype]
    rows, indexer_rows = [], []
    for case in make_cases(args.smoke):
        rows += run_case(case, device, dtype, rate, bandwidth)
    for case in make_cases(args.smoke):
        indexer_rows += run_indexer(case, device, dtype, rates, args.smoke)
    finish(args, device, bandwidth, "bench_sparse_attention", [(indexer_rows, INDEXER_COLUMNS), (rows, COLUMNS)], matmul_TFLOPs=rate / 1e12)


if __name__ == "__main__":
    main()
