// The thin torch binding of the sm90_ conversion kernels: argument checks (each naming the argument
// and what was expected), output allocation, the current CUDA stream. The torch.library custom ops
// over these functions, their fake implementations and the CPU fallback live in moe_fp4/ops.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sm90_launchers.h"

namespace {

using at::Tensor;

#define MOE_FP4_CHECK_CUDA(t, name) \
  TORCH_CHECK((t).is_cuda(), name ": expected a CUDA tensor, got device ", (t).device())
#define MOE_FP4_CHECK_DTYPE(t, dtype, name) \
  TORCH_CHECK((t).scalar_type() == (dtype), name ": expected dtype ", (dtype), ", got ", (t).scalar_type())
#define MOE_FP4_CHECK_DIM(t, n, name) \
  TORCH_CHECK((t).dim() == (n), name ": expected ", (n), " dimensions, got shape ", (t).sizes())
#define MOE_FP4_CHECK_INNER(t, name) \
  TORCH_CHECK((t).size(-1) <= 1 || (t).stride(-1) == 1, name ": expected a contiguous last dimension, got strides ", (t).strides())
#define MOE_FP4_CHECK_SAME_DEVICE(t, ref, name) \
  TORCH_CHECK((t).device() == (ref).device(), name ": expected device ", (ref).device(), ", got ", (t).device())

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// The hidden size H as the kernels' 32-bit row length, within their limit.
int checked_hidden(int64_t h, const char* name) {
  TORCH_CHECK(h <= moe_fp4::kMaxHidden, name, ": rows of ", h, " elements exceed the native kernels' limit of ",
              moe_fp4::kMaxHidden, " elements per row");
  return static_cast<int>(h);
}

// Rows the kernels read by 4-byte words: a 4-byte aligned start and, with more than one row, row stride
// (moe_fp4.ops routes other views to the spec).
void check_word_rows(const void* data, int64_t stride, int64_t rows, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data) % 4 == 0 && (rows <= 1 || stride % 4 == 0), name,
              ": rows must be 4-byte aligned");
}

moe_fp4::FloatInput float_input(const Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return moe_fp4::FloatInput::kFloat32;
    case at::kBFloat16: return moe_fp4::FloatInput::kBFloat16;
    case at::kHalf: return moe_fp4::FloatInput::kFloat16;
    default: TORCH_CHECK(false, "x: expected dtype float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

void check_float_rows(const Tensor& x, int64_t block) {
  MOE_FP4_CHECK_CUDA(x, "x");
  float_input(x);
  MOE_FP4_CHECK_DIM(x, 2, "x");
  MOE_FP4_CHECK_INNER(x, "x");
  TORCH_CHECK(x.size(1) % block == 0, "x: last dimension (", x.size(1), ") must be a multiple of ", block);
  TORCH_CHECK(x.size(0) <= 1 || (x.stride(0) * x.element_size()) % 16 == 0,
              "x: rows must start 16 bytes apart (row stride ", x.stride(0), " elements)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x: data must be 16-byte aligned");
}

// Ragged segments: lens/offsets int32 or int64 1-D on x's device, offsets' shape and dtype matching lens.
moe_fp4::Segments segments_of(const std::optional<Tensor>& lens, const std::optional<Tensor>& offsets,
                              const Tensor& ref) {
  moe_fp4::Segments s;
  if (!lens.has_value()) return s;  // (offsets without lengths: moe_fp4.ops refuses them)
  const Tensor& l = *lens;
  MOE_FP4_CHECK_SAME_DEVICE(l, ref, "split_lens");
  TORCH_CHECK(l.scalar_type() == at::kInt || l.scalar_type() == at::kLong,
              "split_lens: expected dtype int32 or int64, got ", l.scalar_type());
  MOE_FP4_CHECK_DIM(l, 1, "split_lens");
  TORCH_CHECK(l.is_contiguous(), "split_lens: expected a contiguous tensor");
  // An empty tensor's data pointer is null, which the kernels read as "no split given" (every row
  // in one segment); zero segments must leave every row outside, so they get a pointer never read.
  static const long long kNoSegments = 0;
  s.lens = l.numel() > 0 ? l.data_ptr() : static_cast<const void*>(&kNoSegments);
  s.is64 = l.scalar_type() == at::kLong;
  s.num = static_cast<int>(l.size(0));
  if (offsets.has_value()) {
    const Tensor& o = *offsets;
    MOE_FP4_CHECK_SAME_DEVICE(o, ref, "split_offsets");
    TORCH_CHECK(o.scalar_type() == l.scalar_type(), "split_offsets: expected dtype ", l.scalar_type(),
                " (that of split_lens), got ", o.scalar_type());
    TORCH_CHECK(o.sizes() == l.sizes(), "split_offsets: expected shape ", l.sizes(), ", got ", o.sizes());
    TORCH_CHECK(o.is_contiguous(), "split_offsets: expected a contiguous tensor");
    s.offsets = o.data_ptr();
  }
  return s;
}

// x [T, H] float -> (packed uint8 [T, H/2], scales uint8 [T, H/32]).
std::tuple<Tensor, Tensor> quantize_mxfp4(const Tensor& x, bool round_up) {
  check_float_rows(x, 32);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0), h = x.size(1);
  auto opts = x.options().dtype(at::kByte);
  Tensor packed = at::empty({t, h / 2}, opts), scales = at::empty({t, h / 32}, opts);
  moe_fp4::QuantizeMxfp4Params p{};
  p.x = x.data_ptr();
  p.x_type = float_input(x);
  p.x_stride = x.stride(0);
  p.packed = packed.data_ptr<uint8_t>();
  p.packed_stride = h / 2;
  p.scales = scales.data_ptr<uint8_t>();
  p.scales_stride = h / 32;
  p.row_index = nullptr;
  p.out_rows = t;
  p.tokens = t;
  p.hidden = checked_hidden(h, "x");
  p.round_up = round_up;
  check_launch(moe_fp4::launch_quantize_mxfp4(p, c10::cuda::getCurrentCUDAStream()), "quantize_mxfp4");
  return {packed, scales};
}

// x [T, H] float -> byte rows written into out uint8 [R, H/2 + H/32]: token t to row row_index[t]
// (or row t). Returns nothing; out is modified in place.
void quantize_mxfp4_rows_into(const Tensor& x, bool round_up, Tensor& out, const std::optional<Tensor>& row_index) {
  check_float_rows(x, 32);
  const int64_t t = x.size(0), h = x.size(1), width = h / 2 + h / 32;
  MOE_FP4_CHECK_SAME_DEVICE(out, x, "out");
  MOE_FP4_CHECK_DTYPE(out, at::kByte, "out");
  MOE_FP4_CHECK_DIM(out, 2, "out");
  TORCH_CHECK(out.size(1) == width, "out: expected ", width, " bytes per row for hidden ", h, ", got ", out.size(1));
  MOE_FP4_CHECK_INNER(out, "out");
  const c10::cuda::CUDAGuard guard(x.device());
  moe_fp4::QuantizeMxfp4Params p{};
  if (row_index.has_value()) {
    const Tensor& ri = *row_index;
    MOE_FP4_CHECK_SAME_DEVICE(ri, x, "row_index");
    TORCH_CHECK(ri.scalar_type() == at::kInt || ri.scalar_type() == at::kLong,
                "row_index: expected dtype int32 or int64, got ", ri.scalar_type());
    TORCH_CHECK(ri.dim() == 1 && ri.size(0) == t, "row_index: expected shape [", t, "], got ", ri.sizes());
    TORCH_CHECK(ri.is_contiguous(), "row_index: expected a contiguous tensor");
    p.row_index = ri.data_ptr();
    p.row_index_is64 = ri.scalar_type() == at::kLong;
  } else {
    TORCH_CHECK(out.size(0) >= t, "out: expected at least ", t, " rows (one per token), got ", out.size(0));
    p.row_index = nullptr;
  }
  p.x = x.data_ptr();
  p.x_type = float_input(x);
  p.x_stride = x.stride(0);
  p.packed = out.data_ptr<uint8_t>();
  p.packed_stride = out.stride(0);
  p.scales = out.data_ptr<uint8_t>() + h / 2;
  p.scales_stride = out.stride(0);
  p.out_rows = out.size(0);
  p.tokens = t;
  p.hidden = checked_hidden(h, "x");
  p.round_up = round_up;
  check_launch(moe_fp4::launch_quantize_mxfp4(p, c10::cuda::getCurrentCUDAStream()), "quantize_mxfp4_rows");
}

// t on ref's device with dtype `dtype` (a function, not a MOE_FP4_CHECK_* macro: those need the
// argument's name as a literal, and these helpers get it at run time).
void check_device_dtype(const Tensor& t, const Tensor& ref, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, ": expected device ", ref.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ", t.scalar_type());
}

// int64 [rows, k] contiguous, 1 <= k <= 32, on ref's device: the output rows of each byte row.
void check_slot_table(const Tensor& slots, const Tensor& ref, int64_t rows, const char* name) {
  check_device_dtype(slots, ref, at::kLong, name);
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous() && slots.size(0) == rows && slots.size(1) >= 1 &&
                  slots.size(1) <= 32,
              name, ": expected a contiguous [", rows, ", k] tensor with 1 <= k <= 32 (one row per byte row), got ",
              slots.sizes());
}

