"""The recipe of the enclosing ``autocast`` block, kept in a context variable.

``autocast`` (which converts models) and ``quant_linear`` (whose layers ask which recipe to run)
both import this module, so neither imports the other.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from moe_fp4.recipes.recipes import Recipe

# None outside any autocast block; else a 1-tuple holding the block's recipe (None: high precision).
_ACTIVE: ContextVar[tuple[Recipe | None] | None] = ContextVar("moe_fp4_autocast", default=None)


@contextlib.contextmanager
def autocast(recipe: Recipe | None = None, *, enabled: bool = True):
    """Within the block every QuantLinear runs ``recipe``; with ``enabled=False`` (or recipe None)
    they run in high precision. Blocks nest; the innermost wins. Layers that ``convert_linears``
    kept as ``nn.Linear`` are not affected."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"recipe: expected a moe_fp4.recipes Recipe or None, got {type(recipe).__name__}")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    token = _ACTIVE.set((recipe if enabled else None,))
    try:
        yield recipe if enabled else None
    finally:
        _ACTIVE.reset(token)


def current_recipe(default: Recipe | None = None) -> Recipe | None:
    """The recipe of the innermost enclosing ``autocast`` block, else ``default``."""
    active = _ACTIVE.get()
    return default if active is None else active[0]
