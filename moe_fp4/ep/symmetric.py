"""Direct NVLink exchange through torch symmetric memory (``torch.distributed._symmetric_memory``).

``SymmetricMemoryBackend`` (``Buffer(..., backend="symm")``) keeps NCCL for the small exchanges
(counts, metadata) and moves the payload rows through the ranks' symmetric-memory buffers:

  dispatch  one kernel reads each token once, encodes it and stores its row straight into every
            destination (a push): this rank's receive rows, and each peer's buffer at the row where
            that peer receives it (stores over NVLink), so the encode overlaps the transfer and there
            is no staging or packing pass (mxfp4: ``ops.quantize_mxfp4_rows_multi``; bf16:
            ``ops.scatter_rows`` of the tokens' bytes; other codecs: encode, then that push).
            After a device barrier each rank copies the peers' blocks out of its own buffer into its
            receive rows (a local copy, so the returned rows outlive the next dispatch).
            With FP8 output asked for (``push_rows_fp8``: mxfp4 with the native ops) the push kernel
            also converts the rows a rank sends itself to FP8 from its staged row, and the peers'
            blocks are converted and copied out of the buffer in one pass after the barrier.
  combine   every expert rank writes its per-token partial sums into its staging buffer; after a
            barrier each token's rank sums (and, for fp8/mxfp4 wires, decodes) its partials straight
            out of the peers' buffers (one Triton kernel: no receive buffer, no all-to-all).
Each operation starts with a barrier, so no rank writes into a buffer (its own staging buffer, or a
receiver's in the push dispatch) while that buffer's rows are still being read (copied out by its
owner, or read by a peer). Results are bit for bit those of the NCCL path (tests/test_ep_gpu.py checks it).

Where a rank cannot map its peers' buffers as tensors (what the push writes through), the ranks
agree at the first allocation to move every payload through the NCCL all-to-all instead (the
``AllToAllBackend`` path), with a warning. Paths that measured slower and were removed (their figures
are in benchmarks/results/dispatch.md): pulling the rows out of the senders' staging buffers
(``push=False``), its encode in slices, and converting to FP8 after the transfer while pushing
(``overlap_fp8=False``).

Multicast is never used (no multimem operations; set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on
machines where it must stay off). The staging buffer grows on demand; the size is computed from
counts every rank knows (the dispatch handle), so every rank allocates the same size at the same
call, as the collective allocation requires (the allocation synchronises the host; it happens on
first use and when a larger batch arrives). Buffers replaced by a larger one stay allocated until
the backend is dropped (a peer may still be reading them).
"""

from __future__ import annotations

import warnings

import torch

from moe_fp4.ep import _triton_combine, _triton_rows, sms
from moe_fp4.ep.backends import TorchDistributedBackend, dist
from moe_fp4.ep.layout import start_offsets
from moe_fp4.ep.payloads import fused_wire
from moe_fp4.formats import FP8_GROUP

_MIB = 1 << 20


