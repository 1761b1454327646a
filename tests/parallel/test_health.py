"""fmoe.parallel.replica_mismatches on the reference model in 4 gloo processes, HSDP
(dp_replicate = 2) and TP (norms and routers replicated over tp): quiet at the start and
after a training step, and on every rank the name of a parameter one rank corrupted (an
added 1e-3, one flipped low bit) or of an expert_bias buffer; and fmoe.train.metrics'
memory_plan on FSDP2 ranks, whose per-rank bytes add up to one process's, and its
EnergyMeter agreed over the ranks; and the rules beyond the model (a tied tensor named
once, integer buffers not compared, ranks outside a tensor's mesh, meshes that do not
divide the group, Partial placements refused). One spawn runs
every distributed check; the one-process checks run here."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fmoe.parallel import bits_hash, replica_mismatches
from tests.parallel.dist import counting_calls, run_distributed

TINY = dict(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32, n_shared=1,
            n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1, impl="torch")
# vocab 66: the embedding and head split 17, 17, 17, 15 over 4 FSDP2 ranks (uneven shards)
MEMORY = dict(TINY, vocab_size=66)


def _model(cfg, sizes):
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import build_meshes, parallelize

    model = Transformer(TransformerConfig(**cfg))
    model.reset_parameters(seed=0)
    return parallelize(model, build_meshes(**sizes))


def _tensor(model, name):
    return dict(list(model.named_parameters()) + list(model.named_buffers()))[name]


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _check(model, corruptions, **kwargs):
    """replica_mismatches after the given (rank, name, how) corruptions of one element of
    this rank's local values, which are then restored; with the number of all_gathers."""
    saved = {}
    with torch.no_grad():
        for rank, name, how in corruptions:
            if dist.get_rank() == rank:
                local = _local(_tensor(model, name))
                saved[name] = local.clone()
                index = (local.shape[0] - 1,) + (0,) * (local.ndim - 1)  # the shard's last row
                if how == "add":
                    local[index] += 1e-3
                else:  # the lowest bit of the float32's mantissa
                    local.view(torch.int32)[index] ^= 1
    calls, original = [], dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        names = replica_mismatches(model, **kwargs)
    finally:
        dist.all_gather = original
    with torch.no_grad():
        for name, value in saved.items():
            _local(_tensor(model, name)).copy_(value)
    return names, len(calls)


