"""examples/generate.py: greedy decoding equals transformers' own generate on a loaded HF
model; an fmoe run directory is rebuilt from its config.json and newest checkpoint and
samples reproducibly per seed; under torchrun (FSDP2, TP, EP) rank 0 prints one process's
samples; bad knobs stop with a message."""

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import generate  # noqa: E402

import fmoe  # noqa: E402
from fmoe.model import Transformer, TransformerConfig  # noqa: E402
from fmoe.train.data import EOS, decode_text  # noqa: E402
from tests.sessions import run_in_session  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "deepseek_v2", "granitemoeshared", "hunyuan_v1_moe", "exaone_moe", "llama4_text",
                                    "granitemoe_swa", "afmoe", "flint", "mellum", "qwen3_next", "mistral4", "ministral3", "olmo3", "smollm3", "glm4", "mimo_v2_flash", "lfm2_moe",
                                    "deepseek_v4", "deepseek_v4-csa"])
def test_greedy_matches_transformers_generate(tmp_path, family):
    """Through fmoe's KV cache (DeepSeek-V3 / -V2: multi-latent attention absorbed, latents
    cached; -V2 without the low-rank q; Granite: the embedding, attention and residual
    multipliers in decode's steps; Hunyuan: q/k norms after RoPE, the normed keys cached;
    EXAONE: a 3-token window with RoPE in layer 0, its keys in a ring, layer 1 NoPE; Llama 4:
    layer 0 chunked attention over 4 tokens, layer 1 NoPE with the query temperature from
    position 1 on; GraniteMoeSWA: sinks, a 3-token window ring in layer 1, layer 0 NoPE;
    AFMoE: gated attention and sandwich norms, a 3-token window ring in layer 0, layer 1 NoPE;
    Flint: sinks, q/k norms and biases, a 3-token window ring in layer 0, layer 1 NoPE;
    Mellum: a 3-token window ring in layer 0 with plain RoPE at its own base, layer 1 full
    with Llama 3.1's scaling; Qwen3-Next: layer 0 Gated DeltaNet, its conv and delta-rule
    states carried from the prompt through every step, layer 1 gated attention; Mistral 4:
    multi-latent attention absorbed with the queries scaled from position 2 on; Ministral 3:
    grouped-query attention with YaRN and the same scale; OLMo 3: post-norm blocks, a 3-token
    window ring in layer 0 with plain RoPE beside YaRN in the full layer 1; SmolLM3: layer 1
    NoPE over a 3-token window ring; GLM-4: sandwich norms, RoPE on interleaved pairs of half
    of each head; MiMo-V2-Flash: values of their own dim, scaled, a 3-token window ring of
    twice the kv heads with sinks in layer 1; LFM2-MoE: layer 0 a gated short convolution, its
    last 2 inputs carried from the prompt through every step; DeepSeek-V4: manifold streams,
    a 3-token window ring of its one key head that is its values, RoPE on each head's last
    channels, layer 1 heavily compressed (runs of 3: its entries and open run cached), layer 0
    routed by its hash table; deepseek_v4-csa: layer 2 compressed sparse attention, its
    overlapping runs of 2 and its indexer's entries cached, each step's best 2 of them) against
    transformers' own generate and cache."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    import fmoe.hf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=24,
                                             num_experts=4, num_experts_per_tok=2)
    elif family == "deepseek_v2":  # a full-rank q, softmax routing over groups scored by their best expert
        config = transformers.DeepseekV2Config(
            **common, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, max_position_embeddings=128)
    elif family == "granitemoeshared":
        config = transformers.GraniteMoeSharedConfig(**common, num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                                     num_experts_per_tok=2, shared_intermediate_size=20, embedding_multiplier=3.0,
                                                     attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=2.5)
    elif family == "hunyuan_v1_moe":
        config = transformers.HunYuanMoEV1Config(**common, num_key_value_heads=2, head_dim=8, intermediate_size=24, num_experts=4, moe_topk=2,
                                                 rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0))
    elif family == "exaone_moe":
        config = transformers.ExaoneMoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                              num_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=0,
                                              sliding_window=3, sliding_window_pattern=2, max_position_embeddings=128)
    elif family == "afmoe":
        config = transformers.AfmoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                          num_experts=4, num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, sliding_window=3,
                                          global_attn_every_n_layers=2, route_scale=2.0)
    elif family == "granitemoe_swa":
        config = transformers.GraniteMoeSWAConfig(**common, num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                                  num_experts_per_tok=2, shared_intermediate_size=20, embedding_multiplier=2.0,
                                                  attention_multiplier=0.3, residual_multiplier=0.6, logits_scaling=3.0, sliding_window=3,
                                                  layer_types=["full_attention", "sliding_attention"], layer_rope_theta=[0, 10000.0])
    elif family == "flint":
        config = transformers.FlintConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                          num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24, mlp_only_layers=[],
                                          sliding_window=3, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                                          max_position_embeddings=128)
    elif family == "mellum":
        config = transformers.MellumConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                           num_experts=4, num_experts_per_tok=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                                           rope_parameters=dict(full_attention=dict(rope_type="llama3", rope_theta=5e5, factor=4.0, low_freq_factor=1.0,
                                                                                    high_freq_factor=4.0, original_max_position_embeddings=8),
                                                                sliding_attention=dict(rope_type="default", rope_theta=100.0)))
    elif family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                              num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                              layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
                                              linear_key_head_dim=8, linear_value_head_dim=6)
    elif family == "llama4_text":
        config = transformers.Llama4TextConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=16, intermediate_size_mlp=40,
                                               num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=2, attention_chunk_size=4,
                                               floor_scale=2, attn_scale=0.5, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0,
                                               factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8))
    elif family == "mistral4":  # an original length of 2: queries from position 2 on scaled by 1 + 2 log(1 + floor(p / 2))
        config = transformers.Mistral4Config(
            **common, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
            v_head_dim=5, max_position_embeddings=128, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=2, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=2.0))
    elif family == "ministral3":  # dense: YaRN over an original length of 2, the queries' scale from position 2 on
        config = transformers.Ministral3Config(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, max_position_embeddings=128,
                                               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=2,
                                                                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                                                    llama_4_scaling_beta=2.0))
    elif family == "olmo3":  # YaRN over an original length of 2 in the full layer, plain RoPE at the same base in the window's
        config = transformers.Olmo3Config(**common, intermediate_size=40, sliding_window=3, layer_types=["sliding_attention", "full_attention"], pad_token_id=None,
                                          max_position_embeddings=128, rope_parameters=dict(
                                              full_attention=dict(rope_type="yarn", rope_theta=5e5, factor=4.0, original_max_position_embeddings=2),
                                              sliding_attention=dict(rope_type="default", rope_theta=5e5)))
    elif family == "smollm3":
        config = transformers.SmolLM3Config(**common, num_key_value_heads=2, intermediate_size=40, no_rope_layer_interval=2, use_sliding_window=True,
                                            sliding_window=3, attention_bias=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    elif family == "mimo_v2_flash":
        config = transformers.MiMoV2FlashConfig(**common, num_key_value_heads=1, head_dim=12, v_head_dim=8, intermediate_size=40,
                                                moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
                                                sliding_window=3, routed_scaling_factor=1.5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    elif family == "lfm2_moe":
        config = transformers.Lfm2MoeConfig(**common, num_key_value_heads=2, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                            num_experts_per_tok=2, num_dense_layers=1, layer_types=["conv", "full_attention"],
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    elif family.startswith("deepseek_v4"):
        csa = family.endswith("csa")
        config = transformers.DeepseekV4Config(**dict(common, num_hidden_layers=3 if csa else 2), head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5,
                                               moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                                               layer_types=["sliding_attention", "heavily_compressed_attention"] + ["compressed_sparse_attention"] * csa,
                                               compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
                                               index_n_heads=8, index_head_dim=8, index_topk=2,
                                               mlp_layer_types=["hash_moe", "moe"] + ["moe"] * csa, hc_mult=2, sliding_window=3, o_groups=2,
                                               o_lora_rank=5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    elif family == "glm4":
        config = transformers.Glm4Config(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40, pad_token_id=None)
    else:
        config = transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
            qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, max_position_embeddings=128, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                mscale=0.8, mscale_all_dim=1.0))
    # transformers 5.24's AutoModelForCausalLM does not map mistral4: its own class
    ref = (transformers.Mistral4ForCausalLM(config) if family == "mistral4" else transformers.AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("router.gate.weight"):  # AFMoE starts its routers at zero: every expert tied, picked in no defined order
                p.normal_(0.0, 0.02)
            p.mul_(8.0)  # sharper logits: no near-ties for greedy to split on
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash table (zeros at initialisation): k distinct experts per token id
                b.copy_(torch.rand(b.shape[0], config.n_routed_experts).argsort(dim=1)[:, :b.shape[1]])
    ref.save_pretrained(tmp_path)
    model, _ = fmoe.hf.from_pretrained(tmp_path, impl="torch")
    prompt = [3, 17, 42, 5]
    ours = generate.generate(model, prompt, tokens=10)
    theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert ours == theirs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An fmoe run as the loop leaves it: config.json and a checkpoint."""
    from fmoe.train import checkpoint
    from fmoe.train.run import write_config

    out = tmp_path_factory.mktemp("run")
    cfg = TransformerConfig(vocab_size=258, hidden=32, n_layers=2, n_dense=1, ffn_dense=48, n_experts=4, k=2, ffn_expert=16,
                            n_heads=4, n_kv_heads=2, head_dim=8, moe_layers=(1,), mtp_depth=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    write_config(out, {"model": dataclasses.asdict(cfg), "data": ""}, vocab_size=258)
    checkpoint.save(out, 1, model=model, optimizers=[])
    return out, model


def test_a_run_of_a_newer_fmoe_names_the_knobs_this_one_does_not_have(run_dir, tmp_path):
    """config.json with a model knob this fmoe has not (a run of a newer version): reading
    the run (generate, evaluate, export: run_config) and resuming it say which knobs and the
    version that wrote it (a TypeError from the config's constructor before; --resume went
    on and rewrote config.json without the knob)."""
    from fmoe.train import checkpoint

    out = shutil.copytree(run_dir[0], tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    config["config"]["model"]["a_newer_knob"] = 2
    config["run"]["fmoe"] = "9.9.0"
    (out / "config.json").write_text(json.dumps(config))
    said = (rf"path: '{out / 'config.json'}' names model knobs that this fmoe \({fmoe.__version__}\) does not have: a_newer_knob "
            r"\(the run was written by fmoe 9\.9\.0\); read it with that version")
    with pytest.raises(checkpoint.UnknownKnobs, match=said):
        checkpoint.run_config(out / "step_000001")
    cli = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(out), "--prompt=def ", "--tokens=2"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and re.search(said, cli.stderr), cli.stderr[-2000:]
    resume = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={out}", "--resume", "--steps=2"],
                            capture_output=True, text=True, timeout=300)
    assert resume.returncode == 1 and re.search("--resume: " + said, resume.stderr), resume.stderr[-2000:]
    assert json.loads((out / "config.json").read_text()) == config  # as it was


def test_a_run_directory_generates_and_samples_reproducibly(run_dir):
    out, model = run_dir
    loaded, run = generate.load_run(out)
    assert run["checkpoint"] == str(out / "step_000001")  # which one the out_dir's newest was
    prompt = list(b"def ")
    greedy = generate.generate(loaded, prompt, tokens=6)
    assert greedy == generate.generate(model, prompt, tokens=6)
    # through the KV cache, each new token is the argmax of the whole sequence's logits before it
    with torch.no_grad():
        whole = model.logits(torch.tensor(greedy[:-1]), torch.tensor([0, len(greedy) - 1], dtype=torch.int32))
    assert whole[len(prompt) - 1:].argmax(-1).tolist() == greedy[len(prompt):]
    a = generate.generate(loaded, prompt, tokens=6, temperature=1.0, top_p=0.9, seed=3)
    assert a == generate.generate(loaded, prompt, tokens=6, temperature=1.0, top_p=0.9, seed=3)
    assert len(a) == len(prompt) + 6 or a[-1] == 256  # stops early only at the end of a document
    # top_p small enough keeps the most likely token only: greedy
    assert generate.generate(loaded, prompt, tokens=6, temperature=1.0, top_p=1e-6, seed=3) == generate.generate(loaded, prompt, tokens=6)
    cli = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(out / "step_000001"), "--prompt=def ", "--tokens=5"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.startswith("def ") and cli.stderr.splitlines() == [f"weights: {out / 'step_000001'}"]


def test_a_batch_of_prompts_decodes_as_each_prompt_alone(run_dir):
    """generate_many: prompts of different lengths in one cache, greedy, give what each
    gives alone; a sequence that reaches eos stops while the others go on."""
    model = run_dir[1]
    prompts = [list(b"def "), list(b"import os"), list(b"x")]
    alone = [generate.generate(model, p, tokens=6) for p in prompts]
    assert generate.generate_many(model, prompts, tokens=6) == alone
    first = alone[0][len(prompts[0])]  # an end drawn as the first new token ends the sequence there
    assert generate.generate_many(model, prompts, tokens=6, eos=first)[0] == prompts[0] + [first]
    eos = alone[0][len(prompts[0]) + 1]  # the first prompt's second new token ends it
    stopped = generate.generate_many(model, prompts, tokens=6, eos=eos)
    assert stopped == [generate.generate(model, p, tokens=6, eos=eos) for p in prompts]
    assert len(stopped[0]) == len(prompts[0]) + 2 and max(len(a) - len(p) for a, p in zip(stopped, prompts)) == 6
    with pytest.raises(ValueError, match="prompts: expected at least one prompt"):
        generate.generate_many(model, [], tokens=2)
    import numpy as np

    # numpy's and a 0-d tensor's id stop as an int does (they raised TypeErrors); a str was taken and never matched
    for same in (np.int64(eos), torch.tensor(eos), [np.int64(eos)], (eos,)):
        assert generate.generate_many(model, prompts, tokens=6, eos=same) == stopped
    for bad in ("x", 1.5, True, [eos, "x"], {"eos": eos}):
        with pytest.raises(ValueError, match="eos: expected None, a token id"):
            generate.generate_many(model, prompts, tokens=2, eos=bad)


def test_cli_samples_in_one_batch_on_a_device_and_dtype(run_dir):
    out, _ = run_dir
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(out), "--prompt=def ", *args],  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    cli = run("--tokens=8", "--samples=3", "--temperature=1.0", "--seed=1")
    assert cli.returncode == 0, cli.stderr[-2000:]
    parts = cli.stdout.split("--- sample ")[1:]
    assert [p.split("\n", 1)[0] for p in parts] == ["0", "1", "2"]
    texts = [p.split("\n", 1)[1] for p in parts]
    assert all(t.startswith("def ") for t in texts) and len(set(texts)) > 1  # three draws, not one repeated
    bf16 = run("--tokens=4", "--dtype=bfloat16")
    assert bf16.returncode == 0 and bf16.stdout.startswith("def "), bf16.stderr[-2000:]
    for args, message in ((["--samples=0"], "--samples: expected a positive number of continuations, got 0"),
                          (["--samples=2"], "--samples=2: greedy decoding (--temperature=0, the default) continues the prompt one way only"),
                          (["--device=cuda:7"], "--device: cuda:7 is not available here"),
                          (["--device=nowhere"], "--device: expected cpu, cuda or cuda:N, got 'nowhere'"),
                          (["--prompt_ids=1,2"], "--prompt, --prompt_ids: the prompt as text or as token ids; give one")):
        bad = run("--tokens=2", *args)
        assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]
    for ids, message in (("1,,2", "--prompt_ids: expected comma-separated token ids (e.g. 1,2,3), got '1,,2'"),
                         ("5,999999", "prompt: token ids [999999] are outside the model's vocabulary 0..257")):
        bad = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(out), f"--prompt_ids={ids}", "--tokens=2"],
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]


