"""Megatron-core's MoE token exchange through moe_fp4's ``Buffer``.

Megatron-core's ``MoELayer`` (megatron.core.transformer.moe.moe_layer) routes, then drives its
``token_dispatcher`` through six hooks, in this order, each one's outputs the next one's inputs:

  dispatch_preprocess(tokens [S, B, H], routing_map bool [T, E], probs float [T, E]) -> (x, p)
  token_dispatch(x, p)                      -> (rows, row_probs)       the exchange to the experts
  dispatch_postprocess(rows, row_probs)     -> (rows [N, H], tokens_per_expert int64 [L] (CPU),
                                                permuted_probs [N])    what the experts consume
  experts(rows, tokens_per_expert, permuted_probs) -> expert_output [N, H]
  combine_preprocess(expert_output)         -> y
  token_combine(y)                          -> z                       the exchange back
  combine_postprocess(z)                    -> output [S, B, H]

(T = S * B tokens of this rank, E experts, L = E / EP local experts, N rows received.) The experts
(``SequentialMLP``, ``TEGroupedMLP``) split ``rows`` by ``tokens_per_expert.tolist()`` and multiply
each row's activation by its ``permuted_probs`` entry themselves, so the combine is an unweighted sum
of each token's expert outputs. ``MoeFp4TokenDispatcher`` implements those hooks on a ``Buffer``:

* dispatch_preprocess: the routing map becomes top-k ids (each token's experts in ascending order,
  ``config.moe_router_topk`` of them, -1 padding) and the probs their weights; no communication;
* token_dispatch: ``dispatch_with_grad`` sends each token once per destination rank as ``payload``
  rows (bf16, fp8, mxfp4, nvfp4) and returns one decoded row per (token, local expert), grouped by
  local expert, then by source rank, then by source token: the order Megatron's alltoall dispatcher
  produces. The row probabilities travel with the tokens (float32) and are differentiable: their
  gradient goes back to the token's rank (``_PermutedProbs``), so the router trains;
* token_combine: ``combine_with_grad`` (unweighted) sums each token's expert outputs back on its
  rank: float32 partial sums per rank sent as BF16 (``combine_payload``), summed in float32, rounded
  to BF16, then cast to the layer's dtype.
Gradients run back through both exchanges as ``backward_payload`` (BF16 by default, or "fp8").

``apply(model, payload="mxfp4")`` installs one such dispatcher on every ``MoELayer`` of a built model
(or one layer, or a list of model chunks); ``revert(model)`` puts Megatron's back. Experts stay
Megatron's own. Supported: megatron-core 0.16 to 0.19 (the hooks above; written against 0.19.2 and
run on CPU with 0.16.1), dropless routing with expert parallelism over any process group (NCCL, the
``symm`` backend over NVLink, gloo on CPU). Refused with ``ValueError`` (naming the option): expert
tensor parallelism, token dropping or padding to capacity, router padding for quantization,
shared-expert overlap, expert-parallel communication overlap, CUDA graphs.

This module imports without Megatron installed; ``apply`` raises ``ImportError`` naming
megatron-core when it is missing.
"""

from __future__ import annotations

import torch

from moe_fp4.ep.autograd import combine_with_grad, dispatch_with_grad
from moe_fp4.ep.buffer import Buffer, DispatchHandle
from moe_fp4.ep.payloads import get_payload

SUPPORTED_VERSIONS = ((0, 16), (0, 19))  # first and last supported (major, minor), inclusive
_ORIGINAL = "_moe_fp4_original_token_dispatcher"  # the MoELayer attribute that keeps Megatron's dispatcher


def megatron_version() -> str:
    """The installed megatron-core version, or raise ImportError naming megatron-core."""
    try:
        from megatron.core import package_info
    except ImportError as e:
        raise ImportError("moe_fp4.integrations.megatron_core needs megatron-core (pip install megatron-core); "
                          f"importing megatron.core failed: {e}") from e
    return package_info.__version__


def check_version(version: str) -> None:
    """Raise ImportError unless ``version`` (e.g. "0.19.2") is a megatron-core release whose MoELayer
    calls the six dispatcher hooks this module implements."""
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = None
    lo, hi = SUPPORTED_VERSIONS
    if major_minor is None or len(major_minor) != 2 or not lo <= major_minor <= hi:
        raise ImportError(f"megatron-core {version} is not supported by moe_fp4.integrations.megatron_core: it "
                          f"implements the MoE token dispatcher hooks of megatron-core {lo[0]}.{lo[1]} to "
                          f"{hi[0]}.{hi[1]} (written against 0.19.2)")


