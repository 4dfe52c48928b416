"""The native kernels equal the spec bit for bit on the GPU (marked gpu: skipped without CUDA)."""

import pytest
import torch
from _compare import assert_bitwise_equal, random_splits

from moe_fp4 import formats, ops
from moe_fp4.ops import _ops

pytestmark = pytest.mark.gpu

HIDDEN = (7168, 2048, 4096, 96)
TOKENS = (1, 7, 4096, 32768)
FP8_HIDDEN = (7168, 2048, 4096)


@pytest.fixture(scope="module", autouse=True)
def native():
    ops.build()
    assert ops.native_available()


def _float_input(t, h, dtype):
    """Random rows spread over many binades, with special values and E2M1 rounding ties."""
    x = torch.randn(t, h, device="cuda") * torch.exp2(torch.randint(-40, 40, (t, 1), device="cuda").float())
    if t >= 7 and h >= 64:
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
        x[0, :32] = ties * torch.tensor([1.0, -1.0]).repeat(16)
        x[1, 3] = float("nan")
        x[2, 40] = float("inf")
        x[2, 0] = float("-inf")
        x[3, :32] = 0.0
        x[3, 33] = -0.0
        x[4, :32] = torch.randn(32) * 1e-39  # subnormal in float32 and bfloat16
        x[5, :] = torch.finfo(dtype).max * torch.rand(h) * 0.99
        x[6, : h // 2] *= 1e20  # one element dominates its blocks: saturation and zeros
    return x.to(dtype)


def _mxfp4_input(n, h):
    packed = torch.randint(0, 256, (n, h // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(100, 160, (n, h // 32), dtype=torch.uint8, device="cuda")
    if n >= 7:
        scales[0, 0] = 0xFF
        scales[1] = torch.randint(0, 255, (h // 32,), dtype=torch.uint8)  # shifts >= 15: underflow
        scales[2, :4] = torch.tensor([254, 253, 0, 1], dtype=torch.uint8)
        scales[3] = 0
        packed[4] = 0
        packed[5] = 0x88  # negative zeros
        scales[6] = 254
    return packed, scales


def _splits(n, experts, gaps):
    """Random ragged segments (empty ones and lengths 1 included) inside n rows; gaps: shuffled
    segment order with unused rows between them (explicit offsets), else back to back (None)."""
    cuts = torch.sort(torch.randint(0, n + 1, (experts - 1,))).values
    lens = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
    if experts >= 4:
        lens[1] = 0
        lens[2] = min(1, int(lens[2]) + int(lens[3]))
        lens[3] = 0
    if not gaps:
        lens[-1] += n - int(lens.sum())
        return lens.cuda(), None
    lens = (lens * 3) // 4
    order = torch.randperm(experts)
    offs = torch.empty(experts, dtype=torch.int64)
    pos, slack = 0, n - int(lens.sum())
    for e in order.tolist():
        if lens[e] == 0:  # empty segments at the end: check_splits calls one at another's start overlapping
            offs[e] = n
            continue
        gap = min(int(torch.randint(0, 3, ())), slack)
        pos, slack = pos + gap, slack - gap
        offs[e] = pos
        pos += int(lens[e])
    assert pos <= n
    return lens.cuda(), offs.cuda()


def _equal(got, want, names):
    for g, w, name in zip(got, want, names):
        assert_bitwise_equal(g, w.to(g.device), name)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", HIDDEN)
def test_quantize_mxfp4(t, h):
    x = _float_input(t, h, torch.bfloat16)
    for rounding in ("up", "down"):
        _equal(ops.quantize_mxfp4(x, scale_rounding=rounding), formats.quantize_mxfp4(x, scale_rounding=rounding),
               (f"packed {rounding}", f"scales {rounding}"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h", [7168, 96])
def test_quantize_mxfp4_other_dtypes(dtype, h):
    x = _float_input(513, h, dtype)
    _equal(ops.quantize_mxfp4(x), formats.quantize_mxfp4(x), ("packed", "scales"))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", HIDDEN)
def test_quantize_mxfp4_rows(t, h):
    x = _float_input(t, h, torch.bfloat16)
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    assert_bitwise_equal(ops.quantize_mxfp4_rows(x), want, "rows in order")
    r = t + 5
    out = torch.full((r, want.shape[1]), 0x5A, dtype=torch.uint8, device="cuda")
    index = torch.randperm(r, device="cuda")[:t]
    ops.quantize_mxfp4_rows(x, out=out, row_index=index.to(torch.int32))
    assert_bitwise_equal(out[index], want, "rows at row_index")
    rest = torch.ones(r, dtype=torch.bool, device="cuda")
    rest[index] = False
    assert bool((out[rest] == 0x5A).all())


def _destination_rows(t, caps, dense):
    """int64 [t, D] on the GPU: distinct rows per destination (D = len(caps)), about a quarter -1
    (dense: every token everywhere it fits), a few at or past the capacity (skipped)."""
    cols = []
    for cap in caps:
        col = torch.full((t,), -1, dtype=torch.int64)
        n = min(t, cap)
        take = torch.randperm(t)[:n] if not dense else torch.arange(n)
        col[take] = torch.randperm(cap)[:n]
        if not dense:
            col[torch.rand(t) < 0.25] = -1
            col[torch.randperm(t)[: max(1, t // 50)]] = cap + torch.randint(0, 3, (1,)).item()
        cols.append(col)
    return torch.stack(cols, 1).cuda().contiguous()


def _check_destinations(dests, rows, want, fill, what):
    for d, dest in enumerate(dests):
        r = rows[:, d]
        keep = (r >= 0) & (r < dest.shape[0])
        assert_bitwise_equal(dest[r[keep]], want[keep], f"{what}: destination {d}")
        untouched = torch.ones(dest.shape[0], dtype=torch.bool, device="cuda")
        untouched[r[keep]] = False
        assert bool((dest[untouched] == fill).all()), f"{what}: destination {d} rows nobody targets were written"


@pytest.mark.parametrize("round_up", [True, False])
@pytest.mark.parametrize("t,h,dense", [(4096, 7168, True), (1000, 7168, False), (7, 96, False), (300, 2048, False)])
def test_quantize_mxfp4_rows_multi(t, h, dense, round_up):
    """Each token's byte row written to several destinations at once equals the spec's row, in every
    destination that takes it (8 destinations: the most the kernel takes; an unaligned one too, which
    takes byte stores; H = 96: rows of 51 bytes)."""
    x = _float_input(t, h, torch.bfloat16)
    rounding = "up" if round_up else "down"
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x, scale_rounding=rounding))
    width = want.shape[1]
    for num in (1, 2, 8):
        caps = [t + 3 * d for d in range(num)]
        rows = _destination_rows(t, caps, dense)
        dests = [torch.full((c, width), 0x5A, dtype=torch.uint8, device="cuda") for c in caps]
        if num == 8:  # a destination starting at an odd address: byte stores
            raw = torch.full((caps[-1] * width + 1,), 0x5A, dtype=torch.uint8, device="cuda")
            dests[-1] = raw[1:].view(caps[-1], width)
        blocks = {1: None, 2: 1, 8: 5}[num]  # one block striding over every token; a few
        ops.quantize_mxfp4_rows_multi(x, dests, rows, scale_rounding=rounding, max_blocks=blocks)
        _check_destinations(dests, rows, want, 0x5A, f"{num} destinations, {rounding}, blocks={blocks}")


def test_quantize_mxfp4_rows_multi_other_dtypes_and_errors():
    x = _float_input(64, 256, torch.float32)
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    rows = _destination_rows(64, [64, 70], False)
    dests = [torch.full((c, want.shape[1]), 7, dtype=torch.uint8, device="cuda") for c in (64, 70)]
    ops.quantize_mxfp4_rows_multi(x, dests, rows)
    _check_destinations(dests, rows, want, 7, "float32 input")
    with pytest.raises(ValueError, match="dests"):
        ops.quantize_mxfp4_rows_multi(x, dests * 5, rows)
    with pytest.raises(ValueError, match="dest_rows"):
        ops.quantize_mxfp4_rows_multi(x, dests, rows[:, :1].contiguous())
    with pytest.raises(ValueError, match="dest_rows"):
        ops.quantize_mxfp4_rows_multi(x, dests, rows.to(torch.int32))
    with pytest.raises(ValueError, match="dests"):
        ops.quantize_mxfp4_rows_multi(x, [dests[0][:, :-1], dests[1]], rows)


def _spec_fp8_rows(x):
    """The spec's FP8 1x128 byte rows of x: uint8 [T, H + H/32] (H E4M3 bytes, then H/128 FP32 scales)."""
    data, scales = formats.quantize_fp8_blockwise(x, block=(1, formats.FP8_GROUP))
    return torch.cat((data.view(torch.uint8), scales.view(torch.uint8)), dim=1)


@pytest.mark.parametrize("t,h,dense", [(4096, 7168, True), (1000, 7168, False), (7, 128, False), (300, 2048, False)])
def test_quantize_fp8_blockwise_rows_multi(t, h, dense):
    """FP8 1x128 byte rows [E4M3 | FP32 scales] to several destinations equal the spec's, in every
    destination that takes the token (shared-memory staging above 48 KB at 8 warps for H = 7168)."""
    x = _float_input(t, h, torch.bfloat16)
    want = _spec_fp8_rows(x)
    for num in (1, 2, 8):
        caps = [t + 2 * d for d in range(num)]
        rows = _destination_rows(t, caps, dense)
        dests = [torch.full((c, want.shape[1]), 0x5A, dtype=torch.uint8, device="cuda") for c in caps]
        if num == 8:  # a destination starting 4 bytes off a 16-byte boundary: 4-byte stores
            raw = torch.full((caps[-1] * want.shape[1] + 4,), 0x5A, dtype=torch.uint8, device="cuda")
            dests[-1] = raw[4:].view(caps[-1], want.shape[1])
        blocks = {1: None, 2: 1, 8: 5}[num]
        ops.quantize_fp8_blockwise_rows_multi(x, dests, rows, max_blocks=blocks)
        _check_destinations(dests, rows, want, 0x5A, f"fp8 rows to {num} destinations, blocks={blocks}")
    # float32 input: quantize, then the push
    xf = _float_input(64, h, torch.float32)
    want = _spec_fp8_rows(xf)
    rows = _destination_rows(64, [64, 66], False)
    dests = [torch.full((c, want.shape[1]), 3, dtype=torch.uint8, device="cuda") for c in (64, 66)]
    ops.quantize_fp8_blockwise_rows_multi(xf, dests, rows)
    _check_destinations(dests, rows, want, 3, "fp8 rows from float32")


@pytest.mark.parametrize("t,width", [(4096, 14336), (333, 3808), (50, 4036), (9, 17)])
def test_scatter_rows(t, width):
    """Byte rows pushed to several destinations (16-, 4- and 1-byte paths, a strided source)."""
    wide = torch.randint(0, 256, (t, width + 16), dtype=torch.uint8, device="cuda")
    src = wide[:, :width] if width % 16 else wide[:, :width].contiguous()
    for num in (1, 3, 8):
        caps = [t + d for d in range(num)]
        rows = _destination_rows(t, caps, num == 1)
        dests = [torch.full((c, width), 0xA5, dtype=torch.uint8, device="cuda") for c in caps]
        blocks = {1: None, 3: 1, 8: 7}[num]
        ops.scatter_rows(src, dests, rows, max_blocks=blocks)
        _check_destinations(dests, rows, src, 0xA5, f"scatter of {width}-byte rows to {num}, blocks={blocks}")


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", FP8_HIDDEN)
def test_mxfp4_to_fp8_blockwise(t, h):
    packed, scales = _mxfp4_input(t, h)
    want = formats.mxfp4_to_fp8_blockwise(packed, scales)
    names = ("data", "scales", "underflow")
    _equal(ops.mxfp4_to_fp8_blockwise(packed, scales), want, names)
    rows = formats.pack_mxfp4_rows(packed, scales)
    _equal(ops.mxfp4_rows_to_fp8_blockwise(rows, h), want, names)


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("t,h", [(7, 7168), (4096, 2048), (32768, 7168), (1000, 384)])
def test_mxfp4_to_fp8_blockwise_splits(t, h, gaps):
    packed, scales = _mxfp4_input(t, h)
    lens, offs = _splits(t, 8, gaps)
    want = _ops._spec_fp8_rows(packed, scales, lens, offs)
    names = ("data", "scales", "underflow")
    _equal(ops.mxfp4_to_fp8_blockwise(packed, scales, lens, offs), want, names)
    rows = formats.pack_mxfp4_rows(packed, scales)
    _equal(ops.mxfp4_rows_to_fp8_blockwise(rows, h, lens.to(torch.int32),
                                           None if offs is None else offs.to(torch.int32)), want, names)


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", FP8_HIDDEN)
def test_mxfp4_rows_to_fp8_cols(t, h, gaps):
    packed, scales = _mxfp4_input(t, h)
    lens, offs = _splits(t, 8 if t > 7 else 3, gaps)
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs), want, ("data", "scales", "group_offsets"))


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("t", [4096, 32768])
def test_mxfp4_rows_to_fp8_cols_quantized_activations(t, ragged):
    """Inputs quantized from activations (row scales within a few binades, as in training): the
    kernel's per-column integer path; outlier and all-zero rows push some groups onto its table path."""
    h = 2048
    x = torch.randn(t, h, device="cuda") * torch.exp2(torch.randint(-3, 4, (t, 1), device="cuda").float())
    x[5] *= 2.0**20  # an outlier row: the other rows of its group land below E4M3's normal range
    x[300] = 0.0  # scale byte 0 rows
    x[301, :64] = 0.0
    x[1000, 7] = float("nan")  # a NaN block
    packed, scales = formats.quantize_mxfp4(x.to(torch.bfloat16))
    if ragged:
        lens, offs = _splits(t, 32, False)
    else:
        lens, offs = torch.full((32,), t // 32, dtype=torch.int64, device="cuda"), None
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs), want, ("data", "scales", "group_offsets"))


def test_mxfp4_rows_to_fp8_cols_edge_splits():
    packed, scales = _mxfp4_input(300, 256)
    for lens, offs in [
        ([0, 0, 0], None),
        ([300], None),
        ([1] * 7, None),
        ([128, 129, 0, 43], None),
        ([5, 1], [290, 17]),
        ([], None),
    ]:
        lt = torch.tensor(lens, dtype=torch.int64, device="cuda")
        ot = None if offs is None else torch.tensor(offs, dtype=torch.int64, device="cuda")
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lt, ot)
        _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lt, ot), want, (f"data {lens}", "scales", "goffs"))


def _dirty_cache(nbytes):
    """Leave nonzero garbage in the caching allocator's free blocks, so that an output byte a kernel
    forgets to write shows up."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    del junk


def _small_expert_splits(n, gaps):
    """Segments of lengths drawn from {0, 1, 5, 127, 128, 129, 200} (groups at unaligned rows, empty
    and 1-row experts), back to back or shuffled with unused rows between them."""
    choices = [0, 1, 5, 127, 128, 129, 200]
    lens, left = [], n if not gaps else (n * 3) // 4
    while left > 0:
        ln = min(left, choices[int(torch.randint(0, len(choices), ()))])
        lens.append(ln)
        left -= ln
    if not gaps:
        return torch.tensor(lens, device="cuda"), None
    order = torch.randperm(len(lens)).tolist()
    offs, pos, slack = [0] * len(lens), 0, n - sum(lens)
    for e in order:
        gap = min(int(torch.randint(0, 4, ())), slack)
        pos, slack = pos + gap, slack - gap
        offs[e] = pos if lens[e] > 0 else n
        pos += lens[e]
    return torch.tensor(lens, device="cuda"), torch.tensor(offs, device="cuda")


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("t", [520, 1000, 4099])
def test_mxfp4_rows_to_fp8_cols_small_experts(t, gaps):
    """Many short experts: 128-token output windows holding several groups and experts, rows outside
    every segment, N not a multiple of 8 (4099), int32 split tensors."""
    h = 2048
    packed, scales = _mxfp4_input(t, h)
    lens, offs = _small_expert_splits(t, gaps)
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
    _dirty_cache(4 * t * h)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs), want, ("data", "scales", "group_offsets"))
    got = ops.mxfp4_rows_to_fp8_cols(packed, scales, lens.to(torch.int32),
                                     None if offs is None else offs.to(torch.int32))
    _equal(got, want, ("data int32 splits", "scales int32 splits", "group_offsets int32 splits"))


def test_mxfp4_rows_to_fp8_cols_many_experts():
    """More experts than the kernel's shared-memory table holds (the separate prefix pass)."""
    t, h, experts = 3000, 256, 1500
    packed, scales = _mxfp4_input(t, h)
    lens = torch.randint(0, 4, (experts,), device="cuda")
    lens[7] = 129
    lens[8] = 0
    _dirty_cache(4 * t * h)
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens), want, ("data", "scales", "group_offsets"))


