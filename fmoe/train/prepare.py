"""Text files -> a token file: `python -m fmoe.train.prepare SRC OUT --tokenizer=tokenizer.json`.

    python -m fmoe.train.prepare data/code/ data/code.u16 --tokenizer=tokenizer.json
    python -m fmoe.train.prepare book.txt data/book.bin --tokenizer=tok.json --separator='</s>' --dtype=uint32
    python -m fmoe.train.prepare fineweb/ data/web.u32 --tokenizer=tok.json    # *.parquet shards, "text" column
    python -m fmoe.train.prepare dump.jsonl.gz data/dump.u16 --tokenizer=tok.json --text_key=content

SRC is a directory (every file below it, as fmoe.train.data.list_text_files selects them:
recursive, into linked directories too, each once, dot-files and dot-directories skipped,
sorted relative paths) or one file. By
its name (case-insensitive) a file is:

    *.jsonl, *.ndjson (+ .gz)   JSON Lines: each line an object, its --text_key string one
                                document (blank lines skipped)
    *.json                      records too: a JSON array of objects (alpaca_data.json), or
                                JSON Lines by another name; a file of one JSON object
                                (dataset_info.json: no records) is left out of a directory,
                                and refused given alone
    *.parquet                   a Parquet table: each row's --text_key string one document
                                (read 1024 rows at a time with pyarrow: pip install 'fmoe[data]')
    *.gz                        gzip-compressed text: one document
    anything else               UTF-8 text: one document
    (refused: *.zst / *.zstd, decompress them first; tar archives, *.tar / *.tar.gz / *.tgz,
    extract them first; a text or .gz file holding a NUL byte, which text never does)
    A UTF-8 byte-order mark at the start of a text file or of a JSON Lines file is dropped.

A directory that holds files of records (JSON Lines, Parquet, .json records) is read for
its records alone: its text files (a dataset's README.md, LICENSE) are left out, named in
a warning, as are .json files of one object (its metadata).

Each non-empty document's text is encoded by a Hugging Face `tokenizers`
Tokenizer (the `data` extra: pip install 'fmoe[data]') without the tokenizer's
post-processing (no BOS / CLS added), then the separator id. The separator is
--separator (a token string, or an id when all digits 0-9), else the first of
SEPARATOR_TOKENS the tokenizer knows. A document whose text already encodes to the
separator id is refused, naming the file (and line or row): it would read back as two
documents. So is a record without a string --text_key (null, a number, a missing key), and
a text holding a lone surrogate (a JSON "\\ud800" escape without its pair: not Unicode).

Prompts and responses (instruction tuning): --prompt_key names a second field (or
column) of each record, its prompt. The document is then the prompt's ids, then the
text's (each encoded alone: the ids at their boundary are those of two texts), then the
separator; OUT.loss_mask gets one uint8 per token, 0 on the prompt's ids, so training and
evaluation on OUT count the loss of the texts (and separators) only (fmoe.train.data's
TokenDataset.label_mask). Every source must be JSON Lines or Parquet; a record with an
empty text is skipped.

    python -m fmoe.train.prepare sft.jsonl data/sft.u32 --tokenizer=tok.json --prompt_key=prompt --text_key=response

Conversations (chat data): --messages_key names each record's list of messages
({"role": "user" | "assistant" | "system" | ..., "content": ...}; any other fields reach
the template too), rendered by the model's chat template exactly as transformers'
apply_chat_template renders it (fmoe.train.chat: --chat_template=FILE, else the folder's
chat_template.jinja, else its tokenizer_config.json's; --chat_template_kwargs='{"enable_thinking":
false}' gives it more variables) and encoded whole, without the tokenizer's
post-processing. OUT.loss_mask is 1 on the assistant's turns only (a token counts when it
holds a character of one, as in transformers' assistant masks: the turn's text and end-of-turn
tokens, and a first word merged with the space that ends the header, not the role header)
and on a separator that follows one. A conversation whose template renders earlier turns
differently once later ones follow becomes one document per assistant turn
(fmoe.train.chat); one without an assistant message is skipped (an assistant message
that opens a conversation is trained where the template can render its prompt:
fmoe.train.chat). A record's "tools" field
or column (function definitions; a JSON string of them is parsed), when it has one, is the
template's `tools`, as apply_chat_template(messages, tools=...).

    python -m fmoe.train.prepare chats.jsonl data/chat.u32 --tokenizer=qwen3/tokenizer.json --messages_key=messages

OUT gets the ids (uint16 when the vocabulary fits, <= 65536 ids, else uint32; a .u16 /
.u32 suffix or --dtype decides otherwise) and OUT.index.json:

    {"documents": n, "tokens": n_tokens, "dtype": "uint16", "separator": id,
     "vocab_size": tokenizer.get_vocab_size(), "tokenizer": "/abs/tokenizer.json", "sources": n_files,
     "text_key": "text" (when some file is JSON Lines or Parquet, without conversations),
     "prompt_key": "prompt" (with prompts), "messages_key": "messages", "chat_template": "/abs/template",
     "conversations": n, "split_conversations": n, "chat_template_kwargs": {...} (when given),
     "prompt_tokens": n (the tokens out of the loss), "loss_mask": "OUT.loss_mask" (with either)}

from which fmoe.train.data.load_token_file / load_corpus / load_blend take separator,
vocab_size and dtype. Documents are read and encoded in batches of about 4M characters
(encode_batch runs on the tokenizer's threads; a large JSON Lines or Parquet file is
streamed, never read whole) and streamed to disk; progress goes to stderr about once a
second. A text document longer than 512K characters (a book, a dump nobody split) is
encoded a window at a time, cut at the pre-tokenizer's piece boundaries, to the same ids,
and a text file larger than 16 MB is read 4 MB at a time as it is encoded: one encode of a
whole document held about 450 bytes per token (a 45 MB file took 7.6 GB; now 0.68 GB, the
process's 0.4 GB included), at the cost of one more pass of the pre-tokenizer (a tokenizer
with a normalizer, or one that adds a prefix space to each input, reads and encodes each
document whole, as before). Output is atomic: both files are written under hidden
temporary names in OUT's directory and renamed into place at the end, the index last (an
older index and loss mask are removed first), so a failed or interrupted run leaves no
final name. Its temporary files (.OUT.HOST.PID.tmp) are removed on an error, Ctrl-C and, from
the command line, SIGTERM (a scheduler's stop, `timeout`); those of a run killed outright
(SIGKILL, a crash) are removed by the next run of this machine for the same OUT, once their
process is gone.
"""

