"""Training metrics: FLOPs per token (SPEC.md section 8), MFU, expert load, energy, memory,
a JSONL logger.

    mean_attended_keys(cu_seqlens, window=None) -> n_avg   sum_i len_i^2 / (2 T); S/2 for one
                                                    document; under a sliding window W a document
                                                    longer than W counts W^2/2 + (len - W) W
    flops_per_token(*, hidden, n_layers, n_dense, ffn_dense, ffn_expert, k, n_shared,
                    n_heads, n_kv_heads, head_dim, vocab, mtp_depth=0, n_avg_keys,
                    n_experts=0) -> float
    mean_compressed_entries(cu_seqlens, rate, topk=None) -> float   a query's mean compressed
                                                    entries (HCA), at most topk of them (CSA's chosen)
    model_flops_per_token(cfg, *, n_avg_keys, n_avg_local_keys=None, n_avg_index_keys=None, k=None,
                          n_avg_compressed_keys=None, n_avg_csa_entries=None,
                          n_avg_csa_chosen=None) -> float   the same
                                                    for a TransformerConfig (sliding blocks: the local mean)
    datasheet_peak_flops(name) / peak_flops(device) -> float | None   dense bf16 peaks
    mfu(tokens_per_s, flops_per_token, peak) -> float | None
    layer_loads(counts[L, E], slots, *, zero_experts=0) -> record entries, one item per MoE layer (fmoe.ops.load_stats)
    MetricsLogger(out_dir, *, rank=0, total_steps, start_step=0).log(step, record)
    format_progress(step, total_steps, record) -> the one-line progress string
    to_host(values) -> {name: float | int | list}   tensors to Python numbers in one transfer
    HostReads()                                     counts host reads of tensor values (syncs)
    SavedTensors(exclude=params)                    counts the bytes kept for the backward
    AllocatedBytes()                                live and peak bytes of the tensors created
    EnergyMeter(device, *, query=None).joules_since_last() -> float | None   NVML energy
    EnergyMeter.agree(group, device)          several processes: every rank's energy summed, or none
    memory_plan(modules, optimizers, *, grad_dtype=float32) -> dict   this rank's bytes of
                                                    parameters, gradients, optimizer states

Training FLOPs per token (6 = 3 passes x 2 for a multiply-add: forward x W, backward dx and
dW), for L = n_layers layers of which n_dense are dense and N_moe = L - n_dense are MoE,
SwiGLU (m = 3), attention A = 6 (H (q + 2 kv) + q H) + 12 q n_avg per layer (q, k, v, o
projections; scores and values):

    L A + 6 H m F_dense n_dense                                   trunk: attention, dense MLPs
    + N_moe (6 H m F_expert (k + n_shared) + 6 H E)               experts and router
    + mtp_depth (6 (2H) H + A + FFN_mtp)                          MTP modules' own work
    + (1 + mtp_depth) 6 H V                                       output heads
with q = n_heads * head_dim, kv = n_kv_heads * head_dim, n_avg = mean_attended_keys(...),
FFN_mtp = the MoE term above when the trunk has a MoE layer, else 6 H m F_dense (each MTP
module's block is a MoE block exactly then: fmoe.model.MTPModule), and E = n_experts (0
leaves the router out). This extends SPEC.md section 8, which leaves out the router
(6 H E per MoE layer: 2 H E forward, 4 H E backward) and the MTP modules' projection and
block (only their heads were counted). Still not counted: norms, embeddings (lookups),
the shared-expert gate (6 H per MoE layer), softmax, RoPE and other elementwise work.

Metric records (one JSON object per line of `<out_dir>/metrics.jsonl`): step, and what the
loop passes: loss, lm_loss, lr, tokens, grad_norm, tokens_per_s (the step's tokens over its
training wall-clock time: a step that evaluates times the evaluation apart, eval_seconds;
mfu and energy_j likewise), val_loss, seq_aux_loss, aux_loss, z_loss, mtp_<d>_loss (each MTP depth d's: mtp_1_loss,
...), mfu, loss_tokens and
padding_tokens (of the step's tokens, those whose label counts and those that are
--whole_documents padding), ... and, per MoE layer (lists in layer order, see layer_loads):
tokens_per_expert [L][E], load_max_over_mean [L], load_cv [L], dropped_fraction [L].
Tensors become numbers / lists; non-finite floats become null (strict JSON).
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import warnings
from numbers import Complex, Real
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from fmoe.ops import load_stats
from fmoe.ops.checks import MissingExtra, check_cu_seqlens, check_path, check_positive_int
from fmoe.train.run import refuse_link

_PEAKS = (  # dense bf16 tensor-core peaks (NVIDIA datasheets), most specific name first
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("H100 PCIE", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
)


def _offsets(cu_seqlens) -> list[int]:
    """cu_seqlens (a tensor or a list) as a list of ints: fmoe.ops.checks.check_cu_seqlens's offsets, ending at T > 0."""
    if not isinstance(cu_seqlens, (torch.Tensor, list, tuple)):  # None, a string: torch's "Could not infer dtype" before
        raise ValueError(f"cu_seqlens: expected offsets [0, ..., T] (a tensor or a list of ints), got {type(cu_seqlens).__name__}")
    if not isinstance(cu_seqlens, torch.Tensor) and len(cu_seqlens) < 2:  # [] read as float32 ("expected dtype int32")
        raise ValueError(f"cu_seqlens: expected offsets [0, ..., T] (at least 2), got {list(cu_seqlens)}")
    cu = torch.as_tensor(cu_seqlens)
    check_cu_seqlens(cu, int(cu[-1]) if cu.ndim == 1 and cu.numel() and cu.dtype in (torch.int32, torch.int64) else 0)
    if int(cu[-1]) <= 0:
        raise ValueError(f"cu_seqlens: expected offsets ending at T > 0, got {cu.tolist()}")
    return cu.tolist()


