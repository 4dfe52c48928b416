"""The expert-parallel dispatch's routing tables, built by counting on the tokens' device.

``send_layout`` (the sender): from topk_idx [T, k], the count rows exchanged with the peers, each
token's row in the send buffer (blocks by destination rank, tokens ascending in a block), the send
order and the metadata rows. ``expand_layout`` (the receiver): from the received metadata rows, the
(token, slot) entries grouped by local expert, in entry order within an expert (a stable counting
sort), each expert's rows starting at the aligned prefix of the lengths.

On CUDA with the native extension each is two kernels and never synchronizes with the host
(csrc/kernels/sm90_dispatch_layout.cu); elsewhere the torch functions below compute the same tables
(the reference the kernels are tested against; they may synchronize).

Count rows (int64 [W, width], row r for destination rank r):
  [INFO_ERROR] 0 (a caller that rejected its inputs sends 1), [INFO_HEADER, +LAYOUT_HEADER) the
  header values, [INFO_INVALID] ids outside [-1, E), [INFO_DROPPED] with fixed blocks the tokens
  for rank r past its block (not sent), [INFO_RANKS, +W) tokens routed to each rank,
  then L = E / W counts of (token, slot) pairs per expert of rank r, then k counts of tokens whose
  slot j goes to rank r, zeros up to width.
Metadata rows (int32 [n, 2k + 1]): the local ids of the destination's experts (-1 elsewhere), the
weights' float32 bits (0 without weights), the token's index in the sender's batch.

Fixed blocks (``block_rows=B``, the sync-free dispatch): rank r's block of the send buffer is rows
[r B, r B + B) whatever the counts, so that every size is known without reading the counts: the
first B tokens for r fill its first rows, later ones are not sent (counted in INFO_DROPPED), and the
block's unused rows carry metadata ids -1 (no entries), weights 0, token -1, and send_token 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_fp4.ops import _native

INFO_ERROR = 0
INFO_HEADER = 1
LAYOUT_HEADER = 8  # header values at most
INFO_INVALID = INFO_HEADER + LAYOUT_HEADER
INFO_DROPPED = INFO_INVALID + 1
INFO_RANKS = INFO_DROPPED + 1
MAX_RANKS = 64  # the native kernels' limits (the torch functions have none)
MAX_LOCAL_EXPERTS = 1024


def info_width(world_size: int, experts_per_rank: int, max_topk: int) -> int:
    """Columns of a count row for ``world_size`` ranks of ``experts_per_rank`` experts, k <= max_topk."""
    return INFO_RANKS + world_size + experts_per_rank + max_topk


class SendLayout(NamedTuple):
    info: torch.Tensor        # int64 [W, width]: the count rows
    rank_table: torch.Tensor  # int64 [T, W]: the send row of (token, rank), -1 where not sent
    send_token: torch.Tensor  # int64 [>= n_send]: the token of each send row (the first n_send)
    meta: torch.Tensor        # int32 [>= n_send, 2k + 1]: the metadata rows (the first n_send)


class ExpandLayout(NamedTuple):
    slot_table: torch.Tensor             # int64 [n, k]: the output row of each entry, -1 for none
    expand_row: torch.Tensor             # int64 [R]: the received token of each row, -1 for a gap row
    expand_slot: torch.Tensor            # int64 [R]: its slot, -1 for a gap row
    row_weights: torch.Tensor | None     # float32 [R]: its weight, 0 for a gap row
    split_lens: torch.Tensor             # int64 [L]
    split_offsets: torch.Tensor          # int64 [L]: the aligned starts
    gap_rows: torch.Tensor | None        # int64 [num_gap]: the rows between the experts, ascending, then R for
                                         # any past the capacity and for the entries past the gaps; None if num_gap 0
    recv_topk_idx: torch.Tensor          # int64 [n, k]: local expert ids, -1 for none
    recv_topk_weights: torch.Tensor | None  # float32 [n, k]
    recv_src_token: torch.Tensor         # int64 [n]: each token's index in its sender's batch
    rows_needed: torch.Tensor            # int64 [1]: the rows the experts take, aligned (> R: rows were dropped)


def send_layout(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int, world_size: int,
                header: list[int], width: int, block_rows: int = 0) -> SendLayout:
    """topk_idx int64/int32 [T, k] (contiguous): expert ids in [0, num_experts), -1 for none (other
    ids are counted as invalid and sent nowhere); topk_weights float [T, k] (contiguous) or None;
    header: at most LAYOUT_HEADER ints copied into every count row; width: the count rows' columns;
    block_rows: 0 (blocks back to back, sized by the counts) or B > 0 (fixed blocks of B rows)."""
    if len(header) > LAYOUT_HEADER:
        raise ValueError(f"header: at most {LAYOUT_HEADER} values, got {len(header)}")
    if width < info_width(world_size, num_experts // world_size, topk_idx.shape[1]):
        raise ValueError(f"width: {width} columns are too few for the count rows")
    if topk_idx.is_cuda and _native.available() and world_size <= MAX_RANKS:
        return SendLayout(*_native.module().send_layout(topk_idx, topk_weights, num_experts, world_size,
                                                        list(header), width, block_rows))
    return send_layout_torch(topk_idx, topk_weights, num_experts, world_size, header, width, block_rows)


def expand_layout(meta: torch.Tensor, topk: int, num_local: int, alignment: int, num_rows: int, num_gap: int,
                  weights: bool) -> ExpandLayout:
    """meta int32 [n, 2k + 1] (contiguous): received metadata rows; num_local: L experts here;
    alignment: each expert's rows start on a multiple of it; num_rows: R, rows of the outputs (the
    aligned lengths' sum; rows past R are not written and their slots get -1); num_gap: the entries
    of the gap list (the rows between the experts, or a bound on them: L * (alignment - 1));
    weights: whether the metadata carries weights."""
    if meta.is_cuda and _native.available() and num_local <= MAX_LOCAL_EXPERTS:
        return ExpandLayout(*_native.module().expand_layout(meta, topk, num_local, alignment, num_rows, num_gap,
                                                            weights))
    return expand_layout_torch(meta, topk, num_local, alignment, num_rows, num_gap, weights)


class RouteCounts(NamedTuple):
    bad: torch.Tensor         # bool [T, k]: ids outside [-1, E)
    expert: torch.Tensor      # int64 [T, k]: each slot's expert, E for empty and bad slots
    dest_rank: torch.Tensor   # int64 [T, k]: the rank of each slot's expert, W for empty and bad slots
    in_rank: torch.Tensor     # bool [T, W]: token t goes to rank r
    per_rank: torch.Tensor    # int64 [W]: tokens to each rank
    per_expert: torch.Tensor  # int64 [E]: (token, slot) pairs per expert
    slots: torch.Tensor       # int64 [W, k]: tokens whose slot j goes to rank r


def route_counts(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> RouteCounts:
    """The counts of a routing in torch ops, no host synchronisation: experts split evenly and
    contiguously over the ranks; ids outside [-1, num_experts) are flagged and count as empty."""
    t, k = topk_idx.shape
    w, ell, dev = world_size, num_experts // world_size, topk_idx.device
    idx = topk_idx.to(torch.int64)
    bad = (idx < -1) | (idx >= num_experts)
    expert = torch.where(bad, -1, idx).remainder_(num_experts + 1)  # empty and bad slots -> num_experts
    dest = expert // ell  # world_size for those
    in_rank = torch.zeros(t, w + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :w]
    ones = torch.ones(t, k, dtype=torch.int64, device=dev)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, expert.reshape(-1), ones.reshape(-1))[:num_experts]
    slots = torch.zeros(w + 1, k, dtype=torch.int64, device=dev).scatter_add_(0, dest, ones)[:w]
    return RouteCounts(bad, expert, dest, in_rank, in_rank.sum(0, dtype=torch.int64), per_expert, slots)


def send_rows(in_rank: torch.Tensor, per_rank: torch.Tensor, block_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank_table int64 [T, W]: each token's row in the send buffer, -1 where not sent; bool [T, W]:
    where it is sent): blocks by rank, tokens ascending in a block; back to back (block_rows 0) or
    at r * block_rows, the tokens past a block not sent."""
    w = in_rank.shape[1]
    flag = in_rank.to(torch.int64)
    pos = torch.cumsum(flag, 0) - flag  # the token's place in its rank's block
    if block_rows:
        in_rank = in_rank & (pos < block_rows)
        start = torch.arange(w, device=in_rank.device) * block_rows
    else:
        start = torch.cumsum(per_rank, 0) - per_rank
    return torch.where(in_rank, pos + start, -1), in_rank


