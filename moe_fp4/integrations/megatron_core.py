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
  gradient goes back to the token's rank (``moe_fp4.ep.row_weights_with_grad``), so the router trains;
* token_combine: ``combine_with_grad`` (unweighted) sums each token's expert outputs back on its
  rank: float32 partial sums per rank sent as BF16 (``combine_payload``), summed in float32, rounded
  to BF16, then cast to the layer's dtype.
Gradients run back through both exchanges as ``backward_payload`` (BF16 by default, or "fp8").

``apply(model, payload="mxfp4")`` installs one such dispatcher on every ``MoELayer`` of a built model
(or one layer, or a list of model chunks); ``revert(model)`` puts Megatron's back. The experts stay
Megatron's own unless ``experts="moe_fp4"``:

* ``apply(model, payload="mxfp4", experts="moe_fp4", save="mxfp4")`` also replaces each layer's
  experts (``SequentialMLP``, ``GroupedMLP`` or ``TEGroupedMLP``, gated SwiGLU without biases) by
  ``MoeFp4Experts``, a ``moe_fp4.moe.Experts`` (FP8 grouped GEMMs; ``save`` says what backward keeps)
  holding a copy of their weights: w1 [L, 2I, H] = each expert's fc1 ([2I, H], gate rows then up
  rows, Megatron's ``chunk(2)`` order), w2 [L, H, I] = its fc2. The dispatcher then lays each local
  expert's rows out from a multiple of 128 (``expert_alignment=128``; zero rows between experts) and
  the experts read the dispatch's own FP8 rows (``DispatchOutput.to_fp8_blockwise``) and, with the
  mxfp4 payload, its MXFP4 rows as what save="mxfp4" keeps: nothing is quantized again. The
  ``permuted_probs`` Megatron hands the experts become ``row_weights`` (float32), applied to the
  SwiGLU output as Megatron's experts apply them (0.16 to 0.19: inside the experts, never in the
  combine, which stays unweighted): each row is weighted once, with the probs' gradient.
  ``revert`` copies the trained weights back into Megatron's experts and puts them back.
  ``MoeFp4Experts`` also runs behind Megatron's own dispatchers (installed by hand:
  ``layer.experts = experts_class()(layer.experts, layer.config)``): it then copies Megatron's
  permuted rows into a 128-aligned layout, quantizes them to FP8 itself, and copies its output rows
  back. Megatron's distributed checkpoints of the experts need Megatron's modules: ``revert`` before
  ``sharded_state_dict`` (``MoeFp4Experts`` refuses it). Build the optimizer and DDP after ``apply``:
  the experts' parameters are new tensors.

Supported: megatron-core 0.16 to 0.19 (the hooks above; written against 0.19.2 and
run on CPU with 0.16.1), dropless routing with expert parallelism over any process group (NCCL, the
``symm`` backend over NVLink, gloo on CPU). Refused with ``ValueError`` (naming the option): expert
tensor parallelism, token dropping or padding to capacity, router padding for quantization,
shared-expert overlap, expert-parallel communication overlap, CUDA graphs; with experts="moe_fp4" also
experts other than gated SwiGLU (``gated_linear_unit`` with ``activation_func`` silu, no
``glu_linear_offset``, clamp or GLU interleaving), expert biases, probs applied on the input, hidden or
expert intermediate sizes that are not multiples of 128, FP16 weights.

