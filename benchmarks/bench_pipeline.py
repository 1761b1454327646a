"""Pipeline benchmark: the measured bubble of each schedule against its theoretical value.

    .venv/bin/python benchmarks/bench_pipeline.py            # CUDA, bf16, pp=2: needs >= 2 GPUs
    .venv/bin/python benchmarks/bench_pipeline.py --smoke    # CPU, gloo, tiny model

pp = 2 pipeline ranks (fmoe.parallel.Pipeline over torch.distributed.pipelining), spawned
here: one process per GPU with nccl, or, with --smoke, two CPU processes with gloo (each
with cpu_count / 2 threads). With fewer than 2 GPUs the script says so and exits (status
0) without measuring: a single GPU cannot hold two nccl ranks, and it does not fall back to
CPU (--smoke is that path, labelled as such).

Model (fmoe.model.Transformer, all blocks MoE, no MTP): H=1024, 8 layers, 16 experts of
F=1024, top-2 and 1 shared expert, 16 query / 4 kv heads of 64, vocab 32768, micro-batches
of 4096 tokens, m = 4, 8, 16 micro-batches per step, bf16 compute with float32 master
weights (--smoke: H=64, 4 layers, 4 experts of 64, vocab 64, 128 tokens, m = 2, 4,
float32). The layers are split evenly over the pp x virtual stages; the first stage also
holds the embedding, the last the head and the loss (LM loss plus each MoE layer's
sequence aux and z losses, as in the train loop).

Timing, per rank: each PipelineStage's forward_one_chunk and backward_one_chunk (one
stage, one micro-batch: the stage's compute, after the schedule has waited for its
inputs) are timed (CUDA events on the compute stream; perf_counter on CPU), and the whole
`Pipeline.step` with a wall clock after a barrier (warmup steps first: 3 on CUDA, 1 with
--smoke; then 10, or 3, timed steps). A step's time is the slowest rank's; a rank's busy
time is the sum of its chunks; its bubble is 1 - busy / step time (idle: waiting for a
neighbour, the point-to-point transfers the compute stream waits on, and the schedule's
own host work between chunks).

Rows (impl = the schedule name; at each m):
    no_pipeline        the whole model on one device (one process, with one rank's share of
                       the CPU threads), the same micro-batches forward and backward in
                       turn: the baseline, measured in the same run
    gpipe, 1f1b        virtual = 1 (one stage per rank)
    interleaved_1f1b   virtual = 2 (stages r and r + pp on rank r)
    looped_bfs         virtual = 2, breadth first

Columns: ms (median step time), busy_ms (busy time per rank, mean over ranks),
bubble_measured (1 - busy / step, mean over ranks; bubble_max in the CSV is the worst
rank), bubble_sim (the bubble the same schedule would have with these measured chunk
times and free, instant communication: each rank's chunks replayed in the order they ran,
each starting when its rank is free and its inputs are done; it holds the cost of
unequal stages, e.g. the head on the last), bubble_theory (equal stages, free
communication):
    gpipe, 1f1b        (p - 1) / (m + p - 1)
    interleaved_1f1b   (p - 1) / (v m + p - 1)                  (Megatron-LM's)
    looped_bfs         1 - v m / (v max(m, p) + min(m, p) - 1)
with p = pp, v = virtual, m micro-batches per step. looped_bfs: all of a rank's stage-r
forwards, then its stage-(r + p) forwards, ..., the backwards in reverse. With m >= p the
loops follow each other without a gap (micro-batch 0 is back at rank 0 after p chunk times,
while rank 0 is busy for m), so the forward takes (v m + p - 1) chunk times for v m of
work, the same as interleaved 1F1B; with m < p it waits p - m per loop. ratio =
bubble_measured / bubble_theory (1.0: the textbook bubble; above: imbalance, communication
and overhead, bubble_sim telling how much is imbalance). speedup_vs_no_pipeline = the
no_pipeline ms at the same m / this ms (ideal: pp (1 - bubble) for equal stages).
The CSV also has the schedule, each stage's median forward and backward chunk ms
(stage_ms: s<stage>:F / :B), the per-rank bubbles (rank_bubble) and the model sizes.
CSV: OUT/bench_pipeline.csv. The CUDA path (nccl, events) has not yet run on a machine
with 2 GPUs.

--smoke: on CPU the times hold gloo's transfers (in-process threads on the same cores)
and the Python overhead of the schedule, both large next to a tiny model's compute, so
the measured bubble sits well above the theory; they check that the benchmark runs.
"""

