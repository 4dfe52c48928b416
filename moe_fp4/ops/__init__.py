"""Native conversion ops (CUDA, sm_90a) with the signatures of the spec, moe_fp4.formats.

Every op returns exactly the bits that the spec returns for the same inputs. On CPU tensors, or on
CUDA where the extension cannot be built, the op runs the spec itself. The ops are torch.library
custom ops (namespace ``moe_fp4``) with fake implementations, so torch.compile traces them. The
native kernels take rows of at most 2^24 elements (H); longer rows get a RuntimeError naming the
argument. The multi-destination ops also stage 8 byte rows per thread block in shared memory, which
bounds their row width (29,024 bytes on an H100 or H200: H up to 54,624 for MXFP4 rows, 28,032 for
FP8 rows).

  quantize_mxfp4               float [T, H] -> packed E2M1 [T, H/2] + UE8M0 [T, H/32]
  quantize_mxfp4_rows          the same as byte rows [R, H/2 + H/32], optionally at given rows (dispatch)
  quantize_mxfp4_rows_multi    the byte rows of each token written to several destinations at once
                               (the expert-parallel push into every rank's receive buffer)
  quantize_fp8_blockwise_rows_multi  FP8 1x128 byte rows [H E4M3 | H/128 FP32] to several destinations
  scatter_rows                 byte rows copied to several destinations (the push of rows needing no encode)
  quantize_nvfp4_rows          float [T, H] -> NVFP4 byte rows [T, H/2 + H/16 + 4] (E2M1, E4M3 per 16, the
                               FP32 tensor scale of the whole batch): the nvfp4 dispatch payload
  mxfp4_to_fp8_blockwise       MXFP4 -> E4M3 [N, H] + FP32 [N, H/128] (+ underflow count)
  mxfp4_rows_to_fp8_blockwise  the same, reading byte rows
  mxfp4_rows_expand_fp8_blockwise  the same from byte rows, each row written to several output rows (the
                               dispatch's expansion of received tokens to one FP8 row per local expert)
  mxfp4_rows_to_fp8_cols       MXFP4 rows per expert -> E4M3 [H, N] + FP32 [H, G]
  mxfp4_rows_to_fp8_cols_planned  the same for splits held on the host as ints, its plan kept by the caller
  quantize_fp8_blockwise       float [T, H] -> E4M3 [T, H] + FP32 power-of-two scales [T, H/128]
  quantize_fp8_rows_cols       float [M, K] -> FP8 1x128 of x and of x^T in one pass (the GEMM operands of
                               an activation or gradient: fprop/dgrad rows, wgrad columns)
  quantize_fp8_tiles           float [(G,) N, K] -> FP8 128x128 of a weight (stack) and its transpose(s), one pass
  dequantize_mxfp4             MXFP4 [..., H/2] + UE8M0 [..., H/32] -> bfloat16 (or float32/float16) [..., H]
  native_available, build      the extension: whether it is usable here; build/load it
  routing (module)             the dispatch's routing tables by counting kernels: send_layout, expand_layout

The paper names three of them BF16ToFP4Row (quantize_mxfp4), FP4RowToFP8Row (mxfp4_to_fp8_blockwise)
and FP4RowToFP8Col (mxfp4_rows_to_fp8_cols); the code uses the names above throughout.

The extension is compiled with ninja through torch.utils.cpp_extension on first use on a CUDA
device (or by ``python -m moe_fp4 build``) and cached.

Environment variables:
  MOE_FP4_BUILD_DIR      where the compiled extension is cached
                         (default ~/.cache/moe_fp4/torch<version>-cuda<version>)
  MOE_FP4_NATIVE         auto (default): native ops on CUDA when the extension builds, else the spec
                         with a warning; 0: always the spec; 1: a failed build raises
  MOE_FP4_BUILD_VERBOSE  1: print the compiler commands while building
  MOE_FP4_CSRC           the csrc/ folder to build from (default: the one beside the package)
  MOE_FP4_COLUMN_BOX_STORE  unset (default): the one-pass column kernel writes each whole 128-row
                         tile by one tensor copy; 0: every tile by the threads' 16-byte stores (for
                         compute-sanitizer's initcheck, blind to the copy engine)
Each is read once per process: MOE_FP4_NATIVE and MOE_FP4_COLUMN_BOX_STORE at their first use, the
build variables when the extension is built.

Ragged segments (``split_lens`` / ``split_offsets``, int32 or int64 [E] on the input's device): rows
[offsets[e], offsets[e] + lens[e]) belong to expert e; offsets None means back to back from row 0.
The row conversions read them on the device (no host sync); the column conversion needs the total
group count for its output shape and reads the lengths on the host once.
"""

from __future__ import annotations

import torch

