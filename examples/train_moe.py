"""Train a small MoE language model: the explicit loop, meant to be copied and changed.

    python examples/train_moe.py                                  # CPU: stdlib corpus, minutes
    python examples/train_moe.py --steps=400 --out_dir=out/long   # any knob as --name=value
    python examples/train_moe.py --help                           # every knob, its type, default and note
    python examples/train_moe.py --model.hidden=256 --model.n_groups=4 --model.topk_groups=2
    python examples/train_moe.py --resume --steps=600             # continue from out_dir
    python examples/train_moe.py --data=my_texts/                 # a directory of text files
    python examples/train_moe.py --data=tokens.bin --data_dtype=uint16 --separator=50256 --model.vocab_size=50304
    python examples/train_moe.py --deterministic --compile        # bit-reproducible; torch.compile
    python examples/train_moe.py --upcycle_from=out/dense --model.n_dense=1 --model.ffn_expert=192   # a dense run made an MoE

Several processes (gloo on CPU, nccl on GPUs), one per device; the parallel knobs below:
    torchrun --nproc-per-node 2 examples/train_moe.py                   # FSDP2 over 2 ranks
    torchrun --nproc-per-node 4 examples/train_moe.py --ep=4            # experts over 4 ranks
    torchrun --nproc-per-node 4 examples/train_moe.py --tp=2 --ep=2     # TP x EP (MoE folding)
    torchrun --nproc-per-node 2 examples/train_moe.py --cp=2            # context parallel: tokens split
    torchrun --nproc-per-node 8 examples/train_moe.py --dp_replicate=2 --tp=2 --ep=4 --etp=1
    torchrun --nproc-per-node 4 examples/train_moe.py --optimizer=muon  # layer-wise distributed Muon
    torchrun --nproc-per-node 2 examples/train_moe.py --pp=2                # pipeline: 2 stages, 1F1B
    torchrun --nproc-per-node 4 examples/train_moe.py --pp=2 --pp_schedule=interleaved_1f1b --pp_virtual=2 --ep=2
Under torchrun each rank builds the model on the meta device and allocates and initialises
only its own shards (the weights are a function of --seed and each parameter's name, so
every mesh starts from the one-process model). --dtype=bfloat16 (the default on CUDA)
computes in bf16 with float32 master weights and gradient sums, on one process too.
The tokens of an optimizer step do not depend on the number of processes: every rank reads
the step's micro-batches and the data-parallel ranks take turns, so the same command with
other parallel knobs trains the same model and logs the same losses (up to float rounding).
main(argv) can be called several times in one launch (a sweep of small runs without each
run's start-up): set up the process group first and main uses it and leaves it up.

Everything a step does is below, in order: the batch-size schedule picks the micro-batches,
their valid-token counts are read on the host, each moves to the device, gets its context
(RoPE tables, attention mask: once per micro-batch) and runs forward (LM loss + MTP losses
as sums) plus the balancing losses, backward; the loss is the sum over valid tokens divided
by the step's valid-token count; then clip (AdamW multiplies the gradients by the clip's
factor as its kernel reads them; Muon's are scaled in place), the optimizer step, the aux-loss-free
expert-bias update from the step's actual counts, ONE transfer of everything logged to the
host, metrics, and checkpoints (a complete one at the end of every run, and at a step after
which a signal or --stop_after_minutes stops it, every rank agreeing). Nothing in the forward
and backward reads a device value on the host.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import textwrap
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import fmoe.hf
import fmoe.ops as ops
import fmoe.parallel as parallel
from fmoe.model import Transformer, TransformerConfig
from fmoe.optim import (AdamW, Muon, batch_size_at, build_optimizers, clip_factor, clip_grad_norm, grad_norm, lr_at, param_norm, parse_batch_schedule, split_param_groups,
                        zero_grad_count)
from fmoe.train import checkpoint, metrics
from fmoe.train.data import BlendSampler, batch_layout, load_blend, read_index
from fmoe.train.profile import StepProfiler, parse_steps, phase
from fmoe.train.run import (NON_FINITE, OutDirLock, StopRequests, every_rank, nearest, per_rank, refuse_link, run_script, same_command_lines,
                            saved_config, set_deterministic, unshared_dir, write_config)
from fmoe.train.upcycle import granularity, upcycle_


# ------------------------------------------------------------------------------ knobs
@dataclass
class Config:
    # the model: every TransformerConfig field, as --model.<field>=value (e.g. --model.n_groups=4)
    model: TransformerConfig = field(default_factory=lambda: TransformerConfig(mtp_depth=1))
    # data
    data: str = ""                  # "" = the embedded corpus (this Python's stdlib sources, bytes); a directory of
                                    # text files, a token file (.bin/.u16/.u32, its .index.json if prepared), a .npy
                                    # array, or a blend: "0.7:code.u32,0.3:prose.u32" or blend.json ([{"path", "weight"}])
    data_dtype: str = ""            # token files: uint16 | uint32 ("" = from the file suffix)
    separator: int = -1             # token files: the document separator id (--model.vocab_size too)
    val_percent: int = 5            # validation documents: by a hash of each file's name (text directories) or of each
                                    # document's place in a token file
    whole_documents: bool = False   # a document that does not fit the rest of a micro-batch starts the next (the rest
                                    # padding, never routed), not cut: for prompt/response data (no response without its prompt)
    tokens_per_micro_batch: int = 1024  # tokens of one micro-batch: documents packed (and cut) to this length
    batch_schedule: str = "0:2 2M:4"  # micro-batches per step, by tokens consumed
    # losses
    mtp_lambda: float = 0.1         # (lambda / D) * sum_d mean CE_d
    seq_aux_coeff: float = 1e-2     # sequence-level balancing loss (each of the three: averaged over the MoE layers and
                                    # micro-batches, as transformers' Mixtral loss is; Megatron sums its L layers' instead, so
                                    # a Megatron coefficient c balances as L x c does here)
    aux_coeff: float = 0.0          # switch loss over the micro-batch
    z_coeff: float = 0.0            # router z-loss (softmax routing; the default sigmoid routing runs better without)
    bias_rate: float = 3e-2         # aux-loss-free expert-bias step, in the selection scores' units: sigmoids (0..1), or with
                                    # --model.score=softmax probabilities (about 1/n_experts each: a smaller rate there), or
                                    # with --model.expert_bias_on_logits the router's logits
    bias_update: str = "proportional"  # bias_rate * relative load error; sign: +-bias_rate
    # optimizer and schedule
    optimizer: str = "adamw"        # adamw | muon (Muon for matrices, AdamW for the rest)
    adamw_state_dtype: str = "float32"  # AdamW's moments: float32 | bfloat16 (half the memory)
    ns_dtype: str = "bfloat16"      # Muon's Newton-Schulz dtype (float32: bit-comparable runs)
    lr: float = 3e-3                # the peak learning rate, after the warmup
    min_lr: float = -1.0            # the floor the schedule decays to; -1: a tenth of --lr
    init_lr: float = 0.0            # the warmup starts here
    warmup: int = -1                # steps; -1: 20, or a tenth of a shorter run
    lr_style: str = "cosine"        # constant | linear | cosine | inverse_sqrt | wsd
    wsd_decay: int = -1             # wsd: steps of the final decay; -1: a fifth of the steps after warmup. Step n runs
                                    # at the schedule's lr after n - 1 steps (Megatron's count): the floor is reached
                                    # after the last step, so --wsd_decay=1 lowers no step's lr
    wsd_style: str = "linear"       # wsd: linear | cosine | exponential | minus_sqrt
    weight_decay: float = 0.1       # matrices only: never norms, biases, gates (Megatron Core's default)
    decay_embeddings: bool = True   # ...and the embedding and output head by this knob
    clip: float = 1.0               # the gradients' max norm (inf: no clipping)
    # run
    steps: int = 250                # optimizer steps of the whole run
    stop_at: int = 0                # stop after this step (a time-limited job); 0: run to --steps
    stop_after_minutes: float = 0.0  # stop, with a checkpoint, after the first step that ends this long after the start
                                    # (a job's wall-clock limit less a step, a checkpoint and a margin); 0: no limit
    stop_signals: str = "SIGTERM,SIGUSR1"  # these signals stop the run after its step, with a checkpoint (a scheduler's
                                    # preemption or limit; the same one again within 5 s is the same request, a
                                    # later one acts as usual); "": none
    seed: int = 0                   # the model's initialisation and the data's order
    out_dir: str = "out/train_moe"  # config.json, metrics.jsonl and the step_N checkpoints (metrics' mfu is over the GPU's
                                    # datasheet dense bf16 peak, config.json's peak_flops: null, and mfu null, off CUDA or
                                    # for an unknown GPU; benchmarks/RESULTS.md's MFU is over a measured matmul rate)
    resume: bool = False            # continue the run in out_dir from its newest checkpoint
    init_from: str = ""             # a checkpoint (or a run's out_dir): start from its weights only
    init_from_hf: str = ""          # a Hugging Face folder (config.json + safetensors; fmoe.hf.FAMILIES): its model
                                    # and weights; only the --model.* knobs of how it runs and trains apply (mtp_depth: the
                                    # folder's own unless given; impl, ac, fp8*, capacity_*, index_loss_coeff, moa_aux_coeff,
                                    # init_std), the others are refused
    upcycle_from: str = ""          # a dense fmoe run (or checkpoint) or Hugging Face folder (fmoe.hf.DENSE_FAMILIES): its model,
                                    # with the --model.* knobs given (the MoE ones: n_dense, n_experts, k, ffn_expert, ...),
                                    # starts from its weights (fmoe.train.upcycle)
    upcycle_drop: float = 0.0       # Drop-Upcycling: this fraction of each expert's channels drawn afresh (0: the exact start)
    train_only: str = ""            # a regex: only the parameters whose names it matches train, the others stay frozen
                                    # ('' : all train; a MoE layer's expert bias moves where it names the layer's router);
                                    # e.g. '[.]index_' trains DeepSeek sparse attention's indexers alone
    ckpt_every: int = 100           # a checkpoint every this many steps, and always after the last
    keep_last: int = 2              # retention: the newest checkpoints kept...
    keep_every: int = 0             # ...plus every keep_every-th step (0: none)
    eval_every: int = 50            # validation every this many steps, and always at the last
    eval_batches: int = 4           # validation micro-batches (0: no validation, no document held out: a corpus of a few files)
    tensorboard: bool = False       # also TensorBoard event files in out_dir/tensorboard (pip install 'fmoe[tensorboard]')
    check_replicas_every: int = 100  # compare a hash of the parameters across the ranks that hold copies (0: never)
    check_finite: bool = True       # stop at a step whose loss or gradient norm is nan/inf, before its checkpoint
    profile: str = ""               # steps to trace with torch.profiler, START:END (1-based, as logged) or N: each rank's
                                    # Chrome trace and ops table in out_dir/profile/ (fmoe.train.profile)
    memory_snapshot: bool = False   # with --profile, on CUDA: the allocator's history over those steps too (memory_viz)
    device: str = "auto"            # auto | cpu | cuda
    dtype: str = "auto"             # compute: auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16;
                                    # weights, gradient sums and optimizer steps stay float32
    compile: bool = False           # torch.compile the model (forward and backward; each pipeline stage's in place); the graphs
                                    # and graph breaks are printed at the end (--model.impl=torch: the grouped GEMMs read their
                                    # offsets on the host, a break in each MoE layer)
    deterministic: bool = False     # bit-reproducible runs (fmoe.train.run.set_deterministic)
    # parallelism (under torchrun; fmoe.parallel): world = dp_replicate * dp_shard * cp * tp
    dp_replicate: int = 1           # HSDP replicas
    dp_shard: int = -1              # FSDP2 shards (-1: the rest of the world)
    cp: int = 1                     # context parallel: each micro-batch's tokens split over cp ranks
    tp: int = 1                     # tensor parallel: attention heads, dense and shared FFN columns
    ep: int = 1                     # expert parallel, borrowing ranks from dp_shard x cp x tp
    etp: int = 1                    # expert tensor parallel (the experts' FFN columns)
    pp: int = 1                     # pipeline parallel: stages of consecutive layers (the outermost axis)
    pp_schedule: str = "1f1b"       # gpipe | 1f1b | interleaved_1f1b | looped_bfs (torch.distributed.pipelining)
    pp_virtual: int = 1             # stages per rank: 1 (gpipe, 1f1b), >= 2 (interleaved_1f1b, looped_bfs)
    pp_layers: str = ""             # trunk layers per stage, e.g. "3,2,2,1" ("": an even split)
    collective_timeout: float = 0.0  # minutes a rank waits in a collective for its peers (a stalled or lost rank) before
                                    # the run fails; 0: torch's default (10 for nccl, 30 for gloo); raise it for long compiles


def _type_name(kind) -> str:
    """'an int', 'a float or None', ... for messages."""
    optional = typing.get_origin(kind) is typing.Union
    if optional:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is tuple:
        return "a comma-separated list of " + typing.get_args(kind)[0].__name__ + ("s or None" if optional else "s")
    name = kind.__name__
    return ("an " if name[0] in "aeiou" else "a ") + name + (" or None" if optional else "")


def _parse_value(name: str, kind, value: str):
    """value (a string) as the annotated type kind: bool, int, float, str, or Optional[...]."""
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        if value == "None":
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if value.lower() not in flags:
            raise ValueError
        return flags[value.lower()]
    if typing.get_origin(kind) is tuple:  # tuple[int, ...]: comma-separated, e.g. --model.moe_layers=1,3,5
        item = typing.get_args(kind)[0]
        if value.strip() and not all(v.strip() for v in value.split(",")):  # "0,,1" was read as (0, 1)
            raise ValueError
        return tuple(item(v) for v in value.split(",") if v.strip())
    return kind(value)


def knob_help() -> str:
    """--help: every knob with its type and default; Config's with the comments beside them in
    this file, under its section comments; the model's as TransformerConfig's docstring says."""
    hints, defaults = typing.get_type_hints(Config), Config()
    wrap = textwrap.TextWrapper(width=110, initial_indent=" " * 6, subsequent_indent=" " * 6)
    sections: list[tuple[str, dict[str, list[str]]]] = []  # (section comment, {knob: its comment's lines})
    name = None
    for line in inspect.getsource(Config).splitlines()[1:]:  # a field, a section's comment, or a comment's next line
        code, _, comment = line.partition("#")
        if code.strip().partition(":")[0] in hints:
            name = code.strip().partition(":")[0]
            sections[-1][1][name] = [comment.strip()] if comment else []
        elif not code.strip() and comment and line.index("#") == 4:
            sections.append((comment.strip(), {}))
            name = None
        elif not code.strip() and comment and name:
            sections[-1][1][name].append(comment.strip())
    lines = [f"usage: {os.path.basename(__file__)} [--knob=value ...]  (a bool knob also takes the bare --knob)"]
    for title, knobs in sections:
        if "model" in knobs:
            model_title = title  # the model's knobs come last
            continue
        lines += ["", title]
        for knob, note in knobs.items():
            lines.append(f"  --{knob}=<{_type_name(hints[knob]).split(' ', 1)[1]}>  (default {getattr(defaults, knob)!r})")
            lines += wrap.wrap(" ".join(note))
    lines += ["", f"{model_title}; fmoe.model.TransformerConfig's docstring says what each does"]
    lines += [f"  --model.{n}=<{_type_name(kind).split(' ', 1)[1]}>  (default {getattr(defaults.model, n)!r})"
              for n, kind in typing.get_type_hints(TransformerConfig).items()]
    return "\n".join(lines)


# the knobs naming files: each rank reads its own copy of them, compared by what they hold (data, model, checkpoints)
PATH_KNOBS = ("data", "out_dir", "init_from", "init_from_hf", "upcycle_from")


def _rank_knobs(cfg: Config) -> dict:
    """The command line's knobs (--model.* as given, not the model they built; PATH_KNOBS left
    out): what every rank of a run must share (fmoe.train.run.same_command_lines)."""
    knobs = {name: value for name, value in dataclasses.asdict(cfg).items() if name not in ("model", *PATH_KNOBS)}
    knobs.update({f"model.{name}": value for name, value in cfg.model_overrides.items()})
    return knobs


def _differing_models(every: list) -> str:
    """The knobs in which the ranks' models (each rank's TransformerConfig as sorted JSON) differ."""
    return f"--data, --init_from_hf: the ranks built different models from their files ({per_rank(every)}); every node must hold the same files"


SCHEDULE_KNOBS = ("steps", "lr", "min_lr", "init_lr", "warmup", "lr_style", "wsd_decay", "wsd_style")


def _warmup_steps(cfg: Config) -> int:
    """The run's warmup steps: --warmup, or for -1 its default, 20 steps or a tenth of a shorter run."""
    return cfg.warmup if cfg.warmup >= 0 else min(20, cfg.steps // 10)


def _lr_schedule(knobs: dict, warmup: int, wsd_decay: int) -> dict:
    """lr_at's keywords for the run knobs `knobs` (Config's, or a run's config.json "config")
    with their warmup and wsd_decay steps resolved: a factor on each group's lr (--lr's 1)."""
    min_lr = knobs["min_lr"] if knobs["min_lr"] >= 0 else knobs["lr"] / 10
    return dict(max_lr=1.0, total=knobs["steps"], warmup=warmup, min_lr=min_lr / knobs["lr"], init_lr=knobs["init_lr"] / knobs["lr"],
                style=knobs["lr_style"], wsd_decay=wsd_decay if knobs["lr_style"] == "wsd" else 0, wsd_style=knobs["wsd_style"])


def _schedule_change(out_dir: str, step: int, cfg: Config, schedule: dict) -> typing.Optional[str]:
    """A note where a resumed run's learning rate for step+1 by this run's schedule
    (`schedule`: lr_at's keywords) is not what the run's own schedule gave (its config.json:
    --steps raised to extend a cosine or WSD run sends it back up), naming the schedule knobs
    that changed and the warmup and WSD decay they resolved to where those changed with
    them; None where it is the same, or the run's config.json holds no schedule to compare with."""
    lr = cfg.lr * lr_at(step, **schedule)
    try:
        run = saved_config(out_dir)
        was = run["config"]
        then = was["lr"] * lr_at(step, **_lr_schedule(was, run["warmup"], run["wsd_decay"]))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):  # no config.json, or one of another version
        return None
    if math.isclose(then, lr, rel_tol=1e-9, abs_tol=1e-15):
        return None
    changed = [f"--{k}={getattr(cfg, k)} (was {was[k]})" for k in SCHEDULE_KNOBS if k in was and was[k] != getattr(cfg, k)]
    # the steps the defaults resolve to (a --warmup of -1 is a tenth of --steps, up to 20): changed with --steps
    changed += [f"{what} {schedule[key]} steps (was {run[key]})" for key, what in (("warmup", "warmup"), ("wsd_decay", "WSD decay"))
                if schedule[key] != run[key] and was.get(key) == getattr(cfg, key) and (key == "warmup" or cfg.lr_style == "wsd")]
    changed = ", ".join(changed)
    return (f"note: step {step + 1} runs at a learning rate of {lr:.4g} by this run's schedule, where the run's own gave {then:.4g}"
            + (f": {changed}" if changed else "") + "; a resumed run follows the schedule of its knobs")


