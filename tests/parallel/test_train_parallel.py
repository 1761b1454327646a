"""examples/train_moe.py under torchrun (gloo, CPU, float32): other parallel knobs train the
same model and log the same losses as one process; a checkpoint saved on 4 ranks resumes on 2
and its weights start a new run (--init_from) on another mesh. The knobs' runs of one world
size share one launch (train_runs.py), and so do their one-process references."""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fmoe.train import checkpoint
from tests.sessions import run_in_session

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
TINY = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.ffn_dense=64", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=32",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=8", "--tokens_per_micro_batch=96", "--batch_schedule=0:4",
        "--eval_every=5", "--eval_batches=1", "--warmup=2", "--lr=1e-2", "--min_lr=1e-3", "--steps=5", "--ckpt_every=100", "--z_coeff=1e-3"]
STEPS = 5


def _launch(nproc, script, *args, timeout=900):
    """`script` run by torchrun on nproc ranks (by python itself for 1); its completed process, checked."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    run = run_in_session([*launch, str(script), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    failed = "".join(f"{line}\n" for line in run.stderr.splitlines() if line.startswith("train_runs: "))  # which of several runs
    assert run.returncode == 0, failed + run.stdout[-2000:] + run.stderr[-4000:]
    assert "returned a view tensor" not in run.stderr, run.stderr[-4000:]  # FSDP2's warning: fmoe.parallel.fsdp.shard_unit
    return run


def _records(out_dir):
    return [json.loads(line) for line in (pathlib.Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _train(out_dir, nproc, *args, stdout=None):
    """The run's metrics.jsonl records (and its standard output appended to `stdout`, a list)."""
    run = _launch(nproc, ROOT / "examples" / "train_moe.py", f"--out_dir={out_dir}", *TINY, *args)
    if stdout is not None:
        stdout.append(run.stdout)
    return _records(out_dir)


def _train_together(nproc, runs: dict):
    """{out_dir: args} trained in ONE launch of nproc ranks (train_runs.py: the script's main
    called for each in one process group) -> {out_dir: metrics.jsonl records}. Each run logs
    what it logs launched alone, bit for bit; the launch costs a 4-rank run more than its 5 steps."""
    spec = pathlib.Path(next(iter(runs))).parent / f"runs_{nproc}.json"
    spec.write_text(json.dumps([[f"--out_dir={out_dir}", *TINY, *args] for out_dir, args in runs.items()]))
    _launch(nproc, HERE / "train_runs.py", str(spec), timeout=300 + 60 * len(runs))  # alone: about 5 s a run
    return {out_dir: _records(out_dir) for out_dir in runs}


def _selected_runs(request) -> list:
    """The RUNS this session runs (all of them, or those -k or a node id picked)."""
    return list(dict.fromkeys(item.callspec.params["run"] for item in request.session.items
                              if item.module is sys.modules[__name__] and "run" in getattr(getattr(item, "callspec", None), "params", {})))


def _one_process_args(args) -> tuple:
    """The knobs of a parallel run that its one-process reference shares."""
    return tuple(a for a in args if a.startswith(SAME_MODEL))


class _Together:
    """Runs trained together on first use, one launch per world size; a failed launch fails
    every test of it with its output (it is not launched again)."""

    def __init__(self, root, runs: dict):  # name -> (nproc, args)
        self.runs, self.done = runs, {}
        self.dirs = {name: root / f"run{i}" for i, name in enumerate(runs)}

    def __call__(self, name):
        nproc = self.runs[name][0]
        if nproc not in self.done:
            try:
                self.done[nproc] = _train_together(nproc, {self.dirs[n]: args for n, (world, args) in self.runs.items() if world == nproc})
            except AssertionError as err:
                self.done[nproc] = err
        if isinstance(self.done[nproc], AssertionError):
            pytest.fail(f"the launch of the {nproc}-rank runs failed:\n{self.done[nproc]}")
        return self.done[nproc][self.dirs[name]]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """reference(*args): the one-process records for the knobs that are not about parallelism:
    those of the selected RUNS, and none, trained in one process on first use."""
    wanted = dict.fromkeys([(), *(_one_process_args(RUNS[name][1]) for name in _selected_runs(request))])
    together = _Together(tmp_path_factory.mktemp("ref"), {args: (1, list(args)) for args in wanted})
    return lambda *args: together(args)


@pytest.fixture(scope="module")
def parallel_runs(request, tmp_path_factory):
    """parallel_runs(name): the records of RUNS[name], every selected run of its world size
    trained in one launch on first use."""
    return _Together(tmp_path_factory.mktemp("knobs"), {name: RUNS[name] for name in _selected_runs(request)})


KEYS = ("loss", "mtp_1_loss", "z_loss", "seq_aux_loss", "aux_loss", "param_norm", "grad_norm")


