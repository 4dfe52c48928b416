// Host launchers of the sm90_ conversion kernels. Raw device pointers and the caller's stream; no
// torch. Each launcher enqueues its kernels on `stream`, never synchronizes, and returns the launch
// status (cudaGetLastError). Shapes: T/N rows (tokens), H hidden size (elements per row).
// The launchers do not validate their parameters: the caller (the binding, csrc/torch) checks every
// value that could make a kernel read or write out of bounds, as the comments on the fields state.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace moe_fp4 {

enum class FloatInput : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Ragged expert segments on the device: rows [offsets[e], offsets[e] + lens[e]) belong to expert e.
struct Segments {
  const void* lens = nullptr;     // int32/int64 [num]; nullptr: every row is one segment
  const void* offsets = nullptr;  // int32/int64 [num]; nullptr: back to back from row 0
  bool is64 = true;               // element type of lens/offsets
  int num = 0;                    // number of segments (experts)
};

// Several destinations for each token's byte row (the expert-parallel dispatch writing straight into
// every rank's receive buffer, peers' over NVLink): token t's row goes to row rows[t * num + d] of
// destination d, at base[d] + row * row_bytes; a negative row, or one at or past capacity[d], is
// skipped. The addresses are passed by value (no device table to fill before the launch).
constexpr int kMaxRowDestinations = 8;
// Elements per row (the hidden size H) the kernels take: their per-row indices are 32-bit.
constexpr long long kMaxHidden = 1LL << 24;
struct RowDestinations {
  uint8_t* base[kMaxRowDestinations];       // destination d's row 0 (device addresses, peers' included)
  long long capacity[kMaxRowDestinations];  // rows destination d holds
  const long long* rows;                    // int64 [T, num]: the row of each (token, destination)
  int num;                                  // destinations in use, 0..kMaxRowDestinations (0: none)
  long long row_bytes;                      // bytes between rows, the same in every destination
  int max_blocks;                           // > 0: launch at most this many thread blocks (their warps
                                            // stride over the rows), leaving the other SM slots to
                                            // kernels of other streams; 0: fill the GPU
};

// quantize_mxfp4 (and quantize_mxfp4_rows, _rows_multi): x [T, H] (row stride x_stride elements) -> MXFP4.
struct QuantizeMxfp4Params {
  const void* x;             // float32/bfloat16/float16 [T, H]
  FloatInput x_type;
  long long x_stride;        // elements between rows of x (16-byte aligned rows)
  uint8_t* packed;           // uint8 [R, H/2] rows of E2M1 pairs (element 2i in the low nibble)
  long long packed_stride;   // bytes between rows of packed
  uint8_t* scales;           // uint8 [R, H/32] UE8M0 scale bytes
  long long scales_stride;   // bytes between rows of scales (byte rows: both strides are H/2 + H/32)
  const void* row_index;     // int32/int64 [T] output row of each token, or nullptr (token t -> row t)
  bool row_index_is64;
  long long out_rows;        // R: rows of the output; tokens whose row_index is outside [0, R) are skipped
  long long tokens;          // T
  int hidden;                // H, a multiple of 32
  bool round_up;             // scale rounding: true "up" (rceil), false "down" (OCP floor)
  RowDestinations dests;     // num > 0 (bfloat16 x only): byte rows [H/2 packed | H/32 scales] to
                             // these destinations instead (packed, scales, row_index, out_rows unused)
  // With destinations and fp8_out set: the rows stored to destination fp8_dest are also converted to
  // FP8 1x128 (as launch_mxfp4_rows_expand_fp8_blockwise) from the staged row and written to the output
  // rows fp8_slots[r, 0..fp8_k), r the token's row in that destination (outside [0, fp8_rows): skipped).
  // H must be a multiple of 128.
  int fp8_dest;
  const long long* fp8_slots;  // int64 [rows of destination fp8_dest, fp8_k]
  int fp8_k;                   // 1..32
  uint8_t* fp8_out;            // float8_e4m3fn [fp8_rows, H], or nullptr: no conversion
  float* fp8_scales;           // float32 [fp8_rows, H/128]
  long long fp8_rows;
};
cudaError_t launch_quantize_mxfp4(const QuantizeMxfp4Params& p, cudaStream_t stream);

// Encoded byte rows to several destinations: src [T, B] (row stride src_stride bytes) -> dests
// (row_bytes = B). The dispatch's push of rows that need no encoding (bfloat16 tokens as they are)
// or were encoded beforehand.
struct ScatterRowsParams {
  const uint8_t* src;        // uint8 [T, B]
  long long src_stride;      // bytes between rows of src
  long long tokens;          // T
  RowDestinations dests;     // num >= 1
};
cudaError_t launch_scatter_rows(const ScatterRowsParams& p, cudaStream_t stream);

