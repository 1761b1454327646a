"""Every Triton kernel compiles for Hopper (sm_90a) with the real compiler, without spills.

The interpreter that runs the kernels in the CPU tests accepts code the compiler rejects
(non-constexpr globals, some dtype mixes); this runs Triton's compiler and the ptxas it
ships, which need no GPU, at the benchmark shapes.
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_stats.py")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 78, out.stdout
    for row in rows:
        name, regs, spill = row[0], int(row[-6]), int(row[-5])
        assert 0 < regs <= 255 and spill == 0, f"{name}: {regs} registers, {spill} bytes spilled"


def test_kernel_stats_takes_no_options():
    """--help says what it does; an unknown flag is refused (it compiled every kernel anyway)."""
    script = str(ROOT / "benchmarks" / "kernel_stats.py")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "Compile fmoe's Triton kernels for Hopper" in helped.stdout and "takes no options" in helped.stdout
    bad = subprocess.run([sys.executable, script, "--bogus"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr and not bad.stdout
