"""Element codecs and UE8M0 against ml_dtypes (an independent implementation) and crafted values."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from _compare import assert_bitwise_equal

import moe_fp4.formats as F

ML_TYPES = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}
FMTS = list(ML_TYPES)


def ml_encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(ML_TYPES[fmt]).view(np.uint8).copy())


def all_finite_values(fmt: str) -> torch.Tensor:
    table = F.decode_table(fmt)
    return table[torch.isfinite(table)]


def random_in_range(fmt: str, n: int) -> torch.Tensor:
    """Log-uniform magnitudes from far below the smallest subnormal up to the largest value, random
    signs, plus every midpoint between neighbouring values (the ties)."""
    f = F.ELEMENT_FORMATS[fmt]
    lo, hi = math.log2(f.min_subnormal) - 3, math.log2(f.max_value)
    mag = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(lo, hi)).to(torch.float32)
    mag = torch.clamp(mag, max=f.max_value)
    sign = torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    pos = torch.unique(all_finite_values(fmt).abs())
    mids = ((pos[1:].double() + pos[:-1].double()) / 2).float()
    return torch.cat([mag * sign, mids, -mids, pos, -pos])


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_matches_ml_dtypes_on_a_million_values(fmt):
    x = random_in_range(fmt, 1_000_000)
    assert_bitwise_equal(F.encode_elements(x, fmt), ml_encode(x, fmt), f"{fmt} codes")


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_matches_ml_dtypes_for_every_code(fmt):
    f = F.ELEMENT_FORMATS[fmt]
    codes = torch.arange(1 << f.bits, dtype=torch.uint8)
    ours = F.decode_elements(codes, fmt)
    theirs = torch.from_numpy(codes.numpy().view(ML_TYPES[fmt]).astype(np.float32))
    if fmt == "e5m2":  # the Inf codes: our encoder never writes them, the decoder gives what they mean
        assert torch.equal(torch.isinf(theirs), torch.isinf(ours))
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    keep = ~torch.isnan(ours)
    assert_bitwise_equal(ours[keep], theirs[keep], f"{fmt} decoded values")


@pytest.mark.parametrize("fmt", FMTS)
def test_every_finite_code_round_trips(fmt):
    f = F.ELEMENT_FORMATS[fmt]
    codes = torch.arange(1 << f.bits, dtype=torch.uint8)
    values = F.decode_elements(codes, fmt)
    finite = torch.isfinite(values)
    assert_bitwise_equal(F.encode_elements(values[finite], fmt), codes[finite], f"{fmt} round trip")


@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_nan_and_signed_zero(fmt):
    f = F.ELEMENT_FORMATS[fmt]
    mx = f.max_value
    x = torch.tensor([mx, mx * 1.01, mx * 4, 3.0e38, float("inf"), -mx * 1.5, float("-inf"), 0.0, -0.0])
    codes = F.encode_elements(x, fmt).tolist()
    assert codes[:5] == [f.max_code] * 5
    assert codes[5:7] == [f.max_code | f.sign_bit] * 2
    assert codes[7:] == [0, f.sign_bit]
    nan = F.encode_elements(torch.tensor([float("nan"), -float("nan")]), fmt).tolist()
    if f.nan_code is None:
        assert nan == [0, 0]
    else:
        assert nan == [f.nan_code, f.nan_code | f.sign_bit]
        assert torch.isnan(F.decode_elements(torch.tensor(nan, dtype=torch.uint8), fmt)).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_subnormal_edges_and_ties(fmt):
    f = F.ELEMENT_FORMATS[fmt]
    s = f.min_subnormal
    x = torch.tensor([s, s / 2, s * 0.5000001, s * 0.75, s * 1.5, s * 2.5, s / 4, 1e-45])
    # s/2 is a tie between 0 and s: even (0) wins; 1.5s ties to 2s (even), 2.5s ties to 2s.
    want = [1, 0, 1, 1, 2, 2, 0, 0]
    assert F.encode_elements(x, fmt).tolist() == want


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fmt"):
        F.encode_elements(torch.zeros(2), "e3m4")
    with pytest.raises(ValueError, match="x: expected dtype torch.float32"):
        F.encode_elements(torch.zeros(2, dtype=torch.float64), "e2m1")
    with pytest.raises(ValueError, match="rounding"):
        F.encode_elements(torch.zeros(2), "e2m1", rounding="up")
    with pytest.raises(ValueError, match="codes"):
        F.decode_elements(torch.tensor([16], dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="codes: expected dtype"):
        F.decode_elements(torch.tensor([1]), "e2m1")


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_stochastic_rounding_is_unbiased(fmt):
    f = F.ELEMENT_FORMATS[fmt]
    pos = torch.unique(all_finite_values(fmt).abs())
    lo, hi = pos[:-1], pos[1:]
    frac = torch.rand(lo.shape)
    x = (lo.double() + frac.double() * (hi - lo).double()).float()
    x = torch.cat([x, -x])
    n = 4000
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    samples = F.encode_elements(x.repeat(n, 1), fmt, rounding="stochastic", generator=gen)
    vals = F.decode_elements(samples, fmt).double()
    mean = vals.mean(0)
    gap = torch.cat([hi - lo, hi - lo]).double()
    # Each sample is one of the two neighbours: the std of the mean is at most gap / (2 sqrt(n)).
    assert bool(((mean - x.double()).abs() <= 5 * gap / (2 * math.sqrt(n)) + 1e-12).all())
    # Only the two neighbours ever appear.
    assert bool(((vals - x.double()).abs() <= gap + 1e-12).all())
    # Representable values are kept exactly.
    exact = F.encode_elements(pos.repeat(50, 1), fmt, rounding="stochastic", generator=gen)
    assert_bitwise_equal(exact, F.encode_elements(pos, fmt).repeat(50, 1), "stochastic on representable values")
    del f


def test_ue8m0_round_trip_and_rounding():
    e = torch.arange(255, dtype=torch.uint8)
    v = F.decode_ue8m0(e)
    assert v[0].item() == 2.0**-127 and v[127].item() == 1.0 and v[254].item() == 2.0**127
    assert_bitwise_equal(F.encode_ue8m0(v, rounding="up"), e, "ue8m0 up on powers of two")
    assert_bitwise_equal(F.encode_ue8m0(v, rounding="down"), e, "ue8m0 down on powers of two")
    assert math.isnan(F.decode_ue8m0(torch.tensor([255], dtype=torch.uint8)).item())
    x = torch.tensor([3.0, 1.0000001, 0.75, 0.0, float("inf"), float("nan"), 1e-45])
    assert F.encode_ue8m0(x, rounding="up").tolist() == [129, 128, 127, 0, 255, 255, 0]
    assert F.encode_ue8m0(x, rounding="down").tolist() == [128, 127, 126, 0, 255, 255, 0]
    sub = torch.tensor([2.0**-127, 2.0**-127 * 1.5, 2.0**-128])
    assert F.encode_ue8m0(sub, rounding="up").tolist() == [0, 1, 0]
    assert F.encode_ue8m0(sub, rounding="down").tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="non-negative"):
        F.encode_ue8m0(torch.tensor([-1.0]))


def test_pow2_float32_is_exact_everywhere():
    e = torch.arange(-152, 130)
    got = F.pow2_float32(e).double()
    want = torch.tensor([math.ldexp(1.0, int(k)) if -149 <= k <= 127 else (0.0 if k < -149 else math.inf)
                         for k in e], dtype=torch.float64)
    assert torch.equal(got, want)
