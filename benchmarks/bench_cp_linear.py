"""Context-parallel Gated DeltaNet benchmark: one cp rank's share of the gated delta rule,
forward+backward, at cp = 1, 2, 4.

    .venv/bin/python benchmarks/bench_cp_linear.py            # CUDA, bf16 inputs, real shapes
    .venv/bin/python benchmarks/bench_cp_linear.py --smoke    # CPU + Triton interpreter, tiny shapes

One device runs ONE RANK'S SHARE only, what fmoe.parallel.gated_delta_rule_cp computes on
it: the rule over each of its two chunks (fmoe.parallel.cp_token_index: chunks r and
2 cp - 1 - r) with Dk extra value channels started from [0 | I], the scan of every chunk's
end states and the correction of its outputs. The all-gather of the chunks' end states is
simulated: the other ranks' are computed beforehand and the rank's own put among them, so
the time holds the rank's compute and no communication (2 cp N Dk (Dk + Dv) float32 values
per layer: 16 MiB at cp = 4 with Qwen3-Next's heads). Multi-rank numbers wait for a
multi-GPU machine.

Shapes (Qwen3-Next-80B's linear layers: N = 32 value heads, q and k repeated to them,
Dk = Dv = 128, chunks of 64; --smoke: N = 2, D = 8, float32), T = 16K and 32K tokens
(--smoke: 32, 64). Layouts:
    one document   one document over the whole micro-batch (the state crosses every chunk)
    packed         documents of 4096 tokens (--smoke: 12)

Implementations:
    cp=1   fmoe.ops.gated_delta_rule on the whole micro-batch, one device: the baseline,
           measured in the same run
    cp=2   each rank's share in turn; the row shows the slowest (a step waits for it) and
    cp=4   rank_spread = slowest / fastest (1.0: balanced)

Table: median ms of forward + backward (the gradients of q, k, v, g and beta for a fixed
upstream gradient); speedup_vs_cp1 = cp=1 ms / this ms (cp would be ideal; the widened
values make each rank's rule about (Dv + Dk) / Dv times the work of its tokens alone);
work_vs_cp1 = cp x this ms / cp=1 ms, the device time of all ranks over one device's;
flop_fraction = the rank's useful FLOPs (bench_delta's count for its T/cp tokens, not
counting the extra channels) / ms over the float32 matmul rate measured in the same run.
Before timing, every rank's output is checked against its rows of the cp=1 output. CSV:
OUT/bench_cp_linear.csv.
"""

import sys

from _common import bench, case_done, finish, matmul_rate, rel_err, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET

import torch  # noqa: E402
from bench_delta import CHUNK, flops_per_token_head, rule_inputs  # noqa: E402  (the same inputs and FLOP count)
from fmoe.ops import gated_delta_rule  # noqa: E402
from fmoe.parallel import cp_token_index  # noqa: E402
from fmoe.parallel.context import _chunk_rows, _rule_chunks, _rule_outputs  # noqa: E402  (one rank's pieces of gated_delta_rule_cp)

COLUMNS = ["layout", "T", "impl", "ms", "rank_spread", "speedup_vs_cp1", "work_vs_cp1", "flop_fraction"]
CPS = (1, 2, 4)
NOTE = ("one rank's share per row, the all-gather of the chunks' end states simulated on one device: "
        "multi-rank numbers wait for a multi-GPU machine")


def make_shapes(smoke: bool):
    """(N heads, D = Dk = Dv, sequence lengths, packed document length)."""
    return (2, 8, (32, 64), 12) if smoke else (32, 128, (16384, 32768), 4096)


