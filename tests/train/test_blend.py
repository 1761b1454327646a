"""fmoe.train.data blends: specs, sources (.npy, indexed token files), the greedy BlendSampler."""

import json
import re

import numpy as np
import pytest
import torch

from fmoe.train.data import (
    BYTE_VOCAB_SIZE, Blend, BlendSampler, Sampler, TokenDataset, load_blend, load_corpus, load_npy,
    load_text_dir, load_token_file, parse_blend,
)
from tests.train.test_data import _same, _synthetic


def _source(k, n_docs=9, vocab_size=100):
    """Token documents (no EOS) of ids k*30 .. k*30+29 only, so a batch's ids name its source."""
    rng = np.random.default_rng(k)
    lengths = rng.integers(1, 12, n_docs)
    data = (k * 30 + rng.integers(0, 30, int(lengths.sum()))).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return TokenDataset(data, starts, lengths, None, vocab_size=vocab_size, eos=None)


def _blend(weights, names=None):
    names = names or [f"s{k}" for k in range(len(weights))]
    return Blend([_source(k) for k in range(len(weights))], names, weights)


def _write_tokens(path, tokens, dtype="uint16", index=None):
    """tokens -> a flat token file; index: the fields of its .index.json (None: no index)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=dtype).tofile(path)
    if index is not None:
        (path.parent / (path.name + ".index.json")).write_text(json.dumps(index))
    return path


# ---------------------------------------------------------------- one source == Sampler


def test_one_source_is_the_sampler():
    ds = _synthetic()
    blend = Blend([ds], ["only"], [3.0])
    assert blend.weights == [1.0] and len(blend) == len(ds) and blend.n_tokens == ds.n_tokens
    plain, blended = Sampler(ds, 32, seed=5, mtp_depth=1), BlendSampler(blend, 32, seed=5, mtp_depth=1)
    assert blended.last_source is None
    for _ in range(15):
        a, b = plain.next_batch(), blended.next_batch()
        assert a.keys() == b.keys() and _same(a, b)
    assert blended.last_source == "only" and blended.tokens_by_source() == {"only": 15 * 32}
    assert blended.state_dict()["samplers"] == [plain.state_dict()]
    # a plain Sampler's state (a checkpoint from before blends) resumes the same stream
    resumed = BlendSampler(blend, 32, seed=5, mtp_depth=1)
    resumed.load_state_dict(plain.state_dict())
    assert all(_same(plain.next_batch(), resumed.next_batch()) for _ in range(5))
    # and validation is the dataset's own
    train, val = blend.split(30)
    v_plain = ds.split(30)[1].validation_batches(8, 3, mtp_depth=1)
    assert all(_same(a, b) for a, b in zip(val.validation_batches(8, 3, mtp_depth=1), v_plain))
    assert train.names == val.names == ["only"] and val.validation_sources(3) == ["only"] * 3


def test_one_source_spec_is_load_corpus(tmp_path):
    (tmp_path / "texts").mkdir()
    for i in range(6):
        (tmp_path / "texts" / f"f{i}.txt").write_text(f"document {i} " * (i + 1))
    blend = load_blend(str(tmp_path / "texts"))
    assert blend.names == ["texts"] and blend.vocab_size == BYTE_VOCAB_SIZE
    ds = load_text_dir(tmp_path / "texts")
    plain, blended = Sampler(ds, 16, seed=2), BlendSampler(blend, 16, seed=2)
    assert all(_same(plain.next_batch(), blended.next_batch()) for _ in range(8))


def test_default_is_stdlib():
    blend = load_blend("")
    assert blend.names == ["stdlib"] and blend.paths == [None] and blend.vocab_size == BYTE_VOCAB_SIZE
    assert len(blend) > 100 and "json/__init__.py" in blend.datasets[0].names


# ---------------------------------------------------------------- greedy blending


@pytest.mark.parametrize("weights", [[7, 3], [0.5, 0.3, 0.2], [1, 1, 5]])
def test_shares_track_weights(weights):
    blend = _blend(weights)
    sampler = BlendSampler(blend, 8, seed=0)
    counts = dict.fromkeys(blend.names, 0)
    for n in range(1, 301):
        batch = sampler.next_batch()
        counts[sampler.last_source] += 1
        k = blend.names.index(sampler.last_source)
        assert ((batch["input_ids"] >= 30 * k) & (batch["input_ids"] < 30 * k + 30)).all()  # one source per batch
        for name, w in zip(blend.names, blend.weights):  # Megatron's greedy rule: within 1/2 for two sources, 1 for more
            assert abs(counts[name] - w * n) <= (0.5 if len(weights) == 2 else 1), (n, counts)
    assert sampler.batches == list(counts.values()) and sampler.tokens == [8 * c for c in counts.values()]


def test_ties_go_to_the_first_source():
    sampler = BlendSampler(_blend([1, 1]), 4, seed=0)
    order = []
    for _ in range(6):
        sampler.next_batch()
        order.append(sampler.last_source)
    assert order == ["s0", "s1"] * 3
    sampler = BlendSampler(_blend([1, 9]), 4, seed=0)  # argmax w (n + 1) - drawn: the first draw is the heavier source's
    order = []
    for _ in range(4):
        sampler.next_batch()
        order.append(sampler.last_source)
    assert order == ["s1"] * 4


def test_determinism_and_seeds():
    blend = _blend([0.6, 0.4])
    a, b, c = (BlendSampler(blend, 16, seed=s) for s in (3, 3, 4))
    xs, ys, zs = ([s.next_batch() for _ in range(12)] for s in (a, b, c))
    assert all(_same(x, y) for x, y in zip(xs, ys))
    assert not all(_same(x, z) for x, z in zip(xs, zs))
    # the second source's stream is not the first seed's: its own Sampler, its own seed
    assert BlendSampler(blend, 16, seed=3).samplers[1].seed not in (3, 4)


def test_resume_mid_stream():
    blend = _blend([0.5, 0.3, 0.2])
    full = BlendSampler(blend, 10, seed=7, mtp_depth=1)
    batches, sources = [], []
    for _ in range(25):
        batches.append(full.next_batch())
        sources.append(full.last_source)
    part = BlendSampler(blend, 10, seed=7, mtp_depth=1)
    for _ in range(11):
        part.next_batch()
    state = part.state_dict()
    assert any(s["offset"] > 0 for s in state["samplers"])  # resumes inside a document
    fresh = BlendSampler(blend, 10, seed=7, mtp_depth=1)
    fresh.load_state_dict(state)
    for batch, source in zip(batches[11:], sources[11:]):
        assert _same(fresh.next_batch(), batch) and fresh.last_source == source
    assert fresh.tokens_by_source() == full.tokens_by_source()


def test_state_of_another_blend_refused():
    blend = _blend([0.5, 0.5])
    sampler = BlendSampler(blend, 8, seed=1)
    sampler.next_batch()
    state = sampler.state_dict()
    with pytest.raises(ValueError, match=r"state: sources \['s0', 's1'\], this blend has \['s0', 'x'\]"):
        BlendSampler(_blend([0.5, 0.5], ["s0", "x"]), 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state: source 's0' has weight 0.5, this blend gives it 0.75"):
        BlendSampler(_blend([3, 1]), 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state: seed is 1, this sampler has 2"):
        BlendSampler(blend, 8, seed=2).load_state_dict(state)
    for weights in ([], [0.5], [0.5, 0.5, 0.5]):
        with pytest.raises(ValueError, match=rf"state: weights has {len(weights)} entries, this blend has 2 sources"):
            BlendSampler(blend, 8, seed=1).load_state_dict({**state, "weights": weights})
    with pytest.raises(ValueError, match=r"^state: expected a BlendSampler's \(or Sampler's\) state_dict\(\) \(a dict\), got NoneType"):
        BlendSampler(blend, 8, seed=2).load_state_dict(None)
    with pytest.raises(ValueError, match=r"state: a single Sampler's state, this blend has 2 sources"):
        BlendSampler(blend, 8, seed=1).load_state_dict(state["samplers"][0])
    with pytest.raises(ValueError, match="missing keys"):
        sampler.load_state_dict({"names": ["s0", "s1"]})
    other_docs = Blend([_source(0), _source(1, n_docs=4)], ["s0", "s1"], [1, 1])
    target = BlendSampler(other_docs, 8, seed=1)
    with pytest.raises(ValueError, match="data: source 's1': state: n_documents is 9, this sampler has 4"):
        target.load_state_dict(state)
    assert target.batches == [0, 0] and target.samplers[0].state_dict()["index"] == 0  # nothing changed


def test_a_blend_or_a_state_of_the_wrong_kinds_is_refused_by_name():
    """Source names that are not str were taken (checkpoints and metrics key the sources by
    name), weights given as a generator failed on len(), a source that is no TokenDataset on
    an attribute, and a state's None or non-number fields on TypeErrors; each is a ValueError
    naming the argument now, the sampler left as it was."""
    with pytest.raises(ValueError, match=r"^names: expected str source names, got \[1, 2\]"):
        Blend([_source(0), _source(1)], [1, 2], [1, 1])
    with pytest.raises(ValueError, match=r"^datasets: expected TokenDatasets, got \['list'\]"):
        Blend([[1, 2]], ["a"], [1])
    assert Blend([_source(0), _source(1)], ["a", "b"], (w for w in (3, 1))).weights == [0.75, 0.25]
    sampler = BlendSampler(_blend([0.5, 0.5]), 8, seed=1)
    state = sampler.state_dict()
    for key, value, match in [("weights", [0.5, "x"], r"state: weights expected numbers, got \[0.5, 'x'\]"),
                              ("weights", [True, 0.5], r"state: weights expected numbers, got \[True, 0.5\]"),
                              ("weights", None, "state: weights expected a list, got NoneType"),
                              ("samplers", None, "state: samplers expected a list, got NoneType"),
                              ("batches", None, "state: batches expected a list, got NoneType")]:
        with pytest.raises(ValueError, match=f"^{match}$"):
            sampler.load_state_dict({**state, key: value})
    assert sampler.state_dict() == state


# ---------------------------------------------------------------- validation


def test_validation_batches():
    blend = Blend([_synthetic(seed=1), _synthetic(seed=2)], ["a", "b"], [2, 1])
    _, val = blend.split(40)
    v1, v2 = val.validation_batches(6, 5, mtp_depth=1), val.validation_batches(6, 5, mtp_depth=1)
    assert len(v1) == 5 and all(_same(x, y) for x, y in zip(v1, v2))
    sources = val.validation_sources(5)
    assert sources == ["a", "b", "a", "a", "b"]
    for name, dataset in zip(val.names, val.datasets):  # each source's first batches, in order
        mine = [b for b, s in zip(v1, sources) if s == name]
        assert all(_same(x, y) for x, y in zip(mine, dataset.validation_batches(6, len(mine), mtp_depth=1)))


def test_validation_errors():
    blend = Blend([_synthetic(seed=1), _synthetic(n_docs=2, seed=2)], ["big", "tiny"], [1, 1])
    _, val = blend.split(30)
    assert len(val.datasets[0]) and not len(val.datasets[1])
    with pytest.raises(ValueError, match="data: source 'tiny': no validation documents"):
        val.validation_batches(4, 2)
    assert len(val.validation_batches(4, 1)) == 1  # one batch: only 'big' is drawn
    with pytest.raises(ValueError, match="data: source 'big': n_batches: 100 batches"):
        blend.validation_batches(64, 200)


# ---------------------------------------------------------------- specs


def test_json_spec(tmp_path):
    _write_tokens(tmp_path / "data" / "web.u16", [5, 6, 0, 7, 0])
    _write_tokens(tmp_path / "data" / "code.u16", [3, 0, 8, 9, 0, 4])
    spec = tmp_path / "blends" / "mix.json"
    spec.parent.mkdir()
    spec.write_text(json.dumps([
        {"path": "../data/web.u16", "weight": 3, "separator": 0, "vocab_size": 10},
        {"name": "code", "path": str(tmp_path / "data" / "code.u16"), "weight": 1, "separator": 0, "vocab_size": 12},
    ]))
    entries = parse_blend(str(spec))
    assert [e["name"] for e in entries] == ["web.u16", "code"]
    assert entries[0]["path"] == str(spec.parent / "../data/web.u16") and entries[0]["weight"] == 3.0
    assert entries[1]["dtype"] is None and set(entries[1]) == {"name", "path", "weight", "separator", "dtype", "vocab_size"}
    blend = load_blend(spec)
    assert blend.names == ["web.u16", "code"] and blend.weights == [0.75, 0.25] and blend.vocab_size == 12
    assert [blend.datasets[1].document(i).tolist() for i in range(3)] == [[3, 0], [8, 9, 0], [4]]


def test_short_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_tokens(tmp_path / "data" / "a.u16", [1, 2, 0])
    _write_tokens(tmp_path / "data" / "b.u16", [3, 0])
    entries = parse_blend("0.7:data/a.u16, 0.3:data/b.u16")
    assert [(e["name"], e["path"], e["weight"]) for e in entries] == [("a.u16", "data/a.u16", 0.7), ("b.u16", "data/b.u16", 0.3)]
    blend = load_blend("0.7:data/a.u16,0.3:data/b.u16", separator=0, vocab_size=5)
    assert blend.names == ["a.u16", "b.u16"] and blend.paths == ["data/a.u16", "data/b.u16"]
    # a plain path, with or without a trailing slash, is one source of weight 1
    assert [(e["name"], e["weight"]) for e in parse_blend("data/a.u16")] == [("a.u16", 1.0)]
    assert [(e["name"], e["path"]) for e in parse_blend("data/")] == [("data", "data/")]


def test_duplicate_names_refused(tmp_path):
    with pytest.raises(ValueError, match=r"duplicate source names \['a.u16'\]"):
        parse_blend("1:x/a.u16,1:y/a.u16")
    spec = tmp_path / "b.json"
    spec.write_text(json.dumps([{"path": "x", "weight": 1, "name": "n"}, {"path": "y", "weight": 1, "name": "n"}]))
    with pytest.raises(ValueError, match=r"duplicate source names \['n'\]"):
        parse_blend(spec)


# ---------------------------------------------------------------- sources: .npy and indexed token files


@pytest.mark.parametrize("dtype", ["int32", "uint16", "int64"])
def test_npy_source(tmp_path, dtype):
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([4, 5, 1, 6, 1, 7], dtype=dtype))
    for ds in (load_npy(path, separator=1, vocab_size=8), load_corpus(path, separator=1, vocab_size=8)):
        assert isinstance(ds.data, np.memmap) and ds.vocab_size == 8
        assert [ds.document(i).tolist() for i in range(len(ds))] == [[4, 5, 1], [6, 1], [7]]
    assert load_blend(f"1:{path}", separator=1, vocab_size=8).names == ["tokens.npy"]


def test_npy_errors(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.array([4, -3, 1], dtype=np.int32))
    with pytest.raises(ValueError, match="path: token -3 at index 1 of .*t.npy.* is negative"):
        load_npy(path, separator=1, vocab_size=8)
    np.save(path, np.array([4, 9, 1], dtype=np.int32))
    with pytest.raises(ValueError, match="vocab_size: token 9 at index 1 of .*t.npy"):
        load_npy(path, separator=1, vocab_size=8)
    with pytest.raises(ValueError, match="separator"):
        load_npy(path, separator=8, vocab_size=8)
    with pytest.raises(ValueError, match="dtype: 'uint16' was given, .*holds int32"):
        load_npy(path, separator=1, vocab_size=10, dtype="uint16")
    with pytest.raises(ValueError, match="separator, vocab_size: required for the .npy file"):
        load_corpus(path)
    np.save(path, np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="holds a 2-D int32 array; expected a 1-D integer array"):
        load_npy(path, separator=1, vocab_size=8)
    np.save(path, np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="holds a 1-D float32 array"):
        load_npy(path, separator=1, vocab_size=8)
    np.save(path, np.zeros(0, dtype=np.int32))
    with pytest.raises(ValueError, match="t.npy.* is empty"):
        load_npy(path, separator=1, vocab_size=8)
    path.write_bytes(b"\x93NUMPY\x01\x00")  # a header cut short
    with pytest.raises(ValueError, match="is not a .npy array of token ids"):
        load_npy(path, separator=1, vocab_size=8)


def test_what_is_no_npy_array_is_named_so(tmp_path):
    """A file named .npy that np.save did not write was refused with numpy's advice to
    unpickle it ("If you trust the file you can load it unsafely using the allow_pickle=
    keyword"); an archive of np.savez (.npz) was read as a raw token file ("dtype: cannot
    infer it from the suffix")."""
    junk = tmp_path / "t.npy"
    for content in (b"not an array", b"", b"\x80\x04K\x01."):  # text, nothing, a real pickle
        junk.write_bytes(content)
        for load in (lambda: load_npy(junk, separator=1, vocab_size=8), lambda: load_corpus(junk, separator=1, vocab_size=8)):
            with pytest.raises(ValueError, match=r"^path: '.*t.npy' is not a .npy array \(it does not start as np.save's files do\): "
                                                 r"save the token ids with np.save$") as refused:
                load()
            assert "pickle" not in str(refused.value)
    archive = tmp_path / "t.npz"
    np.savez(archive, tokens=np.array([4, 5, 1], dtype=np.int32))
    misnamed = tmp_path / "archive.npy"
    misnamed.write_bytes(archive.read_bytes())
    for load in (lambda: load_corpus(archive, separator=1, vocab_size=8), lambda: load_corpus(archive),
                 lambda: load_npy(misnamed, separator=1, vocab_size=8), lambda: load_blend(str(archive), separator=1, vocab_size=8)):
        with pytest.raises(ValueError, match=r"path: '.*t.npz' is a numpy archive \(np.savez\), which is not read: save the one array of "
                                             r"token ids with np.save \(a .npy file\)|path: '.*archive.npy' is a numpy archive"):
            load()


def test_json_with_a_byte_order_mark_is_read(tmp_path):
    """A blend file or a token file's index saved with a UTF-8 BOM (a Windows editor) was
    refused with json's own words ("Unexpected UTF-8 BOM (decode using utf-8-sig)")."""
    index = {"documents": 2, "tokens": 4, "dtype": "uint16", "separator": 0, "vocab_size": 10}
    path = _write_tokens(tmp_path / "p.u16", [5, 0, 7, 0])
    (tmp_path / "p.u16.index.json").write_text(json.dumps(index), encoding="utf-8-sig")
    assert load_token_file(path).vocab_size == 10
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps([{"path": "p.u16", "weight": 1}]), encoding="utf-8-sig")
    assert load_blend(spec).datasets[0].document(1).tolist() == [7, 0]