def _assert_same(records, ref, keys=KEYS, loose=()):
    """Every step's losses, norms and expert counts alike (relative 1e-5; the keys in `loose`
    5e-5)."""
    assert [r["step"] for r in records] == [r["step"] for r in ref]
    for got, want in zip(records, ref):
        for key in keys:
            # the indexer's loss, a KL divergence near 0 at the start (7e-6 in the DSA run), sums terms of about 1 that
            # cancel: float32 leaves an absolute error that is not relative to it (about 1e-10 on SDPA's math path; 1.04e-8 at
            # step 5 of dsa-pp2 with the reference attention on torch's CPU flash kernel, whose probabilities the loss reads)
            near = dict(abs=3e-8) if key == "index_loss" else {}
            assert got[key] == pytest.approx(want[key], rel=5e-5 if key in loose else 1e-5, **near), (got["step"], key, got[key], want[key])
        assert got["tokens_per_expert"] == want["tokens_per_expert"], got["step"]  # counts summed over every rank
        for key in ("loss_tokens", "padding_tokens", "tokens_by_source", "batch_size", "tokens"):  # the step's tokens, every rank's
            assert got[key] == want[key], (got["step"], key, got[key], want[key])
        assert got["dropped_fraction"] == pytest.approx(want["dropped_fraction"], abs=1e-12), got["step"]
        assert got["zero_grads"] == want["zero_grads"], got["step"]  # each gradient entry counted once on any mesh
    assert records[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=1e-5)
    assert records[-1]["val_loss_by_source"] == pytest.approx(ref[-1]["val_loss_by_source"], rel=1e-5)  # summed over pp and cp too


