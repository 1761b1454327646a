"""Sample from a trained model: an fmoe run (its out_dir, or one checkpoint) or a Hugging Face folder.

    python examples/generate.py out/train_moe --prompt="def " --tokens=200            # greedy
    python examples/generate.py out/train_moe --prompt="import " --temperature=0.8 --top_p=0.9 --seed=1
    python examples/generate.py path/to/qwen3_moe --prompt="Hello"   # needs its tokenizer.json (`tokenizers`)
    python examples/generate.py path/to/qwen3_moe --prompt_ids=1,2,3 # or token ids, printed as ids
    python examples/generate.py out/train_moe --prompt="def " --samples=4 --temperature=1  # 4 draws, one batch
    python examples/generate.py path/to/qwen3_moe --prompt="Hi" --device=cuda --dtype=bfloat16
    python examples/generate.py path/to/qwen3_moe --chat --prompt="What is 2+2?" --system="Be brief."  # the reply
    torchrun --nproc-per-node 8 examples/generate.py path/to/qwen3_moe --prompt="Hi" --ep=8 --device=cuda --dtype=bfloat16

An fmoe run is rebuilt from its config.json (the model knobs and vocab_size the loop wrote)
and the newest complete checkpoint's weights (fmoe.train.checkpoint.load_model); a run on
the embedded corpus or a text directory speaks bytes (fmoe.train.data.encode_text /
decode_text). An HF folder is loaded with fmoe.hf.from_pretrained. Decoding: greedy with
--temperature=0, else softmax(logits / temperature) restricted to the --top_k most likely
tokens (0: all), then, renormalised, to the smallest set of them whose probability reaches
--top_p (nucleus sampling; transformers' order of the two), continuation i from a
generator of its own seeded by (--seed + i) mod 2**32 (so continuation 0 of --samples=4 is the one
of --samples=1, whatever the others draw; torch's CPU generator keeps 32 bits of a seed, so
--seed is in [0, 2**32)). The prompt runs once, then each new token alone against the keys and values of
the tokens before it (Transformer.decode with a KVCache of prompt + --tokens tokens, made up
front: refused, naming --tokens and its bytes, where it would not fit the device's free memory).
A run on prepared token files speaks the tokenizer their index names (when that file is
here; fmoe.train.prepare records it). Generation stops after --tokens new tokens or at the
end-of-document token (an HF folder's generation_config.json eos_token_id, one id or
several, as transformers' generate, else its config.json's; a token-file run's separator,
and the ids of the generation_config.json of the folder it started from, --init_from_hf).
--chat renders --prompt as a user message (after --system's message) with the chat
template beside the tokenizer and its generation prompt, as transformers'
apply_chat_template does (fmoe.train.chat), and prints the reply alone; a run also stops at
the template's eos_token (the end of a turn). --samples=N
draws N continuations of the prompt as one batch (one cache of N sequences, every step of
the unfinished ones in one forward pass). --device and --dtype place and cast the model
(the router stays float32; an HF folder's weights are allocated there and cast as they are
read, so --dtype=bfloat16 needs half the host memory of float32); the model runs fmoe's
torch reference (SDPA attention) there.

Under torchrun the model may be larger than one device: each rank builds it on the meta
device, parallelized over --tp (attention heads and dense FFN columns; each rank caches its
own kv heads), --ep and --etp (the experts), the rest of the world sharding it with FSDP2,
and reads only its own shards' weights (load_sharded, as examples/evaluate.py). Every rank
decodes the same batch (Transformer.decode on the parallelized model), rank 0's draws are
broadcast so that the ranks stay in step, and rank 0 prints: the same tokens as one process
(up to float rounding near a tie). FSDP2 gathers each block's weights for each step and
frees them after it; --keep_gathered gathers them once and keeps them for the whole
generation (fmoe.parallel.gathered), for a model whose unsharded weights (divided by tp
and ep x etp) fit on each device.

    torchrun --nproc-per-node 4 examples/generate.py out/train_moe --prompt="def " --keep_gathered
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import numbers
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

import fmoe.parallel as parallel
from fmoe.model import KVCache, Transformer
from fmoe.train.chat import json_object
from fmoe.hf import is_hf_folder
from fmoe.ops.checks import MissingExtra
from fmoe.train.checkpoint import load_run, run_config  # noqa: F401  (export_hf and the tests use them from here)
from fmoe.train.run import ArgumentParser, every_rank, raise_together, run_path, run_script, same_command_lines


def load_model(path: Path, *, impl: str = "torch", dtype: torch.dtype = torch.float32, device="cpu") -> tuple[Transformer, dict]:
    """(model, run config) of an fmoe run or checkpoint (load_run), or (model, {}) of an HF
    folder (fmoe.hf.from_pretrained without MTP modules, allocated in `dtype` on `device`
    directly; model.hf_config keeps its config), in `dtype` (the router float32) on `device`."""
    if is_hf_folder(path):
        import fmoe.hf

        return fmoe.hf.from_pretrained(path, impl=impl, mtp_depth=0, dtype=dtype, device=device)[0], {}
    model, run = load_run(path, impl=impl)
    return model.to(device=device, dtype=dtype), run


def say_read(run: dict, rank: int = 0) -> None:
    """On rank 0, tell stderr which checkpoint a run's model was read from (load_run's
    run["checkpoint"]): a run's out_dir names no step, and its newest changes as it trains.
    An HF folder's model (run {}) says nothing."""
    if rank == 0 and run.get("checkpoint"):
        print(f"weights: {run['checkpoint']}", file=sys.stderr)