def send_layout_torch(topk_idx, topk_weights, num_experts, world_size, header, width, block_rows=0) -> SendLayout:
    """The reference of ``send_layout`` in torch ops (CPU, or CUDA without the extension)."""
    t, k = topk_idx.shape
    w, ell = world_size, num_experts // world_size
    dev = topk_idx.device
    bad, expert, dest, in_rank, per_rank, per_expert, slots = route_counts(topk_idx, num_experts, world_size)
    info = torch.zeros(w, width, dtype=torch.int64, device=dev)
    for i, v in enumerate(header):
        info[:, INFO_HEADER + i] = v
    info[:, INFO_INVALID] = bad.sum()
    info[:, INFO_RANKS:INFO_RANKS + w] = per_rank.unsqueeze(0)
    info[:, INFO_RANKS + w:INFO_RANKS + w + ell] = per_expert.view(w, ell)
    info[:, INFO_RANKS + w + ell:INFO_RANKS + w + ell + k] = slots
    if block_rows:
        info[:, INFO_DROPPED] = (per_rank - block_rows).clamp(min=0)
    rank_table, in_rank = send_rows(in_rank, per_rank, block_rows)
    n_rows = w * block_rows if block_rows else t * w
    target = torch.where(in_rank, rank_table, n_rows).reshape(-1)  # rows not sent land past the end
    token = torch.arange(t, device=dev)
    send_token = torch.zeros(n_rows + 1, dtype=torch.int64, device=dev)
    send_token.scatter_(0, target, token.repeat_interleave(w))
    ranks = torch.arange(w, device=dev).view(1, w, 1)
    meta = torch.empty(t, w, 2 * k + 1, dtype=torch.int32, device=dev)
    meta[:, :, :k] = torch.where(dest.unsqueeze(1) == ranks, expert.remainder(ell).unsqueeze(1), -1)
    bits = topk_weights.to(torch.float32).view(torch.int32) if topk_weights is not None else \
        torch.zeros(t, k, dtype=torch.int32, device=dev)
    meta[:, :, k:2 * k] = bits.unsqueeze(1)
    meta[:, :, 2 * k] = token.unsqueeze(1).to(torch.int32)
    out_meta = torch.zeros(n_rows + 1, 2 * k + 1, dtype=torch.int32, device=dev)
    out_meta[:, :k] = -1  # (unused rows: no entries, weights 0, token -1)
    out_meta[:, 2 * k] = -1
    out_meta.index_copy_(0, target, meta.reshape(t * w, 2 * k + 1))
    return SendLayout(info, rank_table, send_token[:n_rows], out_meta[:n_rows])


