"""examples/train_moe.py end to end on CPU: the loss falls, resume is exact, runs repeat bit
for bit, torch.compile matches eager, the knobs parse as users type them, bad knobs fail."""

import ast
import dataclasses
import errno
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import typing

import pytest
import torch

from fmoe.model import TransformerConfig
from tests.exits import exits

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--model.hidden=32", "--model.n_layers=2", "--model.n_dense=1", "--model.ffn_dense=64", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=32",
        "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16", "--tokens_per_micro_batch=128", "--batch_schedule=0:2",
        "--eval_every=10", "--eval_batches=2", "--warmup=3", "--lr=1e-2", "--min_lr=1e-3", "--z_coeff=1e-3"]


def _train(out_dir, *args, threads=None):
    """examples/train_moe.py with TINY and args; threads None: the worker's share of the cores (tests/conftest.py sets
    OMP_NUM_THREADS under make test's workers: a run of 2 threads beside the other worker's spins them, 1.7x slower)."""
    env = {**os.environ, **({} if threads is None else {"OMP_NUM_THREADS": str(threads)})}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={out_dir}", *TINY, *args],
                          capture_output=True, text=True, timeout=900, env=env)


def _records(out_dir):
    return [json.loads(line) for line in (pathlib.Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_in_an_out_dir_that_a_run_holds_is_refused(tmp_path):
    """One run at a time writes an out_dir: held (here by this process, as a running
    train_moe.py holds its own), a new run and a --resume stop at once with a message, writing
    nothing and removing nothing (a resume's cleanup removed a partial checkpoint the other
    run was writing), naming the holder's pid (a requeued job's orphans were not named).
    Released (its process ended), the same command runs."""
    from fmoe.train.run import OutDirInUse, OutDirLock

    out = tmp_path / "run"
    lock = OutDirLock(out)
    with pytest.raises(OutDirInUse, match=f"^--out_dir: {out} is in use: this process holds it \\(another OutDirLock of it, not released\\)"):
        OutDirLock(out)  # a second holder, even in this process: not named "another run" by its own pid
    with pytest.raises(ValueError, match="^--out_dir: expected a directory, got '' \\(the working directory"):
        OutDirLock("")
    (out / "step_000002.tmp").mkdir()  # the holder's checkpoint being written
    for extra in ([], ["--resume"]):
        run = _train(out, "--steps=2", *extra)
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
            f"--out_dir: {out} is in use: another run (pid {os.getpid()}) is writing it (it holds the directory until it ends); wait for it to end, "
            "or give another --out_dir"), run.stderr[-2000:]
        assert sorted(p.name for p in out.iterdir()) == ["step_000002.tmp"]
    holder = subprocess.run([sys.executable, "-c", f"from fmoe.train.run import OutDirLock; lock = OutDirLock({str(tmp_path / 'other')!r})"],
                            capture_output=True, text=True, timeout=120)
    assert holder.returncode == 0, holder.stderr
    OutDirLock(tmp_path / "other")  # its process ended (without a release): free again
    lock.release()
    OutDirLock(out).release()
    assert out.is_dir()  # it was there before the lock: kept
    OutDirLock(tmp_path / "made").release()
    assert not (tmp_path / "made").exists()  # made by the lock, still empty: removed (a refused run leaves no out_dir)


def test_an_out_dir_that_cannot_be_written_is_refused_at_the_start(tmp_path, monkeypatch):
    """A read-only mount passes mkdir and flock, so the run read its data and built its model
    before metrics.jsonl failed with a traceback; and where the mkdir itself failed, the lock's
    __del__ raised an AttributeError too. Now one line at the start, from the lock."""
    import errno
    import tempfile

    from fmoe.train.run import OutDirLock

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    real = tempfile.TemporaryFile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ValueError, match=f"^--out_dir: {tmp_path / 'ro'} cannot be written: Read-only file system$"):
        OutDirLock(tmp_path / "ro")
    assert not (tmp_path / "ro").exists()  # made by the lock, removed again
    monkeypatch.setattr(tempfile, "TemporaryFile", real)
    (tmp_path / "file").write_text("x")
    for out, said in ((tmp_path / "file" / "run", "cannot be made: Not a directory"), (tmp_path / "file", "exists and is not a directory")):
        with pytest.raises(ValueError, match=f"^--out_dir: {out} {said}$"):
            OutDirLock(out)
    import gc

    gc.collect()
    assert unraisable == []  # no __del__ of a half-made lock raised
    run = _train(pathlib.Path("/sys/fmoe_out_dir"), "--steps=2")  # sysfs takes no directory of ours, root's either
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith("--out_dir: /sys/fmoe_out_dir cannot be made: "), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "step 1" not in run.stdout


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tmp_path):
    """A save that fails with room on the disk (a file-size limit here, as a quota on a shared
    file system): the run stops naming the step, the cause and the newest intact checkpoint,
    where torch's writer said "unexpected pos 704 vs 598" under a 30-line traceback."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))

    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--steps=4",
                          "--ckpt_every=2"], capture_output=True, text=True, timeout=900, preexec_fn=limit)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last == (
        f"step 2: [Errno {errno.EFBIG}] cannot write step_000002 in {tmp_path}: File too large (a write of 1,048,576 bytes into "
        "step_000002.tmp failed as the save did, CheckpointException); the earlier checkpoints are kept; no checkpoint was written yet"), \
        run.stderr[-3000:]
    assert "Traceback" not in run.stderr and [r["step"] for r in _records(tmp_path)] == [1, 2]


def test_a_resume_without_a_checkpoint_says_it_starts_a_new_run(tmp_path):
    """--resume in an out_dir without a complete checkpoint (a job killed in its first save, or
    a typo in --out_dir) started a new run without a word, removing the partial save and the
    logged steps: now the start says so."""
    (tmp_path / "step_000004.tmp").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    run = _train(tmp_path, "--steps=1", "--warmup=0", "--resume")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (f"--resume: no complete checkpoint in {tmp_path}: a new run from step 1 (the partial step_000004.tmp of an interrupted "
            "save removed); the 2 steps its metrics.jsonl logged start again\n") in run.stdout, run.stdout[-2000:]
    assert not (tmp_path / "step_000004.tmp").exists() and [r["step"] for r in _records(tmp_path)] == [1]
    fresh = _train(tmp_path / "new", "--steps=1", "--warmup=0", "--resume")
    assert f"--resume: no complete checkpoint in {tmp_path / 'new'}: a new run from step 1\n" in fresh.stdout, fresh.stdout[-2000:]


def test_a_resume_passes_over_a_half_copied_checkpoint_and_needs_the_run_s_config(tmp_path):
    """A newer step_N folder that lacks a file its .metadata names (a copy stopped part way)
    was taken as the newest checkpoint, and the resume failed saying it was "not a checkpoint
    of fmoe"; it is passed over for the one before, saying so. A run whose config.json is gone
    resumed without checking its --model.* knobs (another model trained on, and the new knobs
    were written as the run's): refused."""
    first = _train(tmp_path, "--steps=6", "--stop_at=4", "--ckpt_every=2")
    assert first.returncode == 0, first.stderr[-2000:]
    (tmp_path / "step_000004" / "__0_0.distcp").unlink()
    run = _train(tmp_path, "--steps=6", "--resume")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (f"--resume: step_000004 is not a whole checkpoint (__0_0.distcp is missing): passed over for step_000002; move it out of "
            f"{tmp_path} (or remove it)\nresumed from {tmp_path / 'step_000002'} at step 2\n") in run.stdout, run.stdout[-2000:]
    (tmp_path / "config.json").unlink()
    run = _train(tmp_path, "--steps=8", "--resume", "--model.k=1")
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        f"--resume: path: '{tmp_path / 'step_000006'}' is neither an fmoe run directory (config.json) nor a checkpoint inside one; a resumed "
        "run checks its --model.* knobs against the run's config.json: put it back, or start a new run from the checkpoint's weights "
        f"with --init_from={tmp_path / 'step_000006'}"), run.stderr[-2000:]
    assert not (tmp_path / "config.json").exists() and "step 7" not in run.stdout


def test_a_resume_with_another_train_only_names_it(tmp_path):
    """--resume with a --train_only that trains other parameters than the run's (or none):
    refused naming the knob and the run's value (it failed in the optimizers' load, naming 200
    of their state entries and a Python function); another regex of the same parameters
    resumes (the strings were compared). A refused resume leaves the .tmp folder of an
    interrupted save (it was removed before the refusal); a taken one removes it. A resume
    with nothing to train keeps the records past its checkpoint (they were cut)."""
    first = _train(tmp_path, "--steps=3", "--stop_at=2", "--ckpt_every=2", "--train_only=blocks[.]1[.]")
    assert first.returncode == 0, first.stderr[-2000:]
    # the frozen MTP block's routing stays as it was (its expert bias too); the frozen parameters have no gradient, and
    # zero_grads counts the trained ones' entries
    from fmoe.train import checkpoint

    model, _ = checkpoint.load_run(tmp_path / "step_000002")
    biases = {name: moe.expert_bias for name, moe in model.moe_layers().items()}
    assert list(biases) == ["layer_1", "mtp_1"] and biases["layer_1"].abs().sum() > 0 and torch.equal(biases["mtp_1"], torch.zeros(4))
    trained = sum(p.numel() for name, p in model.named_parameters() if re.search("blocks[.]1[.]", name))
    assert all(0 <= r["zero_grads"] <= trained for r in _records(tmp_path)), (trained, _records(tmp_path))
    (tmp_path / "step_000003.tmp").mkdir()
    for extra, here in (([], ""), (["--train_only=blocks"], "blocks")):
        run = _train(tmp_path, "--steps=3", "--resume", *extra)
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
            f"--resume: the run in {tmp_path} trained with --train_only='blocks[.]1[.]' (here {here!r}); a resumed run trains the "
            "parameters it did, whose optimizer state its checkpoint holds: give the same --train_only, or start a new run from its "
            "weights with --init_from"), run.stderr[-2000:]
        assert (tmp_path / "step_000003.tmp").is_dir()
    run = _train(tmp_path, "--steps=3", "--resume", r"--train_only=blocks\.1\.")
    assert run.returncode == 0 and [r["step"] for r in _records(tmp_path)] == [1, 2, 3], run.stderr[-2000:]
    assert not (tmp_path / "step_000003.tmp").exists() and "resumed from" in run.stdout
    shutil.rmtree(tmp_path / "step_000003", ignore_errors=True)  # the newest checkpoint is step 2's again
    done = _train(tmp_path, "--steps=3", "--stop_at=2", "--resume", "--train_only=blocks[.]1[.]", "--clip=0.5")
    assert done.returncode == 0 and f"done: the run in {tmp_path} is at step 2, nothing to train up to step 2 (--steps=3, --stop_at=2)" \
        in done.stdout, done.stderr[-2000:]
    assert "note: this resumed run trains with" not in done.stdout  # it trains nothing
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


def _train_moe():
    """examples/train_moe.py as a module (its functions, without a run)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    import train_moe

    return train_moe


def test_validation_data_of_one_s_own_counts_under_its_own_names(tmp_path, monkeypatch):
    """A trainer copied from train_moe that validates on a held-out set of its own: the
    sources whose names the training corpus lacks were computed, then left out of val_loss
    (a blend of "train" and "ood" logged "train" alone), and with no name in common the
    first evaluation stopped the run on torch.stack's "expects a non-empty TensorList"."""
    from fmoe.train.data import Blend

    tm = _train_moe()
    stock = tm.load_blend

    class OwnValidation:  # the stock corpus for training; its validation split, then training documents, under other names
        def __init__(self, blend, names):
            self.blend, self.val_names = blend, names

        def __getattr__(self, name):
            return getattr(self.blend, name)

        def split(self, percent):
            train, val = self.blend.split(percent)
            datasets = [val.datasets[0], *[train.datasets[0]] * (len(self.val_names) - 1)]
            return train, Blend(datasets, self.val_names, [1.0] * len(self.val_names))

    for names in (["heldout"], [None, "ood"]):
        monkeypatch.setattr(tm, "load_blend", lambda *a, names=names, **k: OwnValidation(stock(*a, **k), names))
        out = tmp_path / str(len(names))
        argv = [f"--out_dir={out}", *TINY, "--steps=2", "--warmup=0", "--eval_every=2", "--eval_batches=4"]
        if None in names:  # one source the training corpus has, one it has not
            names[0] = stock(None).names[0]
        tm.main(argv)
        record = _records(out)[-1]
        assert list(record["val_loss_by_source"]) == names and math.isfinite(record["val_loss"])
        means = list(record["val_loss_by_source"].values())
        if len(means) == 1:
            assert means[0] == pytest.approx(record["val_loss"], rel=1e-5), record
        else:  # other documents under "ood": val_loss the token-weighted mix of both sources, not the training-named one's
            assert abs(means[0] - means[1]) > 1e-3 and min(means) < record["val_loss"] < max(means), record


def test_a_blend_source_validation_leaves_out_is_named(tmp_path, capsys):
    """Two sources weighted 3:1 and --eval_batches=1: validation measured the first alone, and
    nothing said so (no per-source line of the other either); a note names it now."""
    tm = _train_moe()
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        for i in range(30):
            (tmp_path / name / f"doc{i}.txt").write_text(f"{name} document {i}: " + "some words to train on. " * 12)
    (tmp_path / "blend.json").write_text(json.dumps([{"name": "first", "path": "first", "weight": 3},
                                                     {"name": "second", "path": "second", "weight": 1}]))
    argv = [f"--out_dir={tmp_path / 'run'}", *TINY, f"--data={tmp_path / 'blend.json'}", "--steps=1", "--warmup=0", "--val_percent=20", "--eval_batches=1"]
    tm.main(argv)
    said = ("note: validation leaves out 'second': its weight's share of the --eval_batches=1 micro-batches is none; raise "
            "--eval_batches to measure every source")
    assert said in capsys.readouterr().out and list(_records(tmp_path / "run")[-1]["val_loss_by_source"]) == ["first"]
    tm.main([f"--out_dir={tmp_path / 'run4'}", *argv[1:-1], "--eval_batches=4"])
    assert "note: validation leaves out" not in capsys.readouterr().out
    assert list(_records(tmp_path / "run4")[-1]["val_loss_by_source"]) == ["first", "second"]


