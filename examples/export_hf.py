"""Write an fmoe run (its out_dir, or one checkpoint) as a Hugging Face folder, for transformers and inference engines.

    python examples/export_hf.py out/qwen3_tuned out/qwen3_tuned_hf         # a run started from --init_from_hf
    python examples/export_hf.py out/train_moe out/hf --model_type=glm4_moe  # a model of fmoe's own
    torchrun --nproc-per-node 8 examples/export_hf.py out/big out/big_hf --ep=8 --device=cuda

The weights: the run's newest complete checkpoint, or the checkpoint named (as
examples/generate.py loads them). The config:
- a run started from a Hugging Face folder (--init_from_hf; or --hf_config=FOLDER) keeps
  that folder's config.json (its model_type, token ids, RoPE fields, dtype, ...), the MTP
  depth set to the run's where the family stores MTP layers, and every other file of the
  folder but its weights (tokenizer, generation config, license, ...) is copied beside the
  new weights, laid out as the folder's (its experts as stacks or one module each, a released
  LongCat-Flash folder without the zero experts' unused rows: fmoe.hf.keep_folder_layout).
  The folder's model must be the run's: a field in which they differ is an
  error (fmoe.hf.config_mismatch), unless --model_type names another family, whose config
  is then built from the run's model, the folder's other files still copied (DeepSeek
  sparse attention added to a DeepSeek-V3 folder's model: --model_type=deepseek_v32);
- a released llama4 folder (Llama4ForConditionalGeneration) holds a vision model that fmoe
  does not read: the run's text model is written as llama4_text with the folder's
  text_config (fmoe.hf.written_config), with a note;
- a model of fmoe's own needs --model_type, one of fmoe.hf.FAMILIES, and gets a config built
  from its knobs (fmoe.hf.hf_config; a knob the family has no field for is an error naming
  it), and the id that ends the run's documents as its eos_token_id (a byte run's EOS,
  256; prepared token files' separator), where generation stops as from the run. A byte
  run speaks fmoe's bytes: no tokenizer is written. A run on prepared token
  files (fmoe.train.prepare) speaks the tokenizer their index names: that tokenizer.json is
  copied as the folder's, with the tokenizer_config.json, special_tokens_map.json and
  chat_template.jinja beside it (its special tokens and chat template), when it is here
  (run_tokenizer_files); else it is left out, with a note.
The run's capacity_factor is a training-time drop, not part of the model: the export has
none. The run's MTP modules are exported as the layers after the trunk's where the family stores
them so (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash), each with its own output norm (a module
on the trunk's final norm, mtp_norm=False, with a copy of it); other families' are left out,
with a note. --dtype: the weights' dtype (default: the
folder's config, float32 for a model of fmoe's own). --max_shard_gb: the tensor bytes of
each safetensors shard, its header aside, as transformers' max_shard_size (default 5).

Under torchrun the model may be larger than one process's memory: each rank builds it on
the meta device, parallelized over --tp, --ep and --etp (the rest of the world sharding it
with FSDP2), reads only its own shards of the checkpoint (generate.load_sharded), and the
weights are gathered one at a time while rank 0 writes the shards (fmoe.hf.save_pretrained):
the files of one process, byte for byte.

Printed: the folder, its files and their total size, the files copied beside the weights
(the HF folder's, the tokenizer), and what was left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import (_byte_run, _device, add_parallel_knobs, command_knobs, is_hf_folder, load_run, load_sharded, named_tokenizer, run_eos,  # noqa: E402
                      say_read, start_ranks, with_tokenizer)

import fmoe.hf  # noqa: E402
import fmoe.parallel as parallel  # noqa: E402
from fmoe.model import TransformerConfig  # noqa: E402
from fmoe.train.chat import CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG  # noqa: E402
from fmoe.train.run import ArgumentParser, raise_together, run_path, run_script  # noqa: E402

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def export_config(cfg: TransformerConfig, run: dict, *, model_type: str = "", hf_folder: str = "",
                  dtype: str = "") -> tuple[dict, list[str], Path | None]:
    """(config.json for the export (fmoe.hf.save_pretrained sets its MTP count to the model's
    depth), notes on what it leaves out, the HF folder whose other files go with it or None)
    of a run's model `cfg` and run config `run` (see the module
    docstring). ValueError naming the knob: no --model_type for a model of fmoe's own, a
    folder that is gone, a model_type other than the folder's, a folder whose model is not
    the run's, a knob the family has no field for."""
    source = hf_folder or run.get("config", {}).get("init_from_hf", "")
    if model_type and model_type not in fmoe.hf.FAMILIES:
        raise ValueError(f"--model_type: expected one of {', '.join(fmoe.hf.FAMILIES)}, got {model_type!r}")
    notes = []
    if cfg.capacity_factor is not None:
        notes.append(f"capacity_factor={cfg.capacity_factor}: a training-time drop, not exported")
        cfg = dataclasses.replace(cfg, capacity_factor=None, capacity_policy="probs")  # the policy: which slots that drop keeps
    folder = None if not source else Path(source) if hf_folder else run_path(run, source)  # the run's: relative to where it started
    if source and not hf_folder and model_type and not is_hf_folder(folder):  # the run's folder gone: the config of --model_type
        notes.append(f"the run's --init_from_hf folder {str(folder)!r} is gone: the config is built from the run's knobs, and no "
                     "other file of that folder (its tokenizer) goes with it")
        source = ""
    if source:
        if not is_hf_folder(folder):
            knob = "--hf_config" if hf_folder else f"the run's --init_from_hf ({source!r})"
            raise ValueError(f"{knob}: not a Hugging Face folder (config.json with a model_type); pass --hf_config=FOLDER, "
                             "or --model_type for a config built from the run's knobs")
        hf = json.loads((folder / "config.json").read_text())
        kind = hf.get("model_type")
        family = fmoe.hf.FAMILIES.get(kind)
        if family is not None and family.written_as is not None:  # a released llama4 folder: its text model, as llama4_text
            hf = fmoe.hf.written_config(hf)
            notes.append(f"the {kind} folder's {', '.join(family.not_read)} weights: fmoe does not read them; "
                         f"written as {hf['model_type']} with the folder's text config")
        if model_type and model_type != hf["model_type"]:  # the run's model as another family (DSA added to DeepSeek-V3: deepseek_v32)
            if family is None or family.written_as is not None or model_type == kind:
                written = f", written as {hf['model_type']!r}" if hf["model_type"] != kind else ""
                raise ValueError(f"--model_type: {model_type!r}, but the run's Hugging Face folder {str(folder)!r} is {kind!r}{written}")
            hf = None
        model_type = model_type or hf["model_type"]
    elif not model_type:
        raise ValueError(f"--model_type: needed for a model of fmoe's own, one of {', '.join(fmoe.hf.FAMILIES)}")
    family = fmoe.hf.FAMILIES[model_type]
    if family.mtp_module and cfg.mtp_depth > 1:  # Qwen3-Next's one module (mtp.): depth 1 is written, a second has no keys
        raise ValueError(f"--model_type: {model_type} checkpoints hold one MTP module, the run's model has mtp_depth = {cfg.mtp_depth}")
    if cfg.mtp_depth and not (family.mtp or family.mtp_module):
        notes.append(f"the {cfg.mtp_depth} MTP module(s): {model_type} checkpoints hold none; not exported")
        cfg = dataclasses.replace(cfg, mtp_depth=0, mtp_norm=False)
    if source and hf is not None:
        mismatch = fmoe.hf.config_mismatch(cfg, hf)
        if mismatch:
            raise ValueError(f"--hf_config: {str(folder)!r} is not the run's model; {{field: (run, folder)}}: {mismatch} (a model_type that fits "
                             "the run's model writes a config of its own, with the folder's other files)")
    else:
        hf = fmoe.hf.hf_config(cfg, model_type)
        eos = run_eos(run)
        if eos is not None:  # where the run's documents end: generation from the export stops there, as from the run
            hf["eos_token_id"] = eos
    if dtype:
        hf = {k: v for k, v in hf.items() if k != "torch_dtype"} | {"dtype": dtype}
    return hf, notes, folder if source else None


