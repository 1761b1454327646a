"""fmoe.train.prepare: text files -> a token file and its index, read back by fmoe.train.data."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="fmoe.train.prepare needs the tokenizers package (the fmoe[data] extra)")

from fmoe.train import prepare as prepare_module  # noqa: E402
from fmoe.train.data import load_blend, load_corpus  # noqa: E402
from fmoe.train.prepare import main, prepare  # noqa: E402

TEXTS = {
    "a.txt": "first document: héllo wörld → 🙂\n",
    "sub/b.py": (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[:3000],
    "sub/c.md": "# third\n\nsome *markdown* text\n",
}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A byte-level BPE (500 ids, "<|endoftext|>" special) trained on a few KB of the stdlib."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8")[:4000] for name in ("string.py", "textwrap.py", "json/__init__.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _word_tokenizer(path, n_words, specials=("<|endoftext|>",)):
    """A WordLevel tokenizer of n_words ids: words w0.., [UNK], then `specials` at the top."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n_words - 1 - len(specials))}
    vocab["[UNK]"] = len(vocab)
    for token in specials:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def _write_texts(root, texts=TEXTS):
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def src(tmp_path):
    root = _write_texts(tmp_path / "src")
    (root / "empty.txt").write_bytes(b"")
    (root / ".hidden").write_text("skipped")
    (root / ".git").mkdir()
    (root / ".git" / "x").write_text("skipped")
    return root


def test_prepare_round_trip(src, tmp_path, tokenizer_path):
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id("<|endoftext|>")
    out = tmp_path / "out" / "code.bin"
    index = prepare(src, out, tokenizer=tokenizer_path, progress=False)
    on_disk = json.loads((tmp_path / "out" / "code.bin.index.json").read_text())
    assert index == on_disk
    assert index == {"documents": 3, "tokens": out.stat().st_size // 2, "dtype": "uint16", "separator": eot,
                     "vocab_size": 500, "tokenizer": str(tokenizer_path.resolve()), "sources": 4}
    ds = load_corpus(out)  # separator, vocab_size and dtype from the index
    assert len(ds) == 3 and ds.vocab_size == 500
    for i, rel in enumerate(sorted(TEXTS)):  # sorted relative paths, the empty file skipped
        ids = ds.document(i).tolist()
        assert ids[-1] == eot and eot not in ids[:-1]
        assert tok.decode(ids[:-1]) == TEXTS[rel]
    assert sorted(os.listdir(tmp_path / "out")) == ["code.bin", "code.bin.index.json"]
    assert load_blend(str(out)).names == ["code.bin"]


def test_single_file_and_separator_choice(tmp_path, tokenizer_path):
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    path = _write_texts(tmp_path, {"one.txt": "just one file"}) / "one.txt"
    by_id = prepare(path, tmp_path / "a.u16", tokenizer=tokenizer_path, separator=tok.token_to_id("a"), progress=False)
    by_token = prepare(path, tmp_path / "b.u16", tokenizer=tokenizer_path, separator="<|endoftext|>", progress=False)
    assert by_id["separator"] == tok.token_to_id("a") and by_token["separator"] == tok.token_to_id("<|endoftext|>")
    assert by_token["documents"] == 1 and by_token["sources"] == 1
    assert load_corpus(tmp_path / "b.u16").document(0).tolist()[:-1] == tok.encode("just one file", add_special_tokens=False).ids
    sep_tok = _word_tokenizer(tmp_path / "sep.json", 20, specials=("[SEP]",))
    (tmp_path / "w.txt").write_text("w1 w2 w3")
    assert prepare(tmp_path / "w.txt", tmp_path / "w.u16", tokenizer=sep_tok, progress=False)["separator"] == 19


