"""Payload codecs: how one token's hidden vector becomes one opaque byte row on the wire.

Every codec turns x [T, H] into uint8 rows [T, row_bytes(H)] (NCCL and gloo cannot carry float8
dtypes, and a single byte dtype lets every format share one all-to-all). The bytes are those of the
numeric spec (``moe_fp4.formats``), produced through ``moe_fp4.ops`` where an op exists (native
kernels on CUDA, the spec itself elsewhere). Row layouts:

  bf16    H bf16 values                                         2H bytes
  fp8     H E4M3 bytes, then H/128 FP32 power-of-two scales      H + H/32 bytes
          (1x128 blocks, ``quantize_fp8_blockwise``)
  mxfp4   H/2 packed E2M1 bytes, then H/32 UE8M0 scale bytes     H/2 + H/32 bytes
          (``quantize_mxfp4`` + ``pack_mxfp4_rows``)
  nvfp4   H/2 packed E2M1 bytes, H/16 E4M3 block scales, then    H/2 + H/16 + 4 bytes
          the sender's FP32 tensor scale (the same in each row of one sender's batch:
          ``quantize_nvfp4`` of the sender's whole [T, H])

Each codec also decodes rows back to values and converts them to the FP8 1x128 operand of the
expert GEMMs (``to_fp8_blockwise``): fp8 rows are that operand already, mxfp4 rows go through the
direct MXFP4 -> FP8 conversion (no BF16 detour), bf16 and nvfp4 rows are quantized from their values.
"""

from __future__ import annotations

import torch

from moe_fp4 import formats, ops
from moe_fp4.ep import _triton_rows
from moe_fp4.formats._checks import describe

FP8_GROUP = formats.FP8_GROUP


_WORDS = (torch.int64, torch.int32, torch.int16)


def gather_rows(t: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """t[index] for a 2-D tensor whose rows may be a strided slice of wider rows: t [n, m] (any
    dtype, last dimension contiguous), index int64 [N] -> [N, m] contiguous, same dtype.

    Rows move as the widest machine words that divide them (a byte row of 3808 bytes moves as 476
    int64), so the copy runs at memory speed whatever the payload's element type. ``out``: an [N, m]
    tensor of t's dtype with a contiguous last dimension to write into (e.g. a slice of a receive
    buffer, or a view of wider rows)."""
    nbytes = t.shape[1] * t.element_size()
    for word in _WORDS:
        size = word.itemsize
        if (size > t.element_size() and nbytes % size == 0 and (t.stride(0) * t.element_size()) % size == 0
                and (t.storage_offset() * t.element_size()) % size == 0 and t.stride(1) == 1):
            try:
                words = t.view(word)
                if out is None:
                    return words.index_select(0, index).view(t.dtype)
                torch.index_select(words, 0, index, out=out.view(word))
                return out
            except RuntimeError:  # a view the allocator's alignment does not allow: copy as is
                break
    if out is None:
        return t.index_select(0, index)
    torch.index_select(t, 0, index, out=out)
    return out


def _check_rows(rows: torch.Tensor, width: int, hidden: int, name: str = "rows") -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"{name}: expected uint8 [N, {width}] rows, got {describe(rows)}")
    if rows.shape[1] != width:
        raise ValueError(f"{name}: expected {width} bytes per row for hidden={hidden}, got {rows.shape[1]}")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """[N, m] tensor of any dtype -> uint8 [N, m * itemsize] (a view of contiguous data)."""
    return t.contiguous().view(torch.uint8)