from moe_fp4 import formats
from moe_fp4.formats._checks import FLOAT_INPUTS, check_tensor
from moe_fp4.ops import _native, _ops
from moe_fp4.ops import build as _build_command  # noqa: F401  (loaded first: `build` below is the function)
from moe_fp4.ops._ops import mxfp4_rows_to_fp8_cols_planned

__all__ = [
    "build",
    "dequantize_mxfp4",
    "mxfp4_rows_expand_fp8_blockwise",
    "mxfp4_rows_to_fp8_blockwise",
    "mxfp4_rows_to_fp8_cols",
    "mxfp4_rows_to_fp8_cols_planned",
    "mxfp4_to_fp8_blockwise",
    "native_available",
    "nvfp4_rows_to_fp8_blockwise",
    "quantize_fp8_blockwise",
    "quantize_fp8_blockwise_rows_multi",
    "quantize_fp8_rows_cols",
    "quantize_fp8_tiles",
    "quantize_mxfp4",
    "quantize_mxfp4_rows",
    "quantize_mxfp4_rows_multi",
    "quantize_nvfp4_rows",
    "scatter_rows",
]

_INDEX = (torch.int32, torch.int64)


def native_available() -> bool:
    """True when the native ops run here (a Hopper GPU and a built or buildable extension)."""
    return _native.available()


def build(verbose: bool = False):
    """Build (or load from the cache) the native extension and return its module. Raises
    RuntimeError naming what is missing (CUDA torch, toolkit, Hopper GPU, ninja, sources)."""
    return _native.build(verbose=verbose)


# ------------------------------------------------------------------------------------------------
# Argument checks (ValueError naming the argument and what was expected)
# ------------------------------------------------------------------------------------------------


def _tensor(t, name, dtypes, dim=None):
    check_tensor(t, name, dtypes=dtypes, dim=dim)


def _float_rows(x, block):
    _tensor(x, "x", FLOAT_INPUTS, 2)
    if x.shape[1] % block:
        raise ValueError(f"x: last dimension ({x.shape[1]}) must be a multiple of {block}")
    if x.shape[1] and x.stride(1) != 1:
        raise ValueError(f"x: expected a contiguous last dimension, got strides {x.stride()}")
    if x.is_cuda and (x.data_ptr() % 16 or (x.shape[0] > 1 and (x.stride(0) * x.element_size()) % 16)):
        raise ValueError("x: rows must be 16-byte aligned")


def _rounding(scale_rounding):
    if scale_rounding not in ("up", "down"):
        raise ValueError(f"scale_rounding: expected 'up' or 'down', got {scale_rounding!r}")


def _same_device(t, ref, name):
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device}, got {t.device}")


def _splits(split_lens, split_offsets, ref, required=False, host_ok=False):
    # host_ok: the op reads the splits on the host anyway and takes them from the CPU as well
    if split_lens is None:
        if required:
            raise ValueError("split_lens: expected an int32/int64 tensor [E], got None")
        if split_offsets is not None:
            raise ValueError("split_offsets: given without split_lens")
        return
    _tensor(split_lens, "split_lens", _INDEX, 1)
    if not (host_ok and split_lens.device.type == "cpu"):
        _same_device(split_lens, ref, "split_lens")
    if split_offsets is not None:
        _tensor(split_offsets, "split_offsets", (split_lens.dtype,), 1)
        _same_device(split_offsets, split_lens, "split_offsets")
        if split_offsets.shape != split_lens.shape:
            raise ValueError(f"split_offsets: expected shape {tuple(split_lens.shape)}, "
                             f"got {tuple(split_offsets.shape)}")


def _mxfp4_byte_rows(rows, hidden):
    """rows: uint8 [N, H/2 + H/32] MXFP4 byte rows; hidden: H, a multiple of 128 (FP8 1x128 outputs)."""
    _tensor(rows, "rows", (torch.uint8,), 2)
    if not isinstance(hidden, int) or hidden <= 0 or hidden % formats.FP8_GROUP:
        raise ValueError(f"hidden: expected a positive multiple of {formats.FP8_GROUP}, got {hidden!r}")
    if rows.shape[1] != formats.mxfp4_row_bytes(hidden):
        raise ValueError(f"rows: expected {formats.mxfp4_row_bytes(hidden)} bytes per row for hidden {hidden}, "
                         f"got {rows.shape[1]}")


