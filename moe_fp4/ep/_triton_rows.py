"""Row kernels of the dispatch path in Triton (CUDA only; the torch paths are the references).

``mxfp4_rows_to_fp8_scatter(rows, hidden, slot_table, num_rows)``: FP4RowToFP8Row fused with the
expansion to expert rows: each received token is converted once and written to each of its
(token, local expert) rows (``DispatchOutput.to_fp8_blockwise`` for the mxfp4 payload).
``mxfp4_rows_to_fp8_gather(rows, hidden, index)``: the same conversion of ``rows[index]``.
Both are bit-exact with ``moe_fp4.formats.mxfp4_to_fp8_blockwise`` (tested against it on GPU and,
where Triton is installed, in its CPU interpreter).

``copy_rows(out, index, src_rank, bases, ...)``: out[i] = the row ``index[i]`` of rank
``src_rank[i]``'s staging buffer, whose address is ``bases[src_rank[i]]`` (symmetric memory: peers'
buffers are addressable from this GPU over NVLink).

Each launcher takes ``num_sms``, the SM budget (moe_fp4.ep.sms): the kernels loop over their work,
so a bounded grid gives the same bits.

MOE_FP4_EP_TRITON=0 turns these kernels off (the torch paths run instead).

The conversion, per 128-element group with UE8M0 block scales e_0..e_3 and emax = max(e_i): the FP32
scale is 2^(emax - 133), built from bits (a group with a 0xFF block scale gets NaN and zero data);
an E2M1 code (sign s, magnitude m) of block i becomes the E4M3 byte s << 7 | T[min(emax - e_i, 19)][m],
where T[d][m] = encode_elements(decode_elements(m) * 2^(6 - d), E4M3) is computed once by the spec
itself (``shift_table``): the E2M1 value shifted by the scale difference and rounded to nearest even
into E4M3 (exact down to E4M3's subnormals; from d = 19 on every value rounds to zero). A zero keeps
its sign, as the spec's encoder does.
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
from moe_fp4.ep import sms


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on t's device (CUDA, Triton installed, not turned off); with
    TRITON_INTERPRET=1 they also run on CPU tensors (tests)."""
    if triton is None or os.environ.get("MOE_FP4_EP_TRITON", "1") == "0":
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _convert_groups(row, g, n_groups, lut_ptr, HALF):
        """MXFP4 byte row ``row`` (pointer), groups g [G] of 128 elements -> (E4M3 byte pairs int16
        [G, 4, 16] (element 2j in the low byte), FP32 scale bits int32 [G], pair offsets and masks)."""
        blk = tl.arange(0, 4)
        j = tl.arange(0, 16)
        gmask = g < n_groups
        off3 = g[:, None, None] * 64 + blk[None, :, None] * 16 + j[None, None, :]  # packed byte of (group, block, j)
        mask3 = gmask[:, None, None] & (off3 >= 0)
        p = tl.load(row + off3, mask=mask3, other=0).to(tl.int32)
        e = tl.load(row + HALF + g[:, None] * 4 + blk[None, :], mask=gmask[:, None] & (blk[None, :] >= 0),
                    other=0).to(tl.int32)
        emax = tl.max(e, axis=1)
        d = tl.minimum(emax[:, None] - e, 19)  # _LUT_ROWS - 1
        lo_tab = tl.load(lut_ptr + d * 2)[:, :, None]  # E4M3 magnitudes of E2M1 magnitudes 0..3 at shift d
        hi_tab = tl.load(lut_ptr + d * 2 + 1)[:, :, None]  # ... of 4..7
        c0 = p & 15
        c1 = p >> 4
        m0 = c0 & 7
        m1 = c1 & 7
        t0 = tl.where(m0 >= 4, hi_tab, lo_tab)
        t1 = tl.where(m1 >= 4, hi_tab, lo_tab)
        b0 = ((t0 >> ((m0 & 3) << 3)) & 255) | ((c0 & 8) << 4)
        b1 = ((t1 >> ((m1 & 3) << 3)) & 255) | ((c1 & 8) << 4)
        nan = emax == 255
        pair = tl.where(nan[:, None, None], 0, b0 | (b1 << 8)).to(tl.int16)
        bits = tl.where(emax >= 7, (emax - 6) << 23, 1 << tl.minimum(emax + 16, 22))
        bits = tl.where(nan, 0x7FC00000, bits)
        return pair, bits, off3, mask3, gmask

    # Every kernel loops over its work items (a row and a block of columns: item = row * col_blocks +
    # block): program p takes items p, p + grid, ..., so a grid bounded by the SM budget
    # (moe_fp4.ep.sms) gives the same bits as one program per item (the default).

    @triton.jit
    def _mxfp4_to_fp8_gather_kernel(rows_ptr, index_ptr, lut_ptr, data_ptr, scales_ptr, row_stride, n_groups, HALF,
                                    n, col_blocks, GROUPS: tl.constexpr):
        for item in range(tl.program_id(0), n * col_blocks, tl.num_programs(0)):
            i = (item // col_blocks).to(tl.int64)
            g = (item % col_blocks) * GROUPS + tl.arange(0, GROUPS)
            src = tl.load(index_ptr + i)
            pair, bits, off3, mask3, gmask = _convert_groups(rows_ptr + src * row_stride, g, n_groups, lut_ptr, HALF)
            tl.store(data_ptr + i * HALF + off3, pair, mask=mask3)
            tl.store(scales_ptr + i * n_groups + g, bits, mask=gmask)

    @triton.jit
    def _mxfp4_to_fp8_scatter_kernel(rows_ptr, slot_ptr, lut_ptr, data_ptr, scales_ptr, row_stride, n_groups, HALF,
                                     n, col_blocks, K: tl.constexpr, GROUPS: tl.constexpr):
        for item in range(tl.program_id(0), n * col_blocks, tl.num_programs(0)):
            t = (item // col_blocks).to(tl.int64)
            g = (item % col_blocks) * GROUPS + tl.arange(0, GROUPS)
            pair, bits, off3, mask3, gmask = _convert_groups(rows_ptr + t * row_stride, g, n_groups, lut_ptr, HALF)
            for j in tl.static_range(K):  # converted once, written to each of the token's output rows
                r = tl.load(slot_ptr + t * K + j)
                if r >= 0:
                    tl.store(data_ptr + r * HALF + off3, pair, mask=mask3)
                    tl.store(scales_ptr + r * n_groups + g, bits, mask=gmask)

    @triton.jit
    def _copy_rows_kernel(out_ptr, out_addr, index_ptr, rank_ptr, bases_ptr, words, n, col_blocks,
                          WORD: tl.constexpr, BLOCK: tl.constexpr):
        # unbounded: one program per (row, BLOCK words): many small programs keep many loads in
        # flight, which is what reads over NVLink need (a persistent kernel on a quarter of the SMs
        # measured 1.6x slower on 2 H200s)
        for item in range(tl.program_id(0), n * col_blocks, tl.num_programs(0)):
            i = (item // col_blocks).to(tl.int64)
            r = tl.load(rank_ptr + i)
            # the source buffer as an offset from out, in words (both addresses are word-aligned)
            rel = (tl.load(bases_ptr + r) - out_addr) // WORD + tl.load(index_ptr + i) * words
            cols = (item % col_blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < words
            v = tl.load(out_ptr + rel + cols, mask=mask)
            tl.store(out_ptr + i * words + cols, v, mask=mask)


_LUT_ROWS = 20  # scale differences 0..19; from 19 on every E2M1 value rounds to zero in E4M3
_LUTS: dict = {}


def shift_table(device) -> torch.Tensor:
    """int32 [20, 2]: for a scale difference d (row, clamped to 19), the E4M3 magnitude byte of each
    E2M1 magnitude m (byte m % 4 of word m // 4), computed by the spec: encode_elements(
    decode_elements(m) * 2^(6 - d), E4M3). Built once per device (a host-to-device copy)."""
    device = torch.device(device)
    if device not in _LUTS:
        d = torch.arange(_LUT_ROWS).repeat_interleave(8)
        m = torch.arange(8).repeat(_LUT_ROWS)
        values = formats.decode_elements(m.to(torch.uint8), formats.E2M1) * formats.pow2_float32(
            formats.FP8_HEADROOM_EXP - d)
        codes = formats.encode_elements(values, formats.E4M3).to(torch.int64).reshape(_LUT_ROWS, 2, 4)
        if codes[-1].any():
            raise RuntimeError("shift_table: the last row must be all zeros")
        words = (codes << (8 * torch.arange(4))).sum(-1).to(torch.int32)
        _LUTS[device] = words.to(device)
    return _LUTS[device]


def _check_fp8_rows(rows, hidden):
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != formats.mxfp4_row_bytes(hidden):
        raise ValueError(f"rows: expected uint8 [n, {formats.mxfp4_row_bytes(hidden)}], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    if hidden % formats.FP8_GROUP:
        raise ValueError(f"hidden: expected a multiple of {formats.FP8_GROUP}, got {hidden}")
    if rows.shape[0] and rows.stride(1) != 1:
        raise ValueError(f"rows: expected a contiguous last dimension, got strides {rows.stride()}")


_GROUPS = 8  # 128-element groups per program


def mxfp4_rows_to_fp8_scatter(rows: torch.Tensor, hidden: int, slot_table: torch.Tensor,
                              num_rows: int, *, num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4RowToFP8Row fused with the expansion to expert rows: rows uint8 [n, H/2 + H/32] (one per
    received token), slot_table int64 [n, K] (the output row of each (token, slot), -1: none; every
    output row named exactly once) -> (float8_e4m3fn [num_rows, H], float32 [num_rows, H/128]):
    output row slot_table[t, j] is ``formats.mxfp4_to_fp8_blockwise`` of rows[t], bit for bit. Each
    token is converted once and written to each of its rows. num_sms: the SM budget (moe_fp4.ep.sms;
    None: one program per (token, group block))."""
    _check_fp8_rows(rows, hidden)
    if slot_table.dtype != torch.int64 or slot_table.dim() != 2 or slot_table.shape[0] != rows.shape[0]:
        raise ValueError(f"slot_table: expected int64 [{rows.shape[0]}, K], got {slot_table.dtype} "
                         f"{tuple(slot_table.shape)}")
    n_groups = hidden // formats.FP8_GROUP
    data = torch.empty(num_rows, hidden, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(num_rows, n_groups, dtype=torch.int32, device=rows.device)
    if rows.shape[0] and num_rows:
        table, lut = slot_table.contiguous(), shift_table(rows.device)

        def launch(config):
            groups, warps = config
            col_blocks = triton.cdiv(n_groups, groups)
            work = rows.shape[0] * col_blocks
            _mxfp4_to_fp8_scatter_kernel[(sms.grid(work, sms.max_programs(num_sms, rows.device, warps)),)](
                rows, table, lut, data.view(torch.int16), scales, rows.stride(0), n_groups, hidden // 2,
                rows.shape[0], col_blocks, K=table.shape[1], GROUPS=groups, num_warps=warps)

        launch(_scatter_config(rows.device, hidden, table.shape[1], launch))
    return data.view(torch.float8_e4m3fn), scales.view(torch.float32)


# (128-element groups per program, warps) tried by the scatter conversion on its first call per
# (device, hidden, k); every one writes the same bits, the fastest is kept
SCATTER_CONFIGS = ((8, 4), (8, 2), (16, 4), (32, 8), (64, 8))
_SCATTER_CHOICE: dict = {}


def _scatter_config(device, hidden: int, k: int, launch) -> tuple[int, int]:
    """The fastest of SCATTER_CONFIGS for this shape, timed once on CUDA (a host synchronisation on
    that first call only); the first config elsewhere."""
    key = (device, hidden, k)
    if key not in _SCATTER_CHOICE:
        if device.type != "cuda":
            _SCATTER_CHOICE[key] = SCATTER_CONFIGS[0]
            return SCATTER_CONFIGS[0]
        best, best_ms = SCATTER_CONFIGS[0], float("inf")
        for config in SCATTER_CONFIGS:
            try:
                launch(config)  # compiles
            except Exception:  # a config this GPU or Triton cannot run: skip it
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                launch(config)
            end.record()
            end.synchronize()
            if start.elapsed_time(end) < best_ms:
                best, best_ms = config, start.elapsed_time(end)
        _SCATTER_CHOICE[key] = best
    return _SCATTER_CHOICE[key]


def mxfp4_rows_to_fp8_gather(rows: torch.Tensor, hidden: int, index: torch.Tensor, *,
                             num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows uint8 [n, H/2 + H/32] (``formats.pack_mxfp4_rows`` layout, last dimension contiguous),
    hidden H (a multiple of 128), index int64 [N] rows to convert -> (float8_e4m3fn [N, H],
    float32 [N, H/128]), bit for bit ``formats.mxfp4_to_fp8_blockwise`` of ``rows[index]``.
    num_sms: the SM budget (moe_fp4.ep.sms)."""
    _check_fp8_rows(rows, hidden)
    if index.dtype != torch.int64 or index.dim() != 1:
        raise ValueError(f"index: expected int64 [N], got {index.dtype} {tuple(index.shape)}")
    n = index.shape[0]
    n_groups = hidden // formats.FP8_GROUP
    data = torch.empty(n, hidden, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(n, n_groups, dtype=torch.int32, device=rows.device)
    if n:
        col_blocks = triton.cdiv(n_groups, _GROUPS)
        grid = (sms.grid(n * col_blocks, sms.max_programs(num_sms, rows.device)),)
        _mxfp4_to_fp8_gather_kernel[grid](rows, index, shift_table(rows.device), data.view(torch.int16), scales,
                                          rows.stride(0), n_groups, hidden // 2, n, col_blocks, GROUPS=_GROUPS,
                                          num_warps=sms.TRITON_WARPS)
    return data.view(torch.float8_e4m3fn), scales.view(torch.float32)


def copy_rows(out: torch.Tensor, index: torch.Tensor, src_rank: torch.Tensor, bases: torch.Tensor, *,
              num_sms: int | None = None) -> torch.Tensor:
    """out uint8 [N, B] (contiguous) <- row index[i] (int64 [N]) of the buffer of rank src_rank[i]
    (int64 [N]); bases int64 [W]: each rank's buffer address (rows of B bytes back to back). Rows
    move as 4-byte words when B allows it, else as bytes. num_sms: the SM budget (moe_fp4.ep.sms)."""
    n, width = out.shape
    if out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous uint8 rows, got {out.dtype} {tuple(out.shape)}")
    if n == 0 or width == 0:
        return out
    word = torch.int32 if width % 4 == 0 else torch.uint8
    words = width // word.itemsize
    block = min(1024, triton.next_power_of_2(words))
    col_blocks = triton.cdiv(words, block)
    grid = (sms.grid(n * col_blocks, sms.max_programs(num_sms, out.device)),)
    _copy_rows_kernel[grid](out.view(word), out.data_ptr(), index, src_rank, bases, words, n, col_blocks,
                            WORD=word.itemsize, BLOCK=block, num_warps=sms.TRITON_WARPS)
    return out


__all__ = ["available", "copy_rows", "mxfp4_rows_to_fp8_gather", "mxfp4_rows_to_fp8_scatter", "shift_table"]
