"""ops.mxfp4_rows_expand_fp8_blockwise: mxfp4_rows_to_fp8_blockwise fused with the expansion to expert rows
(the receive side of the mxfp4 dispatch): every output row equals the spec's conversion of its token's row."""

import pytest
import torch

from moe_fp4 import formats, ops
from moe_fp4.ep.payloads import get_payload
from tests._compare import assert_bitwise_equal


def _routing(n: int, k: int, experts: int, local: int, device) -> tuple[torch.Tensor, int, torch.Tensor]:
    """slots int64 [n, k] for top-k routing over `experts` experts of which the first `local` are
    here, output rows in expert order; also the number of output rows and the token of each."""
    topk = torch.randn(n, experts).topk(k, dim=1).indices
    pairs = (topk < local).nonzero()
    order = torch.argsort(topk[pairs[:, 0], pairs[:, 1]] * n + pairs[:, 0])
    out_row = torch.empty_like(order)
    out_row[order] = torch.arange(order.numel())
    slots = torch.full((n, k), -1, dtype=torch.int64)
    slots[pairs[:, 0], pairs[:, 1]] = out_row
    token = torch.empty(order.numel(), dtype=torch.int64)
    token[out_row] = pairs[:, 0]
    return slots.to(device), int(order.numel()), token.to(device)


def _mxfp4_rows(n: int, h: int, device, special: bool = False) -> torch.Tensor:
    x = torch.randn(n, h) * torch.exp2(torch.randint(-20, 20, (n, h // 32, 1)).float()).repeat_interleave(
        32, dim=1).reshape(n, h)
    rows = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    if special and n:
        scales = rows[:, h // 2:]
        scales[0, 0] = 0xFF  # a NaN block: its group converts to NaN scale and zero data
        scales[n // 2, -1] = 0
        scales[-1, 1] = 254
    return rows.to(device)


def _expected(rows, h, token):
    data, scales, _ = formats.mxfp4_to_fp8_blockwise(*formats.unpack_mxfp4_rows(rows, h))
    return data[token], scales[token]


def test_spec_fallback_and_checks():
    rows = _mxfp4_rows(40, 256, "cpu", special=True)
    slots, num_rows, token = _routing(40, 4, 16, 8, "cpu")
    data, scales = ops.mxfp4_rows_expand_fp8_blockwise(rows, 256, slots, num_rows)
    ref_d, ref_s = _expected(rows, 256, token)
    assert_bitwise_equal(data, ref_d, "data")
    assert_bitwise_equal(scales, ref_s, "scales")
    with pytest.raises(ValueError, match="hidden"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, 96, slots, num_rows)
    with pytest.raises(ValueError, match="slots"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, 256, slots[:3], num_rows)
    with pytest.raises(ValueError, match="slots"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, 256, slots.t().contiguous().t(), num_rows)
    with pytest.raises(ValueError, match="slots"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, 256, slots.to(torch.int32), num_rows)
    with pytest.raises(ValueError, match="num_rows"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, 256, slots, -1)
    plain = _mxfp4_rows(40, 256, "cpu")  # no NaN group: opcheck compares outputs with ==
    torch.library.opcheck(torch.ops.moe_fp4.mxfp4_rows_expand_fp8_blockwise.default, (plain, 256, slots, num_rows))


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,k,experts,local", [(4096, 7168, 8, 256, 128), (37, 2048, 8, 64, 16), (5, 128, 1, 4, 2),
                                                  (300, 4096, 32, 64, 40), (1, 7168, 8, 16, 16)])
def test_native_equals_spec(n, h, k, experts, local):
    rows = _mxfp4_rows(n, h, "cuda", special=True)
    slots, num_rows, token = _routing(n, k, experts, local, "cuda")
    data, scales = ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, num_rows)
    ref_d, ref_s = _expected(rows, h, token)
    assert_bitwise_equal(data, ref_d, f"data {n}x{h} k={k}")
    assert_bitwise_equal(scales, ref_s, f"scales {n}x{h} k={k}")


@pytest.mark.gpu
def test_native_skips_out_of_range_slots_and_keeps_row_layouts():
    h = 128  # 68-byte rows: 4-byte aligned loads
    rows = _mxfp4_rows(6, h, "cuda")
    slots = torch.tensor([[0, 7], [-1, -1], [1, -5], [2, 3], [100, 4], [5, -1]], device="cuda")
    data, scales = ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, 6)
    token = torch.tensor([0, 2, 3, 3, 4, 5], device="cuda")
    ref_d, ref_s = _expected(rows, h, token)
    assert_bitwise_equal(data, ref_d, "data")
    assert_bitwise_equal(scales, ref_s, "scales")
    base = torch.zeros(7, formats.mxfp4_row_bytes(2048) + 4, dtype=torch.uint8, device="cuda")
    base[:, :-4] = _mxfp4_rows(7, 2048, "cuda")
    strided = base[:, :-4]  # rows 4-byte aligned, not 8
    slots, num_rows, token = _routing(7, 4, 8, 6, "cuda")
    data, scales = ops.mxfp4_rows_expand_fp8_blockwise(strided, 2048, slots, num_rows)
    ref_d, ref_s = _expected(strided.contiguous(), 2048, token)
    assert_bitwise_equal(data, ref_d, "strided data")
    assert_bitwise_equal(scales, ref_s, "strided scales")
    empty = ops.mxfp4_rows_expand_fp8_blockwise(rows[:0], h, slots[:0, :2], 0)
    assert empty[0].shape == (0, h) and empty[1].shape == (0, 1)


