"""Mixed precision done right on one process: FSDP2's mixed precision over a group of one
(what examples/train_moe.py does with --dtype=bfloat16, and on one CUDA device by default)
keeps float32 master weights and sums micro-batch gradients in float32 (the router's, computed
in float32, and every other one) while computing in bf16; an update
far below bf16's resolution accumulates, where a model cast to bf16 loses it."""

import math

import torch

from tests.parallel.dist import run_distributed

TINY = dict(vocab_size=64, hidden=32, n_layers=2, n_dense=1, ffn_dense=64, n_experts=4, k=2, ffn_expert=32,
            n_shared=1, n_heads=4, n_kv_heads=2, head_dim=8, mtp_depth=1)
STEPS, LR = 20, 1e-5  # 20 updates of ~1e-5: under half of bf16's spacing (1.2e-4) at |w| ~ 0.02


def _train(model, batch, steps):
    from fmoe.optim import AdamW

    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    seen = {}
    for _ in range(steps):
        losses, stats = model(batch)
        ((losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / losses["lm_tokens"]).backward()
        seen = {n: p.grad.dtype for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def _check(rank, world):
    from torch.distributed.tensor import DTensor

    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import build_meshes, materialize, parallelize
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(**TINY)
    g = torch.Generator().manual_seed(1)
    batch = make_batch(torch.randint(0, 64, (32,), generator=g), torch.tensor([0, 11, 32]), 1)
    name = "blocks.0.attn.wq"

    # master weights: float32 parameters (DTensors over a mesh of one), bf16 compute
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, build_meshes(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    materialize(model, "cpu", seed=0)
    # gradient sums across micro-batches: float32, exactly g1 + g2 (not a bf16 sum)
    batch2 = make_batch(torch.randint(0, 64, (32,), generator=g), torch.tensor([0, 20, 32]), 1)
    sums = {}
    for part in ([batch], [batch2], [batch, batch2]):
        for b in part:
            losses, _ = model(b)
            ((losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / 32).backward()
        sums[len(sums)] = {n: model.get_parameter(n).grad.full_tensor().clone() for n in (name, "blocks.1.mlp.router")}
        model.zero_grad(set_to_none=True)
    accumulated = {}
    for n in (name, "blocks.1.mlp.router"):
        exact = sums[0][n] + sums[1][n]
        accumulated[n] = (sums[2][n].dtype == torch.float32 and torch.equal(sums[2][n], exact),
                          not torch.equal(exact, exact.bfloat16().float()))
    compute = {}
    model.blocks[0].attn.register_forward_hook(lambda m, args, out: compute.update(attn=out.dtype))
    before = model.get_parameter(name).full_tensor().clone()
    grad_dtypes = _train(model, batch, STEPS)
    after = model.get_parameter(name).full_tensor()

    # the same model cast to bf16 (no master copy): the same tiny updates round away
    plain = Transformer(cfg)
    plain.reset_parameters(seed=0)
    plain = plain.to(torch.bfloat16)
    plain_before = plain.get_parameter(name).detach().clone()
    _train(plain, batch, STEPS)
    plain_after = plain.get_parameter(name).detach()
    large = plain_before.abs() > 0.01
    return dict(
        param_dtypes={str(p.dtype) for p in model.parameters()},
        all_dtensors=all(isinstance(p, DTensor) for p in model.parameters()),
        grad_dtypes={str(d) for d in grad_dtypes.values()},
        compute=str(compute["attn"]),
        accumulated=accumulated,
        init_equal=torch.equal(before, _init(cfg, name)),
        master_step=float((after - before).abs().mean()),
        bf16_of_master_changed=float((after.bfloat16() != before.bfloat16()).float().mean()),
        plain_changed_large=int((plain_after != plain_before)[large].sum()),
        plain_large=int(large.sum()),
    )


def _init(cfg, name):
    from fmoe.model import Transformer

    model = Transformer(cfg)
    model.reset_parameters(seed=0)
    return model.get_parameter(name).detach()


def test_master_weights_accumulate_updates_below_bf16_resolution():
    (out,) = run_distributed(_check, 1, timeout=200)
    print(out)
    assert out["param_dtypes"] == {"torch.float32"} and out["all_dtensors"] and out["init_equal"], out
    assert out["grad_dtypes"] == {"torch.float32"}, out  # summed in float32, never held in bf16
    assert out["compute"] == "torch.bfloat16", out
    # (summed in float32, and a sum that bf16 could not hold)
    assert all(exact and not_bf16 for exact, not_bf16 in out["accumulated"].values()), out
    # every update kept: the mean move is about STEPS * LR (Adam's steps are ~LR each)
    assert out["master_step"] > 0.3 * STEPS * LR, out
    assert out["bf16_of_master_changed"] > 0.5, out  # and the bf16 compute copy follows
    # cast to bf16, the weights above 0.01 in size never move
    assert out["plain_large"] > 100 and out["plain_changed_large"] == 0, out


def _hyper_connections(rank, world):
    """A model with hyper-connections under FSDP2's bf16 compute: what each HyperConnection
    computes with and sees, and the streams' dtype between blocks."""
    from fmoe.model import HyperConnection, Transformer, TransformerConfig
    from fmoe.parallel import build_meshes, materialize, parallelize
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(**{**TINY, "mtp_depth": 0, "hyper_connections": 3})
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, build_meshes(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    materialize(model, "cpu", seed=0)
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, HyperConnection):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.update({name: (str(m.fn.dtype), str(m.scale.dtype), str(args[0].dtype))}))
    streams = set()
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: streams.add((tuple(out[0].shape), str(out[0].dtype))))
    batch = make_batch(torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 11, 32]), 0)
    losses, _ = model(batch)
    (losses["lm_sum"] / 32).backward()
    grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if "hc" in n}
    return dict(seen=seen, streams=streams, grads=grads, loss=float(losses["lm_sum"]))


