// Quantizers from float rows: quantize_mxfp4 (MXFP4, optionally as byte rows at a caller-given row, or
// to several destinations at once: the expert-parallel push into every rank's receive buffer) and
// BF16 -> FP8 1x128; and the plain multi-destination push of encoded byte rows. One warp per row,
// several 16-byte loads in flight per lane, block absolute maxima reduced with warp shuffles.
// bfloat16 rows to MXFP4 take 16 elements per lane and encode E2M1 in integer space, two elements per
// instruction; float32/float16 rows take 8 per lane.
#include "sm90_common.cuh"
#include "sm90_device_queries.h"
#include "sm90_launchers.h"
#include "sm90_mxfp4_expand.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // items (16-byte loads) in flight per lane

__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// Bits of the absolute maximum of one item's 8 elements (NaN and Inf sort above every finite
// value). bfloat16: lane-wise 16-bit maxima over the raw words, then widened.
template <FloatInput kType>
__device__ __forceinline__ uint32_t item_amax_bits(const uint4 (&r)[2], const float (&f)[8]) {
  if constexpr (kType == FloatInput::kBFloat16) {
    constexpr uint32_t kAbs = 0x7FFF7FFFu;
    const uint32_t m = max_u16x2(max_u16x2(r[0].x & kAbs, r[0].y & kAbs), max_u16x2(r[0].z & kAbs, r[0].w & kAbs));
    return max(m << 16, m & 0xFFFF0000u);
  } else {
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = max(amax, abs_bits(f[i]));
    return amax;
  }
}

// Eight E2M1 magnitude codes (low byte of each c[i]) and the signs of the eight inputs -> one word of
// packed codes (element 2i in the low nibble of byte i): bytes first, then nibbles.
__device__ __forceinline__ uint32_t pack_codes_with_signs(const uint32_t (&c)[8], const float (&f)[8]) {
  const uint32_t u0 = __float_as_uint(f[0]), u1 = __float_as_uint(f[1]), u2 = __float_as_uint(f[2]);
  const uint32_t u3 = __float_as_uint(f[3]), u4 = __float_as_uint(f[4]), u5 = __float_as_uint(f[5]);
  const uint32_t u6 = __float_as_uint(f[6]), u7 = __float_as_uint(f[7]);
  // Byte k: code of element k, its sign (bit 31 of the float, gathered as byte 3) moved to bit 3.
  const uint32_t s_lo = __byte_perm(__byte_perm(u0, u1, 0x0073), __byte_perm(u2, u3, 0x0073), 0x5410);
  const uint32_t s_hi = __byte_perm(__byte_perm(u4, u5, 0x0073), __byte_perm(u6, u7, 0x0073), 0x5410);
  uint32_t x_lo = __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040), 0x5410);
  uint32_t x_hi = __byte_perm(__byte_perm(c[4], c[5], 0x0040), __byte_perm(c[6], c[7], 0x0040), 0x5410);
  x_lo |= (s_lo >> 4) & 0x08080808u;
  x_hi |= (s_hi >> 4) & 0x08080808u;
  // Nibbles: byte 2j of x | x >> 4 holds code 2j | code 2j+1 << 4.
  return __byte_perm(x_lo | (x_lo >> 4), x_hi | (x_hi >> 4), 0x6420);
}

// E2M1 codes with signs of the two bfloat16 values in w for the block scale byte sbyte (4 <= sbyte
// < 255), in integer space: |x| clamped below at 2^(q-3) (everything below rounds to code 0
// anyway), times 2^-q by subtracting q from both exponent fields (q = sbyte - 127; the clamp keeps
// the results normal), saturated at 6, then rounded to the E2M1 grid by adding 2^(e + 6) in
// bfloat16 (its ulp is the E2M1 step at exponent e = max(exponent, 0)); the sum's low bits count
// the steps and 2e more steps give the code. No lane ever borrows from or carries into the other.
// Result: the low element's code (sign in bit 3) in bits 0..3, the high one's in bits 16..19.
// kSaturate false: the caller knows every scaled value is at most 6 ("up" scale rounding).
template <bool kSaturate>
__device__ __forceinline__ uint32_t e2m1_bf16_pair_codes(uint32_t w, uint32_t lowest, uint32_t shift) {
  uint32_t y = max_u16x2(w & 0x7FFF7FFFu, lowest) - shift;
  if constexpr (kSaturate) y = min_u16x2(y, 0x40C040C0u);
  const uint32_t g = max_u16x2(y, 0x3F803F80u) & 0x7F807F80u;  // exponent field of max(y, 1)
  const uint32_t magic = g + 0x03000300u;                       // times 2^6
  const __nv_bfloat162 sum = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&y),
                                     *reinterpret_cast<const __nv_bfloat162*>(&magic));
  const uint32_t code = *reinterpret_cast<const uint32_t*>(&sum) - g + (g >> 6) - 0x03FE03FEu;
  return code | (__umulhi(w, 1u << 20) & 0x00080008u);  // signs (bits 15, 31) to bits 3, 19
}

