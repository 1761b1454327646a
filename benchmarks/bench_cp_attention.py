"""Context-parallel attention benchmark: one cp rank's attention forward+backward at cp = 1, 2, 4.

    .venv/bin/python benchmarks/bench_cp_attention.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_cp_attention.py --smoke    # CPU, tiny shapes

One device runs ONE RANK'S SHARE only: fmoe.layers.attention on the rank's T/cp tokens
(fmoe.parallel.cp_token_index: chunks r and 2 cp - 1 - r), its queries against the keys and
values of all T tokens with the [T/cp, T] context-parallel mask. The all-gather is simulated:
the other ranks' K/V are built locally from the whole batch beforehand and the rank's own
rows are put among them (what fmoe.parallel.gather_kv returns), so the time holds the
rank's compute and no communication. Multi-rank numbers (the all-gather of K/V and the
reduce-scatter of their gradients, over NVLink, per layer) wait for a multi-GPU machine.

Shapes (N query heads, G kv heads, D head dim, H hidden): N=16, G=4, D=128, H=2048, bf16,
T = 8K, 16K, 32K, 64K tokens (--smoke: N=4, G=2, D=16, H=32, T = 32, 64, float32). Layouts:
    one document   a single causal document over the whole micro-batch (long context)
    packed         documents of 3T/8, T/8, T/4, T/4 tokens, across the chunk edges

Implementations (the same layer, "auto": FlexAttention with a block mask on CUDA, the SDPA
reference with a dense mask on CPU):
    cp=1   the whole micro-batch on one device: the baseline, measured in the same run
    cp=2   each of the 2 ranks' shares in turn; the row shows the slowest (a step waits
    cp=4   for it) and rank_spread = slowest / fastest (1.0: balanced)

Table: median ms of forward + backward (gradients of x and of wq, wk, wv, wo for a fixed
random upstream gradient); speedup_vs_cp1 = cp=1 ms / this ms (ideal: cp); matmul_fraction =
the rank's useful FLOPs / ms over the bf16 matmul rate measured in the same run (the
hardware floor: 3x the forward's 2 T/cp H (N + 2 G) D + 2 T/cp N D H projection FLOPs and
4 N D per visible (query, key) pair); peak_GiB, CUDA only: the peak memory of forward +
backward above what was held before; kv_MiB: the K and V of all T tokens that every rank
holds for one layer (2 T G D elements). Before timing, every rank's output is checked
against its rows of the cp=1 output. CSV: OUT/bench_cp_attention.csv.
"""

import sys

from _common import bench, cuda_peak_bytes, finish, matmul_rate, rel_err, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET

import torch  # noqa: E402
from fmoe.layers import AttentionConfig, attention, attention_context, rope_tables  # noqa: E402
from fmoe.ops import apply_rope, positions_from_cu_seqlens  # noqa: E402
from fmoe.parallel import cp_kv_index, cp_token_index  # noqa: E402

COLUMNS = ["layout", "T", "impl", "ms", "rank_spread", "speedup_vs_cp1", "matmul_fraction", "peak_GiB", "kv_MiB"]
CPS = (1, 2, 4)
NOTE = ("one rank's share per row, the K/V all-gather simulated on one device: "
        "multi-rank numbers (all-gather and reduce-scatter over cp ranks) wait for a multi-GPU machine")


def make_shapes(smoke: bool):
    """(AttentionConfig, hidden size, sequence lengths)."""
    if smoke:
        return AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16), 32, (32, 64)
    return AttentionConfig(n_heads=16, n_kv_heads=4, head_dim=128), 2048, (8192, 16384, 32768, 65536)


