"""The FP8 grouped GEMM in Triton: each program computes a 128 x 128 tile of one group's rows, one
tensor-core product per 128-wide K block, each block's float32 partial scaled by the row's 1x128
scale and the weight tile's 128x128 scale before it is added (the scales differ per K block, so they
cannot wait for the end). The tiles of every group come from a table built on the device from the
split offsets and lengths (no host synchronisation; sized for the worst case, unused entries -1)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU machines without Triton: the torch reference runs instead)
    triton = None

BLOCK_M = 128  # with 8 warps and 5 stages: the fastest of 128/64 rows x 4/8 warps x 3-5 stages measured
BLOCK_N = 128  # one weight scale per program and K block
BLOCK_K = 128


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _grouped_fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, tile_group_ptr, tile_start_ptr,
                                 tile_end_ptr, m, n, k, k_blocks, n_blocks,
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g = tl.load(tile_group_ptr + pid_m)
        if g >= 0:
            r0 = tl.load(tile_start_ptr + pid_m)
            r1 = tl.load(tile_end_ptr + pid_m)
            rows = r0 + tl.arange(0, BM)
            row_ok = (rows < r1) & (rows < m) & (rows >= 0)  # (splits are not read on the host: stay inside a)
            rows64 = rows.to(tl.int64)
            cols = pid_n * BN + tl.arange(0, BN)
            ks = tl.arange(0, BK)
            g64 = g.to(tl.int64)
            a_ptrs = a_ptr + rows64[:, None] * k + ks[None, :]
            w_ptrs = w_ptr + g64 * n * k + cols.to(tl.int64)[:, None] * k + ks[None, :]
            w_scale = w_scale_ptr + (g64 * n_blocks + pid_n) * k_blocks
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, k_blocks):
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
                sa = tl.load(a_scale_ptr + rows64 * k_blocks + kb, mask=row_ok, other=0.0)
                sw = tl.load(w_scale + kb)
                acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * sw)
                a_ptrs += BK
                w_ptrs += BK
            out = out_ptr + rows64[:, None] * n + cols[None, :]
            tl.store(out, acc.to(tl.bfloat16), mask=row_ok[:, None])


def tile_table(split_offsets: torch.Tensor, split_lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    """(group, first row, end row) int32 of each 128-row tile of every group, in group order, on the
    device; sized rows / 128 + G (a bound on the tiles of groups inside [0, rows)), unused entries -1."""
    g = split_lens.shape[0]
    lens = split_lens.to(torch.int64)
    tiles = (lens + BLOCK_M - 1) // BLOCK_M
    ends = torch.cumsum(tiles, 0)
    size = rows // BLOCK_M + g
    index = torch.arange(size, device=lens.device)
    group = torch.searchsorted(ends, index, right=True)  # G past the last tile
    used = group < g
    gi = group.clamp(max=g - 1)
    start = split_offsets.to(torch.int64)[gi] + (index - (ends - tiles)[gi]) * BLOCK_M
    end = split_offsets.to(torch.int64)[gi] + lens[gi]
    return (torch.where(used, gi, -1).to(torch.int32), start.to(torch.int32), end.to(torch.int32))


def grouped_gemm_fp8(a, a_scales, w, w_scales, split_offsets, split_lens) -> torch.Tensor:
    """As moe_fp4.moe.grouped_gemm_fp8 (arguments checked there); contiguous CUDA tensors."""
    m, k = a.shape
    g, n, _ = w.shape
    out = torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or g == 0:
        return out
    group, start, end = tile_table(split_offsets, split_lens, m)
    grid = (group.shape[0], n // BLOCK_N)
    _grouped_fp8_gemm_kernel[grid](a, a_scales, w, w_scales, out, group, start, end, m, n, k, k // BLOCK_K,
                                   n // BLOCK_N, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=8, num_stages=5)
    return out
