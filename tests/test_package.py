"""The package's promises: the public API contract of DESIGN.md and a README that runs."""

import inspect
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fmoe
import fmoe.ops
import fmoe.optim
from tests.sessions import run_in_session

ROOT = pathlib.Path(__file__).resolve().parents[1]

# DESIGN.md "The public API contract": positional parameters, then keyword-only ones
CONTRACT = {
    "route": ("logits k", "score pre_softmax n_groups topk_groups expert_bias scale"),
    "drop_by_capacity": ("routes n_experts capacity_factor", "policy"),
    "random_logits": ("logits", ""),
    "aux_scores": ("logits k", "score"),
    "tokens_per_expert": ("experts n_experts", ""),
    "load_balancing_loss": ("scores counts", "k n_tokens"),
    "seq_load_balancing_loss": ("scores experts cu_seqlens", "k"),
    "z_loss": ("logits", ""),
    "update_expert_bias": ("bias counts rate", "center"),
    "permute": ("x experts n_experts", "align"),
    "unpermute": ("y_perm plan weights", ""),
    "grouped_mlp": ("x_perm w_gate w_up w_down offsets", ""),
    "rope_inv_freq": ("dim", "base"),
    "yarn_inv_freq": ("dim", "base factor original_max_positions beta_fast beta_slow"),
    "yarn_mscale": ("factor mscale", ""),
    "yarn_softmax_scale": ("head_dim", "factor mscale_all_dim"),
    "rope_cos_sin": ("positions inv_freq", "scale"),
    "apply_rope": ("x cos sin", "interleaved"),
    "roll_packed": ("x cu_seqlens", "shift dim fill"),
    "positions_from_cu_seqlens": ("cu_seqlens", ""),
    "cross_entropy": ("logits labels", "ignore_index"),
    "linear_cross_entropy": ("h weight labels", "ignore_index"),
    "lr_at": ("step", "max_lr total warmup min_lr init_lr style wsd_decay wsd_style"),
    "batch_size_at": ("tokens_consumed schedule", ""),
}


def test_public_signatures_follow_the_contract():
    for name, (positional, keyword) in CONTRACT.items():
        module = fmoe.optim if hasattr(fmoe.optim, name) else fmoe.ops
        params = inspect.signature(getattr(module, name)).parameters.values()
        pos = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        kw = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
        assert pos == positional.split(), name
        assert kw[: len(keyword.split())] == keyword.split(), name  # extra keywords may follow


def test_readme_examples_run():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 4, "README.md should hold the routing, the torchrun, the fmoe.hf and the MoE block examples"
    scopes = []
    for code in (blocks[0], blocks[3]):
        scopes.append({})
        exec(compile(code, "README.md", "exec"), scopes[-1])
    routing, block = scopes
    # the routing example really ran the losses' backward and the balancing update
    assert routing["bias"].abs().sum() > 0 and routing["logits"].grad is not None
    assert block["y"].shape == (4, 16, 64) and int(block["stats"]["tokens_per_expert"].sum()) == 4 * 16 * 2


def test_readme_hf_example_runs(tmp_path):
    """The README's fmoe.hf example, on a tiny Qwen3-MoE folder written by fmoe itself."""
    import fmoe.hf
    from fmoe.model import Transformer, TransformerConfig

    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[2]
    assert '"path/to/Qwen3-30B-A3B"' in code and '"out/qwen3-tuned"' in code
    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_dense=0, n_experts=4, k=2, ffn_expert=8, n_shared=0,
                            n_heads=2, n_kv_heads=1, head_dim=8, qk_norm="head", score="softmax", expert_bias=False, impl="torch")
    torch.manual_seed(0)
    fmoe.hf.save_pretrained(Transformer(cfg), tmp_path / "in", model_type="qwen3_moe")
    code = code.replace('"path/to/Qwen3-30B-A3B"', repr(str(tmp_path / "in"))).replace('"out/qwen3-tuned"', repr(str(tmp_path / "out")))
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["logits"].shape == (12, 32) and torch.isfinite(scope["logits"]).all()
    assert (tmp_path / "out" / "config.json").exists()
    again, _ = fmoe.hf.from_pretrained(tmp_path / "out")
    assert torch.equal(again.logits(scope["input_ids"], scope["cu_seqlens"]), scope["logits"])


