"""Routing benchmark: fmoe.ops.route's fused Triton kernels against the torch reference.

    .venv/bin/python benchmarks/bench_routing.py            # CUDA, bf16 logits, real shapes
    .venv/bin/python benchmarks/bench_routing.py --smoke    # CPU + Triton interpreter, tiny shapes
    .venv/bin/python benchmarks/bench_routing.py --cases dsv3    # only the named cases (here both T)

Cases (T tokens, E experts, k per token):
    dsv3   DeepSeek-V3-like: E=256, k=8, sigmoid score, 8 groups keep 4, expert bias, scale 2.5
    qwen3  Qwen3-like: E=128, k=8, softmax over the k chosen logits
    kolibri  Kolibri-1-like: E=384, k=6, the top-k of logits + expert bias, raw sigmoids as weights
    dsv4   DeepSeek-V4-like: E=256, k=6, sqrt(softplus) score + expert bias, renormalised, scale 1.5
each with T = 16384 and 65536 (--smoke: T = 8 only, float32 logits: the kernels run two or
four programs).

Implementations, all through route(..., check=False):
    fused     impl="triton": the fused Triton kernels
    eager     impl="torch": the plain-torch reference
    compiled  torch.compile(dynamic=False) of the reference, warmed up before timing

Passes: fwd (the training forward: logits require grad) and fwd+bwd (then the gradient of the
logits for a fixed random upstream gradient of the weights). Before timing, each case checks
the fused kernels against the reference (experts, weights, logits gradient).

Table: median ms per implementation; on the fused rows the speedups (baseline ms / fused ms)
and the fraction of the bandwidth floor: (bytes moved / copy bandwidth) / fused ms, with the
copy bandwidth measured in the same run; on every row device_ms, the device's own time per
call with the host queued ahead (_common.device_ms; ms is the host's where launching a call
takes longer than its kernels), and device_floor_fraction, (bytes / copy bandwidth) /
device_ms (both empty on CPU). Bytes: forward reads the logits and the bias and
writes weights (float32) and experts (int64); backward reads the k chosen logits (every
logit for softmax before top-k), the experts and the weight gradient, and writes the logits
gradient. The CSV goes to OUT/bench_routing.csv.
"""

import sys
from dataclasses import dataclass
from typing import Optional

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    case_done,
    device_columns,
    finish,
    floor_fraction,
    select,
    start,
    timing_row,
)

import torch  # noqa: E402
from fmoe.ops import route  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_eager", "speedup_vs_compiled", "floor_fraction",
           "device_ms", "device_floor_fraction"]
MIN_SAME_ROWS = 0.9999  # bf16 ties may pick a different expert on a few rows


@dataclass
class Case:
    name: str
    T: int
    E: int
    k: int
    options: dict  # route() keyword arguments

    def router(self, impl: str):
        """logits -> Routes by impl, without the NaN check (it syncs with the host)."""
        return lambda logits: route(logits, self.k, impl=impl, check=False, **self.options)


def make_cases(smoke: bool, device: torch.device) -> list[Case]:
    bias = 0.01 * torch.randn(256, device=device)  # small, like a trained balancing bias
    dsv3 = dict(score="sigmoid", n_groups=8, topk_groups=4, expert_bias=bias, scale=2.5)
    kolibri = dict(score="sigmoid", normalize=False, expert_bias=0.1 * torch.randn(384, device=device), bias_on_logits=True)
    cases = []
    for T in (8,) if smoke else (16384, 65536):
        cases.append(Case(f"dsv3 T={T}", T, 256, 8, dsv3))
        cases.append(Case(f"qwen3 T={T}", T, 128, 8, dict(score="softmax", pre_softmax=False)))
        cases.append(Case(f"kolibri T={T}", T, 384, 6, kolibri))
        cases.append(Case(f"dsv4 T={T}", T, 256, 6, dict(score="sqrtsoftplus", expert_bias=bias, scale=1.5)))
    return cases


def select_cases(cases: list[Case], spec: Optional[str]) -> list[Case]:
    """The cases that spec names (--cases): comma-separated, each a whole case name
    ("dsv3 T=65536") or its model ("dsv3": every T); None keeps them all."""
    models: dict[str, list[str]] = {}
    for c in cases:
        models.setdefault(c.name.split()[0], []).append(c.name)
    picked = select([c.name for c in cases], spec, "--cases", models)
    return [c for c in cases if c.name in picked]


