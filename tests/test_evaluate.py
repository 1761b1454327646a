"""examples/evaluate.py: an fmoe run's defaults reproduce the validation loss the loop logged
(from the run directory and from a checkpoint); every whole micro-batch of a split; an HF
folder on byte data; under torchrun (2 gloo ranks: FSDP2, TP, EP, CP) the one-process
numbers; bad knobs stop with a message."""

import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.exits import exits

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import evaluate  # noqa: E402
from tests.sessions import run_in_session  # noqa: E402

TINY = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.ffn_dense=64", "--model.n_experts=4", "--model.k=2",
        "--model.ffn_expert=32", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.head_dim=16", "--model.mtp_depth=1",
        "--tokens_per_micro_batch=128", "--batch_schedule=0:2", "--steps=3", "--eval_every=3", "--eval_batches=3", "--warmup=1"]


def _cli(*args, ranks: int = 1):
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return run_in_session([*launch, str(ROOT / "examples" / "evaluate.py"), *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={out}", *TINY],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_s_defaults_reproduce_its_logged_validation_loss(run_dir):
    out, records = run_dir
    for path in (out, out / "step_000003"):
        cli = _cli(path, "--json")
        assert cli.returncode == 0, cli.stderr[-2000:]
        # stderr says which checkpoint (a run's out_dir names none) and which data were read
        assert {f"weights: {out / 'step_000003'}", "data: the embedded corpus (this Python's standard library sources)"} <= set(cli.stderr.splitlines())
        result = json.loads(cli.stdout)
        assert result["loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-5)
        assert {n: r["loss"] for n, r in result["by_source"].items()} == pytest.approx(records[-1]["val_loss_by_source"], rel=1e-5)
        assert len(result["mtp_losses"]) == 1 and result["mtp_losses"][0] > 0
    text = _cli(out)
    assert text.returncode == 0 and text.stdout.startswith("stdlib: ") and "bits per byte" in text.stdout and "mtp depth 1: loss" in text.stdout
    assert [line.split(":")[0] for line in text.stdout.splitlines()] == ["stdlib", "mtp depth 1"]  # one source: no "all" line repeating it


def test_torchrun_on_any_mesh_gives_the_one_process_numbers(run_dir):
    """2 ranks: FSDP2 with the 3 batches taken in turns (rank 1 runs one batch that it does
    not count), TP (the tp ranks' equal sums counted once), EP folded into TP, CP (each rank
    half of each batch's tokens; the weights gathered once, --keep_gathered)."""
    out, _ = run_dir
    one = _cli(out, "--json")
    assert one.returncode == 0, one.stderr[-2000:]
    want = json.loads(one.stdout)
    for knobs in ([], ["--tp=2", "--ep=2"], ["--cp=2", "--keep_gathered"]):
        cli = _cli(out, "--json", *knobs, ranks=2)
        assert cli.returncode == 0, (knobs, cli.stderr[-3000:])
        assert cli.stderr.count("weights: ") == cli.stderr.count("data: ") == 1, (knobs, cli.stderr)  # rank 0 says it
        lines = [line for line in cli.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, (knobs, cli.stdout)  # rank 0 prints
        got = json.loads(lines[0])
        assert got["tokens"] == want["tokens"] == 381 and got["by_source"]["stdlib"]["tokens"] == 381, knobs
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), knobs
        assert got["mtp_losses"] == pytest.approx(want["mtp_losses"], rel=1e-6), knobs


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A small directory of text documents (read as bytes)."""
    root = tmp_path_factory.mktemp("docs")
    for i in range(30):
        (root / f"{i}.txt").write_text(f"document {i}: " + "some text to score " * (i + 3))
    return root


def test_a_run_on_relative_data_evaluates_from_anywhere(tmp_path, docs):
    """A run trained on --data relative to its working directory: evaluate.py, started in
    another one, reads the same documents (config.json keeps the run's working directory)
    and gives the logged validation loss."""
    shutil.copytree(docs, tmp_path / "texts")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), "--out_dir=run", "--data=texts", *TINY],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["run"]["cwd"] == str(tmp_path) and config["data_sources"][0]["path"] == str(tmp_path / "texts")
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    cli = _cli(tmp_path / "run", "--json")  # from this process's directory
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert f"data: {tmp_path / 'texts'} (the run's --data)" in cli.stderr.splitlines(), cli.stderr  # the files read, named whole
    assert json.loads(cli.stdout)["loss"] == pytest.approx(logged, rel=1e-5)


def test_every_whole_micro_batch_of_other_data(run_dir, docs):
    out, _ = run_dir
    cli = _cli(out, f"--data={docs}", "--split=all", "--batches=0", "--tokens_per_micro_batch=256", "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    result = json.loads(cli.stdout)
    from fmoe.train.data import load_blend

    corpus = load_blend(str(docs), vocab_size=258)
    batches, sources = evaluate.data_batches(corpus, split="all", val_percent=5, tokens=256, n_batches=0, mtp_depth=1)
    batches, sources = list(batches), list(sources)  # made as they are read: evaluate reads them once
    assert len(batches) == corpus.n_tokens // 256 >= 20 and len(set(sources)) == 1 and result["micro_batches"] == len(batches)
    assert result["tokens"] == sum(int(b["loss_mask"].sum()) for b in batches) > 0.9 * len(batches) * 256
    # the same batches through the function, in this process
    model, _ = evaluate.load_model(out)
    again = evaluate.evaluate(model, batches, sources, device=torch.device("cpu"))
    assert again["loss"] == pytest.approx(result["loss"], rel=1e-6) and again["tokens"] == result["tokens"]


def test_every_micro_batch_is_made_as_it_is_read(run_dir, docs):
    """--batches=0 made a list of every micro-batch of the split before the first forward
    (~55 bytes per token: a 1B-token split held 55 GB): data_batches now makes each as
    evaluate reads it, one ahead of the forwards at most, and a mismatch of batches and
    sources is a ValueError."""
    from fmoe.train.data import load_blend

    out, _ = run_dir
    model, _ = evaluate.load_model(out)
    batches, sources = evaluate.data_batches(load_blend(str(docs), vocab_size=258), split="all", val_percent=5, tokens=256, n_batches=0,
                                             mtp_depth=1)
    made, ahead = [], []

    def counted(items):
        for item in items:
            made.append(1)
            yield item

    model.register_forward_pre_hook(lambda module, args: ahead.append(len(made) - len(ahead)))
    result = evaluate.evaluate(model, counted(batches), sources, device=torch.device("cpu"))
    assert result["micro_batches"] == len(made) == len(ahead) >= 20 and set(ahead) == {1}, ahead
    with pytest.raises(ValueError, match="^batches: expected one source name per batch and at least one batch"):
        evaluate.evaluate(model, [], [], device=torch.device("cpu"))
    one, = evaluate.data_batches(load_blend(str(docs), vocab_size=258), split="all", val_percent=5, tokens=256, n_batches=1, mtp_depth=1)[0]
    with pytest.raises(ValueError, match="^batches: expected one source name per batch .* more of one than of the other"):
        evaluate.evaluate(model, [one, one], ["a"], device=torch.device("cpu"))


def test_a_token_file_without_an_index_takes_separator_and_data_dtype(run_dir, tmp_path):
    """--data=tokens.bin (no .index.json): the loader needs the separator and the id type,
    train_moe's --separator and --data_dtype; evaluate had neither, so its error named a
    separator no flag could give."""
    from fmoe.train.data import load_blend

    out, _ = run_dir
    ids = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0))
    ids[::97] = 257  # the documents' separator
    raw = tmp_path / "raw.bin"
    raw.write_bytes(ids.numpy().astype("uint16").tobytes())
    knobs = ["--split=all", "--batches=2", "--tokens_per_micro_batch=128", "--json"]
    missing = _cli(out, f"--data={raw}", *knobs)
    assert missing.returncode != 0 and "separator: required" in missing.stderr, missing.stderr[-2000:]
    cli = _cli(out, f"--data={raw}", "--separator=257", "--data_dtype=uint16", *knobs)
    assert cli.returncode == 0, cli.stderr[-2000:]
    corpus = load_blend(str(raw), separator=257, vocab_size=258, dtype="uint16")
    batches, sources = evaluate.data_batches(corpus, split="all", val_percent=5, tokens=128, n_batches=2, mtp_depth=1)
    model, _ = evaluate.load_model(out)
    want = evaluate.evaluate(model, batches, sources, device=torch.device("cpu"))
    got = json.loads(cli.stdout)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["tokens"] == want["tokens"] > 0


def test_learned_positions_bound_the_micro_batch(tmp_path, docs):
    """A GPT-2 folder (64 learned positions) on long documents: a micro-batch of more tokens
    is refused naming --tokens_per_micro_batch; it stopped in the forward with a traceback."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    config = transformers.GPT2Config(vocab_size=260, n_embd=32, n_layer=1, n_head=4, n_positions=64, n_inner=40, bos_token_id=None,
                                     eos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    long = _cli(tmp_path / "gpt2", f"--data={docs}", "--tokens_per_micro_batch=128")
    assert long.returncode != 0 and "--tokens_per_micro_batch: expected at most 64 tokens, the model's learned positions" in long.stderr
    assert "Traceback" not in long.stderr, long.stderr[-2000:]
    fits = _cli(tmp_path / "gpt2", f"--data={docs}", "--tokens_per_micro_batch=64", "--split=all", "--batches=2", "--json")
    assert fits.returncode == 0 and json.loads(fits.stdout)["tokens"] > 0, fits.stderr[-2000:]


def test_a_hugging_face_folder_on_byte_data(tmp_path, docs):
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    import fmoe.hf
    from fmoe.train.data import load_blend

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    missing = _cli(tmp_path / "hf")
    assert missing.returncode != 0 and "--data: an HF folder needs data tokenized with its tokenizer" in missing.stderr
    cli = _cli(tmp_path / "hf", f"--data={docs}", "--split=all", "--batches=4", "--tokens_per_micro_batch=256", "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    result = json.loads(cli.stdout)
    model, _ = fmoe.hf.from_pretrained(tmp_path / "hf", impl="torch")
    corpus = load_blend(str(docs), vocab_size=260)
    want = evaluate.evaluate(model, corpus.validation_batches(256, 4), corpus.validation_sources(4), device=torch.device("cpu"))
    assert result["loss"] == pytest.approx(want["loss"], rel=1e-6) and result["tokens"] == want["tokens"]
    assert abs(result["loss"] - torch.log(torch.tensor(260.0)).item()) < 0.5  # a fresh model: near uniform
    # 2 ranks, the experts split over them (each reads its own), the rest FSDP2: the same numbers
    two = _cli(tmp_path / "hf", f"--data={docs}", "--split=all", "--batches=4", "--tokens_per_micro_batch=256", "--json", "--ep=2", ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    got = json.loads(two.stdout.splitlines()[-1])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["tokens"] == want["tokens"]
    # ids beyond the model's vocabulary are refused
    small = transformers.Qwen3MoeConfig(**{**config.to_dict(), "vocab_size": 257})
    transformers.AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path / "small")
    refused = _cli(tmp_path / "small", f"--data={docs}")
    assert refused.returncode != 0 and "the data's 258 token ids do not fit the model's vocab_size 257" in refused.stderr


def test_nothing_counted_is_no_loss_and_a_left_out_source_is_named(run_dir, tmp_path):
    """A source (or MTP depth) whose micro-batches count no token has no loss (None, JSON
    null), not 0 (perplexity 1, a perfect model); nothing counted at all stops with an
    error naming the knobs; with --batches=0 a source shorter than one micro-batch is named
    in a note, not left out in silence. --split=val needs no training documents; load_blend's
    errors are not prefixed "data: " twice."""
    from fmoe.train.data import make_batch

    out, _ = run_dir
    model, _ = evaluate.load_model(out)
    counted = make_batch(torch.arange(97, 105), torch.tensor([0, 8]), 1)
    ones = make_batch(torch.arange(97, 105), torch.arange(9), 1)  # 8 documents of one token: no next token in any
    got = evaluate.evaluate(model, [counted, ones], ["long", "ones"], device=torch.device("cpu"))
    assert got["by_source"]["ones"] == dict(loss=None, tokens=0) and got["tokens"] == got["by_source"]["long"]["tokens"] == 7
    assert got["loss"] == pytest.approx(got["by_source"]["long"]["loss"]) and got["mtp_losses"][0] > 0
    alone = evaluate.evaluate(model, [ones], ["ones"], device=torch.device("cpu"))
    assert alone["loss"] is None and alone["tokens"] == 0 and alone["mtp_losses"] == [None]
    (small := tmp_path / "small").mkdir()
    for i, text in enumerate(["def f(x):\n", "import os, sys\nprint(os)\n", "class A:\n    pass\n"]):
        (small / f"{i}.txt").write_text(text)  # 56 tokens with their ends of document
    (short := tmp_path / "short").mkdir()
    (short / "a.txt").write_text("ab")  # 3 tokens
    blend = f"--data=0.5:{small},0.5:{short}"
    cases = exits(ROOT / "examples" / "evaluate.py", [
        [out, f"--data={small}", "--split=all", "--batches=0", "--tokens_per_micro_batch=1"],  # a token alone in each micro-batch
        [out, blend, "--split=all", "--batches=0", "--tokens_per_micro_batch=8", "--json"],
        [out, blend, "--split=all", "--batches=2", "--tokens_per_micro_batch=2", "--json"],  # one label each, none 2 ahead (MTP)
        [out, f"--data={small}", "--val_percent=100", "--split=val", "--batches=1", "--tokens_per_micro_batch=8"],
        [out, f"--data={tmp_path / 'nowhere'}"],
        [out, f"--data={small}", "--split=all", "--batches=0", "--tokens_per_micro_batch=32", "--whole_documents", "--json"],
        [out, f"--data=0.9:{small},0.1:{short}", "--split=all", "--batches=1", "--tokens_per_micro_batch=8", "--json"],
    ])
    assert cases[0]["status"] != 0 and ("--tokens_per_micro_batch, --batches: no token was counted in 56 micro-batch(es) of 1 tokens"
                                        in cases[0]["text"]), cases[0]
    assert cases[1]["status"] == 0 and "note: source 'short' is left out: it holds fewer than one micro-batch of 8 tokens" in cases[1]["text"]
    assert list(json.loads(cases[1]["out"])["by_source"]) == ["small"], cases[1]
    assert cases[2]["status"] == 0 and json.loads(cases[2]["out"])["mtp_losses"] == [None], cases[2]
    assert cases[3]["status"] == 0 and cases[3]["out"].startswith("small: 7 tokens, loss "), cases[3]  # was "no training documents ..."
    assert cases[4]["status"] != 0 and cases[4]["text"].startswith("data: source ") and "data: data:" not in cases[4]["text"], cases[4]
    from fmoe.train.data import load_blend

    whole = [evaluate.evaluate(model, *evaluate.data_batches(load_blend(str(small), vocab_size=258), split="all", val_percent=5, tokens=32,
                                                               n_batches=0, mtp_depth=1, whole_documents=w), device=torch.device("cpu"))
             for w in (True, False)]
    assert cases[5]["status"] == 0, cases[5]
    got = json.loads(cases[5]["out"])
    assert (got["tokens"], got["micro_batches"]) == (whole[0]["tokens"], whole[0]["micro_batches"]) != (whole[1]["tokens"], whole[1]["micro_batches"])
    assert got["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)
    assert cases[6]["status"] == 0 and "note: source 'short' is left out: its weight's share of the 1 --batches is none" in cases[6]["text"], cases[6]


def test_a_source_without_a_counted_token_prints_no_loss(capsys):
    result = dict(loss=2.0, tokens=7, by_source=dict(a=dict(loss=2.0, tokens=7), b=dict(loss=None, tokens=0)), mtp_losses=[None])
    evaluate.report(result, unit="byte", as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "b: 0 tokens, no loss: no token with a next one in its document and micro-batch was counted"
    assert lines[2].startswith("all: 7 tokens, loss 2.0000") and lines[3] == "mtp depth 1: no loss: no token was counted at this depth"
    evaluate.report(result, unit="byte", as_json=True)
    got = json.loads(capsys.readouterr().out)
    assert got["by_source"]["b"] == {"loss": None, "tokens": 0, "perplexity": None, "bits_per_byte": None}
    assert got["by_source"]["a"]["perplexity"] == got["perplexity"] == pytest.approx(math.exp(2.0)) and got["mtp_losses"] == [None]


def test_json_has_the_perplexity_and_bits_the_text_prints(capsys):
    """--json printed the loss and tokens only: a script wanting the perplexity had to
    take exp() itself. The JSON now holds the numbers the text prints, overall and per source."""
    result = dict(loss=2.0, tokens=7, by_source=dict(a=dict(loss=1.5, tokens=3), b=dict(loss=2.375, tokens=4)), mtp_losses=[3.0])
    evaluate.report(result, unit="token", as_json=True)
    got = json.loads(capsys.readouterr().out)
    assert got["perplexity"] == pytest.approx(math.exp(2.0)) and got["bits_per_token"] == pytest.approx(2.0 / math.log(2))
    assert got["by_source"]["a"]["perplexity"] == pytest.approx(math.exp(1.5)) and "bits_per_byte" not in got
    evaluate.report(result, unit="token", as_json=False)
    text = capsys.readouterr().out.splitlines()
    assert text[2] == f"all: 7 tokens, loss 2.0000, perplexity {got['perplexity']:.3f}, bits per token {got['bits_per_token']:.4f}"


def test_a_diverged_run_s_numbers_print_as_strict_json(capsys):
    """A finite loss past 709.78 (a diverged run) stopped the report on math.exp's OverflowError, and a NaN loss printed
    bare NaN, which strict JSON readers refuse: now perplexity inf, and "inf" / "nan" as config.json writes them."""
    result = dict(loss=800.0, tokens=7, by_source=dict(a=dict(loss=800.0, tokens=3), b=dict(loss=float("nan"), tokens=4)), mtp_losses=[float("inf")])
    evaluate.report(result, unit="token", as_json=True)
    got = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"not strict JSON: {name}"))
    assert got["perplexity"] == "inf" and got["loss"] == 800.0 and got["mtp_losses"] == ["inf"]
    assert got["by_source"]["b"]["loss"] == got["by_source"]["b"]["perplexity"] == "nan"  # a NaN loss's perplexity NaN, not inf
    evaluate.report(result, unit="token", as_json=False)
    assert capsys.readouterr().out.splitlines()[0] == "a: 3 tokens, loss 800.0000, perplexity inf, bits per token 1154.1560"
    assert evaluate.with_rates(dict(loss=705.0, tokens=1), "token")["perplexity"] == math.exp(705.0) < math.inf


def test_dtype_defaults_to_the_run_s_own(tmp_path):
    """evaluate.py loaded every run in float32: a bf16 run's defaults missed its logged validation loss (2.9e-4 off).
    --dtype now defaults to the run's (auto: bfloat16 on cuda, float32 elsewhere), float32 for an HF folder."""
    for dtype, device, want in (("bfloat16", "cpu", "bfloat16"), ("auto", "cpu", "float32"), ("auto", "cuda", "bfloat16"), ("float16", "cuda", "float16")):
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "config.json").write_text(json.dumps({"config": {"dtype": dtype}}))
        for path in (tmp_path / "run", tmp_path / "run" / "step_000003"):
            assert evaluate._run_dtype(path, torch.device(device)) == want, (dtype, device, path)
    for hf in (tmp_path / "hf", tmp_path / "run" / "hf"):  # an HF folder: one exported inside the run too
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "torch_dtype": "bfloat16"}))
        assert evaluate._run_dtype(hf, torch.device("cuda")) == "float32", hf


def test_main_loads_the_model_in_the_run_s_dtype(tmp_path, monkeypatch):
    """evaluate.main takes --dtype's default from _run_dtype (a bf16 run was loaded in float32)."""
    (tmp_path / "config.json").write_text(json.dumps({"config": {"dtype": "bfloat16"}}))
    asked = []

    class Loaded(Exception):
        pass

    def load_model(path, *, impl, dtype, device):
        asked.append(dtype)
        raise Loaded

    monkeypatch.setattr(evaluate, "load_model", load_model)
    for argv, want in (([], torch.bfloat16), (["--dtype=float32"], torch.float32)):
        with pytest.raises(Loaded):
            evaluate.main([str(tmp_path), *argv])
        assert asked.pop() == want


BAD_KNOBS = [
    (["--split=test"], "argument --split: invalid choice: 'test'"),
    (["--batches=-1"], "--batches: expected >= 0"),
    (["--tokens_per_micro_batch=0"], "--tokens_per_micro_batch: expected >= 1 (leave it out for the run's), got 0"),
    (["--tokens_per_micro_batch=100000000", "--batches=0", "--split=val"], "--tokens_per_micro_batch: no source of the val split holds"),
    (["--batches=100000"], "n_batches: 100000 batches of 128 tokens need"),
    (["--tp=2"], "parallel knobs (--tp, --ep, --etp, --cp) for 1 process(es), the rest FSDP2: "),
    (["--tokenizer=t.json"], "--tokenizer: it encodes --choices' texts, which are not given (a loss on token data needs no tokenizer)"),
    (["--questions=3"], "--questions: counts the questions of --choices, which is not given"),
    (["--separator=-2"], "--separator: expected a token id >= 0, got -2"),
    (["--separator=-1"], "--separator: expected a token id >= 0, got -1"),
    # no effect without a word before
    (["--delimiter= "], "--delimiter: goes between a context and each choice of --choices, which is not given (got ' ')"),
    (["--separator=5"], "--separator=5: applies to token files; this data is bytes (text files or the embedded corpus)"),
]


@pytest.mark.parametrize("case", range(len(BAD_KNOBS)), ids=[" ".join(args) for args, _ in BAD_KNOBS])
def test_bad_knobs_stop_with_a_message(bad_exits, case):
    got = bad_exits["knobs"][case]
    assert got["status"] != 0 and BAD_KNOBS[case][1] in got["text"], got["text"][-2000:]


def _reference_logprob(logits_fn, context, continuation):
    """log p(continuation | context) from one forward of the document alone."""
    ids = torch.tensor(context + continuation)
    logp = torch.log_softmax(logits_fn(ids[:-1]).double(), dim=-1)
    rows = torch.arange(len(context) - 1, len(ids) - 1)
    return logp[rows, ids[rows + 1]].sum().item()


def test_choice_logprobs_equal_each_document_alone(run_dir):
    """Packed into micro-batches of 64 tokens (several documents each, a context longer than
    one cut from the left), every continuation's log-probability equals the one of its
    document run alone."""
    model, _ = evaluate.load_model(run_dir[0])
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 256, (int(n),), generator=g).tolist(), torch.randint(0, 256, (int(m),), generator=g).tolist())
             for n, m in zip(torch.randint(1, 30, (12,), generator=g), torch.randint(1, 8, (12,), generator=g))]
    pairs.append((list(range(100)), [7, 8, 9]))  # 100 + 2 tokens do not fit 64: the context keeps its last 62
    got, cut = evaluate.choice_logprobs(model, pairs, tokens=64, device=torch.device("cpu"))
    assert cut == 1 and len(got) == len(pairs)
    one = lambda ids: model.logits(ids, torch.tensor([0, len(ids)], dtype=torch.int32))  # noqa: E731
    with torch.no_grad():
        want = [_reference_logprob(one, c[-62:], m) for c, m in pairs]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert all(x < 0 for x in got)
    with pytest.raises(ValueError, match="a continuation of 70 tokens needs more than 64"):
        evaluate.choice_logprobs(model, [([1], [2] * 70)], tokens=64, device=torch.device("cpu"))
    for bad in ([], [([1], [])], [([], [1])]):
        with pytest.raises(ValueError, match="pairs: expected at least one"):
            evaluate.choice_logprobs(model, bad, tokens=64, device=torch.device("cpu"))


