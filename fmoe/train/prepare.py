"""Text files -> a token file: `python -m fmoe.train.prepare SRC OUT --tokenizer=tokenizer.json`.

    python -m fmoe.train.prepare data/code/ data/code.u16 --tokenizer=tokenizer.json
    python -m fmoe.train.prepare book.txt data/book.bin --tokenizer=tok.json --separator='</s>' --dtype=uint32

SRC is a directory (every file below it, as fmoe.train.data.list_text_files selects them:
recursive, dot-files and dot-directories skipped, sorted relative paths) or one text file.
Each non-empty file is one document: its UTF-8 text encoded by a Hugging Face `tokenizers`
Tokenizer (the `data` extra: pip install 'fmoe[data]') without the tokenizer's
post-processing (no BOS / CLS added), then the separator id. The separator is
--separator (a token string, or an id when all digits), else the first of
SEPARATOR_TOKENS the tokenizer knows. A document whose text already encodes to the
separator id is refused, naming the file: it would read back as two documents.

OUT gets the ids (uint16 when the vocabulary fits, <= 65536 ids, else uint32; a .u16 /
.u32 suffix or --dtype decides otherwise) and OUT.index.json:

    {"documents": n, "tokens": n_tokens, "dtype": "uint16", "separator": id,
     "vocab_size": tokenizer.get_vocab_size(), "tokenizer": "/abs/tokenizer.json", "sources": n_files}

from which fmoe.train.data.load_token_file / load_corpus / load_blend take separator,
vocab_size and dtype. Files are encoded in batches of about 4M characters
(encode_batch runs on the tokenizer's threads) and streamed to disk; progress goes to
stderr about once a second. Output is atomic: both files are written under hidden
temporary names in OUT's directory and renamed into place at the end, the index last (an
older index is removed first), so a failed or interrupted run leaves neither final name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fmoe.ops.checks import check_positive_int
from fmoe.train.data import FILE_DTYPES, SUFFIX_DTYPES, index_path, list_text_files

# end-of-document tokens of common tokenizers (GPT-2 / Qwen, Llama 2 / T5, ..., Llama 3, BERT)
SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
# characters of text per encode_batch call: large enough for the tokenizer's threads, small
# enough that one batch's ids stay a few tens of MB
_BATCH_CHARS = 1 << 22
_PROGRESS_SECONDS = 1.0


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


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"src: {str(path)!r} is not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _encode(tokenizer, pending: list[tuple[Path, str]], *, separator: int, vocab_size: int, dtype: str) -> np.ndarray:
    """The documents `pending` (path, text) as one array of ids [n_tokens], each document's
    ids followed by the separator."""
    encodings = tokenizer.encode_batch([text for _, text in pending], add_special_tokens=False)
    docs = []
    for (path, _), encoding in zip(pending, encodings):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        hits = np.flatnonzero(ids == separator)
        if len(hits):
            raise ValueError(f"src: {str(path)!r} already holds the separator id {separator} (token {int(hits[0])} of the "
                             "document); remove it from the text or choose another --separator")
        if len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"tokenizer: it gave id {int(ids.max())} for {str(path)!r}, not below its vocab_size {vocab_size}")
        docs.extend((ids, [separator]))
    return np.concatenate(docs).astype(FILE_DTYPES[dtype])


def prepare(src: Union[str, os.PathLike], out: Union[str, os.PathLike], *, tokenizer: Union[str, os.PathLike],
            separator: Union[str, int, None] = None, dtype: Optional[str] = None, progress: bool = True) -> dict:
    """Tokenize the text files of `src` into the token file `out` and its index (module
    docstring); returns the index.

    Args:
        src: a directory of text files, or one text file.
        out: the token file to write (its directory is created); out + ".index.json" too.
        tokenizer: a tokenizers tokenizer.json.
        separator: the end-of-document token (str) or id (int); None: SEPARATOR_TOKENS.
        dtype: "uint16" or "uint32"; None: from out's suffix, else the smallest that fits.
        progress: report files and tokens on stderr about once a second.
    """
    src, out, tokenizer_path = Path(src), Path(out), Path(tokenizer)
    files = _source_files(src, out)
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
    try:
        with open(tmp_tokens, "wb") as f:
            for done, path in enumerate(files, 1):
                text = _read_text(path)
                if text:
                    pending.append((path, text))
                    pending_chars += len(text)
                if pending and (pending_chars >= _BATCH_CHARS or done == len(files)):
                    ids = _encode(tok, pending, separator=separator_id, vocab_size=vocab_size, dtype=dtype)
                    f.write(ids.tobytes())
                    documents, tokens, pending, pending_chars = documents + len(pending), tokens + len(ids), [], 0
                if progress and (time.monotonic() >= next_report or done == len(files)):
                    rate = tokens / max(time.monotonic() - start, 1e-9)
                    print(f"prepare: {done}/{len(files)} files, {tokens:,} tokens ({rate:,.0f} tokens/s)", file=sys.stderr, flush=True)
                    next_report = time.monotonic() + _PROGRESS_SECONDS
        if not documents:
            raise ValueError(f"src: no non-empty files in {str(src)!r}")
        index = dict(documents=documents, tokens=tokens, dtype=dtype, separator=separator_id, vocab_size=vocab_size,
                     tokenizer=str(tokenizer_path.resolve()), sources=len(files))
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
    parser.add_argument("src", help="a directory of text files, or one text file")
    parser.add_argument("out", help="the token file to write, e.g. data/code.u16 (and its .index.json)")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    parser.add_argument("--separator", default=None, help="end-of-document token, or its id (digits); "
                        f"default: the first of {', '.join(SEPARATOR_TOKENS)} the tokenizer knows")
    parser.add_argument("--dtype", choices=list(FILE_DTYPES), default=None,
                        help="default: from OUT's suffix, else uint16 when the vocabulary fits, else uint32")
    args = parser.parse_args(argv)
    separator = int(args.separator) if args.separator is not None and args.separator.isdigit() else args.separator
    try:
        index = prepare(args.src, args.out, tokenizer=args.tokenizer, separator=separator, dtype=args.dtype)
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}), "
          f"separator {index['separator']}, vocab_size {index['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
