"""The experts' FP8 grouped GEMM reference (moe_fp4.moe.grouped_gemm_fp8) against a float64 product of
the dequantized operands: ragged, empty and gapped groups, the layout of a real dispatch with
expert_alignment, rows of no group zero, bad arguments rejected by name."""

import pytest
import torch

from moe_fp4 import formats
from moe_fp4.ep import Buffer
from moe_fp4.moe import grouped_gemm_fp8

SEED = 3030
K, N = 384, 256


def _operands(m: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    w = torch.randn(g, N, K, generator=gen) * 0.05
    a, a_s = formats.quantize_fp8_blockwise(x, block=(1, 128))
    wq, w_s = formats.quantize_fp8_blockwise(w, block=(128, 128))
    return a, a_s, wq, w_s


def _reference(a, a_s, w, w_s, offsets, lens):
    """float64 [M, N] product per group (zeros elsewhere) and the bound of a float32 accumulation."""
    x = formats.dequantize_fp8_blockwise(a, a_s).double()
    wt = formats.dequantize_fp8_blockwise(w, w_s, block=(128, 128)).double()
    ref = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for e, (o, c) in enumerate(zip(offsets, lens)):
        ref[o:o + c] = x[o:o + c] @ wt[e].t()
        mag[o:o + c] = x[o:o + c].abs() @ wt[e].abs().t()
    return ref, mag


def _check(out, ref, mag, what):
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    # bfloat16 rounding (half an ulp: 2^-9 relative) plus a float32 sum of K products
    bound = ref.abs() * 2.0 ** -8 + mag * K * 2.0 ** -23
    worst = (err - bound).max()
    assert bool(worst <= 0), f"{what}: error exceeds the bound by {float(worst)}"


@pytest.mark.parametrize("layout", ["ragged", "empty", "gapped", "single"])
def test_grouped_gemm_matches_float64(layout):
    lens = {"ragged": [5, 17, 1, 9], "empty": [0, 12, 0, 7], "gapped": [6, 3, 10, 2], "single": [30, 0, 0, 0]}[layout]
    if layout == "gapped":  # groups with rows between them and rows after the last
        offsets = [2, 12, 16, 30]
    else:
        offsets = [sum(lens[:e]) for e in range(4)]
    m = max(o + c for o, c in zip(offsets, lens)) + 3
    a, a_s, w, w_s = _operands(m, 4, SEED + len(layout))
    out = grouped_gemm_fp8(a, a_s, w, w_s, torch.tensor(offsets), torch.tensor(lens))
    ref, mag = _reference(a, a_s, w, w_s, offsets, lens)
    _check(out, ref, mag, layout)
    covered = torch.zeros(m, dtype=torch.bool)
    for o, c in zip(offsets, lens):
        covered[o:o + c] = True
    assert int(out[~covered].count_nonzero()) == 0  # rows of no group: zero
    assert int(out[covered].count_nonzero()) > 0


def test_grouped_gemm_on_dispatch_output():
    """The FP8 expert rows of a dispatch with expert_alignment, their device splits, local experts' weights."""
    torch.manual_seed(SEED)
    experts, t, k = 4, 40, 2
    buf = Buffer(experts, payload="mxfp4")
    x = torch.randn(t, K)
    idx = torch.randn(t, experts).topk(k, dim=1).indices
    out = buf.dispatch(x, idx, torch.rand(t, k), return_fp8=True, expert_alignment=32)
    _, _, w, w_s = _operands(1, experts, SEED + 1)
    a, a_s = out.fp8
    y = grouped_gemm_fp8(a, a_s, w, w_s, out.split_offsets, out.split_lens)
    assert y.shape == (out.handle.num_rows, N)
    ref, mag = _reference(a, a_s, w, w_s, out.split_offsets.tolist(), out.split_lens.tolist())
    _check(y, ref, mag, "dispatch output")
    assert int(y[out.handle.gap_rows].count_nonzero()) == 0


def test_grouped_gemm_bad_arguments():
    a, a_s, w, w_s = _operands(16, 2, SEED)
    offs, lens = torch.tensor([0, 8]), torch.tensor([8, 8])
    cases = [
        (dict(a=a.float()), "a"),
        (dict(a=a[:, :200]), "a"),
        (dict(w=w[:, :, :256], w_s=w_s[:, :, :2]), "w"),
        (dict(w=w[:, :200]), "w"),
        (dict(a_s=a_s[:, :2]), "a_scales"),
        (dict(w_s=w_s.double()), "w_scales"),
        (dict(offs=offs.float()), "split_offsets"),
        (dict(lens=torch.tensor([8, 8, 0])), "split_lens"),
        (dict(offs=torch.tensor([0, 12])), "outside"),
        (dict(offs=torch.tensor([0, 4])), "overlap"),
        (dict(lens=torch.tensor([8, -1])), "outside"),
    ]
    for change, word in cases:
        args = dict(a=a, a_s=a_s, w=w, w_s=w_s, offs=offs, lens=lens) | change
        with pytest.raises(ValueError, match=word):
            grouped_gemm_fp8(args["a"], args["a_s"], args["w"], args["w_s"], args["offs"], args["lens"])


def _cols_float64(cols, scales, lo, hi, base):
    blocks = -(-(hi - lo) // 128)
    s = scales[:, base:base + blocks].double().repeat_interleave(128, dim=1)[:, :hi - lo]
    return cols[:, lo:hi].double() * s


def _wgrad_case(lens, seed, h=256, n=384):
    """Aligned groups (starts on multiples of 128, gaps after ragged ends) of dy [M, n] and x [M, h]."""
    offsets, at = [], 0
    for c in lens:
        offsets.append(at)
        at += -(-c // 128) * 128
    m = at + 128
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-5, 5, (m, 1), generator=gen).float())
    dy = (torch.randn(m, n, generator=gen) * scale).bfloat16()
    x = (torch.randn(m, h, generator=gen) / scale).bfloat16()
    return dy, x, offsets, m


@pytest.mark.parametrize("lens", [[130, 0, 256, 1], [5, 300], [0, 0, 0]])
def test_wgrad_matches_float64(lens):
    from moe_fp4 import ops
    from moe_fp4.moe import grouped_gemm_fp8_wgrad

    dy, x, offsets, m = _wgrad_case(lens, SEED + sum(lens))
    _, _, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy)
    _, _, x_t, x_ts = ops.quantize_fp8_rows_cols(x)
    offs, ls = torch.tensor(offsets), torch.tensor(lens)
    out = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls)
    assert out.dtype == torch.float32 and out.shape == (len(lens), dy.shape[1], x.shape[1])
    for e, (o, c) in enumerate(zip(offsets, lens)):
        if c == 0:
            assert int(out[e].count_nonzero()) == 0
            continue
        a = _cols_float64(dy_t, dy_ts, o, o + c, o // 128)
        b = _cols_float64(x_t, x_ts, o, o + c, o // 128)
        ref, mag = a @ b.t(), a.abs() @ b.abs().t()
        err = (out[e].double() - ref).abs()
        assert bool((err <= mag * c * 2.0 ** -23 + 1e-30).all()), f"group {e}: max error {float(err.max())}"
        assert int(out[e].count_nonzero()) > 0
    again = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls, out=out.clone())  # accumulation
    assert torch.equal(again, out * 2)
    bf16 = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls, out_dtype=torch.bfloat16)
    assert torch.equal(bf16, out.bfloat16())  # float32 sums, rounded once


