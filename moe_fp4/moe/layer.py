"""An MoE layer: router, dispatch, local experts, combine and an optional shared expert, expert
parallel over a process group (or on one device without one), differentiable end to end.

Policies (what travels, what computes, what backward keeps):
  "bf16"           BF16 dispatch, BF16 grouped GEMMs (torch._grouped_mm), autograd saves BF16
  "fp8"            FP8 1x128 dispatch, FP8 experts, FP8 saved
  "fp8-recompute"  FP8 1x128 dispatch, FP8 experts recomputed in backward (only their input saved)
  "mxfp4"          MXFP4 dispatch, FP8 experts, MXFP4 saved (the dispatched rows themselves; the
                   weight gradient's input operand from FP4RowToFP8Col)
Every policy applies the top-k weights inside the experts, to the SwiGLU output before the down
projection (``moe_fp4.ep.row_weights_with_grad`` gives each dispatched row its weight, with the
gradient path back to the router): the combine is then an unweighted sum that keeps nothing for
backward (a weighted combine would keep every expert output row, H wide in BF16, for the weights'
gradient), and the weights' gradient is each row's dot product of the down projection's input
gradient and the unweighted SwiGLU output. The router keeps its input as given (not a float32 copy)
for its weight gradient. Gradients return through a BF16 combine and dispatch
(``moe_fp4.ep.autograd``); the combine of the expert outputs travels as BF16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_fp4 import formats
from moe_fp4.ep import Buffer, combine_with_grad, dispatch_with_grad, row_weights_with_grad
from moe_fp4.ep.backends import LocalBackend
from moe_fp4.formats._checks import describe
from moe_fp4.moe.experts import ALIGN, Experts

# policy -> (dispatch payload, Experts save policy or None for BF16 GEMMs)
POLICIES = {"bf16": ("bf16", None), "fp8": ("fp8", "fp8"), "fp8-recompute": ("fp8", "recompute"),
            "mxfp4": ("mxfp4", "mxfp4")}


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class Router(torch.nn.Module):
    """Top-k routing: scores = softmax or sigmoid of x @ weight^T (float32), experts chosen by score
    (plus ``bias`` when given: DeepSeek-V3's balancing bias, which picks but does not weight),
    optionally within the ``topk_groups`` best of ``num_groups`` expert groups (a group's score: the
    sum of its two best experts' scores); weights = the chosen experts' scores, renormalised to sum
    to one when ``renormalize``, times ``route_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 renormalize: bool = True, num_groups: int | None = None, topk_groups: int | None = None,
                 route_scale: float = 1.0, bias: bool = False, device=None):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score: expected 'softmax' or 'sigmoid', got {score!r}")
        if not isinstance(top_k, int) or not 0 < top_k <= num_experts:
            raise ValueError(f"top_k: expected an int in [1, {num_experts}], got {top_k!r}")
        if (num_groups is None) != (topk_groups is None):
            raise ValueError("num_groups, topk_groups: give both (group-limited routing) or neither")
        if num_groups is not None:
            if num_experts % num_groups or not 0 < topk_groups <= num_groups:
                raise ValueError(f"num_groups, topk_groups: expected num_experts ({num_experts}) divisible by "
                                 f"num_groups and 0 < topk_groups <= num_groups, got {num_groups}, {topk_groups}")
            if top_k > topk_groups * (num_experts // num_groups):
                raise ValueError(f"top_k: {top_k} exceeds the experts of {topk_groups} groups")
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.renormalize, self.num_groups, self.topk_groups = renormalize, num_groups, topk_groups
        self.route_scale = route_scale
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device))
        torch.nn.init.normal_(self.weight, std=1.0 / math.sqrt(hidden))
        self.register_buffer("bias", torch.zeros(num_experts, device=device) if bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_idx int64 [T, k], topk_weights float32 [T, k])."""
        logits = _RouterLogits.apply(x, self.weight)
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choose = scores.detach() if self.bias is None else scores.detach() + self.bias
        if self.num_groups is not None:
            t = choose.shape[0]
            per_group = choose.view(t, self.num_groups, -1)
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
            choose = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)
        idx = choose.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return idx, weights * self.route_scale


class _RouterLogits(torch.autograd.Function):
    """x @ weight^T in float32, keeping x as given for backward (F.linear on x.float() would keep a
    float32 copy of the layer input, twice the size of a BF16 one, per layer)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):  # float32 scores under a caller's autocast too
            return x.float() @ weight.float().t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.float()
        with torch.autocast(x.device.type, enabled=False):
            dx = (grad @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
            dw = (grad.t() @ x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class BF16Experts(torch.nn.Module):
    """The experts of ``Experts`` (same parameters and layout) on BF16 grouped GEMMs
    (``torch._grouped_mm``) with torch's autograd: the "bf16" policy."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w1 = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialisation of ``Experts.reset_parameters`` (the same draws from the same generator state)."""
        with torch.no_grad():
            self.w1.normal_(0.0, 1.0 / math.sqrt(self.hidden))
            self.w2.normal_(0.0, 1.0 / math.sqrt(self.intermediate))

    def forward(self, x, split_offsets, split_lens, row_weights=None, **_):
        # torch's groups run back to back (group e ends at ends[e]): the gap rows before an expert's
        # rows are computed with its weights; they belong to no token and get no gradient
        ends = (split_offsets + split_lens).to(torch.int32)
        y1 = torch._grouped_mm(x.to(torch.bfloat16), self.w1.to(torch.bfloat16).transpose(-2, -1), offs=ends)
        gate, up = y1.float().chunk(2, dim=-1)
        h = F.silu(gate) * up
        if row_weights is not None:
            h = h * row_weights.unsqueeze(1)
        return torch._grouped_mm(h.to(torch.bfloat16), self.w2.to(torch.bfloat16).transpose(-2, -1), offs=ends)


class SharedExpert(torch.nn.Module):
    """A dense SwiGLU MLP applied to every token (DeepSeek-V3's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        gate, up = self.gate_up(x.to(self.gate_up.weight.dtype)).float().chunk(2, dim=-1)
        return self.down((F.silu(gate) * up).to(self.down.weight.dtype))


class MoELayer(torch.nn.Module):
    """y = combine(experts(dispatch(x))) (+ shared expert): an expert-parallel MoE layer.

    hidden (H), intermediate (I): multiples of 128; num_experts over all ranks, split evenly;
    top_k experts per token; group: the expert-parallel process group (None: the default group if
      torch.distributed is initialised, else one device);
    policy: "bf16", "fp8", "fp8-recompute" or "mxfp4" (module docstring);
    router options (``Router``): score, renormalize, num_groups / topk_groups, route_scale, score_bias;
    shared_intermediate: the shared expert's intermediate size (None: no shared expert);
    dtype: the master weights' dtype (bfloat16 or float32); backend: ``Buffer``'s backend.
    forward(x [..., H]) -> bfloat16 [..., H]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, group=None,
                 policy: str = "mxfp4", score: str = "softmax", renormalize: bool = True,
                 num_groups: int | None = None, topk_groups: int | None = None, route_scale: float = 1.0,
                 score_bias: bool = False, shared_intermediate: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, device=None, backend=None):
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {tuple(POLICIES)}, got {policy!r}")
        payload, save = POLICIES[policy]
        self.policy, self.hidden = policy, hidden
        if backend is None and group is None and device is not None and not _distributed():
            backend = LocalBackend(device)  # one device without a process group
        self.buffer = Buffer(num_experts, group, payload=payload, backend=backend)
        local = self.buffer.experts_per_rank
        self.router = Router(hidden, num_experts, top_k, score=score, renormalize=renormalize,
                             num_groups=num_groups, topk_groups=topk_groups, route_scale=route_scale,
                             bias=score_bias, device=device)
        if save is None:
            self.experts = BF16Experts(local, hidden, intermediate, dtype=dtype, device=device)
        else:
            self.experts = Experts(local, hidden, intermediate, save=save, dtype=dtype, device=device)
        self.shared = None if shared_intermediate is None else SharedExpert(hidden, shared_intermediate,
                                                                             dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ValueError(f"x: expected a tensor [..., {self.hidden}], got {describe(x)}")
        shape = x.shape
        flat = x.reshape(-1, self.hidden)
        idx, weights = self.router(flat)
        fp8_experts = isinstance(self.experts, Experts)
        # the FP8 experts read the dispatch's FP8 (and MXFP4) rows: the decoded values are only the
        # carrier of their gradient, so they are not made
        values, out = dispatch_with_grad(self.buffer, flat, idx, weights, expert_alignment=ALIGN,
                                         decode=not fp8_experts)
        extra = {}
        if fp8_experts:
            extra["x_fp8"] = out.to_fp8_blockwise()
            if self.policy == "mxfp4":
                extra["x_mxfp4"] = formats.unpack_mxfp4_rows(out.rows, self.hidden)
            extra["validate"] = False  # (the dispatch's own splits: aligned and inside the rows)
            extra["host_splits"] = out.host_splits  # (None when sync-free: the backward reads them)
        row_weights = row_weights_with_grad(self.buffer, out.handle, weights)
        y = self.experts(values, out.split_offsets, out.split_lens, row_weights=row_weights, **extra)
        z = combine_with_grad(self.buffer, y, out.handle, weighted=False)
        if self.shared is not None:
            z = z + self.shared(flat).to(z.dtype)
        return z.reshape(shape)


__all__ = ["POLICIES", "BF16Experts", "MoELayer", "Router", "SharedExpert"]