@pytest.mark.gpu
def test_payload_expansion_equals_the_gather_path():
    h, n = 2048, 500
    rows = _mxfp4_rows(n, h, "cuda")
    slots, num_rows, token = _routing(n, 8, 64, 32, "cuda")
    codec = get_payload("mxfp4")
    data, scales = codec.expand_fp8_blockwise(rows, h, slots, num_rows, token)
    ref_d, ref_s = codec.gather_fp8_blockwise(rows, h, token)
    assert_bitwise_equal(data, ref_d, "data")
    assert_bitwise_equal(scales, ref_s, "scales")
    torch.library.opcheck(torch.ops.moe_fp4.mxfp4_rows_expand_fp8_blockwise.default, (rows, h, slots, num_rows))


def _fill_in_blocks(rows, h, slots, num_rows, cut):
    """The expansion written into one preset output by two calls (rows [0, cut) then [cut, n)): the
    rows named by no slot must keep the preset bytes."""
    dev = rows.device
    data = torch.randint(0, 256, (num_rows + 3, h), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    scales = torch.rand(num_rows + 3, h // 128, device=dev)
    before_d, before_s = data[num_rows:].clone(), scales[num_rows:].clone()
    out = (data, scales)
    assert ops.mxfp4_rows_expand_fp8_blockwise(rows[:cut], h, slots[:cut], out=out)[0] is data
    ops.mxfp4_rows_expand_fp8_blockwise(rows[cut:], h, slots[cut:], num_rows + 3, out=out)
    assert_bitwise_equal(data[num_rows:], before_d, "unnamed data rows")
    assert_bitwise_equal(scales[num_rows:], before_s, "unnamed scale rows")
    return data[:num_rows], scales[:num_rows]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_expansion_into_a_given_output_by_blocks(device):
    n, h = 301 if device == "cuda" else 41, 2048 if device == "cuda" else 256
    rows = _mxfp4_rows(n, h, device, special=True)
    slots, num_rows, token = _routing(n, 8, 64, 24, device)
    data, scales = _fill_in_blocks(rows, h, slots, num_rows, cut=n // 3)
    ref_d, ref_s = _expected(rows, h, token)
    assert_bitwise_equal(data, ref_d, "data")
    assert_bitwise_equal(scales, ref_s, "scales")
    out = (torch.empty(num_rows, h, dtype=torch.float8_e4m3fn, device=device),
           torch.empty(num_rows, h // 128, device=device))
    with pytest.raises(ValueError, match="num_rows"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, num_rows + 1, out=out)
    with pytest.raises(ValueError, match=r"out\[0\]"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, out=(out[0].view(torch.uint8), out[1]))
    with pytest.raises(ValueError, match=r"out\[0\]"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, out=(out[0][:, :128], out[1]))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, out=(out[0], out[1][1:]))
    with pytest.raises(ValueError, match="out"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, out=out[0])
    # the rows that name an output row copied in the same pass (the others left as they were): into a
    # tensor, a view with 4-byte aligned rows, and without out
    masked = slots.clone()
    masked[[1, n // 2]] = -1  # rows that name no output row (a slice of a dispatch masks the others so)
    named = ((masked >= 0) & (masked < num_rows)).any(dim=1)
    want_copy = torch.where(named.unsqueeze(1), rows, torch.full_like(rows, 0x33))
    out_named = named[token]  # output rows whose token still names them
    wide = torch.full((n, rows.shape[1] + 4), 0x33, dtype=torch.uint8, device=device)
    for copy in (torch.full_like(rows, 0x33), wide[:, 4:]):
        d2, s2 = ops.mxfp4_rows_expand_fp8_blockwise(rows, h, masked, out=(torch.empty_like(data),
                                                                            torch.empty_like(scales)), copy_to=copy)
        assert_bitwise_equal(copy, want_copy, "copied rows")
        assert_bitwise_equal(d2[out_named], ref_d[out_named], "data with a copy")
        assert_bitwise_equal(s2[out_named], ref_s[out_named], "scales with a copy")
    assert bool((wide[:, :4] == 0x33).all()), "bytes beside the copied rows were written"
    copy = torch.full_like(rows, 0x33)
    d3, _ = ops.mxfp4_rows_expand_fp8_blockwise(rows, h, masked, num_rows, copy_to=copy)
    assert_bitwise_equal(copy, want_copy, "copied rows, new output")
    assert_bitwise_equal(d3[out_named], ref_d[out_named], "data, new output with a copy")
    with pytest.raises(ValueError, match="copy_to"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, num_rows, copy_to=copy[1:])
    # rows copied to rows named by copy_rows (some out of range: skipped), into a taller tensor
    perm = torch.randperm(n + 3, device=device)[:n]
    perm[0] = n + 50
    tall = torch.full((n + 3, rows.shape[1]), 0x44, dtype=torch.uint8, device=device)
    ops.mxfp4_rows_expand_fp8_blockwise(rows, h, masked, num_rows, copy_to=tall, copy_rows=perm)
    want_tall = torch.full_like(tall, 0x44)
    take = named.clone()
    take[0] = False
    want_tall[perm[take]] = rows[take]
    assert_bitwise_equal(tall, want_tall, "rows copied by copy_rows")
    with pytest.raises(ValueError, match="copy_rows"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, num_rows, copy_rows=perm)
    with pytest.raises(ValueError, match="copy_rows"):
        ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, num_rows, copy_to=tall, copy_rows=perm[1:])
    plain = _mxfp4_rows(n, h, device)
    # (opcheck's schema test compares mutated tensors with arithmetic float8 lacks; the mutation itself is
    # checked above: named rows written, the others kept)
    torch.library.opcheck(torch.ops.moe_fp4.mxfp4_rows_expand_fp8_blockwise_into.default,
                          (plain, h, slots, *out, None, None),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device,blocks", [("cpu", None),
                                           pytest.param("cuda", None, marks=pytest.mark.gpu),
                                           pytest.param("cuda", 3, marks=pytest.mark.gpu)])
def test_push_with_expansion_of_one_destination(device, blocks):
    """quantize_mxfp4_rows_multi with fp8_out: every destination gets the spec's byte rows, and the
    rows stored to fp8_dest also land, converted, in their expert rows (the dispatch's own rows)."""
    t, h = (1500, 7168) if device == "cuda" else (40, 256)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = (torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-8, 8, (t, 1), generator=g).float()))
    x[0, :32] = float("nan")  # a NaN block: its group's scale is NaN, its data zero
    x = x.to(device, torch.bfloat16)
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    width = want.shape[1]
    peer_rows = torch.randperm(t + 5, generator=g)[:t].to(device)
    peer_rows[torch.rand(t, generator=g).to(device) < 0.2] = -1  # tokens the peer does not take
    own_rows = torch.randperm(t, generator=g).to(device)  # every own row written
    rows = torch.stack((peer_rows, own_rows), dim=1).contiguous()
    dests = [torch.full((t + 5, width), 0x5A, dtype=torch.uint8, device=device),
             torch.full((t, width), 0xA5, dtype=torch.uint8, device=device)]
    slots, num_rows, own_of_out = _routing(t, 8, 64, 24, device)
    data = torch.randint(0, 256, (num_rows + 2, h), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    scales = torch.rand(num_rows + 2, h // 128, device=device)
    kept_d, kept_s = data[num_rows:].clone(), scales[num_rows:].clone()
    ops.quantize_mxfp4_rows_multi(x, dests, rows, max_blocks=blocks, fp8_dest=1, fp8_slots=slots,
                                  fp8_out=(data, scales))
    keep = peer_rows >= 0
    assert_bitwise_equal(dests[0][peer_rows[keep]], want[keep], "peer rows")
    assert_bitwise_equal(dests[1][own_rows], want, "own rows")
    ref_d, ref_s = _expected(dests[1], h, own_of_out)
    assert_bitwise_equal(data[:num_rows], ref_d, "expert rows data")
    assert_bitwise_equal(scales[:num_rows], ref_s, "expert rows scales")
    assert_bitwise_equal(data[num_rows:], kept_d, "rows no slot names")
    assert_bitwise_equal(scales[num_rows:], kept_s, "scales no slot names")
    with pytest.raises(ValueError, match="fp8_dest"):
        ops.quantize_mxfp4_rows_multi(x, dests, rows, fp8_dest=2, fp8_slots=slots, fp8_out=(data, scales))
    with pytest.raises(ValueError, match="fp8_slots"):
        ops.quantize_mxfp4_rows_multi(x, dests, rows, fp8_dest=0, fp8_slots=slots, fp8_out=(data, scales))
    with pytest.raises(ValueError, match="fp8_out"):
        ops.quantize_mxfp4_rows_multi(x, dests, rows, fp8_dest=1, fp8_slots=slots, fp8_out=data)
