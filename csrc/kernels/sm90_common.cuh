// Device helpers shared by the sm90_ conversion kernels: the bit-level rules of moe_fp4.formats
// (the numeric spec) written once in CUDA. CUDA toolkit headers only; no torch.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "sm90_launchers.h"

namespace moe_fp4 {

constexpr int kMxBlock = 32;          // elements per UE8M0 scale (MX block)
constexpr int kFp8Group = 128;        // elements per FP32 scale (FP8 1x128 group)
constexpr int kFp8HeadroomExp = 6;    // formats.convert.FP8_HEADROOM_EXP: 6 * 2^6 = 384 <= 448
constexpr uint32_t kUe8m0Nan = 0xFFu;
constexpr uint32_t kFloatNanBits = 0x7FC00000u;  // the bits of float('nan') in the spec
constexpr uint32_t kFloatInfBits = 0x7F800000u;

// Exact 2^(127 - byte) for a UE8M0 byte in [0, 254] (spec: pow2_float32(127 - byte)); byte 254 gives
// the subnormal 2^-127.
__device__ __forceinline__ float ue8m0_inverse(uint32_t byte) {
  return __uint_as_float(byte < 254u ? (254u - byte) << 23 : 0x00400000u);
}

// Exact 2^(byte - 127) for a UE8M0 byte (spec: decode_ue8m0); 0 gives 2^-127, 0xFF gives NaN.
__device__ __forceinline__ float ue8m0_value(uint32_t byte) {
  if (byte == kUe8m0Nan) return __uint_as_float(kFloatNanBits);
  return __uint_as_float(byte > 0u ? byte << 23 : 0x00400000u);
}

// UE8M0 byte of a finite non-negative float32, rounded up to a power of two in bit space
// (spec: encode_ue8m0(x, rounding="up")): a normal q gives its exponent field plus one when any
// mantissa bit is set; a subnormal q gives byte 0 (2^-127) up to 2^-127 and byte 1 above it.
__device__ __forceinline__ uint32_t ue8m0_round_up(float q) {
  const uint32_t u = __float_as_uint(q), field = u >> 23, mant = u & 0x7FFFFFu;
  const uint32_t b = field == 0u ? (mant > 0x400000u ? 1u : 0u) : field + (mant != 0u ? 1u : 0u);
  return b < 254u ? b : 254u;
}

// "Up" scale byte of a block whose absolute maximum has the finite bits amax_bits, for an element
// format whose largest value is max_value = 1.m * 2^k with m's mantissa bits `max_mant` (spec:
// encode_ue8m0(float32(amax / max_value), "up")). Where the quotient is a normal float32 (amax's
// exponent field at least `min_field`), the byte follows from amax's bits alone: with amax =
// 1.a * 2^e, float32(amax / max_value) lies in (2^(e-k-1), 2^(e-k)] when a <= m (rounding up gives
// 2^(e-k)) and in (2^(e-k), 2^(e-k+1)) when a > m, the correctly rounded quotient never landing on a
// power of two in the second case (checked exhaustively over every mantissa). Below `min_field` it
// divides with IEEE __fdiv_rn as the spec does.
template <uint32_t kMaxField, uint32_t kMaxMant, uint32_t kMinField>
__device__ __forceinline__ uint32_t scale_byte_up(uint32_t amax_bits, float max_value) {
  const uint32_t field = amax_bits >> 23;
  if (field >= kMinField) return field - (kMaxField - 127u) + ((amax_bits & 0x7FFFFFu) > kMaxMant ? 1u : 0u);
  return ue8m0_round_up(__fdiv_rn(__uint_as_float(amax_bits), max_value));
}

// Scale byte of an MX E2M1 block from the bits of its absolute maximum (spec: mx_scale_bytes).
// "up": float32(amax / 6) correctly rounded, then rounded up to a power of two in bit space;
// "down": exponent field of amax minus 2 (E2M1's largest exponent), clamped at 0.
// NaN or Inf in the block (amax bits >= Inf) gives 0xFF.
__device__ __forceinline__ uint32_t e2m1_scale_byte(uint32_t amax_bits, bool round_up) {
  if (amax_bits >= kFloatInfBits) return kUe8m0Nan;
  if (round_up) return scale_byte_up<129u, 0x400000u, 5u>(amax_bits, 6.0f);  // 6 = 1.5 * 2^2
  const int e = int(amax_bits >> 23) - 2;
  return e > 0 ? uint32_t(e) : 0u;
}

// Scale byte of an FP8 E4M3 1x128 group (spec: mx_scale_bytes(amax, E4M3, "up")).
__device__ __forceinline__ uint32_t e4m3_scale_byte(uint32_t amax_bits) {
  if (amax_bits >= kFloatInfBits) return kUe8m0Nan;
  return scale_byte_up<135u, 0x600000u, 10u>(amax_bits, 448.0f);  // 448 = 1.75 * 2^8
}

// Makes this thread's shared-memory writes visible to the copy engine (the async proxy) before a
// tensor copy reads them; a barrier then orders them before the thread that issues the copy.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Lane-wise unsigned maximum / minimum of two pairs of 16-bit values (one instruction on sm_90).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t min_u16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("min.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// E2M1 magnitude codes of two scaled values v0, v1 >= 0 (finite, below 8) that are exact in float16
// or below 2^-14 (true for bfloat16 and float16 inputs times a power of two): code of v0 in bits
// 0..2, of v1 in bits 16..18. Works on both at once in float16: clamping at 6 keeps every code (all of
// (6, 8) becomes 6), and adding 2^(e + 9), e = max(exponent of v, 0), whose ulp is v's E2M1 step
// (0.5, 1 or 2), rounds v to nearest even on the E2M1 grid; the sum's low bits count the steps, and
// 2e more steps give the code. Lanes never carry into each other.
__device__ __forceinline__ uint32_t e2m1_pair_codes(float v0, float v1) {
  const __half2 h = __floats2half2_rn(v0, v1);
  const uint32_t hv = min_u16x2(*reinterpret_cast<const uint32_t*>(&h), 0x46004600u);  // min(v, 6)
  const uint32_t g = max_u16x2(hv, 0x3C003C00u) & 0x7C007C00u;  // exponent field of max(v, 1)
  const uint32_t magic = g + 0x24002400u;                       // times 2^9
  const __half2 sum = __hadd2(*reinterpret_cast<const __half2*>(&hv), *reinterpret_cast<const __half2*>(&magic));
  return *reinterpret_cast<const uint32_t*>(&sum) - magic + ((g >> 9) & 0x003F003Fu) - 0x001E001Eu;
}

// E2M1 magnitude code (0..7) of a finite v >= 0: round to nearest, ties to even, saturating at 6.
// v < 1 (E2M1 subnormals, step 0.5): adding 2^22 (whose ulp is 0.5) rounds v to a multiple of 0.5
// and leaves that multiple in the low bits. v >= 1: round the float32 mantissa to one bit in integer
// space; the carry moves into the exponent, and the exponent offset turns the result into a code.
__device__ __forceinline__ uint32_t e2m1_magnitude(float v) {
  const uint32_t sub = __float_as_uint(__fadd_rn(v, 4194304.0f)) & 7u;
  const uint32_t u = __float_as_uint(v);
  const uint32_t r = (u + 0x1FFFFFu + ((u >> 22) & 1u) - (252u << 22)) >> 22;
  const uint32_t normal = r < 7u ? r : 7u;
  return v < 1.0f ? sub : normal;
}

// E2M1 magnitude code (0..7) of a finite v >= 0 in the low byte of the result (the upper bytes are
// not cleared): e2m1_magnitude without its final masking, for callers that pick bytes.
__device__ __forceinline__ uint32_t e2m1_magnitude_low_byte(float v) {
  const uint32_t sub = __float_as_uint(__fadd_rn(v, 4194304.0f));  // low byte: 2^22 + k/2 -> k
  const uint32_t u = __float_as_uint(v);
  const uint32_t r = (u + 0x1FFFFFu + ((u >> 22) & 1u) - (252u << 22)) >> 22;
  return v < 1.0f ? sub : min(r, 7u);
}

// Two float32 -> two E4M3 bytes (a in the low byte): round to nearest even, saturating to +-448.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// Four float32 -> four E4M3 bytes in one word (a in the lowest byte).
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  return e4m3x2(a, b) | (e4m3x2(c, d) << 16);
}

