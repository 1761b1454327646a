"""examples/export_hf.py: an fmoe run as a Hugging Face folder. A run of fmoe's own exported
with --model_type (its MTP module as the layer after the trunk's, in shards) and a run
started from an HF folder (its config and tokenizer files kept, the MTP module left out,
another dtype) load in transformers with the run's logits and back into fmoe with its
weights; two torchrun ranks write one process's files; bad knobs stop with a message."""

import collections
import dataclasses
import filecmp
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")

import fmoe.hf as hf  # noqa: E402
from fmoe.train import checkpoint  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import export_hf  # noqa: E402
from generate import load_run, stop_ids, text_codec  # noqa: E402

from fmoe.train.data import read_index  # noqa: E402
from tests.sessions import run_in_session  # noqa: E402

# how the runs train (a Hugging Face folder's run takes these alone: its architecture is the folder's), then the model
RUN = ["--model.mtp_depth=1", "--tokens_per_micro_batch=128", "--batch_schedule=0:2", "--steps=2", "--eval_every=2", "--eval_batches=1",
       "--warmup=1", "--model.impl=torch", "--lr=1e-2"]
TINY = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.ffn_dense=64", "--model.n_experts=4", "--model.k=2",
        "--model.ffn_expert=32", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.head_dim=16", *RUN]
SHARD_GB = 2e-5  # 20 kB shards: several files for these tiny models


def _train(out, *args, knobs=TINY):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={out}", *knobs, *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _export(*args, ranks=1):
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return run_in_session([*launch, str(ROOT / "examples" / "export_hf.py"), *map(str, args)], capture_output=True, text=True, timeout=600)


def _docs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(vocab, (n,), generator=g) for n in (7, 12)]
    return docs, torch.cat(docs), torch.tensor([0, 7, 19], dtype=torch.int32)


def _own_run_exported(tmp_path, knobs, model_type):
    """A run of fmoe's own with these knobs, exported with --model_type: (its config.json,
    the run's model)."""
    run = _train(tmp_path / "run", knobs=knobs)
    cli = _export(run, tmp_path / "out", f"--model_type={model_type}")
    assert cli.returncode == 0, cli.stderr[-3000:]
    return json.loads((tmp_path / "out" / "config.json").read_text()), load_run(run)[0]


def _loads_whole_with_the_run_s_logits(path, model):
    """transformers loads the export at path with no key missing or unexpected, and gives the
    run's model's logits on byte data (its vocabulary)."""
    docs, ids, cu = _docs(258)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert _rel(_transformers_logits(path, docs), model.logits(ids, cu)) < 1e-5