from __future__ import annotations

import argparse
import bisect
import codecs
import contextlib
import glob
import gzip
import json
import os
import re
import signal
import socket
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import numpy as np

from fmoe.ops.checks import MissingExtra, check_path, check_positive_int
from fmoe.train.chat import TOOLS_FIELD, TRAINED_ROLE, json_object, load_chat_template
from fmoe.train.data import FILE_DTYPES, MASK_SUFFIX, SUFFIX_DTYPES, index_path, list_text_files

# end-of-document tokens of common tokenizers (GPT-2 / Qwen, Llama 2 / T5, ..., Llama 3, BERT)
SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
# characters of text per encode_batch call: large enough for the tokenizer's threads, small
# enough that one batch's ids stay a few tens of MB
_BATCH_CHARS = 1 << 22
# a longer document (a book, a file nobody split) is encoded a window at a time where the
# tokenizer allows it (_windowed): one encode of a whole document held ~450 bytes per token
# (a 45 MB text file: 7.6 GB), and the windows' ids are the whole document's, id for id
_WINDOW_CHARS = 1 << 19
_WINDOW_MARGIN = 1 << 12  # characters before a window's end that its cut leaves out: the regexes' lookahead
_STREAM_BYTES = 1 << 24  # a larger text file is read _READ_BYTES at a time as it is encoded (_text_file_ids), never whole
_READ_BYTES = 1 << 22
# pre-tokenizers that cut a text into pieces by looking at the text alone (no prefix added to
# each input): a piece boundary far from a window's end is the whole document's
_LOCAL_PRE_TOKENIZERS = ("ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "Sequence")
_PROGRESS_SECONDS = 1.0
_PARQUET_ROWS = 1024  # rows of a Parquet file read at a time
_RECORD_KINDS = ("jsonl", "json", "parquet")  # _kind's files of records
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # a lone one (a JSON escape without its pair): tokenizers refuses the str


def _load_tokenizer(path: Path):
    try:
        import tokenizers
    except ImportError as err:
        raise MissingExtra("fmoe.train.prepare needs the Hugging Face tokenizers package: "
                          "pip install 'fmoe[data]' (or tokenizers)") from err
    if path.is_dir():
        raise ValueError(f"tokenizer: {str(path)!r} is a directory; expected its tokenizer.json file")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {str(path)!r} does not exist")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"tokenizer: cannot read {str(path)!r} as a tokenizer.json ({err})") from err
    # a tokenizer.json may carry a truncation or padding setting (a classifier's max_length, a
    # batch pad): documents are encoded whole, unpadded, whatever the file says
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _separator_id(tokenizer, separator: Union[str, int, None]) -> int:
    """The separator's id: a token string looked up, an int id checked, or the first of
    SEPARATOR_TOKENS the tokenizer knows."""
    if separator is None:
        for token in SEPARATOR_TOKENS:
            if tokenizer.token_to_id(token) is not None:
                return tokenizer.token_to_id(token)
        raise ValueError(f"separator: the tokenizer knows none of {list(SEPARATOR_TOKENS)}; "
                         "name its end-of-document token with --separator=<token or id>")
    if isinstance(separator, str):
        if tokenizer.token_to_id(separator) is None:
            raise ValueError(f"separator: the tokenizer has no token {separator!r}")
        return tokenizer.token_to_id(separator)
    return check_positive_int("separator", separator, 0, tokenizer.get_vocab_size() - 1)


def _choose_dtype(out: Path, dtype: Optional[str], vocab_size: int) -> str:
    """--dtype, else the one OUT's suffix names, else the smallest that holds vocab_size ids."""
    if dtype is not None and dtype not in FILE_DTYPES:
        raise ValueError(f"dtype: expected one of {list(FILE_DTYPES)}, got {dtype!r}")
    implied = SUFFIX_DTYPES.get(out.suffix.lower())
    if dtype is not None and implied is not None and dtype != implied:
        raise ValueError(f"dtype: {dtype!r} was given, the suffix of {str(out)!r} means {implied!r}")
    dtype = dtype or implied or ("uint16" if vocab_size <= 1 << 16 else "uint32")
    if vocab_size - 1 > np.iinfo(FILE_DTYPES[dtype]).max:
        raise ValueError(f"dtype: {dtype} holds ids up to {np.iinfo(FILE_DTYPES[dtype]).max}, the tokenizer has "
                         f"{vocab_size} (use uint32, or a .u32 file name)")
    return dtype


def _source_files(src: Path, out: Path) -> list[Path]:
    if not src.exists():
        raise FileNotFoundError(f"src: {str(src)!r} does not exist")
    if not src.is_dir():
        if out.resolve() == src.resolve():
            raise ValueError(f"out: {str(out)!r} is src itself; writing it would destroy the text")
        return [src]
    if out.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"out: {str(out)!r} is inside src {str(src)!r}; a later run would read it as a document")
    files = [src / rel for rel in list_text_files(src)]
    if not files:
        raise ValueError(f"src: no files under {str(src)!r}")
    return files