RUNS = {
    "fsdp2": (2, []),
    "ep2": (2, ["--ep=2"]),
    "ep2-fsdp-edp2": (4, ["--ep=2", "--check_replicas_every=1"]),  # every step: the copies agree bit for bit
    "ep2xtp2": (4, ["--tp=2", "--ep=2"]),
    # sequence parallel: each tp rank's share of every balancing loss, the switch loss too; the
    # tp copies of norms and routers agree bit for bit every step
    "tp2-aux": (2, ["--tp=2", "--aux_coeff=1e-2", "--check_replicas_every=1"]),
    "etp2": (2, ["--etp=2"]),
    "muon": (4, ["--optimizer=muon", "--ns_dtype=float32", "--ep=2"]),
    # context parallel: each rank two chunks of every micro-batch, the switch loss too; with
    # sequence parallelism (each cp share split again over tp) and expert parallelism
    "cp2-aux": (2, ["--cp=2", "--aux_coeff=1e-2"]),
    "cp2xtp2": (4, ["--cp=2", "--tp=2", "--aux_coeff=1e-2"]),  # the switch loss's counts over both
    "cp2xep2": (4, ["--cp=2", "--ep=2"]),
    "cp2-capacity": (2, ["--cp=2", "--model.capacity_factor=1.0"]),  # the drop over both ranks' chunks
    # --whole_documents: the padding (on one cp rank's chunk, in one tp slice) is not routed
    # and every balancing loss leaves it out, its means over the micro-batch's routed tokens;
    # the switch loss under cp, the sequence-level loss and the z-loss (on by default) under
    # cp x tp, all three under a pipeline with experts over 2 ranks
    "whole-documents-cp2-aux": (2, ["--cp=2", "--whole_documents=True", "--aux_coeff=1e-2"]),
    "whole-documents-cp2xtp2": (4, ["--cp=2", "--tp=2", "--whole_documents=True"]),
    "whole-documents-pp2xep2": (4, ["--pp=2", "--ep=2", "--whole_documents=True", "--aux_coeff=1e-2"]),
    # experts over 4 ranks, 2 micro-batches over 4 data ranks: two ranks run only a masked copy, and still join
    "padded-ep4": (4, ["--ep=4", "--batch_schedule=0:2"]),
    # pipeline parallel (the switch loss on: each stage's balancing losses reach its routers);
    # stage 0 holds only the dense block; 2 stages per rank over 4 layers; FSDP2 and EP,
    # sequence and context parallel inside each stage; distributed Muon per stage (GPipe and
    # pp 4: test_pipeline.py)
    "pp2": (2, ["--pp=2", "--aux_coeff=1e-2"]),
    "pp2-interleaved": (2, ["--pp=2", "--pp_schedule=interleaved_1f1b", "--pp_virtual=2", "--model.n_layers=4"]),
    # ...3 micro-batches over 2 data ranks: the second runs the first's masked copy through the schedule too
    "pp2xep2-muon": (4, ["--pp=2", "--ep=2", "--optimizer=muon", "--ns_dtype=float32", "--check_replicas_every=1", "--batch_schedule=0:3"]),
    # ...with 2 stages per rank: the schedule gathers a stage's shards before the forward pre-hooks that wrote the owned
    # matrices' updates (the forward read the weights of the step before: 3.4e-4 off at step 3)
    "pp2-interleaved-ep2-muon": (4, ["--pp=2", "--ep=2", "--pp_schedule=interleaved_1f1b", "--pp_virtual=2", "--model.n_layers=4",
                                     "--optimizer=muon", "--ns_dtype=float32"]),
    "pp2xtp2": (4, ["--pp=2", "--tp=2"]),
    "pp2xcp2": (4, ["--pp=2", "--cp=2"]),
    # --train_only leaving stage 0 (the dense block, the embedding) frozen: that rank has no optimizer to build
    "pp2-train-only-last-stage": (2, ["--pp=2", "--train_only=blocks[.]1[.]|head", "--optimizer=muon", "--ns_dtype=float32"]),
    # DeepSeek-V3's pieces: multi-latent attention under cp (keys and values gathered), group top-2 routing, MTP norm;
    # and V3.2's sparse attention: each query's 3 keys chosen among every rank's (the indexer's keys gathered too), the
    # indexer's loss each rank's share (logged: index_loss), its target over every tp rank's heads, block 1 reusing
    # block 0's choice (GLM-5's shared layers)
    "dsa-cp2xtp2": (4, ["--cp=2", "--tp=2", "--model.n_kv_heads=4", "--model.head_dim=12", "--model.rope_dim=4", "--model.q_rank=10",
                        "--model.kv_rank=6", "--model.v_head_dim=5", "--model.mtp_norm=True", "--model.score=sigmoid", "--model.n_groups=2",
                        "--model.topk_groups=1", "--model.group_score_topk=2", "--model.index_topk=3", "--model.index_heads=4",
                        "--model.index_head_dim=6", "--model.index_shared_layers=1"]),
    # ...and through a pipeline: each stage's indexer losses logged (block 0's on stage 0, block 1's and the MTP
    # block's on stage 1), their gradients added in each stage's backward
    "dsa-pp2": (2, ["--pp=2", "--model.n_kv_heads=4", "--model.head_dim=12", "--model.rope_dim=4", "--model.q_rank=10", "--model.kv_rank=6",
                    "--model.v_head_dim=5", "--model.index_topk=3", "--model.index_heads=4", "--model.index_head_dim=6"]),
    # Qwen3-Next's hybrid: a Gated DeltaNet block under cp (its convolution's halos and its
    # rule's states exchanged between the ranks' chunks)
    "gated-deltanet-cp2": (2, ["--cp=2", "--model.linear_layers=0", "--model.linear_k_heads=2", "--model.linear_v_heads=4",
                               "--model.linear_k_dim=8", "--model.linear_v_dim=6"]),
    # (its decay's gradients, a sum of terms that mostly cancel, differ by 1e-5 across the
    # split, as they do between chunk sizes of one process; AdamW divides each entry by its
    # own gradient's scale, so the small entries' relative differences reach the weights:
    # the parameter norm drifts by 1.1e-5 in 5 steps while the losses agree to 1e-7: LOOSE)
    # attention's extras under tp: qkv biases with the qk norm over the whole projection
    # (OLMoE's, its statistic averaged over tp); multi-latent attention with distributed
    # Muon (the latent down projections whole on each tp rank, their copies agreeing bit for bit)
    "qkv-bias-proj-norm-tp2": (2, ["--tp=2", "--model.qkv_bias=True", "--model.qk_norm=proj", "--check_replicas_every=1"]),
    # fp8 GEMMs (--model.fp8) through a pipeline with experts over 2 ranks: 5 steps of the
    # one-process fp8 run's losses (each token quantized on its own row, the weights whole)
    "pp2xep2-fp8": (4, ["--pp=2", "--ep=2", "--model.fp8=True"]),
    # LongCat-Flash's blocks: three shortcut pairs through a pipeline, split as whole pairs (blocks 0-3, then 4-5; an
    # even split of the blocks would part pair 2-3), the zero experts' share in each stage's loads
    "shortcut-pairs-pp2": (2, ["--pp=2", "--model.n_layers=6", "--model.n_dense=0", "--model.shortcut_moe=True", "--model.zero_experts=2"]),
    # hyper-connections: the [T, 3 H] streams handed from stage to stage, collapsed on the last
    "hyper-connections-pp2": (2, ["--pp=2", "--model.hyper_connections=3", "--model.mtp_depth=0"]),
    "mla-tp2-muon": (2, ["--tp=2", "--optimizer=muon", "--ns_dtype=float32", "--model.n_kv_heads=4", "--model.head_dim=12", "--model.rope_dim=4",
                         "--model.q_rank=10", "--model.kv_rank=6", "--model.v_head_dim=5", "--check_replicas_every=1"]),
}
LOOSE = {"gated-deltanet-cp2": ("param_norm",)}
# knobs the one-process reference shares
SAME_MODEL = ("--optimizer=", "--ns_dtype=", "--batch_schedule=", "--aux_coeff=", "--model.n_layers=", "--model.n_kv_heads=", "--model.head_dim=",
              "--model.rope_dim=", "--model.q_rank=", "--model.kv_rank=", "--model.v_head_dim=", "--model.mtp_norm=", "--model.score=",
              "--model.n_groups=", "--model.topk_groups=", "--model.group_score_topk=", "--model.capacity_factor=", "--model.qkv_bias=",
              "--model.qk_norm=", "--whole_documents=", "--model.linear_", "--model.fp8=", "--model.index_", "--model.n_dense=",
              "--model.shortcut_moe=", "--model.zero_experts=", "--model.hyper_connections=", "--model.hc_", "--model.mtp_depth=", "--train_only=")