@pytest.mark.parametrize("t", [300, 4096])
def test_mxfp4_rows_to_fp8_cols_special_columns(t):
    """Scales within a few binades (the integer fast path) plus: an overflowing (Inf) column beside
    zero and negative-zero columns of the same 8, a NaN block, an all-zero group, rows outside every
    segment holding NaN blocks (zero output), a row whose shift sends its group's others below E4M3's
    normal range."""
    h = 2048
    packed = torch.randint(0, 256, (t, h // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(125, 129, (t, h // 32), dtype=torch.uint8, device="cuda")
    packed[0:3, 0:4] = torch.tensor([0x07, 0x80, 0x00, 0x88], dtype=torch.uint8)  # col 0: code 7, then zeros
    packed[3:128, 0:4] = 0x88
    scales[0:3, 0] = 254  # col 0 overflows float32: a NaN scale, zero data; cols 1..7 stay (negative) zeros
    scales[140, 5] = 0xFF  # a NaN block
    packed[256:300, 64:128] = 0  # an all-zero stretch
    scales[200, 3] = 150  # one large row scale
    lens = torch.tensor([128, 12, 0, 100, 1, 50], device="cuda")
    offs = torch.tensor([0, 128, t, 150, 149, 250], device="cuda")
    scales[140:150, 9] = 0xFF  # rows 140..149 partly outside segments (149 is expert 4's only row)
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
    _dirty_cache(4 * t * h)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs), want, ("data", "scales", "group_offsets"))
    one = lens[:1].new_tensor([t])
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, one)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, one), want, ("data one expert", "scales one expert", "goffs"))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", FP8_HIDDEN)
def test_quantize_fp8_blockwise(t, h):
    x = _float_input(t, h, torch.bfloat16)
    _equal(ops.quantize_fp8_blockwise(x), formats.quantize_fp8_blockwise(x, block=(1, 128)), ("data", "scales"))