def _megatron():
    """megatron.core's MoE modules, after the version check."""
    check_version(megatron_version())
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_layer, token_dispatcher
    return token_dispatcher, moe_layer, ProcessGroupCollection


def _config_problems(config) -> list[str]:
    """What of a TransformerConfig the dispatcher does not do, one phrase per option."""
    problems = []
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append("moe_expert_capacity_factor (token dropping) must be None")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        problems.append("moe_pad_expert_input_to_capacity must be False")
    if getattr(config, "moe_router_padding_for_quantization", False):
        problems.append("moe_router_padding_for_quantization must be False")
    if getattr(config, "moe_shared_expert_overlap", False):
        problems.append("moe_shared_expert_overlap must be False (shared experts run beside the layer instead)")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm must be False")
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        problems.append("CUDA graphs must be off (cuda_graph_impl='none'): the dispatch waits on the host once "
                        "for the token counts")
    return problems


class _PermutedProbs(torch.autograd.Function):
    """Each dispatched row's top-k weight, differentiable: forward returns the handle's row_weights
    (float32 [N], sent with the tokens); backward sends each row's gradient to its (token, slot) on
    the token's rank (float32 all-to-all), giving the gradient of topk_weights [T, k]."""

    @staticmethod
    def forward(ctx, topk_weights, buffer, handle):
        ctx.buffer, ctx.handle, ctx.dtype = buffer, handle, topk_weights.dtype
        return handle.row_weights.to(topk_weights.dtype, copy=True)

    @staticmethod
    def backward(ctx, grad):
        buffer, handle = ctx.buffer, ctx.handle
        k = handle.num_topk
        n_slots = handle.num_recv_tokens * k
        per_slot = torch.zeros(n_slots + 1, dtype=torch.float32, device=grad.device)  # + 1: rows of no slot
        slot = handle.expand_row * k + handle.expand_slot
        if handle.gap_rows is not None or handle.sync_free:
            slot = torch.where(handle.expand_row >= 0, slot, n_slots)
        per_slot.scatter_(0, slot, grad.to(torch.float32))
        per_slot = per_slot[:n_slots].reshape(-1, k)
        back = torch.empty(sum(handle.send_counts), k, dtype=torch.float32, device=grad.device)
        buffer.backend.all_to_all(back.view(torch.uint8), per_slot.view(torch.uint8), handle.send_counts,
                                  handle.recv_counts)
        gw = torch.zeros(handle.num_tokens, k, dtype=torch.float32, device=grad.device)
        gw.index_add_(0, handle.send_token, back)  # each (token, slot) is sent to one rank
        return gw.to(ctx.dtype), None, None


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing (routing_map bool [T, E], probs float [T, E]) as top-k lists: (topk_idx int64
    [T, topk], each token's experts in ascending order, -1 past its last; topk_weights [T, topk] in
    probs' dtype, differentiable, 0 at -1). A token with more than ``topk`` experts in the map keeps its
    ``topk`` lowest ids (Megatron's routers mark exactly topk, or none for a padding token)."""
    num_experts = routing_map.shape[1]
    ids = torch.arange(num_experts, device=routing_map.device)
    keys = torch.where(routing_map, ids, num_experts)
    first = keys.sort(dim=1).values[:, :topk]
    topk_idx = torch.where(first < num_experts, first, -1).to(torch.int64)
    topk_weights = probs.gather(1, topk_idx.clamp(min=0)) * (topk_idx >= 0)
    return topk_idx, topk_weights


def _make_dispatcher_class(base):
    from megatron.core import utils as megatron_utils

    class MoeFp4TokenDispatcher(base):
        """A Megatron ``MoETokenDispatcher`` on moe_fp4's ``Buffer`` (see the module doc).

        num_local_experts / local_expert_indices / config / pg_collection: as Megatron's dispatchers
          take them (pg_collection needs ep, expt_tp and tp_ep);
        buffer: the ``Buffer`` over pg_collection.ep with config.num_moe_experts experts (None: a new one
          with ``payload`` and ``backend``);
        payload: the dispatch payload ("bf16", "fp8", "mxfp4", "nvfp4");
        backend: the Buffer's backend (None: follow the group; "nccl", "symm", "gloo");
        backward_payload: the gradients' payload through both exchanges ("bf16" or "fp8");
        combine_payload: the combine's payload ("bf16" or "fp8")."""

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *,
                     buffer: Buffer | None = None, payload="mxfp4", backend=None, backward_payload="bf16",
                     combine_payload="bf16"):
            super().__init__(config=config, pg_collection=pg_collection)
            problems = _config_problems(config)
            if self.tp_size > 1:
                problems.append(f"expert tensor parallelism must be off (expert_tensor_parallel_size is "
                                f"{self.tp_size})")
            if problems:
                raise ValueError("MoeFp4TokenDispatcher: " + "; ".join(problems))
            self.ep_rank = megatron_utils.get_pg_rank(self.ep_group)  # 0.16 to 0.18 do not set it
            self.num_experts = config.num_moe_experts
            self.num_local_experts = num_local_experts
            self.local_expert_indices = list(local_expert_indices)
            expected = list(range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts))
            if self.num_experts != num_local_experts * self.ep_size or self.local_expert_indices != expected:
                raise ValueError(f"local_expert_indices: expected {expected} (experts split evenly and "
                                 f"contiguously over {self.ep_size} EP ranks), got {self.local_expert_indices}")
            self.topk = config.moe_router_topk
            self.payload = get_payload(payload)
            hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
            self.payload.check_hidden(hidden, "config.hidden_size")
            get_payload(backward_payload)
            get_payload(combine_payload)
            self.backward_payload, self.combine_payload = backward_payload, combine_payload
            if buffer is None:
                buffer = Buffer(self.num_experts, self.ep_group, payload=self.payload, backend=backend)
            elif buffer.num_experts != self.num_experts or buffer.world_size != self.ep_size:
                raise ValueError(f"buffer: made for {buffer.num_experts} experts on {buffer.world_size} ranks, "
                                 f"expected {self.num_experts} on {self.ep_size}")
            self.buffer = buffer
            self.hidden_shape = None
            self.routing_map = None  # read by Megatron's inference path; kept as the alltoall dispatcher does
            self._out_dtype = None
            self._topk_idx = None
            self._handle: DispatchHandle | None = None

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            """hidden_states [S, B, H] or [T, H]; routing_map bool [T, E]; probs float [T, E].
            Returns (tokens [T, H], topk_weights [T, k] in probs' dtype); no communication."""
            if routing_map.dim() != 2 or routing_map.dtype != torch.bool or routing_map.shape[1] != self.num_experts:
                raise ValueError(f"routing_map: expected a bool tensor [T, {self.num_experts}], got "
                                 f"{routing_map.dtype} {tuple(routing_map.shape)}")
            if probs.shape != routing_map.shape:
                raise ValueError(f"probs: expected shape {tuple(routing_map.shape)} like routing_map, "
                                 f"got {tuple(probs.shape)}")
            self.hidden_shape = hidden_states.shape
            self._out_dtype = hidden_states.dtype
            self.routing_map = routing_map
            tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
            self._topk_idx, topk_weights = routing_to_topk(routing_map, probs, self.topk)
            return tokens, topk_weights

        def token_dispatch(self, hidden_states, probs):
            """hidden_states [T, H]; probs [T, k]. Returns (rows [N, H] in hidden_states' dtype, grouped
            by local expert; their probabilities [N] in probs' dtype)."""
            rows, out = dispatch_with_grad(self.buffer, hidden_states, self._topk_idx, probs.detach(),
                                           payload=self.payload, backward_payload=self.backward_payload,
                                           dtype=hidden_states.dtype)
            self._handle = out.handle
            return rows, _PermutedProbs.apply(probs, self.buffer, out.handle)

        def dispatch_postprocess(self, hidden_states, probs):
            """Returns (rows [N, H], tokens_per_expert int64 [L] on the CPU, permuted_probs [N])."""
            tokens_per_expert = torch.tensor(self._handle.tokens_per_expert, dtype=torch.int64)
            return hidden_states, tokens_per_expert, probs

        def combine_preprocess(self, hidden_states):
            """Expert outputs [N, H], already weighted by the experts: nothing to do here."""
            return hidden_states

        def token_combine(self, hidden_states):
            """Expert outputs [N, H] -> each token's sum of its experts' rows, BF16 [T, H]."""
            return combine_with_grad(self.buffer, hidden_states, self._handle, weighted=False,
                                     payload=self.combine_payload, backward_payload=self.backward_payload)

        def combine_postprocess(self, hidden_states):
            """BF16 [T, H] -> the layer's output in its input's dtype and shape."""
            return hidden_states.to(self._out_dtype).view(self.hidden_shape)

    return MoeFp4TokenDispatcher


