"""Activation memory benchmark: what each `ac` mode keeps for the backward, its cost, and
what tensor parallelism with sequence parallelism (tp = 2) leaves on each rank.

    .venv/bin/python benchmarks/bench_activation_memory.py            # CUDA, bf16, bench_train_step's small model
    .venv/bin/python benchmarks/bench_activation_memory.py --smoke    # CPU, tiny model

For each TransformerConfig.ac mode (none, full, attention, experts) on the same model and
packed micro-batch (bench_train_step's small one: H=1024, 12 layers, 64 experts top-4, 1 MTP depth,
T=8192 on CUDA): the bytes autograd keeps for the backward of one forward with its losses,
counted with saved_tensors_hooks (fmoe.train.metrics.SavedTensors: each storage once,
parameters excluded; the inputs of recomputed regions are counted, their insides are not),
per token and as a reduction factor over `none`; the forward + backward time and its ratio
to `none` (the price of recomputing); and on CUDA the peak memory of a forward + backward
above what the model and its gradients hold (torch.cuda.max_memory_allocated).

Then the same modes with tp = 2 (rows "tp2 <mode>"): two processes spawned by this script
(gloo on CPU for --smoke; nccl on two GPUs, skipped with a message where there are fewer),
the model tensor parallel with sequence parallelism (fmoe.parallel.tensor_parallel_plan
through parallelize_module; no FSDP, so that the parameters are excluded exactly). Bytes
per token are per rank (the larger rank's) over the micro-batch's T tokens, `vs_tp1` the
ratio to the same mode at tp = 1: what each rank keeps compared to one process.
--smoke: float32 on CPU, a tiny model (the counts are exact there too; the times are not
performance numbers). CSV: OUT/bench_activation_memory.csv.
"""

import dataclasses
import os
import tempfile

from _common import bench, cuda_peak_bytes, finish, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
from bench_train_step import SMALL, SMOKE, make_batch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import fmoe.ops as ops  # noqa: E402
from fmoe.model import AC_MODES, Transformer  # noqa: E402
from fmoe.ops.backend import local_tensor  # noqa: E402
from fmoe.train.metrics import SavedTensors  # noqa: E402

COLUMNS = ["impl", "tp", "saved_MiB", "bytes/token", "reduction", "vs_tp1", "ms", "time_vs_none", "peak_GiB"]
TP = 2


def forward_loss(model, batch, ctx, z_share=ops.z_loss):
    losses, stats = model(batch, ctx)
    loss = (losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / losses["lm_tokens"]
    for layer in stats.values():
        loss = loss + 1e-3 * z_share(layer["router_logits"])
    return loss


def measure(model, batch, ctx, device, T, mode, tp, z_share=ops.z_loss) -> dict:
    """One row: the bytes kept for the backward (parameters and buffers excluded: their
    local shards under tp), the forward + backward time, the CUDA peak above what is held."""
    exclude = [*(local_tensor(p) for p in model.parameters()), *model.buffers()]
    with SavedTensors(exclude=exclude) as saved:
        loss = forward_loss(model, batch, ctx, z_share)
    loss.backward()  # allocates the gradients before the peak is measured

    def fwd_bwd():
        forward_loss(model, batch, ctx, z_share).backward()

    peak = cuda_peak_bytes(fwd_bwd, device)
    peak = None if peak is None else peak / 2**30
    ms = bench(fwd_bwd, device, cpu_warmup=0, cpu_repeats=3, label=f"{mode}-tp{tp}")
    return {"impl": mode if tp == 1 else f"tp{tp} {mode}", "tp": tp, "saved_MiB": saved.nbytes / 2**20,
            "bytes/token": saved.nbytes / T, "ms": ms, "peak_GiB": peak, "tensors": saved.count, "tokens": T}


def _tp_worker(rank, world, root, cfg, T, dtype, device_type):
    """One rank of the tp section: every ac mode, tensor + sequence parallel over `world`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fmoe.parallel import leave_ranks, tensor_parallel_plan, z_loss_split

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    mesh = init_device_mesh(device_type, (world,))
    batch = make_batch(cfg, T, device)
    rows = []
    for mode in AC_MODES:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(cfg, ac=mode)).to(device=device, dtype=dtype)
        parallelize_module(model, mesh, tensor_parallel_plan(model))
        # the MoE stats cover this rank's T/tp tokens: its share of the z-loss
        rows.append(measure(model, batch, model.context(batch), device, T, mode, world, lambda logits: z_loss_split(logits, n_tokens=T)))
        del model
    torch.save(rows, f"{root}/rows{rank}.pt")
    leave_ranks()


def tp_rows(cfg, T, dtype, device) -> list:
    """The tp section's rows, each the larger of the ranks' bytes and times; [] (with a
    message) without two GPUs on CUDA."""
    if device.type == "cuda" and torch.cuda.device_count() < TP:
        print(f"tp{TP} rows skipped: they need {TP} GPUs, found {torch.cuda.device_count()} (--smoke counts them on CPU)")
        return []
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(_tp_worker, args=(TP, root, cfg, T, dtype, device.type), nprocs=TP, start_method="spawn")
        per_rank = [torch.load(f"{root}/rows{r}.pt") for r in range(TP)]
    rows = []
    for ranks in zip(*per_rank):
        row = max(ranks, key=lambda r: r["saved_MiB"])
        row["ms"] = max(r["ms"] for r in ranks)
        rows.append(row)
        print(f"{row['impl']}: {row['saved_MiB']:.2f} MiB kept for backward per rank ({row['bytes/token']:.0f} B/token), {row['ms']:.1f} ms", flush=True)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    # n_kv_heads a multiple of tp, so that the same model runs at tp = 1 and 2
    base = dataclasses.replace(SMOKE, impl="auto", n_kv_heads=TP) if args.smoke else SMALL
    T = 256 if args.smoke else 8192
    batch = make_batch(base, T, device)
    rows = []
    for mode in AC_MODES:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(base, ac=mode)).to(device=device, dtype=dtype)
        row = measure(model, batch, model.context(batch), device, T, mode, 1)
        rows.append(row)
        print(f"{mode}: {row['saved_MiB']:.2f} MiB kept for backward ({row['bytes/token']:.0f} B/token), {row['ms']:.1f} ms", flush=True)
        del model
    rows += tp_rows(base, T, dtype, device)
    tp1 = {row["impl"]: row for row in rows if row["tp"] == 1}
    for row in rows:
        same_mode = tp1[row["impl"].split()[-1]]
        row["reduction"] = rows[0]["saved_MiB"] / row["saved_MiB"]
        row["vs_tp1"] = row["saved_MiB"] / same_mode["saved_MiB"]
        row["time_vs_none"] = row["ms"] / rows[0]["ms"]
    finish(args, device, bandwidth, "bench_activation_memory", [(rows, COLUMNS)], dtype=str(dtype))


if __name__ == "__main__":
    main()