def test_torchrun_on_any_mesh_draws_the_one_process_tokens(run_dir):
    """2 gloo ranks: FSDP2, TP with EP (each rank caches its kv head; odd token counts padded),
    expert tensor parallel with the weights gathered once (--keep_gathered). Each rank reads its own shards of the checkpoint, decodes the
    same batch, and rank 0's draws are broadcast: rank 0 prints one process's samples."""
    out, _ = run_dir
    args = [str(ROOT / "examples" / "generate.py"), str(out), "--prompt_ids=100,101,102,32,120", "--tokens=7", "--samples=2",
            "--temperature=1.0", "--seed=4"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    samples = [line.split(",") for line in one.stdout.splitlines() if not line.startswith("--- sample")]
    assert len(samples) == 2 and all(1 <= len(ids) <= 7 for ids in samples) and samples[0] != samples[1]  # two different draws
    for knobs in ([], ["--tp=2", "--ep=2"], ["--etp=2", "--keep_gathered"]):
        cli = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args, *knobs],
                             capture_output=True, text=True, timeout=600)
        assert cli.returncode == 0, (knobs, cli.stderr[-3000:])
        assert cli.stdout == one.stdout, knobs  # rank 0 prints, the same tokens
        assert cli.stderr.count(f"weights: {out / 'step_000001'}") == 1, (knobs, cli.stderr)  # and says which checkpoint, once
    bad = subprocess.run([sys.executable, *args, "--tp=2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "parallel knobs (--tp, --ep, --etp) for 1 process(es), the rest FSDP2" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), r"temperature: expected a finite number >= 0 \(0: greedy\), got -1.0"),
    (dict(temperature=float("nan")), "temperature: expected a finite number >= 0 .*, got nan"),  # was torch.multinomial's RuntimeError
    (dict(temperature=float("inf")), "temperature: expected a finite number >= 0 .*, got inf"),  # was a uniform draw
    (dict(top_p=0.0), r"top_p: expected a number in \(0, 1\]"),
    (dict(top_p="0.5"), r"top_p: expected a number in \(0, 1\], got '0.5'"),
    (dict(top_k=-1), r"top_k: expected an int >= 0 \(0: every token\), got -1"),
    (dict(top_k=2.0), r"top_k: expected an int >= 0 \(0: every token\), got 2.0"),
    (dict(tokens=-1), r"tokens: expected an int >= 0 \(new tokens\), got -1"),
    (dict(tokens=2.5), r"tokens: expected an int >= 0 \(new tokens\), got 2.5"),  # was kv_cache's "max_tokens: ..., got 8.5"
    (dict(tokens="3"), r"tokens: expected an int >= 0 \(new tokens\), got '3'"),  # was a TypeError
    # torch's CPU generator keeps the low 32 bits of a seed: --seed=2**32 drew as --seed=0 did, and 2**64 raised its "Overflow
    # when unpacking long long"
    (dict(seed=2**32), r"seed: expected an int in \[0, 2\*\*32\) \(torch's CPU generator keeps 32 bits of a seed\), got 4294967296"),
    (dict(seed=2**64), r"seed: expected an int in \[0, 2\*\*32\) .*, got 18446744073709551616"),
    (dict(seed=-1), r"seed: expected an int in \[0, 2\*\*32\) .*, got -1"),
    (dict(seed=1.5), r"seed: expected an int in \[0, 2\*\*32\) .*, got 1.5"),
    (dict(top_p=1.5), r"top_p: expected a number in \(0, 1\], got 1.5"),  # above 1: as 1
    (dict(top_p=True), r"top_p: expected a number in \(0, 1\], got True"),
    (dict(temperature=True), r"temperature: expected a finite number >= 0 \(0: greedy\), got True"),
    (dict(top_k=True), r"top_k: expected an int >= 0 \(0: every token\), got True"),
    (dict(tokens=True), r"tokens: expected an int >= 0 \(new tokens\), got True"),
    (dict(seed=True), r"seed: expected an int in \[0, 2\*\*32\) .*, got True"),
])
def test_bad_sampling_knobs(run_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate.generate(run_dir[1], [1, 2], **{"tokens": 2, **kwargs})
    for prompts in ([["a"]], [[1, 2.0]]):  # was a TypeError
        with pytest.raises(ValueError, match="prompt: expected int token ids, got "):
            generate.generate_many(run_dir[1], prompts, tokens=2)
    with pytest.raises(ValueError, match="prompt: expected a list of int token ids, got 5"):
        generate.generate_many(run_dir[1], [5], tokens=2)
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        generate.generate(run_dir[1], [], tokens=2)
    vocab = run_dir[1].cfg.vocab_size
    with pytest.raises(ValueError, match=rf"prompt: token ids \[-3, {vocab}\] are outside the model's vocabulary 0..{vocab - 1}"):
        generate.generate(run_dir[1], [1, vocab, -3], tokens=2)


def test_a_tiny_temperature_samples_the_greedy_tokens(run_dir):
    """softmax(logits / temperature) from the largest logit in float64: a temperature whose
    scaled logits overflow float32 (1e-40) or float64 (5e-324) leaves the most likely token
    alone, as greedy decoding (it was torch.multinomial's RuntimeError on inf and nan)."""
    model, prompt = run_dir[1], list(b"def ")
    greedy = generate.generate(model, prompt, tokens=5)
    for temperature in (1e-40, 5e-324):
        assert generate.generate(model, prompt, tokens=5, temperature=temperature, seed=2) == greedy
    gen = torch.Generator().manual_seed(0)
    assert generate._next_token(torch.tensor([3.0, 1e4, -1e4]), 1e-45, 1.0, gen) == 1


def test_a_tiny_top_p_among_tied_logits_keeps_greedy_s_token():
    """Tied most likely tokens (40 equal logits): a top_p that keeps one token keeps the
    lowest id, greedy's (argmax's) token; the descending sort was not stable and kept
    another (id 30 of 40)."""
    for seed in range(5):
        for logits in (torch.zeros(40), torch.tensor([0.0] * 3 + [1.0] * 40)):
            want = int(logits.argmax())
            assert generate._next_token(logits, 1.0, 1e-6, torch.Generator().manual_seed(seed)) == want


def test_top_k_samples_among_the_k_most_likely_tokens_then_top_p(run_dir):
    """top_k: a draw among the k most likely tokens only (k = 1: greedy's token, whatever the
    temperature); with top_p, the nucleus of those k renormalised (transformers' order: the
    k kept first); 0 keeps every token. The command line's --top_k does the same."""
    logits = torch.tensor([2.0, 1.9, 1.8, 1.7, -1.0, 0.5])
    for k, top_p, allowed in ((1, 1.0, {0}), (3, 1.0, {0, 1, 2}), (4, 0.6, {0, 1, 2}), (0, 1.0, set(range(6)))):
        drawn = {generate._next_token(logits, 5.0, top_p, torch.Generator().manual_seed(seed), k) for seed in range(300)}
        assert drawn == allowed, (k, top_p, drawn)
    # top_p exactly a prefix's sum (two tokens of 0.5): that prefix alone, the smallest reaching top_p (transformers' TopPLogitsWarper)
    drawn = {generate._next_token(torch.tensor([0.0, 0.0]), 1.0, 0.5, torch.Generator().manual_seed(seed), 0) for seed in range(100)}
    assert drawn == {0}, drawn  # ties in id order
    model, prompt = run_dir[1], list(b"def ")
    assert generate.generate(model, prompt, tokens=5, temperature=2.0, top_k=1, seed=4) == generate.generate(model, prompt, tokens=5)
    sampled = generate.generate(model, prompt, tokens=5, temperature=1.0, top_k=5, seed=4)
    assert sampled == generate.generate_many(model, [prompt], tokens=5, temperature=1.0, top_k=5, seed=4)[0]
    cli = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(run_dir[0]), "--prompt_ids=100,101,102,32",
                          "--tokens=5", "--temperature=2.0", "--top_k=1"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and cli.stdout.strip() == ",".join(map(str, generate.generate(model, prompt, tokens=5)[4:])), cli.stderr[-2000:]


def test_a_kv_cache_larger_than_the_free_memory_is_refused_before_it_is_made(run_dir, monkeypatch):
    """The KV cache of prompt + tokens is allocated up front: more bytes than the device has
    free is a ValueError naming tokens and the bytes, sized on the meta device before any
    allocation (--tokens=1e8 on a toy model ended in the allocator's RuntimeError, or the
    host's out-of-memory kill); an allocation that fails all the same, where the free memory
    is not known, is the same ValueError."""
    model, prompt = run_dir[1], list(b"def ")
    said = r"^tokens: the KV cache of 2 sequence\(s\) of up to 1000000000004 tokens \(the prompt and the new tokens\) takes [0-9.]+ GiB, "
    need = model.kv_cache(10**12 + 4, 2, device="meta").nbytes
    assert need > 10**12 and model.kv_cache(8, 2, device="meta").k.device.type == "meta"
    meminfo = pathlib.Path("/proc/meminfo")
    if meminfo.is_file():  # MemAvailable is in kB
        kb = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
        assert 0.5 < generate._free_bytes(torch.device("cpu")) / (kb * 1024) < 2
    if generate._free_bytes(torch.device("cpu")) is not None:
        with pytest.raises(ValueError, match=said + r"more than the [0-9.]+ GiB free on cpu: ask for fewer tokens$"):
            generate.generate_many(model, [prompt, prompt], tokens=10**12)
    monkeypatch.setattr(generate, "_free_bytes", lambda device: None)
    with pytest.raises(ValueError, match=said + r"which cpu could not allocate \(.*\): ask for fewer tokens$"):
        generate.generate_many(model, [prompt, prompt], tokens=10**12)
    monkeypatch.setattr(generate, "_free_bytes", lambda device: 1000)  # below this cache's bytes
    with pytest.raises(ValueError, match=said.replace("1000000000004", "10") + r"more than the 0.00 GiB free on cpu"):
        generate.generate_many(model, [prompt, prompt], tokens=6)
    monkeypatch.setattr(generate, "_free_bytes", lambda device: 10**9)
    assert generate.generate_many(model, [prompt, prompt], tokens=6) == [generate.generate(model, prompt, tokens=6)] * 2


def test_logits_with_nothing_to_draw_from_name_the_problem():
    """A NaN, +inf or no finite logit (a broken model): a ValueError saying so, for greedy
    decoding too (argmax took the NaN's place silently; multinomial raised its own
    RuntimeError)."""
    inf, nan = float("inf"), float("nan")
    for row, what in (([1.0, nan, 2.0], "a NaN"), ([1.0, inf, 2.0], r"\+inf"), ([-inf, -inf, -inf], "no finite value")):
        for temperature in (0.0, 1.0):
            with pytest.raises(ValueError, match=f"logits: the model's logits for the next token hold {what} .* of 3\\): nothing to draw from"):
                generate._next_token(torch.tensor(row), temperature, 1.0, torch.Generator())
    assert generate._next_token(torch.tensor([-inf, 0.0, -inf]), 1.0, 1.0, torch.Generator()) == 1  # -inf beside a finite logit: fine


def test_each_continuation_draws_from_a_generator_of_its_own(run_dir):
    """Sequence i samples with seed + i: continuation 0 of a batch is the one drawn alone,
    and continuation i is generate's with seed + i, whatever the other sequences draw or
    when they stop (one generator for the batch drew in turn, so a sample depended on the
    batch it was drawn in)."""
    model, prompt = run_dir[1], list(b"def ")
    args = dict(tokens=6, temperature=1.0, top_p=0.95)
    batch = generate.generate_many(model, [prompt] * 3, seed=5, **args)
    assert [generate.generate(model, prompt, seed=5 + i, **args) for i in range(3)] == batch
    assert len({tuple(b) for b in batch}) == 3  # three different draws
    other = list(b"import ")
    mixed = generate.generate_many(model, [other, prompt], seed=4, **args)
    assert mixed[1] == batch[0] and mixed[0] == generate.generate(model, other, seed=4, **args)
    # the seeds past the last wrap to the first
    assert generate.generate_many(model, [prompt] * 2, seed=2**32 - 1, **args)[1] == generate.generate(model, prompt, seed=0, **args)
    # a sequence that stops at its first draw leaves the others drawing from their own generators
    end = mixed[0][len(other)]  # other's first new token
    ended = generate.generate_many(model, [other, prompt, prompt], seed=4, eos=end, **args)
    assert ended[0] == other + [end] and ended[1:] == [generate.generate(model, prompt, seed=4 + i, eos=end, **args) for i in (1, 2)]
    assert min(len(e) for e in ended[1:]) > len(prompt) + 2, ended  # drawing on past the first one's end


def test_learned_positions_bound_the_prompt_and_tokens(tmp_path):
    """A model of 8 learned absolute positions (abs_positions): a prompt and its new tokens
    fit when they take 8 positions (the last new token is drawn, never fed back); more
    stop before generating, naming tokens (or the prompt; the CLI's --tokens, --prompt),
    not after some tokens in the model's "positions: ... past the 8 learned positions"."""
    from fmoe.train import checkpoint
    from fmoe.train.run import write_config

    cfg = TransformerConfig(vocab_size=258, hidden=16, n_layers=1, n_dense=1, ffn_dense=32, n_heads=2, n_kv_heads=1, head_dim=8,
                            abs_positions=8)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    assert len(generate.generate(model, [1, 2, 3], tokens=6)) == 9
    assert len(generate.generate(model, list(range(8)), tokens=1)) == 9
    with pytest.raises(ValueError, match=r"tokens: expected at most 6 new tokens after a prompt of 3 \(the model's 8 learned positions"):
        generate.generate_many(model, [[1], [1, 2, 3]], tokens=7)
    with pytest.raises(ValueError, match=r"prompt: expected at most 8 tokens, the model's learned positions \(abs_positions\), got 9"):
        generate.generate(model, list(range(9)), tokens=0)
    write_config(tmp_path, {"model": dataclasses.asdict(cfg), "data": ""}, vocab_size=258)
    checkpoint.save(tmp_path, 1, model=model, optimizers=[])
    cli = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(tmp_path), "--prompt=abc", "--tokens=7"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode != 0 and cli.stdout == "" and "Traceback" not in cli.stderr, cli.stderr[-2000:]
    assert ("tokens: expected at most 6 new tokens after a prompt of 3 (the model's 8 learned positions, abs_positions), got 7"
            in cli.stderr), cli.stderr[-2000:]


def _word_tokenizer(vocab: dict, unk: str):
    """A tokenizers WordLevel tokenizer of `vocab` over whitespace-split words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_prompt_is_encoded_whole_whatever_the_tokenizer_json_says(tmp_path):
    """A tokenizer.json saved with truncation and padding on would cut a long prompt and pad a
    short one; text_codec's encode gives every id of the text, and nothing else."""
    tok = _word_tokenizer({f"w{i}": i for i in range(10)} | {"[UNK]": 10}, "[UNK]")
    tok.enable_truncation(max_length=3)
    tok.enable_padding(pad_id=9, pad_token="w9", length=6)
    tok.save(str(tmp_path / "tokenizer.json"))
    encode, decode, eos = generate.text_codec(tmp_path, SimpleNamespace(hf_config={"eos_token_id": [8, 9]}), {})
    assert encode("w1 w2 w3 w4 w5") == [1, 2, 3, 4, 5] and encode("w4") == [4] and eos == 8


def test_a_tokenizer_without_the_tokenizers_package_names_the_extra(tmp_path, monkeypatch):
    """A folder's tokenizer.json where `tokenizers` is not installed: an ImportError naming
    the file and the extra that brings it (a bare ModuleNotFoundError before)."""
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"tokenizer.json: the model's tokenizer is read with the Hugging Face tokenizers package: "
                                          r"pip install 'fmoe\[data\]' \(or tokenizers\)"):
        generate.text_codec(tmp_path, SimpleNamespace(hf_config={}), {})


