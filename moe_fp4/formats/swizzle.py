"""The Blackwell tensor-core scale layout (``to_blocked`` in cuBLAS terms), and its inverse.

A scale matrix [rows, cols] (one byte per 1x32 or 1x16 block) is padded to multiples of 128 rows and
4 columns with zeros and cut into 128x4 tiles, stored tile after tile in row-major tile order. Inside
a tile, scale (r, c) goes to byte ``(r % 32) * 16 + (r // 32) * 4 + c``: rows interleave as
0, 32, 64, 96, 1, 33, ... with the 4 columns of each row adjacent.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import check_tensor

_TILE_ROWS, _TILE_COLS = 128, 4


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def to_blackwell_scale_layout(scales: torch.Tensor) -> torch.Tensor:
    """scales [rows, cols] (uint8 or float8_e4m3fn) -> 1-D, ceil(rows/128)*128 * ceil(cols/4)*4 bytes."""
    check_tensor(scales, "scales")
    if scales.dim() != 2:
        raise ValueError(f"scales: expected 2 dimensions [rows, cols], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    rt, ct = _ceil(rows, _TILE_ROWS), _ceil(cols, _TILE_COLS)
    padded = torch.zeros(rt * _TILE_ROWS, ct * _TILE_COLS, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = scales.view(torch.uint8)
    t = padded.reshape(rt, 4, 32, ct, _TILE_COLS).permute(0, 3, 2, 1, 4)  # [rt, ct, r%32, r//32, c]
    return t.reshape(-1).view(scales.dtype)


def from_blackwell_scale_layout(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blackwell_scale_layout``: 1-D swizzled bytes -> [rows, cols]."""
    check_tensor(swizzled, "swizzled")
    rt, ct = _ceil(rows, _TILE_ROWS), _ceil(cols, _TILE_COLS)
    want = rt * _TILE_ROWS * ct * _TILE_COLS
    if swizzled.dim() != 1 or swizzled.numel() != want:
        raise ValueError(f"swizzled: expected 1-D with {want} elements for rows={rows}, cols={cols}, "
                         f"got shape {tuple(swizzled.shape)}")
    t = swizzled.view(torch.uint8).reshape(rt, ct, 32, 4, _TILE_COLS).permute(0, 3, 2, 1, 4)
    return t.reshape(rt * _TILE_ROWS, ct * _TILE_COLS)[:rows, :cols].contiguous().view(swizzled.dtype)
