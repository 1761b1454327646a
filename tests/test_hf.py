"""fmoe.hf against transformers' own models: for each family a tiny random model, built with
transformers' class (every weight randomised, norms, biases and gates included, so a wrong
mapping shows) and saved with save_pretrained, loads into fmoe with the same logits on
packed documents (fmoe's packed forward against HF run per document) through the torch and
the Triton paths, and the same loss; fmoe's export loads back into transformers with the
same logits, and re-exporting a loaded folder gives bit-identical files."""

import copy
import dataclasses
import filecmp
import json
import math
import os
import pathlib
import re
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]' (Python 3.11 or newer)")

from fmoe import hf  # noqa: E402
from fmoe.layers import lightning_decay  # noqa: E402
from fmoe.model import Transformer, TransformerConfig  # noqa: E402
from fmoe.train.data import make_batch  # noqa: E402
from tests.sessions import run_in_session  # noqa: E402

V = 64
FALCON_H1_MULTIPLIERS = dict(key_multiplier=0.5, attention_in_multiplier=2.0, attention_out_multiplier=0.25, ssm_in_multiplier=0.5, ssm_out_multiplier=2.0,
                             ssm_multipliers=[0.5, 2.0, 0.25, 4.0, 0.5], mlp_multipliers=[2.0, 0.5], embedding_multiplier=2.0, lm_head_multiplier=0.5)
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    # the dense families: Llama with biases on q, k, v and o; Qwen2's q/k/v biases; Qwen3's per-head q/k norms
    "llama": lambda: transformers.LlamaConfig(**COMMON, head_dim=8, intermediate_size=40, attention_bias=True, mlp_bias=True),
    # Jais 2: Llama's blocks with biased LayerNorms, MLPs without a gate (relu^2) and biases on every projection
    "jais2": lambda: transformers.Jais2Config(**COMMON, intermediate_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=8, intermediate_size=40, sliding_window=None),
    # NanoChat: weightless norms (the embeddings' too), RoPE turned the other way, weightless q/k norms after it, relu^2 MLPs,
    # the logits capped at 15 (a cap the tiny model's logits reach: 1.5)
    "nanochat": lambda: transformers.NanoChatConfig(**COMMON, intermediate_size=40, final_logit_softcapping=1.5),
    # InternLM3 (Llama's model): biases on q, k, v, o and the MLPs, set by its own names; IQuest-Coder (Llama's model)
    "internlm3": lambda: transformers.InternLM3Config(**COMMON, head_dim=8, intermediate_size=40, qkv_bias=True, bias=True, pad_token_id=None),
    "iquestcoder": lambda: transformers.IQuestCoderConfig(**COMMON, head_dim=8, intermediate_size=40),
    # OLMo (OLMo-1): weightless LayerNorms, q, k and v clamped to +-1 (which these weights cross), q/k/v/o biases
    "olmo": lambda: transformers.OlmoConfig(**COMMON, intermediate_size=40, clip_qkv=1.0, attention_bias=True, pad_token_id=None,
                                            eos_token_id=None),
    # Phi-2: parallel blocks of one LayerNorm with bias, RoPE on 4 of 8 channels, MLPs without a gate through gelu_new, biases
    "phi": lambda: transformers.PhiConfig(**COMMON, intermediate_size=40, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # StarCoder2: LayerNorms with bias, MLPs without a gate through GELU's tanh form, biases everywhere, a window of 4
    "starcoder2": lambda: transformers.Starcoder2Config(**COMMON, intermediate_size=40, sliding_window=4, bos_token_id=None, eos_token_id=None),
    # GPT-NeoX / Pythia: q, k and v head by head in one module, RoPE on a quarter of each head, the attention and an MLP
    # without a gate (exact GELU) each of its own LayerNorm with bias, added together
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}, intermediate_size=40,
                                                   bos_token_id=None, eos_token_id=None),
    # GPT-J: parallel blocks of one LayerNorm with bias, RoPE on interleaved pairs of 4 of 8 channels, gelu_new MLPs with biases
    "gptj": lambda: transformers.GPTJConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=128, rotary_dim=4, n_inner=40,
                                            bos_token_id=None, eos_token_id=None),
    # Falcon-40B / 180B's: the attention and the MLP each of its own LayerNorm (ln_attn, ln_mlp), added together; q, k and v
    # kv head by kv head in one query_key_value (2 kv heads), biases on every projection, exact-GELU MLPs without a gate
    "falcon": lambda: transformers.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=2,
                                                max_position_embeddings=128, ffn_hidden_size=40, new_decoder_architecture=True, bias=True,
                                                bos_token_id=None, eos_token_id=None),
    # BLOOM: ALiBi over 6 heads (the slopes of 4 heads', then every other of 8's), a LayerNorm with bias on the embeddings, q, k
    # and v head by head in one query_key_value, biases everywhere, GELU's tanh form in MLPs of 4 H without a gate, the head tied
    "bloom": lambda: transformers.BloomConfig(vocab_size=V, hidden_size=48, n_layer=3, n_head=6, bos_token_id=None, eos_token_id=None),
    # MPT: ALiBi, bias-free LayerNorms, q, k and v every q first in one Wqkv, clamped (which these weights cross) and scaled by
    # attn_config's softmax_scale, exact-GELU MLPs of 4 H without a gate or biases, the head tied
    "mpt": lambda: transformers.MptConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, max_seq_len=64,
                                          attn_config=dict(clip_qkv=1.0, softmax_scale=0.3)),
    # Persimmon: q, k and v head by head in one query_key_value, one LayerNorm with bias over every head's q (and k) channels,
    # RoPE on half of each head, relu2 MLPs without a gate, biases and LayerNorms with bias everywhere, the head untied
    "persimmon": lambda: transformers.PersimmonConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                                                      bos_token_id=None, eos_token_id=None),
    # BioGPT: OPT's blocks after positions offset by 2, the embeddings times sqrt(H), exact-GELU MLPs, the head tied
    "biogpt": lambda: transformers.BioGptConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
                                                max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Aria's text model: every block MoE, softmax over the top-2 logits, [E, H, 2F] / [E, F, H] expert stacks, 2 shared experts
    "aria_text": lambda: transformers.AriaTextConfig(**COMMON, intermediate_size=16, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2,
                                                     pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # CodeGen: GPT-J's model with q, v, k in four groups of one qkv_proj
    "codegen": lambda: transformers.CodeGenConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=128, n_ctx=128, rotary_dim=4, n_inner=40,
                                                  bos_token_id=None, eos_token_id=None),
    # GPT-Neo: learned absolute positions, local attention over 4 tokens in layers 1 and 2, no softmax scale, gelu_new MLPs
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=V, hidden_size=32, num_layers=3, num_heads=4, max_position_embeddings=64, window_size=4,
                                                 attention_types=[[["global"], 1], [["local"], 2]], intermediate_size=40, bos_token_id=None,
                                                 eos_token_id=None),
    # GPT-BigCode (StarCoder, SantaCoder): multi-query attention of one fused c_attn, learned positions, gelu MLPs, biases
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64, n_inner=40,
                                                         bos_token_id=None, eos_token_id=None),
    # GPT-2: GPT-BigCode's blocks with a kv head per query head and Conv1D weights [in, out]
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_positions=64, n_inner=40, bos_token_id=None,
                                            eos_token_id=None),
    # OPT: learned positions with two rows before position 0's, ReLU MLPs without a gate, LayerNorms and biases everywhere
    "opt": lambda: transformers.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=40, word_embed_proj_dim=32,
                                          max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Cohere's North text model: Cohere 2's parallel blocks, RoPE on halves in the sliding layers 0 and 1, none in layer 2
    "cohere_compass_text": lambda: transformers.CohereCompassTextConfig(
        **COMMON, intermediate_size=40, layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=4,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": None}, logit_scale=0.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # EXAONE 3.0 / 3.5 (Llama's model under its released names); CWM: a window of 4 in layers 1 and 2, Llama 3.1's RoPE
    # scaling (its default: factor 16 over 8192 positions) in every layer
    "exaone": lambda: transformers.ExaoneConfig(**COMMON, intermediate_size=40, pad_token_id=None, eos_token_id=None),
    "cwm": lambda: transformers.CwmConfig(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4),
    # Ministral-8B: a window of 4 in layers 0 and 2, layer 1 full
    "ministral": lambda: transformers.MinistralConfig(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4,
                                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # OLMo 2's post-norm blocks and whole-projection q/k norms; Granite's multipliers
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, intermediate_size=40, pad_token_id=None, eos_token_id=None, bos_token_id=None),
    "granite": lambda: transformers.GraniteConfig(**COMMON, mlp_bias=True, intermediate_size=40, attention_multiplier=0.3, embedding_multiplier=2.0,
                                                  residual_multiplier=0.5, logits_scaling=4.0),
    # Granite SWA: Granite 3's blocks and multipliers, a sink per head, layer 0 global with RoPE at 5000, layer 1 over a
    # window of 4 without RoPE, layer 2 global at 100
    # Gemma 4: blocks 0 and 1 over a window of 4 with heads of 8 and 2 kv heads, plain RoPE at 100; block 2 (the last, always
    # full) with heads of 16, 1 kv head whose values are its keys' projection, proportional RoPE (a quarter turns); values
    # RMS-normed; each MoE (4 experts, top 2 renormalised, scaled per expert) beside a dense GeGLU; layer scalars; logits capped
    "gemma4_text": lambda: transformers.Gemma4TextConfig(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4,
                                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                                         hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                         moe_intermediate_size=16, attention_k_eq_v=True, global_head_dim=16,
                                                         num_global_key_value_heads=1, final_logit_softcapping=3.0, pad_token_id=None,
                                                         rope_parameters=dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                                                                  rope_theta=10000.0),
                                                                              sliding_attention=dict(rope_type="default", rope_theta=100.0))),
    # Gemma 4's unified text model (Gemma 4 12B's): Gemma 4's dense blocks, the full layer's own geometry and proportional RoPE
    "gemma4_unified_text": lambda: transformers.Gemma4UnifiedTextConfig(
        **COMMON, head_dim=8, intermediate_size=40, sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        attention_k_eq_v=True, global_head_dim=16, num_global_key_value_heads=1, final_logit_softcapping=3.0, pad_token_id=None,
        rope_parameters=dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=10000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=100.0))),
    # LFM3: a short convolution (3 taps), a block over a window of 4 with plain RoPE at 100, a full block with proportional
    # RoPE (half the frequencies turn); the attention's gate per head, sandwich norms
    "lfm3": lambda: transformers.Lfm3Config(**COMMON, head_dim=8, intermediate_size=40, conv_L_cache=3, sliding_window=4,
                                            layer_types=["conv", "sliding_attention", "full_attention"], tie_word_embeddings=False,
                                            rope_parameters=dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.5,
                                                                                     rope_theta=10000.0),
                                                                 sliding_attention=dict(rope_type="default", rope_theta=100.0)),
                                            pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Helium: Llama's blocks with RoPE on interleaved pairs
    "helium": lambda: transformers.HeliumConfig(**COMMON, mlp_bias=True, head_dim=8, intermediate_size=40, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # MiniCPM3: multi-latent attention with RoPE on halves and LongRoPE (short / long factors past 8 positions), the
    # embeddings x 12, each sublayer's output x 1.4 / sqrt(3), the hidden states / (32 / 8) before the head
    "minicpm3": lambda: transformers.MiniCPM3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, q_lora_rank=12, kv_lora_rank=8,
                                                    qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, scale_emb=12, scale_depth=1.4,
                                                    dim_model_base=8, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                                    rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5],
                                                                         long_factor=[2.0, 4.0], original_max_position_embeddings=8)),
    # Arcee: MLPs without a gate (relu(x up_proj)^2 down_proj), YaRN
    "arcee": lambda: transformers.ArceeConfig(**COMMON, mlp_bias=True, head_dim=8, intermediate_size=40, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)),
    # Gemma (1): GeGLU, zero-centred pre-norms, the embeddings x sqrt(32) rounded to their dtype
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=8, intermediate_size=40, pad_token_id=None),
    # VaultGemma: Gemma 2's blocks with pre-norms only
    "vaultgemma": lambda: transformers.VaultGemmaConfig(**COMMON, head_dim=8, intermediate_size=40, query_pre_attn_scalar=6, sliding_window=4,
                                                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=None),
    # Gemma 2: Gemma's dense blocks without q/k norms, every attention score capped at 2 (these random scores reach past it),
    # blocks 0 and 2 over a window of 4, the logits capped at 3
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=8, intermediate_size=40, query_pre_attn_scalar=6, sliding_window=4,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=None),
    # Gemma 3: sandwich blocks of zero-centred RMSNorms, GeGLU, the embeddings x sqrt(32), the softmax scale 6 ** -0.5;
    # blocks 0 and 2 over a window of 4 with plain RoPE at 100, block 1 global with linear RoPE (factor 2); logits capped
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=8, intermediate_size=40, query_pre_attn_scalar=6, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                         rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
                                                                              sliding_attention=dict(rope_type="default", rope_theta=100.0)),
                                                         final_logit_softcapping=3.0, pad_token_id=None),
    # Youtu-LLM: DeepSeek-V3's multi-latent attention (a q latent, YaRN, interleaved pairs) in dense Llama blocks
    "youtu": lambda: transformers.YoutuConfig(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, q_lora_rank=12, kv_lora_rank=8,
                                              qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, tie_word_embeddings=False,
                                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                                                                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    # HyperCLOVA X: Granite's multipliers (the logits multiplied by logits_scaling) with an RMSNorm on each sublayer's output
    "hyperclovax": lambda: transformers.HyperCLOVAXConfig(**COMMON, mlp_bias=True, intermediate_size=40, attention_multiplier=0.3, embedding_multiplier=2.0,
                                                          residual_multiplier=0.5, logits_scaling=0.25),
    "granite_swa": lambda: transformers.GraniteSWAConfig(**COMMON, mlp_bias=True, intermediate_size=40, attention_multiplier=0.3, embedding_multiplier=2.0,
                                                         residual_multiplier=0.5, logits_scaling=4.0, sliding_window=4,
                                                         layer_types=["full_attention", "sliding_attention", "full_attention"],
                                                         layer_rope_theta=[5000.0, 0, 5000.0], tie_word_embeddings=False,
                                                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Ministral 3: Mistral's blocks, YaRN with cos and sin unscaled (mscale = mscale_all_dim), every query
    # scaled by 1 + 0.5 log(1 + floor(p / 4))
    "ministral3": lambda: transformers.Ministral3Config(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None,
                                                        pad_token_id=None, rope_parameters=dict(
                                                            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4,
                                                            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)),
    # OLMo 3: OLMo 2's blocks with a 4-token window in layers 0 and 2, there plain RoPE, in layer 1 YaRN (its
    # attention_factor written out, as the released configs have it)
    "olmo3": lambda: transformers.Olmo3Config(**COMMON, intermediate_size=40, sliding_window=4, pad_token_id=None, eos_token_id=None, bos_token_id=None,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                              rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=5e5, factor=4.0,
                                                                                       original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                                                                                       attention_factor=0.1 * math.log(4.0) + 1),
                                                                   sliding_attention=dict(rope_type="default", rope_theta=5e5))),
    # SmolLM3: Llama's blocks with q/k/v/o biases, layer 1 without RoPE and over a 4-token window, tied embeddings
    "smollm3": lambda: transformers.SmolLM3Config(**COMMON, mlp_bias=True, intermediate_size=40, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=4,
                                                  attention_bias=True, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # EXAONE 4.0: post-norm blocks, per-head q/k norms, layers 0 and 2 over a 4-token window with RoPE, layer 1 global without
    "exaone4": lambda: transformers.Exaone4Config(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4, sliding_window_pattern=2,
                                                  bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Seed-OSS: Llama's blocks with q/k/v biases and an o bias apart
    "seed_oss": lambda: transformers.SeedOssConfig(**COMMON, mlp_bias=True, head_dim=8, intermediate_size=40, attention_bias=True, attention_out_bias=True,
                                                   bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Hunyuan dense: per-head q/k norms after NTK-alpha RoPE
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None,
                                                                  pad_token_id=None, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                                                          alpha=50.0, factor=1.0)),
    # Phi-3 / Phi-4: q, k and v the rows of qkv_proj, gate and up of gate_up_proj; LongRoPE on the first 3/4 of each head,
    # its long factors in a document of more than 8 positions (DOCS' second), cos and sin scaled by sqrt(1 + ln 16 / ln 8)
    "phi3": lambda: transformers.Phi3Config(**COMMON, intermediate_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                            original_max_position_embeddings=8,
                                            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                                                 short_factor=[1.0, 1.1, 1.3], long_factor=[1.5, 3.0, 6.0])),
    # GLM-4: sandwich norms, q/k/v biases, RoPE on interleaved pairs of the first half of each head, gate and up of gate_up_proj
    "glm4": lambda: transformers.Glm4Config(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # GLM (GLM-4-9B): GLM-4's blocks without its sandwich norms
    "glm": lambda: transformers.GlmConfig(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # ERNIE 4.5 dense: Llama's blocks with RoPE on interleaved pairs, tied embeddings
    "ernie4_5": lambda: transformers.Ernie4_5Config(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # LFM2: gated short convolutions (3 taps) in layers 0 and 2, attention with per-head q/k norms in layer 1; the FFN 2/3
    # of intermediate_size, rounded up to a multiple of 16 (66 -> 44 -> 48); tied embeddings
    "lfm2": lambda: transformers.Lfm2Config(**COMMON, intermediate_size=66, block_multiple_of=16, layer_types=["conv", "full_attention", "conv"],
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, intermediate_size=40),
    # Bamba: Mamba-2 mixers in blocks 0 and 2 (4 heads of 16, C and B in 2 groups of 8, 3 taps), attention in block 1 with
    # RoPE on half of each head's channels; Llama's MLP
    "bamba": lambda: transformers.BambaConfig(**COMMON, intermediate_size=40, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                              mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=8, pad_token_id=None),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=8, intermediate_size=40),
    # StableLM 2: LayerNorms with biases, RoPE on the first quarter of each head, q/k/v biases, each head's own q/k LayerNorm;
    # parallel residual blocks (stablelm's second form: test_stablelm_...)
    "stablelm": lambda: transformers.StableLmConfig(**COMMON, intermediate_size=40, use_qkv_bias=True, qk_layernorm=True, bos_token_id=None,
                                                    eos_token_id=None, pad_token_id=None),
    # Nemotron-4 / Minitron: LayerNorm1P (1 + weight, a bias), relu2 MLPs without a gate, RoPE on the first half of each head
    "nemotron": lambda: transformers.NemotronConfig(**COMMON, mlp_bias=True, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None,
                                                    pad_token_id=None),
    # Apertus: per-head q/k RMSNorms, Llama 3's RoPE, MLPs without a gate through xIELU (its learned alpha_p, alpha_n)
    "apertus": lambda: transformers.ApertusConfig(**COMMON, head_dim=8, intermediate_size=40, bos_token_id=None, eos_token_id=None,
                                                  pad_token_id=None, dtype="float32"),
    # Mamba-2: every layer a Mamba-2 mixer alone (4 heads of 16, C and B in 2 groups of 8, 3 taps, dt clamped at 0.5 and above)
    "mamba2": lambda: transformers.Mamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, n_groups=2, state_size=8,
                                                conv_kernel=3, chunk_size=8, expand=2, time_step_limit=(0.5, float("inf")), pad_token_id=None,
                                                bos_token_id=None, eos_token_id=None),
    # Mamba: every layer a Mamba-1 mixer alone (64 channels of x, a state of 8 each, 3 taps, dt of rank 3), the head tied
    "mamba": lambda: transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, state_size=8, conv_kernel=3, expand=2,
                                              time_step_rank=3, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Falcon Mamba: Mamba's layers with dt, B and C RMS-normed without weights (their eps its own), the head untied
    "falcon_mamba": lambda: transformers.FalconMambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, state_size=8, conv_kernel=3,
                                                           expand=2, time_step_rank=3, mixer_rms_eps=1e-3, tie_word_embeddings=False,
                                                           pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Jamba: attention without RoPE in layer 1 (every 3 from 1), Mamba-1 mixers (64 channels, a state of 8, 3 taps, dt of rank 3,
    # dt, B and C normed with weights) in 0 and 2; a MoE (4 experts, softmax top 2 not renormalised) in layers 0 and 2, a SwiGLU in 1
    "jamba": lambda: transformers.JambaConfig(**COMMON, intermediate_size=40, num_experts=4, num_experts_per_tok=2, attn_layer_period=3,
                                              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, mamba_d_conv=3,
                                              mamba_expand=2, mamba_dt_rank=3, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # Nemotron-H / Nemotron 3: layers of one sublayer each, ME M *E M- - (fmoe's 5 blocks: MoE, none, MoE, an MLP, an MLP alone); Mamba-2 (4
    # heads of 10: 40 channels, no multiple of hidden; C and B in 2 groups of 8, 3 taps; dt at least 0.5, a floor these
    # weights reach), attention without RoPE, MLPs and experts relu(x up)^2 down, sigmoid routing in 2 groups x 2.5
    "nemotron_h": lambda: transformers.NemotronHConfig(**{k: v for k, v in COMMON.items() if k != "num_hidden_layers"}, head_dim=8,
                                                       intermediate_size=40, mamba_num_heads=4, mamba_head_dim=10, n_groups=2, ssm_state_size=8,
                                                       conv_kernel=3, chunk_size=8, time_step_min=0.5, pad_token_id=None, bos_token_id=None,
                                                       eos_token_id=None, layers_block_type=["linear_attention", "moe", "linear_attention",
                                                                                             "full_attention", "moe", "linear_attention", "mlp", "mlp"],
                                                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                       moe_shared_expert_intermediate_size=20, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # Falcon-H1: in every layer a Mamba-2 mixer (4 heads of 6: 24 channels, no multiple of hidden; C and B in 2 groups of 8,
    # 3 taps; its output norm per group before the gate) beside the attention, their outputs summed; every muP multiplier
    # other than 1 (powers of two, so that folding them into the weights and out again is exact: re-export is bit-identical;
    # others: test_falcon_h1_reads_its_multipliers_and_output_norms)
    "falcon_h1": lambda: transformers.FalconH1Config(**COMMON, head_dim=8, intermediate_size=40, mamba_d_ssm=24, mamba_n_heads=4, mamba_n_groups=2,
                                                     mamba_d_state=8, mamba_d_conv=3, mamba_chunk_size=8, mamba_rms_norm=True, **FALCON_H1_MULTIPLIERS,
                                                     pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    # Granite 4.0-H: Mamba-2 mixers in blocks 0 and 2 (4 heads of 16, C and B in 2 groups of a state of 8, 3 taps) beside
    # attention without RoPE; Granite's MoE with a shared MLP and multipliers
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(**COMMON, intermediate_size=24, shared_intermediate_size=20, num_local_experts=4,
                                                                    num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
                                                                    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                                                                    mamba_d_conv=3, mamba_chunk_size=8, attention_multiplier=0.3,
                                                                    embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
    # MiniMax-Text-01: lightning attention (blocks 0 and 2; blocks of 4 tokens in transformers' chunked form) beside softmax
    # attention, Mixtral's MoE, each residual the normed input x 1.7 beside the output x 0.6
    "minimax": lambda: transformers.MiniMaxConfig(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  layer_types=["linear_attention", "full_attention", "linear_attention"], block_size=4,
                                                  **{f"{kind}_{w}_factor": v for kind in ("full_attn", "linear_attn", "mlp")
                                                     for w, v in (("alpha", 1.7), ("beta", 0.6))}),
    # layer 0 dense (mlp_only_layers), shared experts with their sigmoid gate, q/k/v biases, weights not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                     num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False),
    # per-head q/k norms, renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True),
    # q/k norms over the whole projections
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                              eos_token_id=None, bos_token_id=None),
    # OLMoE's attention and routing in OLMo 2's post-norm blocks (no input norms; norms on the
    # attention and MLP outputs), weights not renormalised
    "flex_olmo": lambda: transformers.FlexOlmoConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                                     eos_token_id=None, bos_token_id=None),
    # partial rotary (half of each head), q/k/v biases, per-head q/k norms, sigmoid routing with
    # the correction bias, raw (not renormalised) weights scaled, a shared expert, layer 0 dense
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
                                                   attention_bias=True, norm_topk_prob=False, routed_scaling_factor=1.5, n_group=1, topk_group=1),
    # Flint: sinks, per-head q/k norms, q/k/v/o biases, a 4-token window with RoPE in layers 0
    # and 2, layer 1 global without RoPE; layer 0 dense, renormalised sigmoid routing beside an
    # ungated shared expert
    "flint": lambda: transformers.FlintConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=24, mlp_only_layers=[0], sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"], attention_bias=True),
    # HY-V3: per-head q/k norms and q/k/v/o biases; layer 1 dense; renormalised sigmoid routing
    # with the correction bias, x 2.5, beside a shared expert
    "hy_v3": lambda: transformers.HYV3Config(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=2, num_shared_experts=1, router_scaling_factor=2.5, attention_bias=True,
                                             mlp_layer_types=["sparse", "dense", "sparse"]),
    # Mellum: Qwen3-MoE's attention and routing with q/k/v/o biases; a 4-token window in layers 0
    # and 2 with plain RoPE at base 100, layer 1 full with Llama 3.1's scaling; layer 0 dense
    "mellum": lambda: transformers.MellumConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                                num_experts_per_tok=2, sliding_window=4, attention_bias=True,
                                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                mlp_layer_types=["dense", "sparse", "sparse"],
                                                rope_parameters=dict(full_attention=dict(rope_type="llama3", rope_theta=5e5, factor=4.0,
                                                                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                                                                         original_max_position_embeddings=8),
                                                                     sliding_attention=dict(rope_type="default", rope_theta=100.0))),
    # Sarvam-30B: GLM-4.5's model (q/k norms, RoPE on every channel by default) under its own key
    # names, q, k and v (with biases) the rows of one query_key_value; 2 groups of 4 experts
    "sarvam_moe": lambda: transformers.SarvamMoEConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                                                       num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
                                                       n_group=2, topk_group=1),
    # Sarvam-105B: DeepSeek-V3's model, full-rank q by default, RoPE on interleaved pairs
    "sarvam_mla": lambda: transformers.SarvamMLAConfig(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, bos_token_id=None, eos_token_id=None),
    # LongCat-Flash: two sublayers per layer, the first's MoE output added after the second's MLP (fmoe's shortcut
    # pairs); multi-latent attention with the q and kv latents scaled; softmax over 4 experts and 2 identity experts,
    # the top-3 of the probabilities plus the correction bias, unrenormalised x 6
    "longcat_flash": lambda: transformers.LongcatFlashConfig(
        vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=128, ffn_hidden_size=40, q_lora_rank=12,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, head_dim=4, moe_topk=3, n_routed_experts=4, zero_expert_num=2,
        expert_ffn_hidden_size=16, routed_scaling_factor=6.0, bos_token_id=None, eos_token_id=None),
    # Ling's hybrid (bailing_hybrid): Kimi Delta Attention blocks 0 and 1 with the whole decay and gate projections and
    # the bounded decay, gated multi-latent attention (a sigmoid per head) with interleaved RoPE in block 2; block 0
    # dense, then 2 groups of 4 experts on sigmoids with the correction bias, renormalised x 2.5, a shared expert
    "bailing_hybrid": lambda: transformers.BailingHybridConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40,
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, head_dim=8, layer_group_size=3,
        num_mtp_layers=0, routed_scaling_factor=2.5, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # multi-latent attention (low-rank q and kv, interleaved rotary key shared by the heads,
    # v_head_dim != q/k dim), YaRN with mscale != mscale_all_dim, 4 groups of 2 experts scored
    # by their best 2 (Megatron's k // topk_groups would score by 1), renormalised x 2.5
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
            mscale=0.8, mscale_all_dim=1.0)),
    # DeepSeek-V3's model with DeepSeek sparse attention: each query attends to the 4 keys of
    # its document an indexer of 8 heads scores highest (RoPE on halves), so every document
    # longer than 4 tokens is attended sparsely; YaRN, a dense block first
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, index_topk=4, index_n_heads=8, index_head_dim=8,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
                             beta_slow=1, mscale=0.8, mscale_all_dim=1.0), bos_token_id=None, eos_token_id=None),
    # GLM-5: DeepSeek-V3.2's model, the indexer's RoPE on interleaved pairs, layer 1 without an
    # indexer attending to the keys layer 0's chose ("shared"); no groups, plain RoPE, the MoE
    # and dense blocks by mlp_layer_types
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        routed_scaling_factor=2.5, index_topk=3, index_n_heads=8, index_head_dim=6, mlp_layer_types=["sparse", "dense", "sparse"],
        indexer_types=["full", "shared", "full"], bos_token_id=None, eos_token_id=None),
    # HY-V4: 3 independent residual streams (post weights x 1.7); DeepSeek sparse attention (the indexer's RoPE on its
    # last channels, layer 2 attending to layer 1's choice) with an elementwise sigmoid gate and sinks; layer 0 dense,
    # then 2 groups of 4 experts on sigmoids with the correction bias, renormalised x 2.5, the SwiGLU clamped at 0.5
    "hy_v4": lambda: transformers.HYV4Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=128, intermediate_size=40,
        moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=12,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, index_topk=3, index_n_heads=8,
        index_head_dim=6, hc_mult=3, hc_magnitude=1.7, swiglu_limit=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # DeepSeek-V4: 3 manifold streams; a q latent of 12, one key head of 16 that is its values, RoPE on its last 8 channels in
    # pairs, a window of 4, sinks, 2 output groups of rank 5; layer 0 sliding (plain RoPE at 100), layer 1 compressed sparse
    # attention (overlapping entries of runs of 2 tokens, each query's best 2 of them by an indexer of 8 heads of 8), layer 2
    # heavily compressed (entries of runs of 3 tokens; both with YaRN x 4 over 8 positions at 1000); layer 0 hashed, then 8 experts on
    # sqrt(softplus) with the correction bias, renormalised x 1.5, beside a shared one, the SwiGLUs clamped at 0.5
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5,
        moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3}, rope_theta=100.0, compress_rope_theta=1000.0,
        index_n_heads=8, index_head_dim=8, index_topk=2,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
        mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=3, hc_sinkhorn_iters=5, sliding_window=4, o_groups=2, o_lora_rank=5,
        routed_scaling_factor=1.5, swiglu_limit=0.5, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # multi-latent attention without the low-rank q, YaRN with mscale == mscale_all_dim (the
    # -Lite release's); softmax over every expert, 4 groups of 2 scored by their best expert
    # (group_limited_greedy), the top-3 probabilities x 2.5; a shared expert, layer 0 dense
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=2.5, bos_token_id=None, eos_token_id=None,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                             mscale=0.707, mscale_all_dim=0.707)),
    # DeepSeek-V3's multi-latent attention without the low-rank q, plain RoPE; sigmoid routing
    # over 2 groups of 4 experts, renormalised x 1.8; a dense block after a MoE block
    # (mlp_layer_types)
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        routed_scaling_factor=1.8, mlp_layer_types=["sparse", "dense", "sparse"], bos_token_id=None, eos_token_id=None),
    # attention sinks, q/k/v/o biases, a 4-token sliding window in layers 0 and 2, YaRN
    # without truncation, a router bias, expert biases and the clamped SwiGLU (a limit of
    # 0.5 so that the clamps act on these small activations; a correction range of
    # fractional bounds, (1.75, 3.75), so that truncating would change it; H and F multiples
    # of MXFP4's 32-value groups)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**COMMON, "max_position_embeddings": 4 * 4096}, head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=4096, beta_fast=32.0,
                             beta_slow=1.0, truncate=False)),
    # GLM-4.5's routing (2 groups of 4 experts scored by their best 2, the correction bias,
    # renormalised x 1.5) and a shared expert in every block; Llama's attention with q/k/v
    # biases (not o)
    "solar_open": lambda: transformers.SolarOpenConfig(**COMMON, head_dim=8, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                                                       n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
                                                       attention_bias=True),
    # per-head q/k norms; a 4-token window with RoPE in layers 0 and 2, layer 1 global
    # without RoPE (NoPE); DeepSeek-V3's routing (2 groups of 4 experts scored by their best 2,
    # the correction bias beside the router, renormalised x 2.5) and a shared expert; layer 0 dense
    # A.X-K2: DeepSeek sparse attention over multi-latent attention whose queries and gate come from the q latent normed
    # and raw (one q_b_proj); gated RMSNorms of rank 3 before the attention and before each MoE; layer 0 dense, then
    # sigmoid routing with the correction bias, renormalised x 2.5, beside a shared expert
    "axk2": lambda: transformers.AXK2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=128, intermediate_size=40, moe_intermediate_size=12, n_routed_experts=8,
                                            num_experts_per_tok=3, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
                                            v_head_dim=5, index_topk=3, index_n_heads=4, index_head_dim=6, gated_norm_rank=3,
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Beam: layers 0 and 2 over a window of 4 with RoPE, layer 1 global without (its queries scaled by position); an
    # elementwise sigmoid gate with a bias per head; sandwich norms, depth-scaled residual adds; layer 0 dense, then 2
    # groups of 4 experts scored by their best 2, renormalised x 2.5; the logits capped at 3
    "beam": lambda: transformers.BeamConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=8,
                                            num_experts_per_tok=3, n_group=2, topk_group=1, sliding_window=4,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            mlp_layer_types=["dense", "sparse", "sparse"], final_logit_softcapping=3.0,
                                            bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Kolibri-1: EXAONE's attention (layers 0 and 2 over a window of 4 with RoPE, layer 1 global without) in sandwich
    # blocks, every block MoE: the top-3 of the logits plus the correction bias, their raw sigmoids, a shared expert
    "kolibri1": lambda: transformers.Kolibri1Config(**COMMON, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                                    shared_expert_intermediate_size=24, sliding_window=4,
                                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                    bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=8,
                                                       num_experts_per_tok=3, n_group=2, topk_group=1, num_shared_experts=1,
                                                       routed_scaling_factor=2.5, sliding_window=4, sliding_window_pattern=2,
                                                       bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Qwen3's attention (per-head q/k norms) with q/k/v/o biases and a 4-token window in layer
    # 1, DeepSeek-V3's routing (4 groups of 2 experts scored by their best 2, the correction
    # bias, raw weights scaled x 2), a shared expert, layer 0 dense
    "dots1": lambda: transformers.Dots1Config(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                                              num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                              attention_bias=True, norm_topk_prob=False, routed_scaling_factor=2.0, sliding_window=4,
                                              layer_types=["full_attention", "sliding_attention", "full_attention"]),
    # q/k norms over the whole projections, RoPE on the first half of each head, sigmoid routing
    # with the correction bias (the block's own buffer), renormalised
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                       bos_token_id=None, eos_token_id=None,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    # Mixtral's routing with Granite's four multipliers (none of them 1), tied embeddings;
    # experts stored as [E, 2F, H] / [E, H, F] stacks
    # JetMoE: a mixture of attention heads (4 attention experts, 2 per token, over 2 kv heads of 8) beside a MoE with a bias on its
    # output, the head tied
    "jetmoe": lambda: transformers.JetMoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_key_value_heads=2, kv_channels=8,
                                                intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                                bos_token_id=None, eos_token_id=None),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                       embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5,
                                                       logits_scaling=2.5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None),
    # the same with a shared expert MLP ([2Fs, H] / [H, Fs] beside the MoE block), untied
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                                   shared_intermediate_size=20, embedding_multiplier=2.0, attention_multiplier=0.2,
                                                                   residual_multiplier=0.7, logits_scaling=4.0, bos_token_id=None, eos_token_id=None),
    # Granite's MoE blocks and multipliers with a sink per head, layer 0 global, layers 1 and 2
    # over a 4-token window (the default layer_types), layer 1 NoPE (layer_rope_theta 0), the
    # experts as [E, 2F, H] / [E, H, F] stacks, a shared MLP beside each MoE block
    "granitemoe_swa": lambda: transformers.GraniteMoeSWAConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                               shared_intermediate_size=20, embedding_multiplier=2.0, attention_multiplier=0.3,
                                                               residual_multiplier=0.6, logits_scaling=3.0, sliding_window=4,
                                                               layer_rope_theta=[5000.0, 0, 100.0], bos_token_id=None, eos_token_id=None,
                                                               pad_token_id=None),
    # AFMoE (Arcee Trinity): gated attention, per-head q/k norms, sandwich norms; layers 0 and
    # 2 over a 4-token window with RoPE, layer 1 global without (global_attn_every_n_layers 2);
    # layer 0 dense; sigmoid routing with the expert bias, renormalised x 2, a shared expert;
    # the embeddings x sqrt(hidden_size) (mup_enabled)
    "afmoe": lambda: transformers.AfmoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                              num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, sliding_window=4,
                                              global_attn_every_n_layers=2, route_scale=2.0, mup_enabled=True, bos_token_id=None,
                                              eos_token_id=None, pad_token_id=None),
    # Laguna: layer 0 global with 4 heads and RoPE at 5e5 on half of each head, layers 1 and 2
    # over a 4-token window with 8 heads and RoPE at 1e4 on all of it (the default
    # rope_parameters); a softplus output gate per head, per-head q/k norms; layer 0 dense,
    # sigmoid routing with the correction bias on logits soft-capped at 1.5, renormalised x 2,
    # a shared expert
    "laguna": lambda: transformers.LagunaConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                                num_experts_per_tok=2, shared_expert_intermediate_size=24, sliding_window=4,
                                                layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                                num_attention_heads_per_layer=[4, 8, 8], moe_router_logit_softcapping=1.5,
                                                moe_routed_scaling_factor=2.0, bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # MiniMax-M3's text model: block-sparse attention in layers 1 and 2 (an indexer head per kv head choosing 2 blocks of 3
    # keys, the query's own among them), per-head q/k norms and every norm 1 + weight, RoPE on half of each head; layer 0
    # dense, sigmoid routing with the correction bias, renormalised x 2, a shared expert; every SwiGLU clamped (up + 1)
    "minimax_m3_vl_text": lambda: transformers.MiniMaxM3VLTextConfig(
        **COMMON, head_dim=8, intermediate_size=16, dense_intermediate_size=40, shared_intermediate_size=24, num_local_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_block_size=3, index_topk_blocks=2,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5), swiglu_limit=1.5, bos_token_id=None,
        eos_token_id=None, pad_token_id=None),
    # per-head q/k norms after RoPE, a shared MLP beside every MoE block, NTK-alpha RoPE
    # (the released "dynamic" type with a fixed alpha), tied embeddings
    # MoE blocks 1 and 2 of 3 (start 1, interval 1), tied embeddings, a correction bias on the probabilities
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, moe_num_experts=8, moe_k=3,
                                                            moe_num_shared_experts=1),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(**COMMON, head_dim=8, intermediate_size=24, num_experts=4, moe_topk=2,
                                                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                                             rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=50.0, factor=1.0)),
    # Llama 4's text model: layer 1 (the MoE one, by interleave_moe_layer_step) NoPE with the
    # query temperature (floor 2, so that these short documents reach it), layers 0 and 2
    # chunked attention over 4 tokens with weightless q/k norms after interleaved RoPE;
    # q/k/v/o biases; the top-2 router logits' raw sigmoids scaling the experts' input, a
    # shared expert; experts stored as [E, H, 2F] / [E, F, H] stacks; Llama 4 Scout's RoPE
    # scaling (llama3 with low_freq_factor = high_freq_factor: a step, no blend)
    "llama4_text": lambda: transformers.Llama4TextConfig(**COMMON, head_dim=8, intermediate_size=16, intermediate_size_mlp=40, num_local_experts=4,
                                                         num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                                                         attention_chunk_size=4, floor_scale=2, attn_scale=0.5, attention_bias=True,
                                                         rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=16.0,
                                                                              low_freq_factor=1.0, high_freq_factor=1.0,
                                                                              original_max_position_embeddings=16),
                                                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Qwen3-Next: Gated DeltaNet in layers 0 and 2 (2 key heads, 4 value heads: in_proj_qkvz's
    # and in_proj_ba's rows grouped by key head), layer 1 gated attention (the gate as rows of
    # q_proj) with per-head q/k norms and RoPE on half of each head; zero-centred norms; layer
    # 0 dense, softmax top-2 renormalised beside a shared expert with its sigmoid gate
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                                       num_experts_per_tok=2, shared_expert_intermediate_size=24, mlp_only_layers=[0],
                                                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                                       linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
                                                       bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Qwen3.5-MoE's text model: Qwen3-Next's with in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    # apart; every layer MoE; tied embeddings
    # Qwen3.5 dense: Qwen3.5-MoE's blocks with a dense SwiGLU (Gated DeltaNet in blocks 0 and 1, gated attention in 2)
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**COMMON, head_dim=8, intermediate_size=40,
                                                          layer_types=["linear_attention", "linear_attention", "full_attention"],
                                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                                          linear_value_head_dim=6, linear_conv_kernel_dim=3,
                                                          rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.5)),
    # OLMo Hybrid: pre-norm Gated DeltaNet blocks 0 and 1 (q, k, v, g, b, a projections apart; beta in [0, 2]) beside OLMo 3's
    # post-norm attention in block 2. q, k and v of 24 channels each: transformers' save_pretrained cuts the convolution into
    # three equal parts (test_olmo_hybrid_reads_its_released_files has unequal ones)
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(**COMMON, intermediate_size=40, layer_types=["linear_attention", "linear_attention", "full_attention"],
                                                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
                                                        linear_value_head_dim=6, linear_conv_kernel_dim=3, rope_parameters=dict(rope_type="default", rope_theta=500.0),
                                                        bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**COMMON, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                                  num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                                                  layer_types=["linear_attention", "linear_attention", "full_attention"],
                                                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                                                  linear_value_head_dim=6, linear_conv_kernel_dim=3, tie_word_embeddings=True,
                                                                  rope_parameters=dict(rope_type="default", rope_theta=500.0,
                                                                                       partial_rotary_factor=0.25)),
    # Lara Mini: a Gated DeltaNet block (its one in_proj, its out_norm), Qwen3's attention with biases over a window of 4
    # with RoPE, then globally without; plain RMSNorms; softmax top-k renormalised beside an ungated shared expert
    "lara_mini": lambda: transformers.LaraMiniConfig(**COMMON, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                     shared_expert_intermediate_size=24, attention_bias=True, sliding_window=4,
                                                     layer_types=["linear_attention", "sliding_attention", "full_attention"],
                                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                                     linear_value_head_dim=6, linear_conv_kernel_dim=3, tie_word_embeddings=False,
                                                     rope_parameters=dict(rope_type="default", rope_theta=500.0), eos_token_id=None),
    # Kimi Linear: Kimi Delta Attention in layers 0 and 2 (a decay per key channel, low-rank decay and gate), multi-latent
    # attention without RoPE in layer 1; DeepSeek-V3's routing over 2 groups of 4 experts, x 2.446; a shared expert, layer 0 dense
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
        n_group=2, topk_group=1, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        linear_head_dim=8, linear_num_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # MiMo-V2-Flash: q/k heads of 12, values of 8 scaled by 0.707, q/k/v biases; layer 0 full attention with 2 kv heads
    # and RoPE at 5e6, layers 1 and 2 over a 4-token window with 4 kv heads, sinks and RoPE at 1e4, each on the first
    # 4 channels (0.334 of 12); layer 0 dense, DeepSeek-V3's routing over 2 groups of 4 experts, x 1.5, no shared expert
    # A.X-K1: DeepSeek-V3's model (a q latent, RoPE on interleaved pairs, 2 groups of 4 experts, x 1.5, a shared expert,
    # layer 0 dense) with an RMSNorm on each MoE block's output
    # Cohere 2 (Command R7B, Command A): parallel blocks of one bias-free LayerNorm, layers 0 and 2 over a 4-token window with
    # RoPE on interleaved pairs, layer 1 global without RoPE, the logits x 0.25, tied embeddings
    # Cohere (Command R+): the same blocks with RoPE in every layer, no window, a LayerNorm per head on the queries and
    # keys, each head's own weights (use_qk_norm); the logits x 0.5
    "cohere": lambda: transformers.CohereConfig(**COMMON, intermediate_size=40, logit_scale=0.5, use_qk_norm=True, bos_token_id=None,
                                                eos_token_id=None, pad_token_id=None),
    "cohere2": lambda: transformers.Cohere2Config(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4, logit_scale=0.25,
                                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                  bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Cohere 2 MoE: Cohere 2's blocks (RMSNorms here), layer 0 dense (of 24) with RoPE in its global attention (the prefix's
    # pattern 1), layers 1 and 2 MoE, layer 1 over the window, layer 2 global without RoPE; softmax over the top-2 logits,
    # a shared expert averaged with the routed output
    "cohere2_moe": lambda: transformers.Cohere2MoeConfig(**COMMON, head_dim=8, intermediate_size=16, prefix_dense_intermediate_size=24,
                                                         num_experts=4, num_experts_per_tok=2, num_shared_experts=1, sliding_window=4,
                                                         rms_norm_eps=1e-5, logit_scale=0.5, first_k_dense_replace=1, sliding_window_pattern=2,
                                                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "axk1": lambda: transformers.AXK1Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                                            num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=12,
                                            qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, routed_scaling_factor=1.5, bos_token_id=None,
                                            eos_token_id=None, pad_token_id=None),
    "mimo_v2_flash": lambda: transformers.MiMoV2FlashConfig(**COMMON, head_dim=12, v_head_dim=8, intermediate_size=40, moe_intermediate_size=16,
                                                            n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, sliding_window=4,
                                                            routed_scaling_factor=1.5, attention_bias=True, bos_token_id=None, eos_token_id=None,
                                                            pad_token_id=None),
    # LFM2-MoE: LFM2's blocks, layer 0 dense, then 4 experts routed on sigmoids plus the expert bias, renormalised x 1.5
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                   num_dense_layers=1, routed_scaling_factor=1.5, layer_types=["conv", "full_attention", "conv"],
                                                   bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # Mistral 4: DeepSeek-V3's multi-latent attention (YaRN, interleaved RoPE) with every query
    # scaled by 1 + 0.5 log(1 + floor(p / 4)) (an original length of 4, so that these short
    # documents reach it); softmax top-3 renormalised x 1.5, a shared expert, layer 0 dense;
    # the experts stored as [E, 2F, H] / [E, H, F] stacks
    "mistral4": lambda: transformers.Mistral4Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        routed_scaling_factor=1.5, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4,
                                                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5),
        bos_token_id=None, eos_token_id=None, pad_token_id=None),
    # DBRX: its own names; bias-free LayerNorms, q, k and v the rows of one Wqkv clamped to [-2, 2] (about a
    # quarter of these projections clamped), softmax top-2 renormalised, the experts' rows in one [E F, H] per matrix
    "dbrx": lambda: transformers.DbrxConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=4, max_seq_len=128, attn_config=dict(clip_qkv=2.0, kv_n_heads=2, rope_theta=5e5),
                                            ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2),
                                            rope_parameters=dict(rope_type="default", rope_theta=5e5)),
    # Phi-3.5-MoE: LayerNorms with biases, q/k/v/o and head biases, a 9-token window, SparseMixer's top-2 (a gap of 0.3: a
    # softmax over several experts in each round), LongRoPE whose scale switches past 8 positions (DOCS' second)
    "phimoe": lambda: transformers.PhimoeConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.3,
                                                attention_bias=True, lm_head_bias=True, sliding_window=9, bos_token_id=None, eos_token_id=None,
                                                pad_token_id=None, rope_parameters=dict(
                                                    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.3, 1.6],
                                                    long_factor=[1.0, 1.1, 1.3, 1.6], original_max_position_embeddings=8, short_mscale=1.1,
                                                    long_mscale=1.3)),
}
DOCS = (7, 12, 5)  # packed documents


def _causal_lm(model_type: str):
    """transformers' class of a family's causal LM (5.24's AutoModelForCausalLM does not map mistral4)."""
    return transformers.Mistral4ForCausalLM if model_type == "mistral4" else transformers.AutoModelForCausalLM


def _randomised(model):
    """The transformers model with every weight drawn again, so that a wrong mapping shows: the
    norms' near 1 (a norm: its module's name says so; DBRX's attention sits under a module
    named norm_attn_norm), everything else about 0.3; in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in ([""] + name.rsplit(".", 2))[-2] else 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder saved by transformers (weights randomised), and the HF model."""
    out = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        config = make()
        model = _randomised(transformers.Mistral4ForCausalLM(config) if name == "mistral4" else transformers.AutoModelForCausalLM.from_config(config))
        with torch.no_grad():
            for bname, b in model.named_buffers():  # the routers' correction biases; Gemma 4's layer scalars
                if bname.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):  # LFM2-MoE's too
                    b.copy_(0.2 * torch.randn_like(b))
                elif bname.endswith("tid2eid"):  # DeepSeek-V4's hash tables: k distinct experts per token id
                    b.copy_(torch.rand(b.shape[0], config.n_routed_experts).argsort(dim=1)[:, :b.shape[1]])
                elif bname.endswith("layer_scalar"):
                    b.copy_(0.5 + torch.rand_like(b))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def _packed(seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, V, (n,), generator=g) for n in DOCS]
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    return docs, torch.cat(docs), cu


def _their_logits(ref, docs):
    """transformers model `ref`'s logits of each document alone, one after the other [T, V]."""
    return torch.cat([ref(d[None]).logits[0] for d in docs])


def _exported_logits(model, folder, model_type: str, *, nudge: float = 0.0):
    """fmoe's `model` (every weight first moved by nudge x N(0, 1), so that none sits at its
    initial value) written as `model_type` to `folder` and loaded by transformers: its logits
    of _packed's documents."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(nudge * torch.randn_like(p))
    hf.save_pretrained(model, folder, model_type=model_type)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return _their_logits(back, _packed()[0])


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# The relative logits error allowed against transformers: 1e-5, but for the Gated DeltaNet
# families (and Kimi Linear's Kimi Delta Attention: 6.7e-6 in this model, too near 1e-5 for a
# bound): their rule's chunks round in another order than transformers' and the per-head
# output norm magnifies it in a head whose output is small (in one of these random models
# fmoe's token-by-token loop, its definition, is itself 2e-5 from transformers). A mapping
# error moves them by 1e-2 and more. Falcon Mamba's logits are 9.2e-6 (torch) and 1.0e-5 (the scan kernels) from
# transformers' in this model, Mamba's 4.8e-6 and 2.7e-6. Ling's hybrid (bailing_hybrid) runs Kimi Delta Attention too:
# 1.07e-5 in the export's test once a chunk's decays were summed per document (over the pairs, not a running sum).
TOL = dict(qwen3_next=1e-4, qwen3_5_moe_text=1e-4, qwen3_5_moe=1e-4, qwen3_5_text=1e-4, qwen3_5=1e-4, kimi_linear=1e-4, lara_mini=1e-4,
           bailing_hybrid=1e-4, falcon_mamba=3e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_model_gives_transformers_logits_and_loss(family, impl, folders):
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl=impl)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < TOL.get(family, 1e-5)
        # the loss: fmoe's sum over every document's next-token predictions / their count
        # equals HF's per-document mean losses weighted by their token counts
        batch = make_batch(ids, cu)
        losses, _ = model(batch)
        ours = float(losses["lm_sum"] / losses["lm_tokens"])
        want = sum(float(ref(d[None], labels=d[None]).loss) * (len(d) - 1) for d in docs) / sum(len(d) - 1 for d in docs)
    assert ours == pytest.approx(want, rel=TOL.get(family, 1e-5))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_and_reexport_is_bit_identical(family, folders, tmp_path):
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl="torch")
    hf.save_pretrained(model, tmp_path / "again")
    zero_rows = hf.zero_expert_keys(hf.FAMILIES[family], cfg)
    for file in ("model.safetensors", "config.json") if not zero_rows else ("config.json",):
        assert filecmp.cmp(path / file, tmp_path / "again" / file, shallow=False), file
    if zero_rows:  # LongCat-Flash: transformers' unused zero-expert rows (random there) written as zeros, every other tensor as it was
        from safetensors.torch import load_file

        theirs, ours = load_file(path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
        assert sorted(theirs) == sorted(ours) and set(zero_rows) < set(ours)
        for key, value in ours.items():
            assert torch.equal(value, torch.zeros_like(value) if key in zero_rows else theirs[key]), key
        hf.save_pretrained(hf.from_pretrained(tmp_path / "again", impl="torch")[0], tmp_path / "twice")
        assert filecmp.cmp(tmp_path / "again" / "model.safetensors", tmp_path / "twice" / "model.safetensors", shallow=False)
    # a model of fmoe's own (fresh weights, no HF config kept) exported with model_type=
    fresh, _ = hf.from_pretrained(path, impl="torch")
    del fresh.hf_config
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.01 * torch.randn_like(p))
    hf.save_pretrained(fresh, tmp_path / "fresh", model_type=family)
    back = _causal_lm(family).from_pretrained(tmp_path / "fresh", dtype=torch.float32).eval()
    # no padding row (OLMoE's, Hunyuan's and EXAONE's configs default to one: its embedding would get no gradient in transformers)
    assert back.get_input_embeddings().padding_idx is None
    docs, ids, cu = _packed(2)
    with torch.no_grad():
        theirs = torch.cat([back(d[None]).logits[0] for d in docs])
        assert _rel(fresh.logits(ids, cu), theirs) < TOL.get(family, 1e-5)


@pytest.mark.parametrize("family", ["gpt_oss", "granitemoeshared", "deepseek_v3"])
def test_export_in_shards_loads_back_and_replaces_earlier_files(family, folders, tmp_path):
    """max_shard_bytes splits the export into model-0000i-of-0000N.safetensors files and an
    index; a key that several parameters fill (gpt-oss's interleaved gate_up_proj, Granite's
    input_linear) is written whole, in one shard. Both fmoe and transformers load the
    shards; exporting again without a limit leaves only model.safetensors."""
    from safetensors import safe_open

    path, ref = folders[family]
    model, _ = hf.from_pretrained(path, impl="torch")
    total = (path / "model.safetensors").stat().st_size
    out = hf.save_pretrained(model, tmp_path / "out", max_shard_bytes=total // 4)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    n = len(files)
    assert n >= 4 and [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    (shard_mode,) = {f.stat().st_mode & 0o777 for f in files}
    stored = {}
    for file in files:
        with safe_open(file, "pt") as f:
            shard = {key: f.get_tensor(key) for key in f.keys()}
        sizes = [t.numel() * t.element_size() for t in shard.values()]
        assert sum(sizes) <= total // 4 or len(sizes) == 1, (file.name, sizes)  # a tensor over the limit is a shard alone
        assert all(index["weight_map"][key] == file.name for key in shard)
        stored.update(shard)
    original = _read_all(path)
    assert set(index["weight_map"]) == set(stored) == set(original)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert all(torch.equal(stored[key], t) for key, t in original.items())
    back, _ = hf.from_pretrained(out, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    docs, ids, cu = _packed(2)
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), torch.cat([theirs(d[None]).logits[0] for d in docs])) < 1e-5
    hf.save_pretrained(model, out)  # one file again: the shards and the index are gone
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    # the weights readable as config.json is (a new file's mode), by a server running as another user
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777 == shard_mode
    assert filecmp.cmp(path / "model.safetensors", out / "model.safetensors", shallow=False)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes: expected a positive int"):
            hf.save_pretrained(model, tmp_path / "bad", max_shard_bytes=bad)


def test_a_failed_export_leaves_no_weight_files(folders, tmp_path, monkeypatch):
    """An export that raises after writing some shards removes them (the error goes on to
    the caller); the temporary shards of a killed export are removed by the next export."""
    path, _ = folders["mixtral"]
    model, _ = hf.from_pretrained(path, impl="torch")
    total = (path / "model.safetensors").stat().st_size
    out = tmp_path / "out"
    written, stored = [], hf._stored

    def failing(spec, full, dtype):
        if len(written) == 6:
            raise OSError("disk full")
        written.append(spec.keys[0])
        return stored(spec, full, dtype)

    import safetensors.torch

    save_file, saves = safetensors.torch.save_file, []
    monkeypatch.setattr(hf, "_stored", failing)
    monkeypatch.setattr(safetensors.torch, "save_file", lambda t, f, **kw: (saves.append(f), save_file(t, f, **kw)))
    with pytest.raises(OSError, match="disk full"):
        hf.save_pretrained(model, out, max_shard_bytes=total // 20)
    assert len(saves) >= 2 and all(f.name.endswith(".partial.safetensors") for f in saves)  # it had written shards
    assert list(out.iterdir()) == []
    monkeypatch.setattr(hf, "_stored", stored)
    # a failure while the shards get their final names: the renamed ones go too
    rename, renames = pathlib.Path.replace, []

    def failing_rename(self, target):
        if len(renames) == 2:
            raise OSError("rename failed")
        renames.append(target)
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "replace", failing_rename)
    with pytest.raises(OSError, match="rename failed"):
        hf.save_pretrained(model, out, max_shard_bytes=total // 4)
    assert [t.name for t in renames] == ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"]
    assert list(out.iterdir()) == []
    monkeypatch.setattr(pathlib.Path, "replace", rename)
    (out / "model-00003.partial.safetensors").write_bytes(b"left by a killed export")
    (out / "config.json.partial").write_text("{")
    (out / "model.safetensors.index.json.partial").write_text("{")
    hf.save_pretrained(model, out)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    assert filecmp.cmp(path / "model.safetensors", out / "model.safetensors", shallow=False)


def test_a_failed_export_leaves_the_folder_s_earlier_export_whole(folders, tmp_path, monkeypatch):
    """The folder's earlier weights and config.json are replaced only once every new file is
    written: a full disk after the first new shard, or no safetensors package, leaves them
    byte for byte (they were removed first, and the folder was left without weights). The
    export that then succeeds replaces them, the earlier shards and index included."""
    import safetensors.torch

    path, _ = folders["mixtral"]
    model, _ = hf.from_pretrained(path, impl="torch")
    total = (path / "model.safetensors").stat().st_size
    out = hf.save_pretrained(model, tmp_path / "out", max_shard_bytes=total // 3)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert "model.safetensors.index.json" in before and len(before) >= 5
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_file, saves = safetensors.torch.save_file, []

    def full_disk(tensors, file, **kw):
        if saves:
            raise OSError(28, "No space left on device")
        saves.append(file)
        save_file(tensors, file, **kw)

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(OSError, match="No space left on device"):
            hf.save_pretrained(model, out, max_shard_bytes=total // 3)
    assert saves and {f.name: f.read_bytes() for f in out.iterdir()} == before
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "safetensors", None)  # not installed: import raises
        m.setitem(sys.modules, "safetensors.torch", None)
        for call in (lambda: hf.save_pretrained(model, out), lambda: hf.from_pretrained(out, impl="torch")):
            with pytest.raises(ImportError, match=r"safetensors package: pip install 'fmoe\[hf\]' \(or safetensors\)"):
                call()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    hf.save_pretrained(model, out)
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    back, _ = hf.from_pretrained(out, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("family,knobs", [("llama", {}), ("mistral", {}), ("qwen2", dict(qkv_bias=True)), ("qwen3", dict(qk_norm="head")),
                                          ("ministral3", dict(query_temperature_floor=4, query_temperature_scale=0.5)),
                                          ("ministral3", dict(yarn_factor=4.0, yarn_original_max_positions=8, yarn_mscale=1.0, yarn_mscale_all_dim=0.0)),
                                          ("olmo2", dict(qk_norm="proj", pre_norms=False, post_norms=True)), ("granite", {}),
                                          ("olmo3", dict(qk_norm="proj", pre_norms=False, post_norms=True, window=4, window_layers=(0,), local_rope_base=100.0)),
                                          ("olmo3", dict(qk_norm="proj", pre_norms=False, post_norms=True, window=4, window_layers=(1,), local_rope_base=10000.0,
                                                         yarn_factor=4.0, yarn_original_max_positions=4, yarn_mscale=1.0, yarn_mscale_all_dim=0.0)),
                                          ("smollm3", dict(qkv_bias=True, o_bias=True, nope_layers=(1,), window=4, window_layers=(1,))),
                                          ("exaone4", dict(qk_norm="head", pre_norms=False, post_norms=True, window=4, window_layers=(0,), nope_layers=(1,))),
                                          ("exaone4", dict(qk_norm="head", pre_norms=False, post_norms=True)),
                                          ("granite_swa", dict(attn_scale=0.3, embed_scale=2.0, residual_scale=0.5, logit_divisor=4.0, attn_sinks=True,
                                                               window=4, window_layers=(1,), local_rope_base=100.0)),
                                          ("granite_swa", dict(attn_sinks=True, window=4, window_layers=(1,), nope_layers=(0,))),
                                          ("hyperclovax", dict(post_norms=True, embed_scale=2.0, residual_scale=0.5, logit_divisor=4.0)), ("hyperclovax", {}),
                                          ("youtu", dict(n_kv_heads=4, kv_rank=8, rope_dim=4, v_head_dim=6, rope_interleaved=False)),
                                          ("seed_oss", dict(qkv_bias=True)), ("hunyuan_v1_dense", dict(qk_norm="head", qk_norm_after_rope=True)),
                                          ("phi3", dict(rope_dim=4, window=4)),
                                          ("phi3", dict(rope_dim=4, longrope_short_factors=(1.0, 1.5), longrope_long_factors=(2.0, 4.0),
                                                        longrope_original_max_positions=8, longrope_short_scale=1.25, longrope_long_scale=1.25)),
                                          ("phi3", dict(longrope_short_factors=(1.0, 1.5, 2.0, 3.0), longrope_original_max_positions=8)),
                                          ("ernie4_5", dict(rope_interleaved=True, tie_embeddings=True)),
                                          ("lfm2", dict(linear_layers=(0,), linear_kind="short_conv", linear_k_heads=32, linear_v_heads=32,
                                                        linear_k_dim=1, linear_v_dim=1, linear_conv=3, qk_norm="head", tie_embeddings=True)), ("glm4", dict(qkv_bias=True, post_norms=True, rope_interleaved=True, rope_dim=4)),
                                          ("nemotron_h", dict(mlp_act="relu2", linear_layers=(0,), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4,
                                                              linear_k_dim=8, linear_v_dim=12, linear_conv=3, linear_dt_min=0.05, nope_layers=(1,),
                                                              mlp_free_layers=(0,), norm_eps=1e-5)),
                                          ("stablelm", dict(layer_norms=True, norm_bias=True, rope_dim=4, qkv_bias=True, qk_norm="head_layer", norm_eps=1e-5)),
                                          ("nemotron", dict(layer_norms=True, norm_bias=True, zero_centered_norms=True, mlp_act="relu2",
                                                            rope_dim=4, norm_eps=1e-5)),
                                          ("apertus", dict(mlp_act="xielu", qk_norm="head", norm_eps=1e-5)),
                                          ("qwen3_5_text", dict(linear_layers=(0,), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6,
                                                                zero_centered_norms=True, attn_gate=True, qk_norm="head", rope_dim=4)),
                                          ("stablelm", dict(layer_norms=True, norm_bias=True, rope_dim=2, parallel_blocks=True, norm_eps=1e-5)),
                                          ("llama", dict(qkv_bias=True, o_bias=True, mlp_bias=True)),
                                          ("exaone", dict(qkv_bias=True, o_bias=True, llama3_factor=8.0, llama3_original_max_positions=8)),
                                          ("olmo", dict(layer_norms=True, norm_weights=False, qkv_bias=True, o_bias=True, clip_qkv=1.0, norm_eps=1e-5)),
                                          ("gpt_neox", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, parallel_norms=True, qkv_bias=True,
                                                            o_bias=True, mlp_bias=True, mlp_act="gelu", rope_dim=4, n_kv_heads=4, norm_eps=1e-5)),
                                          ("gpt_neox", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu_new",
                                                            rope_dim=2, n_kv_heads=4, norm_eps=1e-5)),
                                          ("falcon", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, parallel_norms=True, mlp_act="gelu",
                                                          norm_eps=1e-5, tie_embeddings=True)),
                                          ("falcon", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, mlp_act="gelu", n_kv_heads=1,
                                                          norm_eps=1e-5)),
                                          ("falcon", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu",
                                                          n_kv_heads=4, norm_eps=1e-5)),
                                          ("falcon", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu",
                                                          n_kv_heads=4, norm_eps=1e-5, alibi=True, alibi_scaled=True)),
                                          ("bloom", dict(alibi=True, embed_norm=True, layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                                                         mlp_act="gelu_new", n_kv_heads=4, ffn_dense=128, tie_embeddings=True, norm_eps=1e-5)),
                                          ("mpt", dict(alibi=True, layer_norms=True, mlp_act="gelu", n_kv_heads=4, ffn_dense=128, clip_qkv=1.0, attn_scale=0.3,
                                                       tie_embeddings=True, norm_eps=1e-5)),
                                          ("gptj", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, mlp_bias=True, mlp_act="gelu_new",
                                                        head_bias=True, rope_interleaved=True, rope_dim=4, n_kv_heads=4, norm_eps=1e-5)),
                                          ("gpt_neo", dict(layer_norms=True, norm_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu_new", attn_scale=1.0,
                                                           abs_positions=64, window=4, window_layers=(1,), n_kv_heads=4, tie_embeddings=True, norm_eps=1e-5)),
                                          ("gpt_bigcode", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu_new",
                                                               abs_positions=64, n_kv_heads=1, tie_embeddings=True, norm_eps=1e-5)),
                                          ("gpt_bigcode", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu_new",
                                                               abs_positions=64, n_kv_heads=4, attn_scale=1.0, tie_embeddings=True, norm_eps=1e-5)),
                                          ("gpt2", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu_new",
                                                        abs_positions=64, n_kv_heads=4, tie_embeddings=True, norm_eps=1e-5)),
                                          ("persimmon", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="relu2",
                                                             qk_norm="layer", qk_norm_bias=True, rope_dim=4, n_kv_heads=4, norm_eps=1e-5)),
                                          ("biogpt", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="gelu",
                                                          abs_positions=64, abs_position_offset=2, n_kv_heads=4, tie_embeddings=True, norm_eps=1e-5,
                                                          embed_scale=32 ** 0.5)),
                                          ("opt", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, mlp_act="relu",
                                                       abs_positions=64, abs_position_offset=2, n_kv_heads=4, tie_embeddings=True, norm_eps=1e-5)),
                                          ("codegen", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, mlp_bias=True, mlp_act="gelu_new",
                                                           head_bias=True, rope_interleaved=True, rope_dim=4, n_kv_heads=4, norm_eps=1e-5)),
                                          ("starcoder2", dict(layer_norms=True, norm_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                                                              mlp_act="gelu_new", window=4, tie_embeddings=True, norm_eps=1e-5)),
                                          ("phi", dict(layer_norms=True, norm_bias=True, parallel_blocks=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                                                       mlp_act="gelu_new", head_bias=True, rope_dim=4, norm_eps=1e-5)),
                                          ("cwm", dict(window=4, window_layers=(1,), llama3_factor=4.0, llama3_original_max_positions=8, mlp_bias=True)),
                                          ("nanochat", dict(norm_weights=False, embed_norm=True, rope_reversed=True, qk_norm="rms", qk_norm_after_rope=True,
                                                            mlp_act="relu2", logit_softcap=15.0)),
                                          ("glm", dict(qkv_bias=True, rope_interleaved=True, rope_dim=4)),
                                          ("jais2", dict(layer_norms=True, norm_bias=True, mlp_act="relu2", qkv_bias=True, o_bias=True, mlp_bias=True,
                                                         norm_eps=1e-5)),
                                          ("olmo_hybrid", dict(linear_layers=(0,), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6,
                                                               linear_neg_eigval=True, linear_norm_eps=1e-5, linear_pre_norms=True, pre_norms=False,
                                                               post_norms=True, qk_norm="proj")),
                                          # every block a Mamba-2 mixer alone: its attention fields (unused) are not compared
                                          ("mamba2", dict(linear_layers=(0, 1), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
                                                          linear_v_dim=16, linear_conv=3, linear_dt_min=0.05, mlp_free_layers=(0, 1), norm_eps=1e-5))])
def test_a_dense_model_of_fmoe_s_own_exports_as_a_dense_family(family, knobs, tmp_path):
    """An fmoe model with no MoE block (its MoE fields at the defaults, unused) is written as
    the dense family and read by transformers with the same logits; the attention must match
    the family's (Qwen3's q/k norms, Qwen2's q/k/v biases)."""
    cfg = TransformerConfig(**{**dict(vocab_size=V, hidden=32, n_layers=2, n_dense=2, ffn_dense=48, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=0,
                                      init_std=0.2), **knobs})
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=1)
    hf.save_pretrained(model, tmp_path / "hf", model_type=family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), torch.cat([ref(d[None]).logits[0] for d in docs])) < 1e-5
    if family in ("qwen2", "qwen3"):
        with pytest.raises(ValueError, match=f"model: its config has no {family} equivalent"):
            hf.save_pretrained(hf.Transformer(dataclasses.replace(cfg, **dict.fromkeys(knobs, None if family == "qwen3" else False))),
                               tmp_path / "plain", model_type=family)
    if family == "starcoder2":  # its biases one setting (use_bias)
        with pytest.raises(ValueError, match="model: StarCoder2's biases are one setting .use_bias.; this model has qkv_bias = True, o_bias = False"):
            hf.save_pretrained(hf.Transformer(dataclasses.replace(cfg, o_bias=False)), tmp_path / "apart", model_type=family)


def test_nanochat_reads_weightless_norms_reversed_rope_and_refuses_what_it_lacks(folders, tmp_path):
    """NanoChat's folder reads as norm_weights False (no norm parameter at all), embed_norm, rope_reversed, weightless q/k
    norms after RoPE, relu^2 MLPs and its logits' cap: without the embeddings' norm or the reversed RoPE the logits
    differ; with norm weights (1 at the start: the same logits) the model has them as parameters, and is refused on
    export (NanoChat has none); attention biases are refused on reading."""
    path, ref = folders["nanochat"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.norm_weights, cfg.embed_norm, cfg.rope_reversed, cfg.qk_norm, cfg.qk_norm_after_rope, cfg.mlp_act, cfg.logit_softcap) == (
        False, True, True, "rms", True, "relu2", 1.5)
    assert not [n for n, _ in model.named_parameters() if "norm" in n]
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for change in (dict(embed_norm=False), dict(rope_reversed=False)):
            other = hf.Transformer(dataclasses.replace(cfg, **change))
            other.load_state_dict(model.state_dict())
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, change
        weighted = hf.Transformer(dataclasses.replace(cfg, norm_weights=True))  # the same function at weights 1, which it trains
        missing = weighted.load_state_dict(model.state_dict(), strict=False).missing_keys
        assert sorted(missing) == sorted(["embed_norm.weight", "norm.weight"] + [f"blocks.{i}.{n}_norm.weight" for i in range(3) for n in ("attn", "mlp")])
        assert _rel(weighted.logits(ids, cu), theirs) < 1e-5
    with pytest.raises(ValueError, match=r"model: its config has no nanochat equivalent: \{'norm_weights': \(True, False\)\}"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(cfg, norm_weights=True)), tmp_path / "weighted", model_type="nanochat")
    with pytest.raises(ValueError, match="attention_bias"):
        hf.from_pretrained(_edit(path, tmp_path / "biased", lambda c: c.update(attention_bias=True)), impl="torch")


def test_a_qwen3_model_upcycled_and_written_as_qwen3_moe_gives_the_dense_logits_in_transformers(folders, tmp_path):
    """Qwen3 (dense) -> fmoe.train.upcycle (4 experts of half its FFN, k = 2, Qwen3-MoE's
    routing) -> save_pretrained as qwen3_moe: transformers' own Qwen3-MoE code computes the
    dense model's logits from it."""
    from fmoe.train.upcycle import upcycle_

    path, dense_ref = folders["qwen3"]
    dense, dense_cfg = hf.from_pretrained(path, impl="torch")
    cfg = dataclasses.replace(dense_cfg, n_dense=0, n_experts=4, k=2, ffn_expert=20, score="softmax", pre_softmax=False, n_shared=0,
                              expert_bias=False)
    moe = hf.Transformer(cfg)
    moe.reset_parameters(seed=0)
    upcycle_(moe, dense.state_dict(), dense_cfg, seed=0)
    hf.save_pretrained(moe, tmp_path / "moe", model_type="qwen3_moe")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = torch.cat([dense_ref(d[None]).logits[0] for d in docs])
        assert _rel(torch.cat([theirs(d[None]).logits[0] for d in docs]), want) < 1e-5


SLIDING = {  # windows narrower than the documents: every layer (Mixtral, Qwen3-MoE, Mistral), or the layers layer_types names (Qwen2-MoE, Qwen2)
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=8, intermediate_size=40, sliding_window=4),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, intermediate_size=40, use_sliding_window=True, sliding_window=3,
                                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, use_sliding_window=True, sliding_window=5),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, use_sliding_window=True, sliding_window=3,
                                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("family", list(SLIDING))
def test_sliding_window_models_give_transformers_logits_and_export_back(family, tmp_path):
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(SLIDING[family]()))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert (cfg.window, cfg.window_layers) == {"mixtral": (4, None), "qwen3_moe": (5, None), "qwen2_moe": (3, (0, 2)), "mistral": (4, None),
                                               "qwen2": (3, (0, 2))}[family]
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        full, _ = hf.from_pretrained(tmp_path / "hf", impl="torch", window=None, window_layers=None)  # the window matters here
        assert _rel(full.logits(ids, cu), theirs) > 1e-3
    del model.hf_config
    hf.save_pretrained(model, tmp_path / "fmoe", model_type=family)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fmoe", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    if family not in ("qwen2_moe", "qwen2"):  # a window on some layers only has no Mixtral / Qwen3-MoE / Mistral config
        part, _ = hf.from_pretrained(tmp_path / "hf", impl="torch", window_layers=(0,))
        del part.hf_config
        with pytest.raises(ValueError, match=f"model: its config has no {family} equivalent"):
            hf.save_pretrained(part, tmp_path / "part", model_type=family)


def test_a_model_a_family_cannot_hold_is_refused_before_writing():
    """hf_config of a model of fmoe's own (sigmoid routing with an expert bias, a shared
    expert, a dense first block) as a family without those: DBRX's config was built with no
    comparison and written, transformers then read the folder with missing and unexpected
    keys (other logits). A family that reads the config as no model of its own says so as
    a model it cannot hold, not as a config.json being loaded."""
    cfg = TransformerConfig(vocab_size=V, hidden=32, n_layers=2, n_dense=1, ffn_dense=40, n_experts=4, k=2, ffn_expert=16, n_heads=4, n_kv_heads=2,
                            head_dim=8, mtp_depth=0, clip_qkv=8.0)
    with pytest.raises(ValueError, match=r"^model: its config has no dbrx equivalent: \{'score': \('sigmoid', 'softmax'\)"):
        hf.hf_config(cfg, "dbrx")
    with pytest.raises(ValueError, match=r"^model: its config has no deepseek_v4 equivalent: swiglu_limit = None is not supported"):
        hf.hf_config(cfg, "deepseek_v4")
    dbrx = _family_config("dbrx")  # a model DBRX holds is still written
    assert hf.hf_config(dbrx, "dbrx")["ffn_config"]["moe_num_experts"] == 4


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "dots1"])
def test_dense_blocks_first_past_the_layer_count_make_every_block_dense(family, tmp_path):
    """first_k_dense_replace past num_hidden_layers (DeepSeek-V3's default 3 in a smaller
    config): transformers builds every block dense; fmoe refused the folder ("n_dense:
    expected 0..n_layers = 3, got 5"). It reads the same all-dense model, with the same
    logits, and writes it back as one transformers reads the same."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.first_k_dense_replace = 5
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    assert not any(hasattr(layer.mlp, "gate") for layer in ref.model.layers)  # transformers' model: every block dense
    ref.save_pretrained(tmp_path / "theirs")
    model, cfg = hf.from_pretrained(tmp_path / "theirs", impl="torch")
    assert cfg.n_dense == cfg.n_layers == 3 and not model.moe_layers()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
        assert _rel(_exported_logits(model, tmp_path / "ours", family), _their_logits(ref, docs)) < 1e-5


@pytest.mark.parametrize("field,value,names", [("num_experts_per_tok", 9, r"num_experts_per_tok = 9 \(fmoe's k\): expected 1\.\.8, got 9"),
                                               ("num_hidden_layers", 0, r"num_hidden_layers = 0, expected a positive int"),
                                               ("n_group", 3, r"n_group = 3 \(fmoe's n_groups\): the 8 experts must split evenly")],
                         ids=["num_experts_per_tok", "num_hidden_layers", "n_group"])
def test_a_config_fmoe_refuses_names_the_config_json_field(field, value, names, folders, tmp_path):
    """A config.json value the mapped TransformerConfig refuses is named by its config.json
    field (the error named fmoe's own field: "k: expected 1..8, got 9")."""
    path, _ = folders["deepseek_v3"]
    shutil.copytree(path, tmp_path / "bad")
    fields = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**fields, field: value}))
    with pytest.raises(ValueError, match=r"^config\.json: " + names):
        hf.from_pretrained(tmp_path / "bad")


_LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
              max_position_embeddings=128)
_QWEN_MOE = dict(_LLAMA, model_type="qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
_GPT_OSS = dict(_LLAMA, model_type="gpt_oss", head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
_DEEPSEEK = dict(_LLAMA, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                 qk_nope_head_dim=6, qk_rope_head_dim=4, kv_lora_rank=8, v_head_dim=5, q_lora_rank=12, first_k_dense_replace=1, n_group=1,
                 routed_scaling_factor=1.0)
_PHI3_LONGROPE = dict(type="longrope", short_factor=[1.0, 1.05, 1.1, 1.2], long_factor=[1.0, 4.0, 16.0, 20.0])
_YARN4 = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)


def _read_config_json(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf.read_config(tmp_path)[1]


@pytest.mark.parametrize("config, fields", [
    (_LLAMA, dict(n_kv_heads=2, head_dim=8, norm_eps=1e-6, tie_embeddings=False, qkv_bias=False, o_bias=False, window=None, rope_base=10000.0)),
    ({k: v for k, v in _LLAMA.items() if k != "num_key_value_heads"}, dict(n_kv_heads=4)),
    (dict(_LLAMA, head_dim=16, num_key_value_heads=None), dict(head_dim=16, n_kv_heads=4)),
    (dict(_LLAMA, attention_bias=True), dict(qkv_bias=True, o_bias=True)),
    (dict(_LLAMA, rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0,
                                       original_max_position_embeddings=16)),
     dict(llama3_factor=8.0, llama3_low_freq_factor=2.0, llama3_high_freq_factor=3.0, llama3_original_max_positions=16)),
    (dict(_LLAMA, rope_parameters=_YARN4),
     dict(yarn_factor=4.0, yarn_original_max_positions=16, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
          yarn_truncate=True)),
    (dict(_LLAMA, rope_parameters=dict(_YARN4, mscale=0.5, mscale_all_dim=0.5, beta_fast=16.0, truncate=False)),
     dict(yarn_mscale=0.0, yarn_mscale_all_dim=0.0, yarn_beta_fast=16.0, yarn_truncate=False)),
    (dict(_LLAMA, model_type="mistral", sliding_window=4), dict(window=4, window_layers=None)),
    (dict(_LLAMA, model_type="qwen2", sliding_window=4), dict(window=None, qkv_bias=True, o_bias=False)),
    (dict(_LLAMA, model_type="qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=1), dict(window=4, window_layers=(1, 2))),
    (dict(_LLAMA, model_type="qwen2", num_hidden_layers=30, sliding_window=4, use_sliding_window=True), dict(window=4, window_layers=(28, 29))),
    (dict(_QWEN_MOE, sliding_window=4, use_sliding_window=False), dict(window=None, pre_softmax=True)),
    (dict(_QWEN_MOE, sliding_window=4, use_sliding_window=True, norm_topk_prob=True), dict(window=4, window_layers=None, pre_softmax=False)),
    (dict({k: v for k, v in _QWEN_MOE.items() if k != "num_experts"}, num_local_experts=4), dict(n_experts=4)),
    (dict(_QWEN_MOE, model_type="qwen2_moe", shared_expert_intermediate_size=24), dict(shared_ffn=24, shared_gate=True, qkv_bias=True, pre_softmax=True)),
    (dict(_QWEN_MOE, model_type="qwen2_moe", shared_expert_intermediate_size=0, qkv_bias=False), dict(shared_ffn=0, shared_gate=False, qkv_bias=False)),
    (dict(_QWEN_MOE, model_type="mixtral", num_local_experts=4, sliding_window=4), dict(window=4, window_layers=None, n_experts=4)),
    (dict(_GPT_OSS, rope_parameters=_YARN4),
     dict(window=4, window_layers=(0, 2), swiglu_limit=7.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0, yarn_truncate=True, yarn_beta_fast=32.0)),
    (_DEEPSEEK, dict(rope_interleaved=True, n_groups=None, topk_groups=None, group_score_topk=None, route_scale=None, n_shared=1, n_dense=1,
                     route_normalize=True)),
    (dict(_DEEPSEEK, n_group=2, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=5, norm_topk_prob=False),
     dict(n_groups=2, topk_groups=1, group_score_topk=2, route_scale=2.5, n_shared=1, n_dense=3, route_normalize=False)),
    (dict(_DEEPSEEK, model_type="deepseek_v2", n_group=2, topk_group=1, topk_method="greedy"), dict(n_groups=None, topk_groups=None, pre_softmax=True)),
    (dict(_LLAMA, model_type="phi3", max_position_embeddings=131072, original_max_position_embeddings=4096,
          rope_scaling=dict(_PHI3_LONGROPE, factor=8.0, original_max_position_embeddings=2048)),
     dict(longrope_original_max_positions=4096, longrope_short_scale=math.sqrt(1 + math.log(8.0) / math.log(4096)))),
    (dict(model_type="dbrx", vocab_size=V, d_model=32, n_heads=4, n_layers=2, rope_theta=2e5, attn_config=dict(kv_n_heads=2, rope_theta=5e5),
          ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)), dict(rope_base=2e5, n_kv_heads=2, k=2)),
    (dict(_QWEN_MOE, model_type="phimoe", num_local_experts=4, router_jitter_noise=0.0), dict(score="sparsemixer", sparsemixer_eps=0.0)),
    (dict(_LLAMA, model_type="gemma2", head_dim=8, hidden_activation="gelu_pytorch_tanh", sliding_window=4, query_pre_attn_scalar=8),
     dict(attn_scale=None, window_layers=(0, 2))),
    (dict(_LLAMA, model_type="gemma2", head_dim=8, hidden_activation="gelu_pytorch_tanh", sliding_window=4, query_pre_attn_scalar=16), dict(attn_scale=0.25)),
], ids=["llama", "llama-kv-heads-left-out", "llama-head-dim-kv-heads-null", "llama-attention-bias", "llama3",
        "yarn", "yarn-mscale-pair", "mistral-window", "qwen2-window-off", "qwen2-max-window-layers", "qwen2-max-window-layers-28",
        "qwen3-moe-window-off", "qwen3-moe-window-on", "qwen3-moe-num-local-experts", "qwen2-moe", "qwen2-moe-no-shared", "mixtral-window",
        "gpt-oss", "deepseek-v3", "deepseek-v3-grouped", "deepseek-v2-greedy", "phi3-longrope", "dbrx-top-level-rope-theta", "phimoe-no-jitter",
        "gemma2", "gemma2-query-pre-attn-scalar"])
def test_config_json_fields_read_as_the_family_defines_them(config, fields, tmp_path):
    """A config.json's fields, and the defaults of those it leaves out or sets to null, read
    into the TransformerConfig the family defines."""
    cfg = _read_config_json(tmp_path, config)
    assert {name: getattr(cfg, name) for name in fields} == fields


@pytest.mark.parametrize("config, said", [
    (dict(_LLAMA, rope_parameters=dict(rope_type="dynamic", factor=2.0)), r"rope type 'dynamic' is not supported for llama \(plain RoPE, llama3 or yarn\)"),
    (dict(_GPT_OSS, rope_parameters=dict(rope_type="linear", factor=2.0)), r"rope type 'linear' is not supported for gpt_oss \(plain RoPE or yarn\)"),
    (dict({k: v for k, v in _LLAMA.items() if k != "max_position_embeddings"},
          rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)),
     r"rope_parameters of rope type 'llama3' lack original_max_position_embeddings \(nor is max_position_embeddings set\)"),
    (dict(_LLAMA, rope_parameters=dict(_YARN4, mscale_all_dim=1.0)),
     r"rope_parameters with mscale None and mscale_all_dim 1.0 are not supported for llama \(both equal, or neither\)"),
    (dict(_GPT_OSS, rope_parameters=dict(_YARN4, mscale_all_dim=1.0)), r"rope_parameters.mscale_all_dim without mscale is not supported"),
    (dict(_GPT_OSS, rope_parameters=dict(_YARN4, attention_factor=1.2)), r"attention_factor = 1.2 is not supported \(YaRN's own attention factor, "),
    (dict(_GPT_OSS, num_local_experts=None), r"num_local_experts = None is not supported \(a positive number of experts\)"),
    (dict(_LLAMA, hidden_act="gelu"), r"hidden_act = 'gelu' is not supported \(SwiGLU with silu only\)"),
    (dict(_LLAMA, mlp_bias="yes"), r"mlp_bias = 'yes' is not supported \(true or false\)"),
    (dict(_LLAMA, pretraining_tp=2), r"pretraining_tp = 2 is not supported \(a plain matmul: pretraining_tp = 1\)"),
    (dict(_LLAMA, model_type="mistral", mlp_bias=True), r"mlp_bias = True is not supported \(no MLP biases\)"),
    (dict(_LLAMA, model_type="qwen3", attention_bias=True), r"attention_bias = True is not supported \(no attention biases in Qwen3's attention here\)"),
    (dict(_QWEN_MOE, model_type="qwen2_moe", layer_types=["full_attention"] * 2),
     r"layer_types = \['full_attention', 'full_attention'\] is not supported \(one of full_attention / sliding_attention per layer\)"),
    (dict(_QWEN_MOE, model_type="qwen2_moe", layer_types=["sliding_attention"] * 3, sliding_window=0),
     r"sliding_window = 0 is not supported \(a positive width for the sliding layers\)"),
    (dict(_DEEPSEEK, attention_bias=True), r"attention_bias = True is not supported \(no attention biases in multi-latent attention here\)"),
    (dict(_DEEPSEEK, num_experts_per_tok=1), r"num_experts_per_tok = 1 is not supported \(k > 1: this family renormalises a single sigmoid"),
    (dict(_QWEN_MOE, model_type="olmoe", clip_qkv=8.0), r"clip_qkv = 8.0 is not supported \(OLMoE clamps q and k after their norms"),
    (dict(_LLAMA, intermediate_size="40"), r"intermediate_size = '40', expected a positive int$"),
], ids=["llama-dynamic-rope", "gpt-oss-linear-rope", "llama3-without-positions", "yarn-lone-mscale-all-dim", "gpt-oss-lone-mscale-all-dim",
        "yarn-attention-factor", "gpt-oss-null-experts", "hidden-act", "mlp-bias-not-bool", "pretraining-tp", "mistral-mlp-bias", "qwen3-attention-bias",
        "layer-types-length", "window-zero", "mla-attention-bias", "sigmoid-k1-renormalised", "olmoe-clip-qkv", "size-str"])
def test_config_json_values_fmoe_does_not_build_are_refused_by_name(config, said, tmp_path):
    """A config.json value the family's model is not built with (a RoPE type, a bias, a window,
    a renormalised single sigmoid, a size of the wrong kind) is refused naming the field."""
    with pytest.raises(ValueError, match=r"^config\.json: " + said):
        _read_config_json(tmp_path, config)


def test_a_refused_value_of_a_field_the_file_lacks_keeps_fmoe_s_name(folders, tmp_path):
    """DBRX keeps its experts per token in ffn_config.moe_top_k, not num_experts_per_tok: the
    refusal names fmoe's k rather than a field the file does not have."""
    path, _ = folders["dbrx"]
    shutil.copytree(path, tmp_path / "bad")
    fields = json.loads((tmp_path / "bad" / "config.json").read_text())
    fields["ffn_config"]["moe_top_k"] = 9
    (tmp_path / "bad" / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"^k: expected 1\.\.4, got 9"):
        hf.from_pretrained(tmp_path / "bad")


# transformers 4.x wrote no layer_types: transformers derives them from max_window_layers (Qwen2 and Qwen3: the layers from it
# on slide; Qwen2-MoE: every other one from layer 0 below it)
MAX_WINDOW_LAYERS = {
    "qwen2": (lambda: transformers.Qwen2Config(**COMMON, intermediate_size=40, use_sliding_window=True, sliding_window=3, max_window_layers=1), (1, 2)),
    "qwen3": (lambda: transformers.Qwen3Config(**COMMON, head_dim=8, intermediate_size=40, use_sliding_window=True, sliding_window=3,
                                               max_window_layers=1), (1, 2)),
    "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=16,
                                                      num_experts=4, num_experts_per_tok=2, use_sliding_window=True, sliding_window=3,
                                                      max_window_layers=2), (0,)),
}


@pytest.mark.parametrize("family", list(MAX_WINDOW_LAYERS))
def test_a_qwen_config_without_layer_types_slides_the_layers_max_window_layers_names(family, tmp_path):
    """A config.json without layer_types (as transformers 4.x wrote Qwen2's, Qwen3's and
    Qwen2-MoE's) slid every layer; transformers slides those max_window_layers names, and
    reads max_window_layers and use_sliding_window left out as 28 and false."""
    torch.manual_seed(0)
    make, layers = MAX_WINDOW_LAYERS[family]
    _randomised(transformers.AutoModelForCausalLM.from_config(make())).save_pretrained(tmp_path / "hf")
    folder = _edit(tmp_path / "hf", tmp_path / "4.x", lambda c: c.pop("layer_types"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert [i for i, kind in enumerate(ref.config.layer_types) if kind == "sliding_attention"] == list(layers)
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert (cfg.window, cfg.window_layers) == (3, layers)
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
    config = json.loads((folder / "config.json").read_text())
    for field in ("max_window_layers", "use_sliding_window"):
        left = {k: v for k, v in config.items() if k != field}
        theirs = type(ref.config).from_dict(left).layer_types
        ours = TransformerConfig(**hf.FAMILIES[family].kwargs(left))
        assert [i for i in range(ours.n_layers) if ours.is_sliding(i)] == [i for i, kind in enumerate(theirs) if kind == "sliding_attention"]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("step, dense", [(2, []), (2, [3]), (3, [])], ids=["step2", "step2-dense3", "step3"])
def test_qwen_moe_blocks_are_where_decoder_sparse_step_puts_them(family, step, dense):
    """decoder_sparse_step > 1: block i is MoE when (i + 1) % step == 0 (and not in
    mlp_only_layers), as transformers builds the model (every test folder had step 1, where
    i % step == 0 reads the same)."""
    config = FAMILIES[family]()
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 6, step, dense
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * 6
    theirs = transformers.AutoModelForCausalLM.from_config(config)
    moe = tuple(i for i, layer in enumerate(theirs.model.layers) if "Sparse" in type(layer.mlp).__name__)
    assert moe and moe == tuple(i for i in range(6) if i not in dense and (i + 1) % step == 0)
    assert TransformerConfig(**hf.FAMILIES[family].kwargs(config.to_dict())).moe_layers == moe


@pytest.mark.parametrize("family", ["gpt_oss", "ministral", "cwm"])
def test_a_model_without_a_window_exports_as_a_windowed_family_with_every_layer_full(family, tmp_path):
    """A model of fmoe's own without a sliding layer, written as gpt_oss, ministral or cwm: its
    config.json had sliding_window null, which transformers refuses (cwm) or fails on in the
    forward (gpt_oss, ministral); a width is written, unused, beside layer_types all full."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.window is None
    del model.hf_config  # written from its TransformerConfig
    hf.save_pretrained(model, tmp_path / "fmoe", model_type=family)
    written = json.loads((tmp_path / "fmoe" / "config.json").read_text())
    assert isinstance(written["sliding_window"], int) and written["layer_types"] == ["full_attention"] * 3
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fmoe", dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(_their_logits(back, docs), _their_logits(ref, docs)) < 1e-5


LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


@pytest.mark.parametrize("family", ["qwen3_moe", "exaone_moe"])
def test_llama3_rope_scaling_gives_transformers_logits_and_exports_back(family, folders, tmp_path):
    """rope_type "llama3" (Llama 3.1's frequency-dependent scaling; EXAONE 4's, here beside
    its NoPE global layers): over an original context of 16 positions the 4 frequencies of
    an 8-channel head are blended (wavelength 2 pi) or divided by 4."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.rope_parameters = dict(LLAMA3)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert (cfg.llama3_factor, cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor, cfg.llama3_original_max_positions) == (4.0, 1.0, 4.0, 16)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        plain, _ = hf.from_pretrained(tmp_path / "hf", impl="torch", llama3_factor=None)  # the scaling matters here
        assert _rel(plain.logits(ids, cu), theirs) > 1e-3
    del model.hf_config
    hf.save_pretrained(model, tmp_path / "fmoe", model_type=family)
    assert json.loads((tmp_path / "fmoe" / "config.json").read_text())["rope_parameters"] == LLAMA3
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fmoe", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    with pytest.raises(ValueError, match="config.json: rope_parameters of rope type 'llama3' lack high_freq_factor"):
        hf.from_pretrained(_edit(tmp_path / "hf", tmp_path / "bad", lambda c: c["rope_parameters"].pop("high_freq_factor")))


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=True, original_max_position_embeddings=4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
@pytest.mark.parametrize("mscale", [None, 1.0], ids=["attention factor", "mscale pair"])
def test_yarn_of_llama_like_families_gives_transformers_logits_and_exports_back(family, mscale, tmp_path):
    """rope_type "yarn" in a Llama-like family (Qwen2.5's and Qwen3's long-context configs):
    was refused ("plain RoPE or llama3"). transformers scales cos and sin by 0.1 ln(factor) + 1
    (or mscale(factor, mscale) / mscale(factor, mscale_all_dim), 1 for an equal pair) and keeps
    the softmax scale 1 / sqrt(head_dim), as DeepSeek's attention does not; an unequal pair,
    which fmoe would tie to the softmax scale, is refused."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.rope_parameters = dict(YARN, **({} if mscale is None else dict(mscale=mscale, mscale_all_dim=mscale)))
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert (cfg.yarn_factor, cfg.yarn_original_max_positions, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (4.0, 4, 1.0 if mscale is None else 0.0, 0.0)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        plain, _ = hf.from_pretrained(tmp_path / "hf", impl="torch", yarn_factor=None)  # the scaling matters here
        assert _rel(plain.logits(ids, cu), theirs) > 1e-3
    del model.hf_config
    hf.save_pretrained(model, tmp_path / "fmoe", model_type=family)
    written = json.loads((tmp_path / "fmoe" / "config.json").read_text())["rope_parameters"]
    assert {k: v for k, v in written.items() if k != "partial_rotary_factor"} == config.rope_parameters
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fmoe", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(_their_logits(back, docs), theirs) < 1e-5
    with pytest.raises(ValueError, match=f"config.json: rope_parameters with mscale 1.0 and mscale_all_dim 0.5 are not supported for {family} "
                                         r"\(both equal, or neither\)"):
        hf.from_pretrained(_edit(tmp_path / "hf", tmp_path / "bad", lambda c: c["rope_parameters"].update(mscale=1.0, mscale_all_dim=0.5)))


@pytest.mark.parametrize("rope", [YARN, LLAMA3], ids=["yarn", "llama3"])
def test_scaled_rope_without_original_max_position_embeddings_reads_max_position_embeddings(rope, tmp_path):
    """rope_parameters of type yarn or llama3 without original_max_position_embeddings (YaRN's
    were refused): transformers reads max_position_embeddings in its place. A rope type Llama
    does not take is refused naming the ones it does."""
    torch.manual_seed(0)
    config = FAMILIES["llama"]()
    config.rope_parameters = dict(rope)
    _randomised(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(tmp_path / "hf")
    folder = _edit(tmp_path / "hf", tmp_path / "short", lambda c: c["rope_parameters"].pop("original_max_position_embeddings"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert (cfg.yarn_original_max_positions if rope is YARN else cfg.llama3_original_max_positions) == COMMON["max_position_embeddings"]
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        # a top-level original_max_position_embeddings (Phi-3's place) is not read by Llama's config: nor by fmoe's
        top = _edit(folder, tmp_path / "top", lambda c: c.update(original_max_position_embeddings=16))
        assert _rel(hf.from_pretrained(top, impl="torch")[0].logits(ids, cu), theirs) < 1e-5
        plain, _ = hf.from_pretrained(folder, impl="torch", **{"yarn_factor" if rope is YARN else "llama3_factor": None})  # the scaling matters here
        assert _rel(plain.logits(ids, cu), theirs) > 1e-3
    with pytest.raises(ValueError, match=r"config.json: rope type 'dynamic' is not supported for llama \(plain RoPE, llama3 or yarn\)"):
        hf.from_pretrained(_edit(folder, tmp_path / "dynamic", lambda c: c["rope_parameters"].update(rope_type="dynamic")))


def test_config_mapping_reads_the_family_fields(folders, tmp_path):
    _, cfg = hf.read_config(folders["qwen2_moe"][0])
    assert cfg.moe_layers == (1, 2) and cfg.shared_size == 40 and cfg.shared_gate and cfg.qkv_bias and cfg.pre_softmax
    _, cfg = hf.read_config(folders["qwen3_moe"][0])
    assert cfg.qk_norm == "head" and not cfg.pre_softmax and cfg.moe_layers == (0, 1, 2)
    _, cfg = hf.read_config(folders["olmoe"][0])
    assert cfg.qk_norm == "proj" and cfg.pre_softmax and cfg.n_dense == 0
    _, cfg = hf.read_config(folders["mixtral"][0])
    assert cfg.n_experts == 4 and cfg.score == "softmax" and not cfg.expert_bias and cfg.shared_size == 0
    _, cfg = hf.read_config(folders["glm4_moe"][0])
    assert cfg.rope_dim == 4 and cfg.qkv_bias and cfg.qk_norm == "head" and cfg.score == "sigmoid" and cfg.expert_bias
    assert not cfg.route_normalize and cfg.route_scale == 1.5 and cfg.n_dense == 1 and cfg.shared_size == 16 and cfg.n_groups is None
    _, cfg = hf.read_config(folders["flint"][0])
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.attn_sinks, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (4, (0, 2), (1,), True, "head", True, True)
    assert (cfg.score, cfg.expert_bias, cfg.route_normalize, cfg.moe_layers, cfg.shared_size, cfg.shared_gate) == ("sigmoid", False, True, (1, 2), 24, False)
    assert hf.key_map(hf.FAMILIES["flint"], cfg)["blocks.0.attn.sinks"].keys == ("model.layers.0.self_attn.softmax_offset",)
    # the defaults where config.json leaves the lists out: full attention in the first two layers, every fourth from 1 and the last
    bare = _edit(folders["flint"][0], tmp_path / "flint", lambda c: [c.pop(n) for n in ("layer_types", "mlp_only_layers")])
    assert hf.read_config(bare)[1] == dataclasses.replace(cfg, window=None, window_layers=None, nope_layers=(0, 1, 2), moe_layers=(2,))
    ten = dict(json.loads((bare / "config.json").read_text()), num_hidden_layers=10)
    full = [i for i, kind in enumerate(transformers.FlintConfig(num_hidden_layers=10).layer_types) if kind == "full_attention"]
    assert hf.FAMILIES["flint"].kwargs(ten)["nope_layers"] == tuple(full) == (0, 1, 5, 9)
    _, cfg = hf.read_config(folders["mellum"][0])
    assert (cfg.window, cfg.window_layers, cfg.local_rope_base, cfg.rope_base, cfg.llama3_factor, cfg.n_dense) == (4, (0, 2), 100.0, 5e5, 4.0, 1)
    assert cfg.qk_norm == "head" and cfg.qkv_bias and cfg.o_bias and cfg.score == "softmax" and not cfg.pre_softmax and cfg.shared_size == 0
    # one RoPE for both layer types: the trunk's everywhere
    same = _edit(folders["mellum"][0], tmp_path / "mellum", lambda c: c["rope_parameters"].update(sliding_attention=c["rope_parameters"]["full_attention"]))
    assert hf.read_config(same)[1] == dataclasses.replace(cfg, local_rope_base=None)
    _, cfg = hf.read_config(folders["hy_v3"][0])
    assert cfg.qk_norm == "head" and not cfg.qk_norm_after_rope and cfg.qkv_bias and cfg.o_bias and cfg.moe_layers == (0, 2)
    assert (cfg.score, cfg.expert_bias, cfg.route_normalize, cfg.route_scale, cfg.n_groups, cfg.shared_size) == ("sigmoid", True, True, 2.5, None, 16)
    keys = hf.key_map(hf.FAMILIES["hy_v3"], cfg)
    assert (keys["blocks.0.mlp.router"].keys, keys["blocks.0.mlp.expert_bias"].keys, keys["blocks.0.mlp.shared.w_up"].keys) == (
        ("model.layers.0.mlp.router.gate.weight",), ("model.layers.0.mlp.expert_bias",), ("model.layers.0.mlp.shared_mlp.up_proj.weight",))
    _, cfg = hf.read_config(folders["sarvam_moe"][0])
    assert cfg.rope_dim is None and cfg.rope_base == 8e6 and cfg.qkv_bias and not cfg.o_bias and cfg.qk_norm == "head" and cfg.expert_bias
    assert (cfg.n_groups, cfg.topk_groups, cfg.route_scale, cfg.route_normalize, cfg.n_dense, cfg.shared_size) == (2, 1, 2.5, True, 1, 16)
    keys = hf.key_map(hf.FAMILIES["sarvam_moe"], cfg)
    assert keys["blocks.0.attn.wk"] == hf.Tensor(("model.layers.0.attention.query_key_value.weight",), transpose=True, chunk=(1, (32, 16, 16)))
    assert keys["blocks.0.attn.bv"] == hf.Tensor(("model.layers.0.attention.query_key_value.bias",), chunk=(2, (32, 16, 16)))
    assert keys["embed"].keys == ("model.word_embeddings.weight",) and keys["blocks.1.mlp.expert_bias"].keys == ("model.layers.1.mlp.gate.expert_bias",)
    # Sarvam's released config.json files, written for their own code, name some fields otherwise
    released = _edit(folders["sarvam_moe"][0], tmp_path / "sarvam", lambda c: c.update(
        num_experts=c.pop("n_routed_experts"), num_shared_experts=c.pop("n_shared_experts"), use_qkv_bias=c.pop("attention_bias"),
        rope_theta=c.pop("rope_parameters")["rope_theta"], use_bias=False, moe_router_enable_expert_bias=True))
    assert hf.read_config(released)[1] == cfg
    _, cfg = hf.read_config(folders["sarvam_mla"][0])
    assert (cfg.q_rank, cfg.kv_rank, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim, cfg.rope_interleaved) == (None, 8, 10, 4, 5, True)
    assert (cfg.n_groups, cfg.route_scale, cfg.route_normalize, cfg.n_dense, cfg.shared_size, cfg.score) == (None, 2.5, True, 1, 16, "sigmoid")
    # the released format: its names, the legacy head_dim and q_head_dim, and YaRN as rope_scaling of type deepseek_yarn, read as
    # transformers reads it
    yarn = dict(type="deepseek_yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=0.8, mscale_all_dim=1.0)
    released = _edit(folders["sarvam_mla"][0], tmp_path / "sarvam_mla", lambda c: c.update(
        num_experts=c.pop("n_routed_experts"), num_shared_experts=c.pop("n_shared_experts"), head_dim=12, q_head_dim=10,
        rope_theta=c.pop("rope_parameters")["rope_theta"], rope_scaling=yarn))
    config = json.loads((released / "config.json").read_text())
    theirs = transformers.SarvamMLAConfig(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()
    assert hf.read_config(released)[1] == TransformerConfig(**hf.FAMILIES["sarvam_mla"].kwargs(theirs))
    assert hf.read_config(released)[1] == dataclasses.replace(cfg, yarn_factor=4.0, yarn_original_max_positions=32, yarn_mscale=0.8,
                                                             yarn_mscale_all_dim=1.0)
    _, cfg = hf.read_config(folders["deepseek_v3"][0])
    assert (cfg.q_rank, cfg.kv_rank, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim, cfg.n_kv_heads) == (12, 8, 10, 4, 5, 4)
    assert cfg.rope_interleaved and (cfg.yarn_factor, cfg.yarn_original_max_positions, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (4.0, 32, 0.8, 1.0)
    assert (cfg.n_groups, cfg.topk_groups, cfg.group_score_topk, cfg.route_scale, cfg.route_normalize) == (4, 2, 2, 2.5, True)
    assert cfg.mtp_norm
    _, cfg = hf.read_config(folders["deepseek_v2"][0])
    assert (cfg.q_rank, cfg.kv_rank, cfg.rope_dim, cfg.rope_interleaved, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (None, 8, 4, True, 0.707, 0.707)
    assert (cfg.score, cfg.pre_softmax, cfg.expert_bias, cfg.n_groups, cfg.topk_groups, cfg.group_score_topk, cfg.route_scale) == (
        "softmax", True, False, 4, 2, 1, 2.5)
    assert cfg.n_dense == 1 and cfg.shared_size == 16
    _, cfg = hf.read_config(folders["glm4_moe_lite"][0])
    assert (cfg.q_rank, cfg.kv_rank, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim, cfg.moe_layers) == (None, 8, 10, 4, 5, (0, 2))
    assert (cfg.n_groups, cfg.topk_groups, cfg.route_scale, cfg.route_normalize, cfg.yarn_factor) == (2, 1, 1.8, True, None)
    _, cfg = hf.read_config(folders["solar_open"][0])
    assert cfg.qkv_bias and not cfg.o_bias and cfg.qk_norm is None and cfg.rope_dim is None and cfg.rope_base == 1e6
    assert (cfg.n_groups, cfg.topk_groups, cfg.group_score_topk, cfg.route_scale, cfg.route_normalize) == (2, 1, 2, 1.5, True)
    assert cfg.score == "sigmoid" and cfg.expert_bias and cfg.n_dense == 0 and cfg.moe_layers is None and cfg.shared_size == 16
    _, cfg = hf.read_config(folders["dots1"][0])
    assert cfg.qk_norm == "head" and cfg.qkv_bias and cfg.o_bias and (cfg.window, cfg.window_layers) == (4, (1,))
    assert (cfg.n_groups, cfg.topk_groups, cfg.group_score_topk, cfg.route_scale, cfg.route_normalize) == (4, 2, 2, 2.0, False)
    assert cfg.score == "sigmoid" and cfg.expert_bias and cfg.n_dense == 1 and cfg.shared_size == 16
    _, cfg = hf.read_config(folders["minimax_m2"][0])
    assert cfg.qk_norm == "proj" and cfg.rope_dim == 4 and cfg.score == "sigmoid" and cfg.expert_bias and cfg.route_normalize
    assert cfg.n_groups is None and cfg.route_scale is None and cfg.n_dense == 0 and cfg.shared_size == 0
    # MiniMax-M2's released configs give the rotary part as rotary_dim
    legacy = _edit(folders["minimax_m2"][0], tmp_path / "legacy", lambda c: (c["rope_parameters"].pop("partial_rotary_factor"), c.update(rotary_dim=4)))
    assert hf.read_config(legacy)[1] == cfg
    _, cfg = hf.read_config(folders["granitemoe"][0])
    assert (cfg.attn_scale, cfg.embed_scale, cfg.residual_scale, cfg.logit_divisor) == (0.3, 3.0, 0.5, 2.5)
    assert cfg.score == "softmax" and not cfg.pre_softmax and cfg.tie_embeddings and cfg.n_dense == 0 and cfg.shared_size == 0
    _, cfg = hf.read_config(folders["granitemoeshared"][0])
    assert (cfg.attn_scale, cfg.embed_scale, cfg.residual_scale, cfg.logit_divisor, cfg.shared_size) == (0.2, 2.0, 0.7, 4.0, 20)
    assert not cfg.tie_embeddings and not cfg.shared_gate
    # an fmoe model's default softmax scale is written out as Granite's attention_multiplier
    default = dataclasses.replace(cfg, attn_scale=None)
    assert hf.hf_config(default, "granitemoeshared")["attention_multiplier"] == cfg.head_dim**-0.5
    _, cfg = hf.read_config(folders["hunyuan_v1_moe"][0])
    assert cfg.qk_norm == "head" and cfg.qk_norm_after_rope and cfg.shared_size == 24 and cfg.n_dense == 0 and cfg.k == 2
    assert cfg.rope_base == 10000.0 * 50.0 ** (8 / 6) and cfg.score == "softmax" and not cfg.pre_softmax and cfg.tie_embeddings
    # the released configs: rope_scaling {"type": "dynamic", "alpha": ...} and a top-level rope_theta; per-layer lists
    legacy = _edit(folders["hunyuan_v1_moe"][0], tmp_path / "hunyuan", lambda c: (
        c.pop("rope_parameters"), c.update(rope_theta=10000.0, rope_scaling=dict(type="dynamic", alpha=50.0, factor=1.0), moe_topk=[2] * 3)))
    assert hf.read_config(legacy)[1] == cfg
    _, cfg = hf.read_config(folders["granitemoe_swa"][0])
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.rope_base, cfg.attn_sinks, cfg.shared_size) == (4, (1, 2), (1,), 5000.0, True, 20)
    assert cfg.local_rope_base == 100.0  # the sliding layer 2's own base beside the full layer 0's
    assert (cfg.attn_scale, cfg.embed_scale, cfg.residual_scale, cfg.logit_divisor) == (0.3, 2.0, 0.6, 3.0)
    _, cfg = hf.read_config(folders["afmoe"][0])
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.attn_gate, cfg.pre_norms, cfg.post_norms, cfg.qk_norm) == (
        4, (0, 2), (1,), True, True, True, "head")
    assert (cfg.score, cfg.expert_bias, cfg.route_normalize, cfg.route_scale, cfg.n_dense, cfg.shared_size, cfg.embed_scale) == (
        "sigmoid", True, True, 2.0, 1, 16, 32**0.5)
    _, cfg = hf.read_config(folders["llama4_text"][0])
    assert (cfg.moe_layers, cfg.nope_layers, cfg.chunk, cfg.chunk_layers, cfg.nope_temperature_floor, cfg.nope_temperature_scale) == (
        (1,), (1,), 4, (0, 2), 2, 0.5)
    assert cfg.qk_norm == "rms" and cfg.qk_norm_after_rope and not cfg.nope_qk_norm and cfg.rope_interleaved and cfg.qkv_bias and cfg.o_bias
    assert (cfg.score, cfg.expert_bias, cfg.route_normalize, cfg.route_on_input, cfg.shared_size, cfg.ffn_dense) == ("sigmoid", False, False, True, 16, 40)
    # a correction bias is mapped whatever the experts' layout (a stacked family's too), never left at 0 unread
    biased = hf.key_map(hf.FAMILIES["llama4_text"], dataclasses.replace(cfg, expert_bias=True))
    assert biased["blocks.1.mlp.expert_bias"].keys == ("model.layers.1.feed_forward.gate.e_score_correction_bias",)
    # the defaults where config.json leaves the lists out: NoPE every no_rope_layer_interval-th layer, the RoPE layers chunked
    bare = _edit(folders["llama4_text"][0], tmp_path / "llama4", lambda c: [c.pop(n) for n in ("no_rope_layers", "layer_types", "moe_layers")])
    assert hf.read_config(bare)[1] == cfg
    # without the temperature or the q/k norms
    plain = _edit(folders["llama4_text"][0], tmp_path / "llama4-plain", lambda c: c.update(attn_temperature_tuning=False, use_qk_norm=False))
    assert hf.read_config(plain)[1] == dataclasses.replace(cfg, nope_temperature_floor=None, qk_norm=None, qk_norm_after_rope=False)


def test_laguna_reads_its_heads_rope_and_gate_per_layer_type(folders, tmp_path):
    """Laguna's layer types each have their own query heads and RoPE (base and rotated
    channels); its gate is softplus per head, or per channel with gating "per-element"; its
    router's logits are soft-capped. A per-element model with every layer sliding (one head
    count, one RoPE), and one whose full layers have YaRN beside the sliding layer's plain
    RoPE, load with transformers' logits, and fmoe's own such models export as ones
    transformers reads with fmoe's logits."""
    _, cfg = hf.read_config(folders["laguna"][0])
    assert (cfg.n_heads, cfg.local_heads, cfg.window, cfg.window_layers) == (4, 8, 4, (1, 2))
    assert (cfg.rope_base, cfg.rope_dim, cfg.local_rope_base, cfg.local_rope_dim) == (5e5, 4, 1e4, 8)
    assert (cfg.attn_gate, cfg.attn_gate_act, cfg.attn_gate_per_head, cfg.qk_norm) == (True, "softplus", True, "head")
    assert (cfg.router_softcap, cfg.route_scale, cfg.score, cfg.expert_bias, cfg.n_dense, cfg.shared_size) == (1.5, 2.0, "sigmoid", True, 1, 24)
    torch.manual_seed(3)

    def laguna(**fields):
        return transformers.LagunaConfig(**COMMON, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=24, sliding_window=4, bos_token_id=None,
                                         eos_token_id=None, pad_token_id=None, **fields)

    config = laguna(gating="per-element", layer_types=["sliding_attention"] * 3, mlp_layer_types=["sparse", "dense", "sparse"])
    yarn = laguna(layer_types=["full_attention", "sliding_attention", "full_attention"],
                  rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=5e5, factor=4.0, original_max_position_embeddings=8,
                                                           partial_rotary_factor=0.5),
                                       sliding_attention=dict(rope_type="default", rope_theta=1e4)))
    docs, ids, cu = _packed()
    for name, made in (("per-element", config), ("yarn", yarn)):
        ref = _randomised(transformers.AutoModelForCausalLM.from_config(made))
        ref.save_pretrained(tmp_path / name)
        model, cfg = hf.from_pretrained(tmp_path / name, impl="torch")
        if name == "per-element":
            assert (cfg.attn_gate_per_head, cfg.local_heads, cfg.local_rope_base, cfg.rope_base, cfg.rope_dim, cfg.router_softcap) == (
                False, None, None, 1e4, None, None)
            assert cfg.moe_layers == (0, 2) and model.blocks[0].attn.wg.shape == (32, 4 * 8)
        else:  # YaRN in the full layers' half of each head; the sliding layer's plain RoPE over all of it
            assert (cfg.yarn_factor, cfg.yarn_original_max_positions, cfg.rope_dim, cfg.local_rope_base, cfg.local_rope_dim) == (4.0, 8, 4, 1e4, 8)
        with torch.no_grad():
            assert _rel(model.logits(ids, cu), torch.cat([ref(d[None]).logits[0] for d in docs])) < 1e-5
        del model.hf_config  # fmoe's own: written from its config
        hf.save_pretrained(model, tmp_path / f"{name}-out", model_type="laguna")
        written = json.loads((tmp_path / f"{name}-out" / "config.json").read_text())
        assert written["gating"] == ("per-element" if name == "per-element" else "per-head") and written["num_attention_heads_per_layer"] == [4] * 3
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-out", dtype=torch.float32).eval()
        with torch.no_grad():
            assert _rel(model.logits(ids, cu), torch.cat([back(d[None]).logits[0] for d in docs])) < 1e-5


def test_minimax_m3_reads_its_block_sparse_attention_and_released_folders(folders, tmp_path):
    """MiniMax-M3's text model (minimax_m3_vl_text): block-sparse attention in the layers
    layer_types names, its indexer's fields, the clamped SwiGLU in the routed and shared
    experts and the dense MLPs, norms of gain 1 + weight; the blocks matter (every block
    chosen gives other logits). The released configs' older fields (sparse_attention_config,
    moe_layer_freq) read as the same model. A released folder (minimax_m3_vl: the text model
    under language_model. in MiniMax-M2's names, the indexer's modules index_q_proj, ...,
    beside a vision tower) loads its text model with transformers' logits and is written back
    as minimax_m3_vl_text; fmoe's own model with every block sparse and MoE exports as one
    transformers reads with fmoe's logits."""
    path, ref = folders["minimax_m3_vl_text"]
    _, cfg = hf.read_config(path)
    assert (cfg.index_topk_blocks, cfg.index_block_size, cfg.index_local_blocks, cfg.index_heads, cfg.index_head_dim,
            cfg.index_block_layers) == (2, 3, 1, 2, 8, (1, 2))
    assert (cfg.qk_norm, cfg.zero_centered_norms, cfg.rope_dim, cfg.n_dense, cfg.shared_size, cfg.route_scale, cfg.score) == (
        "head", True, 4, 1, 24, 2.0, "sigmoid")
    glu = (1.702, 1.5, 1.0)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_offset) == (cfg.shared_swiglu_alpha, cfg.shared_swiglu_limit, cfg.shared_swiglu_offset) == glu
    docs, ids, cu = _packed()
    model, _ = hf.from_pretrained(path, impl="torch")
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for block in model.blocks:  # every block chosen: the 12-token document's queries see keys the indexer left out
            if block.attn.cfg.index_topk_blocks is not None:
                block.attn.cfg = dataclasses.replace(block.attn.cfg, index_topk_blocks=8)
        assert _rel(model.logits(ids, cu), theirs) > 1e-2
    config = json.loads((path / "config.json").read_text())
    sparse = {old: config.pop(flat) for flat, old in hf._M3_INDEX_LEGACY.items()}
    older = dict(config, sparse_attention_config=dict(sparse, sparse_attention_freq=[0, 1, 1]), moe_layer_freq=[0, 1, 1])
    del older["layer_types"], older["mlp_layer_types"]
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "config.json").write_text(json.dumps(older))
    assert hf.read_config(tmp_path / "older")[1] == cfg
    assert transformers.AutoConfig.from_pretrained(tmp_path / "older").layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 2
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2, spatial_merge_size=2)
    whole = transformers.MiniMaxM3VLConfig(text_config=ref.config.to_dict(), vision_config=vision, projector_hidden_size=32)
    theirs = _saved_multimodal(transformers.MiniMaxM3SparseForConditionalGeneration, whole, tmp_path / "released")
    stored = set(_read_all(tmp_path / "released"))
    assert {"language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight", "language_model.model.layers.1.self_attn.index_q_proj.weight",
            "language_model.model.layers.2.block_sparse_moe.e_score_correction_bias", "language_model.lm_head.weight"} <= stored
    _, vl_cfg, written = _text_model_round_trip(tmp_path / "released", theirs, tmp_path / "out", kind="minimax_m3_vl",
                                                prefix="language_model.model.", head="language_model.lm_head.weight", text_kind="minimax_m3_vl_text")
    assert dataclasses.replace(vl_cfg, impl=cfg.impl) == cfg and written["layer_types"] == ["full_attention"] + ["minimax_m3_sparse"] * 2
    torch.manual_seed(5)  # fmoe's own: every block sparse and MoE, RoPE over whole heads, two blocks always kept
    own = TransformerConfig(vocab_size=V, hidden=32, n_layers=2, n_dense=0, ffn_dense=40, n_experts=4, k=2, ffn_expert=16, n_shared=0, shared_ffn=24,
                            n_heads=4, n_kv_heads=2, head_dim=8, score="sigmoid", expert_bias=True, route_scale=2.5, qk_norm="head",
                            zero_centered_norms=True, swiglu_alpha=1.702, swiglu_limit=2.0, swiglu_offset=1.0, shared_swiglu_alpha=1.702,
                            shared_swiglu_limit=2.0, shared_swiglu_offset=1.0, index_topk_blocks=3, index_block_size=2, index_local_blocks=2,
                            index_heads=2, index_head_dim=8, mtp_depth=0, impl="torch")
    mine = Transformer(own)
    mine.reset_parameters(seed=5)
    theirs = _exported_logits(mine, tmp_path / "own", "minimax_m3_vl_text", nudge=0.3)
    with torch.no_grad():
        assert _rel(mine.logits(ids, cu), theirs) < 1e-5


def test_jetmoe_s_attention_experts_are_read_and_fmoe_s_own_mixture_of_attention_heads_is_written(folders, tmp_path):
    """A JetMoE folder: every block a mixture of attention heads (4 experts' query and output
    projections, 2 per token, the kv heads from kv_proj), its MoE's output bias, the head tied,
    the routers' aux_loss_coef as moa_aux_coeff; the attention experts matter (the router
    turned to choose other experts moves the logits). fmoe's own such model (its weights
    nudged off their start: the biases too) written as jetmoe gives its logits in
    transformers; a model without attention experts is not written as jetmoe."""
    path, ref = folders["jetmoe"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.moa_experts, cfg.moa_topk, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 2, 4, 2, 8)
    assert cfg.o_bias and cfg.moe_out_bias and cfg.tie_embeddings and cfg.moa_aux_coeff == 0.01 and cfg.n_dense == 0
    docs, ids, cu = _packed()
    with torch.no_grad():
        before = model.logits(ids, cu)
        assert _rel(before, _their_logits(ref, docs)) < 1e-5
        router = model.blocks[1].attn.moa_router
        router.copy_(-router)  # each token's least likely experts now
        assert _rel(model.logits(ids, cu), before) > 1e-2
    torch.manual_seed(3)
    own = TransformerConfig(vocab_size=V, hidden=32, n_layers=2, n_dense=0, ffn_dense=24, n_experts=5, k=3, ffn_expert=24, n_shared=0,
                            n_heads=6, n_kv_heads=2, head_dim=8, score="softmax", expert_bias=False, moa_experts=5, moa_topk=3, o_bias=True,
                            moe_out_bias=True, tie_embeddings=True, moa_aux_coeff=0.02, mtp_depth=0, impl="torch")
    mine = Transformer(own)
    theirs = _exported_logits(mine, tmp_path / "own", "jetmoe", nudge=0.3)
    written = json.loads((tmp_path / "own" / "config.json").read_text())
    assert (written["num_local_experts"], written["num_experts_per_tok"], written["kv_channels"], written["aux_loss_coef"]) == (5, 3, 8, 0.02)
    with torch.no_grad():
        assert _rel(mine.logits(ids, cu), theirs) < 1e-5
    # JetMoE's attention has as many experts as its MoE, and routes as many per token; a model without attention experts is not JetMoE
    for change, named in ((dict(moa_experts=4), "'moa_experts': (4, 5)"), (dict(moa_experts=None, moa_topk=1, moa_aux_coeff=0.01, n_heads=4),
                                                                             "'moa_experts': (None, 5)")):
        with pytest.raises(ValueError, match=re.escape(named)):
            hf.save_pretrained(Transformer(dataclasses.replace(own, **change)), tmp_path / "other", model_type="jetmoe")


def _left_out(config: dict):
    """(field, config.json without it) for each field of `config`, and each of its rope_parameters'."""
    for field in config:
        if field not in ("model_type", "architectures", "transformers_version"):
            yield field, {k: v for k, v in config.items() if k != field}
    for field in config.get("rope_parameters") or {}:
        if field != "rope_type":
            yield f"rope_parameters.{field}", dict(config, rope_parameters={k: v for k, v in config["rope_parameters"].items() if k != field})


def test_the_newer_dense_families_read_their_layer_patterns_as_transformers_completes_them(folders):
    """The per-layer knobs of the newer dense families: read from the test's configs; left out
    (the default patterns), or in an older config.json's form, read as the config transformers
    completes from it; bad values refused by name."""
    def ours(family: str, config: dict) -> TransformerConfig:
        return TransformerConfig(**hf.FAMILIES[family].kwargs(config))

    def theirs(cls, config: dict) -> dict:
        return cls(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()

    cfg = hf.read_config(folders["olmo3"][0])[1]
    assert (cfg.window, cfg.window_layers, cfg.local_rope_base, cfg.rope_base, cfg.yarn_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (
        4, (0, 2), 5e5, 5e5, 4.0, 1.0, 0.0)
    assert (cfg.qk_norm, cfg.pre_norms, cfg.post_norms, cfg.n_dense) == ("proj", False, True, 3)
    # OLMo 3's older config.json: rope_theta for both layer types, rope_scaling for the full layers alone; three sliding
    # layers in four by default
    older = dict(model_type="olmo3", vocab_size=V, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, intermediate_size=40,
                 sliding_window=4, rope_theta=5e5, rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4,
                                                                     attention_factor=0.1 * math.log(8.0) + 1))
    mine = ours("olmo3", older)
    assert mine == ours("olmo3", theirs(transformers.Olmo3Config, older))
    assert (mine.window_layers, mine.local_rope_base, mine.yarn_factor) == ((0, 1, 2, 4, 5, 6), 5e5, 8.0)
    plain = ours("olmo3", dict(older, rope_scaling=None))  # the same RoPE in every layer: one set of tables
    assert (plain.local_rope_base, plain.yarn_factor) == (None, None) and plain == ours("olmo3", theirs(transformers.Olmo3Config, dict(older, rope_scaling=None)))
    # SmolLM3: every fourth layer NoPE by default; the window only with use_sliding_window, then in the NoPE layers
    smol = dict(model_type="smollm3", vocab_size=V, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, intermediate_size=40, sliding_window=4)
    for config in (smol, dict(smol, use_sliding_window=True)):
        mine = ours("smollm3", config)
        assert mine == ours("smollm3", theirs(transformers.SmolLM3Config, config))
        assert mine.nope_layers == (3, 7) and mine.tie_embeddings and mine.n_kv_heads == 4 and mine.rope_base == 2e6
    assert ours("smollm3", smol).window is None and ours("smollm3", dict(smol, use_sliding_window=True)).window_layers == (3, 7)
    # EXAONE 4.0: sliding_window_pattern as an int or its string of L (local) and G (global); no window: RoPE everywhere
    exaone = dict(model_type="exaone4", vocab_size=V, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=40, sliding_window=4, sliding_window_pattern=4)
    mine = ours("exaone4", exaone)
    assert mine == ours("exaone4", theirs(transformers.Exaone4Config, exaone)) == ours("exaone4", dict(exaone, sliding_window_pattern="LLLG"))
    assert (mine.window_layers, mine.nope_layers) == ((0, 1, 2, 4, 5, 6), (3, 7))
    assert (ours("exaone4", dict(exaone, sliding_window=None)).window, ours("exaone4", dict(exaone, sliding_window=None)).nope_layers) == (None, None)
    # a rotary part whose fraction of the head rounds below it in int(head_dim x factor) (30 / 44 x 44 = 29.99...): written
    # half a channel over, so that transformers and fmoe read 30 back
    odd = TransformerConfig(vocab_size=V, hidden=32, n_layers=2, n_dense=2, ffn_dense=48, n_heads=2, n_kv_heads=2, head_dim=44, rope_dim=30,
                            qkv_bias=True, post_norms=True, rope_interleaved=True, mtp_depth=0)
    assert int(44 * (30 / 44)) == 29
    written = hf.hf_config(odd, "glm4")
    factor = written["rope_parameters"]["partial_rotary_factor"]
    assert int(44 * factor) == 30 and ours("glm4", written).rope_dim == 30 and not hf.config_mismatch(odd, written)
    for family, config, match in (
            ("olmo3", dict(older, rope_scaling=dict(older["rope_scaling"], attention_factor=1.5)),
             r"attention_factor = 1.5 is not supported \(YaRN's own attention factor, 1.20794"),
            ("olmo3", dict(older, rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=5e5),
                                                       sliding_attention=dict(rope_type="yarn", factor=2.0, rope_theta=5e5))),
             r"rope_parameters.sliding_attention = .* is not supported \(plain RoPE, or the full layers' RoPE\)"),
            ("olmo3", dict(older, rope_parameters=dict(rope_type="default", rope_theta=5e5)), r"rope_parameters = .* is not supported \(one per layer type"),
            ("olmo3", dict(older, attention_bias=True), r"attention_bias = True is not supported \(no attention biases in OLMo 3's"),
            ("smollm3", dict(smol, no_rope_layers=[1, 2, 1, 1, 1, 1, 1, 0]), r"no_rope_layers = \[1, 2, .* \(1 for a layer with RoPE, 0 without"),
            ("smollm3", dict(smol, no_rope_layer_interval=0), r"no_rope_layer_interval = 0 is not supported"),
            ("exaone4", dict(exaone, sliding_window_pattern="LXG"), r"sliding_window_pattern = 'LXG' is not supported without layer_types"),
            # LongRoPE needs both sets of factors, one per rotated pair
            ("phi3", dict(FAMILIES["phi3"]().to_dict(), rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 3)),
             r"rope_parameters of rope type 'longrope' lack long_factor"),
            ("phi3", dict(FAMILIES["phi3"]().to_dict(), rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)),
             r"rope type 'yarn' is not supported for phi3 \(plain RoPE or longrope\)")):
        with pytest.raises(ValueError, match=f"config.json: {match}"):
            ours(family, config)


def test_phi3_reads_the_released_longrope_layout_and_refuses_to_write_two_scales(tmp_path):
    """Phi-3.5-mini's and Phi-4-mini's config.json: rope_scaling of type "longrope" (older
    Phi-3 folders "su") with 3/4 of each head rotated, original_max_position_embeddings at the
    top level: cos and sin scaled by sqrt(1 + ln 32 / ln 4096), the factors as written; a
    model whose long scale differs has no phi3 config (its one attention_factor)."""
    released = dict(FAMILIES["phi3"]().to_dict(), max_position_embeddings=131072, original_max_position_embeddings=4096, rope_parameters=None,
                    rope_theta=10000.0, partial_rotary_factor=0.75,
                    rope_scaling=dict(type="longrope", short_factor=[1.0, 1.05, 1.1], long_factor=[1.0, 4.0, 16.0]))
    for kind in ("longrope", "su"):
        cfg = TransformerConfig(**hf.FAMILIES["phi3"].kwargs(dict(released, rope_scaling=dict(released["rope_scaling"], type=kind))))
        assert (cfg.rope_dim, cfg.longrope_short_factors, cfg.longrope_long_factors) == (6, (1.0, 1.05, 1.1), (1.0, 4.0, 16.0))
        assert cfg.longrope_original_max_positions == 4096
        assert cfg.longrope_short_scale == cfg.longrope_long_scale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    theirs = transformers.Phi3Config(**{k: v for k, v in released.items() if k not in ("rope_parameters", "transformers_version")})
    assert theirs.rope_parameters["short_factor"] == [1.0, 1.05, 1.1] and theirs.rope_parameters["original_max_position_embeddings"] == 4096
    two = dataclasses.replace(cfg, n_dense=cfg.n_layers, longrope_long_scale=1.5)
    with pytest.raises(ValueError, match=r"model: its config has no phi3 equivalent: .*longrope_long_scale"):
        hf.save_pretrained(hf.Transformer(two), tmp_path / "two", model_type="phi3")


@pytest.mark.parametrize("family, field, base", [("phi", "partial_rotary_factor", "rope_theta"), ("stablelm", "partial_rotary_factor", "rope_theta"),
                                                 ("persimmon", "partial_rotary_factor", "rope_theta"), ("gpt_neox", "rotary_pct", "rotary_emb_base")])
def test_a_rotary_fraction_at_the_top_level_reads_as_transformers_reads_it(family, field, base):
    """phi-2's, StableLM's, Persimmon-8B's and GPT-NeoX's (Pythia's) released config.json files
    give the rotary fraction and the RoPE base at the top level, without rope_parameters
    (save_pretrained moves them inside, so the folders of the other tests never had them
    there): fmoe reads the model transformers' own config of it reads (phi-2's top-level
    factor ignored gave rope_dim 4 for 2: logits 1.26 off; Persimmon-8B's rope_theta 25000 was
    read as 10000)."""
    released = dict(FAMILIES[family]().to_dict(), rope_parameters=None, rope_scaling=None, **{field: 0.25, base: 5000.0})
    cfg = TransformerConfig(**hf.FAMILIES[family].kwargs(released))
    theirs = type(FAMILIES[family]())(**{k: v for k, v in released.items() if k not in ("rope_parameters", "transformers_version")})
    assert TransformerConfig(**hf.FAMILIES[family].kwargs(theirs.to_dict())) == cfg
    assert (cfg.rope_dim, cfg.rope_base) == (cfg.head_dim // 4, 5000.0)


def test_phimoe_reads_the_released_layout():
    """Phi-3.5-MoE's config.json: rope_scaling of type "longrope" with the original positions
    and both mscales inside it, rope_theta at the top level, the gap router_jitter_noise, every
    bias on; transformers' own config of it agrees. Two experts per token only."""
    released = dict(FAMILIES["phimoe"]().to_dict(), rope_parameters=None, rope_theta=10000.0, max_position_embeddings=131072,
                    router_jitter_noise=0.01, rope_scaling=dict(type="longrope", short_factor=[1.0, 1.02, 1.05, 1.1], long_factor=[1.0, 2.0, 8.0, 30.0],
                                                                original_max_position_embeddings=4096, short_mscale=1.243, long_mscale=1.243))
    released.pop("original_max_position_embeddings", None)
    cfg = TransformerConfig(**hf.FAMILIES["phimoe"].kwargs(released))
    assert (cfg.score, cfg.k, cfg.sparsemixer_eps, cfg.expert_bias, cfg.rope_base) == ("sparsemixer", 2, 0.01, False, 10000.0)
    assert (cfg.layer_norms, cfg.norm_bias, cfg.qkv_bias, cfg.o_bias, cfg.head_bias) == (True,) * 5
    assert (cfg.longrope_short_factors, cfg.longrope_long_factors) == ((1.0, 1.02, 1.05, 1.1), (1.0, 2.0, 8.0, 30.0))
    assert (cfg.longrope_original_max_positions, cfg.longrope_short_scale, cfg.longrope_long_scale) == (4096, 1.243, 1.243)
    theirs = transformers.PhimoeConfig(**{k: v for k, v in released.items() if k not in ("rope_parameters", "transformers_version")})
    assert TransformerConfig(**hf.FAMILIES["phimoe"].kwargs(theirs.to_dict())) == cfg
    with pytest.raises(ValueError, match=r"config.json: num_experts_per_tok = 4 is not supported \(2: SparseMixer chooses two experts\)"):
        hf.FAMILIES["phimoe"].kwargs(dict(released, num_experts_per_tok=4))
    with pytest.raises(ValueError, match=r"rope_parameters of rope type 'longrope' lack long_mscale"):
        hf.FAMILIES["phimoe"].kwargs(dict(released, rope_scaling={k: v for k, v in released["rope_scaling"].items() if k != "long_mscale"}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_field_left_out_reads_as_transformers_fills_it(family):
    """A config.json that leaves out a field means the model transformers builds from it (the
    class default, or what its RoPE standardisation fills in): each field in turn, at the top
    level and in rope_parameters, is left out of the test's config; fmoe maps that config as it
    maps the config transformers completes from it, or refuses it by name (a ValueError)."""
    made = FAMILIES[family]()
    cls, model_type = type(made), made.model_type

    def ours(config: dict):
        try:
            return TransformerConfig(**hf.FAMILIES[model_type].kwargs(config))
        except ValueError as err:
            return f"refused: {err}"

    checked = 0
    for field, config in _left_out(made.to_dict()):
        if (family, field) == ("dbrx", "rope_parameters"):  # fmoe reads attn_config.rope_theta there (test_a_released_dbrx_folder_...)
            continue
        try:
            theirs = cls(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()
        except Exception:  # transformers refuses it too
            continue
        mine = ours(config)
        if isinstance(mine, str):
            continue
        assert mine == ours(theirs), f"{family} without {field}"
        checked += 1
    assert checked >= 10


def test_sparse_attention_added_to_a_deepseek_v3_model_starts_with_fresh_indexers(folders, tmp_path):
    """DeepSeek-V3.2's start: a DeepSeek-V3 folder read with DeepSeek sparse attention's knobs
    keeps the indexers it has none of as initialised; with index_topk over every key it is
    the folder's own model (DeepSeek's dense warm-up), and it writes back as a deepseek_v32
    folder that transformers reads, not under the DeepSeek-V3 config it no longer fits."""
    path, _ = folders["deepseek_v3"]
    docs, ids, cu = _packed()
    plain, _ = hf.from_pretrained(path, impl="torch")
    dense, cfg = hf.from_pretrained(path, impl="torch", index_topk=64, index_heads=4, index_head_dim=8)
    assert cfg.index_topk == 64 and float(dense.blocks[0].attn.index_wq.detach().abs().max()) > 0  # initialised, not zero
    with torch.no_grad():
        torch.testing.assert_close(dense.logits(ids, cu), plain.logits(ids, cu), rtol=0, atol=0)
        sparse, _ = hf.from_pretrained(path, impl="torch", index_topk=3, index_heads=8, index_head_dim=8)
        assert _rel(sparse.logits(ids, cu), plain.logits(ids, cu)) > 1e-2
    with pytest.raises(ValueError, match=r"model: differs from the config.json it was loaded with \(\{'index_topk': \(3, None\)"):
        hf.save_pretrained(sparse, tmp_path / "v3")
    with torch.no_grad():  # indexers as trained ones would be: scores far apart (the fresh ones' are near 0, often equal)
        for name, p in sparse.named_parameters():
            if ".index_" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm") else 0.3 * torch.randn_like(p))
    hf.save_pretrained(sparse, tmp_path / "v32", model_type="deepseek_v32")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v32", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.cat([back(d[None]).logits[0] for d in docs])
        assert _rel(sparse.logits(ids, cu), theirs) < 1e-5


@pytest.mark.parametrize("fields", [dict(index_topk_freq=2, index_skip_topk_offset=1), dict(index_topk_freq=3), dict(index_topk_pattern="FSFF"),
                                    dict(index_topk_pattern=["full", "shared", "shared", "full"]), {}])
def test_glm5_shared_indexer_layers_read_as_transformers_derives_them(fields):
    """GLM-5's layers without an indexer: the indexer_types transformers derives from
    index_topk_freq / index_skip_topk_offset or index_topk_pattern (without indexer_types)
    are fmoe's index_shared_layers; a first layer without an indexer is refused."""
    config = FAMILIES["glm_moe_dsa"]().to_dict()
    config.update(num_hidden_layers=4, mlp_layer_types=["dense"] + ["sparse"] * 3)
    del config["indexer_types"], config["layer_types"]
    theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "model_type"}, **fields).indexer_types
    cfg = TransformerConfig(**hf.FAMILIES["glm_moe_dsa"].kwargs(dict(config, **fields)))
    assert [cfg.is_index_shared(i) for i in range(4)] == [kind == "shared" for kind in theirs]
    assert cfg.index_shared_layers == (tuple(i for i, kind in enumerate(theirs) if kind == "shared") or None)
    with pytest.raises(ValueError, match=r"indexer_types = \['shared', 'full', 'full', 'full'\] is not supported \(full / shared per layer, the first full\)"):
        hf.FAMILIES["glm_moe_dsa"].kwargs(dict(config, indexer_types=["shared", "full", "full", "full"]))


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_the_indexer_loss_weight_is_a_training_knob_the_export_ignores(family, tmp_path):
    """index_loss_coeff weighs the indexers' loss in training, as init_std and the capacity
    are knobs of how a model trains (the loop applies them on top of a folder): a model loaded
    with another writes its folder back bit-identical, and a config of its own as well."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch", index_loss_coeff=0.1)
    assert hf.config_mismatch(cfg, model.hf_config) == {}
    hf.save_pretrained(model, tmp_path / "again")
    assert all(filecmp.cmp(tmp_path / "hf" / f, tmp_path / "again" / f, shallow=False) for f in ("config.json", "model.safetensors"))
    assert hf.hf_config(cfg, family) == hf.hf_config(dataclasses.replace(cfg, index_loss_coeff=1.0), family)


def test_a_released_llama4_folder_loads_its_text_model(folders, tmp_path):
    """A llama4 folder (Llama4ForConditionalGeneration, as released): the text model under
    language_model. loads with transformers' logits (a text-only forward), the vision
    model's keys neither read nor counted as unread; it is not written back without them,
    and writes as llama4_text, which transformers loads with the same logits."""
    text = FAMILIES["llama4_text"]().to_dict()
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vision_output_dim=16, image_size=28,
                  patch_size=14, projector_input_dim=16, projector_output_dim=16)
    torch.manual_seed(0)
    ref = _randomised(transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision)))
    ref.save_pretrained(tmp_path / "llama4")
    model, cfg = hf.from_pretrained(tmp_path / "llama4", impl="torch")
    assert dataclasses.replace(cfg, impl="auto") == hf.read_config(folders["llama4_text"][0])[1]
    keys = hf.key_map(hf.FAMILIES["llama4"], cfg)
    assert all(k.startswith("language_model.") for spec in keys.values() for k in spec.keys)
    docs, ids, cu = _packed()
    with torch.no_grad():
        # Its language model: a text-only forward of the whole class runs just that, but transformers
        # 5.24's Llama4ForConditionalGeneration.forward reads a field its language model does not return.
        theirs = torch.cat([ref.language_model(input_ids=d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    with pytest.raises(ValueError, match="model_type: a llama4 folder holds a model fmoe does not read .vision_model., multi_modal_projector.., "
                                         "so it is not written; pass model_type='llama4_text'"):
        hf.save_pretrained(model, tmp_path / "again")
    assert not (tmp_path / "again").exists() or not any((tmp_path / "again").iterdir())
    hf.save_pretrained(model, tmp_path / "text", model_type="llama4_text")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(back).__name__ == "Llama4ForCausalLM"
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    with pytest.raises(ValueError, match="config.json: a llama4 config without a text_config is not supported"):
        hf.from_pretrained(_edit(tmp_path / "llama4", tmp_path / "bad", lambda c: c.pop("text_config")))


def _stacked_experts(src, dst):
    """A copy of the folder src whose experts are stacks, as the released Qwen3.5-MoE folders
    store them: per MoE block experts.gate_up_proj [E, 2F, H] (each expert's gate rows, then
    its up rows) and experts.down_proj [E, H, F], in place of the per-expert modules."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    blocks = sorted({m[1] for key in tensors if (m := re.match(r"(.*\.mlp)\.experts\.\d+\.", key))})
    for block in blocks:
        n = len({key for key in tensors if key.startswith(block + ".experts.") and key.endswith("down_proj.weight")})
        take = lambda e, name: tensors.pop(f"{block}.experts.{e}.{name}.weight")  # noqa: E731
        tensors[block + ".experts.gate_up_proj"] = torch.stack([torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in range(n)])
        tensors[block + ".experts.down_proj"] = torch.stack([take(e, "down_proj") for e in range(n)])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_released_qwen3_5_moe_folder_loads_its_text_model(tmp_path):
    """A qwen3_5_moe folder (Qwen3_5MoeForConditionalGeneration): the text model under
    model.language_model. (the head at lm_head) loads with transformers' logits of a
    text-only forward, the vision model's keys neither read nor counted as unread, its
    experts as transformers writes them (a module per expert) or as the released folders
    store them (stacks, which transformers reads too); it is not written back without the
    vision model, and writes as qwen3_5_moe_text (its experts as the folder had them), which
    transformers loads with the same logits."""
    text = FAMILIES["qwen3_5_moe_text"]().to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, num_position_embeddings=16)
    torch.manual_seed(0)
    ref = _randomised(transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                                                                                    tie_word_embeddings=True)))
    ref.save_pretrained(tmp_path / "modules")
    stacks = _stacked_experts(tmp_path / "modules", tmp_path / "stacks")
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        again = transformers.AutoModelForImageTextToText.from_pretrained(stacks, dtype=torch.float32).eval()
        assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6  # transformers reads the stacks
    for folder in (tmp_path / "modules", stacks):
        model, cfg = hf.from_pretrained(folder, impl="torch")
        assert cfg.linear_layers == (0, 1) and cfg.tie_embeddings and cfg.zero_centered_norms and cfg.moe_layers == (0, 1, 2)
        keys = [k for spec in hf.key_map(hf.FAMILIES["qwen3_5_moe"], cfg).values() for k in spec.keys]
        assert all(k.startswith("model.language_model.") for k in keys)
        with torch.no_grad():
            assert _rel(model.logits(ids, cu), theirs) < TOL["qwen3_5_moe"]
        with pytest.raises(ValueError, match="model_type: a qwen3_5_moe folder holds a model fmoe does not read .model.visual..,"
                                             " so it is not written; pass model_type='qwen3_5_moe_text'"):
            hf.save_pretrained(model, tmp_path / "again")
        model.hf_config = hf.written_config(model.hf_config)  # its own text config: the experts stay as the folder stored them
        out = hf.save_pretrained(model, tmp_path / f"text-{folder.name}")
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            assert any(k.endswith("experts.gate_up_proj") for k in f.keys()) == (folder == stacks)
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
        with torch.no_grad():
            assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < TOL["qwen3_5_moe"]
        back_ours, _ = hf.from_pretrained(out, impl="torch")  # and fmoe reads its own export back, exactly
        assert all(torch.equal(a, b) for a, b in zip(back_ours.state_dict().values(), model.state_dict().values()))
    # the released folders' MTP module, at the top level (mtp.), is read as depth 1 with its own norm, as the text model's
    with_mtp, _ = hf.from_pretrained(tmp_path / "modules", impl="torch", mtp_depth=1, mtp_norm=True)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in with_mtp.named_parameters():
            if name.startswith("mtp."):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    with_mtp.hf_config = hf.written_config(with_mtp.hf_config)
    mtp = {k: v for k, v in _read_all(hf.save_pretrained(with_mtp, tmp_path / "text-mtp")).items() if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.mlp.gate.weight"} <= set(mtp)
    released = _copy_folder(tmp_path / "modules", tmp_path / "released-mtp", {**_read_all(tmp_path / "modules"), **mtp})
    read, cfg = hf.from_pretrained(released, impl="torch")
    assert (cfg.mtp_depth, cfg.mtp_norm) == (1, True)
    mine = dict(with_mtp.named_parameters())
    assert all(torch.equal(p, mine[name]) for name, p in read.named_parameters()) and any(n.startswith("mtp.") for n in mine)


def test_a_released_dense_qwen3_5_folder_loads_its_text_model(tmp_path):
    """A dense qwen3_5 folder (Qwen3_5ForConditionalGeneration; Qwen3.5-27B's): the text model
    under model.language_model. loads with transformers' logits of a text-only forward, the
    vision model's keys neither read nor counted as unread; written back as qwen3_5_text,
    which transformers loads with the same logits."""
    text = FAMILIES["qwen3_5_text"]().to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, num_position_embeddings=16)
    torch.manual_seed(0)
    ref = _randomised(transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text, vision_config=vision)))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.linear_layers == (0, 1) and cfg.moe_layers == () and cfg.attn_gate and cfg.zero_centered_norms
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < TOL["qwen3_5"]
    model.hf_config = hf.written_config(model.hf_config)
    back = transformers.AutoModelForCausalLM.from_pretrained(hf.save_pretrained(model, tmp_path / "text"), dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < TOL["qwen3_5"]


def test_olmo_hybrid_reads_its_released_files(tmp_path):
    """OLMo Hybrid's files hold a convolution per q, k and v (q_conv1d, k_conv1d, v_conv1d) of
    their own channels, here 16, 16 and 24 (transformers joins them into one conv1d on load;
    its save_pretrained cuts that into three equal parts, so the folder is written here as
    the released ones are): fmoe reads them with transformers' logits, writes them back
    bit for bit, and a fresh export of the model loads in transformers with those logits."""
    from safetensors.torch import load_file, save_file

    config = dict(FAMILIES["olmo_hybrid"]().to_dict(), linear_key_head_dim=8)
    torch.manual_seed(0)
    ref = _randomised(transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**{k: v for k, v in config.items() if k != "model_type"})))
    ref.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    for i in (0, 1):
        la = f"model.layers.{i}.linear_attn."
        whole = ref.model.layers[i].linear_attn.conv1d.weight.detach()
        assert whole.shape[0] == 56 and files[la + "q_conv1d.weight"].shape[0] != 16  # transformers' equal thirds
        for name, part in zip("qkv", whole.split([16, 16, 24])):
            files[f"{la}{name}_conv1d.weight"] = part.contiguous()
    save_file(files, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.linear_layers == (0, 1) and cfg.linear_pre_norms and cfg.post_norms and not cfg.pre_norms and cfg.linear_neg_eigval
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    hf.save_pretrained(model, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == files.keys() and all(torch.equal(back[k], files[k]) for k in files)
    model.hf_config = None  # written from its TransformerConfig
    fresh = transformers.AutoModelForCausalLM.from_pretrained(hf.save_pretrained(model, tmp_path / "own", model_type="olmo_hybrid"),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([fresh(d[None]).logits[0] for d in docs]), theirs) < 1e-5


_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)
# a released vision-language (or speech) folder's model_type -> its text model's family (the tests' config of it), and
# transformers' classes of the whole model and its config with the tiny encoder and projector configs beside the text config
# a tiny Whisper-like audio encoder (AudioFlamingo 3's, Qwen2-Audio's), and Granite Speech's encoder and Q-Former projector
# a tiny SAM-style vision encoder (GOT-OCR 2.0's, DeepSeek-VL-Hybrid's high-resolution one)
_SAM = dict(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=2, mlp_dim=16, image_size=32, patch_size=8,
            global_attn_indexes=[0], window_size=2)
_WHISPER_LIKE = dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, num_mel_bins=8)
_GRANITE_SPEECH = dict(encoder_config=dict(hidden_dim=16, num_layers=1, num_heads=2, dim_head=8, output_dim=8, input_dim=16),
                       projector_config=dict(hidden_size=16, num_attention_heads=2, intermediate_size=16, encoder_hidden_size=16, num_hidden_layers=1))
_VL = {
    "lfm2_vl": ("lfm2", ("Lfm2VlForConditionalGeneration", "Lfm2VlConfig"),
                dict(vision_config=dict(_SIGLIP, model_type="siglip2_vision_model"), projector_hidden_size=16)),
    "lfm3_vl": ("lfm3", ("Lfm3VlForConditionalGeneration", "Lfm3VlConfig"),
                dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2), projector_hidden_size=16)),
    "exaone4_5": ("exaone4", ("Exaone4_5_ForConditionalGeneration", "Exaone4_5_Config"),
                  dict(vision_config=dict(hidden_size=16, intermediate_size=16, depth=1, num_heads=2, out_hidden_size=32))),
    # a CLIP vision tower, a projector per vision layer read (deepstack) and the spatial ones; the text model's own model_type
    "granite4_vision": ("granite", ("Granite4VisionForConditionalGeneration", "Granite4VisionConfig"), dict(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=14),
        deepstack_layer_map=[[1, 0]], spatial_target_layers=[0, 1, 2, 2], downsample_rate="1/2", qformer_config=dict(intermediate_size=16))),
    "cohere2_vision": ("cohere2", ("Cohere2VisionForConditionalGeneration", "Cohere2VisionConfig"), dict(vision_config=_SIGLIP)),
    # the older layout: everything under language_model.
    "aya_vision": ("cohere2", ("AyaVisionForConditionalGeneration", "AyaVisionConfig"), dict(vision_config=_SIGLIP)),
    "hyperclovax_vision_v2": ("hyperclovax", ("HyperCLOVAXVisionV2ForConditionalGeneration", "HyperCLOVAXVisionV2Config"),
                              dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32))),
    # an audio encoder and a Q-Former projector, under encoder. and projector.
    "granite_speech": ("granite", ("GraniteSpeechForConditionalGeneration", "GraniteSpeechConfig"), _GRANITE_SPEECH),
    "minicpmv4_6": ("qwen3_5_text", ("MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_6Config"), {}),
    "minicpmv4_7": ("qwen3_5_text", ("MiniCPMV4_7ForConditionalGeneration", "MiniCPMV4_7Config"), {}),
    # DeepSeek-VL: a SigLIP tower and its aligner; AudioFlamingo 3, GLM-ASR: an audio tower and its projector; Fun-ASR-Nano: an
    # audio encoder and its adaptor (projector)
    "deepseek_vl": ("llama", ("DeepseekVLForConditionalGeneration", "DeepseekVLConfig"), dict(vision_config=_SIGLIP)),
    "audioflamingo3": ("qwen2", ("AudioFlamingo3ForConditionalGeneration", "AudioFlamingo3Config"), dict(audio_config=_WHISPER_LIKE)),
    "fun_asr_nano": ("qwen3", ("FunAsrNanoForConditionalGeneration", "FunAsrNanoConfig"), dict(
        audio_config=dict(hidden_size=16, num_attention_heads=2, intermediate_size=16, num_hidden_layers=2, num_mel_bins=8, num_timestamp_prediction_layers=1),
        adaptor_config=dict(hidden_size=32, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1, projector_hidden_size=16))),
    "glmasr": ("llama", ("GlmAsrForConditionalGeneration", "GlmAsrConfig"),
               dict(audio_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=8))),
    "qwen2_audio": ("qwen2", ("Qwen2AudioForConditionalGeneration", "Qwen2AudioConfig"), dict(audio_config=_WHISPER_LIKE)),
    "musicflamingo": ("qwen2", ("MusicFlamingoForConditionalGeneration", "MusicFlamingoConfig"),
                      dict(audio_config=dict(_WHISPER_LIKE, model_type="audioflamingo3_encoder"))),
    "granite_speech_plus": ("granite", ("GraniteSpeechPlusForConditionalGeneration", "GraniteSpeechPlusConfig"), _GRANITE_SPEECH),
    "qwen3_asr": ("qwen3", ("Qwen3ASRForConditionalGeneration", "Qwen3ASRConfig"),
                  dict(audio_config=dict(_WHISPER_LIKE, output_dim=32, downsample_hidden_size=8))),
    "moss_transcribe_diarize": ("qwen3", ("MossTranscribeDiarizeForConditionalGeneration", "MossTranscribeDiarizeConfig"),
                                dict(audio_config=dict(num_mel_bins=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, hidden_size=16))),
    "lighton_ocr": ("qwen3", ("LightOnOcrForConditionalGeneration", "LightOnOcrConfig"),
                    dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                                            head_dim=8))),
    # GOT-OCR 2.0 and DeepSeek-VL-Hybrid's high-resolution tower: SAM-style encoders; Janus: the image generation's VQ model
    # (GroupNorms of 32 groups) beside the understanding tower; Idefics2: a perceiver resampler of the text model's width
    "got_ocr2": ("qwen2", ("GotOcr2ForConditionalGeneration", "GotOcr2Config"), dict(vision_config=_SAM)),
    "ovis2": ("qwen2", ("Ovis2ForConditionalGeneration", "Ovis2Config"), dict(vision_config=dict(_SIGLIP, model_type="ovis2_vision_model", vocab_size=32))),
    "video_llama_3": ("qwen2", ("VideoLlama3ForConditionalGeneration", "VideoLlama3Config"),
                      dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))),
    "qianfan_ocr": ("qwen3", ("QianfanOCRForConditionalGeneration", "QianfanOCRConfig"),
                    dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=[28, 28],
                                            patch_size=[14, 14]))),
    "janus": ("llama", ("JanusForConditionalGeneration", "JanusConfig"), dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        vq_config=dict(embed_dim=4, num_embeddings=8, base_channels=32, channel_multiplier=[1], num_res_blocks=1, latent_channels=4, projection_dim=32,
                       image_token_embed_dim=32, num_patches=4))),
    "deepseek_vl_hybrid": ("llama", ("DeepseekVLHybridForConditionalGeneration", "DeepseekVLHybridConfig"),
                           dict(vision_config=_SIGLIP, high_res_vision_config=_SAM)),
    "idefics2": ("mistral", ("Idefics2ForConditionalGeneration", "Idefics2Config"), dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        perceiver_config=dict(hidden_size=32, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2, resampler_head_dim=8, num_key_value_heads=1))),
    # Granite Docling: a vision model with its connectors' deepstack mergers (vision layers 0 and 1); its own text model_type
    "granite_docling": ("granite", ("GraniteDoclingForConditionalGeneration", "GraniteDoclingConfig"), dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                           out_hidden_size=32, scale_factor=2, deepstack_visual_indexes=[0, 1]))),
    # BLIP-2 (OPT's causal LM), InstructBLIP and InstructBLIP-Video (Llama's) beside a vision model, a Q-Former and its query tokens
    **{kind: (text, (f"{name}ForConditionalGeneration", f"{name}Config"), dict(
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        qformer_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, encoder_hidden_size=16), num_query_tokens=2))
       for kind, text, name in (("blip-2", "opt", "Blip2"), ("instructblip", "llama", "InstructBlip"), ("instructblipvideo", "llama", "InstructBlipVideo"))},
    # Fuyu: Persimmon's causal LM under language_model. beside the image patches' linear embedding
    "fuyu": ("persimmon", ("FuyuForCausalLM", "FuyuConfig"), dict(hidden_size=32, num_attention_heads=4, patch_size=4)),
    # Emu3: Llama's causal LM under text_model. beside a VQ image tokenizer (its vocabulary map: image tokens of the text vocabulary)
    "emu3": ("llama", ("Emu3ForConditionalGeneration", "Emu3Config"), dict(
        vq_config=dict(embed_dim=4, codebook_size=8, latent_channels=4, base_channels=32, channel_multiplier=[1], num_res_blocks=1, attn_resolutions=[],
                       temporal_downsample_factor=1),
        vocabulary_map={"<image>": 60, "<|extra_200|>": 61, **{f"<|visual token {i:06d}|>": 50 + i for i in range(8)}})),
    # Nemotron 3 Nano Omni: Nemotron-H's causal LM under language_model. beside a RADIO vision model, a Parakeet audio encoder
    # and their projectors; the text model ties its own head
    "nemotron_h_omni": ("nemotron_h", ("NemotronH_Omni_Reasoning_V3", "NemotronH_Omni_Reasoning_V3_Config"), dict(
        vision_config=dict(model_type="radio", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16,
                           max_img_size=32, num_cls_tokens=1, num_registers=1, patch_dim=16, video_temporal_patch_size=2),
        audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, subsampling_conv_channels=4,
                          num_mel_bins=8, projection_hidden_size=16, projection_bias=False),
        projector_hidden_size=16, vision_hidden_size=16)),
}


@pytest.mark.parametrize("kind", list(_VL))
def test_a_released_vision_language_folder_loads_its_text_model(kind, tmp_path):
    """Released vision-language (and speech) folders whose text model is a family's
    (fmoe.hf._VL_TEXT: LFM2-VL, LFM3-VL, EXAONE 4.5, Granite 4.0 Vision, Command A Vision, Aya
    Vision, HyperCLOVA X SEED Vision, Granite Speech (Plus), MiniCPM-V 4.6 / 4.7, DeepSeek-VL, AudioFlamingo 3,
    Music Flamingo, Qwen2-Audio, Qwen3-ASR, MOSS Transcribe-Diarize, LightOnOCR, Fun-ASR-Nano, GLM-ASR,
    GOT-OCR 2.0, Ovis2, VideoLLaMA 3, Qianfan-OCR, Janus, DeepSeek-VL-Hybrid, Idefics2, Granite Docling, BLIP-2, InstructBLIP
    (-Video), Emu3, Fuyu, Nemotron 3 Nano Omni):
    the text model, under model.language_model. (Idefics2's and Granite Docling's model.text_model.) or (the older layout) all of it under language_model., loads with
    transformers' logits of a text-only forward, the encoders' and projectors' keys neither
    read nor counted as unread, its head tied as the top level says (or its class by default);
    written back as the text model's family (_text_model_round_trip); a text_config of
    another model is refused by name."""
    text_kind, names, extra = _VL[kind]
    text = dict(FAMILIES[text_kind]().to_dict(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind in ("granite4_vision", "granite_docling", "emu3"):  # the text model's own model_type
        text["model_type"] = "emu3_text_model" if kind == "emu3" else f"{kind}_text"
    omni = kind == "nemotron_h_omni"  # its released folders name the text config llm_config
    own_tie = hf.FAMILIES[kind].defaults.get("tie_word_embeddings") is None  # the text model ties its own head (the top level has no such field)
    cls, config = (getattr(transformers, name) for name in names)
    config = config(text_config=text, **extra)
    theirs = _saved_multimodal(cls, config, tmp_path / "hf")
    prefix = hf.FAMILIES[kind].outer or hf.FAMILIES[kind].prefix[1]  # model.language_model. (Idefics2's model.text_model.)
    _, cfg, _ = _text_model_round_trip(tmp_path / "hf", theirs, tmp_path / "text", kind=kind, prefix=prefix,
                                       head=prefix + "lm_head.weight" if hf.FAMILIES[kind].outer else "lm_head.weight", text_kind=text_kind)
    tied = config.text_config.tie_word_embeddings if own_tie else config.tie_word_embeddings
    # Command A Vision's, Aya Vision's and Granite Speech (Plus)'s classes leave the text model's logit scale (here 1/4) unapplied
    unscaled = dict(logit_divisor=1.0) if kind in ("cohere2_vision", "aya_vision", "granite_speech", "granite_speech_plus") else {}
    assert cfg == TransformerConfig(**dict(hf.FAMILIES[text_kind].kwargs(dict(text, model_type=text_kind, tie_word_embeddings=tied)), impl="torch",
                                           **unscaled))
    outer = {k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items() if k != "tie_word_embeddings"}
    if not own_tie:  # the class default
        tied = type(config)(**{k: v for k, v in outer.items() if k != "model_type"}).tie_word_embeddings
    assert TransformerConfig(**hf.FAMILIES[kind].kwargs(outer)).tie_embeddings == tied
    if omni:  # the released folders' name of the text config
        legacy = {("llm_config" if k == "text_config" else k): v for k, v in outer.items()}
        assert TransformerConfig(**hf.FAMILIES[kind].kwargs(legacy)) == TransformerConfig(**hf.FAMILIES[kind].kwargs(outer))
    other = "qwen2" if text_kind == "llama" else "llama"  # a text model of another family
    with pytest.raises(ValueError, match=f"config.json: a {kind} folder whose text model is '{other}' is not supported"):
        hf.FAMILIES[kind].kwargs(dict(model_type=kind, text_config=dict(text, model_type=other)))


def test_qianfan_ocr_reads_its_released_layout_and_transformers_one(tmp_path):
    """Qianfan-OCR's released folders hold the text layers under language_model.model.layers.;
    transformers writes them under language_model.model.encoder.layers. (its renaming of the
    vision encoder's layers undone on every key) and reads both: so does fmoe, with the same
    logits, the layout taken from the keys the files hold."""
    text_kind, names, extra = _VL["qianfan_ocr"]
    text = dict(FAMILIES[text_kind]().to_dict(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cls, config = (getattr(transformers, name) for name in names)
    theirs = _saved_multimodal(cls, config(text_config=text, **extra), tmp_path / "written")
    written = _read_all(tmp_path / "written")
    assert any(k.startswith("language_model.model.encoder.layers.") for k in written)
    released = _copy_folder(tmp_path / "written", tmp_path / "released",
                            {k.replace("language_model.model.encoder.layers.", "language_model.model.layers."): v for k, v in written.items()})
    docs, ids, cu = _packed()
    with torch.no_grad():
        again = cls.from_pretrained(released, dtype=torch.float32).eval()
        assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6
        for folder in (tmp_path / "written", released):
            model, _ = hf.from_pretrained(folder, impl="torch")
            assert _rel(model.logits(ids, cu), theirs) < 1e-5, folder.name


def _qwen3_vl(kind, ffn_expert=8):
    """A tiny Qwen3-VL(-MoE) model (randomised) whose RoPE has the released folders' mrope_section."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[2, 1, 1], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    if kind == "qwen3_vl":
        return _randomised(transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(text_config=text, vision_config=vision)))
    text.update(moe_intermediate_size=ffn_expert, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    return _randomised(transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)))


def _older_cosmos3_names(tensors):
    """A Cosmos3 folder's tensors with its text layers' attention under the older names (q_proj, k_proj, v_proj, o_proj,
    q_norm, k_norm) in place of the Diffusers-style ones transformers writes (to_q, ..., norm_k)."""
    names = dict(to_q="q_proj", to_k="k_proj", to_v="v_proj", to_out="o_proj", norm_q="q_norm", norm_k="k_norm")
    return {re.sub(r"^(layers\.\d+\.self_attn)\.(\w+)\.", lambda m: f"{m[1]}.{names.get(m[2], m[2])}.", k): v for k, v in tensors.items()}


def test_a_released_cosmos3_omni_folder_loads_its_text_model(tmp_path):
    """A cosmos3_omni folder (Cosmos3-Nano's reasoner): Qwen3-VL's model under its own
    model_type, its text model's keys at the top level beside the vision model's, Qwen3's
    text model read, its attention under the Diffusers-style names transformers writes (to_q,
    ..., norm_k) or the older ones (q_proj, ..., k_norm), which transformers reads too; a
    unified Cosmos3 checkpoint's generator, sound and action towers and cross-modal
    projections (some in the text layers), which transformers drops, are neither read nor
    counted as unread; written back as qwen3 with the same logits."""
    from safetensors.torch import load_file

    ref = _qwen3_vl("qwen3_vl")
    config = transformers.Cosmos3OmniConfig(**{k: v for k, v in ref.config.to_dict().items() if k != "model_type"})
    theirs = _saved_multimodal(transformers.Cosmos3OmniForConditionalGeneration, config, tmp_path / "written")
    tensors = load_file(tmp_path / "written" / "model.safetensors")
    extra = {"model.language_model.layers.0.self_attn.add_q_proj.weight": torch.randn(32, 32), "proj_in.weight": torch.randn(4, 32),
             "model.language_model.layers.1.moe_gen.experts.0.weight": torch.randn(8, 32), "audio_modality_embed": torch.randn(32),
             "time_embedder.linear_1.weight": torch.randn(8, 8), "model.language_model.layers.2.self_attn.norm_added_k.weight": torch.randn(8)}
    assert "layers.0.self_attn.to_q.weight" in tensors and "layers.0.self_attn.norm_k.weight" in tensors
    unified = _copy_folder(tmp_path / "written", tmp_path / "unified", {**tensors, **extra})
    older = _copy_folder(tmp_path / "written", tmp_path / "older", _older_cosmos3_names(tensors))
    assert "layers.0.self_attn.q_proj.weight" in _read_all(older)
    docs = _packed()[0]
    with torch.no_grad():
        for folder in (unified, older):  # transformers drops the unified checkpoint's other towers, and reads the older names
            again = transformers.Cosmos3OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
            assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6, folder.name
    for folder in (tmp_path / "written", unified, older):
        _, cfg, written = _text_model_round_trip(folder, theirs, tmp_path / f"text-{folder.name}", kind="cosmos3_omni",
                                                 prefix="", head="lm_head.weight", text_kind="qwen3")
        assert not cfg.tie_embeddings and cfg.rope_base == 5e5 and "mrope_section" not in written["rope_parameters"]


def test_a_released_cosmos3_edge_folder_loads_its_text_model(tmp_path):
    """A cosmos3_edge folder (Cosmos3-Edge): Llama's attention with MLPs without a gate,
    relu(x fc1)^2 fc2, RoPE plain over text (Arcee's model), stored at the top level with the
    Diffusers-style attention names transformers writes (or the older ones, which it reads
    too) and the MLP's up_proj / down_proj, beside the vision model and its projector; a
    unified checkpoint's generator keys unread; written back as arcee with the same logits."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1]))
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
    theirs = _saved_multimodal(transformers.Cosmos3EdgeForConditionalGeneration, transformers.Cosmos3EdgeConfig(text_config=text, vision_config=vision),
                               tmp_path / "written")
    tensors = _read_all(tmp_path / "written")
    assert "layers.0.self_attn.to_q.weight" in tensors and "layers.0.mlp.up_proj.weight" in tensors
    older = _older_cosmos3_names(tensors)
    older.update({"time_embedder.linear_1.weight": torch.randn(8, 8), "layers.1.mlp_moe_gen.fc1.weight": torch.randn(8, 32),
                  "layers.0.self_attn.add_k_proj.weight": torch.randn(16, 32)})
    older = _copy_folder(tmp_path / "written", tmp_path / "older", older)
    docs = _packed()[0]
    with torch.no_grad():  # transformers reads the older names and drops the generator's keys
        again = transformers.Cosmos3EdgeForConditionalGeneration.from_pretrained(older, dtype=torch.float32).eval()
        assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6
    for folder in (tmp_path / "written", older):
        _, cfg, written = _text_model_round_trip(folder, theirs, tmp_path / f"text-{folder.name}", kind="cosmos3_edge", prefix="",
                                                 head="lm_head.weight", text_kind="arcee")
        assert (cfg.mlp_act, cfg.tie_embeddings, cfg.rope_base) == ("relu2", False, 1e4) and "mrope_section" not in written["rope_parameters"]


def _released_stacks(src, dst):
    """A copy of the folder src (written by transformers: [E, 2F, H] gate_up_proj, [E, H, F]
    down_proj) with the experts' stacks as the released Qwen3-VL-MoE folders store them,
    [E, H, 2F] and [E, F, H]."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def _saved_multimodal(cls, config, folder, ids=None):
    """A randomised multimodal model of transformers' class `cls` (its routers' correction biases
    drawn too) saved to `folder`; its logits of a text-only forward over _packed's documents
    (ids [T]: those tokens instead; BLIP-2's and InstructBLIP's, whose forward needs an image:
    their language model's)."""
    torch.manual_seed(0)
    ref = _randomised(cls(config))
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
        ref.save_pretrained(folder)
        text_only = ref.language_model if "Blip" in cls.__name__ else ref
        return torch.cat([text_only(input_ids=d[None]).logits[0] for d in (_packed()[0] if ids is None else [ids])])


def _text_model_round_trip(folder, theirs, out, *, kind, prefix, head, text_kind):
    """fmoe reads a multimodal `folder` of `kind`: every key it reads under `prefix` (or the
    `head`), the logits of transformers' text-only forward (`theirs`, over _packed's
    documents); the folder is not written back without its other models; written with its
    text config as `text_kind` (written_config) to `out`, transformers loads the same logits
    and fmoe reads back the same weights. -> (the model as loaded, its config, the written config)."""
    docs, ids, cu = _packed()
    model, cfg = hf.from_pretrained(folder, impl="torch")
    keys = [k for spec in hf.key_map(hf.FAMILIES[kind], cfg).values() for k in spec.keys]
    assert all(k.startswith(prefix) for k in keys if k != head) and (head in keys) == (not cfg.tie_embeddings)
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    not_read = ", ".join(re.escape(p) for p in hf.FAMILIES[kind].not_read)
    # the family to pass: the one fmoe writes it as, or (Molmo2's) one of those its text config may make it
    what = rf"its text model's model_type \(one of .*{text_kind}" if hf.FAMILIES[kind].written_as == "text_config" else rf"model_type='{text_kind}'"
    with pytest.raises(ValueError, match=rf"model_type: a {kind} folder holds a model fmoe does not read \({not_read}\), so it is not written; "
                                         rf"pass {what}"):
        hf.save_pretrained(model, out.parent / "whole")
    written = model.hf_config = hf.written_config(model.hf_config)  # its own text config, as the text model's family
    assert written["model_type"] == text_kind
    hf.save_pretrained(model, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == hf.FAMILIES[text_kind].architecture
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    back_ours, _ = hf.from_pretrained(out, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(back_ours.state_dict().values(), model.state_dict().values()))
    return model, cfg, written


@pytest.mark.parametrize("kind", ["qwen3_vl_moe", "qwen3_vl"])
def test_a_released_qwen3_vl_folder_loads_its_text_model(kind, tmp_path):
    """A qwen3_vl_moe / qwen3_vl folder (Qwen3-VL-30B-A3B, Qwen3-VL-8B, ...): the text model
    under model.language_model. (the head at lm_head, untied) loads with transformers' logits
    of a text-only forward (its mrope_section is plain RoPE there), the vision model's keys
    neither read nor counted as unread; the experts' stacks as transformers writes them or
    as released (transposed), which transformers reads too. The router renormalises its
    top-k whatever norm_topk_prob says. Not written back without the vision model; written
    as qwen3_moe / qwen3, which transformers loads with the same logits and fmoe reads back
    exactly."""
    ref = _qwen3_vl(kind)
    ref.save_pretrained(tmp_path / "written")
    folders = [tmp_path / "written"] + ([_released_stacks(tmp_path / "written", tmp_path / "released")] if kind == "qwen3_vl_moe" else [])
    docs = _packed()[0]
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
    text_kind = dict(qwen3_vl_moe="qwen3_moe", qwen3_vl="qwen3")[kind]
    for folder in folders:
        if folder.name == "released":
            again = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
            with torch.no_grad():
                assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6  # transformers reads them too
        _, cfg, written = _text_model_round_trip(folder, theirs, tmp_path / f"text-{folder.name}", kind=kind, prefix="model.language_model.",
                                                 head="lm_head.weight", text_kind=text_kind)
        assert not cfg.tie_embeddings and cfg.rope_base == 5e5
        assert (cfg.moe_layers, cfg.pre_softmax) == ((0, 2), False) if kind == "qwen3_vl_moe" else cfg.n_dense == 3
        assert "mrope_section" not in written["rope_parameters"]
    # transformers clears the text model's sliding_window, and the MoE router ignores norm_topk_prob; the head is untied
    # where the top level leaves tie_word_embeddings out (the text_config's true is not the whole model's)
    ignored = _edit(tmp_path / "written", tmp_path / "ignored",
                    lambda c: [c["text_config"].update(norm_topk_prob=False, sliding_window=4, tie_word_embeddings=True), c.pop("tie_word_embeddings")])
    assert hf.read_config(ignored)[1] == hf.read_config(tmp_path / "written")[1]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_a_released_qwen2_vl_folder_loads_its_text_model(kind, tmp_path):
    """A qwen2_vl / qwen2_5_vl folder (Qwen2-VL, Qwen2.5-VL 3B to 72B): Qwen2's text model
    (q/k/v biases, its own rms_norm_eps) where Qwen2 keeps it (model., the head at lm_head),
    the vision model under visual. neither read nor counted as unread; it loads with
    transformers' logits of a text-only forward (its mrope_section is plain RoPE there) from
    the config as transformers writes it (a text_config) and as the released folders hold
    it (the text fields at the top level, rope_scaling {"type": "mrope", ...}), which
    transformers reads too; not written back without the vision model; written as qwen2,
    which transformers loads with the same logits."""
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[kind]
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2]))
    vision = dict(depth=1, hidden_size=16, embed_dim=16, num_heads=2, out_hidden_size=32, intermediate_size=16, patch_size=14)
    torch.manual_seed(0)
    ref = _randomised(getattr(transformers, f"{name}ForConditionalGeneration")(getattr(transformers, f"{name}Config")(text_config=text,
                                                                                                                     vision_config=vision)))
    ref.save_pretrained(tmp_path / "written")
    docs = _packed()[0]
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])

    def released(c):  # the text fields at the top level, RoPE as rope_theta beside rope_scaling's mrope
        text = {k: v for k, v in c.pop("text_config").items() if k != "model_type"}  # the top level's model_type stays
        rope = text.pop("rope_parameters")
        c.update(text, rope_theta=rope["rope_theta"], rope_scaling=dict(type="mrope", mrope_section=rope["mrope_section"]))

    old = _edit(tmp_path / "written", tmp_path / "released", released)
    assert "text_config" not in json.loads((old / "config.json").read_text())
    again = transformers.AutoModelForImageTextToText.from_pretrained(old, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([again(input_ids=d[None]).logits[0] for d in docs]), theirs) < 1e-6  # transformers reads it too
    for folder in (tmp_path / "written", old):
        _, cfg, written = _text_model_round_trip(folder, theirs, tmp_path / f"text-{folder.name}", kind=kind, prefix="model.", head="lm_head.weight",
                                                 text_kind="qwen2")
        assert not cfg.tie_embeddings and cfg.qkv_bias and (cfg.rope_base, cfg.norm_eps) == (1e6, 1e-5)
        assert "mrope" not in json.dumps(written)  # plain RoPE, written so
    assert hf.read_config(old)[1] == hf.read_config(tmp_path / "written")[1]


def _omni_thinker_round_trip(kind, text, audio, vision, tmp_path):
    """A tiny Qwen3-Omni / Qwen2.5-Omni model (randomised) of these sub-configs, saved; its
    thinker's text model read, compared and written back (_text_model_round_trip) -> (the
    config read, the written config). A folder without a thinker_config is refused."""
    name, text_kind = dict(qwen3_omni_moe=("Qwen3OmniMoe", "qwen3_moe"), qwen2_5_omni=("Qwen2_5Omni", "qwen2"))[kind]
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(thinker_config=dict(text_config=text, audio_config=audio, vision_config=vision), enable_audio_output=False)
    ref = _randomised(getattr(transformers, f"{name}ForConditionalGeneration")(config))
    ref.save_pretrained(tmp_path / "omni")
    docs = _packed()[0]
    with torch.no_grad():
        theirs = torch.cat([ref.thinker(input_ids=d[None]).logits[0] for d in docs])
    _, cfg, written = _text_model_round_trip(tmp_path / "omni", theirs, tmp_path / "text", kind=kind, prefix="thinker.model.",
                                             head="thinker.lm_head.weight", text_kind=text_kind)
    with pytest.raises(ValueError, match=f"config.json: a {kind} config without a thinker_config is not supported"):
        hf.from_pretrained(_edit(tmp_path / "omni", tmp_path / "bad", lambda c: c.pop("thinker_config")))
    return cfg, written


def test_a_released_qwen3_omni_folder_loads_its_thinker_s_text_model(tmp_path):
    """A qwen3_omni_moe folder (Qwen3-Omni-30B-A3B): the thinker's text model under
    thinker.model. (the head at thinker.lm_head) loads with the thinker's logits of a
    text-only forward, its audio and vision encoders' keys neither read nor counted as unread;
    it is not written back without them, and writes as qwen3_moe (norm_topk_prob as the
    thinker has it), which transformers loads with the same logits and fmoe reads back exactly."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 1, 1], interleaved=True))
    audio = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16, output_dim=32, downsample_hidden_size=8)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])
    cfg, written = _omni_thinker_round_trip("qwen3_omni_moe", text, audio, vision, tmp_path)
    assert not cfg.tie_embeddings and cfg.pre_softmax and cfg.moe_layers == (0, 2) and cfg.rope_base == 1e6
    assert written["norm_topk_prob"] is False and written["rope_parameters"] == dict(rope_type="default", rope_theta=1e6)  # no mrope fields
    # transformers clears the text model's sliding_window; the head is untied where the thinker leaves tie_word_embeddings out
    ignored = _edit(tmp_path / "omni", tmp_path / "ignored",
                    lambda c: [c["thinker_config"]["text_config"].update(sliding_window=4, tie_word_embeddings=True), c["thinker_config"].pop("tie_word_embeddings")])
    assert hf.read_config(ignored)[1] == hf.read_config(tmp_path / "omni")[1]


def test_a_released_qwen2_5_omni_folder_loads_its_thinker_s_text_model(tmp_path):
    """A qwen2_5_omni folder (Qwen2.5-Omni-3B / -7B): the thinker's Qwen2 text model under
    thinker.model. (the head at thinker.lm_head, untied as the thinker says) loads with the
    thinker's logits of a text-only forward, its audio and vision encoders' keys neither read
    nor counted as unread; it is not written back without them, and writes as qwen2, which
    transformers loads with the same logits and fmoe reads back exactly."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2]))
    audio = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16, output_dim=32)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=14, fullatt_block_indexes=[0])
    cfg, written = _omni_thinker_round_trip("qwen2_5_omni", text, audio, vision, tmp_path)
    assert not cfg.tie_embeddings and cfg.qkv_bias and (cfg.rope_base, cfg.norm_eps) == (1e6, 1e-5)
    assert "mrope" not in json.dumps(written)


def test_cohere2_moe_reads_its_norms_routing_and_shared_experts_as_transformers_does(folders, tmp_path):
    """Cohere 2 MoE: the test folder's (RMSNorms, softmax over the top-2 logits, a shared expert
    averaged with the routed output: both x 0.5, the dense prefix rotating in its global layer);
    then LayerNorms without bias (rms_norm_eps null), sigmoid routing without renormalising, the
    shared expert summed, the prefix of pattern 2 (its global layer NoPE), each loading with
    transformers' logits, and fmoe's own such model exporting as one transformers reads with
    fmoe's logits."""
    _, cfg = hf.read_config(folders["cohere2_moe"][0])
    assert (cfg.parallel_blocks, cfg.layer_norms, cfg.norm_eps, cfg.moe_layers, cfg.ffn_dense, cfg.ffn_expert, cfg.shared_size) == (
        True, False, 1e-5, (1, 2), 24, 16, 16)
    assert (cfg.score, cfg.pre_softmax, cfg.route_scale, cfg.shared_scale, cfg.window_layers, cfg.nope_layers, cfg.logit_divisor) == (
        "softmax", False, 0.5, 0.5, (1,), (2,), 2.0)
    config = FAMILIES["cohere2_moe"]().to_dict()
    config.update(rms_norm_eps=None, layer_norm_eps=1e-4, expert_selection_fn="sigmoid", norm_topk_prob=False,
                  shared_expert_combination_strategy="sum", prefix_dense_sliding_window_pattern=2)
    config.pop("layer_types")
    torch.manual_seed(1)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(transformers.Cohere2MoeConfig(
        **{k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "architectures")}, first_k_dense_replace=1)))
    ref.save_pretrained(tmp_path / "other")
    model, cfg = hf.from_pretrained(tmp_path / "other", impl="torch")
    assert (cfg.layer_norms, cfg.norm_eps, cfg.score, cfg.route_normalize, cfg.route_scale, cfg.shared_scale) == (True, 1e-4, "sigmoid", False, None, 1.0)
    assert ref.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] and cfg.nope_layers == (2,)
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), torch.cat([ref(d[None]).logits[0] for d in docs])) < 1e-5
    del model.hf_config
    hf.save_pretrained(model, tmp_path / "out", model_type="cohere2_moe")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), torch.cat([back(d[None]).logits[0] for d in docs])) < 1e-5


def test_a_released_axk1_folder_reads_as_transformers_reads_it(folders, tmp_path):
    """A.X-K1: DeepSeek-V3's model with a norm on each MoE block's output (the MTP block's too).
    Its released folders also hold that norm for the dense blocks (transformers leaves it
    unread, and so does fmoe) and route without a correction bias (zero in both), and their
    configs give the MoE blocks by first_k_dense_replace and moe_layer_freq."""
    path, ref = folders["axk1"]
    _, cfg = hf.read_config(path)
    assert cfg.moe_out_norm and not cfg.post_norms and cfg.n_dense == 1 and cfg.q_rank == 12
    model, _ = hf.from_pretrained(path, impl="torch")
    assert model.blocks[0].mlp_post_norm is None and model.blocks[1].mlp_post_norm is not None and model.blocks[0].attn_post_norm is None
    tensors = {k: v for k, v in _read_all(path).items() if not k.endswith("e_score_correction_bias")}
    tensors["model.layers.0.post_mlp_layernorm.weight"] = 1 + 0.3 * torch.randn(32)

    def legacy(c):
        c.pop("mlp_layer_types")
        c.update(first_k_dense_replace=1, moe_layer_freq=1)

    released = _copy_folder(path, tmp_path / "released", tensors, legacy)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(released, dtype=torch.float32).eval()
    model, got = hf.from_pretrained(released, impl="torch")
    assert got == dataclasses.replace(cfg, impl="torch") and not model.blocks[1].mlp.expert_bias.any()
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([theirs_model(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        assert _rel(hf.from_pretrained(path, impl="torch")[0].logits(ids, cu), theirs) > 1e-3  # the correction bias mattered
    every_other = hf.read_config(_edit(released, tmp_path / "every-other", lambda c: c.update(moe_layer_freq=2)))[1]
    assert [every_other.is_moe(i) for i in range(3)] == [False, False, True]  # from block 1 on, i % 2 == 0


def test_a_released_dbrx_folder_reads_its_rope_base_clip_and_routing(folders, tmp_path):
    """DBRX: a released config.json gives the RoPE base only in attn_config.rope_theta (and a
    router jitter, training noise, not built). fmoe reads that base, as DBRX was trained and
    transformers 4 read it; transformers 5.24 builds such a folder at its default 10000. The
    clamp and the weights kept as they are (moe_normalize_expert_weights None) are as
    transformers computes them."""
    path, ref = folders["dbrx"]

    def released(c):
        c.pop("rope_parameters")
        c["attn_config"] = dict(clip_qkv=2.0, kv_n_heads=2, rope_theta=5e5, model_type="")
        c["ffn_config"] = dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2, moe_jitter_eps=0.01, moe_loss_weight=0.05, model_type="")

    folder = _edit(path, tmp_path / "released", released)
    assert transformers.AutoConfig.from_pretrained(folder).rope_parameters["rope_theta"] == 10000.0  # transformers 5.24's reading
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert (cfg.rope_base, cfg.clip_qkv, cfg.layer_norms, cfg.pre_softmax, cfg.n_dense, cfg.norm_eps) == (5e5, 2.0, True, False, 0, 1e-5)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])  # the table's model: its top level at 5e5
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for name, change in (("unclamped", lambda c: c["attn_config"].update(clip_qkv=1e9)),
                             ("weights kept", lambda c: c["ffn_config"].update(moe_normalize_expert_weights=None))):
            other = _edit(path, tmp_path / name, change)
            theirs_other = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
            want = torch.cat([theirs_other(d[None]).logits[0] for d in docs])
            mine = hf.from_pretrained(other, impl="torch")[0].logits(ids, cu)
            assert _rel(mine, want) < 1e-5 and _rel(want, theirs) > 1e-3, name  # each piece matters, and fmoe has it
    assert hf.read_config(tmp_path / "weights kept")[1].pre_softmax


def test_a_released_glm4v_moe_folder_loads_its_text_model(tmp_path):
    """A glm4v_moe folder (GLM-4.5V, GLM-4.6V): GLM-4.5's text model (q/k/v biases by default,
    no q/k norms, RoPE on half of each head with the released mrope_section, plain for text)
    under model.language_model. (the head at lm_head) loads with transformers' logits of a
    text-only forward, the vision model's keys neither read nor counted as unread; it is not
    written back without the vision model, and writes as glm4_moe, which transformers loads
    with the same logits and fmoe reads back exactly."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=1.5, rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=[1, 1, 0]))
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1)
    theirs = _saved_multimodal(transformers.Glm4vMoeForConditionalGeneration, transformers.Glm4vMoeConfig(text_config=text, vision_config=vision),
                               tmp_path / "glm4v")
    _, cfg, written = _text_model_round_trip(tmp_path / "glm4v", theirs, tmp_path / "text", kind="glm4v_moe", prefix="model.language_model.",
                                             head="lm_head.weight", text_kind="glm4_moe")
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.rope_dim, cfg.n_dense, cfg.route_scale, cfg.expert_bias, cfg.tie_embeddings) == (
        True, None, 4, 1, 1.5, True, False)
    assert "mrope_section" not in written["rope_parameters"] and written["use_qk_norm"] is False
    # a config.json that leaves attention_bias out has the biases (transformers' GLM-4.5V default), and no q/k norms whatever it says
    left_out = _edit(tmp_path / "glm4v", tmp_path / "left-out", lambda c: [c["text_config"].pop("attention_bias"), c["text_config"].update(use_qk_norm=True)])
    assert hf.read_config(left_out)[1] == hf.read_config(tmp_path / "glm4v")[1]
    # the released folders' MTP layer (model.language_model.layers.n, which transformers leaves unread) loads into the MTP module
    # and writes back as glm4_moe's model.layers.n
    tensors = _read_all(tmp_path / "glm4v")
    p, last, g = "model.language_model.layers.3.", "model.language_model.layers.2.", torch.Generator().manual_seed(3)
    mtp = {p + k[len(last):]: t + 0.1 * torch.randn(t.shape, generator=g) for k, t in tensors.items() if k.startswith(last)}
    mtp.update({p + "enorm.weight": torch.ones(32), p + "hnorm.weight": torch.ones(32), p + "eh_proj.weight": torch.randn(32, 64, generator=g),
                p + "shared_head.norm.weight": torch.ones(32), p + "embed_tokens.weight": tensors["model.language_model.embed_tokens.weight"].clone(),
                p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    model, cfg = hf.from_pretrained(_copy_folder(tmp_path / "glm4v", tmp_path / "mtp", {**tensors, **mtp}), impl="torch")
    assert cfg.mtp_depth == 1 and torch.equal(model.mtp[0].proj, mtp[p + "eh_proj.weight"].t())
    assert hf.from_pretrained(tmp_path / "mtp", mtp_depth=0)[1].mtp_depth == 0  # asked for none, the layer is left unread
    assert torch.equal(model.mtp[0].block.mlp.experts.w_up[1], mtp[p + "mlp.experts.1.up_proj.weight"].t())
    model.hf_config = hf.written_config(model.hf_config)
    hf.save_pretrained(model, tmp_path / "mtp-text")
    assert torch.equal(_read_all(tmp_path / "mtp-text")["model.layers.3.eh_proj.weight"], mtp[p + "eh_proj.weight"])
    assert hf.from_pretrained(tmp_path / "mtp-text")[1].mtp_depth == 1


@pytest.mark.parametrize("kind", ["glm4v", "glm46v", "glmga", "glm_ocr"])
def test_a_released_glm4v_folder_loads_its_dense_text_model(kind, tmp_path):
    """A glm4v / glm46v folder (GLM-4.1V-9B, GLM-4.6V-Flash): GLM-4's dense text model
    (sandwich norms, q/k/v biases always, gate and up as one gate_up_proj, RoPE on interleaved
    pairs of the part of each head its rope_parameters name, all of it where they name none)
    under model.language_model. loads with transformers' logits of a text-only forward; not
    written back without the vision model, it writes as glm4, which transformers loads with
    the same logits and fmoe reads back exactly (glmga: GLM-4.6V's model under its own
    model_type). GLM-OCR's (glm_ocr): that model without q/k/v
    biases, heads of head_dim where the config sets one, its MTP layer after the trunk's
    neither read nor counted as unread."""
    made = dict(glm4v=(transformers.Glm4vConfig, transformers.Glm4vForConditionalGeneration),
                glm46v=(transformers.Glm46VConfig, transformers.Glm46VForConditionalGeneration),
                glmga=(transformers.GlmgaConfig, transformers.Glm46VForConditionalGeneration),
                glm_ocr=(transformers.GlmOcrConfig, transformers.GlmOcrForConditionalGeneration))[kind]
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1)
    docs = _packed()[0]
    ocr = kind == "glm_ocr"
    # (GLM-OCR's first: heads of 12, RoPE on 6 of their channels, 3 frequencies)
    for rope, rope_dim in ((dict(partial_rotary_factor=0.5, mrope_section=[1, 1, 1] if ocr else [1, 1, 0]), 4), (dict(mrope_section=[2, 1, 1]), None)):
        text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    rope_parameters=dict(rope_type="default", rope_theta=1e4, **rope), **(dict(head_dim=12) if ocr and rope_dim else {}))
        torch.manual_seed(0)
        ref = _randomised(made[1](made[0](text_config=text, vision_config=vision)))
        folder = tmp_path / f"{kind}-{rope_dim}"
        ref.save_pretrained(folder)
        with torch.no_grad():
            theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        _, cfg, written = _text_model_round_trip(folder, theirs, tmp_path / f"text-{rope_dim}", kind=kind, prefix="model.language_model.",
                                                 head="lm_head.weight", text_kind="glm4")
        assert (cfg.qkv_bias, cfg.post_norms, cfg.rope_interleaved, cfg.n_dense, cfg.norm_eps) == (not ocr, True, True, 3, 1e-5)
        assert (cfg.head_dim, cfg.rope_dim) == ((12, 6) if ocr and rope_dim else (8, rope_dim))
        assert "mrope_section" not in written["rope_parameters"]
    if ocr:  # the released folders' MTP layer (layers.3 of these 3): unread, as in transformers
        tensors = _read_all(folder)
        mtp = {k.replace(".layers.2.", ".layers.3."): torch.randn_like(v) for k, v in tensors.items() if ".language_model.layers.2." in k}
        model, _ = hf.from_pretrained(_copy_folder(folder, tmp_path / "mtp", {**tensors, **mtp}), impl="torch")
        with torch.no_grad():
            assert _rel(model.logits(*_packed()[1:]), theirs) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_a_released_paddleocr_vl_folder_loads_its_text_model(bias, tmp_path):
    """A paddleocr_vl folder (PaddleOCR-VL): ERNIE 4.5's blocks with Qwen2-VL's RoPE on halves
    (3-D positions, equal over text: plain RoPE) and its biases on q, k, v, o and the MLPs one
    setting (use_bias): Llama's model, under model. beside the vision model (visual.) and its
    projector (mlp_AR.), neither read nor counted as unread; it loads with transformers' logits
    of a text-only forward, is not written back without them, and writes as llama, which
    transformers loads with the same logits and fmoe reads back exactly."""
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                use_bias=bias, rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 2, 2]))
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=14, image_size=28)
    theirs = _saved_multimodal(transformers.PaddleOCRVLForConditionalGeneration, transformers.PaddleOCRVLConfig(text_config=text, vision_config=vision),
                               tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="paddleocr_vl", prefix="model.",
                                             head="lm_head.weight", text_kind="llama")
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.rope_interleaved, cfg.head_dim, cfg.tie_embeddings) == (bias, bias, bias, False, 12, True)
    assert "mrope_section" not in written["rope_parameters"]


def test_a_released_hunyuan_vl_folder_loads_its_text_model(tmp_path):
    """A hunyuan_vl folder (HunYuan-VL, HunyuanOCR): Hunyuan dense's text model (q/k norms after
    RoPE, its dynamic RoPE's alpha) whose XD-RoPE rotates four axes, equal over text: plain
    RoPE. Under model. beside the vision model (vit.), neither read nor counted as unread; it
    loads with transformers' logits of a text-only forward, the head tied, is not written back
    without the vision model, and writes as hunyuan_v1_dense, which transformers loads with the
    same logits and fmoe reads back exactly."""
    text = dict(FAMILIES["hunyuan_v1_dense"]().to_dict(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[1, 1, 1, 1])
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=32)
    theirs = _saved_multimodal(transformers.HunYuanVLForConditionalGeneration, transformers.HunYuanVLConfig(text_config=text, vision_config=vision),
                               tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="hunyuan_vl", prefix="model.", head="lm_head.weight",
                                             text_kind="hunyuan_v1_dense")
    assert cfg.tie_embeddings and cfg.qk_norm_after_rope and "mrope_section" not in written["rope_parameters"]


def _molmo2(folder, extra=0, qk_norm_type="qwen3", norm_after=False, ids=None):
    """A tiny Molmo2 model (randomised: its text model's blocks by qk_norm_type and norm_after, an
    embedding of `extra` rows past the head's) saved to folder; transformers' logits of a
    text-only forward over _packed's documents (ids: its tokens instead)."""
    text = dict(vocab_size=V, additional_vocab_size=extra, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=1e4), qk_norm_type=qk_norm_type,
                norm_after=norm_after)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                  image_patch_size=14, image_default_input_size=[28, 28])
    adapter = dict(vision_feature_layer=[1, 0], hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                   text_hidden_size=32)
    return _saved_multimodal(transformers.Molmo2ForConditionalGeneration,
                             transformers.Molmo2Config(text_config=text, vision_config=vision, adapter_config=adapter), folder, ids)


@pytest.mark.parametrize("blocks", [("qwen3", False), ("olmo", True)], ids=["qwen3", "olmo"])
def test_a_released_molmo2_folder_loads_its_text_model(blocks, tmp_path):
    """A molmo2 folder (Molmo2-4B / -8B, Molmo2-O-7B): its text model, Qwen3's blocks
    (qk_norm_type "qwen3") or OLMo 2's (qk_norm_type "olmo" with norm_after), under the
    released OLMo-core names (att_proj's q, k, v rows; ff_proj's up rows then gate rows; the
    embedding's rows in wte.embedding then wte.new_embedding, however the file splits them)
    beside the vision backbone, unread; transformers' logits of a text-only forward. With no
    rows past the head's it writes as qwen3 / olmo2, which transformers loads with the same
    logits; with additional_vocab_size rows (the image tokens', out_vocab) it reads them (ids
    past the head's) and is not written as either. What neither family is, is refused."""
    qk, after = blocks
    kind = "qwen3" if qk == "qwen3" else "olmo2"
    theirs = _molmo2(tmp_path / "plain", 0, qk, after)
    _, cfg, _ = _text_model_round_trip(tmp_path / "plain", theirs, tmp_path / "text", kind="molmo2", prefix="model.transformer.",
                                       head="lm_head.weight", text_kind=kind)
    assert (cfg.qk_norm, cfg.post_norms, cfg.pre_norms, cfg.out_vocab) == ("head" if qk == "qwen3" else "proj", after, not after, None)
    # the image tokens' rows past the head's: ids 64 ... 71 read from wte.new_embedding (the file splits the 72 rows 36 / 36)
    ids = torch.tensor([3, 70, 5, 64, 71, 9, 66, 2])
    theirs = _molmo2(tmp_path / "extra", 8, qk, after, ids=ids)
    model, cfg = hf.from_pretrained(tmp_path / "extra", impl="torch")
    assert (cfg.vocab_size, cfg.out_vocab, cfg.head_vocab) == (V + 8, V, V)
    with torch.no_grad():
        assert _rel(model.logits(ids, torch.tensor([0, 8], dtype=torch.int32)), theirs) < 1e-5
    assert tuple(_read_all(tmp_path / "extra")["model.transformer.wte.new_embedding"].shape) == (36, 32)
    with pytest.raises(ValueError, match="model: a molmo2 folder's embedding holds rows past its head's"):
        hf.written_config(model.hf_config)
    with pytest.raises(ValueError, match=r"pass its text model's model_type \(one of qwen3, olmo2\)"):
        hf.save_pretrained(model, tmp_path / "whole")
    config = json.loads((tmp_path / "extra" / "config.json").read_text())
    for change, message in ((dict(norm_after=not after), "qk_norm_type = .* with norm_after = .* is not supported"),
                            (dict(attention_bias=True), "attention_bias = True is not supported"),
                            (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4), rope_scaling_layers=[0]),
                             r"rope_scaling_layers = \[0\] is not supported"),
                            (dict(additional_vocab_size=-1), "additional_vocab_size = -1 is not supported")):
        with pytest.raises(ValueError, match=f"config.json: .*{message}"):
            hf.FAMILIES["molmo2"].kwargs(dict(config, text_config=dict(config["text_config"], **change)))
    with pytest.raises(ValueError, match="config.json: tie_word_embeddings = True is not supported"):  # the top level's, which ties the head
        hf.FAMILIES["molmo2"].kwargs(dict(config, tie_word_embeddings=True))


def _load_molmo2_sharded(rank, world, path):
    """One rank: a molmo2 folder's text model built on meta, FSDP2-sharded over 2 ranks (the
    embedding's rows split between them), materialised and loaded; its gathered weights."""
    from torch.distributed.tensor import DTensor

    import fmoe.parallel as parallel
    from fmoe.model import Transformer

    _, cfg = hf.read_config(path)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, impl="torch"))
    parallel.parallelize(model, parallel.build_meshes())
    parallel.materialize(model, torch.device("cpu"), seed=0)
    hf.load_weights(model, path, model_type="molmo2")
    embed = model.embed if not isinstance(model.embed, DTensor) else model.embed.to_local()
    return tuple(embed.shape), {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in hf._tensors(model).items()}


def test_sharded_ranks_read_molmo2_s_embedding_rows_from_both_keys(tmp_path):
    """Molmo2's embedding under FSDP2 over 2 ranks: each rank's rows (36 of the 72) come from
    wte.embedding and wte.new_embedding as the file splits them (here 30 and 42, so the ranks'
    halves cross the join); gathered, every weight is the one-process model's."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from parallel.dist import run_distributed

    _molmo2(tmp_path / "written", 8)
    tensors = _read_all(tmp_path / "written")
    rows = torch.cat([tensors.pop("model.transformer.wte.embedding"), tensors.pop("model.transformer.wte.new_embedding")])
    folder = _copy_folder(tmp_path / "written", tmp_path / "uneven",
                          {**tensors, "model.transformer.wte.embedding": rows[:30], "model.transformer.wte.new_embedding": rows[30:]})
    one, _ = hf.from_pretrained(folder, impl="torch")
    assert torch.equal(one.embed.detach(), rows)
    want = {n: t.detach() for n, t in hf._tensors(one).items()}
    for shape, full in run_distributed(_load_molmo2_sharded, 2, folder):
        assert shape == (36, 32) and set(full) == set(want)
        assert all(torch.equal(full[n], want[n]) for n in want)


def test_a_released_ernie4_5_vl_moe_folder_loads_its_text_model(tmp_path):
    """An ernie4_5_vl_moe folder (ERNIE-4.5-VL-28B-A3B, -424B-A47B): ERNIE 4.5 MoE's text model
    with modality-isolated experts (the first half of each block's experts the text ones, the
    rest and their router weight_1 the vision ones), the router stored [H, E], the correction
    bias a [2, E] of one row per modality, and 3-D RoPE that text positions make ERNIE 4.5's
    interleaved RoPE. It loads with transformers' logits of a text-only forward, the vision
    experts, the vision model and the resampler neither read nor counted as unread; it is not
    written back without them, and writes as ernie4_5_moe, which transformers loads with the
    same logits and fmoe reads back exactly."""
    from safetensors import safe_open

    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                moe_intermediate_size=[8, 12], moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 2]))
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2, temporal_patch_size=1, spatial_merge_size=1)
    theirs = _saved_multimodal(transformers.Ernie4_5_VLMoeForConditionalGeneration,
                               transformers.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision), tmp_path / "vl")
    model, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="ernie4_5_vl_moe", prefix="model.",
                                                 head="lm_head.weight", text_kind="ernie4_5_moe")
    assert (cfg.moe_layers, cfg.ffn_expert, cfg.n_experts, cfg.shared_size, cfg.tie_embeddings, cfg.rope_interleaved) == ((1, 2), 8, 4, 8, True, True)
    with safe_open(tmp_path / "vl" / "model.safetensors", "pt") as f:
        bias, router = f.get_tensor("model.layers.1.mlp.moe_statics.e_score_correction_bias"), f.get_tensor("model.layers.1.mlp.gate.weight")
    assert torch.equal(model.blocks[1].mlp.expert_bias, bias[0]) and torch.equal(model.blocks[1].mlp.router, router.t())
    assert (written["moe_intermediate_size"], written["moe_layer_start_index"], written["moe_layer_end_index"]) == (8, 1, 2)
    with pytest.raises(ValueError, match=r"config.json: MoE blocks \[0, 2\] are not supported \(every interval-th block"):
        hf.read_config(_edit(tmp_path / "vl", tmp_path / "bad", lambda c: c["text_config"].update(mlp_layer_types=["sparse", "dense", "sparse"])))


def test_qwen3_vl_moe_stacks_are_told_apart_by_their_shapes(tmp_path):
    """Where 2F = H, a gate_up_proj stack has one shape either way: the down_proj's tells them
    apart ([E, H, F] as transformers writes it, [E, F, H] as released), so fmoe reads the
    released folder as the model it is (transformers takes its gate_up_proj as its own layout)."""
    ref = _qwen3_vl("qwen3_vl_moe", ffn_expert=16)  # 2F = H = 32
    ref.save_pretrained(tmp_path / "written")
    released = _released_stacks(tmp_path / "written", tmp_path / "released")
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        for folder in (tmp_path / "written", released):
            assert _rel(hf.from_pretrained(folder, impl="torch")[0].logits(ids, cu), theirs) < 1e-5


_CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
             patch_size=14)
# the folders whose text model is one of several families: model_type -> (transformers' class of the whole model, its
# config class, a small vision config, the text models fmoe reads there)
_OF_SEVERAL = {
    "mistral3": ("Mistral3", dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, image_size=28,
                                  patch_size=14), ("mistral4", "ministral3", "mistral")),
    **{vl: (cls, vision, ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "granite"))
       for vl, cls, vision in (("llava", "Llava", _CLIP), ("llava_next", "LlavaNext", _CLIP), ("llava_next_video", "LlavaNextVideo", _CLIP),
                               ("llava_onevision", "LlavaOnevision", dict(_CLIP, model_type="siglip_vision_model")),
                               ("internvl", "InternVL", dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                             image_size=[28, 28], patch_size=[14, 14])),
                               ("vipllava", "VipLlava", dict(_CLIP, num_hidden_layers=12)),  # its projector reads layers -2 ... -11 and 6
                               ("video_llava", "VideoLlava", _CLIP),
                               ("idefics3", "Idefics3", dict(_CLIP, model_type="idefics3_vision")),
                               ("smolvlm", "SmolVLM", dict(_CLIP, model_type="smolvlm_vision")))},
}


@pytest.mark.parametrize("kind,text_model", [("mistral3", "mistral4"), ("mistral3", "ministral3"), ("mistral3", "mistral"), ("llava", "llama"),
                                             ("llava_next", "mistral"), ("llava_next_video", "llama"), ("llava_onevision", "qwen2"),
                                             ("internvl", "qwen3"), ("internvl", "qwen3_moe"), ("idefics3", "llama"), ("smolvlm", "llama"),
                                             ("llava_next", "granite"), ("vipllava", "llama"), ("video_llava", "qwen2")])
def test_a_released_folder_of_one_of_several_text_models_loads_it(kind, text_model, folders, tmp_path):
    """A released Mistral 3 folder (mistral3, Mistral3ForConditionalGeneration: Mistral Small
    4, Ministral 3, Mistral Small 3.x) or LLaVA-style one (LLaVA 1.5, LLaVA-NeXT(-Video),
    LLaVA-OneVision, InternVL's -hf folders, ViP-LLaVA, Video-LLaVA; Idefics3 and SmolVLM, whose text model is under
    model.text_model. and head at lm_head.): the text model under language_model. (the head
    too) loads with transformers' logits of a text-only forward, the vision model's keys
    neither read nor counted as unread; it is not written back without the vision model, and
    writes as its text model's family, which transformers loads with the same logits. The
    head is tied as transformers' class ties it by default; a folder of another text model is
    refused by name."""
    name, vision, texts = _OF_SEVERAL[kind]
    whole, config = getattr(transformers, f"{name}ForConditionalGeneration"), getattr(transformers, f"{name}Config")
    text = FAMILIES[text_model]().to_dict()
    torch.manual_seed(0)
    # the class's default of the top level's tie_word_embeddings, except Mistral 3's (test_a_folder_of_several_text_models_ties_...)
    ref = _randomised(whole(config(text_config=text, vision_config=vision, **(dict(tie_word_embeddings=False) if kind == "mistral3" else {}))))
    ref.save_pretrained(tmp_path / kind)
    model, cfg = hf.from_pretrained(tmp_path / kind, impl="torch")
    tied = ref.config.tie_word_embeddings  # InternVL's head is tied by default, the others' not
    assert cfg.tie_embeddings == tied == (kind == "internvl")
    unscaled = dict(logit_divisor=1.0) if text_model == "granite" else {}  # the LLaVA-style heads apply no logit scale (here 4)
    assert dataclasses.replace(cfg, impl="auto") == dataclasses.replace(hf.read_config(folders[text_model][0])[1], tie_embeddings=tied, **unscaled)
    keys = [k for spec in hf.key_map(hf.FAMILIES[kind], cfg).values() for k in spec.keys]
    inner = ("model.text_model.", "lm_head.") if kind in ("idefics3", "smolvlm") else ("language_model.",)  # the head too
    assert all(k.startswith(inner) for k in keys)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    not_read = ", ".join(re.escape(p) for p in hf.FAMILIES[kind].not_read)
    with pytest.raises(ValueError, match=f"model_type: a {kind} folder holds a model fmoe does not read .{not_read}., "
                                         f"so it is not written; pass its text model's model_type .one of {', '.join(texts)}."):
        hf.save_pretrained(model, tmp_path / "again")
    model.hf_config = hf.written_config(model.hf_config)  # the folder's own text config, as its text model's family
    assert model.hf_config["model_type"] == text_model
    hf.save_pretrained(model, tmp_path / "text")
    back = _causal_lm(text_model).from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    if text_model in ("mistral", "llama"):
        other = _edit(tmp_path / kind, tmp_path / "other", lambda c: c["text_config"].update(model_type="gemma"))
        with pytest.raises(ValueError, match=f"config.json: a {kind} folder whose text model is 'gemma' is not supported .{', '.join(texts)}."):
            hf.from_pretrained(other)


@pytest.mark.parametrize("kind,top,text,tied", [
    ("llava", None, True, True), ("llava", False, True, True), ("llava", True, False, True), ("llava", None, False, False),
    ("llava_onevision", None, True, True), ("llava_next_video", False, True, True),
    ("llava_next", None, True, False), ("llava_next", True, False, True),
    ("internvl", None, False, True), ("internvl", False, True, False), ("smolvlm", None, True, False), ("idefics3", True, False, True),
    ("vipllava", None, True, False), ("video_llava", True, False, True),
    ("mistral3", None, True, True), ("mistral3", None, False, False), ("mistral3", False, True, False)])
def test_a_folder_of_several_text_models_ties_the_head_as_transformers_does(kind, top, text, tied):
    """A config.json's top-level tie_word_embeddings (None: left out) and its text model's: the
    head is tied as transformers' class ties it: LLaVA's, LLaVA-NeXT-Video's and
    LLaVA-OneVision's where either level ties it, LLaVA-NeXT's, Idefics3's, SmolVLM's and
    InternVL's by the top level (by default untied, InternVL's tied). Mistral 3's by the top
    level where stated, else by the text model's own (transformers' class ties it by default:
    a released Mistral Small 3.x folder, whose text_config does not, would read its head as
    the embedding)."""
    name, _, _ = _OF_SEVERAL[kind]
    stated = {} if top is None else dict(tie_word_embeddings=top)
    text_config = dict(FAMILIES["mistral"]().to_dict(), tie_word_embeddings=text)
    if kind != "mistral3" or top is not None:  # transformers' own rule
        assert getattr(transformers, f"{name}Config")(text_config=text_config, **stated).tie_word_embeddings == tied
    released = dict(model_type=kind, text_config=text_config, **stated)
    assert hf.TransformerConfig(**hf.FAMILIES[kind].kwargs(released)).tie_embeddings == tied


def test_the_llava_style_folders_text_models_are_stored_as_llama_s():
    """The LLaVA-style folders read any of their text models through one Family, Llama's
    layout: every field of each text model's family but how its config reads is Llama's;
    each folder's family reads its text model by its text_config (_listed_family)."""
    config_only = {"config_to_fmoe", "architecture", "defaults", "aliases", "written_as"}
    for kind in _OF_SEVERAL["llava"][2]:
        family = hf.FAMILIES[kind]
        assert {f.name for f in dataclasses.fields(family) if getattr(family, f.name) != getattr(hf.FAMILIES["llama"], f.name)} <= config_only, kind
    for kind in ("llava", "llava_next", "llava_next_video", "llava_onevision", "internvl", "idefics3", "smolvlm", "vipllava", "video_llava"):
        assert hf.FAMILIES[kind].written_as == "text_config" and hf.FAMILIES[kind].config_to_fmoe is hf.FAMILIES["llava"].config_to_fmoe


def test_mistral4_query_scale_is_read_and_written(folders, tmp_path):
    """Mistral 4's query scale by position: it changes the logits (so the family test checks
    it); a llama_4_scaling_beta of 0 reads as none; a model without one exports with a beta
    of 0 and transformers gives its logits; one whose floor is not YaRN's original length has
    no mistral4 config."""
    path, ref = folders["mistral4"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    docs, ids, cu = _packed()
    plain_cfg = dataclasses.replace(cfg, query_temperature_floor=None, query_temperature_scale=0.1, impl="auto")
    plain = hf.Transformer(plain_cfg)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert _rel(plain.logits(ids, cu), model.logits(ids, cu)) > 1e-2
    zero = _edit(path, tmp_path / "zero", lambda c: c["rope_parameters"].update(llama_4_scaling_beta=0.0))
    assert hf.read_config(zero)[1] == plain_cfg
    hf.save_pretrained(plain, tmp_path / "plain", model_type="mistral4")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["rope_parameters"]["llama_4_scaling_beta"] == 0.0
    back = transformers.Mistral4ForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(plain.logits(ids, cu), torch.cat([back(d[None]).logits[0] for d in docs])) < 1e-5
    # one original_max_position_embeddings for both: the floor's 8 would move YaRN's 4
    with pytest.raises(ValueError, match=r"model: its config has no mistral4 equivalent: \{'yarn_original_max_positions': \(4, 8\)\}"):
        hf.hf_config(dataclasses.replace(cfg, query_temperature_floor=8), "mistral4")


def _edit(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _with_extra_key(src, dst, key, value):
    """A copy of folder src at dst whose weights hold one more tensor, `key`."""
    from safetensors.torch import load_file, save_file

    _edit(src, dst, lambda c: None)
    weights = load_file(dst / "model.safetensors")
    weights[key] = value
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# config.json edits fmoe refuses: (family, edit, the error it names)
BAD_CONFIGS = [
    ("mixtral", lambda c: c.update(model_type="bert"), "config.json: model_type 'bert' is not supported"),
    ("dbrx", lambda c: c["ffn_config"].update(moe_normalize_expert_weights=2.0),
     r"config.json: moe_normalize_expert_weights = 2.0 is not supported \(the chosen weights divided by their sum \(1\) or kept as they are"),
    ("dbrx", lambda c: c["ffn_config"].update(ffn_act_fn={"name": "gelu"}), r"config.json: ffn_act_fn = \{'name': 'gelu'\} is not supported"),
    ("dbrx", lambda c: c.update(tie_word_embeddings=True), r"config.json: tie_word_embeddings = True is not supported \(DBRX's head is its own"),
    ("dbrx", lambda c: c.update(n_heads=3), r"config.json: d_model = 32 is not supported \(n_heads = 3 heads of d_model / n_heads channels\)"),
    ("olmoe", lambda c: c.update(sliding_window=64),
     r"config.json: sliding_window = 64 is not supported \(no sliding-window attention in this family\)"),
    ("qwen2_moe", lambda c: c.update(layer_types=["chunked_attention"] * 3), "config.json: layer_types = .* is not supported"),
    ("minimax_m2", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.375),
     r"config.json: a rotary part of 3 channels is not supported \(an even number in \(0, head_dim = 8\]\)"),
    ("minimax_m2", lambda c: c.update(scoring_func="softmax"), r"config.json: scoring_func = 'softmax' is not supported \(sigmoid routing\)"),
    ("minimax_m2", lambda c: c.update(shared_intermediate_size=16), r"config.json: shared_intermediate_size = 16 is not supported"),
    ("ernie4_5_moe", lambda c: c.update(use_bias=True), r"config.json: use_bias = True is not supported \(no biases on the linear layers\)"),
    ("ernie4_5_moe", lambda c: c.update(moe_norm_min=0.5), r"config.json: moe_norm_min = 0.5 is not supported"),
    ("ernie4_5_moe", lambda c: c.update(moe_layer_interval=0), r"config.json: moe_layer_interval = 0 is not supported \(an int, at least 1\)"),
    ("deepseek_v2", lambda c: c.update(topk_method="noaux_tc"),
     r"config.json: topk_method = 'noaux_tc' is not supported \(greedy or group_limited_greedy\)"),
    ("solar_open", lambda c: c.update(first_k_dense_replace=1),
     r"config.json: first_k_dense_replace = 1 is not supported \(every Solar Open block is MoE\)"),
    ("solar_open", lambda c: c.update(use_qk_norm=True), r"config.json: use_qk_norm = True is not supported"),
    ("deepseek_v3", lambda c: c["rope_parameters"].pop("factor"), r"config.json: rope_parameters of rope type 'yarn' lack factor"),
    ("bailing_hybrid", lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     r"config.json: layer_types = .* is not supported \(full_attention or linear_attention for each of the 3 layers\)"),
    ("gemma4_text", lambda c: c.update(hidden_size_per_layer_input=256), r"config.json: hidden_size_per_layer_input = 256 is not supported \(no per-layer"),
    ("gemma4_text", lambda c: c.update(num_kv_shared_layers=1), r"config.json: num_kv_shared_layers = 1 is not supported"),
    ("gemma4_text", lambda c: c.update(per_layer_config={"0": {"head_dim": 16}, "2": {"head_dim": 16}}),
     r"config.json: per_layer_config = .* is not supported \(one head_dim and num_key_value_heads for every full_attention layer\)"),
    ("gemma4_text", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     r"config.json: rope_parameters.full_attention = .* is not supported \(plain RoPE over every channel, or proportional RoPE\)"),
    ("arcee", lambda c: c.update(hidden_act="silu"), r"config.json: hidden_act = 'silu' is not supported \(relu2, the squared ReLU"),
    ("gemma", lambda c: c.update(hidden_act="relu"), r"config.json: hidden_act = 'relu' is not supported \(GeGLU with GELU's tanh form"),
    ("gemma2", lambda c: c.update(attn_logit_softcapping=0), r"config.json: attn_logit_softcapping = 0 is not supported \(None or a positive cap\)"),
    # a dense config (H-Micro's) over an MoE checkpoint: the experts are read nowhere
    ("granitemoehybrid", lambda c: c.update(num_local_experts=0), r"checkpoint: 9 key\(s\) in .* that the model's config reads nowhere, e.g. "
     r"'model.layers.0.block_sparse_moe.input_linear.weight'"),
    ("granitemoehybrid", lambda c: c.update(mamba_conv_bias=False), r"config.json: mamba_conv_bias = False is not supported"),
    ("granitemoehybrid", lambda c: c.update(mamba_proj_bias=True), r"config.json: mamba_proj_bias = True is not supported"),
    ("granitemoehybrid", lambda c: c.update(time_step_limit=[0.001, 0.1]), r"config.json: time_step_limit = \[0.001, 0.1\] is not supported"),
    ("granitemoehybrid", lambda c: c.update(mamba_d_head=8), r"config.json: mamba_n_heads x mamba_d_head = 4 x 8 is not supported"),
    ("granitemoehybrid", lambda c: c.update(layer_types=["mamba", "sliding_attention", "mamba"]), r"config.json: layer_types = .* is not supported"),
    ("minimax", lambda c: c.update(mlp_alpha_factor=2.0), r"config.json: full_attn_alpha_factor / linear_attn_alpha_factor / mlp_alpha_factor = "
     r"\[1.7, 1.7, 2.0\] is not supported \(one positive alpha for every sublayer\)"),
    ("minimax", lambda c: c.update(full_attn_beta_factor=0), r"config.json: full_attn_beta_factor .* = \[0, 0.6, 0.6\] is not supported"),
    ("minimax", lambda c: c.update(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     r"config.json: layer_types = .* is not supported \(full_attention or linear_attention for each of the 3 layers\)"),
    ("minimax", lambda c: c.update(sliding_window=4), r"config.json: sliding_window = 4 is not supported \(no sliding-window attention"),
    ("lfm3", lambda c: c.update(layer_types=["conv", "chunked_attention", "full_attention"]),
     r"config.json: layer_types = .* is not supported \(one of conv / full_attention / sliding_attention per layer\)"),
    ("lfm3", lambda c: c.update(use_attention_gate="yes"), r"config.json: use_attention_gate = 'yes' is not supported \(true or false\)"),
    ("gemma3_text", lambda c: c.update(attn_logit_softcapping=50.0), r"config.json: attn_logit_softcapping = 50.0 is not supported \(no softcap"),
    ("gemma3_text", lambda c: c.update(use_bidirectional_attention=True), r"config.json: use_bidirectional_attention = True is not supported"),
    ("gemma3_text", lambda c: c.update(hidden_activation="gelu"), r"config.json: hidden_activation = 'gelu' is not supported \(GeGLU with GELU's tanh"),
    ("gemma3_text", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
     r"config.json: rope type 'yarn' is not supported for gemma3_text \(plain RoPE or linear\)"),
    ("hyperclovax", lambda c: c.update(use_post_norm="yes"), r"config.json: use_post_norm = 'yes' is not supported \(true or false\)"),
    ("hyperclovax", lambda c: c.update(logits_scaling=0), r"config.json: logits_scaling = 0 is not supported \(a positive number\)"),
    ("granite_swa", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported \(no attention biases in Granite's"),
    ("granite_swa", lambda c: c.update(layer_rope_theta=[5000.0, 0, 7.0]), r"config.json: layer_rope_theta = \[5000.0, 0, 7.0\] is not supported"),
    ("axk2", lambda c: c.update(n_group=2, topk_group=1), r"config.json: n_group = 2 is not supported \(no expert groups: A.X-K2's grouped routing"),
    ("axk2", lambda c: c.update(q_lora_rank=None), r"config.json: q_lora_rank = None is not supported \(A.X-K2's queries and gate"),
    ("axk2", lambda c: c.update(gated_norm_rank=0), r"config.json: gated_norm_rank = 0 is not supported \(a positive int\)"),
    ("axk2", lambda c: c.update(layer_types=["indexed_attention", "full_attention", "indexed_attention"]),
     r"config.json: layer_types = .* is not supported \(A.X-K2's indexed_attention in every layer\)"),
    ("beam", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported \(no attention biases"),
    ("beam", lambda c: c.update(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
     r"config.json: rope_parameters = .* is not supported \(one per layer type, full_attention / sliding_attention, each RoPE's parameters or None\)"),
    ("beam", lambda c: c.update(final_logit_softcapping=0), r"config.json: final_logit_softcapping = 0 is not supported \(None or a positive cap\)"),
    ("lara_mini", lambda c: c.update(layer_types=["linear_attention", "chunked_attention", "full_attention"]),
     r"config.json: layer_types = .* is not supported \(one of linear_attention / sliding_attention / full_attention per layer\)"),
    ("lara_mini", lambda c: c.update(sliding_window=None), r"config.json: sliding_window = None is not supported \(a positive width"),
    ("lara_mini", lambda c: c.update(hidden_act="gelu"), r"config.json: hidden_act = 'gelu' is not supported"),
    ("kolibri1", lambda c: c.update(sliding_window=None),
     r"config.json: sliding_window = None is not supported with sliding_attention layers in layer_types"),
    ("kolibri1", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported \(no attention biases"),
    ("kolibri1", lambda c: c.update(norm_topk_prob=True, num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported"),
    ("hy_v4", lambda c: c.update(layer_types=["indexed_attention", "full_attention", "indexed_attention"]),
     r"config.json: layer_types = .* is not supported \(HY-V4's indexed_attention in every layer\)"),
    ("hy_v4", lambda c: c.update(swiglu_limit=0.0), r"config.json: swiglu_limit = 0.0 is not supported \(a positive clamp"),
    ("hy_v4", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported"),
    ("hy_v4", lambda c: c.update(indexer_types=["shared", "full", "full"]), r"config.json: indexer_types = .* is not supported"),
    ("deepseek_v4", lambda c: c.update(layer_types=["sliding_attention", "full_attention", "compressed_sparse_attention"]),
     r"config.json: layer_types = .* is not supported \(sliding_attention, heavily_compressed_attention or compressed_sparse_attention in every "
     r"layer\)"),
    ("deepseek_v4", lambda c: c["rope_parameters"]["compress"].update(attention_factor=1.5),
     r"config.json: the compressed layers' rope of type 'yarn' \(attention_factor 1.5\) is not supported"),
    ("deepseek_v4", lambda c: c.update(layer_types=None), r"config.json: layer_types = None is not supported"),
    ("deepseek_v4", lambda c: c.update(mlp_layer_types=["moe", "hash_moe", "moe"]),
     r"config.json: mlp_layer_types = \['moe', 'hash_moe', 'moe'\] is not supported \(hash_moe in the first layers, then moe\)"),
    ("deepseek_v4", lambda c: c.update(scoring_func="softmax"), r"config.json: scoring_func = 'softmax' is not supported \(sqrtsoftplus or sigmoid\)"),
    ("deepseek_v4", lambda c: c.update(scoring_func="sigmoid", num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported"),
    ("deepseek_v4", lambda c: c.update(q_lora_rank=None), r"config.json: q_lora_rank = None is not supported \(a positive int\)"),
    ("deepseek_v4", lambda c: c.update(swiglu_limit=0.0), r"config.json: swiglu_limit = 0.0 is not supported \(a positive clamp"),
    ("deepseek_v4", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported"),
    ("deepseek_v4", lambda c: c.update(hidden_act="gelu"), r"config.json: hidden_act = 'gelu' is not supported"),
    ("deepseek_v4", lambda c: c["rope_parameters"]["main"].update(rope_type="yarn"),
     r"config.json: rope_parameters.main of rope type 'yarn' is not supported"),
    ("longcat_flash", lambda c: c.update(qk_head_dim=11), r"config.json: qk_head_dim = 11 is not supported \(qk_nope_head_dim \+ qk_rope_head_dim = 10\)"),
    ("longcat_flash", lambda c: c.update(q_lora_rank=None), r"config.json: q_lora_rank = None is not supported \(a q latent"),
    ("longcat_flash", lambda c: c.update(zero_expert_type="constant"), r"config.json: zero_expert_type = 'constant' is not supported \(identity"),
    ("longcat_flash", lambda c: c.update(mla_scale_kv_lora=False), r"config.json: mla_scale_kv_lora = False is not supported \(true"),
    ("hunyuan_v1_moe", lambda c: c.update(moe_topk=[2, 1, 2]),
     r"config.json: moe_topk = \[2, 1, 2\] is not supported \(the same value in every layer\)"),
    ("hunyuan_v1_moe", lambda c: c["rope_parameters"].pop("alpha"), r"config.json: rope type 'dynamic' is not supported"),
    ("granitemoe", lambda c: c.update(logits_scaling=0), r"config.json: logits_scaling = 0 is not supported \(a positive number\)"),
    ("jetmoe", lambda c: c.update(activation_function="gelu"), r"config.json: activation_function = 'gelu' is not supported \(silu"),
    ("jetmoe", lambda c: c.update(rms_norm_eps=1e-5), r"config.json: rms_norm_eps = 1e-05 is not supported \(1e-6: JetMoE's blocks norm with 1e-6"),
    ("jetmoe", lambda c: c.update(aux_loss_coef=-1.0), r"config.json: aux_loss_coef = -1.0 is not supported \(a finite number >= 0\)"),
    ("granitemoe_swa", lambda c: c.update(layer_rope_theta=[5000.0, 100.0, 200.0]),
     r"config.json: layer_rope_theta = \[5000.0, 100.0, 200.0\] is not supported \(0 for NoPE, else one RoPE base per layer type"),
    ("afmoe", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family renormalises"),
    ("llama4_text", lambda c: c.update(attention_chunk_size=None), r"config.json: attention_chunk_size = None is not supported"),
    ("mistral4", lambda c: c.update(n_group=2, topk_group=1), r"config.json: n_group = 2 is not supported \(no expert groups: n_group = 1\)"),
    ("mistral4", lambda c: c["rope_parameters"].pop("llama_4_scaling_beta"),
     r"config.json: mistral4's rope_parameters need llama_4_scaling_beta and original_max_position_embeddings"),
    ("ministral3", lambda c: c["rope_parameters"].update(mscale_all_dim=0.5),
     r"config.json: rope_parameters with mscale 1.0 and mscale_all_dim 0.5 are not supported for ministral3 \(both equal, or neither\)"),
    ("llama4_text", lambda c: c.update(layer_types=["sliding_attention"] * 3), r"config.json: layer_types = .* is not supported"),
    ("llama4_text", lambda c: c.update(no_rope_layers=[1, 2, 1]), r"config.json: no_rope_layers = \[1, 2, 1\] is not supported"),
    ("granitemoe", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported"),
    ("mellum", lambda c: c.update(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
     r"config.json: rope_parameters = .* is not supported \(one per layer type, full_attention / sliding_attention\)"),
    ("mellum", lambda c: c["rope_parameters"]["sliding_attention"].update(partial_rotary_factor=0.5),
     r"config.json: partial_rotary_factor = 0.5 is not supported \(RoPE over every channel in the sliding_attention layers\)"),
    ("mellum", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
     r"config.json: rope_parameters.sliding_attention = .* is not supported \(plain RoPE, or the full layers' RoPE\)"),
    ("hy_v3", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family renormalises"),
    ("deepseek_v3", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family"),
    ("minimax_m2", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family"),
    ("hy_v3", lambda c: c.update(mlp_bias=True), r"config.json: mlp_bias = True is not supported \(no biases in the MLPs here\)"),
    ("flint", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family renormalises"),
    ("sarvam_moe", lambda c: c.update(use_bias=True), r"config.json: use_bias = True is not supported \(no biases in Sarvam's projections"),
    ("sarvam_moe", lambda c: c.update(moe_router_enable_expert_bias=False), r"config.json: moe_router_enable_expert_bias = False is not supported"),
    ("cohere2_moe", lambda c: c.update(shared_expert_combination_strategy="max"), r"config.json: shared_expert_combination_strategy = 'max' is not"),
    ("cohere2_moe", lambda c: c.update(expert_selection_fn="relu"), r"config.json: expert_selection_fn = 'relu' is not supported \(softmax or sigmoid\)"),
    ("cohere2", lambda c: c.update(logit_scale=0), r"config.json: logit_scale = 0 is not supported \(a positive number\)"),
    ("minimax_m3_vl_text", lambda c: c.update(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     r"config.json: layer_types = .* is not supported \(one of full_attention / minimax_m3_sparse per layer\)"),
    ("minimax_m3_vl_text", lambda c: c.update(mlp_layer_types=["dense", "sparse"]), r"config.json: mlp_layer_types = .* is not supported"),
    ("minimax_m3_vl_text", lambda c: c["rope_parameters"].update(rope_type="linear", factor=2.0),
     r"config.json: rope type 'linear' is not supported for minimax_m3_vl_text \(plain RoPE\)"),
    ("minimax_m3_vl_text", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1"),
    ("minimax_m3_vl_text", lambda c: c.update(index_n_heads=1), r"index_heads: block-sparse attention's indexer has one head per kv head, expected "
                                                              r"n_kv_heads = 2, got 1"),
    ("minimax_m3_vl_text", lambda c: c.update(index_local_blocks=3), r"index_local_blocks: expected an int in \[0, index_topk_blocks = 2\]"),
    ("cohere2", lambda c: c.update(attention_bias=True), r"config.json: attention_bias = True is not supported"),
    ("axk1", lambda c: c.update(q_lora_rank=None), r"config.json: q_lora_rank = None is not supported \(A.X-K1's queries always come from a latent\)"),
    ("laguna", lambda c: c.update(num_attention_heads_per_layer=[4, 8, 4]),
     r"config.json: num_attention_heads_per_layer = \[4, 8, 4\] is not supported \(one head count for the full layers and one for the sliding"),
    ("laguna", lambda c: c.update(num_attention_heads_per_layer=[4, 8]),
     r"config.json: num_attention_heads_per_layer = \[4, 8\] is not supported \(one count per layer\)"),
    ("laguna", lambda c: c.update(moe_router_score_func="sqrtsoftplus"),
     r"config.json: moe_router_score_func = 'sqrtsoftplus' is not supported \(sigmoid router scores\)"),
    ("laguna", lambda c: c.update(gating="per-channel"), r"config.json: gating = 'per-channel' is not supported"),
    ("laguna", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="linear", factor=2.0),
     r"config.json: rope_parameters.full_attention = .* is not supported \(plain RoPE in each layer type, or YaRN in the full layers\)"),
    ("laguna", lambda c: c["rope_parameters"].pop("sliding_attention"),
     r"config.json: rope_parameters has no sliding_attention entry for the sliding_attention layers"),
    ("laguna", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                                        mscale=1.0, mscale_all_dim=1.0),
     r"config.json: mscale_all_dim = 1.0 is not supported \(YaRN without mscale_all_dim"),
    ("laguna", lambda c: c.update(moe_apply_router_weight_on_input=True), r"config.json: moe_apply_router_weight_on_input = True is not supported"),
    ("laguna", lambda c: c.update(num_experts_per_tok=1), r"config.json: num_experts_per_tok = 1 is not supported \(k > 1: this family renormalises"),
    ("mixtral", lambda c: c.pop("vocab_size"), r"config.json: a mixtral config without vocab_size is not supported"),
    ("mixtral", lambda c: c.update(hidden_size=16),
     r"checkpoint: model.embed_tokens.weight gives embed the shape \(64, 32\), the model expects \(64, 16\)"),
    ("mixtral", lambda c: c.update(num_hidden_layers=4), r"checkpoint: missing key 'model.layers.3"),
]


def test_bad_checkpoints_name_the_key_or_field(folders, tmp_path):
    for i, (family, edit, match) in enumerate(BAD_CONFIGS):
        with pytest.raises(ValueError, match=match):
            hf.from_pretrained(_edit(folders[family][0], tmp_path / f"bad{i}", edit))
    path = folders["mixtral"][0]
    # an option the family's checkpoints cannot hold is refused, not left at its initial value
    with pytest.raises(ValueError, match=r"model: 9 parameter\(s\) that a mixtral checkpoint does not hold, e.g. 'blocks.0.mlp.experts.b_gate'"):
        hf.from_pretrained(path, expert_biases=True)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    for read in (hf.from_pretrained, hf.is_hf_folder):  # examples/generate.py asks is_hf_folder first
        with pytest.raises(ValueError, match=r"config.json: '.*config.json' is not valid JSON \(JSONDecodeError: Expecting property name"):
            read(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: '.*config.json' holds a list, not a JSON object of fields"):
        hf.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"^moe_layers: .* \(the config of '.*qwen2_moe.*' with the options n_layers=1, norm_eps=1e-05\)$"):
        hf.from_pretrained(folders["qwen2_moe"][0], n_layers=1, norm_eps=1e-5)  # its MoE layers 1, 2 past n_layers=1: the options named
    with pytest.raises(ValueError, match="strict: expected a bool, got 'no'"):  # not truthy
        hf.from_pretrained(path, strict="no")
    model, _ = hf.from_pretrained(path)
    with pytest.raises(ValueError, match="strict: expected a bool, got 0"):
        hf.load_weights(model, path, model_type="mixtral", strict=0)
    del model.hf_config
    with pytest.raises(ValueError, match="model_type: needed"):
        hf.save_pretrained(model, tmp_path / "e")
    with pytest.raises(ValueError, match="model_type: expected one of"):
        hf.save_pretrained(model, tmp_path / "e", model_type="bert")


def test_checkpoint_keys_the_model_does_not_read_are_refused_unless_not_strict(folders, tmp_path):
    """A key the config reads nowhere would be dropped without a word: refused by name
    before anything is read; strict=False loads the rest. Keys that come with a read one,
    RoPE's inv_freq, a tied lm_head and MTP depths left out on purpose are not counted."""
    hunyuan, _ = folders["hunyuan_v1_moe"]
    with pytest.raises(ValueError, match=r"checkpoint: 9 key\(s\) in .* that the model's config reads nowhere, e.g. "
                                         r"'model.layers.0.mlp.shared_mlp.down_proj.weight' \(an option that leaves out part"):
        hf.from_pretrained(hunyuan, n_shared=0)
    full, _ = hf.from_pretrained(hunyuan)
    part, cfg = hf.from_pretrained(hunyuan, n_shared=0, strict=False)
    assert cfg.shared_size == 0
    shared = {n for n in full.state_dict() if ".mlp.shared." in n}
    assert shared and all(torch.equal(t, full.state_dict()[n]) for n, t in part.state_dict().items())
    assert set(full.state_dict()) - set(part.state_dict()) == shared
    # an unknown key, refused before any parameter is written
    mixtral, _ = folders["mixtral"]
    tensors = _read_all(mixtral)
    extra = _copy_folder(mixtral, tmp_path / "extra", {**tensors, "model.layers.1.mlp.extra.weight": torch.ones(2)})
    model, cfg = hf.from_pretrained(mixtral)
    blank = type(model)(cfg)
    with torch.no_grad():
        for t in blank.parameters():
            t.zero_()
    with pytest.raises(ValueError, match=r"checkpoint: 1 key\(s\) .* e.g. 'model.layers.1.mlp.extra.weight'"):
        hf.load_weights(blank, extra, model_type="mixtral")
    assert all(not t.any() for t in blank.parameters())
    hf.load_weights(blank, extra, model_type="mixtral", strict=False)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in blank.state_dict().items())
    # not counted: RoPE's inv_freq buffers, an lm_head that config.json ties to the embedding
    granite, _ = folders["granitemoe"]
    g = _read_all(granite)
    assert "lm_head.weight" not in g
    kept = _copy_folder(granite, tmp_path / "tied", {**g, "lm_head.weight": g["model.embed_tokens.weight"].clone(),
                                                     "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    assert all(torch.equal(a, b) for a, b in zip(hf.from_pretrained(kept)[0].parameters(), hf.from_pretrained(granite)[0].parameters()))
    # a tied lm_head stored with other values: transformers reads it untied; refused, not silently the embedding
    head = g["model.embed_tokens.weight"] + 1.0
    other = _copy_folder(granite, tmp_path / "tied_other", {**g, "lm_head.weight": head})
    with pytest.raises(ValueError, match=r"checkpoint: .* holds a lm_head.weight that differs from its model.embed_tokens.weight, "
                                         r"but config.json ties them .* from_pretrained\(path, tie_embeddings=False\)"):
        hf.from_pretrained(other)
    untied, cfg = hf.from_pretrained(other, tie_embeddings=False)
    assert not cfg.tie_embeddings and torch.equal(untied.head, head) and torch.equal(untied.embed, g["model.embed_tokens.weight"])
    tied = hf.from_pretrained(other, strict=False)[0]
    assert tied.head is None and torch.equal(tied.embed, g["model.embed_tokens.weight"])
    # EXAONE's MTP layers (mtp.*) are not read, as transformers does not read them
    exaone, _ = folders["exaone_moe"]
    e = _read_all(exaone)
    mtp = _copy_folder(exaone, tmp_path / "mtp", {**e, "mtp.layers.0.eh_proj.weight": torch.ones(32, 64), "mtp.norm.weight": torch.ones(32)})
    assert all(torch.equal(a, b) for a, b in zip(hf.from_pretrained(mtp)[0].parameters(), hf.from_pretrained(exaone)[0].parameters()))
    assert hf.unread_keys(hf.FAMILIES["mixtral"], cfg, mixtral, {"mtp.norm.weight": None}) == ["mtp.norm.weight"]  # other families count them
    # HY-V3's MTP layer, the layer after the trunk's, is not read either (transformers ignores it); other families count it
    hy, _ = folders["hy_v3"]
    h = _read_all(hy)
    mtp = _copy_folder(hy, tmp_path / "hy-mtp", {**h, "model.layers.3.eh_proj.weight": torch.ones(32, 64), "model.layers.3.enorm.weight": torch.ones(32)})
    assert all(torch.equal(a, b) for a, b in zip(hf.from_pretrained(mtp)[0].parameters(), hf.from_pretrained(hy)[0].parameters()))
    assert hf.unread_keys(hf.FAMILIES["mixtral"], cfg, mixtral, {"model.layers.3.enorm.weight": None}) == ["model.layers.3.enorm.weight"]
    # an untied head that a tie_embeddings override would drop is refused
    with pytest.raises(ValueError, match=r"checkpoint: 1 key\(s\) .* e.g. 'lm_head.weight'"):
        hf.from_pretrained(mixtral, tie_embeddings=True)
    assert hf.unread_keys(hf.FAMILIES["mixtral"], cfg, mixtral, tensors) == []


@pytest.mark.parametrize("family, no_shared", [("glm4_moe", "n_shared_experts"), ("qwen2_moe", "shared_expert_intermediate_size")])
def test_a_shared_mlp_of_no_rows_loads_strictly_and_is_written_back(family, no_shared, tmp_path):
    """transformers builds and saves a shared MLP of 0 rows where the config has no shared
    experts (GLM-4.5's n_shared_experts=0, Qwen2-MoE's shared_expert_intermediate_size=0;
    Qwen2-MoE's sigmoid gate [1, H] on its zeros too): it acts on nothing, so a strict load
    does not refuse it as unread; it is written back as stored (bit-identical files), and
    transformers reads the export whole with the folder's logits."""
    config = FAMILIES[family]()
    setattr(config, no_shared, 0)
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    assert any(t.numel() == 0 for k, t in _read_all(tmp_path / "hf").items() if ".shared_expert" in k)  # what the test is about
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.shared_size == 0
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), want) < 1e-5
    hf.save_pretrained(model, tmp_path / "again")
    assert all(filecmp.cmp(tmp_path / "hf" / f, tmp_path / "again" / f, shallow=False) for f in ("config.json", "model.safetensors"))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert _rel(_their_logits(back.eval(), docs), want) < 1e-5


def _loop_from_folder(config, tmp_path, *knobs):
    """A random model of `config` (or that transformers model) saved by transformers, the loop
    run 2 steps from it (64-token micro-batches of the stdlib corpus, one per step) with these
    knobs: (its metrics records, its standard output, the folder model's own loss on the first
    step's micro-batch)."""
    import pathlib
    import subprocess
    import sys

    from fmoe.train.data import Sampler, load_corpus

    torch.manual_seed(0)
    made = config if isinstance(config, transformers.PreTrainedModel) else transformers.AutoModelForCausalLM.from_config(config)
    made.save_pretrained(tmp_path / "hf")
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run'}", *knobs,
                          "--steps=2", "--tokens_per_micro_batch=64", "--batch_schedule=0:1", "--eval_every=2", "--eval_batches=1",
                          "--model.mtp_depth=0", "--model.impl=torch", "--lr=1e-2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    model, _ = hf.from_pretrained(tmp_path / "hf", impl="torch")
    train, _ = load_corpus(None).split(5)
    batch = Sampler(train, 64, seed=0, mtp_depth=0).next_batch()
    with torch.no_grad():
        losses, _ = model(batch)
    return records, run.stdout, float(losses["lm_sum"] / losses["lm_tokens"])


def test_the_loop_fine_tunes_a_loaded_model(tmp_path):
    """--init_from_hf: the released model's config and weights; the first step's logged loss
    is that model's loss on the step's micro-batch, and a step trains it."""
    import pathlib
    import subprocess
    import sys

    config = transformers.Qwen3MoeConfig(**{**COMMON, "vocab_size": 260}, head_dim=8, intermediate_size=40, moe_intermediate_size=24,
                                         num_experts=4, num_experts_per_tok=2)
    records, _, loss = _loop_from_folder(config, tmp_path, f"--init_from_hf={tmp_path / 'hf'}")
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]
    root = pathlib.Path(__file__).resolve().parents[1]
    # a corpus whose ids do not fit the model's vocabulary is refused, naming the knob
    small = tmp_path / "small"
    transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"]()).save_pretrained(small)
    run = subprocess.run([sys.executable, str(root / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run2'}", f"--init_from_hf={small}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "--init_from_hf: the data's 258 token ids do not fit the model's vocab_size 64" in run.stderr
    # the MTP depth is the folder's own (none), not the loop's default of 1: a fresh module's loss trained the released trunk
    run = subprocess.run([sys.executable, str(root / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'run3'}",
                          f"--init_from_hf={tmp_path / 'hf'}", "--steps=1", "--tokens_per_micro_batch=64", "--batch_schedule=0:1",
                          "--eval_every=2", "--eval_batches=1", "--model.impl=torch"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "run3" / "metrics.jsonl").read_text())
    assert json.loads((tmp_path / "run3" / "config.json").read_text())["config"]["model"]["mtp_depth"] == 0
    assert record["loss"] == pytest.approx(records[0]["loss"], rel=1e-6) and not any(k.startswith("mtp") for k in record), sorted(record)


def test_the_loop_fine_tunes_a_loaded_deepseek_v4_model(tmp_path):
    """--init_from_hf of a DeepSeek-V4 folder (its sliding layers): the streams, the hashed block reading the micro-batch's
    token ids, the sqrt(softplus) blocks' bias update; the first step's loss is the folder model's own, the second moves."""
    config = FAMILIES["deepseek_v4"]()
    config.vocab_size = 260
    torch.manual_seed(0)
    made = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        made.model.layers[0].mlp.gate.tid2eid.copy_(torch.rand(260, 8).argsort(dim=1)[:, :3])
    records, _, loss = _loop_from_folder(made, tmp_path, f"--init_from_hf={tmp_path / 'hf'}")
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert records[1]["loss"] != records[0]["loss"]


def test_the_loop_keeps_a_loaded_model_s_architecture_and_applies_its_run_knobs(tmp_path):
    """--init_from_hf with --model knobs: one that changes the folder's architecture is refused
    (it was ignored without a word), one of how it runs and trains (a capacity factor) applies."""
    from tests.exits import exits

    config = transformers.Qwen3MoeConfig(**{**COMMON, "vocab_size": 260}, head_dim=8, intermediate_size=40, moe_intermediate_size=24,
                                         num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
    run = ["--steps=1", "--tokens_per_micro_batch=64", "--batch_schedule=0:1", "--eval_batches=0", "--model.mtp_depth=0", "--model.impl=torch"]
    got = exits(script, [[f"--init_from_hf={tmp_path / 'hf'}", "--model.n_layers=5", f"--out_dir={tmp_path / 'a'}"],
                         [f"--init_from_hf={tmp_path / 'hf'}", "--model.capacity_factor=1.5", f"--out_dir={tmp_path / 'b'}", *run]])
    assert got[0]["status"] != 0
    assert "--model.n_layers=5: the model of --init_from_hf keeps its own architecture (n_layers = 3 in its config.json)" in got[0]["text"]
    assert "--model.capacity_factor" in got[0]["text"]  # the knobs that do apply are named
    assert got[1]["status"] == 0, got[1]["text"]
    saved = json.loads((tmp_path / "b" / "config.json").read_text())["config"]["model"]
    assert saved["capacity_factor"] == 1.5 and saved["n_layers"] == 3


def test_the_loop_warms_up_fresh_indexers_on_a_deepseek_v3_model(tmp_path):
    """DeepSeek-V3.2's dense warm-up from a DeepSeek-V3 folder: --init_from_hf with DeepSeek
    sparse attention's knobs (fresh indexers; index_topk over the whole micro-batch: dense)
    and --train_only=[.]index_: the first step's loss is the folder model's own, the indexer
    loss is logged, and only the indexers' weights move."""
    from fmoe.train.checkpoint import load_run

    config = FAMILIES["deepseek_v3"]()
    config.vocab_size = 260
    records, _, loss = _loop_from_folder(config, tmp_path, f"--init_from_hf={tmp_path / 'hf'}", "--model.index_topk=64",
                                         "--model.index_heads=4", "--model.index_head_dim=8", "--train_only=[.]index_")
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert all(r["index_loss"] > 0 for r in records[:2])
    trained, _ = load_run(tmp_path / "run")
    start, _ = hf.from_pretrained(tmp_path / "hf", impl="torch", mtp_depth=0, index_topk=64, index_heads=4, index_head_dim=8)
    start.reset_parameters(seed=0)  # the fresh indexers as the run drew them (its --seed), then the folder's weights
    hf.load_weights(start, tmp_path / "hf", model_type="deepseek_v3")
    moved = {name for name, p in trained.named_parameters() if not torch.equal(p, start.get_parameter(name))}
    assert moved and all(".index_" in name for name in moved), sorted(moved)[:5]
    # the frozen MoE layers' expert biases too (each step's bias update moved them: their routing drifted)
    biases = {name: b for name, b in trained.named_buffers() if name.endswith("expert_bias")}
    assert biases and all(torch.equal(b, start.get_buffer(name)) for name, b in biases.items())
    # written as a DeepSeek-V3.2 folder (not as the DeepSeek-V3 folder's config, which it no longer fits) that transformers reads
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    import export_hf

    with pytest.raises(SystemExit, match="is not the run's model"):
        export_hf.main([str(tmp_path / "run"), str(tmp_path / "v3")])
    export_hf.main([str(tmp_path / "run"), str(tmp_path / "v32"), "--model_type=deepseek_v32"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v32", dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(trained.logits(ids, cu), torch.cat([back(d[None]).logits[0] for d in docs])) < 1e-5
    # an indexer's knob without index_topk: no indexer would be built, so the knob is refused as on a model of the loop's own
    import train_moe

    with pytest.raises(SystemExit, match=r"^--model.index_heads=4: a knob of a sparse attention's indexer, needs index_topk, index_topk_blocks "
                                         r"or csa_layers; this model has none, so it would have no effect$"):
        train_moe.main([f"--out_dir={tmp_path / 'inert'}", f"--init_from_hf={tmp_path / 'hf'}", "--model.index_heads=4"])


@pytest.mark.parametrize("family, knobs, logged, floor", [
    ("deepseek_v32", dict(index_topk=8), "index_loss", 0.0),  # sparse attention: the documents are longer than index_topk = 8
    ("minimax_m3_vl_text", {}, "index_loss", 0.0),  # block-sparse attention: two blocks of 3 keys of the micro-batch's documents
    ("deepseek_v4", {}, "index_loss", 0.0),  # compressed sparse attention: its indexer's loss over the chosen entries
    ("jetmoe", {}, "moa_aux_loss", 0.5),  # each token's attention experts; their routers' balance loss, about 1
])
def test_the_loop_fine_tunes_a_model_and_the_loss_its_attention_trains_by(family, knobs, logged, floor, tmp_path):
    """--init_from_hf of a folder whose attention trains by a loss of its own: the first step's
    loss is the folder model's own, and that loss is logged each step: DeepSeek-V3.2's,
    MiniMax-M3's and DeepSeek-V4's CSA indexers' (their weights trained by it), JetMoE's
    attention routers' balance."""
    config = FAMILIES[family]()
    config.vocab_size = 260
    for name, value in knobs.items():
        setattr(config, name, value)
    records, _, loss = _loop_from_folder(config, tmp_path, f"--init_from_hf={tmp_path / 'hf'}")
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert all(math.isfinite(r[logged]) and r[logged] > floor for r in records[:2])


def test_the_loop_upcycles_a_released_dense_model(tmp_path):
    """--upcycle_from a Qwen3 folder: its config made an MoE by the knobs given (layer 0
    dense, then 4 experts of half its FFN, k = 2); the first step's logged loss is the dense
    model's own on the step's micro-batch."""
    config = transformers.Qwen3Config(**{**COMMON, "vocab_size": 260}, head_dim=8, intermediate_size=40)
    records, out, loss = _loop_from_folder(config, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert "4 experts, each a slice of 1/2 of its FFN" in out
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    assert records[0]["tokens_per_expert"][0] and records[1]["loss"] != records[0]["loss"]
    # the folder's vocabulary stays: a corpus whose ids do not fit it is refused, naming the knob
    import pathlib
    import subprocess
    import sys

    small = tmp_path / "small"
    transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3"]()).save_pretrained(small)
    run = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"),
                          f"--out_dir={tmp_path / 'run2'}", f"--upcycle_from={small}", "--model.n_dense=1", "--model.ffn_expert=20"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "--upcycle_from: the data's 258 token ids do not fit the model's vocab_size 64" in run.stderr


def test_the_loop_upcycles_a_released_cohere2_folder(tmp_path):
    """--upcycle_from a Cohere 2 folder (Command A's blocks: the attention and the MLP of one
    LayerNorm, RoPE in the sliding layers only, the logits scaled): the MoE made from it keeps
    its parallel blocks, and the first step's logged loss is the dense model's own."""
    config = transformers.Cohere2Config(**{**COMMON, "vocab_size": 260}, head_dim=8, intermediate_size=40, sliding_window=4, logit_scale=0.5,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"], bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None)
    records, out, loss = _loop_from_folder(config, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert "4 experts, each a slice of 1/2 of its FFN" in out
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5) and records[1]["loss"] != records[0]["loss"]
    model = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["model"]
    assert model["parallel_blocks"] and model["layer_norms"] and model["nope_layers"] == [1]


def test_the_loop_upcycles_a_released_falcon_h1_folder(tmp_path):
    """--upcycle_from a Falcon-H1 folder (its multipliers folded into the weights as read):
    the MoE made from it keeps a Mamba-2 mixer beside the attention in every block, and the
    first step's logged loss is the dense model's own."""
    config = FAMILIES["falcon_h1"]()
    config.vocab_size = 260
    records, out, loss = _loop_from_folder(config, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert "4 experts, each a slice of 1/2 of its FFN" in out
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5) and records[1]["loss"] != records[0]["loss"]
    model = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["model"]
    assert model["parallel_hybrid"] and model["linear_layers"] == [0, 1, 2] and model["linear_gate_norm"] == "before"


def test_the_loop_upcycles_a_released_qwen2_5_vl_folder(tmp_path):
    """--upcycle_from a Qwen2.5-VL folder: its Qwen2 text model made an MoE (the vision model
    left unread); the first step's logged loss is the dense text model's own."""
    text = dict(vocab_size=260, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[1, 1, 2]))
    vision = dict(depth=1, hidden_size=16, embed_dim=16, num_heads=2, out_hidden_size=32, intermediate_size=16, patch_size=14)
    torch.manual_seed(0)
    made = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    records, out, loss = _loop_from_folder(made, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert "4 experts, each a slice of 1/2 of its FFN" in out
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5) and records[1]["loss"] != records[0]["loss"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["model"]["qkv_bias"]


def test_the_loop_upcycles_a_released_olmo3_folder(tmp_path):
    """--upcycle_from an OLMo 3 folder: its post-norm blocks, sliding windows with plain RoPE
    beside YaRN in the full layer, kept in the MoE the knobs make (block 0 dense, then 4
    experts of half its FFN, k = 2); the first step's logged loss is the dense model's own."""
    config = FAMILIES["olmo3"]()
    config.vocab_size = 260
    records, out, loss = _loop_from_folder(config, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert "4 experts, each a slice of 1/2 of its FFN" in out
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5) and records[0]["tokens_per_expert"][0]
    run = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["model"]
    assert (run["window_layers"], run["local_rope_base"], run["yarn_factor"], run["post_norms"], run["n_experts"]) == ([0, 2], 5e5, 4.0, True, 4)


def test_the_loop_upcycles_a_released_ministral3_folder(tmp_path):
    """--upcycle_from a released Mistral 3 folder of Ministral 3 (its text model under
    language_model., YaRN and the query scale; the vision model unread): the first step's
    logged loss is the dense text model's own, the MoE's query scale the folder's."""
    text = FAMILIES["ministral3"]()
    text.vocab_size = 260
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)
    torch.manual_seed(0)
    folder = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision,
                                                                                       tie_word_embeddings=False))
    records, out, loss = _loop_from_folder(folder, tmp_path, f"--upcycle_from={tmp_path / 'hf'}", "--model.n_dense=1", "--model.n_experts=4",
                                           "--model.k=2", "--model.ffn_expert=20")
    assert records[0]["loss"] == pytest.approx(loss, rel=1e-5)
    model = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["model"]
    assert (model["query_temperature_floor"], model["query_temperature_scale"], model["n_experts"]) == (4, 0.5, 4)


def _copy_folder(src, dst, tensors, config_change=None):
    """dst: src's config (changed) and these tensors as model.safetensors."""
    from safetensors.torch import save_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_change:
        config_change(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _family_config(family: str) -> TransformerConfig:
    """fmoe's config of the tiny test model of `family` (FAMILIES), read from its HF config."""
    return TransformerConfig(**hf.FAMILIES[family].kwargs(FAMILIES[family]().to_dict()))


def _read_all(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _beside_the_rest(folder, text, dst, text_config, rename=lambda key: key):
    """transformers' logits of a text-only forward over _packed's documents of the text model
    in folder `text` (fmoe's export, each key renamed by `rename`) put back beside the keys of
    the multimodal `folder` its family does not read (its vision or audio towers), with
    `text_config` as the whole model's text_config, in dst."""
    not_read = hf.FAMILIES[json.loads((folder / "config.json").read_text())["model_type"]].not_read
    rest = {k: v for k, v in _read_all(folder).items() if k.startswith(not_read)}
    tensors = {rename(k): v for k, v in _read_all(text).items()} | rest
    whole = _copy_folder(folder, dst, tensors, lambda c: c.update(text_config=text_config))
    ref = transformers.AutoModelForImageTextToText.from_pretrained(whole, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([ref(input_ids=d[None]).logits[0] for d in _packed()[0]])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite"])
def test_mtp_layers_load_into_mtp_modules_and_export_back(family, folders, tmp_path):
    """DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash keep MTP depth d as layer n_layers + d - 1 (enorm, hnorm,
    eh_proj, a MoE block, shared_head.norm, and copies of the embedding and head)."""
    path, _ = folders[family]
    tensors = _read_all(path)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(3)
    mtp = {}
    for key, t in tensors.items():  # the MTP block: a copy of the last (MoE) block's keys, new values
        if key.startswith(f"model.layers.{n - 1}."):
            mtp[key.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = t + 0.1 * torch.randn(t.shape, generator=g)
    p = f"model.layers.{n}."
    H = tensors["model.norm.weight"].shape[0]
    mtp.update({p + "enorm.weight": 1 + 0.3 * torch.randn(H, generator=g), p + "hnorm.weight": 1 + 0.3 * torch.randn(H, generator=g),
                p + "eh_proj.weight": 0.3 * torch.randn(H, 2 * H, generator=g), p + "shared_head.norm.weight": 1 + 0.3 * torch.randn(H, generator=g),
                p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(), p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    folder = _copy_folder(path, tmp_path / "mtp", {**tensors, **mtp})
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert cfg.mtp_depth == 1 and cfg.mtp_norm
    m = model.mtp[0]
    assert torch.equal(m.proj, mtp[p + "eh_proj.weight"].t()) and torch.equal(m.emb_norm.weight, mtp[p + "enorm.weight"])
    assert torch.equal(m.hidden_norm.weight, mtp[p + "hnorm.weight"]) and torch.equal(m.out_norm.weight, mtp[p + "shared_head.norm.weight"])
    assert torch.equal(m.block.mlp.expert_bias, mtp[p + "mlp.gate.e_score_correction_bias"])
    assert torch.equal(m.block.mlp.experts.w_up[1], mtp[p + "mlp.experts.1.up_proj.weight"].t())
    # the MTP loss uses the depth's own norm: changing the trunk's final norm leaves the
    # depth's hidden states alone, yet its loss follows out_norm
    _, ids, cu = _packed()
    batch = make_batch(ids, cu, mtp_depth=1)
    with torch.no_grad():
        before = model(batch)[0]["mtp_1_sum"]
        m.out_norm.weight.mul_(2.0)
        after = model(batch)[0]["mtp_1_sum"]
        m.out_norm.weight.div_(2.0)
    assert float(before) != float(after)
    hf.save_pretrained(model, tmp_path / "again")
    assert filecmp.cmp(folder / "model.safetensors", tmp_path / "again" / "model.safetensors", shallow=False)
    # asking for fewer depths loads fewer; a checkpoint without them leaves fresh ones
    assert hf.from_pretrained(folder, mtp_depth=0)[1].mtp_depth == 0
    assert hf.from_pretrained(path)[1].mtp_depth == 0
    fresh, _ = hf.from_pretrained(path, mtp_depth=1)
    assert torch.isfinite(fresh.mtp[0].proj).all() and not torch.equal(fresh.mtp[0].proj, m.proj)


def test_config_json_counts_the_mtp_depths_written(tmp_path):
    """A loaded config's count of MTP modules (num_nextn_predict_layers; Qwen3-Next's
    mtp_num_hidden_layers) is written as the depths save_pretrained writes, where the model
    has other depths than its folder held (mtp_depth=0 or 2 of a folder of 1; 1 of a folder
    whose config has no count: transformers' GLM-4.7-Flash and Qwen3-Next configs). With the
    folder's own depths from_pretrained's model keeps the count as loaded: transformers'
    DeepSeek-V3 folder says 1 beside no MTP layer, and is written back bit-identical; so does a
    model whose weights load_weights read from it, or that keep_folder_layout gave its layout (a
    run's, examples/export_hf.py); with other depths than that folder's they are counted."""
    n = FAMILIES["deepseek_v3"]().num_hidden_layers
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FAMILIES["deepseek_v3"]()).save_pretrained(tmp_path / "tf")
    assert json.loads((tmp_path / "tf" / "config.json").read_text())["num_nextn_predict_layers"] == 1  # transformers' default
    hf.save_pretrained(hf.from_pretrained(tmp_path / "tf", impl="torch")[0], tmp_path / "as_loaded")
    assert filecmp.cmp(tmp_path / "tf" / "config.json", tmp_path / "as_loaded" / "config.json", shallow=False)
    config, cfg = hf.read_config(tmp_path / "tf")
    read = Transformer(dataclasses.replace(cfg, mtp_depth=0, impl="torch"))  # the weights read by load_weights (a sharded load's way)
    hf.load_weights(read, tmp_path / "tf", model_type="deepseek_v3")
    read.hf_config = config
    assert filecmp.cmp(tmp_path / "tf" / "config.json", hf.save_pretrained(read, tmp_path / "read") / "config.json", shallow=False)
    hf.save_pretrained(hf.from_pretrained(tmp_path / "tf", impl="torch", mtp_depth=1)[0], tmp_path / "released")  # a fresh MTP layer
    run = Transformer(dataclasses.replace(cfg, mtp_depth=0, impl="torch"))  # a run's model of no MTP depth from a folder of one
    run.hf_config = json.loads((tmp_path / "released" / "config.json").read_text())
    hf.keep_folder_layout(run, tmp_path / "released", "deepseek_v3")
    assert json.loads((hf.save_pretrained(run, tmp_path / "run") / "config.json").read_text())["num_nextn_predict_layers"] == 0
    for depth in (0, 1, 2):
        model, _ = hf.from_pretrained(tmp_path / "released", impl="torch", mtp_depth=depth)
        out = hf.save_pretrained(model, tmp_path / f"depth{depth}")
        layers = {int(key.split(".")[2]) for key in _read_all(out) if key.startswith("model.layers.")}
        assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == depth and max(layers) == n - 1 + depth
        assert hf.from_pretrained(out, impl="torch")[1].mtp_depth == depth
    assert all(filecmp.cmp(tmp_path / "released" / f, tmp_path / "depth1" / f, shallow=False) for f in ("config.json", "model.safetensors"))
    for family, count in (("glm4_moe_lite", "num_nextn_predict_layers"), ("qwen3_next", "mtp_num_hidden_layers")):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).save_pretrained(tmp_path / family)
        assert count not in json.loads((tmp_path / family / "config.json").read_text())
        one = hf.save_pretrained(hf.from_pretrained(tmp_path / family, impl="torch", mtp_depth=1)[0], tmp_path / f"{family}-1")
        assert json.loads((one / "config.json").read_text())[count] == 1 and hf.from_pretrained(one, impl="torch")[1].mtp_depth == 1
        none = hf.save_pretrained(hf.from_pretrained(one, impl="torch", mtp_depth=0)[0], tmp_path / f"{family}-0")
        assert json.loads((none / "config.json").read_text())[count] == 0 and hf.from_pretrained(none, impl="torch")[1].mtp_depth == 0


def test_an_mtp_module_on_the_final_norm_exports_with_a_copy_of_it(folders, tmp_path):
    """An MTP module without its own output norm (mtp_norm=False: its loss goes through the
    trunk's final norm) is written with a copy of the final norm as its shared_head.norm:
    the folder reads back (mtp_norm=True) as the same model, MTP loss included."""
    from fmoe.model import Transformer

    path, _ = folders["glm4_moe"]
    loaded, cfg = hf.from_pretrained(path, mtp_depth=1, impl="torch")
    model = Transformer(dataclasses.replace(cfg, mtp_norm=False))
    state = {k: v for k, v in loaded.state_dict().items() if k != "mtp.0.out_norm.weight"}
    state["norm.weight"] = 1 + 0.3 * torch.randn(cfg.hidden, generator=torch.Generator().manual_seed(5))  # not the ones of a fresh norm
    model.load_state_dict(state)
    out = hf.save_pretrained(model, tmp_path / "out", model_type="glm4_moe")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert torch.equal(_read_all(out)[f"model.layers.{cfg.n_layers}.shared_head.norm.weight"], state["norm.weight"])
    back, back_cfg = hf.from_pretrained(out, impl="torch")
    assert back_cfg.mtp_depth == 1 and back_cfg.mtp_norm and torch.equal(back.mtp[0].out_norm.weight, model.norm.weight)
    _, ids, cu = _packed()
    batch = make_batch(ids, cu, mtp_depth=1)
    with torch.no_grad():
        want, got = model(batch)[0], back(batch)[0]
    assert set(got.keys()) == set(want.keys()) == {"lm_sum", "lm_tokens", "mtp_1_sum", "mtp_1_tokens"}
    for key in want.keys():
        assert torch.equal(got[key], want[key]), key
    with pytest.raises(ValueError, match=r"shared_head\.norm\.weight"):  # read into mtp_norm=False, its norm would be lost
        hf.load_weights(Transformer(model.cfg), out, model_type="glm4_moe")


def _fp8(w, block, *, pow2=False):
    """Block-scaled FP8 of a float32 weight [out, in] and its scale_inv (amax / 448 per block); pow2: DeepSeek-V4's, each
    block's scale the power of two at or above amax / 448, stored as float8_e8m0fnu."""
    m, n = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // m), -(-cols // n))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * m:(i + 1) * m, j * n:(j + 1) * n]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            if pow2:
                scale[i, j] = torch.exp2(torch.ceil(torch.log2(scale[i, j])))
            q[i * m:(i + 1) * m, j * n:(j + 1) * n] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return (q, scale.to(torch.float8_e8m0fnu)) if pow2 else (q, scale)


def _matches_the_dequantised_model(model, path, tensors, dequantised, tmp_path):
    """model (loaded from a quantised copy of the folder `path`) has the logits of
    transformers' model of the dequantised weights, and exports them dequantised, without
    the quantisation config; returns the exported tensors."""
    plain = _copy_folder(path, tmp_path / "dequantised", {**tensors, **dequantised})
    reference = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        docs, ids, cu = _packed()
        theirs = torch.cat([reference(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    hf.save_pretrained(model, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    out = _read_all(tmp_path / "out")
    assert all(torch.equal(out[k], v) for k, v in dequantised.items())
    return out


def test_fp8_block_scaled_checkpoints_are_dequantised(folders, tmp_path):
    """DeepSeek-V3's released layout: linear weights in float8_e4m3fn with a float32
    weight_scale_inv per 8x8 block here (edge blocks cut: 20 and 44 are not multiples of 8)."""
    path, ref = folders["deepseek_v3"]
    tensors = _read_all(path)
    block = (8, 8)
    quantised, dequantised = {}, {}
    for key, t in tensors.items():
        if key.endswith("proj.weight") and t.ndim == 2:
            q, s = _fp8(t, block)
            quantised[key], quantised[key.removesuffix("weight") + "weight_scale_inv"] = q, s
            dequantised[key] = torch.stack([torch.stack([q[r, c].float() * s[r // 8, c // 8] for c in range(t.shape[1])]) for r in range(t.shape[0])])
        else:
            quantised[key] = t
    assert any(not torch.equal(dequantised[k], tensors[k]) for k in dequantised)  # quantisation really rounded
    folder = _copy_folder(path, tmp_path / "fp8", quantised,
                          lambda c: c.update(quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                                      weight_block_size=list(block))))
    model, _ = hf.from_pretrained(folder, impl="torch")
    out = _matches_the_dequantised_model(model, path, tensors, dequantised, tmp_path)
    assert not any(k.endswith("scale_inv") for k in out)
    with pytest.raises(ValueError, match="quantization_config .* is not supported"):
        hf.from_pretrained(_edit(folder, tmp_path / "bad", lambda c: c.update(quantization_config=dict(quant_method="gptq"))))


def _fp4_e8m0(w, group=32):
    """DeepSeek-V4's FP4 expert weight of a float32 [out, in]: per row, each group of `group` columns (fewer where in is
    smaller) scaled by the power of two at or above amax / 6, rounded to the nearest e2m1 code, two codes a byte (the low
    nibble first) as int8 [out, in / 2]; the scales [out, in / group] float8_e8m0fnu."""
    n = min(group, w.shape[1])
    codes = torch.tensor(hf.FP4_E2M1)
    scale = torch.exp2(torch.ceil(torch.log2(w.view(w.shape[0], -1, n).abs().amax(-1).clamp_min(1e-12) / 6.0)))  # [out, in / n]
    x = w / scale.repeat_interleave(n, -1)
    nearest = (x[..., None] - codes).abs().argmin(-1).to(torch.uint8)  # [out, in] codes 0..15
    packed = (nearest[:, 0::2] | (nearest[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def test_deepseek_v4_fp8_weights_and_fp4_experts_are_dequantised(folders, tmp_path):
    """DeepSeek-V4's released layout: the attention's and the shared experts' projections in float8_e4m3fn with power-of-two
    float8_e8m0fnu scales per 2x2 block, the routed experts in FP4 (expert_dtype "fp4": int8 [out, in / 2], two e2m1 codes a
    byte, with a scale per row and 32 columns, fewer where the row is shorter; the indexer's wq_b in FP8 too), the
    compressors' projections and the indexer's weights_proj as they are. They load as transformers' own dequantisation (finegrained_fp8's Fp8Dequantize) gives them, the model has
    the logits of transformers' model of those weights, and the export writes them dequantised; an FP4 scale grid that does
    not tile its weight is refused."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    path, ref = folders["deepseek_v4"]
    tensors = _read_all(path)
    theirs = Fp8Dequantize(None)
    quantised, dequantised = {}, {}
    for key, t in tensors.items():
        fp8 = key.endswith((".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_b.weight")) or ".shared_experts.w" in key
        expert = ".experts." in key and ".shared_experts." not in key and key.endswith("weight")
        if fp8 or expert:
            q, scale = _fp4_e8m0(t) if expert else _fp8(t, (2, 2), pow2=True)  # blocks that tile every shape, as the releases' 128 x 128 do
            quantised[key], quantised[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantised[key] = theirs._dequantize_one(q, scale, torch.float32)
        else:
            quantised[key] = t
    assert any(k.endswith("experts.0.w1.weight") for k in dequantised) and any(k.endswith("attn.wkv.weight") for k in dequantised)
    assert all(not torch.equal(dequantised[k], tensors[k]) for k in dequantised)  # quantisation really rounded
    folder = _copy_folder(path, tmp_path / "fp4", quantised, lambda c: c.update(quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[2, 2], scale_fmt="ue8m0", expert_dtype="fp4")))
    model, _ = hf.from_pretrained(folder, impl="torch")
    out = _matches_the_dequantised_model(model, path, tensors, dequantised, tmp_path)
    assert not any(k.endswith("scale_inv") for k in out)
    key = next(k for k in dequantised if k.endswith("experts.0.w1.weight"))
    assert torch.equal(hf.dequantize_fp4(quantised[key], quantised[key.removesuffix("weight") + "weight_scale_inv"].view(torch.uint8)),
                       dequantised[key])  # the scales as biased uint8 exponents read the same
    with pytest.raises(ValueError, match=r"checkpoint: FP4 scales of shape \(12, 3\) do not tile a 12x32 weight"):
        hf.dequantize_fp4(quantised[key], torch.ones(12, 3))


def test_mxfp4_experts_are_dequantised(folders, tmp_path):
    """gpt-oss's released layout: the experts' gate_up_proj and down_proj as MXFP4 blocks and
    scales ([E, out, in/32, 16] and [E, out, in/32] uint8). They load as transformers'
    dequantisation gives them (convert_moe_packed_tensors), the model has the logits of
    transformers' model of those weights, and the export writes them dequantised."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, ref = folders["gpt_oss"]
    tensors = _read_all(path)
    g = torch.Generator().manual_seed(3)
    quantised, dequantised = {}, {}
    for key, t in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, n_in, n_out = t.shape  # [E, in, out]
            blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(122, 126, (E, n_out, n_in // 32), generator=g, dtype=torch.uint8)  # 2^-5 .. 2^-2
            quantised[key + "_blocks"], quantised[key + "_scales"] = blocks, scales
            dequantised[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert dequantised[key].shape == t.shape
        else:
            quantised[key] = t
    folder = _copy_folder(path, tmp_path / "mxfp4", quantised, lambda c: c.update(quantization_config=dict(quant_method="mxfp4")))
    model, _ = hf.from_pretrained(folder, impl="torch")
    for i in range(model.cfg.n_layers):
        experts, stored = model.blocks[i].mlp.experts, dequantised[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert torch.equal(experts.w_gate, stored[..., 0::2]) and torch.equal(experts.w_up, stored[..., 1::2])
        assert torch.equal(experts.w_down, dequantised[f"model.layers.{i}.mlp.experts.down_proj"])
    out = _matches_the_dequantised_model(model, path, tensors, dequantised, tmp_path)
    assert not any(k.endswith(("_blocks", "_scales")) for k in out)
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        hf.dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


def test_fp8_blocks_of_other_heights_than_widths_scale_their_own_rows_and_columns(tmp_path):
    """A 3x5 FP8 weight in 2x4 blocks (the edge blocks cut): each entry times its block's
    scale_inv, the rows' blocks 2 high and the columns' 4 wide, as weight_block_size [m, n]
    names them; the misfits are refused by name."""
    w = torch.ones(3, 5).to(torch.float8_e4m3fn)
    want = torch.tensor([[1.0, 1, 1, 1, 2], [1, 1, 1, 1, 2], [4, 4, 4, 4, 8]])
    assert torch.equal(hf.dequantize_fp8(w, torch.tensor([[1.0, 2.0], [4.0, 8.0]]), (2, 4)), want)
    with pytest.raises(ValueError, match=r"^checkpoint: fp8 scales of shape \(2, 3\) for a 3x5 weight in 2x4 blocks$"):
        hf.dequantize_fp8(w, torch.ones(2, 3), (2, 4))
    with pytest.raises(ValueError, match=r"^config.json: an fp8 weight without a quantization_config \(weight_block_size\)$"):
        hf.dequantize_fp8(w, torch.ones(2, 2), None)
    with pytest.raises(ValueError, match=r"^checkpoint: an fp8 weight of shape \(4,\), expected \[\.\.\., out, in\]$"):
        hf.dequantize_fp8(torch.ones(4).to(torch.float8_e4m3fn), torch.ones(1), (2, 4))


@pytest.mark.parametrize("config, read", [
    ({}, (None, None)),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 4]}}, ((2, 4), None)),
    ({"text_config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}}, ((128, 64), None)),
    ({"quantization_config": {"quant_method": "mxfp4"}}, (None, None)),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": dict(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)}}}}, (None, (4, 32))),
], ids=["none", "fp8", "text_config", "mxfp4", "int4"])
def test_the_weight_quantization_is_read_from_config_json(config, read, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf._weight_quantization(tmp_path) == read


def test_fp8_without_weight_block_size_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}))
    with pytest.raises(ValueError, match=r"^config.json: quantization_config \{'quant_method': 'fp8', 'activation_scheme': 'static'\} is not "
                                         r"supported \(block-scaled fp8 with weight_block_size \[m, n\]"):
        hf._weight_quantization(tmp_path)


def _packed_int_config(top_format="pack-quantized", **weights):
    group = {"weights": dict(dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=8), **weights)}
    return {"quant_method": "compressed-tensors", "format": top_format, "config_groups": {"group_0": group}}


@pytest.mark.parametrize("quant, scheme", [
    (_packed_int_config(), (4, 8)),
    (_packed_int_config(num_bits=2, group_size=16), (2, 16)),
    (_packed_int_config(num_bits=8, strategy="channel", group_size=32), (8, None)),
    (dict(_packed_int_config("naive-quantized"), config_groups={"group_0": dict(_packed_int_config()["config_groups"]["group_0"],
                                                                                format="pack-quantized")}), (4, 8)),
], ids=["int4", "int2", "per-channel", "group-format"])
def test_a_compressed_tensors_config_reads_as_its_one_weight_scheme(quant, scheme):
    assert hf._packed_int(quant) == scheme


@pytest.mark.parametrize("change, problem", [
    (lambda q: q.update(format="naive-quantized"), r"has format 'naive-quantized'"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "has quantised activations"),
    (lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}), "has quantised activations"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=16), "has num_bits 16"),
    (lambda q: q.update(config_groups={}), r"with 0 weight schemes \(num_bits, group_size\): \[\]; fmoe reads one"),
], ids=["format", "input-activations", "output-activations", "num-bits", "no-groups"])
def test_a_compressed_tensors_config_fmoe_cannot_read_is_named(change, problem):
    quant = _packed_int_config()
    change(quant)
    with pytest.raises(ValueError, match=r"^config.json: compressed-tensors config_groups.*" + problem):
        hf._packed_int(quant)


def test_fp4_and_mxfp4_codes_dequantise_as_worked_by_hand():
    """Two e2m1 codes a byte, the low nibble first: 0x21 is 0.5 then 1.0, 0x9F is -6.0 then
    -0.5; DeepSeek-V4's FP4 scales each block of its grid (float32, or biased uint8 exponents),
    MXFP4 scales each group of 32 by 2 ** (byte - 127). The misfits are refused by name."""
    packed = torch.tensor([[0x21, 0x9F - 256]], dtype=torch.int8)
    assert torch.equal(hf.dequantize_fp4(packed, torch.tensor([[2.0]])), torch.tensor([[1.0, 2.0, -12.0, -1.0]]))
    assert torch.equal(hf.dequantize_fp4(packed, torch.tensor([[128, 125]], dtype=torch.uint8)), torch.tensor([[1.0, 2.0, -1.5, -0.125]]))
    with pytest.raises(ValueError, match=r"^checkpoint: an FP4 weight stored as torch.uint8, expected int8 \(two e2m1 codes a byte\)$"):
        hf.dequantize_fp4(packed.view(torch.uint8), torch.tensor([[2.0]]))
    with pytest.raises(ValueError, match=r"^checkpoint: an FP4 weight of shape \(1, 2\) with scales of shape \(1,\), "
                                         r"expected \[\.\.\., out, in / 2\]"):
        hf.dequantize_fp4(packed, torch.tensor([2.0]))
    with pytest.raises(ValueError, match=r"^checkpoint: FP4 scales of shape \(3, 1, 1\) do not tile a 2x1x4 weight$"):
        hf.dequantize_fp4(torch.stack([packed, packed]), torch.ones(3, 1, 1))
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, :2] = torch.tensor([0x9F, 0x21])
    assert torch.equal(hf.dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8)), torch.tensor([-12.0, -1.0, 1.0, 2.0] + [0.0] * 28))
    for b, s, said in ((blocks[:, :8], torch.tensor([128], dtype=torch.uint8), "torch.uint8 (1, 8) and torch.uint8 (1,)"),
                       (blocks, torch.tensor([128], dtype=torch.int32), "torch.uint8 (1, 16) and torch.int32 (1,)")):
        with pytest.raises(ValueError, match=r"^checkpoint: MXFP4 blocks \[\.\.\., G, 16\] and scales \[\.\.\., G\] of uint8 expected, got "
                                             + re.escape(said) + "$"):
            hf.dequantize_mxfp4(b, s)


def test_packed_2_bit_weights_dequantise_as_worked_by_hand():
    """16 columns' 2-bit codes per int32, the first in the lowest bits, each the value + 2:
    codes 3, 0, 1, 2 are 1, -2, -1, 0; a scale per group of 2 columns; codes not in int32 refused."""
    word = torch.tensor([[3 | 0 << 2 | 1 << 4 | 2 << 6]], dtype=torch.int32)
    assert torch.equal(hf.dequantize_int_packed(word, torch.tensor([[1.0]]), (1, 4), 2), torch.tensor([[1.0, -2.0, -1.0, 0.0]]))
    assert torch.equal(hf.dequantize_int_packed(word, torch.tensor([[1.0, 0.5]]), (1, 4), 2, 2), torch.tensor([[1.0, -2.0, -0.5, 0.0]]))
    with pytest.raises(ValueError, match=r"^checkpoint: a packed 2-bit weight of shape \(1, 4\) needs int32 codes of shape \(1, 1\) and scales of "
                                         r"shape \(1, 1\), got torch.int64 \(1, 1\) and \(1, 1\)$"):
        hf.dequantize_int_packed(word.long(), torch.tensor([[1.0]]), (1, 4), 2)


def test_a_hugging_face_folder_is_one_whose_config_names_a_model_type(tmp_path):
    assert not hf.is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden": 32, "n_layers": 2}))  # an fmoe run's
    assert not hf.is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert hf.is_hf_folder(tmp_path)


def test_an_expert_of_another_shape_than_the_others_is_named(folders, tmp_path):
    path, _ = folders["mixtral"]
    tensors = _read_all(path)
    key = next(k for k in tensors if ".experts.1." in k and k.endswith("w1.weight"))
    bad = _copy_folder(path, tmp_path / "bad", {**tensors, key: torch.zeros(25, 32)})
    with pytest.raises(ValueError, match=rf"^checkpoint: {re.escape(key)} has shape \(32, 25\) \(as \[in, out\]\), its other experts \(32, 24\)$"):
        hf.from_pretrained(bad)


def test_embedding_keys_whose_rows_do_not_join_are_named(tmp_path):
    _molmo2(tmp_path / "written", 8)
    tensors = _read_all(tmp_path / "written")
    bad = _copy_folder(tmp_path / "written", tmp_path / "bad", {**tensors, "model.transformer.wte.new_embedding": torch.zeros(8, 31)})
    with pytest.raises(ValueError, match=r"^checkpoint: model.transformer.wte.embedding and model.transformer.wte.new_embedding have shapes "
                                         r"\[\(36, 32\), \(8, 31\)\], whose rows do not join$"):
        hf.from_pretrained(bad)


@pytest.mark.parametrize("option, said", [(dict(abs_positions=128), "abs_positions, learned absolute positions, which"),
                                          (dict(embed_norm=True), "embed_norm with weights, a norm of the embeddings which")],
                         ids=["abs_positions", "embed_norm"])
def test_an_option_whose_weights_the_family_s_folders_have_no_key_for_is_named(option, said, folders):
    with pytest.raises(ValueError, match=rf"^model: {said} this family's checkpoints do not hold$"):
        hf.from_pretrained(folders["llama"][0], **option)


def test_load_weights_returns_the_bytes_it_read(folders, tmp_path):
    """A float32 folder: every tensor's bytes; compressed-tensors' int4: the int32 codes' and
    the scales' (weight_shape, read for the shape, not counted)."""
    path, _ = folders["deepseek_v3"]
    model, _ = hf.from_pretrained(path)
    assert hf.load_weights(model, path, model_type="deepseek_v3") == sum(t.numel() * 4 for t in _read_all(path).values())
    quantised, _ = _int4_experts(_read_all(path))
    int4 = _copy_folder(path, tmp_path / "int4", quantised, lambda c: c.update(quantization_config=_INT4))
    read = sum(t.numel() * t.element_size() for k, t in quantised.items() if not k.endswith("_shape"))
    assert hf.load_weights(model, int4, model_type="deepseek_v3") == read


def test_each_mtp_layer_s_copies_are_of_the_embedding_and_the_head_it_uses(folders):
    """DeepSeek-V3's MTP layer n_layers + d - 1 holds copies of the embedding and of the head:
    the embedding's where the head is tied to it; with final_norm (the export) and MTP modules
    on the final norm, its shared_head.norm too."""
    _, cfg = hf.read_config(folders["deepseek_v3"][0])
    family, p = hf.FAMILIES["deepseek_v3"], f"model.layers.{cfg.n_layers}."
    untied = dataclasses.replace(cfg, mtp_depth=1, mtp_norm=False)
    assert hf.mtp_copies(family, untied) == {p + "embed_tokens.weight": "embed", p + "shared_head.head.weight": "head"}
    assert hf.mtp_copies(family, dataclasses.replace(untied, tie_embeddings=True)) == {p + "embed_tokens.weight": "embed",
                                                                                        p + "shared_head.head.weight": "embed"}
    assert hf.mtp_copies(family, untied, final_norm=True)[p + "shared_head.norm.weight"] == "norm.weight"
    assert hf.mtp_copies(family, dataclasses.replace(untied, mtp_norm=True), final_norm=True) == hf.mtp_copies(family, untied)


def test_only_deepseek_v3_s_layout_maps_mtp_depths_onto_the_layers_after_the_trunk_s(folders):
    """MTP depth d is the layer n_layers + d - 1 in DeepSeek-V3's layout; a family whose folders
    hold no MTP layers maps none (its MTP modules start fresh and are not written)."""
    _, ds = hf.read_config(folders["deepseek_v3"][0])
    keys = hf.key_map(hf.FAMILIES["deepseek_v3"], dataclasses.replace(ds, mtp_depth=2))
    p = f"model.layers.{ds.n_layers + 1}."
    assert keys["mtp.1.proj"] == hf.Tensor((p + "eh_proj.weight",), transpose=True)
    assert keys["mtp.1.emb_norm.weight"] == hf.Tensor((p + "enorm.weight",)) and keys["mtp.1.hidden_norm.weight"] == hf.Tensor((p + "hnorm.weight",))
    _, llama = hf.read_config(folders["llama"][0])
    assert not [name for name in hf.key_map(hf.FAMILIES["llama"], dataclasses.replace(llama, mtp_depth=1)) if name.startswith("mtp.")]


def test_stored_unit_dims_are_put_back_and_a_row_read_from_several_is_not_written():
    assert hf._with_units(hf.Tensor(("k",), unit=(3, 0, 1)), torch.zeros(4)).shape == (1, 1, 4, 1)
    assert hf._with_units(hf.Tensor(("k",), unit=0), torch.zeros(4, 2)).shape == (1, 4, 2)
    with pytest.raises(ValueError, match=r"^model: k holds other rows than the one read \(Tensor.row\), so it is not written$"):
        hf._with_units(hf.Tensor(("k", "l"), row=0), torch.zeros(4))


def test_packed_int_weights_dequantise_as_worked_by_hand():
    """compressed-tensors' pack-quantized layout, worked by hand: 8 columns' 4-bit codes per
    int32, the first in the lowest bits, each the value + 8; a row padded to whole words; a
    scale per group of 8 columns."""
    packed = torch.tensor([[0x0F2D4B69, 0x0000BA98], [-0x10000000, 0x00008888]], dtype=torch.int32)  # 0xF0000000 as int32
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25]], dtype=torch.bfloat16)
    want = torch.tensor([[0.5, -1, 1.5, -2, 2.5, -3, 3.5, -4, 0, 2, 4, 6], [-8, -8, -8, -8, -8, -8, -8, 7, 0, 0, 0, 0]])
    assert torch.equal(hf.dequantize_int_packed(packed, scale, (2, 12), 4, 8), want)
    # 8 bits: 4 codes per word, each the value + 128; one scale per row
    word = (130 | 1 << 8 | 255 << 16 | 128 << 24) - (1 << 32)  # values 2, -127, 127, 0
    assert torch.equal(hf.dequantize_int_packed(torch.tensor([[word]], dtype=torch.int32), torch.tensor([[0.5]]), (1, 3), 8),
                       torch.tensor([[1.0, -63.5, 63.5]]))
    with pytest.raises(ValueError, match=r"a packed 4-bit weight of shape \(2, 12\) needs int32 codes of shape \(2, 2\) and scales of shape \(2, 3\)"):
        hf.dequantize_int_packed(packed, scale, (2, 12), 4, 4)
    with pytest.raises(ValueError, match="num_bits: expected 2, 4 or 8, got 3"):
        hf.dequantize_int_packed(packed, scale, (2, 12), 3, 8)


def _int4(w, group):
    """Symmetric int4 of a float32 weight [out, in] in groups of `group` columns, stored as
    compressed-tensors' pack-quantized layout: (weight_packed, weight_scale in bf16,
    weight_shape), and the dequantised weight."""
    rows, cols = w.shape
    scale = (w.reshape(rows, cols // group, group).abs().amax(-1) / 7).to(torch.bfloat16)
    full = scale.float().repeat_interleave(group, 1)
    q = torch.clamp(torch.round(w / full), -8, 7).long()
    words = torch.zeros(rows, -(-cols // 8), dtype=torch.int64)
    for c in range(cols):
        words[:, c // 8] |= (q[:, c] + 8) << (4 * (c % 8))
    packed = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return packed, scale, torch.tensor([rows, cols]), q.float() * full


def _int4_experts(tensors, prefix=""):
    """(the folder's tensors with every routed expert's weight as int4 in groups of 8, the
    dequantised experts by key)."""
    quantised, dequantised = {}, {}
    for key, t in tensors.items():
        if ".mlp.experts." in key and key.endswith("proj.weight"):
            packed, scale, shape, dequantised[key] = _int4(t, 8)
            quantised.update({prefix + key + "_packed": packed, prefix + key + "_scale": scale, prefix + key + "_shape": shape})
        else:
            quantised[prefix + key] = t
    assert any(not torch.equal(dequantised[k], tensors[k]) for k in dequantised)  # quantisation really rounded
    return quantised, dequantised


_INT4 = dict(quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed", ignore=["lm_head", "re:.*self_attn.*"],
             config_groups=dict(group_0=dict(targets=["Linear"], input_activations=None, output_activations=None,
                                             weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=8))))
_KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def _kimi_k2(config):
    """A DeepSeek-V3 config.json as Kimi K2's releases write theirs: model_type kimi_k2 (their
    remote code), YaRN as rope_scaling of type yarn, one group, no MTP layers."""
    config.pop("rope_parameters")
    config.update(model_type="kimi_k2", auto_map=_KIMI_AUTO_MAP, rope_theta=50000.0, n_group=1, topk_group=1, num_nextn_predict_layers=0,
                  scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=2.827,
                  rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                    mscale_all_dim=1.0))


def test_a_released_kimi_k2_folder_is_deepseek_v3_with_int4_experts(folders, tmp_path):
    """Kimi K2's folders (kimi_k2): DeepSeek-V3's keys, the config in the releases' own fields,
    read as transformers' DeepseekV3Config reads it; the model gives the logits of transformers'
    DeepSeek-V3 of the same weights, writes back the same config and bit-identical weights,
    and as deepseek_v3 (model_type=). K2-Thinking's int4 experts (compressed-tensors'
    pack-quantized, groups of 8 here) load dequantised, with the logits of transformers'
    model of the dequantised weights, and are exported dequantised."""
    path, _ = folders["deepseek_v3"]
    kimi = _edit(path, tmp_path / "kimi", _kimi_k2)
    config = json.loads((kimi / "config.json").read_text())
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in json.loads(json.dumps(config)).items() if k not in ("model_type", "auto_map")})
    _, cfg = hf.read_config(kimi)
    assert cfg == TransformerConfig(**hf.FAMILIES["deepseek_v3"].kwargs(dict(theirs.to_dict(), model_type="deepseek_v3")))
    assert (cfg.n_groups, cfg.route_scale, cfg.yarn_factor, cfg.rope_base, cfg.score) == (None, 2.827, 4.0, 50000.0, "sigmoid")
    plain = _edit(kimi, tmp_path / "plain", lambda c: [c.update(model_type="deepseek_v3"), c.pop("auto_map")])
    ref = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    model, got = hf.from_pretrained(kimi, impl="torch")
    assert got == dataclasses.replace(cfg, mtp_depth=0, impl="torch")
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), want) < 1e-5
    out = hf.save_pretrained(model, tmp_path / "again")
    assert json.loads((out / "config.json").read_text()) == config
    assert filecmp.cmp(kimi / "model.safetensors", out / "model.safetensors", shallow=False)
    hf.save_pretrained(model, tmp_path / "as-deepseek", model_type="deepseek_v3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "as-deepseek", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), want) < 1e-5
    # K2-Thinking: the routed experts in int4
    tensors = _read_all(path)
    quantised, dequantised = _int4_experts(tensors)
    int4 = _copy_folder(path, tmp_path / "int4", quantised, lambda c: c.update(quantization_config=_INT4))
    model, _ = hf.from_pretrained(int4, impl="torch")
    out = _matches_the_dequantised_model(model, path, tensors, dequantised, tmp_path)
    assert not any(k.endswith(("_packed", "_scale", "_shape")) for k in out)
    assert hf.unread_keys(hf.FAMILIES["deepseek_v3"], model.cfg, int4, quantised) == []
    for change, problem in ((dict(symmetric=False), "asymmetric weights"), (dict(type="float"), "type 'float'"),
                            (dict(strategy="tensor"), "strategy 'tensor'"), (dict(actorder="group"), "actorder 'group'")):
        bad = json.loads(json.dumps(_INT4))
        bad["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(ValueError, match=rf"compressed-tensors config_groups\['group_0'\] has {problem}; fmoe reads pack-quantized"):
            hf.from_pretrained(_edit(int4, tmp_path / f"bad-{problem[:5]}", lambda c: c.update(quantization_config=bad)))
    two = json.loads(json.dumps(_INT4))
    two["config_groups"]["group_1"] = dict(two["config_groups"]["group_0"], weights=dict(two["config_groups"]["group_0"]["weights"], group_size=32))
    with pytest.raises(ValueError, match=r"compressed-tensors config_groups with 2 weight schemes"):
        hf.from_pretrained(_edit(int4, tmp_path / "two", lambda c: c.update(quantization_config=two)))
    with pytest.raises(ValueError, match="_packed needs a compressed-tensors quantization_config"):
        hf.from_pretrained(_edit(int4, tmp_path / "none", lambda c: c.pop("quantization_config")))


def test_exaone_reads_its_released_names_and_llama3_rope(folders, tmp_path):
    """EXAONE 3.0 / 3.5 (exaone): the layers under transformer.h. with their released module
    names, as transformers writes them; a config.json with the released field names
    (num_layers, layer_norm_epsilon, activation_function) and EXAONE 3.5's Llama 3.1 RoPE
    scaling reads as the model transformers builds from it, with its logits; an activation
    other than silu is refused by name."""
    path, _ = folders["exaone"]
    keys = set(_read_all(path))
    assert "transformer.h.0.attn.attention.out_proj.weight" in keys and "transformer.wte.weight" in keys and "transformer.ln_f.weight" in keys
    plain = json.loads((path / "config.json").read_text())
    released = {k: v for k, v in plain.items() if k not in ("num_hidden_layers", "rms_norm_eps", "hidden_act", "rope_parameters")}
    released.update(num_layers=plain["num_hidden_layers"], layer_norm_epsilon=1e-6, activation_function="silu", rope_theta=1e4,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8))
    folder = _edit(path, tmp_path / "released", lambda c: [c.clear(), c.update(released)])
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert (cfg.n_layers, cfg.norm_eps, cfg.rope_base, cfg.llama3_factor, cfg.llama3_original_max_positions) == (3, 1e-6, 1e4, 8.0, 8)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
        unscaled = hf.Transformer(dataclasses.replace(cfg, llama3_factor=None))
        unscaled.load_state_dict(model.state_dict())
        assert _rel(unscaled.logits(ids, cu), _their_logits(ref, docs)) > 1e-3  # the scaling matters at these positions
    with pytest.raises(ValueError, match=r"config.json: activation_function = 'gelu' is not supported \(SwiGLU with silu only\)"):
        hf.FAMILIES["exaone"].kwargs(dict(released, activation_function="gelu"))


@pytest.mark.parametrize("variant", ["falcon-7b", "falcon2-11b", "sequential", "falcon-rw"])
def test_falcon_reads_each_architecture_s_kv_heads_and_norms(variant, tmp_path):
    """Falcon's other layouts (the table's is Falcon-40B's): Falcon-7B's multi-query attention
    (one kv head) in parallel blocks of one LayerNorm, Falcon2-11B's new architecture with one
    LayerNorm for both branches (num_ln_in_parallel_attn 1), the sequential pre-norm block
    (parallel_attn false: input_layernorm, post_attention_layernorm) with a kv head per head,
    and Falcon-RW's, that block with ALiBi in place of RoPE, its biases scaled with the scores
    (alibi_scaled; 4 heads: slopes that bfloat16, transformers' rounding, holds exactly),
    each read with transformers' logits and written back bit for bit; what transformers'
    model is not (another activation, num_ln_in_parallel_attn 2 in the old architecture, the
    new one without parallel_attn) is refused by name."""
    fields = {"falcon-7b": dict(multi_query=True), "falcon2-11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
              "sequential": dict(multi_query=False, parallel_attn=False, bias=True),
              "falcon-rw": dict(multi_query=False, parallel_attn=False, bias=True, alibi=True)}[variant]
    config = transformers.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=128,
                                       ffn_hidden_size=40, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, **fields)
    torch.manual_seed(0)
    ref = _randomised(transformers.FalconForCausalLM(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    want = {"falcon-7b": (1, True, False), "falcon2-11b": (2, True, False), "sequential": (4, False, False), "falcon-rw": (4, False, False)}[variant]
    assert (cfg.n_kv_heads, cfg.parallel_blocks, cfg.parallel_norms) == want and cfg.qkv_bias == (variant in ("sequential", "falcon-rw"))
    assert cfg.alibi == cfg.alibi_scaled == (variant == "falcon-rw")
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        if variant == "falcon-rw":  # the bias's scale matters
            unscaled = hf.Transformer(dataclasses.replace(cfg, alibi_scaled=False))
            unscaled.load_state_dict(model.state_dict())
            assert _rel(unscaled.logits(ids, cu), theirs) > 1e-3
    hf.save_pretrained(model, tmp_path / "again")
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "hf" / file, tmp_path / "again" / file, shallow=False), file
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, message in ((dict(alibi="yes"), r"alibi = 'yes' is not supported \(true or false\)"), (dict(activation="relu"), "activation = 'relu' is not supported"),
                            (dict(new_decoder_architecture=False, parallel_attn=True, num_ln_in_parallel_attn=2),
                             "num_ln_in_parallel_attn = 2 is not supported"),
                            (dict(new_decoder_architecture=True, parallel_attn=False), "new_decoder_architecture without parallel_attn is not supported")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["falcon"].kwargs(dict(written, **change))


def test_gpt_neox_reads_pythia_s_released_fields_and_leaves_its_mask_buffers_unread(folders, tmp_path):
    """A released Pythia / GPT-NeoX folder: its config's rotary_pct and rotary_emb_base (the
    RoPE fields before rope_parameters), and the causal-mask buffers older folders hold
    (attention.bias, attention.masked_bias), unread as in transformers; q, k and v read head by
    head from query_key_value; the logits transformers gives; grouped kv heads and another
    activation refused by name."""
    path, ref = folders["gpt_neox"]
    plain = json.loads((path / "config.json").read_text())
    released = {k: v for k, v in plain.items() if k != "rope_parameters"} | dict(rotary_pct=0.5, rotary_emb_base=100.0)
    tensors = _read_all(path)
    buffers = {f"gpt_neox.layers.{i}.attention.{name}": torch.ones(1) for i in range(3) for name in ("bias", "masked_bias")}
    folder = _copy_folder(path, tmp_path / "released", tensors | buffers, lambda c: [c.clear(), c.update(released)])
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert (cfg.rope_dim, cfg.rope_base, cfg.parallel_blocks, cfg.parallel_norms, cfg.mlp_act) == (4, 100.0, True, True, "gelu")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(theirs, docs)) < 1e-5
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) > 1e-3  # the RoPE fields were read: not the folder's own model
    wq = model.blocks[0].attn.wq.detach()
    D = cfg.head_dim
    torch.testing.assert_close(wq[:, D:2 * D], tensors["gpt_neox.layers.0.attention.query_key_value.weight"][3 * D:4 * D].T)  # head 1's q rows
    for change, message in ((dict(num_key_value_heads=2), r"num_key_value_heads = 2 is not supported \(a kv head per query head, 4\)"),
                            (dict(hidden_act="relu"), r"hidden_act = 'relu' is not supported \(GELU, exact \(gelu\) or in its tanh form")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["gpt_neox"].kwargs(dict(released, **change))


@pytest.mark.parametrize("family, masks", [("gptj", ("attn.bias", "attn.masked_bias")), ("codegen", ("attn.causal_mask", "attn.masked_bias")),
                                           ("gpt_neo", ("attn.attention.bias", "attn.attention.masked_bias")),
                                           ("gpt2", ("attn.bias", "attn.masked_bias"))])
def test_old_folders_leave_their_mask_buffers_unread_and_their_positions_matter(family, masks, folders, tmp_path):
    """GPT-J, CodeGen, GPT-Neo and GPT-2: the causal-mask buffers older folders hold (attn.bias /
    causal_mask, masked_bias) are not read, as in transformers, and the folder loads with
    transformers' logits; GPT-J's and CodeGen's RoPE turns interleaved pairs of each head's
    first rotary_dim channels (halves give other logits); GPT-Neo's and GPT-2's positions are
    their learned ones (without them, other logits)."""
    path, ref = folders[family]
    buffers = {f"transformer.h.{i}.{name}": torch.ones(1) for i in range(3) for name in masks}
    folder = _copy_folder(path, tmp_path / "old", _read_all(path) | buffers)
    model, cfg = hf.from_pretrained(folder, impl="torch")
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
        if family in ("gpt_neo", "gpt2"):
            assert (cfg.abs_positions, cfg.attn_scale, cfg.window_layers) == ((64, 1.0, (1, 2)) if family == "gpt_neo" else (64, None, None))
            model.pos_embed.zero_()
        else:
            assert (cfg.rope_interleaved, cfg.rope_dim, cfg.parallel_blocks, cfg.head_bias) == (True, 4, True, True)
            halves = hf.Transformer(dataclasses.replace(cfg, rope_interleaved=False))
            halves.load_state_dict(model.state_dict())
            model = halves
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) > 1e-3


def test_a_released_aria_folder_loads_its_text_model(folders, tmp_path):
    """A released Aria folder (aria, AriaForConditionalGeneration): the text model whole under
    language_model. (its head too), with transformers' logits of a text-only forward, the vision
    tower and projector unread; not written back whole; written as aria_text, which
    transformers loads with the same logits and fmoe reads back exactly."""
    text = json.loads((folders["aria_text"][0] / "config.json").read_text())
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    whole = transformers.AriaConfig(text_config={k: v for k, v in text.items() if k not in ("architectures", "dtype", "transformers_version")},
                                    vision_config=vision, projector_patch_to_query_dict={4: 2})
    theirs = _saved_multimodal(transformers.AriaForConditionalGeneration, whole, tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="aria", prefix="language_model.",
                                             head="language_model.lm_head.weight", text_kind="aria_text")
    assert (cfg.n_experts, cfg.k, cfg.shared_size, cfg.n_dense) == (4, 2, 32, 0) and written["moe_num_shared_experts"] == 2


def test_opt_reads_its_offset_positions_and_refuses_opt_350m_s_blocks(folders):
    """OPT: its position table holds two rows before position 0's (abs_position_offset 2:
    read whole, rows 2.. used), its MLPs ReLU without a gate; OPT-350M's post-norm blocks and
    projected embeddings, a LayerNorm without weights and another activation are refused by
    name."""
    path, _ = folders["opt"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.abs_positions, cfg.abs_position_offset, cfg.mlp_act, model.pos_embed.shape) == (64, 2, "relu", (66, 32))
    config = json.loads((path / "config.json").read_text())
    for change, message in ((dict(do_layer_norm_before=False), "do_layer_norm_before = False is not supported"),
                            (dict(word_embed_proj_dim=16), r"word_embed_proj_dim = 16 is not supported \(hidden_size, 32"),
                            (dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine = False is not supported"),
                            (dict(activation_function="gelu"), r"^config.json: activation_function = 'gelu' is not supported \(relu")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["opt"].kwargs(dict(config, **change))
    # a field read through its alias is refused by the name config.json holds (GPT-2's has no hidden_act)
    gpt2 = dict(FAMILIES["gpt2"]().to_dict(), activation_function="relu")
    with pytest.raises(ValueError, match=r"^config.json: activation_function = 'relu' is not supported \(GELU"):
        hf.FAMILIES["gpt2"].kwargs(gpt2)


def test_cohere_compass_reads_each_layer_type_s_rope_and_its_vision_folder_s_text_model(tmp_path):
    """Cohere's North models: a text model (cohere_compass_text) whose sliding and full layers
    both rotate, each at its own base (the sliding ones' local_rope_base), or whose full layers
    alone do, loads with transformers' logits; a layer type that rope_parameters leaves out,
    or scales, is refused by name. A released vision folder (cohere_compass,
    CohereCompassForConditionalGeneration: the text model under model.language_model., its
    RoPE with the multimodal sections) loads the text model with transformers' logits of a
    text-only forward, is not written back whole, and written as cohere_compass_text loads in
    transformers with the same logits."""
    docs, ids, cu = _packed()
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4, logit_scale=0.25,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    both = dict(sliding_attention=dict(rope_type="default", rope_theta=100.0), full_attention=dict(rope_type="default", rope_theta=5e5))
    full_only = dict(sliding_attention=None, full_attention=dict(rope_type="default", rope_theta=1e4))
    for name, rope, want in (("both", both, dict(nope_layers=None, rope_base=5e5, local_rope_base=100.0)),
                             ("full only", full_only, dict(nope_layers=(0, 2), rope_base=1e4, local_rope_base=None))):
        torch.manual_seed(0)
        ref = _randomised(transformers.CohereCompassForCausalLM(transformers.CohereCompassTextConfig(**text, rope_parameters=rope)))
        ref.save_pretrained(tmp_path / name)
        model, cfg = hf.from_pretrained(tmp_path / name, impl="torch")
        assert {k: getattr(cfg, k) for k in want} == want and (cfg.rope_interleaved, cfg.parallel_blocks, cfg.logit_divisor) == (False, True, 4.0)
        with torch.no_grad():
            assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
    config = json.loads((tmp_path / "both" / "config.json").read_text())
    for change, message in ((dict(rope_parameters=dict(full_attention=both["full_attention"])),
                             "config.json: rope_parameters has no sliding_attention entry for the sliding_attention layers"),
                            (dict(rope_parameters=dict(both, full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4))),
                             r"rope_parameters.full_attention = .* is not supported \(plain RoPE, or null: none\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["cohere_compass_text"].kwargs(dict(config, **change))
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])
    sections = {kind: dict(p, mrope_section=[2, 1, 1]) for kind, p in both.items()}
    whole = transformers.CohereCompassConfig(text_config=dict(text, rope_parameters=sections), vision_config=vision)
    theirs = _saved_multimodal(transformers.CohereCompassForConditionalGeneration, whole, tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="cohere_compass", prefix="model.language_model.",
                                             head="lm_head.weight", text_kind="cohere_compass_text")
    assert (cfg.local_rope_base, cfg.tie_embeddings) == (100.0, False) and written["rope_parameters"]["sliding_attention"]["mrope_section"] == [2, 1, 1]


_STEP_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
_STEP_LLAMA3 = dict(rope_type="llama3", factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)


def _step_text(**fields) -> dict:
    """A Step 3.7 text config (transformers' Step3p7TextConfig's fields, the released per-layer lists): four layers, full and
    sliding in turn, the sliding ones with 8 query heads and their own plain RoPE, Llama 3.1's scaling on the full ones' half
    of each head; the first block dense; the routed experts clamped in blocks 2 and 3, the shared expert and the dense MLP in
    blocks 0 and 3; a softmax scale of 6 ** -0.5."""
    return dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, share_expert_dim=24, sliding_window=4,
                layer_types=["full_attention", "sliding_attention"] * 2, num_sliding_attention_heads=8,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], swiglu_limits=[0, 0, 0.5, 0.5], swiglu_limits_shared=[0.3, 0, 0, 0.3],
                moe_router_scaling_factor=2.5, query_pre_attn_scalar=6, rope_theta=[1e4, 500.0] * 2, partial_rotary_factors=[0.5, 1.0] * 2,
                rope_scaling=_STEP_LLAMA3, bos_token_id=None, eos_token_id=None, **fields)


def test_step3p7_and_step3p5_folders_read_their_clamps_and_each_layer_type_s_heads_and_rope(tmp_path):
    """A Step 3.7 Flash folder (step3p7, Step3p7ForConditionalGeneration): its text model
    loads with transformers' logits of a text-only forward, on the torch and the Triton
    paths (the interpreter), the vision model unread: zero-centred norms, a sigmoid gate per
    head, each layer type's heads and RoPE (Llama 3.1's scaling on the full layers alone),
    the softmax scale, and the SwiGLU limits on silu(gate) in the listed layers, each of
    which moves the logits. Not written back whole; written as step3p5 (Step 3.5 Flash's
    text model, which transformers has no class of) and read back exactly, and that folder,
    put beside the vision model again as a step3p7 folder, loads in transformers with the
    same logits. A step3p5 folder as released (the fields' released names and per-layer
    lists, each list carrying the MTP layer's entry, and the MTP layer's keys, unread)
    reads as the same model (its empty use_rope_layers: RoPE in every layer); one that clamps
    nothing reads with mlp_act "silu"."""
    _, ids, cu = _packed()
    config = transformers.Step3p7Config(text_config=_step_text(), vision_config=_STEP_VISION)
    theirs = _saved_multimodal(transformers.Step3p7ForConditionalGeneration, config, tmp_path / "vl")
    model, cfg = hf.from_pretrained(tmp_path / "vl", impl="torch")
    assert (cfg.n_heads, cfg.local_heads, cfg.window, cfg.window_layers, cfg.attn_gate_act, cfg.attn_gate_per_head) == (4, 8, 4, (1, 3), "sigmoid", True)
    assert (cfg.rope_base, cfg.rope_dim, cfg.local_rope_base, cfg.local_rope_dim, cfg.llama3_factor) == (1e4, 4, 500.0, 8, 2.0)
    assert (cfg.mlp_act, cfg.swiglu_limit, cfg.swiglu_limit_layers, cfg.shared_swiglu_limit, cfg.shared_swiglu_limit_layers) == (
        "silu_cap", 0.5, (2, 3), 0.3, (0, 3))
    assert (cfg.attn_scale, cfg.zero_centered_norms, cfg.route_scale, cfg.n_dense, cfg.shared_size) == (6**-0.5, True, 2.5, 1, 24)
    unclamped = hf.FAMILIES["step3p5"].kwargs(dict(_step_text(), model_type="step3p5", swiglu_limits=[0] * 4, swiglu_limits_shared=None))
    assert (unclamped["mlp_act"], unclamped["swiglu_limit"], unclamped["shared_swiglu_limit_layers"]) == ("silu", None, None)  # silu_cap is silu then
    keys = [k for spec in hf.key_map(hf.FAMILIES["step3p7"], cfg).values() for k in spec.keys]
    assert "model.layers.1.moe.gate_proj.weight" in keys and "model.layers.1.share_expert.up_proj.weight" in keys
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        assert _rel(hf.from_pretrained(tmp_path / "vl", impl="triton")[0].logits(ids, cu), theirs) < 1e-5
        # each piece matters: the limits, the cap on silu(gate) rather than gate, the scaling, the gate's activation
        for change in (dict(swiglu_limit_layers=(2,)), dict(shared_swiglu_limit_layers=(3,)), dict(mlp_act="silu"), dict(llama3_factor=None),
                       dict(attn_gate_act="softplus"), dict(attn_scale=None)):
            other = hf.Transformer(dataclasses.replace(cfg, **change))
            other.load_state_dict(model.state_dict())
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, change
    with pytest.raises(ValueError, match=r"model_type: a step3p7 folder holds a model fmoe does not read \(vision_model., vit_large_projector.\), "
                                         "so it is not written; pass model_type='step3p5'"):
        hf.save_pretrained(model, tmp_path / "whole")
    model.hf_config = hf.written_config(model.hf_config)
    out = hf.save_pretrained(model, tmp_path / "text")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("step3p5", ["Step3p5ForCausalLM"])
    back, back_cfg = hf.from_pretrained(out, impl="torch")
    assert back_cfg == cfg and all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    del back.hf_config  # fmoe's own: written from its config
    own = json.loads((hf.save_pretrained(back, tmp_path / "own", model_type="step3p5") / "config.json").read_text())
    assert hf.read_config(tmp_path / "own")[1] == dataclasses.replace(cfg, impl="auto") and own["swiglu_limits_shared"] == [0.3, 0.0, 0.0, 0.3]
    assert own["model_type"] == "step3p5" and _rel(_beside_the_rest(tmp_path / "vl", tmp_path / "own", tmp_path / "again", own), theirs) < 1e-5
    # the released Step 3.5 Flash layout: the fields' own names, per-layer lists with the MTP layer's entry, its keys unread
    text = {k: v for k, v in _step_text().items() if k not in ("num_key_value_heads", "n_routed_experts", "num_experts_per_tok",
                                                                 "num_sliding_attention_heads", "mlp_layer_types")}
    released = dict(text, model_type="step3p5", architectures=["Step3p5ForCausalLM"], num_attention_groups=2, moe_num_experts=4, moe_top_k=2,
                    moe_layers_enum="1,2,3", attention_other_setting=dict(attention_type="sliding_attention", num_attention_heads=8,
                                                                           num_attention_groups=2, head_dim=8),
                    num_nextn_predict_layers=1, moe_router_activation="sigmoid", use_moe_router_bias=True, use_head_wise_attn_gate=True,
                    zero_centered=True, norm_expert_weight=True, need_fp32_gate=True, att_impl_type="GQA", yarn_only_types=["full_attention"],
                    use_rope_layers=[], use_qk_norm=True, sink=False, use_moe=True, share_expert_dims=24, layer_types=text["layer_types"] + ["full_attention"], rope_theta=text["rope_theta"] + [1e4],
                    partial_rotary_factors=text["partial_rotary_factors"] + [0.5], swiglu_limits=text["swiglu_limits"] + [9.0],
                    swiglu_limits_shared=text["swiglu_limits_shared"] + [0])
    mtp = {"model.layers.4.eh_proj.weight": torch.randn(32, 64), "model.layers.4.enorm.weight": torch.zeros(32)}
    folder = _copy_folder(out, tmp_path / "released", _read_all(out) | mtp, lambda c: [c.clear(), c.update(released)])
    model, released_cfg = hf.from_pretrained(folder, impl="torch")
    assert released_cfg == cfg and hf.unread_keys(hf.FAMILIES["step3p5"], cfg, folder, set(_read_all(folder))) == []
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), theirs) < 1e-5


def test_step3p5_fp8_expert_stacks_are_dequantised_expert_by_expert(tmp_path):
    """Block-scaled FP8 experts stored as Step 3.5's stacks (float8 [E, F, H] and [E, H, F] with
    [E, F/m, H/n] scales, its FP8 folders' layout) load as each expert's matrix dequantised on
    its own blocks, the 2-D projections as before: the model is the one read from the
    dequantised weights; scales of another shape are refused by name."""
    cfg = TransformerConfig(**hf.FAMILIES["step3p5"].kwargs(dict(_step_text(), model_type="step3p5")))
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=1)
    plain = hf.save_pretrained(model, tmp_path / "plain", model_type="step3p5")
    tensors, block = _read_all(plain), (8, 8)
    quantised, dequantised = dict(tensors), {}
    for key, t in tensors.items():
        if key.endswith("proj.weight"):
            pairs = [_fp8(w, block) for w in (t if t.ndim == 3 else t[None])]
            q, scale = (torch.stack(parts) if t.ndim == 3 else parts[0] for parts in zip(*pairs))
            quantised[key], quantised[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantised[key] = hf.dequantize_fp8(q, scale, block)
    gate = "model.layers.1.moe.gate_proj.weight"
    scales = quantised[gate.removesuffix("weight") + "weight_scale_inv"]
    assert quantised[gate].shape == (4, 16, 32) and scales.shape == (4, 2, 4)
    assert torch.equal(dequantised[gate][2], hf.dequantize_fp8(quantised[gate][2], scales[2], block))  # expert 2 on its own blocks
    assert not torch.equal(dequantised[gate], tensors[gate])  # the quantisation rounded
    fp8 = _copy_folder(plain, tmp_path / "fp8", quantised, lambda c: c.update(quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block))))
    reference = _copy_folder(plain, tmp_path / "dequantised", tensors | dequantised)
    got, want = hf.from_pretrained(fp8, impl="torch")[0].state_dict(), hf.from_pretrained(reference, impl="torch")[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(ValueError, match=r"checkpoint: fp8 scales of shape \(4, 1, 4\) for a 4x16x32 weight in 8x8 blocks"):
        hf.dequantize_fp8(quantised[gate], scales[:, :1], block)


def test_step3p5_refuses_what_transformers_model_is_not(tmp_path):
    """Step 3.5's fields that describe another model than transformers' Step3p7TextModel are
    refused by name: per-layer lists of another length, limits that differ across the layers
    they clamp, two RoPE bases in one layer type, the sliding layers' own kv heads, scaling on
    the sliding layers, softmax routing, a gate per channel, RoPE left out of some layer, no
    q/k norms, attention sinks. The released configs' empty use_rope_layers means every layer."""
    base = dict(_step_text(), model_type="step3p5")
    for change, message in (
            (dict(swiglu_limits=[0, 0, 0.5]), r"config.json: swiglu_limits = \[0, 0, 0.5\] is not supported \(one entry per layer: 4\)"),
            (dict(swiglu_limits=[0, 0, 0.5, 0.4]), r"swiglu_limits = \[0, 0, 0.5, 0.4\] is not supported \(one limit for the layers it clamps\)"),
            (dict(swiglu_limits_shared=[0, -1, 0, 0]), r"swiglu_limits_shared = \[0, -1, 0, 0\] is not supported \(a limit >= 0 per layer"),
            (dict(rope_theta=[1e4, 500.0, 2e4, 500.0]), r"rope_theta = .* is not supported \(one value for the full_attention layers\)"),
            (dict(attention_other_setting=dict(num_attention_heads=8, num_attention_groups=1)),
             r"num_attention_groups = 1 is not supported \(the sliding layers' num_attention_groups as the others', 2\)"),
            (dict(yarn_only_types=["sliding_attention"]), r"yarn_only_types = \['sliding_attention'\] is not supported"),
            (dict(moe_router_activation="softmax"), r"moe_router_activation = 'softmax' is not supported \(sigmoid router scores"),
            (dict(use_head_wise_attn_gate=False), r"use_head_wise_attn_gate = False is not supported \(true, as transformers' model\)"),
            (dict(use_rope_layers=[True, False, True, True]), r"use_rope_layers = .* is not supported \(RoPE in every layer"),
            (dict(use_qk_norm=False), r"use_qk_norm = False is not supported \(true, as transformers' model\)"),
            (dict(sink=True), r"sink = True is not supported \(no attention sinks"),
            (dict(moe_layers_enum="1,x"), r"moe_layers_enum = '1,x' is not supported \(the MoE layers' indices\)")):
        config = dict(base, **change)
        if "moe_layers_enum" in change:
            config.pop("mlp_layer_types")
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["step3p5"].kwargs(config)


_MUSE_VISION = dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=2),
                    out_hidden_size=16, projector_hidden_size=16)


def _muse_text(**fields) -> dict:
    """A Muse Glimmer text config: four layers, transformers' default pattern (layers 0-2 over a window of 4 with RoPE, layer 3
    full without), the logits times 0.7 then capped at 3 (a cap the tiny model's logits reach), q/k/v/o biases."""
    return dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                sliding_window=4, final_logit_softcapping=3.0, output_multiplier=0.7, attention_bias=True, pad_token_id=None, bos_token_id=None,
                eos_token_id=None, **fields)


def _muse_round_trip(tmp_path, kind: str, config, changes, tol: float = 1e-5):
    """A released Muse folder of `kind` (config: transformers' config of the whole model):
    fmoe's logits against transformers' text-only forward on the torch and the Triton paths
    (within tol); each of `changes` to the config read moves them by more than 1e-3; not written
    back whole; written as its text model's family and read back exactly; a model of fmoe's
    own written so reads back as its config, and put beside the folder's other models gives
    transformers' logits of fmoe's. -> (the config read, the written text config)."""
    name = "MuseSpark" if kind == "muse_spark" else "MuseGlimmer"
    _, ids, cu = _packed()
    theirs = _saved_multimodal(getattr(transformers, f"{name}ForConditionalGeneration"), config, tmp_path / "vl")
    model, cfg = hf.from_pretrained(tmp_path / "vl", impl="torch")
    keys = [k for spec in hf.key_map(hf.FAMILIES[kind], cfg).values() for k in spec.keys]
    assert all(k.startswith("model.language_model.") or k == "lm_head.weight" for k in keys) and "lm_head.weight" in keys
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), theirs) < tol
        assert _rel(hf.from_pretrained(tmp_path / "vl", impl="triton")[0].logits(ids, cu), theirs) < tol
        for change in changes:  # each piece matters
            other = hf.Transformer(dataclasses.replace(cfg, **change))
            other.load_state_dict(model.state_dict(), strict=False)
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, change
    text_kind = f"{kind}_text"
    not_read = ", ".join(re.escape(p) for p in hf.FAMILIES[kind].not_read)
    with pytest.raises(ValueError, match=rf"model_type: a {kind} folder holds a model fmoe does not read \({not_read}\), so it is not written; "
                                         rf"pass model_type='{text_kind}'"):
        hf.save_pretrained(model, tmp_path / "whole")
    model.hf_config = hf.written_config(model.hf_config)
    out = hf.save_pretrained(model, tmp_path / "text")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (text_kind, [f"{name}TextModel"])
    back, back_cfg = hf.from_pretrained(out, impl="torch")
    assert back_cfg == cfg and all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    del back.hf_config  # fmoe's own: written from its config
    with torch.no_grad():
        for p in back.parameters():
            p.add_(0.01 * torch.randn_like(p))
    own = json.loads((hf.save_pretrained(back, tmp_path / "own", model_type=text_kind) / "config.json").read_text())
    assert hf.read_config(tmp_path / "own")[1] == dataclasses.replace(cfg, impl="auto")
    renamed = _beside_the_rest(tmp_path / "vl", tmp_path / "own", tmp_path / "again", own,
                               rename=lambda k: "model.language_model." + k[len("model."):] if k.startswith("model.") else k)
    with torch.no_grad():
        assert _rel(renamed, back.logits(ids, cu)) < tol
    return cfg, own


def test_muse_glimmer_folders_read_their_norms_scales_and_rope_or_none_per_layer(tmp_path):
    """A released Muse Glimmer folder (muse_glimmer, MuseGlimmerForConditionalGeneration): its
    text model loads with transformers' logits of a text-only forward on the torch and the
    Triton paths, the vision tower, adapter and projection unread: zero-centred sandwich norms
    whose post-norms have their own eps (1e-8 beside 1e-5), the embeddings normed without
    weights, the final norm's gain its weight itself, weightless per-head q/k norms with the
    queries scaled, the gated attention, NoPE in the full layer, the logits' multiplier and
    cap; each moves the logits. Written as muse_glimmer_text (which transformers has no causal
    LM of) and read back exactly (_muse_round_trip). What transformers' model is not is
    refused by name."""
    changes = (dict(post_norm_eps=1e-1), dict(norm_overrides=("embed:unit",)), dict(attn_scale=None), dict(nope_layers=None), dict(logit_divisor=1.0))
    cfg, own = _muse_round_trip(tmp_path, "muse_glimmer", transformers.MuseGlimmerConfig(text_config=_muse_text(), **_MUSE_VISION), changes)
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.norm_eps, cfg.post_norm_eps, cfg.norm_overrides) == (
        4, (0, 1, 2), (3,), 1e-5, 1e-8, ("embed:unit", "final:plain"))
    assert (cfg.attn_scale, cfg.logit_divisor, cfg.logit_softcap, cfg.qk_norm, cfg.attn_gate, cfg.tie_embeddings, cfg.qkv_bias, cfg.o_bias) == (
        3.87 * 8**-0.5, 1 / 0.7, 3.0, "rms", True, False, True, True)
    assert own["layer_rope_theta"] == [1e4, 1e4, 1e4, 0] and own["hidden_activation"] == "silu"
    # tied as the top level says; GeGLU; transformers' defaults of the layer kinds and bases
    tied = dict(transformers.MuseGlimmerConfig(text_config=_muse_text(), tie_word_embeddings=True, **_MUSE_VISION).to_dict(), model_type="muse_glimmer")
    assert TransformerConfig(**hf.FAMILIES["muse_glimmer"].kwargs(tied)).tie_embeddings
    base = {k: v for k, v in _muse_text(hidden_activation="gelu_pytorch_tanh").items() if k not in ("layer_types", "layer_rope_theta")}
    read = hf.FAMILIES["muse_glimmer_text"].kwargs(dict(base, model_type="muse_glimmer_text", num_hidden_layers=6))
    assert (read["mlp_act"], read["window_layers"], read["nope_layers"]) == ("gelu_tanh", (0, 2, 3, 4), (1, 5))
    for change, message in ((dict(layer_rope_theta=[1e4, 5e5, 1e4, 0]), r"layer_rope_theta = \[10000.0, 500000.0, 10000.0, 0\] is not supported"),
                            (dict(hidden_activation="relu"), r"hidden_activation = 'relu' is not supported \(silu \(SwiGLU\) or gelu_pytorch_tanh"),
                            (dict(final_logit_softcapping=None), r"final_logit_softcapping = None is not supported \(a positive number\)"),
                            (dict(qk_scale_factor=0), r"qk_scale_factor = 0 is not supported \(a positive number\)"),
                            (dict(post_norm_eps=-1.0), r"post_norm_eps = -1.0 is not supported \(a finite number >= 0\)"),
                            (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)),
                             r"rope_parameters of rope type 'yarn' lack original_max_position_embeddings"),
                            (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), r"rope type 'dynamic' is not supported")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["muse_glimmer_text"].kwargs(dict(_muse_text(), model_type="muse_glimmer_text", **change))


def test_muse_spark_folders_read_their_latent_moe_residual_gates_and_norms(tmp_path):
    """A released Muse Spark folder (muse_spark, MuseSparkForConditionalGeneration): Muse
    Glimmer's blocks with each head's output normed (o_norm), the attention's post-norm
    without a weight, the MLP's prescaled, each residual add weighed by its gate; latent MoE
    blocks (layers 1-3; layer 0 dense) routed in float32 on the scaled logits' sigmoids plus the
    correction bias, renormalised and scaled, the experts' input normed and each expert's
    output normed before its weight; each moves the logits. Its text model loads with
    transformers' logits (within 5e-5: transformers' own float32 logits are 2.1e-5 from its
    float64 ones, fmoe's 2.0e-5, and the two differ by up to 2.3e-5 as the CPU's kernels round), the vision and audio towers unread; written as
    muse_spark_text and back (_muse_round_trip)."""
    text = _muse_text(moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=24, routed_scaling_factor=1.5,
                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    config = transformers.MuseSparkConfig(text_config=text, audio_config=dict(out_hidden_size=32), **_MUSE_VISION)
    # (the attention's post-norm without a weight is the zero-centred one of weight 0: its keys are absent, below)
    changes = (dict(residual_gates=False), dict(attn_out_norm=False), dict(norm_overrides=("embed:unit", "final:plain", "attn_post:unit")),
               dict(router_scale=1.0), dict(moe_latent_norm=False),
               dict(expert_out_norm=False))  # (not route_scale: the MLP's post-norm takes any common scale of the routed weights out)
    cfg, own = _muse_round_trip(tmp_path, "muse_spark", config, changes, tol=5e-5)
    assert (cfg.n_dense, cfg.n_experts, cfg.k, cfg.ffn_expert, cfg.moe_latent, cfg.n_shared, cfg.score, cfg.expert_bias, cfg.route_scale) == (
        1, 4, 2, 16, 24, 0, "sigmoid", True, 1.5)
    assert (cfg.router_scale, cfg.residual_gate_temperature, cfg.attn_out_norm, cfg.moe_latent_norm, cfg.expert_out_norm) == (0.7, 0.3, True, True, True)
    assert cfg.norm_overrides == ("embed:unit", "final:plain", "attn_post:unit", "mlp_post:prescaled")
    assert own["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"] and own["output_multiplier"] == 0.7
    keys = [k for spec in hf.key_map(hf.FAMILIES["muse_spark"], cfg).values() for k in spec.keys]
    assert {"model.language_model.layers.1.mlp.experts.post_expert_norm.weight", "model.language_model.layers.1.mlp.pre_expert_norm.weight",
            "model.language_model.layers.0.post_attention_residual_gate.gate"} < set(keys)
    assert not any("post_attention_layernorm" in k for k in keys)
    with pytest.raises(ValueError, match=r"hidden_act = 'gelu' is not supported \(SwiGLU with silu\)"):
        hf.FAMILIES["muse_spark_text"].kwargs(dict(text, model_type="muse_spark_text", hidden_act="gelu"))


def test_hy_v4_vl_folders_read_their_text_model_with_rope_on_pairs_and_its_latent_norms_eps(tmp_path):
    """A released HY-V4-VL folder (hy_v4_vl, HYV4VLForConditionalGeneration): its text model,
    stored as HY-V4's folders store it (model., lm_head), loads with transformers' logits on
    the torch and the Triton paths, the vision tower (vit.) unread: HY-V4's model with RoPE on
    interleaved pairs in the attention and the indexer (each moves the logits) and the
    latents' norms at rms_norm_eps (mla_norm_eps: at 1e-6, HY-V4's, the logits are ten times
    further from transformers'). The head's hyper-connection weights as transformers writes
    them (model.hc_head.hc_pre.) or under HY-V4's prefix (model.hc_pre.hc_head.) are read and
    written back as the folder held them (transformers reads the former alone beside the vision
    tower). Not written back whole; written as hy_v4_vl_text and read back exactly, and a model
    of fmoe's own written so, put beside the vision tower again, loads in transformers with
    fmoe's logits."""
    _, ids, cu = _packed()
    text = {k: v for k, v in FAMILIES["hy_v4"]().to_dict().items() if k not in ("model_type", "architectures")}
    text["rope_parameters"] = dict(rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 0])
    config = transformers.HYV4VLConfig(text_config=text, vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                                             num_attention_heads=2, out_hidden_size=32))
    theirs = _saved_multimodal(transformers.HYV4VLForConditionalGeneration, config, tmp_path / "vl")
    model, cfg = hf.from_pretrained(tmp_path / "vl", impl="torch")
    assert (cfg.rope_interleaved, cfg.index_rope_interleaved, cfg.index_rope_last, cfg.mla_norm_eps, cfg.hyper_connections) == (True, True, True, 1e-5, 3)
    assert model.hf_hyper_head == "model.hc_head.hc_pre.hc_head_" and "vit.perceive.image_newline" in _read_all(tmp_path / "vl")
    with torch.no_grad():
        error = _rel(model.logits(ids, cu), theirs)
        assert error < 1e-5
        assert _rel(hf.from_pretrained(tmp_path / "vl", impl="triton")[0].logits(ids, cu), theirs) < 1e-5
        for change in (dict(rope_interleaved=False), dict(index_rope_interleaved=False), dict(mla_norm_eps=None)):
            other = hf.Transformer(dataclasses.replace(cfg, **change))
            other.load_state_dict(model.state_dict())
            assert _rel(other.logits(ids, cu), theirs) > (10 * error if "mla_norm_eps" in change else 1e-3), change
    # HY-V4's prefix of the head's weights: read, and written back so
    tensors = {k.replace("model.hc_head.hc_pre.hc_head_", "model.hc_pre.hc_head.hc_head_"): v for k, v in _read_all(tmp_path / "vl").items()}
    released = _copy_folder(tmp_path / "vl", tmp_path / "released", tensors)
    again, _ = hf.from_pretrained(released, impl="torch")
    assert again.hf_hyper_head == "model.hc_pre.hc_head.hc_head_"
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match=r"model_type: a hy_v4_vl folder holds a model fmoe does not read \(model.mtp_layers., vit.\), so it is not "
                                         "written; pass model_type='hy_v4_vl_text'"):
        hf.save_pretrained(model, tmp_path / "whole")
    for loaded, name in ((model, "text"), (again, "text_released")):
        loaded.hf_config = hf.written_config(loaded.hf_config)
        out = hf.save_pretrained(loaded, tmp_path / name)
        assert json.loads((out / "config.json").read_text())["model_type"] == "hy_v4_vl_text"
        back, back_cfg = hf.from_pretrained(out, impl="torch")
        assert back_cfg == cfg and back.hf_hyper_head == loaded.hf_hyper_head
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    del back.hf_config  # fmoe's own: written from its config
    with torch.no_grad():
        for p in back.parameters():
            p.add_(0.01 * torch.randn_like(p))
    own = json.loads((hf.save_pretrained(back, tmp_path / "own", model_type="hy_v4_vl_text") / "config.json").read_text())
    assert hf.read_config(tmp_path / "own")[1] == dataclasses.replace(cfg, impl="auto") and own["rope_parameters"]["mrope_section"] == [2, 0, 0]
    beside = _beside_the_rest(tmp_path / "vl", tmp_path / "own", tmp_path / "beside", own)
    with torch.no_grad():
        assert _rel(beside, back.logits(ids, cu)) < 1e-5


_APERTUS1P5_TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, output_vocab_size=48, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_apertus1p5_reads_its_pruned_output_head_and_released_folders(tmp_path):
    """Apertus 1.5's text model (apertus1p5_text): Apertus's model whose output head keeps the
    first output_vocab_size = 48 of the 64 ids (out_vocab): the logits [T, 48] and the loss
    over labels below 48 are transformers'; a label past the head stops the training forward
    (a device assert, no host read); re-exported bit for bit, and a model of fmoe's own written
    so loads in transformers with its logits. A released folder (apertus1p5) loads its text
    model, the image and audio tokenizers unread, and is written back as apertus1p5_text."""
    docs, ids, cu = _packed()
    torch.manual_seed(0)
    ref = _randomised(transformers.Apertus1p5TextForCausalLM(transformers.Apertus1p5TextConfig(**_APERTUS1P5_TEXT)))
    ref.save_pretrained(tmp_path / "hf")
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 48, (n,), generator=g) for n in DOCS]  # labels the head has rows for
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        want = sum(float(ref(d[None], labels=d[None]).loss) * (len(d) - 1) for d in texts) / sum(len(d) - 1 for d in texts)
        for impl in ("torch", "triton"):
            model, cfg = hf.from_pretrained(tmp_path / "hf", impl=impl)
            assert cfg.out_vocab == 48 and model.head.shape == (48, 32) and model.embed.shape == (64, 32)
            logits = model.logits(ids, cu)
            assert logits.shape == (ids.shape[0], 48) and _rel(logits, theirs) < 1e-5
            losses, _ = model(make_batch(torch.cat(texts), cu))
            assert float(losses["lm_sum"] / losses["lm_tokens"]) == pytest.approx(want, rel=1e-5)
        with pytest.raises(RuntimeError, match=r"labels: a counted label outside 0..47, the output head's rows \(out_vocab\)"):
            bad = torch.cat(texts)
            bad[1] = 60  # the label of document 0's first token
            model(make_batch(bad, cu))
    hf.save_pretrained(model, tmp_path / "again")
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "hf" / file, tmp_path / "again" / file, shallow=False), file
    del model.hf_config
    theirs = _exported_logits(model, tmp_path / "own", "apertus1p5_text", nudge=0.01)
    with torch.no_grad():
        assert _rel(theirs, model.logits(ids, cu)) < 1e-5
    with pytest.raises(ValueError, match="model: its config has no apertus equivalent: {'out_vocab': \\(48, None\\)}"):
        hf.save_pretrained(model, tmp_path / "plain", model_type="apertus")
    with pytest.raises(ValueError, match="out_vocab: expected 1..64, got 70"):
        TransformerConfig(**hf.FAMILIES["apertus1p5_text"].kwargs(dict(_APERTUS1P5_TEXT, model_type="apertus1p5_text", output_vocab_size=70)))
    with pytest.raises(ValueError, match="out_vocab: an output head of its own rows, not with tie_embeddings"):
        dataclasses.replace(cfg, tie_embeddings=True)
    # the released folders: the text model beside the image and audio tokenizers
    vision = dict(codebook_size=8, embed_dim=8, latent_channels=32, base_channels=32, channel_multiplier=[1], num_res_blocks=1, attn_resolutions=[],
                  resolution=8)
    audio = dict(model_type="wavtokenizer_encoder", codebook_size=8, num_filters=4, upsampling_ratios=[2], hidden_size=8, codebook_dim=8,
                 num_lstm_layers=1)
    config = transformers.Apertus1p5Config(text_config=_APERTUS1P5_TEXT, vision_config=vision, audio_config=audio, image_token_offset=48,
                                           audio_token_offset=56, image_token_id=40, audio_token_id=41)
    theirs = _saved_multimodal(transformers.Apertus1p5ForConditionalGeneration, config, tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="apertus1p5", prefix="model.language_model.",
                                             head="lm_head.weight", text_kind="apertus1p5_text")
    assert cfg.out_vocab == 48 and written["output_vocab_size"] == 48


def test_a_released_kimi_k25_folder_loads_its_text_model(folders, tmp_path):
    """A Kimi K2.5 / K2.6 folder (kimi_k25) as released: Kimi K2's text model under
    language_model.model. and language_model.lm_head (the layout transformers reads, with the
    same text logits), beside a vision tower and projector that are not read; its text_config
    (model_type kimi_k2) maps as a kimi_k2 folder's config. It is not written back without
    the vision tower; written as deepseek_v3 it loads in transformers with the same logits.
    With the text_config's int4 quantization_config, the experts load dequantised."""
    path, _ = folders["deepseek_v3"]
    kimi = _edit(path, tmp_path / "kimi", _kimi_k2)
    text = json.loads((kimi / "config.json").read_text())
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, patch_size=2, pos_emb_height=4,
                  pos_emb_width=4, pos_emb_time=1)
    whole = transformers.Kimi_K25Config(text_config=dict(text, model_type="deepseek_v3"), vision_config=vision, projection_hidden_size=16,
                                        tie_word_embeddings=False)
    config = dict(whole.to_dict(), architectures=["KimiK25ForConditionalGeneration"], text_config=text)
    torch.manual_seed(0)
    beside = {k.removeprefix("model."): v for k, v in transformers.Kimi_K25ForConditionalGeneration(whole).state_dict().items()
              if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    tensors = _read_all(kimi)
    released = {("language_model." + k): v for k, v in tensors.items()} | beside
    folder = _copy_folder(kimi, tmp_path / "k25", released, lambda c: [c.clear(), c.update(config)])
    plain = _edit(kimi, tmp_path / "plain", lambda c: [c.update(model_type="deepseek_v3"), c.pop("auto_map")])
    ref = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = torch.cat([ref(d[None]).logits[0] for d in docs])
        k25 = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        assert _rel(torch.cat([k25(input_ids=d[None]).logits[0] for d in docs]), want) < 1e-6  # transformers reads this layout
    model, cfg = hf.from_pretrained(folder, impl="torch")
    assert dataclasses.replace(cfg, impl="auto") == hf.read_config(kimi)[1] and not cfg.tie_embeddings
    assert all(k.startswith("language_model.") for spec in hf.key_map(hf.FAMILIES["kimi_k25"], cfg).values() for k in spec.keys)
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), want) < 1e-5
    with pytest.raises(ValueError, match="model_type: a kimi_k25 folder holds a model fmoe does not read .vision_tower., mm_projector.., "
                                         "so it is not written; pass model_type='deepseek_v3'"):
        hf.save_pretrained(model, tmp_path / "again")
    model.hf_config = hf.written_config(model.hf_config)
    out = hf.save_pretrained(model, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), want) < 1e-5
    # the released K2.5: int4 experts, the quantization_config in the text_config
    quantised, dequantised = _int4_experts(tensors, prefix="language_model.")
    int4 = _copy_folder(folder, tmp_path / "int4", quantised | beside, lambda c: c["text_config"].update(quantization_config=_INT4))
    model, _ = hf.from_pretrained(int4, impl="torch")
    for i in [i for i in range(cfg.n_layers) if cfg.is_moe(i)]:
        experts = model.blocks[i].mlp.experts
        for name, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            stacked = torch.stack([dequantised[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"].T for e in range(cfg.n_experts)])
            assert torch.equal(getattr(experts, name), stacked), (i, name)
    model.hf_config = hf.written_config(model.hf_config)
    out = hf.save_pretrained(model, tmp_path / "text-int4")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert all(torch.equal(_read_all(out)[k], v) for k, v in dequantised.items())


def test_a_released_kimi_linear_folder_loads_as_transformers_reads_it(folders, tmp_path):
    """Kimi Linear's released folders: the config in their own fields (linear_attn_config with
    its layers numbered from 1, first_k_dense_replace, mla_use_nope, the router's activation)
    maps as transformers' KimiLinearConfig reads it; the dense block's MLP under mlp. (where
    transformers writes block_sparse_moe.) loads with transformers' logits and is written back
    under that name, the weights bit-identical. mla_use_nope false, another router than the
    sigmoid and a layer outside the model are refused."""
    path, ref = folders["kimi_linear"]
    _, cfg = hf.read_config(path)

    def released(c):
        for name in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
            c.pop(name)
        c.update(linear_attn_config=dict(num_heads=4, head_dim=8, short_conv_kernel_size=4, full_attn_layers=[2], kda_layers=[1, 3]),
                 first_k_dense_replace=1, mla_use_nope=True, moe_router_activation_func="sigmoid")

    tensors = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in _read_all(path).items()}
    assert any(".0.mlp.gate_proj" in k for k in tensors)
    folder = _copy_folder(path, tmp_path / "released", tensors, released)
    config = json.loads((folder / "config.json").read_text())
    theirs = transformers.KimiLinearConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert hf.read_config(folder)[1] == cfg == TransformerConfig(**hf.FAMILIES["kimi_linear"].kwargs(dict(theirs.to_dict(), model_type="kimi_linear")))
    assert (cfg.linear_layers, cfg.nope_layers, cfg.linear_kind, cfg.n_dense) == ((0, 2), (1,), "kda", 1)
    model, _ = hf.from_pretrained(folder, impl="torch")
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), want) < TOL["kimi_linear"]
    out = hf.save_pretrained(model, tmp_path / "again")
    assert filecmp.cmp(folder / "model.safetensors", out / "model.safetensors", shallow=False)
    for change, match in ((dict(mla_use_nope=False), "mla_use_nope = False is not supported"),
                          (dict(moe_router_activation_func="softmax"), "moe_router_activation_func = 'softmax' is not supported"),
                          (dict(linear_attn_config=dict(config["linear_attn_config"], kda_layers=[1, 4])),
                           "linear_attn_config lists layer 4, not one of the 3 layers")):
        with pytest.raises(ValueError, match=match):
            hf.read_config(_edit(folder, tmp_path / f"bad-{len(str(change))}", lambda c: c.update(change)))


def test_released_routing_semantics_matter(folders):
    """The loaded DeepSeek-V3 needs its group rule (best 2 per group): Megatron's k //
    topk_groups rule picks other experts on this model's tokens, and other logits."""
    import dataclasses

    path, ref = folders["deepseek_v3"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    other = type(model)(dataclasses.replace(cfg, group_score_topk=None))
    other.load_state_dict(model.state_dict())
    _, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(other.logits(ids, cu), model.logits(ids, cu)) > 1e-3


def test_ernie_routes_on_probabilities_plus_its_bias_and_places_its_moe_blocks(folders, tmp_path):
    """ERNIE 4.5: the correction bias shifts the probabilities (with it zeroed, or added to
    the logits, the logits move away from transformers'), stored [1, E]; the MoE blocks every
    moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index, written back so;
    its MTP layers (model.mtp_*) read by neither transformers nor fmoe."""
    path, ref = folders["ernie4_5_moe"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.moe_layers, cfg.shared_size, cfg.score, cfg.pre_softmax, cfg.expert_bias) == ((1, 2), 16, "softmax", False, True)
    assert cfg.rope_interleaved and cfg.tie_embeddings and cfg.rope_base == 500000.0 and cfg.norm_eps == 1e-5
    assert hf.key_map(hf.FAMILIES["ernie4_5_moe"], cfg)["blocks.1.mlp.expert_bias"].unit == 0
    bias = model.blocks[1].mlp.expert_bias
    assert bias.abs().min() > 0  # the folder's random bias, read
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for moe in model.moe_layers().values():
            moe.expert_bias.zero_()
        assert _rel(model.logits(ids, cu), theirs) > 1e-3
    # the placement: every second block from 0 (blocks 1 and 3 of 4), written back with the same fields
    placed = _edit(path, tmp_path / "placed", lambda c: c.update(num_hidden_layers=4, moe_layer_start_index=0, moe_layer_end_index=-1,
                                                                moe_layer_interval=2))
    _, four = hf.read_config(placed)
    assert four.moe_layers == (1, 3) and not four.is_moe(0) and not four.is_moe(2)
    written = hf.hf_config(four, "ernie4_5_moe")
    assert (written["moe_layer_start_index"], written["moe_layer_end_index"], written["moe_layer_interval"]) == (1, 3, 2)
    assert hf.read_config(_edit(path, tmp_path / "back", lambda c: c.update(written)))[1] == four
    # MTP layers beside the trunk (the released folders' model.mtp_block.0..., model.mtp_linear_proj.0...) are not read
    tensors = _read_all(path)
    tensors["model.mtp_linear_proj.0.weight"] = torch.zeros(32, 64)
    with_mtp = _copy_folder(path, tmp_path / "mtp", tensors)
    again, _ = hf.from_pretrained(with_mtp, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), hf.from_pretrained(path, impl="torch")[0].state_dict().values()))


def test_the_loop_loads_a_released_model_into_sharded_ranks(tmp_path):
    """--init_from_hf under torchrun (2 gloo ranks, experts split over ep, the rest FSDP):
    each rank reads its own blocks of a DeepSeek-V3 folder (MLA, MTP layer included), and
    the run logs the losses of one process loading the same folder."""
    import pathlib
    import subprocess
    import sys

    torch.manual_seed(0)
    config = FAMILIES["deepseek_v3"]()
    config.vocab_size = 260
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hf")
    root = pathlib.Path(__file__).resolve().parents[1]
    args = [str(root / "examples" / "train_moe.py"), f"--init_from_hf={tmp_path / 'hf'}", "--steps=2", "--tokens_per_micro_batch=64",
            "--batch_schedule=0:2", "--eval_every=2", "--eval_batches=1", "--model.mtp_depth=1", "--model.impl=torch", "--lr=1e-2"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    runs = []
    for launch, out in (([sys.executable], "one"), ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"], "two")):
        extra = ["--ep=2"] if out == "two" else []
        run = run_in_session([*launch, *args, f"--out_dir={tmp_path / out}", *extra], capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        runs.append([json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()])
    one, two = runs
    for a, b in zip(one, two):
        for key in ("loss", "mtp_1_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])


SHARD_BYTES = 20000  # the sharded ranks' export: several files


def _load_sharded(rank, world, path, family, out):
    """One rank: the model built on meta, sharded (FSDP2 over 2 ranks, experts over ep 2; or
    its heads over tp 2, TP_FAMILIES: Sarvam's fused q/k/v rows, Kimi Linear's A_log [1, 1, N, 1]
    and replicated low-rank down projections, Laguna's blocks of their own head counts), materialised, then loaded: its bytes
    read and its gathered weights; then exported to `out` in shards of SHARD_BYTES (rank 0
    writes)."""
    from torch.distributed.tensor import DTensor

    import fmoe.parallel as parallel
    from fmoe.model import Transformer

    config, cfg = hf.read_config(path)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, impl="torch"))
    parallel.parallelize(model, parallel.build_meshes(tp=2) if family in TP_FAMILIES else parallel.build_meshes(ep=2, has_experts=True))
    parallel.materialize(model, torch.device("cpu"), seed=0)
    read = hf.load_weights(model, path, model_type=family)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in hf._tensors(model).items()}
    model.hf_config = config
    hf.save_pretrained(model, out, max_shard_bytes=SHARD_BYTES)
    assert (out / "config.json").is_file()  # every rank returns after rank 0 has written
    if rank == 0:  # a model without DTensors, saved by rank 0 alone: it waits for no other rank
        hf.save_pretrained(hf.from_pretrained(path, impl="torch")[0], out.with_name(out.name + "-plain"))
    return read, full


SHARDED_FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoeshared", "sarvam_moe", "kimi_linear", "laguna", "dbrx", "phimoe", "minimax",
                    "deepseek_v4")
TP_FAMILIES = ("sarvam_moe", "kimi_linear", "laguna", "deepseek_v4")  # Laguna's: each block's own query heads, a gate column per head;
# DeepSeek-V4's: its one kv head on both ranks, the output groups split


def _load_sharded_families(rank, world, paths, out):
    from parallel.dist import in_own_groups

    return {family: in_own_groups(_load_sharded, rank, world, path, family, out / family) for family, path in paths.items()}


@pytest.fixture(scope="module")
def sharded_loads(folders, tmp_path_factory):
    """Every SHARDED_FAMILIES folder loaded by 2 gloo ranks in one spawned process group:
    ([rank 0's {family: (read, full)}, ...], the folder of their exports)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from parallel.dist import run_distributed

    out = tmp_path_factory.mktemp("sharded_exports")
    return run_distributed(_load_sharded_families, 2, {family: folders[family][0] for family in SHARDED_FAMILIES}, out), out


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_each_rank_reads_only_its_own_blocks(family, folders, sharded_loads):
    """Loading into a sharded model reads each rank's blocks only (safetensors slices, this
    rank's experts), and the gathered weights are the one-process model's bit for bit."""
    path = folders[family][0]
    one, _ = hf.from_pretrained(path, impl="torch")
    want = {n: t.detach() for n, t in hf._tensors(one).items()}
    total = (path / "model.safetensors").stat().st_size
    results = [by_family[family] for by_family in sharded_loads[0]]
    for read, full in results:
        assert set(full) == set(want)
        for name, value in want.items():
            assert torch.equal(full[name], value), name
        # about half the weights, plus the small replicated ones (MiniMax's qkv_proj, per head its q, k and v rows, read once
        # for wq, wk and wv; DeepSeek-V4's q latents, its one key head, its compressors and indexer and the streams' weights,
        # replicated under tp, weigh more in this tiny model: each rank reads 65% of its bytes)
        assert read < (0.7 if family == "deepseek_v4" else 0.6) * total, (read, total)
    assert sum(read for read, _ in results) >= 0.95 * total - 4096  # together every tensor is read


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_sharded_ranks_export_the_one_process_files(family, folders, sharded_loads, tmp_path):
    """save_pretrained on the 2 ranks' sharded model (each parameter gathered in turn, rank
    0 writing the shards) gives the files of one process's export, byte for byte."""
    one, _ = hf.from_pretrained(folders[family][0], impl="torch")
    want = hf.save_pretrained(one, tmp_path / "one", max_shard_bytes=SHARD_BYTES)
    got = sharded_loads[1] / family
    names = sorted(f.name for f in want.iterdir())
    assert len(names) > 3 and sorted(f.name for f in got.iterdir()) == names
    for name in names:
        assert filecmp.cmp(want / name, got / name, shallow=False), name
    plain = got.with_name(family + "-plain")
    assert filecmp.cmp(folders[family][0] / "model.safetensors", plain / "model.safetensors", shallow=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_from_pretrained_allocates_in_the_dtype_asked_for(family, folders, tmp_path):
    """dtype=torch.bfloat16: every weight is the float32 load's cast to bf16 (the router and
    its bias stay float32), allocated in bf16 from the start, with the logits of the float32
    load cast afterwards; an MXFP4 checkpoint (gpt-oss) is dequantised into bf16 the same way."""
    path, _ = folders[family]
    full, _ = hf.from_pretrained(path, impl="torch")
    half, _ = hf.from_pretrained(path, impl="torch", dtype=torch.bfloat16)
    for (name, p32), (name16, p16) in zip(full.state_dict().items(), half.state_dict().items()):
        assert name == name16
        kept = name.endswith(("router", "router_bias", "expert_bias"))
        assert p16.dtype == (torch.float32 if kept else torch.bfloat16), name
        assert torch.equal(p16, p32.to(p16.dtype)), name
    _, ids, cu = _packed()
    with torch.no_grad():
        assert torch.equal(half.logits(ids, cu), full.to(torch.bfloat16).logits(ids, cu))
    with pytest.raises(ValueError, match="dtype: expected a floating torch.dtype"):
        hf.from_pretrained(path, dtype=torch.int32)
    if family == "gpt_oss":
        tensors = _read_all(path)
        g = torch.Generator().manual_seed(3)
        for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            E, n_in, n_out = tensors.pop(key).shape
            tensors[key + "_blocks"] = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
            tensors[key + "_scales"] = torch.randint(122, 126, (E, n_out, n_in // 32), generator=g, dtype=torch.uint8)
        folder = _copy_folder(path, tmp_path / "mxfp4", tensors, lambda c: c.update(quantization_config=dict(quant_method="mxfp4")))
        full, _ = hf.from_pretrained(folder, impl="torch")
        half, _ = hf.from_pretrained(folder, impl="torch", dtype=torch.bfloat16)
        for name in ("w_gate", "w_up", "w_down"):
            w16, w32 = getattr(half.blocks[0].mlp.experts, name), getattr(full.blocks[0].mlp.experts, name)
            assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))


def test_longcat_flash_reads_its_pairs_its_released_layout_and_routes_through_identity_experts(folders, tmp_path):
    """LongCat-Flash's layer j is fmoe's shortcut pair (2j, 2j + 1); the parity test's tokens
    reach its identity experts; a folder in the released layout (no rows for the zero experts,
    an MTP layer under model.mtp.) loads to the same model, neither read."""
    from safetensors.torch import load_file, save_file

    path, _ = folders["longcat_flash"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.n_layers, cfg.shortcut_moe, cfg.zero_experts, cfg.mla_scales, cfg.pre_softmax, cfg.route_scale, cfg.n_shared) == (4, True, 2, True, True, 6.0, 0)
    assert [cfg.shortcut(i) for i in range(4)] == ["out", "in", "out", "in"] and cfg.rope_interleaved and cfg.expert_bias
    docs, ids, cu = _packed()
    with torch.no_grad():
        _, stats = model(make_batch(ids, cu))
        want = model.logits(ids, cu)
    for layer in ("layer_0", "layer_2"):  # slots taken by the identity experts (4 and 5), and by the computing ones
        counts = stats[layer]["tokens_per_expert"]
        assert int(counts[cfg.n_experts:].sum()) > 0 and int(counts[:cfg.n_experts].sum()) > 0
    zero_rows = hf.zero_expert_keys(hf.FAMILIES["longcat_flash"], cfg)
    assert len(zero_rows) == 2 * 2 * 2 and "model.layers.1.mlp.experts.5.up_proj.weight" in zero_rows
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text((path / "config.json").read_text())
    weights = {k: v for k, v in load_file(path / "model.safetensors").items() if k not in zero_rows}
    weights["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, released / "model.safetensors", metadata={"format": "pt"})
    again, _ = hf.from_pretrained(released, impl="torch")
    with torch.no_grad():
        assert torch.equal(again.logits(ids, cu), want)
    # written back as the released folder had it: no zero rows (transformers' own folder gets them: the export test)
    hf.save_pretrained(again, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(k for k in weights if not k.startswith("model.mtp."))
    assert all(torch.equal(back[k], weights[k]) for k in back)
    with pytest.raises(ValueError, match="model: this family's layers are shortcut pairs of blocks"):
        hf.key_map(hf.FAMILIES["longcat_flash"], dataclasses.replace(cfg, shortcut_moe=False))


def test_bailing_hybrid_reads_the_unbounded_decay_and_leaves_its_mtp_layers_unread(folders, tmp_path):
    """Ling's hybrid: kda_safe_gate false is Kimi's softplus decay (linear_decay_bound None), read
    as transformers reads it; the MTP layers stored after the trunk's are not read; the linear
    blocks by layer_group_size where layer_types is left out."""
    from safetensors.torch import load_file, save_file

    path, _ = folders["bailing_hybrid"]
    _, cfg = hf.read_config(path)
    assert (cfg.linear_layers, cfg.linear_kind, cfg.linear_full_rank, cfg.linear_decay_bound) == ((0, 1), "kda", True, -5.0)
    assert cfg.attn_gate and cfg.attn_gate_per_head and cfg.rope_interleaved and cfg.n_dense == 1
    unbounded = _edit(path, tmp_path / "unbounded", lambda c: c.update(kda_safe_gate=False))
    model, cfg = hf.from_pretrained(unbounded, impl="torch")
    assert cfg.linear_decay_bound is None
    ref = transformers.AutoModelForCausalLM.from_pretrained(unbounded, dtype=torch.float32).eval()
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        want = model.logits(ids, cu)
        assert _rel(want, theirs) < 1e-5
    weights = load_file(unbounded / "model.safetensors")
    weights["model.layers.3.attention.dense.weight"] = torch.zeros(32, 20)  # an MTP layer's
    save_file(weights, unbounded / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        assert torch.equal(hf.from_pretrained(unbounded, impl="torch")[0].logits(ids, cu), want)
    grouped = _edit(path, tmp_path / "grouped", lambda c: c.pop("layer_types"))
    assert hf.read_config(grouped)[1].linear_layers == (0, 1)  # layer_group_size 3: the third layer attends


def test_hy_v4_reads_its_streams_and_indexer_layers_and_leaves_its_mtp_layers_unread(folders, tmp_path):
    """HY-V4: the streams (3, independent, x hc_magnitude), the indexer's RoPE on its last
    channels and its LayerNorm's eps, the shared indexer layers as config.json lists them or,
    left out, as transformers derives them (layer 0 and every fourth from layer 1 full); the
    MTP layers (model.mtp_layers.*) are not read; a model with hyper-connections is not
    written as a family without them."""
    path, _ = folders["hy_v4"]
    _, cfg = hf.read_config(path)
    assert (cfg.hyper_connections, cfg.hc_kind, cfg.hc_magnitude, cfg.hc_eps) == (3, "independent", 1.7, 1e-6)
    assert cfg.index_rope_last and not cfg.index_rope_interleaved and not cfg.rope_interleaved and cfg.index_norm_eps == 1e-5
    assert (cfg.index_shared_layers, cfg.attn_gate, cfg.attn_gate_per_head, cfg.attn_sinks) == ((2,), True, False, True)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_offset, cfg.n_dense, cfg.mtp_depth) == (1.0, 0.5, 0.0, 1, 0)
    six = _edit(path, tmp_path / "six", lambda c: c.update(num_hidden_layers=6, indexer_types=None, mlp_layer_types=None))
    assert hf.read_config(six)[1].index_shared_layers == (2, 3, 4)  # full: 0, 1, 5
    model, _ = hf.from_pretrained(path, impl="torch")
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = model.logits(ids, cu)
    unread = _with_extra_key(path, tmp_path / "mtp", "model.mtp_layers.0.self_attn.o_proj.weight", torch.zeros(32, 20))
    with torch.no_grad():
        assert torch.equal(hf.from_pretrained(unread, impl="torch")[0].logits(ids, cu), want)
    del model.hf_config
    with pytest.raises(ValueError, match=r"model: its config has no deepseek_v32 equivalent: .*'hyper_connections': \(3, 0\)"):
        hf.save_pretrained(model, tmp_path / "v32", model_type="deepseek_v32")
    # and a model without HY-V4's streams or clamp is not written as HY-V4
    for change in (dict(hyper_connections=0, hc_kind="manifold", hc_magnitude=2.0), dict(hc_kind="manifold"), dict(swiglu_limit=None)):
        with pytest.raises(ValueError, match=r"model: its config has no hy_v4 equivalent: HY-V4's blocks are independent hyper-connections"):
            hf.hf_config(dataclasses.replace(cfg, **change), "hy_v4")
    with pytest.raises(ValueError, match=r"config.json: swiglu_limit = None is not supported \(a positive clamp"):
        hf.read_config(_edit(path, tmp_path / "no_clamp", lambda c: c.update(swiglu_limit=None)))


def test_kolibri1_routes_on_the_logits_plus_the_bias_and_reads_its_layer_pattern(folders, tmp_path):
    """Kolibri-1: the correction bias (released as layers.{i}.moe.router.expert_bias) added to
    the logits to choose, which matters in this model: the same weights with the bias on the
    sigmoids give other logits, and such a model is not written as kolibri1. Sandwich norms,
    the window's layers with RoPE and the global one without; left out, layer_types is every
    fifth layer global; without a window, every layer global with RoPE."""
    path, ref = folders["kolibri1"]
    _, cfg = hf.read_config(path)
    assert (cfg.score, cfg.expert_bias, cfg.expert_bias_on_logits, cfg.route_normalize, cfg.n_dense, cfg.shared_size) == ("sigmoid", True, True, False, 0, 24)
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.qk_norm, cfg.pre_norms, cfg.post_norms) == (4, (0, 2), (1,), "head", True, True)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        model, _ = hf.from_pretrained(path, impl="torch")
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        on_sigmoids, _ = hf.from_pretrained(path, impl="torch", expert_bias_on_logits=False)
        assert _rel(on_sigmoids.logits(ids, cu), theirs) > 1e-2
    del on_sigmoids.hf_config
    with pytest.raises(ValueError, match=r"model: its config has no kolibri1 equivalent: .*'expert_bias_on_logits': \(False, True\)"):
        hf.save_pretrained(on_sigmoids, tmp_path / "on-sigmoids", model_type="kolibri1")
    ten = _edit(path, tmp_path / "ten", lambda c: c.update(num_hidden_layers=10, layer_types=None))
    assert hf.read_config(ten)[1].nope_layers == (4, 9)
    plain = _edit(path, tmp_path / "plain", lambda c: c.update(sliding_window=None, layer_types=["full_attention"] * 3))
    _, cfg = hf.read_config(plain)
    assert cfg.window is None and cfg.nope_layers is None


def test_deepseek_v4_reads_its_layers_ropes_hash_tables_and_leaves_its_mtp_layers_unread(folders, tmp_path):
    """DeepSeek-V4: the config reads as its pieces (manifold streams, a q latent, one key head that is its values with RoPE
    on its last channels in pairs, the queries' weightless norm, sinks, a window, the grouped output projection; the sliding
    layer's plain RoPE as the local layers', the compressed layers' YaRN as the global one, with attention_factor 1; the
    compressed sparse layer's rate, top-k and indexer heads;
    hashed then sqrt(softplus) MoE blocks), the hash table is read as stored (int64) and the hashed block has no correction
    bias; a folder that also holds DeepSeek's MTP layers (mtp.) loads with the same logits. An older config that names
    qk_rope_head_dim, num_hash_layers, compress_rate_hca, compress_rate_csa and rope_scaling instead reads the same. A model of fmoe's own
    with weighted query norms has no deepseek_v4 equivalent (named), nor one without the grouped output projection, which
    every DeepSeek-V4 has."""
    path, ref = folders["deepseek_v4"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.hyper_connections, cfg.hc_kind, cfg.hc_sinkhorn_iters, cfg.n_kv_heads, cfg.q_rank, cfg.rope_dim, cfg.rope_last,
            cfg.rope_interleaved, cfg.qk_norm, cfg.kv_shared, cfg.attn_sinks, cfg.window, cfg.o_groups, cfg.o_rank) == (
        3, "manifold", 5, 1, 12, 8, True, True, "head_k", True, True, 4, 2, 5)
    assert (cfg.compress_layers, cfg.compress_rate, cfg.window_layers, cfg.local_rope_base, cfg.rope_base, cfg.yarn_factor,
            cfg.yarn_original_max_positions, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == ((2,), 3, None, 100.0, 1000.0, 4.0, 8, 0.0, 0.0)
    assert (cfg.csa_layers, cfg.csa_rate, cfg.csa_topk, cfg.index_heads, cfg.index_head_dim) == ((1,), 2, 2, 8, 8)
    assert (cfg.hash_layers, cfg.score, cfg.route_scale, cfg.swiglu_limit, cfg.shared_swiglu_limit, cfg.n_dense) == (1, "sqrtsoftplus", 1.5, 0.5, 0.5, 0)
    table = model.blocks[0].mlp.hash_table
    assert table.dtype == torch.int64 and torch.equal(table, ref.model.layers[0].mlp.gate.tid2eid)
    assert not hasattr(model.blocks[0].mlp, "expert_bias") or model.blocks[0].mlp.expert_bias is None
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = model.logits(ids, cu)
        with_mtp = _with_extra_key(path, tmp_path / "mtp", "mtp.0.attn.wq_a.weight", torch.randn(12, 32))
        torch.testing.assert_close(hf.from_pretrained(with_mtp, impl="torch")[0].logits(ids, cu), want, rtol=0, atol=0)

    def legacy(c):
        del c["partial_rotary_factor"], c["rope_parameters"], c["mlp_layer_types"], c["compress_rates"]
        c.update(qk_rope_head_dim=8, num_hash_layers=1, compress_rate_hca=3, compress_rate_csa=2,
                 rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8))

    assert hf.read_config(_edit(path, tmp_path / "legacy", legacy))[1] == dataclasses.replace(cfg, impl="auto")
    with pytest.raises(ValueError, match=r"model: its config has no deepseek_v4 equivalent: .*'qk_norm': \('head', 'head_k'\)"):
        hf.hf_config(dataclasses.replace(cfg, qk_norm="head"), "deepseek_v4")
    with pytest.raises(ValueError, match=r"^model: its config has no deepseek_v4 equivalent: o_groups = None is not supported \(a positive int\)"):
        hf.hf_config(dataclasses.replace(cfg, o_groups=None, o_rank=None), "deepseek_v4")


def test_lara_mini_reads_its_fused_projection_norms_and_layer_pattern(folders, tmp_path):
    """Lara Mini: the Gated DeltaNet's q, k, v, z, b and a are runs of one in_proj's rows, in
    that order, and its gated norm is out_norm; the RMSNorms are plain (gain weight): read as
    Qwen3-Next's (1 + weight) the logits move. The window's layer has RoPE, the global one
    none; left out, layer_types is the released period of five. A model of fmoe's own with
    its blocks in another order exports as lara_mini with its logits; one whose global block
    has RoPE has no lara_mini equivalent."""
    from safetensors.torch import load_file

    path, ref = folders["lara_mini"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.linear_layers, cfg.window, cfg.window_layers, cfg.nope_layers, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == ((0,), 4, (1,), (2,), "head", True, True)
    assert (cfg.zero_centered_norms, [cfg.is_moe(i) for i in range(3)], cfg.shared_size, cfg.shared_gate, cfg.pre_softmax) == (
        False, [True] * 3, 24, False, False)
    in_proj = load_file(path / "model.safetensors")["model.layers.0.linear_attn.in_proj.weight"]
    assert in_proj.shape == (16 + 16 + 24 + 24 + 4 + 4, 32)  # q, k (2 heads of 8), v, z (4 heads of 6), b, a (4 heads)
    attn = model.blocks[0].attn
    for weight, start in ((attn.wq, 0), (attn.wk, 16), (attn.wv, 32), (attn.wz, 56), (attn.wb, 80), (attn.wa, 84)):
        assert torch.equal(weight.detach(), in_proj[start:start + weight.shape[1]].T)
    assert "model.layers.0.linear_attn.out_norm.weight" in hf.key_map(hf.FAMILIES["lara_mini"], cfg)["blocks.0.attn.out_norm"].keys
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-4
        centred, _ = hf.from_pretrained(path, impl="torch", zero_centered_norms=True)
        assert _rel(centred.logits(ids, cu), theirs) > 1e-2
    ten = hf.read_config(_edit(path, tmp_path / "ten", lambda c: c.update(num_hidden_layers=10, layer_types=None)))[1]
    kinds = transformers.LaraMiniConfig(num_hidden_layers=10).layer_types
    assert ten.linear_layers == tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention") == (0, 2, 5, 7)
    assert ten.window_layers == tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") == (1, 4, 6, 9)
    assert ten.nope_layers == tuple(i for i, kind in enumerate(kinds) if kind == "full_attention") == (3, 8)

    own = TransformerConfig(vocab_size=V, hidden=32, n_layers=3, n_dense=0, n_experts=4, k=2, ffn_expert=16, n_shared=0, shared_ffn=24,
                            shared_gate=False, score="softmax", expert_bias=False, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=0, init_std=0.2,
                            qk_norm="head", linear_layers=(1,), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3,
                            window=4, window_layers=(2,), nope_layers=(0,))
    mine = hf.Transformer(own)
    mine.reset_parameters(seed=1)
    hf.save_pretrained(mine, tmp_path / "own", model_type="lara_mini")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["layer_types"] == ["full_attention", "linear_attention", "sliding_attention"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(mine.logits(ids, cu), torch.cat([theirs(d[None]).logits[0] for d in docs])) < 1e-4
    with pytest.raises(ValueError, match=r"model: its config has no lara_mini equivalent: .*'nope_layers': \(None, \(0,\)\)"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(own, nope_layers=None)), tmp_path / "roped", model_type="lara_mini")


def test_gemma3_reads_its_norms_scales_rope_per_layer_type_and_released_folders(folders, tmp_path):
    """Gemma 3: GeGLU, zero-centred sandwich norms, the embeddings x sqrt(hidden), the softmax
    scale query_pre_attn_scalar ** -0.5, the window's layers with their own plain RoPE and the
    global one with linear RoPE, the capped logits; read with SwiGLU or without the linear
    factor the logits move. An older config.json (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) reads as the same model; left out, five layers in
    six slide. A released gemma3 folder (Gemma3ForConditionalGeneration) loads its text model
    under language_model., the vision model unread, and is written back as gemma3_text."""
    path, ref = folders["gemma3_text"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.mlp_act, cfg.zero_centered_norms, cfg.pre_norms, cfg.post_norms, cfg.qk_norm, cfg.embed_scale, cfg.attn_scale) == (
        "gelu_tanh", True, True, True, "head", 32**0.5, 6**-0.5)
    assert (cfg.window, cfg.window_layers, cfg.rope_base, cfg.rope_linear_factor, cfg.local_rope_base, cfg.logit_softcap) == (
        4, (0, 2), 10000.0, 2.0, 100.0, 3.0)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for knob, value in (("mlp_act", "silu"), ("rope_linear_factor", None)):
            other, _ = hf.from_pretrained(path, impl="torch", **{knob: value})
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, knob
    older = _edit(path, tmp_path / "older", lambda c: (c.pop("rope_parameters"), c.pop("layer_types"), c.update(
        rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=2.0), sliding_window_pattern=2)))
    assert hf.read_config(older)[1] == dataclasses.replace(cfg, impl="auto")
    six = hf.read_config(_edit(path, tmp_path / "six", lambda c: c.update(num_hidden_layers=12, layer_types=None)))[1]
    assert six.window_layers == tuple(i for i, kind in enumerate(transformers.Gemma3TextConfig(num_hidden_layers=12).layer_types)
                                      if kind == "sliding_attention") == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)

    text = dict(FAMILIES["gemma3_text"]().to_dict(), final_logit_softcapping=None)  # which Gemma3ForConditionalGeneration would not apply
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    released = _randomised(transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(text_config=text, vision_config=vision,
                                                                                                  mm_tokens_per_image=4)))
    released.save_pretrained(tmp_path / "gemma3")
    loaded, read = hf.from_pretrained(tmp_path / "gemma3", impl="torch")
    assert read == dataclasses.replace(cfg, logit_softcap=None)
    keys = [k for spec in hf.key_map(hf.FAMILIES["gemma3"], read).values() for k in spec.keys]
    assert all(k.startswith("language_model.") for k in keys)
    with torch.no_grad():
        theirs = torch.cat([released(input_ids=d[None]).logits[0] for d in docs])
        assert _rel(loaded.logits(ids, cu), theirs) < 1e-5
    loaded.hf_config = hf.written_config(loaded.hf_config)
    assert loaded.hf_config["model_type"] == "gemma3_text"
    hf.save_pretrained(loaded, tmp_path / "text")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(torch.cat([back(d[None]).logits[0] for d in docs]), theirs) < 1e-5
    silu = dataclasses.replace(read, mlp_act="silu", impl="torch")  # GeGLU is Gemma's: a SwiGLU model has no gemma3_text equivalent
    with pytest.raises(ValueError, match=r"model: its config has no gemma3_text equivalent: \{'mlp_act': \('silu', 'gelu_tanh'\)\}"):
        hf.save_pretrained(hf.Transformer(silu), tmp_path / "silu", model_type="gemma3_text")
    capped = _edit(tmp_path / "gemma3", tmp_path / "capped", lambda c: c["text_config"].update(final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="config.json: final_logit_softcapping = 30.0 is not supported \\(none in a gemma3 folder"):
        hf.read_config(capped)


def test_granite_4_hybrid_reads_its_mamba2_mixers_rope_or_none_and_layer_names(folders, tmp_path):
    """Granite 4.0-H: Mamba-2 mixers (linear_kind "mamba2": 2 groups of C and B of a state of 8
    read by 4 heads of 16, 3 taps) in the layers layer_types names mamba (or linear_attention),
    attention without RoPE in the others unless position_embedding_type is "rope" (then the
    logits equal transformers' too, and reading without it moves them); left out, every
    layer is a mixer; Granite's multipliers."""
    path, ref = folders["granitemoehybrid"]
    _, cfg = hf.read_config(path)
    assert (cfg.linear_layers, cfg.linear_kind, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_conv,
            cfg.nope_layers, cfg.shared_size, cfg.attn_scale, cfg.logit_divisor) == ((0, 2), "mamba2", 2, 4, 8, 16, 3, (1,), 20, 0.3, 4.0)
    named = _edit(path, tmp_path / "named", lambda c: c.update(layer_types=["linear_attention", "full_attention", "linear_attention"]))
    assert hf.read_config(named)[1] == cfg
    assert hf.read_config(_edit(path, tmp_path / "all", lambda c: c.pop("layer_types")))[1].linear_layers == (0, 1, 2)
    roped = _edit(path, tmp_path / "rope", lambda c: c.update(position_embedding_type="rope"))
    model, read = hf.from_pretrained(roped, impl="torch")
    unroped, _ = hf.from_pretrained(roped, impl="torch", nope_layers=(1,))
    assert read.nope_layers is None
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(transformers.AutoModelForCausalLM.from_pretrained(roped, dtype=torch.float32).eval(), docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5 < 1e-3 < _rel(unroped.logits(ids, cu), theirs)


def test_granite_4_hybrid_micro_reads_its_shared_mlp_as_dense_blocks(tmp_path):
    """Granite 4.0-H-Micro (num_local_experts 0): every block's MLP the shared one alone
    (shared_mlp.input_linear, the gate's rows then the up's; output_linear), read as dense
    blocks with transformers' logits; written back bit for bit; an fmoe model of mixed MoE and
    dense blocks is refused as Granite 4.0-H."""
    config = dict(FAMILIES["granitemoehybrid"]().to_dict(), num_local_experts=0)
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(transformers.GraniteMoeHybridConfig(**config)))
    ref.save_pretrained(tmp_path / "micro")
    model, cfg = hf.from_pretrained(tmp_path / "micro", impl="torch")
    assert (cfg.n_dense, cfg.ffn_dense, cfg.linear_kind, cfg.linear_layers) == (3, 20, "mamba2", (0, 2))
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    hf.save_pretrained(model, tmp_path / "again")
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "micro" / file, tmp_path / "again" / file, shallow=False), file
    mixed = hf.Transformer(dataclasses.replace(cfg, n_dense=1, n_experts=4, k=2, ffn_expert=16, shared_ffn=20))
    with pytest.raises(ValueError, match=r"model: Granite 4.0-H's blocks are all MoE or all dense; this model has MoE layers \[1, 2\] of 3"):
        hf.save_pretrained(mixed, tmp_path / "mixed", model_type="granitemoehybrid")


@pytest.mark.parametrize("family", ["mixtral", "minimax_m2", "minimax", "phimoe"])
def test_mixtral_like_configs_write_the_experts_size_as_intermediate_size(family, folders):
    """Mixtral's layout names the experts' width intermediate_size: an fmoe model whose dense
    MLP width differs (unused there) writes its experts' (48, not 40), and reads back alike."""
    _, cfg = hf.read_config(folders[family][0])
    cfg = dataclasses.replace(cfg, ffn_expert=48, ffn_dense=40)
    written = hf.hf_config(cfg, family)
    assert written["intermediate_size"] == 48 and hf.FAMILIES[family].kwargs(written)["ffn_expert"] == 48


def test_qwen3_next_reads_and_writes_its_mtp_module(folders, tmp_path):
    """Qwen3-Next's MTP module (mtp.: pre_fc_norm_embedding, pre_fc_norm_hidden, fc, one full
    attention block with its MoE, norm) is fmoe's MTP depth 1 with its own output norm: written
    by save_pretrained (on the final norm: with a copy of it as mtp.norm), read back where the
    folder holds it (mtp.fc; transformers itself skips it); one depth only; and its loss is the cross-entropy of transformers' own block on fc([norm(emb(t + 1));
    norm(h_t)]) against token t + 2, h the trunk's output before its final norm (its last
    layer's, here checked to be that). A folder without it loads with none."""
    path, ref = folders["qwen3_next"]
    assert hf.from_pretrained(path, impl="torch")[1].mtp_depth == 0
    model, _ = hf.from_pretrained(path, impl="torch", mtp_depth=1, mtp_norm=True)
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("mtp."):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(model, tmp_path / "mtp")
    tensors = _read_all(tmp_path / "mtp")
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(tensors)
    again, cfg = hf.from_pretrained(tmp_path / "mtp", impl="torch")
    assert (cfg.mtp_depth, cfg.mtp_norm) == (1, True)
    mine = dict(model.named_parameters())
    for name, p in again.named_parameters():
        assert torch.equal(p, mine[name]), name
    asked, asked_cfg = hf.from_pretrained(tmp_path / "mtp", impl="torch", mtp_depth=1)  # the depth given: the module's own norm still read
    assert asked_cfg.mtp_norm and torch.equal(asked.mtp[0].out_norm.weight, mine["mtp.0.out_norm.weight"])
    with pytest.raises(ValueError, match=r"reads nowhere, e\.g\. 'mtp\.norm\.weight'"):  # on the final norm, its own would be lost
        hf.from_pretrained(tmp_path / "mtp", impl="torch", mtp_depth=1, mtp_norm=False)

    # transformers' block on the module's weights: a one-layer Qwen3-Next whose layer, final norm are the module's
    hf_cfg = dict(ref.config.to_dict(), num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    mini = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"], "lm_head.weight": tensors["lm_head.weight"],
            "model.norm.weight": tensors["mtp.norm.weight"],
            **{"model.layers.0." + k[len("mtp.layers.0."):]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")}}
    (tmp_path / "mini").mkdir()
    from safetensors.torch import save_file
    save_file(mini, tmp_path / "mini" / "model.safetensors")
    (tmp_path / "mini" / "config.json").write_text(json.dumps(hf_cfg))
    block = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mini", dtype=torch.float32).eval()
    norm = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=ref.config.rms_norm_eps) * (1 + w)  # noqa: E731 zero-centred
    ids = _packed()[0][1]
    L = len(ids)
    with torch.no_grad():
        seen = []
        hook = ref.model.layers[-1].register_forward_hook(lambda mod, args, output: seen.append(output[0] if isinstance(output, tuple) else output))
        out = ref(ids[None])
        hook.remove()
        h = seen[0][0]
        torch.testing.assert_close(ref.lm_head(ref.model.norm(h)), out.logits[0])  # the trunk's output before the final norm
        x = torch.cat([norm(ref.model.embed_tokens(ids[1:]), tensors["mtp.pre_fc_norm_embedding.weight"]),
                       norm(h[:-1], tensors["mtp.pre_fc_norm_hidden.weight"])], -1) @ tensors["mtp.fc.weight"].T
        logits = block(inputs_embeds=x[None]).logits[0]
        want = torch.nn.functional.cross_entropy(logits[:-1], ids[2:], reduction="sum")
        batch = make_batch(ids, torch.tensor([0, L]), 1)
        losses, _ = again(batch, again.context(batch))
    assert float(losses["mtp_1_sum"]) == pytest.approx(float(want), rel=1e-5)
    # a module on the trunk's final norm (mtp_norm=False) is written with a copy of it as mtp.norm, and reads back the same
    shared, _ = hf.from_pretrained(path, impl="torch", mtp_depth=1)
    hf.save_pretrained(shared, tmp_path / "shared")
    assert torch.equal(_read_all(tmp_path / "shared")["mtp.norm.weight"], shared.norm.weight.detach())
    back, cfg = hf.from_pretrained(tmp_path / "shared", impl="torch")
    own = hf.Transformer(dataclasses.replace(cfg, impl="torch"))  # fmoe's own: its config.json counts the module as the released ones do
    assert hf.save_pretrained(own, tmp_path / "own", model_type="qwen3_next") and json.loads((tmp_path / "own" / "config.json").read_text())[
        "mtp_num_hidden_layers"] == 1
    with torch.no_grad():
        assert cfg.mtp_norm and torch.equal(back(batch, back.context(batch))[0]["mtp_1_sum"], shared(batch, shared.context(batch))[0]["mtp_1_sum"])
    with pytest.raises(ValueError, match=r"model: mtp_depth = 2; this family's checkpoints hold one MTP module \(mtp.\), its depth 1"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(cfg, mtp_depth=2)), tmp_path / "two", model_type="qwen3_next")


def test_minimax_reads_lightning_attention_its_decay_and_normed_residuals(folders, tmp_path):
    """MiniMax: the lightning blocks that layer_types names (by default every second layer
    from layer 1), their decay per head and depth equal to transformers' slope_rate buffers,
    the normed residual's alpha and the output's beta; read without the normed residual, or
    with other weights, the logits move. A folder whose slope_rate is not the decay fmoe
    computes is refused, naming the key; save_pretrained writes the decay tables as
    transformers computes them (the bit-identical re-export of test_export_loads_...)."""
    path, ref = folders["minimax"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.linear_layers, cfg.linear_kind, cfg.linear_v_heads, cfg.linear_v_dim, cfg.normed_residual, cfg.residual_scale, cfg.n_dense) == (
        (0, 2), "lightning", 4, 8, 1.7, 0.6, 0)
    for i in cfg.linear_layers:
        theirs = ref.model.layers[i].self_attn.slope_rate.flatten()
        assert torch.equal(-lightning_decay(4, i, 3), theirs), i
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for knob, value in (("normed_residual", None), ("normed_residual", 1.0), ("residual_scale", 1.0)):
            other, _ = hf.from_pretrained(path, impl="torch", **{knob: value})
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, (knob, value)
    default = hf.read_config(_edit(path, tmp_path / "default", lambda c: c.pop("layer_types")))[1]
    assert default.linear_layers == tuple(i for i, kind in enumerate(transformers.MiniMaxConfig(num_hidden_layers=3).layer_types)
                                          if kind == "linear_attention") == (1,)
    tensors = _read_all(path)
    tensors["model.layers.2.self_attn.slope_rate"] = tensors["model.layers.2.self_attn.slope_rate"] * 2
    edited = _copy_folder(path, tmp_path / "slopes", tensors, lambda c: None)
    with pytest.raises(ValueError, match=r"checkpoint: model.layers.2.self_attn.slope_rate is not the lightning decay fmoe computes"):
        hf.from_pretrained(edited, impl="torch")


def test_nemotron_h_reads_its_layers_as_blocks_and_refuses_what_it_cannot_pair(folders, tmp_path):
    """Nemotron-H's layers M E M * E M - - are fmoe's blocks (M E), (M), (* E), (M -), (-):
    block 1 without an MLP, block 4 without a mixer (Nemotron-H-47B's runs of MLP layers),
    blocks 0 and 2 MoE (experts and a shared expert without a gate), each block's MLP and its
    norm from the layer after its mixer's, under backbone.; the older hybrid_override_pattern
    reads the same. dt's floor (time_step_min) binds in this model: without it the logits
    move. Unknown layer kinds and what transformers would build otherwise are refused by name."""
    path, ref = folders["nemotron_h"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.n_layers, cfg.linear_layers, cfg.nope_layers, cfg.mlp_free_layers, cfg.mixer_free_layers, cfg.moe_layers, cfg.linear_dt_min,
            cfg.mlp_act) == (5, (0, 1, 3), (2,), (1,), (4,), (0, 2), 0.5, "relu2")
    assert (cfg.n_experts, cfg.k, cfg.ffn_expert, cfg.shared_size, cfg.score, cfg.n_groups, cfg.group_score_topk, cfg.route_scale) == (
        4, 2, 24, 20, "sigmoid", 2, 2, 2.5)
    keys = hf.key_map(hf.FAMILIES["nemotron_h"], cfg)
    assert keys["blocks.2.attn.wq"].keys == ("backbone.layers.3.mixer.q_proj.weight",)
    assert keys["blocks.2.mlp_norm.weight"].keys == ("backbone.layers.4.norm.weight",)
    assert keys["blocks.2.mlp.experts.w_up"].keys == tuple(f"backbone.layers.4.mixer.experts.{e}.up_proj.weight" for e in range(4))
    assert keys["blocks.2.mlp.shared.w_down"].keys == ("backbone.layers.4.mixer.shared_experts.down_proj.weight",)
    assert keys["blocks.2.mlp.expert_bias"].keys == ("backbone.layers.4.mixer.gate.e_score_correction_bias",)
    assert keys["blocks.3.attn.A_log"].keys == ("backbone.layers.5.mixer.A_log",)
    assert keys["blocks.3.mlp.w_up"].keys == ("backbone.layers.6.mixer.up_proj.weight",)
    assert keys["blocks.4.mlp_norm.weight"].keys == ("backbone.layers.7.norm.weight",)
    assert keys["blocks.4.mlp.w_up"].keys == ("backbone.layers.7.mixer.up_proj.weight",)
    assert not any(name.startswith(("blocks.1.mlp", "blocks.4.attn")) or name.endswith("w_gate") for name in keys)
    assert "blocks.1.mlp" not in dict(model.named_modules()) and model.blocks[4].attn is None
    pattern = hf.read_config(_edit(path, tmp_path / "pattern", lambda c: (c.pop("layers_block_type"), c.update(hybrid_override_pattern="MEM*EM--"))))[1]
    assert pattern == hf.read_config(path)[1]
    _needs_its_dt_floor(path, ref, model)
    config = json.loads((path / "config.json").read_text())
    runs = TransformerConfig(**hf.FAMILIES["nemotron_h"].kwargs(dict(config, layers_block_type=["mlp", "mlp", "linear_attention", "moe", "moe"])))
    assert (runs.n_layers, runs.mixer_free_layers, runs.mlp_free_layers, runs.moe_layers) == (4, (0, 1, 3), None, (2, 3))
    for change, message in (
            (dict(layers_block_type=["linear_attention", "mamba2"]), r"layer 1 is 'mamba2'; expected linear_attention, full_attention, mlp or moe"),
            (dict(layers_block_type=None, hybrid_override_pattern="M-X"), r"hybrid_override_pattern = 'M-X' is not supported"),
            (dict(tie_word_embeddings=True), r"tie_word_embeddings = True is not supported \(an untied head"),
            (dict(mlp_hidden_act="silu"), r"mlp_hidden_act = 'silu' is not supported \(relu2"),
            (dict(use_conv_bias=False), r"use_conv_bias = False is not supported"),
            (dict(use_bias=True), r"use_bias = True is not supported \(no biases on the mixer's projections\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["nemotron_h"].kwargs(dict(config, **change))


def test_stablelm_reads_its_norms_partial_rope_and_parallel_residual(folders, tmp_path):
    """StableLM: LayerNorms with biases, RoPE on the first partial_rotary_factor of each head,
    q/k/v biases, each head's q/k LayerNorm its own module (read stacked into qk_norm
    "head_layer"); with use_parallel_residual (StableLM-3B's form) the attention and the MLP
    of one normed input: transformers' logits, and a bit-identical re-export."""
    from safetensors.torch import load_file

    _, cfg = hf.read_config(folders["stablelm"][0])
    assert (cfg.layer_norms, cfg.norm_bias, cfg.rope_dim, cfg.qkv_bias, cfg.qk_norm, cfg.parallel_blocks) == (True, True, 2, True, "head_layer", False)
    config = FAMILIES["stablelm"]()
    config.use_parallel_residual, config.qk_layernorm, config.use_qkv_bias = True, False, False
    config.rope_parameters["partial_rotary_factor"] = 0.5
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert (cfg.parallel_blocks, cfg.rope_dim, cfg.qk_norm, cfg.qkv_bias) == (True, 4, None, False)
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
    hf.save_pretrained(model, tmp_path / "again")
    assert filecmp.cmp(tmp_path / "hf" / "model.safetensors", tmp_path / "again" / "model.safetensors", shallow=False)
    assert "model.layers.0.post_attention_layernorm.weight" not in load_file(tmp_path / "again" / "model.safetensors")


def _needs_its_dt_floor(path, ref, model):
    """model (read from path) gives transformers' model ref's logits; read without its Mamba-2
    dt floor (linear_dt_min 0), the logits move: the floor binds in these weights."""
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        unfloored, _ = hf.from_pretrained(path, impl="torch", linear_dt_min=0.0)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5 < 1e-3 < _rel(unfloored.logits(ids, cu), theirs)


def test_apertus_reads_its_xielu_and_checks_its_constants(folders, tmp_path):
    """Apertus's MLPs: up_proj, xIELU with its learned alpha_p and alpha_n (read as each MLP's
    xielu_alpha_p / xielu_alpha_n), down_proj; xIELU's constants beta and eps, stored beside
    them, are checked (a folder with another beta is refused by name) and written on export
    (the re-export of test_export_... is bit-identical)."""
    path, _ = folders["apertus"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    tensors = _read_all(path)
    assert cfg.mlp_act == "xielu" and model.blocks[0].mlp.w_gate is None
    assert torch.equal(model.blocks[1].mlp.xielu_alpha_n.detach(), tensors["model.layers.1.mlp.act_fn.alpha_n"])
    assert float(tensors["model.layers.0.mlp.act_fn.beta"]) == 0.5 and tensors["model.layers.0.mlp.act_fn.eps"].shape == ()
    tensors["model.layers.2.mlp.act_fn.beta"] = torch.tensor(0.25)
    with pytest.raises(ValueError, match=r"checkpoint: model.layers.2.mlp.act_fn.beta = 0.25 is not xIELU's constant fmoe computes with, 0.5"):
        hf.from_pretrained(_copy_folder(path, tmp_path / "beta", tensors), impl="torch")


def test_mamba2_reads_every_layer_as_a_mixer_alone_with_its_dt_clamp(folders):
    """Mamba-2: every block a Mamba-2 mixer without an MLP; time_step_limit's lower end (0.5
    here, which these weights reach) is linear_dt_min: without it the logits move. An upper
    clamp, heads that are not expand x hidden_size channels and projection biases are refused."""
    path, ref = folders["mamba2"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert cfg.linear_layers == cfg.mlp_free_layers == (0, 1, 2) and (cfg.linear_v_heads, cfg.linear_v_dim, cfg.linear_dt_min) == (4, 16, 0.5)
    assert not any(".mlp" in name for name, _ in model.named_parameters()) and all(type(b.attn).__name__ == "LinearAttention" for b in model.blocks)
    _needs_its_dt_floor(path, ref, model)
    config = json.loads((path / "config.json").read_text())
    for change, message in ((dict(time_step_limit=[0.0, 1.0]), r"time_step_limit = \[0.0, 1.0\] is not supported \(dt clamped below only"),
                            (dict(head_dim=8), r"num_heads x head_dim = 4 x 8 is not supported \(expand x hidden_size, 64"),
                            (dict(use_bias=True), r"use_bias = True is not supported")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["mamba2"].kwargs(dict(config, **change))


def test_llama_s_model_under_internlm3_iquestcoder_and_ministral_configs(folders, tmp_path):
    """InternLM3's released config.json names its biases qkv_bias and bias (one setting: apart,
    refused on reading and on export); IQuest-Coder refuses clip_qkv and a sliding window, as
    transformers does; Ministral's windows follow layer_types (by default every layer slides)."""
    path, ref = folders["internlm3"]
    config = json.loads((path / "config.json").read_text())
    released = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")}
    released.update(qkv_bias=True, bias=True, architectures=["InternLM3ForCausalLM"])
    (tmp_path / "released").mkdir()
    (tmp_path / "released" / "config.json").write_text(json.dumps(released))
    shutil.copy(path / "model.safetensors", tmp_path / "released")
    model, cfg = hf.from_pretrained(tmp_path / "released", impl="torch")
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
    with pytest.raises(ValueError, match=r"qkv_bias \(attention_bias\) = True beside bias \(mlp_bias\) = False is not supported"):
        hf.FAMILIES["internlm3"].kwargs(dict(released, bias=False))
    with pytest.raises(ValueError, match=r"model: InternLM3's attention and MLP biases are one setting; this model has qkv_bias = True, mlp_bias = False"):
        hf.hf_config(dataclasses.replace(cfg, mlp_bias=False), "internlm3")
    iquest = json.loads((folders["iquestcoder"][0] / "config.json").read_text())
    for change, message in ((dict(clip_qkv=8.0), r"clip_qkv = 8.0 is not supported \(no clamp of q, k and v\)"),
                            (dict(use_sliding_window=True), r"use_sliding_window = True is not supported \(no sliding window\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["iquestcoder"].kwargs(dict(iquest, **change))
    ministral = json.loads((folders["ministral"][0] / "config.json").read_text())
    assert TransformerConfig(**hf.FAMILIES["ministral"].kwargs(ministral)).window_layers == (0, 2)
    every = TransformerConfig(**hf.FAMILIES["ministral"].kwargs({k: v for k, v in ministral.items() if k != "layer_types"}))
    assert (every.window, every.window_layers) == (4, None)  # every layer


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_mamba_reads_every_layer_as_a_mamba1_mixer_alone(family, folders, tmp_path):
    """Mamba and Falcon Mamba: every block a Mamba-1 mixer without an MLP (64 channels, a state
    of 8, dt of rank 3, "auto": ceil(hidden / 16)); Falcon Mamba's weightless norms on dt, B
    and C with their own eps (without it the logits move). Projection biases, a convolution
    without biases and another activation are refused; an fmoe model whose channels are no
    multiple of hidden is not written."""
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert cfg.linear_layers == cfg.mlp_free_layers == (0, 1, 2) and cfg.linear_kind == "mamba1"
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_conv, cfg.linear_dt_rank) == (1, 64, 8, 1, 3, 3)
    assert (cfg.linear_dt_bc_norm, cfg.linear_norm_eps) == (("rms_unit", 1e-3) if family == "falcon_mamba" else ("none", None))
    assert cfg.tie_embeddings == (family == "mamba") and not any(".mlp" in name for name, _ in model.named_parameters())
    config = json.loads((path / "config.json").read_text())
    assert TransformerConfig(**hf.FAMILIES[family].kwargs(dict(config, time_step_rank="auto"))).linear_dt_rank == 2
    if family == "falcon_mamba":  # the mixer's own eps matters: at the blocks' eps the logits move
        docs, ids, cu = _packed()
        with torch.no_grad():
            theirs = _their_logits(ref, docs)
            assert _rel(model.logits(ids, cu), theirs) < TOL["falcon_mamba"]
            other = hf.Transformer(dataclasses.replace(cfg, linear_norm_eps=None))
            other.load_state_dict(model.state_dict())
            assert _rel(other.logits(ids, cu), theirs) > 1e-4
    for change, message in ((dict(use_bias=True), r"use_bias = True is not supported \(no biases on the mixer's projections\)"),
                            (dict(use_conv_bias=False), r"use_conv_bias = False is not supported \(the convolution's biases\)"),
                            (dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported \(silu after the convolution\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES[family].kwargs(dict(config, **change))
    with pytest.raises(ValueError, match=r"model: Mamba-1's x channels \(linear_v_heads x linear_v_dim = 48\) are not a whole multiple of hidden = 32 \(expand\)"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(cfg, linear_v_heads=48)), tmp_path / "odd", model_type=family)


def test_jamba_reads_its_layer_periods_and_writes_them_back(folders, tmp_path):
    """Jamba: attention without RoPE in the layers attn_layer_period / offset name, Mamba-1
    mixers (dt, B and C normed with weights) in the others, the MoE where expert_layer_period
    / offset say (softmax top-k, not renormalised), a SwiGLU of the same size elsewhere; no
    MoE at all with num_experts 1. An fmoe model is written with the periods of its blocks;
    one whose attention or MoE blocks follow no period, or with a RoPE block, is not."""
    path, ref = folders["jamba"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.linear_layers, cfg.nope_layers, cfg.moe_layers, cfg.n_experts, cfg.k, cfg.pre_softmax) == ((0, 2), (1,), (0, 2), 4, 2, True)
    assert (cfg.linear_kind, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_dt_rank, cfg.linear_dt_bc_norm) == ("mamba1", 64, 8, 3, "rms")
    assert cfg.ffn_dense == cfg.ffn_expert == 40 and model.blocks[1].mlp.__class__.__name__ != "MoE"
    config = json.loads((path / "config.json").read_text())
    dense = TransformerConfig(**hf.FAMILIES["jamba"].kwargs(dict(config, num_experts=1)))
    assert (dense.moe_layers, dense.n_dense, dense.n_experts) == (None, 3, 1)
    six = TransformerConfig(**hf.FAMILIES["jamba"].kwargs(dict(config, num_hidden_layers=6, attn_layer_period=4, attn_layer_offset=3)))
    assert (six.linear_layers, six.nope_layers, six.moe_layers) == ((0, 1, 2, 4, 5), (3,), (0, 2, 4))
    for change, message in ((dict(mamba_proj_bias=True), r"mamba_proj_bias = True is not supported \(no biases on the mixer's projections\)"),
                            (dict(mamba_conv_bias=False), r"mamba_conv_bias = False is not supported \(the convolution's biases\)"),
                            (dict(attn_layer_offset=3), r"attn_layer_period, attn_layer_offset = 3, 3 are not supported \(0 <= offset < period\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["jamba"].kwargs(dict(config, **change))
    # fmoe's own: attention in blocks 1 and 3 of 4 (period 2, offset 1), the MoE in block 0 and 2, read back as written
    own = dataclasses.replace(cfg, n_layers=4, linear_layers=(0, 2), nope_layers=(1, 3), moe_layers=(0, 2), impl="auto")
    written = hf.hf_config(own, "jamba")
    assert (written["attn_layer_period"], written["attn_layer_offset"], written["expert_layer_period"], written["expert_layer_offset"]) == (2, 1, 2, 0)
    assert TransformerConfig(**hf.FAMILIES["jamba"].kwargs(written)) == own
    for change, message in ((dict(linear_layers=(0, 1), nope_layers=(2, 3)), r"Jamba places its attention layers every period layers from an "
                                                                               r"offset; this model has them at \[2, 3\]"),
                            (dict(moe_layers=(0, 1)), r"Jamba places its MoE layers every period layers from an offset; this model has them at \[0, 1\]")):
        with pytest.raises(ValueError, match=message):
            hf.hf_config(dataclasses.replace(own, **change), "jamba")
    with pytest.raises(ValueError, match=r"its config has no jamba equivalent"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(own, nope_layers=(1,))), tmp_path / "rope", model_type="jamba")


@pytest.mark.parametrize("rms_norm,before", [(False, False), (True, False)], ids=["no-norm, tied", "norm-after-gate"])
def test_falcon_h1_reads_its_multipliers_and_output_norms(rms_norm, before, tmp_path):
    """Falcon-H1 with multipliers that are not powers of two and the mixer's output norm left
    out (mamba_rms_norm false, the released models', here with Falcon-H1-0.5B's tied head and
    heads of 12 channels, 48 in all beside hidden 32) or after the gate: every block a
    parallel hybrid (attention beside the mixer) with the norm where transformers puts it,
    the embeddings' and logits' multipliers as knobs, the others folded into the weights; it
    gives transformers' logits, its export keeps config.json and takes the multipliers out of
    the weights again (to within a rounding), and an export of fmoe's own (multipliers 1, the
    weights as folded) loads in transformers with the same logits. Biases refused."""
    from safetensors.torch import load_file

    multipliers = dict(key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.35, ssm_in_multiplier=0.6, ssm_out_multiplier=1.9,
                       ssm_multipliers=[0.3, 1.7, 0.45, 2.2, 0.8], mlp_multipliers=[1.6, 0.55], embedding_multiplier=1.4, lm_head_multiplier=0.45)
    config = FAMILIES["falcon_h1"]()
    config.update(dict(multipliers, mamba_rms_norm=rms_norm, mamba_norm_before_gate=before))
    if not rms_norm:
        config.update(dict(tie_word_embeddings=True, head_dim=12))
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.parallel_hybrid and cfg.linear_layers == (0, 1, 2) and cfg.linear_gate_norm == ("after" if rms_norm else "none")
    assert (cfg.linear_v_heads, cfg.linear_v_dim, cfg.linear_k_heads, cfg.linear_k_dim) == (4, 6, 2, 8)
    assert (cfg.embed_scale, cfg.logit_divisor, cfg.tie_embeddings, cfg.head_dim) == (1.4, 1 / 0.45, not rms_norm, 8 if rms_norm else 12)
    assert all(b.attn_beside is not None for b in model.blocks) and ("out_norm" in model.blocks[0].attn.names) == rms_norm
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    # the folded weights: the mixer's x rows x ssm_in x its multiplier, the attention's k x attention_in x key_multiplier
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    x_rows = stored["model.layers.1.mamba.in_proj.weight"][24:48].t()
    torch.testing.assert_close(model.blocks[1].attn.wv.detach(), x_rows * (0.6 * 1.7))
    torch.testing.assert_close(model.blocks[1].attn_beside.wk.detach(), stored["model.layers.1.self_attn.k_proj.weight"].t() * (1.3 * 0.7))
    hf.save_pretrained(model, tmp_path / "again")
    assert filecmp.cmp(tmp_path / "hf" / "config.json", tmp_path / "again" / "config.json", shallow=False)
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(stored)
    for key, value in stored.items():
        torch.testing.assert_close(again[key], value, rtol=3e-7, atol=0.0)
    del model.hf_config  # fmoe's own: written with the multipliers at 1 but the embeddings' and the logits'
    hf.save_pretrained(model, tmp_path / "own", model_type="falcon_h1")
    written = json.loads((tmp_path / "own" / "config.json").read_text())
    assert written["ssm_multipliers"] == [1.0] * 5 and written["key_multiplier"] == 1.0 and written["mamba_rms_norm"] == rms_norm
    assert written["embedding_multiplier"] == 1.4 and written["lm_head_multiplier"] == pytest.approx(0.45, rel=1e-15)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(_their_logits(back, docs), theirs) < 1e-5
    for change, message in ((dict(attention_bias=True), r"attention_bias = True is not supported"),
                            (dict(projectors_bias=True), r"projectors_bias = True is not supported"),
                            (dict(mamba_proj_bias=True), r"mamba_proj_bias = True is not supported"),
                            (dict(mamba_d_head=8), r"mamba_n_heads x mamba_d_head = 4 x 8 is not supported \(mamba_d_ssm, 24\)")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["falcon_h1"].kwargs(dict(config.to_dict(), **change))


def test_nemotron_3_super_s_latent_moe_gives_transformers_logits_and_exports_back(tmp_path):
    """Nemotron 3 Super's latent MoE (moe_latent_size 12): the routed experts over 12 channels
    between fc1_latent_proj [12, H] and fc2_latent_proj [H, 12], the router and the shared
    expert on x. Read as moe_latent, it gives transformers' logits; the export re-exports bit
    for bit, and transformers loads it with the same logits."""
    from safetensors.torch import load_file

    config = FAMILIES["nemotron_h"]()
    config.moe_latent_size = 12
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    ref.save_pretrained(tmp_path / "hf")
    model, cfg = hf.from_pretrained(tmp_path / "hf", impl="torch")
    assert cfg.moe_latent == 12 and model.blocks[0].mlp.experts.w_up.shape == (4, 12, 24)
    assert model.blocks[0].mlp.latent_in.shape == (32, 12) and model.blocks[0].mlp.shared.w_up.shape == (32, 20)
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
    hf.save_pretrained(model, tmp_path / "again")
    assert filecmp.cmp(tmp_path / "hf" / "model.safetensors", tmp_path / "again" / "model.safetensors", shallow=False)
    assert set(load_file(tmp_path / "again" / "model.safetensors")) >= {"backbone.layers.1.mixer.fc1_latent_proj.weight",
                                                                        "backbone.layers.4.mixer.fc2_latent_proj.weight"}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(_their_logits(back, docs), theirs) < 1e-6


def test_minicpm3_reads_its_multipliers_rope_halves_and_longrope(folders):
    """MiniCPM3: the embeddings x scale_emb (rounded), each sublayer's output x scale_depth /
    sqrt(layers), the logits' divisor hidden / dim_model_base, multi-latent attention rotating
    halves (not interleaved pairs) with LongRoPE's factors; read as interleaved pairs, the
    logits move."""
    path, ref = folders["minicpm3"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.embed_scale, cfg.round_embed_scale, cfg.residual_scale, cfg.logit_divisor, cfg.rope_interleaved, cfg.kv_rank) == (
        12.0, True, 1.4 / 3**0.5, 4.0, False, 8)
    assert (cfg.longrope_short_factors, cfg.longrope_long_factors, cfg.longrope_original_max_positions) == ((1.0, 1.5), (2.0, 4.0), 8)
    docs, ids, cu = _packed()
    assert max(len(d) for d in docs) > 8  # a document past LongRoPE's original length: its long factors
    interleaved, _ = hf.from_pretrained(path, impl="torch", rope_interleaved=True)
    with torch.no_grad():
        theirs = _their_logits(ref, docs)
        assert _rel(model.logits(ids, cu), theirs) < 1e-5 < 1e-3 < _rel(interleaved.logits(ids, cu), theirs)


def test_gemma_1_reads_the_releases_legacy_gelu_and_vaultgemma_has_no_post_norms(folders, tmp_path):
    """Gemma 1's released configs say hidden_act "gelu", which transformers reads as GELU's tanh
    form: the same model. VaultGemma: Gemma 2's config without post-norms."""
    path, _ = folders["gemma"]
    _, cfg = hf.read_config(path)
    assert (cfg.mlp_act, cfg.zero_centered_norms, cfg.post_norms, cfg.round_embed_scale, cfg.attn_scale) == ("gelu_tanh", True, False, True, None)
    assert hf.read_config(_edit(path, tmp_path / "gelu", lambda c: c.update(hidden_act="gelu")))[1] == cfg
    assert transformers.GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    vault, gemma2 = (hf.read_config(folders[f][0])[1] for f in ("vaultgemma", "gemma2"))
    assert not vault.post_norms and dataclasses.replace(vault, post_norms=True) == gemma2


@pytest.mark.parametrize("family", ["gemma", "vaultgemma", "gemma2", "gemma3_text", "gemma4_text"])
def test_gemma_rounds_its_embedding_scale_to_the_embeddings_dtype(family, folders):
    """Gemma multiplies its embeddings by sqrt(hidden_size) rounded to their dtype
    (round_embed_scale): loaded in bf16, the first block's input equals transformers' bf16
    embeddings bit for bit (sqrt(32) = 5.657 is 5.656 in bf16); read without the rounding it
    does not. In float32 the scale is itself (the parity tests)."""
    path, ref = folders[family]
    model, cfg = hf.from_pretrained(path, impl="torch", dtype=torch.bfloat16)
    plain, _ = hf.from_pretrained(path, impl="torch", dtype=torch.bfloat16, round_embed_scale=False)
    assert cfg.round_embed_scale and cfg.embed_scale == 32**0.5 != float(torch.tensor(32**0.5, dtype=torch.bfloat16))
    theirs_model = copy.deepcopy(ref).to(torch.bfloat16)
    docs, _, _ = _packed()
    ids, cu = docs[0], torch.tensor([0, len(docs[0])], dtype=torch.int32)
    with torch.no_grad():
        theirs = theirs_model(ids[None], output_hidden_states=True).hidden_states[0][0]
        assert theirs.dtype == torch.bfloat16
        for m, equal in ((model, True), (plain, False)):
            seen = []
            hook = m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
            m.logits(ids, cu)
            hook.remove()
            assert seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], theirs) == equal


def test_gemma4_reads_its_per_layer_geometry_rope_and_moe_blocks(folders, tmp_path):
    """Gemma 4: the sliding layers' heads of 8 and 2 kv heads (local_head_dim, local_kv_heads)
    beside the full layer's 16 and 1, whose values are its keys' projection; proportional RoPE
    there, plain at the sliding layers' own base; values RMS-normed; each MoE beside a dense
    MLP, routed through router.scale, weights times router.per_expert_scale; layer scalars.
    Each of these read wrong (the knob off) moves the logits. An older config.json
    (global_head_dim, num_global_key_value_heads) reads as the same model; left out, five
    layers in six slide and the last is full; a model of fmoe's own without MoE blocks writes
    as a dense Gemma 4 (enable_moe_block false) that transformers reads with its logits."""
    path, ref = folders["gemma4_text"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.local_head_dim, cfg.local_kv_heads, cfg.window, cfg.window_layers) == (16, 1, 8, 2, 4, (0, 1))
    assert (cfg.global_k_eq_v, cfg.v_norm, cfg.rope_proportion, cfg.rope_base, cfg.local_rope_base, cfg.attn_scale, cfg.zero_centered_norms) == (
        True, True, 0.25, 10000.0, 100.0, 1.0, False)
    assert (cfg.dense_beside_moe, cfg.router_norm, cfg.router_expert_scale, cfg.layer_scalars, cfg.mlp_act, [cfg.is_moe(i) for i in range(3)]) == (
        True, True, True, True, "gelu_tanh", [True] * 3)
    assert not hasattr(model.blocks[2].attn, "wv") and float(model.blocks[1].layer_scalar) != 1.0
    docs, ids, cu = _packed()
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        for knob, value in (("rope_proportion", None), ("v_norm", False), ("layer_scalars", False)):
            other, _ = hf.from_pretrained(path, impl="torch", strict=False, **{knob: value})
            assert _rel(other.logits(ids, cu), theirs) > 1e-3, knob
    older = _edit(path, tmp_path / "older", lambda c: (c.pop("per_layer_config"), c.update(global_head_dim=16, num_global_key_value_heads=1)))
    assert hf.read_config(older)[1] == dataclasses.replace(cfg, impl="auto")
    eight = hf.read_config(_edit(path, tmp_path / "eight", lambda c: (c.pop("per_layer_config"), c.update(num_hidden_layers=8, layer_types=None))))[1]
    kinds = transformers.Gemma4TextConfig(num_hidden_layers=8, hidden_size_per_layer_input=0).layer_types
    assert eight.window_layers == tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") == (0, 1, 2, 3, 4, 6)

    # a released folder: the text model under model.language_model., a vision model beside it (and a padding id, which it needs)
    text = dict(FAMILIES["gemma4_text"]().to_dict(), pad_token_id=0)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    released = _randomised(transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=text, vision_config=vision,
                                                                                                  audio_config=None)))
    released.save_pretrained(tmp_path / "gemma4")
    loaded, read = hf.from_pretrained(tmp_path / "gemma4", impl="torch")
    assert read == cfg
    with torch.no_grad():
        assert _rel(loaded.logits(ids, cu), torch.cat([released(input_ids=d[None]).logits[0] for d in docs])) < 1e-5
    assert hf.written_config(loaded.hf_config)["model_type"] == "gemma4_text"

    dense = dataclasses.replace(cfg, moe_layers=(), n_dense=3, dense_beside_moe=False, router_norm=False, router_expert_scale=False, impl="torch")
    mine = hf.Transformer(dense)
    mine.reset_parameters(seed=1)
    hf.save_pretrained(mine, tmp_path / "dense", model_type="gemma4_text")
    assert json.loads((tmp_path / "dense" / "config.json").read_text())["enable_moe_block"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(mine.logits(ids, cu), torch.cat([back(d[None]).logits[0] for d in docs])) < 1e-5
    with pytest.raises(ValueError, match=r"model: its config has no gemma4_text equivalent: .*'window_layers'"):
        hf.save_pretrained(hf.Transformer(dataclasses.replace(dense, window_layers=(0, 2))), tmp_path / "last", model_type="gemma4_text")


def test_a_released_gemma4_unified_folder_loads_its_text_model(folders, tmp_path):
    """A released Gemma 4 unified folder (gemma4_unified, Gemma4UnifiedForConditionalGeneration):
    the text model (Gemma 4's dense blocks) under model.language_model. with transformers'
    logits of a text-only forward, the vision model unread; not written back whole; written
    as gemma4_unified_text, which transformers loads with the same logits. Bidirectional
    attention over every token and the double-wide MLP are refused by name."""
    text = dict(FAMILIES["gemma4_unified_text"]().to_dict(), pad_token_id=0)
    vision = dict(patch_size=2, pooling_kernel_size=1, mm_embed_dim=32, mm_posemb_size=8, output_proj_dims=32)
    whole = transformers.Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=None)
    theirs = _saved_multimodal(transformers.Gemma4UnifiedForConditionalGeneration, whole, tmp_path / "vl")
    _, cfg, written = _text_model_round_trip(tmp_path / "vl", theirs, tmp_path / "text", kind="gemma4_unified", prefix="model.language_model.",
                                             head="lm_head.weight", text_kind="gemma4_unified_text")
    assert (cfg.global_k_eq_v, cfg.layer_scalars, cfg.window_layers) == (True, True, (0, 1))
    for change, message in ((dict(use_bidirectional_attention="all"), "use_bidirectional_attention = 'all' is not supported"),
                            (dict(use_double_wide_mlp=True), "use_double_wide_mlp = True is not supported")):
        with pytest.raises(ValueError, match=message):
            hf.FAMILIES["gemma4_unified_text"].kwargs(dict(written, **change))


def test_gemma2_caps_its_attention_scores_and_lfm3_reads_its_three_layer_kinds(folders, tmp_path):
    """Gemma 2: every attention score capped at attn_logit_softcapping (read without the cap,
    the logits move); left out, every other layer slides. LFM3: a short convolution, a
    window's layer with plain RoPE at its own base and a full one with proportional RoPE, the
    attention's gate per head (gate_proj, as released) and sandwich norms; read with RoPE over every channel,
    or without the gate, the logits move; left out, layer_types is LFM3's pattern (every
    fourth layer from 2 full, from 4 sliding, the rest convolutions)."""
    docs, ids, cu = _packed()
    path, ref = folders["gemma2"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.attn_softcap, cfg.logit_softcap, cfg.window_layers, cfg.qk_norm, cfg.attn_scale) == (2.0, 3.0, (0, 2), None, 6**-0.5)
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        assert _rel(hf.from_pretrained(path, impl="torch", attn_softcap=None)[0].logits(ids, cu), theirs) > 1e-3
    six = hf.read_config(_edit(path, tmp_path / "six", lambda c: c.update(num_hidden_layers=6, layer_types=None)))[1]
    assert six.window_layers == tuple(i for i, k in enumerate(transformers.Gemma2Config(num_hidden_layers=6).layer_types) if k == "sliding_attention")

    path, ref = folders["lfm3"]
    model, cfg = hf.from_pretrained(path, impl="torch")
    assert (cfg.linear_layers, cfg.window_layers, cfg.rope_proportion, cfg.local_rope_base, cfg.attn_gate, cfg.attn_gate_per_head, cfg.post_norms) == (
        (0,), (1,), 0.5, 100.0, True, True, True)
    assert hf.key_map(hf.FAMILIES["lfm3"], cfg)["blocks.2.attn.wg"].keys == ("model.layers.2.self_attn.gate_proj.weight",)  # as released
    with torch.no_grad():
        theirs = torch.cat([ref(d[None]).logits[0] for d in docs])
        assert _rel(model.logits(ids, cu), theirs) < 1e-5
        assert _rel(hf.from_pretrained(path, impl="torch", rope_proportion=None)[0].logits(ids, cu), theirs) > 1e-3
        assert _rel(hf.from_pretrained(path, impl="torch", strict=False, attn_gate=False, attn_gate_per_head=False)[0].logits(ids, cu), theirs) > 1e-3
    whole = dataclasses.replace(cfg, attn_gate_per_head=False)  # LFM3's gate is one per head
    with pytest.raises(ValueError, match=r"model: its config has no lfm3 equivalent: \{'attn_gate_per_head': \(False, True\)\}"):
        hf.save_pretrained(hf.Transformer(whole), tmp_path / "whole", model_type="lfm3")
    ten = hf.read_config(_edit(path, tmp_path / "ten", lambda c: c.update(num_hidden_layers=10, layer_types=None)))[1]
    kinds = transformers.Lfm3Config(num_hidden_layers=10).layer_types
    assert ten.linear_layers == tuple(i for i, k in enumerate(kinds) if k == "conv") == (0, 1, 3, 5, 7, 9)
    assert ten.window_layers == tuple(i for i, k in enumerate(kinds) if k == "sliding_attention") == (4, 8)


def test_beam_reads_its_layer_pattern_and_rope_and_matches_each_layer_s_output(folders, tmp_path):
    """Beam: the global layers without RoPE, their queries scaled by (1 + (p + 1) / 2048) **
    0.1; the gate's bias per head; the depth-scaled residual adds, which the logits cannot
    show (with pre- and post-norms they scale the whole residual by 1 / sqrt(n) only): each
    layer's output equals transformers' hidden state; left out, layer_types is every sixth and
    the last layer global, mlp_layer_types 3 dense layers first, rope_parameters RoPE in the
    sliding layers only; both kinds with RoPE read the sliding layers' own base."""
    path, ref = folders["beam"]
    _, cfg = hf.read_config(path)
    assert (cfg.window, cfg.window_layers, cfg.nope_layers, cfg.nope_temperature_floor, cfg.nope_temperature_scale, cfg.nope_temperature_kind) == (
        4, (0, 2), (1,), 2048, 0.1, "power")
    assert (cfg.attn_gate, cfg.attn_gate_bias, cfg.pre_norms, cfg.post_norms, cfg.depth_scaled_residual, cfg.logit_softcap) == (
        True, True, True, True, True, 3.0)
    assert (cfg.n_dense, cfg.shared_size, cfg.n_groups, cfg.group_score_topk, cfg.route_scale) == (1, 0, 2, 2, 2.5)
    model, _ = hf.from_pretrained(path, impl="torch")
    docs, ids, cu = _packed()
    outputs = []
    hooks = [block.register_forward_hook(lambda _m, _i, out: outputs.append(out[0])) for block in model.blocks]
    with torch.no_grad():
        model.logits(ids, cu)
        theirs = [torch.cat([h[0] for h in layer]) for layer in zip(*[ref(d[None], output_hidden_states=True).hidden_states[1:-1] for d in docs])]
    for hook in hooks:
        hook.remove()
    assert len(outputs) == 3 and len(theirs) == 2  # transformers' last hidden state is the final norm's, not layer 2's
    for ours, want in zip(outputs, theirs):
        assert _rel(ours, want) < 1e-5
    ten = _edit(path, tmp_path / "ten", lambda c: c.update(num_hidden_layers=13, layer_types=None, mlp_layer_types=None, rope_parameters=None))
    _, cfg = hf.read_config(ten)
    assert (cfg.window_layers, cfg.nope_layers, cfg.n_dense, cfg.local_rope_base) == (
        tuple(i for i in range(12) if i not in (5, 11)), (5, 11, 12), 3, None)
    both = _edit(path, tmp_path / "both", lambda c: c.update(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=5e5),
                                                                                  sliding_attention=dict(rope_type="default", rope_theta=100.0))))
    _, cfg = hf.read_config(both)
    assert (cfg.nope_layers, cfg.nope_temperature_floor, cfg.rope_base, cfg.local_rope_base) == (None, None, 5e5, 100.0)


def test_axk2_reads_its_gated_norms_and_fused_query_gate_and_leaves_its_mtp_layers_unread(folders, tmp_path):
    """A.X-K2: gated RMSNorms of gated_norm_rank before the attention and before each MoE (the
    dense layer's pre-MLP norm plain), the q_b_proj rows split into the queries' and the
    gate's; an older config's first_k_dense_replace / moe_layer_freq name the MoE layers; an
    MTP layer after the trunk's is not read."""
    path, _ = folders["axk2"]
    _, cfg = hf.read_config(path)
    assert (cfg.norm_gate_rank, cfg.q_latent_raw, cfg.attn_gate, cfg.attn_gate_on_q, cfg.n_dense, cfg.n_groups, cfg.mtp_depth) == (
        3, True, True, True, 1, None, 0)
    assert (cfg.index_topk, cfg.rope_interleaved, cfg.index_rope_interleaved) == (3, True, False)
    keys = hf.key_map(hf.FAMILIES["axk2"], cfg)
    assert keys["blocks.0.mlp_norm.weight"].keys == ("model.layers.0.post_attention_layernorm.weight",)
    assert keys["blocks.1.mlp_norm.gate_down"].keys == ("model.layers.1.post_attention_layernorm.W_down.weight",)
    assert keys["blocks.0.attn_norm.weight"].keys == ("model.layers.0.input_layernorm.norm.weight",)
    model, _ = hf.from_pretrained(path, impl="torch")
    docs, ids, cu = _packed()
    with torch.no_grad():
        want = model.logits(ids, cu)
    older = _edit(path, tmp_path / "older", lambda c: c.update(mlp_layer_types=None, first_k_dense_replace=0, moe_layer_freq=2))
    assert hf.read_config(older)[1].moe_layers == (0, 2)
    unread = _with_extra_key(path, tmp_path / "mtp", "model.layers.3.eh_proj.weight", torch.zeros(32, 64))
    with torch.no_grad():
        assert torch.equal(hf.from_pretrained(unread, impl="torch")[0].logits(ids, cu), want)


def test_a_bfloat16_folder_is_written_back_with_the_dtypes_it_stored(tmp_path):
    """transformers stores a bfloat16 DeepSeek-V3's routers (mlp.gate.weight) in float32;
    loaded (as bfloat16 or float32) and saved again, the files are bit-identical (the routers
    were rounded to bfloat16 before: 2e-3 off); and a bfloat16 MiniMax folder, whose decay
    tables are bfloat16, loads (its slope_rate was refused against the float32 decay)."""
    from safetensors.torch import load_file

    config = FAMILIES["deepseek_v3"]()
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    ref.save_pretrained(tmp_path / "v3")
    stored = load_file(tmp_path / "v3" / "model.safetensors")
    routers = [k for k in stored if k.endswith("mlp.gate.weight")]
    assert routers and all(stored[k].dtype == torch.float32 for k in routers)  # what the test is about
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = hf.from_pretrained(tmp_path / "v3", impl="torch", dtype=dtype)
        hf.save_pretrained(model, tmp_path / f"again-{dtype}")
        assert filecmp.cmp(tmp_path / "v3" / "model.safetensors", tmp_path / f"again-{dtype}" / "model.safetensors", shallow=False), dtype
    # written as float16: the routers stay float32 as stored, the rest follows the config
    model, _ = hf.from_pretrained(tmp_path / "v3", impl="torch")
    model.hf_config = dict(model.hf_config, dtype="float16")
    hf.save_pretrained(model, tmp_path / "half")
    half = load_file(tmp_path / "half" / "model.safetensors")
    assert {half[k].dtype for k in routers} == {torch.float32} and half["model.embed_tokens.weight"].dtype == torch.float16
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FAMILIES["minimax"](), dtype=torch.bfloat16).save_pretrained(tmp_path / "minimax")
    assert any(v.dtype == torch.bfloat16 for k, v in load_file(tmp_path / "minimax" / "model.safetensors").items() if k.endswith("slope_rate"))
    hf.from_pretrained(tmp_path / "minimax", impl="torch")


def test_a_shard_takes_tensors_up_to_max_shard_bytes_and_a_larger_tensor_is_a_shard_alone(tmp_path):
    """A shard holds tensors while their bytes stay within the limit (reaching it exactly
    included); a tensor over the limit is a shard of its own, first tensor included (no
    empty shard before it); the index maps every key, sorted, and totals their bytes."""
    from safetensors import safe_open

    writer = hf._ShardWriter(tmp_path, 32)
    for key, n in (("z", 20), ("b", 4), ("a", 4), ("c", 1)):  # float32: 80, 16, 16 (32 together: the limit), 4 bytes
        writer.add(key, torch.full((n,), float(n)))
    writer.close("{}\n")
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", *names, "model.safetensors.index.json"]
    held = []
    for name in names:
        with safe_open(tmp_path / name, "pt") as f:
            held.append({key: f.get_tensor(key).tolist() for key in f.keys()})
    assert held == [{"z": [20.0] * 20}, {"a": [4.0] * 4, "b": [4.0] * 4}, {"c": [1.0]}]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 116}, "weight_map": {"a": names[1], "b": names[1], "c": names[2], "z": names[0]}}
    assert list(index["weight_map"]) == ["a", "b", "c", "z"]


def test_an_export_under_a_limit_below_every_tensor_writes_one_shard_per_tensor_readable_as_config_json(tmp_path):
    """max_shard_bytes=1: each tensor a shard of its own, named in the index (indented as
    transformers writes it, keys sorted) with the tensors' total bytes; config.json's keys
    sorted as transformers writes them; every file gets the mode a new file gets under the
    process's umask (0o027: 0o640), config.json's, where safetensors alone writes 0o600."""
    from safetensors import safe_open

    cfg = TransformerConfig(vocab_size=V, hidden=32, n_layers=1, n_dense=1, ffn_dense=48, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=0)
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=0)
    whole = _read_all(hf.save_pretrained(model, tmp_path / "one", model_type="llama"))
    mask = os.umask(0o027)
    try:
        out = hf.save_pretrained(model, tmp_path / "out", model_type="llama", max_shard_bytes=1)
    finally:
        os.umask(mask)
    n = len(whole)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(f.name for f in out.iterdir()) == sorted(["config.json", "model.safetensors.index.json", *names])
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == dict.fromkeys(["config.json", "model.safetensors.index.json", *names], 0o640)
    assert (out / "config.json").read_text() == json.dumps(hf.hf_config(cfg, "llama"), indent=2, sort_keys=True) + "\n"
    text = (out / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert text == json.dumps(index, indent=2) + "\n" and list(index["weight_map"]) == sorted(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for name in names:
        with safe_open(out / name, "pt") as f:
            (key,) = f.keys()
            assert index["weight_map"][key] == name and torch.equal(f.get_tensor(key), whole[key])


@pytest.mark.parametrize("change", [dict(capacity_factor=1.25, capacity_policy="position"), dict(init_std=0.5), dict(yarn_truncate=False),
                                    dict(yarn_original_max_positions=7), dict(llama3_low_freq_factor=2.0), dict(llama3_high_freq_factor=8.0),
                                    dict(llama3_original_max_positions=7), dict(impl="triton", ac="full")])
def test_config_mismatch_ignores_what_leaves_the_model_as_the_config_json_s(change):
    """Training knobs (the capacity drop and its policy, init_std, impl, ac) and the knobs of a
    RoPE scaling the model does not use (YaRN's, Llama 3.1's without their factor) are no
    mismatch: the model is the config.json's."""
    cfg = _family_config("qwen3_moe")
    assert hf.config_mismatch(dataclasses.replace(cfg, **change), hf.hf_config(cfg, "qwen3_moe")) == {}


@pytest.mark.parametrize("model,change,config,want", [
    ("qwen3_moe", dict(moe_layers=(1,)), "qwen3_moe", {"MoE layers": ([False, True, False], [True, True, True])}),
    ("qwen3_moe", dict(n_shared=1), "qwen3_moe", {"shared_size": (24, 0)}),
    ("qwen3_moe", dict(mtp_depth=1, mtp_norm=True), "qwen3_moe", {"mtp_depth": (1, 0), "mtp_norm": (True, False)}),
    ("llama", {}, "qwen3_moe", {"n_experts": (1, 4), "k": (1, 2), "ffn_expert": (40, 24), "qkv_bias": (True, False), "qk_norm": (None, "head"),
                                "o_bias": (True, False), "mlp_bias": (True, False), "MoE layers": ([False] * 3, [True] * 3)}),
    ("llama", dict(n_dense=0, n_experts=4, k=2, ffn_expert=24, n_shared=1), "llama",
     {"n_experts": (4, 1), "k": (2, 1), "ffn_expert": (24, 40), "MoE layers": ([True] * 3, [False] * 3), "shared_size": (24, 0)}),
])
def test_config_mismatch_names_each_field_the_config_json_reads_otherwise(model, change, config, want):
    """{field: (the model's, the config.json's)}: the MoE layers, the shared experts' size, an
    MTP module (and its norm) of a family without one; a dense model against a MoE config
    names the MoE fields too, a MoE model against a dense one its shared experts."""
    cfg = dataclasses.replace(_family_config(model), **change)
    assert hf.config_mismatch(cfg, hf.hf_config(_family_config(config), config)) == want


@pytest.mark.parametrize("family,change,model_type,message", [
    ("qwen3_moe", dict(capacity_factor=1.25), "qwen3_moe", "model: its config has no qwen3_moe equivalent: {'capacity_factor': (1.25, None)}"),
    ("qwen3_moe", {}, "bert", "model_type: expected one of mixtral, "),
    ("qwen3_moe", {}, "llama", "model: llama is a dense family; this model has MoE layers [0, 1, 2]"),
    ("deepseek_v3", dict(n_shared=0, shared_ffn=24), "deepseek_v3", "model: shared experts of 24 are not a whole number of experts of 16"),
])
def test_hf_config_refuses_a_model_its_family_cannot_hold_by_name(family, change, model_type, message):
    """A capacity drop (no family has one), an unknown model_type, MoE layers written as a
    dense family, shared experts that are no whole number of routed experts: refused, named."""
    cfg = dataclasses.replace(_family_config(family), **change)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        hf.hf_config(cfg, model_type)


def test_a_deepseek_style_config_without_expert_groups_writes_one_group():
    """DeepSeek-V3's routing without groups is written as one group of which one is kept
    (n_group = topk_group = 1), the fields transformers' router computes with, not None."""
    cfg = _family_config("deepseek_v3")
    written = hf.hf_config(dataclasses.replace(cfg, n_groups=None, topk_groups=None, group_score_topk=None), "deepseek_v3")
    assert (written["n_group"], written["topk_group"], written["n_shared_experts"]) == (1, 1, 1)


def test_a_loaded_folder_read_with_an_mtp_module_its_family_does_not_store_writes_back_unchanged(tmp_path):
    """A Llama folder read with an MTP module of its own norm (mtp_depth=1, mtp_norm=True; Llama
    stores none) is still the folder's model: it writes back byte for byte, the module left out."""
    cfg = TransformerConfig(vocab_size=V, hidden=32, n_layers=1, n_dense=1, ffn_dense=48, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=0)
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=0)
    hf.save_pretrained(model, tmp_path / "llama", model_type="llama")
    with_mtp, read = hf.from_pretrained(tmp_path / "llama", impl="torch", mtp_depth=1, mtp_norm=True)
    assert (read.mtp_depth, read.mtp_norm) == (1, True)
    hf.save_pretrained(with_mtp, tmp_path / "again")
    for file in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "llama" / file, tmp_path / "again" / file, shallow=False), file


def test_a_loaded_folder_written_as_another_family_is_a_fresh_export(tmp_path):
    """A DeepSeek-V3 folder that stores its correction biases in bfloat16 writes them back so,
    but written as kimi_k2 (a config of the model's own) the folder's dtypes no longer
    apply: the biases float32, as a fresh export writes them."""
    from safetensors.torch import load_file, save_file

    cfg = _family_config("deepseek_v3")
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=0)
    folder = hf.save_pretrained(model, tmp_path / "v3", model_type="deepseek_v3")
    stored = load_file(folder / "model.safetensors")
    biases = [k for k in stored if k.endswith("e_score_correction_bias")]
    save_file({k: v.to(torch.bfloat16) if k in biases else v for k, v in stored.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    loaded, _ = hf.from_pretrained(folder, impl="torch")
    for model_type, dtype in ((None, torch.bfloat16), ("kimi_k2", torch.float32)):
        out = hf.save_pretrained(loaded, tmp_path / str(model_type), model_type=model_type)
        written = load_file(out / "model.safetensors")
        assert biases and {written[k].dtype for k in biases} == {dtype}, model_type
        assert json.loads((out / "config.json").read_text())["model_type"] == (model_type or "deepseek_v3")


def test_the_zero_experts_unused_rows_are_written_in_the_checkpoint_s_dtype(tmp_path):
    """LongCat-Flash's zero-computation experts' unused rows (zeros) are written in the
    config's dtype, bfloat16 here, as every other weight (the correction bias: float32)."""
    from safetensors.torch import load_file

    cfg = _family_config("longcat_flash")
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=0)
    model.hf_config = dict(hf.hf_config(cfg, "longcat_flash"), dtype="bfloat16")
    stored = load_file(hf.save_pretrained(model, tmp_path / "out") / "model.safetensors")
    zero_rows = hf.zero_expert_keys(hf.FAMILIES["longcat_flash"], cfg)
    assert zero_rows and all(torch.equal(stored[k], torch.zeros(shape, dtype=torch.bfloat16)) for k, shape in zero_rows.items())
    assert {k for k, v in stored.items() if v.dtype != torch.bfloat16} == {k for k in stored if k.endswith("e_score_correction_bias")}


def test_a_llama4_config_is_written_as_its_text_model_s_class():
    """written_config of a released llama4 folder's config: its text config as llama4_text,
    under Llama4ForCausalLM (not the whole model's Llama4ForConditionalGeneration, which a
    server would build from architectures)."""
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vision_output_dim=16, image_size=28,
                  patch_size=14, projector_input_dim=16, projector_output_dim=16)
    config = transformers.Llama4Config(text_config=FAMILIES["llama4_text"]().to_dict(), vision_config=vision).to_dict()
    written = hf.written_config(dict(config, architectures=["Llama4ForConditionalGeneration"]))
    assert (written["model_type"], written["architectures"], written["hidden_size"]) == ("llama4_text", ["Llama4ForCausalLM"], 32)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_folder_cast_to_bfloat16_writes_its_correction_bias_back_as_stored(family, tmp_path):
    """A folder of a model cast whole to bfloat16 (model.to(torch.bfloat16).save_pretrained:
    the routing correction bias bfloat16 too, where transformers' own bfloat16 load keeps it
    float32), loaded as bfloat16 or float32 and saved again, gives bit-identical files (the
    bias was written float32); a model of fmoe's own writes it float32."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()))
    with torch.no_grad():
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    biases = [k for k in stored if k.endswith("e_score_correction_bias")]
    assert biases and {stored[k].dtype for k in biases} == {torch.bfloat16}  # what the test is about
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = hf.from_pretrained(tmp_path / "bf16", impl="torch", dtype=dtype)
        hf.save_pretrained(model, tmp_path / f"again-{dtype}")
        for file in ("model.safetensors", "config.json"):
            assert filecmp.cmp(tmp_path / "bf16" / file, tmp_path / f"again-{dtype}" / file, shallow=False), (dtype, file)
    del model.hf_config
    hf.save_pretrained(model, tmp_path / "fresh", model_type=family)
    assert {load_file(tmp_path / "fresh" / "model.safetensors")[k].dtype for k in biases} == {torch.float32}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_an_export_in_bfloat16_writes_the_correction_bias_in_float32(family, tmp_path):
    """export_hf.py --dtype=bfloat16 of a run (a config.json of fmoe's with dtype bfloat16, no
    folder dtypes): the routing correction bias is written float32, as transformers keeps it
    (_keep_in_fp32_modules_strict), its value exactly the model's (bf16 rounds 1 + 1e-3 x by
    about 1e-3, the size of the gaps between experts' scores); the weights bfloat16."""
    from safetensors.torch import load_file

    cfg = _family_config(family)
    model = hf.Transformer(cfg)
    model.reset_parameters(seed=0)
    biases = {}
    with torch.no_grad():
        for name, moe in model.moe_layers().items():
            moe.expert_bias.copy_(1 + 1e-3 * torch.randn_like(moe.expert_bias))
            biases[name] = moe.expert_bias.clone()
    model.hf_config = dict(hf.hf_config(cfg, family), dtype="bfloat16")
    hf.save_pretrained(model, tmp_path / "out")
    stored = load_file(tmp_path / "out" / "model.safetensors")
    written = {k: v for k, v in stored.items() if k.endswith("e_score_correction_bias")}
    assert len(written) == len(biases) > 0 and {v.dtype for v in written.values()} == {torch.float32}
    assert sorted(map(tuple, (v.tolist() for v in written.values()))) == sorted(map(tuple, (b.tolist() for b in biases.values())))
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_bamba_reads_and_writes_its_partial_rotary_factor(tmp_path):
    """Bamba's attention rotates the first partial_rotary_factor of each head (transformers'
    default 0.5, an explicit one honoured): fmoe read half whatever the field said."""
    config = FAMILIES["bamba"]()
    config.rope_parameters = dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.25)
    torch.manual_seed(0)
    ref = _randomised(transformers.AutoModelForCausalLM.from_config(config))
    ref.save_pretrained(tmp_path / "bamba")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bamba", dtype=torch.float32).eval()
    model, cfg = hf.from_pretrained(tmp_path / "bamba", impl="torch")
    assert cfg.rope_dim == cfg.head_dim // 4
    docs, ids, cu = _packed()
    with torch.no_grad():
        assert _rel(model.logits(ids, cu), _their_logits(ref, docs)) < 1e-5
    del model.hf_config  # fmoe's own: the factor written into a fresh config
    with torch.no_grad():
        assert _rel(_exported_logits(model, tmp_path / "fresh", "bamba"), _their_logits(ref, docs)) < 1e-5
    assert hf.read_config(tmp_path / "fresh")[1].rope_dim == cfg.rope_dim


def test_config_dtype_names_a_bad_dtype_field():
    """The weights' dtype of a config.json ("dtype", else "torch_dtype", else float32); a name
    that is no torch floating dtype is refused naming the field (it was torch's AttributeError)."""
    assert hf.config_dtype({}) == torch.float32 and hf.config_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert hf.config_dtype({"dtype": "torch.float16", "torch_dtype": "bfloat16"}) == torch.float16
    for config, said in (({"dtype": "auto"}, "dtype = 'auto'"), ({"torch_dtype": "float8"}, "torch_dtype = 'float8'"),
                         ({"dtype": 5}, "dtype = 5"), ({"dtype": "int8"}, "dtype = 'int8'")):
        with pytest.raises(ValueError, match=f"^config.json: {re.escape(said)} is not supported"):
            hf.config_dtype(config)


def test_a_safetensors_index_names_files_of_its_folder_only(tmp_path):
    """A weight_map that names a file elsewhere (../other/model.safetensors, an absolute
    path) read weights from anywhere on this machine: refused by name, as is an index that
    is no JSON object of a weight_map (a raw RecursionError or KeyError before); a folder
    of neither weight file is named too."""
    from fmoe.hf import _weight_files

    with pytest.raises(FileNotFoundError, match=r"^path: '.*' has no model.safetensors or model.safetensors.index.json$"):
        _weight_files(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(ValueError, match=r"^path: '.*model.safetensors.index.json': weight_map is a list, expected an object of names to files$"):
        _weight_files(tmp_path)
    for bad in ("../other/model.safetensors", "/tmp/x.safetensors", "..", 3):
        index.write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors", "b.weight": bad}}))
        with pytest.raises(ValueError, match=r"names weight files that are not files of the folder: \[" + re.escape(repr(bad))):
            _weight_files(tmp_path)
    for text, said in (("[" * 100000, "RecursionError"), ('{"metadata": {}}', "KeyError"), ("[1]", "TypeError")):
        index.write_text(text)
        with pytest.raises(ValueError, match=f"is not a safetensors index .*: {said}"):
            _weight_files(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors"}}))
    assert _weight_files(tmp_path) == {"a.weight": tmp_path / "model-1.safetensors"}


def test_a_size_field_of_the_wrong_kind_is_named(tmp_path):
    """config.json sizes that are strings or 0 raised a TypeError or ZeroDivisionError from
    inside a family's mapping: a ValueError names the field."""
    base = {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 64, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
    for field, value in (("hidden_size", "32"), ("num_attention_heads", 0), ("num_hidden_layers", True), ("vocab_size", 1.5)):
        (tmp_path / "config.json").write_text(json.dumps(dict(base, **{field: value})))
        with pytest.raises(ValueError, match=f"^config.json: {field} = {re.escape(repr(value))}, expected a positive int$"):
            hf.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base))
    assert hf.read_config(tmp_path)[1].hidden == 32
