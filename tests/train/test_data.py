"""fmoe.train.data: corpora, byte tokens, packing, MTP targets, the resumable sampler."""

import gzip
import os
import pathlib
import re
import sysconfig
import warnings

import numpy as np
import pytest
import torch

from fmoe.train.data import (
    BYTE_VOCAB_SIZE, EOS, IGNORE_INDEX, PAD, Sampler, TokenDataset, batch_layout, decode_text, encode_text,
    list_text_files, load_corpus, load_stdlib, load_text_dir, load_token_file, make_batch,
)


@pytest.fixture(scope="module")
def stdlib():
    return load_stdlib()


def _synthetic(n_docs=23, seed=0, max_len=40):
    """Byte-token documents of random lengths 1..max_len; document i holds only the byte
    value i (so every token names its document), plus the virtual EOS."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, n_docs)
    data = np.concatenate([np.full(n, i, dtype=np.uint8) for i, n in enumerate(lengths)])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return TokenDataset(data, starts, lengths, [f"doc{i}.txt" for i in range(n_docs)], vocab_size=BYTE_VOCAB_SIZE, eos=EOS)


def _sequences(batch):
    cu = batch["cu_seqlens"].tolist()
    return [(s, e) for s, e in zip(cu[:-1], cu[1:])]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a.keys())


# ---------------------------------------------------------------- corpora and byte tokens


def test_constants():
    assert (EOS, PAD, BYTE_VOCAB_SIZE) == (256, 257, 258)


def test_stdlib_corpus(stdlib):
    assert len(stdlib) > 100 and stdlib.n_tokens > 1_000_000
    assert stdlib.names == sorted(stdlib.names)
    assert not any(part in ("site-packages", "test", "tests") for n in stdlib.names for part in n.split("/"))
    # the definition: every *.py file below the stdlib root outside those directories (the walk never enters them)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    want = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if p.is_file() and not {"site-packages", "test", "tests", "idle_test"} & set(p.relative_to(root).parts))
    assert stdlib.names == [n for n in want if (root / n).stat().st_size]
    i = stdlib.names.index("json/__init__.py")
    doc = stdlib.document(i)
    assert doc[-1] == EOS and int(doc[:-1].max()) < 256 and doc.shape == (stdlib.doc_len(i),)
    assert "import" in decode_text(doc)


def test_stdlib_split_deterministic(stdlib):
    train, val = stdlib.split(10)
    train2, val2 = load_stdlib().split(10)
    assert train.names == train2.names and val.names == val2.names
    assert not set(train.names) & set(val.names)
    assert sorted(train.names + val.names) == stdlib.names
    assert 0 < len(val) < len(train)


def test_file_names_that_are_not_utf8_split_as_the_others(tmp_path):
    """A file name of bytes that are not UTF-8 (legal on Linux; Python keeps them as
    surrogates): the corpus loads and splits, stably, and the name keeps its bytes."""
    for i in range(20):
        (tmp_path / f"{i}.txt").write_text(f"document {i}")
    odd = os.fsencode(tmp_path) + b"/b\xffd.txt"
    with open(odd, "wb") as f:
        f.write(b"bad name, good text")
    corpus = load_text_dir(tmp_path)
    train, val = corpus.split(30)
    again_train, again_val = load_text_dir(tmp_path).split(30)
    assert train.names == again_train.names and val.names == again_val.names and len(train) + len(val) == 21
    assert "b\udcffd.txt" in train.names + val.names and os.fsencode("b\udcffd.txt") == b"b\xffd.txt"


def test_token_dataset_refuses_spans_outside_its_data_and_an_eos_outside_its_vocabulary():
    data = np.arange(1, 6, dtype=np.uint16)
    for starts, lengths, span in (([0, 3], [3, 3], r"\[3, 6\)"), ([-1], [2], r"\[-1, 1\)"), ([0, 2], [2, -1], r"\[2, 1\)")):
        with pytest.raises(ValueError, match=rf"starts, lengths: document \d spans {span}, not inside the data's 5 tokens"):
            TokenDataset(data, np.array(starts), np.array(lengths), None, vocab_size=10, eos=None)
    with pytest.raises(ValueError, match=r"eos: expected 0..9, got 10"):
        TokenDataset(data, np.array([0]), np.array([5]), None, vocab_size=10, eos=10)
    # arrays of floats were cut to ints ([1.9, 2.5, 3.99] read as [1, 2, 3]); a label mask that is no array named
    for name, arrays in (("data", (data.astype(float), [0], [5])), ("starts", (data, np.array([0.0, 2.7]), [2, 1])),
                         ("lengths", (data, [0, 2], np.array([2.9, 1.2])))):
        with pytest.raises(ValueError, match=f"^{name}: expected an integer array, got float64"):
            TokenDataset(*(np.asarray(a) for a in arrays), None, vocab_size=10, eos=None)
    with pytest.raises(ValueError, match=r"^label_mask: expected a 1-D array of the data's 5 tokens, got list"):
        TokenDataset(data, np.array([0]), np.array([5]), None, vocab_size=10, eos=None, label_mask=[True] * 5)
    assert TokenDataset(data, np.array([0, 3]), np.array([3, 2]), None, vocab_size=10, eos=9).n_tokens == 7
    # the constructor does not scan its data: a document's ids are checked as it is read, before a batch holds them
    ds = TokenDataset(np.array([5, 900, 7], dtype=np.uint16), np.array([0, 2]), np.array([2, 1]), None, vocab_size=10, eos=None)
    assert ds.document(1).tolist() == [7]
    with pytest.raises(ValueError, match=r"vocab_size: document 0 holds token 900, not in 0..9"):
        ds.document(0)
    with pytest.raises(ValueError, match=r"vocab_size: document 0 holds token 900"):
        Sampler(ds, 3, seed=0, shuffle=False).next_batch()
    edge = TokenDataset(np.array([9, 10], dtype=np.uint16), np.array([0, 1]), np.array([1, 1]), None, vocab_size=10, eos=None)
    assert edge.document(0).tolist() == [9]  # the largest id, and the first one past it
    with pytest.raises(ValueError, match=r"vocab_size: document 1 holds token 10, not in 0..9"):
        edge.document(1)


def test_a_document_span_outside_the_document_is_refused_by_name():
    """document(i, begin, end) read the document before's tokens for a negative begin, gave
    tokens and mask of other lengths for an end past the document, a document from the end
    for a negative i, and numpy's or torch's errors otherwise; make_batch named a numpy mask's
    shape as what was wrong. doc_len(i) checks i the same way."""
    ds = TokenDataset(np.arange(20, dtype=np.int64), np.array([0, 10]), np.array([10, 10]), None, vocab_size=100, eos=99)
    assert ds.document(1, 2).tolist() == [12, 13, 14, 15, 16, 17, 18, 19, 99] and ds.document_mask(1, 2, 11).shape == (9,)
    assert ds.document(1, 11).tolist() == [] and ds.document(np.int64(0), 0, 1).tolist() == [0]
    for args, match in [((1, -3), r"^begin: expected 0..11, got -3$"), ((1, 2, 100), r"^end: expected 2..11, got 100$"),
                        ((1, 5, 2), r"^end: expected 5..11, got 2$"), ((2,), r"^i: expected 0..1, got 2$"),
                        ((-1,), r"^i: expected 0..1, got -1$"), ((0, 12), r"^begin: expected 0..11, got 12$"),
                        ((0, 1.5), r"^begin: expected an int")]:
        for read in (ds.document, ds.document_mask):
            with pytest.raises(ValueError, match=match):
                read(*args)
    assert [ds.doc_len(0), ds.doc_len(np.int64(1))] == [11, 11]
    for i in (-1, 2):  # doc_len(-1) gave the last document's length
        with pytest.raises(ValueError, match=rf"^i: expected 0..1, got {i}$"):
            ds.doc_len(i)
    with pytest.raises(ValueError, match=r"^token_mask: expected a tensor of input_ids' shape \(10,\), got ndarray$"):
        make_batch(torch.arange(10), torch.tensor([0, 10]), token_mask=np.ones(10, dtype=bool))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_make_batch_takes_the_unsigned_ids_of_a_token_file(dtype):
    """torch.from_numpy of a .u16 / .u32 file's slice: torch's min lacks these dtypes ("min_all"
    not implemented for 'UInt16'); the ids are read as int64, their largest value included."""
    ids = torch.from_numpy(np.array([5, 6, 0, 7, 65535], dtype={torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}[dtype]))
    batch = make_batch(ids, torch.tensor([0, 3, 5]))
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].tolist() == [5, 6, 0, 7, 65535]
    assert batch["labels"].tolist() == [6, 0, IGNORE_INDEX, 65535, IGNORE_INDEX]


def test_byte_round_trip():
    text = "héllo wörld\n\tλ → 🙂 end"
    ids = encode_text(text)
    assert ids.dtype == torch.int64 and ids.tolist() == list(text.encode())
    assert decode_text(ids) == text
    assert decode_text(torch.cat([ids, torch.tensor([EOS, PAD])])) == text
    assert encode_text(b"").shape == (0,) and decode_text([]) == ""
    with pytest.raises(ValueError, match="ids"):
        decode_text([1, BYTE_VOCAB_SIZE])
    with pytest.raises(ValueError, match="text"):
        encode_text(5)
    for ids in (torch.tensor([104.7]), [104.0], torch.tensor([True])):  # not 'h'
        with pytest.raises(ValueError, match="ids: expected integer byte tokens, got dtype torch.(float|bool)"):
            decode_text(ids)


# ---------------------------------------------------------------- packing and targets


@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_packing_never_crosses_documents(tokens):
    ds = _synthetic()
    sampler = Sampler(ds, tokens, seed=3)
    stream = []  # the tokens of every sequence, in order
    for _ in range(12):
        b = sampler.next_batch()
        ids, labels, mask, pos = b["input_ids"], b["labels"], b["loss_mask"], b["positions"]
        assert b["cu_seqlens"].dtype == torch.int32 and ids.shape == (tokens,) and ids.dtype == torch.int64
        assert labels.dtype == torch.int64 and mask.dtype == torch.bool and pos.dtype == torch.int64
        for s, e in _sequences(b):
            assert e > s
            seq = ids[s:e]
            body = seq[seq != EOS]
            assert body.numel() == 0 or (body == body[0]).all()  # one document
            assert (seq[:-1] != EOS).all()  # EOS only ends a document
            assert pos[s:e].tolist() == list(range(e - s))
            assert labels[s:e - 1].tolist() == seq[1:].tolist() and mask[s:e - 1].all()
            assert labels[e - 1] == IGNORE_INDEX and not mask[e - 1]
            stream.append(seq)
    # concatenated, the pieces are whole documents followed by EOS, in the epoch's order
    flat = torch.cat(stream)
    epochs = range(flat.numel() // ds.n_tokens + 1)
    expected = torch.cat([ds.document(d) for e in epochs for d in sampler._epoch_order(e).tolist()])
    assert torch.equal(flat, expected[:flat.numel()])


def test_mtp_targets_hand_example():
    ids = torch.tensor([10, 11, 12, 20, 21])
    b = make_batch(ids, torch.tensor([0, 3, 5]), mtp_depth=2)
    assert b["labels"].tolist() == [11, 12, -100, 21, -100]
    assert b["loss_mask"].tolist() == [True, True, False, True, False]
    assert b["positions"].tolist() == [0, 1, 2, 0, 1]
    for key in ("mtp_input_ids", "mtp_positions", "mtp_labels", "mtp_loss_mask"):
        assert b[key].shape == (2, 5)
    assert b["mtp_input_ids"].tolist() == [[11, 12, 0, 21, 0], [12, 0, 0, 0, 0]]
    assert b["mtp_positions"].tolist() == [[1, 2, 0, 1, 0], [2, 0, 0, 0, 0]]
    assert b["mtp_labels"].tolist() == [[12, -100, -100, -100, -100], [-100] * 5]
    assert b["mtp_loss_mask"].tolist() == [[True, False, False, False, False], [False] * 5]
    assert "mtp_labels" not in make_batch(ids, torch.tensor([0, 5])).keys()
    # what make_batch is given is checked there, on the host, by name (no truncated ids, no wrapped bounds)
    for args, message in (((ids.float(), torch.tensor([0, 5])), r"input_ids: expected \[T\] integer token ids, got torch.float32 \[5\]"),
                          ((ids - 11, torch.tensor([0, 5])), "input_ids: expected token ids >= 0, got -1"),
                          ((ids, [0, 5]), "cu_seqlens: expected an int32 or int64 tensor \\[n \\+ 1\\], got list"),
                          ((ids, torch.tensor([0.0, 5.0])), "cu_seqlens: expected an int32 or int64 tensor .* got torch.float32"),
                          ((ids, torch.tensor([0, 2**32 + 5])), "cu_seqlens: values up to 4294967301 do not fit int32")):
        with pytest.raises(ValueError, match=message):
            make_batch(*args)


def test_sampler_mtp_depth():
    b = Sampler(_synthetic(), 50, seed=0, mtp_depth=3).next_batch()
    assert b["mtp_labels"].shape == (3, 50)
    ref = make_batch(b["input_ids"], b["cu_seqlens"], 3)
    assert _same(b, ref)


# ---------------------------------------------------------------- sampler


def test_sampler_determinism():
    ds = _synthetic()
    s1, s2, s3 = Sampler(ds, 32, seed=5), Sampler(ds, 32, seed=5), Sampler(ds, 32, seed=6)
    a = [s1.next_batch() for _ in range(10)]
    b = [s2.next_batch() for _ in range(10)]
    c = [s3.next_batch() for _ in range(10)]
    assert all(_same(x, y) for x, y in zip(a, b))
    assert not all(_same(x, y) for x, y in zip(a, c))
    assert next(iter(Sampler(ds, 32, seed=5))).keys() == a[0].keys()


def test_sampler_resume():
    ds = _synthetic()
    full = Sampler(ds, 45, seed=11, mtp_depth=1)
    batches = [full.next_batch() for _ in range(7)]
    part = Sampler(ds, 45, seed=11, mtp_depth=1)
    for _ in range(3):
        part.next_batch()
    state = part.state_dict()
    assert state["offset"] > 0  # resumes inside a document
    fresh = Sampler(ds, 45, seed=11, mtp_depth=1)
    fresh.load_state_dict(state)
    assert all(_same(fresh.next_batch(), b) for b in batches[3:])


def test_a_stream_cut_inside_a_document_resumes_with_whole_documents_at_the_next_one():
    """A run resumed with whole_documents turned on began its first batch with the rest of the
    document the earlier run had cut (the state did not say how the stream was cut): a piece
    trained without the tokens before it. It now goes on at the next document (the next
    epoch's first after the last); a stream at a document's start goes on there; a long
    document cut by a whole_documents sampler goes on where it was cut, as before."""
    ds, T = _synthetic(n_docs=23, max_len=40), 32
    plain = Sampler(ds, T, seed=3)
    while not plain.offset:
        plain.next_batch()
    state = plain.state_dict()
    assert state["whole_documents"] is False
    order = plain._epoch_order(0).tolist()
    old = {k: v for k, v in state.items() if k != "whole_documents"}  # a state from before it was kept
    last = dict(state, index=22, offset=1)  # the epoch's last document, cut
    assert ds.doc_len(order[22]) > 1
    for saved, epoch, index in [(state, 0, state["index"] + 1), (old, 0, state["index"] + 1), (last, 1, 0)]:
        whole = Sampler(ds, T, seed=3, whole_documents=True)
        whole.load_state_dict(saved)
        assert (whole.epoch, whole.index, whole.offset) == (epoch, index, 0)
        doc = int(whole._epoch_order(epoch)[index])
        first = whole.next_batch()["input_ids"]
        assert first[:min(ds.doc_len(doc), T)].tolist() == ds.document(doc).tolist()[:T]  # a document from its start
    for at in (Sampler(ds, T, seed=3).state_dict(), dict(state, offset=0)):  # at a document's start (no cut): resumed there
        whole = Sampler(ds, T, seed=3, whole_documents=True)
        whole.load_state_dict(at)
        assert (whole.epoch, whole.index, whole.offset) == (0, at["index"], 0)
    plain_again = Sampler(ds, T, seed=3)
    plain_again.load_state_dict(state)  # without whole_documents: the cut document's rest, as saved
    assert plain_again.next_batch()["input_ids"][:4].tolist() == ds.document(order[state["index"]]).tolist()[state["offset"]:][:4]
    long_cut = Sampler(ds, T, seed=3, whole_documents=True)
    while not long_cut.offset:  # a document longer than T, cut at a batch's end
        long_cut.next_batch()
    resumed = Sampler(ds, T, seed=3, whole_documents=True)
    resumed.load_state_dict(long_cut.state_dict())
    assert (resumed.index, resumed.offset) == (long_cut.index, long_cut.offset) and _same(resumed.next_batch(), long_cut.next_batch())
    with pytest.raises(ValueError, match=r"state\['whole_documents'\]: expected a bool, got 'yes'"):
        Sampler(ds, T, seed=3).load_state_dict(dict(state, whole_documents="yes"))


def test_empty_documents_are_passed_over_and_a_dataset_of_only_empty_ones_refused():
    """A document of no tokens (eos None: nothing follows it) makes no sequence of length 0 in
    cu_seqlens, in a batch or at a resume that stands on it; a dataset whose documents are all
    empty is refused where the sampler would otherwise look for a token forever."""
    docs = [[1, 2, 3], [], [4, 5], [], [6], []]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    ds = TokenDataset(np.array([t for d in docs for t in d], dtype=np.int64), np.cumsum(lengths) - lengths, lengths, None,
                      vocab_size=10, eos=None)
    sampler = Sampler(ds, 4, seed=0, shuffle=False)
    first, second = sampler.next_batch(), sampler.next_batch()
    assert first["input_ids"].tolist() == [1, 2, 3, 4] and first["cu_seqlens"].tolist() == [0, 3, 4]
    assert second["input_ids"].tolist() == [5, 6, 1, 2] and second["cu_seqlens"].tolist() == [0, 1, 2, 4]
    state = sampler.state_dict()
    stream = [sampler.next_batch() for _ in range(3)]
    for batch in stream:
        assert (batch["cu_seqlens"].diff() > 0).all()
    at_empty = dict(state, index=1, offset=0)  # a state standing on an empty document resumes
    fresh = Sampler(ds, 4, seed=0, shuffle=False)
    fresh.load_state_dict(at_empty)
    assert fresh.next_batch()["input_ids"].tolist() == [4, 5, 6, 1]
    # the epoch turns with its last token, not a batch later when its last documents are empty
    ends = Sampler(ds, 6, seed=0, shuffle=False)
    assert ends.next_batch()["input_ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert (ends.epoch, ends.index, ends.offset) == (1, 0, 0) and ends.state_dict()["epoch"] == 1
    assert ds.stored_batches(6).__next__()["input_ids"].tolist() == [1, 2, 3, 4, 5, 6] and len(list(ds.stored_batches(6))) == 1
    assert len(list(ds.stored_batches(3))) == 2 and len(list(ds.stored_batches(4))) == 1
    shuffled = Sampler(ds, 6, seed=5)
    for epoch in range(1, 4):
        assert sorted(shuffled.next_batch()["input_ids"].tolist()) == [1, 2, 3, 4, 5, 6] and shuffled.epoch == epoch
    empty = TokenDataset(np.zeros(0, dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), None, vocab_size=10, eos=None)
    with pytest.raises(ValueError, match="dataset: its 2 documents are all empty"):
        Sampler(empty, 4, seed=0)


def test_a_memory_mapped_dataset_pickles_as_its_file_not_a_copy(tmp_path):
    """A DataLoader's spawned workers get the dataset pickled: numpy pickled the np.memmap
    data and label mask as copies of the whole files (each worker a copy of the corpus).
    Now their place: unpickled, they map the same files again, the same tokens and batches;
    an array in memory still pickles as itself."""
    import pickle

    tokens = np.random.default_rng(0).integers(1, 200, size=50_000).astype(np.uint16)
    tokens[::97] = 0
    tokens.tofile(tmp_path / "tokens.u16")
    np.asarray(np.random.default_rng(1).integers(0, 2, size=len(tokens)), dtype=np.uint8).tofile(tmp_path / "mask.u8")
    data = np.memmap(tmp_path / "tokens.u16", dtype=np.uint16, mode="r")
    mask = np.memmap(tmp_path / "mask.u8", dtype=np.uint8, mode="r")
    ends = np.flatnonzero(data == 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    ds = TokenDataset(data, starts, ends - starts, None, vocab_size=200, eos=0, label_mask=mask)
    for original in (ds, ds.split(10)[1]):
        blob = pickle.dumps(original)
        assert len(blob) < 20_000  # the starts and lengths, not the 100,000 bytes of tokens
        again = pickle.loads(blob)
        assert isinstance(again.data, np.memmap) and isinstance(again.label_mask, np.memmap)
        assert np.array_equal(again.data, data) and np.array_equal(again.label_mask, mask)
        assert _same(Sampler(again, 256, seed=1).next_batch(), Sampler(original, 256, seed=1).next_batch())
    in_memory = TokenDataset(np.asarray(data), starts, ends - starts, None, vocab_size=200, eos=0)
    again = pickle.loads(pickle.dumps(in_memory))
    assert not isinstance(again.data, np.memmap) and np.array_equal(again.data, data) and again.label_mask is None
    # memmaps of one's own: one past a file's header (offset), a slice of one, a copy-on-write one edited in memory
    (tmp_path / "header.u16").write_bytes(np.full(64, 7, dtype=np.uint16).tobytes() + tokens.tobytes())
    edited = np.memmap(tmp_path / "tokens.u16", dtype=np.uint16, mode="c")
    edited[1:5] = 199
    for own in (np.memmap(tmp_path / "header.u16", dtype=np.uint16, mode="r", offset=128), data[100:], edited):
        ends = np.flatnonzero(own == 0)
        starts = np.concatenate([[0], ends[:-1] + 1])
        again = pickle.loads(pickle.dumps(TokenDataset(own, starts, ends - starts, None, vocab_size=200, eos=0)))
        assert np.array_equal(again.data, own), (own[:5], again.data[:5])


def test_epoch_rollover():
    ds = _synthetic(n_docs=5)
    sampler = Sampler(ds, 16, seed=2)
    seen = 0
    while sampler.epoch < 3:
        b = sampler.next_batch()
        seen += b["input_ids"].numel()
    assert seen >= 3 * ds.n_tokens
    o0, o1 = sampler._epoch_order(0).tolist(), sampler._epoch_order(1).tolist()
    assert sorted(o0) == sorted(o1) == list(range(5))
    # each epoch its own order, drawn from (seed, epoch): pinned, as a resumed run of an earlier version reads them (a seed
    # without the epoch gave every epoch epoch 0's order, and the stream was compared with that same order)
    assert [o0, o1, sampler._epoch_order(2).tolist()] == [[2, 4, 1, 3, 0], [3, 4, 0, 1, 2], [4, 3, 2, 1, 0]]
    # the stream is epoch 0's documents, then epoch 1's, ... without gaps
    fresh = Sampler(ds, ds.n_tokens, seed=2)
    e0, e1 = fresh.next_batch(), fresh.next_batch()
    assert fresh.state_dict()["epoch"] == 2 and fresh.index == 0 and fresh.offset == 0
    assert torch.equal(e0["input_ids"], torch.cat([ds.document(d) for d in o0]))
    assert torch.equal(e1["input_ids"], torch.cat([ds.document(d) for d in o1]))
    assert len(_sequences(e0)) == 5


def test_validation_batches_fixed():
    ds = _synthetic()
    train, val = ds.split(30)
    assert len(train) and len(val)
    v1, v2 = val.validation_batches(8, 3, mtp_depth=1), val.validation_batches(8, 3, mtp_depth=1)
    assert len(v1) == 3 and all(_same(a, b) for a, b in zip(v1, v2))
    assert torch.equal(torch.cat([b["input_ids"] for b in v1]), torch.cat([val.document(i) for i in range(len(val))])[:24])
    # every token of the dataset in batches, and one token more: refused up front, saying what it takes
    n = val.n_tokens
    assert sum(b["input_ids"].numel() for b in val.validation_batches(n, 1)) == n
    with pytest.raises(ValueError, match=f"n_batches: 1 batches of {n + 1} tokens need {n + 1} tokens, the dataset has {n}$"):
        val.validation_batches(n + 1, 1)


def test_unnamed_split():
    ds = TokenDataset(np.arange(200, dtype=np.uint16), np.arange(0, 200, 2), np.full(100, 2), None, vocab_size=200, eos=None)
    train, val = ds.split(20)
    assert len(train) + len(val) == 100 and 5 < len(val) < 40
    assert not set(train.starts.tolist()) & set(val.starts.tolist())
    assert ds.split(20)[1].starts.tolist() == val.starts.tolist()
    # the hash is of the index + 1: document 0's is not 0, bucket 0, in validation whatever val_percent
    assert 0 not in val.starts.tolist() and ds.subset(np.arange(2)).split(1)[1].starts.tolist() == []
    one = ds.subset(np.arange(1))
    assert len(one.split(5)[0]) == 1  # a one-document token file (no separator in it) trains
    many = TokenDataset(np.zeros(1, dtype=np.uint16), np.zeros(10000, dtype=np.int64), np.ones(10000, dtype=np.int64), None,
                        vocab_size=2, eos=None)
    assert 450 < len(many.split(5)[1]) < 550  # the buckets spread evenly


def test_sampler_flags_are_bools():
    ds = TokenDataset(np.arange(20, dtype=np.uint16), np.arange(0, 20, 4), np.full(5, 4), None, vocab_size=20, eos=None)
    for flag in ("shuffle", "whole_documents"):
        for bad in ("no", 0, None):
            with pytest.raises(ValueError, match=f"{flag}: expected a bool, got {bad!r}"):
                Sampler(ds, 4, seed=0, **{flag: bad})


# ---------------------------------------------------------------- user data


def test_text_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first ü")
    (tmp_path / "sub" / "c.md").write_bytes(b"\xff\x00third")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / ".hidden").write_text("skip me")
    (tmp_path / ".git" / "objects").mkdir(parents=True)  # a hidden directory: never entered
    (tmp_path / ".git" / "objects" / "pack").write_text("skip me")
    (tmp_path / "dir.txt").mkdir()  # a directory is no document, whatever its name
    (tmp_path / "sub" / "link.txt").symlink_to(tmp_path / "b.txt")  # a link to a file the tree holds: b.txt is read once
    (tmp_path / "linked").symlink_to(tmp_path / "sub", target_is_directory=True)  # the tree's own directory: read once, as itself
    (tmp_path / "sub" / "up").symlink_to(tmp_path, target_is_directory=True)  # a link back up: no loop
    (tmp_path / "sub" / "d.md").write_text("fourth")
    with pytest.warns(UserWarning, match=r"1 file\(s\) under .* are not UTF-8 text \(a NUL byte or invalid UTF-8\) and are left out: sub/c.md$"):
        ds = load_text_dir(tmp_path)
    # sub/link.txt was a second document of b.txt's bytes (which could fall in the other side of the split:
    # validation text trained on); a file is read once, under its own name
    assert ds.names == ["a.txt", "b.txt", "sub/d.md"] and ds.vocab_size == BYTE_VOCAB_SIZE
    assert decode_text(ds.document(0)) == "first ü"
    assert ds.document(2).tolist() == [*b"fourth", EOS]
    with pytest.warns(UserWarning, match="sub/c.md"):
        assert load_corpus(tmp_path).names == ds.names
    b = Sampler(ds, 10, seed=0, shuffle=False).next_batch()
    assert b["cu_seqlens"].tolist() == [0, len("first ü".encode()) + 1, 10]


def test_a_text_dir_leaves_out_what_is_not_text_and_refuses_records(tmp_path):
    """A corpus directory read as bytes: bytecode caches are not entered, files that are not
    UTF-8 text (an image, UTF-16, gzip) are left out with a warning naming them, and files
    of records (JSON Lines, Parquet) are refused by name with the way to read them (they
    were all read as documents of raw bytes: a run trained on PNG pages, pickled bytecode
    and JSON syntax without a word)."""
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0code")
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "img.png").write_bytes(bytes(range(256)))
    (tmp_path / "utf16.txt").write_text("text", encoding="utf-16")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "x.gz").write_bytes(gzip.compress(b"zipped text"))
    with pytest.warns(UserWarning, match=r"4 file\(s\) under .* are left out: img.png, latin1.txt, utf16.txt, \.\.\.$"):
        ds = load_text_dir(tmp_path)
    assert ds.names == ["m.py"]
    (tmp_path / "m.py").unlink()
    with pytest.raises(ValueError, match="path: no non-empty text files under"), pytest.warns(UserWarning):
        load_text_dir(tmp_path)
    for name in ("train-0.jsonl", "shard.parquet", "part.jsonl.gz"):
        records = tmp_path / name.split(".")[0]
        records.mkdir()
        (records / "a.txt").write_text("a text")
        (records / name).write_text('{"text": "a record"}\n')
        with pytest.raises(ValueError, match=rf"path: '{records}' holds files of records \({name}\), which a directory of text files "
                                             r"would read as their raw bytes, keys and quotes included: make a token file of their "
                                             r"text with `python -m fmoe.train.prepare`"):
            load_corpus(records)


def test_a_corpus_of_linked_directories_is_read_through_them(tmp_path):
    """A corpus put together from links to other directories read as empty ("no non-empty
    files"): a linked directory outside the tree is entered, each directory once (two links
    to one, or a link inside one to another, add nothing), in sorted order."""
    (tmp_path / "store" / "web" / "deep").mkdir(parents=True)
    (tmp_path / "store" / "web" / "w.txt").write_text("web text")
    (tmp_path / "store" / "web" / "deep" / "d.txt").write_text("deep text")
    (tmp_path / "store" / "code").mkdir()
    (tmp_path / "store" / "code" / "c.py").write_text("x = 1")
    (tmp_path / "store" / "code" / "web").symlink_to(tmp_path / "store" / "web", target_is_directory=True)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, target in (("a_web", "web"), ("b_code", "code"), ("c_deep", "web/deep")):
        (corpus / name).symlink_to(tmp_path / "store" / target, target_is_directory=True)
    assert list_text_files(corpus) == ["a_web/w.txt", "b_code/c.py", "c_deep/d.txt"]  # deep claimed by its own link, met first
    assert load_text_dir(corpus).names == list_text_files(corpus)


def test_a_file_linked_inside_a_corpus_is_read_once(tmp_path):
    """A symlink to a file was a document of its own: the same bytes read as often as they
    were linked (and the copies split apart, one in validation, one in training). A link to
    a file the tree holds adds nothing; links to a file outside it give it once, under the
    first link's name in sorted order; a link to a file the walk leaves out (a hidden one)
    is read, as the file's only name."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.txt").write_text("outside text")
    corpus = tmp_path / "corpus"
    (corpus / "v2").mkdir(parents=True)
    (corpus / "v2" / "a.txt").write_text("alpha")
    (corpus / "v2" / "b.txt").write_text("beta")
    (corpus / ".notes").write_text("hidden notes")
    (corpus / "latest").symlink_to("v2", target_is_directory=True)  # a directory the tree holds: read once already
    (corpus / "a_again.txt").symlink_to("v2/a.txt")
    (corpus / "z_link.txt").symlink_to(corpus / "v2" / "a.txt")
    (corpus / "v2" / "b_link.txt").symlink_to("b.txt")
    (corpus / "o2.txt").symlink_to(tmp_path / "outside" / "o.txt")
    (corpus / "o1.txt").symlink_to(tmp_path / "outside" / "o.txt")
    (corpus / "notes.txt").symlink_to(".notes")
    assert list_text_files(corpus) == ["notes.txt", "o1.txt", "v2/a.txt", "v2/b.txt"]
    ds = load_text_dir(corpus)
    assert ds.names == list_text_files(corpus)
    assert sorted(decode_text(ds.document(i)) for i in range(len(ds))) == ["alpha", "beta", "hidden notes", "outside text"]


@pytest.mark.parametrize("dtype,suffix", [("uint16", ".u16"), ("uint32", ".uint32")])
def test_token_file(tmp_path, dtype, suffix):
    big = 70000 if dtype == "uint32" else 60000
    tokens = np.array([5, 6, 0, 7, 0, 0, big, 8, 9], dtype=dtype)
    path, plain = tmp_path / f"train{suffix}", tmp_path / "train.bin"
    tokens.tofile(path)
    tokens.tofile(plain)
    for ds in (load_token_file(path, separator=0, vocab_size=big + 1),
               load_token_file(plain, separator=0, vocab_size=big + 1, dtype=dtype),
               load_corpus(path, separator=0, vocab_size=big + 1)):
        assert ds.eos is None and ds.vocab_size == big + 1
        assert [ds.document(i).tolist() for i in range(len(ds))] == [[5, 6, 0], [7, 0], [0], [big, 8, 9]]
    b = Sampler(ds, 9, seed=0, shuffle=False).next_batch()
    assert b["input_ids"].tolist() == tokens.astype(np.int64).tolist()
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 6, 9]


