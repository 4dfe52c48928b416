// mxfp4_rows_expand_fp8_blockwise: mxfp4_to_fp8_blockwise fused with the expansion to expert rows (the
// receive side of the dispatch): each received MXFP4 byte row [H/2 packed | H/32 UE8M0] is converted
// once to FP8 1x128 (the direct remap of formats.mxfp4_to_fp8_blockwise) and written to each of its
// output rows, one per local expert of the token. One warp per received row: lanes j < k read the
// row's slots, then each pass converts 8 items per lane (an item is half an MX block: 8 packed bytes
// in, 16 E4M3 bytes out) and stores them to every slot's row, 512 contiguous bytes per warp store.
#include "sm90_common.cuh"
#include "sm90_launchers.h"
#include "sm90_mxfp4_expand.cuh"

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <bool kVec8>
__global__ void __launch_bounds__(kThreads) sm90_mxfp4_rows_expand_fp8_blockwise_kernel(const Mxfp4RowsExpandFp8BlockwiseParams p) {
  __shared__ ExpandRemap remap;
  load_expand_remap(remap);
  const int lane = threadIdx.x & 31;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.tokens) return;
  const uint8_t* prow = p.rows + t * p.row_stride;
  long long slot = -1;
  if (lane < p.k) slot = p.slots[t * p.k + lane];
  const bool valid = slot >= 0 && slot < p.num_rows;
  const uint32_t targets = __ballot_sync(0xFFFFFFFFu, valid);  // lanes whose slot names an output row
  if (targets == 0u) return;  // (nor copied: a caller converting a dispatch in slices masks the others)
  uint8_t* copy = nullptr;
  if (p.copy_to != nullptr) {
    const long long c = p.copy_rows != nullptr ? p.copy_rows[t] : t;
    if (c >= 0 && c < p.copy_count) copy = p.copy_to + c * p.copy_stride;
  }
  expand_row_to_slots<false, kVec8>(prow, prow + p.hidden / 2, p.hidden, targets, slot, p.out, p.out_scales, remap,
                                    lane, copy);
}

}  // namespace

cudaError_t launch_mxfp4_rows_expand_fp8_blockwise(const Mxfp4RowsExpandFp8BlockwiseParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((p.tokens + kWarps - 1) / kWarps);
  const bool vec8 = (p.row_stride % 8 == 0) && (reinterpret_cast<uintptr_t>(p.rows) % 8 == 0);
  if (vec8) {
    sm90_mxfp4_rows_expand_fp8_blockwise_kernel<true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    sm90_mxfp4_rows_expand_fp8_blockwise_kernel<false><<<blocks, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe_fp4
