"""fmoe.train.checkpoint: exact round trips, interrupted saves, retention, async saves and
their handles, errors."""

import dataclasses
import errno
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fmoe.optim
from fmoe.layers import MoEConfig
from fmoe.model import MoE
from fmoe.train import checkpoint as ckpt
from tests.sessions import run_in_session

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _build():
    """A MoE block with expert_bias plus a dense head; torch AdamW on the router and the
    head, fmoe AdamW with bf16 moments on the experts."""
    cfg = MoEConfig(n_experts=4, k=2, score="sigmoid")
    model = nn.ModuleDict({"moe": MoE(16, 16, cfg, expert_bias=True), "head": nn.Linear(16, 8)})
    experts = list(model["moe"].experts.parameters())
    rest = [model["moe"].router, *model["head"].parameters()]
    opts = [
        torch.optim.AdamW(rest, lr=1e-2),
        fmoe.optim.AdamW(experts, lr=1e-2, state_dtype=torch.bfloat16, impl="torch"),
    ]
    return model, opts


def _train(model, opts, steps=2):
    for _ in range(steps):
        x = torch.randn(12, 16)
        y, stats = model["moe"](x)
        loss = model["head"](y).square().mean()
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():  # an expert-bias update, as the train loop does
            model["moe"].expert_bias += 1e-3 * torch.sign(stats["tokens_per_expert"].float().mean() - stats["tokens_per_expert"].float())


def _tensors(model, opts):
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, o in enumerate(opts):
        for j, (p, st) in enumerate(o.state.items()):
            for name, v in st.items():
                out[f"opt{i}.{j}.{name}"] = v.clone() if torch.is_tensor(v) else v
    return out


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_round_trip_bit_identical(tmp_path):
    model, opts = _build()
    _train(model, opts)
    assert model["moe"].expert_bias.abs().sum() > 0
    random.random()
    extra = {"step": 2, "lr_schedule": {"max_lr": 1e-2, "style": "wsd"}, "sampler": {"epoch": 1, "offset": 37, "order": [3, 1, 2]},
             "name": "run-α", "rng": ckpt.rng_state()}
    before = _tensors(model, opts)
    handle = ckpt.save(tmp_path, 2, model=model, optimizers=opts, extra=extra)
    assert handle.done() and handle.wait() == tmp_path / "step_000002"
    after_save = (torch.rand(5), random.random(), np.random.rand())

    torch.manual_seed(123)
    random.seed(123)
    fresh, fresh_opts = _build()
    path = ckpt.latest(tmp_path)
    assert path == tmp_path / "step_000002"
    got = ckpt.load(path, model=fresh, optimizers=fresh_opts)
    ckpt.set_rng_state(got["rng"])
    _assert_identical(before, _tensors(fresh, fresh_opts))
    assert fresh["moe"].expert_bias.dtype == torch.float32
    assert fresh_opts[1].state[fresh["moe"].experts.w_up]["exp_avg"].dtype == torch.bfloat16
    assert {k: v for k, v in got.items() if k != "rng"} == {k: v for k, v in extra.items() if k != "rng"}
    for key in ("torch", "numpy"):
        assert str(got["rng"][key]) == str(extra["rng"][key])
    assert got["rng"]["python"] == extra["rng"]["python"]
    assert torch.equal(torch.rand(5), after_save[0]) and random.random() == after_save[1] and np.random.rand() == after_save[2]

    # training goes on identically from the restored state
    torch.manual_seed(7)
    _train(model, opts, 1)
    torch.manual_seed(7)
    _train(fresh, fresh_opts, 1)
    _assert_identical(_tensors(model, opts), _tensors(fresh, fresh_opts))


@pytest.mark.parametrize("before", ["gradients", "a_step_of_some", "a_read_of_the_state", "a_frozen_parameter"])
def test_a_load_replaces_whatever_state_the_optimizers_held(tmp_path, before):
    """DCP reads the entries of the loading optimizers' state, made only for an optimizer
    holding none where no parameter holds a gradient, and only for parameters that require
    one: after a backward (a warm-up step, a probe of the memory), a step in which some
    parameters had no gradient, a read of opt.state[p] (a defaultdict: it adds an empty
    entry) or with a parameter frozen at the load, saved moments were not read, without a
    word, and their next step was a first step's. Every saved entry loads; the gradients are
    left as they were; a frozen parameter stays frozen; a refused load leaves the state."""
    model, opts = _build()
    _train(model, opts)
    before_save = _tensors(model, opts)
    ckpt.save(tmp_path, 2, model=model, optimizers=opts)
    fresh, fresh_opts = _build()
    head, grads = fresh["head"].weight, {}
    if before == "gradients":  # on every parameter: every entry stayed empty
        y, _ = fresh["moe"](torch.randn(12, 16))
        fresh["head"](y).square().mean().backward()
        grads = {name: p.grad.clone() for name, p in fresh.named_parameters()}
        assert all(g.abs().sum() > 0 for g in grads.values())
    elif before == "a_step_of_some":  # the head alone has a gradient
        head.grad = torch.randn_like(head)
        fresh_opts[0].step()
        fresh_opts[0].zero_grad()
        assert len(fresh_opts[0].state) == 1
    elif before == "a_read_of_the_state":
        assert fresh_opts[0].state[head] == {}
    else:
        head.requires_grad_(False)
    other, _ = _build()  # a run of another optimizer kind: its checkpoint is refused, the state left as it was
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    _train(other, [sgd], steps=1)
    ckpt.save(tmp_path / "sgd", 1, model=other, optimizers=[sgd])
    held = _tensors(fresh, fresh_opts)
    with pytest.raises(ValueError, match="optimizers: the checkpoint .* holds no"):
        ckpt.load(tmp_path / "sgd", model=fresh, optimizers=fresh_opts)
    _assert_identical(held, _tensors(fresh, fresh_opts))
    ckpt.load(tmp_path / "step_000002", model=fresh, optimizers=fresh_opts)
    _assert_identical(before_save, _tensors(fresh, fresh_opts))
    assert head.requires_grad == (before != "a_frozen_parameter")
    if grads:
        assert all(torch.equal(p.grad, grads[name]) for name, p in fresh.named_parameters())


def test_a_scheduler_s_initial_lr_loads_as_torch_s_load_state_dict_keeps_it(tmp_path):
    """A torch scheduler puts initial_lr in each group. Loaded into optimizers built before
    their scheduler, it was dropped (DCP reads the knobs the loading groups have): a scheduler
    resumed with last_epoch raised a KeyError, and one built afresh took the decayed lr as its
    base without a word. A scheduler's initial_lr that the checkpoint lacks (saved without
    one) is kept, where it was refused as another optimizer set-up."""
    model, opts = _build()
    sched = torch.optim.lr_scheduler.LambdaLR(opts[0], lambda n: 0.5 ** n)
    for _ in range(2):
        _train(model, opts, 1)
        sched.step()
    ckpt.save(tmp_path / "scheduled", 2, model=model, optimizers=opts)
    fresh, fresh_opts = _build()
    ckpt.load(tmp_path / "scheduled", model=fresh, optimizers=fresh_opts)
    assert [(g["lr"], g["initial_lr"]) for g in fresh_opts[0].param_groups] == [(0.25e-2, 1e-2)]
    assert torch.optim.lr_scheduler.LambdaLR(fresh_opts[0], lambda n: 0.5 ** n, last_epoch=2).base_lrs == [1e-2]
    assert "initial_lr" not in fresh_opts[1].param_groups[0]  # its groups were saved without one
    plain, plain_opts = _build()
    _train(plain, plain_opts)
    ckpt.save(tmp_path / "plain", 2, model=plain, optimizers=plain_opts)
    scheduled, scheduled_opts = _build()
    torch.optim.lr_scheduler.LambdaLR(scheduled_opts[1], lambda n: 0.1)
    ckpt.load(tmp_path / "plain", model=scheduled, optimizers=scheduled_opts)
    assert [(g["lr"], g["initial_lr"]) for g in scheduled_opts[1].param_groups] == [(1e-2, 1e-2)]
    _assert_identical(_tensors(plain, plain_opts), _tensors(scheduled, scheduled_opts))


def _linear_opt(groups, lr=5e-3):
    """nn.Linear(4, 3) with torch AdamW over its weight and bias in `groups`: a list of
    ({names}, knobs) pairs (in a group, the weight before the bias)."""
    model = nn.Linear(4, 3)
    params = dict(model.named_parameters())
    return model, torch.optim.AdamW([{"params": [params[n] for n in sorted(names, reverse=True)], **knobs} for names, knobs in groups], lr=lr)