def test_a_tokenizer_that_truncates_or_pads_encodes_documents_whole(tmp_path, tokenizer_path):
    """A tokenizer.json saved with truncation and padding on (a classifier's, a batch encoder's)
    would cut a long document at max_length and pad a short one: prepare encodes each whole."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    plain = [tok.encode(t, add_special_tokens=False).ids for t in (TEXTS["sub/b.py"][:400], "hi")]
    assert len(plain[0]) > 8 and len(plain[1]) < 8
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=0, pad_token=tok.id_to_token(0))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = _write_texts(tmp_path / "src", {"a.txt": TEXTS["sub/b.py"][:400], "b.txt": "hi"})
    eot = prepare(src, tmp_path / "out.u16", tokenizer=tmp_path / "tokenizer.json", progress=False)["separator"]
    ds = load_corpus(tmp_path / "out.u16")
    assert [ds.document(i).tolist() for i in range(len(ds))] == [ids + [eot] for ids in plain]


def test_dtype_choice(src, tmp_path, tokenizer_path):
    small = prepare(src, tmp_path / "t.bin", tokenizer=tokenizer_path, dtype="uint32", progress=False)
    assert small["dtype"] == "uint32" and (tmp_path / "t.bin").stat().st_size == 4 * small["tokens"]
    assert prepare(src, tmp_path / "t.u32", tokenizer=tokenizer_path, progress=False)["dtype"] == "uint32"  # the suffix says so
    ref = load_corpus(tmp_path / "t.u32")
    assert [d.tolist() for d in map(ref.document, range(3))] == [d.tolist() for d in map(load_corpus(tmp_path / "t.bin").document, range(3))]
    with pytest.raises(ValueError, match="dtype: 'uint16' was given, the suffix of .*t.u32.* means 'uint32'"):
        prepare(src, tmp_path / "t.u32", tokenizer=tokenizer_path, dtype="uint16", progress=False)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        prepare(src, tmp_path / "t.bin", tokenizer=tokenizer_path, dtype="int8", progress=False)
    big = _word_tokenizer(tmp_path / "big.json", 70_000)
    words = tmp_path / "words.txt"
    words.write_text("w1 w69000 w5 unknownword")
    index = prepare(words, tmp_path / "w.bin", tokenizer=big, progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_000 and index["separator"] == 69_999
    assert load_corpus(tmp_path / "w.bin").document(0).tolist() == [1, 69000, 5, 69_998, 69_999]
    with pytest.raises(ValueError, match="dtype: uint16 holds ids up to 65535, the tokenizer has 70000"):
        prepare(words, tmp_path / "w16.bin", tokenizer=big, dtype="uint16", progress=False)
    assert not (tmp_path / "w16.bin").exists()
    # exactly 65536 ids (a 2^16 BPE): ids 0..65535 fit uint16, by default, by name and by the knob
    full = _word_tokenizer(tmp_path / "full.json", 1 << 16)
    words.write_text("w1 w65000 w5")
    for out, kw in ((tmp_path / "f.bin", {}), (tmp_path / "f.u16", {}), (tmp_path / "g.bin", {"dtype": "uint16"})):
        index = prepare(words, out, tokenizer=full, progress=False, **kw)
        assert index["dtype"] == "uint16" and index["vocab_size"] == 65_536 and out.stat().st_size == 2 * index["tokens"] == 2 * 4
        assert load_corpus(out).document(0).tolist() == [1, 65000, 5, 65_535]  # the separator, the top id
    # one id more (65537): uint32 by default, uint16 refused
    over = _word_tokenizer(tmp_path / "over.json", (1 << 16) + 1)
    assert prepare(words, tmp_path / "o.bin", tokenizer=over, progress=False)["dtype"] == "uint32"
    with pytest.raises(ValueError, match="dtype: uint16 holds ids up to 65535, the tokenizer has 65537"):
        prepare(words, tmp_path / "o16.bin", tokenizer=over, dtype="uint16", progress=False)


def test_cli(src, tmp_path, tokenizer_path):
    out = tmp_path / "cli.u16"
    result = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(src), str(out), f"--tokenizer={tokenizer_path}",
                             "--separator=<|endoftext|>"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "cli.u16.index.json").read_text())
    assert result.stdout.strip() == (f"{out}: 3 documents, {index['tokens']:,} tokens (uint16), separator {index['separator']}, "
                                     "vocab_size 500")
    assert "prepare: 4/4 files" in result.stderr  # progress
    assert len(load_corpus(out)) == 3


def test_cli_errors(src, tmp_path, tokenizer_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "x.u16"), f"--tokenizer={tokenizer_path}"]) == 1
    assert "error: src: " in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "x.u16"), f"--tokenizer={tokenizer_path}", "--separator=9999"]) == 1
    assert "error: separator: expected 0..499, got 9999" in capsys.readouterr().err
    assert not (tmp_path / "x.u16").exists()


def test_atomic_on_failure(src, tmp_path, tokenizer_path, monkeypatch):
    real = tokenizers.Tokenizer.from_file(str(tokenizer_path))

    class FailsOnSecondBatch:
        """The real tokenizer, but its second encode_batch call raises."""

        def __init__(self):
            self.calls = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def encode_batch(self, texts, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("interrupted")
            return real.encode_batch(texts, **kwargs)

    monkeypatch.setattr(prepare_module, "_load_tokenizer", lambda path: FailsOnSecondBatch())
    monkeypatch.setattr(prepare_module, "_BATCH_CHARS", 1)  # one file per batch
    out_dir = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare(src, out_dir / "code.u16", tokenizer=tokenizer_path, progress=False)
    assert os.listdir(out_dir) == []  # no OUT, no index, no temporary file
    # an earlier run's files stay as they were
    monkeypatch.undo()
    index = prepare(src, out_dir / "code.u16", tokenizer=tokenizer_path, progress=False)
    before = (out_dir / "code.u16").read_bytes()
    monkeypatch.setattr(prepare_module, "_load_tokenizer", lambda path: FailsOnSecondBatch())
    monkeypatch.setattr(prepare_module, "_BATCH_CHARS", 1)
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare(src, out_dir / "code.u16", tokenizer=tokenizer_path, progress=False)
    assert sorted(os.listdir(out_dir)) == ["code.u16", "code.u16.index.json"]
    assert (out_dir / "code.u16").read_bytes() == before and json.loads((out_dir / "code.u16.index.json").read_text()) == index


def test_bad_inputs(src, tmp_path, tokenizer_path):
    out = tmp_path / "out.u16"
    with pytest.raises(FileNotFoundError, match="src: .*nope.* does not exist"):
        prepare(tmp_path / "nope", out, tokenizer=tokenizer_path, progress=False)
    with pytest.raises(FileNotFoundError, match="tokenizer: .*missing.json.* does not exist"):
        prepare(src, out, tokenizer=tmp_path / "missing.json", progress=False)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer: cannot read .*broken.json"):
        prepare(src, out, tokenizer=tmp_path / "broken.json", progress=False)
    with pytest.raises(ValueError, match="separator: the tokenizer has no token '<eos>'"):
        prepare(src, out, tokenizer=tokenizer_path, separator="<eos>", progress=False)
    with pytest.raises(ValueError, match="separator: the tokenizer knows none of .*--separator"):
        prepare(src, out, tokenizer=_word_tokenizer(tmp_path / "plain.json", 10, specials=()), progress=False)
    (src / "sub" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"src: .*sub/latin1.txt.* is not valid UTF-8 \(unexpected end of data at byte 3\)"):
        prepare(src, out, tokenizer=tokenizer_path, progress=False)
    (src / "sub" / "latin1.txt").unlink()
    (src / "sub" / "eot.txt").write_text("one<|endoftext|>two")
    with pytest.raises(ValueError, match="src: .*sub/eot.txt.* already holds the separator id 0 .token [0-9]+ of the document.; remove it"):
        prepare(src, out, tokenizer=tokenizer_path, progress=False)
    (src / "sub" / "eot.txt").unlink()
    with pytest.raises(ValueError, match="out: .*inside src"):
        prepare(src, src / "tokens.u16", tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match="out: .* is src itself"):
        prepare(src / "a.txt", src / "a.txt", tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match="out: .* is a directory"):
        prepare(src, tmp_path, tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match=r"out: .*tokens.npy' would be read as a numpy array; name the token file .u16, .u32 or .bin"):
        prepare(src, tmp_path / "tokens.npy", tokenizer=tokenizer_path, progress=False)
    assert not (tmp_path / "tokens.npy").exists()
    with pytest.raises(ValueError, match=r"out: .*tokens.u16.INDEX.json' is named as an index; name the token file"):
        prepare(src, tmp_path / "tokens.u16.INDEX.json", tokenizer=tokenizer_path, progress=False)
    assert not list(tmp_path.glob("tokens.u16.*"))
    empties = tmp_path / "empties"
    empties.mkdir()
    with pytest.raises(ValueError, match="src: no files under"):
        prepare(empties, out, tokenizer=tokenizer_path, progress=False)
    (empties / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="src: no non-empty documents in"):
        prepare(empties, out, tokenizer=tokenizer_path, progress=False)
    assert not out.exists() and not (tmp_path / "out.u16.index.json").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_missing_package(src, tmp_path, tokenizer_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now raises ImportError
    with pytest.raises(ImportError, match=r"needs the Hugging Face tokenizers package: pip install 'fmoe\[data\]'"):
        prepare(src, tmp_path / "x.u16", tokenizer=tokenizer_path, progress=False)


RECORDS = ["first record: héllo", "", "second\nrecord with a newline", "third 🙂"]  # the empty one is skipped


def _records(root, key="text"):
    """The same RECORDS as JSON Lines (plain, gzip; a blank line; an extra field), as a
    Parquet table, and as a gzip text file (one document): the files of one source dir."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    lines = [json.dumps({"id": i, key: text}) for i, text in enumerate(RECORDS)]
    (root / "a.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    (root / "b.JSONL.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    pq.write_table(pa.table({"id": list(range(len(RECORDS))), key: RECORDS}), root / "c.parquet", row_group_size=3)
    (root / "d.txt.gz").write_bytes(gzip.compress("a whole gzip text".encode()))
    return root


def test_json_lines_parquet_and_gzip_sources(tmp_path, tokenizer_path):
    """Each JSON Lines line / Parquet row is a document (its text_key), a .gz text file one
    (given alone: beside records, a text file is left out, warned of); empty texts are
    skipped; the index says which key was read."""
    pytest.importorskip("pyarrow", reason="Parquet sources need pyarrow (the fmoe[data] extra)")
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    src = _records(tmp_path / "src")
    with pytest.warns(UserWarning, match=r"src: 1 file\(s\) beside the records of .* are left out \(text, or a .json of one object\): d.txt.gz$"):
        index = prepare(src, tmp_path / "r.u16", tokenizer=tokenizer_path, progress=False)
    kept = [t for t in RECORDS if t]
    want = kept + kept + kept  # sorted file names: a, b, c
    assert index["documents"] == len(want) and index["sources"] == 3 and index["text_key"] == "text"
    ds = load_corpus(tmp_path / "r.u16")
    assert [tok.decode(ds.document(i).tolist()[:-1]) for i in range(len(ds))] == want
    # another key, from the command line; a text-only source writes no text_key
    other = _records(tmp_path / "other", key="content")
    run = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(other / "c.parquet"), str(tmp_path / "o.u16"),
                          f"--tokenizer={tokenizer_path}", "--text_key=content"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [tok.decode(d.tolist()[:-1]) for d in map(load_corpus(tmp_path / "o.u16").document, range(3))] == kept
    assert "text_key" not in prepare(other / "d.txt.gz", tmp_path / "d.u16", tokenizer=tokenizer_path, progress=False)
    # NDJSON, plain and gzip (a .ndjson.gz read as one text document put braces and keys in the data)
    import gzip

    nd = tmp_path / "nd"
    nd.mkdir()
    lines = "\n".join(json.dumps({"text": text}) for text in RECORDS) + "\n"
    (nd / "e.ndjson").write_text(lines, encoding="utf-8")
    (nd / "f.NDJSON.gz").write_bytes(gzip.compress(lines.encode()))
    index = prepare(nd, tmp_path / "nd.u16", tokenizer=tokenizer_path, progress=False)
    assert index["documents"] == 2 * len(kept) and index["sources"] == 2 and index["text_key"] == "text"
    assert [tok.decode(d.tolist()[:-1]) for d in map(load_corpus(tmp_path / "nd.u16").document, range(2 * len(kept)))] == kept + kept


def test_record_sources_name_the_bad_line_or_row(tmp_path, tokenizer_path):
    pytest.importorskip("pyarrow", reason="Parquet sources need pyarrow (the fmoe[data] extra)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out.u16"

    def fails(name, data, match, **kw):
        path = tmp_path / name
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
        with pytest.raises(ValueError, match=match):
            prepare(path, out, tokenizer=tokenizer_path, progress=False, **kw)
        path.unlink()

    fails("a.jsonl", '{"text": "ok"}\n{"text": "ok"\n', r"src: '.*a.jsonl' line 2 is not JSON \(Expecting ',' delimiter at column 14\)")
    fails("a.jsonl", '{"text": "ok"}\n["text"]\n', r"src: '.*a.jsonl' line 2 is not a JSON object \(got list\)")
    fails("a.jsonl", '{"body": "ok"}\n', r"src: '.*a.jsonl' line 1 has no string 'text' field \(no such key; keys: \['body'\]\); choose it with --text_key")
    fails("a.jsonl", '{"text": null}\n', r"src: '.*a.jsonl' line 1 has no string 'text' field \(NoneType")
    fails("a.jsonl", b'{"text": "caf\xe9"}\n', r"src: '.*a.jsonl' line 1 is not valid UTF-8")
    fails("a.jsonl", '{"text": "one<|endoftext|>two"}\n', r"src: '.*a.jsonl' line 1 already holds the separator id 0")
    fails("a.jsonl.gz", b"not gzip at all", r"src: '.*a.jsonl.gz' is not a readable gzip file")
    fails("a.txt.gz", b"not gzip at all", r"src: '.*a.txt.gz' is not a readable gzip file")
    fails("a.jsonl.zst", b"\x28\xb5\x2f\xfd", r"src: '.*a.jsonl.zst' is zstd-compressed, which is not read here; decompress it first")
    fails("a.parquet", b"PAR1 not really", r"src: '.*a.parquet' is not a readable Parquet file")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"src: '.*p.parquet' has no column 'text' \(columns: \['body'\]\); choose it with --text_key"):
        prepare(tmp_path / "p.parquet", out, tokenizer=tokenizer_path, progress=False)
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"src: '.*n.parquet' row 1 has no string 'text' \(NoneType\)"):
        prepare(tmp_path / "n.parquet", out, tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match="text_key: expected a non-empty field name, got ''"):
        prepare(tmp_path / "n.parquet", out, tokenizer=tokenizer_path, progress=False, text_key="")
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_large_json_lines_file_is_streamed_in_batches(tmp_path, tokenizer_path, monkeypatch):
    """A file's records are encoded in several batches (never all at once), and the ids are
    those of one batch."""
    calls = []
    real = tokenizers.Tokenizer.from_file(str(tokenizer_path))

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode_batch(self, texts, **kwargs):
            calls.append(len(texts))
            return real.encode_batch(texts, **kwargs)

    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": f"record {i} " * 3}) + "\n" for i in range(50)))
    whole = prepare(tmp_path / "big.jsonl", tmp_path / "one.u16", tokenizer=tokenizer_path, progress=False)
    monkeypatch.setattr(prepare_module, "_load_tokenizer", lambda path: Counting())
    monkeypatch.setattr(prepare_module, "_BATCH_CHARS", 100)
    assert prepare(tmp_path / "big.jsonl", tmp_path / "many.u16", tokenizer=tokenizer_path, progress=False) == whole
    assert len(calls) > 5 and sum(calls) == 50
    assert (tmp_path / "many.u16").read_bytes() == (tmp_path / "one.u16").read_bytes()


