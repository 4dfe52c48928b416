"""Nibble packing of 4-bit codes and the byte-row layouts of an MXFP4 and an NVFP4 token.

Packing: element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble (the
convention of ``torch.float4_e2m1fn_x2``, the OCP tooling and TransformerEngine).

MXFP4 byte row: one token of hidden size H as ``H/2`` packed data bytes followed by its ``H/32``
UE8M0 scale bytes, ``H/2 + H/32`` bytes in all: the unit that the dispatch all-to-all sends.

NVFP4 byte row: ``H/2`` packed data bytes, ``H/16`` E4M3 block scale bytes, then the 4 bytes of the
FP32 tensor scale (little endian), ``H/2 + H/16 + 4`` bytes: every row carries the tensor scale of
the batch it was quantized with, so rows of several senders can be decoded together.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import check_multiple, check_tensor, value_checks

NVFP4_ROW_BLOCK = 16  # elements per E4M3 block scale (formats.nvfp4.NVFP4_BLOCK)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] 4-bit codes (values < 16), K even -> uint8 [..., K/2]."""
    check_tensor(codes, "codes", dtypes=(torch.uint8,), min_dim=1)
    check_multiple(codes.shape[-1], 2, "codes")
    if value_checks() and codes.numel() and int(codes.max()) > 0xF:
        raise ValueError("codes: 4-bit codes must be below 16")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] 4-bit codes."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_row_bytes(hidden: int) -> int:
    """Bytes of one MXFP4 byte row of hidden size ``hidden``: hidden/2 data + hidden/32 scales."""
    check_multiple(hidden, 32, "hidden", "value")
    return hidden // 2 + hidden // 32


def pack_mxfp4_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [T, H/2] + scales uint8 [T, H/32] -> byte rows uint8 [T, H/2 + H/32]."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * 16:
        raise ValueError(
            f"scales: expected shape {(*packed.shape[:-1], packed.shape[-1] // 16)} for packed of shape "
            f"{tuple(packed.shape)}, got {tuple(scales.shape)}"
        )
    return torch.cat((packed, scales), dim=-1)


def unpack_mxfp4_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """byte rows uint8 [T, H/2 + H/32] -> (packed uint8 [T, H/2], scales uint8 [T, H/32])."""
    check_tensor(rows, "rows", dtypes=(torch.uint8,), min_dim=1)
    width = mxfp4_row_bytes(hidden)
    if rows.shape[-1] != width:
        raise ValueError(f"rows: expected last dimension {width} for hidden={hidden}, got {rows.shape[-1]}")
    return rows[..., : hidden // 2], rows[..., hidden // 2 :]


def nvfp4_row_bytes(hidden: int) -> int:
    """Bytes of one NVFP4 byte row: hidden/2 data + hidden/16 E4M3 scales + 4 (FP32 tensor scale)."""
    check_multiple(hidden, NVFP4_ROW_BLOCK, "hidden", "value")
    return hidden // 2 + hidden // NVFP4_ROW_BLOCK + 4


def pack_nvfp4_rows(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [T, H/2] + scales float8_e4m3fn [T, H/16] + global_scale float32 0-dim or [T]
    -> byte rows uint8 [T, H/2 + H/16 + 4] (formats.quantize_nvfp4's 1x16 output, one row a token)."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), dim=2)
    check_tensor(scales, "scales", dtypes=(torch.float8_e4m3fn,), dim=2)
    check_tensor(global_scale, "global_scale", dtypes=(torch.float32,))
    t = packed.shape[0]
    if tuple(scales.shape) != (t, packed.shape[1] // 8) or packed.shape[1] % 8:
        raise ValueError(f"scales: expected shape {(t, packed.shape[1] // 8)} for packed of shape "
                         f"{tuple(packed.shape)}, got {tuple(scales.shape)}")
    if global_scale.dim() != 0 and tuple(global_scale.shape) != (t,):
        raise ValueError(f"global_scale: expected a 0-dim tensor or shape ({t},), got {tuple(global_scale.shape)}")
    gs = global_scale.reshape(-1, 1).expand(t, 1).contiguous().view(torch.uint8)
    return torch.cat((packed, scales.view(torch.uint8), gs), dim=1)


def unpack_nvfp4_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """byte rows uint8 [T, H/2 + H/16 + 4] -> (packed uint8 [T, H/2], scales float8_e4m3fn [T, H/16],
    global_scale float32 [T])."""
    check_tensor(rows, "rows", dtypes=(torch.uint8,), dim=2)
    width = nvfp4_row_bytes(hidden)
    if rows.shape[1] != width:
        raise ValueError(f"rows: expected last dimension {width} for hidden={hidden}, got {rows.shape[1]}")
    h2, h16 = hidden // 2, hidden // NVFP4_ROW_BLOCK
    scales = rows[:, h2:h2 + h16].contiguous().view(torch.float8_e4m3fn)
    gs = rows[:, h2 + h16:].contiguous().view(torch.float32).reshape(-1)
    return rows[:, :h2], scales, gs
