"""The reference transformer: each feature on and off, losses as sums, and it learns."""

import dataclasses
import math
import re

import pytest
import torch
from einops import rearrange

import fmoe.layers
import fmoe.ops
from fmoe.model import BatchContext, KVCache, RMSNorm, Transformer, TransformerConfig, init_parameters, init_value, random_hash_table
from fmoe.train.data import make_batch
from fmoe.train.metrics import HostReads, SavedTensors

TINY = TransformerConfig(vocab_size=40, hidden=32, n_layers=3, n_dense=1, ffn_dense=48, n_experts=4, k=2,
                         ffn_expert=16, n_shared=1, n_heads=4, n_kv_heads=2, head_dim=8, impl="torch")
VARIANTS = {
    "default": TINY,
    "softmax aux, no shared, no bias": dataclasses.replace(TINY, score="softmax", expert_bias=False, n_shared=0),
    "groups, scale, capacity": dataclasses.replace(TINY, n_groups=2, topk_groups=1, route_scale=2.5, capacity_factor=1.0),
    "yarn, mtp 2": dataclasses.replace(TINY, yarn_factor=4.0, yarn_original_max_positions=8, mtp_depth=2),
    "all dense": dataclasses.replace(TINY, n_dense=3),
    "all moe, triton": dataclasses.replace(TINY, n_dense=0, impl="triton"),
    # DeepSeek-V3's pieces: multi-latent attention, groups scored by their best 2, MTP with its own norm
    "mla, group top-2, mtp norm": dataclasses.replace(TINY, n_kv_heads=4, head_dim=12, rope_dim=4, rope_interleaved=True, q_rank=10, kv_rank=6,
                                                       v_head_dim=5, n_groups=2, topk_groups=1, group_score_topk=2, mtp_depth=1, mtp_norm=True),
    # DeepSeek-V3.2's and GLM-5's: DeepSeek sparse attention over the latents (each query attends to the 3 keys its
    # indexer scores highest), the indexers trained by their loss; block 2 without an indexer, attending to block 1's choice
    "dsa": dataclasses.replace(TINY, n_kv_heads=4, head_dim=12, rope_dim=4, rope_interleaved=True, q_rank=10, kv_rank=6, v_head_dim=5,
                               index_topk=3, index_heads=4, index_head_dim=6, index_shared_layers=(2,), mtp_depth=1, mtp_norm=True),
    # gpt-oss's and Gemma's local layers: a sliding window in blocks 0 and 2, the others and MTP full
    "sliding window, mtp": dataclasses.replace(TINY, window=4, window_layers=(0, 2), mtp_depth=1),
    # EXAONE's layout: per-head q/k norms, local blocks 0 and 2 with RoPE, block 1 global without (NoPE)
    "nope global, window local": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 2), nope_layers=(1,), mtp_depth=1),
    # Llama 4's pieces: chunked attention in the RoPE blocks 0 and 2, block 1 NoPE with the
    # query temperature and without q/k norms, weightless q/k norms after interleaved RoPE,
    # the raw sigmoid of the top-1 logit scaling the expert's input
    "llama4": dataclasses.replace(TINY, chunk=4, chunk_layers=(0, 2), nope_layers=(1,), nope_temperature_floor=2, nope_temperature_scale=0.5,
                                  qk_norm="rms", qk_norm_after_rope=True, nope_qk_norm=False, rope_interleaved=True, score="sigmoid",
                                  expert_bias=False, route_normalize=False, k=1, route_on_input=True, mtp_depth=1),
    # AFMoE's (Arcee Trinity) blocks: gated attention, sandwich norms, per-head q/k norms,
    # local blocks 0 and 2 with RoPE, block 1 global without
    "afmoe": dataclasses.replace(TINY, attn_gate=True, pre_norms=True, post_norms=True, qk_norm="head", window=4, window_layers=(0, 2),
                                 nope_layers=(1,), route_scale=2.0, mtp_depth=1),
    # OLMo 2's / FlexOlmo's post-norm blocks (norms on the branch outputs, none on their inputs), and Gemma's sandwich
    "post-norm": dataclasses.replace(TINY, pre_norms=False, post_norms=True, qk_norm="proj", mtp_depth=1),
    # Qwen3-Next's / Qwen3.5's blocks: Gated DeltaNet in blocks 0 and 1, gated attention with
    # per-head q/k norms and partial RoPE in block 2 (and MTP), zero-centred norms, a gated shared expert
    "gated deltanet": dataclasses.replace(TINY, linear_layers=(0, 1), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6,
                                          zero_centered_norms=True, attn_gate=True, qk_norm="head", rope_dim=4, shared_gate=True, mtp_depth=1),
    # Kimi Linear's blocks: Kimi Delta Attention in blocks 0 and 1 (a decay per key channel, low-rank decay and gate),
    # multi-latent attention without RoPE in block 2 (and MTP's block, with RoPE)
    # Granite 4.0-H's blocks: Mamba-2 mixers in blocks 0 and 1 (C and B in 2 groups of a state of 8, read by 4 heads of 6; 3
    # taps with biases) beside a NoPE attention block; Granite's multipliers, an ungated shared expert
    "granite4": dataclasses.replace(TINY, linear_layers=(0, 1), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
                                    linear_v_dim=6, linear_conv=3, nope_layers=(2,), n_dense=0, n_shared=0, shared_ffn=20, score="softmax",
                                    expert_bias=False, attn_scale=0.3, embed_scale=2.0, residual_scale=0.5, logit_divisor=4.0, mtp_depth=1),
    # Falcon-H1's parallel hybrid: in every block a Mamba-2 mixer (its gate alone, no output norm) and softmax attention
    # beside it, both of the block's normed input, their outputs summed
    "falcon_h1": dataclasses.replace(TINY, linear_layers=(0, 1, 2), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
                                     linear_v_dim=6, linear_conv=3, parallel_hybrid=True, linear_gate_norm="none", mtp_depth=1),
    # MiniMax-Text-01's blocks: lightning attention in blocks 0 and 1 (a constant decay per head and depth, the output norm
    # over every head's channels) beside softmax attention, each residual the sublayer's normed input x 1.7 beside its
    # output x 0.6; Mixtral's MoE
    "minimax": dataclasses.replace(TINY, linear_layers=(0, 1), linear_kind="lightning", linear_k_heads=4, linear_v_heads=4, linear_k_dim=6,
                                   linear_v_dim=6, normed_residual=1.7, residual_scale=0.6, n_dense=0, n_shared=0, score="softmax",
                                   expert_bias=False, mtp_depth=1),
    # Nemotron-H's layers as blocks: Mamba-2 with the MLP after it (block 0), Mamba-2 alone (1: no MLP), NoPE attention
    # with its MLP (2), Mamba-2 with its MLP (3); dt's floor 0.05; every MLP relu(x w_up)^2 w_down
    "nemotron_h": dataclasses.replace(TINY, n_layers=4, n_dense=4, mlp_free_layers=(1,), linear_layers=(0, 1, 3), linear_kind="mamba2",
                                      linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3, linear_dt_min=0.05,
                                      mlp_act="relu2", nope_layers=(2,), mtp_depth=1),
    # Nemotron 3's: the same layers with MoE blocks (0, 2, 3) of experts without a gate (routed and shared: relu(x w_up)^2
    # w_down), sigmoid routing in 2 groups scored by their best 2, the expert bias, the weights x 2.5
    "nemotron 3": dataclasses.replace(TINY, n_layers=4, moe_layers=(0, 2, 3), mlp_free_layers=(1,), linear_layers=(0, 1, 3), linear_kind="mamba2",
                                      linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3, linear_dt_min=0.05,
                                      mlp_act="relu2", nope_layers=(2,), n_groups=2, topk_groups=1, group_score_topk=2, route_scale=2.5,
                                      mtp_depth=1),
    # Nemotron 3 Super's latent MoE: the routed experts over 12 channels between latent_in and latent_out
    "nemotron 3 super": dataclasses.replace(TINY, n_layers=4, moe_layers=(0, 2, 3), mlp_free_layers=(1,), linear_layers=(0, 1, 3),
                                            linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3,
                                            mlp_act="relu2", nope_layers=(2,), moe_latent=12, mtp_depth=1),
    # Nemotron-H-47B's runs of MLP layers: block 1 its MLP alone (no attention, nothing cached), a window on the attention
    "nemotron_h 47b": dataclasses.replace(TINY, n_layers=4, n_dense=4, mixer_free_layers=(1,), linear_layers=(0, 3), linear_kind="mamba2",
                                          linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3, mlp_act="relu2",
                                          window=4, mtp_depth=1),
    # Jais 2's: biased LayerNorms, dense MLPs without a gate with biases on their projections, q/k/v/o biases
    "jais2": dataclasses.replace(TINY, n_dense=3, layer_norms=True, norm_bias=True, mlp_act="relu2", mlp_bias=True, qkv_bias=True, o_bias=True,
                                 mtp_depth=1),
    # Apertus's: dense MLPs without a gate through xIELU (its two learned scalars each), per-head q/k norms
    "apertus": dataclasses.replace(TINY, n_dense=3, mlp_act="xielu", qk_norm="head", mtp_depth=1),
    # Mamba-2's: every block a Mamba-2 mixer alone (no attention, no MLP; the MTP block attends and has its MLP)
    "mamba2": dataclasses.replace(TINY, n_dense=3, linear_layers=(0, 1, 2), mlp_free_layers=(0, 1, 2), linear_kind="mamba2", linear_k_heads=2,
                                  linear_v_heads=4, linear_k_dim=8, linear_v_dim=6, linear_conv=3, mtp_depth=1),
    # Jamba's blocks: Mamba-1 mixers in blocks 0 and 2 (64 channels of x, each with a state of 8; dt of rank ceil(32 / 16) = 2;
    # dt, B and C RMS-normed with weights) beside NoPE attention in block 1, the MoE there alone (softmax over every expert,
    # the top 2 not renormalised)
    "jamba": dataclasses.replace(TINY, linear_layers=(0, 2), linear_kind="mamba1", linear_k_heads=1, linear_v_heads=64, linear_k_dim=8,
                                 linear_v_dim=1, linear_conv=3, linear_dt_bc_norm="rms", nope_layers=(1,), moe_layers=(1,), score="softmax",
                                 pre_softmax=True, expert_bias=False, n_shared=0, mtp_depth=1),
    # Mamba's and Falcon Mamba's: every block a Mamba-1 mixer alone (no attention, no MLP); Falcon Mamba's weightless norms
    "falcon mamba": dataclasses.replace(TINY, n_dense=3, linear_layers=(0, 1, 2), mlp_free_layers=(0, 1, 2), linear_kind="mamba1",
                                        linear_k_heads=1, linear_v_heads=64, linear_k_dim=8, linear_v_dim=1, linear_conv=3, linear_dt_rank=3,
                                        linear_dt_bc_norm="rms_unit", linear_norm_eps=1e-6, mtp_depth=1),
    # OLMo Hybrid's blocks: pre-norm Gated DeltaNet blocks 0 and 1 (beta = 2 sigmoid, the output norm's eps 1e-5) beside
    # OLMo 3's post-norm attention (q/k norms over the whole projections) in block 2 and the MTP block
    "olmo hybrid": dataclasses.replace(TINY, linear_layers=(0, 1), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6,
                                       linear_neg_eigval=True, linear_norm_eps=1e-5, linear_pre_norms=True, pre_norms=False, post_norms=True,
                                       qk_norm="proj", mtp_depth=1),
    "kimi linear": dataclasses.replace(TINY, linear_layers=(0, 1), linear_kind="kda", linear_k_heads=2, linear_v_heads=2, linear_k_dim=8,
                                       linear_v_dim=6, n_kv_heads=4, head_dim=12, rope_dim=4, kv_rank=6, v_head_dim=5, nope_layers=(2,),
                                       n_groups=2, topk_groups=1, group_score_topk=2, mtp_depth=1),
    # Ling's hybrid's blocks: Kimi Delta Attention with the whole decay and gate projections and the bounded decay in
    # blocks 0 and 1, multi-latent attention with interleaved RoPE and a sigmoid gate per head in block 2 (and MTP's)
    "ling": dataclasses.replace(TINY, linear_layers=(0, 1), linear_kind="kda", linear_k_heads=2, linear_v_heads=2, linear_k_dim=8,
                                linear_v_dim=6, linear_full_rank=True, linear_decay_bound=-5.0, n_kv_heads=4, head_dim=12, rope_dim=4,
                                rope_interleaved=True, kv_rank=6, v_head_dim=5, attn_gate=True, attn_gate_per_head=True, mtp_depth=1),
    "sandwich norms": dataclasses.replace(TINY, post_norms=True),
    # Cohere's: parallel blocks of one bias-free LayerNorm (the final and the MTP norms LayerNorms too), blocks 0 and 2
    # over a window with RoPE on interleaved pairs, block 1 global without RoPE, the logits scaled; Command R+'s q/k
    # LayerNorms, each head its own weights
    "cohere": dataclasses.replace(TINY, parallel_blocks=True, layer_norms=True, window=4, window_layers=(0, 2), nope_layers=(1,),
                                  rope_interleaved=True, logit_divisor=4.0, qk_norm="head_layer", mtp_depth=1),
    # DBRX's: every block MoE (softmax top-2 renormalised, no shared expert), bias-free LayerNorms, q, k and v clamped to [-0.5, 0.5]
    "dbrx": dataclasses.replace(TINY, n_dense=0, n_shared=0, score="softmax", expert_bias=False, layer_norms=True, clip_qkv=0.5, mtp_depth=1),
    # Phi-3.5-MoE's: every block MoE with SparseMixer's top-2, LayerNorms with biases, q/k/v/o and head biases, LongRoPE
    # on the first half of each head
    "phimoe": dataclasses.replace(TINY, n_dense=0, n_shared=0, score="sparsemixer", sparsemixer_eps=0.2, expert_bias=False, layer_norms=True,
                                  norm_bias=True, qkv_bias=True, o_bias=True, head_bias=True, rope_dim=4, longrope_short_factors=(1.0, 1.5),
                                  longrope_long_factors=(3.0, 9.0), longrope_original_max_positions=1, longrope_short_scale=1.1,
                                  longrope_long_scale=1.3, mtp_depth=1),
    # A.X-K1's: a norm on the MoE blocks' output only (blocks 1 and 2, and the MTP block's), none on the dense block's or the attention's
    "moe out norm": dataclasses.replace(TINY, moe_out_norm=True, mtp_depth=1),
    # LFM2's blocks: gated short convolutions (3 taps over the 32 channels, 8 heads of 4) in blocks 0 and 1, per-head q/k norms
    "lfm2": dataclasses.replace(TINY, linear_layers=(0, 1), linear_kind="short_conv", linear_k_heads=8, linear_v_heads=8, linear_k_dim=4,
                                linear_v_dim=4, linear_conv=3, qk_norm="head", mtp_depth=1),
    # MiMo-V2-Flash's attention: values of 6 channels beside q/k heads of 8, scaled by 0.7; the window's blocks 0 and 2
    # with 4 kv heads (1 and the MTP block's 2), sinks and their own RoPE base
    "mimo": dataclasses.replace(TINY, v_head_dim=6, value_scale=0.7, window=4, window_layers=(0, 2), local_kv_heads=4, attn_sinks=True,
                                sink_layers=(0, 2), local_rope_base=100.0, mtp_depth=1),
    # Laguna's: the window's blocks 1 and 2 with 8 query heads (block 0 and the MTP block's 4)
    # and their own RoPE over every channel (the others' over half), a softplus output gate
    # per head, router logits soft-capped at 1.5
    "laguna": dataclasses.replace(TINY, window=4, window_layers=(1, 2), local_heads=8, rope_dim=4, rope_base=5e5, local_rope_base=100.0,
                                  local_rope_dim=8, attn_gate=True, attn_gate_act="softplus", attn_gate_per_head=True, router_softcap=1.5,
                                  qk_norm="head", score="sigmoid", route_scale=2.0, mtp_depth=1),
    # LongCat-Flash's zero-computation experts: 3 identity experts beside the 4 computing ones, softmax scores with
    # the expert bias, the computing experts' capacity
    "zero experts": dataclasses.replace(TINY, zero_experts=3, score="softmax", capacity_factor=1.0, mtp_depth=1),
    # LongCat-Flash's blocks: shortcut pairs (0, 1) and (2, 3), each first block's MoE beside its dense MLP and its
    # output added after the second block's MLP; multi-latent attention with its q and kv latents scaled; softmax over
    # 4 experts and 2 identity experts, the top-2 probabilities (plus the expert bias for the choice) x 6
    "longcat": dataclasses.replace(TINY, n_layers=4, n_dense=0, n_shared=0, shortcut_moe=True, zero_experts=2, score="softmax", pre_softmax=True,
                                   route_scale=6.0, n_kv_heads=4, head_dim=12, rope_dim=4, rope_interleaved=True, q_rank=10, kv_rank=6,
                                   v_head_dim=5, mla_scales=True, mtp_depth=1),
    # DeepSeek-V4's manifold-constrained hyper-connections: 4 residual streams, mixed by doubly stochastic matrices
    "mhc": dataclasses.replace(TINY, hyper_connections=4, hc_sinkhorn_iters=5),
    # HY-V4's blocks: 3 independent streams (no mixing); multi-latent attention with DeepSeek sparse attention (block 2
    # reusing block 1's choice), an elementwise sigmoid output gate and sinks; the routed experts' SwiGLU clamped
    "hy_v4": dataclasses.replace(TINY, hyper_connections=3, hc_kind="independent", n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10,
                                 kv_rank=6, v_head_dim=5, index_topk=3, index_heads=4, index_head_dim=6, index_shared_layers=(2,),
                                 attn_gate=True, attn_sinks=True, swiglu_alpha=1.0, swiglu_limit=0.5, swiglu_offset=0.0),
    # Kolibri-1's blocks: EXAONE's attention (blocks 0 and 1 over a window with RoPE, block 2 global without) in
    # sandwich blocks, every block MoE routed on the logits plus the expert bias, the raw sigmoids as weights
    "kolibri1": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 1), nope_layers=(2,), post_norms=True, n_dense=0,
                                    route_normalize=False, expert_bias_on_logits=True, mtp_depth=1),
    # A.X-K2's blocks: DeepSeek sparse attention over multi-latent attention whose wq_b reads the q latent normed and
    # raw, an output gate over that input too; gated RMSNorms before the attention and before each MoE
    "axk2": dataclasses.replace(TINY, n_kv_heads=4, head_dim=12, rope_dim=4, rope_interleaved=True, q_rank=10, kv_rank=6, v_head_dim=5,
                                index_topk=3, index_heads=4, index_head_dim=6, q_latent_raw=True, attn_gate=True, attn_gate_on_q=True,
                                norm_gate_rank=3, mtp_depth=1),
    # Beam's blocks: blocks 0 and 2 over a window with RoPE, block 1 global without and its queries scaled by
    # (1 + (p + 1) / 4) ** 0.5; an elementwise sigmoid output gate with a bias per head; sandwich norms; depth-scaled
    # residual adds; groups scored by their best 2, x 2.5, no shared expert; the logits capped at 3
    "beam": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 2), nope_layers=(1,), nope_temperature_floor=4,
                                nope_temperature_scale=0.5, nope_temperature_kind="power", attn_gate=True, attn_gate_bias=True, post_norms=True,
                                depth_scaled_residual=True, n_groups=2, topk_groups=1, group_score_topk=2, route_scale=2.5, n_shared=0,
                                logit_softcap=3.0),
    # Gemma's GeGLU in every MLP: the dense block's, the shared expert's, the routed experts', the MTP module's
    "geglu": dataclasses.replace(TINY, mlp_act="gelu_tanh", mtp_depth=1),
    # Gemma 3's blocks: zero-centred sandwich norms, the embeddings x sqrt(32), a softmax scale of 6 ** -0.5, blocks 0
    # and 2 over a window with plain RoPE at 100, block 1 global with linear RoPE (factor 4); GeGLU; the logits capped
    "gemma3": dataclasses.replace(TINY, mlp_act="gelu_tanh", qk_norm="head", post_norms=True, zero_centered_norms=True, embed_scale=32**0.5,
                                  attn_scale=6**-0.5, window=4, window_layers=(0, 2), local_rope_base=100.0, rope_linear_factor=4.0,
                                  logit_softcap=3.0),
    # Gemma 4's blocks: blocks 0 and 2 over a window with heads of 6 and 4 kv heads (plain RoPE at 100), block 1 global
    # with proportional RoPE (a quarter of the frequencies turn) and its values the keys' projection; the values
    # RMS-normed; each MoE beside a dense MLP, routed over its own norm, each expert's weights scaled; layer scalars
    "gemma4": dataclasses.replace(TINY, mlp_act="gelu_tanh", qk_norm="head", post_norms=True, v_norm=True, global_k_eq_v=True, window=4,
                                  window_layers=(0, 2), local_head_dim=6, local_kv_heads=4, local_rope_base=100.0, rope_proportion=0.25,
                                  n_dense=0, n_shared=0, score="softmax", expert_bias=False, dense_beside_moe=True, router_norm=True,
                                  router_expert_scale=True, layer_scalars=True, attn_scale=1.0, embed_scale=32**0.5, logit_softcap=3.0,
                                  mtp_depth=1),
    # gpt-oss's pieces: q/k/v/o biases, attention sinks, a router bias, expert biases, the
    # clamped SwiGLU, YaRN without truncation, sliding windows in blocks 0 and 2
    "gpt-oss": dataclasses.replace(TINY, qkv_bias=True, o_bias=True, attn_sinks=True, router_bias=True, expert_biases=True, swiglu_alpha=1.702,
                                   swiglu_limit=0.5, swiglu_offset=1.0, window=4, window_layers=(0, 2), yarn_factor=4.0,
                                   yarn_original_max_positions=8, yarn_truncate=False),
    # NanoChat's: every norm without weights, the embeddings' too, RoPE turned the other way, weightless q/k norms after
    # it, relu^2 MLPs (its dense model; the MoE block's experts through relu^2 too), the logits capped
    "nanochat": dataclasses.replace(TINY, mlp_act="relu2", norm_weights=False, embed_norm=True, rope_reversed=True, qk_norm="rms",
                                    qk_norm_after_rope=True, logit_softcap=15.0, mtp_depth=1),
    # GPT-Neo's blocks: learned absolute positions (no RoPE), local attention over a window of 4 in blocks 0 and 2, a softmax
    # scale of 1, LayerNorms with bias, an output bias, MLPs without a gate through GELU's tanh form
    "gpt-neo": dataclasses.replace(TINY, abs_positions=32, window=4, window_layers=(0, 2), attn_scale=1.0, layer_norms=True, norm_bias=True,
                                   o_bias=True, mlp_act="gelu_new", mlp_bias=True),
    # Muse Spark's: weightless q/k norms, scaled queries, each head's output normed before the gate, the embeddings' weightless
    # norm, a plain final norm, the post-norms weightless (attention) and prescaled (MLP) at their own eps, residual gates
    # per channel; windows in blocks 0 and 2 with RoPE, NoPE in block 1 (its window none); latent MoE blocks (20 channels, their
    # input normed, each expert's output normed before its weight) routed on scaled logits; the logits scaled and capped
    "muse spark": dataclasses.replace(TINY, qk_norm="rms", attn_scale=0.5, attn_gate=True, attn_out_norm=True, post_norms=True,
                                      zero_centered_norms=True, embed_norm=True, post_norm_eps=1e-8,
                                      norm_overrides=("embed:unit", "final:plain", "attn_post:unit", "mlp_post:prescaled"), residual_gates=True,
                                      window=4, window_layers=(0, 2), nope_layers=(1,), n_shared=0, score="sigmoid", router_scale=0.7,
                                      moe_latent=20, moe_latent_norm=True, expert_out_norm=True, logit_divisor=1 / 0.7, logit_softcap=3.0, mtp_depth=1),
    # BLOOM's: ALiBi in place of RoPE (over the window in blocks 0 and 2), a LayerNorm with bias on the embeddings and in every block
    "alibi": dataclasses.replace(TINY, alibi=True, embed_norm=True, layer_norms=True, norm_bias=True, window=4, window_layers=(0, 2)),
    # Step 3.7's: sliding blocks 0 and 2 with more query heads and their own plain RoPE beside a full block whose half-head RoPE
    # has Llama 3.1's scaling, a sigmoid gate per head, zero-centred norms, the SwiGLU limits on silu(gate) in some blocks alone
    "step3p7": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 2), local_heads=8, rope_dim=4, local_rope_base=500.0,
                                   local_rope_dim=8, llama3_factor=2.0, llama3_original_max_positions=8, attn_gate=True, attn_gate_per_head=True,
                                   attn_scale=6**-0.5, zero_centered_norms=True, mlp_act="silu_cap", swiglu_limit=0.01, swiglu_limit_layers=(2,),
                                   shared_swiglu_limit=0.01, shared_swiglu_limit_layers=(0, 2), route_scale=2.5, score="sigmoid",
                                   n_shared=0, shared_ffn=24, mtp_depth=1),
    # JetMoE's: a mixture of attention heads (3 attention experts' query and output projections, 2 per token, over 2 shared kv
    # heads) in every block and the MTP's, its routers balanced by their loss; a bias on the MoE blocks' output
    "jetmoe": dataclasses.replace(TINY, moa_experts=3, moa_topk=2, moe_out_bias=True, score="softmax", expert_bias=False, n_shared=0,
                                  mtp_depth=1),
    # DeepSeek-V4's pieces: sqrt(softplus) scores, block 1 routing by a table of token ids (hash_moe), block 2 and the MTP's by
    # the router plus the expert bias, the chosen renormalised and scaled, the SwiGLUs clamped; the grouped output projection
    # (2 groups of 2 heads, each to 6 channels), shared key-value heads (the values the normed, rotated keys, the outputs
    # rotated back) and attention sinks in every attention block
    # DeepSeek-V4's pieces: hash and sqrt(softplus) routing, the clamped SwiGLU, a q latent, RoPE on each head's last 4
    # channels in pairs, the queries' weightless norm beside the keys' weighted one, shared key-value heads, sinks, the
    # grouped output projection, a window
    "dsv4": dataclasses.replace(TINY, score="sqrtsoftplus", hash_layers=1, route_scale=1.5, swiglu_limit=0.5, shared_swiglu_limit=0.5,
                                mtp_depth=1, o_groups=2, o_rank=6, kv_shared=True, qk_norm="head_k", attn_sinks=True, q_rank=10, rope_dim=4,
                                rope_last=True, rope_interleaved=True, window=5, window_layers=(0, 2)),
}
# DeepSeek-V4's heavily compressed attention in blocks 1 and 2 (runs of 3 tokens; one kv head), with YaRN there, the window's
# block 0 at its own plain RoPE
VARIANTS["dsv4-hca"] = dataclasses.replace(VARIANTS["dsv4"], n_kv_heads=1, compress_layers=(1, 2), compress_rate=3, local_rope_base=100.0,
                                           yarn_factor=2.0, yarn_original_max_positions=8, yarn_mscale=0.0, yarn_mscale_all_dim=0.0)
# DeepSeek-V4's compressed sparse attention in block 1 (not in VARIANTS: its indexer's weights get no gradient; overlapping entries of runs of 2 tokens, each query's best 2 by an
# indexer of 4 heads of 8), heavily compressed attention in block 2
DSV4_CSA = dataclasses.replace(VARIANTS["dsv4-hca"], compress_layers=(2,), csa_layers=(1,), csa_rate=2, csa_topk=2, index_heads=4, index_head_dim=8,
                               mtp_depth=0)


# MiniMax-M3's blocks: block-sparse attention in blocks 1 and 2 (and the MTP block: an indexer head per kv head choosing 2 blocks
# of 3 keys, the query's own among them), per-head q/k norms, every norm 1 + weight, every SwiGLU clamped with up + 1
MINIMAX_M3 = dataclasses.replace(TINY, index_topk_blocks=2, index_block_size=3, index_heads=2, index_head_dim=8, index_block_layers=(1, 2),
                                 qk_norm="head", rope_dim=4, zero_centered_norms=True, swiglu_alpha=1.702, swiglu_limit=1.5, swiglu_offset=1.0,
                                 shared_swiglu_alpha=1.702, shared_swiglu_limit=1.5, shared_swiglu_offset=1.0, mtp_depth=1)


def _batch(cfg, T=24, cu=(0, 7, 8, 24), padding=0):
    """Random tokens in documents cu; with padding, the last `padding` tokens (a sequence of
    their own) are padding, as Sampler(whole_documents=True) makes it."""
    keep = None if not padding else torch.arange(T) < T - padding
    return make_batch(torch.randint(0, cfg.vocab_size, (T,)), torch.tensor(cu), mtp_depth=cfg.mtp_depth, label_mask=keep, token_mask=keep)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_backward_each_feature(name):
    cfg = VARIANTS[name]
    model = Transformer(cfg)
    batch = _batch(cfg)
    losses, stats = model(batch, model.context(batch))
    n_valid = int(batch["loss_mask"].sum())
    assert int(losses["lm_tokens"]) == n_valid == 24 - 3  # the last token of each document has no label
    mean = losses["lm_sum"].detach() / losses["lm_tokens"]
    assert abs(float(mean) - torch.log(torch.tensor(float(cfg.vocab_size)))) < 0.5  # near uniform at init
    total = losses["lm_sum"]
    for d in range(1, cfg.mtp_depth + 1):
        # depth d predicts d + 1 tokens ahead: a document of length n keeps n - d - 1 labels
        assert int(losses[f"mtp_{d}_tokens"]) == sum(max(0, n - d - 1) for n in (7, 1, 16))
        total = total + losses[f"mtp_{d}_sum"]
    moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
    assert sorted(stats.keys()) == sorted([f"layer_{i}" for i in moe_layers] + [f"mtp_{d}" for d in range(1, cfg.mtp_depth + 1) if moe_layers])
    assert sorted(model.moe_layers()) == sorted(stats.keys())  # the bias update finds each layer's counts by name
    for key in stats.keys():
        assert int(stats[key]["tokens_per_expert"].sum()) <= 24 * cfg.k
    total.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    if cfg.expert_bias:  # every MoE block's but a hashed one's (hash_layers: nothing to balance)
        assert all(m.expert_bias.dtype == torch.float32 for i, m in enumerate(model.moe_layers().values()) if i >= cfg.hash_layers)


def test_loss_of_a_document_does_not_depend_on_packing():
    model = Transformer(TINY)
    doc = torch.randint(0, TINY.vocab_size, (9,))
    other = torch.randint(0, TINY.vocab_size, (5,))

    def loss(tokens, cu):
        return model(make_batch(tokens, torch.tensor(cu)))[0]["lm_sum"]

    alone = loss(doc, [0, 9])
    both = loss(torch.cat([other, doc]), [0, 5, 14])
    torch.testing.assert_close(both - loss(other, [0, 5]), alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["window", "chunk"])
def test_local_layers_see_only_their_window_or_chunk(kind):
    """The blocks of window_layers attend over the window (chunk_layers: within their chunk
    of each document), the others over every earlier token: a model whose window or chunk
    spans every document is the full-attention model; a narrow one changes the logits only
    from the window's edge (each document's second chunk) on, and only through its layers."""
    torch.manual_seed(0)
    ref = Transformer(TINY).eval()
    ids, cu = torch.randint(0, TINY.vocab_size, (20,)), torch.tensor([0, 12, 20], dtype=torch.int32)
    with torch.no_grad():
        want = ref.logits(ids, cu)

        def logits(**knobs):
            model = Transformer(dataclasses.replace(TINY, **knobs)).eval()
            model.load_state_dict(ref.state_dict())
            return model.logits(ids, cu)

        torch.testing.assert_close(logits(**{kind: 12}), want)  # as long as the longest document
        narrow = {kind: 3, f"{kind}_layers": (1,)}
        local = logits(**narrow)
        assert [getattr(b.attn.cfg, kind) for b in Transformer(dataclasses.replace(TINY, **narrow)).blocks] == [None, 3, None]
    torch.testing.assert_close(local[[0, 1, 2, 12, 13, 14]], want[[0, 1, 2, 12, 13, 14]])  # the first 3 tokens of each document
    assert float((local - want).abs().amax(-1)[[3, 15]].min()) > 1e-4  # the 4th on: its first key out of the window (a chunk of its own)


def test_sliding_window_knobs_are_checked():
    with pytest.raises(ValueError, match="window: expected >= 1, got 0"):
        dataclasses.replace(TINY, window=0)
    with pytest.raises(ValueError, match="window_layers: needs a window"):
        dataclasses.replace(TINY, window_layers=(0,))
    with pytest.raises(ValueError, match=r"window_layers: expected distinct block indices in 0..2, got \(0, 3\)"):
        dataclasses.replace(TINY, window=4, window_layers=(0, 3))
    cfg = dataclasses.replace(TINY, window=4, window_layers=(2, 0))
    assert cfg.window_layers == (0, 2) and [cfg.is_sliding(i) for i in range(3)] == [True, False, True] and cfg.any_sliding
    assert all(dataclasses.replace(TINY, window=4).is_sliding(i) for i in range(3)) and not TINY.any_sliding


def test_llama4_knobs_are_checked_and_build_what_they_say():
    with pytest.raises(ValueError, match="chunk_layers: needs a chunk"):
        dataclasses.replace(TINY, chunk_layers=(0,))
    with pytest.raises(ValueError, match=r"chunk: chunked attention or a sliding window, not both \(window = 4\)"):
        dataclasses.replace(TINY, chunk=8, window=4)
    with pytest.raises(ValueError, match=r"chunk_layers: expected distinct block indices in 0..2, got \(0, 3\)"):
        dataclasses.replace(TINY, chunk=4, chunk_layers=(0, 3))
    with pytest.raises(ValueError, match="nope_temperature_floor: scales the NoPE blocks' queries, needs nope_layers"):
        dataclasses.replace(TINY, nope_temperature_floor=4)
    with pytest.raises(ValueError, match="temperature_floor: expected >= 1, got 0"):
        dataclasses.replace(TINY, nope_layers=(1,), nope_temperature_floor=0)
    with pytest.raises(ValueError, match="route_on_input: expected a bool, got 1"):
        dataclasses.replace(TINY, route_on_input=1)
    cfg = VARIANTS["llama4"]
    assert [cfg.is_chunked(i) for i in range(3)] == [True, False, True] and cfg.any_local and not cfg.any_sliding
    model = Transformer(cfg)
    attn = [b.attn.cfg for b in model.blocks]
    assert [a.chunk for a in attn] == [4, None, 4] and [a.rope for a in attn] == [True, False, True]
    assert [a.qk_norm for a in attn] == ["rms", None, "rms"] and [a.temperature_floor for a in attn] == [None, 2, None]
    assert model.mtp[0].block.attn.cfg.chunk is None  # the MTP blocks attend to every earlier token, with RoPE
    assert not any(name.endswith(("q_norm", "k_norm")) for name, _ in model.named_parameters())  # "rms" has no weights
    assert all(b.mlp.cfg.weights_on_input for b in model.blocks[1:])
    # nope_qk_norm=True keeps the NoPE blocks' norms (EXAONE's global layers)
    kept = Transformer(dataclasses.replace(TINY, qk_norm="head", nope_layers=(1,)))
    assert kept.blocks[1].attn.cfg.qk_norm == "head" and hasattr(kept.blocks[1].attn, "q_norm")


def test_query_temperature_knobs_are_checked_and_reach_every_block():
    """Mistral 4's query scale by position: every block's attention (the MTP block's too,
    multi-latent or grouped-query) takes floor(p / floor), offset 0; bad knobs are refused by
    name, and so is the NoPE blocks' temperature beside it."""
    with pytest.raises(ValueError, match="query_temperature_floor: expected >= 1, got 0"):
        dataclasses.replace(TINY, query_temperature_floor=0)
    with pytest.raises(ValueError, match="query_temperature_scale: expected a finite number, got inf"):
        dataclasses.replace(TINY, query_temperature_floor=4, query_temperature_scale=math.inf)
    with pytest.raises(ValueError, match="query_temperature_floor: scales every block's queries, not beside nope_temperature_floor"):
        dataclasses.replace(TINY, nope_layers=(1,), nope_temperature_floor=2, query_temperature_floor=4)
    for cfg in (dataclasses.replace(VARIANTS["mla, group top-2, mtp norm"], query_temperature_floor=4, query_temperature_scale=0.5),
                dataclasses.replace(TINY, nope_layers=(1,), query_temperature_floor=4, query_temperature_scale=0.5, mtp_depth=1)):
        model = Transformer(cfg)
        attn = [b.attn.cfg for b in model.blocks] + [m.block.attn.cfg for m in model.mtp]
        assert len(attn) == 4 and all((a.temperature_floor, a.temperature_scale, a.temperature_offset) == (4, 0.5, 0) for a in attn)


