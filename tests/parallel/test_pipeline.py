"""fmoe.parallel.Pipeline (torch.distributed.pipelining) on the reference model: pp stages,
alone and with FSDP2 and EP inside each stage, with every schedule we offer, give the
one-process losses, gradients (the tied embedding's included), grad norm, parameter norm,
zero-gradient count and expert loads (gloo, float32, sequence aux loss and z-loss on, MTP on
but in the hyper-connection and tied-embedding cases), and evaluate's LM loss sums; the split and the
schedules' constraints give ValueErrors naming the knob. One spawned process group per world
size runs every case of that size."""

import pytest
import torch
import torch.distributed as dist

from tests.parallel.dist import by_world, in_own_groups
from tests.parallel.test_model_parallel import GRANITE, QWEN3_NEXT

TINY = dict(vocab_size=64, hidden=32, n_layers=4, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32,
            n_shared=1, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1)
T = 24


def _batches(n, seed=1):
    from fmoe.train.data import make_batch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        cuts = sorted(torch.randperm(T - 1, generator=g)[:3].add(1).tolist())
        out.append(make_batch(torch.randint(0, TINY["vocab_size"], (T,), generator=g), torch.tensor([0, *cuts, T]), 1))
    return out


def _loss_fn(valid, n_layers_moe, n_micro):
    """The train loop's loss of one micro-batch on one stage: LM + 0.1 MTP over the step's
    valid count (last stage), plus the stage's own layers' sequence aux and z losses,
    averaged over all MoE layers and micro-batches."""
    from fmoe.ops import seq_load_balancing_loss, z_loss

    def loss_fn(losses, stats, batch, model):
        loss, logged = None, {}
        if losses is not None:
            loss = (losses["lm_sum"] + (0.1 * losses["mtp_1_sum"] if "mtp_1_sum" in losses.keys() else 0.0)) / valid
            logged["lm_sum"] = losses["lm_sum"].detach()
        if len(stats.keys()):
            cu = batch["cu_seqlens"]
            aux = sum(1e-2 * seq_load_balancing_loss(s["aux_scores"], s["aux_experts"], cu, k=2, check=False) + 1e-3 * z_loss(s["router_logits"])
                      for s in stats.values()) / (n_layers_moe * n_micro)
            loss = aux if loss is None else loss + aux
            logged["aux"] = aux.detach()
        return loss, logged

    return loss_fn