@pytest.mark.parametrize("run", list(RUNS))
def test_parallel_knobs_log_the_one_process_losses(run, reference, parallel_runs):
    nproc, args = RUNS[run]
    records = parallel_runs(run)
    assert len(records) == STEPS
    keys = KEYS + (("index_loss",) if "--model.index_topk=3" in args else ())  # DeepSeek sparse attention's indexer loss
    if "--model.mtp_depth=0" in args:  # no MTP module, no MTP loss
        keys = tuple(key for key in keys if key != "mtp_1_loss")
    _assert_same(records, reference(*_one_process_args(args)), keys=keys, loose=LOOSE.get(run, ()))


def test_a_run_among_others_in_one_launch_logs_what_it_logs_alone(parallel_runs, tmp_path):
    """train_runs.py calls the script's main for each run in one process group: nothing of
    an earlier run (seeds, process groups, caches) reaches a later one. tp2-aux runs third of
    the 2-rank launch, after FSDP2 and EP runs; alone it logs the same values bit for bit."""
    before = [name for name, (nproc, _) in parallel_runs.runs.items() if nproc == 2]
    if "tp2-aux" not in before or before.index("tp2-aux") < 2:
        pytest.skip("tp2-aux is not selected after two other 2-rank runs of its launch: run the whole module")
    nproc, args = RUNS["tp2-aux"]
    timing = {"tokens_per_s", "eta_seconds", "eval_seconds"}
    together = [{k: v for k, v in r.items() if k not in timing} for r in parallel_runs("tp2-aux")]
    alone = [{k: v for k, v in r.items() if k not in timing} for r in _train(tmp_path, nproc, *args)]
    assert together == alone


def test_checkpoint_of_four_ranks_resumes_on_two_and_starts_a_run_on_tp2(reference, tmp_path):
    first = _train(tmp_path, 4, "--ep=2", "--stop_at=3")
    assert (tmp_path / "step_000003").is_dir()
    resumed = _train(tmp_path, 2, "--resume=True")
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # the log keeps the first 3 steps
    _assert_same(resumed, reference())
    # --init_from: the weights only, on another mesh (2 ranks, TP), a new run from step 1
    # that logs what one process starting from the same weights logs
    tuned = _train(tmp_path / "tp2", 2, "--tp=2", f"--init_from={tmp_path}")
    one = _train(tmp_path / "one", 1, f"--init_from={tmp_path / 'step_000005'}")  # the newest one
    assert [r["step"] for r in tuned] == list(range(1, STEPS + 1))
    _assert_same(tuned, one)
    assert tuned[0]["loss"] < 0.9 * reference()[0]["loss"]  # trained weights: not a fresh start


def test_checkpoint_of_cp2_resumes_on_one_process(reference, tmp_path):
    first = _train(tmp_path, 2, "--cp=2", "--stop_at=3")
    resumed = _train(tmp_path, 1, "--resume=True")
    assert [r["step"] for r in first] == [1, 2, 3]
    _assert_same(resumed, reference())


def test_a_checkpoint_whose_ranks_disagree_stops_every_rank_with_one_message(tmp_path):
    """Each rank lists out_dir and reads its own extra file: another newest checkpoint on rank
    1, an extra file that cannot be read on rank 1 alone, or one of another step (a folder
    put together from two saves), stops both ranks before the load's collectives, rank 0
    saying what rank 1 found (before, rank 1 alone refused, after a minute, while rank 0
    waited in the load; the mixed steps trained on)."""
    _train(tmp_path, 2, "--stop_at=2")
    _train(tmp_path, 2, "--resume", "--stop_at=3")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "examples" / "train_moe.py"),
              f"--out_dir={tmp_path}", *TINY, "--resume"]
    done = _one_rank_fault("older_checkpoint", "train_moe", f"--out_dir={tmp_path}", *TINY, "--resume")  # step 3 not there on rank 1
    said = f"--resume: the ranks found different newest checkpoints in {tmp_path} (rank 0: step_000003, rank 1: step_000002)"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    step3 = tmp_path / "step_000003"
    shutil.copy(tmp_path / "step_000002" / "extra_rank1.pt", step3 / "extra_rank1.pt")
    for said in (f"--resume: path: '{step3}': the ranks' extra files are of different steps (rank 0: 3, rank 1: 2); a checkpoint "
                 "put together from several saves?",
                 f"--resume: rank 1: path: '{step3}' could not be read (extra_rank1.pt: "):
        run = subprocess.run(launch, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode != 0 and said in run.stderr, run.stdout[-2000:] + run.stderr[-4000:]
        assert "step 4" not in run.stdout, run.stdout[-2000:]
        (step3 / "extra_rank1.pt").write_bytes(b"not a checkpoint")


def test_a_replica_that_drifts_stops_the_run_at_the_next_check(tmp_path):
    """Data-parallel replicas (--dp_replicate=2) hold the same weights bit for bit: rank 1's
    drifting after step 2 (one_rank_fault.py's drift) stops both ranks at the first check
    after it (--check_replicas_every=3: step 3), naming the tensor, not at the run's end."""
    done = _one_rank_fault("drift", "train_moe", f"--out_dir={tmp_path}", *TINY, "--dp_replicate=2", "--check_replicas_every=3",
                           "--steps=6", "--eval_every=100")
    assert done.returncode != 0 and "step 3: the ranks holding copies of embed disagree" in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]  # stopped before step 3's record