// Four pair results (e2m1_bf16_pair_codes / e2m1_pair_codes layout) -> one word of 8 packed codes.
__device__ __forceinline__ uint32_t pack_pair_codes(uint32_t p0, uint32_t p1, uint32_t p2, uint32_t p3) {
  const uint32_t a = __byte_perm(p0, p1, 0x6420), b = __byte_perm(p2, p3, 0x6420);
  return __byte_perm(a | (a >> 4), b | (b >> 4), 0x6420);
}

template <FloatInput kType>
__global__ void __launch_bounds__(kThreads) sm90_quantize_mxfp4_kernel(const QuantizeMxfp4Params p) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const int items = p.hidden / 8;  // 4 items per MX block
  const size_t elem = kType == FloatInput::kFloat32 ? 4 : 2;
  const bool aligned4 = ((p.packed_stride & 3) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 3) == 0);
  for (long long t = warp; t < p.tokens; t += num_warps) {
    const long long orow = p.row_index ? load_index(p.row_index, p.row_index_is64, t) : t;
    if (orow < 0 || orow >= p.out_rows) continue;  // the same for the whole warp
    const void* xrow = static_cast<const char*>(p.x) + static_cast<size_t>(t) * p.x_stride * elem;
    uint8_t* prow = p.packed + orow * p.packed_stride;
    uint8_t* srow = p.scales + orow * p.scales_stride;
    for (int base = 0; base < items; base += 32 * kUnroll) {
      uint4 raw[kUnroll][2];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item < items) {
          load_item<kType>(xrow, item, raw[u]);
        } else {
          raw[u][0] = raw[u][1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        float f[8];
        item_to_float<kType>(raw[u], f);
        uint32_t amax = item_amax_bits<kType>(raw[u], f);
        amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        const uint32_t sbyte = e2m1_scale_byte(amax, p.round_up);
        uint32_t codes = 0;  // a NaN/Inf block keeps all codes 0
        if (sbyte != kUe8m0Nan) {
          const float inv = ue8m0_inverse(sbyte);
          if constexpr (kType == FloatInput::kFloat32) {
            uint32_t c[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) c[i] = e2m1_magnitude_low_byte(__fmul_rn(fabsf(f[i]), inv));
            codes = pack_codes_with_signs(c, f);
          } else {
            // float16 inputs: the scaled values are exact in float16, two codes per instruction.
            const uint32_t w[4] = {raw[u][0].x, raw[u][0].y, raw[u][0].z, raw[u][0].w};
            uint32_t y[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t pc = e2m1_pair_codes(__fmul_rn(fabsf(f[2 * j]), inv), __fmul_rn(fabsf(f[2 * j + 1]), inv)) |
                                  ((w[j] >> 12) & 0x00080008u);  // signs (bits 15, 31) to bits 3, 19
              y[j] = pc | (pc >> 12);  // low byte: code 2j | code 2j+1 << 4
            }
            codes = __byte_perm(__byte_perm(y[0], y[1], 0x0040), __byte_perm(y[2], y[3], 0x0040), 0x5410);
          }
        }
        if (item < items) {
          uint8_t* dst = prow + item * 4;
          if (aligned4) {
            *reinterpret_cast<uint32_t*>(dst) = codes;
          } else {
#pragma unroll
            for (int b = 0; b < 4; ++b) dst[b] = static_cast<uint8_t>(codes >> (8 * b));
          }
          if ((lane & 3) == 0) srow[item >> 2] = static_cast<uint8_t>(sbyte);
        }
      }
    }
  }
}

