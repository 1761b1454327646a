"""fmoe.parallel.context: the load-balanced split of a packed micro-batch, the K/V all-gather,
and fmoe.layers.attention across the split (cp = 2 and 4 gloo processes against one process
on the whole batch, float32).

One spawn of 4 processes runs every distributed case (a module-scoped fixture): cp = 4 over
the 4 ranks, and cp = 2 over ranks (0, 1) and (2, 3) at once, each pair on its own batch.
The split's pure checks run in this process.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from fmoe.layers import AttentionConfig, LinearAttentionConfig, attention, attention_context, linear_attention, linear_attention_shapes
from fmoe.ops import gated_delta_rule, gated_linear_attention
from fmoe.ops.scan import selective_scan_loop
from fmoe.parallel import (ContextParallel, cp_kv_index, cp_token_index, gated_delta_rule_cp, gated_linear_attention_cp, gather_kv, selective_scan_cp,
                           split_batch)
from fmoe.train.data import make_batch
from tests.parallel.dist import run_distributed

H = 16
CFG = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8)  # grouped-query: 2 queries per kv head

# name: (cp, cu_seqlens of the whole batch). Chunks are T / (2 cp) tokens.
CASES = {
    # chunks of 4: [0,3) and [3,4) shorter than a chunk, an empty document, [3,18) crosses
    # chunks 0-4 and so lies on every rank, [21,26) crosses the 24 boundary (ranks 2 and 1)
    "cp=4, mixed documents": (4, [0, 1, 3, 3, 18, 21, 26, 32]),
    # chunks of 4: [2,7) crosses rank 0 -> 1, [7,13) crosses rank 1 -> 0 (at 12)
    "cp=2, documents across the chunk edges": (2, [0, 2, 7, 13, 16]),
    # chunks of 6: one causal document over both ranks
    "cp=2, one document": (2, [0, 24]),
}
# the cp = 2 groups (ranks 0, 1) and (2, 3) each run one cp = 2 case
CP2_CASES = ("cp=2, documents across the chunk edges", "cp=2, one document")

# Gated DeltaNet across the split: 2 key heads of 4, 4 value heads of 3, 4 taps (chunks of
# 4 tokens hold the 3 the next chunk's convolution reads), the rule in chunks of 3 (chunks
# of the rule do not line up with the cp chunks)
LINEAR = LinearAttentionConfig(n_k_heads=2, n_v_heads=4, k_head_dim=4, v_head_dim=3, conv=4, chunk_size=3)
LINEAR_CASES = {
    # the state runs through all 8 chunks of 4 ranks (the scan of every rank's A and B)
    "cp=4, one document": (4, [0, 32]),
    # documents inside a chunk, an empty one, one over chunks 0-4, one across 24
    "cp=4, mixed documents": (4, [0, 1, 3, 3, 18, 21, 26, 32]),
    # documents starting at chunk 2's and chunk 6's first token (the scan restarts there)
    "cp=4, documents from a chunk's first token": (4, [0, 8, 13, 24, 32]),
    # chunks of 4: [2,7) crosses rank 0 -> 1, [7,13) crosses rank 1 -> 0 (at 12)
    "cp=2, documents across the chunk edges": (2, [0, 2, 7, 13, 16]),
    # chunks of 6: a document from chunk 1's first token, over chunks 1-3
    "cp=2, a document from a chunk's first token": (2, [0, 6, 24]),
}
LINEAR_CP2 = ("cp=2, documents across the chunk edges", "cp=2, a document from a chunk's first token")


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


# ---------------------------------------------------------------------------- worker side


def _inputs(cu, seed):
    """The whole batch's inputs, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    T = cu[-1]
    N, G, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    shapes = {"wq": (H, N * D), "wk": (H, G * D), "wv": (H, G * D), "wo": (N * D, H)}
    params = {n: torch.randn(*s, generator=gen) * s[0] ** -0.5 for n, s in shapes.items()}
    x = torch.randn(T, H, generator=gen)
    upstream = torch.randn(T, H, generator=gen)  # a random upstream gradient, never .sum()
    batch = make_batch(torch.randint(0, 50, (T,), generator=gen), torch.tensor(cu), mtp_depth=1)
    return params, x, upstream, batch


def _layer_over_split(layer, cfg, params, x, upstream, batch, mesh, cp, cp_rank, cp_args):
    """layer(x, params, cfg, ctx) on one process over the whole batch, then on this rank's
    share with the context attention_context(..., **cp_args(token_index)) builds: outputs,
    gradients (the parameters' summed over the cp ranks, as they are replicated) and the
    host reads of the split's context, forward and backward."""
    from fmoe.train.metrics import HostReads

    ref_x = x.clone().requires_grad_()
    ref_p = {n: t.clone().requires_grad_() for n, t in params.items()}
    ref_y, _ = layer(ref_x, ref_p, cfg, attention_context(batch["cu_seqlens"], batch["positions"], CFG))
    ref_y.backward(upstream)

    local = split_batch(batch, cp_rank, cp)
    index = local["token_index"]
    x_local = x[index].clone().requires_grad_()
    p_local = {n: t.clone().requires_grad_() for n, t in params.items()}
    with HostReads() as reads:
        ctx = attention_context(local["cu_seqlens"], local["positions"], CFG, **cp_args(index))
        y, _ = layer(x_local, p_local, cfg, ctx)
        y.backward(upstream[index])
    grads = {n: p.grad.clone() for n, p in p_local.items()}
    for g in grads.values():
        dist.all_reduce(g, group=mesh.get_group())
    return local, ctx, dict(
        index=index, y=y.detach(), ref_y=ref_y.detach()[index], x_grad=x_local.grad, ref_x_grad=ref_x.grad[index],
        grads=grads, ref_grads={n: p.grad for n, p in ref_p.items()}, host_reads=reads.count,
    )