def test_a_group_of_parameters_saved_with_other_knobs_is_refused_or_keeps_its_own(tmp_path):
    """Optimizer state is saved per parameter name, whatever the grouping: parameters saved in
    groups of other knobs and loaded into one group took the first one's knobs without a word
    (torch's load_state_dict refuses another grouping). Now a ValueError names the knob and
    the parameters, before anything is read; knobs="held" keeps the loading groups' own knobs
    (a trainer that sets its own) and loads the state alone; groups saved apart with the same
    knobs load into one."""
    saved, opt = _linear_opt([({"weight"}, {"lr": 1e-2}), ({"bias"}, {"lr": 1e-3, "weight_decay": 0.5})])
    saved(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    ckpt.save(tmp_path / "apart", 1, model=saved, optimizers=[opt])
    fresh, one_group = _linear_opt([({"weight", "bias"}, {})])
    before = _tensors(fresh, [one_group])
    with pytest.raises(ValueError, match=r"optimizers\[0\]\.param_groups\[0\]: .*weight.*bias.*lr 0\.01 and 0\.001.*weight_decay 0\.01 and 0\.5.*knobs='held'"):
        ckpt.load(tmp_path / "apart", model=fresh, optimizers=[one_group])
    _assert_identical(before, _tensors(fresh, [one_group]))  # the model too: refused before anything was read
    ckpt.load(tmp_path / "apart", model=fresh, optimizers=[one_group], knobs="held")
    assert [(g["lr"], g["weight_decay"]) for g in one_group.param_groups] == [(5e-3, 1e-2)]
    _assert_identical(_tensors(saved, [opt]), _tensors(fresh, [one_group]))
    same, same_opt = _linear_opt([({"weight"}, {"lr": 2e-2}), ({"bias"}, {"lr": 2e-2})])
    same(torch.randn(5, 4)).sum().backward()
    same_opt.step()
    ckpt.save(tmp_path / "same", 1, model=same, optimizers=[same_opt])
    ckpt.load(tmp_path / "same", model=fresh, optimizers=[one_group])
    assert [g["lr"] for g in one_group.param_groups] == [2e-2]
    _assert_identical(_tensors(same, [same_opt]), _tensors(fresh, [one_group]))
    with pytest.raises(ValueError, match="knobs: expected 'saved' or 'held', got 'kept'"):
        ckpt.load(tmp_path / "same", model=fresh, optimizers=[one_group], knobs="kept")


def _two_layer_opts(optimizers):
    """nn.Sequential(Linear(4, 3), Linear(3, 2)) and torch AdamWs over its parameters: a list
    of optimizers, each a list of groups ([names], knobs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    params = dict(model.named_parameters())
    return model, [torch.optim.AdamW([{"params": [params[n] for n in names], **knobs} for names, knobs in groups], lr=5e-3)
                   for groups in optimizers]


W0, W1 = ["0.weight", "0.bias"], ["1.weight", "1.bias"]
REGROUPED = {  # saved optimizers' groups, loaded ones', what the refusal names
    "third_parameter": ([[(W0, {"lr": 1e-2}), (W1, {"lr": 1e-3})]], [[(W0 + W1, {})]],
                        r"optimizers\[0\]\.param_groups\[0\]: .*0\.weight and 1\.weight with other knobs \(lr 0\.01 and 0\.001\)"),
    "betas": ([[(W0[:1], {"betas": (0.9, 0.95)}), (W0[1:] + W1, {})]], [[(W0 + W1, {})]],
              r"optimizers\[0\]\.param_groups\[0\]: .*0\.weight and 0\.bias with other knobs \(betas \(0\.9, 0\.95\) and \(0\.9, 0\.999\)\)"),
    "second_group": ([[(W0[:1], {"lr": 1e-2}), (W0[1:], {"lr": 1e-3}), (W1, {})]], [[(W1, {}), (W0, {})]],
                     r"optimizers\[0\]\.param_groups\[1\]: .*0\.weight and 0\.bias with other knobs \(lr 0\.01 and 0\.001\)"),
    "second_optimizer": ([[(W0, {})], [(W1[:1], {"lr": 1e-2}), (W1[1:], {"lr": 1e-3})]], [[(W0, {})], [(W1, {})]],
                         r"optimizers\[1\]\.param_groups\[0\]: .*1\.weight and 1\.bias with other knobs \(lr 0\.01 and 0\.001\)"),
}


@pytest.mark.parametrize("case", list(REGROUPED))
def test_every_parameter_group_and_knob_of_every_optimizer_is_checked(tmp_path, case):
    """The knobs' check covers every parameter of a group (not the first two), every knob
    (betas too), every group and every optimizer (the train loop's Muon and AdamW)."""
    saved_groups, loaded_groups, said = REGROUPED[case]
    saved, opts = _two_layer_opts(saved_groups)
    saved(torch.randn(5, 4)).square().sum().backward()
    for opt in opts:
        opt.step()
    ckpt.save(tmp_path, 1, model=saved, optimizers=opts)
    fresh, loading = _two_layer_opts(loaded_groups)
    with pytest.raises(ValueError, match=said):
        ckpt.load(tmp_path, model=fresh, optimizers=loading)
    ckpt.load(tmp_path, model=fresh, optimizers=loading, knobs="held")

    def by_name(model, opts):  # each parameter's state, whichever optimizer and group holds it
        names = {p: n for n, p in model.named_parameters()}
        return {f"{names[p]}.{k}": v for opt in opts for p, state in opt.state.items() for k, v in state.items()}

    _assert_identical(by_name(saved, opts), by_name(fresh, loading))
    assert len(by_name(fresh, loading)) == 4 * 3  # step, exp_avg, exp_avg_sq of each


def test_a_parameter_frozen_when_saved_and_trained_now_loads_with_its_groups_knobs(tmp_path):
    """A parameter in no optimizer when saved (frozen then: a pipeline stage that trained
    nothing) has no knobs in the checkpoint: the refusal named another kind of optimizer and
    load_model; it names the parameter and knobs="held", which loads the others' state and
    leaves the parameter without state (its first step a first step)."""
    saved, opt = _linear_opt([({"bias"}, {"lr": 1e-2})])
    saved(torch.randn(5, 4)).sum().backward()
    opt.step()
    ckpt.save(tmp_path, 1, model=saved, optimizers=[opt])
    fresh, both = _linear_opt([({"weight", "bias"}, {})])
    with pytest.raises(ValueError, match=r"holds no param_groups\.weight\.lr, .*these parameters were in no optimizer when it was saved "
                                         r"\(frozen then\?\); load with knobs='held'"):
        ckpt.load(tmp_path, model=fresh, optimizers=[both])
    ckpt.load(tmp_path, model=fresh, optimizers=[both], knobs="held")
    assert fresh.weight not in both.state and torch.equal(both.state[fresh.bias]["exp_avg"], opt.state[saved.bias]["exp_avg"])
    for params in ([fresh.bias], [fresh.weight, fresh.bias]):  # another kind (frozen then too): some knobs of each missing
        with pytest.raises(ValueError, match="these optimizers differ from the saving run's"):
            ckpt.load(tmp_path, model=fresh, optimizers=[torch.optim.SGD(params, lr=1e-2, momentum=0.9)])


def test_ranks_refuse_a_regrouped_load_together_and_load_its_grouping(tmp_path):
    """Under two processes, the knobs' check reads the checkpoint's param_groups with the
    ranks together (a DCP load of its own): both ranks refuse a regrouped load with the same
    message; the saved grouping and knobs="held" load, bit for bit."""
    script = f"""
import torch, torch.distributed as dist
from torch import nn
from fmoe.train import checkpoint as ckpt
dist.init_process_group("gloo")
def say(line):  # each rank's own file: the ranks' stdout interleaves
    with open({str(tmp_path)!r} + f"/rank{{dist.get_rank()}}.txt", "a") as f:
        f.write(line + "\\n")
def build(apart):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    groups = [{{"params": [model.weight], "lr": 1e-2}}, {{"params": [model.bias], "lr": 1e-3}}] if apart else [{{"params": list(model.parameters())}}]
    return model, torch.optim.AdamW(groups, lr=5e-3)
model, opt = build(True)
model(torch.ones(2, 4)).sum().backward()
opt.step()
ckpt.save({str(tmp_path)!r}, 1, model=model, optimizers=[opt])
fresh, one = build(False)
try:
    ckpt.load({str(tmp_path)!r}, model=fresh, optimizers=[one])
except ValueError as err:
    say(f"refused: {{err}}")
ckpt.load({str(tmp_path)!r}, model=fresh, optimizers=[one], knobs="held")
again, apart = build(True)
ckpt.load({str(tmp_path)!r}, model=again, optimizers=[apart])
for o in (one, apart):
    assert all(torch.equal(o.state[q]["exp_avg"], opt.state[p]["exp_avg"]) for p, q in zip(model.parameters(), o.param_groups[0]["params"] + o.param_groups[-1]["params"][-1:]))
say(f"loaded {{[g['lr'] for g in one.param_groups]}} {{[g['lr'] for g in apart.param_groups]}}")
dist.destroy_process_group()
"""
    (tmp_path / "regroup.py").write_text(script)
    run = run_in_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(tmp_path / "regroup.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert said[0] == said[1] and len(said[0]) == 2 and said[0][1] == "loaded [0.005] [0.01, 0.001]", said
    assert said[0][0].startswith("refused: optimizers[0].param_groups[0]: ") and "weight and bias with other knobs (lr 0.01 and 0.001)" in said[0][0]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_save_before_the_first_step_changes_nothing(tmp_path, async_):
    """DCP's get_state_dict makes a fresh optimizer's state by a step at lr 0: a save before the
    first step left step count 1 in the optimizers (both kinds), so every later step's bias
    correction was off by one, in the saving run (0.005 after 3 steps) and in a run resumed
    from it. Both now equal the run that never saved, bit for bit; a checkpoint after a
    step keeps its state (the round trip above)."""
    torch.manual_seed(0)
    model, opts = _build()
    plain_model, plain_opts = _build()
    plain_model.load_state_dict(model.state_dict())
    handle = ckpt.save(tmp_path, 0, model=model, optimizers=opts, async_=async_)
    handle.wait()
    assert all(not o.state for o in opts)
    resumed, resumed_opts = _build()
    _train(resumed, resumed_opts, 1)  # a stepped optimizer loads the saved "no state" too
    ckpt.load(tmp_path / "step_000000", model=resumed, optimizers=resumed_opts)
    assert all(not o.state for o in resumed_opts)
    runs = []
    for m, o in ((plain_model, plain_opts), (model, opts), (resumed, resumed_opts)):
        torch.manual_seed(7)
        _train(m, o, 3)
        runs.append(_tensors(m, o))
    _assert_identical(runs[0], runs[1])
    _assert_identical(runs[0], runs[2])


def test_interrupted_save_leaves_previous_usable(tmp_path, monkeypatch):
    model, opts = _build()
    _train(model, opts, 1)
    ckpt.save(tmp_path, 10, model=model, optimizers=opts, extra={"step": 10})
    good = _tensors(model, opts)
    _train(model, opts, 1)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed midway")

    monkeypatch.setattr(ckpt.dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 20, model=model, optimizers=opts, extra={"step": 20})
    monkeypatch.undo()
    (tmp_path / "step_000030.tmp").mkdir()
    (tmp_path / "step_000030.tmp" / "__0_0.distcp").write_bytes(b"garbage")
    assert (tmp_path / "step_000020.tmp").is_dir()

    assert ckpt.latest(tmp_path) == tmp_path / "step_000010"
    fresh, fresh_opts = _build()
    assert ckpt.load(ckpt.latest(tmp_path), model=fresh, optimizers=fresh_opts) == {"step": 10}
    _assert_identical(good, _tensors(fresh, fresh_opts))

    assert ckpt.latest(tmp_path, delete_partial=True) == tmp_path / "step_000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]
    # a save of a step whose .tmp a killed run left behind replaces it
    ckpt.save(tmp_path, 20, model=model, optimizers=opts)
    assert ckpt.latest(tmp_path) == tmp_path / "step_000020"
    (tmp_path / "step_000030.tmp").mkdir()  # what a killed save left there is not in the new checkpoint (a 4-rank run's extra files)
    (tmp_path / "step_000030.tmp" / "extra_rank3.pt").write_bytes(b"stale")
    ckpt.save(tmp_path, 30, model=model, optimizers=opts)
    assert "extra_rank3.pt" not in {p.name for p in (tmp_path / "step_000030").iterdir()} and not (tmp_path / "step_000030.tmp").exists()


def test_a_save_on_a_full_disk_says_so(tmp_path, monkeypatch):
    """A write that fails with under a MiB free on out_dir's file system: an OSError(ENOSPC)
    naming the step, the space left and what a save needs (torch's own writer said
    "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"); the earlier
    checkpoint stays the newest. With room on the disk the error passes as it is."""
    import collections

    model, opts = _build()
    _train(model, opts, 1)
    ckpt.save(tmp_path, 10, model=model, optimizers=opts)

    def cut(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.dcp, "save", cut)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(OSError, match=rf"no space left to save step_000020 in {tmp_path}: 4,096 bytes free after [\d,]+ bytes of it were "
                                      r"written \(RuntimeError\); the earlier checkpoints are kept, .*--keep_last") as raised:
        ckpt.save(tmp_path, 20, model=model, optimizers=opts)
    assert raised.value.errno == errno.ENOSPC and "unexpected pos" in str(raised.value.__cause__)
    assert ckpt.latest(tmp_path) == tmp_path / "step_000010"
    # over the floor, but under what a checkpoint takes (the newest one's size, less what was written): full too
    monkeypatch.setattr(ckpt, "FULL_DISK_BYTES", 1024)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 2048, 2048))
    assert ckpt._bytes_in(tmp_path / "step_000010") > 4 * 2048
    with pytest.raises(OSError, match=rf"no space left to save step_000020 in {tmp_path}: 2,048 bytes free after") as raised:
        ckpt.save(tmp_path, 20, model=model, optimizers=opts)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.setattr(ckpt, "FULL_DISK_BYTES", 1 << 20)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 0, 10**9))
    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        ckpt.save(tmp_path, 20, model=model, optimizers=opts)
    if sys.version_info >= (3, 11):  # BaseException.add_note
        assert raised.value.__notes__ == [f"fmoe: while saving step_000020 in {tmp_path} (left as step_000020.tmp; the earlier checkpoints are kept)"]
    assert sorted(p.name for p in (tmp_path / "step_000020.tmp").iterdir()) == ["extra_rank0.pt"]  # the write probe removed

    class NoNotes(OSError):  # Python 3.10's exceptions have no add_note: the error passed as an AttributeError
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(ckpt.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(NoNotes(errno.EIO, "an I/O error")))
    with pytest.raises(NoNotes, match="an I/O error"):  # an OSError still, as train_moe catches it
        ckpt.save(tmp_path, 20, model=model, optimizers=opts)
    # DCP's own CheckpointException (a BaseException) from a full disk: named too
    monkeypatch.setattr(ckpt.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(ckpt.CheckpointException("write failed", {})))
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with pytest.raises(OSError, match=r"no space left to save step_000020 .* \(CheckpointException\)"):
        ckpt.save(tmp_path, 20, model=model, optimizers=opts)


