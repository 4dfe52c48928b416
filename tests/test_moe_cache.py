"""The MXFP4 activation cache: exact reference gradients, bytes, and what is left alone."""

import pytest
import torch
from _compare import assert_bitwise_equal

import moe_fp4.formats as F
from moe_fp4.moe import mxfp4_activation_cache


def q(t: torch.Tensor) -> torch.Tensor:
    """What backward sees for a cached tensor: the spec's MXFP4 round trip along the last dim."""
    p, s = F.quantize_mxfp4(t.reshape(-1, t.shape[-1]))
    return F.dequantize_mxfp4(p, s, dtype=t.dtype).reshape(t.shape)


def test_gradients_equal_the_hand_built_reference():
    x0 = torch.randn(64, 128, requires_grad=True)
    w1 = torch.randn(256, 128, requires_grad=True)
    w2 = torch.randn(64, 256, requires_grad=True)
    dy = torch.randn(64, 64)
    with mxfp4_activation_cache(min_numel=1) as cache:
        x = x0 * 1.0  # an activation (not a leaf): cached
        h = torch.relu(x @ w1.t())
        y = h @ w2.t()
    y.backward(dy)
    # matmul saves its inputs: x for dW1, h for dW2 (both cached); the weights stay exact.
    # relu saves its output h: its mask comes from the cached h.
    hq = q(h.detach())
    dh = dy @ w2.detach()
    dz = dh * (hq > 0)
    assert torch.equal(w2.grad, dy.t() @ hq)
    assert torch.equal(w1.grad, dz.t() @ q(x.detach()))
    assert torch.equal(x0.grad, dz @ w1.detach())
    assert cache.stats.tensors_packed >= 3
    assert cache.stats.bytes_packed / cache.stats.bytes_original == pytest.approx((1 / 2 + 1 / 32) / 4)


def test_bf16_activations_take_about_a_quarter_of_the_bytes_and_grads_stay_close():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    model = model.to(torch.bfloat16)
    x = torch.randn(128, 512, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with mxfp4_activation_cache() as cache:
        loss = model(x).float().square().mean()
    loss.backward()
    # BF16 tensors shrink to (1/2 + 1/32) / 2 of their bytes, the float32 one before the loss to half that
    assert cache.stats.tensors_packed >= 3
    assert (1 / 2 + 1 / 32) / 4 < cache.stats.ratio <= (1 / 2 + 1 / 32) / 2
    for p, r in zip(model.parameters(), ref):
        rel = ((p.grad.float() - r.float()).norm() / r.float().norm()).item()
        assert 0 < rel < 0.2  # lossy (MXFP4) but close


def test_parameters_small_and_unaligned_tensors_are_kept():
    w = torch.randn(64, 64, requires_grad=True)
    odd = torch.randn(64, 48, requires_grad=True)
    with mxfp4_activation_cache(min_numel=1) as cache:
        xin = torch.randn(64, 64, requires_grad=True) * 1.0
        a = xin @ w  # saves xin (an activation: packed) and w (a parameter: kept)
        b = (odd * 2).sin()  # last dimension 48: kept
    (a.sum() + b.sum()).backward()
    assert torch.equal(odd.grad, 2 * (odd.detach() * 2).cos())
    assert cache.stats.tensors_kept == 2 and cache.stats.tensors_packed == 1
    assert torch.equal(w.grad, q(xin.detach()).t() @ torch.ones(64, 64))
    with pytest.raises(ValueError, match="min_numel"):
        mxfp4_activation_cache(min_numel=-1)
    with pytest.raises(ValueError, match="scale_rounding"):
        mxfp4_activation_cache(scale_rounding="nearest")


def test_unpack_in_chunks_gives_the_same_tensor(monkeypatch):
    import moe_fp4.moe.cache as C

    monkeypatch.setattr(C, "_UNPACK_CHUNK_ELEMENTS", 96)  # 3 rows of 32 per chunk, 7 rows: a partial chunk
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    cache = mxfp4_activation_cache(min_numel=1)
    assert torch.equal(cache._unpack(cache._pack(x)), q(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_pack_unpack_equals_the_spec_on_cpu(dtype):
    """On CUDA the cache packs with the native kernel: what backward gets back must be the spec's
    MXFP4 round trip computed on the CPU, bit for bit (3-D activations, wide magnitude range)."""
    t = torch.randn(3, 700, 2048) * torch.exp2(torch.randint(-12, 12, (3, 700, 1)).float())
    t[0, 5, :64] = 0.0
    t = t.to(dtype)
    cache = mxfp4_activation_cache()
    obj = cache._pack(t.cuda())
    back = cache._unpack(obj)
    assert back.device.type == "cuda" and back.dtype == dtype and back.shape == t.shape
    assert_bitwise_equal(back.cpu(), q(t), f"{dtype} round trip")
    assert cache.stats.tensors_packed == 1


@pytest.mark.gpu
def test_cuda_training_step_gradients_stay_close():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    model = model.cuda().bfloat16()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    ref = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad()
    with mxfp4_activation_cache() as cache:
        loss = model(x).float().square().mean()
    loss.backward()
    assert cache.stats.tensors_packed >= 2
    for p, g in zip(model.parameters(), ref):
        assert torch.isfinite(p.grad).all()
        assert ((p.grad.float() - g).norm() / g.norm()).item() < 0.2