def _packed_scales(packed, scales, fp8=True):
    _tensor(packed, "packed", (torch.uint8,), 2)
    _tensor(scales, "scales", (torch.uint8,), 2)
    _same_device(scales, packed, "scales")
    h = packed.shape[1] * 2
    if tuple(scales.shape) != (packed.shape[0], h // 32) or h % 32:
        raise ValueError(f"scales: expected shape {(packed.shape[0], h // 32)} for packed of shape "
                         f"{tuple(packed.shape)}, got {tuple(scales.shape)}")
    if fp8 and h % formats.FP8_GROUP:
        raise ValueError(f"packed: hidden size {h} (last dimension times 2) must be a multiple of "
                         f"{formats.FP8_GROUP} for FP8 1x128 outputs")


# ------------------------------------------------------------------------------------------------
# Public ops
# ------------------------------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor, *, scale_rounding: str = "up") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 along the last dimension (formats.quantize_mxfp4, round to nearest even).

    x: bfloat16/float32/float16 [T, H], H a multiple of 32, contiguous last dimension.
    scale_rounding: "up" (amax/6 rounded up to a power of two) or "down" (the OCP floor).
    Returns (packed uint8 [T, H/2], element 2i in the low nibble; scales uint8 [T, H/32], UE8M0).
    """
    _float_rows(x, 32)
    _rounding(scale_rounding)
    return _ops.call(_ops.quantize_mxfp4_op, x, scale_rounding)


def quantize_mxfp4_rows(
    x: torch.Tensor,
    *,
    scale_rounding: str = "up",
    out: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize_mxfp4 writing byte rows (the dispatch payload): each token as H/2 packed bytes followed
    by its H/32 scale bytes (formats.pack_mxfp4_rows of formats.quantize_mxfp4).

    x: bfloat16/float32/float16 [T, H], H a multiple of 32.
    out: uint8 [R, H/2 + H/32] written in place, or None for a new [T, H/2 + H/32] tensor in token order.
    row_index: int32/int64 [T] on x's device, the row of out for each token (needs out; values in
      [0, R) and distinct; a token whose row is outside [0, R) is skipped); None: token t -> row t.
    Returns out (or the new tensor). Rows of out that no token targets are left untouched.
    """
    _float_rows(x, 32)
    _rounding(scale_rounding)
    width = formats.mxfp4_row_bytes(x.shape[1])
    if out is None:
        if row_index is not None:
            raise ValueError("out: required when row_index is given (the rows it indexes)")
        return _ops.call(_ops.quantize_mxfp4_rows_op, x, scale_rounding)
    _tensor(out, "out", (torch.uint8,), 2)
    _same_device(out, x, "out")
    if out.shape[1] != width:
        raise ValueError(f"out: expected {width} bytes per row for hidden {x.shape[1]}, got {out.shape[1]}")
    if out.shape[1] and out.stride(1) != 1:
        raise ValueError(f"out: expected a contiguous last dimension, got strides {out.stride()}")
    if row_index is None:
        if out.shape[0] < x.shape[0]:
            raise ValueError(f"out: expected at least {x.shape[0]} rows (one per token), got {out.shape[0]}")
    else:
        _tensor(row_index, "row_index", _INDEX, 1)
        _same_device(row_index, x, "row_index")
        if row_index.shape[0] != x.shape[0]:
            raise ValueError(f"row_index: expected shape ({x.shape[0]},), got {tuple(row_index.shape)}")
    _ops.call(_ops.quantize_mxfp4_rows_into_op, x, scale_rounding, out, row_index)
    return out


MAX_ROW_DESTINATIONS = 8  # csrc/kernels/sm90_launchers.h: kMaxRowDestinations


def _destinations(dests, dest_rows, ref, tokens, width):
    if not isinstance(dests, (list, tuple)) or not 1 <= len(dests) <= MAX_ROW_DESTINATIONS:
        raise ValueError(f"dests: expected a list of 1 to {MAX_ROW_DESTINATIONS} uint8 tensors, got "
                         f"{type(dests).__name__} of {len(dests) if isinstance(dests, (list, tuple)) else '?'}")
    for i, d in enumerate(dests):
        _tensor(d, f"dests[{i}]", (torch.uint8,), 2)
        if d.device != ref.device:  # (a peer's buffer mapped on this GPU is a tensor of this GPU)
            raise ValueError(f"dests[{i}]: expected device {ref.device}, got {d.device}")
        if d.shape[1] != width:
            raise ValueError(f"dests[{i}]: expected {width} bytes per row, got {d.shape[1]}")
        # (a single row still needs contiguous bytes: the kernels store each row as one run)
        if (d.shape[0] > 1 and d.stride(0) != width) or (width > 1 and d.shape[0] and d.stride(1) != 1):
            raise ValueError(f"dests[{i}]: expected back-to-back rows of {width} contiguous bytes, got "
                             f"strides {d.stride()}")
    _tensor(dest_rows, "dest_rows", (torch.int64,), 2)
    _same_device(dest_rows, ref, "dest_rows")
    if tuple(dest_rows.shape) != (tokens, len(dests)):
        raise ValueError(f"dest_rows: expected shape {(tokens, len(dests))}, got {tuple(dest_rows.shape)}")
    if not dest_rows.is_contiguous():
        raise ValueError("dest_rows: expected a contiguous tensor")


def quantize_mxfp4_rows_multi(
    x: torch.Tensor,
    dests: list[torch.Tensor],
    dest_rows: torch.Tensor,
    *,
    scale_rounding: str = "up",
    max_blocks: int | None = None,
    fp8_dest: int | None = None,
    fp8_slots: torch.Tensor | None = None,
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """quantize_mxfp4_rows to several destinations at once: each token is read and encoded once and its byte
    row (quantize_mxfp4_rows' layout) stored into every destination that takes it. The expert-parallel
    dispatch uses it to write straight into every rank's receive buffer (peers' over NVLink).

    x: bfloat16/float32/float16 [T, H], H a multiple of 32 (bfloat16 on CUDA: one fused kernel; other
      dtypes: the rows first, then ``scatter_rows``).
    dests: 1 to 8 uint8 tensors [R_d, H/2 + H/32] with back-to-back rows (on CUDA any memory this GPU
      can address, e.g. a peer's symmetric-memory buffer).
    dest_rows: int64 [T, D] on x's device, contiguous, D = len(dests): token t goes to row
      dest_rows[t, d] of dests[d]; a negative row (or one >= R_d) is skipped. Rows of one destination
      must be distinct (not checked: that would synchronise).
    scale_rounding: "up" or "down", as in quantize_mxfp4.
    max_blocks: launch at most this many thread blocks of 256 threads (their warps stride over the
      tokens), so kernels on other streams find free SM slots while this one runs (the dispatch gives
      a push over NVLink part of the GPU and converts its own rows beside it); None: fill the GPU.
    fp8_dest, fp8_slots, fp8_out: also convert the rows stored to dests[fp8_dest] to FP8 1x128, in
      the same pass (on CUDA from the row the kernel has just staged, while its stores to the other
      destinations are in flight): fp8_slots int64 [R_fp8_dest, k] (1 <= k <= 32), contiguous, the
      output rows of each row of that destination (-1 or outside the output: none); fp8_out
      (float8_e4m3fn [R, H], float32 [R, H/128]), contiguous, written in place as
      ``mxfp4_rows_expand_fp8_blockwise(dests[fp8_dest][rows written], H, fp8_slots[...], out=fp8_out)``
      would (H a multiple of 128); rows no written row names are left untouched.
    Writes in place and returns None; other rows of the destinations are left untouched.
    """
    _float_rows(x, 32)
    _rounding(scale_rounding)
    _destinations(dests, dest_rows, x, x.shape[0], formats.mxfp4_row_bytes(x.shape[1]))
    expand = (-1, None, None, None)
    if fp8_dest is not None or fp8_slots is not None or fp8_out is not None:
        if isinstance(fp8_dest, bool) or not isinstance(fp8_dest, int) or not 0 <= fp8_dest < len(dests):
            raise ValueError(f"fp8_dest: expected a destination index in [0, {len(dests)}), got {fp8_dest!r}")
        h = x.shape[1]
        if h % formats.FP8_GROUP:
            raise ValueError(f"x: FP8 1x128 output needs a hidden size that is a multiple of {formats.FP8_GROUP}, "
                             f"got {h}")
        _tensor(fp8_slots, "fp8_slots", (torch.int64,), 2)
        _same_device(fp8_slots, x, "fp8_slots")
        rows_d = dests[fp8_dest].shape[0]
        if fp8_slots.shape[0] != rows_d or not 1 <= fp8_slots.shape[1] <= 32 or not fp8_slots.is_contiguous():
            raise ValueError(f"fp8_slots: expected a contiguous ({rows_d}, k) tensor with 1 <= k <= 32, got shape "
                             f"{tuple(fp8_slots.shape)} strides {fp8_slots.stride()}")
        data, scales = _fp8_pair(fp8_out, h, x, "fp8_out")
        expand = (fp8_dest, fp8_slots, data, scales)
    _ops.call(_ops.quantize_mxfp4_rows_multi_op, x, scale_rounding, list(dests), dest_rows, _max_blocks(max_blocks),
              *expand)


def _fp8_pair(out, hidden, ref, name):
    """Checks an FP8 1x128 output pair (float8_e4m3fn [R, H], float32 [R, H/128]), both contiguous."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"{name}: expected a (data, scales) pair of tensors, got {type(out).__name__}")
    data, scales = out
    _tensor(data, f"{name}[0]", (torch.float8_e4m3fn,), 2)
    _tensor(scales, f"{name}[1]", (torch.float32,), 2)
    _same_device(data, ref, f"{name}[0]")
    _same_device(scales, ref, f"{name}[1]")
    r = data.shape[0]
    if data.shape[1] != hidden or not data.is_contiguous():
        raise ValueError(f"{name}[0]: expected a contiguous [R, {hidden}] tensor, got shape {tuple(data.shape)} "
                         f"strides {data.stride()}")
    if tuple(scales.shape) != (r, hidden // formats.FP8_GROUP) or not scales.is_contiguous():
        raise ValueError(f"{name}[1]: expected a contiguous {(r, hidden // formats.FP8_GROUP)} tensor, got shape "
                         f"{tuple(scales.shape)} strides {scales.stride()}")
    return data, scales


def _max_blocks(max_blocks):
    if max_blocks is None:
        return 0
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or not 1 <= max_blocks <= 1 << 30:
        raise ValueError(f"max_blocks: expected None or an int in [1, 2**30], got {max_blocks!r}")
    return max_blocks


def quantize_fp8_blockwise_rows_multi(x: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, *,
                                      max_blocks: int | None = None) -> None:
    """quantize_fp8_blockwise to several destinations at once, as byte rows: each token's H E4M3
    bytes followed by its H/128 FP32 scales (the fp8 dispatch payload), stored into every
    destination that takes it (see quantize_mxfp4_rows_multi).

    x: bfloat16/float32/float16 [T, H], H a multiple of 128 (bfloat16 on CUDA: one fused kernel;
      other dtypes: quantize_fp8_blockwise, then ``scatter_rows``);
    dests: 1 to 8 uint8 tensors [R_d, H + H/32] with back-to-back rows;
    dest_rows: int64 [T, D] on x's device, contiguous, D = len(dests) (negative or >= R_d: skipped;
      distinct within a destination);
    max_blocks: as in quantize_mxfp4_rows_multi.
    Writes in place and returns None; other rows of the destinations are left untouched.
    """
    _float_rows(x, formats.FP8_GROUP)
    h = x.shape[1]
    _destinations(dests, dest_rows, x, x.shape[0], h + 4 * (h // formats.FP8_GROUP))
    _ops.call(_ops.quantize_fp8_blockwise_rows_multi_op, x, list(dests), dest_rows, _max_blocks(max_blocks))


def scatter_rows(src: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, *,
                 max_blocks: int | None = None) -> None:
    """Byte rows to several destinations: row t of src is copied to row dest_rows[t, d] of dests[d]
    (skipped when negative or >= R_d). The dispatch's push of rows that need no encoding.

    src: uint8 [T, B] (contiguous last dimension); dests: 1 to 8 uint8 tensors [R_d, B] with
    back-to-back rows; dest_rows: int64 [T, D] on src's device, contiguous, D = len(dests) (distinct
    within a destination); max_blocks: as in quantize_mxfp4_rows_multi. Writes in place and returns
    None; other rows are left untouched.
    """
    _tensor(src, "src", (torch.uint8,), 2)
    if src.shape[1] and src.stride(1) != 1:
        raise ValueError(f"src: expected a contiguous last dimension, got strides {src.stride()}")
    _destinations(dests, dest_rows, src, src.shape[0], src.shape[1])
    _ops.call(_ops.scatter_rows_op, src, list(dests), dest_rows, _max_blocks(max_blocks))


def mxfp4_to_fp8_blockwise(
    packed: torch.Tensor,
    scales: torch.Tensor,
    split_lens: torch.Tensor | None = None,
    split_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct MXFP4 -> FP8 1x128 (formats.mxfp4_to_fp8_blockwise), no BF16 detour.

    packed uint8 [N, H/2], scales uint8 [N, H/32], H a multiple of 128.
    split_lens / split_offsets: optional ragged segments (see the module docstring); rows outside
      every segment get ZERO data and ZERO scales and count no underflow.
    Returns (data float8_e4m3fn [N, H], scales float32 [N, H/128] (powers of two; NaN for a group
    holding a NaN block), underflow int64 0-dim: nonzero MXFP4 values that became zero).
    """
    _packed_scales(packed, scales)
    _splits(split_lens, split_offsets, packed)
    return _ops.call(_ops.mxfp4_to_fp8_blockwise_op, packed, scales, split_lens, split_offsets)


