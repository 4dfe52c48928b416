"""SwiGLU of the fused gate/up projection, forward and backward, in one pass each (Triton on CUDA;
the torch formula elsewhere). y1 [M, 2I] holds the gate in columns [0, I) and the up projection in
[I, 2I); the arithmetic is float32, the results bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_fp4.moe._triton_grouped_gemm import available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_kernel(y1_ptr, h_ptr, m, inter, BR: tl.constexpr, BC: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < m) & (cols[None, :] < inter)
        src = y1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(src + inter, mask=ok, other=0.0).to(tl.float32)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _swiglu_backward_kernel(dh_ptr, y1_ptr, dy1_ptr, m, inter, BR: tl.constexpr, BC: tl.constexpr):
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (rows[:, None] < m) & (cols[None, :] < inter)
        src = y1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
        gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(src + inter, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + rows[:, None] * inter + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = dh * up * sig * (1 + gate * (1 - sig))
        d_up = dh * gate * sig
        dst = dy1_ptr + rows[:, None] * (2 * inter) + cols[None, :]
        tl.store(dst, d_gate.to(tl.bfloat16), mask=ok)
        tl.store(dst + inter, d_up.to(tl.bfloat16), mask=ok)


def _grid(m, inter):
    return (triton.cdiv(m, 32), triton.cdiv(inter, 128))


def swiglu(y1: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: bfloat16 [M, I] from y1 [M, 2I] (contiguous)."""
    m, two_i = y1.shape
    inter = two_i // 2
    if not available(y1):
        gate, up = y1.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(torch.bfloat16)
    h = torch.empty(m, inter, dtype=torch.bfloat16, device=y1.device)
    if m:
        _swiglu_kernel[_grid(m, inter)](y1, h, m, inter, BR=32, BC=128, num_warps=4)
    return h


def swiglu_backward(dh: torch.Tensor, y1: torch.Tensor) -> torch.Tensor:
    """The gradient of y1 [M, 2I] from dh [M, I] (both contiguous): bfloat16 [M, 2I]."""
    m, two_i = y1.shape
    inter = two_i // 2
    if not available(y1):
        gate, up = y1.float().chunk(2, dim=-1)
        dhf = dh.float()
        sig = torch.sigmoid(gate)
        return torch.cat((dhf * up * sig * (1 + gate * (1 - sig)), dhf * gate * sig), dim=-1).to(torch.bfloat16)
    dy1 = torch.empty(m, two_i, dtype=torch.bfloat16, device=y1.device)
    if m:
        _swiglu_backward_kernel[_grid(m, inter)](dh, y1, dy1, m, inter, BR=32, BC=128, num_warps=4)
    return dy1