def test_nope_layers_attend_without_rope():
    """The blocks of nope_layers leave q and k unrotated: a model whose blocks are all NoPE
    gives the same logits at any positions (only the causal mask orders its tokens), and
    one NoPE block among RoPE blocks changes the logits; the MTP blocks always rotate."""
    nope = _sharp(dataclasses.replace(TINY, nope_layers=(0, 1, 2)))
    ids, cu = torch.randint(0, TINY.vocab_size, (20,)), torch.tensor([0, 12, 20], dtype=torch.int32)
    shuffled = torch.randperm(20)  # positions no rotation can ignore
    with torch.no_grad():
        torch.testing.assert_close(nope.logits(ids, cu, positions=shuffled), nope.logits(ids, cu))
        rope = Transformer(TINY).eval()
        rope.load_state_dict(nope.state_dict())
        assert float((rope.logits(ids, cu, positions=shuffled) - rope.logits(ids, cu)).abs().max()) > 0.1
        one = Transformer(dataclasses.replace(TINY, nope_layers=(1,), mtp_depth=1)).eval()
        assert [b.attn.cfg.rope for b in one.blocks] == [True, False, True] and one.mtp[0].block.attn.cfg.rope
        one.load_state_dict(rope.state_dict(), strict=False)
        assert float((one.logits(ids, cu) - rope.logits(ids, cu)).abs().max()) > 0.1


def test_nope_knobs_are_checked():
    with pytest.raises(ValueError, match=r"nope_layers: expected distinct block indices in 0..2, got \(1, 3\)"):
        dataclasses.replace(TINY, nope_layers=(1, 3))
    with pytest.raises(ValueError, match="rope: expected a bool, got 0"):
        TINY.attention_config(rope=0)
    cfg = dataclasses.replace(TINY, nope_layers=(2, 0))
    assert cfg.nope_layers == (0, 2) and [cfg.is_nope(i) for i in range(3)] == [True, False, True] and not TINY.is_nope(0)


def test_post_norms_normalise_each_branch_output():
    """post_norms: an RMSNorm on the attention and MLP outputs before each residual add; with
    their weights 0 every block is the identity (the logits those of the embedding through the
    final norm and the head). pre_norms=False leaves the inputs unnormed; the default block
    has pre-norms only."""
    post = Transformer(dataclasses.replace(TINY, pre_norms=False, post_norms=True)).eval()
    names = {n for n, _ in post.named_parameters() if "norm" in n and n.startswith("blocks.0.")}
    assert names == {"blocks.0.attn_post_norm.weight", "blocks.0.mlp_post_norm.weight"}
    assert {n for n, _ in Transformer(TINY).named_parameters() if "norm" in n and n.startswith("blocks.0.")} == {
        "blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight"}
    ids, cu = torch.randint(0, TINY.vocab_size, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        for n, p in post.named_parameters():
            if "post_norm" in n:
                p.zero_()
        want = (post.norm(post.embed[ids]) @ post.output_weight().T).float()
        torch.testing.assert_close(post.logits(ids, cu), want)
        for n, p in post.named_parameters():
            if "post_norm" in n:
                p.fill_(2.0)
        assert float((post.logits(ids, cu) - want).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="post_norms: expected a bool, got 1"):
        dataclasses.replace(TINY, post_norms=1)


def test_zero_centered_norms_are_one_plus_their_weights():
    """zero_centered_norms: every RMSNorm's gain (the blocks', the final, the MTP modules', the
    q/k norms) is 1 + weight, the weights 0 at initialisation: the model of weights w equals
    the plain model of weights 1 + w; the linear-attention blocks' gated output norm is not
    zero-centred (1 at initialisation in both)."""
    cfg = dataclasses.replace(VARIANTS["gated deltanet"], mtp_norm=True)
    zc = Transformer(cfg)
    plain = Transformer(dataclasses.replace(cfg, zero_centered_norms=False))
    norms = [n for n, _ in zc.named_parameters() if n.endswith(("norm.weight", "q_norm", "k_norm"))]
    assert len(norms) == 3 * 2 + 2 + 1 + 3 + 2 + 2  # block pre-norms, q/k norms of block 2, final; MTP: emb/hidden/out, block norms, q/k
    assert all(float(zc.get_parameter(n).detach().abs().max()) == 0 for n in norms)
    assert torch.equal(zc.get_parameter("blocks.0.attn.out_norm"), torch.ones(6))
    with torch.no_grad():
        for n, p in zc.named_parameters():
            p.normal_(0.0, 0.3)
        plain.load_state_dict({n: t + 1 if n in norms else t for n, t in zc.state_dict().items()})
    batch = _batch(cfg)
    torch.testing.assert_close(zc(batch)[0]["lm_sum"], plain(batch)[0]["lm_sum"])
    torch.testing.assert_close(zc(batch)[0]["mtp_1_sum"], plain(batch)[0]["mtp_1_sum"])
    with pytest.raises(ValueError, match="zero_centered_norms: expected a bool, got 1"):
        dataclasses.replace(TINY, zero_centered_norms=1)


def test_norm_overrides_give_each_norm_its_kind_and_the_post_norms_their_eps():
    """norm_overrides: the embeddings' norm without a weight ("unit"), the final norm's gain its
    weight ("plain", 1 at the start) beside zero-centred block norms, the attention's post-norm
    weightless, the MLP's prescaled (y / rms(y) for y = x (1 + w), 0 at the start), each its
    formula; post_norm_eps the post-norms' eps, the others' norm_eps; a run's config.json list
    reads as the tuple; refusals by name."""
    cfg = dataclasses.replace(TINY, post_norms=True, zero_centered_norms=True, embed_norm=True, post_norm_eps=1e-3,
                              norm_overrides=("embed:unit", "final:plain", "attn_post:unit", "mlp_post:prescaled"))
    model = Transformer(cfg)
    block = model.blocks[1]
    assert model.embed_norm.weight is None and block.attn_post_norm.weight is None
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden)) and not model.norm.zero_centered
    assert torch.equal(block.mlp_post_norm.weight, torch.zeros(cfg.hidden)) and block.mlp_post_norm.prescaled
    assert torch.equal(block.attn_norm.weight, torch.zeros(cfg.hidden)) and block.attn_norm.zero_centered
    assert (block.attn_post_norm.eps, block.mlp_post_norm.eps, block.attn_norm.eps, model.norm.eps, model.embed_norm.eps) == (1e-3, 1e-3, 1e-6, 1e-6, 1e-6)
    x = torch.randn(5, cfg.hidden, dtype=torch.float64) * 0.05  # small: the eps shows

    def rms(y, eps):
        return y / torch.sqrt(y.square().mean(-1, keepdim=True) + eps)

    with torch.no_grad():
        for norm in (model.norm, block.mlp_post_norm, block.attn_norm):
            norm.weight.normal_(0.0, 0.5)
        w = {name: n.weight.double() for name, n in (("final", model.norm), ("mlp_post", block.mlp_post_norm), ("pre", block.attn_norm))}
        cases = ((model.embed_norm, rms(x, 1e-6)), (block.attn_post_norm, rms(x, 1e-3)), (model.norm, rms(x, 1e-6) * w["final"]),
                 (block.mlp_post_norm, rms(x * (1 + w["mlp_post"]), 1e-3)), (block.attn_norm, rms(x, 1e-6) * (1 + w["pre"])))
        for norm, want in cases:
            torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=1e-6)
        losses, _ = model(_batch(cfg))
    assert torch.isfinite(losses["lm_sum"])
    assert TransformerConfig(**dict(dataclasses.asdict(cfg), norm_overrides=list(cfg.norm_overrides))) == cfg  # a run's config.json
    for change, message in ((dict(norm_overrides=("final:bf16",)), r"norm_overrides: expected 'role:kind' entries, role one of embed, attn_post, "
                                                                   r"mlp_post, final and kind one of unit, plain, zero_centered, prescaled, got 'final:bf16'"),
                            (dict(norm_overrides=("final:plain", "final:unit")), "norm_overrides: the final norm's kind is given twice"),
                            (dict(norm_overrides="final:plain"), "norm_overrides: expected a tuple of 'role:kind' strings, got 'final:plain'"),
                            (dict(post_norms=False, pre_norms=True), r"post_norm_eps: the post-norms' eps, needs post_norms \(or moe_out_norm\)"),
                            (dict(post_norm_eps=None, embed_norm=False), r"norm_overrides: the embed norm's kind, but the model has no such norm \(needs embed_norm\)"),
                            (dict(post_norm_eps=-1.0), r"post_norm_eps: expected None or a finite number >= 0, got -1.0"),
                            (dict(layer_norms=True, zero_centered_norms=False), "norm_overrides: the kinds of RMSNorms with weights, not with layer_norms")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cfg, **change)
    with pytest.raises(ValueError, match="prescaled: the gain 1 \\+ weight before the norm"):
        RMSNorm(4, 1e-6, prescaled=True)


def test_residual_gates_weigh_each_add_and_attn_out_norm_norms_each_head_s_output():
    """residual_gates: each block's two residual adds are alpha x + beta y channel by channel,
    beta = sigmoid(g / T), alpha = sqrt(max(sigmoid(-g / T) (1 + beta), 1e-3)) of the add's
    gate g [H] (float32, kept so when the model is cast; Normal(0, init_std) at the start);
    attn_out_norm: the attention's output is its heads' outputs RMS-normed each over its
    channels, without weights, before the gate and wo (the same attention without the norm,
    its output normed by hand). mla_norm_eps reaches the attention's latent norms. Refusals by
    name."""
    from fmoe.model import ResidualGate

    gate = ResidualGate(6, temperature=0.3)
    with torch.no_grad():
        gate.gate.copy_(torch.tensor([-3.0, -0.5, 0.0, 0.2, 1.0, 4.0]))
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    w = gate.gate / 0.3
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + beta), min=1e-3))
    torch.testing.assert_close(gate(x, y), alpha * x + beta * y)
    with torch.no_grad():  # alpha alone: x = 1, y = 0; the gate of 4 (w = 13.3) at the floor sqrt(1e-3), -3's (w = -10) near 1
        kept = gate(torch.ones(1, 6), torch.zeros(1, 6))[0]
    sig = 1 / (1 + math.exp(-10))  # sigmoid(-w) at w = -10
    assert float(kept[5]) == pytest.approx(1e-3 ** 0.5) and float(kept[0]) == pytest.approx((sig * (2 - sig)) ** 0.5)
    assert gate.to(torch.bfloat16).gate.dtype == torch.float32 and gate(x.bfloat16(), y.bfloat16()).dtype == torch.bfloat16
    cfg = dataclasses.replace(TINY, residual_gates=True, residual_gate_temperature=0.5, attn_out_norm=True, attn_gate=True)
    model = Transformer(cfg)
    block = model.blocks[0]
    assert block.attn_residual_gate.gate.std() > 0.005 and block.attn_residual_gate.temperature == 0.5
    batch = _batch(cfg)
    ctx = model.context(batch)
    h = torch.randn(24, cfg.hidden)
    with torch.no_grad():
        a = block._attend(h, ctx.attention[0])
        x1 = block.attn_residual_gate(h, a)
        m, _ = block._mlp_out(block.mlp_norm(x1))
        torch.testing.assert_close(block(h, ctx.attention[0])[0], block.mlp_residual_gate(x1, m))
        # the heads' outputs normed: the same attention without the norm and with wo = I, normed per head, then wg's gate and wo
        plain = dataclasses.replace(block.attn.cfg, out_norm=False)
        params = {n: p for n, p in block.attn.named_parameters()}
        eye = dict(params, wo=torch.eye(cfg.n_heads * cfg.head_dim), wg=torch.full_like(params["wg"], 0.0))
        from fmoe.layers import attention

        normed_in = block.attn_norm(h)
        out, _ = attention(normed_in, eye, plain, ctx.attention[0])
        heads = out.view(24, cfg.n_heads, cfg.head_dim) * 2  # sigmoid(0) = 1/2 undone
        heads = heads / torch.sqrt(heads.square().mean(-1, keepdim=True) + cfg.norm_eps)
        want = (heads.reshape(24, -1) * torch.sigmoid(normed_in @ params["wg"])) @ params["wo"]
        torch.testing.assert_close(block.attn(normed_in, ctx.attention[0]), want, rtol=1e-5, atol=1e-5)
    losses, _ = model(batch, ctx)
    losses["lm_sum"].backward()
    assert block.attn_residual_gate.gate.grad.abs().sum() > 0 and block.mlp_residual_gate.gate.grad.abs().sum() > 0
    for change, message in ((dict(hyper_connections=2), "residual_gates: each residual add weighed by its gate, not with hyper_connections"),
                            (dict(residual_scale=0.5), "residual_gates: each residual add weighed by its gate, not with residual_scale"),
                            (dict(residual_gate_temperature=0.0), "residual_gate_temperature: expected a positive finite number, got 0.0"),
                            (dict(router_scale=-1.0), "router_scale: expected a positive finite number, got -1.0"),
                            (dict(moe_latent_norm=True), "moe_latent_norm: the norm of a latent MoE's experts' input, needs moe_latent"),
                            (dict(kv_rank=6, q_rank=8, head_dim=12, rope_dim=4, n_kv_heads=4, v_head_dim=5),
                             r"attn_out_norm: each grouped-query attention head's output normed, not multi-latent attention's \(kv_rank\)"),
                            (dict(attn_out_norm=1), "attn_out_norm: expected a bool, got 1"),
                            (dict(mla_norm_eps=1e-5), r"mla_norm_eps: the eps of the q and kv latents' norms, needs kv_rank or q_rank \(got 1e-05\)"),
                            (dict(mla_norm_eps=-1.0, kv_rank=6), r"mla_norm_eps: the latent norms' eps, None or a finite number >= 0, got -1.0")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cfg, **change)
    # mla_norm_eps: the latents' norms' eps (HY-V4-VL's rms_norm_eps; 1e-6 by default)
    mla = VARIANTS["mla, group top-2, mtp norm"]
    assert Transformer(mla).blocks[0].attn.cfg.latent_norm_eps == 1e-6
    assert Transformer(dataclasses.replace(mla, mla_norm_eps=1e-3)).blocks[0].attn.cfg.latent_norm_eps == 1e-3


def test_out_vocab_prunes_the_output_head_to_the_first_ids():
    """out_vocab V': the head [V', H] (and its bias), the embedding whole [V, H]; logits and
    decode over the first V' ids, the head and the loss of every MTP depth; the FLOPs count
    V' rows; a label past V' stops the training forward with a RuntimeError (an assert on the
    device: no host read); refusals by name."""
    from fmoe.train.metrics import model_flops_per_token

    cfg = dataclasses.replace(TINY, out_vocab=24, head_bias=True, mtp_depth=1)
    model = Transformer(cfg)
    assert model.head.shape == (24, cfg.hidden) and model.head_bias.shape == (24,) and model.embed.shape == (40, cfg.hidden)
    ids, cu = torch.randint(0, 40, (16,)), torch.tensor([0, 9, 16], dtype=torch.int32)  # inputs of every id
    with torch.no_grad():
        logits = model.logits(ids, cu)
        cache = model.kv_cache(16)
        torch.testing.assert_close(model.decode(ids[:9], cache), logits[:9], rtol=1e-5, atol=1e-5)
    assert logits.shape == (16, 24)
    labels = torch.randint(0, 24, (24,))
    batch = make_batch(labels, torch.tensor([0, 7, 8, 24]), mtp_depth=1)
    losses, _ = model(batch, model.context(batch))
    (losses["lm_sum"] + losses["mtp_1_sum"]).backward()
    assert model.head.grad.abs().sum() > 0 and torch.isfinite(losses["mtp_1_sum"])
    with torch.no_grad():  # a head bias: added to the logits, and the loss is their cross-entropy
        plain = model.logits(batch["input_ids"], batch["cu_seqlens"])
        model.head_bias.uniform_(-2.0, 2.0)
        biased = model.logits(batch["input_ids"], batch["cu_seqlens"])
        torch.testing.assert_close(biased, plain + model.head_bias, rtol=1e-5, atol=1e-5)
        losses, _ = model(batch)
        mask = batch["loss_mask"].bool()
        torch.testing.assert_close(losses["lm_sum"], torch.nn.functional.cross_entropy(biased[mask], batch["labels"][mask], reduction="sum"))
    full = dataclasses.replace(cfg, out_vocab=None)
    assert model_flops_per_token(full, n_avg_keys=8.0) - model_flops_per_token(cfg, n_avg_keys=8.0) == 2 * 6 * cfg.hidden * (40 - 24)  # trunk + MTP heads
    labels[3] = 30  # the label of token 2
    with pytest.raises(RuntimeError, match=r"labels: a counted label outside 0..23, the output head's rows \(out_vocab\)"):
        model(make_batch(labels, torch.tensor([0, 24]), mtp_depth=1))
    for change, message in ((dict(out_vocab=41), "out_vocab: expected 1..40, got 41"), (dict(out_vocab=0), "out_vocab: expected 1..40, got 0"),
                            (dict(tie_embeddings=True), "out_vocab: an output head of its own rows, not with tie_embeddings")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cfg, **change)


def test_linear_layers_build_gated_deltanet_blocks():
    """linear_layers: those trunk blocks' mixer is Gated DeltaNet (fmoe.layers.linear_attention),
    the others attend; the attention knobs name attending blocks only; the MTP block attends."""
    from fmoe.model import Attention, LinearAttention

    cfg = dataclasses.replace(TINY, linear_layers=(0, 2), linear_k_heads=1, linear_v_heads=2, linear_k_dim=4, linear_v_dim=3, linear_conv=2,
                              window=4, mtp_depth=1)
    model = Transformer(cfg)
    assert [type(b.attn) for b in model.blocks] == [LinearAttention, Attention, LinearAttention] and isinstance(model.mtp[0].block.attn, Attention)
    assert [cfg.is_sliding(i) for i in range(3)] == [False, True, False]  # the window's blocks are the attending ones
    attn = model.blocks[0].attn
    assert {n: tuple(p.shape) for n, p in attn.named_parameters()} == dict(
        wq=(32, 4), wk=(32, 4), wv=(32, 6), wz=(32, 6), wb=(32, 2), wa=(32, 2), conv_q=(2, 4), conv_k=(2, 4), conv_v=(2, 6), A_log=(2,),
        dt_bias=(2,), out_norm=(3,), wo=(6, 32))
    decay_rates = attn.A_log.detach().exp()  # A uniform in [0, 16] (FLA's GatedDeltaNet): test_linear_mixers_start_as_their_references
    assert float(decay_rates.min()) > 0 and float(decay_rates.max()) <= 16
    assert abs(float(attn.conv_v.detach().std()) - 6 ** -0.5) < 0.25
    with pytest.raises(ValueError, match=r"nope_layers: blocks \[2\] are linear-attention blocks \(linear_layers\), which do not attend"):
        dataclasses.replace(TINY, linear_layers=(2,), nope_layers=(1, 2))
    with pytest.raises(ValueError, match=r"window_layers: blocks \[0\] are linear-attention blocks"):
        dataclasses.replace(TINY, linear_layers=(0,), window=4, window_layers=(0, 1))
    with pytest.raises(ValueError, match=r"linear_layers: expected distinct block indices in 0..2, got \(3,\)"):
        dataclasses.replace(TINY, linear_layers=(3,))
    with pytest.raises(ValueError, match=r"linear_v_heads: 3 value heads do not split over 2 key heads"):
        dataclasses.replace(TINY, linear_layers=(0,), linear_v_heads=3)


def test_mamba1_blocks_own_mamba_s_parameters_at_mamba_s_start():
    """linear_kind "mamba1": a block's mixer owns Mamba-1's weights (dt's rank ceil(hidden / 16)
    unless linear_dt_rank, the norms' weights with linear_dt_bc_norm "rms"); at the start, as
    Mamba's, A = 1 .. N in every channel (S4D-real) and dt = softplus(dt_bias) log-uniform in
    [0.001, 0.1] (the same values on every call with the seed), D and the norms 1, the conv's
    biases 0; the knobs are checked."""
    cfg = VARIANTS["jamba"]
    attn = Transformer(cfg).blocks[0].attn
    assert attn.cfg.dt_rank == 2 and attn.cfg.dt_bc_norm == "rms"
    assert {n: tuple(p.shape) for n, p in attn.named_parameters()} == dict(
        wv=(32, 64), wz=(32, 64), conv_v=(3, 64), conv_v_bias=(64,), wdt=(64, 2), wk=(64, 8), wq=(64, 8), wa=(2, 64), dt_bias=(64,),
        A_log=(64, 8), D=(64,), dt_norm=(2,), b_norm=(8,), c_norm=(8,), wo=(64, 32))
    torch.testing.assert_close(attn.A_log.detach().exp(), torch.arange(1.0, 9.0).expand(64, 8))
    for name in ("D", "dt_norm", "b_norm", "c_norm"):
        assert bool((getattr(attn, name) == 1).all()), name
    dt = torch.nn.functional.softplus(attn.dt_bias.detach())
    assert float(dt.min()) >= 1e-3 * (1 - 1e-5) and float(dt.max()) <= 0.1 * (1 + 1e-5) and float(dt.max() / dt.min()) > 10
    again = Transformer(cfg)
    again.reset_parameters(seed=torch.initial_seed())
    torch.testing.assert_close(again.blocks[2].attn.dt_bias, Transformer(cfg).blocks[2].attn.dt_bias, rtol=0, atol=0)
    assert not attn.conv_v_bias.any() and float(attn.wdt.detach().std()) > 0
    unit = Transformer(dataclasses.replace(cfg, linear_dt_rank=5, linear_dt_bc_norm="rms_unit")).blocks[0].attn
    assert unit.cfg.dt_rank == 5 and not any(n.endswith("_norm") for n, _ in unit.named_parameters())
    for change, match in ((dict(linear_kind="mamba2"), r"linear_dt_bc_norm: a knob of Mamba-1's mixer, needs linear_layers and linear_kind='mamba1'"),
                          (dict(linear_dt_bc_norm="none", linear_dt_rank=4, linear_kind="mamba2"),
                           r"linear_dt_rank: a knob of Mamba-1's mixer, needs linear_layers and linear_kind='mamba1'"),
                          (dict(linear_dt_bc_norm="layer"), r"dt_bc_norm: expected one of \('none', 'rms', 'rms_unit'\)"),
                          (dict(linear_k_heads=2), r"^linear_k_heads / linear_v_dim: Mamba-1's B and C are one group"),
                          # only None is Mamba's "auto" rank (0 and False were taken as it)
                          (dict(linear_dt_rank=0), r"linear_dt_rank: expected an int >= 1 \(the rank of Mamba-1's dt projection\), got 0"),
                          (dict(linear_dt_rank=False), r"linear_dt_rank: expected an int >= 1 .*, got False"),
                          (dict(linear_layers=0), r"linear_layers: expected distinct block indices in 0..2, got 0")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **change)


@pytest.mark.parametrize("variant,k_heads,low,dt", [
    ("gated deltanet", 2, 0.0, "log-uniform"),  # FLA's GatedDeltaNet: A uniform in [0, 16], dt log-uniform in [0.001, 0.1]
    ("mamba2", 2, 1.0, "log-uniform"),          # mamba_ssm's Mamba2: A uniform in [1, 16]
    ("kimi linear", 64, 1.0, "zero"),           # FLA's KimiDeltaAttention: dt_bias 0 (as many key as value heads)
    ("ling", 64, 1.0, "zero"),
])
def test_linear_mixers_start_as_their_references(variant, k_heads, low, dt):
    """Each linear-attention kind's A_log and dt_bias at the start, as its reference implementation's,
    over enough heads to see the ranges' ends: A = exp(A_log) uniform in [low, 16]; dt =
    softplus(dt_bias) log-uniform in [0.001, 0.1] (its decays exp(-dt A) near 1: a long memory
    at the start; with dt_bias 1 (dt 1.31) they were under 0.27), or dt_bias 0; the same values
    again with the seed; the output norm 1 (Mamba-1's: test_mamba1_blocks_own_mamba_s_parameters_at_mamba_s_start)."""
    cfg = dataclasses.replace(VARIANTS[variant], linear_v_heads=64, linear_k_heads=k_heads)
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    A = attn.A_log.detach().exp()
    assert float(A.min()) >= low and float(A.max()) <= 16 and float(A.max() - A.min()) > 8
    if low == 0.0:
        assert float(A.min()) < 1  # below mamba2's floor somewhere among 64 heads (p = 1 - (15/16)^64 = 0.98 per seed)
    if dt == "zero":
        assert not attn.dt_bias.any()
    else:
        step = torch.nn.functional.softplus(attn.dt_bias.detach())
        assert float(step.min()) >= 1e-3 * (1 - 1e-5) and float(step.max()) <= 0.1 * (1 + 1e-5) and float(step.max() / step.min()) > 10
        assert float(step.log().std()) > 0.8  # log-uniform over ln(100) = 4.6: std 1.33
    again = Transformer(cfg)
    again.reset_parameters(seed=torch.initial_seed())
    for name in ("A_log", "dt_bias"):
        torch.testing.assert_close(again.blocks[1].attn.get_parameter(name), model.blocks[1].attn.get_parameter(name), rtol=0, atol=0)
    assert bool((attn.out_norm == 1).all())


def test_llama3_rope_knobs_are_checked():
    with pytest.raises(ValueError, match="llama3_factor: one RoPE scaling at a time, not with yarn_factor"):
        dataclasses.replace(TINY, llama3_factor=8.0, yarn_factor=4.0)
    with pytest.raises(ValueError, match="llama3_high_freq_factor: expected at least low_freq_factor = 1"):
        dataclasses.replace(TINY, llama3_factor=8.0, llama3_high_freq_factor=0.5)
    with pytest.raises(ValueError, match="llama3_factor: expected a finite number > 0, got -1"):
        dataclasses.replace(TINY, llama3_factor=-1)
    with pytest.raises(ValueError, match="rope_base: expected a finite number > 1"):
        dataclasses.replace(TINY, llama3_factor=8.0, rope_base=1.0)


def test_linear_rope_reads_positions_over_the_factor_in_the_global_blocks_only():
    """rope_linear_factor f: the RoPE tables at position p are plain RoPE's at p / f (every
    frequency divided by f); beside local_rope_base the window's blocks keep their own plain
    tables; the knob is checked."""
    from fmoe.layers import attention_context

    cfg = dataclasses.replace(TINY, rope_linear_factor=4.0, window=3, window_layers=(0,), local_rope_base=100.0)
    positions = torch.arange(12)
    ctx = attention_context(torch.tensor([0, 12], dtype=torch.int32), positions, cfg.attention_config(local=True))
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = (positions.double() / 4.0)[:, None] * inv_freq[None, :]
    torch.testing.assert_close(ctx.cos.double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ctx.sin.double(), angles.sin(), rtol=0, atol=1e-6)
    local = positions.double()[:, None] / (100.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))[None, :]
    torch.testing.assert_close(ctx.local_cos.double(), local.cos(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="linear_factor: one RoPE scaling at a time, not with yarn_factor"):
        dataclasses.replace(TINY, rope_linear_factor=4.0, yarn_factor=4.0)
    with pytest.raises(ValueError, match=r"linear_factor: expected None or a positive finite number \(positions read as p / factor\), got 0"):
        dataclasses.replace(TINY, rope_linear_factor=0)


@pytest.mark.parametrize("rope_dim", [None, 4], ids=["every channel", "rope_dim 4"])
def test_local_blocks_with_heads_wider_than_the_global_ones_run(rope_dim):
    """local_head_dim above head_dim (8 against 4): the local layers' RoPE tables were built
    from a config of the global head dim, and every forward failed ("rot_dim: expected an
    even number <= head_dim = 4, got 6"). The local tables turn the local heads' channels
    at local_rope_base, the model trains, and decoding gives its logits."""
    from fmoe.ops import positions_from_cu_seqlens, rope_cos_sin, rope_inv_freq

    cfg = dataclasses.replace(TINY, head_dim=4, n_heads=4, n_kv_heads=2, window=4, window_layers=(0,), local_rope_base=100.0,
                              local_head_dim=8, rope_dim=rope_dim, mtp_depth=0)
    model = Transformer(cfg)
    ids, cu = torch.randint(0, cfg.vocab_size, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    ctx = model.context(make_batch(ids, cu)).attention[0]
    want = rope_cos_sin(positions_from_cu_seqlens(cu), rope_inv_freq(8, base=100.0))
    assert torch.equal(ctx.local_cos, want[0]) and torch.equal(ctx.local_sin, want[1])
    losses, _ = model(make_batch(ids, cu))
    losses["lm_sum"].backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    with torch.no_grad():
        whole = model.logits(ids[:5], cu[:2])
        cache = model.kv_cache(5)
        steps = torch.cat([model.decode(ids[:2], cache)] + [model.decode(ids[t:t + 1], cache) for t in range(2, 5)])
    torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-5)


def test_gemma4_attention_knobs_build_what_they_say():
    """local_head_dim and local_kv_heads shape the window's blocks (their own RoPE tables, of
    their head dim); global_k_eq_v leaves the global blocks without wv, their values the keys'
    projection: the same as a wv equal to wk; v_norm RMS-norms each value head (a document of
    one token attends to its own value alone); rope_proportion turns only the first share of
    the global tables' frequencies; the knobs are checked."""
    from fmoe.layers import attention, attention_context

    cfg = VARIANTS["gemma4"]
    model = Transformer(cfg)
    local, glob = model.blocks[0].attn, model.blocks[1].attn
    assert (local.wq.shape, local.wk.shape, local.wv.shape, local.q_norm.shape) == ((32, 24), (32, 24), (32, 24), (6,))
    assert (glob.wq.shape, glob.wk.shape, glob.q_norm.shape, glob.names) == ((32, 32), (32, 16), (8,), ["wq", "wk", "wo", "q_norm", "k_norm"])
    assert not hasattr(glob, "wv") and glob.cfg.k_eq_v and not local.cfg.k_eq_v
    cu, positions = torch.tensor([0, 1, 9], dtype=torch.int32), torch.tensor([0, *range(8)])
    ctx = attention_context(cu, positions, cfg.context_config())
    assert ctx.cos.shape == (9, 4) and ctx.local_cos.shape == (9, 3)
    # a quarter of the 4 frequency pairs turns: base^0 = 1; the other 3 stay (cos 1, sin 0)
    torch.testing.assert_close(ctx.cos[:, 0], positions.float().cos())
    assert (ctx.cos[:, 1:] == 1).all() and (ctx.sin[:, 1:] == 0).all()
    # ...with the local blocks' heads as wide (LFM3's): the same global tables beside the local ones
    same = dataclasses.replace(TINY, window=4, window_layers=(0,), local_rope_base=100.0, rope_proportion=0.25)
    lfm3 = attention_context(cu, positions, same.context_config())
    assert torch.equal(lfm3.cos, ctx.cos) and lfm3.local_cos.shape == (9, 4) and (lfm3.local_cos[:, 1:] != 1).any()
    x = torch.randn(9, 32)
    params = {n: getattr(glob, n).detach() for n in glob.names}
    with torch.no_grad():
        y = attention(x, params, glob.cfg, ctx)[0]
        wv = attention(x, dict(params, wv=params["wk"]), dataclasses.replace(glob.cfg, k_eq_v=False), ctx)[0]
        torch.testing.assert_close(y, wv, rtol=1e-6, atol=1e-6)
        # token 0 is a document alone: its output is its normed values (per kv head, repeated over the query heads), then wo
        v = (x[:1] @ params["wk"]).view(2, 8)
        want = (v * torch.rsqrt(v.square().mean(-1, keepdim=True) + cfg.norm_eps)).repeat_interleave(2, dim=0).reshape(1, 32) @ params["wo"]
        torch.testing.assert_close(y[:1], want, rtol=1e-5, atol=1e-6)
    for knobs, message in ((dict(local_head_dim=6), "local_head_dim: the head dim of the window's or chunk's blocks, needs a window"),
                           (dict(window=4, local_head_dim=6), "local_head_dim: the local blocks' RoPE tables are their own"),
                           (dict(kv_rank=6, q_rank=10, n_kv_heads=4, head_dim=12, rope_dim=4, v_head_dim=5, v_norm=True),
                            "v_norm: a knob of grouped-query attention's values"),
                           (dict(rope_proportion=1.5), r"rope_proportion: expected None or a number in \(0, 1\]"),
                           (dict(rope_proportion=0.5, rope_dim=4), "rope_proportion: proportional RoPE over every channel of each head"),
                           (dict(rope_proportion=0.5, window=4), "rope_proportion: proportional RoPE in the blocks without a window or chunk; "
                                                                 "those with one need their own plain tables, local_rope_base"),
                           (dict(global_k_eq_v=1), "global_k_eq_v: expected a bool")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)


def test_attention_softcap_caps_every_score_before_the_softmax_on_both_paths():
    """attn_softcap c (Gemma 2's): softmax(c tanh(q k^T s / c)) v, the reference's and
    FlexAttention's (its score_mod) alike, the window's block too; with sinks beside it; the
    knob is checked (not beside DeepSeek sparse attention)."""
    from fmoe.layers import attention, attention_context

    cfg = dataclasses.replace(TINY, attn_softcap=0.5, window=4, window_layers=(0,))
    model = Transformer(cfg)
    cu, positions = torch.tensor([0, 9], dtype=torch.int32), torch.arange(9)
    x = torch.randn(9, 32)
    for block in (0, 1):
        attn = model.blocks[block].attn
        params = {n: getattr(attn, n).detach() * (30 if n in ("wq", "wk") else 1) for n in attn.names}  # scores past the cap
        ctx = attention_context(cu, positions, cfg.context_config())
        with torch.no_grad():
            y = attention(x, params, attn.cfg, ctx)[0]
            flex = attention(x, params, dataclasses.replace(attn.cfg, impl="flex"),
                             attention_context(cu, positions, dataclasses.replace(cfg.context_config(), impl="flex")))[0]
            torch.testing.assert_close(flex, y, rtol=1e-5, atol=1e-6)
            q, k, v = (rearrange(t, "t (h d) -> h t d", d=8) for t in (x @ params["wq"], x @ params["wk"], x @ params["wv"]))
            cos, sin = (ctx.local_cos, ctx.local_sin) if block == 0 and ctx.local_cos is not None else (ctx.cos, ctx.sin)
            q, k = (fmoe.ops.apply_rope(t.transpose(0, 1), cos, sin, impl="torch").transpose(0, 1) for t in (q, k))
            scores = 0.5 * torch.tanh(q @ k.repeat_interleave(2, dim=0).transpose(1, 2) * 8**-0.5 / 0.5)
            keys = torch.arange(9)
            allowed = (keys[None, :] <= keys[:, None]) & ((keys[:, None] - keys[None, :] < 4) if block == 0 else True)
            out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(2, dim=0)
            torch.testing.assert_close(y, rearrange(out, "h t d -> t (h d)") @ params["wo"], rtol=1e-5, atol=1e-6)
            uncapped = attention(x, params, dataclasses.replace(attn.cfg, score_softcap=None), ctx)[0]
            assert (uncapped - y).abs().max() > 1e-3
    with torch.no_grad():  # beside sinks
        sinks = Transformer(dataclasses.replace(cfg, attn_sinks=True)).blocks[1].attn
        params = {n: getattr(sinks, n).detach() for n in sinks.names}
        ctx = attention_context(cu, positions, cfg.context_config())
        flex = attention(x, params, dataclasses.replace(sinks.cfg, impl="flex"),
                         attention_context(cu, positions, dataclasses.replace(cfg.context_config(), impl="flex")))[0]
        torch.testing.assert_close(flex, attention(x, params, sinks.cfg, ctx)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attn_softcap: expected None or a positive finite number, without index_topk"):
        dataclasses.replace(VARIANTS["dsa"], attn_softcap=30.0)


def test_minimax_blocks_keep_the_normed_input_as_their_residual():
    """normed_residual a (MiniMax's blocks): h = a attn_norm(x) + b attn(attn_norm(x)), then
    a mlp_norm(h) + b moe(mlp_norm(h)), b = residual_scale, in a lightning block and a
    softmax one (each block's own decay: lightning_decay of its depth); the knob is checked."""
    from fmoe.layers import attention_context, lightning_decay, linear_attention

    cfg = dataclasses.replace(VARIANTS["minimax"], mtp_depth=0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = torch.randn(9, 32)
    ctx = attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), cfg.context_config())
    with torch.no_grad():
        for block in model.blocks:
            got, _ = block(x, ctx)
            h = block.attn_norm(x)
            h = 1.7 * h + 0.6 * block.attn(h, ctx)
            m = block.mlp_norm(h)
            torch.testing.assert_close(got, 1.7 * m + 0.6 * block.mlp(m, None)[0], rtol=1e-5, atol=1e-6)
        assert [b.attn.layer for b in model.blocks[:2]] == [0, 1]
        # the lightning block's decay is its depth's: block 1 with block 0's decay differs
        params = {n: getattr(model.blocks[1].attn, n) for n in model.blocks[1].attn.names}
        own = linear_attention(x, dict(params, decay=lightning_decay(4, 1, 3)), model.blocks[1].attn.cfg, ctx)[0]
        torch.testing.assert_close(model.blocks[1].attn(x, ctx), own)
        assert not torch.allclose(own, linear_attention(x, dict(params, decay=lightning_decay(4, 0, 3)), model.blocks[1].attn.cfg, ctx)[0])
    for knobs, message in ((dict(normed_residual=0.0), r"normed_residual: expected None or a positive finite number .*, got 0.0"),
                           (dict(normed_residual=True), r"normed_residual: expected None or a positive finite number"),
                           (dict(normed_residual=2.0, parallel_blocks=True), r"normed_residual: .* needs pre_norms and not parallel_blocks"),
                           (dict(normed_residual=2.0, hyper_connections=2), r"normed_residual: .* not hyper_connections"),
                           (dict(normed_residual=2.0, pre_norms=False, post_norms=True), r"normed_residual: .* not pre_norms=False")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)


def test_blocks_without_an_mlp_end_at_their_mixer():
    """mlp_free_layers (Nemotron-H's mixer layers with no MLP after them): the block is x +
    mixer(attn_norm(x)), with no MLP, MLP norm or MLP streams' weights; with normed_residual
    a attn_norm(x) + b mixer(attn_norm(x)); with hyper-connections the attention's add alone.
    The others are unchanged; the knob is checked."""
    from fmoe.layers import attention_context

    torch.manual_seed(0)
    x = torch.randn(9, 32)
    ctx_of = lambda cfg: attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), cfg.context_config())  # noqa: E731
    cfg = VARIANTS["nemotron_h"]
    model = Transformer(cfg)
    ctx = ctx_of(cfg)
    free = model.blocks[1]
    assert free.mlp is None and free.mlp_norm is None and free.mlp_post_norm is None
    assert not any(".mlp" in name for name, _ in free.named_parameters())
    assert all(b.mlp is not None for i, b in enumerate(model.blocks) if i != 1)
    with torch.no_grad():
        got, stats = free(x, ctx)
        torch.testing.assert_close(got, x + free.attn(free.attn_norm(x), ctx))
        assert stats is None
        normed = Transformer(dataclasses.replace(cfg, normed_residual=1.7, residual_scale=0.6, mtp_depth=0)).blocks[1]
        h = normed.attn_norm(x)
        torch.testing.assert_close(normed(x, ctx)[0], 1.7 * h + 0.6 * normed.attn(h, ctx))
        hc_cfg = dataclasses.replace(TINY, hyper_connections=2, n_dense=3, mlp_free_layers=(0,))
        hc = Transformer(hc_cfg).blocks[0]
        assert hc.mlp_hc is None and hc.attn_hc is not None
        streams = torch.randn(9, 64)
        h, post, comb = hc.attn_hc(streams)
        torch.testing.assert_close(hc(streams, ctx_of(hc_cfg))[0], hc.attn_hc.add(streams, hc.attn(hc.attn_norm(h), ctx_of(hc_cfg)), post, comb))
    for knobs, message in ((dict(mlp_free_layers=(1,)), r"mlp_free_layers: blocks \[1\] are MoE blocks \(n_dense = 1, moe_layers = None\)"),
                           (dict(n_dense=3, mlp_free_layers=(3,)), r"mlp_free_layers: expected distinct block indices in 0..2, got \(3,\)"),
                           (dict(n_dense=3, mlp_free_layers=(0,), parallel_blocks=True), "mlp_free_layers: blocks without an MLP, not with parallel_blocks"),
                           (dict(n_dense=3, mlp_free_layers=(0,), layer_scalars=True), "mlp_free_layers: blocks without an MLP, not with layer_scalars"),
                           (dict(linear_dt_min=0.1), r"linear_dt_min: the floor of Mamba-2's dt, needs linear_layers and linear_kind='mamba2'")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)
    with pytest.raises(ValueError, match=r"mlp: a MoE block has an MLP"):
        fmoe.model.Block(TINY, moe=True, mlp=False)
    with pytest.raises(ValueError, match=r"hashed: a MoE block's routing by its tokens' ids, needs moe=True"):
        fmoe.model.Block(TINY, moe=False, hashed=True)