// quantize_mxfp4 for bfloat16 inputs: 16 elements (two 16-byte loads, half an MX block) per lane and
// item, so a block's absolute maximum takes one shuffle and its scale byte is derived by 2 lanes.
constexpr int kBf16Unroll = 2;  // items in flight per lane (64 bytes)
static_assert(kBf16Unroll == 2, "a warp step's 32 scale bytes are stored by one instruction (below)");

// Eight bytes of packed codes (item `item` of a row) at the row's packed bytes prow.
__device__ __forceinline__ void store_bf16_item_codes(uint8_t* prow, int item, uint2 codes, bool aligned8, bool aligned4) {
  uint8_t* dst = prow + item * 8;
  if (aligned8) {
    *reinterpret_cast<uint2*>(dst) = codes;
  } else if (aligned4) {
    reinterpret_cast<uint32_t*>(dst)[0] = codes.x;
    reinterpret_cast<uint32_t*>(dst)[1] = codes.y;
  } else {
#pragma unroll
    for (int b = 0; b < 8; ++b) dst[b] = static_cast<uint8_t>((b < 4 ? codes.x : codes.y) >> (8 * (b & 3)));
  }
}

// Token t's row in destination d, or -1 (negative in the table, or past the destination's end).
__device__ __forceinline__ long long destination_row(const RowDestinations& ds, long long t, int d) {
  const long long r = ds.rows[t * ds.num + d];
  long long cap = 0;
#pragma unroll
  for (int i = 0; i < kMaxRowDestinations; ++i) cap = i == d ? ds.capacity[i] : cap;  // constant indices only
  return r < cap ? r : -1;
}

__device__ __forceinline__ uint8_t* destination_base(const RowDestinations& ds, int d) {
  uint8_t* b = nullptr;
#pragma unroll
  for (int i = 0; i < kMaxRowDestinations; ++i) b = i == d ? ds.base[i] : b;  // constant indices only
  return b;
}

// Bit d set when token t goes to destination d.
__device__ __forceinline__ unsigned destination_mask(const RowDestinations& ds, long long t) {
  unsigned m = 0;
  for (int d = 0; d < ds.num; ++d) m |= (destination_row(ds, t, d) >= 0 ? 1u : 0u) << d;
  return m;
}

// One warp copies a row staged in shared memory (16-byte aligned) to dst, in the widest accesses dst
// allows: 16-byte stores reach a peer over NVLink as whole packets, where a row written piecewise from
// registers (8 code bytes and 1 scale byte per lane) goes out in small ones.
__device__ __forceinline__ void store_staged_row(const uint8_t* row, uint8_t* dst, long long bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes);
  if ((a & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(row);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (long long i = lane; i < bytes / 16; i += 32) d[i] = s[i];
  } else if ((a & 3) == 0) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(row);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (long long i = lane; i < bytes / 4; i += 32) d[i] = s[i];
  } else {
    for (long long i = lane; i < bytes; i += 32) dst[i] = row[i];
  }
}

// Dynamic shared memory of the multi-destination kernels: one staged row per warp.
__host__ __device__ inline size_t staged_row_pitch(long long row_bytes) { return static_cast<size_t>((row_bytes + 15) / 16 * 16); }

// The warp's staged row.
__device__ __forceinline__ uint8_t* warp_staged_row(const RowDestinations& ds) {
  extern __shared__ __align__(16) uint8_t staged_rows[];
  return staged_rows + (threadIdx.x >> 5) * staged_row_pitch(ds.row_bytes);
}

// Token t's staged row (complete in shared memory) to every destination that takes it, by the warp's
// stores.
__device__ __forceinline__ void push_staged_row(const RowDestinations& ds, long long t, const uint8_t* staged, int lane) {
  __syncwarp();  // the staged row is complete
  for (int d = 0; d < ds.num; ++d) {  // (the rows again: an L1 hit, fewer live registers)
    const long long r = destination_row(ds, t, d);
    if (r >= 0) store_staged_row(staged, destination_base(ds, d) + r * ds.row_bytes, ds.row_bytes, lane);
  }
  __syncwarp();  // every lane has read the staged row before the next token overwrites it
}

