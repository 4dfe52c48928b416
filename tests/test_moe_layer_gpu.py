"""moe_fp4.moe.MoELayer on one GPU (no process group): every policy's forward and backward against
the same layer on the CPU (the spec's GEMMs and conversions, torch's BF16 grouped GEMM), at a
mid-size shape; the difference stays within the policy's accumulation-order bound."""

import pytest
import torch

from moe_fp4.moe import POLICIES, MoELayer

pytestmark = pytest.mark.gpu
SEED = 3434
H, I, E, K, T = 1024, 512, 8, 2, 384


@pytest.mark.parametrize("policy", list(POLICIES))
def test_layer_gpu_matches_cpu(policy):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(T, H, generator=gen)
    dy = torch.randn(T, H, generator=gen)
    results, weights = [], None
    for dev in ("cpu", "cuda"):
        torch.manual_seed(SEED)
        layer = MoELayer(H, I, E, K, policy=policy, shared_intermediate=256, dtype=torch.float32, device=dev)
        if weights is None:
            weights = layer.state_dict()
        else:  # the same weights on both devices (the CUDA generator draws other numbers)
            layer.load_state_dict(weights)
        xx = x.detach().clone().to(dev).requires_grad_()
        y = layer(xx)
        y.float().backward(dy.to(dev))
        results.append([t.detach().cpu().double() for t in (y, xx.grad, layer.router.weight.grad,
                                                            layer.experts.w1.grad, layer.experts.w2.grad)])
    for name, a, b in zip(("y", "dx", "router", "w1", "w2"), *results):
        rel = float((a - b).norm() / b.norm())
        # BF16 roundings in different orders; with FP8/MXFP4 a near-tie may round one element
        # differently and move its block's scale
        assert rel < 2.0 ** -5, f"{policy} {name}: relative difference {rel}"
