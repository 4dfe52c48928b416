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