def test_score_choices_counts_the_best_choice_and_breaks_ties_to_the_first():
    questions = [dict(choices=[[1], [2]], answer=0, lengths=[1, 10]), dict(choices=[[1], [2], [3]], answer=2, lengths=[1, 1, 20]),
                 dict(choices=[[1], [2]], answer=1, lengths=[1, 1])]
    result = evaluate.score_choices(questions, [-1.0, -2.0, -3.0, -5.0, -4.0, -2.0, -2.0])
    # q0: right (-1 > -2), normalised wrong (-1 < -0.2); q1: wrong (-3 best), normalised right (-0.2); q2: a tie goes to choice 0
    assert result == dict(questions=3, accuracy=pytest.approx(1 / 3), accuracy_norm=pytest.approx(1 / 3),
                          logprobs=[[-1.0, -2.0], [-3.0, -5.0, -4.0], [-2.0, -2.0]])
    # each question alone: the totals above agree with a norm that forgets the lengths (q0 and q1 swap), these do not
    for question, lp, right, right_norm in ((questions[0], [-1.0, -2.0], 1.0, 0.0), (questions[1], [-3.0, -5.0, -4.0], 0.0, 1.0),
                                            (questions[2], [-2.0, -2.0], 0.0, 0.0)):
        alone = evaluate.score_choices([question], lp)
        assert (alone["accuracy"], alone["accuracy_norm"]) == (right, right_norm), question


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


