"""The Triton FP8 grouped GEMM on a GPU against the reference (moe_fp4.moe.grouped_gemm_fp8_reference):
ragged, empty and gapped groups at DeepSeek-V3 expert shapes, rows of no group zero, no host sync
with validate=False."""

import pytest
import torch

from moe_fp4 import formats
from moe_fp4.moe import _deep_gemm, grouped_gemm_fp8
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8_reference

pytestmark = pytest.mark.gpu
SEED = 3131


@pytest.fixture(params=["triton", "deepgemm"])
def engine(request, monkeypatch):
    """The CUDA engine of grouped_gemm_fp8 for tile-aligned splits: the Triton kernel (DeepGEMM hidden)
    or DeepGEMM (where it is installed: patches/deepgemm/build.sh)."""
    if request.param == "triton":
        monkeypatch.setattr(_deep_gemm, "module", lambda: None)
    elif _deep_gemm.module() is None:
        pytest.skip("deep_gemm is not installed (patches/deepgemm/build.sh builds it)")
    return request.param


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
def test_grouped_gemm_matches_reference(k, n, layout, engine):
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


def test_grouped_gemm_no_host_sync(engine):
    a, a_s, w, w_s, offs, ls = _case([200, 0, 77], [0, 256, 256], 256, 256, SEED)
    grouped_gemm_fp8(a, a_s, w, w_s, offs, ls, validate=False, tile_aligned=True)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = grouped_gemm_fp8(a, a_s, w, w_s, offs, ls, validate=False, tile_aligned=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = grouped_gemm_fp8_reference(a, a_s, w, w_s, offs, ls)
    assert float((out.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2.0 ** -6


def _aligned(lens):
    offsets, at = [], 0
    for c in lens:
        offsets.append(at)
        at += -(-c // 128) * 128
    return offsets, at


@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_dgrad_matches_reference(n, k, engine):
    """dx = dy @ w_g (dgrad) through the transposed tiles of ops.quantize_fp8_tiles at DeepSeek-V3 shapes
    (a strided view for the Triton kernel; DeepGEMM takes contiguous tiles, as Experts makes them)."""
    from moe_fp4 import ops

    lens = [300, 0, 129, 1000, 64, 257]
    offsets, m = _aligned(lens)
    gen = torch.Generator().manual_seed(SEED + n)
    g = len(lens)
    w = (torch.randn(g, n, k, generator=gen) * 0.02).cuda()
    data, scales, data_t = ops.quantize_fp8_tiles(w.reshape(g * n, k))
    w_t = data_t.view(k, g, n).permute(1, 0, 2)
    s_t = scales.view(g, n // 128, k // 128).transpose(1, 2)
    if engine == "deepgemm":
        w_t = w_t.contiguous()
    dy = torch.randn(m + 7, n, generator=gen).cuda()
    d8, ds = ops.quantize_fp8_blockwise(dy)
    offs, ls = torch.tensor(offsets).cuda(), torch.tensor(lens).cuda()
    out = grouped_gemm_fp8(d8, ds, w_t, s_t, offs, ls)
    ref = grouped_gemm_fp8_reference(d8, ds, w_t.contiguous(), s_t.contiguous(), offs, ls)
    err = (out.float() - ref.float()).abs()
    bound = ref.float().abs() * 2.0 ** -7 + float(ref.float().abs().max()) * 2.0 ** -12
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    assert int(out[m:].count_nonzero()) == 0


@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_triton_wgrad_matches_reference(n, k):
    """dw_g = dy_g^T x_g (wgrad) from FP8 columns at DeepSeek-V3 shapes; also from MXFP4 rows
    (FP4RowToFP8Col's per-expert scale columns) and accumulated into a float32 buffer."""
    from moe_fp4 import ops
    from moe_fp4.moe import grouped_gemm_fp8_wgrad
    from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8_wgrad_reference

    lens = [300, 0, 129, 1000, 257]
    offsets, m = _aligned(lens)
    gen = torch.Generator().manual_seed(SEED + k)
    dy = torch.randn(m, n, generator=gen).cuda().bfloat16()
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    _, _, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy)
    _, _, x_t, x_ts = ops.quantize_fp8_rows_cols(x)
    offs, ls = torch.tensor(offsets).cuda(), torch.tensor(lens).cuda()
    out = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls)
    ref = grouped_gemm_fp8_wgrad_reference(dy_t, dy_ts, x_t, x_ts, offs, ls)
    _check_wgrad(out, ref, _abs(dy_t), dy_ts, _abs(x_t), x_ts, offs, ls, None)
    assert int(out[1].count_nonzero()) == 0
    acc = torch.full_like(out, 0.5)
    grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls, out=acc)
    assert torch.equal(acc, out + 0.5)
    b16 = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls, out_dtype=torch.bfloat16)
    assert torch.equal(b16, out.bfloat16())  # the float32 sums rounded once, to nearest

    packed, mx = ops.quantize_mxfp4(x)
    c_t, c_ts, goff = ops.mxfp4_rows_to_fp8_cols(packed, mx, ls, offs)
    out = grouped_gemm_fp8_wgrad(dy_t, dy_ts, c_t, c_ts, offs, ls, b_scale_offsets=goff[:-1])
    ref = grouped_gemm_fp8_wgrad_reference(dy_t, dy_ts, c_t, c_ts, offs, ls, b_scale_offsets=goff[:-1])
    _check_wgrad(out, ref, _abs(dy_t), dy_ts, _abs(c_t), c_ts, offs, ls, goff[:-1])


def test_triton_wgrad_scale_layouts():
    """The wgrad kernel reads the scales block-major: scales given block-major already (no copy),
    as a column slice of a block-major buffer, and a single scale column (at most 128 tokens) give
    the bits of the row-major scales."""
    from moe_fp4 import ops
    from moe_fp4.moe import grouped_gemm_fp8_wgrad

    gen = torch.Generator().manual_seed(SEED + 7)
    for lens in ([300, 0, 129, 257], [100, 0]):
        offsets, m = _aligned(lens)
        dy = torch.randn(m, 256, generator=gen).cuda().bfloat16()
        x = torch.randn(m, 384, generator=gen).cuda().bfloat16()
        _, _, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy)
        _, _, x_t, x_ts = ops.quantize_fp8_rows_cols(x)
        offs, ls = torch.tensor(offsets).cuda(), torch.tensor(lens).cuda()
        want = grouped_gemm_fp8_wgrad(dy_t, dy_ts, x_t, x_ts, offs, ls)
        block_major = grouped_gemm_fp8_wgrad(dy_t, dy_ts.t().contiguous().t(), x_t, x_ts.t().contiguous().t(), offs, ls)
        assert torch.equal(block_major, want)
        wide = torch.zeros(dy_ts.shape[1] + 3, dy_ts.shape[0], device="cuda")  # block-major, 3 blocks more
        wide[2:2 + dy_ts.shape[1]] = dy_ts.t()
        sliced = wide[2:2 + dy_ts.shape[1]].t()  # [N, blocks], unit stride along N, offset into the buffer
        assert sliced.stride(0) == 1
        assert torch.equal(grouped_gemm_fp8_wgrad(dy_t, sliced, x_t, x_ts, offs, ls), want)
        # columns whose rows leave the 16-byte grid (per-thread loads instead of tensor-map copies)
        assert dy_t.stride(0) % 16 == 0 and x_t.stride(0) % 16 == 0
        off_grid = [torch.nn.functional.pad(t.view(torch.uint8), (0, 8)).view(t.dtype)[:, :t.shape[1]]
                    for t in (dy_t, x_t)]
        assert off_grid[0].stride(0) % 16 == 8
        assert torch.equal(grouped_gemm_fp8_wgrad(off_grid[0], dy_ts, off_grid[1], x_ts, offs, ls), want)


