"""Decoding benchmark: one step of B sequences (a new token each) through the KV cache.

    .venv/bin/python benchmarks/bench_decode.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_decode.py --smoke    # CPU, tiny shapes

Models (4 trunk blocks, no MTP; weights random, the model's "auto" ops):
    gqa   Qwen3-30B-A3B's block: H=2048, 32 query / 4 kv heads of 128, qk norm, 128 experts
          of 768, top-8
    gqa-window  the same with a sliding window of 128 tokens in blocks 0 and 2 (gpt-oss's
          pattern): those layers' cache is a ring of the window's rows
    gqa-chunked the same with Llama 4's attention: chunks of 512 tokens in blocks 0-2 (their
          cache a ring of one chunk), block 3 NoPE with the query temperature, weightless
          q/k norms
    mla   DeepSeek-V3's attention at H=2048: 16 heads, q_rank 1536, kv_rank 512, rope 64,
          nope 128, v 128; 64 experts of 1024, top-6, a shared expert
(--smoke: H=32, 4 heads, 8 experts.) Each sequence holds a prompt of P = 1024 tokens (--smoke:
8) in the cache; the timed step decodes position P of every sequence again (the cache's
lengths are set back to P before each call), so every call does the same work.

Implementations, each checked to give the same next-token logits before timing:
    fmoe batched    Transformer.decode(ids [B, 1], cache of B sequences): one forward for all
    one at a time   B calls of decode, one sequence each (the same cache): what generation
                    without batching does
    no cache        Transformer.logits over the B packed whole sequences (P + 1 tokens each),
                    their last rows: decoding without a KV cache

Table: median ms per step (every sequence one token); tokens_per_s = B / step; speedup = this
impl's ms / fmoe's ms (how much longer it takes); floor_fraction (fmoe only): the bytes a step
must move at least (floor_bytes), at the copy bandwidth measured in the same run, over the
measured time: every dense weight (the embedding's B rows alone), the weights of the experts
the step routed to (per MoE block the distinct experts its B tokens chose, counted on the
step itself: routed_experts, from each block's tokens_per_expert; at most min(E, B k), fewer
where tokens share an expert) and, per attending layer and sequence, the key/value rows the
decoded position P sees, itself included (the earlier ones read from the cache, its own
written to it): P + 1 in a full layer, min(P + 1, window) in a sliding-window one, P % chunk
+ 1 in a chunked one (its own chunk up to itself: at P = 1024, chunks of 512, just itself);
experts (CSV column experts_read) is the sum over MoE blocks of the distinct experts.
cache_mib (fmoe only): the KV cache's size (KVCache.nbytes). CSV: OUT/bench_decode.csv.
"""

import math
import sys

from _common import bench, finish, floor_fraction, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET

import torch  # noqa: E402

from fmoe.model import Transformer, TransformerConfig  # noqa: E402

COLUMNS = ["model", "B", "impl", "ms", "tokens_per_s", "speedup", "floor_fraction", "cache_mib"]


def _llama4_attention(chunk: int) -> dict:
    """Llama 4's attention knobs on 4 blocks: chunked blocks 0-2, block 3 NoPE with the temperature."""
    return dict(qk_norm="rms", qk_norm_after_rope=True, nope_qk_norm=False, chunk=chunk, chunk_layers=(0, 1, 2), nope_layers=(3,),
                nope_temperature_floor=8192)