def test_a_save_that_cannot_write_for_another_cause_names_it(tmp_path):
    """A save that fails with room on the disk (a disk quota on a shared file system, here a
    file-size limit, whose EFBIG a quota's EDQUOT stands for): torch's writer said "unexpected
    pos 704 vs 598", naming neither the checkpoint nor the cause. Now an OSError of the
    cause's errno naming both; the earlier checkpoint stays the newest."""
    code = ("import resource, sys\n"
            "from tests.train.test_checkpoint import _build, _train, ckpt\n"
            "model, opts = _build(); _train(model, opts, 1)\n"
            f"ckpt.save({str(tmp_path)!r}, 10, model=model, optimizers=opts)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (32768, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
            "try:\n"
            f"    ckpt.save({str(tmp_path)!r}, 20, model=model, optimizers=opts)\n"
            "except OSError as err:\n"
            "    print(err.errno, err, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{errno.EFBIG} [Errno {errno.EFBIG}] cannot write step_000020 in {tmp_path}: File too large (a write of "
                                  "1,048,576 bytes into step_000020.tmp failed as the save did"), done.stdout + done.stderr[-2000:]
    assert ckpt.latest(tmp_path) == tmp_path / "step_000010"


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_step_saved_again_replaces_it(tmp_path, async_):
    """The same step saved twice (a run resumed from before it saves it again): the second
    replaces the first, whole, and no .tmp is left."""
    model, opts = _build()
    _train(model, opts, 1)
    ckpt.save(tmp_path, 5, model=model, optimizers=opts, extra={"v": 1}).wait()
    _train(model, opts, 1)
    second = _tensors(model, opts)
    ckpt.save(tmp_path, 5, model=model, optimizers=opts, extra={"v": 2}, async_=async_).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005"]
    fresh, fresh_opts = _build()
    assert ckpt.load(ckpt.latest(tmp_path), model=fresh, optimizers=fresh_opts) == {"v": 2}
    _assert_identical(second, _tensors(fresh, fresh_opts))


