"""The README's ``Buffer`` snippet and the transformers example exit with code 0 under torchrun
(2 gloo ranks on CPU), run after run.

What this guards against: a gloo collective returns before gloo's worker thread has dropped its
work; if the caller's last reference to a tensor of that work went first, the worker frees it and
needs the GIL, and at interpreter exit it is killed inside C++ (SIGABRT, "terminate called without
an active exception"; see moe_fp4/ep/backends.py). Without the backend's wait the race hit a few runs
in a hundred; with a GIL switch interval of 100 s (``sys.setswitchinterval``: the exiting thread keeps
the GIL) it hit 5 of 8 runs of the snippet. So every run here sets that interval, through a runner
script that then runs the snippet (or the example module) unchanged.

``MOE_FP4_EXIT_RUNS`` (default 2) sets the runs per case (30 for the check of record).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = int(os.environ.get("MOE_FP4_EXIT_RUNS", "2"))
pytestmark = pytest.mark.timeout(120 + 60 * RUNS)  # a run takes 10 to 20 s on 2 cores

# The names the README's snippet takes from its surroundings: a gloo group, a batch, a routing and
# an expert layer (here: the FP8 rows decoded back to BF16).
PREAMBLE = '''
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
ep_group = dist.group.WORLD
torch.manual_seed(dist.get_rank())
T, H, K = 64, 256, 8
x = torch.randn(T, H, dtype=torch.bfloat16)
topk_idx = torch.rand(T, 256).topk(K).indices
topk_weights = torch.rand(T, K)


def run_local_experts(e4m3, scales, split_lens):
    rows = e4m3.float().reshape(e4m3.shape[0], -1, 128) * scales.unsqueeze(-1)
    return rows.reshape(e4m3.shape[0], -1).to(torch.bfloat16)
'''

EPILOGUE = '''
assert x_out.shape == (T, H) and x_out.dtype == torch.bfloat16 and bool(torch.isfinite(x_out.float()).all())
print(f"rank {dist.get_rank()}: x_out {tuple(x_out.shape)}", flush=True)
'''

RUNNER = '''
import runpy
import sys

sys.setswitchinterval(100.0)  # the exiting thread keeps the GIL: exit races show in most runs
target = sys.argv.pop(1)
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
'''


def readme_buffer_snippet() -> str:
    """The README's python block that builds a ``Buffer`` and runs dispatch and combine."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = [b for b in blocks if "Buffer(num_experts=" in b and "buf.combine(" in b]
    assert found, "README.md: no python block with Buffer(num_experts=...) and buf.combine("
    return found[0]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def run_many(args: list[str], cwd: Path, expect: str) -> None:
    failed = []
    for i in range(RUNS):
        res = torchrun(args, cwd)
        ok = res.returncode == 0 and res.stdout.count(expect) == 2
        if not ok:
            failed.append(f"run {i}: exit code {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    assert not failed, f"{len(failed)} of {RUNS} runs failed:\n" + "\n".join(failed)


@pytest.fixture
def runner(tmp_path: Path) -> Path:
    path = tmp_path / "runner.py"
    path.write_text(RUNNER)
    return path


def test_readme_buffer_snippet_exits_cleanly(tmp_path, runner):
    script = tmp_path / "readme_buffer.py"
    script.write_text(PREAMBLE + "\n" + readme_buffer_snippet() + EPILOGUE)
    run_many([str(runner), str(script)], tmp_path, "x_out (64, 256)")


def test_transformers_example_exits_cleanly(tmp_path, runner):
    pytest.importorskip("transformers")
    run_many([str(runner), "moe_fp4.integrations.hf_example"], tmp_path, "gradients finite: True")