_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # not gzip, truncated, corrupt


def _kind(path: Path) -> str:
    """How a source file is read, by its name: "jsonl", "parquet", "gzip" or "text"."""
    name = path.name.lower()
    if name.endswith((".zst", ".zstd")):
        raise ValueError(f"src: {str(path)!r} is zstd-compressed, which is not read here; decompress it first (zstd -d)")
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        raise ValueError(f"src: {str(path)!r} is a tar archive, which is not read here; extract it first (tar -xf) and give its directory")
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".json"):
        return "json"
    return "gzip" if name.endswith(".gz") else "text"


def _json_layout(path: Path, record_key: str) -> str:
    """How a .json file holds its records: "array" (its first non-blank character is "[": a
    JSON array of objects), "lines" (JSON Lines by another name: its first non-blank line is
    a whole JSON value, and more follow, or that one object holds record_key, the field each
    record has), or "object" (one JSON value: over several lines, or one line without
    record_key, as datasets writes a dataset_info.json: a dataset's metadata, no records).
    Reads the first non-blank line whole, however long, and little past it."""
    with open(path, "rb") as f:
        first = ""
        for line in f:  # a whole line, however long (a JSON Lines record past 1 MiB was read as a multi-line value)
            first = line.decode("utf-8", errors="replace").removeprefix("\ufeff").strip()
            if first:
                break
        if first.startswith("["):
            return "array"
        try:
            value = json.loads(first)
        except json.JSONDecodeError:  # one value over several lines (or an empty file)
            return "object"
        more = b""
        while not more.strip() and (chunk := f.read(1 << 16)):
            more = chunk
    return "lines" if more.strip() or (isinstance(value, dict) and record_key in value) else "object"


def _json_documents(path: Path, fields: tuple[tuple[str, Optional[str]], ...]) -> Iterator[tuple]:
    """The records of a .json file (_json_layout): each object of its array, or each line."""
    layout = _json_layout(path, fields[0][0])
    if layout == "lines":
        yield from _jsonl_documents(path, fields)
        return
    text = _decode(path.read_bytes(), repr(str(path))).removeprefix("\ufeff")
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"src: {str(path)!r} is not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(records, list):
        raise ValueError(f"src: {str(path)!r} holds one JSON {type(records).__name__}, not records: a .json source is a JSON array "
                         "of objects, or JSON Lines (one object per line)")
    del text
    for number, record in enumerate(records):
        where = f"{str(path)!r} record {number}"
        yield where, *(_field(record, key, where, knob) for key, knob in fields)


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"src: {where} is not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _read_bytes(path: Path, compressed: bool) -> bytes:
    if not compressed:
        return path.read_bytes()
    try:
        return gzip.decompress(path.read_bytes())
    except _GZIP_ERRORS as err:
        raise ValueError(f"src: {str(path)!r} is not a readable gzip file ({err})") from None


def _field(record, key: str, where: str, knob: Optional[str]):
    """record[key]: a string, or for --messages_key any value (fmoe.train.chat checks it);
    knob None: an optional field of any value, None when missing."""
    if not isinstance(record, dict):
        raise ValueError(f"src: {where} is not a JSON object (got {type(record).__name__})")
    value = record.get(key)
    if knob is None:
        return value
    if key not in record or (knob != "messages_key" and not isinstance(value, str)):
        got = "no such key" if key not in record else f"{type(value).__name__}"
        kind = "" if knob == "messages_key" else "string "
        raise ValueError(f"src: {where} has no {kind}{key!r} field ({got}; keys: {sorted(record)[:8]}); choose it with --{knob}")
    return value


def _jsonl_documents(path: Path, fields: tuple[tuple[str, Optional[str]], ...]) -> Iterator[tuple]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, 1):
                where = f"{str(path)!r} line {number}"
                line = _decode(line, where).removeprefix("\ufeff" if number == 1 else "").strip()  # a BOM: json's error
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"src: {where} is not JSON ({err.msg} at column {err.colno})") from None
                yield where, *(_field(record, key, where, knob) for key, knob in fields)
    except _GZIP_ERRORS as err:
        raise ValueError(f"src: {str(path)!r} is not a readable gzip file ({err})") from None