def test_runs_called_in_one_long_lived_process_leave_its_state_as_they_found_it(tmp_path, monkeypatch):
    """main called in a notebook's process: --stop_after_minutes counted from the module's import (a run called an hour
    later stopped after its first step), --deterministic stayed on for the rest of the process, and the process group a
    one-process bf16 run starts stayed up after a refusal (a later run took it as the caller's, and the user's own
    init_process_group raised "initialize the default process group twice"), and the caller's generators were left at
    --seed's state, by a run or by a refusal after the seeding."""
    import random

    import torch.distributed as dist

    tm = _train_moe()
    torch.manual_seed(123)
    random.seed(123)
    generators = torch.get_rng_state(), random.getstate()
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + 3600.0)  # the run is called an hour after the import
    argv = [f"--out_dir={tmp_path / 'run'}", *TINY, "--steps=3", "--warmup=0", "--stop_after_minutes=30", "--deterministic", "--dtype=bfloat16"]
    tm.main(argv)
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 3]
    assert not torch.are_deterministic_algorithms_enabled() and not dist.is_initialized()
    with pytest.raises(SystemExit, match="holds an earlier run's checkpoints"):  # refused after its group started
        tm.main(argv)
    assert not dist.is_initialized() and not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.get_rng_state(), generators[0]) and random.getstate() == generators[1]
    with pytest.raises(SystemExit, match="^data: "):  # refused after the seeding
        tm.main([f"--out_dir={tmp_path / 'run2'}", *argv[1:], f"--data={tmp_path / 'absent.bin'}"])
    assert torch.equal(torch.get_rng_state(), generators[0]) and random.getstate() == generators[1]


def test_a_logged_value_the_record_lacks_is_named_with_where_its_key_goes():
    """A value of one's own logged by micro_batch_loss stopped the step with a bare
    KeyError('router_entropy'); the message now says where the key is added."""
    tm = _train_moe()
    record = {"lm_loss": torch.tensor(1.0)}
    tm._add_logged(record, {"lm_loss": torch.tensor(0.5)})
    assert record == {"lm_loss": torch.tensor(1.5)}
    with pytest.raises(KeyError, match=r"'router_entropy': a logged value that the step's record lacks; add its key to the record's keys"):
        tm._add_logged(record, {"router_entropy": torch.tensor(0.1)})


def test_a_launcher_s_variables_left_in_the_shell_are_refused_in_one_line(tmp_path):
    """Plain python with a WORLD_SIZE left in the environment (of a torchrun job's shell):
    torch's 20-line traceback ("RANK expected", "MASTER_ADDR expected") or int()'s; now one
    line naming what is missing and how to launch."""
    clean = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for env, said in (({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' in the environment without RANK, MASTER_ADDR, MASTER_PORT: launch several "
                                           "processes with torchrun (python -m torch.distributed.run --nproc-per-node=N ...), or unset "
                                           "WORLD_SIZE for one"),
                      ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE='2' in the environment without MASTER_ADDR, MASTER_PORT: launch"),
                      ({"WORLD_SIZE": "two"}, "WORLD_SIZE: expected an int in the environment (as torchrun sets it), got 'two'"),
                      ({"WORLD_SIZE": "0"}, "WORLD_SIZE: expected an int of at least 1 in the environment (as torchrun sets it), got '0'")):
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--steps=1"],
                             capture_output=True, text=True, timeout=300, env={**clean, **env})
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith(said), run.stderr[-3000:]
        assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_ranks_knobs_are_compared_as_given_and_their_differences_named():
    """The knobs every rank of a run must share (_rank_knobs, compared by same_command_lines at
    the start): --model.* as given (a model knob given on one rank alone was said as "the ranks
    built different models from their files"), the path knobs left out (each rank's copy of
    a path is compared by what it holds)."""
    from fmoe.train.run import command_line_facts, command_lines_differ

    tm = _train_moe()
    base = tm._rank_knobs(tm.parse_args(["--lr=0.01"]))
    assert base == tm._rank_knobs(tm.parse_args(["--lr=1e-2", "--data=/a", "--out_dir=/b"]))
    for knob in ("data", "out_dir", "init_from", "init_from_hf"):  # nodes may hold their copies at other paths (--upcycle_from: read at parsing)
        assert tm._rank_knobs(tm.parse_args(["--lr=0.01", f"--{knob}=/node1/{knob}"])) == base, knob
    assert set(tm.PATH_KNOBS) == {"data", "out_dir", "init_from", "init_from_hf", "upcycle_from"}
    # the same --model.* knobs in another order: the same command line, as the ranks compare it
    assert (command_line_facts(tm._rank_knobs(tm.parse_args(["--model.k=1", "--model.n_layers=3"])))
            == command_line_facts(tm._rank_knobs(tm.parse_args(["--model.n_layers=3", "--model.k=1"]))))
    other = tm._rank_knobs(tm.parse_args(["--lr=0.01", "--model.k=1", "--seed=3"]))
    assert command_lines_differ([command_line_facts(k) for k in (base, other, base)]) == (
        "the ranks' command lines differ (rank 0: --model.k=(not given), --seed=0; rank 1: --model.k=1, --seed=3; rank 2: --model.k=(not "
        "given), --seed=0): every rank must run the same one (torchrun: the same command on every node)")


def test_the_resume_note_names_each_changed_training_knob_and_no_other(tmp_path):
    """_training_changes against the knobs as config.json holds them (write_config: inf as
    "inf"): each training knob changed is named, a --model.* knob of how it trains beside
    another knob too; a knob given again as it was (an infinite --clip) is no change."""
    from fmoe.train.run import saved_config, write_config

    tm = _train_moe()
    base = tm.Config()
    write_config(tmp_path / "base", dataclasses.asdict(base))
    was = saved_config(tmp_path / "base")["config"]
    for knob, value in [("clip", 0.5), ("mtp_lambda", 0.3), ("z_coeff", 0.5), ("dtype", "bfloat16"), ("whole_documents", True)]:
        assert tm._training_changes(was, dataclasses.replace(base, **{knob: value})) == [f"--{knob}={value} (was {getattr(base, knob)})"]
    both = dataclasses.replace(base, weight_decay=0.5, model=dataclasses.replace(base.model, capacity_factor=1.25))
    assert tm._training_changes(was, both) == [f"--weight_decay=0.5 (was {base.weight_decay})",
                                               f"--model.capacity_factor=1.25 (was {base.model.capacity_factor})"]
    assert tm._training_changes(was, base) == []
    unclipped = dataclasses.replace(base, clip=math.inf)
    write_config(tmp_path / "inf", dataclasses.asdict(unclipped))
    was = saved_config(tmp_path / "inf")["config"]
    assert was["clip"] == "inf" and tm._training_changes(was, unclipped) == []
    assert tm._training_changes(was, base) == [f"--clip={base.clip} (was inf)"]


def test_train_only_regexes_are_compared_by_the_parameters_they_train():
    """A resume compares --train_only by the parameters each regex names (the strings were
    compared): "" trains all; a regex that is no regex (config.json edited by hand) none."""
    tm = _train_moe()
    names = ["embed.weight", "blocks.0.attn.wq", "blocks.1.mlp.router.weight", "head.weight"]
    assert tm._trains(names, r"blocks\.1\.") == tm._trains(names, "blocks[.]1[.]") == {"blocks.1.mlp.router.weight"}
    assert tm._trains(names, "") == tm._trains(names, ".") == set(names) != tm._trains(names, "blocks")
    assert tm._trains(names, "(") == tm._trains(names, 3) == set()


def test_knob_values_parse_as_users_spell_them(capsys):
    """None for an optional knob, a bool in any case and as yes/no, an empty list, inf for --clip, a floor or warmup start
    at the peak lr, softmax routing with its bias kept by name; -h prints the help as --help does."""
    tm = _train_moe()
    hints = typing.get_type_hints(TransformerConfig)
    assert tm._parse_value("model.capacity_factor", hints["capacity_factor"], "None") is None
    assert tm._parse_value("model.moe_layers", hints["moe_layers"], "") == ()
    assert tm._parse_value("model.norm_overrides", hints["norm_overrides"], " ") == ()
    assert [tm._parse_value("check_finite", bool, v) for v in ("Yes", "no", "TRUE", "0")] == [True, False, True, False]
    cfg = tm.parse_args(["--clip=inf", "--lr=1e-3", "--min_lr=1e-3", "--init_lr=1e-3"])
    assert (cfg.clip, cfg.min_lr, cfg.init_lr) == (math.inf, 1e-3, 1e-3)
    cfg = tm.parse_args(["--model.score=softmax", "--model.expert_bias=true"])
    assert (cfg.model.score, cfg.model.expert_bias) == ("softmax", True)
    with pytest.raises(SystemExit) as stop:
        tm.parse_args(["-h"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: train_moe.py [--knob=value ...]")


def test_the_schedule_helpers_resolve_the_knobs_defaults():
    """The default warmup is a tenth of the run up to 20 steps (--warmup=0: none); lr_at's keywords are factors on --lr,
    the WSD decay given to the wsd style alone; pipeline errors name the knobs."""
    tm = _train_moe()
    assert [tm._warmup_steps(tm.Config(steps=n)) for n in (9, 50, 199, 500)] == [0, 5, 19, 20]
    assert tm._warmup_steps(tm.Config(steps=500, warmup=0)) == 0 and tm._warmup_steps(tm.Config(warmup=7)) == 7
    knobs = dict(lr=2e-2, min_lr=-1.0, init_lr=5e-3, steps=100, lr_style="cosine", wsd_style="linear")
    schedule = tm._lr_schedule(knobs, 10, 18)
    assert schedule == dict(max_lr=1.0, total=100, warmup=10, min_lr=pytest.approx(0.1), init_lr=pytest.approx(0.25), style="cosine",
                            wsd_decay=0, wsd_style="linear")
    wsd = tm._lr_schedule({**knobs, "lr_style": "wsd", "min_lr": 1e-3}, 10, 18)
    assert wsd["wsd_decay"] == 18 and wsd["min_lr"] == pytest.approx(0.05)
    assert tm._pp_knobs(ValueError("chunk: block 3 attends to the keys block 1 chose (index_shared_layers), in another stage")) == (
        "block 3 attends to the keys block 1 chose (--model.index_shared_layers), in another stage")
    assert tm._pp_knobs(ValueError("layers_per_stage: expected 2 positive ints")) == "--pp_layers: expected 2 positive ints"


def test_the_resume_notes_name_the_knobs_that_changed_and_no_other(tmp_path):
    """_schedule_change names a knob changed by hand once (not again as the steps it resolved to), and a WSD decay only
    for a wsd run; _training_changes leaves out how the model runs (--model.ac) and a config.json without knobs;
    _upcycle_changes says "none" for a run that was not upcycled."""
    from fmoe.train.run import write_config

    tm = _train_moe()
    was = tm.Config(steps=100, warmup=5)
    write_config(tmp_path / "warm", dataclasses.asdict(was), warmup=5, wsd_decay=0)
    now = dataclasses.replace(was, warmup=10)
    note = tm._schedule_change(tmp_path / "warm", 2, now, tm._lr_schedule(vars(now), 10, 0))
    assert re.fullmatch(r"note: step 3 runs at a learning rate of [\d.e-]+ by this run's schedule, where the run's own gave [\d.e-]+: "
                        r"--warmup=10 \(was 5\); a resumed run follows the schedule of its knobs", note), note
    was = tm.Config(steps=100, warmup=0, lr_style="wsd")
    write_config(tmp_path / "wsd", dataclasses.asdict(was), warmup=0, wsd_decay=20)
    now = dataclasses.replace(was, lr_style="cosine")
    note = tm._schedule_change(tmp_path / "wsd", 50, now, tm._lr_schedule(vars(now), 0, 20))
    assert note.endswith(": --lr_style=cosine (was wsd); a resumed run follows the schedule of its knobs"), note
    base = tm.Config()
    write_config(tmp_path / "base", dataclasses.asdict(base))
    saved = json.loads((tmp_path / "base" / "config.json").read_text())["config"]
    assert tm._training_changes(saved, dataclasses.replace(base, model=dataclasses.replace(base.model, ac="full", impl="torch"))) == []
    assert tm._training_changes(None, base) == tm._training_changes("config", base) == []
    assert tm._upcycle_changes({"upcycle_from": "", "upcycle_drop": 0.0}, tm.Config(upcycle_from="/runs/dense")) == [
        "--upcycle_from=/runs/dense (was none)"]


def test_a_released_model_s_knob_given_as_its_folder_holds_it_is_no_change(tmp_path):
    """--init_from_hf with an architecture knob at the folder's own value: nothing changes, nothing is refused (the
    run goes on to the next check, here --device's)."""
    transformers = pytest.importorskip("transformers", reason="transformers (the test extra) not installed")
    transformers.Qwen3MoeConfig(vocab_size=260, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=128, head_dim=8, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2).save_pretrained(tmp_path / "hf")
    tm = _train_moe()
    with pytest.raises(SystemExit, match="^--device: expected auto, cpu, cuda or cuda:N, got 'tpu'$"):
        tm.main([f"--out_dir={tmp_path / 'run'}", f"--init_from_hf={tmp_path / 'hf'}", "--model.n_layers=3", "--model.n_experts=4",
                 "--device=tpu"])


def test_the_wsd_decay_default_rounds_up_and_zero_is_none(tmp_path):
    """--wsd_decay=-1 is a fifth of the steps after the warmup, rounded up (ceil(11 / 5) = 3 of 13 steps); --wsd_decay=0
    decays over no step, not the default."""
    tm = _train_moe()
    run = [*TINY, "--steps=13", "--warmup=2", "--lr_style=wsd", "--stop_at=1", "--eval_batches=0", "--batch_schedule=0:1",
           "--tokens_per_micro_batch=32"]
    for given, resolved in (("-1", 3), ("0", 0)):
        tm.main([f"--out_dir={tmp_path / given}", *run, f"--wsd_decay={given}"])
        assert json.loads((tmp_path / given / "config.json").read_text())["wsd_decay"] == resolved


def test_bf16_on_one_process_computes_through_mixed_precision(tmp_path, monkeypatch):
    """--dtype=bfloat16 on one process: the model is sharded over a group of one with FSDP2's bf16 compute and float32
    gradient sums (not a float32 model under a bf16 label)."""
    tm = _train_moe()
    real, precisions = tm.parallel.parallelize, []

    def parallelize(model, meshes, **precision):
        precisions.append(precision)
        return real(model, meshes, **precision)

    monkeypatch.setattr(tm.parallel, "parallelize", parallelize)
    tm.main([f"--out_dir={tmp_path}", *TINY, "--steps=1", "--warmup=0", "--eval_batches=0", "--batch_schedule=0:1", "--tokens_per_micro_batch=32",
             "--dtype=bfloat16"])
    assert precisions == [dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)]


def test_a_run_directory_whose_files_are_links_is_refused(tmp_path):
    """A run directory from elsewhere whose config.json or metrics.jsonl links to another
    file (a shell's rc file): --resume wrote its metrics through the link, emptying that
    file first. Refused at the start, naming the link; the linked file is untouched, and
    MetricsLogger and write_config refuse it too."""
    from fmoe.train.metrics import MetricsLogger
    from fmoe.train.run import write_config

    target = tmp_path / "bashrc"
    target.write_text("export PATH=$PATH\n")
    for name in ("config.json", "metrics.jsonl"):
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        (out / name).symlink_to(target)
        run = _train(out, "--steps=4", "--resume")
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
            f"--out_dir: '{out / name}' is a link (to '{target}'); a run writes its own {name}: remove the link"), run.stderr[-2000:]
        assert target.read_text() == "export PATH=$PATH\n"
    with pytest.raises(ValueError, match=r"out_dir: '.*metrics.jsonl' is a link \(to '.*bashrc'\); a run writes its own metrics.jsonl"):
        MetricsLogger(tmp_path / "metrics", total_steps=2, start_step=1)
    with pytest.raises(ValueError, match=r"out_dir: '.*config.json' is a link \(to '.*bashrc'\); a run writes its own config.json"):
        write_config(tmp_path / "config", {})
    assert target.read_text() == "export PATH=$PATH\n"


