"""Context parallelism (CP): one packed micro-batch split over the cp ranks, attention across
the split by an all-gather of K and V. DESIGN.md "Parallelism".

    cp_token_index(n_tokens, cp, cp_rank) -> token_index [T/cp] int64   this rank's tokens
    cp_kv_index(n_tokens, cp) -> kv_index [T] int64                      the gathered K/V rows
    split_batch(batch, cp_rank, cp) -> TensorDict                        this rank's share
    gather_kv(k [T/cp, G, D], v [T/cp, G, Dv], cp_mesh) -> (k [T, G, D], v [T, G, Dv])
    ContextParallel(cp_mesh).attention_kwargs(token_index)   attention_context's CP arguments
                                         (parallelize sets it as Transformer.context_parallel)
    ContextCapacityDrop(cp_mesh, tp_mesh)(routes, E, capacity_factor, policy=)   the capacity
                                         drop over the whole micro-batch (MoE.capacity_drop)
    conv_halo(x [T/cp, C], n, cp_mesh) -> [2, n, C]        the n tokens before each chunk
    gated_delta_rule_cp(q, k, v, g, beta, cu_seqlens, cp_mesh) -> o [1, T/cp, N, Dv]
                                         the gated delta rule across the split (exact)
    gated_linear_attention_cp(q, k, v, g, cu_seqlens, cp_mesh) -> o [1, T/cp, N, Dv]
                                         the same without the rule (lightning attention)
    selective_scan_cp(u, dt, A, b, c, cu_seqlens, cp_mesh) -> y [1, T/cp, C]
                                         Mamba-1's scan across the split (exact)

One rank's attention, step by step (fmoe.layers.attention does 2-4 when its context has CP):

  1. split_batch: the rank keeps the tokens token_index of the micro-batch (every per-token
     field: ids, labels, loss mask, positions, the MTP rows), cu_seqlens stays GLOBAL, and
     the split records token_index (explicit, no hidden state).
  2. q, k, v of the local tokens; RoPE at their own positions (positions are per token, so
     the split positions are the right ones).
  3. gather_kv: K and V of every rank, in rank order (rank 0's T/cp rows, then rank 1's, ...);
     row j is global token kv_index[j].
  4. attention of the T/cp local queries over the T gathered keys, query i (global token
     token_index[i]) seeing key j iff same document and kv_index[j] <= token_index[i]
     (fmoe.layers.attention_context builds that [T/cp, T] mask, or the BlockMask).

Load balance. Under a causal mask the work of a query grows with its index, so contiguous
T/cp slices would leave the last rank with most of it. The T tokens are cut into 2 cp equal
chunks and rank r takes chunk r and chunk 2 cp - 1 - r (a head and a tail): every rank then
has the same causal work on one long document (the split of Megatron-LM and of Llama 3).
Example, T = 16, cp = 2: rank 0 holds [0..3, 12..15], rank 1 holds [4..11].

MTP targets. make_batch rolls the MTP inputs, labels and loss mask over the WHOLE packed
batch, inside each document, before the split, so the token at the end of a chunk keeps the
label that lies on another rank. (Megatron-LM rolled per CP chunk, which gave chunk-edge
tokens a wrong or filled target.) tests/parallel/test_context.py checks those tokens.

Why an all-gather of K and V (and not ring attention):
  - grouped-query attention makes K and V small: 2 G D values per token against N D for Q
    (Llama-3-70B: G = 8, N = 64, so K + V is a quarter of Q); gathering them costs less than
    moving queries or partial outputs around.
  - it is what Llama 3's long-context training did (all-gather K/V, then each rank's local
    queries against the whole sequence, with the same 2 cp chunk balance).
  - it is simple and exact with document masks: the mask sees global indices, so any mask
    (causal, same document, anything FlexAttention expresses) works unchanged, with no
    online-softmax merge of partial results and no per-step mask bookkeeping.
  - ring attention overlaps the exchange with compute and keeps K/V at T/cp per rank; that
    is for later, when the all-gather shows up in profiles.
  The gather is DTensor redistribution, Shard(0) -> Replicate, whose backward (the gradient
  declared Partial) is a reduce-scatter: each rank gets the sum over ranks of its own
  rows' K/V gradients. K and V travel together, one collective each way per layer.

Memory. Each rank holds the whole sequence's K and V, 2 T G D elements (bf16, G = 8, D = 128:
4 KiB per token, 512 MiB at T = 128K) for the layer it computes. The attention op saves its
K and V for the backward, so without activation checkpointing of attention every layer keeps
its gathered K/V until its backward (n_layers times that); with attention recomputed
(TransformerConfig.ac = "attention" or "full") only the layer being computed or recomputed
holds them: one layer at a time.

Compressed attention (DeepSeek-V4's HCA and CSA; fmoe.layers.compressed_entries): an entry
sums a run of m tokens that may lie on two ranks, so every rank gathers every rank's
compressor inputs (c and g, 2 D numbers per token; CSA's 4 D and its indexer's 4 Di) with the
same gather as K and V, puts them in token order (argsort of kv_index) and makes the whole
micro-batch's entries, T / m of them, which its queries attend to beside the gathered keys.
Exact; the gradients of the inputs return as K's and V's do.

Linear attention (Gated DeltaNet; fmoe.layers.linear_attention with the context's
linear_cp, which ContextParallel.attention_kwargs sets). Its state runs through every token
of a document, so each rank needs the state its chunks start from:
  - the causal convolution reads the K - 1 tokens before each chunk: conv_halo all-gathers
    every chunk's last K - 1 rows (of q, k and v together) and masks taps by document;
  - the rule is linear in the state a chunk starts from (S_end = B + A S_start, each output
    o0 + u S_start). gated_delta_rule_cp runs each chunk once with Dk extra zero value
    channels started from the identity, which yields B, A, o0 and u together; it
    all-gathers every chunk's [B | A], scans them in chunk order on every rank (restarting
    where a document starts at a chunk's first token) and corrects its outputs. Exact; the
    cost is the rule over Dv + Dk channels and one gather of 2 cp N Dk (Dk + Dv) floats.
  A chunk must hold the K - 1 tokens the next one's convolution reads (T / (2 cp) >= K - 1).

Sizes. T must be a multiple of 2 cp; other sizes are refused (ValueError naming
tokens_per_micro_batch and cp), never padded: padding would change the tokens every rank
computes and the loss's token count.

Legend: T tokens of the micro-batch (n_tokens), T/cp this rank's tokens, D_mtp MTP depth,
G kv heads, D (Dv) key (value) head dim.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from tensordict import TensorDict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fmoe.ops.checks import check_bools, check_cu_seqlens, check_index, check_positive_int, holds_values
from fmoe.ops.delta import check_rule_inputs, gated_delta_rule, gated_linear_attention
from fmoe.ops.routing import Routes
from fmoe.ops.scan import check_scan_inputs, selective_scan
from fmoe.parallel.tensor import drop_by_capacity_over_ranks, gather_rows

__all__ = ["ContextParallel", "ContextCapacityDrop", "conv_halo", "cp_kv_index", "cp_token_index", "gated_delta_rule_cp", "gather_kv", "split_batch"]


def _check_split(n_tokens, cp, cp_rank=None) -> None:
    check_positive_int("n_tokens", n_tokens, 0)
    check_positive_int("cp", cp)
    if cp_rank is not None:
        check_positive_int("cp_rank", cp_rank, 0, cp - 1)
    if n_tokens % (2 * cp):
        raise ValueError(
            f"tokens_per_micro_batch: context parallelism cuts the micro-batch into 2 * cp = {2 * cp} equal chunks, "
            f"so T = {n_tokens} tokens must be a multiple of {2 * cp} (choose tokens_per_micro_batch or cp to fit; "
            "bad sizes are refused, not padded)"
        )


def cp_token_index(n_tokens: int, cp: int, cp_rank: int, *, device=None) -> torch.Tensor:
    """The global indices of the tokens cp rank `cp_rank` holds: [T/cp] int64, increasing.

    The T tokens are cut into 2 cp chunks of T / (2 cp); rank r gets chunk r and chunk
    2 cp - 1 - r (module docstring: causal load balance). cp = 1: arange(T).

    Args:
        n_tokens: T, the micro-batch's tokens (tokens_per_micro_batch); a multiple of 2 cp.
            Other sizes are refused with a ValueError, not padded.
        cp, cp_rank: the context-parallel size and this rank's index on the cp axis.
        device: where the index lives (default: the CPU).

    Example:
        >>> cp_token_index(16, 2, 0).tolist()
        [0, 1, 2, 3, 12, 13, 14, 15]
        >>> cp_token_index(16, 2, 1).tolist()
        [4, 5, 6, 7, 8, 9, 10, 11]
    """
    _check_split(n_tokens, cp, cp_rank)
    if cp == 1:
        return torch.arange(n_tokens, device=device)
    chunk = n_tokens // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


def cp_kv_index(n_tokens: int, cp: int, *, device=None) -> torch.Tensor:
    """The global token index of each row gathered by gather_kv: [T] int64, the ranks'
    cp_token_index concatenated in rank order. No communication: a function of (T, cp).

    Example:
        >>> cp_kv_index(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    _check_split(n_tokens, cp)
    return torch.cat([cp_token_index(n_tokens, cp, r, device=device) for r in range(cp)])


def split_batch(batch, cp_rank: int, cp: int) -> TensorDict:
    """Cp rank `cp_rank`'s share of a packed micro-batch (fmoe.train.data.make_batch's).

    Every per-token entry (its last dim is T: input_ids, labels, loss_mask, positions [T];
    mtp_input_ids, mtp_labels, mtp_loss_mask, mtp_positions [D_mtp, T]) is indexed along its
    last dim by cp_token_index(T, cp, cp_rank); cu_seqlens stays global (unchanged: the
    attention mask and the sequence-level aux loss need the whole batch's documents); the
    result adds "token_index" [T/cp] int64, the global indices used (for
    fmoe.layers.attention_context's token_index= and
    fmoe.parallel.seq_load_balancing_loss_split's token_index=), and with a token_mask
    (padding False) "routed_tokens", its count over the whole batch (0-D int64: the
    balancing losses' mean runs over it). No value is read on the host; the batch's values
    were checked where it was made.

    The MTP rows were rolled over the whole batch by make_batch, so tokens at the chunk
    edges keep their targets from the other ranks' tokens (module docstring).

    Args:
        batch: a mapping with "input_ids" [T] (which fixes T), "cu_seqlens" [n + 1] and
            other entries whose last dim is T; not already split (no "token_index").
        cp_rank, cp: this rank's index on the cp axis and the cp size; T % (2 cp) == 0
            (else a ValueError naming tokens_per_micro_batch and cp). The cp mesh's:
            meshes.batch.get_local_rank("cp") and meshes.cp, not the world rank mod cp (with
            tp or dp beside cp that is another rank's share; the model's context refuses
            such a split: ContextParallel.attention_kwargs).
    Returns:
        A TensorDict (batch_size []) with the same keys plus "token_index" (and
        "routed_tokens" with a token_mask), on the batch's device.
    """
    if not callable(getattr(batch, "keys", None)):
        raise ValueError(f"batch: expected a mapping of make_batch's entries (a dict or TensorDict), got {type(batch).__name__}")
    keys = list(batch.keys())
    for key in ("input_ids", "cu_seqlens"):
        if key not in keys:
            raise ValueError(f"batch: expected make_batch's entries, missing {key!r}")
    if "token_index" in keys:
        raise ValueError("batch: already split over cp ranks (it has a 'token_index' entry)")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1:
        raise ValueError(f"batch['input_ids']: expected a 1-D tensor [T], got {getattr(ids, 'shape', type(ids).__name__)}")
    T = ids.shape[0]
    token_index = cp_token_index(T, cp, cp_rank, device=ids.device)
    out = {"cu_seqlens": batch["cu_seqlens"], "token_index": token_index}
    if "token_mask" in keys:
        out["routed_tokens"] = batch["token_mask"].sum()
    for key in keys:
        if key == "cu_seqlens":
            continue
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[-1] != T:
            raise ValueError(f"batch[{key!r}]: expected a per-token tensor whose last dim is T = {T}, got {getattr(value, 'shape', type(value).__name__)}")
        out[key] = value.index_select(-1, token_index.to(value.device))
    return TensorDict(out, batch_size=[])


def gather_kv(k: torch.Tensor, v: torch.Tensor, cp_mesh: Optional[DeviceMesh]):
    """Every cp rank's keys and values, differentiable: (k [T, G, D], v [T, G, Dv]) from this
    rank's k [T/cp, G, D], v [T/cp, G, Dv], in rank order (row j is token cp_kv_index[j]).

    One all-gather of k and v side by side (DTensor Shard(0) -> Replicate); backward, one
    reduce-scatter: each rank's gradient is the sum over the cp ranks of its own rows'
    gradients (each rank's queries used them). Every rank must hold the same T/cp rows.
    cp_mesh None or of one rank: (k, v) unchanged. fmoe.layers.attention_context takes it
    as gather_kv=functools.partial(gather_kv, cp_mesh=mesh).
    """
    if cp_mesh is not None and (not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1):
        got = f"a {cp_mesh.ndim}-D DeviceMesh" if isinstance(cp_mesh, DeviceMesh) else type(cp_mesh).__name__
        raise ValueError(f"cp_mesh: expected a 1-D DeviceMesh (the cp axis) or None, got {got}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim < 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a float tensor [T/cp, G, D], got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"v: expected k's leading dims {tuple(k.shape[:-1])}, dtype {k.dtype} and device {k.device}, "
                         f"got {tuple(v.shape)} {v.dtype} {v.device}")
    if cp_mesh is None or cp_mesh.size() == 1:
        return k, v
    kv = _gather(torch.cat([k, v], dim=-1), cp_mesh)  # one collective for both
    return kv.split([k.shape[-1], v.shape[-1]], dim=-1)


def _gather(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's x [n, ...] in rank order, [cp n, ...], differentiable (DTensor Shard(0)
    -> Replicate): each rank's gradient of the gathered rows is a partial sum, and the
    backward of Partial -> Shard(0) is the reduce-scatter (a Replicate gradient would only
    be sliced)."""
    x = DTensor.from_local(x, cp_mesh, [Shard(0)]).redistribute(cp_mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


# ----------------------------------------------------------------------------------------
# linear attention (Gated DeltaNet) across the split
# ----------------------------------------------------------------------------------------


def _chunk_rows(cp: int) -> list[int]:
    """The row of each global chunk c = 0 .. 2 cp - 1 in a rank-ordered gather of every
    rank's two chunks (rank r: chunk r, then chunk 2 cp - 1 - r)."""
    return [2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1 for c in range(2 * cp)]


def _check_cp_mesh(cp_mesh) -> None:
    if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
        got = f"a {cp_mesh.ndim}-D DeviceMesh" if isinstance(cp_mesh, DeviceMesh) else type(cp_mesh).__name__
        raise ValueError(f"cp_mesh: expected a 1-D DeviceMesh (the cp axis), got {got}")


def _halves(name: str, n_local: int) -> int:
    """L = T/cp / 2: this rank's tokens are its two chunks of L (split_batch's order)."""
    if n_local % 2:
        raise ValueError(f"{name}: expected this rank's T/cp tokens, its two chunks of T / (2 cp) (split_batch's), got an odd count {n_local}")
    return n_local // 2


def conv_halo(x: torch.Tensor, n: int, cp_mesh: DeviceMesh) -> torch.Tensor:
    """The n tokens before each of this rank's two chunks, [2, n, C] (zeros before token 0),
    differentiable: what a causal convolution of n + 1 taps over the tokens of a
    context-parallel split (Gated DeltaNet's) reads from the chunk before.

    Every rank's last n rows of each chunk are all-gathered ([2 cp, n, C], one collective);
    the backward reduce-scatters their gradients back to the ranks that hold them. Rows of
    another document than the token they precede are returned too: the convolution masks
    them by document (fmoe.layers.linear_attention).

    Args:
        x: [T/cp, C] this rank's tokens, its head chunk then its tail chunk (split_batch's).
        n: the rows wanted, at most a chunk's T / (2 cp) (else a ValueError naming
            tokens_per_micro_batch). cp_mesh: the cp axis (1-D).
    """
    _check_cp_mesh(cp_mesh)
    check_positive_int("n", n, 0)
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"x: expected a tensor [T/cp, C], got {getattr(x, 'shape', type(x).__name__)}")
    L = _halves("x", x.shape[0])
    if n > L:
        raise ValueError(f"tokens_per_micro_batch: each cp chunk (T / (2 cp) = {L} tokens) must hold the {n} tokens "
                         f"the next chunk's convolution reads; use fewer cp ranks or more tokens")
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    tails = torch.stack([x[L - n:L], x[2 * L - n:]])  # [2, n, C]
    if n == 0:  # a convolution of one tap reads nothing before its chunk
        return tails
    every = (tails if cp == 1 else _gather(tails, cp_mesh))[_chunk_rows(cp)]  # [2 cp, n, C], global chunk order
    head = every[rank - 1] if rank > 0 else torch.zeros_like(tails[0])
    return torch.stack([head, every[2 * cp - 2 - rank]])


