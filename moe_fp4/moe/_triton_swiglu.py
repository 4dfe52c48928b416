"""SwiGLU of the fused gate/up projection, forward and backward, in one pass each (Triton on CUDA;
the torch formula elsewhere). y1 [M, 2I] holds the gate in columns [0, I) and the up projection in
[I, 2I); the arithmetic is float32, the results bfloat16. An optional float32 weight per row (the
token's top-k weight) multiplies the output: the expert layer then applies the routing weights
itself and the combine keeps nothing for backward; the backward also gives the weights' gradient
(each row's dot product of the output gradient and the unweighted SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_fp4.moe._triton_grouped_gemm import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_kernel(y1_ptr, w_ptr, h_ptr, m, inter, HAS_W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < m) & (cols[None, :] < inter)
        src = y1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(src + inter, mask=ok, other=0.0).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up
        if HAS_W:
            h = h * tl.load(w_ptr + rows, mask=rows < m, other=0.0)[:, None]
        tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _swiglu_backward_kernel(dh_ptr, y1_ptr, w_ptr, dy1_ptr, dw_ptr, m, inter, HAS_W: tl.constexpr,
                                BR: tl.constexpr, BC: tl.constexpr):
        # whole rows per program: the weight's gradient sums over the row in a fixed order
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        row_ok = rows < m
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
            dw = tl.zeros((BR,), dtype=tl.float32)
        for c0 in range(0, inter, BC):
            cols = c0 + tl.arange(0, BC)
            ok = row_ok[:, None] & (cols[None, :] < inter)
            src = y1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
            gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(src + inter, mask=ok, other=0.0).to(tl.float32)
            dh = tl.load(dh_ptr + rows[:, None] * inter + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            if HAS_W:
                dw += tl.sum(dh * (gate * sig * up), axis=1)
                dh = dh * w[:, None]
            d_gate = dh * up * sig * (1 + gate * (1 - sig))
            d_up = dh * gate * sig
            dst = dy1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
            tl.store(dst, d_gate.to(tl.bfloat16), mask=ok)
            tl.store(dst + inter, d_up.to(tl.bfloat16), mask=ok)
        if HAS_W:
            tl.store(dw_ptr + rows, dw, mask=row_ok)


def swiglu(y1: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (times row_weights float32 [M] per row when given): bfloat16 [M, I] from y1
    [M, 2I] (contiguous)."""
    m, two_i = y1.shape
    inter = two_i // 2
    if not available(y1):
        gate, up = y1.float().chunk(2, dim=-1)
        h = F.silu(gate) * up
        if row_weights is not None:
            h = h * row_weights.float().unsqueeze(1)
        return h.to(torch.bfloat16)
    h = torch.empty(m, inter, dtype=torch.bfloat16, device=y1.device)
    if m:
        w = row_weights if row_weights is not None else y1
        _swiglu_kernel[(triton.cdiv(m, 32), triton.cdiv(inter, 128))](
            y1, w, h, m, inter, HAS_W=row_weights is not None, BR=32, BC=128, num_warps=4)
    return h


def swiglu_backward(dh: torch.Tensor, y1: torch.Tensor, row_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the gradient of y1: bfloat16 [M, 2I], the gradient of row_weights: float32 [M] or None) from
    dh [M, I], the gradient of ``swiglu(y1, row_weights)`` (dh and y1 contiguous)."""
    m, two_i = y1.shape
    inter = two_i // 2
    if not available(y1):
        gate, up = y1.float().chunk(2, dim=-1)
        dhf = dh.float()
        sig = torch.sigmoid(gate)
        dw = None
        if row_weights is not None:
            dw = (dhf * (gate * sig * up)).sum(dim=1)
            dhf = dhf * row_weights.float().unsqueeze(1)
        dy1 = torch.cat((dhf * up * sig * (1 + gate * (1 - sig)), dhf * gate * sig), dim=-1).to(torch.bfloat16)
        return dy1, dw
    dy1 = torch.empty(m, two_i, dtype=torch.bfloat16, device=y1.device)
    dw = torch.empty(m, dtype=torch.float32, device=y1.device) if row_weights is not None else None
    if m:
        w = row_weights if row_weights is not None else y1
        _swiglu_backward_kernel[(triton.cdiv(m, 16),)](dh, y1, w, dy1, dw if dw is not None else dy1, m, inter,
                                                       HAS_W=row_weights is not None, BR=16, BC=128, num_warps=4)
    return dy1, dw
