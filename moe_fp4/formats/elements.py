"""Element codecs: float32 <-> small floating-point codes, and the UE8M0 scale byte.

Every codec here works in float32 bit space with integer arithmetic, so it gives the same codes on
CPU and GPU and is the reference that the CUDA kernels match bit for bit.

Encoding rules (all formats):
  * round to nearest, ties to even (``rounding="nearest"``), or stochastic rounding
    (``rounding="stochastic"``: round up with probability equal to the discarded fraction of an ulp,
    random bits drawn from the given ``torch.Generator``);
  * saturating: finite values beyond the largest magnitude, and +-Inf, become +-max;
  * the sign of zero is kept (-0.0 encodes to the sign bit alone);
  * NaN: E4M3 and E5M2 encode it as ``0x7F`` with the input's sign bit; E2M1, E2M3 and E3M2 have no
    NaN and encode it as +0 (the MX block codecs flag such blocks through their scale byte instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4.formats._checks import value_checks


@dataclass(frozen=True)
class ElementFormat:
    """A sign + exponent + mantissa floating-point element format."""

    name: str
    ebits: int  # exponent bits
    mbits: int  # mantissa bits
    bias: int  # exponent bias
    max_code: int  # magnitude code of the largest finite value
    nan_code: int | None  # magnitude code written for NaN, None when the format has no NaN
    inf_code: int | None = None  # magnitude code of Inf (decoding only: encoding saturates)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value (floor(log2(max_value)))."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_value(self) -> float:
        return _magnitude_value(self, self.max_code)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)


def _magnitude_value(fmt: ElementFormat, code: int) -> float:
    e_field, m = code >> fmt.mbits, code & ((1 << fmt.mbits) - 1)
    if e_field == 0:
        return m * 2.0 ** (fmt.emin - fmt.mbits)
    return (1 + m / 2**fmt.mbits) * 2.0 ** (e_field - fmt.bias)


E2M1 = ElementFormat("e2m1", 2, 1, 1, max_code=0x7, nan_code=None)  # FP4, max 6
E2M3 = ElementFormat("e2m3", 2, 3, 1, max_code=0x1F, nan_code=None)  # FP6, max 7.5
E3M2 = ElementFormat("e3m2", 3, 2, 3, max_code=0x1F, nan_code=None)  # FP6, max 28
E4M3 = ElementFormat("e4m3", 4, 3, 7, max_code=0x7E, nan_code=0x7F)  # FP8, max 448, no Inf
E5M2 = ElementFormat("e5m2", 5, 2, 15, max_code=0x7B, nan_code=0x7F, inf_code=0x7C)  # FP8, max 57344

ELEMENT_FORMATS: dict[str, ElementFormat] = {f.name: f for f in (E2M1, E2M3, E3M2, E4M3, E5M2)}

ROUNDING_MODES = ("nearest", "stochastic")


def element_format(fmt: str | ElementFormat, argname: str = "fmt") -> ElementFormat:
    if isinstance(fmt, ElementFormat):
        return fmt
    if fmt not in ELEMENT_FORMATS:
        raise ValueError(f"{argname}: expected one of {sorted(ELEMENT_FORMATS)}, got {fmt!r}")
    return ELEMENT_FORMATS[fmt]


def check_rounding(rounding: str, generator: torch.Generator | None) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding: expected one of {ROUNDING_MODES}, got {rounding!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")


def _float32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of a float32 tensor as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _random_bits(shape, nbits: int, generator, device) -> torch.Tensor:
    return torch.randint(0, 1 << nbits, shape, generator=generator, device=device, dtype=torch.int64)


# Stochastic rounding draws this many random bits; discarded fractions finer than 2^-SR_BITS of an
# ulp round down (a bias below 2^-24 of an ulp).
_SR_BITS = 48


def encode_elements(
    x: torch.Tensor,
    fmt: str | ElementFormat,
    *,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Encode float32 values to codes of ``fmt`` (uint8, one code per byte, sign in the top used bit).

    x: float32 tensor of any shape. Returns uint8 of the same shape. See the module docstring for the
    rounding, saturation, signed-zero and NaN rules.
    """
    f = element_format(fmt)
    check_rounding(rounding, generator)
    if x.dtype != torch.float32:
        raise ValueError(f"x: expected dtype torch.float32, got {x.dtype}")
    u = _float32_bits(x)
    sign = (u >> 31) & 1
    exp32 = (u >> 23) & 0xFF
    mant = u & 0x7FFFFF
    is_nan = (exp32 == 0xFF) & (mant != 0)
    # float32 subnormals: exponent field 0 means 2^-126 with no implicit bit.
    e = torch.clamp(exp32, min=1) - 127
    sig = mant | ((exp32 > 0).to(torch.int64) << 23)  # 24-bit significand
    # Bits to drop: the mantissa bits the format lacks, plus the extra shift into its subnormal range.
    shift = (23 - f.mbits) + torch.clamp(f.emin - e, min=0)
    shift = torch.clamp(shift, max=_SR_BITS)
    if rounding == "nearest":
        q = sig >> shift
        rem = sig & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        q = q + round_up.to(torch.int64)
    else:
        r = _random_bits(sig.shape, _SR_BITS, generator, sig.device) >> (_SR_BITS - shift)
        q = (sig + r) >> shift
    # q counts ulps of the (normal or subnormal) binade; adding the exponent offset gives the code,
    # and a carry out of the mantissa moves into the exponent field by itself.
    code = q + (torch.clamp(e - f.emin, min=0) << f.mbits)
    code = torch.clamp(code, max=f.max_code)  # saturate (also +-Inf)
    nan_code = f.nan_code if f.nan_code is not None else 0
    nan_sign = sign if f.nan_code is not None else torch.zeros_like(sign)
    code = torch.where(is_nan, nan_code + nan_sign * f.sign_bit, code + sign * f.sign_bit)
    return code.to(torch.uint8)


