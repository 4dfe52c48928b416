"""Combine's two reductions as one Triton kernel on CUDA (the torch path is the reference).

``gather_sum(src, table, weights)``: out[t] = sum over j = 0..K-1 with table[t, j] >= 0, ascending,
of float32(src[table[t, j]]) (times weights[t, j]), accumulated in float32 from +0 with a separate
multiply and add (no fused multiply-add), then stored as float32 or rounded to bfloat16. That is
exactly the arithmetic of Buffer._local_sums / _rank_sums, in one pass over the rows instead of a
gather, a conversion, a multiply and an atomic scatter per slot.

MOE_FP4_EP_TRITON=0 turns the kernel off (the torch path runs instead).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (CPU machines): the torch path is used
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("MOE_FP4_EP_TRITON", "1") != "0"


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src_ptr, table_ptr, w_ptr, out_ptr, hidden, src_stride, out_stride,
                           K: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr,
                           OUT_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
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
    def _gather_sum_peers_kernel(bases_ptr, table_ptr, out_ptr, hidden, W: tl.constexpr, BLOCK: tl.constexpr,
                                 OUT_BF16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(W):
            row = tl.load(table_ptr + t * W + r)
            if row >= 0:
                base = tl.load(bases_ptr + r).to(tl.pointer_type(tl.bfloat16))
                acc = acc + tl.load(base + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
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
               out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """src float [n, H] (last dimension contiguous), table int64 [T, K] (rows of src, -1: none),
    weights float32 [T, K] or None -> out_dtype (float32 or bfloat16) [T, H]; out: a contiguous
    out_dtype tensor of T * H elements to write into (e.g. a staging buffer), or None."""
    if out_dtype == torch.bfloat16 and not _BF16_STORE_OK.get(src.device, False):
        res = _launch(src, table, weights, torch.float32).to(torch.bfloat16)
        if out is not None:
            out.view(res.shape).copy_(res)
            return out.view(res.shape)
        return res
    return _launch(src, table, weights, out_dtype, out)


def gather_sum_peers(bases: torch.Tensor, table: torch.Tensor, hidden: int) -> torch.Tensor:
    """bases int64 [W]: each rank's buffer address (bfloat16 rows of ``hidden`` back to back, readable
    from this GPU); table int64 [T, W]: the row of rank r's buffer for token t, -1: none ->
    bfloat16 [T, hidden]: sum over r ascending in float32 from +0, rounded to bfloat16 (the
    arithmetic of gather_sum with the rows spread over the ranks' buffers)."""
    t, w = table.shape
    bf16_store = _BF16_STORE_OK.get(table.device, False)
    out = torch.empty(t, hidden, dtype=torch.bfloat16 if bf16_store else torch.float32, device=table.device)
    if t == 0 or hidden == 0:
        return out.to(torch.bfloat16)
    block = 1024 if hidden >= 1024 else triton.next_power_of_2(hidden)
    grid = (t, triton.cdiv(hidden, block))
    _gather_sum_peers_kernel[grid](bases, table.contiguous(), out, hidden, W=w, BLOCK=block, OUT_BF16=bf16_store,
                                   enable_fp_fusion=False, num_warps=4)
    return out if bf16_store else out.to(torch.bfloat16)


def _launch(src, table, weights, out_dtype, out=None):
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
    grid = (t, triton.cdiv(hidden, block))
    w = weights.contiguous() if weights is not None else table  # unused when not weighted
    _gather_sum_kernel[grid](src, table, w, out, hidden, src.stride(0), out.stride(0), K=k, BLOCK=block,
                             WEIGHTED=weights is not None, OUT_BF16=out_dtype == torch.bfloat16,
                             enable_fp_fusion=False, num_warps=4)
    return out


__all__ = ["available", "check_bf16_store", "gather_sum", "gather_sum_peers"]