// An FP8 1x128 output written in place: e4m3 [R, hidden] and float32 [R, hidden / 128], contiguous.
void check_fp8_rows_output(const Tensor& out, const Tensor& out_scales, const Tensor& ref, int64_t hidden,
                           const char* name, const char* scales_name) {
  check_device_dtype(out, ref, at::kFloat8_e4m3fn, name);
  check_device_dtype(out_scales, ref, at::kFloat, scales_name);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == hidden && out.is_contiguous(), name, ": expected a contiguous [R, ",
              hidden, "] tensor, got ", out.sizes());
  TORCH_CHECK(out_scales.dim() == 2 && out_scales.size(0) == out.size(0) && out_scales.size(1) == hidden / 128 &&
                  out_scales.is_contiguous(),
              scales_name, ": expected a contiguous [", out.size(0), ", ", hidden / 128, "] tensor, got ",
              out_scales.sizes());
}

// dests: uint8 [R_d, width] tensors of ref's GPU with contiguous rows (a peer's symmetric-memory
// buffer mapped on this GPU is one); rows int64 [T, D] on ref's device, D = len(dests),
// at most kMaxRowDestinations. Row rows[t, d] of dests[d] receives token t's row (skipped when
// negative or >= R_d).
moe_fp4::RowDestinations row_destinations(const std::vector<Tensor>& dests, const Tensor& rows, const Tensor& ref,
                                          int64_t tokens, int64_t width, int64_t max_blocks) {
  TORCH_CHECK(max_blocks >= 0 && max_blocks <= (1LL << 30), "max_blocks: expected 0 (no limit) or a block count, got ",
              max_blocks);
  const int64_t num = static_cast<int64_t>(dests.size());
  TORCH_CHECK(num >= 1 && num <= moe_fp4::kMaxRowDestinations, "dests: expected 1 to ",
              moe_fp4::kMaxRowDestinations, " destination tensors, got ", num);
  MOE_FP4_CHECK_SAME_DEVICE(rows, ref, "dest_rows");
  MOE_FP4_CHECK_DTYPE(rows, at::kLong, "dest_rows");
  MOE_FP4_CHECK_DIM(rows, 2, "dest_rows");
  TORCH_CHECK(rows.size(0) == tokens && rows.size(1) == num, "dest_rows: expected shape [", tokens, ", ", num,
              "], got ", rows.sizes());
  TORCH_CHECK(rows.is_contiguous(), "dest_rows: expected a contiguous tensor");
  moe_fp4::RowDestinations d{};
  for (int64_t i = 0; i < num; ++i) {
    const Tensor& t = dests[i];
    MOE_FP4_CHECK_CUDA(t, "dests");
    // a peer's symmetric-memory buffer mapped on this GPU is a tensor of this GPU
    TORCH_CHECK(t.device() == ref.device(), "dests: expected device ", ref.device(), ", got ", t.device(), " in dests[",
                i, "]");
    MOE_FP4_CHECK_DTYPE(t, at::kByte, "dests");
    MOE_FP4_CHECK_DIM(t, 2, "dests");
    TORCH_CHECK(t.size(1) == width, "dests: expected ", width, " bytes per row, got ", t.size(1), " in dests[", i, "]");
    // each row is stored as one contiguous run, rows back to back (a single row needs contiguous bytes too)
    TORCH_CHECK(t.size(0) == 0 || (t.stride(1) == 1 && (t.size(0) == 1 || t.stride(0) == width)),
                "dests: expected back-to-back rows of contiguous bytes, got strides ", t.strides(), " in dests[", i,
                "]");
    d.base[i] = t.data_ptr<uint8_t>();
    d.capacity[i] = t.size(0);
  }
  d.rows = reinterpret_cast<const long long*>(rows.data_ptr<int64_t>());
  d.num = static_cast<int>(num);
  d.row_bytes = width;
  d.max_blocks = static_cast<int>(max_blocks);
  return d;
}

// The parameters the multi-destination quantizers share: bfloat16 rows x [T, H] and their byte rows of
// `width` bytes stored into every destination that takes them.
template <typename Params>
Params multi_rows_params(const Tensor& x, const std::vector<Tensor>& dests, const Tensor& dest_rows, int64_t width,
                         int64_t max_blocks) {
  const int64_t max_width = moe_fp4::max_staged_row_bytes();
  TORCH_CHECK(width <= max_width, "x: rows of ", x.size(1), " elements make ", width,
              "-byte rows; the multi-destination kernels stage 8 rows per block in shared memory, at most ",
              max_width, " bytes per row on this device");
  Params p{};
  p.dests = row_destinations(dests, dest_rows, x, x.size(0), width, max_blocks);
  p.x = x.data_ptr();
  p.x_type = moe_fp4::FloatInput::kBFloat16;
  p.x_stride = x.stride(0);
  p.tokens = x.size(0);
  p.hidden = checked_hidden(x.size(1), "x");
  return p;
}

