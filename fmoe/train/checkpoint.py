"""Checkpoints on torch.distributed.checkpoint (DCP): save, resume, retention.

    save(out_dir, step, *, model, optimizers, extra=None, async_=False, previous=None) -> SaveHandle
        model: a module, or this rank's pipeline chunks (a list; one optimizer per chunk)
    SaveHandle.wait() -> Path                finish an async save (a sync one is done already)
    latest(out_dir, *, delete_partial=False) -> Path | None
    incomplete(path) -> str | None           which file a step_N folder lacks (None: none is missing)
    passed_over(out_dir) -> [(Path, str)]    the step_N folders newer than latest(), with what each lacks
    load(path, *, model, optimizers, knobs="saved") -> extra
    load_model(path, *, model) -> Path          the weights only (start a new run from them)
    run_config(path) -> (TransformerConfig, run), load_run(path) -> (Transformer, run)   a run's own model
    model_differences(path, cfg) -> {knob: (saved, cfg's)}   where a run's model differs from cfg
    ModelTensors(path): Mapping[name, Tensor]    its full weights, each read only when asked for
    reading(path) -> context manager of Path     a checkpoint held against prune() while it is read
    prune(out_dir, *, keep_last, keep_every=None) -> removed paths
    rng_state() -> dict, set_rng_state(state)   torch CPU/CUDA, python, numpy generators

Layout: `out_dir/step_000123/` holds DCP's files (`.metadata`, `__<rank>_*.distcp`) for
{"model": ..., "optim": ...}, built with torch.distributed.checkpoint.state_dict's
get_state_dict / set_state_dict (so FSDP2 / DTensor shards save and reshard, and several
optimizers over disjoint parameters merge into one FQN-keyed state, flattened: every entry
keyed by parameter name, so that a checkpoint saved with one pipeline split, or none,
loads with another; a pipeline rank passes its chunks, each with its own optimizers), plus one
`extra_rank<r>.pt` per rank written with torch.save: `extra` is per-rank plain state
(schedules, sampler state, RNG states) that must round trip exactly as Python objects,
which DCP's planner does not promise (it needs the keys up front to load and treats
every rank's values as one global dict). Buffers such as the MoE expert_bias are in the
model state and keep their dtype.

Completeness: a checkpoint is written to `step_000123.tmp/` and renamed to `step_000123/`
only after every rank's data and DCP's metadata are on disk: at the end of a sync save, and
for async_=True when the caller waits on the returned handle. A run killed midway, or one
that exits without waiting, leaves only a `.tmp` directory, which latest() ignores. A
step_N folder that lost files after it was written (a copy stopped part way: rsync copies
`.metadata`, which sorts first, before the data) is skipped by latest() too: it checks the
newest folders' files against what their `.metadata` names (incomplete()).

Reading runs none of a checkpoint's code (load, load_model, load_run, ModelTensors; every
file a pickle): DCP's `.metadata` is unpickled with an allow-list of what DCP's metadata
holds (its metadata classes and storage records, torch.Size, dtypes, the tensor layout, a
path), where DCP's own reader runs pickle.load; the entries DCP stores as pickled bytes (the
optimizers' param_groups knobs) and the extra files are read with
torch.load(weights_only=True), with numpy's generator state allowed in the extras (DCP and
earlier fmoe used weights_only=False). A file that names anything else (a function to call on
unpickling) is a ValueError naming the file, its entry, and what it names, before any is run.
Sizes are not bounded: a crafted checkpoint may claim tensors, files or a model (its run's
config.json) as large as it likes, and reading it allocates or reads that much; read a
checkpoint of unknown origin under memory limits.

Async saves: the caller keeps the handle; nothing here tracks saves in flight. At most one
async save is in flight at a time: pass the last handle as `previous=` (save waits for it
before it starts) or call its wait() before the next save, and wait on the last one before
the process exits, loads, prunes or looks for the latest checkpoint:

    handle = None
    for step in ...:
        ...
        handle = checkpoint.save(out_dir, step, model=model, optimizers=opts, async_=True, previous=handle)
    handle.wait()

Process groups: none is needed on one process; DCP runs with no_dist=True when
torch.distributed is not initialised. Under torchrun every rank calls save / load /
SaveHandle.wait with the same arguments (DCP's collectives); rank 0 renames the directory;
call prune and latest(delete_partial=True) on rank 0 only, with no async save in flight.

Reading a run that trains: load, load_model, load_run and ModelTensors' reads hold the
checkpoint they read (reading(): a shared flock on its directory), and prune() leaves a
held checkpoint for a later call, so a reader never loses its files to the run's retention
midway (evaluating or exporting a run as it goes; it read half a checkpoint and failed, or
found none, before). Only readers that share the run's machine or a file system that
passes flocks on are seen.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import io
import itertools
import json
import os
import pickle
import random
import re
import shutil
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element as dcp_set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import fmoe
from fmoe.model import Transformer, TransformerConfig
from fmoe.train.run import NON_FINITE, raise_together

_NAME = re.compile(r"step_(\d+)")
_BLOCK = re.compile(r"model\.blocks\.(\d+)\.")  # a trunk block's entries in the checkpoint


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process even with no_dist=True: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _out_dir(out_dir) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir: {str(out_dir)!r} exists and is not a directory")
    return out_dir


# optimizer state keyed by parameter name ("state.blocks.0.attn.wq.exp_avg",
# "param_groups.blocks.0.attn.wq.lr"), not by group index: the same keys whatever the
# grouping and however the model is split into pipeline chunks
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_FRESH = "fresh_optimizers.json"  # older checkpoints': the places in the list of the optimizers saved before their first step
_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module"}  # torch.compile's and checkpoint_wrapper's modules: not in DCP's names


def _models(model) -> list[torch.nn.Module]:
    """model as a list: one module, or a sequence of them (a pipeline's chunks on this rank,
    whose parameter names are the whole model's)."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model) if isinstance(model, (list, tuple)) else None
    if not models or not all(isinstance(m, torch.nn.Module) for m in models):
        raise ValueError(f"model: expected an nn.Module or a non-empty list of them (pipeline chunks), got {type(model).__name__}")
    return models


def _pairs(models, optimizers) -> list[tuple[torch.nn.Module, list]]:
    """Each model with the optimizers of its parameters (an optimizer belongs to the one
    model holding all its parameters); ValueError for an optimizer of none."""
    if len(models) == 1 and dist.is_initialized():  # sharded (FSDP, ep): DCP pairs the one model's parameters itself
        return [(models[0], list(optimizers))]
    owned = [{id(p) for p in m.parameters()} for m in models]
    pairs = [(m, []) for m in models]
    for i, opt in enumerate(optimizers):
        ids = {id(p) for group in opt.param_groups for p in group["params"]}
        owner = next((j for j, o in enumerate(owned) if ids <= o), None)
        if owner is None:  # one model: an optimizer of another module's parameters (DCP's KeyError 0 before)
            where = "the model's" if len(models) == 1 else f"in one of the {len(models)} models (pipeline chunks): build one optimizer per chunk"
            raise ValueError(f"optimizers[{i}]: its parameters are not all {where}")
        pairs[owner][1].append(opt)
    return pairs


def _state(pairs) -> tuple[dict, list[tuple[dict, dict]]]:
    """{"model": ..., "optim": ...} over every (model, optimizers) pair (one dict: the
    chunks' keys are disjoint, or equal with equal values for a tied copy), and each pair's
    own (model, optim) state dicts."""
    merged, parts = {"model": {}, "optim": {}}, []
    for model, opts in pairs:
        if opts:
            model_sd, optim_sd = get_state_dict(model, opts, options=_OPTIONS)
        else:
            model_sd, optim_sd = get_model_state_dict(model), {}
        merged["model"].update(model_sd)
        merged["optim"].update(optim_sd)
        parts.append((model_sd, optim_sd))
    return merged, parts


def _optimizers(optimizers) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    try:
        optimizers = list(optimizers)
    except TypeError:  # None: "'NoneType' object is not iterable" before
        raise ValueError(f"optimizers: expected a list of torch.optim.Optimizer ([] for none), got {type(optimizers).__name__}") from None
    if not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError(f"optimizers: expected a list of torch.optim.Optimizer, got {[type(o).__name__ for o in optimizers]}")
    return optimizers


def _complete(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in out_dir, oldest first: step_N directories
    holding DCP's .metadata (a save writes it last, in a .tmp directory renamed when done;
    an emptied step_N is not one, so prune() keeps the good ones for it)."""
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir()
             if p.is_dir() and (m := _NAME.fullmatch(p.name)) and (p / ".metadata").is_file()]
    return sorted(found)


class SaveHandle:
    """One save, returned by save(): `path` is the final directory, `tmp` the one written.

    A sync save's checkpoint is complete already. An async save's is complete once wait()
    has run: wait() blocks until this rank's data is on disk (re-raising the writer's
    exception if it failed), renames `.tmp` to `path` (rank 0), waits for every rank (a
    barrier under torch.distributed) and returns `path`; calling it again returns `path` at
    once. Under torchrun every rank waits on its handle of the same save.
    """

    def __init__(self, tmp: Path, final: Path, future=None):
        self.tmp, self.path, self._future = tmp, final, future
        self._finished = future is None

    def done(self) -> bool:
        """True when wait() would not block on the writer (the rename may still be due)."""
        return self._finished or self._future.done()

    def wait(self) -> Path:
        """Finish the save (see the class docstring) and return the checkpoint's path."""
        if not self._finished:
            self._future.result()
            self._finished = True
            if _rank() == 0:
                _finalize(self.tmp, self.path)
            _barrier()
        return self.path