def _said(err: BaseException) -> str:
    """A loading error as the script says it: its own words where they name the knob or path."""
    return str(err) if str(err).startswith(("parallel knobs", "rank ", "--chat", "--prompt_ids", "--tokenizer", "chat_template", "path:")) else f"path: {err}"


def load_sharded(path: Path, sizes: dict, *, device: torch.device, dtype: torch.dtype, impl: str) -> tuple[Transformer, dict, object]:
    """(model, run config, meshes): load_model's model and run config (with "checkpoint", as
    load_run's) for a model larger than
    one device (after start_ranks). The meshes are fmoe.parallel.build_meshes(**sizes) (tp,
    ep, etp, and cp for evaluation; the rest of the world FSDP2's); the model is built on
    the meta device, parallelized over them (FSDP2 computing in `dtype`, the router in
    float32), each rank allocating only its own shards and reading only their weights (an
    HF folder's safetensors blocks, fmoe.hf.load_weights; a run's checkpoint resharded by
    DCP, fmoe.train.checkpoint.load_model)."""
    import fmoe.hf
    from fmoe.train import checkpoint

    cfg, error = None, None
    try:
        if is_hf_folder(path):
            hf, cfg = fmoe.hf.read_config(path)
            cfg, run = dataclasses.replace(cfg, impl=impl, mtp_depth=0), {}
        else:
            cfg, run = run_config(path, impl=impl)
    except (OSError, ValueError, KeyError) as err:
        error = err
    # each rank read its own: agreed before the meshes, and so is what it read (the loads' collectives differ)
    raise_together(error, None if cfg is None else ("an fmoe run" if run else "a Hugging Face folder", repr(cfg)), lambda every: (
        f"path: the ranks read different model configs from {str(path)!r}: every node must hold the same files"
        if len({kind for kind, _ in every}) == 1 else f"path: {str(path)!r} is not the same on every rank ("
        + ", ".join(f"rank {r}: {kind}" for r, (kind, _) in enumerate(every)) + "): every node must hold the same files"))
    meshes = parallel.build_meshes(**sizes, has_experts=any(cfg.is_moe(i) for i in range(cfg.n_layers)), device_type=device.type)
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        parallel.parallelize(model, meshes, param_dtype=dtype if dtype != torch.float32 else None)
    except ValueError as err:
        raise ValueError(f"{_knobs(sizes)}: {err}") from None
    parallel.materialize(model, device, seed=0)  # what the weights do not hold (an HF folder's expert biases) starts as from_pretrained's
    if run:
        run = {**run, "checkpoint": str(checkpoint.load_model(path, model=model))}  # the ranks agree on what they read there
    else:
        error = None
        try:
            fmoe.hf.load_weights(model, path, model_type=hf["model_type"])
        except (OSError, ValueError, KeyError) as err:
            error = err
        raise_together(error)
        model.hf_config = hf
    return model, run, meshes


def _data_sources(run: dict) -> list[dict]:
    """A run's data sources ({"path": ...} each; the path None for the stdlib corpus), from
    its config.json: data_sources, or the --data of a run from before that field."""
    return run.get("data_sources") or [{"path": run["config"].get("data") or None}]


