"""Nibble packing of 4-bit codes and the byte-row layout of an MXFP4 token.

Packing: element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble (the
convention of ``torch.float4_e2m1fn_x2``, the OCP tooling and TransformerEngine).

MXFP4 byte row: one token of hidden size H as ``H/2`` packed data bytes followed by its ``H/32``
UE8M0 scale bytes, ``H/2 + H/32`` bytes in all: the unit that the dispatch all-to-all sends.

(The NVFP4 byte row is in formats.nvfp4.)
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import check_multiple, check_tensor, value_checks


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

