"""The value-check rule of fmoe/ops/checks.py, op by op, and the host reads of a MoE step.

Every public op that reads tensor values to validate them takes a keyword-only check=True.
With check=False its forward and backward read nothing on the host (counted on CPU, where
the count is the number of device->host syncs the same code makes on a GPU); with
check=True a bad value still raises the ValueError naming the argument.
"""

import inspect
from typing import Callable, NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

import tensordict.nn  # noqa: F401  (its import reads a tensor value, once per process: mtp_targets imports it on first call)

import fmoe.ops as F
from fmoe.train.metrics import HostReads


class Case(NamedTuple):
    """run(check): the op on good inputs (float inputs require grad) -> a tensor, a tuple
    of tensors or a list of TensorDicts; bad(): the op, default check, on a bad value, which
    must raise a ValueError matching `match` (it names the argument)."""

    run: Callable
    bad: Callable
    match: str


T, H, E, K = 13, 16, 6, 2


def _cu():
    return torch.tensor([0, 4, 4, 9, T], dtype=torch.int32)


def _routes():
    return F.route(torch.randn(T, E, requires_grad=True), K, check=False)


def _grouped(check, offsets):
    x = torch.randn(T * K, H, requires_grad=True)
    w_gate, w_up = torch.randn(E, H, 8, requires_grad=True), torch.randn(E, H, 8, requires_grad=True)
    w_down = torch.randn(E, 8, H, requires_grad=True)
    return F.grouped_mlp(x, w_gate, w_up, w_down, offsets, check=check)


def _offsets():
    return torch.tensor([3, 3, 10, 14, 20, 24], dtype=torch.int32)


def _rule_inputs(beta: bool, g_sign: float = -1.0):
    """q, k, v, g (and beta) of the delta rule / linear attention over T tokens, one row, 2 heads."""
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, 2, 4), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, 2, 3, requires_grad=True)
    g = (g_sign * torch.rand(1, T, 2)).requires_grad_()
    return (q, k, v, g, torch.rand(1, T, 2, requires_grad=True)) if beta else (q, k, v, g)


def _scan_inputs():
    """u, dt (> 0), A (< 0), b, c of the selective scan over T tokens, one row, 3 channels, a state of 2."""
    return (torch.randn(1, T, 3, requires_grad=True), (0.1 + torch.rand(1, T, 3)).requires_grad_(), (-0.5 - torch.rand(3, 2)).requires_grad_(),
            torch.randn(1, T, 2, requires_grad=True), torch.randn(1, T, 2, requires_grad=True))


def _scores_experts():
    logits = torch.randn(T, E, requires_grad=True)
    return F.aux_scores(logits, K)