def test_chat_renders_the_template_and_stops_at_any_end_id(tmp_path, run_dir):
    """--chat on an HF folder: --system and --prompt rendered by its chat template with the
    generation prompt (the ids of transformers' apply_chat_template), greedy tokens equal
    to transformers' generate, which stops at any of generation_config.json's eos ids; the
    reply alone is printed. Refused: --prompt_ids, --system without --chat, a byte run."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(8.0)  # sharper logits: no near-ties for greedy to split on
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = {f"w{i}": i for i in range(57)} | {"user": 57, "assistant": 58, "system": 59, "[UNK]": 60} | {t: 61 + i for i, t in enumerate(specials)}
    tok = _word_tokenizer(vocab, "[UNK]")
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    text, end_of_turn = generate.chat_prompt(tmp_path / "tokenizer.json", "w3 w4 w5", system="w1 w2")
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) and end_of_turn is None
    free = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    stop = free[4]  # a token greedy meets: generation ends there (at its first appearance)
    ref.generation_config.eos_token_id = [62, stop]
    ref.generation_config.pad_token_id = 0
    ref.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [62, stop]
    theirs = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert theirs == free[:free.index(stop) + 1]
    run = lambda path, *args: subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(path), "--tokens=12", *args],  # noqa: E731
                                             capture_output=True, text=True, timeout=300)
    cli = run(tmp_path, "--chat", "--system=w1 w2", "--prompt=w3 w4 w5")
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout == hf.decode(theirs, skip_special_tokens=True) + "\n" and len(cli.stdout.split()) >= 2
    model, _ = generate.load_model(tmp_path)
    assert generate.generate(model, ids, tokens=12, eos=generate.stop_ids(tmp_path, {}, 61))[len(ids):] == theirs
    # a run started from this folder stops where the folder (and so its export) does, and at its separator
    started = {"config": {"init_from_hf": str(tmp_path)}, "byte_tokens": False}
    assert generate.stop_ids(run_dir[0], started, 61) == [62, stop, 61] and generate.stop_ids(run_dir[0], started, 62) == [62, stop]
    assert generate.stop_ids(run_dir[0], dict(started, byte_tokens=True), 61) == [61]  # bytes: the folder's ids are another vocabulary's
    # a relative --init_from_hf is the run's: relative to where it started, not to where this runs
    relative = {"config": {"init_from_hf": tmp_path.name}, "byte_tokens": False, "run": {"cwd": str(tmp_path.parent)}}
    assert pathlib.Path.cwd() != tmp_path.parent and generate.stop_ids(run_dir[0], relative, 61) == [62, stop, 61]
    assert generate.stop_ids(run_dir[0], {"config": {"init_from_hf": str(tmp_path / "gone")}, "byte_tokens": False}, 61) == [61]
    assert generate.stop_ids(run_dir[0], {"config": {}}, 61) == [61] and generate.stop_ids(tmp_path / "gone", {}, None) == []
    # a folder without generation_config.json stops at every id of its config.json, as transformers (which builds one from it)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    plain = tmp_path / "no_generation_config"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(dict(hf_config, eos_token_id=[62, stop])))
    assert generate.stop_ids(plain, {}, 62) == [62, stop] and generate.stop_ids(plain, {}, None) == [62, stop]
    (plain / "config.json").write_text(json.dumps(dict(hf_config, eos_token_id=stop)))
    assert generate.stop_ids(plain, {}, stop) == [stop]
    assert generate.generate(model, ids, tokens=12, eos=generate.stop_ids(plain, {}, 62))[len(ids):] == theirs
    for path, args, message in ((tmp_path, ["--chat", "--prompt_ids=1,2"], "--chat: it renders --prompt's text in the chat template"),
                                (tmp_path, ["--system=hi"], "--system, --chat_template, --chat_template_kwargs: they shape a chat prompt, which needs --chat"),
                                (tmp_path, ["--chat", "--chat_template_kwargs=[1]"], "--chat_template_kwargs: expected a JSON object, got \\[1\\]"),
                                (tmp_path, ["--chat", f"--chat_template={tmp_path / 'nope.jinja'}"], "chat_template: '.*nope.jinja' does not exist"),
                                (run_dir[0], ["--chat", "--prompt=hi"], "--chat: '.*' has no tokenizer here")):  # a byte run
        bad = run(path, *args)
        assert bad.returncode != 0 and re.search(message, bad.stderr), bad.stderr[-2000:]


def test_tokenizer_replaces_a_token_file_run_s_only(run_dir, tmp_path):
    """with_tokenizer (--tokenizer): a run on prepared token files takes the named file in
    place of the one its data's index names (another machine's path); a byte run and an
    HF folder have none to replace, and a file that is no tokenizer.json is named."""
    out, _ = run_dir
    _, run = generate.run_config(out)
    with pytest.raises(ValueError, match="--tokenizer: it replaces the tokenizer a run on prepared token files names; this run's data are bytes"):
        generate.with_tokenizer(run, tmp_path / "t.json")
    with pytest.raises(ValueError, match="--tokenizer: it replaces .* an HF folder reads its own tokenizer.json"):
        generate.with_tokenizer({}, tmp_path / "t.json")
    assert generate.with_tokenizer(run, None) is run
    token_run = dict(run, byte_tokens=False, data_sources=[dict(name="d", weight=1.0, path=str(tmp_path / "gone.u16"),
                                                                 tokenizer="/elsewhere/tokenizer.json", separator=3)])
    assert generate.named_tokenizer(token_run) == (None, "the tokenizer the data's index names, '/elsewhere/tokenizer.json', is not "
                                                         "here (give its copy with --tokenizer=FILE)")
    (tmp_path / "t.json").write_text('{"model": {"type": "WordLevel", "vocab": {}}}')
    assert generate.named_tokenizer(generate.with_tokenizer(token_run, tmp_path / "t.json")) == ((tmp_path / "t.json", 3), "")
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert generate.named_tokenizer(generate.with_tokenizer(token_run, tmp_path / "bad.json")) == (
        None, f"--tokenizer: {str(tmp_path / 'bad.json')!r} is not a tokenizer.json")
    assert generate._said(ValueError("--tokenizer: x")) == "--tokenizer: x"
    assert generate._said(ValueError("path: x")) == "path: x" and generate._said(OSError("x")) == "path: x"


def test_command_knobs_leave_out_the_paths_and_compare_the_device_by_its_type():
    """What the ranks of evaluate.py, generate.py and export_hf.py compare at the start (start_ranks): each rank's copy of
    a file is compared by what it holds, not by its path, and each rank takes its LOCAL_RANK's GPU whatever the index."""
    import argparse

    args = argparse.Namespace(path=pathlib.Path("/node1/run"), tokenizer=None, device="cuda:1", tokens=12, dtype="bfloat16")
    assert generate.command_knobs(args, ("path", "tokenizer")) == {"device": "cuda", "tokens": 12, "dtype": "bfloat16"}
    assert generate.command_knobs(argparse.Namespace(path="p", device="cpu"), ("path",)) == {"device": "cpu"}


