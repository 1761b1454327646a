"""Measure a model's loss on data: an fmoe run (its out_dir, or one checkpoint) or a Hugging Face folder.

    python examples/evaluate.py out/train_moe                      # the run's validation batches: its logged val_loss
    python examples/evaluate.py out/train_moe --split=all --batches=0          # every whole micro-batch of its data
    python examples/evaluate.py path/to/qwen3_moe --data=data/web.u32 --batches=64 --tokens_per_micro_batch=4096 \\
        --device=cuda --dtype=bfloat16

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

Printed: per source and overall, the tokens counted (those with a next token in their
document), the mean loss, its perplexity and bits per byte (byte corpora) or per token;
the MTP depths' losses when the model has MTP modules. --json prints one JSON object
instead: {"loss", "tokens", "by_source": {name: {"loss", "tokens"}}, "mtp_losses"}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import _device, is_hf_folder, load_model  # noqa: E402

from fmoe.model import Transformer  # noqa: E402


@torch.no_grad()
def evaluate(model: Transformer, batches: list, sources: list[str], *, device: torch.device) -> dict:
    """The loss sums of `batches` (make_batch TensorDicts), each from the source named in
    `sources`: {"loss": mean over every counted token, "tokens": their count, "by_source":
    {name: {"loss", "tokens"}} in first-seen order, "mtp_losses": [depth d's mean loss]}.
    One forward per micro-batch, eval mode; the sums stay on the device until the end."""
    if len(batches) != len(sources) or not batches:
        raise ValueError(f"batches: expected one source name per batch and at least one batch, got {len(batches)} and {len(sources)}")
    model.eval()
    sums, counts, mtp = {}, {}, [0.0] * model.cfg.mtp_depth
    mtp_counts = [0] * model.cfg.mtp_depth
    for host_batch, name in zip(batches, sources):
        batch = host_batch.to(device)
        losses, _ = model(batch, model.context(batch))
        sums[name] = sums.get(name, 0) + losses["lm_sum"]
        counts[name] = counts.get(name, 0) + losses["lm_tokens"]
        for d in range(model.cfg.mtp_depth):
            mtp[d] = mtp[d] + losses[f"mtp_{d + 1}_sum"]
            mtp_counts[d] = mtp_counts[d] + losses[f"mtp_{d + 1}_tokens"]
    sums, counts = {n: float(v) for n, v in sums.items()}, {n: int(v) for n, v in counts.items()}
    tokens = sum(counts.values())
    return dict(loss=sum(sums.values()) / max(tokens, 1), tokens=tokens,
                by_source={n: dict(loss=sums[n] / max(counts[n], 1), tokens=counts[n]) for n in sums},
                mtp_losses=[float(s) / max(int(c), 1) for s, c in zip(mtp, mtp_counts)])


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
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        device = _device(args.device)
        if args.data is None and is_hf_folder(args.path):
            raise ValueError("--data: an HF folder needs data tokenized with its tokenizer (python -m fmoe.train.prepare)")
        model, run = load_model(args.path, impl="auto" if device.type == "cuda" else "torch")  # Triton and FlexAttention on a GPU
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"path: {err}")
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
        batches, sources = data_batches(
            corpus, split=args.split, val_percent=args.val_percent if args.val_percent is not None else loop.get("val_percent", 5),
            tokens=args.tokens_per_micro_batch or loop.get("tokens_per_micro_batch", 2048),
            n_batches=args.batches if args.batches is not None else loop.get("eval_batches", 16), mtp_depth=model.cfg.mtp_depth)
    except (OSError, ValueError) as err:
        sys.exit(f"data: {err}")
    model.to(device=device, dtype=getattr(torch, args.dtype))
    result = evaluate(model, batches, sources, device=device)
    if args.json:
        print(json.dumps(result))
        return
    unit = "byte" if corpus.vocab_size == BYTE_VOCAB_SIZE else "token"
    rows = [*result["by_source"].items()] + ([("all", result)] if len(result["by_source"]) > 1 else [])
    for name, r in rows:
        print(f"{name}: {r['tokens']} tokens, loss {r['loss']:.4f}, perplexity {math.exp(r['loss']):.3f}, "
              f"bits per {unit} {r['loss'] / math.log(2):.4f}")
    for d, loss in enumerate(result["mtp_losses"], 1):
        print(f"mtp depth {d}: loss {loss:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