def test_readme_torchrun_example_runs(tmp_path):
    """The README's fmoe.parallel example, under torchrun with 2 gloo processes."""
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    (tmp_path / "demo.py").write_text(code)
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(tmp_path / "demo.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    # the two ranks print concurrently: a line's text and its newline may be written apart
    reports = re.findall(r"rank (\d): grad norm ([\d.]+), tokens per expert \[([\d, ]*)\]", run.stdout)
    assert sorted(rank for rank, _, _ in reports) == ["0", "1"], run.stdout
    assert len({norm for _, norm, _ in reports}) == 1  # every rank reports the same global norm
    counts = [[int(c) for c in text.split(",")] for _, _, text in reports]
    assert counts[0] == counts[1] and sum(counts[0]) == 2 * 32 * 2  # 2 ranks x 32 tokens x k slots


def test_import_fmoe_ops_stays_light():
    """`import fmoe.ops` (what research code imports) brings neither tensordict nor
    torch._dynamo, whose import took 1.3 s of its 3.1 s: mtp_targets imports TensorDict when
    called. The model, the layers and the loop still import it at the top."""
    run = subprocess.run([sys.executable, "-c", "import sys, fmoe.ops; print(sorted(m for m in ('tensordict', 'torch._dynamo') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]
    steps = fmoe.ops.mtp_targets(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 4]), depth=1)
    assert type(steps[1]).__name__ == "TensorDict" and steps[1]["input_ids"].tolist() == [6, 7, 8, 0]


def test_the_files_the_suite_runs_first_exist():
    """tests/conftest.py's longest files, started first under make test's workers, are files
    of the suite (a renamed one would fall back to its place in the order, unsaid)."""
    from tests.conftest import _LONGEST_FIRST

    root = pathlib.Path(__file__).resolve().parents[1]
    assert [path for path in _LONGEST_FIRST if not (root / path).is_file()] == []


def test_the_source_distribution_holds_the_license_and_what_runs_the_tests(tmp_path):
    """The sdist of the tracked files: the LICENSE (BSD-3-Clause as an SPDX expression, the
    form setuptools keeps building), and every tracked file of tests/, examples/,
    benchmarks/ with the Makefile, so that its tests run (only tests/test_*.py of the top
    level were in it, and pytest stopped collecting)."""
    import tarfile

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout.strip():  # an unpacked source distribution: git tracks nothing here
        pytest.skip(f"{ROOT} is not a git checkout, so which files are tracked is unknown: {listed.stderr.strip()[-200:]}")
    tracked = listed.stdout.split()
    src = tmp_path / "src"
    for name in tracked:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"
    built = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    with tarfile.open(tmp_path / "dist" / built.stdout.split()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        info = sdist.extractfile(next(n for n in sdist.getnames() if n.endswith("/PKG-INFO"))).read().decode()
    wanted = {n for n in tracked if n.startswith(("tests/", "examples/", "benchmarks/", "fmoe/"))} | {"LICENSE", "Makefile", "README.md", "SPEC.md", "DESIGN.md"}
    assert wanted <= names, sorted(wanted - names)[:10]
    assert "License-Expression: BSD-3-Clause" in info and "License-File: LICENSE" in info
    assert f"\nVersion: {fmoe.__version__}\n" in info  # the package's own __version__, written once
    assert "Copyright (c)" in (ROOT / "LICENSE").read_text()


def test_build_folders_are_ignored_and_make_clean_removes_them():
    """A wheel built in the checkout leaves build/ (setuptools reuses it: a deleted module stayed in the next wheel),
    dist/ and fmoe.egg-info: git ignores them and `make clean` removes them."""
    made = ["build/lib/fmoe/old.py", "dist/fmoe-0.1.0-py3-none-any.whl", "fmoe.egg-info/PKG-INFO"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *made], cwd=ROOT, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip(f"{ROOT} is not a git checkout: {ignored.stderr.strip()[-200:]}")
    assert ignored.stdout.split() == made
    recipe = subprocess.run(["make", "-n", "clean", "VENV=.venv"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert {"build", "dist", "fmoe.egg-info", ".venv"} <= set(recipe), recipe