def test_index_defaults(tmp_path):
    index = {"documents": 3, "tokens": 6, "dtype": "uint32", "separator": 0, "vocab_size": 50}
    path = _write_tokens(tmp_path / "prepared.bin", [5, 0, 49, 7, 0, 8], "uint32", index)
    for ds in (load_token_file(path), load_corpus(path), load_blend(str(path)).datasets[0],
               load_token_file(path, separator=0, vocab_size=50, dtype="uint32")):
        assert ds.vocab_size == 50 and [ds.document(i).tolist() for i in range(3)] == [[5, 0], [49, 7, 0], [8]]
    assert load_token_file(path, vocab_size=64).vocab_size == 64  # a padded vocabulary still holds every id


def test_index_conflicts(tmp_path):
    index = {"documents": 3, "tokens": 6, "dtype": "uint16", "separator": 0, "vocab_size": 50}
    path = _write_tokens(tmp_path / "p.u16", [5, 0, 49, 7, 0, 8], "uint16", index)
    with pytest.raises(ValueError, match=r"separator: 7 was given, the index .*p.u16.index.json.* says 0"):
        load_token_file(path, separator=7)
    with pytest.raises(ValueError, match="vocab_size: 40 was given, the index .* says 50"):
        load_corpus(path, vocab_size=40)
    with pytest.raises(ValueError, match="dtype: 'uint32' was given, the index .* says 'uint16'"):
        load_token_file(path, dtype="uint32")
    with pytest.raises(ValueError, match="data: source 'p.u16' .*p.u16.: separator: 7 was given"):
        load_blend(f"1:{path}", separator=7)
    for field, bad in (("vocab_size", "64"), ("separator", -1), ("vocab_size", 2.5)):  # a JSON entry's string: named, not a TypeError
        with pytest.raises(ValueError, match=f"data: source 'p.u16' .*p.u16.: {field}: expected an int|data: source 'p.u16' .*: {field}: expected >= 0"):
            load_blend(f"1:{path}", **{field: bad})
    # a dtype for every source (--data_dtype) against a token file's suffix: refused, not read as the other dtype
    other = _write_tokens(tmp_path / "web.u32", [464, 3290, 0, 40, 0], "uint32")
    with pytest.raises(ValueError, match=r"data: source 'web.u32' .*: dtype: 'uint16' was given, the suffix of .*web.u32' means 'uint32'"):
        load_blend(f"0.5:{path},0.5:{other}", separator=0, vocab_size=50304, dtype="uint16")
    for stale, message in (({"tokens": 7}, "holds 6 tokens, its index says 7"), ({"documents": 2}, "holds 3 documents, its index says 2")):
        _write_tokens(path, [5, 0, 49, 7, 0, 8], "uint16", {**index, **stale})
        with pytest.raises(ValueError, match=f"{message} \\(a stale index"):
            load_token_file(path)
    (tmp_path / "p.u16.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index .* is not valid JSON"):
        load_token_file(path)
    (tmp_path / "p.u16.index.json").write_text(json.dumps({"tokens": 6}))
    with pytest.raises(ValueError, match=r"lacks the fields \['documents', 'dtype', 'separator', 'vocab_size'\]"):
        load_token_file(path)
    # fields of another type: a null separator was read as "none given", a "2" as a stale count, an int loss_mask a TypeError
    for field, value, expected in (("separator", None, "an int >= 0"), ("documents", "3", "an int >= 0"), ("tokens", True, "an int >= 0"),
                                   ("vocab_size", 0, "an int >= 1"), ("loss_mask", 1, "a file name or null")):
        _write_tokens(path, [5, 0, 49, 7, 0, 8], "uint16", {**index, field: value})
        with pytest.raises(ValueError, match=rf"^path: the index .*p.u16.index.json' holds {field} = {value!r}, expected {expected}"):
            load_token_file(path)


