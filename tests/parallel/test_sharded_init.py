"""Sharded initialisation: a model built on the meta device, parallelized, then materialised
(fmoe.parallel.materialize) has, gathered, the same weights bit for bit as the one-process
model built without meta, on every mesh; and no rank ever holds more than its shards plus
one full parameter (counted with fmoe.train.metrics.AllocatedBytes)."""

import torch

from tests.parallel.dist import own_groups, run_distributed

TINY = dict(vocab_size=64, hidden=32, n_layers=3, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32,
            n_shared=1, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1)
# 4 processes: FSDP2, EP, TP, EP x TP, HSDP, expert TP
MESHES = {
    "fsdp4": dict(),
    "ep4": dict(ep=4),
    "tp2-fsdp2": dict(tp=2),
    "ep2xtp2": dict(tp=2, ep=2),
    "hsdp2x2": dict(dp_replicate=2),
    "ep2xetp2": dict(ep=2, etp=2),
}
# a model ~30x larger than TINY: 3 MoE layers of 16 experts; the largest parameter is one
# expert stack [16, 128, 256] (2 MiB)
BIG = dict(TINY, hidden=128, ffn_dense=256, n_experts=16, ffn_expert=256, n_heads=4, n_kv_heads=4, head_dim=32, n_layers=4)


def _sharded(cfg, sizes, seed):
    from fmoe.model import Transformer
    from fmoe.parallel import build_meshes, materialize, parallelize

    meshes = build_meshes(**sizes)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, meshes)
    return materialize(model, "cpu", seed=seed)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(rank, world):
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.train.data import make_batch
    from fmoe.train.metrics import AllocatedBytes

    cfg = TransformerConfig(**TINY)
    torch.manual_seed(7)
    ref = Transformer(cfg)  # one process, no meta, seeded through torch.manual_seed
    g = torch.Generator().manual_seed(1)
    batch = make_batch(torch.randint(0, 64, (24,), generator=g), torch.tensor([0, 5, 17, 24]), 1)
    ref_lm = float(ref(batch)[0]["lm_sum"])
    out = {}
    for name, sizes in MESHES.items():
        with own_groups():
            model = _sharded(cfg, sizes, seed=7)
            params = dict(model.named_parameters())
            out[f"{name}.names"] = sorted(params) == sorted(n for n, _ in ref.named_parameters())
            out[f"{name}.unequal"] = [n for n, p in ref.named_parameters() if not torch.equal(_full(params[n].detach()), p.detach())]
            out[f"{name}.buffers"] = all(torch.equal(b, ref.get_buffer(n)) for n, b in model.named_buffers())
            # the materialised model runs (FSDP2 gathers what it allocated): same forward
            out[f"{name}.lm_err"] = abs(float(model(batch)[0]["lm_sum"]) - ref_lm) / abs(ref_lm)
    # copy_full_value: a DTensor gets its own block of the full value; a local tensor that is not its layout's block is named
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fmoe.model import copy_full_value, local_block

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(8, 3)
    rows = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)])
    copy_full_value(rows, full)
    out["block"] = local_block(rows), rows.to_local().tolist()
    odd = DTensor.from_local(torch.zeros(3, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([8, 3]), stride=(3, 1))
    try:
        copy_full_value(odd, full)
    except ValueError as e:
        out["odd"] = str(e)
    # memory: shards only (+ one full parameter at a time while initialising)
    big = TransformerConfig(**BIG)
    with torch.device("meta"):
        meta = Transformer(big)
    sizes = {n: p.numel() * 4 for n, p in meta.named_parameters()}
    out["model_bytes"], out["largest_bytes"] = sum(sizes.values()), max(sizes.values())
    for name, mesh in (("fsdp4", {}), ("ep4", dict(ep=4))):
        with AllocatedBytes() as mem:
            model = _sharded(big, mesh, seed=0)
        out[f"{name}.peak"] = mem.peak
        out[f"{name}.shard_bytes"] = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    with AllocatedBytes() as mem:  # the counter sees a whole model built the plain way
        Transformer(big)
    out["unsharded.peak"] = mem.peak
    return out


def test_meta_init_is_bit_identical_on_every_mesh_and_never_holds_the_model():
    results = run_distributed(_check, 4, timeout=300)
    for rank, out in enumerate(results):
        for name in MESHES:
            assert out[f"{name}.names"], (rank, name)
            assert out[f"{name}.unequal"] == [], (rank, name, out[f"{name}.unequal"])
            assert out[f"{name}.buffers"], (rank, name)
            assert out[f"{name}.lm_err"] < 1e-5, (rank, name, out[f"{name}.lm_err"])
        block = (slice(2 * rank, 2 * rank + 2), slice(0, 3))
        assert out["block"] == (block, torch.arange(24.0).reshape(8, 3)[block].tolist())
        assert out["odd"] == f"param: a DTensor whose local shape (3, 3) is not its layout's block {block}"
        model, largest = out["model_bytes"], out["largest_bytes"]
        assert out["unsharded.peak"] >= model
        for name in ("fsdp4", "ep4"):
            shard, peak = out[f"{name}.shard_bytes"], out[f"{name}.peak"]
            print(f"rank {rank} {name}: model {model / 2**20:.2f} MiB, shard {shard / 2**20:.2f} MiB, "
                  f"largest parameter {largest / 2**20:.2f} MiB, peak while building {peak / 2**20:.2f} MiB")
            assert shard < model / 3  # each rank keeps about a quarter
            # its shard, plus the one full parameter being initialised and that parameter's
            # cut shard, plus 5% for padding and small temporaries
            assert peak <= 1.05 * (shard + 1.25 * largest), (rank, name, peak, shard, largest)
            assert peak < model / 2


def test_materialize_needs_an_int_seed():
    """seed=None would initialise from each rank's own torch seed (replicas that differ); "0" is no seed either."""
    import pytest

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import materialize

    with torch.device("meta"):
        model = Transformer(TransformerConfig(**TINY))
    for seed in (None, "0", 1.0, True):
        with pytest.raises(ValueError, match=f"seed: expected an int, the same on every rank, got {seed!r}"):
            materialize(model, "cpu", seed=seed)
    assert materialize(model, "cpu", seed=3) is model and not model.embed.is_meta
    # a module whose reset_parameters takes no seed (nn.Linear's): refused before to_empty (it failed after emptying the weights)
    with torch.device("meta"):
        own = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"^model: expected a module with reset_parameters\(seed=\) \(fmoe.model.Transformer\), got Linear"):
        materialize(own, "cpu", seed=0)
    assert own.weight.is_meta

    class Own(torch.nn.Linear):  # one of one's own that takes the seed
        def reset_parameters(self, *, seed=None):
            if seed is not None:
                torch.nn.init.constant_(self.weight, float(seed))
                torch.nn.init.zeros_(self.bias)

    with torch.device("meta"):
        own = Own(4, 4)
    assert materialize(own, "cpu", seed=2).weight.eq(2.0).all()

    class Forwarding(Own):  # a wrapper passing seed= on through **kwargs: taken
        def reset_parameters(self, **kwargs):
            super().reset_parameters(**kwargs)

    with torch.device("meta"):
        own = Forwarding(4, 4)
    assert materialize(own, "cpu", seed=3).weight.eq(3.0).all()

    class Forgets(Own):  # a buffer its reset_parameters never writes: it held to_empty's memory (1e31 on one rank, 0 on another)
        def __init__(self, *args):
            super().__init__(*args)
            self.register_buffer("table", torch.zeros(3))
            self.register_buffer("steps", torch.zeros(3, dtype=torch.long))  # an integer one: not checked

    with torch.device("meta"):
        own = Forgets(4, 4)
    with pytest.raises(ValueError, match=r"^model: reset_parameters\(seed=\) left 'table' unwritten \(or NaN in part\): they would hold "
                                         r"the memory to_empty gave them, another on each rank; initialise every parameter and buffer"):
        materialize(own, "cpu", seed=0)
    class InPart(Own):  # a buffer written in part (its first entry)
        def __init__(self, *args):
            super().__init__(*args)
            self.register_buffer("part", torch.zeros(4))

        def reset_parameters(self, *, seed=None):
            super().reset_parameters(seed=seed)
            if seed is not None:
                self.part[:1] = 0.0

    with torch.device("meta"):
        own = InPart(4, 4)
    with pytest.raises(ValueError, match=r"^model: reset_parameters\(seed=\) left 'part' unwritten \(or NaN in part\)"):
        materialize(own, "cpu", seed=0)
    with torch.device("meta"):
        fmoe_own = Transformer(TransformerConfig(**TINY))
    fmoe_own.extra = Forgets(2, 2)
    fmoe_own.extra.register_buffer("more", torch.zeros(2))
    for i in range(4):
        fmoe_own.register_buffer(f"cache_{i}", torch.zeros(2))
    with pytest.raises(ValueError, match=r"^model: reset_parameters\(seed=\) left 'cache_0', 'cache_1', 'cache_2', 'cache_3' and 2 more "
                                         r"unwritten"):
        materialize(fmoe_own, "cpu", seed=0)


