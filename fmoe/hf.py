"""Hugging Face checkpoints in and out: released MoE models as fmoe Transformers, exactly.

    model, cfg = fmoe.hf.from_pretrained("path/to/Qwen3-30B-A3B")    # a local folder
    fmoe.hf.save_pretrained(model, "out/hf")                            # config.json + safetensors

A folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). Supported `model_type`s: FAMILIES (mixtral, qwen2_moe,
qwen3_moe, olmoe, flex_olmo, glm4_moe, deepseek_v3, axk1, kimi_k2, kimi_k25, deepseek_v2, deepseek_v32, glm_moe_dsa, hy_v4, hy_v4_vl_text,
hy_v4_vl, deepseek_v4, glm4_moe_lite, gpt_oss, solar_open,
exaone_moe, kolibri1, beam, axk2, dots1, minimax_m2, minimax, granitemoe, granitemoeshared, granitemoe_swa, granitemoehybrid, jetmoe, nemotron_h, mamba2, mamba, falcon_mamba, jamba, hunyuan_v1_moe, llama4_text, llama4, afmoe,
laguna, step3p5, step3p7, aria_text, aria, cohere2_moe, sarvam_moe, sarvam_mla, longcat_flash, bailing_hybrid, flint, hy_v3, mellum, qwen3_next, qwen3_5_moe_text, qwen3_5_moe, lara_mini, qwen3_vl_moe, qwen3_vl, qwen3_omni_moe, glm4v_moe, glm4v, glm46v, ernie4_5_vl_moe, kimi_linear, ernie4_5_moe,
mimo_v2_flash, lfm2_moe, mistral4, mistral3, dbrx, phimoe, gemma3, gemma4_text, gemma4, gemma4_unified_text, gemma4_unified, muse_spark_text,
muse_spark), and the dense
DENSE_FAMILIES (llama, exaone, cwm, olmo, phi, starcoder2, gpt_neox, persimmon, falcon, bloom, mpt, gptj, codegen, gpt_neo, gpt_bigcode, gpt2, opt, biogpt, mistral, ministral3, qwen2, qwen3, olmo2, olmo3, granite, granite_swa, hyperclovax, youtu, helium, minicpm3, arcee, gemma, vaultgemma, gemma2, gemma3_text, lfm3, smollm3, exaone4, seed_oss, hunyuan_v1_dense, phi3,
glm4, ernie4_5, lfm2, cohere, cohere2, bamba, falcon_h1, stablelm, qwen3_5_text (and qwen3_5's text model), nemotron, apertus,
apertus1p5_text (and apertus1p5's text model), olmo_hybrid, jais2, glm, internlm3,
iquestcoder, ministral, nanochat, cohere_compass_text (and cohere_compass's text model), muse_glimmer_text (and muse_glimmer's):
Transformers without MoE blocks, to fine-tune or to upcycle into an MoE with fmoe.train.upcycle). Each family has one table: its
config mapping (`config_to_fmoe`, which refuses what fmoe does not build: OLMoE's q and k clamped after their norms, ...;
the fields a config.json leaves out read at transformers' defaults, Family.defaults, and a
family's own names for the fields the shared mappings read as those, Family.aliases)
and its key map (HF key <-> fmoe
parameter, with the layout change: HF linear weights [out, in] are transposed to fmoe's
[in, out]; the per-expert matrices are stacked into [E, H, F] / [E, F, H] and split back
on export; the router stays float32). A model parameter outside the MTP modules that the
key map does not name is refused on load, never left at its initial value; so is a
checkpoint key that the config reads nowhere (unread_keys), unless strict=False, but for
what acts on nothing (transformers' 0-row shared MLP of a config without shared experts),
which is kept and written back as stored.

Routing: HF's softmax routers take the top-k of softmax(logits) and, with norm_topk_prob
(Mixtral always), renormalise the k weights: fmoe's default softmax routing (softmax over
the k chosen logits) is that; without it, fmoe's pre_softmax (weights not renormalised).
GLM-4.5, GLM-4.7-Flash, DeepSeek-V3, Solar Open, EXAONE MoE and dots.llm1 route on sigmoids plus
e_score_correction_bias (fmoe's expert_bias buffer), score groups by their best 2
(group_score_topk=2), renormalise with norm_topk_prob (route_normalize) and scale by
routed_scaling_factor (route_scale); MiniMax-M2 routes on sigmoids plus the correction
bias without groups, always renormalised. DeepSeek-V2 takes the top-k of softmax over
every expert (pre_softmax), with group_limited_greedy groups scored by their best expert
(group_score_topk=1), scaled by routed_scaling_factor. ERNIE 4.5 chooses on softmax(logits)
plus its correction bias and renormalises the chosen probabilities: fmoe's softmax routing
with an expert_bias.

MTP: DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash store MTP depth d as layer n_layers + d - 1
(enorm, hnorm, eh_proj, a block, shared_head.norm, and copies of the embedding and the
head, which fmoe shares). from_pretrained loads as many depths as the checkpoint holds (mtp_depth=
overrides; depths it lacks start fresh; save_pretrained counts the depths it writes in
config.json's num_nextn_predict_layers where they are not the folder's); other families'
MTP modules always start fresh and are not exported. An MTP module without its own output
norm (mtp_norm=False: it uses the final norm) is exported with a copy of the final norm as
its shared_head.norm, so the folder reads back (mtp_norm=True) as the same model. FP8: weights stored as float8 with `weight_scale_inv` block scales
(quantization_config.weight_block_size; a stack of experts' matrices each on its own blocks; the scales float32, or
DeepSeek-V4's powers of two, float8_e8m0fnu or biased uint8) are dequantised to float32 on load; so are DeepSeek-V4's FP4
experts (quantization_config.expert_dtype "fp4": int8 weights holding two e2m1 codes a byte, the low nibble first, beside
a weight_scale_inv grid whose blocks the shapes give, dequantize_fp4), and
compressed-tensors' packed integers (`weight_packed`, `weight_scale`, `weight_shape`:
symmetric int4 in groups of 32 for the experts of Kimi K2-Thinking and K2.5,
dequantize_int_packed). The export writes them in the config's dtype, without the
quantization_config.

gpt-oss: the experts are stacks ([E, H, 2F] gate_up_proj with gate and up interleaved,
[E, F, H] down_proj, and their biases), split into fmoe's w_gate / w_up (Tensor.part) and
joined back on export; the released MXFP4 experts (`*_blocks` and `*_scales`, quant_method
"mxfp4") are dequantised on load (dequantize_mxfp4), this rank's experts only, then cast to
the parameters' dtype.

MiniMax-Text-01 / M1 (minimax): lightning attention (fmoe.layers' linear_kind "lightning")
beside softmax attention, Mixtral's MoE, each sublayer's residual its normed input
(normed_residual). The lightning layers' decay tables (slope_rate, query_decay, key_decay,
diagonal_decay) are constants of the config (constant_tensors): a folder's slope_rate is
checked against fmoe's decay on load, and the tables are written on export as transformers
computes them.

GraniteMoE / GraniteMoeShared (IBM Granite 3 MoE): Mixtral's routing with Granite's
multipliers (TransformerConfig.attn_scale, embed_scale, residual_scale, logit_divisor); the
experts are stacks of linear weights, input_linear [E, 2F, H] (the gate's F rows, then the
up's: Tensor.chunk) and output_linear [E, H, F], and so is the shared MLP ([2Fs, H], [H, Fs]).
JetMoE (jetmoe): a mixture of attention heads in every block (TransformerConfig.moa_experts:
each token's top-k attention experts' query and output projections, self_attention.experts'
input_linear [E, G D, H] and output_linear [E, H, G D], over the kv heads of kv_proj: the
keys' rows, then the values'; the router experts.router.layer; the bias experts.bias as
o_bias's) and Granite's experts' stacks in its MoE, a bias on its output (mlp.bias:
moe_out_bias).
Hunyuan-A13B: its router is gate.wg, its q/k norms query_layernorm / key_layernorm
(Family.router, Family.qk_norms), applied after RoPE.
Sarvam-30B (sarvam_moe): GLM-4.5's model under its released checkpoint's names
(Family.embed, attention, qkv, o_proj): model.word_embeddings, attention.query_key_value
[(N + 2 Nkv) D, H] whose rows are q, k and v (Tensor.chunk of unequal runs, with the
biases likewise), attention.dense, query_layernorm / key_layernorm, gate.expert_bias.
Llama 4 (llama4_text, the text model of Llama4ForCausalLM): the experts are [E, H, 2F]
gate_up_proj (the gate's F columns, then the up's: Tensor.chunk) and [E, F, H] down_proj
stacks; RoPE on interleaved pairs; chunked attention, NoPE layers with the query
temperature, weightless q/k norms and the routing weights on the experts' input
(_llama4_text). A released llama4 folder (Llama4ForConditionalGeneration) holds that text
model under language_model. (Family.prefix) beside a vision model that is not read
(Family.not_read); it is written back only as llama4_text (Family.written_as).
Kimi K2 (kimi_k2: K2-Instruct, K2-Thinking) is DeepSeek-V3's model under its own model_type,
written back as its folder had it (its remote code's model_type; model_type="deepseek_v3"
writes a folder transformers reads without remote code). A released Kimi K2.5 / K2.6 folder
(kimi_k25) holds that model under language_model. beside a vision tower, and is written
back only as deepseek_v3. A.X-K1 (axk1) is DeepSeek-V3's model with an RMSNorm on each MoE
block's output (post_mlp_layernorm: moe_out_norm); its released folders hold one for the dense
blocks too, which nothing reads (Family.ignored), and route without a correction bias, which
reads as zero (Family.correction_bias_optional). LongCat-Flash (longcat_flash): layer j's two
sublayers are fmoe's shortcut pair of blocks 2j and 2j + 1 (shortcut_moe; Family.pairs: the
attention, the pre-norms and the dense MLP as self_attn.{s}, input_layernorm.{s},
post_attention_layernorm.{s}, mlps.{s}; the pair's MoE under mlp., its router as
router.classifier), multi-latent attention with its q and kv latents scaled (mla_scales) and
identity experts (zero_experts). transformers keeps a gate and up projection for each zero
expert too, unused (Family.zero_expert_rows): they are not read, and are written as zeros
(zero_expert_keys), which transformers needs to load the folder, unless the model was read
from a folder without them (a released one: keep_folder_layout); the MTP layer under
model.mtp. is not read, as in transformers.
DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek-V3's model with DeepSeek sparse
attention in every block, its lightning indexer under self_attn.indexer (wq_b, wk, k_norm's
weight and bias, weights_proj: TransformerConfig.index_*), the indexer's RoPE on halves
(DeepSeek-V3.2) or interleaved pairs (GLM-5); GLM-5's layers without an indexer (indexer_types
"shared") attend to the keys the previous full layer chose (index_shared_layers).
MiniMax-M3 (minimax_m3_vl_text, and the released minimax_m3_vl folders: the text model under
language_model. in MiniMax-M2's names beside a vision tower, which is not read, written back as
minimax_m3_vl_text): block-sparse attention in the layers layer_types names minimax_m3_sparse, its
indexer under self_attn.indexer (q_proj, k_proj, q_norm, k_norm; the released self_attn.index_q_proj,
...: TransformerConfig.index_topk_blocks and the index_* knobs), per-head q/k norms and every norm
of gain 1 + weight, dense and MoE blocks by mlp_layer_types, sigmoid routing with the correction
bias beside a shared expert (gate_up_proj, Family.shared_gate_up), every SwiGLU gpt-oss's clamped
one (up + 1; shared_swiglu_alpha / _offset); MTP modules are not read.
HY-V4 (hy_v4): hc_mult residual streams of independent hyper-connections (under
layers.{i}.hc_pre.hc_attn_layer / hc_mlp_layer and model.hc_pre.hc_head, Family.hyper) around
DeepSeek-V3.2's sparse attention with HY-V4's own pieces: the indexer's RoPE on its last
channels (index_rope_last), an elementwise sigmoid output gate (linear_gate) and a sink per head
(learnable_sink_param), the routed experts' SwiGLU clamped; its MTP layers are not read.
A released HY-V4-VL folder (hy_v4_vl) holds HY-V4's text model with RoPE on interleaved pairs
(the indexer's too) and its latent norms at rms_norm_eps (mla_norm_eps), as HY-V4's folders
hold it, beside a vision tower (vit.) that is not read; the head's hyper-connection weights
under model.hc_head.hc_pre. (as transformers writes them) or HY-V4's prefix
(Family.hyper_head_too); written back as hy_v4_vl_text.
DeepSeek-V4 (deepseek_v4), its sliding, compressed sparse and heavily compressed attention
layers (layer_types): manifold hyper-connections (hc_attn_,
hc_ffn_, model.hc_head.hc_), one key head (wkv, norm) that is its values, queries from wq_a,
q_norm, wq_b (Family.q_latent), the grouped output projection (wo_a, wo_b), sinks, the HCA
layers' compressor (compressor.wkv, wgate, ape, norm: Family.compressor), the CSA layers' overlapping
one and their indexer (indexer.wq_b, weights_proj and its compressor: Family.csa_indexer) and YaRN'd RoPE beside
the sliding layers' plain one; hash_moe blocks reading gate.tid2eid (Family.hash_table) before
sqrt(softplus) MoE blocks; mtp. not read.
Kolibri-1 (kolibri1): EXAONE's attention in GLM-4's sandwich blocks (the released
post_attn_norm / post_ffn_norm), every block MoE with a shared expert, routed on the logits
plus the correction bias (expert_bias_on_logits; released as layers.{i}.moe.router.expert_bias,
beside the MoE block: Family.correction_bias "../") and weighted by the chosen sigmoids.
Mistral 4 (mistral4, Mistral Small 4's text model): DeepSeek-V3's multi-latent attention with
the queries scaled by position (TransformerConfig.query_temperature_floor / _scale, from
rope_parameters' original_max_position_embeddings / llama_4_scaling_beta), softmax routing
(renormalised by norm_topk_prob) beside shared experts, the experts as [E, 2F, H] / [E, H, F]
stacks. A released mistral3 folder (Mistral3ForConditionalGeneration) holds that model, or
a dense Ministral 3 (ministral3: Mistral's blocks with YaRN and the same query scale) or
Mistral (Mistral Small 3.x) one, under language_model. beside a vision model that is not
read, and is written back only as its text model's family (Family.written_as "text_config").
A released LLaVA-style folder (_LLAVA: llava, llava_next, llava_next_video, llava_onevision,
internvl, vipllava, video_llava; idefics3 and smolvlm) holds Llama's, Mistral's, Qwen2's, Qwen3's, Qwen3-MoE's or
Granite 3's text model (_LLAVA_TEXT; Granite Vision's, its logits unscaled) the same way,
under language_model. (Idefics3's and SmolVLM's under model.text_model., the head at
lm_head.), and is written back the same way.
A released LFM2-VL, LFM3-VL, EXAONE 4.5, Granite 4.0 Vision, Command A Vision, Aya Vision,
HyperCLOVA X SEED Vision, Granite Speech (Plus), MiniCPM-V 4.6 / 4.7, DeepSeek-VL, AudioFlamingo 3,
Music Flamingo, Qwen2-Audio, Qwen3-ASR, MOSS Transcribe-Diarize, LightOnOCR, Fun-ASR-Nano, GLM-ASR,
GOT-OCR 2.0, Ovis2, VideoLLaMA 3, Qianfan-OCR, Janus, DeepSeek-VL-Hybrid, Idefics2, Granite Docling, BLIP-2,
InstructBLIP (-Video), Emu3, Fuyu or Nemotron 3 Nano Omni folder (_VL_TEXT) holds LFM2's, LFM3's, EXAONE 4.0's,
Granite 3's, Cohere 2's, HyperCLOVA X's, Qwen3.5's, Llama's, Mistral's, OPT's, Persimmon's, Qwen2's, Qwen3's or Nemotron-H's text
model under model.language_model. (Idefics2's and Granite Docling's under model.text_model.; the older layout: all of it, head
included, under language_model. (Emu3's text_model.): Family.outer; Qianfan-OCR's text layers there as released or as
transformers writes them, Family.layout_too) beside a vision or audio encoder and its
projectors that are not read, and is written back only as that family.
A released Molmo2 folder (molmo2) holds Qwen3's or OLMo 2's text model (by qk_norm_type and
norm_after) under OLMo-core's names (fused att_proj and ff_proj, the embedding's rows in
wte.embedding then wte.new_embedding: Family.embed_too, Tensor.cat) beside a head of its first
vocab_size rows (out_vocab) and a vision backbone that is not read.
A released Qwen3-VL-MoE folder (qwen3_vl_moe) holds Qwen3-MoE's text model (its router always
renormalised) under model.language_model., the dense Qwen3-VL (qwen3_vl) Qwen3's, beside a
vision model that is not read; a Qwen3-Omni folder (qwen3_omni_moe) holds Qwen3-MoE's under
thinker. beside its audio and vision encoders, talker and code-to-wave model, none read.
Each is written back only as qwen3_moe / qwen3 (_multimodal_text: the mrope_section of text
positions is plain RoPE). A released Qwen2-VL / Qwen2.5-VL folder (qwen2_vl, qwen2_5_vl) holds
Qwen2's text model where Qwen2 keeps it (model., lm_head) beside a vision model under visual.
that is not read (its config's text fields at the top level, or in a text_config as
transformers 5 writes it), and is written back only as qwen2; a Qwen2.5-Omni folder
(qwen2_5_omni) Qwen2's under thinker., as Qwen3-Omni's. A released GLM-4.5V / GLM-4.6V folder (glm4v_moe) holds GLM-4.5's
text model (glm4_moe's, without q/k norms) under model.language_model. beside a vision model
that is not read, and is written back only as glm4_moe; a GLM-4.1V / GLM-4.6V-Flash folder
(glm4v, glm46v) GLM-4's dense text model, written back only as glm4. Qwen3-VL-MoE's experts are stacks, [E, H, 2F] / [E, F, H] as
released or [E, 2F, H] / [E, H, F] as transformers writes them, told apart by their shapes
(Family.stacks_by_shape).
Kimi Linear (kimi_linear): Kimi Delta Attention blocks under self_attn (q/k/v_proj,
q/k/v_conv1d, the decay's f_a_proj / f_b_proj, dt_bias, A_log [1, 1, N, 1] (Tensor.unit of
several dims), b_proj, the gate's g_a_proj / g_b_proj, o_norm, o_proj), multi-latent attention
without RoPE, Mixtral's expert names under block_sparse_moe with DeepSeek-V3's routing and
shared experts; the dense MLP under mlp or block_sparse_moe (Family.dense_too).
Ling's hybrid models (bailing_hybrid): Kimi Delta Attention in Ling's variant under attention.
(Family.linear "ling": q/k/v_proj, q/k/v_conv1d, the whole f_proj and g_proj, dt_bias, A_log
[N], b_proj, o_norm, dense: linear_full_rank, linear_decay_bound) beside multi-latent attention
with a sigmoid gate per head (g_proj) and its output projection dense (Family.o_proj); the
embedding model.word_embeddings, DeepSeek-V3's MoE blocks with the correction bias as
gate.expert_bias; the MTP layers after the trunk's not read (Family.extra_layers_read).
Step 3.5 Flash (step3p5; Step3p5ForCausalLM, read as transformers' Step3p7TextModel): the
router, correction bias and experts' stacks under moe. (gate.weight, router_bias, [E, F, H]
gate_proj / up_proj and [E, H, F] down_proj linear weights: Family.fused "stacks_out", the MoE
block the layer itself, Family.moe ""), the shared expert share_expert beside them; the MTP
layers after the trunk's not read. Step 3.7 Flash (step3p7): that text model beside a vision
model (vision_model., vit_large_projector.) that is not read; written back as step3p5.
Muse Glimmer (muse_glimmer_text, dense) and Muse Spark (muse_spark_text): text models transformers has no causal LM of
(written with their base model's class as the architecture); the released muse_glimmer / muse_spark folders hold them under
model.language_model. beside vision (and audio) towers that are not read, and are written back as those text models. Both:
zero-centred sandwich norms with the post-norms' own eps, a weightless embeddings' norm and a plain final norm
(TransformerConfig.norm_overrides, post_norm_eps), gated attention with weightless q/k norms; Muse Spark's attention
post-norm has no weight (no key) and its MLP post-norm is prescaled, each residual add has a gate (layers.{i}.
post_attention_residual_gate.gate / post_feedforward_residual_gate.gate, Family.residual_gates), and its latent MoE blocks
keep the experts' stacks as transformers writes them ([E, 2F, L] gate_up_proj, [E, L, F] down_proj) beside pre_expert_proj,
pre_expert_norm, experts.post_expert_norm and post_expert_proj (Family.latent, latent_norm, expert_out_norm).
Gemma 2 (gemma2, dense): Gemma 3's blocks without q/k norms, every attention score capped
(attn_softcap). LFM3 (lfm3, dense): LFM2's names for its convolutions and MLPs, Qwen3's for
its attention (o_proj, q_norm, k_norm), the gate per head as the checkpoints name it (gate_proj).
Gemma 3 (gemma3_text, dense): GeGLU MLPs (mlp_act "gelu_tanh"), zero-centred sandwich norms,
the embeddings x sqrt(hidden), linear RoPE in the global layers; a released gemma3 folder
(Gemma3ForConditionalGeneration) holds it under language_model. beside a vision model that is
not read, and is written back only as gemma3_text.
Gemma 4 (gemma4_text): its MoE is the layer's own (Family.moe ""): router.proj, router.scale
(router_norm), router.per_expert_scale (router_expert_scale) and the experts' stacks under
model.layers.{i}, beside the dense mlp with its own norms (Family.beside_norms); the full
layers' head dim and kv heads per layer (per_layer_config), no v_proj there with
attention_k_eq_v; each layer's layer_scalar a buffer. A released gemma4 folder holds it
under model.language_model. beside vision and audio models that are not read, and is
written back only as gemma4_text.
Lara Mini (lara_mini): Qwen3.5's Gated DeltaNet blocks with q, k, v, z, b and a as runs of one
in_proj's rows (Family.linear "fused", Tensor.chunk) and the gated norm as out_norm, beside
Qwen3's attention over a window with RoPE or global without; plain RMSNorms.
OLMo Hybrid (olmo_hybrid, dense): OLMo 3's post-norm attention blocks beside pre-norm Gated
DeltaNet blocks (linear_pre_norms; attention_layer_norm, feedforward_layer_norm in its files),
whose q, k, v, gate, b and a projections and q, k, v convolutions are modules of their own
under linear_attn. (Family.linear "split"), with the write strength in [0, 2]
(linear_neg_eigval).

Loading reads the safetensors files tensor by tensor with the `safetensors` library (an
expert stack is filled expert by expert): the checkpoint is never in memory twice. Into a
model whose parameters are DTensors (fmoe.parallel.parallelize, e.g. built on the meta
device and materialised), each rank reads only its own block of each tensor (safetensors
slices; an expert stack, only this rank's experts) and copies it into its shard.

Export writes the same keys, dtypes and config back: a model loaded and saved again gives
files bit-identical to the originals (`from_pretrained` keeps the HF config on the model,
`model.hf_config`); a model of fmoe's own is written with `model_type=` one of FAMILIES
and a config built from its TransformerConfig. The export is streamed: one parameter at
a time is gathered and converted, and rank 0 writes shards of at most max_shard_bytes
of tensors (with model.safetensors.index.json), so a model sharded over many devices is
written without any rank holding it whole.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from fmoe.layers import PLAIN_ACTS, XIELU, lightning_decay
from fmoe.model import Transformer, TransformerConfig, local_block
from fmoe.ops.checks import MissingExtra
from fmoe.ops.rope import yarn_mscale


# ------------------------------------------------------------------------------ configs
def _get(hf: dict, *names, default=None):
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    return default


def _rope_params(hf: dict, scaled: Optional[str] = None, needs: tuple[str, ...] = (), default_base: float = 10000.0) -> tuple[str, dict, dict]:
    """config.json's RoPE: (its rope type; the parameters, from rope_parameters or the older
    rope_scaling; {"rope_base": rope_theta}). With `scaled`: ValueError for a type other than
    "default" and it, or a `scaled` one without the fields `needs` names."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if scaled is not None and rope_type not in ("default", scaled):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported for {hf.get('model_type')} (plain RoPE or {scaled})")
    missing = [name for name in needs if rope_type == scaled and name not in params]
    if missing:
        raise ValueError(f"config.json: rope_parameters of rope type {scaled!r} lack {', '.join(missing)}")
    return rope_type, params, dict(rope_base=float(params.get("rope_theta", hf.get("rope_theta", default_base))))


def _rope(hf: dict) -> dict:
    """RoPE of the Llama-like families: plain (rope_theta), with Llama 3.1's scaling
    (rope_type "llama3": factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), or YaRN as their attention applies it (rope_type
    "yarn": Qwen2.5's and Qwen3's long context; _llama_yarn). Without
    original_max_position_embeddings the scaled types read it as transformers does
    (_original_max_positions)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "llama3", "yarn"):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported for {hf.get('model_type')} (plain RoPE, llama3 or yarn)")
    if rope_type == "yarn":
        return _llama_yarn(hf)
    rope_type, params, out = _rope_params(hf, "llama3", ("factor", "low_freq_factor", "high_freq_factor"))
    if rope_type == "default":
        return out
    return dict(out, llama3_factor=float(params["factor"]), llama3_low_freq_factor=float(params["low_freq_factor"]),
                llama3_high_freq_factor=float(params["high_freq_factor"]), llama3_original_max_positions=_original_max_positions(hf, params))


def _original_max_positions(hf: dict, params: dict) -> int:
    """The context a scaled RoPE (llama3, yarn) was pretrained over, as transformers reads it
    for the Llama-like families: rope_parameters' original_max_position_embeddings, else
    max_position_embeddings (a top-level original_max_position_embeddings is not read; Phi-3's
    LongRoPE reads it first: _longrope)."""
    positions = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if positions is None:
        raise ValueError(f"config.json: rope_parameters of rope type {params.get('rope_type', params.get('type'))!r} lack "
                         "original_max_position_embeddings (nor is max_position_embeddings set)")
    return int(positions)


def _refuse(hf: dict, field: str, ok: Callable[[object], bool], what: str) -> None:
    if field in hf and not ok(hf[field]):
        raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported ({what})")


def _sliding(hf: dict) -> dict:
    """The sliding window of Mixtral, Qwen2-MoE and Qwen3-MoE: sliding_window W (with
    use_sliding_window where the family has it) in every layer, or in the layers that
    layer_types names "sliding_attention" (Qwen2-MoE; a config.json without layer_types gets
    them from its family first, e.g. _max_window_layers); a query sees keys > its index - W."""
    kinds = hf.get("layer_types")
    window = hf.get("sliding_window")
    if kinds is not None:
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown or len(kinds) != hf["num_hidden_layers"]:
            raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of full_attention / sliding_attention per layer)")
        layers = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    else:
        layers = tuple(range(hf["num_hidden_layers"])) if window and hf.get("use_sliding_window", True) else ()
    if not layers:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window = {window!r} is not supported (a positive width for the sliding layers)")
    return dict(window=window, window_layers=None if len(layers) == hf["num_hidden_layers"] else layers)


def _max_window_layers(hf: dict, slides: Callable[[int, int], bool]) -> dict:
    """config.json with the layer_types transformers derives where it has none (Qwen2's,
    Qwen3's and Qwen2-MoE's as transformers 4.x wrote them): layer i slides where
    use_sliding_window (false by default) and a sliding_window are set and
    slides(i, max_window_layers) (max_window_layers 28 by default), the others full."""
    if hf.get("layer_types") is not None:
        return hf
    on = bool(hf.get("use_sliding_window", False)) and hf.get("sliding_window") is not None
    first = hf.get("max_window_layers", 28)
    return dict(hf, layer_types=["sliding_attention" if on and slides(i, first) else "full_attention" for i in range(hf["num_hidden_layers"])])


def _common(hf: dict, n_experts: int, *, sliding: bool = False) -> dict:
    """The Llama-like fields every family shares; with sliding the family's sliding window
    (_sliding), else a sliding window is refused."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act = {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if not sliding:
        _refuse(hf, "sliding_window", lambda v: not v or not hf.get("use_sliding_window", True), "no sliding-window attention in this family")
    heads = hf["num_attention_heads"]
    return dict(**(_sliding(hf) if sliding else {}),
        vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=_get(hf, "num_key_value_heads", default=heads), head_dim=_get(hf, "head_dim", default=hf["hidden_size"] // heads),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), **_rope(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        n_experts=n_experts, k=hf["num_experts_per_tok"], score="softmax", expert_bias=False, mtp_depth=0,
    )


def _dense(hf: dict, *, sliding: bool = False, mlp_bias: bool = False, **extra) -> dict:
    """A dense Llama-style model (DENSE_FAMILIES): every block a SwiGLU MLP of
    intermediate_size, in fmoe a Transformer with no MoE block (n_dense = n_layers; the MoE
    fields, unused, at one expert of that size). What fine-tuning and upcycling start from.
    mlp_bias: the family's MLPs read config.json's mlp_bias (Llama's, Jais 2's: biases on
    their projections, TransformerConfig.mlp_bias); without it an mlp_bias is refused."""
    if mlp_bias:
        _refuse(hf, "mlp_bias", lambda v: isinstance(v, bool), "true or false")
    else:
        _refuse(hf, "mlp_bias", lambda v: not v, "no MLP biases")
    _refuse(hf, "pretraining_tp", lambda v: v == 1, "a plain matmul: pretraining_tp = 1")
    F = hf["intermediate_size"]
    return dict(_common(dict(hf, num_experts_per_tok=1), 1, sliding=sliding), ffn_dense=F, ffn_expert=F, n_dense=hf["num_hidden_layers"],
                n_shared=0, mlp_bias=bool(hf.get("mlp_bias", False)), **extra)


def _llama(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))  # on q, k, v and o
    return _dense(hf, qkv_bias=bias, o_bias=bias, mlp_bias=True)


def _internlm3(hf: dict) -> dict:
    """InternLM3 (internlm3, dense; internlm3-8b): Llama's model, its biases on q, k, v and o
    (attention_bias, released as qkv_bias) and on the MLPs (mlp_bias, released as bias) one
    setting: transformers refuses them apart, and so does this."""
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ValueError(f"config.json: qkv_bias (attention_bias) = {hf.get('attention_bias')!r} beside bias (mlp_bias) = {hf.get('mlp_bias')!r} "
                         "is not supported (InternLM3's attention and MLP biases are one setting)")
    return _llama(hf)


def _iquestcoder(hf: dict) -> dict:
    """IQuest-Coder (iquestcoder, dense; IQuest-Coder-V1): Llama's model; clip_qkv and a sliding
    window refused, as transformers refuses them."""
    _refuse(hf, "clip_qkv", lambda v: v is None, "no clamp of q, k and v")
    _refuse(hf, "use_sliding_window", lambda v: not v, "no sliding window")
    return _llama(hf)


def _jais2(hf: dict) -> dict:
    """Jais 2 (jais2, dense; Jais-2-8B): Llama's blocks with LayerNorms with biases
    (layer_norms, norm_bias; eps layer_norm_eps), MLPs without a gate, relu(x up_proj)^2
    down_proj (mlp_act "relu2"), biases on q, k, v and o (attention_bias) and on the MLPs'
    projections (mlp_bias), both on by default."""
    _refuse(hf, "hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    bias = bool(hf.get("attention_bias", True))
    return _dense(dict(hf, hidden_act="silu", rms_norm_eps=hf.get("layer_norm_eps", 1e-5), mlp_bias=hf.get("mlp_bias", True)), mlp_bias=True,
                  mlp_act="relu2", layer_norms=True, norm_bias=True, qkv_bias=bias, o_bias=bias)


def _nanochat(hf: dict) -> dict:
    """NanoChat (nanochat, dense; karpathy's nanochat models as transformers converts them):
    every norm without weights (norm_weights False): the blocks' pre-norms, the final norm, and
    a norm of the embeddings before the first block (embed_norm: transformers applies its one
    final norm module there too); RoPE turned the other way (rope_reversed: its rotate_half is
    (x2, -x1)), q and k RMS-normed without weights after it (qk_norm "rms",
    qk_norm_after_rope); MLPs without a gate, relu(x fc1)^2 fc2 (mlp_act "relu2"); the logits
    capped at final_logit_softcapping (15 by default; None: none); no biases."""
    _refuse(hf, "hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases")
    cap = hf.get("final_logit_softcapping", 15.0)
    return _dense(dict(hf, hidden_act="silu"), mlp_act="relu2", norm_weights=False, embed_norm=True, rope_reversed=True, qk_norm="rms",
                  qk_norm_after_rope=True, logit_softcap=None if cap is None else float(cap))


def _helium(hf: dict) -> dict:
    """Helium (helium, dense; Kyutai's Helium 1): Llama's blocks with RoPE on interleaved pairs;
    attention biases refused, MLP biases read (mlp_bias)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Helium's attention here")
    return _dense(hf, rope_interleaved=True, mlp_bias=True)


def _mistral(hf: dict) -> dict:
    return _dense(hf, sliding=True)  # Llama's blocks, a sliding window over every layer where sliding_window is set


def _phi(hf: dict) -> dict:
    """Phi (phi, dense; phi-1, phi-1.5, phi-2): the attention and the MLP of one LayerNorm's output
    (with bias, layer_norm_eps) added together to the residual (parallel_blocks), biases on q,
    k, v and the output projection (dense), RoPE on the first partial_rotary_factor of each
    head's channels (halves), MLPs without a gate, gelu_new(x fc1) fc2 with biases (mlp_act
    "gelu_new", GELU's tanh form), a final LayerNorm with bias and a head with a bias."""
    _refuse(hf, "qk_layernorm", lambda v: not v, "no q/k LayerNorms (one shared by the heads) here")
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "GELU's tanh form, gelu_new")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return _dense(dict(hf, hidden_act="silu", head_dim=head_dim, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), mlp_bias=True), mlp_bias=True,
                  qkv_bias=True, o_bias=True, mlp_act="gelu_new", layer_norms=True, norm_bias=True, parallel_blocks=True, head_bias=True,
                  rope_dim=_partial_rope(dict(partial_rotary_factor=factor), head_dim))


def _starcoder2(hf: dict) -> dict:
    """StarCoder2 (starcoder2, dense; StarCoder2-3B / 7B / 15B): Mistral's blocks with LayerNorms
    with bias (norm_epsilon), MLPs without a gate, gelu_pytorch_tanh(x c_fc) c_proj (mlp_act
    "gelu_new", GELU's tanh form), biases on q, k, v, o and both MLP projections with use_bias
    (by default), a sliding window in every layer where sliding_window is set."""
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_pytorch_tanh", "gelu_new"), "GELU's tanh form, gelu_pytorch_tanh")
    bias = bool(hf.get("use_bias", True))
    return _dense(dict(hf, hidden_act="silu", rms_norm_eps=hf.get("norm_epsilon", 1e-5), mlp_bias=bias), sliding=True, mlp_bias=True,
                  qkv_bias=bias, o_bias=bias, mlp_act="gelu_new", layer_norms=True, norm_bias=True)


def _gpt_neox(hf: dict) -> dict:
    """GPT-NeoX (gpt_neox, dense; Pythia, GPT-NeoX-20B): LayerNorms with bias (layer_norm_eps),
    q, k and v as each head's rows of one query_key_value module (its q, k and v in turn:
    Family.qkv_per_head), biases on them and on the output projection dense (attention_bias),
    RoPE on the first partial_rotary_factor (rotary_pct) of each head's channels (halves), MLPs
    without a gate, act(x dense_h_to_4h) dense_4h_to_h with biases (hidden_act gelu: GELU's
    exact form, mlp_act "gelu"; gelu_new: its tanh form); with use_parallel_residual (by
    default) the attention and the MLP, each of its own LayerNorm, added together to the
    residual (parallel_blocks, parallel_norms)."""
    acts = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new"}
    _refuse(hf, "hidden_act", lambda v: v in acts, "GELU, exact (gelu) or in its tanh form (gelu_new)")
    heads = hf["num_attention_heads"]
    _refuse(hf, "num_key_value_heads", lambda v: v in (None, heads), f"a kv head per query head, {heads}")
    params = dict(hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))
    factor = params.pop("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    head_dim = hf["hidden_size"] // heads
    bias = bool(hf.get("attention_bias", True))
    parallel = bool(hf.get("use_parallel_residual", True))
    return _dense(dict(hf, hidden_act="silu", head_dim=head_dim, num_key_value_heads=heads, rms_norm_eps=hf.get("layer_norm_eps", 1e-5),
                       rope_parameters=params, mlp_bias=True), mlp_bias=True, qkv_bias=bias, o_bias=bias, mlp_act=acts[hf.get("hidden_act", "gelu")],
                  layer_norms=True, norm_bias=True, parallel_blocks=parallel, parallel_norms=parallel,
                  rope_dim=_partial_rope(dict(partial_rotary_factor=factor), head_dim))


def _persimmon(hf: dict) -> dict:
    """Persimmon (persimmon, dense; Persimmon-8B, and Fuyu's text model): pre-norm blocks of
    LayerNorms with bias (layer_norm_eps), q, k and v as each head's rows of one
    query_key_value (its q, k and v in turn: Family.qkv_per_head) with biases, the output
    projection dense with a bias; with qk_layernorm (by default) the queries and keys each
    through one LayerNorm with bias over every head's channels (qk_norm "layer", qk_norm_bias)
    before RoPE on the first partial_rotary_factor (by default half) of each head's channels
    (halves); MLPs without a gate, relu(x dense_h_to_4h)^2 dense_4h_to_h with biases (mlp_act
    "relu2"); a final LayerNorm with bias, the head untied by default."""
    _refuse(hf, "hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = H // heads
    params = dict(hf.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    qk = bool(hf.get("qk_layernorm", True))
    return _dense(dict(hf, hidden_act="silu", head_dim=head_dim, num_key_value_heads=heads, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), mlp_bias=True,
                       rope_parameters=params or dict(rope_type="default", rope_theta=hf.get("rope_theta", 10000.0))),  # Persimmon-8B's: 25000
                  mlp_bias=True, qkv_bias=True, o_bias=True, mlp_act="relu2", layer_norms=True, norm_bias=True, qk_norm="layer" if qk else None,
                  qk_norm_bias=qk, rope_dim=_partial_rope(dict(partial_rotary_factor=factor), head_dim))


def _falcon(hf: dict) -> dict:
    """Falcon (falcon, dense; Falcon-7B / 40B / 180B, Falcon2-11B): LayerNorms with bias
    (layer_norm_epsilon), q, k and v as one query_key_value module kv head by kv head (each
    one's q heads, its k and its v in turn: Family.qkv_per_head) of num_kv_heads kv heads with
    new_decoder_architecture, one with multi_query, else one per head; biases on it, the
    output projection dense and the MLPs with bias; MLPs without a gate, gelu(x dense_h_to_4h)
    dense_4h_to_h (activation gelu: GELU's exact form, mlp_act "gelu") of ffn_hidden_size (by
    default 4 hidden_size); plain RoPE over every channel. With parallel_attn (by default) the
    attention and the MLP added together to the residual (parallel_blocks), of one LayerNorm
    (input_layernorm) or with new_decoder_architecture and num_ln_in_parallel_attn 2 (its
    default there) each of its own (ln_attn, ln_mlp: parallel_norms); without it the usual
    pre-norm block (input_layernorm, post_attention_layernorm). With alibi (Falcon-RW-1B / 7B)
    ALiBi's biases in place of RoPE (alibi), added before the softmax scale (alibi_scaled):
    transformers rounds Falcon's slopes and biases to bfloat16 (build_alibi_tensor), fmoe
    keeps them in float32, the same numbers where the slopes are powers of two (up to 8 heads)
    at positions below 256, otherwise within bfloat16's rounding."""
    _refuse(hf, "alibi", lambda v: isinstance(v, bool), "true or false")
    _refuse(hf, "activation", lambda v: v == "gelu", "GELU's exact form, gelu")
    heads, new, parallel = hf["num_attention_heads"], bool(hf.get("new_decoder_architecture", False)), bool(hf.get("parallel_attn", True))
    norms = hf.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if new and not parallel:
        raise ValueError("config.json: new_decoder_architecture without parallel_attn is not supported (transformers' model reads ln_attn "
                         "there, which that layer has not)")
    if parallel and norms != (2 if new else 1) and not (new and norms == 1):
        raise ValueError(f"config.json: num_ln_in_parallel_attn = {norms!r} is not supported (1, or 2 with new_decoder_architecture)")
    kv = hf.get("num_kv_heads") or heads if new else 1 if hf.get("multi_query", True) else heads
    bias = bool(hf.get("bias", False))
    alibi = bool(hf.get("alibi", False))
    return _dense(dict(hf, hidden_act="silu", head_dim=hf["hidden_size"] // heads, num_key_value_heads=kv, rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       intermediate_size=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"], mlp_bias=bias),
                  mlp_bias=True, qkv_bias=bias, o_bias=bias, mlp_act="gelu", layer_norms=True, norm_bias=True, parallel_blocks=parallel,
                  parallel_norms=parallel and norms == 2, alibi=alibi, alibi_scaled=alibi)


def _bloom(hf: dict) -> dict:
    """BLOOM (bloom, dense; BLOOM 560M to 176B, BLOOMZ): ALiBi's biases in place of RoPE
    (alibi), a LayerNorm with bias on the embeddings before the first block (embed_norm:
    word_embeddings_layernorm), pre-norm blocks of LayerNorms with bias (layer_norm_epsilon), q,
    k and v as each head's rows of one query_key_value (its q, k and v in turn:
    Family.qkv_per_head), biases on it and on the output projection dense; MLPs without a
    gate, gelu_tanh(x dense_h_to_4h) dense_4h_to_h of 4 hidden_size with biases (BLOOM's
    GELU, its tanh form: mlp_act "gelu_new"); the head tied to the embeddings by default.
    pretraining_tp splits its projections' matmuls in transformers, the same function, unless
    slow_but_exact, whose slices leave the output projections' biases out: refused, as is
    apply_residual_connection_post_layernorm (the residual from the norm's output)."""
    _refuse(hf, "apply_residual_connection_post_layernorm", lambda v: not v, "the residual before the norm, false")
    if hf.get("slow_but_exact") and hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"config.json: slow_but_exact with pretraining_tp = {hf['pretraining_tp']!r} is not supported (transformers' slices "
                         "leave the attention's and the MLP's output biases out there)")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    if H % heads:
        raise ValueError(f"config.json: hidden_size = {H} is not supported (n_head = {heads} heads of hidden_size / n_head channels)")
    return _dense(dict({k: v for k, v in hf.items() if k != "pretraining_tp"}, hidden_act="silu", head_dim=H // heads, num_key_value_heads=heads,
                       rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), intermediate_size=4 * H, mlp_bias=True,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                  mlp_bias=True, qkv_bias=True, o_bias=True, mlp_act="gelu_new", layer_norms=True, norm_bias=True, embed_norm=True, alibi=True)


# MPT's attention fields (attn_config) where a config.json leaves them out: MptAttentionConfig's defaults
_MPT_ATTN = dict(attn_type="multihead_attention", clip_qkv=None, softmax_scale=None, prefix_lm=False, qk_ln=False, attn_uses_sequence_id=False,
                 alibi=True, alibi_bias_max=8)


def _mpt(hf: dict) -> dict:
    """MPT (mpt, dense; MPT-7B / 30B and their Instruct / Chat / StoryWriter models): ALiBi's
    biases in place of RoPE (alibi), pre-norm blocks of LayerNorms without bias (norm_1,
    norm_2, norm_f; layer_norm_epsilon), q, k and v the rows of one Wqkv (every q's first),
    clamped to [-clip_qkv, clip_qkv] where attn_config sets it (fmoe's clip_qkv), a softmax
    scale of attn_config's softmax_scale (None: 1/sqrt(head_dim)), MLPs without a gate,
    gelu(x up_proj) down_proj of 4 d_model (exact GELU), no biases; the head tied to the
    embeddings by default; its config's own field names. What transformers' MptModel does not
    build (every projection without bias, no_bias true; 4 d_model MLP channels; multi-head
    attention with ALiBi at alibi_bias_max 8, no q/k LayerNorms, no prefix LM or sequence ids;
    no logit_scale) is refused by name, and learned_pos_emb, which it never reads, is not read."""
    attn = {f"attn_config.{name}": value for name, value in {**_MPT_ATTN, **(hf.get("attn_config") or {})}.items()}
    _refuse(hf, "no_bias", lambda v: v is True, "no biases, true (transformers' MPT has none)")
    _refuse(hf, "expansion_ratio", lambda v: v == 4, "4 (transformers' MPT builds MLPs of 4 d_model)")
    _refuse(hf, "norm_type", lambda v: v in ("low_precision_layernorm", "layernorm"), "a LayerNorm without bias")
    _refuse(hf, "logit_scale", lambda v: v is None, "None (transformers' MptForCausalLM scales no logit)")
    _refuse(attn, "attn_config.attn_type", lambda v: v == "multihead_attention", "multihead_attention")
    _refuse(attn, "attn_config.alibi", lambda v: v is True, "true: ALiBi (transformers' MPT has no other positions)")
    _refuse(attn, "attn_config.alibi_bias_max", lambda v: v == 8, "8 (transformers' MptModel builds its slopes with 8)")
    for name in ("qk_ln", "prefix_lm", "attn_uses_sequence_id"):
        _refuse(attn, f"attn_config.{name}", lambda v: not v, "false (transformers' MPT does not build it)")
    clip, scale = attn["attn_config.clip_qkv"], attn["attn_config.softmax_scale"]
    for name, value in (("clip_qkv", clip), ("softmax_scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
            raise ValueError(f"config.json: attn_config.{name} = {value!r} is not supported (None or a positive number)")
    d, heads = hf["d_model"], hf["n_heads"]
    if d % heads:
        raise ValueError(f"config.json: d_model = {d} is not supported (n_heads = {heads} heads of d_model / n_heads channels)")
    return _dense(dict(hf, hidden_act="silu", hidden_size=d, num_hidden_layers=hf["n_layers"], num_attention_heads=heads, head_dim=d // heads,
                       num_key_value_heads=heads, rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), intermediate_size=4 * d,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                  mlp_act="gelu", layer_norms=True, clip_qkv=None if clip is None else float(clip), attn_scale=None if scale is None else float(scale),
                  alibi=True)


def _gptj(hf: dict) -> dict:
    """GPT-J (gptj, dense; GPT-J-6B): the attention and the MLP of one LayerNorm's output (with
    bias, layer_norm_epsilon) added together to the residual (parallel_blocks), q, k, v and o
    without biases, RoPE on interleaved pairs of each head's first rotary_dim channels at base
    10000 (its fixed tables), MLPs without a gate, gelu_new(x fc_in) fc_out with biases
    (n_inner, by default 4 n_embd), a head with a bias; its config's own field names."""
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "GELU's tanh form, gelu_new")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = H // heads
    rotary = hf.get("rotary_dim") or head_dim
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"config.json: rotary_dim = {rotary!r} is not supported (an even number in (0, head_dim = {head_dim}])")
    return _dense(dict(hf, hidden_act="silu", intermediate_size=hf.get("intermediate_size") or 4 * H, head_dim=head_dim, num_key_value_heads=heads,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0), mlp_bias=True), mlp_bias=True, mlp_act="gelu_new",
                  layer_norms=True, norm_bias=True, parallel_blocks=True, head_bias=True, rope_interleaved=True,
                  rope_dim=None if rotary == head_dim else rotary)


def _codegen(hf: dict) -> dict:
    """CodeGen (codegen, dense; Salesforce CodeGen-350M to 16B): GPT-J's model (_gptj) with q, k
    and v as the rows of one qkv_proj module in four groups (its mp_num), each its heads' q, v
    and k in turn (Family.qkv_groups, qkv_order "qvk")."""
    _refuse(hf, "num_attention_heads", lambda v: v % 4 == 0, "a multiple of 4, CodeGen's four groups of heads")
    return _gptj(hf)


def _gpt_neo(hf: dict) -> dict:
    """GPT-Neo (gpt_neo, dense; GPT-Neo 125M to 2.7B, the TinyStories models): learned absolute
    positions (max_position_embeddings of them: abs_positions) and no RoPE; the layers
    attention_types (or attention_layers) names local attend over the window_size newest
    tokens, the global ones over all; no softmax scale (attn_scale 1); q, k and v without
    biases, the output projection with one; LayerNorms with bias (layer_norm_epsilon); MLPs
    without a gate, gelu_new(x c_fc) c_proj with biases (intermediate_size, by default 4 H);
    its config's own field names."""
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "GELU's tanh form, gelu_new")
    n, heads, H = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    kinds = hf.get("attention_layers")
    if not kinds:
        types = hf.get("attention_types") or [[["global", "local"], n // 2]]
        try:
            kinds = [kind for pattern, repeat in types for _ in range(repeat) for kind in pattern]
        except (TypeError, ValueError):
            raise ValueError(f"config.json: attention_types = {types!r} is not supported ([[kinds, repeats], ...])") from None
    if len(kinds) != n or set(kinds) - {"global", "local"}:
        raise ValueError(f"config.json: attention layers {kinds!r} are not supported (one of global / local for each of the {n} layers)")
    positions = hf.get("max_position_embeddings", 2048)
    return _dense(dict(hf, hidden_act="silu", intermediate_size=hf.get("intermediate_size") or 4 * H, head_dim=H // heads, num_key_value_heads=heads,
                       layer_types=["sliding_attention" if kind == "local" else "full_attention" for kind in kinds],
                       sliding_window=hf.get("window_size", 256), rope_parameters=dict(rope_type="default", rope_theta=10000.0), mlp_bias=True),
                  sliding=True, mlp_bias=True, o_bias=True, attn_scale=1.0, layer_norms=True, norm_bias=True, mlp_act="gelu_new",
                  abs_positions=positions)


def _gpt_bigcode(hf: dict) -> dict:
    """GPT-BigCode (gpt_bigcode, dense; StarCoder, SantaCoder): GPT-2's blocks on Linear weights:
    learned absolute positions (n_positions: abs_positions), no RoPE; multi-query attention
    (multi_query, by default: one kv head) with q, k and v as the rows of one c_attn module
    (kv head by kv head: every q, then k and v, under multi-query attention), biases on them
    and on c_proj; the softmax scale 1/sqrt(head_dim), or 1 without scale_attn_weights;
    LayerNorms with bias; MLPs without a gate, gelu_pytorch_tanh(x c_fc) c_proj with biases
    (n_inner, by default 4 n_embd); its config's own field names."""
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_pytorch_tanh", "gelu_new"), "GELU's tanh form, gelu_pytorch_tanh")
    _refuse(hf, "add_cross_attention", lambda v: not v, "no cross-attention")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    return _dense(dict(hf, hidden_act="silu", intermediate_size=hf.get("intermediate_size") or 4 * H, head_dim=H // heads,
                       num_key_value_heads=1 if hf.get("multi_query", True) else heads, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                       mlp_bias=True),
                  mlp_bias=True, qkv_bias=True, o_bias=True, attn_scale=None if hf.get("scale_attn_weights", True) else 1.0, layer_norms=True,
                  norm_bias=True, mlp_act="gelu_new", abs_positions=hf.get("max_position_embeddings", 1024))


def _gpt2(hf: dict) -> dict:
    """GPT-2 (gpt2, dense; GPT-2 and DistilGPT-2, and models trained as them): GPT-BigCode's blocks
    (_gpt_bigcode) with a kv head per query head and its weights as Conv1D's [in, out]
    (Family.conv1d): q, k and v the columns of c_attn, every q's first; the scale by the
    inverse layer index is refused."""
    _refuse(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v, "the softmax scale 1/sqrt(head_dim) in every layer")
    return _gpt_bigcode(dict(hf, multi_query=False))


def _opt(hf: dict) -> dict:
    """OPT (opt, dense; OPT-125M to 66B but 350M): learned absolute positions whose table holds
    two rows before position 0's (max_position_embeddings + 2: abs_position_offset 2), no
    RoPE; pre-norm blocks of LayerNorms with bias (self_attn_layer_norm, final_layer_norm),
    biases on q, k, v, o and the MLPs with enable_bias, MLPs without a gate, relu(x fc1) fc2
    (ffn_dim; mlp_act "relu"). OPT-350M's post-norm blocks (do_layer_norm_before false) and
    projection of the embeddings (word_embed_proj_dim other than hidden_size) are refused."""
    _refuse(hf, "do_layer_norm_before", lambda v: v is True, "pre-norm blocks, true (OPT-350M's post-norm ones are not built)")
    _refuse(hf, "word_embed_proj_dim", lambda v: v in (None, hf["hidden_size"]), f"hidden_size, {hf['hidden_size']}: no projection of the embeddings")
    _refuse(hf, "_remove_final_layer_norm", lambda v: not v, "a final LayerNorm")
    _refuse(hf, "layer_norm_elementwise_affine", lambda v: v is True, "LayerNorms with weights and biases")
    _refuse(hf, "hidden_act", lambda v: v == "relu", "relu, the ReLU of an MLP without a gate")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    bias = bool(hf.get("enable_bias", True))
    return _dense(dict(hf, hidden_act="silu", intermediate_size=hf["ffn_dim"], head_dim=H // heads, num_key_value_heads=heads, rms_norm_eps=1e-5,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0), mlp_bias=bias),
                  mlp_bias=True, qkv_bias=bias, o_bias=bias, layer_norms=True, norm_bias=True, mlp_act="relu",
                  abs_positions=hf.get("max_position_embeddings", 2048), abs_position_offset=2)


def _biogpt(hf: dict) -> dict:
    """BioGPT (biogpt, dense; BioGPT, BioGPT-Large): OPT's blocks (pre-norm LayerNorms with bias;
    q, k, v and out_proj with biases; MLPs without a gate, act(x fc1) fc2 with biases, act by
    hidden_act: exact GELU by default) after learned absolute positions whose table holds two
    rows before position 0's (max_position_embeddings + 2: abs_position_offset 2), the
    embeddings times sqrt(hidden_size) with scale_embedding (by default: embed_scale), a final
    LayerNorm, the head output_projection tied to the embedding by default. Every LayerNorm's
    eps is nn.LayerNorm's 1e-5 (transformers' BioGPT builds them so, whatever layer_norm_eps says)."""
    acts = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu"}
    _refuse(hf, "hidden_act", lambda v: v in acts, "GELU, exact (gelu) or in its tanh form (gelu_new), or relu")
    heads, H = hf["num_attention_heads"], hf["hidden_size"]
    scale = math.sqrt(H) if hf.get("scale_embedding", True) else 1.0
    return _dense(dict(hf, hidden_act="silu", head_dim=H // heads, num_key_value_heads=heads, rms_norm_eps=1e-5, mlp_bias=True,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                  mlp_bias=True, qkv_bias=True, o_bias=True, layer_norms=True, norm_bias=True, mlp_act=acts[hf.get("hidden_act", "gelu")],
                  abs_positions=hf.get("max_position_embeddings", 1024), abs_position_offset=2, embed_scale=scale)


def _olmo(hf: dict) -> dict:
    """OLMo (olmo, dense; OLMo-1B, -7B, -7B-0424, -7B-0724): Llama's blocks with LayerNorms
    without weight or bias (the blocks' and the final one, eps 1e-5: layer_norms,
    norm_weights=False), q, k and v clamped to [-clip_qkv, clip_qkv] after their projections,
    biases on q, k, v and o with attention_bias."""
    clip = hf.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf):
        raise ValueError(f"config.json: clip_qkv = {clip!r} is not supported (None or a positive bound)")
    bias = bool(hf.get("attention_bias", False))
    return _dense(dict(hf, rms_norm_eps=1e-5), qkv_bias=bias, o_bias=bias, layer_norms=True, norm_weights=False,
                  clip_qkv=None if clip is None else float(clip))


def _cwm(hf: dict) -> dict:
    """CWM (cwm, dense; Meta's Code World Model): Llama's blocks without biases, a sliding window
    in the layers layer_types names sliding_attention (by default all but every fourth from
    layer 0), Llama 3.1's RoPE scaling (by default factor 16 over 8192 positions) in every layer."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    return _dense(dict(hf, layer_types=kinds), sliding=True, mlp_bias=True)


def _ministral3(hf: dict) -> dict:
    """Ministral 3 (ministral3, dense): Mistral's blocks with YaRN (rope_parameters: cos and sin
    scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is 1 where the two
    are equal, or by 0.1 ln(factor) + 1 without them; the softmax scale 1 / sqrt(head_dim), as
    Llama's attention has it) and every query scaled after RoPE by 1 + llama_4_scaling_beta *
    log(1 + floor(p / original_max_position_embeddings)) (_mistral4's rule)."""
    rope_type, params, _ = _rope_params(hf, "yarn", ("factor", "original_max_position_embeddings"), 1e6)
    out = _dense(dict(hf, rope_parameters=dict(params, rope_type="default"), rope_scaling=None), sliding=True, **_query_temperature(hf))
    return out if rope_type == "default" else dict(out, **_llama_yarn(hf, 1e6))


def _llama_yarn(hf: dict, default_base: float = 10000.0) -> dict:
    """YaRN as Llama's attention applies it (rope_type "yarn"; transformers' rotary embedding):
    cos and sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is 1
    where the two are equal, or by 0.1 ln(factor) + 1 without them; the softmax scale stays
    1 / sqrt(head_dim) (DeepSeek's attention also scales it: _yarn). An unequal pair is
    refused (fmoe ties it to the softmax scale)."""
    _, params, _ = _rope_params(hf, "yarn", ("factor",), default_base)
    params["original_max_position_embeddings"] = _original_max_positions(hf, params)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if bool(mscale) != bool(mscale_all_dim) or (mscale and mscale != mscale_all_dim):
        raise ValueError(f"config.json: rope_parameters with mscale {mscale!r} and mscale_all_dim {mscale_all_dim!r} are not supported "
                         f"for {hf.get('model_type')} (both equal, or neither)")
    # both equal: cos and sin unscaled (fmoe's mscale 0 over mscale_all_dim 0); neither: 0.1 ln(factor) + 1 on them (1 over 0)
    yarn = _yarn(dict(hf, rope_parameters=dict(params, mscale=None, mscale_all_dim=None)), default_base)
    return dict(yarn, yarn_mscale=0.0 if mscale else 1.0, yarn_mscale_all_dim=0.0)


def _query_temperature(hf: dict) -> dict:
    """TransformerConfig's query temperature of Mistral 4 and Ministral 3: rope_parameters'
    llama_4_scaling_beta over original_max_position_embeddings (a beta of 0: none)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    beta, floor = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta is None or floor is None:
        raise ValueError(f"config.json: {hf.get('model_type')}'s rope_parameters need llama_4_scaling_beta and original_max_position_embeddings "
                         "(the queries' scale by position)")
    return dict(query_temperature_floor=int(floor), query_temperature_scale=float(beta)) if beta else {}


def _qwen2(hf: dict) -> dict:
    """Qwen2 (qwen2, dense): Llama's blocks with q/k/v biases (o none); the window in the layers
    layer_types names, by default those from max_window_layers on (_max_window_layers)."""
    return _dense(_max_window_layers(hf, lambda i, first: i >= first), sliding=True, qkv_bias=True)


def _qwen3(hf: dict) -> dict:
    """Qwen3 (qwen3, dense): Llama's blocks with per-head q/k norms; the window in the layers
    layer_types names, by default those from max_window_layers on (_max_window_layers)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Qwen3's attention here")
    return _dense(_max_window_layers(hf, lambda i, first: i >= first), sliding=True, qk_norm="head")


def _olmo2(hf: dict, name: str = "OLMo 2", **extra) -> dict:
    """OLMo 2 (dense): post-norm blocks (no input norms; RMSNorms on the attention and MLP
    outputs) and q/k norms over the whole projections, as FlexOlmo's (_flex_olmo); `extra`
    for OLMo 3's (name: the family's, in the refusals)."""
    _refuse(hf, "clip_qkv", lambda v: v is None, f"{name}'s attention in transformers clamps no q/k/v")
    _refuse(hf, "attention_bias", lambda v: not v, f"no attention biases in {name}'s attention here")
    return _dense(hf, qk_norm="proj", pre_norms=False, post_norms=True, **extra)


def _olmo3(hf: dict) -> dict:
    """OLMo 3 (olmo3, dense): OLMo 2's blocks (_olmo2) with a sliding window in the layers
    layer_types names sliding_attention (by default three in four: every fourth layer, from
    layer 3, attends to every earlier token) and each layer type's own RoPE (rope_parameters
    keyed by full_attention / sliding_attention; an older config.json's rope_theta for both,
    its rope_scaling for the full layers only): the full layers' plain or YaRN, the sliding
    layers' the same or plain RoPE (at their own base: local_rope_base)."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)])
    if hf.get("rope_parameters") is None:  # an older config.json
        theta = float(hf.get("rope_theta", 500000.0))
        hf = dict(hf, rope_parameters=dict(full_attention=dict(hf.get("rope_scaling") or {}, rope_theta=theta),
                                           sliding_attention=dict(rope_type="default", rope_theta=theta)))
    full, local = _rope_by_layer_type(hf, _OLMO3_ROPE)
    plain = dict(hf, rope_parameters=dict(rope_type="default", rope_theta=full.get("rope_theta", 500000.0)), rope_scaling=None)
    out = dict(_olmo2(plain, "OLMo 3", sliding=True), **_yarn(dict(hf, rope_parameters=full), 500000.0))
    return dict(out, local_rope_base=local if out.get("window") is not None else None)


def _gemma3_text(hf: dict) -> dict:
    """Gemma 3 (gemma3_text, dense: Gemma 3 1B, the text model of the larger ones): sandwich
    blocks (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    post_feedforward_layernorm), every RMSNorm zero-centred (gain 1 + weight), per-head q/k
    norms, the softmax scale query_pre_attn_scalar ** -0.5, the embeddings times
    sqrt(hidden_size), GeGLU MLPs (hidden_activation gelu_pytorch_tanh: mlp_act
    "gelu_tanh"); the layers layer_types names sliding_attention (by default five in six, an
    older config's sliding_window_pattern) attend over sliding_window with their own plain
    RoPE (rope_parameters' sliding_attention; an older config's rope_local_base_freq), the
    others globally with the full_attention RoPE, plain or linear (rope_linear_factor; an
    older config's rope_theta and rope_scaling); the logits capped at
    final_logit_softcapping. A softcap on the attention's scores and bidirectional attention
    are refused."""
    _refuse(hf, "attn_logit_softcapping", lambda v: v is None, "no softcap on the attention's scores")
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:
        every = hf.get("sliding_window_pattern", 6)
        hf = dict(hf, layer_types=["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)])
    if hf.get("rope_parameters") is None:  # an older config.json
        hf = dict(hf, rope_parameters=dict(full_attention=dict(hf.get("rope_scaling") or {}, rope_theta=float(hf.get("rope_theta", 1e6))),
                                           sliding_attention=dict(rope_type="default", rope_theta=float(hf.get("rope_local_base_freq", 1e4)))))
    full, local = _rope_by_layer_type(hf, _GEMMA3_ROPE)
    rope_type, params, base = _rope_params(dict(rope_parameters=full, model_type=hf.get("model_type")), "linear", ("factor",), default_base=1e6)
    plain = dict(hf, rope_parameters=dict(rope_type="default", rope_theta=base["rope_base"]), rope_scaling=None)
    return dict(_gemma_dense(plain), qk_norm="head", rope_linear_factor=float(params["factor"]) if rope_type == "linear" else None,
                local_rope_base=local if hf["layer_types"].count("sliding_attention") else None)


def _gemma_dense(hf: dict) -> dict:
    """The dense blocks of Gemma 2 and 3 (_dense): zero-centred sandwich norms, GeGLU MLPs
    (hidden_activation gelu_pytorch_tanh: mlp_act "gelu_tanh"), the embeddings times
    sqrt(hidden_size) rounded to their dtype (round_embed_scale), the softmax scale query_pre_attn_scalar ** -0.5 (None where it is
    head_dim's), the window over the layers layer_types names sliding_attention, the logits
    capped at final_logit_softcapping; bidirectional attention and attention biases refused."""
    _refuse(hf, "use_bidirectional_attention", lambda v: not v, "causal attention")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Gemma's attention here")
    _refuse(hf, "hidden_activation", lambda v: v in ("gelu_pytorch_tanh", "gelu_tanh"), "GeGLU with GELU's tanh form, gelu_pytorch_tanh")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        _refuse(hf, cap, lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf), "None or a positive cap")
    head_dim = _get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])
    scalar = _get(hf, "query_pre_attn_scalar", default=head_dim)
    _refuse(dict(query_pre_attn_scalar=scalar), "query_pre_attn_scalar", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "a positive number")
    softcap = hf.get("final_logit_softcapping")
    return _dense(dict(hf, hidden_act="silu"), sliding=True, mlp_act="gelu_tanh", post_norms=True, zero_centered_norms=True,
                  embed_scale=float(hf["hidden_size"]) ** 0.5, round_embed_scale=True, attn_scale=None if scalar == head_dim else float(scalar) ** -0.5,
                  logit_softcap=None if softcap is None else float(softcap))


def _gemma2(hf: dict) -> dict:
    """Gemma 2 (gemma2, dense): Gemma's dense blocks (_gemma_dense) without q/k norms, every
    attention score capped at attn_logit_softcapping (attn_softcap); the layers layer_types
    names sliding_attention (by default every other one, from layer 0) attend over
    sliding_window; one plain RoPE (rope_theta)."""
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf["num_hidden_layers"])])
    out, cap = _gemma_dense(hf), hf.get("attn_logit_softcapping")  # the cap checked there
    return dict(out, attn_softcap=None if cap is None else float(cap))


def _arcee(hf: dict) -> dict:
    """Arcee (arcee, dense; AFM-4.5B): Llama's blocks with MLPs without a gate, relu(x up_proj)^2
    down_proj (mlp_act "relu2"), RoPE plain or YaRN (_yarn); attention biases refused, MLP biases read (mlp_bias)."""
    _refuse(hf, "hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Arcee's attention here")
    _, params, _ = _rope_params(hf, "yarn", ("factor", "original_max_position_embeddings"))
    out = _dense(dict(hf, hidden_act="silu", rope_parameters=dict(params, rope_type="default"), rope_scaling=None), mlp_act="relu2", mlp_bias=True)
    return dict(out, **_yarn(hf))


def _positive(hf: dict, field: str) -> float:
    """config.json's `field` (it must hold one: Family.defaults fills it), a positive finite number."""
    _refuse(hf, field, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf, "a positive number")
    return float(hf[field])


def _muse_glimmer_text(hf: dict) -> dict:
    """Muse Glimmer's text model (muse_glimmer_text; the released muse_glimmer folders'):
    Gemma 2's sandwich blocks (zero-centred RMSNorms, the post-norms' eps post_norm_eps) around
    AFMoE's gated attention (the heads' outputs times sigmoid(x gate_proj) channel by channel)
    whose q and k are RMS-normed per head without weights before RoPE (qk_norm "rms"), the
    queries times qk_scale_factor (attn_scale qk_scale_factor / sqrt(head_dim)); SwiGLU MLPs
    (hidden_activation silu; gelu_pytorch_tanh: GeGLU); the embeddings RMS-normed without
    weights (embed_norm, norm_overrides "embed:unit"), the final norm's gain its weight itself
    ("final:plain"); the window over the layers layer_types names sliding_attention (by default
    all but every fourth from the last); no RoPE in the layers whose layer_rope_theta is 0
    (by default those full ones), the others at rope_theta, which transformers' model turns
    whatever their entry says (another value is refused); the logits times output_multiplier,
    then capped at final_logit_softcapping (logit_divisor, logit_softcap). Attention biases
    (attention_bias) on q, k, v and o."""
    _refuse(hf, "hidden_activation", lambda v: v in ("silu", "gelu_pytorch_tanh"), "silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)")
    return _muse_blocks(hf, "gelu_tanh" if hf.get("hidden_activation") == "gelu_pytorch_tanh" else "silu")


def _muse_blocks(hf: dict, act: str) -> dict:
    """Muse Glimmer's and Muse Spark's dense model (_muse_glimmer_text) with MLPs of `act`."""
    n = hf["num_hidden_layers"]
    last_of_four = [(n - 1 - i) % 4 == 0 for i in range(n)]  # transformers' defaults: the full, NoPE layers
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["full_attention" if full else "sliding_attention" for full in last_of_four])
    _refuse(hf, "attention_bias", lambda v: isinstance(v, bool), "true or false")
    _, _, base = _rope_params(hf)
    thetas = hf.get("layer_rope_theta")
    if thetas is None:
        thetas = [0 if full else base["rope_base"] for full in last_of_four]
    if not isinstance(thetas, list) or len(thetas) != n or any(t not in (0, base["rope_base"]) for t in thetas):
        raise ValueError(f"config.json: layer_rope_theta = {thetas!r} is not supported (one entry per layer, 0: no RoPE, else rope_theta "
                         f"{base['rope_base']}, the one base transformers' model turns)")
    _refuse(hf, "post_norm_eps", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf, "a finite number >= 0")
    bias = bool(hf.get("attention_bias", False))
    head_dim = _get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"])
    nope = tuple(i for i, t in enumerate(thetas) if t == 0)
    scale = _positive(hf, "qk_scale_factor")
    return _dense(dict(hf, hidden_act="silu"), sliding=True, mlp_act=act, post_norms=True, zero_centered_norms=True, post_norm_eps=float(hf["post_norm_eps"]),
                  embed_norm=True, norm_overrides=("embed:unit", "final:plain"), qk_norm="rms", attn_gate=True,
                  attn_scale=None if scale == 1 else scale * head_dim ** -0.5, qkv_bias=bias, o_bias=bias,
                  logit_divisor=1 / _positive(hf, "output_multiplier"), logit_softcap=_positive(hf, "final_logit_softcapping"), nope_layers=nope or None)


def _muse_spark_text(hf: dict) -> dict:
    """Muse Spark's text model (muse_spark_text; the released muse_spark folders'): Muse
    Glimmer's blocks (_muse_blocks; SwiGLU of hidden_act silu) with each head's attention
    output RMS-normed without weights before the gate (attn_out_norm: o_norm), the
    attention's post-norm without a weight ("attn_post:unit"), the MLP's prescaled
    ("mlp_post:prescaled": post_feedforward_layernorm's gain before the norm), each residual
    add weighed by a gate per channel at residual_gate_temperature (residual_gates); the
    layers mlp_layer_types names sparse (by default all) latent MoE blocks: the router on the
    block's normed input in float32, its logits times output_multiplier (router_scale), chosen
    on the sigmoids plus the correction bias, the chosen sigmoids renormalised and times
    routed_scaling_factor; num_local_experts experts of moe_intermediate_size between
    pre_expert_proj and post_expert_proj (moe_latent moe_hidden_size), their input normed
    (pre_expert_norm, zero-centred: moe_latent_norm) and each one's output normed before its
    weight (post_expert_norm, prescaled, eps post_norm_eps: expert_out_norm); the dense
    layers' MLPs of intermediate_size."""
    _refuse(hf, "hidden_act", lambda v: v == "silu", "SwiGLU with silu")
    _refuse_single_renormalised(hf)
    out = _muse_blocks(hf, "silu")
    moe = _mlp_layer_types(dict(hf, n_shared_experts=0), 0)
    return dict(out, **moe, n_experts=hf["num_local_experts"], k=hf["num_experts_per_tok"], score="sigmoid", expert_bias=True, route_normalize=True,
                router_scale=_positive(hf, "output_multiplier"), moe_latent=hf["moe_hidden_size"], moe_latent_norm=True, expert_out_norm=True,
                norm_overrides=("embed:unit", "final:plain", "attn_post:unit", "mlp_post:prescaled"), attn_out_norm=True, residual_gates=True,
                residual_gate_temperature=_positive(hf, "residual_gate_temperature"))


def _muse_spark(hf: dict) -> dict:
    """A released Muse Spark folder (muse_spark, MuseSparkForConditionalGeneration): its
    text_config's model (_muse_spark_text) under model.language_model., the head untied unless
    the top level ties it; the vision and audio towers, adapter and projection are not read."""
    return _text_family(hf, "muse_spark_text", _text_config({"tie_word_embeddings": False, **hf}))


def _muse_glimmer(hf: dict) -> dict:
    """A released Muse Glimmer folder (muse_glimmer, MuseGlimmerForConditionalGeneration): its
    text_config's model (_muse_glimmer_text) under model.language_model., the head untied unless
    the top level ties it; the vision tower and its adapter and projection are not read."""
    return _text_family(hf, "muse_glimmer_text", _text_config({"tie_word_embeddings": False, **hf}))


def _vaultgemma(hf: dict) -> dict:
    """VaultGemma (vaultgemma, dense): Gemma 2's blocks (_gemma2) with pre-norms only
    (input_layernorm, pre_feedforward_layernorm), no norm on the sublayers' outputs."""
    return dict(_gemma2(hf), post_norms=False)


def _gemma(hf: dict) -> dict:
    """Gemma (gemma, dense; Gemma 1, CodeGemma): GeGLU MLPs (hidden_act gelu_pytorch_tanh; the
    releases' legacy "gelu" is read as that, as transformers reads it), zero-centred RMSNorms
    before the attention and the MLP, the embeddings times sqrt(hidden_size) rounded to their
    dtype, the softmax scale 1/sqrt(head_dim); attention biases refused."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Gemma's attention here")
    _refuse(hf, "hidden_act", lambda v: v in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"), "GeGLU with GELU's tanh form, gelu_pytorch_tanh")
    return _dense(dict(hf, hidden_act="silu"), mlp_act="gelu_tanh", zero_centered_norms=True, embed_scale=float(hf["hidden_size"]) ** 0.5,
                  round_embed_scale=True)


def _gemma4_text(hf: dict) -> dict:
    """Gemma 4 (gemma4_text: Gemma 4 26B-A4B, 31B): Gemma 3's sandwich blocks, GeGLU MLPs and
    scaled embeddings, with plain RMSNorms (gain weight), per-head q/k norms and the values
    RMS-normed without weights (v_norm), a softmax scale of 1; the layers layer_types names
    sliding_attention (by default five in six, the last layer always full) attend over
    sliding_window with head_dim and num_key_value_heads, plain RoPE at their own base; the
    full layers with per_layer_config's head_dim and kv heads (an older config's
    global_head_dim and, with attention_k_eq_v, num_global_key_value_heads: local_head_dim and
    local_kv_heads for the sliding ones), "proportional" RoPE (rope_proportion: its
    partial_rotary_factor of the frequencies turn; its factor rope_linear_factor) and, with
    attention_k_eq_v, no v_proj: the values are the keys' projection (global_k_eq_v). With
    enable_moe_block every block's MLP is beside a MoE (dense_beside_moe, the extra norms
    pre_feedforward_layernorm_2, post_feedforward_layernorm_1 / _2) of num_experts experts
    of moe_intermediate_size, top_k_experts per token, routed on the block's input through
    router.scale (router_norm) by softmax top-k renormalised and times router.per_expert_scale
    (router_expert_scale); each layer's output times its layer_scalar (layer_scalars); the
    logits capped at final_logit_softcapping. Per-layer embeddings (hidden_size_per_layer_input),
    layers sharing an earlier layer's keys and values (num_kv_shared_layers) and
    bidirectional attention are refused."""
    _refuse(hf, "hidden_size_per_layer_input", lambda v: not v, "no per-layer embeddings (PLE): 0 or None")
    _refuse(hf, "num_kv_shared_layers", lambda v: not v, "every layer with its own keys and values: 0")
    _refuse(hf, "use_bidirectional_attention", lambda v: not v, "causal attention")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Gemma's attention here")
    _refuse(hf, "hidden_activation", lambda v: v in ("gelu_pytorch_tanh", "gelu_tanh"), "GeGLU with GELU's tanh form, gelu_pytorch_tanh")
    _refuse(hf, "final_logit_softcapping", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf),
            "None or a positive cap")
    n, k_eq_v = hf["num_hidden_layers"], bool(hf.get("attention_k_eq_v", False))
    kinds = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if len(kinds) != n or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of sliding_attention / full_attention per layer)")
    kinds[-1] = "full_attention"  # as transformers forces it
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    sliding_dim, sliding_kv = _get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"]), hf["num_key_value_heads"]
    overrides = {int(i): dict(v) for i, v in (hf.get("per_layer_config") or {}).items()}
    if not overrides:  # an older config.json: the full layers' head dim, and with k_eq_v their kv heads, at the top level
        over = {"head_dim": hf.get("global_head_dim", 512)}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = dict.fromkeys(full, over)
    if set(overrides) - set(full) or any(set(v) - {"head_dim", "num_key_value_heads"} for v in overrides.values()) or len(
            {tuple(sorted(v.items())) for v in overrides.values()}) > 1:
        raise ValueError(f"config.json: per_layer_config = {hf.get('per_layer_config')!r} is not supported (one head_dim and "
                         "num_key_value_heads for every full_attention layer)")
    over = next(iter(overrides.values()), {})
    dim, kv = over.get("head_dim", sliding_dim), over.get("num_key_value_heads", sliding_kv)
    window = bool(len(full) < n)
    rope = _proportional_rope(hf, _GEMMA4_ROPE, window)
    common = _common(dict(hf, hidden_act="silu", layer_types=kinds, head_dim=dim, num_key_value_heads=kv, num_experts_per_tok=1,
                          rope_parameters=dict(rope_type="default", rope_theta=rope.pop("rope_base"))), 1, sliding=True)
    softcap = hf.get("final_logit_softcapping")
    out = dict(common, **rope, mlp_act="gelu_tanh", qk_norm="head", v_norm=True, global_k_eq_v=k_eq_v, post_norms=True, attn_scale=1.0,
               embed_scale=float(hf["hidden_size"]) ** 0.5, round_embed_scale=True, layer_scalars=True, logit_softcap=None if softcap is None else float(softcap),
               local_head_dim=sliding_dim if window and sliding_dim != dim else None, local_kv_heads=sliding_kv if window and sliding_kv != kv else None,
               ffn_dense=hf["intermediate_size"], n_shared=0)
    if not hf.get("enable_moe_block"):
        return dict(out, n_dense=n, ffn_expert=hf["intermediate_size"])
    return dict(out, n_experts=hf["num_experts"], k=hf["top_k_experts"], ffn_expert=hf["moe_intermediate_size"], moe_layers=tuple(range(n)),
                dense_beside_moe=True, router_norm=True, router_expert_scale=True)


def _proportional_rope(hf: dict, defaults: dict, window: bool) -> dict:
    """Gemma 4's and LFM3's RoPE, rope_parameters keyed by layer type (a missing one at
    `defaults`'): the full layers' plain, or "proportional" (rope_proportion: the
    partial_rotary_factor of the frequencies turn; its factor rope_linear_factor), at
    rope_base; the sliding layers' plain over every channel at their own base (local_rope_base,
    where some layer slides: `window`)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: rope_parameters = {params!r} is not supported (one per layer type, full_attention / sliding_attention)")
    globe, local = (dict(params.get(k) or defaults[k]) for k in ("full_attention", "sliding_attention"))
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: rope_parameters.sliding_attention = {local!r} is not supported (plain RoPE over every channel)")
    kind = globe.get("rope_type", "default")
    if kind not in ("default", "proportional") or (kind == "default" and globe.get("partial_rotary_factor", 1.0) != 1.0):
        raise ValueError(f"config.json: rope_parameters.full_attention = {globe!r} is not supported (plain RoPE over every channel, or "
                         "proportional RoPE)")
    share, factor = float(globe.get("partial_rotary_factor", 1.0)), float(globe.get("factor", 1.0))
    return dict(rope_base=float(globe.get("rope_theta", 1e6)), rope_proportion=None if kind == "default" or share == 1.0 else share,
                rope_linear_factor=None if factor == 1.0 else factor, local_rope_base=float(local.get("rope_theta", 1e4)) if window else None)


def _lfm3(hf: dict) -> dict:
    """LFM3 (lfm3, dense; LFM3-1.7B): LFM2's short convolutions (_lfm2_common's "short_conv"
    blocks, conv_L_cache taps) in the layers layer_types names conv, Qwen3's attention with
    per-head q/k norms in the others (by default every fourth from layer 2 full_attention,
    every fourth from layer 4 sliding_attention, over sliding_window), each layer type with
    its RoPE (_proportional_rope: the full layers' proportional, the sliding layers' plain at
    their own base); a sigmoid gate per head on the attention's output (use_attention_gate;
    gate_proj in the checkpoints, transformers' g_proj); RMSNorms on each branch's output (post_operator_norm, post_ffn_norm:
    use_sandwich_norm); every block a SwiGLU (feed_forward w1, w3, w2) of intermediate_size."""
    _refuse(hf, "conv_bias", lambda v: not v, "no biases in the short convolutions")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in LFM3's attention here")
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"full_attention", "sliding_attention", "conv"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of conv / full_attention / sliding_attention per layer)")
    rope = _proportional_rope(hf, _LFM3_ROPE, "sliding_attention" in kinds)
    attention = [kind if kind != "conv" else "full_attention" for kind in kinds]  # the window's layers as _sliding reads them
    common = _common(dict(hf, num_experts_per_tok=1, layer_types=attention, rope_parameters=dict(rope_type="default", rope_theta=rope.pop("rope_base"))),
                     1, sliding=True)
    conv, H, F = tuple(i for i, kind in enumerate(kinds) if kind == "conv"), hf["hidden_size"], hf["intermediate_size"]
    gate, sandwich = hf.get("use_attention_gate", True), hf.get("use_sandwich_norm", True)
    for name, value in (("use_attention_gate", gate), ("use_sandwich_norm", sandwich)):
        _refuse({name: value}, name, lambda v: isinstance(v, bool), "true or false")
    return dict(common, **rope, qk_norm="head", linear_layers=conv or None, linear_kind="short_conv", linear_k_heads=H, linear_v_heads=H,
                linear_k_dim=1, linear_v_dim=1, linear_conv=hf.get("conv_L_cache", 7), attn_gate=gate, attn_gate_per_head=gate,
                post_norms=sandwich, ffn_dense=F, ffn_expert=F, n_dense=n, n_shared=0)


def _gemma4_unified_text(hf: dict) -> dict:
    """Gemma 4's unified models' text model (gemma4_unified_text, Gemma4UnifiedForCausalLM:
    Gemma 4 12B): Gemma 4's dense blocks (_gemma4_text; no MoE, no per-layer embeddings);
    bidirectional attention among the vision tokens alone (use_bidirectional_attention
    "vision", by default) leaves a text-only forward causal; "all" and the double-wide MLP are
    refused."""
    _refuse(hf, "use_bidirectional_attention", lambda v: v in (None, "vision"), "causal attention among text tokens: null or \"vision\"")
    _refuse(hf, "use_double_wide_mlp", lambda v: not v, "one MLP width in every layer")
    return _gemma4_text(dict(hf, use_bidirectional_attention=None))


def _gemma4_unified(hf: dict) -> dict:
    """A released Gemma 4 unified folder (gemma4_unified, Gemma4UnifiedForConditionalGeneration):
    its text_config's model (_gemma4_unified_text) under model.language_model.; the vision and
    audio models beside it are not read."""
    return _text_family(hf, "gemma4_unified_text")


def _gemma4(hf: dict) -> dict:
    """A released Gemma 4 folder (gemma4, Gemma4ForConditionalGeneration): its text_config's
    model (_gemma4_text) under model.language_model. (the head at lm_head); the vision and
    audio models beside it are not read."""
    return _text_family(hf, "gemma4_text")


def _gemma3(hf: dict) -> dict:
    """A released Gemma 3 folder (gemma3, Gemma3ForConditionalGeneration: Gemma 3 4B, 12B,
    27B): its text_config's model (_gemma3_text) under language_model.; the vision model
    beside it is not read. Its text model's final_logit_softcapping is refused: the released
    ones have none, and transformers' Gemma3ForConditionalGeneration would not apply it
    (its Gemma3ForCausalLM does)."""
    text = _text_config(hf)
    _refuse(text, "final_logit_softcapping", lambda v: v is None, "none in a gemma3 folder, whose transformers class does not cap the logits")
    return _text_family(hf, "gemma3_text", text)


def _rope_by_layer_type(hf: dict, defaults: dict, partial: Optional[float] = None) -> tuple[dict, Optional[float]]:
    """rope_parameters keyed by layer type (full_attention / sliding_attention, a missing one
    at `defaults`'): the full layers' parameters, and the sliding layers' own base where their
    RoPE is not the full layers' (plain RoPE there: local_rope_base; None where it is).
    partial: the family's partial_rotary_factor where a layer type's leaves it out (MiMo's
    0.334), the same in both; None: RoPE over every channel."""
    params = hf.get("rope_parameters")
    if not isinstance(params, dict) or not params or set(params) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: rope_parameters = {params!r} is not supported (one per layer type, full_attention / sliding_attention)")
    full = params.get("full_attention", defaults["full_attention"])
    sliding = params.get("sliding_attention", defaults["sliding_attention"])
    if partial is None:
        for kind, p in (("full_attention", full), ("sliding_attention", sliding)):
            _refuse(p, "partial_rotary_factor", lambda v: v == 1.0, f"RoPE over every channel in the {kind} layers")
    else:
        full, sliding = (dict(p, partial_rotary_factor=p.get("partial_rotary_factor", partial)) for p in (full, sliding))
        if full["partial_rotary_factor"] != sliding["partial_rotary_factor"]:
            raise ValueError(f"config.json: rope_parameters with partial_rotary_factor {full['partial_rotary_factor']!r} (full_attention) and "
                             f"{sliding['partial_rotary_factor']!r} (sliding_attention) are not supported (the same in both)")

    def kind(p: dict) -> dict:  # the rope type under its one name
        return dict({k: v for k, v in p.items() if k != "type"}, rope_type=p.get("rope_type", p.get("type")) or "default")

    if kind(sliding) == kind(full):
        return full, None
    if kind(sliding)["rope_type"] != "default":
        raise ValueError(f"config.json: rope_parameters.sliding_attention = {sliding!r} is not supported (plain RoPE, or the full layers' RoPE)")
    return full, float(sliding.get("rope_theta", 10000.0))


def _phi3(hf: dict) -> dict:
    """Phi-3 / Phi-4 (phi3, dense): Llama's blocks with q, k and v as the rows of one qkv_proj
    and the MLP's gate and up as the rows of one gate_up_proj (Family.qkv, dense_gate_up), RoPE
    on the first partial_rotary_factor of each head (Phi-4-mini's 0.75), plain or LongRoPE
    (_longrope: Phi-3.5-mini's, Phi-4-mini's), a sliding window over every layer where
    sliding_window is set."""
    plain, longrope = _longrope(hf)
    common = _dense(plain, sliding=True)
    return dict(common, rope_dim=_partial_rope(hf, common["head_dim"]), **longrope)


def _longrope_renamed(hf: dict) -> dict:
    """config.json's RoPE parameters, the older rope type "su" named "longrope"."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    return dict(params, rope_type="longrope") if params.get("rope_type", params.get("type")) == "su" else params


def _longrope(hf: dict, mscales: bool = False) -> tuple[dict, dict]:
    """(config.json with plain RoPE, TransformerConfig's LongRoPE knobs) of rope_type
    "longrope" (older "su"): short_factor and long_factor, switched beyond
    original_max_position_embeddings (the top level's first, as transformers reads Phi-3's;
    rope_parameters', else max_position_embeddings); cos and sin scaled by attention_factor,
    else sqrt(1 + ln s / ln L) with s = factor, else max_position_embeddings / L (Phi-3's), or
    with `mscales` by short_mscale and long_mscale (Phi-3.5-MoE's). ({} for plain RoPE; a
    ValueError for another type or a missing field, _rope_params'.)"""
    needs = ("short_factor", "long_factor") + (("short_mscale", "long_mscale") if mscales else ())
    kind, params, _ = _rope_params(dict(hf, rope_parameters=_longrope_renamed(hf), rope_scaling=None), "longrope", needs)
    if kind == "default":
        return hf, {}
    # Phi-3's transformers reads the top level's first (its class default 4096 over rope_parameters'), Phi-3.5-MoE's rope_parameters' alone
    L = params.get("original_max_position_embeddings") if mscales else _get(hf, "original_max_position_embeddings",
                                                                              default=params.get("original_max_position_embeddings"))
    L = int(hf["max_position_embeddings"] if L is None else L)
    if mscales:
        short, long = float(params["short_mscale"]), float(params["long_mscale"])
    elif params.get("attention_factor"):
        short = long = float(params["attention_factor"])
    else:
        factor = params.get("factor") or hf["max_position_embeddings"] / L
        short = long = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(L))
    plain = dict(hf, rope_parameters=dict(rope_type="default", rope_theta=params.get("rope_theta", hf.get("rope_theta", 10000.0)),
                                          **{k: v for k, v in params.items() if k == "partial_rotary_factor"}), rope_scaling=None)
    return plain, dict(longrope_short_factors=tuple(float(f) for f in params["short_factor"]),
                       longrope_long_factors=tuple(float(f) for f in params["long_factor"]), longrope_original_max_positions=L,
                       longrope_short_scale=short, longrope_long_scale=long)


def _glm4(hf: dict) -> dict:
    """GLM-4 (glm4, dense; GLM-4-0414): sandwich blocks (an RMSNorm before and after the
    attention and the MLP: Family.sandwich), biases on q, k and v (attention_bias), RoPE on
    interleaved pairs of the first partial_rotary_factor (by default half) of each head, the
    MLP's gate and up as the rows of one gate_up_proj."""
    return dict(_glm(hf), post_norms=True)


def _glm(hf: dict) -> dict:
    """GLM (glm, dense; GLM-4-9B, GLM-Edge): GLM-4's blocks (_glm4) as plain pre-norm blocks,
    without the norms after the attention and the MLP."""
    common = _dense(hf)
    return dict(common, qkv_bias=bool(hf["attention_bias"]), rope_interleaved=True, rope_dim=_partial_rope(hf, common["head_dim"]))


def _mimo_v2_flash(hf: dict) -> dict:
    """MiMo-V2-Flash (mimo_v2_flash): grouped-query attention with q/k heads of head_dim,
    values of v_head_dim scaled by attention_value_scale, q/k/v biases with attention_bias;
    the layers layer_types names sliding_attention (by default all but layer 0 and every
    sixth from layer 5) attend over sliding_window (an older config's sliding_window_size + 1)
    with twice num_key_value_heads and a sink per head (attention_sink_bias; local_kv_heads,
    sink_layers); each layer type's RoPE on the first partial_rotary_factor of each head (by
    default 0.334, the same in both), plain, the sliding layers' at their own base
    (local_rope_base); DeepSeek-V3's routing (sigmoid scores with the correction bias,
    n_group groups scored by their best 2, norm_topk_prob, x routed_scaling_factor) without
    shared experts; dense and MoE blocks by mlp_layer_types (by default the first dense). Its
    MTP layers (model.mtp.*) are not read, as in transformers."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)])
    if hf.get("sliding_window_size") is not None:  # an older config's name, one token short
        hf = dict(hf, sliding_window=hf["sliding_window_size"] + 1)
    full, local = _rope_by_layer_type(hf, _MIMO_ROPE, partial=0.334)
    common = _common(dict(hf, rope_parameters=full, rope_scaling=None), hf["n_routed_experts"], sliding=True)
    D, Dv, G = common["head_dim"], hf["v_head_dim"], common["n_kv_heads"]
    window = common.get("window") is not None  # the sliding layers: window_layers (None: every layer), with their sinks
    scale = hf.get("attention_value_scale")
    return dict(common, **_mlp_layer_types(hf, 1), **_sigmoid_routing(hf), rope_dim=_partial_rope(dict(hf, rope_parameters=full), D),
                v_head_dim=None if Dv == D else Dv, value_scale=1.0 if scale is None else float(scale),
                qkv_bias=bool(hf.get("attention_bias", False)), local_kv_heads=2 * G if window else None, attn_sinks=window,
                sink_layers=common.get("window_layers"), local_rope_base=local if window else None)


def _ernie4_5(hf: dict) -> dict:
    """ERNIE 4.5 dense (ernie4_5; ERNIE-4.5-0.3B): Llama's blocks with RoPE on interleaved
    pairs (ERNIE 4.5 MoE's attention), tied embeddings by default, no biases (use_bias)."""
    _refuse(hf, "use_bias", lambda v: not v, "no biases on the linear layers")
    return _dense(hf, rope_interleaved=True)


def _lfm2_common(hf: dict, n_experts: int) -> dict:
    """LFM2's blocks (dense and MoE): gated short convolutions (fmoe.layers.linear_attention's
    "short_conv": conv.in_proj's B, C and x rows, conv_L_cache taps, over the hidden channels,
    which are its heads) in the layers layer_types names conv (an older config's: all but
    full_attn_idxs), grouped-query attention with per-head q/k norms before RoPE in the
    others (out_proj, q_layernorm, k_layernorm); pre-norms operator_norm and ffn_norm, the
    final norm embedding_norm."""
    _refuse(hf, "conv_bias", lambda v: not v, "no biases in the short convolutions")
    n, kinds = hf["num_hidden_layers"], hf.get("layer_types")
    if kinds is None:
        full = hf.get("full_attn_idxs")
        kinds = ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"full_attention", "conv"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of full_attention / conv per layer)")
    conv = tuple(i for i, kind in enumerate(kinds) if kind == "conv")
    H = hf["hidden_size"]
    return dict(_common(hf, n_experts), qk_norm="head", linear_layers=conv or None, linear_kind="short_conv",
                linear_k_heads=H, linear_v_heads=H, linear_k_dim=1, linear_v_dim=1, linear_conv=hf.get("conv_L_cache", 3))


def _lfm2(hf: dict) -> dict:
    """LFM2 (lfm2, dense; LFM2-350M to -2.6B): _lfm2_common's blocks, each with a SwiGLU
    (feed_forward w1, w3, w2) of intermediate_size or, with block_auto_adjust_ff_dim, of
    2/3 of it (then times block_ffn_dim_multiplier, rounded up to block_multiple_of)."""
    F = hf["intermediate_size"]
    if hf.get("block_auto_adjust_ff_dim", True):
        F, mult = int(2 * F / 3), hf.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            m = hf.get("block_multiple_of", 256)
            F = m * ((int(mult * F) + m - 1) // m)
    common = _lfm2_common(dict(hf, num_experts_per_tok=1), 1)
    return dict(common, ffn_dense=F, ffn_expert=F, n_dense=hf["num_hidden_layers"], n_shared=0)


def _lfm2_moe(hf: dict) -> dict:
    """LFM2-MoE (lfm2_moe; LFM2-8B-A1B): _lfm2_common's blocks, num_dense_layers dense ones
    first (a SwiGLU of intermediate_size), then MoE blocks of num_experts experts routed on
    sigmoids (plus the expert_bias buffer with use_expert_bias), renormalised with
    norm_topk_prob, x routed_scaling_factor; no shared experts."""
    normalize, scale = bool(hf.get("norm_topk_prob", True)), float(hf.get("routed_scaling_factor", 1.0))
    if normalize:
        _refuse_single_renormalised(hf)
    return dict(_lfm2_common(hf, hf["num_experts"]), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                n_dense=hf.get("num_dense_layers", 2), n_shared=0, score="sigmoid", expert_bias=bool(hf.get("use_expert_bias", True)),
                route_normalize=normalize, route_scale=None if scale == 1.0 else scale)


def _smollm3(hf: dict) -> dict:
    """SmolLM3 (smollm3, dense): Llama's blocks (attention_bias on q, k, v and o) without RoPE
    in the layers no_rope_layers marks 0 (by default every no_rope_layer_interval-th, from
    layer interval - 1); with use_sliding_window and a sliding_window, a sliding window in
    the layers layer_types names sliding_attention (by default the NoPE ones)."""
    n = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers")
    if flags is None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json: no_rope_layer_interval = {interval!r} is not supported (a positive int)")
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ValueError(f"config.json: no_rope_layers = {flags!r} is not supported (1 for a layer with RoPE, 0 without, one per layer)")
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        if hf.get("layer_types") is None:
            hf = dict(hf, layer_types=["full_attention" if flag else "sliding_attention" for flag in flags])
    else:  # transformers' window only with use_sliding_window
        hf = dict(hf, layer_types=None, sliding_window=None)
    bias = bool(hf.get("attention_bias", False))
    nope = tuple(i for i, flag in enumerate(flags) if not flag)
    return _dense(hf, sliding=True, qkv_bias=bias, o_bias=bias, nope_layers=nope or None, mlp_bias=True)


def _exaone4(hf: dict) -> dict:
    """EXAONE 4.0 (exaone4, dense): OLMo 2's post-norm blocks (RMSNorms on the attention and
    MLP outputs, no input norms) with EXAONE's attention (_exaone_attention: per-head q/k
    norms before RoPE, sliding layers with RoPE beside global ones without)."""
    hf, nope = _exaone_attention(hf)
    return _dense(hf, sliding=True, qk_norm="head", pre_norms=False, post_norms=True, nope_layers=nope or None)


def _cohere_layer_types(hf: dict) -> dict:
    """hf with layer_types: its own, or Cohere 2's pattern (every sliding_window_pattern-th
    layer global, the others over the window)."""
    every = hf.get("sliding_window_pattern", 4)
    return dict(hf, layer_types=hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                                          for i in range(hf["num_hidden_layers"])])


def _cohere_blocks(hf: dict, *, rope_everywhere: bool = False) -> dict:
    """Cohere's blocks (Command R, R7B, A): the attention and the MLP of one LayerNorm's
    output (without bias, layer_norm_eps) added together to the residual (parallel_blocks,
    layer_norms), RoPE on interleaved pairs in the sliding layers only (the global ones NoPE;
    with rope_everywhere, Command R's, in every layer), the logits x logit_scale
    (logit_divisor); no attention biases here."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Cohere's attention here")
    scale = hf.get("logit_scale", 0.0625)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"config.json: logit_scale = {scale!r} is not supported (a positive number)")
    nope = () if rope_everywhere else tuple(i for i, kind in enumerate(hf["layer_types"]) if kind != "sliding_attention")
    return dict(norm_eps=float(hf.get("layer_norm_eps", 1e-5)), parallel_blocks=True, layer_norms=True, rope_interleaved=True,
                nope_layers=nope or None, logit_divisor=1 / scale)


def _stablelm(hf: dict) -> dict:
    """StableLM (stablelm, dense; StableLM 2 1.6B / 12B, StableLM-3B-4E1T, StableCode): Llama's
    SwiGLU blocks with LayerNorms with biases (the blocks' and the final one, layer_norm_eps),
    RoPE on the first partial_rotary_factor of each head's channels (halves, not pairs), q/k/v
    biases with use_qkv_bias, a LayerNorm without bias on each head's queries and keys before
    RoPE with qk_layernorm (each head its own weight, its own module: qk_norm "head_layer"),
    and with use_parallel_residual the attention and the MLP of one normed input added to the
    residual together (parallel_blocks)."""
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    parallel = bool(hf.get("use_parallel_residual", False))
    return _dense(dict(hf, head_dim=head_dim, rms_norm_eps=hf.get("layer_norm_eps", 1e-5)), qkv_bias=bool(hf.get("use_qkv_bias", False)),
                  layer_norms=True, norm_bias=True, qk_norm="head_layer" if hf.get("qk_layernorm") else None, parallel_blocks=parallel,
                  rope_dim=_partial_rope(dict(hf, partial_rotary_factor=hf.get("partial_rotary_factor", 0.25)), head_dim))


def _apertus(hf: dict) -> dict:
    """Apertus (apertus, dense; Apertus-8B / 70B): Llama's blocks (its pre-norms
    attention_layernorm and feedforward_layernorm) with per-head q/k RMSNorms before RoPE (Llama
    3's by default), MLPs without a gate through xIELU (mlp_act "xielu": up_proj, act_fn's
    learned alpha_p and alpha_n, down_proj); xIELU's constants (act_fn's beta 0.5, eps -1e-6, as
    transformers builds them) are checked on load and written on export. Attention biases
    refused."""
    _refuse(hf, "hidden_act", lambda v: v == "xielu", "xielu, the xIELU of an MLP without a gate")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Apertus's attention here")
    return _dense(dict(hf, hidden_act="silu"), mlp_act="xielu", qk_norm="head")


def _apertus1p5_text(hf: dict) -> dict:
    """Apertus 1.5's text model (apertus1p5_text, Apertus1p5TextForCausalLM; dense): Apertus's
    model (_apertus) over a vocabulary that holds image and audio codes too, its output head
    pruned to the first output_vocab_size ids (out_vocab; None or vocab_size: every id)."""
    rows = hf.get("output_vocab_size")
    return dict(_apertus(hf), out_vocab=None if rows in (None, hf["vocab_size"]) else rows)


def _apertus1p5(hf: dict) -> dict:
    """A released Apertus 1.5 folder (apertus1p5, Apertus1p5ForConditionalGeneration): its
    text_config's model (_apertus1p5_text) under model.language_model., the head untied unless
    the top level ties it; the image and audio tokenizers (model.vision_tokenizer.,
    model.audio_tokenizer.), which turn images and audio into the vocabulary's codes, are not read."""
    return _text_family(hf, "apertus1p5_text", _text_config({"tie_word_embeddings": False, **hf}))


def _nemotron(hf: dict) -> dict:
    """Nemotron (nemotron, dense; Nemotron-4, Minitron, Mistral-NeMo-Minitron): LayerNorm1P
    everywhere (a LayerNorm with a bias whose gain is 1 + weight: layer_norms, norm_bias,
    zero_centered_norms; eps norm_eps), MLPs without a gate, relu(x up_proj)^2 down_proj
    (mlp_act "relu2"), RoPE on the first partial_rotary_factor of each head (halves);
    attention biases refused, MLP biases read (mlp_bias)."""
    _refuse(hf, "hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Nemotron's attention here")
    out = _dense(dict(hf, hidden_act="silu"), mlp_act="relu2", layer_norms=True, norm_bias=True, zero_centered_norms=True, mlp_bias=True)
    return dict(out, rope_dim=_partial_rope(dict(hf, partial_rotary_factor=hf.get("partial_rotary_factor", 0.5)), out["head_dim"]))


def _cohere(hf: dict) -> dict:
    """Cohere (cohere, dense; Command R, R+): Cohere's blocks (_cohere_blocks) with RoPE in every
    layer and no sliding window; with use_qk_norm (Command R+) a LayerNorm without bias on
    each head's queries and keys before RoPE, each head with its own weights (qk_norm
    "head_layer")."""
    return dict(_dense(hf), **_cohere_blocks(hf, rope_everywhere=True), qk_norm="head_layer" if hf.get("use_qk_norm") else None)


def _cohere2(hf: dict) -> dict:
    """Cohere 2 (cohere2, dense; Command R7B, Command A): Cohere's blocks (_cohere_blocks), the
    layers layer_types names sliding_attention (by default three in four) over the window."""
    hf = _cohere_layer_types(hf)
    return dict(_dense(hf, sliding=True), **_cohere_blocks(hf))


def _cohere_compass_text(hf: dict) -> dict:
    """Cohere's North models' text model (cohere_compass_text, CohereCompassForCausalLM):
    Cohere 2's blocks (the attention and the MLP of one LayerNorm's output, without bias,
    layer_norm_eps, added together to the residual) with RoPE on rotated halves, not pairs
    (a text-only forward's multimodal RoPE is the plain one), each layer type with the RoPE
    rope_parameters gives it (plain, at its own base; null: no RoPE, NoPE); the window over
    the layers layer_types names sliding_attention (by default none); the logits x
    logit_scale (by default 1)."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["full_attention"] * n
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Cohere's attention here")
    params = hf.get("rope_parameters") or {}
    by_kind = {}
    for kind in dict.fromkeys(kinds):
        if kind not in params:  # transformers' model reads one entry per layer type
            raise ValueError(f"config.json: rope_parameters has no {kind} entry for the {kind} layers")
        p = params[kind]
        if p is not None and (not isinstance(p, dict) or (p.get("rope_type") or "default") != "default"):
            raise ValueError(f"config.json: rope_parameters.{kind} = {p!r} is not supported (plain RoPE, or null: none)")
        by_kind[kind] = None if p is None else float(p.get("rope_theta", 10000.0))
    scale = hf.get("logit_scale")
    scale = 1.0 if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"config.json: logit_scale = {scale!r} is not supported (a positive number)")
    nope = tuple(i for i, kind in enumerate(kinds) if by_kind[kind] is None)
    full, sliding = by_kind.get("full_attention"), by_kind.get("sliding_attention")
    base = full if full is not None else sliding if sliding is not None else 10000.0
    local = sliding if full is not None and sliding is not None and sliding != full else None
    return dict(_dense(dict(hf, layer_types=kinds, rope_parameters=dict(rope_type="default", rope_theta=base)), sliding=True),
                norm_eps=float(hf.get("layer_norm_eps", 1e-5)), parallel_blocks=True, layer_norms=True, nope_layers=nope or None,
                local_rope_base=local, logit_divisor=1 / scale)


def _cohere_compass(hf: dict) -> dict:
    """A released North vision folder (cohere_compass, CohereCompassForConditionalGeneration):
    its text_config's model (_cohere_compass_text; the head untied unless the top level ties
    it, the whole model's default), each layer type's RoPE without its multimodal fields
    (mrope_section, mrope_interleaved: text positions are equal in all three, where that is
    plain RoPE); the vision model beside it is not read."""
    text = _text_config({"tie_word_embeddings": False, **hf})
    params = text.get("rope_parameters")
    if isinstance(params, dict):  # one entry per layer type (null: no RoPE)
        text["rope_parameters"] = {k: _text_rope(p) if isinstance(p, dict) else p for k, p in params.items()}
    return _text_family(hf, "cohere_compass_text", text)


def _cohere2_moe(hf: dict) -> dict:
    """Cohere 2 MoE (cohere2_moe): Cohere's blocks (_cohere_blocks) with RMSNorms where
    rms_norm_eps is set, LayerNorms without bias (layer_norm_eps) otherwise; dense blocks
    (of prefix_dense_intermediate_size, by default intermediate_size) and MoE blocks by
    mlp_layer_types (an older config's first_k_dense_replace dense blocks first, their
    layers full or sliding by prefix_dense_sliding_window_pattern, the others' by
    sliding_window_pattern); the dense blocks of pattern 1 rotate in their global layers
    too. Experts of intermediate_size: softmax over the top-k logits, or their sigmoids
    (renormalised with norm_topk_prob); num_shared_experts shared ones (one SwiGLU of that
    many times intermediate_size) summed with the routed output, or averaged with it
    (shared_expert_combination_strategy "average": both x 0.5, route_scale and shared_scale)."""
    n, first = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    if hf.get("layer_types") is None:
        prefix, every = hf.get("prefix_dense_sliding_window_pattern", 1), hf.get("sliding_window_pattern", 4)
        hf = dict(hf, layer_types=["sliding_attention" if (i + 1) % prefix else "full_attention" for i in range(first)]
                  + ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n - first)])
    if hf.get("mlp_layer_types") is None:
        hf = dict(hf, mlp_layer_types=["dense" if i < first else "sparse" for i in range(n)])
    kinds = hf["mlp_layer_types"]
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types = {kinds!r} is not supported (one of dense / sparse per layer)")
    select = hf.get("expert_selection_fn", "softmax")
    _refuse(hf, "expert_selection_fn", lambda v: v in ("softmax", "sigmoid"), "softmax or sigmoid")
    combine = hf.get("shared_expert_combination_strategy", "average")
    _refuse(hf, "shared_expert_combination_strategy", lambda v: v in ("average", "sum"), "average or sum")
    shared = hf.get("num_shared_experts") or 0
    blocks = _cohere_blocks(hf)
    # the dense prefix of pattern 1 keeps RoPE in its (global) layers
    forced = hf.get("prefix_dense_sliding_window_pattern", 1) == 1
    nope = tuple(i for i in blocks["nope_layers"] or () if not (forced and kinds[i] == "dense"))
    rms = hf.get("rms_norm_eps") is not None
    F = hf["intermediate_size"]
    moe = tuple(i for i, kind in enumerate(kinds) if kind == "sparse")
    half = combine == "average" and shared > 0
    return dict(_common(dict(hf, rms_norm_eps=hf.get("rms_norm_eps") or 1e-6), hf["num_experts"], sliding=True), **blocks) | dict(
        nope_layers=nope or None, layer_norms=not rms, norm_eps=float(hf["rms_norm_eps"] if rms else hf.get("layer_norm_eps", 1e-5)),
        ffn_expert=F, ffn_dense=hf.get("prefix_dense_intermediate_size") or F, n_shared=shared, moe_layers=moe, n_dense=0,
        score=select, expert_bias=False, route_normalize=select == "softmax" or bool(hf.get("norm_topk_prob", True)),
        route_scale=0.5 if half else None, shared_scale=0.5 if half else 1.0)


def _seed_oss(hf: dict) -> dict:
    """Seed-OSS (seed_oss, dense): Llama's blocks with biases on q, k and v (attention_bias)
    and on o apart (attention_out_bias)."""
    return _dense(hf, qkv_bias=bool(hf["attention_bias"]), o_bias=bool(hf.get("attention_out_bias", False)), mlp_bias=True)


def _hunyuan_v1_dense(hf: dict) -> dict:
    """Hunyuan dense (hunyuan_v1_dense): Llama's blocks with Hunyuan-A13B's attention (per-head
    q/k norms after RoPE, NTK-alpha RoPE: _ntk_alpha)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Hunyuan's attention here")
    return _ntk_alpha(hf, lambda plain: _dense(plain, qk_norm="head", qk_norm_after_rope=True))


def _granite(hf: dict) -> dict:
    """Granite 3 (dense): Llama's blocks with Granite's multipliers (_granite_multipliers)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Granite's attention here")
    return _dense(hf, **_granite_multipliers(hf), mlp_bias=True)


def _mixtral(hf: dict) -> dict:
    n = hf["num_local_experts"]
    return dict(_common(hf, n, sliding=True), ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=0)


def _hybrid_layer_types(hf: dict, default: list[str]) -> list[str]:
    """A hybrid model's layer_types (or layers_block_type; `default` where it has neither), the
    older names read as transformers reads them (mamba: linear_attention, attention:
    full_attention): full_attention or linear_attention for each layer, else a ValueError."""
    n = hf["num_hidden_layers"]
    kinds = [_LEGACY_KINDS.get(k, k) for k in (hf.get("layer_types") or hf.get("layers_block_type") or default)]
    if len(kinds) != n or set(kinds) - {"full_attention", "linear_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (full_attention or linear_attention for each of the {n} layers)")
    return kinds


def _minimax(hf: dict) -> dict:
    """MiniMax-Text-01 and MiniMax-M1 (minimax): lightning attention (linear_kind "lightning":
    num_attention_heads heads of head_dim, a constant decay per head by depth, no RoPE) in the
    layers layer_types names linear_attention (by default every second layer from layer 1),
    softmax attention with RoPE over every channel in the others; every block Mixtral's MoE
    (softmax top-k, renormalised); each sublayer's residual its normed input, weighted by the
    alpha factors (normed_residual) beside the output's beta factors (residual_scale), one
    alpha and one beta for every kind of sublayer."""
    kinds = _hybrid_layer_types(hf, ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(hf["num_hidden_layers"])])
    weights = {}
    for kind in ("alpha", "beta"):
        names = [f"full_attn_{kind}_factor", f"linear_attn_{kind}_factor", f"mlp_{kind}_factor"]
        values = {hf.get(name, 1) for name in names}
        if len(values) > 1 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf for v in values):
            raise ValueError(f"config.json: {' / '.join(names)} = {[hf.get(name, 1) for name in names]!r} is not supported "
                             f"(one positive {kind} for every sublayer)")
        weights[kind] = float(values.pop())
    common = _common(hf, hf["num_local_experts"])
    heads, dim = common["n_heads"], common["head_dim"]
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    return dict(common, ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=0,
                linear_layers=linear or None, linear_kind="lightning", linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=dim,
                linear_v_dim=dim, normed_residual=weights["alpha"], residual_scale=weights["beta"])


def _qwen_moe_layers(hf: dict) -> tuple[int, ...]:
    """Qwen's rule: block i is MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    return tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _qwen2_moe(hf: dict) -> dict:
    """Qwen2-MoE: MoE blocks by decoder_sparse_step and mlp_only_layers (_qwen_moe_layers) with a
    gated shared expert; the window in the layers layer_types names, by default every other
    one from layer 0 below max_window_layers (_max_window_layers)."""
    hf = _max_window_layers(hf, lambda i, first: (i + 1) % 2 != 0 and i < first)
    shared = hf.get("shared_expert_intermediate_size") or 0
    return dict(_common(hf, hf["num_experts"], sliding=True), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                moe_layers=_qwen_moe_layers(hf), n_shared=0, shared_ffn=shared, shared_gate=bool(shared),
                pre_softmax=not hf.get("norm_topk_prob", False), qkv_bias=bool(hf.get("qkv_bias", True)))


def _qwen3_moe(hf: dict) -> dict:
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Qwen3-MoE's attention here")
    return dict(_common(hf, _get(hf, "num_experts", "num_local_experts"), sliding=True), ffn_expert=hf["moe_intermediate_size"],
                ffn_dense=hf["intermediate_size"], moe_layers=_qwen_moe_layers(hf), n_shared=0,
                pre_softmax=not hf.get("norm_topk_prob", False), qk_norm="head")


def _deepseek_moe(hf: dict, *, n_dense: Optional[int] = None) -> dict:
    """The MoE blocks of the DeepSeek-style families (DeepSeek-V2 / -V3, GLM-4.5 / -4.7-Flash,
    dots.llm1): first_k_dense_replace dense blocks (or n_dense), then MoE blocks of experts
    of moe_intermediate_size with n_shared_experts shared experts, the routed weights scaled
    by routed_scaling_factor. first_k_dense_replace past num_hidden_layers (DeepSeek-V3's
    default 3 in a 2-layer config) makes every block dense, as transformers builds it."""
    return dict(ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"], n_shared=hf.get("n_shared_experts") or 0,
                n_dense=min(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]) if n_dense is None else n_dense,
                route_scale=_route_scale(hf))


def _route_scale(hf: dict) -> Optional[float]:
    """route_scale of routed_scaling_factor: None where it is 1."""
    scale = float(hf.get("routed_scaling_factor", 1.0))
    return None if scale == 1.0 else scale


def _sigmoid_routing(hf: dict, *, normalize: bool = True) -> dict:
    """GLM-4.5 / -4.7-Flash / DeepSeek-V3 / dots.llm1 routing: sigmoid scores with the
    correction bias for the choice, n_group groups scored by their best 2, weights
    renormalised with norm_topk_prob (`normalize` where the config leaves it out: the
    family's default); MTP modules with their own output norm."""
    groups = hf.get("n_group") or 1
    grouped = groups > 1
    if hf.get("norm_topk_prob", normalize):
        _refuse_single_renormalised(hf)
    return dict(score="sigmoid", expert_bias=True, n_groups=groups if grouped else None, topk_groups=hf.get("topk_group") if grouped else None,
                group_score_topk=2 if grouped else None, route_normalize=bool(hf.get("norm_topk_prob", normalize)), mtp_norm=True)


def _refuse_single_renormalised(hf: dict) -> None:
    """ValueError for k = 1 where the family renormalises the chosen sigmoids: its one weight
    becomes 1, fmoe's sigmoid routing keeps a single sigmoid as it is (SPEC 1)."""
    _refuse(hf, "num_experts_per_tok", lambda v: v != 1, "k > 1: this family renormalises a single sigmoid weight to 1, fmoe keeps it")


def _partial_rope(hf: dict, head_dim: int) -> Optional[int]:
    """rope_dim of GLM-4.5 / MiniMax-M2: RoPE on the first partial_rotary_factor x head_dim
    channels of each head (rope_parameters', else the top level's; MiniMax-M2's released
    configs say rotary_dim instead), None for all of them."""
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rope_dim = int(head_dim * factor) if factor is not None else hf.get("rotary_dim") or head_dim
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(f"config.json: a rotary part of {rope_dim} channels is not supported (an even number in (0, head_dim = {head_dim}])")
    return None if rope_dim == head_dim else rope_dim


def _glm4_moe(hf: dict) -> dict:
    common = _common(hf, hf["n_routed_experts"])
    return dict(common, **_deepseek_moe(hf), **_sigmoid_routing(hf), qkv_bias=bool(hf.get("attention_bias", False)),
                qk_norm="head" if hf.get("use_qk_norm") else None, rope_dim=_partial_rope(hf, common["head_dim"]))


def _sarvam_moe(hf: dict) -> dict:
    """Sarvam-30B (sarvam_moe; transformers builds it as Glm4MoeForCausalLM): GLM-4.5's model
    (_glm4_moe) with its own defaults (RoPE on every channel, q/k norms, x 2.5); the routing
    correction bias is always there (moe_router_enable_expert_bias false is refused), and
    there are no other biases than q/k/v's (use_bias is refused)."""
    _refuse(hf, "use_bias", lambda v: not v, "no biases in Sarvam's projections but q, k and v's")
    _refuse(hf, "moe_router_enable_expert_bias", lambda v: v, "the routing correction bias, as transformers builds Sarvam")
    return _glm4_moe(hf)


def _solar_open(hf: dict) -> dict:
    """Solar Open (solar_open): GLM-4.5's MoE blocks and routing (sigmoid scores with the
    correction bias, n_group groups scored by their best 2, norm_topk_prob, x
    routed_scaling_factor, n_shared_experts shared experts) in every block, Llama's
    attention (attention_bias on q, k and v, not o; no q/k norms, RoPE on every channel)."""
    _refuse(hf, "first_k_dense_replace", lambda v: not v, "every Solar Open block is MoE")
    _refuse(hf, "use_qk_norm", lambda v: not v, "no q/k norms in Solar Open's attention")
    plain = dict(hf, intermediate_size=hf["moe_intermediate_size"])  # no dense blocks: their size is never used
    return dict(_common(plain, hf["n_routed_experts"]), **_deepseek_moe(plain, n_dense=0), **_sigmoid_routing(hf),
                qkv_bias=bool(hf.get("attention_bias", False)))


def _dots1(hf: dict) -> dict:
    """dots.llm1: Qwen3's attention (per-head q/k norms; attention_bias on q, k, v and o;
    sliding windows in the layers layer_types names, by default those from
    max_window_layers on) with DeepSeek-V3's MoE blocks and routing (weights not
    renormalised unless norm_topk_prob)."""
    if "layer_types" not in hf and hf.get("sliding_window") is not None:
        first = hf.get("max_window_layers", hf["num_hidden_layers"])
        hf = dict(hf, layer_types=["sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])])
    bias = bool(hf.get("attention_bias", False))
    return dict(_common(hf, hf["n_routed_experts"], sliding=True), **_deepseek_moe(hf), **_sigmoid_routing(hf, normalize=False),
                qkv_bias=bias, o_bias=bias, qk_norm="head")


def _minimax_m2(hf: dict) -> dict:
    """MiniMax-M2: q/k RMS norms over the whole projections (qk_norm "proj"), RoPE on the
    first rotary_dim channels of each head; every block MoE, routed on sigmoids plus the
    correction bias (no groups, no scale), the chosen sigmoids renormalised."""
    _refuse(hf, "scoring_func", lambda v: v == "sigmoid", "sigmoid routing")
    _refuse(hf, "shared_intermediate_size", lambda v: not v, "no shared experts in MiniMax-M2 here")
    _refuse_single_renormalised(hf)
    common = _common(hf, hf["num_local_experts"])
    return dict(common, ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=0, score="sigmoid",
                expert_bias=True, route_normalize=True, qk_norm="proj", rope_dim=_partial_rope(hf, common["head_dim"]))


_M3_INDEX_LEGACY = dict(index_n_heads="sparse_num_index_heads", index_head_dim="sparse_index_dim", index_block_size="sparse_block_size",
                        index_topk_blocks="sparse_topk_blocks", index_local_blocks="sparse_local_block")


def _jetmoe(hf: dict) -> dict:
    """JetMoE (jetmoe; JetMoE-8B): every block a mixture of attention heads (moa_experts =
    num_local_experts attention experts, each a query projection of num_key_value_heads heads
    of kv_channels and an output projection, num_experts_per_tok of them per token over the
    kv heads that kv_proj makes for all; its router's softmax over the top-k logits; a bias on
    the attention's output: o_bias) and a MoE of as many experts and the same top-k (SwiGLU
    experts, input_linear the gate's rows then the up's; a bias on its output: moe_out_bias);
    no shared experts, no dense block, RoPE over whole heads, the head tied by default. The
    routers' balance loss weight aux_loss_coef is read as moa_aux_coeff. transformers' blocks
    norm with eps 1e-6 whatever rms_norm_eps (its final norm reads it): another one is refused."""
    _refuse(hf, "activation_function", lambda v: v == "silu", "silu, the experts' SwiGLU")
    _refuse(hf, "rms_norm_eps", lambda v: v == 1e-6, "1e-6: JetMoE's blocks norm with 1e-6 whatever it says, fmoe's norms share one eps")
    G, k = hf["num_key_value_heads"], hf["num_experts_per_tok"]
    coeff = hf.get("aux_loss_coef", 0.01)
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not 0 <= coeff < math.inf:
        raise ValueError(f"config.json: aux_loss_coef = {coeff!r} is not supported (a finite number >= 0)")
    F = hf["intermediate_size"]
    common = _common(dict(hf, hidden_act="silu", num_attention_heads=G * k, head_dim=hf["kv_channels"]), hf["num_local_experts"])
    return dict(common, ffn_expert=F, ffn_dense=F, n_dense=0, n_shared=0, moa_experts=hf["num_local_experts"], moa_topk=k,
                moa_aux_coeff=float(coeff), o_bias=True, moe_out_bias=True)


def _minimax_m3(hf: dict) -> dict:
    """MiniMax-M3's text model (minimax_m3_vl_text): per-head q/k RMS norms and every norm's
    gain 1 + weight (zero_centered_norms); plain RoPE on partial_rotary_factor of each head
    (rope_parameters'; transformers reads no rotary_dim); block-sparse attention in the layers
    layer_types names minimax_m3_sparse (an indexer of index_n_heads = num_key_value_heads
    heads of index_head_dim choosing index_topk_blocks blocks of index_block_size keys,
    index_local_blocks of them the query's own; TransformerConfig.index_topk_blocks), the
    others full; dense MLPs of dense_intermediate_size and MoE blocks by mlp_layer_types,
    routed on sigmoids plus the correction bias for the choice, renormalised, times
    routed_scaling_factor, beside a shared expert of shared_intermediate_size; every SwiGLU
    gpt-oss's clamped one (swiglu_alpha, swiglu_limit, up + 1; transformers computes it
    whatever hidden_act says). The released configs' sparse_attention_config and
    moe_layer_freq read as transformers reads them."""
    n = hf["num_hidden_layers"]
    sparse = hf.get("sparse_attention_config") or {}
    hf = dict(hf, hidden_act="silu", **{flat: sparse[old] for flat, old in _M3_INDEX_LEGACY.items() if old in sparse})
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]] if "sparse_attention_freq" in sparse \
            else ["full_attention"] * n
    mlps = hf.get("mlp_layer_types")
    if mlps is None:
        mlps = ["sparse" if f else "dense" for f in hf["moe_layer_freq"]] if hf.get("moe_layer_freq") is not None else ["sparse"] * n
    if len(kinds) != n or set(kinds) - {"full_attention", "minimax_m3_sparse"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of full_attention / minimax_m3_sparse per layer)")
    if len(mlps) != n or set(mlps) - {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types = {mlps!r} is not supported (one of dense / sparse per layer)")
    rope_type, _, _ = _rope_params(hf, None)
    if rope_type != "default":
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported for minimax_m3_vl_text (plain RoPE)")
    _refuse_single_renormalised(hf)
    common = _common(hf, hf["num_local_experts"])
    rope_dim = _partial_rope(dict(rope_parameters=hf.get("rope_parameters") or {}), common["head_dim"])
    moe = tuple(i for i, kind in enumerate(mlps) if kind == "sparse")
    blocks = tuple(i for i, kind in enumerate(kinds) if kind == "minimax_m3_sparse")
    dense_first = moe == tuple(range(n - len(moe), n))
    limit = hf.get("swiglu_limit", 7.0)
    glu = dict(swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=None if limit is None else float(limit), swiglu_offset=1.0)
    index = dict(index_topk_blocks=hf.get("index_topk_blocks", 16), index_block_size=hf.get("index_block_size", 128),
                 index_local_blocks=hf.get("index_local_blocks", 1), index_heads=hf.get("index_n_heads", 4), index_head_dim=hf.get("index_head_dim", 128),
                 index_block_layers=None if len(blocks) == n else blocks) if blocks else {}
    return dict(common, ffn_expert=hf["intermediate_size"], ffn_dense=hf.get("dense_intermediate_size", 12288), n_shared=0,
                shared_ffn=hf.get("shared_intermediate_size") or 0, n_dense=n - len(moe) if dense_first else 0,
                moe_layers=None if dense_first else moe, score="sigmoid", expert_bias=True, route_normalize=True, route_scale=_route_scale(hf),
                qk_norm="head", zero_centered_norms=True, rope_dim=rope_dim, **glu,
                **{"shared_" + name: value for name, value in glu.items()}, **index)


def _minimax_m3_vl(hf: dict) -> dict:
    """A released MiniMax-M3 folder (minimax_m3_vl): its text model (text_config, a
    minimax_m3_vl_text), the vision tower and its projectors unread."""
    text = _text_config(hf)
    if text.get("model_type", "minimax_m3_vl_text") != "minimax_m3_vl_text":
        raise ValueError(f"config.json: a minimax_m3_vl folder whose text model is {text.get('model_type')!r} is not supported "
                         "(expected 'minimax_m3_vl_text')")
    return _minimax_m3(text)


def _yarn(hf: dict, default_base: float = 10000.0) -> dict:
    """DeepSeek-V3's and gpt-oss's RoPE fields: plain, or YaRN (DeepSeek's mscale_all_dim
    also in the softmax scale; gpt-oss's truncate: false)."""
    rope_type, params, out = _rope_params(hf, "yarn", ("factor", "original_max_position_embeddings"), default_base)
    if rope_type == "default":
        return out
    _refuse(params, "truncate", lambda v: v is None or isinstance(v, bool), "a bool")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # an attention_factor written out (OLMo 3's) is the one transformers computes without it, or another model
    factor = float(params["factor"])
    own = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else yarn_mscale(factor)
    _refuse(params, "attention_factor", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isclose(v, own, rel_tol=1e-9)),
            f"YaRN's own attention factor, {own!r} from factor / mscale / mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise ValueError("config.json: rope_parameters.mscale_all_dim without mscale is not supported")
    return dict(out, yarn_factor=float(params["factor"]), yarn_original_max_positions=int(params["original_max_position_embeddings"]),
                yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow") or 1),
                yarn_mscale=float(mscale) if mscale and mscale_all_dim else 1.0,
                yarn_mscale_all_dim=float(mscale_all_dim) if mscale and mscale_all_dim else 0.0,
                yarn_truncate=params.get("truncate") is not False)


def _mla(hf: dict, *, interleaved: Optional[bool] = None) -> dict:
    """_common's fields and multi-latent attention's (DeepSeek-V2 / -V3, GLM-4.7-Flash):
    q/k heads of qk_nope_head_dim + qk_rope_head_dim, RoPE (plain or YaRN) on the last
    qk_rope_head_dim, on interleaved pairs by rope_interleave (or `interleaved`), a low-rank q
    of q_lora_rank (None: full rank), the kv latent of kv_lora_rank, values of v_head_dim."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in multi-latent attention here")
    heads, nope, rope = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    common = _common(dict(hf, rope_parameters=None, rope_scaling=None, head_dim=nope + rope, num_key_value_heads=heads), hf["n_routed_experts"])
    return dict(common, **_yarn(hf), rope_dim=rope, rope_interleaved=bool(hf.get("rope_interleave", True)) if interleaved is None else interleaved,
                q_rank=hf.get("q_lora_rank"), kv_rank=hf["kv_lora_rank"], v_head_dim=hf["v_head_dim"])


def _youtu(hf: dict) -> dict:
    """Youtu-LLM (youtu, dense): DeepSeek-V3's multi-latent attention (_mla: RoPE, plain or
    YaRN, on interleaved pairs by rope_interleave) in Llama's blocks, each a SwiGLU MLP of
    intermediate_size."""
    _refuse(hf, "mlp_bias", lambda v: not v, "no MLP biases")
    F = hf["intermediate_size"]
    return dict(_mla(dict(hf, n_routed_experts=1, num_experts_per_tok=1)), ffn_dense=F, ffn_expert=F, n_dense=hf["num_hidden_layers"], n_shared=0)


def _minicpm3(hf: dict) -> dict:
    """MiniCPM3 (minicpm3, dense; MiniCPM3-4B): multi-latent attention (_mla) with RoPE on
    rotate-half pairs (not interleaved), plain or LongRoPE (_longrope), in Llama's blocks; the
    embeddings x scale_emb (rounded to their dtype), each attention and MLP output x
    scale_depth / sqrt(num_hidden_layers) (None: sqrt of it, so x 1), the normed hidden states
    divided by hidden_size / dim_model_base (None: hidden_size) before the head."""
    _refuse(hf, "mlp_bias", lambda v: not v, "no MLP biases")
    plain, longrope = _longrope(hf)
    n, F, H = hf["num_hidden_layers"], hf["intermediate_size"], hf["hidden_size"]
    depth, base = hf.get("scale_depth") or math.sqrt(n), hf.get("dim_model_base") or H
    out = _mla(dict(plain, n_routed_experts=1, num_experts_per_tok=1, v_head_dim=hf.get("v_head_dim") or H // hf["num_attention_heads"]),
               interleaved=False)
    return dict(out, **longrope, ffn_dense=F, ffn_expert=F, n_dense=n, n_shared=0, embed_scale=float(hf.get("scale_emb", 12)),
                round_embed_scale=True, residual_scale=depth / math.sqrt(n), logit_divisor=H / base)


def _deepseek_v3(hf: dict) -> dict:
    return dict(_mla(hf), **_deepseek_moe(hf), **_sigmoid_routing(hf))


def _axk1(hf: dict) -> dict:
    """A.X-K1 (axk1, SK Telecom): DeepSeek-V3's model (always with a q latent) with an RMSNorm on
    each MoE block's output, routed plus shared experts (post_mlp_layernorm: moe_out_norm;
    the released folders hold one for the dense blocks too, which nothing reads); dense and
    MoE blocks by mlp_layer_types, or an older config's first_k_dense_replace and
    moe_layer_freq (block i MoE from the first_k-th on, when i % freq == 0). The released
    folders route without a correction bias: it reads as zero where the folder has none."""
    hf = _ax_layers(hf, "A.X-K1's queries always come from a latent")
    return dict(_mla(hf), **_mlp_layer_types(hf, 1), **_sigmoid_routing(hf), moe_out_norm=True)


def _ax_layers(hf: dict, why_q_latent: str) -> dict:
    """A.X-K1's and A.X-K2's config with mlp_layer_types: its own, or an older config's
    first_k_dense_replace and moe_layer_freq (block i MoE from the first_k-th on, when i %
    freq == 0); ValueError (naming why_q_latent) without a q latent (q_lora_rank)."""
    if hf.get("mlp_layer_types") is None:
        first, freq = hf.get("first_k_dense_replace", 1), hf.get("moe_layer_freq", 1)
        hf = dict(hf, mlp_layer_types=["sparse" if i >= first and i % freq == 0 else "dense" for i in range(hf["num_hidden_layers"])])
    if not hf.get("q_lora_rank"):
        raise ValueError(f"config.json: q_lora_rank = {hf.get('q_lora_rank')!r} is not supported ({why_q_latent})")
    return hf


def _sarvam_mla(hf: dict) -> dict:
    """Sarvam-105B (sarvam_mla; transformers builds it as DeepseekV3ForCausalLM): DeepSeek-V3's
    model with its own defaults (full-rank q, no groups, one dense block first); a released
    config's rope_scaling of type deepseek_yarn is YaRN (its legacy head_dim and q_head_dim
    are derived fields, not read)."""
    scaling = hf.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        params = {k: v for k, v in scaling.items() if k != "type"}
        hf = dict(hf, rope_scaling=None, rope_parameters=dict(params, rope_type="yarn"))
    return _deepseek_v3(hf)


def _longcat_flash(hf: dict) -> dict:
    """LongCat-Flash (longcat_flash): num_layers layers of two sublayers each, fmoe's shortcut
    pairs (shortcut_moe: 2 num_layers blocks, each pair's first with the MoE beside its dense
    MLP of ffn_hidden_size); multi-latent attention with a q latent, RoPE on interleaved
    pairs, the query and kv latent scales (mla_scales); experts of expert_ffn_hidden_size,
    zero_expert_num identity experts (zero_experts); the router a float32 softmax over every
    choice, the choice by the probabilities plus the correction bias, the weights the chosen
    probabilities (pre_softmax) x routed_scaling_factor; no shared experts."""
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    _refuse(hf, "qk_head_dim", lambda v: v is None or v == nope + rope, f"qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
    _refuse(hf, "q_lora_rank", lambda v: bool(v), "a q latent (LongCat-Flash's queries always come from one)")
    _refuse(hf, "zero_expert_type", lambda v: v in (None, "identity"), "identity zero experts")
    for field in ("mla_scale_q_lora", "mla_scale_kv_lora"):  # the released configs' flags: transformers always scales
        _refuse(hf, field, lambda v: v is None or v is True, "true (transformers scales the q and kv latents)")
    scale = float(hf.get("routed_scaling_factor", 1.0))
    n = 2 * hf["num_layers"]
    return dict(_mla(dict(hf, num_hidden_layers=n), interleaved=True), n_layers=n, ffn_dense=hf["ffn_hidden_size"],
                ffn_expert=hf["expert_ffn_hidden_size"], n_dense=0, n_shared=0, shortcut_moe=True, zero_experts=hf.get("zero_expert_num") or 0,
                pre_softmax=True, expert_bias=True, route_scale=None if scale == 1.0 else scale, router_bias=bool(hf.get("router_bias", False)),
                mla_scales=True)


def _deepseek_v2(hf: dict) -> dict:
    """DeepSeek-V2 / -V2-Lite: DeepSeek-V3's multi-latent attention (RoPE always on
    interleaved pairs), first_k_dense_replace dense blocks, shared experts; the top-k of
    softmax over every expert as the weights (never renormalised: norm_topk_prob is not
    read, as in transformers), topk_method group_limited_greedy keeping the topk_group of
    n_group groups scored by their best expert; x routed_scaling_factor."""
    _refuse(hf, "topk_method", lambda v: v in ("greedy", "group_limited_greedy"), "greedy or group_limited_greedy")
    _refuse(hf, "scoring_func", lambda v: v == "softmax", "softmax routing")
    _refuse(hf, "mlp_bias", lambda v: not v, "no biases in the MLPs here")
    groups = hf.get("n_group") or 1
    grouped = hf.get("topk_method") == "group_limited_greedy" and groups > 1
    return dict(_mla(hf, interleaved=True), **_deepseek_moe(hf), pre_softmax=True, n_groups=groups if grouped else None,
                topk_groups=hf.get("topk_group") if grouped else None, group_score_topk=1 if grouped else None)


def _mistral4(hf: dict) -> dict:
    """Mistral 4 (mistral4, Mistral Small 4's text model): DeepSeek-V3's multi-latent
    attention (_mla: YaRN, RoPE on interleaved pairs by rope_interleave) with every query
    scaled after RoPE by 1 + beta * log(1 + floor(p / L)) at position p, beta and L
    rope_parameters' llama_4_scaling_beta and original_max_position_embeddings
    (query_temperature_scale and _floor; a beta of 0: no scale); the dense and MoE blocks,
    shared experts and scale of _deepseek_moe; the top-k of softmax over every expert,
    renormalised with norm_topk_prob (fmoe's softmax over the k chosen logits) or not
    (pre_softmax); no expert groups."""
    _refuse(hf, "n_group", lambda v: v is None or v == 1, "no expert groups: n_group = 1")
    return dict(_mla(hf), **_deepseek_moe(hf), pre_softmax=not hf.get("norm_topk_prob", True), **_query_temperature(hf))


# Molmo2's text config's fields where a config.json leaves them out (Molmo2TextConfig's defaults), and the family its blocks
# are by qk_norm_type and norm_after: Qwen3's (per-head q/k norms, pre-norm blocks) or OLMo 2's (q/k norms over the whole
# projections, the norms on each branch's output)
_MOLMO2_TEXT = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, additional_vocab_size=128,
                    attention_bias=False, qk_norm_type="qwen3", num_hidden_layers=36, intermediate_size=12288, hidden_act="silu",
                    max_position_embeddings=36864, rms_norm_eps=1e-6, norm_after=False, tie_word_embeddings=False)
_MOLMO2_BLOCKS = {("qwen3", False): "qwen3", ("olmo", True): "olmo2"}


def _molmo2_text(hf: dict) -> dict:
    """A molmo2 folder's text config (_text_config, at Molmo2TextConfig's defaults) as the
    family its blocks are (_MOLMO2_BLOCKS: qwen3 or olmo2, its model_type), without Molmo2's
    own fields (additional_vocab_size, the embedding's rows past the head's: _molmo2);
    ValueError for what neither family is: another qk_norm_type / norm_after pair, q/k/v
    biases, a tied head, RoPE scaling in some layers alone (rope_scaling_layers)."""
    text = {**_MOLMO2_TEXT, **_text_config(hf)}
    blocks = (text["qk_norm_type"], bool(text["norm_after"]))
    if blocks not in _MOLMO2_BLOCKS:
        raise ValueError(f"config.json: text_config's qk_norm_type = {blocks[0]!r} with norm_after = {blocks[1]} is not supported ('qwen3' with "
                         "pre-norm blocks or 'olmo' with norm_after: Qwen3's or OLMo 2's blocks)")
    _refuse(text, "attention_bias", lambda v: not v, "no q/k/v biases (Molmo2's blocks are Qwen3's or OLMo 2's here)")
    _refuse(text, "tie_word_embeddings", lambda v: not v, "an output head of its own (Molmo2's embedding holds more rows)")
    params = text.get("rope_parameters") or {}
    layers = text.get("rope_scaling_layers")
    if (params.get("rope_type", params.get("type", "default")) != "default" and layers is not None
            and sorted(layers) != list(range(text["num_hidden_layers"]))):
        raise ValueError(f"config.json: rope_scaling_layers = {layers!r} is not supported with rope_type {params.get('rope_type')!r} (the scaled "
                         "RoPE in every layer)")
    kind = _MOLMO2_BLOCKS[blocks]
    own = ("additional_vocab_size", "qk_norm_type", "norm_after", "rope_scaling_layers")
    return {**{k: v for k, v in text.items() if k not in own}, "model_type": kind}


def _molmo2_written(hf: dict) -> dict:
    """A molmo2 folder's text config as written back (_molmo2_text), or a ValueError where its
    embedding holds rows past the head's (additional_vocab_size), which neither family has."""
    if {**_MOLMO2_TEXT, **_text_config(hf)}["additional_vocab_size"]:
        raise ValueError("model: a molmo2 folder's embedding holds rows past its head's (additional_vocab_size), which neither qwen3 nor olmo2 "
                         "has, so its text model is not written as either")
    return _molmo2_text(hf)


def _molmo2(hf: dict) -> dict:
    """Molmo2 (molmo2, Molmo2ForConditionalGeneration: Molmo2-4B / -8B, Molmo2-O-7B): its text
    model, Qwen3's blocks or OLMo 2's (_molmo2_text), under the released OLMo-core names
    (Family: model.transformer.blocks.{i}: attn_norm, self_attn.att_proj (every q's rows, then
    k's, v's), q_norm, k_norm, attn_out, ff_norm, mlp.ff_proj (the up's rows, then the gate's),
    ff_out; ln_f), an embedding of vocab_size + additional_vocab_size rows stored as
    wte.embedding then wte.new_embedding (Tensor.cat) beside a head of the first vocab_size
    (out_vocab); the vision backbone not read. Written back as its blocks' family where the
    embedding has no rows past the head's (written_config)."""
    text = {**_MOLMO2_TEXT, **_text_config(hf)}
    extra = text["additional_vocab_size"]
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise ValueError(f"config.json: text_config's additional_vocab_size = {extra!r} is not supported (an int >= 0)")
    blocks = _molmo2_text(hf)
    out = FAMILIES[blocks["model_type"]].kwargs(dict(blocks, vocab_size=text["vocab_size"] + extra))
    return dict(out, out_vocab=text["vocab_size"] if extra else None)


_MISTRAL3_TEXT = ("mistral4", "ministral3", "mistral")  # the text models of the mistral3 folders fmoe reads
# the released LLaVA-style folders' text models fmoe reads: families of Llama's checkpoint layout (Family fields equal to
# llama's but for how the config reads; tests/test_hf.py checks it)
_LLAVA_TEXT = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "granite")


def _listed_text(hf: dict) -> dict:
    """The text config (_text_config) of a folder whose text model may be one of several
    families (_TEXT_OF: a mistral3 or LLaVA-style folder; a text_config without a model_type
    is transformers' default one), or a ValueError naming one fmoe does not read there; a
    LLaVA-style folder's text model with the logit scale 1 (_unscaled: its class's head
    applies none), read so and written so. The head is tied as transformers' class of the
    whole model ties it (_TEXT_OF's rule): by the top level's tie_word_embeddings, at the
    class's default where the config leaves it out (True / False); where either level ties
    it ("or": LLaVA's, LLaVA-NeXT-Video's, LLaVA-OneVision's); by the top level's where
    stated, else by the text model's own ("text": Mistral 3's, whose released Ministral 3
    folders tie theirs in text_config and Mistral Small's do not)."""
    kinds, default, tied = _TEXT_OF[hf.get("model_type")]
    if tied == "or":
        text = _text_config({k: v for k, v in hf.items() if k != "tie_word_embeddings"})
        if hf.get("tie_word_embeddings"):
            text["tie_word_embeddings"] = True
    else:
        text = _text_config(hf if tied == "text" or "tie_word_embeddings" in hf else dict(hf, tie_word_embeddings=tied))
    text.setdefault("model_type", default)
    if text["model_type"] not in kinds:
        raise ValueError(f"config.json: a {hf.get('model_type')} folder whose text model is {text['model_type']!r} is not supported "
                         f"({', '.join(kinds)})")
    return _unscaled(hf, text)


def _listed_family(hf: dict) -> dict:
    """A released folder whose text model is one of several families (_TEXT_OF): that text
    model's kwargs (_listed_text). A Mistral 3 folder (mistral3, Mistral3ForConditionalGeneration)
    holds Mistral 4 (Mistral Small 4), Ministral 3 or Mistral (Mistral Small 3.1 / 3.2,
    Magistral and Devstral Small); a LLaVA-style one (_LLAVA: LLaVA 1.5, LLaVA-NeXT,
    LLaVA-NeXT-Video, LLaVA-OneVision, InternVL 3 / 3.5's -hf folders, Idefics3, SmolVLM /
    SmolVLM2, Granite Vision 3.x) Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE or Granite 3
    (_LLAVA_TEXT; Granite's logits unscaled, as the class computes them). The vision model
    and projector beside it are not read."""
    text = _listed_text(hf)
    return FAMILIES[text["model_type"]].kwargs(text)


def _mlp_layer_types(hf: dict, n_dense: int) -> dict:
    """n_dense and moe_layers of the dense and MoE blocks that mlp_layer_types names (one
    of dense / sparse per layer; by default n_dense dense blocks first), with _deepseek_moe's
    other fields."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (n - n_dense)
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types = {kinds!r} is not supported (one of dense / sparse per layer)")
    moe = tuple(i for i, kind in enumerate(kinds) if kind == "sparse")
    dense_prefix = moe == tuple(range(n - len(moe), n))  # n_dense dense blocks first, else the MoE blocks listed
    return dict(_deepseek_moe(hf, n_dense=n - len(moe) if dense_prefix else 0), moe_layers=None if dense_prefix else moe)


def _glm4_moe_lite(hf: dict) -> dict:
    """GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's multi-latent attention and MoE blocks,
    the dense and MoE blocks named by mlp_layer_types (by default the first dense)."""
    params = hf.get("rope_parameters") or {}
    _refuse(params, "partial_rotary_factor", lambda v: v == 1.0, "RoPE over the whole qk_rope_head_dim")
    return dict(_mla(hf), **_mlp_layer_types(hf, 1), **_sigmoid_routing(hf))


def _dsa(hf: dict, *, interleaved: bool) -> dict:
    """DeepSeek sparse attention's fields (DeepSeek-V3.2, GLM-5): the indexer's top-k,
    heads and head dim; its RoPE on interleaved pairs (GLM-5) or halves (DeepSeek-V3.2)."""
    return dict(index_topk=hf["index_topk"], index_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_rope_interleaved=interleaved)


def _deepseek_v32(hf: dict) -> dict:
    """DeepSeek-V3.2 (deepseek_v32): DeepSeek-V3's model (multi-latent attention with RoPE on
    interleaved pairs, its MoE blocks and routing, the dense and MoE blocks by
    mlp_layer_types, by default first_k_dense_replace dense blocks first) with DeepSeek sparse
    attention in every block, the indexer's RoPE on halves."""
    return dict(_mla(hf, interleaved=True), **_mlp_layer_types(hf, hf.get("first_k_dense_replace", 3)), **_sigmoid_routing(hf),
                **_dsa(hf, interleaved=False))


def _axk2(hf: dict) -> dict:
    """A.X-K2 (axk2, SK Telecom): DeepSeek-V3.2's model (multi-latent attention with RoPE on
    interleaved pairs and DeepSeek sparse attention in every layer, the indexer's RoPE on
    halves) with A.X-K2's pieces: the queries made from [q_a_layernorm(c) | c] of the q
    latent c (q_latent_raw) and an elementwise sigmoid output gate made from the same input
    (attn_gate_on_q): its q_b_proj holds each head's query rows, then its gate rows; gated
    RMSNorms (norm_gate_rank = gated_norm_rank: input_layernorm in every layer,
    post_attention_layernorm in the MoE layers; released as norm.weight beside the gate's
    W_down / W_up); dense and MoE layers by mlp_layer_types, or first_k_dense_replace and
    moe_layer_freq; sigmoid routing with the correction bias, renormalised x
    routed_scaling_factor, beside shared experts. Its grouped routing (n_group) fills the
    other groups' scores with 0, not -inf, and is refused. The MTP layers after the trunk's
    are not read, as in transformers."""
    hf = _ax_layers(hf, "A.X-K2's queries and gate come from a latent")
    _refuse(hf, "n_group", lambda v: v in (None, 1), "no expert groups: A.X-K2's grouped routing fills the other groups' scores with 0, "
            "not -inf, which fmoe does not build")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in A.X-K2's attention")
    _refuse(hf, "layer_types", lambda v: v is None or set(v) == {"indexed_attention"}, "A.X-K2's indexed_attention in every layer")
    rank = hf.get("gated_norm_rank", 16)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"config.json: gated_norm_rank = {rank!r} is not supported (a positive int)")
    return dict(_mla(hf, interleaved=True), **_mlp_layer_types(hf, 1), **_sigmoid_routing(hf), **_dsa(hf, interleaved=False), q_latent_raw=True,
                attn_gate=True, attn_gate_on_q=True, norm_gate_rank=rank)


def _indexer_types(hf: dict) -> list[str]:
    """GLM-5's indexer_types, "full" (the layer's own indexer) or "shared" (the previous full
    layer's choice) per layer: as config.json gives them, or as transformers derives them from
    index_topk_pattern ("F" / "S" per layer) or index_topk_freq and index_skip_topk_offset."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("indexer_types")
    if kinds is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    elif kinds is None:
        freq = max(hf.get("index_topk_freq") or 1, 1)
        offset = hf.get("index_skip_topk_offset")
        offset = 2 if offset is None else offset
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full", "shared"} or (kinds and kinds[0] != "full"):
        raise ValueError(f"config.json: indexer_types = {kinds!r} is not supported (full / shared per layer, the first full)")
    return kinds


def _glm_moe_dsa(hf: dict) -> dict:
    """GLM-5 (glm_moe_dsa): DeepSeek-V3.2's model with the indexer's RoPE on interleaved
    pairs; the layers indexer_types names "shared" have no indexer and attend to the keys
    the previous "full" layer chose (index_shared_layers)."""
    shared = tuple(i for i, kind in enumerate(_indexer_types(hf)) if kind == "shared")
    return dict(_deepseek_v32(hf), **_dsa(hf, interleaved=True), index_shared_layers=shared or None)


def _hy_v4(hf: dict, *, vl: bool = False) -> dict:
    """HY-V4 (hy_v4, Hy4): hc_mult residual streams of independent hyper-connections
    (TransformerConfig.hyper_connections, hc_kind "independent": no mixing, the post weights
    x hc_magnitude + hc_eps) around DeepSeek-V3.2's sparse attention on multi-latent attention
    (RoPE on halves, the indexer's on its last qk_rope_head_dim channels, its key's LayerNorm
    eps rms_norm_eps) with an elementwise sigmoid output gate and a sink per head; the layers
    indexer_types names "shared" (by default all but layer 0 and every fourth from layer 1)
    attend to the keys the previous "full" layer chose. DeepSeek-V3's MoE blocks and routing
    (sigmoid scores with the correction bias, norm_topk_prob, x routed_scaling_factor) beside
    n_shared_experts shared experts, the routed experts' SwiGLU clamped at swiglu_limit (gate
    below it, up within +-it); the dense and MoE blocks by mlp_layer_types (by default one
    dense block first). The MTP layers (model.mtp_layers.*) are not read, as in transformers.
    vl: HY-V4-VL's text model (_hy_v4_vl_text): RoPE on interleaved pairs, the indexer's too,
    and the latent norms' eps rms_norm_eps (mla_norm_eps)."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is not None and set(kinds) != {"indexed_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (HY-V4's indexed_attention in every layer)")
    limit = hf["swiglu_limit"]
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
        raise ValueError(f"config.json: swiglu_limit = {limit!r} is not supported (a positive clamp of the routed experts' SwiGLU)")
    default = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(n)]
    shared = tuple(i for i, kind in enumerate(_indexer_types(dict(hf, indexer_types=hf.get("indexer_types") or default))) if kind == "shared")
    vl_fields = dict(mla_norm_eps=float(hf["rms_norm_eps"])) if vl else {}
    return dict(_mla(hf, interleaved=vl), **_mlp_layer_types(hf, 1), **_sigmoid_routing(hf), **_dsa(hf, interleaved=vl), index_rope_last=True, **vl_fields,
                index_norm_eps=float(hf["rms_norm_eps"]), index_shared_layers=shared or None, attn_gate=True, attn_sinks=True,
                swiglu_alpha=1.0, swiglu_limit=float(limit), swiglu_offset=0.0, hyper_connections=hf["hc_mult"], hc_kind="independent",
                hc_magnitude=float(hf["hc_magnitude"]), hc_eps=float(hf["hc_eps"]))


def _deepseek_v4(hf: dict) -> dict:
    """DeepSeek-V4 (deepseek_v4) whose attention layers are sliding_attention and
    heavily_compressed_attention ones and compressed_sparse_attention ones (layer_types; the HCA
    layers are compress_layers of compress_rates' rate, the CSA layers csa_layers of theirs,
    csa_topk index_topk, their indexer's index_n_heads of index_head_dim; both layers' RoPE the compress one, plain or YaRN with attention_factor 1,
    the sliding layers' the main one, _deepseek_v4_compress_rope): hc_mult streams of manifold hyper-connections
    (TransformerConfig.hyper_connections, hc_kind "manifold", hc_sinkhorn_iters, hc_eps);
    attention of num_attention_heads query heads over one key head whose values are its keys
    (kv_shared), the queries from a normed q_lora_rank latent (q_rank) and RMS-normed per head
    without weights, the key normed with weights (qk_norm "head_k"), RoPE on each head's last
    qk_rope_head_dim channels in pairs (rope_last, interleaved; the "main" rope's theta), the
    output rotated back, a sink per head, a window of sliding_window, and the grouped output
    projection (o_groups, o_rank = o_lora_rank); every block a MoE of n_routed_experts
    experts with n_shared_experts shared ones, scored by scoring_func (sqrtsoftplus or
    sigmoid) with the correction bias, the chosen weights renormalised (always, as transformers
    does) x routed_scaling_factor, the routed and shared SwiGLUs clamped at swiglu_limit; the
    first blocks that mlp_layer_types names hash_moe route by their tid2eid table
    (hash_layers). The MTP layers (mtp.) are not read, as in transformers."""
    n = hf["num_hidden_layers"]
    _refuse(hf, "hidden_act", lambda v: v == "silu", "SwiGLU with silu only")
    kinds = hf.get("layer_types")
    if kinds is None or len(kinds) != n or set(kinds) - {"sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (sliding_attention, heavily_compressed_attention or "
                         "compressed_sparse_attention in every layer)")
    compressed = tuple(i for i, kind in enumerate(kinds) if kind == "heavily_compressed_attention")
    sparse = tuple(i for i, kind in enumerate(kinds) if kind == "compressed_sparse_attention")
    rate = (hf.get("compress_rates") or {}).get("heavily_compressed_attention", hf.get("compress_rate_hca", 128))
    csa_rate = (hf.get("compress_rates") or {}).get("compressed_sparse_attention", hf.get("compress_rate_csa", 4))
    csa = dict(csa_layers=sparse, csa_rate=csa_rate, csa_topk=hf.get("index_topk", 512), index_heads=hf.get("index_n_heads", 64),
               index_head_dim=hf.get("index_head_dim", 128)) if sparse else {}
    n_hash = min(n, hf.get("num_hash_layers", 3))
    mlp = hf.get("mlp_layer_types") or ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    n_hash = sum(kind == "hash_moe" for kind in mlp)
    if list(mlp) != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
        raise ValueError(f"config.json: mlp_layer_types = {mlp!r} is not supported (hash_moe in the first layers, then moe)")
    score = hf.get("scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"config.json: scoring_func = {score!r} is not supported (sqrtsoftplus or sigmoid)")
    if score == "sigmoid":
        _refuse_single_renormalised(hf)
    limit = hf["swiglu_limit"]
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
        raise ValueError(f"config.json: swiglu_limit = {limit!r} is not supported (a positive clamp of the SwiGLUs)")
    for field in ("attention_bias", "mlp_bias"):
        _refuse(hf, field, lambda v: not v, "no biases in DeepSeek-V4's projections")
    main, compress = _deepseek_v4_ropes(hf)
    rope = _deepseek_v4_compress_rope(main, compress) if compressed or sparse else dict(rope_base=float(main["rope_theta"]))
    D = hf["head_dim"]
    legacy = hf["qk_rope_head_dim"] / D if hf.get("qk_rope_head_dim") else 64 / 512  # transformers' fallback without partial_rotary_factor
    factor = main.get("partial_rotary_factor", hf.get("partial_rotary_factor") or legacy)
    rope_dim = int(D * factor)
    if not 0 < rope_dim < D or rope_dim % 2:
        raise ValueError(f"config.json: a rotary part of {rope_dim} channels is not supported (an even number in (0, head_dim = {D}))")
    window = hf["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window = {window!r} is not supported (a positive width)")
    for field in ("q_lora_rank", "o_groups", "o_lora_rank"):  # every DeepSeek-V4 has its q latent and grouped output projection
        if isinstance(hf[field], bool) or not isinstance(hf[field], int) or hf[field] < 1:
            raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported (a positive int)")
    eps = float(hf["rms_norm_eps"])
    return dict(vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=n, n_heads=hf["num_attention_heads"], n_kv_heads=1, head_dim=D,
                norm_eps=eps, mla_norm_eps=None if eps == 1e-6 else eps, **rope, rope_dim=rope_dim, rope_last=True, rope_interleaved=True,
                compress_layers=compressed or None, compress_rate=rate, **csa,
                q_rank=hf["q_lora_rank"], qk_norm="head_k", kv_shared=True, attn_sinks=True, o_groups=hf["o_groups"], o_rank=hf["o_lora_rank"],
                window=window, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), n_experts=hf["n_routed_experts"],
                k=hf["num_experts_per_tok"], ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["moe_intermediate_size"],
                n_shared=hf.get("n_shared_experts") or 0, n_dense=0, score=score, expert_bias=True, route_normalize=True,
                route_scale=_route_scale(hf), hash_layers=n_hash, swiglu_alpha=1.0, swiglu_limit=float(limit), swiglu_offset=0.0,
                shared_swiglu_limit=float(limit), hyper_connections=hf["hc_mult"], hc_kind="manifold",
                hc_sinkhorn_iters=hf["hc_sinkhorn_iters"], hc_eps=float(hf["hc_eps"]), mtp_depth=0)


def _deepseek_v4_ropes(hf: dict) -> tuple[dict, dict]:
    """DeepSeek-V4's two RoPEs, (main, compress), each {rope_type, rope_theta, ...} as
    transformers completes them: the sliding layers' main (plain, rope_theta) and the
    compressed layers' compress (compress_rope_theta, with the top level's YaRN fields)."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # the released configs' rope_scaling: the compressed layers' YaRN
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        main = dict(rope_type="default", rope_theta=hf.get("rope_theta", 10000.0))
        compress = {"rope_type": "default", **yarn, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
    if main.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: rope_parameters.main of rope type {main.get('rope_type')!r} is not supported (plain RoPE)")
    return main, compress


def _deepseek_v4_compress_rope(main: dict, compress: dict) -> dict:
    """TransformerConfig's RoPE fields of a DeepSeek-V4 model with compressed layers: theirs
    (compress: plain, or YaRN whose attention_factor is 1, the V4 reference's: neither cos /
    sin nor the softmax scaled) at rope_base, the sliding layers' plain main RoPE as
    local_rope_base (every layer has the window; the compressed ones keep the global tables)."""
    kind = compress.get("type", compress.get("rope_type", "default"))
    out = dict(rope_base=float(compress["rope_theta"]), local_rope_base=float(main["rope_theta"]))
    if kind == "default":
        return out
    if kind != "yarn" or compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: the compressed layers' rope of type {kind!r} (attention_factor {compress.get('attention_factor')!r}) is not "
                         "supported (plain, or YaRN with attention_factor 1)")
    return dict(out, yarn_factor=float(compress["factor"]), yarn_original_max_positions=int(compress["original_max_position_embeddings"]),
                yarn_beta_fast=float(compress.get("beta_fast", 32.0)), yarn_beta_slow=float(compress.get("beta_slow", 1.0)),
                yarn_truncate=bool(compress.get("truncate", True)), yarn_mscale=0.0, yarn_mscale_all_dim=0.0)


def _deepseek_v4_config(cfg: TransformerConfig) -> dict:
    """config.json of a DeepSeek-V4 model of `cfg` (_deepseek_v4's fields; its sliding layers
    alone): ValueError where cfg has no such model (config_mismatch names the fields)."""
    n, f = cfg.n_layers, (cfg.rope_dim or cfg.head_dim) / cfg.head_dim
    main_theta = cfg.rope_base if cfg.local_rope_base is None else cfg.local_rope_base
    main = dict(rope_type="default", rope_theta=main_theta, partial_rotary_factor=f)
    if not cfg.compress_layers and not cfg.csa_layers:  # the compressed layers' RoPE unused: transformers' own
        compress = dict(main, rope_theta=160000.0)
    elif cfg.yarn_factor is None:
        compress = dict(main, rope_theta=cfg.rope_base)
    else:
        compress = dict(_yarn_parameters(cfg), attention_factor=1.0, partial_rotary_factor=f)
    kinds = ["heavily_compressed_attention" if cfg.is_compressed(i) else "compressed_sparse_attention" if cfg.is_csa(i) else "sliding_attention"
             for i in range(n)]
    csa = dict(index_topk=cfg.csa_topk, index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim) if cfg.csa_layers else {}
    hf = dict(architectures=[FAMILIES["deepseek_v4"].architecture], model_type="deepseek_v4", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
              num_hidden_layers=n, num_attention_heads=cfg.n_heads, num_key_value_heads=1, head_dim=cfg.head_dim, q_lora_rank=cfg.q_rank,
              rms_norm_eps=cfg.norm_eps, hidden_act="silu", tie_word_embeddings=cfg.tie_embeddings, partial_rotary_factor=f, rope_theta=main_theta,
              compress_rope_theta=compress["rope_theta"], rope_parameters=dict(main=main, compress=compress), layer_types=kinds,
              compress_rates=dict(compressed_sparse_attention=cfg.csa_rate if cfg.csa_layers else 4, heavily_compressed_attention=cfg.compress_rate),
              **csa,
              sliding_window=cfg.window, o_groups=cfg.o_groups, o_lora_rank=cfg.o_rank, scoring_func=cfg.score,
              mlp_layer_types=["hash_moe" if cfg.is_hash(i) else "moe" for i in range(n)], swiglu_limit=cfg.swiglu_limit,
              hc_mult=cfg.hyper_connections, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, num_experts_per_tok=cfg.k,
              attention_bias=False, mlp_bias=False, dtype="float32", pad_token_id=None)
    moe = _deepseek_moe_config(cfg)
    hf.update({name: moe[name] for name in ("n_routed_experts", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor")},
              norm_topk_prob=True, num_nextn_predict_layers=0)
    return _equivalent(cfg, hf)


def _hy_v4_vl_text(hf: dict) -> dict:
    """HY-V4-VL's text model (hy_v4_vl_text; the released hy_v4_vl folders'): HY-V4's model
    (_hy_v4) with RoPE on interleaved pairs in the attention and the indexer and the latent
    norms' eps rms_norm_eps; its multimodal RoPE (mrope_section) of a text-only forward is
    the plain one, whose sections are not read."""
    return _hy_v4(dict(hf, rope_parameters=_text_rope(hf.get("rope_parameters") or dict(rope_type="default", rope_theta=10000.0))), vl=True)


def _hy_v4_vl(hf: dict) -> dict:
    """A released HY-V4-VL folder (hy_v4_vl, HYV4VLForConditionalGeneration): its text_config's
    model (_hy_v4_vl_text), stored as HY-V4's folders store it (model., lm_head), beside the
    vision tower (vit.) that is not read; the head untied unless the top level ties it."""
    return _text_family(hf, "hy_v4_vl_text", _text_config({"tie_word_embeddings": False, **hf}))


def _exaone_moe(hf: dict) -> dict:
    """EXAONE MoE (exaone_moe, K-EXAONE): per-head q/k norms before RoPE; with a
    sliding_window, the layers layer_types names sliding_attention (by default all but every
    sliding_window_pattern-th) attend over it with RoPE and the others attend globally
    without RoPE (NoPE); without one, every layer is global with RoPE. DeepSeek-V3's MoE
    blocks and routing (sigmoid scores with the correction bias, n_group groups scored by
    their best 2, norm_topk_prob, x routed_scaling_factor) beside num_shared_experts shared
    experts; the dense and MoE blocks by mlp_layer_types (by default first_k_dense_replace
    dense blocks first). The MTP layers (mtp.*) are not read, as in transformers."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in EXAONE's attention")
    hf, nope = _exaone_attention(hf)
    return dict(_common(hf, hf["num_experts"], sliding=True), **_mlp_layer_types(hf, hf.get("first_k_dense_replace", 1)),
                **_sigmoid_routing(hf), qk_norm="head", nope_layers=nope or None)


def _kolibri1(hf: dict) -> dict:
    """Kolibri-1 (kolibri1, Aleph Alpha): EXAONE's attention (per-head q/k norms before RoPE;
    the layers layer_types names sliding_attention, by default all but every fifth, attend
    over sliding_window with RoPE, the others globally without RoPE; without a window every
    layer is global with RoPE), GLM-4's sandwich norms (Family.sandwich: its released
    post_attn_norm and post_ffn_norm around the attention's and the MLP's outputs); every
    block MoE: the top-k of the router logits plus the correction bias (on the logits, not
    their sigmoids: expert_bias_on_logits), weighted by the chosen sigmoids (renormalised
    with norm_topk_prob, by default not), beside a shared expert of
    shared_expert_intermediate_size."""
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(hf["num_hidden_layers"])])
    if hf.get("sliding_window") is None and "sliding_attention" in hf["layer_types"]:
        raise ValueError("config.json: sliding_window = None is not supported with sliding_attention layers in layer_types "
                         "(Kolibri-1's sliding layers need a positive window)")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Kolibri-1's attention")
    normalize = bool(hf.get("norm_topk_prob", False))
    if normalize:
        _refuse_single_renormalised(hf)
    hf, nope = _exaone_attention(hf)
    return dict(_common(hf, hf["num_local_experts"], sliding=True), ffn_expert=hf["moe_intermediate_size"], n_dense=0, n_shared=0,
                shared_ffn=hf["shared_expert_intermediate_size"], score="sigmoid", expert_bias=True, expert_bias_on_logits=True,
                route_normalize=normalize, qk_norm="head", nope_layers=nope or None, post_norms=True)


_BEAM_ROPE = dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0), full_attention=None)


def _beam(hf: dict) -> dict:
    """Beam (beam): Qwen3-MoE's attention (per-head q/k norms) with an elementwise sigmoid
    output gate (gate_proj) plus a bias per head (gate_bias: attn_gate_bias); the layers
    layer_types names sliding_attention (by default all but every sixth and the last) attend
    over sliding_window; each layer type with RoPE (rope_parameters keyed by layer type, plain
    or Llama 3.1's; the sliding layers' own plain base local_rope_base) or, where its entry is
    None (by default the full layers), without, its queries scaled by (1 + (p + 1) / 2048) **
    0.1 (nope_temperature_kind "power"); sandwich norms (input_layernorm,
    post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm) with
    depth-scaled residual adds (depth_scaled_residual); dense and MoE blocks by
    mlp_layer_types (by default 3 dense first), DeepSeek-V3's routing (sigmoid scores with the
    correction bias, n_group groups scored by their best 2, norm_topk_prob, x
    routed_scaling_factor), no shared expert; the logits capped at final_logit_softcapping."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Beam's attention here")
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["sliding_attention" if (i + 1) % 6 and i < n - 1 else "full_attention" for i in range(n)])
    if hf.get("mlp_layer_types") is None:
        hf = dict(hf, mlp_layer_types=["dense"] * min(3, n) + ["sparse"] * (n - min(3, n)))
    params = hf.get("rope_parameters") or _BEAM_ROPE
    if not isinstance(params, dict) or set(params) != {"full_attention", "sliding_attention"} or not all(
            p is None or isinstance(p, dict) for p in params.values()):
        raise ValueError(f"config.json: rope_parameters = {params!r} is not supported (one per layer type, full_attention / "
                         "sliding_attention, each RoPE's parameters or None)")
    nope = tuple(i for i, kind in enumerate(hf["layer_types"]) if params.get(kind) is None)
    roped = [p for p in (params["full_attention"], params["sliding_attention"]) if p is not None]
    rope = {}
    if len(roped) == 2:  # both kinds rotate: the full layers' RoPE, the sliding layers' own plain base where it differs
        full, local = _rope_by_layer_type(dict(hf, rope_parameters=params), _BEAM_ROPE)
        rope = dict(rope_parameters=full, local_rope_base=local)
    elif roped:
        rope = dict(rope_parameters=roped[0])
    softcap = hf.get("final_logit_softcapping")
    _refuse(hf, "final_logit_softcapping", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf),
            "None or a positive cap")
    common = _common(dict(hf, rope_parameters=rope.get("rope_parameters"), rope_scaling=None), hf["num_experts"], sliding=True)
    return dict(common, **_mlp_layer_types(hf, 3), **_sigmoid_routing(hf), qk_norm="head", attn_gate=True, attn_gate_bias=True,
                post_norms=True, depth_scaled_residual=True, nope_layers=nope or None, local_rope_base=rope.get("local_rope_base"),
                nope_temperature_floor=2048 if nope else None, nope_temperature_kind="power" if nope else "log",
                logit_softcap=None if softcap is None else float(softcap))


def _exaone_attention(hf: dict) -> tuple[dict, tuple[int, ...]]:
    """EXAONE's layers (EXAONE 4.0, K-EXAONE): with a sliding_window, the layers layer_types
    names sliding_attention (by default from sliding_window_pattern: all but every n-th for
    an int n, or a string of L (local) and G (global) repeated over the layers, "LLLG")
    attend over it with RoPE and the others attend globally without RoPE (NoPE); without
    one, every layer is global with RoPE. The config with its layer_types, and the NoPE layers."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if window is not None and hf.get("layer_types") is None:
        pattern = hf.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            kinds = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        else:
            raise ValueError(f"config.json: sliding_window_pattern = {pattern!r} is not supported without layer_types "
                             "(a positive int, or a string of L and G)")
        hf = dict(hf, layer_types=kinds)
    elif window is None:  # every layer global, with RoPE
        hf = dict(hf, layer_types=None)
    return hf, tuple(i for i in range(n) if window is not None and hf["layer_types"][i] != "sliding_attention")


def _gpt_oss(hf: dict) -> dict:
    """gpt-oss: attention with q/k/v/o biases (attention_bias) and a sink per head, YaRN
    (rope_theta 150000 by default, truncate false), sliding windows in the layers layer_types
    names; every block MoE, softmax over the top-k router logits (the router has a bias), the
    experts with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit, up + 1)."""
    _refuse(hf, "num_local_experts", lambda v: isinstance(v, int) and v >= 1, "a positive number of experts")
    if hf.get("layer_types") is None:  # transformers' default: sliding and full attention in turn
        hf = dict(hf, layer_types=["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(hf["num_hidden_layers"])])
    common = _common(dict(hf, rope_parameters=None, rope_scaling=None), hf["num_local_experts"], sliding=True)
    limit = hf.get("swiglu_limit", 7.0)
    bias = bool(hf.get("attention_bias", True))
    return dict(common, **_yarn(hf, default_base=150000.0), ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0,
                n_shared=0, qkv_bias=bias, o_bias=bias, attn_sinks=True, router_bias=True, expert_biases=True,
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=None if limit is None else float(limit), swiglu_offset=1.0)


def _flint(hf: dict) -> dict:
    """Flint (flint): Qwen3-MoE's attention (per-head q/k norms before RoPE; attention_bias on
    q, k, v and o) with a sink per head; the layers layer_types names sliding_attention (by
    default all but the first two, every fourth from layer 1 and the last) attend over the
    window with RoPE, the others globally without RoPE (NoPE); MoE blocks by mlp_only_layers
    (by default [0, 1]) and decoder_sparse_step, routed on sigmoids without a bias and
    renormalised with norm_topk_prob, beside an ungated shared expert of
    shared_expert_intermediate_size."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:
        hf = dict(hf, layer_types=["full_attention" if i < 2 or i % 4 == 1 or i == n - 1 else "sliding_attention" for i in range(n)])
    if hf.get("mlp_only_layers") is None:
        hf = dict(hf, mlp_only_layers=[0, 1])
    normalize = bool(hf.get("norm_topk_prob", True))
    if normalize:
        _refuse_single_renormalised(hf)
    bias = bool(hf.get("attention_bias", False))
    nope = tuple(i for i, kind in enumerate(hf["layer_types"]) if kind != "sliding_attention")
    return dict(_common(hf, hf["num_experts"], sliding=True), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                moe_layers=_qwen_moe_layers(hf), n_shared=0, shared_ffn=hf.get("shared_expert_intermediate_size") or 0, shared_gate=False,
                score="sigmoid", expert_bias=False, route_normalize=normalize, qk_norm="head", qkv_bias=bias, o_bias=bias, attn_sinks=True,
                nope_layers=nope or None)


def _mellum(hf: dict) -> dict:
    """Mellum (mellum): Qwen3-MoE's attention (per-head q/k norms before RoPE; attention_bias
    on q, k, v and o) and routing (softmax top-k, renormalised with norm_topk_prob); sliding
    windows in the layers layer_types names (by default none), each layer type with its own
    RoPE (rope_parameters keyed by full_attention / sliding_attention: the full layers' is the
    trunk's, plain or Llama 3.1's; the sliding layers' the same, or plain RoPE at their own
    base, local_rope_base); dense and MoE blocks by mlp_layer_types (by default every block
    MoE). Its MTP layers (mtp.*) are not read, as in transformers."""
    full, local = _rope_by_layer_type(hf, _MELLUM_ROPE)
    kinds = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]  # by default no window (not every layer's)
    bias = bool(hf.get("attention_bias", False))
    common = _common(dict(hf, rope_parameters=full, layer_types=kinds), hf["num_local_experts"], sliding=True)
    return dict(common, **_mlp_layer_types(hf, 0), pre_softmax=not hf.get("norm_topk_prob", True), qk_norm="head",
                qkv_bias=bias, o_bias=bias, local_rope_base=local if common.get("window") is not None else None)


def _granite_multipliers(hf: dict) -> dict:
    """Granite's multipliers: the softmax scale attention_multiplier (not 1/sqrt(head_dim)),
    the embeddings x embedding_multiplier, each attention / MLP output x residual_multiplier
    before its residual add, the logits / logits_scaling."""
    multipliers = {}
    for ours, theirs in (("attn_scale", "attention_multiplier"), ("embed_scale", "embedding_multiplier"),
                         ("residual_scale", "residual_multiplier"), ("logit_divisor", "logits_scaling")):
        _refuse(hf, theirs, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number")
        multipliers[ours] = float(_get(hf, theirs, default=1.0))
    return multipliers


def _granitemoe(hf: dict, *, sliding: bool = False) -> dict:
    """GraniteMoE / GraniteMoeShared: every block MoE, softmax over the top-k router logits
    (Mixtral's), the softmax scale attention_multiplier (not 1/sqrt(head_dim)), the
    embeddings x embedding_multiplier, each attention / MLP output x residual_multiplier
    before its residual add, the logits / logits_scaling; shared_intermediate_size > 0: a
    shared expert MLP of that size, ungated. sliding: the layers layer_types names attend
    over the sliding window (GraniteMoeSWA)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Granite's attention here")
    return dict(_common(hf, hf["num_local_experts"], sliding=sliding), **_granite_multipliers(hf), ffn_expert=hf["intermediate_size"],
                ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=0, shared_ffn=hf.get("shared_intermediate_size") or 0)


_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap of older layer_types


def _mamba2_fields(hf: dict, linear: tuple[int, ...], channels: Optional[int] = None) -> dict:
    """The Mamba-2 mixers' fields (linear_kind "mamba2") of Granite 4.0-H, Bamba and Falcon-H1,
    in the blocks `linear`: mamba_n_heads heads of mamba_d_head (by default `channels` / heads;
    channels: Falcon-H1's mamba_d_ssm, None: mamba_expand x hidden), mamba_n_groups groups
    of C and B of mamba_d_state, mamba_d_conv taps with biases; projection biases and a
    clamped dt refused."""
    _refuse(hf, "mamba_conv_bias", lambda v: v is True, "the convolution's biases")
    _refuse(hf, "mamba_proj_bias", lambda v: not v, "no biases on the mixer's projections")
    _refuse(hf, "time_step_limit", lambda v: v is None or [_json_float(x) for x in v] == [0.0, math.inf], "dt unclamped, (0.0, inf)")
    heads, what = hf.get("mamba_n_heads", 128), "mamba_expand x hidden_size" if channels is None else "mamba_d_ssm"
    channels = hf.get("mamba_expand", 2) * hf["hidden_size"] if channels is None else channels
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = channels // heads if head_dim == "auto" else head_dim
    if heads * head_dim != channels:
        raise ValueError(f"config.json: mamba_n_heads x mamba_d_head = {heads} x {head_dim} is not supported ({what}, {channels})")
    return dict(linear_layers=linear or None, linear_kind="mamba2", linear_k_heads=hf.get("mamba_n_groups", 1), linear_v_heads=heads,
                linear_k_dim=hf.get("mamba_d_state", 256), linear_v_dim=head_dim, linear_conv=hf.get("mamba_d_conv", 4))


def _mamba2_config(cfg: TransformerConfig, ssm_channels: bool = False) -> dict:
    """The config.json fields _mamba2_fields reads back; with ssm_channels the x channels as
    mamba_d_ssm (Falcon-H1's), not as mamba_expand x hidden_size."""
    lin = cfg.linear_attention_config()
    common = dict(mamba_n_heads=lin.n_v_heads, mamba_d_head=lin.v_head_dim, mamba_n_groups=lin.n_k_heads, mamba_d_state=lin.k_head_dim,
                  mamba_d_conv=lin.conv, mamba_conv_bias=True, mamba_proj_bias=False)
    if ssm_channels:
        return dict(common, mamba_d_ssm=lin.v_channels)
    return dict(common, mamba_expand=_expand(cfg, "mamba_expand"))


def _expand(cfg: TransformerConfig, field: str) -> int:
    """A Mamba mixer's x channels over hidden, written as config.json's `field` (expand,
    mamba_expand); a ValueError where they are not a whole multiple of it."""
    lin = cfg.linear_attention_config()
    if lin.v_channels % cfg.hidden:
        raise ValueError(f"model: {'Mamba-1' if lin.kind == 'mamba1' else 'Mamba-2'}'s x channels (linear_v_heads x linear_v_dim = {lin.v_channels}) "
                         f"are not a whole multiple of hidden = {cfg.hidden} ({field})")
    return lin.v_channels // cfg.hidden


def _bamba(hf: dict) -> dict:
    """Bamba (bamba, dense; Bamba-9B): Llama's blocks (the MLP feed_forward after its norm
    pre_ff_layernorm) with Mamba-2 mixers (_mamba2_fields) in every layer but those
    attn_layer_indices names, whose attention rotates the first partial_rotary_factor of each
    head's channels (rope_parameters', else the top level's; transformers' default 0.5)."""
    n = hf["num_hidden_layers"]
    attention = set(hf.get("attn_layer_indices") or ())
    out = _dense(hf)
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Bamba's attention here")
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return dict(out, rope_dim=_partial_rope(dict(partial_rotary_factor=factor), out["head_dim"]),
                **_mamba2_fields(hf, tuple(i for i in range(n) if i not in attention)))


def _falcon_h1(hf: dict) -> dict:
    """Falcon-H1 (falcon_h1, dense; Falcon-H1 0.5B to 34B, Falcon-H1R, Falcon-H1-Tiny): every
    layer a parallel hybrid (parallel_hybrid): a Mamba-2 mixer (_mamba2_fields; its x channels
    mamba_d_ssm, apart from hidden_size; its output norm per group after the gate, before it,
    or none: mamba_rms_norm, mamba_norm_before_gate) beside Llama's attention, both of the
    block's normed input (input_layernorm), their outputs summed, then Llama's MLP
    (feed_forward after pre_ff_layernorm). Its muP multipliers: the embeddings' and the
    logits' as embed_scale and logit_divisor, the others folded into the weights they
    scale on load and taken out on export (_falcon_h1_folds). Biases refused."""
    for field in ("attention_bias", "projectors_bias"):
        _refuse(hf, field, lambda v: not v, "no biases on the attention's and the mixer's projections")
    mixers = _mamba2_fields(hf, tuple(range(hf["num_hidden_layers"])), hf.get("mamba_d_ssm"))  # without it: expand x hidden, as transformers
    gate_norm = ("before" if hf.get("mamba_norm_before_gate", True) else "after") if hf.get("mamba_rms_norm", False) else "none"
    return dict(_dense(hf), **mixers, parallel_hybrid=True, linear_gate_norm=gate_norm, embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                logit_divisor=1 / float(hf.get("lm_head_multiplier", 1.0)))


def _falcon_h1_folds(hf: dict) -> dict[str, float]:
    """Falcon-H1's multipliers folded into the weights they scale (the parameter's name
    under its block -> the factor; Family.folds): the mixer's in_proj rows z, x, B, C, dt by
    ssm_in_multiplier x ssm_multipliers (its mup_vector), its out_proj by
    ssm_out_multiplier; the attention's q, k, v by attention_in_multiplier (k by
    key_multiplier too), o by attention_out_multiplier; the MLP's gate and down by
    mlp_multipliers."""
    ssm_in = float(hf.get("ssm_in_multiplier", 1.0))
    z, x, b, c, dt = (float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5)
    attn_in, gate_down = float(hf.get("attention_in_multiplier", 1.0)), hf.get("mlp_multipliers") or (1.0, 1.0)
    return {"attn.wz": ssm_in * z, "attn.wv": ssm_in * x, "attn.wk": ssm_in * b, "attn.wq": ssm_in * c, "attn.wa": ssm_in * dt,
            "attn.wo": float(hf.get("ssm_out_multiplier", 1.0)), "attn_beside.wq": attn_in,
            "attn_beside.wk": attn_in * float(hf.get("key_multiplier", 1.0)), "attn_beside.wv": attn_in,
            "attn_beside.wo": float(hf.get("attention_out_multiplier", 1.0)), "mlp.w_gate": float(gate_down[0]), "mlp.w_down": float(gate_down[1])}


def _folded(family: "Family", hf: dict) -> Callable[[str], float]:
    """The factor each parameter's weights carry of the family's multipliers in config.json
    `hf` (Family.folds; 1: none), as a function of the parameter's name."""
    folds = {} if family.folds is None else family.folds(hf)
    return lambda name: folds.get(name.split(".", 2)[2], 1.0) if name.startswith("blocks.") else 1.0


def _json_float(v) -> float:
    """A float of config.json, as transformers writes inf and nan: {"__float__": "Infinity"}."""
    return float(v.get("__float__", "nan")) if isinstance(v, dict) else float(v)


def _mamba2_model(hf: dict) -> dict:
    """Mamba-2 (mamba2; Mamba-Codestral-7B, the mamba2-*m models): every layer a Mamba-2 mixer
    alone after its norm, no attention and no MLP (linear_layers and mlp_free_layers: every
    block): num_heads heads of head_dim (expand x hidden_size channels), n_groups groups of
    state_size, conv_kernel taps with biases; dt = softplus(...) clamped to time_step_limit
    (its lower end: linear_dt_min; an upper one is refused); every norm's eps
    layer_norm_epsilon. Projection biases and a convolution without biases refused. In float32
    the residual stream is transformers' (residual_in_fp32 keeps it float32 in a 16-bit load,
    where fmoe's is in the compute dtype)."""
    _refuse(hf, "use_bias", lambda v: not v, "no biases on the mixer's projections")
    _refuse(hf, "use_conv_bias", lambda v: v is True, "the convolution's biases")
    _refuse(hf, "hidden_act", lambda v: v == "silu", "silu after the convolution")
    low, high = (_json_float(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
    if high != math.inf or not 0 <= low < math.inf:
        raise ValueError(f"config.json: time_step_limit = {hf['time_step_limit']!r} is not supported (dt clamped below only, [min, inf))")
    H, heads, head_dim = hf["hidden_size"], hf.get("num_heads", 128), hf.get("head_dim", 64)
    if heads * head_dim != int(hf.get("expand", 2) * H):
        raise ValueError(f"config.json: num_heads x head_dim = {heads} x {head_dim} is not supported (expand x hidden_size, "
                         f"{int(hf.get('expand', 2) * H)}: transformers' mixer views one as the other)")
    return dict(_mixers_alone(hf, tie=False), linear_kind="mamba2", linear_k_heads=hf.get("n_groups", 8), linear_v_heads=heads,
                linear_k_dim=hf.get("state_size", 128), linear_v_dim=head_dim, linear_conv=hf.get("conv_kernel", 4), linear_dt_min=low)


def _mixers_alone(hf: dict, *, tie: bool) -> dict:
    """The fields of a model whose every layer is its mixer alone after its norm (Mamba's,
    Mamba-2's: linear_layers and mlp_free_layers every block; the attention and MoE fields
    unused), every norm's eps layer_norm_epsilon, the head tied by default with `tie`."""
    n = hf["num_hidden_layers"]
    every = tuple(range(n))
    return dict(vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=n, n_dense=n, ffn_dense=1, ffn_expert=1, n_experts=1, k=1,
                n_shared=0, score="softmax", expert_bias=False, mtp_depth=0, n_heads=1, n_kv_heads=1, head_dim=2,
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings", tie)), linear_layers=every,
                mlp_free_layers=every)


def _dt_rank(hf: dict, field: str) -> int:
    """Mamba-1's dt rank: config.json's `field`, "auto" (its default) ceil(hidden_size / 16)."""
    rank = hf.get(field, "auto")
    return math.ceil(hf["hidden_size"] / 16) if rank == "auto" else rank


def _mamba(hf: dict) -> dict:
    """Mamba (mamba; state-spaces' mamba-130m to 2.8b) and Falcon Mamba (falcon_mamba;
    Falcon-Mamba-7B): every layer a Mamba-1 mixer alone after its norm (_mixers_alone): expand x
    hidden_size channels of x (linear_kind "mamba1"), each with a state of state_size,
    conv_kernel taps with biases, dt of rank time_step_rank; Falcon Mamba's dt, B and C
    RMS-normed without weights, eps mixer_rms_eps. The head tied by default. Projection biases
    and a convolution without biases refused. residual_in_fp32 as with Mamba-2 (_mamba2_model)."""
    _refuse(hf, "use_bias", lambda v: not v, "no biases on the mixer's projections")
    _refuse(hf, "use_conv_bias", lambda v: v is True, "the convolution's biases")
    _refuse(hf, "hidden_act", lambda v: v == "silu", "silu after the convolution")
    falcon = hf.get("model_type") == "falcon_mamba"
    norms = dict(linear_dt_bc_norm="rms_unit", linear_norm_eps=float(hf.get("mixer_rms_eps", 1e-6))) if falcon else {}
    return dict(_mixers_alone(hf, tie=True), linear_kind="mamba1", linear_k_heads=1, linear_v_heads=int(hf.get("expand", 2) * hf["hidden_size"]),
                linear_k_dim=hf.get("state_size", 16), linear_v_dim=1, linear_conv=hf.get("conv_kernel", 4), linear_dt_rank=_dt_rank(hf, "time_step_rank"),
                **norms)


def _mamba_config(cfg: TransformerConfig, model_type: str) -> dict:
    """The config.json fields that _mamba reads back (Falcon Mamba's mixer_rms_eps too)."""
    lin = cfg.linear_attention_config()
    out = dict(state_size=lin.k_head_dim, conv_kernel=lin.conv, expand=_expand(cfg, "expand"), time_step_rank=lin.dt_rank,
               layer_norm_epsilon=cfg.norm_eps, use_bias=False, use_conv_bias=True, hidden_act="silu")
    return dict(out, mixer_rms_eps=lin.norm_eps) if model_type == "falcon_mamba" else out


def _period(kinds: list[bool], what: str) -> tuple[int, int]:
    """(period, offset): the layers where kinds is true are those with i % period == offset
    (Jamba's layout), the smallest such period; a ValueError naming `what` if none is."""
    n = len(kinds)
    for period in range(1, n + 2):
        for offset in range(period):
            if kinds == [i % period == offset for i in range(n)]:
                return period, offset
    raise ValueError(f"model: Jamba places its {what} layers every period layers from an offset; this model has them at "
                     f"{[i for i, k in enumerate(kinds) if k]}")


def _jamba_config(cfg: TransformerConfig) -> dict:
    """The config.json fields that _jamba reads back (beside the shared ones)."""
    lin, n = cfg.linear_attention_config(), cfg.n_layers
    attn_period, attn_offset = _period([not cfg.is_linear(i) for i in range(n)], "attention")
    moe = [cfg.is_moe(i) for i in range(n)]
    expert_period, expert_offset = _period(moe, "MoE") if any(moe) else (2, 1)
    return dict(attn_layer_period=attn_period, attn_layer_offset=attn_offset, expert_layer_period=expert_period, expert_layer_offset=expert_offset,
                num_experts=cfg.n_experts if any(moe) else 1, intermediate_size=cfg.ffn_expert if any(moe) else cfg.ffn_dense,
                mamba_d_state=lin.k_head_dim, mamba_d_conv=lin.conv, mamba_expand=_expand(cfg, "mamba_expand"), mamba_dt_rank=lin.dt_rank,
                mamba_conv_bias=True, mamba_proj_bias=False)


def _jamba(hf: dict) -> dict:
    """Jamba (jamba; Jamba-v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large): attention without RoPE
    (nope_layers) in layer i where i % attn_layer_period == attn_layer_offset, a Mamba-1 mixer
    (linear_kind "mamba1": mamba_expand x hidden_size channels, a state of mamba_d_state each,
    mamba_d_conv taps with biases, dt of rank mamba_dt_rank, dt, B and C RMS-normed with
    weights) in the others; the MLP (feed_forward, after pre_ff_layernorm) a MoE of
    num_experts experts of intermediate_size where i % expert_layer_period ==
    expert_layer_offset (none with num_experts 1), softmax over every expert, the top
    num_experts_per_tok not renormalised; a SwiGLU of that size elsewhere. Biases on the
    mixer's projections, or none on its convolution, refused."""
    _refuse(hf, "mamba_proj_bias", lambda v: not v, "no biases on the mixer's projections")
    _refuse(hf, "mamba_conv_bias", lambda v: v is True, "the convolution's biases")
    n, E = hf["num_hidden_layers"], hf.get("num_experts", 16)
    for field in ("attn_layer", "expert_layer"):
        period, offset = hf.get(f"{field}_period"), hf.get(f"{field}_offset")
        if not (isinstance(period, int) and isinstance(offset, int) and 0 <= offset < period):
            raise ValueError(f"config.json: {field}_period, {field}_offset = {period!r}, {offset!r} are not supported (0 <= offset < period)")
    attention = tuple(i for i in range(n) if i % hf["attn_layer_period"] == hf["attn_layer_offset"])
    moe = tuple(i for i in range(n) if E > 1 and i % hf["expert_layer_period"] == hf["expert_layer_offset"])
    F = hf["intermediate_size"]
    return dict(_common(hf if moe else dict(hf, num_experts_per_tok=1), E if moe else 1), ffn_expert=F, ffn_dense=F, n_dense=n if not moe else 0, moe_layers=moe or None, n_shared=0,
                pre_softmax=True, nope_layers=attention or None, linear_layers=tuple(i for i in range(n) if i not in attention) or None,
                linear_kind="mamba1", linear_k_heads=1, linear_v_heads=hf.get("mamba_expand", 2) * hf["hidden_size"],
                linear_k_dim=hf.get("mamba_d_state", 16), linear_v_dim=1, linear_conv=hf.get("mamba_d_conv", 4),
                linear_dt_rank=_dt_rank(hf, "mamba_dt_rank"), linear_dt_bc_norm="rms")


def _mamba2_model_config(cfg: TransformerConfig) -> dict:
    """The config.json fields that _mamba2_model reads back."""
    lin = cfg.linear_attention_config()
    return dict(num_heads=lin.n_v_heads, head_dim=lin.v_head_dim, n_groups=lin.n_k_heads, state_size=lin.k_head_dim, conv_kernel=lin.conv,
                expand=_expand(cfg, "expand"), layer_norm_epsilon=cfg.norm_eps, use_bias=False, use_conv_bias=True, hidden_act="silu",
                time_step_limit=[cfg.linear_dt_min, {"__float__": "Infinity"}])


_NEMOTRON_H_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}  # hybrid_override_pattern's letters


def _nemotron_h_blocks(hf: dict) -> list[tuple[Optional[str], Optional[str]]]:
    """Nemotron-H's layers (layers_block_type, or its older hybrid_override_pattern: M Mamba-2,
    * attention, - MLP, E MoE; by default transformers' four) as fmoe's blocks: each mixer
    layer with the MLP or MoE layer after it, if there is one, and an MLP or MoE layer with
    no mixer layer before it alone. [(mixer kind or None, "mlp", "moe" or None)] per block."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None and hf.get("hybrid_override_pattern") is not None:
        pattern = hf["hybrid_override_pattern"]
        if not isinstance(pattern, str) or set(pattern) - set(_NEMOTRON_H_PATTERN):
            raise ValueError(f"config.json: hybrid_override_pattern = {pattern!r} is not supported (letters of {''.join(_NEMOTRON_H_PATTERN)})")
        kinds = [_NEMOTRON_H_PATTERN[c] for c in pattern]
    kinds = [_LEGACY_KINDS.get(k, k) for k in (kinds or ["linear_attention", "moe", "full_attention", "mlp"])]
    blocks: list[tuple[Optional[str], Optional[str]]] = []
    for j, kind in enumerate(kinds):
        if kind in ("linear_attention", "full_attention"):
            blocks.append((kind, None))
        elif kind in ("mlp", "moe") and blocks and blocks[-1][0] is not None and blocks[-1][1] is None:
            blocks[-1] = (blocks[-1][0], kind)
        elif kind in ("mlp", "moe"):  # no mixer layer before it: a block of its own (mixer_free_layers)
            blocks.append((None, kind))
        else:
            raise ValueError(f"config.json: layers_block_type = {kinds!r} is not supported (layer {j} is {kind!r}; expected "
                             "linear_attention, full_attention, mlp or moe)")
    return blocks


def _nemotron_h(hf: dict) -> dict:
    """Nemotron-H (nemotron_h; Nemotron-H-8B/56B, Nemotron-Nano-9B/12B-v2, and the MoE Nemotron 3
    Nano): layers of one sublayer each after its own norm (_nemotron_h_blocks: fmoe's blocks
    pair a mixer with the MLP or MoE after it, mlp_free_layers those without, mixer_free_layers
    an MLP or MoE layer after another): Mamba-2 mixers
    (mamba_num_heads heads of mamba_head_dim, any multiple of hidden_size: expand is not read,
    as in transformers; n_groups groups of ssm_state_size, conv_kernel taps with biases; dt at
    least time_step_min), attention without RoPE, MLPs relu(x up_proj)^2 down_proj of
    intermediate_size, MoE layers of experts without a gate (relu2) of moe_intermediate_size
    beside one shared expert of moe_shared_expert_intermediate_size, DeepSeek-V3's routing
    (_sigmoid_routing: sigmoid scores with the correction bias, n_group groups by their best
    2, renormalised with norm_topk_prob, x routed_scaling_factor), with moe_latent_size L
    (Nemotron 3 Super's latent MoE, moe_latent) the routed experts over L channels between
    fc1_latent_proj and fc2_latent_proj; every norm's eps layer_norm_epsilon. Projection,
    attention and MLP biases, tied embeddings and sliding windows refused; the MTP layers
    (mtp.) not read, as in transformers."""
    for field, what in (("use_bias", "no biases on the mixer's projections"), ("mlp_bias", "no MLP biases"),
                        ("attention_bias", "no attention biases"), ("tie_word_embeddings", "an untied head, as transformers builds it"),
                        ("sliding_window", "no sliding window")):
        _refuse(hf, field, lambda v: not v, what)
    _refuse(hf, "use_conv_bias", lambda v: v is True, "the convolution's biases")
    _refuse(hf, "mlp_hidden_act", lambda v: v == "relu2", "relu2, the squared ReLU of an MLP without a gate")
    _refuse(hf, "mamba_hidden_act", lambda v: v == "silu", "silu after the convolution")
    blocks = _nemotron_h_blocks(hf)
    heads = hf["num_attention_heads"]
    linear = tuple(i for i, (kind, _) in enumerate(blocks) if kind == "linear_attention")
    lin = dict(linear_layers=linear or None, linear_kind="mamba2", linear_k_heads=hf.get("n_groups", 8), linear_v_heads=hf.get("mamba_num_heads", 128),
               linear_k_dim=hf.get("ssm_state_size", 128), linear_v_dim=hf.get("mamba_head_dim", 64), linear_conv=hf.get("conv_kernel", 4))
    moe = tuple(i for i, (_, mlp) in enumerate(blocks) if mlp == "moe")
    F = hf.get("intermediate_size", 21504)
    if moe:
        routing = {k: v for k, v in _sigmoid_routing(hf).items() if k != "mtp_norm"}  # no MTP module read here
        experts = dict(n_experts=hf.get("n_routed_experts", 8), k=hf.get("num_experts_per_tok", 2), ffn_expert=hf.get("moe_intermediate_size", 7688),
                       shared_ffn=hf.get("moe_shared_expert_intermediate_size", 7688), **routing, mtp_depth=0,
                       moe_latent=hf.get("moe_latent_size") or None, route_scale=_route_scale(hf))
    else:
        experts = dict(n_experts=1, k=1, ffn_expert=F, score="softmax", expert_bias=False, mtp_depth=0)
    return dict(vocab_size=hf["vocab_size"], hidden=hf["hidden_size"], n_layers=len(blocks), moe_layers=moe, ffn_dense=F, n_shared=0, **experts,
                n_heads=heads, n_kv_heads=_get(hf, "num_key_value_heads", default=heads),
                head_dim=_get(hf, "head_dim", default=hf["hidden_size"] // heads), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                mlp_act="relu2", **lin, linear_dt_min=float(hf.get("time_step_min", 0.001)),
                nope_layers=tuple(i for i, (kind, _) in enumerate(blocks) if kind == "full_attention") or None,
                mlp_free_layers=tuple(i for i, (_, mlp) in enumerate(blocks) if mlp is None) or None,
                mixer_free_layers=tuple(i for i, (kind, _) in enumerate(blocks) if kind is None) or None)


def _nemotron_h_config(cfg: TransformerConfig) -> dict:
    """The config.json fields of Nemotron-H that _nemotron_h reads back: each block's layers
    (its mixer's, then its MLP's or MoE's) as layers_block_type, the mixers', the MoE's."""
    lin = cfg.linear_attention_config()
    kinds = [kind for i in range(cfg.n_layers)
             for kind in ((() if cfg.is_mixer_free(i) else ("linear_attention",) if cfg.is_linear(i) else ("full_attention",))
                          + (() if cfg.is_mlp_free(i) else ("moe",) if cfg.is_moe(i) else ("mlp",)))]
    out = dict(layers_block_type=kinds, layer_norm_epsilon=cfg.norm_eps, mlp_hidden_act="relu2", mamba_hidden_act="silu",
               intermediate_size=cfg.ffn_dense, mamba_num_heads=lin.n_v_heads, mamba_head_dim=lin.v_head_dim, n_groups=lin.n_k_heads,
               ssm_state_size=lin.k_head_dim, conv_kernel=lin.conv, time_step_min=cfg.linear_dt_min, use_conv_bias=True, use_bias=False,
               mlp_bias=False, attention_bias=False, num_nextn_predict_layers=0, moe_latent_size=cfg.moe_latent)
    if any(cfg.is_moe(i) for i in range(cfg.n_layers)):
        out.update(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.k, moe_intermediate_size=cfg.ffn_expert,
                   moe_shared_expert_intermediate_size=cfg.shared_size, n_shared_experts=1, n_group=cfg.n_groups or 1, topk_group=cfg.topk_groups or 1,
                   norm_topk_prob=cfg.route_normalize, routed_scaling_factor=cfg.route_scale if cfg.route_scale is not None else 1.0)
    return out


def _granitemoehybrid(hf: dict) -> dict:
    """Granite 4.0-H (granitemoehybrid; H-Tiny, H-Small): Granite's MoE blocks with a shared MLP
    and multipliers (_granitemoe), Mamba-2 mixers (linear_kind "mamba2") in the layers
    layer_types names linear_attention (or mamba; by default all) and attention in the others,
    with RoPE where position_embedding_type is "rope", else none (NoPE); with num_local_experts
    0 (H-Micro) every block's MLP is the shared one alone, a dense SwiGLU. The mixer:
    mamba_n_heads heads of mamba_d_head (by default mamba_expand x hidden / heads),
    mamba_n_groups groups of C and B of mamba_d_state, mamba_d_conv taps with biases."""
    kinds = _hybrid_layer_types(hf, ["linear_attention"] * hf["num_hidden_layers"])
    if hf.get("num_local_experts", 8) == 0:  # H-Micro: every block's MLP the shared one alone, a dense SwiGLU
        _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Granite's attention here")
        blocks = _dense(dict(hf, intermediate_size=hf["shared_intermediate_size"]), **_granite_multipliers(hf))
    else:
        blocks = _granitemoe(hf)
    attention = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    nope = attention if hf.get("position_embedding_type") != "rope" else ()
    return dict(blocks, **_mamba2_fields(hf, tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")), nope_layers=nope or None)


def _granitemoe_swa(hf: dict) -> dict:
    """GraniteMoeSWA: Granite's MoE blocks and multipliers (_granitemoe) with Granite SWA's
    attention (_granite_swa_attention)."""
    hf, attention = _granite_swa_attention(hf)
    return dict(_granitemoe(hf, sliding=True), **attention)


def _hyperclovax(hf: dict) -> dict:
    """HyperCLOVA X (hyperclovax, dense; HyperCLOVAX-SEED): Granite 3's blocks and multipliers
    (_granite_multipliers; the softmax scale by default 1/sqrt(head_dim)) but the logits
    multiplied by logits_scaling, not divided, and with Peri-Layer Normalization
    (use_post_norm, by default on): an RMSNorm on each attention and MLP output
    (post_norm1, post_norm2) before residual_multiplier and the residual add."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Granite's attention here")
    _refuse(hf, "use_post_norm", lambda v: isinstance(v, bool), "true or false")
    multipliers = _granite_multipliers({k: v for k, v in hf.items() if k != "attention_multiplier" or v is not None})
    if multipliers["attn_scale"] == _get(hf, "head_dim", default=hf["hidden_size"] // hf["num_attention_heads"]) ** -0.5 or hf.get(
            "attention_multiplier") is None:  # transformers' default (what its configs write), fmoe's: 1/sqrt(head_dim)
        multipliers["attn_scale"] = None
    return _dense(hf, **dict(multipliers, logit_divisor=1 / multipliers["logit_divisor"]), post_norms=hf.get("use_post_norm", True), mlp_bias=True)


def _granite_swa(hf: dict) -> dict:
    """Granite SWA (granite_swa, dense): Granite 3's blocks and multipliers with its own
    attention (_granite_swa_attention)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Granite's attention here")
    hf, attention = _granite_swa_attention(hf)
    return _dense(hf, sliding=True, **_granite_multipliers(hf), **attention, mlp_bias=True)


def _granite_swa_attention(hf: dict) -> tuple[dict, dict]:
    """Granite SWA's attention (granite_swa, granitemoe_swa): a learned attention sink per head
    in every layer, a sliding window of sliding_window tokens in the layers layer_types names
    sliding_attention (by default all but every fourth, from layer 0), and layer_rope_theta:
    each layer's RoPE base, 0 for a NoPE layer (one base for the others, or one for the full
    layers and another for the sliding ones: local_rope_base). (The config with its
    layer_types, window and RoPE base; the TransformerConfig fields of the sinks, the NoPE
    layers and the sliding layers' base.)"""
    n = hf["num_hidden_layers"]
    hf = dict(hf, layer_types=hf.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)],
              sliding_window=hf.get("sliding_window", 128))
    rope_type, params, base = _rope_params(hf)
    thetas = hf.get("layer_rope_theta") or [base["rope_base"]] * n
    full, sliding = ({float(t) for t, kind in zip(thetas, hf["layer_types"]) if t and (kind == "sliding_attention") == local} for local in (False, True))
    if len(thetas) != n or len(full) > 1 or len(sliding) > 1 or (full != sliding and full and sliding and rope_type != "default"):
        raise ValueError(f"config.json: layer_rope_theta = {hf.get('layer_rope_theta')!r} is not supported "
                         "(0 for NoPE, else one RoPE base per layer type: full / sliding)")
    local = None
    if full and sliding and full != sliding:  # the sliding layers' own base
        local = sliding.pop()
    if full or sliding:  # the base of the (full) RoPE layers
        hf["rope_parameters"] = dict(params, rope_theta=(full or sliding).pop())
    nope = tuple(i for i, t in enumerate(thetas) if not t)
    return hf, dict(attn_sinks=True, nope_layers=nope or None, local_rope_base=local)


def _llama4_text(hf: dict) -> dict:
    """Llama 4's text model (llama4_text, Llama4ForCausalLM): the layers no_rope_layers marks
    0 attend without RoPE (NoPE, by default every no_rope_layer_interval-th), with the
    query temperature (attn_temperature_tuning: floor_scale, attn_scale) and without q/k
    norms; the others rotate interleaved pairs, with weightless per-head q/k norms after
    RoPE (use_qk_norm). The layers layer_types names chunked_attention (by default the RoPE
    ones) attend within chunks of attention_chunk_size. The MoE blocks (moe_layers, by
    default every interleave_moe_layer_step-th) route each token to the top-k of the router
    logits, the raw sigmoid of each chosen logit scaling the token on its way into the
    expert, beside a shared expert of intermediate_size; the dense blocks' MLP is of
    intermediate_size_mlp. Experts stored as [E, H, 2F] gate_up_proj (gate, then up) and
    [E, F, H] down_proj."""
    n = hf["num_hidden_layers"]
    ropes = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    if len(ropes) < n or set(ropes[:n]) - {0, 1}:
        raise ValueError(f"config.json: no_rope_layers = {hf.get('no_rope_layers')!r} is not supported (1 for RoPE or 0 for NoPE, per layer)")
    kinds = hf.get("layer_types") or ["chunked_attention" if rope else "full_attention" for rope in ropes[:n]]
    if len(kinds) != n or set(kinds) - {"full_attention", "chunked_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of full_attention / chunked_attention per layer)")
    chunked = tuple(i for i, kind in enumerate(kinds) if kind == "chunked_attention")
    chunk = hf.get("attention_chunk_size")
    if chunked and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"config.json: attention_chunk_size = {chunk!r} is not supported (a positive length for the chunked layers)")
    step = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    moe = tuple(range(step - 1, n, step)) if moe is None else tuple(moe)
    nope = tuple(i for i in range(n) if not ropes[i])
    floor = hf.get("floor_scale", 8192) if hf.get("attn_temperature_tuning", True) and nope else None
    bias = bool(hf.get("attention_bias", False))
    return dict(_common(hf, hf["num_local_experts"]), ffn_expert=hf["intermediate_size"], ffn_dense=hf.get("intermediate_size_mlp", 16384),
                moe_layers=moe, n_shared=1, score="sigmoid", route_normalize=False, route_on_input=True, qkv_bias=bias, o_bias=bias,
                rope_interleaved=True, qk_norm="rms" if hf.get("use_qk_norm", True) else None, qk_norm_after_rope=bool(hf.get("use_qk_norm", True)),
                nope_qk_norm=False, nope_layers=nope or None, nope_temperature_floor=floor,
                nope_temperature_scale=float(hf.get("attn_scale", 0.1)), chunk=chunk if chunked else None,
                chunk_layers=None if len(chunked) == n else chunked or None)


def _llama4(hf: dict) -> dict:
    """A released Llama 4 folder (llama4, Llama4ForConditionalGeneration): its text_config's
    model (_llama4_text); the vision model beside it is not read."""
    return _text_family(hf, "llama4_text")


def _kimi_linear(hf: dict) -> dict:
    """Kimi Linear (kimi_linear): Kimi Delta Attention blocks (linear_layers, linear_kind "kda":
    linear_num_heads heads of linear_head_dim, a decay per key channel) and, in the
    full_attention layers, multi-latent attention without RoPE (nope_layers: the rope slices of
    the queries and the shared key used as they are; YaRN and rope_theta not read, as in
    transformers); DeepSeek-V3's MoE blocks and routing (sigmoid scores with the correction
    bias, groups scored by their best 2, renormalised, x routed_scaling_factor) with shared
    experts, the dense and MoE blocks by mlp_layer_types (by default first_k_dense_replace
    dense blocks first). A released config's linear_attn_config (num_heads, head_dim,
    short_conv_kernel_size; full_attn_layers and kda_layers numbered from 1) is read as
    transformers reads it; its mla_use_nope false and another router than the sigmoid are refused."""
    _refuse(hf, "mla_use_nope", lambda v: v, "multi-latent attention without RoPE, as transformers builds Kimi Linear")
    _refuse(hf, "moe_router_activation_func", lambda v: v == "sigmoid", "sigmoid routing")
    released = hf.get("linear_attn_config") or {}
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None and "full_attn_layers" in released and "kda_layers" in released:
        kinds = [None] * n
        for name, layers in (("full_attention", released["full_attn_layers"]), ("linear_attention", released["kda_layers"])):
            for layer in layers:
                if not 1 <= layer <= n:
                    raise ValueError(f"config.json: linear_attn_config lists layer {layer}, not one of the {n} layers (numbered from 1)")
                kinds[layer - 1] = name
    elif kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"full_attention", "linear_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (full_attention or linear_attention for each of the {n} layers)")
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    heads, dim = released.get("num_heads", hf["linear_num_heads"]), released.get("head_dim", hf["linear_head_dim"])
    mla = _mla(dict(hf, rope_parameters=None, rope_scaling=None, n_routed_experts=hf["num_experts"]))
    return dict(mla, **_mlp_layer_types(hf, hf.get("first_k_dense_replace", 1)), **_sigmoid_routing(hf), nope_layers=full or None,
                linear_layers=linear or None, linear_kind="kda", linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=dim,
                linear_v_dim=dim, linear_conv=released.get("short_conv_kernel_size", hf["linear_conv_kernel_dim"]))


def _bailing_hybrid(hf: dict) -> dict:
    """Ling's hybrid models (bailing_hybrid): Kimi Delta Attention blocks in Ling's variant
    (linear_kind "kda" with linear_full_rank: the decay's f_proj and the gate's g_proj whole;
    the bounded decay kda_lower_bound sigmoid(...) with kda_safe_gate, linear_decay_bound,
    else Kimi's) of linear_num_heads heads of linear_head_dim (by default num_attention_heads
    and head_dim, as transformers derives them), and in each layer_group_size-th layer (or
    by layer_types) multi-latent attention with RoPE on interleaved pairs and a sigmoid gate
    per head (attn_gate_per_head); DeepSeek-V3's MoE blocks and routing with shared experts,
    the dense and MoE blocks by mlp_layer_types (by default first_k_dense_replace dense
    blocks first). The MTP layers after the trunk's are not read, as in transformers."""
    kinds = _hybrid_layer_types(hf, ["full_attention" if (i + 1) % hf["layer_group_size"] == 0 else "linear_attention"
                                     for i in range(hf["num_hidden_layers"])])
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    heads, dim = hf.get("linear_num_heads", hf["num_attention_heads"]), hf.get("linear_head_dim", hf["head_dim"])
    mla = _mla(dict(hf, n_routed_experts=hf["num_experts"]), interleaved=True)
    return dict(mla, **_mlp_layer_types(hf, hf["first_k_dense_replace"]), **_sigmoid_routing(hf), linear_layers=linear or None,
                linear_kind="kda", linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=dim, linear_v_dim=dim,
                linear_conv=hf.get("linear_conv_kernel_dim", hf["short_conv_kernel_size"]), linear_full_rank=True,
                linear_decay_bound=float(hf["kda_lower_bound"]) if hf["kda_safe_gate"] else None,
                attn_gate=True, attn_gate_per_head=True)


def _kimi_k25(hf: dict) -> dict:
    """A released Kimi K2.5 / K2.6 folder (kimi_k25, KimiK25ForConditionalGeneration): its
    text_config's model, Kimi K2's (DeepSeek-V3's: transformers reads a kimi_k2 text config
    as deepseek_v3), under language_model.; the vision tower and projector are not read."""
    return _text_family(hf, "kimi_k2")


# transformers' Step3p7TextConfig's defaults where they differ from the mappings' own fallbacks, and the released configs'
# names of its fields (its attribute_map)
_STEP3P5_DEFAULTS = dict(vocab_size=128815, hidden_size=4096, intermediate_size=11264, num_hidden_layers=45, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, n_routed_experts=288, num_experts_per_tok=8,
                         moe_intermediate_size=1280, share_expert_dim=1280)
_STEP3P5_ALIASES = dict(num_key_value_heads="num_attention_groups", n_routed_experts="moe_num_experts", num_experts_per_tok="moe_top_k",
                        share_expert_dim="share_expert_dims", num_nextn_predict_layers="num_mtp_layers")


def _step3p5(hf: dict) -> dict:
    """Step 3.5 / 3.7 Flash's text model (step3p5: the released Step-3.5-Flash folders'
    Step3p5ForCausalLM; a step3p7 folder's text_config), as transformers' Step3p7TextModel
    reads it: zero-centred RMSNorms (the q/k norms per head too); the layers layer_types names
    sliding_attention attend over the sliding window, the others globally, each kind with
    its own RoPE (per layer type in rope_parameters, or the released per-layer rope_theta and
    partial_rotary_factors, one value per kind; rope_scaling, Llama 3.1's, on the full
    layers) and query heads (num_sliding_attention_heads, or attention_other_setting's,
    or per_layer_config's); an output gate sigmoid(x g_proj) per head; the softmax scale
    query_pre_attn_scalar ** -0.5; dense and MoE blocks by mlp_layer_types (or the released
    moe_layers_enum; by default the first three dense), MoE blocks routed on sigmoids plus the
    correction bias for the choice, renormalised, x moe_router_scaling_factor, beside one
    shared expert of share_expert_dim; the SwiGLUs with the limit on silu(gate) (mlp_act
    "silu_cap"; "silu" where nothing is clamped): swiglu_limits the routed experts',
    swiglu_limits_shared the shared expert's and the dense MLP's, per layer (0: none; one
    value each). Per-layer lists may carry the
    num_nextn_predict_layers MTP layers' entries after the trunk's, which are not read, nor
    are those layers (Family.extra_layers_read), as in transformers."""
    n = hf["num_hidden_layers"]
    extra = hf.get("num_nextn_predict_layers") or 0

    def per_layer(field: str):
        value = hf.get(field)
        if value is not None and (not isinstance(value, list) or len(value) not in (n, n + extra)):
            raise ValueError(f"config.json: {field} = {value!r} is not supported (one entry per layer: {n}"
                             + (f", or {n + extra} with the MTP layers')" if extra else ")"))
        return None if value is None else value[:n]

    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Step's attention here")
    _refuse(hf, "mlp_bias", lambda v: not v, "no MLP biases")
    _refuse(hf, "use_bidirectional_attention", lambda v: not v, "causal attention")
    _refuse(hf, "att_impl_type", lambda v: v == "GQA", "grouped-query attention, as transformers' model")
    _refuse(hf, "moe_router_activation", lambda v: v == "sigmoid", "sigmoid router scores, as transformers' model")
    for field in ("use_head_wise_attn_gate", "use_moe_router_bias", "norm_expert_weight", "zero_centered", "use_qk_norm"):
        _refuse(hf, field, lambda v: v is True, "true, as transformers' model")
    _refuse(hf, "sink", lambda v: not v, "no attention sinks, as transformers' model")
    _refuse(hf, "yarn_only_types", lambda v: list(v) in ([], ["full_attention"]), "rope_scaling on the full layers, as transformers' model")
    rope_layers = per_layer("use_rope_layers") if hf.get("use_rope_layers") else None  # the released configs' []: every layer
    if rope_layers is not None and not all(rope_layers):
        raise ValueError(f"config.json: use_rope_layers = {hf['use_rope_layers']!r} is not supported (RoPE in every layer, as transformers' model)")
    kinds = per_layer("layer_types") or ["full_attention"] * n
    mlp = per_layer("mlp_layer_types")
    if mlp is None:
        enum = hf.get("moe_layers_enum")
        items = (enum.split(",") if isinstance(enum, str) else enum) if enum is not None else range(3, n)
        try:
            moe = {int(i) for i in items if str(i).strip()}
        except (TypeError, ValueError):
            raise ValueError(f"config.json: moe_layers_enum = {enum!r} is not supported (the MoE layers' indices)") from None
        mlp = ["sparse" if i in moe else "dense" for i in range(n)]
    heads = hf["num_attention_heads"]
    other = hf.get("attention_other_setting") or {}
    for field, own in (("num_attention_groups", _get(hf, "num_key_value_heads")), ("head_dim", _get(hf, "head_dim"))):
        _refuse(other, field, lambda v: v == own, f"the sliding layers' {field} as the others', {own!r}")
    sliding_heads = _get(hf, "num_sliding_attention_heads", default=other.get("num_attention_heads", heads))
    per = hf.get("per_layer_config") or {}
    for entry in per.values():
        _refuse(dict(per_layer_config=entry), "per_layer_config", lambda v: isinstance(v, dict) and set(v) <= {"num_attention_heads"},
                "a head count per layer")
    heads_per_layer = [(per.get(str(i)) or per.get(i) or {}).get("num_attention_heads", sliding_heads if kind == "sliding_attention" else heads)
                       for i, kind in enumerate(kinds)]
    params = hf.get("rope_parameters") or {}
    if not all(isinstance(params.get(kind), dict) for kind in set(kinds)):  # the released per-layer lists (transformers' __post_init__)
        theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
        theta = per_layer("rope_theta") if isinstance(theta, list) else [theta] * n
        factors = per_layer("partial_rotary_factors")
        params = {}
        for kind in set(kinds):
            layers = [i for i, k in enumerate(kinds) if k == kind]
            for field, values in (("rope_theta", theta), ("partial_rotary_factors", factors)):
                if values is not None and len({values[i] for i in layers}) > 1:
                    raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported (one value for the {kind} layers)")
            params[kind] = dict(rope_type="default", rope_theta=theta[layers[0]])
            if factors is not None:
                params[kind]["partial_rotary_factor"] = factors[layers[0]]
        if hf.get("rope_scaling") and "full_attention" in params:
            params["full_attention"].update(hf["rope_scaling"])
    llama3 = {}
    full = params.get("full_attention")
    if full is not None and full.get("rope_type", full.get("type")) == "llama3":  # Llama 3.1's scaling on the full layers (Step 3.5's)
        llama3 = _rope(dict(rope_parameters=full))
        params = dict(params, full_attention=dict(rope_type="default", rope_theta=llama3["rope_base"],
                                                  partial_rotary_factor=full.get("partial_rotary_factor", 1.0)))
    laguna = dict({k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factors")}, layer_types=kinds,
                  mlp_layer_types=mlp, num_attention_heads_per_layer=heads_per_layer, rope_parameters=params,
                  num_experts=hf["n_routed_experts"], shared_expert_intermediate_size=hf["share_expert_dim"], gating="per-head",
                  moe_routed_scaling_factor=hf.get("moe_router_scaling_factor", 1.0), hidden_act="silu")
    out = _laguna(laguna)
    if llama3:
        out.update({k: v for k, v in llama3.items() if k != "rope_base"})
        if "sliding_attention" in params and out["local_rope_base"] is None:  # the sliding layers' plain RoPE beside the scaled one
            D = out["head_dim"]
            rotated = _partial_rope(dict(partial_rotary_factor=params["sliding_attention"].get("partial_rotary_factor", 1.0)), D)
            out.update(local_rope_base=float(params["sliding_attention"].get("rope_theta", 10000.0)),
                       local_rope_dim=(rotated or D) if rotated != out["rope_dim"] else None)
    limits = {}
    for field, knob in (("swiglu_limits", "swiglu_limit"), ("swiglu_limits_shared", "shared_swiglu_limit")):
        values = per_layer(field) or []
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf) for v in values):
            raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported (a limit >= 0 per layer, 0 or null: none)")
        clamped = {i: float(v) for i, v in enumerate(values) if v}
        if len(set(clamped.values())) > 1:
            raise ValueError(f"config.json: {field} = {hf[field]!r} is not supported (one limit for the layers it clamps)")
        limits.update({knob: next(iter(clamped.values())) if clamped else None, knob + "_layers": tuple(clamped) or None})
    scalar = _get(hf, "query_pre_attn_scalar", default=out["head_dim"])
    _refuse(dict(query_pre_attn_scalar=scalar), "query_pre_attn_scalar", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "a positive number")
    clamped = limits["swiglu_limit"] is not None or limits["shared_swiglu_limit"] is not None  # without limits "silu_cap" is silu
    return dict(out, **limits, attn_gate_act="sigmoid", attn_scale=None if scalar == out["head_dim"] else float(scalar) ** -0.5,
                zero_centered_norms=True, mlp_act="silu_cap" if clamped else "silu")


def _step3p7(hf: dict) -> dict:
    """A released Step 3.7 Flash folder (step3p7, Step3p7ForConditionalGeneration): its
    text_config's model, Step 3.5's (_step3p5); the vision model and its projector are not read."""
    return _text_family(hf, "step3p5")


def _afmoe(hf: dict) -> dict:
    """AFMoE (afmoe, Arcee Trinity): gated attention (the heads' outputs times sigmoid of
    gate_proj, channel by channel), per-head q/k norms; the layers layer_types names
    sliding_attention (by default all but every global_attn_every_n_layers-th) attend over
    the window with RoPE, the others globally without RoPE (NoPE); sandwich norms (an
    RMSNorm before and after the attention and the MLP); num_dense_layers dense blocks, then
    MoE blocks routed on sigmoids plus the expert bias, renormalised, x route_scale, beside
    num_shared_experts shared experts; mup_enabled: the embeddings x sqrt(hidden_size)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in AFMoE's attention here")
    n = hf["num_hidden_layers"]
    every = hf.get("global_attn_every_n_layers", 4)
    _refuse_single_renormalised(hf)
    hf = dict(hf, layer_types=hf.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)])
    nope = tuple(i for i in range(n) if hf["layer_types"][i] != "sliding_attention")
    return dict(_common(hf, hf["num_experts"], sliding=True), **_deepseek_moe(hf, n_dense=hf.get("num_dense_layers", 1)),
                score="sigmoid", expert_bias=True, route_normalize=True, qk_norm="head",
                nope_layers=nope or None, attn_gate=True, post_norms=True, embed_scale=hf["hidden_size"] ** 0.5 if hf.get("mup_enabled") else 1.0)


_LAGUNA_ROPE = dict(full_attention=dict(rope_type="default", rope_theta=500000.0, partial_rotary_factor=0.5),
                    sliding_attention=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0))


def _laguna(hf: dict) -> dict:
    """Laguna (laguna, Poolside): the layers layer_types names sliding_attention (by default
    none) attend over the sliding window, the others globally, each kind with its own plain
    RoPE (rope_parameters keyed by layer type: the full layers' base and partial rotary
    factor, rope_base and rope_dim, plain or YaRN; the sliding layers' plain RoPE,
    local_rope_base and local_rope_dim) and its own query heads (num_attention_heads_per_layer:
    one count for each kind, n_heads and local_heads); per-head q/k norms; an output gate softplus(x g_proj) before o_proj,
    one per head (gating true or "per-head") or per channel ("per-element"); dense and MoE
    blocks by mlp_layer_types (by default the first dense), MoE blocks routed on sigmoids of
    the logits soft-capped at moe_router_logit_softcapping (0: none), plus the correction
    bias for the choice, renormalised, x moe_routed_scaling_factor, beside one shared
    expert of shared_expert_intermediate_size."""
    n = hf["num_hidden_layers"]
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Laguna's attention here")
    _refuse(hf, "moe_apply_router_weight_on_input", lambda v: not v, "the router's weights on the experts' outputs, as in transformers")
    _refuse(hf, "moe_router_score_func", lambda v: v == "sigmoid", "sigmoid router scores")
    _refuse(hf, "gating", lambda v: v is True or v in ("per-head", "per-element"), 'true, "per-head" or "per-element"')
    _refuse_single_renormalised(hf)
    kinds = hf.get("layer_types") or ["full_attention"] * n
    hf = dict(hf, layer_types=kinds)
    common = _common(hf, hf["num_experts"], sliding=True)
    heads = hf.get("num_attention_heads_per_layer") or [hf["num_attention_heads"]] * n
    if len(heads) != n:
        raise ValueError(f"config.json: num_attention_heads_per_layer = {heads!r} is not supported (one count per layer)")
    by_kind = {kind: sorted({h for h, k in zip(heads, kinds) if k == kind}) for kind in ("full_attention", "sliding_attention")}
    if any(len(counts) > 1 for counts in by_kind.values()):
        raise ValueError(f"config.json: num_attention_heads_per_layer = {heads!r} is not supported (one head count for the full layers and one "
                         "for the sliding layers)")
    full_heads = (by_kind["full_attention"] or by_kind["sliding_attention"])[0]
    local_heads = by_kind["sliding_attention"][0] if by_kind["sliding_attention"] else full_heads
    params = hf.get("rope_parameters") or _LAGUNA_ROPE
    if not isinstance(params, dict) or set(params) - set(_LAGUNA_ROPE):
        raise ValueError(f"config.json: rope_parameters = {params!r} is not supported (one per layer type, full_attention / sliding_attention)")
    D, rope, yarn = common["head_dim"], {}, {}
    for kind, p in params.items():
        if kind not in kinds:  # a layer type no layer has: transformers builds its tables, which no layer reads
            continue
        rope_type = p.get("rope_type", p.get("type")) or "default"
        if kind == "full_attention" and rope_type == "yarn":  # YaRN's cos / sin factor only: Laguna's softmax scale stays 1/sqrt(D)
            _refuse(p, "mscale_all_dim", lambda v: not v, "YaRN without mscale_all_dim: Laguna's softmax scale is 1/sqrt(head_dim)")
            yarn = {k: v for k, v in _yarn(dict(hf, rope_parameters=p), 500000.0).items() if k.startswith("yarn_")}
        elif rope_type != "default":
            raise ValueError(f"config.json: rope_parameters.{kind} = {p!r} is not supported (plain RoPE in each layer type, or YaRN in the "
                             "full layers)")
        rotated = _partial_rope(dict(partial_rotary_factor=p.get("partial_rotary_factor", 1.0)), D)
        rope[kind] = (float(p.get("rope_theta", _LAGUNA_ROPE[kind]["rope_theta"])), rotated)
    for kind in set(kinds) - set(rope):
        raise ValueError(f"config.json: rope_parameters has no {kind} entry for the {kind} layers")
    full, sliding = rope.get("full_attention"), rope.get("sliding_attention")
    base, dim = full or sliding
    local = sliding if full is not None and sliding is not None and (sliding != full or yarn) else None
    cap = float(hf.get("moe_router_logit_softcapping") or 0.0)
    scale = float(hf.get("moe_routed_scaling_factor", 1.0))
    return {**common, **_mlp_layer_types(hf, 1)} | dict(n_heads=full_heads, local_heads=local_heads if local_heads != full_heads else None,
                rope_base=base, rope_dim=dim, local_rope_base=local[0] if local else None,
                local_rope_dim=(local[1] or D) if local and local[1] != dim else None,
                n_shared=0, shared_ffn=hf.get("shared_expert_intermediate_size") or 0, route_scale=None if scale == 1.0 else scale,
                score="sigmoid", expert_bias=True, route_normalize=True, qk_norm="head", attn_gate=True, attn_gate_act="softplus",
                attn_gate_per_head=hf.get("gating", True) in (True, "per-head"), router_softcap=cap or None, **yarn)


def _linear_layers(hf: dict) -> dict:
    """Qwen3-Next's and Qwen3.5's Gated DeltaNet blocks: the layers layer_types names
    linear_attention (by default all but every full_attention_interval-th), with
    linear_num_key_heads heads of linear_key_head_dim for q and k, linear_num_value_heads of
    linear_value_head_dim for v, a convolution of linear_conv_kernel_dim taps."""
    n = hf["num_hidden_layers"]
    every = hf.get("full_attention_interval", 4)
    kinds = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(kinds) != n or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of linear_attention / full_attention per layer)")
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    return dict(linear_layers=linear or None, linear_k_heads=hf["linear_num_key_heads"], linear_v_heads=hf["linear_num_value_heads"],
                linear_k_dim=hf["linear_key_head_dim"], linear_v_dim=hf["linear_value_head_dim"], linear_conv=hf["linear_conv_kernel_dim"])


def _olmo_hybrid(hf: dict) -> dict:
    """OLMo Hybrid (olmo_hybrid, dense; Olmo-Hybrid-7B): OLMo 3's post-norm attention blocks
    (_olmo2: norms on the attention and MLP outputs, q/k norms over the whole projections,
    RoPE, no window) in the layers layer_types names full_attention (by default every fourth,
    from layer 3, and the last where that names none), Gated DeltaNet blocks (_linear_layers;
    by default as many key and value heads as attention heads, keys of 0.75 hidden / heads
    channels, values of twice that) in the others: pre-norm blocks (linear_pre_norms; its files'
    attention_layer_norm and feedforward_layer_norm) whose write strength is 2 sigmoid(x wb) with
    linear_allow_neg_eigval (by default; linear_neg_eigval) and whose gated output norm has
    eps 1e-5 (linear_norm_eps)."""
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    k_heads = hf.get("linear_num_key_heads") or heads
    k_dim = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / k_heads)
    linear = _linear_layers(dict(hf, layer_types=kinds, linear_num_key_heads=k_heads, linear_num_value_heads=hf.get("linear_num_value_heads") or heads,
                                 linear_key_head_dim=k_dim, linear_value_head_dim=hf.get("linear_value_head_dim") or 2 * k_dim,
                                 linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4)))
    if linear["linear_layers"] is None or len(linear["linear_layers"]) == n:
        raise ValueError(f"config.json: OLMo Hybrid has linear-attention and attention layers both, got layer_types = {kinds!r}")
    hf = {k: v for k, v in hf.items() if k != "head_dim"}  # transformers' OLMo Hybrid has none: hidden / heads
    return dict(_olmo2(hf, "OLMo Hybrid"), **linear, linear_neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)), linear_norm_eps=1e-5,
                linear_pre_norms=True)


def _qwen3_next(hf: dict) -> dict:
    """Qwen3-Next (qwen3_next): Gated DeltaNet blocks (_linear_layers) beside gated attention
    (the heads' outputs times sigmoid of their gate, stored as rows of q_proj after each
    head's query) with per-head q/k norms and RoPE on the first partial_rotary_factor of each
    head; zero-centred RMSNorms (gain 1 + weight) everywhere but the linear blocks' gated
    output norm; MoE blocks by mlp_only_layers and decoder_sparse_step, softmax top-k
    renormalised with norm_topk_prob, beside a shared expert of shared_expert_intermediate_size
    with its sigmoid gate. Its MTP layers (mtp.*) are not read, as in transformers."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Qwen3-Next's attention here")
    common = _common(hf, hf["num_experts"])
    shared = hf.get("shared_expert_intermediate_size") or 0
    return dict(common, **_linear_layers(hf), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                moe_layers=_qwen_moe_layers(hf), n_shared=0, shared_ffn=shared, shared_gate=bool(shared), pre_softmax=not hf["norm_topk_prob"],
                qk_norm="head", attn_gate=True, rope_dim=_partial_rope(hf, common["head_dim"]), zero_centered_norms=True)


def _qwen3_5_moe_text(hf: dict) -> dict:
    """Qwen3.5-MoE's text model (qwen3_5_moe_text, Qwen3_5MoeForCausalLM): Qwen3-Next's
    (_qwen3_next) with Qwen3.5's unfused linear-attention projections, every block MoE, the
    top-k always renormalised. Its RoPE's mrope_section places the rotary pairs of image
    and video positions; text positions are equal in all three, where that is plain RoPE (on
    the first partial_rotary_factor of each head), the only input fmoe reads. Qwen3-Next's
    norm_topk_prob, decoder_sparse_step and mlp_only_layers are not read, as in transformers."""
    return _qwen3_next(dict(hf, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=hf["moe_intermediate_size"]))


def _qwen3_5_text(hf: dict) -> dict:
    """Qwen3.5's dense text model (qwen3_5_text, Qwen3_5ForCausalLM; Qwen3.5-27B's): Qwen3.5-MoE's
    blocks (_qwen3_5_moe_text: Gated DeltaNet beside gated attention, zero-centred norms) with a
    dense SwiGLU of intermediate_size in every block instead of the MoE."""
    F = hf["intermediate_size"]
    return _qwen3_next(dict(hf, num_experts=1, num_experts_per_tok=1, moe_intermediate_size=F, shared_expert_intermediate_size=0,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=list(range(hf["num_hidden_layers"]))))


def _qwen3_5(hf: dict) -> dict:
    """A released dense Qwen3.5 folder (qwen3_5, Qwen3_5ForConditionalGeneration): its
    text_config's model (_qwen3_5_text); the vision model beside it is not read."""
    return _text_family(hf, "qwen3_5_text")


def _lara_mini(hf: dict) -> dict:
    """Lara Mini (lara_mini, Lara 4 Mini): Qwen3.5's Gated DeltaNet blocks in the layers
    layer_types names linear_attention (by default the released period of five: linear,
    sliding, linear, full, sliding), the others Qwen3's attention (per-head q/k norms before
    RoPE; attention_bias on q, k, v and o; no output gate): sliding_attention layers attend
    over sliding_window with RoPE, full_attention layers globally without RoPE (NoPE); plain
    RMSNorms (gain weight, not Qwen3-Next's 1 + weight); every block MoE, softmax top-k
    (renormalised with norm_topk_prob) beside an ungated shared expert of
    shared_expert_intermediate_size."""
    n = hf["num_hidden_layers"]
    period = ("linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention")
    kinds = hf.get("layer_types") or [period[i % len(period)] for i in range(n)]
    if len(kinds) != n or set(kinds) - {"linear_attention", "sliding_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types = {kinds!r} is not supported (one of linear_attention / sliding_attention / "
                         "full_attention per layer)")
    normalize = bool(hf.get("norm_topk_prob", True))
    bias = bool(hf.get("attention_bias", False))
    # the sliding layers as _sliding reads them, the linear ones (no window) as full attention; the Gated DeltaNet blocks
    common = _common(dict(hf, layer_types=[kind if kind == "sliding_attention" else "full_attention" for kind in kinds]), hf["num_experts"],
                     sliding=True)
    linear = _linear_layers(dict(hf, layer_types=[kind if kind == "linear_attention" else "full_attention" for kind in kinds]))
    nope = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    return dict(common, **linear, ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["moe_intermediate_size"], moe_layers=tuple(range(n)), n_shared=0,
                shared_ffn=hf.get("shared_expert_intermediate_size") or 0, shared_gate=False, pre_softmax=not normalize, qk_norm="head",
                qkv_bias=bias, o_bias=bias, nope_layers=nope or None)


def _text_config(hf: dict) -> dict:
    """The text model's config of a multimodal folder (Llama 4's, Qwen3.5's): its text_config
    (a released Nemotron-H Omni folder's llm_config), with the top level's tie_word_embeddings
    where it has one (the field transformers' class of the whole model ties the head by)."""
    text = hf.get("text_config", hf.get("llm_config"))
    if not isinstance(text, dict):
        raise ValueError(f"config.json: a {hf.get('model_type')} config without a text_config is not supported")
    text = dict(text)
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _text_family(hf: dict, kind: str, text: Optional[dict] = None) -> dict:
    """A multimodal folder's text model (its text_config, _text_config; or `text`, that read
    and checked) read as family `kind`'s."""
    return FAMILIES[kind].kwargs(dict(_text_config(hf) if text is None else text, model_type=kind))


def _qwen3_5_moe(hf: dict) -> dict:
    """A released Qwen3.5-MoE folder (qwen3_5_moe, Qwen3_5MoeForConditionalGeneration): its
    text_config's model (_qwen3_5_moe_text); the vision model beside it is not read."""
    return _text_family(hf, "qwen3_5_moe_text")


def _text_part(text: dict, field: str):
    """ERNIE-4.5-VL's per-modality field ([text, vision], or one value for both): the text experts'."""
    value = text.get(field)
    return value[0] if isinstance(value, (list, tuple)) else value


def _ernie_vl_placement(text: dict) -> dict:
    """ERNIE-4.5-VL's MoE blocks (mlp_layer_types; by default all but the first) as ERNIE 4.5
    MoE's placement fields, or a ValueError where those cannot say them."""
    n = text["num_hidden_layers"]
    kinds = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"config.json: mlp_layer_types = {kinds!r} is not supported (one of dense / sparse per layer)")
    return _ernie_moe_layers(n, [i for i, kind in enumerate(kinds) if kind == "sparse"], strict=True)


def _whole_heads(text: dict) -> int:
    """A text config's head dim as an attention that reads no head_dim makes it: hidden_size / heads."""
    return text["hidden_size"] // text["num_attention_heads"]


# a released multimodal folder's model_type (Qwen2-VL, Qwen3-VL, Qwen3-Omni, GLM-4.5V; its text model read as its Family.written_as) ->
# the sub-config holding its text_config (None: the top level); transformers' defaults of that holder's fields and of the
# text_config's where they differ from the family's (the head untied); the fields the text model always has (the VL MoE
# router renormalises its top-k whatever the config says; GLM-4.5V's attention has q/k/v biases by default and no q/k norms;
# a function of the text config where the field follows from others)
_MULTIMODAL = {
    # Qwen2-VL, Qwen2.5-VL: Qwen2's text model; their released configs hold its fields at the top level (_TOP_LEVEL_TEXT)
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl"), (None, dict(tie_word_embeddings=False), dict(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        rms_norm_eps=1e-5, rope_theta=1e6), {})),
    "qwen3_vl_moe": (None, dict(tie_word_embeddings=False), dict(num_key_value_heads=16, rope_theta=5e5), dict(norm_topk_prob=True)),
    # Qwen3-VL and Cosmos3-Omni (Cosmos3-Nano's reasoner: Qwen3-VL's model under its own model_type)
    **dict.fromkeys(("qwen3_vl", "cosmos3_omni"), (None, dict(tie_word_embeddings=False), dict(num_key_value_heads=32, head_dim=128, rope_theta=5e5), {})),
    # Cosmos3-Edge: Llama's attention with MLPs without a gate, relu(x fc1)^2 fc2 (Arcee's model), RoPE plain over text
    "cosmos3_edge": (None, dict(tie_word_embeddings=False), dict(vocab_size=131072, hidden_size=2048, intermediate_size=9216, num_hidden_layers=28,
                                                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                                                hidden_act="relu2", rope_parameters=dict(rope_type="default", rope_theta=1e8)), {}),
    "qwen3_omni_moe": ("thinker_config", dict(tie_word_embeddings=False), dict(num_key_value_heads=4, rope_theta=1e6), {}),
    "qwen2_5_omni": ("thinker_config", dict(tie_word_embeddings=False), dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                                                             num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                                                             rope_theta=1e6), {}),
    "glm4v_moe": (None, dict(tie_word_embeddings=False), dict(vocab_size=151424, attention_bias=True), dict(use_qk_norm=False)),
    # GLM-4.1V / GLM-4.6V-Flash: GLM-4's dense text model, its q/k/v biases always there, its heads hidden_size / heads wide
    # whatever head_dim says, RoPE over every channel unless the rope_parameters say otherwise; glmga: GLM-4.6V's model under its
    # own model_type
    **dict.fromkeys(("glm4v", "glm46v", "glmga"), (None, dict(tie_word_embeddings=False), dict(vocab_size=151552, rms_norm_eps=1e-5,
                                                                                              partial_rotary_factor=1.0),
                                                   dict(attention_bias=True, head_dim=_whole_heads))),
    # PaddleOCR-VL: ERNIE 4.5's blocks with Qwen2-VL's RoPE (on halves, plain over text): Llama's model, its biases on q, k, v, o
    # and the MLPs one setting (use_bias)
    "paddleocr_vl": (None, dict(tie_word_embeddings=True), dict(vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18,
                                                                num_attention_heads=16, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
                                                                use_bias=False, rope_parameters=dict(rope_type="default", rope_theta=5e5)),
                     dict(attention_bias=lambda t: bool(t["use_bias"]), mlp_bias=lambda t: bool(t["use_bias"]))),
    # HunYuan-VL: Hunyuan dense's text model (its XD-RoPE's four axes equal over text: its plain RoPE), the head tied
    "hunyuan_vl": (None, dict(tie_word_embeddings=True), dict(tie_word_embeddings=True), {}),
    # GLM-OCR: GLM-4.1V's text model without q/k/v biases, its heads head_dim wide where the config says so
    "glm_ocr": (None, dict(tie_word_embeddings=False), dict(vocab_size=59392, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                                                            num_attention_heads=16, num_key_value_heads=8, rms_norm_eps=1e-5, partial_rotary_factor=1.0),
                dict(attention_bias=False, head_dim=lambda t: t.get("head_dim") or _whole_heads(t))),
    # ERNIE-4.5-VL: ERNIE 4.5 MoE's text model, its text experts' size the first of moe_intermediate_size's [text, vision],
    # its MoE blocks by mlp_layer_types (by default all but the first) in ERNIE 4.5 MoE's placement fields
    "ernie4_5_vl_moe": (None, dict(tie_word_embeddings=True), dict(moe_intermediate_size=[1536, 512], rms_norm_eps=1e-5),
                        dict(moe_intermediate_size=lambda t: _text_part(t, "moe_intermediate_size"),
                             moe_num_experts=lambda t: _text_part(t, "moe_num_experts"),
                             **{name: (lambda t, name=name: _ernie_vl_placement(t)[name])
                                for name in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")})),
}


def _multimodal_text(hf: dict) -> dict:
    """The text model's config of a released multimodal folder as its family's
    (_MULTIMODAL): its text_config at transformers' defaults, with the fixed fields, the
    sliding_window that transformers always clears left out, and RoPE without its multimodal
    fields (mrope_section, and mrope_interleaved or Qwen3-Omni's interleaved). Those place the
    rotary pairs of image, video and audio positions; text positions are equal in all three,
    where that is plain RoPE over the whole head, the only input fmoe reads (the vision
    model's deepstack features join the first blocks' outputs only at image tokens)."""
    holder, outer_defaults, defaults, fixed = _MULTIMODAL[hf["model_type"]]
    kind = FAMILIES[hf["model_type"]].written_as
    outer = hf if holder is None else hf.get(holder)
    if not isinstance(outer, dict):
        raise ValueError(f"config.json: a {hf['model_type']} config without a {holder} is not supported")
    if hf["model_type"] in _TOP_LEVEL_TEXT and "text_config" not in outer:  # a released Qwen2-VL's: the text fields at the top level
        outer = dict(outer, text_config={k: v for k, v in outer.items() if k != "vision_config"})
    text = {**defaults, **_text_config({**outer_defaults, **outer, "model_type": hf["model_type"]})}
    text.update({field: value(text) if callable(value) else value for field, value in fixed.items()}, model_type=kind)
    text.pop("sliding_window", None)
    for field in ("rope_parameters", "rope_scaling"):
        if isinstance(text.get(field), dict):
            text[field] = _text_rope(text[field])
    return text


def _text_rope(params: dict) -> dict:
    """RoPE parameters without their multimodal fields (mrope_section, and mrope_interleaved or
    Qwen3-Omni's interleaved), which place the rotary pairs of image, video and audio positions:
    text positions are equal in all three, where that is plain RoPE (Qwen2-VL's rope type
    "mrope" read as "default")."""
    params = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved", "interleaved")}
    if params.get("type", params.get("rope_type")) == "mrope":  # Qwen2-VL's name for it: plain RoPE over text
        params = {k: v for k, v in params.items() if k not in ("type", "rope_type")} | {"rope_type": "default"}
    return params


_TOP_LEVEL_TEXT = ("qwen2_vl", "qwen2_5_vl")  # released folders whose text_config may be the top level itself


def _multimodal(hf: dict) -> dict:
    """A released multimodal folder: qwen3_vl_moe (Qwen3VLMoeForConditionalGeneration:
    Qwen3-VL-30B-A3B, -235B-A22B) and qwen3_vl (Qwen3VLForConditionalGeneration: Qwen3-VL-2B to
    -32B), and cosmos3_omni (Cosmos3OmniForConditionalGeneration, Qwen3-VL's model), hold Qwen3-MoE's and Qwen3's
    text model beside a vision model, cosmos3_edge (Cosmos3EdgeForConditionalGeneration) Arcee's; qwen3_omni_moe
    (Qwen3OmniMoeForConditionalGeneration: Qwen3-Omni-30B-A3B) Qwen3-MoE's as its thinker's,
    beside the thinker's audio and vision encoders, the talker and the code-to-wave model;
    glm4v_moe (Glm4vMoeForConditionalGeneration: GLM-4.5V, GLM-4.6V) GLM-4.5's (glm4_moe:
    without q/k norms, and its MTP layer, which transformers does not read) beside a vision
    model, glm4v, glm46v and glmga (GLM-4.1V-9B, GLM-4.6V-Flash) GLM-4's dense one (glm4), glm_ocr
    (GLM-OCR) that one without q/k/v biases (and its MTP layer, which transformers does not read); paddleocr_vl
    (PaddleOCR-VL) ERNIE 4.5's blocks with RoPE on halves, Llama's model (llama); hunyuan_vl
    (HunYuan-VL) Hunyuan dense's (hunyuan_v1_dense); qwen2_vl and
    qwen2_5_vl (Qwen2-VL, Qwen2.5-VL) Qwen2's, qwen2_5_omni (Qwen2.5-Omni-3B / -7B) Qwen2's as
    its thinker's. The text model is read as its family's (Family.written_as, _multimodal_text);
    nothing beside it is."""
    text = _multimodal_text(hf)
    return FAMILIES[text["model_type"]].kwargs(text)


def _one_per_model(hf: dict, field: str):
    """A field that may be a per-layer list (Hunyuan's num_experts, moe_topk): one value for
    every layer, or a ValueError."""
    value = hf[field]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"config.json: {field} = {value!r} is not supported (the same value in every layer)")
        value = value[0]
    return value


def _hy_v3(hf: dict) -> dict:
    """HY-V3 (hy_v3, Tencent Hunyuan 3): per-head q/k norms before RoPE (attention_bias on q,
    k, v and o); the dense and MoE blocks by mlp_layer_types (by default the first dense);
    sigmoid routing with the correction bias and no groups, the chosen sigmoids renormalised
    and x router_scaling_factor, beside num_shared_experts shared experts. Its MTP layer (the
    layer after the trunk's) is not read, as in transformers."""
    _refuse(hf, "mlp_bias", lambda v: not v, "no biases in the MLPs here")
    _refuse_single_renormalised(hf)
    bias = bool(hf.get("attention_bias", False))
    return dict(_common(hf, hf["num_experts"]), **_mlp_layer_types(hf, 1), score="sigmoid", expert_bias=True, route_normalize=True,
                qk_norm="head", qkv_bias=bias, o_bias=bias)


def _hunyuan_v1_moe(hf: dict) -> dict:
    """Hunyuan-A13B (hunyuan_v1_moe): per-head q/k norms after RoPE; every block MoE, softmax
    over every expert, the top-k renormalised (fmoe's default softmax routing), beside a
    shared MLP of intermediate_size (as the experts); RoPE "dynamic" with a fixed alpha is
    NTK-alpha, the base stretched to rope_theta x alpha^(D / (D - 2))."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Hunyuan's attention here")
    common = _ntk_alpha(dict(hf, num_experts_per_tok=_one_per_model(hf, "moe_topk")), lambda plain: _common(plain, _one_per_model(hf, "num_experts")))
    return dict(common, ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0, n_shared=1,
                qk_norm="head", qk_norm_after_rope=True)


def _ntk_alpha(hf: dict, fields: Callable[[dict], dict]) -> dict:
    """Hunyuan's RoPE: "dynamic" with a fixed alpha is NTK-alpha, the base stretched to
    rope_theta x alpha^(D / (D - 2)); fields(hf) maps the config with that RoPE as plain RoPE
    of rope_theta (stretched after; without alpha, _common refuses "dynamic")."""
    rope_type, params, base = _rope_params(hf)
    alpha = params.get("alpha") if rope_type == "dynamic" else None
    out = fields(dict(hf, rope_parameters=dict(rope_type="default", rope_theta=base["rope_base"])) if alpha else hf)
    if alpha:
        D = out["head_dim"]
        out["rope_base"] = out["rope_base"] * float(alpha) ** (D / (D - 2))
    return out


def _ernie4_5_moe(hf: dict) -> dict:
    """ERNIE 4.5 MoE (ernie4_5_moe): Llama's attention with interleaved RoPE (channel pairs
    2i, 2i + 1), a MoE block every moe_layer_interval-th block from moe_layer_start_index to
    moe_layer_end_index (-1: the last), a SwiGLU of intermediate_size in the others;
    moe_num_shared_experts shared experts of moe_intermediate_size each. The router's
    softmax probabilities plus the correction bias (moe_statics.e_score_correction_bias,
    stored [1, E]) choose the moe_k experts, whose probabilities, renormalised, are the
    weights: fmoe's softmax routing with an expert_bias (fmoe.ops.route)."""
    _refuse(hf, "use_bias", lambda v: not v, "no biases on the linear layers")
    _refuse(hf, "moe_norm_min", lambda v: 0 <= v <= 1e-6, "a renormalisation floor of at most 1e-6: fmoe divides by the sum itself")
    L = hf["num_hidden_layers"]
    placement = {n: hf.get(n, d) for n, d in (("moe_layer_start_index", 1), ("moe_layer_end_index", -1), ("moe_layer_interval", 1))}
    for name, value in placement.items():
        if isinstance(value, bool) or not isinstance(value, int) or (name == "moe_layer_interval" and value < 1):
            raise ValueError(f"config.json: {name} = {value!r} is not supported (an int{', at least 1' if name == 'moe_layer_interval' else ''})")
    start, end, step = placement.values()
    end = L - 1 if end == -1 else end
    return dict(_common(hf, hf["moe_num_experts"]), ffn_expert=hf["moe_intermediate_size"], ffn_dense=hf["intermediate_size"],
                moe_layers=tuple(i for i in range(L) if (i + 1) % step == 0 and start <= i <= end),
                n_shared=hf.get("moe_num_shared_experts") or 0, rope_interleaved=True, expert_bias=True)


_DBRX_ATTN = dict(clip_qkv=None, kv_n_heads=1)  # DbrxAttentionConfig's defaults (of the fields read here)
_DBRX_FFN = dict(ffn_act_fn=None, ffn_hidden_size=3584, moe_num_experts=4, moe_top_k=1, moe_normalize_expert_weights=1.0)


def _dbrx(hf: dict) -> dict:
    """DBRX (dbrx): every block MoE, with its own names (d_model, n_heads, n_layers; the
    attention's fields in attn_config, the experts' in ffn_config). Bias-free LayerNorms
    (eps 1e-5: nn.LayerNorm's) before the attention and the experts and at the end; q, k
    and v the rows of one Wqkv, each clamped to [-clip_qkv, clip_qkv] (fmoe's clip_qkv);
    softmax over every expert, its top moe_top_k divided by their sum
    (moe_normalize_expert_weights 1, fmoe's default softmax routing) or kept as they are
    (None: pre_softmax); each expert's F rows in turn of one [E F, H] w1 (the gate), v1 (the
    up) and w2 (the down's transpose).

    RoPE: the top level's (rope_parameters, as transformers 5 writes them), else the base
    that the released config.json files give in attn_config.rope_theta (500000), as DBRX was
    trained and transformers 4 read it; transformers 5.24 reads the top level alone and
    builds such a folder at the default base 10000. moe_jitter_eps, the router input's
    multiplicative noise in training, is not built (a loaded model's function is the same;
    fmoe's fine-tuning routes without it); the dropouts are not either."""
    attn, ffn = {**_DBRX_ATTN, **(hf.get("attn_config") or {})}, {**_DBRX_FFN, **(hf.get("ffn_config") or {})}
    _refuse(ffn, "ffn_act_fn", lambda v: (v or {"name": "silu"}) == {"name": "silu"}, "SwiGLU with silu only")
    norm = ffn["moe_normalize_expert_weights"]
    _refuse(ffn, "moe_normalize_expert_weights", lambda v: v is None or v == 1,
            "the chosen weights divided by their sum (1) or kept as they are (None)")
    _refuse(hf, "tie_word_embeddings", lambda v: not v, "DBRX's head is its own, as transformers builds it")
    d, heads = hf["d_model"], hf["n_heads"]
    if d % heads:
        raise ValueError(f"config.json: d_model = {d} is not supported (n_heads = {heads} heads of d_model / n_heads channels)")
    top_level_rope = any(field in hf for field in ("rope_parameters", "rope_theta", "rope_scaling"))
    rope = _rope(hf if top_level_rope else dict(hf, rope_theta=attn.get("rope_theta", 10000.0)))
    return dict(vocab_size=hf["vocab_size"], hidden=d, n_layers=hf["n_layers"], n_heads=heads, n_kv_heads=attn["kv_n_heads"], head_dim=d // heads,
                norm_eps=1e-5, layer_norms=True, clip_qkv=attn["clip_qkv"], **rope, tie_embeddings=False, n_experts=ffn["moe_num_experts"],
                k=ffn["moe_top_k"], score="softmax", pre_softmax=norm is None, expert_bias=False, mtp_depth=0,
                ffn_expert=ffn["ffn_hidden_size"], ffn_dense=ffn["ffn_hidden_size"], n_dense=0, n_shared=0)


def _phimoe(hf: dict) -> dict:
    """Phi-3.5-MoE (phimoe): Mixtral's blocks and layout with LayerNorms with biases
    (eps rms_norm_eps) before the attention and the experts and at the end, biases on q, k, v
    and o (attention_bias) and on the head (lm_head_bias), LongRoPE with its own cos/sin
    scales short_mscale and long_mscale (_longrope), a sliding window where sliding_window is
    set, and SparseMixer's top-2 routing with the gap router_jitter_noise (fmoe.ops.sparsemixer_route;
    num_experts_per_tok 2, as transformers' router takes two whatever it says).

    Departures: a document longer than original_max_position_embeddings gets the long
    factors, as Phi-3.5-MoE's own code and every Phi-3 model do; transformers 5.24's phimoe
    keeps the short ones there (its scale switches alone). Training routes by the same
    deterministic choice: the sampled one of Phi-3.5-MoE's training (Gumbel noise, Heun's
    third-order gradient) and input_jitter_noise are not built (a loaded model's function
    is the same); the router's logits are float32 (transformers': the hidden states' dtype)."""
    _refuse(hf, "num_experts_per_tok", lambda v: v == 2, "2: SparseMixer chooses two experts")
    _refuse(hf, "router_jitter_noise", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
            "a finite number >= 0: SparseMixer's gap")
    plain, longrope = _longrope(hf, mscales=True)
    bias = bool(hf.get("attention_bias", False))
    return dict(_common(plain, hf["num_local_experts"], sliding=True), **longrope, ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"],
                n_dense=0, n_shared=0, score="sparsemixer", sparsemixer_eps=float(hf["router_jitter_noise"]), layer_norms=True, norm_bias=True,
                qkv_bias=bias, o_bias=bias, head_bias=bool(hf.get("lm_head_bias", False)))


def _olmoe(hf: dict) -> dict:
    _refuse(hf, "clip_qkv", lambda v: v is None, "OLMoE clamps q and k after their norms; fmoe's clip_qkv clamps before them")
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in OLMoE's attention here")
    return dict(_common(hf, hf["num_experts"]), ffn_expert=hf["intermediate_size"], ffn_dense=hf["intermediate_size"], n_dense=0,
                n_shared=0, pre_softmax=not hf.get("norm_topk_prob", False), qk_norm="proj")


def _aria_text(hf: dict) -> dict:
    """Aria's text model (aria_text, AriaTextForCausalLM; the released aria folders' language
    model): Llama's attention without biases, every block MoE: the top moe_topk of the router's
    logits and their softmax (fmoe's softmax routing), experts of intermediate_size stored as
    [E, H, 2F] fc1 (the gate's F columns, then the up's) and [E, F, H] fc2 stacks, beside
    moe_num_shared_experts shared experts (one SwiGLU of that many times intermediate_size)."""
    _refuse(hf, "attention_bias", lambda v: not v, "no attention biases in Aria's attention here")
    _refuse(hf, "mlp_bias", lambda v: not v, "no biases in Aria's shared experts here")
    F = hf["intermediate_size"]
    return dict(_common(dict(hf, num_experts_per_tok=hf["moe_topk"]), hf["moe_num_experts"]), ffn_expert=F, ffn_dense=F, n_dense=0,
                n_shared=hf.get("moe_num_shared_experts", 2))


def _aria(hf: dict) -> dict:
    """A released Aria folder (aria, AriaForConditionalGeneration): its text_config's model
    (_aria_text), every key under language_model. (the head's too); the vision tower and its
    projector are not read."""
    return _text_family(hf, "aria_text")


def _flex_olmo(hf: dict) -> dict:
    """FlexOlmo (flex_olmo): OLMoE's attention (q/k norms over the whole projections) and
    routing in OLMo 2's post-norm blocks: no input norms, an RMSNorm on the attention output
    (post_attention_layernorm) and on the MLP output (post_feedforward_layernorm), each before
    its residual add."""
    return dict(_olmoe(hf), pre_norms=False, post_norms=True)


# ------------------------------------------------------------------------------ key maps
@dataclasses.dataclass(frozen=True)
class Tensor:
    """One fmoe parameter and where it lives in the HF checkpoint: `keys` (one, or one per
    expert to stack along dim 0), each transposed when `transpose` (HF's [out, in] linear
    weights); `unit`: a stored dim of size 1 that fmoe's parameter leaves out (dim 0 of a
    [1, H] row: the shared expert's gate; dim 1 of a depthwise conv1d's [C, 1, K] weight), or
    a tuple of them (Kimi Linear's A_log [1, 1, N, 1]: (0, 1, 3)), dropped before anything
    else; `part` (i, n): every n-th entry of the stored last dim from entry i (gpt-oss's gate_up_proj [E, H, 2F] interleaves gate and up: the
    gate is part (0, 2), the up part (1, 2)), the n parts sharing one key; `chunk` (i, sizes):
    the i-th of len(sizes) contiguous runs, of those relative sizes, that fill fmoe's last dim:
    the stored dim -2 of a transposed linear weight, the out dim (Granite's input_linear
    [E, 2F, H]: the gate is chunk (0, (1, 1)), the up chunk (1, (1, 1)); Sarvam's fused
    query_key_value [(N + 2 Nkv) D, H]: q, k and v are chunks 0, 1, 2 of (N D, Nkv D, Nkv D)), the
    stored last dim otherwise (Llama 4's gate_up_proj [E, H, 2F]); with `groups` n the dim
    holds n equal groups one after the other, each cut into those runs, and the chunk is the
    i-th run of every group, in group order (Qwen3-Next's in_proj_qkvz: per key head its
    q, k, v and z rows; its gated attention's q_proj: per head its query's D rows, then its
    gate's). `transpose` swaps the last two dims (a stack [E, out, in] too). `row`: the index of
    stored dim 0 to read, a dim fmoe's parameter leaves out (ERNIE-4.5-VL's [2, E] correction
    bias, one row per modality: the text row 0); such a parameter is read, never written.
    `experts` n: the stored dim 0 holds n equal runs of rows one after the other, one per
    expert, read as a stack [n, rows, ...] (DBRX's w1, v1, w2 [E F, H]: [E, F, H]); a rank
    reads its experts' whole runs. `cat`: the keys' rows one after the other (Molmo2's
    embedding, wte.embedding then wte.new_embedding); a rank reads the rows of its block from
    each; read, never written."""

    keys: tuple[str, ...]
    transpose: bool = False
    stacked: bool = False
    unit: Optional[Union[int, tuple[int, ...]]] = None
    part: Optional[tuple[int, int]] = None
    chunk: Optional[tuple[int, tuple[int, ...]]] = None
    groups: int = 1
    row: Optional[int] = None
    experts: Optional[int] = None
    cat: bool = False


def _units(spec: Tensor) -> tuple[int, ...]:
    """Tensor.unit as a sorted tuple of stored dims (none, one, or several: Kimi Linear's A_log [1, 1, N, 1]), and
    Tensor.row's dim 0: the stored dims fmoe's parameter leaves out."""
    units = () if spec.unit is None else (spec.unit,) if isinstance(spec.unit, int) else tuple(sorted(spec.unit))
    return units if spec.row is None else tuple(sorted({0, *units}))


def _with_units(spec: Tensor, t: torch.Tensor) -> torch.Tensor:
    """t (fmoe's layout) with Tensor.unit's dims of size 1 put back, as stored."""
    if spec.row is not None:
        raise ValueError(f"model: {spec.keys[0]} holds other rows than the one read (Tensor.row), so it is not written")
    for u in _units(spec):
        t = t.unsqueeze(u)
    return t


def _run(chunk: tuple[int, tuple[int, ...]], dim: int) -> tuple[int, int]:
    """(offset, length) of Tensor.chunk (i, sizes)'s run in a stored dim (or group) of `dim` entries."""
    i, sizes = chunk
    unit = dim // sum(sizes)
    return unit * sum(sizes[:i]), unit * sizes[i]


def _chunk_dim(spec: Tensor, ndim: int) -> int:
    """The dim of a stored tensor (its unit dim dropped, ndim dims) that spec.chunk cuts."""
    return ndim - (2 if spec.transpose else 1)


def _grouped_runs(spec: Tensor, t: torch.Tensor, d: int) -> torch.Tensor:
    """A view of t's dim d as [groups, one group], narrowed to the chunk's run in each group."""
    grouped = t.unflatten(d, (spec.groups, -1))
    offset, size = _run(spec.chunk, grouped.shape[d + 1])
    return grouped.narrow(d + 1, offset, size)


_PROJ = ("gate_proj", "up_proj", "down_proj")  # the experts' and the dense MLP's three projections, in most families


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: config.json -> TransformerConfig kwargs, the key map, and the
    names HF uses for its MoE block and its experts' three matrices (gate, up, down): each
    expert's module names, or with `fused` the keys of the stacks under the MoE block (the
    gate's and the up's the same key)."""

    config_to_fmoe: Callable[[dict], dict]
    moe: str
    experts: tuple[str, str, str]
    architecture: str
    shared: str = "shared_expert"  # the shared experts' module name
    # the routing correction bias, under the MoE block (after "../": under the block itself, Kolibri-1's moe.router.expert_bias)
    correction_bias: str = "gate.e_score_correction_bias"
    correction_bias_unit: Optional[int] = None  # its stored dim of size 1 that fmoe's [E] leaves out (ERNIE 4.5's [1, E]: 0)
    mtp: bool = False  # MTP modules as layers n_layers, n_layers + 1, ... (DeepSeek-V3's layout)
    # one MTP module under mtp. (Qwen3-Next's layout: pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0, norm), read
    # where the folder holds it (mtp.fc), else left unread
    mtp_module: bool = False
    # experts as stacks: [E, H, 2F] gate/up and [E, F, H] down, gate and up "interleaved" (gpt-oss,
    # with biases and a router module with a bias) or in "halves" (Llama 4); or [E, 2F, H] gate/up
    # (the gate's F rows, then the up's) and [E, H, F] down, linear weights: "halves_out" (Granite);
    # or one [E F, H] key per matrix, each expert's F rows in turn, the down's as [F, H] (DBRX's w1, v1, w2): "rows";
    # or one stack of linear weights per matrix, [E, F, H] gate and up and [E, H, F] down (Step 3.5's): "stacks_out";
    # None: one module per expert
    fused: Optional[str] = None
    shared_beside: bool = False  # Granite: the shared MLP beside the MoE block, input_linear [2Fs, H] (gate, then up) / output_linear
    router: str = "gate.weight"  # the router's weight, under the MoE block (its bias beside it, where it has one)
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")  # the q / k norm modules, under self_attn
    qk_norm_modules: bool = False  # with qk_norm "head_layer", each head's norm a module of its own, `{q/k norm}.norms.{h}` (StableLM's)
    not_read: tuple[str, ...] = ()  # prefixes of checkpoint keys never read (EXAONE's MTP layers, "mtp."), as in transformers
    # (old, new): the start of a key the model reads, and what the family's folders have there instead (Llama 4's ("",
    # "language_model.") before every key; Qwen3.5's ("model.", "model.language_model."), the head left at lm_head), beside a
    # vision model
    prefix: tuple[str, str] = ("", "")
    # every key, the head's too, under this prefix as well, after `prefix` (a multimodal folder holding the text model's own
    # keys under language_model.: Aya Vision's, Granite Speech's, Nemotron-H Omni's)
    outer: str = ""
    # folders holding more than fmoe reads are not written back: export as this family ("text_config": the text model's own)
    written_as: Optional[str] = None
    dense: str = "mlp"  # the dense blocks' MLP module
    # the dense blocks' MLP module in some folders instead (Kimi Linear's, written by transformers: block_sparse_moe, the MoE
    # blocks' name; the released ones: mlp): loading reads the name the files hold (_stacked_experts), export writes it back
    dense_too: Optional[str] = None
    # the dense MLP's gate and up as the rows of one gate_up_proj [2F, H] (the gate's F rows, then the up's: Phi-3, GLM-4)
    dense_gate_up: bool = False
    gate_up: tuple[str, str] = ("gate_up_proj", "down_proj")  # with dense_gate_up, that module's and the down projection's names
    up_first: bool = False  # with dense_gate_up, the up's rows first, then the gate's (Molmo2's ff_proj)
    shared_gate_up: bool = False  # the shared experts' gate and up as the rows of one gate_up_proj [2F, H] (MiniMax-M3's, as transformers writes them)
    # block-sparse attention's indexer under the attention module: its q_proj, k_proj, q_norm, k_norm after this (MiniMax-M3's
    # indexer. as transformers writes them; its released folders' index_)
    block_index: str = "indexer."

    # the dense MLP's and the shared experts' gate, up and down projections (LFM2's w1, w3, w2; HY-V4's gate linear_gate)
    dense_names: tuple[str, str, str] = _PROJ
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")  # a pre-norm block's norms (LFM2's operator_norm, ffn_norm)
    parallel_norm_names: Optional[tuple[str, str]] = None  # a parallel block's norms where each branch has its own (Falcon's ln_attn, ln_mlp)
    # a post-norm block's norms, on the attention's and the MLP's outputs (OLMo 2's; OLMo Hybrid's files: feedforward_layer_norm first)
    post_norms: tuple[str, str] = ("post_attention_layernorm", "post_feedforward_layernorm")
    final_norm: str = "model.norm.weight"  # the final norm's key (LFM2's model.embedding_norm)
    # the norms of a sandwich block (pre_norms and post_norms): before and after the attention, before and after the MLP
    sandwich: Optional[tuple[str, str, str, str]] = None
    # transformers' defaults of the fields config_to_fmoe reads where they differ from its own fallbacks: a
    # config.json that leaves one out means the model transformers builds from it
    defaults: dict = dataclasses.field(default_factory=dict)
    # {a field the shared mappings read: the family's own name for it} (Sarvam's released num_experts; EXAONE's,
    # AFMoE's and HY-V3's num_shared_experts; AFMoE's route_scale, ...), read as that field unless it is there too
    aliases: dict = dataclasses.field(default_factory=dict)
    embed: str = "model.embed_tokens.weight"  # the embedding's key
    head: str = "lm_head.weight"  # the output head's key (GPT-NeoX's embed_out.weight); its bias beside it
    pos_embed: Optional[str] = None  # learned absolute positions' key (GPT-Neo's transformer.wpe.weight; TransformerConfig.abs_positions)
    embed_norm: Optional[str] = None  # the embeddings' norm's weight key (BLOOM's word_embeddings_layernorm; TransformerConfig.embed_norm)
    embed_too: Optional[str] = None  # the embedding's rows past embed's, under this key (Molmo2's wte.new_embedding: Tensor.cat)
    # the fused q/k/v module's, the attention's output and the dense MLP's weights stored [in, out] (GPT-2's Conv1D), not as
    # linear weights [out, in]
    conv1d: bool = False
    attention: str = "self_attn"  # the attention module, in each block
    qkv: Optional[str] = None  # q, k and v as one module's rows (Sarvam's query_key_value), not q_proj / k_proj / v_proj
    qkv_names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")  # ...or their own modules' names (Cosmos3's to_q, to_k, to_v)
    # that module's rows kv head by kv head, each one's q heads, k and v in turn (GPT-NeoX's; GPT-BigCode's, whose one kv head under
    # multi-query attention makes it all q's first), not all q's first
    qkv_per_head: bool = False
    qkv_groups: Optional[int] = None  # ...or in this many equal groups, each its heads' q, k and v in turn (CodeGen's 4)
    qkv_order: str = "qkv"  # the order of q, k and v in the module's rows (in each group): CodeGen's "qvk"
    o_proj: str = "o_proj"  # the attention's output projection, under the attention module
    o_a_proj: str = "o_a_proj"  # the grouped output projection's first (cfg.o_groups; DeepSeek-V4's [g r, N Dv / g]), o_proj the second
    q_latent: tuple[str, str, str] = ("q_a_proj", "q_a_norm", "q_b_proj")  # a q latent on grouped-query attention (cfg.q_rank): DeepSeek-V4's
    hash_table: str = "gate.tid2eid"  # a hashed MoE block's table of token ids' experts (cfg.hash_layers), under the MoE block
    # heavily compressed attention's compressor (cfg.compress_layers) under the attention module: its kv and gate projections,
    # its bias by place in the run, its norm (DeepSeek-V4's compressor.wkv, wgate, ape, norm)
    compressor: tuple[str, str, str, str] = ("compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape", "compressor.norm.weight")
    # compressed sparse attention's indexer (cfg.csa_layers) under the attention module: its wq_b, weights_proj and compressor
    csa_indexer: str = "indexer."
    sinks: str = "sinks"  # the attention sinks' key, under the attention module
    extra_layers_read: bool = True  # False: the layers after the trunk's (HY-V3's MTP layer) are not read, as in transformers
    # the linear-attention (Gated DeltaNet) blocks' projections: "qkvz", Qwen3-Next's fused in_proj_qkvz and in_proj_ba
    # (their rows grouped by key head); "qkv", Qwen3.5's in_proj_qkv beside in_proj_z, in_proj_b, in_proj_a; "fused", Lara
    # Mini's one in_proj (the rows of q, k, v, z, b and a in turn) and out_norm; "kda", Kimi
    # Linear's Kimi Delta Attention under the attention module (q/k/v/b_proj, q/k/v_conv1d, f_a/f_b_proj, g_a/g_b_proj, o_norm);
    # "lightning", MiniMax's lightning attention under the attention module (qkv_proj, output_gate, norm, out_proj); "split",
    # OLMo Hybrid's modules of their own (q_proj, k_proj, v_proj, g_proj, b_proj, a_proj, o_proj, o_norm, q/k/v_conv1d)
    linear: str = "qkv"
    gate_in_q: bool = False  # gated attention's gate as rows of q_proj, per head after its query's (Qwen3-Next), not a gate_proj
    gate_proj: str = "gate_proj"  # gated attention's own gate module, under the attention module (AFMoE's; Laguna's g_proj)
    # the routed experts one module per expert (what transformers writes) or as [E, 2F, H] gate_up_proj / [E, H, F] down_proj
    # stacks (Qwen3.5's released folders, "halves_out"): loading reads the layout the files hold (_stacked_experts), export
    # writes the layout a folder was loaded from
    stacks_too: bool = False
    # the experts' stacks as the released folders store them ([E, H, 2F] gate_up_proj, [E, F, H] down_proj: "halves") or as
    # transformers writes them ([E, 2F, H], [E, H, F]: "halves_out"), told apart by their shapes (Qwen3-VL-MoE: _stacks_by_shape)
    stacks_by_shape: bool = False
    moe_out_norm: str = "post_mlp_layernorm"  # the norm on a MoE block's output (moe_out_norm: A.X-K1's), under the block
    # Gemma 4's MoE blocks (dense_beside_moe: the norms of the dense MLP's output, the MoE's input and output, under the
    # layer; the router's scale (router_norm) and its scale per expert (router_expert_scale), under the MoE block (Family.moe
    # "": the layer itself)
    beside_norms: tuple[str, str, str] = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
    router_norm: str = "router.scale"
    expert_scale: str = "router.per_expert_scale"
    # patterns (re.search) of keys the family's folders hold and transformers never reads (A.X-K1's dense blocks' post_mlp_layernorm)
    ignored: tuple[str, ...] = ()
    # folders without the routing correction bias route without one (A.X-K1's released ones): the expert bias reads as zero
    correction_bias_optional: bool = False
    # the correction bias as row i of a stored [modalities, E] (ERNIE-4.5-VL's [2, E]: the text row 0)
    correction_bias_row: Optional[int] = None
    router_transposed: bool = False  # the router's weight stored [H, E] (ERNIE-4.5-VL's), not as a linear weight [E, H]
    # LongCat-Flash: layer j holds fmoe's shortcut pair (2j, 2j + 1), block 2j + s its sublayer s: the attention, the two
    # pre-norms and the dense MLP as `<name>.{s}` under the layer, the pair's MoE (the first block's) under the layer itself
    pairs: bool = False
    # LongCat-Flash's transformers model stacks a gate and up projection per choice (n_experts + zero_experts), the zero
    # experts' unused: its folders hold them as experts n_experts, ... (loading skips them, export writes zeros there)
    zero_expert_rows: bool = False
    # hyper-connections' weights (TransformerConfig.hyper_connections): the prefixes of a block's attention's and MLP's fn,
    # base and scale, under the layer, and of the head's, HY-V4's released names (transformers renames them on load)
    hyper: tuple[str, str, str] = ("hc_pre.hc_attn_layer.hc_", "hc_pre.hc_mlp_layer.hc_", "model.hc_pre.hc_head.hc_head_")
    # the head's hyper-connection weights under this prefix instead in some folders (HY-V4-VL's under HY-V4's prefix,
    # model.hc_pre.hc_head.hc_head_): loading reads the prefix the files hold (_stacked_experts), export writes it back
    hyper_head_too: Optional[str] = None
    # (a pattern, Family fields): another layout some of the family's folders hold, used where a key matches the pattern
    # (re.search; _stacked_experts): Qianfan-OCR's text layers as transformers writes them (language_model.model.encoder.layers.)
    # beside the released ones, Cosmos3-Omni's older attention names (q_proj, ...) beside the Diffusers-style ones transformers
    # writes; their folders are written back only as their text model's family
    layout_too: Optional[tuple[str, dict]] = None
    # Nemotron-H: each layer one sublayer (a mixer, an MLP or a MoE, under `mixer`, after its own `norm`); fmoe's block i is a
    # mixer's layer and, unless cfg.mlp_free_layers lists it, the MLP's (or MoE's) layer after it (_layer_prefixes)
    single_sublayer: bool = False
    # a latent MoE's (cfg.moe_latent) projections into and out of the routed experts' channels, under the MoE block (Nemotron 3 Super's)
    latent: tuple[str, str] = ("fc1_latent_proj", "fc2_latent_proj")
    # Muse Spark's MoE norms (cfg.moe_latent_norm, expert_out_norm), under the MoE block, and residual gates, under the layer
    latent_norm: str = "pre_expert_norm"
    expert_out_norm: str = "experts.post_expert_norm"
    residual_gates: tuple[str, str] = ("post_attention_residual_gate", "post_feedforward_residual_gate")
    mamba: str = "mamba"  # the Mamba-2 mixer's module, in each layer (Granite 4.0-H's, Bamba's; Nemotron-H's mixer)
    # multipliers folded into the weights: config.json -> {a parameter's name under its block: the factor} (Falcon-H1's muP
    # multipliers, _falcon_h1_folds): a weight is read times it and written divided by it
    folds: Optional[Callable[[dict], dict[str, float]]] = None

    def renamed(self, key: str) -> str:
        """key (as the family's own models name it) in the family's folders (prefix, then outer)."""
        old, new = self.prefix
        return self.outer + (new + key[len(old):] if key.startswith(old) else key)

    def unread(self, mtp_read: bool) -> tuple[str, ...]:
        """not_read's prefixes, less the MTP module's ("mtp.") where it is read (mtp_read: a
        model of mtp_depth >= 1 of an mtp_module family)."""
        return tuple(p for p in self.not_read if not (self.mtp_module and mtp_read and p == "mtp."))

    def kwargs(self, hf: dict) -> dict:
        """config.json -> TransformerConfig kwargs: the fields it names by their aliases read as
        transformers' own, those it leaves out at transformers' defaults; ValueError naming a
        field it lacks that has none. A refusal of a field read through its alias names the
        alias, the name the file holds (GPT-2's activation_function, not hidden_act)."""
        hf = dict(hf)
        read_as = {}
        for field, alias in self.aliases.items():
            if field not in hf and alias in hf:
                hf[field], read_as[field] = hf[alias], alias
        defaults = self.defaults if "rope_scaling" not in hf else {k: v for k, v in self.defaults.items() if k != "rope_parameters"}
        try:
            return self.config_to_fmoe({**defaults, **hf})
        except KeyError as err:
            raise ValueError(f"config.json: a {hf.get('model_type')} config without {err.args[0]} is not supported") from None
        except ValueError as err:
            said = str(err)
            for field, alias in read_as.items():
                if said.startswith(f"config.json: {field} "):
                    raise ValueError(f"config.json: {alias} {said.removeprefix(f'config.json: {field} ')}") from None
            raise


_STACKS = ("experts.gate_up_proj", "experts.gate_up_proj", "experts.down_proj")  # fused experts' keys under the MoE block
# GPT-2's names (transformer.h.{i}, attn, transformer.wte / ln_f) and config field names, which GPT-BigCode, GPT-J and CodeGen
# keep: GPT-2's and GPT-BigCode's blocks (c_attn, c_proj, two LayerNorms, the learned positions wpe), GPT-J's and CodeGen's
# (out_proj, fc_in / fc_out, one LayerNorm per block)
_GPT2_ALIASES = dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head", intermediate_size="n_inner",
                     rms_norm_eps="layer_norm_epsilon", hidden_act="activation_function")
_GPT2_NAMES = dict(prefix=("model.layers.", "transformer.h."), attention="attn", embed="transformer.wte.weight", final_norm="transformer.ln_f.weight")
_GPT2_LAYOUT = dict(_GPT2_NAMES, qkv="c_attn", o_proj="c_proj", norms=("ln_1", "ln_2"), dense_names=("", "c_fc", "c_proj"),
                    pos_embed="transformer.wpe.weight", aliases=dict(_GPT2_ALIASES, max_position_embeddings="n_positions"))
_GPT2_DEFAULTS = dict(vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, rms_norm_eps=1e-5, max_position_embeddings=1024,
                      tie_word_embeddings=True)
_GPTJ_LAYOUT = dict(_GPT2_NAMES, o_proj="out_proj", norms=("ln_1", ""), dense_names=("", "fc_in", "fc_out"), aliases=_GPT2_ALIASES,
                    defaults=dict(vocab_size=50400, hidden_size=4096, num_hidden_layers=28, num_attention_heads=16, rotary_dim=64, rms_norm_eps=1e-5,
                                  hidden_act="gelu_new"))
_ARIA_EXPERTS = ("experts.fc1.weight", "experts.fc1.weight", "experts.fc2.weight")  # Aria's stacks ("halves"), under the MoE block
_STEP3P5_EXPERTS = ("moe.gate_proj.weight", "moe.up_proj.weight", "moe.down_proj.weight")  # Step 3.5's stacks ("stacks_out"), under the layer
_GRANITE = ("input_linear.weight", "input_linear.weight", "output_linear.weight")
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096,
                     rope_theta=150000.0)
_LFM2_MLP = ("w1", "w3", "w2")
# LFM2's names (Family's fields): the attention's output projection and q/k norms, the short convolutions, the dense MLP, the
# pre-norms, the final norm; its own names of the norms' eps, the tied head and the FFN; transformers' defaults
_LFM2 = dict(o_proj="out_proj", qk_norms=("q_layernorm", "k_layernorm"), linear="short_conv", dense="feed_forward", dense_names=_LFM2_MLP,
             norms=("operator_norm", "ffn_norm"), final_norm="model.embedding_norm.weight",
             aliases=dict(rms_norm_eps="norm_eps", tie_word_embeddings="tie_embedding", intermediate_size="block_ff_dim"),
             defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e6)))
_MIMO_ROPE = dict(full_attention=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.334),
                  sliding_attention=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.334))
_OLMO3_ROPE = dict(full_attention=dict(rope_type="default", rope_theta=500000.0), sliding_attention=dict(rope_type="default", rope_theta=500000.0))
_GEMMA3_ROPE = dict(full_attention=dict(rope_type="default", rope_theta=1e6), sliding_attention=dict(rope_type="default", rope_theta=1e4))
# Gemma's sandwich norms (Gemma 2, 3 and 4; Beam's too): before and after the attention, before and after the MLP
_GEMMA_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# transformers' defaults of MiniMax-M3's text config where they differ from _minimax_m3's fallbacks
_M3_DEFAULTS = dict(num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=5e6),
                    routed_scaling_factor=2.0, shared_intermediate_size=3072)
_GEMMA4 = dict(fused="halves_out", router="router.proj.weight", sandwich=_GEMMA_SANDWICH)  # Gemma 4's layout (Family's fields)
_GEMMA4_ROPE = dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6),
                    sliding_attention=dict(rope_type="default", rope_theta=1e4))
_LFM3_ROPE = dict(full_attention=dict(rope_type="proportional", partial_rotary_factor=0.5, rope_theta=1e6),
                  sliding_attention=dict(rope_type="default", rope_theta=1e4))
_MELLUM_ROPE = dict(full_attention=dict(rope_type="default", rope_theta=500000.0), sliding_attention=dict(rope_type="default", rope_theta=10000.0))
_QWEN3_NEXT_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
_QWEN3_NEXT_LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4)
_QWEN3_NEXT_MOE = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512)
_QWEN3_5_DEFAULTS = dict(num_key_value_heads=2, head_dim=256, rope_parameters=_QWEN3_NEXT_ROPE, **_QWEN3_NEXT_LINEAR, num_experts=256,
                         num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)
_QWEN3_5_DENSE_DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4,
                               head_dim=256, rope_parameters=_QWEN3_NEXT_ROPE, **_QWEN3_NEXT_LINEAR)
_DSA_DEFAULTS = dict(index_topk=2048, index_head_dim=128)
_DEEPSEEK_V3_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=1536, n_group=8, topk_group=4, first_k_dense_replace=3)
# Kimi Linear's config.json names (transformers' attribute_map, the releases') for the fields the shared mappings read
_KIMI_LINEAR_ALIASES = dict(num_experts_per_tok="num_experts_per_token", n_group="num_expert_group", norm_topk_prob="moe_renormalize",
                            n_shared_experts="num_shared_experts", num_experts="num_local_experts")
_KIMI_LINEAR_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                             v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                             rms_norm_eps=1e-5, num_experts=256, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
                             intermediate_size=9216, moe_intermediate_size=1024)
# Ling's config.json names (transformers' attribute_map) for the fields the shared mappings read
_BAILING_ALIASES = dict(num_experts_per_tok="num_experts_per_token", n_group="num_expert_group", norm_topk_prob="moe_renormalize",
                        n_shared_experts="num_shared_experts")
# the names of Sarvam's released config.json files (written for their own code) for transformers' fields
_SARVAM_ALIASES = dict(n_routed_experts="num_experts", n_shared_experts="num_shared_experts")
_MISTRAL4_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=128.0, original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
_MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=16384, beta_fast=32.0, beta_slow=1.0,
                        mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
# transformers' MuseGlimmerTextConfig's defaults of the fields _muse_glimmer_text reads
_MUSE_GLIMMER_DEFAULTS = dict(vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52, num_attention_heads=32,
                              num_key_value_heads=2, head_dim=128, hidden_activation="silu", rms_norm_eps=1e-5, sliding_window=2048,
                              final_logit_softcapping=20.0, qk_scale_factor=3.87, output_multiplier=0.19611613513818404, post_norm_eps=1e-8,
                              tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
# ...and MuseSparkTextConfig's
_MUSE_SPARK_DEFAULTS = dict(_MUSE_GLIMMER_DEFAULTS, hidden_size=8192, intermediate_size=16384, num_hidden_layers=62, num_attention_heads=128,
                            num_key_value_heads=16, head_dim=64, hidden_act="silu", qk_scale_factor=5.4730064863875, output_multiplier=0.1767766952966369,
                            moe_intermediate_size=4096, num_local_experts=256, num_experts_per_tok=8, routed_scaling_factor=1.0,
                            moe_hidden_size=4096, residual_gate_temperature=0.3, rope_parameters=dict(rope_type="default", rope_theta=500000.0))
# HY-V4's layout (Family's fields): the experts as [E, 2F, H] / [E, H, F] stacks; the dense MLPs' and shared experts' gate
# linear_gate, the attention's gate linear_gate and sinks learnable_sink_param (the released names, which transformers writes
# back); and transformers' HYV4Config's defaults
_HY_V4 = dict(shared="shared_experts", fused="halves_out", dense_names=("linear_gate", "up_proj", "down_proj"), gate_proj="linear_gate",
              sinks="learnable_sink_param", not_read=("model.mtp_layers.",), aliases=dict(n_routed_experts="num_local_experts"))
# HY-V4-VL's: the head's hyper-connection weights under model.hc_head.hc_pre. as transformers writes them (and reads them
# beside the vision tower), or under HY-V4's model.hc_pre.hc_head. (Family.hyper_head_too)
_HY_V4_VL = dict(_HY_V4, hyper=("hc_pre.hc_attn_layer.hc_", "hc_pre.hc_mlp_layer.hc_", "model.hc_head.hc_pre.hc_head_"),
                 hyper_head_too="model.hc_pre.hc_head.hc_head_")
# DeepSeek-V4's names as transformers writes them (DeepSeek's own inside each layer: attn, ffn, each expert's w1 / w3 / w2, the
# correction bias gate.bias; model.embed_tokens, head) (Family's fields), and transformers' defaults of the fields _deepseek_v4 reads
_DEEPSEEK_V4 = dict(shared="shared_experts", dense_names=("w1", "w3", "w2"), attention="attn", qkv_names=("wq", "wkv", "wv"), o_proj="wo_b",
                    o_a_proj="wo_a", q_latent=("wq_a", "q_norm", "wq_b"), qk_norms=("q_norm", "norm"), sinks="attn_sink",
                    norms=("attn_norm", "ffn_norm"), correction_bias="gate.bias", head="head.weight",
                    hyper=("hc_attn_", "hc_ffn_", "model.hc_head.hc_"), not_read=("mtp.",))
_DEEPSEEK_V4_DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
                             head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
                             scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, rope_theta=10000.0, hc_mult=4, hc_sinkhorn_iters=20,
                             hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, rms_norm_eps=1e-6)
_HY_V4_DEFAULTS = dict(vocab_size=120832, hidden_size=2816, intermediate_size=6912, moe_intermediate_size=768, num_hidden_layers=34,
                       num_attention_heads=32, rms_norm_eps=1e-5, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                       routed_scaling_factor=2.827, norm_topk_prob=True, n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512,
                       qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=16,
                       hc_mult=4, hc_magnitude=2.0, hc_eps=1e-6, swiglu_limit=10.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
# Apertus's layout (its pre-norms' names; xIELU's constants: checked on load, written on export, constant_tensors) and
# transformers' ApertusConfig's defaults
_APERTUS = dict(norms=("attention_layernorm", "feedforward_layernorm"), ignored=(r"\.mlp\.act_fn\.(beta|eps)$",))
_APERTUS_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0, original_max_position_embeddings=8192,
                                              low_freq_factor=1.0, high_freq_factor=4.0))
# GLM-4.1V's layout (GLM-4.6V's, glmga's, GLM-OCR's): GLM-4's sandwich blocks under model.language_model. beside model.visual.
_GLM4V_LAYOUT = dict(dense_gate_up=True, prefix=("model.", "model.language_model."), not_read=("model.visual.",), written_as="glm4",
                     sandwich=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"))
# Cosmos3's text model as its folders store it: at the top level (layers., embed_tokens, norm, lm_head), the attention under the
# Diffusers-style names transformers writes (to_q, to_k, to_v, to_out, norm_q, norm_k) or, in older folders, the usual ones
# (Family.layout_too; an Edge folder's attention has no q/k norms, so their names change nothing there)
_COSMOS3_NAMES = dict(prefix=("model.", ""), qkv_names=("to_q", "to_k", "to_v"), o_proj="to_out", qk_norms=("norm_q", "norm_k"),
                      layout_too=(r"\.self_attn\.q_proj\.weight$", dict(qkv_names=("q_proj", "k_proj", "v_proj"), o_proj="o_proj",
                                                                        qk_norms=("q_norm", "k_norm"))))
# the dense families (no MoE block): fine-tuned as they are, or upcycled into an MoE (fmoe.train.upcycle)
DENSE_FAMILIES = ("llama", "exaone", "cwm", "olmo", "phi", "starcoder2", "gpt_neox", "gptj", "codegen", "gpt_neo", "gpt_bigcode", "gpt2", "opt", "mistral", "ministral3", "qwen2", "qwen3", "olmo2", "olmo3", "granite", "granite_swa", "hyperclovax", "youtu", "helium", "minicpm3", "arcee", "gemma", "vaultgemma", "gemma2", "gemma3_text", "lfm3", "smollm3", "exaone4", "seed_oss", "hunyuan_v1_dense",
                  "phi3", "glm4", "ernie4_5", "lfm2", "cohere", "cohere2", "bamba", "falcon_h1", "stablelm", "qwen3_5_text", "nemotron", "apertus", "olmo_hybrid",
                  "jais2", "glm", "internlm3", "iquestcoder", "ministral", "nanochat", "cohere_compass_text", "muse_glimmer_text", "falcon", "bloom", "mpt",
                  "biogpt", "persimmon",
                  "apertus1p5_text")
FAMILIES = {
    "mixtral": Family(_mixtral, "block_sparse_moe", ("w1", "w3", "w2"), "MixtralForCausalLM",
                      defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6)),
    "minimax": Family(_minimax, "block_sparse_moe", ("w1", "w3", "w2"), "MiniMaxForCausalLM", linear="lightning",
                      ignored=(r"\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$",),  # lightning's decay: constants
                      defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6)),
    "phimoe": Family(_phimoe, "block_sparse_moe", ("w1", "w3", "w2"), "PhimoeForCausalLM",
                     defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072, router_jitter_noise=0.01)),
    "qwen2_moe": Family(_qwen2_moe, "mlp", _PROJ, "Qwen2MoeForCausalLM", defaults=dict(num_key_value_heads=16, shared_expert_intermediate_size=5632)),
    "qwen3_moe": Family(_qwen3_moe, "mlp", _PROJ, "Qwen3MoeForCausalLM"),
    # Aria (rhymes-ai): the experts as [E, H, 2F] fc1 / [E, F, H] fc2 stacks, the router mlp.router; the released folders
    # (aria) hold that text model whole under language_model., beside a vision tower and projector that are not read
    "aria_text": Family(_aria_text, "mlp", _ARIA_EXPERTS, "AriaTextForCausalLM", "shared_experts", fused="halves", router="router.weight",
                        defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=4096, num_attention_heads=32, moe_num_experts=8,
                                      moe_topk=2)),
    "aria": Family(_aria, "mlp", _ARIA_EXPERTS, "AriaForConditionalGeneration", "shared_experts", fused="halves", router="router.weight",
                   outer="language_model.", not_read=("vision_tower.", "multi_modal_projector."), written_as="aria_text"),
    "olmoe": Family(_olmoe, "mlp", _PROJ, "OlmoeForCausalLM", defaults=dict(rms_norm_eps=1e-5)),
    "flex_olmo": Family(_flex_olmo, "mlp", _PROJ, "FlexOlmoForCausalLM", defaults=dict(rope_theta=5e5)),
    "glm4_moe": Family(_glm4_moe, "mlp", _PROJ, "Glm4MoeForCausalLM", "shared_experts", mtp=True,
                       defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5)),
    "deepseek_v3": Family(_deepseek_v3, "mlp", _PROJ, "DeepseekV3ForCausalLM", "shared_experts", mtp=True, defaults=_DEEPSEEK_V3_DEFAULTS),
    # A.X-K1: DeepSeek-V3's model with a norm on each MoE block's output (its dense blocks' stored ones unread, as in transformers)
    "axk1": Family(_axk1, "mlp", _PROJ, "AXK1ForCausalLM", "shared_experts", mtp=True, ignored=(r"\.post_mlp_layernorm\.",),
                   correction_bias_optional=True, defaults=dict(_DEEPSEEK_V3_DEFAULTS, first_k_dense_replace=1, rms_norm_eps=1e-6)),
    # Kimi K2 / K2-Instruct / K2-Thinking: DeepSeek-V3's model and names under their own model_type (the releases' remote code)
    "kimi_k2": Family(_deepseek_v3, "mlp", _PROJ, "DeepseekV3ForCausalLM", "shared_experts", mtp=True, defaults=_DEEPSEEK_V3_DEFAULTS),
    # the released Kimi K2.5 / K2.6 folders: Kimi K2's text model under language_model., beside a vision tower
    "kimi_k25": Family(_kimi_k25, "mlp", _PROJ, "KimiK25ForConditionalGeneration", "shared_experts", prefix=("", "language_model."),
                       not_read=("vision_tower.", "mm_projector."), written_as="deepseek_v3", defaults=dict(tie_word_embeddings=True)),
    # LongCat-Flash: two sublayers per layer (Family.pairs), the router's weight and correction bias under router., the
    # zero experts' unused gate and up rows (Family.zero_expert_rows), the MTP layer under model.mtp. (never read, as in transformers)
    "longcat_flash": Family(_longcat_flash, "mlp", _PROJ, "LongcatFlashForCausalLM", dense="mlps", router="router.classifier.weight",
                            correction_bias="router.e_score_correction_bias", pairs=True, zero_expert_rows=True, not_read=("model.mtp.",),
                            aliases=dict(num_experts_per_tok="moe_topk"),
                            defaults=dict(vocab_size=131072, hidden_size=6144, num_layers=28, num_attention_heads=64, rms_norm_eps=1e-5,
                                          rope_parameters=dict(rope_type="default", rope_theta=1e7), ffn_hidden_size=12288, q_lora_rank=1536,
                                          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_topk=12,
                                          n_routed_experts=512, zero_expert_num=256, expert_ffn_hidden_size=2048, routed_scaling_factor=6.0)),
    "deepseek_v2": Family(_deepseek_v2, "mlp", _PROJ, "DeepseekV2ForCausalLM", "shared_experts", defaults=dict(q_lora_rank=1536, n_shared_experts=2)),
    # DeepSeek-V3.2 and GLM-5: DeepSeek-V3's model with DeepSeek sparse attention (the indexer under self_attn.indexer)
    "axk2": Family(_axk2, "mlp", _PROJ, "AXK2ForCausalLM", "shared_experts", extra_layers_read=False,
                   defaults={**_DEEPSEEK_V3_DEFAULTS, **_DSA_DEFAULTS, **dict(index_n_heads=16, q_lora_rank=384, kv_lora_rank=128, n_group=None,
                                                                                topk_group=None, rms_norm_eps=1e-6, first_k_dense_replace=1)}),
    "deepseek_v32": Family(_deepseek_v32, "mlp", _PROJ, "DeepseekV32ForCausalLM", "shared_experts", mtp=True,
                           defaults=dict(_DEEPSEEK_V3_DEFAULTS, **_DSA_DEFAULTS, index_n_heads=64)),
    "glm_moe_dsa": Family(_glm_moe_dsa, "mlp", _PROJ, "GlmMoeDsaForCausalLM", "shared_experts", mtp=True,
                          defaults=dict(_DEEPSEEK_V3_DEFAULTS, **_DSA_DEFAULTS, index_n_heads=32, n_group=1, topk_group=1, q_lora_rank=2048,
                                        rms_norm_eps=1e-5)),
    # HY-V4: hyper-connections around DeepSeek sparse attention with a gate and sinks (_HY_V4's names)
    "hy_v4": Family(_hy_v4, "mlp", _STACKS, "HYV4ForCausalLM", **_HY_V4, defaults=_HY_V4_DEFAULTS),
    # DeepSeek-V4: manifold hyper-connections, its sliding attention (a q latent, one key head that is its values, RoPE on the
    # heads' last channels, the grouped output projection), hash and sqrt(softplus) MoE blocks (_deepseek_v4's names)
    "deepseek_v4": Family(_deepseek_v4, "ffn", ("w1", "w3", "w2"), "DeepseekV4ForCausalLM", **_DEEPSEEK_V4, defaults=_DEEPSEEK_V4_DEFAULTS),
    # HY-V4-VL's text model (transformers has no causal LM of it alone: its base model's class), and the released folders: that
    # text model as HY-V4's folders hold it, beside the vision tower
    "hy_v4_vl_text": Family(_hy_v4_vl_text, "mlp", _STACKS, "HYV4VLTextModel", **_HY_V4_VL,
                            defaults=dict(_HY_V4_DEFAULTS, hidden_size=6144, intermediate_size=18432, moe_intermediate_size=2048,
                                          num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048, index_n_heads=32)),
    "hy_v4_vl": Family(_hy_v4_vl, "mlp", _STACKS, "HYV4VLForConditionalGeneration", **dict(_HY_V4_VL, not_read=("model.mtp_layers.", "vit.")),
                       written_as="hy_v4_vl_text"),
    "glm4_moe_lite": Family(_glm4_moe_lite, "mlp", _PROJ, "Glm4MoeLiteForCausalLM", "shared_experts", mtp=True,
                            defaults=dict(n_shared_experts=1, routed_scaling_factor=1.8, q_lora_rank=768, rms_norm_eps=1e-5)),
    "gpt_oss": Family(_gpt_oss, "mlp", _STACKS, "GptOssForCausalLM", fused="interleaved", router="router.weight",
                      defaults=dict(head_dim=64, num_key_value_heads=8, rms_norm_eps=1e-5, sliding_window=128, rope_parameters=_GPT_OSS_ROPE)),
    "llama4_text": Family(_llama4_text, "feed_forward", _STACKS, "Llama4ForCausalLM", fused="halves", router="router.weight", dense="feed_forward",
                          defaults=dict(num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5)),
    # the released Llama 4 folders: the text model under language_model., beside a vision model that is not read
    "llama4": Family(_llama4, "feed_forward", _STACKS, "Llama4ForConditionalGeneration",
                     fused="halves", router="router.weight", dense="feed_forward", prefix=("", "language_model."),
                     not_read=("vision_model.", "multi_modal_projector."), written_as="llama4_text"),
    # Sarvam-30B: GLM-4.5's model under the released checkpoint's own names (fused q/k/v rows)
    "sarvam_moe": Family(_sarvam_moe, "mlp", _PROJ, "Glm4MoeForCausalLM", "shared_experts", correction_bias="gate.expert_bias",
                         qk_norms=("query_layernorm", "key_layernorm"), embed="model.word_embeddings.weight", attention="attention",
                         qkv="query_key_value", o_proj="dense", aliases=_SARVAM_ALIASES | dict(attention_bias="use_qkv_bias"),
                         defaults=dict(num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, n_shared_experts=1, first_k_dense_replace=1,
                                       routed_scaling_factor=2.5, use_qk_norm=True, partial_rotary_factor=1.0, rope_theta=8e6)),
    # Sarvam-105B: DeepSeek-V3's model and names
    "sarvam_mla": Family(_sarvam_mla, "mlp", _PROJ, "DeepseekV3ForCausalLM", "shared_experts", mtp=True, aliases=_SARVAM_ALIASES,
                         defaults=dict(n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1)),
    "flint": Family(_flint, "mlp", _PROJ, "FlintForCausalLM", sinks="softmax_offset",
                    defaults=dict(num_key_value_heads=4, head_dim=128, sliding_window=513, shared_expert_intermediate_size=1024)),
    "mellum": Family(_mellum, "mlp", _PROJ, "MellumForCausalLM", not_read=("mtp.",), aliases=dict(num_local_experts="num_experts"),
                     defaults=dict(head_dim=128, sliding_window=1024, rope_parameters=_MELLUM_ROPE)),
    "solar_open": Family(_solar_open, "mlp", _PROJ, "SolarOpenForCausalLM", "shared_experts",
                         defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5, n_shared_experts=1, head_dim=128, rope_theta=1e6)),
    "exaone_moe": Family(_exaone_moe, "mlp", _PROJ, "ExaoneMoeForCausalLM", "shared_experts", correction_bias="e_score_correction_bias",
                         not_read=("mtp.",), aliases=dict(n_shared_experts="num_shared_experts"),
                         defaults=dict(num_key_value_heads=32, rms_norm_eps=1e-5, sliding_window=4096, routed_scaling_factor=2.5, n_shared_experts=1)),
    "kolibri1": Family(_kolibri1, "mlp", _PROJ, "Kolibri1ForCausalLM", "shared_experts", correction_bias="../moe.router.expert_bias",
                       sandwich=("input_layernorm", "post_attn_norm", "post_attention_layernorm", "post_ffn_norm"),
                       defaults=dict(num_key_value_heads=4, head_dim=128, sliding_window=513, moe_intermediate_size=512, num_local_experts=384,
                                     num_experts_per_tok=6, shared_expert_intermediate_size=512)),
    "beam": Family(_beam, "mlp", _PROJ, "BeamForCausalLM", sandwich=_GEMMA_SANDWICH,
                   defaults=dict(num_key_value_heads=8, head_dim=128, sliding_window=512, intermediate_size=20480, moe_intermediate_size=2560,
                                 num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 final_logit_softcapping=30.0)),
    "dots1": Family(_dots1, "mlp", _PROJ, "Dots1ForCausalLM", "shared_experts", defaults=dict(num_key_value_heads=32)),
    "minimax_m2": Family(_minimax_m2, "block_sparse_moe", ("w1", "w3", "w2"), "MiniMaxM2ForCausalLM", correction_bias="e_score_correction_bias",
                         defaults=dict(num_key_value_heads=8, head_dim=128, rope_theta=5e6)),
    # MiniMax-M3's text model as transformers writes it (fused experts' stacks, the dense MLPs' and shared experts' gate_up_proj,
    # the indexer under indexer.), and its released folders: the text model under language_model. in MiniMax-M2's names (experts
    # one module each, the correction bias beside the router), the indexer's modules index_q_proj, ...; the vision tower and
    # its projectors, and any MTP modules, unread (as transformers leaves them)
    "minimax_m3_vl_text": Family(_minimax_m3, "mlp", _STACKS, "MiniMaxM3VLForCausalLM", "shared_experts", fused="halves_out", dense_gate_up=True,
                                 shared_gate_up=True, ignored=(r"(^|\.)mtp\.",), defaults=_M3_DEFAULTS),
    "minimax_m3_vl": Family(_minimax_m3_vl, "block_sparse_moe", ("w1", "w3", "w2"), "MiniMaxM3SparseForConditionalGeneration", "shared_experts",
                            correction_bias="e_score_correction_bias", block_index="index_", prefix=("", "language_model."),
                            not_read=("vision_tower.", "multi_modal_projector.", "patch_merge_mlp."), ignored=(r"(^|\.)mtp\.",),
                            written_as="text_config"),
    "granitemoe": Family(_granitemoe, "block_sparse_moe", _GRANITE, "GraniteMoeForCausalLM", fused="halves_out", router="router.layer.weight"),
    # JetMoE's: the attention experts under self_attention.experts (input_linear [E, G D, H], output_linear [E, H, G D], router.layer,
    # bias) beside kv_proj (the keys' rows, then the values'); the MoE's stacks as Granite's, its bias beside them
    "jetmoe": Family(_jetmoe, "mlp", _GRANITE, "JetMoeForCausalLM", fused="halves_out", router="router.layer.weight", attention="self_attention",
                     defaults=dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_key_value_heads=16, kv_channels=128,
                                   intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=True,
                                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "granitemoeshared": Family(_granitemoe, "block_sparse_moe", _GRANITE, "GraniteMoeSharedForCausalLM", "shared_mlp", fused="halves_out",
                               shared_beside=True, router="router.layer.weight"),
    "granitemoehybrid": Family(_granitemoehybrid, "block_sparse_moe", _GRANITE, "GraniteMoeHybridForCausalLM", "shared_mlp", fused="halves_out",
                               shared_beside=True, router="router.layer.weight", linear="mamba2", defaults=dict(shared_intermediate_size=1024),
                               dense="shared_mlp", dense_gate_up=True, gate_up=("input_linear", "output_linear")),  # H-Micro's blocks
    # Nemotron-H: each layer one sublayer, a mixer, an MLP or a MoE under `mixer` after its `norm`; the model under backbone.
    "nemotron_h": Family(_nemotron_h, "mixer", _PROJ, "NemotronHForCausalLM", "shared_experts", attention="mixer", dense="mixer", norms=("norm", "norm"),
                         final_norm="model.norm_f.weight", embed="model.embeddings.weight", linear="mamba2", mamba="mixer", single_sublayer=True,
                         prefix=("model.", "backbone."), not_read=("mtp.",),
                         defaults=dict(vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    # Mamba-2: every layer a Mamba-2 mixer alone under `mixer` after its `norm`; the model under backbone.
    "mamba2": Family(_mamba2_model, "mixer", _PROJ, "Mamba2ForCausalLM", attention="mixer", dense="mixer", norms=("norm", "norm"),
                     final_norm="model.norm_f.weight", embed="model.embeddings.weight", linear="mamba2", mamba="mixer", prefix=("model.", "backbone.")),
    **{kind: Family(_mamba, "mixer", _PROJ, f"{name}ForCausalLM", attention="mixer", dense="mixer", norms=("norm", "norm"),
                    final_norm="model.norm_f.weight", embed="model.embeddings.weight", linear="mamba1", mamba="mixer", prefix=("model.", "backbone."),
                    defaults=dict(vocab_size=50280, hidden_size=768, num_hidden_layers=32))
       for kind, name in (("mamba", "Mamba"), ("falcon_mamba", "FalconMamba"))},
    "jamba": Family(_jamba, "feed_forward", _PROJ, "JambaForCausalLM", dense="feed_forward", router="router.weight",
                    norms=("input_layernorm", "pre_ff_layernorm"), final_norm="model.final_layernorm.weight", linear="mamba1",
                    aliases=dict(num_experts="num_local_experts"),
                    defaults=dict(vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=8, num_experts_per_tok=2, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                                  expert_layer_offset=1)),
    "granitemoe_swa": Family(_granitemoe_swa, "block_sparse_moe", _STACKS, "GraniteMoeSWAForCausalLM", "shared_mlp", fused="halves_out",
                             shared_beside=True, router="router.weight"),
    "laguna": Family(_laguna, "mlp", _PROJ, "LagunaForCausalLM", "shared_expert", correction_bias="experts.e_score_correction_bias",
                     gate_proj="g_proj", defaults=dict(num_key_value_heads=8, head_dim=128, sliding_window=512, num_experts=256, num_experts_per_tok=8,
                                                         intermediate_size=8192, moe_intermediate_size=512, shared_expert_intermediate_size=512)),
    # Step 3.5 Flash's folders (Step3p5ForCausalLM, the releases' remote code; read as transformers' Step3p7TextModel): the MoE
    # block's router, correction bias and experts' stacks under moe., its shared expert beside it (share_expert), the MTP layers
    # after the trunk's not read
    "step3p5": Family(_step3p5, "", _STEP3P5_EXPERTS, "Step3p5ForCausalLM", "share_expert", router="moe.gate.weight",
                      correction_bias="moe.router_bias", fused="stacks_out", gate_proj="g_proj", extra_layers_read=False,
                      defaults=_STEP3P5_DEFAULTS, aliases=_STEP3P5_ALIASES),
    # the released Step 3.7 Flash folders: Step 3.5's text model, beside a vision model that is not read
    "step3p7": Family(_step3p7, "", _STEP3P5_EXPERTS, "Step3p7ForConditionalGeneration", "share_expert", router="moe.gate.weight",
                      correction_bias="moe.router_bias", fused="stacks_out", gate_proj="g_proj", extra_layers_read=False,
                      not_read=("vision_model.", "vit_large_projector."), written_as="step3p5"),
    "afmoe": Family(_afmoe, "mlp", _PROJ, "AfmoeForCausalLM", "shared_experts", correction_bias="expert_bias", router="router.gate.weight",
                    sandwich=("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"),
                    aliases=dict(n_shared_experts="num_shared_experts", routed_scaling_factor="route_scale"),
                    defaults=dict(head_dim=128, rms_norm_eps=1e-5, n_shared_experts=2)),
    "hy_v3": Family(_hy_v3, "mlp", _PROJ, "HYV3ForCausalLM", "shared_mlp", correction_bias="expert_bias", router="router.gate.weight",
                    extra_layers_read=False, aliases=dict(n_shared_experts="num_shared_experts", routed_scaling_factor="router_scaling_factor"),
                    defaults=dict(num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=11158840.0, n_shared_experts=1,
                                  routed_scaling_factor=2.826)),
    "qwen3_next": Family(_qwen3_next, "mlp", _PROJ, "Qwen3NextForCausalLM", linear="qkvz", gate_in_q=True, not_read=("mtp.",), mtp_module=True,
                         defaults=dict(num_key_value_heads=2, head_dim=256, norm_topk_prob=True, rope_parameters=_QWEN3_NEXT_ROPE, **_QWEN3_NEXT_LINEAR,
                                       intermediate_size=5632, shared_expert_intermediate_size=512, **_QWEN3_NEXT_MOE)),
    "qwen3_5_moe_text": Family(_qwen3_5_moe_text, "mlp", _PROJ, "Qwen3_5MoeForCausalLM", gate_in_q=True, stacks_too=True, not_read=("mtp.",),
                               mtp_module=True,
                               defaults=_QWEN3_5_DEFAULTS),
    # Qwen3.5's dense models: the text model alone, or a released folder's beside its vision model (not read)
    "qwen3_5_text": Family(_qwen3_5_text, "mlp", _PROJ, "Qwen3_5ForCausalLM", gate_in_q=True, not_read=("mtp.",), mtp_module=True,
                           defaults=_QWEN3_5_DENSE_DEFAULTS),
    "qwen3_5": Family(_qwen3_5, "mlp", _PROJ, "Qwen3_5ForConditionalGeneration", gate_in_q=True, prefix=("model.", "model.language_model."),
                      not_read=("model.visual.", "mtp."), written_as="qwen3_5_text", mtp_module=True),
    "lara_mini": Family(_lara_mini, "mlp", _STACKS, "LaraMiniForCausalLM", fused="halves_out", linear="fused",
                        defaults=dict(num_key_value_heads=4, head_dim=128, sliding_window=512, linear_num_key_heads=8, linear_num_value_heads=16,
                                      linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=128,
                                      num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                      tie_word_embeddings=True)),
    # the released Qwen3.5-MoE folders: the text model under model.language_model. (the head at lm_head), beside a vision model
    "qwen3_5_moe": Family(_qwen3_5_moe, "mlp", _PROJ, "Qwen3_5MoeForConditionalGeneration", gate_in_q=True, stacks_too=True,
                          prefix=("model.", "model.language_model."), not_read=("model.visual.", "mtp."), written_as="qwen3_5_moe_text",
                          mtp_module=True),  # its MTP module at the top level, mtp., as the text model's
    # the released Qwen3-VL-MoE folders: Qwen3-MoE's text model under model.language_model. (the head at lm_head), beside a
    # vision model; the experts as stacks, as released or as transformers writes them (Family.stacks_by_shape)
    "qwen3_vl_moe": Family(_multimodal, "mlp", _STACKS, "Qwen3VLMoeForConditionalGeneration", fused="halves", stacks_by_shape=True,
                           prefix=("model.", "model.language_model."), not_read=("model.visual.",), written_as="qwen3_moe"),
    # ...and the dense Qwen3-VL folders: Qwen3's text model there
    "qwen3_vl": Family(_multimodal, "mlp", _PROJ, "Qwen3VLForConditionalGeneration", prefix=("model.", "model.language_model."),
                       not_read=("model.visual.",), written_as="qwen3"),
    # ...and Cosmos3-Omni's folders: Qwen3-VL's, the text model's keys at the top level (layers., embed_tokens, norm, lm_head) beside
    # the vision model's (blocks., merger., ...), the attention's Diffusers-style names as transformers writes them (to_q, to_k,
    # to_v, to_out, norm_q, norm_k; older folders: q_proj, ... , Family.layout_too); a unified Cosmos3 checkpoint's generator,
    # sound and action towers and their cross-modal projections (in the text layers too) not read, as transformers drops them
    "cosmos3_omni": Family(_multimodal, "mlp", _PROJ, "Cosmos3OmniForConditionalGeneration", **_COSMOS3_NAMES,
                           not_read=("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list."), written_as="qwen3",
                           ignored=(r"\.add_[qkv]_proj\.", r"\.to_add_out\.", r"\.norm_added_[qk]\.", r"moe_gen", r"^proj_(out|in)\.", r"^time_embedder\.",
                                    r"^(audio|action)_proj_(out|in)\.", r"^(audio|action)_modality_embed$")),
    # Cosmos3-Edge: its text model (Arcee's) stored as Cosmos3-Omni's (the top level, Diffusers-style attention names or the older
    # ones), the MLP's up_proj / down_proj, beside the vision model and its projector; a unified checkpoint's generator not read
    "cosmos3_edge": Family(_multimodal, "mlp", _PROJ, "Cosmos3EdgeForConditionalGeneration", **_COSMOS3_NAMES,
                           not_read=("model.visual.", "model.projector."), written_as="arcee",
                           ignored=(r"^action_modality_embed$", r"^action_proj_(in|out)\.", r"^time_embedder\.", r"^proj_(in|out)\.", r"^norm_moe_gen\.",
                                    r"^layers\.\d+\.(input_layernorm|post_attention_layernorm|mlp)_moe_gen\.",
                                    r"^layers\.\d+\.self_attn\.(add_[qkv]_proj|to_add_out|norm_added_[qk]|k_norm_und_for_gen)\.")),
    # Qwen2-VL / Qwen2.5-VL: Qwen2's text model where Qwen2 keeps it (model., lm_head), the vision model under visual.
    "qwen2_vl": Family(_multimodal, "mlp", _PROJ, "Qwen2VLForConditionalGeneration", not_read=("visual.",), written_as="qwen2"),
    "qwen2_5_vl": Family(_multimodal, "mlp", _PROJ, "Qwen2_5_VLForConditionalGeneration", not_read=("visual.",), written_as="qwen2"),
    # ...and the released Qwen3-Omni folders: Qwen3-MoE's text model under thinker.model. (the head at thinker.lm_head)
    # GLM-4.5V / GLM-4.6V: GLM-4.5's text model (its MTP layer too, which transformers leaves unread) under model.language_model.
    "glm4v_moe": Family(_multimodal, "mlp", _PROJ, "Glm4vMoeForConditionalGeneration", "shared_experts", mtp=True,
                        prefix=("model.", "model.language_model."), not_read=("model.visual.",), written_as="glm4_moe"),
    # GLM-4.1V-9B and GLM-4.6V-Flash: GLM-4's dense text model under model.language_model.
    "glm4v": Family(_multimodal, "mlp", _PROJ, "Glm4vForConditionalGeneration", **_GLM4V_LAYOUT),
    "glm46v": Family(_multimodal, "mlp", _PROJ, "Glm46VForConditionalGeneration", **_GLM4V_LAYOUT),
    # Molmo2: its text model (Qwen3's or OLMo 2's blocks: _molmo2) under the released OLMo-core names beside the vision backbone
    "molmo2": Family(_molmo2, "mlp", _PROJ, "Molmo2ForConditionalGeneration", prefix=("model.layers.", "model.transformer.blocks."),
                     qkv="att_proj", o_proj="attn_out", dense_gate_up=True, gate_up=("ff_proj", "ff_out"), up_first=True,
                     norms=("attn_norm", "ff_norm"), post_norms=("attn_norm", "ff_norm"), embed="model.transformer.wte.embedding",
                     embed_too="model.transformer.wte.new_embedding", final_norm="model.transformer.ln_f.weight", not_read=("model.vision_backbone.",),
                     written_as="text_config"),
    # glmga: GLM-4.6V's folders under their own model_type
    "glmga": Family(_multimodal, "mlp", _PROJ, "Glm46VForConditionalGeneration", **_GLM4V_LAYOUT),
    # GLM-OCR: the same layout; its MTP layer after the trunk's (layers.16 of the released 16) not read, as in transformers
    "glm_ocr": Family(_multimodal, "mlp", _PROJ, "GlmOcrForConditionalGeneration", **_GLM4V_LAYOUT, extra_layers_read=False),
    "qwen3_omni_moe": Family(_multimodal, "mlp", _PROJ, "Qwen3OmniMoeForConditionalGeneration", prefix=("", "thinker."),
                             not_read=("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav."), written_as="qwen3_moe"),
    # ...and Qwen2.5-Omni's: Qwen2's text model under thinker. beside its encoders, the talker and token2wav
    "qwen2_5_omni": Family(_multimodal, "mlp", _PROJ, "Qwen2_5OmniForConditionalGeneration", prefix=("", "thinker."),
                           not_read=("thinker.audio_tower.", "thinker.visual.", "talker.", "token2wav."), written_as="qwen2"),
    # HunYuan-VL: Hunyuan dense's text model under model. beside its vision model (vit.), as released (and as transformers writes it)
    "hunyuan_vl": Family(_multimodal, "mlp", _PROJ, "HunYuanVLForConditionalGeneration", qk_norms=("query_layernorm", "key_layernorm"),
                         not_read=("vit.",), written_as="hunyuan_v1_dense"),
    # PaddleOCR-VL: its text model (Llama's: _MULTIMODAL) under model. as the released folders hold it (and transformers writes
    # it), beside a vision model (visual.) and its projector (mlp_AR.)
    "paddleocr_vl": Family(_multimodal, "mlp", _PROJ, "PaddleOCRVLForConditionalGeneration", not_read=("visual.", "mlp_AR."), written_as="llama"),
    # Kimi Linear: transformers writes the dense MLPs under block_sparse_moe too (the released folders: mlp)
    "kimi_linear": Family(_kimi_linear, "block_sparse_moe", ("w1", "w3", "w2"), "KimiLinearForCausalLM", "shared_experts", linear="kda",
                          dense_too="block_sparse_moe", aliases=_KIMI_LINEAR_ALIASES, defaults=_KIMI_LINEAR_DEFAULTS),
    # Ling's hybrid models: Kimi Delta Attention in Ling's variant (Family.linear "ling") and gated multi-latent attention
    # under attention. (its output projection dense), the embedding model.word_embeddings, the correction bias gate.expert_bias,
    # the MTP layers after the trunk's not read (as in transformers)
    "bailing_hybrid": Family(_bailing_hybrid, "mlp", _PROJ, "BailingHybridForCausalLM", "shared_experts", linear="ling", attention="attention",
                             o_proj="dense", gate_proj="g_proj", embed="model.word_embeddings.weight", correction_bias="gate.expert_bias",
                             extra_layers_read=False, aliases=_BAILING_ALIASES,
                             defaults=dict(vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
                                           num_hidden_layers=42, num_attention_heads=32, num_experts=512, num_experts_per_tok=8,
                                           n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=2,
                                           rms_norm_eps=1e-6, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                           v_head_dim=128, head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=6e6),
                                           layer_group_size=6, short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0)),
    # ERNIE 4.5 (21B-A3B, 300B-A47B): its MTP layers (model.mtp_*) are not read, as in transformers
    # ERNIE-4.5-VL: ERNIE 4.5 MoE's text model, its router stored [H, E], its correction bias a row of [2, E], its text experts
    # those of the first half of the indices (the vision ones, their router weight_1 and the vision model left unread)
    "ernie4_5_vl_moe": Family(_multimodal, "mlp", _PROJ, "Ernie4_5_VLMoeForConditionalGeneration", "shared_experts",
                              correction_bias="moe_statics.e_score_correction_bias", correction_bias_row=0, router_transposed=True,
                              not_read=("model.vision_model.", "model.resampler_model."), ignored=(r"\.mlp\.experts\.\d+\.", r"\.mlp\.gate\.weight_1$"),
                              written_as="ernie4_5_moe"),
    "ernie4_5_moe": Family(_ernie4_5_moe, "mlp", _PROJ, "Ernie4_5_MoeForCausalLM", "shared_experts", correction_bias="moe_statics.e_score_correction_bias",
                           correction_bias_unit=0, not_read=("model.mtp_",), aliases=dict(num_experts_per_tok="moe_k"),
                           defaults=dict(num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True, intermediate_size=12288,
                                         rope_parameters=dict(rope_type="default", rope_theta=500000.0), moe_num_experts=64, moe_k=6,
                                         moe_intermediate_size=1536, moe_num_shared_experts=2)),
    # Mistral 4: the experts as stacks, [E, 2F, H] gate_up_proj (each expert's gate rows, then its up rows) and [E, H, F] down_proj
    "lfm2_moe": Family(_lfm2_moe, "feed_forward", _LFM2_MLP, "Lfm2MoeForCausalLM", correction_bias="expert_bias", **_LFM2),
    "mimo_v2_flash": Family(_mimo_v2_flash, "mlp", _PROJ, "MiMoV2FlashForCausalLM", sinks="attention_sink_bias", not_read=("model.mtp.",),
                            defaults=dict(head_dim=192, v_head_dim=128, num_key_value_heads=4, rms_norm_eps=1e-5, sliding_window=129,
                                          attention_value_scale=0.707, rope_parameters=_MIMO_ROPE, n_group=1, topk_group=1,
                                          routed_scaling_factor=1.0, norm_topk_prob=True)),
    "mistral4": Family(_mistral4, "mlp", _STACKS, "Mistral4ForCausalLM", "shared_experts", fused="halves_out",
                       defaults=dict(n_shared_experts=1, q_lora_rank=1024, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                     v_head_dim=128, rope_parameters=_MISTRAL4_ROPE)),
    # the released Mistral 3 folders (Mistral Small 4, Ministral 3, Mistral Small 3.x): the text model under language_model.
    # (the head too), beside a vision model
    "mistral3": Family(_listed_family, "mlp", _STACKS, "Mistral3ForConditionalGeneration", "shared_experts", fused="halves_out",
                       prefix=("", "language_model."), not_read=("vision_tower.", "multi_modal_projector."), written_as="text_config"),
    "hunyuan_v1_moe": Family(_hunyuan_v1_moe, "mlp", _PROJ, "HunYuanMoEV1ForCausalLM", "shared_mlp", router="gate.wg.weight",
                             qk_norms=("query_layernorm", "key_layernorm"), defaults=dict(rms_norm_eps=1e-5)),
    # Command A's MoE: Cohere's blocks, experts one module each (as transformers writes them)
    "cohere2_moe": Family(_cohere2_moe, "mlp", _PROJ, "Cohere2MoeForCausalLM", "shared_experts", norms=("input_layernorm", ""),
                          defaults=dict(head_dim=128, tie_word_embeddings=True, sliding_window=4096, num_experts=8, num_experts_per_tok=2)),
    "dbrx": Family(_dbrx, "ffn", ("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"), "DbrxForCausalLM", fused="rows",
                   router="router.layer.weight", prefix=("model.layers.", "transformer.blocks."), embed="transformer.wte.weight",
                   final_norm="transformer.norm_f.weight", attention="norm_attn_norm.attn", qkv="Wqkv", o_proj="out_proj",
                   norms=("norm_attn_norm.norm_1", "norm_attn_norm.norm_2"), defaults=dict(d_model=2048, n_heads=16, n_layers=24, vocab_size=32000)),
    # the dense families (DENSE_FAMILIES), after the MoE ones
    "llama": Family(_llama, "mlp", _PROJ, "LlamaForCausalLM"),
    # EXAONE 3.0 / 3.5: Llama's model under the released names (transformers renames them on load and back on save): the
    # layers under transformer.h., ln_1 / ln_2, the attention under attn.attention. with its out_proj, the MLP's c_fc_0 /
    # c_fc_1 / c_proj, the embedding transformer.wte, the final norm transformer.ln_f; its config's own field names
    "exaone": Family(_llama, "mlp", _PROJ, "LlamaForCausalLM", prefix=("model.layers.", "transformer.h."),
                     attention="attn.attention", o_proj="out_proj", norms=("ln_1", "ln_2"), dense_names=("c_fc_0", "c_fc_1", "c_proj"),
                     embed="transformer.wte.weight", final_norm="transformer.ln_f.weight",
                     aliases=dict(num_hidden_layers="num_layers", rms_norm_eps="layer_norm_epsilon", hidden_act="activation_function"),
                     defaults=dict(vocab_size=102400, intermediate_size=14336, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=5e5)),
    "olmo": Family(_olmo, "mlp", _PROJ, "OlmoForCausalLM"),
    # GPT-J: the layers under transformer.h., the attention under attn. (out_proj), the MLP's fc_in / fc_out, one LayerNorm per
    # block (ln_1), the embedding transformer.wte, the final norm transformer.ln_f; old folders' causal-mask buffers
    # (attn.bias, attn.masked_bias) not read, as in transformers; its config's own field names
    # GPT-Neo: the layers under transformer.h., the attention under attn.attention. (out_proj), the MLP's c_fc / c_proj, the
    # learned positions transformer.wpe; old folders' causal-mask buffers (attn.attention.bias, masked_bias) not read
    "gpt_neo": Family(_gpt_neo, "mlp", _PROJ, "GPTNeoForCausalLM", prefix=("model.layers.", "transformer.h."), attention="attn.attention",
                      o_proj="out_proj", norms=("ln_1", "ln_2"), dense_names=("", "c_fc", "c_proj"), embed="transformer.wte.weight",
                      pos_embed="transformer.wpe.weight", final_norm="transformer.ln_f.weight", ignored=(r"\.attn\.attention\.(masked_)?bias$",),
                      aliases=dict(num_hidden_layers="num_layers", num_attention_heads="num_heads", rms_norm_eps="layer_norm_epsilon",
                                   hidden_act="activation_function"),
                      defaults=dict(vocab_size=50257, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, rms_norm_eps=1e-5,
                                    hidden_act="gelu_new", tie_word_embeddings=True)),
    # GPT-BigCode: GPT-2's names on Linear weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj), the learned positions
    # transformer.wpe
    "gpt_bigcode": Family(_gpt_bigcode, "mlp", _PROJ, "GPTBigCodeForCausalLM", qkv_per_head=True, **_GPT2_LAYOUT,
                          defaults=dict(_GPT2_DEFAULTS, hidden_act="gelu_pytorch_tanh")),
    # GPT-2: GPT-BigCode's names with Conv1D weights [in, out] (Family.conv1d), q, k and v in c_attn every q's first; old
    # folders' causal-mask buffers (attn.bias, attn.masked_bias) not read
    "gpt2": Family(_gpt2, "mlp", _PROJ, "GPT2LMHeadModel", conv1d=True, ignored=(r"\.attn\.(masked_)?bias$",), **_GPT2_LAYOUT,
                   defaults=dict(_GPT2_DEFAULTS, hidden_act="gelu_new")),
    # OPT: the layers under model.decoder.layers., self_attn (out_proj), its pre-norms self_attn_layer_norm and
    # final_layer_norm, the MLP's fc1 / fc2 under the layer itself, the learned positions model.decoder.embed_positions
    # BioGPT: OPT's layout under biogpt. (the final norm layer_norm), the head output_projection
    "biogpt": Family(_biogpt, "", _PROJ, "BioGptForCausalLM", prefix=("model.layers.", "biogpt.layers."), o_proj="out_proj", dense="",
                     norms=("self_attn_layer_norm", "final_layer_norm"), dense_names=("", "fc1", "fc2"), embed="biogpt.embed_tokens.weight",
                     pos_embed="biogpt.embed_positions.weight", final_norm="biogpt.layer_norm.weight", head="output_projection.weight",
                     defaults=dict(vocab_size=42384, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                                   max_position_embeddings=1024, tie_word_embeddings=True)),
    "opt": Family(_opt, "", _PROJ, "OPTForCausalLM", prefix=("model.layers.", "model.decoder.layers."), o_proj="out_proj", dense="",
                  norms=("self_attn_layer_norm", "final_layer_norm"), dense_names=("", "fc1", "fc2"), embed="model.decoder.embed_tokens.weight",
                  pos_embed="model.decoder.embed_positions.weight", final_norm="model.decoder.final_layer_norm.weight",
                  aliases=dict(hidden_act="activation_function"),
                  defaults=dict(vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12, hidden_act="relu",
                                tie_word_embeddings=True)),
    # CodeGen: GPT-J's names, q, k and v in qkv_proj (four groups of q, v, k)
    "codegen": Family(_codegen, "mlp", _PROJ, "CodeGenForCausalLM", qkv="qkv_proj", qkv_groups=4, qkv_order="qvk",
                      ignored=(r"\.attn\.(causal_mask|masked_bias)$",), **_GPTJ_LAYOUT),
    "gptj": Family(_gptj, "mlp", _PROJ, "GPTJForCausalLM", ignored=(r"\.attn\.(masked_)?bias$",), **_GPTJ_LAYOUT),
    # GPT-NeoX / Pythia: the layers under gpt_neox.layers., the attention's fused query_key_value (head by head) and dense, the
    # MLP's dense_h_to_4h / dense_4h_to_h, the embedding embed_in, the head embed_out; old folders' attention.bias and
    # masked_bias buffers (the causal mask) are not read, as in transformers
    # Falcon: the blocks under transformer.h., the attention self_attention (query_key_value kv head by kv head, dense), the
    # norms ln_attn / ln_mlp where each branch has its own (Family.parallel_norm_names)
    "falcon": Family(_falcon, "mlp", _PROJ, "FalconForCausalLM", prefix=("model.layers.", "transformer.h."), attention="self_attention",
                     qkv="query_key_value", qkv_per_head=True, o_proj="dense", dense_names=("", "dense_h_to_4h", "dense_4h_to_h"),
                     parallel_norm_names=("ln_attn", "ln_mlp"), embed="transformer.word_embeddings.weight", final_norm="transformer.ln_f.weight",
                     aliases=dict(num_hidden_layers="n_layer", num_attention_heads="n_head", num_kv_heads="n_head_kv", hidden_size="n_embed"),
                     defaults=dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, layer_norm_epsilon=1e-5,
                                   tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # Persimmon: GPT-NeoX's attention names under the layers' self_attn (query_key_value head by head, dense, the q/k LayerNorms
    # q_layernorm / k_layernorm), the MLP's dense_h_to_4h / dense_4h_to_h, the final norm model.final_layernorm
    "persimmon": Family(_persimmon, "mlp", _PROJ, "PersimmonForCausalLM", qkv="query_key_value", qkv_per_head=True, o_proj="dense",
                        dense_names=("", "dense_h_to_4h", "dense_4h_to_h"), qk_norms=("q_layernorm", "k_layernorm"),
                        final_norm="model.final_layernorm.weight",
                        defaults=dict(vocab_size=262144, hidden_size=4096, intermediate_size=16384, num_hidden_layers=36, num_attention_heads=64,
                                      layer_norm_eps=1e-5, tie_word_embeddings=False)),
    # BLOOM: Falcon's names (transformer.h., self_attention's query_key_value head by head and dense, the MLP's
    # dense_h_to_4h / dense_4h_to_h), the embeddings' LayerNorm word_embeddings_layernorm
    "bloom": Family(_bloom, "mlp", _PROJ, "BloomForCausalLM", prefix=("model.layers.", "transformer.h."), attention="self_attention",
                    qkv="query_key_value", qkv_per_head=True, o_proj="dense", dense_names=("", "dense_h_to_4h", "dense_4h_to_h"),
                    embed="transformer.word_embeddings.weight", embed_norm="transformer.word_embeddings_layernorm.weight",
                    final_norm="transformer.ln_f.weight", aliases=dict(num_hidden_layers="n_layer", num_attention_heads="n_head", hidden_size="n_embed"),
                    defaults=dict(vocab_size=250880, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, layer_norm_epsilon=1e-5,
                                  tie_word_embeddings=True)),
    # MPT: the blocks under transformer.blocks., norm_1 / norm_2, the attention's Wqkv (every q's first) and out_proj, the MLP ffn's
    # up_proj / down_proj, the embedding transformer.wte, the final norm transformer.norm_f
    "mpt": Family(_mpt, "ffn", _PROJ, "MptForCausalLM", prefix=("model.layers.", "transformer.blocks."), attention="attn", qkv="Wqkv",
                  o_proj="out_proj", norms=("norm_1", "norm_2"), dense="ffn", dense_names=("", "up_proj", "down_proj"), embed="transformer.wte.weight",
                  final_norm="transformer.norm_f.weight",
                  defaults=dict(d_model=2048, n_heads=16, n_layers=24, vocab_size=50368, layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    "gpt_neox": Family(_gpt_neox, "mlp", _PROJ, "GPTNeoXForCausalLM", prefix=("model.layers.", "gpt_neox.layers."), attention="attention",
                       qkv="query_key_value", qkv_per_head=True, o_proj="dense", dense_names=("", "dense_h_to_4h", "dense_4h_to_h"),
                       embed="gpt_neox.embed_in.weight", head="embed_out.weight", final_norm="gpt_neox.final_layer_norm.weight",
                       ignored=(r"\.attention\.(masked_)?bias$",),
                       defaults=dict(vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44, num_attention_heads=64)),
    "starcoder2": Family(_starcoder2, "mlp", _PROJ, "Starcoder2ForCausalLM", dense_names=("", "c_fc", "c_proj"),
                         defaults=dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30, num_attention_heads=24,
                                       num_key_value_heads=2, tie_word_embeddings=True)),
    # Phi-1 / -1.5 / -2: the attention's output projection dense, the MLP's fc1 / fc2, one LayerNorm per block, the final one
    # final_layernorm
    "phi": Family(_phi, "mlp", _PROJ, "PhiForCausalLM", o_proj="dense", norms=("input_layernorm", ""), dense_names=("", "fc1", "fc2"),
                  final_norm="model.final_layernorm.weight",
                  defaults=dict(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32)),
    "cwm": Family(_cwm, "mlp", _PROJ, "CwmForCausalLM",
                  defaults=dict(vocab_size=128256, hidden_size=6144, intermediate_size=21504, num_hidden_layers=64, num_attention_heads=48,
                                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, sliding_window=8192,
                                rope_parameters=dict(rope_type="llama3", rope_theta=1e6, factor=16.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                                     original_max_position_embeddings=8192))),
    # InternLM3 and IQuest-Coder: Llama's model under their own configs (transformers builds LlamaForCausalLM), InternLM3's
    # biases named qkv_bias and bias in its released config.json
    "internlm3": Family(_internlm3, "mlp", _PROJ, "LlamaForCausalLM", aliases=dict(attention_bias="qkv_bias", mlp_bias="bias"),
                        defaults=dict(vocab_size=128512, hidden_size=4096, intermediate_size=10240, num_hidden_layers=48, num_attention_heads=32,
                                      num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5)),
    "iquestcoder": Family(_iquestcoder, "mlp", _PROJ, "LlamaForCausalLM",
                          defaults=dict(vocab_size=76800, hidden_size=5120, intermediate_size=27648, num_hidden_layers=80, num_attention_heads=40,
                                        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5)),
    # Ministral-8B (ministral): Mistral's blocks, each layer's window from layer_types (by default every layer slides)
    "ministral": Family(_mistral, "mlp", _PROJ, "MinistralForCausalLM", defaults=dict(num_key_value_heads=8, sliding_window=4096)),
    "mistral": Family(_mistral, "mlp", _PROJ, "MistralForCausalLM", defaults=dict(num_key_value_heads=8, sliding_window=4096)),
    "ministral3": Family(_ministral3, "mlp", _PROJ, "Ministral3ForCausalLM",
                         defaults=dict(num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_parameters=_MINISTRAL3_ROPE)),
    "qwen2": Family(_qwen2, "mlp", _PROJ, "Qwen2ForCausalLM", defaults=dict(num_key_value_heads=32)),
    "qwen3": Family(_qwen3, "mlp", _PROJ, "Qwen3ForCausalLM", defaults=dict(num_key_value_heads=32, head_dim=128)),
    "olmo2": Family(_olmo2, "mlp", _PROJ, "Olmo2ForCausalLM", defaults=dict(rms_norm_eps=1e-5)),
    "olmo3": Family(_olmo3, "mlp", _PROJ, "Olmo3ForCausalLM", defaults=dict(rms_norm_eps=1e-5, sliding_window=4096)),
    "jais2": Family(_jais2, "mlp", _PROJ, "Jais2ForCausalLM"),
    "nanochat": Family(_nanochat, "mlp", _PROJ, "NanoChatForCausalLM", dense_names=("", "fc1", "fc2")),  # no norm weights: none read
    # OLMo Hybrid's files (transformers renames on load): the linear blocks' pre-norms, the attention blocks' output norm of
    # the attention, a conv per q, k, v
    "olmo_hybrid": Family(_olmo_hybrid, "mlp", _PROJ, "OlmoHybridForCausalLM", linear="split", norms=("attention_layer_norm", "feedforward_layer_norm"),
                          post_norms=("feedforward_layer_norm", "post_feedforward_layernorm")),
    "granite": Family(_granite, "mlp", _PROJ, "GraniteForCausalLM"),
    # Gemma 4: the MoE is the layer's own (its router and experts under model.layers.{i}), beside its dense mlp
    "gemma4_text": Family(_gemma4_text, "", _STACKS, "Gemma4ForCausalLM", **_GEMMA4,
                          defaults=dict(vocab_size=262144, num_key_value_heads=4, head_dim=256, sliding_window=512, tie_word_embeddings=True,
                                        hidden_size_per_layer_input=256, rope_parameters=_GEMMA4_ROPE)),
    # the released Gemma 4 folders: the text model under model.language_model., beside vision and audio models
    "gemma4": Family(_gemma4, "", _STACKS, "Gemma4ForConditionalGeneration", **_GEMMA4,
                     prefix=("model.", "model.language_model."), written_as="gemma4_text",
                     not_read=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")),
    # Gemma 4's unified models (Gemma 4 12B): Gemma 4's dense text model, the released folders' under model.language_model.
    "gemma4_unified_text": Family(_gemma4_unified_text, "", _STACKS, "Gemma4UnifiedForCausalLM", **_GEMMA4,
                                  defaults=dict(vocab_size=262144, num_key_value_heads=4, head_dim=256, sliding_window=1024, tie_word_embeddings=True,
                                                use_bidirectional_attention="vision", rope_parameters=_GEMMA4_ROPE)),
    "gemma4_unified": Family(_gemma4_unified, "", _STACKS, "Gemma4UnifiedForConditionalGeneration", **_GEMMA4,
                             prefix=("model.", "model.language_model."), written_as="gemma4_unified_text",
                             not_read=("model.vision_embedder.", "model.embed_vision.", "model.embed_audio.")),
    "arcee": Family(_arcee, "mlp", _PROJ, "ArceeForCausalLM", defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5)),
    "gemma": Family(_gemma, "mlp", _PROJ, "GemmaForCausalLM", defaults=dict(vocab_size=256000, num_key_value_heads=16, head_dim=256,
                                                                               tie_word_embeddings=True)),
    "vaultgemma": Family(_vaultgemma, "mlp", _PROJ, "VaultGemmaForCausalLM", norms=("input_layernorm", "pre_feedforward_layernorm"),
                         defaults=dict(vocab_size=256000, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                       tie_word_embeddings=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma2": Family(_gemma2, "mlp", _PROJ, "Gemma2ForCausalLM",
                     sandwich=_GEMMA_SANDWICH,
                     defaults=dict(vocab_size=256000, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                   tie_word_embeddings=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3_text": Family(_gemma3_text, "mlp", _PROJ, "Gemma3ForCausalLM",
                          sandwich=_GEMMA_SANDWICH,
                          defaults=dict(vocab_size=262208, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                        tie_word_embeddings=True, rope_parameters=_GEMMA3_ROPE)),
    # the released Gemma 3 folders: the text model under language_model., beside a vision model
    "gemma3": Family(_gemma3, "mlp", _PROJ, "Gemma3ForConditionalGeneration",
                     sandwich=_GEMMA_SANDWICH,
                     prefix=("", "language_model."), not_read=("vision_tower.", "multi_modal_projector."), written_as="gemma3_text"),
    "helium": Family(_helium, "mlp", _PROJ, "HeliumForCausalLM", defaults=dict(vocab_size=48000, num_key_value_heads=20, head_dim=128,
                                                                                 rms_norm_eps=1e-8, rope_theta=100000.0)),
    "minicpm3": Family(_minicpm3, "mlp", _PROJ, "MiniCPM3ForCausalLM",
                       defaults=dict(vocab_size=73448, num_key_value_heads=40, tie_word_embeddings=True, q_lora_rank=768, kv_lora_rank=256,
                                     qk_rope_head_dim=32, qk_nope_head_dim=64, scale_emb=12, scale_depth=1.4, dim_model_base=256,
                                     rms_norm_eps=1e-5)),
    "youtu": Family(_youtu, "mlp", _PROJ, "YoutuForCausalLM",
                    defaults=dict(vocab_size=128256, num_key_value_heads=16, tie_word_embeddings=True, q_lora_rank=1536, kv_lora_rank=512,
                                  qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)),
    "hyperclovax": Family(_hyperclovax, "mlp", _PROJ, "HyperCLOVAXForCausalLM",
                          sandwich=("input_layernorm", "post_norm1", "post_attention_layernorm", "post_norm2")),
    "granite_swa": Family(_granite_swa, "mlp", _PROJ, "GraniteSWAForCausalLM",
                          defaults=dict(num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True, sliding_window=128)),
    "phi3": Family(_phi3, "mlp", _PROJ, "Phi3ForCausalLM", qkv="qkv_proj", dense_gate_up=True,
                   defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096)),
    "glm": Family(_glm, "mlp", _PROJ, "GlmForCausalLM", dense_gate_up=True,
                  defaults=dict(num_key_value_heads=2, head_dim=128, rms_norm_eps=1.5625e-07, attention_bias=True, partial_rotary_factor=0.5)),
    "glm4": Family(_glm4, "mlp", _PROJ, "Glm4ForCausalLM", dense_gate_up=True,
                   sandwich=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
                   defaults=dict(num_key_value_heads=2, head_dim=128, rms_norm_eps=1.5625e-07, attention_bias=True, partial_rotary_factor=0.5)),
    "ernie4_5": Family(_ernie4_5, "mlp", _PROJ, "Ernie4_5ForCausalLM",
                       defaults=dict(num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                     rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "lfm2": Family(_lfm2, "feed_forward", _LFM2_MLP, "Lfm2ForCausalLM", **_LFM2),
    # LFM3: LFM2's names but Qwen3's attention (o_proj, q_norm, k_norm), its sandwich norms and the attention's gate per head
    "lfm3": Family(_lfm3, "feed_forward", _LFM2_MLP, "Lfm3ForCausalLM",
                   sandwich=("operator_norm", "post_operator_norm", "ffn_norm", "post_ffn_norm"),
                   **dict(_LFM2, o_proj="o_proj", qk_norms=("q_norm", "k_norm"),
                          defaults=dict(num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=True, sliding_window=256,
                                        rope_parameters=_LFM3_ROPE))),
    "bamba": Family(_bamba, "feed_forward", _PROJ, "BambaForCausalLM", dense="feed_forward", norms=("input_layernorm", "pre_ff_layernorm"),
                    final_norm="model.final_layernorm.weight",
                    linear="mamba2", defaults=dict(num_key_value_heads=8, rms_norm_eps=1e-5)),
    "falcon_h1": Family(_falcon_h1, "feed_forward", _PROJ, "FalconH1ForCausalLM", dense="feed_forward", norms=("input_layernorm", "pre_ff_layernorm"),
                        final_norm="model.final_layernorm.weight", linear="mamba2", folds=_falcon_h1_folds,
                        defaults=dict(vocab_size=128000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=8192, mamba_d_ssm=1024, mamba_n_heads=128,
                                      mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
                                      mamba_proj_bias=False, mamba_norm_before_gate=True, mamba_rms_norm=False)),
    "smollm3": Family(_smollm3, "mlp", _PROJ, "SmolLM3ForCausalLM", defaults=dict(num_key_value_heads=4, rope_theta=2e6, tie_word_embeddings=True)),
    "stablelm": Family(_stablelm, "mlp", _PROJ, "StableLmForCausalLM", qk_norms=("q_layernorm", "k_layernorm"), qk_norm_modules=True,
                       defaults=dict(vocab_size=50304, hidden_size=2560, num_attention_heads=32, num_key_value_heads=32,
                                     intermediate_size=6912, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                                 partial_rotary_factor=0.25))),
    "apertus": Family(_apertus, "mlp", _PROJ, "ApertusForCausalLM", **_APERTUS, defaults=_APERTUS_DEFAULTS),
    "apertus1p5_text": Family(_apertus1p5_text, "mlp", _PROJ, "Apertus1p5TextForCausalLM", **_APERTUS,
                              defaults=dict(_APERTUS_DEFAULTS, vocab_size=266752)),
    "apertus1p5": Family(_apertus1p5, "mlp", _PROJ, "Apertus1p5ForConditionalGeneration", **_APERTUS, prefix=("model.", "model.language_model."),
                         not_read=("model.vision_tokenizer.", "model.audio_tokenizer."), written_as="apertus1p5_text"),
    "nemotron": Family(_nemotron, "mlp", _PROJ, "NemotronForCausalLM", aliases=dict(rms_norm_eps="norm_eps"),
                       defaults=dict(vocab_size=256000, hidden_size=6144, intermediate_size=24576, num_attention_heads=48, rms_norm_eps=1e-5,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "cohere": Family(_cohere, "mlp", _PROJ, "CohereForCausalLM", norms=("input_layernorm", ""),
                     defaults=dict(tie_word_embeddings=True, rope_theta=500000.0)),
    "cohere2": Family(_cohere2, "mlp", _PROJ, "Cohere2ForCausalLM", norms=("input_layernorm", ""),
                      defaults=dict(tie_word_embeddings=True, sliding_window=4096)),
    # Cohere's North models (CohereLabs' North-*): Cohere 2's names; the released folders (cohere_compass,
    # CohereCompassForConditionalGeneration) hold that text model under model.language_model., beside a vision model
    "cohere_compass_text": Family(_cohere_compass_text, "mlp", _PROJ, "CohereCompassForCausalLM", norms=("input_layernorm", ""),
                                  defaults=dict(tie_word_embeddings=True, sliding_window=4096)),
    "cohere_compass": Family(_cohere_compass, "mlp", _PROJ, "CohereCompassForConditionalGeneration", norms=("input_layernorm", ""),
                             prefix=("model.", "model.language_model."), not_read=("model.visual.",), written_as="cohere_compass_text"),
    # Muse Glimmer's text model (transformers has no causal LM of it alone: its base model's class)
    "muse_glimmer_text": Family(_muse_glimmer_text, "mlp", _PROJ, "MuseGlimmerTextModel", sandwich=_GEMMA_SANDWICH, defaults=_MUSE_GLIMMER_DEFAULTS),
    "muse_spark_text": Family(_muse_spark_text, "mlp", _STACKS, "MuseSparkTextModel", sandwich=_GEMMA_SANDWICH, fused="halves_out",
                              latent=("pre_expert_proj", "post_expert_proj"), defaults=_MUSE_SPARK_DEFAULTS),
    "muse_spark": Family(_muse_spark, "mlp", _STACKS, "MuseSparkForConditionalGeneration", sandwich=_GEMMA_SANDWICH, fused="halves_out",
                         latent=("pre_expert_proj", "post_expert_proj"), prefix=("model.", "model.language_model."),
                         not_read=("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.", "model.audio_tower."),
                         written_as="muse_spark_text"),
    "muse_glimmer": Family(_muse_glimmer, "mlp", _PROJ, "MuseGlimmerForConditionalGeneration", sandwich=_GEMMA_SANDWICH,
                           prefix=("model.", "model.language_model."),
                           not_read=("model.vision_tower.", "model.vision_adapter.", "model.vision_projection."), written_as="muse_glimmer_text"),
    "exaone4": Family(_exaone4, "mlp", _PROJ, "Exaone4ForCausalLM", defaults=dict(rms_norm_eps=1e-5, sliding_window=4096, num_key_value_heads=32)),
    "seed_oss": Family(_seed_oss, "mlp", _PROJ, "SeedOssForCausalLM", defaults=dict(num_key_value_heads=8, head_dim=128, attention_bias=True)),
    "hunyuan_v1_dense": Family(_hunyuan_v1_dense, "mlp", _PROJ, "HunYuanDenseV1ForCausalLM", qk_norms=("query_layernorm", "key_layernorm"),
                               defaults=dict(rms_norm_eps=1e-5)),
}


def _vl_text(kind: str) -> Callable[[dict], dict]:
    """config_to_fmoe of a released vision-language folder whose text_config is family `kind`'s
    model (_VL_TEXT): that text model's kwargs (_vl_text_config, _text_family), a text_config
    of another model_type refused."""
    def config_to_fmoe(hf: dict) -> dict:
        text = _vl_text_config(hf)
        if text.get("model_type", kind) not in (kind, *_VL_TEXT_ALIASES.get(kind, ())):
            raise ValueError(f"config.json: a {hf.get('model_type')} folder whose text model is {text.get('model_type')!r} is not supported "
                             f"(expected {kind!r})")
        return _text_family(hf, kind, text)
    return config_to_fmoe


def _vl_text_config(hf: dict) -> dict:
    """A multimodal folder's text config (_text_config) as transformers' class of the whole model
    computes with it (_unscaled: Command A Vision's, Aya Vision's and Granite Speech's logits
    unscaled), read so and written so."""
    return _unscaled(hf, _text_config(hf))


def _unscaled(hf: dict, text: dict) -> dict:
    """text, the text config of a multimodal folder `hf`, with its family's logit scale
    (_LOGIT_SCALE) 1 where the folder's class applies none to its head (_HEAD_UNSCALED)."""
    kind = text.get("model_type", FAMILIES[hf["model_type"]].written_as)
    if hf["model_type"] in _HEAD_UNSCALED and kind in _LOGIT_SCALE:
        text[_LOGIT_SCALE[kind]] = 1.0
    return text


# released vision-language (and speech) folders: model_type -> (the text model's family, the architecture, transformers'
# default of the top level's tie_word_embeddings (None: the text model ties its own head), the prefixes of what is beside
# the text model, where the text model's keys are: _IN_MODEL or _LEGACY). What is beside it (the vision or audio encoder,
# its projectors) is not read; the folder is
# written back only as the text model's family. Granite 4.0 Vision's text model is Granite 3's (the vision features it adds
# to some layers' outputs join only at image tokens). Some of their classes' heads apply no logit scale (_HEAD_UNSCALED)
# the text model under model. (Family.prefix), or all of it, head included, under language_model. (Family.outer)
_IN_MODEL, _LEGACY = ("model.", "model.language_model."), "language_model."
_VL_TEXT = {"lfm2_vl": ("lfm2", "Lfm2VlForConditionalGeneration", True, ("model.vision_tower.", "model.multi_modal_projector."), _IN_MODEL),
            "lfm3_vl": ("lfm3", "Lfm3VlForConditionalGeneration", True, ("model.vision_tower.", "model.multi_modal_projector."), _IN_MODEL),
            "exaone4_5": ("exaone4", "Exaone4_5_ForConditionalGeneration", False, ("model.visual.",), _IN_MODEL),
            "granite4_vision": ("granite", "Granite4VisionForConditionalGeneration", False,
                                ("model.vision_tower.", "model.image_newline", "model.layerwise_projectors.", "model.spatial_projectors."), _IN_MODEL),
            "cohere2_vision": ("cohere2", "Cohere2VisionForConditionalGeneration", True, ("model.vision_tower.", "model.multi_modal_projector."),
                               _IN_MODEL),
            "aya_vision": ("cohere2", "AyaVisionForConditionalGeneration", True, ("vision_tower.", "multi_modal_projector."), _LEGACY),
            "hyperclovax_vision_v2": ("hyperclovax", "HyperCLOVAXVisionV2ForConditionalGeneration", True, ("model.vision_model.", "model.vision_projector."),
                                      _IN_MODEL),
            "granite_speech": ("granite", "GraniteSpeechForConditionalGeneration", True, ("encoder.", "projector."), _LEGACY),
            **{f"minicpmv4_{v}": ("qwen3_5_text", f"MiniCPMV4_{v}ForConditionalGeneration", False, ("model.vision_tower.", "model.merger."), _IN_MODEL)
               for v in (6, 7)},
            # DeepSeek-VL (Llama's text model beside a SigLIP tower and its aligner), Fun-ASR-Nano (Qwen3's beside an audio encoder and
            # its adaptor); AudioFlamingo 3 (Qwen2's) and GLM-ASR (Llama's) beside an audio tower, in Qwen2-Audio's older layout
            "deepseek_vl": ("llama", "DeepseekVLForConditionalGeneration", True, ("model.vision_model.", "model.aligner."), _IN_MODEL),
            "audioflamingo3": ("qwen2", "AudioFlamingo3ForConditionalGeneration", None, ("audio_tower.", "multi_modal_projector."), _LEGACY),
            "fun_asr_nano": ("qwen3", "FunAsrNanoForConditionalGeneration", True, ("model.audio_tower.", "model.multi_modal_projector."), _IN_MODEL),
            "glmasr": ("llama", "GlmAsrForConditionalGeneration", True, ("audio_tower.", "multi_modal_projector."), _LEGACY),
            # Qwen2-Audio (Qwen2's text model) and Music Flamingo (AudioFlamingo 3's) in the same older layout; Granite Speech Plus
            # (Granite 3's beside Granite Speech's encoder and projector)
            "qwen2_audio": ("qwen2", "Qwen2AudioForConditionalGeneration", None, ("audio_tower.", "multi_modal_projector."), _LEGACY),
            "musicflamingo": ("qwen2", "MusicFlamingoForConditionalGeneration", None, ("audio_tower.", "multi_modal_projector."), _LEGACY),
            "granite_speech_plus": ("granite", "GraniteSpeechPlusForConditionalGeneration", True, ("encoder.", "projector."), _LEGACY),
            # Qwen3-ASR and MOSS Transcribe-Diarize (Qwen3's text model beside an audio tower), LightOnOCR (Qwen3's beside a
            # Pixtral vision encoder)
            "qwen3_asr": ("qwen3", "Qwen3ASRForConditionalGeneration", True, ("model.audio_tower.", "model.multi_modal_projector."), _IN_MODEL),
            "moss_transcribe_diarize": ("qwen3", "MossTranscribeDiarizeForConditionalGeneration", True,
                                        ("model.audio_tower.", "model.multi_modal_projector."), _IN_MODEL),
            "lighton_ocr": ("qwen3", "LightOnOcrForConditionalGeneration", True, ("model.vision_encoder.", "model.vision_projection."), _IN_MODEL),
            # GOT-OCR 2.0 (Qwen2's text model beside a SAM-style vision encoder and its projector, in the older layout), Ovis2
            # (Qwen2's beside a SigLIP-style tower and its visual embedding table), VideoLLaMA 3 (Qwen2's beside a vision model and
            # its projector), Qianfan-OCR (Qwen3's beside an InternViT-style tower and its mlp1, in the older layout), Janus
            # (Llama's beside a SigLIP tower, its aligner, and the image generation's VQ model, embeddings, aligner and head),
            # DeepSeek-VL-Hybrid (Llama's beside a SigLIP tower and a SAM-style high-resolution one, with their projections);
            # Idefics2 (Mistral's, under model.text_model., the head at lm_head)
            "got_ocr2": ("qwen2", "GotOcr2ForConditionalGeneration", True, ("vision_tower.", "multi_modal_projector."), _LEGACY),
            "ovis2": ("qwen2", "Ovis2ForConditionalGeneration", True, ("model.vision_tower.", "model.visual_embeddings_table."), _IN_MODEL),
            "video_llama_3": ("qwen2", "VideoLlama3ForConditionalGeneration", False, ("model.vision_model.", "model.projector."), _IN_MODEL),
            "qianfan_ocr": ("qwen3", "QianfanOCRForConditionalGeneration", False, ("vision_model.", "mlp1."), _LEGACY),
            "janus": ("llama", "JanusForConditionalGeneration", True, ("model.vision_model.", "model.aligner.", "model.vqmodel.",
                                                                        "model.generation_embeddings.", "model.generation_aligner.",
                                                                        "model.generation_head."), _IN_MODEL),
            "deepseek_vl_hybrid": ("llama", "DeepseekVLHybridForConditionalGeneration", True,
                                   ("model.vision_model.", "model.aligner.", "model.high_res_vision_model.", "model.high_res_vision_neck.",
                                    "model.high_res_vision_proj.", "model.high_res_vision_alpha"), _IN_MODEL),
            "idefics2": ("mistral", "Idefics2ForConditionalGeneration", False, ("model.vision_model.", "model.connector."), ("model.", "model.text_model.")),
            # Granite Docling (Granite 3's text model under model.text_model., its own model_type, beside a vision model whose
            # deepstack features join some layers' outputs only at image tokens; its head applies the logit scale)
            "granite_docling": ("granite", "GraniteDoclingForConditionalGeneration", True, ("model.vision_model.",), ("model.", "model.text_model.")),
            # BLIP-2 (OPT's causal LM whole under language_model., beside a vision model, a Q-Former, its query tokens and the
            # projection into the language model), InstructBLIP and InstructBLIP-Video (Vicuna's, Llama's, the same way); their
            # encoder-decoder text models (Flan-T5) are not read
            **{kind: (text, f"{name}ForConditionalGeneration", None, ("vision_model.", "qformer.", "query_tokens", "language_projection."), _LEGACY)
               for kind, text, name in (("blip-2", "opt", "Blip2"), ("instructblip", "llama", "InstructBlip"),
                                        ("instructblipvideo", "llama", "InstructBlipVideo"))},
            # Fuyu (Persimmon's causal LM whole under language_model., beside the image patches' linear embedding)
            "fuyu": ("persimmon", "FuyuForCausalLM", False, ("vision_embed_tokens.",), _LEGACY),
            # Emu3 (Llama's causal LM whole under text_model., its own model_type, beside the image tokenizer's VQ model; its
            # attention dropout, training's only, not built)
            "emu3": ("llama", "Emu3ForConditionalGeneration", False, ("vqmodel.",), "text_model."),
            # Nemotron 3 Nano Omni: Nemotron-H's causal LM whole (its backbone. and lm_head) under language_model.
            "nemotron_h_omni": ("nemotron_h", "NemotronH_Omni_Reasoning_V3", None,
                                ("vision_model.", "mlp1.", "sound_encoder.", "sound_projection."), _LEGACY)}
# the text models' own model_types that read as the family: EXAONE 4.5's first released one (transformers reads it as exaone4),
# Granite 4.0 Vision's and Granite Docling's (Granite 3's config), Emu3's (Llama's)
_VL_TEXT_ALIASES = {"exaone4": ("exaone4_5_text",), "granite": ("granite4_vision_text", "granite_docling_text"), "llama": ("emu3_text_model",)}
for _vl, (_text, _architecture, _tied, _beside, _where) in _VL_TEXT.items():
    FAMILIES[_vl] = dataclasses.replace(FAMILIES[_text], config_to_fmoe=_vl_text(_text), architecture=_architecture,
                                        # Qianfan-OCR's text layers as transformers writes them (its renaming of the vision encoder's
                                        # encoder.layers. undone on every key)
                                        layout_too=(r"^language_model\.model\.encoder\.layers\.", dict(prefix=("model.layers.", "model.encoder.layers.")))
                                        if _vl == "qianfan_ocr" else None,
                                        aliases=dict(tie_word_embeddings="tie_embedding") if _vl == "lfm2_vl" else {},  # LFM2-VL's own name
                                        defaults={} if _tied is None else dict(tie_word_embeddings=_tied), not_read=_beside, written_as=_text,
                                        **(dict(outer=_where) if isinstance(_where, str) else dict(prefix=_where)))
# released LLaVA-style folders: model_type -> (the architecture, how transformers' class ties the head (_listed_text), its
# default text model's model_type, what is beside the text model (not read), where the text model's keys are
# (Family.prefix: the head too under language_model., or Idefics3's and SmolVLM's under model.text_model. with the head
# at lm_head.)). Their text model is written back only as its own family (Family.written_as "text_config").
_IN_LANGUAGE_MODEL, _LLAVA_BESIDE = ("", "language_model."), ("vision_tower.", "multi_modal_projector.")
_LLAVA = {"llava": ("LlavaForConditionalGeneration", "or", "llama", _LLAVA_BESIDE, _IN_LANGUAGE_MODEL),
          "llava_next": ("LlavaNextForConditionalGeneration", False, "llama", (*_LLAVA_BESIDE, "image_newline"), _IN_LANGUAGE_MODEL),
          "llava_next_video": ("LlavaNextVideoForConditionalGeneration", "or", "llama", (*_LLAVA_BESIDE, "image_newline", "vision_resampler."),
                               _IN_LANGUAGE_MODEL),
          "llava_onevision": ("LlavaOnevisionForConditionalGeneration", "or", "qwen2", (*_LLAVA_BESIDE, "image_newline"), _IN_LANGUAGE_MODEL),
          "internvl": ("InternVLForConditionalGeneration", True, "qwen2", _LLAVA_BESIDE, _IN_LANGUAGE_MODEL),
          # ViP-LLaVA (its projector over several CLIP layers), Video-LLaVA (an image tower and a video tower)
          "vipllava": ("VipLlavaForConditionalGeneration", False, "llama", _LLAVA_BESIDE, _IN_LANGUAGE_MODEL),
          "video_llava": ("VideoLlavaForConditionalGeneration", False, "llama", ("image_tower.", "video_tower.", "multi_modal_projector."),
                          _IN_LANGUAGE_MODEL),
          **{kind: (f"{name}ForConditionalGeneration", False, "llama", ("model.vision_model.", "model.connector."), ("model.", "model.text_model."))
             for kind, name in (("idefics3", "Idefics3"), ("smolvlm", "SmolVLM"))}}
for _vl, (_architecture, _tied, _text, _beside, _where) in _LLAVA.items():
    FAMILIES[_vl] = dataclasses.replace(FAMILIES["llama"], config_to_fmoe=_listed_family, architecture=_architecture, prefix=_where, not_read=_beside,
                                        written_as="text_config")
# the folders whose text model is one of several families: model_type -> (those families, transformers' default one, how
# the head is tied: _listed_text)
_TEXT_OF = {"mistral3": (_MISTRAL3_TEXT, "mistral", "text"), **{vl: (_LLAVA_TEXT, text, tied) for vl, (_, tied, text, _, _) in _LLAVA.items()}}
# ...and those of the other folders written as their text config's family (Family.written_as "text_config"): its families
_TEXT_KINDS = {"molmo2": tuple(_MOLMO2_BLOCKS.values()), "minimax_m3_vl": ("minimax_m3_vl_text",)}
# the text families' logit scales (the text config's field), and the multimodal folders whose transformers class applies
# none to its head (Command A Vision's, Aya Vision's, Granite Speech's and Speech Plus's, the LLaVA-style ones'): there the scale reads and
# is written as 1 (_unscaled)
_LOGIT_SCALE = {"cohere2": "logit_scale", "granite": "logits_scaling"}
_HEAD_UNSCALED = {"cohere2_vision", "aya_vision", "granite_speech", "granite_speech_plus", *_LLAVA}
_MLA = (("wq", "q_proj"), ("wq_a", "q_a_proj"), ("wq_b", "q_b_proj"), ("wkv_a", "kv_a_proj_with_mqa"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj"))


def _linear_attention_keys(family: Family, cfg: TransformerConfig, p: str, q: str) -> dict[str, Tensor]:
    """A Gated DeltaNet block's mixer (linear_attn): Qwen3-Next's fused in_proj_qkvz (per key
    head its q, k, v and z rows) and in_proj_ba (per key head its b's and a's rows), or
    Qwen3.5's in_proj_qkv (q, k, v) beside in_proj_z, in_proj_b, in_proj_a, or Lara Mini's
    one in_proj (q, k, v, z, b, a); conv1d [C, 1, K] over the q, k, v channels; A_log,
    dt_bias, the gated norm (Lara Mini's out_norm), out_proj."""
    la, lin, out = p + "linear_attn.", cfg.linear_attention_config(), {}
    qkv = (lin.k_channels, lin.k_channels, lin.v_channels)  # the q, k, v channels of in_proj_qkv and of the conv
    if family.linear == "mamba2":  # Granite 4.0-H: mamba.in_proj's rows z, x, B, C, dt; conv1d's channels (and bias) x, B, C
        m, rows, channels = p + family.mamba + ".", (lin.v_channels, lin.v_channels, lin.k_channels, lin.k_channels, lin.n_v_heads), qkv[::-1]
        for j, name in enumerate(("wz", "wv", "wk", "wq", "wa")):
            out[q + "attn." + name] = Tensor((m + "in_proj.weight",), transpose=True, chunk=(j, rows))
        for j, name in enumerate("vkq"):
            out[q + f"attn.conv_{name}"] = Tensor((m + "conv1d.weight",), transpose=True, unit=1, chunk=(j, channels))
            out[q + f"attn.conv_{name}_bias"] = Tensor((m + "conv1d.bias",), chunk=(j, channels))
        out.update({q + "attn." + name: Tensor((m + name,)) for name in ("A_log", "dt_bias", "D")})
        if lin.gate_norm != "none":  # Falcon-H1's mixers may have none
            out[q + "attn.out_norm"] = Tensor((m + "norm.weight",))
        out[q + "attn.wo"] = Tensor((m + "out_proj.weight",), transpose=True)
        return out
    if family.linear == "mamba1":  # Mamba's, Jamba's: in_proj's rows x, z; conv1d over x; x_proj's rows dt, B, C; dt_proj; A_log [C, N]
        m, C, R, N = p + family.mamba + ".", lin.v_channels, lin.dt_rank, lin.k_head_dim
        for j, name in enumerate(("wv", "wz")):
            out[q + "attn." + name] = Tensor((m + "in_proj.weight",), transpose=True, chunk=(j, (C, C)))
        out[q + "attn.conv_v"] = Tensor((m + "conv1d.weight",), transpose=True, unit=1)
        out[q + "attn.conv_v_bias"] = Tensor((m + "conv1d.bias",))
        for j, name in enumerate(("wdt", "wk", "wq")):
            out[q + "attn." + name] = Tensor((m + "x_proj.weight",), transpose=True, chunk=(j, (R, N, N)))
        out[q + "attn.wa"], out[q + "attn.dt_bias"] = Tensor((m + "dt_proj.weight",), transpose=True), Tensor((m + "dt_proj.bias",))
        out.update({q + "attn." + name: Tensor((m + name,)) for name in ("A_log", "D")})
        if lin.dt_bc_norm == "rms":  # Jamba's norms' weights (Falcon Mamba's have none)
            out.update({q + f"attn.{ours}_norm": Tensor((f"{m}{ours}_layernorm.weight",)) for ours in ("dt", "b", "c")})
        out[q + "attn.wo"] = Tensor((m + "out_proj.weight",), transpose=True)
        return out
    if family.linear == "lightning":  # MiniMax: under the attention module, qkv_proj [N 3D, H] (per head its q, k, v rows)
        la = p + family.attention + "."
        for j, name in enumerate(("wq", "wk", "wv")):
            out[q + "attn." + name] = Tensor((la + "qkv_proj.weight",), transpose=True, chunk=(j, (1, 1, 1)), groups=lin.n_v_heads)
        out[q + "attn.wz"] = Tensor((la + "output_gate.weight",), transpose=True)
        out[q + "attn.out_norm"] = Tensor((la + "norm.weight",))
        out[q + "attn.wo"] = Tensor((la + "out_proj.weight",), transpose=True)
        return out
    if family.linear == "short_conv":  # LFM2: conv.in_proj [3C, H] (the rows of B, C and x), conv.conv [C, 1, K], conv.out_proj
        conv = p + "conv."
        for j, name in enumerate(("wb", "wc", "wv")):
            out[q + "attn." + name] = Tensor((conv + "in_proj.weight",), transpose=True, chunk=(j, (1, 1, 1)))
        out[q + "attn.conv_v"] = Tensor((conv + "conv.weight",), transpose=True, unit=1)
        out[q + "attn.wo"] = Tensor((conv + "out_proj.weight",), transpose=True)
        return out
    if family.linear in ("kda", "ling"):  # under the attention module, a conv per q, k, v; Kimi Linear's A_log [1, 1, N, 1], Ling's [N]
        la = p + family.attention + "."
        gates = ((("wf", "f_proj"), ("wz", "g_proj")) if lin.full_rank  # Ling's whole decay and gate projections
                 else (("wf_a", "f_a_proj"), ("wf_b", "f_b_proj"), ("wz_a", "g_a_proj"), ("wz_b", "g_b_proj")))
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wb", "b_proj"), *gates, ("wo", family.o_proj)):
            out[q + "attn." + ours] = Tensor((f"{la}{theirs}.weight",), transpose=True)
        for n in "qkv":
            out[q + f"attn.conv_{n}"] = Tensor((f"{la}{n}_conv1d.weight",), transpose=True, unit=1)
        out[q + "attn.A_log"] = Tensor((la + "A_log",), unit=(0, 1, 3) if family.linear == "kda" else None)
        out[q + "attn.dt_bias"] = Tensor((la + "dt_bias",))
        out[q + "attn.out_norm"] = Tensor((la + "o_norm.weight",))
        return out
    if family.linear == "split":  # OLMo Hybrid: a module per projection (the gate g_proj) and a conv per q, k, v
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wz", "g_proj"), ("wb", "b_proj"), ("wa", "a_proj")):
            out[q + "attn." + ours] = Tensor((f"{la}{theirs}.weight",), transpose=True)
        for n in "qkv":
            out[q + f"attn.conv_{n}"] = Tensor((f"{la}{n}_conv1d.weight",), transpose=True, unit=1)
        out[q + "attn.A_log"], out[q + "attn.dt_bias"] = Tensor((la + "A_log",)), Tensor((la + "dt_bias",))
        out[q + "attn.out_norm"] = Tensor((la + "o_norm.weight",))
        out[q + "attn.wo"] = Tensor((la + "o_proj.weight",), transpose=True)
        return out
    norm = "norm"
    if family.linear == "fused":
        rows = (*qkv, lin.v_channels, lin.n_v_heads, lin.n_v_heads)
        for j, name in enumerate(("wq", "wk", "wv", "wz", "wb", "wa")):
            out[q + "attn." + name] = Tensor((la + "in_proj.weight",), transpose=True, chunk=(j, rows))
        norm = "out_norm"
    elif family.linear == "qkvz":
        r = lin.n_v_heads // lin.n_k_heads
        rows = (lin.k_head_dim, lin.k_head_dim, r * lin.v_head_dim, r * lin.v_head_dim)
        for j, name in enumerate(("wq", "wk", "wv", "wz")):
            out[q + "attn." + name] = Tensor((la + "in_proj_qkvz.weight",), transpose=True, chunk=(j, rows), groups=lin.n_k_heads)
        for j, name in enumerate(("wb", "wa")):
            out[q + "attn." + name] = Tensor((la + "in_proj_ba.weight",), transpose=True, chunk=(j, (r, r)), groups=lin.n_k_heads)
    else:
        for j, name in enumerate(("wq", "wk", "wv")):
            out[q + "attn." + name] = Tensor((la + "in_proj_qkv.weight",), transpose=True, chunk=(j, qkv))
        for ours, theirs in (("wz", "in_proj_z"), ("wb", "in_proj_b"), ("wa", "in_proj_a")):
            out[q + "attn." + ours] = Tensor((f"{la}{theirs}.weight",), transpose=True)
    for j, name in enumerate(("conv_q", "conv_k", "conv_v")):
        out[q + "attn." + name] = Tensor((la + "conv1d.weight",), transpose=True, unit=1, chunk=(j, qkv))
    out[q + "attn.A_log"], out[q + "attn.dt_bias"] = Tensor((la + "A_log",)), Tensor((la + "dt_bias",))
    out[q + "attn.out_norm"] = Tensor((la + norm + ".weight",))
    out[q + "attn.wo"] = Tensor((la + "out_proj.weight",), transpose=True)
    return out


def _block_keys(family: Family, cfg: TransformerConfig, p: str, q: str, moe: bool, rope: bool = True, linear: bool = False,
                index_shared: bool = False, layer: Optional[int] = None) -> dict[str, Tensor]:
    """One transformer block: HF prefix p ("model.layers.{i}."), fmoe prefix q; rope=False:
    a NoPE block (its q/k norms only with cfg.nope_qk_norm); linear: a Gated DeltaNet block;
    layer: the trunk block's index (its sinks and kv heads; None: an MTP block)."""
    out = _linear_attention_keys(family, cfg, p, q) if linear else _attention_keys(family, cfg, p, q, rope, index_shared, layer)
    if linear and cfg.parallel_hybrid:  # Falcon-H1's attention beside the mixer, under the attention module
        attention = _attention_keys(family, cfg, p, q, rope, index_shared, layer)
        out.update({q + "attn_beside." + name[len(q + "attn."):]: spec for name, spec in attention.items() if name.startswith(q + "attn.")})
    pre, post = cfg.block_norms(linear)  # OLMo Hybrid's linear blocks: pre-norm beside post-norm attention blocks
    if pre and post:  # a sandwich block (AFMoE)
        if family.sandwich is None:
            raise ValueError("model: pre- and post-norms together (a sandwich block) have no key names in this family")
        for ours, theirs in zip(("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"), family.sandwich):
            out[q + ours + ".weight"] = Tensor((p + theirs + ".weight",))
    elif post:  # OLMo 2's post-norm block: post_attention_layernorm is the attention output's norm
        for ours, theirs in zip(("attn_post_norm", "mlp_post_norm"), family.post_norms):
            out[q + ours + ".weight"] = Tensor((p + theirs + ".weight",))
    elif pre:
        norms = family.parallel_norm_names if cfg.parallel_norms and family.parallel_norm_names else family.norms
        out.update(_norm_keys(p + norms[0], q + "attn_norm", cfg, gated=True))
        if not cfg.parallel_blocks or cfg.parallel_norms:  # a parallel block's MLP reads the attention's norm (GPT-NeoX's: its own)
            out.update(_norm_keys(p + norms[1], q + "mlp_norm", cfg, gated=moe))
    if moe and cfg.moe_out_norm:  # the MoE block's output norm (A.X-K1's)
        out[q + "mlp_post_norm.weight"] = Tensor((p + family.moe_out_norm + ".weight",))
    mlp = p + family.moe + "." if family.moe else p  # Gemma 4's MoE is the layer's own: its router and experts under it
    if moe:
        out[q + "mlp.router"] = Tensor((mlp + family.router,), transpose=family.router_transposed)
        if cfg.router_norm:  # Gemma 4's router scale and scale per expert
            out[q + "mlp.router_norm"] = Tensor((mlp + family.router_norm,))
        if cfg.router_expert_scale:
            out[q + "mlp.expert_scale"] = Tensor((mlp + family.expert_scale,))
        if cfg.router_bias:  # gpt-oss: the router module's bias
            out[q + "mlp.router_bias"] = Tensor((mlp + family.router.removesuffix("weight") + "bias",))
    if moe and family.fused == "rows":  # one [E F, H] key per matrix, expert after expert (DBRX's w1, v1 and w2: the down's [F, H] rows)
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.experts):
            out[q + "mlp.experts." + ours] = Tensor((mlp + theirs,), transpose=ours != "w_down", experts=cfg.n_experts)
    elif moe and family.fused == "stacks_out":  # one stack of linear weights per matrix, [E, F, H] / [E, F, H] / [E, H, F] (Step 3.5's)
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.experts):
            out[q + "mlp.experts." + ours] = Tensor((mlp + theirs,), transpose=True)
    elif moe and family.fused:  # the experts' stacks (Family.fused), each bias beside its stack (gpt-oss)
        gate_up, _, down = (mlp + name for name in family.experts)
        stored_linear = family.fused == "halves_out"  # [E, 2F, H] / [E, H, F]: linear weights, transposed

        def half(i: int) -> dict:
            return dict(part=(i, 2)) if family.fused == "interleaved" else dict(chunk=(i, (1, 1)), transpose=stored_linear)

        out[q + "mlp.experts.w_gate"] = Tensor((gate_up,), **half(0))
        out[q + "mlp.experts.w_up"] = Tensor((gate_up,), **half(1))
        out[q + "mlp.experts.w_down"] = Tensor((down,), transpose=stored_linear)
        if cfg.expert_biases:
            out[q + "mlp.experts.b_gate"] = Tensor((gate_up + "_bias",), **half(0))
            out[q + "mlp.experts.b_up"] = Tensor((gate_up + "_bias",), **half(1))
            out[q + "mlp.experts.b_down"] = Tensor((down + "_bias",))
    elif moe:
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.experts):
            if ours != "w_gate" or cfg.mlp_act not in PLAIN_ACTS:  # experts without a gate (Nemotron 3's) have none
                out[q + "mlp.experts." + ours] = Tensor(tuple(f"{mlp}experts.{e}.{theirs}.weight" for e in range(cfg.n_experts)),
                                                        transpose=True, stacked=True)
    if moe and cfg.moe_out_bias:  # a bias on the MoE block's output (JetMoE's), under the block
        out[q + "mlp.out_bias"] = Tensor((mlp + "bias",))
    if moe and cfg.moe_latent:  # a latent MoE's [L, H] and [H, L] linear weights
        for ours, theirs in zip(("latent_in", "latent_out"), family.latent):
            out[q + "mlp." + ours] = Tensor((f"{mlp}{theirs}.weight",), transpose=True)
    if moe and cfg.moe_latent_norm:  # Muse Spark's norm of the experts' input, and of each expert's output
        out[q + "mlp.latent_norm"] = Tensor((f"{mlp}{family.latent_norm}.weight",))
    if moe and cfg.expert_out_norm:
        out[q + "mlp.expert_out_norm"] = Tensor((f"{mlp}{family.expert_out_norm}.weight",))
    hashed = moe and layer is not None and cfg.is_hash(layer)  # a hashed block: its table, and no correction bias (DeepSeek-V4's)
    if hashed:
        out[q + "mlp.hash_table"] = Tensor((mlp + family.hash_table,))
    if moe and cfg.expert_bias and not hashed:  # HF's e_score_correction_bias: fmoe's expert_bias buffer, whatever the experts' layout
        bias = p + family.correction_bias[3:] if family.correction_bias.startswith("../") else mlp + family.correction_bias
        out[q + "mlp.expert_bias"] = Tensor((bias,), unit=family.correction_bias_unit, row=family.correction_bias_row)
    if moe and cfg.shared_size and family.shared_beside:  # Granite: [2Fs, H] gate then up, [H, Fs], beside the MoE block
        shared = p + family.shared + "."
        out[q + "mlp.shared.w_gate"] = Tensor((shared + "input_linear.weight",), transpose=True, chunk=(0, (1, 1)))
        out[q + "mlp.shared.w_up"] = Tensor((shared + "input_linear.weight",), transpose=True, chunk=(1, (1, 1)))
        out[q + "mlp.shared.w_down"] = Tensor((shared + "output_linear.weight",), transpose=True)
    elif moe and cfg.shared_size and family.shared_gate_up:  # [2Fs, H]: the gate's rows, then the up's, under the MoE block
        shared = f"{mlp}{family.shared}."
        for j, ours in enumerate(("w_gate", "w_up")):
            out[q + "mlp.shared." + ours] = Tensor((shared + "gate_up_proj.weight",), transpose=True, chunk=(j, (1, 1)))
        out[q + "mlp.shared.w_down"] = Tensor((shared + "down_proj.weight",), transpose=True)
    elif moe and cfg.shared_size:  # the shared experts inside the MoE block
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.dense_names):
            if ours != "w_gate" or cfg.mlp_act not in PLAIN_ACTS:
                out[q + "mlp.shared." + ours] = Tensor((f"{mlp}{family.shared}.{theirs}.weight",), transpose=True)
        if cfg.shared_gate:
            out[q + "mlp.shared_gate"] = Tensor((mlp + "shared_expert_gate.weight",), unit=0)
    if moe and cfg.dense_beside_moe:  # Gemma 4's dense MLP beside the MoE, and their norms
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.dense_names):
            out[q + "beside." + ours] = Tensor((f"{p}{family.dense}.{theirs}.weight",), transpose=True)
        for ours, theirs in zip(("dense_post_norm", "moe_norm", "moe_post_norm"), family.beside_norms):
            out[q + ours + ".weight"] = Tensor((p + theirs + ".weight",))
    if cfg.layer_scalars:  # Gemma 4's scale of the layer's output (a buffer)
        out[q + "layer_scalar"] = Tensor((p + "layer_scalar",))
    if moe and layer is not None and cfg.shortcut(layer) == "out":  # the dense MLP beside a shortcut pair's MoE
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.dense_names):
            out[q + "dense." + ours] = Tensor((f"{p}{family.dense}.{theirs}.weight",), transpose=True)
    if not moe and family.dense_gate_up:  # [2F, H]: the gate's F rows, then the up's (Granite 4.0-H's input_linear)
        gate_up, down = family.gate_up
        out[q + "mlp.w_gate"] = Tensor((f"{p}{family.dense}.{gate_up}.weight",), transpose=True, chunk=(int(family.up_first), (1, 1)))
        out[q + "mlp.w_up"] = Tensor((f"{p}{family.dense}.{gate_up}.weight",), transpose=True, chunk=(1 - int(family.up_first), (1, 1)))
        out[q + "mlp.w_down"] = Tensor((f"{p}{family.dense}.{down}.weight",), transpose=True)
    elif not moe:
        mlp = f"{p}{family.dense}." if family.dense else p  # OPT's fc1 / fc2: under the layer itself (Family.dense "")
        for ours, theirs in zip(("w_gate", "w_up", "w_down"), family.dense_names):
            if ours != "w_gate" or cfg.mlp_act not in PLAIN_ACTS:  # an MLP without a gate (Arcee's) has none
                out[q + "mlp." + ours] = Tensor((f"{mlp}{theirs}.weight",), transpose=not family.conv1d)
                if cfg.mlp_bias:  # Llama's mlp_bias: each projection's bias
                    out[q + "mlp.b_" + ours[2:]] = Tensor((f"{mlp}{theirs}.bias",))
        if cfg.mlp_act == "xielu":  # its learned scalars, [1] each (Apertus's act_fn)
            for name in ("alpha_p", "alpha_n"):
                out[q + "mlp.xielu_" + name] = Tensor((f"{p}{family.dense}.act_fn.{name}",))
    if cfg.residual_gates:  # Muse Spark's residual gates, [H] each
        for ours, theirs in zip(("attn_residual_gate", "mlp_residual_gate"), family.residual_gates):
            out[q + ours + ".gate"] = Tensor((p + theirs + ".gate",))
    if cfg.hyper_connections:  # the streams' weights of the attention and of the MLP (Family.hyper)
        for ours, theirs in zip(("attn_hc.", "mlp_hc."), family.hyper[:2]):
            out.update({q + ours + name: Tensor((p + theirs + name,)) for name in ("fn", "base", "scale")})
    return out


def _q_gate_rows(cfg: TransformerConfig) -> tuple[int, int]:
    """Each head's rows in A.X-K2's fused q_b_proj: its query's (head_dim), then its gate's."""
    return cfg.head_dim, 1 if cfg.attn_gate_per_head else cfg.v_head_dim


def _norm_keys(theirs: str, ours: str, cfg: TransformerConfig, gated: bool) -> dict[str, Tensor]:
    """A pre-norm's weight; where norm_gate_rank gates it (gated: an attention's pre-norm, or a
    MoE block's MLP's) A.X-K2's names: the norm's under norm., the gate's [H, r] / [r, H] as
    the linear weights W_down [r, H] / W_up [H, r]."""
    if not (gated and cfg.norm_gate_rank):
        return {ours + ".weight": Tensor((theirs + ".weight",))}
    return {ours + ".weight": Tensor((theirs + ".norm.weight",)), ours + ".gate_down": Tensor((theirs + ".W_down.weight",), transpose=True),
            ours + ".gate_up": Tensor((theirs + ".W_up.weight",), transpose=True)}


def _attention_keys(family: Family, cfg: TransformerConfig, p: str, q: str, rope: bool, index_shared: bool = False,
                    layer: Optional[int] = None) -> dict[str, Tensor]:
    """An attention block's mixer (family.attention): grouped-query or multi-latent attention
    with their biases, sinks, gate and q/k norms, and DeepSeek sparse attention's indexer
    (none in a block of index_shared_layers)."""
    out = {}
    attn = p + family.attention + "."
    if cfg.kv_rank is not None:  # multi-latent attention
        q_weights = ("wq",) if cfg.q_rank is None else ("wq_a", "wq_b")  # a full-rank q, or its low-rank pair
        for ours, theirs in _MLA:
            if not ours.startswith("wq") or ours in q_weights:
                out[q + "attn." + ours] = Tensor((f"{attn}{family.o_proj if ours == 'wo' else theirs}.weight",), transpose=True)
        if cfg.q_rank is not None:
            out[q + "attn.q_a_norm"] = Tensor((attn + "q_a_layernorm.weight",))
        if cfg.attn_gate_on_q:  # A.X-K2's q_b_proj: each head's query rows, then its gate rows
            out[q + "attn.wq_b"] = Tensor((attn + "q_b_proj.weight",), transpose=True, chunk=(0, _q_gate_rows(cfg)), groups=cfg.n_heads)
        out[q + "attn.kv_a_norm"] = Tensor((attn + "kv_a_layernorm.weight",))
        if cfg.index_topk is not None and not index_shared:  # DeepSeek sparse attention's indexer
            index = attn + "indexer."
            for ours, theirs in (("index_wq", "wq_b"), ("index_wk", "wk"), ("index_w", "weights_proj")):
                out[q + "attn." + ours] = Tensor((f"{index}{theirs}.weight",), transpose=True)
            out[q + "attn.index_k_norm"] = Tensor((index + "k_norm.weight",))
            out[q + "attn.index_k_bias"] = Tensor((index + "k_norm.bias",))
    elif cfg.moa_experts is not None:  # JetMoE's mixture of attention heads: the experts' stacks, kv_proj's keys then values
        experts = attn + "experts."
        out[q + "attn.wq"] = Tensor((experts + "input_linear.weight",), transpose=True)
        out[q + "attn.wo"] = Tensor((experts + "output_linear.weight",), transpose=True)
        out[q + "attn.moa_router"] = Tensor((experts + "router.layer.weight",), transpose=True)
        for j, ours in enumerate(("wk", "wv")):
            out[q + "attn." + ours] = Tensor((attn + "kv_proj.weight",), transpose=True, chunk=(j, (1, 1)))
    elif family.qkv is not None:  # q, k and v: the rows of one module, in that order (qkv_per_head: each head's in turn)
        G = cfg.kv_heads(layer)
        rows = (cfg.heads(layer) * cfg.head_dim, G * cfg.head_dim, G * (cfg.v_head_dim or cfg.head_dim))
        groups = G if family.qkv_per_head else family.qkv_groups or 1  # each group's heads' q, k and v (one group: every q, then k, v)
        split = dict(chunk=(0, tuple(rows["qkv".index(p)] // groups for p in family.qkv_order)), groups=groups)
        for name in ("q", "k", "v"):
            part = dict(split, chunk=(family.qkv_order.index(name), split["chunk"][1]))
            out[q + "attn.w" + name] = Tensor((f"{attn}{family.qkv}.weight",), transpose=not family.conv1d, **part)
            if cfg.qkv_bias:
                out[q + "attn.b" + name] = Tensor((f"{attn}{family.qkv}.bias",), **part)
        out[q + "attn.wo"] = Tensor((f"{attn}{family.o_proj}.weight",), transpose=not family.conv1d)
    else:
        k_eq_v = cfg.global_k_eq_v and (layer is None or not cfg.is_local(layer))  # Gemma 4's global layers: no v_proj
        for ours, theirs in (*zip(("wq", "wk", "wv"), family.qkv_names), ("wo", family.o_proj)):
            if not (ours == "wv" and (k_eq_v or cfg.kv_shared)) and not (ours == "wq" and cfg.q_rank is not None):
                out[q + "attn." + ours] = Tensor((f"{attn}{theirs}.weight",), transpose=True)
        if cfg.q_rank is not None:  # the queries from a normed q latent (DeepSeek-V4's q_a_proj, q_a_norm, q_b_proj)
            down, norm, up = family.q_latent
            out[q + "attn.wq_a"] = Tensor((f"{attn}{down}.weight",), transpose=True)
            out[q + "attn.q_a_norm"] = Tensor((f"{attn}{norm}.weight",))
            out[q + "attn.wq_b"] = Tensor((f"{attn}{up}.weight",), transpose=True)
        if cfg.o_groups is not None:  # the grouped output projection: [g r, N Dv / g] rows, group by group, read as wo_a [g, N Dv / g, r]
            out[q + "attn.wo_a"] = Tensor((f"{attn}{family.o_a_proj}.weight",), transpose=True, experts=cfg.o_groups)
    gate_in_q = cfg.attn_gate and family.gate_in_q and cfg.kv_rank is None
    if gate_in_q:  # Qwen3-Next: q_proj's rows are per head its query's D rows, then its gate's
        out[q + "attn.wq"] = Tensor((attn + "q_proj.weight",), transpose=True, chunk=(0, (1, 1)), groups=cfg.heads(layer))
    if cfg.qkv_bias and family.qkv is None:
        for ours, theirs in zip(("bq", "bk", "bv"), family.qkv_names):
            out[q + "attn." + ours] = Tensor((f"{attn}{theirs}.bias",))
    if cfg.o_bias:  # (JetMoE's: the attention experts' bias)
        out[q + "attn.bo"] = Tensor((f"{attn}experts.bias" if cfg.moa_experts is not None else f"{attn}{family.o_proj}.bias",))
    if cfg.has_sinks(layer):
        out[q + "attn.sinks"] = Tensor((attn + family.sinks,))
    if gate_in_q:
        out[q + "attn.wg"] = Tensor((attn + "q_proj.weight",), transpose=True, chunk=(1, (1, 1)), groups=cfg.heads(layer))
    elif cfg.attn_gate_on_q:
        out[q + "attn.wg"] = Tensor((attn + "q_b_proj.weight",), transpose=True, chunk=(1, _q_gate_rows(cfg)), groups=cfg.n_heads)
    elif cfg.attn_gate:  # gated attention's own gate module (AFMoE's gate_proj, Laguna's g_proj)
        out[q + "attn.wg"] = Tensor((attn + family.gate_proj + ".weight",), transpose=True)
    if cfg.attn_gate_bias:  # its bias per head (Beam's gate_bias)
        out[q + "attn.bg"] = Tensor((attn + "gate_bias",))
    if cfg.qk_norm == "head_k" and (rope or cfg.nope_qk_norm):  # the keys' weights alone (DeepSeek-V4's kv_norm)
        out[q + "attn.k_norm"] = Tensor((f"{attn}{family.qk_norms[1]}.weight",))
    if cfg.qk_norm in ("head", "proj", "head_layer", "layer") and (rope or cfg.nope_qk_norm):  # weighted norms ("rms" has none)
        parts = ("weight", "bias") if cfg.qk_norm_bias else ("weight",)  # the LayerNorms' biases beside (Chameleon's, Persimmon's)
        for part in parts:
            suffix = "" if part == "weight" else "_bias"
            if family.qk_norm_modules:  # each head's weight [D] its own key, stacked into fmoe's [N, D]
                for ours, theirs, heads in (("q_norm", family.qk_norms[0], cfg.n_heads), ("k_norm", family.qk_norms[1], cfg.n_kv_heads)):
                    out[q + "attn." + ours + suffix] = Tensor(tuple(f"{attn}{theirs}.norms.{h}.{part}" for h in range(heads)), stacked=True)
            else:
                out[q + "attn.q_norm" + suffix] = Tensor((f"{attn}{family.qk_norms[0]}.{part}",))
                out[q + "attn.k_norm" + suffix] = Tensor((f"{attn}{family.qk_norms[1]}.{part}",))
    if layer is not None and (cfg.is_compressed(layer) or cfg.is_csa(layer)):  # compressed attention's compressor (DeepSeek-V4's HCA, CSA)
        for ours, theirs in zip(("compress_wkv", "compress_wg", "compress_bias", "compress_norm"), family.compressor):
            out[q + "attn." + ours] = Tensor((attn + theirs,), transpose=ours in ("compress_wkv", "compress_wg"))
    if layer is not None and cfg.is_csa(layer):  # compressed sparse attention's indexer: its queries, head weights and own compressor
        index = attn + family.csa_indexer
        for ours, theirs in zip(("index_compress_wkv", "index_compress_wg", "index_compress_bias", "index_compress_norm"), family.compressor):
            out[q + "attn." + ours] = Tensor((index + theirs,), transpose=ours in ("index_compress_wkv", "index_compress_wg"))
        for ours, theirs in (("index_wq", "wq_b.weight"), ("index_w", "weights_proj.weight")):
            out[q + "attn." + ours] = Tensor((index + theirs,), transpose=True)
    if cfg.is_index_blocks(layer):  # block-sparse attention's indexer (MiniMax-M3's)
        index = attn + family.block_index
        for ours, theirs in (("index_wq", "q_proj"), ("index_wk", "k_proj"), ("index_q_norm", "q_norm"), ("index_k_norm", "k_norm")):
            out[q + "attn." + ours] = Tensor((f"{index}{theirs}.weight",), transpose=ours.startswith("index_w"))
    return out


def mtp_layer(cfg: TransformerConfig, d: int, family: Optional[Family] = None) -> str:
    """The HF prefix of MTP depth d (1, 2, ...): the layers after the trunk's (in `family`'s
    folders, Family.prefix: GLM-4.5V's under model.language_model.)."""
    key = f"model.layers.{cfg.n_layers + d - 1}."
    return key if family is None else family.renamed(key)


def _holds_mtp(family: Family, cfg: TransformerConfig, d: int, files) -> bool:
    """Whether a folder of checkpoint keys `files` holds MTP depth d: DeepSeek-V3's layer
    n_layers + d - 1 (its eh_proj), or Qwen3-Next's one module (mtp.fc, depth 1)."""
    if family.mtp_module:
        return d == 1 and "mtp.fc.weight" in files
    return mtp_layer(cfg, d, family) + "eh_proj.weight" in files


def _mtp_count_field(model_type: str) -> Optional[str]:
    """config.json's count of the MTP modules that a folder of model_type holds and fmoe
    writes: num_nextn_predict_layers (DeepSeek-V3's layout; A.X-K1's configs have none),
    mtp_num_hidden_layers (Qwen3-Next's module); None for the other families."""
    family = FAMILIES[model_type]
    if family.mtp and model_type not in _NO_MTP_COUNT:
        return "num_nextn_predict_layers"
    return "mtp_num_hidden_layers" if family.mtp_module else None


def _stacked_experts(family: Family, keys) -> Family:
    """The family as a folder of checkpoint `keys` stores it: with Family.stacks_too and the
    experts stored as stacks (a key ending in experts.gate_up_proj), its stacked layout
    ("halves_out", Granite's and transformers' [E, 2F, H] / [E, H, F]); with Family.dense_too
    and a dense MLP under that name, that name for the dense blocks; with Family.hyper_head_too
    and the head's hyper-connection weights under that prefix, that prefix; with
    Family.layout_too and a key of its pattern, its fields; the family itself otherwise."""
    if family.stacks_too and any(key.endswith(".experts.gate_up_proj") for key in keys):
        family = dataclasses.replace(family, fused="halves_out", experts=_STACKS)
    if family.dense_too and any(key.endswith(f".{family.dense_too}.gate_proj.weight") for key in keys):
        family = dataclasses.replace(family, dense=family.dense_too)
    if family.hyper_head_too and any(key.startswith(family.hyper_head_too) for key in keys):
        family = dataclasses.replace(family, hyper=(*family.hyper[:2], family.hyper_head_too))
    if family.layout_too and any(re.search(family.layout_too[0], key) for key in keys):
        family = dataclasses.replace(family, **family.layout_too[1])
    return family


def _stacks_by_shape(family: Family, cfg: TransformerConfig, files: dict[str, Path]) -> Family:
    """A Family.stacks_by_shape family as the folder of `files` stores its experts: "halves_out",
    transformers' own layout, where the first MoE block's gate_up_proj is [E, 2F, H] (or, where
    2F = H and that shape says nothing, its down_proj [E, H, F]); the family as it is (the
    released [E, H, 2F] / [E, F, H]) otherwise, or where the key is missing (the load names it)."""
    layer = next((i for i in range(cfg.n_layers) if cfg.is_moe(i)), None)
    if not family.stacks_by_shape or layer is None:
        return family
    gate_up, _, down = (family.renamed(f"model.layers.{layer}.{family.moe}.{name}") for name in family.experts)
    F, H = cfg.ffn_expert, cfg.hidden
    key, transformers_shape = (gate_up, (2 * F, H)) if 2 * F != H else (down, (H, F))
    if key not in files:
        return family
    safe_open = safetensors_module().safe_open

    with safe_open(files[key], "pt") as f:
        stored = tuple(f.get_slice(key).get_shape()[1:])
    return dataclasses.replace(family, fused="halves_out") if stored == transformers_shape else family


def key_map(family: Family, cfg: TransformerConfig) -> dict[str, Tensor]:
    """Every fmoe parameter (and expert-bias buffer) name -> its Tensor in the HF
    checkpoint, in HF's key order. MTP depth d (family.mtp) is the layer n_layers + d - 1:
    enorm, hnorm, eh_proj, a block, shared_head.norm (its copies of the embedding and the
    head are mtp_copies'); with family.mtp_module, depth 1 is Qwen3-Next's module under mtp."""
    out = {"embed": Tensor((family.embed, family.embed_too), cat=True) if family.embed_too else Tensor((family.embed,))}
    if cfg.abs_positions:  # learned absolute positions (GPT-Neo's wpe)
        if family.pos_embed is None:
            raise ValueError("model: abs_positions, learned absolute positions, which this family's checkpoints do not hold")
        out["pos_embed"] = Tensor((family.pos_embed,))
    if cfg.embed_norm and cfg.norm_weights and cfg.norm_kind("embed") != "unit":  # the embeddings' norm, with weights (BLOOM's)
        if family.embed_norm is None:
            raise ValueError("model: embed_norm with weights, a norm of the embeddings which this family's checkpoints do not hold")
        out["embed_norm.weight"] = Tensor((family.embed_norm,))
    if family.pairs and not cfg.shortcut_moe:
        raise ValueError("model: this family's layers are shortcut pairs of blocks (shortcut_moe=True)")
    for i, (p_mixer, p_mlp) in enumerate(_layer_prefixes(family, cfg)):
        q, p = f"blocks.{i}.", p_mixer or p_mlp
        block = _block_keys(family, cfg, p, q, cfg.is_moe(i), rope=not cfg.is_nope(i), linear=cfg.is_linear(i),
                            index_shared=cfg.is_index_shared(i), layer=i)
        if family.pairs:
            block = {name: dataclasses.replace(spec, keys=tuple(_sublayer(family, key, p, i % 2) for key in spec.keys)) for name, spec in block.items()}
        if p_mixer is None:  # a block without a mixer (cfg.mixer_free_layers)
            block = {name: spec for name, spec in block.items() if not name.startswith(q + "attn")}
        if p_mlp is None:  # a block without an MLP (cfg.mlp_free_layers)
            block = {name: spec for name, spec in block.items() if not name.startswith(q + "mlp")}
        elif p_mlp != p:  # the MLP's own layer (Family.single_sublayer)
            block = {name: dataclasses.replace(spec, keys=tuple(p_mlp + key[len(p):] for key in spec.keys)) if name.startswith(q + "mlp") else spec
                     for name, spec in block.items()}
        out.update(block)
    if cfg.hyper_connections:  # the streams' last collapse
        out.update({"hc_head." + name: Tensor((family.hyper[2] + name,)) for name in ("fn", "base", "scale")})
    out["norm.weight"] = Tensor((family.final_norm,))
    if not cfg.tie_embeddings:
        out["head"] = Tensor((family.head,))
    if cfg.head_bias:
        out["head_bias"] = Tensor((family.head[:-len("weight")] + "bias",))
    for d in range(1, cfg.mtp_depth + 1 if family.mtp else 1):  # other families: MTP modules start fresh
        p, q = mtp_layer(cfg, d), f"mtp.{d - 1}."
        out[q + "emb_norm.weight"] = Tensor((p + "enorm.weight",))
        out[q + "hidden_norm.weight"] = Tensor((p + "hnorm.weight",))
        out[q + "proj"] = Tensor((p + "eh_proj.weight",), transpose=True)
        out.update(_block_keys(family, cfg, p, q + "block.", any(cfg.is_moe(i) for i in range(cfg.n_layers))))
        if cfg.mtp_norm:
            out[q + "out_norm.weight"] = Tensor((p + "shared_head.norm.weight",))
    if family.mtp_module and cfg.mtp_depth:  # Qwen3-Next's one MTP module: [pre_fc_norm_embedding(emb); pre_fc_norm_hidden(h)] fc, a block, norm
        if cfg.mtp_depth > 1:
            raise ValueError(f"model: mtp_depth = {cfg.mtp_depth}; this family's checkpoints hold one MTP module (mtp.), its depth 1")
        q = "mtp.0."
        out[q + "emb_norm.weight"] = Tensor(("mtp.pre_fc_norm_embedding.weight",))
        out[q + "hidden_norm.weight"] = Tensor(("mtp.pre_fc_norm_hidden.weight",))
        out[q + "proj"] = Tensor(("mtp.fc.weight",), transpose=True)
        out.update(_block_keys(family, cfg, "mtp.layers.0.", q + "block.", any(cfg.is_moe(i) for i in range(cfg.n_layers))))
        if cfg.mtp_norm:
            out[q + "out_norm.weight"] = Tensor(("mtp.norm.weight",))
    if not cfg.norm_weights:  # weightless norms (NanoChat's): no keys for them
        out = {name: spec for name, spec in out.items() if not name.endswith("norm.weight")}
    unit = {role for role in ("attn_post", "mlp_post", "final") if cfg.norm_kind(role) == "unit"}  # norm_overrides' weightless norms
    if unit:
        out = {name: spec for name, spec in out.items()
               if not (name == "norm.weight" and "final" in unit) and not any(name.endswith(f".{role}_norm.weight") for role in unit)}
    if cfg.norm_bias:  # each LayerNorm's bias beside its weight (Phi-3.5-MoE's)
        out = {n: s for name, spec in out.items()
               for n, s in [(name, spec)] + ([(name[:-len("weight")] + "bias", Tensor((spec.keys[0][:-len("weight")] + "bias",)))]
                                             if name.endswith("norm.weight") else [])}
    if family.prefix != ("", "") or family.outer:
        out = {name: dataclasses.replace(spec, keys=tuple(family.renamed(key) for key in spec.keys)) for name, spec in out.items()}
    return out


def _layer_prefixes(family: Family, cfg: TransformerConfig) -> list[tuple[Optional[str], Optional[str]]]:
    """Each trunk block's HF layer prefixes: its mixer's and its MLP's (None: a block without
    an MLP, cfg.mlp_free_layers, or without a mixer, cfg.mixer_free_layers). Layer i holds
    block i whole; Family.pairs' layer j blocks 2j and 2j + 1; Family.single_sublayer's
    layers one sublayer each (Nemotron-H's), block i's MLP the layer after its mixer's."""
    out, layer = [], 0
    for i in range(cfg.n_layers):
        mixer, mlp = not cfg.is_mixer_free(i), not cfg.is_mlp_free(i)
        if family.single_sublayer:
            out.append((f"model.layers.{layer}." if mixer else None, f"model.layers.{layer + mixer}." if mlp else None))
            layer += mixer + mlp
        else:
            p = f"model.layers.{i // 2 if family.pairs else i}."
            out.append((p if mixer else None, p if mlp else None))
    return out


def _sublayer(family: Family, key: str, p: str, s: int) -> str:
    """A key under layer prefix p as Family.pairs stores sublayer s's: its attention, pre-norms
    and dense MLP as `<name>.{s}`; the MoE's as they are."""
    name, _, rest = key[len(p):].partition(".")
    return f"{p}{name}.{s}.{rest}" if name in (family.attention, *family.norms, family.dense) else key


def zero_expert_keys(family: Family, cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The keys (and their shapes) of the unused zero-expert gate and up projections that a
    Family.zero_expert_rows family's folders hold: not read, written as zeros (save_pretrained;
    not where the folder the model came from had none)."""
    if not family.zero_expert_rows:
        return {}
    out = {}
    for i in range(cfg.n_layers):
        if cfg.is_moe(i):
            mlp = f"model.layers.{i // 2 if family.pairs else i}.{family.moe}."
            for e in range(cfg.n_experts, cfg.n_choices):
                for name in family.experts[:2]:
                    out[family.renamed(f"{mlp}experts.{e}.{name}.weight")] = (cfg.ffn_expert, cfg.hidden)
    return out


def mtp_copies(family: Family, cfg: TransformerConfig, *, final_norm: bool = False) -> dict[str, str]:
    """HF key -> fmoe parameter for the copies of the embedding and the output head each
    MTP layer carries in DeepSeek-V3's layout (fmoe shares them: read nowhere, written on
    export). final_norm (the export): also, for MTP modules on the final norm (mtp_norm=False),
    each layer's shared_head.norm as a copy of it; never read, so that a checkpoint's own
    MTP norm is not taken for one."""
    out = {}
    if family.mtp_module and cfg.mtp_depth and final_norm and not cfg.mtp_norm:  # Qwen3-Next's module on the final norm
        out["mtp.norm.weight"] = "norm.weight"
    for d in range(1, cfg.mtp_depth + 1 if family.mtp else 1):
        p = mtp_layer(cfg, d, family)
        out[p + "embed_tokens.weight"] = "embed"
        out[p + "shared_head.head.weight"] = "embed" if cfg.tie_embeddings else "head"
        if final_norm and not cfg.mtp_norm:
            out[p + "shared_head.norm.weight"] = "norm.weight"
    return out


# ------------------------------------------------------------------------------ files
def _weight_files(path: Path) -> dict[str, Path]:
    """HF key -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, RecursionError, KeyError, TypeError) as err:
            raise ValueError(f"path: {str(index)!r} is not a safetensors index (a JSON object with its weight_map): "
                             f"{type(err).__name__}: {err}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"path: {str(index)!r}: weight_map is a {type(weight_map).__name__}, expected an object of names to files")
        outside = sorted({f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f or f in (".", "..")}, key=str)
        if outside:  # a shard is a file of the folder: a path would read weights from elsewhere on this machine
            raise ValueError(f"path: {str(index)!r} names weight files that are not files of the folder: {outside[:3]}")
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} has no model.safetensors or model.safetensors.index.json")
    safe_open = safetensors_module().safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def config_dtype(hf: dict) -> torch.dtype:
    """The dtype a config.json names for its weights ("dtype", or the older "torch_dtype";
    float32 when it names none); a ValueError naming the field for a name that is not a torch
    floating dtype's ("auto", "float8", 5: an AttributeError of torch's before)."""
    field = "dtype" if hf.get("dtype") else "torch_dtype"
    named = hf.get(field) or "float32"
    dtype = getattr(torch, named.removeprefix("torch."), None) if isinstance(named, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"config.json: {field} = {named!r} is not supported (a torch floating dtype's name: float32, bfloat16, float16, ...)")
    return dtype


def is_hf_folder(path) -> bool:
    """Whether path is a Hugging Face folder (its config.json names a model_type; an fmoe
    run's config.json does not)."""
    file = Path(path) / "config.json"
    return file.is_file() and "model_type" in _config_dict(file)


def _config_dict(file: Path) -> dict:
    """A config.json's fields; ValueError naming the file for one that is not a JSON object."""
    try:
        fields = json.loads(file.read_text())
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested past Python's stack
        raise ValueError(f"config.json: {str(file)!r} is not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"config.json: {str(file)!r} holds a {type(fields).__name__}, not a JSON object of fields")
    return fields


# config.json fields that are positive ints wherever a family has them (checked before the family's mapping reads them)
_POSITIVE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def read_config(path) -> tuple[dict, TransformerConfig]:
    """(config.json as a dict, the TransformerConfig it maps to); ValueError naming the
    field for an unknown model_type or an option fmoe does not build."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} has no config.json")
    hf = _config_dict(file)
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of {', '.join(FAMILIES)}")
    for field in _POSITIVE_FIELDS:  # the sizes every family divides or multiplies by: a str or 0 failed inside the mapping
        value = hf.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config.json: {field} = {value!r}, expected a positive int")
    try:
        kwargs = FAMILIES[model_type].kwargs(hf)
    except (TypeError, ZeroDivisionError) as err:  # another field of the wrong kind, or 0 where a size is divided by
        raise ValueError(f"config.json: a field of {str(file)!r} has a value its {model_type} config cannot take ({type(err).__name__}: "
                         f"{err})") from None
    try:
        return hf, TransformerConfig(**kwargs)
    except ValueError as err:  # TransformerConfig names its own fields: say which config.json field that is, where the file has it
        name, _, why = str(err).partition(": ")
        field = next((key for key in _CONFIG_FIELDS.get(name, ()) if key in hf), None)
        if field is None or not why:
            raise
        raise ValueError(f"config.json: {field} = {hf[field]!r} (fmoe's {name}): {why}") from None


# fmoe's TransformerConfig fields and the top-level config.json fields the Llama- and DeepSeek-style families map them from
# (read_config's errors name the one the file holds; another family's own names, or a value derived, keep fmoe's name)
_CONFIG_FIELDS = dict(k=("num_experts_per_tok",), n_experts=("n_routed_experts", "num_experts", "num_local_experts"),
                      n_dense=("first_k_dense_replace",), n_layers=("num_hidden_layers",), hidden=("hidden_size",),
                      n_heads=("num_attention_heads",), n_kv_heads=("num_key_value_heads",), head_dim=("head_dim",), vocab_size=("vocab_size",),
                      ffn_expert=("moe_intermediate_size",), ffn_dense=("intermediate_size",), n_groups=("n_group",), topk_groups=("topk_group",),
                      n_shared=("n_shared_experts",), window=("sliding_window",), rope_base=("rope_theta",))


def unread_keys(family: Family, cfg: TransformerConfig, path, stored) -> list[str]:
    """The checkpoint keys (of `stored`) that a model of `cfg` reads nowhere, in file order.
    Not counted: what comes with a read key (FP8's weight_scale_inv, MXFP4's _blocks and
    _scales), the MTP layers' copies of the embedding and head, MTP depths past
    cfg.mtp_depth (asked for with mtp_depth=), RoPE's inv_freq buffers (recomputed),
    lm_head.weight where `path`'s config.json ties it to the embedding, the keys under
    family.not_read (what transformers does not read either), and what the weight files in
    `path` store that acts on nothing (_inert_tensors: transformers' 0-row shared experts of
    a config without any). The experts' layout is the one `stored` holds (_stacked_experts)."""
    unread = _not_read(family, cfg, path, stored)
    inert = _inert_tensors(_weight_files(Path(path)), unread) if unread else {}
    return [key for key in unread if key not in inert]


def _inert_tensors(files: dict[str, Path], keys) -> dict[str, torch.Tensor]:
    """HF key -> its stored value, for those of `keys` (keys fmoe reads nowhere) that act on
    nothing: a tensor without elements (transformers builds and saves a shared MLP of 0 rows
    where the config has no shared experts: GLM-4.5's n_shared_experts=0, Qwen2-MoE's
    shared_expert_intermediate_size=0), and the sigmoid gate of such a shared expert (Qwen2-MoE's
    shared_expert_gate, [1, H]), which scales its zeros. The files' headers are read, and the
    values of these alone."""
    safe_open = safetensors_module().safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    shapes = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            shapes.update((key, f.get_slice(key).get_shape()) for key in names)
    empty = {key for key, shape in shapes.items() if 0 in shape}
    out = {}
    for key in shapes:
        if key in empty or key.endswith(".shared_expert_gate.weight") and key.removesuffix("_gate.weight") + ".down_proj.weight" in empty:
            with safe_open(files[key], "pt") as f:
                out[key] = f.get_tensor(key)
    return out


def _not_read(family: Family, cfg: TransformerConfig, path, stored) -> list[str]:
    """unread_keys before what acts on nothing is left out (_inert_tensors)."""
    family = _stacked_experts(family, stored)
    read = {key for spec in key_map(family, cfg).values() for key in spec.keys}
    read |= {key + suffix for key in list(read) for suffix in ("_blocks", "_scales")}
    read |= {key + suffix for key in list(read) if key.endswith("weight") for suffix in ("_scale_inv", "_packed", "_scale", "_shape")}
    read |= set(mtp_copies(family, cfg)) | set(zero_expert_keys(family, cfg))
    config = Path(path) / "config.json"
    if cfg.tie_embeddings and config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        read.add(family.renamed(family.head))

    def dropped_mtp(key: str) -> bool:  # MTP depths not asked for, or a family's layers after the trunk's that are never read
        layer = re.match(re.escape(family.renamed("model.layers.")) + r"(\d+)\.", key)
        past = cfg.n_layers + (cfg.mtp_depth if family.mtp else 0)
        return (family.mtp or not family.extra_layers_read) and layer is not None and int(layer[1]) >= past

    not_read = family.unread(cfg.mtp_depth > 0)  # an MTP module's keys that a model reading it leaves unread (mtp.norm) count
    return [key for key in stored if key not in read and not key.endswith(".rotary_emb.inv_freq") and not dropped_mtp(key)
            and not key.startswith(not_read) and not any(re.search(pattern, key) for pattern in family.ignored)]


def keep_folder_layout(model: Transformer, path, model_type: str) -> Family:
    """The layout of the weights in the Hugging Face folder `path` (of family model_type), kept
    on `model` for save_pretrained to write back with the folder's config: hf_stacks, the
    experts as stacks (Family.stacks_too, stacks_by_shape); hf_dense, the dense MLP's name
    (Family.dense_too); hf_hyper_head, the head's hyper-connection prefix (Family.hyper_head_too);
    hf_zero_rows, whether it holds the zero experts' unused rows
    (Family.zero_expert_rows: a released LongCat-Flash folder does not, transformers' does);
    hf_dtypes, the dtype of each float tensor stored in another than config.json's (a bfloat16
    folder's router weights, which transformers keeps in float32, its A_log or sinks), which
    the export writes them in whatever dtype the rest is written in, and the routing
    correction bias's, whatever it is (float32 where the folder holds none: a fresh export's);
    hf_inert, what the folder stores that acts on nothing (_inert_tensors: transformers' 0-row
    shared experts of a config without any), written back as stored; hf_mtp_depth, the MTP
    depths the folder holds (save_pretrained keeps config.json's MTP count while the model has
    as many).
    load_weights records it (from the file list it reads anyway); examples/export_hf.py calls
    it for a run started from the folder.
    Returns the family as the folder stores it."""
    path = Path(path)
    return _folder_layout(model, path, _weight_files(path), model_type)


def _folder_layout(model: Transformer, path: Path, files: dict[str, Path], model_type: str) -> Family:
    """keep_folder_layout of the folder `path` whose weight files (_weight_files) are already listed."""
    family = _stacks_by_shape(_stacked_experts(FAMILIES[model_type], files), model.cfg, files)
    model.hf_stacks = family.fused is not None and not FAMILIES[model_type].fused
    model.hf_dense = family.dense
    model.hf_hyper_head = family.hyper[2]
    model.hf_zero_rows = any(key in files for key in zero_expert_keys(family, model.cfg))
    bias = [spec.keys[0] for name, spec in key_map(family, model.cfg).items() if name.endswith("expert_bias")]
    model.hf_dtypes = _stored_dtypes(files, always=bias)
    model.hf_inert = _inert_tensors(files, _not_read(family, model.cfg, path, files))
    model.hf_mtp_depth = _held_mtp_depth(FAMILIES[model_type], model.cfg, files)
    return family


def _held_mtp_depth(family: Family, cfg: TransformerConfig, files) -> int:
    """The MTP depths the weight files hold (0 for a family that stores none)."""
    if not (family.mtp or family.mtp_module):
        return 0
    return next(d for d in range(cfg.n_layers + 1) if not _holds_mtp(family, cfg, d + 1, files))


_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _stored_dtypes(files: dict[str, Path], always=()) -> dict[str, torch.dtype]:
    """HF key -> the dtype a safetensors file stores it in, for the plain float tensors stored
    in another dtype than the folder's config.json names (config_dtype), and for the keys in
    `always` in whatever dtype (the files' headers alone are read; quantized tensors, written
    back dequantised, are left out)."""
    safe_open = safetensors_module().safe_open

    config = next(iter(files.values())).parent / "config.json" if files else None
    folder = config_dtype(_config_dict(config)) if config is not None and config.is_file() else None
    always = set(always)

    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    out = {}
    for file, keys in by_file.items():
        with safe_open(file, "pt") as f:
            for key in keys:
                dtype = _FLOAT_DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None and (dtype != folder or key in always):
                    out[key] = dtype
    return out


def load_weights(model: Transformer, path, *, model_type: str, strict: bool = True) -> int:
    """Read the checkpoint in `path` into model's parameters (see the module docstring): a
    whole model, one parallelized over ranks, or a pipeline chunk (its own parameters only).
    A parameter that is a DTensor gets only its own block, and only that block is read
    from the files (safetensors slices; an expert stack reads only this rank's experts);
    FP8 weights are read whole and dequantised before their block is cut. Returns the
    bytes this rank read. ValueError naming the key for a missing key or a shape mismatch, and
    naming the parameter for one (outside the MTP modules) that the family's checkpoints do
    not hold. With strict (the default), a checkpoint key that the model's config reads
    nowhere (unread_keys: e.g. the shared experts when loaded with n_shared=0) is a
    ValueError naming it, checked before anything is read; strict=False loads the rest. So is
    an lm_head stored beside an embedding that config.json ties it to, with other values
    (transformers reads such a head untied: tie_embeddings=False does too).
    A model with DeepSeek sparse attention (cfg.index_topk) read from a checkpoint that holds
    no indexer at all (a DeepSeek-V3 or other multi-latent attention folder: DeepSeek-V3.2's
    start) keeps its indexers as initialised, to be trained (their loss; index_topk at least
    the context length attends densely while they learn: DeepSeek's dense warm-up)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(strict, bool):
        raise ValueError(f"strict: expected a bool, got {strict!r}")
    path = Path(path)
    files = _weight_files(path)
    family = _folder_layout(model, path, files, model_type)
    folder_config = _config_dict(path / "config.json") if (path / "config.json").is_file() else {}  # read once, for both uses below
    folded = _folded(family, folder_config if family.folds is not None else {})  # its multipliers
    params = _tensors(model)
    block, packed_int = _weight_quantization(path)
    safe_open = safetensors_module().safe_open

    handles: dict[Path, object] = {}
    last_part: list = [None, None]  # (key and block, value): the parts of one key come one after another and share the read
    read_bytes = 0
    try:
        def open_slice(key: str):
            if key not in files:
                raise ValueError(f"checkpoint: missing key {key!r} in {str(path)!r}")
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            return handles[file].get_slice(key)

        def fp4(key: str) -> bool:
            """Whether key is stored as DeepSeek-V4's FP4 codes (int8, two a byte) beside a weight_scale_inv."""
            return (key in files and key.removesuffix("weight") + "weight_scale_inv" in files
                    and (open_slice(key).get_dtype() == "I8" or open_slice(key).get_dtype().startswith("F4")))

        def mxfp4(key: str) -> bool:
            """Whether key is stored as MXFP4 blocks and scales (gpt-oss's experts)."""
            return key not in files and key + "_blocks" in files

        def packed(key: str) -> bool:
            """Whether key is stored as compressed-tensors' packed integers (weight_packed, _scale, _shape)."""
            return key not in files and key.endswith("weight") and key + "_packed" in files

        def packed_shape(key: str) -> tuple[int, int]:
            return tuple(int(n) for n in open_slice(key + "_shape")[:].tolist())

        def stored_shape(key: str) -> tuple[int, ...]:
            if fp4(key):  # two codes a byte: the last dim twice the bytes'
                *lead, half = open_slice(key).get_shape()
                return (*lead, 2 * half)
            return packed_shape(key) if packed(key) else tuple(open_slice(key).get_shape())

        def read(key: str, index: tuple[slice, ...]) -> torch.Tensor:
            """index of the tensor stored under key ([out, in] for a linear weight)."""
            nonlocal read_bytes
            if any(s.stop <= s.start for s in index):
                return torch.empty([max(s.stop - s.start, 0) for s in index])
            if mxfp4(key):  # this rank's experts, dequantised, then cut
                blocks, scales = open_slice(key + "_blocks")[index[0]], open_slice(key + "_scales")[index[0]]
                read_bytes += blocks.numel() + scales.numel()
                return dequantize_mxfp4(blocks, scales).transpose(1, 2)[(slice(None), *index[1:])]
            if packed(key):  # compressed-tensors' integers: dequantised whole, then cut
                if packed_int is None:
                    raise ValueError(f"config.json: {key}_packed needs a compressed-tensors quantization_config")
                codes, scale = open_slice(key + "_packed")[:], open_slice(key + "_scale")[:]
                read_bytes += codes.numel() * 4 + scale.numel() * scale.element_size()
                return dequantize_int_packed(codes, scale, packed_shape(key), *packed_int)[index]
            if fp4(key):  # DeepSeek-V4's FP4 experts: dequantised whole, then cut
                t, scale = handles[files[key]].get_tensor(key), open_slice(key.removesuffix("weight") + "weight_scale_inv")[:]
                read_bytes += t.numel() * t.element_size() + scale.numel() * scale.element_size()
                return dequantize_fp4(t, scale)[index]
            stored = open_slice(key)
            if stored.get_dtype().startswith("F8"):  # block-scaled FP8 (DeepSeek-V3): dequantised whole, then cut
                scale_key = key.removesuffix("weight") + "weight_scale_inv"
                t, scale = handles[files[key]].get_tensor(key), open_slice(scale_key)[:]
                read_bytes += t.numel() * t.element_size() + scale.numel() * scale.element_size()
                return dequantize_fp8(t, scale, block)[index]
            t = stored[index]
            read_bytes += t.numel() * t.element_size()
            return t

        def shape(key: str, spec: Tensor) -> tuple[int, ...]:
            """The full value of `key` in fmoe's layout, as `spec` places it."""
            if mxfp4(key):  # blocks [E, out, in/32, 16] of an [E, in, out] stack
                E, out, groups, _ = open_slice(key + "_blocks").get_shape()
                stored = (E, groups * 32, out)
            else:
                stored = stored_shape(key)
            stored = tuple(n for d, n in enumerate(stored) if d not in _units(spec))
            if spec.experts is not None:  # [E rows, ...] as [E, rows, ...]
                stored = (spec.experts, stored[0] // spec.experts, *stored[1:])
            if spec.part is not None:
                return (*stored[:-1], stored[-1] // spec.part[1])
            if spec.chunk is not None:  # a run of fmoe's last dim (of each group): the stored dim -2 of a transposed weight
                d = _chunk_dim(spec, len(stored))
                stored = (*stored[:d], spec.groups * _run(spec.chunk, stored[d] // spec.groups)[1], *stored[d + 1:])
            return _swap_last(stored) if spec.transpose else stored

        keys = key_map(family, model.cfg)
        # unread_keys, with what acts on nothing as _folder_layout read it above (model.hf_inert), not read again
        unread = [key for key in _not_read(family, model.cfg, path, files) if key not in model.hf_inert] if strict else []
        if unread:  # part of the checkpoint would be dropped without a word: refused
            raise ValueError(f"checkpoint: {len(unread)} key(s) in {str(path)!r} that the model's config reads nowhere, e.g. "
                             f"{unread[0]!r} (an option that leaves out part of the model? strict=False loads the rest)")
        head, embed = family.renamed(family.head), family.renamed(family.embed)
        tied_but_stored = model.cfg.tie_embeddings and head in files and embed in files and not any(head in spec.keys for spec in keys.values())
        if strict and tied_but_stored and folder_config.get("tie_word_embeddings"):
            if not torch.equal(open_slice(head)[:], open_slice(embed)[:]):
                raise ValueError(f"checkpoint: {str(path)!r} holds a {head} that differs from its {embed}, but config.json ties "
                                 f"them (tie_word_embeddings); transformers then reads the head untied: "
                                 f"from_pretrained(path, tie_embeddings=False) does too, strict=False ties it to the embedding")
        for key, rate in constant_tensors(family, model.cfg, {"block_size": 1}).items():  # the lightning decay, xIELU's constants a folder holds
            stored_rate = open_slice(key)[:] if key.endswith(".slope_rate") and key in files else None  # as stored: bf16 rounds it
            if stored_rate is not None and not torch.allclose(stored_rate.float(), rate.to(stored_rate.dtype).float(), rtol=1e-5, atol=0.0):
                raise ValueError(f"checkpoint: {key} is not the lightning decay fmoe computes for its layer "
                                 f"(fmoe.layers.lightning_decay: {(-rate.flatten()).tolist()})")
            if key.endswith(("act_fn.beta", "act_fn.eps")) and key in files:  # xIELU's constants, as stored (bf16 rounds eps)
                with safe_open(files[key], "pt") as f:  # 0-dim: no slice of it
                    stored = f.get_tensor(key)
                if not torch.equal(stored, rate.to(stored.dtype)):
                    raise ValueError(f"checkpoint: {key} = {stored.tolist()!r} is not xIELU's constant fmoe computes with, {rate.item()!r}")
        unmapped = [n for n in params if n not in keys and not n.startswith("mtp.") and not n.endswith("expert_bias")]
        if unmapped:  # a trunk weight would keep its initial value: refused, not silently fresh
            raise ValueError(f"model: {len(unmapped)} parameter(s) that a {model_type} checkpoint does not hold, "
                             f"e.g. {unmapped[0]!r} (an option the family does not have?)")
        chunk = getattr(model, "pipeline_chunk", None)
        absent = {f"mtp.{d - 1}." for d in range(1, model.cfg.mtp_depth + 1) if not _holds_mtp(family, model.cfg, d, files)}
        # DeepSeek sparse attention over a checkpoint without any indexer (DeepSeek-V3's: DeepSeek-V3.2's start): fresh indexers
        fresh_indexers = model.cfg.index_topk is not None and not any(".indexer." in key for key in files)
        for name, spec in keys.items():
            if name not in params and chunk is not None:
                continue  # held by another pipeline stage
            if any(name.startswith(prefix) for prefix in absent):
                continue  # an MTP depth the checkpoint does not hold: left as initialised
            if fresh_indexers and ".attn.index_" in name:
                continue  # an indexer the checkpoint has none of: left as initialised
            if family.correction_bias_optional and name.endswith(".expert_bias") and spec.keys[0] not in files:
                continue  # a folder that routes without a correction bias: left at zero (A.X-K1's released ones)
            if name not in params:
                raise ValueError(f"model: has no parameter {name!r} for checkpoint key {spec.keys[0]!r}")
            param = params[name]
            if spec.stacked:
                shapes = {key: shape(key, spec) for key in spec.keys}
                first = shapes[spec.keys[0]]
                for key, other in shapes.items():
                    if other != first:
                        raise ValueError(f"checkpoint: {key} has shape {other} (as [in, out]), its other experts {first}")
                full_shape = (len(spec.keys), *first)
            elif spec.cat:  # the keys' rows in turn
                shapes = [stored_shape(key) for key in spec.keys]
                if any(other[1:] != shapes[0][1:] for other in shapes):
                    raise ValueError(f"checkpoint: {' and '.join(spec.keys)} have shapes {shapes}, whose rows do not join")
                full_shape = (sum(other[0] for other in shapes), *shapes[0][1:])
            else:
                full_shape = shape(spec.keys[0], spec)
            if tuple(param.shape) != tuple(full_shape):
                raise ValueError(f"checkpoint: {spec.keys[0]} gives {name} the shape {tuple(full_shape)}, the model expects {tuple(param.shape)}")
            index = local_block(param)

            def stored_index(ours: tuple[slice, ...]) -> tuple[slice, ...]:
                if spec.part is not None:  # the whole interleaved run of the block's entries
                    n = spec.part[1]
                    index = (*ours[:-1], slice(ours[-1].start * n, ours[-1].stop * n))
                else:
                    index = _swap_last(ours) if spec.transpose else ours
                if spec.chunk is not None:  # the i-th run of the stored dim -2 (transposed) or -1
                    d = _chunk_dim(spec, len(index))
                    stored_dim = stored_shape(spec.keys[0])[d + sum(u <= d for u in _units(spec))]
                    if spec.groups > 1:  # runs in every group: the whole dim is read, as_ours takes them
                        index = (*index[:d], slice(0, stored_dim), *index[d + 1:])
                    else:
                        offset = _run(spec.chunk, stored_dim)[0]
                        index = (*index[:d], slice(index[d].start + offset, index[d].stop + offset), *index[d + 1:])
                for u in _units(spec):  # ascending: each a stored dim (Tensor.row's dim 0: its row)
                    at = spec.row if spec.row is not None and u == 0 else 0
                    index = (*index[:u], slice(at, at + 1), *index[u:])
                if spec.experts is not None:  # the experts' whole runs of rows (as_ours narrows each run)
                    rows = stored_shape(spec.keys[0])[0] // spec.experts
                    index = (slice(index[0].start * rows, index[0].stop * rows), *index[2:])
                return index

            def as_ours(t: torch.Tensor, ours: tuple[slice, ...]) -> torch.Tensor:
                for u in reversed(_units(spec)):
                    t = t.squeeze(u)
                if spec.experts is not None:  # [experts rows, ...] -> [experts, rows, ...], each run narrowed to the block's rows
                    run = (_swap_last(ours) if spec.transpose else ours)[1]
                    t = t.unflatten(0, (-1, stored_shape(spec.keys[0])[0] // spec.experts))[:, run]
                if spec.part is not None:
                    return t[..., spec.part[0]::spec.part[1]]
                if spec.chunk is not None and spec.groups > 1:  # every group's run, then the block's entries of them
                    d = _chunk_dim(spec, t.dim())
                    runs = _grouped_runs(spec, t, d).flatten(d, d + 1)
                    block = ours[-1] if spec.transpose else ours[d]
                    t = runs.narrow(d, block.start, block.stop - block.start)
                return t.transpose(-2, -1) if spec.transpose else t

            if spec.cat:  # this block's rows of each key
                rows, offset, runs = index[0], 0, []
                for key in spec.keys:
                    n = stored_shape(key)[0]
                    lo, hi = max(rows.start, offset), min(rows.stop, offset + n)
                    if lo < hi:
                        runs.append(read(key, (slice(lo - offset, hi - offset), *index[1:])))
                    offset += n
                value = torch.cat(runs) if runs else None
            elif spec.stacked:  # only this rank's experts, each its own block
                experts = range(len(spec.keys))[index[0]]
                value = torch.stack([as_ours(read(spec.keys[e], stored_index(index[1:])), index[1:]) for e in experts]) if len(experts) else None
            elif spec.part is not None or (spec.chunk is not None and spec.groups > 1):  # the parts (every group's runs) of a key share one read
                where = (spec.keys[0], tuple((sl.start, sl.stop) for sl in stored_index(index)))
                if last_part[0] != where:
                    last_part[:] = where, read(spec.keys[0], stored_index(index))
                value = as_ours(last_part[1], index)
            else:
                value = as_ours(read(spec.keys[0], stored_index(index)), index)
            local = param.to_local() if isinstance(param, DTensor) else param
            scale = folded(name)
            if value is not None and scale != 1.0:  # a multiplier folded into the weight
                value = value.float() * scale
            if value is not None:
                with torch.no_grad():
                    local.copy_(value.to(local.dtype))
    finally:
        handles.clear()
    return read_bytes


def _swap_last(dims: tuple) -> tuple:
    """A shape or index with its last two entries swapped (a linear weight's [out, in] <-> [in, out])."""
    return (*dims[:-2], dims[-1], dims[-2])


def _tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's parameters and its expert-bias, layer-scalar and hash-table buffers by name (what a checkpoint holds)."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith(("expert_bias", "layer_scalar", "hash_table")))
    return out


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantization(hf: dict) -> Optional[dict]:
    """config.json's quantization_config: the top level's, else its text_config's (where a
    multimodal release such as Kimi K2.5 keeps it)."""
    text = hf.get("text_config")
    return hf.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None) or None


def _weight_quantization(path: Path) -> tuple[Optional[tuple[int, int]], Optional[tuple[int, Optional[int]]]]:
    """(FP8's weight_block_size, (num_bits, group_size) of compressed-tensors' packed integers)
    of the folder's quantization_config, each None where it has none; ValueError for a
    scheme fmoe does not read."""
    quant = _quantization(json.loads((path / "config.json").read_text())) if (path / "config.json").is_file() else None
    if not quant or quant.get("quant_method") == "mxfp4":  # gpt-oss's experts: read by dequantize_mxfp4
        return None, None
    if quant.get("quant_method") == "fp8" and len(quant.get("weight_block_size") or ()) == 2:
        return tuple(int(b) for b in quant["weight_block_size"]), None
    if quant.get("quant_method") == "compressed-tensors":
        return None, _packed_int(quant)
    raise ValueError(f"config.json: quantization_config {quant!r} is not supported (block-scaled fp8 with weight_block_size [m, n], "
                     "mxfp4, or compressed-tensors pack-quantized symmetric int weights)")


def _packed_int(quant: dict) -> tuple[int, Optional[int]]:
    """(num_bits, group_size or None per row) of a compressed-tensors quantization_config whose
    every group is weight-only, symmetric, integer, per group or per row, in pack-quantized
    format (Kimi K2-Thinking's and K2.5's int4 experts); ValueError naming what is not."""
    groups = quant.get("config_groups") or {}
    schemes = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        fmt = group.get("format") or quant.get("format")
        problem = ("format " + repr(fmt) if fmt != "pack-quantized" else
                   "quantised activations" if group.get("input_activations") or group.get("output_activations") else
                   f"type {w.get('type')!r}" if w.get("type") != "int" else
                   "asymmetric weights" if not w.get("symmetric") else
                   f"strategy {w.get('strategy')!r}" if w.get("strategy") not in ("group", "channel") else
                   f"num_bits {w.get('num_bits')!r}" if w.get("num_bits") not in (2, 4, 8) else
                   f"actorder {w.get('actorder')!r}" if w.get("actorder") else None)
        if problem is not None:
            raise ValueError(f"config.json: compressed-tensors config_groups[{name!r}] has {problem}; fmoe reads pack-quantized, "
                             "symmetric int weights (2, 4 or 8 bits, per group or per channel) without quantised activations")
        schemes.add((int(w["num_bits"]), int(w["group_size"]) if w["strategy"] == "group" else None))
    if len(schemes) != 1:
        raise ValueError(f"config.json: compressed-tensors config_groups with {len(schemes)} weight schemes (num_bits, group_size): "
                         f"{sorted(schemes, key=str)}; fmoe reads one")
    return schemes.pop()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """A block-scaled FP8 weight [out, in] in float32: each [m, n] block (the last ones
    cut at the edges) times its scale_inv [ceil(out/m), ceil(in/n)] entry; a stack of them
    [..., out, in] (Step 3.5's experts, [E, F, H]) with scale_inv [..., ceil(out/m), ceil(in/n)],
    each matrix its own blocks."""
    if block is None:
        raise ValueError("config.json: an fp8 weight without a quantization_config (weight_block_size)")
    m, n = block
    if weight.ndim < 2:
        raise ValueError(f"checkpoint: an fp8 weight of shape {tuple(weight.shape)}, expected [..., out, in]")
    rows, cols = weight.shape[-2:]
    if tuple(scale_inv.shape) != (*weight.shape[:-2], -(-rows // m), -(-cols // n)):
        raise ValueError(f"checkpoint: fp8 scales of shape {tuple(scale_inv.shape)} for a {'x'.join(map(str, weight.shape))} weight in {m}x{n} blocks")
    scale = _scales(scale_inv).repeat_interleave(m, -2)[..., :rows, :].repeat_interleave(n, -1)[..., :cols]
    return weight.float() * scale


def _scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales in float32: as stored (float32, bfloat16, float8_e8m0fnu), or from biased
    uint8 exponents (2 ** (byte - 127))."""
    return torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()


def dequantize_fp4(packed: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's FP4 weight (quantization_config.expert_dtype "fp4") in float32: packed
    [..., out, in / 2] int8 (or float4_e2m1fn_x2) holds two e2m1 codes a byte, the low nibble
    the first column; scale_inv [..., R, C] (powers of two: float8_e8m0fnu, or biased uint8)
    scales blocks of out / R rows and in / C columns (the releases': 1 x 32). Returns
    [..., out, in]."""
    if packed.dtype != torch.int8 and not str(packed.dtype).startswith("torch.float4"):
        raise ValueError(f"checkpoint: an FP4 weight stored as {packed.dtype}, expected int8 (two e2m1 codes a byte)")
    if packed.ndim < 2 or scale_inv.ndim != packed.ndim:
        raise ValueError(f"checkpoint: an FP4 weight of shape {tuple(packed.shape)} with scales of shape {tuple(scale_inv.shape)}, "
                         "expected [..., out, in / 2] and [..., R, C]")
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([lut[(u8 & 0x0F).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)  # [..., out, in]
    rows, cols = values.shape[-2:]
    R, C = scale_inv.shape[-2:]
    if rows % R or cols % C or scale_inv.shape[:-2] != values.shape[:-2]:
        raise ValueError(f"checkpoint: FP4 scales of shape {tuple(scale_inv.shape)} do not tile a {'x'.join(map(str, values.shape))} weight")
    return values * _scales(scale_inv).repeat_interleave(rows // R, -2).repeat_interleave(cols // C, -1)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # the 16 codes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights (the OCP microscaling format of gpt-oss's experts) in float32: blocks
    [..., G, 16] uint8 hold 32 FP4 (e2m1) codes per group, two per byte, the low nibble first;
    scales [..., G] uint8 are each group's power of two, biased by 127. Returns [..., G * 32],
    code value * 2 ** (scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1:] != (16,):
        raise ValueError(f"checkpoint: MXFP4 blocks [..., G, 16] and scales [..., G] of uint8 expected, got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def dequantize_int_packed(packed: torch.Tensor, scale: torch.Tensor, shape, num_bits: int = 4, group_size: Optional[int] = None) -> torch.Tensor:
    """compressed-tensors' pack-quantized weight (Kimi K2-Thinking's and K2.5's int4 experts)
    in float32, [out, in] = shape. packed [out, ceil(in / p)] int32, p = 32 / num_bits: each
    entry holds p consecutive columns' codes, the first in the lowest bits, each the signed
    value plus 2 ** (num_bits - 1). scale [out, ceil(in / group_size)] holds each row's group
    scales (group_size None: one per row, [out, 1]). Returns value x its group's scale (exact:
    a float32 product of a small integer and a bf16 or float32 scale)."""
    if num_bits not in (2, 4, 8):
        raise ValueError(f"num_bits: expected 2, 4 or 8, got {num_bits!r}")
    rows, cols = (int(n) for n in shape)
    per = 32 // num_bits
    group = cols if group_size is None else int(group_size)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // per)) or tuple(scale.shape) != (rows, -(-cols // group)):
        raise ValueError(f"checkpoint: a packed {num_bits}-bit weight of shape {(rows, cols)} needs int32 codes of shape "
                         f"{(rows, -(-cols // per))} and scales of shape {(rows, -(-cols // group))}, got {packed.dtype} "
                         f"{tuple(packed.shape)} and {tuple(scale.shape)}")
    shifts = torch.arange(per, dtype=torch.int32) * num_bits
    codes = ((packed[..., None] >> shifts) & ((1 << num_bits) - 1)).flatten(-2)[:, :cols]  # the low bits after an arithmetic shift
    values = (codes - (1 << (num_bits - 1))).float()
    return values * scale.float().repeat_interleave(group, 1)[:, :cols]


def from_pretrained(path, *, dtype: torch.dtype = torch.float32, device="cpu", strict: bool = True, **options) -> tuple[Transformer, TransformerConfig]:
    """A Transformer with the weights of the HF folder `path`, in `dtype` (the router and its
    bias stay float32) on `device`: allocated there directly, each weight cast as it is read,
    so bf16 takes half the memory of float32 and no float32 copy of the model is made (one
    tensor at a time is read or dequantised in float32).

    options: TransformerConfig fields to set on top of the mapped config (e.g. impl="torch",
    ac="full"). mtp_depth: by default the MTP layers the checkpoint holds (DeepSeek-V3,
    GLM-4.5, GLM-4.7-Flash; none for the others); more depths than it holds start from fresh weights.
    An MTP module the folder holds (Qwen3-Next's mtp.) is read with its own output norm
    (mtp_norm=True) whether or not mtp_depth is given.
    Block-scaled FP8 and MXFP4 (gpt-oss) weights are dequantised. strict: a checkpoint
    key the options leave unread (e.g. n_shared=0 on a model with shared experts) is a
    ValueError; strict=False drops it (load_weights). Returns (model, cfg);
    model.hf_config keeps config.json for save_pretrained, model.hf_mtp_depth the MTP depths
    the folder holds."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict: expected a bool, got {strict!r}")
    hf, cfg = read_config(path)
    family = FAMILIES[hf["model_type"]]
    if family.mtp or family.mtp_module:
        held = _held_mtp_depth(family, cfg, _weight_files(Path(path)))
        options.setdefault("mtp_depth", held)
        if family.mtp_module and held and options["mtp_depth"]:  # the module read with its own output norm, mtp.norm
            options.setdefault("mtp_norm", True)
    if options:
        try:
            cfg = dataclasses.replace(cfg, **options)
        except ValueError as err:  # a field the folder set that the options no longer fit (n_dense past n_layers=...)
            given = ", ".join(f"{name}={value!r}" for name, value in options.items())
            raise ValueError(f"{err} (the config of {str(path)!r} with the options {given})") from err
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model.to_empty(device=device)
    model.reset_parameters(seed=0)  # everything the checkpoint does not hold (expert biases, MTP)
    load_weights(model, path, model_type=hf["model_type"], strict=strict)
    model.hf_config = hf
    return model, cfg


def _qwen3_5_fields(cfg: TransformerConfig) -> dict:
    """The config.json fields of Qwen3-Next's and Qwen3.5's attention and Gated DeltaNet blocks
    (and their MTP module's count) that _qwen3_next reads back."""
    lin = cfg.linear_attention_config()
    out = dict(attention_bias=False, layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
               linear_num_key_heads=lin.n_k_heads, linear_num_value_heads=lin.n_v_heads, linear_key_head_dim=lin.k_head_dim,
               linear_value_head_dim=lin.v_head_dim, linear_conv_kernel_dim=lin.conv,
               rope_parameters=dict(_rope_parameters(cfg), partial_rotary_factor=_rotary_factor(cfg)))
    if cfg.mtp_depth:  # the released configs' count of MTP modules (mtp.), which inference engines read
        out.update(mtp_num_hidden_layers=cfg.mtp_depth)
    return out


def _deepseek_moe_config(cfg: TransformerConfig) -> dict:
    """The config.json fields that _deepseek_moe and the DeepSeek-style routings
    (_sigmoid_routing, DeepSeek-V2's groups) read, from an fmoe config."""
    if cfg.shared_size % cfg.ffn_expert:
        raise ValueError(f"model: shared experts of {cfg.shared_size} are not a whole number of experts of {cfg.ffn_expert}")
    return dict(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                first_k_dense_replace=cfg.n_dense, n_shared_experts=cfg.shared_size // cfg.ffn_expert,
                routed_scaling_factor=cfg.route_scale if cfg.route_scale is not None else 1.0, n_group=cfg.n_groups or 1,
                topk_group=cfg.topk_groups or 1, norm_topk_prob=cfg.route_normalize, num_nextn_predict_layers=cfg.mtp_depth)


def _layer_types(cfg: TransformerConfig) -> list[str]:
    """config.json's layer_types: each layer's sliding or full attention."""
    return ["sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layers)]


def _granite_scaled(cfg: TransformerConfig) -> TransformerConfig:
    """cfg with its softmax scale stated: Granite's attention_multiplier is the scale itself, so
    the default 1 / sqrt(head_dim) (attn_scale None) is written out, and read back."""
    return cfg if cfg.attn_scale is not None else dataclasses.replace(cfg, attn_scale=cfg.head_dim**-0.5)


def _granite_multiplier_fields(cfg: TransformerConfig) -> dict:
    """Granite's multipliers in config.json (what _granite_multipliers reads back), of a
    _granite_scaled cfg."""
    return dict(attention_multiplier=cfg.attn_scale, embedding_multiplier=cfg.embed_scale, residual_multiplier=cfg.residual_scale,
                logits_scaling=cfg.logit_divisor)


def _granite_swa_fields(cfg: TransformerConfig) -> dict:
    """Granite SWA's attention fields (what _granite_swa_attention reads back): the window's
    layers (a sink per head in every layer), 0 as the RoPE base of a NoPE layer."""
    return dict(sliding_window=cfg.window or 128, layer_types=_layer_types(cfg), attention_bias=False,
                layer_rope_theta=[0 if cfg.is_nope(i) else cfg.local_rope_base if cfg.is_sliding(i) and cfg.local_rope_base else cfg.rope_base
                                  for i in range(cfg.n_layers)])


def _lfm2_config(cfg: TransformerConfig) -> dict:
    """The config.json fields of LFM2's blocks (what _lfm2_common reads): the layer types, the
    convolutions' taps, the norms' eps under LFM2's name."""
    return dict(layer_types=["conv" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                conv_L_cache=cfg.linear_conv, conv_bias=False, norm_eps=cfg.norm_eps)


def _proportional_rope_parameters(cfg: TransformerConfig) -> dict:
    """config.json's rope_parameters of Gemma 4 and LFM3 (what _proportional_rope reads back): the
    full layers' proportional RoPE (or plain), the sliding layers' plain at local_rope_base."""
    globe = dict(rope_type="proportional", partial_rotary_factor=cfg.rope_proportion or 1.0, rope_theta=cfg.rope_base,
                 **({} if cfg.rope_linear_factor is None else dict(factor=cfg.rope_linear_factor)))
    if cfg.rope_proportion is None and cfg.rope_linear_factor is None:
        globe = dict(rope_type="default", rope_theta=cfg.rope_base)
    return dict(full_attention=globe, sliding_attention=dict(rope_type="default", rope_theta=cfg.local_rope_base or cfg.rope_base))


def _rope_by_layer_type_parameters(cfg: TransformerConfig, full: dict) -> dict:
    """config.json's rope_parameters keyed by layer type (what _rope_by_layer_type reads back):
    the full layers' `full`; the sliding layers' the same, or plain RoPE at local_rope_base
    (on the same partial rotary)."""
    partial = {k: v for k, v in full.items() if k == "partial_rotary_factor"}
    sliding = full if cfg.local_rope_base is None else dict(rope_type="default", rope_theta=cfg.local_rope_base, **partial)
    return {"full_attention": full, "sliding_attention": sliding}


def _query_pre_attn_scalar(cfg: TransformerConfig):
    """Gemma's query_pre_attn_scalar q of attn_scale (q ** -0.5; None: head_dim): the whole
    number, or the float, that reads back as attn_scale exactly."""
    if cfg.attn_scale is None:
        return cfg.head_dim
    q = cfg.attn_scale ** -2
    return next((c for c in (round(q), q) if c > 0 and float(c) ** -0.5 == cfg.attn_scale), q)


def _muse_fields(cfg: TransformerConfig) -> dict:
    """The config.json fields of Muse Glimmer's and Muse Spark's blocks (_muse_blocks) from an
    fmoe config: the q scale and the logits' multiplier that read back exactly, the cap, the
    post-norms' eps, the layer kinds and each layer's RoPE base (0: none)."""
    head_dim = cfg.head_dim
    q_scale = 1.0 if cfg.attn_scale is None else _exact_field(cfg.attn_scale, cfg.attn_scale * head_dim ** 0.5, lambda c: c * head_dim ** -0.5)
    return dict(attention_bias=cfg.qkv_bias, qk_scale_factor=q_scale, output_multiplier=_exact_field(cfg.logit_divisor, 1 / cfg.logit_divisor, lambda c: 1 / c),
                final_logit_softcapping=cfg.logit_softcap, post_norm_eps=cfg.post_norm_eps, sliding_window=cfg.window or 4096,
                layer_types=_layer_types(cfg), layer_rope_theta=[0 if cfg.is_nope(i) else cfg.rope_base for i in range(cfg.n_layers)])


def _exact_field(target: float, guess: float, reads: Callable[[float], float]) -> float:
    """The config.json value near `guess` (within a few ulps) that `reads` (the mapping's
    formula) takes back to `target` exactly (Muse's qk_scale_factor of attn_scale, its
    output_multiplier of logit_divisor); guess itself where none does."""
    below = above = guess
    for _ in range(8):
        for c in (below, above):
            if reads(c) == target:
                return c
        below, above = math.nextafter(below, -math.inf), math.nextafter(above, math.inf)
    return guess


def _rotary_factor(cfg: TransformerConfig) -> float:
    """config.json's partial_rotary_factor of rope_dim: rope_dim / head_dim, or where
    int(head_dim * that) rounds below rope_dim (30 / 44), half a channel more, which
    transformers' and _partial_rope's int(head_dim * factor) read back as rope_dim."""
    rope, D = cfg.rope_dim or cfg.head_dim, cfg.head_dim
    return rope / D if int(D * (rope / D)) == rope else (rope + 0.5) / D


def _rope_parameters(cfg: TransformerConfig) -> dict:
    """config.json's rope_parameters of plain RoPE, or with Llama 3.1's scaling (what _rope
    reads back), or LongRoPE (what _longrope reads back; its short scale as attention_factor,
    Phi-3's, which config_mismatch finds wrong where the long one differs)."""
    if cfg.longrope_short_factors is not None:
        return dict(rope_type="longrope", rope_theta=cfg.rope_base, short_factor=list(cfg.longrope_short_factors),
                    long_factor=list(cfg.longrope_long_factors or cfg.longrope_short_factors),
                    original_max_position_embeddings=cfg.longrope_original_max_positions, attention_factor=cfg.longrope_short_scale)
    if cfg.yarn_factor is not None:  # as _llama_yarn reads it back (a softmax scale of YaRN's, DeepSeek's, does not: config_mismatch)
        return dict(rope_type="yarn", rope_theta=cfg.rope_base, factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
                    truncate=cfg.yarn_truncate, original_max_position_embeddings=cfg.yarn_original_max_positions,
                    **(dict(mscale=1.0, mscale_all_dim=1.0) if cfg.yarn_mscale == 0 else {}))
    if cfg.llama3_factor is None:
        return {"rope_theta": cfg.rope_base, "rope_type": "default"}
    return dict(rope_type="llama3", rope_theta=cfg.rope_base, factor=cfg.llama3_factor, low_freq_factor=cfg.llama3_low_freq_factor,
                high_freq_factor=cfg.llama3_high_freq_factor, original_max_position_embeddings=cfg.llama3_original_max_positions)


def _yarn_parameters(cfg: TransformerConfig) -> dict:
    """config.json's rope_parameters of a YaRN model (what _yarn reads back): DeepSeek's
    mscale pair when set; without it, 0.1 ln(factor) + 1 on cos / sin (gpt-oss)."""
    out = dict(rope_type="yarn", rope_theta=cfg.rope_base, factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast,
               beta_slow=cfg.yarn_beta_slow, truncate=cfg.yarn_truncate, original_max_position_embeddings=cfg.yarn_original_max_positions)
    if cfg.yarn_mscale_all_dim:
        out.update(mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
    return out


def _query_temperature_parameters(cfg: TransformerConfig, floor: int) -> dict:
    """The rope_parameters fields _query_temperature reads back: the query temperature's beta
    (0: none) and floor (`floor` for a model without one: YaRN's original length, when the
    family has YaRN, since the two share the field)."""
    return dict(llama_4_scaling_beta=cfg.query_temperature_scale if cfg.query_temperature_floor else 0.0,
                original_max_position_embeddings=cfg.query_temperature_floor or floor)


def _ministral3_rope(cfg: TransformerConfig) -> dict:
    """Ministral 3's rope_parameters (what _ministral3 reads back): plain RoPE or YaRN (its
    mscale pair equal where fmoe leaves cos and sin unscaled), and the query temperature."""
    out = dict(rope_type="default", rope_theta=cfg.rope_base)
    if cfg.yarn_factor is not None:
        out.update(rope_type="yarn", factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow,
                   **(dict(mscale=1.0, mscale_all_dim=1.0) if cfg.yarn_mscale == 0 else {}))
    return dict(out, **_query_temperature_parameters(cfg, cfg.yarn_original_max_positions if cfg.yarn_factor else 16384))


# the families whose config.json holds _deepseek_moe_config's fields
_DEEPSEEK_STYLE = ("glm4_moe", "sarvam_moe", "deepseek_v2", "deepseek_v3", "kimi_k2", "sarvam_mla", "glm4_moe_lite", "dots1", "deepseek_v32", "axk1",
                   "glm_moe_dsa", "hy_v4", "hy_v4_vl_text", "axk2")
# ...of which these have no first_k_dense_replace (mlp_layer_types says it) nor MTP count (_mtp_count_field)
_NO_MTP_COUNT = ("axk1", "hy_v4", "hy_v4_vl_text", "axk2")


def hf_config(cfg: TransformerConfig, model_type: str) -> dict:
    """A config.json for an fmoe model of one of FAMILIES (the fields the mapping reads)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: expected one of {', '.join(FAMILIES)}, got {model_type!r}")
    _check_writable(model_type)
    if model_type == "deepseek_v4":  # its own fields throughout
        return _deepseek_v4_config(cfg)
    if model_type == "dbrx":  # its own names, the attention's and the experts' fields in their own dicts (transformers' attention reads
        # attn_config.rope_theta, its RoPE the top level's)
        ffn = dict(ffn_act_fn={"name": "silu"}, ffn_hidden_size=cfg.ffn_expert, moe_num_experts=cfg.n_experts, moe_top_k=cfg.k,
                   moe_normalize_expert_weights=None if cfg.pre_softmax else 1.0)
        return _equivalent(cfg, dict(
            architectures=[FAMILIES[model_type].architecture], model_type=model_type, vocab_size=cfg.vocab_size, d_model=cfg.hidden,
            n_heads=cfg.n_heads, n_layers=cfg.n_layers, rope_parameters=_rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
            attn_config=dict(clip_qkv=cfg.clip_qkv, kv_n_heads=cfg.n_kv_heads, rope_theta=cfg.rope_base), ffn_config=ffn, dtype="float32", pad_token_id=None))
    hf = dict(architectures=[FAMILIES[model_type].architecture], model_type=model_type, vocab_size=cfg.vocab_size,
              hidden_size=cfg.hidden, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
              num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
              rope_parameters=_rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
              num_experts_per_tok=cfg.k, dtype="float32", pad_token_id=None)  # no padding row in fmoe's embedding
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
    if cfg.window is not None and model_type == "mixtral":
        hf.update(sliding_window=cfg.window)
    elif cfg.window is not None and model_type == "qwen3_moe":
        hf.update(use_sliding_window=True, sliding_window=cfg.window)
    elif cfg.window is not None and model_type == "qwen2_moe":
        hf.update(use_sliding_window=True, sliding_window=cfg.window, max_window_layers=cfg.n_layers, layer_types=_layer_types(cfg))
    if model_type in ("mixtral", "minimax_m2", "minimax"):
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert)
        if model_type == "minimax":  # one alpha (None: a plain pre-norm block, which config_mismatch names) and one beta
            alpha = 1.0 if cfg.normed_residual is None else cfg.normed_residual
            hf.update(layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                      **{f"{kind}_alpha_factor": alpha for kind in ("full_attn", "linear_attn", "mlp")},
                      **{f"{kind}_beta_factor": cfg.residual_scale for kind in ("full_attn", "linear_attn", "mlp")})
    elif model_type == "phimoe":  # LongRoPE's two scales under their own names (_longrope)
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, router_jitter_noise=cfg.sparsemixer_eps,
                  attention_bias=cfg.qkv_bias, lm_head_bias=cfg.head_bias, sliding_window=cfg.window)
        if cfg.longrope_short_factors is not None:
            hf["rope_parameters"].pop("attention_factor")
            hf["rope_parameters"].update(short_mscale=cfg.longrope_short_scale, long_mscale=cfg.longrope_long_scale)
    elif model_type in ("granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid"):
        cfg = _granite_scaled(cfg)
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, **_granite_multiplier_fields(cfg))
        if model_type in ("granitemoeshared", "granitemoe_swa", "granitemoehybrid"):
            hf.update(shared_intermediate_size=cfg.shared_size)
        if model_type == "granitemoehybrid" and not moe:  # H-Micro: the shared MLP alone in every block
            hf.update(num_local_experts=0, shared_intermediate_size=cfg.ffn_dense)
        elif model_type == "granitemoehybrid" and len(moe) < cfg.n_layers:
            raise ValueError(f"model: Granite 4.0-H's blocks are all MoE or all dense; this model has MoE layers {moe} of {cfg.n_layers}")
        if model_type == "granitemoehybrid":  # one rope or none for every attention layer (config_mismatch names the rest)
            hf.update(layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                      position_embedding_type=None if cfg.nope_layers else "rope", **_mamba2_config(cfg))
        if model_type == "granitemoe_swa":
            hf.update(_granite_swa_fields(cfg))
    elif model_type == "gpt_oss":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, attention_bias=cfg.qkv_bias,
                  swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, layer_types=_layer_types(cfg),
                  # transformers builds the sliding mask in every forward: a width is written even where no layer uses it
                  sliding_window=cfg.window or 128)
        if cfg.yarn_factor is not None:
            hf["rope_parameters"] = _yarn_parameters(cfg)
    elif model_type == "llama4_text":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, intermediate_size_mlp=cfg.ffn_dense, moe_layers=moe,
                  use_qk_norm=cfg.qk_norm == "rms", attention_bias=cfg.qkv_bias, no_rope_layers=[int(not cfg.is_nope(i)) for i in range(cfg.n_layers)],
                  # transformers builds the chunked mask in every forward: a length is written even where no layer uses it
                  attention_chunk_size=cfg.chunk or 8192,
                  layer_types=["chunked_attention" if cfg.is_chunked(i) else "full_attention" for i in range(cfg.n_layers)],
                  attn_temperature_tuning=cfg.nope_temperature_floor is not None, floor_scale=cfg.nope_temperature_floor or 8192,
                  attn_scale=cfg.nope_temperature_scale)
    elif model_type == "cohere2_moe":
        if cfg.shared_size % cfg.ffn_expert:
            raise ValueError(f"model: shared experts of {cfg.shared_size} are not a whole number of experts of {cfg.ffn_expert}")
        rotating_prefix = any(not cfg.is_moe(i) and not cfg.is_sliding(i) and not cfg.is_nope(i) for i in range(cfg.n_layers))
        hf.pop("rms_norm_eps")
        hf.update(num_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, prefix_dense_intermediate_size=cfg.ffn_dense,
                  num_shared_experts=cfg.shared_size // cfg.ffn_expert, expert_selection_fn=cfg.score, norm_topk_prob=cfg.route_normalize,
                  shared_expert_combination_strategy="average" if cfg.shared_scale == 0.5 else "sum",
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)], layer_types=_layer_types(cfg),
                  sliding_window=cfg.window or 4096, prefix_dense_sliding_window_pattern=1 if rotating_prefix else 2, attention_bias=False,
                  logit_scale=1 / cfg.logit_divisor, rms_norm_eps=None if cfg.layer_norms else cfg.norm_eps, layer_norm_eps=cfg.norm_eps)
    elif model_type == "afmoe":
        moe_fields = _deepseek_moe_config(cfg)
        hf.update(num_experts=cfg.n_experts, num_shared_experts=moe_fields["n_shared_experts"], moe_intermediate_size=cfg.ffn_expert,
                  intermediate_size=cfg.ffn_dense, num_dense_layers=cfg.n_dense, route_scale=moe_fields["routed_scaling_factor"],
                  attention_bias=False, sliding_window=cfg.window, layer_types=_layer_types(cfg), mup_enabled=cfg.embed_scale != 1.0)
    elif model_type == "aria_text":
        if cfg.shared_size % cfg.ffn_expert:
            raise ValueError(f"model: shared experts of {cfg.shared_size} are not a whole number of experts of {cfg.ffn_expert} (Aria's "
                             "moe_num_shared_experts)")
        hf.pop("num_experts_per_tok")
        hf.update(moe_num_experts=cfg.n_experts, moe_topk=cfg.k, intermediate_size=cfg.ffn_expert, moe_num_shared_experts=cfg.shared_size // cfg.ffn_expert,
                  attention_bias=False, mlp_bias=False)
    elif model_type == "laguna":
        full = _yarn_parameters(cfg) if cfg.yarn_factor is not None else dict(rope_type="default", rope_theta=cfg.rope_base)
        rope = {"full_attention": dict(full, partial_rotary_factor=_rotary_factor(cfg))}
        if cfg.local_rope_base is not None:
            local = dataclasses.replace(cfg, rope_dim=cfg.local_rope_dim or cfg.rope_dim)
            rope["sliding_attention"] = dict(rope_type="default", rope_theta=cfg.local_rope_base, partial_rotary_factor=_rotary_factor(local))
        else:
            rope["sliding_attention"] = rope["full_attention"]
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  shared_expert_intermediate_size=cfg.shared_size, moe_routed_scaling_factor=cfg.route_scale or 1.0,
                  moe_router_logit_softcapping=cfg.router_softcap or 0.0, attention_bias=False, sliding_window=cfg.window or 512,
                  layer_types=_layer_types(cfg), num_attention_heads_per_layer=[cfg.heads(i) for i in range(cfg.n_layers)],
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  gating="per-head" if cfg.attn_gate_per_head else "per-element", rope_parameters=rope)
    elif model_type == "step3p5":  # transformers' own form of the fields (Step3p7TextConfig's), which _step3p5 reads as the released ones
        full = dict(_rope_parameters(cfg), partial_rotary_factor=_rotary_factor(cfg))
        rope = {"full_attention": full}
        if cfg.local_rope_base is not None:
            local = dataclasses.replace(cfg, rope_dim=cfg.local_rope_dim or cfg.rope_dim)
            rope["sliding_attention"] = dict(rope_type="default", rope_theta=cfg.local_rope_base, partial_rotary_factor=_rotary_factor(local))
        elif cfg.window is not None:  # the sliding layers' RoPE the full layers' (a model of fmoe's own: no scaling there, which
            rope["sliding_attention"] = full  # config_mismatch names)

        def limits(limit, layers):
            return [limit if limit is not None and (layers is None or i in layers) else 0.0 for i in range(cfg.n_layers)]

        scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale**-2  # the softmax scale's 1 / s^2, a whole number where it is one
        scalar = round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-12) else scalar
        hf.pop("pad_token_id")  # an int in transformers' config class (its own 1; fmoe's embedding has no padding row)
        hf.update(n_routed_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  share_expert_dim=cfg.shared_size, moe_router_scaling_factor=cfg.route_scale or 1.0, attention_bias=False, sliding_window=cfg.window,
                  layer_types=_layer_types(cfg), num_sliding_attention_heads=cfg.local_heads or cfg.n_heads,
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  query_pre_attn_scalar=scalar, rope_parameters=rope,
                  swiglu_limits=limits(cfg.swiglu_limit, cfg.swiglu_limit_layers),
                  swiglu_limits_shared=limits(cfg.shared_swiglu_limit, cfg.shared_swiglu_limit_layers), num_nextn_predict_layers=0)
    elif model_type == "hy_v3":
        moe_fields = _deepseek_moe_config(cfg)
        hf.update(num_experts=cfg.n_experts, num_shared_experts=moe_fields["n_shared_experts"], moe_intermediate_size=cfg.ffn_expert,
                  intermediate_size=cfg.ffn_dense, router_scaling_factor=moe_fields["routed_scaling_factor"], attention_bias=cfg.qkv_bias,
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)])
    elif model_type == "hunyuan_v1_moe":
        hf.update(num_experts=cfg.n_experts, moe_topk=cfg.k, intermediate_size=cfg.ffn_expert, attention_bias=False)
    elif model_type == "ernie4_5_moe":
        hf.pop("num_experts_per_tok")
        hf.update(moe_num_experts=cfg.n_experts, moe_k=cfg.k, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  moe_num_shared_experts=cfg.n_shared, use_bias=False, moe_norm_min=1e-12, **_ernie_moe_layers(cfg.n_layers, moe))
    elif model_type == "solar_open":  # no dense blocks, no MTP: those fields are not Solar Open's
        moe_fields = _deepseek_moe_config(cfg)
        hf.update({k: v for k, v in moe_fields.items() if k not in ("intermediate_size", "first_k_dense_replace", "num_nextn_predict_layers")},
                  attention_bias=cfg.qkv_bias)
    elif model_type == "exaone_moe":
        moe_fields = _deepseek_moe_config(cfg)
        hf.update(num_experts=moe_fields.pop("n_routed_experts"), num_shared_experts=moe_fields.pop("n_shared_experts"),
                  **{k: v for k, v in moe_fields.items() if k != "num_nextn_predict_layers"}, attention_bias=False,
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  sliding_window=cfg.window, layer_types=_layer_types(cfg))
    elif model_type == "beam":
        moe_fields, kinds = _deepseek_moe_config(cfg), _layer_types(cfg)

        def rope_of(kind: str) -> Optional[dict]:  # None: the layers of this kind are NoPE
            if all(cfg.is_nope(i) for i, k in enumerate(kinds) if k == kind):
                return None
            return dict(rope_type="default", rope_theta=cfg.local_rope_base) if kind == "sliding_attention" and cfg.local_rope_base else _rope_parameters(cfg)

        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  **{k: moe_fields[k] for k in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")},
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)], layer_types=kinds,
                  sliding_window=cfg.window, rope_parameters={kind: rope_of(kind) for kind in ("full_attention", "sliding_attention")},
                  final_logit_softcapping=cfg.logit_softcap, attention_bias=False)
    elif model_type in ("gemma4_text", "gemma4_unified_text"):  # GeGLU; the sliding layers' geometry at the top level, the full ones'
        hf.pop("hidden_act")                                         # per layer; each type's RoPE
        hf.pop("num_experts_per_tok")
        full = [i for i in range(cfg.n_layers) if not cfg.is_sliding(i)]
        hf.update(hidden_activation="gelu_pytorch_tanh", head_dim=cfg.local_head_dim or cfg.head_dim, num_key_value_heads=cfg.local_kv_heads or cfg.n_kv_heads,
                  per_layer_config={str(i): dict(head_dim=cfg.head_dim, num_key_value_heads=cfg.n_kv_heads) for i in full},
                  attention_k_eq_v=cfg.global_k_eq_v, layer_types=_layer_types(cfg), sliding_window=cfg.window or 512,
                  rope_parameters=_proportional_rope_parameters(cfg), final_logit_softcapping=cfg.logit_softcap, hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_bias=False,
                  intermediate_size=cfg.ffn_dense, enable_moe_block=bool(moe))
        if model_type == "gemma4_unified_text":  # no MoE block, no per-layer embeddings in its config
            if moe:
                raise ValueError(f"model: gemma4_unified_text is a dense family; this model has MoE layers {moe}")
            for field in ("enable_moe_block", "hidden_size_per_layer_input"):
                hf.pop(field)
            hf.update(use_bidirectional_attention=None, use_double_wide_mlp=False)
        if moe:
            hf.update(num_experts=cfg.n_experts, top_k_experts=cfg.k, moe_intermediate_size=cfg.ffn_expert)
    elif model_type == "kolibri1":
        hf.update(num_local_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, shared_expert_intermediate_size=cfg.shared_size,
                  norm_topk_prob=cfg.route_normalize, sliding_window=cfg.window, layer_types=_layer_types(cfg))
    elif model_type == "jetmoe":  # its heads from the kv heads and the top-k; head_dim is kv_channels
        for name in ("num_attention_heads", "head_dim", "hidden_act"):
            hf.pop(name)
        hf.update(kv_channels=cfg.head_dim, num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, activation_function="silu",
                  aux_loss_coef=cfg.moa_aux_coeff)
    elif model_type == "minimax_m3_vl_text":
        blocks = [i for i in range(cfg.n_layers) if cfg.is_index_blocks(i)]
        index = dict(index_topk_blocks=cfg.index_topk_blocks, index_block_size=cfg.index_block_size, index_local_blocks=cfg.index_local_blocks,
                     index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim) if blocks else {}
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, dense_intermediate_size=cfg.ffn_dense,
                  shared_intermediate_size=cfg.shared_size, routed_scaling_factor=cfg.route_scale if cfg.route_scale is not None else 1.0,
                  swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, mlp_layer_types=["sparse" if i in moe else "dense" for i in range(cfg.n_layers)],
                  layer_types=["minimax_m3_sparse" if i in blocks else "full_attention" for i in range(cfg.n_layers)], **index)
        hf["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(cfg)
    elif model_type == "flint":
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense, decoder_sparse_step=1,
                  mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe], norm_topk_prob=cfg.route_normalize,
                  shared_expert_intermediate_size=cfg.shared_size, attention_bias=cfg.qkv_bias, sliding_window=cfg.window or 513,
                  layer_types=_layer_types(cfg))
    elif model_type == "mellum":
        hf.update(num_local_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  norm_topk_prob=not cfg.pre_softmax, attention_bias=cfg.qkv_bias, sliding_window=cfg.window or 1024, layer_types=_layer_types(cfg),
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  rope_parameters=_rope_by_layer_type_parameters(cfg, _rope_parameters(cfg)))
    elif model_type in ("qwen3_next", "qwen3_5_moe_text"):
        if model_type == "qwen3_next":  # Qwen3.5-MoE's blocks are all MoE, renormalised
            hf.update(intermediate_size=cfg.ffn_dense, decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe],
                      norm_topk_prob=not cfg.pre_softmax)
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, shared_expert_intermediate_size=cfg.shared_size,
                  **_qwen3_5_fields(cfg))
    elif model_type == "lara_mini":
        lin = cfg.linear_attention_config()
        kinds = ["linear_attention" if cfg.is_linear(i) else "sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layers)]
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, shared_expert_intermediate_size=cfg.shared_size,
                  norm_topk_prob=not cfg.pre_softmax, attention_bias=cfg.qkv_bias, sliding_window=cfg.window or 512, layer_types=kinds,
                  linear_num_key_heads=lin.n_k_heads, linear_num_value_heads=lin.n_v_heads, linear_key_head_dim=lin.k_head_dim,
                  linear_value_head_dim=lin.v_head_dim, linear_conv_kernel_dim=lin.conv)
    elif model_type == "kimi_linear":  # MLA without RoPE beside Kimi Delta Attention, DeepSeek-V3's MoE blocks
        lin, moe_fields = cfg.linear_attention_config(), _deepseek_moe_config(cfg)
        rope = cfg.rope_dim or cfg.head_dim
        hf.update(num_experts=moe_fields.pop("n_routed_experts"), num_shared_experts=moe_fields.pop("n_shared_experts"),
                  num_expert_group=moe_fields.pop("n_group"), moe_renormalize=moe_fields.pop("norm_topk_prob"),
                  **{k: v for k, v in moe_fields.items() if k not in ("first_k_dense_replace", "num_nextn_predict_layers")},
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                  linear_num_heads=lin.n_v_heads, linear_head_dim=lin.k_head_dim, linear_conv_kernel_dim=lin.conv,
                  q_lora_rank=cfg.q_rank, kv_lora_rank=cfg.kv_rank, qk_nope_head_dim=cfg.head_dim - rope, qk_rope_head_dim=rope,
                  v_head_dim=cfg.v_head_dim, head_dim=rope, attention_bias=False)
        hf.pop("num_experts_per_tok")
        hf.update(num_experts_per_token=cfg.k)
    elif model_type == "bailing_hybrid":  # Ling's Kimi Delta Attention beside gated MLA, DeepSeek-V3's MoE blocks, under Ling's names
        lin, moe_fields = cfg.linear_attention_config(), _deepseek_moe_config(cfg)
        hf.update(num_experts=moe_fields.pop("n_routed_experts"), num_shared_experts=moe_fields.pop("n_shared_experts"),
                  num_expert_group=moe_fields.pop("n_group"), moe_renormalize=moe_fields.pop("norm_topk_prob"),
                  **{k: v for k, v in moe_fields.items() if k != "first_k_dense_replace"},
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                  linear_num_heads=lin.n_v_heads, linear_head_dim=lin.k_head_dim, linear_conv_kernel_dim=lin.conv, short_conv_kernel_size=lin.conv,
                  kda_safe_gate=lin.decay_bound is not None, kda_lower_bound=-5.0 if lin.decay_bound is None else lin.decay_bound)
        hf.pop("num_experts_per_tok")
        hf.update(num_experts_per_token=cfg.k)
    elif model_type in _DEEPSEEK_STYLE or model_type == "longcat_flash":  # their fields, below
        pass
    elif model_type == "lfm2_moe":
        hf.update(_lfm2_config(cfg), num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  num_dense_layers=cfg.n_dense, use_expert_bias=cfg.expert_bias, norm_topk_prob=cfg.route_normalize,
                  routed_scaling_factor=cfg.route_scale if cfg.route_scale is not None else 1.0)
    elif model_type == "mimo_v2_flash":  # DeepSeek-V3's routing without shared experts; each layer type's RoPE, kv heads and sinks
        if cfg.local_kv_heads not in (None, 2 * cfg.n_kv_heads) or (cfg.window is not None and cfg.local_kv_heads is None):
            raise ValueError(f"model: MiMo-V2-Flash's sliding layers have twice the kv heads, 2 x {cfg.n_kv_heads}; this model's have "
                             f"{cfg.local_kv_heads or cfg.n_kv_heads}")
        moe_fields = _deepseek_moe_config(cfg)
        hf.update({k: v for k, v in moe_fields.items() if k not in ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers")},
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)], layer_types=_layer_types(cfg),
                  sliding_window=cfg.window or 129, v_head_dim=cfg.v_head_dim or cfg.head_dim, attention_value_scale=cfg.value_scale,
                  attention_bias=cfg.qkv_bias,
                  rope_parameters=_rope_by_layer_type_parameters(cfg, dict(_rope_parameters(cfg), partial_rotary_factor=_rotary_factor(cfg))))
    elif model_type in ("mamba2", "mamba", "falcon_mamba"):  # no attention, no MLP: its mixers' fields alone
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "rope_parameters", "num_experts_per_tok"):
            hf.pop(name)
        hf.update(_mamba2_model_config(cfg) if model_type == "mamba2" else _mamba_config(cfg, model_type))
    elif model_type == "jamba":  # no RoPE (config_mismatch names a block with it); the layers' kinds by period and offset
        hf.pop("rope_parameters")
        hf.update(_jamba_config(cfg))
    elif model_type == "nemotron_h":  # its layers, not fmoe's blocks; no RoPE (config_mismatch names a block with it)
        for name in ("num_hidden_layers", "rms_norm_eps", "hidden_act", "rope_parameters", "num_experts_per_tok"):
            hf.pop(name)
        hf.update(_nemotron_h_config(cfg))
    elif model_type == "mistral4":  # DeepSeek-V3's fields (the MLA ones below) but MTP's; softmax routing
        hf.update({k: v for k, v in _deepseek_moe_config(cfg).items() if k != "num_nextn_predict_layers"}, norm_topk_prob=not cfg.pre_softmax)
    elif model_type in DENSE_FAMILIES:
        if moe:
            raise ValueError(f"model: {model_type} is a dense family; this model has MoE layers {moe}")
        hf.pop("num_experts_per_tok")
        hf.update(intermediate_size=cfg.ffn_dense, mlp_bias=cfg.mlp_bias)
        if model_type in ("llama", "internlm3", "iquestcoder", "exaone"):  # Llama's model: its biases on q, k, v and o (InternLM3's on the MLPs too)
            if model_type == "internlm3" and cfg.qkv_bias != cfg.mlp_bias:
                raise ValueError(f"model: InternLM3's attention and MLP biases are one setting; this model has qkv_bias = {cfg.qkv_bias}, "
                                 f"mlp_bias = {cfg.mlp_bias}")
            hf.update(attention_bias=cfg.qkv_bias)
        elif model_type == "jais2":  # its LayerNorms' eps under their own name, MLPs without a gate
            hf.pop("rms_norm_eps")
            hf.update(layer_norm_eps=cfg.norm_eps, hidden_act="relu2", attention_bias=cfg.qkv_bias)
        elif model_type == "muse_glimmer_text":  # its activation's field, scales, post-norms' eps and RoPE or none per layer
            hf.pop("hidden_act")
            hf.pop("mlp_bias")
            hf.update(hidden_activation="gelu_pytorch_tanh" if cfg.mlp_act == "gelu_tanh" else "silu", **_muse_fields(cfg))
        elif model_type == "nanochat":  # MLPs without a gate, the logits' cap
            hf.pop("mlp_bias")
            hf.update(hidden_act="relu2", attention_bias=False, final_logit_softcapping=cfg.logit_softcap)
        elif model_type == "mistral":
            hf.update(sliding_window=cfg.window)
        elif model_type == "phi":  # its LayerNorms' eps and activation under their own names, RoPE's part of each head
            hf.pop("rms_norm_eps")
            hf.pop("mlp_bias")
            hf.update(layer_norm_eps=cfg.norm_eps, hidden_act="gelu_new", qk_layernorm=False,
                      rope_parameters=dict(hf["rope_parameters"], partial_rotary_factor=_rotary_factor(cfg)))
        elif model_type == "starcoder2":  # its LayerNorms' eps and activation under their own names, one setting for every bias
            if not cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias:
                raise ValueError(f"model: StarCoder2's biases are one setting (use_bias); this model has qkv_bias = {cfg.qkv_bias}, o_bias = "
                                 f"{cfg.o_bias}, mlp_bias = {cfg.mlp_bias}")
            hf.pop("rms_norm_eps")
            hf.pop("mlp_bias")
            hf.update(norm_epsilon=cfg.norm_eps, hidden_act="gelu_pytorch_tanh", use_bias=cfg.qkv_bias, sliding_window=cfg.window)
        elif model_type == "gpt_neox":  # its LayerNorms' eps, activation and parallel residual under their own names
            if cfg.parallel_blocks != cfg.parallel_norms:
                raise ValueError("model: GPT-NeoX's parallel residual gives the MLP its own LayerNorm (parallel_norms with parallel_blocks); "
                                 f"this model has parallel_blocks = {cfg.parallel_blocks}, parallel_norms = {cfg.parallel_norms}")
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim"):
                hf.pop(field)
            hf.update(layer_norm_eps=cfg.norm_eps, hidden_act="gelu" if cfg.mlp_act == "gelu" else "gelu_new", attention_bias=cfg.qkv_bias,
                      use_parallel_residual=cfg.parallel_blocks, rope_parameters=dict(hf["rope_parameters"], partial_rotary_factor=_rotary_factor(cfg)))
        elif model_type == "falcon":  # its own field names; the kv heads and norms by its architecture flags
            if not cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias:
                raise ValueError(f"model: Falcon's biases are one setting (bias); this model has qkv_bias = {cfg.qkv_bias}, o_bias = {cfg.o_bias}, "
                                 f"mlp_bias = {cfg.mlp_bias}")
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "hidden_act", "intermediate_size"):
                hf.pop(field)
            new = cfg.parallel_blocks and (cfg.parallel_norms or cfg.n_kv_heads not in (1, cfg.n_heads))  # the kv heads a number of their own
            hf.update(layer_norm_epsilon=cfg.norm_eps, bias=cfg.qkv_bias, activation="gelu", alibi=cfg.alibi, ffn_hidden_size=cfg.ffn_dense,
                      parallel_attn=cfg.parallel_blocks, new_decoder_architecture=new, multi_query=cfg.n_kv_heads == 1,
                      num_kv_heads=cfg.n_kv_heads, num_ln_in_parallel_attn=(2 if cfg.parallel_norms else 1) if new else None)
        elif model_type == "persimmon":  # its LayerNorms' eps, the q/k LayerNorms or none, RoPE's part of each head
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim"):
                hf.pop(field)
            hf.update(layer_norm_eps=cfg.norm_eps, hidden_act="relu2", qk_layernorm=cfg.qk_norm is not None,
                      rope_parameters=dict(hf["rope_parameters"], partial_rotary_factor=_rotary_factor(cfg)))
        elif model_type == "bloom":  # its own field names; ALiBi, its norms, its biases and 4 H MLP channels are the model's (config_mismatch)
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "hidden_act", "intermediate_size", "rope_parameters",
                          "num_hidden_layers", "num_attention_heads"):
                hf.pop(field)
            hf.update(n_layer=cfg.n_layers, n_head=cfg.n_heads, layer_norm_epsilon=cfg.norm_eps, apply_residual_connection_post_layernorm=False,
                      pretraining_tp=1, slow_but_exact=False)
        elif model_type == "mpt":  # its own field names, the attention's in attn_config
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "hidden_act", "intermediate_size", "rope_parameters",
                          "num_hidden_layers", "num_attention_heads", "hidden_size"):
                hf.pop(field)
            hf.update(d_model=cfg.hidden, n_layers=cfg.n_layers, n_heads=cfg.n_heads, layer_norm_epsilon=cfg.norm_eps, expansion_ratio=4, no_bias=True,
                      norm_type="low_precision_layernorm", logit_scale=None, learned_pos_emb=False,
                      attn_config=dict(_MPT_ATTN, clip_qkv=cfg.clip_qkv, softmax_scale=cfg.attn_scale))
        elif model_type == "gpt_neo":  # its own field names, each layer's kind, the learned positions' count
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "rope_parameters", "num_hidden_layers", "num_attention_heads",
                          "hidden_act"):
                hf.pop(field)
            hf.update(num_layers=cfg.n_layers, num_heads=cfg.n_heads, layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
                      attention_types=[[["local" if cfg.is_sliding(i) else "global"], 1] for i in range(cfg.n_layers)], window_size=cfg.window or 256,
                      max_position_embeddings=cfg.abs_positions)
        elif model_type == "opt":  # its own field names, one bias setting, the learned positions' count (the table's two extra rows implied)
            if not cfg.qkv_bias == cfg.o_bias == cfg.mlp_bias:
                raise ValueError(f"model: OPT's biases are one setting (enable_bias); this model has qkv_bias = {cfg.qkv_bias}, o_bias = "
                                 f"{cfg.o_bias}, mlp_bias = {cfg.mlp_bias}")
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "rope_parameters", "intermediate_size", "hidden_act"):
                hf.pop(field)
            hf.update(ffn_dim=cfg.ffn_dense, activation_function="relu", enable_bias=cfg.qkv_bias, do_layer_norm_before=True,
                      word_embed_proj_dim=cfg.hidden, max_position_embeddings=cfg.abs_positions)
        elif model_type == "biogpt":  # its activation, the learned positions' count, sqrt(H) or no scale of the embeddings (config_mismatch)
            for field in ("rms_norm_eps", "mlp_bias", "num_key_value_heads", "head_dim", "rope_parameters"):
                hf.pop(field)
            hf.update(hidden_act="gelu" if cfg.mlp_act == "gelu" else "relu" if cfg.mlp_act == "relu" else "gelu_new",
                      max_position_embeddings=cfg.abs_positions, scale_embedding=cfg.embed_scale != 1.0)
        elif model_type in ("gpt_bigcode", "gpt2", "gptj", "codegen"):  # GPT-2's field names (_GPT2_ALIASES), RoPE's fixed base (GPT-J's)
            for field in ("mlp_bias", "num_key_value_heads", "head_dim", "rope_parameters", *_GPT2_ALIASES):
                hf.pop(field)
            hf.update(n_embd=cfg.hidden, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.ffn_dense, layer_norm_epsilon=cfg.norm_eps,
                      activation_function="gelu_pytorch_tanh" if model_type == "gpt_bigcode" else "gelu_new")
            if model_type in ("gptj", "codegen"):  # config_mismatch names another RoPE base than their fixed 10000
                hf.update(rotary_dim=cfg.rope_dim or cfg.head_dim)
            else:
                hf.update(scale_attn_weights=cfg.attn_scale is None, n_positions=cfg.abs_positions)
            if model_type == "gpt_bigcode":
                hf.update(multi_query=cfg.n_kv_heads == 1)
        elif model_type == "olmo":  # its LayerNorms' eps fixed at 1e-5, q/k/v's bound
            hf.pop("rms_norm_eps")
            hf.update(attention_bias=cfg.qkv_bias, clip_qkv=cfg.clip_qkv)
        elif model_type in ("ministral", "cwm"):  # each layer's window or none; a width written even where no layer uses it (gpt_oss's)
            hf.update(sliding_window=cfg.window or (4096 if model_type == "ministral" else 8192), layer_types=_layer_types(cfg))
        elif model_type == "ministral3":
            hf.update(sliding_window=cfg.window, rope_parameters=_ministral3_rope(cfg))
        elif model_type in ("olmo2", "hunyuan_v1_dense"):
            hf.update(attention_bias=False)
        elif model_type == "olmo3":  # each layer type's RoPE: YaRN or plain in the full layers, plain at its base in the sliding ones
            full = _yarn_parameters(cfg) if cfg.yarn_factor is not None else _rope_parameters(cfg)
            hf.update(attention_bias=False, sliding_window=cfg.window or 4096, layer_types=_layer_types(cfg),
                      rope_parameters=_rope_by_layer_type_parameters(cfg, full))
        elif model_type == "bamba":  # RoPE on half of each head's channels unless partial_rotary_factor says otherwise
            hf.update(attention_bias=False, attn_layer_indices=[i for i in range(cfg.n_layers) if not cfg.is_linear(i)], **_mamba2_config(cfg))
            if (cfg.rope_dim or cfg.head_dim) * 2 != cfg.head_dim:
                hf["rope_parameters"] = dict(hf.get("rope_parameters") or {}, partial_rotary_factor=(cfg.rope_dim or cfg.head_dim) / cfg.head_dim)
        elif model_type == "falcon_h1":  # the multipliers fmoe keeps as knobs; the others 1, folded into the weights (_falcon_h1_folds)
            gate_norm = cfg.linear_gate_norm
            hf.update(attention_bias=False, projectors_bias=False, **_mamba2_config(cfg, ssm_channels=True),
                      mamba_rms_norm=gate_norm != "none", mamba_norm_before_gate=gate_norm != "after",
                      embedding_multiplier=cfg.embed_scale, lm_head_multiplier=1 / cfg.logit_divisor, key_multiplier=1.0,
                      attention_in_multiplier=1.0, attention_out_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
                      ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0, 1.0])
        elif model_type == "smollm3":
            hf.update(attention_bias=cfg.qkv_bias, no_rope_layers=[int(not cfg.is_nope(i)) for i in range(cfg.n_layers)],
                      use_sliding_window=cfg.window is not None, sliding_window=cfg.window, layer_types=_layer_types(cfg))
        elif model_type == "exaone4":  # without a window, every layer global (layer_types written: transformers divides by the pattern)
            hf.update(sliding_window=cfg.window, layer_types=_layer_types(cfg))
        elif model_type == "cohere_compass_text":  # each layer type's RoPE (null: none) at its base
            hf.pop("rms_norm_eps")
            roped = {kind: None if cfg.is_nope(i) else dict(rope_type="default", rope_theta=cfg.local_rope_base if cfg.is_local(i) and
                                                            cfg.local_rope_base is not None else cfg.rope_base)
                     for i, kind in enumerate(_layer_types(cfg))}
            hf.update(layer_norm_eps=cfg.norm_eps, logit_scale=1 / cfg.logit_divisor, attention_bias=False, sliding_window=cfg.window or 4096,
                      layer_types=_layer_types(cfg), rope_parameters=roped)
        elif model_type in ("cohere", "cohere2"):  # the LayerNorms' eps under their own name, the logits' scale
            hf.pop("rms_norm_eps")
            hf.update(layer_norm_eps=cfg.norm_eps, logit_scale=1 / cfg.logit_divisor, attention_bias=False)
            if model_type == "cohere":
                hf.update(use_qk_norm=cfg.qk_norm == "head_layer")
            if model_type == "cohere2":
                hf.update(sliding_window=cfg.window or 4096, layer_types=_layer_types(cfg))
        elif model_type == "ernie4_5":
            hf.update(use_bias=False)
        elif model_type == "lfm2":  # the FFN's size as it is
            hf.update(_lfm2_config(cfg), block_auto_adjust_ff_dim=False)
        elif model_type == "lfm3":  # the window's layers beside the conv and full ones, each type's RoPE; the gate and sandwich norms
            hf.update(_lfm2_config(cfg), sliding_window=cfg.window or 256, rope_parameters=_proportional_rope_parameters(cfg),
                      use_attention_gate=cfg.attn_gate, use_sandwich_norm=cfg.post_norms, attention_bias=False,
                      layer_types=["conv" if cfg.is_linear(i) else "sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.n_layers)])
        elif model_type == "seed_oss":
            hf.update(attention_bias=cfg.qkv_bias, attention_out_bias=cfg.o_bias)
        elif model_type in ("phi3", "glm4", "glm"):  # RoPE on the first partial_rotary_factor of each head
            hf["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(cfg)
            if model_type == "phi3" and cfg.longrope_short_factors is not None:  # transformers reads the top level's, by default 4096
                hf.update(original_max_position_embeddings=cfg.longrope_original_max_positions)
            hf.update(dict(sliding_window=cfg.window) if model_type == "phi3" else dict(attention_bias=cfg.qkv_bias))
        elif model_type == "stablelm":  # its LayerNorms' eps under its own name, RoPE on the first part of each head (head_dim: hidden / heads)
            for name in ("rms_norm_eps", "head_dim"):
                hf.pop(name)
            hf["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(cfg)
            hf.update(layer_norm_eps=cfg.norm_eps, use_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_norm == "head_layer",
                      use_parallel_residual=cfg.parallel_blocks)
        elif model_type in ("apertus", "apertus1p5_text"):  # xIELU: hidden_act names it; Apertus 1.5's pruned head
            hf.update(hidden_act="xielu", attention_bias=False, **({"output_vocab_size": cfg.out_vocab} if model_type == "apertus1p5_text" else {}))
        elif model_type == "nemotron":  # LayerNorm1P's eps under its own name, MLPs without a gate, RoPE on the first part of each head
            hf.pop("rms_norm_eps")
            hf["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(cfg)
            hf.update(norm_eps=cfg.norm_eps, hidden_act="relu2", attention_bias=False)
        elif model_type == "qwen3_5_text":  # Qwen3.5-MoE's blocks with a dense MLP
            hf.update(_qwen3_5_fields(cfg))
        elif model_type == "olmo_hybrid":  # no head_dim (hidden / heads) and no window; the linear blocks' fields
            lin = cfg.linear_attention_config()
            hf.pop("head_dim")
            hf.update(attention_bias=False, layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention" for i in range(cfg.n_layers)],
                      linear_num_key_heads=lin.n_k_heads, linear_num_value_heads=lin.n_v_heads, linear_key_head_dim=lin.k_head_dim,
                      linear_value_head_dim=lin.v_head_dim, linear_conv_kernel_dim=lin.conv, linear_allow_neg_eigval=lin.neg_eigval)
        elif model_type == "helium":  # RoPE on interleaved pairs: always, in Helium
            hf.update(attention_bias=False)
        elif model_type == "minicpm3":  # its multipliers under its own names (_minicpm3)
            base = cfg.hidden / cfg.logit_divisor
            if not base.is_integer():
                raise ValueError(f"model: logit_divisor = {cfg.logit_divisor} is not hidden / an integer (MiniCPM3's dim_model_base)")
            hf.update(scale_emb=cfg.embed_scale, scale_depth=cfg.residual_scale * math.sqrt(cfg.n_layers), dim_model_base=int(base), mlp_bias=False)
            if cfg.longrope_short_factors is not None:  # transformers reads the top level's
                hf.update(original_max_position_embeddings=cfg.longrope_original_max_positions)
        elif model_type == "arcee":  # an MLP without a gate; YaRN or plain RoPE
            hf.update(hidden_act="relu2", attention_bias=False, rope_parameters=_yarn_parameters(cfg) if cfg.yarn_factor is not None else _rope_parameters(cfg))
        elif model_type == "gemma":  # GeGLU
            hf.update(hidden_act="gelu_pytorch_tanh", attention_bias=False)
        elif model_type in ("gemma2", "gemma3_text", "vaultgemma"):  # GeGLU; the softmax scale as query_pre_attn_scalar; Gemma 3's RoPE per layer type
            hf.pop("hidden_act")
            hf.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_query_pre_attn_scalar(cfg), sliding_window=cfg.window or 4096,
                      layer_types=_layer_types(cfg), final_logit_softcapping=cfg.logit_softcap, attn_logit_softcapping=cfg.attn_softcap,
                      attention_bias=False)
            if model_type == "gemma3_text":
                full = dict(_rope_parameters(cfg), **({} if cfg.rope_linear_factor is None else dict(rope_type="linear", factor=cfg.rope_linear_factor)))
                hf.update(rope_parameters=_rope_by_layer_type_parameters(cfg, full))
        elif model_type == "hyperclovax":  # the logits multiplied by logits_scaling; no attention_multiplier: 1/sqrt(head_dim)
            hf.update(attention_bias=False, use_post_norm=cfg.post_norms,
                      **dict(_granite_multiplier_fields(cfg), attention_multiplier=cfg.attn_scale, logits_scaling=1 / cfg.logit_divisor))
        elif model_type in ("granite", "granite_swa"):
            cfg = _granite_scaled(cfg)
            hf.update(attention_bias=False, **_granite_multiplier_fields(cfg))
            if model_type == "granite_swa":
                hf.update(_granite_swa_fields(cfg))
        else:
            hf.update(use_sliding_window=cfg.window is not None, sliding_window=cfg.window, max_window_layers=cfg.n_layers,
                      layer_types=_layer_types(cfg), **(dict(attention_bias=False) if model_type == "qwen3" else {}))
    elif model_type == "muse_spark_text":  # Muse Glimmer's fields, the latent MoE's, the residual gates' temperature
        hf.update(num_local_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense, moe_hidden_size=cfg.moe_latent,
                  mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
                  routed_scaling_factor=cfg.route_scale if cfg.route_scale is not None else 1.0,
                  residual_gate_temperature=cfg.residual_gate_temperature, **_muse_fields(cfg))
    elif model_type in ("olmoe", "flex_olmo"):
        hf.update(num_experts=cfg.n_experts, intermediate_size=cfg.ffn_expert, norm_topk_prob=not cfg.pre_softmax)
    else:
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.ffn_expert, intermediate_size=cfg.ffn_dense,
                  decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe],
                  norm_topk_prob=not cfg.pre_softmax)
        if model_type == "qwen2_moe":
            hf.update(shared_expert_intermediate_size=cfg.shared_size, qkv_bias=cfg.qkv_bias)
    if model_type in _DEEPSEEK_STYLE:
        hf.update(_deepseek_moe_config(cfg))
    if model_type == "longcat_flash":  # its own names; num_layers of two sublayers each; MLA as DeepSeek-V3's (below)
        scale = _deepseek_moe_config(cfg)["routed_scaling_factor"]
        hf.pop("num_hidden_layers")
        hf.pop("num_experts_per_tok")
        hf.update(num_layers=cfg.n_layers // 2, moe_topk=cfg.k, n_routed_experts=cfg.n_experts, ffn_hidden_size=cfg.ffn_dense,
                  expert_ffn_hidden_size=cfg.ffn_expert, zero_expert_num=cfg.zero_experts, routed_scaling_factor=scale, router_bias=cfg.router_bias)
    if model_type == "deepseek_v2":
        hf.update(topk_method="group_limited_greedy" if cfg.n_groups else "greedy")
    if model_type in ("glm4_moe", "sarvam_moe", "minimax_m2"):
        hf["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(cfg)
    if model_type in ("glm4_moe", "sarvam_moe"):
        hf.update(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm == "head")
    if model_type == "dots1":
        hf.update(attention_bias=cfg.qkv_bias, sliding_window=cfg.window, max_window_layers=cfg.n_layers, layer_types=_layer_types(cfg))
    if model_type in ("glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "axk1", "hy_v4", "hy_v4_vl_text", "axk2"):
        hf.update(mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)])
    if model_type in _NO_MTP_COUNT:  # no first_k_dense_replace (mlp_layer_types says it) nor MTP field in their configs
        hf.pop("first_k_dense_replace")
        hf.pop("num_nextn_predict_layers")
    if model_type == "axk2":  # the gated norms; no groups (refused on read), written as A.X-K2-Light's None
        hf.update(gated_norm_rank=cfg.norm_gate_rank, layer_types=["indexed_attention"] * cfg.n_layers,
                  **({} if cfg.n_groups else dict(n_group=None, topk_group=None)))
    if model_type in ("hy_v4", "hy_v4_vl_text"):  # the streams, the clamp
        if cfg.hyper_connections < 2 or cfg.hc_kind != "independent" or cfg.swiglu_limit is None:
            raise ValueError(f"model: its config has no hy_v4 equivalent: HY-V4's blocks are independent hyper-connections with the routed "
                             f"experts' SwiGLU clamped (hyper_connections >= 2, hc_kind='independent', swiglu_limit), got hyper_connections="
                             f"{cfg.hyper_connections}, hc_kind={cfg.hc_kind!r}, swiglu_limit={cfg.swiglu_limit}")
        hf.update(hc_mult=cfg.hyper_connections, hc_magnitude=cfg.hc_magnitude, hc_eps=cfg.hc_eps, swiglu_limit=cfg.swiglu_limit,
                  layer_types=["indexed_attention"] * cfg.n_layers)
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2", "sarvam_mla", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "mistral4", "axk1",
                      "longcat_flash", "bailing_hybrid", "hy_v4", "hy_v4_vl_text", "axk2", "youtu", "minicpm3"):
        rope = cfg.rope_dim or cfg.head_dim
        hf.update(q_lora_rank=cfg.q_rank, kv_lora_rank=cfg.kv_rank, qk_nope_head_dim=cfg.head_dim - rope, qk_rope_head_dim=rope,
                  v_head_dim=cfg.v_head_dim, head_dim=rope, attention_bias=False)
        if model_type in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "hy_v4_vl_text", "axk2"):
            hf.update(index_topk=cfg.index_topk, index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim)
            if model_type in ("glm_moe_dsa", "hy_v4", "hy_v4_vl_text"):
                hf.update(indexer_types=["shared" if cfg.is_index_shared(i) else "full" for i in range(cfg.n_layers)])
        # no such field where the family's RoPE is always on interleaved pairs (HY-V4's: always on halves; HY-V4-VL's on pairs)
        if model_type not in ("deepseek_v32", "glm_moe_dsa", "longcat_flash", "bailing_hybrid", "hy_v4", "hy_v4_vl_text", "axk2", "minicpm3"):
            hf.update(rope_interleave=cfg.rope_interleaved)
        if cfg.yarn_factor is not None:
            hf["rope_parameters"] = _yarn_parameters(cfg)
        if model_type == "hy_v4_vl_text":  # its multimodal RoPE's sections (text positions: all of them the plain RoPE's)
            hf["rope_parameters"]["mrope_section"] = [rope // 2, 0, 0]
    if model_type == "mistral4":  # the queries' scale by position, and the rotated share of each head
        hf["rope_parameters"].update(**_query_temperature_parameters(cfg, cfg.yarn_original_max_positions),
                                     partial_rotary_factor=_rotary_factor(cfg))
        hf["head_dim"] = cfg.head_dim  # Mistral 4's RoPE rotates partial_rotary_factor x head_dim (nope + rope) channels
    return _equivalent(cfg, hf)


def _equivalent(cfg: TransformerConfig, hf: dict) -> dict:
    """hf, the config.json hf_config built for cfg, where it describes cfg; else a ValueError
    naming what it cannot hold: the knobs that read back otherwise ({knob: (cfg's, the
    family's)}, config_mismatch; a capacity factor, which no family has), or the family's
    own refusal of the config (a field it needs that cfg leaves unset)."""
    model_type = hf["model_type"]
    try:
        mismatch = config_mismatch(cfg, hf)
    except ValueError as err:  # read back as no model of the family: said as what it is, not as a config.json being loaded
        raise ValueError(f"model: its config has no {model_type} equivalent: {str(err).removeprefix('config.json: ')}") from None
    if cfg.capacity_factor is not None:
        mismatch["capacity_factor"] = (cfg.capacity_factor, None)
    if mismatch:
        raise ValueError(f"model: its config has no {model_type} equivalent: {mismatch}")
    return hf


def _ernie_moe_layers(n_layers: int, moe: list[int], *, strict: bool = False) -> dict:
    """ERNIE 4.5's placement of the MoE blocks (every interval-th block from start to end)
    that gives `moe` of n_layers blocks, the smallest interval that does; where none does, the
    contiguous run's fields, which config_mismatch then reports as a mismatch of the MoE
    layers (strict: a ValueError)."""
    start, end = (moe[0], moe[-1]) if moe else (n_layers, n_layers - 1)
    for step in range(1, n_layers + 1):
        if [i for i in range(n_layers) if (i + 1) % step == 0 and start <= i <= end] == moe:
            return dict(moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=step)
    if strict:
        raise ValueError(f"config.json: MoE blocks {moe} are not supported (every interval-th block from a start to an end, ERNIE 4.5's)")
    return dict(moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=1)


def _check_writable(model_type: str) -> None:
    """ValueError for a family whose folders hold more than fmoe reads (Llama 4's vision
    model, Family.written_as): such a folder is not written back incomplete."""
    family = FAMILIES[model_type]
    if family.written_as is None:
        return
    if family.written_as == "text_config":
        kinds = _TEXT_OF[model_type][0] if model_type in _TEXT_OF else _TEXT_KINDS[model_type]
        what = f"its text model's model_type (one of {', '.join(kinds)})"
    else:
        what = f"model_type={family.written_as!r} to write what fmoe holds ({FAMILIES[family.written_as].architecture})"
    unread = family.unread(mtp_read=True)  # an MTP module it reads where the folder holds it
    raise ValueError(f"model_type: a {model_type} folder holds a model fmoe does not read ({', '.join(unread)}), so it is not written; "
                     f"pass {what}, or set model.hf_config = written_config(model.hf_config) to keep the folder's own text config")


def written_config(hf: dict) -> dict:
    """The config.json that a loaded folder's model is written back with: the folder's own,
    or for a family whose folders hold more than fmoe reads (Family.written_as: a released
    llama4 folder) its text_config as that family's (llama4_text, Llama4ForCausalLM: token
    ids, RoPE and every text field kept; a mistral3 folder's as its text model's own; the logit
    scale 1 where the whole model's class applies none, _unscaled)."""
    family = FAMILIES[hf["model_type"]]
    if family.written_as is None:
        return hf
    text = (_multimodal_text(hf) if hf["model_type"] in _MULTIMODAL else _listed_text(hf) if hf["model_type"] in _TEXT_OF
            else _molmo2_written(hf) if hf["model_type"] == "molmo2" else _vl_text_config(hf))
    kind = text["model_type"] if family.written_as == "text_config" else family.written_as
    return dict(text, model_type=kind, architectures=[FAMILIES[kind].architecture])


# TransformerConfig fields that only MoE blocks read (the dense MLP is a plain SwiGLU)
_MOE_ONLY = {"n_experts", "k", "ffn_expert", "n_shared", "shared_ffn", "shared_gate", "score", "pre_softmax", "n_groups", "topk_groups",
             "group_score_topk", "route_scale", "route_normalize", "expert_bias", "route_on_input", "router_bias", "expert_biases",
             "swiglu_alpha", "swiglu_limit", "swiglu_offset", "swiglu_limit_layers", "router_softcap", "shared_scale", "expert_bias_on_logits",
             "router_scale", "expert_out_norm", "moe_out_bias"}


# TransformerConfig fields that only the attention blocks read: nothing in a model none of whose blocks attends (every
# one linear attention or an MLP alone: Mamba-2's) and that has no MTP module
_ATTENTION_ONLY = {"n_heads", "n_kv_heads", "head_dim", "qkv_bias", "o_bias", "qk_norm", "qk_norm_after_rope", "nope_qk_norm", "rope_base", "rope_dim",
                   "rope_interleaved", "rope_last", "rope_linear_factor", "rope_proportion", "yarn_factor", "yarn_original_max_positions", "yarn_beta_fast",
                   "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_truncate", "llama3_factor", "llama3_low_freq_factor",
                   "llama3_high_freq_factor", "llama3_original_max_positions", "longrope_short_factors", "longrope_long_factors",
                   "longrope_original_max_positions", "longrope_short_scale", "longrope_long_scale", "q_rank", "kv_rank", "v_head_dim", "mla_scales",
                   "q_latent_raw", "attn_gate", "attn_gate_act", "attn_gate_per_head", "attn_gate_bias", "attn_gate_on_q", "attn_scale", "attn_softcap",
                   "attn_sinks", "sink_layers", "value_scale", "clip_qkv", "v_norm", "attn_out_norm", "global_k_eq_v", "local_heads", "local_kv_heads",
                   "local_head_dim",
                   "local_rope_base", "local_rope_dim", "window", "window_layers", "chunk", "chunk_layers", "nope_layers", "nope_temperature_floor",
                   "nope_temperature_scale", "nope_temperature_kind", "query_temperature_floor", "query_temperature_scale", "index_topk", "index_heads",
                   "index_head_dim", "index_rope_interleaved", "index_rope_last", "index_norm_eps", "index_loss_coeff", "index_shared_layers",
                   "moa_experts", "moa_topk", "moa_aux_coeff", "o_groups", "o_rank", "kv_shared"}


def config_mismatch(cfg: TransformerConfig, hf: dict) -> dict[str, tuple]:
    """{field: (cfg's value, the value config.json `hf` maps to)} for each TransformerConfig
    field in which a model of `cfg` differs from the checkpoint's model (ignoring what does
    not change the weights' meaning: impl, ac, fp8 and its knobs, init_std, the capacity, the losses' weights
    (index_loss_coeff, moa_aux_coeff), how the dense and MoE
    layers and the shared experts' size (n_shared or shared_ffn) are spelled, and the MTP depth and mtp_norm of a family that stores MTP layers:
    save_pretrained writes MTP modules that use the final norm with a copy of it as their
    own); {} when `cfg` is that model."""
    family = FAMILIES[hf["model_type"]]
    back = TransformerConfig(**family.kwargs(hf))
    ignored = {"impl", "ac", "fp8", "fp8_layers", "fp8_fast_accum", "init_std", "ffn_dense", "n_dense", "n_shared", "shared_ffn", "moe_layers",
               "capacity_factor", "capacity_policy", "index_loss_coeff", "moa_aux_coeff"}
    if cfg.yarn_factor is None:
        ignored |= {"yarn_original_max_positions", "yarn_truncate"}
    if cfg.llama3_factor is None:
        ignored |= {"llama3_low_freq_factor", "llama3_high_freq_factor", "llama3_original_max_positions"}
    if family.mtp or family.mtp_module:  # any depth; MTP modules without their own output norm are written with a copy of the final one
        ignored |= {"mtp_depth", "mtp_norm"}
    elif cfg.mtp_depth == 0 and back.mtp_depth == 0:  # no MTP module: its norm means nothing
        ignored.add("mtp_norm")
    if cfg.longrope_short_factors is not None:  # LongRoPE without long factors has the short ones there too (written as both)
        cfg, back = (dataclasses.replace(c, longrope_long_factors=c.longrope_long_factors or c.longrope_short_factors) for c in (cfg, back))
    moe = [cfg.is_moe(i) for i in range(cfg.n_layers)], [back.is_moe(i) for i in range(back.n_layers)]
    if not any(moe[0]) and not any(moe[1]):  # dense models: the MoE fields mean nothing
        ignored |= _MOE_ONLY
    if all(c.mtp_depth == 0 and not any(c.attends(i) for i in range(c.n_layers)) for c in (cfg, back)):  # no attention anywhere (Mamba-2's)
        ignored |= _ATTENTION_ONLY
    mismatch = {f.name: (getattr(cfg, f.name), getattr(back, f.name)) for f in dataclasses.fields(TransformerConfig)
                if f.name not in ignored and getattr(cfg, f.name) != getattr(back, f.name)}
    if moe[0] != moe[1]:
        mismatch["MoE layers"] = moe
    if cfg.shared_size != back.shared_size and (any(moe[0]) or any(moe[1])):
        mismatch["shared_size"] = (cfg.shared_size, back.shared_size)
    if cfg.ffn_dense != back.ffn_dense and any(not m and not cfg.is_mlp_free(i) for i, m in enumerate(moe[0])):  # a dense MLP somewhere
        mismatch["ffn_dense"] = (cfg.ffn_dense, back.ffn_dense)
    return mismatch


def _stored(spec: Tensor, full: torch.Tensor, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """(HF key, value) pairs of one fmoe parameter in the checkpoint's layout: an expert
    stack's experts, a row, or one tensor (not a part of a key: Tensor.part, Tensor.chunk)."""
    if spec.stacked:
        return [(key, (full[e].t() if spec.transpose else full[e]).contiguous().to(dtype)) for e, key in enumerate(spec.keys)]
    if spec.cat:
        raise ValueError(f"model: {' and '.join(spec.keys)} hold its rows between them (Tensor.cat), so it is not written")
    stored = full.transpose(-2, -1) if spec.transpose else full
    if spec.experts is not None:  # [E, rows, ...] as the stored [E rows, ...]
        stored = stored.flatten(0, 1)
    return [(spec.keys[0], _with_units(spec, stored).contiguous().to(dtype))]


def safetensors_module(name: str = "safetensors"):
    """The safetensors module `name` (fmoe.hf's checkpoint files), or an ImportError that
    names the extra that brings it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise MissingExtra("fmoe.hf reads and writes Hugging Face checkpoints with the safetensors package: "
                          "pip install 'fmoe[hf]' (or safetensors)") from err


def _new_file_mode() -> int:
    """The mode open() gives a new file here: 0o666 less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class _ShardWriter:
    """Complete checkpoint tensors in, safetensors shards out: a shard is written once the
    next tensor would take its tensors' bytes (the file's header not counted) past
    max_bytes (a tensor larger than that is a shard alone), under a temporary name until the
    number of shards is known. The folder's earlier weights and config.json are replaced
    only once every new file is written (close): an export that fails (a full disk, a
    tensor it cannot convert, no safetensors) removes its own files (abort) and leaves the
    earlier export whole. A killed one leaves its temporary files for the next export of
    the folder to remove."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.save_file = safetensors_module("safetensors.torch").save_file  # missing: an error before the folder is touched
        self.shard: dict[str, torch.Tensor] = {}
        self.bytes = self.total = 0
        self.files: list[tuple[Path, list[str]]] = []
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model-*.partial.safetensors"), path / "config.json.partial", path / "model.safetensors.index.json.partial"]:
            old.unlink(missing_ok=True)  # a killed export's

    def add(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if self.shard and self.bytes + size > self.max_bytes:
            self.flush()
        self.shard[key] = value
        self.bytes += size
        self.total += size

    def flush(self) -> None:
        file = self.path / f"model-{len(self.files) + 1:05d}.partial.safetensors"
        self.files.append((file, list(self.shard)))  # abort removes it, written whole or not
        self.save_file(self.shard, file, metadata={"format": "pt"})
        file.chmod(_new_file_mode())  # safetensors writes its file owner-only (0600); others read an export as they read config.json
        self.shard, self.bytes = {}, 0

    def close(self, config: str) -> None:
        """The shards under their final names (model.safetensors, or model-0000i-of-0000N
        with model.safetensors.index.json) and `config` as config.json, in place of the
        folder's earlier weights (an earlier export's shards that the new names do not
        overwrite are removed, so no loader reads them with these). Every new file is
        written before any earlier one is touched; what is left is renames and removals."""
        if self.shard or not self.files:
            self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        staged = [(self.path / "config.json.partial", self.path / "config.json")]
        self.files.append((staged[0][0], []))
        staged[0][0].write_text(config)
        if n > 1:
            weight_map = dict(sorted((key, name) for name, (_, keys) in zip(names, self.files) for key in keys))
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            staged.append((self.path / "model.safetensors.index.json.partial", self.path / "model.safetensors.index.json"))
            self.files.append((staged[1][0], []))
            staged[1][0].write_text(json.dumps(index, indent=2) + "\n")
        final = {self.path / name for name in names} | {target for _, target in staged}
        for old in [self.path / "model.safetensors", self.path / "model.safetensors.index.json", *self.path.glob("model-*-of-*.safetensors")]:
            if old not in final:
                old.unlink(missing_ok=True)  # an earlier export's, which would be read with this one's
        for i, name in enumerate(names):
            file, keys = self.files[i]
            self.files[i] = (file.replace(self.path / name), keys)  # abort finds it under its new name
        for partial, target in staged:
            partial.replace(target)

    def abort(self) -> None:
        """Remove the files written so far, under whatever name they have reached (and the
        index): a failed export leaves none of its files behind."""
        for file, _ in self.files:
            file.unlink(missing_ok=True)
        self.files, self.shard = [], {}


_LIGHTNING_TABLES = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def constant_tensors(family: Family, cfg: TransformerConfig, hf: dict) -> dict[str, torch.Tensor]:
    """{HF key: float32 tensor} of what a family's checkpoints hold beside the weights that is
    a function of the config: MiniMax's lightning attention's decay tables per linear layer
    (slope_rate [N, 1, 1] = -lightning_decay, and of config.json's block_size b
    query_decay, key_decay [N, b, 1], diagonal_decay [1, N, b, b]), computed as transformers
    computes them; Apertus's xIELU constants per MLP (act_fn.beta, act_fn.eps, 0-dim: XIELU).
    save_pretrained writes them; load_weights checks a folder's slope_rate, beta and eps."""
    if cfg.mlp_act == "xielu":  # xIELU's constants in every MLP, 0-dim (Apertus's act_fn.beta, act_fn.eps)
        return {family.renamed(f"{p}{family.dense}.act_fn.{name}"): torch.tensor(value) for p, p_mlp in _layer_prefixes(family, cfg) if p_mlp
                for name, value in (("beta", XIELU[0]), ("eps", XIELU[1]))}
    if family.linear != "lightning":
        return {}
    lin, block, out = cfg.linear_attention_config(), int(hf.get("block_size", 256)), {}
    steps = torch.arange(block) + 1
    for i in range(cfg.n_layers):
        if not cfg.is_linear(i):
            continue
        rate = -lightning_decay(lin.n_v_heads, i, cfg.n_layers)[:, None, None]
        diagonal = rate * (steps[:, None] - steps[None, :])[None, None]
        p = f"{family.prefix[0]}model.layers.{i}.{family.attention}."
        out.update({p + "slope_rate": rate, p + "query_decay": torch.exp(-rate * steps[:, None]),
                    p + "key_decay": torch.exp(-rate * (block - steps[:, None])),
                    p + "diagonal_decay": torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))})
    return out


def _checkpoint_tensors(model: Transformer, family, params: dict, dtype: torch.dtype, keep: bool, failed: list, hf: Optional[dict] = None,
                        dtypes: Optional[dict] = None, inert: Optional[dict] = None):
    """(HF key, complete CPU tensor) pairs of `model` in the checkpoint's layout and dtype,
    one parameter at a time, then the zero experts' unused rows as zeros (zero_expert_keys),
    the config's constant tables (constant_tensors; hf: the config.json written) and `inert`'s
    (HF key -> stored value: a loaded folder's model.hf_inert). A
    DTensor is gathered (full_tensor) whatever `keep` says: every rank must walk this in
    step; a rank with keep=False yields nothing, and neither does one once `failed` holds an
    error (a conversion that raises is appended to it: the walk goes on, gathering, so that
    the other ranks are not left waiting in a collective). dtypes: HF key -> its dtype where
    it is not `dtype` (_converted)."""
    from torch.distributed.tensor import DTensor

    copies: dict[str, list[str]] = {}
    for key, name in mtp_copies(family, model.cfg, final_norm=True).items():
        copies.setdefault(name, []).append(key)
    parts: dict[str, list] = {}  # a key several parameters fill: [value, parts still missing]
    folded = _folded(family, hf or {})  # the config's multipliers, taken out of the weights again (Family.folds)
    for name, spec in key_map(family, model.cfg).items():
        p = params[name].detach()
        full = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank, in this order
        if not keep or failed:
            continue
        try:
            scale = folded(name)
            full = full.to("cpu") if scale == 1.0 else full.to("cpu").float() / scale
            stored = _converted(name, spec, full, copies.get(name, ()), parts, dtype, dtypes)
        except Exception as err:
            failed.append(err)
            continue
        yield from stored
    if keep and not failed:
        for key, shape in zero_expert_keys(family, model.cfg).items():
            yield key, torch.zeros(shape, dtype=(dtypes or {}).get(key, dtype))
        for key, value in constant_tensors(family, model.cfg, hf or {}).items():
            yield key, value.to((dtypes or {}).get(key, dtype))
        yield from (inert or {}).items()


def _converted(name: str, spec: Tensor, full: torch.Tensor, copies, parts: dict, dtype: torch.dtype,
               dtypes: Optional[dict] = None) -> list[tuple[str, torch.Tensor]]:
    """The (HF key, tensor) pairs that one gathered parameter completes (_checkpoint_tensors);
    dtypes: HF key -> its dtype where it is not `dtype` (a loaded folder's, model.hf_dtypes:
    its correction biases' whatever it is)."""
    dtypes = dtypes or {}
    # the MTP layers' copies of the embedding, the head (and the final norm), each in its own
    # storage: safetensors refuses shared tensors
    out = [(key, full.to(dtypes.get(key, dtype)).clone()) for key in copies]
    if name.endswith("expert_bias"):  # as the folder stored it, else float32 (HF keeps the correction bias float32)
        return [*out, (spec.keys[0], _with_units(spec, full).to(dtypes.get(spec.keys[0], torch.float32)).contiguous())]
    dtype = dtypes.get(spec.keys[0], dtype)
    if not full.is_floating_point():  # a hashed block's table of expert ids (DeepSeek-V4's tid2eid): int64, as stored
        return [*out, (spec.keys[0], full.contiguous())]
    if spec.part is None and spec.chunk is None:
        return [*out, *_stored(spec, full, dtype)]
    key = spec.keys[0]
    if spec.part is not None:  # every n-th entry of the last dim, from i
        i, n = spec.part
        shape, where = (*full.shape[:-1], full.shape[-1] * n), (..., slice(i, None, n))
    else:  # the i-th of n runs of the stored dim -2 (transposed) or -1 (of each group)
        i, sizes = spec.chunk
        n = len(sizes)
        full = full.transpose(-2, -1) if spec.transpose else full
        d = _chunk_dim(spec, full.dim())
        dim = full.shape[d] // sizes[i] * sum(sizes)
        shape = (*full.shape[:d], dim, *full.shape[d + 1:])
        where = None
    stored = parts.setdefault(key, [torch.empty(shape, dtype=dtype), n])
    if where is not None:
        stored[0][where] = full
    else:  # the chunk's run of each group (one group: the run itself)
        _grouped_runs(spec, stored[0], d).copy_(full.unflatten(d, (spec.groups, -1)))
    stored[1] -= 1
    if stored[1]:
        return out
    value = parts.pop(key)[0]
    return [*out, (key, _with_units(spec, value))]


def save_pretrained(model: Transformer, path, *, model_type: Optional[str] = None, max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write `model` as an HF folder: config.json (the loaded one when the model came from
    from_pretrained, else hf_config(cfg, model_type)) and the weights in the checkpoint's
    layout (module docstring): model.safetensors, or shards of at most max_shard_bytes
    (model-00001-of-0000N.safetensors, ..., with model.safetensors.index.json) when they do
    not fit one. max_shard_bytes counts the tensors' bytes alone, as transformers'
    max_shard_size does: a file is larger by its safetensors header (and a tensor larger
    than the limit is a shard of its own). Earlier weight files in `path` are replaced. A
    loaded config's count of MTP modules (num_nextn_predict_layers; Qwen3-Next's mtp_num_hidden_layers) is set to the
    model's MTP depth, unless the model has the depths its folder held (model.hf_mtp_depth):
    then it stays as loaded (transformers writes DeepSeek-V3's default 1 beside no MTP layer).

    Streamed: one parameter at a time is gathered (a DTensor's full_tensor: call on every
    rank, in step) and converted; rank 0 keeps only the shard being filled and writes it,
    the other ranks drop each value once gathered. So a model sharded over many devices is
    written without any rank holding it whole; every rank returns `path` once the files are
    written. A model without DTensors is written by rank 0 alone (the others may call it:
    they write nothing). An export that raises removes the shards it wrote; the temporary
    files of a killed one are removed by the next export to the folder. When rank 0 cannot
    write (a full disk, a path it may not create), a sharded model's ranks still gather
    every parameter in step, then every rank raises: rank 0 its error, the others a
    RuntimeError that quotes it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: expected a positive int, got {max_shard_bytes!r}")
    hf = getattr(model, "hf_config", None)
    if hf is None or (model_type is not None and model_type != hf.get("model_type")):
        if model_type is None:
            raise ValueError("model_type: needed for a model not loaded with from_pretrained (one of " + ", ".join(FAMILIES) + ")")
        hf = hf_config(model.cfg, model_type)
    else:  # the loaded folder's config: only while it still describes the model (options may have changed it; MTP
        # modules a family does not store are not written)
        mismatch = {k: v for k, v in config_mismatch(model.cfg, hf).items() if k not in ("mtp_depth", "mtp_norm")}
        if mismatch:
            raise ValueError(f"model: differs from the config.json it was loaded with ({mismatch}); pass model_type= to write a config of "
                             "its own (e.g. deepseek_v32 for DeepSeek sparse attention added to a DeepSeek-V3 model)")
    _check_writable(hf["model_type"])
    family = FAMILIES[hf["model_type"]]
    loaded = hf is getattr(model, "hf_config", None)
    if loaded:  # written back as the folder stored it (keep_folder_layout)
        count = _mtp_count_field(hf["model_type"])
        if count is not None and model.cfg.mtp_depth != getattr(model, "hf_mtp_depth", None):  # MTP depths the folder did not hold
            hf = dict(hf, **{count: model.cfg.mtp_depth})
        if getattr(model, "hf_stacks", False):  # the experts as stacks
            family = _stacked_experts(family, (".experts.gate_up_proj",))
        if getattr(model, "hf_dense", None):  # the dense MLP's name
            family = dataclasses.replace(family, dense=model.hf_dense)
        if getattr(model, "hf_hyper_head", None):  # the head's hyper-connection prefix
            family = dataclasses.replace(family, hyper=(*family.hyper[:2], model.hf_hyper_head))
        if not getattr(model, "hf_zero_rows", True):  # no zero-expert rows (transformers needs them: written where the folder had them)
            family = dataclasses.replace(family, zero_expert_rows=False)
    quantized = _quantization(hf)
    if quantized:  # written dequantised, in the checkpoint's dtype
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}
        if isinstance(hf.get("text_config"), dict):
            hf["text_config"] = {k: v for k, v in hf["text_config"].items() if k != "quantization_config"}
    params = _tensors(model)
    sharded = any(isinstance(p, DTensor) for p in params.values())  # then every rank calls, and gathers
    dtype = config_dtype(hf)
    path = Path(path)
    writes = not dist.is_initialized() or dist.get_rank() == 0
    writer, failed = None, []  # failed: rank 0's error, raised once every rank has gathered every parameter
    if writes:
        try:
            writer = _ShardWriter(path, max_shard_bytes)
        except Exception as err:
            failed.append(err)
    try:
        # a loaded folder written back: the tensors it stored in another dtype than the rest, in that one (model.hf_dtypes),
        # and what acts on nothing, as stored (model.hf_inert)
        dtypes = getattr(model, "hf_dtypes", None) if loaded and not quantized else None
        inert = getattr(model, "hf_inert", None) if loaded else None
        for key, value in _checkpoint_tensors(model, family, params, dtype, keep=writes, failed=failed, hf=hf, dtypes=dtypes, inert=inert):
            try:
                writer.add(key, value)
            except Exception as err:
                failed.append(err)
    except BaseException:  # in a gather: the other ranks are in it too
        if writer is not None:
            writer.abort()
        raise
    if writer is not None and not failed:
        try:
            writer.close(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        except Exception as err:
            failed.append(err)
    if failed and writer is not None:
        writer.abort()
    if sharded and dist.is_initialized():
        # the other ranks wait here until rank 0 has written the folder (or failed to): then
        # every rank returns, or every rank raises
        error = [f"save_pretrained: rank 0 could not write {path}: {type(failed[0]).__name__}: {failed[0]}" if failed else None]
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None and not failed:
            raise RuntimeError(error[0])
    if failed:
        raise failed[0]
    return path