# the knobs of what a step trains, which a resumed run takes from its own command line (not from the run's config.json):
# each one that differs from the run's is named at the resume (a plain --resume of a run started with others trained on
# the defaults without a word); and the --model.* ones of how it trains (RUN_KNOBS less how it runs and starts)
TRAINING_KNOBS = ("whole_documents", "tokens_per_micro_batch", "batch_schedule", "mtp_lambda", "seq_aux_coeff", "aux_coeff", "z_coeff",
                  "bias_rate", "bias_update", "adamw_state_dtype", "ns_dtype", "weight_decay", "decay_embeddings", "clip", "dtype")


def _add_logged(record: dict, logged: dict) -> None:
    """Add a micro-batch's logged values into the step's record, each key one the record
    holds from the step's start (every rank then sums the same keys in one collective)."""
    for name, value in logged.items():
        if name not in record:
            raise KeyError(f"{name!r}: a logged value that the step's record lacks; add its key to the record's keys where the step "
                           f"starts (record = dict.fromkeys([...]))")
        record[name] = record[name] + value


def _trains(names: list[str], train_only) -> set[str]:
    """The parameter names (of the model's trainable `names`) a --train_only regex trains:
    all for "", none for a value that is no regex (a config.json edited by hand)."""
    try:
        return {n for n in names if re.search(train_only, n)} if train_only else set(names)
    except (re.error, TypeError):
        return set()


def _training_changes(was, cfg: Config) -> list[str]:
    """The TRAINING_KNOBS (and the --model.* RUN_KNOBS of how it trains) in which cfg differs from `was`, the knobs in the
    run's config.json ("config"), as "--clip=1.0 (was 0.5)"; [] where it holds none to compare with."""
    if not isinstance(was, dict):
        return []
    model_was = was.get("model") if isinstance(was.get("model"), dict) else {}
    now = dataclasses.asdict(cfg)

    def differs(then, value) -> bool:
        then = NON_FINITE.get(then, then) if isinstance(then, str) else then  # config.json's "inf" of a float knob
        return then != (list(value) if isinstance(value, tuple) else value)

    changed = [f"--{k}={now[k]} (was {was[k]})" for k in TRAINING_KNOBS if k in was and differs(was[k], now[k])]
    return changed + [f"--model.{k}={now['model'][k]} (was {model_was[k]})" for k in RUN_KNOBS
                      if k not in ("impl", "ac", "init_std") and k in model_was and differs(model_was[k], now["model"][k])]


def _upcycle_changes(was, cfg: Config) -> list[str]:
    """--upcycle_from (by the path it names from here) and --upcycle_drop where they differ from the run's config.json
    ("config"), as "--upcycle_drop=0.7 (was 0.0)"; [] where it holds none to compare with."""
    if not isinstance(was, dict) or not isinstance(was.get("upcycle_from"), str):
        return []
    changed = []
    if Path(was["upcycle_from"]).resolve() != Path(cfg.upcycle_from).resolve():
        changed.append(f"--upcycle_from={cfg.upcycle_from} (was {was['upcycle_from'] or 'none'})")
    if was.get("upcycle_drop", 0.0) != cfg.upcycle_drop:
        changed.append(f"--upcycle_drop={cfg.upcycle_drop:g} (was {was.get('upcycle_drop', 0.0)})")
    return changed


def _pp_knobs(err: ValueError) -> str:
    """A pipeline error in the knobs' words: the stage sizes Pipeline calls layers_per_stage are --pp_layers."""
    said = str(err).removeprefix("chunk: ").replace("layers_per_stage", "--pp_layers")
    return said.replace("(index_shared_layers)", "(--model.index_shared_layers)").replace("(shortcut_moe)", "(--model.shortcut_moe)")


def _refuse_inert(model, overrides: dict) -> None:
    """Exit naming the first --model knob given that has no effect on `model` (e.g. --model.index_heads without
    --model.index_topk: another model than asked for would train, without a word)."""
    inert = {name: why for name, why in model.inert_knobs().items() if name in overrides}
    if inert:
        name = next(iter(inert))
        sys.exit(f"--model.{name}={overrides[name]}: {inert[name]}; this model has none, so it would have no effect")


