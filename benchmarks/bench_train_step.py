"""Train-step benchmark: tokens/s and MFU of the reference MoE transformer.

    .venv/bin/python benchmarks/bench_train_step.py                  # CUDA, bf16, the large model
    .venv/bin/python benchmarks/bench_train_step.py --model small    # CUDA, the first GPU run's model
    .venv/bin/python benchmarks/bench_train_step.py --fp8            # fp8 GEMMs (--model.fp8) against bf16
    .venv/bin/python benchmarks/bench_train_step.py --model dsa      # DeepSeek-V3.2's attention on the large model
    .venv/bin/python benchmarks/bench_train_step.py --model falcon_h1   # Falcon-H1's parallel hybrid blocks on the large model
    .venv/bin/python benchmarks/bench_train_step.py --model jamba       # Jamba's blocks (Mamba-1 mixers, the scan kernels) on the large model
    .venv/bin/python benchmarks/bench_train_step.py --smoke          # CPU + Triton interpreter, tiny model
    .venv/bin/python benchmarks/bench_train_step.py --impls "fmoe compiled"   # only the implementations named

Models (fmoe.model.Transformer, top-k sigmoid routing with an expert bias, vocab 32768, 1 MTP
depth):
    large  H=2048, 8 layers (1 dense, FFN 8192), 64 experts of F=1024, top-6 and 2 shared
           experts, 16 query / 4 kv heads of 128: 3.6B parameters, 0.69B active per token
           (embedding and head counted). Parameters, gradients and bf16 AdamW states take
           27 GiB, and the forward keeps about 23 GiB for the backward at 16384 tokens
           (counted on CPU with fmoe.train.metrics.SavedTensors through the torch ops): about
           two thirds of an H100, the GPU filled without risking its last GiB.
    small  H=1024, 12 layers (1 dense, FFN 4096), 64 experts of F=512, top-4 and 1 shared
           expert, 16 query / 4 kv heads of 64: the model of the first H100 run
           (benchmarks/RESULTS.md), whose GEMMs are small for the GPU.
    dsa    the large model with DeepSeek-V3.2's attention: multi-latent attention (q latent
           768, kv latent 512, 16 heads of 128 + 64 rotated, values of 128) and its sparse
           attention (2048 keys per query, an indexer of 64 heads of 128 trained by its loss):
           the sparse kernels (fmoe.ops.sparse_attention) in a whole step; its FLOPs count the
           kept keys and the indexer (n_avg_index_keys). The reference's dense attention
           (impl="torch") may run out of memory at 16384 tokens (its row is then left empty).
    falcon_h1  the large model with Falcon-H1's parallel hybrid blocks: in every block a Mamba-2
           mixer (32 heads of 64, C and B in 1 group of a state of 128, 4 taps; its output
           gated, without a norm, as the released Falcon-H1 models) beside the attention,
           their outputs summed (parallel_hybrid): the SSD kernels (fmoe.ops.gated_linear_attention)
           in a whole step; its FLOPs count both mixers.
    jamba  the large model with Jamba's blocks: Mamba-1 mixers (4096 channels, a state of 16
           each, dt of rank 128, dt, B and C RMS-normed) in 7 of the 8 blocks, NoPE attention in
           block 4, the MoE in every second block, a dense MLP in the others: the selective
           scan's kernels (fmoe.ops.selective_scan) in a whole step.
One step: forward and backward of a packed micro-batch of 16384 tokens (documents of random
lengths), the balancing losses, clipping and an AdamW step (bf16 states), the clip's factor
taken by the AdamW kernel (step(grad_factor=...)) as examples/train_moe.py does: on the
first H100 run of the large model, the clip's own pass over the bf16 gradients took 15.2
of the step's 186 ms of GPU time.

Implementations:
    fmoe compiled   impl="auto" (fused Triton ops, torch._grouped_mm, FlexAttention), the
                    model under torch.compile
    fmoe eager      the same without torch.compile
    reference ops   impl="torch" for every op (the plain-torch references), eager
With --fp8 instead: "fmoe compiled fp8" (TransformerConfig.fp8: the attention, MLP and
expert GEMMs in fp8, fmoe.ops.fp8_matmul) and "fmoe compiled fp8 fast accum" (also
fp8_fast_accum: the experts' grouped GEMMs with the tensor cores' own accumulator) beside
"fmoe compiled" (bf16); MFU still counts the model's FLOPs over the bf16 matmul rate.

Columns: median ms per step, tokens/s, TFLOP/s (SPEC 8 FLOPs per token of this batch's
documents, times tokens, over the time), MFU as the fraction of the bf16 matmul rate measured
in the same run and MFU_datasheet over the GPU's datasheet dense bf16 peak
(fmoe.train.metrics.peak_flops, what examples/train_moe.py logs as mfu; empty off CUDA or
for a GPU it does not know), the peak memory of one untimed step (the allocator's peak
while it ran: weights, gradients, optimizer states, activations; not the timing's cache
flush), and the host syncs of one step: `syncs/step` for the whole
step (forward, losses, backward, clip, optimizer) and `fwd+bwd reads` for the model's
forward and backward alone. On CUDA syncs/step counts what torch.cuda.set_sync_debug_mode
reports plus the host reads of tensor values; on CPU (--smoke) it counts the host reads
(.item, .tolist, .cpu, float/int/bool of a tensor: fmoe.train.metrics.HostReads), the
stalls the same code makes on a GPU. The eager model's fwd+bwd reads are 0 (a test keeps
them there); torch.compile's graphs are not instrumented, so their eager remainder is
counted. Goal on an H100: MFU of at least 40% for "fmoe compiled" (the measured rate's:
MFU; MFU_datasheet beside it), zero syncs per step.
--smoke: float32 on CPU, the interpreter, a tiny model (SMOKE below, H=16, a batch of 32
tokens in two documents); torch.compile with the aot_eager backend (the CPU inductor build
takes minutes). CSV: OUT/bench_train_step.csv.
"""