def _byte_run(run: dict) -> bool:
    """Whether a run speaks bytes (the stdlib corpus or text files): config.json records it;
    an older run's sources were bytes when each was a directory."""
    byte_tokens = run.get("byte_tokens")
    if byte_tokens is None:
        byte_tokens = all(s["path"] is None or Path(s["path"]).is_dir() for s in _data_sources(run))
    return bool(byte_tokens)


def named_tokenizer(run: dict) -> tuple[Optional[tuple[Path, int]], str]:
    """((tokenizer.json, separator), "") of a run on prepared token files: the ones every data
    source's index names (fmoe.train.prepare; where the data is not here, a copied run, as
    config.json's data_sources recorded them), when that tokenizer file is here, or the one
    run["tokenizer"] names in its place (with_tokenizer: --tokenizer); else (None, why not):
    a source without an index (.npy, a bare token file), sources that name different
    tokenizers or separators, or a tokenizer moved away."""
    from fmoe.train.data import read_index

    named = set()
    for source in _data_sources(run):
        index = read_index(source["path"]) if source["path"] and Path(source["path"]).is_file() else None
        index = index or {k: source[k] for k in ("tokenizer", "separator") if k in source}  # as the run recorded it
        if not isinstance(index.get("tokenizer"), str) and run.get("tokenizer"):  # --tokenizer: the separator --separator gave
            given = run["config"].get("separator", -1)
            named.add((None, given if isinstance(given, int) and given >= 0 else None))
        elif not isinstance(index.get("tokenizer"), str):
            return None, f"the data source {source['path']!r} has no index naming a tokenizer (fmoe.train.prepare writes one)"
        else:
            named.add((index["tokenizer"], index["separator"]))
    if len(named) != 1:
        return None, f"the data's indexes name different tokenizers or separators: {sorted(named)}"
    tokenizer, separator = named.pop()
    if run.get("tokenizer"):  # given in its place: the named one's path is another machine's
        tokenizer = run["tokenizer"]
        if not Path(tokenizer).is_file() or not _is_tokenizer_json(Path(tokenizer)):
            return None, f"--tokenizer: {tokenizer!r} is not a tokenizer.json"
        return (Path(tokenizer), separator), ""
    if not Path(tokenizer).is_file():
        return None, (f"the tokenizer the data's index names, {tokenizer!r}, is not here (give its copy with --tokenizer=FILE)")
    if not _is_tokenizer_json(Path(tokenizer)):  # an index from elsewhere may name any file: export_hf would copy it out
        return None, f"the file the data's index names as its tokenizer, {tokenizer!r}, is not a tokenizer.json"
    return (Path(tokenizer), separator), ""


def _is_tokenizer_json(path: Path) -> bool:
    """Whether `path` holds a tokenizers tokenizer.json: a JSON object with its "model"."""
    try:
        with open(path, "rb") as f:
            if f.read(1).strip() not in (b"{", b""):  # not JSON at all: read no further (a device, /proc's files)
                return False
            f.seek(0)
            content = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(content, dict) and isinstance(content.get("model"), dict)


def with_tokenizer(run: dict, tokenizer: Optional[Path]) -> dict:
    """The run config with `tokenizer` (--tokenizer: a tokenizer.json) in place of the one its
    data's index names (named_tokenizer), e.g. where the run was copied from another machine;
    the run config as it is for None. Only a run on prepared token files has a tokenizer to
    replace: a byte run's or an HF folder's (run {}) is a ValueError naming --tokenizer."""
    if tokenizer is None:
        return run
    if not run or _byte_run(run):
        raise ValueError("--tokenizer: it replaces the tokenizer a run on prepared token files names; "
                         + ("an HF folder reads its own tokenizer.json" if not run else "this run's data are bytes, which need none"))
    return {**run, "tokenizer": str(tokenizer)}


def run_tokenizer(run: dict) -> tuple[Optional[Path], Optional[int]]:
    """(tokenizer.json, separator) of a run on prepared token files (named_tokenizer), else
    (None, None)."""
    found, _ = named_tokenizer(run)
    return found if found is not None else (None, None)


def run_eos(run: dict) -> Optional[int]:
    """The id a run of fmoe's own ends a document with, where generation from it stops: a
    byte run's EOS, a run on prepared token files its data's separator (run_tokenizer), else
    None (token files that name no tokenizer, or no run config)."""
    if not run:
        return None
    if _byte_run(run):
        from fmoe.train.data import EOS

        return EOS
    return run_tokenizer(run)[1]


