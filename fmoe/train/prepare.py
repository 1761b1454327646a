"""Text files -> a token file: `python -m fmoe.train.prepare SRC OUT --tokenizer=tokenizer.json`.

    python -m fmoe.train.prepare data/code/ data/code.u16 --tokenizer=tokenizer.json
    python -m fmoe.train.prepare book.txt data/book.bin --tokenizer=tok.json --separator='</s>' --dtype=uint32
    python -m fmoe.train.prepare fineweb/ data/web.u32 --tokenizer=tok.json    # *.parquet shards, "text" column
    python -m fmoe.train.prepare dump.jsonl.gz data/dump.u16 --tokenizer=tok.json --text_key=content

SRC is a directory (every file below it, as fmoe.train.data.list_text_files selects them:
recursive, dot-files and dot-directories skipped, sorted relative paths) or one file. By
its name (case-insensitive) a file is:

    *.jsonl, *.ndjson (+ .gz)   JSON Lines: each line an object, its --text_key string one
                                document (blank lines skipped)
    *.parquet                   a Parquet table: each row's --text_key string one document
                                (read 1024 rows at a time with pyarrow: pip install 'fmoe[data]')
    *.gz                        gzip-compressed text: one document
    anything else               UTF-8 text: one document
    (*.zst / *.zstd are refused: decompress them first)

Each non-empty document's text is encoded by a Hugging Face `tokenizers`
Tokenizer (the `data` extra: pip install 'fmoe[data]') without the tokenizer's
post-processing (no BOS / CLS added), then the separator id. The separator is
--separator (a token string, or an id when all digits), else the first of
SEPARATOR_TOKENS the tokenizer knows. A document whose text already encodes to the
separator id is refused, naming the file (and line or row): it would read back as two
documents. So is a record without a string --text_key (null, a number, a missing key).

Prompts and responses (instruction tuning): --prompt_key names a second field (or
column) of each record, its prompt. The document is then the prompt's ids, then the
text's (each encoded alone: the ids at their boundary are those of two texts), then the
separator; OUT.loss_mask gets one uint8 per token, 0 on the prompt's ids, so training and
evaluation on OUT count the loss of the texts (and separators) only (fmoe.train.data's
TokenDataset.label_mask). Every source must be JSON Lines or Parquet; a record with an
empty text is skipped.

    python -m fmoe.train.prepare sft.jsonl data/sft.u32 --tokenizer=tok.json --prompt_key=prompt --text_key=response

OUT gets the ids (uint16 when the vocabulary fits, <= 65536 ids, else uint32; a .u16 /
.u32 suffix or --dtype decides otherwise) and OUT.index.json:

    {"documents": n, "tokens": n_tokens, "dtype": "uint16", "separator": id,
     "vocab_size": tokenizer.get_vocab_size(), "tokenizer": "/abs/tokenizer.json", "sources": n_files,
     "text_key": "text" (only when some file is JSON Lines or Parquet),
     "prompt_key": "prompt", "prompt_tokens": n, "loss_mask": "OUT.loss_mask" (only with prompts)}

from which fmoe.train.data.load_token_file / load_corpus / load_blend take separator,
vocab_size and dtype. Documents are read and encoded in batches of about 4M characters
(encode_batch runs on the tokenizer's threads; a large JSON Lines or Parquet file is
streamed, never read whole) and streamed to disk; progress goes to stderr about once a
second. Output is atomic: both files are written under hidden
temporary names in OUT's directory and renamed into place at the end, the index last (an
older index and loss mask are removed first), so a failed or interrupted run leaves no
final name.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np

from fmoe.ops.checks import check_positive_int
from fmoe.train.data import FILE_DTYPES, MASK_SUFFIX, SUFFIX_DTYPES, index_path, list_text_files

# end-of-document tokens of common tokenizers (GPT-2 / Qwen, Llama 2 / T5, ..., Llama 3, BERT)
SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
# characters of text per encode_batch call: large enough for the tokenizer's threads, small
# enough that one batch's ids stay a few tens of MB
_BATCH_CHARS = 1 << 22
_PROGRESS_SECONDS = 1.0
_PARQUET_ROWS = 1024  # rows of a Parquet file read at a time
_KEY_KNOBS = ("text_key", "prompt_key")  # the knobs naming a record's fields, in _documents' order


def _load_tokenizer(path: Path):
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError("fmoe.train.prepare needs the Hugging Face tokenizers package: "
                          "pip install 'fmoe[data]' (or tokenizers)") from err
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {str(path)!r} does not exist")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"tokenizer: cannot read {str(path)!r} as a tokenizer.json ({err})") from err


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
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "gzip" if name.endswith(".gz") else "text"


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


def _text_field(record, text_key: str, where: str, knob: str = "text_key") -> str:
    if not isinstance(record, dict):
        raise ValueError(f"src: {where} is not a JSON object (got {type(record).__name__})")
    text = record.get(text_key)
    if not isinstance(text, str):
        got = "no such key" if text_key not in record else f"{type(text).__name__}"
        raise ValueError(f"src: {where} has no string {text_key!r} field ({got}; keys: {sorted(record)[:8]}); choose it with --{knob}")
    return text


def _jsonl_documents(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, 1):
                where = f"{str(path)!r} line {number}"
                line = _decode(line, where).strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"src: {where} is not JSON ({err.msg} at column {err.colno})") from None
                yield where, *(_text_field(record, key, where, knob) for key, knob in zip(keys, _KEY_KNOBS))
    except _GZIP_ERRORS as err:
        raise ValueError(f"src: {str(path)!r} is not a readable gzip file ({err})") from None


def _parquet_documents(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"src: {str(path)!r} is a Parquet file, which needs the pyarrow package: pip install 'fmoe[data]' (or pyarrow)") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's own error types
        raise ValueError(f"src: {str(path)!r} is not a readable Parquet file ({err})") from None
    names = table.schema_arrow.names
    for key in keys:
        if key not in names:
            raise ValueError(f"src: {str(path)!r} has no column {key!r} (columns: {names[:8]}); choose it with --{_KEY_KNOBS[keys.index(key)]}")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS, columns=list(keys)):
        for values in zip(*(batch.column(j).to_pylist() for j in range(len(keys)))):
            where = f"{str(path)!r} row {row}"
            for key, value in zip(keys, values):
                if not isinstance(value, str):
                    raise ValueError(f"src: {where} has no string {key!r} ({type(value).__name__})")
            yield where, *values
            row += 1


def _documents(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """(where, text) of each document of one source file (module docstring), `where`
    naming it in errors: the file, and its line or row; (where, text, prompt) with
    keys = (text_key, prompt_key), records only."""
    kind = _kind(path)
    if kind == "jsonl":
        yield from _jsonl_documents(path, keys)
    elif kind == "parquet":
        yield from _parquet_documents(path, keys)
    else:
        yield repr(str(path)), _decode(_read_bytes(path, kind == "gzip"), repr(str(path)))


def _encode(tokenizer, pending: list[tuple[str, ...]], *, separator: int, vocab_size: int,
            dtype: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The documents `pending` ((where, text) or (where, text, prompt)) as one array of ids
    [n_tokens], each document's ids (the prompt's, then the text's) followed by the
    separator; and with prompts, their loss mask [n_tokens] uint8: 0 on the prompts' ids."""
    encodings = tokenizer.encode_batch([p[1] for p in pending], add_special_tokens=False)
    prompted = len(pending[0]) == 3
    prompts = tokenizer.encode_batch([p[2] for p in pending], add_special_tokens=False) if prompted else [None] * len(pending)
    docs, masks = [], []
    for (where, *_), encoding, prompt in zip(pending, encodings, prompts):
        head = np.asarray(prompt.ids if prompt is not None else [], dtype=np.int64)
        ids = np.concatenate([head, np.asarray(encoding.ids, dtype=np.int64)])
        hits = np.flatnonzero(ids == separator)
        if len(hits):
            raise ValueError(f"src: {where} already holds the separator id {separator} (token {int(hits[0])} of the "
                             "document); remove it from the text or choose another --separator")
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"tokenizer: it gave id {int(ids.max())} for {where}, not below its vocab_size {vocab_size}")
        docs.extend((ids, [separator]))
        if prompted:
            masks.extend((np.zeros(len(head), dtype=np.uint8), np.ones(len(ids) - len(head) + 1, dtype=np.uint8)))
    return np.concatenate(docs).astype(FILE_DTYPES[dtype]), np.concatenate(masks) if prompted else None