// mxfp4_to_fp8_blockwise (and mxfp4_rows_to_fp8_blockwise): MXFP4 rows -> E4M3 [N, H] + FP32 scales
// [N, H/128] + underflow count.
struct Mxfp4ToFp8BlockwiseParams {
  const uint8_t* packed;       // uint8 [N, H/2] (row stride packed_stride bytes)
  long long packed_stride;
  const uint8_t* scales;       // uint8 [N, H/32] (row stride scales_stride bytes, 4-byte aligned rows)
  long long scales_stride;
  uint8_t* out;                // float8_e4m3fn [N, H]
  float* out_scales;           // float32 [N, H/128]
  unsigned long long* underflow;  // int64 0-dim, zeroed by the caller: nonzero values that became zero
  long long rows;              // N
  int hidden;                  // H, a multiple of 128
  Segments segments;           // rows outside every segment get zero data and zero scales
};
cudaError_t launch_mxfp4_to_fp8_blockwise(const Mxfp4ToFp8BlockwiseParams& p, cudaStream_t stream);

// mxfp4_rows_to_fp8_cols: MXFP4 rows grouped by expert -> E4M3 columns [H, N] + FP32 scales [H, G],
// the scales stored outer-dim-major (a [G, H] buffer).
struct Mxfp4RowsToFp8ColsParams {
  const uint8_t* packed;       // uint8 [N, H/2] (row stride packed_stride bytes, 16-byte aligned rows)
  long long packed_stride;
  const uint8_t* scales;       // uint8 [N, H/32] (row stride scales_stride bytes)
  long long scales_stride;
  uint8_t* out;                // float8_e4m3fn [H, N] at row stride out_stride; columns of rows outside
                               // every segment are zeroed
  long long out_stride;        // bytes between output rows, >= N (a multiple of 32 for whole-sector stores)
  float* out_scales;           // float32 [H, G] at strides (1, H): the scale of column h, group g at g H + h
                               // (16-byte aligned: the scale pass stores 4 scales at a time)
  long long* group_offsets;    // int64 [E + 1] (output): first scale column of each expert, then G
  long long* workspace;        // int64 [E + 1] scratch: first row of each expert, then the rows covered
  long long* group_rows;       // int64 [G, 2] scratch: first row and row count of each scale group
  long long rows;              // N
  int hidden;                  // H, a multiple of 128
  long long num_groups;        // G = sum_e ceil(len_e / 128), known to the caller
  Segments segments;           // lens required
  // Scratch of the two-pass path (both set: scale pass, then a pass writing whole aligned 128-token
  // output windows; either nullptr: the one-pass kernel):
  uint8_t* col_records;        // [G, H/8] 16-byte records (16-byte aligned): per scale group and 8
                               // hidden columns, the 8 scale bytes used to convert, then min | max << 8
  int* row_groups;             // int32 [ceil(N/128) * 128] (16-byte aligned): scale group of each row, -1 outside
  const long long* host_splits;  // host int64 [2, num_host_splits] or nullptr: the segments' lengths, then
                                 // their first rows, as the caller read them. The launcher derives each
                                 // scale group's first row and row count (column_groups_of) for the one-pass
                                 // kernel, which loads a group's rows before its own look-up and checks
                                 // them against it (up to kMaxColumnGroupHints groups; none past that)
  int num_host_splits;
  bool full_groups;            // the caller knows the segments are back to back from row 0 with lengths that
                               // are multiples of 128: group g is rows [128 g, 128 g + 128), so the one-pass
                               // kernel may load them before its look-up (checked against it afterwards)
  bool box_store;              // the one-pass kernel stores a tile of 128 rows (or the input's last rows)
                               // starting on a 16-row boundary by one tensor copy; false: every tile by
                               // the threads' 16-byte stores (for compute-sanitizer's initcheck, which
                               // does not see the copy engine's writes)
};
constexpr int kMaxColumnGroupHints = 1024;
// The column kernels' tiles (128 rows of 256 hidden columns) and their 32-bit indices: rows, and the CTAs
// of each pass (scale groups or 128-row windows, times 256-column chunks), all below 2^31.
constexpr int kColumnTileRows = 128;
constexpr int kColumnTileCols = 256;
constexpr bool mxfp4_rows_to_fp8_cols_fits(long long rows, long long hidden, long long num_groups) {
  const long long chunks = (hidden + kColumnTileCols - 1) / kColumnTileCols;
  const long long windows = (rows + kColumnTileRows - 1) / kColumnTileRows;
  return rows < (1LL << 31) && num_groups * chunks < (1LL << 31) && windows * chunks < (1LL << 31);
}
// Each scale group's first row and row count, expert by expert (FP8 groups of 128 rows from each
// segment's first row; empty segments have none), from host arrays of num lengths and first rows:
// emit(first, count) for each, in order; returns the number of groups.
template <typename Emit>
long long column_groups_of(const long long* lens, const long long* starts, int num, Emit emit) {
  long long groups = 0;
  for (int e = 0; e < num; ++e) {
    for (long long j = 0; j < lens[e]; j += 128, ++groups) emit(starts[e] + j, lens[e] - j < 128 ? lens[e] - j : 128);
  }
  return groups;
}
cudaError_t launch_mxfp4_rows_to_fp8_cols(const Mxfp4RowsToFp8ColsParams& p, cudaStream_t stream);

