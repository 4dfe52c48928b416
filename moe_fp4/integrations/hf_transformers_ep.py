"""moe_fp4 as a transformers ``EPImplementation`` (``transformers.distributed.expert_parallel``).

Loaded by ``moe_fp4.integrations.hf_transformers`` on first use of ``register_ep_implementations`` or of the
classes below (the interface is not in every transformers 5.x release); see that module's docstring.
"""

from __future__ import annotations

import torch
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from moe_fp4.ep import Buffer, get_payload
from moe_fp4.integrations.hf_transformers import ExpertParallelExperts


class MoeFp4EP(EPImplementation):
    """transformers' ``EPImplementation`` with moe_fp4's ``Buffer`` doing the token exchange (MXFP4
    rows; the subclasses below send the other payloads; gradients travel as ``backward_payload``).

    Built by transformers' plan application (``ep_dispatch_experts`` rule) once per experts module:
    experts: the module, its ``gate_up_proj`` / ``down_proj`` already sharded by expert (rank r holds
      experts [r * E_local, (r + 1) * E_local), ``num_experts`` = E_local), its ``forward`` the
      experts' own, on local expert ids;
    ep_mesh: the 1-D expert-parallel mesh (W ranks); its process group carries the exchanges;
    tp_mesh: the ranks sharing one batch; only size 1 is supported (each rank of the EP group
      holds its own batch).
    Called with hidden_states float [T, H], top_k_index int64 [T, k] (global expert ids in
    [0, W * E_local)), top_k_weights float [T, k]; returns float [T, H] (hidden_states' dtype):
    sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t]) (``ExpertParallelExperts``).
    Raises ValueError when tp_mesh has more than one rank, or the hidden size does not fit the
    payload."""

    payload = "mxfp4"
    backward_payload = "bf16"

    def __init__(self, experts: torch.nn.Module, ep_mesh, tp_mesh):
        if tp_mesh.size() != 1:
            raise ValueError(f"tp_mesh: {type(self).__name__} needs a tensor-parallel mesh of size 1 (every rank of "
                             f"the expert group holding its own batch, DistributedConfig(tp_size=1)), got size "
                             f"{tp_mesh.size()}")
        super().__init__(experts, ep_mesh, tp_mesh)
        codec = get_payload(self.payload)
        codec.check_hidden(experts.down_proj.shape[1], "payload")
        buffer = Buffer(self.num_local_experts * ep_mesh.size(), ep_mesh.get_group(), payload=codec)
        if buffer.rank != ep_mesh.get_local_rank():
            raise ValueError(f"ep_mesh: rank {ep_mesh.get_local_rank()} of the mesh is rank {buffer.rank} of its "
                             "process group; expected the same order")
        self.forward = ExpertParallelExperts(buffer, self.experts_forward, self.num_local_experts, payload=codec,
                                             backward_payload=self.backward_payload)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.forward(hidden_states, top_k_index, top_k_weights)


class MoeFp4BF16EP(MoeFp4EP):
    """``MoeFp4EP`` sending BF16 rows."""

    payload = "bf16"


class MoeFp4FP8EP(MoeFp4EP):
    """``MoeFp4EP`` sending FP8 rows (hidden size a multiple of 128)."""

    payload = "fp8"


class MoeFp4NVFP4EP(MoeFp4EP):
    """``MoeFp4EP`` sending NVFP4 rows."""

    payload = "nvfp4"


# the names DistributedConfig(ep_implementation=...) takes once register_ep_implementations() ran
EP_IMPLEMENTATIONS = {"moe_fp4": MoeFp4EP, "moe_fp4_bf16": MoeFp4BF16EP, "moe_fp4_fp8": MoeFp4FP8EP,
                      "moe_fp4_nvfp4": MoeFp4NVFP4EP}


def register_ep_implementations() -> list[str]:
    """See ``moe_fp4.integrations.hf_transformers.register_ep_implementations``."""
    registered = EPImplementationInterface()
    for name, cls in EP_IMPLEMENTATIONS.items():
        if name in registered and registered[name] is not cls:
            raise ValueError(f"ep_implementation: {name!r} is already registered to {registered[name]!r}")
    for name, cls in EP_IMPLEMENTATIONS.items():
        EPImplementationInterface.register(name, cls)
    return list(EP_IMPLEMENTATIONS)


__all__ = ["EP_IMPLEMENTATIONS", "MoeFp4BF16EP", "MoeFp4EP", "MoeFp4FP8EP", "MoeFp4NVFP4EP",
           "register_ep_implementations"]