// x [T, H] bfloat16 -> each token's MXFP4 byte row written to every destination that takes it.
// With fp8_out: the rows stored to dests[fp8_dest] are also converted to FP8 1x128 and written to the
// rows fp8_slots[r, :] of (fp8_out, fp8_scales), r the token's row in that destination.
void quantize_mxfp4_rows_multi(const Tensor& x, bool round_up, const std::vector<Tensor>& dests,
                               const Tensor& dest_rows, int64_t max_blocks, int64_t fp8_dest,
                               const c10::optional<Tensor>& fp8_slots, const c10::optional<Tensor>& fp8_out,
                               const c10::optional<Tensor>& fp8_scales) {
  check_float_rows(x, 32);
  MOE_FP4_CHECK_DTYPE(x, at::kBFloat16, "x");
  const int64_t h = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  auto p = multi_rows_params<moe_fp4::QuantizeMxfp4Params>(x, dests, dest_rows, h / 2 + h / 32, max_blocks);
  p.round_up = round_up;
  if (fp8_out.has_value()) {
    TORCH_CHECK(fp8_slots.has_value() && fp8_scales.has_value(), "fp8_out: needs fp8_slots and fp8_scales");
    TORCH_CHECK(fp8_dest >= 0 && fp8_dest < static_cast<int64_t>(dests.size()), "fp8_dest: expected a destination "
                "index in [0, ", dests.size(), "), got ", fp8_dest);
    TORCH_CHECK(h % 128 == 0, "x: FP8 1x128 output needs a hidden size that is a multiple of 128, got ", h);
    const Tensor& slots = *fp8_slots;
    const Tensor& out = *fp8_out;
    const Tensor& out_scales = *fp8_scales;
    check_slot_table(slots, x, dests[fp8_dest].size(0), "fp8_slots");
    check_fp8_rows_output(out, out_scales, x, h, "fp8_out", "fp8_scales");
    p.fp8_dest = static_cast<int>(fp8_dest);
    p.fp8_slots = reinterpret_cast<const long long*>(slots.data_ptr<int64_t>());
    p.fp8_k = static_cast<int>(slots.size(1));
    p.fp8_out = out.numel() ? reinterpret_cast<uint8_t*>(out.data_ptr()) : nullptr;
    p.fp8_scales = out_scales.data_ptr<float>();
    p.fp8_rows = out.size(0);
  }
  check_launch(moe_fp4::launch_quantize_mxfp4(p, c10::cuda::getCurrentCUDAStream()), "quantize_mxfp4_rows_multi");
}

// x [T, H] bfloat16, H % 128 == 0 -> each token's FP8 1x128 byte row [H E4M3 | H/128 FP32 scales]
// written to every destination that takes it.
void quantize_fp8_blockwise_rows_multi(const Tensor& x, const std::vector<Tensor>& dests, const Tensor& dest_rows,
                                       int64_t max_blocks) {
  check_float_rows(x, 128);
  MOE_FP4_CHECK_DTYPE(x, at::kBFloat16, "x");
  const int64_t h = x.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto p = multi_rows_params<moe_fp4::QuantizeFp8BlockwiseParams>(x, dests, dest_rows, h + 4 * (h / 128), max_blocks);
  check_launch(moe_fp4::launch_quantize_fp8_blockwise(p, c10::cuda::getCurrentCUDAStream()),
               "quantize_fp8_blockwise_rows_multi");
}

// src uint8 [T, B] -> each row copied to every destination that takes it.
void scatter_rows(const Tensor& src, const std::vector<Tensor>& dests, const Tensor& dest_rows, int64_t max_blocks) {
  MOE_FP4_CHECK_CUDA(src, "src");
  MOE_FP4_CHECK_DTYPE(src, at::kByte, "src");
  MOE_FP4_CHECK_DIM(src, 2, "src");
  MOE_FP4_CHECK_INNER(src, "src");
  const c10::cuda::CUDAGuard guard(src.device());
  moe_fp4::ScatterRowsParams p{};
  p.dests = row_destinations(dests, dest_rows, src, src.size(0), src.size(1), max_blocks);
  p.src = src.data_ptr<uint8_t>();
  p.src_stride = src.stride(0);
  p.tokens = src.size(0);
  check_launch(moe_fp4::launch_scatter_rows(p, c10::cuda::getCurrentCUDAStream()), "scatter_rows");
}

