"""DeepGEMM's m-grouped FP8 GEMM as the CUDA engine of ``grouped_gemm_fp8`` where it is installed.

DeepGEMM (an optional dependency: ``patches/deepgemm/build.sh`` builds it) takes exactly our operand
format on sm_90 (FP8 activations with float32 1x128 scales, FP8 weights with float32 128x128 scales,
bf16 out) and overlaps the per-block scaling with the tensor cores, which a Triton kernel cannot.
Its contiguous layout gives every row a group index (-1: no group) and runs each 128-row tile with
the weights of the tile's group, so it serves only splits whose groups start on multiples of 128
(one group per tile); other splits stay on the Triton kernel. It computes the tail rows of a tile
like the others, so the rows of no group are zeroed after it.
"""

from __future__ import annotations

import importlib.util

import torch

from moe_fp4.moe import _triton_grouped_gemm

TILE_M = 128
_module = None
_probed = False


def module():
    """deep_gemm when it imports and the current CUDA device is sm_90, else None (probed once)."""
    global _module, _probed
    if not _probed:
        _probed = True
        if importlib.util.find_spec("deep_gemm") is not None and torch.cuda.is_available() \
                and torch.cuda.get_device_capability() == (9, 0):
            try:
                import deep_gemm
                _module = deep_gemm if hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous") else None
            except ImportError:  # (built for another torch or CUDA: the Triton kernel runs instead)
                _module = None
    return _module


def disable() -> None:
    """Keep grouped_gemm_fp8 off DeepGEMM in this process (a build that fails a probe call)."""
    global _module, _probed
    _module, _probed = None, True


def usable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether CUDA operands fit DeepGEMM's contiguous layout (TMA: K-major, contiguous, 16-byte rows)."""
    return a.is_contiguous() and w.is_contiguous() and module() is not None


def grouped_rows(a, a_scales, w, w_scales, split_offsets, split_lens) -> torch.Tensor:
    """As ``grouped_gemm_fp8`` for splits whose groups start on multiples of 128 rows: each row's group
    (-1 for none) from one Triton launch, the GEMM, then the rows of no group zeroed."""
    m = a.shape[0]
    out = torch.empty(m, w.shape[1], dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    if w.shape[0]:
        module().m_grouped_fp8_gemm_nt_contiguous((a, a_scales), (w, w_scales), out,
                                                  _triton_grouped_gemm.row_groups(split_offsets, split_lens, m))
    _triton_grouped_gemm.zero_uncovered_rows(out, split_offsets, split_lens)
    return out