// BF16 -> FP8 1x128: x [T, H] -> E4M3 [T, H] + FP32 power-of-two scales [T, H/128].
struct QuantizeFp8BlockwiseParams {
  const void* x;             // float32/bfloat16/float16 [T, H] (row stride x_stride elements)
  FloatInput x_type;
  long long x_stride;
  uint8_t* out;              // float8_e4m3fn [T, H]
  float* out_scales;         // float32 [T, H/128]
  long long tokens;
  int hidden;                // H, a multiple of 128
  RowDestinations dests;     // num > 0 (bfloat16 x only): byte rows [H E4M3 | H/128 FP32 scales] to
                             // these destinations instead (out, out_scales unused)
  int row_parts;             // set by the launcher (the caller's value is ignored): warps per row
};
cudaError_t launch_quantize_fp8_blockwise(const QuantizeFp8BlockwiseParams& p, cudaStream_t stream);
// The widest byte row the multi-destination quantizers (RowDestinations with num > 0) can stage: each
// CTA keeps one row per warp in shared memory, so a row may take an eighth of the current device's
// opt-in shared memory per block, less a reserve for the kernels' own (0 if the query fails).
long long max_staged_row_bytes();

// FP8 blockwise along both axes in one pass (the operands of a linear layer's real FP8 GEMMs):
// x [M, K] -> row-major E4M3 [M, K] and/or the transpose E4M3 [K, ld_t], ld_t = M rounded up to 128
// (rows of x past M read as zeros). Rows mode: 1x128 groups along each axis; tiles mode: one scale per
// 128x128 tile (M a multiple of 128), the transpose's scales being the transpose of out_scales.
struct QuantizeFp8TwoAxisParams {
  const void* x;             // float32/bfloat16 [M, K] (row stride x_stride elements, 16-byte aligned rows)
  FloatInput x_type;         // kFloat32 or kBFloat16
  long long x_stride;
  long long rows;            // M (at most 65535 * 128)
  long long cols;            // K, a multiple of 128
  bool tiles;                // false: rows mode; true: tiles mode
  uint8_t* out;              // float8_e4m3fn [M, K], or nullptr (rows mode: no row-major copy)
  float* out_scales;         // rows mode float32 [M, K/128]; tiles mode [M/128, K/128]
  uint8_t* out_t;            // float8_e4m3fn [K, ld_t], or nullptr (no transposed copy)
  float* out_t_scales;       // rows mode float32 [K, ld_t/128] (tiles mode: unused)
  long long ld_t;            // M rounded up to a multiple of 128
  long long t_group_rows;    // tiles mode: 0, or the rows of each of the stacked matrices of x (a multiple
                             // of 128 dividing M): out_t then holds each one's transpose after the other,
                             // [M / t_group_rows][K][t_group_rows] (a stack of weights: each w_g^T contiguous)
};
cudaError_t launch_quantize_fp8_2d(const QuantizeFp8TwoAxisParams& p, cudaStream_t stream);

// MXFP4 -> BF16: packed [N, H/2] + scales [N, H/32] -> bfloat16 [N, H] (the spec's dequantize_mxfp4
// in float32, then cast).
struct DequantizeMxfp4Params {
  const uint8_t* packed;     // uint8 [N, H/2] (row stride packed_stride bytes, 4-byte aligned rows)
  long long packed_stride;
  const uint8_t* scales;     // uint8 [N, H/32] (row stride scales_stride bytes)
  long long scales_stride;
  uint16_t* out;             // bfloat16 [N, H], contiguous, 16-byte aligned
  long long rows;            // N
  int hidden;                // H, a multiple of 32
};
cudaError_t launch_dequantize_mxfp4(const DequantizeMxfp4Params& p, cudaStream_t stream);