CASES = {
    "sparsemixer_route": Case(
        run=lambda check: F.sparsemixer_route(torch.randn(T, E, requires_grad=True), eps=0.1, check=check),
        bad=lambda: F.sparsemixer_route(torch.tensor([[0.0, float("nan"), 1.0]]), eps=0.1),
        match=r"logits: contains NaN",
    ),
    "route": Case(
        run=lambda check: F.route(torch.randn(T, E, requires_grad=True), K, score="sigmoid", check=check),
        bad=lambda: F.route(torch.tensor([[0.0, float("nan"), 1.0]]), 2, score="sigmoid"),
        match=r"logits: contains NaN",
    ),
    "hash_route": Case(
        run=lambda check: F.hash_route(torch.randn(T, E, requires_grad=True), torch.arange(T) % 5, torch.arange(10).view(5, 2) % E,
                                       score="sqrtsoftplus", check=check),
        bad=lambda: F.hash_route(torch.randn(2, E), torch.tensor([0, 5]), torch.arange(10).view(5, 2) % E),
        match=r"token_ids: expected ids in 0\.\.4 \(the table's rows\), got 5",
    ),
    "drop_by_capacity": Case(
        run=lambda check: F.drop_by_capacity(_routes(), E, 1.0, check=check),
        bad=lambda: F.drop_by_capacity(F.Routes(torch.rand(2, 2), torch.tensor([[0, 1], [2, E]])), E, 1.0),
        match=r"routes\.experts: ids must lie in -1\.\.5",
    ),
    "permute": Case(
        run=lambda check: F.permute(torch.randn(T, H, requires_grad=True), _routes().experts, E, align=4, check=check),
        bad=lambda: F.permute(torch.randn(2, H), torch.tensor([[0, 1], [-2, 3]]), E),
        match=r"experts: ids must lie in -1\.\.5",
    ),
    "grouped_mlp": Case(
        run=lambda check: _grouped(check, _offsets()),
        bad=lambda: _grouped(True, torch.tensor([3, 2, 10, 14, 20, 24], dtype=torch.int32)),
        match=r"offsets: must be non-decreasing",
    ),
    "grouped_matmul": Case(
        run=lambda check: F.grouped_matmul(torch.randn(T * K, H, requires_grad=True), torch.randn(E, H, 8, requires_grad=True), _offsets(),
                                           check=check),
        bad=lambda: F.grouped_matmul(torch.randn(T * K, H), torch.randn(E, H, 8), torch.tensor([3, 3, 10, 14, 20, 27], dtype=torch.int32)),
        match=r"offsets: the last expert's rows end at 27, past x_perm's 26 rows",
    ),
    "cross_entropy": Case(
        run=lambda check: F.cross_entropy(torch.randn(T, 10, requires_grad=True), torch.randint(0, 10, (T,)), check=check),
        bad=lambda: F.cross_entropy(torch.randn(2, 10), torch.tensor([3, 10])),
        match=r"labels: 1 label\(s\) outside \[0, 10\)",
    ),
    "linear_cross_entropy": Case(
        run=lambda check: F.linear_cross_entropy(
            torch.randn(T, H, requires_grad=True), torch.randn(10, H, requires_grad=True), torch.randint(0, 10, (T,)), check=check
        ),
        bad=lambda: F.linear_cross_entropy(torch.randn(2, H), torch.randn(10, H), torch.tensor([-1, 3])),
        match=r"labels: 1 label\(s\) outside \[0, 10\)",
    ),
    "seq_load_balancing_loss": Case(
        run=lambda check: F.seq_load_balancing_loss(*_scores_experts(), _cu(), k=K, check=check),
        bad=lambda: F.seq_load_balancing_loss(*_scores_experts(), torch.tensor([0, 9, 4, T]), k=K),
        match=r"cu_seqlens: must be non-decreasing",
    ),
    "roll_packed": Case(
        run=lambda check: F.roll_packed(torch.randn(T, H, requires_grad=True), _cu(), check=check),
        bad=lambda: F.roll_packed(torch.randn(T, H), torch.tensor([1, 4, T])),
        match=r"cu_seqlens: must start at 0",
    ),
    "positions_from_cu_seqlens": Case(
        run=lambda check: F.positions_from_cu_seqlens(_cu(), n_tokens=T, check=check),
        bad=lambda: F.positions_from_cu_seqlens(_cu(), n_tokens=T + 1),
        match=r"cu_seqlens: must end at the token count 14",
    ),
    "sparse_attention": Case(
        run=lambda check: F.sparse_attention(torch.randn(T, 2, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True),
                                             torch.randint(-1, 5, (T, 3)), v_dim=4, check=check),
        bad=lambda: F.sparse_attention(torch.randn(2, 2, 8), torch.randn(5, 8), torch.tensor([[0, 5], [1, -1]])),
        match=r"index: expected keys in 0 \.\. S-1 = 4 or -1",
    ),
    "sparse_attention_probs": Case(
        run=lambda check: F.sparse_attention_probs(torch.randn(T, 2, 8), torch.randn(5, 8), torch.randint(-1, 5, (T, 3)),
                                                   torch.randn(T, 2), v_dim=4, check=check),
        bad=lambda: F.sparse_attention_probs(torch.randn(2, 2, 8), torch.randn(5, 8), torch.tensor([[0, 5], [1, -1]]), torch.randn(2, 2)),
        match=r"index: expected keys in 0 \.\. S-1 = 4 or -1",
    ),
    "gated_delta_rule": Case(
        run=lambda check: F.gated_delta_rule(*_rule_inputs(beta=True), _cu(), chunk_size=4, check=check),
        bad=lambda: F.gated_delta_rule(*_rule_inputs(beta=True), torch.tensor([0, 9, 4, T])),
        match=r"cu_seqlens: must be non-decreasing",
    ),
    "gated_linear_attention": Case(
        run=lambda check: F.gated_linear_attention(*_rule_inputs(beta=False), _cu(), chunk_size=4, check=check),
        bad=lambda: F.gated_linear_attention(*_rule_inputs(beta=False, g_sign=1.0)),
        match=r"g: expected the log of each token's decay of the state, <= 0",
    ),
    "selective_scan": Case(
        run=lambda check: F.selective_scan(*_scan_inputs(), _cu(), check=check),
        bad=lambda: F.selective_scan(*_scan_inputs(), torch.tensor([1, 4, T])),
        match=r"cu_seqlens: must start at 0",
    ),
    "mtp_targets": Case(
        run=lambda check: F.mtp_targets(torch.randint(0, 50, (T,)), _cu(), 2, check=check),
        bad=lambda: F.mtp_targets(torch.randint(0, 50, (T,)), torch.tensor([0, 5, T - 1]), 2),
        match=r"cu_seqlens: must end at the token count 13",
    ),
}