def test_a_long_document_is_encoded_a_window_at_a_time_to_the_same_ids(tmp_path, tokenizer_path, monkeypatch):
    """One encode of a whole long document held ~450 bytes per token (a 45 MB text file took
    7.6 GB), and the file was read whole: a document longer than _WINDOW_CHARS is cut at
    pre-token boundaries and encoded a window at a time, a text file larger than
    _STREAM_BYTES read a part at a time, the ids those of the whole, byte for byte (here with
    windows of 64 characters: many cuts, by whitespace runs, code, unicode and an added
    token's text; parts of 50 bytes, cutting characters in two); a run the pre-tokenizer
    keeps whole takes a window as long as it, and a tokenizer whose normalizer or prefix
    space makes pieces encode otherwise encodes documents whole."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.add_special_tokens(["<|im_start|>"])
    tok.save(str(tmp_path / "tok.json"))
    code = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[:6000]
    texts = {"long.txt": code + "  \n\n   héllo wörld → 🙂🙂 <|im_start|>user\n" * 20 + "x" * 300 + " tail\n",
             "short.txt": "a short one\n", "run.txt": "y" * 500}
    src = _write_texts(tmp_path / "src", texts)
    (src / "bom.txt").write_bytes("\ufeffa text with a byte-order mark, ".encode() * 5)
    whole = prepare(src, tmp_path / "whole.u16", tokenizer=tmp_path / "tok.json", progress=False)
    windows = []
    real = prepare_module._windowed_ids
    monkeypatch.setattr(prepare_module, "_windowed_ids", lambda tokenizer, chunks: windows.append(got := list(real(tokenizer, chunks))) or iter(got))
    monkeypatch.setattr(prepare_module, "_WINDOW_CHARS", 64)
    monkeypatch.setattr(prepare_module, "_WINDOW_MARGIN", 8)
    for stream in (False, True):  # documents read whole; text files read 50 bytes at a time
        monkeypatch.setattr(prepare_module, "_STREAM_BYTES", 100 if stream else 1 << 26)
        monkeypatch.setattr(prepare_module, "_READ_BYTES", 50)
        windows.clear()
        got = prepare(src, tmp_path / f"windowed{stream}.u16", tokenizer=tmp_path / "tok.json", progress=False)
        assert got == whole and (tmp_path / f"windowed{stream}.u16").read_bytes() == (tmp_path / "whole.u16").read_bytes(), stream
        assert len(windows) == 3 and len(windows[1]) > 100 and len(windows[2]) == 1  # bom, long, run (whole); short.txt is short
        ends = [end for _, end in windows[1]]
        assert ends[-1] == len(texts["long.txt"]) and any(b - a > 300 for a, b in zip(ends, ends[1:]))  # a window doubled for the x's
        assert not any("<|im_start|>" in texts["long.txt"][c - 12:c + 12] for c in ends[:-1])
    (src / "bad.txt").write_bytes(b"text" * 30 + "é".encode()[:1] + b"more")
    with pytest.raises(ValueError, match=r"^src: '.*bad\.txt' is not valid UTF-8 \(invalid continuation byte at byte 120\)"):
        prepare(src, tmp_path / "bad.u16", tokenizer=tmp_path / "tok.json", progress=False)
    (src / "bad.txt").write_bytes(b"text" * 30 + b"\0")
    with pytest.raises(ValueError, match=r"^src: '.*bad\.txt' holds a NUL byte \(at byte 120\)"):
        prepare(src, tmp_path / "bad.u16", tokenizer=tmp_path / "tok.json", progress=False)
    assert prepare_module._windowed(tok)

    class Misled:  # a pre-tokenizer piece that starts inside a token: that cut is not taken
        def pre_tokenize_str(self, text):
            return [(text[1:], (1, len(text)))]

    text = "import textwrap\n" * 20
    wrapped = type("T", (), {"pre_tokenizer": Misled(), "encode": tok.encode, "get_added_tokens_decoder": tok.get_added_tokens_decoder})()
    ids = np.concatenate([ids for ids, _ in real(wrapped, [text])])
    assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
    for pre in (pre_tokenizers.ByteLevel(add_prefix_space=True), pre_tokenizers.Metaspace()):
        tok.pre_tokenizer = pre
        assert not prepare_module._windowed(tok)
    tok.pre_tokenizer, tok.normalizer = pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC()
    assert not prepare_module._windowed(tok)


SFT = [{"prompt": "Q: what is json?", "response": " A: a format.", "id": 0}, {"prompt": "", "response": " only a response", "id": 1},
       {"prompt": "a prompt without an answer", "response": "", "id": 2}, {"prompt": "Q: and string?", "response": " A: a module.", "id": 3}]


def test_prompts_are_left_out_of_the_loss(tmp_path, tokenizer_path):
    """--prompt_key: each document is the prompt's ids, then the response's, then the
    separator, and OUT.loss_mask is 0 exactly on the prompt's ids (a record without a
    response is skipped; an empty prompt masks nothing). Read back, a batch counts the
    response's tokens and the separator, at every MTP depth; JSON Lines and Parquet agree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fmoe.train.data import Sampler

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    sep = tok.token_to_id("<|endoftext|>")
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT))
    pq.write_table(pa.table({k: [r[k] for r in SFT] for k in ("id", "response", "prompt")}), tmp_path / "sft.parquet", row_group_size=2)
    kept = [r for r in SFT if r["response"]]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False).ids for r in kept]
    responses = [tok.encode(r["response"], add_special_tokens=False).ids for r in kept]
    want_ids = [t for p, r in zip(prompts, responses) for t in (*p, *r, sep)]
    want_mask = [m for p, r in zip(prompts, responses) for m in [0] * len(p) + [1] * (len(r) + 1)]
    for name in ("sft.jsonl", "sft.parquet"):
        out = tmp_path / f"{name}.u16"
        index = prepare(tmp_path / name, out, tokenizer=tokenizer_path, text_key="response", prompt_key="prompt", progress=False)
        assert index["documents"] == 3 and index["prompt_key"] == "prompt" and index["loss_mask"] == f"{name}.u16.loss_mask"
        assert index["prompt_tokens"] == sum(map(len, prompts)) > 0 and index["tokens"] == len(want_ids)
        assert np.fromfile(out, dtype=np.uint16).tolist() == want_ids
        assert np.fromfile(tmp_path / index["loss_mask"], dtype=np.uint8).tolist() == want_mask
        ds = load_corpus(out)
        assert ds.label_mask is not None and np.asarray(ds.label_mask).tolist() == want_mask
        batch = Sampler(ds, len(want_ids), seed=0, shuffle=False, mtp_depth=1).next_batch()
        ids, cu = batch["input_ids"].tolist(), batch["cu_seqlens"].tolist()
        doc = [i for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])) for _ in range(s, e)]
        for t in range(len(ids)):  # the label of t is token t + 1 (t + 2 at MTP depth 1), counted when a response's
            for d, (labels, mask) in enumerate([(batch["labels"], batch["loss_mask"]), (batch["mtp_labels"][0], batch["mtp_loss_mask"][0])]):
                j = t + 1 + d
                counted = j < len(ids) and doc[j] == doc[t] and want_mask[j] == 1
                assert bool(mask[t]) == counted and int(labels[t]) == (ids[j] if counted else -100), (name, t, d)
    # preparing the same name again without prompts removes the mask; the index no longer names one
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"text": r["response"]}) + "\n" for r in kept))
    out = tmp_path / "sft.jsonl.u16"
    index = prepare(tmp_path / "plain.jsonl", out, tokenizer=tokenizer_path, progress=False)
    assert "loss_mask" not in index and not (tmp_path / "sft.jsonl.u16.loss_mask").exists() and load_corpus(out).label_mask is None
    # the CLI names the prompt tokens left out
    run = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(tmp_path / "sft.jsonl"), str(tmp_path / "cli.u16"),
                          f"--tokenizer={tokenizer_path}", "--text_key=response", "--prompt_key=prompt"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(f", {sum(map(len, prompts))} prompt tokens left out of the loss (cli.u16.loss_mask)")


