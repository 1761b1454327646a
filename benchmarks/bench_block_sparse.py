"""Block-sparse attention benchmark: MiniMax-M3's attention layer (fmoe.layers.attention with
index_topk_blocks) on the sparse kernel against the dense reference and plain full attention.

    .venv/bin/python benchmarks/bench_block_sparse.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_block_sparse.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (one tensor-parallel rank of MiniMax-M3 at tp = 4: H = 6144 in, 16 query heads over 1 kv
head of 128 channels, its indexer head of 128 channels; each query keeps 16 blocks of 128 keys,
its own among them; one document of T tokens):
    m3-8k     T = 8192
    m3-32k    T = 32768
--smoke: H = 32, 2 heads over 1 kv head of 16 channels, blocks of 4, 3 kept, T = 48, float32.

Implementations (the whole layer: projections, RoPE, the indexer's choice, attention, wo):
    kernel      impl="triton": each query's heads over the keys of their chosen blocks
                (block_index_slots; fmoe.ops.sparse_attention over rows [v | k]), the mask kept
                as its rule (MaskRows)
    dense-mask  impl="torch": the choice as a [kv heads, T, T] mask under SDPA (the reference)
    full        the same layer without block-sparse attention: every earlier key, fmoe's own
                attention (impl "auto": FlexAttention on CUDA)

Passes: fwd, and fwd+bwd (the gradients of x and the four projections for a fixed upstream
gradient; the indexer's loss off). Each case first checks kernel against dense-mask (output and
gradients) where both fit. Table: median ms, the speedups over dense-mask and full, CUDA peak
memory, the mean keys a query attends to (keys_per_query), and the floor fraction: the useful
FLOPs (layer_flops), the attention's 2 T N keys (D + Dv) plus the projections' 2 T H (N D +
2 G D + N D), x 1 for fwd and x 3 for fwd+bwd (matmul backward = 2x forward, no recomputation
counted, as fmoe.train.metrics counts attention), over the bf16 matmul rate measured in the
same run (the indexer's own FLOPs are not counted). keys_per_query: kernel and dense-mask, the
slots the kernel's run filled (block_index_slots' index >= 0, counted on one forward of the
layer; both attend under the same choice), which block_keys_per_query gives in closed form: a
query t sees its own block up to itself (t % block + 1 keys) and the topk - 1 other chosen
blocks whole, min(topk - 1, t // block) x block, in all min(K, t + 1) for t < K = topk x block
and about K - block / 2 after (mean m3-8k 1744.5, m3-32k 1924.5, where min(K, t + 1) gave 1792.1
and 1984.0); full, (T + 1) / 2. An implementation
that runs out of memory gets an empty row (the dense mask at m3-32k: T^2 bytes per kv head, and
SDPA's scores under it).

The CSV goes to OUT/bench_block_sparse.csv.
"""

import dataclasses
from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    case_done,
    check_agree,
    run_rate_cases,
    time_and_peak,
)

import torch  # noqa: E402
import fmoe.layers  # noqa: E402
from fmoe.layers import AttentionConfig, attention, attention_context, index_shapes  # noqa: E402
from fmoe.ops import positions_from_cu_seqlens  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_dense_mask", "speedup_vs_full", "peak_GiB", "keys_per_query", "floor_fraction"]


@dataclass
class Case:
    name: str
    T: int
    H: int
    N: int
    G: int
    D: int
    block: int
    topk: int


def make_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("m3-8k", 48, 32, 2, 1, 16, 4, 3)]
    return [Case("m3-8k", 8192, 6144, 16, 1, 128, 128, 16), Case("m3-32k", 32768, 6144, 16, 1, 128, 128, 16)]


