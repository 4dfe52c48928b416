"""The spec's MX quantizers against an independent implementation: torchao's ``to_mx``.

torchao's scale modes map onto ours: FLOOR (the OCP rule, floor(log2 amax) - emax) is our
``scale_rounding="down"``, RCEIL (ceil(log2(amax / max_elem))) is our ``"up"``. With those pairs the
scale bytes and the element codes must agree bit for bit for MXFP4 (packed, low nibble first), MXFP8
(E4M3, E5M2) and MXFP6 (E2M3, E3M2), on wide-range random data and on every binade boundary.

Two places where the implementations decide differently, kept out of the bitwise comparison and
checked to be the only differences:
  * blocks whose scale is 2^-127 (scale byte 0, amax below about 2^-125): the spec divides by the
    exact 2^-127; torchao's elements there differ (it does not divide by the float32 subnormal
    2^-127 exactly), while the scale byte agrees;
  * blocks holding an Inf: the spec writes the NaN scale 0xFF (the block is lost either way);
    torchao writes a finite scale. Not compared here;
  * "up" (RCEIL) when float32(amax / max_elem) lies a few ulps above a power of two 2^e (float32
    inputs only: amax must carry mantissa bits below bfloat16's): the spec rounds up to 2^(e+1), as its
    rule says; torchao's ceil(log2(.)) loses the tiny excess and gives 2^e, one byte lower (seen for
    1 to 17 ulps with torch 2.13's CPU log2). Those blocks may differ by exactly that byte and their
    elements accordingly; every other block must agree.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _compare import assert_bitwise_equal

from moe_fp4.formats import E2M1, E2M3, E3M2, E4M3, E5M2, quantize_mxfp4, quantize_mxfp6, quantize_mxfp8
from moe_fp4.formats.elements import divide_to_float32

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2

MODES = {"down": mx_tensor.ScaleCalculationMode.FLOOR, "up": mx_tensor.ScaleCalculationMode.RCEIL}


def ours(x: torch.Tensor, fmt: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "fp4":
        return quantize_mxfp4(x, scale_rounding=rounding)
    if fmt in ("e4m3", "e5m2"):
        data, scales = quantize_mxfp8(x, fmt=fmt, scale_rounding=rounding)
        return data.view(torch.uint8), scales
    return quantize_mxfp6(x, fmt=fmt, scale_rounding=rounding)


def theirs(x: torch.Tensor, fmt: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    elem = {"fp4": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
            "e2m3": DTYPE_FP6_E2M3, "e3m2": DTYPE_FP6_E3M2}[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales, data = mx_tensor.to_mx(x.contiguous(), elem, 32, MODES[rounding])
    return data.view(torch.uint8), scales.view(torch.uint8)


FORMATS = ["fp4", "e4m3", "e5m2", "e2m3", "e3m2"]
ELEMENTS = {"fp4": E2M1, "e4m3": E4M3, "e5m2": E5M2, "e2m3": E2M3, "e3m2": E3M2}
RCEIL_ULPS = 32  # how far above a power of two torchao's RCEIL may still round down (17 seen)


def rceil_edge_blocks(x: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """bool [rows, blocks]: the blocks where torchao's RCEIL may give one byte less than the spec:
    float32(amax / max_elem) is 1 to RCEIL_ULPS ulps above a power of two (none for "down")."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    if rounding != "up":
        return torch.zeros(blocks.shape[:2], dtype=torch.bool)
    ratio = divide_to_float32(blocks.abs().amax(-1), ELEMENTS[fmt].max_value)
    mant = ratio.view(torch.int32) & 0x7FFFFF
    return (mant >= 1) & (mant <= RCEIL_ULPS) & ((ratio.view(torch.int32) >> 23) & 0xFF > 0)


def assert_equal_but_rceil_edges(x, fmt, rounding, data, scales, ref_data, ref_scales, what):
    """Scales and elements equal bit for bit outside the RCEIL edge blocks; inside them the spec's
    scale byte is torchao's or one above it (the spec rounds up)."""
    edge = rceil_edge_blocks(x, fmt, rounding)
    diff = scales.to(torch.int16) - ref_scales.to(torch.int16)
    assert bool(((diff == 0) | (edge & (diff == 1))).all()), f"{what}: scale bytes differ outside the RCEIL edges"
    keep = (~edge).repeat_interleave(32, dim=1)
    if fmt == "fp4":  # two codes per byte: a packed byte belongs to one block
        keep = keep[:, ::2]
    assert_bitwise_equal(data[keep], ref_data[keep], f"{what} data")


