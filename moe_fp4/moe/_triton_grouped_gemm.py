"""The FP8 grouped GEMMs in Triton (tensor-core products of 128-wide K blocks, each block's float32
partial scaled and added in float32: the scales differ per K block, so they cannot wait for the end).

rows kernel (fprop and dgrad): out[r] = a[r] @ b_g^T for the rows r of group g; a FP8 1x128 rows,
  b_g [N, K] FP8 in 128x128 tiles (w_g for fprop, w_g^T for dgrad). Each program computes one
  128 x 128 output tile; it finds its group from the split lengths on the device (no host
  synchronisation; the grid is sized for the worst case and programs past the last tile return).
  The programs run in bands of 8 row tiles (all N tiles of a band before the next band), so rows of a
  and weight tiles are read from memory about once and then from L2.
wgrad kernel: out[g] = a_g^T-contracted: out[g][i, j] = sum over the rows r of group g of
  a[i, r] b[j, r]; both operands are FP8 columns (tokens along the contiguous dimension) with one
  scale per 128 tokens of each column, the blocks anchored at the group's first row.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU machines without Triton: the torch reference runs instead)
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # (a Triton without host tensor descriptors: the wgrad kernel loads through pointers)
    TensorDescriptor = None

BLOCK_M = 128  # with 8 warps: one 128 x 128 float32 accumulator and one block product in registers
BLOCK_N = 128  # one weight scale per program and K block
BLOCK_K = 128
ROWS_STAGES = 4
GROUP_M = 8
# wgrad: 128 x 64 output tiles on one warp group (a 128 x 128 tile on two measured slower: the short
# contraction per expert leaves the larger tile's store and prologue less amortised; results/gemm.md)
WGRAD_BM, WGRAD_BN, WGRAD_WARPS, WGRAD_STAGES = 128, 64, 4, 3


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like ``t``: CUDA, or any device under TRITON_INTERPRET=1."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1")


if triton is not None:

    @triton.jit
    def _grouped_rows_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, offs_ptr, lens_ptr, groups,
                             m, n, k_blocks, n_blocks,
                             stride_am, stride_asm, stride_ask,
                             stride_bg, stride_bn, stride_sg, stride_sn, stride_sk,
                             GP: tl.constexpr, GROUP_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr):
        # bands of GROUP_M row tiles, the N tiles of a band in turn: the programs running together
        # share their rows of a and their weight tiles through L2
        pid = tl.program_id(0)
        band = GROUP_M * n_blocks
        pid_m = (pid // band) * GROUP_M + (pid % band) % GROUP_M
        pid_n = (pid % band) // GROUP_M
        # this row tile's group: the tiles of all groups numbered in group order (a prefix sum of
        # each group's tile count; no table built beforehand)
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
            row_ok = (rows < r1) & (rows < m) & (rows >= 0)  # (splits are not read on the host: stay inside a)
            rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
            cols = pid_n * BN + tl.arange(0, BN)
            ks = tl.arange(0, BK)
            g64 = g.to(tl.int64)
            a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :]
            b_ptrs = b_ptr + g64 * stride_bg + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
            a_scales = a_scale_ptr + rows64 * stride_asm
            b_scale = b_scale_ptr + g64 * stride_sg + pid_n * stride_sn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, k_blocks):
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
                sa = tl.load(a_scales + kb * stride_ask)
                sb = tl.load(b_scale + kb * stride_sk)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
                a_ptrs += BK
                b_ptrs += BK
            out = out_ptr + rows64[:, None] * n + cols[None, :]
            tl.store(out, acc.to(tl.bfloat16), mask=row_ok[:, None])

    @triton.jit
    def _grouped_wgrad_kernel(a_desc, b_desc, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, offs_ptr, lens_ptr,
                              a_base_ptr, b_base_ptr, n, kdim, n_blocks, k_blocks, tokens_a, tokens_b,
                              stride_a, stride_asc, stride_b, stride_bsc,
                              ACCUMULATE: tl.constexpr, A_BASE: tl.constexpr, B_BASE: tl.constexpr,
                              TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              STAGES: tl.constexpr):
        pid = tl.program_id(0)
        tiles = n_blocks * k_blocks
        g = pid // tiles
        t = pid % tiles
        pid_n = t // k_blocks
        pid_k = t % k_blocks
        # groups start on multiples of 16 rows (checked by the wrapper): the tile rows are then
        # 16-byte aligned, which lets the loads go 16 bytes at a time through the async copy pipeline
        first = tl.multiple_of(tl.load(offs_ptr + g).to(tl.int64), 16)
        count = tl.load(lens_ptr + g).to(tl.int64)
        # each operand's first scale column: given per group, or the group's first row / 128
        if A_BASE:
            base_a = tl.load(a_base_ptr + g).to(tl.int64)
        else:
            base_a = first // BK
        if B_BASE:
            base_b = tl.load(b_base_ptr + g).to(tl.int64)
        else:
            base_b = first // BK
        rows_a = (pid_n * BM + tl.arange(0, BM)).to(tl.int64)
        rows_b = (pid_k * BN + tl.arange(0, BN)).to(tl.int64)
        tokens = tl.arange(0, BK)
        a_rows = a_ptr + rows_a[:, None] * stride_a + first + tokens[None, :]
        b_rows = b_ptr + rows_b[:, None] * stride_b + first + tokens[None, :]
        # (the scales are block-major, unit stride along the columns: one contiguous read per block)
        a_sc = a_scale_ptr + rows_a + base_a * stride_asc
        b_sc = b_scale_ptr + rows_b + base_b * stride_bsc
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        full = (count // BK).to(tl.int32)
        # (the loop's own pipeline depth: left to the kernel's, the partial block below took part in
        # the schedule and the loop ran slower; the same products and sums in the same order)
        for i in tl.range(0, full, num_stages=STAGES):
            if TMA:  # (the tile copies of the tensor-memory accelerator: no per-thread addresses)
                a = a_desc.load([pid_n * BM, first.to(tl.int32) + i * BK])
                b = b_desc.load([pid_k * BN, first.to(tl.int32) + i * BK])
            else:
                a = tl.load(a_rows + i * BK)
                b = tl.load(b_rows + i * BK)
            sa = tl.load(a_sc + i * stride_asc)
            sb = tl.load(b_sc + i * stride_bsc)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        if full * BK < count:  # the group's last, partial block
            # loads by 16 tokens (inside the operands' columns), then the tokens past the group zeroed
            r = full * BK + tokens
            r16 = tl.multiple_of((count + 15) // 16 * 16, 16)
            col = first + r
            a = tl.load(a_rows + full * BK, mask=(r < r16)[None, :] & (col < tokens_a)[None, :], other=0.0)
            b = tl.load(b_rows + full * BK, mask=(r < r16)[None, :] & (col < tokens_b)[None, :], other=0.0)
            a = tl.where((r < count)[None, :], a, 0.0)
            b = tl.where((r < count)[None, :], b, 0.0)
            sa = tl.load(a_sc + full * stride_asc)
            sb = tl.load(b_sc + full * stride_bsc)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        out = out_ptr + g.to(tl.int64) * n * kdim + rows_a[:, None] * kdim + rows_b[None, :]
        if ACCUMULATE:
            acc += tl.load(out)
        tl.store(out, acc.to(out_ptr.dtype.element_ty))


if triton is not None:

    @triton.jit
    def _zero_rows_kernel(out_ptr, offs_ptr, lens_ptr, groups, m, n, GP: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        e = tl.arange(0, GP)
        starts = tl.load(offs_ptr + e, mask=e < groups, other=0)
        ends = starts + tl.maximum(tl.load(lens_ptr + e, mask=e < groups, other=0), 0)
        inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])
        free = (tl.max(inside.to(tl.int32), 1) == 0) & (rows < m)
        if tl.max(free.to(tl.int32), 0) > 0:  # (most blocks hold group rows only: nothing to write)
            cols = tl.program_id(1) * BC + tl.arange(0, BC)
            ptrs = out_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
            tl.store(ptrs, tl.zeros((BR, BC), dtype=out_ptr.dtype.element_ty),
                     mask=free[:, None] & (cols[None, :] < n))


if triton is not None:

    @triton.jit
    def _row_groups_kernel(offs_ptr, lens_ptr, out_ptr, groups, m, GP: tl.constexpr, BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        e = tl.arange(0, GP)
        starts = tl.load(offs_ptr + e, mask=e < groups, other=0)
        ends = starts + tl.maximum(tl.load(lens_ptr + e, mask=e < groups, other=0), 0)
        inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])
        g = tl.max(tl.where(inside, e[None, :], -1), 1)  # (groups do not overlap: one at most)
        tl.store(out_ptr + rows, g.to(tl.int32), mask=rows < m)


def row_groups(split_offsets: torch.Tensor, split_lens: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [rows]: each row's group, -1 for rows of no group (one launch; groups must not overlap)."""
    out = torch.empty(rows, dtype=torch.int32, device=split_offsets.device)
    g = split_lens.shape[0]
    if rows:
        br = 128 if g <= 128 else 32  # (rows x groups compared in registers)
        _row_groups_kernel[(triton.cdiv(rows, br),)](split_offsets, split_lens, out, g, rows, GP=_pow2(g), BR=br,
                                                     num_warps=4)
    return out


