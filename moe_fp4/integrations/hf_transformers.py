"""Expert parallelism for Hugging Face transformers MoE models through moe_fp4's ``Buffer``.

transformers 5.x keeps the experts of a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) in one
"experts" module: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] parameters, an attribute
``num_experts`` and a forward ``(hidden_states [T, H], top_k_index int64 [T, k], top_k_weights [T, k])
-> [T, H]`` that the block calls after its own router. ``enable_expert_parallel`` replaces that forward
on every such module (the block, its router and any shared expert stay as they are):

  1. dispatch: each token goes to the ranks of its top-k experts as ``payload`` rows
     (``dispatch_with_grad``); the rows arrive grouped by local expert;
  2. the module's own forward runs on the received rows, with local expert ids and unit weights, so
     whichever experts implementation the config selects (eager, grouped_mm, ...) does the maths;
  3. combine: the expert outputs are weighted by the top-k weights and summed back on each token's rank
     (``combine_with_grad``, BF16 partial sums); the result is cast to the input's dtype.
Gradients flow back through both exchanges (BF16 by default), to the tokens, the local experts' weights
and the routing weights (so the router trains).

Experts are sharded by index: with E experts on W ranks, rank r keeps experts
[r * E / W, (r + 1) * E / W) (expert e lives on rank e // (E / W)). The patch keeps only those rows of
``gate_up_proj`` / ``down_proj`` (and of their biases where a model has them) as the module's
parameters; the other ranks' expert weights are dropped, so an optimizer built after the patch sees
only the local experts.

Two ways in, sharing that forward (``ExpertParallelExperts``):

* ``enable_expert_parallel(model, group, payload)``: no ``DistributedConfig`` nor DTensor plan, a
  plain process group and a model built the usual way; the patch shards the experts itself;
* transformers' own expert-parallel plan: ``register_ep_implementations()`` registers moe_fp4 in
  ``EPImplementationInterface`` under the names of ``EP_IMPLEMENTATIONS`` ("moe_fp4" sends MXFP4
  rows, "moe_fp4_bf16" / "moe_fp4_fp8" / "moe_fp4_nvfp4" the other payloads), and
  ``DistributedConfig(ep_size=W, ..., ep_implementation="moe_fp4")`` selects it. transformers then
  shards the experts (``grouped_gemm`` rule: the same contiguous split) and builds one
  ``MoeFp4EP`` per experts module (``ep_dispatch_experts`` rule) with the EP and TP meshes.
"""

from __future__ import annotations

import logging
import sys

import torch

from moe_fp4.ep import Buffer, combine_with_grad, dispatch_with_grad, get_payload


class _TorchaoImportNoise(logging.Filter):
    """transformers imports torchao (for its quantizers) when it is installed, and torchao's import
    logs noise that says nothing to a user of this module: on a torch without CUDA, one "Failed to
    load" warning per CUDA extension in torchao's wheel (``torchao/_C*.so``, which such a torch can
    never load), and torch's deprecation note for each enum torchao registers as a pytree constant.
    This filter drops exactly those records; it is installed on the two loggers when this module is
    imported, so it applies when torchao is imported later (by transformers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            return torch.version.cuda is not None or not record.getMessage().startswith("Failed to load")
        args = record.args if isinstance(record.args, tuple) else ()
        from_torchao = bool(args) and str(getattr(args[0], "__module__", "")).startswith("torchao")
        return not (from_torchao and "is an Enum subclass" in str(record.msg))


if "torchao" not in sys.modules:
    for _name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(_name).addFilter(_TorchaoImportNoise())

_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


def _is_experts_module(module: torch.nn.Module) -> bool:
    proj = getattr(module, "gate_up_proj", None)
    if proj is None:
        proj = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(getattr(module, "num_experts", None), int) and isinstance(proj, torch.nn.Parameter)
            and isinstance(down, torch.nn.Parameter) and proj.dim() == 3 and down.dim() == 3
            and proj.shape[0] == module.num_experts == down.shape[0])


def find_experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every experts module of ``model``: 3-D ``gate_up_proj`` (or ``up_proj``) and
    ``down_proj`` parameters whose first dimension is the module's ``num_experts``."""
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


class ExpertParallelExperts:
    """The forward installed on one experts module: dispatch, local experts, combine.

    buffer: the ``Buffer`` of the expert-parallel group (num_experts = the model's E);
    experts_forward: the module's own forward, called on local expert ids;
    payload: the dispatch wire format; backward_payload: the gradients' wire format."""

    def __init__(self, buffer: Buffer, experts_forward, num_local_experts: int, *, payload, backward_payload):
        self.buffer = buffer
        self.experts_forward = experts_forward
        self.num_local_experts = num_local_experts
        self.payload = payload
        self.backward_payload = backward_payload

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states float [T, H]; top_k_index int64 [T, k] global expert ids; top_k_weights float
        [T, k]. Returns [T, H] in hidden_states' dtype: sum_j top_k_weights[t, j] * expert_j(x_t)."""
        dtype = hidden_states.dtype
        values, out = dispatch_with_grad(self.buffer, hidden_states, top_k_index.to(torch.int64), top_k_weights,
                                         payload=self.payload, backward_payload=self.backward_payload,
                                         dtype=dtype)
        n = values.shape[0]
        if n == 0:
            # No rows here: run the experts on one zero row and keep none of it, so that the (empty)
            # output stays connected to the dispatch (this rank's backward joins the gradient
            # exchanges the other ranks run) and the local experts' weights get (zero) gradients,
            # as on the ranks that received rows (a gradient reduction over replicas expects them).
            ids = torch.zeros(1, 1, dtype=torch.int64, device=values.device)
            ones = torch.ones(1, 1, dtype=top_k_weights.dtype, device=values.device)
            y = self.experts_forward(values.sum(dim=0, keepdim=True), ids, ones)[:0]
        else:
            local_ids = torch.repeat_interleave(
                torch.arange(self.num_local_experts, device=values.device), out.split_lens).unsqueeze(1)
            ones = torch.ones(n, 1, dtype=top_k_weights.dtype, device=values.device)
            y = self.experts_forward(values, local_ids, ones)
        combined = combine_with_grad(self.buffer, y, out.handle, top_k_weights, weighted=True,
                                     backward_payload=self.backward_payload)
        return combined.to(dtype)