def _transformers_logits(path, docs, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return torch.cat([model(d[None]).logits[0] for d in docs]).float()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A run of fmoe's own model (sigmoid routing with expert biases, a shared expert, a
    dense first layer: GLM-4.5's model) with an MTP module that has its own output norm."""
    return _train(tmp_path_factory.mktemp("own"), "--model.mtp_norm=True")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A run started from a Qwen3-MoE folder (with a tokenizer file beside its weights),
    with an MTP module that no Qwen3-MoE checkpoint holds."""
    root = tmp_path_factory.mktemp("hf_run")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    tokens = root / "tokens.bin"  # the folder's ids (its tokenizer's): documents of random ids, 259 between them
    ids = torch.randint(0, 259, (20000,), generator=torch.Generator().manual_seed(0))
    ids[::150] = 259
    tokens.write_bytes(ids.numpy().astype("uint16").tobytes())
    return root / "hf", _train(root / "run", f"--init_from_hf={root / 'hf'}", f"--data={tokens}", "--separator=259", "--data_dtype=uint16",
                               knobs=RUN)


def test_a_folder_with_a_tokenizer_refuses_byte_data(hf_run, tmp_path):
    """The folder's model reads its tokenizer's ids: the byte corpus (no --data) trained it on
    bytes read as those ids, and the export then shipped the tokenizer beside it."""
    folder, _ = hf_run
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run'}", *RUN,
                          f"--init_from_hf={folder}"], capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and f"--data: the model of --init_from_hf reads the ids of its tokenizer ({str(folder / 'tokenizer.json')!r}), " \
        "the data is bytes" in run.stderr, run.stderr[-2000:]


def test_a_run_of_fmoe_s_own_exports_in_shards_with_its_mtp_layer(own_run, tmp_path):
    model, run_config = load_run(own_run)
    cli = _export(own_run, tmp_path / "out", "--model_type=glm4_moe", f"--max_shard_gb={SHARD_GB}")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert run_config["checkpoint"].startswith(str(own_run / "step_")) and f"weights: {run_config['checkpoint']}" in cli.stderr.splitlines()
    out = tmp_path / "out"
    assert cli.stdout.startswith(f"{out}: glm4_moe, ") and "left out" not in cli.stdout and "copied" not in cli.stdout
    # transformers loads the model without its MTP layer and reports the layer's keys as unexpected: said, not a broken-looking export
    assert cli.stdout.splitlines()[-1] == (f"note: the MTP module is layer {model.cfg.n_layers}, as glm4_moe checkpoints hold them; transformers' "
                                           "Glm4MoeForCausalLM has no MTP layer and lists their weights as unexpected keys when it loads the folder "
                                           "(the model loads without them; fmoe.hf.from_pretrained reads them)"), cli.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["num_nextn_predict_layers"] == 1 and config["vocab_size"] == model.cfg.vocab_size
    # the byte run's documents end at EOS (256): generation from the export stops there, in generate.py and in transformers
    assert config["eos_token_id"] == 256 and stop_ids(own_run, run_config, text_codec(own_run, model, run_config)[2]) == stop_ids(out, {}, None) == [256]
    assert transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(out)).eos_token_id == 256
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and "model.layers.2.eh_proj.weight" in index["weight_map"]
    assert max(collections.Counter(index["weight_map"].values()).values()) > 1  # 20 kB shards, not 20 B ones: tensors share them
    docs, ids, cu = _docs(model.cfg.vocab_size)
    with torch.no_grad():
        ours = model.logits(ids, cu)
    assert _rel(_transformers_logits(out, docs), ours) < 1e-5
    back, cfg = hf.from_pretrained(out, impl="torch")
    assert cfg.mtp_depth == 1 and cfg.mtp_norm
    want = dict(model.state_dict())
    assert set(back.state_dict()) == set(want)
    for name, t in back.state_dict().items():
        assert torch.equal(t, want[name]), name


def test_a_run_on_prepared_token_files_exports_the_tokenizer_their_index_names(own_run, tmp_path, capsys):
    """A run on fmoe.train.prepare's token files speaks the tokenizer their index names: the
    export gets it as its tokenizer.json, with the tokenizer_config.json beside it, and says
    so; a tokenizer moved away is printed as left out."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fmoe.train.prepare import prepare

    (tmp_path / "tok").mkdir()
    tok = Tokenizer(models.WordLevel(vocab={"w0": 0, "w1": 1, "[UNK]": 2, "<|endoftext|>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok" / "words.json"))  # any name: the folder's is tokenizer.json
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}\n')
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}\n')
    (tmp_path / "tok" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("w0 w1 w1")
    prepare(tmp_path / "docs", tmp_path / "data.u16", tokenizer=tmp_path / "tok" / "words.json", progress=False)
    run = shutil.copytree(own_run, tmp_path / "run")  # its config.json made a run on that data's: the export reads no data
    config = json.loads((run / "config.json").read_text())
    config.update(byte_tokens=False, data_sources=[dict(name="data.u16", weight=1.0, path=str(tmp_path / "data.u16"))])
    (run / "config.json").write_text(json.dumps(config))
    export_hf.main([str(run), str(tmp_path / "out"), "--model_type=glm4_moe"])
    printed = capsys.readouterr().out
    assert f"copied the tokenizer the data's index names: {tmp_path / 'tok' / 'words.json'}, {tmp_path / 'tok' / 'tokenizer_config.json'}" in printed
    assert "left out" not in printed, printed
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (tmp_path / "tok" / "words.json").read_text()
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == (tmp_path / "tok" / "tokenizer_config.json").read_text()
    assert f"names: {tmp_path / 'tok' / 'words.json'}, {tmp_path / 'tok' / 'tokenizer_config.json'}, {tmp_path / 'tok' / 'special_tokens_map.json'}, " \
        f"{tmp_path / 'tok' / 'chat_template.jinja'}\n" in printed
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_text() == (tmp_path / "tok" / name).read_text(), name
    separator = read_index(tmp_path / "data.u16")["separator"]  # where the data's documents end: the export's eos_token_id
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == separator == stop_ids(tmp_path / "out", {}, None)[0]
    (tmp_path / "tok" / "words.json").unlink()
    export_hf.main([str(run), str(tmp_path / "gone"), "--model_type=glm4_moe"])
    printed = capsys.readouterr().out
    assert (f"left out: the tokenizer: the tokenizer the data's index names, '{tmp_path / 'tok' / 'words.json'}', is not here (give its copy "
            "with --tokenizer=FILE); no tokenizer written") in printed
    assert not (tmp_path / "gone" / "tokenizer.json").exists() and "copied" not in printed, printed
    # the run copied to another machine: --tokenizer names the tokenizer's copy there; where the data is not there either,
    # the tokenizer's separator comes from config.json's data_sources, which the loop writes from the index (train_moe)
    import train_moe

    (tmp_path / "tok2").mkdir()
    (tmp_path / "tok2" / "my.json").write_text(tok.to_str())
    config["data_sources"][0].update(train_moe._tokenizer_named(tmp_path / "data.u16"))
    assert config["data_sources"][0]["separator"] == separator and config["data_sources"][0]["tokenizer"] == str(tmp_path / "tok" / "words.json")
    (run / "config.json").write_text(json.dumps(config))
    (tmp_path / "data.u16").rename(tmp_path / "away.u16")
    export_hf.main([str(run), str(tmp_path / "copied"), "--model_type=glm4_moe", f"--tokenizer={tmp_path / 'tok2' / 'my.json'}"])
    printed = capsys.readouterr().out
    assert f"copied the tokenizer the data's index names: {tmp_path / 'tok2' / 'my.json'}" in printed and "left out" not in printed, printed
    assert (tmp_path / "copied" / "tokenizer.json").read_text() == tok.to_str()
    assert json.loads((tmp_path / "copied" / "config.json").read_text())["eos_token_id"] == separator
    with pytest.raises(SystemExit, match="--tokenizer: it replaces the tokenizer a run on prepared token files names; this run's data "
                                         "are bytes, which need none"):
        export_hf.main([str(own_run), str(tmp_path / "bytes"), "--model_type=glm4_moe", f"--tokenizer={tmp_path / 'tok2' / 'my.json'}"])
    (tmp_path / "away.u16").rename(tmp_path / "data.u16")
    # an index from elsewhere that names another file as its tokenizer (a secret of this machine): not copied into the export
    secret = tmp_path / "secret.txt"
    secret.write_text("HF_TOKEN=hf_abc")
    index = json.loads((tmp_path / "data.u16.index.json").read_text())
    for named in (secret, pathlib.Path("/proc/self/environ")):
        (tmp_path / "data.u16.index.json").write_text(json.dumps(dict(index, tokenizer=str(named))))
        export_hf.main([str(run), str(tmp_path / "leak"), "--model_type=glm4_moe"])
        printed = capsys.readouterr().out
        assert f"left out: the tokenizer: the file the data's index names as its tokenizer, '{named}', is not a tokenizer.json" in printed
        assert not (tmp_path / "leak" / "tokenizer.json").exists() and "copied" not in printed, printed
        assert not any("hf_abc" in f.read_text(errors="replace") for f in (tmp_path / "leak").iterdir() if f.suffix != ".safetensors")


def test_links_out_of_the_hf_folder_are_not_copied_into_the_export(tmp_path):
    """copy_folder_files: a folder from elsewhere may link any file of this machine in (an
    ssh key): such a link is left out with a note; the hub cache's links to its repository's
    blobs, and links inside the folder, are copied."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"model": {}}')
    folder = repo / "snapshots" / "rev"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").symlink_to(repo / "blobs" / "abc123")
    (folder / "LICENSE").write_text("MIT")
    (folder / "NOTICE").symlink_to(folder / "LICENSE")
    (folder / "tokenizer.model").symlink_to(secret)
    (folder / "config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / "LICENSE").symlink_to(tmp_path / "bashrc")  # a link the out folder held: replaced, not written through
    (tmp_path / "bashrc").write_text("export PATH=$PATH")
    names, notes = export_hf.copy_folder_files(folder, out)
    assert names == ["LICENSE", "NOTICE", "tokenizer.json"] and sorted(f.name for f in out.iterdir()) == names
    assert (tmp_path / "bashrc").read_text() == "export PATH=$PATH" and not (out / "LICENSE").is_symlink()
    assert notes == [f"tokenizer.model: a link to '{secret}', outside '{folder}'; not copied"]
    assert (out / "tokenizer.json").read_text() == '{"model": {}}'


def test_two_ranks_write_the_one_process_files(own_run, tmp_path):
    one = _export(own_run, tmp_path / "one", "--model_type=glm4_moe", f"--max_shard_gb={SHARD_GB}")
    assert one.returncode == 0, one.stderr[-3000:]
    names = sorted(f.name for f in (tmp_path / "one").iterdir())
    for knobs in (["--ep=2"], ["--tp=2"]):
        two = _export(own_run, tmp_path / "two", "--model_type=glm4_moe", f"--max_shard_gb={SHARD_GB}", *knobs, ranks=2)
        assert two.returncode == 0, (knobs, two.stderr[-3000:])
        assert two.stderr.count("weights: ") == 1, (knobs, two.stderr)  # rank 0 says which checkpoint
        assert two.stdout == one.stdout.replace(str(tmp_path / "one"), str(tmp_path / "two"))  # rank 0 prints, once
        assert sorted(f.name for f in (tmp_path / "two").iterdir()) == names
        for name in names:
            assert filecmp.cmp(tmp_path / "one" / name, tmp_path / "two" / name, shallow=False), (knobs, name)


def test_a_run_from_an_hf_folder_keeps_its_config_and_tokenizer(hf_run, tmp_path):
    folder, run = hf_run
    model, _ = load_run(run)
    cli = _export(run, tmp_path / "out")
    assert cli.returncode == 0, cli.stderr[-3000:]
    out = tmp_path / "out"
    assert f"copied from {folder}: generation_config.json, tokenizer.json" in cli.stdout
    assert "left out: the 1 MTP module(s): qwen3_moe checkpoints hold none; not exported" in cli.stdout
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    docs, ids, cu = _docs(260)
    with torch.no_grad():
        ours = model.logits(ids, cu)
        before = hf.from_pretrained(folder, impl="torch")[0].logits(ids, cu)
    assert _rel(ours, before) > 1e-3  # the run trained the model: the export is not the folder's model
    assert _rel(_transformers_logits(out, docs), ours) < 1e-5
    # --dtype: the weights and the config in bfloat16
    bf16 = _export(run, tmp_path / "bf16", "--dtype=bfloat16")
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    back, _ = hf.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, impl="torch")
    assert back.embed.dtype == torch.bfloat16 and torch.equal(back.embed, model.embed.to(torch.bfloat16))


def test_two_ranks_that_read_other_hf_folders_stop_together(hf_run, tmp_path):
    """Each rank reads --hf_config's folder itself: rank 1's copy without config.json refused
    alone while rank 0 waited in the export's collectives (a minute), and a copy whose
    config.json differs (another eos_token_id) gave the ranks different configs to write.
    Now rank 0 says it at once (tests/parallel/one_rank_fault.py: rank 1's path replaced)."""
    folder, run = hf_run
    bare, other = tmp_path / "bare", tmp_path / "other"
    bare.mkdir()
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    for copy, said in ((bare, "rank 1: --hf_config: not a Hugging Face folder"),
                       (other, f"--hf_config: the ranks read different configs from {str(folder)!r}; every node must hold the same folder")):
        done = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(ROOT / "tests" / "parallel" / "one_rank_fault.py"), "other_path", "export_hf", str(run), str(tmp_path / "out"),
                               f"--hf_config={folder}"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "FMOE_TEST_OTHER_PATH": f"={folder}=>={copy}"})
        assert done.returncode != 0 and said in done.stderr, (copy, done.stdout[-2000:] + done.stderr[-4000:])
        assert not (tmp_path / "out").exists()


