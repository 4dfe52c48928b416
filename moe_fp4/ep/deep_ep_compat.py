"""A DeepEP-compatible surface: ``deep_ep.Buffer``'s normal-mode (intranode) methods on moe_fp4.

Code written for DeepEP v1.2.1's normal mode runs by changing one import::

    # from deep_ep import Buffer, EventOverlap, Config
    from moe_fp4.ep.deep_ep_compat import Buffer, EventOverlap, Config

    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)          # the sizes are accepted, not used
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \\
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert)
    ...                                                            # experts: one output row per recv_x row
    combined_x, combined_topk_weights, event = buffer.combine(expert_out, handle, recv_topk_weights)

What the values mean (as in DeepEP):
  * recv_x: one row per received token, ordered by source rank, then by the token's index in its
    source's batch; a token is received once however many of its experts are local. A tensor x
    comes back as a tensor of x's dtype, an (e4m3 [T, H], scales [T, S]) tuple as a tuple.
  * recv_topk_idx: int [n, k], the LOCAL ids (expert - rank * L) of the experts on this rank,
    -1 for the others; recv_topk_weights: float [n, k], the weight of each local slot, 0 elsewhere.
  * num_recv_tokens_per_expert_list: Python ints [L], the (token, slot) pairs each local expert
    received, each rounded up to a multiple of ``expert_alignment`` (recv_x itself is not padded);
    ``[]`` when ``num_worst_tokens`` is given.
  * dispatch(x, handle=handle): the cached dispatch, same tokens and routing, returns
    (recv_x, None, None, None, None, event).
  * combine(x, handle, topk_weights=None, bias=None): x has one row per received token (the rows
    of recv_x, same order); each token's rows from the ranks it went to are added WITHOUT weights,
    in float32 in ascending rank order, starting from bias_0 + bias_1 (zeros without bias), and the
    sum is cast to x's dtype; the top-k weights given are summed the same way (starting from 0), so
    recv_topk_weights come back as the original weights of the slots whose ids were valid.
    A token that went nowhere gets its bias (or zeros).

Wire formats (``payload=``, an extra keyword of dispatch and combine; default "bf16"):
  * "bf16": DeepEP's own wire: x's bits as they are (a bfloat16 tensor, as DeepEP takes; another
    float tensor travels as its own bits too), an (e4m3, scales) tuple as its E4M3 bytes and its
    scales' bytes. Exact: recv_x holds the sender's bits.
  * "mxfp4" (also "fp8", "nvfp4"): each token encoded to moe_fp4's payload rows (a tuple x is first
    dequantized, e4m3 * scale per 1x128 block, in float32; it then needs float32 scales [T, H/128]).
    recv_x comes back in x's form: a tensor x gives the decoded values in x's dtype; a tuple x gives
    the FP8 1x128 tuple made from the received rows (``PayloadCodec.to_fp8_blockwise``: for mxfp4
    the direct MXFP4 -> FP8 conversion, power-of-two scales). ``recv_format="bf16"`` or ``"fp8"``
    asks for one form whatever x was (with payload "bf16" too: "fp8" quantizes the received values
    with ``ops.quantize_fp8_blockwise``, "bf16" dequantizes a received tuple).
    The mxfp4 error: the decoded value of each element is the spec's MXFP4 round trip of the
    sender's value (``formats.quantize_mxfp4`` / ``dequantize_mxfp4``, scales rounded up), so
    |recv - x| <= the block's scale < amax / 3 for the 32-element block's largest magnitude amax.
  * combine's ``payload``: "bf16" sends x's bits (DeepEP's wire); the others encode each row and
    decode it on arrival (the sum is then that of the decoded rows).

Arguments accepted for compatibility but not used (moe_fp4 has no preallocated NVLink/RDMA buffers
and runs on the caller's current stream): num_nvl_bytes, num_rdma_bytes, num_qps_per_rank,
allow_nvlink_for_low_latency_mode, allow_mnnvl, num_tokens_per_rdma_rank, config, async_finish and
allocate_on_comm_stream (the work is ordered on the current stream already; on CUDA with
async_finish the returned event is recorded there, elsewhere it holds None and
``current_stream_wait`` does nothing). ``previous_event``: the current stream waits for it first.

Deviations from DeepEP:
  * normal mode only, one process group (any torch.distributed backend moe_fp4 supports: NCCL,
    gloo on CPU, or ``backend="symm"``); low_latency_mode=True, comm= (mpi4py) and the internode /
    low-latency methods are not provided; group=None means the default group (a world of one
    without torch.distributed).
  * the non-cached dispatch needs topk_idx (DeepEP can route by is_token_in_rank alone); its
    layout arguments are checked for shape and dtype, but the routing and counts are taken from
    topk_idx (they must be get_dispatch_layout's of the same topk_idx); topk_weights may be None
    (recv_topk_weights is then None).
  * the host waits for the counts as DeepEP does; ``num_worst_tokens`` gives DeepEP's output
    shapes (recv_x padded with zero rows, recv_topk_idx with -1, recv_topk_weights with 0, an empty
    list) but not its sync-free property, and raises ValueError on a rank that receives more
    tokens than that.
  * bad arguments raise ValueError naming the argument (DeepEP asserts); on a gloo group on every
    rank (see ``moe_fp4.ep.Buffer``), elsewhere on the failing rank.
  * the handle is an opaque object (DeepEP's is a tuple of tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4 import formats, ops
from moe_fp4.ep.buffer import Buffer as _MoEBuffer
from moe_fp4.ep.buffer import DispatchHandle as _MoEHandle
from moe_fp4.ep.buffer import agree_on_checks, make_backend
from moe_fp4.ep.layout import check_experts, check_topk_idx, dispatch_layout
from moe_fp4.ep.payloads import PAYLOAD_IDS, get_payload
from moe_fp4.formats._checks import FLOAT_INPUTS, describe

_PAYLOADS = ("bf16", "fp8", "mxfp4", "nvfp4")
_RECV_FORMATS = (None, "bf16", "fp8")
_WIRE_ALIGN = 64  # bytes: the bf16 payload's rows are a multiple of 32 bf16 values


@dataclass
class Config:
    """DeepEP's performance-tuning config: accepted and ignored (moe_fp4 sizes its transfers per
    call). The fields are DeepEP's."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: moe_fp4 needs no preallocated NVLink buffer."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: moe_fp4 needs no preallocated RDMA buffer."""
        return 0