def _pow2(g: int) -> int:
    return max(16, triton.next_power_of_2(g))


def zero_uncovered_rows(out: torch.Tensor, split_offsets: torch.Tensor, split_lens: torch.Tensor) -> None:
    """Zero the rows of out [M, N] that belong to no group, on the device (one launch)."""
    m, n = out.shape
    g = split_lens.shape[0]
    br = 32 if g <= 256 else 8  # (rows x groups compared in registers)
    _zero_rows_kernel[(triton.cdiv(m, br), triton.cdiv(n, 512))](out, split_offsets, split_lens, g, m, n,
                                                                 GP=_pow2(g), BR=br, BC=512, num_warps=4)


def grouped_rows(a, a_scales, b, b_scales, split_offsets, split_lens) -> torch.Tensor:
    """As moe_fp4.moe.grouped_gemm_fp8 (arguments checked there): b [G, N, K] with a unit last stride.
    Two launches: the zeros of rows of no group, then the products (a grid sized for the worst case,
    rows / 128 + G row tiles, whose programs past the groups' tiles return at once)."""
    m, k = a.shape
    g, n, _ = b.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    zero_uncovered_rows(out, split_offsets, split_lens)
    if g == 0:
        return out
    n_blocks = n // BLOCK_N
    row_tiles = -(-(m // BLOCK_M + g) // GROUP_M) * GROUP_M  # (whole bands; tiles past the groups' return)
    grid = (row_tiles * n_blocks,)
    _grouped_rows_kernel[grid](a, a_scales, b, b_scales, out, split_offsets, split_lens, g, m, n, k // BLOCK_K,
                               n_blocks, a.stride(0), a_scales.stride(0), a_scales.stride(1),
                               b.stride(0), b.stride(1), b_scales.stride(0), b_scales.stride(1), b_scales.stride(2),
                               GP=_pow2(g), GROUP_M=GROUP_M, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=8,
                               num_stages=ROWS_STAGES)
    return out


def wgrad_tma(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the wgrad kernel loads the whole token blocks of the FP8 columns a [N, Ma], b [K, Mb]
    through TMA tensor maps: where Triton has them and both operands' rows start on 16-byte boundaries
    and hold at least one 128-token block (what a tensor map of those blocks needs); through
    per-thread loads otherwise (the same bits)."""
    return TensorDescriptor is not None and all(
        t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.shape[0] > 0 and t.shape[1] >= BLOCK_K
        for t in (a, b))


def grouped_wgrad(a, a_scales, b, b_scales, split_offsets, split_lens, a_base, b_base, out, accumulate) -> None:
    """As moe_fp4.moe.grouped_gemm_fp8_wgrad (arguments checked there, group offsets multiples of 16):
    writes out [G, N, K] (float32 sums, stored in out's dtype). a_base / b_base: int [G], each group's
    first scale column, or None for split_offsets / 128. Scales are read per token block for
    128 columns at a time, so they are given to the kernel block-major ([blocks, columns] contiguous:
    one 512-byte read)."""
    g, n, kdim = out.shape
    if g == 0 or n == 0 or kdim == 0:
        return
    if a_scales.stride(0) != 1:
        a_scales = a_scales.t().contiguous().t()
    if b_scales.stride(0) != 1:
        b_scales = b_scales.t().contiguous().t()
    n_blocks, k_blocks = n // WGRAD_BM, kdim // WGRAD_BN
    grid = (g * n_blocks * k_blocks,)
    tma = wgrad_tma(a, b)
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [WGRAD_BM, BLOCK_K]) if tma else a
    b_desc = TensorDescriptor(b, list(b.shape), [b.stride(0), 1], [WGRAD_BN, BLOCK_K]) if tma else b
    _grouped_wgrad_kernel[grid](a_desc, b_desc, a, a_scales, b, b_scales, out, split_offsets, split_lens,
                                split_offsets if a_base is None else a_base,
                                split_offsets if b_base is None else b_base,
                                n, kdim, n_blocks, k_blocks, a.shape[1], b.shape[1],
                                a.stride(0), a_scales.stride(1), b.stride(0), b_scales.stride(1),
                                ACCUMULATE=accumulate, A_BASE=a_base is not None, B_BASE=b_base is not None,
                                TMA=tma, BM=WGRAD_BM, BN=WGRAD_BN, BK=BLOCK_K, STAGES=WGRAD_STAGES,
                                num_warps=WGRAD_WARPS, num_stages=WGRAD_STAGES)