# ---------------------------------------------------------------- bad inputs name their source


def test_bad_weights(tmp_path):
    with pytest.raises(ValueError, match=r"data: source 'code.bin' \(path/to/code.bin\): weight must be > 0, got 0"):
        parse_blend("0:path/to/code.bin,1:b")
    with pytest.raises(ValueError, match=r"data: source 'b' \(b\): weight must be > 0, got -1"):
        parse_blend("1:a,-1:b")
    with pytest.raises(ValueError, match=r"data: 'heavy:a' does not exist as a path, and is not a blend of WEIGHT:PATH entries: "
                                         r"'heavy' \(before the ':' of 'heavy:a'\) is not a number"):
        parse_blend("heavy:a")  # a missing path with a colon, or a weight that is no number: either way said as both
    with pytest.raises(ValueError, match="data: source 'a' .*weight must be a finite number, got inf"):
        parse_blend("inf:a")
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps([{"name": "code", "path": "c.bin", "weight": "0.5"}]))
    with pytest.raises(ValueError, match=r"data: source 'code' \(.*c.bin\): weight must be a finite number, got '0.5'"):
        parse_blend(spec)


def test_a_missing_path_with_a_colon_is_named_a_missing_path(tmp_path, monkeypatch):
    """A path that holds a ':' and does not exist (a typo, a Windows drive) was read as
    WEIGHT:PATH and refused as a bad weight of a source named after its tail: "source
    'there.u16' (there.u16): weight must be a finite number, got 'blend/no'"."""
    monkeypatch.chdir(tmp_path)
    for spec, weight, item in (("blend/no:there.u16", "blend/no", "blend/no:there.u16"), ("C:\\data\\x.u16", "C", "C:\\data\\x.u16"),
                               ("1:a.u16,70%:b.u16", "70%", "70%:b.u16")):
        with pytest.raises(ValueError, match=rf"^data: {re.escape(repr(spec))} does not exist as a path, and is not a blend of "
                                             rf"WEIGHT:PATH entries: {re.escape(repr(weight))} \(before the ':' of "
                                             rf"{re.escape(repr(item))}\) is not a number; e.g. '0.7:data/code.u32,0.3:data/web.u32'$"):
            load_blend(spec)
    _write_tokens(tmp_path / "blend" / "no:there.u16", [1, 0, 2])  # one that exists is one source
    assert load_blend("blend/no:there.u16", separator=0, vocab_size=4).names == ["no:there.u16"]


