"""moe_fp4.ops on CPU: the fallbacks equal the spec, argument errors, fake shapes, opcheck."""

import pytest
import torch
from _compare import assert_bitwise_equal, random_splits

from moe_fp4 import formats, ops
from moe_fp4.ops import _ops


def _x(t, h, dtype=torch.bfloat16):
    x = torch.randn(t, h) * torch.exp2(torch.randint(-20, 20, (t, 1)).float())
    if t > 2 and h >= 64:
        x[0, :32] = float("nan")
        x[1, 3] = float("-inf")
        x[2, 32:64] = 0
    return x.to(dtype)


def _u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8)


def _mxfp4(t, h):
    packed = torch.randint(0, 256, (t, h // 2), dtype=torch.uint8)
    scales = torch.randint(100, 150, (t, h // 32), dtype=torch.uint8)
    if t > 3:
        scales[0, 0] = 0xFF
        scales[1] = torch.randint(0, 255, (h // 32,), dtype=torch.uint8)  # wide spread: underflows
        scales[2, 0] = 254
    return packed, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rounding", ["up", "down"])
def test_quantize_mxfp4_equals_spec(dtype, rounding):
    x = _x(9, 96, dtype)
    p, s = ops.quantize_mxfp4(x, scale_rounding=rounding)
    pr, sr = formats.quantize_mxfp4(x, scale_rounding=rounding)
    assert_bitwise_equal(p, pr, "packed")
    assert_bitwise_equal(s, sr, "scales")


def test_quantize_mxfp4_rows_in_order_and_at_rows():
    x = _x(7, 256)
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    assert_bitwise_equal(ops.quantize_mxfp4_rows(x), want, "rows")
    out = torch.full((12, want.shape[1]), 0xAB, dtype=torch.uint8)
    index = torch.randperm(12)[:7]
    assert ops.quantize_mxfp4_rows(x, out=out, row_index=index) is out
    assert_bitwise_equal(out[index], want, "rows at row_index")
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[index] = False
    assert bool((out[untouched] == 0xAB).all()), "rows no token targets must stay untouched"
    out2 = torch.zeros(7, want.shape[1], dtype=torch.uint8)
    ops.quantize_mxfp4_rows(x, out=out2)
    assert_bitwise_equal(out2, want, "rows in order into out")


def test_quantize_mxfp4_rows_skips_out_of_range_rows():
    x = _x(3, 64)
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    out = torch.zeros(4, want.shape[1], dtype=torch.uint8)
    ops.quantize_mxfp4_rows(x, out=out, row_index=torch.tensor([2, 9, -1]))
    assert_bitwise_equal(out[2], want[0], "row 2")
    assert int(out[[0, 1, 3]].sum()) == 0


def _segments_reference(packed, scales, lens, offs):
    """Per-segment spec calls, rows outside every segment zero."""
    n, h = packed.shape[0], packed.shape[1] * 2
    data = torch.zeros(n, h, dtype=torch.uint8)
    sc = torch.zeros(n, h // 128)
    total = 0
    for o, ln in zip(offs.tolist(), lens.tolist()):
        if ln:
            d, s, u = formats.mxfp4_to_fp8_blockwise(packed[o:o + ln], scales[o:o + ln])
            data[o:o + ln], sc[o:o + ln] = d.view(torch.uint8), s
            total += int(u)
    return data.view(torch.float8_e4m3fn), sc, torch.tensor(total)


def test_mxfp4_to_fp8_blockwise_equals_spec():
    packed, scales = _mxfp4(11, 256)
    for got, want, what in zip(ops.mxfp4_to_fp8_blockwise(packed, scales),
                               formats.mxfp4_to_fp8_blockwise(packed, scales), ("data", "scales", "underflow")):
        assert_bitwise_equal(got, want, what)


@pytest.mark.parametrize("with_offsets", [False, True])
def test_mxfp4_to_fp8_blockwise_with_splits(with_offsets):
    packed, scales = _mxfp4(20, 256)
    lens = torch.tensor([4, 0, 1, 6])
    offs = torch.tensor([13, 0, 2, 5]) if with_offsets else formats.split_offsets(lens)
    want = _segments_reference(packed, scales, lens, offs)
    got = ops.mxfp4_to_fp8_blockwise(packed, scales, lens, offs if with_offsets else None)
    for g, w, what in zip(got, want, ("data", "scales", "underflow")):
        assert_bitwise_equal(g, w, what)
    rows = formats.pack_mxfp4_rows(packed, scales)
    got = ops.mxfp4_rows_to_fp8_blockwise(rows, 256, lens, offs if with_offsets else None)
    for g, w, what in zip(got, want, ("data", "scales", "underflow")):
        assert_bitwise_equal(g, w, "byte rows " + what)


def test_mxfp4_rows_to_fp8_cols_equals_spec():
    packed, scales = _mxfp4(300, 128)
    lens = torch.tensor([130, 0, 1, 129, 3], dtype=torch.int32)
    offs = torch.tensor([0, 130, 297, 131, 260], dtype=torch.int32)
    for o in (None, offs):
        got = ops.mxfp4_rows_to_fp8_cols(packed, scales, lens, o)
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens, o)
        for g, w, what in zip(got, want, ("data", "scales", "group_offsets")):
            assert_bitwise_equal(g, w, what)
        assert got[1].stride() == want[1].stride() == (1, 128)  # outer-dim-major [H, G]
        assert got[0].stride() == want[0].stride() == (320, 1)  # rows padded to 32 bytes


def test_quantize_fp8_blockwise_equals_spec():
    x = _x(5, 256)
    for g, w, what in zip(ops.quantize_fp8_blockwise(x), formats.quantize_fp8_blockwise(x, block=(1, 128)),
                          ("data", "scales")):
        assert_bitwise_equal(g, w, what)


def test_dequantize_mxfp4_equals_spec():
    packed, scales = _mxfp4(6, 256)
    scales[0, 1] = 0xFF  # a NaN block
    scales[1, 0] = 254  # overflow to +-inf
    scales[2, :] = 0  # subnormal values
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert_bitwise_equal(ops.dequantize_mxfp4(packed, scales, dtype=dtype),
                             formats.dequantize_mxfp4(packed, scales, dtype=dtype), str(dtype))
    got = ops.dequantize_mxfp4(packed.reshape(2, 3, 128), scales.reshape(2, 3, 8))
    assert got.shape == (2, 3, 256) and got.dtype == torch.bfloat16
    assert_bitwise_equal(got.reshape(6, 256), ops.dequantize_mxfp4(packed, scales), "3-D")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.quantize_mxfp4(torch.zeros(2, 64, dtype=torch.int32)), "x: expected dtype"),
        (lambda: ops.quantize_mxfp4(torch.zeros(64)), "x: expected 2 dimension"),
        (lambda: ops.quantize_mxfp4(torch.zeros(2, 48)), "x: last dimension .48. must be a multiple of 32"),
        (lambda: ops.quantize_mxfp4(torch.zeros(2, 64), scale_rounding="nearest"), "scale_rounding"),
        (lambda: ops.quantize_mxfp4(torch.zeros(64, 2).t()), "x: expected a contiguous last dimension"),
        (lambda: ops.quantize_mxfp4_rows(torch.zeros(2, 64), row_index=torch.tensor([0, 1])), "out: required"),
        (lambda: ops.quantize_mxfp4_rows(torch.zeros(2, 64), out=torch.zeros(2, 33, dtype=torch.uint8)),
         "out: expected 34 bytes per row"),
        (lambda: ops.quantize_mxfp4_rows(torch.zeros(3, 64), out=torch.zeros(2, 34, dtype=torch.uint8)),
         "out: expected at least 3 rows"),
        (lambda: ops.quantize_mxfp4_rows(torch.zeros(2, 64), out=torch.zeros(2, 34, dtype=torch.uint8),
                                         row_index=torch.tensor([0])), "row_index: expected shape"),
        (lambda: ops.quantize_mxfp4_rows(torch.zeros(2, 64), out=torch.zeros(2, 34, dtype=torch.uint8),
                                         row_index=torch.tensor([0.0, 1.0])), "row_index: expected dtype"),
        (lambda: ops.mxfp4_to_fp8_blockwise(_u8(2, 64), _u8(2, 3)),
         "scales: expected shape"),
        (lambda: ops.mxfp4_to_fp8_blockwise(_u8(2, 48), _u8(2, 3)),
         "packed: hidden size 96"),
        (lambda: ops.mxfp4_to_fp8_blockwise(torch.zeros(2, 64), _u8(2, 4)),
         "packed: expected dtype"),
        (lambda: ops.mxfp4_to_fp8_blockwise(_u8(2, 64), _u8(2, 4),
                                            None, torch.tensor([0])), "split_offsets: given without split_lens"),
        (lambda: ops.mxfp4_to_fp8_blockwise(_u8(2, 64), _u8(2, 4),
                                            torch.tensor([1]), torch.tensor([0], dtype=torch.int32)),
         "split_offsets: expected dtype"),
        (lambda: ops.mxfp4_to_fp8_blockwise(_u8(2, 64), _u8(2, 4),
                                            torch.tensor([1.0])), "split_lens: expected dtype"),
        (lambda: ops.mxfp4_rows_to_fp8_blockwise(torch.zeros(2, 51, dtype=torch.uint8), 96), "hidden: expected"),
        (lambda: ops.mxfp4_rows_to_fp8_blockwise(torch.zeros(2, 67, dtype=torch.uint8), 128), "rows: expected 68"),
        (lambda: ops.mxfp4_rows_to_fp8_cols(_u8(2, 64), _u8(2, 4),
                                            None), "split_lens: expected"),
        (lambda: ops.mxfp4_rows_to_fp8_cols(_u8(2, 64), _u8(2, 4),
                                            torch.tensor([3])), "split_lens: segments cover 3 rows"),
        (lambda: ops.quantize_fp8_blockwise(torch.zeros(2, 96)), "x: last dimension .96. must be a multiple of 128"),
        (lambda: ops.dequantize_mxfp4(_u8(2, 64), _u8(2, 3)), "scales: expected shape"),
        (lambda: ops.dequantize_mxfp4(_u8(2, 8), _u8(2, 0)), "scales: expected shape"),
        (lambda: ops.dequantize_mxfp4(torch.zeros(2, 64), _u8(2, 4)), "packed: expected dtype"),
        (lambda: ops.dequantize_mxfp4(_u8(2, 64), _u8(2, 4), dtype=torch.int32), "dtype: expected one of"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(6, 256, dtype=torch.bfloat16)
        p, s = ops.quantize_mxfp4(x)
        assert (p.shape, s.shape, p.dtype) == ((6, 128), (6, 8), torch.uint8)
        assert ops.quantize_mxfp4_rows(x).shape == (6, 136)
        d, sc, u = ops.mxfp4_to_fp8_blockwise(p, s)
        assert (d.shape, d.dtype, sc.shape) == ((6, 256), torch.float8_e4m3fn, (6, 2))
        assert (u.shape, u.dtype) == ((), torch.int64)
        d, sc, u = ops.mxfp4_rows_to_fp8_blockwise(torch.empty(6, 136, dtype=torch.uint8), 256)
        assert (d.shape, sc.shape) == ((6, 256), (6, 2))
        lens = torch.empty(3, dtype=torch.int64)
        d, sc, go = _ops.mxfp4_rows_to_fp8_cols_op(p, s, lens, None)
        assert d.shape == (256, 6) and d.stride() == (32, 1) and sc.shape[0] == 256 and sc.stride() == (1, 256)
        assert go.shape == (4,)
        q, qs = ops.quantize_fp8_blockwise(x)
        assert (q.shape, q.dtype, qs.shape) == ((6, 256), torch.float8_e4m3fn, (6, 2))
        v = ops.dequantize_mxfp4(p, s)
        assert (v.shape, v.dtype) == ((6, 256), torch.bfloat16)


def test_call_skips_the_dispatch_only_in_plain_eager_mode(monkeypatch):
    """_ops.call runs an op's implementation directly for plain tensors outside torch.compile and any
    torch function or dispatch mode, and through the custom op otherwise (its fake under tracing);
    either way the results equal the spec's, and a mutated argument's version counter moves."""
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    want = formats.quantize_mxfp4(x)
    fn, mutated = _ops._IMPL[_ops.quantize_mxfp4_op]
    direct = []
    monkeypatch.setitem(_ops._IMPL, _ops.quantize_mxfp4_op, (lambda *a: direct.append(1) or fn(*a), mutated))
    for got, w in zip(ops.quantize_mxfp4(x), want):
        assert_bitwise_equal(got, w, "eager")
    assert direct == [1]

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        got = ops.quantize_mxfp4(x)
    assert direct == [1] and any("moe_fp4.quantize_mxfp4" in n or "moe_fp4::quantize_mxfp4" in n
                                 for n in Seen.names), Seen.names
    with torch.device("cpu"):  # a torch function mode
        ops.quantize_mxfp4(x)
    assert direct == [1]
    compiled = torch.compile(lambda v: ops.quantize_mxfp4(v), backend="aot_eager", fullgraph=True)
    for got, w in zip(compiled(x), want):
        assert_bitwise_equal(got, w, "compiled")
    assert direct == [1]
    out = _u8(8, 136)
    before = out._version
    ops.quantize_mxfp4_rows(x, out=out, row_index=torch.tensor([7, 0, 2, 1, 5, 3]))
    assert out._version > before


def test_opcheck_cpu():
    x = torch.randn(4, 128, dtype=torch.bfloat16)  # finite: opcheck compares outputs with NaN != NaN
    packed, scales = formats.quantize_mxfp4(x)
    rows = formats.pack_mxfp4_rows(packed, scales)
    lens = torch.tensor([1, 0, 3])
    cases = [
        (_ops.quantize_mxfp4_op, (x, "up")),
        (_ops.quantize_mxfp4_rows_op, (x, "down")),
        (_ops.quantize_mxfp4_rows_into_op, (x, "up", _u8(5, 68), torch.tensor([4, 0, 2, 1]))),
        (_ops.mxfp4_to_fp8_blockwise_op, (packed, scales, lens, None)),
        (_ops.mxfp4_rows_to_fp8_blockwise_op, (rows, 128, None, None)),
        (_ops.mxfp4_rows_to_fp8_cols_op, (packed, scales, lens, None)),
        (_ops.quantize_fp8_blockwise_op, (x,)),
        (_ops.dequantize_mxfp4_op, (packed, scales, torch.bfloat16)),
        (_ops.scatter_rows_op, (rows, [_u8(5, 68), _u8(3, 68)], torch.tensor([[4, 0], [-1, 2], [0, 1], [2, 3]]), 0)),
        (_ops.quantize_mxfp4_rows_multi_op, (x, "down", [_u8(6, 68)], torch.tensor([[5], [0], [-1], [3]]), 1, -1,
                                             None, None, None)),
        (_ops.quantize_fp8_blockwise_rows_multi_op, (x, [_u8(4, 132), _u8(2, 132)],
                                                     torch.tensor([[3, 1], [2, -1], [1, 0], [0, 5]]), 0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_native_unavailable_on_cpu_build():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert ops.native_available() is False
    with pytest.raises(RuntimeError, match="cannot be built"):
        ops.build()
    import importlib

    assert importlib.import_module("moe_fp4.ops.build").main([]) == 1
    assert callable(ops.build)


def test_column_plan_groups_path_and_validation():
    """The column op's host plan: G = sum ceil(len/128), one pass only when every non-empty segment
    starts on a 16-row boundary, and the splits validated as formats.check_splits does."""
    from moe_fp4.ops._ops import column_plan

    lens = torch.tensor([0, 32, 256, 129, 0, 64])
    assert column_plan(lens, None, 600) == (0 + 1 + 2 + 2 + 0 + 1, True, False)  # 129: the next starts at 417
    assert column_plan(torch.tensor([32, 256, 128, 0, 64]), None, 480) == (5, False, False)
    offs = torch.tensor([7, 64, 320, 600, 480])
    assert column_plan(torch.tensor([32, 256, 128, 0, 64]), offs, 600) == (5, True, False)  # 7: off the boundary
    offs32 = torch.tensor([0, 64, 320, 3, 544], dtype=torch.int32)
    assert column_plan(torch.tensor([32, 256, 128, 0, 56], dtype=torch.int32), offs32, 600) == (5, False, False)
    # full groups: back to back from row 0, every length a multiple of 128 (empty segments anywhere)
    assert column_plan(torch.tensor([256, 0, 128, 512]), None, 1000) == (7, False, True)
    full_offs = torch.tensor([0, 999, 256, 384])  # the empty segment's offset is not a row of it
    assert column_plan(torch.tensor([256, 0, 128, 512]), full_offs, 1000) == (7, False, True)
    assert column_plan(torch.tensor([256, 128]), torch.tensor([0, 384]), 600) == (3, False, False)  # a gap
    assert column_plan(torch.tensor([256, 128]), torch.tensor([128, 0]), 600) == (3, False, False)  # reordered
    assert column_plan(torch.tensor([256, 96]), None, 600) == (3, False, False)  # 96: not a whole group
    assert column_plan(torch.tensor([16, 32, 5]), None, 60) == (3, False, False)  # starts 0, 16, 48: one pass
    assert column_plan(torch.tensor([8, 32]), None, 60) == (2, True, False)  # a start at 8: two passes
    with pytest.raises(ValueError, match="split_lens"):
        column_plan(torch.tensor([300, 301]), None, 600)
    with pytest.raises(ValueError, match="overlap"):
        column_plan(torch.tensor([100, 100]), torch.tensor([0, 50]), 600)
    with pytest.raises(ValueError, match="split_offsets"):
        column_plan(torch.tensor([100, 100]), torch.tensor([0, 50, 7]), 600)
    with pytest.raises(ValueError, match="split_offsets"):
        column_plan(torch.tensor([100, 100]), torch.tensor([0, 550]), 600)


def test_host_splits_are_lengths_then_first_rows():
    """The column op's host read of the splits: lengths, then first rows (the offsets given, or back to
    back), as integers and as the int64 [2, E] tensor the native op takes; random lengths and offsets."""
    from moe_fp4.ops._ops import _host_splits, _splits_tensor

    for _ in range(5):
        lens, offs = random_splits(9, 400)
        n = int(lens.sum()) + 5
        for o, starts in ((None, torch.cumsum(lens, 0) - lens), (offs, offs)):
            assert _host_splits(lens, o, n) == (lens.tolist(), starts.tolist())
            assert _host_splits(lens.to(torch.int32), None if o is None else o.to(torch.int32), n) == (
                lens.tolist(), starts.tolist())
            got = _splits_tensor(lens.tolist(), starts.tolist())
            assert got.dtype == torch.int64 and got.device.type == "cpu" and got.shape == (2, 9)
            assert torch.equal(got[0], lens) and torch.equal(got[1], starts)
    # its own buffer each call (the op copies it to the device), contiguous; none for no experts
    a, b = _splits_tensor([5, 1], [0, 5]), _splits_tensor([6, 2], [1, 7])
    assert a.is_contiguous() and a.tolist() == [[5, 1], [0, 5]] and b.tolist() == [[6, 2], [1, 7]]
    assert _splits_tensor([], []).shape == (2, 0)


def test_column_op_traces_with_a_symbolic_token_count():
    """torch.compile (full graph, dynamic shapes) traces the column op through its fake for a symbolic N:
    the padded row stride is an expression of N, and the results equal the spec for several N."""
    compiled = torch.compile(lambda p, s, lens: _ops.mxfp4_rows_to_fp8_cols_op(p, s, lens, None),
                             backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (33, 70, 96):
        packed, scales = _mxfp4(n, 128)
        lens = torch.tensor([n - 20, 0, 20])
        got = compiled(packed, scales, lens)
        want = formats.mxfp4_rows_to_fp8_cols(packed, scales, lens)
        for g, w, what in zip(got, want, ("data", "scales", "group_offsets")):
            assert_bitwise_equal(g, w, f"N={n} {what}")
        assert got[0].stride() == (formats.fp8_cols_row_stride(n), 1)


def test_column_launch_passes_the_table_on_32_row_starts():
    """The op's native arguments: column_plan's three and the host splits (from which the launcher
    derives the group table) only for a one-pass plan of groups that are not full ones, every segment
    starting on a 32-row boundary."""
    from moe_fp4.ops._ops import column_launch, column_plan

    lens = torch.tensor([64, 0, 32, 96, 7])
    got = column_launch(lens, None, 200)
    assert got[:3] == column_plan(lens, None, 200) == (4, False, False)
    assert torch.equal(got[3], torch.tensor([[64, 0, 32, 96, 7], [0, 64, 64, 96, 192]]))
    assert column_launch(torch.tensor([48, 80]), None, 200)[3] is None  # a start at 16 mod 32
    assert column_launch(torch.tensor([8, 32]), None, 200)[3] is None  # two passes
    assert column_launch(torch.tensor([256, 128]), None, 400)[3] is None  # full groups