def _latent_moe(rank, world):
    """A latent MoE (moe_latent) under FSDP2's bf16 compute, and the same model in float32."""
    from fmoe.model import Transformer, TransformerConfig
    from fmoe.parallel import build_meshes, materialize, parallelize
    from fmoe.train.data import make_batch

    cfg = TransformerConfig(**{**TINY, "mtp_depth": 0, "moe_latent": 16})
    batch = make_batch(torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 11, 32]), 0)
    with torch.device("meta"):
        model = Transformer(cfg)
    parallelize(model, build_meshes(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    materialize(model, "cpu", seed=0)
    losses, _ = model(batch)
    (losses["lm_sum"] / 32).backward()
    grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if "latent" in n}
    plain = Transformer(cfg)
    plain.reset_parameters(seed=0)
    with torch.no_grad():
        ref, _ = plain(batch)
    return dict(loss=float(losses["lm_sum"]), ref=float(ref["lm_sum"]), grads=grads)


def test_latent_moe_computes_in_bf16_with_float32_weights():
    """The latent projections live in the MoE's own FSDP2 unit, which is not cast (the
    router's float32): they were handed to the MoE in float32 beside bf16 tokens, and the
    first forward stopped ("a latent MoE needs latent_in ... in x's dtype"). They compute in
    the tokens' dtype, their gradients float32, the loss the float32 model's to bf16's
    precision."""
    (out,) = run_distributed(_latent_moe, 1, timeout=200)
    assert len(out["grads"]) == 2 * (TINY["n_layers"] - TINY["n_dense"]) and set(out["grads"].values()) == {"torch.float32"}, out
    assert abs(out["loss"] - out["ref"]) < 2e-2 * abs(out["ref"]), out


def test_hyper_connection_weights_stay_float32_under_bf16_compute():
    """The streams' weights (fn, base, scale: FSDP2 units of their own, never cast, like the
    router) compute in float32 while the blocks and the [T, 3 H] streams between them are
    bf16; their gradients float32."""
    (out,) = run_distributed(_hyper_connections, 1, timeout=200)
    assert len(out["seen"]) == 2 * TINY["n_layers"] + 1, out  # every block's two and the head's
    assert all(fn == scale == "torch.float32" for fn, scale, _ in out["seen"].values()), out
    assert {x for _, _, x in out["seen"].values()} == {"torch.bfloat16"}, out
    assert out["streams"] == {((32, 3 * TINY["hidden"]), "torch.bfloat16")}, out
    assert set(out["grads"].values()) == {"torch.float32"} and len(out["grads"]) == 3 * (2 * TINY["n_layers"] + 1), out
    assert math.isfinite(out["loss"]), out