def test_thirty_steps_lower_the_loss(tmp_path):
    run = _train(tmp_path, "--steps=30")
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert [r["tokens"] for r in records] == [256 * step for step in range(1, 31)]  # the tokens seen: 2 micro-batches of 128 a step
    first, last = records[0], records[-1]
    assert sum(r["loss"] for r in records[-5:]) / 5 < 0.75 * first["loss"]
    assert records[9]["val_loss"] > last["val_loss"]
    for key in ("loss", "lr", "tokens", "grad_norm", "tokens_per_s", "mtp_1_loss", "seq_aux_loss", "z_loss", "flops_per_token",
                "tokens_per_expert", "load_cv", "load_max_over_mean", "dropped_fraction", "eta_seconds", "param_norm", "zero_grads",
                "planned_memory_gib", "tokens_by_source"):
        assert key in last, key
    # run health: the weights' norm grows from its initial value, some gradients are exactly
    # zero (embedding rows of bytes the step did not hold), no energy off CUDA (the reason in config.json)
    assert 0 < first["param_norm"] != last["param_norm"] and 0 < first["zero_grads"] < 100_000
    assert "energy_j" not in last and last["tokens_by_source"] == {"stdlib": 256}
    assert last["aux_loss"] == 0.0 < last["seq_aux_loss"]  # --aux_coeff=0: off, logged as 0; the default seq_aux_coeff's is on
    assert "stop_requests" not in last  # the loop's own sum of the ranks' stop requests is not a metric
    assert last["val_loss_by_source"] == {"stdlib": pytest.approx(last["val_loss"], rel=1e-6)}  # one source: the mean itself
    assert "val_loss_by_source" not in records[10] and "; by source" not in run.stdout
    assert "lasts the whole run" not in run.stdout  # a warmup of 3 in 30 steps
    assert f"(bits per byte {last['val_loss'] / math.log(2):.3f})" in run.stdout.splitlines()[-1]  # the byte corpus
    assert sum(last["tokens_per_expert"][0]) == 2 * 128 * 2 and last["dropped_fraction"] == [0.0, 0.0]  # layer_1, mtp_1
    assert (tmp_path / "step_000030").is_dir()  # a run always ends with a complete checkpoint
    # the start: one summary before the step lines; every step line shows the load and an ETA
    lines = run.stdout.splitlines()
    assert lines[0].startswith("model: ") and "active per token" in lines[0]
    assert "(1 MoE layer and 1 in the MTP module, each of 4 experts, top-2)" in lines[0], lines[0]  # the MTP block's was counted as the trunk's
    assert lines[1].startswith("data: the stdlib corpus") and "256 tokens per step" in lines[1]
    assert re.search(r"tokens \(\+ \d+ documents, [\d,]+ tokens for validation\)", lines[1]), lines[1]  # documents were called tokens
    assert lines[2].startswith("run: 30 steps on cpu x 1 (one process)") and f"out_dir {tmp_path}" in lines[2]
    steps = [line for line in lines if line.startswith("[")]
    assert len(steps) == 30 and all(" load " in line and " eta " in line for line in steps)
    # config.json: every knob, the versions, the world
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["config"]["model"]["hidden"] == 32 and config["config"]["steps"] == 30 and config["config"]["lr"] == 1e-2
    assert config["world_size"] == 1 and config["mesh"]["dp_shard"] == 1
    assert config["energy"] == {"measured": False, "reason": "CPU device"}
    assert config["peak_flops"] is None and last["mfu"] is None  # mfu's denominator, the datasheet peak: none for a CPU
    plan = config["memory_plan"]  # float32 weights and gradients, AdamW's two float32 moments
    assert plan["grads"] == plan["params"] and plan["optimizer"] == 2 * plan["params"] > 0
    import torch, triton  # noqa: E401

    assert config["run"]["torch"] == torch.__version__ and config["run"]["triton"] == triton.__version__
    assert "git_commit" in config["run"] and config["run"]["fmoe"] and config["run"]["git_dirty"] in (True, False, None)
    run = config["run"]  # how it was started: the command line, the threads, the launcher's variables, when
    assert run["argv"][0] == str(ROOT / "examples" / "train_moe.py") and "--steps=30" in run["argv"] and run["threads"] >= 1
    assert isinstance(run["env"], dict) and run["started"].endswith("+00:00") and "earlier_runs" not in config


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _train(whole, "--steps=10", "--ckpt_every=2", "--keep_every=4", "--deterministic").returncode == 0
    assert sorted(p.name for p in whole.glob("step_*")) == ["step_000004", "step_000008", "step_000010"]  # the last 2, and every 4th
    first = _train(parts, "--steps=10", "--stop_at=6", "--ckpt_every=4", "--deterministic")
    assert first.returncode == 0, first.stderr[-3000:]
    (parts / "step_000007.tmp").mkdir()  # a save the stop interrupted: removed by the resumed run
    second = _train(parts, "--steps=10", "--resume", "--deterministic")  # a bare flag is True
    assert second.returncode == 0, second.stderr[-3000:]
    assert not (parts / "step_000007.tmp").exists()
    assert "resumed from" in second.stdout and "step_000006" in second.stdout
    segments = json.loads((parts / "config.json").read_text())  # each segment's run record: the first kept
    assert [r["argv"] for r in segments["earlier_runs"]] == [[str(ROOT / "examples" / "train_moe.py"), *first.args[2:]]]
    assert "--resume" in segments["run"]["argv"]
    keys = ("loss", "grad_norm", "lr", "tokens", "mtp_1_loss")
    assert [[r[k] for k in keys] for r in _records(parts)] == [[r[k] for k in keys] for r in _records(whole)]
    # a resumed run at its last step says so and exits 0 (a job queued again); a new run refuses the earlier run's
    # out_dir (its checkpoints would mix with the new ones); a resumed run reads the data it read
    config = (parts / "config.json").read_text()
    done = _train(parts, "--steps=10", "--resume", "--lr=0.5", "--min_lr=0.05")
    assert (parts / "config.json").read_text() == config  # it trained nothing: the run's record stays
    assert "note: step" not in done.stdout  # no step left to run at another learning rate
    assert done.returncode == 0 and f"done: the run in {parts} is at step 10, nothing to train up to step 10 (--steps=10)" in done.stdout, \
        done.stderr[-3000:]
    assert len(_records(parts)) == 10
    run = _train(parts, "--steps=12")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"--out_dir: {parts} holds an earlier run's checkpoints (the newest step_000010); --resume continues that run" in run.stderr
    run = _train(parts, "--steps=12", "--resume", "--seed=3")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"--resume: the run in {parts} read other data (state: seed is 0, this sampler has 3)" in run.stderr, run.stderr[-3000:]
    assert "give the --data (and --separator, --data_dtype), --seed and --val_percent it was started with" in run.stderr
    run = _train(parts, "--steps=12", "--resume", "--eval_batches=0")  # no validation split: other training documents
    assert run.returncode != 0 and "(and --eval_batches=0 if it was, or not: 0 holds no document out for validation)" in run.stderr, \
        run.stderr[-3000:]
    # --resume continues the run's model: a knob that would change it stops the run, by name, before anything is
    # read (one of how it runs does not); --init_from takes the weights into a model of the same shapes
    run = _train(parts, "--steps=12", "--resume", "--model.zero_experts=2", "--model.route_scale=2.0", "--model.ac=full")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert (f"--resume: the run in {parts} was trained with route_scale=None (here 2.0), zero_experts=0 (here 2); a resumed run "
            "continues its model: give the --model.* knobs (and --init_from_hf or --upcycle_from) it was started with") in run.stderr, \
        run.stderr[-3000:]
    run = _train(tmp_path / "other", "--steps=12", f"--init_from={parts}", "--model.zero_experts=2")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "--init_from: the model of " in run.stderr and "blocks.1.mlp.router (saved [4, 32], here [6, 32])" in run.stderr
    assert "--upcycle_from" not in run.stderr  # the saved model is an MoE already
    assert "the saving run's model has zero_experts=0 (here 2)" in run.stderr, run.stderr[-3000:]
    # knobs that keep the shapes load, and are named: the weights make another function (nothing said before)
    run = _train(tmp_path / "other_k", "--steps=1", "--warmup=0", f"--init_from={parts}", "--model.k=3", "--model.route_scale=2.0")
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("note: --init_from: its weights were trained with k=2 (here 3), route_scale=None (here 2.0): "
            "they fit this model's shapes, and this model computes another function of them") in run.stdout, run.stdout[-3000:]
    # a damaged newest checkpoint (its data overwritten, its length kept: a cut one is passed over, as a copy stopped part
    # way): refused, saying how to resume from an earlier one
    data = next((parts / "step_000010").glob("*.distcp"))
    data.write_bytes(bytes(data.stat().st_size))
    run = _train(parts, "--steps=12", "--resume")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "step_000010' could not be read" in run.stderr and (f"--resume starts from the newest checkpoint in {parts}: to resume from an earlier "
                                                              "one, move step_000010 out of it") in run.stderr, run.stderr[-3000:]


def test_deterministic_runs_repeat_bit_for_bit(tmp_path):
    """Three identical runs with 2 threads log identical losses and norms (before F.embedding
    one of three differed in the last bits at step 3)."""
    keys = ("loss", "grad_norm", "mtp_1_loss", "z_loss", "seq_aux_loss", "val_loss")
    logs = []
    for i in range(3):
        run = _train(tmp_path / str(i), "--steps=4", "--seed=7", "--deterministic", "--eval_every=4", threads=2)
        assert run.returncode == 0, run.stderr[-3000:]
        logs.append([[r.get(k) for k in keys] for r in _records(tmp_path / str(i))])
    assert logs[0] == logs[1] == logs[2]
    assert json.loads((tmp_path / "0" / "config.json").read_text())["run"]["deterministic"] is True


def test_compiled_run_matches_eager(tmp_path):
    """--compile: torch.compile of the model (inductor on CPU), forward and backward; the
    losses of a few steps equal eager's within 1e-4 relative (the compiler may reorder float
    sums, so not bit for bit). --model.fp8=true (the attention, MLP and expert GEMMs in fp8,
    fmoe.ops.fp8_matmul) compiles with no more graph breaks, its losses within fp8's few
    percent of the plain ones, the knob kept in config.json."""
    eager = _train(tmp_path / "eager", "--steps=3")
    compiled = _train(tmp_path / "compiled", "--steps=3", "--compile")
    fp8 = _train(tmp_path / "fp8", "--steps=3", "--compile", "--model.fp8=true")
    assert eager.returncode == 0 and compiled.returncode == 0 and fp8.returncode == 0, compiled.stderr[-3000:] + fp8.stderr[-3000:]
    graphs = [re.search(r"torch.compile: (\d+) graphs, (\d+) graph breaks", run.stdout) for run in (compiled, fp8)]
    assert graphs[0] and int(graphs[0][1]) >= 1, compiled.stdout[-2000:]
    assert graphs[1] and graphs[1].groups() == graphs[0].groups(), fp8.stdout[-2000:]
    assert "torch.compile" not in eager.stdout
    for a, b in zip(_records(tmp_path / "eager"), _records(tmp_path / "compiled")):
        for key in ("loss", "mtp_1_loss", "z_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)
        assert b["tokens_per_expert"] == a["tokens_per_expert"]
    for a, b in zip(_records(tmp_path / "compiled"), _records(tmp_path / "fp8")):
        assert math.isfinite(b["loss"]) and b["loss"] != a["loss"]
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-2), (a["step"], a["loss"], b["loss"])
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["config"]["model"]["fp8"] is True


@pytest.mark.skipif(not torch.__version__.startswith("2.13."), reason="the refusal is torch 2.13's (its inductor on CPU), this is torch "
                    + torch.__version__)
def test_compile_with_padding_is_refused_on_the_cpu(tmp_path):
    """torch 2.13's inductor gets the routers' gradients wrong where padding is masked out of
    the routing (tests/ops/test_routing.py): --compile with --whole_documents trained silently
    on them (a router gradient 8% off, the routing apart from eager's from step 2)."""
    run = _train(tmp_path / "run", "--steps=1", "--compile", "--whole_documents=true")
    assert run.returncode == 1 and "--compile with --whole_documents on the CPU: torch 2.13's inductor" in run.stderr, run.stderr[-2000:]