This module imports without Megatron installed; ``apply`` raises ``ImportError`` naming
megatron-core when it is missing.
"""

from __future__ import annotations

import torch

from moe_fp4 import formats
from moe_fp4.ep.autograd import combine_with_grad, dispatch_with_grad, row_weights_with_grad
from moe_fp4.ep.buffer import Buffer, DispatchHandle
from moe_fp4.ep.payloads import get_payload
from moe_fp4.formats._checks import describe
from moe_fp4.moe.experts import ALIGN as EXPERTS_ALIGN
from moe_fp4.moe.experts import SAVE_POLICIES, Experts

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


def _required_options(config, rules) -> list[str]:
    """One phrase per rule (option, required, why) that config breaks: a required None asks for None,
    False or 0 for a false value; an absent option keeps the required one. why, if any, follows in
    parentheses."""
    problems = []
    for name, required, why in rules:
        value = getattr(config, name, required)
        if value is not None if required is None else bool(value):
            problems.append(f"{name} must be {required}" + (f" ({why})" if why else ""))
    return problems


def _config_problems(config) -> list[str]:
    """What of a TransformerConfig the dispatcher does not do, one phrase per option."""
    problems = _required_options(config, (
        ("moe_expert_capacity_factor", None, "token dropping"),
        ("moe_pad_expert_input_to_capacity", False, ""),
        ("moe_router_padding_for_quantization", False, ""),
        ("moe_shared_expert_overlap", False, "shared experts run beside the layer instead"),
        ("overlap_moe_expert_parallel_comm", False, ""),
    ))
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none") or getattr(config, "enable_cuda_graph", False):
        problems.append("CUDA graphs must be off (cuda_graph_impl='none'): the dispatch waits on the host once "
                        "for the token counts")
    return problems


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
        combine_payload: the combine's payload ("bf16" or "fp8");
        expert_alignment: each local expert's rows start on a multiple of it, zero rows between
          (``MoeFp4Experts``: 128); tokens_per_expert stays the true counts, so Megatron's experts,
          which split the rows by them, need 1;
        decode: False hands the experts a zero-stride stand-in of the rows (the carrier of their
          gradient) for experts that read ``dispatch_output``'s rows themselves (``MoeFp4Experts``).
        dispatch_output: the ``DispatchOutput`` of the current dispatch, from token_dispatch to
          token_combine."""

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *,
                     buffer: Buffer | None = None, payload="mxfp4", backend=None, backward_payload="bf16",
                     combine_payload="bf16", expert_alignment: int = 1, decode: bool = True):
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
            if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
                raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment!r}")
            self.expert_alignment, self.decode = expert_alignment, bool(decode)
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
            self.dispatch_output = None
            self.dispatched_rows = None  # the rows token_dispatch returned (what the experts should get)

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
            by local expert (each expert's from a multiple of ``expert_alignment``, zero rows and zero
            probabilities between); their probabilities [N] in probs' dtype)."""
            rows, out = dispatch_with_grad(self.buffer, hidden_states, self._topk_idx, probs.detach(),
                                           payload=self.payload, backward_payload=self.backward_payload,
                                           dtype=hidden_states.dtype, expert_alignment=self.expert_alignment,
                                           decode=self.decode)
            self._handle = out.handle
            self.dispatch_output, self.dispatched_rows = out, rows
            return rows, row_weights_with_grad(self.buffer, out.handle, probs).to(probs.dtype)

        def dispatch_postprocess(self, hidden_states, probs):
            """Returns (rows [N, H], tokens_per_expert int64 [L] on the CPU, permuted_probs [N])."""
            tokens_per_expert = torch.tensor(self._handle.tokens_per_expert, dtype=torch.int64)
            return hidden_states, tokens_per_expert, probs

        def combine_preprocess(self, hidden_states):
            """Expert outputs [N, H], already weighted by the experts: nothing to do here."""
            return hidden_states

        def token_combine(self, hidden_states):
            """Expert outputs [N, H] -> each token's sum of its experts' rows, BF16 [T, H]."""
            self.dispatch_output = self.dispatched_rows = None
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


# ---------------------------------------------------------------------------------------------
# the experts: moe_fp4.moe.Experts behind Megatron's experts interface
# ---------------------------------------------------------------------------------------------

EXPERTS_CHOICES = ("megatron", "moe_fp4")  # apply(experts=...)
# attributes Megatron's DDP and optimizer read on the experts' parameters (expert-parallel grouping)
_PARAM_ATTRS = ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride")


