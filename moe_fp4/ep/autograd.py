"""Autograd for dispatch and combine: each one's backward is the other applied to the gradients.

dispatch_with_grad: the backward of a dispatch is an unweighted combine of the row gradients
  (each token's gradient is the sum over its rows); combine_with_grad: the backward of a combine is
  a cached dispatch of the output gradient, multiplied by each row's top-k weight, plus the
  gradient of the weights (the dot product of the output gradient and each expert output row, sent
  back to the token's rank); row_weights_with_grad: each dispatched row's top-k weight for expert
  layers that apply the weights themselves, its backward the same path back to the tokens' ranks
  (the combine is then unweighted and keeps nothing for backward). Gradients travel as
  ``backward_payload``: "bf16" (default) or "fp8"; MXFP4 only when asked for explicitly.
"""

from __future__ import annotations

import torch

from moe_fp4.ep.buffer import Buffer, DispatchHandle, DispatchOutput
from moe_fp4.ep.payloads import get_payload


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, topk_idx, topk_weights, handle, payload, backward_payload, dtype, sink, alignment,
                bounds, error, decode):
        out = buffer._dispatch(x.detach() if isinstance(x, torch.Tensor) else x, topk_idx, topk_weights, handle,
                               payload, False, alignment, bounds.get("max_recv_tokens"), bounds.get("max_recv_rows"),
                               error)
        sink.append(out)
        ctx.buffer, ctx.handle, ctx.backward_payload, ctx.x_dtype = buffer, out.handle, backward_payload, x.dtype
        if decode:
            return out.values(dtype)
        # a stand-in of the rows' shape and dtype that holds no memory (one zero, expanded)
        return torch.zeros((), dtype=dtype, device=out.recv_rows.device).expand(out.handle.num_rows, out.hidden)

    @staticmethod
    def backward(ctx, grad):
        gx = ctx.buffer.combine(grad.contiguous(), ctx.handle, weighted=False, payload=ctx.backward_payload)
        return gx.to(ctx.x_dtype), None, None, None, None, None, None, None, None, None, None, None, None


def dispatch_with_grad(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                       topk_weights: torch.Tensor | None = None, *, handle: DispatchHandle | None = None,
                       payload=None, backward_payload="bf16", dtype: torch.dtype = torch.bfloat16,
                       expert_alignment: int | None = None, max_recv_tokens: int | None = None,
                       max_recv_rows: int | None = None, decode: bool = True) -> tuple[torch.Tensor, DispatchOutput]:
    """Differentiable dispatch.

    x: float [T, H] (requires grad); topk_idx int64 [T, k]; topk_weights float [T, k] or None (carried
    to the experts' ranks for combine; dispatch itself does not differentiate them).
    Returns (values ``dtype`` [N, H]: the received rows decoded, grouped by local expert, each
    expert's rows starting on a multiple of ``expert_alignment`` (see ``Buffer.dispatch``); the
    DispatchOutput with the rows, splits and handle). The gradient of values flows back to x
    through a combine with ``backward_payload`` (gap rows' gradients are ignored). max_recv_tokens /
    max_recv_rows: a sync-free dispatch (see ``Buffer.dispatch``; values then has the capacity's
    rows, those past the experts' rows unspecified, and their gradients are ignored). A failed check
    here raises on every rank of a gloo group, as the dispatch's own checks do.
    decode: False returns, instead of the decoded values, a zero-stride stand-in of their shape and
      dtype that holds no memory: the carrier of the rows' gradient for expert layers that read the
      DispatchOutput's rows or FP8 rows themselves (``moe_fp4.moe.Experts`` given ``x_fp8``)."""
    error = _check_payload(backward_payload, "backward_payload")
    sink: list[DispatchOutput] = []
    bounds = {} if max_recv_tokens is None and max_recv_rows is None else dict(
        max_recv_tokens=max_recv_tokens, max_recv_rows=max_recv_rows)
    values = _Dispatch.apply(x, buffer, topk_idx, topk_weights, handle, payload, backward_payload, dtype, sink,
                             expert_alignment, bounds, error, decode)
    return values, sink[0]


def _token_weight_grads(buffer: Buffer, handle: DispatchHandle, row_grads: torch.Tensor) -> torch.Tensor:
    """float32 [T, k], the gradient of the dispatched top-k weights from row_grads float32 [N], the
    gradient of each output row's weight (each row carries one (token, slot)'s weight): scattered
    per received (token, slot), sent back to the token's rank, added per token there."""
    k = handle.num_topk
    n_slots = handle.num_recv_tokens * k
    per_slot = torch.zeros(n_slots + 1, dtype=torch.float32, device=row_grads.device)  # + 1: gap rows' sink
    slot = handle.expand_row * k + handle.expand_slot
    if handle.gap_rows is not None or handle.sync_free:  # rows of no slot: to the sink
        slot = torch.where(handle.expand_row >= 0, slot, n_slots)
    per_slot.scatter_(0, slot, row_grads)
    per_slot = per_slot[:n_slots].reshape(-1, k)
    back = torch.empty(sum(handle.send_counts), k, dtype=torch.float32, device=row_grads.device)
    buffer.backend.all_to_all(back.view(torch.uint8), per_slot.view(torch.uint8),
                              handle.send_counts, handle.recv_counts)
    gw = torch.zeros(handle.num_tokens, k, dtype=torch.float32, device=row_grads.device)
    gw.index_add_(0, handle.send_token, back)  # each (t, j) is nonzero on one rank only
    return gw