def test_knobs_as_users_type_them(tmp_path):
    # a first trial run: the default warmup (20) adapts to 4 steps, and says so
    run = _train(tmp_path / "short", "--steps=4", "--warmup=-1", "--model.n_groups=2", "--model.topk_groups=1",
                 "--model.capacity_factor=1.5", "--model.capacity_policy=position", "--adamw_state_dtype=bfloat16",
                 "--model.ac=full", "--dtype=bfloat16", "--decay_embeddings=false", "--model.window=16", "--model.window_layers=1",
                 "--model.attn_sinks=true", "--model.o_bias=true", "--model.router_bias=true", "--model.expert_biases=true",
                 "--model.swiglu_alpha=1.702", "--model.swiglu_limit=7", "--model.swiglu_offset=1", "--model.zero_experts=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "warmup 0 steps (a tenth of this short run)" in run.stdout
    assert "of 4 experts and 2 zero experts, top-2" in run.stdout
    # the zero experts' share of each MoE layer's slots is logged; their slots are counted, not dropped
    for r in _records(tmp_path / "short"):
        slots = r["batch_size"] * 128 * 2
        assert [len(row) for row in r["tokens_per_expert"]] == [6] * len(r["zero_fraction"]) and r["zero_experts"] == 2
        assert r["zero_fraction"] == pytest.approx([sum(row[4:]) / slots for row in r["tokens_per_expert"]])
        assert r["dropped_fraction"] == pytest.approx([1 - sum(row) / slots for row in r["tokens_per_expert"]])
    assert any(f > 0 for r in _records(tmp_path / "short") for f in r["zero_fraction"])
    # bf16 compute on one process: float32 master weights through FSDP2 over a group of one
    assert "torch.bfloat16" in run.stdout and all(math.isfinite(r["loss"]) for r in _records(tmp_path / "short"))
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    model = config["config"]["model"]
    assert (model["n_groups"], model["topk_groups"], model["capacity_factor"], model["capacity_policy"], model["ac"]) == (2, 1, 1.5, "position", "full")
    assert (model["window"], model["window_layers"]) == (16, [1])
    assert (model["attn_sinks"], model["o_bias"], model["router_bias"], model["expert_biases"]) == (True,) * 4
    assert (model["swiglu_alpha"], model["swiglu_limit"], model["swiglu_offset"], model["zero_experts"]) == (1.702, 7.0, 1.0, 2)
    assert config["config"]["adamw_state_dtype"] == "bfloat16" and config["warmup"] == 0
    assert (config["dtype"], config["config"]["decay_embeddings"]) == ("torch.bfloat16", False)
    # WSD decays over its last fifth by default (no jump from the peak to min_lr)
    run = _train(tmp_path / "wsd", "--steps=10", "--warmup=0", "--lr_style=wsd", "--wsd_style=cosine", "--min_lr=0.0")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "wsd" / "config.json").read_text())["wsd_decay"] == 2
    lrs = [r["lr"] for r in _records(tmp_path / "wsd")]
    assert lrs[:9] == [pytest.approx(1e-2)] * 9 and lrs[9] == pytest.approx(0.5e-2)  # 0.5 (cos(pi / 2) + 1)


def test_profile_traces_the_steps_asked_for(tmp_path):
    """--profile=2:3: steps 2 and 3 (as logged) in a Chrome trace with the loop's phases,
    and the ops table; the run goes on to its end."""
    run = _train(tmp_path, "--steps=4", "--profile=2:3", "--eval_every=3", "--ckpt_every=3")
    assert run.returncode == 0, run.stderr[-3000:]
    trace, ops = tmp_path / "profile" / "trace_rank0.json", tmp_path / "profile" / "ops_rank0.txt"
    assert f"profile: {trace}, {ops} (each rank writes its own; the trace opens in https://ui.perfetto.dev)" in run.stdout.splitlines()
    assert len(_records(tmp_path)) == 4
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    phases = sorted(n for n in names if n.startswith("fmoe."))  # 2 micro-batches a step in one range; eval and checkpoint at step 3
    assert phases == ["fmoe.checkpoint", "fmoe.eval"] + ["fmoe.forward_backward"] * 2 + ["fmoe.optimizer"] * 2
    assert "aten::mm" in names and "aten::mm" in ops.read_text()
    # resumed from step 4's checkpoint to run on, steps 2:3 were run before it: said, not a run that traces nothing; the
    # refusal leaves metrics.jsonl as it was (a record past the checkpoint, of a run stopped after it, was cut out)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**_records(tmp_path)[-1], "step": 5}) + "\n")
    log = (tmp_path / "metrics.jsonl").read_bytes()
    again = _train(tmp_path, "--steps=6", "--profile=2:3", "--eval_every=3", "--ckpt_every=3", "--resume")
    assert again.returncode != 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert "--profile: steps 2:3 were run before this resume (from step 4); profile steps after it" in again.stderr
    assert (tmp_path / "metrics.jsonl").read_bytes() == log
    with pytest.raises(SystemExit, match=r"^--profile: steps 3:4 were run before this resume \(from step 4\)"):  # its last step too
        _train_moe().main([f"--out_dir={tmp_path}", *TINY, "--steps=6", "--profile=3:4", "--eval_every=3", "--ckpt_every=3", "--resume"])


def test_a_step_that_is_not_finite_stops_the_run_before_its_checkpoint(tmp_path):
    """An absurd learning rate: step 1 (checkpointed) moves the weights to ~1e30 and step 2's
    gradient norm is nan. The run logs step 2, stops without checkpointing it, names the
    intact checkpoint, and exits nonzero; --check_finite=False runs on."""
    bad = ["--lr=1e30", "--min_lr=0", "--warmup=0", "--ckpt_every=1", "--eval_every=100"]
    run = _train(tmp_path / "stop", "--steps=4", *bad)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    message = f"step 2: loss {_records(tmp_path / 'stop')[1]['loss']}, gradient norm nan: not finite"
    assert message in run.stderr and f"The newest checkpoint, {tmp_path / 'stop' / 'step_000001'}, is intact: --resume starts from it" in run.stderr
    assert [r["step"] for r in _records(tmp_path / "stop")] == [1, 2] and _records(tmp_path / "stop")[1]["grad_norm"] is None
    assert sorted(p.name for p in (tmp_path / "stop").glob("step_*")) == ["step_000001"]
    on = _train(tmp_path / "on", "--steps=3", *bad, "--check_finite=False")
    assert on.returncode == 0, on.stderr[-3000:]
    assert len(_records(tmp_path / "on")) == 3
    # the diverged values shown as such: the step lines left them out, and the end said "no validation at this step"
    assert re.search(r"step 3/3 loss nan .*gnorm nan", on.stdout) and "done: step 3, validation loss nan" in on.stdout, on.stdout[-2000:]


def test_a_run_of_a_trillion_steps_plans_its_tokens_at_once(tmp_path):
    """The start's count of the tokens the run reads (its passes over the data) summed the
    batch schedule step by step: --steps=1e12 hung there, --stop_at=1 too. Past the
    schedule's last threshold the rest is one product."""
    try:
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--steps=1000000000000",
                              "--eval_batches=0", "--stop_at=5", "--batch_schedule=0:2 1K:3"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("--steps=1e12 --stop_at=5 did not stop within 300 s")
    assert run.returncode == 0, run.stderr[-3000:]
    # 4 steps of 2 x 128 tokens reach 1K, then 1e12 - 4 steps of 3 x 128
    assert f"the run reads {4 * 256 + (10**12 - 4) * 384:,} tokens" in run.stdout, run.stdout
    assert re.search(r"^stopped: step 5, ", run.stdout, flags=re.M), run.stdout
    # the steps follow the schedule by the tokens seen (not by the step's number)
    records = _records(tmp_path)
    assert [(r["batch_size"], r["tokens"]) for r in records] == [(2, 256), (2, 512), (2, 768), (2, 1024), (3, 1408)]
    # resumed past 1K: the start counts the steps of 3 micro-batches it runs, and the tokens left to read
    run = subprocess.run([*(a for a in run.args if a != "--stop_at=5"), "--resume", "--stop_at=6"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "384 tokens per step now" in run.stdout and f"note: the rest of the run reads {(10**12 - 5) * 384:,} tokens" in run.stdout, run.stdout
    assert [(r["batch_size"], r["tokens"]) for r in _records(tmp_path)][4:] == [(3, 1408), (3, 1792)]


def test_a_resume_whose_schedule_changed_says_so(tmp_path):
    """--resume --steps=N larger than the run's (extending it) rebuilds the schedule from N:
    a cosine run's learning rate went back up at the resume without a word. The run says
    which knobs changed it and from what; a resume on the run's own schedule says nothing."""
    out = tmp_path / "run"
    first = _train(out, "--steps=4", "--eval_batches=0", "--warmup=1", "--stop_at=2")
    assert first.returncode == 0, first.stderr[-3000:]
    # a run --stop_at ends before --steps is stopped, not done (--resume continues it), as a signal or time stop
    assert re.search(r"^stopped: step 2, loss \d+\.\d{4} \(no validation", first.stdout, flags=re.M) and "done:" not in first.stdout, first.stdout
    assert [r["eta_seconds"] > 0 for r in _records(out)] == [True, False]  # the time left to --stop_at, not to --steps
    same = _train(out, "--steps=4", "--eval_batches=0", "--warmup=1", "--stop_at=3", "--resume")
    assert same.returncode == 0 and "resumed from" in same.stdout and "note: step" not in same.stdout, same.stdout
    assert re.search(r"^stopped: step 3, ", same.stdout, flags=re.M), same.stdout
    longer = _train(out, "--steps=8", "--eval_batches=0", "--warmup=1", "--resume")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert re.search(r"^done: step 8, ", longer.stdout, flags=re.M), longer.stdout
    lr = {r["step"]: r["lr"] for r in _records(out)}
    said = re.search(r"^note: step 4 runs at a learning rate of ([\d.e-]+) by this run's schedule, where the run's own gave ([\d.e-]+): "
                     r"--steps=8 \(was 4\); a resumed run follows the schedule of its knobs$", longer.stdout, flags=re.M)
    assert said and float(said.group(1)) == pytest.approx(lr[4], rel=1e-3) and float(said.group(2)) < float(said.group(1)), longer.stdout
    # the default warmup (a tenth of --steps) moved with --steps: named, as the reason the rate fell mid-warmup
    default = tmp_path / "default"
    assert _train(default, "--steps=50", "--eval_batches=0", "--warmup=-1", "--stop_at=2").returncode == 0
    extended = _train(default, "--steps=300", "--eval_batches=0", "--warmup=-1", "--stop_at=3", "--resume")
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert re.search(r"^note: step 3 runs at a learning rate of [\d.e-]+ by this run's schedule, where the run's own gave [\d.e-]+: "
                     r"--steps=300 \(was 50\), warmup 20 steps \(was 5\); a resumed run", extended.stdout, flags=re.M), extended.stdout


def test_the_schedule_s_defaults_are_those_its_knobs_name(tmp_path):
    """--min_lr=-1 is a tenth of --lr and --wsd_decay=-1 a fifth of the steps after the
    warmup (here ceil(10 / 5) = 2 of 12 steps): step n runs at the rate after n - 1 steps,
    so step 12 is halfway down the decay, at lr - (lr - lr / 10) / 2."""
    run = _train(tmp_path, "--steps=12", "--warmup=2", "--lr_style=wsd", "--min_lr=-1", "--eval_batches=0", "--batch_schedule=0:1",
                 "--tokens_per_micro_batch=32")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "config.json").read_text())["wsd_decay"] == 2
    lr = [r["lr"] for r in _records(tmp_path)]
    assert lr == pytest.approx([0.0, 0.005] + [0.01] * 9 + [0.0055]), lr


def test_a_document_that_holds_much_of_the_data_is_named(tmp_path):
    """A corpus concatenated into one file is one document: the sampler shuffles documents,
    so its windows came in order, step after step, without a word. The run says so. So it
    does of top-1 softmax routing after the top-k (allowed for released checkpoints): every
    weight 1, the routers trained by the balance losses alone."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"doc{i}.txt").write_text(f"document {i}: " + "some text. " * 20)
    (data / "all.txt").write_text("a corpus someone concatenated. " * 400)
    top1 = ["--model.k=1", "--model.score=softmax", "--model.expert_bias=false"]  # the softmax over the one chosen logit: weight 1
    run = _train(tmp_path / "run", f"--data={data}", "--steps=3", "--eval_batches=0", *top1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^note: one document \(all\.txt\) holds 9\d% of the training tokens of the data \(\d+ steps of them\): the "
                     r"sampler shuffles documents", run.stdout, flags=re.M), run.stdout
    assert ("note: top-1 softmax routing takes the softmax over the one chosen logit: every weight is 1, and the routers learn from the "
            "balance losses alone (--seq_aux_coeff=0.01, --z_coeff=0.001); --model.pre_softmax=true weighs each token by its softmax over "
            "all the experts (Switch Transformer's)") in run.stdout, run.stdout
    (data / "all.txt").unlink()
    run = _train(tmp_path / "run2", f"--data={data}", "--steps=3", "--eval_batches=0", *top1, "--model.pre_softmax=true")
    assert run.returncode == 0 and "note: one document" not in run.stdout and "note: top-1" not in run.stdout, run.stdout
    # DeepSeek-V4's sqrt(softplus) renormalised over one expert: weight 1 too; without the balance losses nothing trains the routers
    run3 = _train(tmp_path / "run3", f"--data={data}", "--steps=1", "--warmup=0", "--eval_batches=0", "--model.k=1", "--model.score=sqrtsoftplus",
                  "--model.expert_bias=false", "--seq_aux_coeff=0", "--z_coeff=0")
    assert run3.returncode == 0 and ("note: top-1 sqrtsoftplus routing renormalises the one chosen score (--model.route_normalize): every "
                                     "weight is 1, and the routers learn nothing (no balance loss is on); --model.route_normalize=false "
                                     "keeps sqrt(softplus(logit)) as the weight (Megatron's)") in run3.stdout, run3.stdout + run3.stderr[-2000:]
    # TINY's warmup of 3 steps is the whole run: step n trains at the rate after n - 1 steps, so none at --lr
    assert "note: the warmup (3 steps, --warmup) lasts the whole run (--steps=3): no step trains at --lr=0.01 (the last at 0.006667)" in run.stdout
    assert {r["step"]: r["lr"] for r in _records(tmp_path / "run2")}[3] == pytest.approx(0.01 * 2 / 3)


def test_the_time_limit_stops_after_a_step_with_a_checkpoint_and_resume_continues(tmp_path):
    """--stop_after_minutes: a limit already passed at the end of step 1 stops the run there
    (exit 0), with step 1's checkpoint though --ckpt_every is larger; --resume then logs the
    uninterrupted run's losses."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _train(whole, "--steps=4", "--deterministic", "--eval_every=3").returncode == 0
    first = _train(parts, "--steps=4", "--deterministic", "--eval_every=3", "--stop_after_minutes=1e-9")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 1: stopping on the time limit of 1e-09 minutes, with the checkpoint of step 1; --resume continues the run" in first.stdout
    # the last line says the run stopped: "done" (printed before) ended a job loop that resubmits until it is; a stop at a
    # step without validation printed no such line
    assert re.search(r"^stopped: step 1, loss [0-9.]+ \(no validation at this step: every --eval_every=3\)$", first.stdout.splitlines()[-1]), first.stdout
    assert "done:" not in first.stdout and "val_loss" not in _records(parts)[0]
    assert [r["step"] for r in _records(parts)] == [1] and sorted(p.name for p in parts.glob("step_*")) == ["step_000001"]
    from fmoe.train import checkpoint

    weights = torch.cat([p.detach().flatten() for p in checkpoint.load_run(parts / "step_000001")[0].parameters()]).norm().item()
    second = _train(parts, "--steps=4", "--deterministic", "--eval_every=3", "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert re.search(r"^done: step 4, validation loss ", second.stdout, flags=re.M), second.stdout
    assert _records(parts)[1]["param_norm"] == pytest.approx(weights, rel=1e-6)  # step 2's: the weights it computed with, before its update
    keys = ("loss", "grad_norm", "lr", "tokens", "mtp_1_loss")
    assert [[r[k] for k in keys] for r in _records(parts)] == [[r[k] for k in keys] for r in _records(whole)]


def test_a_step_s_speed_leaves_its_validation_out(tmp_path):
    """tokens_per_s (and mfu, energy_j) time the training step: a step that evaluates times
    the validation apart (eval_seconds). It counted it: with 16 validation micro-batches
    beside a step of one, the steps that evaluated read 5-9x slower."""
    run = _train(tmp_path, "--steps=6", "--eval_every=2", "--eval_batches=16", "--batch_schedule=0:1", "--val_percent=30")
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6] and all(r["eval_seconds"] > 0 for r in evals)
    assert not any("eval_seconds" in r for r in records if "val_loss" not in r)
    # each evaluating step's own time, 128 / tokens_per_s, is shorter than its validation's (16 forwards against one
    # forward and backward): had it counted the validation, it would be longer whatever the machine's load. (A comparison
    # with the other steps' speed failed 2 runs in 10 on a loaded machine: single steps of 15-350 ms.)
    assert statistics.median(r["eval_seconds"] * r["tokens_per_s"] / 128 for r in evals) > 1.0, records
    # and the other way: a step of 16 micro-batches beside a validation of one, whose time leaves the step's out
    run = _train(tmp_path / "long_step", "--steps=2", "--warmup=0", "--eval_every=1", "--eval_batches=1", "--batch_schedule=0:16")
    assert run.returncode == 0, run.stderr[-3000:]
    assert min(r["eval_seconds"] * r["tokens_per_s"] / (16 * 128) for r in _records(tmp_path / "long_step")) < 1.0


