"""Hyper-connections benchmark: one sublayer's HyperConnection (the streams' weights, the
block input's weighted sum, the add back) as fmoe.model runs it, against torch.compile of the
same code and against the one-stream residual add it replaces.

    .venv/bin/python benchmarks/bench_hyper_connections.py            # CUDA, bf16 streams, real shapes
    .venv/bin/python benchmarks/bench_hyper_connections.py --smoke    # CPU, tiny shapes

Cases (T tokens, n streams of H channels; the streams in the compute dtype, the weights
float32 as in the model), T = 16384, H = 4096, n = 4 (--smoke: T = 48, H = 32, float32):
    manifold     DeepSeek-V4's mHC: pre, post and the Sinkhorn-projected n x n mixing (20 steps)
    independent  HY-V4's: pre and post, no mixing

Implementations (the pass: h, post, comb = hc(x); x' = hc.add(x, y, post, comb), the sublayer
output y given; fwd+bwd: the gradients of x, y and the weights for fixed upstream gradients
of h and x'):
    eager       fmoe.model.HyperConnection's forward and add, plain torch (what the model runs)
    compiled    torch.compile(dynamic=False) of the same, warmed up before timing
    one stream  the residual add x + y of one [T, H] stream (no hyper-connections), for scale

Before timing, eager and compiled are checked against each other (outputs and gradients).

Table: median ms per implementation and pass; compiled's speedup over eager; the fraction of
the bandwidth floor, (bytes / copy bandwidth) / ms, with the copy bandwidth measured in the
same run. Bytes (the streams' dtype, e bytes): forward, read x [T, n H] and y [T, H], write h
[T, H] and x' [T, n H]: e T (2 n H + 2 H); backward, read the upstream gradients [T, H] and
[T, n H], x and y, write the gradients of x and y: e T (3 n H + 3 H); the one-stream rows
count their own, e T 3 H forward and none backward (the add's gradients are the upstream
gradient itself, returned twice: on an H200 its fwd+bwd took the forward's time). The weights (M x n H float32) are
left out: a few MB, read once. The CSV goes to OUT/bench_hyper_connections.csv.
"""

import dataclasses

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    check_agree,
    device_columns,
    floor_fraction,
    run_cases,
)

import torch  # noqa: E402
from fmoe.model import HyperConnection, Transformer, TransformerConfig  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_eager", "floor_fraction", "device_ms", "device_floor_fraction"]


@dataclasses.dataclass
class Case:
    name: str
    T: int
    H: int
    n: int
    kind: str


def make_cases(smoke: bool) -> list[Case]:
    T, H, n = (48, 32, 4) if smoke else (16384, 4096, 4)
    return [Case("manifold", T, H, n, "manifold"), Case("independent", T, H, n, "independent")]


def _module(case: Case, device: torch.device) -> HyperConnection:
    """A sublayer's HyperConnection with the model's initial weights (a one-block model's
    attn_hc, Transformer.reset_parameters) but its scales 0.5: streams that part, as after
    training."""
    cfg = TransformerConfig(vocab_size=8, hidden=case.H, n_heads=1, n_kv_heads=1, head_dim=8, n_layers=1, ffn_dense=8,
                            hyper_connections=case.n, hc_kind=case.kind)
    hc = Transformer(cfg).blocks[0].attn_hc.to(device)
    with torch.no_grad():
        hc.scale.fill_(0.5)
    return hc


def run_case(case: Case, device: torch.device, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    T, H, n = case.T, case.H, case.n
    torch._dynamo.reset()  # one compile per case
    hc = _module(case, device)
    x = torch.randn(T, n * H, device=device, dtype=dtype, requires_grad=True)
    y = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    grad_h, grad_out = torch.randn(T, H, device=device, dtype=dtype), torch.randn(T, n * H, device=device, dtype=dtype)
    one_x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)

    def sublayer(x, y):
        h, post, comb = hc(x)
        return h, hc.add(x, y, post, comb)

    impls = {"eager": sublayer, "compiled": torch.compile(sublayer, dynamic=False)}
    params = list(hc.parameters())

    def fwd_bwd(name):
        h, out = impls[name](x, y)
        return (h.detach(), out.detach(), *torch.autograd.grad((h, out), [x, y, *params], (grad_h, grad_out)))

    check_agree(case.name, {name: fwd_bwd(name) for name in impls}, ("eager", "compiled"), dtype)

    def fwd(name):
        with torch.no_grad():
            return impls[name](x, y)

    def one_fwd():
        with torch.no_grad():
            return one_x + y

    def one_fwd_bwd():
        return torch.autograd.grad(one_x + y, [one_x, y], grad_h)

    e = x.element_size()
    hc_bytes = {"fwd": e * T * (2 * n * H + 2 * H), "fwd+bwd": e * T * (5 * n * H + 5 * H)}
    one_bytes = {"fwd": e * T * 3 * H, "fwd+bwd": e * T * 3 * H}  # the add's backward passes its gradient on: no bytes
    rows = []
    for pass_name, step, one_step in (("fwd", fwd, one_fwd), ("fwd+bwd", fwd_bwd, one_fwd_bwd)):
        calls = {name: (lambda name=name: step(name)) for name in impls}
        calls["one stream"] = one_step
        ms = {name: bench(fn, device, label=f"{case.name}-{pass_name}-{name}") for name, fn in calls.items()}
        for name, fn in calls.items():
            nbytes = (one_bytes if name == "one stream" else hc_bytes)[pass_name]
            rows.append({
                "case": case.name, "pass": pass_name, "impl": name, "ms": ms[name],
                "speedup_vs_eager": ms["eager"] / ms[name] if name == "compiled" else None,
                "floor_fraction": floor_fraction(nbytes, bandwidth, ms[name]),
                **device_columns(fn, device, bandwidth, nbytes),
                "T": T, "H": H, "streams": n, "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
                "floor_ms": nbytes / bandwidth * 1e3,
            })
    return rows


def main() -> None:
    run_cases(__doc__, "bench_hyper_connections", make_cases, run_case, COLUMNS)


if __name__ == "__main__":
    main()
