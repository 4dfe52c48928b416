"""The numeric spec of moe_fp4, in plain PyTorch (CPU and GPU).

Every CUDA kernel and every payload codec of the library is checked against these functions bit
for bit. The rules of each format are in its module's docstring:
  elements       E2M1, E2M3, E3M2, E4M3, E5M2 element codecs; UE8M0 scale bytes
  mx             MX block quantization (MXFP8, MXFP6, MXFP4), 1x32 or 32x1 blocks
  packing        two E2M1 codes per byte; the MXFP4 byte row of one token
  nvfp4          NVFP4 (1x16 or 16x16 blocks, E4M3 block scales, FP32 tensor scale); its byte row
  fp8_blockwise  E4M3 with FP32 power-of-two scales per 1x128 / 128x128
  convert        direct MXFP4 -> FP8 1x128 rows and FP8 columns per expert
  ragged         split lengths / offsets of rows grouped by expert
  swizzle        the Blackwell 128x4 scale layout and its inverse

Bad arguments raise ValueError naming the argument. Checks that read tensor values (codes out of
range, a negative amax) are skipped while torch.compile traces a caller, since each would force a
host synchronisation; shape, dtype and argument checks always run.
"""

from moe_fp4.formats.convert import (
    FP8_COLS_ROW_ALIGN,
    FP8_GROUP,
    FP8_HEADROOM_EXP,
    fp8_cols_row_stride,
    mxfp4_rows_to_fp8_cols,
    mxfp4_to_fp8_blockwise,
)
from moe_fp4.formats.elements import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    ELEMENT_FORMATS,
    ElementFormat,
    decode_elements,
    decode_table,
    decode_ue8m0,
    encode_elements,
    encode_ue8m0,
    mx_scale_bytes,
    pow2_float32,
)
from moe_fp4.formats.fp8_blockwise import dequantize_fp8_blockwise, quantize_fp8_blockwise
from moe_fp4.formats.mx import (
    MX_BLOCK,
    dequantize_mx,
    dequantize_mxfp4,
    dequantize_mxfp6,
    dequantize_mxfp8,
    quantize_mx,
    quantize_mxfp4,
    quantize_mxfp6,
    quantize_mxfp8,
)
from moe_fp4.formats.nvfp4 import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    dequantize_nvfp4_rows,
    nvfp4_global_scale,
    nvfp4_row_bytes,
    pack_nvfp4_rows,
    quantize_nvfp4,
    unpack_nvfp4_rows,
)
from moe_fp4.formats.packing import mxfp4_row_bytes, pack_fp4, pack_mxfp4_rows, unpack_fp4, unpack_mxfp4_rows
from moe_fp4.formats.ragged import check_splits, group_by_expert, split_offsets
from moe_fp4.formats.swizzle import from_blackwell_scale_layout, to_blackwell_scale_layout

__all__ = [
    "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "ELEMENT_FORMATS", "ElementFormat",
    "FP8_COLS_ROW_ALIGN", "FP8_GROUP", "FP8_HEADROOM_EXP", "MX_BLOCK", "NVFP4_BLOCK",
    "check_splits", "decode_elements", "decode_table", "decode_ue8m0", "dequantize_fp8_blockwise",
    "dequantize_mx", "dequantize_mxfp4", "dequantize_mxfp6", "dequantize_mxfp8", "dequantize_nvfp4",
    "dequantize_nvfp4_rows",
    "encode_elements", "encode_ue8m0", "fp8_cols_row_stride", "from_blackwell_scale_layout", "group_by_expert",
    "mx_scale_bytes", "mxfp4_row_bytes", "mxfp4_rows_to_fp8_cols", "mxfp4_to_fp8_blockwise",
    "nvfp4_global_scale", "nvfp4_row_bytes", "pack_fp4", "pack_mxfp4_rows", "pack_nvfp4_rows", "pow2_float32",
    "quantize_fp8_blockwise",
    "quantize_mx", "quantize_mxfp4", "quantize_mxfp6", "quantize_mxfp8", "quantize_nvfp4",
    "split_offsets", "to_blackwell_scale_layout", "unpack_fp4", "unpack_mxfp4_rows", "unpack_nvfp4_rows",
]