def test_quantize_fp8_blockwise_float32_and_h96_rejected():
    x = _float_input(300, 2048, torch.float32)
    _equal(ops.quantize_fp8_blockwise(x), formats.quantize_fp8_blockwise(x, block=(1, 128)), ("data", "scales"))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.quantize_fp8_blockwise(_float_input(4, 96, torch.bfloat16))
    packed, scales = _mxfp4_input(4, 96)
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.mxfp4_to_fp8_blockwise(packed, scales)


@pytest.mark.parametrize("t", (1, 7, 4096))
@pytest.mark.parametrize("h", HIDDEN)
def test_dequantize_mxfp4(t, h):
    if h >= 128:
        packed, scales = _mxfp4_input(t, h)
    else:
        packed = torch.randint(0, 256, (t, h // 2), dtype=torch.uint8, device="cuda")
        scales = torch.randint(0, 256, (t, h // 32), dtype=torch.uint8, device="cuda")  # 0xFF and 254 included
    for dtype in (torch.bfloat16, torch.float32):
        want = formats.dequantize_mxfp4(packed, scales, dtype=dtype)
        assert_bitwise_equal(ops.dequantize_mxfp4(packed, scales, dtype=dtype), want, f"values {dtype}")
    # quantized activations, and a 3-D input
    x = _float_input(t, h, torch.bfloat16)
    p, s = formats.quantize_mxfp4(x)
    assert_bitwise_equal(ops.dequantize_mxfp4(p, s), formats.dequantize_mxfp4(p, s, dtype=torch.bfloat16), "bf16")
    p3, s3 = p.reshape(1, t, h // 2), s.reshape(1, t, h // 32)
    assert_bitwise_equal(ops.dequantize_mxfp4(p3, s3), formats.dequantize_mxfp4(p3, s3, dtype=torch.bfloat16), "3-D")


def test_outputs_on_current_stream():
    x = _float_input(4096, 7168, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = ops.quantize_mxfp4(x)
    torch.cuda.current_stream().wait_stream(stream)
    _equal(got, formats.quantize_mxfp4(x), ("packed", "scales"))


def test_opcheck_cuda():
    x = torch.randn(70, 256, device="cuda", dtype=torch.bfloat16)  # finite: opcheck compares with NaN != NaN
    packed, scales = formats.quantize_mxfp4(x)
    rows = formats.pack_mxfp4_rows(packed, scales)
    lens = torch.tensor([10, 0, 1, 40], device="cuda")
    out = torch.zeros(76, rows.shape[1], dtype=torch.uint8, device="cuda")
    index = torch.randperm(76, device="cuda")[:70]  # 70 rows: the column op's padded row stride (96)
    for op, args in [
        (_ops.quantize_mxfp4_op, (x, "up")),
        (_ops.quantize_mxfp4_rows_op, (x, "down")),
        (_ops.quantize_mxfp4_rows_into_op, (x, "up", out, index)),
        (_ops.mxfp4_to_fp8_blockwise_op, (packed, scales, lens, None)),
        (_ops.mxfp4_rows_to_fp8_blockwise_op, (rows, 256, lens, None)),
        (_ops.mxfp4_rows_to_fp8_cols_op, (packed, scales, lens, None)),  # the native strides against the fake
        (_ops.mxfp4_rows_to_fp8_cols_op, (packed, scales, lens.cpu(), None)),  # splits on the host
        (_ops.quantize_fp8_blockwise_op, (x,)),
        (_ops.dequantize_mxfp4_op, (packed, scales, torch.bfloat16)),
    ]:
        torch.library.opcheck(op, args)


def test_selfcheck_driver():
    from moe_fp4.ops import selfcheck

    assert selfcheck.run("cuda")


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("gaps", [False, True])
def test_mxfp4_rows_to_fp8_cols_both_paths(aligned, gaps):
    """The one-pass and the two-pass column paths give the spec's bits on the same inputs, whichever
    the op would choose (column_plan: one pass when every segment starts on a 16-row boundary; here
    some start at 16 mod 32, sharing a 32-byte sector with the previous group)."""
    t, h = 4099, 2048
    packed, scales = _mxfp4_input(t, h)
    if aligned:
        lens = torch.tensor([0, 48, 256, 1024, 80, 0, 64, 2048], device="cuda")
        offs = torch.tensor([t, 4016, 0, 2816, 256, t, 3856, 512], device="cuda") if gaps else None
    else:
        lens, offs = _small_expert_splits(t, gaps)
    groups, chosen, full = _ops.column_plan(lens, offs, t)
    assert chosen == (not aligned) and not full
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
    native = ops.build()
    for two_pass in (False, True):
        _dirty_cache(4 * t * h)
        got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs, groups, two_pass)
        _equal(got, want, (f"data two_pass={two_pass}", "scales", "group_offsets"))
        assert got[1].stride() == (1, h)  # outer-dim-major, as the spec
        assert got[0].stride() == want[0].stride() == ((t + 31) // 32 * 32, 1)  # rows on 32-byte sectors


def test_mxfp4_rows_to_fp8_cols_two_pass_rows_past_the_segments():
    """Two-pass path, back-to-back segments covering fewer than all rows: the rows past them are zero
    in the output. The workspace is uninitialised memory (the prepare kernel marks those rows); the
    first call, of the same workspace size, leaves group 31 in the rows the second call must zero."""
    t, h = 4096, 2048
    packed, scales = _mxfp4_input(t, h)
    native = ops.build()
    for lens in (torch.tensor([t], device="cuda"), torch.tensor([31 * 128 + 1], device="cuda")):
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens)
        assert want[1].shape[1] == 32
        got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, 32, True)
        _equal(got, want, ("data", "scales", "group_offsets"))
        del got


def test_mxfp4_rows_to_fp8_cols_two_pass_in_a_cuda_graph():
    """The two-pass path's kernels start as programmatic dependents of the previous one: captured in a
    CUDA graph and replayed on new inputs in the same buffers, they still give the spec's bits (the
    native call takes the group count, so nothing reads the splits on the host)."""
    t, h = 4099, 2048
    packed, scales = _mxfp4_input(t, h)
    lens, offs = _small_expert_splits(t, False)
    groups, two_pass, _ = _ops.column_plan(lens, offs, t)
    assert two_pass
    native = ops.build()
    native.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs, groups, True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs, groups, True)
    for _ in range(2):
        fresh_p, fresh_s = _mxfp4_input(t, h)
        packed.copy_(fresh_p)
        scales.copy_(fresh_s)
        graph.replay()
        torch.cuda.synchronize()
        _equal(got, formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs), ("data", "scales", "group_offsets"))


@pytest.mark.parametrize("low", [0, 240, 248])
@pytest.mark.parametrize("t,h", [(4096, 7168), (1000, 2048), (4099, 384)])
def test_mxfp4_rows_to_fp8_cols_top_scale_bytes(t, h, low):
    """Scale bytes drawn from [low, 255]: the two-pass path's byte keys hold S + 4 in a byte only up to
    S = 251, and columns that met 252..254 take the exact fallback (low 248: most lanes, no NaN; the
    others: NaN blocks too). Both paths, ragged splits with and without gaps."""
    packed = torch.randint(0, 256, (t, h // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(low, 256, (t, h // 32), dtype=torch.uint8, device="cuda")
    if low == 248:
        scales[scales == 0xFF] = 251
    native = ops.build()
    for experts, gaps in ((8, False), (32, True)):
        lens, offs = _splits(t, experts, gaps)
        groups, _, _ = _ops.column_plan(lens, offs, t)
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
        for two_pass in (False, True):
            got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs, groups, two_pass)
            _equal(got, want, (f"data two_pass={two_pass}", "scales", "group_offsets"))


@pytest.mark.parametrize("h", [7168, 2048, 384])
def test_mxfp4_rows_to_fp8_cols_full_groups(h):
    """Segments back to back from row 0 with lengths that are multiples of 128 (column_plan's
    full_groups): the one-pass kernel loads each group's rows before its look-up. The spec's bits
    with the flag right, absent, and set for a layout it does not describe (the kernel checks the rows
    it loaded early against the look-up); rows past the segments are zeroed."""
    t = 3072 + 77
    packed, scales = _mxfp4_input(t, h)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lens = torch.randint(0, 4, (8,), generator=gen) * 128
    lens[0], lens[3], lens[5] = 256, 0, 128
    lens = lens.cuda()
    groups, two_pass, full = _ops.column_plan(lens, None, t)
    assert full and not two_pass
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, None)
    native = ops.build()
    for flag in (True, False):
        _dirty_cache(4 * t * h)
        got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, flag)
        _equal(got, want, (f"data full_groups={flag}", "scales", "group_offsets"))
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens), want, ("op data", "op scales", "op group_offsets"))
    # more than 32 experts (the kernel's check of the flag sums their groups 32 at a time), half empty
    many = torch.zeros(40, dtype=torch.int64)
    many[torch.randperm(40, generator=gen)[:20]] = 128
    many = many.cuda()
    groups, two_pass, full = _ops.column_plan(many, None, t)
    assert full and not two_pass and groups == 20
    want_many = formats.mxfp4_rows_to_fp8_cols(packed, scales, many, None)
    _dirty_cache(4 * t * h)
    got = native.mxfp4_rows_to_fp8_cols(packed, scales, many, None, groups, False, True)
    _equal(got, want_many, ("data, 40 experts", "scales", "group_offsets"))
    # a first segment of 32 rows moves every later group off 128 g: the flag is wrong, the output is not
    lens[0] = 32
    groups, two_pass, full = _ops.column_plan(lens, None, t)
    assert not full and not two_pass
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, None)
    _dirty_cache(4 * t * h)
    got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, True)
    _equal(got, want, ("data, flag set wrongly", "scales", "group_offsets"))
    # 40 one-row segments through the one-pass kernel (the plan would take two passes): 40 groups,
    # whose rows 128 g would lie past the input from g = 24 on, where no early load may be issued
    lens = torch.ones(40, dtype=torch.int64, device="cuda")
    groups, two_pass, full = _ops.column_plan(lens, None, t)
    assert groups * 128 > t and two_pass and not full
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, None)
    _dirty_cache(4 * t * h)
    got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, True)
    _equal(got, want, ("data, one-row segments, flag set wrongly", "scales", "group_offsets"))