def _linked_outside(file: Path, source: Path) -> bool:
    """Whether `file` of the folder `source` is a link to a file outside it: anywhere but
    the folder itself or, for a folder of the Hugging Face hub's cache
    (models--org--name/snapshots/<revision>/), the blobs of its repository."""
    if not file.is_symlink():
        return False
    target, folder = file.resolve(), source.resolve()
    repository = next((p for p in folder.parents if p.name.startswith("models--")), None)
    return not (target.is_relative_to(folder) or repository is not None and target.is_relative_to(repository / "blobs"))


def _copy_into(file: Path, dest: Path) -> None:
    """shutil.copy2 to `dest`, replacing a link there rather than writing through it into the
    file it names (an out folder someone else prepared), as save_pretrained's files do."""
    if dest.is_symlink():
        dest.unlink()
    shutil.copy2(file, dest)


def copy_folder_files(source: Path, out: Path) -> tuple[list[str], list[str]]:
    """Copy every top-level file of the HF folder `source` but its config and weights
    (tokenizer, generation config, license, ...) into `out`; returns (their names, notes on
    the files left out). A link to a file outside the folder (_linked_outside) is left out:
    an export is made to be shared, and a folder from elsewhere could link in any file of
    this machine (an ssh key, /proc/self/environ and its tokens)."""
    names, left = [], []
    for file in sorted(source.iterdir()):
        if file.is_file() and file.name != "config.json" and not file.name.endswith(WEIGHT_SUFFIXES):
            if _linked_outside(file, source):
                left.append(f"{file.name}: a link to {str(file.resolve())!r}, outside {str(source)!r}; not copied")
                continue
            _copy_into(file, out / file.name)
            names.append(file.name)
    return names, left