def test_bad_knobs_stop_with_a_message(own_run, hf_run, tmp_path):
    folder, run = hf_run
    shard = "--max_shard_gb: expected a finite number of GB of at least 1e-9 (one byte), got "
    source = "is the Hugging Face folder whose config and files the export takes; write the export elsewhere"
    cases = [
        ((own_run, tmp_path / "a"), "--model_type: needed for a model of fmoe's own, one of mixtral"),
        ((own_run, tmp_path / "a", "--model_type=bert"), "--model_type: expected one of"),
        ((own_run, tmp_path / "a", "--model_type=mixtral"), "model: its config has no mixtral equivalent: {'score': ('sigmoid', 'softmax')"),
        ((own_run, tmp_path / "a", f"--hf_config={folder}"), "--hf_config: '" + str(folder) + "' is not the run's model; "),
        ((own_run, tmp_path / "a", f"--hf_config={tmp_path}"), "--hf_config: not a Hugging Face folder"),
        ((own_run, tmp_path / "a", "--model_type=glm4_moe", f"--hf_config={tmp_path}"), "--hf_config: not a Hugging Face folder"),
        ((own_run, own_run, "--model_type=glm4_moe"), "is inside the run; write the export elsewhere"),
        ((run, tmp_path / "a", "--model_type=mixtral"), "model: its config has no mixtral equivalent"),  # another family, if it fits
        ((own_run, own_run / "hf"), "is inside the run; write the export elsewhere"),
        # given a checkpoint, its run's folder is kept whole too (another checkpoint of it would take the export's files)
        ((checkpoint.latest(own_run), own_run / "step_000001"), "is inside the run; write the export elsewhere"),
        ((folder, tmp_path / "a"), "is already a Hugging Face folder"),
        ((own_run, tmp_path / "file", "--model_type=glm4_moe"), f"out: '{tmp_path / 'file'}' exists and is not a directory"),
        ((own_run, tmp_path / "file" / "a", "--model_type=glm4_moe"), f"out: '{tmp_path / 'file' / 'a'}' is under '{tmp_path / 'file'}', which is not"),
        ((own_run, "", "--model_type=glm4_moe"), "out: expected the folder to write, got ''"),  # not the current directory
        ((own_run, tmp_path / "a", "--model_type=glm4_moe", "--max_shard_gb=0"), shard + "0.0"),
        ((own_run, tmp_path / "a", "--model_type=glm4_moe", "--max_shard_gb=nan"), shard + "nan"),
        ((own_run, tmp_path / "a", "--model_type=glm4_moe", "--max_shard_gb=inf"), shard + "inf"),
        ((own_run, tmp_path / "a", "--model_type=glm4_moe", "--max_shard_gb=1e-12"), shard + "1e-12"),  # 0 bytes
        ((tmp_path / "norun", tmp_path / "a", "--model_type=glm4_moe"), "path: '" + str(tmp_path / "norun") + "' is neither an fmoe run"),
        ((tmp_path / "badjson", tmp_path / "a"), f"path: config.json: '{tmp_path / 'badjson' / 'config.json'}' is not valid JSON"),
        # the folder the export takes its config and files from, as its out: overwritten, then copied onto itself
        ((run, folder), f"out: '{folder}' {source}"),
        ((run, tmp_path / "copy", f"--hf_config={tmp_path / 'copy'}"), f"out: '{tmp_path / 'copy'}' {source}"),
    ]
    (tmp_path / "norun").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    (tmp_path / "file").write_text("not a folder")
    shutil.copytree(folder, tmp_path / "copy")
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    for args, message in cases:
        with pytest.raises(SystemExit) as stop:
            export_hf.main(list(map(str, args)))
        assert message in str(stop.value.code), (args, stop.value.code)
        assert not str(stop.value.code).startswith("path: path:"), stop.value.code  # named once
    assert not (tmp_path / "a").exists()
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before


