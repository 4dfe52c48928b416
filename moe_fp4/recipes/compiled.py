"""The recipes' operand quantizers, run eagerly or compiled by ``torch.compile``.

Every recipe quantizes an operand by calling the spec (``moe_fp4.formats``): quantize, then
dequantize. Run eagerly, those plain-PyTorch functions launch about 150 small kernels per operand,
six operands per layer and step; on a GPU the launches, not the arithmetic, are what an emulated
training step costs. Compiled, the same functions fuse into a few kernels.

What is compiled: the spec's own quantize -> dequantize of one operand (the functions ``qdq_*``
below, nothing re-implemented), with ``torch.compile(dynamic=False)``: one set of graphs per operand
kind (format, rounding, block shape) and shape; operands are made contiguous first, so a transposed
view compiles no second variant. (Dynamic shapes were tried: torch 2.11 fails to trace the spec's
``1 << (ebits + mbits)`` once the format's integers become symbolic.) The spec skips its checks that
read tensor values (e.g. ``int(codes.max())``) while torch.compile traces, so a kind with nearest
rounding is one graph with no host synchronisation; the draws of random bits for stochastic rounding
(``torch.randint`` with the layer's generator) split it into a few graphs and run eagerly between
them, so the random bits are the very bits of the eager spec.

Bit-exactness: the first use of each (kind, shape, dtype, device) runs both the compiled and the
eager spec (same generator state) and compares their bits (``same_bits``: NaN payloads aside, since
the sign and payload of a NaN are the producing kernel's choice: the CPU's eager float32 -> bfloat16
cast writes 0xFFFF where a compiled kernel writes 0x7FC0); a difference, or an error from the
compiler, switches that kind to the eager spec for good, with a warning (``compiled_status()``
reports every kind). Every ``RECHECK_EVERY``-th call of a kind is compared again, since one operand
per shape cannot show every data-dependent difference. ``tests/test_recipes_gpu.py`` checks compiled
== eager bit for bit for every recipe and operand kind on fresh random inputs and special values.

What was seen on an H200 (torch 2.11, Triton 3.6): the GPU code that torch.compile generates drops a
float64 -> float32 -> float64 round trip, which the spec's NVFP4 block divisor once relied on; a few
elements per million then rounded the other way at E2M1 ties. The spec now forms that divisor as a
float32 product (the same value), and every kind, NVFP4 included, matches the eager spec.

When: the recipe field ``quantizer`` (``"auto"``: compiled for CUDA tensors, except the kinds in
``EAGER_ON_AUTO`` (none at present), eager elsewhere; ``"compiled"``: compiled on every device; ``"eager"``: never).

Side effect on ``torch._dynamo.config`` (set once, at the first compiled call, from
``DYNAMO_CONFIG``; patching it around every call would cost tens of microseconds a call): the
recompile limits are raised to at least 256 / 4096 (the spec's functions are shared by every operand
kind, and each kind is one cache entry of them), and where this torch has it
``nested_graph_breaks`` is switched on (a graph break inside a nested spec function then resumes
tracing there instead of splitting every caller into its own graphs: about half as many graphs).
Set ``DYNAMO_CONFIG["nested_graph_breaks"] = None`` before the first call to leave it alone.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from moe_fp4.formats import (
    dequantize_fp8_blockwise,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_fp8_blockwise,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)

QUANTIZERS = ("auto", "compiled", "eager")

# ------------------------------------------------------------------------------------------------
# the operand kinds: the spec's quantize -> dequantize, with plain (hashable) arguments
# ------------------------------------------------------------------------------------------------


def qdq_mxfp8(t: torch.Tensor, generator, fmt: str, scale_rounding: str, dtype: torch.dtype):
    """MXFP8 along the last dimension. t: float32 [R, C], C % 32 == 0 -> (``dtype`` [R, C], None)."""
    data, scales = quantize_mxfp8(t, fmt=fmt, scale_rounding=scale_rounding, axis=-1)
    return dequantize_mxfp8(data, scales, axis=-1, dtype=dtype), None


def qdq_mxfp4(t: torch.Tensor, generator, scale_rounding: str, rounding: str, dtype: torch.dtype):
    """MXFP4 along the last dimension. t: float32 [R, C], C % 32 == 0 -> (``dtype`` [R, C], None)."""
    packed, scales = quantize_mxfp4(t, scale_rounding=scale_rounding, rounding=rounding, generator=generator)
    return dequantize_mxfp4(packed, scales, dtype=dtype), None


def qdq_nvfp4(t: torch.Tensor, generator, block_2d: bool, rounding: str, split_tensor_scale: bool,
              dtype: torch.dtype):
    """NVFP4 (1x16 or 16x16 blocks). t: float32 [R, C] -> (``dtype`` [R, C], tensor scale float32
    0-dim when ``split_tensor_scale`` (then left out of the values), else None)."""
    packed, scales, gs = quantize_nvfp4(t, block_2d=block_2d, rounding=rounding, generator=generator)
    if split_tensor_scale:
        return dequantize_nvfp4(packed, scales, torch.ones((), device=t.device), dtype=dtype), gs
    return dequantize_nvfp4(packed, scales, gs, dtype=dtype), None


def qdq_fp8_blockwise(t: torch.Tensor, generator, block: tuple[int, int], dtype: torch.dtype):
    """Blockwise FP8 (1x128 or 128x128). t: float32 [R, C] -> (``dtype`` [R, C], None)."""
    data, scales = quantize_fp8_blockwise(t, block=block)
    return dequantize_fp8_blockwise(data, scales, block=block, dtype=dtype), None


def q_fp8_blockwise(t: torch.Tensor, generator, block: tuple[int, int]):
    """Blockwise FP8 quantization only (the operands of a real FP8 GEMM). t: float32 [R, C] ->
    (data float8_e4m3fn [R, C], scales float32 [R/bm, C/bn])."""
    return quantize_fp8_blockwise(t, block=block)


# ------------------------------------------------------------------------------------------------
# compiled or eager
# ------------------------------------------------------------------------------------------------

# Kinds that quantizer="auto" runs eagerly (a kind whose compiled code is known to differ from the
# eager spec goes here until the cause is fixed).
EAGER_ON_AUTO: set[Callable] = set()

# Every RECHECK_EVERY-th call of a checked kind is compared with the eager spec again (the first-use
# check sees one operand per shape; a data-dependent difference can show up later).
RECHECK_EVERY = 200

# False: run the compiled code alone, no first-use comparison and no fallback (errors propagate);
# the GPU tests use it to compare compiled and eager directly.
VERIFY_FIRST_USE = True

_LOCK = threading.Lock()
_COMPILED: dict[Callable, Callable] = {}
# kind -> True (compiled, every checked shape matched the eager spec) or why it runs eagerly
_STATUS: dict[tuple, object] = {}
_CHECKED: set[tuple] = set()  # (kind, shape, dtype, device, no generator) whose first result was compared
_CALLS: dict[tuple, int] = {}  # calls per kind


def _kind_name(fn: Callable, args: tuple) -> str:
    return f"{fn.__name__}{args}"


def compiled_status() -> dict[str, object]:
    """Per operand kind used so far: True (compiled; its first result for every shape matched the
    eager spec bit for bit) or the reason it runs eagerly (a compiler error or a mismatch)."""
    return {_kind_name(fn, args): v for (fn, args), v in _STATUS.items()}


def reset_compiled_state() -> None:
    """Forget which kinds were checked or failed (the compiled functions stay cached)."""
    with _LOCK:
        _STATUS.clear()
        _CHECKED.clear()
        _CALLS.clear()


# Minimums for the limits; True / False / None (leave as it is) for the switch.
DYNAMO_CONFIG: dict[str, object] = {"recompile_limit": 256, "accumulated_recompile_limit": 4096,
                                    "nested_graph_breaks": True}


def _configure_dynamo() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < DYNAMO_CONFIG[name]:
            setattr(cfg, name, DYNAMO_CONFIG[name])
    if hasattr(cfg, "nested_graph_breaks") and DYNAMO_CONFIG["nested_graph_breaks"] is not None:
        cfg.nested_graph_breaks = bool(DYNAMO_CONFIG["nested_graph_breaks"])


def _compiled(fn: Callable) -> Callable:
    with _LOCK:
        if fn not in _COMPILED:
            if not _COMPILED:
                _configure_dynamo()
            _COMPILED[fn] = torch.compile(fn, dynamic=False)
        return _COMPILED[fn]


def use_compiled(quantizer: str, device: torch.device, fn: Callable | None = None) -> bool:
    """Whether a recipe with this ``quantizer`` field compiles the quantizer ``fn`` for ``device``
    ("auto" leaves the kinds of ``EAGER_ON_AUTO`` eager)."""
    if quantizer == "eager":
        return False
    if quantizer == "compiled":
        return True
    return device.type == "cuda" and fn not in EAGER_ON_AUTO


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether a and b hold the same bits, NaN payloads aside: NaNs must sit at the same places, but
    their sign and payload bits are the producing kernel's choice (the spec promises a NaN, not which)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    bits_a, bits_b = a.contiguous().view(ints), b.contiguous().view(ints)
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
        if not torch.equal(nan_a, nan_b):
            return False
        bits_a = bits_a.masked_fill(nan_a, 0)
        bits_b = bits_b.masked_fill(nan_b, 0)
    return bool(torch.equal(bits_a, bits_b))


def _disable(kind: tuple, reason: str) -> None:
    _STATUS[kind] = reason[:600]
    warnings.warn(f"moe_fp4.recipes: compiled quantizer {_kind_name(*kind)} disabled ({_STATUS[kind]}); "
                  f"the eager spec runs instead", stacklevel=4)


def run_quantizer(quantizer: str, fn: Callable, t: torch.Tensor, generator: torch.Generator | None,
                  *args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fn(t, generator, *args)`` (one of the ``qdq_*`` functions), compiled or eager as
    ``quantizer`` says for ``t``'s device. Returns what ``fn`` returns, bit for bit."""
    if not use_compiled(quantizer, t.device, fn):
        return fn(t, generator, *args)
    t = t.contiguous()  # one compiled variant per shape, whatever the strides (the values are the same)
    if not VERIFY_FIRST_USE:
        return _compiled(fn)(t, generator, *args)
    kind = (fn, args)
    state = _STATUS.get(kind)
    if isinstance(state, str):
        return fn(t, generator, *args)
    key = (kind, tuple(t.shape), t.dtype, str(t.device), generator is None)
    calls = _CALLS[kind] = _CALLS.get(kind, 0) + 1
    if state is True and key in _CHECKED and calls % RECHECK_EVERY:
        return _compiled(fn)(t, generator, *args)
    # First use of this kind for this shape (or a periodic recheck): run both, keep the eager spec's
    # result if they differ.
    rng = generator.get_state() if generator is not None else None
    try:
        out = _compiled(fn)(t, generator, *args)
    except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the spec
        _disable(kind, f"{type(err).__name__}: {' '.join(str(err).split())}")
        if generator is not None:
            generator.set_state(rng)
        return fn(t, generator, *args)
    rng_after = generator.get_state() if generator is not None else None
    if generator is not None:
        generator.set_state(rng)
    ref = fn(t, generator, *args)
    if generator is not None and not torch.equal(generator.get_state(), rng_after):
        _disable(kind, "the compiled code drew a different amount of random bits")
        return ref
    if not all(same_bits(a, b) for a, b in zip(out, ref)):
        _disable(kind, f"compiled result differs from the eager spec for shape {tuple(t.shape)}")
        return ref
    _STATUS[kind] = True
    _CHECKED.add(key)
    return out