def gated_delta_rule_cp(q, k, v, g, beta, cu_seqlens, cp_mesh: DeviceMesh, *, scale=None, chunk_size: int = 64, impl: str = "auto",
                        check: bool = True):
    """fmoe.ops.gated_delta_rule over a context-parallel split: this rank's outputs of the
    rule over the whole packed micro-batch, exact (to float32 rounding), no host sync with
    check=False.

    The state is linear in the state a chunk starts from: after a chunk of L tokens,
    S_end = B + A S_start, and each output o_t = o0_t + u_t S_start, where B and o0 are the
    chunk's with S_start = 0, A [Dk, Dk] is the state after the chunk started from the
    identity with zero values, and u_t its outputs then. One call of the rule per chunk
    computes all four: the values widened by Dk zero channels, started from [0 | I]
    (columns of the state evolve independently). A and B of every chunk (2 cp of them,
    [N, Dk, Dk + Dv] each) are all-gathered once; every rank runs the short scan
    S_start(c + 1) = B_c + A_c S_start(c) (0 where a document starts at the chunk's first
    token) and corrects its outputs. The backward runs through the gather (a reduce-scatter).
    A document that starts inside a chunk zeroes A there (the rule restarts at documents),
    so every document's outputs depend on its own tokens only.

    Cost: the rule over Dv + Dk value channels (twice the work when Dk = Dv), one
    all-gather of 2 cp N Dk (Dk + Dv) float32, 2 cp small matrix products.

    Args:
        q, k: [1, T/cp, N, Dk]; v: [1, T/cp, N, Dv]; g: [1, T/cp, N] or [1, T/cp, N, Dk] (a
            decay per key channel); beta: [1, T/cp, N]: this rank's tokens, its head chunk
            then its tail chunk (split_batch's order).
        cu_seqlens: [n + 1] the WHOLE micro-batch's document bounds (split_batch keeps them).
        cp_mesh: the cp axis (1-D). scale, chunk_size, impl: gated_delta_rule's.
        check: read cu_seqlens (bounds of the whole T = cp T/cp tokens) and this rank's
            largest g (<= 0), as gated_delta_rule's check (a device->host sync); fmoe's
            layers pass False (make_batch checked the batch).
    Returns:
        o [1, T/cp, N, Dv] in v's dtype: rows token_index of the rule over the whole batch.
    """
    if not isinstance(beta, torch.Tensor):
        raise ValueError(f"beta: expected this rank's [1, T/cp, N] (gated_linear_attention_cp is the rule without it), got {type(beta).__name__}")
    return _rule_cp(q, k, v, g, beta, cu_seqlens, cp_mesh, check, scale=scale, chunk_size=chunk_size, impl=impl)