def expand_layout_torch(meta, topk, num_local, alignment, num_rows, num_gap, weights) -> ExpandLayout:
    """The reference of ``expand_layout`` in torch ops (a stable sort by local expert)."""
    k, ell, dev = topk, num_local, meta.device
    n = meta.shape[0]
    ids = meta[:, :k].to(torch.int64)
    valid = (ids >= 0) & (ids < ell)
    ids = torch.where(valid, ids, -1)
    key = torch.where(valid, ids, ell).reshape(-1)
    lens = torch.zeros(ell + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:ell]
    order = torch.sort(key, stable=True).indices  # entries by expert, in entry order within one
    sorted_key = key[order]
    aligned = (lens + alignment - 1) // alignment * alignment
    starts = torch.cumsum(aligned, 0) - aligned
    plain = torch.cumsum(lens, 0) - lens
    keep = sorted_key < ell
    e = sorted_key.clamp(max=ell - 1)
    row = torch.arange(n * k, device=dev) - plain[e] + starts[e]
    keep &= row < num_rows
    row = torch.where(keep, row, -1)
    slot_table = torch.full((n * k,), -1, dtype=torch.int64, device=dev).scatter_(0, order, row).view(n, k)
    target = torch.where(keep, row, num_rows)  # entries without a row land past the end
    expand_row = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, target, order // k)
    expand_slot = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, target, order % k)
    recv_w = meta[:, k:2 * k].contiguous().view(torch.float32) if weights else None
    row_weights = None
    if weights:
        row_weights = torch.zeros(num_rows + 1, dtype=torch.float32, device=dev).scatter_(
            0, target, recv_w.reshape(-1)[order])[:num_rows]
    gap_rows = None
    if num_gap:  # rows [start + len, start + aligned) of each expert, in order; R past the capacity and the list
        n_gaps = int((aligned - lens).sum())
        of_gap = torch.repeat_interleave(torch.arange(ell, device=dev), aligned - lens, output_size=n_gaps)
        first = torch.cumsum(aligned - lens, 0) - (aligned - lens)
        gaps = (starts + lens - first)[of_gap] + torch.arange(n_gaps, device=dev)
        gap_rows = torch.full((max(num_gap, n_gaps),), num_rows, dtype=torch.int64, device=dev)
        gap_rows[:n_gaps] = gaps.clamp(max=num_rows)
        gap_rows = gap_rows[:num_gap]
    return ExpandLayout(slot_table, expand_row[:num_rows], expand_slot[:num_rows], row_weights, lens, starts,
                        gap_rows, ids, recv_w, meta[:, 2 * k].to(torch.int64), aligned.sum().view(1))


__all__ = ["ExpandLayout", "RouteCounts", "SendLayout", "expand_layout", "expand_layout_torch", "info_width",
           "route_counts", "send_layout", "send_layout_torch", "send_rows"]
