"""The real FP8 path of ``FP8BlockwiseRecipe`` in ``QuantLinear``, each tensor read once per pass.

``QuantLinearFunction`` quantizes every GEMM operand from its high-precision tensor when the GEMM
runs: x twice (rows for fprop, x^T for wgrad), W twice (fprop, dgrad), dy twice, with a transposed
copy in high precision before each wgrad operand. ``FP8LinearFunction`` quantizes the same operands,
to the same bits, in three one-pass native kernels:

  forward   x  -> x's 1x128 rows and x^T's 1x128 rows (along the tokens)   ops.quantize_fp8_rows_cols
            W  -> W's 128x128 tiles and their transpose (W^T's tiles)       ops.quantize_fp8_tiles
            y  = x_q W_q^T                                                  torch._scaled_mm
  backward  dy -> dy's rows and dy^T's rows                                 ops.quantize_fp8_rows_cols
            dx = dy_q (W^T)_q^T,  dW = (dy^T)_q (x^T)_q^T                    torch._scaled_mm

Saved for backward: the FP8 copies x^T and W^T with their scales (about 1.03 bytes per element of
x, where the generic path keeps x itself), not x or W. A copy that no gradient needs is not made
(x^T when W needs no gradient; W^T when x needs none; neither without autograd).

The GEMMs, their first-use check against the emulation and the fallback to the emulation for a
layout torch._scaled_mm refuses are the generic path's (``recipes.scaled_mm_checked``), so the
results equal ``QuantLinearFunction``'s bit for bit. ``QuantLinear`` takes this path when
``applies`` says so: an FP8BlockwiseRecipe whose GEMMs are real (``uses_scaled_mm``), not
``bf16_forward``, ``quantizer`` not "eager", bfloat16 or float32 input and weight on a CUDA device
where the native ops are built.
"""

from __future__ import annotations

import torch

from moe_fp4.formats import dequantize_fp8_blockwise
from moe_fp4.recipes.recipes import FP8_BLOCK, GEMM_DTYPES, FP8BlockwiseRecipe, emulated_matmul, scaled_mm_checked

_ROWS = (1, FP8_BLOCK)
_TILES = (FP8_BLOCK, FP8_BLOCK)
_FLOATS = (torch.bfloat16, torch.float32)


def applies(recipe, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``QuantLinear`` runs ``recipe`` on (x, weight) through ``FP8LinearFunction``."""
    if not isinstance(recipe, FP8BlockwiseRecipe) or recipe.bf16_forward or recipe.quantizer == "eager":
        return False
    if not x.is_cuda or x.dtype not in _FLOATS or weight.dtype not in _FLOATS or weight.device != x.device:
        return False
    if not recipe.uses_scaled_mm(x.device):
        return False
    from moe_fp4 import ops

    return ops.native_available()


def _gemm(recipe: FP8BlockwiseRecipe, gemm: str, da, sa, block_a, db, sb, block_b, out_dtype) -> torch.Tensor:
    """``A @ B^T`` of quantized operands: torch._scaled_mm, or the emulation where it fails."""
    out = scaled_mm_checked(da, sa, block_a, db, sb, block_b, gemm, strict=recipe.backend == "scaled_mm")
    if out is not None:
        return out.to(out_dtype)
    dt = GEMM_DTYPES[recipe.gemm_dtype]
    aq = dequantize_fp8_blockwise(da, sa, block=block_a, dtype=dt)
    bq = dequantize_fp8_blockwise(db, sb, block=block_b, dtype=dt)
    return emulated_matmul(aq, None, bq, None, recipe.gemm_dtype, out_dtype)


class FP8LinearFunction(torch.autograd.Function):
    """Autograd of ``y = x W^T`` with FP8BlockwiseRecipe's real FP8 GEMMs (see the module docstring).

    x: bfloat16/float32 [..., K]; weight: bfloat16/float32 [N, K] (N, K multiples of 128);
    recipe: an FP8BlockwiseRecipe; out_dtype: dtype of y; x_grad, w_grad: whether backward will be
    asked for dx / dW (which transposed copies to make). Returns y ``out_dtype`` [..., N].
    """

    @staticmethod
    def forward(ctx, x, weight, recipe: FP8BlockwiseRecipe, out_dtype, x_grad: bool, w_grad: bool):
        with torch.autocast(device_type=x.device.type, enabled=False):  # the recipe fixes every dtype
            return FP8LinearFunction._forward(ctx, x, weight, recipe, out_dtype, x_grad, w_grad)

    @staticmethod
    def _forward(ctx, x, weight, recipe, out_dtype, x_grad, w_grad):
        from moe_fp4 import ops

        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if w_grad:
            dx_, sx, dxt, sxt = ops.quantize_fp8_rows_cols(x2)
        else:
            (dx_, sx), dxt, sxt = ops.quantize_fp8_blockwise(x2.contiguous()), None, None
        dw_, sw, dwt = ops.quantize_fp8_tiles(weight, transpose=x_grad)
        y = _gemm(recipe, "fprop", dx_, sx, _ROWS, dw_, sw, _TILES, out_dtype)
        ctx.save_for_backward(dxt, sxt, dwt, sw if x_grad else None)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, x.shape, x.dtype, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        with torch.autocast(device_type=grad_y.device.type, enabled=False):
            return FP8LinearFunction._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y):
        dxt, sxt, dwt, sw = ctx.saved_tensors
        recipe = ctx.recipe
        n = grad_y.shape[-1]
        g2 = grad_y.reshape(-1, n)
        if g2.dtype not in _FLOATS:
            g2 = g2.float()
        dx = dw = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        from moe_fp4 import ops

        if need_w:
            dg, sg, dgt, sgt = ops.quantize_fp8_rows_cols(g2)
        else:
            (dg, sg), dgt, sgt = ops.quantize_fp8_blockwise(g2.contiguous()), None, None
        if (need_x and dwt is None) or (need_w and dxt is None):
            raise RuntimeError("FP8LinearFunction: backward needs a gradient that forward was told is not "
                               "needed (x_grad / w_grad)")
        if need_x:
            dx = _gemm(recipe, "dgrad", dg, sg, _ROWS, dwt, sw.t(), _TILES, ctx.x_dtype).reshape(ctx.x_shape)
        if need_w:
            dw = _gemm(recipe, "wgrad", dgt, sgt, _ROWS, dxt, sxt, _ROWS, ctx.w_dtype)
        return dx, dw, None, None, None, None