def decode_table(fmt: str | ElementFormat, device=None) -> torch.Tensor:
    """float32 [2^bits]: the value of every code of ``fmt`` (NaN codes give NaN)."""
    f = element_format(fmt)
    values = []
    for code in range(1 << f.bits):
        mag = code & (f.sign_bit - 1)
        if mag <= f.max_code:
            v = _magnitude_value(f, mag)
        else:  # above the largest finite code: Inf where the format has it, NaN otherwise
            v = float("inf") if mag == f.inf_code else float("nan")
        values.append(-v if code & f.sign_bit else v)
    return torch.tensor(values, dtype=torch.float32, device=device)


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def decode_elements(codes: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Decode uint8 codes of ``fmt`` to float32 (exact). codes: uint8, any shape."""
    f = element_format(fmt)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    if f.bits < 8 and value_checks() and codes.numel() and int(codes.max()) >= (1 << f.bits):
        raise ValueError(f"codes: {f.name} codes must be below {1 << f.bits}, got {int(codes.max())}")
    key = (f.name, str(codes.device))
    if key not in _TABLES:
        _TABLES[key] = decode_table(f, device=codes.device)
    return _TABLES[key][codes.long()]


# ---------------------------------------------------------------------------------------------
# UE8M0 (the MX scale byte) and exact powers of two
# ---------------------------------------------------------------------------------------------

UE8M0_NAN = 0xFF


def pow2_float32(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^exponent as float32 from an integer tensor: subnormals down to 2^-149, 0 below that,
    +Inf above 2^127. Built from bits, so it is exact on every device."""
    e = exponent.to(torch.int64)
    normal_bits = torch.clamp(e + 127, 1, 255) << 23
    sub_bits = torch.where(e >= -149, 1 << torch.clamp(e + 149, 0, 22), torch.zeros_like(e))
    bits = torch.where(e >= -126, normal_bits, sub_bits)
    bits = torch.where(e > 127, torch.full_like(e, 0x7F800000), bits)
    return bits.to(torch.int32).view(torch.float32)


def decode_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32: byte e means 2^(e-127) (byte 0 is the subnormal 2^-127); 0xFF is NaN."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales: expected dtype torch.uint8, got {scales.dtype}")
    e = scales.to(torch.int64)
    v = pow2_float32(e - 127)
    return torch.where(e == UE8M0_NAN, torch.full_like(v, float("nan")), v)