def test_wgrad_mxfp4_columns_with_group_scale_offsets():
    """The expert input's wgrad operand straight from MXFP4 rows (FP4RowToFP8Col, scales per expert)."""
    from moe_fp4 import ops
    from moe_fp4.moe import grouped_gemm_fp8_wgrad

    lens = [200, 0, 129]
    dy, x, offsets, m = _wgrad_case(lens, SEED + 7)
    offs, ls = torch.tensor(offsets), torch.tensor(lens)
    packed, mx_scales = ops.quantize_mxfp4(x)
    x_t, x_ts, goff = ops.mxfp4_rows_to_fp8_cols(packed, mx_scales, ls, offs)
    _, _, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy)
    out = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls, b_scale_offsets=goff[:-1])
    xd = formats.dequantize_mxfp4(packed, mx_scales).double()
    for e, (o, c) in enumerate(zip(offsets, lens)):
        if c == 0:
            continue
        a = _cols_float64(dy_t, dy_ts, o, o + c, o // 128)
        b = _cols_float64(x_t, x_ts, o, o + c, int(goff[e]))
        ref = a @ b.t()
        assert float((out[e].double() - ref).abs().max()) <= float(ref.abs().max()) * 2.0 ** -18
        # and the FP8 columns hold the MXFP4 rows within FP8's rounding
        rel = (a @ xd[o:o + c] - ref).norm() / ref.norm()  # (dy^T x through the MXFP4 values directly)
        assert float(rel) < 0.06


def test_wgrad_bad_arguments():
    from moe_fp4 import ops
    from moe_fp4.moe import grouped_gemm_fp8_wgrad

    dy, x, offsets, m = _wgrad_case([130, 10], SEED)
    _, _, a, a_s = ops.quantize_fp8_rows_cols(dy)
    _, _, b, b_s = ops.quantize_fp8_rows_cols(x)
    offs, lens = torch.tensor(offsets), torch.tensor([130, 10])
    cases = [
        (dict(offs=torch.tensor([0, 208])), "multiple of 128"),
        (dict(offs=torch.tensor([0, 200]), a_base=torch.tensor([0, 1]), b_base=torch.tensor([0, 1])),
         "multiple of 16"),
        (dict(a=a.float()), "a_cols"),
        (dict(b=b[:200]), "b_cols"),
        (dict(a_s=a_s[:, :1].double()), "a_scales"),
        (dict(lens=torch.tensor([130, 500])), "outside"),
        (dict(out=torch.zeros(2, 384, 128)), "out"),
        (dict(a_base=torch.tensor([0, 5])), "a_scale_offsets"),
        (dict(b_base=torch.tensor([0.0, 1.0])), "b_scale_offsets"),
        (dict(out_dtype=torch.float16), "out_dtype"),
    ]
    for change, word in cases:
        args = dict(a=a, a_s=a_s, b=b, b_s=b_s, offs=offs, lens=lens, a_base=None, b_base=None, out=None,
                    out_dtype=torch.float32) | change
        with pytest.raises(ValueError, match=word):
            grouped_gemm_fp8_wgrad(args["a"], args["a_s"], args["b"], args["b_s"], args["offs"], args["lens"],
                                   a_scale_offsets=args["a_base"], b_scale_offsets=args["b_base"], out=args["out"],
                                   out_dtype=args["out_dtype"])


def test_dgrad_through_transposed_weight_tiles():
    """dx = dy @ w_g through the transposed tiles of ops.quantize_fp8_tiles (a strided view, no copy)."""
    from moe_fp4 import ops

    g, n, k = 3, 256, 384
    gen = torch.Generator().manual_seed(SEED + 11)
    w = torch.randn(g, n, k, generator=gen) * 0.05
    data, scales, data_t = ops.quantize_fp8_tiles(w.reshape(g * n, k))
    w_t = data_t.view(k, g, n).permute(1, 0, 2)  # [G, K, N], unit stride along N
    s_t = scales.view(g, n // 128, k // 128).transpose(1, 2)
    lens, offsets = [40, 0, 77], [0, 40, 50]
    dy = torch.randn(130, n, generator=gen)
    d8, ds = formats.quantize_fp8_blockwise(dy)
    out = grouped_gemm_fp8(d8, ds, w_t, s_t, torch.tensor(offsets), torch.tensor(lens))
    wd = formats.dequantize_fp8_blockwise(data.view(g, n, k), scales.view(g, n // 128, k // 128), block=(128, 128))
    ref, mag = torch.zeros(130, k, dtype=torch.float64), torch.zeros(130, k, dtype=torch.float64)
    dyd = formats.dequantize_fp8_blockwise(d8, ds).double()
    for e, (o, c) in enumerate(zip(offsets, lens)):
        ref[o:o + c] = dyd[o:o + c] @ wd[e].double()
        mag[o:o + c] = dyd[o:o + c].abs() @ wd[e].double().abs()
    err = (out.double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0 ** -8 + mag * n * 2.0 ** -23).all())
    assert int(out[127:].count_nonzero()) == 0  # rows of no group


# The Triton kernels under the Triton interpreter (CPU), in a fresh process: Triton decides between
# compiling and interpreting when it is imported. Small shapes; the GPU runs are in
# test_grouped_gemm_gpu.py.
_KERNEL_CHECK = r"""
import torch
from moe_fp4 import formats, ops
from moe_fp4.moe import grouped_gemm as gg, _triton_grouped_gemm as tg
assert tg.available(torch.zeros(1))
torch.manual_seed(%d)
lens, offs = [100, 0, 130, 7], [0, 128, 128, 384]
m, k, n, g = 520, 256, 256, 4
x = torch.randn(m, k); w = torch.randn(g, n, k) * 0.05; dy = torch.randn(m, n)
a, a_s = formats.quantize_fp8_blockwise(x)
wq, w_s, w_t = ops.quantize_fp8_tiles(w.reshape(g * n, k))
wq, w_s = wq.view(g, n, k), w_s.view(g, 2, 2)
o, l = torch.tensor(offs), torch.tensor(lens)
out = gg.grouped_gemm_fp8(a, a_s, wq, w_s, o, l)
ref = gg.grouped_gemm_fp8_reference(a, a_s, wq, w_s, o, l)
assert float((out.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7, "rows"
covered = torch.zeros(m, dtype=torch.bool)
for first, count in zip(offs, lens):
    covered[first:first + count] = True
assert int(out[~covered].count_nonzero()) == 0, "rows of no group"
d8, ds, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy)
wt, wts = w_t.view(k, g, n).permute(1, 0, 2), w_s.transpose(1, 2)
out = gg.grouped_gemm_fp8(d8, ds, wt, wts, o, l)
ref = gg.grouped_gemm_fp8_reference(d8, ds, wt.contiguous(), wts.contiguous(), o, l)
assert float((out.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7, "dgrad"
_, _, x_t, x_ts = ops.quantize_fp8_rows_cols(x)
out = gg.grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, o, l)
ref = gg.grouped_gemm_fp8_wgrad_reference(dy_t, dy_ts, x_t, x_ts, o, l)
assert float((out - ref).abs().max()) <= float(ref.abs().max()) * 2 ** -18, "wgrad"
given = gg.grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, o, l, a_scale_offsets=o // 128, b_scale_offsets=o // 128)
assert torch.equal(given, out), "wgrad with the scale offsets given"
# (the columns' rows on the 16-byte grid: tensor-map loads; the same columns in rows 8 bytes longer:
# per-thread loads, the same bits)
wide = lambda t: torch.nn.functional.pad(t.view(torch.uint8), (0, 8)).view(t.dtype)[:, :t.shape[1]]
assert tg.wgrad_tma(dy_t, x_t) and not tg.wgrad_tma(wide(dy_t), wide(x_t)), "load path"
assert torch.equal(gg.grouped_gemm_fp8_wgrad(wide(dy_t), dy_ts, wide(x_t), x_ts, o, l), out), "wgrad per-thread loads"
for rows in (0, 64):  # no tokens at all (a rank that received none), fewer than one block
    _, _, c_a, c_as = ops.quantize_fp8_rows_cols(dy[:rows])
    _, _, c_b, c_bs = ops.quantize_fp8_rows_cols(x[:rows])
    c_a, c_b = c_a[:, :rows], c_b[:, :rows]  # (columns exactly as long as the tokens: no tensor map)
    assert not tg.wgrad_tma(c_a, c_b), rows
    few_o, few_l = torch.tensor([0, rows]), torch.tensor([rows, 0])
    few = gg.grouped_gemm_fp8_wgrad(c_a, c_as, c_b, c_bs, few_o, few_l)
    ref = gg.grouped_gemm_fp8_wgrad_reference(c_a, c_as, c_b, c_bs, few_o, few_l)
    assert float((few - ref).abs().max()) <= float(ref.abs().max()) * 2 ** -18, rows
none = gg.grouped_gemm_fp8_wgrad(dy_t[:0], dy_ts[:0], x_t, x_ts, o, l)  # (N = 0: nothing to compute)
assert none.shape == (g, 0, k), "wgrad with N = 0"
again = gg.grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, o, l, out=out.clone())
assert torch.equal(again, out * 2), "wgrad accumulation"
b16 = gg.grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, o, l, out_dtype=torch.bfloat16)
# (the interpreter's float32 -> bfloat16 conversion need not round to nearest: one bfloat16 step)
assert bool(((b16.float() - out).abs() <= out.abs() * 2 ** -7).all()), "wgrad bfloat16 output"
from moe_fp4.moe import _triton_swiglu as sw
y1 = (torch.randn(70, 512) * 3).bfloat16(); dh = torch.randn(70, 256).bfloat16()
gate, up = y1.float().chunk(2, -1)
ref = (torch.nn.functional.silu(gate) * up).bfloat16().float()
assert bool(((sw.swiglu(y1).float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-30).all()), "swiglu"
sig = torch.sigmoid(gate)
ref = torch.cat((dh.float() * up * sig * (1 + gate * (1 - sig)), dh.float() * gate * sig), -1).bfloat16().float()
# each row's group (-1 outside; DeepGEMM's contiguous layout): empty groups, gaps, rows past the last
gen = torch.Generator().manual_seed(torch.initial_seed() + 77)  # (the seed set above)
lens = torch.randint(0, 300, (12,), generator=gen)
lens[[0, 5, 11]] = 0
offs, at = [], 0
for c in lens.tolist():
    offs.append(at)
    at += -(-c // 128) * 128 + 128 * int(torch.randint(0, 2, (1,), generator=gen))
want = torch.full((at + 37,), -1, dtype=torch.int32)
for e, (o, c) in enumerate(zip(offs, lens.tolist())):
    want[o:o + c] = e
got = tg.row_groups(torch.tensor(offs), lens, at + 37)
assert got.dtype == torch.int32 and torch.equal(got, want), "row groups"
dy1, none = sw.swiglu_backward(dh, y1)
assert none is None and bool(((dy1.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-30).all()), "swiglu bwd"
print("@ok")
"""


def test_triton_kernels_interpreted():
    import importlib.util
    import os
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("needs Triton without a GPU (the interpreter); GPU runs are in test_grouped_gemm_gpu.py")
    root = pathlib.Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    res = subprocess.run([sys.executable, "-c", _KERNEL_CHECK % SEED], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "@ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]

