"""The experts' FP8 grouped GEMM: activations in FP8 1x128 (the dispatch's ``return_fp8`` rows),
weights in FP8 128x128 blocks, BF16 out.

``grouped_gemm_fp8_reference`` is the reference: each group's operands dequantized through the spec
(``formats.dequantize_fp8_blockwise``: E4M3 value times its power-of-two scale, exact in float32),
one float32 matrix product per group, rounded to bfloat16; it reads the group boundaries on the
host. ``grouped_gemm_fp8`` runs on CUDA DeepGEMM's grouped GEMM where it is installed and the splits
fit it (``_deep_gemm``), else the Triton kernel of ``_triton_grouped_gemm`` (tensor-core products per
128-wide K block, each scaled and added in float32); the reference elsewhere.
"""

from __future__ import annotations

import torch

from moe_fp4 import formats
from moe_fp4.formats._checks import check_multiple, check_tensor, describe
from moe_fp4.moe import _deep_gemm, _triton_grouped_gemm

FP8 = torch.float8_e4m3fn
BLOCK = formats.FP8_GROUP  # 128: the activations' 1x128 groups and the weights' 128x128 tiles
WGRAD_ROW_ALIGN = 16  # the weight gradient's groups start on 16-row (16-byte) boundaries: aligned loads


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
            raise ValueError(f"{name}: expected float32 {shape}, got {describe(t)}")
    for name, t in (("split_offsets", split_offsets), ("split_lens", split_lens)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or tuple(t.shape) != (g,):
            raise ValueError(f"{name}: expected an int64 tensor [{g}] (one per group of w), got {describe(t)}")
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
                     split_offsets: torch.Tensor, split_lens: torch.Tensor, *, validate: bool = True,
                     tile_aligned: bool = False) -> torch.Tensor:
    """out[r] = a[r] @ w[g]^T for the rows r of group g: bfloat16 [M, N].

    a: float8_e4m3fn [M, K] with a_scales float32 [M, K/128] (power-of-two scales per 1x128 group,
      what ``Buffer.dispatch(return_fp8=True)`` gives); w: float8_e4m3fn [G, N, K] with w_scales
      float32 [G, N/128, K/128] (per 128x128 tile); group g owns rows [split_offsets[g],
      split_offsets[g] + split_lens[g]) (int64 [G] on a's device: ragged, empty and gapped groups;
      groups may not overlap); rows of no group come out zero. K and N multiples of 128.
      a needs unit strides along K (rows may be apart), w a unit stride along K (any other strides:
      the dgrad operand w^T is a transposed view of ``ops.quantize_fp8_tiles``' ``data_t``); the
      scales take any strides.
    validate: read the splits on the host and raise ValueError for groups outside [0, M) or
      overlapping (one host synchronisation on a GPU); False skips that (a sync-free dispatch's
      splits, a CUDA graph): the CUDA kernel then keeps every access inside a, and the result for
      invalid splits is unspecified.
    tile_aligned: the caller guarantees that each group starts at or after the previous group's end
      (empty groups too) and each non-empty group on a multiple of 128 rows (``Experts``' contract;
      a dispatch with ``expert_alignment=128``); with validate=True it is read from the splits.
    On CUDA: DeepGEMM's m-grouped FP8 GEMM when it is installed, the GPU is sm_90, a and w are
    contiguous and the groups are tile-aligned (see ``moe_fp4.moe._deep_gemm``); else the Triton
    kernel. Both sum per 128-wide K block in float32 and scale each block's sum in float32: within
    the FP8 tensor cores' accumulation of the reference. Elsewhere the reference."""
    m, k, g, n = check_grouped_gemm_args(a, a_scales, w, w_scales, split_offsets, split_lens)
    if validate:
        bounds = group_bounds(split_offsets, split_lens, m)
        tile_aligned = all(lo % BLOCK == 0 for lo, hi in bounds if hi > lo) and all(
            b[1] <= c[0] for b, c in zip(bounds, bounds[1:]))
    if tile_aligned and a.is_cuda and _deep_gemm.usable(a, w):
        return _deep_gemm.grouped_rows(a, a_scales, w, w_scales, split_offsets, split_lens)
    if _triton_grouped_gemm.available(a):
        if a.stride(1) != 1 or w.stride(2) != 1:
            bad = "a" if a.stride(1) != 1 else "w"
            raise ValueError(f"{bad}: expected a unit stride along K, got strides {(a if bad == 'a' else w).stride()}")
        return _triton_grouped_gemm.grouped_rows(a, a_scales, w, w_scales, split_offsets, split_lens)
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


