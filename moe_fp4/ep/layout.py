"""Dispatch layout: where each token goes, computed on the tokens' device without a host sync.

Experts are split evenly and contiguously across ranks: rank r owns experts
[r * L, (r + 1) * L) with L = num_experts / world_size. A token is sent once to each rank that owns
at least one of its top-k experts, however many of its experts live there; the receiver expands it
to one row per (token, slot) whose expert is local (so a duplicated expert id gives two rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4.ops import routing


@dataclass
class DispatchLayout:
    """Per-token routing of one rank's batch (all tensors on topk_idx's device).

    dest_rank: int64 [T, k], the rank owning each slot's expert; world_size for an empty slot (-1)
    is_token_in_rank: bool [T, W], token t goes to rank r
    num_tokens_per_rank: int64 [W], tokens sent to each rank (each token once per rank)
    num_tokens_per_expert: int64 [E], (token, slot) pairs per expert
    num_slots_per_rank: int64 [W, k], tokens whose slot j goes to rank r
    invalid: int64 0-dim, how many ids are outside [-1, num_experts) (such ids count as empty slots)
    """

    num_experts: int
    world_size: int
    dest_rank: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    num_slots_per_rank: torch.Tensor
    invalid: torch.Tensor

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size


def check_topk_idx(topk_idx: torch.Tensor, name: str = "topk_idx") -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int64, torch.int32):
        got = topk_idx.dtype if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__
        raise ValueError(f"{name}: expected an int64 (or int32) tensor [T, k], got {got}")
    if topk_idx.dim() != 2 or topk_idx.shape[1] == 0:
        raise ValueError(f"{name}: expected shape [T, k] with k >= 1, got {tuple(topk_idx.shape)}")


def check_experts(num_experts: int, world_size: int) -> int:
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if num_experts % world_size:
        raise ValueError(f"num_experts: {num_experts} experts cannot be split evenly over a world size of "
                         f"{world_size}")
    return num_experts // world_size


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> DispatchLayout:
    """topk_idx: int64/int32 [T, k], expert ids in [0, num_experts) or -1 (no expert).

    Runs on topk_idx's device with no host synchronisation; ids out of range are counted in
    ``invalid`` (the caller decides how to report them: Buffer.dispatch raises ValueError on every
    rank) and otherwise treated as empty slots."""
    check_topk_idx(topk_idx)
    check_experts(num_experts, world_size)
    got = routing.route_counts(topk_idx, num_experts, world_size)
    return DispatchLayout(
        num_experts=num_experts,
        world_size=world_size,
        dest_rank=got.dest_rank,
        is_token_in_rank=got.in_rank,
        num_tokens_per_rank=got.per_rank,
        num_tokens_per_expert=got.per_expert,
        num_slots_per_rank=got.slots,
        invalid=got.bad.sum(dtype=torch.int64),
    )


def send_order(layout: DispatchLayout, num_send: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the dispatch send buffer: grouped by destination rank (ascending), tokens in
    ascending order within a rank. num_send = layout.num_tokens_per_rank.sum() (known on the host).

    Returns (token int64 [num_send], rank int64 [num_send]), by counting; no host synchronisation."""
    in_rank = layout.is_token_in_rank
    t, w = in_rank.shape
    rank_table, _ = routing.send_rows(in_rank, layout.num_tokens_per_rank)
    row = torch.where(in_rank, rank_table, num_send).reshape(-1)
    token = torch.zeros(num_send + 1, dtype=torch.int64, device=in_rank.device)
    rank = torch.zeros(num_send + 1, dtype=torch.int64, device=in_rank.device)
    token.scatter_(0, row, torch.arange(t, device=in_rank.device).repeat_interleave(w))
    rank.scatter_(0, row, torch.arange(w, device=in_rank.device).repeat(t))
    return token[:num_send], rank[:num_send]


def start_offsets(counts: list[int]) -> list[int]:
    """Host ints: where each of ``counts``' blocks starts when they are laid back to back."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


__all__ = ["DispatchLayout", "dispatch_layout", "send_order", "start_offsets", "check_topk_idx", "check_experts"]