def _rule_cp(q, k, v, g, beta, cu_seqlens, cp_mesh: DeviceMesh, check: bool, **kwargs) -> torch.Tensor:
    """gated_delta_rule_cp, or gated_linear_attention_cp with beta None."""
    check_bools(check=check)
    _check_cp_mesh(cp_mesh)
    check_index("cu_seqlens", cu_seqlens, 1, "[n_docs + 1]")
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected this rank's [1, T/cp, N, Dk], got {getattr(q, 'shape', type(q).__name__)}")
    check_rule_inputs(q, k, v, g, beta, None, kwargs.get("scale"), None, check=check)  # this rank's, as gated_delta_rule names them
    L = _halves("q", q.shape[1])
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    check_cu_seqlens(cu_seqlens, 2 * L * cp, check=check, like=("q", q))  # the whole micro-batch's
    outs, ends = _rule_chunks(q, k, v, g, beta, cu_seqlens, cp, rank, **kwargs)
    every = (ends if cp == 1 else _gather(ends, cp_mesh))[_chunk_rows(cp)]  # [2 cp, ...] global chunk order
    return _rule_outputs(outs, every, cu_seqlens, L, cp, rank).to(v.dtype)


def gated_linear_attention_cp(q, k, v, g, cu_seqlens, cp_mesh: DeviceMesh, *, scale=None, chunk_size: int = 64, impl: str = "auto",
                              check: bool = True):
    """fmoe.ops.gated_linear_attention over a context-parallel split (MiniMax's lightning
    attention): gated_delta_rule_cp without the rule, the same exchange (the state after a
    chunk is as linear in the state it starts from; A is the chunk's decay). Arguments and
    result as gated_delta_rule_cp's, without beta."""
    return _rule_cp(q, k, v, g, None, cu_seqlens, cp_mesh, check, scale=scale, chunk_size=chunk_size, impl=impl)