def encode_ue8m0(x: torch.Tensor, *, rounding: str = "up") -> torch.Tensor:
    """Non-negative float32 -> UE8M0 byte, rounding to a power of two in bit space.

    rounding="up": the smallest power of two >= x (bit space: exponent field, plus one when any
    mantissa bit is set); "down": the largest power of two <= x (the exponent field). Results are
    clamped to [0, 254]; NaN and +Inf give 0xFF; zero gives byte 0.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x: expected dtype torch.float32, got {x.dtype}")
    if rounding not in ("up", "down"):
        raise ValueError(f"rounding: expected 'up' or 'down', got {rounding!r}")
    if value_checks() and x.numel() and bool((x < 0).any()):
        raise ValueError("x: expected non-negative values for a UE8M0 scale")
    u = _float32_bits(x)
    exp32 = (u >> 23) & 0xFF
    mant = u & 0x7FFFFF
    if rounding == "up":
        # Normal: the exponent field, plus one when any mantissa bit is set. Subnormal (field 0):
        # 2^-127 is byte 0 itself; anything above it rounds up to byte 1 (2^-126).
        normal_up = exp32 + ((mant != 0) & (exp32 != 0xFF)).to(torch.int64)
        b = torch.where(exp32 == 0, (mant > 0x400000).to(torch.int64), normal_up)
    else:
        b = exp32
    b = torch.clamp(b, max=254)
    return torch.where(exp32 == 0xFF, torch.full_like(b, UE8M0_NAN), b).to(torch.uint8)


def divide_to_float32(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """float32(a / b), correctly rounded once (computed in float64, which is innocuous for a
    float32 quotient), so every backend gives the same bits as CUDA's ``__fdiv_rn``."""
    b64 = b.to(torch.float64) if isinstance(b, torch.Tensor) else float(b)
    return (a.to(torch.float64) / b64).to(torch.float32)


SCALE_ROUNDINGS = ("up", "down")


def mx_scale_bytes(amax: torch.Tensor, fmt: str | ElementFormat, scale_rounding: str = "up") -> torch.Tensor:
    """UE8M0 scale byte of each block from its float32 absolute maximum.

    "up" (default, Mishra et al. 2025, "rceil"): float32(amax / max_value) rounded up to a power of
    two in bit space, so no element saturates (up to the rounding of that division).
    "down" (the OCP MX spec): 2^(floor(log2(amax)) - emax_elem), where emax_elem is the exponent of the
    format's largest value; values above max_value * scale then saturate.
    Zero block -> byte 0. NaN or Inf in the block (amax NaN or Inf) -> 0xFF. Bytes clamp to [0, 254].
    """
    f = element_format(fmt)
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding: expected one of {SCALE_ROUNDINGS}, got {scale_rounding!r}")
    nonfinite = ~torch.isfinite(amax)
    safe = torch.where(nonfinite, torch.zeros_like(amax), amax)
    if scale_rounding == "up":
        b = encode_ue8m0(divide_to_float32(safe, f.max_value), rounding="up").to(torch.int64)
    else:
        exp32 = (_float32_bits(safe) >> 23) & 0xFF
        b = torch.clamp(exp32 - f.emax, 0, 254)
    return torch.where(nonfinite, torch.full_like(b, UE8M0_NAN), b).to(torch.uint8)