def test_export_config_notes_and_the_folder_gone(own_run, tmp_path):
    """The notes of what is left out; a run whose HF folder is gone is named."""
    model, run = load_run(own_run)
    cfg = dataclasses.replace(model.cfg, capacity_factor=1.25, mtp_norm=False)  # an MTP module on the final norm is exported too
    config, notes, source = export_hf.export_config(cfg, run, model_type="glm4_moe")
    assert source is None and config["num_nextn_predict_layers"] == 1
    assert notes == ["capacity_factor=1.25: a training-time drop, not exported"]
    assert config == hf.hf_config(dataclasses.replace(cfg, capacity_factor=None, mtp_norm=True), "glm4_moe") | {"eos_token_id": 256}
    position = dataclasses.replace(cfg, capacity_policy="position")  # the drop's other policy goes with it (it needs a factor)
    assert export_hf.export_config(position, run, model_type="glm4_moe")[:2] == (config, notes)
    gone = dict(run, config=dict(run["config"], init_from_hf=str(tmp_path / "gone")))
    with pytest.raises(ValueError, match=r"the run's --init_from_hf \('.*gone'\): not a Hugging Face folder .*; pass --hf_config=FOLDER"):
        export_hf.export_config(model.cfg, gone)
    # what that error suggests works: --model_type builds the config from the run's knobs (it used to stop on the same error)
    built, notes, source = export_hf.export_config(model.cfg, gone, model_type="glm4_moe")
    assert source is None and built == hf.hf_config(dataclasses.replace(model.cfg, capacity_factor=None), "glm4_moe") | {"eos_token_id": 256}
    assert len(notes) == 1 and notes[0].startswith(f"the run's --init_from_hf folder {str(tmp_path / 'gone')!r} is gone"), notes
    # a run on token files whose documents end at id 0 (the separator as the run recorded it): eos_token_id 0
    (tmp_path / "tok.json").write_text('{"model": {}}')
    zero = dict(run, byte_tokens=False, data_sources=[dict(path=None, tokenizer=str(tmp_path / "tok.json"), separator=0)])
    assert export_hf.export_config(model.cfg, zero, model_type="glm4_moe")[0]["eos_token_id"] == 0


def test_qwen3_next_s_one_mtp_module_is_exported_and_a_second_depth_named(tmp_path):
    """Qwen3-Next's checkpoints hold one MTP module (mtp.): a run's depth 1 is written (no note
    that it is left out), depth 2 is a ValueError naming the knob (save_pretrained's key map
    raised it, a traceback)."""
    transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                 shared_expert_intermediate_size=24, layer_types=["linear_attention", "full_attention"],
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                                 bos_token_id=None, eos_token_id=None, pad_token_id=None).save_pretrained(tmp_path)
    _, cfg = hf.read_config(tmp_path)
    config, notes, source = export_hf.export_config(dataclasses.replace(cfg, mtp_depth=1, mtp_norm=True), {}, model_type="qwen3_next")
    assert notes == [] and source is None and config["mtp_num_hidden_layers"] == 1
    with pytest.raises(ValueError, match=r"^--model_type: qwen3_next checkpoints hold one MTP module, the run's model has mtp_depth = 2$"):
        export_hf.export_config(dataclasses.replace(cfg, mtp_depth=2, mtp_norm=True), {}, model_type="qwen3_next")
    # an older folder's torch_dtype: --dtype replaces it (not a second, contradicting field)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dtype"} | {"torch_dtype": "float32"}))
    config, _, source = export_hf.export_config(cfg, {}, hf_folder=str(tmp_path), dtype="bfloat16")
    assert source == tmp_path and config["dtype"] == "bfloat16" and "torch_dtype" not in config


