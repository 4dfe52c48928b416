"""torch.library custom ops over the native kernels, their fake (meta) implementations, and the spec
fallback used on CPU or where the extension is not built.

Every op computes exactly what moe_fp4.formats computes (bit for bit); the public functions in
moe_fp4.ops check their arguments (ValueError naming the argument) and call these ops.
"""

from __future__ import annotations

import array
import inspect

import torch
from torch.overrides import has_torch_function
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from moe_fp4 import formats
from moe_fp4.formats.ragged import check_splits, split_starts
from moe_fp4.ops import _native

LIB = "moe_fp4"
FP8 = torch.float8_e4m3fn

_IMPL = {}  # custom op -> (its Python implementation, positions of the arguments it mutates)


def _custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """torch.library.custom_op(f"{LIB}::{name}"), remembering the implementation for call()."""
    def register(fn):
        op = torch.library.custom_op(f"{LIB}::{name}", mutates_args=mutates_args)(fn)
        params = list(inspect.signature(fn).parameters)
        _IMPL[op] = (fn, tuple(params.index(a) for a in mutates_args))
        return op
    return register


def _flat_tensors(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))
        elif isinstance(a, torch.Tensor):
            yield a


def call(op, *args):
    """op(*args). Outside torch.compile, with plain tensors and no torch function or dispatch mode
    active, the implementation runs directly: the custom-op dispatch adds nothing there but host time
    (about 70 us per call on the H200 machine's host, more than a 4096-token kernel takes). The version
    counters of the arguments the op mutates are bumped as the dispatch would."""
    tensors = tuple(_flat_tensors(args))
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or has_torch_function(tensors) or any(
        type(t) is not torch.Tensor for t in tensors
    ):
        return op(*args)
    fn, mutated = _IMPL[op]
    result = fn(*args)
    for i in mutated:
        for t in _flat_tensors((args[i],)):
            torch.autograd.graph.increment_version(t)
    return result


def _native_for(t: torch.Tensor) -> bool:
    return t.is_cuda and _native.available()


def _word_rows(t: torch.Tensor) -> bool:
    """Rows the native kernels read by 4-byte words: a 4-byte aligned start and row stride (a single
    row: its start only). Other views take the spec."""
    return t.data_ptr() % 4 == 0 and (t.shape[0] <= 1 or t.stride(0) % 4 == 0)


def _round_up(scale_rounding: str) -> bool:
    return scale_rounding == "up"


# ------------------------------------------------------------------------------------------------
# Spec fallbacks (CPU, or CUDA without the extension)
# ------------------------------------------------------------------------------------------------


