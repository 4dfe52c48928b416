"""Quantized-format recipes for dense layers: MXFP8, NVFP4, MXFP4 and blockwise FP8.

  recipes       the recipe dataclasses and how each operand of fprop / dgrad / wgrad is quantized
  hadamard      the 16x16 random Hadamard transform (one fixed seed) of the wgrad inputs
  quant_linear  QuantLinear (drop-in nn.Linear) and its autograd Function
  fp8_linear    QuantLinear's real FP8 path for FP8BlockwiseRecipe: each tensor quantized in one pass
  context       ``moe_fp4.autocast(recipe)`` and ``current_recipe``: the recipe of the enclosing block
  autocast      ``convert_linears``, ``set_recipe``: put a model's linear layers on a recipe
  compiled      the operand quantizers (the spec's quantize -> dequantize), compiled on CUDA
"""

from moe_fp4.recipes.autocast import (
    DEFAULT_HIGH_PRECISION,
    ConvertReport,
    convert_linears,
    find_blocks,
    set_recipe,
)
from moe_fp4.recipes.compiled import QUANTIZERS, compiled_status
from moe_fp4.recipes.context import autocast, current_recipe
from moe_fp4.recipes.fp8_linear import FP8LinearFunction
from moe_fp4.recipes.hadamard import RHT_SEED, RHT_SIZE, apply_rht, hadamard_matrix, random_hadamard_matrix
from moe_fp4.recipes.quant_linear import QuantLinear, QuantLinearFunction
from moe_fp4.recipes.recipes import (
    GEMM_ROLES,
    RECIPES,
    FP8BlockwiseRecipe,
    MXFP4Recipe,
    MXFP8Recipe,
    NVFP4Recipe,
    Recipe,
    fp8_blockwise_scaled_mm,
    scaled_mm_status,
)

__all__ = [
    "DEFAULT_HIGH_PRECISION", "GEMM_ROLES", "QUANTIZERS", "RECIPES", "RHT_SEED", "RHT_SIZE",
    "ConvertReport", "FP8BlockwiseRecipe", "FP8LinearFunction", "MXFP4Recipe", "MXFP8Recipe", "NVFP4Recipe",
    "QuantLinear", "QuantLinearFunction", "Recipe",
    "apply_rht", "autocast", "compiled_status", "convert_linears", "current_recipe", "find_blocks",
    "fp8_blockwise_scaled_mm", "hadamard_matrix", "random_hadamard_matrix", "scaled_mm_status", "set_recipe",
]
