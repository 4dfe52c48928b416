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
  quantizer         "auto" (default): the operand quantizers (the spec's quantize -> dequantize)
                    run compiled by ``torch.compile`` for CUDA tensors (NVFP4's stay eager for
                    now, see ``moe_fp4.recipes.compiled``) and eagerly elsewhere; "compiled":
                    compiled on every device; "eager": never compiled. Compiled code must give the
                    eager spec's bits: each operand kind's first use per shape, and every 200th
                    call, is compared, and a difference switches the kind to the eager spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_fp4.formats import dequantize_fp8_blockwise
from moe_fp4.recipes.compiled import (
    QUANTIZERS,
    q_fp8_blockwise,
    qdq_fp8_blockwise,
    qdq_mxfp4,
    qdq_mxfp8,
    qdq_nvfp4,
    run_quantizer,
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
    quantizer: str = "auto"

    # Elements per scale block along the reduction axis; the reduction dimensions of every GEMM
    # (in_features, out_features, tokens) are multiples of it (tokens are zero-padded).
    block: ClassVar[int] = 32

    def __post_init__(self) -> None:
        _check_choice(self, "gemm_dtype", GEMM_DTYPES)
        _check_bool(self, "bf16_forward")
        _check_int(self, "bf16_last_blocks")
        _check_int(self, "seed")
        _check_choice(self, "quantizer", QUANTIZERS)

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
        return self.operand(t, role=role, gemm=gemm, generator=generator, split_tensor_scale=split_tensor_scale)

    def gemm_input(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor that ``gemm_nt`` takes for the high-precision operand ``t`` (float, any shape):
        float32 (every operand quantizer reads its input exactly in float32)."""
        return t.to(torch.float32)

    def operand(
        self, t: torch.Tensor, *, role: str, gemm: str, generator: torch.Generator | None = None,
        split_tensor_scale: bool = False, dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``quantize_rows`` with the dequantized values cast to ``dtype`` by the spec's dequantizer
        (the GEMM's input dtype). t: float32 [R, C]. Returns (``dtype`` [R, C], tensor scale or None)."""
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
        dt = GEMM_DTYPES[self.gemm_dtype]
        aq, sa = self.operand(a, role=role_a, gemm=gemm, generator=generator, split_tensor_scale=split, dtype=dt)
        bq, sb = self.operand(b, role=role_b, gemm=gemm, generator=generator, split_tensor_scale=split, dtype=dt)
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

    def operand(self, t, *, role, gemm, generator=None, split_tensor_scale=False, dtype=torch.float32):
        fmt = self.grad_fmt if role == "grad" else self.fmt
        return run_quantizer(self.quantizer, qdq_mxfp8, t, None, fmt, self.scale_rounding, dtype)


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

    def operand(self, t, *, role, gemm, generator=None, split_tensor_scale=False, dtype=torch.float32):
        t, rounding = _fp4_operand(self, t, role, gemm)
        block_2d = role == "weight" and self.weight_2d
        gen = generator if rounding == "stochastic" else None
        return run_quantizer(self.quantizer, qdq_nvfp4, t, gen, block_2d, rounding, split_tensor_scale, dtype)


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

    def operand(self, t, *, role, gemm, generator=None, split_tensor_scale=False, dtype=torch.float32):
        t, rounding = _fp4_operand(self, t, role, gemm)
        gen = generator if rounding == "stochastic" else None
        return run_quantizer(self.quantizer, qdq_mxfp4, t, gen, self.scale_rounding, rounding, dtype)


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

    def operand(self, t, *, role, gemm, generator=None, split_tensor_scale=False, dtype=torch.float32):
        return run_quantizer(self.quantizer, qdq_fp8_blockwise, t, None, self.operand_block(role), dtype)

    def uses_scaled_mm(self, device: torch.device) -> bool:
        if self.backend == "emulate" or device.type != "cuda":
            if self.backend == "scaled_mm":
                raise ValueError(f"FP8BlockwiseRecipe.backend: 'scaled_mm' needs a CUDA tensor, got {device}")
            return False
        if self.backend == "auto" and torch.cuda.get_device_capability(device) < (9, 0):
            return False
        return True

    def gemm_input(self, t: torch.Tensor) -> torch.Tensor:
        """BF16 operands stay BF16 on the real FP8 GEMM path (the quantizers read them exactly, and the
        native 1x128 quantizer takes BF16), saving a float32 copy of every operand; float32 elsewhere."""
        if t.dtype == torch.bfloat16 and self.uses_scaled_mm(t.device):
            return t
        return t.to(torch.float32)

    def gemm_nt(self, a, b, *, gemm, generator=None, out_dtype=torch.float32):
        if self.uses_scaled_mm(a.device):
            out = _try_scaled_mm_nt(a, b, gemm, strict=self.backend == "scaled_mm", quantizer=self.quantizer)
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


def _check_fp8_operand(data, scales, block, name: str) -> int:
    """ValueError unless ``data`` [rows, L] e4m3 and ``scales`` fit ``block``; returns rows."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(f"data_{name}: expected a 2-D torch.float8_e4m3fn tensor, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
    rows, length = data.shape
    if length % FP8_BLOCK:
        raise ValueError(f"data_{name}: last dimension ({length}) must be a multiple of {FP8_BLOCK}")
    want = (rows, length // FP8_BLOCK) if block == (1, FP8_BLOCK) else (-(-rows // FP8_BLOCK), length // FP8_BLOCK)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise ValueError(f"scales_{name}: expected float32 {want} for block {block}, got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {tuple(getattr(scales, 'shape', ()))}")
    if scales.device != data.device:
        raise ValueError(f"scales_{name}: expected device {data.device}, got {scales.device}")
    return rows


def _pad_fp8(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad e4m3 ``data`` [R, L] by ``rows`` rows and ``cols`` columns (through its bytes)."""
    if not rows and not cols:
        return data
    return torch.nn.functional.pad(data.view(torch.uint8), (0, cols, 0, rows)).view(data.dtype)


def fp8_blockwise_scaled_mm(
    data_a: torch.Tensor, scales_a: torch.Tensor, block_a, data_b: torch.Tensor, scales_b: torch.Tensor,
    block_b, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Real FP8 GEMM ``A @ B^T`` on blockwise-quantized operands through ``torch._scaled_mm``.

    data_a float8_e4m3fn [R, L] with scales_a float32 [R, L/128] (block_a (1, 128)); data_b
    float8_e4m3fn [C, L] with scales_b float32 [C, L/128] (block_b (1, 128)) or [ceil(C/128), L/128]
    (block_b (128, 128)). L a multiple of 128; R and C any (an empty product, R, C or L zero, is
    zeros without a GEMM). Returns ``out_dtype`` [R, C] (cuBLAS computes bfloat16 for blockwise
    scaling). Raises ValueError for operands that do not fit.

    What cuBLAS is handed (torch 2.11's ``_scaled_mm`` on sm_90): A's 1x128 scales outer-dim-major
    ([R, L/128] with strides (1, R)); B's 1x128 scales as [L/128, C] row-major; B's 128x128 scales
    as the transposed view [L/128, C/128] of a contiguous [C/128, L/128] buffer. Padding, all with
    zero data (which adds nothing to the product) and unit scales:
      * with 128x128 scales, the reduction dimension to a multiple of 4 blocks of 128: cuBLAS reads
        those scales with a leading dimension rounded up to 4 blocks (on an H200, unpadded, the
        product was off by 42-64% of its largest value for L/128 % 4 in {1, 2, 3}) and torch 2.11
        accepts no padded scale view; the 1x128 x 1x128 layout computed right unpadded for every
        L/128 % 4 and is not padded;
      * R and C to multiples of 128, so that both operands are whole 128-row blocks.
    Checked on an H200 against dequantize-then-matmul for L/128 in 4..9 and (R, C) in (200, 328),
    (128, 256), (72, 136) (``tests/test_recipes_gpu.py``).
    """
    if tuple(block_a) != (1, FP8_BLOCK):
        raise ValueError(f"block_a: expected (1, {FP8_BLOCK}), got {block_a!r}")
    block_b = tuple(block_b)
    if block_b not in ((1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK)):
        raise ValueError(f"block_b: expected (1, {FP8_BLOCK}) or ({FP8_BLOCK}, {FP8_BLOCK}), got {block_b!r}")
    rows_a = _check_fp8_operand(data_a, scales_a, (1, FP8_BLOCK), "a")
    rows_b = _check_fp8_operand(data_b, scales_b, block_b, "b")
    if data_b.shape[1] != data_a.shape[1] or data_b.device != data_a.device:
        raise ValueError(f"data_b: expected reduction dimension {data_a.shape[1]} on {data_a.device}, got "
                         f"shape {tuple(data_b.shape)} on {data_b.device}")
    if not rows_a or not rows_b or not data_a.shape[1]:  # an empty product: nothing for cuBLAS to do
        return torch.zeros(rows_a, rows_b, dtype=out_dtype, device=data_a.device)
    pad = torch.nn.functional.pad
    extra_k = -scales_a.shape[1] % 4 if block_b == (FP8_BLOCK, FP8_BLOCK) else 0
    pad_a, pad_b = -rows_a % FP8_BLOCK, -rows_b % FP8_BLOCK
    data_a = _pad_fp8(data_a, pad_a, extra_k * FP8_BLOCK)
    data_b = _pad_fp8(data_b, pad_b, extra_k * FP8_BLOCK)
    if pad_a or extra_k:
        scales_a = pad(scales_a, (0, extra_k, 0, pad_a), value=1.0)
    if block_b == (1, FP8_BLOCK) and (pad_b or extra_k):
        scales_b = pad(scales_b, (0, extra_k, 0, pad_b), value=1.0)
    elif extra_k:
        scales_b = pad(scales_b, (0, extra_k), value=1.0)
    sa = scales_a.t().contiguous().t()
    sb = scales_b.t().contiguous() if block_b == (1, FP8_BLOCK) else scales_b.contiguous().t()
    out = torch._scaled_mm(data_a, data_b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    if pad_a or pad_b:
        out = out[:rows_a, :rows_b]
    return out.to(out_dtype)


def _quantize_fp8_operand(quantizer: str, t: torch.Tensor, block: tuple[int, int]):
    """Blockwise FP8 of one real-GEMM operand: the native 1x128 quantizer (``moe_fp4.ops``, the same
    bits as the spec) for BF16 CUDA operands when it is built and ``quantizer`` is not "eager",
    else the spec (compiled or eager as ``quantizer`` says). t: [R, C]. Returns (float8_e4m3fn [R, C],
    float32 scales [R/bm, C/bn])."""
    if block == (1, FP8_BLOCK) and quantizer != "eager" and t.is_cuda and t.dtype == torch.bfloat16:
        from moe_fp4 import ops

        if ops.native_available():
            return ops.quantize_fp8_blockwise(t.contiguous())
    return run_quantizer(quantizer, q_fp8_blockwise, t, None, block)


def _layout_refused(key: str, strict: bool) -> bool:
    """Whether ``torch._scaled_mm`` is known to fail (refuse or miscompute) layout ``key``, so the
    emulation runs instead (never when ``strict``: then the failure is raised again)."""
    return isinstance(_SCALED_MM_STATE.get(key), str) and not strict


def scaled_mm_checked(da, sa, block_a, db, sb, block_b, gemm: str, strict: bool) -> torch.Tensor | None:
    """``fp8_blockwise_scaled_mm`` of quantized operands (``da``/``sa`` float8_e4m3fn [R, L] with
    float32 scales for ``block_a``, ``db``/``sb`` [C, L] for ``block_b``), bfloat16 [R, C]; or None
    when torch._scaled_mm refuses this layout or its first result differed from the emulation of the
    same operands (a warning says so once; ``strict``: raise instead). GEMM ``gemm`` names the warning."""
    if not da.shape[0] or not db.shape[0] or not da.shape[1]:  # empty: zeros, nothing to check
        return fp8_blockwise_scaled_mm(da, sa, block_a, db, sb, block_b)
    key = _layout_key(block_a, block_b, da.shape[1] // FP8_BLOCK)
    if _layout_refused(key, strict):
        return None
    state = _SCALED_MM_STATE.get(key)
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
    return out


def _try_scaled_mm_nt(a: torch.Tensor, b: torch.Tensor, gemm: str, strict: bool,
                      quantizer: str = "auto") -> torch.Tensor | None:
    role_a, role_b = GEMM_ROLES[gemm]
    block_a, block_b = FP8BlockwiseRecipe.operand_block(role_a), FP8BlockwiseRecipe.operand_block(role_b)
    if _layout_refused(_layout_key(block_a, block_b, a.shape[1] // FP8_BLOCK), strict):
        return None
    da, sa = _quantize_fp8_operand(quantizer, a, block_a)
    db, sb = _quantize_fp8_operand(quantizer, b, block_b)
    return scaled_mm_checked(da, sa, block_a, db, sb, block_b, gemm, strict)


RECIPES = (MXFP8Recipe, NVFP4Recipe, MXFP4Recipe, FP8BlockwiseRecipe)