// kRoundUp: "up" scale rounding (every scaled value at most 6: no saturation step), else "down".
// kMulti: each token is read and encoded once into a row staged in shared memory (one per warp),
// which the warp then stores to every destination of p.dests that takes it (peers' buffers over
// NVLink); other warps' loads and encodes overlap those stores.
// kExpand (with kMulti): a token stored to destination p.fp8_dest is also converted to FP8 1x128 from
// the staged row and written to its output rows (p.fp8_slots), while its stores to the peers are in
// flight: the dispatch's own rows reach the expert GEMMs' layout without another pass.
template <bool kRoundUp, bool kMulti, bool kExpand = false>
__global__ void __launch_bounds__(kThreads) sm90_quantize_mxfp4_bf16_kernel(const QuantizeMxfp4Params p) {
  static_assert(kMulti || !kExpand, "the conversion reads the staged row of the multi-destination kernel");
  const ExpandRemap* remap = nullptr;
  if constexpr (kExpand) {
    __shared__ ExpandRemap remap_table;
    load_expand_remap(remap_table);
    remap = &remap_table;
  }
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const int items = p.hidden / 16;  // 2 items per MX block
  const uintptr_t obase = reinterpret_cast<uintptr_t>(p.packed);
  const bool aligned8 = kMulti || (((p.packed_stride & 7) == 0) && ((obase & 7) == 0));
  const bool aligned4 = kMulti || (((p.packed_stride & 3) == 0) && ((obase & 3) == 0));
  for (long long t = warp; t < p.tokens; t += num_warps) {
    long long orow = 0;
    uint8_t* staged = nullptr;
    if constexpr (kMulti) {
      if (!destination_mask(p.dests, t)) continue;  // the same for the whole warp
      staged = warp_staged_row(p.dests);
    } else {
      orow = p.row_index ? load_index(p.row_index, p.row_index_is64, t) : t;
      if (orow < 0 || orow >= p.out_rows) continue;  // the same for the whole warp
    }
    const uint4* xrow = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.x_stride);
    uint8_t* prow = kMulti ? staged : p.packed + orow * p.packed_stride;
    uint8_t* srow = kMulti ? staged + p.hidden / 2 : p.scales + orow * p.scales_stride;
    for (int base = 0; base < items; base += 32 * kBf16Unroll) {
      uint4 raw[kBf16Unroll][2];
      uint32_t sbs[kBf16Unroll];  // the scale byte of each item's block (lanes 2k and 2k + 1 agree)
#pragma unroll
      for (int u = 0; u < kBf16Unroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item < items) {
          raw[u][0] = __ldcs(xrow + 2 * item);
          raw[u][1] = __ldcs(xrow + 2 * item + 1);
        } else {
          raw[u][0] = raw[u][1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kBf16Unroll; ++u) {
        const int item = base + u * 32 + lane;
        const uint32_t w[8] = {raw[u][0].x, raw[u][0].y, raw[u][0].z, raw[u][0].w,
                               raw[u][1].x, raw[u][1].y, raw[u][1].z, raw[u][1].w};
        constexpr uint32_t kAbs = 0x7FFF7FFFu;
        uint32_t m = max_u16x2(max_u16x2(max_u16x2(w[0] & kAbs, w[1] & kAbs), max_u16x2(w[2] & kAbs, w[3] & kAbs)),
                               max_u16x2(max_u16x2(w[4] & kAbs, w[5] & kAbs), max_u16x2(w[6] & kAbs, w[7] & kAbs)));
        m = max_u16x2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        const uint32_t amax = max(m << 16, m & 0xFFFF0000u);  // NaN and Inf sort above every finite value
        const uint32_t sbyte = e2m1_scale_byte(amax, kRoundUp);
        uint2 codes = make_uint2(0, 0);  // a NaN/Inf block keeps all codes 0
        if (sbyte != kUe8m0Nan) {
          uint32_t pc[8];
          if (sbyte >= 4u) {
            const uint32_t lowest = (sbyte - 3u) * 0x00800080u;   // bits of 2^(q-3) in both lanes
            const uint32_t shift = (sbyte - 127u) * 0x00800080u;  // q in both exponent fields
#pragma unroll
            for (int j = 0; j < 8; ++j) pc[j] = e2m1_bf16_pair_codes<!kRoundUp>(w[j], lowest, shift);
          } else {  // tiny blocks (scale 2^-124 and below): through float16, as for float16 inputs
            const float inv = ue8m0_inverse(sbyte);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              pc[j] = e2m1_pair_codes(__fmul_rn(__uint_as_float((w[j] << 16) & 0x7FFF0000u), inv),
                                      __fmul_rn(__uint_as_float(w[j] & 0x7FFF0000u), inv)) |
                      ((w[j] >> 12) & 0x00080008u);
            }
          }
          codes.x = pack_pair_codes(pc[0], pc[1], pc[2], pc[3]);
          codes.y = pack_pair_codes(pc[4], pc[5], pc[6], pc[7]);
        }
        sbs[u] = sbyte;
        if (item < items) store_bf16_item_codes(prow, item, codes, aligned8, aligned4);
      }
      // The step's 64 items have 32 scale bytes, srow[base / 2 .. base / 2 + 31]: byte b of them comes
      // from lane 2b of the first item (b < 16) or 2 (b - 16) of the second, and lane b stores it. One
      // byte store by all 32 lanes (a whole 32-byte sector of a row's scales for H % 1024 == 0), not
      // two by 16 lanes each (half-sector writes).
      {
        const uint32_t first = __shfl_sync(0xFFFFFFFFu, sbs[0], (2 * lane) & 31);
        const uint32_t second = __shfl_sync(0xFFFFFFFFu, sbs[1], (2 * lane) & 31);
        const int b = base / 2 + lane;
        if (b < items / 2) srow[b] = static_cast<uint8_t>(lane < 16 ? first : second);
      }
    }
    if constexpr (kMulti) push_staged_row(p.dests, t, staged, lane);
    if constexpr (kExpand) {
      const long long r = destination_row(p.dests, t, p.fp8_dest);
      if (r >= 0) {  // (the same for the whole warp)
        long long slot = -1;
        if (lane < p.fp8_k) slot = p.fp8_slots[r * p.fp8_k + lane];
        const uint32_t targets = __ballot_sync(0xFFFFFFFFu, slot >= 0 && slot < p.fp8_rows);
        if (targets != 0u) {
          expand_row_to_slots<true, true>(staged, staged + p.hidden / 2, p.hidden, targets, slot, p.fp8_out,
                                          p.fp8_scales, *remap, lane);
        }
      }
      __syncwarp();  // every lane has read the staged row before the next token overwrites it
    }
  }
}