@pytest.mark.parametrize("rounding", ["down", "up"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_wide_range_matches_torchao(fmt, rounding, dtype):
    rows, k = 1024, 256
    # every row its own magnitude, 2^-100 .. 2^100, so the scales cover most of UE8M0's range
    exps = torch.randint(-100, 101, (rows, 1)).float()
    x = (torch.randn(rows, k) * torch.exp2(exps)).to(dtype)
    x[torch.rand(rows, k) < 0.01] = 0.0
    data, scales = ours(x, fmt, rounding)
    ref_data, ref_scales = theirs(x, fmt, rounding)
    assert_equal_but_rceil_edges(x, fmt, rounding, data, scales, ref_data, ref_scales, f"{fmt} {rounding}")
    assert scales.unique().numel() > 100  # the draw really spans many scales


@pytest.mark.parametrize("fmt", FORMATS)
def test_rceil_just_above_a_power_of_two(fmt):
    # float32 amax whose ratio to max_elem is 1 to 40 ulps above 2^e: the spec's "up" gives byte
    # e + 128 (2^(e+1)), by its rule; torchao gives that or one byte less, and only inside the edge.
    max_value = ELEMENTS[fmt].max_value
    e = int(torch.randint(-60, 60, ()))
    ulps = torch.arange(1, 41, dtype=torch.int32)
    ratio = (torch.tensor(2.0 ** e, dtype=torch.float32).view(torch.int32) + ulps).view(torch.float32)
    amax = (ratio.double() * max_value).float()  # exact product when max_value has few bits
    x = torch.rand(len(ulps), 32) * amax[:, None]
    x[:, 3] = amax
    data, scales = ours(x, fmt, "up")
    ref_data, ref_scales = theirs(x, fmt, "up")
    got_ratio = divide_to_float32(amax, max_value)
    assert torch.equal(got_ratio, ratio)
    assert bool((scales[:, 0] == e + 128).all())
    assert_equal_but_rceil_edges(x, fmt, "up", data, scales, ref_data, ref_scales, f"{fmt} edge")


@pytest.mark.parametrize("rounding", ["down", "up"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_binade_boundaries_match_torchao(fmt, rounding):
    """amax exactly at, just under and just over 2^k and max_elem * 2^k for every k: the scale rule's
    edges. Rows whose scale is 2^-127 (byte 0) are the only ones allowed to differ, and only in
    their elements."""
    ks = torch.arange(-126, 127).float()
    blocks = []
    for mult in (1.0, 1.0 - 2**-24, 1.0 + 2**-23, 1.5, 3.0, 6.0, 6.0 * (1 + 2**-7), 7.5, 57344.0, 448.0, 449.0):
        amax = torch.exp2(ks) * mult
        blk = (torch.rand(ks.numel(), 32) * 2 - 1) * amax[:, None]
        blk[:, torch.randint(0, 32, ())] = amax * (1 if torch.rand(()) < 0.5 else -1)
        blocks.append(blk)
    x = torch.cat(blocks)
    x = x[torch.isfinite(x).all(1)]
    data, scales = ours(x, fmt, rounding)
    ref_data, ref_scales = theirs(x, fmt, rounding)
    assert_bitwise_equal(scales, ref_scales, f"{fmt} {rounding} scales")
    tiny = scales[:, 0] == 0
    assert tiny.any() and (~tiny).sum() > 2000
    assert_bitwise_equal(data[~tiny], ref_data[~tiny], f"{fmt} {rounding} data")


@pytest.mark.parametrize("rounding", ["down", "up"])
def test_zero_and_nan_blocks_match_torchao(rounding):
    x = torch.randn(8, 64)
    x[1] = 0.0
    x[2, 7] = float("nan")
    x[3, :32] = 0.0
    data, scales = ours(x, "fp4", rounding)
    ref_data, ref_scales = theirs(x, "fp4", rounding)
    assert scales[2, 0] == 0xFF and scales[1, 0] == 0 and scales[1, 1] == 0
    assert_bitwise_equal(scales, ref_scales, "scales")
    finite = torch.ones(8, dtype=torch.bool)
    finite[2] = False  # a NaN block's elements are don't-care (its scale already says NaN)
    assert_bitwise_equal(data[finite], ref_data[finite], "data")