# ---------------------------------------------------------------- errors


def test_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_text_dir(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_token_file(missing, separator=0, vocab_size=10, dtype="uint16")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus(missing)
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no non-empty files.*empty_dir"):
        load_text_dir(empty_dir)
    f = tmp_path / "tok.u16"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="tok.u16.*is empty"):
        load_token_file(f, separator=0, vocab_size=10)
    f.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        load_token_file(f, separator=0, vocab_size=10)
    f.write_bytes(np.array([1, 0, 12], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="vocab_size: token 12 at index 2"):
        load_token_file(f, separator=0, vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size: token 12 at index 2 of .* is not below vocab_size 12"):  # the first id past it
        load_token_file(f, separator=0, vocab_size=12)
    assert load_token_file(f, separator=0, vocab_size=13).document(1).tolist() == [12]
    with pytest.raises(ValueError, match="separator"):
        load_token_file(f, separator=10, vocab_size=10)
    with pytest.raises(ValueError, match="dtype: expected"):
        load_token_file(f, separator=0, vocab_size=20, dtype="int8")
    (tmp_path / "tok.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="dtype: cannot infer.*tok.bin"):
        load_token_file(tmp_path / "tok.bin", separator=0, vocab_size=10)
    # a dtype given against the file's suffix (a --data_dtype meant for the blend's other sources): not read as the other
    (tmp_path / "tok.u32").write_bytes(np.array([5, 1, 3], dtype=np.uint32).tobytes())
    with pytest.raises(ValueError, match=r"dtype: 'uint16' was given, the suffix of .*tok.u32' means 'uint32'"):
        load_token_file(tmp_path / "tok.u32", separator=1, vocab_size=10, dtype="uint16")
    assert load_token_file(tmp_path / "tok.u32", separator=1, vocab_size=10, dtype="uint32").document(0).tolist() == [5, 1]
    with pytest.raises(ValueError, match="not a directory"):
        load_text_dir(f)
    with pytest.raises(ValueError, match="not a regular file"):
        load_token_file(empty_dir, separator=0, vocab_size=10, dtype="uint16")
    with pytest.raises(ValueError, match="separator, vocab_size") as refused:
        load_corpus(f)
    assert "looks like text" not in str(refused.value)  # token ids below 256 hold zero bytes


def test_a_text_file_given_as_a_token_file_is_named_text(tmp_path):
    """A user's first try, --data=notes.txt: the refusal says it looks like text and how to
    train on text; a binary file of another suffix, or a token suffix, gets no such hint."""
    notes = tmp_path / "notes.txt"
    notes.write_text("xx" + "déjà vu: " * 600)  # 11-byte repeats after 2: the 4096 bytes read end inside an "é"
    with pytest.raises(ValueError, match=r"separator: required for the token file .*notes.txt.*; it looks like text, not "
                                         r"token ids: a directory of text files is read as their bytes \(load_text_dir\), and "
                                         r"`python -m fmoe.train.prepare` makes a token file of text"):
        load_corpus(notes, vocab_size=258)
    for name, data in (("ids.dat", np.arange(300, 600, dtype=np.uint16).tobytes()), ("notes.u16", b"ab" * 50)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match="separator: required") as refused:
            load_corpus(tmp_path / name, vocab_size=1000)
        assert "looks like text" not in str(refused.value), name
    ds = _synthetic()
    with pytest.raises(ValueError, match="tokens_per_batch"):
        Sampler(ds, 0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        Sampler(ds, 8, seed=-1)
    with pytest.raises(ValueError, match="mtp_depth"):
        Sampler(ds, 8, seed=0, mtp_depth=-1)
    with pytest.raises(ValueError, match="dataset: has no documents"):
        Sampler(ds.split(0)[1], 8, seed=0)
    with pytest.raises(ValueError, match="dataset: expected a TokenDataset"):
        Sampler([1, 2], 8, seed=0)
    with pytest.raises(ValueError, match="val_percent"):
        ds.split(101)
    with pytest.raises(ValueError, match="n_batches: 100 batches"):
        ds.validation_batches(64, 100)
    sampler = Sampler(ds, 8, seed=0)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="seed is 0, this sampler has 1"):
        Sampler(ds, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="^state: shuffle is True, this sampler has False$"):  # another order of the documents
        Sampler(ds, 8, seed=0, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="n_documents"):
        Sampler(_synthetic(n_docs=4), 8, seed=0).load_state_dict(state)
    other = _synthetic(seed=1)  # as many documents, of other lengths: other data
    assert len(other) == len(ds) and other.n_tokens != ds.n_tokens
    with pytest.raises(ValueError, match=f"^state: n_tokens is {ds.n_tokens}, this sampler has {other.n_tokens}$"):
        Sampler(other, 8, seed=0).load_state_dict(state)
    old_state = {k: v for k, v in state.items() if k != "n_tokens"}  # a checkpoint from before n_tokens was kept
    Sampler(other, 8, seed=0).load_state_dict(old_state)
    with pytest.raises(ValueError, match="missing keys"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"^state: expected a Sampler's state_dict\(\) \(a dict\), got NoneType"):
        sampler.load_state_dict(None)
    with pytest.raises(ValueError, match="offset"):
        sampler.load_state_dict({**state, "offset": 10_000})


def test_label_mask_keeps_masked_tokens_out_of_every_label():
    """TokenDataset.label_mask: a token marked 0 is never a label (main or MTP), across
    documents cut between batches; the virtual EOS counts; subsets keep the mask."""
    data = np.arange(20, dtype=np.uint8)
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1], dtype=np.uint8)
    ds = TokenDataset(data, np.array([0, 5, 10, 15]), np.array([5, 5, 5, 5]), None, vocab_size=BYTE_VOCAB_SIZE, eos=EOS, label_mask=mask)
    assert ds.document_mask(0).tolist() == [False, False, True, True, True, True]  # the EOS counts
    assert ds.document_mask(3, 2, 6).tolist() == [False, True, True, True] and ds.document_mask(1, 5, 6).tolist() == [True]
    stream = [(t, bool(m)) for i in range(4) for t, m in zip(ds.document(i).tolist(), ds.document_mask(i).tolist())]
    sampler = Sampler(ds, 7, seed=0, shuffle=False, mtp_depth=2)
    at = 0
    for _ in range(4):  # 28 tokens: every document, cut across batches, twice over the first ones
        b = sampler.next_batch()
        for s, e in _sequences(b):
            for t in range(s, e):
                for d, (labels, lm) in enumerate([(b["labels"], b["loss_mask"]), *zip(b["mtp_labels"], b["mtp_loss_mask"])]):
                    j = t + 1 + d
                    counted = j < e and stream[(at + j) % len(stream)][1]
                    assert bool(lm[t]) == counted and int(labels[t]) == (b["input_ids"][j].item() if counted else IGNORE_INDEX)
        at += 7
    assert sum(int(b["loss_mask"].sum()) for b in ds.validation_batches(6, 4)) < sum(
        int(b["loss_mask"].sum()) for b in TokenDataset(data, ds.starts, ds.lengths, None, vocab_size=BYTE_VOCAB_SIZE, eos=EOS).validation_batches(6, 4))
    assert ds.split(50)[0].label_mask is mask
    # make_batch: a mask of another shape is refused; an all-True mask changes nothing
    ids, cu = torch.arange(6), torch.tensor([0, 4, 6])
    assert _same(make_batch(ids, cu, 1, label_mask=torch.ones(6, dtype=torch.bool)), make_batch(ids, cu, 1))
    with pytest.raises(ValueError, match=r"label_mask: expected a tensor of input_ids' shape \(6,\)"):
        make_batch(ids, cu, label_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"token_mask: expected a tensor of input_ids' shape \(6,\)"):
        make_batch(ids, cu, token_mask=[True] * 6)
    assert make_batch(ids, cu, token_mask=torch.tensor([1, 1, 1, 1, 0, 0]))["token_mask"].tolist() == [True] * 4 + [False] * 2
    with pytest.raises(ValueError, match="label_mask: expected a 1-D array of the data's 20 tokens"):
        TokenDataset(data, ds.starts, ds.lengths, None, vocab_size=BYTE_VOCAB_SIZE, eos=EOS, label_mask=mask[:5])


def test_whole_documents_start_the_next_batch_instead_of_being_cut():
    """whole_documents: every sequence of a batch is a whole document, a document longer
    than the batch cut from a batch's start, or the padding at a batch's end (PAD, never
    a label); the documents come in the epoch's order, each once per epoch; the stream
    resumes exactly from a state_dict; validation batches refuse what needs more documents."""
    ds = _synthetic(n_docs=23, max_len=40)  # document i: the byte i repeated, then EOS
    T = 32
    sampler = Sampler(ds, T, seed=3, whole_documents=True, mtp_depth=1)
    seen, pads = [], 0
    for _ in range(30):
        b = sampler.next_batch()
        assert b["input_ids"].shape == (T,)
        seqs = _sequences(b)
        for n, (s, e) in enumerate(seqs):
            ids = b["input_ids"][s:e].tolist()
            if ids[0] == PAD:
                assert n == len(seqs) - 1 and set(ids) == {PAD} and not b["loss_mask"][s:e].any() and not b["mtp_loss_mask"][0, s:e].any()
                assert (b["labels"][s:e] == IGNORE_INDEX).all()
                assert not b["token_mask"][s:e].any() and b["token_mask"][:s].all()  # the padding, and only it, is not routed
                pads += e - s
                continue
            assert b["token_mask"][s:e].all()
            doc = ids[0]
            assert set(ids[:-1]) <= {doc} and (ids[-1] == EOS or (e - s == T or n == 0))  # whole, or a long document's piece
            if ds.doc_len(doc) <= T:
                assert ids == ds.document(doc).tolist()
            seen.append((doc, e - s))
    assert pads > 0
    # the documents of each epoch, in its order, every piece of a long one in a row
    order = [int(d) for e in range(3) for d in Sampler(ds, T, seed=3)._epoch_order(e)]
    merged = []
    for doc, n in seen:
        if merged and merged[-1][0] == doc and merged[-1][1] < ds.doc_len(doc):
            merged[-1][1] += n
        else:
            merged.append([doc, n])
    assert [d for d, _ in merged] == order[:len(merged)] and all(n == ds.doc_len(d) for d, n in merged[:-1])
    # resume mid-stream
    a = Sampler(ds, T, seed=3, whole_documents=True)
    for _ in range(7):
        a.next_batch()
    b = Sampler(ds, T, seed=3, whole_documents=True)
    b.load_state_dict(a.state_dict())
    assert all(_same(a.next_batch(), b.next_batch()) for _ in range(10))
    # without padding the same documents fill fewer batches
    plain = Sampler(ds, T, seed=3)
    assert not any((plain.next_batch()["input_ids"] == PAD).any() for _ in range(30))
    assert "token_mask" not in plain.next_batch().keys()
    # validation: the stored order, each document at most once
    stored = Sampler(ds, T, seed=0, shuffle=False, whole_documents=True)
    every = []
    while not stored.epoch:
        every.append(stored.next_batch())
        assert len(every) <= ds.n_tokens, "the sampler makes no progress (batches of padding alone)"  # it hung, not failed
    assert (stored.index, stored.offset) == (0, 0)  # the last batch ends in padding, not in document 0 again
    val = ds.validation_batches(T, len(every), whole_documents=True)
    assert all(_same(a, b) for a, b in zip(val, every))
    with pytest.raises(ValueError, match="each document whole, need more than the dataset's 23 documents"):
        ds.validation_batches(T, len(every) + 1, whole_documents=True)
    # a micro-batch longer than the whole dataset: its documents once, not a second pass landing on the end again
    small = TokenDataset(np.array([1, 2, 0, 3, 0], dtype=np.uint16), np.array([0, 3]), np.array([3, 2]), None, vocab_size=10, eos=None)
    for whole in (True, False):
        assert [b["input_ids"].tolist() for b in small.stored_batches(10, whole_documents=whole)] == []
    with pytest.raises(ValueError, match="n_batches: 1 batches of 11 tokens, each document whole, need more than the dataset's 2 documents"):
        small.validation_batches(11, 1, whole_documents=True)
    assert [b["input_ids"].tolist() for b in small.stored_batches(5)] == [[1, 2, 0, 3, 0]]  # exactly the dataset: once
    # a next batch would end inside the first document again ([3, 0, 1]): the stored ones stop before it
    assert [b["input_ids"].tolist() for b in small.stored_batches(3)] == [[1, 2, 0]]


def test_token_dataset_checks_its_names_data_and_mask_values():
    """Names that are no strings failed at split() (an AttributeError), 2-D data at the first
    batch (blaming make_batch's input_ids), and mask values other than 0 and 1 were read as
    True (a mask file's loader refuses them)."""
    data, starts, lengths = np.arange(1, 7, dtype=np.uint16), np.array([0, 3]), np.array([3, 3])
    with pytest.raises(ValueError, match=r"^names: expected strings, got 7"):
        TokenDataset(data, starts, lengths, ["a", 7], vocab_size=10, eos=None)
    with pytest.raises(ValueError, match=r"^data: expected a 1-D array \[N\] of token ids, got shape \(2, 3\)"):
        TokenDataset(data.reshape(2, 3), np.array([0]), np.array([1]), None, vocab_size=10, eos=None)
    for mask, got in ((np.array([0, 2, 1, 0, 1, 1], dtype=np.uint8), "values other than 0 and 1"),
                      (np.array([0, -1, 1, 0, 1, 1], dtype=np.int8), "values other than 0 and 1"),
                      (np.ones(6, dtype=np.float32), "float32")):
        with pytest.raises(ValueError, match=rf"^label_mask: expected uint8 0/1 or bool values, got {got}"):
            TokenDataset(data, starts, lengths, None, vocab_size=10, eos=None, label_mask=mask)
    ok = TokenDataset(data, starts, lengths, ["a", "b"], vocab_size=10, eos=None, label_mask=np.array([1, 0, 1, 1, 1, 0], dtype=bool))
    assert len(ok.split(50)[0]) + len(ok.split(50)[1]) == 2


def test_text_given_as_token_ids_is_refused_with_every_knob_given(tmp_path):
    """--data=corpus.jsonl with --separator, --model.vocab_size and --data_dtype (the README's
    line for GPT-2 token files) read the text's bytes as uint16 ids and trained on them: the
    text is refused as it is where a knob is missing. A token file of any name is read."""
    for name, text in (("corpus.txt", "plain text, " * 50), ("corpus.jsonl", '{"text": "a record"}\n' * 40)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"^path: '.*{name}' looks like text \(UTF-8 without a NUL byte\), not token ids: a "
                                             r"directory of text files is read as their bytes"):
            load_corpus(tmp_path / name, separator=50256, vocab_size=50304, dtype="uint16")
    np.array([300, 7, 5000, 7], dtype=np.uint16).tofile(tmp_path / "ids.tok")
    assert len(load_corpus(tmp_path / "ids.tok", separator=7, vocab_size=50304, dtype="uint16")) == 2


def test_ids_beyond_the_dtype_are_refused_from_an_index_and_warned_of_from_a_caller(tmp_path):
    """A uint16 file holds ids up to 65535: ids of a larger tokenizer wrapped when written.
    An index that says so is refused (prepare refuses to write it); a caller's larger
    vocab_size (perhaps a model's padded table) is warned of."""
    import json

    path = tmp_path / "a.u16"
    np.array([5, 1, 3], dtype=np.uint16).tofile(path)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(documents=2, tokens=3, dtype="uint16", separator=1, vocab_size=100000)))
    with pytest.raises(ValueError, match=r"^path: the index '.*a.u16.index.json' holds vocab_size = 100000 with dtype uint16, which holds "
                                         r"ids up to 65535: the larger ids wrapped when written; prepare the data again as uint32$"):
        load_token_file(path)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(documents=2, tokens=3, dtype="uint16", separator=1, vocab_size=65536)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_token_file(path, vocab_size=100000)) == 2  # the index's tokenizer fits; the table is padded
    (tmp_path / "a.u16.index.json").unlink()
    with pytest.warns(UserWarning, match=r"vocab_size: 100000 is beyond what uint16 holds \(ids up to 65535\): where '.*a.u16' holds ids "
                                         r"of a tokenizer that large, they wrapped when written as uint16"):
        assert len(load_token_file(path, separator=1, vocab_size=100000)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_token_file(path, separator=1, vocab_size=65536)


def test_an_index_dtype_is_named_as_the_index_s(tmp_path):
    """The index's dtype against the file's suffix was blamed on the caller ("dtype: 'uint32'
    was given"), who gave none; a dtype no file has failed as if given."""
    import json

    path = tmp_path / "a.u16"
    np.array([5, 1, 3], dtype=np.uint16).tofile(path)
    index = dict(documents=2, tokens=3, dtype="uint32", separator=1, vocab_size=10)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^path: the index '.*a.u16.index.json' says dtype 'uint32', the suffix of '.*a.u16' means 'uint16'"):
        load_token_file(path)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(index, dtype="float32")))
    with pytest.raises(ValueError, match=r"^path: the index '.*a.u16.index.json' holds dtype = 'float32', expected one of \['uint16', 'uint32'\]"):
        load_token_file(path)
    # the index's separator and vocab_size are named as the index's, not as arguments the caller did not give
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(index, dtype="uint16", separator=10)))
    with pytest.raises(ValueError, match=r"^path: the index '.*a.u16.index.json' holds separator = 10, not below its vocab_size 10$"):
        load_token_file(path)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(index, dtype="uint16", vocab_size=4)))
    with pytest.raises(ValueError, match=r"^path: the index '.*a.u16.index.json' says vocab_size 4: token 5 at index 0 of '.*a.u16' "
                                         r"is not below vocab_size 4$"):
        load_token_file(path)
    with pytest.raises(ValueError, match=r"^vocab_size: 3 was given, the index"):  # the caller's own value is still named as theirs
        load_token_file(path, vocab_size=3)
    (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(index, dtype="uint16")))
    assert load_token_file(path).document(0).tolist() == [5, 1]


