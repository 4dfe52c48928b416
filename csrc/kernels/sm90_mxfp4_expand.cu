// FP4RowToFP8Row fused with the expansion to expert rows (the receive side of the dispatch): each
// received MXFP4 byte row [H/2 packed | H/32 UE8M0] is converted once to FP8 1x128 (the direct remap
// of formats.mxfp4_to_fp8_blockwise) and written to each of its output rows, one per local expert of
// the token. One warp per received row: lanes j < k read the row's slots, then each pass converts 8
// items per lane (an item is half an MX block: 8 packed bytes in, 16 E4M3 bytes out) and stores them
// to every slot's row, 512 contiguous bytes per warp store.
#include "sm90_common.cuh"
#include "sm90_launchers.h"

#include <type_traits>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;  // items in flight per lane

struct ExpandRemap {
  uint32_t word[kRemapRows][2];  // byte c of (word[d][0], word[d][1]): E4M3 magnitude of E2M1 code c at shift d
};

constexpr ExpandRemap make_expand_remap() {
  ExpandRemap t{};
  for (int d = 0; d < kRemapRows; ++d) {
    const int shift = d < kRemapRows - 1 ? d : 64;  // the last row: every shift from there on (all zero)
    t.word[d][0] = remap_word(shift, 0);
    t.word[d][1] = remap_word(shift, 1);
  }
  return t;
}

__constant__ ExpandRemap kExpandRemap = make_expand_remap();

// 16 E2M1 codes (8 packed bytes) of block scale byte e in a group whose largest byte is emax -> 16 E4M3
// bytes: sign | remap[min(emax - e, 19)][magnitude]; a NaN group (emax 0xFF) gives zeros.
__device__ __forceinline__ uint4 convert_item(uint2 raw, uint32_t e, uint32_t emax, const ExpandRemap& remap) {
  uint4 o = make_uint4(0, 0, 0, 0);
  if (emax == kUe8m0Nan) return o;
  const uint32_t d = min(emax - e, static_cast<uint32_t>(kRemapRows - 1));
  remap8(raw.x, remap.word[d][0], remap.word[d][1], o.x, o.y);
  remap8(raw.y, remap.word[d][0], remap.word[d][1], o.z, o.w);
  return o;
}

template <bool kVec8>
__global__ void __launch_bounds__(kThreads) sm90_mxfp4_expand_fp8_rows_kernel(const Mxfp4ExpandFp8RowsParams p) {
  __shared__ ExpandRemap remap;
  for (int i = threadIdx.x; i < kRemapRows; i += kThreads) {
    remap.word[i][0] = kExpandRemap.word[i][0];
    remap.word[i][1] = kExpandRemap.word[i][1];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.tokens) return;
  long long slot = -1;
  if (lane < p.k) slot = p.slots[t * p.k + lane];
  const bool valid = slot >= 0 && slot < p.num_rows;
  const uint32_t targets = __ballot_sync(0xFFFFFFFFu, valid);  // lanes whose slot names an output row
  if (targets == 0u) return;
  const uint8_t* prow = p.rows + t * p.row_stride;
  const uint8_t* scrow = prow + p.hidden / 2;
  const int items = p.hidden / 16;
  const int groups = p.hidden / kFp8Group;
  // kFull: every item of the pass lies in the row (no bounds checks).
  auto pass = [&](int base, auto full) {
    constexpr bool kFull = decltype(full)::value;
    uint4 o[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) o[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int item = base + u * 32 + lane;
      if (kFull || item < items) {
        uint2 raw;
        if constexpr (kVec8) {
          raw = __ldcs(reinterpret_cast<const uint2*>(prow + item * 8));
        } else {
          const uint32_t* q = reinterpret_cast<const uint32_t*>(prow + item * 8);
          raw = make_uint2(__ldcs(q), __ldcs(q + 1));
        }
        const uint32_t s4 = __ldg(reinterpret_cast<const uint32_t*>(scrow + (item >> 3) * 4));
        o[u] = convert_item(raw, (s4 >> (8 * ((item >> 1) & 3))) & 0xFFu, group_emax(s4), remap);
      }
    }
    for (uint32_t m = targets; m != 0u; m &= m - 1u) {
      const long long r = __shfl_sync(0xFFFFFFFFu, slot, __ffs(m) - 1);
      uint4* orow = reinterpret_cast<uint4*>(p.out + r * p.hidden);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (kFull || item < items) orow[item] = o[u];
      }
    }
  };
  int base = 0;
  for (; base + 32 * kUnroll <= items; base += 32 * kUnroll) pass(base, std::true_type{});
  if (base < items) pass(base, std::false_type{});
  // Group scales 2^(emax - 127 - 6) (NaN for a NaN group), one per lane, to every slot's row.
  for (int g0 = 0; g0 < groups; g0 += 32) {
    const int g = g0 + lane;
    float s = 0.0f;
    if (g < groups) {
      s = group_scale(group_emax(__ldg(reinterpret_cast<const uint32_t*>(scrow) + g)));
    }
    for (uint32_t m = targets; m != 0u; m &= m - 1u) {
      const long long r = __shfl_sync(0xFFFFFFFFu, slot, __ffs(m) - 1);
      if (g < groups) p.out_scales[r * groups + g] = s;
    }
  }
}

}  // namespace

cudaError_t launch_mxfp4_expand_fp8_rows(const Mxfp4ExpandFp8RowsParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((p.tokens + kWarps - 1) / kWarps);
  const bool vec8 = (p.row_stride % 8 == 0) && (reinterpret_cast<uintptr_t>(p.rows) % 8 == 0);
  if (vec8) {
    sm90_mxfp4_expand_fp8_rows_kernel<true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    sm90_mxfp4_expand_fp8_rows_kernel<false><<<blocks, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe_fp4
