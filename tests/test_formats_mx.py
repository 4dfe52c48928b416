"""MX block quantization (MXFP4, MXFP6, MXFP8) against an independent numpy/ml_dtypes reference."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from _compare import assert_bitwise_equal

import moe_fp4.formats as F

ML = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn,
      "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAXV = {"e2m1": 6.0, "e2m3": 7.5, "e3m2": 28.0, "e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e2m1": 2, "e2m3": 2, "e3m2": 4, "e4m3": 8, "e5m2": 15}


def reference_mx(x: np.ndarray, fmt: str, scale_rounding: str):
    """Independent MX reference along the last axis (numpy float32 arithmetic, math.frexp, ml_dtypes casts)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    scale = np.zeros(amax.shape, dtype=np.int64)
    for idx in np.ndindex(amax.shape):
        a = float(amax[idx])
        if not math.isfinite(a):
            scale[idx] = 255
            continue
        if a == 0.0:
            continue
        if scale_rounding == "up":
            r = float(np.float32(a) / np.float32(MAXV[fmt]))  # IEEE float32 division
            m, e = math.frexp(r)  # r = m * 2^e, m in [0.5, 1)
            k = e - 1 if m == 0.5 else e  # ceil(log2 r)
        else:
            m, e = math.frexp(a)
            k = (e - 1) - EMAX[fmt]  # floor(log2 a) - emax
        scale[idx] = min(max(k + 127, 0), 254)
    nan_block = scale == 255
    factor = np.array([math.ldexp(1.0, 127 - int(s)) if s != 255 else 0.0 for s in scale.ravel()])
    with np.errstate(invalid="ignore"):  # Inf * 0 in the NaN blocks, replaced just below
        scaled = blocks.astype(np.float64) * factor.reshape(scale.shape)[..., None]
    scaled = np.where(nan_block[..., None], 0.0, scaled).astype(np.float32)  # exact: powers of two
    scaled = np.clip(scaled, -MAXV[fmt], MAXV[fmt])
    codes = scaled.astype(ML[fmt]).view(np.uint8).reshape(x.shape)
    if fmt in ("e2m1", "e2m3", "e3m2"):
        codes = codes & ((1 << (4 if fmt == "e2m1" else 6)) - 1)
    return torch.from_numpy(codes.copy()), torch.from_numpy(scale.astype(np.uint8))