def test_bad_prompt_sources_and_masks(tmp_path, tokenizer_path):
    from fmoe.train.data import load_token_file

    out = tmp_path / "o.u16"
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT))
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(ValueError, match=r"src: '.*t.txt' is not JSON Lines or Parquet: a text file has no 'prompt' \(--prompt_key\) field"):
        prepare(tmp_path / "t.txt", out, tokenizer=tokenizer_path, prompt_key="prompt", progress=False)
    # a field named for text files: refused, not the whole file read as one document (JSON Lines saved as .json are records)
    with pytest.raises(ValueError, match=r"text_key: 'response' names a field, but src has no JSON Lines or Parquet file \('.*t.txt'"):
        prepare(tmp_path / "t.txt", out, tokenizer=tokenizer_path, text_key="response", progress=False)
    (tmp_path / "records.json").write_text("".join(json.dumps(r) + "\n" for r in SFT))
    assert prepare(tmp_path / "records.json", tmp_path / "j.u16", tokenizer=tokenizer_path, text_key="response", progress=False)["documents"] == sum(bool(r["response"]) for r in SFT)
    for bad in ("", "text", 3):
        with pytest.raises(ValueError, match="prompt_key: expected a non-empty field name other than text_key 'text'"):
            prepare(tmp_path / "sft.jsonl", out, tokenizer=tokenizer_path, prompt_key=bad, progress=False)
    with pytest.raises(ValueError, match=r"line 1 has no string 'question' field \(no such key; .*choose it with --prompt_key"):
        prepare(tmp_path / "sft.jsonl", out, tokenizer=tokenizer_path, text_key="response", prompt_key="question", progress=False)
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))
    prepare(tmp_path / "sft.jsonl", out, tokenizer=tokenizer_path, text_key="response", prompt_key="prompt", progress=False)
    mask = tmp_path / "o.u16.loss_mask"
    good = mask.read_bytes()
    mask.write_bytes(good[:-1])
    with pytest.raises(ValueError, match=r"holds \d+ entries for \d+ tokens \(a stale file"):
        load_token_file(out)
    mask.write_bytes(good[:-1] + b"\x02")
    with pytest.raises(ValueError, match="holds values other than 0 and 1"):
        load_token_file(out)
    mask.unlink()
    with pytest.raises(ValueError, match="the loss mask '.*o.u16.loss_mask' that '.*o.u16.index.json' names does not exist"):
        load_token_file(out)


