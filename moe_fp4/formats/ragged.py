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
    lens = split_lens.to(torch.int64).cpu()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"split_lens: expected non-negative lengths, got {lens.tolist()}")
    if split_offsets is None:
        if int(lens.sum()) > total_rows:
            raise ValueError(f"split_lens: segments cover {int(lens.sum())} rows, more than the {total_rows} given")
        return split_offsets_of(lens).to(split_lens.device)
    check_tensor(split_offsets, "split_offsets", dtypes=INDEX_DTYPES)
    if split_offsets.shape != split_lens.shape:
        raise ValueError(f"split_offsets: expected shape {tuple(split_lens.shape)}, got {tuple(split_offsets.shape)}")
    offs = split_offsets.to(torch.int64).cpu()
    if lens.numel():
        if int(offs.min()) < 0 or int((offs + lens).max()) > total_rows:
            raise ValueError(f"split_offsets: segments must lie inside [0, {total_rows}), got offsets "
                             f"{offs.tolist()} with lengths {lens.tolist()}")
        nonempty = lens > 0  # an empty segment covers no row, wherever it sits
        order = torch.argsort(offs[nonempty], stable=True)
        so, sl = offs[nonempty][order], lens[nonempty][order]
        if bool((so[1:] < so[:-1] + sl[:-1]).any()):
            raise ValueError("split_offsets: segments overlap")
    return split_offsets.to(torch.int64)


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