def test_a_uint32_file_read_as_uint16_is_refused_and_a_uint16_file_of_zeros_is_not(tmp_path):
    """uint32 ids below 65536 read as uint16 are an id and a 0 each: they passed every check
    (the ids fit vocab_size) and every other token trained on was 0. The pattern, 0 at every
    other place and ids between, is refused; uint16 files with many zeros (separator 0,
    short and empty documents, token 0 common) are read as before."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50000, 10000).astype(np.uint32)
    ids[::100] = 50256
    for name, order, place in (("ids.bin", "<u4", "odd"), ("big_endian.bin", ">u4", "even"), ("named.u16", "<u4", "odd")):
        ids.astype(order).tofile(tmp_path / name)
        with pytest.raises(ValueError, match=rf"^dtype: '.*{name}' read as uint16 holds 0 at every {place} position of its first "
                                             r"20000 tokens and ids at the .* ones \(10000 of 10000 non-zero\): it looks like a file "
                                             r"of uint32 ids, each read as an id and a 0; pass dtype='uint32'"):
            load_token_file(tmp_path / name, separator=50256, vocab_size=50304, dtype=None if name.endswith(".u16") else "uint16")
    assert len(load_token_file(tmp_path / "ids.bin", separator=50256, vocab_size=50304, dtype="uint32")) == 101  # a separator first, then one every 100
    np.where(ids == 50256, 0, ids).tofile(tmp_path / "sep0.bin")  # separator 0: the uint32 zeros give even zeros too
    with pytest.raises(ValueError, match="dtype: .*sep0.bin' read as uint16 holds 0 at every odd position"):
        load_token_file(tmp_path / "sep0.bin", separator=0, vocab_size=50304, dtype="uint16")
    # genuine uint16 files of many zeros
    short = np.concatenate([np.append(rng.integers(0, 3, rng.integers(0, 4)), 0) for _ in range(3000)]).astype(np.uint16)
    zeros = np.zeros(5000, dtype=np.uint16)
    zeros[::10] = 7  # mostly separators, ids at even places only
    common = np.where(rng.random(20000) < 0.45, 0, rng.integers(1, 50000, 20000)).astype(np.uint16)
    for name, tokens in (("short.u16", short), ("zeros.u16", zeros), ("common.u16", common),
                         ("small.u16", np.tile(np.array([5, 0], dtype=np.uint16), 100))):  # 200 tokens: too few to tell
        tokens.tofile(tmp_path / name)
        ds = load_token_file(tmp_path / name, separator=0, vocab_size=50304)
        assert ds.n_tokens == len(tokens), name


def test_numpy_integers_are_taken_as_ints(tmp_path):
    """Numbers computed from arrays (np.int64: int(ids.max()) + 1 without the int) were
    refused: "vocab_size: expected an int, got np.int64(10)". Any integer is taken, stored
    as an int; a bool (numpy's too) or a float still is not."""
    path = tmp_path / "t.u16"
    np.array([5, 0, 7, 8, 0, 9], dtype=np.uint16).tofile(path)
    np.save(tmp_path / "t.npy", np.array([5, 0, 7, 8, 0, 9], dtype=np.int32))
    for ds in (load_corpus(path, separator=np.int64(0), vocab_size=np.int64(10)),
               load_token_file(path, separator=np.uint16(0), vocab_size=np.int32(10)),
               load_corpus(tmp_path / "t.npy", separator=np.int64(0), vocab_size=np.int64(10))):
        assert type(ds.vocab_size) is int and ds.vocab_size == 10 and len(ds) == 3
    train, _ = ds.split(np.int64(0))
    sampler = Sampler(train, np.int64(4), seed=np.int64(3), mtp_depth=np.int64(1))
    assert (type(sampler.tokens_per_batch), type(sampler.seed), type(sampler.mtp_depth)) == (int, int, int)
    assert sampler.next_batch()["mtp_labels"].shape == (1, 4)
    assert len(train.validation_batches(np.int64(2), np.int64(3))) == 3
    assert make_batch(torch.arange(4), torch.tensor([0, 4]), np.int64(1))["mtp_labels"].shape == (1, 4)
    for bad in (True, np.bool_(True), 10.0):
        with pytest.raises(ValueError, match=f"vocab_size: expected an int, got {bad!r}"):
            load_corpus(path, separator=0, vocab_size=bad)


def test_make_batch_refuses_mask_values_other_than_0_and_1_and_takes_empty_sequences():
    """A label_mask of 2s read as True: masks are bool or 0/1. An empty sequence holds no
    token and counts nothing, as in the ops (context parallelism's tests pack one)."""
    ids, cu = torch.arange(10), torch.tensor([0, 4, 10])
    empty = make_batch(ids, torch.tensor([0, 4, 4, 10]), 1)
    assert _same(empty.exclude("cu_seqlens"), make_batch(ids, cu, 1).exclude("cu_seqlens"))
    for name in ("label_mask", "token_mask"):
        for bad, shown in ((torch.full((10,), 2), "2"), (torch.tensor([1.0] * 9 + [0.5]), "0.5"), (torch.tensor([0] * 9 + [-1]), "-1")):
            with pytest.raises(ValueError, match=rf"^{name}: expected bool or 0/1 values, got {shown}$"):
                make_batch(ids, cu, **{name: bad})
        for good in (torch.tensor([1, 0] * 5), torch.tensor([1.0, 0.0] * 5, dtype=torch.float16), torch.tensor([True, False] * 5)):
            assert make_batch(ids, cu, **{name: good})["loss_mask" if name == "label_mask" else "token_mask"].dtype == torch.bool
    assert _same(make_batch(ids, cu, 1, label_mask=torch.tensor([1, 0] * 5)), make_batch(ids, cu, 1, label_mask=torch.tensor([True, False] * 5)))


def test_an_index_names_a_loss_mask_beside_it_and_deep_json_is_named(tmp_path):
    """A token file's index from elsewhere: its loss_mask is a file beside it (a path,
    relative or absolute, opened any file of this machine as the run's label mask), and
    JSON nested past Python's stack is a ValueError naming the index (a raw RecursionError)."""
    import json

    from fmoe.train.checkpoint import run_config
    from fmoe.hf import read_config

    path = tmp_path / "a.u16"
    np.array([5, 1, 3], dtype=np.uint16).tofile(path)
    index = dict(documents=2, tokens=3, dtype="uint16", separator=1, vocab_size=10)
    for mask in ("../../etc/hostname", "/etc/hostname", "sub/a.mask", ".."):
        (tmp_path / "a.u16.index.json").write_text(json.dumps(dict(index, loss_mask=mask)))
        with pytest.raises(ValueError, match=rf"holds loss_mask = {re.escape(repr(mask))}, expected the name of a file beside it"):
            load_token_file(path)
    (tmp_path / "a.u16.index.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match=r"the index '.*a.u16.index.json' is not valid JSON \(RecursionError"):
        load_token_file(path)
    (tmp_path / "config.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match=r"config.json' is not valid JSON \(RecursionError"):
        run_config(tmp_path)
    with pytest.raises(ValueError, match=r"config.json' is not valid JSON \(RecursionError"):
        read_config(tmp_path)


def test_a_text_directory_is_held_once_in_memory(tmp_path):
    """Each file is read into its place in one array: reading the files into bytes and joining
    them held the corpus twice (a 65 MB directory took 129 MB a rank for the whole run). The
    documents are the files, as before, a binary file left out."""
    import tracemalloc

    rng = np.random.default_rng(0)
    texts = {f"d{i:02d}/f{j}.txt": bytes(rng.integers(97, 123, size=int(rng.integers(50_000, 300_000)), dtype=np.uint8))
             for i in range(6) for j in range(7)}
    for rel, blob in texts.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(blob)
    (tmp_path / "d00" / "image.txt").write_bytes(b"\x89PNG\0\0" * 100)
    size = sum(len(b) for b in texts.values())
    tracemalloc.start()
    try:
        with pytest.warns(UserWarning, match="1 file"):
            corpus = load_text_dir(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.2 * size, (peak, size)
    assert corpus.names == sorted(texts)
    docs = [corpus.document(i) for i in range(len(texts))]
    assert all(int(d[-1]) == EOS for d in docs)
    assert [d[:-1].numpy().astype(np.uint8).tobytes() for d in docs] == [texts[n] for n in sorted(texts)]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("whole_documents", [False, True])
@pytest.mark.parametrize("eos", [EOS, None])
def test_next_layout_advances_as_next_batch_and_counts_what_it_builds(masked, whole_documents, eos):
    """Sampler.next_layout(): the stream moves past a micro-batch exactly as next_batch()
    moves (the same state and the same batches after it), and its layout is the built
    batch's batch_layout: the sequences, the counted labels of the main model and of every
    MTP depth, the routed tokens; over empty documents, documents longer than a batch,
    padding (whole_documents), label masks and epoch ends."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 19, 31)  # empty documents and ones longer than a batch of 11
    data = rng.integers(0, 256, int(lengths.sum())).astype(np.uint8)
    mask = (rng.random(len(data)) < 0.6).astype(np.uint8) if masked else None
    ds = TokenDataset(data, np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths, None, vocab_size=BYTE_VOCAB_SIZE,
                      eos=eos, label_mask=mask)
    for depth in (0, 1, 3):
        built = Sampler(ds, 11, seed=3, mtp_depth=depth, whole_documents=whole_documents)
        counted = Sampler(ds, 11, seed=3, mtp_depth=depth, whole_documents=whole_documents)
        for i in range(60):  # over 2 epochs of 230 tokens (1 with padding)
            batch = built.next_batch()
            layout = counted.next_layout() if i % 3 else batch_layout(counted.next_batch())
            want = batch_layout(batch)
            assert want["loss_tokens"].tolist() == [int(batch["loss_mask"].sum()), *(int(m.sum()) for m in batch.get("mtp_loss_mask", []))]
            assert want["routed_tokens"] == (int(batch["token_mask"].sum()) if whole_documents else 11)
            assert _same(layout, want), (depth, i, layout, want)
            assert counted.state_dict() == built.state_dict()
        assert built.epoch >= 1  # across an epoch end (padding spends part of each batch)
        counts = [batch_layout(built.next_batch())["loss_tokens"] for _ in range(40)]
        assert torch.stack(counts).sum(0).gt(0).all()  # every depth counted something
        if whole_documents:
            assert any(bool((~built.next_batch()["token_mask"]).any()) for _ in range(20))  # padding was met


def test_batch_layout_refuses_what_is_not_a_micro_batch():
    with pytest.raises(ValueError, match="batch: expected a micro-batch TensorDict"):
        batch_layout({"input_ids": torch.zeros(3)})