@pytest.mark.parametrize("t,h", [(4096, 7168), (1000 + 37, 384)])
def test_mxfp4_rows_to_fp8_cols_box_and_thread_stores(t, h):
    """The one-pass kernel stores a whole 128-row tile (or the input's last rows) starting on a 16-row
    boundary with one tensor copy, other tiles by the threads' 16-byte stores. The spec's bits either
    way: with the copies (box_store=True, the default unless MOE_FP4_COLUMN_BOX_STORE=0), and with every
    tile stored by the threads (box_store=False), on segments whose groups mix both kinds (full groups,
    short last groups of each segment, groups starting at 16 mod 32 rows, the input's last rows) and on
    full groups only."""
    packed, scales = _mxfp4_input(t, h)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    mixed = (torch.randint(0, t // 16 // 12 + 1, (12,), generator=gen) * 16).tolist()
    mixed[-1] = t - sum(mixed[:-1])  # back to back up to the input's last row
    assert mixed[-1] > 0
    full = [t // 128 // 2 * 128, (t // 128 - t // 128 // 2) * 128]
    native = ops.build()
    for lens in (mixed, full):
        lens = torch.tensor(lens, device="cuda")
        groups, two_pass, full_groups = _ops.column_plan(lens, None, t)
        assert not two_pass
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, None)
        for box_store in (True, False):
            _dirty_cache(4 * t * h)
            got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, full_groups,
                                                box_store=box_store)
            _equal(got, want, (f"data box_store={box_store}", "scales", "group_offsets"))


def test_mxfp4_rows_to_fp8_cols_group_table():
    """Segments on 16-row boundaries, not full groups, with host splits passed (_ops.column_launch): the
    launcher derives each scale group's first row and count (native column_group_table), which the
    one-pass kernel loads before its own look-up and checks against it. The spec's bits with the splits
    right, their first rows shifted by 16, their lengths rounded up to 128, the first half of the
    experts only, and absent; through the op; splits on the GPU are refused."""
    t, h = 3000, 2048
    packed, scales = _mxfp4_input(t, h)
    lens = torch.tensor([48, 0, 256, 1008, 80, 16, 512, 144], device="cuda")  # rows past them stay zero
    groups, two_pass, full = _ops.column_plan(lens, None, t)
    assert not two_pass and not full
    assert _ops.column_launch(lens, None, t)[3] is None  # starts at 16 mod 32: the op passes no splits
    host = _ops._splits_tensor(*_ops._host_splits(lens, None, t))
    shifted, rounded = host.clone(), host.clone()
    shifted[1] += 16
    rounded[0] = (rounded[0] + 127) // 128 * 128
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens)
    native = ops.build()
    for name, splits in (("right", host), ("shifted", shifted), ("rounded up", rounded),
                         ("half", host[:, : host.shape[1] // 2]), ("none", None)):
        _dirty_cache(4 * t * h)
        got = native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, False, splits)
        _equal(got, want, (f"data, splits {name}", f"scales, splits {name}", f"group_offsets, splits {name}"))
    _dirty_cache(4 * t * h)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens), want, ("op data", "op scales", "op group_offsets"))
    lens32 = torch.tensor([64, 0, 256, 1024, 96, 32, 512, 128], device="cuda")  # the op passes its splits
    assert _ops.column_launch(lens32, None, t)[3] is not None
    _dirty_cache(4 * t * h)
    _equal(ops.mxfp4_rows_to_fp8_cols(packed, scales, lens32), formats.mxfp4_rows_to_fp8_cols(packed, scales, lens32),
           ("op data, 32-row starts", "op scales, 32-row starts", "op group_offsets, 32-row starts"))
    with pytest.raises(RuntimeError, match="host_splits"):
        native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, False, host.cuda())
    with pytest.raises(RuntimeError, match="host_splits"):
        native.mxfp4_rows_to_fp8_cols(packed, scales, lens, None, groups, False, False, host.to(torch.int32))


