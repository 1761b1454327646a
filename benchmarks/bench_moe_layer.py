"""MoE layer benchmark: fmoe.layers.moe against a per-expert torch loop and a strong baseline.

    .venv/bin/python benchmarks/bench_moe_layer.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_moe_layer.py --smoke    # CPU + Triton interpreter, tiny shapes

Shapes (T tokens, H hidden, E experts, k per token, F expert FFN, shared experts):
    A         T=16384, H=2048, E=128, k=8, F=768                 (Qwen3-like, softmax top-k)
    deepseek  T=16384, H=2048, E=64,  k=6, F=1408, 2 shared experts of F=1408
    nemotron3 T=16384, H=2688, E=128, k=6, F=1856, a shared expert of 3712 = 2 F; experts
              without a gate (relu(x w_up)^2 w_down: Nemotron 3 Nano's, MoEConfig glu_act
              "relu2"), two matrices each

Implementations (same softmax-top-k routing math, bf16 experts, float32 router):
    fmoe      fmoe.layers.moe (fused router, Triton permute/unpermute, torch._grouped_mm
              experts with the fused SwiGLU on Hopper)
    fmoe gather  the same with permute's rows (and unpermute's backward) filled by row, each
              reading its token's x row (fmoe.ops.dispatch.PERMUTE_BY = "gather", set around
              the whole timed call, its backward included), not by token (the default
              "scatter": each x row read once)
    fmoe fp8  the same with MoEConfig.fp8: the experts' forward and input-gradient GEMMs in
              fp8 (torch._scaled_grouped_mm on Hopper; fmoe.ops.fp8_matmul's row-wise
              power-of-two scales), its FLOP/s still over the bf16 matmul rate; its output
              differs from fmoe's by fp8's rounding (checked below 0.15 relative, printed)
    fmoe fp8 fast accum  the same with MoEConfig.fp8_fast_accum (use_fast_accum: the tensor
              cores' own accumulator in the grouped GEMMs; its difference printed too)
    loop      a per-expert loop in plain torch (nonzero per expert, index_add combine)
    strong    argsort dispatch (x[token]) + torch._grouped_mm + scatter_add combine: the
              experts' counts by torch.histc (no host sync), the routing weights folded into
              the experts' output and scatter-added in the activations' dtype (bf16; no
              float32 T k H copy), the shared experts' output added after
    titan     the same grouped GEMMs in the pattern of torchtitan's MoE layer: the dispatch by
              torch.gather (its backward a scatter_add, where x[token]'s is an index_put
              with accumulation), the routing weights applied in float32 and cast back, the
              output scatter-added onto the shared experts' output (or zeros)
    The 1.3x goal is judged against the faster of strong and titan (printed per shape).

Before timing, every implementation's output and gradients (of x and every weight, for a fixed
upstream gradient) are checked against fmoe's: within 2e-2 (relative norm; fp8: the output
within 0.15, the gradients within 0.3, both printed).

Table: median ms of the forward and forward+backward; TFLOP/s over the active parameters
(forward: 2 T (k + n_shared) m H F for the experts, m = 3 matrices or 2 without a gate, plus 2 T H E for the router; forward+
backward: 3x that), the fraction of the bf16 matmul rate measured in the same run, the peak memory
of forward+backward above what was held before it (inputs, weights, the upstream gradient
and the timing's cache flush left out), fmoe's speedup over each baseline; then fmoe's
permute and unpermute alone and one after the other ("permute + unpermute", the goal's
row: 2x the bytes) as a fraction of the copy bandwidth measured in the same run (bytes: x
read once, T k rows written; and back), permute's plan alone and its rows filled by each kernel, and gpt-oss's clamped SwiGLU (forward + backward over the T k x F
activations) fused against the torch reference (fused_speedup: its ms / the fused ms), or for
experts without a gate their relu(up)^2 in torch ops; on
these rows also device_ms, the device's own time per call with the host queued ahead
(_common.device_ms; ms is the host's where launching a call takes longer than its kernels),
and device_floor_fraction, copy_fraction over device_ms instead of ms (none for the plan,
which has no bytes; both empty on CPU). CSV in OUT/bench_moe_layer.csv.
"""

import dataclasses
import sys
from dataclasses import dataclass

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    cuda_peak_bytes,
    device_columns,
    finish,
    floor_fraction,
    matmul_rate,
    rel_err,
    start,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmoe.layers import MoEConfig, moe  # noqa: E402