def mean_attended_keys(cu_seqlens: Union[torch.Tensor, Sequence[int]], window: Optional[int] = None, chunk: Optional[int] = None) -> float:
    """n_avg = sum_i len_i^2 / (2 T): the mean number of keys a query attends to in causal
    attention over packed documents (S/2 for one document of length S). Under a sliding
    window W (fmoe.layers.AttentionConfig.window) a query sees at most W keys: a document
    longer than W counts W^2 / 2 + (len - W) W (the same continuous count, min(t, W) dt).
    In chunked attention (AttentionConfig.chunk C, not with a window) each chunk of a
    document is a document of its own: len // C chunks of C^2 / 2 and the rest's (len % C)^2 / 2."""
    from fmoe.layers import check_window

    check_window(window)
    if chunk is not None:
        check_positive_int("chunk", chunk)
        if window is not None:
            raise ValueError(f"chunk: a sliding window or chunked attention, not both (window = {window})")
    cu = _offsets(cu_seqlens)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if chunk is not None:  # the documents cut into their chunks (as the mask cuts them)
        lengths = [c for n in lengths for c in [chunk] * (n // chunk) + [n % chunk]]
    if window is None:
        return sum(n * n for n in lengths) / (2 * cu[-1])
    return sum(n * n / 2 if n <= window else window * window / 2 + (n - window) * window for n in lengths) / cu[-1]


def mean_compressed_entries(cu_seqlens: Union[torch.Tensor, Sequence[int]], rate: int, topk: Optional[int] = None) -> float:
    """The mean number of compressed entries a query attends to in heavily compressed
    attention (fmoe.layers.AttentionConfig.compress_rate m): a query at position p sees its
    document's floor((p + 1) / m) complete runs; a document of n = a m + r tokens sums
    m a (a - 1) / 2 + a (r + 1) of them. Over the T tokens of the packed documents. topk:
    each query's min(topk, floor((p + 1) / m)) instead (compressed sparse attention's chosen
    entries, AttentionConfig.compress_topk)."""

    check_positive_int("rate", rate, 2)
    if topk is not None:
        check_positive_int("topk", topk)
    cu = _offsets(cu_seqlens)

    def seen(a: int, r: int) -> float:  # the entries of a document of a m + r tokens, summed over its queries
        if topk is None or a <= topk:
            return rate * a * (a - 1) / 2 + a * (r + 1)
        # the queries that see j <= topk runs (m of them for each j < topk), then topk for each later one
        return rate * topk * (topk - 1) / 2 + topk * (a * rate + r - topk * rate + 1)

    return sum(seen(*divmod(b - a, rate)) for a, b in zip(cu, cu[1:])) / cu[-1]


def mean_block_keys(cu_seqlens: Union[torch.Tensor, Sequence[int]], topk_blocks: int, block_size: int) -> float:
    """The mean number of keys a query attends to in block-sparse attention
    (fmoe.layers.AttentionConfig.index_topk_blocks K, index_block_size b): a query at place p
    of its document sees p + 1 keys in p // b + 1 blocks; with more than K of them it attends
    to its own block's p mod b + 1 and K - 1 full ones, min(p + 1, (K - 1) b + p mod b + 1)
    in all. Counted, as mean_attended_keys counts S^2 / 2 for a causal document, half a key
    less per query: so with every block chosen (K b at least the longest document) this is
    mean_attended_keys(cu_seqlens), and their difference is the keys the choice leaves out.
    Exact where the query's own block is among its chosen (index_local_blocks >= 1, the
    default); with index_local_blocks 0 the indexer may pass it over for a full block, and this
    is a lower bound."""
    check_positive_int("topk_blocks", topk_blocks)
    check_positive_int("block_size", block_size)
    cu = _offsets(cu_seqlens)
    span = topk_blocks * block_size  # the keys a query sees before the choice leaves any out

    def keys(n: int) -> float:  # summed over a document's n queries
        m = min(n, span)
        total = m * (m + 1) / 2  # the first K b queries: every earlier key
        if n > span:  # then K - 1 full blocks and the own block's first p mod b + 1 keys
            full, rest = divmod(n - span, block_size)
            total += (n - span) * ((topk_blocks - 1) * block_size + 1) + full * block_size * (block_size - 1) / 2 + rest * (rest - 1) / 2
        return total - n / 2

    return sum(keys(b - a) for a, b in zip(cu, cu[1:])) / cu[-1]


def _check_count(name: str, value, minimum: int = 0, *, whole: bool = False) -> None:
    """value: a finite real number >= minimum (not a bool); with whole, a whole one too (32 or 32.0, not 32.5)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not minimum <= value < math.inf:
        raise ValueError(f"{name}: expected a finite number >= {minimum}, got {value!r}")
    if whole and value != int(value):
        raise ValueError(f"{name}: expected a whole number, got {value!r}")


def flops_per_token(
    *, hidden: int, n_layers: int, n_dense: int, ffn_dense: int, ffn_expert: int, k: int, n_shared: float,
    n_heads: int, n_kv_heads: int, head_dim: int, vocab: int, mtp_depth: int = 0, n_avg_keys: float,
    n_experts: int = 0, attention_weights: Optional[int] = None, v_dim: Optional[int] = None,
    n_sliding: int = 0, n_avg_local_keys: Optional[float] = None, attn_gate: bool = False, n_linear: int = 0,
    linear_layer: float = 0.0, local_attention_weights: Optional[int] = None, local_heads: Optional[int] = None,
    attn_gate_per_head: bool = False, local_head_dim: Optional[int] = None, mlp_matrices: int = 3, n_mlp_only: int = 0,
) -> float:
    """Training FLOPs per token (forward + backward): SPEC.md section 8 with the router and
    the MTP modules' blocks (the module docstring's formula). n_shared counts shared experts
    in units of ffn_expert (Fs = n_shared F); n_experts = E for the router's 6 H E per MoE
    layer (0: no router term). attention_weights: the elements of one layer's attention
    projections (None: grouped-query attention's H (q + 2 kv) + q H; multi-latent attention
    passes its own), plus the output gate's H n_heads v_dim with attn_gate (gated
    attention); v_dim: the value head dim (None: head_dim), so the scores and values
    cost 6 n_heads (head_dim + v_dim) n_avg_keys (12 q n_avg_keys when they are equal).
    n_sliding of the n_layers trunk layers attend over a sliding window or within chunks,
    n_avg_local_keys keys each on average (mean_attended_keys(cu_seqlens, window, chunk));
    the MTP blocks over all, local_attention_weights the sliding layers' projection
    elements where they differ (other kv heads: MiMo-V2-Flash; None: attention_weights', or
    grouped-query attention's with local_heads), local_heads their query heads where they
    differ (Laguna; None: n_heads: their scores, values and gate), local_head_dim their head dim
    where it differs (Gemma 4; None: head_dim: their scores, values and gate; with v_dim
    None their values' too). attn_gate_per_head: the
    gate has one column per head (H n_heads weights). n_linear of them are linear-attention
    layers instead, of linear_layer FLOPs per token each (linear_attention_flops).
    mlp_matrices: each MLP's weight matrices, m (3: a GLU's gate, up and down; 2: an MLP
    without a gate, mlp_act "relu2"). n_mlp_only of the trunk layers have no attention of
    either kind, their MLP alone."""
    args = dict(hidden=hidden, n_layers=n_layers, n_dense=n_dense, ffn_dense=ffn_dense, ffn_expert=ffn_expert, k=k,
                n_shared=n_shared, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, vocab=vocab,
                mtp_depth=mtp_depth, n_avg_keys=n_avg_keys, n_experts=n_experts)
    for name, value in args.items():
        # sizes and counts of a model are whole; k may be a mean (of a routing that picks fewer: model_flops_per_token), n_shared
        # a shared size in units of ffn_expert (shared_size / ffn_expert)
        _check_count(name, value, 1 if name in ("hidden", "vocab") else 0, whole=name not in ("k", "n_shared", "n_avg_keys"))
    if n_experts and k > n_experts:
        raise ValueError(f"k: expected at most n_experts = {n_experts} experts chosen per token, got {k}")
    _check_count("n_sliding", n_sliding, whole=True)
    _check_count("n_linear", n_linear, whole=True)
    _check_count("n_mlp_only", n_mlp_only, whole=True)
    _check_count("linear_layer", linear_layer)
    for name, flag in (("attn_gate", attn_gate), ("attn_gate_per_head", attn_gate_per_head)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    if local_heads is not None:
        _check_count("local_heads", local_heads, 1, whole=True)
    if local_head_dim is not None:
        _check_count("local_head_dim", local_head_dim, 1, whole=True)
    if n_dense > n_layers or n_sliding + n_linear + n_mlp_only > n_layers:
        raise ValueError(f"n_dense / n_sliding + n_linear + n_mlp_only: expected at most n_layers={n_layers}, got {n_dense} / {n_sliding} + "
                         f"{n_linear} + {n_mlp_only}")
    if n_sliding:
        _check_count("n_avg_local_keys", n_avg_local_keys)
    if mlp_matrices not in (2, 3):
        raise ValueError(f"mlp_matrices: expected 3 (a GLU: gate, up, down) or 2 (no gate), got {mlp_matrices!r}")
    m, H = mlp_matrices, hidden
    n_moe = n_layers - n_dense
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    weights = H * (q + 2 * kv) + q * H if attention_weights is None else attention_weights
    Dv = head_dim if v_dim is None else v_dim

    def gate(N, Dv=Dv):  # the output gate [H, N v_dim], or [H, N] per head
        return H * N * (1 if attn_gate_per_head else Dv) if attn_gate else 0

    if attention_weights is not None:
        _check_count("attention_weights", attention_weights, whole=True)
    if v_dim is not None:
        _check_count("v_dim", v_dim, 1, whole=True)
    if local_attention_weights is not None:
        _check_count("local_attention_weights", local_attention_weights, whole=True)
    elif local_heads is not None:  # grouped-query attention's, of the local blocks' query heads
        local_attention_weights = H * (local_heads * head_dim + 2 * kv) + local_heads * head_dim * H

    def attention_layer(keys, local=False):  # projections, then scores and values over `keys` keys per query
        own = local_attention_weights if local and local_attention_weights is not None else weights
        N = local_heads if local and local_heads is not None else n_heads
        D = local_head_dim if local and local_head_dim is not None else head_dim
        V = D if local and local_head_dim is not None and v_dim is None else Dv
        return 6 * (own + gate(N, V)) + 6 * N * (D + V) * keys

    attention = attention_layer(n_avg_keys)
    dense_ffn = 6 * H * m * ffn_dense
    moe_ffn = 6 * H * m * ffn_expert * (k + n_shared) + 6 * H * n_experts  # experts, router
    trunk = (n_layers - n_sliding - n_linear - n_mlp_only) * attention + n_linear * linear_layer + n_dense * dense_ffn + n_moe * moe_ffn
    if n_sliding:
        trunk += n_sliding * attention_layer(n_avg_local_keys, local=True)
    mtp = mtp_depth * (6 * 2 * H * H + attention + (moe_ffn if n_moe else dense_ffn))
    head = (1 + mtp_depth) * 6 * H * vocab
    return float(trunk + mtp + head)


def linear_attention_flops(hidden: int, cfg) -> float:
    """Training FLOPs per token (forward + backward, 6 per weight) of one Gated DeltaNet layer
    (fmoe.layers.LinearAttentionConfig): its projections (q, k, v, the output gate z, beta's
    and the decay's, the output), the convolution's K taps per channel of q, k and v, and
    the gated delta rule's three products with the Nv [Dk, Dv] states per token (what the
    state recalls for k, the write k u^T, the read for q): 6 (H (2 Ck + 2 Cv + 2 Nv) + Cv H +
    K (2 Ck + Cv) + 3 Nv Dk Dv). Kimi Delta Attention (kind "kda") counts its own projections
    (its low-rank decay and gate: H Dk + Dk Ck and H Dv + Dv Cv in place of H Nv and H Cv).
    Counted as the recurrence's math, as attention is counted by its scores: the chunked
    form's own extra work inside each chunk is not. LFM2's short convolution (kind
    "short_conv") counts its four projections and K taps per channel: 6 (4 H C + K C).
    MiniMax's lightning attention (kind "lightning") its five projections and two products
    with the states (no delta rule: no recall; no convolution): 6 (5 H C + 2 N D D); Mamba-2's
    (kind "mamba2") its projections, the taps and two products: 6 (H (2 Ck + 2 Cv + Nv) + Cv H +
    K (2 Ck + Cv) + 2 Nv Dk Dv); Mamba-1's (kind "mamba1", C channels, N = Dk, R = dt_rank) its
    projections (x, z, dt's pair, B, C, the output), the taps and two products: 6 (2 H C + 2 R C
    + 2 C N + C H + K C + 2 C N)."""
    from fmoe.layers import LinearAttentionConfig, linear_attention_shapes

    check_positive_int("hidden", hidden)
    if not isinstance(cfg, LinearAttentionConfig):
        raise ValueError(f"cfg: expected a LinearAttentionConfig, got {type(cfg).__name__}")
    Nv = cfg.n_v_heads
    weights = sum(rows * cols for name, (rows, cols) in ((n, s) for n, s in linear_attention_shapes(hidden, cfg).items() if n.startswith("w")))
    # LFM2's short convolution has no rule; lightning attention's no recall (the write and the read only)
    rule = {"short_conv": 0, "lightning": 2, "mamba2": 2, "mamba1": 2}.get(cfg.kind, 3) * Nv * cfg.k_head_dim * cfg.v_head_dim
    return 6.0 * (weights + cfg.conv * cfg.conv_channels + rule)


def model_flops_per_token(cfg, *, n_avg_keys: float, n_avg_local_keys: Optional[float] = None,
                          n_avg_index_keys: Optional[float] = None, k: Optional[float] = None,
                          n_avg_compressed_keys: Optional[float] = None, n_avg_csa_entries: Optional[float] = None,
                          n_avg_csa_chosen: Optional[float] = None, n_avg_block_keys: Optional[float] = None) -> float:
    """flops_per_token of an fmoe.model.TransformerConfig (any object with its fields): the
    dense blocks are those that are not MoE (moe_layers or n_dense), the shared experts'
    size in units of ffn_expert (shared_ffn, or n_shared), the router over n_experts, the
    MTP blocks as the model builds them; blocks without an MLP (cfg.is_mlp_free) count none, blocks
    without attention (cfg.is_mixer_free) no attention. A
    latent MoE (cfg.moe_latent = L) adds 6 x 2 H L per MoE block for its projections and counts
    its routed experts over L channels instead of H. With multi-latent attention (kv_rank) the attention
    terms of every block (trunk and MTP) are its own: 6 x its projection weights, and
    6 N (D + v_dim) n_avg_keys for the scores (q.k over D) and the values (over v_dim).
    Gated attention (attn_gate) adds its gate's H N Dv weights to each block's projections.
    Grouped-query attention with a value head dim of its own (v_head_dim) counts H N D + H G
    (D + Dv) + N Dv H projection weights, G = local_kv_heads, N = local_heads and D =
    local_head_dim in the local blocks where set; without wv (global_k_eq_v, the global
    blocks; every block with kv_shared) H N D + H G D + N Dv H; a q latent (q_rank) H q_rank + q_rank N D in
    place of H N D. The grouped output projection (cfg.o_groups g, o_rank r)
    counts N Dv r + g r H in place of N Dv H (either attention kind). A mixture of attention
    heads (cfg.moa_experts E) counts the k G = N heads a token computes, and its router's H E. Gemma 4's dense MLP beside each MoE (dense_beside_moe)
    adds 6 m H ffn_dense per MoE block (trunk and MTP), m its MLP's weight matrices (3 with a gate; 2 without, cfg.mlp_act in
    fmoe.layers.PLAIN_ACTS: w_up, w_down).
    Blocks with a sliding window or chunked attention (cfg.is_local) count n_avg_local_keys
    keys per query (mean_attended_keys with cfg.window, cfg.chunk): required when there are any.
    Linear-attention blocks (cfg.is_linear) count linear_attention_flops in place of attention
    (a parallel hybrid's, cfg.parallel_hybrid, beside it: both).
    DeepSeek sparse attention (cfg.index_topk) attends n_avg_index_keys keys per query
    (mean_attended_keys(cu_seqlens, index_topk): at most index_topk; required), and its
    indexer (index_heads Ni of index_head_dim Di) adds per block with one (trunk and MTP; not
    index_shared_layers) its choice's forward, 2 x its projection weights and 2 Ni (Di + 1)
    n_avg_keys (every earlier key's products and their weighted sum); trained
    (cfg.index_loss_coeff > 0) its loss too: the queries' and head weights' projections again,
    recomputed in the backward and their dW, 6 x theirs, the keys' dW, 2 x index_wk's; the
    index_topk chosen slots' products and weighted sums, recomputed, and their backward,
    8 Ni (Di + 1) index_topk (every slot of the choice, as the loss computes them); and the
    target, the attention's probabilities over the kept keys, 2 n_heads head_dim n_avg_index_keys.
    The router counts its n_choices outputs (cfg.n_choices where the model has zero experts,
    else n_experts). k: the mean computing experts per token where it is not cfg.k (with
    zero experts, cfg.k (1 - zero_fraction), the step's measured share: layer_loads).
    Shortcut pairs (cfg.shortcut_moe) add each trunk MoE block's dense MLP of ffn_dense
    beside its MoE: 6 m H ffn_dense. Hyper-connections (cfg.hyper_connections = n streams)
    add per trunk block, for its attention's and its MLP's HyperConnection, 6 (M n H + n H)
    (the weights' projection, M = 2 n + n^2 with hc_kind "manifold" else 2 n, and the
    streams' weighted sum) and 6 n^2 H for the manifold kind's mixing, and for the head's
    collapse 6 (n^2 H + n H). Gated norms (cfg.norm_gate_rank r) add 6 x 2 H r for each: the
    attention's pre-norm of every block (trunk and MTP), the MLP's of each MoE block. A gate
    on the q latent (cfg.attn_gate_on_q) counts its q_in N Dv weights instead of H N Dv.
    Heavily compressed attention blocks (cfg.compress_layers) add their compressor's two
    projections, 6 x 2 H D, and the scores and values over n_avg_compressed_keys entries per
    query (mean_compressed_entries(cu_seqlens, compress_rate); required), 6 N 2 D each.
    Compressed sparse attention blocks (cfg.csa_layers) add their compressor's, 6 x 2 H 2 D,
    the scores and values over the n_avg_csa_chosen entries a query attends to
    (mean_compressed_entries(cu_seqlens, csa_rate, csa_topk)), 6 N 2 D each, and their
    indexer's forward alone (no gradient), 2 x (its compressor's 2 H 2 Di, its queries'
    q_rank Ni Di, its head weights' H Ni, and Ni (Di + 1) per entry it scores, the products and
    their weighted sum: n_avg_csa_entries, mean_compressed_entries(cu_seqlens, csa_rate)); both
    required. With its loss (cfg.index_loss_coeff > 0) the indexer adds its compressor's
    weight gradients, 2 x 2 H 2 Di, and for each query's csa_topk chosen slots (fewer where a
    micro-batch has fewer than csa_topk runs) their scores twice (the loss recomputes them in
    its backward) and their backward: 6 (q_rank Ni Di + H Ni) + 8 Ni (Di + 1) csa_topk.
    Block-sparse attention (cfg.index_topk_blocks; the blocks of index_block_layers, every
    one where None, and the MTP blocks) attends n_avg_block_keys keys per query
    (mean_block_keys(cu_seqlens, index_topk_blocks, index_block_size); required) in place of
    n_avg_keys, and its indexer (index_heads Ni of index_head_dim Di, no gradient to the
    tokens) adds per block: trained (cfg.index_loss_coeff > 0) its key projection's forward and
    dW, 4 H Di; its queries' forward for the choice, again in the loss, its recompute in the
    backward and their dW, 8 H Ni Di; their products with every earlier key for the choice,
    in the loss, recomputed, and their backward, 10 Ni Di n_avg_keys; and the attention's
    probabilities over the kept keys (the loss's target), 2 n_heads head_dim n_avg_block_keys.
    Not trained, its forward alone: 2 H (Ni Di + Di) + 2 Ni Di n_avg_keys."""
    from fmoe.layers import PLAIN_ACTS  # an MLP without a gate: two matrices

    names = ("hidden", "n_layers", "ffn_dense", "ffn_expert", "k", "n_heads", "n_kv_heads", "head_dim", "mtp_depth", "n_experts")
    lacking = [n for n in (*names, "n_shared") if not hasattr(cfg, n)]
    if lacking:  # None, a dict: "'NoneType' object has no attribute 'n_dense'"
        raise ValueError(f"cfg: expected a fmoe.model.TransformerConfig (or an object with its fields), got {type(cfg).__name__} "
                         f"without {', '.join(lacking)}")
    is_moe = getattr(cfg, "is_moe", lambda i: i >= cfg.n_dense)
    n_dense = sum(not is_moe(i) for i in range(cfg.n_layers))
    mlp_free = sum(getattr(cfg, "is_mlp_free", lambda i: False)(i) for i in range(cfg.n_layers))  # blocks without an MLP
    mixer_free = sum(getattr(cfg, "is_mixer_free", lambda i: False)(i) for i in range(cfg.n_layers))  # blocks without attention
    mlp_matrices = 2 if getattr(cfg, "mlp_act", "silu") in PLAIN_ACTS else 3
    shared = getattr(cfg, "shared_size", cfg.n_shared * cfg.ffn_expert) / cfg.ffn_expert
    attention = {}
    if getattr(cfg, "kv_rank", None) is not None:
        from fmoe.layers import mla_shapes

        attn_cfg = cfg.attention_config()
        mats, _ = mla_shapes(cfg.hidden, attn_cfg)
        weights = sum(math.prod(shape) for shape in mats.values())  # wo_a [g, N Dv / g, r] too (the grouped output projection)
        if getattr(cfg, "attn_gate_on_q", False):  # the gate over wq_b's input, not x: counted here, not as flops_per_token's H N Dv
            from fmoe.layers import q_in

            weights += q_in(attn_cfg) * cfg.n_heads * (1 if cfg.attn_gate_per_head else cfg.v_head_dim)
        attention = dict(attention_weights=weights, v_dim=cfg.v_head_dim)
    elif any(getattr(cfg, n, None) is not None for n in ("v_head_dim", "local_kv_heads", "local_heads", "local_head_dim", "o_groups",
                                                         "moa_experts", "q_rank")) or getattr(cfg, "global_k_eq_v", False) or getattr(cfg, "kv_shared", False):
        # grouped-query attention with its own value head dim, other kv or query heads or head dim in the local blocks,
        # or no wv in the global ones
        v_head_dim = getattr(cfg, "v_head_dim", None)

        def gqa(G, N, D, k_eq_v=False):
            Dv, g, r = v_head_dim or D, getattr(cfg, "o_groups", None), getattr(cfg, "o_rank", None)
            out = N * Dv * cfg.hidden if g is None else N * Dv * r + g * r * cfg.hidden  # wo, or the grouped output projection's wo_a and wo
            router = cfg.hidden * (getattr(cfg, "moa_experts", None) or 0)  # a mixture of attention heads' router [H, E]
            q_rank = getattr(cfg, "q_rank", None)  # a q latent (DeepSeek-V4's): wq_a [H, q_rank], wq_b [q_rank, N D] in place of wq
            q = cfg.hidden * N * D if q_rank is None else (cfg.hidden + N * D) * q_rank
            return q + cfg.hidden * G * (D + (0 if k_eq_v else Dv)) + out + router

        no_wv = getattr(cfg, "kv_shared", False)  # no wv in any block
        attention = dict(attention_weights=gqa(cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, getattr(cfg, "global_k_eq_v", False) or no_wv),
                         v_dim=v_head_dim)  # None: each block's head dim
        local_kv, local_heads, local_dim = (getattr(cfg, n, None) for n in ("local_kv_heads", "local_heads", "local_head_dim"))
        # the local blocks' own count: other heads or head dim, or their wv where the global blocks have none
        if local_kv is not None or local_heads is not None or local_dim is not None or getattr(cfg, "global_k_eq_v", False):
            attention.update(local_attention_weights=gqa(local_kv or cfg.n_kv_heads, local_heads or cfg.n_heads, local_dim or cfg.head_dim, no_wv),
                             local_heads=local_heads, local_head_dim=local_dim)
    n_sliding = sum(getattr(cfg, "is_local", getattr(cfg, "is_sliding", lambda i: False))(i) for i in range(cfg.n_layers))
    if n_sliding and n_avg_local_keys is None:
        local = f"within chunks of {cfg.chunk}" if getattr(cfg, "chunk", None) is not None else f"over a sliding window of {cfg.window}"
        raise ValueError(f"n_avg_local_keys: {n_sliding} blocks attend {local}: "
                         "pass their mean attended keys (mean_attended_keys(cu_seqlens, window, chunk))")
    n_linear = sum(getattr(cfg, "is_linear", lambda i: False)(i) for i in range(cfg.n_layers))
    linear = dict(n_linear=n_linear, linear_layer=linear_attention_flops(cfg.hidden, cfg.linear_attention_config())) if n_linear else {}
    beside = 0.0
    if linear and getattr(cfg, "parallel_hybrid", False):  # attention in every block (counted as such), the linear mixers on top
        beside, linear = n_linear * linear["linear_layer"], {}
    values = {n: getattr(cfg, n) for n in names}
    values["n_experts"] = getattr(cfg, "n_choices", cfg.n_experts)  # the router's outputs
    if k is not None:
        _check_count("k", k)
        if k > cfg.n_experts:
            raise ValueError(f"k: the mean computing experts per token, expected at most n_experts = {cfg.n_experts}, got {k}")
        values["k"] = k
    indexer = 0.0
    if getattr(cfg, "index_topk", None) is not None:  # DeepSeek sparse attention: the kept keys, and the indexer
        from fmoe.layers import index_shapes

        if n_avg_index_keys is None:
            raise ValueError(f"n_avg_index_keys: the blocks attend to at most index_topk = {cfg.index_topk} keys: pass their mean "
                             "attended keys (mean_attended_keys(cu_seqlens, index_topk))")
        _check_count("n_avg_index_keys", n_avg_index_keys)
        _check_count("n_avg_keys", n_avg_keys)
        shapes = index_shapes(cfg.hidden, cfg.attention_config())
        weights = sum(a * b for a, b in (shape for shape in shapes.values() if len(shape) == 2))
        blocks = cfg.n_layers - n_linear - len(cfg.index_shared_layers or ()) + cfg.mtp_depth  # those with an indexer (no mixer-free ones)
        Ni, Di = cfg.index_heads, cfg.index_head_dim
        indexer = 2 * weights + 2 * Ni * (Di + 1) * n_avg_keys  # the choice's forward: the projections, every key's products and their weighted sum
        if getattr(cfg, "index_loss_coeff", 1.0) > 0:  # its loss: the queries and head weights again, recomputed and their dW, the keys' dW;
            # the chosen keys' products and weighted sums, recomputed and their backward; the target's attention probabilities
            wk = math.prod(shapes["index_wk"])
            indexer += 6 * (weights - wk) + 2 * wk + 8 * Ni * (Di + 1) * cfg.index_topk + 2 * cfg.n_heads * cfg.head_dim * n_avg_index_keys
        indexer *= blocks
        n_avg_keys = n_avg_index_keys
    if getattr(cfg, "index_topk_blocks", None) is not None:  # block-sparse attention: the chosen blocks' keys, and the indexer
        if n_avg_block_keys is None:
            raise ValueError(f"n_avg_block_keys: block-sparse attention attends to the keys of index_topk_blocks = {cfg.index_topk_blocks} blocks "
                             f"of {cfg.index_block_size}: pass their mean (mean_block_keys(cu_seqlens, index_topk_blocks, index_block_size))")
        _check_count("n_avg_block_keys", n_avg_block_keys)
        _check_count("n_avg_keys", n_avg_keys)
        parallel = getattr(cfg, "parallel_hybrid", False)  # attention beside the linear mixers: in those blocks too
        is_linear, is_mixer_free = (getattr(cfg, n, lambda i: False) for n in ("is_linear", "is_mixer_free"))
        blocks = sum(cfg.is_index_blocks(i) and not is_mixer_free(i) and (parallel or not is_linear(i)) for i in range(cfg.n_layers)) + cfg.mtp_depth
        H, N, D, Ni, Di = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.index_heads, cfg.index_head_dim
        Dv = getattr(cfg, "v_head_dim", None) or D
        per_block = 6 * N * (D + Dv) * (n_avg_block_keys - n_avg_keys)  # flops_per_token counts n_avg_keys for them
        if cfg.index_loss_coeff > 0:
            per_block += 4 * H * Di + 8 * H * Ni * Di + 10 * Ni * Di * n_avg_keys + 2 * N * D * n_avg_block_keys
        else:
            per_block += 2 * H * (Ni * Di + Di) + 2 * Ni * Di * n_avg_keys
        indexer += blocks * per_block
    compressed = 0.0
    if getattr(cfg, "compress_layers", None):  # heavily compressed attention: the compressor's projections, the entries' scores and values
        if n_avg_compressed_keys is None:
            raise ValueError(f"n_avg_compressed_keys: blocks {list(cfg.compress_layers)} attend to compressed entries too: pass their mean "
                             f"(mean_compressed_entries(cu_seqlens, compress_rate = {cfg.compress_rate}))")
        _check_count("n_avg_compressed_keys", n_avg_compressed_keys)
        D = cfg.head_dim
        compressed = len(cfg.compress_layers) * (6 * 2 * cfg.hidden * D + 6 * cfg.n_heads * 2 * D * n_avg_compressed_keys)
    if getattr(cfg, "csa_layers", None):  # compressed sparse attention: the compressor, the chosen entries, the indexer's forward
        for name, value in (("n_avg_csa_entries", n_avg_csa_entries), ("n_avg_csa_chosen", n_avg_csa_chosen)):
            if value is None:
                raise ValueError(f"{name}: blocks {list(cfg.csa_layers)} attend to compressed sparse entries: pass the mean entries a query "
                                 f"{'sees' if name.endswith('entries') else 'attends to'} (mean_compressed_entries(cu_seqlens, csa_rate = "
                                 f"{cfg.csa_rate}{'' if name.endswith('entries') else f', csa_topk = {cfg.csa_topk}'}))")
            _check_count(name, value)
        D, Ni, Di = cfg.head_dim, cfg.index_heads, cfg.index_head_dim
        csa_indexer = 2 * (2 * cfg.hidden * 2 * Di + cfg.q_rank * Ni * Di + cfg.hidden * Ni + Ni * (Di + 1) * n_avg_csa_entries)
        if cfg.index_loss_coeff > 0:  # its loss: the compressor's dW, the chosen slots' scores twice (recomputed), their dW and products' backward
            csa_indexer += 2 * 2 * cfg.hidden * 2 * Di + 6 * (cfg.q_rank * Ni * Di + cfg.hidden * Ni) + 8 * Ni * (Di + 1) * cfg.csa_topk
        compressed += len(cfg.csa_layers) * (6 * 2 * cfg.hidden * 2 * D + 6 * cfg.n_heads * 2 * D * n_avg_csa_chosen + csa_indexer)
    shortcut = 0.0
    if getattr(cfg, "shortcut_moe", False):  # the dense MLP beside each trunk MoE
        shortcut = sum(is_moe(i) for i in range(cfg.n_layers)) * 6 * mlp_matrices * cfg.hidden * cfg.ffn_dense
    if getattr(cfg, "dense_beside_moe", False):  # Gemma 4's dense MLP beside each MoE, trunk and MTP
        n_moe = sum(is_moe(i) for i in range(cfg.n_layers))
        shortcut += (n_moe + (cfg.mtp_depth if n_moe else 0)) * 6 * mlp_matrices * cfg.hidden * cfg.ffn_dense
    gated_norms = 0.0
    rank = getattr(cfg, "norm_gate_rank", None)
    if rank:  # the attention's pre-norm of every block, the MLP's of MoE blocks: 2 H r weights each
        n_moe = cfg.n_layers - n_dense
        gated_norms = 6 * 2 * cfg.hidden * rank * (cfg.n_layers - mixer_free + n_moe + cfg.mtp_depth * (2 if n_moe else 1))
    hc = 0.0
    n = getattr(cfg, "hyper_connections", 0)
    if n:  # the streams' weights and sums: two per trunk block, and the head's
        H, manifold = cfg.hidden, cfg.hc_kind == "manifold"
        M = 2 * n + (n * n if manifold else 0)
        hc = (2 * cfg.n_layers - mlp_free - mixer_free) * 6 * (M * n * H + n * H + (n * n * H if manifold else 0)) + 6 * (n * n * H + n * H)
    no_mlp = mlp_free * 6 * mlp_matrices * cfg.hidden * cfg.ffn_dense  # counted among the dense blocks below
    latent = 0.0
    L = getattr(cfg, "moe_latent", None)
    if L:  # a latent MoE: its two projections, and the routed experts over L channels instead of H (trunk and MTP MoE blocks)
        n_moe = sum(is_moe(i) for i in range(cfg.n_layers))
        n_moe += cfg.mtp_depth if n_moe else 0
        latent = n_moe * (6 * 2 * cfg.hidden * L + 6 * (L - cfg.hidden) * mlp_matrices * cfg.ffn_expert * values["k"])
    vocab = getattr(cfg, "head_vocab", cfg.vocab_size)  # the output head's rows (out_vocab)
    return indexer + compressed + shortcut + hc + gated_norms + latent + beside - no_mlp + flops_per_token(**values, n_dense=n_dense, n_shared=shared, vocab=vocab,
                                     n_avg_keys=n_avg_keys, n_sliding=n_sliding, n_avg_local_keys=n_avg_local_keys,
                                     attn_gate=bool(getattr(cfg, "attn_gate", False)) and not getattr(cfg, "attn_gate_on_q", False),
                                     attn_gate_per_head=bool(getattr(cfg, "attn_gate_per_head", False)), **attention, **linear,
                                     mlp_matrices=mlp_matrices, n_mlp_only=mixer_free)


def active_parameters(model) -> int:
    """The parameters a token runs through: all of model's (model.parameters(), each shared
    one once; a DTensor's global numel) less, for each MoE layer of model.moe_layers() (the
    trunk's and the MTP modules'), the (E - k) / E share of its routed experts' parameters
    (its `experts` module: w_gate / w_up [E, H or L, F], w_down [E, F, H or L], the expert
    biases): a token runs k of the E experts. From the weights' actual shapes, so a GLU
    (3 matrices) or plain (relu2: 2) expert and a latent MoE (experts over L channels)
    count alike. k is cfg.k, which with zero experts counts the zero-computation ones: then
    it is an upper bound. Everything else counts whole (embeddings, shared experts, routers,
    a mixture of attention heads' heads). model: a fmoe.model.Transformer (any device,
    meta included) or a module with the same moe_layers()."""
    if not callable(getattr(model, "moe_layers", None)) or not callable(getattr(model, "parameters", None)):
        raise ValueError(f"model: expected a fmoe.model.Transformer (or a module with its moe_layers()), got {type(model).__name__}")
    total = sum(p.numel() for p in model.parameters())
    for name, moe in model.moe_layers().items():
        n_experts, k = moe.cfg.n_experts, moe.cfg.k
        routed = sum(p.numel() for p in moe.experts.parameters())
        if routed % n_experts:
            raise ValueError(f"model: MoE layer {name}'s routed experts hold {routed} parameters, not n_experts={n_experts} equal shares")
        total -= routed // n_experts * max(n_experts - k, 0)
    return total


def datasheet_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU from its name (torch.cuda.get_device_name), None if
    unknown: H100 SXM / H200 989e12, H100 NVL 835e12, H100 PCIe 756e12, A100 312e12."""
    if not isinstance(name, str):
        raise ValueError(f"name: expected a GPU name string, got {type(name).__name__}")
    upper = name.upper()
    return next((peak for key, peak in _PEAKS if key in upper), None)


def peak_flops(device: Union[torch.device, str, int, None] = None) -> Optional[float]:
    """Dense bf16 datasheet peak of a CUDA device; None on CPU, without CUDA, or unknown."""
    try:
        device = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) else torch.device(device or "cuda")
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device, a device string or a CUDA index, got {device!r}") from None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return datasheet_peak_flops(torch.cuda.get_device_name(device))


def mfu(tokens_per_s: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: tokens_per_s * flops_per_token / peak (None when peak is)."""
    _check_count("tokens_per_s", tokens_per_s)
    _check_count("flops_per_token", flops_per_token)
    if peak is None:
        return None
    if isinstance(peak, bool) or not isinstance(peak, Real) or not 0 < peak < math.inf:
        raise ValueError(f"peak: expected finite FLOP/s > 0 or None, got {peak!r}")
    return tokens_per_s * flops_per_token / peak


def layer_loads(counts: Union[torch.Tensor, Sequence], slots: Union[int, torch.Tensor], *, zero_experts: int = 0) -> dict:
    """Record entries for the MoE layers from their counts [L, E] (a tensor or a list of
    [E] rows, E >= 1, each layer's tokens_per_expert summed as wanted) and the slots requested
    (T k; a whole number >= 0, 32 or 32.0, or a 0-D tensor, e.g. token_mask.sum() * k, never
    read on the host):
    tokens_per_expert [L, E], load_max_over_mean [L], load_cv [L], dropped_fraction [L].
    zero_experts: the last Z of the E columns count zero-computation experts' slots
    (fmoe.layers.MoEConfig.zero_experts): max/mean and CV are then the computing experts'
    alone, zero_fraction [L] is the share of the slots the zero experts took, and zero_experts
    (Z, an int) says which columns they are (fmoe.train.plot leaves them out of the shares).
    The maths is fmoe.ops.load_stats'; tensors in, tensors out (no host sync: to_host turns
    them into numbers with the step's other values). Counts given as numbers are checked:
    finite, >= 0, and each layer's sum at most slots (a ValueError)."""
    host = False  # counts given as numbers (on the host): their values are checked
    if isinstance(counts, Sequence) and counts and all(isinstance(row, torch.Tensor) for row in counts):
        if len({(row.shape, row.device) for row in counts}) != 1:
            raise ValueError(f"counts: expected [E] rows of one shape and device, got {[(tuple(r.shape), str(r.device)) for r in counts]}")
        counts = torch.stack(list(counts))  # each layer's tokens_per_expert
    elif not isinstance(counts, torch.Tensor):  # a list of rows: on the host already, so its values are checked (a tensor's are not read)
        try:
            counts = torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError) as err:  # strings, None, ragged rows: torch's "too many dimensions 'str'"
            raise ValueError(f"counts: expected [L, E] counts (a tensor or a list of [E] rows of numbers), got {counts!r} ({err})") from None
        if counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"counts: expected counts (numbers >= 0), got {counts.dtype} values")
        bad = counts[~(torch.isfinite(counts) & (counts >= 0))] if counts.is_floating_point() else counts[counts < 0]
        if bad.numel():  # a negative count gave a load, NaN NaNs, without a word
            raise ValueError(f"counts: expected finite counts >= 0, got {bad[0].item()!r}")
        host = True
    counts_LE = counts
    if counts_LE.ndim != 2 or counts_LE.shape[1] == 0:
        raise ValueError(f"counts: expected [L, E] counts with E >= 1 (one row per MoE layer), got shape {tuple(counts_LE.shape)}")
    if isinstance(slots, torch.Tensor):  # e.g. token_mask.sum() * k: read on the device, as load_stats reads it
        if slots.ndim != 0 or slots.dtype == torch.bool or slots.is_complex():
            raise ValueError(f"slots: expected a whole number >= 0 or a 0-D real tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    else:  # a count of slots: 32.0 is 32 (load_stats takes an int)
        if isinstance(slots, bool) or not isinstance(slots, Real) or not (math.isfinite(slots) and slots >= 0 and slots == int(slots)):
            raise ValueError(f"slots: expected a whole number >= 0 or a 0-D real tensor, got {slots!r}")
        slots = int(slots)
        over = slots * (1 + 1e-6)  # fractional counts' float rounding: ten 0.1s sum to 1.0000001
        if host and (routed := counts_LE.double().sum(dim=-1)).gt(over).any():  # T for T k: dropped_fraction -1, without a word
            layer = int(routed.gt(over).nonzero()[0, 0])
            raise ValueError(f"counts: layer {layer}'s counts sum to {routed[layer].item():g} slots, more than slots={slots} "
                             "(the slots requested: tokens times k)")
    check_positive_int("zero_experts", zero_experts, 0, counts_LE.shape[1] - 1)  # fewer than counts' columns
    E = counts_LE.shape[1] - zero_experts
    load = load_stats(counts_LE[:, :E], slots)
    record = {
        "tokens_per_expert": counts_LE,
        "load_max_over_mean": load["max_over_mean"],
        "load_cv": load["cv"],
        "dropped_fraction": load_stats(counts_LE, slots)["dropped_fraction"] if zero_experts else load["dropped_fraction"],
    }
    if zero_experts:
        record["zero_fraction"] = counts_LE[:, E:].sum(dim=-1).float() / (slots.to(counts_LE.device).clamp(min=1) if isinstance(slots, torch.Tensor)
                                                                          else max(slots, 1))
        record["zero_experts"] = zero_experts
    return record


def _plain(value):
    """A JSON-ready copy of value: tensors and numpy arrays to numbers / lists (integers stay
    integers, bools bools), non-finite floats to None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, (np.ndarray, np.generic)):  # numpy's arrays and scalars as Python's (an int64 was written 1000.0)
        value = value.tolist()
    if isinstance(value, dict):
        plain, keys = {}, {}
        for k, v in value.items():
            if str(k) in keys:  # JSON's keys are strings: the later value replaced the other, without a word
                raise ValueError(f"record: keys {keys[str(k)]!r} and {k!r} would both be written as the JSON key {str(k)!r}")
            keys[str(k)], plain[str(k)] = k, _plain(v)
        return plain
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Real):  # other real numbers
        return _plain(float(value))
    raise ValueError(f"record: cannot write a {type(value).__name__} as JSON")


def _si(x: float) -> str:
    """x to one decimal in the smallest unit that keeps it under 1000 once rounded (999999 is 1.0M, not 1000.0k)."""
    for unit, scale in (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        text = f"{x / scale:.1f}"
        if abs(float(text)) < 1000:
            return text + unit
    return f"{x / 1e12:.1f}T"  # 2e12 was 2000.0G


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_progress(step: int, total_steps: int, record: dict, *, width: int = 20) -> str:
    """`[####................] step 12/100 loss 3.2100 lr 1.0e-03 gnorm 0.51 load 1.32
    tok/s 12.3k eta 4m05s` (the fields present in record, in that order). `load` is the
    worst MoE layer's max/mean expert load (record["load_max_over_mean"], one per layer):
    near 1 is balanced, E/k means one expert takes every token. `eta` is
    record["eta_seconds"]. step: an int >= 0, total_steps and width ints >= 1; each of those
    fields a number or a one-element tensor (or numpy array), else a ValueError (a value of
    another kind, a string, is left out). A NaN or infinite loss, val or gnorm shows as nan /
    inf; the other fields show finite values alone."""
    check_positive_int("step", step, 0)  # NaN, None, "3" gave torch's or Python's errors, naming none
    check_positive_int("total_steps", total_steps)  # 1.5 printed "step 1/1.5"
    check_positive_int("width", width)  # 0 and -3 printed "[]"
    if not isinstance(record, dict):
        raise ValueError(f"record: expected a dict of the step's metrics, got {type(record).__name__}")
    done = min(max(step / total_steps, 0.0), 1.0)
    filled = int(done * width)
    parts = [f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total_steps}"]
    loads = record.get("load_max_over_mean")
    if isinstance(loads, torch.Tensor):  # layer_loads' tensors, as MetricsLogger.log takes them
        loads = loads.detach().reshape(-1).tolist()
    elif isinstance(loads, (np.ndarray, np.generic)):  # numpy's, as MetricsLogger.log takes them too (left out of the line before)
        loads = np.asarray(loads).reshape(-1).tolist()
    # the worst finite layer's (read_metrics gives a non-finite value back as None; NaN would win or lose by its place)
    finite = [v for v in loads if isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)] if isinstance(loads, (list, tuple)) else []
    values = dict(record, load=max(finite) if finite else None)
    formats = (("loss", "loss", "{:.4f}"), ("val_loss", "val", "{:.4f}"), ("lr", "lr", "{:.1e}"),
               ("grad_norm", "gnorm", "{:.3g}"), ("load", "load", "{:.2f}"), ("tokens_per_s", "tok/s", _si),
               ("mfu", "mfu", "{:.1%}"), ("eta_seconds", "eta", _duration))
    for key, label, fmt in formats:
        value = values.get(key)
        if isinstance(value, (torch.Tensor, np.ndarray)):  # a 1-D loss gave torch's "a Tensor with 3 elements cannot be converted"
            if math.prod(value.shape) != 1:
                raise ValueError(f"record[{key!r}]: expected a number or a one-element tensor, got a {type(value).__name__} of "
                                 f"shape {list(value.shape)}")
            value = value.item()
        if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
            parts.append(f"{label} {fmt(value) if callable(fmt) else fmt.format(value)}")
        elif isinstance(value, Real) and not isinstance(value, bool) and key in ("loss", "val_loss", "grad_norm"):
            parts.append(f"{label} {value}")  # nan, inf: a diverged step says so (--check_finite=False went on without them shown)
    return " ".join(parts)


def _nest(flat: list, shape: tuple) -> list:
    """A flat row-major list as nested lists of `shape` (at least 1-D)."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def to_host(values: dict) -> dict:
    """The values with every tensor turned into Python numbers in ONE device->host transfer
    per device (a step's logged losses, counts and norms, gathered at its end instead of a
    sync per value). 0-D tensors become a number, others (nested) lists of their shape; integer dtypes give ints (exact up to 2**53: they travel as float64), bool tensors bools.
    A complex tensor or number is a ValueError (MetricsLogger.log writes none). Other values pass through.

    >>> to_host({"loss": torch.tensor(2.5), "counts": torch.tensor([[1, 2], [3, 4]]), "step": 7})
    {'loss': 2.5, 'counts': [[1, 2], [3, 4]], 'step': 7}
    """
    if not isinstance(values, dict):
        raise ValueError(f"values: expected a dict, got {type(values).__name__}")
    out = dict(values)
    by_device: dict = {}
    for name, v in values.items():
        # a complex one became the int of its real part (torch's cast), or passed through to a logger that refuses it
        if isinstance(v, torch.Tensor) and v.is_complex() or isinstance(v, Complex) and not isinstance(v, Real):
            raise ValueError(f"values[{name!r}]: expected a real (or bool) tensor or number, got a complex "
                             f"{f'tensor ({v.dtype})' if isinstance(v, torch.Tensor) else f'number {v!r}'}")
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(name)
    for names in by_device.values():
        host = torch.cat([values[n].detach().reshape(-1).to(torch.float64) for n in names]).tolist()  # the transfer
        start = 0
        for name in names:
            t = values[name]
            chunk, start = host[start : start + t.numel()], start + t.numel()
            if t.dtype == torch.bool:
                chunk = [bool(x) for x in chunk]
            elif not t.is_floating_point():
                chunk = [int(x) for x in chunk]
            out[name] = chunk[0] if t.ndim == 0 else _nest(chunk, tuple(t.shape))
    return out


class MetricsLogger:
    """Appends one JSON object per step to `<out_dir>/metrics.jsonl` and prints a one-line
    progress on rank 0 (other ranks log nothing, so every rank may call log()). Tensors and
    numpy values are written as numbers and lists; a NaN or infinite number as null (strict
    JSON: read it back as None).

    start_step: the step the run starts or resumes at; records of the file with step >=
    start_step are dropped at construction (a fresh run, start_step=0, starts an empty file;
    a resumed run keeps one record per step); the file is rewritten whole or not at all (a
    failure leaves it as it was).
    tensorboard: also write every number of each record to TensorBoard event files in
    `<out_dir>/tensorboard` (torch's SummaryWriter; the `tensorboard` package, the
    `fmoe[tensorboard]` extra): a scalar as its key, a list of numbers (per MoE layer) as
    key/0, key/1, ..., a dict of numbers (tokens per data source) as key/name. The writer opens
    with purge_step=start_step, so TensorBoard hides the events of steps >= start_step that
    an earlier (killed) run wrote: one record per step there too. Without the package, an
    ImportError naming the extra before anything is written (the file and out_dir as they were).
    """

    def __init__(self, out_dir, *, rank: int = 0, total_steps: int, start_step: int = 0, print_progress: bool = True,
                 tensorboard: bool = False):
        check_positive_int("total_steps", total_steps)  # 2.5 and 1.5 were taken (a finite number)
        check_positive_int("start_step", start_step, 0)
        out_dir = Path(out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"out_dir: {str(out_dir)!r} exists and is not a directory")
        self.path = out_dir / "metrics.jsonl"
        self.rank, self.total_steps, self.print_progress = rank, total_steps, print_progress
        self.writer, self.closed = None, False
        if rank != 0:
            return
        summary_writer = None
        if tensorboard:  # before anything is written: a refusal leaves out_dir as it was
            try:
                from torch.utils.tensorboard import SummaryWriter as summary_writer
            except ImportError as err:
                raise MissingExtra("tensorboard: needs the tensorboard package: pip install 'fmoe[tensorboard]'") from err
        out_dir.mkdir(parents=True, exist_ok=True)
        refuse_link(self.path)
        kept = [line for line in read_metrics_lines(self.path) if json.loads(line)["step"] < start_step]
        # written beside it and renamed over it: a run killed (or a disk full) during the rewrite left the log cut short
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.unlink(missing_ok=True)  # a link there (a run folder from elsewhere) is not written through
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        if summary_writer is not None:
            self.writer = summary_writer(str(out_dir / "tensorboard"), purge_step=start_step)

    def log(self, step: int, record: dict) -> None:
        """Write {"step": step, **record} as one line (and print the progress line). step: an
        int >= 0 (read_metrics keeps the records with an int step); a "step" the record holds
        too must be the same int (ValueError: it overrode step, and a float one was written
        where read_metrics then left the record out). A ValueError after close() (the
        TensorBoard events stopped there without a word, the file went on), and for a record
        whose keys write as the same JSON key (1 and "1": one was lost)."""
        if self.closed:
            raise ValueError("MetricsLogger: log() after close(): open another MetricsLogger (start_step: the next step) to go on")
        check_positive_int("step", step, 0)
        if not isinstance(record, dict):
            raise ValueError(f"record: expected a dict, got {type(record).__name__}")
        if "step" in record and not (type(record["step"]) is int and record["step"] == step):
            raise ValueError(f"record: its 'step' is the step logged, expected {step} (or no 'step' key), got {record['step']!r}")
        if self.rank != 0:
            return
        plain = _plain(record)
        line = json.dumps({"step": step, **plain}, allow_nan=False)
        with self.path.open("a") as f:
            f.write(line + "\n")
        if self.writer is not None:
            for key, value in _scalars(plain):
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.print_progress:
            print(format_progress(step, self.total_steps, record), flush=True)

    def close(self) -> None:
        """Close the TensorBoard writer (if any); log() is refused after it. A second close() does nothing."""
        self.closed = True
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalars(record: dict):
    """(tag, number) of every number in a plain record: scalars, lists and dicts of numbers."""
    for key, value in record.items():
        if _is_number(value):
            yield key, value
        elif isinstance(value, list) and value and all(_is_number(v) for v in value):
            yield from ((f"{key}/{i}", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            yield from ((f"{key}/{name}", v) for name, v in value.items() if _is_number(v))


def read_metrics_lines(path) -> list[str]:
    """The record lines of a metrics.jsonl: JSON objects with an int "step" (a torn last line
    of a killed run, or any other line, one not UTF-8 included, is left out); [] when the file
    does not exist. path: a str or os.PathLike, not a directory (ValueError)."""
    path = Path(check_path("path", path, "the path of a metrics.jsonl"))  # None: Path's TypeError
    if path.is_dir():  # IsADirectoryError before
        raise ValueError(f"path: expected the path of a metrics.jsonl, got the directory {str(path)!r} (its metrics.jsonl: {str(path / 'metrics.jsonl')!r})")
    if not path.exists():
        return []
    lines = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            lines.append(line)
    return lines


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl, in file order."""
    return [json.loads(line) for line in read_metrics_lines(path)]


# ----------------------------------------------------------------------------------------
# host syncs
# ----------------------------------------------------------------------------------------

# the ways Python code reads a tensor's values on the host: torch.Tensor's methods, torch's functions (and .to, when it
# copies to the host: _copies_to_host)
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__complex__", "__index__", "is_nonzero", "equal", "allclose")
_TORCH_READS = ("is_nonzero", "equal", "allclose")
_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller() -> str:
    """file:line of the innermost frame outside torch (where the read was asked for)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _copies_to_host(tensor: torch.Tensor, *args, **kwargs) -> bool:
    """Whether tensor.to(*args, **kwargs) waits for a copy from a device to the host, as
    HostReads counts it: tensor not on the CPU, the CPU as the target (a string, a
    torch.device, or another tensor's device: to(other)), without non_blocking=True. (A .to
    of a CPU tensor is no read: its device may be a variable that names the GPU there.)"""
    target = kwargs.get("device", kwargs.get("tensor", args[0] if args else None))
    other = isinstance(target, torch.Tensor)  # to(other, non_blocking, ...), else to(device, dtype, non_blocking, ...)
    if other:
        target = target.device
    elif not isinstance(target, (str, torch.device)):  # a dtype alone, or an int: an accelerator's index
        return False
    at = 1 if other else 2  # non_blocking's place
    return (tensor.device.type != "cpu" and torch.device(target).type == "cpu"
            and not kwargs.get("non_blocking", args[at] if len(args) > at else False))


class HostReads:
    """Count the host reads of tensor values (device->host syncs) made while active.

        with HostReads() as reads:
            losses, stats = model(batch, ctx); loss.backward()
        reads.count, reads.sites      # 0, Counter() on the reference model's forward+backward

    On a GPU each `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `float(t)`, `int(t)`,
    `complex(t)`, `bool(t)` (an `if` on a tensor), `t.__index__()`, `t.is_nonzero()`,
    `t.equal(u)`, `t.allclose(u)` (and torch.is_nonzero, torch.equal, torch.allclose) of a
    device tensor stalls the host until the device is done, and so does a copy to the host
    by `.to` without non_blocking=True. HostReads wraps those methods of torch.Tensor and
    functions of torch, so it counts them on any device, CPU included: the count of a CPU
    run is the number of these reads the same code makes on a GPU (a `.cpu()` of a CPU
    tensor counts, as its tensor would be on the GPU there), but for `.to`, counted only
    from a device tensor to the CPU: its target is often a variable (`t.to(device)`) that
    names the CPU on a CPU run and the GPU on a GPU, so a CPU run cannot tell. Reads made through these count too (f"{t:.2f}" and `x in t`
    call `.item()`, printing a tensor reads its elements). Not counted: other syncs
    (torch.cuda.synchronize, a blocking `host.copy_(t)`, a non_blocking copy waited on
    later, ops whose output size depends on values such as nonzero) and functions bound
    before entry (`from torch import equal`). `sites` counts the reads by the file:line
    that asked (the first frame outside torch). With cuda=True it also counts the
    synchronizing CUDA operations that torch.cuda.set_sync_debug_mode("warn") reports
    (blocking copies, nonzero, ...), in `cuda_syncs`. Not thread-safe, not reentrant; eager
    code only (torch.compile's graphs do not call these methods).
    """

    def __init__(self, *, cuda: bool = False):
        self.cuda = bool(cuda)
        self.count, self.cuda_syncs = 0, 0
        self.sites: collections.Counter = collections.Counter()
        self._saved: dict = {}

    def _wrap(self, owner, name: str, reads: Optional[Callable[..., bool]] = None):
        original = getattr(owner, name)

        def read(*args, **kwargs):
            if reads is None or reads(*args, **kwargs):
                self.count += 1
                self.sites[_caller()] += 1
            return original(*args, **kwargs)

        self._saved[owner, name] = owner.__dict__.get(name)  # None: inherited from the C base
        setattr(owner, name, read)

    def __enter__(self) -> "HostReads":
        if self._saved:
            raise RuntimeError("HostReads: already active (not reentrant)")
        for name in _READS:
            self._wrap(torch.Tensor, name)
        for name in _TORCH_READS:
            self._wrap(torch, name)
        self._wrap(torch.Tensor, "to", _copies_to_host)
        if self.cuda:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved = {}
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._warnings.__exit__(*exc)
            self.cuda_syncs = sum("synchronizing CUDA operation" in str(w.message) for w in self._caught)


class SavedTensors:
    """Count the bytes autograd keeps for the backward of what runs while active.

        with SavedTensors(exclude=model.parameters()) as saved:
            losses, stats = model(batch, ctx)
        saved.nbytes, saved.count     # activations kept for backward, each storage once

    A torch.autograd.graph.saved_tensors_hooks pack hook sees every tensor an op saves for
    its backward, the inputs of non-reentrant activation-checkpoint regions included (their
    insides are recomputed, not kept). Views of one storage count once, by the storage's
    size; tensors sharing storage with `exclude` (the parameters: not activations) are not
    counted. Works on any device, CPU included; it counts what is kept, not the allocator's
    peak (use torch.cuda.max_memory_allocated for that on a GPU). Under FSDP2 the unsharded
    weights an op saves are counted too (exclude holds the sharded parameters, not the
    all-gathered copies).
    """

    def __init__(self, *, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = None

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded and storage.nbytes():
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    @property
    def count(self) -> int:
        return len(self._storages)

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class AllocatedBytes:
    """Live and peak bytes of the tensor storages created while active, on any device.

        with AllocatedBytes() as mem:
            model = build()                  # e.g. on the meta device, sharded, materialised
        mem.peak, mem.live                   # bytes: the most held at once, and held at exit

    A TorchDispatchMode sees the result of every op (factories included; a DTensor's local
    shard is counted, not the DTensor wrapper); each new storage is counted once, from its
    creation until it is freed (a weak reference to it), at its size when an op last saw it
    (a `resize_` counts its new size, the old one freed; a storage resized without an op,
    `untyped_storage().resize_`, at the next op that sees it). Storages that existed before
    (an op's inputs, in-place results) are not counted, resized or not. Meta tensors cost
    nothing. It counts tensors, not the allocator's caching or the process's other memory,
    and only the results of the ops it sees: the scratch a custom op allocates inside (fmoe's
    fused losses, grouped GEMMs) is below it. On CPU it is the exact answer to "did this rank
    ever hold more than its shards" (building and loading use plain ops). Slow (Python per
    op): for measuring, not for training.
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._counted: dict[int, Optional[int]] = {}  # id of each storage seen -> its bytes counted (None: it existed before)
        self._mode = None

    def _storage(self, t):
        from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return None
        return t.untyped_storage()

    def _note(self, tensors, *, new: bool) -> None:
        import weakref

        for t in tensors:
            storage = self._storage(t)
            if storage is None:
                continue
            key = id(storage)  # one Python object per storage while it lives (its finalizer below drops the key)
            if key not in self._counted:
                self._counted[key] = 0 if new else None
                weakref.finalize(storage, self._free, key)
            counted = self._counted[key]
            if counted is not None and counted != storage.nbytes():  # new, or resized in place since
                self.live += storage.nbytes() - counted
                self._counted[key] = storage.nbytes()
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._counted.pop(key) or 0

    def __enter__(self) -> "AllocatedBytes":
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter._note(tree_leaves((args, kwargs)), new=False)
                out = func(*args, **(kwargs or {}))
                counter._note(tree_leaves(out), new=True)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


# ----------------------------------------------------------------------------------------
# energy
# ----------------------------------------------------------------------------------------


def _bare_uuid(uuid: str) -> str:
    """A GPU UUID without its "GPU-" prefix, lower case (NVML writes "GPU-<uuid>", torch
    the bare uuid)."""
    uuid = str(uuid).strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def nvml_index(cuda_index: int, *, visible: Optional[str] = None, nvml_uuids: Sequence[str] = (),
               cuda_uuid: Optional[str] = None) -> int:
    """The NVML index of the CUDA device torch calls cuda:cuda_index.

    NVML numbers every GPU of the machine, ignoring CUDA_VISIBLE_DEVICES; CUDA numbers the
    visible ones, in its own order. In order of preference:
      1. cuda_uuid (torch.cuda.get_device_properties(i).uuid) found among nvml_uuids (NVML's
         "GPU-..." UUIDs by NVML index): exact whatever the environment;
      2. visible = CUDA_VISIBLE_DEVICES unset (None): cuda_index itself (CUDA's default
         order, fastest first, is NVML's PCI order on machines of one GPU model);
      3. the cuda_index-th entry of CUDA_VISIBLE_DEVICES: an integer is an NVML index
         (exact with CUDA_DEVICE_ORDER=PCI_BUS_ID, and on machines of one GPU model), a
         UUID or a unique prefix of one ("GPU-8f3a") is looked up in nvml_uuids.
    ValueError when the device cannot be found (an index past the visible list, a UUID no
    NVML device has, a MIG instance's "MIG-..." id: its GPU's counter is not its own).

    >>> nvml_index(1, visible="6,2")
    2
    >>> nvml_index(0, visible="GPU-bb", nvml_uuids=["GPU-aa11", "GPU-bb22"])
    1
    """
    if isinstance(cuda_index, bool) or not isinstance(cuda_index, int) or cuda_index < 0:
        raise ValueError(f"cuda_index: expected an int >= 0, got {cuda_index!r}")
    bare = [_bare_uuid(u) for u in nvml_uuids]
    if cuda_uuid is not None and _bare_uuid(cuda_uuid) in bare:
        return bare.index(_bare_uuid(cuda_uuid))
    if visible is None:
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if cuda_index >= len(entries):
        raise ValueError(f"cuda_index: cuda:{cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry)
    matches = [i for i, u in enumerate(bare) if u.startswith(_bare_uuid(entry))]
    if len(matches) != 1:
        raise ValueError(f"visible: CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} of the NVML devices' UUIDs (a MIG instance has no energy counter of its own)")
    return matches[0]


class EnergyMeter:
    """The energy a GPU used between two calls, from NVML's total-energy counter.

        meter = EnergyMeter(device)                  # at start
        meter.agree(group, device)                   # several processes: on every rank of group
        ...
        joules = meter.joules_since_last()           # once per step, after the step's host sync

    query(nvml_index) -> millijoules used since the driver loaded
    (pynvml.nvmlDeviceGetTotalEnergyConsumption of the device's handle by default, Volta and
    newer). The torch device's NVML index is found by nvml_index (its UUID when torch
    reports one, else CUDA_VISIBLE_DEVICES). `query` can be given instead of NVML (tests
    pass a fake counter); with one given, no NVML is loaded and the index comes from
    CUDA_VISIBLE_DEVICES alone.

    `available` says whether readings come; otherwise `reason` says why: "CPU device",
    "pynvml not installed (pip install nvidia-ml-py)", "NVML error: ..." (no driver, a GPU
    without the counter), "device: ..." (not found among NVML's devices). The counter is
    read on the host (no GPU sync): call it right after the step's one device->host
    transfer, so that the interval covers the step's GPU work. A reading that fails later
    makes the meter unavailable (None from then on); a counter that went backwards (the
    driver reloaded) gives None for that interval.

    Several processes: `agree(group, device)` on every rank of the group, once, makes the
    meter the group's. Its readings are then the sum over the group's devices, and
    `available` is the same on every rank: where one rank's meter cannot read (no pynvml on
    one node, a GPU without the counter), none reads, that rank keeping its own reason and
    the others' saying how many ranks lack it. Each reading is then a collective on every
    rank (called by each at the same step, as the loop does): None on every rank for an
    interval one rank's counter went backwards in; a read that fails on one rank makes every
    rank's meter unavailable. A meter read on some ranks only would leave the others waiting
    in a collective the first skipped.
    """

    def __init__(self, device, *, query: Optional[Callable[[int], float]] = None):
        self.device = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) else torch.device(device)
        self.available, self.reason, self.index = False, None, None
        self._query, self._errors, self._last = None, (Exception,), None
        self._group = None  # (group, device of its collectives) once agree()d and available
        self.reason = self._start(query)
        self.available = self.reason is None

    def _start(self, query) -> Optional[str]:
        if self.device.type != "cuda":
            return f"{self.device.type.upper()} device"
        cuda_index = self.device.index
        if cuda_index is None:
            cuda_index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        uuids, cuda_uuid = (), None
        if query is None:
            try:
                import pynvml
            except ImportError:
                return "pynvml not installed (pip install nvidia-ml-py)"
            self._errors = (pynvml.NVMLError,)
            try:
                pynvml.nvmlInit()
                uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
            except pynvml.NVMLError as e:
                return f"NVML error: {e}"
            uuids = [u.decode() if isinstance(u, bytes) else str(u) for u in uuids]
            if torch.cuda.is_available() and cuda_index < torch.cuda.device_count():
                cuda_uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)

            def query(index):
                return pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(index))

        try:
            self.index = nvml_index(cuda_index, visible=visible, nvml_uuids=uuids, cuda_uuid=None if cuda_uuid is None else str(cuda_uuid))
        except ValueError as e:
            return f"device: {e}"
        self._query = query
        try:
            self._last = float(query(self.index))
        except self._errors as e:
            return f"NVML error: {e}"
        return None

    def agree(self, group, device) -> None:
        """Make this meter the group's (class docstring): one all_reduce on `device` (the
        group's backend's: CUDA for nccl, the CPU for gloo), on every rank of `group`."""
        import torch.distributed as dist

        lacking = torch.tensor([0.0 if self.available else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(lacking, group=group)
        lacking, world = int(lacking.item()), dist.get_world_size(group)
        if lacking and self.available:
            self.available, self.reason = False, f"{lacking} of {world} ranks cannot read it"
        self._group = (group, device) if self.available else None

    def joules_since_last(self) -> Optional[float]:
        """Joules used since the previous call (or construction); None when unavailable.
        Once agree()d: the group's joules, a collective on every rank (class docstring)."""
        if not self.available:
            return None
        try:
            now = float(self._query(self.index))
        except self._errors as e:
            self.available, self.reason = False, f"NVML error: {e}"
            now = None
        used = None
        if now is not None:
            used, self._last = now - self._last, now
            used = used / 1000.0 if used >= 0 else None
        if self._group is None:
            return used
        import torch.distributed as dist

        group, device = self._group
        sums = torch.tensor([used or 0.0, used is None, not self.available], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        total, missing, failed = sums.tolist()
        if failed:  # one rank's read failed: every rank's meter stops, so that none waits in this collective again
            self._group = None
            if self.available:
                self.available, self.reason = False, f"NVML error on {int(failed)} of {dist.get_world_size(group)} ranks"
            return None
        return None if missing else total


# ----------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------


def _local_numel(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor  # torch.distributed only when a DTensor may exist

    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def _mesh_key(t: torch.Tensor) -> str:
    """The mesh dims a tensor is split over ("dp_shard", "edp,ep,etp"), "replicated" for a
    plain tensor or a DTensor replicated on every dim; a dim of one rank splits nothing (HSDP's
    dp_shard=1 listed whole tensors as split over it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return "replicated"
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    return ",".join(names[d] for d, p in enumerate(t.placements) if not p.is_replicate() and mesh.size(d) > 1) or "replicated"


def _state_bytes_per_element(optimizer, group: dict, p: torch.Tensor, grad_dtype: torch.dtype, where: str) -> int:
    """Bytes of optimizer state per element of p, from the optimizer's type and settings
    (states are created lazily at the first step, so they are not read)."""
    if hasattr(optimizer, "state_dtype"):  # fmoe.optim.AdamW: exp_avg, exp_avg_sq, float32 master
        master = 4 if getattr(optimizer, "master_weights", False) and p.dtype != torch.float32 else 0
        return 2 * optimizer.state_dtype.itemsize + master
    if "ns_steps" in group:  # fmoe.optim.Muon, fmoe.parallel.DistributedMuon: momentum like the grad
        return grad_dtype.itemsize
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # exp_avg(, _sq, max) like p
        return (3 if group.get("amsgrad") else 2) * p.element_size()
    if isinstance(optimizer, torch.optim.SGD):
        return p.element_size() if group.get("momentum") else 0
    raise ValueError(f"{where}: {type(optimizer).__name__} is not an optimizer memory_plan knows "
                     "(fmoe AdamW, Muon, DistributedMuon; torch.optim Adam, AdamW, SGD)")


def memory_plan(modules, optimizers=(), *, grad_dtype: Optional[torch.dtype] = torch.float32) -> dict:
    """The bytes this rank holds for parameters, buffers, gradients and optimizer states, by
    theory (local shard sizes x dtype sizes), before the first step.

    Every size is the local one: a DTensor's to_local() (FSDP2's shard without its padding,
    an expert-parallel rank's experts), a plain tensor whole. Gradients: grad_dtype per
    element of every trainable parameter (float32: FSDP2 keeps sharded float32 gradients
    under mixed precision; None: the parameter's dtype). Optimizer states, from each
    optimizer's type and param_groups (its states are created at the first step):

        fmoe.optim.AdamW           2 x state_dtype (+ a float32 master of non-float32
                                   parameters with master_weights=True)
        Muon, DistributedMuon      1 momentum buffer of the gradient's dtype (grad_dtype)
        torch.optim.Adam / AdamW   2 x the parameter's dtype (3 with amsgrad)
        torch.optim.SGD            1 x the parameter's dtype with momentum, else 0

    Not counted: per-parameter step counters (scalars), activations, FSDP2's all-gather
    buffers and padding (its root unit, the embedding, head, final norm and MTP projections
    of fmoe.parallel.parallelize, stays gathered whole from the forward to the backward: a
    cost that no dp_shard divides, about 2 GiB in bf16 at V = 131072, H = 4096), Muon's
    Newton-Schulz work and gathered matrices (DistributedMuon keeps its pending updates' and
    gathers' buffers, twice the local bytes of the matrices it owns, from its step to the next
    forward), the allocator's caching. A tensor shared by several modules counts once.

    Args:
        modules: an nn.Module or an iterable of them (a pipeline rank's chunks).
        optimizers: a torch.optim.Optimizer or an iterable of them.
        grad_dtype: the gradients' dtype, or None for each parameter's own.
    Returns: {"params": bytes, "params_by_dtype": {"float32": bytes, ...}, "buffers": bytes,
        "grads": bytes, "optimizer": bytes, "total": bytes, "by_mesh": {key: {"params",
        "buffers", "grads", "optimizer", "total"}}}, ints; key = the mesh dims the tensor
        is split over ("dp_shard", "edp,ep,etp"; the dims of more than one rank), or "replicated".

    >>> linear = torch.nn.Linear(4, 2)                   # 10 float32 parameters
    >>> plan = memory_plan(linear, torch.optim.AdamW(linear.parameters()))
    >>> plan["params"], plan["grads"], plan["optimizer"], plan["total"]
    (40, 40, 80, 160)
    """
    if grad_dtype is not None and not isinstance(grad_dtype, torch.dtype):
        raise ValueError(f"grad_dtype: expected a torch.dtype or None, got {grad_dtype!r}")
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    try:
        modules, optimizers = list(modules), list(optimizers)
    except TypeError:
        raise ValueError("modules / optimizers: expected an nn.Module / torch.optim.Optimizer or an iterable of them") from None
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"modules[{i}]: expected an nn.Module, got {type(m).__name__}")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizers[{i}]: expected a torch.optim.Optimizer, got {type(opt).__name__}")

    kinds = ("params", "buffers", "grads", "optimizer")
    by_mesh: dict = {}
    by_dtype: dict = {}

    def add(kind: str, t: torch.Tensor, nbytes: int) -> None:
        entry = by_mesh.setdefault(_mesh_key(t), dict.fromkeys(kinds, 0))
        entry[kind] += nbytes

    seen = set()
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = _local_numel(p)
            add("params", p, n * p.element_size())
            name = str(p.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + n * p.element_size()
            if p.requires_grad:
                add("grads", p, n * (p.element_size() if grad_dtype is None else grad_dtype.itemsize))
        for b in m.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                add("buffers", b, _local_numel(b) * b.element_size())
    stepped = set()
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) in stepped:
                    continue
                stepped.add(id(p))
                per_element = _state_bytes_per_element(opt, group, p, p.dtype if grad_dtype is None else grad_dtype, f"optimizers[{i}]")
                add("optimizer", p, _local_numel(p) * per_element)
    for entry in by_mesh.values():
        entry["total"] = sum(entry[k] for k in kinds)
    totals = {k: sum(e[k] for e in by_mesh.values()) for k in kinds}
    return {"params": totals["params"], "params_by_dtype": by_dtype, "buffers": totals["buffers"], "grads": totals["grads"],
            "optimizer": totals["optimizer"], "total": sum(totals.values()), "by_mesh": dict(sorted(by_mesh.items()))}
