"""The random Hadamard transform (RHT) of the NVFP4 recipe: 16x16, one fixed seed.

The transform multiplies each group of 16 consecutive elements along the last dimension by
``Q = diag(s) @ H16 / 4``, where ``H16`` is the Sylvester Hadamard matrix (entries +-1) and ``s`` is
a vector of random signs drawn once from ``RHT_SEED``. ``Q`` is orthogonal (``Q @ Q.T == I``) with
entries +-1/4, exact in every float format.

Where it is used: on the two inputs of the weight-gradient GEMM only. ``dW = dY^T X`` reduces over
the token axis; both operands are transformed along that axis with the same ``Q``, so
``(dY^T Q)(X^T Q)^T = dY^T Q Q^T X = dY^T X``: the transform cancels in the product and only
changes what the quantizer sees (block outliers are spread over 16 elements).
"""

from __future__ import annotations

import torch

RHT_SIZE = 16
RHT_SEED = 0x5EED1  # the one fixed seed of the random signs


def hadamard_matrix(n: int = RHT_SIZE) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two): float32 [n, n], entries +-1."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rht_signs(n: int = RHT_SIZE, seed: int = RHT_SEED) -> torch.Tensor:
    """The random sign vector of the transform: float32 [n] of +-1, drawn on the CPU from ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float32) * 2 - 1


_CACHE: dict[tuple, torch.Tensor] = {}


def random_hadamard_matrix(
    n: int = RHT_SIZE, seed: int = RHT_SEED, *, device=None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``Q = diag(signs) @ H / sqrt(n)``: orthogonal, ``dtype`` [n, n] on ``device``."""
    key = (n, seed, str(device), dtype)
    if key not in _CACHE:
        q = rht_signs(n, seed).unsqueeze(1) * hadamard_matrix(n) / (n ** 0.5)
        _CACHE[key] = q.to(device=device, dtype=dtype)
    return _CACHE[key]


def apply_rht(x: torch.Tensor, *, seed: int = RHT_SEED) -> torch.Tensor:
    """Transform each group of 16 elements along the last dimension: ``x_g @ Q``.

    x: float32/bfloat16/float64 [..., K], K a multiple of 16. Returns the same shape and dtype.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % RHT_SIZE:
        raise ValueError(f"x: last dimension must be a multiple of {RHT_SIZE}, got shape {tuple(x.shape)}")
    q = random_hadamard_matrix(RHT_SIZE, seed, device=x.device, dtype=x.dtype)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // RHT_SIZE, RHT_SIZE)
    return torch.matmul(groups, q).reshape(x.shape)
