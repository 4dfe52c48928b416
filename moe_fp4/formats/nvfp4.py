"""NVFP4: E2M1 elements in blocks of 16 with an E4M3 block scale and one FP32 tensor scale.

Rules (the spec):
  * tensor scale ``global_scale = float32(global_amax / (6 * 448))``; ``global_amax`` is the largest
    finite |x| unless the caller gives one (e.g. from an amax history);
  * block scale: ``e4m3(float32(block_amax / (6 * global_scale)))`` (round to nearest even,
    saturating at 448: the nearest E4M3 value may lie below the exact ratio, so a block's largest
    element can saturate slightly at 6); blocks are 1x16 along the last dimension, or 16x16 tiles of the last two
    dimensions with ``block_2d=True`` (weights);
  * elements: ``e2m1(float32(x / d))`` with ``d = float32(e4m3_value(block_scale) * global_scale)``;
    a block whose ``d`` is 0 (zero tensor or zero block) has zero data;
  * a block holding NaN or +-Inf gets the E4M3 NaN code 0x7F as its scale and zero data, so it
    decodes to NaN; such values are left out of the tensor amax.

Byte row (the nvfp4 dispatch payload): ``H/2`` packed data bytes, ``H/16`` E4M3 block scale bytes,
then the 4 bytes of the FP32 tensor scale (little endian), ``H/2 + H/16 + 4`` bytes: every row
carries the tensor scale of the batch it was quantized with, so rows of several senders decode
together (``dequantize_nvfp4_rows``).
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import as_float32, check_multiple, check_tensor, value_checks
from moe_fp4.formats.elements import E2M1, E4M3, decode_elements, encode_elements
from moe_fp4.formats.packing import pack_fp4, unpack_fp4

NVFP4_BLOCK = 16
NVFP4_GLOBAL_DENOM = 6.0 * 448.0  # E2M1 max times E4M3 max


def _blocks(xf: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """View x as [..., nb_rows, nb_cols, block elements] (1x16: nb_rows absent)."""
    if not block_2d:
        return xf.reshape(*xf.shape[:-1], xf.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    *lead, m, k = xf.shape
    t = xf.reshape(*lead, m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return t.transpose(-3, -2).reshape(*lead, m // NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK * NVFP4_BLOCK)


def _unblocks(blocks: torch.Tensor, shape, block_2d: bool) -> torch.Tensor:
    if not block_2d:
        return blocks.reshape(shape)
    *lead, m, k = shape
    t = blocks.reshape(*lead, m // NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK, NVFP4_BLOCK)
    return t.transpose(-3, -2).reshape(shape)


def nvfp4_global_scale(global_amax: torch.Tensor | float) -> torch.Tensor:
    """float32 0-dim: global_amax / (6 * 448), correctly rounded to float32."""
    a = torch.as_tensor(global_amax, dtype=torch.float64)
    return (a / NVFP4_GLOBAL_DENOM).to(torch.float32)


def block_divisor(scale_codes: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``d = e4m3_value(scale_codes) * global_scale``, correctly rounded once.

    scale_codes: uint8 E4M3 codes of any shape; global_scale: float32 0-dim. The product is formed
    in float32 arithmetic, which IEEE 754 rounds once from the exact product. (Forming it in float64
    and casting to float32 gives the same value eagerly, but torch.compile's GPU code drops a float64
    -> float32 -> float64 round trip, so the later division saw the unrounded divisor and rounded a
    few elements at E2M1 ties the other way.)
    """
    return decode_elements(scale_codes, E4M3) * global_scale.to(torch.float32)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    block_2d: bool = False,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x``.

    x: float32/bfloat16/float16 [..., K] (1x16 blocks, K % 16 == 0) or [..., M, K] with M, K % 16 == 0
    (``block_2d=True``). ``rounding="stochastic"`` rounds the elements stochastically (gradients).
    Returns (packed uint8 [..., K/2],
             scales float8_e4m3fn [..., K/16] (1x16) or [..., M/16, K/16] (16x16),
             global_scale float32 0-dim).
    """
    xf = as_float32(x)
    if xf.dim() < (2 if block_2d else 1):
        raise ValueError(f"x: expected at least {2 if block_2d else 1} dimension(s), got shape {tuple(xf.shape)}")
    check_multiple(xf.shape[-1], NVFP4_BLOCK, "x")
    if block_2d:
        check_multiple(xf.shape[-2], NVFP4_BLOCK, "x", "second-to-last dimension")
    finite = torch.isfinite(xf)
    given = global_amax is not None  # else the largest finite |x|: finite and non-negative by construction
    if not given:
        global_amax = torch.where(finite, xf.abs(), torch.zeros_like(xf)).amax() if xf.numel() else 0.0
    gamax = torch.as_tensor(global_amax, dtype=torch.float32, device=xf.device)
    if given and (gamax.numel() != 1 or value_checks() and (not bool(torch.isfinite(gamax).all())
                                                            or float(gamax) < 0)):
        raise ValueError(f"global_amax: expected one finite non-negative value, got {global_amax!r}")
    gs = nvfp4_global_scale(gamax.reshape(()))
    blocks = _blocks(xf, block_2d)
    nonfinite = ~_blocks(finite, block_2d).all(dim=-1)
    bamax = torch.where(nonfinite, torch.zeros_like(blocks[..., 0]), blocks.abs().amax(dim=-1))
    gs64 = gs.to(torch.float64)
    bscale = torch.where(gs64 > 0, bamax.to(torch.float64) / (6.0 * gs64), torch.zeros_like(gs64))
    scale_codes = encode_elements(bscale.to(torch.float32), E4M3)
    d64 = block_divisor(scale_codes, gs).to(torch.float64).unsqueeze(-1)
    scaled = torch.where(d64 > 0, blocks.to(torch.float64) / torch.where(d64 > 0, d64, 1.0), 0.0)
    scaled = torch.where(nonfinite.unsqueeze(-1), 0.0, scaled).to(torch.float32)
    codes = encode_elements(scaled, E2M1, rounding=rounding, generator=generator)
    scale_codes = torch.where(nonfinite, torch.full_like(scale_codes, E4M3.nan_code), scale_codes)
    packed = pack_fp4(_unblocks(codes, xf.shape, block_2d))
    return packed, scale_codes.view(torch.float8_e4m3fn), gs


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | float, *, dtype=torch.float32
) -> torch.Tensor:
    """packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16] or [..., M/16, K/16] (2-D blocks),
    global_scale float32 -> ``dtype`` [..., K]. value = e2m1 * float32(e4m3(scale) * global_scale)."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.float8_e4m3fn,), min_dim=1)
    k = packed.shape[-1] * 2
    check_multiple(k, NVFP4_BLOCK, "packed", "last dimension times 2")
    shape_1d = (*packed.shape[:-1], k // NVFP4_BLOCK)
    block_2d = tuple(scales.shape) != shape_1d
    if block_2d:
        if packed.dim() < 2 or packed.shape[-2] % NVFP4_BLOCK:
            raise ValueError(f"scales: expected shape {shape_1d}, got {tuple(scales.shape)}")
        shape_2d = (*packed.shape[:-2], packed.shape[-2] // NVFP4_BLOCK, k // NVFP4_BLOCK)
        if tuple(scales.shape) != shape_2d:
            raise ValueError(f"scales: expected shape {shape_1d} (1x16) or {shape_2d} (16x16), "
                             f"got {tuple(scales.shape)}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(())
    d = block_divisor(scales.view(torch.uint8), gs)
    values = decode_elements(unpack_fp4(packed), E2M1)
    shape = values.shape
    out = _blocks(values, block_2d) * d.unsqueeze(-1)
    return _unblocks(out, shape, block_2d).to(dtype)


def dequantize_nvfp4_rows(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *, dtype=torch.float32
) -> torch.Tensor:
    """1x16 NVFP4 rows that each carry their own tensor scale (rows of several senders): packed uint8
    [T, K/2], scales float8_e4m3fn [T, K/16], global_scale float32 [T] -> ``dtype`` [T, K]. Row t
    equals ``dequantize_nvfp4(packed[t], scales[t], global_scale[t])``: the divisor of each block is
    the same float32 product."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), dim=2)
    check_tensor(scales, "scales", dtypes=(torch.float8_e4m3fn,), dim=2)
    check_tensor(global_scale, "global_scale", dtypes=(torch.float32,), dim=1)
    t, k = packed.shape[0], packed.shape[1] * 2
    check_multiple(k, NVFP4_BLOCK, "packed", "last dimension times 2")
    if tuple(scales.shape) != (t, k // NVFP4_BLOCK):
        raise ValueError(f"scales: expected shape {(t, k // NVFP4_BLOCK)}, got {tuple(scales.shape)}")
    if tuple(global_scale.shape) != (t,):
        raise ValueError(f"global_scale: expected shape ({t},), got {tuple(global_scale.shape)}")
    d = block_divisor(scales.view(torch.uint8), global_scale.unsqueeze(-1))
    values = decode_elements(unpack_fp4(packed), E2M1).reshape(t, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return (values * d.unsqueeze(-1)).reshape(t, k).to(dtype)


def nvfp4_row_bytes(hidden: int) -> int:
    """Bytes of one NVFP4 byte row: hidden/2 data + hidden/16 E4M3 scales + 4 (FP32 tensor scale)."""
    check_multiple(hidden, NVFP4_BLOCK, "hidden", "value")
    return hidden // 2 + hidden // NVFP4_BLOCK + 4


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
    h2, h16 = hidden // 2, hidden // NVFP4_BLOCK
    scales = rows[:, h2:h2 + h16].contiguous().view(torch.float8_e4m3fn)
    gs = rows[:, h2 + h16:].contiguous().view(torch.float32).reshape(-1)
    return rows[:, :h2], scales, gs
