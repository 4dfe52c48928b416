"""All-to-all backends: move uint8 rows between ranks, and own the payload exchange of a dispatch
and of a combine (``AllToAllBackend.dispatch`` / ``AllToAllBackend.combine``; ``Buffer`` computes the
layout and hands the payload to its backend).

``TorchDistributedBackend`` wraps ``torch.distributed.all_to_all_single`` (input/output split sizes
in rows); its device follows the process group: NCCL carries CUDA tensors, gloo CPU tensors.
``LocalBackend`` is the world of one process (no process group), where an all-to-all is a copy.
The symmetric-memory backend (moe_fp4.ep.symmetric) overrides the payload exchange; the backend for
a group and a name is chosen by ``moe_fp4.ep.buffer.make_backend``.

The payload exchange of this module (the all-to-all path): the dispatch encodes each token once
into its row of every destination's block of the send rows (``PayloadCodec.encode_push``; wider rows
or more ranks than one pass stores to: encode, then gather by destination) and moves them with one
all-to-all; the combine sums each received token's expert rows (Triton on CUDA: ``gather_sum``),
encodes the partial sums, moves them back with one all-to-all and sums them per token in rank order.

A gloo collective returns to its caller before gloo's worker thread has let go of the work and of
the tensors in it. A tensor whose last Python reference goes first is then freed by that thread,
which must take the GIL to do it; if the interpreter is shutting down by then, the thread is killed
inside C++ and the process aborts ("terminate called without an active exception"). So the backend
keeps its Python references until the worker has let go (microseconds: the work is complete).
"""

from __future__ import annotations

import atexit
import time

import torch

from moe_fp4.ep import _triton_combine, sms
from moe_fp4.ep.payloads import fused_wire, gather_rows
from moe_fp4.ops import MAX_ROW_DESTINATIONS

try:
    import torch.distributed as dist
except Exception:  # torch built without distributed support
    dist = None


# The widest payload row the one-pass encode into the send blocks takes: the multi-destination
# kernels stage rows in shared memory (29,024 bytes per row on an H100/H200); wider rows are encoded,
# then gathered by destination.
PUSH_ROW_BYTES = 16384


class AllToAllBackend:
    """Interface: ``rank``, ``world_size``, ``device`` and ``all_to_all``; ``dispatch`` and
    ``combine`` (the payload exchange) are built on ``all_to_all`` and may be overridden.

    The ``handle`` these methods take is a ``moe_fp4.ep.DispatchHandle`` (read, never changed:
    split sizes, the send order, the slot and rank tables); ``num_sms`` is the Buffer's SM budget
    (None: no bound; see ``moe_fp4.ep.sms``)."""

    name = "backend"
    rank = 0
    world_size = 1
    device = torch.device("cpu")
    # A backend whose transfer finds each token's ranks itself (DeepEP: moe_fp4.ep.deepep) sets this and
    # implements ``dispatch_routed``; Buffer then skips its count and metadata exchange.
    routes_tokens = False

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None) -> None:
        """out [sum(out_splits), ...] <- inp [sum(in_splits), ...]: rank r's block of inp goes to
        rank r, and block s of out comes from rank s. None splits mean equal blocks."""
        raise NotImplementedError

    def dispatch(self, x: torch.Tensor, codec, handle, *, fp8=False, num_sms: int | None = None):
        """The payload exchange of a dispatch: x float [T, H] -> (received rows uint8 [n_recv,
        codec.row_bytes(H)], grouped by source rank, fp8). fp8: the ``return_fp8`` asked for (False,
        True/"rows", "tokens"); a backend that converts the rows on the way returns the FP8 1x128
        pair (float8_e4m3fn [R, H], float32 [R, H/128]; "tokens": R = n_recv, one row per received
        row; rows: R = handle.alloc_rows in the order of the expert rows, gap rows not yet filled),
        else None and the caller converts. This path converts nothing (None)."""
        hidden = x.shape[1]
        width = codec.row_bytes(hidden)
        recv_rows = torch.empty(handle.num_recv_tokens, width, dtype=torch.uint8, device=self.device)
        if handle.world_size <= MAX_ROW_DESTINATIONS and width <= PUSH_ROW_BYTES:
            # one pass: each token encoded once and stored to its row in every destination's block of
            # the send buffer (the rank table's rows), no gather of encoded rows by destination
            send_rows = torch.empty(sum(handle.send_counts), width, dtype=torch.uint8, device=self.device)
            if send_rows.shape[0] and x.shape[0]:
                codec.encode_push(x, [send_rows] * handle.world_size, handle.rank_table,
                                  max_blocks=sms.max_blocks(num_sms, sms.NATIVE_WARPS, x.device))
        else:  # (more ranks than one encode pass stores to, or wider rows): encode, then a gather
            rows = codec.encode(x)
            if rows.shape[0] == 0:  # (the unused rows of a sync-free handle's fixed blocks gather row 0)
                rows = rows.new_zeros(1, rows.shape[1])
            send_rows = gather_rows(rows, handle.send_token)
        self.all_to_all(recv_rows, send_rows, handle.recv_counts, handle.send_counts)
        return recv_rows, None

    def dispatch_routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, codec, *,
                        num_experts: int, alignment: int, num_sms: int | None = None):
        """A dispatch without a handle, where ``routes_tokens``: x float [T, H], topk_idx int [T, k],
        topk_weights float [T, k] or None (checked by the Buffer) -> (received rows uint8 [n_recv,
        codec.row_bytes(H)], a DispatchHandle whose expert rows are laid out with ``alignment``)."""
        raise NotImplementedError(f"the {self.name} backend does not route tokens itself")

    def combine(self, y: torch.Tensor, handle, codec, *, weights: torch.Tensor | None = None,
                num_sms: int | None = None) -> torch.Tensor:
        """The payload exchange of a combine: y float [N, H'] (the dispatch's expert rows) ->
        bfloat16 [T, H'] with the arithmetic of ``moe_fp4.ep.buffer`` (per received token the sum of
        its rows in slot order, times weights float32 [n_recv, k] when given; then per token the sum
        of the decoded partials in rank order)."""
        fused = _triton_combine.available(y)
        bf16_wire = codec.name == "bf16"
        if fused:
            partial = _triton_combine.gather_sum(y, handle.slot_table, weights,
                                                 torch.bfloat16 if bf16_wire else torch.float32, num_sms=num_sms)
            wire = partial.view(torch.uint8) if bf16_wire else codec.encode(partial)
        else:
            wire = codec.encode(local_sums(y, handle, weights))
        back = torch.empty(sum(handle.send_counts), wire.shape[1], dtype=torch.uint8, device=self.device)
        self.all_to_all(back, wire, handle.send_counts, handle.recv_counts)
        if not fused:
            return rank_sums(codec.decode(back, y.shape[1]), handle).to(torch.bfloat16)
        if fused_wire(codec) is not None:  # decode inside the sum: no float32 copy of the rows
            bases = torch.full((self.world_size,), back.data_ptr(), dtype=torch.int64, device=self.device)
            return _triton_combine.decode_sum(bases, handle.rank_table, y.shape[1], fused_wire(codec),
                                              num_sms=num_sms)
        values = back.view(torch.bfloat16) if bf16_wire else codec.decode(back, y.shape[1])
        return _triton_combine.gather_sum(values, handle.rank_table, None, torch.bfloat16, num_sms=num_sms)