def layouts(T: int) -> dict:
    return {"one document": [0, T], "packed": [0, 3 * T // 8, T // 2, 3 * T // 4, T]}


def rank_share(x, p, cfg, cu, positions, cp, rank):
    """(token_index, AttentionContext) of cp rank `rank`, its gather_kv simulated: the other
    ranks' K/V computed here from the whole batch, its own rows put in place (differentiably)."""
    T, G, D = x.shape[0], cfg.n_kv_heads, cfg.head_dim
    index, kv_index = cp_token_index(T, cp, rank, device=x.device), cp_kv_index(T, cp, device=x.device)
    with torch.no_grad():
        cos, sin = rope_tables(positions, cfg)
        k_all = apply_rope((x @ p["wk"]).view(T, G, D), cos, sin, interleaved=cfg.interleaved)[kv_index]
        v_all = (x @ p["wv"]).view(T, G, D)[kv_index]
    own_rows = torch.arange(rank * T // cp, (rank + 1) * T // cp, device=x.device)

    def gather_kv(k, v):
        return k_all.index_copy(0, own_rows, k), v_all.index_copy(0, own_rows, v)

    return index, attention_context(cu, positions[index], cfg, token_index=index, kv_index=kv_index, gather_kv=gather_kv)


def flops_fwd(cfg, H: int, positions_local: torch.Tensor) -> float:
    """Useful forward FLOPs of attention on these tokens: the projections and 4 N D per
    visible (query, key) pair; a query at position s sees s + 1 keys of its document."""
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    T_local = positions_local.shape[0]
    pairs = float((positions_local.double() + 1).sum())
    return 2 * T_local * H * (N + 2 * G) * D + 2 * T_local * N * D * H + 4 * N * D * pairs


def run_layout(name, cu_list, cfg, H, device, dtype, rate) -> list[dict]:
    T = cu_list[-1]
    torch.manual_seed(0)
    N, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    shapes = {"wq": (H, N * D), "wk": (H, G * D), "wv": (H, G * D), "wo": (N * D, H)}
    p = {n: (torch.randn(*s, device=device) * s[0] ** -0.5).to(dtype).requires_grad_() for n, s in shapes.items()}
    x = torch.randn(T, H, device=device, dtype=dtype)
    upstream = torch.randn(T, H, device=device, dtype=dtype)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    positions = positions_from_cu_seqlens(cu, n_tokens=T)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    with torch.no_grad():
        whole_ctx = attention_context(cu, positions, cfg)
        whole, _ = attention(x, p, cfg, whole_ctx)
    shares = {1: [(torch.arange(T, device=device), whole_ctx)]}
    for cp in CPS[1:]:
        shares[cp] = [rank_share(x, p, cfg, cu, positions, cp, r) for r in range(cp)]
        with torch.no_grad():
            for rank, (index, ctx) in enumerate(shares[cp]):
                y, _ = attention(x[index], p, cfg, ctx)
                err = rel_err(y, whole[index])
                if err > tol:
                    sys.exit(f"{name}, T={T}, cp={cp}, rank {rank}: differs from its rows of cp=1 by {err:.3g}")
    print(f"{name}, T={T}: every rank's output checked against cp=1; timing", flush=True)

    rows = []
    for cp in CPS:
        times, peaks, fracs = [], [], []
        for rank, (index, ctx) in enumerate(shares[cp]):
            x_local = x[index].detach().requires_grad_()
            leaves, grad = [x_local, *p.values()], upstream[index]

            def fwd_bwd(x_local=x_local, ctx=ctx, leaves=leaves, grad=grad):
                return torch.autograd.grad(attention(x_local, p, cfg, ctx)[0], leaves, grad)

            fwd_bwd()  # compiles FlexAttention for this shape on CUDA
            ms = bench(fwd_bwd, device, label=f"{name}-T{T}-cp{cp}-rank{rank}")
            times.append(ms)
            peak = cuda_peak_bytes(fwd_bwd, device)
            peaks.append(None if peak is None else peak / 2**30)
            fracs.append(3 * flops_fwd(cfg, H, positions[index]) / (ms * 1e-3) / rate)
        slowest = max(range(len(times)), key=times.__getitem__)
        rows.append({
            "layout": name, "T": T, "impl": f"cp={cp}", "ms": times[slowest],
            "rank_spread": times[slowest] / min(times), "matmul_fraction": fracs[slowest],
            "peak_GiB": None if peaks[0] is None else max(peaks),
            "kv_MiB": 2 * T * G * D * x.element_size() / 2**20,
            "slowest_rank": slowest, "rank_ms": " ".join(f"{t:.4g}" for t in times),
            "N": N, "G": G, "D": D, "H": H, "dtype": str(dtype).removeprefix("torch."),
        })
    for row in rows:
        row["speedup_vs_cp1"] = rows[0]["ms"] / row["ms"] if row["impl"] != "cp=1" else None
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    print(f"NOTE: {NOTE}", flush=True)
    rate = matmul_rate(device, dtype, 256 if args.smoke else 8192)
    print(f"matmul rate: {rate / 1e12:.3g} TFLOP/s ({dtype})", flush=True)
    cfg, H, lengths = make_shapes(args.smoke)
    rows = []
    for T in lengths:
        for name, cu in layouts(T).items():
            torch._dynamo.reset()  # one compile per shape, never near dynamo's recompile limit
            rows += run_layout(name, cu, cfg, H, device, dtype, rate)
    finish(args, device, bandwidth, "bench_cp_attention", [(rows, COLUMNS)], matmul_TFLOPs=rate / 1e12, note=NOTE)
    print(f"\n{NOTE}")


if __name__ == "__main__":
    main()
