"""Measure a model's loss on data: an fmoe run (its out_dir, or one checkpoint) or a Hugging Face folder.

    python examples/evaluate.py out/train_moe                      # the run's validation batches: its logged val_loss
    python examples/evaluate.py out/train_moe --split=all --batches=0          # every whole micro-batch of its data
    python examples/evaluate.py path/to/qwen3_moe --data=data/web.u32 --batches=64 --tokens_per_micro_batch=4096 \\
        --device=cuda --dtype=bfloat16
    torchrun --nproc-per-node 4 examples/evaluate.py path/to/qwen3_moe --data=data/web.u32 --ep=4 --device=cuda --dtype=bfloat16

The model (generate.load_model): an fmoe run rebuilt from its config.json and newest
complete checkpoint, or an HF folder (fmoe.hf.from_pretrained). The data: --data, a blend
spec as the loop takes it (a directory of text files read as bytes, a token file, a .npy
file, or a weighted blend of them; fmoe.train.data.load_blend), by default the run's own
data with its separator and dtype; an HF folder needs --data, tokenized with its tokenizer
(python -m fmoe.train.prepare), and refuses ids beyond its vocabulary. --split: the
validation documents (val, by --val_percent, by default the run's), the training ones
(train) or all. --batches N micro-batches of --tokens_per_micro_batch tokens (the run's by
default), picked as the loop picks its validation batches (Blend.validation_batches: the
sources in their weights' proportions, each source's documents in stored order), so an
fmoe run's defaults reproduce the validation loss it logged; --batches=0 takes every whole
micro-batch of every source.

Under torchrun the model may be larger than one device: each rank builds it on the meta
device, parallelized over --tp, --ep, --etp and --cp (the rest of the world shards it with
FSDP2), and reads only its own shards' weights (load_sharded); the data-parallel ranks take
turns over the micro-batches and the sums are added over the ranks, so any mesh prints one
process's numbers (up to float rounding). Rank 0 prints. --keep_gathered: FSDP2 gathers the
weights once for all the micro-batches, not once per micro-batch (fmoe.parallel.gathered;
for a model whose unsharded weights, divided by tp and ep x etp, fit on each device).

Printed: per source and overall, the tokens counted (those with a next token in their
document), the mean loss, its perplexity and bits per byte (byte corpora) or per token;
the MTP depths' losses when the model has MTP modules. --json prints one JSON object
instead: {"loss", "tokens", "by_source": {name: {"loss", "tokens"}}, "mtp_losses"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import _device, add_parallel_knobs, is_hf_folder, load_model, load_sharded, start_ranks  # noqa: E402

import fmoe.parallel as parallel  # noqa: E402
from fmoe.model import Transformer  # noqa: E402


@torch.no_grad()
def evaluate(model: Transformer, batches: list, sources: list[str], *, device: torch.device, meshes=None) -> dict:
    """The loss sums of `batches` (make_batch TensorDicts), each from the source named in
    `sources`: {"loss": mean over every counted token, "tokens": their count, "by_source":
    {name: {"loss", "tokens"}} in first-seen order, "mtp_losses": [depth d's mean loss]}.
    One forward per micro-batch, eval mode; the sums stay on the device (float64) until one
    transfer at the end.

    meshes: the fmoe.parallel.Meshes a model was parallelized over (under torchrun; every
    rank calls this with the same batches). The data-parallel ranks take turns: batch i
    runs on dp rank i % dp, and a rank left without one in the last round runs batch 0
    again and counts nothing (every rank of a sharded model takes part in every forward);
    each cp rank runs its share of each batch (fmoe.parallel.split_batch); the tp ranks
    hold the same sums, and one of them counts. The sums are added over every rank in one
    collective, so each rank returns one process's result (up to float rounding)."""
    if len(batches) != len(sources) or not batches:
        raise ValueError(f"batches: expected one source name per batch and at least one batch, got {len(batches)} and {len(sources)}")
    model.eval()
    dp, dp_rank, cp, cp_rank, counts_here = 1, 0, 1, 0, True
    if meshes is not None:
        dp, dp_rank = meshes.dp, meshes.batch.get_local_rank("dp")
        cp, cp_rank = meshes.cp, meshes.batch.get_local_rank("cp")
        counts_here = meshes.batch.get_local_rank("tp") == 0
    names = list(dict.fromkeys(sources))
    mtp = [f"mtp_{d}_{kind}" for d in range(1, model.cfg.mtp_depth + 1) for kind in ("sum", "tokens")]  # named as in losses
    keys = [f"{kind}_{j}" for j in range(len(names)) for kind in ("sum", "tokens")] + mtp
    sums = dict.fromkeys(keys, torch.zeros((), dtype=torch.float64, device=device))
    for r in range(-(-len(batches) // dp)):
        i = r * dp + dp_rank
        host_batch = batches[i if i < len(batches) else 0]
        batch = (parallel.split_batch(host_batch, cp_rank, cp) if cp > 1 else host_batch).to(device)
        losses, _ = model(batch, model.context(batch))
        if i >= len(batches) or not counts_here:
            continue
        j = names.index(sources[i])
        for key, name in ((f"sum_{j}", "lm_sum"), (f"tokens_{j}", "lm_tokens"), *zip(mtp, mtp)):
            sums[key] = sums[key] + losses[name].double()
    if meshes is not None:
        sums = parallel.all_reduce_sums(sums, meshes.stage_mesh)
    host = dict(zip(sums, torch.stack(list(sums.values())).tolist()))  # one device -> host transfer
    by_source = {name: dict(loss=host[f"sum_{j}"] / max(host[f"tokens_{j}"], 1), tokens=round(host[f"tokens_{j}"]))
                 for j, name in enumerate(names)}
    tokens = sum(r["tokens"] for r in by_source.values())
    return dict(loss=sum(host[f"sum_{j}"] for j in range(len(names))) / max(tokens, 1), tokens=tokens, by_source=by_source,
                mtp_losses=[host[f"mtp_{d}_sum"] / max(host[f"mtp_{d}_tokens"], 1) for d in range(1, model.cfg.mtp_depth + 1)])


def data_batches(corpus, *, split: str, val_percent: int, tokens: int, n_batches: int, mtp_depth: int) -> tuple[list, list[str]]:
    """(micro-batches, their sources) of `corpus` (a Blend): the split's validation batches
    as the loop draws them (n_batches > 0), or every whole micro-batch of every source (0)."""
    if split not in ("val", "train", "all"):
        raise ValueError(f"--split: expected val, train or all, got {split!r}")
    if n_batches < 0:
        raise ValueError(f"--batches: expected >= 0 (0: every whole micro-batch), got {n_batches}")
    if split != "all":
        train, val = corpus.split(val_percent)
        corpus = val if split == "val" else train
    if n_batches:
        return corpus.validation_batches(tokens, n_batches, mtp_depth=mtp_depth), corpus.validation_sources(n_batches)
    batches, sources = [], []
    for name, dataset in zip(corpus.names, corpus.datasets):
        n = dataset.n_tokens // tokens
        if n:
            batches += dataset.validation_batches(tokens, n, mtp_depth=mtp_depth)
            sources += [name] * n
    if not batches:
        raise ValueError(f"--tokens_per_micro_batch: no source of the {split} split holds {tokens} tokens")
    return batches, sources


def main(argv: list[str]) -> None:
    from fmoe.train.data import BYTE_VOCAB_SIZE, load_blend

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="an fmoe run directory or checkpoint, or a Hugging Face folder")
    parser.add_argument("--data", default=None, help="a blend spec (default: the run's data; needed for an HF folder)")
    parser.add_argument("--split", default="val", choices=("val", "train", "all"))
    parser.add_argument("--val_percent", type=int, default=None, help="validation documents (default: the run's, else 5)")
    parser.add_argument("--tokens_per_micro_batch", type=int, default=None, help="default: the run's, else 2048")
    parser.add_argument("--batches", type=int, default=None, help="micro-batches (default: the run's eval_batches, else 16; 0: all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (under torchrun: cpu or cuda, each rank its LOCAL_RANK's GPU)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    axes = add_parallel_knobs(parser, cp=True, per="micro-batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = {axis: getattr(args, axis) for axis in axes}
    meshes, rank, dtype = None, 0, getattr(torch, args.dtype)
    try:
        device = _device(args.device if world == 1 else args.device.split(":")[0])
        if args.data is None and is_hf_folder(args.path):
            raise ValueError("--data: an HF folder needs data tokenized with its tokenizer (python -m fmoe.train.prepare)")
        impl = "auto" if device.type == "cuda" else "torch"  # Triton and FlexAttention on a GPU
        if world == 1 and all(v == 1 for v in sizes.values()):
            model, run = load_model(args.path, impl=impl, dtype=dtype, device=device)
        else:  # several processes: each holds and reads its own shards of the model
            device = start_ranks(device, sizes)
            rank = dist.get_rank()
            model, run, meshes = load_sharded(args.path, sizes, device=device, dtype=dtype, impl=impl)
    except (OSError, ValueError, KeyError) as err:
        sys.exit(str(err) if str(err).startswith("parallel knobs") else f"path: {err}")
    loop = run.get("config", {})
    spec = args.data if args.data is not None else loop.get("data", "")
    same_data = args.data is None and bool(loop)
    try:
        separator = loop.get("separator", -1) if same_data else -1
        corpus = load_blend(spec or None, separator=separator if separator >= 0 else None,
                            vocab_size=model.cfg.vocab_size if spec else None, dtype=(loop.get("data_dtype") or None) if same_data else None)
        if corpus.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"the data's {corpus.vocab_size} token ids do not fit the model's vocab_size {model.cfg.vocab_size} "
                             "(tokenize it with the model's tokenizer)")
        tokens = args.tokens_per_micro_batch or loop.get("tokens_per_micro_batch", 2048)
        split = (2 if args.cp > 1 else 1) * args.cp * args.tp
        if tokens % split:
            raise ValueError(f"--tokens_per_micro_batch: expected a multiple of {'2 x --cp x ' if args.cp > 1 else ''}--tp = {split}, got {tokens}")
        batches, sources = data_batches(
            corpus, split=args.split, val_percent=args.val_percent if args.val_percent is not None else loop.get("val_percent", 5),
            tokens=tokens, n_batches=args.batches if args.batches is not None else loop.get("eval_batches", 16), mtp_depth=model.cfg.mtp_depth)
    except (OSError, ValueError) as err:
        sys.exit(f"data: {err}")
    with parallel.gathered(model) if args.keep_gathered else contextlib.nullcontext():
        result = evaluate(model, batches, sources, device=device, meshes=meshes)
    if rank == 0:
        report(result, unit="byte" if corpus.vocab_size == BYTE_VOCAB_SIZE else "token", as_json=args.json)
    if meshes is not None:
        parallel.leave_ranks()


def report(result: dict, *, unit: str, as_json: bool) -> None:
    """Print evaluate's result: one JSON object, or a line per source (and overall when
    there are several) and per MTP depth."""
    if as_json:
        print(json.dumps(result))
        return
    rows = [*result["by_source"].items()] + ([("all", result)] if len(result["by_source"]) > 1 else [])
    for name, r in rows:
        print(f"{name}: {r['tokens']} tokens, loss {r['loss']:.4f}, perplexity {math.exp(r['loss']):.3f}, "
              f"bits per {unit} {r['loss'] / math.log(2):.4f}")
    for d, loss in enumerate(result["mtp_losses"], 1):
        print(f"mtp depth {d}: loss {loss:.4f}")

if __name__ == "__main__":
    main(sys.argv[1:])