def _reference(cfg, batches, valid, n_micro):
    """One process: every micro-batch, gradients summed."""
    from fmoe.model import Transformer

    model = Transformer(cfg)
    model.reset_parameters(seed=0)
    names = list(model.moe_layers())
    loss_fn = _loss_fn(valid, len(names), n_micro)
    lm, aux, counts = 0.0, 0.0, {}
    for b in batches:
        losses, stats = model(b, model.context(b))
        loss, logged = loss_fn(losses, stats, b, model)
        loss.backward()
        lm, aux = lm + float(logged["lm_sum"]), aux + float(logged["aux"])
        for name, layer in stats.items():
            counts[name] = counts.get(name, 0) + layer["tokens_per_expert"]
    return model, names, lm, aux, counts


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _case(sizes, schedule, virtual, overrides):
    """This rank's errors against one process for one pipeline case."""
    from fmoe.model import TransformerConfig
    from fmoe.optim import grad_norm, param_norm, zero_grad_count
    from fmoe.parallel import MicroBatch, Pipeline, all_reduce_counts, all_reduce_sums, build_meshes, materialize, parallelize

    cfg = TransformerConfig(**{**TINY, **overrides})
    meshes = build_meshes(**sizes)
    dp, dp_rank = meshes.dp, meshes.batch.get_local_rank("dp")
    n_micro = max(2, meshes.pp) if schedule == "1f1b" else 2  # per data rank
    batches = _batches(n_micro * dp)
    valid = sum(int(b["loss_mask"].sum()) for b in batches)
    ref, names, ref_lm, ref_aux, ref_counts = _reference(cfg, batches, valid, len(batches))
    pipe = Pipeline(cfg, meshes, schedule=schedule, virtual=virtual, loss_fn=_loss_fn(valid, len(names), len(batches)), tokens=T,
                    device="cpu", dtype=torch.float32, parallelize=lambda m: parallelize(m, meshes),
                    materialize=lambda m: materialize(m, "cpu", seed=0))
    logged, counts = pipe.step([MicroBatch(b) for b in batches[dp_rank::dp]])
    pipe.sync_tied_grads()
    errors = {}
    sums = all_reduce_sums({"lm": logged.get("lm_sum", torch.zeros(())), "aux": logged.get("aux", torch.zeros(()))}, dist.group.WORLD)
    errors["lm_loss"] = abs(float(sums["lm"]) - ref_lm) / ref_lm
    errors["aux_loss"] = abs(float(sums["aux"]) - ref_aux) / ref_aux
    counts = all_reduce_counts(counts, dist.group.WORLD, names=names, n_experts=cfg.n_experts)
    for name in names:
        errors[f"{name}.counts"] = float((counts[name] - ref_counts[name]).abs().sum())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = set()
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            g = _full(p.grad)
            errors[f"stage{chunk.pipeline_chunk.stage}.{name}"] = float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max())
            seen.add(name)
    # every parameter lives on some stage: gather the names of all ranks
    all_seen = [None] * dist.get_world_size()
    dist.all_gather_object(all_seen, sorted(seen))
    errors["every_parameter_somewhere"] = float(set().union(*map(set, all_seen)) != set(ref_grads))
    counted, copies = pipe.norm_parameters()
    norm = grad_norm(counted, group=meshes.stage_mesh, pp_group=meshes.pp_mesh)
    ref_norm = sum(float(g.double().square().sum()) for g in ref_grads.values()) ** 0.5  # float64: float32's sum is off by ~1e-5
    errors["grad_norm"] = abs(float(norm) - ref_norm) / ref_norm
    # the parameters' norm and the zero-gradient count over the stages: every parameter
    # once, the last stage's embedding copy not counted (passed in the list here, and skipped)
    pnorm = param_norm(counted + copies, group=meshes.stage_mesh, pp_group=meshes.pp_mesh, copies=copies)
    ref_pnorm = sum(float(p.detach().double().square().sum()) for p in ref.parameters()) ** 0.5
    errors["param_norm"] = abs(float(pnorm) - ref_pnorm) / ref_pnorm
    zeros = zero_grad_count(counted, group=meshes.stage_mesh, pp_group=meshes.pp_mesh, copies=copies)
    ref_zeros = sum(int((g == 0).sum()) for g in ref_grads.values())  # embedding rows of unseen tokens, at least (untied)
    errors["zero_grad_count"] = float(int(zeros) != ref_zeros or (ref_zeros == 0 and not cfg.tie_embeddings))
    # the split is printable and covers every layer once
    errors["layers"] = float([i for r in pipe.layers for i in r] != list(range(cfg.n_layers)))
    # forward only: one LM loss sum per micro-batch, on the ranks of the last stage
    mine = batches[dp_rank::dp]
    got = pipe.evaluate([MicroBatch(b) for b in mine])
    if any(c.pipeline_chunk.last for c in pipe.chunks):
        with torch.no_grad():
            want = torch.stack([ref(b, ref.context(b))[0]["lm_sum"] for b in mine])
        errors["evaluate"] = float((got - want).abs().max() / want.abs().max())
    else:
        errors["evaluate_none_off_the_last_stage"] = float(got is not None)
    # the last stage's embedding copy is the first stage's, bit for bit; one flipped bit on
    # one rank of the copy is seen on every rank
    errors["tied_copies_agree"] = float(pipe.tied_mismatches() != [])
    copy = [c for c in pipe.chunks if c.pipeline_chunk.last and not c.pipeline_chunk.first and c.embed is not None]
    if copy and meshes.batch.get_local_rank("dp") == 0:
        with torch.no_grad():
            local = copy[0].embed.to_local() if hasattr(copy[0].embed, "to_local") else copy[0].embed
            local.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    errors["tied_copy_flip_seen"] = float(pipe.tied_mismatches() != (["embed"] if cfg.mtp_depth or cfg.tie_embeddings else []))
    return errors