def test_a_parallel_hybrid_block_adds_its_attention_to_its_linear_mixer():
    """parallel_hybrid (Falcon-H1's): each linear block also holds softmax attention,
    attn_beside, of the same normed input, and its output is the sum of the two: with the
    attention's wo zeroed the block is the linear-only model's, with the mixer's wo zeroed
    the attention-only model's (attn_beside's weights as its attn); the other blocks hold
    none; every block attends and is cached both ways. The knobs are checked."""
    from fmoe.layers import attention_context

    torch.manual_seed(0)
    cfg = dataclasses.replace(VARIANTS["falcon_h1"], linear_layers=(0, 2), mtp_depth=0)
    model = Transformer(cfg)
    assert [b.attn_beside is not None for b in model.blocks] == [True, False, True]
    assert all(cfg.attends(i) for i in range(3)) and "out_norm" not in model.blocks[0].attn.names  # the gate alone (linear_gate_norm "none")
    cache = model.kv_cache(8)
    assert (cache.full_layers, cache.linear_layers, cache.n_layers) == ((0, 1, 2), (0, 2), 3)
    ids = torch.randint(0, cfg.vocab_size, (9,))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    state = model.state_dict()

    def logits(config, weights):
        other = Transformer(config)
        other.load_state_dict(weights)
        with torch.no_grad():
            return other.logits(ids, cu)

    with torch.no_grad():
        both = model.logits(ids, cu)
    linear_only = {n: t for n, t in state.items() if ".attn_beside." not in n}
    zero_attn = dict(state, **{f"blocks.{i}.attn_beside.wo": torch.zeros_like(state[f"blocks.{i}.attn_beside.wo"]) for i in (0, 2)})
    torch.testing.assert_close(logits(cfg, zero_attn), logits(dataclasses.replace(cfg, parallel_hybrid=False), linear_only))
    attention = {n.replace(".attn_beside.", ".attn."): t for n, t in state.items()
                 if not any(n.startswith(f"blocks.{i}.attn.") for i in (0, 2))}
    zero_mixer = dict(state, **{f"blocks.{i}.attn.wo": torch.zeros_like(state[f"blocks.{i}.attn.wo"]) for i in (0, 2)})
    torch.testing.assert_close(logits(cfg, zero_mixer), logits(dataclasses.replace(cfg, linear_layers=None, parallel_hybrid=False,
                                                                                    linear_gate_norm="after"), attention))
    assert float((both - logits(cfg, zero_attn)).abs().max()) > 1e-3 and float((both - logits(cfg, zero_mixer)).abs().max()) > 1e-3
    biased = Transformer(dataclasses.replace(cfg, qkv_bias=True, attn_sinks=True))  # attn_beside initialised as an attention is
    biased.reset_parameters(seed=1)
    beside, attention = biased.blocks[0].attn_beside, biased.blocks[1].attn
    assert not beside.bq.any() and not beside.sinks.any()
    stds = {"wo": cfg.init_std / (2 * cfg.n_layers) ** 0.5}  # an output projection's, as attention's wo; the other matrices init_std
    matrices = {n: p for n, p in beside.named_parameters() if p.dim() == 2}
    assert {"wq", "wk", "wv", "wo"} <= set(matrices), sorted(matrices)
    for n, p in matrices.items():
        torch.testing.assert_close(p.detach(), init_value(1, f"blocks.0.attn_beside.{n}", p.shape, stds.get(n, cfg.init_std)), rtol=0, atol=0)
    assert float(beside.wq.detach().std()) == pytest.approx(float(attention.wq.detach().std()), rel=0.1)  # 0.03 apart here
    x = torch.randn(9, 32)
    ctx = attention_context(cu, torch.cat([torch.arange(4), torch.arange(5)]), cfg.context_config())
    block = model.blocks[0]
    with torch.no_grad():
        h = block.attn_norm(x)
        torch.testing.assert_close(block._attend(x, ctx), block.attn(h, ctx) + block.attn_beside(h, ctx))
    for knobs, message in ((dict(parallel_hybrid=True), "parallel_hybrid: softmax attention beside the linear mixer of each linear_layers block, "
                                                        "needs linear_layers$"),
                           (dict(VARIANTS["dsa"].__dict__, linear_layers=(0,), parallel_hybrid=True),
                            r"parallel_hybrid: .*, not with DeepSeek sparse attention \(index_topk\)"),
                           (dict(parallel_hybrid=1), "parallel_hybrid: expected a bool, got 1"),
                           (dict(linear_layers=(0,), linear_kind="mamba2", linear_gate_norm="first"),
                            r"linear_gate_norm: expected one of \('after', 'before', 'none'\)"),
                           (dict(linear_layers=(0,), linear_gate_norm="none"),
                            "linear_gate_norm: where Mamba-2's output norm sits, needs linear_layers and linear_kind='mamba2'")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)


def test_blocks_without_a_mixer_are_their_mlp_alone():
    """mixer_free_layers (Nemotron-H-47B's MLP layers with no mixer layer before them): the
    block is x + mlp(mlp_norm(x)), with no attention, attention norm or attention streams'
    weights, neither sliding nor cached; with hyper-connections the MLP's add alone. The
    knob is checked against the ones that place attention."""
    from fmoe.layers import attention_context

    torch.manual_seed(0)
    x = torch.randn(9, 32)
    cfg = VARIANTS["nemotron_h 47b"]
    model = Transformer(cfg)
    ctx = attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), cfg.context_config())
    alone = model.blocks[1]
    assert alone.attn is None and alone.attn_norm is None and not any(".attn" in name for name, _ in alone.named_parameters())
    assert not cfg.is_sliding(1) and cfg.is_sliding(2) and not cfg.attends(1) and model.kv_cache(16).window_layers == (2,)
    with torch.no_grad():
        torch.testing.assert_close(alone(x, ctx)[0], x + alone.mlp(alone.mlp_norm(x)))
        hc_cfg = dataclasses.replace(TINY, hyper_connections=2, n_dense=3, mixer_free_layers=(0,))
        hc = Transformer(hc_cfg).blocks[0]
        assert hc.attn_hc is None and hc.mlp_hc is not None
        streams = torch.randn(9, 64)
        h, post, comb = hc.mlp_hc(streams)
        torch.testing.assert_close(hc(streams, ctx)[0], hc.mlp_hc.add(streams, hc.mlp(hc.mlp_norm(h)), post, comb))
    for knobs, message in ((dict(mixer_free_layers=(1,), linear_layers=(1, 2)), r"mixer_free_layers: blocks \[1\] are in linear_layers too"),
                           (dict(mixer_free_layers=(0,), mlp_free_layers=(0,), n_dense=3), r"blocks \[0\] are in mlp_free_layers too"),
                           (dict(mixer_free_layers=(1,), window=4, window_layers=(1,)), r"blocks \[1\] are in window_layers too"),
                           (dict(mixer_free_layers=(1,), parallel_blocks=True), "mixer_free_layers: blocks without a mixer, not with parallel_blocks"),
                           (dict(mixer_free_layers=(1,), normed_residual=1.5), "mixer_free_layers: blocks without a mixer, not with normed_residual")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)
    with pytest.raises(ValueError, match="mixer / mlp: a block holds a mixer, an MLP or both, got neither"):
        fmoe.model.Block(TINY, moe=False, mlp=False, mixer=False)


def test_linear_blocks_can_be_pre_norm_beside_post_norm_attention_blocks():
    """linear_pre_norms (OLMo Hybrid): the linear-attention blocks are x + mixer(attn_norm(x)),
    then + mlp(mlp_norm(.)), without post-norms, while the attention blocks (and the MTP
    block) keep the model's placement, here post-norm: x + attn_post_norm(attn(x)), then
    + mlp_post_norm(mlp(.)); with a sandwich placement the attention blocks keep all four
    norms. The knobs are checked."""
    from fmoe.layers import attention_context

    torch.manual_seed(0)
    x = torch.randn(9, 32)
    cfg = dataclasses.replace(VARIANTS["olmo hybrid"], n_dense=3)
    model = Transformer(cfg)
    ctx = attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), cfg.context_config())
    linear, attention = model.blocks[0], model.blocks[2]
    assert linear.attn_post_norm is None and linear.mlp_post_norm is None and linear.attn.cfg.neg_eigval and linear.attn.cfg.norm_eps == 1e-5
    assert attention.attn_norm is None and attention.mlp_norm is None and model.mtp[0].block.attn_norm is None
    assert cfg.block_norms(True) == (True, False) and cfg.block_norms(False) == (False, True)
    with torch.no_grad():
        h = x + linear.attn(linear.attn_norm(x), ctx)
        torch.testing.assert_close(linear(x, ctx)[0], h + linear.mlp(linear.mlp_norm(h)))
        h = x + attention.attn_post_norm(attention.attn(x, ctx))
        torch.testing.assert_close(attention(x, ctx)[0], h + attention.mlp_post_norm(attention.mlp(h)))
    sandwich = Transformer(dataclasses.replace(cfg, pre_norms=True, mtp_depth=0)).blocks
    assert sandwich[0].attn_post_norm is None and sandwich[0].mlp_norm is not None
    assert None not in (sandwich[2].attn_norm, sandwich[2].attn_post_norm, sandwich[2].mlp_norm, sandwich[2].mlp_post_norm)
    olmo = dict(linear_layers=(0,), pre_norms=False, post_norms=True)
    for knobs, message in ((dict(linear_pre_norms=True), "linear_pre_norms: the linear-attention blocks' norm placement, needs linear_layers"),
                           (dict(linear_layers=(0,), linear_pre_norms=True), "but every block is pre-norm already"),
                           (dict(olmo, linear_pre_norms=True, dense_beside_moe=True, pre_norms=True),
                            "linear_pre_norms: a block placement of its own, not with dense_beside_moe"),
                           (dict(linear_layers=(0,), linear_pre_norms=True, normed_residual=1.5, post_norms=True),
                            "linear_pre_norms: a block placement of its own, not with normed_residual"),
                           (dict(linear_layers=(0,), linear_pre_norms=1), "linear_pre_norms: expected a bool, got 1"),
                           (dict(linear_neg_eigval=True), r"linear_neg_eigval: the delta rule's write strength in \[0, 2\], needs linear_layers"),
                           (dict(linear_layers=(0,), linear_kind="mamba2", linear_neg_eigval=True), "linear_neg_eigval: .* linear_kind 'gated_deltanet' or 'kda'"),
                           (dict(linear_norm_eps=1e-5), "linear_norm_eps: the linear-attention blocks' gated output norm's eps, needs linear_layers"),
                           (dict(linear_layers=(0,), linear_kind="lightning", linear_k_heads=4, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8,
                                 linear_norm_eps=1e-5), r"not 'short_conv' or 'lightning'"),
                           (dict(linear_layers=(0,), linear_norm_eps=0.0), r"linear_norm_eps: expected None \(norm_eps\) or a positive number, got 0.0")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)


def test_gemma4_moe_blocks_add_a_dense_mlp_beside_the_moe_and_scale_their_output():
    """dense_beside_moe: x + post(dense_post(dense(mlp_norm(x))) + moe_post(moe(moe_norm(x),
    routed on x))), router_norm's RMSNorm and 1 / sqrt(H) before the router, each chosen
    weight times expert_scale; layer_scalars: the block's output, the whole stream, times
    layer_scalar; the knobs are checked."""
    from fmoe.layers import attention_context

    cfg = dataclasses.replace(VARIANTS["gemma4"], mtp_depth=0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    block = model.blocks[1]
    with torch.no_grad():
        for name in ("router_norm", "expert_scale"):
            getattr(block.mlp, name).uniform_(0.5, 1.5)
        block.moe_norm.weight.uniform_(0.5, 1.5)  # the experts' input alone: the router reads x itself
        block.layer_scalar.fill_(0.75)
    x = torch.randn(9, 32)
    ctx = attention_context(torch.tensor([0, 9], dtype=torch.int32), torch.arange(9), cfg.context_config())
    with torch.no_grad():
        got, stats = block(x, ctx)
        h = x + block.attn_post_norm(block.attn(block.attn_norm(x), ctx))
        moe = block.mlp
        routed = torch.nn.functional.rms_norm(h, (32,), eps=cfg.norm_eps) * moe.router_norm / 32**0.5
        logits = routed @ moe.router.T
        top, experts = torch.softmax(logits, -1).topk(2, dim=-1)
        weights = top / top.sum(-1, keepdim=True) * moe.expert_scale[experts]
        m = block.moe_norm(h)
        experts_out = torch.stack([sum(weights[t, j] * ((torch.nn.functional.gelu(m[t] @ moe.experts.w_gate[e], approximate="tanh")
                                                         * (m[t] @ moe.experts.w_up[e])) @ moe.experts.w_down[e])
                                       for j, e in enumerate(experts[t].tolist())) for t in range(9)])
        y = block.mlp_post_norm(block.dense_post_norm(block.beside(block.mlp_norm(h))) + block.moe_post_norm(experts_out))
        torch.testing.assert_close(got, 0.75 * (h + y), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats["router_logits"], logits, rtol=1e-5, atol=1e-6)
    for knobs, message in ((dict(dense_beside_moe=True), "dense_beside_moe: the dense MLP and the MoE each have a pre- and a post-norm"),
                           (dict(dense_beside_moe=True, post_norms=True, parallel_blocks=True), "dense_beside_moe: .* not with parallel_blocks"),
                           (dict(layer_scalars=True, hyper_connections=2), "layer_scalars: a scale of each block's output stream"),
                           (dict(router_norm="yes"), "router_norm: expected a bool")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **knobs)


def test_init_scales_output_projections_and_zeroes_biases():
    model = Transformer(dataclasses.replace(TINY, hidden=64, n_layers=8, n_dense=4))
    block = model.blocks[5]
    assert abs(float(block.attn.wq.detach().std()) - 0.02) < 0.003
    assert abs(float(block.attn.wo.detach().std()) - 0.02 / 4) < 0.001  # / sqrt(2 * 8)
    assert torch.equal(block.attn_norm.weight, torch.ones(64))
    assert torch.equal(block.mlp.expert_bias, torch.zeros(TINY.n_experts))


def test_reset_parameters_draws_each_matrix_of_its_seed_and_name_at_init_std():
    """Each matrix is init_value(seed, name, shape, std): std init_std, the output projections' (attention's wo, the
    dense MLP's, the routed and the shared experts' w_down) init_std / sqrt(2 n_layers); two matrices of one shape
    draw different values, another seed others; a seed that is not an int >= 0 is refused."""
    cfg = dataclasses.replace(TINY, init_std=0.05)
    model = Transformer(cfg)
    model.reset_parameters(seed=11)
    out = 0.05 / (2 * cfg.n_layers) ** 0.5
    stds = {"blocks.1.attn.wq": 0.05, "blocks.1.attn.wo": out, "blocks.0.mlp.w_up": 0.05, "blocks.0.mlp.w_down": out, "blocks.1.mlp.router": 0.05,
            "blocks.1.mlp.experts.w_gate": 0.05, "blocks.1.mlp.experts.w_down": out, "blocks.1.mlp.shared.w_down": out}
    for name, std in stds.items():
        p = model.get_parameter(name)
        torch.testing.assert_close(p.detach(), init_value(11, name, p.shape, std), rtol=0, atol=0)
    assert not torch.equal(model.blocks[1].attn.wq, model.blocks[2].attn.wq)
    wq = model.blocks[1].attn.wq.detach().clone()
    model.reset_parameters(seed=12)
    assert not torch.equal(model.blocks[1].attn.wq, wq)
    for bad, said in ((1.0, "seed: expected an int, got 1.0"), (True, "seed: expected an int, got True"), (-1, "seed: expected >= 0, got -1")):
        with pytest.raises(ValueError, match=re.escape(said)):
            model.reset_parameters(seed=bad)


def test_reset_parameters_starts_hyper_connections_layer_scalars_and_latent_moe_norms():
    """Hyper-connections: scale 0.01, the pre biases -log(n - 1) and the others 0 (the blocks' and the head's); Gemma 4's
    layer_scalar 1 again; Muse Spark's latent and expert output norms' weights 0 (gains 1)."""
    model = Transformer(VARIANTS["mhc"])
    model.reset_parameters(seed=2)
    for hc in (model.blocks[0].attn_hc, model.blocks[2].mlp_hc, model.hc_head):
        assert torch.equal(hc.scale, torch.full_like(hc.scale, 0.01))
        want = torch.cat([torch.full((4,), -math.log(3)), torch.zeros(hc.base.shape[0] - 4)])
        torch.testing.assert_close(hc.base.detach(), want, rtol=0, atol=0)
    gemma = Transformer(dataclasses.replace(VARIANTS["gemma4"], mtp_depth=0))
    for block in gemma.blocks:
        block.layer_scalar.fill_(0.75)
    gemma.reset_parameters(seed=2)
    assert all(torch.equal(block.layer_scalar, torch.ones(1)) for block in gemma.blocks)
    muse = Transformer(VARIANTS["muse spark"])
    with torch.no_grad():
        for p in muse.parameters():
            p.fill_(0.5)
    muse.reset_parameters(seed=2)
    for mlp in (muse.blocks[1].mlp, muse.blocks[2].mlp):
        assert torch.equal(mlp.latent_norm, torch.zeros(20)) and torch.equal(mlp.expert_out_norm, torch.zeros(20))


def test_init_parameters_without_recursion_leaves_a_child_torch_norm_alone():
    """recurse=False starts the module's own parameters alone: a child torch norm keeps its weights and running statistics."""
    own = torch.nn.Module()
    own.proj = torch.nn.Parameter(torch.zeros(4, 3))
    own.stats = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        own.stats.weight.fill_(2.0)
        own.stats.running_mean.fill_(5.0)
    init_parameters(own, None, seed=4, recurse=False)
    torch.testing.assert_close(own.proj.detach(), init_value(4, "proj", (4, 3), 0.02), rtol=0, atol=0)
    assert torch.equal(own.stats.weight, torch.full((3,), 2.0)) and torch.equal(own.stats.running_mean, torch.full((3,), 5.0))
    init_parameters(own, None, seed=4)
    assert torch.equal(own.stats.weight, torch.ones(3)) and torch.equal(own.stats.running_mean, torch.zeros(3))


def test_random_hash_table_gives_every_id_k_distinct_experts_past_a_4096_draw():
    """random_hash_table draws 4096 ids at a time: 4100 ids give 4100 rows, each k distinct experts of 0..E-1, a function of
    the generator; no ids, no rows."""
    table = random_hash_table(4100, 3, 5, torch.Generator().manual_seed(0))
    assert table.shape == (4100, 3) and table.dtype == torch.int64
    assert ((table >= 0) & (table < 5)).all() and all(len(set(row)) == 3 for row in table.tolist())
    assert torch.equal(table, random_hash_table(4100, 3, 5, torch.Generator().manual_seed(0)))
    assert random_hash_table(0, 2, 4).shape == (0, 2)


class _OwnModel(Transformer):
    """A model of one's own: the reference with torch modules added under names no rule of fmoe's reads."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.final_ln = torch.nn.LayerNorm(cfg.hidden)
        self.probe = torch.nn.Linear(cfg.hidden, 3)
        self.stats = torch.nn.BatchNorm1d(3)
        self.groups = torch.nn.GroupNorm(2, 4)


def test_a_model_of_one_s_own_starts_its_torch_norms_at_1_and_every_bias_at_0():
    """reset_parameters (which train_moe and fmoe.parallel.materialize call) started a
    subclass's nn.LayerNorm named final_ln with a gain of Normal(0, 0.02) and its nn.Linear's
    bias random: the rules read names ending in "norm.weight" or fmoe's bias names only.
    torch's norms now start as torch starts them, whatever their names, and every bias 0, as
    the docstring says; built on the meta device and materialised, the same; the reference's
    own parameters are unchanged (the same as a plain Transformer's)."""
    torch.manual_seed(3)
    model = _OwnModel(TINY)
    model.stats.running_mean.fill_(5.0)
    model.reset_parameters(seed=7)
    with torch.device("meta"):
        meta = _OwnModel(TINY)
    meta.to_empty(device="cpu")
    for t in meta.state_dict().values():
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    meta.reset_parameters(seed=7)
    for m in (model, meta):
        for norm in (m.final_ln, m.stats, m.groups):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and torch.equal(norm.bias, torch.zeros_like(norm.bias))
        assert torch.equal(m.stats.running_mean, torch.zeros(3)) and torch.equal(m.stats.running_var, torch.ones(3))
        assert int(m.stats.num_batches_tracked) == 0 and torch.equal(m.probe.bias, torch.zeros(3))
        assert abs(float(m.probe.weight.detach().std()) - TINY.init_std) < 0.01  # a matrix: Normal(0, init_std), as the docstring says
    plain = Transformer(TINY)
    plain.reset_parameters(seed=7)
    own = model.state_dict()
    assert all(torch.equal(t, own[n]) for n, t in plain.state_dict().items())
    assert all(torch.equal(t, own[n]) for n, t in meta.state_dict().items())


@pytest.mark.parametrize("zero_centered_norms", [False, True], ids=["gain", "zero_centered"])
def test_every_kind_of_torch_norm_of_one_s_own_starts_at_gain_1_whatever_its_name(zero_centered_norms):
    """Each of fmoe.model.TORCH_NORMS starts at gain 1 and bias 0 in a model of one's own, under any name: one named
    like fmoe's norms ("inorm.weight" ends in "norm.weight") too, where a zero-centred model's rule would give 0."""
    from torch import nn

    from fmoe.model import TORCH_NORMS

    built = {nn.LayerNorm: (8,), nn.RMSNorm: (8,), nn.GroupNorm: (2, 4), nn.SyncBatchNorm: (4,)}

    class Own(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.own = nn.ModuleDict({kind.__name__: kind(*built.get(kind, (4,)), **({} if kind in built else {"affine": True}))
                                      for kind in TORCH_NORMS})
            self.inorm = nn.InstanceNorm1d(4, affine=True)

    model = Own(dataclasses.replace(TINY, zero_centered_norms=zero_centered_norms))
    model.reset_parameters(seed=5)
    norms = [*model.own.values(), model.inorm]
    assert len(norms) == len(TORCH_NORMS) + 1 == 11
    for norm in norms:
        assert torch.equal(norm.weight, torch.ones_like(norm.weight)), type(norm).__name__
        assert getattr(norm, "bias", None) is None or torch.equal(norm.bias, torch.zeros_like(norm.bias)), type(norm).__name__


def _garbage_in_the_allocator():
    """Leave freed memory full of NaN and huge numbers, as a long-running process's is."""
    for value in (float("nan"), 3e38, -1e30):
        junk = torch.full((1 << 16,), value)
        del junk


@pytest.mark.parametrize("part", ["dense mlp", "xielu mlp", "gated norm", "attention", "mla attention", "dsa attention", "gated deltanet",
                                  "mamba2", "mamba1", "kda", "lightning", "hyper connection", "hyper head", "mtp", "block"])
def test_a_building_block_built_alone_starts_finite_and_seeded(part):
    """fmoe.model's blocks built outside a Transformer (a user's own model) start as the model
    does (fmoe.model.init_parameters: a function of (torch's seed, the name)), not with the
    allocator's leftovers: every value finite, the same build for build; a Block given its
    place's name starts as that Transformer block."""
    from fmoe.model import Attention, Block, DenseMLP, GatedRMSNorm, HyperConnection, LinearAttention, MTPModule, init_parameters

    builds = {"dense mlp": lambda: DenseMLP(32, 48, "torch", bias=True), "xielu mlp": lambda: DenseMLP(32, 48, "torch", act="xielu"),
              "gated norm": lambda: GatedRMSNorm(32, 1e-6, 3), "attention": lambda: Attention(dataclasses.replace(TINY, o_bias=True, qkv_bias=True)),
              "mla attention": lambda: Attention(VARIANTS["mla, group top-2, mtp norm"]), "dsa attention": lambda: Attention(VARIANTS["dsa"]),
              "gated deltanet": lambda: LinearAttention(VARIANTS["gated deltanet"]), "mamba2": lambda: LinearAttention(VARIANTS["granite4"]),
              "mamba1": lambda: LinearAttention(VARIANTS["jamba"]), "kda": lambda: LinearAttention(VARIANTS["kimi linear"]),
              "lightning": lambda: LinearAttention(VARIANTS["minimax"]), "hyper connection": lambda: HyperConnection(VARIANTS["mhc"]),
              "hyper head": lambda: HyperConnection(VARIANTS["mhc"], head=True), "mtp": lambda: MTPModule(dataclasses.replace(TINY, mtp_depth=1)),
              "block": lambda: Block(TINY, moe=True, depth=1)}
    states = []
    for _ in range(2):
        _garbage_in_the_allocator()
        torch.manual_seed(5)
        states.append({n: p.detach().clone() for n, p in builds[part]().named_parameters()})
    assert states[0].keys() == states[1].keys() and len(states[0]) > 0
    for name, value in states[0].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, states[1][name]), name
        if value.ndim == 2 and min(value.shape) > 1 and "conv" not in name and "A_log" not in name:  # a matrix: Normal(0, <= 0.02)
            assert 0.001 < float(value.std()) < 0.03, name
    if part == "dense mlp":
        assert not states[0]["b_up"].any() and not states[0]["b_down"].any()
    if part == "block":  # given its place's name, the model's start
        torch.manual_seed(5)
        block = builds[part]()
        init_parameters(block, TINY, seed=7, prefix="blocks.1")
        model = Transformer(TINY)
        model.reset_parameters(seed=7)
        theirs = dict(model.blocks[1].named_parameters())
        assert {n: torch.equal(p, theirs[n]) for n, p in block.named_parameters()} == dict.fromkeys(theirs, True)


def test_a_few_steps_of_training_lower_the_loss():
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, mtp_depth=1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = _batch(cfg, T=48, cu=(0, 20, 48))
    first = None
    for _ in range(30):
        losses, _ = model(batch)
        loss = (losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / losses["lm_tokens"]
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first


def test_minimax_m3_blocks_train_their_indexers_by_their_loss_alone():
    """MiniMax-M3's blocks (block-sparse attention in blocks 1 and 2 and the MTP block,
    per-head q/k norms, every SwiGLU clamped with up + 1): the model's loss reaches every
    weight but the indexers', whose loss (index_loss_sum) reaches them alone; with
    index_loss_coeff 0 they are frozen; block 0 has no indexer; the choice matters (every
    block chosen gives other logits); the dense MLPs and shared experts take the SwiGLU's
    alpha and offset; the knobs without index_topk_blocks, and what it does not combine with,
    are refused by name."""
    cfg = MINIMAX_M3
    model = Transformer(cfg)
    model.reset_parameters(seed=3)
    batch = _batch(cfg)
    losses, _ = model(batch, model.context(batch))
    indexers = [n for n, _ in model.named_parameters() if ".index_" in n]
    assert sorted({n.split(".attn.")[0] for n in indexers}) == ["blocks.1", "blocks.2", "mtp.0.block"]
    assert float(model.index_loss_sum()) > 0
    (losses["lm_sum"] + losses["mtp_1_sum"]).backward(inputs=[p for n, p in model.named_parameters() if n not in indexers])
    for name, p in model.named_parameters():  # the model's loss: all but the indexers
        assert (p.grad is None) == (name in indexers), name
    model.zero_grad()
    losses, _ = model(batch, model.context(batch))
    ((losses["lm_sum"] + losses["mtp_1_sum"]) * 0).backward()  # the indexers' loss alone, attached to the outputs
    for name, p in model.named_parameters():
        assert (p.grad is not None and bool(p.grad.abs().sum() > 0)) == (name in indexers), name
    frozen = Transformer(dataclasses.replace(cfg, index_loss_coeff=0.0))
    frozen_batch = frozen(batch, frozen.context(batch))[0]
    (frozen_batch["lm_sum"] + frozen_batch["mtp_1_sum"]).backward()
    assert frozen.index_loss_sum() is None
    for name, p in frozen.named_parameters():
        assert p.requires_grad == (p.grad is not None) == (name not in indexers), name
    assert model.blocks[0].mlp.alpha == model.blocks[1].mlp.shared.alpha == 1.702 and model.blocks[1].mlp.shared.offset == 1.0
    with torch.no_grad():
        x = torch.randn(5, cfg.hidden)
        w = {n: getattr(model.blocks[0].mlp, n) for n in ("w_gate", "w_up", "w_down")}
        g, u = (x @ w["w_gate"]).clamp(max=1.5), (x @ w["w_up"]).clamp(-1.5, 1.5)
        torch.testing.assert_close(model.blocks[0].mlp(x), (g * torch.sigmoid(1.702 * g) * (u + 1)) @ w["w_down"])
        ids, cu = batch["input_ids"], batch["cu_seqlens"]
        sparse = model.logits(ids, cu)
        for block in model.blocks[1:]:
            block.attn.cfg = dataclasses.replace(block.attn.cfg, index_topk_blocks=6)
        assert float((model.logits(ids, cu) - sparse).abs().max()) > 1e-3
    for fields, message in ((dict(index_block_layers=(1,)), "index_block_layers: a knob of block-sparse attention, needs index_topk_blocks"),
                            (dict(index_local_blocks=2), "index_local_blocks: a knob of block-sparse attention, needs index_topk_blocks"),
                            (dict(MINIMAX_M3.__dict__, window=4), "window: not with block-sparse attention"),
                            (dict(MINIMAX_M3.__dict__, alibi=True, mtp_depth=0), "alibi: not with block-sparse attention"),
                            (dict(MINIMAX_M3.__dict__, index_heads=4), "index_heads: block-sparse attention's indexer has one head per kv head"),
                            (dict(MINIMAX_M3.__dict__, index_block_layers=(3,)), r"index_block_layers: expected")):
        with pytest.raises(ValueError, match=message):
            Transformer(TransformerConfig(**fields))
    with pytest.raises(ValueError, match="shared_swiglu_alpha: the shared experts' gate's sigmoid gain, alpha: expected a finite number, got nan"):
        TransformerConfig(shared_swiglu_alpha=math.nan)


def test_bad_configs():
    with pytest.raises(ValueError, match="n_dense: expected 0..n_layers"):
        TransformerConfig(n_layers=2, n_dense=3)
    # a bool given as a string built the feature ("False" is truthy); counts given as other types were a TypeError naming
    # nothing, or ran (n_dense=1.5), or failed at build (n_shared=1.5: torch.empty); an unknown linear_kind passed while no
    # block was linear
    for name in ("qkv_bias", "o_bias", "attn_sinks", "router_bias", "expert_biases", "mtp_norm", "shared_gate", "expert_bias",
                 "tie_embeddings", "round_embed_scale", "dense_beside_moe", "router_norm", "router_expert_scale", "layer_scalars", "v_norm",
                 "global_k_eq_v"):
        with pytest.raises(ValueError, match=f"^{name}: expected a bool, got 'False'"):
            TransformerConfig(**{name: "False"})
    for name, value, said in (("n_dense", 1.5, r"n_dense: expected 0..n_layers = 4 \(an int\), got 1.5"),
                              ("n_dense", "1", r"n_dense: expected 0..n_layers = 4 \(an int\), got '1'"),
                              ("n_dense", True, r"n_dense: expected 0..n_layers = 4 \(an int\), got True"),
                              ("n_shared", 1.5, r"n_shared: expected an int, got 1.5"),
                              ("n_shared", "1", r"n_shared: expected an int, got '1'"),
                              ("linear_kind", "not_a_kind", r"linear_kind: expected one of gated_deltanet, kda, .*, got 'not_a_kind'")):
        with pytest.raises(ValueError, match=f"^{said}"):
            TransformerConfig(n_layers=4, **{name: value})
    # softmax routing takes the aux-loss-free bias too (on the probabilities: ERNIE 4.5's)
    softmax = Transformer(TransformerConfig(score="softmax", n_layers=2, n_dense=1))
    assert all(m.expert_bias.shape == (softmax.cfg.n_experts,) for m in softmax.moe_layers().values())
    with pytest.raises(ValueError, match="hidden: expected a positive int"):
        TransformerConfig(hidden=0)
    # the bounds' edges are taken: a zero init_std, every block dense, rope_dim = head_dim, shared_ffn 0, and block lists kept sorted
    edges = TransformerConfig(n_layers=2, n_dense=2, init_std=0.0, rope_dim=32, shared_ffn=0, moe_layers=[1, 0], window=3,
                              local_heads=3, local_kv_heads=1)
    assert (edges.n_dense, edges.init_std, edges.rope_dim, edges.shared_ffn, edges.moe_layers) == (2, 0.0, 32, 0, (0, 1))
    for bad, said in ((1.0, "expected an int, got 1.0"), (True, "expected an int, got True"), ("1", "expected an int, got '1'"),
                      (-1, "expected >= 0, got -1")):  # TypeErrors, or True taken as one MTP module
        with pytest.raises(ValueError, match=f"mtp_depth: {said}"):
            TransformerConfig(mtp_depth=bad)
    with pytest.raises(ValueError, match="impl: expected one of auto, triton, torch, flex, got 'bogus'"):  # not at the first forward
        TransformerConfig(impl="bogus")
    for bad in (1.0, True, "1", -5):  # 1.0 and True drew other weights than seed 1
        with pytest.raises(ValueError, match="seed: expected"):
            Transformer(TransformerConfig(n_layers=1, n_dense=1)).reset_parameters(seed=bad)
    # zero experts: the router, its bias and the expert bias score E + Z choices, the experts are E
    zero = Transformer(TransformerConfig(n_layers=2, n_dense=1, n_experts=4, zero_experts=3, router_bias=True))
    for m in zero.moe_layers().values():
        assert m.router.shape[0] == m.router_bias.shape[0] == m.expert_bias.shape[0] == 7 and m.experts.w_gate.shape[0] == 4
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="zero_experts: expected"):
            TransformerConfig(zero_experts=bad)
    with pytest.raises(ValueError, match="n_groups"):  # the groups split all E + Z choices
        TransformerConfig(n_experts=8, zero_experts=2, n_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        TransformerConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="route_normalize: applies to score='sigmoid' or 'sqrtsoftplus' only"):
        TransformerConfig(score="softmax", expert_bias=False, route_normalize=False)
    with pytest.raises(ValueError, match="group_score_topk: applies to group-limited routing only"):
        TransformerConfig(group_score_topk=2)
    with pytest.raises(ValueError, match="topk_groups: expected 1..4"):
        TransformerConfig(n_groups=4, topk_groups=5)
    for name, bad in (("attn_scale", 0.0), ("embed_scale", -1.0), ("residual_scale", float("inf")), ("logit_divisor", True)):
        with pytest.raises(ValueError, match=f"{name}: expected a positive finite number"):
            TransformerConfig(**{name: bad})
    with pytest.raises(ValueError, match="scale: expected None or a positive finite number"):
        fmoe.layers.AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, scale=float("nan"))
    # knobs that failed later, in the first forward or the initialisation, fail at the config, named as its fields
    for kwargs, said in ((dict(ffn_expert=0), "ffn_expert: expected a positive int, got 0"),
                         (dict(ffn_dense=-4), "ffn_dense: expected a positive int, got -4"),
                         (dict(init_std=-0.02), "init_std: expected a finite number >= 0, got -0.02"),
                         (dict(norm_eps=float("nan")), "norm_eps: expected a positive finite number, got nan"),
                         (dict(norm_eps=0.0), "norm_eps: expected a positive finite number, got 0.0"),
                         (dict(head_dim=7), r"head_dim: expected an even number of rotated channels \(pairs\), got 7"),
                         (dict(rope_dim=3), r"rope_dim: expected an even int in 2..head_dim"),
                         (dict(rope_base=0.5), "rope_base: expected a finite number > 1, got 0.5"),
                         (dict(yarn_factor=0.0), "yarn_factor: expected a finite number > 0, got 0.0"),
                         (dict(yarn_factor=4.0, yarn_original_max_positions=0), "yarn_original_max_positions: "),
                         (dict(capacity_factor=0.0), "capacity_factor: expected None or a positive finite number, got 0.0"),
                         (dict(capacity_factor=1.0, capacity_policy="random"), "capacity_policy: expected 'probs' or 'position', got 'random'"),
                         (dict(score="sparsemixer", expert_bias=False, k=3), "k: sparsemixer routing chooses 2 experts per token, got k=3"),
                         (dict(score="sparsemixer"), "expert_bias: sparsemixer routing .* takes no expert bias; set expert_bias=False"),
                         (dict(score="sparsemixer", expert_bias=False, route_scale=2.5), r"route_scale: a knob of route, not of sparsemixer routing"),
                         (dict(score="sparsemixer", expert_bias=False, n_groups=2, topk_groups=1), r"n_groups: a knob of route, not of sparsemixer"),
                         (dict(score="sparsemixer", expert_bias=False, sparsemixer_eps=-1.0), "sparsemixer_eps: expected a finite number >= 0"),
                         (dict(sparsemixer_eps=0.1), "sparsemixer_eps: the gap of sparsemixer routing, needs score='sparsemixer'"),
                         (dict(norm_bias=True), r"norm_bias: a bias on each LayerNorm, needs layer_norms"),
                         (dict(head_bias=1), "head_bias: expected a bool, got 1"),
                         # the blocks' configs' checks, named as the fields they were built from
                         (dict(attn_softcap=-1.0), "attn_softcap: expected None or a positive finite number"),
                         (dict(route_scale=0.0), "route_scale: expected a positive finite number, got 0.0"),
                         (dict(route_normalize="x"), "route_normalize: expected a bool, got 'x'"),
                         (dict(router_softcap=-2.0), "router_softcap: expected None or a positive finite number, got -2.0"),
                         (dict(window=3, local_rope_base=100.0, local_rope_dim=3), r"local_rope_dim: expected an even int in 2..head_dim = 32, or None, got 3"),
                         (dict(window=3, rope_dim=8, rope_last=True, local_rope_base=100.0, local_rope_dim=32),  # was the first forward's error
                          r"local_rope_dim: with rope_last the local layers turn the last 32 channels of each head, which needs fewer than their head_dim = 32"),
                         (dict(index_rope_interleaved=True), "index_rope_interleaved: a knob of DeepSeek sparse attention's indexer, needs index_topk"),
                         (dict(linear_layers=(0,), linear_conv=0), "linear_conv: expected >= 1, got 0"),
                         (dict(linear_layers=(0,), linear_kind="mamba2", linear_gate_norm="x"), "linear_gate_norm: expected one of"),
                         (dict(query_temperature_floor=4, query_temperature_scale=float("nan")), "query_temperature_scale: expected a finite number"),
                         # the block configs' own names inside the message too (it said "the last rot_dim channels ... got rot_dim None")
                         (dict(rope_last=True), r"^rope_last: rotates the last rope_dim channels of each head, needs rope_dim < head_dim = 32, got rope_dim None$"),
                         (dict(kv_rank=8, q_rank=8, rope_dim=8, index_topk=4, index_heads=2, index_head_dim=2),
                          r"^index_head_dim: the indexer rotates rope_dim = 8 of its channels, expected index_head_dim >= rope_dim, got 2")):
        with pytest.raises(ValueError, match=said):
            TransformerConfig(**kwargs)
    with pytest.raises(ValueError, match=r"qk_norm_after_rope: needs per-head norms \(qk_norm 'head', 'rms' or 'head_k'\), got qk_norm='proj'"):
        TransformerConfig(qk_norm="proj", qk_norm_after_rope=True)
    model = Transformer(dataclasses.replace(TINY, mtp_depth=1))
    with pytest.raises(ValueError, match=r"batch: missing \['mtp_input_ids'"):
        model(_batch(TINY))
    batch = _batch(model.cfg)
    with pytest.raises(ValueError, match="ctx: expected model.context"):
        model(batch, Transformer(TINY).context(_batch(TINY)))
    with pytest.raises(ValueError, match=r"batch\['labels'\]: expected shape \(24,\)"):
        model(dict(batch, labels=batch["labels"][:5]))
    with pytest.raises(ValueError, match=r"batch\['positions'\]: expected shape \(24,\) like input_ids, got \(5,\)"):
        model(dict(batch, positions=batch["positions"][:5]))
    with pytest.raises(ValueError, match=r"batch\['mtp_labels'\]: expected shape \(1, 24\): one row per MTP depth \(mtp_depth = 1\), got \(1, 5\)"):
        model(dict(batch, mtp_labels=batch["mtp_labels"][:, :5]))
    with pytest.raises(ValueError, match=r"hidden: expected the previous stage's output .* got a tensor \(pipeline_chunk=None\)"):
        model(batch, hidden=torch.zeros(24, model.cfg.hidden))
    # a batch split by split_batch (token_index) exactly when the model is context parallel
    with pytest.raises(ValueError, match="batch: a context-parallel model takes the batch split .* got a split batch, context_parallel=None$"):
        model.check_batch(dict(batch, token_index=torch.arange(24)))
    model.context_parallel = "cp"
    with pytest.raises(ValueError, match="batch: a context-parallel model takes the batch split .* got an unsplit batch, context_parallel=cp$"):
        model.check_batch(batch)


def test_layer_predicates_place_each_block_s_parts():
    """Which trunk blocks are MoE, hashed, shortcut pairs, attending, local, fp8, with sinks or
    NoPE, and their heads, kv heads, head dims and SwiGLU clamps (i None: an MTP block)."""
    cfg = dataclasses.replace(TINY, n_layers=6, n_dense=1, hash_layers=2, score="sqrtsoftplus")
    assert [cfg.is_moe(i) for i in range(6)] == [False, True, True, True, True, True]
    assert [cfg.is_hash(i) for i in range(6)] == [False, True, True, False, False, False]
    pairs = dataclasses.replace(TINY, n_layers=4, n_dense=0, n_shared=0, shortcut_moe=True)
    assert [pairs.is_moe(i) for i in range(4)] == [True, False, True, False]
    assert [pairs.shortcut(i) for i in range(4)] == ["out", "in", "out", "in"]
    assert [dataclasses.replace(pairs, n_dense=2).shortcut(i) for i in range(4)] == [None, None, "out", "in"]
    assert [VARIANTS["falcon_h1"].attends(i) for i in range(3)] == [True] * 3
    hybrid = dataclasses.replace(TINY, n_layers=4, n_dense=4, mixer_free_layers=(1,), linear_layers=(0, 3), linear_kind="mamba2", window=4)
    assert [hybrid.attends(i) for i in range(4)] == [False, False, True, False]
    assert [hybrid.is_sliding(i) for i in range(4)] == [False, False, True, False]
    chunked = dataclasses.replace(hybrid, window=None, chunk=4)
    assert [chunked.is_chunked(i) for i in range(4)] == [False, False, True, False]
    assert [chunked.is_local(i) for i in range(4)] == [False, False, True, False]
    heads = dataclasses.replace(TINY, chunk=4, chunk_layers=(0, 2), local_heads=8, local_kv_heads=4, local_head_dim=6, local_rope_base=100.0)
    assert [heads.heads(i) for i in (0, 1, 2, None)] == [8, 4, 8, 4]
    assert [heads.kv_heads(i) for i in (0, 1, 2, None)] == [4, 2, 4, 2]
    assert [heads.layer_head_dim(i) for i in (0, 1, 2, None)] == [6, 8, 6, 8]
    fp8 = dataclasses.replace(TINY, fp8=True, fp8_layers=(1,))
    assert [fp8.is_fp8(i) for i in (0, 1, 2, None)] == [False, True, False, False]
    assert [dataclasses.replace(TINY, fp8=True).is_fp8(i) for i in (0, None)] == [True, True]
    sinks = dataclasses.replace(TINY, attn_sinks=True, sink_layers=(0, 2))
    assert [sinks.has_sinks(i) for i in (0, 1, 2, None)] == [True, False, True, False]
    assert [TINY.is_nope(i) for i in range(3)] == [False] * 3
    assert [dataclasses.replace(TINY, abs_positions=32).is_nope(i) for i in range(3)] == [True] * 3
    limits = dataclasses.replace(TINY, swiglu_limit=0.5, swiglu_limit_layers=(1,), shared_swiglu_limit=0.7, shared_swiglu_limit_layers=(2,))
    assert [limits.clamps(i) for i in (0, 1, 2, None)] == [False, True, False, False]
    assert [limits.mlp_limit(i) for i in (0, 1, 2, None)] == [None, None, 0.7, None]
    assert [(limits.moe_config(layer=i).swiglu_limit, limits.moe_config(layer=i).shared_swiglu_limit) for i in (1, 2, None)] == [
        (0.5, None), (None, 0.7), (None, None)]
    assert dataclasses.replace(TINY, n_shared=2).shared_size == 32 and dataclasses.replace(TINY, hyper_connections=0).stream_width == 32
    assert dataclasses.replace(TINY, out_vocab=24).head_vocab == 24
    longrope = dataclasses.replace(TINY, rope_dim=4, longrope_short_factors=(1.0, 1.5), longrope_original_max_positions=1)
    assert not longrope.longrope_switches and dataclasses.replace(longrope, longrope_long_scale=1.3).longrope_switches
    assert dataclasses.replace(longrope, longrope_long_factors=(3.0, 9.0)).longrope_switches


def test_index_predicates_choose_each_block_s_indexer():
    """A block of index_shared_layers takes the keys of the nearest earlier block with an
    indexer (a linear block has none) and trains no indexer; index_block_layers' blocks (and
    the MTP blocks) attend block-sparse."""
    dsa = VARIANTS["dsa"]
    assert [dsa.index_source(i) for i in range(3)] == [0, 1, 1]
    shared = dataclasses.replace(dsa, n_layers=4, n_dense=1, index_shared_layers=(2, 3))
    assert [shared.index_source(i) for i in range(4)] == [0, 1, 1, 1]
    after_linear = dataclasses.replace(dsa, n_layers=4, linear_layers=(1,), index_shared_layers=(2, 3))
    assert [after_linear.index_source(i) for i in (0, 2, 3)] == [0, 0, 0]
    assert dsa.attention_config(index_shared=True).index_loss is False and dsa.attention_config().index_loss is True
    assert [MINIMAX_M3.is_index_blocks(i) for i in (0, 1, 2, None)] == [False, True, True, True]


def test_per_layer_configs_carry_their_block_s_knobs():
    """The blocks' MoE, linear-attention and attention configs carry the knobs of their block:
    fp8, eps, dt rank, the local blocks' RoPE and k_eq_v, the NoPE blocks' q/k norms and
    temperature, the context's global head dim; micro-batches past abs_positions refused."""
    fp8 = dataclasses.replace(TINY, fp8=True, fp8_fast_accum=True)
    assert fp8.moe_config().fp8_fast_accum and not fp8.moe_config(fp8=False).fp8_fast_accum
    assert dataclasses.replace(TINY, post_norms=True, post_norm_eps=1e-3).moe_config().expert_out_norm_eps == 1e-3
    lin = dataclasses.replace(TINY, linear_layers=(0,), linear_k_heads=2, linear_v_heads=2, linear_k_dim=4, linear_v_dim=6, linear_conv=3)
    assert lin.linear_attention_config(fp8=True).fp8 and not lin.linear_attention_config().fp8
    assert [dataclasses.replace(lin, impl=impl).linear_attention_config().impl for impl in ("auto", "triton", "torch")] == ["auto", "triton", "torch"]
    jamba = VARIANTS["jamba"]
    assert jamba.linear_attention_config().dt_rank == 2 and dataclasses.replace(jamba, hidden=40).linear_attention_config().dt_rank == 3
    assert dataclasses.replace(VARIANTS["minimax"], norm_eps=1e-5).linear_attention_config().norm_eps == 1e-6
    local = dataclasses.replace(TINY, window=4, window_layers=(0,), local_head_dim=6, local_rope_base=100.0, rope_proportion=0.25)
    assert local.attention_config(local=True).rope_proportion is None and local.attention_config().rope_proportion == 0.25
    assert local.attention_config(local=True).local_head_dim is None and local.attention_config().local_head_dim == 6
    gemma4 = VARIANTS["gemma4"]
    assert (gemma4.attention_config(local=True).k_eq_v, gemma4.attention_config().k_eq_v) == (False, True)
    ctx = local.context_config()
    assert (ctx.head_dim, ctx.rope_proportion, ctx.local_head_dim, ctx.window) == (8, 0.25, 6, 4)
    nope = dataclasses.replace(TINY, qk_norm="head_layer", qk_norm_bias=True, nope_layers=(1,), nope_qk_norm=False)
    assert (nope.attention_config(rope=False).qk_norm, nope.attention_config(rope=False).qk_norm_bias) == (None, False)
    assert (nope.attention_config().qk_norm, nope.attention_config().qk_norm_bias) == ("head_layer", True)
    mla = VARIANTS["mla, group top-2, mtp norm"]
    assert dataclasses.replace(mla, norm_eps=1e-5).attention_config().latent_norm_eps == 1e-6
    beam = VARIANTS["beam"]
    assert (beam.attention_config().temperature_kind, beam.attention_config(rope=False).temperature_kind) == ("log", "power")
    positions = dataclasses.replace(TINY, abs_positions=32)
    positions.check_micro_batch(32, "--train.micro_batch_tokens")
    with pytest.raises(ValueError, match=r"^--train.micro_batch_tokens: expected at most 32 tokens, .* got 33$"):
        positions.check_micro_batch(33, "--train.micro_batch_tokens")


def _loss(model, batch, ctx, *, with_stats=False):
    """The step's loss as the loop makes it, LM + MTP + balancing terms, from one forward
    (and the MoE stats with with_stats=True)."""
    losses, stats = model(batch, ctx)
    loss = losses["lm_sum"] / losses["lm_tokens"]
    for d in range(1, model.cfg.mtp_depth + 1):
        loss = loss + 0.1 * losses[f"mtp_{d}_sum"] / losses[f"mtp_{d}_tokens"]
    mask = batch["token_mask"] if "token_mask" in batch.keys() else None  # padding: left out of the balancing terms
    for s in stats.values():
        n_tokens = s["aux_scores"].shape[0] if mask is None else mask.sum()
        loss = loss + 1e-3 * fmoe.ops.z_loss(s["router_logits"], mask=mask)
        loss = loss + 1e-4 * fmoe.ops.seq_load_balancing_loss(s["aux_scores"], s["aux_experts"], batch["cu_seqlens"], k=model.cfg.k, check=False,
                                                              mask=mask)
        loss = loss + 1e-4 * fmoe.ops.load_balancing_loss(s["aux_scores"], s["aux_counts"], k=model.cfg.k, n_tokens=n_tokens)
    return (loss, stats) if with_stats else loss


FULL = dataclasses.replace(TINY, mtp_depth=2, impl="auto", capacity_factor=1.25, n_groups=2, topk_groups=1, yarn_factor=2.0,
                           attn_scale=0.3, embed_scale=2.0, residual_scale=0.6, logit_divisor=3.0)


@pytest.mark.parametrize("cfg", [dataclasses.replace(TINY, mtp_depth=1, impl="auto"), FULL, dataclasses.replace(VARIANTS["gated deltanet"], impl="auto"),
                                 dataclasses.replace(VARIANTS["falcon_h1"], impl="auto"), dataclasses.replace(VARIANTS["jamba"], impl="auto"),
                                 dataclasses.replace(MINIMAX_M3, impl="triton"), dataclasses.replace(VARIANTS["jetmoe"], impl="auto"),
                                 dataclasses.replace(VARIANTS["dsv4"], impl="auto"), dataclasses.replace(VARIANTS["dsv4-hca"], impl="auto"),
                                 dataclasses.replace(DSV4_CSA, impl="auto")],
                         ids=["default", "capacity-groups-yarn-mtp2-granite", "gated deltanet", "falcon_h1", "jamba", "minimax-m3-kernel", "jetmoe",
                              "dsv4", "dsv4-hca", "dsv4-csa"])
def test_forward_and_backward_read_nothing_on_the_host(cfg):
    """No device->host sync in the model's forward and backward (MoE layers, MTP, losses):
    on a GPU each read is a stall. Counted here as host reads of tensor values on CPU."""
    model = Transformer(cfg)
    batch = _batch(cfg)
    ctx = model.context(batch)
    with HostReads() as reads:
        _loss(model, batch, ctx).backward()
    assert reads.count == 0, reads.sites


def _compiled_like_eager(cfg, *, fresh=True):
    """A model of cfg, its forward + losses compiled whole (fullgraph) and run backward: the
    value and every gradient as eager's. Returns (model, eager's gradients). fresh=True
    clears dynamo's caches first: each model is a new guard on `_loss`, and the file's
    compiles, run in one process, would pass dynamo's recompile limit (8 per code object). Frozen weights (requires_grad
    False) are left out."""
    if fresh:
        torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = _batch(cfg, T=32, cu=(0, 7, 8, 24, 32), padding=8)
    ctx = model.context(batch)
    eager = _loss(model, batch, ctx)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}  # not a frozen indexer's (compressed sparse attention's)
    model.zero_grad()
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")(model, batch, ctx)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
        else:
            assert p.grad is None, n
    return model, grads