class PayloadCodec:
    """One wire format. Subclasses set ``name`` and ``hidden_multiple`` and implement the methods.

    encode: x float32/bfloat16/float16 [T, H] -> uint8 [T, row_bytes(H)]
    decode: uint8 [N, row_bytes(H)] -> ``dtype`` [N, H] (the values the rows stand for)
    to_fp8_blockwise: uint8 [N, row_bytes(H)] -> (float8_e4m3fn [N, H], float32 [N, H/128])
    """

    name = "codec"
    hidden_multiple = 32
    rowwise = True  # each row depends on its own token only (so a batch may be encoded in slices)

    def check_hidden(self, hidden: int, name: str = "x") -> None:
        if hidden <= 0 or hidden % self.hidden_multiple:
            raise ValueError(f"{name}: hidden size {hidden} must be a positive multiple of "
                             f"{self.hidden_multiple} for the {self.name} payload")

    def row_bytes(self, hidden: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_x(x)
        if x.shape[0] == 0:  # (no token: the quantizers are not called)
            return self.empty_rows(x.shape[1], x.device)
        return self._encode(x)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """encode of a checked x of at least one token."""
        raise NotImplementedError

    def encode_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """encode(x) written into out (uint8 [T, row_bytes(H)], contiguous rows, e.g. a staging buffer)."""
        if out.shape != (x.shape[0], self.row_bytes(x.shape[1])):
            raise ValueError(f"out: expected shape {(x.shape[0], self.row_bytes(x.shape[1]))}, got {tuple(out.shape)}")
        out.copy_(self.encode(x))
        return out

    def encode_push(self, x: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, *,
                    max_blocks: int | None = None) -> None:
        """encode(x) with row t stored into row dest_rows[t, d] of each dests[d]: the direct dispatch's
        push into every rank's receive buffer. Default: encode, then ``ops.scatter_rows``.

        x: float32/bfloat16/float16 [T, H]; dests: 1 to 8 uint8 tensors [R_d, row_bytes(H)] with
        back-to-back rows; dest_rows: int64 [T, len(dests)] on x's device (negative or >= R_d:
        skipped); max_blocks: at most this many thread blocks for the storing kernel (None: fill the
        GPU; see ``ops.quantize_mxfp4_rows_multi``). Writes in place and returns None; other rows of
        the destinations are untouched."""
        ops.scatter_rows(self.encode(x), dests, dest_rows, max_blocks=max_blocks)

    def decode(self, rows: torch.Tensor, hidden: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if rows.shape[0] == 0:
            return torch.empty(0, hidden, dtype=dtype, device=rows.device)
        return self._decode(rows, hidden, dtype)

    def _decode(self, rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def to_fp8_blockwise(self, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Default: decode to float32, then the spec's (or native) FP8 1x128 quantization."""
        if hidden % FP8_GROUP:
            raise ValueError(f"hidden: FP8 1x128 output needs a multiple of {FP8_GROUP}, got {hidden}")
        values = self.decode(rows, hidden)
        return _quantize_fp8(values)

    def gather_fp8_blockwise(self, rows: torch.Tensor, hidden: int,
                             index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows uint8 [n, row_bytes(H)], index int64 [N] -> the FP8 1x128 operand of rows[index]:
        (float8_e4m3fn [N, H], float32 [N, H/128]). Converts each row once, then gathers."""
        data, scales = self.to_fp8_blockwise(rows, hidden)
        return gather_rows(data, index), gather_rows(scales, index)

    def expand_fp8_blockwise(self, rows: torch.Tensor, hidden: int, slot_table: torch.Tensor, num_rows: int,
                             index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 1x128 expert rows of a dispatch: rows uint8 [n, row_bytes(H)] one per received
        token; slot_table int64 [n, k], the output row of each (token, slot) (-1: none); index int64
        [num_rows], the token of each output row (the same map, inverted) -> (float8_e4m3fn
        [num_rows, H], float32 [num_rows, H/128]). Default: ``gather_fp8_blockwise(rows, hidden, index)``."""
        return self.gather_fp8_blockwise(rows, hidden, index)

    def expands_in_place(self, rows: torch.Tensor, hidden: int, k: int) -> bool:
        """Whether ``expand_fp8_blockwise_into`` can convert these rows (rows' device and the payload's
        kernels) into a caller's output, block by block (the dispatch then converts each block of
        received rows as it lands). Default: no."""
        return False

    def expand_fp8_blockwise_into(self, rows: torch.Tensor, hidden: int, slot_table: torch.Tensor,
                                  out: tuple[torch.Tensor, torch.Tensor], copy_to: torch.Tensor | None = None,
                                  copy_rows: torch.Tensor | None = None) -> None:
        """The FP8 1x128 of each row written in place to its slots' rows of out = (float8_e4m3fn
        [R, H], float32 [R, H/128]); slots -1 (or outside [0, R)) skipped, other rows untouched; with
        copy_to (uint8 rows) the rows that name an output row are also copied there in the same pass
        (to row t, or to row copy_rows[t]). Only where ``expands_in_place`` says so."""
        raise NotImplementedError(f"the {self.name} payload has no in-place expansion")

    def encode_push_expand(self, x: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, fp8_dest: int,
                           slot_table: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor], *,
                           max_blocks: int | None = None) -> None:
        """``encode_push``, and the rows stored to dests[fp8_dest] expanded into out as
        ``expand_fp8_blockwise_into`` would (slot_table [rows of that destination, k]), in the same
        pass. Only where ``expands_in_place`` says so."""
        raise NotImplementedError(f"the {self.name} payload has no in-place expansion")

    def empty_rows(self, hidden: int, device) -> torch.Tensor:
        return torch.empty(0, self.row_bytes(hidden), dtype=torch.uint8, device=device)

    def _check_x(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected a float32/bfloat16/float16 tensor, got {got}")
        if x.dim() != 2:
            raise ValueError(f"x: expected 2 dimensions [T, H], got shape {tuple(x.shape)}")
        self.check_hidden(x.shape[1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if values.shape[0] == 0:
        h = values.shape[1]
        return (torch.empty(0, h, dtype=torch.float8_e4m3fn, device=values.device),
                torch.empty(0, h // FP8_GROUP, dtype=torch.float32, device=values.device))
    return ops.quantize_fp8_blockwise(values)


class BF16Payload(PayloadCodec):
    """BF16 values as bytes (2H per row): the exact payload."""

    name = "bf16"

    def row_bytes(self, hidden: int) -> int:
        self.check_hidden(hidden, "hidden")
        return 2 * hidden

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return _bytes_of(x.to(torch.bfloat16))

    def encode_into(self, x, out):
        self._check_x(x)
        if out.shape != (x.shape[0], 2 * x.shape[1]) or out.dtype != torch.uint8:
            raise ValueError(f"out: expected uint8 {(x.shape[0], 2 * x.shape[1])}, got {out.dtype} {tuple(out.shape)}")
        out.view(torch.bfloat16).copy_(x)
        return out

    def encode_push(self, x, dests, dest_rows, *, max_blocks=None):
        self._check_x(x)
        if x.dtype != torch.bfloat16 or (x.shape[1] and x.stride(1) != 1):
            x = x.to(torch.bfloat16).contiguous()
        ops.scatter_rows(x.view(torch.uint8), dests, dest_rows, max_blocks=max_blocks)  # the tokens' bytes as they are

    def _decode(self, rows, hidden, dtype):
        return rows.contiguous().view(torch.bfloat16).to(dtype)

    def to_fp8_blockwise(self, rows, hidden):
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if hidden % FP8_GROUP:
            raise ValueError(f"hidden: FP8 1x128 output needs a multiple of {FP8_GROUP}, got {hidden}")
        return _quantize_fp8(rows.contiguous().view(torch.bfloat16))  # the BF16 values as they are


class FP8Payload(PayloadCodec):
    """E4M3 with one FP32 power-of-two scale per 1x128 block (``quantize_fp8_blockwise``)."""

    name = "fp8"
    hidden_multiple = FP8_GROUP

    def row_bytes(self, hidden: int) -> int:
        self.check_hidden(hidden, "hidden")
        return hidden + 4 * (hidden // FP8_GROUP)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        data, scales = _quantize_fp8(x)
        return torch.cat((data.view(torch.uint8), _bytes_of(scales)), dim=1)

    def encode_push(self, x, dests, dest_rows, *, max_blocks=None):
        """One fused kernel on CUDA for bfloat16 x (``ops.quantize_fp8_blockwise_rows_multi``)."""
        self._check_x(x)
        if x.shape[0]:
            ops.quantize_fp8_blockwise_rows_multi(x, dests, dest_rows, max_blocks=max_blocks)

    def split(self, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows uint8 [N, H + H/32] -> (float8_e4m3fn [N, H], float32 [N, H/128]), contiguous copies."""
        _check_rows(rows, self.row_bytes(hidden), hidden)
        data = rows[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        scales = rows[:, hidden:].contiguous().view(torch.float32)
        return data, scales

    def _decode(self, rows, hidden, dtype):
        data, scales = self.split(rows, hidden)
        return formats.dequantize_fp8_blockwise(data, scales, block=(1, FP8_GROUP), dtype=dtype)

    def to_fp8_blockwise(self, rows, hidden):
        return self.split(rows, hidden)

    def gather_fp8_blockwise(self, rows, hidden, index):
        _check_rows(rows, self.row_bytes(hidden), hidden)
        # gather straight out of the byte rows: one pass, no intermediate copy
        data = gather_rows(rows[:, :hidden], index).view(torch.float8_e4m3fn)
        scales = gather_rows(rows[:, hidden:], index).view(torch.float32)
        return data, scales


class MXFP4Payload(PayloadCodec):
    """MXFP4 byte rows: packed E2M1 (H/2 bytes) then UE8M0 scales (H/32 bytes), ``pack_mxfp4_rows``.

    scale_rounding: "up" (the spec's default) or "down" (OCP floor)."""

    name = "mxfp4"

    def __init__(self, scale_rounding: str = "up"):
        if scale_rounding not in ("up", "down"):
            raise ValueError(f"scale_rounding: expected 'up' or 'down', got {scale_rounding!r}")
        self.scale_rounding = scale_rounding

    def row_bytes(self, hidden: int) -> int:
        self.check_hidden(hidden, "hidden")
        return formats.mxfp4_row_bytes(hidden)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quantize_mxfp4_rows(x, scale_rounding=self.scale_rounding)

    def encode_into(self, x, out):
        self._check_x(x)
        if out.shape != (x.shape[0], self.row_bytes(x.shape[1])) or out.dtype != torch.uint8:
            raise ValueError(f"out: expected uint8 {(x.shape[0], self.row_bytes(x.shape[1]))}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        if x.shape[0]:
            ops.quantize_mxfp4_rows(x, scale_rounding=self.scale_rounding, out=out)  # straight into out
        return out

    def encode_push(self, x, dests, dest_rows, *, max_blocks=None):
        """One fused kernel on CUDA for bfloat16 x: each token read and encoded once, its row stored
        into every destination (``ops.quantize_mxfp4_rows_multi``): no staging copy, no packing pass."""
        self._check_x(x)
        if x.shape[0]:
            ops.quantize_mxfp4_rows_multi(x, dests, dest_rows, scale_rounding=self.scale_rounding,
                                          max_blocks=max_blocks)

    def _decode(self, rows, hidden, dtype):
        packed, scales = formats.unpack_mxfp4_rows(rows, hidden)
        return formats.dequantize_mxfp4(packed, scales, dtype=dtype)

    def to_fp8_blockwise(self, rows, hidden):
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if hidden % FP8_GROUP:
            raise ValueError(f"hidden: FP8 1x128 output needs a multiple of {FP8_GROUP}, got {hidden}")
        if rows.shape[0] == 0:
            return _quantize_fp8(torch.empty(0, hidden, device=rows.device))
        data, fp32_scales, _underflow = ops.mxfp4_rows_to_fp8_blockwise(rows, hidden)
        return data, fp32_scales

    def expand_fp8_blockwise(self, rows, hidden, slot_table, num_rows, index):
        """One pass on CUDA: each received token converted once and written to each of its expert
        rows, no per-token FP8 copy to gather from (bit-exact with the spec): the native kernel
        (``ops.mxfp4_rows_expand_fp8_blockwise``), else the Triton one (``_triton_rows``)."""
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if rows.is_cuda and ops.native_available() and hidden % FP8_GROUP == 0 and slot_table.shape[1] <= 32:
            return ops.mxfp4_rows_expand_fp8_blockwise(rows, hidden, slot_table, num_rows)
        if _triton_rows.available(rows) and hidden % FP8_GROUP == 0 and rows.stride(-1) == 1:
            return _triton_rows.mxfp4_rows_to_fp8_scatter(rows, hidden, slot_table, num_rows)
        return super().expand_fp8_blockwise(rows, hidden, slot_table, num_rows, index)

    def expands_in_place(self, rows, hidden, k):
        """CUDA rows with the native ops built (``ops.mxfp4_rows_expand_fp8_blockwise`` with ``out``)."""
        return rows.is_cuda and ops.native_available() and hidden % FP8_GROUP == 0 and 1 <= k <= 32

    def expand_fp8_blockwise_into(self, rows, hidden, slot_table, out, copy_to=None, copy_rows=None):
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if rows.shape[0]:
            ops.mxfp4_rows_expand_fp8_blockwise(rows, hidden, slot_table, out=out, copy_to=copy_to,
                                                copy_rows=copy_rows)

    def encode_push_expand(self, x, dests, dest_rows, fp8_dest, slot_table, out, *, max_blocks=None):
        """One kernel on CUDA for bfloat16 x: each token encoded once, its row stored to every
        destination, and a row for dests[fp8_dest] also converted from the staged row to its FP8
        expert rows while the stores to the other destinations are in flight."""
        self._check_x(x)
        if x.shape[0]:
            ops.quantize_mxfp4_rows_multi(x, dests, dest_rows, scale_rounding=self.scale_rounding, fp8_dest=fp8_dest,
                                          fp8_slots=slot_table, fp8_out=out, max_blocks=max_blocks)


class NVFP4Payload(PayloadCodec):
    """NVFP4 rows (formats.pack_nvfp4_rows): packed E2M1 (H/2), E4M3 block scales per 16 (H/16), the
    sender's FP32 tensor scale (4 bytes). The tensor scale comes from the amax of the sender's whole
    batch, as ``quantize_nvfp4(x)`` (``ops.quantize_nvfp4_rows``: native on CUDA, no host sync);
    each row carries it, so rows of several senders decode together (no host sync either)."""

    name = "nvfp4"
    rowwise = False  # the tensor scale comes from the whole batch

    def row_bytes(self, hidden: int) -> int:
        self.check_hidden(hidden, "hidden")
        return formats.nvfp4_row_bytes(hidden)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return ops.quantize_nvfp4_rows(x)

    def split(self, rows: torch.Tensor, hidden: int):
        """rows -> (packed uint8 [N, H/2], scales float8_e4m3fn [N, H/16], global scale float32 [N])."""
        _check_rows(rows, self.row_bytes(hidden), hidden)
        return formats.unpack_nvfp4_rows(rows, hidden)

    def _decode(self, rows, hidden, dtype):
        return formats.dequantize_nvfp4_rows(*self.split(rows, hidden), dtype=dtype)

    def to_fp8_blockwise(self, rows, hidden):
        """One pass (``ops.nvfp4_rows_to_fp8_blockwise``: native on CUDA): the bits of decoding to
        float32 and quantizing to FP8 1x128."""
        _check_rows(rows, self.row_bytes(hidden), hidden)
        if hidden % FP8_GROUP:
            raise ValueError(f"hidden: FP8 1x128 output needs a multiple of {FP8_GROUP}, got {hidden}")
        if rows.shape[0] == 0:
            return _quantize_fp8(torch.empty(0, hidden, device=rows.device))
        return ops.nvfp4_rows_to_fp8_blockwise(rows, hidden)


PAYLOADS: dict[str, type[PayloadCodec]] = {
    "bf16": BF16Payload,
    "fp8": FP8Payload,
    "mxfp4": MXFP4Payload,
    "nvfp4": NVFP4Payload,
}
PAYLOAD_IDS = {name: i for i, name in enumerate(PAYLOADS)}


def fused_wire(codec: PayloadCodec) -> str | None:
    """The name of a built-in wire layout the Triton combine decodes inside its sum, or None."""
    return codec.name if type(codec) in (BF16Payload, FP8Payload, MXFP4Payload) else None


def get_payload(payload) -> PayloadCodec:
    """A codec from its name ("bf16", "fp8", "mxfp4", "nvfp4") or a PayloadCodec instance."""
    if isinstance(payload, PayloadCodec):
        return payload
    if isinstance(payload, str) and payload in PAYLOADS:
        return PAYLOADS[payload]()
    raise ValueError(f"payload: expected one of {sorted(PAYLOADS)} or a PayloadCodec, got {payload!r}")


__all__ = ["PayloadCodec", "BF16Payload", "FP8Payload", "MXFP4Payload", "NVFP4Payload", "PAYLOADS",
           "get_payload"]