def _refusals():
    """What every rank must see alike (a rank raising alone left the others waiting), and a
    loss without the MTP terms, whose embedding copy then has no gradient: its sum with the
    first stage's still runs (rank 1 skipped the all_reduce rank 0 entered: a hang)."""
    from fmoe.model import TransformerConfig
    from fmoe.parallel import MicroBatch, Pipeline, build_meshes, materialize, parallelize

    meshes = build_meshes(pp=2)

    def lm_only(losses, stats, batch, model):
        return (None if losses is None else losses["lm_sum"]), {}

    def make(cfg, tokens=T, layers_per_stage=None, dtype=torch.float32):
        return Pipeline(cfg, meshes, schedule="gpipe", virtual=1, loss_fn=lm_only, tokens=tokens, device="cpu", dtype=dtype,
                        parallelize=lambda m: parallelize(m, meshes), materialize=lambda m: materialize(m, "cpu", seed=0),
                        layers_per_stage=layers_per_stage)

    def refused(call, said):
        try:
            call()
        except ValueError as err:
            return float(said not in str(err))
        return 1.0

    dsa = dict(n_kv_heads=TINY["n_heads"], head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, index_topk=3, index_heads=2,
               index_head_dim=4, index_shared_layers=(2,))
    errors = {"split_refused_on_every_rank": refused(lambda: make(TransformerConfig(**{**TINY, **dsa}), layers_per_stage=[2, 2]),
                                                     "chunk: block 2 attends to the keys block 1 chose (index_shared_layers), which is in another "
                                                     "stage than blocks 2..3; give the two one stage (layers_per_stage), or use fewer stages"),
              "tokens_refused": refused(lambda: make(TransformerConfig(**TINY), tokens=0), "tokens: expected >= 1, got 0"),
              # float32 stages sent into bf16 buffers: gloo aborted the receiving rank in the first step
              "dtype_refused": refused(lambda: make(TransformerConfig(**TINY), dtype=torch.bfloat16),
                                       "dtype: the hidden states between stages are computed in the parameters' dtype (torch.float32) "
                                       "without a param_dtype, got dtype torch.bfloat16")}
    pipe = make(TransformerConfig(**TINY))
    batches = _batches(2)
    from fmoe.train.data import make_batch

    short = make_batch(torch.arange(16) % TINY["vocab_size"], torch.tensor([0, 16]), 1)  # 16 tokens, not T
    errors["other_token_count_refused"] = refused(lambda: pipe.step([MicroBatch(batches[0]), MicroBatch(short)]),
                                                  "micro_batches[1]: expected 24 token ids (the Pipeline's tokens), got shape (16,)")
    wide = batches[1].clone()
    wide["input_ids"] = wide["input_ids"].view(T, 1)
    errors["token_ids_of_two_dims_refused"] = refused(lambda: pipe.step([MicroBatch(batches[0]), MicroBatch(wide)]),
                                                      "micro_batches[1]: expected 24 token ids (the Pipeline's tokens), got shape (24, 1)")
    errors["raw_batches_refused"] = refused(lambda: pipe.step(batches), "micro_batches[0]: expected a fmoe.parallel.MicroBatch, got TensorDict")
    # a batch the model refuses (no MTP rows; cut into cp shares for a model that is not context parallel): on every rank before
    # the schedule (the stage holding the model's check raised inside it; the other stages saw a closed connection)
    no_mtp = make_batch(torch.arange(T) % TINY["vocab_size"], torch.tensor([0, T]), 0)
    errors["batch_without_mtp_rows_refused"] = refused(lambda: pipe.step([MicroBatch(batches[0]), MicroBatch(no_mtp)]),
                                                       "micro_batches[1]: batch: missing ['mtp_input_ids', 'mtp_labels'")
    from fmoe.parallel import split_batch

    errors["split_batch_refused"] = refused(lambda: pipe.step([MicroBatch(split_batch(batches[0], 0, 1))]),
                                            "micro_batches[0]: batch: a context-parallel model takes the batch split")
    errors["no_batch_to_evaluate_refused"] = refused(lambda: pipe.evaluate([]), "micro_batches: expected at least one micro-batch")
    pipe.step([MicroBatch(b) for b in batches])
    copies = pipe.embed_copies()
    last = any(c.pipeline_chunk.last for c in pipe.chunks)
    errors["copy_has_no_gradient"] = float(last and copies[0].grad is not None)  # what the test is about
    from fmoe.ops.backend import local_tensor  # this rank's values alone (a DTensor's comparison is a collective)

    first = None if last else local_tensor(copies[0].grad).clone()
    pipe.sync_tied_grads()  # returned on both ranks: no hang
    grad = local_tensor(copies[0].grad) if copies[0].grad is not None else None
    errors["copy_gets_the_first_stage_s_gradient"] = float(not torch.equal(grad, first)) if first is not None else float(
        grad is None or not grad.any())
    return errors