// Sign bits of four E2M1 codes (the nibbles of the low 16 bits of `half`) moved to bit 7 of four
// bytes: byte k gets the sign of nibble k. `spread` is __byte_perm(word, 0, 0x1100) or (0x3322).
__device__ __forceinline__ uint32_t nibble_signs_to_bytes(uint32_t spread) {
  return ((spread << 4) & 0x00800080u) | (spread & 0x80008000u);
}

// float32 value of E2M1 code c (0..15, sign in bit 3), as formats.decode_elements gives it: magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 built from their bits (exponent (mag >> 1) + 126 and mantissa bit mag & 1
// from mag 2 on; 0.5 for mag 1; +-0 for mag 0).
__device__ __forceinline__ float e2m1_value(uint32_t c) {
  const uint32_t mag = c & 7u;
  const uint32_t bits = mag == 0u ? 0u : (((mag >> 1) + 126u) << 23) | ((mag > 1u ? mag & 1u : 0u) << 22);
  return __uint_as_float(bits | ((c & 8u) << 28));
}

// FP8 1x128 of one item (8 elements) of a group spread over 16 consecutive lanes (the spec's
// quantize_fp8_blockwise): the group's absolute maximum from every lane's amax_bits (NaN and Inf
// sort above every finite value), its scale byte (the group's FP32 scale is ue8m0_value of it: a
// power of two, NaN for a NaN/Inf group) and the item's 8 E4M3 bytes (zeros for a NaN/Inf group).
// Every lane of the warp must call it.
__device__ __forceinline__ uint2 fp8_group_item(const float (&f)[8], uint32_t amax_bits, uint32_t& sbyte) {
#pragma unroll
  for (int m = 1; m < 16; m <<= 1) amax_bits = max(amax_bits, __shfl_xor_sync(0xFFFFFFFFu, amax_bits, m));
  sbyte = e4m3_scale_byte(amax_bits);
  uint2 out = make_uint2(0, 0);
  if (sbyte != kUe8m0Nan) {
    const float inv = ue8m0_inverse(sbyte);
    out.x = e4m3x4(__fmul_rn(f[0], inv), __fmul_rn(f[1], inv), __fmul_rn(f[2], inv), __fmul_rn(f[3], inv));
    out.y = e4m3x4(__fmul_rn(f[4], inv), __fmul_rn(f[5], inv), __fmul_rn(f[6], inv), __fmul_rn(f[7], inv));
  }
  return out;
}