def check(case: Case, fused, eager, logits: torch.Tensor, grad_w: torch.Tensor) -> float:
    """Fraction of rows where fused and eager pick the same experts; exits on a mismatch."""
    w_f, e_f = fused(logits)
    w_r, e_r = eager(logits)
    (gx_f,) = torch.autograd.grad(w_f, logits, grad_w)
    (gx_r,) = torch.autograd.grad(w_r, logits, grad_w)
    same = (e_f == e_r).all(dim=1)
    frac = same.float().mean().item()
    if frac < MIN_SAME_ROWS:
        sys.exit(f"{case.name}: fused and eager choose different experts on {1 - frac:.4%} of rows")
    grad_tol = dict(rtol=1e-5, atol=1e-6) if logits.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-4)
    try:
        torch.testing.assert_close(w_f[same], w_r[same], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx_f[same], gx_r[same], **grad_tol)
    except AssertionError as err:
        sys.exit(f"{case.name}: fused and eager disagree on rows with the same experts:\n{err}")
    return frac


def run_case(case: Case, device: torch.device, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    T, E, k = case.T, case.E, case.k
    torch._dynamo.reset()  # one compile per case, never near dynamo's recompile limit
    logits = torch.randn(T, E, device=device, dtype=dtype, requires_grad=True)
    grad_w = torch.randn(T, k, device=device)
    impls = {
        "fused": case.router("triton"),
        "eager": case.router("torch"),
        "compiled": torch.compile(case.router("torch"), dynamic=False),
    }
    frac_same = check(case, impls["fused"], impls["eager"], logits, grad_w)
    print(f"{case.name}: checked, same experts on {frac_same:.4%} of rows; timing", flush=True)

    def fwd(fn):
        return fn(logits)

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(logits)[0], logits, grad_w)

    fwd_bwd(impls["compiled"])  # compiles the forward and backward graphs
    fwd(impls["compiled"])

    logit_bytes = T * E * logits.element_size()
    bias = case.options.get("expert_bias")
    fwd_bytes = logit_bytes + T * k * (4 + 8) + (bias.nbytes if bias is not None else 0)
    # the backward needs every logit only for softmax-before-top-k; otherwise the k chosen
    reads = logit_bytes if case.options.get("pre_softmax") else T * k * logits.element_size()
    bwd_bytes = reads + logit_bytes + T * k * (8 + 4)
    rows = []
    for pass_name, step, nbytes in (("fwd", fwd, fwd_bytes), ("fwd+bwd", fwd_bwd, fwd_bytes + bwd_bytes)):
        # CPU: one timed call each, no warm-up (compiled is warm; the interpreter is slow)
        ms = {name: bench(lambda fn=fn: step(fn), device, cpu_warmup=0, cpu_repeats=1, label=f"{case.name}-{pass_name}-{name}")
              for name, fn in impls.items()}
        for name in impls:
            rows.append({
                **timing_row(case.name, pass_name, ms, name),
                "floor_fraction": floor_fraction(nbytes, bandwidth, ms[name]) if name == "fused" else None,
                **device_columns(lambda fn=impls[name]: step(fn), device, bandwidth, nbytes),
                "T": T, "E": E, "k": k, "dtype": str(dtype).removeprefix("torch."),
                "bytes": nbytes, "floor_ms": nbytes / bandwidth * 1e3,
            })
    case_done(rows, COLUMNS)
    return rows


def main() -> None:
    def add_arguments(parser):
        parser.add_argument("--cases", default=None,
                            help="comma-separated case names to run, e.g. dsv3 (both T) or 'qwen3 T=65536' (default: all)")

    args, device, dtype, bandwidth = start(__doc__, add_arguments)
    try:
        cases = select_cases(make_cases(args.smoke, device), args.cases)
    except ValueError as err:
        sys.exit(str(err))
    rows = []
    for case in cases:
        rows += run_case(case, device, dtype, bandwidth)
    finish(args, device, bandwidth, "bench_routing", [(rows, COLUMNS)])


if __name__ == "__main__":
    main()