import dataclasses
import sys

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    finish,
    matmul_rate,
    select,
    start,
)

import torch  # noqa: E402
import fmoe.ops as ops  # noqa: E402
from fmoe.model import Transformer, TransformerConfig  # noqa: E402
from fmoe.optim import AdamW, clip_factor, grad_norm  # noqa: E402
from fmoe.train import metrics  # noqa: E402
from fmoe.train.data import make_batch as pack  # noqa: E402

COLUMNS = ["impl", "ms", "tokens/s", "TFLOP/s", "MFU", "MFU_datasheet", "peak_GiB", "syncs/step", "fwd+bwd reads"]

SMALL = TransformerConfig(vocab_size=32768, hidden=1024, n_layers=12, n_dense=1, ffn_dense=4096, n_experts=64, k=4,
                        ffn_expert=512, n_shared=1, n_heads=16, n_kv_heads=4, head_dim=64, mtp_depth=1)
LARGE = TransformerConfig(vocab_size=32768, hidden=2048, n_layers=8, n_dense=1, ffn_dense=8192, n_experts=64, k=6,
                          ffn_expert=1024, n_shared=2, n_heads=16, n_kv_heads=4, head_dim=128, mtp_depth=1)
# the large model with DeepSeek-V3.2's attention: multi-latent (q latent 768, kv latent 512, heads of 128 + 64 rotated,
# values of 128) and its sparse attention (each query's 2048 keys, an indexer of 64 heads of 128, trained by its loss)
DSA = dataclasses.replace(LARGE, n_kv_heads=16, head_dim=192, rope_dim=64, q_rank=768, kv_rank=512, v_head_dim=128, index_topk=2048,
                          index_heads=64, index_head_dim=128)
# the large model with Falcon-H1's parallel hybrid blocks: a Mamba-2 mixer (2048 channels of x, 1 group of a state of 128)
# beside the attention in every block
FALCON_H1 = dataclasses.replace(LARGE, linear_layers=tuple(range(LARGE.n_layers)), linear_kind="mamba2", linear_k_heads=1, linear_v_heads=32,
                                linear_k_dim=128, linear_v_dim=64, linear_conv=4, linear_gate_norm="none", parallel_hybrid=True)
# the large model with Jamba's blocks: Mamba-1 mixers (4096 channels, a state of 16 each; dt, B and C normed) in 7 of the 8
# blocks, NoPE attention in block 4, the MoE in every second block (softmax top-k not renormalised), a dense MLP between
JAMBA = dataclasses.replace(LARGE, linear_layers=(0, 1, 2, 3, 5, 6, 7), linear_kind="mamba1", linear_k_heads=1, linear_v_heads=4096,
                            linear_k_dim=16, linear_v_dim=1, linear_conv=4, linear_dt_bc_norm="rms", nope_layers=(4,), moe_layers=(1, 3, 5, 7), score="softmax",
                            pre_softmax=True, expert_bias=False)
