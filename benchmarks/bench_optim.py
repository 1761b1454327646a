"""Optimizer benchmark: one AdamW step over a 2.6B-parameter MoE-like set of tensors.

    .venv/bin/python benchmarks/bench_optim.py            # CUDA, float32 params, 2.6B parameters
    .venv/bin/python benchmarks/bench_optim.py --smoke    # CPU + Triton interpreter, tiny set

Tensors (per layer, 4 layers, 2,617,262,080 parameters, the experts 92% of them): attention
4 x [2048, 2048], dense MLP [2048, 8192] x 2, experts 128 x [2048, 768] x 3 stacks, norms
[2048] x 2; --smoke: a few odd-sized tensors. Parameters and gradients float32 (the mixed-precision training layout).

Implementations (IMPLS: adding one is one entry; `extra_rows` times optimizers that take
other parameters, i.e. Muon):
    fmoe fp32       fmoe.optim.AdamW, float32 moments, the fused Triton kernel
    fmoe bf16       the same with bf16 moments (half the state memory)
    torch fused     torch.optim.AdamW(fused=True) (CUDA only; the baseline)
    torch foreach   torch.optim.AdamW(foreach=True) (the baseline on CPU)
    fmoe bf16 + clip factor     the gradient norm (fmoe.optim.grad_norm), then fmoe bf16's
                    step with the clip's factor (step(grad_factor=clip_factor(norm, 1.0))),
                    as examples/train_moe.py clips
    fmoe bf16 + fmoe clip       fmoe.optim.clip_grad_norm (the gradients scaled in place,
                    one launch per dtype: adamw.scale_), then fmoe bf16's step
    torch fused + clip          torch.nn.utils.clip_grad_norm_ (the gradients scaled in
                    place), then torch fused's step (torch foreach's on CPU)
    muon (matrices) fmoe.optim.Muon over the tensors with ndim >= 2 (extra_rows)
    torch muon (matrices)  torch.optim.Muon (torch >= 2.9) over the same matrices, each
                    expert of a stack its own 2-D tensor (torch's Muon takes 2-D parameters
                    alone), the same hyperparameters (lr 1e-3, momentum 0.95, nesterov, 5
                    Newton-Schulz steps in bf16 with the same coefficients, weight decay 0.01,
                    Moonlight's 0.2 sqrt(max(m, n)) scale: adjust_lr_fn "match_rms_adamw"):
                    Muon's baseline, the same work

Before timing, one step of fmoe fp32 and fmoe bf16 is checked against torch's AdamW on
copies of the first layer's tensors but its expert stacks (the same defaults: lr 1e-3,
betas (0.9, 0.999), eps 1e-8, weight decay 0.01): the updates within 1e-3 (relative norm,
printed).

Columns: median ms per step, state GiB (moments and masters, not the step counters), the
ratio of time to the baseline (the AdamW rows: torch fused, torch foreach on CPU; the
clipped AdamW rows: torch fused + clip, the same work; the Muon rows: torch muon; empty where torch has no Muon; the CSV's baseline column
names it), and the fraction of the bandwidth floor (AdamW rows; Muon is matmul-bound): bytes read and
written per step (params read+write, grads read, each moment read+write, at their dtypes)
over the copy bandwidth measured in the same run, divided by the time; the clipped rows
count one more read of the gradients (the norm), the least any clip + step moves. Goal on an H100:
fmoe bf16 at most 1.1x torch fused with half its state memory. CSV: OUT/bench_optim.csv.
"""

import sys

from _common import (  # before torch and fmoe: with --smoke it sets TRITON_INTERPRET
    bench,
    finish,
    floor_fraction,
    rel_err,
    start,
)

import torch  # noqa: E402
from fmoe.optim import clip_factor, clip_grad_norm, grad_norm  # noqa: E402
from fmoe.optim.adamw import AdamW  # noqa: E402
from fmoe.optim.muon import Muon  # noqa: E402

COLUMNS = ["impl", "ms", "state_GiB", "ratio_vs_baseline", "floor_fraction"]

MAX_NORM = 1.0


def fmoe_bf16(ps, dev):
    return AdamW(ps, state_dtype=torch.bfloat16, impl="triton")


def torch_fused(ps, dev):
    return torch.optim.AdamW(ps, weight_decay=0.01, fused=True) if dev.type == "cuda" else None


def torch_foreach(ps, dev):
    return torch.optim.AdamW(ps, weight_decay=0.01, foreach=True)


# name -> (make(params, device): the optimizer or None where it does not exist, clip: None,
# "factor" (the step takes the clip's factor), "fmoe" or "torch" (that clip in place, then the
# step)); the clipped rows come last: an in-place clip changes the gradients the others step with
IMPLS = {
    "fmoe fp32": (lambda ps, dev: AdamW(ps, impl="triton"), None),
    "fmoe bf16": (fmoe_bf16, None),
    "torch fused": (torch_fused, None),
    "torch foreach": (torch_foreach, None),
    "fmoe bf16 + clip factor": (fmoe_bf16, "factor"),
    "fmoe bf16 + fmoe clip": (fmoe_bf16, "fmoe"),
    "torch fused + clip": (lambda ps, dev: torch_fused(ps, dev) or torch_foreach(ps, dev), "torch"),
}


def stepper(opt, params, clip):
    """The timed call: opt's step, after or with the clip (IMPLS)."""
    if clip == "factor":
        return lambda: opt.step(grad_factor=clip_factor(grad_norm(params), MAX_NORM))
    if clip is not None:
        clip_ = clip_grad_norm if clip == "fmoe" else torch.nn.utils.clip_grad_norm_
        return lambda: (clip_(params, MAX_NORM), opt.step())
    return opt.step


