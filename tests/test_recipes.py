"""Dense-layer recipes: QuantLinear's fprop / dgrad / wgrad against references built from the spec.

Each reference quantizes every operand with the spec functions of moe_fp4.formats directly (along
the operand's own reduction axis, from the high-precision tensor), dequantizes, and multiplies in
float32; QuantLinear must give the same bits.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_bitwise_equal

import moe_fp4
import moe_fp4.formats as S
from moe_fp4.recipes import (
    FP8BlockwiseRecipe,
    MXFP4Recipe,
    MXFP8Recipe,
    NVFP4Recipe,
    QuantLinear,
    apply_rht,
    autocast,
    convert_linears,
    set_recipe,
)


def mm(a, b):
    """The float32 product used by both sides (same layouts, so the same BLAS path)."""
    return torch.matmul(a.contiguous(), b.contiguous())


def pad_tokens(t, block):
    """Zero-pad the last (token) axis of a wgrad operand to a multiple of ``block``."""
    return F.pad(t, (0, -t.shape[-1] % block))


def spread(*shape):
    """Random values whose magnitudes spread over many binades (rows and 16-wide groups differ)."""
    base = torch.randn(*shape)
    mag = torch.exp2(torch.randint(-6, 7, (*shape[:-1], shape[-1] // 16, 1)).float())
    return base * mag.repeat_interleave(16, -1).reshape(shape)


# ------------------------------------------------------------------------------------------------
# references, one per recipe: (fprop(x, w), dgrad(g, w, gen), wgrad(g, x, gen)) with x [M, K],
# w [N, K], g [M, N]; gen is the stochastic-rounding generator (consumed dgrad first, then wgrad)
# ------------------------------------------------------------------------------------------------


def ref_mxfp8(r: MXFP8Recipe):
    def q(t, fmt, axis):
        data, s = S.quantize_mxfp8(t, fmt=fmt, scale_rounding=r.scale_rounding, axis=axis)
        return S.dequantize_mxfp8(data, s, axis=axis)

    def fprop(x, w):
        return mm(q(x, r.fmt, -1), q(w, r.fmt, -1).t())

    def dgrad(g, w, gen):
        return mm(q(g, r.grad_fmt, -1), q(w, r.fmt, 0))

    def wgrad(g, x, gen):
        return mm(q(pad_tokens(g.t(), 32), r.grad_fmt, -1),
                  q(pad_tokens(x.t(), 32), r.fmt, -1).t())

    return fprop, dgrad, wgrad


def ref_nvfp4(r: NVFP4Recipe):
    def q(t, *, block_2d=False, sr=False, gen=None):
        p, s, gs = S.quantize_nvfp4(t, block_2d=block_2d, rounding="stochastic" if sr else "nearest",
                                    generator=gen)
        return S.dequantize_nvfp4(p, s, gs)

    rht = apply_rht if r.wgrad_rht else (lambda t: t)
    sr = r.stochastic_rounding

    def fprop(x, w):
        return mm(q(x), q(w, block_2d=r.weight_2d).t())

    def dgrad(g, w, gen):
        return mm(q(g, sr=sr, gen=gen), q(w.t(), block_2d=r.weight_2d).t())

    def wgrad(g, x, gen):
        return mm(q(rht(pad_tokens(g.t(), 16)), sr=sr, gen=gen),
                  q(rht(pad_tokens(x.t(), 16))).t())

    return fprop, dgrad, wgrad


def ref_mxfp4(r: MXFP4Recipe):
    def q(t, *, sr=False, gen=None):
        p, s = S.quantize_mxfp4(t, scale_rounding=r.scale_rounding, rounding="stochastic" if sr else "nearest",
                                generator=gen)
        return S.dequantize_mxfp4(p, s)

    rht = apply_rht if r.wgrad_rht else (lambda t: t)
    sr = r.stochastic_rounding

    def fprop(x, w):
        return mm(q(x), q(w).t())

    def dgrad(g, w, gen):
        return mm(q(g, sr=sr, gen=gen), q(w.t()).t())

    def wgrad(g, x, gen):
        return mm(q(rht(pad_tokens(g.t(), 32)), sr=sr, gen=gen), q(rht(pad_tokens(x.t(), 32))).t())

    return fprop, dgrad, wgrad


def ref_fp8_blockwise(r: FP8BlockwiseRecipe):
    def q(t, block):
        data, s = S.quantize_fp8_blockwise(t, block=block)
        return S.dequantize_fp8_blockwise(data, s, block=block)

    row, tile = (1, 128), (128, 128)

    def fprop(x, w):
        return mm(q(x, row), q(w, tile).t())

    def dgrad(g, w, gen):
        return mm(q(g, row), q(w.t(), tile).t())

    def wgrad(g, x, gen):
        return mm(q(pad_tokens(g.t(), 128), row), q(pad_tokens(x.t(), 128), row).t())

    return fprop, dgrad, wgrad


CASES = [
    (MXFP8Recipe(), ref_mxfp8),
    (MXFP8Recipe(scale_rounding="down", grad_fmt="e5m2"), ref_mxfp8),
    (NVFP4Recipe(), ref_nvfp4),
    (NVFP4Recipe(weight_2d=False, wgrad_rht=False, stochastic_rounding=False), ref_nvfp4),
    (MXFP4Recipe(), ref_mxfp4),
    (MXFP4Recipe(scale_rounding="down", wgrad_rht=False, stochastic_rounding=False), ref_mxfp4),
    (FP8BlockwiseRecipe(backend="emulate"), ref_fp8_blockwise),
]


@pytest.mark.parametrize("recipe,make_ref", CASES, ids=[repr(c[0]).split("(")[0] + str(i) for i, c in enumerate(CASES)])
def test_quantlinear_matches_spec_reference_bitwise(recipe, make_ref):
    # 2 x 40 = 80 tokens: not a multiple of 32 or 128, so wgrad's token padding is exercised.
    k, n = 256, 128
    layer = QuantLinear(k, n, bias=True, recipe=recipe, sr_index=3)
    with torch.no_grad():
        layer.weight.copy_(spread(n, k) * 0.05)
    x = spread(2, 40, k).requires_grad_(True)
    g = spread(2, 40, n)
    y = layer(x)
    gen_state = layer.generator(recipe, x.device).get_state() if recipe.uses_generator() else None
    y.backward(g)

    fprop, dgrad, wgrad = make_ref(recipe)
    x2, g2, w = x.detach().reshape(-1, k), g.reshape(-1, n), layer.weight.detach()
    gen = None
    if gen_state is not None:
        gen = torch.Generator()
        gen.set_state(gen_state)
    assert_bitwise_equal(y.detach(), (fprop(x2, w) + layer.bias.detach()).reshape(2, 40, n), "fprop")
    assert_bitwise_equal(x.grad, dgrad(g2, w, gen).reshape(2, 40, k), "dgrad")
    assert_bitwise_equal(layer.weight.grad, wgrad(g2, x2, gen), "wgrad")
    assert_bitwise_equal(layer.bias.grad, g2.sum(0), "bias grad")
    # quantization happened: the product is not the high-precision one
    assert not torch.equal(y.detach(), F.linear(x.detach(), w, layer.bias.detach()))


def test_nvfp4_2d_weight_is_one_copy_for_fprop_and_dgrad():
    w = spread(64, 96)
    for block_2d, same in ((True, True), (False, False)):
        r = NVFP4Recipe(weight_2d=block_2d)
        rowwise, _ = r.quantize_rows(w, role="weight", gemm="fprop")
        colwise, _ = r.quantize_rows(w.t(), role="weight", gemm="dgrad")
        assert torch.equal(rowwise, colwise.t()) == same


def test_columnwise_copies_are_quantized_from_the_high_precision_tensor():
    # Requantizing the rowwise copy along the other axis gives different values: the recipe must not.
    x = spread(64, 64)
    r = MXFP8Recipe()
    row, _ = r.quantize_rows(x, role="input", gemm="fprop")
    col, _ = r.quantize_rows(x.t(), role="input", gemm="wgrad")
    twice, _ = r.quantize_rows(row.t(), role="input", gemm="wgrad")
    data, s = S.quantize_mxfp8(x, axis=0)
    assert_bitwise_equal(col.t().contiguous(), S.dequantize_mxfp8(data, s, axis=0).contiguous(), "columnwise")
    assert not torch.equal(col, twice)


@pytest.mark.parametrize("make", [MXFP8Recipe, NVFP4Recipe, MXFP4Recipe])
def test_bfloat16_gemm_close_to_float32_gemm(make):
    x, w = spread(32, 128), spread(64, 128)
    r32, r16 = make(), make(gemm_dtype="bfloat16")
    y32 = r32.gemm_nt(x, w, gemm="fprop")
    y16 = r16.gemm_nt(x, w, gemm="fprop")
    # operands are exact in bfloat16 (tensor scales factored out): only the bfloat16 output (and the
    # CPU kernel's accumulation) differ, a few bfloat16 ulps of the largest output
    err = (y16 - y32).abs().max() / y32.abs().max()
    assert float(err) <= 2.0 ** -7, float(err)


def test_nvfp4_split_tensor_scale_matches_dequantized():
    t = spread(16, 64)
    r = NVFP4Recipe()
    full, none = r.quantize_rows(t, role="input", gemm="fprop")
    vals, gs = r.quantize_rows(t, role="input", gemm="fprop", split_tensor_scale=True)
    assert none is None and gs.dtype == torch.float32 and gs.dim() == 0
    torch.testing.assert_close(vals * gs, full, rtol=2.0 ** -22, atol=0)
    assert torch.equal(vals.to(torch.bfloat16).to(torch.float32), vals)  # exact in bfloat16


# ------------------------------------------------------------------------------------------------
# random Hadamard transform
# ------------------------------------------------------------------------------------------------


def test_rht_is_orthogonal_fixed_and_cancels_in_the_product():
    from moe_fp4.recipes import hadamard_matrix, random_hadamard_matrix

    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))
    q = random_hadamard_matrix(dtype=torch.float64)
    assert torch.equal(q.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    torch.testing.assert_close(q @ q.t(), torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-15)
    assert not torch.equal(q, h.to(torch.float64) / 4)  # the signs are random, not all +1
    a, b = torch.randn(24, 64, dtype=torch.float64), torch.randn(40, 64, dtype=torch.float64)
    ta, tb = apply_rht(a), apply_rht(b)
    assert not torch.allclose(ta, a)
    torch.testing.assert_close(ta @ tb.t(), a @ b.t(), rtol=1e-12, atol=1e-12)
    assert torch.equal(apply_rht(a), ta)  # one fixed seed: the same transform every call
    torch.testing.assert_close(ta.norm(dim=-1), a.norm(dim=-1), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="x"):
        apply_rht(torch.randn(4, 20))


def test_rht_spreads_a_block_outlier():
    x = torch.zeros(1, 16)
    x[0, 5] = 8.0
    y = apply_rht(x)
    assert torch.equal(y.abs(), torch.full((1, 16), 2.0))


# ------------------------------------------------------------------------------------------------
# stochastic rounding of gradients
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [NVFP4Recipe, MXFP4Recipe])
def test_gradient_stochastic_rounding_is_unbiased(make):
    """T identical rows quantized at once are T independent draws per element. A stochastic
    rounding between neighbours lo < x < hi has variance <= (hi - lo)^2 / 4, and E2M1's gap is at
    most 2 scale units, so the mean of T draws lies within z * unit / sqrt(T) of x (z = 6)."""
    t_rows, z = 4096, 6.0
    r = make()
    row = torch.randn(1, 64)
    row[0, ::16] = 3.0 * row.abs().max()  # pin every block's maximum: all other elements stay below 6 units
    g = row.repeat(t_rows, 1)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    draws, _ = r.quantize_rows(g, role="grad", gemm="dgrad", generator=gen)
    nearest, _ = r.quantize_rows(g, role="input", gemm="fprop")
    if make is NVFP4Recipe:
        _, scales, gs = S.quantize_nvfp4(row)
        unit = (S.decode_elements(scales.view(torch.uint8), S.E4M3) * gs).repeat_interleave(16, -1)
    else:
        _, scales = S.quantize_mxfp4(row)
        unit = S.decode_ue8m0(scales).repeat_interleave(32, -1)
    inner = torch.ones(64, dtype=torch.bool)
    inner[::16] = False  # the pinned maxima sit at the saturation edge
    tol = z * unit[0] / t_rows ** 0.5
    dev = (draws.mean(0) - row[0]).abs()
    assert bool((dev[inner] <= tol[inner]).all()), float((dev / tol)[inner].max())
    # the draws take more than one value, and round-to-nearest fails the same test (it is biased)
    assert bool((draws.std(0)[inner] > 0).any())
    assert bool(((nearest.mean(0) - row[0]).abs()[inner] > tol[inner]).any())


def test_stochastic_rounding_is_reproducible_from_the_layer_seed():
    r = NVFP4Recipe(seed=7)
    grads = []
    for _ in range(2):
        layer = QuantLinear(64, 32, bias=False, recipe=r, sr_index=1)
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(-1, 1, 64 * 32).reshape(32, 64))
        x = torch.linspace(-2, 2, 48 * 64).reshape(48, 64).requires_grad_(True)
        layer(x).pow(2).sum().backward()
        grads.append((x.grad, layer.weight.grad))
    assert_bitwise_equal(grads[0][0], grads[1][0], "dgrad")
    assert_bitwise_equal(grads[0][1], grads[1][1], "wgrad")
    other = QuantLinear(64, 32, bias=False, recipe=r, sr_index=2)  # another layer: other random bits
    with torch.no_grad():
        other.weight.copy_(torch.linspace(-1, 1, 64 * 32).reshape(32, 64))
    x = torch.linspace(-2, 2, 48 * 64).reshape(48, 64).requires_grad_(True)
    other(x).pow(2).sum().backward()
    assert not torch.equal(x.grad, grads[0][0])


# ------------------------------------------------------------------------------------------------
# models: convert_linears, kept BF16 layers, autocast, gradient flow
# ------------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=64, d=128, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def test_convert_linears_keeps_last_blocks_and_head_untouched_and_gradients_flow():
    torch.manual_seed(torch.seed() % 2**31)
    model = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(model.state_dict())
    kept_before = {n: m for n, m in model.named_modules() if n.startswith("blocks.2.") or n == "lm_head"}
    params_before = {n: p for n, p in model.named_parameters()}
    report = convert_linears(model, NVFP4Recipe())  # default: the last block stays BF16
    assert report.kept_bf16 == ["blocks.2.qkv", "blocks.2.proj", "blocks.2.fc1", "blocks.2.fc2"]
    assert report.high_precision == ["lm_head"]
    assert len(report.quantized) == 8 and not report.incompatible
    for n, m in model.named_modules():
        if n in kept_before:
            assert m is kept_before[n] and type(m) is type(kept_before[n])
        elif n.startswith(("blocks.0.", "blocks.1.")) and n.rsplit(".", 1)[-1] in ("qkv", "proj", "fc1", "fc2"):
            assert isinstance(m, QuantLinear)
    for n, p in model.named_parameters():
        assert p is params_before[n]  # Parameters shared: an existing optimizer keeps working

    tokens = torch.randint(0, 64, (2, 32))
    h = torch.randn(2, 32, 128)
    for name in ("blocks.2.qkv", "blocks.2.fc2", "lm_head"):
        kept, ref = model.get_submodule(name), reference.get_submodule(name)
        hin = h if ref.in_features == 128 else torch.randn(2, 32, ref.in_features)
        assert_bitwise_equal(kept(hin), ref(hin), name)
    logits = model(tokens)
    assert not torch.equal(logits, reference(tokens))
    F.cross_entropy(logits.reshape(-1, 64), tokens.reshape(-1)).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), n
        assert bool(p.grad.abs().sum() > 0), n


def test_convert_linears_keep_patterns_and_counts():
    model = TinyLM()
    rep = convert_linears(model, MXFP8Recipe(), keep_bf16=["blocks.0", "*.fc2"])
    assert set(rep.kept_bf16) == {"blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2",
                                  "blocks.1.fc2", "blocks.2.fc2"}
    model2 = TinyLM()
    rep2 = convert_linears(model2, MXFP8Recipe(), keep_bf16=2)
    assert len(rep2.quantized) == 4 and len(rep2.kept_bf16) == 8
    rep3 = convert_linears(TinyLM(), MXFP8Recipe(), keep_bf16=0)
    assert len(rep3.quantized) == 12
    rep4 = convert_linears(TinyLM(d=48), FP8BlockwiseRecipe())  # 48 is not a multiple of 128
    assert len(rep4.incompatible) == 12 and not rep4.quantized
    with pytest.raises(ValueError, match="keep_bf16"):
        convert_linears(TinyLM(), MXFP8Recipe(), keep_bf16=-1)
    with pytest.raises(ValueError, match="recipe"):
        convert_linears(TinyLM(), "mxfp8")


def test_autocast_selects_the_recipe_and_can_disable_it():
    layer = QuantLinear(64, 64, recipe=None)
    x = spread(32, 64)
    plain = F.linear(x, layer.weight, layer.bias)
    assert_bitwise_equal(layer(x), plain, "no recipe: high precision")
    fprop, _, _ = ref_mxfp8(MXFP8Recipe())
    with moe_fp4.autocast(MXFP8Recipe()):
        assert_bitwise_equal(layer(x), fprop(x, layer.weight.detach()) + layer.bias.detach(), "autocast recipe")
        with autocast(enabled=False):
            assert_bitwise_equal(layer(x), plain, "nested autocast(enabled=False)")
    layer.recipe = NVFP4Recipe()
    with autocast(None):
        assert_bitwise_equal(layer(x), plain, "autocast(None)")
    assert not torch.equal(layer(x), plain)
    with pytest.raises(ValueError, match="recipe"):
        with autocast("nvfp4"):
            pass


def test_bf16_forward_switch_keeps_backward_quantized():
    r = MXFP8Recipe()
    model = TinyLM(layers=2)
    convert_linears(model, r, keep_bf16=0)
    assert set_recipe(model, dataclasses.replace(r, bf16_forward=True)) == 8
    layer = model.blocks[0].fc1
    x = spread(16, 128).requires_grad_(True)
    y = layer(x)
    expect = torch.matmul(x.detach().to(torch.bfloat16), layer.weight.detach().t().to(torch.bfloat16)).float()
    assert_bitwise_equal(y.detach(), expect + layer.bias.detach(), "bf16 forward")
    g = spread(16, 256)
    y.backward(g)
    _, dgrad, _ = ref_mxfp8(r)
    assert_bitwise_equal(x.grad, dgrad(g, layer.weight.detach(), None), "dgrad stays MXFP8")


def test_autocast_dtype_is_honoured():
    layer = QuantLinear(64, 32, recipe=MXFP8Recipe(gemm_dtype="bfloat16"))
    x = spread(16, 64).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,field,value", [
    (MXFP8Recipe, "scale_rounding", "ceil"),
    (MXFP8Recipe, "fmt", "e3m4"),
    (MXFP8Recipe, "grad_fmt", "e2m1"),
    (MXFP8Recipe, "gemm_dtype", "float16"),
    (NVFP4Recipe, "weight_2d", 1),
    (NVFP4Recipe, "wgrad_rht", "yes"),
    (NVFP4Recipe, "stochastic_rounding", None),
    (NVFP4Recipe, "bf16_last_blocks", -1),
    (NVFP4Recipe, "bf16_forward", 0),
    (MXFP4Recipe, "scale_rounding", "nearest"),
    (MXFP4Recipe, "seed", 1.5),
    (FP8BlockwiseRecipe, "backend", "cutlass"),
    (MXFP4Recipe, "quantizer", "inductor"),
])
def test_bad_recipe_field_raises_naming_it(make, field, value):
    with pytest.raises(ValueError, match=rf"{make.__name__}\.{field}"):
        make(**{field: value})


def test_quantlinear_bad_shapes_raise():
    with pytest.raises(ValueError, match="in_features"):
        QuantLinear(48, 32, recipe=MXFP8Recipe())(torch.randn(4, 48))
    with pytest.raises(ValueError, match="out_features"):
        QuantLinear(128, 64, recipe=FP8BlockwiseRecipe())(torch.randn(4, 128))
    with pytest.raises(ValueError, match="x"):
        QuantLinear(64, 64, recipe=MXFP8Recipe())(torch.randn(4, 32))
    with pytest.raises(ValueError, match="recipe"):
        QuantLinear(64, 64, recipe="nvfp4")
    with pytest.raises(ValueError, match="backend"):
        FP8BlockwiseRecipe(backend="scaled_mm").gemm_nt(torch.randn(4, 128), torch.randn(128, 128), gemm="fprop")


def test_recipe_defaults_are_the_published_ones():
    m = MXFP8Recipe()
    assert (m.fmt, m.grad_fmt, m.scale_rounding, m.block) == ("e4m3", "e4m3", "up", 32)
    n = NVFP4Recipe()
    assert (n.weight_2d, n.wgrad_rht, n.stochastic_rounding, n.bf16_last_blocks, n.block) == (True, True, True, 1, 16)
    f = FP8BlockwiseRecipe()
    assert f.block == 128 and f.operand_block("weight") == (128, 128) and f.operand_block("grad") == (1, 128)
    assert moe_fp4.autocast is autocast


# ------------------------------------------------------------------------------------------------
# the blockwise FP8 GEMM call: scale layouts and the first-use check, against a stand-in for cuBLAS
# ------------------------------------------------------------------------------------------------


def _cublas_like_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """Reads the scales the way cuBLAS does on sm_90: A's 1x128 scales outer-dim-major, B's 1x128
    scales [L/128, C] row-major, B's 128x128 scales from memory as [C/128, L/128] rows whose
    leading dimension is L/128 rounded up to a multiple of 4 (so only L/128 % 4 == 0 reads right)."""
    r, length = a.shape
    c = b.shape[1]
    kb = length // 128
    assert scale_a.shape == (r, kb) and scale_a.stride() == (1, r)
    sa = scale_a
    if tuple(scale_b.shape) == (kb, c):
        sb = scale_b.t()  # [C, kb]
    else:
        # torch 2.11 accepts only the plain transposed view; cuBLAS then reads rows of round_up(kb, 4)
        assert tuple(scale_b.shape) == (kb, c // 128) and scale_b.stride() == (1, kb)
        ld = -(-kb // 4) * 4
        tiles = torch.as_strided(scale_b, (c // 128, kb), (ld, 1))
        sb = tiles.repeat_interleave(128, 0)
    xa = a.float() * sa.repeat_interleave(128, 1)
    xb = b.t().float() * sb.repeat_interleave(128, 1)
    return torch.matmul(xa, xb.t()).to(out_dtype)


@pytest.mark.parametrize("m, n", [(200, 328), (72, 136), (256, 384)])
@pytest.mark.parametrize("k_blocks", [4, 5, 6, 7])
def test_fp8_blockwise_scaled_mm_pads_unaligned_operands(monkeypatch, m, n, k_blocks):
    """Against the stand-in for cuBLAS: every K/128 % 4 and row counts that are not multiples of
    128 give dequantize-then-matmul (to the BF16 output rounding), in both scale layouts."""
    from moe_fp4.recipes import fp8_blockwise_scaled_mm

    monkeypatch.setattr(torch, "_scaled_mm", _cublas_like_scaled_mm)
    k = 128 * k_blocks
    a, b = spread(m, k), spread(-(-n // 128) * 128, k)
    da, sa = S.quantize_fp8_blockwise(a, block=(1, 128))
    ref_a = S.dequantize_fp8_blockwise(da, sa, block=(1, 128))
    for block in ((1, 128), (128, 128)):
        db, sb = S.quantize_fp8_blockwise(b, block=block)
        ref = mm(ref_a, S.dequantize_fp8_blockwise(db, sb, block=block)[:n].t())
        out = fp8_blockwise_scaled_mm(da, sa, (1, 128), db[:n], sb if block == (128, 128) else sb[:n], block)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2.0 ** -8, atol=1e-6 * float(ref.abs().max()))


def test_fp8_blockwise_scaled_mm_bad_arguments_raise():
    from moe_fp4.recipes import fp8_blockwise_scaled_mm

    a, sa = S.quantize_fp8_blockwise(spread(64, 256), block=(1, 128))
    b, sb = S.quantize_fp8_blockwise(spread(128, 256), block=(128, 128))
    with pytest.raises(ValueError, match="block_a"):
        fp8_blockwise_scaled_mm(a, sa, (128, 128), b, sb, (128, 128))
    with pytest.raises(ValueError, match="block_b"):
        fp8_blockwise_scaled_mm(a, sa, (1, 128), b, sb, (1, 32))
    with pytest.raises(ValueError, match="scales_b"):
        fp8_blockwise_scaled_mm(a, sa, (1, 128), b, sb, (1, 128))
    with pytest.raises(ValueError, match="data_a"):
        fp8_blockwise_scaled_mm(a.float(), sa, (1, 128), b, sb, (128, 128))
    with pytest.raises(ValueError, match="scales_a"):
        fp8_blockwise_scaled_mm(a, sa[:, :1], (1, 128), b, sb, (128, 128))
    with pytest.raises(ValueError, match="data_b"):
        fp8_blockwise_scaled_mm(a, sa, (1, 128), b[:, :128], sb[:, :1], (128, 128))


@pytest.mark.parametrize("length", [256, 640, 1024])
def test_blockwise_scaled_mm_layouts_and_first_use_check(monkeypatch, length):
    from moe_fp4.recipes import recipes as R

    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", _cublas_like_scaled_mm)
    a, b = spread(200, length), spread(256, length)
    emu = FP8BlockwiseRecipe(backend="emulate")
    for gemm in ("fprop", "wgrad"):
        out = R._try_scaled_mm_nt(a, b, gemm, strict=True)
        ref = emu.gemm_nt(a, b, gemm=gemm)
        assert out is not None and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2.0 ** -7, atol=1e-6 * float(ref.abs().max()))
    assert all(v is True for v in R.scaled_mm_status().values()) and len(R.scaled_mm_status()) == 2

    # a GEMM whose first product is wrong is caught by the first-use check, then left alone
    monkeypatch.setattr(R, "_SCALED_MM_STATE", {})
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, out_dtype: (
        _cublas_like_scaled_mm(a, b, scale_a, scale_b, out_dtype) * 1.5))
    with pytest.warns(UserWarning, match="wrong product"):
        assert R._try_scaled_mm_nt(a, b, "fprop", strict=False) is None
    assert "wrong product" in next(iter(R.scaled_mm_status().values()))
    assert R._try_scaled_mm_nt(a, b, "fprop", strict=False) is None  # remembered: emulation from now on
    with pytest.raises(RuntimeError, match="wrong product"):
        R._try_scaled_mm_nt(a, b, "fprop", strict=True)


# ------------------------------------------------------------------------------------------------
# compiled quantizers: the dispatch and its first-use check (the compiled code itself runs on GPUs,
# tests/test_recipes_gpu.py; compiling on this CPU would take minutes)
# ------------------------------------------------------------------------------------------------


def test_quantizer_choice_follows_the_device():
    from moe_fp4.recipes.compiled import qdq_mxfp8, qdq_nvfp4, use_compiled

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_compiled("auto", cuda, qdq_mxfp8) and not use_compiled("auto", cpu, qdq_mxfp8)
    assert use_compiled("auto", cuda, qdq_nvfp4) and not use_compiled("auto", cpu, qdq_nvfp4)
    assert use_compiled("compiled", cpu, qdq_nvfp4) and not use_compiled("eager", cuda, qdq_mxfp8)
    assert MXFP8Recipe().quantizer == "auto"


def _fake_compiled(monkeypatch, fake):
    import moe_fp4.recipes.compiled as C

    C.reset_compiled_state()
    monkeypatch.setattr(C, "_compiled", lambda fn: (lambda *a: fake(fn, *a)))
    return C


def test_compiled_quantizer_runs_after_its_first_use_matches(monkeypatch):
    calls = []

    def fake(fn, *a):  # a faithful "compiled" function that counts its calls
        calls.append(fn.__name__)
        return fn(*a)

    C = _fake_compiled(monkeypatch, fake)
    r = NVFP4Recipe(quantizer="compiled")
    g = spread(64, 96)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    first, _ = r.quantize_rows(g, role="grad", gemm="dgrad", generator=gen_a)
    second, _ = r.quantize_rows(g, role="grad", gemm="dgrad", generator=gen_a)
    want1, _ = NVFP4Recipe(quantizer="eager").quantize_rows(g, role="grad", gemm="dgrad", generator=gen_b)
    want2, _ = NVFP4Recipe(quantizer="eager").quantize_rows(g, role="grad", gemm="dgrad", generator=gen_b)
    assert_bitwise_equal(first, want1, "first use")
    assert_bitwise_equal(second, want2, "second use: the generator moved on as in the eager spec")
    assert torch.equal(gen_a.get_state(), gen_b.get_state())
    assert calls == ["qdq_nvfp4", "qdq_nvfp4"]
    assert list(C.compiled_status().values()) == [True]
    r.quantize_rows(spread(32, 96), role="grad", gemm="dgrad", generator=gen_a)  # a new shape is checked again
    assert len(C._CHECKED) == 2


def test_compiled_quantizer_is_rechecked_periodically(monkeypatch):
    """A difference that shows only on later data is caught by the periodic recheck."""
    state = {"calls": 0}

    def fake(fn, t, gen, *a):  # right for the first 3 calls, then wrong
        state["calls"] += 1
        out, s = fn(t, gen, *a)
        return (out if state["calls"] <= 3 else out * 2), s

    C = _fake_compiled(monkeypatch, fake)
    monkeypatch.setattr(C, "RECHECK_EVERY", 4)
    r = MXFP8Recipe(quantizer="compiled")
    x = spread(32, 64)
    want, _ = MXFP8Recipe(quantizer="eager").quantize_rows(x, role="input", gemm="fprop")
    for _ in range(3):  # call 1 checked, calls 2-3 compiled alone
        assert_bitwise_equal(r.quantize_rows(x, role="input", gemm="fprop")[0], want, "right")
    with pytest.warns(UserWarning, match="differs"):  # call 4 is rechecked: its compiled result is wrong
        got, _ = r.quantize_rows(x, role="input", gemm="fprop")
    assert_bitwise_equal(got, want, "recheck returns the eager result")
    assert isinstance(next(iter(C.compiled_status().values())), str)


@pytest.mark.parametrize("failure", ["wrong bits", "raises", "extra random bits"])
def test_compiled_quantizer_falls_back_to_the_eager_spec(monkeypatch, failure):
    def fake(fn, t, gen, *a):
        if failure == "raises":
            if gen is not None:
                torch.randint(0, 2, (5,), generator=gen)  # draws, then fails: the state is restored
            raise RuntimeError("inductor failed")
        if failure == "extra random bits":
            torch.randint(0, 2, (5,), generator=gen)
        out, s = fn(t, gen, *a)
        return (out * 2 if failure == "wrong bits" else out), s

    C = _fake_compiled(monkeypatch, fake)
    r = MXFP4Recipe(quantizer="compiled")
    g = spread(32, 64)
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    with pytest.warns(UserWarning, match="eager spec runs instead"):
        got, _ = r.quantize_rows(g, role="grad", gemm="dgrad", generator=gen_a)
    want, _ = MXFP4Recipe(quantizer="eager").quantize_rows(g, role="grad", gemm="dgrad", generator=gen_b)
    assert_bitwise_equal(got, want, failure)
    assert torch.equal(gen_a.get_state(), gen_b.get_state())
    (reason,) = C.compiled_status().values()
    assert isinstance(reason, str) and reason
    again, _ = r.quantize_rows(g, role="grad", gemm="dgrad", generator=gen_a)  # eager from now on, no warning
    want, _ = MXFP4Recipe(quantizer="eager").quantize_rows(g, role="grad", gemm="dgrad", generator=gen_b)
    assert_bitwise_equal(again, want, failure + " (second call)")


@pytest.mark.parametrize("fn_args", ["mxfp8", "mxfp4", "nvfp4", "nvfp4_2d", "fp8"])
def test_compiled_nearest_quantizers_trace_to_one_graph(fn_args):
    # The spec's value checks (host reads) are skipped while tracing, so a quantize -> dequantize
    # with nearest rounding is one graph: no host synchronisation inside an emulated operand.
    import moe_fp4.recipes.compiled as C

    fn, args = {"mxfp8": (C.qdq_mxfp8, ("e4m3", "up", torch.bfloat16)),
                "mxfp4": (C.qdq_mxfp4, ("down", "nearest", torch.bfloat16)),
                "nvfp4": (C.qdq_nvfp4, (False, "nearest", True, torch.bfloat16)),
                "nvfp4_2d": (C.qdq_nvfp4, (True, "nearest", False, torch.float32)),
                "fp8": (C.qdq_fp8_blockwise, ((128, 128), torch.bfloat16))}[fn_args]
    t = torch.randn(128, 256) * 3
    explained = torch._dynamo.explain(fn)(t, None, *args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_gemm_input_is_float32_except_bf16_on_the_real_fp8_path():
    # The real FP8 GEMM path (CUDA) takes BF16 operands as they are; every emulated path reads float32.
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    for rec in (MXFP8Recipe(), NVFP4Recipe(), MXFP4Recipe(), FP8BlockwiseRecipe(),
                FP8BlockwiseRecipe(backend="emulate")):
        got = rec.gemm_input(x)
        assert got.dtype == torch.float32 and torch.equal(got, x.float())
    assert FP8BlockwiseRecipe().gemm_input(x.float()).dtype == torch.float32
