"""moe_fp4.moe.Experts: forward and backward of the FP8 expert MLPs against a float64 autograd
reference, per save policy; invariants that hold bit for bit (the forward does not depend on the
policy; "recompute" equals "bf16" on FP8-exact inputs; given FP8/MXFP4 forms equal quantizing
inside); the FP8 weight copies remade only when a weight changes; the rows of a real dispatch;
bad arguments rejected by name."""

import pytest
import torch

from moe_fp4 import formats, ops
from moe_fp4.ep import Buffer
from moe_fp4.moe import SAVE_POLICIES, Experts

SEED = 3232
G, H, I = 3, 256, 128
LENS, OFFSETS, M = [100, 200, 0], [0, 128, 384], 512


def _splits():
    return torch.tensor(OFFSETS), torch.tensor(LENS)


def _module(save, dtype=torch.float32, seed=SEED):
    torch.manual_seed(seed)
    return Experts(G, H, I, save=save, dtype=dtype)


def _input(seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(M, H, generator=gen) * torch.exp2(torch.randint(-3, 3, (M, 1), generator=gen).float())


def _reference(x, w1, w2):
    """float64 autograd MLPs per expert (rows of no expert: zero)."""
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    rows = []
    for e, (o, c) in enumerate(zip(OFFSETS, LENS)):
        gate, up = (x[o:o + c] @ w1[e].t()).chunk(2, dim=-1)
        rows.append((o, c, (torch.nn.functional.silu(gate) * up) @ w2[e].t()))
    for o, c, v in rows:
        y = y.index_copy(0, torch.arange(o, o + c), v)
    return y


def _run(module, x, dy, **kw):
    xx = x.clone().requires_grad_()
    offs, lens = _splits()
    y = module(xx, offs, lens, **kw)
    y.backward(dy)
    return y.detach(), xx.grad, module.w1.grad.clone(), module.w2.grad.clone()


def _rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


# relative error bounds (Frobenius) against float64: FP8 E4M3 operands (3 mantissa bits) in every
# product; with "mxfp4" the backward also reads the expert input and the SwiGLU input through E2M1
# (1 mantissa bit)
BOUNDS = {"bf16": 0.1, "fp8": 0.1, "recompute": 0.1, "mxfp4": 0.25}


@pytest.mark.parametrize("save", SAVE_POLICIES)
def test_experts_match_float64_reference(save):
    module = _module(save)
    x = _input()
    dy = torch.randn(M, H, generator=torch.Generator().manual_seed(SEED + 1))
    y, dx, dw1, dw2 = _run(module, x, dy)
    assert y.dtype == torch.bfloat16 and dx.dtype == x.dtype and dw1.dtype == torch.float32

    xr = x.double().requires_grad_()
    w1 = module.w1.detach().double().requires_grad_()
    w2 = module.w2.detach().double().requires_grad_()
    yr = _reference(xr, w1, w2)
    yr.backward(dy.double())
    assert _rel(y, yr) < BOUNDS["fp8"]
    for name, got, want in (("dx", dx, xr.grad), ("dw1", dw1, w1.grad), ("dw2", dw2, w2.grad)):
        assert _rel(got, want) < BOUNDS[save], f"{save} {name}: {_rel(got, want)}"
    assert int(y[328:].count_nonzero()) == 0 and int(dx[328:].count_nonzero()) == 0  # rows of no expert
    assert int(dw1[2].count_nonzero()) == 0 and int(dw2[2].count_nonzero()) == 0  # the expert with no rows


def test_forward_does_not_depend_on_the_policy_and_recompute_equals_bf16():
    # an input on the FP8 1x128 grid: quantizing it again gives the same operands, so "recompute"
    # (y1 recomputed, x columns from the FP8 rows) must give the bits of "bf16" (both saved in BF16)
    x = formats.dequantize_fp8_blockwise(*formats.quantize_fp8_blockwise(_input(SEED + 2)))
    dy = torch.randn(M, H, generator=torch.Generator().manual_seed(SEED + 3))
    results = {save: _run(_module(save), x, dy) for save in SAVE_POLICIES}
    for save in SAVE_POLICIES:
        assert torch.equal(results[save][0], results["bf16"][0]), save
    for a, b in zip(results["recompute"], results["bf16"]):
        assert torch.equal(a, b)
    assert not torch.equal(results["mxfp4"][2], results["bf16"][2])  # the MXFP4-saved input is used


def test_given_fp8_and_mxfp4_forms_equal_quantizing_inside():
    x = _input(SEED + 4)
    dy = torch.randn(M, H, generator=torch.Generator().manual_seed(SEED + 5))
    plain = _run(_module("mxfp4"), x, dy)
    given = _run(_module("mxfp4"), x, dy, x_fp8=ops.quantize_fp8_blockwise(x), x_mxfp4=ops.quantize_mxfp4(x))
    for a, b in zip(plain, given):
        assert torch.equal(a, b)
    # the splits also given as host ints (the backward's FP8 columns of x from them): the same bits
    hosted = _run(_module("mxfp4"), x, dy, host_splits=(list(LENS), list(OFFSETS)))
    for a, b in zip(plain, hosted):
        assert torch.equal(a, b)
    # "fp8" keeps the columns of x when it quantizes x itself, and requantizes the given FP8 rows by
    # columns: the same bits for an x on the FP8 grid
    x = formats.dequantize_fp8_blockwise(*formats.quantize_fp8_blockwise(x))
    plain = _run(_module("fp8"), x, dy)
    given = _run(_module("fp8"), x, dy, x_fp8=ops.quantize_fp8_blockwise(x))
    for a, b in zip(plain, given):
        assert torch.equal(a, b)


def test_host_splits_reach_the_column_conversion(monkeypatch):
    """With host_splits the backward's column conversion takes new tensors made from them (int64 here,
    against int32 device splits), not the device splits."""
    import moe_fp4.moe.experts as experts_module

    seen = []
    convert = experts_module.ops.mxfp4_rows_to_fp8_cols

    def spy(packed, scales, split_lens, split_offsets):
        seen.append((split_lens.dtype, split_lens.tolist(), split_offsets.tolist()))
        return convert(packed, scales, split_lens, split_offsets)

    monkeypatch.setattr(experts_module.ops, "mxfp4_rows_to_fp8_cols", spy)
    x = _input(SEED + 8)
    offs, lens = (t.to(torch.int32) for t in _splits())
    for host in (None, (list(LENS), list(OFFSETS))):
        xx = x.clone().requires_grad_()
        _module("mxfp4")(xx, offs, lens, host_splits=host).square().sum().backward()
    assert seen == [(torch.int32, LENS, OFFSETS), (torch.int64, LENS, OFFSETS)]


def test_fp8_weights_remade_once_per_weight_change(monkeypatch):
    module = _module("fp8", dtype=torch.bfloat16)
    first = module.fp8_weights()
    assert module.fp8_weights() is first
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x = _input(SEED + 6).bfloat16()
    offs, lens = _splits()
    module(x, offs, lens).float().square().mean().backward()
    assert module.w1.grad.dtype == torch.bfloat16
    opt.step()
    import moe_fp4.moe.experts as experts_module

    held = []  # what the module still holds while the new tiles are made: nothing (one version at a time)
    make = experts_module._fp8_tiles
    monkeypatch.setattr(experts_module, "_fp8_tiles", lambda w: (held.append(module._fp8), make(w))[1])
    second = module.fp8_weights()
    assert held == [None, None]
    assert second is not first and not torch.equal(second[0].view(torch.uint8), first[0].view(torch.uint8))
    data, scales = formats.quantize_fp8_blockwise(module.w1.detach().reshape(G * 2 * I, H), block=(128, 128))
    assert torch.equal(second[0].reshape(-1, H).view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(second[1].reshape(-1, H // 128), scales)


def test_experts_on_dispatch_output():
    """The expert rows of a real dispatch (expert_alignment 128): FP8 rows and MXFP4 rows from the
    dispatch feed the module; the gradient of the rows flows back through the combine."""
    from moe_fp4.ep.autograd import combine_with_grad, dispatch_with_grad

    torch.manual_seed(SEED + 7)
    t, k = 64, 2
    buf = Buffer(G, payload="mxfp4")
    x = torch.randn(t, H, requires_grad=True)
    idx = torch.randn(t, G).topk(k, dim=1).indices
    weights = torch.rand(t, k)
    values, out = dispatch_with_grad(buf, x, idx, weights, expert_alignment=128)
    module = _module("mxfp4")
    packed, scales = formats.unpack_mxfp4_rows(out.rows, H)
    assert out.host_splits == (out.split_lens.tolist(), out.split_offsets.tolist())
    y = module(values, out.split_offsets, out.split_lens, x_fp8=out.to_fp8_blockwise(), x_mxfp4=(packed, scales),
               host_splits=out.host_splits)
    z = combine_with_grad(buf, y, out.handle)
    z.float().square().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and int(x.grad.count_nonzero()) > 0
    # the same MLP in float64 on the decoded rows
    xr = values.detach().double()
    w1, w2 = module.w1.detach().double(), module.w2.detach().double()
    ref = torch.zeros_like(xr[:, :H])
    for e, (o, c) in enumerate(zip(out.split_offsets.tolist(), out.split_lens.tolist())):
        gate, up = (xr[o:o + c] @ w1[e].t()).chunk(2, dim=-1)
        ref[o:o + c] = (torch.nn.functional.silu(gate) * up) @ w2[e].t()
    assert _rel(y.detach(), ref) < BOUNDS["fp8"]


def test_experts_bad_arguments():
    module = _module("fp8")
    x = _input()
    offs, lens = _splits()
    cases = [
        (lambda: Experts(G, 200, I), "hidden"),
        (lambda: Experts(G, H, I, save="fp4"), "save"),
        (lambda: Experts(G, H, I, dtype=torch.float16), "dtype"),
        (lambda: module(x[:, :128], offs, lens), "x"),
        (lambda: module(x.double(), offs, lens), "x"),
        (lambda: module(x, offs.float(), lens), "split_offsets"),
        (lambda: module(x, offs, lens[:2]), "split_lens"),
        (lambda: module(x, torch.tensor([0, 100, 384]), lens), "multiple of 128"),
        (lambda: module(x, offs, lens, x_fp8=ops.quantize_fp8_blockwise(x[:10])), "x_fp8"),
        (lambda: module(x, offs, lens, x_mxfp4=(x, x)), "x_mxfp4"),
        (lambda: module(x, offs, lens, host_splits=(LENS,)), "host_splits"),
        (lambda: module(x, offs, lens, host_splits=(LENS, [0.0, 128.0, 384.0])), "host_splits"),
        (lambda: module(x, offs, lens, host_splits=(LENS, [0, 128, 256])), "host_splits: expected the same"),
        (lambda: module(x, offs, lens, host_splits=(LENS, [0, True, 384])), r"host_splits: .*\[0, True, 384\]"),
    ]
    for call, word in cases:
        with pytest.raises(ValueError, match=word):
            call()
    with pytest.raises(ValueError, match="save"):
        module.save = "int8"


def test_swiglu_row_weights_gradients_match_autograd():
    """The SwiGLU with a weight per row (the routing weights applied inside the experts): forward
    and both gradients against float64 autograd of the same formula."""
    from moe_fp4.moe import _triton_swiglu as sw

    gen = torch.Generator().manual_seed(SEED + 9)
    m, inter = 40, 256
    y1 = torch.randn(m, 2 * inter, generator=gen).to(torch.bfloat16)
    w = torch.rand(m, generator=gen)
    w[::7] = 0.0  # (rows of no slot weigh 0)
    dh = torch.randn(m, inter, generator=gen).to(torch.bfloat16)
    y64, w64 = y1.double().requires_grad_(), w.double().requires_grad_()
    gate, up = y64.chunk(2, dim=-1)
    h64 = torch.nn.functional.silu(gate) * up * w64.unsqueeze(1)
    h64.backward(dh.double())
    h = sw.swiglu(y1, w)
    dy1, dw = sw.swiglu_backward(dh, y1, w)
    assert _rel(h, h64) < 2 ** -7 and _rel(dy1, y64.grad) < 2 ** -7
    assert dw.dtype == torch.float32 and _rel(dw, w64.grad) < 2 ** -10
    dy1_plain, none = sw.swiglu_backward(dh, y1)
    assert none is None and torch.equal(sw.swiglu_backward(dh, y1, torch.ones(m))[0], dy1_plain)