def _float_outputs(out):
    """The differentiable tensors among an op's outputs."""
    if isinstance(out, torch.Tensor):
        out = [out]
    flat = []
    for item in out:
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, tuple):
            flat.extend(t for t in item if isinstance(t, torch.Tensor))
    return [t for t in flat if t.requires_grad]


def _forward_backward(case, check):
    """The op's forward and, where it is differentiable, its backward under a random
    upstream gradient; returns how many outputs were differentiated."""
    outs = _float_outputs(case.run(check))
    if outs:
        torch.autograd.backward(outs, [torch.randn_like(t) for t in outs])
    return len(outs)


def test_every_op_with_value_checks_is_listed():
    """The keyword is `check`, keyword-only, default True; the old names are gone."""
    for name, fn in inspect.getmembers(F, callable):
        params = inspect.signature(fn).parameters if inspect.isfunction(fn) else {}
        assert not {"check_nan", "check_offsets", "check_labels"} & set(params), name
        if "check" in params:
            assert name in CASES, name
            assert params["check"].kind == inspect.Parameter.KEYWORD_ONLY and params["check"].default is True, name
    assert all(hasattr(F, name) and "check" in inspect.signature(getattr(F, name)).parameters for name in CASES)


@pytest.mark.parametrize("name", CASES)
def test_check_false_reads_nothing_on_the_host(name):
    with HostReads() as reads:
        n_diff = _forward_backward(CASES[name], check=False)
    assert reads.count == 0, reads.sites
    assert n_diff > 0 or name in ("positions_from_cu_seqlens", "mtp_targets", "sparse_attention_probs")  # no gradient


@pytest.mark.parametrize("name", CASES)
def test_check_true_reads_the_values(name):
    """What check=False saves: the default reads the values (so the test above is not vacuous)."""
    with HostReads() as reads:
        _forward_backward(CASES[name], check=True)
    assert reads.count > 0


@pytest.mark.parametrize("name", CASES)
def test_check_true_still_raises_on_bad_values(name):
    with pytest.raises(ValueError, match=CASES[name].match):
        CASES[name].bad()


def test_checks_are_skipped_while_compiling():
    """Under torch.compile no value is read: the bad value passes the trace (dropped ids)."""
    experts = torch.tensor([[0, 1], [2, E]])
    compiled = torch.compile(lambda w, e: F.drop_by_capacity(F.Routes(w, e), E, 1.0).experts, backend="eager", fullgraph=True)
    assert compiled(torch.rand(2, 2), experts).tolist() == [[0, 1], [2, -1]]


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


