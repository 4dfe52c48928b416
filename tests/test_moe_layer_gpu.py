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


# ------------------------------------------------------------------------------------------------
# expert parallel on 2 GPUs (NCCL and the symm backend): every policy against the float64 MoE
# ------------------------------------------------------------------------------------------------


def case_layer_two_gpus(ctx, seed, policy, backend):
    """This rank's output, input gradient, router gradient and local experts' gradients against the
    float64 MoE over both ranks' tokens (tests/test_moe_layer.py's reference and bounds), the routing
    taken from the layer's own router on the GPU."""
    import test_moe_layer as ref

    dev = torch.device("cuda", ctx.rank) if ctx.group is not None and torch.cuda.is_available() \
        else torch.device("cpu")  # (the CPU: only to check this case's own code on gloo)
    weights = ref.full_weights(seed)
    torch.manual_seed(seed)
    layer = MoELayer(ref.H, ref.I, ref.E, ref.K, group=ctx.group, policy=policy, shared_intermediate=ref.S,
                     dtype=torch.float32, device=dev, backend=backend)
    ref.load(layer, weights, ctx.rank)
    data = [ref.tokens(seed, r, t=16 + 5 * r) for r in range(ctx.world_size)]
    x, dy = data[ctx.rank]
    xx = x.to(dev, copy=True).requires_grad_()
    y = layer(xx)
    y.float().backward(dy.to(dev))
    params = [w.double().requires_grad_() for w in weights]
    total, y_ref, x_mine = 0, None, None
    for r, (xr, dyr) in enumerate(data):
        idx = layer.router(xr.to(dev))[0].cpu()
        xd = xr.double().requires_grad_()
        yr = ref.reference(xd, idx, None, True, params)
        total = total + (yr * dyr.double()).sum()
        if r == ctx.rank:
            y_ref, x_mine = yr, xd
    total.backward()
    router_ref = torch.autograd.grad(
        ref.reference(x.double(), layer.router(x.to(dev))[0].cpu(), None, True, params).mul(dy.double()).sum(),
        params[0])[0]
    local = layer.buffer.experts_per_rank
    mine = slice(ctx.rank * local, (ctx.rank + 1) * local)
    errors = {"y": ref._rel(y.cpu(), y_ref), "dx": ref._rel(xx.grad.cpu(), x_mine.grad),
              "router": ref._rel(layer.router.weight.grad.cpu(), router_ref),
              "w1": ref._rel(layer.experts.w1.grad.cpu(), params[1].grad[mine]),
              "w2": ref._rel(layer.experts.w2.grad.cpu(), params[2].grad[mine])}
    bad = {k: v for k, v in errors.items() if not v < ref.BOUNDS[policy]}
    assert not bad, f"rank {ctx.rank}, {policy}, {backend}: relative errors over {ref.BOUNDS[policy]}: {bad}"
    return errors


@pytest.fixture(scope="module")
def nccl_pool():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two or more CUDA GPUs")
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(2, "nccl", timeout_s=180)
    yield p
    p.close()


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["nccl", "symm"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_layer_two_gpus_matches_float64_moe(nccl_pool, policy, backend):
    errors = nccl_pool.run(case_layer_two_gpus, SEED + 11, policy, backend)
    print(f"seed {SEED + 11}, {policy}, {backend}: {errors}")
    assert len(errors) == 2
