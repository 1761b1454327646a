"""Loss benchmark: fmoe's fused cross-entropy and linear cross-entropy against torch.

    .venv/bin/python benchmarks/bench_loss.py            # CUDA, bf16, real shapes
    .venv/bin/python benchmarks/bench_loss.py --smoke    # CPU + Triton interpreter, tiny shapes

Cases (bf16; --smoke: N=16, V=1000, H=32, chunks of 4 rows):
    ce      cross-entropy of logits [N=8192, V=131072]
    ce softcap=30   the same of the logits capped at 30 tanh(logits / 30) (Gemma 2's, Beam's)
    linear  cross-entropy of h [N=8192, H=4096] @ weight [V=131072, H]^T

Implementations, each timed forward + backward (the gradient of the inputs for a unit
upstream gradient); fmoe's with check=False (the label check syncs with the host):
    ce      fused          cross_entropy(impl="triton"): the forward kernel writes the loss and
                           each row's logsumexp, the backward kernel the gradient
            fused_inplace  the same with inplace_grad=True: the gradient overwrites the logits
            eager          torch.nn.functional.cross_entropy on the bf16 logits, as users call it
            compiled       torch.compile(F.cross_entropy), warmed up before timing
            (softcap: fused and fused_inplace cap inside the kernels; eager and compiled
            cap the logits with torch.tanh first, then F.cross_entropy)
    linear  fused          linear_cross_entropy(impl="triton"): dweight accumulates in place in
                           the weight's dtype (bf16), the default
            fused_fp32acc  the same with accumulate_dtype=float32: a float32 dweight buffer
            unfused        F.cross_entropy(h @ weight.T)
            compiled       torch.compile of unfused
            torch_chunked  F.linear_cross_entropy(options=LinearCrossEntropyOptions()), torch's
                           own chunked version, where this torch has it

Columns: ms (median), speedup (eager or unfused ms / ms), peak_MiB (CUDA only: the peak of
torch.cuda.max_memory_allocated over what was allocated before the step, inputs excluded;
blank on CPU), ratio (peak_MiB / the eager or unfused peak: the fused linear cross-entropy
aims at a quarter or less), floor_fraction (ce: time to read the logits once and write their
gradient once at the bandwidth of a copy measured in the same run, over ms; an exact gradient
reads a row twice when the row does not fit on chip, 256 KiB here, so 2/3 is the ceiling of
any such kernel and of torch's), device_ms and device_floor_fraction (ce: the device's own
time per call with the host queued ahead, _common.device_ms, and floor_fraction over it
instead of ms; empty on CPU), TFLOP/s (linear: the 6 N H V flops of the three GEMMs, over
ms). Before timing, each case checks every implementation against its baseline (eager,
unfused): the loss against torch's in float32, the gradients against the baseline's. The CSV goes to OUT/bench_loss.csv.
"""

import sys

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    cuda_peak_bytes,
    device_columns,
    finish,
    floor_fraction,
    rel_err,
    start,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmoe.ops.loss import cross_entropy, linear_cross_entropy  # noqa: E402

COLUMNS = ["case", "impl", "ms", "speedup", "peak_MiB", "ratio", "floor_fraction", "device_ms", "device_floor_fraction", "TFLOP/s"]


def peak_mib(step, device) -> float | None:
    """Peak CUDA memory of step() above what was allocated before it, in MiB (None on CPU)."""
    peak = cuda_peak_bytes(step, device)
    return None if peak is None else peak / 2**20


def capped(x, softcap):
    """softcap tanh(x / softcap), or x for None."""
    return x if softcap is None else torch.tanh(x / softcap) * softcap


def check(case: str, impls: dict, baseline: str, inputs_of, logits, labels, softcap=None) -> None:
    """Exits unless every impl's loss matches torch's in float32 on the same (capped) logits
    (fmoe's, which return a float32 loss, within 1e-4; torch's own bf16 ones within bf16's
    rounding, 2e-2) and its input gradients match the baseline's (bf16 rounding apart);
    inputs_of(name) gives an impl's inputs (fresh ones for an impl that overwrites them)."""
    expected = float(F.cross_entropy(capped(logits.detach().float(), softcap), labels))
    _, *grads_base = impls[baseline](*inputs_of(baseline))
    worst = [0.0, 0.0]
    for name, step in impls.items():
        value, *grads = step(*inputs_of(name))
        errs = [abs(float(value) - expected) / abs(expected), max(rel_err(a, b) for a, b in zip(grads, grads_base))]
        if errs[0] > (1e-4 if name.startswith("fused") else 2e-2) or errs[1] > 2e-2:
            sys.exit(f"{case}: {name} disagrees (relative errors of the loss and the gradients: {errs})")
        worst = [max(w, e) for w, e in zip(worst, errs)]
    print(f"{case}: {', '.join(impls)} agree (relative errors of the loss within {worst[0]:.1e}, of the gradients within "
          f"{worst[1]:.1e} of the {baseline}'s); timing", flush=True)


