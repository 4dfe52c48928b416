"""Buffer: expert-parallel dispatch and combine over an all-to-all of opaque byte rows.

Dispatch (one rank's view; T tokens of hidden size H, top-k routing, W ranks, L = E / W experts per
rank):
  1. the send layout on the device, by counting (``ops.routing.send_layout``, two kernels on CUDA):
     a count row per destination (tokens per rank, pairs per expert, slots per rank), each token's
     row in the send buffer, the metadata rows (local expert ids, top-k weights, token index);
  2. a small all-to-all of the count rows (with each rank's hidden/k/E/W/payload/T and an error
     flag, so that bad input on any rank raises ValueError on every rank instead of hanging the others);
  3. the one host synchronisation: the count rows become Python ints (split sizes);
  4. an all-to-all of the metadata rows, then the payload exchange, which the backend owns
     (``AllToAllBackend.dispatch``: one all-to-all of the payload rows, each token once per
     destination rank; the symm backend pushes the rows into the receivers' buffers);
  5. the receiver's tables on the device (``ops.routing.expand_layout``, a stable counting sort):
     each token expanded to one row per (token, slot) whose expert is local, grouped
     by local expert (stable: by source rank, then source token order, then slot): ragged segments
     ``split_lens`` / ``split_offsets``, back to back (``expert_alignment=1``, the default) or each
     starting on a multiple of ``expert_alignment`` rows with zero rows between them; optionally
     converted to FP8 1x128.
A dispatch given a ``handle`` reuses its layout: no count or metadata exchange, no host sync.

Bad input on one rank raises ValueError on every rank, not only there: the synced dispatch's count
rows carry each rank's verdict on its arguments; on gloo groups (host memory, nothing to wait for)
the cached dispatch, the sync-free dispatch and combine first exchange one small row of verdicts and
sizes (``Buffer._agree``); on CUDA groups those three raise on the failing rank only (a verdict
exchange would be a host sync per call), and a sync-free dispatch reports bad tokens or routing
through ``DispatchHandle.check()``.

Combine (no host synchronisation; the handle holds the split sizes) returns BF16 [T, H]. It APPLIES
the top-k weights by default (``weighted=True``; pass ``weighted=False`` when the caller has already
weighted the expert outputs). Its arithmetic, which the tests reproduce bit for bit:
  on the expert rank: p_t = sum over the token's local slots j, ascending, of fp32(y_tj) * w_tj
     (float32, starting from +0); p_t travels in the combine payload (BF16 by default);
  on the token's rank: out_t = bf16(sum over ranks r, ascending, of decode(p_t from r)) (float32,
     starting from +0); a token with no expert gets zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_fp4 import formats
from moe_fp4.ep import _triton_combine, sms
from moe_fp4.ep.backends import AllToAllBackend, LocalBackend, TorchDistributedBackend, dist
from moe_fp4.ep.layout import DispatchLayout, check_experts, check_topk_idx, dispatch_layout, start_offsets
from moe_fp4.ep.payloads import PAYLOAD_IDS, PayloadCodec, gather_rows, get_payload
from moe_fp4.ep.symmetric import SymmetricMemoryBackend
from moe_fp4.formats._checks import FLOAT_INPUTS, describe
from moe_fp4.ops import mxfp4_rows_to_fp8_cols_planned, routing

MAX_TOPK = 128  # slot-count columns in the layout exchange
ROW_ALIGN = 128  # bytes: DispatchOutput.rows starts each row on a cache line
_SIGNATURE = ("hidden", "num_topk", "num_experts", "world_size", "payload")
_AGREE_WIDTH = 8  # int64 per rank in the check agreement of gloo groups (Buffer._agree)


@dataclass
class DispatchHandle:
    """What a cached dispatch and a combine need (tensors on the backend's device).

    send_counts / recv_counts: rows sent to / received from each rank (host ints);
    send_token: int64 [n_send], the token of each sent row (grouped by destination rank);
    recv_src_token: int64 [n_recv], the index of each received token in its source's batch;
    peer_num_tokens: host ints [W], every rank's batch size; count_matrix: host ints [W][W], tokens
    rank s sends to rank d (the direct backend finds rows in its own and peers' buffers at offsets
    derived from them);
    recv_topk_idx: int64 [n_recv, k], local expert ids of each received token, -1 elsewhere;
    recv_topk_weights: float32 [n_recv, k] or None;
    expand_row / expand_slot: int64 [N], the received token and slot of each output row;
    row_weights: float32 [N] or None, the weight of each output row;
    tokens_per_expert: host ints [L] (None after a sync-free dispatch); split_lens / split_offsets:
    int64 [L] on the device;
    expert_alignment: every expert's rows start on a multiple of it; gap_rows: int64 [N_gap], the
    output rows between the experts' rows (None when there are none): expand_row and expand_slot
    are -1 there, row_weights 0, and no slot names them;
    num_rows: N, the output rows;
    sync_free: made by a dispatch with ``max_recv_tokens`` (see ``Buffer.dispatch``): every size is a
    bound, not a count. The send and receive blocks have max_recv_tokens / W rows each whatever the
    counts (their unused rows are named by no table), N is the row capacity, rows past the experts'
    rows have expand_row -1 (unspecified contents), gap_rows has L * (alignment - 1) entries, those
    past the gaps being N (the outputs keep one more row past N for them); ``check()`` reports what
    did not fit."""

    rank: int
    world_size: int
    num_experts: int
    hidden: int
    num_topk: int
    num_tokens: int
    send_counts: list[int]
    recv_counts: list[int]
    send_token: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    expand_row: torch.Tensor
    expand_slot: torch.Tensor
    row_weights: torch.Tensor | None
    tokens_per_expert: list[int] | None
    split_lens: torch.Tensor
    split_offsets: torch.Tensor
    num_rows: int
    slot_table: torch.Tensor  # int64 [n_recv, k]: the output row of (received token, slot), -1 if none
    rank_table: torch.Tensor  # int64 [T, W]: the sent row of (token, rank), -1 if not sent there
    recv_src_token: torch.Tensor | None = None  # int64 [n_recv]: each received token's index at its source
    peer_num_tokens: list[int] = field(default_factory=list)  # host ints [W]: tokens of each rank's batch
    count_matrix: list[list[int]] = field(default_factory=list)  # host ints [W][W]: tokens rank s sends to d
    # the direct backend's index tensors, the FP8 of a zero row, to_fp8_cols' plan
    direct_cache: dict = field(default_factory=dict, repr=False)
    expert_alignment: int = 1
    gap_rows: torch.Tensor | None = None
    sync_free: bool = False
    # sync-free: the tensors check() reads (count rows sent and received, rows needed) and a local error
    pending: dict = field(default_factory=dict, repr=False)

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)

    @property
    def alloc_rows(self) -> int:
        """Rows to allocate for an output of the expert rows: num_rows, and one more after a sync-free
        dispatch (the row its gap list names past the capacity; the outputs are views without it)."""
        return self.num_rows + (1 if self.sync_free else 0)

    def check(self) -> None:
        """After a sync-free dispatch: raise ValueError if any rank rejected its inputs, the ranks'
        shapes disagreed, ids were out of range, tokens did not fit the receive blocks
        (max_recv_tokens) or rows did not fit the row capacity (max_recv_rows); those dispatches'
        outputs and combines are incomplete. One host synchronisation; nothing for a synced handle."""
        if not self.sync_free or self.pending.get("checked"):
            return
        p = self.pending
        sent, got = p["info"], p["recv_info"]
        host = torch.cat((sent[:, routing.INFO_DROPPED], got.reshape(-1), p["rows_needed"])).tolist()
        w, width = self.world_size, got.shape[1]
        dropped_here = sum(host[:w])
        rows = [host[w + s * width: w + (s + 1) * width] for s in range(w)]
        rows_needed = host[-1]
        p["checked"] = True
        problems = []
        if p.get("error") is not None:
            problems.append(f"this rank rejected its inputs ({p['error']})")
        bad = [s for s, r in enumerate(rows) if r[routing.INFO_ERROR]]
        if bad:
            problems.append(f"rank(s) {bad} rejected their inputs")
        head = routing.INFO_HEADER
        mine = p["header"]
        for s, r in enumerate(rows):
            if not r[routing.INFO_ERROR] and p.get("error") is None and r[head:head + len(_SIGNATURE)] != mine[:len(
                    _SIGNATURE)]:
                diff = ", ".join(f"{key} {a} here vs {b} on rank {s}" for key, a, b in
                                 zip(_SIGNATURE, mine, r[head:head + len(_SIGNATURE)]) if a != b)
                problems.append(f"ranks disagree: {diff}")
        invalid = {s: r[routing.INFO_INVALID] for s, r in enumerate(rows) if r[routing.INFO_INVALID]}
        if invalid:
            problems.append(f"topk_idx: expert ids out of [-1, {self.num_experts}) on rank(s) {invalid}")
        dropped_in = sum(r[routing.INFO_DROPPED] for r in rows)
        if dropped_here or dropped_in:
            problems.append(f"max_recv_tokens: {dropped_here} token(s) of this rank and {dropped_in} for this rank "
                            f"did not fit the blocks of {self.recv_counts[0]} tokens per source (max_recv_tokens / "
                            "world size); raise max_recv_tokens")
        if rows_needed > self.num_rows:
            problems.append(f"max_recv_rows: the experts here needed {rows_needed} rows, the capacity is "
                            f"{self.num_rows}; raise max_recv_rows")
        if problems:
            raise ValueError("sync-free dispatch: " + "; ".join(problems))

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size


class DispatchOutput:
    """The receiver's side of a dispatch.

    recv_rows: uint8 [n_recv, row_bytes], one per received token (grouped by source rank), as they
      arrived;
    rows: uint8 [N, payload.row_bytes(H)], one per (token, local slot), grouped by local expert
      (gathered from recv_rows on first access), each row starting on a 128-byte boundary (a view
      whose row stride is the row size rounded up to 128 bytes); with an ``expert_alignment`` above 1
      the rows between the experts' rows are zero bytes;
    split_lens / split_offsets: int64 [L], expert e's rows are [off_e, off_e + len_e);
    tokens_per_expert: host ints [L] (the same lengths; None after a sync-free dispatch, whose lengths
      are on the device only);
    recv_topk_idx: int64 [n_recv, k] local expert ids per received token (-1: not on this rank);
    recv_topk_weights: float32 [n_recv, k] or None;
    row_weights: float32 [N] or None, the top-k weight of each output row;
    fp8: (float8_e4m3fn [N, H], float32 [N, H/128]) in the order of ``rows`` once
      ``to_fp8_blockwise`` ran (dispatch's ``return_fp8=True``), else None (gap rows: the conversion
      of a zero row);
    recv_fp8: (float8_e4m3fn [n_recv, H], float32 [n_recv, H/128]), one row per received token (the
      layout of ``recv_rows``, with ``recv_topk_idx``), once ``recv_to_fp8_blockwise`` ran (dispatch's
      ``return_fp8="tokens"``), else None;
    handle: for combine and for cached dispatches."""

    def __init__(self, recv_rows: torch.Tensor, payload: PayloadCodec, hidden: int, handle: DispatchHandle):
        self.recv_rows = recv_rows
        self.payload = payload
        self.hidden = hidden
        self.handle = handle
        self.fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.recv_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is None:
            h = self.handle
            # each row starts on a 128-byte line (H200, the column op on 32768 dispatched mxfp4 rows of
            # 3808 bytes: 130.7 against 125.1 us when every row piece a warp reads spans two lines)
            width = self.recv_rows.shape[1]
            rows = torch.empty(h.alloc_rows, -(-width // ROW_ALIGN) * ROW_ALIGN, dtype=torch.uint8,
                               device=self.recv_rows.device)[:, :width]
            self._rows = rows[:h.num_rows]
            if h.gap_rows is None and not h.sync_free:
                gather_rows(self.recv_rows, h.expand_row, out=self._rows)
            else:  # gap rows gather row 0 (there is one: some expert has rows), then become zeros
                gather_rows(self.recv_rows, h.expand_row.clamp(min=0), out=self._rows)
                if h.gap_rows is not None:
                    rows.index_fill_(0, h.gap_rows, 0)
        return self._rows

    @property
    def split_lens(self) -> torch.Tensor:
        return self.handle.split_lens

    @property
    def split_offsets(self) -> torch.Tensor:
        return self.handle.split_offsets

    @property
    def tokens_per_expert(self) -> list[int]:
        return self.handle.tokens_per_expert

    @property
    def host_splits(self) -> tuple[list[int], list[int]] | None:
        """(split_lens, split_offsets) as host ints, or None for a sync-free dispatch (they are on the
        device only)."""
        h = self.handle
        if h.sync_free:
            return None
        return list(h.tokens_per_expert), start_offsets(aligned_counts(h.tokens_per_expert, h.expert_alignment))

    @property
    def recv_topk_idx(self) -> torch.Tensor:
        return self.handle.recv_topk_idx

    @property
    def recv_topk_weights(self) -> torch.Tensor | None:
        return self.handle.recv_topk_weights

    @property
    def row_weights(self) -> torch.Tensor | None:
        return self.handle.row_weights

    def values(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The output rows decoded: ``dtype`` [N, H]."""
        return self.payload.decode(self.rows, self.hidden, dtype=dtype)

    def to_fp8_blockwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn [N, H], float32 [N, H/128]) in the order of ``rows``: the FP8 1x128
        operand of the expert GEMMs. Each received token is converted once and written to each of
        its rows (mxfp4 on CUDA: one native pass, ``PayloadCodec.expand_fp8_blockwise``; the
        conversion is row by row, so the bits equal converting ``rows``)."""
        if self.fp8 is None:
            h = self.handle
            index = h.expand_row if h.gap_rows is None and not h.sync_free else h.expand_row.clamp(min=0)
            if h.sync_free:  # (the index of the row past the capacity)
                index = torch.cat((index, index[:1] if h.num_rows else index.new_zeros(1)))
            self.fp8 = fill_gap_rows(self.payload.expand_fp8_blockwise(self.recv_rows, self.hidden, h.slot_table,
                                                                       h.alloc_rows, index), self.payload, h)
        return self.fp8

    def recv_to_fp8_blockwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn [n_recv, H], float32 [n_recv, H/128]): the FP8 1x128 of each received token,
        in the order of ``recv_rows`` (a grouped GEMM that gathers its rows by ``recv_topk_idx``)."""
        if self.recv_fp8 is None:
            self.recv_fp8 = self.payload.to_fp8_blockwise(self.recv_rows, self.hidden)
        return self.recv_fp8

    def to_fp8_cols(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expert rows as the FP8 column operand of the weight gradient: ``ops.mxfp4_rows_to_fp8_cols``
        of ``rows`` with this output's splits (float8_e4m3fn [H, N] column-major, float32 [H, G] scales
        per 128 rows of each expert, int64 [L + 1] group offsets). The splits go from the host
        (``tokens_per_expert``), so the call does not wait for the device. With an ``expert_alignment``
        that is a multiple of 32 the conversion takes one pass instead of two; gap rows come out as
        zero columns. Needs the mxfp4 payload; computed on each call (not kept; the plan of the
        conversion is kept with the handle, so that a cached dispatch's call is a kernel launch)."""
        if self.payload.name != "mxfp4":
            raise ValueError(f"to_fp8_cols: needs the mxfp4 payload, this dispatch used {self.payload.name!r}")
        if self.handle.sync_free:
            raise ValueError("to_fp8_cols: needs the expert lengths on the host; a sync-free dispatch "
                             "(max_recv_tokens) keeps them on the device only")
        if self.hidden % formats.FP8_GROUP:
            raise ValueError(f"to_fp8_cols: needs a hidden size that is a multiple of {formats.FP8_GROUP}, "
                             f"got {self.hidden}")
        lens, starts = self.host_splits
        packed, scales = formats.unpack_mxfp4_rows(self.rows, self.hidden)
        return mxfp4_rows_to_fp8_cols_planned(packed, scales, lens, starts,
                                              self.handle.direct_cache.setdefault("fp8_cols", {}))


def aligned_counts(counts: list[int], alignment: int) -> list[int]:
    """Host ints: each count rounded up to a multiple of ``alignment``."""
    return [-(-c // alignment) * alignment for c in counts]


def fill_gap_rows(fp8: tuple[torch.Tensor, torch.Tensor], codec: PayloadCodec,
                  handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
    """The handle's gap rows of an FP8 1x128 expert-row pair set, in place, to the payload's
    conversion of a zero row (so that the pair equals converting ``DispatchOutput.rows``); the pair
    of a sync-free dispatch (handle.alloc_rows rows) is returned without its last row."""
    if handle.gap_rows is not None:
        data, scales = fp8
        key = ("zero_fp8", codec.name, data.shape[1])  # converted once per handle, not per dispatch
        if key not in handle.direct_cache:
            zero = torch.zeros(1, codec.row_bytes(data.shape[1]), dtype=torch.uint8, device=data.device)
            handle.direct_cache[key] = codec.to_fp8_blockwise(zero, data.shape[1])
        z_data, z_scales = handle.direct_cache[key]
        n = handle.gap_rows.shape[0]
        data.view(torch.uint8).index_copy_(0, handle.gap_rows, z_data.view(torch.uint8).expand(n, -1))
        scales.index_copy_(0, handle.gap_rows, z_scales.expand(n, -1))
    if fp8[0].shape[0] > handle.num_rows:  # (the sync-free outputs' row past the capacity)
        fp8 = (fp8[0][:handle.num_rows], fp8[1][:handle.num_rows])
    return fp8


def _check_alignment(expert_alignment, handle: DispatchHandle | None) -> int:
    if expert_alignment is None:
        return handle.expert_alignment if handle is not None else 1
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment!r}")
    if handle is not None and expert_alignment != handle.expert_alignment:
        raise ValueError(f"expert_alignment: the handle lays its rows out with alignment {handle.expert_alignment}, "
                         f"got {expert_alignment}")
    return expert_alignment


def _convert(out: DispatchOutput, return_fp8) -> None:
    if return_fp8 == "tokens":
        out.recv_to_fp8_blockwise()
    elif return_fp8:
        out.to_fp8_blockwise()


def make_backend(group=None, backend=None) -> AllToAllBackend:
    """The backend for ``group``: an AllToAllBackend given as ``backend`` wins; the strings "nccl"/
    "gloo" check the group's backend; "symm" is the symmetric-memory backend over an NCCL group
    (moe_fp4.ep.symmetric); "deepep" moves the rows through DeepEP (moe_fp4.ep.deepep; ImportError
    without the deep_ep package); None follows the group (a LocalBackend when torch.distributed
    is not initialised and no group is given)."""
    if isinstance(backend, AllToAllBackend):
        return backend
    if backend not in (None, "nccl", "gloo", "local", "symm", "deepep"):
        raise ValueError(f"backend: expected None, 'nccl', 'gloo', 'local', 'symm', 'deepep' or an AllToAllBackend, "
                         f"got {backend!r}")
    if backend == "deepep":  # (first: without deep_ep installed, that is the error to fix)
        from moe_fp4.ep.deepep import DeepEPBackend

        return DeepEPBackend(group)
    if backend == "local" or (group is None and (dist is None or not dist.is_initialized())):
        if backend not in (None, "local"):
            raise ValueError(f"backend: {backend!r} needs an initialised torch.distributed process group")
        return LocalBackend()
    if backend == "symm":
        return SymmetricMemoryBackend(group)
    b = TorchDistributedBackend(group)
    if backend is not None and b.name != backend:
        raise ValueError(f"backend: asked for {backend!r} but the process group uses {b.name!r}")
    return b


def agree_on_checks(backend: AllToAllBackend, what: str, error: ValueError | None,
                    signature: dict[str, int]) -> None:
    """Ranks agree on their local checks before a collective that follows them, so that a check
    failing on one rank raises ValueError on every rank instead of leaving the others blocked in
    the transfer. On a group whose tensors live in host memory (gloo) every rank sends every rank
    [failed, *signature] (one small all-to-all; no device to wait for) and raises if any rank
    failed (that rank its own error) or the signatures differ (name -> int: what every rank must
    share, as the transfers' sizes follow from it). On CUDA this would be a host sync per call
    (and no CUDA graph), so there a failed check raises on its rank only, and the peers wait in
    the transfer until the group's timeout."""
    if backend.world_size == 1 or backend.device.type != "cpu":
        if error is not None:
            raise error
        return
    row = [0 if error is None else 1] + [int(v) for v in signature.values()]
    row += [0] * (_AGREE_WIDTH - len(row))
    sent = torch.tensor([row] * backend.world_size, dtype=torch.int64)
    got = torch.empty_like(sent)
    backend.all_to_all(got, sent, None, None)
    peers = got.tolist()
    if error is not None:
        raise error
    bad = [s for s, p in enumerate(peers) if p[0]]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} rejected their inputs (see the error raised there); the {what} "
                         "was abandoned on every rank")
    diff = [f"{key} {a} here vs {b} on rank {s}" for s, p in enumerate(peers)
            for key, a, b in zip(signature, row[1:], p[1:]) if a != b]
    if diff:
        raise ValueError(f"{what}: ranks disagree: " + ", ".join(diff))


class Buffer:
    """Expert-parallel dispatch/combine for one process group.

    num_experts: experts in all, split evenly and contiguously over the ranks;
    group: a torch.distributed process group (None: the default group, or a world of one when
      torch.distributed is not initialised);
    payload: the default dispatch payload ("bf16", "fp8", "mxfp4", "nvfp4" or a PayloadCodec);
    backend: None (follow the group: NCCL on CUDA tensors, gloo on CPU tensors), "nccl"/"gloo"
      (checked against the group), "symm" (an NCCL group whose GPUs share NVLink: the dispatch stores
      payload rows straight into the receivers' symmetric-memory buffers, the combine reads partials
      out of the peers' buffers, see moe_fp4.ep.symmetric), "deepep" (an NCCL group of 2, 4 or 8 GPUs
      of one host: the rows travel through DeepEP's normal-mode dispatch and combine, see
      moe_fp4.ep.deepep; needs the deep_ep package, built with patches/deepep/build.sh; no sync-free
      dispatch, combine over the bf16 wire only), or an AllToAllBackend;
    num_sms: the SM budget of the dispatch and combine kernels (DeepEP's ``Buffer.set_num_sms``), so
      that expert compute on other streams finds free SMs: their grids hold at most the warps of
      num_sms SMs and loop over the work beyond that (the bits do not change; moe_fp4.ep.sms says
      which kernels it bounds); None (the default): no bound, each kernel sized by its work, the
      fastest measured when nothing runs beside the dispatch. ``set_num_sms`` changes it."""

    def __init__(self, num_experts: int, group=None, *, payload="mxfp4", backend=None, num_sms: int | None = None):
        self.num_sms = sms.check_num_sms(num_sms)
        self.backend: AllToAllBackend = make_backend(group, backend)
        self.world_size = self.backend.world_size
        self.rank = self.backend.rank
        self.experts_per_rank = check_experts(num_experts, self.world_size)
        self.num_experts = num_experts
        self.payload = get_payload(payload)
        if _triton_combine.available(torch.empty(0, device=self.device)):
            _triton_combine.check_bf16_store(self.device)

    def set_num_sms(self, num_sms: int | None) -> None:
        """The SM budget of this buffer's later dispatches and combines: a positive int, or None for
        no bound (see the class docstring). Ranks may differ (it changes grids, not bytes)."""
        self.num_sms = sms.check_num_sms(num_sms)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        """Tokens per rank, per expert, is_token_in_rank for topk_idx int64 [T, k] (no host sync)."""
        self._check_device(topk_idx, "topk_idx")
        return dispatch_layout(topk_idx, self.num_experts, self.world_size)

    # -------------------------------------------------------------------------------------------
    # checks
    # -------------------------------------------------------------------------------------------

    def _check_device(self, t: torch.Tensor, name: str) -> None:
        if t.device != self.device:
            raise ValueError(f"{name}: expected a tensor on {self.device} (the {self.backend.name} backend's "
                             f"device), got {t.device}")

    def _check_x(self, x, codec: PayloadCodec, name: str = "x") -> None:
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_INPUTS or x.dim() != 2:
            raise ValueError(f"{name}: expected a float32/bfloat16/float16 tensor [T, H], "
                             f"got {describe(x, device=True)}")
        self._check_device(x, name)
        codec.check_hidden(x.shape[1], name)

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle: expected a DispatchHandle from Buffer.dispatch, got {type(handle).__name__}")
        if handle.world_size != self.world_size or handle.num_experts != self.num_experts:
            raise ValueError(f"handle: made for world size {handle.world_size} and {handle.num_experts} experts, "
                             f"this buffer has world size {self.world_size} and {self.num_experts} experts")
        if handle.send_token.device != self.device:
            raise ValueError(f"handle: its tensors are on {handle.send_token.device}, expected {self.device}")

    def _check_routing(self, x, topk_idx, topk_weights) -> None:
        check_topk_idx(topk_idx)
        if topk_idx.shape[1] > MAX_TOPK:
            raise ValueError(f"topk_idx: at most {MAX_TOPK} experts per token, got k={topk_idx.shape[1]}")
        self._check_device(topk_idx, "topk_idx")
        if topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"topk_idx: expected {x.shape[0]} rows (one per token of x), got {topk_idx.shape[0]}")
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in FLOAT_INPUTS:
                raise ValueError(f"topk_weights: expected a float tensor [T, k], "
                                 f"got {describe(topk_weights, device=True)}")
            if topk_weights.shape != topk_idx.shape:
                raise ValueError(f"topk_weights: expected shape {tuple(topk_idx.shape)} like topk_idx, "
                                 f"got {tuple(topk_weights.shape)}")
            self._check_device(topk_weights, "topk_weights")

    # -------------------------------------------------------------------------------------------
    # dispatch
    # -------------------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, *, handle: DispatchHandle | None = None,
                 payload=None, return_fp8: bool = False, expert_alignment: int | None = None,
                 max_recv_tokens: int | None = None, max_recv_rows: int | None = None) -> DispatchOutput:
        """Send each token to the ranks of its experts.

        x: float32/bfloat16/float16 [T, H] on the backend's device, H a multiple of the payload's
          ``hidden_multiple`` (32; 128 for fp8);
        topk_idx: int64 [T, k] expert ids in [0, num_experts) or -1 (no expert); not needed with a
          handle;
        topk_weights: float [T, k] or None (then combine cannot weight);
        handle: reuse the layout of an earlier dispatch (same tokens and routing): one all-to-all,
          no host sync;
        payload: the wire format for this call (default: the buffer's);
        return_fp8: also convert the received rows to FP8 1x128: True or "rows": one row per (token,
          local expert) in expert order (``DispatchOutput.fp8``); "tokens": one row per received token
          (``DispatchOutput.recv_fp8``); False: no conversion. With the symm backend and the
          mxfp4 payload on CUDA the conversion overlaps the transfer: this rank's own rows are converted
          while the push to the peers is in flight, the peers' rows as soon as they have landed
          (``symmetric.push_rows_fp8``); otherwise the rows are converted after the transfer. The bits
          are the same either way. With the symm backend every rank must pass the same value (the
          paths lay out the transfer buffers differently).
        expert_alignment: a positive int (default 1, or the handle's): each local expert's rows
          start on a multiple of it, with zero rows after each expert up to the next multiple (the
          layout grouped GEMMs with aligned groups take; with a multiple of 32,
          ``ops.mxfp4_rows_to_fp8_cols`` converts the rows in one pass). ``split_offsets`` give the
          starts, ``tokens_per_expert`` / ``split_lens`` the true counts, ``handle.num_rows`` the
          rows in all; combine takes y with those rows and ignores the gap rows. It only shapes
          this rank's output: ranks may differ.
        max_recv_tokens: None (the default: the counts are exchanged first and the host waits once for
          them) or N, a multiple of the world size, for a sync-free dispatch: no host
          synchronisation at all (capturable in a CUDA graph with the FP8 conversion and combine,
          once a first call has allocated the symm backend's buffers). Each rank sends each rank a
          block of N / W rows and receives N rows (``recv_rows``; the rows a source did not use are
          named by no table); the expert rows are sized for the worst case, ``max_recv_rows`` (default
          N * min(k, L) + L * (expert_alignment - 1)): ``handle.num_rows``, with ``split_lens`` /
          ``split_offsets`` on the device, ``tokens_per_expert`` None, and rows past the experts'
          rows unspecified (expand_row -1; combine ignores them). Tokens past a block and rows past
          the capacity are not sent or written, and bad input on a rank is only known after the
          transfer: ``out.handle.check()`` (one host sync) raises ValueError for any of them; call it
          once a step. Every rank must pass the same N, hidden size, k and payload (the transfers'
          sizes follow from them). Not with a handle. The valid rows hold the bits of a synced
          dispatch of the same tokens.
        """
        return self._dispatch(x, topk_idx, topk_weights, handle, payload, return_fp8, expert_alignment,
                              max_recv_tokens, max_recv_rows)

    def _dispatch(self, x, topk_idx, topk_weights, handle, payload, return_fp8, expert_alignment, max_recv_tokens,
                  max_recv_rows, prior_error: ValueError | None = None) -> DispatchOutput:
        """``dispatch``; prior_error: a caller's own failed check (the autograd wrappers'), raised on
        every rank like a failed check of the arguments here."""
        sync_free = max_recv_tokens is not None or max_recv_rows is not None
        codec, alignment = None, 1
        try:  # the arguments' checks: kept, not raised, until the ranks have agreed (see _agree)
            if prior_error is not None:
                raise prior_error
            if return_fp8 not in (False, True, "rows", "tokens"):
                raise ValueError(f"return_fp8: expected False, True, 'rows' or 'tokens', got {return_fp8!r}")
            alignment = _check_alignment(expert_alignment, handle if isinstance(handle, DispatchHandle) else None)
            codec = get_payload(payload) if payload is not None else self.payload
            if sync_free:
                self._check_sync_free(handle, max_recv_tokens, max_recv_rows)
            elif handle is not None:
                self._check_handle(handle)
                self._check_x(x, codec)
                if x.shape[0] != handle.num_tokens:
                    raise ValueError(f"x: the handle was made for {handle.num_tokens} tokens, got {x.shape[0]}")
            error = None
        except ValueError as e:
            error = e
        if sync_free:
            # the transfers' sizes follow from N, k, H and the payload: agree on them (and on the
            # arguments) before the first transfer; bad tokens or routing are reported by check()
            readable = isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(topk_idx, torch.Tensor) \
                and topk_idx.dim() == 2 and 1 <= topk_idx.shape[1] <= MAX_TOPK
            if error is None and not readable:  # this rank cannot size the transfers
                error = self._input_error(x, topk_idx, topk_weights, codec) or ValueError(
                    f"x, topk_idx: expected tensors [T, H] and [T, k], got {describe(x, device=True)} and "
                    f"{describe(topk_idx, device=True)}")
            self._agree("dispatch", error, {} if error is not None else dict(
                max_recv_tokens=max_recv_tokens, num_topk=topk_idx.shape[1], hidden=x.shape[1],
                payload=PAYLOAD_IDS.get(codec.name, -1)))
            handle, local_error = self._exchange_layout_sync_free(x, topk_idx, topk_weights, codec, alignment,
                                                                  max_recv_tokens, max_recv_rows)
            if local_error is not None:  # take part in the payload transfer with nothing to send
                x = torch.zeros(1, handle.hidden, dtype=torch.bfloat16, device=self.device)
                return_fp8 = False
            out = self._send_payload(x, codec, handle, return_fp8)
            if local_error is not None:
                raise local_error
            return out
        if handle is not None:
            self._agree("dispatch", error, {} if error is not None else dict(
                hidden=x.shape[1], payload=PAYLOAD_IDS.get(codec.name, -1)))
        elif self.backend.routes_tokens:  # (DeepEP: the transfer routes the tokens; no count exchange)
            error = error or self._input_error(x, topk_idx, topk_weights, codec)
            if error is not None:
                raise error
            recv, handle = self.backend.dispatch_routed(x, topk_idx, topk_weights, codec, num_experts=self.num_experts,
                                                        alignment=alignment, num_sms=self.num_sms)
            return self._output(recv, None, codec, x.shape[1], handle, return_fp8)
        else:  # the count exchange carries the verdicts
            handle = self._exchange_layout(x, topk_idx, topk_weights, codec, alignment, error)
        return self._send_payload(x, codec, handle, return_fp8)

    def _agree(self, what: str, error: ValueError | None, signature: dict[str, int]) -> None:
        agree_on_checks(self.backend, what, error, signature)

    def _check_sync_free(self, handle, max_recv_tokens, max_recv_rows) -> None:
        if handle is not None:
            raise ValueError("max_recv_tokens: not with a handle (a cached dispatch reuses the handle's sizes)")
        if self.backend.routes_tokens:
            raise ValueError(f"max_recv_tokens: the {self.backend.name} backend has no sync-free dispatch")
        w = self.world_size
        if isinstance(max_recv_tokens, bool) or not isinstance(max_recv_tokens, int) or max_recv_tokens < w \
                or max_recv_tokens % w:
            raise ValueError(f"max_recv_tokens: expected a positive multiple of the world size {w}, got "
                             f"{max_recv_tokens!r}")
        if max_recv_rows is not None and (isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, int)
                                          or max_recv_rows < 0):
            raise ValueError(f"max_recv_rows: expected None or a non-negative int, got {max_recv_rows!r}")

    def _send_payload(self, x: torch.Tensor, codec: PayloadCodec, handle: DispatchHandle, return_fp8) -> DispatchOutput:
        """The payload exchange (the backend's ``dispatch``), then the FP8 conversion the backend did not
        do on the way."""
        recv, fp8 = self.backend.dispatch(x, codec, handle, fp8=return_fp8, num_sms=self.num_sms)
        return self._output(recv, fp8, codec, x.shape[1], handle, return_fp8)

    @staticmethod
    def _output(recv, fp8, codec: PayloadCodec, hidden: int, handle: DispatchHandle, return_fp8) -> DispatchOutput:
        """The DispatchOutput of received rows, with the FP8 conversion the backend did not do on the way."""
        out = DispatchOutput(recv, codec, hidden, handle)
        if fp8 is None:
            _convert(out, return_fp8)
        elif return_fp8 == "tokens":
            out.recv_fp8 = fp8
        else:
            out.fp8 = fill_gap_rows(fp8, codec, handle)
        return out

    def _input_error(self, x, topk_idx, topk_weights, codec: PayloadCodec) -> ValueError | None:
        """The ValueError this rank's dispatch inputs raise, or None (kept, not raised: the peers
        learn of it through the exchange first)."""
        try:
            self._check_x(x, codec)
            self._check_routing(x, topk_idx, topk_weights)
        except ValueError as e:
            return e
        return None

    def _exchange_layout(self, x, topk_idx, topk_weights, codec: PayloadCodec | None, alignment: int = 1,
                         error: ValueError | None = None) -> DispatchHandle:
        """The synced dispatch's count exchange; ``error``: this rank's failed argument check (sent as
        the error flag, then raised)."""
        w, n_exp, ell = self.world_size, self.num_experts, self.experts_per_rank
        local_error = error if error is not None else self._input_error(x, topk_idx, topk_weights, codec)
        # One count row per destination rank (routing.send_layout), of a width that does not depend on
        # k, so that ranks that disagree (on k, say) still exchange cleanly and all raise the same
        # ValueError; a rank that rejected its inputs sends rows with only the error flag set.
        width = routing.info_width(w, ell, MAX_TOPK)
        if local_error is None:
            k = topk_idx.shape[1]
            header = [x.shape[1], k, n_exp, w, PAYLOAD_IDS.get(codec.name, -1), x.shape[0]]
            # (routing tensors are small: a copy of a strided one costs nothing next to the payload)
            weights = None if topk_weights is None else topk_weights.contiguous()
            sent = routing.send_layout(topk_idx.contiguous(), weights, n_exp, w, header, width)
            info = sent.info
        else:
            info = torch.zeros(w, width, dtype=torch.int64, device=self.device)
            info[:, routing.INFO_ERROR] = 1
        recv_info = torch.empty_like(info)
        self.backend.all_to_all(recv_info, info, None, None)
        peers = recv_info.tolist()  # the one host sync: row s is what rank s sent here
        if local_error is not None:
            raise local_error
        bad = [s for s, p in enumerate(peers) if p[routing.INFO_ERROR]]
        if bad:
            raise ValueError(f"dispatch: rank(s) {bad} rejected their inputs (see the error raised there); "
                             "the dispatch was abandoned on every rank")
        head = routing.INFO_HEADER
        for s, p in enumerate(peers):
            diff = {key: (header[i], p[head + i]) for i, key in enumerate(_SIGNATURE) if header[i] != p[head + i]}
            if diff:
                what = ", ".join(f"{key} {a} here vs {b} on rank {s}" for key, (a, b) in diff.items())
                raise ValueError(f"dispatch: ranks disagree: {what}")
        invalid = [(s, p[routing.INFO_INVALID]) for s, p in enumerate(peers)]
        if any(n for _, n in invalid):
            where = ", ".join(f"rank {s}: {n}" for s, n in invalid if n)
            raise ValueError(f"topk_idx: expected expert ids in [-1, {n_exp}), got ids out of range ({where})")
        ranks = routing.INFO_RANKS
        experts = ranks + w
        count_matrix = [p[ranks:ranks + w] for p in peers]
        send_counts = count_matrix[self.rank]
        recv_counts = [row[self.rank] for row in count_matrix]
        tokens_per_expert = [sum(p[experts + e] for p in peers) for e in range(ell)]
        n_send, n_recv, n_rows = sum(send_counts), sum(recv_counts), sum(tokens_per_expert)
        n_out = sum(aligned_counts(tokens_per_expert, alignment))
        recv_meta = torch.empty(n_recv, 2 * k + 1, dtype=torch.int32, device=self.device)
        self.backend.all_to_all(recv_meta, sent.meta[:n_send], recv_counts, send_counts)
        got = routing.expand_layout(recv_meta, k, ell, alignment, n_out, n_out - n_rows, topk_weights is not None)
        return DispatchHandle(
            rank=self.rank, world_size=w, num_experts=n_exp, hidden=x.shape[1], num_topk=k, num_tokens=x.shape[0],
            send_counts=send_counts, recv_counts=recv_counts, send_token=sent.send_token[:n_send],
            recv_topk_idx=got.recv_topk_idx, recv_topk_weights=got.recv_topk_weights, expand_row=got.expand_row,
            expand_slot=got.expand_slot, row_weights=got.row_weights, tokens_per_expert=tokens_per_expert,
            split_lens=got.split_lens, split_offsets=got.split_offsets, num_rows=n_out, slot_table=got.slot_table,
            rank_table=sent.rank_table, recv_src_token=got.recv_src_token,
            peer_num_tokens=[p[head + 5] for p in peers], count_matrix=count_matrix, expert_alignment=alignment,
            gap_rows=got.gap_rows,
        )

    def _exchange_layout_sync_free(self, x, topk_idx, topk_weights, codec: PayloadCodec, alignment: int,
                                   max_recv_tokens: int, max_recv_rows: int | None):
        """The layout of a sync-free dispatch: fixed blocks of max_recv_tokens / W rows per rank pair,
        so that no size depends on the counts; the count rows travel for ``DispatchHandle.check``.
        Returns (handle, local error or None): a rank whose inputs fail the checks still takes part
        in the transfers (its peers are already in them), sending nothing, when the shapes it needs
        (x [T, H], topk_idx [T, k]) are readable, and raises after them; otherwise it raises at once."""
        w, n_exp, ell = self.world_size, self.num_experts, self.experts_per_rank
        block = max_recv_tokens // w
        local_error = self._input_error(x, topk_idx, topk_weights, codec)
        if local_error is not None:
            readable = isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(topk_idx, torch.Tensor) \
                and topk_idx.dim() == 2 and 1 <= topk_idx.shape[1] <= MAX_TOPK
            if not readable:  # (on gloo the ranks have agreed on this already: see _agree)
                raise local_error
        k, hidden = topk_idx.shape[1], x.shape[1]
        tokens = x.shape[0] if local_error is None else 0
        header = [hidden, k, n_exp, w, PAYLOAD_IDS.get(codec.name, -1), tokens]
        width = routing.info_width(w, ell, MAX_TOPK)
        if local_error is None:
            weights = None if topk_weights is None else topk_weights.contiguous()
            sent = routing.send_layout(topk_idx.contiguous(), weights, n_exp, w, header, width, block)
        else:
            info = torch.zeros(w, width, dtype=torch.int64, device=self.device)
            info[:, routing.INFO_ERROR] = 1
            meta = torch.zeros(w * block, 2 * k + 1, dtype=torch.int32, device=self.device)
            meta[:, :k] = -1
            meta[:, 2 * k] = -1
            sent = routing.SendLayout(info, torch.full((1, w), -1, dtype=torch.int64, device=self.device),
                                      torch.zeros(w * block, dtype=torch.int64, device=self.device), meta)
        recv_info = torch.empty_like(sent.info)
        self.backend.all_to_all(recv_info, sent.info, None, None)
        recv_meta = torch.empty_like(sent.meta)
        self.backend.all_to_all(recv_meta, sent.meta, None, None)
        n_recv = w * block
        rows = max_recv_rows if max_recv_rows is not None else n_recv * min(k, ell) + ell * (alignment - 1)
        got = routing.expand_layout(recv_meta, k, ell, alignment, rows, ell * (alignment - 1),
                                    topk_weights is not None)
        handle = DispatchHandle(
            rank=self.rank, world_size=w, num_experts=n_exp, hidden=hidden, num_topk=k,
            num_tokens=x.shape[0] if local_error is None else 1, send_counts=[block] * w,
            recv_counts=[block] * w, send_token=sent.send_token, recv_topk_idx=got.recv_topk_idx,
            recv_topk_weights=got.recv_topk_weights, expand_row=got.expand_row, expand_slot=got.expand_slot,
            row_weights=got.row_weights, tokens_per_expert=None, split_lens=got.split_lens,
            split_offsets=got.split_offsets, num_rows=rows, slot_table=got.slot_table, rank_table=sent.rank_table,
            recv_src_token=got.recv_src_token, peer_num_tokens=[block] * w,
            count_matrix=[[block] * w for _ in range(w)], expert_alignment=alignment, gap_rows=got.gap_rows,
            sync_free=True,
            pending=dict(info=sent.info, recv_info=recv_info, rows_needed=got.rows_needed, header=header,
                         error=None if local_error is None else str(local_error)),
        )
        return handle, local_error

    # -------------------------------------------------------------------------------------------
    # combine
    # -------------------------------------------------------------------------------------------

    def combine(self, y: torch.Tensor, handle: DispatchHandle, *, weighted: bool = True,
                payload="bf16") -> torch.Tensor:
        """Sum the expert outputs of each token back on the token's rank.

        y: float32/bfloat16/float16 [N, H'] in the order of the dispatch output rows (N =
          handle.num_rows), H' a multiple of the payload's ``hidden_multiple``;
        weighted: True multiplies row (t, j) by topk_weights[t, j] (the weights given to dispatch);
          False sums the rows as they are (the caller weighted them);
        payload: the wire format of the partial sums ("bf16" by default).
        Returns bfloat16 [T, H'] (see the module docstring for the exact arithmetic). No host sync (on
        a gloo group the ranks first agree on their checks: bad input on one rank raises ValueError on
        every rank).
        """
        return self._combine(y, handle, weighted, payload)

    def _combine(self, y, handle, weighted, payload, prior_error: ValueError | None = None) -> torch.Tensor:
        """``combine``; prior_error: a caller's own failed check, raised on every rank (see _agree)."""
        try:
            if prior_error is not None:
                raise prior_error
            codec = get_payload(payload)
            self._check_handle(handle)
            self._check_x(y, codec, "y")
            if y.shape[0] != handle.num_rows:
                raise ValueError(f"y: expected {handle.num_rows} rows (the dispatch output's), got {y.shape[0]}")
            if weighted and handle.recv_topk_weights is None:
                raise ValueError("weighted: the dispatch had no topk_weights; pass weighted=False or dispatch weights")
            error = None
        except ValueError as e:
            error = e
        self._agree("combine", error, {} if error is not None else dict(
            hidden=y.shape[1], payload=PAYLOAD_IDS.get(codec.name, -1)))
        weights = handle.recv_topk_weights if weighted else None
        return self.backend.combine(y, handle, codec, weights=weights, num_sms=self.num_sms)


__all__ = ["Buffer", "DispatchHandle", "DispatchOutput", "make_backend"]
