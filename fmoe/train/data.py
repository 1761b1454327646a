"""Training data: corpora of documents, packing into fixed-size micro-batches, a resumable sampler.

Corpora (all give a `TokenDataset`: documents of token ids over one shared storage array):

    load_stdlib(include_tests=False)            the embedded default: the running interpreter's
                                                standard library *.py files, byte tokens
    load_text_dir(path)                         a directory of text files, byte tokens
    load_token_file(path, separator=, vocab_size=, dtype=None)
                                                a flat uint16 / uint32 file of token ids
                                                (nanoGPT-style), memory-mapped
    load_corpus(path=None, ...)                 one of the three, by what `path` is

Byte tokens: a file's bytes 0..255 are its token ids, then EOS = 256 ends every document;
PAD = 257 is reserved for consumers (never emitted here): BYTE_VOCAB_SIZE = 258.
`encode_text` / `decode_text` convert between text and byte tokens. Byte corpora are read
into one uint8 array plus per-document offsets (the default stdlib corpus: ~730 files,
~12 MB, about a second to read; with its test directories ~1800 files, ~31 MB); the EOS
after each document is virtual (added when a document is sliced), so it costs no memory.
Token files stay memory-mapped; their documents end at (and include) each `separator` token,
and trailing tokens after the last separator form a final document.

Splits: `dataset.split(val_percent)` puts a document in validation when a stable hash of
its key is below val_percent out of 100: crc32 of its path relative to the corpus root for
file corpora (paths sorted, so neither the directory listing order nor the other files
matter), a fixed integer hash of its index for token files.

Batches (`make_batch`): a micro-batch packs exactly T tokens. Documents are concatenated
and cut into micro-batches of T tokens; a document that does not fit the rest of a batch
continues at the start of the next one, and each piece of a document is its own sequence,
so sequences never cross document boundaries (the model attends inside cu_seqlens only).
A batch is a TensorDict with batch_size [] and keys

    input_ids     [T] int64        the tokens
    labels        [T] int64        the next token in the same sequence; -100 at its last token
    loss_mask     [T] bool         False where labels is -100 (each sequence's last token)
    positions     [T] int64        position inside the sequence (restarts at 0)
    cu_seqlens    [n + 1] int32    0 = cu[0] < cu[1] < ... < cu[n] = T, the n sequences

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
a step draws, not their size. Validation: `dataset.validation_batches(T, n)`, the first n
micro-batches of the documents in stored order (no shuffle), the same list on every call.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
from tensordict import TensorDict

from fmoe.ops.checks import check_positive_int
from fmoe.ops.packed import mtp_targets

EOS = 256
PAD = 257
BYTE_VOCAB_SIZE = 258
IGNORE_INDEX = -100

# token-file dtypes: the names `dtype` accepts and the suffixes that imply one
_FILE_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SUFFIX_DTYPES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}
# tokens scanned per chunk when splitting a token file at its separators
_SCAN_CHUNK = 1 << 24
# directory names left out of the stdlib corpus unless include_tests
_TEST_DIRS = {"test", "tests", "idle_test"}


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
    ids = torch.as_tensor(ids).reshape(-1).long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= BYTE_VOCAB_SIZE):
        raise ValueError(f"ids: expected byte tokens in 0..{BYTE_VOCAB_SIZE - 1}, got values in {int(ids.min())}..{int(ids.max())}")
    return bytes(ids[ids < 256].to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# 2. Datasets
# ----------------------------------------------------------------------------------------


class TokenDataset:
    """Documents of token ids over one shared 1-D storage array.

    Document i is data[starts[i] : starts[i] + lengths[i]], followed by `eos` when eos is
    not None (byte corpora); its length in tokens, EOS included, is `doc_len(i)`.

    Args:
        data: [N] numpy integer array (uint8 in memory, or a uint16 / uint32 np.memmap).
        starts, lengths: [n_docs] int64 numpy arrays, every span inside data.
        names: n_docs strings (the split keys, e.g. relative paths), or None for unnamed
            documents (split by a hash of their index).
        vocab_size: every token id, eos included, is below it.
        eos: the token appended after each document, or None.
    """

    def __init__(self, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 names: Optional[Sequence[str]], *, vocab_size: int, eos: Optional[int]):
        self.data = data
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.starts.shape != self.lengths.shape or self.starts.ndim != 1:
            raise ValueError(f"starts, lengths: expected two 1-D arrays of one shape, got {self.starts.shape} and {self.lengths.shape}")
        self.names = None if names is None else list(names)
        if self.names is not None and len(self.names) != len(self.starts):
            raise ValueError(f"names: expected {len(self.starts)} names, got {len(self.names)}")
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.eos = eos
        self.doc_lens = self.lengths + (eos is not None)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        """Tokens in all documents, EOS included."""
        return int(self.doc_lens.sum())

    def doc_len(self, i: int) -> int:
        return int(self.doc_lens[i])

    def document(self, i: int, begin: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Tokens begin..end-1 of document i (EOS included): [end - begin] int64."""
        length = int(self.lengths[i])
        end = self.doc_len(i) if end is None else end
        start = int(self.starts[i])
        body = torch.from_numpy(np.asarray(self.data[start + begin: start + min(end, length)], dtype=np.int64))
        if end > length:  # the slice reaches the virtual EOS
            body = torch.cat([body, torch.tensor([self.eos], dtype=torch.long)])
        return body

    def subset(self, indices: np.ndarray) -> "TokenDataset":
        """The documents `indices` (in that order), sharing this dataset's storage."""
        names = None if self.names is None else [self.names[i] for i in indices]
        return TokenDataset(self.data, self.starts[indices], self.lengths[indices], names,
                            vocab_size=self.vocab_size, eos=self.eos)

    def split(self, val_percent: int) -> tuple["TokenDataset", "TokenDataset"]:
        """(train, validation): a document goes to validation when its key's bucket in
        0..99 (crc32 of its name, or a fixed hash of its index when unnamed) is below
        val_percent. Deterministic, disjoint, and together all documents, in stored order."""
        check_positive_int("val_percent", val_percent, 0, 100)
        if self.names is not None:
            buckets = np.array([zlib.crc32(n.encode("utf-8")) % 100 for n in self.names], dtype=np.int64)
        else:  # Fibonacci hashing of the index, top 32 bits (uint64 products wrap)
            prod = np.arange(len(self), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            buckets = ((prod >> np.uint64(32)) % np.uint64(100)).astype(np.int64)
        val = buckets < val_percent
        return self.subset(np.flatnonzero(~val)), self.subset(np.flatnonzero(val))

    def validation_batches(self, tokens: int, n_batches: int, *, mtp_depth: int = 0) -> list[TensorDict]:
        """The first n_batches micro-batches of `tokens` tokens packed from the documents in
        stored order (see make_batch for the keys); the same list on every call."""
        check_positive_int("tokens", tokens)
        check_positive_int("n_batches", n_batches)
        if tokens * n_batches > self.n_tokens:
            raise ValueError(f"n_batches: {n_batches} batches of {tokens} tokens need {tokens * n_batches} tokens, "
                             f"the dataset has {self.n_tokens}")
        sampler = Sampler(self, tokens, seed=0, mtp_depth=mtp_depth, shuffle=False)
        return [sampler.next_batch() for _ in range(n_batches)]


def _byte_dataset(root: Path, rel_paths: list[str]) -> TokenDataset:
    """One document per non-empty file root/rel (paths sorted), read as bytes."""
    blobs, names = [], []
    for rel in sorted(rel_paths):
        blob = (root / rel).read_bytes()
        if blob:
            blobs.append(blob)
            names.append(rel)
    if not blobs:
        raise ValueError(f"path: no non-empty files under {str(root)!r}")
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    return TokenDataset(data, starts, lengths, names, vocab_size=BYTE_VOCAB_SIZE, eos=EOS)


def load_stdlib(*, include_tests: bool = False) -> TokenDataset:
    """The default corpus: every *.py file of the running interpreter's standard library
    (sysconfig stdlib path, recursively), one document per non-empty file, byte tokens.
    site-packages is always left out (third-party code); the test directories (test, tests,
    idle_test) too unless include_tests. Document names are POSIX paths relative to the
    stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages"} | (set() if include_tests else _TEST_DIRS)
    rels = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if p.is_file() and not skip.intersection(rel.parts):
            rels.append(rel.as_posix())
    return _byte_dataset(root, rels)


def _existing(path: Union[str, os.PathLike]) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path: {str(path)!r} does not exist")
    return path


def load_text_dir(path: Union[str, os.PathLike]) -> TokenDataset:
    """A directory of text files: every regular file below it (recursively; files and
    directories whose name starts with '.' are skipped), one document per non-empty file,
    read as bytes -> byte tokens. Document names are POSIX paths relative to `path`."""
    root = _existing(path)
    if not root.is_dir():
        raise ValueError(f"path: {str(root)!r} is not a directory")
    rels = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            rels.append(rel.as_posix())
    return _byte_dataset(root, rels)


def load_token_file(path: Union[str, os.PathLike], *, separator: int, vocab_size: int,
                    dtype: Optional[str] = None) -> TokenDataset:
    """A flat binary file of token ids (nanoGPT-style), memory-mapped.

    Args:
        path: the file; its size must be a positive multiple of the dtype's size.
        separator: the token id that ends a document; it stays in the document as its last
            token. Tokens after the last separator form a final document.
        vocab_size: the user's vocabulary size; every token (separator included) must be
            below it (checked in one chunked pass over the file, with the separator scan).
        dtype: "uint16" or "uint32"; None infers it from the suffix (.u16 / .uint16 /
            .u32 / .uint32).
    """
    path = _existing(path)
    if not path.is_file():
        raise ValueError(f"path: {str(path)!r} is not a regular file")
    if dtype is None:
        if path.suffix.lower() not in _SUFFIX_DTYPES:
            raise ValueError(f"dtype: cannot infer it from the suffix of {str(path)!r}; pass dtype='uint16' or 'uint32' "
                             f"(or name the file {', '.join(_SUFFIX_DTYPES)})")
        dtype = _SUFFIX_DTYPES[path.suffix.lower()]
    if dtype not in _FILE_DTYPES:
        raise ValueError(f"dtype: expected one of {list(_FILE_DTYPES)}, got {dtype!r}")
    np_dtype = np.dtype(_FILE_DTYPES[dtype])
    check_positive_int("vocab_size", vocab_size)
    check_positive_int("separator", separator, 0, vocab_size - 1)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"path: {str(path)!r} is empty")
    if size % np_dtype.itemsize:
        raise ValueError(f"path: the size of {str(path)!r} ({size} bytes) is not a multiple of {np_dtype.itemsize} ({dtype})")
    data = np.memmap(path, dtype=np_dtype, mode="r")
    ends = []
    for lo in range(0, len(data), _SCAN_CHUNK):
        chunk = np.asarray(data[lo: lo + _SCAN_CHUNK])
        top = int(chunk.max())
        if top >= vocab_size:
            bad = lo + int(np.argmax(chunk >= vocab_size))
            raise ValueError(f"vocab_size: token {top} at index {bad} of {str(path)!r} is not below vocab_size {vocab_size}")
        ends.append(lo + np.flatnonzero(chunk == separator) + 1)
    ends = np.concatenate(ends).astype(np.int64)
    if not len(ends) or ends[-1] != len(data):
        ends = np.append(ends, len(data))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return TokenDataset(data, starts, ends - starts, None, vocab_size=vocab_size, eos=None)


def load_corpus(path: Union[str, os.PathLike, None] = None, *, separator: Optional[int] = None,
                vocab_size: Optional[int] = None, dtype: Optional[str] = None) -> TokenDataset:
    """load_stdlib() when path is None, load_text_dir(path) for a directory, otherwise
    load_token_file(path, separator=, vocab_size=, dtype=) (both then required)."""
    if path is None:
        return load_stdlib()
    if _existing(path).is_dir():
        return load_text_dir(path)
    if separator is None or vocab_size is None:
        raise ValueError(f"separator, vocab_size: required for the token file {str(path)!r}")
    return load_token_file(path, separator=separator, vocab_size=vocab_size, dtype=dtype)


# ----------------------------------------------------------------------------------------
# 3. Batches and the sampler
# ----------------------------------------------------------------------------------------


def make_batch(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, mtp_depth: int = 0) -> TensorDict:
    """The batch TensorDict (batch_size []) of packed tokens input_ids [T] int64 and
    sequence bounds cu_seqlens [n + 1]: keys input_ids, labels, loss_mask, positions,
    cu_seqlens (int32), and mtp_input_ids, mtp_positions, mtp_labels, mtp_loss_mask [D, T]
    when mtp_depth D > 0 (module docstring). Labels are -100 where loss_mask is False."""
    check_positive_int("mtp_depth", mtp_depth, 0)
    cu_seqlens = cu_seqlens.to(torch.int32)
    entries = mtp_targets(input_ids.long(), cu_seqlens, mtp_depth, ignore_index=IGNORE_INDEX)
    main = entries[0]
    batch = TensorDict(
        input_ids=main["input_ids"], labels=main["labels"], loss_mask=main["loss_mask"],
        positions=main["positions"], cu_seqlens=cu_seqlens, batch_size=[],
    )
    if mtp_depth:
        for key in ("input_ids", "positions", "labels", "loss_mask"):
            batch[f"mtp_{key}"] = torch.stack([e[key] for e in entries[1:]])
    return batch


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
        dataset: a non-empty TokenDataset.
        tokens_per_batch: T, the tokens of every micro-batch, fixed for the sampler's life.
        seed: the shuffle seed (an int).
        mtp_depth: D, MTP targets in every batch when > 0 (see make_batch).
        shuffle: False visits the documents in stored order every epoch.
    """

    def __init__(self, dataset: TokenDataset, tokens_per_batch: int, *, seed: int, mtp_depth: int = 0,
                 shuffle: bool = True):
        if not isinstance(dataset, TokenDataset):
            raise ValueError(f"dataset: expected a TokenDataset, got {type(dataset).__name__}")
        if not len(dataset):
            raise ValueError("dataset: has no documents")
        self.dataset = dataset
        self.tokens_per_batch = check_positive_int("tokens_per_batch", tokens_per_batch)
        self.seed = check_positive_int("seed", seed, 0)
        self.mtp_depth = check_positive_int("mtp_depth", mtp_depth, 0)
        self.shuffle = shuffle
        self.epoch, self.index, self.offset = 0, 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """[n_docs] int64, the documents in epoch `epoch`'s visiting order."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(len(self.dataset), generator=gen)

    def next_batch(self) -> TensorDict:
        """The next micro-batch of tokens_per_batch tokens (make_batch's keys)."""
        pieces, seqlens = [], [0]
        remaining = self.tokens_per_batch
        while remaining:
            doc = int(self._order[self.index])
            take = min(self.dataset.doc_len(doc) - self.offset, remaining)
            pieces.append(self.dataset.document(doc, self.offset, self.offset + take))
            seqlens.append(take)
            remaining -= take
            self.offset += take
            if self.offset == self.dataset.doc_len(doc):
                self.index, self.offset = self.index + 1, 0
                if self.index == len(self.dataset):
                    self.epoch, self.index = self.epoch + 1, 0
                    self._order = self._epoch_order(self.epoch)
        cu_seqlens = torch.tensor(seqlens, dtype=torch.int64).cumsum(0)
        return make_batch(torch.cat(pieces), cu_seqlens, self.mtp_depth)

    def __iter__(self) -> Iterator[TensorDict]:
        return self

    def __next__(self) -> TensorDict:
        return self.next_batch()

    def state_dict(self) -> dict:
        """Where the stream stands: epoch, index in the epoch's order, offset (tokens) into
        that document, plus the seed, shuffle flag and document count it is valid for."""
        return dict(epoch=self.epoch, index=self.index, offset=self.offset, seed=self.seed,
                    shuffle=self.shuffle, n_documents=len(self.dataset))

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the sampler must have the same seed, shuffle flag and
        dataset size (tokens_per_batch and mtp_depth may differ)."""
        keys = ("epoch", "index", "offset", "seed", "shuffle", "n_documents")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"state: missing keys {missing}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("n_documents", len(self.dataset))):
            if state[key] != mine:
                raise ValueError(f"state: {key} is {state[key]!r}, this sampler has {mine!r}")
        epoch = check_positive_int("state['epoch']", state["epoch"], 0)
        index = check_positive_int("state['index']", state["index"], 0, len(self.dataset) - 1)
        order = self._epoch_order(epoch)
        offset = check_positive_int("state['offset']", state["offset"], 0, self.dataset.doc_len(int(order[index])) - 1)
        self.epoch, self.index, self.offset, self._order = epoch, index, offset, order