def test_triton_wgrad_few_tokens():
    """No tokens at all (a rank that received none) and fewer than one 128-token block: the operands'
    columns too short for a tensor map (per-thread loads), and the same tokens in columns padded to a
    block (tensor maps, no whole block to load); zeros and the spec's sums."""
    from moe_fp4 import ops
    from moe_fp4.moe import _triton_grouped_gemm, grouped_gemm_fp8_wgrad
    from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8_wgrad_reference

    gen = torch.Generator().manual_seed(SEED + 9)
    for rows, padded in ((0, False), (64, False), (100, False), (64, True), (100, True)):
        _, _, a, a_s = ops.quantize_fp8_rows_cols(torch.randn(rows, 256, generator=gen).cuda().bfloat16())
        _, _, b, b_s = ops.quantize_fp8_rows_cols(torch.randn(rows, 384, generator=gen).cuda().bfloat16())
        if not padded:
            a, b = a[:, :rows], b[:, :rows]
        assert _triton_grouped_gemm.wgrad_tma(a, b) == padded, (rows, padded)
        offs, lens = torch.tensor([0, rows]).cuda(), torch.tensor([rows, 0]).cuda()
        out = grouped_gemm_fp8_wgrad(a, a_s, b, b_s, offs, lens)
        ref = grouped_gemm_fp8_wgrad_reference(a, a_s, b, b_s, offs, lens)
        assert out.shape == (2, 256, 384) and int(out[1].count_nonzero()) == 0
        assert float((out - ref).abs().max()) <= float(ref.abs().max()) * 2 ** -18, rows