def selective_scan_cp(u, dt, A, b, c, cu_seqlens, cp_mesh: DeviceMesh, *, chunk_size: int = 64, impl: str = "auto",
                      check: bool = True) -> torch.Tensor:
    """fmoe.ops.selective_scan (Mamba-1's scan) over a context-parallel split: this rank's
    outputs of the scan over the whole packed micro-batch, exact (to float32 rounding), no
    host sync with check=False.

    The state is diagonal-linear in the state a chunk starts from: after a chunk, h_end =
    B + A * h_start elementwise, B the chunk's end state from h_start = 0 and A the product
    of its decays, exp(A sum dt) per channel and state channel (0 where a document starts
    inside the chunk). Each rank scans its two chunks from 0 (their B), all-gathers every
    chunk's (B, A) once ([2 cp, 2, C, N]), runs the short scan of the states the chunks start
    from (0 where a document starts at a chunk's first token), then scans its chunks again
    from those states: their outputs. The backward runs back through both scans and the
    gather (a reduce-scatter). With the scan's kernels the memory stays O(T/cp C) (no
    chunk pairs).

    Args:
        u, dt: [1, T/cp, C]; A: [C, N]; b, c: [1, T/cp, N]: this rank's tokens, its head
            chunk then its tail chunk (split_batch's order).
        cu_seqlens: [n + 1] the WHOLE micro-batch's document bounds (split_batch keeps them).
        cp_mesh: the cp axis (1-D). chunk_size, impl: selective_scan's.
        check: read cu_seqlens (bounds of the whole T = cp T/cp tokens), A <= 0 and this
            rank's dt >= 0, as selective_scan's check (a device->host sync); fmoe's layers
            pass False (make_batch checked the batch).
    Returns:
        y [1, T/cp, C] float32: rows token_index of the scan over the whole batch.
    """
    check_bools(check=check)
    _check_cp_mesh(cp_mesh)
    check_index("cu_seqlens", cu_seqlens, 1, "[n_docs + 1]")
    if not isinstance(u, torch.Tensor) or u.ndim != 3 or u.shape[0] != 1:
        raise ValueError(f"u: expected this rank's [1, T/cp, C], got {getattr(u, 'shape', type(u).__name__)}")
    check_scan_inputs(u, dt, A, b, c, None, None, check=check)  # this rank's, as selective_scan names them
    L = _halves("u", u.shape[1])
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    check_cu_seqlens(cu_seqlens, 2 * L * cp, check=check, like=("u", u))  # the whole micro-batch's
    cu = cu_seqlens.long()
    chunks = (rank, 2 * cp - 1 - rank)
    rows = [slice(slot * L, (slot + 1) * L) for slot in range(2)]
    local = [(cu - chunk * L).clamp(0, L) for chunk in chunks]  # each chunk's document bounds
    ends = []
    for chunk, r, bounds in zip(chunks, rows, local):
        _, end = selective_scan(u[:, r], dt[:, r], A, b[:, r], c[:, r], bounds, final_state=True, chunk_size=chunk_size, impl=impl,
                                check=False)
        inside = ((cu > chunk * L) & (cu < (chunk + 1) * L)).any()  # a document starts inside: the end forgets the start
        decay = torch.where(inside, 0.0, (dt[0, r].float().sum(0)[:, None] * A.float()).exp())  # [C, N]
        ends.append(torch.stack([end[0], decay]))
    every = (torch.stack(ends) if cp == 1 else _gather(torch.stack(ends), cp_mesh))[_chunk_rows(cp)]  # [2 cp, 2, C, N] chunk order
    starts = _start_states(cu, L, cp, rank, torch.zeros_like(every[0, 0]), lambda chunk, state: every[chunk, 0] + every[chunk, 1] * state)
    y = [selective_scan(u[:, r], dt[:, r], A, b[:, r], c[:, r], bounds, initial_state=starts[chunk][None], chunk_size=chunk_size, impl=impl,
                        check=False)
         for chunk, r, bounds in zip(chunks, rows, local)]
    return torch.cat(y, 1)


