"""FP8 blockwise: E4M3 data with one FP32 power-of-two scale per 1x128 (activations, gradients) or
128x128 (weights) block, the operand format of Hopper FP8 GEMMs (DeepSeek-V3 style).

Rules (the spec): scale = 2^(byte - 127) with ``byte = mx_scale_bytes(amax, E4M3, "up")`` (amax/448
rounded up to a power of two in bit space); data = e4m3(x / scale) (exact division by a power of
two, round to nearest even, saturating). A zero block has scale 2^-127 and zero data. A block holding
NaN or +-Inf has scale NaN and zero data. Scales multiply: x ~= data * scale.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import as_float32, check_multiple, check_tensor
from moe_fp4.formats.elements import E4M3, UE8M0_NAN, decode_ue8m0, encode_elements, mx_scale_bytes, pow2_float32


def _check_block(block) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"block: expected a pair of positive ints such as (1, 128), got {block!r}")
    return int(block[0]), int(block[1])


def _tiles(xf: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """[..., M, K] -> [..., M/bm, K/bn, bm*bn]."""
    *lead, m, k = xf.shape
    t = xf.reshape(*lead, m // bm, bm, k // bn, bn).transpose(-3, -2)
    return t.reshape(*lead, m // bm, k // bn, bm * bn)


def _untiles(t: torch.Tensor, shape, bm: int, bn: int) -> torch.Tensor:
    *lead, m, k = shape
    return t.reshape(*lead, m // bm, k // bn, bm, bn).transpose(-3, -2).reshape(shape)


def quantize_fp8_blockwise(x: torch.Tensor, *, block=(1, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32/bfloat16/float16 [..., M, K] (or [K] for 1xN blocks), M % block[0] == 0,
    K % block[1] == 0. Returns (data float8_e4m3fn, the shape of x;
    scales float32 [..., M/block[0], K/block[1]] (for block (1, n): [..., M, K/n]))."""
    bm, bn = _check_block(block)
    xf = as_float32(x)
    if xf.dim() == 0:
        raise ValueError("x: expected at least 1 dimension")
    squeeze = xf.dim() == 1
    if squeeze:
        if bm != 1:
            raise ValueError(f"x: a 1-D input needs block (1, n), got block {block!r}")
        xf = xf.unsqueeze(0)
    check_multiple(xf.shape[-1], bn, "x")
    check_multiple(xf.shape[-2], bm, "x", "second-to-last dimension")
    tiles = _tiles(xf, bm, bn)
    sbytes = mx_scale_bytes(tiles.abs().amax(dim=-1), E4M3, "up")
    nan_tile = (sbytes == UE8M0_NAN).unsqueeze(-1)
    scaled = tiles * pow2_float32(127 - sbytes.to(torch.int64)).unsqueeze(-1)
    scaled = torch.where(nan_tile, torch.zeros_like(scaled), scaled)
    data = _untiles(encode_elements(scaled, E4M3), xf.shape, bm, bn).view(torch.float8_e4m3fn)
    scales = decode_ue8m0(sbytes)
    if squeeze:
        data, scales = data.squeeze(0), scales.squeeze(0)
    return data, scales


def dequantize_fp8_blockwise(
    data: torch.Tensor, scales: torch.Tensor, *, block=(1, 128), dtype=torch.float32
) -> torch.Tensor:
    """data float8_e4m3fn [..., M, K], scales float32 [..., M/bm, K/bn] -> ``dtype`` [..., M, K]."""
    bm, bn = _check_block(block)
    check_tensor(data, "data", dtypes=(torch.float8_e4m3fn,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.float32,), min_dim=1)
    squeeze = data.dim() == 1
    d = data.unsqueeze(0) if squeeze else data
    s = scales.unsqueeze(0) if squeeze else scales
    check_multiple(d.shape[-1], bn, "data")
    check_multiple(d.shape[-2], bm, "data", "second-to-last dimension")
    want = (*d.shape[:-2], d.shape[-2] // bm, d.shape[-1] // bn)
    if tuple(s.shape) != want:
        raise ValueError(f"scales: expected shape {want[1:] if squeeze else want}, got {tuple(scales.shape)}")
    out = _tiles(d.to(torch.float32), bm, bn) * s.unsqueeze(-1)
    out = _untiles(out, d.shape, bm, bn)
    return (out.squeeze(0) if squeeze else out).to(dtype)


def quantize_fp8_e4m3_rowwise_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row (a whole-row block): x float [..., K] -> (e4m3 [..., K],
    float32 [..., 1]). Used where a GEMM takes row-wise scales."""
    xf = as_float32(x)
    return quantize_fp8_blockwise(xf, block=(1, xf.shape[-1]))


__all__ = ["quantize_fp8_blockwise", "dequantize_fp8_blockwise", "quantize_fp8_e4m3_rowwise_pow2", "E4M3"]