MODELS = {"large": LARGE, "small": SMALL, "dsa": DSA, "falcon_h1": FALCON_H1, "jamba": JAMBA}
SMOKE = TransformerConfig(vocab_size=64, hidden=16, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2,
                          ffn_expert=16, n_shared=1, n_heads=2, n_kv_heads=1, head_dim=16, mtp_depth=1)
SMOKE_DSA = dataclasses.replace(SMOKE, n_kv_heads=2, head_dim=12, rope_dim=4, q_rank=8, kv_rank=6, v_head_dim=5, index_topk=4, index_heads=2,
                                index_head_dim=6)
SMOKE_FALCON_H1 = dataclasses.replace(SMOKE, linear_layers=(0, 1), linear_kind="mamba2", linear_k_heads=1, linear_v_heads=2, linear_k_dim=8,
                                      linear_v_dim=8, linear_conv=4, linear_gate_norm="none", parallel_hybrid=True)
SMOKE_JAMBA = dataclasses.replace(SMOKE, linear_layers=(0,), linear_kind="mamba1", linear_k_heads=1, linear_v_heads=32, linear_k_dim=4,
                                  linear_v_dim=1, linear_conv=4, linear_dt_bc_norm="rms", nope_layers=(1,), score="softmax", pre_softmax=True,
                                  expert_bias=False)
SMOKES = {"dsa": SMOKE_DSA, "falcon_h1": SMOKE_FALCON_H1, "jamba": SMOKE_JAMBA}  # --smoke's tiny model of each --model (the others: SMOKE)