def run_tokenizer_files(run: dict) -> tuple[list[Path], str]:
    """(files, note) of the tokenizer a run of fmoe's own speaks: for a run on prepared token
    files, the tokenizer.json every source's index names (generate.named_tokenizer) and the
    tokenizer_config.json, special_tokens_map.json and chat_template.jinja beside it, and no
    note; ([], why it is left out) where there is none here; ([], "") for a byte run, which
    speaks fmoe's bytes."""
    if _byte_run(run):
        return [], ""
    found, why = named_tokenizer(run)
    if found is None:
        return [], f"the tokenizer: {why}; no tokenizer written"
    tokenizer = found[0]
    beside = [tokenizer.parent / name for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE)]
    return [tokenizer, *(f for f in beside if f.is_file())], ""


def main(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path, help="an fmoe run directory, or a checkpoint inside one")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--model_type", default="", help=f"for a model of fmoe's own: one of {', '.join(fmoe.hf.FAMILIES)}")
    parser.add_argument("--hf_config", default="", help="an HF folder whose config and tokenizer to use (default: the run's --init_from_hf)")
    parser.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"), help="the weights' dtype")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="the most tensor bytes of one safetensors shard, in GB (10^9 bytes; "
                                                                          "its header aside, as transformers' max_shard_size)")
    parser.add_argument("--device", default="cpu", help="under torchrun: cpu or cuda (each rank its LOCAL_RANK's GPU)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a run on prepared token files: the tokenizer.json to "
                        "export in place of the one its data's index names (a run copied from another machine)")
    axes = add_parallel_knobs(parser)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = {axis: getattr(args, axis) for axis in axes}
    max_shard_bytes = int(args.max_shard_gb * 10**9) if math.isfinite(args.max_shard_gb) else 0
    if max_shard_bytes < 1:
        sys.exit(f"--max_shard_gb: expected a finite number of GB of at least 1e-9 (one byte), got {args.max_shard_gb}")
    if not args.out:  # Path("") is the current directory
        sys.exit("out: expected the folder to write, got ''")
    out = Path(args.out)
    existing = next(p for p in (out, *out.parents) if p.exists())  # out, or the folder it would be made in
    if not existing.is_dir():
        sys.exit(f"out: {str(out)!r} exists and is not a directory" if existing == out else
                 f"out: {str(out)!r} is under {str(existing)!r}, which is not a directory")
    try:
        hf_folder = is_hf_folder(args.path)
    except ValueError as err:  # a config.json that is not a JSON object
        sys.exit(f"path: {err}")
    if hf_folder:
        sys.exit(f"path: {str(args.path)!r} is already a Hugging Face folder")
    run_dir = args.path.parent if (args.path / ".metadata").is_file() else args.path  # a checkpoint: the run that holds it
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        sys.exit(f"out: {str(out)!r} is inside the run; write the export elsewhere")
    meshes, rank = None, 0
    try:
        if world == 1:
            model, run = load_run(args.path, impl="torch")
        else:  # each rank holds and reads its own shards of the model
            device = start_ranks(_device(args.device.split(":")[0]), sizes, command_knobs(args, ("path", "out", "hf_config", "tokenizer")))
            rank = dist.get_rank()
            model, run, meshes = load_sharded(args.path, sizes, device=device, dtype=torch.float32, impl="torch")
    except (OSError, ValueError, KeyError) as err:
        sys.exit(str(err) if str(err).startswith(("parallel knobs", "path:")) else f"path: {err}")
    say_read(run, rank)
    try:
        run = with_tokenizer(run, args.tokenizer)
    except ValueError as err:
        sys.exit(str(err))
    error, hf, notes, source = None, None, [], None
    try:  # each rank reads the HF folder (--hf_config, or the run's --init_from_hf) itself
        hf, notes, source = export_config(model.cfg, run, model_type=args.model_type, hf_folder=args.hf_config, dtype=args.dtype)
        if source is not None and out.resolve() == source.resolve():  # its weights and config replaced, then its files copied onto themselves
            raise ValueError(f"out: {str(out)!r} is the Hugging Face folder whose config and files the export takes; write the export elsewhere")
        model.hf_config = hf
        if source is not None and json.loads((source / "config.json").read_text()).get("model_type") == hf["model_type"]:
            fmoe.hf.keep_folder_layout(model, source, hf["model_type"])  # the folder's experts' layout, written back
    except (OSError, ValueError) as err:
        error = err
    try:  # the ranks write one folder together: a rank's refusal, or another config (a node's copy of the folder), stops every rank
        raise_together(error, json.dumps(hf, sort_keys=True, default=str), lambda _: (
            f"--hf_config: the ranks read different configs from {str(source)!r}; every node must hold the same folder"))
    except ValueError as err:
        sys.exit(str(err))
    fmoe.hf.save_pretrained(model, out, max_shard_bytes=max_shard_bytes)
    if rank == 0:
        copied, not_copied = copy_folder_files(source, out) if source is not None else ([], [])
        notes.extend(not_copied)
        tokenizer_files, note = run_tokenizer_files(run) if source is None else ([], "")
        for file in tokenizer_files:  # the tokenizer.json may have another name: the folder's is tokenizer.json
            _copy_into(file, out / ("tokenizer.json" if file == tokenizer_files[0] else file.name))
        if note:
            notes.append(note)
        files = sorted(f for f in out.iterdir() if f.is_file())
        print(f"{out}: {hf['model_type']}, {len(files)} files, {sum(f.stat().st_size for f in files) / 1e9:.3f} GB "
              f"(weights in {str(fmoe.hf.config_dtype(hf)).removeprefix('torch.')})")
        if copied:
            print(f"copied from {source}: {', '.join(copied)}")
        if tokenizer_files:
            print(f"copied the tokenizer the data's index names: {', '.join(map(str, tokenizer_files))}")
        for note in notes:
            print(f"left out: {note}")
        family, depth, n = fmoe.hf.FAMILIES.get(hf["model_type"]), model.cfg.mtp_depth, model.cfg.n_layers
        if depth and family is not None and family.mtp:  # a load report of "unexpected" keys, which looks like a broken export
            print(f"note: the MTP module{'s are layers' if depth > 1 else ' is layer'} {n}{f'..{n + depth - 1}' if depth > 1 else ''}"
                  f", as {hf['model_type']} checkpoints hold them; transformers' {family.architecture} has no MTP layer and lists their "
                  "weights as unexpected keys when it loads the folder (the model loads without them; fmoe.hf.from_pretrained reads them)")
    if meshes is not None:
        parallel.leave_ranks()


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