def tokenizer_file(path: Path, run: dict) -> Optional[Path]:
    """The tokenizer.json of a loaded model: an HF folder's own, or a token-file run's
    (run_tokenizer); None where there is none here."""
    if not run:
        return path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None
    return run_tokenizer(run)[0]


def text_codec(path: Path, model: Transformer, run: dict) -> tuple[Optional[Callable], Optional[Callable], Optional[int]]:
    """(encode, decode, eos) of a loaded model (load_model's run config): an fmoe run on the
    embedded corpus or text files speaks bytes (encode_text, decode_text, EOS); an HF folder
    its tokenizer.json (`tokenizers`) and config.json's eos_token_id; a run on prepared token
    files the tokenizer their index names (run_tokenizer) and their separator, a text
    encoded as prepare encoded the data (without the tokenizer's post-processing). encode
    and decode are None where there is no tokenizer (a folder without tokenizer.json, a
    token-file run whose tokenizer is not here). encode(text, special=True) -> ids:
    special=False leaves out the tokens a tokenizer adds around a text (a BOS), for a text
    that continues another."""
    if run:
        if _byte_run(run):  # the stdlib corpus or text files
            from fmoe.train.data import decode_text, encode_text

            return (lambda s, special=True: encode_text(s).tolist()), decode_text, run_eos(run)
        tokenizer, eos = run_tokenizer(run)[0], run_eos(run)  # token ids: of the tokenizer the data's index names, when it is here
    else:  # an HF folder
        eos = model.hf_config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        tokenizer = tokenizer_file(path, run)
    if tokenizer is None:
        return None, None, eos  # (None for a run: run_tokenizer found none)
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise MissingExtra(f"{tokenizer}: the model's tokenizer is read with the Hugging Face tokenizers package: "
                          "pip install 'fmoe[data]' (or tokenizers)") from err
    tok = Tokenizer.from_file(str(tokenizer))
    tok.no_truncation()  # a prompt is encoded whole and unpadded, whatever the tokenizer.json says
    tok.no_padding()
    post_processing = not run  # prepare encoded a run's data without it
    return (lambda s, special=True: tok.encode(s, add_special_tokens=special and post_processing).ids), tok.decode, eos


def _end_ids(config: Optional[Path]) -> list[int]:
    """The eos_token_id of a generation_config.json or config.json (one id or a list), as a
    list; [] where the file or the field is not there."""
    stop = json.loads(config.read_text()).get("eos_token_id") if config is not None and config.is_file() else None
    return [] if stop is None else [stop] if isinstance(stop, int) else list(stop)


def stop_ids(path: Path, run: dict, eos: Optional[int]) -> list[int]:
    """The ids generation stops at: an HF folder's generation_config.json eos_token_id (an
    id or a list, as transformers' generate reads it), else every id of its config.json's
    (transformers builds the generation config from it), else `eos` (text_codec's). A run
    started from an HF folder (--init_from_hf) on token files stops at that folder's ids
    too, when the folder is still there (as its export_hf.py export does: the file is
    copied; a relative path is relative to where the run started, fmoe.train.run.run_path),
    and at `eos`, its data's separator; a byte run at `eos` alone."""
    started = run and run["config"].get("init_from_hf") and not _byte_run(run)
    folder = path if not run else run_path(run, run["config"]["init_from_hf"]) if started else None
    stops = _end_ids(folder / "generation_config.json" if folder is not None else None)
    if not run and not stops:  # an HF folder without a generation config: its config.json's ids, all of them
        stops = _end_ids(path / "config.json")
    if eos is not None and (run or not stops) and eos not in stops:
        stops.append(eos)
    return stops


def chat_prompt(tokenizer: Path, text: str, *, system: str = "", chat_template: Optional[Path] = None,
                variables: Optional[dict] = None) -> tuple[str, Optional[str]]:
    """--chat: `text` as a user message (after a system message when `system` is given),
    rendered by the chat template beside `tokenizer` (a tokenizer.json) with its generation
    prompt (fmoe.train.chat: `chat_template`, else the folder's chat_template.jinja or
    tokenizer_config.json; more `variables` such as {"enable_thinking": False}), as
    transformers' apply_chat_template(..., add_generation_prompt=True, **variables).
    Returns (the text, the template's eos_token: the end of a turn, or None)."""
    from fmoe.train.chat import load_chat_template

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    template = load_chat_template(tokenizer, chat_template, variables)
    return template.render(messages, add_generation_prompt=True, where="--prompt"), template.variables.get("eos_token")