def _calls_without_gradients(rank, world):
    """Two models of one seed trained alike for 3 steps, one of them also evaluated (a
    no_grad forward and logits) before its optimizer is built and between each backward and
    step. The root unit (embedding, final norm, head) stays gathered after a forward for its
    backward; with no backward it stayed so: the optimizer built after the evaluation took
    the gathered copies (embed, head, norm never moved), and a forward after the step read
    the weights of before it (3.4337 for 2.9701)."""
    from torch.distributed.tensor import DTensor

    from fmoe.model import TransformerConfig
    from fmoe.optim import AdamW
    from fmoe.parallel import gathered
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(**dict(TINY, mtp_depth=0))
    g = torch.Generator().manual_seed(rank)
    batch = make_batch(torch.randint(0, cfg.vocab_size, (16,), generator=g), torch.tensor([0, 16]))
    losses = {}
    for evaluate in (False, True):
        model = _sharded(cfg, {}, seed=0)
        if evaluate:
            with torch.no_grad():
                model(batch, model.context(batch))
                model.logits(batch["input_ids"], batch["cu_seqlens"])
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        opt = AdamW(list(model.parameters()), lr=1e-2)
        for _ in range(3):
            out, _ = model(batch, model.context(batch))
            (out["lm_sum"] / 32).backward()
            if evaluate:
                with torch.no_grad():
                    model(batch, model.context(batch))
            opt.step()
            opt.zero_grad()
        out, _ = model(batch, model.context(batch))
        losses[evaluate] = (float(out["lm_sum"]), sharded)
    with torch.no_grad(), gathered(model):  # gathered() still keeps the root gathered between calls
        model(batch, model.context(batch))
        kept = not isinstance(model.embed, DTensor)
    return dict(losses=losses, kept=kept, after=isinstance(model.embed, DTensor))


def test_calls_without_gradients_leave_the_root_sharded():
    for r in run_distributed(_calls_without_gradients, 2, timeout=120):
        assert r["losses"][True] == r["losses"][False] and r["losses"][True][1], r
        assert r["kept"] and r["after"], r
