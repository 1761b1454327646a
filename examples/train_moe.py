"""Train a small MoE language model: the explicit loop, meant to be copied and changed.

    python examples/train_moe.py                                  # CPU: stdlib corpus, minutes
    python examples/train_moe.py --steps=400 --out_dir=out/long   # any knob as --name=value
    python examples/train_moe.py --resume=True --steps=600        # continue from out_dir
    python examples/train_moe.py --data=my_texts/                 # a directory of text files
    python examples/train_moe.py --data=tokens.bin --data_dtype=uint16 --separator=50256 --vocab_size=50304

Several processes (gloo on CPU, nccl on GPUs), one per device; the parallel knobs below:
    torchrun --nproc-per-node 2 examples/train_moe.py                   # FSDP2 over 2 ranks
    torchrun --nproc-per-node 4 examples/train_moe.py --ep=4            # experts over 4 ranks
    torchrun --nproc-per-node 4 examples/train_moe.py --tp=2 --ep=2     # TP x EP (MoE folding)
    torchrun --nproc-per-node 8 examples/train_moe.py --dp_replicate=2 --tp=2 --ep=4 --etp=1
    torchrun --nproc-per-node 4 examples/train_moe.py --optimizer=muon  # layer-wise distributed Muon
The tokens of an optimizer step do not depend on the number of processes: every rank reads
the step's micro-batches and the data-parallel ranks take turns, so the same command with
other parallel knobs trains the same model and logs the same losses (up to float rounding).

Everything a step does is below, in order: the batch-size schedule picks the micro-batches,
each runs forward (LM loss + MTP losses as sums) plus the balancing losses, backward; the
loss is the sum over valid tokens divided by the step's valid-token count; then clip, the
optimizer step, the aux-loss-free expert-bias update from the step's actual counts, metrics,
and checkpoints (a complete one at the end of every run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fmoe.ops as ops
import fmoe.parallel as parallel
from fmoe.optim import AdamW, batch_size_at, build_optimizers, clip_grad_norm, lr_at, split_param_groups
from fmoe.train import checkpoint, metrics
from fmoe.train.data import BYTE_VOCAB_SIZE, Sampler, load_corpus
from fmoe.model import Transformer, TransformerConfig


# ------------------------------------------------------------------------------ knobs
@dataclass
class Config:
    # data
    data: str = ""                  # "" = the embedded corpus (this Python's stdlib sources, bytes)
    data_dtype: str = ""            # token files: uint16 | uint32 ("" = from the file suffix)
    separator: int = -1             # token files: the document separator id
    vocab_size: int = BYTE_VOCAB_SIZE
    val_percent: int = 5            # validation documents, split by file name
    tokens_per_micro_batch: int = 1024
    batch_schedule: str = "0:2 2M:4"  # micro-batches per step, by tokens consumed
    # model
    hidden: int = 128
    n_layers: int = 4
    n_dense: int = 1
    ffn_dense: int = 384
    n_experts: int = 8
    k: int = 2
    ffn_expert: int = 96
    n_shared: int = 1
    score: str = "sigmoid"
    expert_bias: bool = True
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    mtp_depth: int = 1
    # losses
    mtp_lambda: float = 0.1         # (lambda / D) * sum_d mean CE_d
    seq_aux_coeff: float = 1e-4     # sequence-level balancing loss
    aux_coeff: float = 0.0          # switch loss over the micro-batch
    z_coeff: float = 1e-3           # router z-loss
    bias_rate: float = 1e-3         # aux-loss-free expert-bias step (sigmoid routing)
    # optimizer and schedule
    optimizer: str = "adamw"        # adamw | muon (Muon for matrices, AdamW for the rest)
    ns_dtype: str = "bfloat16"      # Muon's Newton-Schulz dtype (float32: bit-comparable runs)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    lr_style: str = "cosine"
    weight_decay: float = 0.1
    clip: float = 1.0
    # run
    steps: int = 250
    stop_at: int = 0                # stop after this step (a time-limited job); 0: run to --steps
    seed: int = 0
    out_dir: str = "out/train_moe"
    resume: bool = False
    ckpt_every: int = 100
    keep_last: int = 2              # retention: the newest checkpoints kept...
    keep_every: int = 0             # ...plus every keep_every-th step (0: none)
    eval_every: int = 50
    eval_batches: int = 4
    device: str = "auto"            # auto | cpu | cuda
    compile: bool = False
    # parallelism (under torchrun; fmoe.parallel): world = dp_replicate * dp_shard * cp * tp
    dp_replicate: int = 1           # HSDP replicas
    dp_shard: int = -1              # FSDP2 shards (-1: the rest of the world)
    tp: int = 1                     # tensor parallel: attention heads, dense and shared FFN columns
    ep: int = 1                     # expert parallel, borrowing ranks from dp_shard x tp
    etp: int = 1                    # expert tensor parallel (the experts' FFN columns)


def parse_args(argv: list[str]) -> Config:
    """--name=value overrides of Config; unknown names and bad values exit with a message."""
    cfg, fields = Config(), {f.name: f for f in dataclasses.fields(Config)}
    for arg in argv:
        name, sep, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not sep or name not in fields:
            sys.exit(f"unknown argument {arg!r}; knobs: " + " ".join(f"--{n}=" for n in fields))
        kind = type(getattr(cfg, name))
        try:
            parsed = {"True": True, "False": False}[value] if kind is bool else kind(value)
        except (KeyError, ValueError):
            sys.exit(f"--{name}: expected a {kind.__name__}, got {value!r}")
        setattr(cfg, name, parsed)
    return cfg


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    # ------------------------------------------------------------------------ setup
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else (cfg.device if cfg.device != "auto" else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = dict(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, ep=cfg.ep, etp=cfg.etp)
    try:
        parallel.plan_sizes(world, **sizes, has_experts=cfg.n_layers > cfg.n_dense)
    except ValueError as err:
        sys.exit(f"parallel knobs (--dp_replicate, --dp_shard, --tp, --ep, --etp) for {world} process(es): {err}")
    meshes, rank, dp_rank, dp = None, 0, 0, 1
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        meshes = parallel.build_meshes(**sizes, has_experts=cfg.n_layers > cfg.n_dense, device_type=device.type)
        rank, dp_rank, dp = dist.get_rank(), meshes.batch.get_local_rank("dp"), meshes.dp
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        corpus = load_corpus(cfg.data or None, separator=cfg.separator if cfg.separator >= 0 else None,
                             vocab_size=cfg.vocab_size if cfg.data else None, dtype=cfg.data_dtype or None)
    except (OSError, ValueError) as err:
        sys.exit(f"data: {err}")
    train_set, val_set = corpus.split(cfg.val_percent)
    sampler = Sampler(train_set, cfg.tokens_per_micro_batch, seed=cfg.seed, mtp_depth=cfg.mtp_depth)
    val_batches = val_set.validation_batches(cfg.tokens_per_micro_batch, cfg.eval_batches, mtp_depth=cfg.mtp_depth)

    # the model knobs above share their names with TransformerConfig's fields
    model_knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(cfg, f.name)}
    model_cfg = TransformerConfig(**{**model_knobs, "vocab_size": corpus.vocab_size})
    if meshes is None:
        model = Transformer(model_cfg).to(device=device, dtype=dtype)  # router and expert biases stay float32
    else:  # every rank builds the same model (same seed) and keeps its shards of it
        model = Transformer(model_cfg).to(device=device)  # float32 master weights, FSDP2 computes in dtype
        try:
            parallel.parallelize(model, meshes, param_dtype=dtype if dtype != torch.float32 else None, reduce_dtype=torch.float32)
        except ValueError as err:
            sys.exit(f"parallel knobs: {err}")
    forward = torch.compile(model) if cfg.compile else model
    if cfg.ns_dtype not in ("bfloat16", "float32"):
        sys.exit(f"--ns_dtype: expected bfloat16 or float32, got {cfg.ns_dtype!r}")
    ns_dtype = getattr(torch, cfg.ns_dtype)
    if cfg.optimizer == "adamw":
        optimizers = [AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)]
    elif cfg.optimizer == "muon" and meshes is None:
        optimizers = build_optimizers(model, muon_lr=cfg.lr, adamw_lr=cfg.lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
    elif cfg.optimizer == "muon":  # each matrix orthogonalised on one rank, the result redistributed
        muon_groups, adamw_groups = split_param_groups(model, muon_lr=cfg.lr, adamw_lr=cfg.lr, weight_decay=cfg.weight_decay)
        optimizers = [parallel.DistributedMuon(muon_groups, lr=cfg.lr, ns_dtype=ns_dtype, model=model), torch.optim.AdamW(adamw_groups, lr=cfg.lr)]
    else:
        sys.exit(f"--optimizer: expected adamw or muon, got {cfg.optimizer!r}")
    for opt in optimizers:  # the schedule scales each group's own lr
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]

    step, tokens_seen = 0, 0
    if cfg.resume and (path := checkpoint.latest(cfg.out_dir)):
        extra = checkpoint.load(path, model=model, optimizers=optimizers)
        step, tokens_seen = extra["step"], extra["tokens_seen"]
        sampler.load_state_dict(extra["sampler"])
        checkpoint.set_rng_state(extra["rng"])
        print(f"resumed from {path} at step {step}")
    # records are logged for completed steps step+1, step+2, ...: keep the ones up to step
    logger = metrics.MetricsLogger(cfg.out_dir, rank=rank, total_steps=cfg.steps, start_step=step + 1)
    peak = metrics.peak_flops(device)

    def mtp_inputs(batch):
        """The batch's [D, T] MTP rows as the model's per-depth targets."""
        keys = ("input_ids", "labels", "loss_mask", "positions")
        return [{key: batch[f"mtp_{key}"][d] for key in keys} for d in range(cfg.mtp_depth)]

    def run_micro_batch(batch, valid_tokens, n_micro):
        """Forward of one micro-batch; returns its share of the step's loss and its stats."""
        losses, stats = forward(batch["input_ids"], batch["labels"], batch["loss_mask"], batch["cu_seqlens"], batch["positions"], mtp_inputs(batch))
        loss = losses["lm_sum"] / valid_tokens["lm"]
        for d in range(1, cfg.mtp_depth + 1):
            loss = loss + cfg.mtp_lambda / cfg.mtp_depth * losses[f"mtp_{d}_sum"] / valid_tokens[d]
        balancing = {"seq_aux_loss": 0.0, "aux_loss": 0.0, "z_loss": 0.0}  # averaged over layers and micro-batches
        for layer in stats.values():
            scale = 1.0 / (len(stats.keys()) * n_micro)
            terms = {
                "seq_aux_loss": (cfg.seq_aux_coeff, lambda: ops.seq_load_balancing_loss(layer["aux_scores"], layer["aux_experts"], batch["cu_seqlens"], k=cfg.k)),
                "aux_loss": (cfg.aux_coeff, lambda: ops.load_balancing_loss(layer["aux_scores"], layer["aux_counts"], k=cfg.k, n_tokens=layer["aux_scores"].shape[0])),
                "z_loss": (cfg.z_coeff, lambda: ops.z_loss(layer["router_logits"])),
            }
            for name, (coeff, term) in terms.items():
                if coeff:
                    value = term() * scale
                    loss = loss + coeff * value
                    balancing[name] += float(value.detach())
        return loss, losses, stats, balancing

    @torch.no_grad()
    def evaluate():
        model.eval()
        total, count = 0.0, 0
        for batch in val_batches:
            b = batch.to(device)
            losses, _ = model(b["input_ids"], b["labels"], b["loss_mask"], b["cu_seqlens"], b["positions"], mtp_inputs(b))
            total, count = total + float(losses["lm_sum"]), count + int(losses["lm_tokens"])
        model.train()
        return total / max(count, 1)

    # the schedule gives a factor on each group's lr; checked once here, with a message
    schedule = dict(max_lr=1.0, total=cfg.steps, warmup=cfg.warmup, min_lr=cfg.min_lr / cfg.lr, style=cfg.lr_style)
    try:
        lr_at(0, **schedule)
        batch_size_at(0, cfg.batch_schedule)
    except ValueError as err:
        sys.exit(f"schedule knobs (--steps, --warmup, --lr, --min_lr, --lr_style, --batch_schedule): {err}")

    # ------------------------------------------------------------------------ the loop
    last = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
    while step < last:
        t0 = time.perf_counter()
        lr_scale = lr_at(step, **schedule)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_scale
        n_micro = batch_size_at(tokens_seen, cfg.batch_schedule)
        batches = [sampler.next_batch().to(device) for _ in range(n_micro)]
        # the step's valid-token counts: the loss is a sum over tokens divided by these
        valid = {"lm": sum(int(b["loss_mask"].sum()) for b in batches)}
        for d in range(1, cfg.mtp_depth + 1):
            valid[d] = max(1, sum(int(b["mtp_loss_mask"][d - 1].sum()) for b in batches))
        # data-parallel ranks take turns over the micro-batches; a rank short of one runs a
        # masked copy with zero loss, so that every rank joins every collective (FSDP, EP)
        mine = batches[dp_rank::dp]
        padding = -(-n_micro // dp) - len(mine)
        counts = {}
        # every key from the start: a rank with only padding sums the same keys (one collective)
        record = dict.fromkeys(["lm_loss", *(f"mtp_{d}_loss" for d in range(1, cfg.mtp_depth + 1)), "seq_aux_loss", "aux_loss", "z_loss"], 0.0)
        for i, batch in enumerate(mine + [batches[0]] * padding):
            loss, losses, stats, balancing = run_micro_batch(batch, valid, n_micro)
            if i >= len(mine):
                (loss * 0.0).backward()
                continue
            loss.backward()
            for name, value in balancing.items():
                record[name] += value
            record["lm_loss"] += float(losses["lm_sum"].detach()) / valid["lm"]
            for d in range(1, cfg.mtp_depth + 1):
                record[f"mtp_{d}_loss"] += float(losses[f"mtp_{d}_sum"].detach()) / valid[d]
            for name, layer in stats.items():
                counts[name] = counts.get(name, 0) + layer["tokens_per_expert"]
        moe_names = list(model.moe_layers())
        if meshes is None:
            grad_norm = clip_grad_norm(model.parameters(), cfg.clip)
        else:  # sums over the data ranks, counts over every rank, one collective each
            record = parallel.all_reduce_sums(record, meshes.group("dp"))
            counts = parallel.all_reduce_counts(counts, dist.group.WORLD, names=moe_names, n_experts=cfg.n_experts)
            grad_norm = parallel.clip_grad_norm(model.parameters(), cfg.clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        # aux-loss-free balancing: each MoE layer's bias moves by the step's actual counts
        if cfg.expert_bias and cfg.bias_rate:
            for name, moe in model.moe_layers().items():
                moe.expert_bias.copy_(ops.update_expert_bias(moe.expert_bias, counts[name], cfg.bias_rate))

        step += 1
        step_tokens = n_micro * cfg.tokens_per_micro_batch
        tokens_seen += step_tokens
        seconds = time.perf_counter() - t0
        # attention FLOPs from the step's own documents (SPEC 8), not a full-length causal row
        n_avg_keys = sum(metrics.mean_attended_keys(b["cu_seqlens"]) for b in batches) / n_micro
        flops_per_token = metrics.model_flops_per_token(model_cfg, n_avg_keys=n_avg_keys)
        record.update(
            step=step, loss=record["lm_loss"], lr=cfg.lr * lr_scale, batch_size=n_micro, tokens=tokens_seen,
            grad_norm=float(grad_norm), tokens_per_s=step_tokens / seconds,
            flops_per_token=flops_per_token, mfu=metrics.mfu(step_tokens / seconds / world, flops_per_token, peak),
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        )
        # expert load per MoE layer (trunk layers, then MTP): counts, max/mean, CV, dropped
        record.update(metrics.layer_loads(torch.stack([counts[n] for n in moe_names]), slots=step_tokens * cfg.k), moe_layers=moe_names)
        if step % cfg.eval_every == 0 or step == last:
            record["val_loss"] = evaluate()
        logger.log(step, record)
        if step % cfg.ckpt_every == 0 or step == last:
            for opt in optimizers:  # a distributed Muon's last update may still be in flight
                getattr(opt, "wait", lambda: None)()
            # every rank holds the same extra (same sampler, same seeds): resumable on any mesh
            extra = {"step": step, "tokens_seen": tokens_seen, "sampler": sampler.state_dict(), "rng": checkpoint.rng_state()}
            checkpoint.save(cfg.out_dir, step, model=model, optimizers=optimizers, extra=extra)
            if rank == 0:
                checkpoint.prune(cfg.out_dir, keep_last=cfg.keep_last, keep_every=cfg.keep_every or None)
    checkpoint.wait(cfg.out_dir)
    if rank == 0 and math.isfinite(record.get("val_loss", float("nan"))):
        print(f"done: step {step}, validation loss {record['val_loss']:.4f} (bits per byte {record['val_loss'] / math.log(2):.3f})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