def rank_share(inputs, cu, cp: int, rank: int):
    """(token_index, fwd_bwd inputs, share(*local) -> o) of cp rank `rank`, its all-gather
    simulated: every other rank's chunk ends computed here, its own put in place
    (differentiably)."""
    T = inputs[0].shape[1]
    every_ends = []
    with torch.no_grad():
        for r in range(cp):
            index = cp_token_index(T, cp, r, device=cu.device)
            every_ends.append(_rule_chunks(*(t[:, index] for t in inputs), cu, cp, r, chunk_size=CHUNK)[1])
    every = torch.cat(every_ends)[_chunk_rows(cp)]
    own = torch.tensor([rank, 2 * cp - 1 - rank], device=cu.device)
    L = T // (2 * cp)

    def share(*local):
        outs, ends = _rule_chunks(*local, cu, cp, rank, chunk_size=CHUNK)
        return _rule_outputs(outs, every.index_copy(0, own, ends), cu, L, cp, rank).to(local[2].dtype)

    index = cp_token_index(T, cp, rank, device=cu.device)
    return index, [t[:, index].detach().requires_grad_() for t in inputs], share


def run_layout(name: str, T: int, cu_list: list, N: int, D: int, device, dtype, rate: float) -> list[dict]:
    inputs = rule_inputs(T, N, D, device, dtype)
    cu = torch.tensor(cu_list, device=device)
    grad_o = torch.randn(1, T, N, D, device=device, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2

    with torch.no_grad():
        whole = gated_delta_rule(*inputs, cu, chunk_size=CHUNK)
    shares = {1: [(torch.arange(T, device=device), [t.detach().requires_grad_() for t in inputs],
                   lambda *xs: gated_delta_rule(*xs, cu, chunk_size=CHUNK, check=False))]}  # no host read of cu in the timing
    for cp in CPS[1:]:
        shares[cp] = [rank_share(inputs, cu, cp, r) for r in range(cp)]
        with torch.no_grad():
            for rank, (index, local, share) in enumerate(shares[cp]):
                err = rel_err(share(*local), whole[:, index])
                if err > tol:
                    sys.exit(f"{name}, T={T}, cp={cp}, rank {rank}: differs from its rows of cp=1 by {err:.3g}")
    print(f"{name}, T={T}: every rank's output checked against cp=1; timing", flush=True)

    rows = []
    for cp in CPS:
        times = []
        for rank, (index, local, share) in enumerate(shares[cp]):
            grad = grad_o[:, index]

            def fwd_bwd(local=local, share=share, grad=grad):
                return torch.autograd.grad(share(*local), local, grad)

            times.append(bench(fwd_bwd, device, label=f"{name}-T{T}-cp{cp}-rank{rank}"))
        slowest = max(range(len(times)), key=times.__getitem__)
        ms = times[slowest]
        rows.append({
            "layout": name, "T": T, "impl": f"cp={cp}", "ms": ms, "rank_spread": ms / min(times),
            "flop_fraction": 3 * (T // cp) * N * flops_per_token_head(D) / (ms * 1e-3) / rate,
            "slowest_rank": slowest, "rank_ms": " ".join(f"{t:.4g}" for t in times),
            "N": N, "D": D, "dtype": str(dtype).removeprefix("torch."),
        })
    for row, cp in zip(rows, CPS):
        row["speedup_vs_cp1"] = rows[0]["ms"] / row["ms"] if cp > 1 else None
        row["work_vs_cp1"] = cp * row["ms"] / rows[0]["ms"]
    case_done(rows, COLUMNS)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    print(f"NOTE: {NOTE}", flush=True)
    rate = matmul_rate(device, torch.float32, 256 if args.smoke else 8192)
    print(f"float32 matmul rate: {rate / 1e12:.3g} TFLOP/s (measured now)", flush=True)
    N, D, lengths, doc = make_shapes(args.smoke)
    rows = []
    for T in lengths:
        packed = list(range(0, T, doc)) + [T]
        for name, cu in (("one document", [0, T]), ("packed", packed)):
            rows += run_layout(name, T, cu, N, D, device, dtype, rate)
    finish(args, device, bandwidth, "bench_cp_linear", [(rows, COLUMNS)], fp32_matmul_TFLOPs=rate / 1e12, note=NOTE)
    print(f"\n{NOTE}")


if __name__ == "__main__":
    main()