// NVFP4 byte rows: x [T, H] -> uint8 [T, H/2 + H/16 + 4] rows, H/2 packed E2M1 bytes (element 2i in
// the low nibble), H/16 E4M3 block scales, then the FP32 tensor scale of the whole x (its 4 bytes,
// little endian): formats.pack_nvfp4_rows of formats.quantize_nvfp4(x).
struct QuantizeNvfp4RowsParams {
  const void* x;             // float32/bfloat16/float16 [T, H] (row stride x_stride elements, 16-byte aligned rows)
  FloatInput x_type;
  long long x_stride;
  uint8_t* out;              // uint8 [T, H/2 + H/16 + 4] (row stride out_stride bytes)
  long long out_stride;
  unsigned int* amax_bits;   // uint32 [1] scratch: float32 bits of the largest finite |x| (cleared by the launcher)
  long long tokens;          // T
  int hidden;                // H, a multiple of 16
};
cudaError_t launch_quantize_nvfp4_rows(const QuantizeNvfp4RowsParams& p, cudaStream_t stream);

// NVFP4 byte rows [n, H/2 + H/16 + 4] (each with its FP32 tensor scale) -> E4M3 [n, H] + FP32 scales
// [n, H/128]: each element decoded exactly as formats.dequantize_nvfp4_rows (E2M1 value times the block
// divisor float32(e4m3 scale * tensor scale)), then quantized as formats.quantize_fp8_blockwise
// (power-of-two scale per 1x128 group; NaN scale and zero data for a group holding NaN or Inf).
struct Nvfp4RowsToFp8BlockwiseParams {
  const uint8_t* rows;       // 4-byte aligned rows, row stride row_stride bytes
  long long row_stride;
  uint8_t* out;              // float8_e4m3fn [n, H], contiguous
  float* out_scales;         // float32 [n, H/128], contiguous
  long long tokens;          // n
  int hidden;                // H, a multiple of 128
};
cudaError_t launch_nvfp4_rows_to_fp8_blockwise(const Nvfp4RowsToFp8BlockwiseParams& p, cudaStream_t stream);

// mxfp4_rows_expand_fp8_blockwise: mxfp4_to_fp8_blockwise fused with the expansion to expert rows:
// MXFP4 byte rows [n, H/2 + H/32] -> E4M3 [R, H] + FP32 scales [R, H/128], received row t converted
// once and written to output row slots[t, j] for every j whose slot lies in [0, R) (the other slots
// are skipped). Output rows named by no slot are not written.
struct Mxfp4RowsExpandFp8BlockwiseParams {
  const uint8_t* rows;       // uint8 [n, H/2 + H/32] (row stride row_stride bytes, 4-byte aligned rows)
  long long row_stride;
  const long long* slots;    // int64 [n, k]: the output row of each (row, slot), -1 for none
  int k;                     // slots per row, 1..32
  uint8_t* out;              // float8_e4m3fn [R, H]
  float* out_scales;         // float32 [R, H/128]
  long long tokens;          // n
  long long num_rows;        // R
  int hidden;                // H, a multiple of 128
  uint8_t* copy_to;          // or nullptr: also copy each byte row that names an output row, as it is,
  long long copy_stride;     // to copy_to + c * copy_stride (4-byte aligned rows; the dispatch keeps its
                             // received rows this way), c = t or, with copy_rows, copy_rows[t] (outside
  const long long* copy_rows;  // [0, copy_count): not copied)
  long long copy_count;
};
cudaError_t launch_mxfp4_rows_expand_fp8_blockwise(const Mxfp4RowsExpandFp8BlockwiseParams& p, cudaStream_t stream);

// The dispatch's routing tables (moe_fp4.ops.routing is their reference; see moe_fp4.ep.layout).
// Count rows: one int64 row of info_width values per destination rank r, exchanged with the peers:
//   [kInfoError] 0 (the caller sets 1 when it rejected its inputs),
//   [kInfoHeader, +kLayoutHeader) the header values as given,
//   [kInfoInvalid] ids outside [-1, E),
//   [kInfoDropped] with block_rows: the tokens for rank r past its block (not sent),
//   [kInfoRanks, +W) tokens routed to each rank (the same in every row),
//   [kInfoRanks + W, +L) (token, slot) pairs sent to each of rank r's L = E / W experts,
//   [kInfoRanks + W + L, +k) tokens whose slot j goes to rank r; zeros up to info_width.
constexpr int kInfoError = 0;
constexpr int kInfoHeader = 1;
constexpr int kLayoutHeader = 8;
constexpr int kInfoInvalid = kInfoHeader + kLayoutHeader;
constexpr int kInfoDropped = kInfoInvalid + 1;
constexpr int kInfoRanks = kInfoDropped + 1;
constexpr int kMaxLayoutRanks = 64;     // destination sets are 64-bit masks
constexpr int kMaxLayoutExperts = 1024; // local experts of the expand layout (per-warp counters in shared memory)

