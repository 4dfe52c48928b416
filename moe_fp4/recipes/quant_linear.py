"""QuantLinear: a drop-in ``nn.Linear`` whose three GEMMs follow a quantized-format recipe.

Forward (fprop) ``y = q(x) q(W)^T``; backward dgrad ``dx = q(dy) q(W^T)^T`` and wgrad
``dW = q(dy^T) q(x^T)^T``, each operand quantized along its own reduction axis from the saved
high-precision tensor (see ``moe_fp4.recipes.recipes``). The bias is added in high precision.

Which recipe runs: the one of an enclosing ``moe_fp4.autocast(recipe)`` block if there is one
(``autocast(enabled=False)`` means high precision), else the layer's own ``recipe`` (None: plain
high-precision ``nn.Linear``). Backward uses the recipe that ran the forward.

With FP8BlockwiseRecipe's real FP8 GEMMs on a GPU, ``moe_fp4.recipes.fp8_linear.FP8LinearFunction``
runs instead: the same operands (bit for bit) quantized by one-pass native kernels, FP8 copies saved
for backward instead of x.

Stochastic rounding draws from a per-layer ``torch.Generator`` seeded with ``recipe.seed +
sr_index``; in backward, dgrad's gradient copy is quantized first, then wgrad's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_fp4.recipes import fp8_linear
from moe_fp4.recipes.context import current_recipe
from moe_fp4.recipes.recipes import Recipe


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dimension (the token axis of the wgrad operands) to a multiple of ``multiple``:
    zero elements leave every block amax, and the product, unchanged."""
    pad = -t.shape[-1] % multiple
    return F.pad(t, (0, pad)) if pad else t


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class QuantLinearFunction(torch.autograd.Function):
    """Autograd of ``y = x W^T`` with quantized fprop, dgrad and wgrad.

    x: float [..., K]; weight: float [N, K]; recipe: a Recipe; generator: torch.Generator or None
    (stochastic rounding); out_dtype: dtype of y. Returns y ``out_dtype`` [..., N].
    """

    @staticmethod
    def forward(ctx, x, weight, recipe: Recipe, generator, out_dtype):
        k = x.shape[-1]
        with torch.autocast(device_type=x.device.type, enabled=False):
            x2 = recipe.gemm_input(x.reshape(-1, k))
            w = recipe.gemm_input(weight)
            if recipe.bf16_forward:
                y = torch.matmul(x2.to(torch.bfloat16), w.t().to(torch.bfloat16)).to(out_dtype)
            else:
                y = recipe.gemm_nt(x2, w, gemm="fprop", generator=generator, out_dtype=out_dtype)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.generator = recipe, generator
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        recipe, gen = ctx.recipe, ctx.generator
        dx = dw = None
        with torch.autocast(device_type=x.device.type, enabled=False):
            g2 = recipe.gemm_input(grad_y.reshape(-1, weight.shape[0]))
            if ctx.needs_input_grad[0]:
                w_t = recipe.gemm_input(weight).t()  # [K, N]: W quantized along N (columnwise copy)
                dx = recipe.gemm_nt(g2, w_t, gemm="dgrad", generator=gen, out_dtype=x.dtype)
                dx = dx.reshape(x.shape)
            if ctx.needs_input_grad[1]:
                x2 = recipe.gemm_input(x.reshape(-1, x.shape[-1]))
                g_t = _pad_last(g2.t(), recipe.block)  # [N, M]: dy quantized along the tokens
                x_t = _pad_last(x2.t(), recipe.block)  # [K, M]: x quantized along the tokens
                dw = recipe.gemm_nt(g_t, x_t, gemm="wgrad", generator=gen, out_dtype=weight.dtype)
        return dx, dw, None, None, None


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs follow ``recipe`` (or the enclosing ``moe_fp4.autocast``).

    in_features, out_features: multiples of the recipe's block (32 MX, 16 NVFP4, 128 blockwise FP8)
    and of its weight tile (16 for NVFP4 2-D weights, 128 for blockwise FP8), checked at each
    quantized forward. Input x: float [..., in_features] (any number of tokens: the token axis is
    zero-padded for wgrad). Output: [..., out_features] in x's dtype, or the torch.autocast dtype.
    sr_index: offset of this layer's stochastic-rounding seed (``recipe.seed + sr_index``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | None = None, sr_index: int = 0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe is not None and not isinstance(recipe, Recipe):
            raise ValueError(f"recipe: expected a Recipe or None, got {type(recipe).__name__}")
        if isinstance(sr_index, bool) or not isinstance(sr_index, int) or sr_index < 0:
            raise ValueError(f"sr_index: expected an int >= 0, got {sr_index!r}")
        self.recipe = recipe
        self.sr_index = sr_index
        self._generators: dict[tuple[str, int], torch.Generator] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | None = None, *, sr_index: int = 0) -> QuantLinear:
        """A QuantLinear sharing ``linear``'s weight and bias Parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        q = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                recipe=recipe, sr_index=sr_index)
        q.weight = linear.weight
        q.bias = linear.bias
        q.train(linear.training)
        return q

    def generator(self, recipe: Recipe, device: torch.device) -> torch.Generator:
        """This layer's stochastic-rounding generator on ``device`` for ``recipe.seed``."""
        key = (str(device), recipe.seed)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(recipe.seed + self.sr_index)
            self._generators[key] = g
        return self._generators[key]

    def active_recipe(self) -> Recipe | None:
        return current_recipe(self.recipe)

    def check_recipe(self, recipe: Recipe) -> None:
        """ValueError naming in_features / out_features when the shape does not fit ``recipe``."""
        for name in ("in_features", "out_features"):
            size = getattr(self, name)
            need = max(recipe.block, recipe.weight_tile())
            if size % need:
                raise ValueError(f"{name}: {recipe.name} needs a multiple of {need}, got {size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.active_recipe()
        if recipe is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected last dimension {self.in_features}, got shape {tuple(x.shape)}")
        self.check_recipe(recipe)
        if fp8_linear.applies(recipe, x, self.weight):
            grad = torch.is_grad_enabled()
            y = fp8_linear.FP8LinearFunction.apply(x, self.weight, recipe, _out_dtype(x),
                                                   grad and x.requires_grad, grad and self.weight.requires_grad)
        else:
            gen = self.generator(recipe, x.device) if recipe.uses_generator() else None
            y = QuantLinearFunction.apply(x, self.weight, recipe, gen, _out_dtype(x))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"