def test_a_released_llama4_folder_exports_its_text_model(tmp_path):
    """A run from a llama4 folder (Llama4ForConditionalGeneration: a vision model beside the
    text model) exports as llama4_text with the folder's text config, saying so; transformers
    loads the export with the run's logits."""
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=16, intermediate_size_mlp=40, num_local_experts=4, attention_chunk_size=4, bos_token_id=7, eos_token_id=8,
                pad_token_id=None)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vision_output_dim=16, image_size=28,
                  patch_size=14, projector_input_dim=16, projector_output_dim=16)
    torch.manual_seed(0)
    transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    run = {"config": {"init_from_hf": str(tmp_path / "hf")}}
    config, notes, source = export_hf.export_config(cfg, run)
    folder = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == dict(folder["text_config"], model_type="llama4_text", architectures=["Llama4ForCausalLM"]) and source == tmp_path / "hf"
    assert (config["bos_token_id"], config["eos_token_id"]) == (7, 8)
    assert notes == ["the llama4 folder's vision_model., multi_modal_projector. weights: fmoe does not read them; written as llama4_text "
                     "with the folder's text config"]
    assert export_hf.export_config(cfg, run, model_type="llama4_text")[0] == config
    # a relative --init_from_hf is relative to where the run started (config.json's run.cwd), not to where this runs
    relative = {"config": {"init_from_hf": "hf"}, "run": {"cwd": str(tmp_path)}}
    assert pathlib.Path.cwd() != tmp_path and export_hf.export_config(cfg, relative) == (config, notes, tmp_path / "hf")
    for other in ("llama4", "mixtral"):
        with pytest.raises(ValueError, match=rf"--model_type: '{other}', but the run's Hugging Face folder .* is 'llama4', written as 'llama4_text'"):
            export_hf.export_config(cfg, run, model_type=other)
    model.hf_config = config
    hf.save_pretrained(model, tmp_path / "out")
    docs, ids, cu = _docs(64)
    with torch.no_grad():
        assert _rel(_transformers_logits(tmp_path / "out", docs), model.logits(ids, cu)) < 1e-5


def test_a_run_from_a_released_longcat_flash_folder_exports_its_layout(tmp_path):
    """A run from a LongCat-Flash folder in the released layout (no rows for the zero experts,
    which transformers' own model keeps unused) exports without them, every key the folder's;
    from transformers' own folder (with them) the export keeps them, as zeros, and
    transformers loads it with the run's logits."""
    from safetensors.torch import load_file, save_file

    config = transformers.LongcatFlashConfig(vocab_size=260, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=40,
                                             q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, head_dim=4,
                                             moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=16, bos_token_id=None,
                                             eos_token_id=None)
    torch.manual_seed(0)
    transformers.LongcatFlashForCausalLM(config).save_pretrained(tmp_path / "own")
    zero_rows = hf.zero_expert_keys(hf.FAMILIES["longcat_flash"], hf.read_config(tmp_path / "own")[1])
    (tmp_path / "released").mkdir()
    (tmp_path / "released" / "config.json").write_text((tmp_path / "own" / "config.json").read_text())
    weights = {k: v for k, v in load_file(tmp_path / "own" / "model.safetensors").items() if k not in zero_rows}
    save_file(weights, tmp_path / "released" / "model.safetensors", metadata={"format": "pt"})
    for folder, rows in (("released", False), ("own", True)):
        run = _train(tmp_path / f"run_{folder}", f"--init_from_hf={tmp_path / folder}", knobs=[*RUN, "--model.mtp_depth=0"])
        cli = _export(run, tmp_path / f"out_{folder}")
        assert cli.returncode == 0, cli.stderr[-3000:]
        out = load_file(tmp_path / f"out_{folder}" / "model.safetensors")
        assert sorted(out) == sorted([*weights, *zero_rows] if rows else weights), folder
        assert all(not out[k].any() for k in zero_rows if rows)
    model, _ = load_run(tmp_path / "run_own")
    docs, ids, cu = _docs(260)
    with torch.no_grad():
        assert _rel(_transformers_logits(tmp_path / "out_own", docs), model.logits(ids, cu)) < 1e-5