def test_the_command_line_draws_with_its_knobs_and_stops_at_the_run_s_end(run_dir, capsys):
    """main: --seed, --top_p and --temperature reach the draws, and a byte run's continuation
    stops at its end of document (EOS) and prints the ids after the prompt; an empty --prompt
    starts from EOS; only rank 0 says which checkpoint it read."""
    out, model = run_dir
    prompt, args = [100, 101, 102, 32], dict(tokens=8, temperature=3.0, top_p=0.8)
    seed = next(s for s in range(1, 2000) if EOS in generate.generate(model, prompt, seed=s, **args)[len(prompt):-1])
    want = generate.generate(model, prompt, seed=seed, eos=EOS, **args)
    assert want[-1] == EOS and len(want) < len(prompt) + 8
    generate.main([str(out), "--prompt_ids=100,101,102,32", "--tokens=8", "--temperature=3.0", "--top_p=0.8", f"--seed={seed}"])
    printed = capsys.readouterr()
    assert printed.out == ",".join(map(str, want[len(prompt):])) + "\n" and printed.err == f"weights: {out / 'step_000001'}\n"
    generate.main([str(out), "--prompt=", "--tokens=3"])
    assert capsys.readouterr().out == decode_text(generate.generate(model, [EOS], tokens=3)) + "\n"
    generate.say_read({"checkpoint": "c"}, rank=1)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("args, message", [
    (["--chat_template=t.jinja"], "--system, --chat_template, --chat_template_kwargs: they shape a chat prompt, which needs --chat"),
    (["--chat_template_kwargs={}"], "--system, --chat_template, --chat_template_kwargs: they shape a chat prompt, which needs --chat"),
    (["--device=meta"], "--device: expected cpu, cuda or cuda:N, got 'meta'"),
])
def test_the_command_line_refuses_before_loading(args, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        generate.main([str(tmp_path / "nowhere"), *args])


def test_stop_ids_tokenizers_and_byte_runs_as_their_files_say(tmp_path):
    """An HF folder with a generation_config.json stops at its ids alone (not also at
    config.json's); a tokenizer.json is a JSON object whose "model" is an object; a run
    from before byte_tokens speaks bytes where its --data was a directory; --separator=-1
    (none) leaves a --tokenizer run without a separator; a token-file run's prompt is
    encoded without the tokenizer's post-processing (its BOS), an HF folder's with it."""
    from tokenizers import processors

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert generate.stop_ids(tmp_path, {}, 7) == [5, 6]
    (tmp_path / "m.json").write_text('{"model": "WordLevel"}')
    assert not generate._is_tokenizer_json(tmp_path / "m.json")
    assert generate._byte_run({"config": {"data": str(tmp_path)}}) and not generate._byte_run({"config": {"data": str(tmp_path / "m.json")}})
    tok = _word_tokenizer({f"w{i}": i for i in range(10)} | {"[UNK]": 10, "[BOS]": 11}, "[UNK]")
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 11)])
    tok.save(str(tmp_path / "tokenizer.json"))
    token_run = {"config": {"separator": -1}, "byte_tokens": False, "tokenizer": str(tmp_path / "tokenizer.json"),
                 "data_sources": [{"path": str(tmp_path / "gone.u16")}]}
    assert generate.named_tokenizer(token_run) == ((tmp_path / "tokenizer.json", None), "")
    assert generate.named_tokenizer(dict(token_run, config={"separator": 3})) == ((tmp_path / "tokenizer.json", 3), "")
    assert generate.text_codec(tmp_path, None, token_run)[0]("w1 w2") == [1, 2]
    assert generate.text_codec(tmp_path, SimpleNamespace(hf_config={"eos_token_id": 7}), {})[0]("w1 w2") == [11, 1, 2]


