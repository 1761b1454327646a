"""Measure a model's loss on data, or its accuracy on multiple-choice questions: an fmoe run (its out_dir, or one checkpoint) or a Hugging Face folder.

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
micro-batch of every source. --whole_documents (by default the run's): a document that does
not fit the rest of a micro-batch starts the next one, the rest padding (Sampler). --dtype
(by default the run's; float32 for an HF folder): the weights' dtype.

Under torchrun the model may be larger than one device: each rank builds it on the meta
device, parallelized over --tp, --ep, --etp and --cp (the rest of the world shards it with
FSDP2), and reads only its own shards' weights (load_sharded); the data-parallel ranks take
turns over the micro-batches and the sums are added over the ranks, so any mesh prints one
process's numbers (up to float rounding). Rank 0 prints. --keep_gathered: FSDP2 gathers the
weights once for all the micro-batches, not once per micro-batch (fmoe.parallel.gathered;
for a model whose unsharded weights, divided by tp and ep x etp, fit on each device).

--choices FILE scores multiple-choice questions instead (a JSON Lines file, read_choices):
each choice's log-probability given its context (choice_logprobs: one document per context
and choice in the packed forward of model.logits; not under --cp; the two tokenized together
as lm-evaluation-harness pairs them, pair_ids; --delimiter puts a text, the harness's " ",
between them), printed as the accuracy and the length-normalised accuracy (score_choices);
--questions N takes the first N. The
questions are the data: --data, --split, --val_percent, --batches and --whole_documents
with --choices stop with an error.

    python examples/evaluate.py out/train_moe --choices=questions.jsonl --json

Printed: per source and overall, the tokens counted (those with a next token in their
document), the mean loss, its perplexity and bits per byte (byte corpora) or per token;
the MTP depths' losses when the model has MTP modules. --json prints one JSON object
instead: {"loss", "tokens", "perplexity", "bits_per_byte" (or "bits_per_token"),
"by_source": {name: {the same four}}, "mtp_losses", "micro_batches"}. A
source (or MTP depth) with no counted token has no loss (null), and an evaluation with
none at all stops with an error; a source without a micro-batch is named in a note
(standard error). A diverged run's NaN or infinite values are the strings "nan" and "inf"
(strict JSON, as config.json writes them).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import (_device, add_parallel_knobs, command_knobs, is_hf_folder, load_model, load_sharded, say_read, start_ranks, text_codec,  # noqa: E402
                      with_tokenizer)

import fmoe.parallel as parallel  # noqa: E402
from fmoe.model import Transformer  # noqa: E402
from fmoe.train.data import Blend  # noqa: E402
from fmoe.train.run import ArgumentParser, every_rank, raise_together, run_script, saved_config, strict_json  # noqa: E402


@torch.no_grad()
def evaluate(model: Transformer, batches: Iterable, sources: Iterable[str], *, device: torch.device, meshes=None) -> dict:
    """The loss sums of `batches` (make_batch TensorDicts, a list or any iterable: they are
    read once, in order, one at a time), each from the source named by the same item of
    `sources`: {"loss": mean over every counted token, "tokens": their count, "by_source":
    {name: {"loss", "tokens"}} in first-seen order, "mtp_losses": [depth d's mean loss],
    "micro_batches": how many there were}; a loss over no counted token is None (nothing
    measured), not 0. One forward per micro-batch, eval mode; the sums stay on the device
    (float64) until one transfer at the end.

    meshes: the fmoe.parallel.Meshes a model was parallelized over (under torchrun; every
    rank calls this with the same batches). The data-parallel ranks take turns: batch i
    runs on dp rank i % dp, and a rank left without one in the last round runs the first
    batch again and counts nothing (every rank of a sharded model takes part in every
    forward); each cp rank runs its share of each batch (fmoe.parallel.split_batch); the tp
    ranks hold the same sums, and one of them counts. The sums are added over every rank in
    one collective, so each rank returns one process's result (up to float rounding)."""
    model.eval()
    dp, dp_rank, cp, cp_rank, counts_here = 1, 0, 1, 0, True
    if meshes is not None:
        dp, dp_rank = meshes.dp, meshes.batch.get_local_rank("dp")
        cp, cp_rank = meshes.cp, meshes.batch.get_local_rank("cp")
        counts_here = meshes.batch.get_local_rank("tp") == 0
    zero = torch.zeros((), dtype=torch.float64, device=device)
    mtp = [f"mtp_{d}_{kind}" for d in range(1, model.cfg.mtp_depth + 1) for kind in ("sum", "tokens")]  # named as in losses
    sums, names, first, n, ran = dict.fromkeys(mtp, zero), [], None, 0, 0

    def forward(host_batch):
        batch = (parallel.split_batch(host_batch, cp_rank, cp) if cp > 1 else host_batch).to(device)
        return model(batch, model.context(batch))[0]

    try:
        for i, (host_batch, source) in enumerate(zip(batches, sources, strict=True)):
            n, first = i + 1, host_batch if first is None else first
            if source not in names:  # every rank reads every item: the same keys everywhere
                names.append(source)
                sums |= {f"sum_{len(names) - 1}": zero, f"tokens_{len(names) - 1}": zero}
            if i % dp != dp_rank:
                continue
            losses, ran = forward(host_batch), ran + 1
            if counts_here:
                j = names.index(source)
                for key, name in ((f"sum_{j}", "lm_sum"), (f"tokens_{j}", "lm_tokens"), *zip(mtp, mtp)):
                    sums[key] = sums[key] + losses[name].double()
    except ValueError as err:
        if "zip()" not in str(err):
            raise
        n = -1  # one ran out before the other
    if n < 1:
        raise ValueError(f"batches: expected one source name per batch and at least one batch, got {'none' if n == 0 else 'more of one than of the other'}")
    if ran < -(-n // dp):  # the last round's forward, which every rank of a sharded model takes part in
        forward(first)
    if meshes is not None:
        sums = parallel.all_reduce_sums(sums, meshes.stage_mesh)
    host = dict(zip(sums, torch.stack(list(sums.values())).tolist()))  # one device -> host transfer
    mean = lambda total, count: total / count if round(count) else None  # noqa: E731  (no token: nothing measured)
    by_source = {name: dict(loss=mean(host[f"sum_{j}"], host[f"tokens_{j}"]), tokens=round(host[f"tokens_{j}"]))
                 for j, name in enumerate(names)}
    tokens = sum(r["tokens"] for r in by_source.values())
    return dict(loss=mean(sum(host[f"sum_{j}"] for j in range(len(names))), tokens), tokens=tokens, by_source=by_source,
                mtp_losses=[mean(host[f"mtp_{d}_sum"], host[f"mtp_{d}_tokens"]) for d in range(1, model.cfg.mtp_depth + 1)],
                micro_batches=n)


def data_batches(corpus, *, split: str, val_percent: int, tokens: int, n_batches: int, mtp_depth: int,
                 whole_documents: bool = False) -> tuple[list, list[str]]:
    """(micro-batches, their sources) of `corpus` (a Blend): the split's validation batches
    as the loop draws them (n_batches > 0: two lists), or every whole micro-batch of every
    source (0: a source of fewer than `tokens` tokens has none), made one at a time as they
    are read (two iterators to read together, as evaluate does: a list of every micro-batch
    of a large split held ~55 bytes per token); whole_documents as for
    fmoe.train.data.Sampler. The val split needs no training documents (val_percent=100)."""
    if split not in ("val", "train", "all"):
        raise ValueError(f"--split: expected val, train or all, got {split!r}")
    if n_batches < 0:
        raise ValueError(f"--batches: expected >= 0 (0: every whole micro-batch), got {n_batches}")
    if split == "val":  # each source's validation part, as Blend.split's, which refuses a source left without training documents
        corpus = Blend([d.split(val_percent)[1] for d in corpus.datasets], corpus.names, corpus.weights, corpus.paths)
    elif split == "train":
        corpus = corpus.split(val_percent)[0]
    if n_batches:
        return (corpus.validation_batches(tokens, n_batches, mtp_depth=mtp_depth, whole_documents=whole_documents),
                corpus.validation_sources(n_batches))
    kept = [(name, dataset) for name, dataset in zip(corpus.names, corpus.datasets)
            if dataset.n_tokens >= tokens]  # fewer: not one micro-batch without repeating documents
    if not kept:
        raise ValueError(f"--tokens_per_micro_batch: no source of the {split} split holds {tokens} tokens")
    pairs = ((batch, name) for name, dataset in kept  # each source's documents in stored order, once
             for batch in dataset.stored_batches(tokens, mtp_depth=mtp_depth, whole_documents=whole_documents))
    these, those = itertools.tee(pairs)  # read in step, the tee holds at most one item
    return (batch for batch, _ in these), (name for _, name in those)


def pair_ids(encode: Callable, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a context and the text that continues it, as
    lm-evaluation-harness pairs them (its _encode_pair): the context's trailing whitespace
    moves to the continuation, and the two are tokenized together, as the model reads them
    (tokenized apart, "... batch " + "to" was scored as "Ġ" "t" "o" where the text reads
    "Ġto"); the context's ids are the tokens the tokenizer adds before a text (a BOS) and the
    joint ids the context's own share, the continuation's the rest (a token across the
    boundary is the continuation's). Where that leaves either side without a token, the two
    are tokenized apart."""
    spaces = len(context) - len(context.rstrip())
    text, rest = (context[:-spaces], context[-spaces:] + continuation) if spaces else (context, continuation)
    alone, joint, full = encode(text, special=False), encode(text + rest, special=False), encode(text)
    head = next((full[:i] for i in range(len(full) - len(alone) + 1) if full[i:i + len(alone)] == alone), full[:0]) if alone else full
    k = 0
    while k < min(len(alone), len(joint)) and alone[k] == joint[k]:
        k += 1
    if head + joint[:k] and joint[k:]:
        return list(head) + list(joint[:k]), list(joint[k:])
    return list(encode(context)), list(encode(continuation, special=False))


def read_choices(path: Path, encode: Optional[Callable], *, limit: int = 0, delimiter: str = "") -> list[dict]:
    """The questions of a JSON Lines file, one per line: {"context": str, "choices": [str,
    ...], "answer": int} (the index of the right choice), or token ids in "context_ids" and
    "choices_ids" (lists of ints) instead of the texts. A choice continues its context as
    written (" Paris" after "The capital of France is"), after `delimiter` (lm-evaluation-
    harness's target_delimiter is " ": then choices are written without it). Texts are
    tokenized with `encode` (text_codec's) in pairs (pair_ids: the context with the tokens
    the tokenizer adds, each choice with it, as the model reads them). Returns [{"contexts":
    [ids per choice], "choices": [ids, ...], "answer", "lengths": each choice's length for
    the normalised accuracy (characters of the choice as written, without the delimiter, as
    the harness's acc_norm; tokens for ids)}], the first `limit` lines (0: all)."""
    questions = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit and len(questions) == limit:
                break
            where = f"{path}:{n}"
            try:
                q = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err})") from None
            if not isinstance(q, dict):
                raise ValueError(f"{where}: expected an object with context, choices and answer, got {type(q).__name__}")
            texts = "context" in q or "choices" in q
            if texts and ("context_ids" in q or "choices_ids" in q):
                raise ValueError(f"{where}: expected texts (context, choices) or token ids (context_ids, choices_ids), not both")
            if texts and encode is None:
                raise ValueError(f"{where}: this model has no tokenizer here (no tokenizer.json, or a token-file run whose "
                                 "data's index names no tokenizer that is here): give context_ids and choices_ids")
            ctx_key, choices_key = ("context", "choices") if texts else ("context_ids", "choices_ids")
            context, choices, answer = q.get(ctx_key), q.get(choices_key), q.get("answer")
            kind = str if texts else list
            if not isinstance(context, kind) or not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, kind) for c in choices):
                raise ValueError(f"{where}: expected {ctx_key!r} a {'text' if texts else 'list of token ids'} and {choices_key!r} a list of at "
                                 f"least 2 of them, got {type(context).__name__} and {choices!r:.80}")
            if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
                raise ValueError(f"{where}: answer: expected the index of the right choice, 0..{len(choices) - 1}, got {answer!r}")
            if texts:
                contexts, choice_ids = zip(*(pair_ids(encode, context, delimiter + c) for c in choices))
                lengths = [len(c) for c in choices]
            else:
                if delimiter:
                    raise ValueError(f"{where}: --delimiter: goes between texts, and this question gives token ids")
                if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in [*context, *(t for c in choices for t in c)]):
                    raise ValueError(f"{where}: token ids: expected non-negative ints")
                contexts, choice_ids, lengths = [context] * len(choices), choices, [len(c) for c in choices]
            if not all(contexts):
                raise ValueError(f"{where}: {ctx_key}: empty (a choice is scored from the tokens before it)")
            if not all(choice_ids):
                raise ValueError(f"{where}: {choices_key}: a choice without tokens")
            questions.append(dict(contexts=[list(c) for c in contexts], choices=[list(c) for c in choice_ids], answer=answer, lengths=lengths))
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


@torch.no_grad()
def choice_logprobs(model: Transformer, pairs: list[tuple[list[int], list[int]]], *, tokens: int, device: torch.device,
                    meshes=None) -> tuple[list[float], int]:
    """(log-probabilities, the number cut) of continuations given their contexts: for each
    (context ids, continuation ids) the sum over the continuation's tokens of log p(token |
    the tokens before it). Each pair is one document of the packed forward (model.logits):
    its context, then its continuation but the last token; the documents fill micro-batches
    of at most `tokens` tokens in order, a context too long for one is cut from the left
    (its newest tokens kept; the number of pairs cut is returned), and a micro-batch is padded
    with a document of token 0 to a multiple of tp. Eval mode; the sums stay on the device
    (float64) until one transfer at the end.

    meshes: as evaluate's (under torchrun, every rank calling with the same pairs): the dp
    ranks take turns over the micro-batches, the tp ranks run the same ones and one counts;
    every rank returns the result of one process (up to float rounding). Not under cp."""
    if meshes is not None and meshes.cp > 1:
        raise ValueError("--cp: choices are scored with model.logits, which context parallelism does not run (use --tp, --ep, --etp)")
    if not pairs or not all(context and continuation for context, continuation in pairs):
        raise ValueError("pairs: expected at least one (context, continuation) pair, each of at least one token")
    model.eval()
    dp, dp_rank, tp, counts_here = 1, 0, 1, True
    if meshes is not None:
        dp, dp_rank, tp = meshes.dp, meshes.batch.get_local_rank("dp"), meshes.tp
        counts_here = meshes.batch.get_local_rank("tp") == 0
    batches, cut, current, used = [], 0, [], 0  # a micro-batch: [(pair index, context ids, continuation ids)]
    for i, (context, continuation) in enumerate(pairs):
        room = tokens - len(continuation) + 1  # the context's tokens that fit with the continuation
        if room < 1:
            raise ValueError(f"--tokens_per_micro_batch: a continuation of {len(continuation)} tokens needs more than {tokens}")
        if len(context) > room:
            context, cut = context[-room:], cut + 1
        size = len(context) + len(continuation) - 1
        if used + size > tokens:
            batches.append(current)
            current, used = [], 0
        current.append((i, context, continuation))
        used += size
    batches.append(current)
    scores = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    for r in range(-(-len(batches) // dp)):
        b = r * dp + dp_rank
        ids, lengths, rows, targets, owners = [], [], [], [], []
        for i, context, continuation in batches[b if b < len(batches) else 0]:
            start = len(ids) + len(context) - 1  # the row whose logits predict the continuation's first token
            ids += context + continuation[:-1]
            lengths.append(len(context) + len(continuation) - 1)
            rows += range(start, start + len(continuation))
            targets += continuation
            owners += [i] * len(continuation)
        pad = -len(ids) % tp
        if pad:
            ids, lengths = ids + [0] * pad, lengths + [pad]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        logits = model.logits(torch.tensor(ids, device=device), cu.to(device))
        if b >= len(batches) or not counts_here:
            continue
        rows_t, targets_t = torch.tensor(rows, device=device), torch.tensor(targets, device=device)
        picked = logits[rows_t]
        logp = picked.gather(1, targets_t[:, None]).squeeze(1) - torch.logsumexp(picked, dim=-1)
        scores.index_add_(0, torch.tensor(owners, device=device), logp.double())
    if meshes is not None:
        from fmoe.optim.grads import process_group

        dist.all_reduce(scores, group=process_group(meshes.stage_mesh))
    return scores.tolist(), cut


def score_choices(questions: list[dict], logprobs: list[float]) -> dict:
    """{"questions", "accuracy": the share whose right choice has the highest log-probability,
    "accuracy_norm": the same with each log-probability divided by its choice's length,
    "logprobs": [[each choice's log-probability] per question]}; ties go to the first choice.
    logprobs: choice_logprobs' result for the questions' choices, in order."""
    per, at, right, right_norm = [], 0, 0, 0
    for q in questions:
        lp = logprobs[at:at + len(q["choices"])]
        at += len(q["choices"])
        per.append(lp)
        right += max(range(len(lp)), key=lambda j: (lp[j], -j)) == q["answer"]
        right_norm += max(range(len(lp)), key=lambda j: (lp[j] / q["lengths"][j], -j)) == q["answer"]
    n = len(questions)
    return dict(questions=n, accuracy=right / n, accuracy_norm=right_norm / n, logprobs=per)


@contextlib.contextmanager
def _working_directory(path):
    """Run the body in directory path (None: where it is)."""
    here = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(here)


def main(argv: list[str]) -> None:
    from fmoe.train.data import load_blend

    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="an fmoe run directory or checkpoint, or a Hugging Face folder")
    parser.add_argument("--data", default=None, help="a blend spec (default: the run's data; needed for an HF folder)")
    parser.add_argument("--separator", type=int, default=None,
                        help="--data's token files without an index: the document separator id (train_moe's; default: the run's, with its data)")
    parser.add_argument("--data_dtype", default=None, choices=("uint16", "uint32"),
                        help="--data's token files: their id type (default: the run's with its data, else from the file suffix)")
    parser.add_argument("--split", default=None, choices=("val", "train", "all"), help="the documents measured (default val)")
    parser.add_argument("--val_percent", type=int, default=None, help="validation documents (default: the run's, else 5)")
    parser.add_argument("--tokens_per_micro_batch", type=int, default=None, help="default: the run's, else 2048")
    parser.add_argument("--batches", type=int, default=None, help="micro-batches (default: the run's eval_batches if not 0, else 16; 0: every whole micro-batch, a source's "
                        "last tokens that fill none left out)")
    parser.add_argument("--whole_documents", action=argparse.BooleanOptionalAction, default=None,
                        help="a document that does not fit the rest of a micro-batch starts the next one (default: the run's, else no)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (under torchrun: cpu or cuda, each rank its LOCAL_RANK's GPU)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype (default: an fmoe run's own --dtype, its auto bfloat16 on cuda and float32 elsewhere; "
                        "float32 for an HF folder)")
    axes = add_parallel_knobs(parser, cp=True, per="micro-batch")
    parser.add_argument("--choices", type=Path, default=None,
                        help="a JSON Lines file of multiple-choice questions to score instead of the data's loss")
    parser.add_argument("--questions", type=int, default=0, help="with --choices: the first N questions (0: all)")
    parser.add_argument("--delimiter", default="", help="with --choices: the text between a context and each choice (lm-evaluation-harness's "
                        "target_delimiter, ' ', for choices written without it); default none: a choice continues its context as written")
    parser.add_argument("--tokenizer", type=Path, default=None, help="with --choices, a run on prepared token files: the "
                        "tokenizer.json to use in place of the one its data's index names (a run copied from another machine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.tokenizer is not None and args.choices is None:
        sys.exit("--tokenizer: it encodes --choices' texts, which are not given (a loss on token data needs no tokenizer)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = {axis: getattr(args, axis) for axis in axes}
    meshes, rank = None, 0
    try:
        device = _device(args.device if world == 1 else args.device.split(":")[0])
        args.dtype = args.dtype or _run_dtype(args.path, device)  # before the ranks compare their knobs: each rank's own reading
        dtype = getattr(torch, args.dtype)
        if args.questions < 0:
            raise ValueError(f"--questions: expected >= 0 (0: all), got {args.questions}")
        if args.separator is not None and args.separator < 0:
            raise ValueError(f"--separator: expected a token id >= 0, got {args.separator}")
        if args.tokens_per_micro_batch is not None and args.tokens_per_micro_batch < 1:
            raise ValueError(f"--tokens_per_micro_batch: expected >= 1 (leave it out for the run's), got {args.tokens_per_micro_batch}")
        given = [knob for knob, value in (("--data", args.data), ("--separator", args.separator), ("--data_dtype", args.data_dtype),
                                          ("--split", args.split), ("--val_percent", args.val_percent),
                                          ("--batches", args.batches), ("--whole_documents", args.whole_documents)) if value is not None]
        if args.choices is not None and given:
            raise ValueError(f"--choices: the questions are the data; {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply")
        if args.choices is None and args.questions:
            raise ValueError("--questions: counts the questions of --choices, which is not given")
        if args.choices is None and args.delimiter:
            raise ValueError(f"--delimiter: goes between a context and each choice of --choices, which is not given (got {args.delimiter!r})")
        if args.choices is not None and args.cp > 1:
            raise ValueError("--cp: choices are scored with model.logits, which context parallelism does not run (use --tp, --ep, --etp)")
        if args.data is None and args.choices is None and is_hf_folder(args.path):
            raise ValueError("--data: an HF folder needs data tokenized with its tokenizer (python -m fmoe.train.prepare)")
        impl = "auto" if device.type == "cuda" else "torch"  # Triton and FlexAttention on a GPU
        if world == 1 and all(v == 1 for v in sizes.values()):
            model, run = load_model(args.path, impl=impl, dtype=dtype, device=device)
        else:  # several processes: each holds and reads its own shards of the model
            device = start_ranks(device, sizes, command_knobs(args, ("path", "data", "choices", "tokenizer")))
            rank = dist.get_rank()
            model, run, meshes = load_sharded(args.path, sizes, device=device, dtype=dtype, impl=impl)
    except (OSError, ValueError, KeyError) as err:
        sys.exit(str(err) if str(err).startswith(("parallel knobs", "rank ", "--", "path:")) else f"path: {err}")
    say_read(run, rank)
    loop = run.get("config", {})
    tokens = args.tokens_per_micro_batch if args.tokens_per_micro_batch is not None else loop.get("tokens_per_micro_batch", 2048)
    if args.choices is not None:
        return choices_main(args, model, run, tokens=tokens, device=device, meshes=meshes)
    args.split = args.split or "val"
    spec = args.data if args.data is not None else loop.get("data", "")
    same_data = args.data is None and bool(loop)
    refusal = None
    try:
        separator = args.separator if args.separator is not None else loop.get("separator", -1) if same_data else -1
        data_dtype = args.data_dtype or ((loop.get("data_dtype") or None) if same_data else None)
        # the run's own --data, relative to where the run started (config.json's run.cwd), wherever this runs
        start = run.get("run", {}).get("cwd") if same_data else None
        with _working_directory(start if start and Path(start).is_dir() else None):
            corpus = load_blend(spec or None, separator=separator if separator >= 0 else None,
                                vocab_size=model.cfg.vocab_size if spec else None, dtype=data_dtype)
            read_from = [str(Path(p).resolve()) for p in corpus.paths if p]  # said below: which files, wherever this runs
        if args.separator is not None and corpus.byte_tokens:  # no effect without a word before
            raise ValueError(f"--separator={args.separator}: applies to token files; this data is bytes (text files or the embedded corpus)")
        if corpus.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"the data's {corpus.vocab_size} token ids do not fit the model's vocab_size {model.cfg.vocab_size} "
                             "(tokenize it with the model's tokenizer)")
        model.cfg.check_micro_batch(tokens, "--tokens_per_micro_batch")
        split = (2 if args.cp > 1 else 1) * args.cp * args.tp
        if tokens % split:
            raise ValueError(f"--tokens_per_micro_batch: expected a multiple of {'2 x --cp x ' if args.cp > 1 else ''}--tp = {split}, got {tokens}")
        if same_data and args.split == "val" and loop.get("eval_batches") == 0:
            raise ValueError("--split=val: the run held no documents out (it trained with --eval_batches=0, on every document): "
                             "give --data of documents it did not see, or --split=train or all to measure its fit")
        n_batches = args.batches if args.batches is not None else loop.get("eval_batches") or 16
        batches, sources = data_batches(
            corpus, split=args.split, val_percent=args.val_percent if args.val_percent is not None else loop.get("val_percent", 5),
            tokens=tokens, n_batches=n_batches, mtp_depth=model.cfg.mtp_depth,
            whole_documents=args.whole_documents if args.whole_documents is not None else loop.get("whole_documents", False))
    except (OSError, ValueError) as err:
        refusal = str(err) if str(err).startswith("data:") else f"data: {err}"  # load_blend's errors name the data already
    # each rank read the data itself: a file one node lacks (or holds another copy of) stops every rank, said once
    refusal, _ = every_rank(refusal, None if refusal else (len(corpus), corpus.n_tokens), lambda every: (
        "--data: the ranks read different data (" + "; ".join(f"rank {r}: {d[0]} documents, {d[1]:,} tokens"
                                                               for r, d in enumerate(every))
        + "); each rank reads the files itself: every node must hold the same ones"))
    if refusal:
        sys.exit(refusal)
    if rank == 0:
        files = ", ".join(read_from) if read_from else "the embedded corpus (this Python's standard library sources)"
        whose = " (the run's --data)" if same_data and spec else ""
        print(f"data: {files}{whose}", file=sys.stderr)
    with parallel.gathered(model) if args.keep_gathered else contextlib.nullcontext():
        result = evaluate(model, batches, sources, device=device, meshes=meshes)
    if not result["tokens"]:  # no loss to report: 0 would read as a perfect model
        sys.exit(f"--tokens_per_micro_batch, --batches: no token was counted in {result['micro_batches']} micro-batch(es) of {tokens} tokens (a token "
                 "counts when the next one is in its document and micro-batch, and its label is not masked); give more tokens per "
                 "micro-batch, more --batches, or other --data")
    if rank == 0:
        for name in (n for n in corpus.names if n not in result["by_source"]):  # a source without a micro-batch has no row: say so
            why = (f"it holds fewer than one micro-batch of {tokens} tokens (--tokens_per_micro_batch) in the {args.split} split"
                   if not n_batches else f"its weight's share of the {n_batches} --batches is none")
            print(f"note: source {name!r} is left out: {why}", file=sys.stderr)
        report(result, unit="byte" if corpus.byte_tokens else "token", as_json=args.json)
    if meshes is not None:
        parallel.leave_ranks()


def choices_main(args, model: Transformer, run: dict, *, tokens: int, device: torch.device, meshes) -> None:
    """--choices: score the file's questions (read_choices, choice_logprobs, score_choices) in
    micro-batches of at most `tokens` tokens and print the accuracies (rank 0), or one JSON
    object with --json."""
    try:
        error, questions = None, []
        try:  # the tokenizer and the file, each rank's own
            encode, _, _ = text_codec(args.path, model, with_tokenizer(run, args.tokenizer))
            questions = read_choices(args.choices, encode, limit=args.questions, delimiter=args.delimiter)
            for q in questions:
                if max(*(max(c) for c in q["contexts"]), *(max(c) for c in q["choices"])) >= model.cfg.vocab_size:
                    raise ValueError(f"{args.choices}: token ids beyond the model's vocab_size {model.cfg.vocab_size}")
        except (OSError, ValueError) as err:
            error = err
        # each rank read the file itself: every rank scores the same pairs, or none does
        raise_together(error, hashlib.sha256(json.dumps(questions).encode()).hexdigest(),
                       lambda _: f"{args.choices}: the ranks read different questions from it; every node must hold the same file")
        pairs = [pair for q in questions for pair in zip(q["contexts"], q["choices"])]
        with parallel.gathered(model) if args.keep_gathered else contextlib.nullcontext():
            logprobs, cut = choice_logprobs(model, pairs, tokens=tokens, device=device, meshes=meshes)
    except (OSError, ValueError) as err:
        sys.exit(f"--choices: {err}" if not str(err).startswith("--") else str(err))
    result = dict(score_choices(questions, logprobs), choices_cut=cut)
    if meshes is None or dist.get_rank() == 0:
        if args.json:
            print(json.dumps(strict_json(result), allow_nan=False))
        else:
            print(f"{args.choices.name}: {result['questions']} questions, accuracy {result['accuracy']:.4f}, "
                  f"length-normalised accuracy {result['accuracy_norm']:.4f}"
                  + (f" ({cut} choices scored after a context cut to fit {tokens} tokens)" if cut else ""))
    if meshes is not None:
        parallel.leave_ranks()


_LOG_MAX_FLOAT = math.log(sys.float_info.max)


def _run_dtype(path: Path, device: torch.device) -> str:
    """--dtype's default: an fmoe run's own (its config.json's --dtype, path the run or one of
    its checkpoints; auto: bfloat16 on cuda, float32 elsewhere), so that the defaults
    reproduce its logged validation loss; float32 for an HF folder (one exported inside the
    run too) or a run without it."""
    if is_hf_folder(path):
        return "float32"
    for folder in (path, path.parent):
        knobs = saved_config(folder).get("config")
        if isinstance(knobs, dict) and isinstance(knobs.get("dtype"), str):
            chosen = knobs["dtype"]
            return ("bfloat16" if device.type == "cuda" else "float32") if chosen == "auto" else chosen
    return "float32"


def with_rates(r: dict, unit: str) -> dict:
    """r ({"loss", "tokens", ...}) with its perplexity, exp(loss), and bits_per_<unit>,
    loss / ln 2 (None for a loss of None)."""
    none = r["loss"] is None
    # a diverged run's loss past 709.78: exp overflows a float (math.exp raised OverflowError)
    perplexity = None if none else math.inf if r["loss"] > _LOG_MAX_FLOAT else math.exp(r["loss"])  # NaN stays NaN
    return {**r, "perplexity": perplexity, f"bits_per_{unit}": None if none else r["loss"] / math.log(2)}


def report(result: dict, *, unit: str, as_json: bool) -> None:
    """Print evaluate's result: one JSON object (a loss over no token null), or a line per
    source (and overall when there are several) and per MTP depth."""
    if as_json:
        record = {**with_rates(result, unit), "by_source": {n: with_rates(r, unit) for n, r in result["by_source"].items()}}
        print(json.dumps(strict_json(record), allow_nan=False))  # a NaN or infinite value as "nan" / "inf", as config.json writes them
        return
    rows = [*result["by_source"].items()] + ([("all", result)] if len(result["by_source"]) > 1 else [])
    nothing = "no loss: no token with a next one in its document and micro-batch was counted"
    for name, r in rows:
        r = with_rates(r, unit)
        print(f"{name}: {r['tokens']} tokens, " + (nothing if r["loss"] is None else f"loss {r['loss']:.4f}, perplexity "
              f"{r['perplexity']:.3f}, bits per {unit} {r[f'bits_per_{unit}']:.4f}"))
    for d, loss in enumerate(result["mtp_losses"], 1):
        print(f"mtp depth {d}: " + ("no loss: no token was counted at this depth" if loss is None else f"loss {loss:.4f}"))

if __name__ == "__main__":
    run_script(main, sys.argv[1:])
