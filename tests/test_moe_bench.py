"""The MoE benchmarks run end to end on CPU (gloo, 2 processes) in tiny form: `python -m moe_fp4 bench
moe` prints a row per policy with a positive throughput, and the convergence script trains every
policy to a loss below the uniform byte model's (ln 256) with paired differences to BF16 that stay
small after a few steps."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_moe_runs_every_policy():
    res = subprocess.run([sys.executable, "-m", "moe_fp4", "bench", "moe", "--iters", "1", "--layers", "1",
                          "--policies", "bf16,mxfp4", "--tokens", "48"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| 48 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["bf16", "mxfp4"], res.stdout
    for r in rows:
        assert float(r.split("|")[4]) > 0  # tok/GPU/s


def test_convergence_script_trains_every_policy(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_convergence.py"), "--out", str(tmp_path),
                          "--steps", "4", "--seeds", "0", "--layers", "1", "--d-model", "128", "--heads", "2",
                          "--experts", "4", "--intermediate", "128", "--seq", "32", "--batch", "4",
                          "--eval-batches", "2", "--warmup", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads((tmp_path / "convergence.json").read_text())["runs"]
    assert sorted(r["policy"] for r in runs) == sorted(["bf16", "fp8", "fp8-recompute", "mxfp4"])
    losses = {r["policy"]: r["eval_loss"] for r in runs}
    for pol, loss in losses.items():
        assert loss < math.log(256), f"{pol}: eval loss {loss} not below the uniform model's"
        assert abs(loss - losses["bf16"]) < 0.1, f"{pol}: {loss} against bf16 {losses['bf16']}"
    assert (tmp_path / "convergence.md").exists()