def _changing_counts():
    """Steps of 3, 2, then 3 micro-batches (a batch-size schedule that goes down and up) give
    one process's loss and gradients at each step: the schedule kept for 3 ran on stages
    that the one for 2 had prepared for 2 ("Chunk id 2 is out of range" on one rank, the
    other waiting)."""
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import MicroBatch, Pipeline, all_reduce_sums, build_meshes, materialize, parallelize

    cfg = TransformerConfig(**{**TINY, "n_layers": 2, "mtp_depth": 0})
    meshes = build_meshes(pp=2)
    ref = Transformer(cfg)
    ref.reset_parameters(seed=0)

    def lm(losses, stats, batch, model):
        return (None if losses is None else losses["lm_sum"]), ({} if losses is None else {"lm_sum": losses["lm_sum"].detach()})

    pipe = Pipeline(cfg, meshes, schedule="gpipe", virtual=1, loss_fn=lm, tokens=T, device="cpu", dtype=torch.float32,
                    parallelize=lambda m: parallelize(m, meshes), materialize=lambda m: materialize(m, "cpu", seed=0))
    errors = {}
    for step, n in enumerate((3, 2, 3)):
        batches = _batches(n, seed=10 + step)
        ref.zero_grad(set_to_none=True)
        ref_lm = 0.0
        for b in batches:
            loss = ref(b, ref.context(b))[0]["lm_sum"]
            loss.backward()
            ref_lm += float(loss)
        for chunk in pipe.chunks:
            chunk.zero_grad(set_to_none=True)
        logged, _ = pipe.step([MicroBatch(b) for b in batches])
        pipe.sync_tied_grads()
        got = float(all_reduce_sums({"lm": logged.get("lm_sum", torch.zeros(()))}, dist.group.WORLD)["lm"])
        errors[f"step{step}.lm_loss"] = abs(got - ref_lm) / ref_lm
        ref_grads = {name: p.grad for name, p in ref.named_parameters()}
        for chunk in pipe.chunks:
            for name, p in chunk.named_parameters():
                errors[f"step{step}.{name}"] = float((_full(p.grad) - ref_grads[name]).abs().max() / ref_grads[name].abs().max())
    return errors


def _padding():
    """A padding copy (MicroBatch(b, padding=True): a data rank short of micro-batches joins
    every collective) adds nothing: the gradients and the logged loss are those of the real
    micro-batches alone (with its loss counted, the gradients were 1.2-1.3 off, relative)."""
    from fmoe.model import TransformerConfig
    from fmoe.parallel import MicroBatch, Pipeline, all_reduce_counts, all_reduce_sums, build_meshes, materialize, parallelize

    cfg = TransformerConfig(**TINY)
    meshes = build_meshes(pp=2)
    batches = _batches(2)
    valid = sum(int(b["loss_mask"].sum()) for b in batches)
    ref, names, ref_lm, _, ref_counts = _reference(cfg, batches, valid, 2)
    pipe = Pipeline(cfg, meshes, schedule="gpipe", virtual=1, loss_fn=_loss_fn(valid, len(names), 2), tokens=T, device="cpu",
                    dtype=torch.float32, parallelize=lambda m: parallelize(m, meshes), materialize=lambda m: materialize(m, "cpu", seed=0))
    logged, counts = pipe.step([MicroBatch(batches[0]), MicroBatch(batches[1]), MicroBatch(batches[1], padding=True)])
    pipe.sync_tied_grads()
    lm = float(all_reduce_sums({"lm": logged.get("lm_sum", torch.zeros(()))}, dist.group.WORLD)["lm"])
    errors = {"lm_loss": abs(lm - ref_lm) / ref_lm}
    counts = all_reduce_counts(counts, dist.group.WORLD, names=names, n_experts=cfg.n_experts)
    for name in names:
        errors[f"{name}.counts"] = float((counts[name] - ref_counts[name]).abs().sum())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for chunk in pipe.chunks:
        for name, p in chunk.named_parameters():
            errors[name] = float((_full(p.grad) - ref_grads[name]).abs().max() / ref_grads[name].abs().max())
    return errors


