"""MX block quantization (OCP Microscaling): blocks of 32 elements sharing one UE8M0 scale byte.

Rules (the spec; every kernel and payload codec matches them bit for bit):
  * block: 32 consecutive elements along ``axis`` (rows, 1x32, with axis=-1; columns, 32x1, with
    axis=-2);
  * scale byte from the block's absolute maximum, see ``mx_scale_bytes``: ``"up"`` (default) rounds
    amax / max_value up to a power of two in bit space, ``"down"`` is the OCP floor;
  * elements: x * 2^(127 - byte) (exact in float32), then the element codec (round to nearest even
    or stochastic, saturating);
  * all-zero block: scale byte 0 and zero data;
  * a block holding NaN or +-Inf: scale byte 0xFF and all element codes 0, so it decodes to NaN.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import as_float32, check_multiple, check_tensor
from moe_fp4.formats.elements import (
    E2M1,
    UE8M0_NAN,
    decode_elements,
    decode_ue8m0,
    element_format,
    encode_elements,
    mx_scale_bytes,
    pow2_float32,
)
from moe_fp4.formats.packing import pack_fp4, unpack_fp4

MX_BLOCK = 32
MXFP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MXFP6_FORMATS = ("e2m3", "e3m2")


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {axis} is out of range for a tensor of {ndim} dimension(s)")
    return axis % ndim


def quantize_mx(
    x: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    scale_rounding: str = "up",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``x`` with element format ``fmt`` in blocks of 32 along ``axis``.

    x: float32/bfloat16/float16 [..., K, ...] with K (the size along ``axis``) a multiple of 32.
    Returns (codes uint8, same shape as x, one code per byte;
             scales uint8, x's shape with K replaced by K/32).
    """
    f = element_format(fmt)
    xf = as_float32(x)
    if xf.dim() == 0:
        raise ValueError("x: expected at least 1 dimension")
    ax = _normalize_axis(axis, xf.dim())
    check_multiple(xf.shape[ax], MX_BLOCK, "x", f"dimension {ax}")
    xm = xf.movedim(ax, -1)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    scales = mx_scale_bytes(amax, f, scale_rounding)
    nan_block = scales == UE8M0_NAN
    inv_scale = pow2_float32(127 - scales.to(torch.int64))  # 2^(127-byte), exact in float32
    scaled = blocks * inv_scale.unsqueeze(-1)
    scaled = torch.where(nan_block.unsqueeze(-1), torch.zeros_like(scaled), scaled)
    codes = encode_elements(scaled, f, rounding=rounding, generator=generator)
    codes = codes.reshape(xm.shape).movedim(-1, ax)
    return codes, scales.movedim(-1, ax)


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, *, axis: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_mx``: codes uint8 [..., K, ...], scales uint8 [..., K/32, ...] -> ``dtype``.

    A scale byte 0xFF decodes its whole block to NaN.
    """
    check_tensor(codes, "codes", dtypes=(torch.uint8,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    ax = _normalize_axis(axis, codes.dim())
    expected = list(codes.shape)
    check_multiple(expected[ax], MX_BLOCK, "codes", f"dimension {ax}")
    expected[ax] //= MX_BLOCK
    if list(scales.shape) != expected:
        raise ValueError(f"scales: expected shape {tuple(expected)}, got {tuple(scales.shape)}")
    values = decode_elements(codes, fmt).movedim(ax, -1)
    s = decode_ue8m0(scales).movedim(ax, -1)
    k = values.shape[-1]
    values = values.reshape(*values.shape[:-1], k // MX_BLOCK, MX_BLOCK) * s.unsqueeze(-1)
    return values.reshape(*values.shape[:-2], k).movedim(-1, ax).to(dtype)


# ------------------------------------------------------------------------------------------------
# MXFP4: E2M1 codes packed two per byte along the last dimension
# ------------------------------------------------------------------------------------------------


def quantize_mxfp4(
    x: torch.Tensor,
    *,
    scale_rounding: str = "up",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 along the last dimension.

    x: float32/bfloat16/float16 [..., K], K a multiple of 32.
    Returns (packed uint8 [..., K/2] (element 2i in the low nibble), scales uint8 [..., K/32]).
    """
    codes, scales = quantize_mx(x, "e2m1", axis=-1, scale_rounding=scale_rounding, rounding=rounding,
                                generator=generator)
    return pack_fp4(codes), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32):
    """packed uint8 [..., K/2], scales uint8 [..., K/32] -> ``dtype`` [..., K] (exact in float32)."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    return dequantize_mx(unpack_fp4(packed), scales, E2M1, axis=-1, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# MXFP8 (E4M3 / E5M2) and MXFP6 (E2M3 / E3M2, one code per byte, unpacked)
# ------------------------------------------------------------------------------------------------


def _check_choice(value, choices, name):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    fmt: str = "e4m3",
    scale_rounding: str = "up",
    axis: int = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 in blocks of 32 along ``axis``.

    x: float32/bfloat16/float16 [..., K, ...]. Returns (data torch.float8_e4m3fn or float8_e5m2, the
    shape of x; scales uint8 with K replaced by K/32).
    """
    _check_choice(fmt, MXFP8_FORMATS, "fmt")
    codes, scales = quantize_mx(x, fmt, axis=axis, scale_rounding=scale_rounding, rounding=rounding,
                                generator=generator)
    return codes.view(MXFP8_FORMATS[fmt]), scales


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, *, axis: int = -1, dtype=torch.float32):
    """data float8_e4m3fn/float8_e5m2 [..., K, ...], scales uint8 [..., K/32, ...] -> ``dtype``."""
    check_tensor(data, "data", dtypes=tuple(MXFP8_FORMATS.values()))
    fmt = "e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2"
    return dequantize_mx(data.view(torch.uint8), scales, fmt, axis=axis, dtype=dtype)


def quantize_mxfp6(
    x: torch.Tensor,
    *,
    fmt: str = "e2m3",
    scale_rounding: str = "up",
    axis: int = -1,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP6 (E2M3 or E3M2) in blocks of 32 along ``axis``.

    Returns (codes uint8, one 6-bit code per byte, the shape of x; scales uint8, K replaced by K/32).
    """
    _check_choice(fmt, MXFP6_FORMATS, "fmt")
    return quantize_mx(x, fmt, axis=axis, scale_rounding=scale_rounding, rounding=rounding, generator=generator)


def dequantize_mxfp6(codes, scales, *, fmt: str = "e2m3", axis: int = -1, dtype=torch.float32):
    """codes uint8 (6-bit) [..., K, ...], scales uint8 [..., K/32, ...] -> ``dtype``."""
    _check_choice(fmt, MXFP6_FORMATS, "fmt")
    return dequantize_mx(codes, scales, fmt, axis=axis, dtype=dtype)