// Sender: the send order (blocks by destination rank, tokens ascending in a block), each token's row in
// it, the metadata rows and the count rows. Two kernels, no host synchronization. With block_rows = B > 0
// rank r's block is rows [r B, r B + B) whatever the counts (the layout of a dispatch whose sizes the
// host does not know): the first B tokens for r take its first rows, later ones are not sent (rank_table
// -1, counted in kInfoDropped), and the block's unused rows get metadata ids -1, weights 0, token -1 and
// send_token 0.
struct SendLayoutParams {
  const void* topk_idx;          // int32/int64 [T, k] (contiguous): expert ids, -1 none, others invalid
  bool idx_is64;
  const void* topk_weights;      // float32/bfloat16/float16 [T, k] (contiguous), or nullptr (weights 0)
  FloatInput weights_type;
  long long tokens;              // T
  int topk;                      // k
  int num_experts;               // E, a multiple of W
  int world_size;                // W, 1..kMaxLayoutRanks
  long long header[kLayoutHeader];  // copied into every count row
  long long* info;               // int64 [W, info_width] (output): the count rows
  int info_width;                // >= kInfoRanks + W + E / W + k
  long long* rank_table;         // int64 [T, W] (output): the send row of (token, rank), -1 if not sent there
  long long* send_token;         // int64 [T * W] (W * B with block_rows) (output): the token of each send
                                 // row (the first n_send)
  long long block_rows;          // B: 0 for blocks back to back, else each block's fixed row count
  int* meta;                     // int32 [T * W, 2k + 1] (output, the first n_send rows): the ids of the
                                 // rank's experts as local ids (-1 elsewhere), the weights' float32 bits,
                                 // the token's index
  int* scratch;                  // int32 [send_layout_scratch_ints(T, k, E, W)], 8-byte aligned
};
long long send_layout_scratch_ints(long long tokens, int topk, int num_experts, int world_size);
cudaError_t launch_send_layout(const SendLayoutParams& p, cudaStream_t stream);

// Receiver: the received tokens' (token, slot) entries grouped by local expert, in entry order within
// an expert, each expert's rows starting at the aligned prefix of the lengths (a stable counting sort,
// two kernels). Rows at or past num_rows are not written (their slots get -1); rows past the last
// expert's (aligned) rows get expand_row -1, expand_slot -1, row_weights 0.
struct ExpandLayoutParams {
  const int* meta;               // int32 [n, 2k + 1]: the received metadata rows (as SendLayoutParams::meta)
  long long tokens;              // n
  int topk;                      // k
  int num_local;                 // L, 1..kMaxLayoutExperts
  int alignment;                 // >= 1
  long long num_rows;            // R: rows of the outputs below
  long long* slot_table;         // int64 [n, k] (output): the row of each entry, -1 for none
  long long* expand_row;         // int64 [R] (output): the token of each row, -1 for a gap row
  long long* expand_slot;        // int64 [R] (output): the slot of each row, -1 for a gap row
  float* row_weights;            // float32 [R] (output, or nullptr): the weight of each row, 0 for a gap row
  long long* split_lens;         // int64 [L] (output)
  long long* split_offsets;      // int64 [L] (output): the aligned starts
  long long* gap_rows;           // int64 [num_gap] (output, or nullptr): the rows between the experts,
                                 // ascending, num_rows for those past the capacity and the entries past them
  long long num_gap;             // entries of gap_rows
  long long* recv_topk_idx;      // int64 [n, k] (output): the local ids (-1 none)
  float* recv_topk_weights;      // float32 [n, k] (output, or nullptr)
  long long* recv_src_token;     // int64 [n] (output): each token's index in its source's batch
  long long* rows_needed;        // int64 [1] (output, or nullptr): the rows the experts take, aligned
  int* scratch;                  // int32 [expand_layout_scratch_ints(n, k, L)]
};
// The (token, slot) entries n k the expand layout takes: its entry indices are 32-bit.
constexpr long long kMaxExpandEntries = 2147483647LL - 2 * 1024;
long long expand_layout_scratch_ints(long long tokens, int topk, int num_local);
cudaError_t launch_expand_layout(const ExpandLayoutParams& p, cudaStream_t stream);

}  // namespace moe_fp4