def _rule_chunks(q, k, v, g, beta, cu_seqlens, cp: int, rank: int, **kwargs):
    """The rule over each of rank `rank`'s two chunks, widened (gated_delta_rule_cp):
    (outputs [1, L, N, Dv + Dk] float32 of each chunk, ends [2, N, Dk, Dv + Dk]: B | A)."""
    _, T_local, N, Dk = q.shape
    Dv, L = v.shape[-1], T_local // 2
    cu = cu_seqlens.long()
    identity = torch.eye(Dk, device=q.device).expand(1, N, Dk, Dk)
    start_from = torch.cat([identity.new_zeros(1, N, Dk, Dv), identity], -1)  # [0 | I]
    outs, ends = [], []
    for slot, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(slot * L, (slot + 1) * L)
        v_wide = torch.cat([v[:, rows].float(), v.new_zeros(1, L, N, Dk, dtype=torch.float32)], -1)
        rule = () if beta is None else (beta[:, rows],)  # beta None: no delta rule (gated_linear_attention)
        o, end = (gated_delta_rule if rule else gated_linear_attention)(q[:, rows], k[:, rows], v_wide, g[:, rows], *rule, (cu - chunk * L).clamp(0, L),
                                                                      initial_state=start_from, final_state=True, check=False, **kwargs)
        outs.append(o)
        ends.append(end[0])
    return outs, torch.stack(ends)