def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint(tmp_path):
    """SIGTERM (a scheduler's preemption) in the middle of a long run: the step ends, its
    checkpoint is written, the process exits 0."""
    run = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", *TINY, "--steps=1000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the loop has begun: its handlers are in place
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, err[-3000:]
    steps = [r["step"] for r in _records(tmp_path)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 1000
    assert f"step {last}: stopping on SIGTERM, with the checkpoint of step {last}; --resume continues the run" in out
    assert out.splitlines()[-1].startswith(f"stopped: step {last}, "), out[-2000:]  # with its validation loss or the step's loss
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_{last:06d}"]


def test_a_dense_run_upcycled_into_an_moe_starts_from_its_function(tmp_path):
    """--upcycle_from: a dense run's model (hidden, heads, layers, MTP from its config.json)
    made an MoE by the --model.* knobs given; the first step's losses, computed before any
    update, are the dense weights' own (a new run from them, --init_from, logs the same)."""
    dense = _train(tmp_path / "dense", "--steps=3", "--model.n_dense=2")
    assert dense.returncode == 0, dense.stderr[-3000:]
    moe_knobs = ["--model.n_dense=1", "--model.n_experts=4", "--model.k=2", "--model.ffn_expert=32"]  # ffn_dense 64: g = 2
    loop_knobs = [a for a in TINY if not a.startswith("--model.")]  # the model's come from the dense run
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'moe'}", *loop_knobs,
                          "--steps=2", "--warmup=0", f"--upcycle_from={tmp_path / 'dense'}", *moe_knobs], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    # the checkpoint read, not the run directory given (a dense run that goes on would leave its step unknown)
    assert f"upcycled from the dense model of {tmp_path / 'dense' / 'step_000003'}: 4 experts, each a slice of 1/2 of its FFN" in run.stdout
    # without the MoE knobs the dense run's model stays dense: refused, saying which knob makes it an MoE
    forgot = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'forgot'}", *loop_knobs,
                             "--steps=1", f"--upcycle_from={tmp_path / 'dense'}"], capture_output=True, text=True, timeout=900)
    assert forgot.returncode != 0 and "--upcycle_from: the model made from it has no MoE layer: set --model.n_dense below its 2 layers" \
        in forgot.stderr
    # --init_from of the dense run into the MoE model: refused, pointing to --upcycle_from
    wrong = _train(tmp_path / "wrong", "--steps=1", "--warmup=0", f"--init_from={tmp_path / 'dense'}")
    assert wrong.returncode == 1 and wrong.stderr.strip().splitlines()[-1].startswith("--init_from: the model of ")
    assert wrong.stderr.strip().endswith(f"; to start an MoE from a dense run's weights: --upcycle_from={tmp_path / 'dense'}"), wrong.stderr[-2000:]
    same = _train(tmp_path / "same", "--steps=2", "--warmup=0", "--model.n_dense=2", f"--init_from={tmp_path / 'dense'}")
    assert same.returncode == 0, same.stderr[-3000:]
    upcycled, reference = _records(tmp_path / "moe"), _records(tmp_path / "same")
    for key in ("loss", "mtp_1_loss"):
        assert upcycled[0][key] == pytest.approx(reference[0][key], rel=1e-5), key
    assert upcycled[1]["loss"] != pytest.approx(reference[1]["loss"], rel=1e-5)  # then two different models train
    assert "note: --model.capacity_factor" not in run.stdout
    # with a capacity factor the start is not the dense function (its fresh routers crowd the tokens): said at the start
    capped = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path / 'capped'}", *loop_knobs,
                             "--steps=1", "--warmup=0", f"--upcycle_from={tmp_path / 'dense'}", *moe_knobs, "--model.capacity_factor=1.25"],
                            capture_output=True, text=True, timeout=900)
    assert capped.returncode == 0 and "note: --model.capacity_factor=1.25 drops the slots past each expert's capacity, so the upcycled " \
        "model does not start as the dense model's function" in capped.stdout, capped.stdout[-2000:] + capped.stderr[-2000:]
    model = json.loads((tmp_path / "moe" / "config.json").read_text())["config"]["model"]
    assert (model["hidden"], model["n_layers"], model["n_dense"], model["n_experts"], model["ffn_dense"]) == (32, 2, 1, 4, 64)
    assert model["n_heads"] == 2 and model["mtp_depth"] == 1  # the dense run's (TINY's), not the defaults


def test_upcycle_knobs_from_a_folder_and_their_refusals(tmp_path):
    """--upcycle_from of a Hugging Face folder whose family takes no MTP module (MPT's ALiBi): the loop's default MTP depth
    was put into the folder's config before the --model.* knobs, so "not with mtp_depth = 1" stopped the run even with
    --model.mtp_depth=0; now the depth given applies there. A --upcycle_drop that draws round(drop Fe) = 0 channels is
    refused (the start was exact, said to be Drop-Upcycling's); a resume is told where --upcycle_from and --upcycle_drop
    differ from the run's (they change nothing there)."""
    transformers = pytest.importorskip("transformers", reason="transformers (the test extra) not installed")
    transformers.MptConfig(vocab_size=320, d_model=32, n_heads=2, n_layers=2, expansion_ratio=4, max_seq_len=256,
                           no_bias=True).save_pretrained(tmp_path / "mpt")
    tm = _train_moe()
    moe = [f"--upcycle_from={tmp_path / 'mpt'}", "--model.n_dense=1", "--model.ffn_expert=64", "--model.n_experts=8", "--model.k=4"]
    cfg = tm.parse_args([*moe, "--model.mtp_depth=0"])
    assert (cfg.model.mtp_depth, cfg.model.n_experts, cfg.model.hidden, cfg.model.alibi) == (0, 8, 32, True)
    with pytest.raises(SystemExit, match=r"^--upcycle_from: alibi: .*not with mtp_depth = 1"):  # the default's MTP: named
        tm.parse_args(moe)
    assert tm.parse_args([*moe, "--model.mtp_depth=0", "--upcycle_drop=0.016"]).upcycle_drop == 0.016  # round(1.02) = 1 channel
    assert tm.parse_args([*moe, "--model.mtp_depth=0", "--upcycle_drop=0.012"]).upcycle_drop == 0.012  # round(0.77) = 1 channel
    with pytest.raises(SystemExit, match=r"^--upcycle_drop=0.005: draws round\(0.005 x ffn_expert 64\) = 0 of each expert's channels "
                                         r"afresh, so it would have no effect; 0.0156 or more draws one \(0: the exact start\)$"):
        tm.parse_args([*moe, "--model.mtp_depth=0", "--upcycle_drop=0.005"])
    was = {"upcycle_from": str(tmp_path / "mpt"), "upcycle_drop": 0.25}
    same = tm.Config(upcycle_from=str(tmp_path / "x" / ".." / "mpt"), upcycle_drop=0.25)  # the same folder, spelled otherwise
    assert tm._upcycle_changes(was, same) == [] and tm._upcycle_changes("no config", same) == []
    other = tm.Config(upcycle_from=str(tmp_path / "other"), upcycle_drop=0.0)
    assert tm._upcycle_changes(was, other) == [f"--upcycle_from={tmp_path / 'other'} (was {tmp_path / 'mpt'})", "--upcycle_drop=0 (was 0.25)"]


def test_muon_runs(tmp_path):
    run = _train(tmp_path, "--steps=3", "--optimizer=muon")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_records(tmp_path)) == 3


def test_muon_keeps_bf16_adamw_states_and_a_resume_runs_at_its_own_lr(tmp_path):
    """--optimizer=muon's AdamW half (embeddings, norms, the head) keeps the moments in --adamw_state_dtype; a resumed
    run steps with its own --lr and --weight_decay, as it logs them, not the checkpoint's param_groups, and may regroup
    them (--decay_embeddings=false: the embedding and head share the norms' group, saved with another weight decay). The
    knobs of what it trains that differ from the run's are named (a plain --resume of a run started with other knobs
    trained on the defaults without a word); another --optimizer is refused by name (its state is another's)."""
    from torch.distributed.checkpoint import FileSystemReader

    flags = ["--steps=4", "--optimizer=muon", "--adamw_state_dtype=bfloat16", "--ckpt_every=2", "--deterministic"]
    first = _train(tmp_path / "same", *flags, "--stop_at=2")
    assert first.returncode == 0, first.stderr[-3000:]
    stored = FileSystemReader(str(tmp_path / "same" / "step_000002")).read_metadata().state_dict_metadata
    moments = {k: v.properties.dtype for k, v in stored.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert moments and set(moments.values()) == {torch.bfloat16}, moments
    shutil.copytree(tmp_path / "same", tmp_path / "higher")
    same = _train(tmp_path / "same", *flags, "--resume")
    higher = _train(tmp_path / "higher", *flags, "--resume", "--lr=0.1", "--min_lr=1e-2", "--weight_decay=0.5", "--decay_embeddings=false")
    assert same.returncode == 0 and higher.returncode == 0, (same.stderr + higher.stderr)[-3000:]
    assert "note: this resumed run" not in same.stdout
    assert ("note: this resumed run trains with --weight_decay=0.5 (was 0.1), --decay_embeddings=False (was True): a resumed run "
            "trains with the knobs given to it, not the run's; give the run's to keep them") in higher.stdout.splitlines(), higher.stdout
    other = _train(tmp_path / "higher", *flags, "--resume", "--optimizer=adamw", "--steps=8")
    assert other.returncode == 1 and other.stderr.strip().splitlines()[-1] == (
        f"--resume: the run in {tmp_path / 'higher'} trained with --optimizer=muon (here adamw); a resumed run continues its optimizer "
        "state: give the same --optimizer, or start a new run from its weights with --init_from"), other.stderr[-2000:]
    a, b = _records(tmp_path / "same"), _records(tmp_path / "higher")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and b[2]["lr"] == pytest.approx(10 * a[2]["lr"])
    assert b[2]["loss"] == a[2]["loss"]  # step 3's loss is of step 2's weights: the same checkpoint
    assert b[3]["loss"] != pytest.approx(a[3]["loss"], rel=1e-4)  # step 3's update ran at the new lr


# DeepSeek sparse attention (its indexers trained by their own loss) and a mixture of attention heads (its routers balanced)
DSA = ["--model.n_kv_heads=2", "--model.rope_dim=4", "--model.q_rank=10", "--model.kv_rank=6", "--model.v_head_dim=5",
       "--model.index_topk=3", "--model.index_heads=2", "--model.index_head_dim=6", "--model.index_loss_coeff=0.5"]
MOA = ["--model.moa_experts=3", "--model.moa_topk=2", "--model.moa_aux_coeff=0.05"]


@pytest.mark.parametrize("optimizer, bias_update, attention", [("adamw", "proportional", "moa"), ("muon", "sign", "dsa")])
def test_a_step_trains_the_objective_of_its_micro_batches(tmp_path, optimizer, bias_update, attention):
    """The step's objective as SPEC states it, recomputed here from the step's micro-batches
    (the sampler's first two: documents of other lengths, whole, so that the micro-batches
    count other tokens): the language-model and each MTP depth's loss the mean over the
    step's counted tokens (not a mean of the micro-batches' means), the MTP losses weighed
    lambda / D, each balancing loss the mean over the MoE layers and the micro-batches, times
    its own coefficient; the indexers' and attention routers' losses weighed by their
    coefficients over the micro-batches (and the attention blocks). The step runs at lr 0 (the warmup's start), so the checkpoint keeps
    the weights it was computed with, and the optimizer's state holds what the step did with
    the gradient: the logged losses and gradient norm are the objective's, the first moments
    the gradient clipped to --clip, each expert bias moved by the step's counts by the
    --bias_update rule, and the embeddings undecayed (--decay_embeddings=False)."""
    from fmoe import ops
    from fmoe.optim import AdamW, build_optimizers, split_param_groups
    from fmoe.train import checkpoint, metrics
    from fmoe.train.data import BlendSampler, load_blend

    data, rng = tmp_path / "docs", random.Random(0)
    data.mkdir()
    for i in range(24):
        (data / f"d{i:02d}.txt").write_text("".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 110))))
    lam, depth, coeffs, clip, rate, decay = 0.1, 2, {"seq_aux_loss": 0.01, "aux_loss": 0.02, "z_loss": 0.003}, 0.05, 0.03, 0.1
    run = _train(tmp_path / "run", f"--data={data}", "--steps=1", "--warmup=1", "--init_lr=0", "--eval_batches=0", "--whole_documents",
                 f"--model.mtp_depth={depth}", f"--mtp_lambda={lam}", *(f"--{name.removesuffix('_loss')}_coeff={c}" for name, c in coeffs.items()),
                 f"--clip={clip}", f"--bias_rate={rate}", f"--bias_update={bias_update}", f"--weight_decay={decay}", "--decay_embeddings=False",
                 f"--optimizer={optimizer}", "--deterministic", *{"dsa": DSA, "moa": MOA}[attention])
    assert run.returncode == 0, run.stderr[-3000:]
    (record,) = _records(tmp_path / "run")
    assert (record["lr"], record["batch_size"], record["tokens"]) == (0.0, 2, 256)

    model, config = checkpoint.load_run(tmp_path / "run")
    moved = {name: moe.expert_bias.clone() for name, moe in model.moe_layers().items()}
    for moe in model.moe_layers().values():  # the biases the step routed with
        moe.expert_bias.zero_()
    sampler = BlendSampler(load_blend(str(data)), 128, seed=config["config"]["seed"], mtp_depth=depth, whole_documents=True)
    batches = [sampler.next_batch() for _ in range(2)]
    blocks = len(model.moa_attentions())
    model.set_index_loss_weight(model.cfg.index_loss_coeff / 2)  # the indexers' and routers' losses, added in the backward
    model.set_moa_aux_weight(model.cfg.moa_aux_coeff / (blocks * 2) if blocks else 0.0)
    outs, apart = [], {"index_loss": [], "moa_aux_loss": []}
    for batch in batches:
        outs.append(model(batch, model.context(batch)))
        apart["index_loss"].append(model.index_loss_sum())
        apart["moa_aux_loss"].append(model.moa_aux_loss_sum())
    apart = {name: sum(values) / len(values) / (blocks if name == "moa_aux_loss" else 1)
             for name, values in apart.items() if values[0] is not None}
    assert apart.keys() == {"dsa": {"index_loss"}, "moa": {"moa_aux_loss"}}[attention] and blocks == (4 if attention == "moa" else 0)  # 2 blocks, 2 MTP blocks
    tokens = [int(losses["lm_tokens"]) for losses, _ in outs]
    assert sum(tokens) == record["loss_tokens"] and tokens[0] != tokens[1], tokens  # the loop's micro-batches, of other counts
    mean = {"loss": sum(losses["lm_sum"] for losses, _ in outs) / sum(tokens)}
    for d in range(1, depth + 1):
        mean[f"mtp_{d}_loss"] = sum(losses[f"mtp_{d}_sum"] for losses, _ in outs) / sum(losses[f"mtp_{d}_tokens"] for losses, _ in outs)
    terms = {name: [] for name in coeffs}
    for batch, (_, stats) in zip(batches, outs):
        mask = batch["token_mask"]
        for layer in stats.values():  # the trunk's MoE layer and the MTP modules'
            terms["seq_aux_loss"].append(ops.seq_load_balancing_loss(layer["aux_scores"], layer["aux_experts"], batch["cu_seqlens"],
                                                                     k=model.cfg.k, mask=mask))
            terms["aux_loss"].append(ops.load_balancing_loss(layer["aux_scores"], layer["aux_counts"], k=model.cfg.k, n_tokens=mask.sum()))
            terms["z_loss"].append(ops.z_loss(layer["router_logits"], mask=mask))
    assert len(terms["z_loss"]) == 2 * 3
    mean |= {name: sum(values) / len(values) for name, values in terms.items()} | apart
    objective = (mean["loss"] + lam / depth * sum(mean[f"mtp_{d}_loss"] for d in range(1, depth + 1))
                 + sum(c * mean[name] for name, c in coeffs.items()))
    objective.backward()
    for name, value in mean.items():
        assert record[name] == pytest.approx(value.item(), rel=1e-5), name
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = torch.cat([g.flatten() for g in grads.values()]).norm().item()
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5) and norm > 10 * clip
    counts = {name: sum(stats[name]["tokens_per_expert"] for _, stats in outs) for name in moved}
    assert record["tokens_per_expert"] == [counts[name].tolist() for name in moved]  # the trunk's layer, then the MTP blocks'
    assert record["padding_tokens"] == 256 - sum(int(batch["token_mask"].sum()) for batch in batches) > 0
    # the FLOPs of the step's own documents (SPEC 8): keys attended (and the indexers' kept ones) and expert slots computed,
    # each a mean over the step's micro-batches (the slots a mean over the MoE layers, per step token)
    keys = lambda *kept: sum(metrics.mean_attended_keys(batch["cu_seqlens"], *kept) for batch in batches) / 2  # noqa: E731
    slots = sum(sum(c.tolist()) for c in counts.values()) / len(counts) / 256
    assert record["flops_per_token"] == pytest.approx(metrics.model_flops_per_token(
        model.cfg, n_avg_keys=keys(), k=slots, n_avg_index_keys=keys(model.cfg.index_topk) if attention == "dsa" else None), rel=1e-12)
    for name, bias in moved.items():
        assert torch.equal(bias, ops.update_expert_bias(torch.zeros(4), counts[name], rate, proportional=bias_update == "proportional")), name
    if bias_update == "sign":
        assert set(torch.cat(list(moved.values())).abs().tolist()) <= {0.0, float(torch.tensor(rate))}  # +-rate in float32

    # the optimizers as the loop builds them, loaded (into the model holding the recomputed gradients): the step's first
    # moments, and the groups' weight decay as saved
    groups = dict(muon_lr=1.0, adamw_lr=1.0, weight_decay=decay, decay_embeddings=False)
    optimizers = ([AdamW(split_param_groups(model, muon=False, **groups)[1], lr=1.0)] if optimizer == "adamw"
                  else build_optimizers(model, **groups, adamw_cls=AdamW))
    checkpoint.load(tmp_path / "run", model=model, optimizers=optimizers)
    names, factor = {p: name for name, p in model.named_parameters()}, clip / (norm + 1e-6)
    moments = 0
    for opt in optimizers:
        for group in opt.param_groups:
            wanted = 0.0 if {"embed", "head"} & {names[p] for p in group["params"]} or all(p.ndim < 2 for p in group["params"]) else decay
            assert group["weight_decay"] == wanted, [names[p] for p in group["params"]]
            for p in group["params"]:
                state = opt.state[p]
                moment = state["exp_avg"] / (1 - group["betas"][0]) if "exp_avg" in state else state["momentum_buffer"]
                torch.testing.assert_close(moment, grads[names[p]] * factor, rtol=1e-4, atol=1e-9, msg=names[p])
                moments += 1
    assert moments == len(grads)