class _RowWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, topk_weights, buffer, handle):
        ctx.buffer, ctx.handle, ctx.w_dtype = buffer, handle, topk_weights.dtype
        # rows of no slot (gaps, a sync-free dispatch's unused rows) weigh 0 whatever they hold
        return torch.where(handle.expand_row >= 0, handle.row_weights, 0.0)

    @staticmethod
    def backward(ctx, grad):
        return _token_weight_grads(ctx.buffer, ctx.handle, grad.float()).to(ctx.w_dtype), None, None


def row_weights_with_grad(buffer: Buffer, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
    """float32 [N], the top-k weight of each output row of a dispatch (0 on rows of no slot), as a
    differentiable function of the dispatched ``topk_weights`` [T, k]: an expert layer that applies
    the weights itself (then ``combine_with_grad(..., weighted=False)``, which keeps no expert
    output for backward) gets their gradient back to the tokens' ranks through it."""
    if not isinstance(handle, DispatchHandle) or handle.row_weights is None:
        raise ValueError("handle: expected the DispatchHandle of a dispatch given topk_weights")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (handle.num_tokens,
                                                                                  handle.num_topk):
        shape = tuple(topk_weights.shape) if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
        raise ValueError(f"topk_weights: expected shape {(handle.num_tokens, handle.num_topk)} (the dispatched "
                         f"weights), got {shape}")
    return _RowWeights.apply(topk_weights, buffer, handle)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, buffer, handle, weighted, payload, backward_payload, error):
        out = buffer._combine(y.detach() if isinstance(y, torch.Tensor) else y, handle, weighted, payload, error)
        # the expert outputs are kept only for the weights' gradient
        keep = weighted and isinstance(topk_weights, torch.Tensor) and topk_weights.requires_grad
        ctx.save_for_backward(y if keep else None)
        ctx.buffer, ctx.handle, ctx.weighted, ctx.backward_payload = buffer, handle, weighted, backward_payload
        ctx.w_dtype = topk_weights.dtype if topk_weights is not None else None
        ctx.y_dtype = y.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        buffer, handle = ctx.buffer, ctx.handle
        codec = get_payload(ctx.backward_payload)
        got = buffer.dispatch(grad.contiguous(), handle=handle, payload=codec)
        g = codec.decode(got.rows, grad.shape[1])  # float32 [N, H]
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            gy = g * handle.row_weights.unsqueeze(1) if ctx.weighted else g
            grad_y = gy.to(ctx.y_dtype)
        if ctx.weighted and ctx.needs_input_grad[1]:
            dots = (g * y.detach().to(torch.float32)).sum(dim=1)  # d out_t / d w_tj = <grad_t, y_tj>
            grad_w = _token_weight_grads(buffer, handle, dots).to(ctx.w_dtype)
        return grad_y, grad_w, None, None, None, None, None, None


def combine_with_grad(buffer: Buffer, y: torch.Tensor, handle: DispatchHandle,
                      topk_weights: torch.Tensor | None = None, *, weighted: bool = True, payload="bf16",
                      backward_payload="bf16") -> torch.Tensor:
    """Differentiable combine: bfloat16 [T, H].

    y: float [N, H] expert outputs in the dispatch output order (requires grad);
    topk_weights: float [T, k], the same tensor given to dispatch (its values were sent with the
      tokens; passing it here lets the weights receive their gradient); None: no weight gradient.
    The forward is ``Buffer.combine`` (weights applied when ``weighted``). A failed check here raises
    on every rank of a gloo group, as the combine's own checks do."""
    error = _check_payload(backward_payload, "backward_payload")
    if error is None and topk_weights is not None and isinstance(handle, DispatchHandle):
        expect = (handle.num_tokens, handle.num_topk)
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != expect:
            shape = tuple(topk_weights.shape) if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
            error = ValueError(f"topk_weights: expected shape {expect} (the dispatched weights), got {shape}")
    return _Combine.apply(y, topk_weights, buffer, handle, weighted, payload, backward_payload, error)


def _check_payload(payload, name: str) -> ValueError | None:
    """The ValueError get_payload raises for ``payload`` (naming ``name``), or None."""
    try:
        get_payload(payload)
    except ValueError as e:
        return ValueError(str(e).replace("payload:", f"{name}:", 1))
    return None


__all__ = ["dispatch_with_grad", "combine_with_grad", "row_weights_with_grad"]
