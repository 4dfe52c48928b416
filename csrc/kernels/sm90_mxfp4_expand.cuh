// mxfp4_to_fp8_blockwise for one byte row, by one warp, stored to several output rows: the body of the
// expansion kernel (sm90_mxfp4_expand.cu) and of the fused push (sm90_quantize.cu), which converts the
// rows a rank sends itself from the row it has just staged in shared memory.
#pragma once

#include "sm90_common.cuh"

#include <type_traits>

namespace moe_fp4 {
namespace {

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

// The block's copy of the table in shared memory (the lanes' shifts differ: a constant-memory read
// would serialise). Call with every thread of the block, before any warp returns.
__device__ __forceinline__ void load_expand_remap(ExpandRemap& remap) {
  for (int i = threadIdx.x; i < kRemapRows; i += blockDim.x) {
    remap.word[i][0] = kExpandRemap.word[i][0];
    remap.word[i][1] = kExpandRemap.word[i][1];
  }
  __syncthreads();
}

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

// Where the row is read from: kShared (a staged row: plain loads), else global memory with 8-byte
// (kVec8) or 4-byte aligned code loads, streaming (read once).
template <bool kShared, bool kVec8>
__device__ __forceinline__ uint2 load_codes(const uint8_t* prow, int item) {
  if constexpr (kShared) {
    return *reinterpret_cast<const uint2*>(prow + item * 8);
  } else if constexpr (kVec8) {
    return __ldcs(reinterpret_cast<const uint2*>(prow + item * 8));
  } else {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(prow + item * 8);
    return make_uint2(__ldcs(q), __ldcs(q + 1));
  }
}

template <bool kShared>
__device__ __forceinline__ uint32_t load_scale_word(const uint8_t* scrow, int i) {
  if constexpr (kShared) {
    return reinterpret_cast<const uint32_t*>(scrow)[i];
  } else {
    return __ldg(reinterpret_cast<const uint32_t*>(scrow) + i);
  }
}

constexpr int kExpandUnroll = 8;  // items in flight per lane

// One warp: the MXFP4 row (prow: H/2 packed bytes; scrow: H/32 UE8M0 bytes, 4-byte aligned) as FP8
// 1x128 to every output row named by a lane of `targets` (lane j holds its row in `slot`): each pass
// converts 8 items per lane (an item is half an MX block: 8 packed bytes in, 16 E4M3 bytes out) and
// stores them to every target row, 512 contiguous bytes per warp store; then the group scales
// 2^(emax - 127 - 6) (NaN for a NaN group), one per lane.
// copy (global memory, 4-byte aligned, or nullptr): also receives the row's bytes [packed | scales]
// as they were loaded for the conversion (a copy that reads nothing twice).
template <bool kShared, bool kVec8>
__device__ __forceinline__ void expand_row_to_slots(const uint8_t* prow, const uint8_t* scrow, int hidden,
                                                    uint32_t targets, long long slot, uint8_t* out,
                                                    float* out_scales, const ExpandRemap& remap, int lane,
                                                    uint8_t* copy = nullptr) {
  const bool copy8 = (reinterpret_cast<uintptr_t>(copy) & 7) == 0;
  const int items = hidden / 16;
  const int groups = hidden / kFp8Group;
  // kFull: every item of the pass lies in the row (no bounds checks).
  auto pass = [&](int base, auto full) {
    constexpr bool kFull = decltype(full)::value;
    uint4 o[kExpandUnroll];
#pragma unroll
    for (int u = 0; u < kExpandUnroll; ++u) o[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kExpandUnroll; ++u) {
      const int item = base + u * 32 + lane;
      if (kFull || item < items) {
        const uint2 raw = load_codes<kShared, kVec8>(prow, item);
        if (copy != nullptr) {
          if (copy8) {
            *reinterpret_cast<uint2*>(copy + item * 8) = raw;
          } else {
            reinterpret_cast<uint32_t*>(copy + item * 8)[0] = raw.x;
            reinterpret_cast<uint32_t*>(copy + item * 8)[1] = raw.y;
          }
        }
        const uint32_t s4 = load_scale_word<kShared>(scrow, item >> 3);
        o[u] = convert_item(raw, (s4 >> (8 * ((item >> 1) & 3))) & 0xFFu, group_emax(s4), remap);
      }
    }
    for (uint32_t m = targets; m != 0u; m &= m - 1u) {
      const long long r = __shfl_sync(0xFFFFFFFFu, slot, __ffs(m) - 1);
      uint4* orow = reinterpret_cast<uint4*>(out + r * hidden);
#pragma unroll
      for (int u = 0; u < kExpandUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (kFull || item < items) orow[item] = o[u];
      }
    }
  };
  int base = 0;
  for (; base + 32 * kExpandUnroll <= items; base += 32 * kExpandUnroll) pass(base, std::true_type{});
  if (base < items) pass(base, std::false_type{});
  for (int g0 = 0; g0 < groups; g0 += 32) {
    const int g = g0 + lane;
    float s = 0.0f;
    if (g < groups) {
      const uint32_t s4 = load_scale_word<kShared>(scrow, g);
      if (copy != nullptr) reinterpret_cast<uint32_t*>(copy + hidden / 2)[g] = s4;
      s = group_scale(group_emax(s4));
    }
    for (uint32_t m = targets; m != 0u; m &= m - 1u) {
      const long long r = __shfl_sync(0xFFFFFFFFu, slot, __ffs(m) - 1);
      if (g < groups) out_scales[r * groups + g] = s;
    }
  }
}

}  // namespace
}  // namespace moe_fp4
