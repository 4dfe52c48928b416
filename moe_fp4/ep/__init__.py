"""Expert-parallel dispatch and combine with byte-row payloads.

  layout     dispatch_layout: tokens per rank / per expert, is_token_in_rank, the send order (the
             dispatch itself builds its tables with the counting kernels of moe_fp4.ops.routing)
  payloads   wire formats as opaque byte rows: bf16, fp8 (E4M3 + FP32 per 128), mxfp4, nvfp4
  backends   all_to_all_single over a process group (NCCL on CUDA, gloo on CPU), or one process;
             each backend owns the payload exchange of a dispatch and of a combine
  symmetric  backend="symm" over torch symmetric memory (NCCL stays the default): the dispatch
             pushes each token's encoded row straight into every receiver's buffer over NVLink
             (mxfp4, fp8: one fused encode-and-store kernel; bf16: one row push; nvfp4: the encode,
             then the push), combine sums partials read out of the peers' buffers (Triton)
  deepep     backend="deepep": the encoded rows through DeepEP's normal-mode dispatch and combine
             (deep_ep.Buffer, built with patches/deepep/build.sh), the expert-order layout built
             on the receiver from DeepEP's recv_topk_idx
  buffer     Buffer.dispatch / Buffer.combine with a reusable handle; dispatch(max_recv_tokens=N)
             is sync-free (fixed blocks, outputs sized for the worst case, DispatchHandle.check());
             make_backend picks the backend
  sms        the SM budget of the dispatch and combine kernels (Buffer(num_sms=...), set_num_sms)
  autograd   dispatch_with_grad / combine_with_grad / row_weights_with_grad (BF16 or FP8 gradients)
  bench      `python -m moe_fp4 bench dispatch`
  testing    a pool of gloo/NCCL worker processes for multi-rank tests
"""

from moe_fp4.ep.autograd import combine_with_grad, dispatch_with_grad, row_weights_with_grad
from moe_fp4.ep.backends import AllToAllBackend, LocalBackend, TorchDistributedBackend
from moe_fp4.ep.buffer import Buffer, DispatchHandle, DispatchOutput, make_backend
from moe_fp4.ep.deepep import DeepEPBackend
from moe_fp4.ep.layout import DispatchLayout, dispatch_layout, send_order
from moe_fp4.ep.payloads import (
    PAYLOADS,
    BF16Payload,
    FP8Payload,
    MXFP4Payload,
    NVFP4Payload,
    PayloadCodec,
    get_payload,
)
from moe_fp4.ep.symmetric import SymmetricMemoryBackend

__all__ = [
    "AllToAllBackend", "BF16Payload", "Buffer", "DeepEPBackend", "DispatchHandle", "DispatchLayout", "DispatchOutput",
    "FP8Payload", "LocalBackend", "MXFP4Payload", "NVFP4Payload", "PAYLOADS", "PayloadCodec",
    "TorchDistributedBackend", "combine_with_grad", "dispatch_layout", "dispatch_with_grad", "get_payload",
    "make_backend", "row_weights_with_grad", "send_order", "SymmetricMemoryBackend",
]
