"""Probe: can the per-128-K scaling of the FP8 grouped GEMMs overlap the next block's tensor-core
product? The package kernels (moe_fp4/moe/_triton_grouped_gemm.py) scale each block's float32 sum
as soon as it is ready, so the tensor cores wait during every multiply-add. The variants here issue
block kb's product first and scale block kb-1's while it runs (one more 128 x 128 float32 fragment
in registers). Run on a GPU; prints TFLOP/s of the package kernels and the variants on the same
operands, and checks that the variants give the same bits (the same sums in the same order).

    python benchmarks/probe_gemm_overlap.py [--groups 32] [--rows 32768]

Also runs on CPU under TRITON_INTERPRET=1 with small shapes (correctness only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fp4 import formats  # noqa: E402
from moe_fp4.moe import _triton_grouped_gemm as tg  # noqa: E402
from moe_fp4.moe.bench import _median_us  # noqa: E402


@triton.jit
def rows_overlap_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, offs_ptr, lens_ptr, groups, m, n,
                        k_blocks, n_blocks, stride_am, stride_asm, stride_ask, stride_bg, stride_bn, stride_sg,
                        stride_sn, stride_sk, GP: tl.constexpr, GROUP_M: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    band = GROUP_M * n_blocks
    pid_m = (pid // band) * GROUP_M + (pid % band) % GROUP_M
    pid_n = (pid % band) // GROUP_M
    e = tl.arange(0, GP)
    lens = tl.maximum(tl.load(lens_ptr + e, mask=e < groups, other=0), 0)
    tiles = (lens + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    g = tl.sum((ends <= pid_m).to(tl.int32), 0)
    if g < groups:
        mine = e == g
        first_tile = tl.sum(tl.where(mine, ends - tiles, 0), 0)
        r0 = tl.load(offs_ptr + g) + (pid_m - first_tile) * BM
        r1 = tl.load(offs_ptr + g) + tl.sum(tl.where(mine, lens, 0), 0)
        rows = r0 + tl.arange(0, BM)
        row_ok = (rows < r1) & (rows < m) & (rows >= 0)
        rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        g64 = g.to(tl.int64)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + g64 * stride_bg + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
        a_scales = a_scale_ptr + rows64 * stride_asm
        b_scale = b_scale_ptr + g64 * stride_sg + pid_n * stride_sn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        prev = tl.zeros((BM, BN), dtype=tl.float32)
        s_prev = tl.zeros((BM,), dtype=tl.float32)
        for kb in range(0, k_blocks):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            p = tl.dot(a, tl.trans(b))  # block kb on the tensor cores ...
            acc += prev * s_prev[:, None]  # ... while block kb-1 is scaled (zero at kb = 0)
            prev = p
            s_prev = tl.load(a_scales + kb * stride_ask) * tl.load(b_scale + kb * stride_sk)
            a_ptrs += BK
            b_ptrs += BK
        acc += prev * s_prev[:, None]
        out = out_ptr + rows64[:, None] * n + cols[None, :]
        tl.store(out, acc.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def wgrad_overlap_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, offs_ptr, lens_ptr, n, kdim, n_blocks,
                         k_blocks, stride_a, stride_asr, stride_asc, stride_b, stride_bsr, stride_bsc,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The package's wgrad kernel for groups of whole 128-token blocks (no tail), with the scaling of
    block j-1 after block j's product is issued."""
    pid = tl.program_id(0)
    tiles = n_blocks * k_blocks
    g = pid // tiles
    t = pid % tiles
    pid_n = t // k_blocks
    pid_k = t % k_blocks
    first = tl.multiple_of(tl.load(offs_ptr + g).to(tl.int64), 16)
    count = tl.load(lens_ptr + g).to(tl.int64)
    base = first // BK
    rows_a = (pid_n * BM + tl.arange(0, BM)).to(tl.int64)
    rows_b = (pid_k * BN + tl.arange(0, BN)).to(tl.int64)
    tokens = tl.arange(0, BK)
    a_ptrs = a_ptr + rows_a[:, None] * stride_a + first + tokens[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_b + first + tokens[None, :]
    a_sc = a_scale_ptr + rows_a * stride_asr + base * stride_asc
    b_sc = b_scale_ptr + rows_b * stride_bsr + base * stride_bsc
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    prev = tl.zeros((BM, BN), dtype=tl.float32)
    sa_prev = tl.zeros((BM,), dtype=tl.float32)
    sb_prev = tl.zeros((BN,), dtype=tl.float32)
    for _ in range(0, (count // BK).to(tl.int32)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        p = tl.dot(a, tl.trans(b))
        acc += prev * (sa_prev[:, None] * sb_prev[None, :])
        prev = p
        sa_prev = tl.load(a_sc)
        sb_prev = tl.load(b_sc)
        a_ptrs += BK
        b_ptrs += BK
        a_sc += stride_asc
        b_sc += stride_bsc
    acc += prev * (sa_prev[:, None] * sb_prev[None, :])
    tl.store(out_ptr + g.to(tl.int64) * n * kdim + rows_a[:, None] * kdim + rows_b[None, :], acc)


def wgrad_overlap(a, a_scales, b, b_scales, offs, lens):
    g, n, kdim = lens.shape[0], a.shape[0], b.shape[0]
    out = torch.empty(g, n, kdim, dtype=torch.float32, device=a.device)
    a_scales, b_scales = a_scales.t().contiguous().t(), b_scales.t().contiguous().t()  # block-major
    wgrad_overlap_kernel[(g * (n // 128) * (kdim // 128),)](
        a, a_scales, b, b_scales, out, offs, lens, n, kdim, n // 128, kdim // 128, a.stride(0), a_scales.stride(0),
        a_scales.stride(1), b.stride(0), b_scales.stride(0), b_scales.stride(1), BM=128, BN=128, BK=128,
        num_warps=8, num_stages=tg.WGRAD_STAGES)
    return out


def rows_overlap(a, a_scales, b, b_scales, offs, lens):
    m, k = a.shape
    g, n, _ = b.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tg.zero_uncovered_rows(out, offs, lens)
    n_blocks = n // 128
    row_tiles = -(-(m // 128 + g) // tg.GROUP_M) * tg.GROUP_M
    rows_overlap_kernel[(row_tiles * n_blocks,)](
        a, a_scales, b, b_scales, out, offs, lens, g, m, n, k // 128, n_blocks, a.stride(0), a_scales.stride(0),
        a_scales.stride(1), b.stride(0), b.stride(1), b_scales.stride(0), b_scales.stride(1), b_scales.stride(2),
        GP=tg._pow2(g), GROUP_M=tg.GROUP_M, BM=128, BN=128, BK=128, num_warps=8, num_stages=tg.ROWS_STAGES)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--rows", type=int, default=32768)
    args = p.parse_args(argv)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dev = "cpu" if interp else "cuda"
    shapes = ((256, 256),) if interp else ((4096, 7168), (7168, 2048))
    g, m = (3, 384) if interp else (args.groups, args.rows)  # (whole 128-row blocks per group)
    lens = torch.full((g,), m // g, device=dev)
    offs = torch.arange(g, device=dev) * (m // g)
    for n, k in shapes:
        torch.manual_seed(0)
        a, a_s = formats.quantize_fp8_blockwise(torch.randn(m, k, device=dev))
        w, w_s = formats.quantize_fp8_blockwise(torch.randn(g, n, k, device=dev) * 0.02, block=(128, 128))
        ref = tg.grouped_rows(a, a_s, w, w_s, offs, lens)
        got = rows_overlap(a, a_s, w, w_s, offs, lens)
        same = torch.equal(got, ref)
        line = f"rows N {n} K {k}: overlap variant equal to the package kernel: {same}"
        if not interp:
            flop = 2 * m * n * k / 1e6
            operands = (a, a_s, w, w_s, offs, lens)
            t0 = _median_us(lambda ops=operands: tg.grouped_rows(*ops), 10)
            t1 = _median_us(lambda ops=operands: rows_overlap(*ops), 10)
            line += f"; package {t0:.0f} us ({flop / t0:.0f} TFLOP/s), overlap {t1:.0f} us ({flop / t1:.0f} TFLOP/s)"
        print(line, flush=True)
        if not same:
            print("  max difference", float((got.float() - ref.float()).abs().max()))
        # wgrad: dw_g [n, k] from dy^T [n, M] and x^T [k, M] (FP8 columns, one scale per 128 tokens)
        dt, dts = formats.quantize_fp8_blockwise(torch.randn(n, m, device=dev))
        xt, xts = formats.quantize_fp8_blockwise(torch.randn(k, m, device=dev))
        base = offs // 128
        ref = torch.empty(g, n, k, device=dev)
        tg.grouped_wgrad(dt, dts, xt, xts, offs, lens, base, base, ref, False)
        got = wgrad_overlap(dt, dts, xt, xts, offs, lens)
        line = f"wgrad N {n} K {k}: overlap variant equal to the package kernel: {torch.equal(got, ref)}"
        if not interp:
            operands = (dt, dts, xt, xts, offs, lens, base, base, ref, False)
            t0 = _median_us(lambda ops=operands: tg.grouped_wgrad(*ops), 10)
            t1 = _median_us(lambda ops=operands[:6]: wgrad_overlap(*ops), 10)
            line += f"; package {t0:.0f} us ({flop / t0:.0f} TFLOP/s), overlap {t1:.0f} us ({flop / t1:.0f} TFLOP/s)"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