def add_parallel_knobs(parser: argparse.ArgumentParser, *, cp: bool = False, per: str = "step") -> tuple[str, ...]:
    """The torchrun knobs of generate.py and evaluate.py: --tp, --ep, --etp (and --cp with
    cp), the rest of the world FSDP2; --keep_gathered (FSDP2's weights gathered once, not
    once per `per`). Returns the axes' names (the args' attributes, build_meshes' sizes)."""
    axes = [("tp", "tensor parallel: attention heads, dense FFN columns"), ("ep", "expert parallel"),
            ("etp", "expert tensor parallel: the experts' FFN columns")] + [("cp", "context parallel: each micro-batch's tokens split")] * cp
    for axis, what in axes:
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"under torchrun: {what} (the rest of the world is FSDP2 data parallel)")
    parser.add_argument("--keep_gathered", action="store_true", help=f"under torchrun: FSDP2 gathers the weights once, not once per {per}")
    return tuple(axis for axis, _ in axes)


def _knobs(sizes: dict) -> str:
    """The command-line knobs of a mesh's axes, for messages: parallel knobs (--tp, --ep, ...)."""
    return f"parallel knobs ({', '.join(f'--{axis}' for axis in sizes)})"


def command_knobs(args: argparse.Namespace, paths: Sequence[str]) -> dict:
    """args' knobs that every rank must share (start_ranks compares them): `paths` left out
    (each rank reads its own copy of those files, compared by what they hold), --device by
    its type (each rank takes its LOCAL_RANK's GPU)."""
    knobs = {name: value for name, value in vars(args).items() if name not in paths}
    if "device" in knobs:
        knobs["device"] = str(knobs["device"]).split(":")[0]
    return knobs


def start_ranks(device: torch.device, sizes: dict, knobs: Optional[dict] = None) -> torch.device:
    """Under torchrun: check the axis sizes against the world, take this rank's GPU
    (LOCAL_RANK) for a cuda device, and start the process group (nccl on cuda, else gloo);
    returns the device. ValueError for sizes the world does not hold. knobs (command_knobs):
    the ranks compare them at once, and a difference stops every rank with one message (a
    rank given other --batches or --tokens scored on without a word, or hung)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        parallel.plan_sizes(world, **sizes)
    except ValueError as err:
        raise ValueError(f"{_knobs(sizes)} for {world} process(es), the rest FSDP2: {err}") from None
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if knobs is not None and (refusal := same_command_lines(knobs)):
        raise SystemExit(refusal)
    return device


def generate(model: Transformer, prompt: list[int], *, tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos: Union[int, Sequence[int], None] = None, top_k: int = 0) -> list[int]:
    """prompt + up to `tokens` new token ids (module docstring). ValueError for an empty
    prompt or ids that are not the model's, `tokens` not an int >= 0 or past the model's
    learned positions (abs_positions), a temperature not a finite number >= 0, top_p
    outside (0, 1], top_k not an int >= 0, or a seed outside [0, 2**32)."""
    return generate_many(model, [prompt], tokens=tokens, temperature=temperature, top_p=top_p, seed=seed, eos=eos, top_k=top_k)[0]


def _stop_set(eos) -> set[int]:
    """generate's eos as a set of token ids: None, one int id or a sequence of them (numpy's
    and 0-d tensors' ints too), else a ValueError naming eos."""
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    ids = [] if eos is None else [eos] if isinstance(eos, numbers.Integral) else eos
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)) or \
            not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids) or isinstance(eos, bool):
        raise ValueError(f"eos: expected None, a token id (int) or a sequence of them, got {eos!r:.80}")
    return {int(t) for t in ids}