// E4M3 magnitude byte of the E2M1 magnitude code c (0..7) times 2^(6 - d): the direct MXFP4 -> FP8
// remap of formats.convert (exact for d <= 14; below that it rounds to nearest even into E4M3's
// subnormals, and d >= 19 gives 0 for every code). Usable on host and device, in constant tables.
constexpr int kRemapRows = 20;  // shifts 0..18, and row 19 for every larger shift (all zero)
__host__ __device__ constexpr uint32_t e4m3_of_shifted_e2m1(int c, int d) {
  // E2M1 magnitude times 2, an integer n: value = n * 2^(5 - d) = U * 2^-9 (E4M3's smallest step).
  const int n = c == 0 ? 0 : c == 1 ? 1 : c == 2 ? 2 : c == 3 ? 3 : c == 4 ? 4 : c == 5 ? 6 : c == 6 ? 8 : 12;
  if (n == 0) return 0u;
  long long units = 0;
  if (d <= 14) {
    units = (long long)n << (14 - d);
  } else {
    const int s = d - 14;
    if (s >= 6) return 0u;  // n < 16 <= half of 2^s... all round to zero
    const long long q = n >> s, rem = n & ((1 << s) - 1), half = 1LL << (s - 1);
    units = q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
  }
  if (units < 8) return uint32_t(units);  // subnormal (or the first normal, code 8, reached by rounding)
  int e = 1;
  while (units >= 16) {  // exact: n has at most two significant bits
    units >>= 1;
    ++e;
  }
  return uint32_t((e << 3) | int(units - 8));
}