def _earlier_keys_on_ties(t, k, dim=-1, largest=True, sorted=True):
    """torch.topk with equal values taken in index order, fmoe's indexer's rule (README): torch's
    own orders them its way, and where the indexer's scores tie exactly at its cutoff (zeros
    after its ReLU) transformers chose other keys (logits 2e-2 apart, for the weights another
    Python's stdlib corpus trained)."""
    values, indices = torch.sort(t, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _transformers_logits_earlier_keys(path, docs):
    """_transformers_logits with _earlier_keys_on_ties as transformers' top-k."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "topk", _earlier_keys_on_ties)
        return _transformers_logits(path, docs)


def test_a_run_from_an_hy_v4_folder_and_one_of_fmoe_s_own_with_its_streams_export_as_hy_v4(tmp_path):
    """HY-V4's streams through the user's path: a run from transformers' HY-V4 folder
    (--model.mtp_depth=0: no MTP module beside hyper-connections) exports with the folder's
    keys and config, and transformers loads it with the run's logits; a run of fmoe's own with
    the same pieces (--model.hyper_connections and the rest) exports with --model_type=hy_v4
    and loads alike. transformers' top-k takes equal scores in fmoe's order here."""
    from safetensors.torch import load_file

    config = transformers.HYV4Config(vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                                     moe_intermediate_size=12, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=12, kv_lora_rank=8,
                                     qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, index_topk=3, index_n_heads=4, index_head_dim=6,
                                     hc_mult=3, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.HYV4ForCausalLM(config).save_pretrained(tmp_path / "hf")
    run = _train(tmp_path / "run", f"--init_from_hf={tmp_path / 'hf'}", knobs=[*RUN, "--model.mtp_depth=0"])
    assert _export(run, tmp_path / "out").returncode == 0
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(load_file(tmp_path / "hf" / "model.safetensors"))
    docs, ids, cu = _docs(260)
    model, _ = load_run(run)
    with torch.no_grad():
        assert _rel(_transformers_logits_earlier_keys(tmp_path / "out", docs), model.logits(ids, cu)) < 1e-5
    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_heads=4", "--model.n_kv_heads=4", "--model.head_dim=10", "--model.rope_dim=4", "--model.q_rank=12", "--model.kv_rank=8",
           "--model.v_head_dim=5", "--model.index_topk=3", "--model.index_heads=4", "--model.index_head_dim=6", "--model.index_rope_last=True",
           "--model.index_norm_eps=1e-5", "--model.attn_gate=True", "--model.attn_sinks=True", "--model.swiglu_alpha=1.0",
           "--model.swiglu_limit=10.0", "--model.swiglu_offset=0.0", "--model.hyper_connections=3", "--model.hc_kind=independent",
           "--model.norm_eps=1e-5", *RUN, "--model.mtp_depth=0"]
    run = _train(tmp_path / "own_run", knobs=own)
    cli = _export(run, tmp_path / "own_out", "--model_type=hy_v4")
    assert cli.returncode == 0, cli.stderr[-3000:]
    model, _ = load_run(run)
    docs, ids, cu = _docs(258)  # byte data's vocabulary
    with torch.no_grad():
        assert _rel(_transformers_logits_earlier_keys(tmp_path / "own_out", docs), model.logits(ids, cu)) < 1e-5


def test_config_mismatch_names_the_fields_that_change_the_model(hf_run):
    folder, _ = hf_run
    config, cfg = hf.read_config(folder)
    assert hf.config_mismatch(cfg, config) == {}
    assert hf.config_mismatch(dataclasses.replace(cfg, impl="triton", ac="full", capacity_factor=2.0, init_std=0.1, fp8=True,
                                                     fp8_fast_accum=True), config) == {}
    assert hf.config_mismatch(dataclasses.replace(cfg, qk_norm=None), config) == {"qk_norm": (None, "head")}
    assert hf.config_mismatch(dataclasses.replace(cfg, moe_layers=(1,)), config) == {"MoE layers": ([False, True], [True, True])}
    assert hf.config_mismatch(dataclasses.replace(cfg, n_shared=1), config) == {"shared_size": (24, 0)}
    # zero-computation experts: no family has them (its router would be the wrong size)
    assert hf.config_mismatch(dataclasses.replace(cfg, zero_experts=2), config) == {"zero_experts": (2, 0)}


def test_a_run_of_fmoe_s_own_routed_on_the_logits_plus_the_bias_exports_as_kolibri1(tmp_path):
    """Kolibri-1's pieces through the user's path: a run of fmoe's own with the expert bias
    on the logits (--model.expert_bias_on_logits; the loop's bias updates move it), EXAONE's
    attention over a window and sandwich blocks exports with --model_type=kolibri1, and
    transformers loads it with the run's logits and the moved bias."""
    from safetensors.torch import load_file

    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=0", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=8", "--model.qk_norm=head", "--model.window=4",
           "--model.post_norms=True", "--model.route_normalize=False", "--model.expert_bias_on_logits=True", *RUN, "--model.mtp_depth=0",
           "--bias_rate=0.1"]
    config, model = _own_run_exported(tmp_path, own, "kolibri1")
    assert config["layer_types"] == ["sliding_attention"] * 2
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.1.moe.router.expert_bias"].abs().max() > 0
    docs, ids, cu = _docs(258)  # byte data's vocabulary
    with torch.no_grad():
        assert _rel(_transformers_logits(tmp_path / "out", docs), model.logits(ids, cu)) < 1e-5


def test_a_run_of_fmoe_s_own_with_beam_s_pieces_exports_as_beam(tmp_path):
    """Beam's pieces through the user's path: a run of fmoe's own with the gate's bias per
    head, depth-scaled residual adds, a NoPE block with the power-law query scale beside a
    window's block, sandwich norms, groups and the capped logits (--model.logit_softcap: the
    loss's kernels cap them too) exports with --model_type=beam, and transformers loads it
    with the run's logits."""
    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_shared=0", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=8", "--model.qk_norm=head",
           "--model.window=4", "--model.window_layers=0", "--model.nope_layers=1", "--model.nope_temperature_floor=2048",
           "--model.nope_temperature_kind=power", "--model.attn_gate=True", "--model.attn_gate_bias=True", "--model.post_norms=True",
           "--model.depth_scaled_residual=True", "--model.n_groups=2", "--model.topk_groups=1", "--model.group_score_topk=2",
           "--model.route_scale=2.5", "--model.logit_softcap=2.0", *RUN, "--model.mtp_depth=0"]
    config, model = _own_run_exported(tmp_path, own, "beam")
    assert config["rope_parameters"]["full_attention"] is None and config["final_logit_softcapping"] == 2.0
    docs, ids, cu = _docs(258)  # byte data's vocabulary
    with torch.no_grad():
        logits = model.logits(ids, cu)
        assert logits.abs().max() < 2.0
        assert _rel(_transformers_logits(tmp_path / "out", docs), logits) < 1e-5


def test_a_run_of_fmoe_s_own_with_axk2_s_pieces_exports_as_axk2(tmp_path):
    """A.X-K2's pieces through the user's path: a run of fmoe's own with DeepSeek sparse
    attention whose queries and gate read the q latent normed and raw (--model.q_latent_raw,
    --model.attn_gate_on_q) and gated RMSNorms (--model.norm_gate_rank) exports with
    --model_type=axk2 (each head's query and gate rows joined in one q_b_proj), and
    transformers loads it with the run's logits. The indexer keeps 12 keys, every key of these
    documents: a young indexer's ReLU scores tie at 0 for some queries, where fmoe's choice
    (the lower key) and torch.topk's differ; the folder parity test checks the choice."""
    from safetensors.torch import load_file

    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_heads=4", "--model.n_kv_heads=4", "--model.head_dim=10", "--model.rope_dim=4", "--model.rope_interleaved=True",
           "--model.q_rank=12", "--model.kv_rank=8", "--model.v_head_dim=5", "--model.index_topk=12", "--model.index_heads=4",
           "--model.index_head_dim=6", "--model.q_latent_raw=True", "--model.attn_gate=True", "--model.attn_gate_on_q=True",
           "--model.norm_gate_rank=3", *RUN, "--model.mtp_depth=0"]
    _, model = _own_run_exported(tmp_path, own, "axk2")
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.1.self_attn.q_b_proj.weight"].shape == (4 * (10 + 5), 24)
    docs, ids, cu = _docs(258)  # byte data's vocabulary
    with torch.no_grad():
        assert _rel(_transformers_logits(tmp_path / "out", docs), model.logits(ids, cu)) < 1e-5


