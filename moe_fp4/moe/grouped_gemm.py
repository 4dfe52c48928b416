"""The experts' FP8 grouped GEMM: activations in FP8 1x128 (the dispatch's ``return_fp8`` rows),
weights in FP8 128x128 blocks, BF16 out.

``grouped_gemm_fp8_reference`` is the reference: each group's operands dequantized through the spec
(``formats.dequantize_fp8_blockwise``: E4M3 value times its power-of-two scale, exact in float32),
one float32 matrix product per group, rounded to bfloat16; it reads the group boundaries on the
host. ``grouped_gemm_fp8`` runs the Triton kernel of ``_triton_grouped_gemm`` on CUDA (tensor-core
products per 128-wide K block, each scaled and added in float32), the reference elsewhere.
"""

from __future__ import annotations

import torch

from moe_fp4 import formats
from moe_fp4.formats._checks import check_multiple, check_tensor
from moe_fp4.moe import _triton_grouped_gemm

FP8 = torch.float8_e4m3fn
BLOCK = formats.FP8_GROUP  # 128: the activations' 1x128 groups and the weights' 128x128 tiles


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_grouped_gemm_args(a, a_scales, w, w_scales, split_offsets, split_lens) -> tuple[int, int, int, int]:
    """ValueError naming the argument unless the shapes, dtypes and devices fit; returns (M, K, G, N)."""
    check_tensor(a, "a", dtypes=(FP8,), dim=2)
    m, k = a.shape
    check_multiple(k, BLOCK, "a")
    check_tensor(w, "w", dtypes=(FP8,), dim=3)
    g, n, kw = w.shape
    if kw != k:
        raise ValueError(f"w: expected K = {k} (a's) in [G, N, K], got shape {tuple(w.shape)}")
    check_multiple(n, BLOCK, "w", "second dimension (N)")
    want = {"a_scales": (a_scales, (m, k // BLOCK)), "w_scales": (w_scales, (g, n // BLOCK, k // BLOCK))}
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected float32 {shape}, got {_describe(t)}")
    for name, t in (("split_offsets", split_offsets), ("split_lens", split_lens)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or tuple(t.shape) != (g,):
            raise ValueError(f"{name}: expected an int64 tensor [{g}] (one per group of w), got {_describe(t)}")
    for name, t in (("a_scales", a_scales), ("w", w), ("w_scales", w_scales), ("split_offsets", split_offsets),
                    ("split_lens", split_lens)):
        if t.device != a.device:
            raise ValueError(f"{name}: expected a tensor on {a.device} (a's device), got {t.device}")
    return m, k, g, n


def group_bounds(split_offsets: torch.Tensor, split_lens: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """Host (start, end) of each group, checked: inside [0, rows), not overlapping (ValueError)."""
    offs, lens = split_offsets.tolist(), split_lens.tolist()
    bounds = []
    for e, (o, c) in enumerate(zip(offs, lens)):
        if c < 0 or o < 0 or o + c > rows:
            raise ValueError(f"split_offsets, split_lens: group {e} covers rows [{o}, {o + c}), outside [0, {rows})")
        bounds.append((o, o + c))
    ordered = sorted(b for b in bounds if b[1] > b[0])
    for (_, end), (start, _) in zip(ordered, ordered[1:]):
        if start < end:
            raise ValueError(f"split_offsets, split_lens: groups overlap at row {start}")
    return bounds


def grouped_gemm_fp8(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                     split_offsets: torch.Tensor, split_lens: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """out[r] = a[r] @ w[g]^T for the rows r of group g: bfloat16 [M, N].

    a: float8_e4m3fn [M, K] with a_scales float32 [M, K/128] (power-of-two scales per 1x128 group,
      what ``Buffer.dispatch(return_fp8=True)`` gives); w: float8_e4m3fn [G, N, K] with w_scales
      float32 [G, N/128, K/128] (per 128x128 tile); group g owns rows [split_offsets[g],
      split_offsets[g] + split_lens[g]) (int64 [G] on a's device: ragged, empty and gapped groups;
      groups may not overlap); rows of no group come out zero. K and N multiples of 128.
    validate: read the splits on the host and raise ValueError for groups outside [0, M) or
      overlapping (one host synchronisation on a GPU); False skips that (a sync-free dispatch's
      splits, a CUDA graph): the CUDA kernel then keeps every access inside a, and the result for
      invalid splits is unspecified.
    On CUDA with Triton: the Triton kernel (float32 sums per 128-wide K block, each scaled and added
    in float32; within the FP8 tensor cores' accumulation of the reference); elsewhere the reference."""
    m, k, g, n = check_grouped_gemm_args(a, a_scales, w, w_scales, split_offsets, split_lens)
    if validate:
        group_bounds(split_offsets, split_lens, m)
    if _triton_grouped_gemm.available(a):
        for name, t in (("a", a), ("a_scales", a_scales), ("w", w), ("w_scales", w_scales)):
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        return _triton_grouped_gemm.grouped_gemm_fp8(a, a_scales, w, w_scales, split_offsets, split_lens)
    return grouped_gemm_fp8_reference(a, a_scales, w, w_scales, split_offsets, split_lens)


def grouped_gemm_fp8_reference(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                               split_offsets: torch.Tensor, split_lens: torch.Tensor) -> torch.Tensor:
    """``grouped_gemm_fp8`` by the spec: per group, both operands dequantized exactly, one float32
    product, rounded to bfloat16 (any device; the splits are read on the host)."""
    m, k, g, n = check_grouped_gemm_args(a, a_scales, w, w_scales, split_offsets, split_lens)
    out = torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    for e, (lo, hi) in enumerate(group_bounds(split_offsets, split_lens, m)):
        if hi == lo:
            continue
        x = formats.dequantize_fp8_blockwise(a[lo:hi], a_scales[lo:hi], block=(1, BLOCK))
        wt = formats.dequantize_fp8_blockwise(w[e], w_scales[e], block=(BLOCK, BLOCK))
        out[lo:hi] = (x.to(torch.float32) @ wt.to(torch.float32).t()).to(torch.bfloat16)
    return out


__all__ = ["check_grouped_gemm_args", "group_bounds", "grouped_gemm_fp8", "grouped_gemm_fp8_reference"]