class EventOverlap:
    """DeepEP's event wrapper. ``event``: a torch.cuda.Event recorded on the current stream after
    the call (CUDA with ``async_finish``), else None; ``current_stream_wait()`` makes the current
    stream wait for it (nothing to wait for when None: the work was issued on the current stream).
    Usable as a context manager, as DeepEP's: the wait happens on exit."""

    def __init__(self, event=None, extra_tensors: tuple[torch.Tensor, ...] | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.current_stream_wait()


class Handle:
    """What a cached dispatch and a combine need (opaque to callers, as DeepEP's handle).

    inner: moe_fp4's DispatchHandle (send/receive counts, the token-by-rank table);
    num_recv_tokens: tokens received; num_rows: rows of recv_x (num_worst_tokens when given, else
    num_recv_tokens); num_experts: experts in all."""

    def __init__(self, inner: _MoEHandle, num_rows: int, num_experts: int):
        self.inner = inner
        self.num_recv_tokens = inner.num_recv_tokens
        self.num_rows = num_rows
        self.num_experts = num_experts

    def __repr__(self) -> str:
        return (f"Handle(rank={self.inner.rank}, world_size={self.inner.world_size}, num_tokens="
                f"{self.inner.num_tokens}, num_recv_tokens={self.num_recv_tokens}, num_rows={self.num_rows})")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Buffer:
    """DeepEP's ``Buffer`` (normal mode) on moe_fp4's dispatch and combine.

    group: a torch.distributed process group (None: the default group, or a world of one);
    num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl:
      accepted, not used; low_latency_mode: must be False; explicitly_destroy: as DeepEP's (then
      ``destroy()`` must be called, and may only be called then); comm: must be None;
    backend (extra keyword): moe_fp4's backend (None follows the group; "symm" for symmetric memory).
    Attributes as DeepEP's: rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
    explicitly_destroy; the class attribute num_sms (set_num_sms, default 20 as DeepEP's) is the SM
    budget of the dispatch kernels (``moe_fp4.ep.Buffer.set_num_sms``, read at each call)."""

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None, *, backend=None):
        if low_latency_mode:
            raise ValueError("low_latency_mode: moe_fp4's DeepEP-compatible Buffer provides the normal mode only")
        if comm is not None:
            raise ValueError("comm: an mpi4py communicator is not supported; pass a torch.distributed group")
        self.backend = make_backend(group, backend)
        self.group = group
        self.rank = self.backend.rank
        self.group_size = self.backend.world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = False
        self.explicitly_destroy = explicitly_destroy
        self._buffers: dict[int, _MoEBuffer] = {}
        self._destroyed = False

    # -------------------------------------------------------------------------------------------
    # DeepEP's static helpers and buffer management
    # -------------------------------------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM budget of every Buffer's later dispatches (``moe_fp4.ep.Buffer.set_num_sms``: the
        kernels' grids hold at most the warps of that many SMs); must be even, as DeepEP's."""
        if not _is_int(new_num_sms) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms: expected a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (an empty one without CUDA)."""
        if torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
            return EventOverlap(event)
        return EventOverlap(None)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise ValueError("explicitly_destroy: destroy() needs a Buffer made with explicitly_destroy=True")
        self._buffers.clear()
        self._destroyed = True

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def _inner(self, num_experts: int) -> _MoEBuffer:
        if self._destroyed:
            raise ValueError("self: the buffer was destroyed")
        if num_experts not in self._buffers:
            self._buffers[num_experts] = _MoEBuffer(num_experts, self.group, payload="bf16", backend=self.backend)
        inner = self._buffers[num_experts]
        inner.set_num_sms(Buffer.num_sms)  # (the class attribute may have changed since)
        return inner

    def _event(self, async_finish: bool) -> EventOverlap:
        if async_finish and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            return EventOverlap(event)
        return EventOverlap(None)

    @staticmethod
    def _wait(previous_event) -> None:
        if previous_event is None:
            return
        if not isinstance(previous_event, EventOverlap):
            raise ValueError(f"previous_event: expected None or an EventOverlap, got {type(previous_event).__name__}")
        previous_event.current_stream_wait()

    # -------------------------------------------------------------------------------------------
    # layout
    # -------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """topk_idx: int64 (or int32) [T, k], expert ids in [0, num_experts) or -1; num_experts: a
        multiple of the group size. No collective, no host sync.

        Returns (num_tokens_per_rank int32 [W], None (the RDMA counts: intranode), num_tokens_per_expert
        int32 [E] ((token, slot) pairs per expert), is_token_in_rank bool [T, W], event). Ids outside
        [-1, num_experts) are counted nowhere (dispatch rejects them)."""
        self._wait(previous_event)
        check_topk_idx(topk_idx)
        if not _is_int(num_experts):
            raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
        check_experts(num_experts, self.group_size)
        if topk_idx.device != self.device:
            raise ValueError(f"topk_idx: expected a tensor on {self.device}, got {topk_idx.device}")
        layout = dispatch_layout(topk_idx, num_experts, self.group_size)
        return (layout.num_tokens_per_rank.to(torch.int32), None, layout.num_tokens_per_expert.to(torch.int32),
                layout.is_token_in_rank, self._event(async_finish))

    # -------------------------------------------------------------------------------------------
    # dispatch
    # -------------------------------------------------------------------------------------------

    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, payload: str = "bf16", recv_format: str | None = None):
        """Send each token to the ranks of its experts (see the module docstring).

        x: a float tensor [T, H] (bfloat16 as DeepEP takes; contiguous), or a tuple (float8_e4m3fn
          [T, H] contiguous, scales float32 (or int32 with payload "bf16") [T, S], S = H / 128 for
          the conversions);
        handle: a Handle from an earlier dispatch of the same tokens and routing (cached dispatch;
          then topk_idx and topk_weights must be None and the layout arguments are not read);
        num_tokens_per_rank int32 [W], is_token_in_rank bool [T, W], num_tokens_per_expert int32 [E]:
          get_dispatch_layout's outputs for topk_idx (required without a handle, as in DeepEP; E
          gives the number of experts);
        topk_idx: int64 [T, k] expert ids or -1 (required without a handle); topk_weights: float32
          [T, k] or None;
        expert_alignment: a positive int, the multiple num_recv_tokens_per_expert_list is rounded to;
        num_worst_tokens: 0, or the row count of the outputs (see the module docstring);
        payload: "bf16" (default: x's own bits), "mxfp4", "fp8" or "nvfp4";
        recv_format: None (recv_x in x's form), "bf16" or "fp8" (an (e4m3, scales) tuple).

        Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); a cached dispatch returns (recv_x, None, None, None, None, event)."""
        self._wait(previous_event)
        x = _detached(x)  # (as DeepEP's, the outputs carry no autograd history)
        topk_weights = _detached(topk_weights)
        cached = handle is not None
        error = None
        try:
            num_experts = self._check_dispatch(x, handle, num_tokens_per_rank, is_token_in_rank,
                                               num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                               num_worst_tokens, payload, recv_format)
            wire, codec, want_fp8 = self._wire(x, payload, recv_format)
        except ValueError as e:
            error, wire, codec, want_fp8 = e, None, None, False
            # the count exchange's size follows from the number of experts: the peers' one where readable
            num_experts = _readable_num_experts(handle, num_tokens_per_expert, self.group_size)
        # moe_fp4's dispatch raises ``error`` on this rank and makes every rank of a gloo group raise
        # with it (the count exchange, or the cached dispatch's agreement, carries the verdict)
        out = self._inner(num_experts)._dispatch(
            x=wire, topk_idx=None if cached else topk_idx, topk_weights=None if cached else topk_weights,
            handle=(handle.inner if isinstance(handle, Handle) else handle) if cached else None,
            payload=codec, return_fp8="tokens" if want_fp8 else False, expert_alignment=None,
            max_recv_tokens=None, max_recv_rows=None, prior_error=error)
        inner = out.handle
        num_rows = handle.num_rows if cached else (num_worst_tokens or inner.num_recv_tokens)
        if inner.num_recv_tokens > num_rows:
            raise ValueError(f"num_worst_tokens: this rank received {inner.num_recv_tokens} tokens, more than "
                             f"num_worst_tokens={num_worst_tokens}")
        recv_x = self._unwire(out, x, payload, recv_format, want_fp8, num_rows)
        event = self._event(async_finish)
        if cached:
            return recv_x, None, None, None, None, event
        new_handle = Handle(inner, num_rows, num_experts)
        recv_idx = _pad_rows(inner.recv_topk_idx.to(topk_idx.dtype), num_rows, -1)
        recv_w = None
        if topk_weights is not None:
            local = torch.where(inner.recv_topk_idx >= 0, inner.recv_topk_weights, 0.0)
            recv_w = _pad_rows(local.to(topk_weights.dtype), num_rows, 0)
        counts = [] if num_worst_tokens else [-(-c // expert_alignment) * expert_alignment
                                              for c in inner.tokens_per_expert]
        return recv_x, recv_idx, recv_w, counts, new_handle, event

    def _check_dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                        topk_weights, expert_alignment, num_worst_tokens, payload, recv_format) -> int:
        """The checks of dispatch's own arguments (moe_fp4's dispatch checks the rest); returns the
        number of experts."""
        if payload not in _PAYLOADS:
            raise ValueError(f"payload: expected one of {list(_PAYLOADS)}, got {payload!r}")
        if recv_format not in _RECV_FORMATS:
            raise ValueError(f"recv_format: expected None, 'bf16' or 'fp8', got {recv_format!r}")
        if not _is_int(expert_alignment) or expert_alignment < 1:
            raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment!r}")
        if not _is_int(num_worst_tokens) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens: expected a non-negative int, got {num_worst_tokens!r}")
        num_tokens = _check_x(x)
        if handle is not None:
            if not isinstance(handle, Handle):
                raise ValueError(f"handle: expected a Handle from this module's dispatch, got {type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx: a cached dispatch (handle given) takes neither topk_idx nor topk_weights")
            if num_tokens != handle.inner.num_tokens:
                raise ValueError(f"x: the handle was made for {handle.inner.num_tokens} tokens, got {num_tokens}")
            return handle.num_experts
        if topk_idx is None:
            raise ValueError("topk_idx: required without a handle (the routing is taken from it)")
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is None:
                raise ValueError(f"{name}: required without a handle (get_dispatch_layout's output)")
        w = self.group_size
        if not isinstance(num_tokens_per_rank, torch.Tensor) or num_tokens_per_rank.dtype != torch.int32 \
                or tuple(num_tokens_per_rank.shape) != (w,):
            raise ValueError(f"num_tokens_per_rank: expected int32 [{w}], got {describe(num_tokens_per_rank)}")
        if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool \
                or tuple(is_token_in_rank.shape) != (num_tokens, w):
            raise ValueError(f"is_token_in_rank: expected bool [{num_tokens}, {w}], got {describe(is_token_in_rank)}")
        if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dtype != torch.int32 \
                or num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.shape[0] == 0 \
                or num_tokens_per_expert.shape[0] % w:
            raise ValueError(f"num_tokens_per_expert: expected int32 [E] with E a positive multiple of {w}, got "
                             f"{describe(num_tokens_per_expert)}")
        return int(num_tokens_per_expert.shape[0])

    def _wire(self, x, payload: str, recv_format):
        """What moe_fp4's dispatch sends: (a float tensor [T, H'], its codec, whether the receiver
        converts to FP8 1x128). payload "bf16": x's bytes (and the scales' bytes) padded to a multiple of
        64 bytes, viewed as bfloat16, so that the bf16 codec moves them unchanged."""
        if payload == "bf16":
            return _native_rows(x), get_payload("bf16"), False
        codec = get_payload(payload)
        if isinstance(x, tuple):
            data, scales = x
            h = data.shape[1]
            if h % formats.FP8_GROUP or scales.dtype != torch.float32 or tuple(scales.shape) != (
                    data.shape[0], h // formats.FP8_GROUP):
                raise ValueError(f"x: with payload {payload!r} the scales must be float32 [T, H/128] = "
                                 f"[{data.shape[0]}, {h // formats.FP8_GROUP}], got {describe(scales)} "
                                 f"for H = {h}")
            values = formats.dequantize_fp8_blockwise(data, scales, block=(1, formats.FP8_GROUP))
        else:
            values = x
        want_fp8 = recv_format == "fp8" or (recv_format is None and isinstance(x, tuple))
        return values, codec, want_fp8

    def _unwire(self, out, x, payload: str, recv_format, want_fp8: bool, num_rows: int):
        """recv_x from moe_fp4's DispatchOutput, in the form asked for, padded to num_rows rows."""
        if payload == "bf16":
            value = _unpack_native(out.recv_rows, x)
            if recv_format == "bf16" and isinstance(value, tuple):
                value = formats.dequantize_fp8_blockwise(*value, block=(1, formats.FP8_GROUP), dtype=torch.bfloat16)
            elif recv_format == "bf16":
                value = value.to(torch.bfloat16)
            elif recv_format == "fp8" and not isinstance(value, tuple):
                value = _quantize_fp8(value)
        elif want_fp8:
            value = out.recv_fp8
        else:
            dtype = x.dtype if recv_format is None else torch.bfloat16
            value = out.payload.decode(out.recv_rows, out.hidden, dtype=dtype)
        if isinstance(value, tuple):
            return tuple(_pad_rows(v, num_rows, 0) for v in value)
        return _pad_rows(value, num_rows, 0)

    # -------------------------------------------------------------------------------------------
    # combine
    # -------------------------------------------------------------------------------------------

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, payload: str = "bf16"):
        """Add each token's rows back on the token's rank (see the module docstring).

        x: float (bfloat16 as DeepEP takes) [handle.num_rows, H], contiguous, one row per row of the
          dispatch's recv_x; handle: the dispatch's Handle;
        topk_weights: float32 [handle.num_rows, k] or None (summed back the same way);
        bias: None, a tensor or a pair of tensors [T, H] of x's dtype, added to each output row;
        payload: "bf16" (x's bits), "fp8", "mxfp4" or "nvfp4".
        Returns (combined_x x.dtype [T, H], combined_topk_weights float32 [T, k] or None, event)."""
        self._wait(previous_event)
        x, topk_weights, bias = _detached(x), _detached(topk_weights), _detached(bias)
        try:
            if not isinstance(handle, Handle):
                raise ValueError(f"handle: expected a Handle from this module's dispatch, got {type(handle).__name__}")
            inner = handle.inner
            if payload not in _PAYLOADS:
                raise ValueError(f"payload: expected one of {list(_PAYLOADS)}, got {payload!r}")
            if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_INPUTS or x.dim() != 2:
                raise ValueError(f"x: expected a float tensor [{handle.num_rows}, H], got {describe(x)}")
            if x.shape[0] != handle.num_rows or not x.is_contiguous():
                raise ValueError(f"x: expected a contiguous tensor of {handle.num_rows} rows (one per received "
                                 f"token), got {tuple(x.shape)}{'' if x.is_contiguous() else ' non-contiguous'}")
            if x.device != self.device:
                raise ValueError(f"x: expected a tensor on {self.device}, got {x.device}")
            hidden = x.shape[1]
            codec = get_payload(payload)
            if payload != "bf16":
                codec.check_hidden(hidden, "x")
            if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                             or topk_weights.dtype != torch.float32 or topk_weights.dim() != 2
                                             or topk_weights.shape[0] != handle.num_rows
                                             or topk_weights.device != self.device):
                raise ValueError(f"topk_weights: expected float32 [{handle.num_rows}, k] on {self.device}, got "
                                 f"{describe(topk_weights)}")
            biases = _check_bias(bias, (inner.num_tokens, hidden), x.dtype, self.device)
            k = 0 if topk_weights is None else topk_weights.shape[1]
            error, signature = None, [hidden, PAYLOAD_IDS[payload], k, x.element_size()]
        except ValueError as e:
            error, signature = e, []
        self._agree("combine", error, signature)

        n = inner.num_recv_tokens
        if payload == "bf16":
            x_bytes = x[:n].view(torch.uint8)
        else:
            x_bytes = codec.encode(x[:n])
        width = x_bytes.shape[1]
        wire = x_bytes if k == 0 else torch.cat((x_bytes, topk_weights[:n].contiguous().view(torch.uint8)), dim=1)
        back = torch.empty(sum(inner.send_counts), wire.shape[1], dtype=torch.uint8, device=self.device)
        self.backend.all_to_all(back, wire.contiguous(), inner.send_counts, inner.recv_counts)
        if payload == "bf16":
            values = back[:, :width].contiguous().view(x.dtype).to(torch.float32)
        else:
            values = codec.decode(back[:, :width].contiguous(), hidden)
        out = torch.zeros(inner.num_tokens, hidden, dtype=torch.float32, device=self.device)
        for b in biases:
            out = out + b.to(torch.float32)
        out = _sum_by_rank(out, values, inner)
        combined_w = None
        if k:
            w_back = back[:, width:].contiguous().view(torch.float32)
            combined_w = _sum_by_rank(torch.zeros(inner.num_tokens, k, dtype=torch.float32, device=self.device),
                                      w_back, inner)
        return out.to(x.dtype), combined_w, self._event(async_finish)

    def _agree(self, what: str, error: ValueError | None, signature: list[int]) -> None:
        """Every rank of a gloo group learns whether any rank's checks failed and whether the ranks'
        shapes agree before the transfer (``moe_fp4.ep.buffer.agree_on_checks``)."""
        names = ("hidden", "payload", "topk_weights columns", "x element size")
        agree_on_checks(self.backend, what, error, dict(zip(names, signature)))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _detached(v):
    """A tensor (or a tuple of tensors) without autograd history; anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in v)
    return v


def _check_x(x) -> int:
    """dispatch's x: a float tensor [T, H] or an (e4m3 [T, H], scales [T, S]) tuple; returns T."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x: expected a tensor or an (e4m3, scales) pair, got a tuple of {len(x)}")
        data, scales = x
        if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn or data.dim() != 2 \
                or not data.is_contiguous():
            raise ValueError(f"x: expected a contiguous float8_e4m3fn tensor [T, H] first, got {describe(data)}")
        if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.float32, torch.int32) \
                or scales.dim() != 2 or scales.shape[0] != data.shape[0] or scales.device != data.device:
            raise ValueError(f"x: expected float32 (or int32) scales [{data.shape[0]}, S] on {data.device} second, "
                             f"got {describe(scales)}")
        return data.shape[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_INPUTS or x.dim() != 2:
        raise ValueError(f"x: expected a bfloat16 (or float32/float16) tensor [T, H] or an (e4m3, scales) pair, "
                         f"got {describe(x)}")
    if not x.is_contiguous():
        raise ValueError("x: expected a contiguous tensor")
    return x.shape[0]


def _readable_num_experts(handle, num_tokens_per_expert, world_size: int) -> int:
    """The number of experts the arguments name, when readable (else the world size)."""
    if isinstance(handle, Handle):
        return handle.num_experts
    t = num_tokens_per_expert
    if isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] and t.shape[0] % world_size == 0:
        return int(t.shape[0])
    return world_size