def test_hashed_moe_layers_train_beside_balanced_ones(tmp_path):
    """DeepSeek-V4's routing: block 1 routes by its table of token ids (no expert bias to update), block 2 by sqrt(softplus)
    scores plus the expert bias the loop moves each step."""
    run = _train(tmp_path, "--steps=3", "--model.n_layers=3", "--model.hash_layers=1", "--model.score=sqrtsoftplus", "--model.route_scale=1.5")
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path)
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert all(len(r["tokens_per_expert"]) == 3 for r in records)  # the counts of both MoE blocks and the MTP block
    model = json.loads((tmp_path / "config.json").read_text())["config"]["model"]
    assert (model["hash_layers"], model["score"], model["route_scale"]) == (1, "sqrtsoftplus", 1.5)


BAD_KNOBS = [
    (["--nope=1"], "unknown argument '--nope=1'; --help lists every knob"),
    (["--stepz=4"], "unknown argument '--stepz=4'; did you mean --steps? --help lists every knob"),
    (["--model.n_expert=3"], "unknown argument '--model.n_expert=3'; did you mean --model.n_experts or --model.ffn_expert"),
    (["warmup=3"], "unknown argument 'warmup=3'; did you mean --warmup?"),
    (["--steps=many"], "--steps: expected an int, got 'many'"),
    (["--model.nope=1"], "unknown argument '--model.nope=1'; did you mean --model.nope_qk_norm or --model.nope_layers or "
                         "--model.nope_temperature_floor?"),
    (["--model.n_groups=x"], "--model.n_groups: expected an int or None, got 'x'"),
    (["--model.n_dense=9"], "model knobs: n_dense: expected 0..n_layers"),
    (["--model.ac=most"], "model knobs: ac: expected one of none, full, attention, experts, got 'most'"),
    (["--model.impl=bogus"], "model knobs: impl: expected one of auto, triton, torch, flex, got 'bogus'"),  # was a traceback at the first forward
    (["--model.fp8_layers=1"], "model knobs: fp8_layers: the blocks whose GEMMs run in fp8, needs fp8=True"),
    (["--model.fp8_fast_accum=true"], "model knobs: fp8_fast_accum: the accumulation of the experts' fp8 GEMMs, needs fp8=True"),
    (["--model.score=softmax"], "--model.score=softmax: the model's expert_bias (on by default, for sigmoid routing) would shift "
                                "softmax's probabilities"),
    (["--compile=maybe"], "--compile: expected a bool, got 'maybe'"),
    (["--train_only=[.index_"], "--train_only='[.index_': not a regular expression"),
    (["--train_only=indexer"], "--train_only='indexer': matches none of the model's trainable parameter names (e.g. 'embed')"),
    (["--model.index_topk=8"], "model knobs: index_topk: DeepSeek sparse attention's indexer reads the q latent of multi-latent attention"),
    (["--dtype=fp8"], "--dtype: expected auto, float32 or bfloat16, got 'fp8'"),
    (["--tp=2", "--tokens_per_micro_batch=255"], "--tokens_per_micro_batch: expected a multiple of --tp = 2, got 255"),
    # context parallel: a linear block's convolution reads linear_conv - 1 = 3 tokens of the chunk before (found up front, not in its forward)
    (["--cp=2", "--tokens_per_micro_batch=8", "--model.linear_layers=0"],
     "--tokens_per_micro_batch: each of the 2 x --cp = 4 chunks must hold the 3 tokens the next chunk's convolution reads "
     "(--model.linear_conv=4): expected at least 12, got 8"),
    # learned positions (GPT-2's): a longer micro-batch stopped in the forward at its first long document, mid-run
    (["--model.abs_positions=64", "--model.mtp_depth=0", "--tokens_per_micro_batch=128"],
     "--tokens_per_micro_batch: expected at most 64 tokens, the model's learned positions (abs_positions): a document of a 128-token "
     "micro-batch can reach past them, got 128"),
    (["--steps"], "--steps: expected --steps=<int>"),
    (["--steps=0"], "--steps: expected an int >= 1, got 0"),
    (["--eval_every=0"], "--eval_every: expected an int >= 1, got 0"),
    (["--ckpt_every=0"], "--ckpt_every: expected an int >= 1, got 0"),
    (["--keep_last=0"], "--keep_last: expected an int >= 1, got 0"),
    (["--eval_batches=-1"], "--eval_batches: expected an int >= 0, got -1"),
    (["--seed=-3"], "--seed: expected an int >= 0, got -3"),
    (["--lr=-1"], "--lr: expected a positive learning rate, got -1.0"),  # not ">= 0", which 0 then contradicts
    (["--lr=nan"], "--lr: expected a finite number, got nan"),
    (["--lr=0"], "--lr: expected a positive learning rate, got 0.0"),
    (["--lr=1e-3", "--min_lr=1e-2"], "--min_lr: expected at most --lr = 0.001, got 0.01"),
    (["--min_lr=-2"], "--min_lr: expected >= 0, or -1 for its default, got -2.0"),
    (["--warmup=-5"], "--warmup: expected >= 0, or -1 for its default, got -5"),
    (["--separator=-5"], "--separator: expected a token id >= 0, or -1 for the token file's index's, got -5"),  # was "separator: required"
    (["--wsd_decay=3"], "--wsd_decay: shapes --lr_style=wsd's final decay; this run's --lr_style is cosine"),  # no effect without a word
    (["--lr_style=linear", "--wsd_style=cosine"], "--wsd_style: shapes --lr_style=wsd's final decay; this run's --lr_style is linear"),
    (["--warmup=0", "--init_lr=1e-4"], "--init_lr: the lr the warmup starts at; --warmup=0 has none (got --init_lr=0.0001)"),
    # the default warmup of a run under 10 steps is none: --init_lr was ignored
    (["--steps=5", "--warmup=-1", "--init_lr=1e-4"], "--init_lr: the lr the warmup starts at; this run of 5 steps has none (the default --warmup is a tenth"),
    (["--lr=1e-3", "--init_lr=0.5"], "--init_lr: the lr the warmup starts at, expected at most --lr = 0.001, got 0.5"),
    (["--lr_style=constant", "--min_lr=1e-4"], "--min_lr: the floor the schedule decays to; --lr_style=constant does not decay (got --min_lr=0.0001)"),
    # kept were the common multiples only: steps 10 and 20 of 5, 10, 15, 20
    (["--ckpt_every=2", "--keep_every=5"], "--keep_every: keeps the checkpoints of its multiples, saved every --ckpt_every=2 steps: expected a "
                                           "multiple of 2, got 5"),
    (["--collective_timeout=1e15"], "--collective_timeout: expected at most a billion days of minutes, got 1e+15"),  # an OverflowError
    (["--model.moe_layers=0,,1"], "--model.moe_layers"),  # read as (0, 1)
    # a feature's knobs without the feature: they trained the model they left out
    (["--model.index_heads=0"], "--model.index_heads=0: a knob of a sparse attention's indexer, needs index_topk, index_topk_blocks or "
                                "csa_layers; this model has none, so it would have no effect"),
    (["--model.yarn_beta_fast=nan"], "--model.yarn_beta_fast=nan: a knob of YaRN's, needs yarn_factor"),
    (["--model.llama3_original_max_positions=-1"], "--model.llama3_original_max_positions=-1: a knob of Llama 3's RoPE scaling, needs llama3_factor"),
    (["--model.compress_rate=7"], "--model.compress_rate=7: a knob of heavily compressed attention, needs compress_layers"),
    (["--model.csa_topk=3"], "--model.csa_topk=3: a knob of compressed sparse attention, needs csa_layers"),
    (["--model.linear_conv=-1"], "--model.linear_conv=-1: a knob of the linear-attention blocks, needs linear_layers"),
    (["--model.query_temperature_scale=0"], "--model.query_temperature_scale=0.0: a knob of the queries' temperature, needs query_temperature_floor"),
    (["--model.nope_temperature_scale=-1"], "--model.nope_temperature_scale=-1.0: a knob of the NoPE blocks' query temperature"),
    (["--model.residual_gate_temperature=1e12"], "--model.residual_gate_temperature=1000000000000.0: a knob of the residual gates, needs residual_gates"),
    (["--model.window=8", "--model.local_rope_base=1e4", "--model.local_rope_dim=0"], "local_rope_dim: expected"),  # 0 was read as unset
    # knobs of features the run lacks: no effect without a word before
    (["--model.mtp_depth=0", "--mtp_lambda=0.5"], "--mtp_lambda: weighs the MTP losses; --model.mtp_depth=0 has none (got --mtp_lambda=0.5)"),
    (["--ns_dtype=float32"], "--ns_dtype: Muon's Newton-Schulz dtype; this run's --optimizer is adamw"),
    (["--model.expert_bias=false", "--bias_rate=0.1"], "--bias_rate: steps the routers' expert bias; this model has none (--model.expert_bias=false)"),
    (["--model.expert_bias=false", "--bias_update=sign"], "--bias_update: steps the routers' expert bias; this model has none"),
    (["--data_dtype=uint16"], "--data_dtype=uint16: applies to token files; this run's data is bytes (text files or the embedded corpus)"),
    (["--separator=7"], "--separator=7: applies to token files; this run's data is bytes"),
    (["--out_dir="], "--out_dir: expected a directory for the run, got ''"),  # the current directory took the run before
    (["--tokens_per_micro_batch=2"], "--tokens_per_micro_batch: expected at least --model.mtp_depth + 2 = 3 (a token and the 2 after it"),
    (["--z_coeff=inf"], "--z_coeff: expected a finite number, got inf"),
    (["--mtp_lambda=-0.1"], "--mtp_lambda: expected a number >= 0, got -0.1"),
    (["--seq_aux_coeff=-1e-2"], "--seq_aux_coeff: expected a number >= 0, got -0.01"),
    (["--bias_rate=-1"], "--bias_rate: expected a number >= 0, got -1.0"),
    (["--weight_decay=-1"], "--weight_decay: expected a number >= 0, got -1.0"),
    (["--clip=0"], "--clip: expected a max norm > 0 (inf: no clipping), got 0.0"),
    (["--clip=nan"], "--clip: expected a finite number (or inf: no clipping), got nan"),
    (["--device=tpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--model.vocab_size=10"], "--model.vocab_size=10: byte data has a vocabulary of 258 (256 bytes, the separator and padding), which "
                                "the model takes; leave the knob out"),
    *([(["--device=cuda:0"], "--device=cuda:0: this torch sees no CUDA device")] if not torch.cuda.is_available() else []),
    (["--warmup=50", "--steps=10"], "warmup: expected at most total=10"),
    (["--data=/no/such/dir"], "data: source 'dir' (/no/such/dir): path: '/no/such/dir' does not exist"),
    # the loader's arguments named as the command line spells them
    ([f"--data={ROOT / 'pyproject.toml'}"], ("separator, vocab_size: required for the token file", "(on this command line: --separator=ID, --model.vocab_size=V)")),
    # the dataset's token count is the running Python's standard library's (857423 in 3.11.7's, 796360 in 3.10.13's)
    (["--eval_batches=100000"], ("--eval_batches=100000: the validation split (5% of the documents) is too small (data: source "
                                 "'stdlib': n_batches: 100000 batches of 128 tokens need 12800000 tokens, the dataset has ",
                                 "); lower --eval_batches (0: no validation) or raise --val_percent")),
    (["--init_from=/no/such/run"], "--init_from: '/no/such/run' does not exist"),
    ([f"--out_dir={ROOT / 'pyproject.toml'}"], f"--out_dir: {ROOT / 'pyproject.toml'} exists and is not a directory"),
    (["--optimizer=sgd", "--steps=1"], "--optimizer: expected adamw or muon"),
    (["--stop_signals=SIGTERM,SIGKILL"], "--stop_signals: signals: expected names of signals a process can catch (e.g. SIGTERM, "
                                         "SIGUSR1), got 'SIGKILL'"),
    (["--upcycle_from=/no/such/run"], "--upcycle_from: path: '/no/such/run' is neither an fmoe run directory"),
    (["--upcycle_from=/no/such/run", "--init_from=/x"], "--upcycle_from: starts from a dense run's weights; --init_from and "
                                                        "--init_from_hf start from others: give one"),
    (["--upcycle_drop=0.5"], "--upcycle_drop: expected a fraction in [0, 1] with --upcycle_from, got 0.5 without it"),
    (["--upcycle_from=/x", "--upcycle_drop=1.5"], "--upcycle_drop: expected a fraction in [0, 1] with --upcycle_from, got 1.5"),
    (["--collective_timeout=-1"], "--collective_timeout: expected minutes >= 0 (0: torch's default), got -1.0"),
    (["--stop_after_minutes=-5"], "--stop_after_minutes: minutes: expected a time limit in minutes >= 0 (0: none), got -5.0"),
    (["--profile=3:2"], "--profile: expected START:END steps with 1 <= START <= END (or one step N), got '3:2'"),
    (["--memory_snapshot"], "--memory_snapshot: records the --profile steps; set --profile=START:END"),
    (["--profile=1", "--memory_snapshot"], "--memory_snapshot: records the CUDA allocator; this run is on cpu"),
    (["--steps=3", "--profile=5:6"], "--profile: steps 5:6 start past the run's last step (--steps=3)"),
    (["--steps=8", "--stop_at=2", "--profile=5:6"], "--profile: steps 5:6 start past the run's last step (--steps=8, --stop_at=2)"),
    # the pipeline's knobs at --pp=1 (they ran without a word)
    (["--pp_schedule=bogus"], "pipeline knobs (--pp_schedule, --pp_virtual, --pp_layers) at --pp=1: pp_schedule: expected one of gpipe"),
    (["--pp_virtual=0"], "at --pp=1: pp_virtual: expected a positive int, got 0"),
    (["--pp_layers=abc"], "--pp_layers: expected comma-separated layer counts like 3,2,2,1, got 'abc'"),
    (["--pp_layers=9,9,9"], "at --pp=1: --pp_layers: expected 1 positive ints (one per stage, pp x pp_virtual) summing to n_layers"),
    (["--pp_layers=2", "--pp_schedule=gpipe"], "--pp_schedule=gpipe, --pp_layers=2: shape a pipeline, and --pp=1 runs none; give --pp (2 or "
                                              "more stages) or leave them out"),
    (["--pp_virtual=2", "--pp_schedule=interleaved_1f1b"], "--pp_schedule=interleaved_1f1b, --pp_virtual=2: shape a pipeline, and --pp=1 "
                                                           "runs none"),
    # counts below their floor, negative loss weights and a negative drop: refused, not run on as something else
    (["--stop_at=-1", "--steps=1"], "--stop_at: expected an int >= 0, got -1"),
    (["--check_replicas_every=-1", "--steps=1"], "--check_replicas_every: expected an int >= 0, got -1"),
    (["--ckpt_every=2", "--keep_every=-4", "--steps=1"], "--keep_every: expected an int >= 0, got -4"),
    (["--val_percent=-5", "--steps=1"], "--val_percent: expected an int >= 0, got -5"),
    (["--aux_coeff=-1", "--steps=1"], "--aux_coeff: expected a number >= 0, got -1.0"),
    (["--z_coeff=-1e-3", "--steps=1"], "--z_coeff: expected a number >= 0, got -0.001"),
    (["--lr_style=wsd", "--wsd_decay=-5", "--steps=1"], "--wsd_decay: expected >= 0, or -1 for its default, got -5"),
    (["--out_dir= ", "--steps=1"], "--out_dir: expected a directory for the run, got ' '"),
    (["--upcycle_from=/no/such/run", "--init_from_hf=/x"], "--upcycle_from: starts from a dense run's weights; --init_from and "
                                                           "--init_from_hf start from others: give one"),
    (["--upcycle_from=/x", "--upcycle_drop=-0.5"], "--upcycle_drop: expected a fraction in [0, 1] with --upcycle_from, got -0.5"),
    (["--cp=2", "--tokens_per_micro_batch=130"], "--tokens_per_micro_batch: expected a multiple of 2 x --cp x --tp = 4, got 130"),
    (["--bias_update=bogus", "--steps=1"], "--bias_update: expected sign or proportional, got 'bogus'"),
    (["--adamw_state_dtype=float16", "--steps=1"], "--ns_dtype, --adamw_state_dtype: expected bfloat16 or float32, got 'bfloat16', 'float16'"),
    # knobs that pass their checks, stopped by a later one: a profile of the last step, no stop signals, chunks of 3 tokens
    (["--steps=3", "--profile=3", "--optimizer=sgd"], "--optimizer: expected adamw or muon, got 'sgd'"),
    (["--stop_signals=", "--optimizer=sgd", "--steps=1"], "--optimizer: expected adamw or muon, got 'sgd'"),
    (["--cp=2", "--tokens_per_micro_batch=12", "--model.linear_layers=0"], "parallel knobs (--pp, --dp_replicate, --dp_shard, --cp, --tp, "
                                                                           "--ep, --etp) for 1 process(es): "),
]


