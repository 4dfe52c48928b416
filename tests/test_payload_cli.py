"""The main job: `python -m moe_fp4 payload` (sizes measured on the spec's own tensors)."""

import subprocess
import sys

import pytest

from moe_fp4.__main__ import main
from moe_fp4.formats.payload import measure_payload_bytes


@pytest.mark.parametrize("hidden", [7168, 2048, 128])
def test_measured_bytes_per_token(hidden):
    sizes = measure_payload_bytes(hidden)
    assert sizes["bf16"]["per_token"] == 2 * hidden
    assert sizes["fp8"]["per_token"] == hidden + 4 * hidden // 128
    assert sizes["mxfp8"]["per_token"] == hidden + hidden // 32
    assert sizes["mxfp4"]["per_token"] == hidden // 2 + hidden // 32
    assert sizes["nvfp4"]["per_token"] == hidden // 2 + hidden // 16 + 4 and sizes["nvfp4"]["per_message"] == 0
    ratio = sizes["mxfp4"]["per_token"] / sizes["fp8"]["per_token"]
    assert ratio == pytest.approx((0.5 + 1 / 32) / (1 + 4 / 128))


def test_cli_prints_the_table(capsys):
    assert main(["payload", "--hidden", "7168", "--tokens", "4096", "--topk", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:5].strip() in
            ("bf16", "fp8", "mxfp8", "mxfp4", "nvfp4")}
    assert rows["mxfp4"][1] == str(7168 // 2 + 7168 // 32)
    assert float(rows["mxfp4"][3]) == pytest.approx(4096 * 8 * 3808 / 2**20, abs=0.01)
    assert rows["mxfp4"][5] == "0.515" and rows["bf16"][4] == "1.000"


def test_cli_rejects_bad_arguments():
    r = subprocess.run([sys.executable, "-m", "moe_fp4", "payload", "--hidden", "100"], capture_output=True, text=True)
    assert r.returncode == 2 and "hidden: expected a positive multiple of 128" in r.stderr
    r = subprocess.run([sys.executable, "-m", "moe_fp4", "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr
