"""Recipes on CUDA: the emulation gives the CPU's bits, and the real blockwise FP8 GEMM
(torch._scaled_mm) agrees with the emulated one up to accumulation order and the BF16 output."""

import pytest
import torch
from _compare import assert_bitwise_equal

from moe_fp4.recipes import (
    FP8BlockwiseRecipe,
    MXFP4Recipe,
    MXFP8Recipe,
    NVFP4Recipe,
    QuantLinear,
    scaled_mm_status,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", [MXFP8Recipe(), NVFP4Recipe(), MXFP4Recipe(), FP8BlockwiseRecipe(backend="emulate")],
                         ids=lambda r: r.name)
def test_quantized_operands_are_device_independent(recipe):
    t = torch.randn(256, 512) * torch.exp2(torch.randint(-20, 20, (256, 1)).float())
    for role, gemm in (("input", "fprop"), ("weight", "fprop"), ("weight", "dgrad")):
        cpu, _ = recipe.quantize_rows(t, role=role, gemm=gemm)
        gpu, _ = recipe.quantize_rows(t.cuda(), role=role, gemm=gemm)
        assert_bitwise_equal(gpu.cpu(), cpu, f"{recipe.name} {role} {gemm}")


def test_blockwise_fp8_scaled_mm_matches_emulation():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise FP8 GEMMs need sm_90")
    torch.manual_seed(0)
    a = torch.randn(384, 640, device="cuda")
    b = torch.randn(256, 640, device="cuda")
    real, emu = FP8BlockwiseRecipe(backend="scaled_mm"), FP8BlockwiseRecipe(backend="emulate")
    for gemm in ("fprop", "dgrad", "wgrad"):
        e = emu.gemm_nt(a, b, gemm=gemm)
        r = real.gemm_nt(a, b, gemm=gemm)
        # same quantized operands: only the accumulation order and the BF16 output rounding differ
        assert float((r - e).abs().max() / e.abs().max()) <= 2.0 ** -7, gemm
    assert all(v is True for v in scaled_mm_status().values()), scaled_mm_status()


def test_quantlinear_trains_on_cuda_under_torch_autocast():
    torch.manual_seed(0)
    for recipe in (NVFP4Recipe(gemm_dtype="bfloat16"), FP8BlockwiseRecipe()):
        layer = QuantLinear(256, 128, device="cuda", recipe=recipe)
        x = torch.randn(3, 100, 256, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
        ref = torch.nn.functional.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
        assert float((y.detach().float() - ref).norm() / ref.norm()) < 0.2