def _start_states(cu: torch.Tensor, L: int, cp: int, rank: int, zero: torch.Tensor, step) -> dict[int, torch.Tensor]:
    """{global chunk c: the state it starts from} for the chunks up to rank `rank`'s tail
    chunk (2 cp chunks of L tokens): a scan over them in order from `zero`, restarted (0)
    where a document starts at a chunk's first token; step(c, state) is the state after chunk
    c from `state` (its end state plus its decay of the start: gated_delta_rule_cp's,
    selective_scan_cp's)."""
    starts_document = (cu[None, :] == torch.arange(2 * cp, device=cu.device)[:, None] * L).any(1)  # [2 cp]
    state, starts = zero, {}
    for c in range(2 * cp - rank):
        state = torch.where(starts_document[c], 0.0, state)
        starts[c] = state
        state = step(c, state)
    return starts


def _rule_outputs(outs, every, cu_seqlens, L: int, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s outputs [1, T/cp, N, Dv] float32 from its chunks' widened outputs and
    every chunk's ends [2 cp, N, Dk, Dv + Dk] in chunk order: the scan of the states the
    chunks start from, then o0 + u S_start (gated_delta_rule_cp)."""
    _, N, Dk, width = every.shape
    Dv = width - Dk
    starts = _start_states(cu_seqlens.long(), L, cp, rank, every.new_zeros(N, Dk, Dv), lambda c, state: every[c, ..., :Dv] + every[c, ..., Dv:] @ state)
    o = [out[0, ..., :Dv] + torch.einsum("tnk,nkv->tnv", out[0, ..., Dv:], starts[c]) for out, c in zip(outs, (rank, 2 * cp - 1 - rank))]
    return torch.cat(o)[None]


class ContextParallel:
    """What a model needs to build its attention context over a CP split: set by
    fmoe.parallel.parallelize as Transformer.context_parallel when cp > 1.

        ContextParallel(cp_mesh).attention_kwargs(batch["token_index"])
            -> dict(token_index=, kv_index=, gather_kv=) for fmoe.layers.attention_context

    token_index [T/cp] is the split batch's (split_batch); T = cp * T/cp; kv_index the
    gathered rows' global indices (cp_kv_index, no communication); gather_kv all-gathers K
    and V over cp_mesh; linear_cp is this object, whose token_index, conv_halo and
    gated_delta_rule run the linear-attention layers across the split
    (fmoe.layers.linear_attention), and whose sum_counts gives a mixture of attention heads'
    balance loss every rank's counts (fmoe.layers.attention).
    """

    def __init__(self, cp_mesh: DeviceMesh):
        if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh: expected a 1-D DeviceMesh, got {cp_mesh!r}")
        self.mesh, self.cp = cp_mesh, cp_mesh.size()

    def __repr__(self) -> str:
        return f"ContextParallel(cp={self.cp})"

    def attention_kwargs(self, token_index: torch.Tensor) -> dict:
        """The attention_context arguments of a batch split by split_batch, whose token_index
        must be this rank's (its cp coordinate and size: the mesh's): a batch split for
        another rank or cp size (the world rank mod cp at cp x tp, say) trained on wrong
        losses and gradients, silently. Checked on the device, no host sync: on the CPU a
        RuntimeError at once, on a GPU a device-side assert at the next sync."""
        n_tokens = token_index.shape[0] * self.cp
        if holds_values(token_index):
            own = cp_token_index(n_tokens, self.cp, self.mesh.get_local_rank(), device=token_index.device)
            torch._assert_async((token_index == own).all(), f"batch['token_index']: the batch was split for another cp rank or size than "
                                 f"this rank's (cp rank {self.mesh.get_local_rank()} of {self.cp}): split it with fmoe.parallel.split_batch("
                                 "batch, meshes.batch.get_local_rank('cp'), meshes.cp)")
        kv_index = cp_kv_index(n_tokens, self.cp, device=token_index.device)
        return dict(token_index=token_index, kv_index=kv_index, gather_kv=functools.partial(gather_kv, cp_mesh=self.mesh), linear_cp=self)

    def token_index(self, n_local: int, device=None) -> torch.Tensor:
        """This rank's global token indices [T/cp] (cp_token_index of T = cp n_local)."""
        return cp_token_index(n_local * self.cp, self.cp, self.mesh.get_local_rank(), device=device)

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts (any shape, int or float) summed over the cp ranks (an all-reduce over this
        object's mesh): every rank's tokens' counts. Counts carry no gradient."""
        return DTensor.from_local(counts, self.mesh, [Partial()], run_check=False).full_tensor()

    def conv_halo(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """conv_halo over this object's cp mesh: [2, n, C]."""
        return conv_halo(x, n, self.mesh)

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, **kwargs) -> torch.Tensor:
        """gated_delta_rule_cp over this object's cp mesh: o [1, T/cp, N, Dv]."""
        return gated_delta_rule_cp(q, k, v, g, beta, cu_seqlens, self.mesh, **kwargs)

    def gated_linear_attention(self, q, k, v, g, cu_seqlens, **kwargs) -> torch.Tensor:
        """gated_linear_attention_cp over this object's cp mesh: o [1, T/cp, N, Dv]."""
        return gated_linear_attention_cp(q, k, v, g, cu_seqlens, self.mesh, **kwargs)

    def selective_scan(self, u, dt, A, b, c, cu_seqlens, **kwargs) -> torch.Tensor:
        """selective_scan_cp over this object's cp mesh: y [1, T/cp, C]."""
        return selective_scan_cp(u, dt, A, b, c, cu_seqlens, self.mesh, **kwargs)


class ContextCapacityDrop:
    """The capacity drop of a MoE block under context parallelism, over the whole micro-batch:
    set by fmoe.parallel.parallelize as each MoE's `capacity_drop` when cp > 1 and the
    model has a capacity factor, so that N processes drop the slots one process drops.

    Called as fmoe.layers.moe's `drop`: drop(routes, n_experts, capacity_factor, policy=)
    with this rank's Routes (weights float32 [T_local, k], experts [T_local, k]). The routes
    of every token are gathered (without autograd; float64 holds the float32 weights and
    the ids exactly): over tp_mesh first when tensor parallelism splits this cp rank's T/cp
    tokens into contiguous T/(cp tp) slices, then over cp_mesh, whose rank order is
    cp_kv_index's; they are put back in token order, fmoe.ops.drop_by_capacity runs on the
    T tokens (capacity ceil(T k / E * capacity_factor), either policy, the same ties as one
    process), and this rank's rows of the keep mask apply to its routes (gradients reach the
    kept weights). Returns Routes of the local shapes.
    """

    def __init__(self, cp_mesh: DeviceMesh, tp_mesh: Optional[DeviceMesh] = None):
        for name, mesh in (("cp_mesh", cp_mesh), ("tp_mesh", tp_mesh)):
            if (mesh is not None or name == "cp_mesh") and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
                raise ValueError(f"{name}: expected a 1-D DeviceMesh, got {mesh!r}")
        self.cp_mesh = cp_mesh
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None

    def __repr__(self) -> str:
        return f"ContextCapacityDrop(cp={self.cp_mesh.size()}, tp={1 if self.tp_mesh is None else self.tp_mesh.size()})"

    def _every(self, packed: torch.Tensor) -> torch.Tensor:
        """[T_local, ...] of each rank -> [T, ...] in token order: over tp (this cp rank's
        T/cp tokens, in order), then over cp, whose rank order is cp_kv_index's."""
        if self.tp_mesh is not None:
            packed = gather_rows(packed, self.tp_mesh)
        gathered = gather_rows(packed, self.cp_mesh)
        return torch.empty_like(gathered).index_copy_(0, cp_kv_index(gathered.shape[0], self.cp_mesh.size(), device=gathered.device), gathered)

    def __call__(self, routes: Routes, n_experts: int, capacity_factor: float, *, policy: str = "probs") -> Routes:
        T_local = routes.weights.shape[0]
        cp, tp_rank = self.cp_mesh.size(), 0 if self.tp_mesh is None else self.tp_mesh.get_local_rank()
        T = T_local * cp * (1 if self.tp_mesh is None else self.tp_mesh.size())
        rows = cp_token_index(T, cp, self.cp_mesh.get_local_rank(), device=routes.weights.device)[tp_rank * T_local:(tp_rank + 1) * T_local]
        return drop_by_capacity_over_ranks(routes, n_experts, capacity_factor, policy=policy, gather=self._every, rows=rows)