// Row d of the remap table packed as two words: byte c of (lo, hi) is e4m3_of_shifted_e2m1(c, d).
__host__ __device__ constexpr uint32_t remap_word(int d, int half) {
  return e4m3_of_shifted_e2m1(4 * half + 0, d) | (e4m3_of_shifted_e2m1(4 * half + 1, d) << 8) |
         (e4m3_of_shifted_e2m1(4 * half + 2, d) << 16) | (e4m3_of_shifted_e2m1(4 * half + 3, d) << 24);
}

// ---- Float rows (the quantizers' inputs) ----

// Raw bits of 8 consecutive input elements: one 16-byte load for 16-bit inputs, two for float32.
template <FloatInput kType>
__device__ __forceinline__ void load_item(const void* row, int item, uint4 (&r)[2]) {
  if constexpr (kType == FloatInput::kFloat32) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const float*>(row) + item * 8);
    r[0] = __ldcs(p);
    r[1] = __ldcs(p + 1);
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(row) + item * 8);
    r[0] = __ldcs(p);
    r[1] = make_uint4(0, 0, 0, 0);
  }
}

template <FloatInput kType>
__device__ __forceinline__ void item_to_float(const uint4 (&r)[2], float (&f)[8]) {
  if constexpr (kType == FloatInput::kFloat32) {
    f[0] = __uint_as_float(r[0].x); f[1] = __uint_as_float(r[0].y);
    f[2] = __uint_as_float(r[0].z); f[3] = __uint_as_float(r[0].w);
    f[4] = __uint_as_float(r[1].x); f[5] = __uint_as_float(r[1].y);
    f[6] = __uint_as_float(r[1].z); f[7] = __uint_as_float(r[1].w);
  } else {
    const uint32_t w[4] = {r[0].x, r[0].y, r[0].z, r[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kType == FloatInput::kBFloat16) {
        f[2 * i] = __uint_as_float(w[i] << 16);  // bf16 -> float32 is exact: the upper half
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      } else {
        __half2 h;
        memcpy(&h, &w[i], 4);
        const float2 t = __half22float2(h);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
      }
    }
  }
}

// ---- MXFP4 -> FP8 1x128 (formats.mxfp4_to_fp8_blockwise) ----

// Largest of the 4 UE8M0 bytes of a 128-element group (one 32-bit word of a row's scale bytes).
__device__ __forceinline__ uint32_t group_emax(uint32_t s4) {
  const uint32_t m = max_u16x2(s4 & 0x00FF00FFu, (s4 >> 8) & 0x00FF00FFu);
  return max(m & 0xFFFFu, m >> 16);
}

// FP32 scale of a group from its largest UE8M0 byte: 2^(emax - 127 - 6) (subnormal below emax 7).
__device__ __forceinline__ float group_scale(uint32_t emax) {
  if (emax == kUe8m0Nan) return __uint_as_float(kFloatNanBits);
  return __uint_as_float(emax >= 7u ? (emax - 6u) << 23 : 1u << (emax + 16u));
}

// Eight E2M1 codes (one word) -> eight E4M3 bytes (two words) through the remap row (lo, hi).
__device__ __forceinline__ void remap8(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& out0, uint32_t& out1) {
  const uint32_t sel = w & 0x77777777u;
  out0 = __byte_perm(lo, hi, sel) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x1100));
  out1 = __byte_perm(lo, hi, sel >> 16) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x3322));
}

