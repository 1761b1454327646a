"""fmoe.hf against transformers' own models: for each family a tiny random model, built with
transformers' class (every weight randomised, norms, biases and gates included, so a wrong
mapping shows) and saved with save_pretrained, loads into fmoe with the same logits on
packed documents (fmoe's packed forward against HF run per document) through the torch and
the Triton paths, and the same loss; fmoe's export loads back into transformers with the
same logits, and re-exporting a loaded folder gives bit-identical files."""

import filecmp
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

from fmoe import hf  # noqa: E402
from fmoe.train.data import make_batch  # noqa: E402

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    # layer 0 dense (mlp_only_layers), shared experts with their sigmoid gate, q/k/v biases, weights not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                     num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False),
    # per-head q/k norms, renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True),
    # q/k norms over the whole projections
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                              eos_token_id=None, bos_token_id=None),
}
DOCS = (7, 12, 5)  # packed documents


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder saved by transformers (weights randomised), and the HF model."""
    out = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():  # norms near 1, everything else random
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in pname else 0.3 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def _packed(seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, V, (n,), generator=g) for n in DOCS]
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    return docs, torch.cat(docs), cu


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_model_gives_transformers_logits_and_loss(family, impl, folders):
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl=impl)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        # the loss: fmoe's sum over every document's next-token predictions / their count
        # equals HF's per-document mean losses weighted by their token counts
        batch = make_batch(ids, cu)
        losses, _ = model(batch)
        ours = float(losses["lm_sum"] / losses["lm_tokens"])
        want = sum(float(ref(d[None], labels=d[None]).loss) * (len(d) - 1) for d in docs) / sum(len(d) - 1 for d in docs)
    assert ours == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_and_reexport_is_bit_identical(family, folders, tmp_path):
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl="torch")
    hf.save_pretrained(model, tmp_path / "again")
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(path / file, tmp_path / "again" / file, shallow=False), file
    # a model of fmoe's own (fresh weights, no HF config kept) exported with model_type=
    fresh, _ = hf.from_pretrained(path, impl="torch")
    del fresh.hf_config
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.01 * torch.randn_like(p))
    hf.save_pretrained(fresh, tmp_path / "fresh", model_type=family)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fresh", dtype=torch.float32).eval()
    docs, ids, cu = _packed(2)
    with torch.no_grad():
        theirs = torch.cat([back(d[None]).logits[0] for d in docs])
        assert _rel(fresh.logits(ids, cu), theirs) < 1e-5


def test_config_mapping_reads_the_family_fields(folders):
    _, cfg = hf.read_config(folders["qwen2_moe"][0])
    assert cfg.moe_layers == (1, 2) and cfg.shared_size == 40 and cfg.shared_gate and cfg.qkv_bias and cfg.pre_softmax
    _, cfg = hf.read_config(folders["qwen3_moe"][0])
    assert cfg.qk_norm == "head" and not cfg.pre_softmax and cfg.moe_layers == (0, 1, 2)
    _, cfg = hf.read_config(folders["olmoe"][0])
    assert cfg.qk_norm == "proj" and cfg.pre_softmax and cfg.n_dense == 0
    _, cfg = hf.read_config(folders["mixtral"][0])
    assert cfg.n_experts == 4 and cfg.score == "softmax" and not cfg.expert_bias and cfg.shared_size == 0


def _edit(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_bad_checkpoints_name_the_key_or_field(folders, tmp_path):
    path = folders["mixtral"][0]
    with pytest.raises(ValueError, match="config.json: model_type 'gpt2' is not supported"):
        hf.from_pretrained(_edit(path, tmp_path / "a", lambda c: c.update(model_type="gpt2")))
    with pytest.raises(ValueError, match="config.json: sliding_window = 64 is not supported"):
        hf.from_pretrained(_edit(path, tmp_path / "b", lambda c: c.update(sliding_window=64)))
    with pytest.raises(ValueError, match=r"checkpoint: model.embed_tokens.weight gives embed the shape \(64, 32\), the model expects \(64, 16\)"):
        hf.from_pretrained(_edit(path, tmp_path / "c", lambda c: c.update(hidden_size=16)))
    with pytest.raises(ValueError, match=r"checkpoint: missing key 'model.layers.3"):
        hf.from_pretrained(_edit(path, tmp_path / "d", lambda c: c.update(num_hidden_layers=4)))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.from_pretrained(tmp_path)
    model, _ = hf.from_pretrained(path)
    del model.hf_config
    with pytest.raises(ValueError, match="model_type: needed"):
        hf.save_pretrained(model, tmp_path / "e")
    with pytest.raises(ValueError, match="model_type: expected one of"):
        hf.save_pretrained(model, tmp_path / "e", model_type="gpt2")


def test_the_loop_fine_tunes_a_loaded_model(tmp_path):
    """--init_from_hf: the released model's config and weights; the first step's logged loss
    is that model's loss on the step's micro-batch, and a step trains it."""
    import pathlib
    import subprocess
    import sys

    from fmoe.train.data import Sampler, load_corpus

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**COMMON, "vocab_size": 260}, head_dim=8, intermediate_size=40, moe_intermediate_size=24,
                                         num_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run'}", f"--init_from_hf={tmp_path / 'hf'}",
                          "--steps=2", "--tokens_per_micro_batch=64", "--batch_schedule=0:1", "--eval_every=2", "--eval_batches=1",
                          "--model.mtp_depth=0", "--model.impl=torch", "--lr=1e-2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model, _ = hf.from_pretrained(tmp_path / "hf", impl="torch")
    train, _ = load_corpus(None).split(5)
    batch = Sampler(train, 64, seed=0, mtp_depth=0).next_batch()
    with torch.no_grad():
        losses, _ = model(batch)
    assert records[0]["loss"] == pytest.approx(float(losses["lm_sum"] / losses["lm_tokens"]), rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]
    # a corpus whose ids do not fit the model's vocabulary is refused, naming the knob
    small = tmp_path / "small"
    transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(small)
    run = subprocess.run([sys.executable, str(root / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run2'}", f"--init_from_hf={small}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "--init_from_hf: the data's 258 token ids do not fit the model's vocab_size 64" in run.stderr