META_CALLS = {  # the default check=True on tensors with no values (a model built on the meta device)
    "route": lambda: F.route(_meta(T, E), K).weights,
    "hash_route": lambda: F.hash_route(_meta(T, E), _meta(T, dtype=torch.long), _meta(5, K, dtype=torch.long)).weights,
    "drop_by_capacity": lambda: F.drop_by_capacity(F.Routes(_meta(T, K), _meta(T, K, dtype=torch.long)), E, 1.0).experts,
    "permute": lambda: F.permute(_meta(T, H), _meta(T, K, dtype=torch.long), E)[0],
    "cross_entropy": lambda: F.cross_entropy(_meta(T, 10), _meta(T, dtype=torch.long)),
    "linear_cross_entropy": lambda: F.linear_cross_entropy(_meta(T, H), _meta(10, H), _meta(T, dtype=torch.long)),
    "seq_load_balancing_loss": lambda: F.seq_load_balancing_loss(_meta(T, E), _meta(T, K, dtype=torch.long),
                                                                 _meta(3, dtype=torch.int32), k=K),
    "roll_packed": lambda: F.roll_packed(_meta(T, H), _meta(3, dtype=torch.int32)),
    "sparse_attention": lambda: F.sparse_attention(_meta(T, 2, 8), _meta(5, 8), _meta(T, 3, dtype=torch.long), v_dim=4)[0],
    # "auto" on meta: torch._grouped_mm's shapes (the per-expert loop would read offsets)
    "grouped_mlp": lambda: F.grouped_mlp(_meta(T, H), _meta(E, H, 8), _meta(E, H, 8), _meta(E, 8, H), _meta(E, dtype=torch.int32)),
    "grouped_matmul": lambda: F.grouped_matmul(_meta(T, H), _meta(E, H, 8), _meta(E, dtype=torch.int32)),
    "positions_from_cu_seqlens": lambda: F.positions_from_cu_seqlens(_meta(3, dtype=torch.int32), n_tokens=T),
    "mtp_targets": lambda: F.mtp_targets(_meta(T, dtype=torch.long), _meta(3, dtype=torch.int32), 1)[1]["labels"],
}


@pytest.mark.parametrize("name", META_CALLS)
def test_check_true_reads_no_value_of_a_meta_tensor(name):
    """Value checks skip tensors on the meta device (nothing to read) instead of failing in
    .item() / .tolist() ("cannot be called on meta tensors"); the op's shapes still come out."""
    out = META_CALLS[name]()
    assert out.is_meta


@pytest.mark.parametrize("name", META_CALLS)
def test_check_true_reads_no_value_of_a_fake_tensor(name, monkeypatch):
    """Under torch's FakeTensorMode (shapes without values, as a tracer or a memory planner
    runs a model) as on the meta device: the default check=True raised torch's
    DataDependentOutputException from its host read."""
    monkeypatch.setitem(globals(), "_meta", lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype))
    with FakeTensorMode():
        out = META_CALLS[name]()
    assert is_fake(out)


def test_what_needs_values_says_so_on_meta_and_fake_tensors():
    """positions_from_cu_seqlens without n_tokens reads T from cu_seqlens, and grouped_mlp's
    "torch" loop reads offsets: on tensors without values each names what to pass instead
    (torch's "cannot be called on meta tensors" / "no data!" before)."""
    for make in (_meta, lambda *shape, dtype: FakeTensorMode().from_tensor(torch.empty(*shape, dtype=dtype))):
        with pytest.raises(ValueError, match="n_tokens: needed where cu_seqlens holds no values .* pass n_tokens=T"):
            F.positions_from_cu_seqlens(make(3, dtype=torch.int32))
        x, w, offsets = make(T, H, dtype=torch.float32), make(E, H, 8, dtype=torch.float32), make(E, dtype=torch.int32)
        with pytest.raises(ValueError, match="impl: 'torch' loops over the experts by offsets read on the host.* impl='auto'"):
            F.grouped_mlp(x, w, w, make(E, 8, H, dtype=torch.float32), offsets, impl="torch", check=False)