class SymmetricMemoryBackend(TorchDistributedBackend):
    """Payload rows and combine partials through the ranks' symmetric-memory buffers: the dispatch
    stores rows straight into the receivers' buffers, the combine reads the partial sums out of the
    peers' buffers.

    group: an NCCL process group (None: the default group) whose ranks share NVLink (one host);
    timeout_ms: how long a device barrier waits for a peer before the kernel traps.
    At the first allocation the ranks agree whether every one of them can map its peers' buffers as
    tensors; if one cannot, every rank moves its payloads through the NCCL all-to-all (a warning
    says which rank could not). Every rank must pass the same ``return_fp8`` to each dispatch."""

    direct = True

    def __init__(self, group=None, *, timeout_ms: int = 120_000):
        super().__init__(group)
        if self.name != "nccl":
            raise ValueError(f"backend: 'symm' needs an NCCL process group on CUDA devices, the group uses "
                             f"{self.name!r}")
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        self.name = "symm"
        self.timeout_ms = timeout_ms
        self.mapped = True  # every rank can map its peers' buffers (agreed at the first allocation)
        self._peer_views: dict = {}  # rank -> uint8 [capacity]: that rank's buffer as seen from this GPU
        self.capacity = 0
        self._keep: list = []  # (tensor, handle) of every buffer allocated (peers may still read old ones)
        self._buffer = None
        self._handle = None
        self.bases = None  # int64 [W]: each rank's staging buffer address, as seen from this GPU
        # high priority: the row copies get SMs as soon as they free up, beside the encoder
        self.side_stream = torch.cuda.Stream(self.device, priority=-1)

    def usable(self, t: torch.Tensor) -> bool:
        """The direct path needs the Triton kernels (else the NCCL collectives are used)."""
        return _triton_rows.available(t) and _triton_combine.available(t)

    def _group_name(self):
        g = self.group if self.group is not None else dist.group.WORLD
        return g

    def ensure_capacity(self, nbytes: int) -> None:
        """Collective: every rank must call it with the same ``nbytes`` (computed from shared counts).
        The first call allocates even for nbytes 0 (a dispatch in which no row moves still needs the
        buffer's barriers and peer views)."""
        if nbytes <= self.capacity and self._handle is not None:
            return
        size = max(nbytes, 2 * self.capacity, _MIB)
        size = -(-size // _MIB) * _MIB
        g = self._group_name()
        enable = getattr(self._symm, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    enable(g.group_name)
                except Exception:  # newer torch: not needed
                    pass
        buf = self._symm.empty(size, dtype=torch.uint8, device=self.device)
        handle = self._symm.rendezvous(buf, g)
        self._keep.append((buf, handle))
        self._buffer, self._handle = buf, handle
        self.bases = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=self.device)
        first = self.capacity == 0
        self.capacity = size
        self._peer_views = {}
        if first and self.world_size > 1:
            self._agree_at_first_allocation()

    def _agree_at_first_allocation(self) -> None:
        """Collective, at the first allocation: every rank tries to map each peer's buffer as a
        tensor (what the push dispatch writes through); one all-reduce (MIN) tells every rank
        whether all could. If not, ``mapped`` turns False on every rank and the payloads move
        through the NCCL all-to-all (one warning per rank). One host sync, once."""
        reason = ""
        try:
            for r in range(self.world_size):
                if r != self.rank:
                    self.peer_rows(r, 1, 1)
        except (AttributeError, RuntimeError, TypeError) as e:  # no tensor view of peers' buffers in this torch
            reason = " ".join(str(e).split()) or type(e).__name__
        flag = torch.tensor([0 if reason else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not flag.item():
            self.mapped = False
            why = f"this rank cannot address its peers' buffers as tensors ({reason})" if reason else \
                "another rank cannot address its peers' buffers as tensors"
            warnings.warn(f"symm backend: {why}; every rank moves its payloads through the NCCL all-to-all",
                          RuntimeWarning, stacklevel=5)

    # -------------------------------------------------------------------------------------------
    # the payload exchange (AllToAllBackend's interface)
    # -------------------------------------------------------------------------------------------

    def dispatch(self, x, codec, handle, *, fp8=False, num_sms=None):
        """The push dispatch (``push_rows``; with ``fp8`` and a codec that converts in place,
        ``push_rows_fp8``, which returns the FP8 pair); the all-to-all path where the Triton
        kernels do not run or the ranks cannot map each other's buffers."""
        if not self.usable(x):
            return super().dispatch(x, codec, handle, fp8=fp8, num_sms=num_sms)
        self.ensure_capacity(max(recv_rows_per_rank(handle)) * codec.row_bytes(x.shape[1]))  # (collective)
        if not self.mapped:
            return super().dispatch(x, codec, handle, fp8=fp8, num_sms=num_sms)
        per_token = fp8 == "tokens"
        k = 1 if per_token else handle.slot_table.shape[1]
        if fp8 and codec.expands_in_place(x, x.shape[1], k):
            return push_rows_fp8(self, x, codec, handle, per_token, num_sms=num_sms)
        return push_rows(self, x, codec, handle, num_sms=num_sms), None

    def combine(self, y, handle, codec, *, weights=None, num_sms=None):
        """``combine_sums`` over the staging buffers; the all-to-all path as in ``dispatch``."""
        if self.usable(y) and self._handle is None:
            self.ensure_capacity(0)  # (collective) the first allocation decides ``mapped``
        if not self.usable(y) or not self.mapped:
            return super().combine(y, handle, codec, weights=weights, num_sms=num_sms)
        return combine_sums(self, y, handle, weights, codec, num_sms=num_sms)

    def peer_rows(self, rank: int, rows: int, width: int) -> torch.Tensor:
        """uint8 [rows, width]: the start of ``rank``'s buffer as a tensor of this GPU (a peer's
        buffer is mapped over NVLink; writes to it land in the peer's memory)."""
        if rows * width > self.capacity:
            raise ValueError(f"rows: {rows} rows of {width} bytes exceed the buffer ({self.capacity} bytes)")
        if rank == self.rank:
            return self.staging(rows, width)
        if rank not in self._peer_views:
            self._peer_views[rank] = self._handle.get_buffer(rank, (self.capacity,), torch.uint8, 0)
        return self._peer_views[rank][: rows * width].view(rows, width)

    def staging(self, rows: int, width: int) -> torch.Tensor:
        """uint8 [rows, width]: the start of this rank's staging buffer (rows back to back)."""
        if rows * width > self.capacity:
            raise ValueError(f"rows: {rows} rows of {width} bytes exceed the staging buffer ({self.capacity} bytes)")
        return self._buffer[: rows * width].view(rows, width)

    def barrier(self, channel: int) -> None:
        """Device-side barrier of the group on the current stream (no host synchronisation)."""
        try:
            self._handle.barrier(channel=channel, timeout_ms=self.timeout_ms)
        except TypeError:  # an older signature without timeout
            self._handle.barrier(channel=channel)


def _fill(values: list[int], device) -> torch.Tensor:
    """int64 [len(values)] on ``device`` from host ints through fills (no host-to-device copy, which
    would synchronise)."""
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        out[i].fill_(v)
    return out


class _DirectPlan(dict):
    """The index tensors of the direct path for one handle, each built on first use (a push dispatch
    needs only ``peer_rank_table``; fewer launches in a full dispatch)."""

    def __init__(self, handle):
        super().__init__()
        self.handle = handle

    def __missing__(self, key):
        build = getattr(self, "_" + key, None)
        if build is None:
            raise KeyError(key)
        self[key] = value = build()
        return value

    def _fill_blocks(self, counts: list[int], values=None) -> torch.Tensor:
        """int64 [sum(counts)]: values[r] (default r) repeated counts[r] times (fills: no host-to-device
        copy, which would synchronise)."""
        out = torch.empty(sum(counts), dtype=torch.int64, device=self.handle.send_token.device)
        for r, (start, n) in enumerate(zip(start_offsets(counts), counts)):
            if n:
                out[start:start + n].fill_(r if values is None else values[r])
        return out

    def _recv_rank(self):
        return self._fill_blocks(self.handle.recv_counts)

    def _delta(self):
        # my row j of the block for rank r is row (rows rank r receives from ranks < me) + j of r's view
        h = self.handle
        send_off = start_offsets(h.send_counts)
        return _fill([sum(h.count_matrix[s][r] for s in range(h.rank)) - send_off[r] for r in range(h.world_size)],
                     h.send_token.device)

    def _peer_rank_table(self):
        table = self.handle.rank_table
        return torch.where(table >= 0, table + self["delta"].unsqueeze(0), table)

    def _token_slots(self):
        # received row j -> FP8 row j: the per-token conversion as an expansion with one slot
        return torch.arange(self.handle.num_recv_tokens, device=self.handle.send_token.device).unsqueeze(1)

    def _send_rank(self):
        return self._fill_blocks(self.handle.send_counts)

    def _send_peer_row(self):
        n_send = sum(self.handle.send_counts)
        return torch.arange(n_send, device=self.handle.send_token.device) + self["delta"][self["send_rank"]]


def direct_plan(handle) -> dict:
    """Index tensors of the direct path for ``handle`` (cached on it; each built on first use, without
    host synchronisation), all int64 on the handle's device:
      recv_rank [n_recv]: the source rank of each received row;
      peer_rank_table [T, W]: the row of (token, rank) in that rank's received rows, -1 if not sent;
      send_rank / send_peer_row [n_send]: the destination of each sent row and its row there."""
    cache = handle.direct_cache
    if "plan" not in cache:
        cache["plan"] = _DirectPlan(handle)
    return cache["plan"]


def recv_rows_per_rank(handle) -> list[int]:
    """Host ints [W]: how many rows each rank receives in the dispatch of ``handle`` (the same list on
    every rank, so buffer sizes computed from it agree)."""
    w = handle.world_size
    return [sum(handle.count_matrix[s][r] for s in range(w)) for r in range(w)]


def push_rows(backend: SymmetricMemoryBackend, x: torch.Tensor, codec, handle, *,
              num_sms: int | None = None) -> torch.Tensor:
    """The push dispatch: x [T, H] -> received rows uint8 [n_recv, row_bytes] (grouped by source
    rank, the bytes of the all-to-all path). Rows for this rank go straight into the returned
    tensor; rows for rank r into r's buffer at the row r receives them (``peer_rank_table``); after
    the barrier the peers' blocks are copied out of this rank's buffer (contiguous slices).
    num_sms: the SM budget of the push and the copies (moe_fp4.ep.sms)."""
    w, me = handle.world_size, handle.rank
    width = codec.row_bytes(x.shape[1])
    plan = direct_plan(handle)
    recv_per_rank = recv_rows_per_rank(handle)
    backend.ensure_capacity(max(recv_per_rank) * width)  # the same size on every rank
    recv = torch.empty(handle.num_recv_tokens, width, dtype=torch.uint8, device=backend.device)
    dests = [recv if r == me else backend.peer_rows(r, recv_per_rank[r], width) for r in range(w)]
    backend.barrier(0)  # every rank has finished copying out of its buffer (and reading peers')
    codec.encode_push(x, dests, plan["peer_rank_table"], max_blocks=sms.max_blocks(num_sms, sms.NATIVE_WARPS,
                                                                                    x.device))
    backend.barrier(1)  # every row has landed
    recv_off = start_offsets(handle.recv_counts)
    own = backend.staging(handle.num_recv_tokens, width)
    # the peers' blocks are [0, my block) and [after my block, n_recv): at most two local copies
    lo, hi = recv_off[me], recv_off[me] + handle.recv_counts[me]
    for a, b in ((0, lo), (hi, handle.num_recv_tokens)):
        if b > a:
            _copy_out(backend, recv[a:b], own, a, num_sms)
    return recv


def _copy_out(backend: SymmetricMemoryBackend, out: torch.Tensor, own: torch.Tensor, start: int,
              num_sms: int | None) -> None:
    """out (uint8 [n, B], contiguous) <- rows [start, start + n) of this rank's buffer ``own``: a torch
    copy, or under an SM budget the Triton row copy with a bounded grid (the same bytes)."""
    if num_sms is None or not _triton_rows.available(out):
        out.copy_(own[start:start + out.shape[0]])
        return
    n = out.shape[0]
    rows = torch.arange(start, start + n, dtype=torch.int64, device=out.device)
    here = torch.zeros(n, dtype=torch.int64, device=out.device)  # (rank 0 of a one-entry base table)
    _triton_rows.copy_rows(out, rows, here, backend.bases[backend.rank:backend.rank + 1], num_sms=num_sms)


def push_rows_fp8(backend: SymmetricMemoryBackend, x: torch.Tensor, codec, handle, per_token: bool, *,
                  num_sms: int | None = None):
    """The push dispatch with the received rows converted to FP8 1x128 on the way: x [T, H] ->
    (received rows uint8 [n_recv, row_bytes] as ``push_rows`` returns them, (float8_e4m3fn [R, H],
    float32 [R, H/128])) with R = n_recv (``per_token``: row j is received row j) or the handle's
    expert rows (row slot_table[j, s] is received row j, as ``DispatchOutput.to_fp8_blockwise``;
    handle.alloc_rows of them). num_sms: the SM budget of the push (moe_fp4.ep.sms; the conversion
    of the peers' rows, ``ops.mxfp4_rows_expand_fp8_blockwise``, takes no grid cap).

    One kernel encodes each token once and stores its row to every receiver; a row this rank sends
    itself is also converted, from the row staged in shared memory, to its FP8 rows while the stores
    to the peers are in flight (``codec.encode_push_expand``). Once every rank has pushed (a barrier
    on the side stream), the peers' rows are converted straight out of this rank's buffer and copied
    to the received rows in one pass, on the high-priority side stream. Only for codecs that convert
    in place (``expands_in_place``); the bits equal converting after the transfer."""
    w, me = handle.world_size, handle.rank
    hidden = x.shape[1]
    width = codec.row_bytes(hidden)
    plan = direct_plan(handle)
    recv_per_rank = recv_rows_per_rank(handle)
    backend.ensure_capacity(max(recv_per_rank) * width)  # the same size on every rank
    n = handle.num_recv_tokens
    recv, slots, out = _fp8_outputs(backend, plan, handle, hidden, width, per_token)
    lo = start_offsets(handle.recv_counts)[me]
    hi = lo + handle.recv_counts[me]
    blocks = [(a, b) for a, b in ((0, lo), (hi, n)) if b > a]  # the peers' rows in the received order
    dests = [recv if r == me else backend.peer_rows(r, recv_per_rank[r], width) for r in range(w)]
    own = backend.staging(n, width)
    main, side = torch.cuda.current_stream(backend.device), backend.side_stream
    backend.barrier(0)  # every rank has finished copying out of its buffer (and reading peers')
    side.wait_stream(main)
    if x.shape[0]:
        codec.encode_push_expand(x, dests, plan["peer_rank_table"], me, slots, out,
                                 max_blocks=sms.max_blocks(num_sms, sms.NATIVE_WARPS, x.device))
    pushed = torch.cuda.Event()
    pushed.record(main)
    with torch.cuda.stream(side):
        side.wait_event(pushed)
        backend.barrier(1)  # every rank has pushed
        for a, b in blocks:  # the peers' rows: converted and copied out in one pass
            codec.expand_fp8_blockwise_into(own[a:b], hidden, slots[a:b], out, copy_to=recv[a:b])
    main.wait_stream(side)
    return recv, out


def _fp8_outputs(backend, plan, handle, hidden: int, width: int, per_token: bool):
    """The received rows (uint8 [n_recv, width]), the slot table of the conversion (one slot per
    received row, or the handle's expert slots) and its FP8 output pair, all new."""
    n = handle.num_recv_tokens
    recv = torch.empty(n, width, dtype=torch.uint8, device=backend.device)
    slots = plan["token_slots"] if per_token else handle.slot_table
    num_out = n if per_token else handle.alloc_rows
    out = (torch.empty(num_out, hidden, dtype=torch.float8_e4m3fn, device=backend.device),
           torch.empty(num_out, hidden // FP8_GROUP, dtype=torch.float32, device=backend.device))
    return recv, slots, out


def combine_sums(backend: SymmetricMemoryBackend, y: torch.Tensor, handle, weights, codec, *,
                 num_sms: int | None = None) -> torch.Tensor:
    """Combine over the staging buffers: y [N, H'] expert outputs -> bfloat16 [T, H'] (the same
    arithmetic and bits as the all-to-all path, ``AllToAllBackend.combine``). num_sms: the SM budget
    of the sums and copies (moe_fp4.ep.sms; the encode of fp8/mxfp4 partials takes no grid cap)."""
    hidden = y.shape[1]
    plan = direct_plan(handle)
    n_recv_per_rank = recv_rows_per_rank(handle)
    bf16_wire = codec.name == "bf16"
    width = 2 * hidden if bf16_wire else codec.row_bytes(hidden)
    backend.ensure_capacity(max(n_recv_per_rank) * width)
    backend.barrier(0)
    staging = backend.staging(handle.num_recv_tokens, width)
    if bf16_wire:
        _triton_combine.gather_sum(y, handle.slot_table, weights, torch.bfloat16,
                                   out=staging.view(torch.bfloat16), num_sms=num_sms)
    else:
        codec.encode_into(_triton_combine.gather_sum(y, handle.slot_table, weights, torch.float32, num_sms=num_sms),
                          staging)
    backend.barrier(1)
    wire = fused_wire(codec)
    if wire is not None:  # sum straight out of the peers' buffers, decoding on the way
        return _triton_combine.decode_sum(backend.bases, plan["peer_rank_table"], hidden, wire, num_sms=num_sms)
    back = torch.empty(sum(handle.send_counts), width, dtype=torch.uint8, device=backend.device)
    _triton_rows.copy_rows(back, plan["send_peer_row"], plan["send_rank"], backend.bases, num_sms=num_sms)
    values = codec.decode(back, hidden)
    return _triton_combine.gather_sum(values, handle.rank_table, None, torch.bfloat16, num_sms=num_sms)


__all__ = ["SymmetricMemoryBackend", "combine_sums", "direct_plan", "push_rows", "push_rows_fp8",
           "recv_rows_per_rank"]
