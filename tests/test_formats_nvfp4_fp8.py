"""NVFP4 two-level scales, FP8 blockwise, and the direct MXFP4 -> FP8 conversions."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from _compare import assert_bitwise_equal

import moe_fp4.formats as F


def ml_cast(x: np.ndarray, t) -> np.ndarray:
    return x.astype(t).view(np.uint8)


# ---------------------------------------------------------------------------------------------- NVFP4


def reference_nvfp4_1x16(x: np.ndarray):
    """Independent NVFP4 1x16 reference in numpy float64 with ml_dtypes casts."""
    amax = float(np.abs(x[np.isfinite(x)]).max())
    gs = np.float32(amax / 2688.0)
    blocks = x.reshape(*x.shape[:-1], -1, 16).astype(np.float64)
    bamax = np.abs(blocks).max(-1)
    bscale = (bamax / (6.0 * float(gs))).astype(np.float32)
    scode = ml_cast(np.minimum(bscale, 448.0), ml_dtypes.float8_e4m3fn)
    d = (scode.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(gs)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d[..., None] > 0, blocks / d[..., None].astype(np.float64), 0.0).astype(np.float32)
    codes = ml_cast(np.clip(scaled, -6, 6), ml_dtypes.float4_e2m1fn) & 0xF
    return codes.reshape(x.shape), scode, gs


def test_nvfp4_matches_reference():
    block_scale = torch.exp2(torch.randint(-6, 6, (256, 64, 1)).float())
    x = torch.randn(256, 1024) * block_scale.repeat_interleave(16, -1).reshape(256, 1024)
    packed, scales, gs = F.quantize_nvfp4(x)
    ref_codes, ref_scodes, ref_gs = reference_nvfp4_1x16(x.numpy())
    assert gs.dtype == torch.float32 and gs.dim() == 0 and gs.item() == float(ref_gs)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (256, 64)
    assert_bitwise_equal(scales.view(torch.uint8), torch.from_numpy(ref_scodes.copy()), "block scales")
    assert_bitwise_equal(F.unpack_fp4(packed), torch.from_numpy(ref_codes.copy()), "codes")
    # the tensor's largest value lands on 6 * 448 * global_scale (no saturation at the top)
    deq = F.dequantize_nvfp4(packed, scales, gs)
    i = int(x.abs().argmax())
    assert abs(deq.flatten()[i].item() - x.flatten()[i].item()) <= 0.02 * abs(x.flatten()[i].item())
    assert ((deq - x).norm() / x.norm()).item() < 0.12


def test_nvfp4_two_level_scales_and_given_global_amax():
    x = torch.randn(32, 64)
    _, s1, g1 = F.quantize_nvfp4(x)
    _, s2, g2 = F.quantize_nvfp4(x, global_amax=x.abs().max() * 4)
    assert g2.item() == pytest.approx(g1.item() * 4, rel=1e-6)
    # a 4x larger tensor scale leaves block scales about 4x smaller
    r = s1.float()[s1.float() > 0.5] / s2.float()[s1.float() > 0.5]
    assert bool(((r > 3) & (r < 5.5)).all())
    with pytest.raises(ValueError, match="global_amax"):
        F.quantize_nvfp4(x, global_amax=float("nan"))


def test_nvfp4_2d_blocks_share_one_scale_per_16x16_tile():
    x = torch.randn(64, 96)
    packed, scales, gs = F.quantize_nvfp4(x, block_2d=True)
    assert scales.shape == (4, 6)
    deq = F.dequantize_nvfp4(packed, scales, gs)
    # each tile's scale is set by that tile's amax: quantizing the tile alone with the same tensor amax agrees
    tile = x[16:32, 32:48].contiguous()
    p2, s2, _ = F.quantize_nvfp4(tile, block_2d=True, global_amax=x.abs().max())
    assert s2.view(torch.uint8).item() == scales[1, 2].view(torch.uint8).item()
    assert_bitwise_equal(F.dequantize_nvfp4(p2, s2, gs), deq[16:32, 32:48].contiguous(), "tile")
    assert ((deq - x).norm() / x.norm()).item() < 0.15


def test_nvfp4_nan_zero_and_inf_blocks():
    x = torch.randn(4, 64)
    x[0, :16] = 0.0
    x[1, 3] = float("nan")
    x[2, 20] = float("inf")
    packed, scales, gs = F.quantize_nvfp4(x)
    su = scales.view(torch.uint8)
    assert su[0, 0].item() == 0 and su[1, 0].item() == 0x7F and su[2, 1].item() == 0x7F
    deq = F.dequantize_nvfp4(packed, scales, gs)
    assert bool((deq[0, :16] == 0).all())
    assert bool(torch.isnan(deq[1, :16]).all()) and bool(torch.isnan(deq[2, 16:32]).all())
    assert gs.item() == np.float32(x[torch.isfinite(x)].abs().max().item() / 2688.0)
    zero = F.quantize_nvfp4(torch.zeros(2, 32))
    assert zero[2].item() == 0.0 and bool((F.dequantize_nvfp4(*zero) == 0).all())


def test_nvfp4_stochastic_rounding_is_unbiased():
    x = torch.rand(1, 64) * 5 + 0.5
    x[0, ::16] = 6.0  # pins every block scale to 448 (d = 1): no element saturates
    n = 3000
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    xs = x.repeat(n, 1)
    packed, scales, gs = F.quantize_nvfp4(xs, global_amax=6.0, rounding="stochastic", generator=gen)
    mean = F.dequantize_nvfp4(packed, scales, gs).double().mean(0)
    # neighbouring E2M1 values differ by at most 2 * d, d = the block's decode scale
    d = F.dequantize_nvfp4(*F.quantize_nvfp4(torch.tensor([[1.0] + [0.0] * 15]), global_amax=6.0)).max().item()
    assert bool(((mean - x[0].double()).abs() < 5 * 2.0 * max(d, 1.0) / (2 * math.sqrt(n))).all())


def test_nvfp4_bad_shapes():
    with pytest.raises(ValueError, match="x: last dimension"):
        F.quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="second-to-last"):
        F.quantize_nvfp4(torch.randn(24, 32), block_2d=True)


# ------------------------------------------------------------------------------------------ FP8 blockwise


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_fp8_blockwise_matches_a_torch_float8_cast(block):
    x = torch.randn(256, 512) * torch.exp2(torch.randint(-20, 20, (256, 1)).float())
    x[5, :128] = 0.0
    data, scales = F.quantize_fp8_blockwise(x, block=block)
    bm, bn = block
    assert scales.shape == (256 // bm, 512 // bn)
    # scales are powers of two (mantissa bits zero) and no element saturates
    assert bool((torch.frexp(scales).mantissa == 0.5).all())
    full = scales.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    assert bool(((x / full).abs() <= 448).all())
    ref = (x / full).to(torch.float8_e4m3fn)  # exact division by a power of two, then torch's RNE cast
    assert_bitwise_equal(data, ref, "e4m3 data")
    back = F.dequantize_fp8_blockwise(data, scales, block=block)
    assert ((back - x).norm() / x.norm()).item() < 0.04


def test_fp8_blockwise_nan_block_and_1d_input():
    x = torch.randn(2, 256)
    x[1, 130] = float("nan")
    data, scales = F.quantize_fp8_blockwise(x)
    assert math.isnan(scales[1, 1].item()) and bool((data[1, 128:].view(torch.uint8) == 0).all())
    d1, s1 = F.quantize_fp8_blockwise(x[0])
    assert s1.shape == (2,) and torch.equal(d1.view(torch.uint8), data[0].view(torch.uint8))
    with pytest.raises(ValueError, match="block"):
        F.quantize_fp8_blockwise(x, block=(1, 0))
    with pytest.raises(ValueError, match="x: last dimension"):
        F.quantize_fp8_blockwise(torch.randn(2, 96))


# ------------------------------------------------------------------------------- MXFP4 -> FP8 conversion


def random_mxfp4(rows: int, hidden: int, spread: int = 8):
    codes = torch.randint(0, 16, (rows, hidden), dtype=torch.uint8)
    scales = torch.randint(127 - spread, 127 + spread + 1, (rows, hidden // 32), dtype=torch.uint8)
    return F.pack_fp4(codes), scales


def test_conversion_is_exact_where_nothing_underflows():
    packed, scales = random_mxfp4(512, 1024, spread=7)  # spreads up to 14 binades: exact
    data, s, underflow = F.mxfp4_to_fp8_blockwise(packed, scales)
    assert data.shape == (512, 1024) and s.shape == (512, 8) and underflow.item() == 0
    assert_bitwise_equal(F.dequantize_fp8_blockwise(data, s), F.dequantize_mxfp4(packed, scales), "values")
    # the FP8 scale is the largest block scale lowered by 2^6
    emax = scales.view(512, 8, 4).amax(-1).to(torch.int64)
    assert_bitwise_equal(s, F.pow2_float32(emax - 127 - F.FP8_HEADROOM_EXP), "scales")


def test_conversion_counts_underflow_and_rounds_to_nearest_even():
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 0] = 7  # 6.0 in block 0
    codes[0, 32] = 1  # 0.5 in block 1
    codes[0, 33] = 3  # 1.5 in block 1
    codes[0, 64] = 1  # 0.5 in block 2
    scales = torch.tensor([[127 + 20, 127 + 20 - 15, 127 + 20 - 16, 0]], dtype=torch.uint8)
    data, s, underflow = F.mxfp4_to_fp8_blockwise(F.pack_fp4(codes), scales)
    vals = data.float() * s.repeat_interleave(128, -1)
    # block 1 is 15 binades down: 0.5 -> half the smallest subnormal, ties to 0; 1.5 -> 1.5 ulps -> 2 ulps
    assert vals[0, 0].item() == 6.0 * 2.0**20
    # (the MXFP4 value of 1.5 there is 1.5 * 2^5 = 48; the FP8 scale is 2^(147 - 133) = 2^14, the element
    # 1.5 * 2^-9 rounds to 2 * 2^-9, so the converted value is 2^-8 * 2^14 = 64)
    assert vals[0, 32].item() == 0.0 and vals[0, 33].item() == 64.0
    assert vals[0, 64].item() == 0.0
    assert underflow.item() == 2
    # a NaN block makes the whole group NaN
    scales[0, 3] = 255
    _, s2, _ = F.mxfp4_to_fp8_blockwise(F.pack_fp4(codes), scales)
    assert math.isnan(s2.item())


def test_conversion_rejects_bad_shapes():
    packed, scales = random_mxfp4(4, 96)
    with pytest.raises(ValueError, match="packed: last dimension times 2"):
        F.mxfp4_to_fp8_blockwise(packed, scales)
    packed, scales = random_mxfp4(4, 128)
    with pytest.raises(ValueError, match="scales: expected shape"):
        F.mxfp4_to_fp8_blockwise(packed, scales[:, :2])


def test_rows_to_fp8_cols_per_expert():
    hidden = 256
    lens = torch.tensor([0, 1, 130, 0, 7, 256])
    n = int(lens.sum())
    packed, scales = random_mxfp4(n, hidden)
    data, s, goff = F.mxfp4_rows_to_fp8_cols(packed, scales, lens)
    assert n % 32 != 0 and data.shape == (hidden, n)
    assert data.stride() == (F.fp8_cols_row_stride(n), 1) == (-(-n // 32) * 32, 1)  # rows on 32-byte sectors
    assert goff.tolist() == [0, 0, 1, 3, 3, 4, 6] and s.shape == (hidden, 6) and s.stride() == (1, hidden)
    values = F.dequantize_mxfp4(packed, scales)
    offs = F.split_offsets(lens).tolist()
    for e in range(len(lens)):
        ln = int(lens[e])
        for g in range(goff[e].item(), goff[e + 1].item()):
            first = offs[e] + (g - goff[e].item()) * 128
            last = min(first + 128, offs[e] + ln)
            cols = values[first:last].t()
            d, sc = F.quantize_fp8_blockwise(torch.nn.functional.pad(cols, (0, 128 - (last - first))))
            assert_bitwise_equal(s[:, g:g + 1], sc, f"expert {e} group {g} scales")
            assert_bitwise_equal(data[:, first:last].contiguous(), d[:, : last - first].contiguous(),
                                 f"expert {e} group {g} data")
    with pytest.raises(ValueError, match="split_lens"):
        F.mxfp4_rows_to_fp8_cols(packed, scales, torch.tensor([n + 1]))


def test_fp8_column_scale_depends_on_the_binade_only():
    """The column kernels' byte keys: a column whose largest element is E2M1 code c in a row of scale
    byte S gets the FP8 scale byte max(S + b(c) - 10, 0), b(c) = floor(log2 |E2M1(c)|) + 2, for every
    finite S and nonzero code (both mantissas of a binade alike), and 0xFF once S + b(c) reaches 257.
    One expert per row, so each row's column 0 is a group's largest element."""
    binade = [None, 1, 2, 2, 3, 3, 4, 4]
    pairs = [(s, c) for s in range(255) for c in range(1, 8)]
    n = len(pairs)
    packed = torch.zeros(n, 16, dtype=torch.uint8)
    scales = torch.zeros(n, 1, dtype=torch.uint8)
    for r, (s, c) in enumerate(pairs):  # column 0: code c with a random sign; the others: codes up to c
        codes = torch.randint(0, c + 1, (32,), dtype=torch.uint8)
        codes[0] = c | (int(torch.randint(0, 2, ())) << 3)
        packed[r] = codes[0::2] | (codes[1::2] << 4)
        scales[r, 0] = s
    _, col_scales, _ = F.mxfp4_rows_to_fp8_cols(packed, scales, torch.ones(n, dtype=torch.int64))
    got = torch.tensor([255 if math.isnan(v) else 127 + round(math.log2(v)) for v in col_scales[0].tolist()])
    want = torch.tensor([255 if s + binade[c] >= 257 else max(s + binade[c] - 10, 0) for s, c in pairs])
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------ ragged and swizzle


def test_ragged_helpers():
    ids = torch.randint(0, 5, (100,))
    order, lens, offs = F.group_by_expert(ids, 8)
    assert lens.tolist() == torch.bincount(ids, minlength=8).tolist()
    assert bool((ids[order][1:] >= ids[order][:-1]).all())
    assert offs.tolist() == (torch.cumsum(lens, 0) - lens).tolist()
    assert F.split_offsets(torch.tensor([3, 0, 2])).tolist() == [0, 3, 3]
    assert F.check_splits(torch.tensor([2, 2]), torch.tensor([4, 0]), 6).tolist() == [4, 0]
    with pytest.raises(ValueError, match="overlap"):
        F.check_splits(torch.tensor([3, 2]), torch.tensor([0, 2]), 6)
    # empty segments never overlap, even at another segment's first row or at the end
    assert F.check_splits(torch.tensor([0, 3, 0, 0]), torch.tensor([0, 0, 3, 6]), 6).tolist() == [0, 0, 3, 6]
    with pytest.raises(ValueError, match="split_lens: expected non-negative"):
        F.check_splits(torch.tensor([3, -1]), None, 6)
    with pytest.raises(ValueError, match="expert_ids"):
        F.group_by_expert(torch.tensor([0, 9]), 8)


def test_blackwell_swizzle_round_trip_and_positions():
    for rows, cols in [(128, 4), (300, 7), (1, 1), (256, 224)]:
        s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
        sw = F.to_blackwell_scale_layout(s)
        assert sw.numel() == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
        assert_bitwise_equal(F.from_blackwell_scale_layout(sw, rows, cols), s, "round trip")
    s = torch.arange(512, dtype=torch.int32).reshape(128, 4).to(torch.uint8)
    sw = F.to_blackwell_scale_layout(s)
    # rows interleave 0, 32, 64, 96, 1, 33, ...; each row's 4 scales adjacent
    assert sw[:8].tolist() == s[0].tolist() + s[32].tolist()
    assert sw[16:20].tolist() == s[1].tolist()
    e4 = torch.randn(128, 8).to(torch.float8_e4m3fn)
    assert F.to_blackwell_scale_layout(e4).dtype == torch.float8_e4m3fn


def test_nvfp4_block_divisor_is_the_float32_rounded_product():
    # d = float32(e4m3 * global_scale), rounded once: the float32 product equals the exact product
    # (formed in float64, where it is exact) rounded to float32, for every E4M3 code and fresh scales.
    from moe_fp4.formats.nvfp4 import block_divisor

    codes = torch.arange(256, dtype=torch.uint8)
    for gs in torch.rand(8, dtype=torch.float64).mul(1e-2).to(torch.float32):
        got = block_divisor(codes, gs)
        exact = F.decode_elements(codes, F.E4M3).to(torch.float64) * gs.to(torch.float64)
        want = exact.to(torch.float32)
        finite = torch.isfinite(want)
        assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
        assert torch.isnan(got[~finite]).all()