def test_a_run_of_fmoe_s_own_with_gemma4_s_pieces_exports_as_gemma4_text(tmp_path):
    """Gemma 4's pieces through the user's path: a run of fmoe's own with GeGLU
    (--model.mlp_act=gelu_tanh), sliding blocks of their own head dim and kv heads beside a
    global block whose values are its keys' projection under proportional RoPE, normed
    values, each MoE beside a dense MLP and routed over its own norm with a scale per expert,
    and layer scalars exports with --model_type=gemma4_text, and transformers loads it with
    the run's logits. Without Gemma's embedding scale rounded to the embeddings' dtype
    (--model.round_embed_scale) it has no gemma4_text equivalent."""
    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=0", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.ffn_dense=24", "--model.n_shared=0", "--model.score=softmax", "--model.expert_bias=False", "--model.n_heads=4",
           "--model.n_kv_heads=1", "--model.head_dim=16", "--model.qk_norm=head", "--model.post_norms=True", "--model.mlp_act=gelu_tanh",
           "--model.v_norm=True", "--model.global_k_eq_v=True", "--model.window=4", "--model.window_layers=0", "--model.local_head_dim=8",
           "--model.local_kv_heads=2", "--model.local_rope_base=100", "--model.rope_proportion=0.25", "--model.dense_beside_moe=True",
           "--model.router_norm=True", "--model.router_expert_scale=True", "--model.layer_scalars=True", "--model.attn_scale=1.0",
           "--model.embed_scale=5.656854249492381", "--model.round_embed_scale=True", "--model.logit_softcap=3.0", "--model.tie_embeddings=True", *RUN, "--model.mtp_depth=0"]
    config, model = _own_run_exported(tmp_path, own, "gemma4_text")
    assert config["per_layer_config"] == {"1": {"head_dim": 16, "num_key_value_heads": 1}} and config["enable_moe_block"] is True
    docs, ids, cu = _docs(258)  # byte data's vocabulary
    with torch.no_grad():
        assert _rel(_transformers_logits(tmp_path / "out", docs), model.logits(ids, cu)) < 1e-5
    unrounded = hf.Transformer(dataclasses.replace(model.cfg, round_embed_scale=False))
    with pytest.raises(ValueError, match=r"no gemma4_text equivalent: \{'round_embed_scale': \(False, True\)\}"):
        hf.save_pretrained(unrounded, tmp_path / "unrounded", model_type="gemma4_text")


def test_a_run_of_fmoe_s_own_with_lightning_attention_exports_as_minimax(tmp_path):
    """MiniMax's pieces through the user's path: a run of fmoe's own with lightning attention
    in block 0 (--model.linear_kind=lightning) and normed residuals (--model.normed_residual,
    --model.residual_scale), every block Mixtral's MoE, exports with --model_type=minimax, decay
    tables included, and transformers loads it (no key missing) with the run's logits."""
    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=0", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_shared=0", "--model.score=softmax", "--model.expert_bias=False", "--model.n_heads=4", "--model.n_kv_heads=2",
           "--model.head_dim=8", "--model.linear_layers=0", "--model.linear_kind=lightning", "--model.linear_k_heads=4",
           "--model.linear_v_heads=4", "--model.linear_k_dim=8", "--model.linear_v_dim=8", "--model.normed_residual=1.5",
           "--model.residual_scale=0.75", "--model.norm_eps=1e-5", *RUN, "--model.mtp_depth=0"]
    config, model = _own_run_exported(tmp_path, own, "minimax")
    assert config["layer_types"] == ["linear_attention", "full_attention"] and config["mlp_alpha_factor"] == 1.5
    _loads_whole_with_the_run_s_logits(tmp_path / "out", model)


def test_a_run_of_fmoe_s_own_with_mamba2_mixers_exports_as_granite_4_hybrid(tmp_path):
    """Granite 4.0-H's pieces through the user's path: a run of fmoe's own with a Mamba-2
    mixer in block 0 (--model.linear_kind=mamba2), a NoPE attention block, Granite's
    multipliers and a shared expert exports with --model_type=granitemoehybrid, and
    transformers loads it (no key missing) with the run's logits."""
    own = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=0", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_shared=0", "--model.shared_ffn=20", "--model.score=softmax", "--model.expert_bias=False", "--model.n_heads=4",
           "--model.n_kv_heads=2", "--model.head_dim=8", "--model.linear_layers=0", "--model.linear_kind=mamba2", "--model.linear_k_heads=2",
           "--model.linear_v_heads=4", "--model.linear_k_dim=8", "--model.linear_v_dim=16", "--model.linear_conv=3", "--model.nope_layers=1",
           "--model.attn_scale=0.3", "--model.embed_scale=2.0", "--model.residual_scale=0.5", "--model.logit_divisor=4.0", *RUN,
           "--model.mtp_depth=0"]
    config, model = _own_run_exported(tmp_path, own, "granitemoehybrid")
    assert config["layer_types"] == ["linear_attention", "full_attention"] and config["position_embedding_type"] is None
    assert (config["mamba_n_heads"], config["mamba_d_head"], config["mamba_expand"], config["mamba_n_groups"]) == (4, 16, 2, 2)
    _loads_whole_with_the_run_s_logits(tmp_path / "out", model)


def test_a_run_of_fmoe_s_own_nemotron_3_exports_as_nemotron_h(tmp_path):
    """Nemotron 3's pieces through the user's path: a run of fmoe's own with Mamba-2 mixers
    (dt floored), a block without an MLP, a block without a mixer, NoPE attention and a latent
    MoE of experts without a gate (relu2) under DeepSeek-V3's routing exports with
    --model_type=nemotron_h as its layers, and transformers loads it (no key missing) with the
    run's logits."""
    own = ["--model.hidden=32", "--model.n_layers=4", "--model.moe_layers=0,2", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=16",
           "--model.n_shared=0", "--model.shared_ffn=20", "--model.score=sigmoid", "--model.route_scale=2.5", "--model.n_heads=4",
           "--model.n_kv_heads=2", "--model.head_dim=8", "--model.ffn_dense=24", "--model.mlp_act=relu2", "--model.moe_latent=12",
           "--model.linear_layers=0,1", "--model.linear_kind=mamba2", "--model.linear_k_heads=2", "--model.linear_v_heads=4",
           "--model.linear_k_dim=8", "--model.linear_v_dim=10", "--model.linear_conv=3", "--model.linear_dt_min=0.01", "--model.mlp_free_layers=1",
           "--model.mixer_free_layers=3", "--model.nope_layers=2", "--model.norm_eps=1e-5", *RUN, "--model.mtp_depth=0"]
    config, model = _own_run_exported(tmp_path, own, "nemotron_h")
    assert config["layers_block_type"] == ["linear_attention", "moe", "linear_attention", "full_attention", "moe", "mlp"]
    assert (config["mamba_num_heads"], config["mamba_head_dim"], config["moe_latent_size"], config["time_step_min"]) == (4, 10, 12, 0.01)
    _loads_whole_with_the_run_s_logits(tmp_path / "out", model)