def _parquet_documents(path: Path, fields: tuple[tuple[str, Optional[str]], ...]) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MissingExtra(f"src: {str(path)!r} is a Parquet file, which needs the pyarrow package: pip install 'fmoe[data]' (or pyarrow)") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's own error types
        raise ValueError(f"src: {str(path)!r} is not a readable Parquet file ({err})") from None
    names = table.schema_arrow.names
    for key, knob in fields:
        if key not in names and knob is not None:
            raise ValueError(f"src: {str(path)!r} has no column {key!r} (columns: {names[:8]}); choose it with --{knob}")
    columns = [key for key, _ in fields if key in names]  # an optional field's column may be absent: None
    at = [columns.index(key) if key in columns else None for key, _ in fields]  # each field's column
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS, columns=columns):
        read = [batch.column(j).to_pylist() for j in range(len(columns))]
        for i in range(batch.num_rows):
            where = f"{str(path)!r} row {row}"
            values = [None if j is None else read[j][i] for j in at]
            for (key, knob), value in zip(fields, values):
                if knob not in ("messages_key", None) and not isinstance(value, str):
                    raise ValueError(f"src: {where} has no string {key!r} ({type(value).__name__})")
            yield where, *values
            row += 1


def _documents(path: Path, fields: tuple[tuple[str, Optional[str]], ...]) -> Iterator[tuple]:
    """(where, text) of each document of one source file (module docstring), `where`
    naming it in errors: the file, and its line or row; with records, (where, *values) of
    `fields`, its (field, knob naming it) pairs: (where, text, prompt) for
    (text_key, prompt_key), (where, messages, tools) for (messages_key, TOOLS_FIELD); a knob
    None marks an optional field (None where a record or table has none)."""
    kind = _kind(path)
    if kind == "jsonl":
        yield from _jsonl_documents(path, fields)
    elif kind == "json":
        yield from _json_documents(path, fields)
    elif kind == "parquet":
        yield from _parquet_documents(path, fields)
    else:
        data = _read_bytes(path, kind == "gzip")
        text = _decode(data, repr(str(path)))
        if b"\0" in data:  # valid UTF-8, but not text: a tar archive by another name, UTF-16, a binary file
            raise _nul_byte(path, data.index(0))
        del data  # the text alone is held while it is encoded
        yield repr(str(path)), text.removeprefix("\ufeff")  # a byte-order mark (Windows editors' UTF-8) is not text


def _nul_byte(path: Path, at: int) -> ValueError:
    """The error for a text file holding a NUL byte (at byte `at`): valid UTF-8, but not text
    (a tar archive by another name, UTF-16, a binary file)."""
    return ValueError(f"src: {str(path)!r} holds a NUL byte (at byte {at}), which text does not; "
                      "extract an archive first (tar -xf), convert UTF-16 text to UTF-8")


def _windowed(tokenizer) -> bool:
    """Whether `tokenizer` encodes a text as the concatenation of the encodings of its pieces
    cut at pre-token boundaries: no normalizer (one may join characters across a cut, as NFC
    does), and pre-tokenizers that add nothing to the start of each input (ByteLevel without
    add_prefix_space; Metaspace prepends its ▁). The model (BPE, WordPiece, Unigram) works on
    one pre-token at a time."""
    config = json.loads(tokenizer.to_str())

    def local(pre) -> bool:
        if not isinstance(pre, dict) or pre.get("type") not in _LOCAL_PRE_TOKENIZERS:
            return False
        if pre["type"] == "Sequence":
            return all(local(p) for p in pre.get("pretokenizers", []))
        return not (pre["type"] == "ByteLevel" and pre.get("add_prefix_space"))

    return config.get("normalizer") is None and local(config.get("pre_tokenizer"))


def _windowed_ids(tokenizer, chunks: Iterable[str]) -> Iterator[tuple[np.ndarray, int]]:
    """(ids [n] int64, where they end in characters of the text) of one document given as
    successive pieces of its text (`chunks`: the whole text, or a file read a part at a
    time), a window at a time, for a tokenizer that _windowed allows; their concatenation
    is the whole text's ids (no post-processing). A window runs from the last cut to
    _WINDOW_MARGIN characters past the next one (the regexes' lookahead sees what the whole
    text's does) and gives the ids of the tokens before that next cut. A cut is the start of
    a pre-token (the pre-tokenizer's pieces of the _WINDOW_CHARS characters from the last
    cut, itself a true boundary), the last one at least _WINDOW_MARGIN before their end and
    away from any added token's text (those are matched before the pre-tokenizer:
    "<|endoftext|>" is one token there), where the window's encoding has a token boundary
    too; where there is none (a run the pre-tokenizer keeps whole), twice the characters are
    tried. Memory: a few windows' encodings and the text not yet cut."""
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
    reach = max(map(len, added), default=0) + 64  # an added token's text, and the spaces lstrip / rstrip take
    chunks, text, size, ended, done = iter(chunks), "", _WINDOW_CHARS, False, 0
    while True:
        while not ended and len(text) <= size:
            piece = next(chunks, None)
            ended = piece is None
            text += piece or ""
        if len(text) <= size:  # the end
            if text:
                yield np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64), done + len(text)
            return
        window = text[:size]
        cut = next((a for a in reversed([a for _, (a, _) in tokenizer.pre_tokenizer.pre_tokenize_str(window)])
                    if 0 < a <= size - _WINDOW_MARGIN and not any(t in window[max(a - reach, 0):a + reach] for t in added)), None)
        if cut is not None:
            encoding = tokenizer.encode(text[:cut + _WINDOW_MARGIN], add_special_tokens=False)
            k = bisect.bisect_left([start for start, _ in encoding.offsets], cut)
            if 0 < k < len(encoding.offsets) and encoding.offsets[k - 1][1] <= cut:  # a token boundary there too
                done += cut
                yield np.asarray(encoding.ids[:k], dtype=np.int64), done
                text, size = text[cut:], _WINDOW_CHARS
                continue
        size *= 2


