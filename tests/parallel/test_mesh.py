"""build_meshes / plan_sizes: sizes, MoE folding, and the promised ValueErrors."""

import pytest
import torch
import torch.distributed as dist

from fmoe.parallel import build_meshes, plan_sizes
from tests.parallel.dist import run_distributed


def test_sizes_fill_dp_shard_and_fold_experts():
    assert plan_sizes(8, tp=2, ep=4) == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, dp=4, edp=2, ep=4, etp=1)
    assert plan_sizes(8, dp_replicate=2, tp=2, ep=2, etp=2)["edp"] == 2
    assert plan_sizes(1) == dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, dp=1, edp=1, ep=1, etp=1)
    # experts on the context-parallel ranks too (dp_shard x cp x tp): a long-context run's experts need not fit dp_shard
    assert plan_sizes(2, cp=2, ep=2) == dict(pp=1, dp_replicate=1, dp_shard=1, cp=2, tp=1, dp=1, edp=1, ep=2, etp=1)
    assert plan_sizes(4, cp=2, tp=2, ep=4)["edp"] == 1 and plan_sizes(8, dp_shard=2, cp=4, ep=8)["edp"] == 1
    assert plan_sizes(8, dp_shard=2, cp=4, ep=2)["edp"] == 4


@pytest.mark.parametrize("world, kwargs, message", [
    (4, dict(tp=3), r"dp_shard=-1: dp_replicate \* cp \* tp = 3 does not divide the world size 4"),
    (4, dict(dp_shard=4, tp=2), r"dp_replicate \* dp_shard \* cp \* tp = 8 does not equal the world size 4"),
    (4, dict(dp_replicate=2, ep=4), r"ep \* etp = 4 does not divide dp_shard \* cp \* tp = 2 \(expert parallelism borrows"),
    (8, dict(tp=2, ep=3), r"ep \* etp = 3 does not divide dp_shard \* cp \* tp = 8"),
    (4, dict(ep=2, has_experts=False), r"ep / etp: expert parallelism \(2 x 1\) needs a model with experts"),
    (4, dict(tp=0), r"tp: expected a positive int, got 0"),
    (4, dict(dp_shard=-2), r"dp_shard: expected a positive int or -1"),
    (4, dict(ep=True), r"ep: expected a positive int, got True"),
    (0, dict(), r"world_size: expected a positive int, got 0"),
    (True, dict(), r"world_size: expected a positive int, got True"),
    (4, dict(pp=0), r"pp: expected a positive int, got 0"),
    (4, dict(dp_shard=1), r"dp_replicate \* dp_shard \* cp \* tp = 1 does not equal the world size 4"),  # fewer ranks than the world
    (4, dict(etp=2, has_experts=False), r"ep / etp: expert parallelism \(1 x 2\) needs a model with experts"),
    # pipeline stages: a stage's ranks (world / pp), not the world's, take the other axes
    (6, dict(pp=4), r"pp: 4 pipeline stages do not divide the world size 6"),
    (12, dict(pp=2, tp=4), r"dp_shard=-1: dp_replicate \* cp \* tp = 4 does not divide the 6 ranks of a pipeline stage \(world size 12 / pp 2\)"),
    (8, dict(pp=2, dp_shard=1), r"pp \* dp_replicate \* dp_shard \* cp \* tp = 2 does not equal the world size 8"),
])
def test_invalid_sizes_say_which_product_does_not_divide_which(world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_sizes(world, **kwargs)


def test_build_meshes_needs_an_initialised_world():
    with pytest.raises(ValueError, match="not initialised"):
        build_meshes()
    with pytest.raises(ValueError, match="not initialised"):
        build_meshes(device_type="cuda")


@pytest.mark.parametrize("device_type", ["tpu", "cuda:0", "meta", 0])
def test_build_meshes_names_a_device_type_torch_does_not_have(device_type):
    """Checked before anything else (meshes on "tpu" were built without a word)."""
    with pytest.raises(ValueError, match=f"device_type: expected a torch device type such as 'cuda' or 'cpu' \\(no index\\), got {device_type!r}"):
        build_meshes(device_type=device_type)


def _views(rank, world):
    meshes = build_meshes(tp=2, ep=2)
    dense_only = build_meshes(dp_replicate=2, has_experts=False)
    try:
        build_meshes(ep=3)
        raised = None
    except ValueError as err:
        raised = str(err)
    unavailable = {}  # a device type torch has but this process cannot use: parallelize failed later in torch's assert
    for device_type in ("xpu",) + (() if torch.cuda.is_available() else ("cuda",)):
        try:
            build_meshes(device_type=device_type)
        except ValueError as err:
            unavailable[device_type] = str(err)
    missing = []  # an axis these meshes lack: the refusal listed it among the names it expected
    for name in ("ep", "pp"):
        try:
            dense_only.axis(name)
        except ValueError as err:
            missing.append(str(err))
    cp_tp, pp_tp = build_meshes(cp=2, tp=2), build_meshes(pp=2, tp=2)
    return dict(missing=missing, token_mesh=cp_tp.token_mesh.mesh.tolist(), token_rank=cp_tp.token_mesh.get_local_rank(),
        pp_mesh=pp_tp.pp_mesh.mesh.tolist(), pp_rank=pp_tp.pp_rank, stage_tp=pp_tp.axis("tp").mesh.tolist(),
        pp_axis=pp_tp.axis("pp").mesh.tolist(),
        tp=meshes.axis("tp").mesh.tolist(), dp=meshes.axis("dp").mesh.tolist(), ep=meshes.axis("ep").mesh.tolist(),
        edp=meshes.axis("edp").mesh.tolist(), etp=meshes.axis("etp").mesh.tolist(), dp_mesh=meshes.dp_mesh.mesh.tolist(),
        group_sizes={a: meshes.group(a).size() for a in ("dp_replicate", "dp_shard", "cp", "tp", "dp", "edp", "ep", "etp")},
        no_experts=dense_only.expert is None, replicate=dense_only.axis("dp_replicate").mesh.tolist(),
        ep_size=meshes.ep, raised=raised, unavailable=unavailable,
    )


def test_views_over_four_ranks():
    results = run_distributed(_views, 4)
    for rank, r in enumerate(results):
        pair, other = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert r["tp"] == pair and r["ep"] == pair  # ep folded onto the tp pair: tp is the last axis
        assert r["dp"] == other and r["edp"] == other and r["dp_mesh"] == [other]
        assert r["etp"] == [rank]
        assert r["token_mesh"] == [0, 1, 2, 3] and r["token_rank"] == rank  # cp_rank * tp + tp_rank, cp_rank = rank // 2
        assert r["pp_mesh"] == other and r["pp_rank"] == rank // 2 and r["stage_tp"] == pair  # stage s: ranks 2s, 2s + 1
        assert r["pp_axis"] == other  # axis("pp") is the pipeline mesh
        assert r["group_sizes"] == dict(dp_replicate=1, dp_shard=2, cp=1, tp=2, dp=2, edp=2, ep=2, etp=1)
        assert r["no_experts"] and r["replicate"] == [rank % 2, rank % 2 + 2]
        assert r["ep_size"] == 2
        assert "ep * etp = 3 does not divide dp_shard * cp * tp = 4" in r["raised"]
        assert r["unavailable"] == {t: f"device_type: {t!r} is not available in this process (torch.{t}.is_available() is False)"
                                    for t in ("xpu",) + (() if torch.cuda.is_available() else ("cuda",))}
        assert r["missing"] == ["name: 'ep' is an axis of the expert mesh, which these meshes lack (build_meshes(has_experts=False))",
                                "name: 'pp' is the pipeline mesh's axis, which these meshes lack (build_meshes(pp=1))"]


def _a_group_after_the_meshes(rank, world):
    meshes = build_meshes(pp=2, tp=2)
    if meshes.pp_rank == 1:  # the last stage alone reads them (its loss's group), as examples/train_moe.py does
        meshes.token_mesh, meshes.stage_mesh
    group = dist.new_group(list(range(world)))  # then every rank makes a group: the same one on each
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return total.item()


def test_a_group_made_after_the_meshes_is_one_group_on_every_rank():
    """build_meshes makes the flattened meshes' groups on every rank: made later on one
    pipeline stage only, they gave the ranks' later groups different names (a hang)."""
    assert run_distributed(_a_group_after_the_meshes, 4, timeout=90) == [4.0] * 4


_LEAVE = """
import atexit, sys
import torch.distributed as dist
from fmoe.parallel import leave_ranks

for name in ("barrier", "destroy_process_group"):
    original = getattr(dist, name)
    setattr(dist, name, lambda *a, _f=original, _n=name, **k: (print(_n, end=" "), _f(*a, **k))[1])
atexit.register(lambda: print("teardown ran"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print("done", end=" ")           # stdout is a pipe: block-buffered, so only a flush shows it
sys.stderr.write("on stderr")
leave_ranks(barrier=sys.argv[1] == "1")
print("not reached")
"""


@pytest.mark.parametrize("barrier", [True, False])
def test_leave_ranks_waits_destroys_flushes_and_exits_zero_without_teardown(barrier):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a pipe is by default
    run = subprocess.run([sys.executable, "-c", _LEAVE, "1" if barrier else "0"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == ("done barrier destroy_process_group " if barrier else "done destroy_process_group "), run.stdout
    assert run.stderr.endswith("on stderr"), run.stderr