def block_keys_per_query(T: int, block: int, topk: int) -> float:
    """The mean keys a query of a causal document of T tokens attends to when it keeps topk
    blocks of `block` keys, its own among them (index_local_blocks = 1): query t sees t % block
    + 1 keys of its own block and min(topk - 1, t // block) earlier blocks whole (blocks of
    no visible key are never chosen)."""
    return sum(min(topk - 1, t // block) * block + t % block + 1 for t in range(T)) / T


def layer_flops(T: int, H: int, N: int, G: int, D: int, keys: float, fwd_bwd: bool) -> float:
    """Useful FLOPs of the layer: the projections' 2 T H (2 N D + 2 G D) (wq and wo, wk and wv)
    and each query head's scores and weighted values over its keys, 2 T N keys (D + D); fwd+bwd
    3x (matmul backward = 2x forward, no recomputation)."""
    return (3 if fwd_bwd else 1) * (2 * T * H * (2 * N * D + 2 * G * D) + 2 * T * N * keys * 2 * D)


def counted_keys(forward, G: int, T: int) -> float:
    """The mean keys per query and kv head of the kernel's run: the slots block_index_slots
    fills (>= 0) in one call of forward()."""
    seen, slots = [], fmoe.layers.block_index_slots

    def spy(*args, **kwargs):
        out = slots(*args, **kwargs)
        seen.append(int((out >= 0).sum()))
        return out

    fmoe.layers.block_index_slots = spy
    try:
        with torch.no_grad():
            forward()
    finally:
        fmoe.layers.block_index_slots = slots
    if len(seen) != 1:
        raise RuntimeError(f"expected one call of block_index_slots in the kernel's forward, got {len(seen)}")
    return seen[0] / (G * T)


def run_case(case: Case, device: torch.device, dtype: torch.dtype, rate: float) -> list[dict]:
    N, G, D = case.N, case.G, case.D
    blocks = AttentionConfig(n_heads=N, n_kv_heads=G, head_dim=D, index_topk_blocks=case.topk, index_block_size=case.block,
                             index_heads=G, index_head_dim=D)
    cfgs = {"kernel": dataclasses.replace(blocks, impl="triton"), "dense-mask": dataclasses.replace(blocks, impl="torch"),
            "full": AttentionConfig(n_heads=N, n_kv_heads=G, head_dim=D)}
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"wq": (case.H, N * D), "wk": (case.H, G * D), "wv": (case.H, G * D), "wo": (N * D, case.H), **index_shapes(case.H, blocks)}
    params = {name: (torch.randn(*shape, device=device, generator=g) * shape[0] ** -0.5 if len(shape) == 2 else
                     torch.ones(shape, device=device)).to(dtype) for name, shape in shapes.items()}
    trained = [params[n] for n in ("wq", "wk", "wv", "wo")]
    for w in trained:
        w.requires_grad_()
    x = torch.randn(case.T, case.H, device=device, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(case.T, case.H, device=device, generator=g).to(dtype)
    cu = torch.tensor([0, case.T], dtype=torch.int32, device=device)
    positions = positions_from_cu_seqlens(cu)
    contexts = {name: attention_context(cu, positions, cfg) for name, cfg in cfgs.items()}

    def layer(name):
        p = params if name != "full" else {n: t for n, t in params.items() if not n.startswith("index_")}
        return attention(x, p, cfgs[name], contexts[name])[0]

    def fwd(name):
        with torch.no_grad():
            return layer(name)

    def fwd_bwd(name):
        return torch.autograd.grad(layer(name), [x, *trained], upstream)

    try:  # the kernel's choice against the reference's: output and gradients
        outs = {name: (layer(name).detach(), *fwd_bwd(name)) for name in ("kernel", "dense-mask")}
        check_agree(case.name, outs, ("kernel", "dense-mask"), dtype)
        del outs
    except torch.OutOfMemoryError:
        print(f"{case.name}: the dense mask does not fit; kernel not checked against it here (tests/test_attention.py does)", flush=True)
        torch.cuda.empty_cache()
    # the keys a query attends to, on average: counted on the kernel's run (the same choice as dense-mask's); full: t + 1
    T = case.T
    chosen = counted_keys(lambda: layer("kernel"), G, T)
    expected = block_keys_per_query(T, case.block, case.topk)
    if abs(chosen - expected) > 1e-6 * expected:
        print(f"{case.name}: the kernel's run attends to {chosen:.6g} keys per query, block_keys_per_query {expected:.6g}", flush=True)
    keys = {"full": (T + 1) / 2, "kernel": chosen, "dense-mask": chosen}
    rows, ms = [], {}
    for pass_name, step in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for name in cfgs:
            seen = keys[name]
            flops = layer_flops(T, case.H, N, G, D, seen, pass_name == "fwd+bwd")
            ms[name], peak = time_and_peak(lambda name=name: step(name), device, f"{case.name}-{pass_name}-{name}")
            rows.append({"case": case.name, "pass": pass_name, "impl": name, "ms": ms[name], "peak_GiB": None if peak is None else peak / 2**30,
                         "keys_per_query": seen, "floor_fraction": None if ms[name] is None else flops / rate * 1e3 / ms[name],
                         "T": case.T, "H": case.H, "N": N, "G": G, "D": D, "block": case.block, "topk": case.topk,
                         "dtype": str(dtype).removeprefix("torch."), "flops": flops})
        kernel_row = rows[-len(cfgs)]
        for base in ("dense-mask", "full"):
            kernel_row[f"speedup_vs_{base.replace('-', '_')}"] = ms[base] / ms["kernel"] if ms.get(base) and ms.get("kernel") else None
    case_done(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    run_rate_cases(__doc__, "bench_block_sparse", make_cases, run_case, COLUMNS)
