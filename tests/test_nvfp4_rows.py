"""NVFP4 byte rows (the nvfp4 dispatch payload): the spec's row layout and per-row decode on CPU, and
the native quantizer (ops.quantize_nvfp4_rows) bit for bit against the spec on GPU."""

import pytest
import torch

from moe_fp4 import formats, ops
from tests._compare import assert_bitwise_equal

FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def _spec_rows(x: torch.Tensor) -> torch.Tensor:
    return formats.pack_nvfp4_rows(*formats.quantize_nvfp4(x))


def _special_tokens(t: int, h: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Random tokens over a wide range with NaN, +-Inf, zero, negative-zero, tiny and huge blocks."""
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-12, 12, (t, h // 16, 1), generator=g).float()
                                                   ).repeat_interleave(16, dim=1).reshape(t, h)
    blocks = x.view(t, h // 16, 16)
    pick = torch.randint(0, 10, (t, h // 16), generator=g)
    blocks[pick == 0] = 0.0
    blocks[pick == 1] = -0.0
    blocks[..., 3][pick == 2] = float("nan")
    blocks[..., 5][pick == 3] = float("inf")
    blocks[..., 7][pick == 4] = -float("inf")
    blocks[pick == 5] *= 2.0**-20  # far below the tensor's largest block: tiny or zero E4M3 scales
    finfo = torch.finfo(dtype)
    x = x.clamp(-finfo.max / 4, finfo.max / 4).where(x.isfinite(), x)
    return x.to(dtype).to(device)


# ---- CPU: the spec's layout and decode ----


def test_row_layout_round_trip():
    t, h = 5, 96
    x = torch.randn(t, h)
    packed, scales, gs = formats.quantize_nvfp4(x)
    rows = formats.pack_nvfp4_rows(packed, scales, gs)
    assert rows.shape == (t, formats.nvfp4_row_bytes(h)) == (t, h // 2 + h // 16 + 4)
    p2, s2, g2 = formats.unpack_nvfp4_rows(rows, h)
    assert_bitwise_equal(p2, packed, "packed")
    assert_bitwise_equal(s2, scales, "scales")
    assert_bitwise_equal(g2, gs.expand(t).contiguous(), "global scale")
    # the last four bytes of a row are the FP32 tensor scale, little endian
    assert int.from_bytes(bytes(rows[0, -4:].tolist()), "little") == int(gs.view(torch.int32))


def test_per_row_decode_equals_per_sender_dequantize():
    h = 64
    a, b = torch.randn(3, h) * 100, torch.randn(4, h) / 100  # two senders, two tensor scales
    rows = torch.cat((_spec_rows(a), _spec_rows(b)))[torch.tensor([4, 0, 5, 1, 6, 2, 3])]
    got = formats.dequantize_nvfp4_rows(*formats.unpack_nvfp4_rows(rows, h))
    ref = torch.cat((formats.dequantize_nvfp4(*formats.quantize_nvfp4(a)),
                     formats.dequantize_nvfp4(*formats.quantize_nvfp4(b))))[torch.tensor([4, 0, 5, 1, 6, 2, 3])]
    assert_bitwise_equal(got, ref, "per-row decode")


def test_per_row_decode_of_special_blocks():
    x = _special_tokens(6, 128, torch.float32, "cpu")
    packed, scales, gs = formats.quantize_nvfp4(x)
    got = formats.dequantize_nvfp4_rows(packed, scales, gs.expand(6).contiguous())
    assert_bitwise_equal(got, formats.dequantize_nvfp4(packed, scales, gs), "special blocks")
    assert bool(got.isnan().any())  # NaN/Inf blocks decode to NaN


def test_layout_errors_name_the_argument():
    packed, scales, gs = formats.quantize_nvfp4(torch.randn(3, 32))
    with pytest.raises(ValueError, match="hidden"):
        formats.nvfp4_row_bytes(40)
    with pytest.raises(ValueError, match="scales"):
        formats.pack_nvfp4_rows(packed, scales[:, :1], gs)
    with pytest.raises(ValueError, match="global_scale"):
        formats.pack_nvfp4_rows(packed, scales, gs.expand(2).contiguous())
    with pytest.raises(ValueError, match="rows"):
        formats.unpack_nvfp4_rows(torch.zeros(3, 10, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="global_scale"):
        formats.dequantize_nvfp4_rows(packed, scales, gs)  # 0-dim: one per row expected


def test_op_on_cpu_is_the_spec_and_checks_arguments():
    x = _special_tokens(7, 96, torch.bfloat16, "cpu")
    assert_bitwise_equal(ops.quantize_nvfp4_rows(x), _spec_rows(x), "cpu op")
    with pytest.raises(ValueError, match="x"):
        ops.quantize_nvfp4_rows(torch.randn(2, 24))
    with pytest.raises(ValueError, match="x"):
        ops.quantize_nvfp4_rows(torch.randn(2, 32, dtype=torch.float64))
    torch.library.opcheck(torch.ops.moe_fp4.quantize_nvfp4_rows.default, (torch.randn(3, 32),))


# ---- GPU: the native kernels against the spec ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("t,h", [(1, 16), (7, 96), (33, 2048), (4096, 7168), (5, 4096)])
def test_native_equals_spec_random(dtype, t, h):
    x = (torch.randn(t, h, device="cuda") * 3).to(dtype)
    assert_bitwise_equal(ops.quantize_nvfp4_rows(x), _spec_rows(x), f"{dtype} {t}x{h}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("t,h", [(9, 112), (64, 7168)])
def test_native_equals_spec_special_values(dtype, t, h):
    x = _special_tokens(t, h, dtype, "cuda")
    got = ops.quantize_nvfp4_rows(x)
    assert_bitwise_equal(got, _spec_rows(x), f"{dtype} special")
    scales = formats.unpack_nvfp4_rows(got, h)[1].view(torch.uint8)
    assert bool((scales == 0x7F).any()) and bool((scales == 0).any())  # NaN and zero blocks were drawn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_native_edge_tensors(dtype):
    h = 64
    cases = {
        "zeros": torch.zeros(3, h),
        "negative zeros": -torch.zeros(3, h),
        "only non-finite": torch.full((2, h), float("nan")),
        "inf and finite": torch.cat((torch.full((1, h), float("inf")), torch.randn(1, h))),
        "one nonzero": torch.zeros(4, h).index_put_((torch.tensor([2]), torch.tensor([17])), torch.tensor(-5.0)),
        "ties": torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (h // 8)).repeat(2, 1) * 448 / 6,
    }
    if dtype == torch.float32:
        cases["subnormal"] = torch.randn(3, h) * 2.0**-140
        cases["huge"] = torch.randn(3, h) * 2.0**120
    for name, x in cases.items():
        xd = x.to(dtype).cuda()
        assert_bitwise_equal(ops.quantize_nvfp4_rows(xd), _spec_rows(xd), f"{dtype} {name}")


@pytest.mark.gpu
def test_native_strided_rows_and_opcheck():
    base = torch.randn(6, 160, device="cuda", dtype=torch.bfloat16)
    x = base[:, :128]  # row stride 160 elements (320 bytes: 16-byte aligned)
    assert_bitwise_equal(ops.quantize_nvfp4_rows(x), _spec_rows(x), "strided rows")
    assert ops.quantize_nvfp4_rows(x[:0]).shape == (0, formats.nvfp4_row_bytes(128))
    torch.library.opcheck(torch.ops.moe_fp4.quantize_nvfp4_rows.default, (x.contiguous(),))


@pytest.mark.gpu
def test_native_on_and_beside_e2m1_rounding_boundaries():
    # A tensor amax of 2688 * 2^k makes the tensor scale exactly 2^k; a block whose amax is 6 c 2^k,
    # c an E4M3 value, then gets the divisor d = c 2^k exactly, so x = m d and its float32 neighbours sit
    # on and beside each E2M1 rounding boundary m (ties to even, and the quotient's own rounding).
    k = -3
    boundaries = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    cs = [1.0, 1.125, 1.75, 3.25, 2.0**-6, 13.0, 224.0, 0.001953125]  # E4M3 values, the last subnormal
    blocks = [[2688.0 * 2.0**k] + [0.0] * 15]
    for c in cs:
        d = c * 2.0**k
        vals = []
        for m in boundaries:
            base = torch.tensor(m * d, dtype=torch.float32)
            down, up = torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(1e30))
            vals += [float(base), float(down), float(up)]
        vals = vals[:21]
        for start in range(0, len(vals), 15):
            chunk = vals[start:start + 15]
            blocks.append([6.0 * d] + [v * s for v, s in zip(chunk, [1, -1] * 8)] + [0.0] * (15 - len(chunk)))
    x = torch.tensor(blocks, dtype=torch.float32).reshape(1, -1)
    x = torch.cat((x, x.flip(1)), dim=0).cuda()
    got, ref = ops.quantize_nvfp4_rows(x), _spec_rows(x)
    assert_bitwise_equal(got, ref, "boundaries")
    codes = formats.unpack_fp4(formats.unpack_nvfp4_rows(ref, x.shape[1])[0]) & 7
    assert len(set(codes.reshape(-1).tolist())) == 8  # every E2M1 magnitude was produced


# ---- NVFP4 rows -> FP8 1x128 (the nvfp4 payload's conversion on the receiver) ----


def _fp8_of_rows_spec(rows: torch.Tensor, h: int):
    values = formats.dequantize_nvfp4_rows(*formats.unpack_nvfp4_rows(rows.cpu(), h))
    return formats.quantize_fp8_blockwise(values, block=(1, formats.FP8_GROUP))


def _random_nvfp4_rows(t: int, h: int, device) -> torch.Tensor:
    """Rows from the quantizer (real data with specials), then some rows of random bytes: every code,
    every block scale byte (NaN 0x7F/0xFF included) and tensor scales of any bits."""
    rows = _spec_rows(_special_tokens(t, h, torch.float32, "cpu"))
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    noisy = torch.rand(t, generator=g) < 0.3
    rows[noisy] = torch.randint(0, 256, (int(noisy.sum()), rows.shape[1]), dtype=torch.uint8, generator=g)
    if t > 2:  # tensor scales: a power of two, a subnormal, zero
        rows[1, -4:] = torch.tensor([2.0**-30], dtype=torch.float32).view(torch.uint8)
        rows[2, -4:] = torch.tensor([1e-40], dtype=torch.float32).view(torch.uint8)
        rows[0, -4:] = torch.tensor([0.0], dtype=torch.float32).view(torch.uint8)
    return rows.to(device)


def test_rows_to_fp8_spec_path_and_errors():
    rows = _random_nvfp4_rows(9, 256, "cpu")
    data, scales = ops.nvfp4_rows_to_fp8_blockwise(rows, 256)
    ref_d, ref_s = _fp8_of_rows_spec(rows, 256)
    assert_bitwise_equal(data, ref_d, "data")
    assert_bitwise_equal(scales, ref_s, "scales")
    from moe_fp4.ep.payloads import get_payload

    got = get_payload("nvfp4").to_fp8_blockwise(rows, 256)
    assert_bitwise_equal(got[0], ref_d, "payload data")
    with pytest.raises(ValueError, match="hidden"):
        ops.nvfp4_rows_to_fp8_blockwise(rows, 96)
    with pytest.raises(ValueError, match="rows"):
        ops.nvfp4_rows_to_fp8_blockwise(rows[:, :-1], 256)
    with pytest.raises(ValueError, match="rows"):
        ops.nvfp4_rows_to_fp8_blockwise(rows.to(torch.int32), 256)
    plain = _spec_rows(torch.randn(9, 256))  # no NaN: opcheck compares outputs with ==
    torch.library.opcheck(torch.ops.moe_fp4.nvfp4_rows_to_fp8_blockwise.default, (plain, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("t,h", [(4096, 7168), (7, 2048), (1, 128), (300, 4096)])
def test_native_rows_to_fp8_equals_spec(t, h):
    rows = _random_nvfp4_rows(t, h, "cuda")
    data, scales = ops.nvfp4_rows_to_fp8_blockwise(rows, h)
    ref_d, ref_s = _fp8_of_rows_spec(rows, h)
    assert_bitwise_equal(data.cpu(), ref_d, f"data {t}x{h}")
    assert_bitwise_equal(scales.cpu(), ref_s, f"scales {t}x{h}")
    wide = torch.zeros(t, rows.shape[1] + 4, dtype=torch.uint8, device="cuda")
    wide[:, 4:] = rows  # 4-byte aligned rows inside wider ones
    strided = ops.nvfp4_rows_to_fp8_blockwise(wide[:, 4:], h)
    assert_bitwise_equal(strided[0].cpu(), ref_d, "strided rows")