def _native_rows(x) -> torch.Tensor:
    """bfloat16 [T, W]: each token's bytes (x's, then the scales' for a tuple), zero-padded to a
    multiple of 64 bytes (a view of x, no copy, for a bfloat16 x whose hidden size is a multiple of 32)."""
    data, scales = x if isinstance(x, tuple) else (x, None)
    t = data.shape[0]
    data_bytes = data.view(torch.uint8) if data.shape[1] else data.new_empty(t, 0, dtype=torch.uint8)
    width = data_bytes.shape[1] + (0 if scales is None else scales.shape[1] * scales.element_size())
    padded = max(_WIRE_ALIGN, -(-width // _WIRE_ALIGN) * _WIRE_ALIGN)
    if scales is None and padded == width:
        return data_bytes.view(torch.bfloat16)
    rows = torch.zeros(t, padded, dtype=torch.uint8, device=data.device)
    rows[:, :data_bytes.shape[1]] = data_bytes
    if scales is not None:
        start = data_bytes.shape[1]
        rows[:, start:width] = scales.contiguous().view(torch.uint8)
    return rows.view(torch.bfloat16)


def _unpack_native(recv_rows: torch.Tensor, x):
    """The inverse of _native_rows on the received rows (uint8 [n, W bytes]): a tensor of x's dtype
    [n, H] or an (e4m3 [n, H], scales [n, S]) tuple."""
    data, scales = x if isinstance(x, tuple) else (x, None)
    n = recv_rows.shape[0]
    data_width = data.shape[1] * data.element_size()
    recv_data = recv_rows[:, :data_width]
    if data_width == recv_rows.shape[1]:
        recv_data = recv_data.view(data.dtype)
    else:
        recv_data = recv_data.contiguous().view(data.dtype)
    if scales is None:
        return recv_data.reshape(n, data.shape[1])
    scale_width = scales.shape[1] * scales.element_size()
    recv_scales = recv_rows[:, data_width:data_width + scale_width].contiguous().view(scales.dtype)
    return recv_data.reshape(n, data.shape[1]), recv_scales.reshape(n, scales.shape[1])


def _quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if values.shape[1] % formats.FP8_GROUP:
        raise ValueError(f"recv_format: 'fp8' needs a hidden size that is a multiple of {formats.FP8_GROUP}, got "
                         f"{values.shape[1]}")
    if values.shape[0] == 0:
        return (torch.empty(0, values.shape[1], dtype=torch.float8_e4m3fn, device=values.device),
                torch.empty(0, values.shape[1] // formats.FP8_GROUP, dtype=torch.float32, device=values.device))
    return ops.quantize_fp8_blockwise(values)


def _pad_rows(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """t [n, ...] with rows - n rows of ``fill`` appended (t itself when n == rows)."""
    if t.shape[0] == rows:
        return t
    out = torch.empty(rows, *t.shape[1:], dtype=t.dtype, device=t.device)
    if t.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8).fill_(0)
    else:
        out.fill_(fill)
    out[:t.shape[0]] = t
    return out


def _check_bias(bias, shape: tuple[int, int], dtype: torch.dtype, device) -> list[torch.Tensor]:
    if bias is None:
        return []
    biases = list(bias) if isinstance(bias, tuple) else [bias]
    if len(biases) > 2:
        raise ValueError(f"bias: expected None, a tensor or a pair of tensors, got a tuple of {len(biases)}")
    for b in biases:
        if not isinstance(b, torch.Tensor) or b.dtype != dtype or tuple(b.shape) != shape or b.device != device:
            raise ValueError(f"bias: expected {dtype} {shape} on {device} (x's dtype, one row per token), got "
                             f"{describe(b)}")
    return biases


def _sum_by_rank(acc: torch.Tensor, values: torch.Tensor, inner: _MoEHandle) -> torch.Tensor:
    """acc float32 [T, m] plus, for each rank in ascending order that token t was sent to, the row of
    values (float32 [rows sent, m], in send order) that came back from it; tokens not sent to a rank
    keep their bits (no +0.0 is added)."""
    for r in range(inner.world_size):
        if inner.send_counts[r] == 0:
            continue
        rows = inner.rank_table[:, r]
        sent = (rows >= 0).unsqueeze(1)
        acc = torch.where(sent, acc + values[rows.clamp(min=0)], acc)
    return acc


__all__ = ["Buffer", "Config", "EventOverlap", "Handle"]