@pytest.mark.parametrize("t,to_end,h", [(2080, True, 1024), (3001, False, 128), (12001, True, 7168)])
def test_mxfp4_rows_to_fp8_cols_offsets_on_32_rows(t, to_end, h):
    """Segments at offsets that are multiples of 32 (the one-pass path), in shuffled order, lengths not
    multiples of 32 (1-row and empty experts among them), gaps from none to more than 32 rows, rows
    before the first segment, the last one ending at N (a multiple of 32 or not) or before it: the
    group ending a segment writes the rows up to the next multiple of 32 as zeros, the zero pass the
    others outside every segment (its tasks covering one 256-column chunk or, at 12001 x 7168, two),
    and every byte is the spec's, on outputs over nonzero garbage."""
    packed, scales = _mxfp4_input(t, h)
    choices = [0, 1, 31, 33, 100, 128, 129, 200, 300]
    lens, starts, pos = [], [], 32 * int(torch.randint(1, 3, ()))
    while True:
        ln = choices[int(torch.randint(0, len(choices), ()))]
        if pos + ln > t - 96:
            break
        lens.append(ln)
        starts.append(pos)
        pos = -(-(pos + ln + int(torch.randint(0, 45, ()))) // 32) * 32
    if to_end:
        lens.append(t - pos)
        starts.append(pos)
    order = torch.randperm(len(lens)).tolist()
    lt = torch.tensor([lens[e] for e in order], device="cuda")
    ot = torch.tensor([starts[e] for e in order], device="cuda")
    groups, two_pass, full = _ops.column_plan(lt, ot, t)
    assert not two_pass and not full
    want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lt, ot)
    for dtype in (torch.int64, torch.int32):
        _dirty_cache(4 * t * h)
        got = ops.mxfp4_rows_to_fp8_cols(packed, scales, lt.to(dtype), ot.to(dtype))
        _equal(got, want, (f"data {dtype}", f"scales {dtype}", f"group_offsets {dtype}"))
    _dirty_cache(4 * t * h)  # without the host splits: the kernel's own look-up
    got = ops.build().mxfp4_rows_to_fp8_cols(packed, scales, lt, ot, groups, False, False)
    _equal(got, want, ("data, no host splits", "scales, no host splits", "group_offsets, no host splits"))


