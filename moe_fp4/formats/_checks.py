"""Argument checks shared by the spec's public functions: each raises ValueError naming the argument."""

from __future__ import annotations

import torch


def describe(t, *, device: bool = False) -> str:
    """An argument as an error message shows it: dtype and shape (and device) of a tensor, else its type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)}" + (f" on {t.device}" if device else "")


def check_tensor(t, name: str, *, dtypes=None, min_dim: int = 0, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({want}), got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimension(s), got shape {tuple(t.shape)}")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def value_checks() -> bool:
    """Whether checks that read tensor values run. They are skipped while torch.compile traces: each
    would force a host synchronisation and split the compiled code into separate graphs (the recipes
    compile the spec's quantize -> dequantize, whose intermediate codes are valid by construction).
    Checks of shapes, dtypes and arguments always run."""
    return not torch.compiler.is_compiling()


def check_multiple(size: int, block: int, name: str, dim_desc: str = "last dimension") -> None:
    if size % block != 0:
        raise ValueError(f"{name}: {dim_desc} ({size}) must be a multiple of {block}")


FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def as_float32(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    check_tensor(x, name, dtypes=FLOAT_INPUTS)
    return x.to(torch.float32)
