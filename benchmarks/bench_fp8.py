"""FP8 GEMMs benchmark: fmoe.ops.fp8_matmul and grouped_mlp(fp8=True) against their bf16 selves.

    .venv/bin/python benchmarks/bench_fp8.py            # CUDA, real shapes
    .venv/bin/python benchmarks/bench_fp8.py --smoke    # CPU, tiny shapes (torch._scaled_mm on CPU)

Cases (--smoke: M = 64 and H, F, N of 32-48, float32 instead of bf16):
    up      a dense projection x [M, K] @ w [K, N]: M = 16384, K = 2048, N = 8192
    down    the same with K = 8192, N = 2048
    experts grouped_mlp over R = 131072 rows (16384 tokens x 8 slots) in E = 128 experts of
            H = 2048, F = 768, balanced (bench_moe_layer's shape A), three GEMMs each way

Implementations:
    fp8           fp8_matmul / grouped_mlp(fp8=True): the forward and input-gradient GEMMs
                  in fp8 (torch._scaled_mm / torch._scaled_grouped_mm), the quantization in
                  eager torch ops (an amax, a scale, a cast: passes over each operand)
    fp8 compiled  the same under torch.compile(dynamic=False), which fuses fp8_matmul's
                  quantization (grouped_mlp's runs inside its grouped-GEMM custom op: the
                  experts' row times what the compiler leaves as it is)
    fp8 fast accum  (experts only) grouped_mlp(fp8=True, fp8_fast_accum=True): the grouped
                  GEMMs with use_fast_accum (the tensor cores' own accumulator); its rel_err
                  beside fp8's says what that costs
    bf16          x @ w / grouped_mlp: every GEMM in the compute dtype

A second table takes the experts' first GEMM (x [R, H] @ W_gate[e] [H, F]) apart, forward
only: torch._grouped_mm in bf16; torch._scaled_grouped_mm on operands quantized beforehand,
with its default float32 accumulation and with use_fast_accum (the tensor cores' own
accumulator, fmoe's only with fp8_fast_accum: the row says what it gains); and the
quantization of x (the rows) and of W_gate (each expert's columns) by fp8_quantize's Triton
kernel (impl="auto" on CUDA) and by the torch ops (impl="torch"), with the fraction of the
bytes floor (read the input once, write a byte per value and the scales, at the copy
bandwidth measured in the same run; the kernel reads it twice, the second time mostly
from L2). --smoke (CPU) has the torch ops' quantization rows alone: the kernel's and the
GEMMs' rows need CUDA.

Passes: fwd, and fwd+bwd (the gradients of x and w for a fixed upstream gradient).

Table: median ms; on the fp8 rows the speedup (bf16 ms / their ms); TFLOP/s (2 M K N per GEMM,
3 GEMMs in fwd+bwd); that rate as a fraction of the bf16 matmul rate and of the fp8 matmul
rate, both measured in the same run (8192^3: a @ b in bf16, and torch._scaled_mm with
row-wise scales on the same operands cast to e4m3); rel_err, the forward's error against a
float32 product of the unquantized operands (fp8's rounding: a few percent; bf16's: below
one). The CSV goes to OUT/bench_fp8.csv.
"""

from _common import bench, finish, matmul_rate, rel_err, start  # before torch and fmoe

import torch  # noqa: E402
from fmoe.ops import fp8_matmul, fp8_quantize, grouped_mlp  # noqa: E402

COLUMNS = ["case", "pass", "impl", "ms", "speedup_vs_bf16", "TFLOPs", "bf16_rate_fraction", "fp8_rate_fraction", "rel_err"]
PART_COLUMNS = ["part", "impl", "ms", "speedup", "TFLOPs", "bf16_rate_fraction", "fp8_rate_fraction", "floor_fraction"]