@pytest.mark.parametrize("name", ["full", "dsa", "mhc", "falcon_h1", "jamba", "minimax-m3", "jetmoe", "dsv4", "dsv4-hca", "dsv4-csa"])
def test_the_whole_model_compiles_without_a_graph_break(name):
    """torch.compile(fullgraph=True) of forward + losses (a host sync would be a graph break),
    then the backward; same values and gradients as eager. The batch ends in padding (its
    token_mask). DeepSeek sparse attention: its stable sort, and its indexer loss's gradient
    added in the backward and its value kept on the module. Hyper-connections: the streams'
    Sinkhorn steps. Falcon-H1's: a Mamba-2 mixer and attention side by side in every block.
    Jamba's: Mamba-1 mixers (a decay per channel and state channel) beside NoPE attention.
    MiniMax-M3's: block-sparse attention's choice (a scatter of block maxima, a stable sort)
    and its indexer's loss. JetMoE's: the attention experts' routed projections and their
    routers' balance loss. DeepSeek-V4's: the hashed block's table lookup by token id, the grouped output projection,
    the shared key-value heads' turn back; its compressed sparse attention's indexer choice (a stable sort of its scores)."""
    cfg = FULL if name == "full" else dataclasses.replace({"minimax-m3": MINIMAX_M3, "dsv4-csa": DSV4_CSA}.get(name) or VARIANTS[name], impl="auto")
    model, grads = _compiled_like_eager(cfg)
    if name in ("dsa", "minimax-m3"):
        indexer = "blocks.0.attn.index_wq" if name == "dsa" else "blocks.1.attn.index_wq"
        assert float(model.index_loss_sum()) > 0 and float(grads[indexer].abs().max()) > 0
    if name == "jetmoe":  # the attention routers' balance losses, kept and added in the backward
        assert float(model.moa_aux_loss_sum()) > 0 and float(grads["blocks.0.attn.moa_router"].abs().max()) > 0


def test_models_whose_float_knobs_differ_compile_whole_in_one_process():
    """A second compile in one process of a model whose float knobs differ from the first's
    (a sweep, or MiniMax-M3 after another model) brings those floats back symbolic: the
    checks they pass through (the SwiGLU's alpha, limit and offset among them) must keep
    the graph whole, with the eager values and gradients."""
    torch._dynamo.reset()
    floats = dict(capacity_factor=1.5, yarn_factor=3.0, attn_scale=0.25, embed_scale=1.5, residual_scale=0.5, logit_divisor=2.0,
                  swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_offset=1.0, route_scale=2.5, rope_base=5e4, norm_eps=1e-5,
                  logit_softcap=30.0, attn_softcap=50.0, router_softcap=20.0, value_scale=0.5, clip_qkv=8.0)
    for cfg in (FULL, dataclasses.replace(MINIMAX_M3, impl="auto"), dataclasses.replace(FULL, **floats)):
        _compiled_like_eager(cfg, fresh=False)


def test_mixture_of_attention_heads_weighs_its_balance_loss_and_checks_its_knobs():
    """The attention routers' balance losses reach the gradients times the weight the loop
    sets (Transformer.set_moa_aux_weight: weight 2w adds twice weight w's share; the router
    gets a share, and every attention block and the MTP's is counted); the knobs are checked
    by name."""
    cfg = VARIANTS["jetmoe"]
    model = Transformer(cfg)
    assert sorted(model.moa_attentions()) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn", "mtp.0.block.attn"]
    batch = _batch(cfg)
    grads = []
    for weight in (0.0, 0.5, 1.0):
        model.zero_grad()
        model.set_moa_aux_weight(weight)
        _loss(model, batch, model.context(batch)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert len(model.moa_attentions()) == 4 and float(model.moa_aux_loss_sum()) > 3.0  # about 1 each
    with torch.no_grad():  # a forward without gradients computes no balance loss: none kept from the last
        model(batch, model.context(batch))
    assert model.moa_aux_loss_sum() is None
    for name, g0 in grads[0].items():
        torch.testing.assert_close(grads[2][name] - g0, 2 * (grads[1][name] - g0), rtol=1e-3, atol=1e-6, msg=name)
    assert float((grads[1]["blocks.0.attn.moa_router"] - grads[0]["blocks.0.attn.moa_router"]).abs().max()) > 0
    with pytest.raises(ValueError, match="weight: expected a finite number >= 0, got -1.0"):
        model.set_moa_aux_weight(-1.0)
    for change, message in [(dict(moa_experts=None, moa_topk=1, moa_aux_coeff=0.1), "moa_aux_coeff: the weight of the attention experts' balance loss, needs moa_experts"),
                            (dict(moa_aux_coeff=-0.5), "moa_aux_coeff: expected a finite number >= 0, got -0.5"),
                            (dict(qkv_bias=True), "qkv_bias: not with a mixture of attention heads (moa_experts)"),
                            (dict(attn_gate=True), "attn_gate: not with a mixture of attention heads (moa_experts)"),
                            (dict(n_heads=6), "n_heads: a mixture of attention heads has moa_topk x n_kv_heads = 4 query heads"),
                            (dict(n_dense=3), "moe_out_bias: a bias on the MoE blocks' output (a bool; True needs MoE blocks), got True")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(cfg, **change)


def test_gated_deltanet_compiles_once_for_every_document_count():
    """The train loop marks cu_seqlens' length dynamic under --compile: a first batch of one
    document (cu_seqlens of 2) must not specialise the graph to that length (the linear
    layers' document search did, and the second batch failed), and later batches of other
    counts reuse the graph; values as eager."""
    cfg = dataclasses.replace(VARIANTS["gated deltanet"], impl="auto")
    torch.manual_seed(0)
    model = Transformer(cfg)

    def lm_and_mtp(model, batch, ctx):  # the model's own losses (a per-document loss has [n] tensors of its own)
        losses, _ = model(batch, ctx)
        return losses["lm_sum"] + losses["mtp_1_sum"]

    compiled = torch.compile(lm_and_mtp, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for cu in ((0, 24), (0, 7, 8, 24), (0, 3, 10, 20, 24)):
        batch = _batch(cfg, cu=cu)
        torch._dynamo.mark_dynamic(batch["cu_seqlens"], 0)
        ctx = model.context(batch)
        torch.testing.assert_close(compiled(model, batch, ctx), lm_and_mtp(model, batch, ctx), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1  # one graph for the three counts


def test_one_context_per_micro_batch(monkeypatch):
    """The mask is built once by context() and shared by the MTP depths; forward with a
    given context builds none."""
    model = Transformer(dataclasses.replace(TINY, mtp_depth=2))
    batch = _batch(model.cfg)
    built = []
    real = fmoe.layers.document_mask
    monkeypatch.setattr(fmoe.layers, "document_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    ctx = model.context(batch)
    assert isinstance(ctx, BatchContext) and len(ctx.attention) == 3 and len(built) == 1
    assert all(c.mask is ctx.attention[0].mask for c in ctx.attention)
    torch.testing.assert_close(ctx.attention[2].cos, fmoe.layers.rope_tables(batch["mtp_positions"][1], model.blocks[0].attn.cfg)[0])
    model(batch, ctx)
    assert len(built) == 1
    losses, _ = model(batch)  # no context given: built here, once
    assert len(built) == 2


def _gpu_step(cfg, seed=0):
    """A CUDA model (bf16, router and biases float32) and one micro-batch on the device."""
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device="cuda", dtype=torch.bfloat16)
    batch = make_batch(torch.randint(0, cfg.vocab_size, (4096,), generator=torch.Generator().manual_seed(seed)),
                       torch.tensor([0, 1000, 1001, 3000, 4096]), mtp_depth=cfg.mtp_depth).to("cuda")
    return model, batch


GPU_CFG = TransformerConfig(vocab_size=4096, hidden=512, n_layers=3, n_dense=1, ffn_dense=1024, n_experts=16, k=4,
                            ffn_expert=256, n_shared=1, n_heads=8, n_kv_heads=2, head_dim=64, mtp_depth=1)


# DeepSeek sparse attention at GPU sizes: 256 keys per query of documents up to 2000 tokens, block 2 reusing block 1's choice
GPU_DSA = dataclasses.replace(GPU_CFG, n_kv_heads=8, head_dim=96, rope_dim=32, rope_interleaved=True, q_rank=256, kv_rank=128, v_head_dim=64,
                              index_topk=256, index_heads=16, index_head_dim=64, index_shared_layers=(2,))


# hyper-connections at GPU sizes: 4 mixed streams (bf16) beside their float32 weights
GPU_MHC = dataclasses.replace(GPU_CFG, hyper_connections=4, mtp_depth=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "dsa", "mhc"])
def test_gpu_training_step_never_syncs(name):
    """One whole training step (forward, losses, backward, clip, AdamW, expert-bias update)
    under torch.cuda.set_sync_debug_mode("error"): any device->host sync raises. DeepSeek
    sparse attention: its choice of keys (a stable sort) and its indexer loss too.
    Hyper-connections: the streams' weights kept float32 in a bf16 model."""
    from fmoe.optim import AdamW, clip_grad_norm

    model, batch = _gpu_step({"default": GPU_CFG, "dsa": GPU_DSA, "mhc": GPU_MHC}[name])
    opt = AdamW(model.parameters(), lr=1e-4, state_dtype=torch.bfloat16)

    ctx = model.context(batch)
    _loss(model, batch, ctx).backward()  # warm-up: compiles FlexAttention, allocates
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = _loss(model, batch, ctx, with_stats=True)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer, moe in model.moe_layers().items():
            moe.expert_bias.copy_(fmoe.ops.update_expert_bias(moe.expert_bias, stats[layer]["tokens_per_expert"], 1e-3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss.detach().float().cpu())
    if name == "dsa":
        # on CUDA the sparse kernel's path: the context keeps the mask's rule, no [T, S] mask
        assert torch.isfinite(model.index_loss_sum().cpu()) and isinstance(ctx.attention[0].mask, fmoe.layers.MaskRows)
    if name == "mhc":
        assert model.hc_head.fn.dtype == model.blocks[0].attn_hc.fn.dtype == torch.float32


@pytest.mark.gpu
def test_gpu_deterministic_steps_repeat_bit_for_bit():
    from fmoe.optim import AdamW
    from fmoe.train.run import set_deterministic

    set_deterministic(True)
    try:
        results = []
        for _ in range(2):
            model, batch = _gpu_step(GPU_CFG, seed=3)
            opt = AdamW(model.parameters(), lr=1e-3)
            losses = []
            for _ in range(2):
                loss = _loss(model, batch, model.context(batch))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().float().cpu())
            results.append((losses, [p.detach().float().cpu() for p in model.parameters()]))
        (losses_a, params_a), (losses_b, params_b) = results
        assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    finally:
        set_deterministic(False)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("name", ["default", "softmax aux, no shared, no bias"])
def test_padding_trains_as_if_it_were_not_in_the_batch(name, ac):
    """A micro-batch with padding (make_batch's token_mask False, as --whole_documents makes
    it) gives the losses, the balancing terms, the expert counts and the gradients of the
    same documents without it: the padding is not routed and no loss counts it."""
    cfg = dataclasses.replace(VARIANTS[name], mtp_depth=1, ac=ac, impl="auto")
    ids = torch.randint(0, cfg.vocab_size, (24,))
    keep = torch.arange(24) < 16
    padded = make_batch(ids, torch.tensor([0, 7, 16, 24]), 1, label_mask=keep, token_mask=keep)
    plain = make_batch(ids[:16], torch.tensor([0, 7, 16]), 1)
    results = []
    for batch in (padded, plain):
        torch.manual_seed(0)
        model = Transformer(cfg)
        with HostReads() as reads:
            loss, stats = _loss(model, batch, model.context(batch), with_stats=True)
            loss.backward()
        assert reads.count == 0, reads.sites
        results.append((loss.detach(), stats, {n: p.grad for n, p in model.named_parameters()}))
    (loss0, stats0, grads0), (loss1, stats1, grads1) = results
    torch.testing.assert_close(loss0, loss1, rtol=1e-6, atol=1e-7)
    assert sorted(stats0.keys()) == sorted(stats1.keys()) == ["layer_1", "layer_2", "mtp_1"]
    for layer in stats0.keys():
        for key in ("tokens_per_expert", "aux_counts"):
            assert torch.equal(stats0[layer][key], stats1[layer][key]), (layer, key)
        assert int(stats0[layer]["tokens_per_expert"].sum()) == 16 * cfg.k
    for pname, g in grads0.items():
        torch.testing.assert_close(g, grads1[pname], rtol=1e-5, atol=1e-7, msg=pname)


AC_CFG = dataclasses.replace(TINY, mtp_depth=1, impl="auto", n_groups=2, topk_groups=1, capacity_factor=1.25, post_norms=True)


@pytest.mark.parametrize("blocks", ["sandwich", "parallel", "shortcut", "hyper", "parallel hybrid"])
@pytest.mark.parametrize("ac", ["full", "attention", "experts"])
def test_activation_checkpointing_gives_the_same_gradients_and_stats(ac, blocks):
    """Recomputing in the backward changes nothing: the gradients are bit-identical (the
    recomputation is deterministic on CPU), the losses and the MoE stats too, and the token
    counts are those of one forward (the recomputed forward counts nothing); in sandwich
    blocks, in Cohere's parallel blocks (the attention recomputed from the one normed input)
    and in LongCat-Flash's shortcut pairs (a pair's [T, 2H] stream recomputed block by block),
    with hyper-connections (the attention recomputed from the streams' weighted sum), and in
    Falcon-H1's parallel hybrid blocks (the Mamba-2 mixer and the attention beside it recomputed)."""
    cfg = {"sandwich": AC_CFG, "parallel": dataclasses.replace(AC_CFG, post_norms=False, parallel_blocks=True, layer_norms=True),
           "shortcut": dataclasses.replace(AC_CFG, post_norms=False, n_layers=4, n_dense=0, shortcut_moe=True, zero_experts=2),
           "hyper": dataclasses.replace(AC_CFG, mtp_depth=0, hyper_connections=3),
           "parallel hybrid": dataclasses.replace(AC_CFG, post_norms=False, linear_layers=(0, 1), linear_kind="mamba2", linear_k_heads=2, linear_v_heads=4,
                                                  linear_k_dim=8, linear_v_dim=6, linear_conv=3, parallel_hybrid=True, linear_gate_norm="none")}[blocks]
    batch = _batch(cfg, T=48, cu=(0, 7, 30, 48))
    results = {}
    for mode in ("none", ac):
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(cfg, ac=mode))
        loss, stats = _loss(model, batch, model.context(batch), with_stats=True)
        loss.backward()
        results[mode] = loss.detach(), stats.detach(), {n: p.grad for n, p in model.named_parameters()}
    (loss0, stats0, grads0), (loss1, stats1, grads1) = results["none"], results[ac]
    assert torch.equal(loss0, loss1)
    for name, layer in stats0.items():
        for key, value in layer.items():
            assert torch.equal(stats1[name][key], value), (name, key)
        assert int(stats1[name]["tokens_per_expert"].sum()) <= 48 * cfg.k  # one forward's slots (capacity drops some)
    for name, g in grads0.items():
        assert torch.equal(grads1[name], g), name


def test_activation_checkpointing_keeps_fewer_bytes_for_backward():
    """Counted with saved_tensors_hooks (fmoe.train.metrics.SavedTensors): full keeps only the
    blocks' inputs, each selective mode less than none."""
    from fmoe.train.metrics import SavedTensors

    cfg = dataclasses.replace(TINY, mtp_depth=1, n_dense=0)
    batch = _batch(cfg, T=64, cu=(0, 64))
    kept = {}
    for ac in ("none", "full", "attention", "experts"):
        model = Transformer(dataclasses.replace(cfg, ac=ac))
        ctx = model.context(batch)
        with SavedTensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
            loss = _loss(model, batch, ctx)
        loss.backward()  # the graph is whole: the backward runs
        kept[ac] = saved.nbytes
    assert kept["full"] < kept["attention"] < kept["none"] and kept["experts"] < kept["none"], kept
    assert kept["full"] < kept["none"] / 3, kept


def test_activation_checkpointing_bad_mode():
    with pytest.raises(ValueError, match="ac: expected one of none, full, attention, experts, got 'some'"):
        dataclasses.replace(TINY, ac="some")


_SMALL = dict(vocab_size=40, hidden=32, n_layers=4, n_dense=1, ffn_dense=48, n_experts=4, k=2, ffn_expert=16, n_shared=1,
              n_heads=4, n_kv_heads=2, head_dim=8, impl="torch")


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_layers=(1, 4)), r"moe_layers: expected distinct block indices in 0..3"),
    (dict(moe_layers=(1, 1)), r"moe_layers: expected distinct"),
    (dict(qk_norm="layernorm"), r"qk_norm: expected None, 'head', 'proj', 'rms', 'head_layer', 'layer' or 'head_k', got 'layernorm'"),
    (dict(rope_dim=7), r"rope_dim: expected an even int in 2..head_dim"),
    (dict(n_shared=0, shared_gate=True), r"shared_gate: needs shared experts"),
    (dict(shared_ffn=-1), r"shared_ffn: expected an int >= 0 or None"),
    (dict(logit_softcap=0.0), r"logit_softcap: expected None or a positive finite number, got 0.0"),
    (dict(norm_gate_rank=0), r"norm_gate_rank: expected >= 1, got 0"),
    (dict(norm_gate_rank=2, layer_norms=True), r"norm_gate_rank: gates the blocks' plain RMSNorm pre-norms, needs pre_norms and not layer_norms"),
    (dict(q_latent_raw=True), r"q_latent_raw: a knob of multi-latent attention's q latent, a bool, True needs q_rank and kv_rank \(got True\)"),
    (dict(attn_gate_on_q=True), r"attn_gate_on_q: the output gate reads the q latent, needs attn_gate=True"),
    (dict(attn_gate_bias=True), r"attn_gate_bias: the output gate's bias per head, a bool, True needs attn_gate=True"),
    (dict(nope_temperature_kind="power"), r"nope_temperature_kind: the form of the NoPE blocks' query scale, needs nope_temperature_floor"),
    (dict(nope_layers=(1,), nope_temperature_floor=4, nope_temperature_kind="exp"), r"temperature_kind: expected one of log, power, got 'exp'"),
    (dict(depth_scaled_residual=1), r"depth_scaled_residual: expected a bool, got 1"),
    (dict(depth_scaled_residual=True, mtp_depth=1),
     r"depth_scaled_residual: the residual adds of sequential trunk blocks, not with .* \(got mtp_depth=1; MTP: mtp_depth=0, --model.mtp_depth=0\)"),
    (dict(depth_scaled_residual=True, residual_scale=0.5), r"depth_scaled_residual: .* \(got residual_scale=0.5"),
    (dict(expert_bias_on_logits=1), r"expert_bias_on_logits: expected a bool, got 1"),
    (dict(expert_bias_on_logits=True, score="softmax"), r"expert_bias_on_logits: .* needs score='sigmoid' and expert_bias=True \(got score='softmax'"),
    (dict(expert_bias_on_logits=True, expert_bias=False), r"expert_bias_on_logits: .* \(got score='sigmoid', expert_bias=False\)"),
    (dict(norm_weights=False, zero_centered_norms=True), r"norm_weights: False leaves the norms without weights, not with zero_centered_norms"),
    (dict(norm_weights=False, layer_norms=True, norm_bias=True), r"norm_weights: False leaves the norms without weights, not with norm_bias"),
    (dict(norm_weights=False, norm_gate_rank=2), r"norm_weights: False leaves the norms without weights, not with norm_gate_rank"),
    (dict(norm_weights=0), r"norm_weights: expected a bool, got 0"),
    (dict(embed_norm=1), r"embed_norm: expected a bool, got 1"),
    (dict(o_groups=3, o_rank=4), r"o_groups: groups of whole heads, expected a divisor of n_heads = 4, got 3"),
    (dict(o_rank=4), r"o_groups and o_rank: the grouped output projection's groups and rank, give both or neither"),
    (dict(rope_reversed="yes"), r"rope_reversed: expected a bool, got 'yes'"),
    (dict(k=0), r"^k: expected a positive int, got 0$"),
    (dict(mlp_act="xielu", n_dense=4, shortcut_moe=True), r"^mlp_act: 'xielu' \(Apertus's, with learned scalars per MLP\) in dense MLPs only"),
    (dict(mlp_act="relu2", expert_biases=True), r"^expert_biases: mlp_act 'relu2' makes experts without a gate, which take no b_gate"),
    (dict(dense_beside_moe=True, post_norms=True, norm_gate_rank=2), r"^dense_beside_moe: Gemma 4's dense MLP beside the MoE, each with its own norms, not with norm_gate_rank$"),
    (dict(dense_beside_moe=True), r"^dense_beside_moe: the dense MLP and the MoE each have a pre- and a post-norm, needs pre_norms and post_norms$"),
    (dict(layer_scalars=True, hyper_connections=2), r"^layer_scalars: a scale of each block's output stream, not with shortcut_moe or hyper_connections$"),
    (dict(value_scale=0.0), r"^value_scale: expected a positive finite number, got 0.0$"),
    (dict(embed_scale=None), r"^embed_scale: expected a positive finite number, got None$"),
    (dict(window_layers=(1,)), r"^window_layers: needs a window"),
    (dict(chunk_layers=(1,)), r"^chunk_layers: needs a chunk"),
    (dict(nope_temperature_floor=4), r"^nope_temperature_floor: scales the NoPE blocks' queries, needs nope_layers$"),
    (dict(logit_softcap=True), r"^logit_softcap: expected None or a positive finite number, got True$"),
    (dict(nope_layers=(1,), nope_temperature_floor=4, query_temperature_floor=4),
     r"^query_temperature_floor: scales every block's queries, not beside nope_temperature_floor"),
    (dict(local_rope_base=100.0), r"^local_rope_base: the RoPE base of the window's or chunk's blocks, needs a window or a chunk$"),
    (dict(window=3, local_heads=2, local_kv_heads=4), r"^local_kv_heads: 2 heads do not split over 4 kv heads$"),
    (dict(window=3, local_kv_heads=2, q_rank=8, kv_rank=8), r"^local_kv_heads: grouped-query attention's kv heads; multi-latent attention has n_heads$"),
    (dict(window=3, local_rope_base=100.0, local_head_dim=4, v_head_dim=8),
     r"^local_head_dim: grouped-query attention's head dim \(its values' too\), not with kv_rank or v_head_dim$"),
    (dict(window=3, local_head_dim=4), r"^local_head_dim: the local blocks' RoPE tables are their own \(of their head dim\), needs local_rope_base$"),
    (dict(moe_out_norm=True, post_norms=True), r"^moe_out_norm: a norm on the MoE blocks' output, which post_norms already puts on every block's$"),
    (dict(parallel_blocks=True, moe_out_norm=True), r"^parallel_blocks: attention and MLP of one pre-norm's output, needs pre_norms and neither"),
    (dict(abs_position_offset=2), r"^abs_position_offset: the rows of pos_embed before position 0's, needs abs_positions$"),
    (dict(abs_positions=64, mtp_depth=1), r"^abs_positions: learned absolute positions leave every block without RoPE, .* set mtp_depth=0$"),
    (dict(parallel_norms=True), r"^parallel_norms: the MLP's own pre-norm in a parallel block, needs parallel_blocks=True$"),
    (dict(attn_gate_per_head=True), r"^attn_gate_act / attn_gate_per_head: gated attention's gate, needs attn_gate=True$"),
    (dict(value_scale=0.5, q_rank=8, kv_rank=8), r"^value_scale: scales grouped-query attention's values, not multi-latent attention's$"),
    (dict(clip_qkv=8.0, linear_layers=(1,)), r"^clip_qkv: clamps the attention blocks' q, k and v; the linear-attention blocks"),
    (dict(sink_layers=(1,)), r"^sink_layers: the blocks with attention sinks, needs attn_sinks$"),
    (dict(residual_gates="False"), r"^residual_gates: expected a bool, got 'False'$"),
    (dict(out_vocab=41), r"^out_vocab: expected 1..40, got 41$"),
    (dict(out_vocab=30, tie_embeddings=True), r"^out_vocab: an output head of its own rows, not with tie_embeddings"),
    (dict(fp8_layers=(1,)), r"^fp8_layers: the blocks whose GEMMs run in fp8, needs fp8=True$"),
    (dict(shortcut_moe=True, moe_layers=(0, 2), residual_scale=0.5),
     r"^shortcut_moe: a pair of pre-norm blocks, not with parallel_blocks, post_norms, moe_out_norm or residual_scale$"),
    (dict(mla_scales=True, q_rank=8), r"^mla_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank$"),
    (dict(index_loss_coeff=0.0), r"^index_loss_coeff: the weight of a sparse attention's indexer loss, needs index_topk"),
    (dict(index_local_blocks=2), r"^index_local_blocks: a knob of block-sparse attention, needs index_topk_blocks$"),
    (dict(index_topk_blocks=2, alibi=True), r"^alibi: not with block-sparse attention \(index_topk_blocks\)$"),
    (dict(linear_dt_min=0.001), r"^linear_dt_min: the floor of Mamba-2's dt, needs linear_layers and linear_kind='mamba2'$"),
    (dict(linear_layers=(1,), linear_kind="lightning", linear_norm_eps=1e-5),
     r"^linear_norm_eps: the linear-attention blocks' gated output norm's eps, needs linear_layers and a linear_kind with that norm"),
    (dict(linear_layers=(1,), linear_pre_norms=True), r"^linear_pre_norms: .* but every block is pre-norm already \(pre_norms without post_norms\)$"),
    (dict(linear_layers=(1,), attn_sinks=True, sink_layers=(1,)), r"^sink_layers: blocks \[1\] are linear-attention blocks \(linear_layers\), which do not attend$"),
    (dict(chunk=4, rope_proportion=0.5), r"^rope_proportion: proportional RoPE in the blocks without a window or chunk; those with one need"),
    (dict(swiglu_limit_layers=(1,)), r"^swiglu_limit_layers: the blocks that swiglu_limit clamps, needs swiglu_limit$"),
    (dict(mlp_bias=True, shortcut_moe=True, moe_layers=(0, 2)), r"^mlp_bias: biases on the dense blocks' MLPs, not with shortcut_moe \(whose dense MLPs have none\)$"),
    (dict(mlp_bias=True, dense_beside_moe=True, post_norms=True), r"^mlp_bias: biases on the dense blocks' MLPs, not with dense_beside_moe \(whose"),
    (dict(linear_layers=(1,), parallel_hybrid=True, index_topk=2),
     r"^parallel_hybrid: softmax attention beside the linear mixer .* needs linear_layers, not with DeepSeek sparse attention \(index_topk\)$"),
])
def test_released_model_knobs_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**_SMALL, **overrides})


