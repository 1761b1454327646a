"""Block-mask benchmark: building the FlexAttention mask of a packed micro-batch, per T.

    .venv/bin/python benchmarks/bench_block_mask.py            # CUDA, T = 8K ... 64K
    .venv/bin/python benchmarks/bench_block_mask.py --smoke    # CPU, T = 512, 2048

What attention_context builds once per micro-batch on the flex path: the causal,
same-document BlockMask (blocks of 128 x 128). Layouts:
    one document   a single causal document over the whole micro-batch (long context)
    packed         documents of 3T/8, T/8, T/4, T/4 tokens
    packed chunked the same documents in Llama 4's chunked attention, chunks of T/8 tokens
                   (8192 at T = 64K): a query sees the earlier tokens of its own chunk

Implementations, each checked to give the same blocks (visited, and full: mask_mod skipped)
before timing:
    fmoe                      fmoe.layers.document_mask(flex=True): from each block's first
                              and last document and token index, O((T/128)^2)
    create_block_mask         torch's, eager: evaluates the whole [T, T] mask, then sums blocks
    compiled create_block_mask  torch.compile(create_block_mask), as torch's docs advise for
                              long sequences (--smoke: the aot_eager backend, no codegen)

Table: median ms; speedup = this impl's ms / fmoe's ms (how much longer the baseline takes);
peak_MiB: the most bytes held while building, above what was held before (CUDA: the
allocator's peak; CPU: fmoe.train.metrics.AllocatedBytes, every storage created); blocks:
visited + full (query block, key block) pairs; floor_fraction (fmoe only): the block
tables' bytes (kv and q side, visited and full, int32) plus the document ids read, at the
copy bandwidth measured in the same run, over the measured time. CSV: OUT/bench_block_mask.csv.
"""

import sys

from _common import bench, cuda_peak_bytes, finish, floor_fraction, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from fmoe.layers import document_mask  # noqa: E402
from fmoe.ops.packed import sequence_ids  # noqa: E402
from fmoe.train.metrics import AllocatedBytes  # noqa: E402

COLUMNS = ["layout", "T", "impl", "ms", "speedup", "peak_MiB", "blocks", "floor_fraction"]
BLOCK = 128


def layouts(T: int) -> dict:
    """name -> (cu_seqlens, chunk or None)."""
    packed = [0, 3 * T // 8, T // 2, 3 * T // 4, T]
    return {"one document": ([0, T], None), "packed": (packed, None), "packed chunked": (packed, T // 8)}


def tables(bm) -> tuple[torch.Tensor, ...]:
    """A BlockMask's block tables: visited-but-masked and full, counts and indices."""
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


def peak_mib(fn, device) -> float:
    """CUDA: the allocator's peak; CPU: every storage created (AllocatedBytes)."""
    peak = cuda_peak_bytes(fn, device)
    if peak is None:
        with AllocatedBytes() as mem:
            fn()
        peak = mem.peak
    return peak / 2**20


def run_layout(name: str, cu_list: list, chunk, device, bandwidth: float, smoke: bool) -> list[dict]:
    T = cu_list[-1]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    doc_T = sequence_ids(cu, T)
    # each token's chunk of its document (positions // chunk), or 0 without chunks
    chunk_T = (torch.arange(T, device=device) - cu.long()[doc_T]) // (chunk or T)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc_T[q_idx] == doc_T[kv_idx]) & (chunk_T[q_idx] == chunk_T[kv_idx]) & (kv_idx <= q_idx)

    compiled = torch.compile(create_block_mask, **(dict(backend="aot_eager") if smoke else {}))
    impls = {
        "fmoe": lambda: document_mask(cu, T, flex=True, block_size=BLOCK, chunk=chunk),
        "create_block_mask": lambda: create_block_mask(same_doc_causal, None, None, T, T, device=device, BLOCK_SIZE=BLOCK),
        "compiled create_block_mask": lambda: compiled(same_doc_causal, None, None, T, T, device=device, BLOCK_SIZE=BLOCK),
    }
    want = None
    rows = []
    for impl, fn in impls.items():
        got = tables(fn())  # the first call compiles
        if want is None:
            want = got
        elif not all(torch.equal(a, b) for a, b in zip(got, want)):
            sys.exit(f"{name}, T={T}: {impl}'s block tables differ from fmoe's")
        ms = bench(fn, device, label=f"{name}-T{T}-{impl}")
        rows.append({"layout": name, "T": T, "impl": impl, "ms": ms, "peak_MiB": peak_mib(fn, device),
                     "blocks": int(got[0].sum() + got[2].sum()), "block": BLOCK})
    n_blocks = -(-T // BLOCK)
    table_bytes = 4 * n_blocks * n_blocks * 4 + 4 * 4 * n_blocks  # kv and q side, visited and full: indices + counts
    rows[0]["floor_fraction"] = floor_fraction(table_bytes + 8 * T, bandwidth, rows[0]["ms"])
    for row in rows[1:]:
        row["speedup"] = row["ms"] / rows[0]["ms"]
    print(f"{name}, T={T}: the three give the same blocks; fmoe {rows[0]['ms']:.3g} ms", flush=True)
    return rows


def main() -> None:
    args, device, _, bandwidth = start(__doc__)
    rows = []
    for T in (512, 2048) if args.smoke else (8192, 16384, 32768, 65536):
        for name, (cu, chunk) in layouts(T).items():
            torch._dynamo.reset()  # one compile per shape
            rows += run_layout(name, cu, chunk, device, bandwidth, args.smoke)
    finish(args, device, bandwidth, "bench_block_mask", [(rows, COLUMNS)])


if __name__ == "__main__":
    main()