CASES = {
    # micro-batch counts that go down and up again between steps
    "changing_counts": (2, _changing_counts),
    # a data rank's padding copy: no loss, no gradient
    "padding": (2, _padding),
    # refusals alike on every rank, and the tied embedding's sum with a loss that leaves the MTP modules out
    "refusals": (2, _refusals),
    # 2 trunk layers: stage 0 holds only the dense block (no MoE layer: it joins every collective all the same)
    "1f1b": (2, dict(pp=2), "1f1b", 1, dict(n_layers=2)),
    "gpipe": (2, dict(pp=2), "gpipe", 1, dict(n_layers=2, **GRANITE)),  # the embedding's and the logits' multipliers on their stages
    "interleaved_1f1b": (2, dict(pp=2), "interleaved_1f1b", 2, {}),
    # Qwen3-Next's blocks: a Gated DeltaNet block on each stage of the first chunk pair, zero-centred norms on both ends
    "interleaved_1f1b-gated-deltanet": (2, dict(pp=2), "interleaved_1f1b", 2, dict(QWEN3_NEXT, linear_layers=(0, 1, 3))),
    "looped_bfs": (2, dict(pp=2), "looped_bfs", 2, {}),
    # DeepSeek-V4's attention: compressed sparse attention on stage 0 (its indexer's loss reaching the indexer through
    # attach_loss, the stage's output its only way back), heavily compressed attention on stage 1
    "1f1b-dsv4": (2, dict(pp=2), "1f1b", 1, dict(n_layers=2, n_kv_heads=1, kv_shared=True, qk_norm="head_k", q_rank=10, csa_layers=(0,),
                                                 csa_rate=2, csa_topk=2, index_heads=2, index_head_dim=8, compress_layers=(1,), compress_rate=3,
                                                 window=5, attn_sinks=True)),
    "pp2xdp2": (4, dict(pp=2), "1f1b", 1, {}),
    "pp2xep2": (4, dict(pp=2, ep=2), "1f1b", 1, {}),
    # one trunk layer per stage: the middle stages' balancing losses reach their routers
    # only through attach_loss; MTP and the embedding copy on the last
    "pp4": (4, dict(pp=4), "1f1b", 1, {}),
    # hyper-connections: the n streams [T, n H] between the stages, collapsed by hc_head on the last
    "gpipe-hyper-connections": (2, dict(pp=2), "gpipe", 1, dict(n_layers=2, hyper_connections=3, mtp_depth=0)),
    # tied embeddings without MTP: the last stage's head is its copy of the embedding, its gradient summed with the first stage's
    "1f1b-tied-embeddings": (2, dict(pp=2), "1f1b", 1, dict(n_layers=2, tie_embeddings=True, mtp_depth=0)),
}


def _cases(rank, world, names):
    return {name: in_own_groups(CASES[name][1]) if callable(CASES[name][1]) else in_own_groups(_case, *CASES[name][1:]) for name in names}


