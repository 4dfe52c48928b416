"""Row kernels of the dispatch path in Triton (CUDA only; the torch paths are the references).

``mxfp4_rows_to_fp8_gather(rows, hidden, index)``: FP4RowToFP8Row of ``rows[index]`` in one pass,
so each received token is read once per output row and no gathered FP8 copy is made: the expansion
to one row per (token, local expert) is fused into the conversion. Integer arithmetic only, bit-exact
with ``moe_fp4.formats.mxfp4_to_fp8_blockwise`` (see below; tested against it on GPU and, where
Triton is installed, in its CPU interpreter).

``copy_rows(out, index, src_rank, bases, row_bytes, ...)``: out[i] = the row ``index[i]`` of rank
``src_rank[i]``'s staging buffer, whose address is ``bases[src_rank[i]]`` (symmetric memory: peers'
buffers are addressable from this GPU over NVLink). With ``chunk`` / ``row_chunk`` only the rows of
that chunk are copied (pipelined dispatch).

MOE_FP4_EP_TRITON=0 turns these kernels off (the torch paths run instead).

The conversion, per 128-element group with UE8M0 block scales e_0..e_3 and emax = max(e_i):
an E2M1 code c (sign s, magnitude m = c & 7) of block i has the value q * 2^t / 2 with
(q, t) = (1, 0) for m = 1, (1, m >> 1) for even m, (3, (m >> 1) - 1) for odd m >= 3; its E4M3 value
is that times 2^(6 - (emax - e_i)), i.e. q * 2^x with x = t + 5 - (emax - e_i). E4M3 (bias 7,
subnormals in steps of 2^-9) encodes q = 1 as exponent x + 7 when x >= -6, else the subnormal
2^(x + 9) (x = -7..-9), 0 at x = -10 (a tie, to even) and below; q = 3 = 1.5 * 2^(x + 1) as exponent
x + 8 and mantissa 4 when x >= -7, else the subnormal 3 * 2^(x + 9) rounded to nearest even: 6, 3,
2 (1.5, a tie), 1 (0.75) for x = -8..-11, 0 below. The sign is kept (a zero keeps its sign). The
FP32 scale is 2^(emax - 133) built from bits; a group with a 0xFF block scale gets NaN and zero data.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (CPU machines): the torch paths are used
    triton = None

from moe_fp4 import formats


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on t's device (CUDA, Triton installed, not turned off); with
    TRITON_INTERPRET=1 they also run on CPU tensors (tests)."""
    if triton is None or os.environ.get("MOE_FP4_EP_TRITON", "1") == "0":
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _e4m3_of_e2m1(c, d):
        """c int32 E2M1 codes (0..15), d int32 >= 0 scale differences -> int32 E4M3 bytes."""
        m = c & 7
        sign = (c >> 3) & 1
        odd = (m & 1) == 1
        big = m >= 2
        q3 = odd & big
        t = tl.where(big, tl.where(odd, (m >> 1) - 1, m >> 1), 0)
        x = t + 5 - d
        # q = 1: 2^x
        n1 = (x + 7) << 3
        s1 = tl.where(x >= -9, 1 << tl.minimum(tl.maximum(x + 9, 0), 2), 0)
        one = tl.where(x >= -6, n1, s1)
        # q = 3: 1.5 * 2^(x + 1)
        n3 = ((x + 8) << 3) | 4
        s3 = tl.where(x == -8, 6, tl.where(x == -9, 3, tl.where(x == -10, 2, tl.where(x == -11, 1, 0))))
        three = tl.where(x >= -7, n3, s3)
        mag = tl.where(m == 0, 0, tl.where(q3, three, one))
        return (sign << 7) | mag

    @triton.jit
    def _mxfp4_to_fp8_gather_kernel(rows_ptr, index_ptr, data_ptr, scales_ptr, row_stride, n_groups,
                                    HALF: tl.constexpr, GROUPS: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        g0 = tl.program_id(1) * GROUPS
        src = tl.load(index_ptr + i)
        g = g0 + tl.arange(0, GROUPS)  # [G] groups of 128 elements
        b = tl.arange(0, 64)  # [64] packed bytes of a group
        gmask = g < n_groups
        mask = gmask[:, None] & (b[None, :] >= 0)
        row = rows_ptr + src * row_stride
        packed = tl.load(row + g[:, None] * 64 + b[None, :], mask=mask, other=0).to(tl.int32)
        e = tl.load(row + HALF + g[:, None] * 4 + b[None, :] // 16, mask=mask, other=0).to(tl.int32)
        emax = tl.max(e, axis=1)  # [G]
        d = emax[:, None] - e
        lo = _e4m3_of_e2m1(packed & 15, d)
        hi = _e4m3_of_e2m1(packed >> 4, d)
        nan = emax == 255
        pair = tl.where(nan[:, None], 0, lo | (hi << 8))  # element 2j in the low byte
        tl.store(data_ptr + i * HALF + g[:, None] * 64 + b[None, :], pair.to(tl.int16), mask=mask)
        bits = tl.where(emax >= 7, (emax - 6) << 23, 1 << tl.minimum(emax + 16, 22))
        bits = tl.where(nan, 0x7FC00000, bits)
        tl.store(scales_ptr + i * n_groups + g, bits, mask=gmask)

    @triton.jit
    def _copy_rows_kernel(out_ptr, index_ptr, rank_ptr, bases_ptr, chunk_ptr, chunk, words,
                          BLOCK: tl.constexpr, CHUNKED: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        if CHUNKED:
            if tl.load(chunk_ptr + i) != chunk:
                return
        r = tl.load(rank_ptr + i)
        src_row = tl.load(index_ptr + i)
        base = tl.load(bases_ptr + r).to(out_ptr.dtype)  # the source buffer, read as out's words
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < words
        v = tl.load(base + src_row * words + cols, mask=mask)
        tl.store(out_ptr + i * words + cols, v, mask=mask)


def mxfp4_rows_to_fp8_gather(rows: torch.Tensor, hidden: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows uint8 [n, H/2 + H/32] (``formats.pack_mxfp4_rows`` layout, last dimension contiguous),
    hidden H (a multiple of 128), index int64 [N] rows to convert -> (float8_e4m3fn [N, H],
    float32 [N, H/128]), bit for bit ``formats.mxfp4_to_fp8_blockwise`` of ``rows[index]``."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != formats.mxfp4_row_bytes(hidden):
        raise ValueError(f"rows: expected uint8 [n, {formats.mxfp4_row_bytes(hidden)}], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if hidden % formats.FP8_GROUP:
        raise ValueError(f"hidden: expected a multiple of {formats.FP8_GROUP}, got {hidden}")
    if index.dtype != torch.int64 or index.dim() != 1:
        raise ValueError(f"index: expected int64 [N], got {index.dtype} {tuple(index.shape)}")
    n = index.shape[0]
    n_groups = hidden // formats.FP8_GROUP
    data = torch.empty(n, hidden, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, n_groups, dtype=torch.int32, device=rows.device)
    if n and rows.shape[1] and rows.stride(1) != 1:
        raise ValueError(f"rows: expected a contiguous last dimension, got strides {rows.stride()}")
    if n:
        groups = 16
        grid = (n, triton.cdiv(n_groups, groups))
        _mxfp4_to_fp8_gather_kernel[grid](rows, index, data.view(torch.int16), scales, rows.stride(0), n_groups,
                                          HALF=hidden // 2, GROUPS=groups, num_warps=4)
    return data.view(torch.float8_e4m3fn), scales.view(torch.float32)


def copy_rows(out: torch.Tensor, index: torch.Tensor, src_rank: torch.Tensor, bases: torch.Tensor,
              row_chunk: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """out uint8 [N, B] (contiguous) <- row index[i] (int64 [N]) of the buffer of rank src_rank[i]
    (int64 [N]); bases int64 [W]: each rank's buffer address (rows of B bytes back to back);
    row_chunk int64 [N] or None: copy only the rows whose chunk equals ``chunk``. Rows move as 4-byte
    words when B allows it, else as bytes."""
    n, width = out.shape
    if out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous uint8 rows, got {out.dtype} {tuple(out.shape)}")
    if n == 0 or width == 0:
        return out
    word = torch.int32 if width % 4 == 0 else torch.uint8
    words = width // word.itemsize
    block = min(1024, triton.next_power_of_2(words))
    grid = (n, triton.cdiv(words, block))
    chunks = row_chunk if row_chunk is not None else index
    _copy_rows_kernel[grid](out.view(word), index, src_rank, bases, chunks, chunk, words, BLOCK=block,
                            CHUNKED=row_chunk is not None, num_warps=4)
    return out


__all__ = ["available", "copy_rows", "mxfp4_rows_to_fp8_gather"]
