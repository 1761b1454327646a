"""Training data: corpora of documents, packing into fixed-size micro-batches, a resumable sampler, blends.

Corpora (all give a `TokenDataset`: documents of token ids over one shared storage array):

    load_stdlib(include_tests=False)            the embedded default: the running interpreter's
                                                standard library *.py files, byte tokens
    load_text_dir(path)                         a directory of text files, byte tokens
    load_token_file(path, separator=None, vocab_size=None, dtype=None)
                                                a flat uint16 / uint32 file of token ids
                                                (nanoGPT-style), memory-mapped; the
                                                arguments default to its .index.json
    load_npy(path, separator=, vocab_size=)     a .npy 1-D integer array, memory-mapped
    load_corpus(path=None, ...)                 one of these, by what `path` is

Byte tokens: a file's bytes 0..255 are its token ids, then EOS = 256 ends every document;
PAD = 257 is reserved for consumers (never emitted here): BYTE_VOCAB_SIZE = 258.
`encode_text` / `decode_text` convert between text and byte tokens. Byte corpora are read
into one uint8 array plus per-document offsets, held in each rank's memory for the run (once:
each file read into its place; a corpus of gigabytes is better prepared into a token file,
which stays memory-mapped and shared by a node's ranks) (the default stdlib corpus: ~730 files,
~12 MB, about a second to read; with its test directories ~1800 files, ~31 MB); the EOS
after each document is virtual (added when a document is sliced), so it costs no memory.
Token files stay memory-mapped; their documents end at (and include) each `separator` token,
and trailing tokens after the last separator form a final document. A token file made by
`python -m fmoe.train.prepare` (fmoe.train.prepare) has a sidecar `<file>.index.json`
holding its dtype, separator, vocab_size and token / document counts, and, for data of
prompts and responses or of conversations (prepare's prompt_key, messages_key), the name of
its loss-mask file: one uint8 per token, 0 on a prompt's tokens (a conversation's tokens
outside the assistant's turns), which are then never labels (TokenDataset.label_mask: the
loss counts only the responses' tokens and separators, at every MTP depth too).

Splits: `dataset.split(val_percent)` puts a document in validation when a stable hash of
its key is below val_percent out of 100: crc32 of its path relative to the corpus root for
file corpora (paths sorted, so neither the directory listing order nor the other files
matter), a fixed integer hash of its index for token files.

Batches (`make_batch`): a micro-batch packs exactly T tokens. Documents are concatenated
and cut into micro-batches of T tokens; a document that does not fit the rest of a batch
continues at the start of the next one, and each piece of a document is its own sequence,
so sequences never cross document boundaries (the model attends inside cu_seqlens only).
With whole_documents (Sampler), a document that does not fit the rest of a batch starts
the next one instead, the rest of the batch padding that is never a label and is not
routed (token_mask below).
A batch is a TensorDict with batch_size [] and keys

    input_ids     [T] int64        the tokens
    labels        [T] int64        the next token in the same sequence; -100 at its last token
    loss_mask     [T] bool         False where labels is -100 (each sequence's last token,
                                   and where the label is a prompt's token: label_mask)
    positions     [T] int64        position inside the sequence (restarts at 0)
    cu_seqlens    [n + 1] int32    0 = cu[0] < cu[1] < ... < cu[n] = T, the n sequences
    token_mask    [T] bool         only with whole_documents: False on the padding, which
                                   the MoE layers do not route and the balancing losses and
                                   expert counts leave out (fmoe.layers.moe's token_mask)

and, when mtp_depth D > 0, the inputs and targets of MTP depths d = 0..D-1 (row d is
fmoe.ops.mtp_targets' entry d + 1: the main quantities rolled d + 1 more times inside each
sequence, SPEC.md section 5):

    mtp_input_ids [D, T] int64     mtp_positions [D, T] int64
    mtp_labels    [D, T] int64     mtp_loss_mask [D, T] bool

Sampling (`Sampler`): each epoch visits every document once in an order drawn from
(seed, epoch) with a torch.Generator; batches run on across epoch ends without gaps. The
state (epoch, index in the epoch's order, offset inside the current document) is enough to
resume exactly: `load_state_dict(state_dict())` into a fresh Sampler over the same dataset
reproduces the batches the uninterrupted run would have produced. The token budget T per
micro-batch is fixed at construction; a batch-size schedule changes how many micro-batches
a step draws, not their size. `next_layout()` advances
past a micro-batch as `next_batch()` does without building it, and gives what a step needs
of it besides its tokens (`batch_layout`: its cu_seqlens, counted labels at each depth and
routed tokens): a data-parallel rank builds its own micro-batches of a step and only counts
the others'. Validation: `dataset.validation_batches(T, n)`, the first n
micro-batches of the documents in stored order (no shuffle), the same list on every call.

Blends (`load_blend(spec)` -> `Blend`, `BlendSampler`): a run's data as weighted sources,

    "data/code"                       one source (a directory, token file or .npy), weight 1
    "0.7:data/web.u32,0.3:data/code.u32"   weight:path entries
    "blend.json"                      [{"name": "web", "path": "web.u32", "weight": 0.7}, ...]

(parse_blend has the rules). Each micro-batch comes whole from one source: the one furthest
below its weight (Megatron's greedy blending), so each source's share of the micro-batches
stays within about one micro-batch of its weight at every point, the same on every run.
Each source has its own Sampler, the first one seeded with `seed` itself, so a one-source
blend gives exactly Sampler's batches (and takes a Sampler's state).
`blend.split(val_percent)` splits every source; `val.validation_batches(T, n)` picks the
sources by the same rule. All sources share one vocabulary: byte sources and token
sources of another vocab_size are refused together.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import mmap
import numbers
import os
import sysconfig
import warnings
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from tensordict import TensorDict

from fmoe.ops.checks import check_bools, check_positive_int
from fmoe.ops.packed import mtp_targets

EOS = 256
PAD = 257
BYTE_VOCAB_SIZE = 258
IGNORE_INDEX = -100

# token-file dtypes: the names `dtype` accepts and the suffixes that imply one
FILE_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SUFFIX_DTYPES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}
# the sidecar index of a prepared token file: <file>.index.json, and the fields it must hold
INDEX_SUFFIX = ".index.json"
MASK_SUFFIX = ".loss_mask"  # prepare's loss-mask file beside a token file of prompts and texts: <file>.loss_mask
_INDEX_FIELDS = ("documents", "tokens", "dtype", "separator", "vocab_size")
# the keys of a blend entry (parse_blend)
_BLEND_KEYS = ("name", "path", "weight", "separator", "dtype", "vocab_size")
# tokens scanned per chunk when splitting a token file at its separators
_SCAN_CHUNK = 1 << 24
# the leading tokens of a uint16 file without an index checked for the pattern of uint32 ids (_check_not_wider_ids),
# and the fewest it takes
_WIDE_SAMPLE = 1 << 20
_WIDE_MIN_TOKENS = 256
# directory names left out of the stdlib corpus unless include_tests
_TEST_DIRS = {"test", "tests", "idle_test"}
# files of records, which a text directory does not read as bytes (fmoe.train.prepare reads their fields)
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".parquet")
# directories a text corpus walk never enters, beside those whose name starts with '.': Python's bytecode caches
_CACHE_DIRS = {"__pycache__"}


def _integral(value):
    """value as a Python int when it is an integer of another type (numpy's np.int64, a
    count computed from an array), else unchanged (None, bool, a float: for the checks to
    refuse)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return value


def _int_arg(name: str, value, low: int = 1, high: Optional[int] = None) -> int:
    """fmoe.ops.checks.check_positive_int, numpy's integers taken as the ints they are
    (returned as int)."""
    return check_positive_int(name, _integral(value), low, high)


# ----------------------------------------------------------------------------------------
# 1. Byte tokens
# ----------------------------------------------------------------------------------------


def encode_text(text: Union[str, bytes]) -> torch.Tensor:
    """Byte tokens of `text` (str is UTF-8 encoded): [n_bytes] int64 in 0..255, no EOS."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, (bytes, bytearray)):
        raise ValueError(f"text: expected str or bytes, got {type(text).__name__}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long() if text else torch.zeros(0, dtype=torch.long)


def decode_text(ids: Union[torch.Tensor, Sequence[int]]) -> str:
    """Text of byte tokens ids [n]: bytes 0..255 decoded as UTF-8 (invalid sequences become
    U+FFFD), the specials EOS and PAD dropped. Ids outside 0..BYTE_VOCAB_SIZE-1 are an error."""
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):  # [] is float32
        raise ValueError(f"ids: expected integer byte tokens, got dtype {ids.dtype}")
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= BYTE_VOCAB_SIZE):
        raise ValueError(f"ids: expected byte tokens in 0..{BYTE_VOCAB_SIZE - 1}, got values in {int(ids.min())}..{int(ids.max())}")
    return bytes(ids[ids < 256].to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# 2. Datasets
# ----------------------------------------------------------------------------------------


class _MappedFile:
    """A whole file's read-only np.memmap, pickled as its place (TokenDataset.__getstate__)."""

    def __init__(self, filename: str, dtype: str, offset: int, shape: tuple):
        self.filename, self.dtype, self.offset, self.shape = filename, dtype, offset, shape

    @staticmethod
    def of(array):
        """The _MappedFile of a memmap as np.memmap made it (its base the map itself, not a
        slice of another, and read-only); any other value as it is."""
        if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.filename and array.mode == "r":
            return _MappedFile(array.filename, array.dtype.str, array.offset, array.shape)
        return array

    def open(self) -> np.memmap:
        return np.memmap(self.filename, dtype=np.dtype(self.dtype), mode="r", offset=self.offset, shape=self.shape)