def test_an_hf_folder_s_run_prints_its_files_and_the_links_left_out(hf_run, tmp_path, capsys):
    """A run from an HF folder exported with --hf_config (a copy of the folder with a link to a
    file outside it) into an out folder that holds a folder of its own: the first line counts
    the files and their size in GB and names the weights' dtype, the link is printed as left
    out, and the run's data (a bare token file) adds no tokenizer note, nor qwen3_moe's lack of
    MTP layers a note of where they are."""
    folder, run = hf_run
    linked = shutil.copytree(folder, tmp_path / "linked")
    (tmp_path / "secret.txt").write_text("HF_TOKEN=hf_abc")
    (linked / "vocab.txt").symlink_to(tmp_path / "secret.txt")
    out = tmp_path / "out"
    (out / "earlier").mkdir(parents=True)
    export_hf.main([str(run), str(out), f"--hf_config={linked}", "--dtype=float16"])
    files = sorted(f for f in out.iterdir() if f.is_file())
    assert [f.name for f in files] == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert capsys.readouterr().out.splitlines() == [
        f"{out}: qwen3_moe, 4 files, {sum(f.stat().st_size for f in files) / 1e9:.3f} GB (weights in float16)",
        f"copied from {linked}: generation_config.json, tokenizer.json",
        "left out: the 1 MTP module(s): qwen3_moe checkpoints hold none; not exported",
        f"left out: vocab.txt: a link to '{tmp_path / 'secret.txt'}', outside '{linked}'; not copied"]


def test_an_export_of_two_mtp_modules_names_their_layers(own_run, tmp_path, capsys, monkeypatch):
    """A run's model with two MTP modules (the run's own, given a second): written as glm4_moe's
    layers n and n + 1, which the note after the export names as a range."""
    model, run = load_run(own_run)
    deeper = hf.Transformer(dataclasses.replace(model.cfg, mtp_depth=2))
    deeper.reset_parameters(seed=0)
    monkeypatch.setattr(export_hf, "load_run", lambda path, impl: (deeper, run))
    export_hf.main([str(own_run), str(tmp_path / "out"), "--model_type=glm4_moe"])
    n = model.cfg.n_layers
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"note: the MTP modules are layers {n}..{n + 1}, as glm4_moe checkpoints hold them; ")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_copy_folder_files_leaves_out_weights_subfolders_and_links_but_to_the_hub_s_blobs(tmp_path):
    """copy_folder_files: the folder's weights in any format (.bin, .pt, .pth, an index) and its
    subfolders (a release's original/) are not copied; the hub cache's relative links to its
    blobs are, also where the folder is reached through a link, but not a link to another file
    of its repository (refs/); a folder outside the hub cache linking out is noted. The copies
    keep their files' times."""
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"model": {}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev")
    folder = repo / "snapshots" / "rev"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").symlink_to("../../blobs/abc123")  # as the hub writes its links
    (folder / "ref.txt").symlink_to(repo / "refs" / "main")
    for name in ("config.json", "model.safetensors", "pytorch_model.bin", "consolidated.pth", "weights.pt", "model.safetensors.index.json"):
        (folder / name).write_text("{}")
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")
    (folder / "LICENSE").write_text("MIT")
    os.utime(folder / "LICENSE", (1e9, 1e9))
    (tmp_path / "linked").symlink_to(folder)
    for source in (folder, tmp_path / "linked"):
        out = tmp_path / "out" / source.name
        out.mkdir(parents=True)
        names, notes = export_hf.copy_folder_files(source, out)
        assert names == ["LICENSE", "tokenizer.json"] and sorted(f.name for f in out.iterdir()) == names, (source, names)
        assert notes == [f"ref.txt: a link to '{repo / 'refs' / 'main'}', outside '{source}'; not copied"], notes
        assert (out / "tokenizer.json").read_text() == '{"model": {}}' and (out / "LICENSE").stat().st_mtime == 1e9
    plain = tmp_path / "plain"
    plain.mkdir()
    (tmp_path / "id_rsa").write_text("PRIVATE KEY")
    (plain / "vocab.txt").symlink_to(tmp_path / "id_rsa")
    (tmp_path / "plain_out").mkdir()
    assert export_hf.copy_folder_files(plain, tmp_path / "plain_out") == (
        [], [f"vocab.txt: a link to '{tmp_path / 'id_rsa'}', outside '{plain}'; not copied"])


def test_a_released_kimi_k25_folder_s_run_keeps_its_mtp_module_as_deepseek_v3(tmp_path):
    """A run from a Kimi K2.5 folder (kimi_k25: no MTP layers of its own) is written as
    deepseek_v3, whose checkpoints hold them: its MTP module goes with it, not noted as left
    out."""
    text = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                         topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8,
                                         qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                                                      "text_config": text, "tie_word_embeddings": False}))
    _, cfg = hf.read_config(tmp_path)
    config, notes, source = export_hf.export_config(dataclasses.replace(cfg, mtp_depth=1), {"config": {"init_from_hf": str(tmp_path)}})
    assert config["model_type"] == "deepseek_v3" and source == tmp_path
    assert notes == ["the kimi_k25 folder's vision_tower., mm_projector. weights: fmoe does not read them; written as deepseek_v3 with the "
                     "folder's text config"]