def _text_file_ids(tokenizer, path: Path) -> Iterator[tuple[np.ndarray, int]]:
    """_windowed_ids of a UTF-8 text file read _READ_BYTES at a time, never whole (a byte-order
    mark at its start dropped); a ValueError for bytes that are not UTF-8 or a NUL byte, as
    _documents says them."""

    def chunks() -> Iterator[str]:
        decoder, at = codecs.getincrementaldecoder("utf-8")(), 0
        with open(path, "rb") as f:
            while True:
                data = f.read(_READ_BYTES)
                held = len(decoder.getstate()[0])  # a character's first bytes, from the last read
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as err:
                    raise ValueError(f"src: {str(path)!r} is not valid UTF-8 ({err.reason} at byte {at - held + err.start})") from None
                if b"\0" in data:
                    raise _nul_byte(path, at + data.index(0))
                yield text.removeprefix("\ufeff") if at == 0 else text
                if not data:
                    return
                at += len(data)

    return _windowed_ids(tokenizer, chunks())


def _check_ids(tokenizer, ids: np.ndarray, where: str, *, separator: int, vocab_size: int, spans=None, at: int = 0) -> None:
    """ValueError for a document's ids (from its token `at` on) that hold the separator (it
    would read back as two documents) or an id beyond the vocabulary."""
    hits = np.flatnonzero(ids == separator)
    if len(hits):
        if spans is not None:  # a message's text holds it, or the template writes it (an end-of-turn token)
            raise ValueError(f"src: {where} already holds the separator id {separator} ({tokenizer.id_to_token(separator)!r}, token "
                             f"{at + int(hits[0])} of the rendered conversation): a message's text holds it or the chat template "
                             "writes it (as an end-of-turn token: then no conversation can be prepared with it); remove it from "
                             "the text, or choose a separator the template never writes with --separator=<token or id>")
        raise ValueError(f"src: {where} already holds the separator id {separator} (token {at + int(hits[0])} of the "
                         "document); remove it from the text or choose another --separator")
    if len(ids) and int(ids.max()) >= vocab_size:
        raise ValueError(f"tokenizer: it gave id {int(ids.max())} for {where}, not below its vocab_size {vocab_size}")


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on the tokens that hold a character of one of `spans` (sorted, disjoint [start, end)
    characters; a token of no characters: where it stands lies in one), 0 elsewhere:
    [n_tokens] uint8. A token that begins before a span and ends inside it counts, as in
    transformers' assistant masks: a reply's first word merged with the space that ends the
    generation prompt ("ĠYes" after "Response: ") is the reply's."""
    starts, ends = (np.asarray([o[i] for o in offsets], dtype=np.int64).reshape(-1) for i in (0, 1))
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    last = np.searchsorted(bounds[:, 0], ends, side="left") - 1  # the last span that starts before the token ends
    overlaps = (last >= 0) & (bounds[np.maximum(last, 0), 1] > starts) if len(bounds) else np.zeros(len(starts), dtype=bool)
    at = np.searchsorted(bounds.reshape(-1), starts, side="right") % 2 == 1  # an empty token: where it stands
    return np.where(ends > starts, overlaps, at).astype(np.uint8)