def parse_args(argv: list[str]) -> Config:
    """--name=value overrides of Config and --model.name=value of its TransformerConfig; a
    bare --name sets a bool knob; --help prints every knob (knob_help). Unknown names (with
    the nearest knobs) and bad values exit with a message."""
    cfg = Config()
    hints = {"": typing.get_type_hints(Config), "model.": typing.get_type_hints(TransformerConfig)}
    model_overrides = {}
    for arg in argv:
        name, sep, value = arg.removeprefix("--").partition("=")
        prefix = "model." if name.startswith("model.") else ""
        kind = hints[prefix].get(name.removeprefix(prefix)) if name != "model" else None
        if arg in ("--help", "-h"):
            print(knob_help())
            sys.exit(0)
        if not arg.startswith("--") or kind is None:
            names = [n for n in hints[""] if n != "model"] + [f"model.{n}" for n in hints["model."]]
            near = nearest(name, names)
            sys.exit(f"unknown argument {arg!r}; " + (f"did you mean {' or '.join('--' + n for n in near)}? " if near else "")
                     + "--help lists every knob")
        if not sep and kind is not bool:
            sys.exit(f"--{name}: expected --{name}=<{_type_name(kind).split(' ', 1)[1]}>")
        try:
            parsed = _parse_value(name, kind, value) if sep else True
        except ValueError:
            sys.exit(f"--{name}: expected {_type_name(kind)}, got {value!r}")
        if prefix:
            model_overrides[name.removeprefix(prefix)] = parsed
        else:
            setattr(cfg, name, parsed)
    # counts the loop divides by or counts down: refused here, not at the step that would fail
    least = dict(steps=1, tokens_per_micro_batch=1, eval_every=1, ckpt_every=1, keep_last=1, eval_batches=0, keep_every=0, stop_at=0,
                 check_replicas_every=0, seed=0, val_percent=0)
    for name, low in least.items():
        if getattr(cfg, name) < low:
            sys.exit(f"--{name}: expected an int >= {low}, got {getattr(cfg, name)}")
    # numbers: finite (nan and inf parse as floats), the losses' weights and rates not negative
    for name in (n for n, kind in hints[""].items() if kind is float):
        value = getattr(cfg, name)
        if not math.isfinite(value) and not (name == "clip" and value == math.inf):
            sys.exit(f"--{name}: expected a finite number{' (or inf: no clipping)' if name == 'clip' else ''}, got {value}")
    if not cfg.lr > 0:  # the schedule is a factor on it
        sys.exit(f"--lr: expected a positive learning rate, got {cfg.lr}")
    for name in ("init_lr", "mtp_lambda", "seq_aux_coeff", "aux_coeff", "z_coeff", "bias_rate", "weight_decay"):
        if getattr(cfg, name) < 0:
            sys.exit(f"--{name}: expected a number >= 0, got {getattr(cfg, name)}")
    for name in ("min_lr", "warmup", "wsd_decay"):  # -1: the default (a tenth of --lr; 20 steps or a tenth of the run; a fifth of the rest)
        if getattr(cfg, name) < 0 and getattr(cfg, name) != -1:
            sys.exit(f"--{name}: expected >= 0, or -1 for its default, got {getattr(cfg, name)}")
    if cfg.separator < -1:  # read as "none given", then "separator: required" blamed a missing one
        sys.exit(f"--separator: expected a token id >= 0, or -1 for the token file's index's, got {cfg.separator}")
    if cfg.lr_style != "wsd" and (cfg.wsd_decay != -1 or cfg.wsd_style != "linear"):  # the decay of wsd's last steps: no effect otherwise
        knob = "--wsd_decay" if cfg.wsd_decay != -1 else "--wsd_style"
        sys.exit(f"{knob}: shapes --lr_style=wsd's final decay; this run's --lr_style is {cfg.lr_style}")
    if cfg.init_lr > 0 and _warmup_steps(cfg) == 0:  # --warmup=0, or the default's for a run under 10 steps
        if cfg.warmup == 0:
            sys.exit(f"--init_lr: the lr the warmup starts at; --warmup=0 has none (got --init_lr={cfg.init_lr})")
        sys.exit(f"--init_lr: the lr the warmup starts at; this run of {cfg.steps} steps has none (the default --warmup is a tenth of "
                 f"the run, at most 20 steps; got --init_lr={cfg.init_lr})")
    defaults = Config()  # knobs set away from their default where they can have no effect: refused, not ignored
    if cfg.ns_dtype != defaults.ns_dtype and cfg.optimizer != "muon":
        sys.exit(f"--ns_dtype: Muon's Newton-Schulz dtype; this run's --optimizer is {cfg.optimizer}")
    if not cfg.out_dir.strip():  # "" would write the run into the current directory
        sys.exit(f"--out_dir: expected a directory for the run, got {cfg.out_dir!r}")
    if cfg.min_lr > cfg.lr:
        sys.exit(f"--min_lr: expected at most --lr = {cfg.lr}, got {cfg.min_lr}")
    if cfg.init_lr > cfg.lr:  # a warmup from above the peak
        sys.exit(f"--init_lr: the lr the warmup starts at, expected at most --lr = {cfg.lr}, got {cfg.init_lr}")
    if cfg.min_lr != -1 and cfg.lr_style == "constant":  # no effect without a word before
        sys.exit(f"--min_lr: the floor the schedule decays to; --lr_style=constant does not decay (got --min_lr={cfg.min_lr})")
    if cfg.keep_every % cfg.ckpt_every:  # its steps between the saves were never saved: kept were only the common multiples
        sys.exit(f"--keep_every: keeps the checkpoints of its multiples, saved every --ckpt_every={cfg.ckpt_every} steps: "
                 f"expected a multiple of {cfg.ckpt_every}, got {cfg.keep_every}")
    if not cfg.clip > 0:
        sys.exit(f"--clip: expected a max norm > 0 (inf: no clipping), got {cfg.clip}")
    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        sys.exit(f"--out_dir: {cfg.out_dir} exists and is not a directory")
    base = cfg.model
    if not 0.0 <= cfg.upcycle_drop <= 1.0 or cfg.upcycle_drop and not cfg.upcycle_from:
        sys.exit(f"--upcycle_drop: expected a fraction in [0, 1] with --upcycle_from, got {cfg.upcycle_drop!r}"
                 f"{'' if cfg.upcycle_from else ' without it'}")
    if cfg.upcycle_from:  # the dense run's model; the knobs given make it an MoE
        if cfg.init_from or cfg.init_from_hf:
            sys.exit("--upcycle_from: starts from a dense run's weights; --init_from and --init_from_hf start from others: give one")
        try:
            if fmoe.hf.is_hf_folder(cfg.upcycle_from):  # a released dense model (fmoe.hf.DENSE_FAMILIES); MTP modules start fresh
                # the MTP depth given (the loop's default before it: a fresh module), at once: the config's own check
                # refused ALiBi or learned positions with the default's MTP before --model.mtp_depth=0 was applied
                base = dataclasses.replace(fmoe.hf.read_config(cfg.upcycle_from)[1], impl=base.impl, ac=base.ac,
                                           mtp_depth=model_overrides.get("mtp_depth", base.mtp_depth))
            else:
                base, _ = checkpoint.run_config(cfg.upcycle_from, impl=base.impl)
        except (OSError, ValueError) as err:
            sys.exit(f"--upcycle_from: {err}")
    cfg.model_overrides = model_overrides  # --init_from_hf applies them to its folder's model (main), not to this default one
    try:
        cfg.model = base if cfg.init_from_hf else dataclasses.replace(base, **model_overrides)
    except ValueError as err:
        sys.exit(f"model knobs: {err}")
    _refuse_inert(cfg.model, model_overrides)  # --init_from_hf's: checked again in _run, on the folder's model
    if model_overrides.get("score") == "softmax" and base.score != "softmax" and "expert_bias" not in model_overrides and base.expert_bias:
        # the default aux-loss-free bias was made for sigmoid routing: with softmax it shifts the
        # probabilities (ERNIE 4.5's routing), a choice to make, not to fall into
        sys.exit("--model.score=softmax: the model's expert_bias (on by default, for sigmoid routing) would shift softmax's "
                 "probabilities (ERNIE 4.5's routing, with --bias_rate in their units); say --model.expert_bias=true to keep it "
                 "or --model.expert_bias=false to route without it")
    if cfg.upcycle_from and not any(cfg.model.is_moe(i) for i in range(cfg.model.n_layers)):
        sys.exit(f"--upcycle_from: the model made from it has no MoE layer: set --model.n_dense below its {cfg.model.n_layers} layers "
                 "(or --model.moe_layers), with --model.n_experts, --model.k and --model.ffn_expert")
    if cfg.upcycle_drop and round(cfg.upcycle_drop * cfg.model.ffn_expert) == 0:  # an exact start, said to be a Drop-Upcycling one
        sys.exit(f"--upcycle_drop={cfg.upcycle_drop:g}: draws round({cfg.upcycle_drop:g} x ffn_expert {cfg.model.ffn_expert}) = 0 of each "
                 f"expert's channels afresh, so it would have no effect; {1 / cfg.model.ffn_expert:.3g} or more draws one (0: the exact start)")
    return cfg


def _report_profile(written: list, rank: int) -> None:
    """Rank 0 names the profile's files once they are written (each rank writes its own)."""
    if written and rank == 0:
        print(f"profile: {', '.join(str(f) for f in written)} (each rank writes its own; the trace opens in https://ui.perfetto.dev)",
              flush=True)


# the model knobs of how it runs and trains, not what it computes (kernels, recomputation, fp8 GEMMs, the capacity
# drop, the indexer loss's weight, the initialisation): --resume may change them
RUN_KNOBS = ("impl", "ac", "fp8", "fp8_layers", "fp8_fast_accum", "capacity_factor", "capacity_policy", "index_loss_coeff", "moa_aux_coeff", "init_std")
# the model knobs that apply on top of a Hugging Face folder's model (--init_from_hf): those, and the MTP depth (the
# MTP modules it lacks start fresh, at init_std)
HF_RUN_KNOBS = ("mtp_depth",) + RUN_KNOBS
# ...and on a folder of multi-latent attention without an indexer (DeepSeek-V3's), DeepSeek sparse attention's: its
# indexers start fresh (fmoe.hf.load_weights), DeepSeek-V3.2's start
HF_DSA_KNOBS = ("index_topk", "index_heads", "index_head_dim", "index_rope_interleaved", "index_rope_last", "index_norm_eps",
                "index_shared_layers")


def _model_changes(path, model_cfg) -> dict:
    """checkpoint.model_differences of the run at path and model_cfg, the knobs of how a model
    runs (RUN_KNOBS) aside: those that make another model of its weights."""
    return {n: d for n, d in checkpoint.model_differences(path, model_cfg).items() if n not in RUN_KNOBS}


def _tokenizer_named(path) -> dict:
    """{"tokenizer", "separator"} that a prepared token file's index names (kept in config.json, so that a
    run read where its data is not, a copy on another machine, still knows them), or {}."""
    index = read_index(path) if path is not None and Path(path).is_file() else None
    return {k: index[k] for k in ("tokenizer", "separator")} if index and isinstance(index.get("tokenizer"), str) else {}