def _finalize(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)


def save(
    out_dir, step: int, *, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
    extra: Optional[dict] = None, async_: bool = False, previous: Optional[SaveHandle] = None,
) -> SaveHandle:
    """Save model, optimizers and this rank's `extra` as `out_dir/step_<step:06d>/`.

    previous: the handle of the last save (or None); it is waited on first, so at most one
    async save is ever in flight (module docstring). A save started while an earlier async
    save has not been waited on is the caller's mistake: two writers in flight at once,
    whose collectives may interleave under torchrun.
    async_: when True the model and optimizer state are staged (copied) before returning,
    so training may go on and change them; the files are written by a background thread
    and the checkpoint becomes complete at the returned handle's wait(). When False the
    checkpoint is complete on return.

    Optimizers that have not stepped yet (no state) are saved as such and keep no state:
    DCP's get_state_dict makes their state by a step at lr 0 on zero gradients, whose step
    count would shift every later step's bias correction; it is not saved, and load leaves
    their parameters without state, whatever the order of the optimizers then.

    Returns a SaveHandle (done already when sync).
    """
    out_dir = _out_dir(out_dir)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra: expected a dict or None, got {type(extra).__name__}")
    if previous is not None and not isinstance(previous, SaveHandle):
        raise ValueError(f"previous: expected the SaveHandle of the last save or None, got {type(previous).__name__}")
    optimizers = _optimizers(optimizers)
    models = _models(model)
    pairs = _pairs(models, optimizers)  # refused before anything is written
    if previous is not None:
        previous.wait()

    final = out_dir / f"step_{step:06d}"
    tmp = out_dir / f"{final.name}.tmp"
    if _rank() == 0:
        if tmp.exists():  # left by a killed run
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    with _disk_full_named(tmp):
        torch.save(extra or {}, tmp / f"extra_rank{_rank()}.pt")

    # optimizers that have not stepped: get_state_dict makes their state by a step at lr 0 (step count 1), which would
    # shift every later step's bias correction here and in a run resumed from this; it is not saved (load leaves a
    # parameter whose state was not saved without any) and they are emptied again once saved
    fresh = [opt for opt in optimizers if not opt.state]
    state, _ = _state(pairs)
    if fresh:
        names = _parameter_names(models)
        ids = {id(p) for opt in fresh for group in opt.param_groups for p in group["params"]}
        unstepped = {name for name, params in names.items() if any(id(p) in ids for p in params)}
        state["optim"] = {k: v for k, v in state["optim"].items() if not k.startswith("state.") or _owner(k, names) not in unstepped}
    no_dist = not dist.is_initialized()
    if not async_:
        with _single_process_quiet(), _disk_full_named(tmp):
            dcp.save(state, checkpoint_id=tmp, no_dist=no_dist)
        _empty(fresh)
        if _rank() == 0:
            _finalize(tmp, final)
        _barrier()
        return SaveHandle(tmp, final)
    if no_dist:  # its background writer warns after the call returns: the filter stays (added once, moved to the front)
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
    result = dcp.async_save(state, checkpoint_id=tmp, no_dist=no_dist)  # staged: the state may change from here
    _empty(fresh)
    future = getattr(result, "upload_completion", result)  # AsyncSaveResponse or Future
    return SaveHandle(tmp, final, future)


FULL_DISK_BYTES = 1 << 20  # free space under which a failed write is named a full disk