def _encode(tokenizer, pending: list[tuple], *, separator: int, vocab_size: int, dtype: str,
            masked: bool, windowed: bool) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The documents `pending`, each (where, text, prompt, spans), as one array of ids
    [n_tokens]: each document's ids (a prompt's, if not None, then the text's) followed by the
    separator; and when `masked`, their loss mask [n_tokens] uint8: 0 on a prompt's ids, and
    with `spans` (a conversation's trained characters, fmoe.train.chat) 0 on the tokens
    outside them, the separator taking its document's last token's value. windowed: whether
    the tokenizer encodes a long plain document a window at a time (_windowed)."""
    for where, text, prompt, _ in pending:
        for part in (text, prompt):
            if part is not None and (bad := _SURROGATE.search(part)):
                raise ValueError(f"src: {where} is not valid Unicode: it holds a lone surrogate (U+{ord(bad.group()):04X}, "
                                 "a JSON \\ud800-\\udfff escape without its pair)")
    long = {}  # a long plain document's ids, encoded a window at a time
    if windowed:
        long = {i: np.concatenate([ids for ids, _ in _windowed_ids(tokenizer, [text])])
                for i, (_, text, prompt, spans) in enumerate(pending) if len(text) > _WINDOW_CHARS and prompt is None and spans is None}
    whole = [i for i in range(len(pending)) if i not in long]
    encodings = dict(zip(whole, tokenizer.encode_batch([pending[i][1] for i in whole], add_special_tokens=False)))
    prompted = pending[0][2] is not None
    prompts = tokenizer.encode_batch([p[2] for p in pending], add_special_tokens=False) if prompted else [None] * len(pending)
    docs, masks = [], []
    for i, ((where, _, _, spans), prompt) in enumerate(zip(pending, prompts)):
        encoding = encodings.get(i)
        head = np.asarray(prompt.ids if prompt is not None else [], dtype=np.int64)
        ids = np.concatenate([head, long[i] if i in long else np.asarray(encoding.ids, dtype=np.int64)])
        _check_ids(tokenizer, ids, where, separator=separator, vocab_size=vocab_size, spans=spans)
        docs.extend((ids, [separator]))
        if masked and spans is not None:
            mask = _span_mask(encoding.offsets, spans)
            masks.extend((mask, mask[-1:] if len(mask) else np.zeros(1, dtype=np.uint8)))
        elif masked:
            masks.extend((np.zeros(len(head), dtype=np.uint8), np.ones(len(ids) - len(head) + 1, dtype=np.uint8)))
    return np.concatenate(docs).astype(FILE_DTYPES[dtype]), np.concatenate(masks) if masked else None


def prepare(src: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tokenizer: Union[str, os.PathLike],
            separator: Union[str, int, None] = None, dtype: Optional[str] = None, progress: bool = True,
            text_key: str = "text", prompt_key: Optional[str] = None, messages_key: Optional[str] = None,
            chat_template: Union[str, os.PathLike, None] = None, chat_template_kwargs: Optional[dict] = None) -> dict:
    """Tokenize the documents of `src` into the token file `out` and its index (module
    docstring); returns the index.

    Args:
        src: a directory of source files (text, gzip, JSON Lines, .json records, Parquet), or one;
            a directory of records leaves out the files beside them (warned).
        out: the token file to write (its directory is created); out + ".index.json" too.
        tokenizer: a tokenizers tokenizer.json.
        separator: the end-of-document token (str) or id (int); None: SEPARATOR_TOKENS.
        dtype: "uint16" or "uint32"; None: from out's suffix, else the smallest that fits.
        progress: report files and tokens on stderr about once a second.
        text_key: the field (JSON Lines) or column (Parquet) holding each document's text;
            another name than "text" with no JSON Lines or Parquet source is refused.
        prompt_key: the field or column of a prompt before each text (records only): the
            document is the prompt's ids, then the text's, and a loss-mask file (module
            docstring) keeps the prompt's ids out of the loss; None: no prompts.
        messages_key: the field or column of a conversation (records only; a list of
            {"role", "content", ...} messages), rendered by the chat template: a loss-mask
            file keeps all but the assistant's turns out of the loss (module docstring);
            text_key is not read. None: no conversations.
        chat_template: with messages_key, a .jinja file or a JSON file with a
            "chat_template" field; None: the one beside the tokenizer (fmoe.train.chat).
        chat_template_kwargs: with messages_key, more variables for the template, e.g.
            {"enable_thinking": False} (as apply_chat_template's **kwargs).
    """
    for name, path in (("src", src), ("out", out), ("tokenizer", tokenizer)):
        check_path(name, path)
    src, out, tokenizer_path = Path(src), Path(out), Path(tokenizer)
    if out.suffix.lower() == ".npy":  # the loaders read a .npy name as numpy's array format, which this file is not
        raise ValueError(f"out: {str(out)!r} would be read as a numpy array; name the token file .u16, .u32 or .bin")
    if out.name.lower().endswith(".index.json"):  # its own index would be OUT.index.json.index.json, the loaders reading OUT as tokens
        raise ValueError(f"out: {str(out)!r} is named as an index; name the token file (e.g. data/code.u16), its index is written beside it")
    if not isinstance(text_key, str) or not text_key:
        raise ValueError(f"text_key: expected a non-empty field name, got {text_key!r}")
    if prompt_key is not None and (not isinstance(prompt_key, str) or not prompt_key or prompt_key == text_key):
        raise ValueError(f"prompt_key: expected a non-empty field name other than text_key {text_key!r}, got {prompt_key!r}")
    if messages_key is not None and (not isinstance(messages_key, str) or not messages_key):
        raise ValueError(f"messages_key: expected a non-empty field name, got {messages_key!r}")
    if messages_key is not None and prompt_key is not None:
        raise ValueError(f"prompt_key: a conversation ({messages_key!r}, --messages_key) holds its own prompts; give one of the two")
    if (chat_template is not None or chat_template_kwargs is not None) and messages_key is None:
        raise ValueError("chat_template, chat_template_kwargs: they render conversations, which need --messages_key")
    files = _source_files(src, out)
    kinds = {path: _kind(path) for path in files}  # also refuses zstd files before any work
    metadata = [path for path in files if kinds[path] == "json" and _json_layout(path, messages_key or text_key) == "object"]
    if src.is_dir():  # records beside text files: a dataset's card, license and metadata are not its documents
        if any(kind in _RECORD_KINDS for kind in kinds.values()):
            metadata += [path for path in files if kinds[path] not in _RECORD_KINDS]
        if metadata:
            names = [path.relative_to(src).as_posix() for path in sorted(metadata)]
            warnings.warn(f"src: {len(names)} file(s) beside the records of {str(src)!r} are left out (text, or a .json of one object): "
                          f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}", stacklevel=2)
            files = [path for path in files if path not in metadata]
        if not files:
            raise ValueError(f"src: no records or text under {str(src)!r} (only .json files of one object each)")
    texts = [path for path in files if kinds[path] not in _RECORD_KINDS]
    records = len(texts) < len(files)
    for key, knob in ((prompt_key, "prompt_key"), (messages_key, "messages_key")):
        if key is not None and texts:
            raise ValueError(f"src: {str(texts[0])!r} is not JSON Lines or Parquet: a text file has no {key!r} (--{knob}) field")
    if text_key != "text" and not records:  # a field named, and no record to read it from: it would be ignored
        raise ValueError(f"text_key: {text_key!r} names a field, but src has no JSON Lines or Parquet file ({str(texts[0])!r} is "
                         "read as one text document; name JSON Lines files .jsonl, .ndjson or .json)")
    if messages_key is not None:  # and a record's tools, when it has them (optional)
        fields = ((messages_key, "messages_key"), (TOOLS_FIELD, None))
    else:
        fields = ((text_key, "text_key"),) + (((prompt_key, "prompt_key"),) if prompt_key is not None else ())
    masked = prompt_key is not None or messages_key is not None
    if out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a directory; expected a file name (e.g. data/code.u16)")
    tok = _load_tokenizer(tokenizer_path)
    chat = load_chat_template(tokenizer_path, chat_template, chat_template_kwargs) if messages_key is not None else None
    vocab_size = tok.get_vocab_size()
    separator_id = _separator_id(tok, separator)
    dtype = _choose_dtype(out, dtype, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    final_index = index_path(out)
    final_mask = out.parent / (out.name + MASK_SUFFIX)
    mine = f"{socket.gethostname()}.{os.getpid()}"  # the partial files of this run: another machine's run writes its own
    tmp_tokens, tmp_index, tmp_mask = (out.parent / f".{final.name}.{mine}.tmp" for final in (out, final_index, final_mask))
    _remove_stale_partials(out.parent, [out.name, final_index.name, final_mask.name])
    documents, tokens, prompt_tokens, pending, pending_chars = 0, 0, 0, [], 0
    conversations, split = 0, 0  # conversations with an assistant turn, and those made one document per turn
    start = time.monotonic()
    next_report = start + _PROGRESS_SECONDS

    def report(files_done: int) -> None:
        nonlocal next_report
        rate = tokens / max(time.monotonic() - start, 1e-9)
        print(f"prepare: {files_done}/{len(files)} files, {documents:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)",
              file=sys.stderr, flush=True)
        next_report = time.monotonic() + _PROGRESS_SECONDS

    def flush(f, mask_file) -> None:
        """Encode the pending documents and append their ids to f (their mask to mask_file)."""
        nonlocal documents, tokens, prompt_tokens, pending, pending_chars
        ids, mask = _encode(tok, pending, separator=separator_id, vocab_size=vocab_size, dtype=dtype, masked=masked, windowed=windowed)
        f.write(ids.tobytes())
        if mask is not None:
            mask_file.write(mask.tobytes())
            prompt_tokens += len(mask) - int(mask.sum())
        documents, tokens, pending, pending_chars = documents + len(pending), tokens + len(ids), [], 0

    windowed = _windowed(tok)  # read once: the tokenizer's whole JSON
    try:
        with open(tmp_tokens, "wb") as f, open(tmp_mask, "wb") if masked else contextlib.nullcontext() as mask_file:
            for done, path in enumerate(files, 1):
                if windowed and chat is None and not masked and _kind(path) == "text" and path.stat().st_size > _STREAM_BYTES:  # a large text file: never read whole
                    if pending:
                        flush(f, mask_file)
                    written = 0
                    for ids, _ in _text_file_ids(tok, path):
                        _check_ids(tok, ids, repr(str(path)), separator=separator_id, vocab_size=vocab_size, at=written)
                        f.write(ids.astype(FILE_DTYPES[dtype]).tobytes())
                        written += len(ids)
                        if progress and time.monotonic() >= next_report:
                            report(done - 1)
                    if written:
                        f.write(np.asarray([separator_id]).astype(FILE_DTYPES[dtype]).tobytes())
                        documents, tokens = documents + 1, tokens + written + 1
                    continue
                for where, *values in _documents(path, fields):
                    if chat is not None:  # a conversation without an assistant turn has nothing to learn
                        docs = chat.documents(values[0], where, tools=values[1])
                        conversations, split = conversations + bool(docs), split + (len(docs) > 1)
                        pending.extend((where, text, None, spans) for text, spans in docs)
                        pending_chars += sum(len(text) for text, _ in docs)
                    elif values[0]:  # a record without a text (a response) has nothing to learn
                        pending.append((where, values[0], values[1] if prompt_key is not None else None, None))
                        pending_chars += sum(map(len, values))
                    if pending_chars >= _BATCH_CHARS:
                        flush(f, mask_file)
                    if progress and time.monotonic() >= next_report:
                        report(done - 1)
            if pending:
                flush(f, mask_file)
            if progress:
                report(len(files))
        if not documents:
            raise ValueError(f"src: no non-empty documents in {str(src)!r}" if chat is None else
                             f"src: no conversation in {str(src)!r} has a message whose role is {TRAINED_ROLE!r}")
        index = dict(documents=documents, tokens=tokens, dtype=dtype, separator=separator_id, vocab_size=vocab_size,
                     tokenizer=str(tokenizer_path.resolve()), sources=len(files),
                     **({"text_key": text_key} if records and chat is None else {}),
                     **(dict(prompt_key=prompt_key) if prompt_key is not None else {}),
                     **(dict(messages_key=messages_key, chat_template=str(Path(chat.origin).resolve()), conversations=conversations,
                             split_conversations=split) if chat is not None else {}),
                     **(dict(chat_template_kwargs=chat_template_kwargs) if chat_template_kwargs else {}),
                     **(dict(prompt_tokens=prompt_tokens, loss_mask=final_mask.name) if masked else {}))
        with open(tmp_index, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        final_index.unlink(missing_ok=True)  # an older index must never describe the new ids
        final_mask.unlink(missing_ok=True)
        os.replace(tmp_tokens, out)
        if masked:
            os.replace(tmp_mask, final_mask)
        os.replace(tmp_index, final_index)
    finally:
        for tmp in (tmp_tokens, tmp_index, tmp_mask):
            tmp.unlink(missing_ok=True)
    return index


def _remove_stale_partials(folder: Path, names: list[str]) -> None:
    """Remove the partial files (.NAME.HOST.PID.tmp) that a prepare of this machine killed
    before its cleanup (SIGKILL, a node's crash) left for these output names, where that
    process is gone; say so on stderr."""
    host = socket.gethostname()
    for name in names:
        for tmp in folder.glob(f".{glob.escape(name)}.{glob.escape(host)}.*.tmp"):
            pid = tmp.name[len(f".{name}.{host}."):-len(".tmp")]
            if not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # still running: its own
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # another user's process
            tmp.unlink(missing_ok=True)
            print(f"note: removed {tmp}, a partial file of a prepare (pid {pid}) that ended before its cleanup", file=sys.stderr)


def _terminated(signum, frame):
    """SIGTERM (a scheduler's stop, `timeout`) ends prepare as Ctrl-C does: its partial files removed."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe.train.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a directory of source files (text, .gz, .jsonl[.gz], .json, .parquet), or one")
    parser.add_argument("out", help="the token file to write, e.g. data/code.u16 (and its .index.json)")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    parser.add_argument("--separator", default=None, help="end-of-document token, or its id (digits 0-9); "
                        f"default: the first of {', '.join(SEPARATOR_TOKENS)} the tokenizer knows")
    parser.add_argument("--text_key", default="text", help="the JSON Lines field / Parquet column of the text (default: text)")
    parser.add_argument("--prompt_key", default=None, help="the field / column of a prompt before each text, left out of the loss "
                        "(a loss-mask file beside OUT; default: no prompts)")
    parser.add_argument("--messages_key", default=None, help="the field / column of a conversation (a list of {role, content} "
                        "messages), rendered by the chat template; only the assistant's turns count in the loss (default: none)")
    parser.add_argument("--chat_template", default=None, help="with --messages_key: a .jinja file, or a JSON file with a "
                        "chat_template field (default: chat_template.jinja or tokenizer_config.json beside --tokenizer)")
    parser.add_argument("--chat_template_kwargs", type=json_object, default=None, help="with --messages_key: more variables "
                        "for the template, a JSON object, e.g. '{\"enable_thinking\": false}'")
    parser.add_argument("--dtype", choices=list(FILE_DTYPES), default=None,
                        help="default: from OUT's suffix, else uint16 when the vocabulary fits, else uint32")
    args = parser.parse_args(argv)
    digits = args.separator is not None and args.separator.isascii() and args.separator.isdigit()  # not '²', not a full-width '２'
    separator = int(args.separator) if digits else args.separator
    previous = signal.signal(signal.SIGTERM, _terminated)  # the partial files removed (SIGKILL's: by the next run)
    try:
        index = prepare(args.src, args.out, tokenizer=args.tokenizer, separator=separator, dtype=args.dtype, text_key=args.text_key,
                        prompt_key=args.prompt_key, messages_key=args.messages_key, chat_template=args.chat_template,
                        chat_template_kwargs=args.chat_template_kwargs)
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}), "
          f"separator {index['separator']}, vocab_size {index['vocab_size']}"
          + (f", {index['prompt_tokens']:,} prompt tokens left out of the loss ({index['loss_mask']})" if "prompt_key" in index else "")
          + (f"; {index['conversations']} conversations ({index['split_conversations']} made one document per "
             f"assistant turn), {index['prompt_tokens']:,} tokens outside the assistant's turns left out of the loss "
             f"({index['loss_mask']})" if "messages_key" in index else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