// kMulti: byte rows [H E4M3 | H/128 FP32 scales] staged in shared memory (one per warp), then stored
// to every destination of p.dests that takes the token (as the MXFP4 multi-destination kernel).
template <FloatInput kType, bool kMulti>
__global__ void __launch_bounds__(kThreads) sm90_quantize_fp8_blockwise_kernel(const QuantizeFp8BlockwiseParams p) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const int items = p.hidden / 8;  // 16 items per 128-element group
  const int groups = p.hidden / kFp8Group;
  const size_t elem = kType == FloatInput::kFloat32 ? 4 : 2;
  // Work unit: part `part` of row t, a run of whole chunks of 32 * kUnroll items (one warp step each;
  // row_parts parts per row, one chunk each from the launcher); kMulti stages whole rows (one part).
  constexpr int kChunk = 32 * kUnroll;
  const int chunks = (items + kChunk - 1) / kChunk;
  const int parts = kMulti ? 1 : p.row_parts;
  for (long long unit = warp; unit < p.tokens * parts; unit += num_warps) {
    const long long t = unit / parts;
    const int part = static_cast<int>(unit - t * parts);
    const int item_lo = part * chunks / parts * kChunk, item_hi = (part + 1) * chunks / parts * kChunk;
    uint8_t* staged = nullptr;
    if constexpr (kMulti) {
      if (!destination_mask(p.dests, t)) continue;  // the same for the whole warp
      staged = warp_staged_row(p.dests);
    }
    const void* xrow = static_cast<const char*>(p.x) + static_cast<size_t>(t) * p.x_stride * elem;
    uint8_t* orow = kMulti ? staged : p.out + t * p.hidden;
    float* srow = kMulti ? reinterpret_cast<float*>(staged + p.hidden) : p.out_scales + t * groups;
    for (int base = item_lo; base < item_hi; base += kChunk) {
      uint4 raw[kUnroll][2];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item < items) {
          load_item<kType>(xrow, item, raw[u]);
        } else {
          raw[u][0] = raw[u][1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        float f[8];
        item_to_float<kType>(raw[u], f);
        uint32_t sbyte;
        const uint2 out = fp8_group_item(f, item_amax_bits<kType>(raw[u], f), sbyte);
        if (item < items) {
          *reinterpret_cast<uint2*>(orow + item * 8) = out;
          if ((lane & 15) == 0) srow[item >> 4] = ue8m0_value(sbyte);
        }
      }
    }
    if constexpr (kMulti) push_staged_row(p.dests, t, staged, lane);
  }
}