def _attention_case(mesh, cp, cp_rank, cu, seed):
    params, x, upstream, batch = _inputs(cu, seed)
    T = x.shape[0]

    def cp_args(index):
        return dict(token_index=index, kv_index=cp_kv_index(T, cp), gather_kv=functools.partial(gather_kv, cp_mesh=mesh))

    local, ctx, out = _layer_over_split(attention, CFG, params, x, upstream, batch, mesh, cp, cp_rank, cp_args)
    index = out["index"]
    flex_cfg = dataclasses.replace(CFG, impl="flex")
    with torch.no_grad():  # FlexAttention has no CPU backward: its mask, forward only
        flex_ctx = attention_context(local["cu_seqlens"], local["positions"], flex_cfg, **cp_args(index))
        y_flex, _ = attention(x[index], params, flex_cfg, flex_ctx)
    return dict(out, y_flex=y_flex, mask_shape=tuple(ctx.mask.shape), flex_mask_shape=tuple(flex_ctx.mask.shape[-2:]))


def _gather_case(mesh, cp, cp_rank, T, seed):
    """gather_kv alone: rank order, and a backward that sums every rank's gradient."""
    gen = torch.Generator().manual_seed(seed)
    k_full, v_full = torch.randn(T, 2, 3, generator=gen), torch.randn(T, 2, 5, generator=gen)
    index = cp_token_index(T, cp, cp_rank)
    k, v = k_full[index].clone().requires_grad_(), v_full[index].clone().requires_grad_()
    k_all, v_all = gather_kv(k, v, mesh)
    # rank r's upstream gradients differ (as its queries' do): seeded by r
    upstream = [(torch.randn(T, 2, 3, generator=torch.Generator().manual_seed(100 + r)),
                 torch.randn(T, 2, 5, generator=torch.Generator().manual_seed(200 + r))) for r in range(cp)]
    torch.autograd.backward([k_all, v_all], list(upstream[cp_rank]))
    rows = slice(cp_rank * T // cp, (cp_rank + 1) * T // cp)  # this rank's rows of the gathered tensors
    kv_index = cp_kv_index(T, cp)
    return dict(
        k_all=k_all.detach(), v_all=v_all.detach(), ref_k=k_full[kv_index], ref_v=v_full[kv_index],
        k_grad=k.grad, ref_k_grad=sum(g[rows] for g, _ in upstream), v_grad=v.grad, ref_v_grad=sum(g[rows] for _, g in upstream),
    )


def _linear_case(mesh, cp, cp_rank, cu, seed):
    """Gated DeltaNet across the split against one process: the layer (convolution halos,
    the rule's exchange) and the rule alone, outputs and every gradient; no host read."""
    gen = torch.Generator().manual_seed(seed)
    T = cu[-1]
    params = {n: torch.randn(*s, generator=gen) * (0.5 if len(s) == 1 else s[0] ** -0.5) for n, s in linear_attention_shapes(H, LINEAR).items()}
    x, upstream = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    batch = make_batch(torch.randint(0, 50, (T,), generator=gen), torch.tensor(cu), mtp_depth=0)
    local, _, out = _layer_over_split(linear_attention, LINEAR, params, x, upstream, batch, mesh, cp, cp_rank,
                                      ContextParallel(mesh).attention_kwargs)
    index = out["index"]

    # the rule alone: q, k, v, g, beta of the whole batch, each rank's rows
    N, Dk, Dv = 3, 4, 5
    rule = [torch.nn.functional.normalize(torch.randn(1, T, N, Dk, generator=gen), dim=-1) for _ in range(2)]
    rule += [torch.randn(1, T, N, Dv, generator=gen), -torch.rand(1, T, N, generator=gen), torch.rand(1, T, N, generator=gen)]
    ref_in = [t.clone().requires_grad_() for t in rule]
    ref_o = gated_delta_rule(*ref_in, batch["cu_seqlens"], chunk_size=2)
    o_up = torch.randn(1, T, N, Dv, generator=gen)
    ref_o.backward(o_up)
    rule_in = [t[:, index].clone().requires_grad_() for t in rule]
    o = gated_delta_rule_cp(*rule_in, batch["cu_seqlens"], mesh, chunk_size=2)
    o.backward(o_up[:, index])

    # Mamba-1's scan alone (its kernels, through the interpreter): u, dt, A, b, c of the whole batch, each rank's rows; A
    # is every rank's, its gradient summed over the ranks
    C, Ns = 5, 3
    scan = [torch.randn(1, T, C, generator=gen), 0.05 + 0.5 * torch.rand(1, T, C, generator=gen), -0.5 - 3 * torch.rand(C, Ns, generator=gen),
            torch.randn(1, T, Ns, generator=gen), torch.randn(1, T, Ns, generator=gen)]
    ref_scan = [t.clone().requires_grad_() for t in scan]
    ref_y = selective_scan_loop(*ref_scan, batch["cu_seqlens"])
    y_up = torch.randn(1, T, C, generator=gen)
    ref_y.backward(y_up)
    scan_in = [(t if t.ndim == 2 else t[:, index]).clone().requires_grad_() for t in scan]
    y_scan = selective_scan_cp(*scan_in, batch["cu_seqlens"], mesh, impl="triton")
    y_scan.backward(y_up[:, index])
    dist.all_reduce(scan_in[2].grad, group=mesh.get_group())

    # a plain CP context (softmax attention's three arguments only) is refused, not run per rank
    plain = attention_context(local["cu_seqlens"], local["positions"], CFG, token_index=index, kv_index=cp_kv_index(T, cp),
                              gather_kv=functools.partial(gather_kv, cp_mesh=mesh))
    try:
        linear_attention(x[index], params, LINEAR, plain)
        refused = None
    except ValueError as err:
        refused = str(err)
    return dict(
        out, o=o.detach(), ref_o=ref_o.detach()[:, index], rule_grads=[t.grad for t in rule_in], ref_rule_grads=[t.grad[:, index] for t in ref_in],
        refused=refused, scan_y=y_scan.detach(), ref_scan_y=ref_y.detach()[:, index], scan_grads=[t.grad for t in scan_in],
        ref_scan_grads=[t.grad if t.ndim == 2 else t.grad[:, index] for t in ref_scan],
    )


def _cp_worker(rank, world):
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    cp4 = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("cp",))
    cp2 = DeviceMesh("cpu", torch.arange(world).view(2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    out = {}
    for seed, (name, (cp, cu)) in enumerate(CASES.items()):
        if cp == 4:
            out[name] = _attention_case(cp4, 4, rank, cu, seed)
        elif name == CP2_CASES[rank // 2]:
            out[name] = _attention_case(cp2, 2, rank % 2, cu, seed)
    for seed, (name, (cp, cu)) in enumerate(LINEAR_CASES.items(), start=20):
        if cp == 4:
            out["linear " + name] = _linear_case(cp4, 4, rank, cu, seed)
        elif name == LINEAR_CP2[rank // 2]:
            out["linear " + name] = _linear_case(cp2, 2, rank % 2, cu, seed)
    try:  # chunks of 2 tokens cannot hold the 3 a convolution of 4 taps reads
        from fmoe.parallel import conv_halo

        conv_halo(torch.zeros(4, 3), 3, cp4)
    except ValueError as err:
        out["small chunks"] = str(err)
    # a batch split for another cp rank or size than the mesh's: refused on the device (it trained on wrong losses, silently)
    from fmoe.parallel import ContextParallel, cp_token_index

    split = ContextParallel(cp2)
    refused = []
    for wrong in (cp_token_index(16, 2, 1 - rank % 2), cp_token_index(16, 4, rank % 2)):  # the other rank; split for cp = 4
        try:
            split.attention_kwargs(wrong)
        except RuntimeError as err:
            refused.append(str(err))
    own = split.attention_kwargs(cp_token_index(16, 2, rank % 2))
    out["wrong split"] = (refused, torch.equal(own["token_index"], cp_token_index(16, 2, rank % 2)))
    out["gather cp=4"] = _gather_case(cp4, 4, rank, 16, 7)
    out["gather cp=2"] = _gather_case(cp2, 2, rank % 2, 12, 8 + rank // 2)
    counts = torch.tensor([1, 2, 3]) * (rank + 1)
    out["sum counts"] = (ContextParallel(cp4).sum_counts(counts), ContextParallel(cp4).sum_counts(counts.double() / 4))
    out["capacity drop"], out["capacity drop repr"] = _capacity_drop_case(rank)
    return out


def _capacity_drop_case(rank):
    """ContextCapacityDrop over cp 2 x tp 2 (rank = cp_rank * 2 + tp_rank: tp splits the cp
    rank's T/cp tokens into contiguous halves) against drop_by_capacity over the whole batch:
    (this rank's kept slots, the one-process ones) per policy."""
    from torch.distributed.device_mesh import DeviceMesh

    from fmoe.ops import Routes, drop_by_capacity
    from fmoe.parallel import ContextCapacityDrop

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("cp", "tp"))
    drop = ContextCapacityDrop(mesh["cp"], mesh["tp"])
    gen = torch.Generator().manual_seed(3)
    T, E, k = 16, 4, 2
    weights, experts = torch.rand(T, k, generator=gen), torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    experts[:10, 0] = 1  # expert 1 over capacity (ceil(16 * 2 / 4) = 8)
    rows = cp_token_index(T, 2, rank // 2)[(rank % 2) * 4:(rank % 2 + 1) * 4]
    out = {}
    for policy in ("probs", "position"):
        got = drop(Routes(weights[rows], experts[rows]), E, 1.0, policy=policy)
        whole = drop_by_capacity(Routes(weights, experts), E, 1.0, policy=policy)
        out[policy] = (got.experts, whole.experts[rows], int((whole.experts == -1).sum()))
    return out, (repr(drop), repr(ContextCapacityDrop(mesh["cp"])))


def test_sum_counts_adds_every_cp_rank_s_counts(cp_results):
    for result in cp_results:
        counts, floats = result["sum counts"]
        assert counts.tolist() == [10, 20, 30] and counts.dtype == torch.int64
        assert floats.tolist() == [2.5, 5.0, 7.5] and floats.dtype == torch.float64


def test_capacity_drop_over_cp_and_tp_drops_the_slots_one_process_drops(cp_results):
    """N processes drop the slots one process drops, on each tp rank's slice of its cp
    rank's tokens (a tp rank reading the first slice's keep mask dropped another token's)."""
    for rank, result in enumerate(cp_results):
        for policy, (got, want, dropped) in result["capacity drop"].items():
            assert dropped > 0 and torch.equal(got, want), (rank, policy, got, want)
        assert result["capacity drop repr"] == ("ContextCapacityDrop(cp=2, tp=2)", "ContextCapacityDrop(cp=2, tp=1)")


@pytest.fixture(scope="module")
def cp_results():
    return run_distributed(_cp_worker, 4)


# ---------------------------------------------------------------------------- distributed


def _case_results(cp_results, name):
    cp, _ = CASES[name]
    if cp == 4:
        return cp_results
    group = CP2_CASES.index(name)
    return cp_results[2 * group:2 * group + 2]


@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_cp_ranks_equals_one_process(cp_results, name):
    cp, cu = CASES[name]
    results = [r[name] for r in _case_results(cp_results, name)]
    T = cu[-1]
    # the ranks' tokens partition the batch
    assert torch.equal(torch.cat([r["index"] for r in results]).sort().values, torch.arange(T))
    for rank, r in enumerate(results):
        assert r["mask_shape"] == (T // cp, T) and r["flex_mask_shape"] == (T // cp, T)
        assert _rel(r["y"], r["ref_y"]) < 1e-5, (rank, _rel(r["y"], r["ref_y"]))
        assert _rel(r["x_grad"], r["ref_x_grad"]) < 1e-5, rank
        for n in r["grads"]:  # summed over the cp ranks in the worker
            assert _rel(r["grads"][n], r["ref_grads"][n]) < 1e-5, (rank, n)
        assert r["host_reads"] == 0, rank  # context, forward and backward: no host sync
        # FlexAttention's CP block mask, eager on CPU, gives the SDPA reference's rows
        assert _rel(r["y_flex"], r["ref_y"]) < 1e-5, rank
    # a rank's output is not its rows of the whole batch by accident: they differ per rank
    assert not torch.allclose(results[0]["y"], results[1]["y"])


@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_linear_attention_over_cp_ranks_equals_one_process(cp_results, name):
    cp, cu = LINEAR_CASES[name]
    results = cp_results if cp == 4 else cp_results[2 * LINEAR_CP2.index(name):2 * LINEAR_CP2.index(name) + 2]
    results = [r["linear " + name] for r in results]
    for rank, r in enumerate(results):
        assert _rel(r["y"], r["ref_y"]) < 1e-5, (rank, _rel(r["y"], r["ref_y"]))
        assert _rel(r["x_grad"], r["ref_x_grad"]) < 1e-5, (rank, _rel(r["x_grad"], r["ref_x_grad"]))
        for n in r["grads"]:  # summed over the cp ranks in the worker
            assert _rel(r["grads"][n], r["ref_grads"][n]) < 1e-5, (rank, n, _rel(r["grads"][n], r["ref_grads"][n]))
        assert r["host_reads"] == 0, rank  # context, convolution, rule and backward: no host sync
        assert _rel(r["o"], r["ref_o"]) < 1e-5, (rank, _rel(r["o"], r["ref_o"]))
        for name_, got, want in zip("q k v g beta".split(), r["rule_grads"], r["ref_rule_grads"]):
            assert _rel(got, want) < 1e-5, (rank, name_, _rel(got, want))
        assert _rel(r["scan_y"], r["ref_scan_y"]) < 1e-5, (rank, _rel(r["scan_y"], r["ref_scan_y"]))  # Mamba-1's scan
        for name_, got, want in zip("u dt A b c".split(), r["scan_grads"], r["ref_scan_grads"]):
            assert _rel(got, want) < 1e-5, (rank, name_, _rel(got, want))
        assert "without linear_cp" in r["refused"]
    # the ranks' outputs differ: each holds its own rows
    assert not torch.allclose(results[0]["y"], results[1]["y"])


def test_conv_halo_refuses_chunks_shorter_than_the_taps_reach(cp_results):
    for r in cp_results:
        assert "tokens_per_micro_batch: each cp chunk (T / (2 cp) = 2 tokens) must hold the 3 tokens" in r["small chunks"]


def test_a_batch_split_for_another_cp_rank_is_refused(cp_results):
    """ContextParallel.attention_kwargs (Transformer.context's) checks the split's token_index
    against its own cp coordinate and size on the device: split_batch with the other rank,
    or for cp = 4 on a cp = 2 mesh, ran with wrong losses and gradients (52% off the loss for
    the size); the right split passes."""
    for rank, r in enumerate(cp_results):
        refused, own = r["wrong split"]
        assert own and len(refused) == 2, r["wrong split"]
        assert all(f"batch['token_index']: the batch was split for another cp rank or size than this rank's (cp rank {rank % 2} of 2)" in m
                   for m in refused), refused


def test_attention_context_checks_linear_cp():
    cu, positions = torch.tensor([0, 8]), torch.arange(4)
    with pytest.raises(ValueError, match="linear_cp: the linear layers' context-parallel exchange needs the split's token_index"):
        attention_context(cu, positions, CFG, linear_cp=object())
    cp_args = dict(token_index=torch.arange(4), kv_index=torch.arange(8), gather_kv=lambda k, v: (k, v))
    with pytest.raises(ValueError, match=r"linear_cp: expected an object with token_index, conv_halo and gated_delta_rule .* without \['token_index'"):
        attention_context(cu, positions, CFG, linear_cp=object(), **cp_args)


@pytest.mark.parametrize("cp", [2, 4])
def test_gather_kv_is_rank_ordered_and_its_backward_sums_over_ranks(cp_results, cp):
    for r in (x[f"gather cp={cp}"] for x in cp_results):  # cp = 2: both pairs of ranks
        assert torch.equal(r["k_all"], r["ref_k"]) and torch.equal(r["v_all"], r["ref_v"])
        torch.testing.assert_close(r["k_grad"], r["ref_k_grad"])
        torch.testing.assert_close(r["v_grad"], r["ref_v_grad"])


def test_gather_kv_on_one_rank_is_the_identity():
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    k_all, v_all = gather_kv(k, v, None)
    assert k_all is k and v_all is v
    with pytest.raises(ValueError, match="cp_mesh: expected a 1-D DeviceMesh"):
        gather_kv(k, v, "cp")
    with pytest.raises(ValueError, match="v: expected k's leading dims"):
        gather_kv(k, v[:3], None)
    with pytest.raises(ValueError, match="k: expected a float tensor"):
        gather_kv(k.long(), v, None)
    with pytest.raises(ValueError, match=r"k: expected a float tensor \[T/cp, G, D\], got torch.Size\(\[4\]\)"):
        gather_kv(torch.randn(4), torch.randn(4), None)
    with pytest.raises(ValueError, match=r"v: expected k's leading dims \(4, 2\), dtype torch.float32 and device cpu, got \(4, 2, 3\) torch.float64 cpu"):
        gather_kv(k, v.double(), None)
    with pytest.raises(ValueError, match=r"v: expected k's leading dims \(4, 2\), dtype torch.float32 and device cpu, got \(4, 2, 3\) torch.float32 meta"):
        gather_kv(k, v.to("meta"), None)


# ---------------------------------------------------------------------------- the split


def test_cp_token_index_takes_a_head_and_a_tail_chunk():
    assert cp_token_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_token_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [cp_token_index(16, 4, r).tolist() for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert torch.equal(cp_token_index(6, 1, 0), torch.arange(6))
    assert cp_token_index(8, 2, 1).dtype == torch.int64
    for T, cp in ((24, 3), (64, 4), (8, 4)):
        parts = [cp_token_index(T, cp, r) for r in range(cp)]
        assert all(p.shape == (T // cp,) and bool((p[1:] > p[:-1]).all()) for p in parts)
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(T))  # a partition
        assert torch.equal(cp_kv_index(T, cp), torch.cat(parts))  # gather_kv's row order
    # causal balance on one document: every rank's queries see the same number of keys
    work = [int((cp_token_index(32, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_bad_sizes_are_refused_not_padded():
    with pytest.raises(ValueError, match=r"tokens_per_micro_batch.*2 \* cp = 4.*T = 18"):
        cp_token_index(18, 2, 0)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        cp_kv_index(12, 4)
    with pytest.raises(ValueError, match="cp_rank: expected 0..1, got 2"):
        cp_token_index(16, 2, 2)
    with pytest.raises(ValueError, match="cp: expected >= 1"):
        cp_token_index(16, 0, 0)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        split_batch(make_batch(torch.arange(10), torch.tensor([0, 10])), 0, 2)
    with pytest.raises(ValueError, match=r"batch: expected a mapping of make_batch's entries \(a dict or TensorDict\), got NoneType"):
        split_batch(None, 0, 2)  # was an AttributeError


def test_cp_token_index_of_no_tokens_is_empty_and_negative_counts_are_refused():
    assert cp_token_index(0, 2, 1).tolist() == [] and cp_kv_index(0, 2).tolist() == []
    with pytest.raises(ValueError, match="n_tokens: expected >= 0, got -4"):
        cp_token_index(-4, 2, 0)


@pytest.mark.parametrize("cp", [1, 2])
def test_the_split_s_indices_live_on_the_batch_s_device(cp):
    assert all(cp_token_index(16, cp, r, device="meta").device.type == "meta" for r in range(cp))
    assert cp_kv_index(16, cp, device="meta").device.type == "meta"
    batch = make_batch(torch.arange(16), torch.tensor([0, 16]), mtp_depth=1)
    local = split_batch({k: v.to("meta") for k, v in batch.items()}, cp - 1, cp)
    assert local["token_index"].device.type == "meta" and local["mtp_labels"].shape == (1, 16 // cp)


def test_split_batch_refuses_entries_that_are_not_per_token():
    batch = make_batch(torch.arange(16), torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="batch: expected make_batch's entries, missing 'input_ids'"):
        split_batch({"cu_seqlens": batch["cu_seqlens"], "labels": batch["labels"]}, 0, 2)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: expected a 1-D tensor \[T\], got torch.Size\(\[2, 16\]\)"):
        split_batch(dict(batch.items(), input_ids=batch["input_ids"].repeat(2, 1)), 0, 2)
    with pytest.raises(ValueError, match=r"batch\['n_docs'\]: expected a per-token tensor whose last dim is T = 16, got torch.Size\(\[\]\)"):
        split_batch(dict(batch.items(), n_docs=torch.tensor(1)), 0, 2)


@pytest.mark.parametrize("padding", [0, 4])
def test_split_batch_keeps_cu_seqlens_and_indexes_every_token_field(padding):
    """Every per-token field indexed by the rank's tokens (the token_mask of padding too),
    cu_seqlens global; with a token_mask, routed_tokens its count over the whole batch (the
    balancing losses' mean runs over it on every rank)."""
    cu = torch.tensor([0, 5, 11, 16])
    keep = None if not padding else torch.arange(16) < 16 - padding
    batch = make_batch(torch.randint(0, 50, (16,)), cu, mtp_depth=2, label_mask=keep, token_mask=keep)
    assert ("token_mask" in batch.keys()) == bool(padding)
    for cp in (2, 4):
        for rank in range(cp):
            local = split_batch(batch, rank, cp)
            index = cp_token_index(16, cp, rank)
            assert set(local.keys()) == set(batch.keys()) | {"token_index"} | ({"routed_tokens"} if padding else set())
            if padding:
                assert local["routed_tokens"].dtype == torch.int64 and int(local["routed_tokens"]) == 16 - padding
            assert torch.equal(local["token_index"], index) and local["token_index"].dtype == torch.int64
            assert torch.equal(local["cu_seqlens"], batch["cu_seqlens"])  # global, unchanged
            for key in batch.keys():
                if key != "cu_seqlens":
                    assert torch.equal(local[key], batch[key][..., index]), key
                    assert local[key].shape[-1] == 16 // cp and local[key].dtype == batch[key].dtype
            assert local["mtp_labels"].shape == (2, 16 // cp)
    with pytest.raises(ValueError, match="batch: already split"):
        split_batch(split_batch(batch, 0, 2), 0, 2)
    with pytest.raises(ValueError, match=r"batch\['doc_ids'\]: expected a per-token tensor whose last dim is T = 16"):
        split_batch(dict(batch.items(), doc_ids=torch.zeros(3)), 0, 2)
    with pytest.raises(ValueError, match="missing 'cu_seqlens'"):
        split_batch({"input_ids": batch["input_ids"]}, 0, 2)


def test_mtp_targets_at_chunk_edges_come_from_the_other_rank():
    """make_batch rolls over the whole batch before the split, so the last token of a chunk
    keeps the next tokens of its document as targets even when they live on another rank
    (a roll per CP chunk, Megatron-LM's old bug, would give them the fill -100 / 0)."""
    tokens = 100 + torch.arange(16)
    batch = make_batch(tokens, torch.tensor([0, 6, 16]), mtp_depth=2)  # documents [0, 6), [6, 16)
    rank0, rank1 = split_batch(batch, 0, 2), split_batch(batch, 1, 2)  # [0..3, 12..15], [4..11]

    def at(local, t):  # the fields of global token t on the rank that holds it
        i = local["token_index"].tolist().index(t)
        return {k: v[..., i].tolist() for k, v in local.items() if k not in ("cu_seqlens", "token_index")}

    # token 3, end of chunk 0 (rank 0): tokens 4 and 5 of its document are on rank 1
    edge = at(rank0, 3)
    assert edge["labels"] == 104 and edge["loss_mask"] is True
    assert edge["mtp_input_ids"] == [104, 105] and edge["mtp_positions"] == [4, 5]
    assert edge["mtp_labels"] == [105, -100]  # token 6 starts the next document
    assert edge["mtp_loss_mask"] == [True, False]
    # token 11, end of chunk 2 (rank 1): tokens 12, 13, 14 are on rank 0
    edge = at(rank1, 11)
    assert edge["labels"] == 112 and edge["mtp_labels"] == [113, 114] and edge["mtp_loss_mask"] == [True, True]
    assert edge["mtp_input_ids"] == [112, 113] and edge["positions"] == 5 and edge["mtp_positions"] == [6, 7]
    # token 7, end of chunk 1: chunk 2 is on the same rank, the same rule holds
    assert at(rank1, 7)["mtp_labels"] == [109, 110]
    # the last tokens of the batch get the fill: nothing rolls in from past the end
    assert at(rank0, 15)["labels"] == -100 and at(rank0, 14)["mtp_labels"] == [-100, -100]
    # every field of both ranks is its rows of the unsplit batch
    for rank, local in enumerate((rank0, rank1)):
        for key in batch.keys():
            if key != "cu_seqlens":
                assert torch.equal(local[key], batch[key][..., cp_token_index(16, 2, rank)]), key


# ---------------------------------------------------------------------------- one rank


def _rule_inputs(T, N, Dk, Dv, device, dtype, seed, channels=False):
    """q, k, v, g, beta; channels: g [1, T, N, Dk], a decay per key channel (Kimi Delta Attention)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, N, Dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, N, Dv, generator=gen)
    g, beta = -torch.rand(1, T, N, *((Dk,) if channels else ()), generator=gen) * 0.2, torch.rand(1, T, N, generator=gen)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, g, beta)]


def _rule_over_one_rank(one_rank_mesh, T, N, Dk, Dv, cu, device, dtype, chunk_size, channels=False, rule=True):
    """gated_delta_rule_cp on one rank (its two chunks, the scan between them, no
    collective) and gated_delta_rule, outputs and gradients (relative errors); rule False:
    gated_linear_attention_cp and gated_linear_attention (no beta)."""
    ref_in = _rule_inputs(T, N, Dk, Dv, device, dtype, 3, channels)[:None if rule else 4]
    cp_in = [t.detach().clone().requires_grad_() for t in ref_in]
    cu = torch.tensor(cu, device=device)
    ref_o = (gated_delta_rule if rule else gated_linear_attention)(*ref_in, cu, chunk_size=chunk_size)
    o = (gated_delta_rule_cp if rule else gated_linear_attention_cp)(*cp_in, cu, one_rank_mesh, chunk_size=chunk_size)
    grad_o = torch.randn_like(o)
    ref_o.backward(grad_o)
    o.backward(grad_o)
    assert o.dtype == ref_o.dtype and o.shape == ref_o.shape
    return [_rel(o, ref_o)] + [_rel(a.grad, b.grad) for a, b in zip(cp_in, ref_in)]


def test_rule_over_one_rank_equals_the_rule(one_rank_mesh):
    # the second chunk continues [0, 9)'s state; chunks of the rule of 3 tokens
    errors = _rule_over_one_rank(one_rank_mesh, 16, 2, 4, 5, [0, 3, 9, 16], "cpu", torch.float32, 3)
    assert max(errors) < 1e-5, errors
    errors = _rule_over_one_rank(one_rank_mesh, 16, 2, 4, 5, [0, 3, 9, 16], "cpu", torch.float32, 3, channels=True)  # a decay per key channel
    assert max(errors) < 1e-5, errors
    for channels in (False, True):  # without the rule (lightning attention)
        errors = _rule_over_one_rank(one_rank_mesh, 16, 2, 4, 5, [0, 3, 9, 16], "cpu", torch.float32, 3, channels=channels, rule=False)
        assert max(errors) < 1e-5, errors
    with pytest.raises(ValueError, match=r"beta: expected this rank's \[1, T/cp, N\] \(gated_linear_attention_cp is the rule without it\)"):
        gated_delta_rule_cp(*_rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0)[:4], None, torch.tensor([0, 8]), one_rank_mesh)
    with pytest.raises(ValueError, match="q: expected this rank's T/cp tokens, its two chunks"):
        gated_delta_rule_cp(*_rule_inputs(7, 2, 4, 5, "cpu", torch.float32, 0), torch.tensor([0, 7]), one_rank_mesh)
    with pytest.raises(ValueError, match="cp_mesh: expected a 1-D DeviceMesh"):
        gated_delta_rule_cp(*_rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0), torch.tensor([0, 8]), "cp")
    q, k, v, g, beta = _rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0)
    for name, bad in (("v", v[:, :6]), ("v", v.repeat(1, 1, 2, 1)), ("k", None), ("g", g[..., None])):  # named as gated_delta_rule names them
        args = dict(q=q, k=k, v=v, g=g)
        args[name] = bad
        for fn, rule in ((gated_delta_rule_cp, (beta,)), (gated_linear_attention_cp, ())):
            with pytest.raises(ValueError, match=f"^{name}: expected"):
                fn(*args.values(), *rule, torch.tensor([0, 8]), one_rank_mesh)
    u, dt, b, c, A = torch.randn(1, 8, 5), torch.rand(1, 8, 5), torch.randn(1, 8, 3), torch.randn(1, 8, 3), -torch.rand(5, 3)
    with pytest.raises(ValueError, match=r"^dt: expected \[1, 8, 5\] \(of u's B, T, C and A's N\) on cpu, got \[1, 6, 5\]"):  # the shapes passed, not a chunk's
        selective_scan_cp(u, dt[:, :6], A, b, c, torch.tensor([0, 8]), one_rank_mesh)
    # values, as the ops' check reads them (the cp forms ran over a growing state and bounds that pack no documents)
    up = g.detach().clone()
    up[0, 5, 1] = 0.5
    for fn, rule in ((gated_delta_rule_cp, (beta,)), (gated_linear_attention_cp, ())):
        with pytest.raises(ValueError, match=r"^g: expected the log of each token's decay .*got a largest value of 0.5"):
            fn(q, k, v, up, *rule, torch.tensor([0, 8]), one_rank_mesh)
        with pytest.raises(ValueError, match=r"^cu_seqlens: must end at the token count 8, ends at 6"):
            fn(q, k, v, g, *rule, torch.tensor([0, 6]), one_rank_mesh)
        with pytest.raises(ValueError, match=r"^check: expected a bool, got 'no'"):
            fn(q, k, v, g, *rule, torch.tensor([0, 8]), one_rank_mesh, check="no")
        assert fn(q, k, v, up, *rule, torch.tensor([0, 8]), one_rank_mesh, check=False).isfinite().all()  # the layers' call: no host read
    with pytest.raises(ValueError, match=r"^A: expected <= 0 \(a positive rate grows the state without bound\), got "):
        selective_scan_cp(u, dt, -A, b, c, torch.tensor([0, 8]), one_rank_mesh)
    with pytest.raises(ValueError, match=r"^dt: expected >= 0 \(softplus's\), got -"):
        selective_scan_cp(u, -dt, A, b, c, torch.tensor([0, 8]), one_rank_mesh)
    with pytest.raises(ValueError, match=r"^cu_seqlens: must be non-decreasing"):
        selective_scan_cp(u, dt, A, b, c, torch.tensor([0, 5, 3, 8]), one_rank_mesh)
    assert selective_scan_cp(u, -dt, A, b, c, torch.tensor([0, 8]), one_rank_mesh, check=False).shape == (1, 8, 5)
    from fmoe.parallel import conv_halo

    x = torch.arange(24.0).view(8, 3)
    halo = conv_halo(x, 2, one_rank_mesh)  # chunks [0, 4) and [4, 8): zeros, then rows 2, 3
    assert torch.equal(halo[0], torch.zeros(2, 3)) and torch.equal(halo[1], x[2:4])
    assert conv_halo(x, 0, one_rank_mesh).shape == (2, 0, 3)  # one tap: nothing before a chunk
    with pytest.raises(ValueError, match=r"tokens_per_micro_batch: each cp chunk \(T / \(2 cp\) = 4 tokens\) must hold the 5 tokens"):
        conv_halo(x, 5, one_rank_mesh)


def test_cp_ops_refuse_a_2d_mesh_and_malformed_inputs(one_rank_mesh):
    from torch.distributed.device_mesh import DeviceMesh

    from fmoe.parallel import ContextCapacityDrop, conv_halo

    mesh_2d = DeviceMesh("cpu", torch.arange(1).view(1, 1), mesh_dim_names=("dp", "cp"))
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0))
    u, dt, b, c, A = torch.randn(1, 8, 5), torch.rand(1, 8, 5), torch.randn(1, 8, 3), torch.randn(1, 8, 3), -torch.rand(5, 3)
    cu, x = torch.tensor([0, 3, 8]), torch.arange(24.0).view(8, 3)
    with pytest.raises(ValueError, match=r"^cp_mesh: expected a 1-D DeviceMesh \(the cp axis\) or None, got a 2-D DeviceMesh"):
        gather_kv(k[0], v[0], mesh_2d)
    for call in (lambda m: gated_delta_rule_cp(q, k, v, g, beta, cu, m), lambda m: gated_linear_attention_cp(q, k, v, g, cu, m),
                 lambda m: selective_scan_cp(u, dt, A, b, c, cu, m), lambda m: conv_halo(x, 2, m)):
        with pytest.raises(ValueError, match=r"^cp_mesh: expected a 1-D DeviceMesh \(the cp axis\), got a 2-D DeviceMesh"):
            call(mesh_2d)
    for mesh in ("cp", mesh_2d):
        with pytest.raises(ValueError, match=r"^cp_mesh: expected a 1-D DeviceMesh, got "):
            ContextParallel(mesh)
    with pytest.raises(ValueError, match=r"^q: expected this rank's \[1, T/cp, N, Dk\], got torch.Size\(\[2, 8, 2, 4\]\)"):
        gated_delta_rule_cp(*(t.expand(2, -1, -1, *t.shape[3:]) for t in (q, k, v, g, beta)), cu, one_rank_mesh)
    with pytest.raises(ValueError, match=r"^u: expected this rank's \[1, T/cp, C\], got torch.Size\(\[2, 8, 5\]\)"):
        selective_scan_cp(u.expand(2, -1, -1), dt.expand(2, -1, -1), A, b.expand(2, -1, -1), c.expand(2, -1, -1), cu, one_rank_mesh)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected a 1-D tensor \[n_docs \+ 1\], got shape \(1, 3\)"):
        gated_delta_rule_cp(q, k, v, g, beta, cu[None], one_rank_mesh)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected a 1-D tensor \[n_docs \+ 1\], got shape \(1, 3\)"):
        selective_scan_cp(u, dt, A, b, c, cu[None], one_rank_mesh)
    with pytest.raises(ValueError, match=r"^n: expected >= 0, got -1"):
        conv_halo(x, -1, one_rank_mesh)
    with pytest.raises(ValueError, match=r"^x: expected a tensor \[T/cp, C\], got torch.Size\(\[8, 3, 1\]\)"):
        conv_halo(x[..., None], 2, one_rank_mesh)
    # a halo of a whole chunk (n = T / (2 cp)) is allowed: zeros, then all of chunk 0
    halo = conv_halo(x, 4, one_rank_mesh)
    assert torch.equal(halo[0], torch.zeros(4, 3)) and torch.equal(halo[1], x[:4])
    with pytest.raises(ValueError, match=r"^tp_mesh: expected a 1-D DeviceMesh, got 'tp'"):
        ContextCapacityDrop(one_rank_mesh, "tp")


def test_the_rule_over_one_rank_returns_v_s_dtype(one_rank_mesh):
    q, k, v, g, beta = (t.detach().bfloat16() for t in _rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0))
    cu = torch.tensor([0, 3, 8])
    assert gated_delta_rule_cp(q, k, v, g, beta, cu, one_rank_mesh, chunk_size=2).dtype == torch.bfloat16
    assert gated_linear_attention_cp(q, k, v, g, cu, one_rank_mesh, chunk_size=2).dtype == torch.bfloat16


def test_context_parallel_on_one_rank_passes_options_and_devices_on(one_rank_mesh):
    split = ContextParallel(one_rank_mesh)
    assert repr(split) == "ContextParallel(cp=1)"
    index = split.token_index(4, device="meta")
    assert index.device.type == "meta" and split.token_index(4).tolist() == [0, 1, 2, 3]
    assert split.attention_kwargs(torch.arange(8, device="meta"))["kv_index"].device.type == "meta"
    q, k, v, g, beta = (t.detach() for t in _rule_inputs(8, 2, 4, 5, "cpu", torch.float32, 0))
    up = g.clone()
    up[0, 5, 1] = 0.5  # a value the ops' check refuses; check=False reaches the op
    cu = torch.tensor([0, 8])
    assert split.gated_delta_rule(q, k, v, up, beta, cu, check=False).shape == (1, 8, 2, 5)
    assert split.gated_linear_attention(q, k, v, up, cu, check=False).shape == (1, 8, 2, 5)
    u, dt, b, c, A = torch.randn(1, 8, 5), torch.rand(1, 8, 5), torch.randn(1, 8, 3), torch.randn(1, 8, 3), -torch.rand(5, 3)
    assert split.selective_scan(u, -dt, A, b, c, cu, check=False).shape == (1, 8, 5)
    for method, args in (("gated_delta_rule", (q, k, v, up, beta, cu)), ("gated_linear_attention", (q, k, v, up, cu)),
                         ("selective_scan", (u, -dt, A, b, c, cu))):
        with pytest.raises(ValueError, match=r"^(g|dt): expected"):
            getattr(split, method)(*args)


@pytest.mark.gpu
def test_rule_over_one_rank_real_shape_on_cuda(one_rank_mesh):
    """The widened rule (Dv + Dk = 256 value channels, started from [0 | I]) in the states'
    Triton kernels, bf16 inputs, a document across the two chunks."""
    errors = _rule_over_one_rank(one_rank_mesh, 4096, 4, 128, 128, [0, 1000, 3000, 4096], "cuda", torch.bfloat16, 64)
    assert max(errors) < 2e-2, errors