def fwd_bwd(loss_fn):
    """(inputs...) -> (loss, gradients of the inputs)."""
    def step(*inputs):
        value = loss_fn(*inputs)
        return (value.detach(), *torch.autograd.grad(value, inputs))
    return step


def measure(case, impls, inputs_of, baseline, device, extra, floor=None) -> list[dict]:
    """Time and peak memory of every impl; inputs_of(name) gives the impl's inputs. With
    floor = (bytes, copy bandwidth), also the device's time (device_columns)."""
    rows = []
    for name, step in impls.items():
        inputs = inputs_of(name)
        step(*inputs)  # compiles, and warms up
        # CPU: one timed call, no further warm-up (the interpreter is slow)
        ms = bench(lambda: step(*inputs), device, cpu_warmup=0, cpu_repeats=1, label=f"{case}-{name}")
        rows.append({"case": case, "impl": name, "ms": ms, "peak_MiB": peak_mib(lambda: step(*inputs), device)})
        if floor is not None:
            rows[-1].update(device_columns(lambda: step(*inputs), device, floor[1], floor[0]))
    base = next(r for r in rows if r["impl"] == baseline)
    for row in rows:
        row["speedup"] = base["ms"] / row["ms"]
        row["ratio"] = row["peak_MiB"] / base["peak_MiB"] if base["peak_MiB"] else None
        row.update(extra(row))
    return rows


def run_ce(N, V, device, bandwidth, softcap=None) -> list[dict]:
    torch._dynamo.reset()
    logits = (4 * torch.randn(N, V, device=device)).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), device=device)
    labels[::16] = -100  # some padding
    impls = {
        "fused": fwd_bwd(lambda x: cross_entropy(x, labels, check=False, impl="triton", softcap=softcap)),
        "fused_inplace": fwd_bwd(lambda x: cross_entropy(x, labels, inplace_grad=True, check=False, impl="triton", softcap=softcap)),
        "eager": fwd_bwd(lambda x: F.cross_entropy(capped(x, softcap), labels)),
        "compiled": fwd_bwd(torch.compile(lambda x: F.cross_entropy(capped(x, softcap), labels), dynamic=False)),
    }
    case = "ce" if softcap is None else f"ce softcap={softcap:g}"
    logits.requires_grad_()
    check(case, impls, "eager", lambda name: (logits.detach().clone().requires_grad_() if name == "fused_inplace" else logits,), logits, labels, softcap)
    # the in-place variant overwrites its logits with their gradient at every call: a copy
    overwritten = logits.detach().clone().requires_grad_()
    nbytes = 2 * logits.numel() * logits.element_size()  # read the logits, write the gradient
    rows = measure(
        f"{case} N={N} V={V}", impls, lambda name: (overwritten if name == "fused_inplace" else logits,), "eager", device,
        lambda row: {"floor_fraction": floor_fraction(nbytes, bandwidth, row["ms"]), "bytes": nbytes, "floor_ms": nbytes / bandwidth * 1e3},
        floor=(nbytes, bandwidth),
    )
    return [dict(row, N=N, V=V) for row in rows]


def run_linear(N, H, V, chunk_rows, device) -> list[dict]:
    torch._dynamo.reset()
    h = (torch.randn(N, H, device=device) / 8).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device=device) / 8).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,), device=device)
    labels[::16] = -100

    def unfused(a, b):
        return F.cross_entropy(a @ b.T, labels)

    impls = {
        "fused": fwd_bwd(lambda a, b: linear_cross_entropy(a, b, labels, chunk_rows=chunk_rows, check=False, impl="triton")),
        "fused_fp32acc": fwd_bwd(lambda a, b: linear_cross_entropy(a, b, labels, chunk_rows=chunk_rows, accumulate_dtype=torch.float32, check=False, impl="triton")),
        "unfused": fwd_bwd(unfused),
        "compiled": fwd_bwd(torch.compile(unfused, dynamic=False)),
    }
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        options = torch.nn.LinearCrossEntropyOptions()
        impls["torch_chunked"] = fwd_bwd(lambda a, b: F.linear_cross_entropy(a, b, labels, options=options))
    check("linear", impls, "unfused", lambda name: (h, weight), h @ weight.T, labels)
    flops = 6 * N * H * V
    rows = measure(
        f"linear N={N} H={H} V={V}", impls, lambda name: (h, weight), "unfused", device,
        lambda row: {"TFLOP/s": flops / (row["ms"] * 1e-3) / 1e12},
    )
    return [dict(row, N=N, H=H, V=V, chunk_rows=chunk_rows) for row in rows]


def main() -> None:
    args, device, _, bandwidth = start(__doc__)  # bf16 inputs even in --smoke
    N, V, H = (16, 1000, 32) if args.smoke else (8192, 131072, 4096)
    chunk_rows = 4 if args.smoke else None  # None: the default, 1024 rows at V = 131072 bf16
    rows = run_ce(N, V, device, bandwidth) + run_ce(N, V, device, bandwidth, softcap=30.0) + run_linear(N, H, V, chunk_rows, device)
    finish(args, device, bandwidth, "bench_loss", [(rows, COLUMNS)], dtype="bfloat16")


if __name__ == "__main__":
    main()
