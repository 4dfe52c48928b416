"""Quantized-format recipes for dense linear layers: MXFP8, NVFP4, MXFP4 and blockwise FP8.

A recipe says how each operand of the three GEMMs of a linear layer ``y = x W^T`` is quantized:

  =======  =====================  =========================  ==============================
  GEMM     product                 operand A (rows x red.)   operand B (cols x red.)
  =======  =====================  =========================  ==============================
  fprop    y  = x  W^T  [M, N]     x   [M, K], along K        W   [N, K], along K
  dgrad    dx = dy W    [M, K]     dy  [M, N], along N        W^T [K, N], along N
  wgrad    dW = dy^T x  [N, K]     dy^T [N, M], along M       x^T [K, M], along M
  =======  =====================  =========================  ==============================

Every operand is quantized along its own reduction axis ("red."), so x, W and dy each have a
rowwise and a columnwise copy; each copy is quantized separately from the high-precision tensor
(never by re-quantizing the other copy). The roles are ``"input"`` (x), ``"weight"`` (W) and
``"grad"`` (dy).

Numerics are emulated on any device: the spec functions of ``moe_fp4.formats`` quantize and
dequantize, then a float32 (exact products, the tested reference) or bfloat16 matmul runs
(``gemm_dtype``). The blockwise FP8 recipe can instead run real FP8 GEMMs (``torch._scaled_mm`` on
sm_90, see ``FP8BlockwiseRecipe``).

Fields shared by every recipe (keyword-only):
  gemm_dtype        "float32" (default; products of dequantized values are exact, what the tests
                    compare bit for bit) or "bfloat16" (fast on GPUs; the dequantized MX and FP8
                    operands are exact in bfloat16; NVFP4's FP32 tensor scales are factored out of
                    the operands and applied to the product, as an NVFP4 GEMM does).
  bf16_forward      False; True runs fprop in BF16 while dgrad and wgrad stay quantized: the
                    NVFP4 report's late switch of the forward pass to higher precision (switch by
                    ``set_recipe(model, dataclasses.replace(recipe, bf16_forward=True))`` or by
                    entering ``autocast`` with such a recipe for the last part of training).
  bf16_last_blocks  how many of the model's last blocks ``convert_linears`` keeps in BF16 when no
                    explicit ``keep_bf16`` is given.
  seed              seed of the stochastic-rounding generators (layer i uses seed + i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
from moe_fp4.recipes.hadamard import apply_rht

GEMMS = ("fprop", "dgrad", "wgrad")
ROLES = ("input", "weight", "grad")
GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Which operand roles each GEMM multiplies, as (A, B) of ``A @ B^T``.
GEMM_ROLES = {"fprop": ("input", "weight"), "dgrad": ("grad", "weight"), "wgrad": ("grad", "input")}


def _fail(recipe, field: str, expected: str, got) -> None:
    raise ValueError(f"{type(recipe).__name__}.{field}: expected {expected}, got {got!r}")


def _check_choice(recipe, field: str, choices) -> None:
    value = getattr(recipe, field)
    if value not in choices:
        _fail(recipe, field, f"one of {tuple(choices)}", value)


def _check_bool(recipe, field: str) -> None:
    if not isinstance(getattr(recipe, field), bool):
        _fail(recipe, field, "a bool", getattr(recipe, field))


def _check_int(recipe, field: str, minimum: int = 0) -> None:
    value = getattr(recipe, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(recipe, field, f"an int >= {minimum}", value)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Fields and GEMM logic shared by every recipe (see the module docstring)."""

    gemm_dtype: str = "float32"
    bf16_forward: bool = False
    bf16_last_blocks: int = 0
    seed: int = 0

    # Elements per scale block along the reduction axis; the reduction dimensions of every GEMM
    # (in_features, out_features, tokens) are multiples of it (tokens are zero-padded).
    block: ClassVar[int] = 32

    def __post_init__(self) -> None:
        _check_choice(self, "gemm_dtype", GEMM_DTYPES)
        _check_bool(self, "bf16_forward")
        _check_int(self, "bf16_last_blocks")
        _check_int(self, "seed")

    @property
    def name(self) -> str:
        return type(self).__name__

    def weight_tile(self) -> int:
        """Both weight dimensions must be multiples of this (2-D weight blocks)."""
        return 1

    def uses_generator(self) -> bool:
        """Whether quantization draws random bits (stochastic rounding)."""
        return False

    def quantize_rows(
        self, t: torch.Tensor, *, role: str, gemm: str, generator: torch.Generator | None = None,
        split_tensor_scale: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Quantize-dequantize ``t`` along its last dimension (the reduction axis) as the recipe says
        for operand ``role`` of GEMM ``gemm``.

        t: float32 [R, C], C a multiple of ``block``. Returns (values float32 [R, C], tensor_scale):
        with ``split_tensor_scale=False`` the values are the spec's dequantized operand and
        tensor_scale is None; with True a per-tensor FP32 scale (NVFP4) is returned separately
        (float32 0-dim) and left out of the values (None where the format has none).
        """
        raise NotImplementedError

    def gemm_nt(
        self, a: torch.Tensor, b: torch.Tensor, *, gemm: str, generator: torch.Generator | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``quant(a) @ quant(b)^T`` for GEMM ``gemm``: a float32 [R, L], b float32 [C, L], reduction
        over L (a multiple of ``block``). Quantizes A then B (the order the random bits are drawn).
        Returns ``out_dtype`` [R, C]."""
        role_a, role_b = GEMM_ROLES[gemm]
        split = self.gemm_dtype == "bfloat16"
        aq, sa = self.quantize_rows(a, role=role_a, gemm=gemm, generator=generator, split_tensor_scale=split)
        bq, sb = self.quantize_rows(b, role=role_b, gemm=gemm, generator=generator, split_tensor_scale=split)
        return emulated_matmul(aq, sa, bq, sb, self.gemm_dtype, out_dtype)


def emulated_matmul(aq, sa, bq, sb, gemm_dtype: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The emulated GEMM: aq [R, L] @ bq[C, L]^T in ``gemm_dtype``, times the tensor scales."""
    dt = GEMM_DTYPES[gemm_dtype]
    out = torch.matmul(aq.to(dt).contiguous(), bq.t().to(dt).contiguous())
    if sa is not None or sb is not None:
        scale = torch.ones((), dtype=torch.float32, device=out.device)
        scale = scale * (sa if sa is not None else 1.0) * (sb if sb is not None else 1.0)
        out = out.to(torch.float32) * scale
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# MXFP8
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MXFP8Recipe(Recipe):
    """MXFP8 (Mishra et al. 2025; TransformerEngine's MXFP8BlockScaling).

    fmt             "e4m3" (default): element format of inputs and weights.
    grad_fmt        "e4m3" (default, E4M3 everywhere as Mishra et al. recommend) or "e5m2" (the
                    E4M3-forward / E5M2-gradient hybrid).
    scale_rounding  "up" (default, amax / max rounded up to a power of two, no saturation) or
                    "down" (the OCP MX spec's floor, kept for comparison).
    Blocks of 32 along each operand's reduction axis, one UE8M0 scale per block.
    """

    fmt: str = "e4m3"
    grad_fmt: str = "e4m3"
    scale_rounding: str = "up"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self, "fmt", ("e4m3", "e5m2"))
        _check_choice(self, "grad_fmt", ("e4m3", "e5m2"))
        _check_choice(self, "scale_rounding", ("up", "down"))

    def quantize_rows(self, t, *, role, gemm, generator=None, split_tensor_scale=False):
        fmt = self.grad_fmt if role == "grad" else self.fmt
        data, scales = quantize_mxfp8(t, fmt=fmt, scale_rounding=self.scale_rounding, axis=-1)
        return dequantize_mxfp8(data, scales, axis=-1), None


# ------------------------------------------------------------------------------------------------
# NVFP4 and MXFP4
# ------------------------------------------------------------------------------------------------


def _fp4_operand(recipe, t, role: str, gemm: str):
    """The FP4 recipes' shared operand treatment: the random Hadamard transform on wgrad inputs
    (``wgrad_rht``), stochastic rounding for gradients (``stochastic_rounding``). Returns (t, rounding)."""
    if gemm == "wgrad" and recipe.wgrad_rht:
        t = apply_rht(t)
    return t, ("stochastic" if (role == "grad" and recipe.stochastic_rounding) else "nearest")


@dataclass(frozen=True, kw_only=True)
class NVFP4Recipe(Recipe):
    """NVFP4 (NVIDIA's NVFP4 pretraining report; TransformerEngine's NVFP4BlockScaling).

    E2M1 elements, 1x16 E4M3 block scales and one FP32 tensor scale per quantized copy.
    weight_2d            True: weights use 16x16 blocks, so fprop and dgrad see the same quantized
                         weight (the columnwise copy is the transpose of the rowwise one).
    wgrad_rht            True: the random Hadamard transform (16x16, one fixed seed) on the two
                         inputs of wgrad only (``moe_fp4.recipes.hadamard``).
    stochastic_rounding  True: gradients (dy, in dgrad and wgrad) round stochastically; inputs and
                         weights round to nearest even.
    bf16_last_blocks     1 (default): the last block of the model stays in BF16 (the report keeps
                         a small share of linear layers, the final ones, in BF16).
    """

    weight_2d: bool = True
    wgrad_rht: bool = True
    stochastic_rounding: bool = True
    bf16_last_blocks: int = 1
    block: ClassVar[int] = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("weight_2d", "wgrad_rht", "stochastic_rounding"):
            _check_bool(self, f)

    def weight_tile(self) -> int:
        return 16 if self.weight_2d else 1

    def uses_generator(self) -> bool:
        return self.stochastic_rounding

    def quantize_rows(self, t, *, role, gemm, generator=None, split_tensor_scale=False):
        t, rounding = _fp4_operand(self, t, role, gemm)
        block_2d = role == "weight" and self.weight_2d
        packed, scales, gs = quantize_nvfp4(t, block_2d=block_2d, rounding=rounding, generator=generator)
        if split_tensor_scale:
            return dequantize_nvfp4(packed, scales, torch.ones((), device=t.device)), gs
        return dequantize_nvfp4(packed, scales, gs), None


@dataclass(frozen=True, kw_only=True)
class MXFP4Recipe(Recipe):
    """MXFP4: E2M1 elements, blocks of 32 with a UE8M0 scale (OCP MX), the NVFP4 techniques
    switchable.

    scale_rounding       "up" (default) or "down" (OCP floor).
    wgrad_rht            True: random Hadamard transform on the wgrad inputs, as in NVFP4.
    stochastic_rounding  True: gradients round stochastically.
    bf16_last_blocks     1 (default), as in NVFP4.
    2-D weight blocks are not offered: the spec's MX blocks are 1x32 / 32x1 only.
    """

    scale_rounding: str = "up"
    wgrad_rht: bool = True
    stochastic_rounding: bool = True
    bf16_last_blocks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self, "scale_rounding", ("up", "down"))
        for f in ("wgrad_rht", "stochastic_rounding"):
            _check_bool(self, f)

    def uses_generator(self) -> bool:
        return self.stochastic_rounding

    def quantize_rows(self, t, *, role, gemm, generator=None, split_tensor_scale=False):
        t, rounding = _fp4_operand(self, t, role, gemm)
        packed, scales = quantize_mxfp4(t, scale_rounding=self.scale_rounding, rounding=rounding,
                                        generator=generator)
        return dequantize_mxfp4(packed, scales), None


# ------------------------------------------------------------------------------------------------
# Blockwise FP8 (DeepSeek-V3; TransformerEngine's Float8BlockScaling)
# ------------------------------------------------------------------------------------------------

FP8_BLOCK = 128


@dataclass(frozen=True, kw_only=True)
class FP8BlockwiseRecipe(Recipe):
    """Blockwise FP8: E4M3 with FP32 power-of-two scales, 1x128 blocks for inputs and gradients
    (along each operand's reduction axis, so the wgrad copies are 128x1 blocks of the original
    tensors) and 128x128 tiles for weights.

    backend  "auto" (default): real FP8 GEMMs through ``torch._scaled_mm`` (cuBLAS blockwise
             scaling: 1x128 operands, 128x128 weights) on CUDA devices of compute capability 9.0+,
             the emulation elsewhere; "scaled_mm": always the real GEMM (CUDA only); "emulate":
             always quantize -> dequantize -> matmul. If ``torch._scaled_mm`` rejects the blockwise
             layouts at run time, the emulation is used and a warning says so once
             (``scaled_mm_status()`` reports it).
    """

    backend: str = "auto"
    block: ClassVar[int] = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self, "backend", ("auto", "scaled_mm", "emulate"))

    def weight_tile(self) -> int:
        return FP8_BLOCK

    @staticmethod
    def operand_block(role: str) -> tuple[int, int]:
        return (FP8_BLOCK, FP8_BLOCK) if role == "weight" else (1, FP8_BLOCK)

    def quantize_rows(self, t, *, role, gemm, generator=None, split_tensor_scale=False):
        block = self.operand_block(role)
        data, scales = quantize_fp8_blockwise(t, block=block)
        return dequantize_fp8_blockwise(data, scales, block=block), None

    def uses_scaled_mm(self, device: torch.device) -> bool:
        if self.backend == "emulate" or device.type != "cuda":
            if self.backend == "scaled_mm":
                raise ValueError(f"FP8BlockwiseRecipe.backend: 'scaled_mm' needs a CUDA tensor, got {device}")
            return False
        if self.backend == "auto" and torch.cuda.get_device_capability(device) < (9, 0):
            return False
        return True

    def gemm_nt(self, a, b, *, gemm, generator=None, out_dtype=torch.float32):
        if self.uses_scaled_mm(a.device):
            out = _try_scaled_mm_nt(a, b, gemm, strict=self.backend == "scaled_mm")
            if out is not None:
                return out.to(out_dtype)
        return super().gemm_nt(a, b, gemm=gemm, generator=generator, out_dtype=out_dtype)


# Per layout key ("1x128*128x128 kb%4!=0", ...): True once torch._scaled_mm ran it and its first
# result matched the emulation, else why not (refused, or a wrong result); such keys use the emulation.
_SCALED_MM_STATE: dict[str, object] = {}
_CHECK_REL_ERR = 2.0 ** -6  # a first result further than this from the emulation counts as wrong


def scaled_mm_status() -> dict[str, object]:
    """What ``torch._scaled_mm`` did with each blockwise layout tried so far: True (ran, and its first
    result matched the emulation) or a message (refused or wrong; the emulation is used instead)."""
    return dict(_SCALED_MM_STATE)


def _layout_key(block_a, block_b, l_blocks: int) -> str:
    pair = "*".join(f"{m}x{n}" for m, n in (block_a, block_b))
    return f"{pair} kb%4{'==' if l_blocks % 4 == 0 else '!='}0"


def fp8_blockwise_scaled_mm(
    data_a: torch.Tensor, scales_a: torch.Tensor, block_a, data_b: torch.Tensor, scales_b: torch.Tensor,
    block_b, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Real FP8 GEMM ``A @ B^T`` on blockwise-quantized operands through ``torch._scaled_mm``.

    data_a float8_e4m3fn [R, L] with scales_a float32 [R, L/128] (block (1,128)); data_b
    float8_e4m3fn [C, L] with scales_b float32 [C, L/128] (block (1,128)) or [C/128, L/128] (block
    (128,128)). R, C and L multiples of 128. Returns ``out_dtype`` [R, C] (cuBLAS computes bfloat16
    for blockwise scaling).

    Scale layouts handed to cuBLAS (through torch 2.11's ``_scaled_mm`` on sm_90): A's 1x128 scales
    outer-dim-major ([R, L/128] with strides (1, R)); B's 1x128 scales as [L/128, C] row-major; B's
    128x128 scales as the transposed view [L/128, C/128] of a contiguous [C/128, L/128] buffer. cuBLAS
    reads those 128x128 scales with a leading dimension rounded up to 4 blocks (an H200 gave wrong
    products whenever L/128 was not a multiple of 4) and torch 2.11 accepts no padded view, so for
    128x128 scaling the reduction dimension itself is zero-padded to a multiple of 4 blocks (zero data
    adds nothing to the product; the padded scales are 1).
    """
    if tuple(block_a) != (1, FP8_BLOCK):
        raise ValueError(f"block_a: expected (1, {FP8_BLOCK}), got {block_a!r}")
    if tuple(block_b) != (1, FP8_BLOCK):
        l_blocks = scales_b.shape[1]
        extra = -l_blocks % 4
        if extra:
            zeros = torch.nn.functional.pad
            data_a = zeros(data_a.view(torch.uint8), (0, extra * FP8_BLOCK)).view(data_a.dtype)
            data_b = zeros(data_b.view(torch.uint8), (0, extra * FP8_BLOCK)).view(data_b.dtype)
            scales_a = zeros(scales_a, (0, extra), value=1.0)
            scales_b = zeros(scales_b, (0, extra), value=1.0)
    sa = scales_a.t().contiguous().t()
    sb = scales_b.t().contiguous() if tuple(block_b) == (1, FP8_BLOCK) else scales_b.contiguous().t()
    out = torch._scaled_mm(data_a, data_b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _try_scaled_mm_nt(a: torch.Tensor, b: torch.Tensor, gemm: str, strict: bool) -> torch.Tensor | None:
    role_a, role_b = GEMM_ROLES[gemm]
    block_a, block_b = FP8BlockwiseRecipe.operand_block(role_a), FP8BlockwiseRecipe.operand_block(role_b)
    key = _layout_key(block_a, block_b, a.shape[1] // FP8_BLOCK)
    state = _SCALED_MM_STATE.get(key)
    if isinstance(state, str) and not strict:
        return None
    rows = a.shape[0]
    pad = -rows % FP8_BLOCK  # cuBLAS wants the row count aligned; zero rows quantize to zeros
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
    da, sa = quantize_fp8_blockwise(a, block=block_a)
    db, sb = quantize_fp8_blockwise(b, block=block_b)
    try:
        out = fp8_blockwise_scaled_mm(da, sa, block_a, db, sb, block_b)
        if state is not True:
            # First use of this layout: check the product against the emulation once.
            ref = torch.matmul(dequantize_fp8_blockwise(da, sa, block=block_a),
                               dequantize_fp8_blockwise(db, sb, block=block_b).t())
            err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            if not err <= _CHECK_REL_ERR:
                raise RuntimeError(f"torch._scaled_mm gave a wrong product (max error {err:.3g} of the "
                                   f"largest value, emulation as reference)")
    except (RuntimeError, ValueError, NotImplementedError) as err:  # layouts this torch / cuBLAS refuses
        if strict:
            raise
        import warnings

        _SCALED_MM_STATE[key] = (" ".join(str(err).split()) or type(err).__name__)[:600]
        warnings.warn(f"blockwise FP8 through torch._scaled_mm ({key}): {_SCALED_MM_STATE[key]}; "
                      f"FP8BlockwiseRecipe emulates {gemm}", stacklevel=3)
        return None
    _SCALED_MM_STATE[key] = True
    return out[:rows] if pad else out


RECIPES = (MXFP8Recipe, NVFP4Recipe, MXFP4Recipe, FP8BlockwiseRecipe)
