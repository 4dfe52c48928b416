"""backend="deepep": moe_fp4's payload rows through DeepEP's normal-mode dispatch and combine.

DeepEP (deepseek-ai/DeepEP v1.2.1, not on PyPI in a working form: ``bash patches/deepep/build.sh SRC
OUT`` builds its wheel) moves each token once to every rank that owns one of its top-k experts, over
NVLink between the 2, 4 or 8 GPUs of one host (intranode), or over NVSHMEM/RDMA and NVLink for
multiples of 8 ranks across hosts (internode: the same code path here, untested). This backend hands
DeepEP moe_fp4's byte rows instead of BF16 values:

Dispatch (no handle), one rank's view:
  1. DeepEP's layout (``get_dispatch_layout``), then one host read: the tokens sent to each rank
     (``DispatchHandle.send_counts``) and the count of expert ids outside [-1, E) (ValueError on this
     rank only: the peers then wait in DeepEP's dispatch until its timeout);
  2. each token encoded once to its payload row (``PayloadCodec.encode``), padded with zero bytes to
     a multiple of WIRE_ALIGN (DeepEP moves a row as two halves of 16-byte words: a copy, for the
     widths that need it: nvfp4 at most sizes (4036 bytes -> 4064 at H 7168), mxfp4 when H is not a
     multiple of 1024, fp8 when H/128 is not a multiple of 8; the receiver copies the rows out of
     the padded ones once more), viewed as bfloat16 [T, wire / 2] and passed as DeepEP's ``x`` (DeepEP never
     reads the values: a row is an opaque run of 16-bit words); DeepEP's dispatch (its own count
     exchange and host wait) returns one row per received token, ordered by source rank then
     source token (intranode), with recv_topk_idx (local expert ids, -1 elsewhere),
     recv_topk_weights (0 elsewhere), the pairs per local expert on the host, and its handle;
  3. the receiver's expert-order tables from that received set (``received_layout``: the metadata
     rows that the other backends exchange, built from recv_topk_idx / weights / source index, through
     the same ``ops.routing.expand_layout``), so that ``DispatchOutput`` (rows, ``expert_alignment``,
     split_lens / split_offsets, ``to_fp8_blockwise``, ``return_fp8``) is the other backends'.
  Intranode the received tokens come in the nccl backend's order (source rank, then source token),
  so recv_rows, recv_topk_idx and every table hold the nccl backend's bits; recv_topk_weights are 0
  in the slots of other ranks' experts (DeepEP's), where the nccl backend keeps the sender's weights.
Cached dispatch (a handle): DeepEP's cached dispatch of the rows; no layout, no host sync.
Combine: each received token's rows summed here, in slot order, weighted or not, into a bfloat16
  partial (``_triton_combine.gather_sum``, the other backends' first sum), then DeepEP's combine,
  which adds each token's partials in float32 in ascending rank order starting from +0 and rounds to
  bfloat16: the arithmetic of ``moe_fp4.ep.buffer`` with the bf16 wire, so the bits of the nccl
  backend's combine. DeepEP's combine adds bfloat16 rows only: the combine's payload is "bf16".

SM budget: ``Buffer(num_sms=N)`` is DeepEP's ``Buffer.set_num_sms`` for this backend's DeepEP calls
(N even: a sender and a receiver block per channel; None: DeepEP's default, ``deep_ep.Buffer.num_sms``,
20) and bounds moe_fp4's own kernels as for the other backends. DeepEP's handle holds per-channel
offsets, so a handle's cached dispatches and its combine run with the SM count of the dispatch that
made it, and every rank must use the same N.

DeepEP's buffer (``deep_ep.Buffer``, NVLink IPC memory, and RDMA memory internode) is made at the
first dispatch, sized by DeepEP's hints for BF16 rows of that hidden size (the widest payload row,
and the combine's rows) at that SM count, and made again, larger, when a later call needs more;
making it is collective (every rank must make the same calls, which DeepEP requires anyway). So is
freeing it (a barrier between the ranks, when the backend's last reference goes): drop every rank's
Buffer at the same point, or keep it for the life of the process; a Buffer left to the garbage
collector (say, held by an exception's traceback) can be freed on one rank while its peers wait
elsewhere, and hang them.

Limits (ValueError before DeepEP is called): 2, 4 or 8 ranks of one host, or a multiple of 8 ranks
across hosts; k <= 32 experts per token; at most 128 local experts (intranode); wire rows of at most
TMA_ROW_BYTES bytes on an SM90 build of DeepEP (bf16 up to hidden 8160; mxfp4 or fp8 far wider); no
sync-free dispatch (``max_recv_tokens``: DeepEP's ``num_worst_tokens`` is not wired here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4.ep import _triton_combine
from moe_fp4.ep.backends import AllToAllBackend, TorchDistributedBackend, dist, local_sums
from moe_fp4.ep.buffer import DispatchHandle, aligned_counts
from moe_fp4.ops import routing

BUILD_HINT = ("DeepEP v1.2.1 is not on PyPI in a working form: build its wheel with "
              "`bash patches/deepep/build.sh SRC OUT` (patches/README.md) and pip install it")
WIRE_ALIGN = 32  # bytes: DeepEP's intranode dispatch copies a row as two halves of 16-byte words
# The widest row DeepEP's SM90 dispatch stages: half a row and an 8-byte barrier in 8192 bytes per warp
TMA_ROW_BYTES = 2 * (8192 - 8) // WIRE_ALIGN * WIRE_ALIGN
INTRANODE_RANKS = (2, 4, 8)
NVL_PEERS = 8  # GPUs of one host in DeepEP's internode layout
MAX_TOPK = 32  # DeepEP's kernels: one lane per slot
MAX_LOCAL_EXPERTS = 128  # DeepEP's intranode notify kernel: one thread per local expert
BUFFER_ALIGN = 128  # bytes: DeepEP's NUM_BUFFER_ALIGNMENT_BYTES, of which both buffer sizes are multiples


def import_deep_ep():
    """The deep_ep module, or an ImportError that says how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(f"backend 'deepep' needs the deep_ep package, which does not import ({e}); "
                          f"{BUILD_HINT}") from e
    return deep_ep