def test_tar_archives_and_nul_bytes_are_refused(tmp_path, tokenizer_path):
    """A tar archive is not a text document (its headers and padding are NUL bytes that decode
    as UTF-8): refused by its name, or, named otherwise, by the NUL bytes of its text."""
    import gzip
    import io
    import tarfile

    (tmp_path / "doc.txt").write_text("some text")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(tmp_path / "doc.txt", arcname="doc.txt")
    out = tmp_path / "out.u16"
    for name, data in (("c.tar", archive.getvalue()), ("c.tar.gz", gzip.compress(archive.getvalue())), ("c.TGZ", gzip.compress(archive.getvalue()))):
        src = tmp_path / name.replace(".", "_")
        src.mkdir()
        (src / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"src: '.*{name}' is a tar archive, which is not read here; extract it first \(tar -xf\)"):
            prepare(src, out, tokenizer=tokenizer_path, progress=False)
    (tmp_path / "c.gz").write_bytes(gzip.compress(archive.getvalue()))
    (tmp_path / "utf16.txt").write_text("text", encoding="utf-16-le")
    for name in ("c.gz", "utf16.txt"):
        with pytest.raises(ValueError, match=rf"src: '.*{name}' holds a NUL byte \(at byte \d+\), which text does not; extract an archive"):
            prepare(tmp_path / name, out, tokenizer=tokenizer_path, progress=False)
    assert not out.exists()