def _experts_config_problems(config) -> list[str]:
    """What of a TransformerConfig ``MoeFp4Experts`` does not compute, one phrase per option."""
    import torch.nn.functional as F

    problems = []
    if not getattr(config, "gated_linear_unit", False) or getattr(config, "activation_func", None) is not F.silu:
        problems.append("the experts must be gated SwiGLU (gated_linear_unit=True, activation_func=F.silu), got "
                        f"gated_linear_unit={getattr(config, 'gated_linear_unit', None)}, activation_func="
                        f"{getattr(getattr(config, 'activation_func', None), '__name__', None)}")
    problems += _required_options(config, (
        ("glu_linear_offset", 0, ""),
        ("activation_func_clamp_value", None, ""),
        ("moe_mlp_glu_interleave_size", None, "gate rows, then up rows"),
        ("add_bias_linear", False, "the experts have no biases"),
        ("moe_apply_probs_on_input", False, "the probs weight the SwiGLU output"),
    ))
    hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
    for name, v in (("hidden_size", hidden), ("moe_ffn_hidden_size", config.moe_ffn_hidden_size)):
        if v % EXPERTS_ALIGN:
            problems.append(f"{name} must be a multiple of {EXPERTS_ALIGN}, got {v}")
    return problems


def _megatron_layout(module) -> str:
    """"sequential", "grouped" or "te_grouped": which of Megatron's experts ``module`` is."""
    from megatron.core.transformer.moe import experts as megatron_experts

    for kind, name in (("te_grouped", "TEGroupedMLP"), ("grouped", "GroupedMLP"), ("sequential", "SequentialMLP")):
        cls = getattr(megatron_experts, name, None)  # (GroupedMLP is gone after 0.16)
        if cls is not None and isinstance(module, cls):
            return kind
    raise ValueError(f"experts: expected Megatron's SequentialMLP, GroupedMLP or TEGroupedMLP, got "
                     f"{type(module).__name__}")


def megatron_expert_names(module, num_local_experts: int) -> list[str]:
    """The names (in ``module``) of the parameters of Megatron's experts that ``MoeFp4Experts`` holds."""
    kind = _megatron_layout(module)
    if kind == "grouped":
        return ["weight1", "weight2"]
    fmt = ("local_experts.{}.linear_fc1.weight", "local_experts.{}.linear_fc2.weight") if kind == "sequential" \
        else ("linear_fc1.weight{}", "linear_fc2.weight{}")
    return [f.format(g) for g in range(num_local_experts) for f in fmt]


