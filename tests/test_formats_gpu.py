"""The spec runs on CUDA too and gives the same bits there as on the CPU."""

import pytest
import torch
from _compare import assert_bitwise_equal

import moe_fp4.formats as F

pytestmark = pytest.mark.gpu


def _same(fn, *args, **kwargs):
    cpu = fn(*args, **kwargs)
    gpu = fn(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    gpu = gpu if isinstance(gpu, tuple) else (gpu,)
    for i, (c, g) in enumerate(zip(cpu, gpu)):
        assert_bitwise_equal(g.cpu(), c, f"{fn.__name__} output {i}")


def test_spec_is_device_independent():
    x = torch.randn(512, 1024) * torch.exp2(torch.randint(-30, 30, (512, 1)).float())
    x[0, 3] = float("nan")
    x[1, 100] = float("inf")
    x[2, :64] = 0.0
    for fmt in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2"):
        _same(F.encode_elements, x, fmt)
    _same(F.quantize_mxfp4, x.to(torch.bfloat16))
    _same(F.quantize_mxfp4, x, scale_rounding="down")
    _same(F.quantize_mxfp8, x, fmt="e5m2", axis=0)
    _same(F.quantize_nvfp4, x)
    _same(F.quantize_nvfp4, x, block_2d=True)
    _same(F.quantize_fp8_blockwise, x, block=(128, 128))
    packed, scales = F.quantize_mxfp4(x)
    _same(F.mxfp4_to_fp8_blockwise, packed, scales)
    _same(F.mxfp4_rows_to_fp8_cols, packed, scales, torch.tensor([100, 0, 1, 411]))