// Byte rows to several destinations, one warp per row, V-sized accesses (V: uint4, uint32_t or uint8_t,
// chosen by the launcher from the alignment of every row), kUnroll accesses in flight per lane.
template <typename V>
__global__ void __launch_bounds__(kThreads) sm90_scatter_rows_kernel(const ScatterRowsParams p) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const long long vecs = p.dests.row_bytes / static_cast<long long>(sizeof(V));
  for (long long t = warp; t < p.tokens; t += num_warps) {
    const unsigned take = destination_mask(p.dests, t);
    if (!take) continue;  // the same for the whole warp
    const V* src = reinterpret_cast<const V*>(p.src + t * p.src_stride);
    for (long long base = 0; base < vecs; base += 32 * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const long long i = base + u * 32 + lane;
        if (i < vecs) v[u] = src[i];
      }
      for (int d = 0; d < p.dests.num; ++d) {
        if (!((take >> d) & 1u)) continue;
        V* dst = reinterpret_cast<V*>(destination_base(p.dests, d) + destination_row(p.dests, t, d) * p.dests.row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const long long i = base + u * 32 + lane;
          if (i < vecs) dst[i] = v[u];
        }
      }
    }
  }
}

// Blocks for a persistent grid: enough to fill every SM at the kernel's occupancy, no more than the
// rows need (one warp per row), and no more than max_blocks when it is positive.
template <typename Kernel>
int grid_for_rows(Kernel kernel, long long rows, size_t smem = 0, int max_blocks = 0) {
  const int sms = sm_count(), per_sm = blocks_per_sm(kernel, kThreads, smem);
  const long long need = (rows + kThreads / 32 - 1) / (kThreads / 32);
  long long cap = static_cast<long long>(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  if (max_blocks > 0 && cap > max_blocks) cap = max_blocks;
  return static_cast<int>(need < cap ? (need > 0 ? need : 1) : cap);
}

// Launch of a multi-destination kernel: one staged row per warp in dynamic shared memory.
template <typename Kernel, typename Params>
cudaError_t launch_staged(Kernel kernel, const Params& p, long long rows, long long row_bytes, cudaStream_t stream) {
  const size_t smem = (kThreads / 32) * staged_row_pitch(row_bytes);
  const cudaError_t err = allow_dynamic_smem(kernel, smem);  // fails past the device's limit
  if (err != cudaSuccess) return err;
  kernel<<<grid_for_rows(kernel, rows, smem, p.dests.max_blocks), kThreads, smem, stream>>>(p);
  return cudaSuccess;
}

// One work unit (a row, or a part of one) per warp and the hardware's block scheduler, not a
// persistent grid: with a few rows per persistent warp the warps holding one more row finish last.
// Past 2^30 blocks the warps stride over the rest.
int grid_one_per_warp(long long units) {
  const long long blocks = (units + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<int>(blocks < (1LL << 30) ? blocks : (1LL << 30));
}

}  // namespace

long long max_staged_row_bytes() {
  const int optin = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  constexpr long long kReserve = 256;  // the kernels' static shared memory (at most 160 bytes today)
  const long long per_row = (static_cast<long long>(optin) - kReserve) / (kThreads / 32);
  return per_row > 0 ? per_row / 16 * 16 : 0;
}

cudaError_t launch_quantize_mxfp4(const QuantizeMxfp4Params& p, cudaStream_t stream) {
  if (p.tokens <= 0 || p.hidden <= 0) return cudaSuccess;
  switch (p.x_type) {
    case FloatInput::kFloat32: {
      auto k = sm90_quantize_mxfp4_kernel<FloatInput::kFloat32>;
      k<<<grid_for_rows(k, p.tokens), kThreads, 0, stream>>>(p);
      break;
    }
    case FloatInput::kBFloat16: {
      if (p.dests.num > 0 && p.fp8_out != nullptr) {
        auto k = p.round_up ? sm90_quantize_mxfp4_bf16_kernel<true, true, true>
                            : sm90_quantize_mxfp4_bf16_kernel<false, true, true>;
        const cudaError_t err = launch_staged(k, p, p.tokens, p.dests.row_bytes, stream);
        if (err != cudaSuccess) return err;
      } else if (p.dests.num > 0) {
        auto k = p.round_up ? sm90_quantize_mxfp4_bf16_kernel<true, true> : sm90_quantize_mxfp4_bf16_kernel<false, true>;
        const cudaError_t err = launch_staged(k, p, p.tokens, p.dests.row_bytes, stream);
        if (err != cudaSuccess) return err;
      } else {
        auto k = p.round_up ? sm90_quantize_mxfp4_bf16_kernel<true, false> : sm90_quantize_mxfp4_bf16_kernel<false, false>;
        // One row per warp (splitting rows into 1024-element chunks, one per warp as the FP8 1x128
        // quantizer does, measured slower for this kernel).
        k<<<grid_one_per_warp(p.tokens), kThreads, 0, stream>>>(p);
      }
      break;
    }
    case FloatInput::kFloat16: {
      auto k = sm90_quantize_mxfp4_kernel<FloatInput::kFloat16>;
      k<<<grid_for_rows(k, p.tokens), kThreads, 0, stream>>>(p);
      break;
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_quantize_fp8_blockwise(const QuantizeFp8BlockwiseParams& p, cudaStream_t stream) {
  if (p.tokens <= 0 || p.hidden <= 0) return cudaSuccess;
  if (p.dests.num > 0) {
    auto k = sm90_quantize_fp8_blockwise_kernel<FloatInput::kBFloat16, true>;
    const cudaError_t err = launch_staged(k, p, p.tokens, p.dests.row_bytes, stream);
    if (err != cudaSuccess) return err;
    return cudaGetLastError();
  }
  // One chunk of 32 * kUnroll items (1024 elements) per warp, on the hardware block scheduler: one row
  // per warp leaves warp slots empty at small token counts (4096 rows fill half of an H200's), and
  // the chunks measured faster at every size; splitting rows only while they are fewer than twice the
  // slots measured slower than always splitting.
  QuantizeFp8BlockwiseParams q = p;
  q.row_parts = (p.hidden / 8 + 32 * kUnroll - 1) / (32 * kUnroll);
  const long long units = p.tokens * q.row_parts;
  switch (p.x_type) {
    case FloatInput::kFloat32: {
      auto k = sm90_quantize_fp8_blockwise_kernel<FloatInput::kFloat32, false>;
      k<<<grid_one_per_warp(units), kThreads, 0, stream>>>(q);
      break;
    }
    case FloatInput::kBFloat16: {
      auto k = sm90_quantize_fp8_blockwise_kernel<FloatInput::kBFloat16, false>;
      k<<<grid_one_per_warp(units), kThreads, 0, stream>>>(q);
      break;
    }
    case FloatInput::kFloat16: {
      auto k = sm90_quantize_fp8_blockwise_kernel<FloatInput::kFloat16, false>;
      k<<<grid_one_per_warp(units), kThreads, 0, stream>>>(q);
      break;
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(const ScatterRowsParams& p, cudaStream_t stream) {
  if (p.tokens <= 0 || p.dests.row_bytes <= 0 || p.dests.num == 0) return cudaSuccess;
  uintptr_t bits = reinterpret_cast<uintptr_t>(p.src) | static_cast<uintptr_t>(p.src_stride) |
                   static_cast<uintptr_t>(p.dests.row_bytes);
  for (int d = 0; d < p.dests.num; ++d) bits |= reinterpret_cast<uintptr_t>(p.dests.base[d]);
  if ((bits & 15) == 0) {
    auto k = sm90_scatter_rows_kernel<uint4>;
    k<<<grid_for_rows(k, p.tokens, 0, p.dests.max_blocks), kThreads, 0, stream>>>(p);
  } else if ((bits & 3) == 0) {
    auto k = sm90_scatter_rows_kernel<uint32_t>;
    k<<<grid_for_rows(k, p.tokens, 0, p.dests.max_blocks), kThreads, 0, stream>>>(p);
  } else {
    auto k = sm90_scatter_rows_kernel<uint8_t>;
    k<<<grid_for_rows(k, p.tokens, 0, p.dests.max_blocks), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe_fp4
