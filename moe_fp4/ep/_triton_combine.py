"""Combine's two reductions as one Triton kernel on CUDA (the torch path is the reference).

``gather_sum(src, table, weights)``: out[t] = sum over j = 0..K-1 with table[t, j] >= 0, ascending,
of float32(src[table[t, j]]) (times weights[t, j]), accumulated in float32 from +0 with a separate
multiply and add (no fused multiply-add), then stored as float32 or rounded to bfloat16. That is
exactly the arithmetic of backends.local_sums / rank_sums, in one pass over the rows instead of a
gather, a conversion, a multiply and an atomic scatter per slot.

Every launcher takes ``num_sms`` (the SM budget, moe_fp4.ep.sms): the kernels loop over their
work items, so a smaller grid gives the same bits.

MOE_FP4_EP_TRITON=0 turns the kernel off (the torch path runs instead).
"""

from __future__ import annotations

import os

import torch

from moe_fp4.ep import sms

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (CPU machines): the torch path is used
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("MOE_FP4_EP_TRITON", "1") != "0"


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src_ptr, table_ptr, w_ptr, out_ptr, tokens, hidden, src_stride, out_stride, col_blocks,
                           K: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, OUT_BF16: tl.constexpr):
        # work item (token t, column block c) = t * col_blocks + c; program p takes p, p + grid, ...
        for item in range(tl.program_id(0), tokens * col_blocks, tl.num_programs(0)):
            t = (item // col_blocks).to(tl.int64)
            cols = (item % col_blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(K):
                r = tl.load(table_ptr + t * K + j)
                if r >= 0:
                    v = tl.load(src_ptr + r * src_stride + cols, mask=mask, other=0.0).to(tl.float32)
                    if WEIGHTED:
                        v = v * tl.load(w_ptr + t * K + j)
                    acc = acc + v
            if OUT_BF16:
                tl.store(out_ptr + t * out_stride + cols, acc.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
            else:
                tl.store(out_ptr + t * out_stride + cols, acc, mask=mask)

    @triton.jit
    def _decode_sum_kernel(bases_ptr, table_ptr, e2m1_ptr, out_ptr, tokens, hidden, row_bytes, col_blocks,
                           W: tl.constexpr, WIRE: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
        for item in range(tl.program_id(0), tokens * col_blocks, tl.num_programs(0)):  # as _gather_sum_kernel
            t = (item // col_blocks).to(tl.int64)
            cols = (item % col_blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(W):
                row = tl.load(table_ptr + t * W + r)
                if row >= 0:
                    addr = tl.load(bases_ptr + r) + row * row_bytes  # the row's address (int64)
                    base = addr.to(tl.pointer_type(tl.uint8))
                    if WIRE == 0:  # bf16 values
                        v = tl.load(addr.to(tl.pointer_type(tl.bfloat16)) + cols, mask=mask,
                                    other=0.0).to(tl.float32)
                    elif WIRE == 1:  # fp8: E4M3 [H], then FP32 scales [H/128]
                        q = tl.load(base + cols, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                        sc = tl.load((addr + hidden).to(tl.pointer_type(tl.float32)) + cols // 128, mask=mask,
                                     other=0.0)
                        v = q * sc
                    else:  # mxfp4: packed E2M1 [H/2], then UE8M0 scales [H/32]
                        byte = tl.load(base + cols // 2, mask=mask, other=0).to(tl.int32)
                        code = tl.where(cols % 2 == 0, byte & 15, byte >> 4)
                        val = tl.load(e2m1_ptr + code, mask=mask, other=0.0)
                        e = tl.load(base + hidden // 2 + cols // 32, mask=mask, other=0).to(tl.int32)
                        sbits = tl.where(e == 0, 0x00400000, e << 23)  # 2^(e - 127); byte 0 is the subnormal 2^-127
                        sbits = tl.where(e == 255, 0x7FC00000, sbits)
                        v = val * sbits.to(tl.float32, bitcast=True)
                    acc = acc + v
            if OUT_BF16:
                tl.store(out_ptr + t * hidden + cols, acc.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
            else:
                tl.store(out_ptr + t * hidden + cols, acc, mask=mask)


_BF16_STORE_OK: dict[torch.device, bool] = {}


def check_bf16_store(device: torch.device) -> bool:
    """Whether the kernel's bfloat16 store rounds as torch's float32 -> bfloat16 cast (to nearest
    even) on ``device``; checked once per device (a host sync, so call it outside dispatch/combine).
    Where it does not, gather_sum stores float32 and torch rounds."""
    if device not in _BF16_STORE_OK:
        g = torch.Generator(device="cpu").manual_seed(0)
        src = torch.randn(64, 384, generator=g).to(device)
        table = torch.randint(-1, 64, (32, 3), generator=g).to(device)
        _BF16_STORE_OK[device] = True
        got = _launch(src, table, None, torch.bfloat16)
        want = _launch(src, table, None, torch.float32).to(torch.bfloat16)
        _BF16_STORE_OK[device] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
    return _BF16_STORE_OK[device]


def gather_sum(src: torch.Tensor, table: torch.Tensor, weights: torch.Tensor | None,
               out_dtype: torch.dtype, out: torch.Tensor | None = None, *,
               num_sms: int | None = None) -> torch.Tensor:
    """src float [n, H] (last dimension contiguous), table int64 [T, K] (rows of src, -1: none),
    weights float32 [T, K] or None -> out_dtype (float32 or bfloat16) [T, H]; out: a contiguous
    out_dtype tensor of T * H elements to write into (e.g. a staging buffer), or None;
    num_sms: the SM budget (moe_fp4.ep.sms): at most the programs that many SMs hold, looping over
    the (token, column block) items (None: one program per item)."""
    if out_dtype == torch.bfloat16 and not _BF16_STORE_OK.get(src.device, False):
        res = _launch(src, table, weights, torch.float32, num_sms=num_sms).to(torch.bfloat16)
        return res if out is None else out.view(res.shape).copy_(res)
    return _launch(src, table, weights, out_dtype, out, num_sms=num_sms)


WIRES = {"bf16": 0, "fp8": 1, "mxfp4": 2}
_E2M1: dict = {}


def _e2m1_values(device) -> torch.Tensor:
    """float32 [16]: the spec's value of each E2M1 code (built once per device)."""
    if device not in _E2M1:
        from moe_fp4 import formats

        _E2M1[device] = formats.decode_elements(torch.arange(16, dtype=torch.uint8), formats.E2M1).to(device)
    return _E2M1[device]


def decode_sum(bases: torch.Tensor, table: torch.Tensor, hidden: int, wire: str,
               out: torch.Tensor | None = None, *, num_sms: int | None = None) -> torch.Tensor:
    """Combine's last step with the decoding fused in: bases int64 [W], the address of each rank's
    rows (the same address W times for one receive buffer; peers' buffers over NVLink), table int64
    [T, W], the row for token t at rank r (-1: none), rows in the ``wire`` payload layout ("bf16",
    "fp8", "mxfp4"; see payloads.py) -> bfloat16 [T, hidden] = bf16(sum over r ascending, in float32
    from +0, of the decoded row): the spec's decode (``dequantize_fp8_blockwise``,
    ``dequantize_mxfp4``: element value times power-of-two scale in float32) then gather_sum.
    out: a contiguous bfloat16 [T, hidden] tensor to write into, or None; num_sms: as in
    gather_sum."""
    t, w = table.shape
    width = {"bf16": 2 * hidden, "fp8": hidden + hidden // 32, "mxfp4": hidden // 2 + hidden // 32}[wire]
    bf16_store = _BF16_STORE_OK.get(table.device, False)
    if out is not None and (out.dtype != torch.bfloat16 or out.shape != (t, hidden) or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous bfloat16 [{t}, {hidden}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if out is not None and not bf16_store:
        return out.copy_(decode_sum(bases, table, hidden, wire, num_sms=num_sms))
    if out is None:
        out = torch.empty(t, hidden, dtype=torch.bfloat16 if bf16_store else torch.float32, device=table.device)
    if t == 0 or hidden == 0:
        return out.to(torch.bfloat16)
    block = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
    col_blocks = triton.cdiv(hidden, block)
    grid = (sms.grid(t * col_blocks, sms.max_programs(num_sms, table.device)),)
    _decode_sum_kernel[grid](bases, table.contiguous(), _e2m1_values(table.device), out, t, hidden, width, col_blocks,
                             W=w, WIRE=WIRES[wire], BLOCK=block, OUT_BF16=bf16_store, enable_fp_fusion=False,
                             num_warps=sms.TRITON_WARPS)
    return out if bf16_store else out.to(torch.bfloat16)


def gather_sum_peers(bases: torch.Tensor, table: torch.Tensor, hidden: int, *,
                     num_sms: int | None = None) -> torch.Tensor:
    """decode_sum of bfloat16 rows: bases int64 [W] (each rank's buffer of bfloat16 rows of ``hidden``),
    table int64 [T, W] -> bfloat16 [T, hidden]."""
    return decode_sum(bases, table, hidden, "bf16", num_sms=num_sms)


def _launch(src, table, weights, out_dtype, out=None, num_sms=None):
    t, k = table.shape
    hidden = src.shape[1]
    if out is None:
        out = torch.empty(t, hidden, dtype=out_dtype, device=src.device)
    else:
        if out.dtype != out_dtype or out.numel() != t * hidden or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {out_dtype} tensor of {t * hidden} elements, got "
                             f"{out.dtype} {tuple(out.shape)}")
        out = out.view(t, hidden)
    if t == 0 or hidden == 0:
        return out
    if src.stride(1) != 1:
        src = src.contiguous()
    table = table.contiguous()
    block = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
    col_blocks = triton.cdiv(hidden, block)
    grid = (sms.grid(t * col_blocks, sms.max_programs(num_sms, src.device)),)
    w = weights.contiguous() if weights is not None else table  # unused when not weighted
    _gather_sum_kernel[grid](src, table, w, out, t, hidden, src.stride(0), out.stride(0), col_blocks, K=k,
                             BLOCK=block, WEIGHTED=weights is not None, OUT_BF16=out_dtype == torch.bfloat16,
                             enable_fp_fusion=False, num_warps=sms.TRITON_WARPS)
    return out


__all__ = ["WIRES", "available", "check_bf16_store", "decode_sum", "gather_sum", "gather_sum_peers"]