def random_blocks(rows: int, cols: int) -> torch.Tensor:
    """Values whose block maxima spread over many binades, with random signs and exact zeros."""
    x = torch.randn(rows, cols) * torch.exp2(torch.randint(-40, 40, (rows, cols // 32, 1)).float()).repeat_interleave(
        32, -1).reshape(rows, cols)
    x[torch.rand(rows, cols) < 0.05] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3", "e3m2", "e4m3", "e5m2"])
@pytest.mark.parametrize("scale_rounding", ["up", "down"])
def test_quantize_mx_matches_reference(fmt, scale_rounding):
    x = random_blocks(64, 512)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 70] = -float("inf")
    codes, scales = F.quantize_mx(x, fmt, scale_rounding=scale_rounding)
    ref_codes, ref_scales = reference_mx(x.numpy(), fmt, scale_rounding)
    assert_bitwise_equal(scales, ref_scales, "scales")
    assert_bitwise_equal(codes, ref_codes, "codes")
    assert scales[0, 0] == 0 and bool((codes[0, :32] == 0).all())
    assert scales[1, 0] == 255 and scales[2, 1] == 255 and scales[3, 2] == 255
    deq = F.dequantize_mx(codes, scales, fmt)
    assert bool(torch.isnan(deq[1, :32]).all()) and bool(torch.isnan(deq[3, 64:96]).all())
    assert not bool(torch.isnan(deq[4:]).any())


def test_mxfp4_matches_reference_on_a_million_values():
    x = random_blocks(1024, 1024)
    packed, scales = F.quantize_mxfp4(x)
    ref_codes, ref_scales = reference_mx(x.numpy(), "e2m1", "up")
    assert_bitwise_equal(scales, ref_scales, "scales")
    assert_bitwise_equal(F.unpack_fp4(packed), ref_codes, "codes")
    assert packed.shape == (1024, 512) and scales.shape == (1024, 32)


def test_mxfp4_bf16_input_equals_float32_input():
    x = random_blocks(8, 256).to(torch.bfloat16)
    a = F.quantize_mxfp4(x)
    b = F.quantize_mxfp4(x.float())
    assert_bitwise_equal(a[0], b[0], "packed")
    assert_bitwise_equal(a[1], b[1], "scales")


def test_packing_puts_element_2i_in_the_low_nibble():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert_bitwise_equal(packed & 0xF, codes[:, 0::2], "low nibbles")
    assert_bitwise_equal(packed >> 4, codes[:, 1::2], "high nibbles")
    assert_bitwise_equal(F.unpack_fp4(packed), codes, "unpack")
    x = torch.tensor([[0.5, 6.0] + [0.0] * 30])  # 0.5 = code 1, 6 = code 7, scale byte 127
    p, s = F.quantize_mxfp4(x)
    assert p[0, 0].item() == 0x71 and s.item() == 127


def test_round_trip_of_representable_values_is_exact():
    codes = torch.randint(0, 16, (32, 256), dtype=torch.uint8)
    scales = torch.randint(100, 160, (32, 8), dtype=torch.uint8)
    values = F.dequantize_mxfp4(F.pack_fp4(codes), scales)
    p, s = F.quantize_mxfp4(values)
    assert_bitwise_equal(F.dequantize_mxfp4(p, s), values, "round trip values")


def test_scale_rounding_up_and_down_differ_on_crafted_blocks():
    # amax 7: "up" gives scale 2^1 (7/2 = 3.5 ties to 4), "down" gives 2^0 and 7 saturates to 6.
    x = torch.zeros(2, 32)
    x[:, 0] = 7.0
    x[:, 1] = 1.25
    pu, su = F.quantize_mxfp4(x, scale_rounding="up")
    pd, sd = F.quantize_mxfp4(x, scale_rounding="down")
    assert su[0, 0].item() == 128 and sd[0, 0].item() == 127
    du, dd = F.dequantize_mxfp4(pu, su), F.dequantize_mxfp4(pd, sd)
    assert du[0, 0].item() == 8.0 and dd[0, 0].item() == 6.0  # 3.5 rounds to 4 (tie to even), 7 saturates
    assert du[0, 1].item() == 1.0 and dd[0, 1].item() == 1.0
    # amax 6 * 2^k: both roundings agree and nothing saturates.
    y = torch.zeros(1, 32)
    y[0, 0] = 6.0
    assert F.quantize_mxfp4(y, scale_rounding="up")[1].item() == F.quantize_mxfp4(y, scale_rounding="down")[1].item()


@pytest.mark.parametrize("scale_rounding", ["up", "down"])
def test_amax_at_every_binade_boundary(scale_rounding):
    ks = torch.arange(-126, 126)
    x = torch.zeros(len(ks), 32)
    x[:, 0] = torch.tensor([math.ldexp(6.0, int(k)) for k in ks])  # exactly 6 * 2^k
    x[:, 1] = torch.tensor([math.ldexp(6.0 * (1 + 2.0**-21), int(k)) for k in ks])  # just above, other block
    x = torch.cat([x[:, :1], torch.zeros(len(ks), 31), x[:, 1:2], torch.zeros(len(ks), 31)], dim=1)
    packed, scales = F.quantize_mxfp4(x, scale_rounding=scale_rounding)
    assert scales[:, 0].tolist() == (ks + 127).tolist()
    want_above = (ks + 128) if scale_rounding == "up" else (ks + 127)
    assert scales[:, 1].tolist() == want_above.tolist()
    codes = F.unpack_fp4(packed)
    assert bool((codes[:, 0] == 7).all())  # 6 * 2^k / 2^k = 6: the largest code, exactly
    # just above 6 * 2^k: "up" moves to the next scale (3.00001 -> 3, code 5), "down" saturates to 6 (code 7)
    assert bool((codes[:, 32] == (5 if scale_rounding == "up" else 7)).all())


def test_mxfp8_columns_equal_rows_of_the_transpose():
    x = random_blocks(64, 96)
    for fmt in ("e4m3", "e5m2"):
        d_col, s_col = F.quantize_mxfp8(x, fmt=fmt, axis=0)
        d_row, s_row = F.quantize_mxfp8(x.t().contiguous(), fmt=fmt, axis=-1)
        assert s_col.shape == (2, 96)
        assert_bitwise_equal(d_col.t().contiguous(), d_row, f"{fmt} data")
        assert_bitwise_equal(s_col.t().contiguous(), s_row, f"{fmt} scales")
        back = F.dequantize_mxfp8(d_col, s_col, axis=0)
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < (0.04 if fmt == "e4m3" else 0.08)


def test_mxfp6_round_trip_error_is_small():
    x = torch.randn(16, 256)
    for fmt in ("e2m3", "e3m2"):
        codes, scales = F.quantize_mxfp6(x, fmt=fmt)
        assert int(codes.max()) < 64
        rel = ((F.dequantize_mxfp6(codes, scales, fmt=fmt) - x).norm() / x.norm()).item()
        assert 0 < rel < 0.1


def test_bad_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match=r"x: dimension 1 \(48\) must be a multiple of 32"):
        F.quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="x: expected dtype"):
        F.quantize_mxfp4(torch.randint(0, 3, (4, 32)))
    with pytest.raises(ValueError, match="scale_rounding"):
        F.quantize_mxfp4(torch.randn(4, 32), scale_rounding="nearest")
    with pytest.raises(ValueError, match="fmt"):
        F.quantize_mxfp8(torch.randn(4, 32), fmt="e3m4")
    with pytest.raises(ValueError, match="axis"):
        F.quantize_mxfp8(torch.randn(4, 32), axis=2)
    with pytest.raises(ValueError, match="scales: expected shape"):
        F.dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x: dimension 0"):
        F.quantize_mxfp8(torch.randn(20, 32), axis=0)


def test_empty_inputs_round_trip():
    for rows in (0, 1):
        x = torch.randn(rows, 64)
        p, s = F.quantize_mxfp4(x)
        assert p.shape == (rows, 32) and s.shape == (rows, 2)
        assert F.dequantize_mxfp4(p, s).shape == (rows, 64)
        d, sc = F.quantize_mxfp8(x)
        assert F.dequantize_mxfp8(d, sc).shape == (rows, 64)