std::tuple<Tensor, Tensor, Tensor> mxfp4_to_fp8_blockwise_common(const Tensor& ref, const uint8_t* packed, int64_t packed_stride,
                                                   const uint8_t* scales, int64_t scales_stride, int64_t n,
                                                   int64_t h, const std::optional<Tensor>& split_lens,
                                                   const std::optional<Tensor>& split_offsets) {
  TORCH_CHECK(h % 128 == 0, "packed: hidden size (", h, ") must be a multiple of 128 for FP8 1x128 outputs");
  check_word_rows(packed, packed_stride, n, "packed");
  check_word_rows(scales, scales_stride, n, "scales");
  const c10::cuda::CUDAGuard guard(ref.device());
  Tensor out = at::empty({n, h}, ref.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({n, h / 128}, ref.options().dtype(at::kFloat));
  Tensor underflow = at::zeros({}, ref.options().dtype(at::kLong));
  moe_fp4::Mxfp4ToFp8BlockwiseParams p{};
  p.packed = packed;
  p.packed_stride = packed_stride;
  p.scales = scales;
  p.scales_stride = scales_stride;
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.underflow = reinterpret_cast<unsigned long long*>(underflow.data_ptr<int64_t>());
  p.rows = n;
  p.hidden = checked_hidden(h, "packed");
  p.segments = segments_of(split_lens, split_offsets, ref);
  check_launch(moe_fp4::launch_mxfp4_to_fp8_blockwise(p, c10::cuda::getCurrentCUDAStream()), "mxfp4_to_fp8_blockwise");
  return {out, out_scales, underflow};
}

void check_packed_scales(const Tensor& packed, const Tensor& scales) {
  MOE_FP4_CHECK_CUDA(packed, "packed");
  MOE_FP4_CHECK_DTYPE(packed, at::kByte, "packed");
  MOE_FP4_CHECK_DIM(packed, 2, "packed");
  MOE_FP4_CHECK_INNER(packed, "packed");
  MOE_FP4_CHECK_SAME_DEVICE(scales, packed, "scales");
  MOE_FP4_CHECK_DTYPE(scales, at::kByte, "scales");
  MOE_FP4_CHECK_DIM(scales, 2, "scales");
  MOE_FP4_CHECK_INNER(scales, "scales");
  TORCH_CHECK(scales.size(0) == packed.size(0) && scales.size(1) * 16 == packed.size(1),
              "scales: expected shape [", packed.size(0), ", ", packed.size(1) / 16, "] for packed of shape ",
              packed.sizes(), ", got ", scales.sizes());
}

// packed uint8 [N, H/2], scales uint8 [N, H/32] -> (e4m3 [N, H], float32 [N, H/128], int64 underflow).
std::tuple<Tensor, Tensor, Tensor> mxfp4_to_fp8_blockwise(const Tensor& packed, const Tensor& scales,
                                                     const std::optional<Tensor>& split_lens,
                                                     const std::optional<Tensor>& split_offsets) {
  check_packed_scales(packed, scales);
  return mxfp4_to_fp8_blockwise_common(packed, packed.data_ptr<uint8_t>(), packed.stride(0), scales.data_ptr<uint8_t>(),
                         scales.stride(0), packed.size(0), packed.size(1) * 2, split_lens, split_offsets);
}

// MXFP4 byte rows uint8 [N, H/2 + H/32] on CUDA, H a multiple of 128 (an FP8 1x128 output).
void check_mxfp4_byte_rows(const Tensor& rows, int64_t hidden) {
  MOE_FP4_CHECK_CUDA(rows, "rows");
  MOE_FP4_CHECK_DTYPE(rows, at::kByte, "rows");
  MOE_FP4_CHECK_DIM(rows, 2, "rows");
  MOE_FP4_CHECK_INNER(rows, "rows");
  TORCH_CHECK(hidden > 0 && hidden % 128 == 0, "hidden: expected a positive multiple of 128, got ", hidden);
  TORCH_CHECK(rows.size(1) == hidden / 2 + hidden / 32, "rows: expected ", hidden / 2 + hidden / 32,
              " bytes per row for hidden ", hidden, ", got ", rows.size(1));
}

// rows uint8 [N, H/2 + H/32] (byte rows) -> as mxfp4_to_fp8_blockwise.
std::tuple<Tensor, Tensor, Tensor> mxfp4_rows_to_fp8_blockwise(const Tensor& rows, int64_t hidden,
                                                               const std::optional<Tensor>& split_lens,
                                                               const std::optional<Tensor>& split_offsets) {
  check_mxfp4_byte_rows(rows, hidden);
  const uint8_t* base = rows.data_ptr<uint8_t>();
  return mxfp4_to_fp8_blockwise_common(rows, base, rows.stride(0), base + hidden / 2, rows.stride(0), rows.size(0), hidden,
                         split_lens, split_offsets);
}

// MOE_FP4_COLUMN_BOX_STORE, read once per process: 0 turns the column op's tensor-copy stores off.
bool column_box_store_default() {
  static const bool value = [] {
    const char* env = std::getenv("MOE_FP4_COLUMN_BOX_STORE");
    return env == nullptr || std::string(env) != "0";
  }();
  return value;
}

// A CPU int64 [2, E] tensor of segment lengths and first rows, contiguous.
Tensor checked_host_splits(const Tensor& splits) {
  TORCH_CHECK(splits.device().is_cpu() && splits.scalar_type() == at::kLong && splits.dim() == 2 && splits.size(0) == 2,
              "host_splits: expected a CPU int64 tensor [2, E] (lengths, first rows), got ", splits.device(), " ",
              splits.scalar_type(), " ", splits.sizes());
  TORCH_CHECK(splits.size(1) <= INT_MAX, "host_splits: too many segments (", splits.size(1), ")");
  return splits.contiguous();
}

// The scale groups the launcher derives from host splits: int32 [G, 2] (first row, row count), expert by expert.
Tensor column_group_table(const Tensor& host_splits) {
  const Tensor s = checked_host_splits(host_splits);
  const long long* v = reinterpret_cast<const long long*>(s.data_ptr<int64_t>());
  const int e = static_cast<int>(s.size(1));
  std::vector<int> flat;
  moe_fp4::column_groups_of(v, v + e, e, [&](long long first, long long count) {
    flat.push_back(static_cast<int>(first));
    flat.push_back(static_cast<int>(count));
  });
  Tensor out = at::empty({static_cast<int64_t>(flat.size() / 2), 2}, s.options().dtype(at::kInt));
  std::copy(flat.begin(), flat.end(), out.data_ptr<int>());
  return out;
}

// packed uint8 [N, H/2], scales uint8 [N, H/32], split_lens [E] (and offsets) -> (e4m3 [H, N],
// float32 [H, G], int64 group_offsets [E + 1]); G = sum ceil(len/128) is given by the caller, and so
// is the choice of path: one pass (each group's columns written as they are converted) or two passes
// (scales first, then whole aligned 16-byte pieces; for segments that start off a 16-row boundary);
// full_groups: the segments are back to back from row 0 with lengths that are multiples of 128;
// host_splits (CPU int64 [2, E], optional): the segments' lengths and first rows as the caller read
// them; the launcher derives each scale group's rows from them, so that the one-pass kernel loads a
// group's rows before its own look-up (checked against it: wrong splits cost time, not bytes);
// box_store: tiles stored by tensor copies (see Mxfp4RowsToFp8ColsParams), None: the process's
// MOE_FP4_COLUMN_BOX_STORE (unset or anything but 0: true).
std::tuple<Tensor, Tensor, Tensor> mxfp4_rows_to_fp8_cols(const Tensor& packed, const Tensor& scales,
                                                          const Tensor& split_lens,
                                                          const std::optional<Tensor>& split_offsets,
                                                          int64_t num_groups, bool two_pass, bool full_groups,
                                                          const std::optional<Tensor>& host_splits,
                                                          std::optional<bool> box_store) {
  check_packed_scales(packed, scales);
  const int64_t n = packed.size(0), h = packed.size(1) * 2;
  TORCH_CHECK(h % 128 == 0, "packed: hidden size (", h, ") must be a multiple of 128 for FP8 1x128 outputs");
  TORCH_CHECK(num_groups >= 0, "num_groups: expected a non-negative count, got ", num_groups);
  TORCH_CHECK(moe_fp4::mxfp4_rows_to_fp8_cols_fits(n, h, num_groups), "packed: ", n, " rows of ", h,
              " elements in ", num_groups, " scale groups exceed the column kernels' 32-bit indices");
  check_word_rows(packed.data_ptr(), packed.stride(0), packed.size(0), "packed");
  check_word_rows(scales.data_ptr(), scales.stride(0), scales.size(0), "scales");
  const c10::cuda::CUDAGuard guard(packed.device());
  moe_fp4::Mxfp4RowsToFp8ColsParams p{};
  p.segments = segments_of(split_lens, split_offsets, packed);
  // [H, N] at a row stride of N rounded up to 32 bytes (whole-sector stores; FP8 GEMMs take it as it is),
  // as formats.mxfp4_rows_to_fp8_cols returns it
  const int64_t out_stride = (n + 31) / 32 * 32;
  Tensor out = at::empty({h, out_stride}, packed.options().dtype(at::kFloat8_e4m3fn)).narrow(1, 0, n);
  // [H, G] outer-dim-major (strides (1, H)), as formats.mxfp4_rows_to_fp8_cols returns it
  Tensor out_scales = at::empty({num_groups, h}, packed.options().dtype(at::kFloat)).t();
  Tensor group_offsets = at::empty({p.segments.num + 1}, packed.options().dtype(at::kLong));
  // int64 workspace: [E + 1] expert rows, [G, 2] group rows, then (16-byte aligned) the two-pass
  // path's [G, H/8] 16-byte column records and int32 row groups padded to whole 128-row windows.
  const int64_t head = (p.segments.num + 1 + 2 * num_groups + 1) / 2 * 2;
  const int64_t record_words = two_pass ? num_groups * (h / 8) * 2 : 0;
  const int64_t row_group_words = two_pass ? (n + 127) / 128 * 128 / 2 : 0;
  Tensor workspace = at::empty({head + record_words + row_group_words}, packed.options().dtype(at::kLong));
  p.packed = packed.data_ptr<uint8_t>();
  p.packed_stride = packed.stride(0);
  p.scales = scales.data_ptr<uint8_t>();
  p.scales_stride = scales.stride(0);
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_stride = out_stride;
  p.out_scales = out_scales.data_ptr<float>();
  p.group_offsets = reinterpret_cast<long long*>(group_offsets.data_ptr<int64_t>());
  p.workspace = reinterpret_cast<long long*>(workspace.data_ptr<int64_t>());
  p.group_rows = p.workspace + p.segments.num + 1;
  p.col_records = two_pass ? reinterpret_cast<uint8_t*>(p.workspace + head) : nullptr;
  p.row_groups = two_pass ? reinterpret_cast<int*>(p.workspace + head + record_words) : nullptr;
  p.rows = n;
  p.hidden = checked_hidden(h, "packed");
  p.num_groups = num_groups;
  p.full_groups = full_groups;
  p.box_store = box_store.has_value() ? *box_store : column_box_store_default();
  Tensor splits_host;
  if (host_splits.has_value()) {
    splits_host = checked_host_splits(*host_splits);
    p.host_splits = reinterpret_cast<const long long*>(splits_host.data_ptr<int64_t>());
    p.num_host_splits = static_cast<int>(splits_host.size(1));
  }
  check_launch(moe_fp4::launch_mxfp4_rows_to_fp8_cols(p, c10::cuda::getCurrentCUDAStream()), "mxfp4_rows_to_fp8_cols");
  return {out, out_scales, group_offsets};
}

// x [T, H] float, H % 128 == 0 -> (e4m3 [T, H], float32 [T, H/128]).
std::tuple<Tensor, Tensor> quantize_fp8_blockwise(const Tensor& x) {
  check_float_rows(x, 128);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0), h = x.size(1);
  Tensor out = at::empty({t, h}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({t, h / 128}, x.options().dtype(at::kFloat));
  moe_fp4::QuantizeFp8BlockwiseParams p{};
  p.x = x.data_ptr();
  p.x_type = float_input(x);
  p.x_stride = x.stride(0);
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.tokens = t;
  p.hidden = checked_hidden(h, "x");
  check_launch(moe_fp4::launch_quantize_fp8_blockwise(p, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_blockwise");
  return {out, out_scales};
}

// The two-axis quantizer's shared checks and parameters (x float32/bfloat16 [M, K], K % 128 == 0).
moe_fp4::QuantizeFp8TwoAxisParams two_axis_params(const Tensor& x, const char* name, bool tiles) {
  check_float_rows(x, 128);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": expected dtype float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) <= int64_t(65535) * 128, name, ": at most ", int64_t(65535) * 128, " rows, got ", x.size(0));
  TORCH_CHECK(!tiles || x.size(0) % 128 == 0, name, ": first dimension (", x.size(0), ") must be a multiple of 128");
  moe_fp4::QuantizeFp8TwoAxisParams p{};
  p.x = x.data_ptr();
  p.x_type = float_input(x);
  p.x_stride = x.stride(0);
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.tiles = tiles;
  p.ld_t = (x.size(0) + 127) / 128 * 128;
  return p;
}

// x [M, K] float32/bfloat16, K % 128 == 0 -> (e4m3 [M, K], float32 [M, K/128], e4m3 [K, Mp], float32 [K, Mp/128])
// with Mp = M rounded up to 128: the 1x128 quantization of x and of x^T zero-padded to Mp columns.
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8_rows_cols(const Tensor& x) {
  moe_fp4::QuantizeFp8TwoAxisParams p = two_axis_params(x, "x", false);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0), k = x.size(1);
  Tensor out = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({m, k / 128}, x.options().dtype(at::kFloat));
  Tensor out_t = at::empty({k, p.ld_t}, x.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_t_scales = at::empty({k, p.ld_t / 128}, x.options().dtype(at::kFloat));
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.out_t = reinterpret_cast<uint8_t*>(out_t.data_ptr());
  p.out_t_scales = out_t_scales.data_ptr<float>();
  check_launch(moe_fp4::launch_quantize_fp8_2d(p, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_rows_cols");
  return {out, out_scales, out_t, out_t_scales};
}

// w [N, K] float32/bfloat16, N and K multiples of 128 -> (e4m3 [N, K], float32 [N/128, K/128], e4m3 [K, N]):
// the 128x128 quantization of w and its transpose ([0, N] when transpose is false). group_rows > 0: w
// stacks N / group_rows matrices of group_rows rows, and the transpose is each one's, [N / group_rows * K,
// group_rows] (matrix g's transpose in rows [g K, (g + 1) K)).
std::tuple<Tensor, Tensor, Tensor> quantize_fp8_tiles(const Tensor& w, bool transpose, int64_t group_rows) {
  moe_fp4::QuantizeFp8TwoAxisParams p = two_axis_params(w, "w", true);
  const c10::cuda::CUDAGuard guard(w.device());
  const int64_t n = w.size(0), k = w.size(1);
  // (protects memory: a group that does not divide the rows would store past the transpose)
  TORCH_CHECK(group_rows == 0 || (group_rows > 0 && group_rows % 128 == 0 && n % group_rows == 0),
              "group_rows: expected 0 or a multiple of 128 dividing w's rows (", n, "), got ", group_rows);
  p.t_group_rows = group_rows;
  const int64_t t_rows = !transpose ? 0 : group_rows > 0 ? n / group_rows * k : k;
  Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({n / 128, k / 128}, w.options().dtype(at::kFloat));
  Tensor out_t = at::empty({t_rows, group_rows > 0 ? group_rows : n}, w.options().dtype(at::kFloat8_e4m3fn));
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.out_t = transpose ? reinterpret_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  check_launch(moe_fp4::launch_quantize_fp8_2d(p, c10::cuda::getCurrentCUDAStream()), "quantize_fp8_tiles");
  return {out, out_scales, out_t};
}

// packed uint8 [N, H/2], scales uint8 [N, H/32] -> bfloat16 [N, H].
Tensor dequantize_mxfp4(const Tensor& packed, const Tensor& scales) {
  check_packed_scales(packed, scales);
  check_word_rows(packed.data_ptr(), packed.stride(0), packed.size(0), "packed");
  const c10::cuda::CUDAGuard guard(packed.device());
  const int64_t n = packed.size(0), h = packed.size(1) * 2;
  Tensor out = at::empty({n, h}, packed.options().dtype(at::kBFloat16));
  moe_fp4::DequantizeMxfp4Params p{};
  p.packed = packed.data_ptr<uint8_t>();
  p.packed_stride = packed.stride(0);
  p.scales = scales.data_ptr<uint8_t>();
  p.scales_stride = scales.stride(0);
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.rows = n;
  p.hidden = checked_hidden(h, "packed");
  check_launch(moe_fp4::launch_dequantize_mxfp4(p, c10::cuda::getCurrentCUDAStream()), "dequantize_mxfp4");
  return out;
}

// MXFP4 byte rows uint8 [n, H/2 + H/32], slots int64 [n, k] (output row of each (row, slot), -1: none)
// -> out e4m3 [R, H], out_scales float32 [R, H/128] (written in place): row t converted once
// (mxfp4_to_fp8_blockwise) and written to each of its slots' rows; slots outside [0, R) are skipped and the other
// output rows are left untouched (so several calls may fill one output, e.g. one per source block).
// copy_to (optional): uint8 [m, H/2 + H/32] with 4-byte aligned rows, receives each byte row that names
// an output row, as it is: row t at row t (m = n) or, with copy_rows (int64 [n]), at row copy_rows[t]
// (outside [0, m): not copied; rows named twice get either copy).
void mxfp4_rows_expand_fp8_blockwise_into(const Tensor& rows, int64_t hidden, const Tensor& slots, const Tensor& out,
                                const Tensor& out_scales, const c10::optional<Tensor>& copy_to,
                                const c10::optional<Tensor>& copy_rows) {
  check_mxfp4_byte_rows(rows, hidden);
  check_word_rows(rows.data_ptr(), rows.stride(0), rows.size(0), "rows");
  check_slot_table(slots, rows, rows.size(0), "slots");
  check_fp8_rows_output(out, out_scales, rows, hidden, "out", "out_scales");
  if (copy_to.has_value()) {
    const Tensor& c = *copy_to;
    MOE_FP4_CHECK_SAME_DEVICE(c, rows, "copy_to");
    MOE_FP4_CHECK_DTYPE(c, at::kByte, "copy_to");
    TORCH_CHECK(c.dim() == 2 && (copy_rows.has_value() || c.size(0) == rows.size(0)) && c.size(1) == rows.size(1) &&
                    (c.size(0) == 0 || c.stride(1) == 1),
                "copy_to: expected a [", copy_rows.has_value() ? "m" : std::to_string(rows.size(0)), ", ", rows.size(1),
                "] tensor with contiguous rows, got ", c.sizes(), " strides ", c.strides());
    if (copy_rows.has_value()) {
      const Tensor& cr = *copy_rows;
      MOE_FP4_CHECK_SAME_DEVICE(cr, rows, "copy_rows");
      MOE_FP4_CHECK_DTYPE(cr, at::kLong, "copy_rows");
      TORCH_CHECK(cr.dim() == 1 && cr.size(0) == rows.size(0) && cr.is_contiguous(),
                  "copy_rows: expected a contiguous [", rows.size(0), "] tensor, got ", cr.sizes());
    }
    check_word_rows(c.data_ptr(), c.stride(0), c.size(0), "copy_to");
  }
  const int64_t num_rows = out.size(0);
  if (rows.size(0) == 0 || (num_rows == 0 && !copy_to.has_value())) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  moe_fp4::Mxfp4RowsExpandFp8BlockwiseParams p{};
  if (copy_to.has_value()) {
    p.copy_to = copy_to->data_ptr<uint8_t>();
    p.copy_stride = copy_to->stride(0);
    p.copy_count = copy_to->size(0);
    if (copy_rows.has_value()) p.copy_rows = reinterpret_cast<const long long*>(copy_rows->data_ptr<int64_t>());
  }
  p.rows = rows.data_ptr<uint8_t>();
  p.row_stride = rows.stride(0);
  p.slots = reinterpret_cast<const long long*>(slots.data_ptr<int64_t>());
  p.k = static_cast<int>(slots.size(1));
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.tokens = rows.size(0);
  p.num_rows = num_rows;
  p.hidden = checked_hidden(hidden, "hidden");
  check_launch(moe_fp4::launch_mxfp4_rows_expand_fp8_blockwise(p, c10::cuda::getCurrentCUDAStream()), "mxfp4_rows_expand_fp8_blockwise");
}

// The same into new outputs of num_rows rows (rows named by no slot are left unwritten; the caller names
// each once).
std::tuple<Tensor, Tensor> mxfp4_rows_expand_fp8_blockwise(const Tensor& rows, int64_t hidden, const Tensor& slots,
                                                 int64_t num_rows) {
  TORCH_CHECK(num_rows >= 0, "num_rows: expected a non-negative count, got ", num_rows);
  check_mxfp4_byte_rows(rows, hidden);
  Tensor out = at::empty({num_rows, hidden}, rows.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({num_rows, hidden / 128}, rows.options().dtype(at::kFloat));
  mxfp4_rows_expand_fp8_blockwise_into(rows, hidden, slots, out, out_scales, c10::nullopt, c10::nullopt);
  return {out, out_scales};
}

// x [T, H] float -> NVFP4 byte rows uint8 [T, H/2 + H/16 + 4] (packed E2M1 | E4M3 block scales | the
// FP32 tensor scale of the whole x): formats.pack_nvfp4_rows(*formats.quantize_nvfp4(x)).
Tensor quantize_nvfp4_rows(const Tensor& x) {
  check_float_rows(x, 16);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0), h = x.size(1);
  Tensor out = at::empty({t, h / 2 + h / 16 + 4}, x.options().dtype(at::kByte));
  if (t == 0) return out;
  Tensor amax = at::empty({1}, x.options().dtype(at::kInt));
  moe_fp4::QuantizeNvfp4RowsParams p{};
  p.x = x.data_ptr();
  p.x_type = float_input(x);
  p.x_stride = x.stride(0);
  p.out = out.data_ptr<uint8_t>();
  p.out_stride = out.stride(0);
  p.amax_bits = reinterpret_cast<unsigned int*>(amax.data_ptr<int>());
  p.tokens = t;
  p.hidden = checked_hidden(h, "x");
  check_launch(moe_fp4::launch_quantize_nvfp4_rows(p, c10::cuda::getCurrentCUDAStream()), "quantize_nvfp4_rows");
  return out;
}

// NVFP4 byte rows uint8 [n, H/2 + H/16 + 4] (4-byte aligned rows), H % 128 == 0 -> (e4m3 [n, H], float32
// [n, H/128]): formats.quantize_fp8_blockwise(formats.dequantize_nvfp4_rows(...)), in one pass.
std::tuple<Tensor, Tensor> nvfp4_rows_to_fp8_blockwise(const Tensor& rows, int64_t hidden) {
  MOE_FP4_CHECK_CUDA(rows, "rows");
  MOE_FP4_CHECK_DTYPE(rows, at::kByte, "rows");
  MOE_FP4_CHECK_DIM(rows, 2, "rows");
  TORCH_CHECK(hidden > 0 && hidden % 128 == 0, "hidden: expected a positive multiple of 128, got ", hidden);
  TORCH_CHECK(rows.size(1) == hidden / 2 + hidden / 16 + 4, "rows: expected ", hidden / 2 + hidden / 16 + 4,
              " bytes per row for hidden ", hidden, ", got ", rows.size(1));
  TORCH_CHECK(rows.size(0) == 0 || rows.stride(1) == 1, "rows: expected a contiguous last dimension");
  check_word_rows(rows.data_ptr(), rows.stride(0), rows.size(0), "rows");
  const c10::cuda::CUDAGuard guard(rows.device());
  Tensor out = at::empty({rows.size(0), hidden}, rows.options().dtype(at::kFloat8_e4m3fn));
  Tensor out_scales = at::empty({rows.size(0), hidden / 128}, rows.options().dtype(at::kFloat));
  if (rows.size(0) == 0) return {out, out_scales};
  moe_fp4::Nvfp4RowsToFp8BlockwiseParams p{};
  p.rows = rows.data_ptr<uint8_t>();
  p.row_stride = rows.stride(0);
  p.out = reinterpret_cast<uint8_t*>(out.data_ptr());
  p.out_scales = out_scales.data_ptr<float>();
  p.tokens = rows.size(0);
  p.hidden = checked_hidden(hidden, "hidden");
  check_launch(moe_fp4::launch_nvfp4_rows_to_fp8_blockwise(p, c10::cuda::getCurrentCUDAStream()), "nvfp4_rows_to_fp8_blockwise");
  return {out, out_scales};
}

// The dispatch's send layout: topk_idx [T, k] -> (count rows int64 [W, info_width], rank_table int64
// [T, W], send_token int64 [T * W], meta int32 [T * W, 2k + 1]); see moe_fp4.ops.routing.
std::tuple<Tensor, Tensor, Tensor, Tensor> send_layout(const Tensor& topk_idx, const std::optional<Tensor>& topk_weights,
                                                       int64_t num_experts, int64_t world_size,
                                                       const std::vector<int64_t>& header, int64_t info_width,
                                                       int64_t block_rows) {
  MOE_FP4_CHECK_CUDA(topk_idx, "topk_idx");
  MOE_FP4_CHECK_DIM(topk_idx, 2, "topk_idx");
  TORCH_CHECK(topk_idx.is_contiguous(), "topk_idx: expected a contiguous tensor");
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
              "topk_idx: expected dtype int64 or int32, got ", topk_idx.scalar_type());
  TORCH_CHECK(world_size >= 1 && world_size <= moe_fp4::kMaxLayoutRanks, "world_size: expected 1..",
              moe_fp4::kMaxLayoutRanks, ", got ", world_size);
  TORCH_CHECK(num_experts >= world_size && num_experts % world_size == 0 && num_experts <= INT_MAX,
              "num_experts: expected a positive multiple of world_size, got ", num_experts);
  TORCH_CHECK(header.size() <= moe_fp4::kLayoutHeader, "header: at most ", moe_fp4::kLayoutHeader, " values");
  const int64_t t = topk_idx.size(0), k = topk_idx.size(1);
  TORCH_CHECK(k >= 1 && t < INT_MAX, "topk_idx: expected shape [T, k] with k >= 1 and T < 2^31, got ", topk_idx.sizes());
  TORCH_CHECK(info_width >= moe_fp4::kInfoRanks + world_size + num_experts / world_size + k && info_width <= INT_MAX,
              "info_width: too small for ", world_size, " ranks, ", num_experts, " experts and k=", k);
  TORCH_CHECK(block_rows >= 0, "block_rows: expected a non-negative int, got ", block_rows);
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  moe_fp4::SendLayoutParams p{};
  if (topk_weights.has_value()) {
    const Tensor& w = *topk_weights;
    MOE_FP4_CHECK_SAME_DEVICE(w, topk_idx, "topk_weights");
    TORCH_CHECK(w.sizes() == topk_idx.sizes() && w.is_contiguous(), "topk_weights: expected a contiguous tensor of shape ",
                topk_idx.sizes(), ", got ", w.sizes());
    p.weights_type = float_input(w);
    p.topk_weights = w.data_ptr();
  }
  const auto opts = topk_idx.options();
  Tensor info = at::empty({world_size, info_width}, opts.dtype(at::kLong));
  Tensor rank_table = at::empty({t, world_size}, opts.dtype(at::kLong));
  const int64_t send_rows = block_rows > 0 ? block_rows * world_size : t * world_size;
  Tensor send_token = at::empty({send_rows}, opts.dtype(at::kLong));
  Tensor meta = at::empty({send_rows, 2 * k + 1}, opts.dtype(at::kInt));
  Tensor scratch = at::empty({moe_fp4::send_layout_scratch_ints(t, k, num_experts, world_size)}, opts.dtype(at::kInt));
  p.topk_idx = topk_idx.data_ptr();
  p.idx_is64 = topk_idx.scalar_type() == at::kLong;
  p.tokens = t;
  p.topk = static_cast<int>(k);
  p.num_experts = static_cast<int>(num_experts);
  p.world_size = static_cast<int>(world_size);
  for (size_t i = 0; i < header.size(); ++i) p.header[i] = header[i];
  p.info = reinterpret_cast<long long*>(info.data_ptr<int64_t>());
  p.info_width = static_cast<int>(info_width);
  p.rank_table = reinterpret_cast<long long*>(rank_table.data_ptr<int64_t>());
  p.send_token = reinterpret_cast<long long*>(send_token.data_ptr<int64_t>());
  p.block_rows = block_rows;
  p.meta = meta.data_ptr<int>();
  p.scratch = scratch.data_ptr<int>();
  check_launch(moe_fp4::launch_send_layout(p, c10::cuda::getCurrentCUDAStream()), "send_layout");
  return {info, rank_table, send_token, meta};
}

// The dispatch's expand layout: received meta int32 [n, 2k + 1] -> (slot_table [n, k], expand_row [R],
// expand_slot [R], row_weights [R] or None, split_lens [L], split_offsets [L], gap_rows [num_gap] or
// None, recv_topk_idx [n, k], recv_topk_weights [n, k] or None, recv_src_token [n]); see moe_fp4.ops.routing.
std::tuple<Tensor, Tensor, Tensor, std::optional<Tensor>, Tensor, Tensor, std::optional<Tensor>, Tensor,
           std::optional<Tensor>, Tensor, Tensor>
expand_layout(const Tensor& meta, int64_t topk, int64_t num_local, int64_t alignment, int64_t num_rows, int64_t num_gap,
              bool weights) {
  MOE_FP4_CHECK_CUDA(meta, "meta");
  MOE_FP4_CHECK_DTYPE(meta, at::kInt, "meta");
  MOE_FP4_CHECK_DIM(meta, 2, "meta");
  TORCH_CHECK(meta.is_contiguous() && topk >= 1 && meta.size(1) == 2 * topk + 1,
              "meta: expected a contiguous int32 tensor [n, 2k + 1] with k = ", topk, ", got ", meta.sizes());
  TORCH_CHECK(num_local >= 1 && num_local <= moe_fp4::kMaxLayoutExperts, "num_local: expected 1..",
              moe_fp4::kMaxLayoutExperts, ", got ", num_local);
  TORCH_CHECK(alignment >= 1 && alignment <= INT_MAX, "alignment: expected a positive int, got ", alignment);
  TORCH_CHECK(num_rows >= 0 && num_gap >= 0, "num_rows, num_gap: expected non-negative ints");
  const int64_t n = meta.size(0);
  TORCH_CHECK(n * topk <= moe_fp4::kMaxExpandEntries, "meta: ", n, " rows of ", topk,
              " slots exceed the expand layout's 32-bit entry indices");
  const c10::cuda::CUDAGuard guard(meta.device());
  const auto opts = meta.options();
  const auto i64 = opts.dtype(at::kLong), f32 = opts.dtype(at::kFloat);
  Tensor slot_table = at::empty({n, topk}, i64);
  Tensor expand_row = at::empty({num_rows}, i64);
  Tensor expand_slot = at::empty({num_rows}, i64);
  std::optional<Tensor> row_weights, gap_rows, recv_w;
  if (weights) {
    row_weights = at::empty({num_rows}, f32);
    recv_w = at::empty({n, topk}, f32);
  }
  if (num_gap > 0) gap_rows = at::empty({num_gap}, i64);
  Tensor split_lens = at::empty({num_local}, i64);
  Tensor split_offsets = at::empty({num_local}, i64);
  Tensor recv_idx = at::empty({n, topk}, i64);
  Tensor recv_src = at::empty({n}, i64);
  Tensor rows_needed = at::empty({1}, i64);
  Tensor scratch = at::empty({moe_fp4::expand_layout_scratch_ints(n, static_cast<int>(topk), static_cast<int>(num_local))},
                             opts);
  moe_fp4::ExpandLayoutParams p{};
  p.meta = meta.data_ptr<int>();
  p.tokens = n;
  p.topk = static_cast<int>(topk);
  p.num_local = static_cast<int>(num_local);
  p.alignment = static_cast<int>(alignment);
  p.num_rows = num_rows;
  p.slot_table = reinterpret_cast<long long*>(slot_table.data_ptr<int64_t>());
  p.expand_row = reinterpret_cast<long long*>(expand_row.data_ptr<int64_t>());
  p.expand_slot = reinterpret_cast<long long*>(expand_slot.data_ptr<int64_t>());
  p.row_weights = weights ? row_weights->data_ptr<float>() : nullptr;
  p.split_lens = reinterpret_cast<long long*>(split_lens.data_ptr<int64_t>());
  p.split_offsets = reinterpret_cast<long long*>(split_offsets.data_ptr<int64_t>());
  p.gap_rows = num_gap > 0 ? reinterpret_cast<long long*>(gap_rows->data_ptr<int64_t>()) : nullptr;
  p.num_gap = num_gap;
  p.recv_topk_idx = reinterpret_cast<long long*>(recv_idx.data_ptr<int64_t>());
  p.recv_topk_weights = weights ? recv_w->data_ptr<float>() : nullptr;
  p.recv_src_token = reinterpret_cast<long long*>(recv_src.data_ptr<int64_t>());
  p.rows_needed = reinterpret_cast<long long*>(rows_needed.data_ptr<int64_t>());
  p.scratch = scratch.data_ptr<int>();
  check_launch(moe_fp4::launch_expand_layout(p, c10::cuda::getCurrentCUDAStream()), "expand_layout");
  return {slot_table, expand_row, expand_slot, row_weights, split_lens, split_offsets, gap_rows, recv_idx, recv_w, recv_src,
          rows_needed};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe_fp4 native conversion kernels (sm_90a); use them through moe_fp4.ops";
  m.def("quantize_mxfp4", &quantize_mxfp4, "x [T,H] float -> (packed u8 [T,H/2], scales u8 [T,H/32])",
        py::arg("x"), py::arg("round_up"));
  m.def("quantize_mxfp4_rows_into", &quantize_mxfp4_rows_into,
        "x [T,H] float -> byte rows written into out u8 [R,H/2+H/32] at row_index", py::arg("x"),
        py::arg("round_up"), py::arg("out"), py::arg("row_index"));
  m.def("quantize_mxfp4_rows_multi", &quantize_mxfp4_rows_multi,
        "x [T,H] bfloat16 -> MXFP4 byte rows written to dests[d] at dest_rows[t, d]", py::arg("x"),
        py::arg("round_up"), py::arg("dests"), py::arg("dest_rows"), py::arg("max_blocks") = 0,
        py::arg("fp8_dest") = -1, py::arg("fp8_slots") = py::none(), py::arg("fp8_out") = py::none(),
        py::arg("fp8_scales") = py::none());
  m.def("quantize_fp8_blockwise_rows_multi", &quantize_fp8_blockwise_rows_multi,
        "x [T,H] bfloat16 -> FP8 1x128 byte rows written to dests[d] at dest_rows[t, d]", py::arg("x"),
        py::arg("dests"), py::arg("dest_rows"), py::arg("max_blocks") = 0);
  m.def("scatter_rows", &scatter_rows, "byte rows src [T,B] copied to dests[d] at dest_rows[t, d]", py::arg("src"),
        py::arg("dests"), py::arg("dest_rows"), py::arg("max_blocks") = 0);
  m.def("mxfp4_to_fp8_blockwise", &mxfp4_to_fp8_blockwise, "MXFP4 -> FP8 1x128 rows", py::arg("packed"),
        py::arg("scales"), py::arg("split_lens"), py::arg("split_offsets"));
  m.def("mxfp4_rows_to_fp8_blockwise", &mxfp4_rows_to_fp8_blockwise, "MXFP4 byte rows -> FP8 1x128 rows",
        py::arg("rows"), py::arg("hidden"), py::arg("split_lens"), py::arg("split_offsets"));
  m.def("mxfp4_rows_to_fp8_cols", &mxfp4_rows_to_fp8_cols, "MXFP4 rows -> FP8 columns per expert", py::arg("packed"),
        py::arg("scales"), py::arg("split_lens"), py::arg("split_offsets"), py::arg("num_groups"),
        py::arg("two_pass"), py::arg("full_groups") = false, py::arg("host_splits") = py::none(),
        py::arg("box_store") = py::none());
  m.def("column_group_table", &column_group_table,
        "The scale groups (first row, row count) that the column op's launcher derives from host splits",
        py::arg("host_splits"));
  m.def("quantize_fp8_blockwise", &quantize_fp8_blockwise, "float [T,H] -> FP8 1x128", py::arg("x"));
  m.def("quantize_fp8_rows_cols", &quantize_fp8_rows_cols, "float [M,K] -> FP8 1x128 of x and of x^T (padded)",
        py::arg("x"));
  m.def("quantize_fp8_tiles", &quantize_fp8_tiles, "float [N,K] -> FP8 128x128 (+ its transpose)", py::arg("w"),
        py::arg("transpose"), py::arg("group_rows"));
  m.def("dequantize_mxfp4", &dequantize_mxfp4, "MXFP4 -> bfloat16 [N,H]", py::arg("packed"),
        py::arg("scales"));
  m.def("mxfp4_rows_expand_fp8_blockwise", &mxfp4_rows_expand_fp8_blockwise,
        "MXFP4 byte rows -> FP8 1x128 rows, each written to its slots' rows", py::arg("rows"), py::arg("hidden"),
        py::arg("slots"), py::arg("num_rows"));
  m.def("mxfp4_rows_expand_fp8_blockwise_into", &mxfp4_rows_expand_fp8_blockwise_into,
        "MXFP4 byte rows -> FP8 1x128 rows written in place to their slots' rows of out", py::arg("rows"),
        py::arg("hidden"), py::arg("slots"), py::arg("out"), py::arg("out_scales"), py::arg("copy_to") = py::none(),
        py::arg("copy_rows") = py::none());
  m.def("nvfp4_rows_to_fp8_blockwise", &nvfp4_rows_to_fp8_blockwise, "NVFP4 byte rows -> FP8 1x128 rows", py::arg("rows"),
        py::arg("hidden"));
  m.def("quantize_nvfp4_rows", &quantize_nvfp4_rows,
        "x [T,H] float -> NVFP4 byte rows u8 [T,H/2+H/16+4] (tensor scale of the whole x)", py::arg("x"));
  m.def("send_layout", &send_layout, "the dispatch's send order, count rows and metadata from topk_idx [T,k]",
        py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_experts"), py::arg("world_size"), py::arg("header"),
        py::arg("info_width"), py::arg("block_rows") = 0);
  m.def("expand_layout", &expand_layout, "the dispatch's expert-order tables from the received metadata rows",
        py::arg("meta"), py::arg("topk"), py::arg("num_local"), py::arg("alignment"), py::arg("num_rows"),
        py::arg("num_gap"), py::arg("weights"));
}
