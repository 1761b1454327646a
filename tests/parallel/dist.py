"""Run a function in N gloo processes and collect what each returns.

    results = run_distributed(fn, world_size, *args, timeout=120)   # [result of rank 0, ...]

    with counting_all_reduce() as calls: ...          # the ops of every dist.all_reduce call
    with counting_calls("all_gather_single") as calls: ...   # any torch.distributed function's calls
    with own_groups(): ...                              # the groups made inside (DeviceMesh's) destroyed on leaving
    in_own_groups(case, *args)                          # case(*args) inside own_groups()
    results = by_world(worker, CASES, timeout=600)      # results(world): one process group per world size

`fn(rank, world_size, *args)` must be a module-level function (the workers are spawned and
import it). Each worker initialises the default process group (gloo, file rendezvous),
runs fn, saves its return value with torch.save, then destroys the group and exits
(fmoe.parallel.leave_ranks). An exception in any worker fails the caller with that
worker's traceback; a worker still running after `timeout` seconds (a hang: a rank waiting
in a collective the others skipped) is killed and the caller fails saying so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, root, fn, args):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    from fmoe.parallel import leave_ranks  # after TRITON_INTERPRET

    try:
        dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, f"{root}/result{rank}.pt")
    except BaseException:
        pathlib.Path(f"{root}/error{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1)
    leave_ranks(barrier=False)  # the peers may have failed: no barrier


class Hang(AssertionError):
    """A worker did not finish in time."""


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    with tempfile.TemporaryDirectory() as root:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world_size, root, fn, args), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: pathlib.Path(f"{root}/error{r}.txt").read_text() for r in range(world_size) if pathlib.Path(f"{root}/error{r}.txt").exists()}
        if errors:
            rank, text = sorted(errors.items())[0]
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{text}")
        if hung:
            raise Hang(f"ranks {hung} of {world_size} still running after {timeout} s (a hang in a collective?)")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(f"{root}/result{r}.pt", weights_only=False) for r in range(world_size)]


def by_world(worker, cases: dict, *, timeout: float) -> Callable[[int], list]:
    """run(world) -> [rank 0's result, ...] of worker(rank, world, names) over the names of
    the `cases` whose first entry is `world`: every case of one world size in ONE spawned
    process group (spawning and importing torch costs 6 s for 2 ranks, 13 s for 4 on 2
    cores), run on first use and kept (a failure too: the tests that read a failed group fail
    at once). Return it from a module-scoped fixture."""
    cache: dict[int, list] = {}

    def run(world: int) -> list:
        if world not in cache:
            names = [name for name, case in cases.items() if case[0] == world]
            try:
                cache[world] = run_distributed(worker, world, names, timeout=timeout)
            except Exception as err:  # a failed group fails every test that reads it, at once, rather than running again for each
                cache[world] = err
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return run


_FROZEN = False  # own_groups has frozen the process's objects (gc.freeze)


@contextlib.contextmanager
def own_groups():
    """Destroy, on leaving, the process groups made inside (each DeviceMesh dimension's, new_group's).

    Each gloo group runs a thread that wakes every 10 ms (its transport's epoll loop) until the group
    is destroyed: a worker running dozens of cases, each building its meshes, kept hundreds of them
    and spent from a third to two thirds of its CPU time in the system calls that wake them. Every rank leaves together (a case's end).
    A destroyed group's loop stops only when its object is freed, and the case's reference cycles (DeviceMesh's, FSDP2's)
    hold some until Python's collector runs: leaving collects them. The first entry in a process freezes what lives then
    (gc.freeze: torch's modules), so that a collection does not scan them again. The world-2 cases of test_model_parallel,
    two runs each way taken in turn: rank 0's sys time 27.0 s and 30.4 s without, 20.6 s and 21.7 s with; user + sys 97 s and
    109 s without, 96 s and 94 s with (collecting without the freeze cost more user time than it saved). Only the first
    entry freezes: a case's survivors frozen too would keep the groups they free later, and their loops, for good.

    DTensor's sharding propagation caches its output specs by mesh equality (shape, ranks, names:
    not the groups), so a later case's equal mesh would be handed this case's specs, naming
    destroyed groups: its caches (the Python one and the C++ fast path's) are emptied with them."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without the C++ fast path's cache (or without this helper): the Python cache alone
        from torch.distributed.tensor import DTensor

        _clear_sharding_prop_cache = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear

    global _FROZEN
    if not _FROZEN:  # the process's first case: what lives now (torch's modules) out of every later collection's scan
        gc.collect()
        gc.freeze()
        _FROZEN = True
    world = dist.distributed_c10d._world
    before = set(world.pg_map)
    try:
        yield
    finally:
        made = [g for g in world.pg_map if g not in before]
        if made:
            _clear_sharding_prop_cache()
        while made:  # no name left holding one of them
            dist.destroy_process_group(made.pop(0))
        gc.collect()  # the destroyed groups that cycles hold: their loops stop with them


def in_own_groups(case: Callable, *args):
    """case(*args), the process groups it makes destroyed when it returns (own_groups)."""
    with own_groups():
        return case(*args)


# the torch.distributed function FSDP2 all-gathers parameters with (torch 2.11: all_gather_into_tensor)
FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextlib.contextmanager
def counting_calls(name: str):
    """Record the `op` keyword (None where not given) of every torch.distributed.<name> call
    made while active (the code under test, FSDP2's included, looks it up at call time)."""
    calls = []
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        yield calls
    finally:
        setattr(dist, name, original)


def counting_all_reduce():
    """Record the op of every torch.distributed.all_reduce call made while active."""
    return counting_calls("all_reduce")