def test_a_lone_surrogate_names_its_line(tmp_path, tokenizer_path):
    """A JSON "\\ud800" escape without its pair is valid JSON but not Unicode: a text, a prompt or
    a message holding one stops the run naming the line (tokenizers would raise a TypeError)."""
    out = tmp_path / "out.u16"
    (tmp_path / "t.jsonl").write_text('{"text": "ok"}\n{"text": "bad \\ud800 x"}\n')
    (tmp_path / "p.jsonl").write_text('{"text": "ok", "prompt": "bad \\udc00"}\n')
    (tmp_path / "m.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\ud83d"}]}\n')
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    for name, code, kw in (("t.jsonl:2", "D800", {}), ("p.jsonl:1", "DC00", dict(prompt_key="prompt")),
                           ("m.jsonl:1", "D83D", dict(messages_key="messages", chat_template=tmp_path / "t.jinja"))):
        name, line = name.split(":")
        with pytest.raises(ValueError, match=rf"src: '.*{name}' line {line} is not valid Unicode: it holds a lone surrogate \(U\+{code},"):
            prepare(tmp_path / name, out, tokenizer=tokenizer_path, progress=False, **kw)
    assert not out.exists()


def test_paths_that_are_not_paths(tmp_path, tokenizer_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match=r"src: expected a path \(str or os.PathLike\), got list"):
        prepare([tmp_path / "a.txt"], tmp_path / "o.u16", tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match=r"src: expected a path \(str or os.PathLike\), got NoneType"):
        prepare(None, tmp_path / "o.u16", tokenizer=tokenizer_path, progress=False)
    with pytest.raises(ValueError, match=r"tokenizer: expected a path \(str or os.PathLike\), got NoneType"):
        prepare(tmp_path / "a.txt", tmp_path / "o.u16", tokenizer=None, progress=False)
    assert main([str(tmp_path / "a.txt"), str(tmp_path / "o.u16"), f"--tokenizer={tokenizer_path.parent}"]) == 1
    assert f"error: tokenizer: '{tokenizer_path.parent}' is a directory; expected its tokenizer.json file" in capsys.readouterr().err