def test_prune_keeps_newest_and_every(tmp_path):
    for step in range(0, 1100, 100):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / ".metadata").write_bytes(b"")
    (tmp_path / "step_001200.tmp").mkdir()
    removed = ckpt.prune(tmp_path, keep_last=2, keep_every=500)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step_000000", "step_000500", "step_000900", "step_001000", "step_001200.tmp"]
    assert len(removed) == 7
    ckpt.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_001000", "step_001200.tmp"]
    # a step_N directory without DCP's .metadata (emptied, half copied) is no checkpoint: latest() skips it and
    # prune() counts only the complete ones (it deleted every good one for it) and leaves it alone
    (tmp_path / "step_001100").mkdir()
    shutil.rmtree(tmp_path / "step_001000")  # a real one now: latest() reads what its .metadata names
    model, opts = _build()
    ckpt.save(tmp_path, 1000, model=model, optimizers=opts, extra={"step": 1000})
    assert ckpt.latest(tmp_path) == tmp_path / "step_001000"
    assert ckpt.prune(tmp_path, keep_last=1) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_001000", "step_001100", "step_001200.tmp"]


def test_a_damaged_checkpoint_file_is_a_value_error(tmp_path):
    """A .distcp file cut short or gone: a ValueError naming the checkpoint and the cause (DCP's
    CheckpointException is a BaseException, which `except Exception` and the loop's `except
    ValueError` let through), from load, load_model and ModelTensors alike; one process's own
    read names no rank (DCP's rank 0 was said on any rank's ModelTensors)."""
    model, opts = _build()
    _train(model, opts, 1)  # optimizer state saved too: the cut falls inside a tensor's record
    path = ckpt.save(tmp_path, 1, model=model, optimizers=opts).wait()
    (shard,) = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    fresh, fresh_opts = _build()
    message = rf"path: '{path}' could not be read \(RuntimeError: PytorchStreamReader failed .*\); a damaged or incomplete checkpoint\?"
    for read in (lambda: ckpt.load(path, model=fresh, optimizers=fresh_opts), lambda: ckpt.load_model(path, model=fresh)):
        with pytest.raises(ValueError, match=message):
            read()
    tensors = ckpt.ModelTensors(path)
    shard.unlink()
    for read in (lambda: ckpt.load_model(path, model=fresh), lambda: tensors["moe.router"]):
        with pytest.raises(ValueError, match=rf"path: '{path}' could not be read \(FileNotFoundError"):
            read()


def test_a_cut_metadata_or_extra_file_is_a_value_error_before_anything_is_loaded(tmp_path):
    """DCP's .metadata cut short (latest() still counts the folder complete): a ValueError from load and load_model, not
    an UnpicklingError; a cut extra_rank0.pt: a ValueError from load before the model or optimizers change."""
    model, opts = _build()
    _train(model, opts)
    path = ckpt.save(tmp_path / "a", 1, model=model, optimizers=opts, extra={"step": 1}).wait()
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    assert ckpt.latest(tmp_path / "a") == path and ckpt.incomplete(path) is None  # left for load to name
    fresh, fresh_opts = _build()
    before = _tensors(fresh, [])
    message = rf"path: '{path}' could not be read \(.metadata: \w+Error.*\); a damaged or incomplete checkpoint\?"
    for read in (lambda: ckpt.load(path, model=fresh, optimizers=fresh_opts), lambda: ckpt.load_model(path, model=fresh)):
        with pytest.raises(ValueError, match=message):
            read()
    path = ckpt.save(tmp_path / "b", 1, model=model, optimizers=opts, extra={"step": 1}).wait()
    extra = path / "extra_rank0.pt"
    extra.write_bytes(extra.read_bytes()[: extra.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"path: '{path}' could not be read \(extra_rank0.pt: RuntimeError.*\); a damaged or incomplete"):
        ckpt.load(path, model=fresh, optimizers=fresh_opts)
    after = _tensors(fresh, fresh_opts)
    _assert_identical({k: after[k] for k in before}, before)  # nothing was read into the model


def test_latest_passes_over_a_folder_missing_files_its_metadata_names(tmp_path):
    """A step_N folder holding .metadata without all its data (a copy stopped part way: rsync
    copies .metadata, which sorts first, before the data) counted as the newest complete
    checkpoint: latest(), load_model of the run's folder, export and --resume chose it and
    failed. latest() takes the newest folder whose files are all there, and incomplete() says
    what the other lacks (passed_over() lists the newer ones latest() passes over); an intact
    one is None."""
    model, opts = _build()
    _train(model, opts)
    good = ckpt.save(tmp_path, 2, model=model, optimizers=opts, extra={"step": 2}).wait()
    want = _tensors(model, [])
    _train(model, opts)

    def cut(path):
        data = path / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:-1])

    for damage, why in ((lambda p: (p / "__0_0.distcp").unlink(), r"__0_0\.distcp is missing"),
                        (cut, r"__0_0\.distcp is (\d+) bytes of the (\d+) its \.metadata names"),
                        (lambda p: (p / "extra_rank0.pt").unlink(), "no extra_rank0.pt")):
        bad = ckpt.save(tmp_path, 4, model=model, optimizers=opts, extra={"step": 4}).wait()
        assert ckpt.latest(tmp_path) == bad and ckpt.incomplete(bad) is None and ckpt.passed_over(tmp_path) == []
        damage(bad)
        assert ckpt.latest(tmp_path) == good and ckpt.passed_over(tmp_path) == [(bad, ckpt.incomplete(bad))]
        said = re.fullmatch(why, ckpt.incomplete(bad))
        assert said and (not said.groups() or int(said[1]) == int(said[2]) - 1), ckpt.incomplete(bad)
        fresh, _ = _build()
        assert ckpt.load_model(tmp_path, model=fresh) == good  # the run's folder: its newest whole checkpoint
        _assert_identical(want, _tensors(fresh, []))
        shutil.rmtree(bad)
    assert ckpt.incomplete(tmp_path / "step_000009") == "no .metadata"
    older = ckpt.save(tmp_path, 1, model=model, optimizers=opts).wait()  # an older damaged one is not passed over: only newer ones are
    (older / "extra_rank0.pt").unlink()
    assert ckpt.latest(tmp_path) == good and ckpt.passed_over(tmp_path) == []


def test_async_save_matches_sync(tmp_path):
    model, opts = _build()
    _train(model, opts)
    ckpt.save(tmp_path / "sync", 5, model=model, optimizers=opts, extra={"step": 5})
    before = _tensors(model, opts)
    handle = ckpt.save(tmp_path / "async", 5, model=model, optimizers=opts, extra={"step": 5}, async_=True)
    _train(model, opts, 1)  # training goes on while the thread writes: the save has a copy
    assert handle.wait() == tmp_path / "async" / "step_000005"
    assert not (tmp_path / "async" / "step_000005.tmp").exists()

    assert handle.done() and handle.wait() == tmp_path / "async" / "step_000005"  # again: at once

    for d in ("sync", "async"):
        fresh, fresh_opts = _build()
        assert ckpt.load(tmp_path / d / "step_000005", model=fresh, optimizers=fresh_opts) == {"step": 5}
        _assert_identical(before, _tensors(fresh, fresh_opts))


def _names(out_dir):
    return sorted(p.name for p in out_dir.iterdir())