from fmoe.ops import dispatch, permute, swiglu, unpermute  # noqa: E402
from fmoe.ops.experts import plain_act  # noqa: E402

COLUMNS = ["shape", "pass", "impl", "ms", "TFLOP/s", "matmul_fraction", "peak_GiB", "fmoe_speedup"]
BW_COLUMNS = ["shape", "op", "ms", "GB/s", "copy_fraction", "fused_speedup", "device_ms", "device_floor_fraction"]


@dataclass
class Shape:
    name: str
    T: int
    H: int
    E: int
    k: int
    F: int
    n_shared: int = 0
    gated: bool = True  # False: experts without a gate (relu2)

    def flops_fwd(self) -> float:
        experts = 2 * self.T * (self.k + self.n_shared) * (3 if self.gated else 2) * self.H * self.F
        return experts + 2 * self.T * self.H * self.E  # + router


def make_shapes(smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape("A (smoke)", 32, 32, 8, 2, 16), Shape("deepseek (smoke)", 32, 32, 8, 3, 16, n_shared=2),
                Shape("nemotron3 (smoke)", 32, 32, 8, 3, 16, n_shared=2, gated=False)]
    return [Shape("A", 16384, 2048, 128, 8, 768), Shape("deepseek", 16384, 2048, 64, 6, 1408, n_shared=2),
            Shape("nemotron3", 16384, 2688, 128, 6, 1856, n_shared=2, gated=False)]


def make_params(shape: Shape, dtype, device) -> dict:
    E, H, Fe = shape.E, shape.H, shape.F
    p = {
        "router": torch.randn(E, H, device=device) * H**-0.5,
        "w_gate": torch.randn(E, H, Fe, device=device, dtype=dtype) * H**-0.5,
        "w_up": torch.randn(E, H, Fe, device=device, dtype=dtype) * H**-0.5,
        "w_down": torch.randn(E, Fe, H, device=device, dtype=dtype) * Fe**-0.5,
    }
    if shape.n_shared:
        Fs = shape.n_shared * Fe
        p["shared_w_gate"] = torch.randn(H, Fs, device=device, dtype=dtype) * H**-0.5
        p["shared_w_up"] = torch.randn(H, Fs, device=device, dtype=dtype) * H**-0.5
        p["shared_w_down"] = torch.randn(Fs, H, device=device, dtype=dtype) * Fs**-0.5
    if not shape.gated:  # experts without a gate
        p = {n: t for n, t in p.items() if n not in ("w_gate", "shared_w_gate")}
    return {n: t.requires_grad_() for n, t in p.items()}


def _mlp(x, w_gate, w_up, w_down, offsets=None):
    """SwiGLU, or relu(x w_up)^2 without a gate, then w_down; with offsets by torch._grouped_mm."""
    mm = (lambda a, w: torch._grouped_mm(a, w, offs=offsets)) if offsets is not None else (lambda a, w: a @ w)
    h = torch.relu(mm(x, w_up)).square() if w_gate is None else F.silu(mm(x, w_gate)) * mm(x, w_up)
    return mm(h, w_down)


def _softmax_topk(x, p, k):
    logits = F.linear(x.float(), p["router"])
    top, experts = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def _shared(x, p):
    if "shared_w_up" not in p:
        return 0
    return _mlp(x, p.get("shared_w_gate"), p["shared_w_up"], p["shared_w_down"])