// bf16 bits (high half of the float32 bits) of the 8 E2M1 magnitudes times the block scale, exact,
// split into byte planes: (hlo, hhi) high bytes of codes 0..3 / 4..7, (llo, lhi) low bytes.
__device__ __forceinline__ void block_tables(uint32_t sbyte, uint32_t& hlo, uint32_t& hhi, uint32_t& llo,
                                             uint32_t& lhi) {
  const float s = ue8m0_value(sbyte);
  const uint32_t b0 = __float_as_uint(__fmul_rn(0.0f, s)), b1 = __float_as_uint(__fmul_rn(0.5f, s));
  const uint32_t b2 = __float_as_uint(__fmul_rn(1.0f, s)), b3 = __float_as_uint(__fmul_rn(1.5f, s));
  const uint32_t b4 = __float_as_uint(__fmul_rn(2.0f, s)), b5 = __float_as_uint(__fmul_rn(3.0f, s));
  const uint32_t b6 = __float_as_uint(__fmul_rn(4.0f, s)), b7 = __float_as_uint(__fmul_rn(6.0f, s));
  hlo = __byte_perm(__byte_perm(b0, b1, 0x0073), __byte_perm(b2, b3, 0x0073), 0x5410);
  hhi = __byte_perm(__byte_perm(b4, b5, 0x0073), __byte_perm(b6, b7, 0x0073), 0x5410);
  llo = __byte_perm(__byte_perm(b0, b1, 0x0062), __byte_perm(b2, b3, 0x0062), 0x5410);
  lhi = __byte_perm(__byte_perm(b4, b5, 0x0062), __byte_perm(b6, b7, 0x0062), 0x5410);
}

// Eight E2M1 codes (one word) -> eight bf16 values (a 16-byte chunk).
__device__ __forceinline__ uint4 dequant8_bf16(uint32_t w, uint32_t hlo, uint32_t hhi, uint32_t llo, uint32_t lhi) {
  const uint32_t sel = w & 0x77777777u, sel_hi = sel >> 16;
  const uint32_t h0 = __byte_perm(hlo, hhi, sel) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x1100));
  const uint32_t l0 = __byte_perm(llo, lhi, sel);
  const uint32_t h1 = __byte_perm(hlo, hhi, sel_hi) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x3322));
  const uint32_t l1 = __byte_perm(llo, lhi, sel_hi);
  return make_uint4(__byte_perm(l0, h0, 0x5140), __byte_perm(l0, h0, 0x7362), __byte_perm(l1, h1, 0x5140),
                    __byte_perm(l1, h1, 0x7362));
}

// Segment index arrays may be int32 or int64.
__device__ __forceinline__ long long load_index(const void* p, bool is64, long long i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<long long>(static_cast<const int*>(p)[i]);
}

// Whether `row` lies in a ragged segment, decided by a whole warp (every lane gets the answer).
// offsets == nullptr: segments are back to back from row 0 and `covered_rows` is their total.
__device__ __forceinline__ bool warp_row_in_segments(long long row, const void* lens, const void* offsets,
                                                     bool is64, int num_segments, long long covered_rows) {
  if (offsets == nullptr) return row < covered_rows;
  bool hit = false;
  for (int e = int(threadIdx.x & 31); e < num_segments; e += 32) {
    const long long off = load_index(offsets, is64, e);
    const long long len = load_index(lens, is64, e);
    hit |= (row >= off && row < off + len);
  }
  return __any_sync(0xFFFFFFFFu, hit);
}

// Sum of the segment lengths, computed by one warp (every lane gets it).
__device__ __forceinline__ long long warp_sum_lengths(const void* lens, bool is64, int num_segments) {
  long long s = 0;
  for (int e = int(threadIdx.x & 31); e < num_segments; e += 32) s += load_index(lens, is64, e);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, m);
  return s;
}

}  // namespace moe_fp4