def _keep_local_experts(module: torch.nn.Module, first: int, count: int) -> None:
    for name in _EXPERT_PARAMS:
        p = getattr(module, name, None)
        if isinstance(p, torch.nn.Parameter):
            local = p.detach()[first:first + count].clone()
            setattr(module, name, torch.nn.Parameter(local, requires_grad=p.requires_grad))
    module.num_experts = count


def enable_expert_parallel(model: torch.nn.Module, group=None, payload="mxfp4", *,
                           backward_payload="bf16") -> list[str]:
    """Shard the experts of every MoE block of ``model`` over ``group`` and route tokens with moe_fp4.

    model: a transformers MoE model (or any module holding experts modules, see
      ``find_experts_modules``), with the same weights on every rank of ``group``;
    group: a torch.distributed process group (None: the default group); every rank must call this;
    payload: the dispatch wire format: "mxfp4" (default), "bf16", "fp8" or "nvfp4" (the hidden size
      must be a multiple of 32; of 128 for "fp8"; of 16 for "nvfp4");
    backward_payload: the gradients' wire format ("bf16" default, or "fp8").
    Rank r keeps experts [r * E / W, (r + 1) * E / W) of each module (W ranks, E experts, W must divide
    E); the other experts' weights are dropped from the module. Each rank then feeds its own tokens
    through the model; every rank must run the same number of MoE forwards (and backwards), since each
    one is a collective. Returns the names of the patched modules.
    Raises ValueError if ``model`` has no experts module, or W does not divide E, or the hidden size
    does not fit the payload.
    """
    modules = find_experts_modules(model)
    if not modules:
        raise ValueError("model: expected at least one experts module (3-D gate_up_proj/up_proj and down_proj "
                         "parameters indexed by num_experts), found none")
    codec = get_payload(payload)
    get_payload(backward_payload)
    buffers: dict[int, Buffer] = {}
    for name, module in modules:  # every check before any change
        if getattr(module, "_moe_fp4_ep", None) is not None:
            raise ValueError(f"model: {name} is already expert-parallel")
        codec.check_hidden(module.down_proj.shape[1], "payload")
        if module.num_experts not in buffers:
            buffers[module.num_experts] = Buffer(module.num_experts, group, payload=codec)
    for _, module in modules:
        buffer = buffers[module.num_experts]
        local = buffer.experts_per_rank
        _keep_local_experts(module, buffer.rank * local, local)
        impl = ExpertParallelExperts(buffer, module.forward, local, payload=codec, backward_payload=backward_payload)
        module._moe_fp4_ep = impl
        module.forward = impl
    return [name for name, _ in modules]


# transformers' EPImplementation API (transformers.distributed.expert_parallel) is not in every 5.x
# release; the classes built on it live in moe_fp4/integrations/hf_transformers_ep.py and load on first use, so
# enable_expert_parallel works without it.
_EP_NAMES = ("EP_IMPLEMENTATIONS", "MoeFp4EP", "MoeFp4BF16EP", "MoeFp4FP8EP", "MoeFp4NVFP4EP")


def has_ep_implementation_api() -> bool:
    """Whether this transformers has ``transformers.distributed.expert_parallel`` (the
    ``EPImplementation`` interface that ``register_ep_implementations`` plugs into)."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformers.distributed.expert_parallel") is not None
    except ModuleNotFoundError:
        return False


def _ep_module():
    if not has_ep_implementation_api():
        import transformers

        raise ImportError(f"register_ep_implementations / MoeFp4EP: transformers {transformers.__version__} has no "
                          "transformers.distributed.expert_parallel (EPImplementation); use a release that has it "
                          "(5.23 does), or enable_expert_parallel(model, group, payload), which needs none")
    from moe_fp4.integrations import hf_transformers_ep

    return hf_transformers_ep


def register_ep_implementations() -> list[str]:
    """Register moe_fp4 in transformers' ``EPImplementationInterface`` under the names of
    ``EP_IMPLEMENTATIONS``; returns them. Calling it again changes nothing. Raises ValueError if one
    of the names is already registered to another implementation, ImportError if this transformers
    has no EPImplementation interface."""
    return _ep_module().register_ep_implementations()


def __getattr__(name: str):
    if name in _EP_NAMES:
        return getattr(_ep_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ExpertParallelExperts", "enable_expert_parallel", "find_experts_modules", "has_ep_implementation_api",
           "register_ep_implementations"]