import json
import os
import statistics
import tempfile
import time

from _common import finish, start  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fmoe.model import Transformer, TransformerConfig  # noqa: E402
from fmoe.train.data import make_batch  # noqa: E402

COLUMNS = ["m", "impl", "pp", "virtual", "ms", "busy_ms", "bubble_measured", "bubble_sim", "bubble_theory", "ratio",
           "speedup_vs_no_pipeline"]
PP = 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2))

GPU = dict(cfg=TransformerConfig(vocab_size=32768, hidden=1024, n_layers=8, n_dense=0, n_experts=16, k=2, ffn_expert=1024,
                                 n_shared=1, n_heads=16, n_kv_heads=4, head_dim=64),
           tokens=4096, micro_batches=(4, 8, 16), warmup=3, steps=10)
SMOKE = dict(cfg=TransformerConfig(vocab_size=64, hidden=64, n_layers=4, n_dense=0, n_experts=4, k=2, ffn_expert=64,
                                   n_shared=1, n_heads=4, n_kv_heads=2, head_dim=16),
             tokens=128, micro_batches=(2, 4), warmup=1, steps=3)


def make_batches(cfg: TransformerConfig, tokens: int, n: int) -> list:
    """n packed micro-batches of `tokens` tokens, 4 documents of random lengths each (CPU)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        cuts = sorted(torch.randperm(tokens - 1, generator=g)[:3].add(1).tolist())
        out.append(make_batch(torch.randint(0, cfg.vocab_size, (tokens,), generator=g), torch.tensor([0, *cuts, tokens])))
    return out


def make_loss_fn(cfg: TransformerConfig, scale: dict):
    """The train loop's loss of one micro-batch on one stage: the LM loss over the step's
    valid tokens (last stage) plus the stage's MoE layers' sequence aux and z losses,
    averaged over layers and micro-batches. scale: {"valid": ..., "n": ...} of the step."""
    from fmoe.ops import seq_load_balancing_loss, z_loss

    n_moe = cfg.n_layers - cfg.n_dense

    def loss_fn(losses, stats, batch, model):
        loss = None if losses is None else losses["lm_sum"] / scale["valid"]
        if len(stats.keys()):
            aux = sum(1e-2 * seq_load_balancing_loss(s["aux_scores"], s["aux_experts"], batch["cu_seqlens"], k=cfg.k, check=False)
                      + 1e-3 * z_loss(s["router_logits"]) for s in stats.values()) / (n_moe * scale["n"])
            loss = aux if loss is None else loss + aux
        return loss, {}

    return loss_fn


def precision(device: torch.device) -> dict:
    """FSDP2's mixed precision as the train loop sets it: bf16 compute on CUDA, float32 on CPU."""
    return dict(param_dtype=torch.bfloat16 if device.type == "cuda" else None, reduce_dtype=torch.float32)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def theory(schedule: str, p: int, v: int, m: int) -> float:
    """The bubble fraction of the step time with equal stages and free communication."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "looped_bfs":
        return 1 - v * m / (v * max(m, p) + min(m, p) - 1)
    raise ValueError(schedule)


def simulate(actions: list, n_stages: int):
    """Replay each rank's chunks (actions[rank] = [(stage, "F" | "B", micro-batch, seconds)],
    in the order they ran) with free communication: a chunk starts when its rank is free and
    its inputs are done (F(s, j) after F(s - 1, j); B(s, j) after B(s + 1, j)). Returns the
    bubble of each rank over the replayed step, or None if the order cannot run."""
    done, free, pos = {}, [0.0] * len(actions), [0] * len(actions)
    while any(pos[r] < len(a) for r, a in enumerate(actions)):
        progressed = False
        for r, queue in enumerate(actions):
            while pos[r] < len(queue):
                s, kind, j, seconds = queue[pos[r]]
                dep = (s - 1, "F", j) if kind == "F" else (s + 1, "B", j)
                if (kind == "F" and s == 0) or (kind == "B" and s == n_stages - 1):
                    dep = None
                if dep is not None and dep not in done:
                    break
                begin = max(free[r], done[dep] if dep is not None else 0.0)
                free[r] = done[(s, kind, j)] = begin + seconds
                pos[r] += 1
                progressed = True
        if not progressed:
            return None
    step = max(free)
    return [1 - sum(a[3] for a in queue) / step for queue in actions]


def instrument(stage, log: list, cuda: bool) -> None:
    """Time the stage's forward_one_chunk and backward_one_chunk calls into `log`:
    (stage index, "F" | "B", micro-batch, start, end) with perf_counter floats on CPU,
    recorded CUDA events on CUDA."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        original = getattr(stage, name)

        def timed(chunk_id, *args, _original=original, _kind=kind, **kwargs):
            if cuda:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            else:
                begin = time.perf_counter()
            out = _original(chunk_id, *args, **kwargs)
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            else:
                end = time.perf_counter()
            log.append((stage.stage_index, _kind, int(chunk_id), begin, end))
            return out

        setattr(stage, name, timed)  # the schedules call stage.<name>(...): the instance's wins