def test_async_saves_one_in_flight_through_previous(tmp_path):
    """The caller keeps the handles: save(previous=h) completes h before starting; a save
    not waited on stays `.tmp` (ignored by latest) until its wait(); no module state."""
    assert not hasattr(ckpt, "wait") and not hasattr(ckpt, "_PENDING")
    model, opts = _build()
    _train(model, opts, 1)
    with warnings.catch_warnings(record=True) as said:  # what DCP's background writers say too
        h6 = ckpt.save(tmp_path, 6, model=model, optimizers=opts, async_=True)
        assert (tmp_path / "step_000006.tmp").is_dir()
        h7 = ckpt.save(tmp_path, 7, model=model, optimizers=opts, async_=True, previous=h6)
        # h6 was waited on before the second save began: complete and renamed
        assert h6.done() and "step_000006" in _names(tmp_path) and "step_000006.tmp" not in _names(tmp_path)
        deadline = time.monotonic() + 60
        while not h7.done() and time.monotonic() < deadline:  # the writer finishes, nobody waits
            time.sleep(0.01)
        assert h7.done(), "the background writer did not finish in 60 s"
        assert "step_000007.tmp" in _names(tmp_path)
        assert ckpt.latest(tmp_path) == tmp_path / "step_000006"
        assert h7.wait() == tmp_path / "step_000007"
        assert ckpt.latest(tmp_path) == tmp_path / "step_000007"
        # a sync save's handle is done already; passing it as previous is a no-op
        h8 = ckpt.save(tmp_path, 8, model=model, optimizers=opts, previous=h7)
        assert h8.done() and h8.wait() == tmp_path / "step_000008"
        ckpt.save(tmp_path, 9, model=model, optimizers=opts, previous=h8)
        assert _names(tmp_path) == ["step_000006", "step_000007", "step_000008", "step_000009"]
        fresh, fresh_opts = _build()
        ckpt.load(tmp_path / "step_000007", model=fresh, optimizers=fresh_opts)
        _assert_identical(_tensors(model, opts), _tensors(fresh, fresh_opts))
    assert not [str(w.message) for w in said if "torch.distributed is disabled" in str(w.message)]  # one process is meant


