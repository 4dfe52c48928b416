"""Ragged expert segments: rows grouped by expert with no padding, described by
``split_lens`` (rows per expert) and ``split_offsets`` (first row of each expert)."""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def split_offsets(split_lens: torch.Tensor) -> torch.Tensor:
    """int [E] rows per expert -> int64 [E] exclusive prefix sum (the first row of each expert)."""
    check_tensor(split_lens, "split_lens", dtypes=INDEX_DTYPES)
    if split_lens.dim() != 1:
        raise ValueError(f"split_lens: expected 1 dimension, got shape {tuple(split_lens.shape)}")
    lens = split_lens.to(torch.int64)
    return torch.cumsum(lens, 0) - lens


def check_splits(split_lens: torch.Tensor, split_offsets: torch.Tensor | None, total_rows: int) -> torch.Tensor:
    """Validate a ragged layout over ``total_rows`` rows and return int64 offsets.

    split_lens: int32/int64 [E], non-negative; split_offsets: int32/int64 [E] or None (then the
    segments are back to back). Segments must lie inside [0, total_rows) and not overlap.
    """
    check_tensor(split_lens, "split_lens", dtypes=INDEX_DTYPES)
    if split_lens.dim() != 1:
        raise ValueError(f"split_lens: expected 1 dimension, got shape {tuple(split_lens.shape)}")
    if split_offsets is None:
        return torch.tensor(split_starts(split_lens.tolist(), None, total_rows), dtype=torch.int64,
                            device=split_lens.device)
    check_tensor(split_offsets, "split_offsets", dtypes=INDEX_DTYPES)
    if split_offsets.shape != split_lens.shape:
        raise ValueError(f"split_offsets: expected shape {tuple(split_lens.shape)}, got {tuple(split_offsets.shape)}")
    split_starts(split_lens.tolist(), split_offsets.tolist(), total_rows)
    return split_offsets.to(torch.int64)


def split_starts(lens: list[int], offsets: list[int] | None, total_rows: int) -> list[int]:
    """check_splits on host integers (the same errors): the first row of each segment, the offsets
    given or back to back from row 0. A few microseconds for tens of experts, where tensor operations
    on the host take tens."""
    if lens and min(lens) < 0:
        raise ValueError(f"split_lens: expected non-negative lengths, got {lens}")
    if offsets is None:
        starts, row = [], 0
        for ln in lens:
            starts.append(row)
            row += ln
        if row > total_rows:
            raise ValueError(f"split_lens: segments cover {row} rows, more than the {total_rows} given")
        return starts
    if lens:
        if min(offsets) < 0 or max(o + ln for o, ln in zip(offsets, lens)) > total_rows:
            raise ValueError(f"split_offsets: segments must lie inside [0, {total_rows}), got offsets "
                             f"{offsets} with lengths {lens}")
        spans = sorted((o, ln) for o, ln in zip(offsets, lens) if ln > 0)  # an empty segment covers no row
        if any(nxt[0] < o + ln for (o, ln), nxt in zip(spans, spans[1:])):
            raise ValueError("split_offsets: segments overlap")
    return list(offsets)


def split_offsets_of(lens: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lens, 0) - lens


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable order that groups rows by expert id.

    expert_ids: int [N] in [0, num_experts). Returns (order int64 [N]: row indices sorted by expert,
    split_lens int64 [num_experts], split_offsets int64 [num_experts]).
    """
    check_tensor(expert_ids, "expert_ids", dtypes=INDEX_DTYPES)
    if expert_ids.dim() != 1:
        raise ValueError(f"expert_ids: expected 1 dimension, got shape {tuple(expert_ids.shape)}")
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise ValueError(f"expert_ids: expected values in [0, {num_experts}), got "
                         f"[{int(expert_ids.min())}, {int(expert_ids.max())}]")
    order = torch.argsort(expert_ids, stable=True)
    lens = torch.bincount(expert_ids.to(torch.int64), minlength=num_experts)
    return order, lens, split_offsets_of(lens)