def check_world(world_size: int) -> None:
    """ValueError unless DeepEP's normal kernels take ``world_size`` ranks."""
    if world_size in INTRANODE_RANKS or (world_size > NVL_PEERS and world_size % NVL_PEERS == 0):
        return
    raise ValueError(f"group: DeepEP's normal kernels take 2, 4 or 8 ranks of one host, or a multiple of "
                     f"{NVL_PEERS} ranks across hosts; this group has {world_size}")


def check_routing(num_topk: int, num_experts: int, world_size: int) -> None:
    """ValueError unless DeepEP's kernels take k experts per token and num_experts / world_size local experts."""
    if num_topk > MAX_TOPK:
        raise ValueError(f"topk_idx: DeepEP's kernels take at most {MAX_TOPK} experts per token, got k={num_topk}")
    local = num_experts // world_size
    if world_size <= NVL_PEERS and local > MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts: DeepEP's intranode kernels take at most {MAX_LOCAL_EXPERTS} experts per "
                         f"rank, got {num_experts} experts over {world_size} ranks ({local} per rank)")


def wire_bytes(row_bytes: int, name: str, sm90: bool = True) -> int:
    """The bytes per row DeepEP moves for payload rows of ``row_bytes`` (``name``: the payload):
    rounded up to WIRE_ALIGN; ValueError past TMA_ROW_BYTES on an SM90 build."""
    wire = -(-row_bytes // WIRE_ALIGN) * WIRE_ALIGN
    if sm90 and wire > TMA_ROW_BYTES:
        raise ValueError(f"payload: {name} rows of {row_bytes} bytes ({wire} on DeepEP's wire) are wider than the "
                         f"{TMA_ROW_BYTES} bytes DeepEP's SM90 dispatch stages per row; use a narrower payload "
                         "(mxfp4, fp8) or a smaller hidden size")
    return wire


def received_layout(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor | None,
                    recv_src_token: torch.Tensor | None, num_local: int, alignment: int,
                    tokens_per_expert: list[int]) -> routing.ExpandLayout:
    """The receiver's expert-order tables of a received set, as the other backends build them.

    recv_topk_idx: int [n, k], local expert ids of each received token, -1 elsewhere;
    recv_topk_weights: float32 [n, k] or None; recv_src_token: int [n], each token's index in its
    source's batch, or None (internode: not known; the layout's recv_src_token is then -1);
    tokens_per_expert: host ints [L], the (token, slot) pairs of each local expert (unaligned).
    The received set becomes the metadata rows the other backends exchange (int32 [n, 2k + 1]: ids,
    weight bits, source token) and goes through ``ops.routing.expand_layout``."""
    n, k = recv_topk_idx.shape
    meta = torch.empty(n, 2 * k + 1, dtype=torch.int32, device=recv_topk_idx.device)
    meta[:, :k] = recv_topk_idx
    if recv_topk_weights is None:
        meta[:, k:2 * k] = 0
    else:
        meta[:, k:2 * k] = recv_topk_weights.to(torch.float32).view(torch.int32)
    meta[:, 2 * k] = -1 if recv_src_token is None else recv_src_token
    n_out = sum(aligned_counts(tokens_per_expert, alignment))
    return routing.expand_layout(meta, k, num_local, alignment, n_out, n_out - sum(tokens_per_expert),
                                 recv_topk_weights is not None)


def partial_sums(y: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None,
                 num_sms: int | None = None) -> torch.Tensor:
    """bfloat16 [n_recv, H]: per received token the sum of its expert rows of y [N, H] in slot order,
    times weights float32 [n_recv, k] when given (the combine's first sum, as the other backends')."""
    if _triton_combine.available(y):
        return _triton_combine.gather_sum(y, handle.slot_table, weights, torch.bfloat16, num_sms=num_sms)
    return local_sums(y, handle, weights).to(torch.bfloat16)


@dataclass
class DeepEPHandle(DispatchHandle):
    """A DispatchHandle made by the deepep backend.

    native: DeepEP's handle (its tuple of tensors); deepep_num_sms: the SM count of the DeepEP
    dispatch that made it (its cached dispatches and its combine run with it); internode: made by
    DeepEP's internode kernels (recv_src_token is then None).
    recv_counts (tokens received from each rank) are read from DeepEP's handle on first use: a host
    sync that the dispatch and combine never need (the all-to-all of ``row_weights_with_grad``
    does). count_matrix and peer_num_tokens are empty (no backend here reads them)."""

    native: tuple = ()
    deepep_num_sms: int = 0
    internode: bool = False

    @property
    def num_recv_tokens(self) -> int:
        return self.recv_topk_idx.shape[0]

    @property
    def recv_counts(self) -> list[int]:
        if self._recv_counts is None:
            # intranode: rank_prefix_matrix [W, W], column r the running sum over sources of the
            # tokens they send rank r; internode: recv_gbl_rank_prefix_sum [W], the running sum here
            prefix = self.native[6] if self.internode else self.native[0][:, self.rank]
            sums = prefix.tolist()
            self._recv_counts = [b - a for a, b in zip([0] + sums[:-1], sums)]
        return self._recv_counts

    @recv_counts.setter
    def recv_counts(self, value: list[int] | None) -> None:
        self._recv_counts = value  # None: read from native on first use


class DeepEPBackend(AllToAllBackend):
    """Dispatch and combine through ``deep_ep.Buffer`` over an NCCL process group (see the module
    docstring). group: the process group (None: the default group); num_nvl_bytes / num_rdma_bytes:
    the sizes of DeepEP's first buffer (0: sized at the first dispatch; rounded up to BUFFER_ALIGN;
    RDMA memory only across hosts); it grows when a call needs more. ``all_to_all`` (the small
    transfers of ``row_weights_with_grad``) goes through NCCL."""

    name = "deepep"
    routes_tokens = True

    def __init__(self, group=None, *, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0):
        for key, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key}: expected a non-negative int (bytes), got {v!r}")
        self._deep_ep = import_deep_ep()
        self._nccl = TorchDistributedBackend(group)
        if self._nccl.name != "nccl":
            raise ValueError(f"group: the deepep backend needs an NCCL process group (DeepEP runs on the GPUs), "
                             f"got a {self._nccl.name!r} group")
        check_world(self._nccl.world_size)
        if num_rdma_bytes and self._nccl.world_size <= NVL_PEERS:  # (DeepEP asserts it: no RDMA intranode)
            raise ValueError(f"num_rdma_bytes: DeepEP's normal kernels use RDMA memory only across hosts (more than "
                             f"{NVL_PEERS} ranks); this group has {self._nccl.world_size}, got {num_rdma_bytes}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size, self.device = self._nccl.rank, self._nccl.world_size, self._nccl.device
        self._sm90 = bool(self._deep_ep.Buffer.is_sm90_compiled())
        self._sizes = tuple(-(-v // BUFFER_ALIGN) * BUFFER_ALIGN for v in (num_nvl_bytes, num_rdma_bytes))
        self._runtime = None  # the deep_ep.Buffer, made at the first dispatch
        self._configs: dict[int, tuple] = {}

    def all_to_all(self, out, inp, out_splits, in_splits):
        self._nccl.all_to_all(out, inp, out_splits, in_splits)

    # DeepEP's configs and buffer

    def _config(self, num_sms: int | None):
        """(the SM count, DeepEP's dispatch Config, its combine Config) for num_sms (None: DeepEP's default)."""
        cls = self._deep_ep.Buffer
        n = cls.num_sms if num_sms is None else num_sms
        if n % 2:
            raise ValueError(f"num_sms: DeepEP's kernels take an even SM count (a sender and a receiver block per "
                             f"channel), got {n}")
        if n not in self._configs:
            saved = cls.num_sms
            cls.num_sms = n  # DeepEP's tuned configs read the class's SM count (set_num_sms)
            try:
                self._configs[n] = (cls.get_dispatch_config(self.world_size), cls.get_combine_config(self.world_size))
            except AssertionError as e:
                raise ValueError(f"group: DeepEP v1.2.1 has no config for {self.world_size} ranks ({e})") from None
            finally:
                cls.num_sms = saved
        return (n, *self._configs[n])

    def _buffer(self, hidden: int, configs):
        """The deep_ep.Buffer, made or made larger for BF16 rows of ``hidden`` under ``configs``."""
        row = 2 * hidden  # the widest payload row (bf16) and the combine's rows
        w = self.world_size
        nvl = max(c.get_nvl_buffer_size_hint(row, w) for c in configs)
        rdma = max(c.get_rdma_buffer_size_hint(row, w) for c in configs) if w > NVL_PEERS else 0
        if self._runtime is None or nvl > self._sizes[0] or rdma > self._sizes[1]:
            self._sizes = (max(nvl, self._sizes[0]), max(rdma, self._sizes[1]))
            self._runtime = None  # (the old buffer goes first)
            self._runtime = self._deep_ep.Buffer(self.group, *self._sizes)
        return self._runtime

    # rows on DeepEP's wire

    def _wire_rows(self, x: torch.Tensor, codec, wire: int) -> torch.Tensor:
        """x [T, H] -> its payload rows as DeepEP's x: bfloat16 [T, wire / 2], zero bytes past a row."""
        rows = codec.encode(x)
        if rows.shape[1] != wire:
            rows = torch.nn.functional.pad(rows, (0, wire - rows.shape[1]))
        elif rows.data_ptr() % 16:  # (bf16: x itself, a view at any offset; DeepEP loads 16-byte words)
            rows = rows.clone()
        return rows.view(torch.bfloat16)

    @staticmethod
    def _received_rows(recv_x: torch.Tensor, width: int) -> torch.Tensor:
        """DeepEP's recv_x bfloat16 [n, wire / 2] -> the payload rows uint8 [n, width], contiguous."""
        rows = recv_x.view(torch.uint8)
        return rows if rows.shape[1] == width else rows[:, :width].contiguous()  # (padded wire rows: a copy)

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, DeepEPHandle):
            raise ValueError(f"handle: the deepep backend needs a handle of its own dispatch, got a "
                             f"{type(handle).__name__} made by another backend")

    # the payload exchange

    def dispatch_routed(self, x, topk_idx, topk_weights, codec, *, num_experts: int, alignment: int,
                        num_sms: int | None):
        """A dispatch without a handle (the module docstring's steps): x float [T, H], topk_idx int
        [T, k], topk_weights float [T, k] or None (checked by the Buffer) -> (received rows uint8
        [n_recv, codec.row_bytes(H)], a DeepEPHandle)."""
        w, (t, k), hidden = self.world_size, topk_idx.shape, x.shape[1]
        check_routing(k, num_experts, w)
        width = codec.row_bytes(hidden)
        wire = wire_bytes(width, codec.name, self._sm90)
        n_sms, *configs = self._config(num_sms)
        runtime = self._buffer(hidden, configs)
        idx = topk_idx.to(torch.int64).contiguous()  # (routing tensors are small)
        # DeepEP takes top-k ids and weights together (or neither, and then returns no ids)
        weights = (torch.zeros(t, k, dtype=torch.float32, device=idx.device) if topk_weights is None
                   else topk_weights.to(torch.float32).contiguous())
        bad = ((idx < -1) | (idx >= num_experts)).sum(dtype=torch.int64).view(1)
        per_rank, per_rdma, per_expert, in_rank, _ = runtime.get_dispatch_layout(idx, num_experts)
        host = torch.cat((bad, per_rank.to(torch.int64))).tolist()  # the one host read before DeepEP's own
        if host[0]:
            raise ValueError(f"topk_idx: expected expert ids in [-1, {num_experts}), got {host[0]} ids out of range "
                             "(raised on this rank only: its peers wait in DeepEP's dispatch until its timeout)")
        send_counts = host[1:]
        recv_x, recv_idx, recv_w, per_expert_list, native, _ = runtime.dispatch(
            self._wire_rows(x, codec, wire), topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            expert_alignment=1, config=configs[0])
        internode = w > NVL_PEERS
        src = None if internode else native[3]  # recv_src_idx (internode: DeepEP keeps no token index)
        got = received_layout(recv_idx, None if topk_weights is None else recv_w, src, num_experts // w, alignment,
                              list(per_expert_list))
        # the send side's tables (row_weights_with_grad's all-to-all): blocks by rank, tokens ascending
        n_send = sum(send_counts)
        rank_table, _ = routing.send_rows(in_rank, per_rank.to(torch.int64))
        target = torch.where(in_rank, rank_table, n_send).reshape(-1)
        send_token = torch.zeros(n_send + 1, dtype=torch.int64, device=idx.device).scatter_(
            0, target, torch.arange(t, device=idx.device).repeat_interleave(w))[:n_send]
        n_out = sum(aligned_counts(per_expert_list, alignment))
        handle = DeepEPHandle(
            rank=self.rank, world_size=w, num_experts=num_experts, hidden=hidden, num_topk=k, num_tokens=t,
            send_counts=send_counts, recv_counts=None, send_token=send_token, recv_topk_idx=got.recv_topk_idx,
            recv_topk_weights=got.recv_topk_weights, expand_row=got.expand_row, expand_slot=got.expand_slot,
            row_weights=got.row_weights, tokens_per_expert=list(per_expert_list), split_lens=got.split_lens,
            split_offsets=got.split_offsets, num_rows=n_out, slot_table=got.slot_table, rank_table=rank_table,
            recv_src_token=None if internode else got.recv_src_token, expert_alignment=alignment,
            gap_rows=got.gap_rows, native=native, deepep_num_sms=n_sms, internode=internode)
        return self._received_rows(recv_x, width), handle

    def dispatch(self, x, codec, handle, *, fp8=False, num_sms=None):
        """A cached dispatch: DeepEP's cached dispatch of x's rows with the handle's SM count; the
        caller converts (returns fp8 None)."""
        self._check_handle(handle)
        width = codec.row_bytes(x.shape[1])
        wire = wire_bytes(width, codec.name, self._sm90)
        _, *configs = self._config(handle.deepep_num_sms)
        runtime = self._buffer(x.shape[1], configs)
        recv_x, *_ = runtime.dispatch(self._wire_rows(x, codec, wire), handle=handle.native, config=configs[0])
        return self._received_rows(recv_x, width), None

    def combine(self, y, handle, codec, *, weights=None, num_sms=None):
        """The partial sums here (``partial_sums``), then DeepEP's combine of them (bfloat16 [T, H'])."""
        self._check_handle(handle)
        if codec.name != "bf16":
            raise ValueError(f"payload: the deepep backend's combine moves bf16 partial sums (DeepEP's combine adds "
                             f"bfloat16 rows), got {codec.name!r}")
        partial = partial_sums(y, handle, weights, num_sms)
        _, *configs = self._config(handle.deepep_num_sms)
        runtime = self._buffer(y.shape[1], configs)
        combined, _, _ = runtime.combine(partial, handle.native, config=configs[1])
        return combined


__all__ = ["DeepEPBackend", "DeepEPHandle", "check_routing", "check_world", "import_deep_ep", "partial_sums",
           "received_layout", "wire_bytes"]