def test_bad_inputs(tmp_path):
    model, opts = _build()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        ckpt.save(a_file, 1, model=model, optimizers=opts)
    with pytest.raises(ValueError, match="out_dir"):
        ckpt.latest(a_file)
    with pytest.raises(ValueError, match="step"):
        ckpt.save(tmp_path, -1, model=model, optimizers=opts)
    with pytest.raises(ValueError, match="optimizers"):
        ckpt.save(tmp_path, 1, model=model, optimizers=[model])
    with pytest.raises(ValueError, match=r"^optimizers: expected a list of torch.optim.Optimizer \(\[\] for none\), got NoneType"):
        ckpt.save(tmp_path, 1, model=model, optimizers=None)
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters())  # DCP's KeyError 0 before
    with pytest.raises(ValueError, match=r"^optimizers\[2\]: its parameters are not all the model's"):
        ckpt.save(tmp_path / "own", 1, model=model, optimizers=[*opts, other])
    assert not (tmp_path / "own").exists()  # refused before anything is written
    ckpt.save(tmp_path / "own", 1, model=model, optimizers=opts)
    with pytest.raises(ValueError, match=r"^optimizers\[2\]: its parameters are not all the model's"):
        ckpt.load(tmp_path / "own" / "step_000001", model=model, optimizers=[*opts, other])
    with pytest.raises(ValueError, match="extra"):
        ckpt.save(tmp_path, 1, model=model, optimizers=opts, extra=[1])
    with pytest.raises(ValueError, match="previous: expected the SaveHandle"):
        ckpt.save(tmp_path, 1, model=model, optimizers=opts, previous=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load(tmp_path / "missing", model=model, optimizers=opts)
    (tmp_path / "step_000001").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load(tmp_path / "step_000001", model=model, optimizers=opts)
    with pytest.raises(ValueError, match="keep_last"):
        ckpt.prune(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        ckpt.prune(tmp_path, keep_last=1, keep_every=0)
    with pytest.raises(ValueError, match="state"):
        ckpt.set_rng_state({})
    assert ckpt.latest(tmp_path / "nothing_here") is None
    hf_folder = tmp_path / "hf"  # a config.json, not an fmoe run's
    hf_folder.mkdir()
    (hf_folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    for read in (ckpt.run_config, ckpt.load_run):
        with pytest.raises(ValueError, match=r"path: .*config.json' is not an fmoe run's config .*a Hugging Face folder: fmoe.hf.from_pretrained"):
            read(hf_folder)
    (hf_folder / "config.json").write_text('{"config": ')  # a torn file: named, not a bare JSONDecodeError
    with pytest.raises(ValueError, match=r"path: '.*config.json' is not valid JSON \(JSONDecodeError: Expecting value"):
        ckpt.run_config(hf_folder)
    (hf_folder / "config.json").write_text('[1, 2]')
    with pytest.raises(ValueError, match=r"path: '.*config.json' is not an fmoe run's config \(no config.model and vocab_size\)"):
        ckpt.run_config(hf_folder)  # an AttributeError


def test_load_model_takes_the_weights_only(tmp_path):
    """--init_from: the weights and the expert bias come back bit for bit, from a checkpoint
    or from a run's out_dir (its newest checkpoint); the optimizers stay fresh."""
    model, opts = _build()
    saved = {}
    for step in (1, 2):
        _train(model, opts)
        ckpt.save(tmp_path, step, model=model, optimizers=opts, extra={"step": step})
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    for path, step in ((tmp_path, 2), (tmp_path / "step_000001", 1)):
        torch.manual_seed(step + 10)
        fresh, fresh_opts = _build()
        assert ckpt.load_model(path, model=fresh) == tmp_path / f"step_{step:06d}"
        assert all(not o.state for o in fresh_opts)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, saved[step][k]), (step, k)
    assert fresh["moe"].expert_bias.abs().sum() > 0  # the buffer came back too
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_model(tmp_path / "nope", model=fresh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        ckpt.load_model(tmp_path / "empty", model=fresh)
    (tmp_path / "empty" / "step_000003.tmp").mkdir()  # a run whose one save was cut: the run holds none, not "is not one"
    with pytest.raises(FileNotFoundError, match=r"path: '.*empty' holds no complete checkpoint \(a step_N folder with its .metadata\)"):
        ckpt.load_model(tmp_path / "empty", model=fresh)
    # a run before its first save, and its config.json itself: said so ("is not a complete checkpoint (no .metadata)" before)
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"^path: '.*started' is a run that has saved no checkpoint yet \(no step_N folder beside"):
        ckpt.load_model(tmp_path / "started", model=fresh)
    with pytest.raises(FileNotFoundError, match=r"^path: '.*config.json' is a file; expected a run's folder or one of its step_N"):
        ckpt.load_model(tmp_path / "started" / "config.json", model=fresh)


def test_a_model_of_other_knobs_is_refused_by_name_before_anything_is_read(tmp_path):
    """load_model and load on a model whose parameters differ in shape from the saved ones
    (or are not saved): a ValueError naming them, and, for a run's checkpoint, the knobs in
    which the saving run's config.json differs; the model keeps its values."""
    import json

    from fmoe.model import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1, head_dim=8)
    model = Transformer(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save(tmp_path, 1, model=model, optimizers=[opt])
    other = Transformer(TransformerConfig(**{**cfg.__dict__, "zero_experts": 2}))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    shapes = r"blocks.1.mlp.router \(saved \[4, 16\], here \[6, 16\]\), blocks.1.mlp.expert_bias \(saved \[4\], here \[6\]\)"
    with pytest.raises(ValueError, match=rf"path: the model of '.*step_000001' differs from this one: {shapes}; build the model"):
        ckpt.load_model(tmp_path, model=other)
    with pytest.raises(ValueError, match="differs from this one: blocks.1.mlp.router"):
        ckpt.load(tmp_path / "step_000001", model=other, optimizers=[torch.optim.SGD(other.parameters(), lr=0.1)])
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    # in a run directory: the saving run's knobs that differ are named too
    run = {"config": {"model": {n: v for n, v in cfg.__dict__.items() if n not in ("impl", "vocab_size")}}, "vocab_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"\[6\]\); the saving run's model has zero_experts=0 \(here 2\); build"):
        ckpt.load_model(tmp_path, model=other)
    # parameters the checkpoint lacks: the first four named, the rest counted
    with pytest.raises(ValueError, match=r"mtp\.0\.\S+ \(not saved\), .* and \d+ more; the saving run's model has mtp_depth=0 \(here 1\)"):
        ckpt.load_model(tmp_path, model=Transformer(TransformerConfig(**{**cfg.__dict__, "mtp_depth": 1})))


def test_a_model_of_one_s_own_refused_with_the_run_s_own_knobs_is_told_to_build_its_class(tmp_path):
    """A subclass with a module of its own, saved in a run directory, loaded into the
    Transformer its config builds (checkpoint.load_run's way): the refusal said "build the
    model with the saved one's knobs", which are these; it now says to build its own class."""
    import json

    from fmoe.model import Transformer, TransformerConfig

    class Probed(Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.router_probe = torch.nn.Linear(cfg.hidden, 1)

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1, head_dim=8)
    own = Probed(cfg)
    ckpt.save(tmp_path, 1, model=own, optimizers=[torch.optim.SGD(own.parameters(), lr=0.1)])
    run = {"config": {"model": {n: v for n, v in cfg.__dict__.items() if n not in ("impl", "vocab_size")}}, "vocab_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"router_probe.weight \(saved, not in this model\), router_probe.bias \(saved, not in this model\); "
                                         r"the saving run's model has these knobs: build it as its own class \(checkpoint.run_config\(path\), "
                                         r"then load_model\(path, model=YourModel\(cfg\)\)\)$"):
        ckpt.load_model(tmp_path, model=Transformer(cfg))
    saved_cfg, _ = ckpt.run_config(tmp_path)
    again = Probed(saved_cfg)
    assert ckpt.load_model(tmp_path, model=again) == tmp_path / "step_000001"
    assert all(torch.equal(v, own.state_dict()[k]) for k, v in again.state_dict().items())


def test_a_model_lacking_saved_parameters_is_refused_by_name_before_anything_is_read(tmp_path):
    """Saved with 3 layers and an MTP module, loaded into a model with fewer layers or none:
    load_model and load name the saved tensors the model lacks (four, the rest counted) and
    the knobs, and read nothing. A pipeline chunk holds its stages' blocks alone: it loads
    its part, and is refused as the whole model of its config would be (the same on every
    rank, whichever stages it holds)."""
    import json

    from fmoe.model import PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=3, n_dense=1, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1,
                            head_dim=8, mtp_depth=1)
    model = Transformer(cfg)
    model.reset_parameters(seed=1)
    ckpt.save(tmp_path, 1, model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    path = tmp_path / "step_000001"
    for knob, lacked in (("mtp_depth", r"mtp\.0\.\S+ \(saved, not in this model\), .* and 13 more"),
                         ("n_layers", r"blocks\.2\.\S+ \(saved, not in this model\), .* and 10 more")):
        other = Transformer(TransformerConfig(**{**cfg.__dict__, knob: getattr(cfg, knob) - 1}))
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(ValueError, match=rf"path: the model of '.*step_000001' differs from this one: {lacked}; build the model"):
            ckpt.load_model(tmp_path, model=other)
        with pytest.raises(ValueError, match=lacked):
            ckpt.load(path, model=other, optimizers=[torch.optim.SGD(other.parameters(), lr=0.1)])
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    run = {"config": {"model": {n: v for n, v in cfg.__dict__.items() if n not in ("impl", "vocab_size")}}, "vocab_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"13 more; the saving run's model has mtp_depth=1 \(here 0\); build"):
        ckpt.load_model(tmp_path, model=Transformer(TransformerConfig(**{**cfg.__dict__, "mtp_depth": 0})))
    # pipeline chunks: stage 0 of 2 (blocks 0 and 1, the embedding) loads its part of the whole model's checkpoint
    chunk = pipeline_chunk(Transformer(cfg), PipelineChunk(0, 2, range(2)))
    saved = model.state_dict()
    assert not torch.equal(chunk.blocks[1].attn.wq, saved["blocks.1.attn.wq"])  # another seed's values until loaded
    assert ckpt.load(path, model=[chunk], optimizers=[torch.optim.SGD(chunk.parameters(), lr=0.1)]) == {}
    assert ckpt.load_model(path, model=[chunk]) == path
    assert all(torch.equal(v, saved[k]) for k, v in chunk.state_dict().items())
    # ... and stage 0 of a model without the MTP module (which the last stage would hold) is refused as well
    chunk = pipeline_chunk(Transformer(TransformerConfig(**{**cfg.__dict__, "mtp_depth": 0})), PipelineChunk(0, 2, range(2)))
    with pytest.raises(ValueError, match=r"differs from this one: mtp\.0\.\S+ \(saved, not in this model\)"):
        ckpt.load_model(path, model=[chunk])


def test_optimizers_of_another_kind_are_refused_by_name_before_anything_is_read(tmp_path):
    """Saved with AdamW, loaded into SGD with momentum: a ValueError naming the state the
    checkpoint lacks (DCP's own error is a BaseException), the weights untouched; saved with
    no optimizers: a ValueError saying so."""
    model, opts = _build()
    _train(model, opts)
    ckpt.save(tmp_path, 1, model=model, optimizers=opts)
    other, _ = _build()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    sgd = [torch.optim.SGD(other.parameters(), lr=1e-2, momentum=0.9)]
    with pytest.raises(ValueError, match=r"optimizers: the checkpoint .*step_000001' holds no state\..*momentum_buffer.*: these optimizers "
                                         r"differ from the saving run's"):
        ckpt.load(tmp_path / "step_000001", model=other, optimizers=sgd)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    ckpt.load_model(tmp_path / "step_000001", model=other)  # the weights alone still load
    assert torch.equal(other["head"].weight, model["head"].weight)
    # saved with no optimizer at all: said so (it named 100 param_groups entries as if the kind differed)
    ckpt.save(tmp_path, 2, model=model, optimizers=[])
    with pytest.raises(ValueError, match=r"^optimizers: the checkpoint .*step_000002' holds no optimizer state \(saved with optimizers=\[\]\): "
                                         r"load it with optimizers=\[\], or load_model for the weights alone$"):
        ckpt.load(tmp_path / "step_000002", model=other, optimizers=sgd)


def test_model_tensors_reads_each_tensor_of_a_checkpoint_when_asked(tmp_path):
    """ModelTensors: the saved model's full tensors by name (a run's out_dir or a step
    directory), read one at a time, each in its saved dtype (bf16 weights, a hashed layer's
    int64 table with an id past float32's 2^24: read as float32 it came back rounded); an
    unknown name is a KeyError."""
    from fmoe.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1,
                                          head_dim=8, mtp_depth=1, hash_layers=1))
    model.reset_parameters(seed=4)
    model.to(torch.bfloat16)
    table = model.blocks[1].mlp.hash_table  # block 0 is dense
    table[0, 0] = 2**24 + 1
    assert table.dtype == torch.int64 and {v.dtype for v in model.state_dict().values()} >= {torch.bfloat16, torch.int64}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save(tmp_path, 3, model=model, optimizers=[opt])
    want = model.state_dict()
    for path in (tmp_path, tmp_path / "step_000003"):
        tensors = ckpt.ModelTensors(path)
        assert sorted(tensors) == sorted(want) and len(tensors) == len(want)
        for name, value in want.items():
            got = tensors[name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
    with pytest.raises(KeyError):
        tensors["blocks.9.attn.wq"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.ModelTensors(tmp_path / "nope")


def _used_and_unused():
    """A Linear that trains and one that never gets a gradient (an indexer whose loss is off, an
    MTP head of weight 0): torch's AdamW keeps no state for the second."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, parts=("used",)):
    sum(model[name](torch.randn(3, 4)).square().sum() for name in parts).backward()
    opt.step()
    opt.zero_grad()


def test_parameters_without_state_load_without_state(tmp_path):
    """A load refused the saving run's own optimizer when some parameters never had a gradient
    (no state saved for them; a fresh optimizer's lr-0 step gives every parameter state).
    They load without state, as they were saved, so a later first step of theirs counts 1;
    another setting of the optimizer (amsgrad) is still refused by name."""
    model, opt = _used_and_unused()
    torch.manual_seed(1)
    _step(model, opt)
    _step(model, opt)
    ckpt.save(tmp_path, 2, model=model, optimizers=[opt])
    resumed, resumed_opt = _used_and_unused()
    ckpt.load(tmp_path / "step_000002", model=resumed, optimizers=[resumed_opt])
    assert {id(p) for p in resumed_opt.state} == {id(p) for p in resumed["used"].parameters()}
    _assert_identical(_tensors(model, [opt]), _tensors(resumed, [resumed_opt]))
    compiled, compiled_opt = _used_and_unused()  # under torch.compile's wrapper (its parameters' names hold _orig_mod) alike
    ckpt.load(tmp_path / "step_000002", model=torch.compile(compiled), optimizers=[compiled_opt])
    assert {id(p) for p in compiled_opt.state} == {id(p) for p in compiled["used"].parameters()}
    runs = []
    for m, o in ((model, opt), (resumed, resumed_opt)):
        torch.manual_seed(7)
        _step(m, o, ("used", "unused"))  # the unused part's first step
        runs.append(_tensors(m, [o]))
    _assert_identical(*runs)
    assert resumed_opt.state[resumed["unused"].weight]["step"] == 1
    other, _ = _used_and_unused()
    amsgrad = torch.optim.AdamW(other.parameters(), lr=1e-2, amsgrad=True)
    with pytest.raises(ValueError, match=r"optimizers: the checkpoint .*step_000002' holds no state\.used\.weight\.max_exp_avg_sq, "
                                         r"state\.used\.bias\.max_exp_avg_sq: these optimizers differ from the saving run's"):
        ckpt.load(tmp_path / "step_000002", model=other, optimizers=[amsgrad])


def _two_parts():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model["a"].parameters(), lr=1e-2), torch.optim.AdamW(model["b"].parameters(), lr=1e-2)


def test_an_optimizer_saved_before_its_first_step_loads_without_state_in_any_order(tmp_path):
    """The optimizers saved before their first step were recorded by their place in the list:
    loaded in another order (or another pipeline split), the stepped one lost its moments and
    the other got the lr-0 step's state. Each parameter now loads the state saved for it, or
    none. An older checkpoint's record (fresh_optimizers.json) still reads by place."""
    model, a, b = _two_parts()
    _step(model, b, ("b",))
    ckpt.save(tmp_path, 1, model=model, optimizers=[a, b])
    assert not a.state and len(b.state) == 2
    resumed, a2, b2 = _two_parts()
    ckpt.load(tmp_path / "step_000001", model=resumed, optimizers=[b2, a2])
    assert not a2.state
    _assert_identical(_tensors(model, [a, b]), _tensors(resumed, [a2, b2]))
    runs = []
    for m, opts in ((model, (a, b)), (resumed, (a2, b2))):
        torch.manual_seed(7)
        for opt in opts:
            _step(m, opt, ("a", "b"))
        runs.append(_tensors(m, opts))
    _assert_identical(*runs)
    # an older checkpoint: every optimizer's state saved, the fresh ones' places in the list beside it
    ckpt.save(tmp_path, 2, model=model, optimizers=[a, b])
    (tmp_path / "step_000002" / "fresh_optimizers.json").write_text("[0]")
    older, a3, b3 = _two_parts()
    ckpt.load(tmp_path / "step_000002", model=older, optimizers=[a3, b3])
    assert not a3.state and len(b3.state) == 2


def test_model_tensors_membership_reads_nothing(tmp_path, monkeypatch):
    """`name in tensors` (Mapping's, through __getitem__) read the tensor from the files; it now
    looks at the names alone, and get of an unknown name reads nothing either."""
    model, opts = _build()
    ckpt.save(tmp_path, 1, model=model, optimizers=opts)
    tensors = ckpt.ModelTensors(tmp_path)
    reads = []
    monkeypatch.setattr(ckpt, "_dcp_load", lambda state, path, **kw: reads.append(list(state["model"])))
    assert "moe.router" in tensors and "nope" not in tensors and 3 not in tensors
    assert tensors.get("nope") is None and reads == []
    tensors.get("moe.router")
    assert reads == [["moe.router"]]


def test_cuda_generators_restore_on_fewer_visible_devices(monkeypatch):
    """A run saved with 8 GPUs visible, resumed with 1 per rank (SLURM's binding): set_rng_state
    restored all 8 (an IndexError); it restores those of the devices visible, in order."""
    visible, restored = [8], []

    def set_state(state, device="cuda"):  # as torch's: device i's generator, an IndexError past the visible ones
        if device >= visible[0]:
            raise IndexError("list index out of range")
        restored.append((device, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([i], dtype=torch.uint8) for i in range(visible[0])])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_state)  # what torch's set_rng_state_all calls
    state = ckpt.rng_state()
    assert len(state["cuda"]) == 8
    visible[0] = 1
    ckpt.set_rng_state(state)
    assert restored == [(0, 0)]
    visible[0] = 8
    restored.clear()
    ckpt.set_rng_state(state)
    assert restored == [(i, i) for i in range(8)]


def test_pipeline_chunks_saved_before_their_first_step_load_without_state(tmp_path):
    """Both stages hold the embedding with MTP modules (a tied copy under one name): loading a
    save made before the first step left the lr-0 step's state on one of the two copies."""
    from fmoe.model import PipelineChunk, Transformer, TransformerConfig
    from fmoe.parallel import pipeline_chunk

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_dense=1, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1,
                            head_dim=8, mtp_depth=1)

    def chunks():
        parts = [pipeline_chunk(Transformer(cfg), PipelineChunk(stage, 2, range(stage, stage + 1))) for stage in (0, 1)]
        return parts, [torch.optim.AdamW(part.parameters(), lr=1e-2) for part in parts]

    parts, opts = chunks()
    assert parts[0].embed is not None and parts[1].embed is not None
    ckpt.save(tmp_path, 0, model=parts, optimizers=opts)
    resumed, resumed_opts = chunks()
    ckpt.load(tmp_path / "step_000000", model=resumed, optimizers=resumed_opts)
    assert [len(o.state) for o in resumed_opts] == [0, 0]


def test_load_takes_a_run_s_newest_checkpoint_as_load_model_does(tmp_path):
    """load(out_dir) was "not a complete checkpoint (no .metadata)" though load_model and
    ModelTensors take the same folder's newest checkpoint."""
    model, opts = _build()
    for step in (1, 2):
        _train(model, opts)
        ckpt.save(tmp_path, step, model=model, optimizers=opts, extra={"step": step})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    fresh, fresh_opts = _build()
    assert ckpt.load(tmp_path, model=fresh, optimizers=fresh_opts)["step"] == 2
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "step_000003.tmp").mkdir()
    with pytest.raises(FileNotFoundError, match=r"path: '.*cut' holds no complete checkpoint"):
        ckpt.load(tmp_path / "cut", model=fresh, optimizers=fresh_opts)


def _saved_steps(tmp_path, steps):
    model, opts = _build()
    for step in steps:
        ckpt.save(tmp_path, step, model=model, optimizers=opts)
    return model, opts


def test_prune_leaves_a_checkpoint_that_is_being_read(tmp_path):
    """reading() holds a checkpoint: prune() (the run's retention, while an evaluation or an
    export reads the run) leaves it until the read ends, and removes it at a later call."""
    model, opts = _saved_steps(tmp_path, (1, 2))
    with ckpt.reading(tmp_path) as held:
        assert held == tmp_path / "step_000002"
        ckpt.save(tmp_path, 3, model=model, optimizers=opts)
        assert ckpt.prune(tmp_path, keep_last=1) == [tmp_path / "step_000001"]
        assert (held / ".metadata").is_file()
        with ckpt.reading(held) as again:  # readers share it
            assert again == held
    assert ckpt.prune(tmp_path, keep_last=1) == [held]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]