def to_megatron_layout(module, w1: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """w1 [L, 2I, H], w2 [L, H, I] (``Experts``' layout: weights or their gradients) as the parameters of
    Megatron's experts ``module``: {name in module: tensor of that parameter's shape}. SequentialMLP and
    TEGroupedMLP: expert g's linear_fc1 weight [2I, H] = w1[g], linear_fc2 weight [H, I] = w2[g];
    GroupedMLP: weight1 [H, L * 2I] (viewed by Megatron as [L, H, 2I]) and weight2 [L * I, H]."""
    g, two_i, h = w1.shape
    if _megatron_layout(module) == "grouped":
        return {"weight1": w1.transpose(1, 2).contiguous().view(h, g * two_i),
                "weight2": w2.transpose(1, 2).contiguous().view(-1, h)}
    names = megatron_expert_names(module, g)
    return {n: (w1 if i % 2 == 0 else w2)[i // 2] for i, n in enumerate(names)}


def from_megatron_layout(module, num_local_experts: int, hidden: int,
                         intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of Megatron's experts ``module`` as (w1 [L, 2I, H], w2 [L, H, I]), detached views
    or copies; ValueError naming a parameter that is missing or of another shape."""
    params = dict(module.named_parameters())
    g, i2, i = num_local_experts, 2 * intermediate, intermediate
    kind = _megatron_layout(module)
    if kind == "grouped":
        want = {"weight1": (hidden, g * i2), "weight2": (g * i, hidden)}
    else:
        names = megatron_expert_names(module, g)
        want = {n: (i2, hidden) if k % 2 == 0 else (hidden, i) for k, n in enumerate(names)}
    for name, shape in want.items():
        p = params.get(name)
        if p is None or tuple(p.shape) != shape:
            got = "missing" if p is None else f"of shape {tuple(p.shape)}"
            raise ValueError(f"experts: {type(module).__name__}'s parameter {name!r} is {got}, expected shape "
                             f"{shape} (gated SwiGLU, {g} local experts, hidden {hidden}, intermediate {i}; "
                             "expert tensor parallelism off)")
    if kind == "grouped":
        return (params["weight1"].detach().view(g, hidden, i2).transpose(1, 2),
                params["weight2"].detach().view(g, i, hidden).transpose(1, 2))
    return (torch.stack([params[n].detach() for n in names[0::2]]),
            torch.stack([params[n].detach() for n in names[1::2]]))


class MoeFp4Experts(Experts):
    """``moe_fp4.moe.Experts`` with Megatron's experts interface: forward(permuted_local_hidden_states
    [N, H], tokens_per_expert int64 [L], permuted_probs [N]) -> (output [N, H] in the rows' dtype, None).

    megatron_experts: Megatron's SequentialMLP, GroupedMLP or TEGroupedMLP whose weights are copied
      (kept, unregistered, for ``restore``); config: the layer's TransformerConfig (gated SwiGLU);
    save: what backward keeps (``Experts``: "mxfp4", "fp8", "bf16", "recompute").
    Parameters w1 [L, 2I, H], w2 [L, H, I] in the dtype of Megatron's weights (bfloat16 or float32),
    with their Megatron attributes (``allreduce``: expert-parallel gradient reduction).
    dispatcher: the layer's ``MoeFp4TokenDispatcher`` (set by ``apply``) whose dispatch output the
    forward reads; None, or rows that are not its dispatched rows: Megatron's rows, padded here."""

    def __init__(self, megatron_experts, config, *, save: str = "mxfp4"):
        problems = _experts_config_problems(config)
        tp_group = getattr(megatron_experts, "tp_group", None)
        if tp_group is not None and tp_group.size() > 1:
            problems.append(f"expert tensor parallelism must be off (expert_tensor_parallel_size is "
                            f"{tp_group.size()})")
        if problems:
            raise ValueError("MoeFp4Experts: " + "; ".join(problems))
        g = megatron_experts.num_local_experts
        hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
        w1, w2 = from_megatron_layout(megatron_experts, g, hidden, config.moe_ffn_hidden_size)
        if w1.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"MoeFp4Experts: the experts' weights must be bfloat16 or float32, got {w1.dtype}")
        super().__init__(g, hidden, config.moe_ffn_hidden_size, save=save, dtype=w1.dtype, device=w1.device)
        with torch.no_grad():
            self.w1.copy_(w1)
            self.w2.copy_(w2)
        names = megatron_expert_names(megatron_experts, g)
        params = dict(megatron_experts.named_parameters())
        for mine, theirs in ((self.w1, params[names[0]]), (self.w2, params[names[1]])):
            for attr in _PARAM_ATTRS:
                if hasattr(theirs, attr):
                    setattr(mine, attr, getattr(theirs, attr))
        self.config = config
        self._megatron = (megatron_experts,)  # (a tuple: not a submodule, its parameters not the model's)
        self.dispatcher = None

    @property
    def megatron_experts(self):
        """Megatron's experts module these replace (its weights as they were at construction or the
        last ``restore``)."""
        return self._megatron[0]

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
        unsupported = sorted(k for k, v in kwargs.items() if v is not None)
        if unsupported:
            raise ValueError(f"MoeFp4Experts: unsupported arguments {unsupported} (NCCL-EP zero-copy buffers)")
        rows = permuted_local_hidden_states
        d = self.dispatcher
        if d is not None and d.dispatched_rows is not None and rows is d.dispatched_rows \
                and d.expert_alignment % EXPERTS_ALIGN == 0:
            return self._forward_dispatched(rows, d.dispatch_output, permuted_probs), None
        if d is not None and not d.decode and d.dispatched_rows is not None:
            raise ValueError("permuted_local_hidden_states: not the rows the layer's MoeFp4TokenDispatcher "
                             "dispatched (a hook replaced them?); with decode=False they carry no values")
        return self._forward_padded(rows, tokens_per_expert, permuted_probs), None

    def _forward_dispatched(self, rows, out, probs):
        """The dispatch's rows as they are: its FP8 (and MXFP4) rows, its 128-aligned splits."""
        extra = {"x_fp8": out.to_fp8_blockwise()}
        if self.save == "mxfp4" and out.payload.name == "mxfp4":
            extra["x_mxfp4"] = formats.unpack_mxfp4_rows(out.rows, self.hidden)
        y = super().forward(rows, out.split_offsets, out.split_lens, row_weights=probs.float(), validate=False,
                            **extra)
        return y.to(rows.dtype)

    def _forward_padded(self, rows, tokens_per_expert, probs):
        """Megatron's rows (back to back by expert) copied into a 128-aligned layout and back."""
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != self.hidden:
            raise ValueError(f"permuted_local_hidden_states: expected a tensor [N, {self.hidden}], "
                             f"got {describe(rows)}")
        counts = [int(c) for c in torch.as_tensor(tokens_per_expert).tolist()]
        if len(counts) != self.num_experts or sum(counts) != rows.shape[0]:
            raise ValueError(f"tokens_per_expert: expected {self.num_experts} counts summing to {rows.shape[0]} "
                             f"rows, got {counts}")
        padded = [-(-c // EXPERTS_ALIGN) * EXPERTS_ALIGN for c in counts]
        starts = [sum(padded[:e]) for e in range(len(padded))]
        dest = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)]).to(rows.device)
        m = sum(padded)
        x = rows.new_zeros(m, self.hidden).index_put((dest,), rows)
        w = torch.zeros(m, dtype=torch.float32, device=rows.device).index_put((dest,), probs.float())
        as_tensor = dict(dtype=torch.int64, device=rows.device)
        y = super().forward(x, torch.tensor(starts, **as_tensor), torch.tensor(counts, **as_tensor), row_weights=w,
                            validate=False)
        return y[dest].to(rows.dtype)

    def megatron_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """w1, w2 (or, ``grads``, their gradients) in the layout of Megatron's experts: {name in
        ``megatron_experts``: tensor} (``to_megatron_layout``)."""
        w1, w2 = (self.w1.grad, self.w2.grad) if grads else (self.w1.detach(), self.w2.detach())
        if w1 is None or w2 is None:
            raise ValueError("grads: w1 or w2 has no gradient (no backward ran)")
        return to_megatron_layout(self.megatron_experts, w1, w2)

    def restore(self):
        """Copy w1, w2 into Megatron's experts; returns that module."""
        module = self.megatron_experts
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, t in self.megatron_state().items():
                params[name].copy_(t)
        return module

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: the weight gradients are computed in backward."""

    def sharded_state_dict(self, *args, **kwargs):
        raise NotImplementedError("MoeFp4Experts: no Megatron distributed checkpoint layout; call "
                                  "moe_fp4.integrations.megatron_core.revert(model) before sharded_state_dict")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, megatron={type(self.megatron_experts).__name__}"


def experts_class():
    """``MoeFp4Experts`` (after the megatron-core version check)."""
    _megatron()
    return MoeFp4Experts


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


def apply(model_or_layer, payload="mxfp4", backend=None, *, backward_payload="bf16", combine_payload="bf16",
          experts: str = "megatron", save: str = "mxfp4") -> list:
    """Install a ``MoeFp4TokenDispatcher`` on every MoELayer of a built model; returns those layers.

    model_or_layer: a megatron-core model (e.g. GPTModel), one MoELayer, or a list of model chunks;
    payload: the dispatch payload ("bf16", "fp8", "mxfp4", "nvfp4"); backend: None (follow the EP
    group: NCCL on GPUs, gloo on CPU), "nccl", "symm" (NVLink symmetric memory) or "gloo";
    backward_payload: the gradients' payload ("bf16" or "fp8"); combine_payload: "bf16" or "fp8";
    experts: "megatron" (Megatron's own experts; moe_fp4's put back if an earlier apply installed
      them) or "moe_fp4" (``MoeFp4Experts`` on the dispatch's FP8 rows: module docstring);
    save: with experts="moe_fp4", what the experts' backward keeps ("mxfp4", "fp8", "bf16",
      "recompute"); with save "fp8" or "recompute", or "mxfp4" with the mxfp4 payload, the dispatch
      decodes no rows (the experts read its FP8/MXFP4 rows).
    Call it on every rank, after the model is built (and after parallel_state is initialised), before
    the optimizer and DDP wrap the parameters. Layers with the same EP group share one Buffer.
    Applying again replaces moe_fp4's dispatchers (keeping Megatron's originals for ``revert``) and
    keeps moe_fp4's experts (their trained weights; ``save`` updated). Raises ImportError without a
    supported megatron-core, ValueError for a model without MoE layers or an option the dispatcher or
    the experts do not do (before changing any layer)."""
    cls = dispatcher_class()
    _, _, ProcessGroupCollection = _megatron()
    if experts not in EXPERTS_CHOICES:
        raise ValueError(f"experts: expected one of {EXPERTS_CHOICES}, got {experts!r}")
    if experts == "moe_fp4" and save not in SAVE_POLICIES:
        raise ValueError(f"save: expected one of {SAVE_POLICIES}, got {save!r}")
    layers = find_moe_layers(model_or_layer)
    if not layers:
        raise ValueError("model_or_layer: no megatron-core MoELayer found")
    fp8_experts = experts == "moe_fp4"
    # the FP8 experts read the dispatch's FP8 rows; they need the decoded values only for what backward
    # keeps of them: save="bf16", or save="mxfp4" when the payload is not MXFP4 (quantized from them)
    reads_rows = save in ("fp8", "recompute") or save == "mxfp4" and get_payload(payload).name == "mxfp4"
    decode = not (fp8_experts and reads_rows)
    buffers: dict = {}
    planned = []
    for layer in layers:  # everything is built (and checked) before any layer changes
        original = getattr(layer, _ORIGINAL, None) or layer.token_dispatcher
        groups = ProcessGroupCollection(ep=original.ep_group, expt_tp=original.tp_group, tp_ep=original.tp_ep_group)
        key = (id(original.ep_group), layer.config.num_moe_experts)
        dispatcher = cls(layer.num_local_experts, layer.local_expert_indices, layer.config, groups,
                         buffer=buffers.get(key), payload=payload, backend=backend,
                         backward_payload=backward_payload, combine_payload=combine_payload,
                         expert_alignment=EXPERTS_ALIGN if fp8_experts else 1, decode=decode)
        buffers[key] = dispatcher.buffer
        adapter = None
        if fp8_experts:
            adapter = layer.experts if isinstance(layer.experts, MoeFp4Experts) else \
                MoeFp4Experts(layer.experts, layer.config, save=save)
        planned.append((layer, original, dispatcher, adapter))
    for layer, original, dispatcher, adapter in planned:
        setattr(layer, _ORIGINAL, original)
        layer.token_dispatcher = dispatcher
        if hasattr(layer, "_training_token_dispatcher"):  # MoELayer.forward re-selects it outside inference
            layer._training_token_dispatcher = dispatcher
        if adapter is not None:
            adapter.save = save
            adapter.dispatcher = dispatcher
            layer.experts = adapter
        elif isinstance(layer.experts, MoeFp4Experts):
            layer.experts = layer.experts.restore()
    return layers


def revert(model_or_layer) -> list:
    """Put Megatron's own dispatchers back on the MoE layers that ``apply`` changed, and Megatron's own
    experts (with moe_fp4's trained weights copied into them); returns those layers."""
    restored = []
    for layer in find_moe_layers(model_or_layer):
        original = getattr(layer, _ORIGINAL, None)
        changed = isinstance(layer.experts, MoeFp4Experts)
        if changed:
            layer.experts = layer.experts.restore()
        if original is not None:
            layer.token_dispatcher = original
            if hasattr(layer, "_training_token_dispatcher"):
                layer._training_token_dispatcher = original
            delattr(layer, _ORIGINAL)
            changed = True
        if changed:
            restored.append(layer)
    return restored


__all__ = ["EXPERTS_CHOICES", "SUPPORTED_VERSIONS", "MoeFp4Experts", "apply", "check_version", "dispatcher_class",
           "experts_class", "find_moe_layers", "from_megatron_layout", "megatron_expert_names", "megatron_version",
           "revert", "routing_to_topk", "to_megatron_layout"]
