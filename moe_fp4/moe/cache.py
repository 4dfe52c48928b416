"""Keep activations saved for backward in MXFP4 instead of recomputing them (or keeping BF16).

``with mxfp4_activation_cache(): loss = model(x)`` stores every eligible tensor that autograd saves
during the forward pass as MXFP4 (packed E2M1 + UE8M0 scales per 32 along the last dimension,
``H/2 + H/32`` bytes per row: 0.27x of BF16) and dequantizes it when backward needs it. This is lossy
by design: backward sees ``dequantize_mxfp4(quantize_mxfp4(t))`` in place of ``t``.

Eligible tensors: floating point (bfloat16, float16, float32), last dimension a multiple of 32, at
least ``min_numel`` elements, and not a parameter (a leaf that requires grad) nor a view of one, so
weights saved by linear layers stay exact. Everything else is kept as it is. Packing goes through
``moe_fp4.ops.quantize_mxfp4`` and unpacking through ``moe_fp4.ops.dequantize_mxfp4`` (native kernels
on a Hopper GPU, BF16 activations for the unpack; the spec elsewhere, in row slices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4 import ops

ELIGIBLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_UNPACK_CHUNK_ELEMENTS = 1 << 22


@dataclass
class CacheStats:
    """Bytes seen by the cache during the forward passes inside it."""

    tensors_packed: int = 0
    tensors_kept: int = 0
    bytes_original: int = 0  # bytes the packed tensors would have taken
    bytes_packed: int = 0  # bytes they take as MXFP4

    @property
    def ratio(self) -> float:
        return self.bytes_packed / self.bytes_original if self.bytes_original else 1.0


def _is_parameter_like(t: torch.Tensor) -> bool:
    if t.is_leaf and t.requires_grad:
        return True
    base = t._base
    return base is not None and base.is_leaf and base.requires_grad


class _Packed:
    __slots__ = ("packed", "scales", "shape", "dtype")

    def __init__(self, packed, scales, shape, dtype):
        self.packed, self.scales, self.shape, self.dtype = packed, scales, shape, dtype


class mxfp4_activation_cache(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved activations are held as MXFP4 until backward.

    min_numel: smaller tensors are kept as they are (their bytes do not matter, and the scale bytes
      would dominate). scale_rounding: "up" (default) or "down", as in ``quantize_mxfp4``.
    After the block, ``stats`` tells how many tensors were packed and the bytes saved.
    """

    def __init__(self, *, min_numel: int = 1 << 14, scale_rounding: str = "up"):
        if not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel: expected a non-negative int, got {min_numel!r}")
        if scale_rounding not in ("up", "down"):
            raise ValueError(f"scale_rounding: expected 'up' or 'down', got {scale_rounding!r}")
        self.min_numel = min_numel
        self.scale_rounding = scale_rounding
        self.stats = CacheStats()
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> mxfp4_activation_cache:
        super().__enter__()
        return self

    def eligible(self, t: torch.Tensor) -> bool:
        return (
            t.dtype in ELIGIBLE_DTYPES
            and t.dim() >= 1
            and t.shape[-1] % 32 == 0
            and t.numel() >= max(self.min_numel, 1)
            and not _is_parameter_like(t)
        )

    def _pack(self, t: torch.Tensor):
        if not self.eligible(t):
            self.stats.tensors_kept += 1
            return t
        flat = t.detach().reshape(-1, t.shape[-1])
        packed, scales = ops.quantize_mxfp4(flat, scale_rounding=self.scale_rounding)
        self.stats.tensors_packed += 1
        self.stats.bytes_original += t.numel() * t.element_size()
        self.stats.bytes_packed += packed.numel() + scales.numel()
        return _Packed(packed, scales, t.shape, t.dtype)

    @staticmethod
    def _unpack(obj):
        if not isinstance(obj, _Packed):
            return obj
        rows, half = obj.packed.shape
        if obj.dtype == torch.bfloat16 and obj.packed.is_cuda and ops.native_available():
            # the native MXFP4 -> BF16 kernel: no temporaries beyond the output
            return ops.dequantize_mxfp4(obj.packed, obj.scales, dtype=obj.dtype).reshape(obj.shape)
        out = torch.empty(rows, 2 * half, dtype=obj.dtype, device=obj.packed.device)
        # Elsewhere the spec, a slice of rows at a time: its temporaries (about 20 bytes per element)
        # must not outgrow the bytes the cache saves.
        step = max(1, _UNPACK_CHUNK_ELEMENTS // (2 * half))
        for r in range(0, rows, step):
            out[r:r + step] = ops.dequantize_mxfp4(obj.packed[r:r + step], obj.scales[r:r + step], dtype=obj.dtype)
        return out.reshape(obj.shape)