def _bytes_in(directory: Path) -> int:
    """The bytes of the files under `directory`."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@contextmanager
def _disk_full_named(tmp: Path):
    """A write into the checkpoint `tmp` that fails where its file system has under
    FULL_DISK_BYTES free, or less than a checkpoint takes (the newest complete one's size
    beside it, less what was written): an OSError(ENOSPC) saying so (torch's writers said "[enforce fail at
    inline_container.cc] unexpected pos" or a CheckpointException), the error it replaces
    chained. Otherwise a write of FULL_DISK_BYTES into `tmp` that fails names its cause (a
    disk quota, a file-size limit, an I/O error: torch's message was the same "unexpected
    pos", naming neither) as an OSError of that errno; other failures pass as they are, with
    a note naming the checkpoint."""
    try:
        yield
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        step = tmp.name.removesuffix(".tmp")
        try:
            free = shutil.disk_usage(tmp).free
            written, newest = _bytes_in(tmp), latest(tmp.parent)
            needed = max(FULL_DISK_BYTES, _bytes_in(newest) if newest else 0)
        except OSError:
            raise err from None
        if free >= FULL_DISK_BYTES and free + written >= needed:
            probe = tmp / f".write_probe_rank{_rank()}"
            try:
                with open(probe, "wb") as f:
                    f.write(bytes(FULL_DISK_BYTES))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as cause:
                raise OSError(cause.errno, f"cannot write {step} in {tmp.parent}: {cause.strerror} (a write of {FULL_DISK_BYTES:,} bytes "
                              f"into {tmp.name} failed as the save did, {type(err).__name__}); the earlier checkpoints are kept") from err
            finally:
                probe.unlink(missing_ok=True)
            _add_note(err, f"fmoe: while saving {step} in {tmp.parent} (left as {tmp.name}; the earlier checkpoints are kept)")
            raise
        raise OSError(errno.ENOSPC, f"no space left to save {tmp.name.removesuffix('.tmp')} in {tmp.parent}: {free:,} bytes free after "
                      f"{written:,} bytes of it were written ({type(err).__name__}); the earlier checkpoints are kept, and a save needs room "
                      "for one more beside them (the run's --keep_last), so free space or keep fewer") from err


def _add_note(err: BaseException, note: str) -> None:
    """err.add_note(note) where Python has it (3.11 on); on 3.10 the error passes without it (the call itself raised
    an AttributeError in its place, which train_moe's `except OSError` then missed)."""
    add = getattr(err, "add_note", None)
    if add is not None:
        add(note)


def _empty(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Back to no state, as before their first step."""
    for opt in optimizers:
        opt.state.clear()


def latest(out_dir, *, delete_partial: bool = False) -> Optional[Path]:
    """The newest complete checkpoint in out_dir (None when there is none or out_dir does not
    exist): the newest step_N folder whose files are all there (incomplete() None; a newer
    one missing some is passed over). `.tmp` directories of interrupted saves are ignored, or
    removed with delete_partial=True (rank 0, no save in flight)."""
    out_dir = _out_dir(out_dir)
    if delete_partial and out_dir.is_dir():
        for p in out_dir.glob("step_*.tmp"):
            shutil.rmtree(p)
    return next((p for p, lacks in _newest_first(out_dir) if lacks is None), None)


def passed_over(out_dir) -> list[tuple[Path, str]]:
    """The step_N folders newer than latest(out_dir) (which it passes over), newest first,
    each with what it lacks (incomplete()): what a resume says before it goes back."""
    return list(itertools.takewhile(lambda found: found[1] is not None, _newest_first(_out_dir(out_dir))))


def _newest_first(out_dir: Path):
    """(path, incomplete(path)) of out_dir's step_N folders, newest first, each checked when
    reached (latest() reads the newest whole one's metadata and stops)."""
    found = sorted(((int(m.group(1)), p) for p in out_dir.iterdir() if p.is_dir() and (m := _NAME.fullmatch(p.name))),
                   reverse=True) if out_dir.is_dir() else []
    return ((p, incomplete(p)) for _, p in found)


def incomplete(path) -> Optional[str]:
    """Which file the step_N folder at path lacks, or None where none is missing: its
    `.metadata`, extra_rank0.pt, and every data file the metadata names, each at least as
    long as the bytes it reads there. A save writes `.metadata` last, so only a folder that
    lost files afterwards lacks one: a copy stopped part way, a file truncated or removed.
    Reads the metadata, not the data; a `.metadata` that cannot be read (damaged, or naming
    code to run) is None here, left for the reader to name (load's ValueError)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        return "no .metadata"
    if not (path / "extra_rank0.pt").is_file():
        return "no extra_rank0.pt"
    try:
        storage = _SafeReader(path).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001 (a damaged or foreign .metadata, whatever the unpickler raised: load names it)
        return None
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            return f"{name} is {'missing' if size is None else f'{size} bytes of the {end} its .metadata names'}"
    return None


def _checkpoint_dir(path) -> Path:
    """path as a complete checkpoint directory, or a FileNotFoundError saying why not."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        what = "does not exist" if not path.exists() else "is not a complete checkpoint (no .metadata)"
        raise FileNotFoundError(f"path: {str(path)!r} {what}")
    return path


def _checkpoint_or_newest(path) -> Path:
    """path as a complete checkpoint directory, or a run's out_dir as its newest one."""
    path = Path(path)
    if not (path / ".metadata").is_file() and path.is_dir():
        if (newest := latest(path)) is not None:
            return newest
        if any(path.glob("step_*")):  # a run whose saves were all interrupted (step_N.tmp) or emptied
            raise FileNotFoundError(f"path: {str(path)!r} holds no complete checkpoint (a step_N folder with its .metadata)")
        if (path / "config.json").is_file():  # a run's folder before its first save
            raise FileNotFoundError(f"path: {str(path)!r} is a run that has saved no checkpoint yet (no step_N folder beside its config.json)")
    if path.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} is a file; expected a run's folder or one of its step_N checkpoint folders")
    return _checkpoint_dir(path)


def _hold(directory: Path, operation: int) -> Optional[int]:
    """A descriptor of `directory` holding flock `operation` on it, or None where the
    directory is gone (removed before or while the lock was taken: the descriptor would hold
    an unlinked directory). A file system without flocks holds nothing (a descriptor all the
    same). BlockingIOError for LOCK_NB where another holds it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as err:  # ENOLCK, EOPNOTSUPP: a file system without flocks
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
    try:
        same = os.stat(directory).st_ino == os.fstat(fd).st_ino and (directory / ".metadata").is_file()
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


@contextmanager
def reading(path) -> Iterator[Path]:
    """Hold a complete checkpoint while it is read: `path` (a checkpoint directory, or a
    run's out_dir: its newest complete checkpoint) as the directory held, which prune()
    leaves in place until the block ends (a shared flock on the directory; prune skips a
    held checkpoint, and removes it at a call after the block). Where the run pruned the
    newest checkpoint between the listing and the lock, the newer one that replaced it is
    taken. A checkpoint directory named itself and pruned away is a FileNotFoundError
    naming it. load, load_model, load_run and ModelTensors' reads hold theirs already: this
    is for reads of one's own (dcp.load, torch.load of a file in it).

        with checkpoint.reading("out/train_moe") as step_dir:
            dcp.load(state, checkpoint_id=step_dir)
    """
    fd = None
    for _ in range(100):  # each retry follows a checkpoint pruned away: a run saves far more slowly than this loops
        found = _checkpoint_or_newest(path)
        fd = _hold(found, fcntl.LOCK_SH)
        if fd is not None:
            break
        if found == Path(path):
            raise FileNotFoundError(f"path: {str(path)!r} was removed as it was about to be read (pruned by its run?)")
    if fd is None:
        raise FileNotFoundError(f"path: {str(path)!r}: its newest checkpoint was removed each time it was about to be read")
    try:
        yield found
    finally:
        os.close(fd)


# What DCP's .metadata pickle legitimately names (module, name): its metadata classes, the
# storage records of its file system writer, torch.Size, a tensor's layout (by name) and the
# checkpoint's path; torch dtypes are taken by name on top (_MetadataUnpickler.find_class).
# Nothing else is unpickled: a pickle naming another global (eval, os.system, ...) would run it.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
})


class _CodeRefused(ValueError):
    """A checkpoint file that names code to run when unpickled (a global outside what fmoe's
    checkpoints hold): it is not read."""


def _refused(path, names, entry: Optional[str] = None) -> _CodeRefused:
    of = f" (its entry {entry})" if entry else ""
    return _CodeRefused(f"path: {str(path)!r}{of} refuses to unpickle {', '.join(names)}: a checkpoint is read without running its code")


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler for DCP's .metadata that finds only _METADATA_GLOBALS and torch
    dtypes: any other global is a _CodeRefused naming `path` and it (pickle.load, as DCP reads
    it, imports and calls whatever the file names)."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_GLOBALS and not dtype:
            raise _refused(self.path, [f"{module}.{name}"])
        # Python 3.13 pickles paths as pathlib._local's, a module older Pythons lack ("a damaged checkpoint?"); pathlib
        # holds the same classes in every version
        return super().find_class("pathlib" if module == "pathlib._local" else module, name)


class _SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader whose read_metadata unpickles with _MetadataUnpickler (DCP's own
    is a plain pickle.load). A refusal is kept in `refused` as well: DCP's load catches the
    error and reports another."""

    refused: Optional[_CodeRefused] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:  # **kwargs: DCP passes rank= for a rank's own metadata file
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = _MetadataUnpickler(file, path).load()
        except _CodeRefused as err:
            self.refused = err
            raise
        if not isinstance(metadata, Metadata):
            raise ValueError(f"path: {str(path)!r} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _weights_only_load(source, path, safe=(), entry: Optional[str] = None):
    """torch.load(source, weights_only=True) with the globals `safe` allowed besides torch's own
    (tensors, containers, numbers, strings, dtypes): a file naming any other is a _CodeRefused
    naming `path` (and `entry`, a DCP entry in it) and those globals, before any is run; other
    failures pass as they are."""
    with torch.serialization.safe_globals(list(safe)):
        try:
            return torch.load(source, weights_only=True)
        except pickle.UnpicklingError:  # the weights-only unpickler refused something: which globals?
            if isinstance(source, io.IOBase):
                source.seek(0)
            try:
                names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
            except Exception:  # not even a torch.save file: the refusal as torch said it
                names = []
            if names:
                raise _refused(path, names, entry) from None
            raise


def _extra_globals() -> list:
    """What rng_state()'s numpy generator state holds besides torch's own: the MT19937 key, an
    ndarray of uint32 (numpy's _reconstruct, ndarray, dtype and the uint32 dtype's class), under
    numpy 2's module name and numpy 1's; [] without numpy."""
    try:
        import numpy as np
    except ImportError:
        return []
    reconstruct = np.ndarray.__reduce__(np.zeros(0, np.uint32))[0]  # numpy's own _reconstruct, wherever this numpy keeps it
    return [(reconstruct, f"{module}.multiarray._reconstruct") for module in ("numpy._core", "numpy.core")] + [
        np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner whose non-tensor entries (the optimizers' param_groups: numbers,
    tuples, dtypes) are read with torch.load(weights_only=True); DCP's own runs the pickle
    (weights_only=False). `reader` names the file of a refused entry; the refusal is kept in
    `refused` too (DCP's load reports another error)."""

    refused: Optional[_CodeRefused] = None

    def __init__(self, reader: _SafeReader, **kwargs):
        super().__init__(**kwargs)
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = self.reader.storage_data.get(read_item.storage_index)
        try:
            loaded = _weights_only_load(value, Path(self.reader.path) / info.relative_path if info is not None else self.reader.path, entry=fqn)
        except _CodeRefused as err:
            self.refused = err
            raise
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _stored(path: Path) -> Mapping:
    """The checkpoint's entries by key (DCP's metadata: each tensor's size, without its data);
    a .metadata that cannot be read (cut short, damaged), or that names code to run when
    unpickled (refused, not run), is a ValueError naming path."""
    try:
        return _SafeReader(path).read_metadata().state_dict_metadata
    except _CodeRefused:
        raise
    except Exception as err:  # an UnpicklingError, EOFError, ... from the pickle DCP wrote
        raise ValueError(f"path: {str(path)!r} could not be read (.metadata: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                         "a damaged or incomplete checkpoint?") from None


def _whole_model_names(models: list[torch.nn.Module], model_state: Mapping) -> set[str]:
    """The parameter and buffer names of the whole model that `models` (model_state: their
    state) are: model_state's own, or, for pipeline chunks (fmoe.parallel.pipeline_chunk: each
    holds its stages' blocks alone, a checkpoint every stage's), those of the whole
    Transformer of their config, built on the meta device: the same names on every rank."""
    chunks = [m for m in models if isinstance(m, Transformer) and m.pipeline_chunk is not None]
    if not chunks:
        return set(model_state)
    with torch.device("meta"):
        return set(Transformer(chunks[0].cfg).state_dict())


def _check_model_shapes(path: Path, stored: Mapping, model_state: Mapping[str, torch.Tensor], whole: set, cfg=None) -> None:
    """ValueError naming the parameters (and buffers) of model_state that checkpoint `path`
    lacks or holds in another shape (full shapes: a DTensor's global one), and the saved ones
    outside `whole` (the whole model's names: _whole_model_names), before DCP reads any of
    them: a model built with other knobs than the saved one's (other shapes, fewer layers, no
    MTP modules, ...). cfg: the model's TransformerConfig, whose knobs that differ from the
    saving run's (its config.json, when the checkpoint lies in a run directory) the message
    names too. stored: _stored(path)."""
    bad = []
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = stored.get(f"model.{name}")
        if meta is None:
            bad.append(f"{name} (not saved)")
        elif isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            bad.append(f"{name} (saved {list(meta.size)}, here {list(value.shape)})")
    bad += [f"{key[len('model.'):]} (saved, not in this model)" for key, meta in stored.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata) and key[len("model."):] not in whole]
    if not bad:
        return
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    knobs, advice = "", "build the model with the saved one's knobs"
    if isinstance(cfg, TransformerConfig):
        try:
            diff = model_differences(path, cfg)
        except ValueError:  # not in a run directory, or its config.json is not one
            diff = None
        knobs = f"; the saving run's model has {knob_list(diff)}" if diff else ""
        if diff == {}:  # the same knobs: another class saved it (a model of one's own, a subclass with modules of its own)
            advice = ("the saving run's model has these knobs: build it as its own class (checkpoint.run_config(path), then "
                      "load_model(path, model=YourModel(cfg)))")
    raise ValueError(f"path: the model of {str(path)!r} differs from this one: {', '.join(bad[:4])}{more}{knobs}; {advice}")


def _check_config_sizes(path: Path, stored: Mapping, cfg: TransformerConfig) -> None:
    """A ValueError where cfg's vocab_size, hidden or n_layers is not the checkpoint's (its
    embedding's shape, its blocks' count), read from the metadata before any model is built
    (even on the meta device, a config.json claiming 10^8 layers took minutes and gigabytes).
    A checkpoint without an embedding (another model) is left to _check_model_shapes."""
    embed = stored.get("model.embed")
    if isinstance(embed, TensorStorageMetadata) and tuple(embed.size) != (cfg.vocab_size, cfg.hidden):
        raise ValueError(f"path: the model of {str(path)!r} differs from its config: the embedding is saved as {list(embed.size)}, "
                         f"the config says vocab_size {cfg.vocab_size} and hidden {cfg.hidden}")
    blocks = {int(m.group(1)) for key in stored if (m := _BLOCK.match(key))}
    if embed is not None and blocks and len(blocks) != cfg.n_layers:
        raise ValueError(f"path: the model of {str(path)!r} differs from its config: {len(blocks)} blocks are saved, the config "
                         f"says n_layers {cfg.n_layers}")


def _dcp_load(state: dict, path: Path, *, no_dist: Optional[bool] = None) -> None:
    """dcp.load of `state` (in place) from checkpoint `path`. A file DCP cannot read (cut
    short, missing) is a ValueError naming path and the first failure: DCP's own
    CheckpointException is a BaseException that `except Exception` lets through. Every rank
    raises it (DCP gathers the failures). Tensors read before the failure keep their new
    values: load the model again, from another checkpoint."""
    no_dist = not dist.is_initialized() if no_dist is None else no_dist
    reader = _SafeReader(path)
    planner = _SafeLoadPlanner(reader)  # dcp.load's default planner's options
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        refused = reader.refused or planner.refused or next((cause for cause, _ in err.failures.values() if isinstance(cause, _CodeRefused)), None)
        if refused is not None:  # this rank's, or another's (DCP gathers them): a metadata refusal is reported as another error
            raise refused from None
        rank, (cause, _) = next(iter(err.failures.items()))
        who = "" if no_dist else f"rank {rank}: "  # this process's own read: DCP's rank 0 whatever rank it is
        raise ValueError(f"path: {str(path)!r} could not be read ({who}{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}); "
                         "a damaged or incomplete checkpoint? What was read before the failure is loaded: load again, from another "
                         "checkpoint") from None


def _parameter_names(models: list[torch.nn.Module]) -> dict[str, list[torch.nn.Parameter]]:
    """The parameters of models by the name that keys their optimizer state (DCP's FQN: the name
    in the model without torch.compile's and checkpoint_wrapper's wrapper modules): a tied
    parameter under each of its names, a tied copy in each pipeline chunk under the same one."""
    names: dict[str, list[torch.nn.Parameter]] = {}
    for m in models:
        for name, p in m.named_parameters(remove_duplicate=False):
            names.setdefault(".".join(part for part in name.split(".") if part not in _WRAPPERS), []).append(p)
    return names


def _owner(key: str, names: Mapping) -> Optional[str]:
    """The parameter (one of names) whose flattened optimizer state entry `key` is
    (state.<param>.<key>, nested state deeper), or None. A parameter's name is a leaf of the
    module tree, never the beginning of another's, so the first match is the one."""
    parts = key.split(".")[1:]
    return next((name for i in range(1, len(parts)) if (name := ".".join(parts[:i])) in names), None)


def _unsaved_state(stored: Mapping, optim_state: Mapping, names: Mapping) -> set[str]:
    """The parameters (of names) whose state optim_state holds and checkpoint `stored` holds
    none of: they had no state when saved (never a gradient: AdamW and Muon keep none). A
    fresh optimizer here has state for all its parameters (get_state_dict's lr-0 step), which
    those must not keep."""
    saved = {_owner(key[len("optim."):], names) for key in stored if key.startswith("optim.state.")}
    held = {_owner(key, names) for key in optim_state if key.startswith("state.")}
    return held - saved - {None}


def _check_optimizer_state(path: Path, stored: Mapping, optim_state: Mapping) -> None:
    """ValueError naming the optimizer state entries (flattened: state.<param>.<key>,
    param_groups.<param>.<knob>) that checkpoint `path` lacks, before DCP reads any (its own
    error, a CheckpointException, is a BaseException that `except Exception` lets through):
    optimizers of another kind or set-up than the saving run's. stored: _stored(path);
    optim_state: without the parameters the checkpoint holds no state for (_unsaved_state), so
    a parameter with some of its entries saved and not others is named here."""
    missing = [name for name, value in optim_state.items()
               if f"optim.{name}" not in stored and not (isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value))]
    if missing and not any(key.startswith("optim.") for key in stored):
        raise ValueError(f"optimizers: the checkpoint {str(path)!r} holds no optimizer state (saved with optimizers=[]): load it with "
                         "optimizers=[], or load_model for the weights alone")
    if not missing:
        return
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    saved_params = {key[len("optim.param_groups."):].rpartition(".")[0] for key in stored if key.startswith("optim.param_groups.")}
    if all(name.startswith("param_groups.") and name[len("param_groups."):].rpartition(".")[0] not in saved_params
           for name in missing):  # parameters without a knob saved (another kind of optimizer lacks some knobs only)
        raise ValueError(f"optimizers: the checkpoint {str(path)!r} holds no {', '.join(missing[:4])}{more}: these parameters were in "
                         "no optimizer when it was saved (frozen then?); load with knobs='held' to keep these groups' own knobs")
    raise ValueError(f"optimizers: the checkpoint {str(path)!r} holds no {', '.join(missing[:4])}{more}: these optimizers differ from "
                     "the saving run's (another kind, or other settings); load with the kind it saved, or load_model for the weights alone")


def _read_agreed(path, *, extra: bool, holds: ExitStack) -> tuple[Path, Mapping, Optional[dict]]:
    """(checkpoint directory, its metadata (_stored), this rank's extra dict or None) of
    `path` (a checkpoint, or a run's out_dir: its newest), held (reading()) until `holds`
    closes, read by each rank itself and then
    agreed by every rank of the default group (fmoe.train.run.raise_together) before any
    collective: a file one rank cannot read, another newest checkpoint found by one rank (a
    save landing between two ranks' listings, a node's stale copy), or extras of different
    steps raise the same error on every rank. Alone, a rank's error left the others waiting
    in the load's collectives, and ranks that found different checkpoints each read their own."""
    found, stored, error, extra_dict = None, None, None, None
    try:
        found = holds.enter_context(reading(path))  # a run's out_dir was "not a complete checkpoint", though load_model took it
        stored = _stored(found)
        if extra:
            extra_file = found / f"extra_rank{_rank()}.pt"
            if not extra_file.is_file():  # resumed on more ranks than saved: rank 0's (load's docstring)
                extra_file = found / "extra_rank0.pt"
            if not extra_file.is_file():
                raise FileNotFoundError(f"path: {str(found)!r} has no extra_rank0.pt (not a checkpoint of fmoe.train.checkpoint?)")
            try:  # read first: a damaged file stops the load before the model and optimizers are overwritten
                extra_dict = _weights_only_load(extra_file, extra_file, _extra_globals())
            except _CodeRefused:
                raise
            except Exception as err:
                raise ValueError(f"path: {str(found)!r} could not be read ({extra_file.name}: {type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}); a damaged or incomplete checkpoint?") from None
    except (OSError, ValueError) as err:  # OSError: FileNotFoundError, a permission, a stale network file handle
        error = err
    step = extra_dict.get("step") if isinstance(extra_dict, Mapping) else None
    raise_together(error, None if error is not None else (str(found), step), differ=differing_checkpoints)
    return found, stored, extra_dict


def differing_checkpoints(every: list) -> str:
    """What the ranks' (checkpoint directory, extra's step or None) of one read say (every_rank's
    facts, where they differ): other directories, or other steps."""
    if len({p for p, _ in every}) > 1:
        return ("path: the ranks found different checkpoints (" + ", ".join(f"rank {rank}: {p}" for rank, (p, _) in enumerate(every))
                + "); every rank must see the same files: name one checkpoint directory")
    return (f"path: {every[0][0]!r}: the ranks' extra files are of different steps ("
            + ", ".join(f"rank {rank}: {s}" for rank, (_, s) in enumerate(every)) + "); a checkpoint put together from several saves?")


def load_model(path, *, model: torch.nn.Module) -> Path:
    """Restore only the model's weights and buffers (the expert biases) from a checkpoint, to
    start a new run from them (fine-tuning, continued pre-training): the optimizer state and
    `extra` (step, schedules, sampler, RNG) are not read. Build the optimizers after it: an
    fmoe.optim.AdamW(master_weights=True) that has stepped holds float32 masters of the
    old weights, which its next step writes back over the loaded ones (load restores both).

    path: a checkpoint directory (`out_dir/step_000123`) or a run's out_dir, whose newest
    complete checkpoint is taken. Returns the checkpoint directory used. Any mesh: DCP
    reshards the saved DTensors onto this model's (other ranks, FSDP / TP / EP sizes). The
    model must have the saved one's parameter names and shapes (pipeline chunks: the whole
    model of their config): a ValueError names those it lacks, holds in another shape or
    holds and the saved model does not, before any is read. Under several processes, every
    rank calls it, and the ranks agree on what they read as load's do.
    """
    with ExitStack() as holds:
        path, stored, _ = _read_agreed(path, extra=False, holds=holds)
        models = _models(model)
        parts = [get_model_state_dict(m) for m in models]
        state = {"model": {k: v for part in parts for k, v in part.items()}}
        error = None
        try:  # each rank checks its own parameters (a pipeline stage's): agreed before the load's collectives
            _check_model_shapes(path, stored, state["model"], _whole_model_names(models, state["model"]), getattr(models[0], "cfg", None))
        except ValueError as err:
            error = err
        raise_together(error)
        _dcp_load(state, path)
    for m, part in zip(models, parts):
        set_model_state_dict(m, {k: state["model"][k] for k in part})
    return path


class UnknownKnobs(ValueError):
    """A run's config.json names model knobs that this fmoe does not have (a run of a newer
    version): its model cannot be built here."""


def run_config(path, *, impl: str = "torch") -> tuple[TransformerConfig, dict]:
    """(model config with the ops' impl `impl`, run config) of an fmoe run directory or of
    one of its checkpoints: the model knobs and vocab_size its config.json recorded.
    UnknownKnobs (a ValueError) names the knobs this fmoe does not have, and the version
    that wrote the run."""
    path = Path(path)
    run_dir = path if (path / "config.json").is_file() else path.parent
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"path: {str(path)!r} is neither an fmoe run directory (config.json) nor a checkpoint inside one")
    try:
        run = json.loads((run_dir / "config.json").read_text())
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested past Python's stack
        raise ValueError(f"path: {str(run_dir / 'config.json')!r} is not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict) or "model" not in run["config"] or "vocab_size" not in run:
        raise ValueError(f"path: {str(run_dir / 'config.json')!r} is not an fmoe run's config (no config.model and vocab_size"
                         f"{'; a Hugging Face folder: fmoe.hf.from_pretrained reads it' if isinstance(run, dict) and 'model_type' in run else ''})")
    knobs = dict(run["config"]["model"], vocab_size=run["vocab_size"])  # block lists come back as lists: the config takes them
    unknown = sorted(set(knobs) - {f.name for f in dataclasses.fields(TransformerConfig)})
    if unknown:
        wrote = run.get("run", {}).get("fmoe") if isinstance(run.get("run"), dict) else None
        raise UnknownKnobs(f"path: {str(run_dir / 'config.json')!r} names model knobs that this fmoe ({fmoe.__version__}) does not have: "
                           f"{', '.join(unknown)} (the run was written by fmoe {wrote or 'of an unknown version'}); read it with that version")
    floats = {f.name for f in dataclasses.fields(TransformerConfig) if "float" in str(f.type)}
    knobs = {k: NON_FINITE[v] if k in floats and isinstance(v, str) and v in NON_FINITE else v
             for k, v in knobs.items()}  # write_config's strings for a float knob's inf or nan
    return TransformerConfig(**{**knobs, "impl": impl}), run


def model_differences(path, cfg: TransformerConfig) -> dict[str, tuple]:
    """{knob: (the saving run's value, cfg's)} for each TransformerConfig field in which the
    model of the fmoe run at `path` (a run directory or a checkpoint inside one: its
    config.json) differs from cfg; {} when they agree. A ValueError when path holds no run
    config that fmoe reads (UnknownKnobs: one of a newer fmoe)."""
    try:
        saved, _ = run_config(path, impl=cfg.impl)
    except (TypeError, KeyError, OSError, json.JSONDecodeError) as err:  # knobs of another version, a config.json of another kind
        raise ValueError(f"path: {str(path)!r} has no fmoe run config to compare with ({type(err).__name__}: {err})") from None
    return {f.name: (getattr(saved, f.name), getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
            if getattr(saved, f.name) != getattr(cfg, f.name)}


def knob_list(differences: Mapping[str, tuple]) -> str:
    """model_differences' knobs as text: "zero_experts=0 (here 4), k=2 (here 8)"."""
    return ", ".join(f"{name}={saved!r} (here {here!r})" for name, (saved, here) in differences.items())


class ModelTensors(Mapping):
    """A checkpoint's model tensors as a read-only mapping, parameter (and buffer) name ->
    its full value on the CPU, each read from the files only when asked for: a process that
    reads a model one tensor at a time (fmoe.train.upcycle) never holds all of it. path: a
    checkpoint directory or a run's out_dir (its newest complete checkpoint). Reads need no
    process group (each is this process's own); an unknown name is a KeyError. `name in
    tensors`, len and iteration read the names alone, never a tensor."""

    def __init__(self, path):
        self.path = _checkpoint_or_newest(path)
        stored = _stored(self.path)
        self._meta = {key[len("model."):]: meta for key, meta in stored.items()
                      if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def __getitem__(self, name: str) -> torch.Tensor:
        meta = self._meta[name]
        state = {"model": {name: torch.empty(meta.size, dtype=meta.properties.dtype)}}
        with reading(self.path):  # pruned away since: a FileNotFoundError naming it
            _dcp_load(state, self.path, no_dist=True)
        return state["model"][name]

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._meta

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


def load_run(path, *, impl: str = "torch") -> tuple[Transformer, dict]:
    """The whole model of an fmoe run directory (its newest checkpoint) or of one of its
    checkpoints, on this process's CPU in float32, with its ops' impl `impl`, and the run's
    config (config.json's dict) with "checkpoint": the directory read, e.g.
    "out/train_moe/step_000250". Under torchrun every rank calls it (DCP's collectives) and
    gets the whole model."""
    cfg, run = run_config(path, impl=impl)
    with reading(path) as found:  # the config against the saved shapes before a model is built: a config.json claiming a
        stored = _stored(found)  # larger model than its weights allocated all of it first
        _check_config_sizes(found, stored, cfg)
        with torch.device("meta"):
            shell = Transformer(cfg)
        whole = shell.state_dict()
        _check_model_shapes(found, stored, whole, set(whole), cfg)
        del shell, whole
        model = Transformer(cfg)
        return model, {**run, "checkpoint": str(load_model(found, model=model))}


def load(path, *, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], knobs: str = "saved") -> dict:
    """Restore model and optimizers in place from a checkpoint directory (or a run's out_dir:
    its newest complete checkpoint, as load_model takes it); return this rank's extra dict
    (its "step" says which checkpoint it was, for the train loop's). Each optimizer's state is
    replaced by the saved one, as torch's load_state_dict replaces it, whatever it held before
    (a step taken, some parameters without a gradient, an entry a read of opt.state[p] made):
    made afresh for every parameter (get_state_dict runs one zero-lr step on zero gradients),
    a frozen one (requires_grad False, left so) included, then overwritten bit for bit; the
    parameters the checkpoint holds no optimizer state for (no gradient before the save: AdamW
    and Muon keep none) are left without state, as they were then, and so are the optimizers
    the checkpoint saved before their first step. Gradients the parameters hold are left as
    they are.

    knobs="saved" (the default): the groups take their parameters' saved knobs (lr,
    weight_decay, ...), those the groups lack too (a scheduler's initial_lr, as torch's
    load_state_dict keeps them); a scheduler's initial_lr the checkpoint lacks (saved without
    one) is kept. The state is saved per parameter, whatever the grouping: groups may differ
    from the saving run's where each group's parameters were saved with the same knobs; a
    group whose parameters were saved with different ones is a ValueError naming them, before
    anything is read (torch's load_state_dict refuses any other grouping). knobs="held": the
    groups keep their own knobs and the state alone is loaded (a trainer that sets its knobs
    itself, e.g. a resumed run of changed learning rate or weight decay groups). A refused load
    (the ValueErrors below) leaves the state as it was. Under several processes, every rank
    (of the default group) calls it: a file that one rank cannot read, another newest
    checkpoint found by one rank, or extras of different steps raise the same error on every
    rank, before the model's collectives.

    The model and optimizer state may be loaded on another mesh (other ranks, other
    FSDP / TP / EP sizes): DCP reshards DTensors. A rank beyond those that saved reads rank
    0's extra, which is right when extra is the same on every rank (the train loop's is).
    A model of other parameter names or shapes than the saved one's (more or fewer; pipeline
    chunks: the whole model of their config), or optimizers whose state entries the
    checkpoint lacks (another kind or set-up; a parameter with some of its entries saved): a
    ValueError naming them, before anything is read."""
    with ExitStack() as holds:
        path, stored, extra = _read_agreed(path, extra=True, holds=holds)
        _load_held(path, stored, extra, model=model, optimizers=optimizers, knobs=knobs)
    return extra


def _load_held(path: Path, stored: Mapping, extra: Optional[dict], *, model, optimizers, knobs: str) -> None:
    """load's reading of the checkpoint at `path` (held by the caller)."""
    if knobs not in ("saved", "held"):
        raise ValueError(f"knobs: expected 'saved' or 'held', got {knobs!r}")
    optimizers = _optimizers(optimizers)
    models = _models(model)
    pairs = _pairs(models, optimizers)
    # DCP reads the state entries of the loading optimizers: it makes them by a step on zero
    # gradients where an optimizer holds no state at all and no parameter a gradient, for the
    # parameters that require one. Otherwise the saved entries of the others were not read,
    # without a word: a step before the load (some parameters without a gradient), a
    # defaultdict read of opt.state[p], a parameter frozen now. The gradients, the state and
    # the parameters' requires_grad are set aside while the whole state is made and loaded
    # (the state as before on a refusal).
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    held, frozen = {p: p.grad for p in params if p.grad is not None}, [p for p in params if not p.requires_grad]
    states = [opt.state for opt in optimizers]
    for p in held:
        p.grad = None
    for p in frozen:
        p.requires_grad_(True)
    for opt in optimizers:
        opt.state = collections.defaultdict(dict)
    loaded = False
    try:
        _load_state(path, stored, pairs, models, optimizers, knobs)
        loaded = True
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for p, grad in held.items():
            p.grad = grad
        if not loaded:
            for opt, state in zip(optimizers, states):
                opt.state = state


def _load_state(path: Path, stored: Mapping, pairs: list, models: list, optimizers: list, knobs: str) -> None:
    """_load_held's reading, the optimizers' state empty, their parameters without a gradient
    and each requiring one."""
    state, parts = _state(pairs)
    error = None
    try:  # each rank checks its own parameters (a pipeline stage's): agreed before the load's collectives
        _check_model_shapes(path, stored, state["model"], _whole_model_names(models, state["model"]), getattr(models[0], "cfg", None))
        names = _parameter_names(models)
        unsaved = _unsaved_state(stored, state["optim"], names)
        read = {"model": state["model"], "optim": {k: v for k, v in state["optim"].items()
                                                   if (knobs == "saved" if k.startswith("param_groups.") else _owner(k, names) not in unsaved)}}
        # the groups' saved knobs that these groups lack (a scheduler's initial_lr, a group's name): read and put in, as torch's
        # load_state_dict keeps them (a scheduler built after the load starts from the saved initial_lr, not the lr reached);
        # a scheduler's initial_lr here that the checkpoint lacks (saved without one): kept
        saved_knobs = {key[len("optim."):] for key in stored if key.startswith("optim.param_groups.")} if knobs == "saved" else set()
        extra_knobs = {key: None for key in saved_knobs - read["optim"].keys() if key[len("param_groups."):].rpartition(".")[0] in names}
        for key in [key for key in read["optim"] if key.startswith("param_groups.") and key.endswith(".initial_lr") and key not in saved_knobs]:
            del read["optim"][key]
        _check_optimizer_state(path, stored, read["optim"])
        read["optim"].update(extra_knobs)
    except ValueError as err:
        error = err
    raise_together(error)
    if knobs == "saved":
        _check_groups(path, read["optim"], optimizers, names)
    _dcp_load(read, path)  # in place; a number (not a tensor) is replaced in read's dict
    for (m, opts), (model_sd, optim_sd) in zip(pairs, parts):
        loaded_model = {k: state["model"][k] for k in model_sd}
        if opts:  # the unsaved parameters' entries as made (set_state_dict wants them all), emptied below
            optim_sd = {k: read["optim"].get(k, v) for k, v in optim_sd.items()}
            set_state_dict(m, opts, model_state_dict=loaded_model, optim_state_dict=optim_sd, options=_OPTIONS)
        else:
            set_model_state_dict(m, loaded_model)
    named = {id(p): name for name, params in names.items() for p in params}
    for opt in optimizers:
        for group in opt.param_groups:
            prefix = f"param_groups.{named[id(group['params'][0])]}." if group["params"] else None
            group.update({key[len(prefix):]: read["optim"][key] for key in extra_knobs if prefix and key.startswith(prefix)})
    for p in (p for name in unsaved for p in names[name]):  # no state, as when saved: a first step of theirs counts 1
        for opt in optimizers:
            opt.state.pop(p, None)
    if (path / _FRESH).is_file():  # an older checkpoint, with the lr-0 step's state: by place in the list, as it saved them
        _empty([optimizers[i] for i in json.loads((path / _FRESH).read_text()) if i < len(optimizers)])


def _check_groups(path: Path, knobs: Mapping, optimizers: list, names: Mapping) -> None:
    """ValueError, on every rank (raise_together), for a group of `optimizers` whose parameters
    checkpoint `path` saved with different knobs (grouped apart), naming the group, its first
    two such parameters and the knobs, before the model or the state is read: DCP takes a
    group's knobs from its first parameter's. knobs: the param_groups.<param>.<knob> entries
    to load (read, first, from the checkpoint into a copy)."""
    saved = {"optim": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in knobs.items() if k.startswith("param_groups.")}}
    _dcp_load(saved, path)
    by_param: dict = {}
    for key, value in saved["optim"].items():
        name, _, knob = key[len("param_groups."):].rpartition(".")
        for p in names.get(name, ()):
            by_param.setdefault(id(p), (name, {}))[1][knob] = value
    error = None
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            held = [by_param[id(p)] for p in group["params"] if id(p) in by_param]
            if not held:
                continue
            (first, first_knobs), differ = held[0], []
            for name, their in held[1:]:
                differ = [(k, v, their[k]) for k, v in first_knobs.items() if k in their and not _same(v, their[k])]
                if differ:
                    break
            if differ and error is None:
                error = ValueError(
                    f"optimizers[{i}].param_groups[{j}]: the checkpoint {str(path)!r} saved its parameters {first} and {name} "
                    f"with other knobs ({', '.join(f'{k} {a} and {b}' for k, a, b in differ)}), grouped apart: one group takes "
                    "one set; build the groups as saved, or load with knobs='held' to keep these groups' own knobs")
    raise_together(error)


def _same(a, b) -> bool:
    """Two saved knob values (numbers, tuples, strings, tensors) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- values whose == is not a truth value: taken as different
        return False


def prune(out_dir, *, keep_last: int, keep_every: Optional[int] = None) -> list[Path]:
    """Delete complete checkpoints except the newest keep_last and those whose step is a
    multiple of keep_every. Returns the removed paths. `.tmp` directories are left alone, and
    so is a checkpoint a reader holds (reading(): a load, an evaluation of the run as it
    trains), removed by a later call once it is free."""
    out_dir = _out_dir(out_dir)
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last: expected an int >= 1, got {keep_last!r}")
    if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1):
        raise ValueError(f"keep_every: expected an int >= 1 or None, got {keep_every!r}")
    found = _complete(out_dir)
    removed = []
    for step, p in found[:-keep_last]:
        if keep_every is None or step % keep_every != 0:
            try:
                fd = _hold(p, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # being read: left for a later prune
                continue
            if fd is None:  # removed meanwhile
                continue
            try:
                shutil.rmtree(p)
            finally:
                os.close(fd)
            removed.append(p)
    return removed


def rng_state() -> dict:
    """The states of torch's CPU and CUDA generators (one per visible device), python's random
    and numpy's global generator (when numpy is installed), for `extra`."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned. CUDA generators: those of the first min(saved,
    visible) devices, in order, so that a run saved with every GPU of a node visible resumes
    with fewer visible per process (SLURM binding one per rank); the others keep theirs."""
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise ValueError("state: expected the dict returned by rng_state()")
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