def seconds(begin, end) -> float:
    return begin.elapsed_time(end) * 1e-3 if isinstance(begin, torch.cuda.Event) else end - begin


def worker(rank: int, root: str, smoke: bool, threads: int) -> None:
    """One pipeline rank: every schedule at every m; rank 0 writes the rows to root/rows.json."""
    from fmoe.parallel import MicroBatch, Pipeline, build_meshes, leave_ranks, materialize, parallelize

    torch.set_num_threads(threads)
    setup = SMOKE if smoke else GPU
    if smoke:
        device, backend = torch.device("cpu"), "gloo"
    else:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{root}/rendezvous", rank=rank, world_size=PP)
    try:
        cfg, dtype = setup["cfg"], torch.float32 if smoke else torch.bfloat16
        meshes = build_meshes(pp=PP, device_type=device.type)
        host = make_batches(cfg, setup["tokens"], max(setup["micro_batches"]))
        batches = [b.to(device) for b in host]
        scale = {}
        rows = []
        for schedule, virtual in SCHEDULES:
            pipe = Pipeline(cfg, meshes, schedule=schedule, virtual=virtual, loss_fn=make_loss_fn(cfg, scale),
                            tokens=setup["tokens"], device=device, dtype=dtype, **precision(device),
                            parallelize=lambda model: parallelize(model, meshes, **precision(device)),
                            materialize=lambda model: materialize(model, device, seed=0))
            log = []
            for stage in pipe.stages:
                instrument(stage, log, device.type == "cuda")
            for m in setup["micro_batches"]:
                scale.update(valid=sum(int(b["loss_mask"].sum()) for b in host[:m]), n=m)
                micro = [MicroBatch(b) for b in batches[:m]]
                steps = []
                for i in range(setup["warmup"] + setup["steps"]):
                    for chunk in pipe.chunks:
                        chunk.zero_grad(set_to_none=True)
                    log.clear()
                    sync(device)
                    dist.barrier()
                    sync(device)
                    t0 = time.perf_counter()
                    pipe.step(micro)
                    sync(device)
                    wall = time.perf_counter() - t0
                    actions = [(s, kind, j, seconds(b, e)) for s, kind, j, b, e in log]
                    gathered = [None] * PP
                    dist.all_gather_object(gathered, (wall, actions))
                    if i >= setup["warmup"]:
                        steps.append(gathered)
                if rank == 0:
                    rows.append(summarize(schedule, virtual, m, steps, pipe.n_stages))
            del pipe
        if rank == 0:
            with open(f"{root}/rows.json", "w") as f:
                json.dump(rows, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_ranks()


def summarize(schedule: str, virtual: int, m: int, steps: list, n_stages: int) -> dict:
    """The row of one (schedule, m) from each timed step's [(wall seconds, actions)] per rank."""
    step_s, busy_s, bubble, bubble_max, bubble_sim, per_rank = [], [], [], [], [], []
    for gathered in steps:
        wall = max(w for w, _ in gathered)  # the step ends when its slowest rank does
        busy = [sum(a[3] for a in actions) for _, actions in gathered]
        ranks = [1 - b / wall for b in busy]
        step_s.append(wall)
        busy_s.append(statistics.mean(busy))
        bubble.append(statistics.mean(ranks))
        bubble_max.append(max(ranks))
        per_rank.append(ranks)
        sim = simulate([actions for _, actions in gathered], n_stages)
        bubble_sim.append(None if sim is None else statistics.mean(sim))
    chunk = {}
    for gathered in steps:
        for _, actions in gathered:
            for s, kind, _, sec in actions:
                chunk.setdefault((s, kind), []).append(sec)
    stage_ms = " ".join(f"s{s}:{kind}={statistics.median(chunk[(s, kind)]) * 1e3:.3g}" for s, kind in sorted(chunk))
    th = theory(schedule, PP, virtual, m)
    measured = statistics.median(bubble)
    sims = [b for b in bubble_sim if b is not None]
    return {
        "m": m, "impl": schedule, "schedule": schedule, "pp": PP, "virtual": virtual,
        "ms": statistics.median(step_s) * 1e3, "busy_ms": statistics.median(busy_s) * 1e3,
        "bubble_measured": measured, "bubble_sim": statistics.median(sims) if sims else None,
        "bubble_theory": th, "ratio": measured / th,
        "bubble_max": statistics.median(bubble_max),
        "rank_bubble": " ".join(f"{statistics.median(r[i] for r in per_rank):.3g}" for i in range(PP)),
        "stage_ms": stage_ms,
    }


def no_pipeline(setup: dict, device: torch.device) -> list[dict]:
    """The whole model in this process (a world of 1, FSDP2 over it as in each pipeline
    stage): each m's micro-batches forward and backward in turn, median step ms."""
    from fmoe.parallel import build_meshes, materialize, parallelize

    cfg = setup["cfg"]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        meshes = build_meshes(device_type=device.type)
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, meshes, **precision(device))
        materialize(model, device, seed=0)
        host = make_batches(cfg, setup["tokens"], max(setup["micro_batches"]))
        batches = [b.to(device) for b in host]
        scale = {}
        loss_fn = make_loss_fn(cfg, scale)
        for m in setup["micro_batches"]:
            scale.update(valid=sum(int(b["loss_mask"].sum()) for b in host[:m]), n=m)
            times = []
            for i in range(setup["warmup"] + setup["steps"]):
                model.zero_grad(set_to_none=True)
                sync(device)
                t0 = time.perf_counter()
                for b in batches[:m]:
                    losses, stats = model(b, model.context(b))
                    loss, _ = loss_fn(losses, stats, b, model)
                    loss.backward()
                sync(device)
                if i >= setup["warmup"]:
                    times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows.append({"m": m, "impl": "no_pipeline", "schedule": "none", "pp": 1, "virtual": 1, "ms": ms, "busy_ms": ms})
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    if device.type == "cuda" and torch.cuda.device_count() < PP:
        print(f"the GPU numbers need >= {PP} GPUs (one pipeline rank per GPU, nccl); found {torch.cuda.device_count()}: "
              "nothing measured. --smoke runs the same benchmark on CPU with gloo.")
        return
    setup = SMOKE if args.smoke else GPU
    note = ("CPU, gloo: the times hold gloo's transfers and the schedule's Python overhead next to a tiny model's compute"
            if args.smoke else f"{PP} GPUs, nccl")
    print(f"NOTE: {note}", flush=True)
    threads = max(1, (os.cpu_count() or 1) // PP)
    torch.set_num_threads(threads)  # the baseline gets one rank's share of the cores
    rows = no_pipeline(setup, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # rank 0 of the pipeline shares this GPU
    print(f"no_pipeline measured; spawning {PP} pipeline ranks", flush=True)
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(worker, args=(root, args.smoke, threads), nprocs=PP, join=True)
        with open(f"{root}/rows.json") as f:
            rows += json.load(f)
    base = {r["m"]: r["ms"] for r in rows if r["impl"] == "no_pipeline"}
    for row in rows:
        if row["impl"] != "no_pipeline":
            row["speedup_vs_no_pipeline"] = base[row["m"]] / row["ms"]
    rows.sort(key=lambda r: r["m"])  # stable: no_pipeline first at each m, then the schedules
    cfg = setup["cfg"]
    finish(args, device, bandwidth, "bench_pipeline", [(rows, COLUMNS)], H=cfg.hidden, n_layers=cfg.n_layers,
           n_experts=cfg.n_experts, T=setup["tokens"], dtype=str(dtype).removeprefix("torch."), note=note)
    print(f"\nNOTE: {note}. bubble_* are means over the {PP} ranks; ratio = bubble_measured / bubble_theory.")


if __name__ == "__main__":
    main()
