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

OUT gets the ids (uint16 when the vocabulary fits, <= 65536 ids, else uint32; a .u16 /
.u32 suffix or --dtype decides otherwise) and OUT.index.json:

    {"documents": n, "tokens": n_tokens, "dtype": "uint16", "separator": id,
     "vocab_size": tokenizer.get_vocab_size(), "tokenizer": "/abs/tokenizer.json", "sources": n_files,
     "text_key": "text" (only when some file is JSON Lines or Parquet)}

from which fmoe.train.data.load_token_file / load_corpus / load_blend take separator,
vocab_size and dtype. Documents are read and encoded in batches of about 4M characters
(encode_batch runs on the tokenizer's threads; a large JSON Lines or Parquet file is
streamed, never read whole) and streamed to disk; progress goes to stderr about once a
second. Output is atomic: both files are written under hidden
temporary names in OUT's directory and renamed into place at the end, the index last (an
older index is removed first), so a failed or interrupted run leaves neither final name.
"""

from __future__ import annotations

import argparse
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
from fmoe.train.data import FILE_DTYPES, SUFFIX_DTYPES, index_path, list_text_files

# end-of-document tokens of common tokenizers (GPT-2 / Qwen, Llama 2 / T5, ..., Llama 3, BERT)
SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
# characters of text per encode_batch call: large enough for the tokenizer's threads, small
# enough that one batch's ids stay a few tens of MB
_BATCH_CHARS = 1 << 22
_PROGRESS_SECONDS = 1.0
_PARQUET_ROWS = 1024  # rows of a Parquet file read at a time


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


def _text_field(record, text_key: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"src: {where} is not a JSON object (got {type(record).__name__})")
    text = record.get(text_key)
    if not isinstance(text, str):
        got = "no such key" if text_key not in record else f"{type(text).__name__}"
        raise ValueError(f"src: {where} has no string {text_key!r} field ({got}; keys: {sorted(record)[:8]}); choose it with --text_key")
    return text


def _jsonl_documents(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
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
                yield where, _text_field(record, text_key, where)
    except _GZIP_ERRORS as err:
        raise ValueError(f"src: {str(path)!r} is not a readable gzip file ({err})") from None


def _parquet_documents(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"src: {str(path)!r} is a Parquet file, which needs the pyarrow package: pip install 'fmoe[data]' (or pyarrow)") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's own error types
        raise ValueError(f"src: {str(path)!r} is not a readable Parquet file ({err})") from None
    names = table.schema_arrow.names
    if text_key not in names:
        raise ValueError(f"src: {str(path)!r} has no column {text_key!r} (columns: {names[:8]}); choose it with --text_key")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            where = f"{str(path)!r} row {row}"
            if not isinstance(text, str):
                raise ValueError(f"src: {where} has no string {text_key!r} ({type(text).__name__})")
            yield where, text
            row += 1


def _documents(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    """(where, text) of each document of one source file (module docstring), `where`
    naming it in errors: the file, and its line or row."""
    kind = _kind(path)
    if kind == "jsonl":
        yield from _jsonl_documents(path, text_key)
    elif kind == "parquet":
        yield from _parquet_documents(path, text_key)
    else:
        yield repr(str(path)), _decode(_read_bytes(path, kind == "gzip"), repr(str(path)))


def _encode(tokenizer, pending: list[tuple[str, str]], *, separator: int, vocab_size: int, dtype: str) -> np.ndarray:
    """The documents `pending` (where, text) as one array of ids [n_tokens], each document's
    ids followed by the separator."""
    encodings = tokenizer.encode_batch([text for _, text in pending], add_special_tokens=False)
    docs = []
    for (where, _), encoding in zip(pending, encodings):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        hits = np.flatnonzero(ids == separator)
        if len(hits):
            raise ValueError(f"src: {where} already holds the separator id {separator} (token {int(hits[0])} of the "
                             "document); remove it from the text or choose another --separator")
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"tokenizer: it gave id {int(ids.max())} for {where}, not below its vocab_size {vocab_size}")
        docs.extend((ids, [separator]))
    return np.concatenate(docs).astype(FILE_DTYPES[dtype])


def prepare(src: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tokenizer: Union[str, os.PathLike],
            separator: Union[str, int, None] = None, dtype: Optional[str] = None, progress: bool = True,
            text_key: str = "text") -> dict:
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
    """
    src, out, tokenizer_path = Path(src), Path(out), Path(tokenizer)
    if not isinstance(text_key, str) or not text_key:
        raise ValueError(f"text_key: expected a non-empty field name, got {text_key!r}")
    files = _source_files(src, out)
    records = any(_kind(path) in ("jsonl", "parquet") for path in files)  # also refuses zstd files before any work
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
    documents, tokens, pending, pending_chars = 0, 0, [], 0
    start = time.monotonic()
    next_report = start + _PROGRESS_SECONDS

    def report(files_done: int) -> None:
        nonlocal next_report
        rate = tokens / max(time.monotonic() - start, 1e-9)
        print(f"prepare: {files_done}/{len(files)} files, {documents:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)",
              file=sys.stderr, flush=True)
        next_report = time.monotonic() + _PROGRESS_SECONDS

    def flush(f) -> None:
        """Encode the pending documents and append their ids to f."""
        nonlocal documents, tokens, pending, pending_chars
        ids = _encode(tok, pending, separator=separator_id, vocab_size=vocab_size, dtype=dtype)
        f.write(ids.tobytes())
        documents, tokens, pending, pending_chars = documents + len(pending), tokens + len(ids), [], 0

    try:
        with open(tmp_tokens, "wb") as f:
            for done, path in enumerate(files, 1):
                for where, text in _documents(path, text_key):
                    if text:
                        pending.append((where, text))
                        pending_chars += len(text)
                    if pending_chars >= _BATCH_CHARS:
                        flush(f)
                    if progress and time.monotonic() >= next_report:
                        report(done - 1)
            if pending:
                flush(f)
            if progress:
                report(len(files))
        if not documents:
            raise ValueError(f"src: no non-empty documents in {str(src)!r}")
        index = dict(documents=documents, tokens=tokens, dtype=dtype, separator=separator_id, vocab_size=vocab_size,
                     tokenizer=str(tokenizer_path.resolve()), sources=len(files), **({"text_key": text_key} if records else {}))
        with open(tmp_index, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        final_index.unlink(missing_ok=True)  # an older index must never describe the new ids
        os.replace(tmp_tokens, out)
        os.replace(tmp_index, final_index)
    finally:
        tmp_tokens.unlink(missing_ok=True)
        tmp_index.unlink(missing_ok=True)
    return index


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe.train.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a directory of source files (text, .gz, .jsonl[.gz], .parquet), or one")
    parser.add_argument("out", help="the token file to write, e.g. data/code.u16 (and its .index.json)")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    parser.add_argument("--separator", default=None, help="end-of-document token, or its id (digits); "
                        f"default: the first of {', '.join(SEPARATOR_TOKENS)} the tokenizer knows")
    parser.add_argument("--text_key", default="text", help="the JSON Lines field / Parquet column of the text (default: text)")
    parser.add_argument("--dtype", choices=list(FILE_DTYPES), default=None,
                        help="default: from OUT's suffix, else uint16 when the vocabulary fits, else uint32")
    args = parser.parse_args(argv)
    separator = int(args.separator) if args.separator is not None and args.separator.isdigit() else args.separator
    try:
        index = prepare(args.src, args.out, tokenizer=args.tokenizer, separator=separator, dtype=args.dtype, text_key=args.text_key)
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}), "
          f"separator {index['separator']}, vocab_size {index['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