def test_a_weight_whose_share_is_0_is_refused(tmp_path):
    a, b = _write_tokens(tmp_path / "a.u16", [1, 0, 2]), _write_tokens(tmp_path / "b.u16", [3, 0])
    with pytest.raises(ValueError, match=r"^weights: \[1e-300, 1e\+300\] give 'a.u16' a share of 0 once normalised"):
        load_blend(f"1e-300:{a},1e300:{b}", separator=0, vocab_size=4)


def test_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="spec: expected a blend"):
        parse_blend("  ")
    with pytest.raises(ValueError, match="blend entry 'b' of '0.5:a,b': expected WEIGHT:PATH"):
        parse_blend("0.5:a,b")
    with pytest.raises(ValueError, match="blend entry '0.5:' .*expected WEIGHT:PATH"):
        parse_blend("0.5:")
    with pytest.raises(FileNotFoundError, match="blend file .*nope.json.* does not exist"):
        parse_blend(str(tmp_path / "nope.json"))
    spec = tmp_path / "b.json"
    for content, message in (("[{", "is not valid JSON"), ("{}", "expected a non-empty JSON list"), ("[]", "expected a non-empty JSON list"),
                             ('[{"path": "a"}]', r"entry 0: missing \['weight'\]"),
                             ('[{"path": "a", "weight": 1, "wieght": 2}]', r"entry 0: unknown keys \['wieght'\]"),
                             ('[{"path": 3, "weight": 1}]', "path must be a non-empty string, got 3")):
        spec.write_text(content)
        with pytest.raises(ValueError, match=message):
            parse_blend(spec)


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data: source 'nope.u16' \(.*nope.u16\): path: .* does not exist"):
        load_blend(f"1:{tmp_path / 'nope.u16'},1:{tmp_path}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="data: source 'empty' .*no non-empty files"):
        load_blend(str(tmp_path / "empty"))
    big = _write_tokens(tmp_path / "big.u16", [1, 0, 12])
    with pytest.raises(ValueError, match="data: source 'big.u16' .*vocab_size: token 12 at index 2"):
        load_blend(str(big), separator=0, vocab_size=10)
    with pytest.raises(ValueError, match="data: source 'big.u16' .*separator, vocab_size: required"):
        load_blend(str(big))
    blend = Blend([_synthetic(), _synthetic(n_docs=1)], ["texts", "bytes"], [1, 1])
    with pytest.raises(ValueError, match="data: source 'bytes': no training documents after the split .val_percent=90 puts all 1 of its documents"):
        blend.split(90)  # doc0.txt, the one document of "bytes", falls in bucket 80
    with pytest.raises(ValueError, match="data: source 'tokens': dataset: has no documents"):
        BlendSampler(Blend([_source(0).subset(np.array([], dtype=np.int64))], ["tokens"], [1]), 4, seed=0)


def test_vocabularies():
    assert Blend([_source(0, vocab_size=100), _source(1, vocab_size=120)], ["a", "b"], [1, 1]).vocab_size == 120
    texts, tokens = _synthetic(), _source(0, vocab_size=BYTE_VOCAB_SIZE + 1)
    with pytest.raises(ValueError, match="data: source 'text' holds byte tokens .vocab_size 258. and data: source 'ids' "
                                         "token ids of vocab_size 259"):
        Blend([texts, tokens], ["text", "ids"], [1, 1])
    assert Blend([texts, _synthetic(seed=3)], ["a", "b"], [1, 1]).vocab_size == BYTE_VOCAB_SIZE
    # token ids below the byte vocab_size are a tokenizer's all the same, in either order (byte_tokens
    # would be the first source's word)
    narrow = _source(0, vocab_size=BYTE_VOCAB_SIZE)
    with pytest.raises(ValueError, match="data: source 'text' holds byte tokens .vocab_size 258. and data: source 'ids' "
                                         "token ids of vocab_size 258"):
        Blend([texts, narrow], ["text", "ids"], [1, 1])
    with pytest.raises(ValueError, match="data: source 'text' holds byte tokens"):
        Blend([narrow, texts], ["ids", "text"], [1, 1])
    # two sources with an EOS each (bytes read in code) of two vocabularies: the same id means two things too
    other_bytes = TokenDataset(texts.data, texts.starts, texts.lengths, None, vocab_size=BYTE_VOCAB_SIZE + 2, eos=texts.eos)
    with pytest.raises(ValueError, match="data: source 'text' holds byte tokens .vocab_size 258. and data: source 'wide' "
                                         "token ids of vocab_size 260"):
        Blend([texts, other_bytes], ["text", "wide"], [1, 1])


def test_blend_constructor_errors():
    with pytest.raises(ValueError, match="names: expected unique"):
        Blend([_source(0), _source(1)], ["a", "a"], [1, 1])
    with pytest.raises(ValueError, match="weights: expected finite numbers > 0"):
        Blend([_source(0)], ["a"], [0])
    with pytest.raises(ValueError, match="weights: expected finite numbers > 0, got .True, 2."):  # not a weight of 1
        Blend([_source(0), _source(1)], ["a", "b"], [True, 2])
    with pytest.raises(ValueError, match="one entry per source"):
        Blend([_source(0)], ["a", "b"], [1])
    with pytest.raises(ValueError, match=r"weights: their sum overflows a float, got \[1e\+308, 1e\+308\]"):
        Blend([_source(0), _source(1)], ["a", "b"], [1e308, 1e308])
    assert Blend([_source(0), _source(1)], ["a", "b"], [1e307, 3e307]).weights == [0.25, 0.75]
    # a weight > 0 whose share underflows to 0.0 beside the others: the source was silently never drawn
    with pytest.raises(ValueError, match=r"^weights: \[1e-300, 1e\+300\] give 'a' a share of 0 once normalised \(it would never be drawn\)"):
        Blend([_source(0), _source(1)], ["a", "b"], [1e-300, 1e300])
    with pytest.raises(ValueError, match=r"^weights: \[1e\+300, 1e-300\] give 'tiny' a share of 0"):
        Blend([_source(0), _source(1)], ["huge", "tiny"], [1e300, 1e-300])
    assert Blend([_source(0), _source(1)], ["a", "b"], [1e-300, 1e-290]).weights[0] > 0  # tiny both: shares fine
    assert Blend([_source(0), _source(1)], ["a", "b"], [np.float32(0.25), np.int64(3)]).weights == [0.25 / 3.25, 3 / 3.25]  # numpy's numbers
    with pytest.raises(ValueError, match="weights: expected finite numbers > 0"):
        Blend([_source(0)], ["a"], [np.bool_(True)])
    with pytest.raises(ValueError, match="blend: expected a Blend"):
        BlendSampler(_source(0), 4, seed=0)
    with pytest.raises(ValueError, match="seed"):
        BlendSampler(_blend([1]), 4, seed=-1)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        BlendSampler(_blend([1]), 0, seed=0)
    assert torch.is_tensor(BlendSampler(_blend([1]), 4, seed=0).next_batch()["input_ids"])


def test_token_file_options_on_a_directory_are_refused(tmp_path):
    """A directory is bytes: a separator, vocab_size or dtype its entry sets (or load_corpus
    is given) was ignored without a word; the blend-wide ones still apply to the token files
    of a blend (train_moe's --separator)."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"^separator, vocab_size: '.*texts' is a directory, read as the bytes of its text files "
                                         r"\(vocab_size 258, the EOS 256 after each file\): \{'separator': 5, 'vocab_size': 7\} apply to token files only"):
        load_corpus(texts, separator=5, vocab_size=7)
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps([{"path": str(texts), "weight": 1, "dtype": "uint32"}]))
    with pytest.raises(ValueError, match=r"data: source 'texts' .*: dtype: '.*texts' is a directory"):
        load_blend(spec)
    assert load_blend(str(texts), separator=0, vocab_size=300).datasets[0].vocab_size == 258  # blend-wide: the token files'


def test_a_blend_of_many_token_files_opens_them_under_a_low_file_limit(tmp_path):
    """Each memory-mapped source holds its file open: a blend of 1200 shards died at the common
    `ulimit -n` of 1024 with a bare "[Errno 24] Too many open files". load_blend raises the
    soft limit toward the hard one; where the hard one is too low, a ValueError says why."""
    import json
    import subprocess
    import sys

    for i in range(150):
        np.array([1, 2, 3, 0, 4, 5, 0], dtype=np.uint16).tofile(tmp_path / f"s{i}.u16")
    (tmp_path / "blend.json").write_text(json.dumps([{"path": f"s{i}.u16", "weight": 1.0} for i in range(150)]))
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))\n"
            "from fmoe.train.data import load_blend\n"
            "try:\n"
            f"    print(len(load_blend({str(tmp_path / 'blend.json')!r}, separator=0, vocab_size=8).names))\n"
            "except ValueError as err:\n"
            "    print(err)\n")
    hard = resource_hard_limit()
    raised = subprocess.run([sys.executable, "-c", code, "64", str(hard)], capture_output=True, text=True, timeout=300)
    assert raised.returncode == 0 and raised.stdout == "150\n", raised.stdout + raised.stderr[-2000:]
    low = subprocess.run([sys.executable, "-c", code, "96", "96"], capture_output=True, text=True, timeout=300)
    assert low.returncode == 0 and "too many open files: each memory-mapped source holds its file open (and its loss mask's), and the " \
        "blend's 150 sources need more than this process may open (96, `ulimit -n`): raise the limit, or prepare the sources into fewer " \
        "token files" in low.stdout, low.stdout + low.stderr[-2000:]


def resource_hard_limit() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def test_a_blend_s_next_layout_draws_as_its_next_batch():
    """BlendSampler.next_layout(): the same source as next_batch() would draw, the same
    draw counts and state after it, and the drawn batch's layout."""
    from fmoe.train.data import batch_layout

    built, counted = (BlendSampler(_blend([0.5, 0.3, 0.2]), 7, seed=1, mtp_depth=2) for _ in range(2))
    for i in range(30):
        batch = built.next_batch()
        layout = counted.next_layout() if i % 2 else batch_layout(counted.next_batch())
        assert counted.last_source == built.last_source
        assert _same(layout, batch_layout(batch))
        assert counted.state_dict() == built.state_dict()
    assert all(built.tokens)  # every source drawn


def test_validation_batches_past_the_blend_s_tokens_are_refused_before_their_schedule():
    """More batches than the blend has tokens: refused at once (the greedy schedule of 1e12
    draws was built first: hours)."""
    blend = _blend([0.5, 0.5])
    with pytest.raises(ValueError, match=rf"n_batches: 1000000000000 batches of 8 tokens need 8000000000000 tokens, the blend has {blend.n_tokens}"):
        blend.validation_batches(8, 10**12)
