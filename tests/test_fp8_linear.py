"""CPU tests of the one-pass FP8 operand quantizers (their spec fallback and argument checks) and of
QuantLinear's real FP8 path (FP8LinearFunction): its operands, GEMM plumbing and gradients, with
torch._scaled_mm replaced by the stand-in for cuBLAS of test_recipes (GPU runs: test_fp8_linear_gpu)."""

from __future__ import annotations

import pytest
import torch
from _compare import assert_bitwise_equal
from test_recipes import _cublas_like_scaled_mm

import moe_fp4.formats as S
import moe_fp4.recipes.recipes as R
from moe_fp4 import ops
from moe_fp4.recipes import FP8BlockwiseRecipe, FP8LinearFunction, QuantLinearFunction, fp8_blockwise_scaled_mm


def spread(*shape, dtype=torch.float32):
    """Values over many binades (so blocks get different scales), with a few exact zeros."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-12, 12, (shape[0], 1)).float())
    x[torch.rand(*shape) < 0.01] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 130, 256])
def test_rows_cols_are_the_spec_of_x_and_of_padded_x_t(m, dtype):
    x = spread(m, 384, dtype=dtype)
    x[0, 5] = float("nan")
    d, s, dt, st = ops.quantize_fp8_rows_cols(x)
    want_d, want_s = S.quantize_fp8_blockwise(x, block=(1, 128))
    assert_bitwise_equal(d, want_d, "rows data")
    assert_bitwise_equal(s, want_s, "rows scales")
    mp = -(-m // 128) * 128
    padded = torch.zeros(384, mp, dtype=dtype)
    padded[:, :m] = x.t()
    want_dt, want_st = S.quantize_fp8_blockwise(padded, block=(1, 128))
    assert dt.shape == (384, mp) and st.shape == (384, mp // 128)
    assert_bitwise_equal(dt, want_dt, "columns data")
    assert_bitwise_equal(st, want_st, "columns scales")
    assert torch.isnan(st[5, 0]) and not torch.isnan(st[4, 0])


def check_tiles(w, transpose):
    """ops.quantize_fp8_tiles(w) against the spec: W's 128x128 tiles and, when asked, W^T's own tile
    quantization (the same bits, transposed scales) as a contiguous tensor."""
    d, s, dt = ops.quantize_fp8_tiles(w, transpose=transpose)
    want_d, want_s = S.quantize_fp8_blockwise(w, block=(128, 128))
    assert_bitwise_equal(d, want_d, "tile data")
    assert_bitwise_equal(s, want_s, "tile scales")
    if transpose:
        want_t, want_ts = S.quantize_fp8_blockwise(w.t().contiguous(), block=(128, 128))
        assert dt.is_contiguous()
        assert_bitwise_equal(dt, want_t, "transposed data")
        assert_bitwise_equal(s.t(), want_ts, "transposed scales")
    else:
        assert dt.shape == (0, w.shape[0])


def check_tile_stack(w):
    """ops.quantize_fp8_tiles of a stack [G, N, K]: each weight's tiles as the spec gives them and each
    weight's own transpose, contiguous, in [G, K, N] (one pass over the stack)."""
    g, n, k = w.shape
    d, s, dt = ops.quantize_fp8_tiles(w)
    assert d.shape == (g, n, k) and s.shape == (g, n // 128, k // 128) and dt.shape == (g, k, n)
    assert dt.is_contiguous()
    for e in range(g):
        want_d, want_s = S.quantize_fp8_blockwise(w[e], block=(128, 128))
        assert_bitwise_equal(d[e], want_d, f"tile data of weight {e}")
        assert_bitwise_equal(s[e], want_s, f"tile scales of weight {e}")
        want_t = S.quantize_fp8_blockwise(w[e].t().contiguous(), block=(128, 128))[0]
        assert_bitwise_equal(dt[e], want_t, f"transposed data of weight {e}")
    d_only, _, dt_none = ops.quantize_fp8_tiles(w, transpose=False)
    assert_bitwise_equal(d_only, d, "tile data without the transpose")
    assert dt_none.shape == (0, g * n)


def test_tile_stack_transposes_each_weight():
    w = spread(3 * 256, 384).view(3, 256, 384)
    w[1, 130, 200] = float("inf")
    check_tile_stack(w)


@pytest.mark.parametrize("transpose", [True, False])
def test_tiles_and_their_transpose(transpose):
    w = spread(256, 384)
    w[130, 200] = float("inf")
    check_tiles(w, transpose)


def test_two_axis_quantizers_reject_bad_input():
    with pytest.raises(ValueError, match="x: dimension 1 .* multiple of 128"):
        ops.quantize_fp8_rows_cols(torch.randn(4, 100))
    with pytest.raises(ValueError, match="x: expected dtype"):
        ops.quantize_fp8_rows_cols(torch.randn(4, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x: expected 2 dimension\(s\)"):
        ops.quantize_fp8_rows_cols(torch.randn(2, 4, 128))
    with pytest.raises(ValueError, match="w: dimension 0 .* multiple of 128"):
        ops.quantize_fp8_tiles(torch.randn(100, 128))
    with pytest.raises(ValueError, match="transpose: expected a bool"):
        ops.quantize_fp8_tiles(torch.randn(128, 128), transpose=1)
    with pytest.raises(ValueError, match=r"w: expected \[G, N, K\] .* got shape \(2, 100, 128\)"):
        ops.quantize_fp8_tiles(torch.randn(2, 100, 128))
    with pytest.raises(ValueError, match=r"w: expected \[G, N, K\] .* got shape \(2, 128, 100\)"):
        ops.quantize_fp8_tiles(torch.randn(2, 128, 100))
    with pytest.raises(ValueError, match=r"w: expected \[N, K\] or \[G, N, K\], got shape \(1, 1, 128, 128\)"):
        ops.quantize_fp8_tiles(torch.randn(1, 1, 128, 128))
    from moe_fp4.ops import _ops

    for bad in (-128, 100, 384):  # not a multiple of 128; not dividing the 256 rows
        with pytest.raises(ValueError, match="group_rows: expected 0 or a multiple of 128 dividing w's rows"):
            _ops.quantize_fp8_tiles_op(torch.randn(256, 128), True, bad)


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("group_rows", [0, 128, 256])
def test_opcheck_tiles_op(transpose, group_rows):
    """The op's real (CPU) and fake implementations agree for every transpose / group_rows."""
    from moe_fp4.ops import _ops

    torch.library.opcheck(_ops.quantize_fp8_tiles_op, (spread(256, 384), transpose, group_rows))


def _reference(x, w, g, standin: bool):
    """y, dx, dW from the spec's operands of the three GEMMs (generic roles: x 1x128, W 128x128,
    W^T 128x128, dy 1x128, and dy^T, x^T zero-padded along the tokens, 1x128)."""
    rows, tiles = (1, 128), (128, 128)

    def gemm(a, block_a, b, block_b, out_dtype):
        da, sa = S.quantize_fp8_blockwise(a, block=block_a)
        db, sb = S.quantize_fp8_blockwise(b, block=block_b)
        if standin:
            return fp8_blockwise_scaled_mm(da, sa, block_a, db, sb, block_b).to(out_dtype)
        ref = torch.matmul(S.dequantize_fp8_blockwise(da, sa, block=block_a),
                           S.dequantize_fp8_blockwise(db, sb, block=block_b).t())
        return ref.to(out_dtype)

    pad = -x.shape[0] % 128
    y = gemm(x, rows, w, tiles, x.dtype)
    dx = gemm(g, rows, w.t().contiguous(), tiles, x.dtype)
    dw = gemm(torch.nn.functional.pad(g.t(), (0, pad)), rows, torch.nn.functional.pad(x.t(), (0, pad)), rows, w.dtype)
    return y, dx, dw


@pytest.mark.parametrize("m", [200, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_gemms_take_the_spec_operands(monkeypatch, m, dtype):
    """With the cuBLAS stand-in, y, dx and dW are those of fp8_blockwise_scaled_mm on operands the
    spec quantizes from x, W and dy (and the first-use check accepts them)."""
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _cublas_like_scaled_mm)
    x = spread(m, 512, dtype=dtype).requires_grad_(True)
    w = spread(384, 512, dtype=dtype).requires_grad_(True)
    g = spread(m, 384, dtype=dtype)
    y = FP8LinearFunction.apply(x, w, FP8BlockwiseRecipe(), dtype, True, True)
    y.backward(g)
    want_y, want_dx, want_dw = _reference(x.detach(), w.detach(), g, standin=True)
    assert_bitwise_equal(y.detach(), want_y, "y")
    assert_bitwise_equal(x.grad, want_dx, "dx")
    assert_bitwise_equal(w.grad, want_dw, "dW")
    # three layouts ran and passed the first-use check: fprop, dgrad (384 / 128 = 3 blocks), wgrad
    assert all(v is True for v in R._SCALED_MM_STATE.values()) and len(R._SCALED_MM_STATE) == 3


def _refuse(*args, **kwargs):
    raise RuntimeError("layout not supported (test)")


@pytest.mark.parametrize("shape", [(3, 70), (256,)])
def test_fp8_linear_falls_back_to_the_generic_emulation(monkeypatch, shape):
    """Where torch._scaled_mm refuses a layout, the emulation of the same FP8 operands runs: y, dx and
    dW equal the generic path's emulation (QuantLinearFunction with backend "emulate") bit for bit."""
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _refuse)
    x = spread(int(torch.tensor(shape).prod()), 384).reshape(*shape, 384)
    w = spread(256, 384)
    g = spread(x.shape[:-1].numel(), 256).reshape(*shape, 256)
    grads = []
    for fn in ("fast", "generic"):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fn == "fast":
            with pytest.warns(UserWarning, match="emulates"):
                y = FP8LinearFunction.apply(xr, wr, FP8BlockwiseRecipe(), torch.float32, True, True)
                y.backward(g)
        else:
            y = QuantLinearFunction.apply(xr, wr, FP8BlockwiseRecipe(backend="emulate"), None, torch.float32)
            y.backward(g)
        grads.append((y.detach(), xr.grad, wr.grad))
    for name, a, b in zip(("y", "dx", "dW"), grads[0], grads[1]):
        assert_bitwise_equal(a, b, name)
    ref = _reference(x.reshape(-1, 384), w, g.reshape(-1, 256), standin=False)
    assert_bitwise_equal(grads[0][0].reshape(-1, 256), ref[0], "y against the spec's operands")


def test_fp8_linear_makes_only_the_copies_a_gradient_needs(monkeypatch):
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _cublas_like_scaled_mm)
    calls = []
    for name in ("quantize_fp8_rows_cols", "quantize_fp8_tiles", "quantize_fp8_blockwise"):
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls.append((_name, k))
            return _real(*a, **k)

        monkeypatch.setattr(ops, name, counted)
    x = spread(128, 256).requires_grad_(True)
    w = spread(128, 256)  # frozen weight: no dW, so no x^T or dy^T copies
    y = FP8LinearFunction.apply(x, w, FP8BlockwiseRecipe(), torch.float32, True, False)
    y.backward(spread(128, 128))
    assert [c[0] for c in calls] == ["quantize_fp8_blockwise", "quantize_fp8_tiles", "quantize_fp8_blockwise"]
    assert calls[1][1] == {"transpose": True}
    assert x.grad is not None and torch.isfinite(x.grad).all()
    calls.clear()
    with torch.no_grad():
        FP8LinearFunction.apply(x, w, FP8BlockwiseRecipe(), torch.float32, False, False)
    assert calls[1] == ("quantize_fp8_tiles", {"transpose": False})


def test_fp8_linear_empty_batch_gives_zeros_without_a_gemm(monkeypatch):
    """No tokens: y is empty and dW zeros, and torch._scaled_mm is never asked (a refusal there
    would switch the layout to the emulation for good)."""
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _refuse)
    x = torch.zeros(0, 256, requires_grad=True)
    w = spread(128, 256).requires_grad_(True)
    y = FP8LinearFunction.apply(x, w, FP8BlockwiseRecipe(), torch.float32, True, True)
    assert y.shape == (0, 128)
    y.backward(torch.zeros(0, 128))
    assert x.grad.shape == (0, 256) and w.grad.shape == (128, 256) and not w.grad.any()
    assert R._SCALED_MM_STATE == {}


def test_fp8_linear_fallback_ignores_an_enclosing_autocast(monkeypatch):
    """The emulated fallback keeps the recipe's GEMM dtype under torch.autocast (as the generic path
    does): the same bits with and without a bfloat16 autocast around forward and backward."""
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _refuse)
    x, w, g = spread(130, 256), spread(128, 256), spread(130, 128)
    outs = []
    for autocast in (False, True):
        monkeypatch.setattr(R, "_SCALED_MM_STATE", {})  # (each pass warns at its first refusal)
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with pytest.warns(UserWarning, match="emulates"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = FP8LinearFunction.apply(xr, wr, FP8BlockwiseRecipe(), torch.float32, True, True)
            y.backward(g)
        outs.append((y.detach(), xr.grad, wr.grad))
    for name, a, b in zip(("y", "dx", "dW"), *outs):
        assert_bitwise_equal(a, b, name)