def test_multi_latent_attention_model_builds_its_parameters():
    cfg = TransformerConfig(**{**_SMALL, "n_kv_heads": 4, "head_dim": 12, "rope_dim": 4, "q_rank": 10, "kv_rank": 6, "v_head_dim": 5,
                               "mtp_depth": 1, "mtp_norm": True})
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    assert sorted(attn.names) == ["kv_a_norm", "q_a_norm", "wkv_a", "wkv_b", "wo", "wq_a", "wq_b"]
    assert attn.wkv_b.shape == (6, 4 * (8 + 5)) and attn.wo.shape == (4 * 5, 32)
    assert torch.equal(attn.kv_a_norm, torch.ones(6)) and torch.equal(model.mtp[0].out_norm.weight, torch.ones(32))
    assert model.blocks[0].attn.wq_a.std() > 0.01  # initialised like every matrix
    # the FLOPs count its projections and its q.k (12) / value (5) dims, not GQA's, in the
    # trunk's 4 blocks and the MTP module's block
    from fmoe.train.metrics import model_flops_per_token

    gqa = dataclasses.replace(cfg, q_rank=None, kv_rank=None, v_head_dim=None)
    mats = 32 * 10 + 10 * 48 + 32 * 10 + 6 * 52 + 20 * 32
    blocks = 4 + 1
    want = blocks * (6 * mats + 6 * 4 * (12 + 5) * 3.0 - (6 * (32 * 48 * 3 + 48 * 32) + 12 * 48 * 3.0))
    assert model_flops_per_token(cfg, n_avg_keys=3.0) == pytest.approx(model_flops_per_token(gqa, n_avg_keys=3.0) + want)
    with pytest.raises(ValueError, match="n_kv_heads: multi-latent attention"):
        TransformerConfig(**{**_SMALL, "kv_rank": 6, "v_head_dim": 5, "rope_dim": 4})


def test_deepseek_sparse_attention_trains_its_indexer_by_its_own_loss():
    """Each DSA block's indexer gets index_loss_weight times its loss's gradient (added in the
    backward; the LM loss does not include it), the other weights the LM loss's alone."""
    cfg = VARIANTS["dsa"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = _batch(cfg)
    grads, sums = [], []
    for weight in (1.0, 0.5, 0.0):
        model.zero_grad()
        model.set_index_loss_weight(weight)
        losses, _ = model(batch)
        sums.append(model.index_loss_sum())
        (losses["lm_sum"] + losses["mtp_1_sum"]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    attns = [m for m in model.modules() if isinstance(m, fmoe.model.Attention) and m.cfg.index_loss]
    assert len(attns) == 3 and all(m.index_loss_weight == 0.0 for m in attns)  # blocks 0, 1 and the MTP block (block 2 has no indexer)
    assert not any(".index_" in n for n, _ in model.blocks[2].named_parameters()) and model.blocks[2].attn.index_source == 1
    assert sums[0] == sums[1] == sums[2] == sum(m.index_loss for m in attns) and float(sums[0]) > 0 and not sums[0].requires_grad
    for name in grads[0]:
        if ".index_" in name:
            torch.testing.assert_close(grads[1][name], 0.5 * grads[0][name], rtol=1e-5, atol=0)
            assert float(grads[0][name].abs().max()) > 0 and float(grads[2][name].abs().max()) == 0, name
        else:
            assert torch.equal(grads[0][name], grads[1][name]) and torch.equal(grads[0][name], grads[2][name]), name
    with torch.no_grad():
        model(batch)
    assert model.index_loss_sum() is None  # no gradients: no indexer loss
    assert Transformer(TINY).index_loss_sum() is None
    for bad in (-1, True, float("inf")):
        with pytest.raises(ValueError, match=rf"weight: expected a finite number >= 0, got {bad!r}$"):
            model.set_index_loss_weight(bad)
    with pytest.raises(ValueError, match="index_loss_coeff: expected a finite number >= 0, got nan"):
        dataclasses.replace(cfg, index_loss_coeff=float("nan"))
    with pytest.raises(ValueError, match="index_loss_coeff: the weight of a sparse attention's indexer loss, needs index_topk, index_topk_blocks or csa_layers"):
        dataclasses.replace(TINY, index_loss_coeff=0.5)
    # the FLOPs: multi-latent attention's over the kept keys (2.5 per query here), and per block with an indexer
    # (blocks 0 and 1, and the MTP block's) the indexer's projections (q latent 10 -> 4 heads x 6, H 32 -> a key of
    # 6, H -> 4 head weights) and its scores over every earlier key (8 per query) for the choice; its loss's queries and
    # head weights again (recomputed, and dW), the key's dW, the 3 chosen slots' products (forward, recomputed, backward)
    # and the attention's probabilities over the kept keys (its target; the tests of fmoe.train.metrics count them all)
    from fmoe.train.metrics import model_flops_per_token

    mla = dataclasses.replace(cfg, index_topk=None, index_heads=64, index_head_dim=128, index_shared_layers=None)
    weights, wk = 10 * 4 * 6 + 32 * 6 + 32 * 4, 32 * 6
    loss = 6 * (weights - wk) + 2 * wk + 8 * 4 * 7 * 3 + 2 * cfg.n_heads * cfg.head_dim * 2.5
    want = model_flops_per_token(mla, n_avg_keys=2.5) + 3 * (2 * weights + 2 * 4 * 7 * 8.0 + loss)
    assert model_flops_per_token(cfg, n_avg_keys=8.0, n_avg_index_keys=2.5) == pytest.approx(want)
    with pytest.raises(ValueError, match="n_avg_index_keys: the blocks attend to at most index_topk = 3 keys"):
        model_flops_per_token(cfg, n_avg_keys=8.0)
    with pytest.raises(ValueError, match="index_shared_layers: block 0 reuses the choice of an earlier block with an indexer, and none is before it"):
        dataclasses.replace(cfg, index_shared_layers=(0,))
    with pytest.raises(ValueError, match="index_shared_layers: blocks reusing an earlier block's choice .* needs index_topk"):
        dataclasses.replace(TINY, index_shared_layers=(1,))
    # only block 1's choice stays in the context, for block 2 (a [T, S] mask per block would add up over 61 layers)
    assert [b.attn.index_keep for b in model.blocks] == [False, True, False]
    ctx = model.context(batch)
    with torch.no_grad():
        model(batch, ctx)
    assert list(ctx.attention[0].index_choices) == [1] and ctx.attention[0].index_choices[1].shape == (24, 3)  # slots: 3 keys per query
    # a block whose source block did not run over the context (a pipeline stage without it)
    ctx = model.context(batch)
    with pytest.raises(ValueError, match=r"ctx: block 2 attends to the keys block 1 chose \(index_shared_layers\), which this forward has not run"):
        model.blocks[2](torch.randn(24, cfg.hidden), ctx.attention[0])
    # index_loss_coeff 0: the indexer is not trained (no loss computed, no gradient)
    frozen = Transformer(dataclasses.replace(cfg, index_loss_coeff=0.0))
    frozen(batch)[0]["lm_sum"].backward()
    assert frozen.index_loss_sum() is None and frozen.blocks[0].attn.index_w.grad is None


def test_mimo_attention_knobs_build_what_they_say():
    """v_head_dim without kv_rank: grouped-query attention's values of their own dim;
    local_kv_heads: the window's blocks' kv heads; sink_layers: the blocks with sinks (the
    MTP block without); value_scale: the values scaled (the output changes, and is the
    unscaled model's with wv scaled instead)."""
    cfg = VARIANTS["mimo"]
    model = Transformer(cfg)
    shapes = [(b.attn.wk.shape, b.attn.wv.shape, b.attn.wo.shape, hasattr(b.attn, "sinks")) for b in (*model.blocks, model.mtp[0].block)]
    local, full = ((32, 4 * 8), (32, 4 * 6), (4 * 6, 32), True), ((32, 2 * 8), (32, 2 * 6), (4 * 6, 32), False)
    assert shapes == [local, full, local, full]
    assert [cfg.kv_heads(i) for i in (0, 1, 2, None)] == [4, 2, 4, 2] and [cfg.has_sinks(i) for i in (0, 1, None)] == [True, False, False]
    batch = _batch(cfg)
    torch.manual_seed(1)
    with torch.no_grad():  # weights large enough that the values' scale shows in the loss
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    with torch.no_grad():
        losses, _ = model(batch)
        unscaled = Transformer(dataclasses.replace(cfg, value_scale=1.0))
        unscaled.load_state_dict(model.state_dict())
        other, _ = unscaled(batch)
    assert float(other["lm_sum"]) != pytest.approx(float(losses["lm_sum"]), rel=1e-2)
    with torch.no_grad():
        for b in (*unscaled.blocks, unscaled.mtp[0].block):
            b.attn.wv.mul_(0.7)
        folded, _ = unscaled(batch)
    assert float(folded["lm_sum"]) == pytest.approx(float(losses["lm_sum"]), rel=1e-5)
    for overrides, message in ((dict(local_kv_heads=3, window=4), "local_kv_heads: 4 heads do not split over 3 kv heads"),
                               (dict(local_kv_heads=4), "local_kv_heads: the kv heads of the window's or chunk's blocks, needs a window or a chunk"),
                               (dict(sink_layers=(0,)), "sink_layers: the blocks with attention sinks, needs attn_sinks"),
                               (dict(attn_sinks=True, sink_layers=(3,)), r"sink_layers: expected distinct block indices in 0..2"),
                               (dict(value_scale=0.0), "value_scale: expected a positive finite number"),
                               (dict(v_head_dim=0), "v_head_dim: expected >= 1, got 0"),
                               (dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, value_scale=0.5),
                                "value_scale: scales grouped-query attention's values, not multi-latent attention's"),
                               (dict(clip_qkv=0.0), "clip_qkv: expected None or a finite number > 0, got 0.0"),
                               (dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, clip_qkv=8.0),
                                "clip_qkv: clamps grouped-query attention's q, k and v, not multi-latent attention's"),
                               (dict(clip_qkv=8.0, linear_layers=(0,)), r"clip_qkv: clamps the attention blocks' q, k and v; the linear-attention")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **overrides)


def test_laguna_attention_knobs_build_what_they_say():
    """local_heads: the window's blocks' query heads (wq, wo, the per-head gate's columns);
    local_rope_dim: the channels their own RoPE rotates (block 1's output changes with it,
    block 0's does not); attn_gate_act / attn_gate_per_head: softplus of one gate per head;
    router_softcap: the router's logits (stats and routing) are c tanh(l / c)."""
    cfg = VARIANTS["laguna"]
    model = _sharp(cfg)
    shapes = [(b.attn.wq.shape, b.attn.wo.shape, b.attn.wg.shape) for b in (*model.blocks, model.mtp[0].block)]
    full, local = ((32, 4 * 8), (4 * 8, 32), (32, 4)), ((32, 8 * 8), (8 * 8, 32), (32, 8))
    assert shapes == [full, local, local, full] and [cfg.heads(i) for i in (0, 1, 2, None)] == [4, 8, 8, 4]
    batch = _batch(cfg)
    ctx = model.context(batch)
    x = torch.randn(24, cfg.hidden)
    with torch.no_grad():
        ys = [model.blocks[i].attn(x, ctx.attention[0]) for i in (0, 1)]
        other = Transformer(dataclasses.replace(cfg, local_rope_dim=4))
        other.load_state_dict(model.state_dict())
        octx = other.context(batch)
        assert torch.equal(other.blocks[0].attn(x, octx.attention[0]), ys[0])
        assert not torch.allclose(other.blocks[1].attn(x, octx.attention[0]), ys[1], atol=1e-3)
        # the gate by hand: block 0's heads' outputs, each times softplus of its own gate column
        attn = model.blocks[0].attn
        params = {n: getattr(attn, n) for n in attn.names if n != "wg"}
        plain, _ = fmoe.layers.attention(x, params, dataclasses.replace(attn.cfg, gate_per_head=False), ctx.attention[0])
        out = (plain @ torch.linalg.pinv(attn.wo)).view(24, 4, 8)  # the heads' outputs before wo (wo [32, 32] is invertible)
        want = (out * torch.nn.functional.softplus(x @ attn.wg)[..., None]).reshape(24, 32) @ attn.wo
        assert torch.allclose(ys[0], want, rtol=1e-4, atol=1e-4)
    moe = model.blocks[1].mlp
    h = torch.randn(5, cfg.hidden)
    y, st = moe(h)
    raw = h @ moe.router.t()
    assert torch.allclose(st["router_logits"], 1.5 * torch.tanh(raw / 1.5)) and float(raw.detach().abs().max()) > 1.5
    for overrides, message in ((dict(local_heads=8), "local_heads: the query heads of the window's or chunk's blocks, needs a window or a chunk"),
                               (dict(local_heads=3, window=4), "local_heads: 3 heads do not split over 2 kv heads"),
                               (dict(local_heads=0, window=4), "local_heads: expected >= 1, got 0"),
                               (dict(attn_gate_act="softplus"), "attn_gate_act / attn_gate_per_head: gated attention's gate, needs attn_gate=True"),
                               (dict(attn_gate=True, attn_gate_act="relu"), "gate_act: expected one of sigmoid, softplus, got 'relu'"),
                               (dict(attn_gate=True, attn_gate_per_head=1), "gate_per_head: expected a bool, got 1"),
                               (dict(window=4, local_rope_dim=4), "local_rope_dim: the channels the local layers' own RoPE rotates, needs local_rope_base"),
                               (dict(window=4, local_rope_base=100.0, local_rope_dim=5), r"local_rope_dim: expected an even int in 2..head_dim = 8"),
                               (dict(router_softcap=0.0), "router_softcap: expected None or a positive finite number, got 0.0"),
                               (dict(local_heads=4, local_kv_heads=3, window=4), "local_kv_heads: 4 heads do not split over 3 kv heads")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **overrides)


def test_moe_out_norm_normalises_the_moe_blocks_output_only():
    """moe_out_norm: each MoE block's output (routed plus shared) RMSNormed before its residual
    add: a MoE block's output is the norm of its MLP's; the dense block and the attention
    branches have no such norm; not beside post_norms, which already has one."""
    cfg = VARIANTS["moe out norm"]
    model = Transformer(cfg)
    assert [b.mlp_post_norm is not None for b in (*model.blocks, model.mtp[0].block)] == [False, True, True, True]
    assert all(b.attn_post_norm is None for b in model.blocks)
    block, x = model.blocks[1], torch.randn(24, cfg.hidden)
    with torch.no_grad():
        block.mlp_post_norm.weight.normal_(1.0, 0.3)
        ctx = model.context(_batch(cfg))
        h = x + block.attn(block.attn_norm(x), ctx.attention[0])  # the attention branch, unnormed
        y, _ = block.mlp(block.mlp_norm(h))
        got, _ = block(x, ctx.attention[0])
        torch.testing.assert_close(got, h + block.mlp_post_norm(y))
        assert not torch.allclose(got, h + y, atol=1e-3)
    with pytest.raises(ValueError, match="moe_out_norm: a norm on the MoE blocks' output, which post_norms already puts on every block's"):
        dataclasses.replace(TINY, moe_out_norm=True, post_norms=True)
    with pytest.raises(ValueError, match="moe_out_norm: expected a bool, got 1"):
        dataclasses.replace(TINY, moe_out_norm=1)


def test_cohere_blocks_add_attention_and_mlp_of_one_layernorm():
    """parallel_blocks: x + attn(n(x)) + mlp(n(x)), one norm (no mlp_norm); layer_norms: that
    norm, the final one and the MTP modules' are LayerNorms without bias (torch's, to float
    rounding), the q/k norms RMSNorms still."""
    cfg = VARIANTS["cohere"]
    model = _sharp(cfg)
    block = model.blocks[1]
    assert block.mlp_norm is None and all(b.mlp_norm is None for b in (*model.blocks, model.mtp[0].block))
    assert block.attn_norm.centered and model.norm.centered and model.mtp[0].emb_norm.centered
    x, ctx = torch.randn(24, cfg.hidden), model.context(_batch(cfg))
    with torch.no_grad():
        block.attn_norm.weight.normal_(1.0, 0.3)
        layer_norm = torch.nn.functional.layer_norm(x, (cfg.hidden,), block.attn_norm.weight, None, cfg.norm_eps)
        torch.testing.assert_close(block.attn_norm(x), layer_norm)
        y, _ = block.mlp(layer_norm)
        got, _ = block(x, ctx.attention[0])
        torch.testing.assert_close(got, x + block.attn(layer_norm, ctx.attention[0]) + y)
    # shared_scale: the shared experts' output scaled before it joins the routed one (Cohere 2 MoE's "average": 0.5)
    half = Transformer(dataclasses.replace(cfg, shared_scale=0.5))
    half.load_state_dict(model.state_dict())
    with torch.no_grad():
        whole_y, _ = block.mlp(x)
        half_y, _ = half.blocks[1].mlp(x)
        torch.testing.assert_close(whole_y - half_y, 0.5 * block.mlp.shared(x))
    with pytest.raises(ValueError, match="shared_scale: expected a positive finite number, got 0"):
        dataclasses.replace(TINY, shared_scale=0)
    for overrides, message in ((dict(parallel_blocks=True, post_norms=True), "parallel_blocks: attention and MLP of one pre-norm's output"),
                               (dict(parallel_blocks=True, pre_norms=False), "parallel_blocks: attention and MLP of one pre-norm's output"),
                               (dict(parallel_blocks=True, moe_out_norm=True), "parallel_blocks: attention and MLP of one pre-norm's output"),
                               (dict(layer_norms=1), "layer_norms: expected a bool, got 1")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **overrides)


def test_geglu_models_put_gelu_s_tanh_form_in_every_mlp():
    """mlp_act="gelu_tanh": the dense block's MLP is (gelu_tanh(x w_gate) * (x w_up)) w_down, and
    the MoE block's shared and routed experts use it too (its MoEConfig's glu_act); the same
    weights with silu give other outputs; an unknown activation is refused by name."""
    cfg = dataclasses.replace(TINY, mlp_act="gelu_tanh")
    torch.manual_seed(0)
    model = Transformer(cfg)
    mlp = model.blocks[0].mlp
    x = torch.randn(5, cfg.hidden)
    want = (torch.nn.functional.gelu(x @ mlp.w_gate, approximate="tanh") * (x @ mlp.w_up)) @ mlp.w_down
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
    moe = model.blocks[1].mlp
    assert moe.cfg.glu_act == "gelu_tanh" and moe.shared.act == "gelu_tanh"
    silu = Transformer(dataclasses.replace(cfg, mlp_act="silu"))
    silu.load_state_dict(model.state_dict())
    batch = _batch(cfg)
    with torch.no_grad():
        assert not torch.allclose(model.logits(batch["input_ids"], batch["cu_seqlens"]), silu.logits(batch["input_ids"], batch["cu_seqlens"]))
    with pytest.raises(ValueError, match=r"mlp_act: expected one of silu, gelu_tanh, silu_cap, relu2, xielu, gelu_new, gelu, relu \(the MLPs' gate activation, "
                                         r"or relu2 / xielu / gelu_new / gelu / relu: no gate\), got 'swish'"):
        dataclasses.replace(TINY, mlp_act="swish")


