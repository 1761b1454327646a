"""Each benchmark's --smoke mode runs end to end (same code as on a GPU, tiny CPU shapes)."""

import csv
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_benchmark_smoke(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # --smoke sets it
    # the script imports this checkout's fmoe, not whichever tree the environment installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "NOT performance numbers" in out.stdout
    (csv_path,) = tmp_path.glob("*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert rows and all(float(r["ms"]) > 0 for r in rows)
    assert len({r["impl"] for r in rows if r.get("impl")}) >= 3  # ours and two baselines