def _abs(fp8):
    """|x| of an FP8 E4M3 tensor (the sign bit cleared), same strides."""
    return (fp8.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def _check_wgrad(out, ref, a_abs, a_s, b_abs, b_s, offs, lens, b_base):
    """Error within the tensor cores' accumulation of each 128-token block (about 2^-13 of the sum of
    the products' magnitudes) plus float32 sums: bound 2^-11 of that sum."""
    from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8_wgrad_reference

    mag = grouped_gemm_fp8_wgrad_reference(a_abs, a_s.abs(), b_abs, b_s.abs(), offs, lens, b_scale_offsets=b_base)
    excess = (out - ref).abs() - mag * 2.0 ** -11
    assert float(excess.max()) <= 0, f"error exceeds the bound by {float(excess.max())}"


@pytest.mark.parametrize("save", ["mxfp4", "fp8", "bf16", "recompute"])
def test_experts_gpu_matches_cpu(save):
    """The Experts module on the GPU (Triton GEMMs, native conversions) against the same module on
    the CPU (the spec's GEMMs and conversions): forward and gradients within the accumulation bound."""
    from moe_fp4.moe import Experts

    g, h, i = 4, 1024, 512
    lens = [300, 0, 129, 700]
    offsets, m = _aligned(lens)
    gen = torch.Generator().manual_seed(SEED + 5)
    x = torch.randn(m, h, generator=gen)
    dy = torch.randn(m, h, generator=gen)
    results = []
    for dev in ("cpu", "cuda"):
        torch.manual_seed(SEED)
        module = Experts(g, h, i, save=save, dtype=torch.float32).to(dev)
        xx = x.detach().clone().to(dev).requires_grad_()
        y = module(xx, torch.tensor(offsets, device=dev), torch.tensor(lens, device=dev))
        y.backward(dy.to(dev))
        results.append([t.detach().cpu().double() for t in (y, xx.grad, module.w1.grad, module.w2.grad)])
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), *results):
        rel = float((a - b).norm() / b.norm())
        assert rel < 2.0 ** -6, f"{save} {name}: relative difference {rel}"


def test_experts_gpu_host_splits_same_bits(monkeypatch):
    """save="mxfp4" with the splits also given as host ints (what a dispatch layer passes: the
    backward's FP8 columns of the input then take them from the host): the same output and
    gradients, bit for bit, as with the splits read from the device."""
    from moe_fp4.moe import Experts

    g, h, i = 4, 1024, 512
    lens = [300, 0, 129, 700]
    offsets, m = _aligned(lens)
    import moe_fp4.moe.experts as experts_module

    gen = torch.Generator().manual_seed(SEED + 6)
    x = torch.randn(m, h, generator=gen).cuda()
    dy = torch.randn(m, h, generator=gen).cuda()
    results, seen = [], []
    convert = experts_module.ops.mxfp4_rows_to_fp8_cols

    def spy(packed, scales, split_lens, split_offsets):  # where the column conversion takes its splits from
        seen.append((split_lens.device.type, split_offsets.device.type))
        return convert(packed, scales, split_lens, split_offsets)

    monkeypatch.setattr(experts_module.ops, "mxfp4_rows_to_fp8_cols", spy)
    for host in (None, (lens, offsets)):
        torch.manual_seed(SEED)
        module = Experts(g, h, i, save="mxfp4", dtype=torch.float32).cuda()
        xx = x.clone().requires_grad_()
        y = module(xx, torch.tensor(offsets).cuda(), torch.tensor(lens).cuda(), validate=False, host_splits=host)
        y.backward(dy)
        results.append((y.detach(), xx.grad, module.w1.grad, module.w2.grad))
    assert seen == [("cuda", "cuda"), ("cpu", "cpu")]
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), *results):
        assert torch.equal(a, b), name