def fp8_rate(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n torch._scaled_mm with row-wise scales (e4m3 operands, bf16 out
    on CUDA, float32 on CPU)."""
    a_fp8, scale_a = fp8_quantize(torch.randn(n, n, device=device), 1)
    bt_fp8, scale_b = fp8_quantize(torch.randn(n, n, device=device), 1)
    out = torch.bfloat16 if device.type == "cuda" else torch.float32
    ms = bench(lambda: torch._scaled_mm(a_fp8, bt_fp8.t(), scale_a=scale_a, scale_b=scale_b.t(), out_dtype=out), device)
    return 2 * n**3 / (ms * 1e-3)


def dense_case(name, M, K, N, device, dtype):
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(K, N, device=device) / K**0.5).to(dtype).requires_grad_()
    grad_y = torch.randn(M, N, device=device, dtype=dtype)
    impls = {"fp8": lambda: fp8_matmul(x, w), "fp8 compiled": torch.compile(lambda: fp8_matmul(x, w), dynamic=False),
             "bf16": lambda: x @ w}
    exact = x.detach().float() @ w.detach().float()
    return name, impls, (x, w), grad_y, 2 * M * K * N, exact


def experts_case(R, E, H, F, device, dtype):
    x = torch.randn(R, H, device=device, dtype=dtype, requires_grad=True)
    ws = [(torch.randn(E, *shape, device=device) / shape[0]**0.5).to(dtype).requires_grad_() for shape in ((H, F), (H, F), (F, H))]
    offsets = torch.full((E,), R // E, device=device).cumsum(0).to(torch.int32)
    grad_y = torch.randn(R, H, device=device, dtype=dtype)
    def fp8():
        return grouped_mlp(x, *ws, offsets, check=False, fp8=True)

    impls = {"fp8": fp8, "fp8 compiled": torch.compile(fp8, dynamic=False),
             "fp8 fast accum": lambda: grouped_mlp(x, *ws, offsets, check=False, fp8=True, fp8_fast_accum=True),
             "bf16": lambda: grouped_mlp(x, *ws, offsets, check=False)}
    exact = grouped_mlp(x.detach().float(), *(w.detach().float() for w in ws), offsets, check=False)
    return "experts", impls, (x, *ws), grad_y, 3 * 2 * R * H * F, exact


def run_case(case, device, rates) -> list[dict]:
    name, impls, leaves, grad_y, fwd_flops, exact = case

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), leaves, grad_y)

    torch._dynamo.reset()  # one compile per case, never near dynamo's recompile limit
    rows = []
    for pass_name, flops, wrap in (("fwd", fwd_flops, lambda fn: fn), ("fwd+bwd", 3 * fwd_flops, fwd_bwd)):
        ms = {impl: bench(wrap(fn), device, label=f"{name}-{pass_name}-{impl}") for impl, fn in impls.items()}
        for impl in impls:
            rate = flops / (ms[impl] * 1e-3)
            rows.append({"case": name, "pass": pass_name, "impl": impl, "ms": ms[impl],
                         "speedup_vs_bf16": ms["bf16"] / ms[impl] if impl != "bf16" else None,
                         "TFLOPs": rate / 1e12, "bf16_rate_fraction": rate / rates["bf16"], "fp8_rate_fraction": rate / rates["fp8"],
                         "rel_err": rel_err(impls[impl]().detach(), exact), "flops": flops})
    print(f"{name}: timed", flush=True)
    return rows


def parts(R, E, H, F, device, dtype, rates, bandwidth) -> list[dict]:
    """The experts' first GEMM and its operands' quantization, timed apart (module docstring)."""
    torch.manual_seed(0)
    x = torch.randn(R, H, device=device, dtype=dtype)
    w = (torch.randn(E, H, F, device=device) / H**0.5).to(dtype)
    offsets = torch.full((E,), R // E, device=device).cumsum(0).to(torch.int32)
    rows = []

    def quant_row(part, impl, t, dim, ms_ref=None):
        ms = bench(lambda: fp8_quantize(t, dim, impl=impl), device, label=f"quantize-{part}-{impl}")
        floor_ms = (t.numel() * (t.element_size() + 1) + 4 * t.numel() / t.shape[dim]) / bandwidth * 1e3
        rows.append({"part": part, "impl": impl, "ms": ms, "speedup": None if ms_ref is None else ms_ref / ms,
                     "floor_fraction": floor_ms / ms})
        return ms

    for part, t, dim in (("quantize x (rows)", x, 1), ("quantize W_gate (columns)", w, 1)):
        torch_ms = quant_row(part, "torch", t, dim)
        if device.type == "cuda":
            quant_row(part, "triton", t, dim, torch_ms)
    if device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
        flops = 2 * R * H * F
        x_fp8, sx = fp8_quantize(x, 1)
        w_fp8, sw = fp8_quantize(w, 1)  # [E, H, F] with H innermost: column-major, as the GEMM takes it
        gemms = {"bf16 _grouped_mm": lambda: torch._grouped_mm(x, w, offs=offsets)}
        for fast in (False, True):
            gemms["_scaled_grouped_mm" + (" fast accum" if fast else "")] = (
                lambda fast=fast: torch._scaled_grouped_mm(x_fp8, w_fp8, sx.reshape(-1), sw.reshape(E, F), offs=offsets,
                                                           out_dtype=dtype, use_fast_accum=fast))
        bf16_ms = None
        for impl, fn in gemms.items():
            ms = bench(fn, device, label=f"gemm-{impl}")
            bf16_ms = bf16_ms or ms
            rate = flops / (ms * 1e-3)
            rows.append({"part": "x @ W_gate", "impl": impl, "ms": ms, "speedup": bf16_ms / ms if impl != "bf16 _grouped_mm" else None,
                         "TFLOPs": rate / 1e12, "bf16_rate_fraction": rate / rates["bf16"], "fp8_rate_fraction": rate / rates["fp8"]})
    print("parts: timed", flush=True)
    return rows


def main() -> None:
    args, device, dtype, bandwidth = start(__doc__)
    n = 256 if args.smoke else 8192
    rates = {"bf16": matmul_rate(device, dtype, n), "fp8": fp8_rate(device, n)}
    print(f"matmul rates ({n}^3): {dtype} {rates['bf16'] / 1e12:.1f} TFLOP/s, fp8 row-wise {rates['fp8'] / 1e12:.1f} TFLOP/s", flush=True)
    if args.smoke:
        cases = [dense_case("up", 64, 32, 48, device, dtype), dense_case("down", 64, 48, 32, device, dtype),
                 experts_case(64, 4, 32, 16, device, dtype)]
    else:
        cases = [dense_case("up", 16384, 2048, 8192, device, dtype), dense_case("down", 16384, 8192, 2048, device, dtype),
                 experts_case(16384 * 8, 128, 2048, 768, device, dtype)]
    shape = (64, 4, 32, 16) if args.smoke else (16384 * 8, 128, 2048, 768)
    part_rows = parts(*shape, device, dtype, rates, bandwidth)
    rows = []
    for case in cases:
        rows += run_case(case, device, rates)
    finish(args, device, bandwidth, "bench_fp8", [(part_rows, PART_COLUMNS), (rows, COLUMNS)],
           bf16_TFLOPs=rates["bf16"] / 1e12, fp8_TFLOPs=rates["fp8"] / 1e12)


if __name__ == "__main__":
    main()
