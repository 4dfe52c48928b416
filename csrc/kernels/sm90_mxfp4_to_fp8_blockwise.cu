// mxfp4_to_fp8_blockwise: direct MXFP4 -> FP8 1x128 rows (formats.mxfp4_to_fp8_blockwise). One warp
// per row, half an MX block (8 packed bytes in, one 16-byte store out) per lane and item; the E4M3 byte
// of each E2M1 code comes from a byte permute over a small remap table indexed by the block's shift
// below the group's largest scale (no float arithmetic).
#include "sm90_common.cuh"
#include "sm90_launchers.h"

#include <type_traits>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kRowUnroll = 8;  // items (8-byte loads) in flight per lane

struct RemapTable {
  uint32_t word[kRemapRows][2];  // bytes: E4M3 magnitude of E2M1 magnitude code c at shift d
  uint32_t zero[kRemapRows];     // bit c: nonzero code c becomes zero at shift d (an underflow)
};

constexpr RemapTable make_remap_table() {
  RemapTable t{};
  for (int d = 0; d < kRemapRows; ++d) {
    const int shift = d < kRemapRows - 1 ? d : 64;
    t.word[d][0] = remap_word(shift, 0);
    t.word[d][1] = remap_word(shift, 1);
    uint32_t z = 0;
    for (int c = 1; c < 8; ++c) z |= (e4m3_of_shifted_e2m1(c, shift) == 0u ? 1u : 0u) << c;
    t.zero[d] = z;
  }
  return t;
}

__constant__ RemapTable kRemap = make_remap_table();

// 8 packed bytes (16 E2M1 codes) of a row.
template <bool kVec8>
__device__ __forceinline__ uint2 load_packed8(const uint8_t* p) {
  if constexpr (kVec8) {
    return __ldcs(reinterpret_cast<const uint2*>(p));
  } else {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
    return make_uint2(__ldcs(q), __ldcs(q + 1));
  }
}

__device__ __forceinline__ uint32_t count_underflow(uint32_t w, uint32_t zero_mask) {
  uint32_t n = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) n += (zero_mask >> ((w >> (4 * i)) & 7u)) & 1u;
  return n;
}

template <bool kVec8>
__global__ void __launch_bounds__(kThreads) sm90_mxfp4_to_fp8_blockwise_kernel(const Mxfp4ToFp8BlockwiseParams p) {
  __shared__ RemapTable remap;
  for (int i = threadIdx.x; i < kRemapRows; i += kThreads) {
    remap.word[i][0] = kRemap.word[i][0];
    remap.word[i][1] = kRemap.word[i][1];
    remap.zero[i] = kRemap.zero[i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  // An item is half an MX block: 8 packed bytes in, 16 E4M3 bytes out (one 16-byte store per lane,
  // contiguous over the warp); 8 items per FP8 group.
  const int items = p.hidden / 16;
  const int groups = p.hidden / kFp8Group;
  const Segments& seg = p.segments;
  const long long covered =
      (seg.lens != nullptr && seg.offsets == nullptr) ? warp_sum_lengths(seg.lens, seg.is64, seg.num) : p.rows;
  unsigned long long underflow = 0;
  for (long long row = warp; row < p.rows; row += num_warps) {
    uint8_t* orow = p.out + row * p.hidden;
    float* srow = p.out_scales + row * groups;
    const bool in_segment =
        seg.lens == nullptr || warp_row_in_segments(row, seg.lens, seg.offsets, seg.is64, seg.num, covered);
    if (!in_segment) {  // rows outside every segment: zero data and zero scales
      for (int item = lane; item < items; item += 32) reinterpret_cast<uint4*>(orow)[item] = make_uint4(0, 0, 0, 0);
      for (int g = lane; g < groups; g += 32) srow[g] = 0.0f;
      continue;
    }
    const uint8_t* prow = p.packed + row * p.packed_stride;
    const uint8_t* scrow = p.scales + row * p.scales_stride;
    // kFull: every item of the pass lies in the row (no bounds checks).
    auto pass = [&](int base, auto full) {
      constexpr bool kFull = decltype(full)::value;
      uint2 raw[kRowUnroll];
      uint32_t s4[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (kFull || item < items) {
          raw[u] = load_packed8<kVec8>(prow + item * 8);
          s4[u] = __ldg(reinterpret_cast<const uint32_t*>(scrow + (item >> 3) * 4));  // the group's 4 scales
        } else {
          raw[u] = make_uint2(0, 0);
          s4[u] = 0;
        }
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (!kFull && item >= items) continue;
        const uint32_t emax = group_emax(s4[u]);
        uint4 o = make_uint4(0, 0, 0, 0);  // NaN group: zero data
        if (emax != kUe8m0Nan) {
          const uint32_t e = (s4[u] >> (8 * ((item >> 1) & 3))) & 0xFFu;
          const uint32_t d = min(emax - e, static_cast<uint32_t>(kRemapRows - 1));
          const uint32_t lo = remap.word[d][0], hi = remap.word[d][1];
          remap8(raw[u].x, lo, hi, o.x, o.y);
          remap8(raw[u].y, lo, hi, o.z, o.w);
          const uint32_t zero_mask = remap.zero[d];
          if (zero_mask != 0u) underflow += count_underflow(raw[u].x, zero_mask) + count_underflow(raw[u].y, zero_mask);
        }
        reinterpret_cast<uint4*>(orow)[item] = o;
      }
    };
    int base = 0;
    for (; base + 32 * kRowUnroll <= items; base += 32 * kRowUnroll) pass(base, std::true_type{});
    if (base < items) pass(base, std::false_type{});
    // The group scales, one per lane: 2^(emax - 127 - 6) of the group's largest scale byte.
    for (int g = lane; g < groups; g += 32) {
      const uint32_t s4 = __ldg(reinterpret_cast<const uint32_t*>(scrow) + g);
      srow[g] = group_scale(group_emax(s4));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) underflow += __shfl_xor_sync(0xFFFFFFFFu, underflow, m);
  if (lane == 0 && underflow != 0ull) atomicAdd(p.underflow, underflow);
}

}  // namespace

cudaError_t launch_mxfp4_to_fp8_blockwise(const Mxfp4ToFp8BlockwiseParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.hidden <= 0) return cudaSuccess;
  const bool vec8 = ((p.packed_stride & 7) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 7) == 0);
  // One row per warp and the hardware's block scheduler, not a persistent grid: with a few rows per
  // persistent warp the warps holding one more row finish last.
  const long long blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
  const int grid = static_cast<int>(blocks < (1LL << 30) ? blocks : (1LL << 30));  // the kernel strides past it
  if (vec8) {
    sm90_mxfp4_to_fp8_blockwise_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    sm90_mxfp4_to_fp8_blockwise_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe_fp4