def _compile_counts() -> tuple[int, int]:
    """torch.compile's (graphs, graph breaks) so far in this process."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def main(argv: list[str]) -> None:
    """One run of the command line argv. When it ends, however it ends, the out_dir's lock is released (a refusal's
    exception, whose traceback holds this run's frame, kept it held until a garbage collection), and a process group
    it started for one process, --deterministic's settings, torch's and random's generators, the profiler and the
    metrics logger are closed or put back as they were (called again in one process, a notebook's, a later run took
    the group as the caller's, ran deterministic, or ran under the profiler)."""
    cleanups = []
    try:
        _run(argv, cleanups)
    finally:
        for cleanup in reversed(cleanups):
            cleanup()


def _run(argv: list[str], cleanups: list) -> None:
    started = time.monotonic()  # --stop_after_minutes counts from here (the module's import: a notebook's later runs stopped at once)
    cfg = parse_args(argv)
    hf_type = None
    if cfg.init_from_hf:  # the released model's own config: fine-tuning or continued pre-training
        try:
            hf_json, hf_model = fmoe.hf.read_config(cfg.init_from_hf)
        except (OSError, ValueError) as err:
            sys.exit(f"--init_from_hf: {err}")
        hf_type = hf_json["model_type"]
        # the folder's architecture stays; only the knobs of how it runs and trains apply on top
        on_top = HF_RUN_KNOBS + (HF_DSA_KNOBS if hf_model.q_rank is not None and hf_model.kv_rank is not None and hf_model.index_topk is None else ())
        overrides = cfg.model_overrides
        for name, value in overrides.items():
            if name not in on_top and value != getattr(hf_model, name):
                sys.exit(f"--model.{name}={value}: the model of --init_from_hf keeps its own architecture ({name} = "
                         f"{getattr(hf_model, name)} in its config.json); the knobs that apply on top of it: "
                         + ", ".join(f"--model.{n}" for n in on_top))
        try:  # the run knobs at the loop's defaults unless given, but the MTP depth the folder's own (the depths it holds, loaded:
            # none for most families), where the loop's default of 1 trained a fresh module whose loss reached the released trunk
            cfg.model = dataclasses.replace(hf_model, **{name: getattr(cfg.model, name) for name in RUN_KNOBS}
                                            | {name: value for name, value in overrides.items() if name in on_top})
        except ValueError as err:
            sys.exit(f"model knobs: {err}")
        _refuse_inert(cfg.model, overrides)  # e.g. a DeepSeek-V3 folder's --model.index_heads without --model.index_topk
    # ------------------------------------------------------------------------ setup
    if cfg.deterministic:
        if not torch.are_deterministic_algorithms_enabled():
            cleanups.append(lambda: set_deterministic(False))
        set_deterministic(True)  # before any CUDA work: cuBLAS reads its workspace setting once
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        sys.exit(f"--device: expected auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"--device={cfg.device}: this torch sees no CUDA device (torch {torch.__version__}); --device=auto or cpu runs on the CPU")
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else (cfg.device if cfg.device != "auto" else "cpu"))
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        sys.exit(f"--dtype: expected auto, float32 or bfloat16, got {cfg.dtype!r}")
    dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.compile and cfg.whole_documents and device.type == "cpu" and torch.__version__.startswith("2.13."):
        sys.exit("--compile with --whole_documents on the CPU: torch 2.13's inductor returns wrong router gradients where padding is "
                 "masked out of the routing (plain torch shows it: tests/ops/test_routing.py keeps the case); drop one of the two")
    try:
        profile_steps = parse_steps(cfg.profile)
        if cfg.memory_snapshot and profile_steps is None:
            raise ValueError("--memory_snapshot: records the --profile steps; set --profile=START:END")
        last = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
        if profile_steps is not None and profile_steps[0] > last:  # nothing would be traced, without a word
            raise ValueError(f"--profile: steps {cfg.profile} start past the run's last step "
                             f"(--steps={cfg.steps}{f', --stop_at={cfg.stop_at}' if cfg.stop_at > 0 else ''})")
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))  # a caller's group: its own rank
        profiler = StepProfiler(cfg.out_dir, profile_steps, rank=rank, device_type=device.type, memory=cfg.memory_snapshot)
    except ValueError as err:
        sys.exit(str(err))
    cleanups.append(profiler.close)  # an interrupted run's recording stopped too (a second close does nothing)
    try:  # a signal or the time limit: stop after the step, with a checkpoint (fmoe.train.run)
        stop_requests = StopRequests([name.strip() for name in cfg.stop_signals.split(",") if name.strip()], cfg.stop_after_minutes,
                                     start=started)
    except ValueError as err:
        sys.exit(f"--stop_{'signals' if str(err).startswith('signals') else 'after_minutes'}: {err}")
    if cfg.collective_timeout < 0:  # finite: the parser takes no nan or inf
        sys.exit(f"--collective_timeout: expected minutes >= 0 (0: torch's default), got {cfg.collective_timeout}")
    try:  # a timedelta holds under a billion days
        datetime.timedelta(minutes=cfg.collective_timeout)
    except OverflowError:
        sys.exit(f"--collective_timeout: expected at most a billion days of minutes, got {cfg.collective_timeout:g}")
    # a process group set up by the caller (several runs in one launch, main called for each) is used and left up
    caller_group = dist.is_initialized()
    world = dist.get_world_size() if caller_group else int(os.environ.get("WORLD_SIZE", "1"))  # an int: run_script checked it
    # torchrun sets the four; a WORLD_SIZE left in a shell (plain python) made torch's 20-line "RANK expected"
    missing = [] if caller_group or world == 1 else [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if world < 1:
        sys.exit(f"WORLD_SIZE: expected an int of at least 1 in the environment (as torchrun sets it), got {os.environ.get('WORLD_SIZE')!r}")
    if missing:
        sys.exit(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} in the environment without {', '.join(missing)}"
                 ": launch several processes with torchrun (python -m torch.distributed.run --nproc-per-node=N ...), "
                 "or unset WORLD_SIZE for one")
    has_experts = any(cfg.model.is_moe(i) for i in range(cfg.model.n_layers))
    sizes = dict(pp=cfg.pp, dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, etp=cfg.etp)
    if cfg.tokens_per_micro_batch < cfg.model.mtp_depth + 2:  # fewer: no token has a label at the deepest MTP depth
        sys.exit(f"--tokens_per_micro_batch: expected at least --model.mtp_depth + 2 = {cfg.model.mtp_depth + 2} (a token and the "
                 f"{cfg.model.mtp_depth + 1} after it that it predicts), got {cfg.tokens_per_micro_batch}")
    try:  # learned positions (GPT-2's): a longer micro-batch can hold a document past them
        cfg.model.check_micro_batch(cfg.tokens_per_micro_batch, "--tokens_per_micro_batch")
    except ValueError as err:
        sys.exit(str(err))
    # context parallel: 2 cp chunks per micro-batch; sequence parallel: T/(cp tp) tokens per rank
    if cfg.cp > 0 and cfg.tp > 0 and cfg.tokens_per_micro_batch % ((2 if cfg.cp > 1 else 1) * cfg.cp * cfg.tp):
        sys.exit(f"--tokens_per_micro_batch: expected a multiple of {'2 x --cp x ' if cfg.cp > 1 else ''}--tp = "
                 f"{(2 if cfg.cp > 1 else 1) * cfg.cp * cfg.tp}, got {cfg.tokens_per_micro_batch}")
    convolves = any(cfg.model.is_linear(i) for i in range(cfg.model.n_layers)) and cfg.model.linear_attention_config().conv_channels > 0
    if cfg.cp > 1 and convolves and cfg.tokens_per_micro_batch // (2 * cfg.cp) < cfg.model.linear_conv - 1:
        # context parallel: the linear blocks' convolution reads its K - 1 tokens before a chunk from one other chunk
        sys.exit(f"--tokens_per_micro_batch: each of the 2 x --cp = {2 * cfg.cp} chunks must hold the {cfg.model.linear_conv - 1} tokens "
                 f"the next chunk's convolution reads (--model.linear_conv={cfg.model.linear_conv}): expected at least "
                 f"{2 * cfg.cp * (cfg.model.linear_conv - 1)}, got {cfg.tokens_per_micro_batch}; use more tokens or fewer cp ranks")
    try:
        mesh_shape = parallel.plan_sizes(world, **sizes, has_experts=has_experts)
    except ValueError as err:
        sys.exit(f"parallel knobs (--pp, --dp_replicate, --dp_shard, --cp, --tp, --ep, --etp) for {world} process(es): {err}")
    try:  # the pipeline's knobs, checked whatever --pp is (the pipeline checks the split of its stages itself)
        pp_layers = [int(n) for n in cfg.pp_layers.split(",")] if cfg.pp_layers else None
    except ValueError:
        sys.exit(f"--pp_layers: expected comma-separated layer counts like 3,2,2,1, got {cfg.pp_layers!r}")
    try:
        parallel.check_schedule(cfg.pp_schedule, cfg.pp_virtual)
        if cfg.pp == 1 and pp_layers is not None:
            parallel.stage_layers(cfg.model.n_layers, cfg.pp_virtual, pp_layers)
    except ValueError as err:
        sys.exit(f"pipeline knobs (--pp_schedule, --pp_virtual, --pp_layers) at --pp={cfg.pp}: {_pp_knobs(err)}")
    if cfg.pp == 1 and (given := [f"--{n}={getattr(cfg, n)}" for n in ("pp_schedule", "pp_virtual", "pp_layers")
                                  if getattr(cfg, n) != getattr(Config(), n)]):  # ignored: no pipeline to shape
        sys.exit(f"{', '.join(given)}: shape a pipeline, and --pp=1 runs none; give --pp (2 or more stages) or leave them out")
    meshes, rank, dp_rank, dp, cp_rank = None, 0, 0, 1, 0
    # several processes, or one computing in bf16: the parallel path (FSDP2's mixed precision
    # keeps float32 master weights and sums gradients in float32; one process is a group of 1)
    if world > 1 or dtype != torch.float32:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not caller_group:  # torchrun's ranks, or one process in a group of its own
            dist.init_process_group(backend, **({} if world > 1 else dict(store=dist.HashStore(), rank=0, world_size=1)),
                                    **({"timeout": datetime.timedelta(minutes=cfg.collective_timeout)} if cfg.collective_timeout else {}))
            if world == 1:  # a refusal or an exception left it up: a later run in the process took it as a caller's
                cleanups.append(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
        # before the first collective that the knobs shape: a rank of another --lr or --seed trained on without a word, one
        # of other --steps or --ep hung in a collective of its own
        if refusal := same_command_lines(_rank_knobs(cfg)):
            sys.exit(refusal)
        meshes = parallel.build_meshes(**sizes, has_experts=has_experts, device_type=device.type)
        rank, dp_rank, dp, cp_rank = dist.get_rank(), meshes.batch.get_local_rank("dp"), meshes.dp, meshes.batch.get_local_rank("cp")
    # a new run in a folder of an earlier run's checkpoints: they would mix with this run's (each rank looks: one
    # node alone seeing them stops every rank at once, not that rank alone a minute after the others went on)
    # one run at a time in an out_dir: rank 0 holds it (before a resume's cleanup of partial checkpoints, another run's included)
    held = None  # the lock lives as long as the run (main releases it)
    if rank == 0:
        try:
            cleanups.append(OutDirLock(cfg.out_dir).release)
        except ValueError as err:  # OutDirInUse, or a directory that cannot be written
            held = str(err)
        for name in ("config.json", "metrics.jsonl"):  # refused before anything is written through them
            try:
                refuse_link(Path(cfg.out_dir) / name)
            except ValueError as err:
                held = held or f"--{err}"
    earlier = None if cfg.resume else checkpoint.latest(cfg.out_dir)
    if refusal := every_rank(held or (None if earlier is None else (
            f"--out_dir: {cfg.out_dir} holds an earlier run's checkpoints (the newest {earlier.name}); --resume continues "
            "that run; for a new one give another --out_dir, or delete them")))[0]:
        sys.exit(refusal)
    if refusal := unshared_dir(cfg.out_dir):  # a node's own disk: the first checkpoint failed, its step directory not there
        sys.exit(refusal)
    # the caller's generators are put back when the run ends (a notebook's own draws after a run, or after a refusal
    # past this point, took up from --seed's state)
    generators = torch.get_rng_state(), random.getstate(), torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    cleanups.append(lambda: (torch.set_rng_state(generators[0]), random.setstate(generators[1]),
                             generators[2] is not None and torch.cuda.set_rng_state_all(generators[2])))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # the vocabulary of token files without an index: the model's where it is given (--model.vocab_size, or a released or
    # upcycled model's own); a prepared file's index gives its own (the default 258 is byte data's, not a token file's)
    given_vocab = bool(cfg.data) and (hf_type is not None or bool(cfg.upcycle_from) or "vocab_size" in cfg.model_overrides)
    refusal, val_batches, val_sources = None, [], []
    try:  # one source or a weighted blend; each micro-batch comes from one source, in the weights' proportions
        corpus = load_blend(cfg.data or None, separator=cfg.separator if cfg.separator >= 0 else None,
                            vocab_size=cfg.model.vocab_size if given_vocab else None, dtype=cfg.data_dtype or None)
        train_set, val_set = corpus.split(cfg.val_percent) if cfg.eval_batches else (corpus, None)
        sampler = BlendSampler(train_set, cfg.tokens_per_micro_batch, seed=cfg.seed, mtp_depth=cfg.model.mtp_depth,
                               whole_documents=cfg.whole_documents)
    except (OSError, ValueError) as err:
        message = str(err) if str(err).startswith("data:") else f"data: {err}"
        # the loader's arguments, as this command line spells them, where the message names them as such ("separator,
        # vocab_size: required"), not where it speaks of a vocabulary ("byte tokens (vocab_size 258)", which no knob mends)
        flags = [flag for word, flag in (("separator", "--separator=ID"), ("vocab_size", "--model.vocab_size=V"),
                                         ("dtype", "--data_dtype=uint16|uint32")) if re.search(rf"\b{word}[,:]", message)]
        refusal = message + (f" (on this command line: {', '.join(flags)})" if flags else "")
    try:
        if refusal is None and val_set is not None:
            val_batches = val_set.validation_batches(cfg.tokens_per_micro_batch, cfg.eval_batches, mtp_depth=cfg.model.mtp_depth,
                                                     whole_documents=cfg.whole_documents)
            val_sources = val_set.validation_sources(cfg.eval_batches)  # the source of each validation batch
    except ValueError as err:
        refusal = (f"--eval_batches={cfg.eval_batches}: the validation split ({cfg.val_percent}% of the documents) is too small "
                   f"({err}); lower --eval_batches (0: no validation) or raise --val_percent")
    # each rank read the data itself: a file one node lacks (or holds another copy of) stops every rank, said once
    data = None if refusal else (len(train_set), train_set.n_tokens, *((len(val_set), val_set.n_tokens) if val_set is not None else ()))
    refusal, _ = every_rank(refusal, data, lambda every: "--data: the ranks read different data (" + "; ".join(
        f"rank {r}: {d[0]} documents, {d[1]:,} tokens" + (f" + {d[2]} documents, {d[3]:,} tokens for validation" if len(d) > 2 else "")
        for r, d in enumerate(every)) + "); each rank reads the files itself: every node must hold the same ones (a stale copy "
        "on one node, or files still being written?)")
    if refusal:
        sys.exit(refusal)

    # a released model keeps its vocabulary (the data must be tokenized with its tokenizer)
    released = hf_type is not None or bool(cfg.upcycle_from) and fmoe.hf.is_hf_folder(cfg.upcycle_from)
    if released and corpus.vocab_size > cfg.model.vocab_size:
        sys.exit(f"--{'upcycle_from' if cfg.upcycle_from else 'init_from_hf'}: the data's {corpus.vocab_size} token ids do not fit the "
                 f"model's vocab_size {cfg.model.vocab_size} (tokenize the data with the model's tokenizer: --data=tokens.bin --separator=...)")
    folder = Path(cfg.upcycle_from or cfg.init_from_hf)
    tokenizer = next((folder / name for name in ("tokenizer.json", "tokenizer.model") if (folder / name).is_file()), None) if released else None
    if tokenizer is not None and corpus.byte_tokens:  # its ids are the tokenizer's: bytes read as them train the model on other text
        sys.exit(f"--data: the model of --{'upcycle_from' if cfg.upcycle_from else 'init_from_hf'} reads the ids of its tokenizer "
                 f"({str(tokenizer)!r}), the data is bytes; tokenize the data with it (python -m fmoe.train.prepare SRC OUT "
                 f"--tokenizer={tokenizer})")
    if not released and corpus.byte_tokens and cfg.model.vocab_size != corpus.vocab_size:  # it would be the corpus's, silently
        sys.exit(f"--model.vocab_size={cfg.model.vocab_size}: byte data has a vocabulary of {corpus.vocab_size} (256 bytes, the "
                 "separator and padding), which the model takes; leave the knob out (it sizes token files' vocabularies)")
    if corpus.byte_tokens and (cfg.data_dtype or cfg.separator >= 0):  # token files' knobs: bytes have their own separator
        knob = f"--data_dtype={cfg.data_dtype}" if cfg.data_dtype else f"--separator={cfg.separator}"
        sys.exit(f"{knob}: applies to token files; this run's data is bytes (text files or the embedded corpus)")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size if released else corpus.vocab_size)
    # each rank read its data's index and --init_from_hf's config.json itself: one model on every rank, or none
    if refusal := every_rank(None, json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str), _differing_models)[0]:
        sys.exit(refusal)
    defaults = Config()
    if cfg.mtp_lambda != defaults.mtp_lambda and model_cfg.mtp_depth == 0:
        sys.exit(f"--mtp_lambda: weighs the MTP losses; --model.mtp_depth=0 has none (got --mtp_lambda={cfg.mtp_lambda})")
    if not model_cfg.expert_bias and (cfg.bias_rate != defaults.bias_rate or cfg.bias_update != defaults.bias_update):
        knob = "--bias_rate" if cfg.bias_rate != defaults.bias_rate else "--bias_update"
        sys.exit(f"{knob}: steps the routers' expert bias; this model has none (--model.expert_bias=false)")
    with torch.device("meta"):  # the whole model's shapes and MoE layer names, allocating nothing
        whole = Transformer(model_cfg)
    moe_names = list(whole.moe_layers())
    trainable = [name for name, p in whole.named_parameters() if p.requires_grad]  # before --train_only freezes some
    n_moa = len(whole.moa_attentions())  # a mixture of attention heads: its routers' balance loss, averaged over them
    trained_names = None  # --train_only: a regex naming some of the model's parameters
    if cfg.train_only:
        try:
            trained_names = re.compile(cfg.train_only)
        except re.error as err:
            sys.exit(f"--train_only={cfg.train_only!r}: not a regular expression ({err})")
        if not _trains(trainable, cfg.train_only):
            sys.exit(f"--train_only={cfg.train_only!r}: matches none of the model's trainable parameter names "
                     f"(e.g. {next(whole.named_parameters())[0]!r})")

    def freeze(m: torch.nn.Module) -> torch.nn.Module:
        """--train_only: the parameters it does not name stop requiring gradients (before sharding); the model's frozen
        ones (block-sparse attention's indexers) stay frozen."""
        if trained_names is not None:
            for name, p in m.named_parameters():
                p.requires_grad_(p.requires_grad and trained_names.search(name) is not None)
        return m
    pipe, precision = None, dict(param_dtype=dtype if dtype != torch.float32 else None, reduce_dtype=torch.float32)
    if meshes is None:  # initial weights: a function of --seed and each parameter's name
        model = freeze(Transformer(model_cfg).to(device=device))
        model.reset_parameters(seed=cfg.seed)
    elif cfg.pp == 1:  # built on the meta device, sharded, then each rank allocates and initialises its own shards
        model = whole
        try:  # float32 master weights; FSDP2 computes in dtype (the router stays float32)
            parallel.parallelize(freeze(model), meshes, **precision)
        except ValueError as err:
            sys.exit(f"parallel knobs: {err}")
        parallel.materialize(model, device, seed=cfg.seed)  # the same weights as one process's
    else:  # pipeline: this rank's stages, each a pruned Transformer built on meta, sharded, materialised
        try:
            pipe = parallel.Pipeline(
                model_cfg, meshes, schedule=cfg.pp_schedule, virtual=cfg.pp_virtual, loss_fn=lambda *a: stage_loss(*a),
                tokens=cfg.tokens_per_micro_batch // cfg.cp, device=device, dtype=dtype, layers_per_stage=pp_layers, **precision,
                parallelize=lambda m: parallel.parallelize(freeze(m), meshes, **precision),
                materialize=lambda m: parallel.materialize(m, device, seed=cfg.seed))
            for n in {-(-b // dp) for _, b in parse_batch_schedule(cfg.batch_schedule)}:
                pipe.check_micro_batches(n)
        except ValueError as err:
            sys.exit(f"pipeline knobs (--pp, --pp_schedule, --pp_virtual, --pp_layers, --batch_schedule): {_pp_knobs(err)}")
        model = None
    # this rank's part of the model: the whole model, or its pipeline stages (each with the
    # whole model's parameter names; optimizers and checkpoints take them as a list)
    parts = pipe.chunks if pipe is not None else [model]
    # a sparse attention's indexers trained by their loss (DeepSeek sparse attention's, block-sparse attention's, compressed sparse attention's)
    index_loss = (model_cfg.index_topk is not None or model_cfg.index_topk_blocks is not None or bool(model_cfg.csa_layers)) and model_cfg.index_loss_coeff > 0
    if hf_type is not None:  # each rank reads the tensors of its own parameters (blocks of them when sharded)
        for part in parts:
            fmoe.hf.load_weights(part, cfg.init_from_hf, model_type=hf_type)
    compiled_before = _compile_counts()
    forward = torch.compile(model) if cfg.compile and pipe is None else model
    if cfg.compile and pipe is not None:  # each stage's model, in place: the schedule calls it
        for chunk in pipe.chunks:
            chunk.compile()
    if cfg.bias_update not in ("sign", "proportional"):
        sys.exit(f"--bias_update: expected sign or proportional, got {cfg.bias_update!r}")
    if cfg.ns_dtype not in ("bfloat16", "float32") or cfg.adamw_state_dtype not in ("bfloat16", "float32"):
        sys.exit(f"--ns_dtype, --adamw_state_dtype: expected bfloat16 or float32, got {cfg.ns_dtype!r}, {cfg.adamw_state_dtype!r}")
    ns_dtype, state_dtype = getattr(torch, cfg.ns_dtype), getattr(torch, cfg.adamw_state_dtype)
    # parameter groups by one helper for every optimizer: no decay on norms, biases, gates;
    # one set of optimizers per part (a pipeline rank's stages each have their own)
    groups = dict(muon_lr=cfg.lr, adamw_lr=cfg.lr, weight_decay=cfg.weight_decay, decay_embeddings=cfg.decay_embeddings)
    adamw = functools.partial(AdamW, state_dtype=state_dtype)
    optimizers = []  # none for a part with nothing to train (a pipeline stage that --train_only leaves frozen)
    for part in parts:
        if cfg.optimizer == "adamw":
            adamw_groups = split_param_groups(part, muon=False, **groups)[1]
            optimizers += [adamw(adamw_groups, lr=cfg.lr)] if adamw_groups else []
        elif cfg.optimizer == "muon":  # sharded: each matrix orthogonalised on one rank, the result redistributed
            muon = Muon if meshes is None else functools.partial(parallel.DistributedMuon, model=part)
            optimizers += build_optimizers(part, **groups, ns_dtype=ns_dtype, muon_cls=muon, adamw_cls=adamw)
        else:
            sys.exit(f"--optimizer: expected adamw or muon, got {cfg.optimizer!r}")
    for opt in optimizers:  # the schedule scales each group's own lr
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]

    # the schedule gives a factor on each group's lr; checked once here, with a message
    warmup = _warmup_steps(cfg)
    wsd_decay = cfg.wsd_decay if cfg.wsd_decay >= 0 else math.ceil((cfg.steps - warmup) / 5)
    schedule = _lr_schedule(vars(cfg), warmup, wsd_decay)
    try:
        lr_at(0, **schedule)
        batch_size_at(0, cfg.batch_schedule)
    except ValueError as err:
        sys.exit(f"schedule knobs (--steps, --warmup, --lr, --min_lr, --init_lr, --lr_style, --wsd_decay, --wsd_style, --batch_schedule): {err}")

    step, tokens_seen = 0, 0
    # a resumed run: rank 0 removes the .tmp folders of saves a stop interrupted once the resume is taken (after its
    # refusals: a refused resume leaves out_dir as it was), before the first collective of the run (no save is in flight yet)
    partial = sorted(p.name for p in Path(cfg.out_dir).glob("step_*.tmp")) if cfg.resume else []  # interrupted saves
    path = checkpoint.latest(cfg.out_dir) if cfg.resume else None
    if cfg.resume and (refusal := every_rank(None, None if path is None else str(path), lambda found: (  # each rank listed out_dir
            f"--resume: the ranks found different newest checkpoints in {cfg.out_dir} ("
            + ", ".join(f"rank {r}: {Path(p).name if p else 'none'}" for r, p in enumerate(found)) + "); every rank must see the same files"))[0]):
        sys.exit(refusal)
    if cfg.resume and rank == 0:  # newer step_N folders latest() passed over (files missing: a copy stopped part way): said, not silent
        for p, why in checkpoint.passed_over(cfg.out_dir):
            print(f"--resume: {p.name} is not a whole checkpoint ({why}): passed over"
                  + (f" for {path.name}" if path else "") + f"; move it out of {cfg.out_dir} (or remove it)", flush=True)
    if cfg.resume and path is None and rank == 0:  # a requeued job's first start, or an out_dir of another name: said, not silent
        logged = Path(cfg.out_dir) / "metrics.jsonl"
        steps = sum(1 for line in logged.read_text().splitlines() if line.strip()) if logged.is_file() else 0
        print(f"--resume: no complete checkpoint in {cfg.out_dir}: a new run from step 1"
              + (f" (the partial {', '.join(partial)} of an interrupted save removed)" if partial else "")
              + (f"; the {steps} steps its metrics.jsonl logged start again" if steps else ""), flush=True)
    if path:
        # a resumed run continues its model: a knob that would change it stops the run (how the model runs may change)
        try:
            changed = _model_changes(path, model_cfg)
        except checkpoint.UnknownKnobs as err:  # a run of a newer fmoe: continuing it here would drop its knobs from config.json
            sys.exit(f"--resume: {err}")
        except ValueError as err:  # no config.json (or a damaged one) to check the knobs against: another model would train on
            sys.exit(f"--resume: {err}; a resumed run checks its --model.* knobs against the run's config.json: put it back, or start "
                     f"a new run from the checkpoint's weights with --init_from={path}")
        if changed:
            sys.exit(f"--resume: the run in {cfg.out_dir} was trained with {checkpoint.knob_list(changed)}; a resumed run continues "
                     "its model: give the --model.* knobs (and --init_from_hf or --upcycle_from) it was started with, or start a new run from its weights "
                     "with --init_from")
        saved = saved_config(cfg.out_dir).get("config")
        if isinstance(saved, dict) and (was := saved.get("optimizer", cfg.optimizer)) != cfg.optimizer:  # its state another's entries
            sys.exit(f"--resume: the run in {cfg.out_dir} trained with --optimizer={was} (here {cfg.optimizer}); a resumed run continues "
                     "its optimizer state: give the same --optimizer, or start a new run from its weights with --init_from")
        if isinstance(saved, dict) and _trains(trainable, was := saved.get("train_only", cfg.train_only)) != _trains(trainable, cfg.train_only):
            # the optimizers' state is its parameters': another regex that names the same ones resumes
            sys.exit(f"--resume: the run in {cfg.out_dir} trained with --train_only={was!r} (here {cfg.train_only!r}); a resumed run "
                     "trains the parameters it did, whose optimizer state its checkpoint holds: give the same --train_only, or start "
                     "a new run from its weights with --init_from")
        try:
            # knobs="held": the groups keep this run's knobs (--lr, --weight_decay, --decay_embeddings, --ns_dtype, ...), or the
            # checkpoint's would run while the log and config.json say these
            extra = checkpoint.load(path, model=parts, optimizers=optimizers, knobs="held")
        except (FileNotFoundError, ValueError) as err:  # a model of other knobs than the saved one's, a damaged checkpoint
            damaged = "could not be read" in str(err)  # --resume reads the newest complete one: how to take an earlier one
            sys.exit(f"--resume: {err}" + (f"\n--resume starts from the newest checkpoint in {cfg.out_dir}: to resume from an earlier one, "
                                           f"move {path.name} out of it" if damaged else ""))
        step, tokens_seen = extra["step"], extra["tokens_seen"]
        try:
            sampler.load_state_dict(extra["sampler"])
        except ValueError as err:  # the data, their split or the sampler's seed changed
            sys.exit(f"--resume: the run in {cfg.out_dir} read other data ({err}); a resumed run continues its data: give the --data "
                     "(and --separator, --data_dtype), --seed and --val_percent it was started with (and --eval_batches=0 if it was, or not: 0 holds no document out for "
                     "validation), or start a new run from its weights with --init_from")
        checkpoint.set_rng_state(extra["rng"])
        if rank == 0:
            print(f"resumed from {path} at step {step}")
            if step < last and (note := _schedule_change(cfg.out_dir, step, cfg, schedule)):
                print(note, flush=True)
            if step < last and (changed := _training_changes(saved, cfg)):
                print(f"note: this resumed run trains with {', '.join(changed)}: a resumed run trains with the knobs given to it, not "
                      "the run's; give the run's to keep them", flush=True)
            if cfg.upcycle_from and (moved := _upcycle_changes(saved, cfg)):
                print(f"note: {', '.join(moved)}: a resumed run continues its own weights, so --upcycle_from gives only the model's "
                      "knobs and --upcycle_drop nothing (config.json's earlier_runs keep what the run was upcycled from)", flush=True)
    elif cfg.init_from:  # the weights only: a new run (step 0, fresh optimizer, schedules and sampler)
        try:
            path = checkpoint.load_model(cfg.init_from, model=parts)
        except (FileNotFoundError, RuntimeError, ValueError) as err:
            said = str(err).removeprefix("path: ")
            try:  # a dense run's weights into an MoE: the tool for that is --upcycle_from
                saved = checkpoint.run_config(cfg.init_from)[0]
                if all(not saved.is_moe(i) for i in range(saved.n_layers)) and any(model_cfg.is_moe(i) for i in range(model_cfg.n_layers)):
                    said += f"; to start an MoE from a dense run's weights: --upcycle_from={cfg.init_from}"
            except (OSError, ValueError):
                pass
            sys.exit(f"--init_from: {said}")
        if rank == 0:
            print(f"initialised from the weights of {path}")
            try:  # knobs that leave the shapes as they were load, and make another model of the weights: said, not refused
                changed = _model_changes(path, model_cfg)
            except ValueError:  # no run config beside the checkpoint: nothing to compare with
                changed = {}
            if changed:
                print(f"note: --init_from: its weights were trained with {checkpoint.knob_list(changed)}: they fit this model's "
                      "shapes, and this model computes another function of them", flush=True)
    elif cfg.upcycle_from:  # a dense run's weights, its FFNs cut into the experts: the dense model's function at step 0
        refusal, found, dense_state = None, None, None
        try:
            if fmoe.hf.is_hf_folder(cfg.upcycle_from):  # read whole, in the dtype its config.json names (bf16: half of float32)
                stored = fmoe.hf.config_dtype(fmoe.hf.read_config(cfg.upcycle_from)[0])
                hf_model = fmoe.hf.from_pretrained(cfg.upcycle_from, mtp_depth=0, dtype=stored)[0]
                dense_cfg, dense_state = hf_model.cfg, hf_model.state_dict()
                del hf_model  # its tensors live on in dense_state, until the upcycling is done
            else:  # an fmoe run's checkpoint (its newest, found by each rank), read one tensor at a time
                dense_cfg, dense_state = checkpoint.run_config(cfg.upcycle_from)[0], checkpoint.ModelTensors(cfg.upcycle_from)
                found = str(dense_state.path)
            upcycle_(parts, dense_state, dense_cfg, seed=cfg.seed, drop=cfg.upcycle_drop)
        except (OSError, ValueError) as err:
            refusal = f"--upcycle_from: {err}"
        # each rank read the dense model itself, with no collective: a rank's refusal is every rank's, and so is its checkpoint
        if refusal := every_rank(refusal, (found, None), lambda every: f"--upcycle_from: {checkpoint.differing_checkpoints(every)}")[0]:
            sys.exit(refusal)
        if rank == 0:
            drawn = round(cfg.upcycle_drop * model_cfg.ffn_expert)
            print(f"upcycled from the dense model of {found or cfg.upcycle_from}: {model_cfg.n_experts} experts, each a slice of "
                  f"1/{granularity(model_cfg, dense_cfg)} of its FFN" + (f", {cfg.upcycle_drop:.0%} of each one's channels ({drawn} of "
                                                                          f"{model_cfg.ffn_expert}) drawn afresh" if cfg.upcycle_drop else ""))
            if model_cfg.capacity_factor is not None:  # the fresh router rows send most tokens to one group at first
                print(f"note: --model.capacity_factor={model_cfg.capacity_factor:g} drops the slots past each expert's capacity, so the "
                      "upcycled model does not start as the dense model's function: its fresh routers send most tokens to a few experts "
                      "at first (one run dropped 69% of the slots at step 1); train without a capacity until the loads even out",
                      flush=True)
        del dense_state
    if profile_steps is not None and profile_steps[1] <= step < last:  # a resumed run: those steps were run before it
        sys.exit(f"--profile: steps {cfg.profile} were run before this resume (from step {step}); profile steps after it")
    # records are logged for completed steps step+1, step+2, ...: keep the ones up to step (after the refusals: a refused
    # resume leaves metrics.jsonl as it was); a resume with nothing to train opens no logger, so the records past it stay
    try:
        logger = metrics.MetricsLogger(cfg.out_dir, rank=rank, total_steps=cfg.steps, start_step=step + 1,
                                       tensorboard=cfg.tensorboard) if step < last else None
    except ImportError as err:
        sys.exit(f"--tensorboard: {err}")
    if logger is not None:
        cleanups.append(logger.close)  # a second close does nothing; an interrupted run's TensorBoard writer ended too
    if rank == 0:  # the resume is taken: the interrupted saves go (the run's next collective, every_rank below, comes after)
        for name in partial:
            shutil.rmtree(Path(cfg.out_dir) / name, ignore_errors=True)
    peak = metrics.peak_flops(device)
    # run health at start: this rank's theoretical memory (parameters, gradients, optimizer
    # states; activations come on top) and whether energy can be read (NVML, CUDA only)
    plan = metrics.memory_plan(parts, optimizers, grad_dtype=torch.float32)
    # the ranks' plans differ (a pipeline's last stage holds the head, uneven shards): the largest is the one to fit
    _, totals = every_rank(None, plan["total"])
    largest = max(range(len(totals)), key=lambda r: totals[r])
    plan = {**plan, "largest_total": totals[largest], "largest_rank": largest}
    energy = metrics.EnergyMeter(device)
    if meshes is not None:  # every rank's device summed, or none: each reading is then a collective of every rank
        energy.agree(dist.group.WORLD, device)
    if rank == 0:
        n_params = sum(p.numel() for p in whole.parameters())
        n_active = metrics.active_parameters(whole)  # zero experts: at most
        first_step = cfg.tokens_per_micro_batch * batch_size_at(tokens_seen, cfg.batch_schedule)
        mesh = " ".join(f"{k}={v}" for k, v in mesh_shape.items() if v > 1) or "one process"
        if pipe is not None:
            mesh += (f"; pipeline {cfg.pp_schedule}, {pipe.n_stages} stages of layers "
                     + " ".join(f"{r.start}-{r.stop - 1}" for r in pipe.layers) + " (embedding on the first, head and MTP on the last)")
        n_mtp_moe = sum(name.startswith("mtp") for name in moe_names)  # the MTP modules' MoE layers, said apart from the trunk's
        layers = f"{len(moe_names) - n_mtp_moe} MoE layer{'s' if len(moe_names) - n_mtp_moe != 1 else ''}" + (
            f" and {n_mtp_moe} in the MTP module{'s' if n_mtp_moe > 1 else ''}" if n_mtp_moe else "")
        print(f"model: {n_params / 1e6:.2f}M parameters, {'at most ' if model_cfg.zero_experts else ''}{n_active / 1e6:.2f}M active per token ({layers}, each of "
              f"{model_cfg.n_experts} experts{f' and {model_cfg.zero_experts} zero experts' if model_cfg.zero_experts else ''}, "
              f"top-{model_cfg.k})\n"
              f"data: {cfg.data or 'the stdlib corpus'}: {len(train_set)} documents, {train_set.n_tokens:,} tokens "
              f"({f'+ {len(val_set)} documents, {val_set.n_tokens:,} tokens for validation' if val_set is not None else 'no validation: --eval_batches=0'}); "
              f"{first_step} tokens per step now (--batch_schedule={cfg.batch_schedule!r})\n"
              + ("".join(f"  source {n}: weight {w:.3f}, {len(d)} documents, {d.n_tokens:,} tokens\n"
                         for n, w, d in zip(train_set.names, train_set.weights, train_set.datasets)) if len(train_set.names) > 1 else "") +
              f"run: {cfg.steps} steps on {device} x {world} ({mesh}), {dtype}; warmup {warmup} steps"
              f"{' (a tenth of this short run)' if cfg.warmup < 0 and warmup < 20 else ''}; out_dir {cfg.out_dir}", flush=True)
        if warmup >= cfg.steps and cfg.lr > cfg.init_lr:  # step n trains at the rate after n - 1 steps: the last below the peak
            print(f"note: the warmup ({warmup} steps, --warmup) lasts the whole run (--steps={cfg.steps}): no step trains at --lr={cfg.lr:g} "
                  f"(the last at {cfg.lr * lr_at(cfg.steps - 1, **schedule):.4g})", flush=True)
        softmax_top1 = model_cfg.score == "softmax" and not model_cfg.pre_softmax
        if model_cfg.k == 1 and (softmax_top1 or (model_cfg.score == "sqrtsoftplus" and model_cfg.route_normalize)):  # released checkpoints'
            balance = [f"--{name}={getattr(cfg, name):g}" for name in ("seq_aux_coeff", "aux_coeff", "z_coeff") if getattr(cfg, name)]
            how = ("top-1 softmax routing takes the softmax over the one chosen logit" if softmax_top1 else
                   "top-1 sqrtsoftplus routing renormalises the one chosen score (--model.route_normalize)")
            print(f"note: {how}: every weight is 1, and the routers learn "
                  + (f"from the balance losses alone ({', '.join(balance)})" if balance else "nothing (no balance loss is on)")
                  + ("; --model.pre_softmax=true weighs each token by its softmax over all the experts (Switch Transformer's)" if softmax_top1
                     else "; --model.route_normalize=false keeps sqrt(softplus(logit)) as the weight (Megatron's)"), flush=True)
        planned = tokens_seen  # the tokens the run reads up to --steps, by the batch schedule
        pairs = parse_batch_schedule(cfg.batch_schedule)
        for done in range(step, cfg.steps):
            if planned >= pairs[-1][0]:  # the last batch size from here on: the rest at once (--steps=1e12 planned for hours)
                planned += (cfg.steps - done) * cfg.tokens_per_micro_batch * pairs[-1][1]
                break
            planned += cfg.tokens_per_micro_batch * batch_size_at(planned, pairs)
        passes = (planned - tokens_seen) / max(train_set.n_tokens, 1)
        if passes > 1:  # a small corpus: the run sees each document many times (it overfits), which nothing said
            print(f"note: {'the rest of ' if step else ''}the run reads {planned - tokens_seen:,} tokens, {passes:.1f} passes over the "
                  f"{train_set.n_tokens:,} training tokens (--steps={cfg.steps}, --batch_schedule={cfg.batch_schedule!r})", flush=True)
        for name, d in zip(train_set.names, train_set.datasets):  # a corpus in one file is not shuffled: say so
            big = int(d.lengths.argmax()) if len(d) else 0
            if len(d) and d.lengths[big] >= d.n_tokens / 4 and d.lengths[big] > 8 * first_step:
                print(f"note: one document{f' ({d.names[big]})' if d.names else ''} holds {d.lengths[big] / d.n_tokens:.0%} of the training "
                      f"tokens of {name if len(train_set.names) > 1 else 'the data'} ({d.lengths[big] // first_step:,} steps of them): the "
                      "sampler shuffles documents, not the windows of one, so its micro-batches come as one run of consecutive text; "
                      "split it into documents (files, or separator ids in a token file) to shuffle it", flush=True)
        gib = {k: round(plan[k] / 2**30, 4) for k in ("params", "grads", "optimizer", "total")}
        print(f"memory per rank (theory, before activations): parameters {gib['params']} GiB, gradients {gib['grads']} GiB, "
              f"optimizer states {gib['optimizer']} GiB, total {gib['total']} GiB"
              + (f" (rank 0; the largest, rank {largest}'s: {round(totals[largest] / 2**30, 4)} GiB)" if totals[largest] > plan["total"] else "")
              + ("" if energy.available else f"; energy not measured ({energy.reason})"), flush=True)
    if rank == 0 and step < last:  # a resumed run at its last step trains nothing: its config.json stays the run's
        write_config(cfg.out_dir, dataclasses.asdict(cfg), world_size=world, mesh=mesh_shape, device=str(device),
                     memory_plan=plan, energy={"measured": energy.available, "reason": energy.reason},
                     peak_flops=peak,  # mfu's denominator: the device's datasheet dense bf16 FLOP/s (metrics.peak_flops), None if unknown
                     dtype=str(dtype), warmup=warmup, wsd_decay=schedule["wsd_decay"], vocab_size=model_cfg.vocab_size, byte_tokens=corpus.byte_tokens,
                     data_sources=[dict(name=n, weight=w, path=None if p is None else str(Path(p).resolve()), **_tokenizer_named(p))
                                   for n, w, p in zip(corpus.names, corpus.weights, corpus.paths)])

    def micro_batch_loss(losses, stats, batch, valid, n_micro, part):
        """One micro-batch's share of the step's loss (a tensor; None when there is nothing
        to add) and the values to log (tensors), from the model's losses (None on a pipeline
        stage before the last, which adds only its own MoE layers' balancing losses), MoE
        stats and the model that ran (`part`: the whole model, or a pipeline stage's).
        The step logs each value summed over its micro-batches and ranks: a value of one's
        own is logged as this micro-batch's share of the step's (a mean over the micro-batch
        divided by n_micro, as index_loss is; a sum over its tokens divided by valid["lm"],
        as lm_loss is), its key added to the record's keys where the step starts (`record`)."""
        loss, logged = None, {}
        if losses is not None:
            loss = losses["lm_sum"] / valid["lm"]
            logged["lm_loss"] = loss.detach()
            for d in range(1, model_cfg.mtp_depth + 1):
                mtp_loss = losses[f"mtp_{d}_sum"] / valid[d]
                loss = loss + cfg.mtp_lambda / model_cfg.mtp_depth * mtp_loss
                logged[f"mtp_{d}_loss"] = mtp_loss.detach()
        index = part.index_loss_sum() if index_loss else None  # the indexers' losses (this part's layers)
        if index is not None:  # trained apart: their gradients were added in the backward
            logged["index_loss"] = index / n_micro
        moa = part.moa_aux_loss_sum() if n_moa else None  # the attention routers' balance losses, likewise
        if moa is not None:
            logged["moa_aux_loss"] = moa / (n_moa * n_micro)
        if not len(stats.keys()):  # no MoE layer here (a dense model, or a pipeline stage without one)
            return loss, logged
        # balancing losses: averaged over layers and micro-batches (a layer's sequences are
        # the micro-batch's documents; its cu_seqlens were checked when the batch was made)
        scale = 1.0 / (len(moe_names) * n_micro)
        T, k, cu_seqlens = batch["input_ids"].shape[0], model_cfg.k, batch["cu_seqlens"]
        # --whole_documents: the padding (token_mask False) is not routed, and the losses
        # leave it out (their means run over the routed tokens: routed_tokens under cp)
        mask = batch["token_mask"] if "token_mask" in batch.keys() else None
        if meshes is None or meshes.cp * meshes.tp == 1:
            n_tokens = T if mask is None else mask.sum()
            terms = {
                "seq_aux_loss": (cfg.seq_aux_coeff, lambda n, s: ops.seq_load_balancing_loss(s["aux_scores"], s["aux_experts"], cu_seqlens, k=k,
                                                                                             check=False, mask=mask)),
                "aux_loss": (cfg.aux_coeff, lambda n, s: ops.load_balancing_loss(s["aux_scores"], s["aux_counts"], k=k, n_tokens=n_tokens)),
                "z_loss": (cfg.z_coeff, lambda n, s: ops.z_loss(s["router_logits"], mask=mask)),
            }
        else:  # the micro-batch's tokens are split over the cp x tp ranks (context parallel: this
            # rank's two chunks, batch["token_index"]; sequence parallel: a T/tp slice of those):
            # the MoE stats cover this rank's tokens, and each term is its exact share of the
            # micro-batch's (the ranks' shares and their gradients add up to one process's)
            group, n_tokens, t = meshes.token_mesh, T * meshes.cp, T // meshes.tp
            start = meshes.tp_mesh.get_local_rank() * t
            index = (batch["token_index"] if meshes.cp > 1 else torch.arange(T, device=device))[start:start + t]
            if mask is not None:
                n_tokens = batch["routed_tokens"] if meshes.cp > 1 else mask.sum()
                mask = mask[start:start + t]
            # the counts over the whole micro-batch: one collective for all layers per loss
            aux_counts = seq_losses = {}
            if cfg.aux_coeff:
                aux_counts = parallel.all_reduce_counts({n: s["aux_counts"] for n, s in stats.items()}, group,
                                                        names=moe_names, n_experts=model_cfg.n_choices)
            if cfg.seq_aux_coeff:
                seq_losses = parallel.seq_load_balancing_losses_split(
                    {n: s["aux_scores"] for n, s in stats.items()}, {n: s["aux_experts"] for n, s in stats.items()}, cu_seqlens,
                    k=k, group=group, names=moe_names, n_experts=model_cfg.n_choices, token_index=index, check=False, mask=mask)
            terms = {
                "seq_aux_loss": (cfg.seq_aux_coeff, lambda n, s: seq_losses[n]),
                "aux_loss": (cfg.aux_coeff, lambda n, s: ops.load_balancing_loss(s["aux_scores"], aux_counts[n], k=k, n_tokens=n_tokens)),
                "z_loss": (cfg.z_coeff, lambda n, s: parallel.z_loss_split(s["router_logits"], n_tokens=n_tokens, mask=mask)),
            }
        for name, (coeff, term) in terms.items():
            if coeff:
                value = sum(term(layer_name, layer) for layer_name, layer in stats.items()) * scale
                loss = coeff * value if loss is None else loss + coeff * value
                logged[name] = value.detach()
        return loss, logged

    def run_micro_batch(batch, valid, n_micro):
        """Forward of one micro-batch (on the device): its share of the step's loss, the
        values to log (tensors) and the MoE stats."""
        losses, stats = forward(batch, model.context(batch))
        loss, logged = micro_batch_loss(losses, stats, batch, valid, n_micro, model)
        return loss, logged, stats

    # pipeline stages compute their part of the loss inside the schedule: the step's
    # valid-token counts and micro-batch count are set here before each step
    step_state = {}

    def stage_loss(losses, stats, batch, stage):
        return micro_batch_loss(losses, stats, batch, step_state["valid"], step_state["n_micro"], stage)

    def split(host_batch):
        """This rank's share of a micro-batch under context parallelism (its two load-balanced
        chunks, with their token_index); the micro-batch itself otherwise."""
        return parallel.split_batch(host_batch, cp_rank, meshes.cp) if meshes is not None and meshes.cp > 1 else host_batch

    def train_batch(host_batch):
        """This rank's share of a training micro-batch, on the device; compiled, its document
        count is dynamic (it varies by micro-batch: one graph for all; a graph that needs a
        count fixed, e.g. of one document, is compiled again for others, never an error)."""
        batch = split(host_batch).to(device, non_blocking=True)
        if cfg.compile:
            torch._dynamo.maybe_mark_dynamic(batch["cu_seqlens"], 0)
        return batch

    # each source's validation tokens (host counts, once): the per-source means divide by them; the training sources'
    # order, then those of validation data of its own (a held-out set under another name: left out of val_loss before)
    val_names = [name for name in corpus.names if name in val_sources] + [name for name in dict.fromkeys(val_sources) if name not in corpus.names]
    val_counts = {name: sum(int(b["loss_mask"].sum()) for b, src in zip(val_batches, val_sources) if src == name) for name in val_names}
    left_out = [name for name in (val_set.names if val_set is not None else []) if name not in val_names]
    if rank == 0 and left_out:  # its weight's share of the batches is none: val_loss without it, and no per-source line of it
        shares = "their weights' shares" if len(left_out) > 1 else "its weight's share"
        print(f"note: validation leaves out {', '.join(map(repr, left_out))}: {shares} of the --eval_batches={cfg.eval_batches} "
              "micro-batches is none; raise --eval_batches to measure every source", flush=True)

    @torch.no_grad()
    def evaluate():
        """(mean validation loss, [n_sources] mean of each source's validation tokens in
        val_names order): tensors, converted with the step's other values."""
        for part in parts:
            part.eval()
        if pipe is not None:  # forward through the stages; the last one's ranks hold the sums
            sums = pipe.evaluate([parallel.MicroBatch(split(b).to(device)) for b in val_batches])
        else:
            sums = []
            for host_batch in val_batches:
                batch = split(host_batch).to(device)
                losses, _ = model(batch, model.context(batch))  # eager: no graphs for eval mode
                sums.append(losses["lm_sum"])
            sums = torch.stack(sums)
        zero = torch.zeros((), device=device)
        by_source = {name: zero if sums is None else sum(s for s, src in zip(sums, val_sources) if src == name) for name in val_names}
        # the ranks holding parts of the sums: the pipeline's last stage (the others add 0) and each cp rank's own tokens
        if pipe is not None:
            by_source = parallel.all_reduce_sums(by_source, meshes.pp_mesh)
        if meshes is not None and meshes.cp > 1:
            by_source = parallel.all_reduce_sums(by_source, meshes.group("cp"))
        for part in parts:
            part.train()
        total = sum(by_source.values()) / max(sum(val_counts.values()), 1)
        return total, torch.stack([by_source[name] / max(val_counts[name], 1) for name in val_names])

    # ------------------------------------------------------------------------ the loop
    run_start, first = time.perf_counter(), step
    record = None  # the last step's logged values: none where a resumed run is already at its last step
    # the first of --stop_signals, or --stop_after_minutes passed, on any rank: every rank
    # stops after the same step (the requests are summed with the step's logged values)
    with stop_requests as stop:
        while step < last:
            profiler.start_step(step + 1)
            t0 = time.perf_counter()
            lr_scale = lr_at(step, **schedule)
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["base_lr"] * lr_scale
            n_micro = batch_size_at(tokens_seen, cfg.batch_schedule)
            # data-parallel ranks take turns over the micro-batches: this rank builds its own and
            # counts the others' (their layouts: sequences, counted labels, routed tokens); a rank
            # short of one runs a masked copy of the first with zero loss, so that every rank joins
            # every collective (FSDP, EP)
            drawn = sampler.tokens_by_source()
            mine, layouts, batch_0 = [], [], None
            padding = -(-n_micro // dp) - len(range(dp_rank, n_micro, dp))
            for i in range(n_micro):
                if i % dp == dp_rank or (i == 0 and padding):
                    batch = sampler.next_batch()
                    layouts.append(batch_layout(batch))
                    if i % dp == dp_rank:
                        mine.append(batch)
                    else:
                        batch_0 = batch
                else:
                    layouts.append(sampler.next_layout())
            tokens_by_source = {name: n - drawn[name] for name, n in sampler.tokens_by_source().items()}
            # the step's valid-token counts, read on the host before the batches move: the loss
            # is a sum over tokens divided by these
            loss_tokens = sum(int(layout["loss_tokens"][0]) for layout in layouts)
            valid = {"lm": max(1, loss_tokens)}  # a step of prompts only counts none
            for d in range(1, model_cfg.mtp_depth + 1):
                valid[d] = max(1, sum(int(layout["loss_tokens"][d]) for layout in layouts))
            counts = {}
            # every key from the start: a rank with only padding sums the same keys (one collective)
            zero = torch.zeros((), device=device)
            record = dict.fromkeys(["lm_loss", *(f"mtp_{d}_loss" for d in range(1, model_cfg.mtp_depth + 1)), "seq_aux_loss", "aux_loss", "z_loss"], zero)
            if index_loss:  # each indexer's loss weighs index_loss_coeff / n_micro: the step averages the micro-batches'
                for part in parts:
                    part.set_index_loss_weight(model_cfg.index_loss_coeff / n_micro)
                record["index_loss"] = zero  # summed over the layers (each pipeline stage logs its own)
            if n_moa:  # each attention router's balance loss weighs moa_aux_coeff / (attention blocks x n_micro): the mean over both
                for part in parts:
                    part.set_moa_aux_weight(model_cfg.moa_aux_coeff / (n_moa * n_micro))
                record["moa_aux_loss"] = zero
            with phase("forward_backward"):
                if pipe is not None:  # the schedule runs forward and backward of this rank's micro-batches
                    step_state.update(valid=valid, n_micro=n_micro)
                    logged, counts = pipe.step([parallel.MicroBatch(train_batch(b), padding=i >= len(mine))
                                                for i, b in enumerate(mine + [batch_0] * padding)])
                    _add_logged(record, logged)
                for i, host_batch in enumerate(mine + [batch_0] * padding if pipe is None else []):
                    loss, logged, stats = run_micro_batch(train_batch(host_batch), valid, n_micro)
                    if i >= len(mine):
                        (loss * 0.0).backward()
                        continue
                    loss.backward()
                    _add_logged(record, logged)
                    for name, layer in stats.items():
                        counts[name] = counts.get(name, 0) + layer["tokens_per_expert"]
            record["stop_requests"] = torch.tensor(float(stop.reason() is not None), device=device)
            if meshes is not None:  # logged sums and counts over every rank, one collective each
                # the world is the batch mesh dp x cp x tp: the data ranks' values add up, and so
                # do the tp ranks' shares of the balancing losses; the LM losses, computed alike
                # on every tp rank, count once (tp rank 0's)
                if meshes.batch.get_local_rank("tp") > 0:
                    record = {name: v if name in ("seq_aux_loss", "aux_loss", "z_loss", "stop_requests") else zero
                              for name, v in record.items()}
                record = parallel.all_reduce_sums(record, dist.group.WORLD)
                counts = parallel.all_reduce_counts(counts, dist.group.WORLD, names=moe_names, n_experts=model_cfg.n_choices)
            with phase("optimizer"):  # the gradients' norm and clipping, the health norms, the step, the expert biases
                if pipe is None:
                    counted, copies, groups = list(model.parameters()), [], {}
                else:  # the first stage's embedding and the last stage's copy take the same summed gradient;
                    # the norm counts every stage's parameters once
                    pipe.sync_tied_grads()
                    counted, copies = pipe.norm_parameters()
                    groups = dict(group=meshes.stage_mesh, pp_group=meshes.pp_mesh)
                # fmoe.optim's norms: exact over parameters on several meshes (the experts' own), which torch's
                # clip_grad_norm_ refuses ("must have the same mesh"); grad_factor is fmoe AdamW's (torch's has none)
                if cfg.optimizer == "adamw":  # the clip's factor goes into AdamW's step: no pass of its own
                    norm = grad_norm(counted, **groups)
                    step_kwargs = dict(grad_factor=clip_factor(norm, cfg.clip))
                else:  # Muon and the AdamW beside it: the gradients scaled in place
                    norm, step_kwargs = clip_grad_norm(counted, cfg.clip, copies=copies, **groups), {}
                # health: the weights' norm and how many gradient entries are exactly zero (dead
                # experts, unused embedding rows), exact over the mesh, before the update
                trained = [p for p in counted if p.requires_grad]  # --train_only: the frozen ones have no gradient to count
                weight_norm, zero_grads = param_norm(counted, copies=copies, **groups), zero_grad_count(trained, copies=copies, **groups)
                for opt in optimizers:
                    opt.step(**step_kwargs)
                    opt.zero_grad(set_to_none=True)
                    if pipe is not None and cfg.pp_virtual > 1:  # a multi-stage schedule gathers a stage's FSDP shards before its
                        getattr(opt, "wait", lambda: None)()  # forward pre-hooks: DistributedMuon's updates written now, not there
                # aux-loss-free balancing: each MoE layer's bias moves by the step's actual counts (--train_only: the layers
                # whose router trains; a frozen layer's routing stays as it was)
                if model_cfg.expert_bias and cfg.bias_rate:
                    for name, moe in (layer for part in parts for layer in part.moe_layers().items()
                                      if "expert_bias" in layer[1]._buffers and layer[1].router.requires_grad):
                        moe.expert_bias.copy_(ops.update_expert_bias(moe.expert_bias, counts[name], cfg.bias_rate,
                                                                     proportional=cfg.bias_update == "proportional"))

            step += 1
            if meshes is not None and cfg.check_replicas_every > 0 and (step % cfg.check_replicas_every == 0 or step == last):
                for opt in optimizers:  # a distributed Muon's last update may still be in flight
                    getattr(opt, "wait", lambda: None)()
                # ranks holding copies of a tensor (data-parallel replicas, tp copies of norms and
                # routers, every rank's expert biases, the pipeline's embedding copy) must agree bit
                # for bit; every rank gets the same list
                bad = parallel.replica_mismatches(parts, group=meshes.stage_mesh if pipe is not None else None)
                if pipe is not None:  # and the last stage's embedding copy against the first stage's
                    bad += [f"{name} (the last stage's copy)" for name in pipe.tied_mismatches()]
                if bad:
                    sys.exit(f"step {step}: the ranks holding copies of {', '.join(bad)} disagree (a non-deterministic collective, "
                             "a corrupted rank or a bug: stopping before the copies drift further)")
            step_tokens = n_micro * cfg.tokens_per_micro_batch
            routed = sum(int(layout["routed_tokens"]) for layout in layouts)  # host values
            tokens_seen += step_tokens
            # the one transfer of the step: every logged value and count comes to the host here
            if moe_names:  # per MoE layer, in moe_names order: counts, max/mean, CV, dropped share (and the zero experts')
                record.update(metrics.layer_loads(torch.stack([counts[n] for n in moe_names]), routed * model_cfg.k,
                                                  zero_experts=model_cfg.zero_experts))
            record = metrics.to_host({**record, "grad_norm": norm, "param_norm": weight_norm, "zero_grads": zero_grads})
            stopping = record.pop("stop_requests") > 0  # the same on every rank
            seconds = time.perf_counter() - t0  # the training step's (synced by the transfer): the evaluation is timed apart
            joules = energy.joules_since_last()  # every rank's device since the last step (after the step's sync); None off CUDA
            if joules is not None:
                record.update(energy_j=joules, energy_j_per_token=joules / step_tokens)
            if val_batches and (step % cfg.eval_every == 0 or step == last):
                with phase("eval"):
                    t_eval = time.perf_counter()
                    mean, by_source = evaluate()
                    val = metrics.to_host({"loss": mean, "by_source": by_source})  # the evaluation's one transfer
                    record.update(val_loss=val["loss"], val_loss_by_source=dict(zip(val_names, val["by_source"])),  # source -> its tokens' mean
                                  eval_seconds=time.perf_counter() - t_eval)
                    energy.joules_since_last()  # the evaluation's, counted in no step's energy_j
            # attention FLOPs from the step's own documents (SPEC 8), not a full-length causal row
            n_avg_keys = sum(metrics.mean_attended_keys(b["cu_seqlens"]) for b in layouts) / n_micro
            n_avg_local = (sum(metrics.mean_attended_keys(b["cu_seqlens"], model_cfg.window, model_cfg.chunk) for b in layouts) / n_micro
                           if model_cfg.any_local else None)
            n_avg_index = (sum(metrics.mean_attended_keys(b["cu_seqlens"], model_cfg.index_topk) for b in layouts) / n_micro
                           if model_cfg.index_topk is not None else None)  # DeepSeek sparse attention's kept keys
            n_avg_block = (sum(metrics.mean_block_keys(b["cu_seqlens"], model_cfg.index_topk_blocks, model_cfg.index_block_size)
                                for b in layouts) / n_micro if model_cfg.index_topk_blocks is not None else None)  # block-sparse attention's
            # the routed experts' FLOPs at the slots they computed per step token (each MoE layer's counts, averaged): k less a
            # zero expert's slots, those a capacity dropped, and those of padding (whole documents), which route nothing
            k_computing = (sum(sum(c[:model_cfg.n_experts]) for c in record["tokens_per_expert"]) / len(moe_names) / step_tokens
                           if moe_names else None)
            n_avg_compressed = (sum(metrics.mean_compressed_entries(b["cu_seqlens"], model_cfg.compress_rate) for b in layouts) / n_micro
                                if model_cfg.compress_layers else None)  # heavily compressed attention's entries
            n_avg_csa = {name: sum(metrics.mean_compressed_entries(b["cu_seqlens"], model_cfg.csa_rate, topk) for b in layouts) / n_micro
                         for name, topk in (("n_avg_csa_entries", None), ("n_avg_csa_chosen", model_cfg.csa_topk))} if model_cfg.csa_layers else {}
            flops_per_token = metrics.model_flops_per_token(model_cfg, n_avg_keys=n_avg_keys, n_avg_local_keys=n_avg_local,
                                                            n_avg_index_keys=n_avg_index, k=k_computing, n_avg_compressed_keys=n_avg_compressed,
                                                            n_avg_block_keys=n_avg_block, **n_avg_csa)
            record.update(
                step=step, loss=record["lm_loss"], lr=cfg.lr * lr_scale, batch_size=n_micro, tokens=tokens_seen,
                loss_tokens=loss_tokens, padding_tokens=step_tokens - routed,  # of the step's tokens: trained on, and padding
                tokens_per_s=step_tokens / seconds, flops_per_token=flops_per_token, tokens_by_source=tokens_by_source,
                mfu=metrics.mfu(step_tokens / seconds / world, flops_per_token, peak),
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                planned_memory_gib=plan["largest_total"] / 2**30,  # the largest rank's plan
                eta_seconds=(time.perf_counter() - run_start) / (step - first) * (last - step), moe_layers=moe_names,
            )
            logger.log(step, record)
            if cfg.check_finite and not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
                # every rank holds the same reduced values: every rank stops here, none waits in a collective
                logger.close()
                newest = checkpoint.latest(cfg.out_dir)
                intact = f"The newest checkpoint, {newest}, is intact: --resume starts from it" if newest else "No checkpoint was written yet"
                sys.exit(f"step {step}: loss {record['loss']}, gradient norm {record['grad_norm']}: not finite, and the weights took the "
                         f"step's update; stopping before a checkpoint. {intact} (lower --lr, raise --warmup, or check the data; "
                         "--check_finite=False runs on)" if rank == 0 else 1)
            if step % cfg.ckpt_every == 0 or step == last or stopping:
                for opt in optimizers:  # a distributed Muon's last update may still be in flight
                    getattr(opt, "wait", lambda: None)()
                # every rank holds the same extra (same sampler, same seeds): resumable on any mesh
                extra = {"step": step, "tokens_seen": tokens_seen, "sampler": sampler.state_dict(), "rng": checkpoint.rng_state()}
                try:
                    with phase("checkpoint"):
                        checkpoint.save(cfg.out_dir, step, model=parts, optimizers=optimizers, extra=extra)
                except OSError as err:  # a full disk, a quota, a file-size limit: named by checkpoint.save
                    logger.close()
                    newest = checkpoint.latest(cfg.out_dir)
                    intact = f"the newest checkpoint, {newest}, is intact: --resume starts from it" if newest else "no checkpoint was written yet"
                    sys.exit(f"{f'rank {rank}: ' if world > 1 else ''}step {step}: {err}; {intact}")
                if rank == 0:
                    checkpoint.prune(cfg.out_dir, keep_last=cfg.keep_last, keep_every=cfg.keep_every or None)
            _report_profile(profiler.end_step(step), rank)
            if stopping:
                if rank == 0:
                    print(f"step {step}: stopping on {stop.reason() or 'a request to another rank'}, with the checkpoint of step "
                          f"{step}; --resume continues the run", flush=True)
                break
    _report_profile(profiler.close(), rank)  # the run ended inside the profiled steps
    if logger is not None:
        logger.close()
    # a stopped run (a signal, the time limit, or --stop_at before --steps) is not done: --resume continues it
    ended = "stopped" if record is not None and (stopping or step < cfg.steps) else "done"
    if rank == 0 and record is None:
        print(f"done: the run in {cfg.out_dir} is at step {step}, nothing to train up to step {last} "
              f"(--steps={cfg.steps}{f', --stop_at={cfg.stop_at}' if cfg.stop_at > 0 else ''})")
    elif rank == 0 and "val_loss" in record:  # a NaN one too (it said "no validation at this step")
        sources = record["val_loss_by_source"]
        each = "; by source: " + ", ".join(f"{name} {v:.4f}" for name, v in sources.items()) if len(sources) > 1 else ""
        unit = "byte" if corpus.byte_tokens else "token"
        print(f"{ended}: step {step}, validation loss {record['val_loss']:.4f} (bits per {unit} {record['val_loss'] / math.log(2):.3f}){each}")
    elif rank == 0:  # no validation, or a stop (a signal, the time limit) at a step without one: no time spent on one there
        print(f"{ended}: step {step}, loss {record['loss']:.4f} "
              f"({'no validation: --eval_batches=0' if not val_batches else f'no validation at this step: every --eval_every={cfg.eval_every}'})")
    if rank == 0 and cfg.compile:  # what the compiler made of the model: graph breaks cost speed (this run's: the counters are the process's)
        graphs, breaks = (a - b for a, b in zip(_compile_counts(), compiled_before))
        print(f"torch.compile: {graphs} graphs, {breaks} graph breaks")
    if dist.is_initialized() and not caller_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
    parallel.leave_ranks()  # exit 0 without the interpreter's teardown, where a gloo rank could abort