def test_load_model_casts_to_the_dtype_but_the_router(run_dir):
    model, _ = generate.load_model(run_dir[0], dtype=torch.bfloat16)
    assert model.embed.dtype == torch.bfloat16
    assert {p.dtype for name, p in model.named_parameters() if name.endswith("router")} == {torch.float32}


def test_chat_on_a_token_file_run_stops_at_the_template_s_end_of_turn(run_dir, tmp_path, capsys):
    """--chat on a run on prepared token files: the prompt rendered by the template beside
    the tokenizer its data's index names, and the continuation stops at the template's
    eos_token (the end of a turn) as at the data's separator; the reply alone is printed."""
    out, model = run_dir
    free = generate.generate(model, [1, 2], tokens=6)
    end = free[3]  # greedy's second new token: the end of the turn
    assert end not in (1, 2, free[2]) and end < 256, free
    tok = _word_tokenizer({f"w{i}": i for i in range(258) if i != end} | {"<|im_end|>": end}, "w0")
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                                                "eos_token": "<|im_end|>"}))
    run = shutil.copytree(out, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config.update(byte_tokens=False, data_sources=[dict(name="d", weight=1.0, path=str(tmp_path / "gone.u16"),
                                                        tokenizer=str(tmp_path / "tokenizer.json"), separator=257)])
    (run / "config.json").write_text(json.dumps(config))
    generate.main([str(run), "--chat", "--prompt=w1 w2", "--tokens=6"])
    assert capsys.readouterr().out == tok.decode(free[2:4]) + "\n" == f"w{free[2]}\n"