@pytest.fixture(scope="module")
def knob_exits(tmp_path_factory):
    """How `main` stops for each BAD_KNOBS case, then for --help, all in one process
    (tests/exits.py). The command line's own exit: test_a_bad_knob_exits_the_process."""
    out = tmp_path_factory.mktemp("bad")
    return exits(ROOT / "examples" / "train_moe.py", [[f"--out_dir={out}", *TINY, *args] for args, _ in BAD_KNOBS] + [["--help"]])


@pytest.mark.parametrize("case", range(len(BAD_KNOBS)), ids=[" ".join(args).replace(f"{ROOT}/", "") for args, _ in BAD_KNOBS])
def test_bad_knobs_exit_with_a_message(knob_exits, case):
    """Each case's message (or every one of its messages) in what the run printed."""
    got = knob_exits[case]
    assert got["status"] != 0, f"{BAD_KNOBS[case][0]} ran without complaint"
    messages = BAD_KNOBS[case][1]
    for message in (messages,) if isinstance(messages, str) else messages:
        assert message in got["text"], (message, got["text"])


def test_help_lists_every_knob_with_its_type_default_and_comment(knob_exits):
    got = knob_exits[-1]
    assert got["status"] == 0 and got["text"] == "", got["text"]
    listed = re.findall(r"^  --([\w.]+)=<", got["out"], flags=re.M)
    tree = ast.parse((ROOT / "examples" / "train_moe.py").read_text())
    config = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Config")
    knobs = [node.target.id for node in config.body if isinstance(node, ast.AnnAssign) and node.target.id != "model"]
    assert listed == knobs + [f"model.{f.name}" for f in dataclasses.fields(TransformerConfig)]
    assert "  --batch_schedule=<str>  (default '0:2 2M:4')\n      micro-batches per step, by tokens consumed\n" in got["out"]
    assert "  --model.n_groups=<int or None>  (default None)\n" in got["out"] and "  --model.mtp_depth=<int>  (default 1)\n" in got["out"]
    words = " ".join(got["out"].split())  # a comment's next lines are part of it
    assert "(a scheduler's preemption or limit; the same one again within 5 s is the same request, a later one acts as usual); \"\": none --seed=<int> (default 0)" in words
    assert "\nlosses\n  --mtp_lambda=" in got["out"] and "\nparallelism (under torchrun; fmoe.parallel)" in got["out"]
    titles = [line for line in got["out"].splitlines()[1:] if line and not line.startswith("  ")]
    assert titles == ["data", "losses", "optimizer and schedule", "run", "parallelism (under torchrun; fmoe.parallel): world = dp_replicate * "
                      "dp_shard * cp * tp", "the model: every TransformerConfig field, as --model.<field>=value (e.g. --model.n_groups=4); "
                      "fmoe.model.TransformerConfig's docstring says what each does"], titles