QUESTIONS = [dict(context="import ", choices=["os", "zzqx"], answer=0), dict(context="def f(x):\n    return", choices=[" x", "@@@", " (x)"], answer=0),
             dict(context_ids=[1, 2, 3], choices_ids=[[4], [5, 6]], answer=1), dict(context="for i in ", choices=["range(10):", "q!"], answer=1)]


def test_choices_of_a_run_on_one_process_and_under_torchrun(run_dir, tmp_path):
    """--choices scores texts (bytes for a byte run) and token ids: the CLI's numbers are
    read_choices + choice_logprobs + score_choices in this process; --questions takes the
    first ones; 2 ranks (FSDP2 taking turns over 3 micro-batches; TP padding odd batches)
    give the one-process log-probabilities."""
    out = run_dir[0]
    path = _write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    cli = _cli(out, f"--choices={path}", "--tokens_per_micro_batch=16", "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    result = json.loads(cli.stdout)
    model, run = evaluate.load_model(out)
    encode, _, _ = evaluate.text_codec(out, model, run)
    assert run["byte_tokens"] is True  # the stdlib corpus; a config.json from before the field: its sources (the stdlib) decide
    assert evaluate.text_codec(out, model, {k: v for k, v in run.items() if k != "byte_tokens"})[0]("ab") == [97, 98]
    questions = evaluate.read_choices(path, encode)
    # the context's trailing space moves to the choice (lm-evaluation-harness's pairing): the same bytes, split at the word
    assert questions[0]["contexts"] == [list(b"import")] * 2 and questions[0]["choices"] == [list(b" os"), list(b" zzqx")]
    assert questions[1]["choices"][2] == list(b" (x)") and questions[1]["lengths"] == [2, 3, 4] and questions[0]["lengths"] == [2, 4]
    # lm-evaluation-harness's files: choices written without their space, --delimiter=" ": the same pairs, and each length the
    # choice's own characters (acc_norm's), not the delimiter's too
    harness = _write_jsonl(tmp_path / "harness.jsonl", [dict(context="import", choices=["os", "zzqx"], answer=0)])
    assert evaluate.read_choices(harness, encode, delimiter=" ") == questions[:1]
    logprobs, cut = evaluate.choice_logprobs(model, [p for q in questions for p in zip(q["contexts"], q["choices"])], tokens=16,
                                             device=torch.device("cpu"))
    assert cut == 4  # the 20 bytes of "def f(x):\n    return" and any choice do not fit 16, nor "for i in " + "range(10):"
    assert result == dict(evaluate.score_choices(questions, logprobs), choices_cut=4)
    assert [len(lp) for lp in result["logprobs"]] == [2, 3, 2, 2]
    text = _cli(out, f"--choices={path}", "--questions=2", "--tokens_per_micro_batch=16")
    assert text.returncode == 0, text.stderr[-2000:]
    first, first_cut = evaluate.choice_logprobs(model, [p for q in questions[:2] for p in zip(q["contexts"], q["choices"])], tokens=16,
                                                device=torch.device("cpu"))
    two = evaluate.score_choices(questions[:2], first)
    assert first_cut == 3 and two["accuracy"] != two["accuracy_norm"], two
    assert text.stdout == (f"q.jsonl: 2 questions, accuracy {two['accuracy']:.4f}, length-normalised accuracy {two['accuracy_norm']:.4f} "
                           "(3 choices scored after a context cut to fit 16 tokens)\n"), text.stdout
    for knobs in ([], ["--tp=2", "--ep=2"]):
        two = _cli(out, f"--choices={path}", "--tokens_per_micro_batch=16", "--json", *knobs, ranks=2)
        assert two.returncode == 0, (knobs, two.stderr[-3000:])
        lines = [line for line in two.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, (knobs, two.stdout)
        got = json.loads(lines[0])
        assert [x for lp in got["logprobs"] for x in lp] == pytest.approx(logprobs, rel=1e-5), knobs
        assert (got["accuracy"], got["accuracy_norm"], got["choices_cut"]) == (result["accuracy"], result["accuracy_norm"], 4), knobs


def test_choices_of_a_hugging_face_folder_are_transformers_log_probabilities(tmp_path):
    """An HF folder's tokenizer.json: the context with its BOS, each choice without; the
    log-probabilities are transformers' own."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    vocab = {f"w{i}": i for i in range(62)} | {"[UNK]": 62, "<s>": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 63)])
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    # choices written as lm-evaluation-harness writes them, the delimiter given; and with their space, none given
    rows = [dict(context="w1 w2 w3", choices=["w4 w5", "w6", "w7 w8 w9"], answer=2), dict(context="w10", choices=["w11", "w12 w13"], answer=0)]
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    cli = _cli(tmp_path / "hf", f"--choices={path}", "--json", "--delimiter= ")
    assert cli.returncode == 0, cli.stderr[-2000:]
    got = json.loads(cli.stdout)["logprobs"]
    spaced = _write_jsonl(tmp_path / "spaced.jsonl", [dict(r, choices=[" " + c for c in r["choices"]]) for r in rows])
    assert json.loads(_cli(tmp_path / "hf", f"--choices={spaced}", "--json").stdout)["logprobs"] == got
    with torch.no_grad():
        one = lambda ids: ref(ids[None]).logits[0]  # noqa: E731
        want = [[_reference_logprob(one, [63, 1, 2, 3], [4, 5]), _reference_logprob(one, [63, 1, 2, 3], [6]),
                 _reference_logprob(one, [63, 1, 2, 3], [7, 8, 9])],
                [_reference_logprob(one, [63, 10], [11]), _reference_logprob(one, [63, 10], [12, 13])]]
    assert [x for lp in got for x in lp] == pytest.approx([x for lp in want for x in lp], rel=1e-5)


BAD_CHOICES = [
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--tokenizer=t.json"],
     "--tokenizer: it replaces the tokenizer a run on prepared token files names; this run's data are bytes, which need none"),
    ([dict(context="a", choices=["b"], answer=0)], [], "q.jsonl:1: expected 'context' a text and 'choices' a list of at least 2"),
    ([dict(context="a", choices=["b", "c"], answer=2)], [], "q.jsonl:1: answer: expected the index of the right choice, 0..1, got 2"),
    ([dict(context="a", choices=["b", "c"], answer=0), dict(context="", choices=["b", "c"], answer=0)], [], "q.jsonl:2: context: empty"),
    ([dict(context="a", choices=["b", ""], answer=0)], [], "q.jsonl:1: choices: a choice without tokens"),
    ([dict(context="a", choices_ids=[[1], [2]], answer=0)], [], "expected texts (context, choices) or token ids"),
    ([dict(context_ids=[1], choices_ids=[[1], [-2]], answer=0)], [], "token ids: expected non-negative ints"),
    ([dict(context_ids=[1], choices_ids=[[1], [300]], answer=0)], [], "token ids beyond the model's vocab_size 258"),
    ([["a", "b"]], [], "q.jsonl:1: expected an object with context, choices and answer, got list"),
    ([], [], "q.jsonl: no questions"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--questions=-1"], "--questions: expected >= 0"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--cp=2"], "--cp: choices are scored with model.logits"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--data=x", "--batches=2"], "--choices: the questions are the data; --data, --batches do not apply"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--split=all", "--val_percent=50"],
     "--choices: the questions are the data; --split, --val_percent do not apply"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--split=val"], "--choices: the questions are the data; --split does not apply"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--whole_documents"], "--choices: the questions are the data; --whole_documents does not apply"),
    ([dict(context="a", choices=["b", "c"], answer=0)], ["--separator=3", "--data_dtype=uint16"],
     "--choices: the questions are the data; --separator, --data_dtype do not apply"),
    ([dict(context_ids=[1], choices_ids=[[258], [1]], answer=0)], [], "q.jsonl: token ids beyond the model's vocab_size 258"),
    ([dict(context="a", choices=["b" * 200, "c"], answer=0)], ["--tokens_per_micro_batch=128"],
     "--tokens_per_micro_batch: a continuation of 200 tokens needs more than 128"),
]


@pytest.fixture(scope="module")
def bad_exits(run_dir, tmp_path_factory):
    """How evaluate's main stops for each BAD_KNOBS and BAD_CHOICES case (each case's questions
    in its own q.jsonl), all in one process (tests/exits.py); the command line's own exit:
    test_a_hugging_face_folder_on_byte_data."""
    root = tmp_path_factory.mktemp("bad")
    knobs = [[run_dir[0], *args] for args, _ in BAD_KNOBS]
    choices = []
    for i, (rows, args, _) in enumerate(BAD_CHOICES):
        (root / str(i)).mkdir()
        choices.append([run_dir[0], f"--choices={_write_jsonl(root / str(i) / 'q.jsonl', rows)}", *args])
    got = exits(ROOT / "examples" / "evaluate.py", knobs + choices + [[root]])
    return dict(knobs=got[:len(knobs)], choices=got[len(knobs):-1], not_a_run=got[-1])


def test_a_path_that_is_no_run_is_named_once(bad_exits):
    got = bad_exits["not_a_run"]
    assert got["status"] != 0 and "is neither an fmoe run directory" in got["text"], got["text"][-2000:]
    assert got["text"].count("path: ") == 1, got["text"][-2000:]  # it said "path: path: '...'"


@pytest.mark.parametrize("case", range(len(BAD_CHOICES)), ids=[BAD_CHOICES[i][2][:80] for i in range(len(BAD_CHOICES))])
def test_bad_choices_stop_with_a_message(bad_exits, case):
    got = bad_exits["choices"][case]
    assert got["status"] != 0 and BAD_CHOICES[case][2] in got["text"], got["text"][-2000:]


def test_a_run_without_validation_has_no_split_of_its_own_to_measure(run_dir, tmp_path):
    """A run trained with --eval_batches=0 held no document out, so --split=val of its own data
    (documents it trained on) is refused; --split=train measures its fit, 16 batches by default."""
    out = tmp_path / "run"
    shutil.copytree(run_dir[0], out)
    config = json.loads((out / "config.json").read_text())
    config["config"]["eval_batches"] = 0
    (out / "config.json").write_text(json.dumps(config))
    got = exits(ROOT / "examples" / "evaluate.py", [[out], [out, "--split=train", "--json"], [out, "--data=", "--split=val", "--batches=1"]])
    assert got[0]["status"] != 0 and "data: --split=val: the run held no documents out (it trained with --eval_batches=0" in got[0]["text"]
    assert got[1]["status"] == 0 and 15 * 128 < json.loads(got[1]["out"])["tokens"] <= 16 * 128, got[1]  # labels of 16 batches, not all
    assert got[2]["status"] == 0, got[2]  # other data given: its validation split is the user's to choose


def test_a_context_and_its_choice_are_tokenized_together_as_lm_evaluation_harness_pairs_them():
    """Tokenized apart, a context ending in a space and its choice were scored on tokens the
    model never reads ("batch " + "to": "Ġ" "t" "o" where the text reads "Ġto", up to 22 nats
    apart). pair_ids moves the trailing space into the choice and tokenizes the two together
    (lm_eval/api/model.py's _encode_pair); a token across the boundary is the choice's."""
    vocab = {"<s>": 0, "batch": 1, " to": 2, " ": 3, "to": 4, **{c: 10 + i for i, c in enumerate("abchot")}}

    def encode(text, special=True):  # greedy longest match, a BOS before a text with special
        ids, i = ([0] if special else []), 0
        while i < len(text):
            piece = max((p for p in vocab if p != "<s>" and text.startswith(p, i)), key=len)
            ids.append(vocab[piece])
            i += len(piece)
        return ids

    assert evaluate.pair_ids(encode, "batch ", "to") == ([0, 1], [2])  # apart: [0, 1, 3] and [4]
    assert evaluate.pair_ids(encode, "batch", " to") == ([0, 1], [2])
    assert evaluate.pair_ids(encode, "bat", "ch to") == ([0], [1, 2])  # "batch" spans the boundary: the choice's
    assert evaluate.pair_ids(encode, "batch", "") == ([0, 1], [])  # nothing to score: apart, then refused by read_choices
    byte = lambda text, special=True: list(text.encode())  # noqa: E731
    assert evaluate.pair_ids(byte, "import ", "os") == (list(b"import"), list(b" os"))


def test_evaluate_sums_every_source_and_each_mtp_depth_over_its_own_tokens(run_dir):
    """Batches of two sources, interleaved: each source's loss and tokens are its own batches'
    sums, the overall loss every counted token's mean (not one source's), the tokens all of
    them, each MTP depth's loss over that depth's own tokens."""
    from fmoe.train.data import make_batch

    model, _ = evaluate.load_model(run_dir[0])
    a = make_batch(torch.arange(97, 109), torch.tensor([0, 12]), 1)
    b = make_batch(torch.arange(100, 116), torch.tensor([0, 5, 16]), 1)
    with torch.no_grad():
        model.eval()
        sums = {id(x): {k: float(v) for k, v in model(x, model.context(x))[0].items() if k.endswith(("sum", "tokens"))} for x in (a, b)}
    got = evaluate.evaluate(model, [a, b, a], ["x", "y", "x"], device=torch.device("cpu"))
    sa, sb = sums[id(a)], sums[id(b)]
    assert list(got["by_source"]) == ["x", "y"] and got["micro_batches"] == 3
    assert got["by_source"]["x"]["tokens"] == 2 * sa["lm_tokens"] == 22 and got["by_source"]["y"]["tokens"] == sb["lm_tokens"] == 14
    assert got["tokens"] == 36
    assert got["by_source"]["x"]["loss"] == pytest.approx(sa["lm_sum"] / sa["lm_tokens"], rel=1e-6)
    assert got["by_source"]["y"]["loss"] == pytest.approx(sb["lm_sum"] / sb["lm_tokens"], rel=1e-6)
    assert got["loss"] == pytest.approx((2 * sa["lm_sum"] + sb["lm_sum"]) / 36, rel=1e-6)
    assert sa["mtp_1_tokens"] + sb["mtp_1_tokens"] < sa["lm_tokens"] + sb["lm_tokens"]
    assert got["mtp_losses"] == pytest.approx([(2 * sa["mtp_1_sum"] + sb["mtp_1_sum"]) / (2 * sa["mtp_1_tokens"] + sb["mtp_1_tokens"])], rel=1e-6)


def test_data_batches_take_the_split_asked_and_whole_documents(docs):
    from fmoe.train.data import load_blend

    corpus = load_blend(str(docs), vocab_size=258)
    with pytest.raises(ValueError, match="^--split: expected val, train or all, got 'test'"):
        evaluate.data_batches(corpus, split="test", val_percent=5, tokens=128, n_batches=2, mtp_depth=1)
    train, val = corpus.split(20)
    for split, part in (("train", train), ("val", val)):
        batches, sources = evaluate.data_batches(corpus, split=split, val_percent=20, tokens=128, n_batches=2, mtp_depth=1)
        want = part.validation_batches(128, 2, mtp_depth=1)
        assert [b["input_ids"].tolist() for b in batches] == [b["input_ids"].tolist() for b in want] and sources == corpus.names[:1] * 2, split
    assert (evaluate.data_batches(corpus, split="train", val_percent=20, tokens=128, n_batches=1, mtp_depth=1)[0][0]["input_ids"].tolist()
            != val.validation_batches(128, 1, mtp_depth=1)[0]["input_ids"].tolist())
    # a source of exactly one micro-batch's tokens has that one micro-batch
    exact = list(evaluate.data_batches(corpus, split="all", val_percent=5, tokens=corpus.n_tokens, n_batches=0, mtp_depth=1)[0])
    assert len(exact) == 1 and exact[0]["input_ids"].numel() == corpus.n_tokens
    for n_batches in (0, 2):
        padded, _ = evaluate.data_batches(corpus, split="all", val_percent=5, tokens=128, n_batches=n_batches, mtp_depth=1,
                                          whole_documents=True)
        plain, _ = evaluate.data_batches(corpus, split="all", val_percent=5, tokens=128, n_batches=n_batches, mtp_depth=1)
        padded, plain = list(padded), list(plain)
        assert "token_mask" in padded[0].keys() and "token_mask" not in plain[0].keys(), n_batches
        assert padded[1]["input_ids"].tolist() != plain[1]["input_ids"].tolist(), n_batches


def test_read_choices_refuses_each_bad_line_and_skips_blank_ones(tmp_path):
    byte = lambda text, special=True: list(text.encode())  # noqa: E731
    ok = dict(context="a", choices=["b", "c"], answer=0)
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(ok) + "\n\n   \n" + json.dumps(dict(context_ids=[1, 2], choices_ids=[[3], [4, 5, 6]], answer=1)) + "\n")
    got = evaluate.read_choices(path, byte)
    assert [q["answer"] for q in got] == [0, 1] and got[1]["lengths"] == [1, 3] and got[1]["contexts"] == [[1, 2], [1, 2]]
    assert evaluate.read_choices(path, byte, limit=1) == got[:1]
    for row, message in (
            ("{not json", "q.jsonl:1: not JSON ("),
            (dict(ok, answer=True), "q.jsonl:1: answer: expected the index of the right choice, 0..1, got True"),
            (dict(context_ids=[1], choices_ids=[[True], [2]], answer=0), "q.jsonl:1: token ids: expected non-negative ints"),
            (dict(choices=["b", "c"], context_ids=[1], answer=0), "q.jsonl:1: expected texts (context, choices) or token ids"),
    ):
        path.write_text((row if isinstance(row, str) else json.dumps(row)) + "\n")
        with pytest.raises(ValueError, match=re.escape(message)):
            evaluate.read_choices(path, byte)
    path.write_text(json.dumps(dict(context_ids=[1], choices_ids=[[2], [3]], answer=0)) + "\n")
    with pytest.raises(ValueError, match="q.jsonl:1: --delimiter: goes between texts, and this question gives token ids"):
        evaluate.read_choices(path, byte, delimiter=" ")


def test_choice_logprobs_cut_a_context_only_past_the_micro_batch(run_dir):
    """A context that fits with its continuation exactly is not cut; a continuation of one
    token more than the micro-batch is refused, one of as many keeps one context token."""
    model, _ = evaluate.load_model(run_dir[0])
    cpu = torch.device("cpu")
    assert evaluate.choice_logprobs(model, [(list(range(60)), [1, 2, 3, 4, 5])], tokens=64, device=cpu)[1] == 0
    assert evaluate.choice_logprobs(model, [(list(range(61)), [1, 2, 3, 4, 5])], tokens=64, device=cpu)[1] == 1
    with pytest.raises(ValueError, match="a continuation of 65 tokens needs more than 64"):
        evaluate.choice_logprobs(model, [([1, 2], [3] * 65)], tokens=64, device=cpu)
    got, cut = evaluate.choice_logprobs(model, [([1, 2], [3] * 64)], tokens=64, device=cpu)
    one = lambda ids: model.logits(ids, torch.tensor([0, len(ids)], dtype=torch.int32))  # noqa: E731
    with torch.no_grad():
        assert cut == 1 and got == pytest.approx([_reference_logprob(one, [2], [3] * 64)], rel=1e-5)