def make_batch(cfg: TransformerConfig, T: int, device):
    """A packed micro-batch of documents of random lengths (16 to T/4 tokens), on device."""
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < T:
        n = min(int(torch.randint(16, max(17, T // 4), (1,), generator=g)), T - total)
        lengths.append(n)
        total += n
    cu = torch.tensor([0] + lengths).cumsum(0)
    return pack(torch.randint(0, cfg.vocab_size, (T,), generator=g), cu, cfg.mtp_depth).to(device)


def make_step(model, forward, optimizer, batch, cfg):
    """One training step: forward (context built once), LM + MTP + balancing losses,
    backward, clip, optimizer step. Returns (step, fwd_bwd) callables."""
    valid = int(batch["loss_mask"].sum())  # read once here, as the loop does on the host batch
    ctx = model.context(batch)

    def fwd_bwd():
        losses, stats = forward(batch, ctx)
        loss = (losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / valid
        for layer in stats.values():
            loss = loss + 1e-4 * ops.seq_load_balancing_loss(layer["aux_scores"], layer["aux_experts"], batch["cu_seqlens"], k=cfg.k, check=False)
            loss = loss + 1e-3 * ops.z_loss(layer["router_logits"])
        loss.backward()

    def step():
        fwd_bwd()
        optimizer.step(grad_factor=clip_factor(grad_norm(model.parameters()), 1.0))
        optimizer.zero_grad(set_to_none=True)
    return step, fwd_bwd


def host_syncs(step, fwd_bwd, device) -> tuple[int, int]:
    """(syncs of one whole step, host reads of one forward + backward): see the docstring."""
    with metrics.HostReads(cuda=device.type == "cuda") as whole:
        step()
    with metrics.HostReads() as model_only:
        fwd_bwd()
    return whole.count + whole.cuda_syncs, model_only.count


def main() -> None:
    def add_arguments(parser):
        parser.add_argument("--model", choices=sorted(MODELS), default="large",
                            help="the model on CUDA (default: large; dsa, falcon_h1, jamba: with --smoke, a tiny model of the same kind)")
        parser.add_argument("--fp8", action="store_true", help="time the fp8 model (compiled, and with fp8_fast_accum) beside the compiled bf16 one")
        parser.add_argument("--impls", default=None,
                            help="comma-separated implementations to time, e.g. 'fmoe compiled' (default: all)")

    args, device, dtype, bandwidth = start(__doc__, add_arguments)
    if args.smoke:  # the tiny model of --model's kind, labelled "dsa (smoke)", ...; large and small share one: "smoke"
        base, label = SMOKES.get(args.model, SMOKE), f"{args.model} (smoke)" if args.model in SMOKES else "smoke"
    else:
        base, label = MODELS[args.model], args.model
    print(f"model: {label}", flush=True)
    T = 32 if args.smoke else 16384
    rate = matmul_rate(device, dtype, 256 if args.smoke else 8192)
    print(f"matmul rate: {rate / 1e12:.3g} TFLOP/s ({dtype})", flush=True)
    batch = make_batch(base, T, device)
    index_keys = metrics.mean_attended_keys(batch["cu_seqlens"], base.index_topk) if base.index_topk is not None else None
    block_keys = (metrics.mean_block_keys(batch["cu_seqlens"], base.index_topk_blocks, base.index_block_size)
                  if base.index_topk_blocks is not None else None)
    flops_per_token = metrics.model_flops_per_token(base, n_avg_keys=metrics.mean_attended_keys(batch["cu_seqlens"]), n_avg_index_keys=index_keys,
                                                    n_avg_block_keys=block_keys)
    compile_kw = dict(backend="aot_eager") if args.smoke else {}
    fast = "triton" if args.smoke else "auto"
    impls = {  # name: (impl, compiled, fp8, fp8_fast_accum)
        "fmoe compiled": (fast, True, False, False),
        "fmoe eager": (fast, False, False, False),
        "reference ops": ("torch", False, False, False),
    }
    if args.fp8:
        impls = {"fmoe compiled fp8": (fast, True, True, False), "fmoe compiled fp8 fast accum": (fast, True, True, True),
                 "fmoe compiled": impls["fmoe compiled"]}
    try:
        impls = {name: impls[name] for name in select(list(impls), args.impls, "--impls")}
    except ValueError as err:
        sys.exit(str(err))
    rows = []
    for name, (impl, compiled, fp8, fast_accum) in impls.items():
        torch.manual_seed(0)
        cfg = dataclasses.replace(base, impl=impl, fp8=fp8, fp8_fast_accum=fast_accum)
        model = Transformer(cfg).to(device=device, dtype=dtype)
        forward = torch.compile(model, **compile_kw) if compiled else model
        optimizer = AdamW(model.parameters(), lr=1e-4, state_dtype=torch.bfloat16)
        step, fwd_bwd = make_step(model, forward, optimizer, batch, cfg)
        try:
            step()  # warm-up: compiles, allocates optimizer state
            syncs, reads = host_syncs(step, fwd_bwd, device)
            optimizer.zero_grad(set_to_none=True)
            peak = None
            if device.type == "cuda":  # one untimed step alone: bench's cache flush (256 MiB) is not the step's
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**30
                optimizer.zero_grad(set_to_none=True)
            ms = bench(step, device, cpu_warmup=0, cpu_repeats=1, label=name)  # CPU: already warm; the interpreter is slow
        except torch.OutOfMemoryError:  # the reference's dense [T, T] attention at T = 16384
            print(f"{name}: out of memory (its row is left empty)", flush=True)
            rows.append({"impl": f"{name} (out of memory)"})
            del model, forward, step, fwd_bwd, optimizer
            torch.cuda.empty_cache()
            continue
        tflops = flops_per_token * T / (ms * 1e-3) / 1e12
        rows.append({
            "impl": name, "model": label, "ms": ms, "tokens/s": T / (ms * 1e-3), "TFLOP/s": tflops, "MFU": tflops * 1e12 / rate,
            "MFU_datasheet": metrics.mfu(T / (ms * 1e-3), flops_per_token, metrics.peak_flops(device)),
            "peak_GiB": peak,
            "syncs/step": syncs, "fwd+bwd reads": reads,
            "params": sum(p.numel() for p in model.parameters()), "flops_per_token": flops_per_token, "tokens": T,
        })
        print(f"{name}: {ms:.1f} ms, {syncs} host syncs per step, {reads} in forward + backward", flush=True)
        del model, forward, step, fwd_bwd, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finish(args, device, bandwidth, "bench_train_step", [(rows, COLUMNS)], matmul_TFLOPs=rate / 1e12)


if __name__ == "__main__":
    main()