def test_checking_names_the_meta_tensors_only():
    assert F.checks.checking(True, torch.ones(1), None) and not F.checks.checking(True, torch.ones(1), _meta(1))
    assert not F.checks.checking(False, torch.ones(1))


MIXED_DEVICES = [  # an op's second tensor on another device than the first: a ValueError naming it
    ("counts", lambda: F.load_balancing_loss(torch.rand(T, E), _meta(E), k=K, n_tokens=T)),
    ("experts", lambda: F.seq_load_balancing_loss(torch.rand(T, E), _meta(T, K, dtype=torch.long), _cu(), k=K, check=False)),
    ("routes.experts", lambda: F.drop_by_capacity(F.Routes(torch.rand(T, K), _meta(T, K, dtype=torch.long)), E, 1.0, check=False)),
    ("routes.experts", lambda: F.split_zero_experts(F.Routes(torch.rand(T, K), _meta(T, K, dtype=torch.long)), E)),
    ("lse", lambda: F.sparse_attention_probs(torch.randn(T, 2, 8), torch.randn(5, 8), torch.randint(-1, 5, (T, 3)), _meta(T, 2), v_dim=4)),
    ("positions", lambda: F.mtp_targets(torch.randint(0, 50, (T,)), _cu(), 1, positions=_meta(T, dtype=torch.long))),
    ("loss_mask", lambda: F.mtp_targets(torch.randint(0, 50, (T,)), _cu(), 1, loss_mask=_meta(T, dtype=torch.bool))),
]


@pytest.mark.parametrize("name, call", MIXED_DEVICES, ids=[f"{i}-{n}" for i, (n, _) in enumerate(MIXED_DEVICES)])
def test_tensors_on_another_device_are_named(name, call):
    """Before, these failed in a torch kernel ("not on the expected device") or, for
    mtp_targets, came back as TensorDicts holding tensors of two devices."""
    with pytest.raises(ValueError, match=rf"^{name}: expected device cpu like [\w.]+, got meta"):
        call()


# ---------------------------------------------------------------------------- a MoE step


