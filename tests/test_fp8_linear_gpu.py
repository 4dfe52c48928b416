"""On the GPU: the one-pass FP8 quantizers equal the spec bit for bit, and QuantLinear's real FP8 path
(FP8LinearFunction) gives the generic path's results bit for bit (marked gpu: skipped without CUDA)."""

import pytest
import torch
from _compare import assert_bitwise_equal
from test_fp8_linear import check_tile_stack, check_tiles

from moe_fp4 import formats, ops
from moe_fp4.recipes import FP8BlockwiseRecipe, QuantLinear, QuantLinearFunction, fp8_linear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def native():
    ops.build()
    assert ops.native_available()


def _input(m, k, dtype):
    """Rows and columns over many binades, with NaN, Inf, zero, subnormal and huge groups."""
    x = torch.randn(m, k, device="cuda")
    x *= torch.exp2(torch.randint(-30, 30, (m, 1), device="cuda").float())
    x *= torch.exp2(torch.randint(-8, 8, (1, k), device="cuda").float())
    if m >= 7 and k >= 256:
        x[1, 3] = float("nan")
        x[2, 140] = float("inf")
        x[3, 128:256] = 0.0
        x[4, :128] = torch.randn(128, device="cuda") * 1e-39
        x[5, :] = torch.finfo(dtype).max * torch.rand(k, device="cuda") * 0.5
        x[:, 200] = 0.0  # a zero column
    return x.to(dtype)


def _padded_t(x):
    m = x.shape[0]
    out = torch.zeros(x.shape[1], -(-m // 128) * 128, dtype=x.dtype, device=x.device)
    out[:, :m] = x.t()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 128), (7, 384), (300, 256), (4096, 7168), (8192, 2048)])
def test_rows_cols_match_the_spec(m, k, dtype):
    x = _input(m, k, dtype)
    d, s, dt, st = ops.quantize_fp8_rows_cols(x)
    want_d, want_s = formats.quantize_fp8_blockwise(x, block=(1, 128))
    want_dt, want_st = formats.quantize_fp8_blockwise(_padded_t(x), block=(1, 128))
    assert_bitwise_equal(d, want_d, "rows data")
    assert_bitwise_equal(s, want_s, "rows scales")
    assert_bitwise_equal(dt, want_dt, "columns data")
    assert_bitwise_equal(st, want_st, "columns scales")


def test_rows_cols_of_strided_inputs():
    base = _input(520, 1024, torch.bfloat16)
    for x in (base[8:400, 128:640], base.t()[:300, 128:512]):  # strided rows; a transposed view
        d, s, dt, st = ops.quantize_fp8_rows_cols(x)
        assert_bitwise_equal(d, formats.quantize_fp8_blockwise(x, block=(1, 128))[0], "rows data")
        assert_bitwise_equal(dt, formats.quantize_fp8_blockwise(_padded_t(x), block=(1, 128))[0], "columns data")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(128, 128), (384, 256), (2048, 7168)])
@pytest.mark.parametrize("transpose", [True, False])
def test_tiles_match_the_spec(n, k, dtype, transpose):
    check_tiles(_input(n, k, dtype), transpose)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("g, n, k", [(3, 256, 384), (4, 4096, 7168), (4, 7168, 2048)])
def test_tile_stack_matches_the_spec(g, n, k, dtype):
    """The experts' weights: each one's transpose stored contiguously by the same kernel pass."""
    check_tile_stack(_input(g * n, k, dtype).view(g, n, k))


def test_opcheck_two_axis_ops():
    from moe_fp4.ops import _ops

    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)  # finite: opcheck compares NaN != NaN
    torch.library.opcheck(_ops.quantize_fp8_rows_cols_op, (x,))
    torch.library.opcheck(_ops.quantize_fp8_tiles_op, (x[:128].float(), True, 0))
    torch.library.opcheck(_ops.quantize_fp8_tiles_op, (torch.randn(256, 256, device="cuda"), True, 128))


def _run(layer_fn, x, w, g, autocast):
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer_fn(xr, wr)
    y.backward(g)
    return y.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("x_dtype, w_dtype, autocast", [(torch.bfloat16, torch.bfloat16, False),
                                                        (torch.bfloat16, torch.float32, False),
                                                        (torch.float32, torch.float32, True)])
@pytest.mark.parametrize("m", [1000, 4096])
def test_fp8_path_equals_the_generic_path(m, x_dtype, w_dtype, autocast):
    """FP8LinearFunction (what QuantLinear runs here) and QuantLinearFunction give the same y, dx and
    dW bits: the same operands, the same torch._scaled_mm calls (also under a bfloat16 autocast of
    float32 inputs and weights, where y is bfloat16)."""
    recipe = FP8BlockwiseRecipe()
    k, n = 1024, 768
    x = _input(m, k, x_dtype).clamp(-1e4, 1e4).nan_to_num(0.0)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(w_dtype)
    y_dtype = torch.bfloat16 if autocast else x_dtype
    g = torch.randn(m, n, device="cuda", dtype=y_dtype)
    assert fp8_linear.applies(recipe, x, w)
    layer = QuantLinear(k, n, bias=False, device="cuda", dtype=w_dtype, recipe=recipe)
    fast = _run(lambda a, b: torch.func.functional_call(layer, {"weight": b}, (a,)), x, w, g, autocast)
    generic = _run(lambda a, b: QuantLinearFunction.apply(a, b, recipe, None, y_dtype), x, w, g, autocast)
    assert fast[0].dtype == y_dtype
    for name, a, b in zip(("y", "dx", "dW"), fast, generic):
        assert a.dtype == b.dtype, name
        assert_bitwise_equal(a, b, name)
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert float((fast[0].float() - ref).norm() / ref.norm()) < 0.05