def prepare(src: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tokenizer: Union[str, os.PathLike],
            separator: Union[str, int, None] = None, dtype: Optional[str] = None, progress: bool = True,
            text_key: str = "text", prompt_key: Optional[str] = None) -> dict:
    """Tokenize the documents of `src` into the token file `out` and its index (module
    docstring); returns the index.

    Args:
        src: a directory of source files (text, gzip, JSON Lines, Parquet), or one.
        out: the token file to write (its directory is created); out + ".index.json" too.
        tokenizer: a tokenizers tokenizer.json.
        separator: the end-of-document token (str) or id (int); None: SEPARATOR_TOKENS.
        dtype: "uint16" or "uint32"; None: from out's suffix, else the smallest that fits.
        progress: report files and tokens on stderr about once a second.
        text_key: the field (JSON Lines) or column (Parquet) holding each document's text.
        prompt_key: the field or column of a prompt before each text (records only): the
            document is the prompt's ids, then the text's, and a loss-mask file (module
            docstring) keeps the prompt's ids out of the loss; None: no prompts.
    """
    src, out, tokenizer_path = Path(src), Path(out), Path(tokenizer)
    if not isinstance(text_key, str) or not text_key:
        raise ValueError(f"text_key: expected a non-empty field name, got {text_key!r}")
    if prompt_key is not None and (not isinstance(prompt_key, str) or not prompt_key or prompt_key == text_key):
        raise ValueError(f"prompt_key: expected a non-empty field name other than text_key {text_key!r}, got {prompt_key!r}")
    files = _source_files(src, out)
    texts = [path for path in files if _kind(path) not in ("jsonl", "parquet")]  # also refuses zstd files before any work
    records = len(texts) < len(files)
    if prompt_key is not None and texts:
        raise ValueError(f"src: {str(texts[0])!r} is not JSON Lines or Parquet: a text file has no {prompt_key!r} (--prompt_key) field")
    keys = (text_key,) if prompt_key is None else (text_key, prompt_key)
    if out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a directory; expected a file name (e.g. data/code.u16)")
    tok = _load_tokenizer(tokenizer_path)
    vocab_size = tok.get_vocab_size()
    separator_id = _separator_id(tok, separator)
    dtype = _choose_dtype(out, dtype, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    final_index = index_path(out)
    tmp_tokens = out.parent / f".{out.name}.{os.getpid()}.tmp"
    tmp_index = out.parent / f".{final_index.name}.{os.getpid()}.tmp"
    final_mask = out.parent / (out.name + MASK_SUFFIX)
    tmp_mask = out.parent / f".{final_mask.name}.{os.getpid()}.tmp"
    documents, tokens, prompt_tokens, pending, pending_chars = 0, 0, 0, [], 0
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
        ids, mask = _encode(tok, pending, separator=separator_id, vocab_size=vocab_size, dtype=dtype)
        f.write(ids.tobytes())
        if mask is not None:
            mask_file.write(mask.tobytes())
            prompt_tokens += len(mask) - int(mask.sum())
        documents, tokens, pending, pending_chars = documents + len(pending), tokens + len(ids), [], 0

    try:
        with open(tmp_tokens, "wb") as f, open(tmp_mask, "wb") if prompt_key is not None else contextlib.nullcontext() as mask_file:
            for done, path in enumerate(files, 1):
                for where, text, *prompt in _documents(path, keys):
                    if text:  # a record without a text (a response) has nothing to learn
                        pending.append((where, text, *prompt))
                        pending_chars += len(text) + sum(map(len, prompt))
                    if pending_chars >= _BATCH_CHARS:
                        flush(f, mask_file)
                    if progress and time.monotonic() >= next_report:
                        report(done - 1)
            if pending:
                flush(f, mask_file)
            if progress:
                report(len(files))
        if not documents:
            raise ValueError(f"src: no non-empty documents in {str(src)!r}")
        index = dict(documents=documents, tokens=tokens, dtype=dtype, separator=separator_id, vocab_size=vocab_size,
                     tokenizer=str(tokenizer_path.resolve()), sources=len(files), **({"text_key": text_key} if records else {}),
                     **(dict(prompt_key=prompt_key, prompt_tokens=prompt_tokens, loss_mask=final_mask.name) if prompt_key is not None else {}))
        with open(tmp_index, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        final_index.unlink(missing_ok=True)  # an older index must never describe the new ids
        final_mask.unlink(missing_ok=True)
        os.replace(tmp_tokens, out)
        if prompt_key is not None:
            os.replace(tmp_mask, final_mask)
        os.replace(tmp_index, final_index)
    finally:
        for tmp in (tmp_tokens, tmp_index, tmp_mask):
            tmp.unlink(missing_ok=True)
    return index


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe.train.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a directory of source files (text, .gz, .jsonl[.gz], .parquet), or one")
    parser.add_argument("out", help="the token file to write, e.g. data/code.u16 (and its .index.json)")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    parser.add_argument("--separator", default=None, help="end-of-document token, or its id (digits); "
                        f"default: the first of {', '.join(SEPARATOR_TOKENS)} the tokenizer knows")
    parser.add_argument("--text_key", default="text", help="the JSON Lines field / Parquet column of the text (default: text)")
    parser.add_argument("--prompt_key", default=None, help="the field / column of a prompt before each text, left out of the loss "
                        "(a loss-mask file beside OUT; default: no prompts)")
    parser.add_argument("--dtype", choices=list(FILE_DTYPES), default=None,
                        help="default: from OUT's suffix, else uint16 when the vocabulary fits, else uint32")
    args = parser.parse_args(argv)
    separator = int(args.separator) if args.separator is not None and args.separator.isdigit() else args.separator
    try:
        index = prepare(args.src, args.out, tokenizer=args.tokenizer, separator=separator, dtype=args.dtype, text_key=args.text_key,
                        prompt_key=args.prompt_key)
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}), "
          f"separator {index['separator']}, vocab_size {index['vocab_size']}"
          + (f", {index['prompt_tokens']:,} prompt tokens left out of the loss ({index['loss_mask']})" if "loss_mask" in index else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