def _moe_step(*, score, align, capacity_factor, grouped, tp_counts, impl, device):
    """One micro-batch through every op a MoE transformer uses, as its forward and backward
    call them (check=False, T known from the shapes): attention inputs with RoPE, a routed
    SwiGLU MoE with a shared expert, the aux losses, and the LM loss on rolled labels."""
    torch.manual_seed(0)
    T, H, E, k, V, heads, head_dim = 21, 16, 8, 2, 50, 2, 8
    cu = torch.tensor([0, 7, 7, 15, T], dtype=torch.int32, device=device)
    tokens = torch.randint(0, V, (T,), device=device)
    leaves = {
        "emb": torch.randn(V, H), "qk": torch.randn(H, 2 * heads * head_dim) / H**0.5, "router": torch.randn(H, E) / H**0.5,
        "w_gate": torch.randn(E, H, 24) / H**0.5, "w_up": torch.randn(E, H, 24) / H**0.5, "w_down": torch.randn(E, 24, H) / 24**0.5,
        "shared_gate": torch.randn(H, 24) / H**0.5, "shared_up": torch.randn(H, 24) / H**0.5, "head": torch.randn(V, H) / H**0.5,
    }
    p = {name: t.to(device).requires_grad_() for name, t in leaves.items()}
    bias = torch.zeros(E, device=device) if score == "sigmoid" else None
    groups = dict(n_groups=4, topk_groups=2) if grouped else {}
    i = dict(impl=impl)

    with HostReads() as reads:
        positions = F.positions_from_cu_seqlens(cu, n_tokens=T, check=False)
        labels = F.roll_packed(tokens, cu, fill=-100, check=False, **i)
        x = p["emb"][tokens]
        cos, sin = F.rope_cos_sin(positions, F.rope_inv_freq(head_dim, device=device))
        q, key = (x @ p["qk"]).view(T, 2, heads, head_dim).unbind(1)
        attn = (F.apply_rope(q, cos, sin, **i) * F.apply_rope(key, cos, sin, **i)).sum((1, 2))[:, None]
        h = x + attn * 0.01 + 0.1 * F.roll_packed(x, cu, shift=1, check=False, **i)

        logits = h @ p["router"]
        routes = F.route(logits, k, score=score, expert_bias=bias, **groups, check=False, **i)
        if capacity_factor is not None:
            routes = F.drop_by_capacity(routes, E, capacity_factor, check=False)
        scores, aux_experts = F.aux_scores(logits, k, score=score, **i)
        counts = F.tokens_per_expert(aux_experts, E)
        n_tokens = torch.tensor(T, device=device) if tp_counts else T  # counts summed over a group: a tensor
        aux = F.load_balancing_loss(scores, counts, k=k, n_tokens=n_tokens)
        aux = aux + F.seq_load_balancing_loss(scores, aux_experts, cu, k=k, check=False) + F.z_loss(logits, **i)
        x_perm, plan = F.permute(h, routes.experts, E, align=align, check=False, **i)
        y_perm = F.grouped_mlp(x_perm, p["w_gate"], p["w_up"], p["w_down"], plan.offsets, check=False, **i)
        shared = F.swiglu(h @ p["shared_gate"], h @ p["shared_up"], **i) @ p["shared_gate"].T
        h = h + F.unpermute(y_perm, plan, routes.weights, **i) + shared

        lm = F.linear_cross_entropy(h, p["head"], labels, reduction="sum", check=False, **i)
        lm = lm + F.cross_entropy(h @ p["head"].T, labels, check=False, **i)
        stats = F.load_stats(F.tokens_per_expert(routes.experts, E), T * k)
        (lm + 0.01 * aux).backward()
    return reads, stats, p


@pytest.mark.parametrize(
    "score, align, capacity_factor, grouped, tp_counts",
    [("softmax", 1, None, False, False), ("sigmoid", 4, 1.0, True, True), ("softmax", 16, 0.5, False, True)],
)
def test_moe_step_reads_nothing_on_the_host(score, align, capacity_factor, grouped, tp_counts):
    """The CPU path: impl="auto" (the torch references, torch._grouped_mm for the experts)."""
    reads, stats, params = _moe_step(
        score=score, align=align, capacity_factor=capacity_factor, grouped=grouped, tp_counts=tp_counts, impl="auto", device="cpu"
    )
    assert reads.count == 0, reads.sites
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values())
    assert all(v.shape == () and v.dtype == torch.float32 for v in stats.values())


def test_moe_step_on_the_kernels_reads_nothing_on_the_host(device):
    """The same step on the Triton kernels (interpreted on CPU): their launch code reads
    nothing either (the n_valid of the losses, the plan's offsets stay on the device)."""
    reads, _, params = _moe_step(
        score="sigmoid", align=4, capacity_factor=1.0, grouped=True, tp_counts=True, impl="triton", device=device
    )
    assert reads.count == 0, reads.sites
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values())