def loop_moe(x, p, k):
    """Per-expert loop: gather each expert's tokens, run its MLP, index_add back."""
    weights, experts = _softmax_topk(x, p, k)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(p["w_up"].shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        gate = p["w_gate"][e] if "w_gate" in p else None
        y = y.index_add(0, token, _mlp(x[token], gate, p["w_up"][e], p["w_down"][e]).float() * weights[token, slot, None])
    return y.to(x.dtype) + _shared(x, p)


def _sorted_by_expert(x, p, k):
    """The grouped-GEMM baselines' dispatch: (slot weights [T k] float32 in expert order, the
    token of each sorted slot [T k], the experts' row offsets for torch._grouped_mm). The
    experts' token counts by torch.histc (no host sync; torch.bincount reads its input's max
    to the host on CUDA)."""
    weights, experts = _softmax_topk(x, p, k)
    order = torch.argsort(experts.flatten(), stable=True)
    counts = torch.histc(experts.flatten().float(), bins=p["w_up"].shape[0], min=0, max=p["w_up"].shape[0]).long()  # exact below 2^24
    return weights.flatten()[order], order // k, torch.cumsum(counts, 0).to(torch.int32)


def strong_moe(x, p, k):
    """argsort dispatch by x[token] + torch._grouped_mm + scatter_add combine: the routing
    weights folded into the experts' output in the activations' dtype and scatter-added in
    it (no float32 copy of the T k H rows), the shared experts' output added after."""
    weights, token, offsets = _sorted_by_expert(x, p, k)
    y_perm = _mlp(x[token], p.get("w_gate"), p["w_up"], p["w_down"], offsets)
    y_perm = y_perm * weights[:, None].to(y_perm.dtype)
    y = torch.zeros_like(x).scatter_add(0, token[:, None].expand(-1, x.shape[1]), y_perm)
    shared = _shared(x, p)
    return y if isinstance(shared, int) else y + shared  # no shared experts: no T x H add of 0


def titan_moe(x, p, k):
    """strong_moe's grouped GEMMs in the pattern of torchtitan's MoE layer: x's rows gathered by
    torch.gather (backward: a scatter_add), the routing weights applied to the experts'
    output in float32 and cast back, the result scatter-added onto the shared experts'
    output (zeros without them)."""
    weights, token, offsets = _sorted_by_expert(x, p, k)
    index = token[:, None].expand(-1, x.shape[1])
    y_perm = _mlp(torch.gather(x, 0, index), p.get("w_gate"), p["w_up"], p["w_down"], offsets)
    y_perm = (y_perm.float() * weights[:, None]).to(x.dtype)
    shared = _shared(x, p)
    return (torch.zeros_like(x) if isinstance(shared, int) else shared).scatter_add(0, index, y_perm)


def permuting_by(by: str, fn):
    """fn() with permute's rows filled by "gather" or "scatter" (fmoe.ops.dispatch.PERMUTE_BY)."""
    before, dispatch.PERMUTE_BY = dispatch.PERMUTE_BY, by
    try:
        return fn()
    finally:
        dispatch.PERMUTE_BY = before


def within(name: str, call):
    """call, for "fmoe gather" the whole of it (a forward and its backward) under
    permuting_by("gather"): permute's kernels read fmoe.ops.dispatch.PERMUTE_BY when they
    launch, the backward's (unpermute's) too, after the forward has returned."""
    return (lambda: permuting_by("gather", call)) if name == "fmoe gather" else call


def peak_gib(fn, device) -> float | None:
    """fn()'s peak memory above what was held before it (cuda_peak_bytes), in GiB; None off CUDA."""
    held = cuda_peak_bytes(fn, device)
    return None if held is None else held / 2**30


def run_shape(shape, device, dtype, impl, rate, bandwidth):
    torch.manual_seed(0)
    p = make_params(shape, dtype, device)
    x = torch.randn(shape.T, shape.H, device=device, dtype=dtype, requires_grad=True)
    cfg = MoEConfig(n_experts=shape.E, k=shape.k, aux_scores=False, impl=impl, glu_act="silu" if shape.gated else "relu2")
    cfg_fp8 = dataclasses.replace(cfg, fp8=True)
    cfg_fast = dataclasses.replace(cfg, fp8=True, fp8_fast_accum=True)
    impls = {
        "fmoe": lambda: moe(x, p, cfg)[0],
        "fmoe gather": lambda: moe(x, p, cfg)[0],  # under permuting_by("gather"), forward and backward alike: within()
        "fmoe fp8": lambda: moe(x, p, cfg_fp8)[0],
        "fmoe fp8 fast accum": lambda: moe(x, p, cfg_fast)[0],
        "loop": lambda: loop_moe(x, p, shape.k),
        "strong": lambda: strong_moe(x, p, shape.k),
        "titan": lambda: titan_moe(x, p, shape.k),
    }

    grad = torch.randn(shape.T, shape.H, device=device, dtype=dtype)
    leaves = [x, *p.values()]

    def out_and_grads(name):
        def run():
            y = impls[name]()
            return (y.detach().float(), *torch.autograd.grad(y, leaves, grad))
        return within(name, run)()

    ref, worst = out_and_grads("fmoe"), (0.0, 0.0)  # the largest output and gradient differences of the non-fp8 rows
    for name in ("fmoe gather", "fmoe fp8", "fmoe fp8 fast accum", "loop", "strong", "titan"):
        got = out_and_grads(name)
        err, grad_err = rel_err(got[0], ref[0]), max(rel_err(a, b) for a, b in zip(got[1:], ref[1:]))
        fp8 = name.startswith("fmoe fp8")
        if err > (0.15 if fp8 else 2e-2):
            sys.exit(f"{shape.name}: {name} differs from fmoe by {err:.3g} (relative norm)")
        if grad_err > (0.3 if fp8 else 2e-2):
            sys.exit(f"{shape.name}: {name}'s gradients differ from fmoe's by {grad_err:.3g} (the largest relative norm over x and the weights)")
        if fp8:
            print(f"{shape.name}: {name.removeprefix('fmoe ')} experts differ from bf16 by {err:.3g} (relative norm), "
                  f"their gradients by {grad_err:.3g}", flush=True)
        else:
            worst = (max(worst[0], err), max(worst[1], grad_err))
        del got
    del ref
    print(f"{shape.name}: outputs and gradients agree (gather, loop, strong, titan vs fmoe: outputs within {worst[0]:.2g}, "
          f"gradients within {worst[1]:.2g}, relative norm); timing", flush=True)

    passes = {
        "fwd": (lambda fn: (lambda: fn()), 1),
        "fwd+bwd": (lambda fn: (lambda: torch.autograd.grad(fn(), leaves, grad)), 3),
    }
    rows = []
    for pass_name, (wrap, factor) in passes.items():
        # CPU: one timed call each, no warm-up (nothing here compiles; the interpreter is slow)
        ms = {name: bench(within(name, wrap(fn)), device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-{pass_name}-{name}")
              for name, fn in impls.items()}
        for name, fn in impls.items():
            tflops = factor * shape.flops_fwd() / (ms[name] * 1e-3) / 1e12
            rows.append({
                "shape": shape.name, "pass": pass_name, "impl": name, "ms": ms[name], "TFLOP/s": tflops,
                "matmul_fraction": tflops * 1e12 / rate,
                "peak_GiB": peak_gib(within(name, wrap(fn)), device) if pass_name == "fwd+bwd" else None,
                "fmoe_speedup": ms[name] / ms["fmoe"] if name != "fmoe" else None,
            })
        faster = min(("strong", "titan"), key=ms.get)
        print(f"{shape.name} {pass_name}: fmoe's speedup over the faster grouped_mm baseline ({faster}): {ms[faster] / ms['fmoe']:.3g}"
              + (" (goal: >= 1.3)" if pass_name == "fwd+bwd" else ""), flush=True)

    # permute / unpermute alone: x read once and T k rows written (and back)
    weights, experts = _softmax_topk(x.detach(), p, shape.k)
    xd = x.detach()
    x_perm, plan = permute(xd, experts, shape.E, check=False, impl=impl)
    row_bytes = shape.H * xd.element_size()
    nbytes = shape.T * row_bytes + shape.T * shape.k * row_bytes
    bw_rows = []
    def round_trip():
        rows, round_plan = permute(xd, experts, shape.E, check=False, impl=impl)
        return unpermute(rows, round_plan, weights, impl=impl)

    for op, fn, n in (("permute", lambda: permute(xd, experts, shape.E, check=False, impl=impl), nbytes),
                      ("unpermute", lambda: unpermute(x_perm, plan, weights, impl=impl), nbytes),
                      ("permute + unpermute", round_trip, 2 * nbytes)):  # the goal's row: one after the other, twice the bytes
        ms = bench(fn, device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-{op.replace(' + ', '-')}")
        bw_rows.append(bw_row(shape, op, n, ms, bandwidth, fn, device))
    # permute's parts: the plan, then the rows filled by either kernel (same bytes as permute)
    plan_only = lambda: torch.ops.fmoe.permute_plan(experts, shape.E, 1)  # noqa: E731
    plan_ms = bench(plan_only, device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-permute-plan")
    bw_rows.append({"shape": shape.name, "op": "permute: its plan alone", "ms": plan_ms, **device_columns(plan_only, device, bandwidth)})
    for by in ("gather", "scatter"):
        fill = lambda: permuting_by(by, lambda: torch.ops.fmoe.permute_fwd(xd, plan.row_of_slot, plan.slot_of_row))  # noqa: E731
        ms = bench(fill, device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-permute-rows-{by}")
        bw_rows.append(bw_row(shape, f"permute: its rows by {by}", nbytes, ms, bandwidth, fill, device))
    bw_rows += swiglu_rows(shape, device, dtype, impl, bandwidth) if shape.gated else relu2_rows(shape, device, dtype, bandwidth)
    return rows, bw_rows


def relu2_rows(shape, device, dtype, bandwidth) -> list[dict]:
    """The experts without a gate's activation, relu(up)^2 (fmoe.ops.experts.plain_act: torch
    ops, not fused), forward + backward over the T k x F activations, against its bytes: up
    read, h written (forward); up and dh read, d up written (backward): 5 T k F elements."""
    g = torch.Generator(device=device).manual_seed(1)
    up, dh = ((3 * torch.randn(shape.T * shape.k, shape.F, device=device, generator=g)).to(dtype) for _ in range(2))
    up.requires_grad_()
    run = lambda: torch.autograd.grad(plain_act(up), up, dh)  # noqa: E731
    ms = bench(run, device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-relu2")
    return [bw_row(shape, "relu2 fwd+bwd torch", 5 * up.numel() * up.element_size(), ms, bandwidth, run, device)]


GPT_OSS_GLU = dict(alpha=1.702, limit=7.0, offset=1.0)


GLUS = {"swiglu clamped": GPT_OSS_GLU, "geglu": dict(act="gelu_tanh")}  # gpt-oss's experts; Gemma's (GELU's tanh form)


def swiglu_rows(shape, device, dtype, impl, bandwidth) -> list[dict]:
    """gpt-oss's clamped SwiGLU and Gemma's GeGLU between the expert projections, forward +
    backward over the T k x F activations: the fused kernels (impl) against the torch
    reference's autograd. Bytes: gate and up read, h written (forward); gate, up and dh read,
    d gate and d up written (backward): 8 T k F elements."""
    g = torch.Generator(device=device).manual_seed(1)
    gate, up, dh = ((3 * torch.randn(shape.T * shape.k, shape.F, device=device, generator=g)).to(dtype) for _ in range(3))
    gate.requires_grad_()
    up.requires_grad_()
    nbytes = 8 * gate.numel() * gate.element_size()
    impls = {"fused": impl, "torch": "torch"}
    rows = []
    for kind, glu in GLUS.items():
        def run(which, glu=glu):
            return lambda: torch.autograd.grad(swiglu(gate, up, impl=which, **glu), (gate, up), dh)

        fused, ref = run(impl)(), run("torch")()
        for a, b in zip(fused, ref):
            err = rel_err(a, b)
            if err > 2e-2:
                sys.exit(f"{shape.name}: the fused {kind}'s gradients differ from the torch reference's by {err:.3g}")
        ms = {name: bench(run(which), device, cpu_warmup=0, cpu_repeats=1, label=f"{shape.name}-{kind.replace(' ', '-')}-{name}")
              for name, which in impls.items()}
        rows += [bw_row(shape, f"{kind} fwd+bwd {name}", nbytes, ms[name], bandwidth, run(which), device,
                        fused_speedup=ms[name] / ms["fused"] if name == "torch" else None)
                 for name, which in impls.items()]
    return rows


def bw_row(shape, op: str, nbytes: int, ms: float, bandwidth: float, fn, device, **extra) -> dict:
    """A row of the bandwidth table: nbytes moved in ms, against the copy bandwidth, and
    fn()'s device time (device_columns)."""
    return {"shape": shape.name, "op": op, "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9, "copy_fraction": floor_fraction(nbytes, bandwidth, ms),
            **extra, **device_columns(fn, device, bandwidth, nbytes)}


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    impl = "triton" if args.smoke else "auto"  # the smoke run exercises the kernels
    rate = matmul_rate(device, dtype, 256 if args.smoke else 8192)
    print(f"matmul rate: {rate / 1e12:.3g} TFLOP/s ({dtype})", flush=True)
    rows, bw_rows = [], []
    for shape in make_shapes(args.smoke):
        r, b = run_shape(shape, device, dtype, impl, rate, bandwidth)
        rows += r
        bw_rows += b
    finish(args, device, bandwidth, "bench_moe_layer", [(bw_rows, BW_COLUMNS), (rows, COLUMNS)], matmul_TFLOPs=rate / 1e12)


if __name__ == "__main__":
    main()
