"""Activation-checkpointing benchmark: what each `ac` mode keeps for the backward, and its cost.

    .venv/bin/python benchmarks/bench_activation_memory.py            # CUDA, bf16, bench_train_step's model
    .venv/bin/python benchmarks/bench_activation_memory.py --smoke    # CPU, tiny model

For each TransformerConfig.ac mode (none, full, attention, experts) on the same model and
packed micro-batch (bench_train_step's: H=1024, 12 layers, 64 experts top-4, 1 MTP depth,
T=8192 on CUDA): the bytes autograd keeps for the backward of one forward with its losses,
counted with saved_tensors_hooks (fmoe.train.metrics.SavedTensors: each storage once,
parameters excluded; the inputs of recomputed regions are counted, their insides are not),
per token and as a reduction factor over `none`; the forward + backward time and its ratio
to `none` (the price of recomputing); and on CUDA the peak memory of a forward + backward
above what the model and its gradients hold (torch.cuda.max_memory_allocated).
--smoke: float32 on CPU, a tiny model (the counts are exact there too; the times are not
performance numbers). CSV: OUT/bench_activation_memory.csv.
"""

import dataclasses

from _common import bench, finish, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
from bench_train_step import GPU, SMOKE, make_batch

import torch  # noqa: E402
import fmoe.ops as ops  # noqa: E402
from fmoe.model import AC_MODES, Transformer  # noqa: E402
from fmoe.train.metrics import SavedTensors  # noqa: E402

COLUMNS = ["impl", "saved_MiB", "bytes/token", "reduction", "ms", "time_vs_none", "peak_GiB"]


def forward_loss(model, batch, ctx):
    losses, stats = model(batch, ctx)
    loss = (losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / losses["lm_tokens"]
    for layer in stats.values():
        loss = loss + 1e-3 * ops.z_loss(layer["router_logits"])
    return loss


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__.splitlines()[0])
    base = dataclasses.replace(SMOKE, impl="auto") if args.smoke else GPU
    T = 256 if args.smoke else 8192
    batch = make_batch(base, T, device)
    rows = []
    for mode in AC_MODES:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(base, ac=mode)).to(device=device, dtype=dtype)
        ctx = model.context(batch)
        with SavedTensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
            loss = forward_loss(model, batch, ctx)
        loss.backward()  # allocates the gradients before the peak is measured

        def fwd_bwd():
            forward_loss(model, batch, ctx).backward()

        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - held) / 2**30
        ms = bench(fwd_bwd, device, cpu_warmup=0, cpu_repeats=3)
        rows.append({"impl": mode, "saved_MiB": saved.nbytes / 2**20, "bytes/token": saved.nbytes / T, "ms": ms,
                     "peak_GiB": peak, "tensors": saved.count, "tokens": T})
        print(f"{mode}: {saved.nbytes / 2**20:.2f} MiB kept for backward ({saved.nbytes / T:.0f} B/token), {ms:.1f} ms", flush=True)
        del model, ctx, loss
    for row in rows:
        row["reduction"] = rows[0]["saved_MiB"] / row["saved_MiB"]
        row["time_vs_none"] = row["ms"] / rows[0]["ms"]
    finish(args, device, bandwidth, "bench_activation_memory", [(rows, COLUMNS)], dtype=str(dtype))


if __name__ == "__main__":
    main()