def test_swiglu_limits_clamp_the_listed_blocks_mlps_and_silu_cap_caps_the_activation():
    """Step 3.7's clamps: mlp_act "silu_cap" with swiglu_limit (the routed experts) in the
    blocks swiglu_limit_layers lists and shared_swiglu_limit (the shared experts and the
    dense MLPs) in those shared_swiglu_limit_layers lists: block 0's dense MLP is
    min(silu(x w_gate), Ls) clamp(x w_up, -Ls, Ls) w_down, block 2's MoE carries both
    limits, block 1's the routed one alone, the MTP block's none; the limits change the
    logits; without the lists every block takes them; the knobs' refusals."""
    cfg = dataclasses.replace(TINY, mlp_act="silu_cap", swiglu_limit=0.01, shared_swiglu_limit=0.02, swiglu_limit_layers=(2, 1),
                              shared_swiglu_limit_layers=(0, 2), mtp_depth=1)
    assert cfg.swiglu_limit_layers == (1, 2) and cfg.shared_swiglu_limit_layers == (0, 2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    dense = model.blocks[0].mlp
    assert dense.limit == 0.02 and dense.act == "silu_cap"
    x = 3 * torch.randn(5, cfg.hidden)
    gate, up = x @ dense.w_gate, x @ dense.w_up
    want = (torch.nn.functional.silu(gate).clamp(max=0.02) * up.clamp(-0.02, 0.02)) @ dense.w_down
    assert (torch.nn.functional.silu(gate) > 0.02).any() and (gate < 0.02).any()
    torch.testing.assert_close(dense(x), want, rtol=1e-6, atol=1e-7)
    for i, limits in ((1, (0.01, None)), (2, (0.01, 0.02))):
        moe = model.blocks[i].mlp
        assert (moe.cfg.swiglu_limit, moe.cfg.shared_swiglu_limit, moe.shared.limit) == (*limits, limits[1])
    assert (model.mtp[0].block.mlp.cfg.swiglu_limit, model.mtp[0].block.mlp.shared.limit) == (None, None)
    batch = _batch(cfg)
    plain = Transformer(dataclasses.replace(cfg, mlp_act="silu", swiglu_limit=None, shared_swiglu_limit=None, swiglu_limit_layers=None,
                                            shared_swiglu_limit_layers=None))
    plain.load_state_dict(model.state_dict())
    every = Transformer(dataclasses.replace(cfg, swiglu_limit_layers=None, shared_swiglu_limit_layers=None))
    every.load_state_dict(model.state_dict())
    assert every.mtp[0].block.mlp.cfg.swiglu_limit == 0.01 and every.blocks[1].mlp.shared.limit == 0.02
    with torch.no_grad():
        logits = [m.logits(batch["input_ids"], batch["cu_seqlens"]) for m in (model, plain, every)]
    assert not torch.allclose(logits[0], logits[1]) and not torch.allclose(logits[0], logits[2])
    for overrides, message in (
            (dict(swiglu_limit_layers=(1,)), "swiglu_limit_layers: the blocks that swiglu_limit clamps, needs swiglu_limit"),
            (dict(swiglu_limit=0.1, shared_swiglu_limit_layers=(1,)),
             "shared_swiglu_limit_layers: the blocks that shared_swiglu_limit clamps, needs shared_swiglu_limit"),
            (dict(swiglu_limit=0.1, swiglu_limit_layers=(3,)), r"swiglu_limit_layers: expected distinct block indices in 0..2, got \(3,\)"),
            (dict(shared_swiglu_limit=0.0), r"shared_swiglu_limit: the shared experts' clamp, limit: expected > 0 \(the SwiGLU clamp\) or None, got 0.0"),
            (dict(shared_swiglu_limit=1.0, shared_swiglu_limit_layers=(0,), swiglu_limit=-1.0, swiglu_limit_layers=(2,)),
             r"limit: expected > 0 \(the SwiGLU clamp\) or None, got -1.0"),
            (dict(shared_swiglu_limit=1.0, shared_swiglu_limit_layers=(2,), mlp_act="relu2"),
             "shared_swiglu_limit: the shared experts' clamp, alpha / limit / offset: knobs of a gated MLP's activation, not of act 'relu2'")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **overrides)


def test_parallel_norms_give_a_parallel_block_s_mlp_its_own_norm():
    """parallel_norms (GPT-NeoX's parallel residual): x + attn(n1(x)) + mlp(n2(x)), the MLP's
    pre-norm its own (mlp_norm) in every block, the MTP block's too; with n2's weights n1's
    the model is the one-norm parallel model (Cohere's); with others, not; refused without
    parallel_blocks."""
    cfg = dataclasses.replace(TINY, parallel_blocks=True, parallel_norms=True, layer_norms=True, mtp_depth=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert all(b.mlp_norm is not None for b in (*model.blocks, model.mtp[0].block))
    one = Transformer(dataclasses.replace(cfg, parallel_norms=False))
    assert all(b.mlp_norm is None for b in one.blocks)
    one.load_state_dict({k: v for k, v in model.state_dict().items() if "mlp_norm" not in k})
    batch = _batch(cfg)
    with torch.no_grad():
        for b in (*model.blocks, model.mtp[0].block):
            b.mlp_norm.weight.copy_(b.attn_norm.weight)
        same = model.logits(batch["input_ids"], batch["cu_seqlens"])
        torch.testing.assert_close(same, one.logits(batch["input_ids"], batch["cu_seqlens"]), rtol=0, atol=0)
        model.blocks[1].mlp_norm.weight.mul_(1.5)
        assert not torch.allclose(model.logits(batch["input_ids"], batch["cu_seqlens"]), same)
    with pytest.raises(ValueError, match="parallel_norms: the MLP's own pre-norm in a parallel block, needs parallel_blocks=True"):
        dataclasses.replace(TINY, parallel_norms=True)


def test_abs_positions_add_learned_position_embeddings_in_place_of_rope():
    """abs_positions P (GPT-Neo's, OPT's wpe): pos_embed [P, H] rows of each token's position in
    its document added to its embedding, every block without RoPE. With pos_embed zero the
    model is the NoPE model of the same weights; its rows move the logits; a document's logits
    do not depend on its packing; positions past P are refused by name in logits and decode,
    and stop the training forward by an assert on the device (no host read); pos_embed goes
    to AdamW; MTP modules are refused. abs_position_offset: the rows before position 0's."""
    from fmoe.optim import split_param_groups

    cfg = dataclasses.replace(TINY, abs_positions=16)
    assert all(cfg.is_nope(i) for i in range(cfg.n_layers))
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert model.pos_embed.shape == (16, cfg.hidden) and float(model.pos_embed.detach().std()) > 0
    nope = Transformer(dataclasses.replace(cfg, abs_positions=None, nope_layers=(0, 1, 2)))
    nope.load_state_dict({k: v for k, v in model.state_dict().items() if k != "pos_embed"})
    ids, cu = torch.randint(0, cfg.vocab_size, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        with_rows = model.logits(ids, cu)
        model.pos_embed.zero_()
        torch.testing.assert_close(model.logits(ids, cu), nope.logits(ids, cu), rtol=0, atol=0)
        model.pos_embed.normal_(0, 0.5)
        assert not torch.allclose(model.logits(ids, cu), with_rows)
        alone = model.logits(ids[5:], torch.tensor([0, 7], dtype=torch.int32))
        torch.testing.assert_close(model.logits(ids, cu)[5:], alone, rtol=1e-5, atol=1e-5)  # positions restart at each document
        with pytest.raises(ValueError, match=r"positions: up to 19, past the 16 learned positions \(abs_positions\)"):
            model.logits(torch.randint(0, cfg.vocab_size, (20,)), torch.tensor([0, 20], dtype=torch.int32))
        cache, longer = model.kv_cache(24), torch.randint(0, cfg.vocab_size, (16,))
        model.decode(longer[:10], cache)
        model.decode(longer[10:], cache)  # positions 10 .. 15: the last ones there are
        with pytest.raises(ValueError, match=r"positions: up to 16, past the 16 learned positions"):
            model.decode(longer[:1], cache)
    with pytest.raises(RuntimeError, match=r"positions past the 16 learned positions \(abs_positions\)"):  # no host read there
        batch = _batch(cfg, T=20, cu=(0, 20))
        model(batch, model.context(batch))
    _, adamw = split_param_groups(model)
    assert any(p is model.pos_embed for g in adamw for p in g["params"])
    with pytest.raises(ValueError, match="abs_positions: learned absolute positions leave every block without RoPE"):
        dataclasses.replace(TINY, abs_positions=16, mtp_depth=1)
    with pytest.raises(ValueError, match="abs_positions: expected >= 1, got 0"):
        dataclasses.replace(TINY, abs_positions=0)
    # abs_position_offset (OPT's 2): the table's rows before position 0's; position p reads row p + 2
    shifted = Transformer(dataclasses.replace(cfg, abs_position_offset=2))
    assert shifted.pos_embed.shape == (18, cfg.hidden)
    with torch.no_grad():
        shifted.load_state_dict({k: torch.cat([torch.randn(2, cfg.hidden), v]) if k == "pos_embed" else v for k, v in model.state_dict().items()})
        torch.testing.assert_close(shifted.logits(ids, cu), model.logits(ids, cu), rtol=0, atol=0)
        # positions given to logits: their rows (a table of 2 rows more in front, read at each position + 2, gives the same logits)
        wider = Transformer(dataclasses.replace(cfg, abs_positions=18))
        wider.load_state_dict(shifted.state_dict())
        torch.testing.assert_close(wider.logits(ids, cu, fmoe.ops.positions_from_cu_seqlens(cu) + 2), model.logits(ids, cu), rtol=0, atol=0)
    with pytest.raises(ValueError, match="abs_position_offset: the rows of pos_embed before position 0's, needs abs_positions"):
        dataclasses.replace(TINY, abs_position_offset=2)


def test_alibi_biases_every_block_s_scores_in_place_of_rope():
    """alibi (BLOOM's, MPT's, Falcon-RW's): every block NoPE, each head's slope (alibi_slopes of
    the block's heads, constants: no parameter, nothing in the state dict) biasing its scores,
    times the softmax scale with alibi_scaled (Falcon's; against transformers:
    tests/test_hf.py). A document's logits do not depend on its packing; the knobs'
    neighbours are refused by name."""
    cfg = dataclasses.replace(TINY, alibi=True)
    assert all(cfg.is_nope(i) for i in range(cfg.n_layers))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    nope = Transformer(dataclasses.replace(cfg, alibi=False, nope_layers=(0, 1, 2))).eval()
    assert set(model.state_dict()) == set(nope.state_dict())  # the slopes are not weights
    nope.load_state_dict(model.state_dict())
    ids, cu = torch.randint(0, cfg.vocab_size, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        logits = model.logits(ids, cu)
        assert float((logits - nope.logits(ids, cu)).abs().max()) > 1e-3
        torch.testing.assert_close(model.logits(ids[5:], torch.tensor([0, 7], dtype=torch.int32)), logits[5:], rtol=1e-5, atol=1e-5)
        scaled = Transformer(dataclasses.replace(cfg, alibi_scaled=True)).eval()
        scaled.load_state_dict(model.state_dict())
        assert scaled.blocks[0].attn.alibi_scale == 8 ** -0.5 and model.blocks[0].attn.alibi_scale == 1.0
        assert float((scaled.logits(ids, cu) - logits).abs().max()) > 1e-3
    for knobs, message in ((dict(mtp_depth=1), r"not with mtp_depth = 1 \(MTP modules, which rotate\)"),
                           (dict(abs_positions=16), "not with abs_positions = 16"), (dict(nope_layers=(1,)), r"not with nope_layers = \(1,\)"),
                           (dict(n_kv_heads=4, head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5), "not with kv_rank = 6"),
                           # compressed entries have no distance to a query: every forward failed on params['alibi']
                           (dict(kv_shared=True, n_kv_heads=1, compress_layers=(1,)), r"not with compress_layers = \(1,\) \(compressed entries"),
                           (dict(kv_shared=True, n_kv_heads=1, q_rank=12, csa_layers=(1,), csa_rate=2, csa_topk=2, index_heads=2, index_head_dim=8),
                            r"not with csa_layers = \(1,\) \(compressed entries")):
        with pytest.raises(ValueError, match=f"alibi: ALiBi's biases on grouped-query attention in place of RoPE, {message}"):
            dataclasses.replace(cfg, **knobs)
    with pytest.raises(ValueError, match="alibi_scaled: ALiBi's bias times the softmax scale, needs alibi=True"):
        dataclasses.replace(TINY, alibi_scaled=True)
    with pytest.raises(ValueError, match="alibi: expected a bool, got 1"):
        dataclasses.replace(TINY, alibi=1)


@pytest.mark.parametrize("act", ["relu2", "gelu_new", "gelu", "relu"])
def test_models_without_a_gate_have_no_w_gate_anywhere(act):
    """mlp_act="relu2" (Arcee's): every MLP is relu(x w_up)^2 w_down, without w_gate (the MTP
    block's too); in MoE blocks (Nemotron 3's) the routed and the shared experts too, each
    routed row relu(x w_up[e])^2 w_down[e] times its weight; refused with expert biases (no
    b_gate); dense_mlp refuses a gate given with it. mlp_act="gelu_new" (Phi-2's) and "gelu"
    (GPT-NeoX's): the same with GELU's tanh and exact forms in place of relu^2."""
    from fmoe.layers import dense_mlp

    def plain(h):
        if act in ("relu2", "relu"):
            return torch.relu(h).square() if act == "relu2" else torch.relu(h)
        return torch.nn.functional.gelu(h, approximate="tanh" if act == "gelu_new" else "none")

    cfg = dataclasses.replace(TINY, mlp_act=act, n_dense=3, mtp_depth=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert all(b.mlp.w_gate is None for b in model.blocks) and model.mtp[0].block.mlp.w_gate is None
    assert not any(name.endswith("w_gate") for name, _ in model.named_parameters())
    mlp = model.blocks[0].mlp
    x = torch.randn(5, cfg.hidden)
    torch.testing.assert_close(mlp(x), plain(x @ mlp.w_up) @ mlp.w_down, rtol=1e-6, atol=1e-6)
    batch = _batch(cfg)
    losses, _ = model(batch, model.context(batch))
    sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    assert mlp.w_up.grad.abs().sum() > 0 and model.mtp[0].block.mlp.w_down.grad.abs().sum() > 0
    moe_cfg = dataclasses.replace(TINY, mlp_act=act, mtp_depth=1)
    model = Transformer(moe_cfg)
    moe = model.blocks[1].mlp
    assert moe.experts.w_gate is None and moe.shared.w_gate is None and model.mtp[0].block.mlp.experts.w_gate is None
    assert not any(name.endswith("w_gate") for name, _ in model.named_parameters())
    routes = fmoe.ops.route(x.float() @ moe.router.T, moe_cfg.k, score=moe_cfg.score, expert_bias=moe.expert_bias)
    y, _ = moe.experts(x, routes)
    want = sum(routes.weights[:, j, None] * torch.stack([plain(x[t] @ moe.experts.w_up[e]) @ moe.experts.w_down[e]
                                                         for t, e in enumerate(routes.experts[:, j].tolist())]) for j in range(moe_cfg.k))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    batch = _batch(moe_cfg)
    losses, _ = model(batch, model.context(batch))
    sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    assert moe.experts.w_up.grad.abs().sum() > 0 and moe.shared.w_down.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=rf"expert_biases: mlp_act '{act}' makes experts without a gate, which take no b_gate"):
        dataclasses.replace(TINY, mlp_act=act, expert_biases=True)
    mlp = Transformer(dataclasses.replace(TINY, mlp_act=act, n_dense=3)).blocks[0].mlp
    with pytest.raises(ValueError, match=rf"w_gate: act '{act}' is an MLP without a gate, expected None"):
        dense_mlp(x, mlp.w_up, mlp.w_up, mlp.w_down, act=act)


@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_mlp_biases_are_added_to_the_dense_blocks_projections(act):
    """mlp_bias (Llama's, Jais 2's): each dense block's MLP (and the MTP block's) adds b_gate,
    b_up and b_down to its projections' outputs (no b_gate without a gate); the MoE blocks'
    shared experts have none; every bias learns. dense_mlp checks their shapes; the knob is
    refused beside the dense MLPs that take no bias."""
    from fmoe.layers import dense_mlp

    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, mlp_act=act, mlp_bias=True, mtp_depth=1, n_dense=1, moe_layers=None)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".b_" in name:
                p.normal_()
    mlp = model.blocks[0].mlp
    assert (mlp.b_gate is None) == (act == "relu2") and Transformer(VARIANTS["jais2"]).mtp[0].block.mlp.b_down is not None  # a dense MTP block's
    assert model.blocks[1].mlp.shared.b_down is None and not any(".b_" in n for n, _ in model.blocks[1].named_parameters())
    x = torch.randn(5, 32)
    with torch.no_grad():
        up = x @ mlp.w_up + mlp.b_up
        h = torch.relu(up).square() if act == "relu2" else torch.nn.functional.silu(x @ mlp.w_gate + mlp.b_gate) * up
        torch.testing.assert_close(mlp(x), h @ mlp.w_down + mlp.b_down)
    batch = _batch(cfg)
    losses, _ = model(batch, model.context(batch))
    sum(losses[key] for key in losses.keys() if key.endswith("_sum")).backward()
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".b_" in n)
    with pytest.raises(ValueError, match=r"b_down: expected None or a tensor \[32\], got \[5\]"):
        dense_mlp(x, mlp.w_gate, mlp.w_up, mlp.w_down, act=mlp.act, b_down=torch.zeros(5))
    if act == "relu2":
        with pytest.raises(ValueError, match=r"b_gate: act 'relu2' is an MLP without a gate, expected None"):
            dense_mlp(x, None, mlp.w_up, mlp.w_down, act="relu2", b_gate=torch.zeros(48))
    for knobs, message in ((dict(shortcut_moe=True, n_layers=4, n_dense=0), "mlp_bias: biases on the dense blocks' MLPs, not with shortcut_moe"),
                           (dict(dense_beside_moe=True, post_norms=True), "not with dense_beside_moe"), (dict(), "mlp_bias: expected a bool")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, mlp_bias=1 if not knobs else True, **knobs)


def test_xielu_mlps_learn_their_scalars_in_dense_blocks_only():
    """mlp_act="xielu" (Apertus's): each dense MLP xielu(x w_up, alpha_p, alpha_n) w_down, its two
    scalars starting at transformers' a_p = 0.8, a_n = beta + 0.3 and trained; MoE blocks are
    refused by name (tensor parallelism: tests/parallel, tp2-apertus)."""
    from fmoe.ops.experts import xielu

    torch.manual_seed(0)
    model = Transformer(VARIANTS["apertus"])
    mlp = model.blocks[1].mlp
    assert float(torch.nn.functional.softplus(mlp.xielu_alpha_p.detach())) == pytest.approx(0.8)
    assert float(0.5 + torch.nn.functional.softplus(mlp.xielu_alpha_n.detach())) == pytest.approx(0.8)
    x = torch.randn(5, 32)
    torch.testing.assert_close(mlp(x), xielu(x @ mlp.w_up, mlp.xielu_alpha_p, mlp.xielu_alpha_n) @ mlp.w_down)
    batch = _batch(model.cfg)
    losses, _ = model(batch, model.context(batch))
    losses["lm_sum"].backward()
    assert mlp.xielu_alpha_p.grad.abs().sum() > 0 and mlp.xielu_alpha_n.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="mlp_act: 'xielu' .* in dense MLPs only"):
        dataclasses.replace(TINY, mlp_act="xielu")
    # MoEConfig refuses xIELU experts; a model of dense blocks builds none, and its MoE knobs are checked all the same
    for kw, said in ((dict(shared_swiglu_limit=1.0), "shared_swiglu_limit: the shared experts' clamp, alpha / limit / offset: knobs of a "
                                                     "gated MLP's activation, not of act 'xielu'"),
                     (dict(score="bogus"), "score: expected one of softmax")):
        with pytest.raises(ValueError, match=re.escape(said)):
            dataclasses.replace(VARIANTS["apertus"], **kw)


def test_released_model_knobs_build_what_they_say():
    cfg = TransformerConfig(**{**_SMALL, "moe_layers": (3, 1), "shared_ffn": 24, "shared_gate": True, "qkv_bias": True,
                               "qk_norm": "head", "tie_embeddings": True, "score": "softmax", "expert_bias": False, "pre_softmax": True})
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert cfg.moe_layers == (1, 3) and list(model.moe_layers()) == ["layer_1", "layer_3"]
    assert model.blocks[1].mlp.shared.w_gate.shape[1] == 24 and model.blocks[1].mlp.shared_gate.shape == (cfg.hidden,)
    attn = model.blocks[0].attn
    assert torch.equal(attn.bq, torch.zeros_like(attn.bq)) and torch.equal(attn.q_norm, torch.ones(cfg.head_dim))
    assert model.head is None and model.output_weight() is model.embed
    batch = make_batch(torch.randint(0, cfg.vocab_size, (24,)), torch.tensor([0, 10, 24]))
    losses, _ = model(batch)
    losses["lm_sum"].backward()
    assert model.embed.grad.abs().sum() > 0 and attn.bq.grad.abs().sum() > 0 and attn.q_norm.grad.abs().sum() > 0
    # logits: the trunk's, over packed documents; the loss is their cross-entropy
    logits = model.logits(batch["input_ids"], batch["cu_seqlens"])
    want = torch.nn.functional.cross_entropy(logits[batch["loss_mask"].bool()], batch["labels"][batch["loss_mask"].bool()], reduction="sum")
    assert float(losses["lm_sum"].detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    with pytest.raises(ValueError, match="cu_seqlens: expected 0, ..., T = 24"):
        model.logits(batch["input_ids"], torch.tensor([0, 23]))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected 0, ..., T = 24 .*got \[0.0, 4.69\d*, 24.0\]"):  # 4.7 was cut to 4
        model.logits(batch["input_ids"], torch.tensor([0.0, 4.7, 24.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected 0, ..., T = 24 .*got \[\]"):  # empty: not an IndexError
        model.logits(batch["input_ids"], torch.tensor([], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected 0, ..., T = 24 for input_ids \[T\], got \[4, 24\]"):
        model.logits(batch["input_ids"], torch.tensor([4, 24]))
    for part in ("pipeline_chunk", "context_parallel"):
        setattr(model, part, "set")
        with pytest.raises(ValueError, match=r"model: logits needs the whole model on one process \(not a pipeline chunk, not context parallel\)"):
            model.logits(batch["input_ids"], batch["cu_seqlens"])
        setattr(model, part, None)
    for bad, got in ((torch.arange(23), r"\[23\]"), (torch.arange(24).view(4, 6), r"\[4, 6\]"), ([0] * 24, "list")):
        with pytest.raises(ValueError, match=rf"positions: expected \[T\] = \[24\], one per token of input_ids, got {got}"):
            model.logits(batch["input_ids"], batch["cu_seqlens"], bad)
    torch.testing.assert_close(model.logits(batch["input_ids"], [0, 24]), model.logits(batch["input_ids"], torch.tensor([0, 24])))  # a list
    # the token ids themselves, named as input_ids (not an IndexError inside the embedding)
    ids = batch["input_ids"]
    for bad, message in ((ids.float(), r"\[T\] int64 token ids .* got torch.float32 \[24\]"), (ids.view(4, 6), r"\[T\] int64 .* got torch.int64 \[4, 6\]"),
                         (torch.where(ids == ids[3], cfg.vocab_size, ids), rf"ids in 0..{cfg.vocab_size - 1} \(vocab_size\), got \d+..{cfg.vocab_size}"),
                         (ids - ids.max() - 1, rf"ids in 0..{cfg.vocab_size - 1} \(vocab_size\), got -")):
        with pytest.raises(ValueError, match="input_ids: expected " + message):
            model.logits(bad, batch["cu_seqlens"])


DECODED = {
    "default": TINY,
    "nanochat": dataclasses.replace(VARIANTS["nanochat"], mtp_depth=0),
    "yarn, softmax, tied head": dataclasses.replace(TINY, yarn_factor=4.0, yarn_original_max_positions=8, score="softmax", expert_bias=False,
                                                    tie_embeddings=True),
    "qkv bias, qk norm": dataclasses.replace(TINY, qkv_bias=True, qk_norm="head", rope_dim=4),
    "mla": VARIANTS["mla, group top-2, mtp norm"],
    "dsa": dataclasses.replace(VARIANTS["dsa"], mtp_depth=0),
    # ...on the sparse kernel (CUDA's "auto"; the interpreter here): each query over its chosen rows of the cache
    "dsa, sparse kernel": dataclasses.replace(VARIANTS["dsa"], mtp_depth=0, impl="triton"),
    "sliding window": dataclasses.replace(TINY, window=4, window_layers=(0, 2)),
    "nope global, window local, llama3 rope": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 2), nope_layers=(1,),
                                                                  llama3_factor=4.0, llama3_original_max_positions=16),
    "gpt-oss": VARIANTS["gpt-oss"],
    "step3p7": dataclasses.replace(VARIANTS["step3p7"], mtp_depth=0),
    "gpt-neo": VARIANTS["gpt-neo"],
    "muse spark": dataclasses.replace(VARIANTS["muse spark"], mtp_depth=0),
    # ALiBi's distances over the rings of the window's blocks and the full block's rows; Falcon-RW's scaled bias over 6 heads
    "alibi": VARIANTS["alibi"],
    # MiniMax-M3's: block-sparse attention in blocks 1 and 2, the indexer's keys cached beside the kv heads' (4 channels each)
    "minimax-m3": dataclasses.replace(MINIMAX_M3, mtp_depth=0),
    # ...on the sparse kernel (the interpreter here; CUDA's "auto"): each query over the cache's rows of its chosen blocks
    "minimax-m3, sparse kernel": dataclasses.replace(MINIMAX_M3, mtp_depth=0, impl="triton"),
    "alibi, scaled, six heads": dataclasses.replace(TINY, alibi=True, alibi_scaled=True, n_heads=6),
    "post-norm": VARIANTS["post-norm"],
    "llama4": dataclasses.replace(VARIANTS["llama4"], mtp_depth=0, llama3_factor=4.0, llama3_original_max_positions=16),
    "mla, sinks, output bias, gate": dataclasses.replace(VARIANTS["mla, group top-2, mtp norm"], attn_sinks=True, o_bias=True, attn_gate=True),
    "afmoe": dataclasses.replace(VARIANTS["afmoe"], mtp_depth=0),
    # A.X-K2's: the gate over the q latent, on the cache's absorbed latents
    "axk2": dataclasses.replace(VARIANTS["axk2"], mtp_depth=0),
    # Beam's: the power-law query scale of the NoPE block by each decoded position, the gate's bias, the capped logits
    "beam": VARIANTS["beam"],
    "gemma3": VARIANTS["gemma3"],
    "gemma4": dataclasses.replace(VARIANTS["gemma4"], mtp_depth=0),
    # Gemma 2's: every attention score capped, over the window's blocks and the full one
    "gemma2": dataclasses.replace(TINY, mlp_act="gelu_tanh", post_norms=True, zero_centered_norms=True, attn_softcap=0.5, window=4,
                                  window_layers=(0, 2), logit_softcap=3.0),
    # ...with a window as long as the cache: its local blocks' heads of 6 in the full layers' store of 8
    "gemma4, one store": dataclasses.replace(VARIANTS["gemma4"], mtp_depth=0, window=16),
    # DBRX's: q, k and v clamped (the cached keys and values are the clamped ones)
    "dbrx": dataclasses.replace(VARIANTS["dbrx"], mtp_depth=0),
    # Mellum's: the window's blocks (rings) with their own plain RoPE base beside full blocks with Llama 3.1's scaling
    "local rope base": dataclasses.replace(TINY, qk_norm="head", window=4, window_layers=(0, 2), local_rope_base=100.0, rope_base=5e5,
                                           llama3_factor=4.0, llama3_original_max_positions=16),
    # Qwen3-Next's: Gated DeltaNet blocks 0 and 1 (their conv and delta-rule states) beside a gated-attention block
    "gated deltanet": dataclasses.replace(VARIANTS["gated deltanet"], mtp_depth=0),
    # Granite 4.0-H's: Mamba-2's conv and SSD states beside a NoPE block
    "granite4": dataclasses.replace(VARIANTS["granite4"], mtp_depth=0),
    # Falcon-H1's: Mamba-2's states and the attention's keys and values in the same blocks; with its output norm before the
    # gate and a window on blocks 0 and 2 (rings beside the full store)
    "falcon_h1": dataclasses.replace(VARIANTS["falcon_h1"], mtp_depth=0),
    "falcon_h1, norm before gate, window": dataclasses.replace(VARIANTS["falcon_h1"], mtp_depth=0, linear_gate_norm="before", window=4,
                                                               window_layers=(0, 2)),
    # MiniMax's: lightning attention's states (no convolution) beside a softmax block
    "minimax": dataclasses.replace(VARIANTS["minimax"], mtp_depth=0),
    # Nemotron-H's: a Mamba-2 block without an MLP among them; Nemotron 3's: MoE blocks of experts without a gate
    "nemotron_h": dataclasses.replace(VARIANTS["nemotron_h"], mtp_depth=0),
    "nemotron 3": dataclasses.replace(VARIANTS["nemotron 3"], mtp_depth=0),
    "nemotron 3 super": dataclasses.replace(VARIANTS["nemotron 3 super"], mtp_depth=0),
    "nemotron_h 47b": dataclasses.replace(VARIANTS["nemotron_h 47b"], mtp_depth=0, window=None),
    # Mamba-2's: no attention layer, so no keys and values cached, the states alone
    "mamba2": dataclasses.replace(VARIANTS["mamba2"], mtp_depth=0),
    # OLMo Hybrid's: pre-norm Gated DeltaNet blocks (beta in [0, 2]) beside a post-norm attention block
    "olmo hybrid": dataclasses.replace(VARIANTS["olmo hybrid"], mtp_depth=0),
    # Jamba's: Mamba-1's states (a decay per channel and state channel) beside a NoPE block; Falcon Mamba's, the states alone
    "jamba": dataclasses.replace(VARIANTS["jamba"], mtp_depth=0),
    "falcon mamba": dataclasses.replace(VARIANTS["falcon mamba"], mtp_depth=0),
    # Kimi Linear's: Kimi Delta Attention blocks (a decay per key channel in the states) beside an MLA block without RoPE
    "kimi linear": dataclasses.replace(VARIANTS["kimi linear"], mtp_depth=0),
    # MiMo-V2-Flash's: the window's blocks (rings) with twice the kv heads, values of their own dim; and with a window
    # wider than the cache, all three blocks in one store, of the most heads
    "mimo": dataclasses.replace(VARIANTS["mimo"], mtp_depth=0),
    # LFM2's: the short convolutions' last 2 gated inputs carried from the prompt through every step
    "lfm2": dataclasses.replace(VARIANTS["lfm2"], mtp_depth=0),
    "mimo, wide window": dataclasses.replace(VARIANTS["mimo"], mtp_depth=0, window=40),
    # Laguna's: the window's blocks with more query heads and their own RoPE (base and channels), a gate per head
    "laguna": dataclasses.replace(VARIANTS["laguna"], mtp_depth=0, window_layers=(0, 2)),
    # Cohere's: parallel blocks of one LayerNorm, the window's blocks with RoPE, the global one NoPE
    "cohere": dataclasses.replace(VARIANTS["cohere"], mtp_depth=0),
    # Phi-3.5-MoE's: SparseMixer's top-2, LayerNorms with biases, a head bias, LongRoPE (the long factors throughout)
    "phimoe": dataclasses.replace(VARIANTS["phimoe"], mtp_depth=0),
    # LongCat-Flash's zero-computation experts (without the capacity, which a step of one token would change)
    "zero experts": dataclasses.replace(VARIANTS["zero experts"], mtp_depth=0, capacity_factor=None),
    # Ling's: the bounded decay's states carried from the prompt through every step
    "ling": dataclasses.replace(VARIANTS["ling"], mtp_depth=0),
    # LongCat-Flash's: shortcut pairs (the [T, 2H] stream between a pair's blocks), scaled latents in the cache
    "longcat": dataclasses.replace(VARIANTS["longcat"], mtp_depth=0),
    # hyper-connections: the [T, n H] streams through the cache's steps, collapsed before the head
    "mhc": VARIANTS["mhc"],
    "hy_v4": VARIANTS["hy_v4"],
    # ...on the sparse kernel (the interpreter here; CUDA's "auto"): its sinks on the kernel's output, sigmoid(lse - sink)
    "hy_v4, sparse kernel": dataclasses.replace(VARIANTS["hy_v4"], impl="triton"),
    # Phi-3's LongRoPE past 1 original position: every prompt here is longer, every call has the long factors (a
    # sequence crossing the original positions: test_decode_past_longrope_s_original_positions_recomputes_the_sequence)
    "longrope": dataclasses.replace(TINY, rope_dim=4, longrope_short_factors=(1.0, 1.5), longrope_long_factors=(3.0, 9.0),
                                    longrope_original_max_positions=1, longrope_short_scale=1.1, longrope_long_scale=1.3),
    # a mixture of attention heads: each new token's queries from its own experts, over the cache's shared kv heads
    "jetmoe": dataclasses.replace(VARIANTS["jetmoe"], mtp_depth=0),
    # a hashed MoE block: each new token routed by its own id; the grouped output projection; shared key-value heads (the
    # cache's values the rotated keys, each new token's output turned back at its position)
    "dsv4": dataclasses.replace(VARIANTS["dsv4"], mtp_depth=0),
}


def _sharp(cfg):
    """A model with weights large enough that attention tells positions and keys apart."""
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


def test_decode_past_longrope_s_original_positions_recomputes_the_sequence():
    """LongRoPE switching past 6 positions: each call's logits are those of the whole
    sequence so far (the short factors up to 6 tokens, the long ones past), the call that
    crosses recomputing its sequence from the cached token ids; in a batched step one
    sequence crosses while the other continues."""
    model = _sharp(dataclasses.replace(DECODED["longrope"], longrope_original_max_positions=6))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))

    def whole(b, n):  # the logits of sequence b's first n tokens, as one forward
        with torch.no_grad():
            return model.logits(ids[b, :n], torch.tensor([0, n], dtype=torch.int32))

    cache = model.kv_cache(16)
    assert cache.tokens.shape == (1, 16)
    for a, b in [(0, 4), (4, 6), (6, 7), (7, 10), (10, 11)]:  # (4, 6) ends at 6 (short), (6, 7) crosses
        torch.testing.assert_close(model.decode(ids[0, a:b], cache), whole(0, b)[a:b], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.tokens[0, :11], ids[0, :11])
    # the switch matters here: the short factors' keys kept past the crossing would give other logits
    assert float((whole(0, 7)[:6] - whole(0, 6)).abs().max()) > 0.1
    batched = model.kv_cache(16, batch=2)
    model.decode(ids[0, :6], batched, seqs=0)
    model.decode(ids[1, :3], batched, seqs=1)
    got = model.decode(torch.stack([ids[0, 6:7], ids[1, 3:4]]), batched, seqs=[0, 1])  # sequence 0 crosses, 1 does not
    torch.testing.assert_close(got[0], whole(0, 7)[6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], whole(1, 4)[3:], rtol=1e-5, atol=1e-5)
    assert batched.lengths == [7, 4] and batched.decoded_lengths == [7, 4]
    # a model without LongRoPE's switch keeps no token ids; a cache without them is refused by one that needs them
    assert model.kv_cache(16).nbytes == Transformer(TINY).kv_cache(16).nbytes + 16 * 8
    assert Transformer(TINY).kv_cache(16).tokens is None
    with pytest.raises(ValueError, match="cache: made without the token ids"):
        model.decode(ids[0, :2], KVCache(TINY, 16))


def test_decode_rewound_from_past_longrope_s_original_positions_recomputes_the_sequence():
    """A sequence decoded past LongRoPE's 6 original positions, then rewound (cache.length
    set lower) to within them: its cached keys have the long factors' rotation, so the next
    call that stays within 6 recomputes it with the short ones; a call that goes past 6
    again, or a rewind that never crossed, matches the whole sequence's logits too."""
    model = _sharp(dataclasses.replace(DECODED["longrope"], longrope_original_max_positions=6))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))

    def whole(seq):
        with torch.no_grad():
            return model.logits(seq, torch.tensor([0, len(seq)], dtype=torch.int32))

    for length, new in [(3, 2), (3, 3), (3, 4), (6, 1), (8, 1)]:  # back to 3 then up to 5, 6 or 7; back to 6 then 7; 8 stays long
        cache = model.kv_cache(16)
        model.decode(ids[0, :10], cache)  # past the 6 original positions: the long factors
        cache.length = length
        seq = torch.cat([ids[0, :length], ids[1, :new]])
        torch.testing.assert_close(model.decode(ids[1, :new], cache), whole(seq)[length:], rtol=1e-5, atol=1e-5)
        assert cache.length == cache.decoded_lengths[0] == length + new
    # the rewind matters: the long factors' keys kept for a 5-token sequence would give other logits
    assert float((whole(ids[0, :7])[:5] - whole(ids[0, :5])).abs().max()) > 0.1
    cache = model.kv_cache(16)  # a rewind within the short factors continues from the cache
    model.decode(ids[0, :5], cache)
    cache.length = 3
    torch.testing.assert_close(model.decode(ids[1, :2], cache), whole(torch.cat([ids[0, :3], ids[1, :2]]))[3:], rtol=1e-5, atol=1e-5)


# Ling's bounded decay reaches e^-5 a step with these sharp weights: the chunked rule (the whole sequence) and the
# stepwise one (decoding) round apart by up to 3e-5 in a logit (their float64 loop: test_linear_attention). Mamba-2's
# three mixers in a row, with nothing else between them: the whole sequence in chunks of 4 instead of 64 already moves a
# logit (of up to 5.3) by 1.5e-5, decoding by 3.1e-5. OLMo Hybrid's write strength up to 2 lets the state's transition
# reach the eigenvalue -1, which keeps rounding instead of decaying it: the whole 11-token sequence in chunks of 2
# instead of 64 moves a logit (of up to 5.2) by 2.0e-5, batched decoding by 1.4e-5
# GPT-Neo's softmax scale of 1 (no 1 / sqrt(head_dim)) sharpens _sharp's attention: a batched decode's other order of sums
# moves a logit by 1.2e-5
# Nemotron-H 47B's Mamba-2 layers, like mamba2's: a logit 1.12e-5 off the whole sequence's with 2 threads (pytest alone on
# 2 cores), 1.16e-5 with 1 in a script, within 1e-5 under make test's one thread per worker
DECODE_TOL = {"ling": 5e-5, "mamba2": 5e-5, "nemotron_h 47b": 5e-5, "olmo hybrid": 5e-5, "falcon mamba": 5e-5, "gpt-neo": 5e-5}


@pytest.mark.parametrize("name", list(DECODED))
def test_decode_with_a_kv_cache_equals_the_whole_sequence(name, monkeypatch):
    """A prompt, then tokens one and a few at a time, through the cache: the logits of each
    call are the rows of the whole sequence's logits, and the cache holds every token.
    Multi-latent attention: single tokens in the absorbed form, several with the cached
    latents expanded per head."""
    forms = []
    for fn in ("_mla_latent_qkv", "_mla_expand"):
        original = getattr(fmoe.layers, fn)
        monkeypatch.setattr(fmoe.layers, fn, lambda *a, _f=original, _n=fn: forms.append(_n) or _f(*a))
    model = _sharp(DECODED[name])
    ids = torch.randint(0, model.cfg.vocab_size, (13,))
    with torch.no_grad():
        want = model.logits(ids, torch.tensor([0, 13], dtype=torch.int32))
    cache = model.kv_cache(16)
    got = []
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 11), (11, 12), (12, 13)]:
        got.append(model.decode(ids[a:b], cache))
        assert cache.length == b
    torch.testing.assert_close(torch.cat(got), want, rtol=DECODE_TOL.get(name, 1e-5), atol=DECODE_TOL.get(name, 1e-5))
    assert float((want[1:] - want[:-1]).abs().max()) > 0.1  # the rows differ: positions and keys matter here
    assert not got[0].requires_grad  # inference: no graph kept
    cfg = model.cfg
    filled = cache.k[..., :cfg.kv_rank + cfg.rope_dim] if cfg.kv_rank is not None else cache.k  # (a layer without an indexer caches zeros as its key)
    assert cache.k[:, 13:].abs().sum() == 0
    for j, layer in enumerate(cache.full_layers):  # each layer's own kv heads and channels filled (of a store holding the most), the others untouched
        G, D = (1, filled.shape[-1]) if cfg.kv_rank is not None else (cfg.kv_heads(layer), cfg.layer_head_dim(layer))
        if cfg.is_index_blocks(layer):  # block-sparse attention's indexer key beside each kv head's
            D += -(-cfg.index_head_dim // G)
        assert filled[j, :13, :G, :D].abs().amin(dim=(1, 2)).gt(0).all() and filled[j, :, G:].abs().sum() == 0
        assert filled[j, :, :, D:].abs().sum() == 0
    attending = sum(cfg.attends(i) for i in range(cfg.n_layers))
    if cfg.kv_rank is not None:  # the latents only: kv_rank + rope_dim per token and attending layer (and DSA's indexer key)
        index = cfg.index_head_dim if cfg.index_topk is not None else 0
        assert cache.k.shape == (attending, 16, 1, cfg.kv_rank + cfg.rope_dim + index) and cache.v.data_ptr() == cache.k.data_ptr()
        # 6 calls x the attending layers (and the whole sequence's logits): calls of 1 token absorbed, of 5 and 4 expanded;
        # DeepSeek sparse attention's kernel reads the latents absorbed in every call
        kernel = cfg.index_topk is not None and cfg.impl == "triton"
        assert forms.count("_mla_latent_qkv") == (7 if kernel else 4) * attending and forms.count("_mla_expand") == (0 if kernel else 3) * attending
    else:  # values of their own dim (MiMo-V2-Flash's); a store of layers with other kv heads holds the most of them
        heads = max((cfg.kv_heads(i) for i in cache.full_layers), default=1)  # (Mamba-2's: no attending layer, an empty store)
        # block-sparse attention's layers: the indexer's key beside each kv head's (a store of the widest)
        widest = max((cfg.head_dim + (-(-cfg.index_head_dim // cfg.kv_heads(i)) if cfg.is_index_blocks(i) else 0) for i in cache.full_layers),
                     default=cfg.head_dim)
        assert cache.k.shape == (len(cache.full_layers), 16, heads, widest)
        assert cache.v.shape == (len(cache.full_layers), 16, heads, cfg.v_head_dim or cfg.head_dim)
    if cfg.linear_layers is not None:  # a state of fixed size per linear-attention layer: the conv's last K - 1 tokens, the rule's state
        lin = cfg.linear_attention_config()
        n_linear = len(cfg.linear_layers)
        assert cache.linear_layers == cfg.linear_layers  # a parallel hybrid's layers are in both (Falcon-H1's), its window's in rings
        assert cache.full_layers == tuple(i for i in range(cfg.n_layers) if cfg.attends(i) and i not in cache.window_layers)
        assert cache.mixer_free_layers == (cfg.mixer_free_layers or ())  # an MLP alone: nothing cached
        # the conv's inputs: q, k and v's projections, or a short convolution's gated input (which has no rule: its state stays 0);
        # lightning attention has no convolution (no channels)
        assert cache.conv.shape == (n_linear, 1, lin.conv - 1, {"short_conv": lin.v_channels, "mamba1": lin.v_channels, "lightning": 0}.get(lin.kind, 2 * lin.k_channels + lin.v_channels))
        assert lin.kind == "lightning" or cache.conv.abs().amin(dim=(2, 3)).gt(0).all()
        assert cache.state.shape == (n_linear, 1, lin.n_v_heads, lin.k_head_dim, lin.v_head_dim)
        assert cache.state.abs().amin(dim=(2, 3, 4)).gt(0).all() if lin.kind != "short_conv" else not cache.state.any()
        keys = cache.k.numel() if cfg.kv_rank is not None else 2 * 16 * cfg.n_kv_heads * cfg.head_dim * len(cache.full_layers)  # the latents, or keys and values
        rings = cache.k_window.numel() + cache.v_window.numel()
        assert rings == (2 * 2 * 4 * cfg.n_kv_heads * cfg.head_dim if cache.window_layers else 0)  # the window's 4 newest tokens in blocks 0 and 2
        assert cache.nbytes == 4 * (keys + rings + cache.conv.numel() + cache.state.numel())
    elif (cfg.window is None and cfg.chunk is None) or (cfg.window or cfg.chunk) >= 16:  # no local layers, or none narrower than the cache
        assert cache.full_layers == tuple(range(cfg.n_layers)) and cache.k_window.numel() == 0
    else:  # the sliding-window (chunked) layers keep a ring of the window's (chunk's) newest tokens only
        local, length = (cfg.window_layers, cfg.window) if cfg.window is not None else (cfg.chunk_layers, cfg.chunk)
        G, D = cfg.kv_heads(0), cfg.layer_head_dim(0)  # the local layers' own (local_kv_heads, local_head_dim)
        Dv = cfg.v_head_dim or D
        assert cache.window_layers == local == (0, 2) and cache.full_layers == (1,) and cache.window == length
        assert cache.k_window.shape == (2, length, G, D) and cache.v_window.shape == (2, length, G, Dv)
        # a token's key and value in float32, in a full layer; kv_shared: its key alone, the values a view of the keys' store
        cached_v = 0 if cfg.kv_shared else Dv
        token = cfg.n_kv_heads * (cfg.head_dim + (0 if cfg.kv_shared else cfg.v_head_dim or cfg.head_dim)) * 4
        assert cache.nbytes == 16 * token + 2 * length * G * (D + cached_v) * 4 < 3 * 16 * token
        if cfg.kv_shared:
            assert cache.v.data_ptr() == cache.k.data_ptr() and cache.v_window.data_ptr() == cache.k_window.data_ptr()
    # a new sequence in the same cache
    cache.length = 0
    with torch.no_grad():
        torch.testing.assert_close(model.decode(ids[:4], cache), want[:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(DECODED))
def test_batched_decode_gives_each_sequence_its_own_logits(name):
    """Three sequences in one cache: prompts of 5, 2 and 7 tokens prefilled one by one, then
    steps of all three together, of two of them, and of two tokens each. Every sequence's
    logits are the rows of its own whole sequence's: the others' rows never leak in."""
    model = _sharp(DECODED[name])
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in (10, 6, 11)]
    with torch.no_grad():
        want = [model.logits(ids, torch.tensor([0, ids.shape[0]], dtype=torch.int32)) for ids in seqs]
    cache = model.kv_cache(12, batch=3)
    got = [[model.decode(ids[:n], cache, seqs=b)] for b, (ids, n) in enumerate(zip(seqs, (5, 2, 7)))]
    assert cache.lengths == [5, 2, 7]
    for which, width in (([0, 1, 2], 1), ([0, 2], 1), ([0, 1, 2], 2), ([1, 0], 1)):
        ids = torch.stack([seqs[b][cache.lengths[b]:cache.lengths[b] + width] for b in which])
        out = model.decode(ids, cache, seqs=which)
        assert out.shape == (len(which), width, model.cfg.vocab_size)
        for row, b in enumerate(which):
            got[b].append(out[row])
    assert cache.lengths == [10, 6, 11]
    tol = DECODE_TOL.get(name, 1e-5)
    for b in range(3):
        torch.testing.assert_close(torch.cat(got[b]), want[b], rtol=tol, atol=tol)
    # a sequence started over in its slot, the others kept
    cache.reset([1])
    torch.testing.assert_close(model.decode(seqs[1][:3], cache, seqs=1), want[1][:3], rtol=tol, atol=tol)
    assert cache.lengths == [10, 3, 11]


@pytest.mark.parametrize("window, alibi", [(None, False), (50, False), (50, True)], ids=["full", "window", "window-alibi"])
def test_batched_decode_through_the_flex_block_mask(window, alibi, monkeypatch):
    """FlexAttention's BlockMask (eager on CPU, as impl "auto" picks it on CUDA) over two
    slots of 160 rows, 128-row blocks: a block of queries spans both sequences and slot
    edges fall inside key blocks. With a window of 50 in blocks 0 and 2, their rings of 50
    rows per sequence: the prompt of 140 against its own keys, then steps of 5 (with ALiBi:
    its distances between the cache's rows, in the score_mod)."""
    import fmoe.layers

    monkeypatch.setattr(fmoe.layers, "_use_flex", lambda impl, device: True)
    model = _sharp(TINY if window is None else dataclasses.replace(TINY, window=window, window_layers=(0, 2), alibi=alibi))
    seqs = [torch.randint(0, TINY.vocab_size, (n,)) for n in (150, 40)]
    with torch.no_grad():
        want = [model.logits(ids, torch.tensor([0, ids.shape[0]], dtype=torch.int32)) for ids in seqs]
    cache = model.kv_cache(160, batch=2)
    got = [[model.decode(seqs[0][:140], cache, seqs=0)], [model.decode(seqs[1][:30], cache, seqs=1)]]
    for t in range(0, 10, 5):
        out = model.decode(torch.stack([seqs[0][140 + t:145 + t], seqs[1][30 + t:35 + t]]), cache)
        got[0].append(out[0])
        got[1].append(out[1])
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), want[b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["default", "gated deltanet", "minimax", "granite4", "jamba", "ling"])
def test_decode_reads_nothing_on_the_host(name):
    """Attention and every linear-attention kind's decoding steps (the rule's and the scan's
    own value checks are the public ops' default, which the layers turn off)."""
    cfg = TINY if name == "default" else dataclasses.replace(VARIANTS[name], mtp_depth=0)
    model = _sharp(dataclasses.replace(cfg, impl="auto"))  # the torch reference's grouped MLP reads its offsets
    cache = model.kv_cache(8)
    ids = torch.randint(0, TINY.vocab_size, (5,))
    with torch.no_grad(), HostReads() as reads:
        model.decode(ids[:4], cache)
        model.decode(ids[4:], cache)
    assert reads.count == 0, reads.sites


def test_forward_checks_ids_and_labels_on_the_device_and_counts_the_rows_it_sums():
    """A hand-built batch (forward takes any mapping): an id past vocab_size stops at a device assert (a RuntimeError on
    CPU, no host read) instead of an IndexError in the embedding; a counted label outside the head's rows stops there
    too, not a NaN loss; a label of -100 under loss_mask is in neither the sum nor the count."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY, mtp_depth=0))
    batch = make_batch(torch.randint(0, TINY.vocab_size, (12,)), torch.tensor([0, 5, 12]))
    losses, _ = model(batch)
    labels = batch["labels"].clone()
    labels[[1, 7]] = -100  # loss_mask stays True there
    dropped, _ = model(dict(batch, labels=labels))
    assert int(batch["loss_mask"].sum()) == 10 and int(dropped["lm_tokens"]) == 8
    keep = labels != -100
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model.logits(batch["input_ids"], batch["cu_seqlens"])[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(dropped["lm_sum"], want, rtol=1e-5, atol=1e-5)
    for bad in (TINY.vocab_size, -1):
        ids = batch["input_ids"].clone()
        ids[3] = bad
        with pytest.raises(RuntimeError, match=rf"input_ids: an id outside 0..{TINY.vocab_size - 1} \(vocab_size\)"):
            model(dict(batch, input_ids=ids))
        labels = batch["labels"].clone()
        labels[2] = bad
        with pytest.raises(RuntimeError, match=rf"labels: a counted label outside 0..{TINY.vocab_size - 1}, the output head's rows \(vocab_size\)"):
            model(dict(batch, labels=labels))


def test_decode_bad_inputs():
    from fmoe.model import KVCache, PipelineChunk

    model = _sharp(TINY)
    cache = model.kv_cache(4)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="max_tokens: expected >= 1, got 0"):
        model.kv_cache(0)
    with pytest.raises(ValueError, match=r"input_ids: expected \[T\] or \[S, T\] int64"):
        model.decode(ids[None, None], cache)
    with pytest.raises(ValueError, match=r"input_ids: expected \[T\] or \[S, T\] int64"):
        model.decode(ids[:0], cache)
    with pytest.raises(ValueError, match=r"input_ids: expected \[T\] or \[S, T\] int64"):
        model.decode(ids.float(), cache)
    with pytest.raises(ValueError, match=r"input_ids: expected a tensor \[T\] or \[S, T\] int64, got list"):
        model.decode([1, 2], cache)  # was an AttributeError
    for bad in (TINY.vocab_size, -1):  # no host read: the device's assert (on CPU, at once), before the cache is written
        with pytest.raises(RuntimeError, match=rf"input_ids: an id outside 0..{TINY.vocab_size - 1} \(vocab_size\)"):
            model.decode(torch.tensor([1, bad]), cache)
    assert cache.lengths == [0]
    with pytest.raises(ValueError, match="batch: expected >= 1, got 0"):
        model.kv_cache(4, batch=0)
    pair = model.kv_cache(4, batch=2)
    for bad in (2, True):
        with pytest.raises(ValueError, match=rf"seqs: expected one sequence index in \[0, 2\) for input_ids \[T\], got {bad}$"):
            model.decode(ids, pair, seqs=bad)
    with pytest.raises(ValueError, match=r"seqs: expected distinct sequence indices in \[0, 2\) for input_ids \[S, T\], got \[1, 1\]"):
        model.decode(ids.expand(2, 3), pair, seqs=[1, 1])
    for rows in (1, 3):
        with pytest.raises(ValueError, match=rf"input_ids: {rows} rows for the 2 sequences \[0, 1\] \(one row each\)"):
            model.decode(ids.expand(rows, 3), pair)
    with pytest.raises(ValueError, match=r"input_ids: expected \[T\] or \[S, T\] int64 with S, T >= 1, got torch.int64 \[0, 1\]"):
        model.decode(ids.new_zeros(0, 1), pair, seqs=[])  # no sequence: max() of nothing
    for bad in ([2], [-1], "0", [True], 1.0):  # -1 reset the last sequence, 0 was a TypeError, 2 an IndexError
        with pytest.raises(ValueError, match=r"seqs: expected None, or sequence indices in \[0, 2\) \(an int or a list of them\)"):
            pair.reset(bad)
    pair.lengths = [1, 2]
    pair.reset(1)
    assert pair.lengths == [1, 0]
    pair.reset()
    with pytest.raises(ValueError, match=r"cache.length: the cache holds 2 sequences; use cache.lengths\[b\]"):
        pair.length  # noqa: B018
    assert pair.lengths == [0, 0]  # nothing was written by the refused calls
    with pytest.raises(ValueError, match="cache: expected a KVCache"):
        model.decode(ids, (cache.k, cache.v))
    for n_layers in (2, 4):
        with pytest.raises(ValueError, match=f"cache: holds {n_layers} layers, the model has 3"):
            model.decode(ids, KVCache(dataclasses.replace(TINY, n_layers=n_layers), 4))
    with pytest.raises(ValueError, match=r"cache: holds torch.bfloat16, the model computes in torch.float32 \(make the cache with model.kv_cache\)"):
        model.decode(ids, KVCache(TINY, 4, dtype=torch.bfloat16))
    model.compute_dtype = torch.bfloat16  # FSDP2's param_dtype: the cache holds it
    assert model.kv_cache(4).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"cache: holds torch.float32, the model computes in torch.bfloat16 \(make the cache with model.kv_cache\)"):
        model.decode(ids, cache)
    model.compute_dtype = None
    meta = model.kv_cache(4, device="meta")  # sized, nothing allocated
    assert meta.k.device.type == "meta" and meta.nbytes == cache.nbytes
    with pytest.raises(ValueError, match=r"cache.k: holds torch.float32 \[.., 4, 8\]"):
        model.decode(ids, KVCache(dataclasses.replace(TINY, n_kv_heads=4), 4))
    with torch.no_grad():
        whole = model.decode(ids, cache)
    with pytest.raises(ValueError, match="input_ids: 2 more tokens after 3 of sequence 0 exceed the cache's max_tokens = 4"):
        model.decode(ids[:2], cache)
    assert cache.length == 3
    # a length past the tokens decoded (rows never written, read as keys) or below 0: refused; fewer goes back
    for bad in (4, -1):
        cache.length = bad
        with pytest.raises(ValueError, match=rf"cache.lengths\[0\]: expected 0..3, the tokens decoded into sequence 0 \(fewer goes back, 0 starts over\), got {bad}"):
            model.decode(ids[:1], cache)
    cache.length = 1
    with torch.no_grad():
        torch.testing.assert_close(model.decode(ids[1:], cache), whole[1:])
        model.decode(ids[:1], cache)  # up to max_tokens exactly
    assert cache.length == 4
    # sliding-window layers: a cache made for other layers is refused, and so is a sequence
    # rewound to fewer tokens (its ring no longer holds their keys); from 0 it starts over
    sliding = _sharp(dataclasses.replace(TINY, window=2, window_layers=(1,)))
    with pytest.raises(ValueError, match=r"cache: made for sliding-window \(chunked\) layers \[\] of window \(chunk\) None, the model's differ"):
        sliding.decode(ids, cache)
    with pytest.raises(ValueError, match=r"cache: made for sliding-window \(chunked\) layers \[1\] of window \(chunk\) 3, the model's differ"):
        sliding.decode(ids, KVCache(dataclasses.replace(sliding.cfg, window=3), 4))  # same layers, another window
    # a cache of other linear-attention layers: a layer read no states (an error about context parallel) or None's shape
    hybrid = _sharp(dataclasses.replace(TINY, linear_layers=(0,), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=6))
    for other, said in ((TINY, r"linear-attention layers \[\] and attention layers \[0, 1, 2\], the model's are \[0\] and \[1, 2\]"),
                        (dataclasses.replace(hybrid.cfg, linear_layers=(0, 1)), r"linear-attention layers \[0, 1\] and attention layers \[2\], the model's are \[0\] and \[1, 2\]")):
        with pytest.raises(ValueError, match=r"cache: made for " + said + r" \(make the cache with model.kv_cache\)"):
            hybrid.decode(ids, KVCache(other, 4))
    ring = sliding.kv_cache(4)
    with torch.no_grad():
        first = sliding.decode(ids, ring)
        ring.length = 2  # one token back: its row held a key out of the window
        torch.testing.assert_close(sliding.decode(ids[2:], ring), first[2:])
        ring.length = 1
        with pytest.raises(ValueError, match=r"cache.lengths\[0\]: 1 tokens after 3: the sliding-window \(chunked\) layers keep only the newest 2"):
            sliding.decode(ids[:1], ring)
        ring.length = 0
        torch.testing.assert_close(sliding.decode(ids, ring), first)
    # linear-attention layers keep the state after the last token alone: no step back at all; from 0 it starts over
    linear = _sharp(dataclasses.replace(VARIANTS["gated deltanet"], mtp_depth=0))
    states = linear.kv_cache(4)
    with torch.no_grad():
        first = linear.decode(ids, states)
        states.length = 2
        with pytest.raises(ValueError, match=r"cache.lengths\[0\]: 2 tokens after 3: the linear-attention layers keep only the state after the last"):
            linear.decode(ids[2:], states)
        states.length = 0
        torch.testing.assert_close(linear.decode(ids, states), first)
        # a cache of another dtype: refused before any layer writes (a linear layer's states were cast into it first)
        half = KVCache(linear.cfg, 4, dtype=torch.bfloat16)
        conv, state = half.conv.clone(), half.state.clone()
        with pytest.raises(ValueError, match=r"cache: holds torch.bfloat16, the model computes in torch.float32"):
            linear.decode(ids, half)
        assert torch.equal(half.conv, conv) and torch.equal(half.state, state) and half.lengths == [0]
    model.pipeline_chunk = PipelineChunk(0, 2, range(2))
    with pytest.raises(ValueError, match="model: decode needs the whole model on one process"):
        model.decode(ids, model.kv_cache(4))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "mla", "gpt-oss", "dsa", "mhc", "falcon_h1", "jamba"])
def test_gpu_decode_with_flex_attention_equals_the_whole_sequence(name):
    """On CUDA (FlexAttention, the block mask of the new tokens against the cached keys;
    multi-latent attention absorbed, with the dense mask; Falcon-H1's parallel hybrid: the
    Mamba-2 states' Triton kernels beside the cached keys; Jamba's, Mamba-1's): a prompt of 300 tokens, then one
    token at a time."""
    model = _sharp(dataclasses.replace(DECODED[name], impl="auto")).cuda()
    ids = torch.randint(0, TINY.vocab_size, (305,), device="cuda")
    with torch.no_grad():
        want = model.logits(ids, torch.tensor([0, 305], dtype=torch.int32, device="cuda"))
        cache = model.kv_cache(320)
        got = [model.decode(ids[:300], cache)] + [model.decode(ids[t:t + 1], cache) for t in range(300, 305)]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "mla", "gpt-oss", "dsa"])
def test_gpu_batched_decode_with_flex_attention_equals_each_sequence(name):
    """On CUDA: two sequences in one cache (block mask over both slots), prompts of 300 and
    140 tokens, then steps of both together."""
    model = _sharp(dataclasses.replace(DECODED[name], impl="auto")).cuda()
    seqs = [torch.randint(0, TINY.vocab_size, (n,), device="cuda") for n in (304, 144)]
    with torch.no_grad():
        want = [model.logits(ids, torch.tensor([0, ids.shape[0]], dtype=torch.int32, device="cuda")) for ids in seqs]
        cache = model.kv_cache(320, batch=2)
        got = [[model.decode(seqs[0][:300], cache, seqs=0)], [model.decode(seqs[1][:140], cache, seqs=1)]]
        for t in range(4):
            out = model.decode(torch.stack([seqs[0][300 + t:301 + t], seqs[1][140 + t:141 + t]]), cache)
            got[0].append(out[0])
            got[1].append(out[1])
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), want[b], rtol=1e-4, atol=1e-4)


def _dsv4_on(device: str, impl: str, T: int = 256):
    """DeepSeek-V4's model (a sliding block, a CSA block with its indexer's loss, an HCA block, an MTP depth) on `device`
    with `impl`, the same weights and batch wherever it runs: (loss, the indexer's loss, every gradient, the logits of a
    prompt of T - 5 tokens decoded then 5 single tokens, the whole sequence's logits), all on the CPU."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(DSV4_CSA, mtp_depth=1, impl=impl)
    model = Transformer(cfg)
    batch = _batch(cfg, T=T, cu=(0, T // 2, T // 2 + 1, T))
    ids = torch.randint(0, cfg.vocab_size, (T,))
    model, batch, ids = model.to(device), batch.to(device), ids.to(device)
    loss = _loss(model, batch, model.context(batch))
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
    decoder = _sharp(dataclasses.replace(cfg, mtp_depth=0)).to(device)
    with torch.no_grad():
        whole = decoder.logits(ids, torch.tensor([0, T], dtype=torch.int32, device=device))
        cache = decoder.kv_cache(T + 16)
        steps = torch.cat([decoder.decode(ids[:T - 5], cache)] + [decoder.decode(ids[t:t + 1], cache) for t in range(T - 5, T)])
    return loss.detach().cpu(), model.index_loss_sum().detach().cpu(), grads, steps.cpu(), whole.cpu()


@pytest.mark.gpu
def test_gpu_deepseek_v4_model_trains_and_decodes_as_on_the_cpu():
    """DeepSeek-V4's model on CUDA (impl "auto": its sliding, CSA and HCA blocks on the compiled sparse kernel, the contexts
    the masks' rules; the MTP block by the reference over the rule's rows), float32, 256 tokens in 3 documents: the loss,
    the indexer's loss and every gradient are the CPU reference's (impl "torch"), and decoding a prompt of 251 tokens then
    single tokens gives the whole sequence's logits."""
    cpu, gpu = _dsv4_on("cpu", "torch"), _dsv4_on("cuda", "auto")
    assert float(cpu[1]) > 0
    torch.testing.assert_close(gpu[0], cpu[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-3, atol=1e-6)
    for n, g in cpu[2].items():
        torch.testing.assert_close(gpu[2][n], g, rtol=1e-3, atol=1e-5, msg=n)
    torch.testing.assert_close(gpu[3], gpu[4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu[4], cpu[4], rtol=1e-4, atol=1e-4)


def test_granite_multipliers_in_the_logits_the_loss_and_decode():
    """logit_divisor d: the logits are those of the same weights without it, / d, and the LM
    loss is their cross-entropy; with every multiplier set, decode's logits are logits()'s
    rows (the embedding, attention, residual and head multipliers on both paths)."""
    cfg = dataclasses.replace(TINY, mtp_depth=0, impl="torch")
    granite = dataclasses.replace(cfg, logit_divisor=3.0)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    divided = Transformer(granite)
    divided.load_state_dict(plain.state_dict())
    batch = _batch(cfg)
    with torch.no_grad():
        want = plain.logits(batch["input_ids"], batch["cu_seqlens"]) / 3.0
        got = divided.logits(batch["input_ids"], batch["cu_seqlens"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        losses, _ = divided(batch)
        ce = torch.nn.functional.cross_entropy(got[batch["loss_mask"]], batch["labels"][batch["loss_mask"]], reduction="sum")
        torch.testing.assert_close(losses["lm_sum"], ce, rtol=1e-5, atol=1e-5)
    every = Transformer(dataclasses.replace(cfg, attn_scale=0.3, embed_scale=2.0, residual_scale=0.6, logit_divisor=3.0)).eval()
    ids = torch.randint(0, cfg.vocab_size, (9,))
    cache = every.kv_cache(16)
    with torch.no_grad():
        stepped = torch.cat([every.decode(ids[:5], cache), *(every.decode(ids[t:t + 1], cache) for t in range(5, 9))])
        whole = every.logits(ids, torch.tensor([0, 9]))
    torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
    block, x = every.blocks[1], torch.randn(24, cfg.hidden)  # each branch's output times residual_scale
    ctx = every.context(batch).attention[0]
    with torch.no_grad():
        mid = x + 0.6 * block._attend(x, ctx)
        torch.testing.assert_close(block(x, ctx)[0], mid + 0.6 * block._mlp_out(block.mlp_norm(mid))[0])


def test_a_shortcut_pair_adds_its_moe_output_after_the_second_block():
    """shortcut_moe, by hand from the blocks' own modules: x + attn; the MLP input n feeds the
    dense MLP (added) and the MoE (held); x + attn; x + mlp + the held MoE output. Adding the
    MoE's output in its own block instead changes the logits."""
    cfg = dataclasses.replace(VARIANTS["longcat"], mtp_depth=0)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # the MoE's output large enough to show where it is added
        for moe in model.moe_layers().values():
            moe.experts.w_down.mul_(30.0)
    assert [b.shortcut for b in model.blocks] == ["out", "in", "out", "in"]
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MoE", "DenseMLP"] * 2 and model.blocks[1].dense is None
    ids, cu = torch.randint(0, cfg.vocab_size, (20,)), torch.tensor([0, 12, 20], dtype=torch.int32)
    ctx = fmoe.layers.attention_context(cu, fmoe.ops.positions_from_cu_seqlens(cu), cfg.attention_config())

    def by_hand(deferred: bool):
        h = model._embedding(ids)
        for first, second in (model.blocks[0:2], model.blocks[2:4]):
            h = h + first.attn(first.attn_norm(h), ctx)
            n = first.mlp_norm(h)
            moe, _ = first.mlp(n)
            h = h + first.dense(n) + (0 if deferred else moe)
            h = h + second.attn(second.attn_norm(h), ctx)
            h = h + second.mlp(second.mlp_norm(h)) + (moe if deferred else 0)
        return model._head(h)

    with torch.no_grad():
        got = model.logits(ids, cu)
        torch.testing.assert_close(got, by_hand(True), rtol=1e-5, atol=1e-6)
        assert float((got - by_hand(False)).abs().max()) > 1e-3
        # the pair's first block hands on [T, 2H]: the residual, then the MoE's output
        out, stats = model.blocks[0](model._embedding(ids), ctx)
        assert out.shape == (20, 2 * cfg.hidden) and stats is not None


def test_shortcut_pairs_take_their_moe_from_the_even_blocks_and_refuse_what_they_cannot_pair():
    cfg = dataclasses.replace(VARIANTS["longcat"], n_layers=6, n_dense=2, mtp_depth=0)
    assert [cfg.is_moe(i) for i in range(6)] == [False, False, True, False, True, False]
    assert [cfg.shortcut(i) for i in range(6)] == [None, None, "out", "in", "out", "in"]
    assert [b.dense is not None for b in Transformer(cfg).blocks] == [False, False, True, False, True, False]
    assert dataclasses.replace(cfg, moe_layers=(4,)).shortcut(2) is None and dataclasses.replace(TINY).shortcut(1) is None
    with pytest.raises(ValueError, match="n_layers: shortcut_moe builds the blocks in pairs, expected an even number, got 3"):
        dataclasses.replace(TINY, shortcut_moe=True)
    with pytest.raises(ValueError, match=r"moe_layers: with shortcut_moe the MoE is the first block's of a pair \(an even index\), got blocks \[1, 3\]"):
        dataclasses.replace(cfg, moe_layers=(0, 1, 3))
    for knob in (dict(parallel_blocks=True), dict(post_norms=True), dict(moe_out_norm=True), dict(residual_scale=0.5)):
        with pytest.raises(ValueError, match="shortcut_moe: a pair of pre-norm blocks"):
            dataclasses.replace(cfg, **knob)
    with pytest.raises(ValueError, match="shortcut_moe: expected a bool, got 1"):
        dataclasses.replace(TINY, n_layers=4, shortcut_moe=1)
    from fmoe.model import Block

    for shortcut, moe, c in (("out", False, cfg), ("in", True, cfg), ("both", True, cfg), ("out", True, TINY)):
        with pytest.raises(ValueError, match="shortcut: expected None, or with cfg.shortcut_moe 'out'"):
            Block(c, moe=moe, shortcut=shortcut)


def test_mla_scales_are_the_latent_weights_scaled():
    """mla_scales (LongCat-Flash's): the queries times sqrt(H / q_rank) and the normed kv latent
    times sqrt(H / kv_rank) give the logits of the same model without them whose wq_b and
    kv_a_norm carry those factors; cached decoding (the latents scaled) matches too."""
    cfg = dataclasses.replace(VARIANTS["mla, group top-2, mtp norm"], mtp_depth=0, mla_scales=True)
    sq, skv = (cfg.hidden / cfg.q_rank) ** 0.5, (cfg.hidden / cfg.kv_rank) ** 0.5
    assert cfg.attention_config().latent_scales == (sq, skv)
    torch.manual_seed(0)
    scaled = Transformer(cfg).eval()
    plain = Transformer(dataclasses.replace(cfg, mla_scales=False)).eval()
    state = scaled.state_dict()
    for i in range(cfg.n_layers):
        state[f"blocks.{i}.attn.wq_b"] = state[f"blocks.{i}.attn.wq_b"] * sq
        state[f"blocks.{i}.attn.kv_a_norm"] = state[f"blocks.{i}.attn.kv_a_norm"] * skv
    plain.load_state_dict(state)
    ids, cu = torch.randint(0, cfg.vocab_size, (12,)), torch.tensor([0, 12], dtype=torch.int32)
    with torch.no_grad():
        want = plain.logits(ids, cu)
        assert float((want - Transformer(dataclasses.replace(cfg, mla_scales=False)).logits(ids, cu)).abs().max()) > 1e-3
        torch.testing.assert_close(scaled.logits(ids, cu), want, rtol=1e-5, atol=1e-6)
        cache = scaled.kv_cache(12)
        steps = torch.cat([scaled.decode(ids[:8], cache)] + [scaled.decode(ids[t:t + 1], cache) for t in range(8, 12)])
        torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mla_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank"):
        dataclasses.replace(cfg, q_rank=None)
    for bad in ((1.0,), (1.0, 0.0), (1.0, float("inf")), ("1", 2.0)):
        with pytest.raises(ValueError, match="latent_scales: expected None or two finite numbers > 0"):
            dataclasses.replace(cfg.attention_config(), latent_scales=bad)
    with pytest.raises(ValueError, match="latent_scales: scales multi-latent attention's queries and kv latent, needs q_rank and kv_rank"):
        dataclasses.replace(cfg.attention_config(), latent_scales=(1.0, 2.0), q_rank=None)


def test_ling_s_linear_knobs_need_kimi_delta_attention_blocks():
    wf = Transformer(VARIANTS["ling"]).blocks[0].attn
    assert wf.wf.shape == (32, 16) and wf.wz.shape == (32, 12) and not hasattr(wf, "wf_a") and wf.cfg.decay_bound == -5.0
    for knob in (dict(linear_full_rank=True), dict(linear_decay_bound=-5.0)):
        name = next(iter(knob))
        with pytest.raises(ValueError, match=f"{name}: a knob of Kimi Delta Attention's blocks, needs linear_layers and linear_kind='kda'"):
            dataclasses.replace(TINY, **knob)
        with pytest.raises(ValueError, match=f"{name}: a knob of Kimi Delta Attention's blocks"):
            dataclasses.replace(VARIANTS["gated deltanet"], **knob)
    with pytest.raises(ValueError, match="decay_bound: expected None or a finite number < 0"):
        dataclasses.replace(VARIANTS["ling"], linear_decay_bound=1.0)


@pytest.mark.parametrize("kind", ["manifold", "independent"])
def test_hyper_connections_with_flat_weights_are_the_one_stream_model(kind):
    """With every scale and eps 0 (and magnitude 2) the pre weights are 1/n, the post weights
    1 and the mixing uniform: equal streams stay equal, and the model is the one-stream model
    of the same weights (logits within 1e-5). With the initial scales the streams part and the
    logits move; the hc weights get gradients."""
    cfg = dataclasses.replace(TINY, hyper_connections=3, hc_kind=kind, hc_eps=0.0, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    plain = Transformer(dataclasses.replace(cfg, hyper_connections=0, hc_kind="manifold", hc_eps=1e-6))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "hc" not in k})
    ids, cu = torch.randint(0, cfg.vocab_size, (12,)), torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        moved = model.logits(ids, cu)
        for name, p in model.named_parameters():
            if name.endswith("hc.scale") or name.endswith("hc_head.scale"):
                p.zero_()
        torch.testing.assert_close(model.logits(ids, cu), plain.logits(ids, cu), rtol=1e-5, atol=1e-5)
        assert float((moved - plain.logits(ids, cu)).abs().max()) > 1e-4
    scales = [n for n, _ in model.named_parameters() if "hc" in n]
    assert len(scales) == 3 * (2 * cfg.n_layers + 1)  # fn, base, scale: two per block and the head's
    model = Transformer(dataclasses.replace(cfg, hc_eps=1e-6))
    batch = _batch(model.cfg)
    losses, _ = model(batch, model.context(batch))
    losses["lm_sum"].backward()
    for name in scales:
        assert float(model.get_parameter(name).grad.abs().max()) > 0, name


def test_hyper_connection_weights_by_hand():
    """One HyperConnection against the formulas written out per token and stream: the pre
    weights' sum, the post weights, and (manifold) the Sinkhorn-projected mixing, doubly
    stochastic; the float32 weights stay float32 when the model is cast."""
    from fmoe.model import HyperConnection

    torch.manual_seed(0)
    n, H, T = 3, 8, 5
    for kind in ("manifold", "independent"):
        cfg = dataclasses.replace(TINY, hidden=H, n_heads=2, n_kv_heads=1, head_dim=4, hyper_connections=n, hc_kind=kind, hc_magnitude=1.5,
                                  hc_eps=1e-3, hc_sinkhorn_iters=30)
        hc = HyperConnection(cfg)
        M = 2 * n + (n * n if kind == "manifold" else 0)
        assert hc.fn.shape == (M, n * H) and hc.base.shape == (M,) and hc.scale.shape == ((3,) if kind == "manifold" else (2,))
        with torch.no_grad():
            for p in hc.parameters():
                p.normal_()
        x, y = torch.randn(T, n * H), torch.randn(T, H)
        with torch.no_grad():
            h, post, comb = hc(x)
        for t in range(T):
            m = (hc.fn @ x[t]) / (x[t].square().mean() + cfg.norm_eps).sqrt()
            pre = torch.sigmoid(m[:n] * hc.scale[0] + hc.base[:n]) + 1e-3
            want_post = 1.5 * torch.sigmoid(m[n:2 * n] * hc.scale[1] + hc.base[n:2 * n]) + (1e-3 if kind == "independent" else 0.0)
            streams = x[t].view(n, H)
            torch.testing.assert_close(h[t], sum(pre[s] * streams[s] for s in range(n)), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(post[t], want_post, rtol=1e-5, atol=1e-6)
            out = hc.add(x, y, post, comb)[t].view(n, H)
            for s in range(n):
                kept = streams[s] if comb is None else sum(comb[t, j, s] * streams[j] for j in range(n))
                torch.testing.assert_close(out[s], post[t, s] * y[t] + kept, rtol=1e-5, atol=1e-5)
        if kind == "manifold":  # Sinkhorn's steps: the columns sum to 1 (the last step's), the rows nearly
            torch.testing.assert_close(comb.sum(-2), torch.ones(T, n) / (1 + 1e-3), rtol=0, atol=1e-5)
            assert float((comb.sum(-1) - 1).abs().max()) < 0.01
            with torch.no_grad():  # doubly stochastic without eps and with moderate weights
                flat = HyperConnection(dataclasses.replace(cfg, hc_eps=0.0))
                flat.load_state_dict(hc.state_dict())
                flat.scale.mul_(0.1)
                comb = flat(x)[2]
            torch.testing.assert_close(comb.sum(-1), torch.ones(T, n), rtol=0, atol=1e-5)
            torch.testing.assert_close(comb.sum(-2), torch.ones(T, n), rtol=0, atol=1e-6)
        else:
            assert comb is None
    model = Transformer(dataclasses.replace(TINY, hyper_connections=2)).to(torch.bfloat16)
    assert model.blocks[0].attn_hc.fn.dtype == model.hc_head.scale.dtype == torch.float32 and model.blocks[0].attn.wq.dtype == torch.bfloat16


def test_hyper_connections_equal_transformers_modules():
    """fmoe's HyperConnection (manifold) and DeepSeek-V4's mHC module, and (independent) and
    HY-V4's, and the head's collapse, of the same weights: the same block input, post and
    mixing weights and streams after the add, to float32 rounding."""
    dsv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4", reason="transformers (the test extra) not installed")
    hyv4 = pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4", reason="transformers (the test extra) not installed")
    from fmoe.model import HyperConnection

    torch.manual_seed(0)
    n, H, T = 4, 16, 6
    x = torch.randn(1, T, n, H)
    y = torch.randn(1, T, H)
    for kind, module, theirs in (("manifold", dsv4, dsv4.DeepseekV4Config(hidden_size=H, hc_mult=n, hc_sinkhorn_iters=7, rms_norm_eps=1e-6)),
                                 ("independent", hyv4, hyv4.HYV4Config(hidden_size=H, hc_mult=n, hc_magnitude=1.7, rms_norm_eps=1e-6))):
        prefix = "DeepseekV4" if kind == "manifold" else "HYV4"
        ref, ref_head = getattr(module, prefix + "HyperConnection")(theirs), getattr(module, prefix + "HyperHead")(theirs)
        for p in list(ref.parameters()) + list(ref_head.parameters()):
            torch.nn.init.normal_(p)
        cfg = dataclasses.replace(TINY, hidden=H, n_heads=2, n_kv_heads=1, head_dim=8, hyper_connections=n, hc_kind=kind,
                                  hc_magnitude=1.7 if kind == "independent" else 2.0, hc_sinkhorn_iters=7)
        ours, head = HyperConnection(cfg), HyperConnection(cfg, head=True)
        ours.load_state_dict({"fn": ref.fn, "base": ref.base, "scale": ref.scale})
        head.load_state_dict({"fn": ref_head.hc_fn, "base": ref_head.hc_base, "scale": ref_head.hc_scale})
        with torch.no_grad():
            h, post, comb = ours(x.view(T, n * H))
            if kind == "manifold":
                want_post, want_comb, want_h = ref(x)
                torch.testing.assert_close(comb, want_comb[0], rtol=1e-5, atol=1e-6)
                want_next = want_post[0, :, :, None] * y[0, :, None, :] + torch.matmul(want_comb[0].transpose(-1, -2), x[0])
            else:
                want_post, want_h = ref(x)
                want_next = want_post[0, :, :, None] * y[0, :, None, :] + x[0]
            torch.testing.assert_close(h, want_h[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(post, want_post[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.add(x.view(T, n * H), y[0], post, comb), want_next.reshape(T, n * H), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(head(x.view(T, n * H)), ref_head(x)[0], rtol=1e-5, atol=1e-5)


def test_hash_layers_route_each_token_by_its_id(tmp_path):
    """The first hash_layers MoE blocks route by their table (DeepSeek-V4's hash_moe): the counts are the
    table's rows at the batch's ids whatever the weights, the router trained through the weights alone;
    the other MoE blocks (and the MTP's) route by their router and expert bias as before."""
    cfg = VARIANTS["dsv4"]
    model = Transformer(cfg)
    hashed, routed = model.blocks[1].mlp, model.blocks[2].mlp
    assert "expert_bias" not in hashed._buffers and "hash_table" not in routed._buffers and "hash_table" not in model.mtp[0].block.mlp._buffers
    table = hashed.hash_table
    assert table.shape == (cfg.vocab_size, cfg.k) and table.dtype == torch.int64
    assert ((table >= 0) & (table < cfg.n_experts)).all() and (table[:, 0] != table[:, 1]).all()
    assert len({tuple(r) for r in table.tolist()}) > 1  # not one row for every id
    from fmoe.train import checkpoint

    checkpoint.save(tmp_path / "ck", 1, model=model, optimizers=[])  # persistent: saved with the weights, read back
    other = Transformer(cfg)
    other.reset_parameters(seed=torch.initial_seed() + 7)
    checkpoint.load_model(tmp_path / "ck" / "step_000001", model=other)
    assert torch.equal(other.blocks[1].mlp.hash_table, table)
    again = Transformer(cfg)
    again.reset_parameters(seed=torch.initial_seed())
    model.reset_parameters(seed=torch.initial_seed())
    assert torch.equal(again.blocks[1].mlp.hash_table, model.blocks[1].mlp.hash_table)  # a function of the seed and the name
    again.reset_parameters(seed=torch.initial_seed() + 1)
    assert not torch.equal(again.blocks[1].mlp.hash_table, model.blocks[1].mlp.hash_table)

    batch = _batch(cfg)
    want = torch.bincount(table[batch["input_ids"]].reshape(-1), minlength=cfg.n_experts)
    _, stats = model(batch)
    assert torch.equal(stats["layer_1"]["tokens_per_expert"], want)
    routed_counts = stats["layer_2"]["tokens_per_expert"].clone()
    with torch.no_grad():  # other weights: the hashed block's choice stays, the routed block's moves
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    _, stats = model(batch)
    assert torch.equal(stats["layer_1"]["tokens_per_expert"], want)
    assert not torch.equal(stats["layer_2"]["tokens_per_expert"], routed_counts)
    losses, _ = model(batch)
    losses["lm_sum"].backward()
    assert float(hashed.router.grad.abs().max()) > 0  # through the weights
    # one token's id moved to another: its experts follow the table
    ids = batch["input_ids"].clone()
    ids[3] = (ids[3] + 1) % cfg.vocab_size
    batch2 = make_batch(ids, torch.tensor((0, 7, 8, 24)), mtp_depth=cfg.mtp_depth)
    _, stats = model(batch2)
    assert torch.equal(stats["layer_1"]["tokens_per_expert"], torch.bincount(table[ids].reshape(-1), minlength=cfg.n_experts))
    # the MoE needs the ids
    with pytest.raises(ValueError, match=r"token_ids: a hashed MoE routes by its tokens' ids, expected \[T\] int ids, got None"):
        hashed(torch.randn(5, cfg.hidden))
    # no released family holds a table (DeepSeek-V4's attention is not built): the export names the knob
    import fmoe.hf

    with pytest.raises(ValueError, match=r"model: its config has no deepseek_v3 equivalent: .*'hash_layers': \(1, 0\)"):
        fmoe.hf.save_pretrained(model, tmp_path / "hf", model_type="deepseek_v3")


@pytest.mark.parametrize("hashed", [True, False], ids=["hash_moe", "moe"])
def test_deepseek_v4_moe_blocks_equal_transformers_modules(hashed):
    """fmoe's MoE (sqrt(softplus) routing with DeepSeek-V4's expert bias, or its hash table; the routed and shared
    SwiGLUs clamped at swiglu_limit) and transformers' DeepseekV4SparseMoeBlock of the same weights: the same output."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4", reason="transformers (the test extra) not installed")
    import transformers

    H, F, E, k, V = 16, 12, 8, 3, 30
    theirs_cfg = transformers.DeepseekV4Config(hidden_size=H, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=k, vocab_size=V,
                                               routed_scaling_factor=1.5, swiglu_limit=0.7, num_hidden_layers=2,
                                               mlp_layer_types=["hash_moe" if hashed else "moe", "moe"])
    theirs = v4.DeepseekV4SparseMoeBlock(theirs_cfg, layer_idx=0)
    torch.manual_seed(0)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    gate = theirs.gate
    if hashed:
        gate.tid2eid.copy_(torch.rand(V, E).argsort(dim=1)[:, :k])
    else:
        gate.e_score_correction_bias.normal_(0.0, 0.1)
    cfg = fmoe.layers.MoEConfig(n_experts=E, k=k, score="sqrtsoftplus", scale=1.5, swiglu_limit=0.7, shared_swiglu_limit=0.7)
    ours = fmoe.model.MoE(H, F, cfg, shared_ffn=F, expert_bias=not hashed, hash_vocab=V if hashed else 0)
    w_gate, w_up = theirs.experts.gate_up_proj.detach().chunk(2, dim=1)  # [E, 2F, H]: gate rows, then up rows
    state = {"router": gate.weight, "experts.w_gate": w_gate.transpose(1, 2), "experts.w_up": w_up.transpose(1, 2),
             "experts.w_down": theirs.experts.down_proj.transpose(1, 2), "shared.w_gate": theirs.shared_experts.gate_proj.weight.T,
             "shared.w_up": theirs.shared_experts.up_proj.weight.T, "shared.w_down": theirs.shared_experts.down_proj.weight.T}
    state["hash_table" if hashed else "expert_bias"] = gate.tid2eid if hashed else gate.e_score_correction_bias
    ours.load_state_dict({n: t.detach().contiguous() for n, t in state.items()})
    x, ids = torch.randn(2, 10, H), torch.randint(0, V, (2, 10))
    with torch.no_grad():
        want = theirs(x, input_ids=ids)
        got, _ = ours(x, token_ids=ids.reshape(-1) if hashed else None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_heavily_compressed_blocks_decode_as_the_whole_sequence():
    """Heavily compressed attention in decoding: the cache keeps each sequence's entries and its open run's inputs, so a
    prompt and then tokens one and a few at a time give the whole sequence's logits (runs of 3 completed inside a call,
    across calls, and by single tokens); two sequences of other lengths decode together as each alone; the entries of the
    complete runs fill their rows (13 tokens: 4 runs, one token open) and the cache counts their bytes; a sequence does not
    go back (refused by name), it restarts from 0."""
    model = _sharp(dataclasses.replace(VARIANTS["dsv4-hca"], mtp_depth=0))

    def check(cache):
        assert cache.compress_layers == (1, 2) and cache.entries.shape == (2, 16 // 3, 8) and cache.run.shape == (2, 1, 3, 16)
        assert cache.entries[:, :4].abs().amin(dim=-1).gt(0).all() and cache.entries[:, 4:].abs().sum() == 0
        assert cache.run[:, 0, :1].abs().amin(dim=-1).gt(0).all()  # the open run's one token (position 12)
        rings_and_stores = sum(t.numel() for t in (cache.k, cache.k_window)) * 4  # kv_shared: the values are views of the keys
        assert cache.csa_entries.numel() == cache.csa_run.numel() == 0  # no compressed sparse attention layer
        assert cache.nbytes == rings_and_stores + (cache.entries.numel() + cache.run.numel()) * 4

    _decodes_as_the_whole_sequence(model, check)


def _decodes_as_the_whole_sequence(model, check) -> None:
    """A sequence of 13 tokens decoded as a prompt of 5 then calls of 1, 1, 4, 1 and 1 token gives its logits (then
    check(cache)); it cannot go back a token (the compressed layers' refusal), restarts from 0 over stale rows, and
    decodes beside another sequence of 8 tokens as each alone."""
    ids = torch.randint(0, model.cfg.vocab_size, (13,))
    other = torch.randint(0, model.cfg.vocab_size, (8,))
    with torch.no_grad():
        want = model.logits(ids, torch.tensor([0, 13], dtype=torch.int32))
        want_other = model.logits(other, torch.tensor([0, 8], dtype=torch.int32))
    cache = model.kv_cache(16)
    got = [model.decode(ids[a:b], cache) for a, b in [(0, 5), (5, 6), (6, 7), (7, 11), (11, 12), (12, 13)]]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-5, atol=1e-5)
    check(cache)
    cache.length = 12  # one token back, which the window's ring allows
    with pytest.raises(ValueError, match=r"cache.lengths\[0\]: 12 tokens after 13: the compressed attention layers keep only the entries"):
        model.decode(ids[12:13], cache)
    cache.reset()
    torch.testing.assert_close(model.decode(ids[:7], cache), want[:7], rtol=1e-5, atol=1e-5)  # a fresh start over stale rows
    both = model.kv_cache(16, batch=2)
    first = [model.decode(ids[:5], both, seqs=0), model.decode(other[:2], both, seqs=1)]
    steps = [model.decode(torch.stack([ids[5 + t:6 + t], other[2 + t:3 + t]]), both) for t in range(6)]
    torch.testing.assert_close(torch.cat([first[0], *(s[0] for s in steps)]), want[:11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([first[1], *(s[1] for s in steps)]), want_other, rtol=1e-5, atol=1e-5)


def test_heavily_compressed_blocks_bad_knobs():
    """compress_layers and compress_rate are checked by name."""
    for overrides, message in ((dict(compress_rate=1), r"compress_rate: expected >= 2, got 1"),
                               (dict(compress_layers=(3,)), r"compress_layers: expected distinct block indices in 0\.\.2, got \(3,\)"),
                               (dict(n_kv_heads=2), r"compress_rate: heavily compressed attention's entries are one shared key-value head's"),
                               (dict(linear_layers=(1,)), r"compress_layers: heavily compressed attention blocks attend \(softmax attention\)")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(VARIANTS["dsv4-hca"], **overrides)


def test_compressed_sparse_blocks_keep_documents_apart_and_train():
    """Compressed sparse attention blocks (csa_layers) in a model: packed documents give each document's logits alone (their
    entries and the indexer's choice stay within the document), the choice matters (csa_topk), the loss's gradients reach
    the compressor, the indexer's loss (index_loss_coeff, kept as attn.index_loss) reaches the indexer's weights and nothing
    else (weighed 0 its gradients are zero and the others' unchanged), frozen without it (index_loss_coeff 0: requires_grad
    False), the indexer's compressor bias stays float32 under a cast."""
    model = _sharp(DSV4_CSA)
    attn = model.blocks[1].attn
    assert attn.cfg.compress_topk == 2 and attn.cfg.compress_rate == 2 and model.blocks[2].attn.cfg.compress_topk is None
    docs = [torch.randint(0, model.cfg.vocab_size, (n,)) for n in (9, 14)]
    with torch.no_grad():
        packed = model.logits(torch.cat(docs), torch.tensor([0, 9, 23], dtype=torch.int32))
        alone = torch.cat([model.logits(d, torch.tensor([0, len(d)], dtype=torch.int32)) for d in docs])
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
        wider = Transformer(dataclasses.replace(DSV4_CSA, csa_topk=8))
        wider.load_state_dict(model.state_dict())
        assert (wider.logits(torch.cat(docs), torch.tensor([0, 9, 23], dtype=torch.int32)) - packed).abs().max() > 1e-3
    model.train()
    batch = make_batch(torch.cat(docs), torch.tensor([0, 9, 23], dtype=torch.int32), 0)
    indexer = ("index_wq", "index_w", "index_compress_wkv", "index_compress_wg", "index_compress_bias", "index_compress_norm")
    grads = {}
    for weight in (1.0, 0.0):
        model.zero_grad(set_to_none=True)
        model.set_index_loss_weight(weight)
        losses, _ = model(batch, model.context(batch))
        (losses["lm_sum"] / losses["lm_tokens"]).backward()
        grads[weight] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert float(attn.index_loss) > 0 and model.index_loss_sum() is not None
    for name in ("compress_wkv", "compress_wg", "compress_bias", "compress_norm"):
        assert float(getattr(attn, name).grad.abs().max()) > 0, name
    assert set(grads[1.0]) == set(grads[0.0]) == {n for n, p in model.named_parameters()}
    for n in grads[1.0]:
        if n.split(".")[-1] in indexer:  # its loss's gradient alone: none weighed 0
            assert n.startswith("blocks.1.attn.") and float(grads[1.0][n].abs().max()) > 0 and float(grads[0.0][n].abs().max()) == 0, n
        else:
            torch.testing.assert_close(grads[1.0][n], grads[0.0][n], rtol=0, atol=0)
    frozen = Transformer(dataclasses.replace(DSV4_CSA, index_loss_coeff=0.0))
    losses, _ = frozen(batch, frozen.context(batch))
    (losses["lm_sum"] / losses["lm_tokens"]).backward()
    for name in indexer:
        assert not getattr(frozen.blocks[1].attn, name).requires_grad and getattr(frozen.blocks[1].attn, name).grad is None, name
    assert frozen.index_loss_sum() is None
    assert model.to(torch.bfloat16).blocks[1].attn.index_compress_bias.dtype == torch.float32


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_compressed_sparse_blocks_decode_as_the_whole_sequence(impl):
    """Compressed sparse attention in decoding: the cache keeps each sequence's entries beside its indexer's, and the inputs
    of its last complete run and its open run, so a prompt and then tokens one and a few at a time give the whole
    sequence's logits (runs of 2 completed inside a call, across calls, by single tokens; each entry overlapping the run
    before it, from a previous call too; the indexer's choice of 2 among up to 6 entries); two sequences of other lengths
    decode together as each alone; the entries of the complete runs fill their rows (13 tokens: 6 runs) and the cache
    counts their bytes; a sequence does not go back (refused by name) and restarts from 0 over stale rows. impl "triton"
    (CUDA's "auto"; the interpreter here): every V4 layer on the sparse kernel, over the cache's rows, the same."""
    model = _sharp(dataclasses.replace(DSV4_CSA, impl=impl))
    D, Di = model.cfg.head_dim, model.cfg.index_head_dim

    def check(cache):
        assert cache.csa_layers == (1,) and cache.csa_entries.shape == (1, 16 // 2, D + Di) and cache.csa_run.shape == (1, 1, 4, 2 * (2 * D + 2 * Di))
        assert cache.csa_entries[:, :6].abs().amin(dim=-1).gt(0).all() and cache.csa_entries[:, 6:].abs().sum() == 0
        assert cache.nbytes == sum(t.numel() for t in (cache.k, cache.k_window, cache.entries, cache.run, cache.csa_entries, cache.csa_run)) * 4

    _decodes_as_the_whole_sequence(model, check)


def test_compressed_sparse_decoding_rotates_the_indexer_s_entries_as_its_queries():
    """A CSA layer whose indexer rotates otherwise than its keys (index_interleaved and index_rope_last the other way: its
    AttentionConfig allows it, where the model's knobs tie them): decoding makes the indexer's entries as the whole
    sequence does (rotated as the indexer's queries), so it gives the whole sequence's logits."""
    model = _sharp(DSV4_CSA)
    attn = model.blocks[1].attn
    attn.cfg = dataclasses.replace(attn.cfg, index_interleaved=not attn.cfg.interleaved, index_rope_last=not attn.cfg.rope_last)
    _decodes_as_the_whole_sequence(model, lambda cache: None)


def test_deepseek_v4_models_on_the_sparse_kernel_train_as_the_reference():
    """A DeepSeek-V4 model (a sliding block, a CSA block with its indexer's loss, an HCA block, an MTP depth) with impl
    "triton" (CUDA's "auto"; the interpreter here): its contexts hold the masks' rules (MaskRows, never [T, T]; the MTP
    depth's shares the trunk's), every layer attends on the sparse kernel, and the loss, the indexer's loss and every
    gradient are the dense reference's (impl "torch")."""
    runs = {}
    for impl in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = dataclasses.replace(DSV4_CSA, mtp_depth=1, impl=impl)
        model = Transformer(cfg)
        batch = _batch(cfg, T=32, cu=(0, 7, 8, 24, 32), padding=8)
        ctx = model.context(batch)
        kinds = {type(c.mask).__name__ for c in ctx.attention} | {type(ctx.attention[0].local_mask).__name__}
        assert len(ctx.attention) == 2
        assert kinds == ({"MaskRows"} if impl == "triton" else {"Tensor"}), (impl, kinds)
        loss = _loss(model, batch, ctx)
        loss.backward()
        runs[impl] = (loss.detach(), model.index_loss_sum().detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    (loss0, index0, grads0), (loss1, index1, grads1) = runs.values()
    assert float(index0) > 0
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(index1, index0, rtol=1e-5, atol=1e-7)
    assert grads1.keys() == grads0.keys()
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_compressed_sparse_blocks_bad_knobs():
    """csa_layers, csa_rate and csa_topk are checked by name; a block is one kind of compressed attention."""
    for overrides, message in ((dict(csa_rate=1), r"csa_rate: expected >= 2, got 1"),
                               (dict(csa_topk=0), r"csa_topk: expected >= 1, got 0"),
                               (dict(csa_layers=(3,)), r"csa_layers: expected distinct block indices in 0\.\.2, got \(3,\)"),
                               (dict(compress_layers=(1, 2)), r"csa_layers: blocks \[1\] are in compress_layers too"),
                               (dict(q_rank=None), r"csa_topk: compressed sparse attention's indexer reads the normed q latent, needs q_rank"),
                               (dict(linear_layers=(1,)), r"csa_layers: compressed sparse attention blocks attend \(softmax attention\)")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(DSV4_CSA, **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(hash_layers=3), r"hash_layers: expected 0\.\.2, got 3"),
    (dict(hash_layers=1, score="sparsemixer", k=2, expert_bias=False), r"score: hash_layers route by a table of token ids .*not with score='sparsemixer'"),
    (dict(hash_layers=1, score="softmax", pre_softmax=True, expert_bias=False), r"pre_softmax: hash_layers route by a table"),
    (dict(hash_layers=1, zero_experts=2), r"zero_experts: hash_layers route by a table"),
])
def test_hash_layer_knobs_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(hyper_connections=1), r"hyper_connections: expected 0 \(one residual stream, no hyper-connections\) or an int >= 2"),
    (dict(hyper_connections=True), r"hyper_connections: expected 0"),
    (dict(hyper_connections=2, hc_kind="dynamic"), r"hc_kind: expected one of manifold, independent, got 'dynamic'"),
    (dict(hyper_connections=2, hc_magnitude=0.0), r"hc_magnitude: expected a positive finite number"),
    (dict(hyper_connections=2, hc_eps=-1.0), r"hc_eps: expected a finite number >= 0"),
    (dict(hyper_connections=2, hc_sinkhorn_iters=0), r"hc_sinkhorn_iters"),
    (dict(hc_kind="independent"), r"hc_kind: knobs of hyper-connections, need hyper_connections >= 2"),
    (dict(hc_magnitude=1.0, hc_sinkhorn_iters=3), r"hc_magnitude, hc_sinkhorn_iters: knobs of hyper-connections"),
    (dict(hyper_connections=2, mtp_depth=1), r"hyper_connections: streams of sequential blocks, not with shortcut_moe, parallel_blocks, residual_scale "
                                             r"or MTP modules \(got mtp_depth=1; MTP: mtp_depth=0, --model.mtp_depth=0\)"),
    (dict(hyper_connections=2, parallel_blocks=True), r"hyper_connections: streams of sequential blocks"),
    (dict(hyper_connections=2, residual_scale=0.5), r"hyper_connections: streams of sequential blocks.*\(got residual_scale=0.5;"),
    (dict(hyper_connections=2, shortcut_moe=True), r"hyper_connections: streams of sequential blocks"),
])
def test_hyper_connection_knobs_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**_SMALL, **overrides})


def test_beam_knobs_build_what_they_say():
    """depth_scaled_residual: block i's two adds weigh the residual and the branch by
    sqrt((n - 1) / n) and 1 / sqrt(n), n = 2i + 2 and 2i + 3; logit_softcap: the logits are
    c tanh(l / c) of the uncapped model's, and the loss is theirs; nope_temperature_kind
    "power": the NoPE queries' scale (1 + (p + 1) / floor) ** scale; attn_gate_bias: the gate's
    pre-activations plus each head's bias."""
    from fmoe.layers import query_temperature

    torch.manual_seed(0)
    cfg = dataclasses.replace(VARIANTS["beam"], logit_softcap=0.2)  # a cap the initial logits reach
    model = Transformer(cfg).eval()
    assert model.blocks[1].residual_weights == [((3 / 4) ** 0.5, 4 ** -0.5), ((4 / 5) ** 0.5, 5 ** -0.5)]
    block, x = model.blocks[1], torch.randn(24, cfg.hidden)
    batch = _batch(cfg)
    ctx = model.context(batch).attention[0]
    with torch.no_grad():
        mid = x * (3 / 4) ** 0.5 + block._attend(x, ctx) / 2
        want = mid * (4 / 5) ** 0.5 + block._mlp_out(block.mlp_norm(mid))[0] / 5 ** 0.5
        torch.testing.assert_close(block(x, ctx)[0], want)
        ids, cu = batch["input_ids"], batch["cu_seqlens"]
        uncapped = Transformer(dataclasses.replace(cfg, logit_softcap=None)).eval()
        uncapped.load_state_dict(model.state_dict())
        raw, capped = uncapped.logits(ids, cu), model.logits(ids, cu)
        assert raw.abs().max() > 0.2  # the cap bites
        torch.testing.assert_close(capped, torch.tanh(raw / 0.2) * 0.2)
        losses, _ = model(batch, model.context(batch))
        labels = torch.where(batch["loss_mask"].bool(), batch["labels"], -100)
        torch.testing.assert_close(losses["lm_sum"], torch.nn.functional.cross_entropy(capped, labels, reduction="sum"))
        assert block._attend(x, ctx).abs().amin(dim=-1).gt(0).all()
        block.attn.bg.fill_(-1e4)  # every head's gate shut: sigmoid(x wg - 1e4) = 0
        assert not block._attend(x, ctx).any()
    attn = model.blocks[1].attn.cfg
    assert (attn.rope, attn.temperature_kind, attn.temperature_floor) == (False, "power", 4)
    assert model.blocks[0].attn.cfg.temperature_floor is None
    torch.testing.assert_close(query_temperature(torch.tensor([0, 3, 11]), attn), torch.tensor([1.25, 2.0, 4.0]) ** 0.5)


def test_gated_rms_norm_is_the_norm_times_its_low_rank_gate():
    """GatedRMSNorm (norm_gate_rank): y = rmsnorm(x) w, times sigmoid(silu(y gate_down)
    gate_up); in a model, the attention's pre-norm of every block and the MLP's of the MoE
    blocks only."""
    from fmoe.model import GatedRMSNorm

    torch.manual_seed(0)
    norm = GatedRMSNorm(8, 1e-6, 3)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x = torch.randn(5, 8)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), y * torch.sigmoid(torch.nn.functional.silu(y @ norm.gate_down) @ norm.gate_up))
    model = Transformer(VARIANTS["axk2"])
    assert [type(b.attn_norm).__name__ for b in model.blocks] == ["GatedRMSNorm"] * 3
    assert [type(b.mlp_norm).__name__ for b in model.blocks] == ["RMSNorm", "GatedRMSNorm", "GatedRMSNorm"]
    assert model.blocks[1].attn.wg.shape == (20, 4 * 5) and model.blocks[1].attn.wq_b.shape == (20, 4 * 12)  # [2 q_rank, N Dv], [2 q_rank, N D]


def test_the_moe_layer_runs_under_autocast_and_the_reference_model_says_it_does_not():
    """fmoe.model.MoE in a model of one's own under torch.autocast: the shared expert's output
    was refused ("shared: expected shared(x) -> float32"), and a bf16 input failed in the routed
    experts. Now the experts compute in autocast's dtype, as a linear would, and the router in
    float32: the routing is that of the float32 layer on the rounded input, the output within
    bf16 rounding of it (DenseMLP too). The reference Transformer said "params['wq']: expected bfloat16";
    it now says how to run it in bf16."""
    torch.manual_seed(0)
    layer = fmoe.model.MoE(24, 16, fmoe.layers.MoEConfig(n_experts=4, k=2), shared_ffn=8)
    x = torch.randn(37, 24)
    rounded = x.to(torch.bfloat16).float()
    want, want_stats = layer(rounded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, stats = layer(x)
    assert y.dtype == torch.bfloat16 and stats["router_logits"].dtype == torch.float32
    assert torch.equal(stats["router_logits"], want_stats["router_logits"]) and torch.equal(stats["tokens_per_expert"], want_stats["tokens_per_expert"])
    assert float((y.float() - want).abs().max().detach() / want.abs().max().detach()) < 2e-2
    y.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype == torch.float32 for p in layer.parameters())
    dense = fmoe.model.DenseMLP(24, 40, "torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dense(x).dtype == torch.bfloat16
    cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=48, n_experts=4, k=2, ffn_expert=16, n_heads=2,
                            n_kv_heads=1, head_dim=16, mtp_depth=0, impl="torch")
    model = Transformer(cfg)
    ids, cu = torch.randint(0, 64, (12,)), torch.tensor([0, 12], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"^torch\.autocast: the reference Transformer computes"):
        model.logits(ids, cu)


@pytest.mark.parametrize("name", ["gated deltanet", "mamba2"])
def test_decode_under_autocast_is_refused_before_any_layer_writes(name):
    """decode under torch.autocast is refused as forward and logits are, before any layer
    writes the cache: a hybrid's linear layers took the refused tokens into their states
    (the next call's logits were 5 off the right ones), and a model without attention
    decoded in bf16 (0.06 off)."""
    cfg = dataclasses.replace(VARIANTS[name], mtp_depth=0)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    prompt, refused, then = torch.randint(0, cfg.vocab_size, (5,)), torch.randint(0, cfg.vocab_size, (2,)), torch.randint(0, cfg.vocab_size, (1,))
    cache, fresh = model.kv_cache(16), model.kv_cache(16)
    model.decode(prompt, cache)
    model.decode(prompt, fresh)
    states = (cache.conv.clone(), cache.state.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"^torch\.autocast: the reference Transformer computes"):
        model.decode(refused, cache)
    assert cache.lengths == [5] and torch.equal(cache.conv, states[0]) and torch.equal(cache.state, states[1])
    assert torch.equal(model.decode(then, cache), model.decode(then, fresh))


def test_inert_knobs_names_a_feature_s_knobs_set_without_it():
    """inert_knobs(): the knobs away from their defaults whose feature the model lacks (a
    NaN among them), each with what it needs; none once the feature is on. local_rope_dim 0
    (read as unset before) is refused."""
    cfg = TransformerConfig(vocab_size=16, hidden=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8)
    assert cfg.inert_knobs() == {}
    odd = dataclasses.replace(cfg, yarn_beta_fast=float("nan"), index_heads=4, linear_k_dim=8, residual_gate_temperature=1.0)
    assert odd.inert_knobs() == {
        "yarn_beta_fast": "a knob of YaRN's, needs yarn_factor",
        "index_heads": "a knob of a sparse attention's indexer, needs index_topk, index_topk_blocks or csa_layers",
        "linear_k_dim": "a knob of the linear-attention blocks, needs linear_layers",
        "residual_gate_temperature": "a knob of the residual gates, needs residual_gates",
    }
    assert dataclasses.replace(cfg, residual_gates=True, residual_gate_temperature=1.0).inert_knobs() == {}
    with pytest.raises(ValueError, match="local_rope_dim: expected"):
        dataclasses.replace(cfg, window=4, local_rope_base=1e4, local_rope_dim=0)


@pytest.mark.parametrize("qk_norm", ["head", "rms", "head_k"])
def test_bf16_per_head_qk_norms_keep_their_inputs_alone_for_the_backward(qk_norm):
    """The per-head q and k norms of a bf16 model keep q and k in bf16 and each row's inverse
    rms for the backward, as RMSNorm does (rms_norm_saving_input), where the float32 form's
    autograd kept q and k and their normed values in float32: the saved bytes grow over the
    same model without the norms by 2 bytes a q/k element and 4 a row (7680 here; 26176
    before)."""
    T, N, G, D = 64, 4, 2, 8
    saved_bytes = {}
    for qk in (None, qk_norm):
        cfg = TransformerConfig(vocab_size=64, hidden=32, n_layers=1, n_dense=1, n_heads=N, n_kv_heads=G, head_dim=D, ffn_dense=32, qk_norm=qk)
        torch.manual_seed(0)
        model = Transformer(cfg).bfloat16()
        batch = make_batch(torch.randint(0, 64, (T,)), torch.tensor([0, 20, T]))
        with SavedTensors(exclude=model.parameters()) as saved:
            losses, _ = model(batch, model.context(batch))
        saved_bytes[qk] = saved.nbytes
        if qk is not None:
            losses["lm_sum"].backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert saved_bytes[qk_norm] - saved_bytes[None] == 2 * T * (N + G) * D + 4 * T * (N + G)


@pytest.mark.parametrize("zero_centered, bias", [(False, False), (True, False), (False, True)])
def test_a_low_precision_rms_norm_keeps_its_input_alone_for_the_backward(zero_centered, bias):
    """RMSNorm of bf16 x: the plain form's values bit for bit; its backward keeps x (bf16) and
    the inverse rms [T, 1] (it kept x and x / rms(x) in float32: 4x x's bytes, 68112 here
    against 17424), and its gradients are the plain form's autograd ones to float32 rounding."""
    from fmoe.train.metrics import SavedTensors

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6, zero_centered=zero_centered, bias=bias)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(4, 33, 64, generator=g).bfloat16().requires_grad_()
    grad_y = torch.randn(4, 33, 64, generator=g).bfloat16()
    with SavedTensors(exclude=norm.parameters()) as saved:
        y = norm(x)
    assert saved.nbytes == x.numel() * 2 + 4 * 33 * 4  # x, and the inverse rms of each row in float32
    got = torch.autograd.grad(y, [x, *norm.parameters()], grad_y)

    def plain(x, weight, b):  # the eager form, as RMSNorm runs float32 inputs
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6) * (weight.float() + 1.0 if zero_centered else weight.float())
        return (out + b.float() if b is not None else out).to(x.dtype)

    params = [p.detach().clone().requires_grad_() for p in norm.parameters()]
    x2 = x.detach().clone().requires_grad_()
    want_y = plain(x2, params[0], params[1] if bias else None)
    assert torch.equal(y, want_y)
    want = torch.autograd.grad(want_y, [x2, *params], grad_y)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if a.dtype == torch.bfloat16 else 1e-5, atol=1e-2 if a.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_a_low_precision_rms_norm_has_the_plain_form_s_jvp_and_double_backward(zero_centered):
    """rms_norm_saving_input's forward-mode derivative (jvp, through x, weight and bias) and its
    double backward (the gradient of x's gradient, the inverse rms recomputed from x) are the
    plain form's autograd ones."""
    from fmoe.layers import rms_norm_saving_input

    def plain(x, weight, b):
        out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * (weight + 1.0 if zero_centered else weight)
        return out + b

    def saving(x, weight, b):
        return rms_norm_saving_input(x, weight, 1e-6, zero_centered=zero_centered, bias=b)

    g = torch.Generator().manual_seed(0)
    x, w, b, dx, dw, db, grad_y, v = (torch.randn(*s, generator=g) for s in ((3, 8), (8,), (8,), (3, 8), (8,), (8,), (3, 8), (3, 8)))
    tangents = []
    for f in (saving, plain):
        with torch.autograd.forward_ad.dual_level():
            out = f(*(torch.autograd.forward_ad.make_dual(t, d) for t, d in ((x, dx), (w, dw), (b, db))))
            tangents.append(torch.autograd.forward_ad.unpack_dual(out).tangent)
    torch.testing.assert_close(tangents[0], tangents[1], rtol=1e-5, atol=1e-5)
    second = []
    for f in (saving, plain):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        grad_x, = torch.autograd.grad(f(*inputs), inputs[0], grad_y, create_graph=True)
        second.append(torch.autograd.grad((grad_x * v).sum(), inputs[:2]))
    for a, b_ in zip(*second):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_a_cast_keeps_the_float32_tensors_gradients_float32():
    """A cast of a module holding gradients (no zero_grad before it) left the float32 router with a bf16 .grad: its next
    gradients accumulated in bf16, and torch's AdamW refused the step ("expected dtype float for `end`")."""
    layer = fmoe.model.MoE(16, 8, fmoe.layers.MoEConfig(n_experts=4, k=2), shared_ffn=8, router_bias=True)
    layer(torch.randn(6, 16))[0].square().sum().backward()
    before = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.to(torch.bfloat16)
    for name in ("router", "router_bias"):
        p = getattr(layer, name)
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, before[name]), name  # the float32 values, not a bf16 rounding of them
    assert layer.experts.w_up.grad.dtype == torch.bfloat16  # the rest follows the cast, as torch's modules
    layer(torch.randn(6, 16, dtype=torch.bfloat16))[0].float().square().sum().backward()
    assert layer.router.grad.dtype == torch.float32
    torch.optim.AdamW(layer.parameters(), lr=1e-3).step()


def test_a_low_precision_layernorm_centres_in_float32_and_returns_the_input_dtype():
    """centered (a LayerNorm) on a bfloat16 input: (x - mean) / std * weight + bias with the
    statistics in float32, the result in bfloat16 (not the uncentred RMS norm)."""
    torch.manual_seed(0)
    norm = RMSNorm(8, 1e-5, centered=True, bias=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = (torch.randn(4, 8) + 3.0).bfloat16()
    want = torch.nn.functional.layer_norm(x.float(), (8,), norm.weight.detach(), norm.bias.detach(), eps=1e-5).bfloat16()
    got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_kv_cache_reset_starts_every_sequence_over_and_rings_only_narrower_windows():
    """reset() and reset(list) set every named sequence's length to 0; a sliding-window layer
    keeps a ring only when its window is narrower than max_tokens (a window of max_tokens is a
    full layer's store); n_layers counts the mixer-free blocks (nothing cached); nbytes counts
    a store whose values are a view of its keys once."""
    cache = KVCache(TINY, 4, batch=3)
    cache.lengths = [1, 2, 3]
    cache.reset([0, 2])
    assert cache.lengths == [0, 2, 0]
    cache.lengths = [1, 2, 3]
    cache.reset()
    assert cache.lengths == [0, 0, 0]
    sliding = dataclasses.replace(TINY, window=2, window_layers=(1,))
    assert (KVCache(sliding, 2).window_layers, KVCache(sliding, 2).full_layers) == ((), (0, 1, 2))
    assert (KVCache(sliding, 3).window_layers, KVCache(sliding, 3).full_layers, KVCache(sliding, 3).window) == ((1,), (0, 2), 2)
    free = KVCache(dataclasses.replace(TINY, mixer_free_layers=(1,)), 4)
    assert free.full_layers == (0, 2) and free.n_layers == 3
    assert KVCache(TINY, 4).nbytes == 2 * 3 * 4 * 2 * 8 * 4
    assert KVCache(dataclasses.replace(TINY, kv_shared=True), 4).nbytes == 3 * 4 * 2 * 8 * 4  # v a view of k, counted once


def test_kv_cache_write_names_the_store_the_layer_and_the_dtype_it_holds():
    """A layer's keys of another dtype than the cache's are refused by name before any row is
    written; a block held by another pipeline stage refuses to run, naming its index."""
    from fmoe.model import LayerElsewhere

    cache = KVCache(TINY, 4)
    k = torch.ones(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"cache.k: holds torch.float32 \[.., 2, 8\] for layer 1 on cpu, the layer gave torch.bfloat16 \[1, 2, 8\]"):
        cache.write(1, torch.tensor([0]), 1, k, k)
    assert float(cache.k.abs().sum()) == 0
    with pytest.raises(RuntimeError, match="block 1 is held by another pipeline stage"):
        LayerElsewhere(1)(torch.zeros(2, 32))


def test_embed_scale_multiplies_the_embeddings_rounded_to_their_dtype_first_with_round_embed_scale():
    """embed_scale s: the embeddings times s in their dtype; round_embed_scale: times s rounded to that dtype first
    (Gemma's), which differs in bfloat16."""
    ids = torch.arange(TINY.vocab_size)
    scale = 32**0.5
    for rounded in (False, True):
        model = Transformer(dataclasses.replace(TINY, embed_scale=scale, round_embed_scale=rounded)).to(torch.bfloat16)
        rows = model.embed.detach()
        with torch.no_grad():
            assert torch.equal(model._embedding(ids), rows * torch.tensor(scale, dtype=torch.bfloat16) if rounded else rows * scale)
    assert not torch.equal(rows * torch.tensor(scale, dtype=torch.bfloat16), rows * scale)


def test_an_mtp_module_projects_the_normed_embedding_before_the_normed_hidden_state():
    """MTPModule: its block reads [norm(emb); norm(h)] @ proj, the embedding's half first;
    a pipeline chunk's first stage is 0, its last n_stages - 1."""
    from fmoe.model import MTPModule, PipelineChunk

    torch.manual_seed(0)
    mtp = MTPModule(dataclasses.replace(TINY, mtp_depth=1))
    mtp.block.forward = lambda x, ctx, token_mask=None: x
    emb, h = torch.randn(3, 32), torch.randn(3, 32) * 5
    normed = [t * torch.rsqrt(t.square().mean(-1, keepdim=True) + TINY.norm_eps) for t in (emb, h)]
    with torch.no_grad():
        torch.testing.assert_close(mtp(emb, h, None), torch.cat(normed, dim=-1) @ mtp.proj)
    chunks = [PipelineChunk(s, 3, range(s, s + 1)) for s in range(3)]
    assert [(c.first, c.last) for c in chunks] == [(True, False), (False, False), (False, True)]


def test_decode_padded_to_the_token_multiple_writes_and_returns_the_real_tokens_alone(monkeypatch):
    """A decode call whose tokens are padded to the tensor-parallel token multiple (copies of
    the last token): the padding's keys are not written and its logits are dropped, so the
    logits and the cache equal the unpadded call's."""
    model = _sharp(TINY)
    ids = torch.tensor([1, 2, 3])
    plain = model.kv_cache(4)
    with torch.no_grad():
        want = model.decode(ids, plain)
        monkeypatch.setattr(model, "_token_multiple", lambda: 2)
        padded = model.kv_cache(4)
        got = model.decode(ids, padded)
    torch.testing.assert_close(got, want)
    assert padded.length == 3
    torch.testing.assert_close((padded.k, padded.v), (plain.k, plain.v))


@pytest.mark.parametrize("kind", ["manifold", "independent"])
def test_hyper_connection_add_keeps_low_precision_streams_in_their_dtype(kind):
    """HyperConnection.add on bfloat16 streams: the sums in float32, the streams after the
    sublayer back in bfloat16 (x'_s = post_s y + sum_j comb[j, s] x_j, or + x_s)."""
    from fmoe.model import HyperConnection

    torch.manual_seed(0)
    hc = HyperConnection(dataclasses.replace(TINY, hyper_connections=2, hc_kind=kind))
    with torch.no_grad():
        for p in hc.parameters():
            p.normal_(0.0, 0.5)
    x, y = torch.randn(3, 64).bfloat16(), torch.randn(3, 32).bfloat16()
    h, post, comb = hc(x)
    streams = x.float().view(3, 2, 32)
    if comb is not None:
        streams = torch.einsum("tjs,tjh->tsh", comb, streams)
    got = hc.add(x, y, post, comb)
    assert h.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, (streams + post[:, :, None] * y.float()[:, None, :]).reshape(3, 64).bfloat16(), rtol=0, atol=0)