def test_a_refused_run_releases_its_out_dir_without_a_garbage_collection(tmp_path):
    """A refusal raised inside an except block (--init_from of no run) left main's frame in a reference cycle with its
    exception, and the out_dir's lock with it: a next run of the same out_dir in the process was refused as "in use"
    until the cyclic garbage collector happened to run (on Python 3.10 and 3.13 the suite's bad-knob cases met it)."""
    script = f"""
import gc, importlib.util, sys
gc.disable()
spec = importlib.util.spec_from_file_location("train_moe", {str(ROOT / "examples" / "train_moe.py")!r})
sys.modules["train_moe"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
out = {str(tmp_path / "run")!r}
for argv in (["--init_from=/no/such/run", f"--out_dir={{out}}"], ["--data=/no/such/dir", f"--out_dir={{out}}"]):
    try:
        module.main(argv)
    except SystemExit as stop:
        print("refused:", stop.code)
    from fmoe.train.run import OutDirLock
    OutDirLock(out).release()  # raises OutDirInUse while the refused run's lock is held
    print("free")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["refused", "free", "refused", "free"], lines
    assert "--init_from: '/no/such/run' does not exist" in lines[0] and "'/no/such/dir' does not exist" in lines[2]


def test_a_bad_knob_exits_the_process(tmp_path):
    """From the command line: a nonzero exit status, the message on stderr, no traceback."""
    run = _train(tmp_path, "--steps=many")
    assert run.returncode != 0 and "--steps: expected an int, got 'many'" in run.stderr and "Traceback" not in run.stderr


def test_default_run_keeps_every_moe_layer_balanced(tmp_path):
    """The first 80 steps of the default run (the default model, data, schedule and balancing
    recipe; only checkpoints and evaluation turned off): no MoE layer collapses. With the
    old recipe (sign bias step 1e-3, sequence aux 1e-4, z-loss 1e-3) three of the four
    layers sat at load max/mean 4.0 (= E / k: one expert takes every token) from about step 25 to 100.
    The default data is the running Python's standard library, so each version trains on its
    own: the mean load max/mean per layer over steps 31-60 and 61-80 was at most 2.09 and 1.81
    on 3.11's, 2.50 and 2.19 on 3.10's, 2.03 and 1.76 on 3.13's, and 3.41 and 2.41 on 3.12's,
    whose third layer balances later (single steps at 4.0 until step 60)."""
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={tmp_path}", "--stop_at=80",
                          "--ckpt_every=1000", "--eval_every=1000"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path)
    assert len(records) == 80 and records[0]["moe_layers"] == ["layer_1", "layer_2", "layer_3", "mtp_1"]
    # each layer: the mean of its load max/mean over steps 31..60 (not collapsed: 4.0) and 61..80 (balanced)
    for i, name in enumerate(records[0]["moe_layers"]):
        for steps, bound in ((range(30, 60), 3.7), (range(60, 80), 3.0)):
            loads = [records[s]["load_max_over_mean"][i] for s in steps]
            assert sum(loads) / len(loads) < bound, (name, steps, [round(x, 2) for x in loads])


def test_a_blend_of_prepared_token_files_trains_from_make_train(tmp_path):
    """The data path of a real run: a tokenizer (trained here, no download), two text
    sources prepared into token files (python -m fmoe.train.prepare), a blend.json with
    weights 3:1, and `make train ARGS=...`: every step logs its tokens per source, the
    sources' micro-batches follow the weights, the plots and TensorBoard files are written."""
    pytest.importorskip("tokenizers", reason="fmoe.train.prepare needs the tokenizers package (the fmoe[data] extra)")
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fmoe.train.data import load_blend

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = {"code": sorted((stdlib / "json").glob("*.py")), "docs": [stdlib / n for n in ("textwrap.py", "string.py", "shlex.py", "glob.py")]}
    texts = [p.read_text(encoding="utf-8") for files in sources.values() for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    for name, files in sources.items():
        for p in files:
            (tmp_path / name / p.name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / p.name).write_text(p.read_text(encoding="utf-8"))
        prep = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(tmp_path / name), str(tmp_path / f"{name}.u16"),
                               f"--tokenizer={tmp_path / 'tokenizer.json'}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert prep.returncode == 0, prep.stderr[-2000:]
    (tmp_path / "blend.json").write_text(json.dumps([{"name": "code", "path": "code.u16", "weight": 3}, {"name": "docs", "path": "docs.u16", "weight": 1}]))
    # no --model.vocab_size: the files' indexes give it (300), not the default of byte data (258)
    args = " ".join([*TINY, f"--data={tmp_path / 'blend.json'}", "--steps=4", "--val_percent=20",
                     "--eval_every=4", "--eval_batches=4", "--tensorboard=True"])
    run = subprocess.run(["make", "-s", "train", f"PY={sys.executable}", f"TRAIN_OUT={tmp_path / 'run'}", f"ARGS={args}"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "source code: weight 0.750" in run.stdout and "source docs: weight 0.250" in run.stdout
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    per_source = {name: sum(r["tokens_by_source"][name] for r in records) for name in ("code", "docs")}
    assert all(sum(r["tokens_by_source"].values()) == 2 * 128 for r in records)
    assert per_source == {"code": 6 * 128, "docs": 2 * 128}  # 8 micro-batches, 3:1
    # validation: 4 batches, 3 from code and 1 from docs; each source's mean, the overall
    # mean between them (their token-weighted mean), and the end line names them
    by_source = records[-1]["val_loss_by_source"]
    assert list(by_source) == ["code", "docs"] and by_source["code"] != by_source["docs"]
    assert min(by_source.values()) < records[-1]["val_loss"] < max(by_source.values())
    val, counted = load_blend(str(tmp_path / "blend.json")).split(20)[1], {}
    for batch, source in zip(val.validation_batches(128, 4, mtp_depth=1), val.validation_sources(4)):
        counted[source] = counted.get(source, 0) + int(batch["loss_mask"].sum())
    assert records[-1]["val_loss"] == pytest.approx(sum(by_source[n] * c for n, c in counted.items()) / sum(counted.values()), rel=1e-5)
    assert f"by source: code {by_source['code']:.4f}, docs {by_source['docs']:.4f}" in run.stdout
    assert f"(bits per token {records[-1]['val_loss'] / math.log(2):.3f})" in run.stdout  # BPE tokens, not bytes
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [s["name"] for s in config["data_sources"]] == ["code", "docs"] and config["vocab_size"] == 300
    separator = json.loads((tmp_path / "code.u16.index.json").read_text())["separator"]  # recorded: a copied run still knows them
    assert all(s["tokenizer"] == str(tmp_path / "tokenizer.json") and s["separator"] == separator for s in config["data_sources"])
    assert all((tmp_path / "run" / f).is_file() for f in ("loss.png", "health.png"))
    assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_prompt_and_response_data_counts_the_responses_only(tmp_path):
    """Data of prompts and responses (prepare --prompt_key): a step whose micro-batch holds
    only prompt tokens logs a loss of 0, not NaN; the validation loss is the loss over the
    responses' tokens alone (evaluate's on the masked batches, not on the same tokens all
    counted). --whole_documents packs each document whole, the rest of its micro-batch
    padding. The token file's small vocabulary prints bits per token, not per byte."""
    pytest.importorskip("tokenizers", reason="fmoe.train.prepare needs the tokenizers package (the fmoe[data] extra)")
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(ROOT / "examples"))
    import evaluate
    import generate

    from fmoe.train.data import load_blend, make_batch

    vocab = {f"w{i}": i for i in range(60)} | {"[UNK]": 60, "<|endoftext|>": 61}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    rng = random.Random(0)
    rows = [{"prompt": " ".join(f"w{rng.randrange(30)}" for _ in range(300)), "response": " ".join(f"w{30 + rng.randrange(30)}" for _ in range(20))}
            for _ in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prep = subprocess.run([sys.executable, "-m", "fmoe.train.prepare", str(tmp_path / "sft.jsonl"), str(tmp_path / "sft.u16"),
                           f"--tokenizer={tmp_path / 'tok.json'}", "--text_key=response", "--prompt_key=prompt"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert prep.returncode == 0, prep.stderr[-2000:]
    run = _train(tmp_path / "run", f"--data={tmp_path / 'sft.u16'}", "--model.vocab_size=62", "--model.mtp_depth=1", "--val_percent=20",
                 "--steps=3", "--eval_every=3", "--eval_batches=12", "--batch_schedule=0:1")
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path / "run")
    # each document is 300 prompt tokens, then 21 counted: the first two micro-batches of 128 tokens count none
    assert [r["lm_loss"] for r in records[:2]] == [0.0, 0.0] and [r["mtp_1_loss"] for r in records[:2]] == [0.0, 0.0]
    assert records[2]["lm_loss"] > 1 and all(math.isfinite(r["loss"]) for r in records)
    # logged: the tokens each step trains on (the third holds the first document's 21) and no padding
    assert [(r["loss_tokens"], r["padding_tokens"]) for r in records] == [(0, 0), (0, 0), (21, 0)]
    assert f"(bits per token {records[-1]['val_loss'] / math.log(2):.3f})" in run.stdout
    model, run_config = evaluate.load_model(tmp_path / "run")
    # a token-file run speaks the tokenizer its data's index names, as prepare encoded (no post-processing), its separator the end
    assert run_config["byte_tokens"] is False
    older = {k: v for k, v in run_config.items() if k != "byte_tokens"}  # a config.json from before byte_tokens: its sources decide
    for config in (run_config, older):
        encode, decode, eos = evaluate.text_codec(tmp_path / "run", model, config)
        assert encode("w1 w2 w40") == [1, 2, 40] and decode([3, 4]) == "w3 w4" and eos == 61
    (tmp_path / "q.jsonl").write_text(json.dumps({"context": "w1 w5", "choices": [" w2", " w3 w4"], "answer": 0}) + "\n")
    choices = lambda: subprocess.run([sys.executable, str(ROOT / "examples" / "evaluate.py"), str(tmp_path / "run"),  # noqa: E731
                                      f"--choices={tmp_path / 'q.jsonl'}", "--json"], capture_output=True, text=True, timeout=300)
    cli = choices()
    assert cli.returncode == 0, cli.stderr[-2000:]
    want, _ = evaluate.choice_logprobs(model, [([1, 5], [2]), ([1, 5], [3, 4])], tokens=1024, device=torch.device("cpu"))
    assert json.loads(cli.stdout)["logprobs"] == [pytest.approx(want, rel=1e-5)]
    # --chat: the template beside the tokenizer; a run stops at its separator and the template's eos_token (the end of a turn)
    prompt = [0, 7, 8, 59, 1]  # as the template below renders --prompt="w7 w8"
    free = generate.generate(model, prompt, tokens=6, eos=61)[len(prompt):]
    end = next(t for t in free[1:] if t < 59)  # a word greedy writes after its first: the template's end of turn
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{end}", "chat_template": (
        "{% for m in messages %}w0 {{ m.content }} w59 {% endfor %}{% if add_generation_prompt %}w1{% endif %}")}))
    chat = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(tmp_path / "run"), "--chat", "--prompt=w7 w8",
                           "--tokens=6"], capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout == decode(free[:free.index(end) + 1]) + "\n" and free.index(end) + 1 < len(free)
    # the tokenizer moved away: texts are refused, not read as bytes
    (tmp_path / "tok.json").rename(tmp_path / "moved.json")
    assert evaluate.text_codec(tmp_path / "run", model, run_config) == (None, None, None)
    cli = choices()
    assert cli.returncode != 0 and "this model has no tokenizer here" in cli.stderr, cli.stderr[-2000:]
    masked = load_blend(str(tmp_path / "sft.u16")).split(20)[1].validation_batches(128, 12, mtp_depth=1)
    every = [make_batch(b["input_ids"], b["cu_seqlens"], 1) for b in masked]  # the same tokens, every label counted
    got, all_counted = (evaluate.evaluate(model, batches, ["sft.u16"] * 12, device=torch.device("cpu")) for batches in (masked, every))
    assert got["tokens"] == sum(int(b["loss_mask"].sum()) for b in masked) < 0.1 * all_counted["tokens"]
    assert got["loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-5)
    assert abs(all_counted["loss"] - records[-1]["val_loss"]) > 1e-3  # far beyond the match above
    # --whole_documents: a micro-batch of 512 tokens holds one document of 321 and padding, never
    # a response cut from its prompt; evaluate.py takes the run's setting and gives its val_loss
    run = _train(tmp_path / "whole", f"--data={tmp_path / 'sft.u16'}", "--model.vocab_size=62", "--model.mtp_depth=1", "--val_percent=20",
                 "--steps=1", "--warmup=0", "--eval_every=1", "--eval_batches=4", "--batch_schedule=0:1", "--tokens_per_micro_batch=512",
                 "--whole_documents=True")
    assert run.returncode == 0, run.stderr[-3000:]
    record = _records(tmp_path / "whole")[0]
    assert record["lm_loss"] > 1
    # the 191 padding tokens are not routed: the trunk's MoE layer and the MTP block's each count
    # the k = 2 slots of the 321 others, none dropped
    assert [sum(c) for c in record["tokens_per_expert"]] == [2 * 321] * 2 and record["dropped_fraction"] == [0.0] * 2
    assert (record["loss_tokens"], record["padding_tokens"]) == (21, 191)  # logged: what the step trained on, and its padding
    # FLOPs count the routed experts at the slots computed, 2 x 321 of 512 tokens' (they counted k = 2 for the padding too)
    from fmoe.train.checkpoint import run_config
    from fmoe.train.metrics import mean_attended_keys, model_flops_per_token

    cfg = run_config(tmp_path / "whole")[0]
    keys = mean_attended_keys([0, 321, 512])
    assert record["flops_per_token"] == pytest.approx(model_flops_per_token(cfg, n_avg_keys=keys, k=2 * 321 / 512), rel=1e-12)
    assert record["flops_per_token"] < model_flops_per_token(cfg, n_avg_keys=keys) - 1
    val = load_blend(str(tmp_path / "sft.u16")).split(20)[1]
    whole = val.validation_batches(512, 4, mtp_depth=1, whole_documents=True)
    assert all(b["cu_seqlens"].tolist() == [0, 321, 512] and int(b["loss_mask"].sum()) == 21 for b in whole)  # 20 response tokens and the separator
    cli = subprocess.run([sys.executable, str(ROOT / "examples" / "evaluate.py"), str(tmp_path / "whole"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["loss"] == pytest.approx(record["val_loss"], rel=1e-5) and json.loads(cli.stdout)["tokens"] == 84
    model, _ = evaluate.load_model(tmp_path / "whole")
    cut = evaluate.evaluate(model, val.validation_batches(512, 4, mtp_depth=1), ["sft.u16"] * 4, device=torch.device("cpu"))
    assert abs(cut["loss"] - record["val_loss"]) > 1e-3


def test_a_corpus_of_one_file_trains_without_validation(tmp_path):
    """--eval_batches=0: no document is held out for validation and none runs, so a directory
    of one text file trains (with validation it cannot: its one document is in one split)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("def add(a, b):\n    return a + b\n" * 100)
    run = _train(tmp_path / "run", f"--data={data}", "--eval_batches=0", "--steps=2", "--warmup=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"data: {data}: 1 documents, 3,201 tokens (no validation: --eval_batches=0)" in run.stdout, run.stdout
    assert re.search(r"^done: step 2, loss \d+\.\d{4} \(no validation: --eval_batches=0\)$", run.stdout, flags=re.M), run.stdout
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and not any("val_loss" in r for r in records)
    assert "passes over the" not in run.stdout  # 512 of 3,201 tokens
    # a corpus smaller than the run: how many times it is read is said (nothing said so)
    (data / "notes.txt").write_text("x = 1\n" * 50)
    run = _train(tmp_path / "small", f"--data={data}", "--eval_batches=0", "--steps=2", "--warmup=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "note: the run reads 512 tokens, 1.7 passes over the 301 training tokens (--steps=2, --batch_schedule='0:2')" in run.stdout, run.stdout


def test_a_blend_of_bytes_and_token_ids_suggests_no_knob(tmp_path):
    """The refusal of a byte source blended with a token source ended "(on this command line:
    --model.vocab_size=V)", which no vocab_size mends: the knob is named only where the
    loader's message names its argument."""
    import numpy as np

    tokens = tmp_path / "t.u16"
    np.array([5, 1, 3, 1], dtype=np.uint16).tofile(tokens)
    (tmp_path / "t.u16.index.json").write_text(json.dumps(dict(documents=2, tokens=4, dtype="uint16", separator=1, vocab_size=10)))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some text")
    got = exits(ROOT / "examples" / "train_moe.py", [[f"--out_dir={tmp_path / 'out'}", *TINY, f"--data=0.5:{tokens},0.5:{tmp_path / 'text'}"]])[0]
    assert got["status"] != 0 and "holds byte tokens (vocab_size 258)" in got["text"], got["text"]
    assert "on this command line" not in got["text"], got["text"]


def test_the_flops_leave_out_the_zero_experts_slots(tmp_path):
    """--model.zero_experts: a token's slots on a zero expert compute nothing; the step's FLOPs count the routed
    experts at the slots the n_experts real ones took (each MoE layer's first n_experts counts), and the start says
    the active parameters per token are at most its count."""
    from fmoe.train import checkpoint, metrics
    from fmoe.train.data import BlendSampler, load_blend

    data, rng = tmp_path / "docs", random.Random(1)
    data.mkdir()
    for i in range(16):
        (data / f"d{i:02d}.txt").write_text("".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 110))))
    run = _train(tmp_path / "run", f"--data={data}", "--steps=1", "--warmup=0", "--eval_batches=0", "--model.zero_experts=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^model: [\d.]+M parameters, at most [\d.]+M active per token \(1 MoE layer and 1 in the MTP module, each of 4 "
                     r"experts and 2 zero experts, top-2\)$", run.stdout, flags=re.M), run.stdout
    (record,) = _records(tmp_path / "run")
    cfg, config = checkpoint.run_config(tmp_path / "run")
    sampler = BlendSampler(load_blend(str(data)), 128, seed=config["config"]["seed"], mtp_depth=cfg.mtp_depth)
    batches = [sampler.next_batch() for _ in range(2)]
    keys = sum(metrics.mean_attended_keys(batch["cu_seqlens"]) for batch in batches) / 2
    rows = record["tokens_per_expert"]
    assert [len(row) for row in rows] == [6, 6] and sum(sum(row[4:]) for row in rows) > 0
    slots = sum(sum(row[:4]) for row in rows) / len(rows) / 256
    assert record["flops_per_token"] == pytest.approx(metrics.model_flops_per_token(cfg, n_avg_keys=keys, k=slots), rel=1e-12)