def local_sums(y: torch.Tensor, handle, weights: torch.Tensor | None) -> torch.Tensor:
    """float32 [n_recv, H]: per received token, the sum over its local slots in slot order (whole
    tensors per slot: no host sync, also for a sync-free handle); the torch reference of the combine's
    first sum."""
    acc = torch.zeros(handle.num_recv_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(handle.num_topk):
        rows = handle.slot_table[:, j]
        contrib = gather_rows(y, rows.clamp(min=0)).to(torch.float32)
        if weights is not None:
            contrib = contrib * weights[:, j].unsqueeze(1)
        # (acc is never -0.0, so adding +0.0 for a slot without a row leaves its bits as they are)
        acc += torch.where((rows >= 0).unsqueeze(1), contrib, 0.0)
    return acc


def rank_sums(values: torch.Tensor, handle) -> torch.Tensor:
    """values float32 [rows sent, H] in send order -> float32 [T, H], ranks added in order (the torch
    reference of the combine's second sum)."""
    out = torch.zeros(handle.num_tokens, values.shape[1], dtype=torch.float32, device=values.device)
    for r in range(handle.world_size):
        rows = handle.rank_table[:, r]
        out += torch.where((rows >= 0).unsqueeze(1), values[rows.clamp(min=0)], 0.0)
    return out


class LocalBackend(AllToAllBackend):
    """A single process: rank 0 of a world of one. all_to_all copies."""

    name = "local"

    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors get it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def all_to_all(self, out, inp, out_splits, in_splits):
        if out.shape != inp.shape:
            raise ValueError(f"out: expected shape {tuple(inp.shape)}, got {tuple(out.shape)}")
        out.copy_(inp)


class TorchDistributedBackend(AllToAllBackend):
    """``all_to_all_single`` over a torch.distributed process group.

    group: the process group (None: the default group); device: where the tensors must live
    (default: the current CUDA device for NCCL, CPU for gloo and others)."""

    def __init__(self, group=None, device: torch.device | str | None = None):
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised; call init_process_group or use "
                             "LocalBackend")
        self.group = group
        self.name = str(dist.get_backend(group))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self.name == "nccl"
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self._peers = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]

    def all_to_all(self, out, inp, out_splits, in_splits):
        if out.device.type != "cpu" or not _CAN_COUNT_USES:  # (NCCL: the watchdog owns the work's tensors)
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                   group=self.group)
            return
        held = [(out, out._use_count()), (inp, inp._use_count())]
        try:
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                   group=self.group)
        finally:
            wait_until_released(held)


# Tensor._use_count: the references to a tensor from C++ (a collective's work) and from its Python object
_CAN_COUNT_USES = hasattr(torch.Tensor, "_use_count")
RELEASE_WAIT_S = 5.0  # the longest a collective's tensors are waited for before they are kept until exit
_unreleased: list[list[tuple[torch.Tensor, int]]] = []  # kept until exit: their work outlived RELEASE_WAIT_S


def wait_until_released(held: list[tuple[torch.Tensor, int]], timeout_s: float = RELEASE_WAIT_S) -> bool:
    """Wait until every tensor of ``held`` (tensor, use count before the collective) is back at its count,
    i.e. the process group's worker threads have dropped the work that held it; sleeping, so that
    other threads run. Returns False (and keeps the tensors until exit) if that takes over timeout_s."""
    deadline = None
    while any(t._use_count() > n for t, n in held):
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now > deadline:
            _unreleased.append(held)
            return False
        time.sleep(0)
    return True


@atexit.register
def _release_at_exit() -> None:
    # (atexit runs before the interpreter starts shutting down: the worker threads can still finish)
    pending = _unreleased[:]
    _unreleased.clear()
    for held in pending:
        wait_until_released(held)


__all__ = ["AllToAllBackend", "LocalBackend", "TorchDistributedBackend"]
