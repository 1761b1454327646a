"""The ops under torch.autocast: float32 inputs give what they give without it, on the torch
path as on the kernels' (custom ops, which autocast passes by). The torch paths' float32
matmuls and einsums ran in bf16 under autocast: sparse_attention's lse and indexer_scores
came back bf16 (sparse_attention_probs then refused that lse), and grouped_mlp,
grouped_matmul, the delta rule, the scan, linear_cross_entropy and fp8_matmul were 2e-3 to
6e-3 off their float32 definition on the CPU alone."""

import pytest
import torch
import torch.nn.functional as F

import fmoe.ops as ops
from fmoe.ops.delta import gated_delta_rule_loop


def _cases():
    gen = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    labels = torch.randint(0, 40, (5,), generator=gen)
    offsets = torch.tensor([3, 3, 8], dtype=torch.int32)
    index = torch.randint(0, 5, (3, 4), generator=gen)
    q, k = (F.normalize(r(1, 8, 2, 8), dim=-1) for _ in range(2))
    rule = [q, k, r(1, 8, 2, 8), -torch.rand(1, 8, 2, generator=gen), torch.rand(1, 8, 2, generator=gen)]
    scan = [r(1, 8, 4), torch.rand(1, 8, 4, generator=gen), -torch.rand(4, 3, generator=gen), r(1, 8, 3), r(1, 8, 3)]
    return {
        "linear_cross_entropy": (lambda impl, h, w: ops.linear_cross_entropy(h, w, labels, impl=impl), [r(5, 16), r(40, 16)]),
        "grouped_mlp": (lambda impl, x, a, b, c: ops.grouped_mlp(x, a, b, c, offsets, impl=impl),
                        [r(10, 16), r(3, 16, 16, scale=0.25), r(3, 16, 16, scale=0.25), r(3, 16, 16, scale=0.25)]),
        "grouped_matmul": (lambda impl, x, w: ops.grouped_matmul(x, w, offsets, impl=impl), [r(10, 16), r(3, 16, 16)]),
        "sparse_attention": (lambda impl, q, kv: ops.sparse_attention(q, kv, index, v_dim=8, impl=impl), [r(3, 2, 16), r(5, 16)]),
        "indexer_scores": (lambda impl, q, w, kv: ops.indexer_scores(q, w, kv, impl=impl), [r(3, 2, 16), r(3, 2), r(5, 16)]),
        "gated_delta_rule": (lambda impl, *xs: ops.gated_delta_rule(*xs, chunk_size=4, impl=impl, final_state=True), rule),
        "gated_delta_rule_loop": (lambda impl, *xs: gated_delta_rule_loop(*xs, final_state=True), rule),
        "gated_linear_attention": (lambda impl, *xs: ops.gated_linear_attention(*xs[:4], chunk_size=4, impl=impl), rule),
        "selective_scan": (lambda impl, *xs: ops.selective_scan(*xs, chunk_size=4, impl=impl), scan),
        "fp8_matmul": (lambda impl, x, w: ops.fp8_matmul(x, w, impl="torch" if impl == "torch" else "auto"), [r(6, 32), r(32, 16)]),
    }


CASES = _cases()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_float32_inputs_under_autocast_give_their_float32_results(name, impl):
    fn, inputs = CASES[name]
    leaves = [x.clone().requires_grad_() for x in inputs]
    plain = fn(impl, *leaves)
    plain = plain if isinstance(plain, tuple) else (plain,)
    def grads_of(out):  # indexer_scores carries no gradient (its loss trains the indexer apart)
        return torch.autograd.grad(out.float().square().sum(), leaves, allow_unused=True) if out.requires_grad else ()

    grads = grads_of(plain[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward under it, the backward after (as torch's AMP recipe)
        cast = fn(impl, *leaves)
    cast = cast if isinstance(cast, tuple) else (cast,)
    cast_grads = grads_of(cast[0])
    assert [t.dtype for t in cast] == [t.dtype for t in plain] == [torch.float32] * len(plain), (name, [t.dtype for t in cast])
    for a, b in zip(cast + cast_grads, plain + grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sparse_attention_probs_takes_the_lse_sparse_attention_gave_under_autocast(impl):
    """The probabilities of the forward's lse (DeepSeek sparse attention's indexer loss): the
    torch path's bf16 lse was refused ("lse: expected sparse_attention's float32")."""
    q, kv, index = torch.randn(3, 2, 16), torch.randn(5, 16), torch.randint(0, 5, (3, 4))
    _, lse = ops.sparse_attention(q, kv, index, v_dim=8, impl=impl)
    plain = ops.sparse_attention_probs(q, kv, index, lse, v_dim=8, impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, lse = ops.sparse_attention(q, kv, index, v_dim=8, impl=impl)
        probs = ops.sparse_attention_probs(q, kv, index, lse, v_dim=8, impl=impl)
    assert lse.dtype == probs.dtype == torch.float32
    torch.testing.assert_close(probs, plain, rtol=1e-6, atol=1e-6)


def test_autocast_is_back_on_after_an_op():
    """autocast_off leaves the caller's autocast as it was: the matmul after the op runs in bf16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops.grouped_matmul(torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([2, 4], dtype=torch.int32), impl="torch")
        assert torch.is_autocast_enabled("cpu") and (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.bfloat16