@torch.no_grad()
def generate_many(model: Transformer, prompts: list[list[int]], *, tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                  seed: int = 0, eos: Union[int, Sequence[int], None] = None, group=None, top_k: int = 0) -> list[list[int]]:
    """Each prompt + up to `tokens` new token ids, decoded as one batch: a KVCache of
    len(prompts) sequences, each prompt run alone, then one step for every unfinished
    sequence together (Transformer.decode with seqs). Greedy gives each prompt what
    generate gives it alone, unless the model has a capacity_factor: a step's capacity
    counts every sequence's token in it, so it may drop other slots than one sequence's
    step alone (Transformer.decode). Sampling draws sequence i's tokens from a generator of
    its own seeded by (seed + i) mod 2**32: what a sequence draws does not depend on the
    others (how many, when they stop), and prompts[i] draws as generate(prompts[i],
    seed=seed + i) does, unless a capacity_factor drops slots. A sequence stops at `eos`: an
    id, or several (a chat model's end of turn and end of text). ValueError as generate's,
    and for no prompts, a seed outside [0, 2**32) (torch's CPU generator keeps its low 32
    bits: seeds 2**32 apart drew alike), and when the model's logits for a next token hold a NaN or no finite
    value (nothing to draw from).

    group: for a model parallelized over several processes (load_sharded), the process
    group of its ranks, every one calling this with the same prompts: the tokens that the
    group's first rank draws at each step are broadcast to the others (one small collective
    per step), so every rank feeds the same tokens and stops at the same step."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected at least one prompt (a list of token id lists), got {prompts!r:.80}")
    prompts = [p.tolist() if isinstance(p, torch.Tensor) and p.ndim == 1 else p for p in prompts]
    if not all(isinstance(p, (list, tuple)) for p in prompts):
        raise ValueError(f"prompt: expected a list of int token ids, got {next(p for p in prompts if not isinstance(p, (list, tuple)))!r:.80}")
    if any(not prompt for prompt in prompts):
        raise ValueError("prompt: expected at least one token")
    not_ids = [t for prompt in prompts for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if not_ids:
        raise ValueError(f"prompt: expected int token ids, got {not_ids[0]!r:.80}")
    vocab = model.cfg.vocab_size
    outside = sorted({t for prompt in prompts for t in prompt if not 0 <= t < vocab})
    if outside:
        raise ValueError(f"prompt: token ids {outside[:8]} are outside the model's vocabulary 0..{vocab - 1}")
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ValueError(f"tokens: expected an int >= 0 (new tokens), got {tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0: every token), got {top_k!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:  # the bits torch's CPU generator keeps
        raise ValueError(f"seed: expected an int in [0, 2**32) (torch's CPU generator keeps 32 bits of a seed), got {seed!r}")
    limit, longest = model.cfg.abs_positions, max(map(len, prompts))  # learned positions: a bound before any token is drawn
    if limit is not None and longest > limit:
        raise ValueError(f"prompt: expected at most {limit} tokens, the model's learned positions (abs_positions), got {longest}")
    if limit is not None and longest + tokens - 1 > limit:  # the last new token is drawn, never fed back: no position of its own
        raise ValueError(f"tokens: expected at most {limit + 1 - longest} new tokens after a prompt of {longest} (the model's {limit} "
                         f"learned positions, abs_positions), got {tokens}")
    stops = _stop_set(eos)
    model.eval()
    gens = [torch.Generator().manual_seed((seed + b) % 2**32) for b in range(len(prompts))]
    out = [list(prompt) for prompt in prompts]
    device = model.embed.device
    cache = _kv_cache(model, max(map(len, prompts)) + tokens, len(prompts), device, group)
    logits = [model.decode(torch.tensor(prompt, device=device), cache, seqs=b)[-1] for b, prompt in enumerate(prompts)]
    active = list(range(len(prompts)))
    for step in range(tokens):
        if step:
            last = torch.tensor([[out[b][-1]] for b in active], device=device)
            logits = list(model.decode(last, cache, seqs=active)[:, -1])
        drawn = [_next_token(row.float().cpu(), temperature, top_p, gens[b], top_k) for b, row in zip(active, logits)]
        if group is not None:
            drawn_t = torch.tensor(drawn, device=device)
            dist.broadcast(drawn_t, group=group, group_src=0)
            drawn = drawn_t.tolist()
        for b, nxt in zip(list(active), drawn):
            out[b].append(nxt)
            if nxt in stops:
                active.remove(b)
        if not active:
            break
    return out


def _free_bytes(device: torch.device) -> Optional[int]:
    """The bytes free for new tensors on device: CUDA's free memory, the host's available
    memory (Linux's MemAvailable); None where it is not known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
        except (OSError, ValueError, IndexError):
            return None
    return None


def _kv_cache(model: Transformer, max_tokens: int, batch: int, device: torch.device, group) -> KVCache:
    """model.kv_cache(max_tokens, batch), refused (a ValueError naming tokens) where it holds
    more bytes than the device has free, before it is allocated (a huge --tokens ended in
    the allocator's traceback, or the host's out-of-memory kill), or where its allocation
    fails. With a group, every rank refuses if one does."""
    need, free = model.kv_cache(max_tokens, batch, device="meta").nbytes, _free_bytes(device)
    short = mine = free is not None and need > free
    if group is not None:  # one rank short of memory: all refuse, none waits on it in a collective
        flag = torch.tensor([float(mine)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        short = bool(flag.item())
    said = (f"tokens: the KV cache of {batch} sequence(s) of up to {max_tokens} tokens (the prompt and the new tokens) takes "
            f"{need / 2**30:.2f} GiB")
    if short:
        raise ValueError(f"{said}, more than {f'the {free / 2**30:.2f} GiB free on {device}' if mine else 'another rank has free'}: "
                         "ask for fewer tokens")
    try:
        return model.kv_cache(max_tokens, batch)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if isinstance(err, torch.OutOfMemoryError) or "allocate" in str(err):
            raise ValueError(f"{said}, which {device.type} could not allocate ({str(err).splitlines()[0]:.120}): ask for fewer tokens") from err
        raise


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator, top_k: int = 0) -> int:
    """Greedy (temperature 0), else a draw from softmax(logits / temperature) (logits [V])
    over the top_k most likely tokens (0: all; the lower id first among equals), then,
    renormalised, the smallest set of them whose probability reaches top_p. A row with
    a NaN, a +inf or no finite logit is a ValueError (argmax took the NaN's place, and
    multinomial refused with its own message)."""
    top = float(logits.max())  # NaN where a logit is
    if not math.isfinite(top):
        raise ValueError(f"logits: the model's logits for the next token hold {'a NaN' if math.isnan(top) else '+inf' if top > 0 else 'no finite value'} "
                         f"({int(logits.isnan().sum())} NaN, {int(logits.isinf().sum())} infinite of {logits.numel()}): nothing to draw from")
    if temperature == 0:
        return int(logits.argmax())
    # from the largest logit, in float64: a tiny temperature sends the others to -inf (greedy), never the largest to inf or nan
    probs = torch.softmax((logits.double() - logits.max()) / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True, stable=True)  # ties in id order: a tiny top_p keeps greedy's token
    if top_k:
        sorted_p, order = sorted_p[:top_k], order[:top_k]
        sorted_p = sorted_p / sorted_p.sum()
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix reaching top_p
    sorted_p = sorted_p * keep
    return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])


