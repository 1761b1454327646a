"""Mixture of attention heads benchmark: JetMoE's attention layer (fmoe.layers.attention with
moa_experts) on the grouped GEMMs against the per-expert loop and plain grouped-query attention.

    .venv/bin/python benchmarks/bench_moa.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_moa.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (JetMoE-8B's attention: H = 2048, 8 attention experts, 2 per token, each 16 query heads
over the 16 shared kv heads of 128 channels; documents of 2048 tokens):
    jetmoe-8k     T = 8192
    jetmoe-16k    T = 16384
--smoke: H = 32, 3 experts, 2 per token, 2 kv heads of 16 channels, T = 48, float32; moa with
impl="triton" (its routing, permute and grouped GEMMs by the Triton kernels, through the
interpreter; "auto" would take the torch path on CPU and check loop against itself).

Implementations (the whole layer: the router, the projections, RoPE, attention, the outputs):
    moa     impl="auto": the experts' query and output projections as routed linear layers
            (fmoe.ops.permute, grouped_matmul, unpermute: the Triton grouped GEMM or
            torch._grouped_mm on CUDA), the attention FlexAttention's
    loop    impl="torch": fmoe's reference layer, the projections expert by expert (one host
            read of the offsets per projection; transformers' JetMoE loops the same way) and the
            attention by SDPA under the dense [T, T] mask (so its row times both)
    gqa     the same attention without experts: one query and one output projection of the
            2 x 16 = 32 heads a token computes (the FLOPs moa does; what routing costs beside it)

Passes: fwd, and fwd+bwd (the gradients of x and every weight for a fixed upstream gradient;
the router's balance loss in the backward). Each case first checks moa against loop (output and
gradients). Table: median ms, moa's speedup over loop and its time over gqa's, CUDA peak memory,
and the floor fraction: the useful FLOPs (layer_flops) over the bf16 matmul rate measured in the
same run, the projections' 2 T H (2 N D + 2 G D) and the attention's 2 T N keys 2 D (keys: the
mean a query sees in its document, (doc + 1) / 2), x 3 for fwd+bwd, projections and attention
alike (matmul backward = 2x forward, no recomputation counted, as fmoe.train.metrics counts
attention; the router's 2 T H E is left out).

The CSV goes to OUT/bench_moa.csv.
"""

import dataclasses
from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    SMOKE,
    case_done,
    check_agree,
    run_rate_cases,
    time_and_peak,
)

import torch  # noqa: E402
from fmoe.layers import AttentionConfig, attention, attention_context  # noqa: E402
from fmoe.ops import positions_from_cu_seqlens  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_loop", "time_vs_gqa", "peak_GiB", "floor_fraction"]


@dataclass
class Case:
    name: str
    T: int
    doc: int
    H: int
    E: int
    k: int
    G: int
    D: int


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("jetmoe-8k", 48, 16, 32, 3, 2, 2, 16)]
    return [Case("jetmoe-8k", 8192, 2048, 2048, 8, 2, 16, 128), Case("jetmoe-16k", 16384, 2048, 2048, 8, 2, 16, 128)]


def layer_flops(T: int, H: int, N: int, G: int, D: int, keys: float, fwd_bwd: bool) -> float:
    """Useful FLOPs of the layer: the projections' 2 T H (2 N D + 2 G D) (a token's k experts'
    query and output projections, N = k G heads, and the shared wk, wv) and the attention's
    2 T N keys 2 D (scores and weighted values); fwd+bwd 3x (matmul backward = 2x forward, no
    recomputation)."""
    return (3 if fwd_bwd else 1) * (2 * T * H * (2 * N * D + 2 * G * D) + 2 * T * N * keys * 2 * D)


def run_case(case: Case, device: torch.device, dtype: torch.dtype, rate: float) -> list[dict]:
    E, k, G, D, H, T = case.E, case.k, case.G, case.D, case.H, case.T
    N = k * G
    moa = AttentionConfig(n_heads=N, n_kv_heads=G, head_dim=D, moa_experts=E, moa_topk=k)
    # --smoke: the Triton kernels through the interpreter ("auto" is the torch path on CPU)
    cfgs = {"moa": dataclasses.replace(moa, impl="triton") if SMOKE else moa, "loop": dataclasses.replace(moa, impl="torch"), "gqa": AttentionConfig(n_heads=N, n_kv_heads=G, head_dim=D)}
    g = torch.Generator(device=device).manual_seed(0)

    def weight(*shape, fan_in):
        return (torch.randn(*shape, device=device, generator=g) * fan_in ** -0.5).to(dtype).requires_grad_()

    experts = {"wq": weight(E, H, G * D, fan_in=H), "wk": weight(H, G * D, fan_in=H), "wv": weight(H, G * D, fan_in=H),
               "wo": weight(E, G * D, H, fan_in=G * D),
               "moa_router": (torch.randn(H, E, device=device, generator=g) * H ** -0.5).requires_grad_()}
    dense = {"wq": weight(H, N * D, fan_in=H), "wk": experts["wk"], "wv": experts["wv"], "wo": weight(N * D, H, fan_in=N * D)}
    x = torch.randn(T, H, device=device, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(T, H, device=device, generator=g).to(dtype)
    cu = torch.arange(0, T + 1, case.doc, dtype=torch.int32, device=device)
    positions = positions_from_cu_seqlens(cu)
    contexts = {name: attention_context(cu, positions, cfg) for name, cfg in cfgs.items()}

    def layer(name):
        p = dense if name == "gqa" else experts
        y, stats = attention(x, p, cfgs[name], contexts[name])
        return y if "moa_aux_loss" not in stats.keys() else (y, stats["moa_aux_loss"])

    def fwd(name):
        with torch.no_grad():
            return layer(name)

    def fwd_bwd(name):
        out = layer(name)
        y, extra = (out, 0.0) if isinstance(out, torch.Tensor) else (out[0], out[1] * 0.01)
        params = list((dense if name == "gqa" else experts).values())
        return torch.autograd.grad((y.float() * upstream.float()).sum() + extra, [x, *params])

    outs = {name: (fwd(name), *fwd_bwd(name)) for name in ("moa", "loop")}
    check_agree(case.name, outs, ("moa", "loop"), dtype)
    del outs
    keys = (case.doc + 1) / 2  # the mean keys a query sees in its document
    rows, ms = [], {}
    for pass_name, step in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        flops = layer_flops(T, H, N, G, D, keys, pass_name == "fwd+bwd")
        for name in cfgs:
            ms[name], peak = time_and_peak(lambda name=name: step(name), device, f"{case.name}-{pass_name}-{name}")
            rows.append({"case": case.name, "pass": pass_name, "impl": name, "ms": ms[name], "peak_GiB": None if peak is None else peak / 2**30,
                         "floor_fraction": None if ms[name] is None else flops / rate * 1e3 / ms[name], "T": T, "H": H, "E": E, "k": k,
                         "G": G, "D": D, "doc": case.doc, "dtype": str(dtype).removeprefix("torch."), "flops": flops,
                         "layer_impl": cfgs[name].impl})
        moa_row = rows[-len(cfgs)]
        if ms.get("moa"):
            moa_row["speedup_vs_loop"] = ms["loop"] / ms["moa"] if ms.get("loop") else None
            moa_row["time_vs_gqa"] = ms["moa"] / ms["gqa"] if ms.get("gqa") else None
    case_done(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    run_rate_cases(__doc__, "bench_moa", make_cases, run_case, COLUMNS)