def test_a_load_keeps_its_checkpoint_while_the_run_prunes_it(tmp_path, monkeypatch):
    """The run saves a newer checkpoint and prunes the one a load reads, midway through the
    read (DCP reads file after file): the load finishes with the checkpoint it started on
    (it lost its files and failed before), and the next prune removes it. load_run says
    which checkpoint it read."""
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.run import write_config

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8)
    writer = Transformer(cfg)
    write_config(tmp_path, {"model": dataclasses.asdict(cfg)}, vocab_size=32)
    ckpt.save(tmp_path, 1, model=writer, optimizers=[])
    read, steps = ckpt._dcp_load, [1]

    def pruned_midway(state, path, **kwargs):  # the run's next save and its retention (keep_last=1)
        with torch.no_grad():
            for p in writer.parameters():
                p.add_(1.0)
        steps.append(steps[-1] + 1)
        ckpt.save(tmp_path, steps[-1], model=writer, optimizers=[])
        ckpt.prune(tmp_path, keep_last=1)
        return read(state, path, **kwargs)

    want = {k: v.clone() for k, v in writer.state_dict().items()}
    monkeypatch.setattr(ckpt, "_dcp_load", pruned_midway)
    model, run = ckpt.load_run(tmp_path)
    assert run["checkpoint"] == str(tmp_path / "step_000001")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert ckpt.prune(tmp_path, keep_last=1) == [tmp_path / "step_000001"]  # free again
    want = {k: v.clone() for k, v in writer.state_dict().items()}
    fresh = Transformer(cfg)
    ckpt.load(tmp_path, model=fresh, optimizers=[])  # the run's newest, step 2; step 3 saved as it is read
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    monkeypatch.setattr(ckpt, "_dcp_load", read)
    assert ckpt.prune(tmp_path, keep_last=1) == [tmp_path / "step_000002"]


