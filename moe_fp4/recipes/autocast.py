"""``moe_fp4.autocast(recipe)`` and the helpers that put a model's linear layers on a recipe.

Usage::

    report = convert_linears(model, NVFP4Recipe())    # QuantLinear in place of nn.Linear
    with moe_fp4.autocast(NVFP4Recipe()):              # optional: choose / switch the recipe
        loss = model(batch).loss
    loss.backward()                                    # backward uses the forward's recipe

What stays in high precision: everything that is not an ``nn.Linear`` (attention score and
value products, softmax, norms, embeddings), the output head (``high_precision`` names), and the
linear layers of the kept blocks (``keep_bf16``: by default the recipe's ``bf16_last_blocks`` last
blocks of the model). Those layers are left as the very ``nn.Linear`` objects they were.

Late switch to a BF16 forward (the NVFP4 report): for the last part of training, run
``set_recipe(model, dataclasses.replace(recipe, bf16_forward=True))`` (or enter
``autocast(dataclasses.replace(recipe, bf16_forward=True))``); dgrad and wgrad stay quantized.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from moe_fp4.recipes.context import autocast, current_recipe
from moe_fp4.recipes.quant_linear import QuantLinear
from moe_fp4.recipes.recipes import Recipe

__all__ = [
    "DEFAULT_HIGH_PRECISION", "ConvertReport", "autocast", "convert_linears", "current_recipe",
    "find_blocks", "set_recipe",
]

DEFAULT_HIGH_PRECISION = ("lm_head", "head", "output", "output_layer", "classifier")


@dataclass
class ConvertReport:
    """Qualified module names of the model's linear layers, by what ``convert_linears`` did."""

    quantized: list[str] = field(default_factory=list)
    kept_bf16: list[str] = field(default_factory=list)
    high_precision: list[str] = field(default_factory=list)  # the output head
    incompatible: list[str] = field(default_factory=list)  # shape not a multiple of the block


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks: the children of the ``nn.ModuleList`` that
    holds the most ``nn.Linear`` layers ([] when there is none)."""
    best, best_count = [], 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            count = sum(isinstance(m, nn.Linear) for m in mod.modules())
            if count > best_count:
                prefix = f"{name}." if name else ""
                best, best_count = [f"{prefix}{i}" for i in range(len(mod))], count
    return best


def _matches(name: str, patterns: Iterable[str]) -> bool:
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, pat) for pat in patterns for p in prefixes)


def convert_linears(
    model: nn.Module,
    recipe: Recipe,
    keep_bf16: int | Iterable[str] | None = None,
    *,
    high_precision: Iterable[str] = DEFAULT_HIGH_PRECISION,
) -> ConvertReport:
    """Replace the ``nn.Linear`` layers of ``model`` in place by QuantLinear layers on ``recipe``
    (sharing their Parameters, so an optimizer built before keeps working).

    keep_bf16: None (default): the last ``recipe.bf16_last_blocks`` blocks (``find_blocks``);
               an int n: the last n blocks; or fnmatch patterns of qualified module names (a
               pattern naming a block keeps every linear layer in it, e.g. ``"blocks.3"``).
    high_precision: names (last component or fnmatch pattern of the qualified name) of layers kept
               in high precision whatever the recipe, by default the usual output-head names.
    Layers whose in/out features do not fit the recipe's blocks stay in high precision too.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe: expected a moe_fp4.recipes Recipe, got {type(recipe).__name__}")
    if isinstance(model, nn.Linear):
        raise ValueError("model: a bare nn.Linear cannot be converted in place; use QuantLinear.from_linear")
    if keep_bf16 is None:
        keep_bf16 = recipe.bf16_last_blocks
    if isinstance(keep_bf16, bool) or isinstance(keep_bf16, str):
        raise ValueError(f"keep_bf16: expected None, an int or an iterable of name patterns, got {keep_bf16!r}")
    if isinstance(keep_bf16, int):
        if keep_bf16 < 0:
            raise ValueError(f"keep_bf16: expected a non-negative number of blocks, got {keep_bf16}")
        blocks = find_blocks(model)
        keep_patterns = blocks[len(blocks) - keep_bf16:] if keep_bf16 else []
    else:
        keep_patterns = list(keep_bf16)
        if not all(isinstance(p, str) for p in keep_patterns):
            raise ValueError(f"keep_bf16: expected name patterns (str), got {keep_patterns!r}")
    head_patterns = list(high_precision)

    report = ConvertReport()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    need = max(recipe.block, recipe.weight_tile())
    for index, (name, lin) in enumerate(linears):
        last = name.rsplit(".", 1)[-1]
        if last in head_patterns or _matches(name, head_patterns):
            report.high_precision.append(name)
            continue
        if _matches(name, keep_patterns):
            report.kept_bf16.append(name)
            continue
        if lin.in_features % need or lin.out_features % need:
            report.incompatible.append(name)
            continue
        if isinstance(lin, QuantLinear):
            lin.recipe, lin.sr_index = recipe, index
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantLinear.from_linear(lin, recipe, sr_index=index))
        report.quantized.append(name)
    return report


def set_recipe(model: nn.Module, recipe: Recipe | None) -> int:
    """Set the recipe of every QuantLinear of ``model`` (None: high precision); returns how many.
    The late switch to a BF16 forward is ``set_recipe(model, replace(recipe, bf16_forward=True))``."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"recipe: expected a Recipe or None, got {type(recipe).__name__}")
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.recipe = recipe
            n += 1
    return n
