"""The reference transformer: each feature on and off, losses as sums, and it learns."""

import dataclasses

import pytest
import torch

import fmoe.ops as ops
from fmoe.model import Transformer, TransformerConfig

TINY = TransformerConfig(vocab_size=40, hidden=32, n_layers=3, n_dense=1, ffn_dense=48, n_experts=4, k=2,
                         ffn_expert=16, n_shared=1, n_heads=4, n_kv_heads=2, head_dim=8, impl="torch")
VARIANTS = {
    "default": TINY,
    "softmax aux, no shared, no bias": dataclasses.replace(TINY, score="softmax", expert_bias=False, n_shared=0),
    "groups, scale, capacity": dataclasses.replace(TINY, n_groups=2, topk_groups=1, route_scale=2.5, capacity_factor=1.0),
    "yarn, mtp 2": dataclasses.replace(TINY, yarn_factor=4.0, yarn_original_max_positions=8, mtp_depth=2),
    "all dense": dataclasses.replace(TINY, n_dense=3),
    "all moe, triton": dataclasses.replace(TINY, n_dense=0, impl="triton"),
}


def _batch(cfg, T=24, cu=(0, 7, 8, 24)):
    tokens = torch.randint(0, cfg.vocab_size, (T,))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    targets = ops.mtp_targets(tokens, cu_seqlens, cfg.mtp_depth)
    main = targets[0]
    return dict(input_ids=main["input_ids"], labels=main["labels"], loss_mask=main["loss_mask"],
                cu_seqlens=cu_seqlens, positions=main["positions"], mtp=targets[1:])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_backward_each_feature(name):
    cfg = VARIANTS[name]
    model = Transformer(cfg)
    batch = _batch(cfg)
    losses, stats = model(**batch)
    n_valid = int(batch["loss_mask"].sum())
    assert int(losses["lm_tokens"]) == n_valid == 24 - 3  # the last token of each document has no label
    mean = losses["lm_sum"].detach() / losses["lm_tokens"]
    assert abs(float(mean) - torch.log(torch.tensor(float(cfg.vocab_size)))) < 0.5  # near uniform at init
    total = losses["lm_sum"]
    for d in range(1, cfg.mtp_depth + 1):
        # depth d predicts d + 1 tokens ahead: a document of length n keeps n - d - 1 labels
        assert int(losses[f"mtp_{d}_tokens"]) == sum(max(0, n - d - 1) for n in (7, 1, 16))
        total = total + losses[f"mtp_{d}_sum"]
    moe_layers = [i for i in range(cfg.n_layers) if i >= cfg.n_dense]
    assert sorted(stats.keys()) == sorted([f"layer_{i}" for i in moe_layers] + [f"mtp_{d}" for d in range(1, cfg.mtp_depth + 1) if moe_layers])
    assert sorted(model.moe_layers()) == sorted(stats.keys())  # the bias update finds each layer's counts by name
    for key in stats.keys():
        assert int(stats[key]["tokens_per_expert"].sum()) <= 24 * cfg.k
    total.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    if cfg.expert_bias:
        assert all(m.expert_bias.dtype == torch.float32 for m in model.moe_layers().values())


def test_loss_of_a_document_does_not_depend_on_packing():
    model = Transformer(TINY)
    doc = torch.randint(0, TINY.vocab_size, (9,))
    other = torch.randint(0, TINY.vocab_size, (5,))

    def loss(tokens, cu):
        cu = torch.tensor(cu, dtype=torch.int32)
        t = ops.mtp_targets(tokens, cu, 0)[0]
        return model(t["input_ids"], t["labels"], t["loss_mask"], cu, t["positions"])[0]["lm_sum"]

    alone = loss(doc, [0, 9])
    both = loss(torch.cat([other, doc]), [0, 5, 14])
    torch.testing.assert_close(both - loss(other, [0, 5]), alone, rtol=1e-4, atol=1e-4)


def test_init_scales_output_projections_and_zeroes_biases():
    model = Transformer(dataclasses.replace(TINY, hidden=64, n_layers=8, n_dense=4))
    block = model.blocks[5]
    assert abs(float(block.attn.wq.detach().std()) - 0.02) < 0.003
    assert abs(float(block.attn.wo.detach().std()) - 0.02 / 4) < 0.001  # / sqrt(2 * 8)
    assert torch.equal(block.attn_norm.weight, torch.ones(64))
    assert torch.equal(block.mlp.expert_bias, torch.zeros(TINY.n_experts))


def test_a_few_steps_of_training_lower_the_loss():
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, mtp_depth=1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = _batch(cfg, T=48, cu=(0, 20, 48))
    first = None
    for _ in range(30):
        losses, _ = model(**batch)
        loss = (losses["lm_sum"] + 0.1 * losses["mtp_1_sum"]) / losses["lm_tokens"]
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first


def test_bad_configs():
    with pytest.raises(ValueError, match="n_dense: expected 0..n_layers"):
        TransformerConfig(n_layers=2, n_dense=3)
    with pytest.raises(ValueError, match="expert_bias: needs score='sigmoid'"):
        TransformerConfig(score="softmax")
    with pytest.raises(ValueError, match="hidden: expected a positive int"):
        TransformerConfig(hidden=0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        TransformerConfig(n_heads=4, n_kv_heads=3)
    model = Transformer(dataclasses.replace(TINY, mtp_depth=1))
    with pytest.raises(ValueError, match="mtp: expected targets for 1 MTP depths, got 0"):
        model(**dict(_batch(TINY), mtp=()))
