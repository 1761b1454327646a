"""examples/train_moe.py end to end on CPU: the loss falls, resume is exact, bad knobs fail."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--hidden=32", "--n_layers=2", "--n_dense=1", "--ffn_dense=64", "--n_experts=4", "--k=2", "--ffn_expert=32",
        "--n_heads=2", "--n_kv_heads=1", "--head_dim=16", "--tokens_per_micro_batch=128", "--batch_schedule=0:2",
        "--eval_every=10", "--eval_batches=2", "--warmup=3", "--lr=1e-2", "--min_lr=1e-3"]


def _train(out_dir, *args):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_moe.py"), f"--out_dir={out_dir}", *TINY, *args],
                         capture_output=True, text=True, timeout=600)
    return run


def _records(out_dir):
    return [json.loads(line) for line in (pathlib.Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_thirty_steps_lower_the_loss(tmp_path):
    run = _train(tmp_path, "--steps=30")
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[0], records[-1]
    assert sum(r["loss"] for r in records[-5:]) / 5 < 0.75 * first["loss"]
    assert records[9]["val_loss"] > last["val_loss"]
    for key in ("loss", "lr", "tokens", "grad_norm", "tokens_per_s", "mtp_1_loss", "seq_aux_loss", "z_loss", "flops_per_token", "tokens_per_expert", "load_cv"):
        assert key in last, key
    assert (tmp_path / "step_000030").is_dir()  # a run always ends with a complete checkpoint


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _train(whole, "--steps=10", "--ckpt_every=100").returncode == 0
    first = _train(parts, "--steps=10", "--stop_at=6", "--ckpt_every=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(parts, "--steps=10", "--resume=True")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_000006" in second.stdout
    keys = ("loss", "grad_norm", "lr", "tokens", "mtp_1_loss")
    assert [[r[k] for k in keys] for r in _records(parts)] == [[r[k] for k in keys] for r in _records(whole)]


def test_muon_runs(tmp_path):
    run = _train(tmp_path, "--steps=3", "--optimizer=muon")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_records(tmp_path)) == 3


@pytest.mark.parametrize("args, message", [
    (["--nope=1"], "unknown argument '--nope=1'"),
    (["--steps=many"], "--steps: expected a int, got 'many'"),
    (["--warmup=50", "--steps=10"], "warmup: expected at most total=10"),
    (["--data=/no/such/dir"], "data: "),
    (["--optimizer=sgd", "--steps=1"], "--optimizer: expected adamw or muon"),
])
def test_bad_knobs_exit_with_a_message(tmp_path, args, message):
    run = _train(tmp_path, *args)
    assert run.returncode != 0 and message in run.stderr