def _device(name: str) -> torch.device:
    """--device as a torch.device that exists here, else ValueError."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {name!r} ({err})") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"--device: {name} is not available here ({torch.cuda.device_count()} CUDA devices)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    return device


def main(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="an fmoe run directory or checkpoint, or a Hugging Face folder")
    parser.add_argument("--prompt", default="", help="text (bytes for fmoe's byte runs; the folder's tokenizer for HF)")
    parser.add_argument("--prompt_ids", default="", help="comma-separated token ids instead of --prompt")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0: all), before --top_p")
    parser.add_argument("--seed", type=int, default=0, help="in [0, 2**32); continuation i draws with (--seed + i) mod 2**32")
    parser.add_argument("--samples", type=int, default=1, help="continuations of the prompt, decoded as one batch")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (under torchrun: cpu or cuda, each rank its LOCAL_RANK's GPU)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--tokenizer", type=Path, default=None, help="a run on prepared token files: the tokenizer.json to use in "
                        "place of the one its data's index names (a run copied from another machine)")
    parser.add_argument("--chat", action="store_true", help="--prompt as a user message in the chat template beside the tokenizer (an HF folder's, or a "
                        "token-file run's); prints the reply")
    parser.add_argument("--system", default="", help="with --chat: a system message before the prompt")
    parser.add_argument("--chat_template", type=Path, default=None, help="with --chat: a .jinja file, or a JSON file with a "
                        "chat_template field (default: the folder's chat_template.jinja or tokenizer_config.json)")
    parser.add_argument("--chat_template_kwargs", type=json_object, default=None, help="with --chat: more variables for the "
                        "template, a JSON object, e.g. '{\"enable_thinking\": false}'")
    axes = add_parallel_knobs(parser, per="step")
    args = parser.parse_args(argv)
    group = None
    world, sizes, dtype = int(os.environ.get("WORLD_SIZE", "1")), {axis: getattr(args, axis) for axis in axes}, getattr(torch, args.dtype)
    if (args.system or args.chat_template or args.chat_template_kwargs is not None) and not args.chat:
        sys.exit("--system, --chat_template, --chat_template_kwargs: they shape a chat prompt, which needs --chat")
    if args.chat and args.prompt_ids:
        sys.exit("--chat: it renders --prompt's text in the chat template; give --prompt, not --prompt_ids")
    if args.prompt and args.prompt_ids:
        sys.exit("--prompt, --prompt_ids: the prompt as text or as token ids; give one")
    if args.prompt_ids and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", args.prompt_ids):
        sys.exit(f"--prompt_ids: expected comma-separated token ids (e.g. 1,2,3), got {args.prompt_ids!r}")
    try:
        device = _device(args.device if world == 1 else args.device.split(":")[0])
        if world > 1 or any(v != 1 for v in sizes.values()):  # several processes: each holds and reads its own shards
            device = start_ranks(device, sizes, command_knobs(args, ("path", "tokenizer", "chat_template")))
            group = dist.group.WORLD
    except ValueError as err:
        sys.exit(str(err))
    try:
        if group is None:
            model, run = load_model(args.path, dtype=dtype, device=device)
        else:
            model, run, _ = load_sharded(args.path, sizes, device=device, dtype=dtype, impl="torch")
    except (OSError, ValueError, KeyError) as err:
        sys.exit(_said(err))
    say_read(run, 0 if group is None else dist.get_rank())
    refusal, prompt, stops, chat = None, [], [], None
    try:
        run = with_tokenizer(run, args.tokenizer)
        encode, decode, eos = text_codec(args.path, model, run)
        stops = stop_ids(args.path, run, eos)
        if args.chat:
            tokenizer = tokenizer_file(args.path, run)
            if tokenizer is None:
                raise ValueError(f"--chat: {str(args.path)!r} has no tokenizer here (an HF folder's tokenizer.json, or the one "
                                 "a token-file run's data index names); a chat template goes with one")
            chat, end_of_turn = chat_prompt(tokenizer, args.prompt, system=args.system, chat_template=args.chat_template,
                                            variables=args.chat_template_kwargs)
            end_ids = encode(end_of_turn, special=False) if run and end_of_turn else []
            stops += end_ids if len(end_ids) == 1 and end_ids[0] not in stops else []  # a run: the template's end of turn too
        if chat is not None:
            prompt = encode(chat, special=False)  # the template writes the BOS itself, as apply_chat_template's tokenize
        elif args.prompt_ids:
            prompt = [int(t) for t in args.prompt_ids.split(",")]
        elif encode is not None:
            prompt = encode(args.prompt) or [eos if eos is not None else 0]
        else:
            raise ValueError("--prompt_ids: this model has no tokenizer here (no tokenizer.json, or a token-file run whose data's "
                             "index names no tokenizer that is here: --tokenizer=FILE names its copy); give token ids")
    except (OSError, ValueError, KeyError) as err:
        refusal = _said(err)
    # each rank read the tokenizer, chat template and generation config itself: the ranks decode one prompt to the same stops
    refusal, _ = every_rank(refusal, None if refusal else (tuple(prompt), tuple(sorted(stops))), lambda _: (
        "--prompt: the ranks made different prompt ids or end-of-text ids from their files (tokenizer, chat template, "
        "generation_config.json); every node must hold the same ones"))
    if refusal is not None:
        sys.exit(refusal)
    try:
        if args.samples < 1:
            raise ValueError(f"--samples: expected a positive number of continuations, got {args.samples}")
        if args.samples > 1 and args.temperature == 0:  # greedy: one continuation, printed n times
            raise ValueError(f"--samples={args.samples}: greedy decoding (--temperature=0, the default) continues the prompt one way only; "
                             "set --temperature > 0 to draw several")
        with parallel.gathered(model) if args.keep_gathered else contextlib.nullcontext():
            samples = generate_many(model, [prompt] * args.samples, tokens=args.tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed, eos=stops, group=group, top_k=args.top_k)
    except ValueError as err:
        sys.exit(str(err))
    if group is None or dist.get_rank() == 0:
        for i, ids in enumerate(samples):
            if args.samples > 1:
                print(f"--- sample {i}")
            if chat is not None:  # the reply alone
                print(decode(ids[len(prompt):]))
            else:
                print(decode(ids) if decode is not None and not args.prompt_ids else ",".join(map(str, ids[len(prompt):])))
    if group is not None:
        parallel.leave_ranks()


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