def _step(model, rank):
    """One training step on this rank's own tokens, with the expert biases updated from the
    all-reduced counts, as the train loop does."""
    from fmoe.ops import update_expert_bias
    from fmoe.optim import AdamW
    from fmoe.parallel import all_reduce_counts
    from fmoe.train.data import make_batch

    g = torch.Generator().manual_seed(10 + rank)
    batch = make_batch(torch.randint(0, TINY["vocab_size"], (24,), generator=g), torch.tensor([0, 9, 24]), 1)
    opt = AdamW(model.parameters(), lr=1e-2, impl="torch")
    losses, stats = model(batch, model.context(batch))
    ((losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / 100.0).backward()
    opt.step()
    opt.zero_grad()
    layers = model.moe_layers()
    counts = all_reduce_counts({n: s["tokens_per_expert"] for n, s in stats.items()}, dist.group.WORLD, names=list(layers), n_experts=4)
    with torch.no_grad():
        for name, moe in layers.items():
            moe.expert_bias.copy_(update_expert_bias(moe.expert_bias, counts[name], 1e-3))


def _world4(rank, world_size):
    from fmoe.optim import AdamW
    from fmoe.train.metrics import memory_plan

    out = {}
    hsdp = _model(TINY, dict(dp_replicate=2, dp_shard=2, ep=2))
    out["hsdp"] = dict(
        start=_check(hsdp, []),
        add=_check(hsdp, [(3, "blocks.0.attn.wq", "add")]),
        bit=_check(hsdp, [(2, "mtp.0.proj", "bit")]),
        bias=_check(hsdp, [(1, "blocks.1.mlp.expert_bias", "add")]),
        # three at once, in reverse model order, two names asked for: the first two
        first_two=_check(hsdp, [(0, "norm.weight", "bit"), (1, "blocks.1.mlp.router", "add"), (2, "embed", "bit")], max_names=2),
        # the experts are split over edp x ep (no rank holds another's copy): nothing to compare
        expert=_check(hsdp, [(0, "blocks.1.mlp.experts.w_up", "add")]),
    )
    _step(hsdp, rank)
    out["hsdp"]["after_step"] = _check(hsdp, [])
    out["hsdp"]["memory"] = memory_plan(hsdp, AdamW(hsdp.parameters(), impl="torch"))

    tp = _model(TINY, dict(dp_shard=2, tp=2, ep=2))
    out["tp"] = dict(
        start=_check(tp, []),
        norm=_check(tp, [(1, "blocks.1.mlp_norm.weight", "bit")]),  # replicated over tp: ranks 0 and 1 hold the same shard
        router=_check(tp, [(2, "mtp.0.block.mlp.router", "add")]),
        tp_shard=_check(tp, [(3, "blocks.0.attn.wq", "add")]),  # split over dp_shard x tp: no copy elsewhere
    )

    fsdp = _model(MEMORY, dict(dp_shard=4, ep=2))
    out["fsdp_memory"] = memory_plan(fsdp, AdamW(fsdp.parameters(), state_dtype=torch.bfloat16, impl="torch"))
    out["energy"] = _energy(rank)
    out["edges"] = _edges(rank)
    return out


def _refused(fn):
    """fn()'s result, or its ValueError's message."""
    try:
        return fn()
    except ValueError as e:
        return f"ValueError: {e}"


def _edges(rank):
    """replica_mismatches beyond the reference model, on 4 ranks: a tensor tied to two
    modules, one rank's copy corrupted, beside an integer buffer every rank keeps its own; a
    parameter replicated on a mesh of ranks 0 and 1 alone (ranks 2 and 3 hold none of it),
    before and after rank 1 corrupts its copy; a mesh of 3 ranks in a group of 4, a mesh of
    4 in a group of 2, and a Partial placement: each refused on every rank, before any
    collective."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    out = {}
    a, b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    b.weight = a.weight
    tied = nn.Sequential(a, b)
    tied.register_buffer("calls", torch.tensor([rank]))
    with torch.no_grad():
        a.weight.fill_(0.5)
        a.weight[0, 0] += 1e-3 * (rank == 1)
    out["tied"] = replica_mismatches(tied)

    half = nn.Module()
    half.w = nn.Parameter(distribute_tensor(torch.ones(4), DeviceMesh("cpu", [0, 1]), [Replicate()]))
    out["outside"] = [replica_mismatches(half)]
    if rank == 1:
        with torch.no_grad():
            half.w.to_local()[2] += 1e-3
    out["outside"].append(replica_mismatches(half))

    world = init_device_mesh("cpu", (4,))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three, wider, partial = nn.Module(), nn.Module(), nn.Module()
    three.w = nn.Parameter(distribute_tensor(torch.ones(3), DeviceMesh("cpu", [0, 1, 2]), [Replicate()]))
    wider.w = nn.Parameter(distribute_tensor(torch.ones(4), world, [Replicate()]))
    partial.w = nn.Parameter(DTensor.from_local(torch.ones(2), world, [Partial()]))
    out["three"] = _refused(lambda: replica_mismatches(three))
    out["wider"] = _refused(lambda: replica_mismatches(wider, group=pairs[rank // 2]))
    out["partial"] = _refused(lambda: replica_mismatches(partial))
    return out


def _energy(rank):
    """EnergyMeter.agree on 4 ranks, each with a fake counter (no NVML): the readings of
    every call, the meter's state after rank 3's read fails, and a meter that rank 2 alone
    cannot read from the start. A rank joining a collective the others skip hangs the group."""
    from fmoe.train.metrics import EnergyMeter

    millijoules, failing = [0.0], []

    def counter(index):
        if failing:
            raise RuntimeError("Not Supported")
        return millijoules[0]

    meter = EnergyMeter("cuda:0", query=counter)
    meter.agree(dist.group.WORLD, "cpu")
    readings = []
    millijoules[0] += 1000 * (rank + 1)
    readings.append(meter.joules_since_last())  # 1 + 2 + 3 + 4 J
    millijoules[0] = 0.0 if rank == 1 else millijoules[0] + 1000  # rank 1's driver reloaded
    readings.append(meter.joules_since_last())
    millijoules[0] += 500
    readings.append(meter.joules_since_last())  # 4 x 0.5 J
    if rank == 3:
        failing.append(True)
    readings.append(meter.joules_since_last())
    after = (meter.available, meter.reason)
    readings.append(meter.joules_since_last())  # off on every rank: no collective

    def broken(index):
        raise RuntimeError("Not Supported")

    failing.clear()
    one_lacks = EnergyMeter("cuda:0", query=broken if rank == 2 else counter)
    one_lacks.agree(dist.group.WORLD, "cpu")
    return dict(readings=readings, after=after, one_lacks=(one_lacks.available, one_lacks.reason, one_lacks.joules_since_last()))


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4, timeout=300)


def test_replica_mismatches_hsdp(world4):
    for rank, r in enumerate(world4):
        h = r["hsdp"]
        assert h["start"] == ([], 1), rank  # one all_gather
        assert h["add"] == (["blocks.0.attn.wq"], 1), rank
        assert h["bit"] == (["mtp.0.proj"], 1), rank
        assert h["bias"] == (["blocks.1.mlp.expert_bias"], 1), rank
        assert h["first_two"] == (["embed", "blocks.1.mlp.router"], 1), rank
        assert h["expert"] == ([], 1), rank
        assert h["after_step"] == ([], 1), rank


def test_replica_mismatches_tp(world4):
    for rank, r in enumerate(world4):
        t = r["tp"]
        assert t["start"] == ([], 1), rank
        assert t["norm"] == (["blocks.1.mlp_norm.weight"], 1), rank
        assert t["router"] == (["mtp.0.block.mlp.router"], 1), rank
        assert t["tp_shard"] == ([], 1), rank


def _one_process_plan(cfg, **opt_kwargs):
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.optim import AdamW
    from fmoe.train.metrics import memory_plan

    model = Transformer(TransformerConfig(**cfg))
    return memory_plan(model, AdamW(model.parameters(), impl="torch", **opt_kwargs))


def test_memory_plan_ranks_add_up_to_one_process(world4):
    """FSDP2 over 4 ranks (uneven embedding shards), experts over edp x ep: the parameter,
    gradient and optimizer bytes of the 4 ranks add up to one process's exactly; the
    expert_bias buffers (plain, on every rank) count on each. HSDP: the dense bytes twice
    (two replicas), the experts' once."""
    one = _one_process_plan(MEMORY, state_dtype=torch.bfloat16)
    plans = [r["fsdp_memory"] for r in world4]
    for kind in ("params", "grads", "optimizer"):
        assert sum(p[kind] for p in plans) == one[kind], kind
    assert all(p["buffers"] == one["buffers"] == 2 * 4 * 4 for p in plans)  # two MoE blocks' [4] float32 biases
    assert len({p["params"] for p in plans}) > 1  # uneven shards: not every rank holds the same
    assert set(plans[0]["by_mesh"]) == {"dp_shard", "edp,ep", "replicated"}  # etp = 1 splits nothing: not named
    assert plans[0]["by_mesh"]["replicated"]["params"] == 0  # every parameter is sharded

    one = _one_process_plan(TINY)
    plans = [r["hsdp"]["memory"] for r in world4]
    experts = sum(p["by_mesh"]["edp,ep"]["params"] for p in plans)
    dense = sum(p["by_mesh"]["dp_shard"]["params"] for p in plans)
    assert experts + dense / 2 == one["params"]
    assert experts == 4 * 2 * 3 * 4 * 32 * 32  # float32 [E, H, F] x 3 in the trunk's MoE block and the MTP's


def test_energy_is_every_ranks_or_none(world4):
    """An EnergyMeter agreed over the ranks reads the sum of every rank's device; an interval
    one rank could not read gives None on every rank, and a read that fails on one rank, or
    a rank that cannot read from the start, turns every rank's meter off (no rank is left
    waiting in a collective the others skipped: the group would hang)."""
    for rank, r in enumerate(world4):
        e = r["energy"]
        assert e["readings"] == [10.0, None, 2.0, None, None], rank
        assert e["after"] == ((False, "NVML error: Not Supported") if rank == 3 else (False, "NVML error on 1 of 4 ranks")), rank
        assert e["one_lacks"] == ((False, "NVML error: Not Supported", None) if rank == 2 else (False, "1 of 4 ranks cannot read it", None)), rank


def test_replica_mismatches_beyond_the_model(world4):
    """_edges' cases: the tied tensor named once (by its first name), the integer buffer
    never; ranks outside a tensor's mesh compare nothing (their empty shards are no copy),
    and the two ranks inside still do; the misfit meshes and the Partial placement refused
    by name on every rank."""
    for rank, r in enumerate(world4):
        e = r["edges"]
        assert e["tied"] == ["0.weight"], rank
        assert e["outside"] == [[], ["w"]], rank
        assert e["three"] == "ValueError: group: w's mesh has 3 ranks, which does not divide the 4 ranks of the group", rank
        assert e["wider"] == "ValueError: group: w's mesh has 4 ranks, which does not divide the 2 ranks of the group", rank
        assert e["partial"].startswith("ValueError: modules: w has a Partial placement"), rank


def test_a_group_of_one_rank_makes_no_collective(one_rank_mesh):
    model = torch.nn.Linear(3, 2)
    with counting_calls("all_gather") as calls:
        assert replica_mismatches(model, group=one_rank_mesh) == []
    assert calls == []


def test_one_process_and_bad_arguments():
    """No process group: [] and no collective. Argument checks come first."""
    assert not dist.is_initialized()
    model = torch.nn.Linear(3, 2)
    assert replica_mismatches(model) == [] and replica_mismatches([model, torch.nn.LayerNorm(2)]) == []
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_names: expected an int >= 1"):
            replica_mismatches(model, max_names=bad)
    with pytest.raises(ValueError, match=r"modules\[1\]: expected an nn.Module"):
        replica_mismatches([model, "x"])
    with pytest.raises(ValueError, match="modules: expected an nn.Module or an iterable"):
        replica_mismatches(3)


def test_bits_hash_tells_single_bit_flips_apart():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        x = torch.randn(1000, dtype=dtype)
        base = bits_hash(x)
        assert base.dtype == torch.int64 and base.dim() == 0
        assert torch.equal(bits_hash(x.clone()), base)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        for position in (0, 1, 500, 999):
            for bit in (0, 3, 8 * x.element_size() - 1):  # the lowest, a middle and the sign bit
                y = x.clone()
                y.view(ints)[position] ^= torch.tensor(1, dtype=ints) << bit
                assert not torch.equal(bits_hash(y), base), (dtype, position, bit)
    x = torch.randn(6)
    swapped = x[[1, 0, 2, 3, 4, 5]]
    assert not torch.equal(bits_hash(swapped), bits_hash(x))  # positions count, not just the values
    assert not torch.equal(bits_hash(torch.tensor([0.0])), bits_hash(torch.tensor([-0.0])))  # bits, not values
    assert torch.equal(bits_hash(x.view(2, 3).t()), bits_hash(x.view(2, 3).t().contiguous()))  # layout-free
    with pytest.raises(ValueError, match="t: expected a tensor"):
        bits_hash([1.0])


def _formula(x):
    """The module docstring's hash in Python integers: sum_i w_i x_i mod 2^64, x_i the
    element's bits sign-extended, w_i = (i * 0x9E3779B97F4A7C15 + c) | 1, as a signed int64."""
    from fmoe.parallel import health

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    total = 0
    for i, bits in enumerate(x.reshape(-1).view(ints).tolist()):
        total += (((i * 0x9E3779B97F4A7C15 + health._OFFSET) % 2**64) | 1) * bits
    total %= 2**64
    return total - 2**64 if total >= 2**63 else total


def test_bits_hash_is_the_formula_chunk_by_chunk(monkeypatch):
    """bits_hash equals the docstring's sum (negative elements sign-extended), whatever the
    chunk the elements are hashed in (positions count from the tensor's start, not the
    chunk's: 3 elements a chunk here, 4M in use)."""
    from fmoe.parallel import health

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(10, generator=g).to(dtype)
        whole = bits_hash(x)
        assert int(whole) == _formula(x), dtype
        monkeypatch.setattr(health, "_CHUNK", 3)
        assert torch.equal(bits_hash(x), whole), dtype
        monkeypatch.undo()


def test_bits_hash_of_complex_and_distributed_tensors(one_rank_mesh):
    """A complex tensor hashes as its real and imaginary parts (complex128's 16-byte
    elements included: a flip of either part tells); a DTensor hashes its local shard."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for dtype in (torch.complex64, torch.complex128):
        z = torch.randn(5, dtype=dtype)
        assert torch.equal(bits_hash(z), bits_hash(torch.view_as_real(z)))
        for part in (0, 1):
            y = z.clone()
            torch.view_as_real(y)[3, part] += 1
            assert not torch.equal(bits_hash(y), bits_hash(z)), (dtype, part)
    x = torch.randn(4, 3)
    d = distribute_tensor(x, one_rank_mesh, [Replicate()])
    assert torch.equal(bits_hash(d), bits_hash(x))