def make_params(smoke: bool, device: torch.device) -> list[torch.Tensor]:
    if smoke:
        shapes = [(64, 48), (4, 32, 24), (33,), (2, 17, 5)]
    else:
        H, F, E, FE = 2048, 8192, 128, 768
        shapes = [s for _ in range(4) for s in [(H, H)] * 4 + [(H, F), (F, H), (E, H, FE), (E, H, FE), (E, FE, H), (H,), (H,)]]
    params = [torch.randn(s, device=device).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def check_adamw(params, device) -> None:
    """One step of fmoe fp32 and fmoe bf16 against torch's AdamW (the baseline) on copies of
    the first layer's tensors but its expert stacks: the same update, or the run stops."""
    some = [p for p in params[:11] if p.numel() <= 1 << 25]

    def stepped(make):
        copies = []
        for p in some:
            c = p.detach().clone().requires_grad_()
            c.grad = p.grad.clone()
            copies.append(c)
        make(copies, device).step()
        return torch.cat([(c.detach() - p.detach()).flatten() for c, p in zip(copies, some)])  # the update

    ref = stepped(lambda ps, dev: torch_fused(ps, dev) or torch_foreach(ps, dev))
    worst = 0.0
    for name, make in (("fmoe fp32", IMPLS["fmoe fp32"][0]), ("fmoe bf16", fmoe_bf16)):
        err = rel_err(stepped(make), ref)
        if err > 1e-3:
            sys.exit(f"{name}: its step differs from torch's AdamW by {err:.3g} (relative norm of the update)")
        worst = max(worst, err)
    print(f"AdamW: fmoe's steps agree with torch's (updates within {worst:.2g}, relative norm); timing", flush=True)


def state_bytes(opt) -> int:
    return sum(v.nbytes for s in opt.state.values() for k, v in s.items() if k != "step")


def extra_rows(params, device, bandwidth) -> list[dict]:
    """Muon's step over the matrices (ndim >= 2; the vectors belong to AdamW): five
    Newton-Schulz iterations per matrix, each expert of a stack its own matrix, by fmoe's Muon
    and by torch.optim.Muon (where torch has it) with the same hyperparameters over the same
    matrices as 2-D tensors (copies, with copies of the gradients). Matmul-bound, so no
    bandwidth fraction."""
    matrices = [p for p in params if p.ndim >= 2]
    opt = Muon(matrices, lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5, scale="moonlight")
    opt.step()  # creates the momentum buffers
    ms = bench(opt.step, device, label="muon")
    rows = [{"impl": "muon (matrices)", "ms": ms, "state_GiB": state_bytes(opt) / 2**30, "params": sum(p.numel() for p in matrices),
             "baseline": "torch muon (matrices)"}]
    del opt
    if not hasattr(torch.optim, "Muon"):
        print("torch.optim.Muon: not in this torch (2.9 or later); muon's ratio_vs_baseline left empty", flush=True)
        return rows
    flat = []  # every 2-D matrix of the same tensors, its own leaf with its gradient's copy
    for p in matrices:
        for w, g in zip(p.detach().reshape(-1, *p.shape[-2:]), p.grad.reshape(-1, *p.shape[-2:])):
            leaf = w.clone().requires_grad_()
            leaf.grad = g.clone()
            flat.append(leaf)
    ref = torch.optim.Muon(flat, lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    ref.step()  # creates the momentum buffers
    ms = bench(ref.step, device, label="torch muon")
    rows.append({"impl": "torch muon (matrices)", "ms": ms, "state_GiB": state_bytes(ref) / 2**30, "params": sum(p.numel() for p in flat),
                 "baseline": "torch muon (matrices)"})
    del ref, flat
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    args, device, _, bandwidth = start(__doc__)
    params = make_params(args.smoke, device)
    n = sum(p.numel() for p in params)
    print(f"{len(params)} tensors, {n:,} parameters", flush=True)
    check_adamw(params, device)
    rows = []
    for name, (make, clip) in IMPLS.items():
        opt = make(params, device)
        if opt is None:
            continue
        step = stepper(opt, params, clip)
        step()  # creates the state (and compiles)
        ms = bench(step, device, label=name)
        moments = sum(s["exp_avg"].element_size() for s in opt.state.values()) // len(opt.state)
        nbytes = n * (4 * 2 + 4 + 2 * moments * 2 + (4 if clip else 0))
        rows.append({
            "impl": name, "ms": ms, "state_GiB": state_bytes(opt) / 2**30,
            "floor_fraction": floor_fraction(nbytes, bandwidth, ms), "bytes": nbytes, "params": n,
        })
        del opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    adamw_base = "torch fused" if device.type == "cuda" else "torch foreach"
    for row in rows:  # a clipped row against torch's clip and step
        row["baseline"] = "torch fused + clip" if IMPLS[row["impl"]][1] is not None else adamw_base
    rows += extra_rows(params, device, bandwidth)
    ms = {row["impl"]: row["ms"] for row in rows}
    for row in rows:  # each row against the baseline doing its work: AdamW's against torch's AdamW, Muon's against torch's Muon
        row["ratio_vs_baseline"] = row["ms"] / ms[row["baseline"]] if row["baseline"] in ms else None
    finish(args, device, bandwidth, "bench_optim", [(rows, COLUMNS)])


if __name__ == "__main__":
    main()
