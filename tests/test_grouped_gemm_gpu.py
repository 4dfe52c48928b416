"""The Triton FP8 grouped GEMM on a GPU against the reference (moe_fp4.moe.grouped_gemm_fp8_reference):
ragged, empty and gapped groups at DeepSeek-V3 expert shapes, rows of no group zero, no host sync
with validate=False."""

import pytest
import torch

from moe_fp4 import formats
from moe_fp4.moe import grouped_gemm_fp8
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8_reference

pytestmark = pytest.mark.gpu
SEED = 3131


def _case(lens, offsets, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    m = max(o + c for o, c in zip(offsets, lens)) + 5
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen).float())
    w = torch.randn(len(lens), n, k, generator=gen) * 0.02
    a, a_s = formats.quantize_fp8_blockwise(x.cuda())
    wq, w_s = formats.quantize_fp8_blockwise(w.cuda(), block=(128, 128))
    return a, a_s, wq, w_s, torch.tensor(offsets).cuda(), torch.tensor(lens).cuda()


@pytest.mark.parametrize("k,n", [(7168, 4096), (2048, 7168), (256, 384)])
@pytest.mark.parametrize("layout", ["ragged", "gapped"])
def test_triton_grouped_gemm_matches_reference(k, n, layout):
    lens = [300, 0, 129, 1, 1000, 64, 0, 257]
    if layout == "gapped":  # aligned starts with rows between the groups
        offsets, at = [], 0
        for c in lens:
            offsets.append(at)
            at += -(-c // 128) * 128 + 128
    else:
        offsets = [sum(lens[:e]) for e in range(len(lens))]
    a, a_s, w, w_s, offs, ls = _case(lens, offsets, k, n, SEED + k + n)
    out = grouped_gemm_fp8(a, a_s, w, w_s, offs, ls)
    ref = grouped_gemm_fp8_reference(a, a_s, w, w_s, offs, ls)
    x = formats.dequantize_fp8_blockwise(a, a_s).abs()
    wt = formats.dequantize_fp8_blockwise(w, w_s, block=(128, 128)).abs()
    mag = torch.zeros_like(ref, dtype=torch.float32)
    covered = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    for e, (o, c) in enumerate(zip(offsets, lens)):
        mag[o:o + c] = x[o:o + c] @ wt[e].t()
        covered[o:o + c] = True
    err = (out.float() - ref.float()).abs()
    # two bfloat16 roundings and the tensor cores' FP8 accumulation within each 128-wide K block
    bound = ref.float().abs() * 2.0 ** -7 + mag * 2.0 ** -12
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    assert int(out[~covered].count_nonzero()) == 0


def test_triton_grouped_gemm_no_host_sync():
    a, a_s, w, w_s, offs, ls = _case([200, 0, 77], [0, 256, 256], 256, 256, SEED)
    grouped_gemm_fp8(a, a_s, w, w_s, offs, ls, validate=False)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_gemm_fp8(a, a_s, w, w_s, offs, ls, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = grouped_gemm_fp8_reference(a, a_s, w, w_s, offs, ls)
    assert float((out.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2.0 ** -6