@pytest.fixture(scope="module")
def results():
    return by_world(_cases, CASES, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_one_process(case, results):
    for rank, by_case in enumerate(results(CASES[case][0])):
        errors = by_case[case]
        bad = {k: v for k, v in errors.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_stage_layers_split_evenly_or_as_asked():
    from fmoe.parallel import rank_stages, stage_layers

    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(6, 3, [1, 2, 3]) == [range(0, 1), range(1, 3), range(3, 6)]
    assert rank_stages(1, 2, 2) == [1, 3]
    assert rank_stages(0, 4, 1) == [0]
    for args, message in (((3, 2, 1), r"pp_rank: expected 0..1, got 3"), ((-1, 2, 1), r"pp_rank: expected 0..1, got -1"),
                          ((0, 0, 1), r"pp: expected >= 1, got 0"), ((0, 2, 0), r"virtual: expected >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            rank_stages(*args)


@pytest.mark.parametrize("call, message", [
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(2, 4), r"pp: 4 pipeline stages .* for 2 trunk layers"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(4, 2, [3, 2]), r"layers_per_stage: expected 2 positive ints"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(4, 2, [4, 0]), r"layers_per_stage"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("1f1b", 1, 2), r"batch_schedule: the 1f1b schedule needs at least as many"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("interleaved_1f1b", 5, 2, 2), r"batch_schedule: .* multiple of its rounds"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule("1f1b", 2), r"pp_virtual: the 1f1b schedule runs one stage per rank"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule("interleaved_1f1b", 1), r"pp_virtual: .* \(pp_virtual >= 2\)"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule("zbv", 2), r"pp_schedule: expected one of gpipe, 1f1b, interleaved_1f1b, looped_bfs"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule("pipedream", 1), r"pp_schedule: expected one of gpipe, 1f1b"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).plan_sizes(4, pp=3), r"pp: 3 pipeline stages do not divide the world size 4"),
    # the pp of check_micro_batches (0 and a bool were accepted, "2" a TypeError) and a schedule of another type (unhashable)
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("1f1b", 2, 0), r"pp: expected >= 1, got 0"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("1f1b", 4, True), r"pp: expected an int, got True"),
    pytest.param(lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("interleaved_1f1b", 2, 0, 2), r"pp: expected >= 1, got 0",
                 id="interleaved pp 0"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule(["1f1b"], 1), r"pp_schedule: expected one of .*, got \['1f1b'\]"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(True, 1), r"n_layers: expected a positive int, got True"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(2, 3), r"pp: 3 pipeline stages \(pp x pp_virtual\) for 2 trunk layers"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(4, 2, [1, 1, 2]), r"layers_per_stage: expected 2 positive ints .* got \[1, 1, 2\]"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).stage_layers(4, 2, [True, 3]), r"layers_per_stage: expected 2 positive ints .* got \[True, 3\]"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_schedule("1f1b", True), r"pp_virtual: expected a positive int, got True"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("gpipe", 0, 2), r"batch_schedule: expected at least one micro-batch .* got 0"),
    (lambda: __import__("fmoe.parallel", fromlist=["x"]).check_micro_batches("gpipe", True, 2), r"batch_schedule: expected at least one micro-batch .* got True"),
])
def test_bad_splits_and_schedules_name_the_knob(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _chunk(*fields):
    from fmoe.model import PipelineChunk

    return PipelineChunk(*fields)


@pytest.mark.parametrize("chunk, message", [
    (_chunk(2, 2, range(0, 2)), r"chunk: expected stage in 0..n_stages - 1 and n_stages >= 1, got stage 2 of 2"),  # was a middle chunk
    (_chunk(-1, 2, range(0, 2)), r"got stage -1 of 2"),
    (_chunk(0, 0, range(0, 2)), r"got stage 0 of 0"),
    (_chunk(0, 2.0, range(0, 2)), r"chunk: expected an int n_stages, got 2.0"),
    (_chunk(0, 2, [0, 1]), r"chunk: expected a non-empty range of consecutive layers within range\(4\), got \[0, 1\]"),  # was an AttributeError
    ((0, 2, range(0, 2)), r"chunk: expected a fmoe.model.PipelineChunk, got tuple"),
    (_chunk(0, 2, range(-1, 2)), r"chunk: expected a non-empty range of consecutive layers within range\(4\), got range\(-1, 2\)"),
    (_chunk(1, 2, range(2, 5)), r"chunk: expected a non-empty range of consecutive layers within range\(4\), got range\(2, 5\)"),
    (_chunk(0, 2, range(0, 4, 2)), r"chunk: expected a non-empty range of consecutive layers within range\(4\), got range\(0, 4, 2\)"),
    (_chunk(1, 2, range(2, 2)), r"chunk: expected a non-empty range of consecutive layers within range\(4\), got range\(2, 2\)"),
])
def test_pipeline_chunk_refuses_a_chunk_outside_the_pipeline(chunk, message):
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    with torch.device("meta"):
        model = Transformer(TransformerConfig(**TINY))
    with pytest.raises(ValueError, match=message):
        pipeline_chunk(model, chunk)


def _pipeline(**changed):
    """A Pipeline built from these arguments (the refusals come before any stage is built: no process group needed)."""
    from types import SimpleNamespace

    from fmoe.model import TransformerConfig
    from fmoe.parallel import Pipeline

    meshes = SimpleNamespace(pp=2, pp_mesh=SimpleNamespace(device_type="cpu"))  # a CPU run's meshes, as Pipeline reads them
    args = dict(cfg=TransformerConfig(**TINY), meshes=meshes, schedule="1f1b", virtual=1, loss_fn=lambda *a: None, tokens=16,
                device="cpu", dtype=torch.float32, parallelize=lambda m: None, materialize=lambda m: None)
    return Pipeline(**{**args, **changed})


@pytest.mark.parametrize("changed, message", [
    (dict(dtype=torch.int64), r"dtype: expected a floating-point torch.dtype .*, got torch.int64"),  # was torch's RuntimeError
    (dict(dtype="bfloat16"), r"dtype: expected a floating-point torch.dtype .*, got 'bfloat16'"),
    (dict(parallelize=None), r"parallelize: expected a callable, got NoneType"),  # was a TypeError calling None
    (dict(materialize=0), r"materialize: expected a callable, got int"),
    (dict(loss_fn="ce"), r"loss_fn: expected a callable, got str"),
    (dict(device="cuda:0"), r"device: expected a cpu device, the meshes' device type, got cuda:0"),  # was accepted
    (dict(device="gpu0"), r"device: expected a torch.device or its name, got 'gpu0'"),
    (dict(meshes=object()), r"meshes: built without a pipeline axis"),  # was an AttributeError
    (dict(dtype=torch.bfloat16, param_dtype=torch.float16),  # buffers of one dtype, hidden states of another: gloo aborted
     r"dtype: the hidden states between stages are computed in param_dtype \(torch.float16, FSDP2's mixed precision\), got dtype torch.bfloat16"),
])
def test_pipeline_names_a_bad_argument_before_building_a_stage(changed, message):
    with pytest.raises(ValueError, match=message):
        _pipeline(**changed)


@pytest.mark.parametrize("n_layers, layers_per_stage, message", [
    (2, None, r"pp: 2 pipeline stages \(pp x pp_virtual\) for 1 shortcut pairs of blocks \(shortcut_moe\)"),
    # the default split keeps pairs whole ([4, 2]; an even [3, 3] cut the pair of blocks 2 and 3): the next check is reached
    (6, None, r"tokens: expected >= 1, got 0"),
    (6, [3, 3], r"chunk: blocks 2 and 3 are a shortcut pair \(shortcut_moe\)"),
])
def test_pipeline_splits_whole_shortcut_pairs(n_layers, layers_per_stage, message):
    from fmoe.model import TransformerConfig

    cfg = TransformerConfig(**{**TINY, "n_layers": n_layers, "n_dense": 0, "shortcut_moe": True, "mtp_depth": 0})
    with pytest.raises(ValueError, match=message):
        _pipeline(cfg=cfg, tokens=0, layers_per_stage=layers_per_stage)


def test_interleaved_1f1b_takes_fewer_micro_batches_than_stages_and_any_count_of_one_round():
    from fmoe.parallel import check_micro_batches

    for n in (1, 2, 3, 4, 6):
        assert check_micro_batches("interleaved_1f1b", n, 2, 2) is None
    assert check_micro_batches("1f1b", 2, 2) is None and check_micro_batches("gpipe", 1, 4) is None


def test_the_last_stage_refuses_a_loss_fn_without_a_loss():
    from fmoe.model import PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import MicroBatch, pipeline_chunk
    from fmoe.parallel.pipeline import StageModule

    cfg = TransformerConfig(**{**TINY, "n_layers": 2})
    model = Transformer(cfg)
    model.reset_parameters(seed=0)
    module = StageModule(pipeline_chunk(model, PipelineChunk(1, 2, range(1, 2))), lambda losses, stats, batch, model: (None, {}))
    module.micro_batches = [MicroBatch(_batches(1)[0])]
    with pytest.raises(ValueError, match="loss_fn: returned no loss on the last stage"):
        module(torch.zeros(T, cfg.hidden), micro_batch=torch.tensor([0]))


def test_stage_layers_names_sizes_that_are_not_a_sequence():
    from fmoe.parallel import stage_layers

    with pytest.raises(ValueError, match=r"layers_per_stage: expected 2 positive ints .* got 2$"):
        stage_layers(4, 2, 2)  # was "'int' object is not iterable"


def test_attach_loss_is_the_identity_forward_and_adds_the_loss_gradient():
    from fmoe.parallel import attach_loss

    x = torch.randn(3, 2, requires_grad=True)
    w = torch.randn((), requires_grad=True)
    y = attach_loss(x * 2, (w * 3).square())
    assert torch.equal(y, x * 2)
    g = torch.randn(3, 2)
    y.backward(g)
    assert torch.allclose(x.grad, 2 * g)
    assert torch.allclose(w.grad, 18 * w.detach())  # d/dw (3w)^2, as if added to the final loss
    with pytest.raises(ValueError, match="loss: expected a 0-D tensor"):
        attach_loss(x, torch.ones(2))


def test_a_block_reusing_another_s_choice_of_keys_shares_its_stage():
    """DeepSeek sparse attention's index_shared_layers: block 2 attends to the keys block 1
    chose, so a split between them is refused (each stage's forward has its own context)."""
    from fmoe.model import PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    dsa = dict(n_kv_heads=TINY["n_heads"], head_dim=12, rope_dim=4, q_rank=10, kv_rank=6, v_head_dim=5, index_topk=3, index_heads=2,
               index_head_dim=4, index_shared_layers=(2,))
    cfg = TransformerConfig(**{**TINY, **dsa})
    with torch.device("meta"):
        pipeline_chunk(Transformer(cfg), PipelineChunk(0, 2, range(0, 3)))  # blocks 1 and 2 together
        with pytest.raises(ValueError, match=r"chunk: block 2 attends to the keys block 1 chose \(index_shared_layers\), which is in another stage"):
            pipeline_chunk(Transformer(cfg), PipelineChunk(1, 2, range(2, 4)))


def test_a_shortcut_pair_shares_its_stage():
    """shortcut_moe: block 2j's MoE output is added in block 2j + 1, so a split between them is
    refused (and the loop's default split keeps pairs whole: test_train_parallel's pp run)."""
    from fmoe.model import PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    cfg = TransformerConfig(**{**TINY, "n_dense": 0, "shortcut_moe": True})
    with torch.device("meta"):
        pipeline_chunk(Transformer(cfg), PipelineChunk(1, 2, range(2, 4)))
        for s, layers in ((0, range(0, 3)), (1, range(1, 4))):
            with pytest.raises(ValueError, match=r"chunk: blocks (2 and 3|0 and 1) are a shortcut pair \(shortcut_moe\)"):
                pipeline_chunk(Transformer(cfg), PipelineChunk(s, 2, layers))


def test_pruned_chunks_keep_the_whole_models_names():
    from fmoe.model import LayerElsewhere, PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    cfg = TransformerConfig(**TINY, embed_norm=True)  # the embeddings' norm (with a weight) on the first stage alone
    whole = {n for n, _ in Transformer(cfg).named_parameters()}
    parts = []
    for s, layers in enumerate([range(0, 1), range(1, 3), range(3, 4)]):
        with torch.device("meta"):
            model = pipeline_chunk(Transformer(cfg), PipelineChunk(s, 3, layers))
        parts.append({n for n, _ in model.named_parameters()})
        assert all(isinstance(b, LayerElsewhere) == (i not in layers) for i, b in enumerate(model.blocks))
    assert parts[0] | parts[1] | parts[2] == whole
    assert parts[0] & parts[2] == {"embed"}  # the last stage's copy for MTP
    assert not parts[1] & (parts[0] | parts[2])
    assert "head" in parts[2] and "mtp.0.proj" in parts[2] and "head" not in parts[0]
    assert "embed_norm.weight" in parts[0] and "embed_norm.weight" not in parts[1] | parts[2]
    # two stages without MTP: learned absolute positions (abs_positions) on the first stage alone, with the embedding; tied
    # embeddings: the last stage's head is its embedding copy; hyper-connections' hc_head and the head's bias on the last stage alone
    for changed, first_only, last_only in ((dict(abs_positions=16), {"pos_embed"}, set()), (dict(tie_embeddings=True), set(), set()),
                                           (dict(hyper_connections=3), set(), {"hc_head.fn", "hc_head.base", "hc_head.scale"}),
                                           (dict(head_bias=True), set(), {"head", "head_bias"})):
        cfg = TransformerConfig(**dict(TINY, mtp_depth=0, **changed))
        with torch.device("meta"):
            stages = [{n for n, _ in pipeline_chunk(Transformer(cfg), PipelineChunk(s, 2, layers)).named_parameters()}
                      for s, layers in enumerate([range(0, 2), range(2, 4)])]
        assert stages[0] & stages[1] == ({"embed"} if "tie_embeddings" in changed else set())
        assert first_only <= stages[0] - stages[1] and last_only <= stages[1] - stages[0], changed