def test_cli_separator_id_is_ascii_digits(tmp_path, capsys):
    """Only 0-9 make an id: '²' and a full-width '２' are token strings (str.isdigit() takes both)."""
    tok = _word_tokenizer(tmp_path / "w.json", 20)
    (tmp_path / "w.txt").write_text("w1 w2")
    for separator in ("²", "２"):
        assert main([str(tmp_path / "w.txt"), str(tmp_path / "o.u16"), f"--tokenizer={tok}", f"--separator={separator}"]) == 1
        assert f"error: separator: the tokenizer has no token '{separator}'" in capsys.readouterr().err
    assert main([str(tmp_path / "w.txt"), str(tmp_path / "o.u16"), f"--tokenizer={tok}", "--separator=3"]) == 0
    assert json.loads((tmp_path / "o.u16.index.json").read_text())["separator"] == 3


def test_a_byte_order_mark_is_not_a_token(tmp_path, tokenizer_path):
    """A UTF-8 file saved with a byte-order mark (Windows editors) trained its BOM as the
    document's first token; a JSON-lines file with one failed at line 1 as not JSON."""
    import gzip

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    expected = tok.encode("just one file", add_special_tokens=False).ids
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"\xef\xbb\xbfjust one file")
    (src / "b.txt.gz").write_bytes(gzip.compress(b"\xef\xbb\xbfjust one file"))
    (tmp_path / "r.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "just one file"}\n{"text": "\xef\xbb\xbfjust one file"}\n')
    for source, out in ((src, "t.u16"), (tmp_path / "r.jsonl", "r.u16")):
        prepare(source, tmp_path / out, tokenizer=tokenizer_path, progress=False)
        docs = load_corpus(tmp_path / out)
        assert len(docs) == 2
        first, second = (docs.document(i).tolist()[:-1] for i in range(2))
        assert first == expected and (second == expected) == (out == "t.u16")  # a BOM inside a record's text is the record's


def test_a_dataset_folder_is_read_for_its_records_and_json_records_are_records(tmp_path, tokenizer_path):
    """A downloaded dataset's folder: records (here a .json array of objects, as
    alpaca_data.json, and JSON Lines named .json) beside its card, license and metadata,
    which are left out with a warning naming them (they were tokenized as documents); a
    .json of one object given alone is refused (it was one document of raw JSON)."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    root = tmp_path / "dataset"
    (root / "data").mkdir(parents=True)
    (root / "data" / "alpaca.json").write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(RECORDS)], indent=2))
    (root / "data" / "more.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in RECORDS[:2]))
    (root / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card")
    (root / "LICENSE").write_text("MIT License")
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": "string"}, "splits": ["train"]}, indent=2))
    with pytest.warns(UserWarning, match=r"src: 3 file\(s\) beside the records of .* are left out \(text, or a .json of one object\): "
                                         r"LICENSE, README.md, dataset_info.json$"):
        index = prepare(root, tmp_path / "r.u16", tokenizer=tokenizer_path, progress=False)
    kept = [t for t in RECORDS if t]
    ds = load_corpus(tmp_path / "r.u16")
    assert [tok.decode(ds.document(i).tolist()[:-1]) for i in range(len(ds))] == kept + [t for t in RECORDS[:2] if t]
    assert index["sources"] == 2 and index["text_key"] == "text"
    with pytest.raises(ValueError, match=r"src: '.*dataset_info.json' holds one JSON dict, not records: a .json source is a JSON array "
                                         r"of objects, or JSON Lines"):
        prepare(root / "dataset_info.json", tmp_path / "m.u16", tokenizer=tokenizer_path, progress=False)
    (root / "data" / "bad.json").write_text('[{"text": "a"}, {"text": 3}]')
    with pytest.raises(ValueError, match=r"src: '.*bad.json' record 1 has no string 'text' field"):
        prepare(root / "data" / "bad.json", tmp_path / "b.u16", tokenizer=tokenizer_path, progress=False)


def test_a_json_file_s_layout_is_read_from_its_first_whole_value(tmp_path, tokenizer_path):
    """A .json file's layout was read from its first line, cut at 1 MiB: JSON Lines whose first
    record was longer were taken for one multi-line value (a dataset folder dropped every
    record of it, as metadata; alone it was "not JSON"); a dataset_info.json on one line, as
    datasets writes it, was taken for JSON Lines (the folder's prepare failed: no 'text'
    field); an array or JSON Lines after a blank first line was taken for metadata. Now the
    first non-blank line is read whole: "[" starts an array; one whole value is JSON Lines
    when more follow it, or when it is a record (it has the text field), else metadata."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    long_text = "the cat sat " * 95000  # past 1 MiB on the first line
    texts = [f"record {i}: {word}" for i, word in enumerate(["héllo", "a\nnewline", "🙂", "four", "five", "six", "seven"])]
    root = tmp_path / "dataset"
    root.mkdir()
    (root / "a_long.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in (long_text, texts[0], texts[1])))
    (root / "b_blank_first.json").write_text("\n\n" + json.dumps([{"text": texts[2]}, {"text": texts[3]}]))
    (root / "c_blank_first_lines.json").write_text("\n" + "".join(json.dumps({"text": t}) + "\n" for t in texts[4:6]))
    (root / "d_one_record.json").write_text(json.dumps({"text": texts[6]}))  # one record on one line: JSON Lines of one
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": "string"}, "splits": ["train"]}))  # one line, as datasets writes it
    with pytest.warns(UserWarning, match=r"src: 1 file\(s\) beside the records of .* are left out \(text, or a .json of one object\): "
                                         r"dataset_info.json$"):
        prepare(root, tmp_path / "r.u16", tokenizer=tokenizer_path, progress=False)
    ds = load_corpus(tmp_path / "r.u16")
    want = [long_text, *texts]
    assert len(ds) == len(want)
    assert [tok.decode(ds.document(i).tolist()[:-1]) for i in range(1, len(ds))] == want[1:]
    assert tok.decode(ds.document(0).tolist()[:-1]) == long_text
    with pytest.raises(ValueError, match=r"src: '.*dataset_info.json' holds one JSON dict, not records"):
        prepare(root / "dataset_info.json", tmp_path / "m.u16", tokenizer=tokenizer_path, progress=False)
    prepare(root / "a_long.json", tmp_path / "l.u16", tokenizer=tokenizer_path, progress=False)
    assert len(load_corpus(tmp_path / "l.u16")) == 3


def test_a_stopped_prepare_leaves_no_partial_files(tokenizer_path, tmp_path):
    """SIGTERM (a scheduler's stop, `timeout`) left .OUT.PID.tmp files, a new one per attempt,
    never removed: now the command line removes them as on Ctrl-C, and a run removes those a
    killed run of this machine left, once that process is gone."""
    import signal
    import socket
    import time

    src = tmp_path / "big.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 400_000)  # about 18 MB: seconds to tokenize
    out = tmp_path / "out" / "big.u16"
    run = subprocess.Popen([sys.executable, "-m", "fmoe.train.prepare", str(src), str(out), f"--tokenizer={tokenizer_path}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "out").glob(".*.tmp")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, (run.returncode, err[-2000:])
    assert list((tmp_path / "out").iterdir()) == [], list((tmp_path / "out").iterdir())
    # a killed run's partial files (a pid that no longer runs) are removed by the next run; a running one's are kept
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    stale = [out.parent / f".big.u16.{host}.{dead}.tmp", out.parent / f".big.u16.index.json.{host}.{dead}.tmp"]
    alive = out.parent / f".big.u16.{host}.{os.getpid()}.tmp"
    for path in (*stale, alive):
        path.write_bytes(b"partial")
    small = tmp_path / "small.txt"
    small.write_text("a few words\n")
    done = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(small), str(out), f"--tokenizer={tokenizer_path}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"note: removed {stale[0]}, a partial file of a prepare (pid {dead}) that ended before its cleanup" in done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([alive.name, "big.u16", "big.u16.index.json"])