def configs(smoke: bool) -> dict:
    if smoke:
        base = dict(vocab_size=64, hidden=32, n_layers=4, n_dense=0, ffn_dense=64, n_experts=8, k=2, ffn_expert=16, n_shared=0,
                    expert_bias=False, score="softmax")
        return {"gqa": TransformerConfig(**base, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head"),
                "gqa-window": TransformerConfig(**base, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head", window=4, window_layers=(0, 2)),
                "gqa-chunked": TransformerConfig(**base, n_heads=4, n_kv_heads=2, head_dim=8, **_llama4_attention(chunk=4)),
                "mla": TransformerConfig(**{**base, "n_shared": 1}, n_heads=4, n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=16,
                                         kv_rank=8, v_head_dim=8)}
    base = dict(vocab_size=151936, hidden=2048, n_layers=4, n_dense=0, ffn_dense=6144)
    gqa = dict(base, n_experts=128, k=8, ffn_expert=768, n_shared=0, score="softmax", expert_bias=False, n_heads=32, n_kv_heads=4,
               head_dim=128, qk_norm="head")
    return {"gqa": TransformerConfig(**gqa),
            "gqa-window": TransformerConfig(**gqa, window=128, window_layers=(0, 2)),
            "gqa-chunked": TransformerConfig(**{**gqa, **_llama4_attention(chunk=512)}),
            "mla": TransformerConfig(**base, n_experts=64, k=6, ffn_expert=1024, n_shared=1, n_heads=16, n_kv_heads=16, head_dim=192,
                                     rope_dim=64, q_rank=1536, kv_rank=512, v_head_dim=128)}


def routed_experts(model: Transformer, step) -> list[int]:
    """The distinct experts each MoE block sent the tokens of one call of step() to (its
    stats["tokens_per_expert"] above 0; zero-computation experts left out), block by block."""
    used = []

    def hook(module, args, out):
        used.append(int((out[1]["tokens_per_expert"][:module.cfg.n_experts] > 0).sum()))

    handles = [m.register_forward_hook(hook) for m in model.moe_layers().values()]
    try:
        with torch.no_grad():
            step()
    finally:
        for h in handles:
            h.remove()
    if len(used) != len(model.moe_layers()):
        raise RuntimeError(f"expected one call of each of the {len(model.moe_layers())} MoE blocks, got {len(used)}")
    return used


def visible_rows(cfg: TransformerConfig, layer: int, position: int) -> int:
    """The key/value rows the token at `position` of a sequence sees in attending layer
    `layer`, itself included: position + 1, a sliding window's min(position + 1, window), a
    chunk's position % chunk + 1."""
    if cfg.is_local(layer):
        return min(position + 1, cfg.window) if cfg.window is not None else position % cfg.chunk + 1
    return position + 1


def floor_bytes(model: Transformer, cache, B: int, experts_used: list[int]) -> int:
    """Bytes a step must move: the dense weights (the embedding's B rows), the weights of
    experts_used[i] experts in MoE block i (routed_experts: the distinct experts the step
    chose), and per attending layer and sequence b the key/value rows position lengths[b] sees
    (visible_rows: read from the cache, its own row written; keys, and values unless they are
    a view of them)."""
    cfg = model.cfg
    expert_params = sum(p.numel() for m in model.moe_layers().values() for p in m.experts.parameters())
    dense_params = sum(p.numel() for p in model.parameters()) - expert_params - model.embed.numel() + B * cfg.hidden
    per_expert = expert_params // (cfg.n_experts * len(model.moe_layers()))
    experts_read = sum(experts_used) * per_expert
    size = model.embed.element_size()
    row = math.prod(cache.k.shape[2:]) + (0 if cache.v_in_k else math.prod(cache.v.shape[2:]))  # one token of one layer (both stores)
    rows = sum(visible_rows(cfg, i, n) for i in (*cache.full_layers, *cache.window_layers) for n in cache.lengths)
    return size * (dense_params + experts_read + rows * row)


def run(name: str, cfg: TransformerConfig, device, dtype, bandwidth: float, smoke: bool) -> list[dict]:
    P = 8 if smoke else 1024
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    rows = []
    for B in (1, 4) if smoke else (1, 8, 32):
        ids = torch.randint(0, cfg.vocab_size, (B, P + 1), device=device)
        cache = model.kv_cache(P + 1, batch=B)
        with torch.no_grad():
            for b in range(B):
                model.decode(ids[b, :P], cache, seqs=b)
        cu = torch.arange(0, B * (P + 1) + 1, P + 1, dtype=torch.int32, device=device)

        def batched():
            cache.lengths = [P] * B
            return model.decode(ids[:, P:], cache)[:, -1]

        def one_at_a_time():
            cache.lengths = [P] * B
            return torch.stack([model.decode(ids[b, P:], cache, seqs=b)[-1] for b in range(B)])

        def no_cache():
            with torch.no_grad():
                return model.logits(ids.reshape(-1), cu)[P::P + 1]

        impls = {"fmoe batched": batched, "one at a time": one_at_a_time, "no cache": no_cache}
        want = batched().float()
        for impl, fn in impls.items():
            got = fn().float()
            if not torch.allclose(got, want, rtol=2e-2 if dtype != torch.float32 else 1e-4, atol=2e-2 if dtype != torch.float32 else 1e-4):
                sys.exit(f"{name}, B={B}: {impl}'s logits differ from fmoe batched's by {float((got - want).abs().max()):.3g}")
            ms = bench(fn, device, label=f"{name}-B{B}-{impl}")
            rows.append({"model": name, "B": B, "impl": impl, "ms": ms, "tokens_per_s": B / ms * 1e3, "P": P})
        experts_used = routed_experts(model, batched)  # the step's own choice (the same tokens every call)
        cache.lengths = [P] * B
        rows[-3]["floor_fraction"] = floor_fraction(floor_bytes(model, cache, B, experts_used), bandwidth, rows[-3]["ms"])
        rows[-3]["experts_read"] = sum(experts_used)
        rows[-3]["cache_mib"] = cache.nbytes / 2**20
        for row in rows[-2:]:
            row["speedup"] = row["ms"] / rows[-3]["ms"]
        print(f"{name}, B={B}: the three give the same logits; fmoe batched {rows[-3]['ms']:.3g} ms per step", flush=True)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    rows = []
    for name, cfg in configs(args.smoke).items():
        rows += run(name, cfg, device, dtype, bandwidth, args.smoke)
    finish(args, device, bandwidth, "bench_decode", [(rows, COLUMNS)])


if __name__ == "__main__":
    main()