_CLASS = []


def dispatcher_class():
    """``MoeFp4TokenDispatcher``, a subclass of megatron-core's ``MoETokenDispatcher`` (made on first use:
    the base class comes from the installed megatron-core)."""
    if not _CLASS:
        token_dispatcher, _, _ = _megatron()
        _CLASS.append(_make_dispatcher_class(token_dispatcher.MoETokenDispatcher))
    return _CLASS[0]


def __getattr__(name: str):
    if name == "MoeFp4TokenDispatcher":
        return dispatcher_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find_moe_layers(model_or_layer) -> list:
    """Every megatron-core ``MoELayer`` in a module, or in a list/tuple of modules (model chunks)."""
    _, moe_layer, _ = _megatron()
    roots = model_or_layer if isinstance(model_or_layer, (list, tuple)) else [model_or_layer]
    found = []
    for root in roots:
        if not isinstance(root, torch.nn.Module):
            raise ValueError(f"model_or_layer: expected a torch.nn.Module or a list of them, got {type(root).__name__}")
        found += [m for m in root.modules() if isinstance(m, moe_layer.MoELayer)]
    return found


def apply(model_or_layer, payload="mxfp4", backend=None, *, backward_payload="bf16", combine_payload="bf16") -> list:
    """Install a ``MoeFp4TokenDispatcher`` on every MoELayer of a built model; returns those layers.

    model_or_layer: a megatron-core model (e.g. GPTModel), one MoELayer, or a list of model chunks;
    payload: the dispatch payload ("bf16", "fp8", "mxfp4", "nvfp4"); backend: None (follow the EP
    group: NCCL on GPUs, gloo on CPU), "nccl", "symm" (NVLink symmetric memory) or "gloo";
    backward_payload: the gradients' payload ("bf16" or "fp8"); combine_payload: "bf16" or "fp8".
    Call it on every rank, after the model is built (and after parallel_state is initialised). Layers
    with the same EP group share one Buffer. Applying again replaces moe_fp4's dispatchers (keeping
    Megatron's originals for ``revert``). Raises ImportError without a supported megatron-core,
    ValueError for a model without MoE layers or an option the dispatcher does not do."""
    cls = dispatcher_class()
    _, _, ProcessGroupCollection = _megatron()
    layers = find_moe_layers(model_or_layer)
    if not layers:
        raise ValueError("model_or_layer: no megatron-core MoELayer found")
    buffers: dict = {}
    for layer in layers:
        original = getattr(layer, _ORIGINAL, None) or layer.token_dispatcher
        groups = ProcessGroupCollection(ep=original.ep_group, expt_tp=original.tp_group, tp_ep=original.tp_ep_group)
        key = (id(original.ep_group), layer.config.num_moe_experts)
        dispatcher = cls(layer.num_local_experts, layer.local_expert_indices, layer.config, groups,
                         buffer=buffers.get(key), payload=payload, backend=backend,
                         backward_payload=backward_payload, combine_payload=combine_payload)
        buffers[key] = dispatcher.buffer
        setattr(layer, _ORIGINAL, original)
        layer.token_dispatcher = dispatcher
        if hasattr(layer, "_training_token_dispatcher"):  # MoELayer.forward re-selects it outside inference
            layer._training_token_dispatcher = dispatcher
    return layers


def revert(model_or_layer) -> list:
    """Put Megatron's own dispatchers back on the MoE layers that ``apply`` changed; returns them."""
    restored = []
    for layer in find_moe_layers(model_or_layer):
        original = getattr(layer, _ORIGINAL, None)
        if original is None:
            continue
        layer.token_dispatcher = original
        if hasattr(layer, "_training_token_dispatcher"):
            layer._training_token_dispatcher = original
        delattr(layer, _ORIGINAL)
        restored.append(layer)
    return restored


__all__ = ["SUPPORTED_VERSIONS", "apply", "check_version", "dispatcher_class", "find_moe_layers", "megatron_version",
           "revert", "routing_to_topk"]