def _cols_operand(t, scales, name, scales_name):
    check_tensor(t, name, dtypes=(FP8,), dim=2)
    check_multiple(t.shape[0], BLOCK, name, "first dimension")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2 \
            or scales.shape[0] != t.shape[0]:
        raise ValueError(f"{scales_name}: expected float32 [{t.shape[0]}, blocks], got {describe(scales)}")


def _scale_offsets(offsets, g, name, device):
    if offsets is None:
        return None  # (split_offsets / 128: the kernel divides itself, no launch for it here)
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
            or tuple(offsets.shape) != (g,) or offsets.device != device:
        raise ValueError(f"{name}: expected an int64 tensor [{g}] on {device}, got {describe(offsets)}")
    return offsets


def _bases(split_offsets, base):
    """The first scale column of each group: the given offsets, or split_offsets / 128."""
    if base is not None:
        return base
    return torch.div(split_offsets.to(torch.int64), BLOCK, rounding_mode="floor")


def check_wgrad_args(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_scale_offsets,
                     b_scale_offsets, out) -> tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]:
    """ValueError naming the argument unless the operands fit; returns (G, N, K, a_base, b_base), a base
    None where its scale offsets are not given (then split_offsets / 128: ``_bases``)."""
    _cols_operand(a_cols, a_scales, "a_cols", "a_scales")
    _cols_operand(b_cols, b_scales, "b_cols", "b_scales")
    n, kdim = a_cols.shape[0], b_cols.shape[0]
    for name, t in (("split_offsets", split_offsets), ("split_lens", split_lens)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or t.dim() != 1 \
                or t.shape[0] != split_lens.shape[0]:
            raise ValueError(f"{name}: expected an int64 tensor [G], got {describe(t)}")
    g = split_lens.shape[0]
    dev = a_cols.device
    for name, t in (("a_scales", a_scales), ("b_cols", b_cols), ("b_scales", b_scales),
                    ("split_offsets", split_offsets), ("split_lens", split_lens)):
        if t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (a_cols' device), got {t.device}")
    a_base = _scale_offsets(a_scale_offsets, g, "a_scale_offsets", dev)
    b_base = _scale_offsets(b_scale_offsets, g, "b_scale_offsets", dev)
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32
                            or tuple(out.shape) != (g, n, kdim) or not out.is_contiguous() or out.device != dev):
        raise ValueError(f"out: expected a contiguous float32 tensor {(g, n, kdim)} on {dev}, got {describe(out)}")
    return g, n, kdim, a_base, b_base


def _validate_wgrad(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_scale_offsets,
                    b_scale_offsets, a_base, b_base):
    tokens = min(a_cols.shape[1], b_cols.shape[1])
    bounds = group_bounds(split_offsets, split_lens, tokens)
    for (name, given, base, scales) in (("a_scale_offsets", a_scale_offsets, a_base, a_scales),
                                        ("b_scale_offsets", b_scale_offsets, b_base, b_scales)):
        for e, ((lo, hi), s) in enumerate(zip(bounds, _bases(split_offsets, base).tolist())):
            if hi == lo:
                continue
            if lo % WGRAD_ROW_ALIGN:
                raise ValueError(f"split_offsets: group {e} starts at row {lo}; the weight gradient needs every "
                                 f"group to start on a multiple of {WGRAD_ROW_ALIGN} rows")
            if given is None and lo % BLOCK:
                raise ValueError(f"split_offsets: group {e} starts at row {lo}; without {name} the scales are "
                                 f"taken per 128 rows from row 0, so each group must start on a multiple of {BLOCK}")
            if s < 0 or s + -(-(hi - lo) // BLOCK) > scales.shape[1]:
                raise ValueError(f"{name}: group {e} needs scale columns [{s}, {s + -(-(hi - lo) // BLOCK)}), "
                                 f"outside the {scales.shape[1]} of {name[0]}_scales")


def grouped_gemm_fp8_wgrad(a_cols: torch.Tensor, a_scales: torch.Tensor, b_cols: torch.Tensor,
                           b_scales: torch.Tensor, split_offsets: torch.Tensor, split_lens: torch.Tensor, *,
                           a_scale_offsets: torch.Tensor | None = None,
                           b_scale_offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32, validate: bool = True) -> torch.Tensor:
    """The weight gradient of a grouped GEMM: out[g][i, j] = sum over the rows r of group g of
    a_cols[i, r] * b_cols[j, r], float32 [G, N, K] (for y = x @ w_g^T: a_cols = dy^T, b_cols = x^T).

    a_cols: float8_e4m3fn [N, Ma], b_cols: float8_e4m3fn [K, Mb]: the operands by columns (tokens
      along the unit-stride dimension; rows may be apart), N and K multiples of 128, what
      ``ops.quantize_fp8_rows_cols`` (data_t) and ``ops.mxfp4_rows_to_fp8_cols`` give;
    a_scales float32 [N, Sa], b_scales float32 [K, Sb] (any strides): one power-of-two scale per 128
      tokens of each column, the blocks counted from each group's first row: the scale of a_cols[i, r]
      for r in the j-th block of group g is a_scales[i, a_scale_offsets[g] + j];
    a_scale_offsets / b_scale_offsets: int64 [G], or None for split_offsets / 128 (the layout of
      ``quantize_fp8_rows_cols``, whose blocks start at multiples of 128 from row 0: then every group
      must start on a multiple of 128); ``mxfp4_rows_to_fp8_cols``' group offsets[:-1] for its columns;
    split_offsets / split_lens: int64 [G], as for ``grouped_gemm_fp8``, every group starting on a
      multiple of 16 rows (a dispatch's expert_alignment of 16 or more);
    out: a float32 [G, N, K] tensor to add the result to (weight gradients accumulated in float32
      over micro-batches), or None for a new one. Empty groups give zeros (or leave out unchanged).
    out_dtype: the new tensor's dtype when out is None: float32, or bfloat16 for BF16 master weights
      (the sums are float32 either way, rounded once at the end).
    validate: check the splits and the scale columns on the host (one synchronisation); False: the
      result of invalid splits is unspecified."""
    g, n, kdim, a_base, b_base = check_wgrad_args(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens,
                                                  a_scale_offsets, b_scale_offsets, out)
    if validate:
        _validate_wgrad(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_scale_offsets,
                        b_scale_offsets, a_base, b_base)
    accumulate = out is not None
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype: expected torch.float32 or torch.bfloat16, got {out_dtype}")
    if out is None:
        out = torch.empty(g, n, kdim, dtype=out_dtype, device=a_cols.device)
    if _triton_grouped_gemm.available(a_cols):
        for name, t in (("a_cols", a_cols), ("b_cols", b_cols)):
            if t.stride(1) != 1:
                raise ValueError(f"{name}: expected a unit stride along the tokens, got strides {t.stride()}")
        _triton_grouped_gemm.grouped_wgrad(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens,
                                           a_base, b_base, out, accumulate)
        return out
    result = _wgrad_reference(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_base, b_base)
    if accumulate:
        return out.add_(result)
    return out.copy_(result)  # (rounded once to out's dtype)


def _cols_dequant(cols, scales, lo, hi, base):
    """float32 [rows of cols, hi - lo]: the group's tokens of an FP8 column operand, dequantized."""
    blocks = -(-(hi - lo) // BLOCK)
    s = scales[:, base:base + blocks].repeat_interleave(BLOCK, dim=1)[:, :hi - lo]
    return cols[:, lo:hi].to(torch.float32) * s


def _wgrad_reference(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_base, b_base):
    g, n, kdim = split_lens.shape[0], a_cols.shape[0], b_cols.shape[0]
    out = torch.zeros(g, n, kdim, dtype=torch.float32, device=a_cols.device)
    tokens = min(a_cols.shape[1], b_cols.shape[1])
    a_base, b_base = _bases(split_offsets, a_base), _bases(split_offsets, b_base)
    for e, ((lo, hi), sa, sb) in enumerate(zip(group_bounds(split_offsets, split_lens, tokens), a_base.tolist(),
                                               b_base.tolist())):
        if hi > lo:
            out[e] = _cols_dequant(a_cols, a_scales, lo, hi, sa) @ _cols_dequant(b_cols, b_scales, lo, hi, sb).t()
    return out


def grouped_gemm_fp8_wgrad_reference(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, *,
                                     a_scale_offsets=None, b_scale_offsets=None) -> torch.Tensor:
    """``grouped_gemm_fp8_wgrad`` by the spec (operands dequantized exactly, one float32 product per
    group; any device, the splits read on the host)."""
    _, _, _, a_base, b_base = check_wgrad_args(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens,
                                               a_scale_offsets, b_scale_offsets, None)
    _validate_wgrad(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_scale_offsets,
                    b_scale_offsets, a_base, b_base)
    return _wgrad_reference(a_cols, a_scales, b_cols, b_scales, split_offsets, split_lens, a_base, b_base)


__all__ = ["check_grouped_gemm_args", "check_wgrad_args", "group_bounds", "grouped_gemm_fp8",
           "grouped_gemm_fp8_reference", "grouped_gemm_fp8_wgrad", "grouped_gemm_fp8_wgrad_reference"]