class TokenDataset:
    """Documents of token ids over one shared 1-D storage array.

    Document i is data[starts[i] : starts[i] + lengths[i]], followed by `eos` when eos is
    not None (byte corpora); its length in tokens, EOS included, is `doc_len(i)`.

    Args:
        data: [N] numpy integer array (uint8 in memory, or a uint16 / uint32 np.memmap).
        starts, lengths: [n_docs] int64 numpy arrays, every span inside data.
        names: n_docs strings (the split keys, e.g. relative paths), or None for unnamed
            documents (split by a hash of their index).
        vocab_size: every token id, eos included, is below it (the file loaders check the
            whole file; here each document is checked as it is read: a ValueError).
        eos: the token appended after each document, or None.
        label_mask: [N] numpy array aligned with data (uint8 0/1 or bool), or None: 0 where
            a token is never a label (a prompt's tokens: the loss does not count predicting
            them); None counts every token. The virtual EOS always counts.
    """

    def __init__(self, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 names: Optional[Sequence[str]], *, vocab_size: int, eos: Optional[int],
                 label_mask: Optional[np.ndarray] = None):
        if label_mask is not None and (not isinstance(label_mask, np.ndarray) or label_mask.ndim != 1 or len(label_mask) != len(data)):
            raise ValueError(f"label_mask: expected a 1-D array of the data's {len(data)} tokens, got "
                             f"{f'shape {label_mask.shape}' if isinstance(label_mask, np.ndarray) else type(label_mask).__name__}")
        for name, value in (("data", data), ("starts", starts), ("lengths", lengths)):  # floats were cut to ints silently
            kind = np.asarray(value).dtype
            if not (np.issubdtype(kind, np.integer) or (name != "data" and np.asarray(value).size == 0)):
                raise ValueError(f"{name}: expected an integer array, got {kind}")
        if np.ndim(data) != 1:  # make_batch blamed its input_ids
            raise ValueError(f"data: expected a 1-D array [N] of token ids, got shape {np.shape(data)}")
        if label_mask is not None and not (label_mask.dtype == np.bool_ or np.issubdtype(label_mask.dtype, np.integer)):
            raise ValueError(f"label_mask: expected uint8 0/1 or bool values, got {label_mask.dtype}")
        if (label_mask is not None and not isinstance(label_mask, np.memmap) and label_mask.size
                and (int(label_mask.min()) < 0 or int(label_mask.max()) > 1)):
            # read as True: a mask file's values are checked by its loader (one pass), an array in memory here
            raise ValueError("label_mask: expected uint8 0/1 or bool values, got values other than 0 and 1")
        self.data, self.label_mask = data, label_mask
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.starts.shape != self.lengths.shape or self.starts.ndim != 1:
            raise ValueError(f"starts, lengths: expected two 1-D arrays of one shape, got {self.starts.shape} and {self.lengths.shape}")
        self.names = None if names is None else list(names)
        if self.names is not None and len(self.names) != len(self.starts):
            raise ValueError(f"names: expected {len(self.starts)} names, got {len(self.names)}")
        if self.names is not None and not all(isinstance(n, str) for n in self.names):  # an AttributeError at split()
            raise ValueError(f"names: expected strings, got {next(n for n in self.names if not isinstance(n, str))!r}")
        if len(self.starts) and (self.starts.min() < 0 or self.lengths.min() < 0 or (self.starts + self.lengths).max() > len(data)):
            bad = int(np.flatnonzero((self.starts < 0) | (self.lengths < 0) | (self.starts + self.lengths > len(data)))[0])
            raise ValueError(f"starts, lengths: document {bad} spans [{self.starts[bad]}, {self.starts[bad] + self.lengths[bad]}), "
                             f"not inside the data's {len(data)} tokens")
        self.vocab_size = _int_arg("vocab_size", vocab_size)
        if eos is not None:
            eos = _int_arg("eos", eos, 0, self.vocab_size - 1)
        self.eos = eos
        self.doc_lens = self.lengths + (eos is not None)

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader's spawned workers, torch.save): a memory-mapped file's data
        and label mask by their file, mapped again where unpickled (numpy pickles a memmap
        as a copy of the whole file: a copy in every worker)."""
        return {**self.__dict__, "data": _MappedFile.of(self.data), "label_mask": _MappedFile.of(self.label_mask)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.data, self.label_mask = (a.open() if isinstance(a, _MappedFile) else a for a in (self.data, self.label_mask))

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        """Tokens in all documents, EOS included."""
        return int(self.doc_lens.sum())

    def doc_len(self, i: int) -> int:
        """Tokens in document i (EOS included); i in 0..len - 1, else a ValueError (-1 read
        the last document's)."""
        return int(self.doc_lens[_int_arg("i", i, 0, len(self) - 1)])

    def _checked_span(self, i, begin, end) -> tuple[int, int, int]:
        """(i, begin, end) as ints, checked: a document of the dataset, 0 <= begin <= end <=
        its doc_len (end None: doc_len). A negative begin read the document before's tokens,
        an end past doc_len other lengths of the tokens and the mask, without a word."""
        i = _int_arg("i", i, 0, len(self) - 1)
        n = int(self.doc_lens[i])
        begin = _int_arg("begin", begin, 0, n)
        return i, begin, n if end is None else _int_arg("end", end, begin, n)

    def _span(self, array: np.ndarray, i: int, begin: int, end: Optional[int], dtype, eos) -> torch.Tensor:
        """Entries begin..end-1 of document i's span of `array` (aligned with data), `eos`
        for the virtual EOS when the span reaches it: [end - begin] of numpy `dtype`."""
        i, begin, end = self._checked_span(i, begin, end)
        length = int(self.lengths[i])
        start = int(self.starts[i])
        # np.array copies: an int64 .npy memmap would otherwise be shared read-only with torch
        body = torch.from_numpy(np.array(array[start + begin: start + min(end, length)], dtype=dtype))
        if end > max(begin, length):  # the slice reaches the virtual EOS (an empty one at it holds none)
            body = torch.cat([body, torch.tensor([eos], dtype=body.dtype)])
        return body

    def document(self, i: int, begin: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Tokens begin..end-1 of document i (EOS included): [end - begin] int64. i in
        0..len - 1, 0 <= begin <= end <= doc_len(i) (end None: doc_len(i)), else a ValueError."""
        tokens = self._span(self.data, i, begin, end, np.int64, self.eos)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)][0]
            raise ValueError(f"vocab_size: document {i} holds token {int(bad)}, not in 0..{self.vocab_size - 1}")
        return tokens

    def document_mask(self, i: int, begin: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """label_mask of tokens begin..end-1 of document i: [end - begin] bool (all True
        without a label_mask; the virtual EOS counts); i, begin and end as for document."""
        if self.label_mask is None:
            i, begin, end = self._checked_span(i, begin, end)
            return torch.ones(end - begin, dtype=torch.bool)
        return self._span(self.label_mask, i, begin, end, bool, True)

    def subset(self, indices: np.ndarray) -> "TokenDataset":
        """The documents `indices` (in that order), sharing this dataset's storage."""
        names = None if self.names is None else [self.names[i] for i in indices]
        return TokenDataset(self.data, self.starts[indices], self.lengths[indices], names,
                            vocab_size=self.vocab_size, eos=self.eos, label_mask=self.label_mask)

    def split(self, val_percent: int) -> tuple["TokenDataset", "TokenDataset"]:
        """(train, validation): a document goes to validation when its key's bucket in
        0..99 (crc32 of its name, or a fixed hash of its index + 1 when unnamed) is below
        val_percent. Deterministic, disjoint, and together all documents, in stored order."""
        val_percent = _int_arg("val_percent", val_percent, 0, 100)
        if self.names is not None:
            buckets = np.array([zlib.crc32(n.encode("utf-8", "surrogateescape")) % 100 for n in self.names], dtype=np.int64)
        else:  # Fibonacci hashing of the index + 1 (index 0's product is 0), top 32 bits (uint64 products wrap)
            prod = np.arange(1, len(self) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            buckets = ((prod >> np.uint64(32)) % np.uint64(100)).astype(np.int64)
        val = buckets < val_percent
        return self.subset(np.flatnonzero(~val)), self.subset(np.flatnonzero(val))

    def validation_batches(self, tokens: int, n_batches: int, *, mtp_depth: int = 0, whole_documents: bool = False) -> list[TensorDict]:
        """The first n_batches micro-batches of `tokens` tokens packed from the documents in
        stored order (see make_batch for the keys; whole_documents as for Sampler); the
        same list on every call. Each document is in them at most once."""
        tokens = _int_arg("tokens", tokens)
        n_batches = _int_arg("n_batches", n_batches)
        if tokens * n_batches > self.n_tokens and not whole_documents:  # with padding: checked once drawn
            raise ValueError(f"n_batches: {n_batches} batches of {tokens} tokens need {tokens * n_batches} tokens, "
                             f"the dataset has {self.n_tokens}")
        if not len(self):
            raise ValueError("n_batches: the dataset has no documents")
        batches = list(itertools.islice(self.stored_batches(tokens, mtp_depth=mtp_depth, whole_documents=whole_documents), n_batches))
        if len(batches) < n_batches:  # padding took the room of some documents
            raise ValueError(f"n_batches: {n_batches} batches of {tokens} tokens, each document whole, need more than the dataset's "
                             f"{len(self)} documents")
        return batches

    def stored_batches(self, tokens: int, *, mtp_depth: int = 0, whole_documents: bool = False) -> Iterator[TensorDict]:
        """The micro-batches of `tokens` tokens packed from the documents in stored order
        (Sampler without shuffling; whole_documents as for it), each document once: they
        stop before a batch that would reach back into the first documents."""
        sampler = Sampler(self, tokens, seed=0, mtp_depth=mtp_depth, shuffle=False, whole_documents=whole_documents)
        while not sampler.epoch:
            batch = sampler.next_batch()
            # it ran into the first documents again: past the end of the first pass, or through a whole second one (a
            # micro-batch longer than the dataset, whole documents padded to it, can end exactly at a pass's end)
            if sampler.epoch > 1 or sampler.epoch and (sampler.index, sampler.offset) != (0, 0):
                return
            yield batch


def _is_text(blob: bytes, *, cut: bool = False) -> bool:
    """UTF-8 without a NUL byte (which text never holds: UTF-16, an image, bytecode, an
    archive); with `cut`, a last character cut short (the head of a file) is allowed."""
    if b"\0" in blob:
        return False
    try:
        blob.decode("utf-8")
    except UnicodeDecodeError as err:
        return cut and err.start >= len(blob) - 3
    return True


def _byte_dataset(root: Path, rel_paths: list[str], *, text_only: bool = False) -> TokenDataset:
    """One document per non-empty file root/rel (paths sorted), read as bytes; with
    text_only, a file that is not UTF-8 text (_is_text) is left out, with a warning naming
    how many and the first."""
    # each file read straight into its place in one array sized by the files' sizes: reading them into bytes and
    # joining them held the corpus twice (a 65 MB directory took 129 MB, per rank, for the run)
    sized = [(rel, (root / rel).stat().st_size) for rel in sorted(rel_paths)]
    data = np.empty(sum(size for _, size in sized), dtype=np.uint8)
    view = memoryview(data)
    starts, lengths, names, binary, pos = [], [], [], [], 0
    for rel, size in sized:
        n = 0
        if size:
            with open(root / rel, "rb") as f:  # at most the size it had when listed (a file being written: its head)
                while n < size and (got := f.readinto(view[pos + n : pos + size])):
                    n += got
        if n and text_only and not _is_text(view[pos : pos + n].tobytes()):
            binary.append(rel)
        elif n:
            starts.append(pos)
            lengths.append(n)
            names.append(rel)
            pos += n
    if binary:
        warnings.warn(f"path: {len(binary)} file(s) under {str(root)!r} are not UTF-8 text (a NUL byte or invalid UTF-8) and are "
                      f"left out: {', '.join(binary[:3])}{', ...' if len(binary) > 3 else ''}", stacklevel=3)
    if not names:
        raise ValueError(f"path: no non-empty {'text ' if binary else ''}files under {str(root)!r}")
    return TokenDataset(data[:pos], np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), names,
                        vocab_size=BYTE_VOCAB_SIZE, eos=EOS)


def load_stdlib(*, include_tests: bool = False) -> TokenDataset:
    """The default corpus: every *.py file of the running interpreter's standard library
    (sysconfig stdlib path, recursively), one document per non-empty file, byte tokens.
    site-packages is always left out (third-party code); the test directories (test, tests,
    idle_test) too unless include_tests. Document names are POSIX paths relative to the
    stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages"} | (set() if include_tests else _TEST_DIRS)
    return _byte_dataset(root, _walk_files(root, lambda name: name.endswith(".py"), lambda name: name not in skip))


def _walk_files(root: Path, keep_file: Callable[[str], bool], enter_dir: Callable[[str], bool], *, follow: bool = False) -> list[str]:
    """The regular files below root (symlinks to files included; symlinked directories
    entered with `follow`, each directory once: a link back up, or to a directory the tree
    holds or another link reached first (in sorted order), adds nothing) whose name
    keep_file keeps, in the directories whose names enter_dir lets the walk into (never
    walked at all: the stdlib's site-packages, a corpus' .git), as POSIX paths relative to
    root. With `follow`, each file once too: a symlink to a file the walk holds as a file
    (not a link), or that another link first in sorted order already gave, adds nothing."""

    def walk(links: bool):
        for top, dirs, files in os.walk(root, followlinks=links):
            dirs[:] = sorted(d for d in dirs if enter_dir(d))
            yield top, dirs, files

    rels, below_link = [], set()  # below_link: walked paths through a followed link
    file_links = {}  # with follow: rel -> the real path of a kept name that is a symlink to a file
    files_held = set()  # with follow: the real paths of the kept names that are files, not links
    seen = {os.path.realpath(top) for top, _, _ in walk(False)} if follow else set()  # the tree's own directories
    for top, dirs, files in walk(follow):
        if follow:
            kept = []
            for d in dirs:
                path = os.path.join(top, d)
                if top in below_link or os.path.islink(path):
                    real = os.path.realpath(path)
                    if real in seen:
                        continue
                    seen.add(real)
                    below_link.add(path)
                kept.append(d)
            dirs[:] = kept
        rel_top = Path(top).relative_to(root)
        kept = [f for f in files if keep_file(f) and os.path.isfile(os.path.join(top, f))]
        if follow:
            real_top = os.path.realpath(top)
            for f in kept:
                if os.path.islink(os.path.join(top, f)):
                    file_links[(rel_top / f).as_posix()] = os.path.realpath(os.path.join(top, f))
                else:
                    files_held.add(os.path.join(real_top, f))
        rels += [(rel_top / f).as_posix() for f in kept]
    dropped = set()
    for rel in sorted(file_links):  # each file once: the file itself, else the first link to it
        if file_links[rel] in files_held:
            dropped.add(rel)
        files_held.add(file_links[rel])
    return [rel for rel in rels if rel not in dropped]


def _existing(path: Union[str, os.PathLike]) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path: {str(path)!r} does not exist")
    return path


def list_text_files(root: Union[str, os.PathLike]) -> list[str]:
    """The files of a text corpus directory: every regular file below `root` (recursively,
    into symlinked directories too, each directory once; each file once too: a symlink to a
    file the tree holds, or to one an earlier link (in sorted order) gave, is skipped; files
    and directories whose name starts with '.' are skipped, and so are __pycache__
    directories), as sorted POSIX paths relative to root."""
    root = Path(root)
    return sorted(_walk_files(root, lambda name: not name.startswith("."),
                              lambda name: not name.startswith(".") and name not in _CACHE_DIRS, follow=True))


def load_text_dir(path: Union[str, os.PathLike]) -> TokenDataset:
    """A directory of text files (list_text_files), one document per non-empty file, read
    as bytes -> byte tokens. Document names are POSIX paths relative to `path`. A file that
    is not UTF-8 text (a NUL byte or invalid UTF-8: an image, UTF-16, an archive) is left
    out with a warning; files of records (RECORD_SUFFIXES: JSON Lines, Parquet) are a
    ValueError naming them, since their bytes are not their documents (`python -m
    fmoe.train.prepare` makes a token file of their text field)."""
    root = _existing(path)
    if not root.is_dir():
        raise ValueError(f"path: {str(root)!r} is not a directory")
    files = list_text_files(root)
    records = [f for f in files if f.lower().endswith(RECORD_SUFFIXES)]
    if records:
        raise ValueError(f"path: {str(root)!r} holds files of records ({', '.join(records[:3])}{', ...' if len(records) > 3 else ''}), "
                         "which a directory of text files would read as their raw bytes, keys and quotes included: make a token "
                         "file of their text with `python -m fmoe.train.prepare`, or give a directory of text files alone")
    return _byte_dataset(root, files, text_only=True)


def _split_documents(data: np.ndarray, *, separator: int, vocab_size: int, where: str,
                     vocab_from: Optional[str] = None) -> TokenDataset:
    """Documents of the 1-D integer array data [N], each ending at (and including) a
    `separator` token; tokens after the last separator form a final document. One chunked
    pass both finds the separators and checks every id is in 0..vocab_size-1 (`where`
    names the array in errors; vocab_from, the index file vocab_size came from, if not the
    caller's argument)."""
    vocab_size = _int_arg("vocab_size", vocab_size)
    separator = _int_arg("separator", separator, 0, vocab_size - 1)
    ends = []
    for lo in range(0, len(data), _SCAN_CHUNK):
        chunk = np.asarray(data[lo: lo + _SCAN_CHUNK])
        if data.dtype.kind == "i" and int(chunk.min()) < 0:
            bad = int(np.argmax(chunk < 0))
            raise ValueError(f"path: token {int(chunk[bad])} at index {lo + bad} of {where} is negative")
        if int(chunk.max()) >= vocab_size:
            bad = int(np.argmax(chunk >= vocab_size))
            named = "vocab_size" if vocab_from is None else f"path: the index {vocab_from!r} says vocab_size {vocab_size}"
            raise ValueError(f"{named}: token {int(chunk[bad])} at index {lo + bad} of {where} is not below vocab_size {vocab_size}")
        ends.append(lo + np.flatnonzero(chunk == separator) + 1)
    ends = np.concatenate(ends).astype(np.int64)
    if not len(ends) or ends[-1] != len(data):
        ends = np.append(ends, len(data))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return TokenDataset(data, starts, ends - starts, None, vocab_size=vocab_size, eos=None)


def index_path(path: Union[str, os.PathLike]) -> Path:
    """Where the sidecar index of the token file `path` lives: `<path>.index.json`."""
    return Path(str(path) + INDEX_SUFFIX)


def read_index(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The sidecar index of the token file `path` (written by fmoe.train.prepare), or None
    when there is none: a dict with at least documents, tokens, dtype, separator and
    vocab_size."""
    index = index_path(path)
    if not index.is_file():
        return None
    try:
        fields = json.loads(index.read_text(encoding="utf-8-sig"))  # a BOM (a Windows editor's) is no error
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested past Python's stack
        raise ValueError(f"path: the index {str(index)!r} is not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    missing = [k for k in _INDEX_FIELDS if not isinstance(fields, dict) or k not in fields]
    if missing:
        raise ValueError(f"path: the index {str(index)!r} lacks the fields {missing}")
    for name in ("documents", "tokens", "separator", "vocab_size"):  # a null separator read as "none given", a "2" as a stale count
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "vocab_size" else 0):
            raise ValueError(f"path: the index {str(index)!r} holds {name} = {value!r}, expected an int >= {1 if name == 'vocab_size' else 0}")
    if fields["separator"] >= fields["vocab_size"]:  # the error blamed the caller's separator, which was not given
        raise ValueError(f"path: the index {str(index)!r} holds separator = {fields['separator']}, not below its "
                         f"vocab_size {fields['vocab_size']}")
    if fields["dtype"] not in FILE_DTYPES:  # the error blamed the caller's dtype, which was not given
        raise ValueError(f"path: the index {str(index)!r} holds dtype = {fields['dtype']!r}, expected one of {list(FILE_DTYPES)}")
    if fields["vocab_size"] - 1 > np.iinfo(FILE_DTYPES[fields["dtype"]]).max:  # its ids wrapped when written
        raise ValueError(f"path: the index {str(index)!r} holds vocab_size = {fields['vocab_size']} with dtype {fields['dtype']}, which "
                         f"holds ids up to {np.iinfo(FILE_DTYPES[fields['dtype']]).max}: the larger ids wrapped when written; prepare "
                         "the data again as uint32")
    if not isinstance(fields.get("loss_mask"), (str, type(None))):  # a file name beside the index, or none
        raise ValueError(f"path: the index {str(index)!r} holds loss_mask = {fields['loss_mask']!r}, expected a file name or null")
    mask = fields.get("loss_mask")
    if isinstance(mask, str) and (Path(mask).name != mask or mask in ("", ".", "..")):  # a path: any file of this machine
        raise ValueError(f"path: the index {str(index)!r} holds loss_mask = {mask!r}, expected the name of a file beside it")
    return fields


def _from_index(field: str, given, index: dict, path: Path):
    """The caller's value of `field`, or the index's when the caller gave None. vocab_size
    may exceed the index's (a padded embedding table still holds every id); any other
    difference is refused."""
    if given is None:
        return index[field]
    if field in ("vocab_size", "separator"):
        given = _int_arg(field, given, 1 if field == "vocab_size" else 0)
    if given != index[field] and not (field == "vocab_size" and given > index[field]):
        raise ValueError(f"{field}: {given!r} was given, the index {str(index_path(path))!r} says {index[field]!r}")
    return given


def _looks_like_text(path: Path, n: int = 4096) -> bool:
    """The file's first n bytes are text (_is_text, a cut last character allowed), where
    token ids below 256 of a uint16 file would hold zero bytes."""
    with open(path, "rb") as f:
        head = f.read(n)
    return bool(head) and _is_text(head, cut=True)


def load_token_file(path: Union[str, os.PathLike], *, separator: Optional[int] = None,
                    vocab_size: Optional[int] = None, dtype: Optional[str] = None) -> TokenDataset:
    """A flat binary file of token ids (nanoGPT-style), memory-mapped.

    Args:
        path: the file; its size must be a positive multiple of the dtype's size.
        separator: the token id that ends a document; it stays in the document as its last
            token. Tokens after the last separator form a final document.
        vocab_size: the user's vocabulary size; every token (separator included) must be
            below it (checked in one chunked pass over the file, with the separator scan).
        dtype: "uint16" or "uint32"; None infers it from the suffix (.u16 / .uint16 /
            .u32 / .uint32).

    When the file has a sidecar index (`<path>.index.json`, see fmoe.train.prepare), the
    arguments left None come from it; a given value that differs from the index is
    refused (except a larger vocab_size), and so is a file whose token or document count
    is not the index's (a stale index). Without an index, a file read as uint16 whose first
    tokens hold 0 at every other place and ids between is refused as one of uint32 ids
    (_check_not_wider_ids: the ids fit any vocab_size, so nothing else would tell).
    """
    path = _existing(path)
    if not path.is_file():
        raise ValueError(f"path: {str(path)!r} is not a regular file")
    separator, vocab_size = _integral(separator), _integral(vocab_size)
    index = read_index(path)
    given_dtype, vocab_from = dtype, None
    if index is not None and vocab_size is None:  # the index's, named as such in errors
        vocab_from = str(index_path(path))
    if index is not None:
        separator, vocab_size, dtype = (_from_index(field, given, index, path) for field, given in
                                        (("separator", separator), ("vocab_size", vocab_size), ("dtype", dtype)))
    missing = [name for name, value in (("separator", separator), ("vocab_size", vocab_size)) if value is None]
    text = index is None and path.suffix.lower() not in (*SUFFIX_DTYPES, ".bin") and _looks_like_text(path)
    how = ("a directory of text files is read as their bytes (load_text_dir), and `python -m fmoe.train.prepare` makes a "
           "token file of text or records")
    if missing:
        raise ValueError(f"{', '.join(missing)}: required for the token file {str(path)!r} (it has no {INDEX_SUFFIX} index)"
                         + (f"; it looks like text, not token ids: {how}" if text else ""))
    if text:  # token ids below 256 hold zero bytes, which text never does: its bytes read as ids would be garbage
        raise ValueError(f"path: {str(path)!r} looks like text (UTF-8 without a NUL byte), not token ids: {how}")
    implied = SUFFIX_DTYPES.get(path.suffix.lower())
    if dtype in FILE_DTYPES and implied is not None and dtype != implied:
        if given_dtype is None:  # the index's
            raise ValueError(f"path: the index {str(index_path(path))!r} says dtype {dtype!r}, the suffix of {str(path)!r} "
                             f"means {implied!r}")
        raise ValueError(f"dtype: {dtype!r} was given, the suffix of {str(path)!r} means {implied!r}")
    if dtype is None:
        if path.suffix.lower() not in SUFFIX_DTYPES:
            raise ValueError(f"dtype: cannot infer it from the suffix of {str(path)!r}; pass dtype='uint16' or 'uint32' "
                             f"(or name the file {', '.join(SUFFIX_DTYPES)})")
        dtype = SUFFIX_DTYPES[path.suffix.lower()]
    if dtype not in FILE_DTYPES:
        raise ValueError(f"dtype: expected one of {list(FILE_DTYPES)}, got {dtype!r}")
    np_dtype = np.dtype(FILE_DTYPES[dtype])
    if index is None and vocab_size > np.iinfo(np_dtype).max + 1:  # the caller's: maybe a model's padded table, so warned
        warnings.warn(f"vocab_size: {vocab_size} is beyond what {dtype} holds (ids up to {np.iinfo(np_dtype).max}): where "
                      f"{str(path)!r} holds ids of a tokenizer that large, they wrapped when written as {dtype} and read as other "
                      "tokens (write them as uint32)", stacklevel=2)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"path: {str(path)!r} is empty")
    if size % np_dtype.itemsize:
        raise ValueError(f"path: the size of {str(path)!r} ({size} bytes) is not a multiple of {np_dtype.itemsize} ({dtype})")
    if index is not None and index["tokens"] != size // np_dtype.itemsize:
        raise ValueError(f"path: {str(path)!r} holds {size // np_dtype.itemsize} tokens, its index says {index['tokens']} "
                         "(a stale index: prepare the file again)")
    data = np.memmap(path, dtype=np_dtype, mode="r")
    if index is None and dtype == "uint16":
        _check_not_wider_ids(data, path)
    dataset = _split_documents(data, separator=separator, vocab_size=vocab_size, where=repr(str(path)), vocab_from=vocab_from)
    if index is not None and index.get("loss_mask") is not None:
        dataset.label_mask = _read_label_mask(path.parent / index["loss_mask"], len(data), repr(str(index_path(path))))
    if index is not None and index["documents"] != len(dataset):
        raise ValueError(f"path: {str(path)!r} holds {len(dataset)} documents, its index says {index['documents']} "
                         "(a stale index: prepare the file again)")
    return dataset


def _check_not_wider_ids(data: np.ndarray, path: Path) -> None:
    """Refuse a uint16 read of what looks like a file of uint32 ids (dtype: a wrong
    --data_dtype, or a .u16 name): in its first _WIDE_SAMPLE tokens (at least
    _WIDE_MIN_TOKENS), every id at one parity (odd positions: the high halves of
    little-endian uint32 ids below 65536; even ones on a big-endian machine) is 0 while
    most ids at the other parity are not. Ids below 65536 pass the vocab_size check, so
    nothing else would catch it: every other id would read as 0. A uint16 file alternating
    so strictly, 0 at every other place for thousands of tokens, would hold documents of
    one token (separator 0) or token 0 between all others; one with zeros anywhere else,
    however many, passes."""
    n = min(len(data), _WIDE_SAMPLE)
    if n < _WIDE_MIN_TOKENS:
        return
    sample = np.asarray(data[:n - n % 2]).reshape(-1, 2)
    zeros = (sample == 0).sum(axis=0)  # per parity: even positions, odd positions
    rows = len(sample)
    for zero, other, place in ((1, 0, "odd"), (0, 1, "even")):
        if zeros[zero] == rows and rows - zeros[other] > rows // 2:
            raise ValueError(f"dtype: {str(path)!r} read as uint16 holds 0 at every {place} position of its first {2 * rows} tokens "
                             f"and ids at the {'even' if place == 'odd' else 'odd'} ones ({rows - int(zeros[other])} of "
                             f"{rows} non-zero): it looks like a file of uint32 ids, each read as an id and a 0; pass "
                             "dtype='uint32' (--data_dtype=uint32, or name it .u32)")


def _read_label_mask(path: Path, n_tokens: int, where: str) -> np.ndarray:
    """The loss-mask file a token file's index names (fmoe.train.prepare's prompt_key or
    messages_key): one uint8 per token, 1 where the token may be a label, memory-mapped; its
    size and values are checked (one chunked pass)."""
    if not path.is_file():
        raise ValueError(f"path: the loss mask {str(path)!r} that {where} names does not exist")
    if path.stat().st_size != n_tokens:
        raise ValueError(f"path: the loss mask {str(path)!r} holds {path.stat().st_size} entries for {n_tokens} tokens "
                         "(a stale file: prepare the data again)")
    mask = np.memmap(path, dtype=np.uint8, mode="r")
    for lo in range(0, n_tokens, _SCAN_CHUNK):
        if int(np.asarray(mask[lo: lo + _SCAN_CHUNK]).max()) > 1:
            raise ValueError(f"path: the loss mask {str(path)!r} holds values other than 0 and 1")
    return mask


_NPY_MAGIC = b"\x93NUMPY"  # how np.save's files start
_ZIP_MAGIC = b"PK\x03\x04"  # and np.savez's (zip archives)


def _refuse_npz(path: Path) -> None:
    """A ValueError for a numpy archive (np.savez / np.savez_compressed: a .npz name or a
    zip file), which no loader reads."""
    with open(path, "rb") as f:
        zipped = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    if zipped or path.suffix.lower() == ".npz":
        raise ValueError(f"path: {str(path)!r} is a numpy archive (np.savez), which is not read: save the one array of token "
                         "ids with np.save (a .npy file)")


def load_npy(path: Union[str, os.PathLike], *, separator: int, vocab_size: int,
             dtype: Optional[str] = None) -> TokenDataset:
    """A .npy file holding a 1-D integer array of token ids, memory-mapped (np.load with
    mmap_mode="r", never unpickling), split into documents at `separator` like
    load_token_file (ids must be in 0..vocab_size-1). `dtype`, when given, must be the
    array's (e.g. "int32"). A numpy archive (np.savez), or a file that is no np.save array,
    is a ValueError saying so."""
    path = _existing(path)
    if not path.is_file():
        raise ValueError(f"path: {str(path)!r} is not a regular file")
    _refuse_npz(path)
    with open(path, "rb") as f:
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:  # numpy's message offered to unpickle it (allow_pickle)
            raise ValueError(f"path: {str(path)!r} is not a .npy array (it does not start as np.save's files do): save the "
                             "token ids with np.save")
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as err:  # a header cut short, a Python object array
        raise ValueError(f"path: {str(path)!r} is not a .npy array of token ids ({err})") from err
    if not isinstance(data, np.ndarray) or data.ndim != 1 or data.dtype.kind not in "iu":
        what = f"a {data.ndim}-D {data.dtype} array" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"path: {str(path)!r} holds {what}; expected a 1-D integer array of token ids")
    if dtype is not None and dtype != data.dtype.name:
        raise ValueError(f"dtype: {dtype!r} was given, {str(path)!r} holds {data.dtype.name}")
    if not len(data):
        raise ValueError(f"path: {str(path)!r} is empty")
    return _split_documents(data, separator=separator, vocab_size=vocab_size, where=repr(str(path)))


def load_corpus(path: Union[str, os.PathLike, None] = None, *, separator: Optional[int] = None,
                vocab_size: Optional[int] = None, dtype: Optional[str] = None) -> TokenDataset:
    """load_stdlib() when path is None, load_text_dir(path) for a directory, load_npy for a
    .npy file (a .npz archive is a ValueError), otherwise load_token_file(path, separator=, vocab_size=, dtype=) (separator
    and vocab_size then required, from the arguments or the file's index). A directory is
    its files' bytes (vocab_size BYTE_VOCAB_SIZE, EOS after each): separator, vocab_size or
    dtype given with one is a ValueError (they were ignored)."""
    if path is None:
        return load_stdlib()
    separator, vocab_size = _integral(separator), _integral(vocab_size)
    if _existing(path).is_dir():
        given = {name: value for name, value in (("separator", separator), ("vocab_size", vocab_size), ("dtype", dtype))
                 if value is not None}
        if given:
            raise ValueError(f"{', '.join(given)}: {str(path)!r} is a directory, read as the bytes of its text files "
                             f"(vocab_size {BYTE_VOCAB_SIZE}, the EOS {EOS} after each file): {given} apply to token files only")
        return load_text_dir(path)
    if Path(path).suffix.lower() == ".npz":
        _refuse_npz(Path(path))
    if Path(path).suffix.lower() == ".npy":
        if separator is None or vocab_size is None:
            raise ValueError(f"separator, vocab_size: required for the .npy file {str(path)!r}")
        return load_npy(path, separator=separator, vocab_size=vocab_size, dtype=dtype)
    return load_token_file(path, separator=separator, vocab_size=vocab_size, dtype=dtype)


# ----------------------------------------------------------------------------------------
# 3. Batches and the sampler
# ----------------------------------------------------------------------------------------


def make_batch(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, mtp_depth: int = 0, *,
               label_mask: Optional[torch.Tensor] = None, token_mask: Optional[torch.Tensor] = None) -> TensorDict:
    """The batch TensorDict (batch_size []) of packed tokens input_ids [T] int64 and
    sequence bounds cu_seqlens [n + 1]: keys input_ids, labels, loss_mask, positions,
    cu_seqlens (int32), and mtp_input_ids, mtp_positions, mtp_labels, mtp_loss_mask [D, T]
    when mtp_depth D > 0 (module docstring). cu_seqlens holds 0 = cu[0] <= cu[1] <= ... <=
    cu[n] = T: an empty sequence holds no token and counts nothing, as in the ops (Sampler
    makes none; context parallelism's tests pack one on purpose). label_mask [T] bool: False where a token is
    never a label (a prompt's tokens, TokenDataset.label_mask), so the positions predicting
    it, at every depth, do not count; None counts every token. Labels are -100 where
    loss_mask is False. token_mask [T] bool: False on padding (whole sequences of it, never
    labels: give label_mask False there too), stored as the batch's token_mask, which the
    MoE layers do not route; None stores none. Either mask may hold 0/1 integers for False
    and True; other values are a ValueError."""
    mtp_depth = _int_arg("mtp_depth", mtp_depth, 0)
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        got = f"{input_ids.dtype} {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected [T] integer token ids, got {got}")
    if input_ids.dtype in (torch.uint16, torch.uint32, torch.uint64):  # a token file's ids (torch.from_numpy): torch's min lacks them
        input_ids = input_ids.long()  # a uint64 id past int64's range turns negative: refused below
    if input_ids.numel() and int(input_ids.min()) < 0:
        raise ValueError(f"input_ids: expected token ids >= 0, got {int(input_ids.min())}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens: expected an int32 or int64 tensor [n + 1], got {got}")
    if cu_seqlens.numel() and int(cu_seqlens.max()) > torch.iinfo(torch.int32).max:  # it is stored as int32
        raise ValueError(f"cu_seqlens: values up to {int(cu_seqlens.max())} do not fit int32")
    cu_seqlens = cu_seqlens.to(torch.int32)
    for name, mask in (("label_mask", label_mask), ("token_mask", token_mask)):
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__  # a numpy mask: "got (10,)"
            raise ValueError(f"{name}: expected a tensor of input_ids' shape {tuple(input_ids.shape)}, got {got}")
    for name, mask in (("label_mask", label_mask), ("token_mask", token_mask)):  # a 2 was read as True
        if mask is not None and mask.dtype != torch.bool and mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
            bad = mask[(mask != 0) & (mask != 1)][0].item()
            raise ValueError(f"{name}: expected bool or 0/1 values, got {bad!r}")
    entries = mtp_targets(input_ids.long(), cu_seqlens, mtp_depth, loss_mask=None if label_mask is None else label_mask.bool(),
                          ignore_index=IGNORE_INDEX)
    if label_mask is not None:
        for e in entries:
            e["labels"] = torch.where(e["loss_mask"], e["labels"], IGNORE_INDEX)
    main = entries[0]
    batch = TensorDict(
        input_ids=main["input_ids"], labels=main["labels"], loss_mask=main["loss_mask"],
        positions=main["positions"], cu_seqlens=cu_seqlens, batch_size=[],
    )
    if token_mask is not None:
        batch["token_mask"] = token_mask.bool()
    if mtp_depth:
        for key in ("input_ids", "positions", "labels", "loss_mask"):
            batch[f"mtp_{key}"] = torch.stack([e[key] for e in entries[1:]])
    return batch


def _layout(cu_seqlens: torch.Tensor, loss_tokens: Sequence[int], routed_tokens: int) -> TensorDict:
    return TensorDict(cu_seqlens=cu_seqlens.to(torch.int32), loss_tokens=torch.tensor(loss_tokens, dtype=torch.int64),
                      routed_tokens=torch.tensor(routed_tokens, dtype=torch.int64), batch_size=[])


def batch_layout(batch: TensorDict) -> TensorDict:
    """What a step needs of a micro-batch besides its tokens, a TensorDict (batch_size []):

        cu_seqlens     [n + 1] int32   the batch's sequence bounds
        loss_tokens    [D + 1] int64   its counted labels: loss_mask.sum() of the main
                                       model, then mtp_loss_mask[d].sum() of each MTP depth
        routed_tokens  [] int64        its tokens that are not padding (token_mask.sum(),
                                       else T): those the MoE layers route

    Sampler.next_layout() gives the same without building the batch."""
    if not isinstance(batch, TensorDict) or "loss_mask" not in batch.keys() or "cu_seqlens" not in batch.keys():
        raise ValueError(f"batch: expected a micro-batch TensorDict (make_batch's keys), got {type(batch).__name__}")
    loss_tokens = [int(batch["loss_mask"].sum())]
    if "mtp_loss_mask" in batch.keys():
        loss_tokens += [int(row.sum()) for row in batch["mtp_loss_mask"]]
    routed = int(batch["token_mask"].sum()) if "token_mask" in batch.keys() else batch["input_ids"].numel()
    return _layout(batch["cu_seqlens"], loss_tokens, routed)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), stable across runs and platforms."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Sampler:
    """Deterministic, resumable stream of packed micro-batches over a TokenDataset.

    Epoch e visits the documents in the order torch.randperm(n_docs) drawn from a generator
    seeded by (seed, e) (stored order when shuffle is False). Micro-batches take the next
    `tokens_per_batch` tokens of that stream, running on into the next epoch at the end of
    one (a batch may hold a document's pieces from two epochs when T exceeds the dataset).

    Args:
        dataset: a TokenDataset with at least one token; its empty documents are passed
            over (every sequence of cu_seqlens has a token).
        tokens_per_batch: T, the tokens of every micro-batch, fixed for the sampler's life.
        seed: the shuffle seed (an int).
        mtp_depth: D, MTP targets in every batch when > 0 (see make_batch).
        shuffle: False visits the documents in stored order every epoch.
        whole_documents: a document that does not fit the rest of a micro-batch starts the
            next one instead of being cut, and the rest is padding (its own sequence of
            PAD for byte corpora, else token 0; never a label): no piece of a document is
            trained without the tokens before it (a response without its prompt). A
            document longer than a micro-batch is still cut, starting a batch. Every
            batch has a token_mask, False on the padding: attention computes it as any
            tokens, the MoE layers do not route it, and the balancing losses and expert
            counts leave it out.
    """

    def __init__(self, dataset: TokenDataset, tokens_per_batch: int, *, seed: int, mtp_depth: int = 0,
                 shuffle: bool = True, whole_documents: bool = False):
        if not isinstance(dataset, TokenDataset):
            raise ValueError(f"dataset: expected a TokenDataset, got {type(dataset).__name__}")
        if not len(dataset):
            raise ValueError("dataset: has no documents")
        if not dataset.n_tokens:
            raise ValueError(f"dataset: its {len(dataset)} documents are all empty (no tokens)")
        self.dataset = dataset
        self.tokens_per_batch = _int_arg("tokens_per_batch", tokens_per_batch)
        self.seed = _int_arg("seed", seed, 0)
        self.mtp_depth = _int_arg("mtp_depth", mtp_depth, 0)
        check_bools(shuffle=shuffle, whole_documents=whole_documents)
        self.shuffle, self.whole_documents = shuffle, whole_documents
        self.epoch, self.index, self.offset = 0, 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """[n_docs] int64, the documents in epoch `epoch`'s visiting order."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=gen)

    def _next_spans(self) -> tuple[list[tuple[int, int, int]], int]:
        """Advance past the next micro-batch: its sequences as (document, begin, end) token
        spans in order, and the padding after them (whole_documents; else 0)."""
        spans, padding = [], 0
        remaining = self.tokens_per_batch
        while remaining:
            doc = int(self._order[self.index])
            if self.whole_documents and self.offset == 0 and remaining < min(self.dataset.doc_len(doc), self.tokens_per_batch):
                padding = remaining
                break
            take = min(self.dataset.doc_len(doc) - self.offset, remaining)
            if take:  # an empty document (no tokens, no EOS) is passed over: no sequence of length 0
                spans.append((doc, self.offset, self.offset + take))
                remaining -= take
            self.offset += take
            if self.offset == self.dataset.doc_len(doc):
                self.index, self.offset = self.index + 1, 0
                # and past the empty documents after it: an epoch whose last documents are empty ends with its last token
                while self.index < len(self.dataset) and not self.dataset.doc_len(int(self._order[self.index])):
                    self.index += 1
                if self.index == len(self.dataset):
                    self.epoch, self.index = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
        return spans, padding

    def next_batch(self) -> TensorDict:
        """The next micro-batch of tokens_per_batch tokens (make_batch's keys)."""
        spans, padding = self._next_spans()
        pieces = [self.dataset.document(doc, begin, end) for doc, begin, end in spans]
        masks = None
        if self.dataset.label_mask is not None or self.whole_documents:
            masks = [self.dataset.document_mask(doc, begin, end) for doc, begin, end in spans]
        seqlens = [0] + [end - begin for _, begin, end in spans]
        token_mask = None
        if self.whole_documents:  # the padding, if any, is the last sequence
            token_mask = torch.ones(self.tokens_per_batch, dtype=torch.bool)
            token_mask[self.tokens_per_batch - padding:] = False
        if padding:
            pieces.append(torch.full((padding,), PAD if self.dataset.eos is not None else 0, dtype=torch.long))
            masks.append(torch.zeros(padding, dtype=torch.bool))
            seqlens.append(padding)
        cu_seqlens = torch.tensor(seqlens, dtype=torch.int64).cumsum(0)
        return make_batch(torch.cat(pieces), cu_seqlens, self.mtp_depth, label_mask=None if masks is None else torch.cat(masks),
                          token_mask=token_mask)

    def next_layout(self) -> TensorDict:
        """Advance past the next micro-batch as next_batch does, without building it: its
        batch_layout (cu_seqlens, loss_tokens, routed_tokens), read from the documents'
        lengths and label masks alone. A data-parallel rank takes this for the step's other
        ranks' micro-batches: the step's counts without their tokens and MTP targets."""
        spans, padding = self._next_spans()
        seqlens = [0] + [end - begin for _, begin, end in spans] + ([padding] if padding else [])
        counts = [0] * (self.mtp_depth + 1)
        for doc, begin, end in spans:  # entry k counts the sequence's labels from its (k + 1)-th token on (mtp_targets)
            if self.dataset.label_mask is None:
                for k in range(min(self.mtp_depth + 1, end - begin - 1)):
                    counts[k] += end - begin - 1 - k
            else:
                mask = self.dataset.document_mask(doc, begin, end).numpy()
                labels = np.cumsum(mask[::-1])[::-1]  # labels[j]: those from token j on
                for k in range(min(self.mtp_depth + 1, end - begin - 1)):
                    counts[k] += int(labels[k + 1])
        return _layout(torch.tensor(seqlens, dtype=torch.int64).cumsum(0), counts, self.tokens_per_batch - padding)

    def __iter__(self) -> Iterator[TensorDict]:
        return self

    def __next__(self) -> TensorDict:
        return self.next_batch()

    def state_dict(self) -> dict:
        """Where the stream stands: epoch, index in the epoch's order, offset (tokens) into
        that document, plus the seed, shuffle flag, document count and token count it is
        valid for (the token count tells other data with as many documents apart: the same
        sources prepared with another tokenizer, another corpus), and whole_documents (whether
        a cut at offset > 0 is a long document's, load_state_dict)."""
        return dict(epoch=self.epoch, index=self.index, offset=self.offset, seed=self.seed,
                    shuffle=self.shuffle, n_documents=len(self.dataset), n_tokens=self.dataset.n_tokens,
                    whole_documents=self.whole_documents)

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the sampler must have the same seed, shuffle flag and
        dataset size in documents and tokens (tokens_per_batch, mtp_depth and whole_documents
        may differ; a state without n_tokens, from before it was kept, is checked by documents
        alone). A whole_documents sampler resuming a stream that was cut inside a document
        without whole_documents (a state of a sampler without it, or from before it was kept)
        goes on at the next document: the rest of the cut one would be trained without the
        tokens before it; a long document cut by a whole_documents sampler goes on where it
        was cut."""
        keys = ("epoch", "index", "offset", "seed", "shuffle", "n_documents")
        if not isinstance(state, Mapping):  # None: "argument of type 'NoneType' is not iterable" before
            raise ValueError(f"state: expected a Sampler's state_dict() (a dict), got {type(state).__name__}")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"state: missing keys {missing}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("n_documents", len(self.dataset)),
                          ("n_tokens", self.dataset.n_tokens)):
            if key in state and state[key] != mine:
                raise ValueError(f"state: {key} is {state[key]!r}, this sampler has {mine!r}")
        epoch = _int_arg("state['epoch']", state["epoch"], 0)
        index = _int_arg("state['index']", state["index"], 0, len(self.dataset) - 1)
        order = self._epoch_order(epoch)
        offset = _int_arg("state['offset']", state["offset"], 0, max(self.dataset.doc_len(int(order[index])) - 1, 0))
        check_bools(**{"state['whole_documents']": state.get("whole_documents", False)})
        if offset and self.whole_documents and not state.get("whole_documents", False):  # cut mid-document: the next one
            index, offset = index + 1, 0
            if index == len(self.dataset):
                epoch, index, order = epoch + 1, 0, self._epoch_order(epoch + 1)
        self.epoch, self.index, self.offset, self._order = epoch, index, offset, order


# ----------------------------------------------------------------------------------------
# 4. Blends: weighted sources, one source per micro-batch
# ----------------------------------------------------------------------------------------


def _where(name: str, path: Optional[str]) -> str:
    """How errors name a source: data: source 'code' (data/code.u32)."""
    return f"data: source {name!r}" + (f" ({path})" if path is not None else "")


@contextlib.contextmanager
def _naming(where: str):
    """Prefix the ValueError / FileNotFoundError raised inside with `where` (the source)."""
    try:
        yield
    except (ValueError, FileNotFoundError) as err:
        raise (FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError)(f"{where}: {err}") from err


def _json_entries(path: Path) -> list[dict]:
    """The raw entries of a JSON blend file, relative paths made relative to its directory."""
    if not path.is_file():
        raise FileNotFoundError(f"data: blend file {str(path)!r} does not exist")
    try:
        entries = json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM (a Windows editor's) is no error
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"data: blend file {str(path)!r} is not valid JSON ({err})") from err
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"data: blend file {str(path)!r}: expected a non-empty JSON list of objects "
                         '{"path": ..., "weight": ...}')
    resolved = []
    for i, entry in enumerate(entries):
        missing, unknown = {"path", "weight"} - entry.keys(), entry.keys() - set(_BLEND_KEYS)
        if missing or unknown:
            raise ValueError(f"data: blend file {str(path)!r}, entry {i}: "
                             + (f"missing {sorted(missing)}" if missing else f"unknown keys {sorted(unknown)} (known: {list(_BLEND_KEYS)})"))
        if isinstance(entry["path"], str) and entry["path"] and not os.path.isabs(entry["path"]):
            entry = {**entry, "path": str(path.parent / entry["path"])}
        resolved.append(entry)
    return resolved


def _short_entries(spec: str) -> list[dict]:
    """The raw entries of "0.7:path/a,0.3:path/b" (the first colon of each entry splits).
    spec is no existing path: an entry whose part before the colon is not a number is
    refused as that (spec is a missing path, or its weight is no number), not as a weight."""
    entries = []
    for item in spec.split(","):
        weight, colon, path = item.partition(":")
        if not colon or not path.strip():
            raise ValueError(f"data: blend entry {item.strip()!r} of {spec!r}: expected WEIGHT:PATH, "
                             "e.g. '0.7:data/code.u32,0.3:data/web.u32'")
        try:
            weight = float(weight)
        except ValueError:  # 'data/no:there.u16', 'C:\\x.u16': a path with a colon more likely than a weight
            raise ValueError(f"data: {spec!r} does not exist as a path, and is not a blend of WEIGHT:PATH entries: "
                             f"{weight.strip()!r} (before the ':' of {item.strip()!r}) is not a number; e.g. "
                             "'0.7:data/code.u32,0.3:data/web.u32'") from None
        entries.append({"path": path.strip(), "weight": weight})
    return entries


def _checked_entry(entry: dict, origin: str) -> dict:
    """One blend entry with all of _BLEND_KEYS: name defaults to the path's file or directory
    name, weight a float > 0, the per-source options None when not given."""
    path = entry["path"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"data: blend {origin}: path must be a non-empty string, got {path!r}")
    name = entry.get("name", Path(path).resolve().name or path)
    if not isinstance(name, str) or not name:
        raise ValueError(f"data: source at {path}: name must be a non-empty string, got {name!r}")
    weight = entry["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"{_where(name, path)}: weight must be a finite number, got {weight!r}")
    if weight <= 0:
        raise ValueError(f"{_where(name, path)}: weight must be > 0, got {weight:g}")
    return {**{key: None for key in _BLEND_KEYS}, **entry, "name": name, "weight": float(weight)}


def parse_blend(spec: Union[str, os.PathLike]) -> list[dict]:
    """The sources of a data blend, each a dict with keys name, path, weight (a float > 0,
    not normalised) and separator, dtype, vocab_size (None unless given).

    `spec` is one of
        "blend.json"              a JSON list of objects with "path" and "weight" and
                                  optionally "name", "separator", "dtype", "vocab_size";
                                  relative paths are relative to the JSON file's directory
        "0.7:data/a,0.3:b.u32"    weight:path entries, comma-separated (cwd-relative paths)
        "data/a" or "tokens.u32"  one source of weight 1 (an existing path, or one with no
                                  ':' or ',')
    A source's name defaults to its path's file or directory name; names must be unique
    (use "name" in a JSON blend to tell apart files of one name).

    >>> parse_blend("3:web.u32,1:code")[1]["name"], parse_blend("3:web.u32,1:code")[1]["weight"]
    ('code', 1.0)
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ValueError(f"spec: expected a blend (a path, a .json file or 'WEIGHT:PATH,...'), got {spec!r}")
    spec = str(spec).strip()
    plain = os.path.exists(spec) or not {",", ":"} & set(spec)
    if plain and spec.lower().endswith(".json"):
        origin, entries = repr(spec), _json_entries(Path(spec))
    elif plain:
        origin, entries = repr(spec), [{"path": spec, "weight": 1.0}]
    else:
        origin, entries = repr(spec), _short_entries(spec)
    entries = [_checked_entry(e, origin) for e in entries]
    names = [e["name"] for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"data: blend {origin}: duplicate source names {duplicates} "
                         '(give each source its own "name" in a JSON blend)')
    return entries


class Blend:
    """Weighted sources of documents, the data of a run; BlendSampler draws each
    micro-batch from one source so that each source's share of the micro-batches tracks
    its weight.

    Args:
        datasets: one TokenDataset per source (a split's validation part may be empty).
        names: unique source names (checkpoints and per-source metrics use them).
        weights: one number > 0 per source; stored normalised to sum 1 (a weight so much
            smaller than the others that its share is 0.0 is a ValueError).
        paths: where each source was read from (named in errors), or None.

    The blend's vocab_size is the largest of its sources'. Token sources may differ there
    (ids of one tokenizer below a padded vocab_size), but byte-token sources (text read as
    bytes: eos set, BYTE_VOCAB_SIZE) and token-id sources (eos None) are refused together,
    whatever their vocab_size: the same id would mean a byte in one and a word piece in the
    other.
    """

    def __init__(self, datasets: Sequence[TokenDataset], names: Sequence[str], weights: Sequence[float],
                 paths: Optional[Sequence[Optional[str]]] = None):
        self.datasets, self.names, weights = list(datasets), list(names), list(weights)  # a generator of weights: len() failed
        self.paths = list(paths) if paths is not None else [None] * len(self.datasets)
        if not all(isinstance(d, TokenDataset) for d in self.datasets):
            raise ValueError(f"datasets: expected TokenDatasets, got {[type(d).__name__ for d in self.datasets]}")
        if not all(isinstance(n, str) for n in self.names):  # checkpoints and metrics key the sources by name
            raise ValueError(f"names: expected str source names, got {self.names}")
        if not self.datasets or not len(self.datasets) == len(self.names) == len(weights) == len(self.paths):
            raise ValueError(f"datasets, names, weights, paths: expected one entry per source, got {len(self.datasets)}, "
                             f"{len(self.names)}, {len(weights)}, {len(self.paths)}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names: expected unique source names, got {self.names}")
        if not all(not isinstance(w, (bool, np.bool_)) and isinstance(w, numbers.Real) and math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"weights: expected finite numbers > 0, got {list(weights)}")
        try:
            total = math.fsum(weights)
        except OverflowError:
            total = math.inf
        if not math.isfinite(total):
            raise ValueError(f"weights: their sum overflows a float, got {list(weights)}; give them on a smaller scale")
        self.weights = [float(w) / total for w in weights]
        if 0.0 in self.weights:  # below the float range next to the others: the source would never be drawn
            raise ValueError(f"weights: {list(weights)} give {self.names[self.weights.index(0.0)]!r} a share of 0 once normalised "
                             "(it would never be drawn); give the weights on a closer scale")
        self._check_vocabularies()
        self.vocab_size = max(d.vocab_size for d in self.datasets)

    def _check_vocabularies(self) -> None:
        byte = [i for i, d in enumerate(self.datasets) if d.eos is not None]
        if byte:
            b = byte[0]
            # a token source is refused even at the byte vocab_size: its ids are a tokenizer's
            other = [i for i, d in enumerate(self.datasets) if d.eos is None or d.vocab_size != self.datasets[b].vocab_size]
            if other:
                o = other[0]
                raise ValueError(f"{self.where(b)} holds byte tokens (vocab_size {self.datasets[b].vocab_size}) and "
                                 f"{self.where(o)} token ids of vocab_size {self.datasets[o].vocab_size}: the same id "
                                 "would mean different things; tokenize both with one tokenizer (python -m fmoe.train.prepare)")

    def where(self, i: int) -> str:
        """Source i as errors name it: data: source 'code' (data/code.u32)."""
        return _where(self.names[i], self.paths[i])

    def __len__(self) -> int:
        """Documents in all sources."""
        return sum(len(d) for d in self.datasets)

    @property
    def n_tokens(self) -> int:
        """Tokens in all sources' documents (EOS included)."""
        return sum(d.n_tokens for d in self.datasets)

    @property
    def byte_tokens(self) -> bool:
        """Whether the sources hold byte tokens (a token is a byte; never mixed with others)."""
        return self.datasets[0].eos is not None

    def split(self, val_percent: int) -> tuple["Blend", "Blend"]:
        """(train, validation) blends of the same names and weights: each source split by
        TokenDataset.split(val_percent). A source left with no training documents is refused."""
        val_percent = _int_arg("val_percent", val_percent, 0, 100)
        parts = [d.split(val_percent) for d in self.datasets]
        for i, (train, _) in enumerate(parts):
            if not len(train):
                raise ValueError(f"{self.where(i)}: no training documents after the split "
                                 f"(val_percent={val_percent} puts all {len(self.datasets[i])} of its documents in validation)")
        return (Blend([t for t, _ in parts], self.names, self.weights, self.paths),
                Blend([v for _, v in parts], self.names, self.weights, self.paths))

    def validation_sources(self, n_batches: int) -> list[str]:
        """The source name of each of validation_batches(..., n_batches)'s batches."""
        return [self.names[i] for i in _blend_schedule(self.weights, n_batches)]

    def validation_batches(self, tokens: int, n_batches: int, *, mtp_depth: int = 0, whole_documents: bool = False) -> list[TensorDict]:
        """n_batches micro-batches of `tokens` tokens, the source of each picked by the
        greedy rule (BlendSampler) and its batches the source's first ones in stored order
        (TokenDataset.validation_batches, whole_documents as for Sampler); the same list on
        every call. One source: exactly its validation_batches."""
        tokens = _int_arg("tokens", tokens)
        n_batches = _int_arg("n_batches", n_batches)
        if n_batches > self.n_tokens:  # before the schedule of n_batches draws (1e12 of them took hours); the sources say more below
            raise ValueError(f"n_batches: {n_batches} batches of {tokens} tokens need {tokens * n_batches} tokens, the blend has {self.n_tokens}")
        order = _blend_schedule(self.weights, n_batches)
        per_source = []
        for i, dataset in enumerate(self.datasets):
            k = order.count(i)
            if k and not len(dataset):
                raise ValueError(f"{self.where(i)}: no validation documents for its {k} of the {n_batches} "
                                 "validation batches (raise val_percent, or give the source more documents)")
            with _naming(self.where(i)):
                per_source.append(iter(dataset.validation_batches(tokens, k, mtp_depth=mtp_depth, whole_documents=whole_documents) if k else []))
        return [next(per_source[i]) for i in order]


def load_blend(spec: Union[str, os.PathLike, None] = None, *, separator: Optional[int] = None,
               vocab_size: Optional[int] = None, dtype: Optional[str] = None) -> Blend:
    """The Blend of parse_blend(spec), each source read by load_corpus: a directory as byte
    tokens, a .npy file, or a token file (its index gives separator, vocab_size and dtype).
    separator, vocab_size and dtype apply to every token-file source whose entry does not set
    them; an entry of a directory (bytes) that sets them is refused (load_corpus).
    None or "": the embedded stdlib corpus as the one source "stdlib". Every error names the
    source: data: source 'code' (data/code.u32): ..."""
    if spec is None or not str(spec).strip():
        return Blend([load_stdlib()], ["stdlib"], [1.0])
    entries = parse_blend(spec)
    limit = _room_for_open_files(2 * len(entries))  # a memory-mapped source holds its file open (and its loss mask's)
    datasets = []
    for e in entries:
        with _naming(_where(e["name"], e["path"])):
            defaults = (None, None, None) if Path(e["path"]).is_dir() else (separator, vocab_size, dtype)  # bytes: none applies
            try:
                datasets.append(load_corpus(
                    e["path"], separator=e["separator"] if e["separator"] is not None else defaults[0],
                    vocab_size=e["vocab_size"] if e["vocab_size"] is not None else defaults[1],
                    dtype=e["dtype"] if e["dtype"] is not None else defaults[2]))
            except OSError as err:
                if err.errno != errno.EMFILE:
                    raise
                raise ValueError(f"too many open files: each memory-mapped source holds its file open (and its loss mask's), and the "
                                 f"blend's {len(entries)} sources need more than this process may open ({limit or '?'}, `ulimit -n`): raise "
                                 "the limit, or prepare the sources into fewer token files") from err
    return Blend(datasets, [e["name"] for e in entries], [e["weight"] for e in entries], [e["path"] for e in entries])


def _room_for_open_files(n: int) -> Optional[int]:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) toward its hard one where
    n more than are open now, and a margin, would not fit (a blend of a thousand token files
    ran out at the common 1024); returns the soft limit then (None where it cannot be read)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = 64
        want = open_now + n + 256  # the margin: sockets of the process group, libraries, checkpoint files
        if soft != resource.RLIM_INFINITY and soft < want:
            soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return soft
    except (ImportError, OSError, ValueError):
        return None


def _next_source(weights: Sequence[float], drawn: Sequence[int]) -> int:
    """Megatron's greedy blending: the source furthest below its share after one more draw,
    argmax_i weights[i] * (n + 1) - drawn[i] with n = sum(drawn), ties to the lowest index.
    Every prefix of n draws then holds about weights[i] * n batches of source i: within
    1/2 for two sources, within 1 for three, a little more with many small weights."""
    n = sum(drawn)
    scores = [w * (n + 1) - c for w, c in zip(weights, drawn)]
    return scores.index(max(scores))


def _blend_schedule(weights: Sequence[float], n: int) -> list[int]:
    """The sources of the first n greedy draws."""
    drawn, order = [0] * len(weights), []
    for _ in range(n):
        i = _next_source(weights, drawn)
        drawn[i] += 1
        order.append(i)
    return order


def _source_seed(seed: int, name: str) -> int:
    """A 63-bit sampler seed for a blend's source (not its first) from (seed, name)."""
    digest = hashlib.sha256(f"{seed}:source:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class BlendSampler:
    """Deterministic, resumable stream of packed micro-batches over a Blend.

    Each micro-batch comes whole from one source, the one the greedy rule picks
    (_next_source: the realised shares track the weights within about one micro-batch at
    every prefix, the same on every run). Each source has its own Sampler: the first source's uses `seed`,
    the others a seed drawn from (seed, source name). A one-source blend therefore gives
    exactly Sampler(dataset, tokens_per_batch, seed=seed)'s batches.

    Args:
        blend: the (training) Blend; every source must have documents.
        tokens_per_batch, seed, mtp_depth, shuffle, whole_documents: as for Sampler.

    After next_batch, `last_source` is the name of the batch's source; `batches` and
    `tokens` count the micro-batches and tokens drawn from each source (tokens_by_source()).
    """

    def __init__(self, blend: Blend, tokens_per_batch: int, *, seed: int, mtp_depth: int = 0, shuffle: bool = True,
                 whole_documents: bool = False):
        if not isinstance(blend, Blend):
            raise ValueError(f"blend: expected a Blend, got {type(blend).__name__}")
        self.blend = blend
        self.tokens_per_batch = _int_arg("tokens_per_batch", tokens_per_batch)
        self.seed = _int_arg("seed", seed, 0)
        self.mtp_depth = _int_arg("mtp_depth", mtp_depth, 0)
        check_bools(shuffle=shuffle, whole_documents=whole_documents)
        self.shuffle, self.whole_documents = shuffle, whole_documents
        self.samplers = self._fresh_samplers()
        self.batches = [0] * len(blend.names)
        self.tokens = [0] * len(blend.names)
        self.last_source: Optional[str] = None

    def _fresh_samplers(self) -> list[Sampler]:
        samplers = []
        for i, (name, dataset) in enumerate(zip(self.blend.names, self.blend.datasets)):
            with _naming(self.blend.where(i)):
                samplers.append(Sampler(dataset, self.tokens_per_batch, seed=self.seed if i == 0 else _source_seed(self.seed, name),
                                        mtp_depth=self.mtp_depth, shuffle=self.shuffle, whole_documents=self.whole_documents))
        return samplers

    def _draw(self, take: Callable[[Sampler], TensorDict]) -> TensorDict:
        i = _next_source(self.blend.weights, self.batches)
        drawn = take(self.samplers[i])
        self.batches[i] += 1
        self.tokens[i] += self.tokens_per_batch
        self.last_source = self.blend.names[i]
        return drawn

    def next_batch(self) -> TensorDict:
        """The next micro-batch (make_batch's keys), from the source the greedy rule picks."""
        return self._draw(Sampler.next_batch)

    def next_layout(self) -> TensorDict:
        """Advance past the next micro-batch as next_batch does, without building it: its
        batch_layout (Sampler.next_layout)."""
        return self._draw(Sampler.next_layout)

    def __iter__(self) -> Iterator[TensorDict]:
        return self

    def __next__(self) -> TensorDict:
        return self.next_batch()

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens drawn from each source so far (across resumes), by name."""
        return dict(zip(self.blend.names, self.tokens))

    def state_dict(self) -> dict:
        """Where the stream stands: every source's Sampler state and draw counts, plus the
        seed, names and weights the state is valid for."""
        return dict(seed=self.seed, names=list(self.blend.names), weights=list(self.blend.weights),
                    batches=list(self.batches), tokens=list(self.tokens),
                    samplers=[s.state_dict() for s in self.samplers])

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict() of a BlendSampler over the same blend (names, weights,
        seed and documents; tokens_per_batch and mtp_depth may differ). A one-source blend
        also takes a plain Sampler.state_dict() (its draw counts then start at 0). Nothing
        changes when the state is refused."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state: expected a BlendSampler's (or Sampler's) state_dict() (a dict), got {type(state).__name__}")
        n = len(self.blend.names)
        samplers = self._fresh_samplers()
        if "epoch" in state:  # a Sampler's state: a run from before blends
            if n != 1:
                raise ValueError(f"state: a single Sampler's state, this blend has {n} sources {self.blend.names}")
            with _naming(self.blend.where(0)):
                samplers[0].load_state_dict(state)
            self.samplers, self.batches, self.tokens = samplers, [0], [0]
            return
        missing = [k for k in ("seed", "names", "weights", "batches", "tokens", "samplers") if k not in state]
        if missing:
            raise ValueError(f"state: missing keys {missing}")
        for key in ("names", "weights", "batches", "tokens", "samplers"):  # None: "object of type 'NoneType' has no len()"
            if not isinstance(state[key], (list, tuple)):
                raise ValueError(f"state: {key} expected a list, got {type(state[key]).__name__}")
        if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in state["weights"]):
            raise ValueError(f"state: weights expected numbers, got {list(state['weights'])}")
        if list(state["names"]) != self.blend.names:
            raise ValueError(f"state: sources {list(state['names'])}, this blend has {self.blend.names}")
        if len(state["weights"]) != n:  # a state edited by hand: zip read the first n (or none) and took it
            raise ValueError(f"state: weights has {len(state['weights'])} entries, this blend has {n} sources")
        for name, theirs, mine in zip(self.blend.names, state["weights"], self.blend.weights):
            if not math.isclose(theirs, mine, rel_tol=1e-9):
                raise ValueError(f"state: source {name!r} has weight {theirs:g}, this blend gives it {mine:g}")
        if state["seed"] != self.seed:
            raise ValueError(f"state: seed is {state['seed']!r}, this sampler has {self.seed!r}")
        for key in ("batches", "tokens", "samplers"):
            if len(state[key]) != n:
                raise ValueError(f"state: {key} has {len(state[key])} entries, this blend has {n} sources")
        batches = [_int_arg(f"state['batches'][{i}]", b, 0) for i, b in enumerate(state["batches"])]
        tokens = [_int_arg(f"state['tokens'][{i}]", t, 0) for i, t in enumerate(state["tokens"])]
        for i, sampler in enumerate(samplers):
            with _naming(self.blend.where(i)):
                sampler.load_state_dict(state["samplers"][i])
        self.samplers, self.batches, self.tokens = samplers, batches, tokens