def mxfp4_rows_to_fp8_blockwise(
    rows: torch.Tensor,
    hidden: int,
    split_lens: torch.Tensor | None = None,
    split_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mxfp4_to_fp8_blockwise reading MXFP4 byte rows directly.

    rows: uint8 [N, H/2 + H/32] (formats.pack_mxfp4_rows layout); hidden: H, a multiple of 128.
    Same splits and results as mxfp4_to_fp8_blockwise (rows outside every segment: zero data/scales).
    """
    _mxfp4_byte_rows(rows, hidden)
    _splits(split_lens, split_offsets, rows)
    return _ops.call(_ops.mxfp4_rows_to_fp8_blockwise_op, rows, hidden, split_lens, split_offsets)


def mxfp4_rows_to_fp8_cols(
    packed: torch.Tensor,
    scales: torch.Tensor,
    split_lens: torch.Tensor,
    split_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 rows grouped by expert -> FP8 columns, one transposed block per expert
    (formats.mxfp4_rows_to_fp8_cols: dequantize, transpose, requantize 1x128 along the tokens).

    packed uint8 [N, H/2], scales uint8 [N, H/32] (H a multiple of 128); split_lens int [E],
    split_offsets int [E] or None (back to back from row 0), both on the input's device or both on
    the CPU; validated as formats.check_splits does.
    Returns (data float8_e4m3fn [H, N], rows N rounded up to 32 bytes apart (strides
               (formats.fp8_cols_row_stride(N), 1), as the spec; FP8 GEMMs take it as it is): columns
               of rows outside every segment are zero;
             scales float32 [H, G], G = sum_e ceil(len_e / 128), outer-dim-major (strides (1, H),
               as the spec and as torch._scaled_mm takes 1x128 scales): expert e owns columns
               [goff_e, goff_e + ceil(len_e / 128));
             group_offsets int64 [E + 1] on the input's device: goff_e, then G).

    Speed: segments that all start on 16-row boundaries take one kernel; any other start takes two
    passes, because the output bytes of a group boundary would otherwise be written partly by each
    group (H200, 32 experts at N = 32768, H = 7168: 112 us with lengths that are multiples of 128,
    113-118 us of 32, 126-141 us of 16, 161 us ragged; about the same at N = 32770). Callers that
    can pad expert segments to multiples of 16 rows (as grouped FP8 GEMMs want them anyway; 32 or
    128 for the fastest paths) get the one-pass kernel; so do segments at offsets that start on
    32-row boundaries with rows between them (122 us with gaps under 32 rows; the rows outside every
    segment come out zero). The split lengths are read once on the host
    to plan this (and to give the kernel each group's rows). Splits on the device make that read wait
    for the device; splits on the CPU (as a dispatch layer often has them) do not: the op copies them
    to the device without waiting and returns while the kernels run.
    """
    _packed_scales(packed, scales)
    _splits(split_lens, split_offsets, packed, required=True, host_ok=True)
    return _ops.call(_ops.mxfp4_rows_to_fp8_cols_op, packed, scales, split_lens, split_offsets)


def quantize_fp8_blockwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 -> FP8 1x128 (formats.quantize_fp8_blockwise with block (1, 128)).

    x: bfloat16/float32/float16 [T, H], H a multiple of 128 (other H raise ValueError).
    Returns (data float8_e4m3fn [T, H], scales float32 [T, H/128], powers of two; NaN for a group
    holding NaN or Inf, whose data is zero).
    """
    _float_rows(x, formats.FP8_GROUP)
    return _ops.call(_ops.quantize_fp8_blockwise_op, x)


def _two_axis(x, name, tiles):
    _tensor(x, name, (torch.float32, torch.bfloat16), 2)
    group = formats.FP8_GROUP
    for dim in ((0, 1) if tiles else (1,)):
        if x.shape[dim] % group:
            raise ValueError(f"{name}: dimension {dim} ({x.shape[dim]}) must be a multiple of {group}")
    if x.shape[0] > 65535 * group:
        raise ValueError(f"{name}: at most {65535 * group} rows, got {x.shape[0]}")
    rows_apart = x.stride(0) * x.element_size() if x.shape[0] > 1 else 0
    if x.is_cuda and (x.stride(1) != 1 or x.data_ptr() % 16 or rows_apart % 16):
        x = x.contiguous()
    return x


def quantize_fp8_rows_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 1x128 of x along both axes, reading x once: the operands an activation or gradient feeds
    to a linear layer's GEMMs (rows: fprop / dgrad; columns: wgrad, where the tokens are reduced).

    x: bfloat16/float32 [M, K], K a multiple of 128, any M (any strides; copied when the rows are not
      16-byte aligned with a contiguous last dimension).
    Returns (data float8_e4m3fn [M, K], scales float32 [M, K/128], data_t float8_e4m3fn [K, Mp],
    scales_t float32 [K, Mp/128]) with Mp = M rounded up to a multiple of 128: the same bits as
    formats.quantize_fp8_blockwise(x) and formats.quantize_fp8_blockwise(x^T zero-padded to Mp columns).
    """
    x = _two_axis(x, "x", False)
    return _ops.call(_ops.quantize_fp8_rows_cols_op, x)


def quantize_fp8_tiles(w: torch.Tensor, *, transpose: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 128x128 of a weight and, in the same pass, its transpose (the dgrad operand: the tile
    quantization of w^T is the transpose of w's, with the transposed scales).

    w: bfloat16/float32 [N, K], or a stack of G weights [G, N, K] (the experts of a layer); N and K
      multiples of 128.
    Returns (data float8_e4m3fn [N, K], scales float32 [N/128, K/128], data_t float8_e4m3fn [K, N]
    (contiguous; [0, N] when ``transpose`` is False)): data and scales are the bits of
    formats.quantize_fp8_blockwise(w, block=(128, 128)), data_t is data transposed. For a stack:
    data [G, N, K], scales [G, N/128, K/128] and data_t [G, K, N], each weight's transpose contiguous
    (what a grouped GEMM's dgrad reads), written by the same pass.
    """
    if not isinstance(transpose, bool):
        raise ValueError(f"transpose: expected a bool, got {transpose!r}")
    if isinstance(w, torch.Tensor) and w.dim() not in (2, 3):
        raise ValueError(f"w: expected [N, K] or [G, N, K], got shape {tuple(w.shape)}")
    if isinstance(w, torch.Tensor) and w.dim() == 3:
        g, n, k = w.shape
        if n % formats.FP8_GROUP or k % formats.FP8_GROUP or g == 0:
            raise ValueError(f"w: expected [G, N, K] with G > 0 and N, K multiples of {formats.FP8_GROUP}, "
                             f"got shape {tuple(w.shape)}")
        data, scales, data_t = _ops.call(_ops.quantize_fp8_tiles_op, _two_axis(w.reshape(g * n, k), "w", True),
                                         transpose, n if transpose else 0)
        return (data.view(g, n, k), scales.view(g, n // formats.FP8_GROUP, k // formats.FP8_GROUP),
                data_t.view(g, k, n) if transpose else data_t)
    w = _two_axis(w, "w", True)
    return _ops.call(_ops.quantize_fp8_tiles_op, w, transpose, 0)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> floats: formats.dequantize_mxfp4 (exact in float32), then a cast to ``dtype``.

    packed: uint8 [..., H/2] (element 2i in the low nibble); scales: uint8 [..., H/32] (UE8M0; 0xFF
      decodes its block to NaN); H a multiple of 32.
    dtype: torch.bfloat16 (native on CUDA for 2-D inputs with 4-byte aligned rows), torch.float32 or
      torch.float16 (the spec).
    Returns dtype [..., H]: the same bits as formats.dequantize_mxfp4(packed, scales, dtype=dtype).
    """
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    _same_device(scales, packed, "scales")
    if dtype not in FLOAT_INPUTS:
        raise ValueError(f"dtype: expected one of {FLOAT_INPUTS}, got {dtype!r}")
    h = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], h // 32)
    if h % 32 or tuple(scales.shape) != expected:
        raise ValueError(f"scales: expected shape {expected} for packed of shape {tuple(packed.shape)} "
                         f"(packed's last dimension times 2 a multiple of 32), got {tuple(scales.shape)}")
    return _ops.call(_ops.dequantize_mxfp4_op, packed, scales, dtype)


def quantize_nvfp4_rows(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 byte rows (the nvfp4 dispatch payload): formats.pack_nvfp4_rows of
    formats.quantize_nvfp4(x), 1x16 blocks, round to nearest even, the tensor scale from the largest
    finite |x| of the whole x (native on CUDA: no host synchronisation).

    x: bfloat16/float32/float16 [T, H], H a multiple of 16, contiguous last dimension.
    Returns uint8 [T, H/2 + H/16 + 4]: per token H/2 packed E2M1 bytes (element 2i in the low nibble),
    H/16 E4M3 block scales (0x7F for a block holding NaN or Inf, whose data is zero), then the 4 bytes
    of the FP32 tensor scale.
    """
    _float_rows(x, 16)
    return _ops.call(_ops.quantize_nvfp4_rows_op, x)


def nvfp4_rows_to_fp8_blockwise(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 byte rows (the nvfp4 dispatch payload, formats.pack_nvfp4_rows, each row with its tensor
    scale) -> FP8 1x128 in one pass: each element decoded exactly (formats.dequantize_nvfp4_rows), then
    formats.quantize_fp8_blockwise with 1x128 blocks, bit for bit (native on CUDA for 4-byte aligned
    rows; the spec elsewhere).

    rows: uint8 [n, H/2 + H/16 + 4] with a contiguous last dimension; hidden: H, a multiple of 128.
    Returns (float8_e4m3fn [n, H], float32 [n, H/128]): power-of-two scales; NaN scale and zero data
    for a group holding NaN (a block scale byte 0x7F decodes to NaN) or Inf.
    """
    _tensor(rows, "rows", (torch.uint8,), 2)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0 or hidden % formats.FP8_GROUP:
        raise ValueError(f"hidden: expected a positive multiple of {formats.FP8_GROUP}, got {hidden!r}")
    width = formats.nvfp4_row_bytes(hidden)
    if rows.shape[1] != width:
        raise ValueError(f"rows: expected {width} bytes per row for hidden {hidden}, got {rows.shape[1]}")
    if rows.shape[0] and rows.stride(1) != 1:
        raise ValueError(f"rows: expected a contiguous last dimension, got strides {rows.stride()}")
    return _ops.call(_ops.nvfp4_rows_to_fp8_blockwise_op, rows, hidden)


def mxfp4_rows_expand_fp8_blockwise(
    rows: torch.Tensor, hidden: int, slots: torch.Tensor, num_rows: int | None = None, *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, copy_to: torch.Tensor | None = None,
    copy_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4_rows_to_fp8_blockwise fused with the expansion to expert rows: each byte row converted once and
    written to each of its output rows.

    rows: uint8 [n, H/2 + H/32] (formats.pack_mxfp4_rows layout, 4-byte aligned rows); hidden: H, a
      multiple of 128; slots: int64 [n, k] (1 <= k <= 32) on rows' device, the output row of each
      (row, slot), -1 for none (slots outside [0, R) are skipped); num_rows: R >= 0 (may be left out
      with ``out``, else must equal its rows);
    out: (float8_e4m3fn [R, H], float32 [R, H/128]), contiguous, on rows' device: written in place
      (only the rows named by slots; the others keep their values, so calls for disjoint row blocks
      can fill one output, e.g. one per source rank of a dispatch, each as its rows arrive);
    copy_to: uint8 [n, H/2 + H/32] with contiguous rows, on rows' device: also receives, as they are
      and in the same pass, the byte rows that name at least one output row (the dispatch copies its
      received rows out of the transfer buffer so, slice by slice, masking the others' slots);
    copy_rows: int64 [n] on rows' device, contiguous (needs copy_to): row t goes to row copy_rows[t] of
      copy_to instead, which may then have any number of rows (outside [0, rows of copy_to): not
      copied; a row named twice gets either copy).
    Returns (float8_e4m3fn [R, H], float32 [R, H/128]) (``out`` when given): output row slots[t, j]
    is the FP8 1x128 of rows[t] (formats.mxfp4_to_fp8_blockwise, bit for bit). Without ``out`` the
    caller names every output row once; a row named by no slot is left unwritten on CUDA (zeros in the
    spec fallback).
    """
    _mxfp4_byte_rows(rows, hidden)
    if rows.shape[0] and rows.stride(1) != 1:
        raise ValueError(f"rows: expected a contiguous last dimension, got strides {rows.stride()}")
    _tensor(slots, "slots", (torch.int64,), 2)
    _same_device(slots, rows, "slots")
    if slots.shape[0] != rows.shape[0] or not 1 <= slots.shape[1] <= 32:
        raise ValueError(f"slots: expected shape ({rows.shape[0]}, k) with 1 <= k <= 32, got {tuple(slots.shape)}")
    if not slots.is_contiguous():
        raise ValueError(f"slots: expected a contiguous tensor, got strides {slots.stride()}")
    if copy_rows is not None:
        if copy_to is None:
            raise ValueError("copy_rows: needs copy_to")
        _tensor(copy_rows, "copy_rows", (torch.int64,), 1)
        _same_device(copy_rows, rows, "copy_rows")
        if copy_rows.shape[0] != rows.shape[0] or not copy_rows.is_contiguous():
            raise ValueError(f"copy_rows: expected a contiguous [{rows.shape[0]}] tensor, got shape "
                             f"{tuple(copy_rows.shape)}")
    if copy_to is not None:
        _tensor(copy_to, "copy_to", (torch.uint8,), 2)
        _same_device(copy_to, rows, "copy_to")
        want_rows = copy_to.shape[0] if copy_rows is not None else rows.shape[0]
        if copy_to.shape != (want_rows, rows.shape[1]) or (copy_to.shape[0] and copy_to.stride(1) != 1):
            raise ValueError(f"copy_to: expected shape {(want_rows, rows.shape[1])} with contiguous rows, got shape "
                             f"{tuple(copy_to.shape)} strides {copy_to.stride()}")
    if out is None:
        if not isinstance(num_rows, int) or num_rows < 0:
            raise ValueError(f"num_rows: expected a non-negative int, got {num_rows!r}")
        if copy_to is None:
            return _ops.call(_ops.mxfp4_rows_expand_fp8_blockwise_op, rows, hidden, slots, num_rows)
        out = (torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=rows.device),
               torch.zeros(num_rows, hidden // formats.FP8_GROUP, dtype=torch.float32, device=rows.device))
    data, scales = _fp8_pair(out, hidden, rows, "out")
    r = data.shape[0]
    if num_rows is not None and num_rows != r:
        raise ValueError(f"num_rows: {num_rows} does not match out's {r} rows")
    _ops.call(_ops.mxfp4_rows_expand_fp8_blockwise_into_op, rows, hidden, slots, data, scales, copy_to, copy_rows)
    return data, scales