def _flag_calls():
    """(flag name, a call of an op with that flag set to the given value)."""
    from fmoe.ops.delta import gated_delta_rule_loop, gated_linear_attention_loop
    from fmoe.ops.scan import selective_scan_loop

    logits = torch.randn(3, 4)
    q, g, beta = torch.randn(1, 5, 2, 4), -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    u, A, bc = torch.randn(1, 5, 3), -torch.rand(3, 2), torch.randn(1, 5, 2)
    x, cos, sin = torch.randn(4, 2, 8), torch.randn(4, 4), torch.randn(4, 4)
    bias, counts = torch.zeros(4), torch.tensor([10, 2, 2, 2])
    return [
        ("pre_softmax", lambda v: F.route(logits, 2, pre_softmax=v)),
        ("normalize", lambda v: F.route(logits, 2, score="sigmoid", normalize=v)),
        ("bias_on_logits", lambda v: F.route(logits, 2, score="sigmoid", expert_bias=bias, bias_on_logits=v)),
        ("return_counts", lambda v: F.aux_scores(logits, 2, return_counts=v)),
        ("center", lambda v: F.update_expert_bias(bias, counts, 1e-3, center=v)),
        ("proportional", lambda v: F.update_expert_bias(bias, counts, 1e-3, proportional=v)),
        ("final_state", lambda v: F.gated_delta_rule(q, q, q, g, beta, final_state=v)),
        ("final_state", lambda v: gated_delta_rule_loop(q, q, q, g, beta, final_state=v)),
        ("final_state", lambda v: F.gated_linear_attention(q, q, q, g, final_state=v)),
        ("final_state", lambda v: gated_linear_attention_loop(q, q, q, g, final_state=v)),
        ("final_state", lambda v: F.selective_scan(u, u.abs(), A, bc, bc, final_state=v)),
        ("final_state", lambda v: selective_scan_loop(u, u.abs(), A, bc, bc, final_state=v)),
        ("inplace_grad", lambda v: F.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), inplace_grad=v)),
        ("interleaved", lambda v: F.apply_rope(x, cos, sin, interleaved=v)),
        ("inplace", lambda v: F.apply_rope(x, cos, sin, inplace=v)),
        ("truncate", lambda v: F.yarn_correction_range(8, base=10000.0, original_max_positions=64, truncate=v)),
    ]


def test_flags_take_bools_only():
    """A flag read from a config as the string "False" (truthy) or as 0 / 1 is refused by
    name; before, route(pre_softmax="False") scored as pre_softmax=True and
    update_expert_bias(center="False") centred its step, with no error."""
    for name, call in _flag_calls():
        call(False), call(True)  # the bools themselves run
        for bad in ("False", 1, None):
            with pytest.raises(ValueError, match=f"^{name}: expected a bool, got {bad!r}"):
                call(bad)


def test_nan_rows_are_counted_and_the_first_is_named():
    logits = torch.randn(6, 4)
    logits[4, 1] = logits[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^logits: contains NaN in 2 row\(s\), first at row 2;"):
        F.route(logits, 2)


def test_cu_seqlens_names_its_first_decrease_even_by_one():
    for cu, at in (([0, 5, 3, 6, 2, 8], 3), ([0, 5, 4, 8], 4)):
        with pytest.raises(ValueError, match=rf"^cu_seqlens: must be non-decreasing, but cu_seqlens\[2\] = {at} < cu_seqlens\[1\] = 5$"):
            F.positions_from_cu_seqlens(torch.tensor(cu), n_tokens=8)


def test_float16_inputs_are_accepted():
    """float16 is one of the float dtypes the ops take (check_float's message names it): a
    float16 router routes as its float32 copy does."""
    logits = torch.randn(5, 8).half()
    w16, e16 = F.route(logits, 2)
    w32, e32 = F.route(logits.float(), 2)
    assert torch.equal(e16, e32)
    torch.testing.assert_close(w16, w32)



def test_check_path_takes_str_and_path_like():
    import pathlib

    from fmoe.ops.checks import check_path

    p = pathlib.Path("runs") / "a"
    assert check_path("out", p) is p and check_path("out", "runs/a") == "runs/a"
    with pytest.raises(ValueError, match=r"^out: expected a path \(str or os.PathLike\), got int$"):
        check_path("out", 3)


def test_int_arguments_refuse_bools():
    """True is an int to isinstance: k=True would route one expert without a word."""
    with pytest.raises(ValueError, match=r"^k: expected an int, got True$"):
        F.route(torch.randn(2, 4), True)
