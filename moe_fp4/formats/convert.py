"""Direct MXFP4 -> FP8 conversions (the references for the FP4RowToFP8Row/Col kernels).

Row conversion, ``mxfp4_to_fp8_blockwise`` (no BF16 detour): each 128-element group holds four MXFP4
blocks with scale bytes e0..e3. Its FP32 scale is ``2^(max(e_i) - 127 - FP8_HEADROOM_EXP)``: the
largest of the four block scales, lowered by 2^6 so that E2M1's largest value 6 lands on 384 < 448.
Element j of block i becomes ``e4m3(e2m1(c_j) * 2^(FP8_HEADROOM_EXP - (max(e) - e_i)))``: the E2M1
value with its exponent shifted by the difference of the scales, which is exact while that
difference is at most 14 binades; beyond that it rounds to nearest even into E4M3's subnormals,
and a nonzero value that rounds to zero is counted as an underflow (the function reports the count).
A group with a 0xFF (NaN) block scale gets scale NaN and zero data.

Column conversion, ``mxfp4_rows_to_fp8_cols`` (the wgrad operand): rows grouped by expert are
dequantized (exactly, in float32), transposed, and requantized to FP8 blockwise along the token
dimension, in groups of 128 tokens that start at each expert's first row (the last group of an
expert may be shorter; it is quantized as if padded with zeros). Its E4M3 data [H, N] has a row
stride of N rounded up to 32 bytes (``fp8_cols_row_stride``): a view of an [H, stride] buffer, so that
every row starts on a 32-byte sector whatever N (a kernel writing 128 tokens of a row then writes
whole sectors, and FP8 GEMMs take the operand as it is: their leading dimension must be a multiple
of 16 bytes); the padding bytes are not part of the tensor. Its FP32 scales [H, G] are stored
outer-dim-major (strides (1, H), the transpose of a contiguous [G, H]): the layout in which
``torch._scaled_mm``'s blockwise 1x128 scaling takes a left operand's scales, and one in which a
kernel converting 128 tokens x 256 hidden columns writes its scales as 1 KB in one piece.
"""

from __future__ import annotations

import torch

from moe_fp4.formats._checks import check_multiple, check_tensor
from moe_fp4.formats.elements import E2M1, E4M3, UE8M0_NAN, decode_elements, encode_elements, pow2_float32
from moe_fp4.formats.fp8_blockwise import quantize_fp8_blockwise
from moe_fp4.formats.mx import MX_BLOCK, dequantize_mxfp4
from moe_fp4.formats.packing import unpack_fp4
from moe_fp4.formats.ragged import check_splits

FP8_GROUP = 128
FP8_COLS_ROW_ALIGN = 32  # bytes: the row stride of mxfp4_rows_to_fp8_cols' data is a multiple of this
FP8_HEADROOM_EXP = 6  # 6 * 2^6 = 384 <= 448: the E2M1 range sits at the top of E4M3's


def _check_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> int:
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    check_tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    k = packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // MX_BLOCK) or k % MX_BLOCK:
        raise ValueError(f"scales: expected shape {(*packed.shape[:-1], k // MX_BLOCK)} for packed of shape "
                         f"{tuple(packed.shape)}, got {tuple(scales.shape)}")
    return k


def mxfp4_to_fp8_blockwise(
    packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed uint8 [..., K/2], scales uint8 [..., K/32], K % 128 == 0 ->
    (data float8_e4m3fn [..., K], scales float32 [..., K/128], underflow int64 0-dim: how many nonzero
    MXFP4 values became zero)."""
    k = _check_mxfp4(packed, scales)
    check_multiple(k, FP8_GROUP, "packed", "last dimension times 2")
    lead = packed.shape[:-1]
    groups = k // FP8_GROUP
    per = FP8_GROUP // MX_BLOCK
    codes = unpack_fp4(packed).reshape(*lead, groups, per, MX_BLOCK)
    e = scales.to(torch.int64).reshape(*lead, groups, per)
    emax = e.amax(dim=-1)
    nan_group = (e == UE8M0_NAN).any(dim=-1)
    shift = FP8_HEADROOM_EXP - (emax.unsqueeze(-1) - e)  # [..., groups, 4]
    values = decode_elements(codes, E2M1) * pow2_float32(shift).unsqueeze(-1)
    out = encode_elements(values, E4M3)
    out = torch.where(nan_group[..., None, None], torch.zeros_like(out), out)
    nonzero = (codes & 0x7) != 0
    underflow = (nonzero & ((out & 0x7F) == 0) & ~nan_group[..., None, None]).sum()
    fp32_scales = pow2_float32(emax - 127 - FP8_HEADROOM_EXP)
    fp32_scales = torch.where(nan_group, torch.full_like(fp32_scales, float("nan")), fp32_scales)
    return out.reshape(*lead, k).view(torch.float8_e4m3fn), fp32_scales, underflow


def fp8_cols_row_stride(n: int) -> int:
    """Row stride (elements = bytes) of the [H, N] E4M3 data of mxfp4_rows_to_fp8_cols: N rounded up to
    FP8_COLS_ROW_ALIGN."""
    return -(-n // FP8_COLS_ROW_ALIGN) * FP8_COLS_ROW_ALIGN


def mxfp4_rows_to_fp8_cols(
    packed: torch.Tensor,
    scales: torch.Tensor,
    split_lens: torch.Tensor,
    split_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 rows grouped by expert -> FP8 columns, one transposed block per expert.

    packed uint8 [N, H/2], scales uint8 [N, H/32]; split_lens int [E] rows per expert, split_offsets
    int [E] (None: back to back from row 0). Returns
      data float8_e4m3fn [H, N] with strides (fp8_cols_row_stride(N), 1): expert e's rows r in
        [off_e, off_e + len_e) become columns of the same index (columns of rows outside every
        segment are zero);
      scales float32 [H, G], G = sum_e ceil(len_e / 128), outer-dim-major (strides (1, H)): expert
        e's groups are the columns [goff_e, goff_e + ceil(len_e/128));
      group_offsets int64 [E + 1]: goff_e, then G.
    """
    k = _check_mxfp4(packed, scales)
    if packed.dim() != 2:
        raise ValueError(f"packed: expected 2 dimensions [N, H/2], got shape {tuple(packed.shape)}")
    n = packed.shape[0]
    offs = check_splits(split_lens, split_offsets, n).cpu().tolist()
    lens = split_lens.to(torch.int64).cpu().tolist()
    values = dequantize_mxfp4(packed, scales)  # exact
    data = torch.zeros(k, fp8_cols_row_stride(n), dtype=torch.uint8, device=packed.device)[:, :n]
    group_counts = [-(-ln // FP8_GROUP) for ln in lens]
    goffs = [0]
    for c in group_counts:
        goffs.append(goffs[-1] + c)
    out_scales = torch.empty(goffs[-1], k, dtype=torch.float32, device=packed.device).t()
    for e, (off, ln) in enumerate(zip(offs, lens)):
        if ln == 0:
            continue
        cols = values[off:off + ln].t()  # [H, len]
        pad = group_counts[e] * FP8_GROUP - ln
        cols = torch.nn.functional.pad(cols, (0, pad))
        q, s = quantize_fp8_blockwise(cols, block=(1, FP8_GROUP))
        data[:, off:off + ln] = q.view(torch.uint8)[:, :ln]
        out_scales[:, goffs[e]:goffs[e + 1]] = s
    return data.view(torch.float8_e4m3fn), out_scales, torch.tensor(goffs, dtype=torch.int64)