def test_reading_takes_the_newer_checkpoint_where_the_newest_was_pruned_before_the_lock(tmp_path, monkeypatch):
    """Between the listing of a run's checkpoints and the lock, the run pruned the newest
    one for a newer: reading() takes the newer. A checkpoint directory named itself and
    pruned away is a FileNotFoundError naming it."""
    model, opts = _saved_steps(tmp_path, (1,))
    newest = ckpt._checkpoint_or_newest

    def listed_then_pruned(path):
        found = newest(path)
        if found.name == "step_000001":
            ckpt.save(tmp_path, 2, model=model, optimizers=opts)
            ckpt.prune(tmp_path, keep_last=1)
        return found

    monkeypatch.setattr(ckpt, "_checkpoint_or_newest", listed_then_pruned)
    with ckpt.reading(tmp_path) as held:
        assert held == tmp_path / "step_000002"
    monkeypatch.setattr(ckpt, "_checkpoint_or_newest", newest)
    ckpt.save(tmp_path, 3, model=model, optimizers=opts)
    monkeypatch.setattr(ckpt, "_checkpoint_or_newest", lambda path: (newest(path), ckpt.prune(tmp_path, keep_last=1))[0])
    with pytest.raises(FileNotFoundError, match=r"step_000002' was removed as it was about to be read \(pruned by its run\?\)"):
        with ckpt.reading(tmp_path / "step_000002"):
            pass


class _Planted:
    """A pickled object whose unpickling creates the file `marker` (open, pickled as io.open, in "w" mode):
    code in a crafted checkpoint that a load must not run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _saved_with_extra(tmp_path):
    model, opts = _build()
    _train(model, opts)
    extra = {"step": 2, "sampler": {"epoch": 1, "offset": 3}, "rng": ckpt.rng_state()}
    return model, opts, ckpt.save(tmp_path / "run", 2, model=model, optimizers=opts, extra=extra).wait()


def _refused(path, entry=""):
    # open is io.open, which Python 3.13 pickles as _io.open
    return rf"path: '{path}'{entry} refuses to unpickle _?io\.open: a checkpoint is read without running its code"


def test_a_metadata_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    """DCP's .metadata is a pickle, read by DCP with pickle.load: one naming a function to call
    ran it on every read (load, load_model, ModelTensors, and a .metadata replaced between
    ModelTensors' listing and its read of a tensor). Only DCP's metadata classes, torch.Size,
    dtypes, layouts and paths are unpickled: a ValueError names the file and the global."""
    import pickle

    model, opts, path = _saved_with_extra(tmp_path)
    marker = tmp_path / "ran"
    meta = path / ".metadata"
    genuine = meta.read_bytes()
    meta.write_bytes(pickle.dumps(_Planted(marker)))
    fresh, fresh_opts = _build()
    before = _tensors(fresh, fresh_opts)
    reads = {"load": lambda: ckpt.load(path, model=fresh, optimizers=fresh_opts), "load_model": lambda: ckpt.load_model(path, model=fresh),
             "load of the run": lambda: ckpt.load(tmp_path / "run", model=fresh, optimizers=fresh_opts),
             "ModelTensors": lambda: ckpt.ModelTensors(path)}
    for what, read in reads.items():
        with pytest.raises(ValueError, match=_refused(meta)):
            read()
        assert not marker.exists(), what
    _assert_identical(_tensors(fresh, fresh_opts), before)
    meta.write_bytes(genuine)
    tensors = ckpt.ModelTensors(path)
    meta.write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ValueError, match=_refused(meta)):
        tensors["head.weight"]
    assert not marker.exists()


def test_a_checkpoint_saved_under_python_3_13_is_read_by_older_pythons(tmp_path):
    """Python 3.13 pickles the path in DCP's .metadata as pathlib._local.PosixPath, a module Python 3.10 to 3.12 lack:
    such a checkpoint read there was "a damaged or incomplete checkpoint?". Here a .metadata written as 3.13 writes it."""
    import pickle

    model, opts, path = _saved_with_extra(tmp_path)
    meta = path / ".metadata"
    plain = pickle.dumps(pickle.loads(meta.read_bytes()), protocol=2)  # its globals as text: "c<module>\n<name>\n"
    as_313 = plain.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")  # on 3.13 itself: already so
    assert as_313.count(b"cpathlib._local\nPosixPath\n") >= 1
    meta.write_bytes(as_313)
    fresh, _ = _build()
    ckpt.load_model(path, model=fresh)
    assert torch.equal(fresh["head"].weight, model["head"].weight)
    assert torch.equal(ckpt.ModelTensors(path)["head.weight"], model["head"].weight)


def test_an_extra_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    """extra_rank<r>.pt was read with torch.load(weights_only=False): a crafted one ran its code
    on load (--resume). It is read with weights_only=True (numpy's generator state allowed): a
    ValueError names the file and the global, before the model or the optimizers change."""
    model, opts, path = _saved_with_extra(tmp_path)
    marker = tmp_path / "ran"
    extra = path / "extra_rank0.pt"
    torch.save({"step": 2, "planted": _Planted(marker)}, extra)
    fresh, fresh_opts = _build()
    before = _tensors(fresh, fresh_opts)
    with pytest.raises(ValueError, match=_refused(extra)):
        ckpt.load(path, model=fresh, optimizers=fresh_opts)
    assert not marker.exists()
    _assert_identical(_tensors(fresh, fresh_opts), before)
    ckpt.load_model(path, model=fresh)  # the weights do not read the extra
    assert torch.equal(fresh["head"].weight, model["head"].weight)


def test_a_non_tensor_entry_that_would_run_code_is_refused_without_running_it(tmp_path):
    """DCP stores non-tensor entries (the optimizers' param_groups knobs: lr, betas, ...) as
    torch.save'd bytes in its .distcp files and its planner read them with
    torch.load(weights_only=False): an entry pointed at a crafted pickle ran its code on load
    (with a genuine .metadata and extra). They are read with weights_only=True: a ValueError
    names the file, the entry and the global."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model, opts, path = _saved_with_extra(tmp_path)
    marker = tmp_path / "ran"
    meta = pickle.loads((path / ".metadata").read_bytes())  # the genuine one, written by this test
    key = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata) and k.startswith("optim.param_groups."))
    index = next(i for i in meta.storage_data if i.fqn == key)
    info = meta.storage_data[index]
    shard = path / info.relative_path
    planted = io.BytesIO()
    torch.save(_Planted(marker), planted)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(planted.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(planted.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    fresh, fresh_opts = _build()
    with pytest.raises(ValueError, match=_refused(shard, rf" \(its entry {key}\)")):
        ckpt.load(path, model=fresh, optimizers=fresh_opts)
    assert not marker.exists()
    ckpt.load_model(path, model=fresh)  # the weights alone read no such entry
    assert torch.equal(fresh["head"].weight, model["head"].weight)


def test_a_run_config_claiming_a_larger_model_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """A run's config.json that says hidden 10^9, 10^8 layers or wider experts than its
    checkpoint holds: load_run built (allocated and initialised) that model before comparing
    it with the checkpoint; the config is now checked against the saved shapes first."""
    import json

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.run import write_config

    cfg = TransformerConfig(vocab_size=32, hidden=16, n_layers=2, n_experts=4, k=2, ffn_expert=8, n_heads=2, n_kv_heads=1, head_dim=8)
    write_config(tmp_path, {"model": dataclasses.asdict(cfg)}, vocab_size=32)
    ckpt.save(tmp_path, 1, model=Transformer(cfg), optimizers=[])
    config = json.loads((tmp_path / "config.json").read_text())
    built = []
    class Counted(Transformer):
        def __init__(self, c):
            built.append((c, torch.get_default_device().type))
            super().__init__(c)

    monkeypatch.setattr(ckpt, "Transformer", Counted)
    for knob, value, said in (("hidden", 10**9, r"the embedding is saved as \[32, 16\], the config says vocab_size 32 and hidden 1000000000"),
                              ("n_layers", 10**4, "2 blocks are saved, the config says n_layers 10000"),
                              ("ffn_expert", 10**9, r"blocks.1.mlp.experts.w_gate \(saved \[4, 16, 8\], here \[4, 16, 1000000000\]\)")):
        (tmp_path / "config.json").write_text(json.dumps({**config, "config": {**config["config"], "model": {**config["config"]["model"], knob: value}}}))
        with pytest.raises(ValueError, match=said):
            ckpt.load_run(tmp_path)
    assert [(c.ffn_expert, device) for c, device in built] == [(10**9, "meta")]  # the wider experts' shapes, on the meta device only
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ckpt.load_run(tmp_path)[0].cfg.hidden == 16