def test_ranks_that_read_different_data_stop_with_one_message(tmp_path):
    """Each rank reads the data itself: rank 1 one text file short (one_rank_fault.py) stops
    both ranks at start, saying what each read (before, the run trained on, each rank on its
    own documents, without a word)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"doc{i}.txt").write_text(f"document {i}: " + "some text to train on. " * (20 + i))
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "one_rank_fault.py"),
                          "short_data", "train_moe", f"--out_dir={tmp_path / 'run'}", *TINY, f"--data={data}", "--eval_batches=0"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = ("--data: the ranks read different data (rank 0: 6 documents, 3,183 tokens; rank 1: 5 documents, 2,595 tokens); each rank "
            "reads the files itself: every node must hold the same ones")
    assert run.returncode != 0 and said in run.stderr, run.stdout[-2000:] + run.stderr[-4000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    for i in range(1, 6):  # one file: rank 1 finds none, and refuses alone; rank 0 says it (before, rank 1 did, a minute later)
        (data / f"doc{i}.txt").unlink()
    run = run_in_session(run.args, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = f"rank 1: data: source 'data' ({data}): path: no non-empty files under '{data}'"
    assert run.returncode != 0 and said in run.stderr, run.stdout[-2000:] + run.stderr[-4000:]


def _one_rank_fault(fault, script, *args, other_path=""):
    """examples/<script>.py on 2 ranks, rank 1 with `fault` (one_rank_fault.py): the completed process."""
    return run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "one_rank_fault.py"),
                           fault, script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "FMOE_TEST_OTHER_PATH": other_path})


def test_evaluate_and_generate_stop_where_a_rank_reads_other_files(tmp_path):
    """evaluate.py and generate.py on 2 ranks, rank 1 seeing its files otherwise (a node's
    copy): every rank stops with one message, said by rank 0. Before, ranks that found
    different newest checkpoints each loaded their own (a model half of each, silently), a
    run folder without its config.json on rank 1 held rank 1's message a minute while rank 0
    waited in a collective, other questions or data were scored, mixed, without a word, and
    ranks whose prompts or end-of-text ids differed (a tokenizer, chat template or
    generation_config.json of their own) aborted in a collective or hung after the output.
    Ranks given other knobs (--batches, --tokens, --dtype, ...) are refused at the start."""
    run = tmp_path / "run"
    _train(run, 1, "--stop_at=2")
    _train(run, 1, "--resume", "--stop_at=3")
    elsewhere = tmp_path / "elsewhere"  # rank 1's copy of the run folder: no config.json
    shutil.copytree(run / "step_000003", elsewhere / "step_000003")
    questions = [{"context_ids": [5, 6, 7], "choices_ids": [[8], [9, 10]], "answer": 1}] * 2
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (tmp_path / "q1.jsonl").write_text("".join(json.dumps(dict(q, answer=0)) + "\n" for q in questions))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"doc{i}.txt").write_text(f"document {i}: " + "some text to evaluate on. " * 40)
    cases = [
        (("older_checkpoint", "evaluate", str(run), "--json"), "",
         f"path: the ranks found different checkpoints (rank 0: {run / 'step_000003'}, rank 1: {run / 'step_000002'}); every rank "
         "must see the same files: name one checkpoint directory"),
        (("other_path", "generate", str(run), "--prompt_ids=1,2", "--tokens=2"), f"{run}=>{elsewhere}",
         f"rank 1: path: '{elsewhere}' is neither an fmoe run directory"),
        # a knob of the command line given otherwise on one rank: said at the start (another --batches scored a mixture of
        # both ranks' micro-batches, exit 0; another --tokens or --ep hung; another --dtype aborted in gloo)
        (("other_path", "generate", str(run), "--prompt_ids=1,2", "--tokens=2"), "--prompt_ids=1,2=>--prompt_ids=1,3",
         "the ranks' command lines differ (rank 0: --prompt_ids=1,2; rank 1: --prompt_ids=1,3): every rank must run the same one"),
        (("other_path", "evaluate", str(run), "--batches=2", "--json"), "--batches=2=>--batches=3",
         "the ranks' command lines differ (rank 0: --batches=2; rank 1: --batches=3): every rank must run the same one"),
        (("other_path", "export_hf", str(run), str(tmp_path / "export"), "--dtype=float32"), "--dtype=float32=>--dtype=bfloat16",
         "the ranks' command lines differ (rank 0: --dtype=float32; rank 1: --dtype=bfloat16): every rank must run the same one"),
        (("other_path", "evaluate", str(run), f"--choices={tmp_path / 'q.jsonl'}"), "q.jsonl=>q1.jsonl",
         f"--choices: {tmp_path / 'q.jsonl'}: the ranks read different questions from it; every node must hold the same file"),
        (("short_data", "evaluate", str(run), f"--data={data}", "--split=all", "--batches=2", "--tokens_per_micro_batch=96"), "",
         "--data: the ranks read different data (rank 0: 4 documents, "),
    ]
    for args, other_path, said in cases:
        done = _one_rank_fault(*args, other_path=other_path)
        assert done.returncode != 0 and said in done.stderr, (args, done.stdout[-2000:] + done.stderr[-4000:])


def test_generate_stops_where_a_rank_s_path_is_an_hf_folder_of_the_same_model(tmp_path):
    """Rank 1's copy of the path an HF export of the run (the same model config): rank 0
    loaded the run's checkpoint with DCP's collectives while rank 1 read safetensors and
    waited in another collective. The ranks now agree on what kind of folder they read."""
    run = tmp_path / "run"
    _train(run, 1, "--model.mtp_depth=0", "--model.mtp_norm=True", "--stop_at=1")
    export = subprocess.run([sys.executable, str(ROOT / "examples" / "export_hf.py"), str(run), str(tmp_path / "hf"), "--model_type=glm4_moe"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert export.returncode == 0, export.stderr[-3000:]
    done = _one_rank_fault("other_path", "generate", str(run), "--prompt_ids=1,2", "--tokens=2", other_path=f"{run}=>{tmp_path / 'hf'}")
    said = f"path: {str(run)!r} is not the same on every rank (rank 0: an fmoe run, rank 1: a Hugging Face folder)"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]


def test_ranks_stop_together_where_their_own_parts_or_models_differ(tmp_path):
    """Checks each rank makes of its own part, said by rank 0 at once: at pp = 2 only the
    last stage holds the MTP module a checkpoint of mtp_depth=0 lacks (before, that rank
    alone refused, a minute later, while rank 0 waited in the load); ranks whose token files'
    indexes give other vocabularies (rank 1's copy of the data) build other models and stop
    (before, they trained on, each its own model); a new run's out_dir where one rank sees an
    earlier run's checkpoints; ranks given other knobs (another --lr trained on without a word,
    another --ep hung)."""
    _train(tmp_path / "no_mtp", 1, "--model.mtp_depth=0", "--stop_at=1")
    done = _one_rank_fault("none", "train_moe", f"--out_dir={tmp_path / 'pp'}", *TINY, "--pp=2", f"--init_from={tmp_path / 'no_mtp'}")
    said = f"--init_from: rank 1: path: the model of '{tmp_path / 'no_mtp' / 'step_000001'}' differs from this one: mtp.0.proj (not saved)"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    for name, vocab in (("a", 300), ("b", 400)):  # the same tokens, indexes of two vocabularies
        (tmp_path / name).mkdir()
        tokens = np.random.default_rng(0).integers(1, 250, size=4000).astype(np.uint16)
        tokens[::100] = 0
        tokens.tofile(tmp_path / name / "tokens.u16")
        (tmp_path / name / "tokens.u16.index.json").write_text(json.dumps(dict(documents=int((tokens == 0).sum()) + 1, tokens=4000, dtype="uint16",
                                                                             separator=0, vocab_size=vocab)))
    done = _one_rank_fault("other_path", "train_moe", f"--out_dir={tmp_path / 'vocab'}", *TINY, f"--data={tmp_path / 'a' / 'tokens.u16'}",
                           other_path=f"{tmp_path / 'a'}=>{tmp_path / 'b'}")
    said = "--data, --init_from_hf: the ranks built different models from their files (rank 0: vocab_size=300; rank 1: vocab_size=400)"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    # a knob given otherwise on one rank: another --lr trained on without a word (the lines printed rank 0's), another
    # --ep hung in the mesh's collectives; both stop before the first step, naming the knob
    for knob, other in (("--lr=1e-2", "--lr=3e-2"), ("--ep=1", "--ep=2")):
        done = _one_rank_fault("other_path", "train_moe", f"--out_dir={tmp_path / 'knob'}", *TINY, "--ep=1", other_path=f"{knob}=>{other}")
        name, _, value = knob.partition("=")
        said = (f"the ranks' command lines differ (rank 0: {name}={float(value) if name == '--lr' else value}; rank 1: "
                f"{name}={float(other.partition('=')[2]) if name == '--lr' else other.partition('=')[2]}): every rank must run the same one")
        assert done.returncode != 0 and said in done.stderr and done.stderr.count(said) == 1, done.stdout[-2000:] + done.stderr[-4000:]
        assert not (tmp_path / "knob" / "metrics.jsonl").exists()
    # a new run's out_dir: rank 1's view holds an earlier run's checkpoints (before, it alone refused, a minute later)
    done = _one_rank_fault("other_path", "train_moe", f"--out_dir={tmp_path / 'fresh'}", *TINY, other_path=f"{tmp_path / 'fresh'}=>{tmp_path / 'no_mtp'}")
    said = f"rank 1: --out_dir: {tmp_path / 'no_mtp'} holds an earlier run's checkpoints (the newest step_000001)"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    assert not (tmp_path / "fresh").exists()


def test_upcycling_ranks_agree_on_the_dense_checkpoint_they_read(tmp_path):
    """--upcycle_from reads the dense run's newest checkpoint on each rank, with no
    collective: ranks that found different ones (a save landing between their listings, a
    node's stale copy) upcycled each its own weights and trained on without a word, and a
    rank that could not read its copy refused alone, a minute after the others went on."""
    dense = tmp_path / "dense"
    _train(dense, 1, "--model.n_dense=2", "--stop_at=2", "--ckpt_every=1")
    _train(dense, 1, "--model.n_dense=2", "--resume", "--stop_at=3")
    upcycle = (f"--out_dir={tmp_path / 'moe'}", *TINY, f"--upcycle_from={dense}")
    done = _one_rank_fault("older_checkpoint", "train_moe", *upcycle)
    said = (f"--upcycle_from: path: the ranks found different checkpoints (rank 0: {dense / 'step_000003'}, rank 1: {dense / 'step_000002'}); "
            "every rank must see the same files: name one checkpoint directory")
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]
    assert not (tmp_path / "moe" / "metrics.jsonl").exists()
    copy = tmp_path / "copy"  # rank 1's copy of the dense run, its newest shard overwritten (a cut one is passed over: step 2)
    shutil.copytree(dense, copy)
    for shard in (copy / "step_000003").glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))
    done = _one_rank_fault("other_path", "train_moe", *upcycle, other_path=f"{dense}=>{copy}")
    said = f"rank 1: --upcycle_from: path: {str(copy / 'step_000003')!r} could not be read"
    assert done.returncode != 0 and said in done.stderr, done.stdout[-2000:] + done.stderr[-4000:]


def test_checkpoints_move_between_pipeline_and_one_process(reference, tmp_path):
    """Saved at pp = 2, resumed on one process; saved on one process, resumed at pp = 2."""
    first = _train(tmp_path / "pp", 2, "--pp=2", "--stop_at=3")
    assert [r["step"] for r in first] == [1, 2, 3]
    # the plan logged is the largest rank's: the last stage (the head, the MTP module) holds more than rank 0's first
    plan = json.loads((tmp_path / "pp" / "config.json").read_text())["memory_plan"]
    assert plan["largest_rank"] == 1 and plan["largest_total"] > plan["total"] and first[0]["planned_memory_gib"] == plan["largest_total"] / 2**30
    _assert_same(_train(tmp_path / "pp", 1, "--resume=True"), reference())
    _train(tmp_path / "one", 1, "--stop_at=3")
    _assert_same(_train(tmp_path / "one", 2, "--pp=2", "--resume=True"), reference())


def _ranks_in_the_loop(run, metrics) -> dict:
    """{rank: pid} of a torchrun launch's processes, once every rank is in the loop (rank 0
    logs a step after its collectives)."""
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if run.poll() is not None:  # ended before its first step: what it said, not a missing /proc file
        out, err = run.communicate()
        raise AssertionError(f"the launch ended before its first step (exit {run.returncode}):\n{out[-2000:]}{err[-4000:]}")
    ranks = {}
    for pid in pathlib.Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split():
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[next(int(v[5:]) for v in env if v.startswith(b"RANK="))] = int(pid)
    return ranks


def test_a_stalled_rank_fails_the_run_after_the_collective_timeout(tmp_path):
    """--collective_timeout=0.2 (12 s): rank 1 stopped (SIGSTOP) in the loop, rank 0 fails in
    its next collective after the timeout rather than torch's default 30 minutes (torchrun
    then kills the stopped rank 30 s after its SIGTERM). (The timeout holds from the start:
    it leaves a loaded machine's ranks 12 s apart before the first step.)"""
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--steps=100000",
                            "--collective_timeout=0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = {}
    try:
        ranks = _ranks_in_the_loop(run, tmp_path / "metrics.jsonl")
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = run.communicate(timeout=240)
        took = time.monotonic() - stopped
    finally:
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.kill()
    assert sorted(ranks) == [0, 1] and run.returncode != 0, out[-2000:] + err[-4000:]
    assert took < 200, took


def _torchrun_acted_on(tmp_path, act, *knobs) -> tuple:
    """A 2-rank torchrun launch of the loop (TINY, many steps), `act(run, ranks)` once every
    rank is in the loop ({rank: pid}), then read to its end: (run, ranks, stdout, stderr,
    the logged steps). Ranks left over are killed."""
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, *knobs],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = {}
    try:
        metrics = tmp_path / "metrics.jsonl"
        ranks = _ranks_in_the_loop(run, metrics)
        act(run, ranks)
        out, err = run.communicate(timeout=300)  # the ranks hold the pipes: read until they end
    finally:
        run.kill()
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return run, ranks, out, err, [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone (rank 0 never gets it): the ranks agree through the step's
    sums, both stop after the same step, write its checkpoint together and exit 0; one
    process resumes from it. Rank 1 is a tensor-parallel rank, whose logged losses count none
    (tp rank 0's do): its stop request counts all the same."""
    run, ranks, out, err, steps = _torchrun_acted_on(tmp_path, lambda run, ranks: os.kill(ranks[1], signal.SIGTERM), "--steps=1000", "--tp=2")
    assert sorted(ranks) == [0, 1] and run.returncode == 0, out[-2000:] + err[-4000:]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 1000
    assert f"step {last}: stopping on a request to another rank, with the checkpoint of step {last}" in out
    assert checkpoint.latest(tmp_path) == tmp_path / f"step_{last:06d}"  # complete: both ranks wrote their part
    resumed = _train(tmp_path, 1, "--resume", "--steps=1000", f"--stop_at={last + 1}")
    assert [r["step"] for r in resumed] == list(range(1, last + 2))


def test_a_signal_to_every_process_of_the_job_stops_the_run_with_its_checkpoint(tmp_path):
    """SIGTERM to torchrun and both ranks at once (SLURM signals every process of a job
    step on scancel, a time limit or a preemption): torchrun passes its own on, so each rank
    gets two; the second, milliseconds later, is the same request and the ranks still stop
    after the same step with its checkpoint (it ended them before, the work since the last
    checkpoint lost). The ranks exit 0; torchrun itself exits 1, re-raising its signal."""
    def every_process(run, ranks):
        for pid in (run.pid, *ranks.values()):
            os.kill(pid, signal.SIGTERM)

    run, ranks, out, err, steps = _torchrun_acted_on(tmp_path, every_process, "--steps=1000")
    assert sorted(ranks) == [0, 1] and run.returncode == 1 and "SignalException" in err, out[-2000:] + err[-4000:]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 1000
    assert f"step {last}: stopping on SIGTERM, with the checkpoint of step {last}" in out, out[-2000:] + err[-4000:]
    assert checkpoint.latest(tmp_path) == tmp_path / f"step_{last:06d}"  # complete: both ranks wrote their part


def test_ranks_whose_torchrun_is_killed_stop_with_a_checkpoint(tmp_path):
    """torchrun SIGKILLed (the OOM killer, a lost agent) passes no signal on: its ranks trained
    on as orphans to the end of the run. They now take the launcher's end as a stop request:
    both stop after the same step, with its checkpoint."""
    run, ranks, out, err, steps = _torchrun_acted_on(tmp_path, lambda run, ranks: run.kill(), "--steps=100000")
    last = steps[-1]
    assert sorted(ranks) == [0, 1] and steps == list(range(1, last + 1)) and last < 100000, out[-2000:] + err[-4000:]
    assert f"step {last}: stopping on its launcher's end (torchrun, pid {run.pid}, is gone), with the checkpoint of step {last}" in out, \
        out[-2000:] + err[-4000:]
    assert checkpoint.latest(tmp_path) == tmp_path / f"step_{last:06d}"


def test_an_upcycled_run_on_two_ranks_logs_the_one_process_losses(tmp_path):
    """--upcycle_from under EP 2 with FSDP2, with Drop-Upcycling: each rank writes its own
    shards of the upcycled weights (its experts' slices, its blocks of the rest), and the run
    logs what one process upcycling the same dense run logs."""
    _train(tmp_path / "dense", 1, "--model.n_dense=2", "--stop_at=2")
    printed = []
    one = _train(tmp_path / "one", 1, f"--upcycle_from={tmp_path / 'dense'}", "--upcycle_drop=0.25", stdout=printed)
    two = _train(tmp_path / "two", 2, f"--upcycle_from={tmp_path / 'dense'}", "--upcycle_drop=0.25", "--ep=2")
    assert "4 experts, each a slice of 1/2 of its FFN, 25% of each one's channels (8 of 32) drawn afresh" in printed[0]
    _assert_same(two, one)  # Drop-Upcycling's draws too: each rank writes its block of the same full values


def test_compiled_pipeline_stages_log_the_eager_losses(reference, tmp_path):
    """--compile with --pp: each stage's model compiled in place (forward and backward under
    the schedule); the losses equal one eager process's within 1e-4 relative (the compiler
    may reorder float sums, as without pp), the expert loads exactly."""
    printed = []
    records = _train(tmp_path, 2, "--pp=2", "--compile", stdout=printed)
    graphs = re.search(r"torch.compile: (\d+) graphs, (\d+) graph breaks", printed[0])
    assert graphs and int(graphs[1]) >= 1, printed[0][-2000:]  # the stages did run compiled
    ref = reference()
    assert [r["step"] for r in records] == [r["step"] for r in ref]
    for got, want in zip(records, ref):
        for key in ("loss", "mtp_1_loss", "z_loss", "seq_aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), (got["step"], key)
        assert got["tokens_per_expert"] == want["tokens_per_expert"]


def test_bad_parallel_knobs_exit_with_the_reason(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--ep=2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ep * etp = 2 does not divide dp_shard * cp * tp = 1" in run.stderr
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--pp=2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "pp: 2 pipeline stages do not divide the world size 1" in run.stderr


def test_under_torchrun_a_bad_knob_is_said_once(tmp_path):
    """Every rank refuses the knob; rank 0 says so and the others, having seen its refusal in
    torchrun's store, leave it to rank 0 (fmoe.train.run.run_script): the message comes once."""
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", "--stepz=4"],
                         capture_output=True, text=True, timeout=300)
    said = "unknown argument '--stepz=4'; did you mean --steps? --help lists every knob"
    assert run.returncode != 0 and run.stderr.count(said) == 1, run.stderr[-3000:]
    root_cause = run.stderr.partition("Root Cause")[2].split("error_file")[0]  # torchrun's report: rank 0 failed first
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 1 ", root_cause), run.stderr[-2000:]