def test_mxfp4_rows_to_fp8_cols_few_groups_zero_the_other_rows():
    """Splits covering none or few of the rows (all experts empty; one short expert in a large buffer;
    one expert at an offset): every row outside them comes out zero, as the spec's, with the grid
    sized for the rows to zero rather than for the groups."""
    t, h = 3000, 1024
    packed, scales = _mxfp4_input(t, h)
    for lens, offs in ((torch.zeros(32, dtype=torch.int64), None), (torch.tensor([0, 77, 0]), None),
                       (torch.tensor([0, 200]), torch.tensor([0, 2500]))):
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, offs)
        for where in ("cuda", "cpu"):
            _dirty_cache(4 * t * h)
            got = ops.mxfp4_rows_to_fp8_cols(packed, scales, lens.to(where), None if offs is None else offs.to(where))
            _equal(got, want, (f"data {lens.tolist()} {where}", "scales", "group_offsets"))


def test_column_group_table_lists_every_group():
    """The launcher's derivation of the scale groups from host splits (native column_group_table):
    each group's first row and row count, expert by expert, empty experts having none, against a loop
    over the experts; random lengths (some empty) and offsets in a random order."""
    native = ops.build()
    for _ in range(5):
        lens, offs = random_splits(9, 700)
        want = [(int(offs[e]) + 128 * j, min(128, int(lens[e]) - 128 * j))
                for e in range(9) for j in range(-(-int(lens[e]) // 128))]
        got = native.column_group_table(torch.stack((lens, offs)))
        assert got.dtype == torch.int32 and got.shape == (len(want), 2)
        assert [tuple(r) for r in got.tolist()] == want


def test_mxfp4_rows_to_fp8_cols_host_splits():
    """Splits given on the CPU (int32 and int64, back to back and with offsets; one-pass and two-pass
    plans): the op's bits equal the spec's, as with the same splits on the GPU, and the caller's host
    tensors may change right after the call without changing the result (the op copies them). Splits on
    another device than the input's, or offsets on another device than the lengths, are refused."""
    t, h = 2300, 512
    packed, scales = _mxfp4_input(t, h)
    ragged = torch.tensor([300, 0, 1, 777, 5, 600])
    offs = torch.tensor([1390, 0, 1100, 0, 1101, 1690])  # not in order, gaps between them
    for lens, o in ((torch.tensor([64, 0, 256, 1024, 96]), None), (ragged, None), (ragged, offs)):
        for dtype in (torch.int32, torch.int64):
            hl, ho = lens.to(dtype).clone(), None if o is None else o.to(dtype).clone()
            want = formats.mxfp4_rows_to_fp8_cols(packed, scales, hl, ho)
            _dirty_cache(4 * t * h)
            got = ops.mxfp4_rows_to_fp8_cols(packed, scales, hl, ho)
            hl.fill_(0)  # the caller reuses its tensors at once
            if ho is not None:
                ho.fill_(0)
            _equal(got, want, (f"data {dtype}", f"scales {dtype}", f"group_offsets {dtype}"))
            assert got[2].device == packed.device
    with pytest.raises(ValueError, match="split_offsets: expected device"):
        ops.mxfp4_rows_to_fp8_cols(packed, scales, ragged, offs.cuda())
    with pytest.raises(ValueError, match="split_lens: expected device"):
        ops.mxfp4_rows_to_fp8_blockwise(ops.quantize_mxfp4_rows(torch.randn(8, 256, device="cuda")),
                                        256, torch.tensor([8]))


def test_fp8_rows_zero_experts_zero_every_row():
    """An empty split (zero experts) leaves every row outside every segment: zero data, zero scales,
    no underflow, as the spec (an empty tensor's null data pointer must not read as "no split")."""
    t, h = 96, 256
    packed, scales = _mxfp4_input(t, h)
    rows = formats.pack_mxfp4_rows(packed, scales)
    names = ("data", "scales", "underflow")
    for dtype in (torch.int64, torch.int32):
        empty = torch.zeros(0, dtype=dtype, device="cuda")
        want = _ops._spec_fp8_rows(packed, scales, empty, None)
        assert not want[0].view(torch.uint8).any() and not want[1].any() and int(want[2]) == 0
        _equal(ops.mxfp4_to_fp8_blockwise(packed, scales, empty), want, names)
        _equal(ops.mxfp4_rows_to_fp8_blockwise(rows, h, empty), want, names)
        col = ops.mxfp4_rows_to_fp8_cols(packed, scales, empty)
        _equal(col, formats.mxfp4_rows_to_fp8_cols(packed, scales, empty), ("data", "scales", "group_offsets"))


def _odd_stride_row(row):
    """A one-row view of `row` ([1, W] uint8) whose row stride is W + 1 (odd), data 4-byte aligned."""
    big = torch.randint(0, 256, (1, row.shape[1] + 1), dtype=torch.uint8, device="cuda")
    big[:, : row.shape[1]] = row
    view = big[:, : row.shape[1]]
    assert view.stride(0) % 2 == 1 and view.data_ptr() % 4 == 0
    return view


def test_single_row_views_with_an_odd_row_stride():
    """One row read through a view with an odd row stride (only its start matters): every op equals
    the spec or, for NVFP4 rows, the same op on a contiguous copy."""
    h = 256
    packed, scales = _mxfp4_input(1, h)
    pv = _odd_stride_row(packed)
    want_bf16 = formats.dequantize_mxfp4(packed, scales, dtype=torch.bfloat16)
    assert_bitwise_equal(ops.dequantize_mxfp4(pv, scales), want_bf16, "dequantize_mxfp4")
    _equal(ops.mxfp4_to_fp8_blockwise(pv, scales), formats.mxfp4_to_fp8_blockwise(packed, scales),
           ("data", "scales", "underflow"))
    one = torch.ones(1, dtype=torch.int64, device="cuda")
    _equal(ops.mxfp4_rows_to_fp8_cols(pv, scales, one), formats.mxfp4_rows_to_fp8_cols(packed, scales, one),
           ("data", "scales", "group_offsets"))
    nv = ops.quantize_nvfp4_rows(_float_input(1, h, torch.bfloat16))
    _equal(ops.nvfp4_rows_to_fp8_blockwise(_odd_stride_row(nv), h), ops.nvfp4_rows_to_fp8_blockwise(nv, h),
           ("data", "scales"))


def test_rows_past_the_kernels_limit_are_refused():
    """Rows longer than the native kernels' 32-bit row length take a clear error naming x."""
    x = torch.randn(1, (1 << 24) + 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="x: rows of 16777344 elements exceed"):
        ops.quantize_fp8_blockwise(x)
    with pytest.raises(RuntimeError, match="x: rows of 16777344 elements exceed"):
        ops.quantize_mxfp4(x)


def test_multi_destination_rows_too_wide_to_stage():
    """Byte rows wider than the shared memory the multi-destination kernels stage them in take a clear
    error naming x, and leave no CUDA error behind for the next launch."""
    t, h = 4, 65536  # MXFP4 rows of 34816 bytes, FP8 rows of 67584: 8 per block exceed 227 KB
    x = _float_input(t, h, torch.bfloat16)
    rows = torch.arange(t, dtype=torch.int64, device="cuda").view(t, 1)
    with pytest.raises(RuntimeError, match="x: rows of 65536 elements make 34816-byte rows"):
        ops.quantize_mxfp4_rows_multi(x, [torch.empty(t, h // 2 + h // 32, dtype=torch.uint8, device="cuda")], rows)
    with pytest.raises(RuntimeError, match="x: rows of 65536 elements make 67584-byte rows"):
        ops.quantize_fp8_blockwise_rows_multi(x, [torch.empty(t, h + h // 32, dtype=torch.uint8, device="cuda")], rows)
    small = _float_input(64, 256, torch.bfloat16)
    _equal(ops.quantize_mxfp4(small), formats.quantize_mxfp4(small), ("packed", "scales"))
    torch.cuda.synchronize()


def test_binding_checks_raise_instead_of_crashing():
    """The native binding's own argument checks (reached here past the Python validation) raise with
    their numbers formatted: the extension shares the process's libstdc++ rather than a static copy
    whose error formatting crashed."""
    from moe_fp4.ops import _native

    native = _native.module()
    x = _float_input(4, 100, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x: last dimension \(100\) must be a multiple of 128"):
        native.quantize_fp8_blockwise(x)
    packed, scales = _mxfp4_input(8, 256)
    with pytest.raises(RuntimeError, match=r"scales: expected shape \[8, 8\]"):
        native.mxfp4_to_fp8_blockwise(packed, scales[:, :4], None, None)