def _segment_rows(split_lens: torch.Tensor, split_offsets: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """int64 indices of the rows inside the segments (validated like the spec's check_splits)."""
    offs = check_splits(split_lens, split_offsets, n).cpu().tolist()
    lens = split_lens.to(torch.int64).cpu().tolist()
    parts = [torch.arange(o, o + ln, dtype=torch.int64) for o, ln in zip(offs, lens) if ln > 0]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return idx.to(device)


def _spec_fp8_rows(packed, scales, split_lens, split_offsets):
    if split_lens is None:
        return formats.mxfp4_to_fp8_blockwise(packed, scales)
    n, h = packed.shape[0], packed.shape[1] * 2
    idx = _segment_rows(split_lens, split_offsets, n, packed.device)
    data = torch.zeros(n, h, dtype=torch.uint8, device=packed.device)
    out_scales = torch.zeros(n, h // formats.FP8_GROUP, dtype=torch.float32, device=packed.device)
    d, s, underflow = formats.mxfp4_to_fp8_blockwise(packed[idx], scales[idx])
    data[idx] = d.view(torch.uint8)
    out_scales[idx] = s
    return data.view(FP8), out_scales, underflow


def _spec_rows_into(x, scale_rounding, out, row_index):
    packed, scales = formats.quantize_mxfp4(x, scale_rounding=scale_rounding)
    rows = formats.pack_mxfp4_rows(packed, scales)
    if row_index is None:
        out[: rows.shape[0]] = rows
        return
    ri = row_index.to(torch.int64)
    keep = (ri >= 0) & (ri < out.shape[0])  # as the kernel: tokens with an out-of-range row are skipped
    out[ri[keep]] = rows[keep]


# ------------------------------------------------------------------------------------------------
# Custom ops
# ------------------------------------------------------------------------------------------------


@_custom_op("quantize_mxfp4")
def quantize_mxfp4_op(x: torch.Tensor, scale_rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_for(x):
        return _native.module().quantize_mxfp4(x, _round_up(scale_rounding))
    return formats.quantize_mxfp4(x, scale_rounding=scale_rounding)


@quantize_mxfp4_op.register_fake
def _(x, scale_rounding):
    t, h = x.shape
    return x.new_empty((t, h // 2), dtype=torch.uint8), x.new_empty((t, h // 32), dtype=torch.uint8)


@_custom_op("quantize_mxfp4_rows")
def quantize_mxfp4_rows_op(x: torch.Tensor, scale_rounding: str) -> torch.Tensor:
    t, h = x.shape
    out = torch.empty((t, formats.mxfp4_row_bytes(h)), dtype=torch.uint8, device=x.device)
    if _native_for(x):
        _native.module().quantize_mxfp4_rows_into(x, _round_up(scale_rounding), out, None)
    else:
        _spec_rows_into(x, scale_rounding, out, None)
    return out


@quantize_mxfp4_rows_op.register_fake
def _(x, scale_rounding):
    t, h = x.shape
    return x.new_empty((t, h // 2 + h // 32), dtype=torch.uint8)


@_custom_op("quantize_mxfp4_rows_into", mutates_args=("out",))
def quantize_mxfp4_rows_into_op(
    x: torch.Tensor, scale_rounding: str, out: torch.Tensor, row_index: torch.Tensor | None
) -> None:
    if _native_for(x):
        _native.module().quantize_mxfp4_rows_into(x, _round_up(scale_rounding), out, row_index)
    else:
        _spec_rows_into(x, scale_rounding, out, row_index)


@quantize_mxfp4_rows_into_op.register_fake
def _(x, scale_rounding, out, row_index):
    return None


def _spec_scatter_rows(src, dests, dest_rows):
    rows = dest_rows.to(torch.int64)
    for d, dest in enumerate(dests):
        r = rows[:, d]
        keep = (r >= 0) & (r < dest.shape[0])  # as the kernel: rows outside the destination are skipped
        dest[r[keep]] = src[keep]


def _scatter_rows(src, dests, dest_rows, max_blocks=0):
    if _native_for(src):
        _native.module().scatter_rows(src, dests, dest_rows, max_blocks)
    else:
        _spec_scatter_rows(src, dests, dest_rows)


@_custom_op("scatter_rows", mutates_args=("dests",))
def scatter_rows_op(src: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, max_blocks: int) -> None:
    _scatter_rows(src, dests, dest_rows, max_blocks)


@scatter_rows_op.register_fake
def _(src, dests, dest_rows, max_blocks):
    return None


@_custom_op("quantize_mxfp4_rows_multi", mutates_args=("dests", "fp8_out", "fp8_scales"))
def quantize_mxfp4_rows_multi_op(
    x: torch.Tensor, scale_rounding: str, dests: list[torch.Tensor], dest_rows: torch.Tensor, max_blocks: int,
    fp8_dest: int, fp8_slots: torch.Tensor | None, fp8_out: torch.Tensor | None, fp8_scales: torch.Tensor | None,
) -> None:
    if _native_for(x) and x.dtype == torch.bfloat16:
        _native.module().quantize_mxfp4_rows_multi(x, _round_up(scale_rounding), dests, dest_rows, max_blocks, fp8_dest,
                                                   fp8_slots, fp8_out, fp8_scales)
        return
    rows = quantize_mxfp4_rows_op(x, scale_rounding)  # other input dtypes (and the spec): rows, then the push
    _scatter_rows(rows, dests, dest_rows, max_blocks)
    if fp8_out is not None:  # then the rows of that destination this call wrote, converted
        r = dest_rows[:, fp8_dest]
        r = r[(r >= 0) & (r < dests[fp8_dest].shape[0])]
        _spec_expand_fp8_rows_into(dests[fp8_dest][r], x.shape[1], fp8_slots[r], fp8_out, fp8_scales)


@quantize_mxfp4_rows_multi_op.register_fake
def _(x, scale_rounding, dests, dest_rows, max_blocks, fp8_dest, fp8_slots, fp8_out, fp8_scales):
    return None


@_custom_op("quantize_fp8_blockwise_rows_multi", mutates_args=("dests",))
def quantize_fp8_blockwise_rows_multi_op(
    x: torch.Tensor, dests: list[torch.Tensor], dest_rows: torch.Tensor, max_blocks: int
) -> None:
    if _native_for(x) and x.dtype == torch.bfloat16:
        _native.module().quantize_fp8_blockwise_rows_multi(x, dests, dest_rows, max_blocks)
        return
    data, scales = quantize_fp8_blockwise_op(x)  # other input dtypes (and the spec): rows, then the push
    _scatter_rows(torch.cat((data.view(torch.uint8), scales.view(torch.uint8)), dim=1), dests, dest_rows,
                  max_blocks)


@quantize_fp8_blockwise_rows_multi_op.register_fake
def _(x, dests, dest_rows, max_blocks):
    return None


@_custom_op("mxfp4_to_fp8_blockwise")
def mxfp4_to_fp8_blockwise_op(
    packed: torch.Tensor, scales: torch.Tensor, split_lens: torch.Tensor | None, split_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _native_for(packed) and _word_rows(packed) and _word_rows(scales):
        return _native.module().mxfp4_to_fp8_blockwise(packed, scales, split_lens, split_offsets)
    return _spec_fp8_rows(packed, scales, split_lens, split_offsets)


def _fake_fp8_rows(ref, n, h):
    return (
        ref.new_empty((n, h), dtype=FP8),
        ref.new_empty((n, h // formats.FP8_GROUP), dtype=torch.float32),
        ref.new_empty((), dtype=torch.int64),
    )


@mxfp4_to_fp8_blockwise_op.register_fake
def _(packed, scales, split_lens, split_offsets):
    return _fake_fp8_rows(packed, packed.shape[0], packed.shape[1] * 2)


@_custom_op("mxfp4_rows_to_fp8_blockwise")
def mxfp4_rows_to_fp8_blockwise_op(
    rows: torch.Tensor, hidden: int, split_lens: torch.Tensor | None, split_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _native_for(rows) and _word_rows(rows):
        return _native.module().mxfp4_rows_to_fp8_blockwise(rows, hidden, split_lens, split_offsets)
    packed, scales = formats.unpack_mxfp4_rows(rows, hidden)
    return _spec_fp8_rows(packed, scales, split_lens, split_offsets)


@mxfp4_rows_to_fp8_blockwise_op.register_fake
def _(rows, hidden, split_lens, split_offsets):
    return _fake_fp8_rows(rows, rows.shape[0], hidden)


COLUMN_PIECE_ROWS = 16  # rows per 16-byte store piece of the column-major E4M3 output


def _host_splits(
    split_lens: torch.Tensor, split_offsets: torch.Tensor | None, total_rows: int
) -> tuple[list[int], list[int]]:
    """(lengths, first rows) as host integers, from one read of the splits, validated as
    formats.check_splits does (ValueError for segments outside the rows or overlapping)."""
    if split_offsets is None or split_offsets.shape != split_lens.shape:
        if split_offsets is not None:
            check_splits(split_lens.cpu(), split_offsets.cpu(), total_rows)  # raises: the shapes differ
        lens = split_lens.tolist()
        return lens, split_starts(lens, None, total_rows)
    lens, starts = torch.stack((split_lens.to(torch.int64), split_offsets.to(torch.int64))).tolist()
    return lens, split_starts(lens, starts, total_rows)


def _splits_tensor(lens: list[int], starts: list[int]) -> torch.Tensor:
    """int64 [2, E] on the host (a new pageable tensor over its own buffer): the lengths, then the first
    rows. torch.frombuffer over an array: 3.4 us against 7.4 us for torch.tensor of the lists (32 experts,
    2-core development host)."""
    if not lens:
        return torch.empty((2, 0), dtype=torch.int64)
    return torch.frombuffer(array.array("q", lens + starts), dtype=torch.int64).view(2, len(lens))


def column_plan(
    split_lens: torch.Tensor, split_offsets: torch.Tensor | None, total_rows: int
) -> tuple[int, bool, bool]:
    """(G, two_pass, full_groups) for the column kernel, from one host read of the splits, which it also
    validates (formats.check_splits on the host copy: ValueError for segments outside the rows or
    overlapping).

    G = sum_e ceil(len_e / 128). The one-pass kernel writes each 128-row group's columns as it
    converts them, in whole aligned 16-byte pieces when every segment (hence every group) starts on a
    16-row boundary (the output's rows start on 32-byte sectors whatever N). A segment starting
    anywhere else leaves pieces shared by two groups, each written partly by byte stores (a DRAM read
    per partial sector); then the two-pass kernels (scales first, then whole aligned pieces) are the
    faster ones. H200, 32 experts at N = 32768, H = 7168, 2026-11-25: lengths multiples of 128 (equal
    or not) 112 us one pass against 160 two-pass; of 32 rows 120 against 159 (113-118 with the host
    splits passed, column_launch); of 16 rows 128 against 160; of 8 rows 176 against 160; any lengths
    247 against 161.

    full_groups: the segments lie back to back from row 0 and every length is a multiple of 128, so
    scale group g is rows [128 g, 128 g + 128); the one-pass kernel then loads a group's rows while it
    looks the group up, and takes their column keys before the look-up answers (H200, 32 equal
    experts at N = 32768: 145 against 150 us for the early loads, 2026-11-24; with the keys, 112
    against 117 us together with the CTA index division, 2026-11-25).
    """
    return _plan(*_host_splits(split_lens, split_offsets, total_rows))[:3]


def _plan(lens: list[int], starts: list[int]) -> tuple[int, bool, bool, bool]:
    """(G, two_pass, full_groups, every segment starting on a 32-row boundary) in one pass over Python
    integers: the op waits on the device for the splits, so this host time is on the critical path (32
    experts: about 10 us, against about 45 us as small tensor operations)."""
    group = formats.FP8_GROUP
    groups, two_pass, on32, from_zero, whole, row = 0, False, True, True, True, 0
    for ln, st in zip(lens, starts):
        groups += -(-ln // group)
        if ln > 0:
            two_pass |= st % COLUMN_PIECE_ROWS != 0
            on32 &= st % (2 * COLUMN_PIECE_ROWS) == 0
            from_zero &= st == row
        whole &= ln % group == 0
        row += ln
    return groups, two_pass, from_zero and whole, on32


COLUMN_GROUP_HINTS_MAX = 1024  # csrc/kernels/sm90_launchers.h: kMaxColumnGroupHints (no table past it)


def _launch(lens: list[int], starts: list[int]) -> tuple[int, bool, bool, torch.Tensor | None]:
    groups, two_pass, full_groups, on32 = _plan(lens, starts)
    passed = not two_pass and not full_groups and on32 and 0 < groups <= COLUMN_GROUP_HINTS_MAX
    return groups, two_pass, full_groups, _splits_tensor(lens, starts) if passed else None


def column_launch(
    split_lens: torch.Tensor, split_offsets: torch.Tensor | None, total_rows: int
) -> tuple[int, bool, bool, torch.Tensor | None]:
    """The native column op's plan arguments as the op passes them: column_plan's (G, two_pass,
    full_groups) and the host splits (int64 [2, E]: lengths, then first rows) or None,
    from one host read of the splits. From the host splits the launcher derives each scale group's
    first row and row count (about 1 us for 300 groups; native column_group_table returns them), which
    the one-pass kernel loads before its own look-up answers and checks against it. They go with the
    one pass when the groups are not full ones and every segment starts on a 32-row boundary (H200,
    32 experts, H = 7168, 2026-11-25: lengths multiples of 32 at N = 32768, 125-128 -> 113-118 us;
    multiples of 128 at N = 32770, 124-126 -> 113-115 us); with starts at 16 mod 32 the table
    measured slower (131-135 -> 126-141 us), so they are left out there."""
    return _launch(*_host_splits(split_lens, split_offsets, total_rows))


def mxfp4_rows_to_fp8_cols_planned(
    packed: torch.Tensor, scales: torch.Tensor, lens: list[int], starts: list[int], cache: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The column op for segments known on the host as ints (a dispatch layer's counts and starts,
    valid by construction): the plan, the group table and the device copy of the splits are made on
    the first call and kept in ``cache`` (a dict the caller keeps with those splits), so that a
    later call is the kernel launch alone. Without the native kernels (or for views they do not
    read) it is the public op with the splits on the CPU."""
    if not (_native_for(packed) and _word_rows(packed) and _word_rows(scales)):
        return call(mxfp4_rows_to_fp8_cols_op, packed, scales, torch.tensor(lens, dtype=torch.int64),
                    torch.tensor(starts, dtype=torch.int64))
    key = (packed.device, packed.shape[0])
    plan = cache.get(key)
    if plan is None:
        split_starts(lens, starts, packed.shape[0])  # raises for splits outside the rows or overlapping
        plan = cache[key] = _host_plan(lens, starts, packed.device)
    return _native.module().mxfp4_rows_to_fp8_cols(packed, scales, *plan)


def _host_plan(lens: list[int], starts: list[int], device: torch.device) -> tuple:
    """The native column op's arguments after the rows for splits held on the host: (lengths and
    first rows on ``device``, G, two_pass, full_groups, the host splits or None). The copy does not
    wait for the device: it reads a new pageable tensor (the launcher's host splits when it takes
    them), staged at once, so the caller may reuse its own."""
    groups, two_pass, full_groups, host = _launch(lens, starts)
    dev = (host if host is not None else _splits_tensor(lens, starts)).to(device, non_blocking=True)
    return dev[0], dev[1], groups, two_pass, full_groups, host


@_custom_op("mxfp4_rows_to_fp8_cols")
def mxfp4_rows_to_fp8_cols_op(
    packed: torch.Tensor, scales: torch.Tensor, split_lens: torch.Tensor, split_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _native_for(packed) and _word_rows(packed) and _word_rows(scales):
        # the output shape needs the lengths on the host anyway: one read, validated there
        lens, starts = _host_splits(split_lens, split_offsets, packed.shape[0])
        if split_lens.device != packed.device:  # splits given on the CPU: no wait for the device
            lens_dev, starts_dev, *plan = _host_plan(lens, starts, packed.device)
            split_lens, split_offsets = lens_dev, (starts_dev if split_offsets is not None else None)
        else:
            plan = _launch(lens, starts)
        return _native.module().mxfp4_rows_to_fp8_cols(packed, scales, split_lens, split_offsets, *plan)
    data, out_scales, goffs = formats.mxfp4_rows_to_fp8_cols(packed, scales, split_lens, split_offsets)
    return data, out_scales, goffs.to(packed.device)


@mxfp4_rows_to_fp8_cols_op.register_fake
def _(packed, scales, split_lens, split_offsets):
    n, h = packed.shape[0], packed.shape[1] * 2
    groups = torch.library.get_ctx().new_dynamic_size()
    return (
        packed.new_empty((h, formats.fp8_cols_row_stride(n)), dtype=FP8)[:, :n],  # rows 32-byte aligned, as the spec
        packed.new_empty((groups, h), dtype=torch.float32).t(),  # [H, G] outer-dim-major, as the spec
        packed.new_empty((split_lens.shape[0] + 1,), dtype=torch.int64),
    )


@_custom_op("quantize_fp8_blockwise")
def quantize_fp8_blockwise_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_for(x):
        return _native.module().quantize_fp8_blockwise(x)
    return formats.quantize_fp8_blockwise(x, block=(1, formats.FP8_GROUP))


@quantize_fp8_blockwise_op.register_fake
def _(x):
    t, h = x.shape
    return x.new_empty((t, h), dtype=FP8), x.new_empty((t, h // formats.FP8_GROUP), dtype=torch.float32)


def _padded_rows(m: int) -> int:
    return -(-m // formats.FP8_GROUP) * formats.FP8_GROUP


@_custom_op("quantize_fp8_rows_cols")
def quantize_fp8_rows_cols_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _native_for(x):
        return _native.module().quantize_fp8_rows_cols(x)
    group = (1, formats.FP8_GROUP)
    data, scales = formats.quantize_fp8_blockwise(x, block=group)
    x_t = torch.nn.functional.pad(x.t(), (0, _padded_rows(x.shape[0]) - x.shape[0]))
    data_t, scales_t = formats.quantize_fp8_blockwise(x_t, block=group)
    return data, scales, data_t, scales_t


@quantize_fp8_rows_cols_op.register_fake
def _(x):
    m, k = x.shape
    mp = _padded_rows(m)
    g = formats.FP8_GROUP
    return (x.new_empty((m, k), dtype=FP8), x.new_empty((m, k // g), dtype=torch.float32),
            x.new_empty((k, mp), dtype=FP8), x.new_empty((k, mp // g), dtype=torch.float32))


def _check_group_rows(group_rows: int, rows: int) -> None:
    g = formats.FP8_GROUP
    if group_rows and (group_rows < 0 or group_rows % g or rows % group_rows):
        raise ValueError(f"group_rows: expected 0 or a multiple of {g} dividing w's rows ({rows}), got {group_rows}")


@_custom_op("quantize_fp8_tiles")
def quantize_fp8_tiles_op(w: torch.Tensor, transpose: bool,
                          group_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_group_rows(group_rows, w.shape[0])
    if _native_for(w):
        return _native.module().quantize_fp8_tiles(w, transpose, group_rows)
    data, scales = formats.quantize_fp8_blockwise(w, block=(formats.FP8_GROUP, formats.FP8_GROUP))
    if not transpose:
        data_t = data.new_empty((0, group_rows or w.shape[0]))
    elif group_rows:
        n, k = data.shape
        data_t = data.view(torch.uint8).view(n // group_rows, group_rows, k).transpose(1, 2).contiguous()
        data_t = data_t.view(FP8).view(n // group_rows * k, group_rows)
    else:
        data_t = data.view(torch.uint8).t().contiguous().view(FP8)
    return data, scales, data_t


@quantize_fp8_tiles_op.register_fake
def _(w, transpose, group_rows):
    n, k = w.shape
    g = formats.FP8_GROUP
    _check_group_rows(group_rows, n)
    t_shape = (0, group_rows or n) if not transpose else (n // group_rows * k, group_rows) if group_rows else (k, n)
    return (w.new_empty((n, k), dtype=FP8), w.new_empty((n // g, k // g), dtype=torch.float32),
            w.new_empty(t_shape, dtype=FP8))


@_custom_op("dequantize_mxfp4")
def dequantize_mxfp4_op(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if (
        dtype == torch.bfloat16
        and packed.dim() == 2
        and _native_for(packed)
        and _word_rows(packed)
    ):
        return _native.module().dequantize_mxfp4(packed, scales)
    return formats.dequantize_mxfp4(packed, scales, dtype=dtype)


@dequantize_mxfp4_op.register_fake
def _(packed, scales, dtype):
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype)


@_custom_op("quantize_nvfp4_rows")
def quantize_nvfp4_rows_op(x: torch.Tensor) -> torch.Tensor:
    if _native_for(x):
        return _native.module().quantize_nvfp4_rows(x)
    return formats.pack_nvfp4_rows(*formats.quantize_nvfp4(x))


@quantize_nvfp4_rows_op.register_fake
def _(x):
    t, h = x.shape
    return x.new_empty((t, formats.nvfp4_row_bytes(h)), dtype=torch.uint8)


@_custom_op("nvfp4_rows_to_fp8_blockwise")
def nvfp4_rows_to_fp8_blockwise_op(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_rows(rows):
        return _native.module().nvfp4_rows_to_fp8_blockwise(rows, hidden)
    values = formats.dequantize_nvfp4_rows(*formats.unpack_nvfp4_rows(rows, hidden))
    return formats.quantize_fp8_blockwise(values, block=(1, formats.FP8_GROUP))


@nvfp4_rows_to_fp8_blockwise_op.register_fake
def _(rows, hidden):
    return (rows.new_empty((rows.shape[0], hidden), dtype=FP8),
            rows.new_empty((rows.shape[0], hidden // formats.FP8_GROUP), dtype=torch.float32))


def _spec_expand_fp8_rows_into(rows, hidden, slots, out, out_scales):
    data, scales, _underflow = formats.mxfp4_to_fp8_blockwise(*formats.unpack_mxfp4_rows(rows, hidden))
    token = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1).expand_as(slots)
    keep = (slots >= 0) & (slots < out.shape[0])  # as the kernel: slots outside the output are skipped
    out.view(torch.uint8)[slots[keep]] = data.view(torch.uint8)[token[keep]]
    out_scales[slots[keep]] = scales[token[keep]]


def _spec_expand_fp8_rows(rows, hidden, slots, num_rows):
    out = torch.zeros(num_rows, hidden, dtype=torch.uint8, device=rows.device).view(FP8)
    out_scales = torch.zeros(num_rows, hidden // formats.FP8_GROUP, dtype=torch.float32, device=rows.device)
    _spec_expand_fp8_rows_into(rows, hidden, slots, out, out_scales)
    return out, out_scales


def _native_rows(rows) -> bool:
    return _native_for(rows) and _word_rows(rows)


@_custom_op("mxfp4_rows_expand_fp8_blockwise")
def mxfp4_rows_expand_fp8_blockwise_op(rows: torch.Tensor, hidden: int, slots: torch.Tensor,
                             num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_rows(rows):
        return _native.module().mxfp4_rows_expand_fp8_blockwise(rows, hidden, slots, num_rows)
    return _spec_expand_fp8_rows(rows, hidden, slots, num_rows)


@mxfp4_rows_expand_fp8_blockwise_op.register_fake
def _(rows, hidden, slots, num_rows):
    return (rows.new_empty((num_rows, hidden), dtype=FP8),
            rows.new_empty((num_rows, hidden // formats.FP8_GROUP), dtype=torch.float32))


@_custom_op("mxfp4_rows_expand_fp8_blockwise_into", mutates_args=("out", "out_scales", "copy_to"))
def mxfp4_rows_expand_fp8_blockwise_into_op(rows: torch.Tensor, hidden: int, slots: torch.Tensor, out: torch.Tensor,
                                  out_scales: torch.Tensor, copy_to: torch.Tensor | None,
                                  copy_rows: torch.Tensor | None) -> None:
    if _native_rows(rows) and (copy_to is None or _native_rows(copy_to)):
        _native.module().mxfp4_rows_expand_fp8_blockwise_into(rows, hidden, slots, out, out_scales, copy_to, copy_rows)
        return
    _spec_expand_fp8_rows_into(rows, hidden, slots, out, out_scales)
    if copy_to is not None:  # the rows that name an output row, to their copy rows
        named = ((slots >= 0) & (slots < out.shape[0])).any(dim=1)
        if copy_rows is None:
            copy_to[named] = rows[named]
        else:
            named &= (copy_rows >= 0) & (copy_rows < copy_to.shape[0])
            copy_to[copy_rows[named]] = rows[named]


@mxfp4_rows_expand_fp8_blockwise_into_op.register_fake
def _(rows, hidden, slots, out, out_scales, copy_to, copy_rows):
    return None
