// NVFP4 byte rows from float rows (the nvfp4 payload of the expert-parallel dispatch), the spec's
// formats.quantize_nvfp4 (1x16 blocks) laid out as formats.pack_nvfp4_rows. Two kernels on the
// caller's stream, no host synchronisation:
//   1. the tensor scale's input: the largest finite |x| of the whole tensor (one warp per row, lane
//      maxima over raw bits, one atomicMax of the float32 bits per warp into a word the launcher
//      clears);
//   2. one warp per row, one 16-element block per lane and item: the block's absolute maximum, its
//      E4M3 scale e4m3(float32(amax_b / (6 * gs))) (the quotient formed in float64 and rounded once
//      to float32, as the spec does), the divisor d = float32(e4m3_value * gs), each element
//      float32(x / d) rounded to E2M1 (nearest even, saturating at 6, sign kept), and the row
//      [H/2 packed | H/16 E4M3 scales | FP32 gs]. A block holding NaN or Inf gets scale 0x7F and
//      zero codes; a block whose d is 0 gets zero codes.
// Every quotient is the IEEE float32 one (a float32 division of float32 operands equals the spec's
// float64 division rounded to float32); the elements get it from the block's reciprocal and two FMAs.
#include "sm90_common.cuh"
#include "sm90_device_queries.h"
#include "sm90_launchers.h"

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kNvfp4Block = 16;
constexpr float kGlobalDenom = 2688.0f;  // 6 * 448, exact in float32
constexpr uint32_t kE4m3Nan = 0x7Fu;
constexpr float kFastMin = 8.673617379884035e-19f;  // 2^-60: block divisors taking the reciprocal path
constexpr float kFastMax = 1.152921504606847e18f;   // 2^60

// Elements of one 16-byte piece of a row.
template <FloatInput kType>
constexpr int kPerVec = kType == FloatInput::kFloat32 ? 4 : 8;

// Lane-wise maximum of the finite |x| bits of one 16-byte piece, in the input's own bit layout
// (two 16-bit lanes for bfloat16/float16, one word for float32).
template <FloatInput kType>
__device__ __forceinline__ uint32_t finite_abs_max(uint4 v, uint32_t m) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kType == FloatInput::kFloat32) {
      const uint32_t a = w[i] & 0x7FFFFFFFu;
      m = a < kFloatInfBits ? max(m, a) : m;
    } else {
      constexpr uint32_t kInf = kType == FloatInput::kBFloat16 ? 0x7F807F80u : 0x7C007C00u;
      const uint32_t a = w[i] & 0x7FFF7FFFu;
      m = max_u16x2(m, a & __vcmpltu2(a, kInf));  // non-finite lanes count as 0
    }
  }
  return m;
}

// float32 bits of a lane maximum from finite_abs_max.
template <FloatInput kType>
__device__ __forceinline__ uint32_t max_to_float_bits(uint32_t m) {
  if constexpr (kType == FloatInput::kFloat32) {
    return m;
  } else if constexpr (kType == FloatInput::kBFloat16) {
    return max(m << 16, m & 0xFFFF0000u);
  } else {
    const uint32_t h = max(m & 0xFFFFu, m >> 16);
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
}

template <FloatInput kType>
__global__ void __launch_bounds__(kThreads) sm90_quantize_nvfp4_rows_amax_kernel(const QuantizeNvfp4RowsParams p) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const int vecs = p.hidden / kPerVec<kType>;
  const size_t row_bytes = static_cast<size_t>(p.x_stride) * (kType == FloatInput::kFloat32 ? 4 : 2);
  uint32_t m = 0;
  for (long long t = warp; t < p.tokens; t += num_warps) {
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const char*>(p.x) + t * row_bytes);
    int v = lane;
    for (; v + 96 < vecs; v += 128) {  // four loads in flight
      const uint4 a = row[v], b = row[v + 32], c = row[v + 64], d = row[v + 96];
      m = finite_abs_max<kType>(d, finite_abs_max<kType>(c, finite_abs_max<kType>(b, finite_abs_max<kType>(a, m))));
    }
    for (; v < vecs; v += 32) m = finite_abs_max<kType>(row[v], m);
  }
  uint32_t bits = max_to_float_bits<kType>(m);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, s));
  if (lane == 0 && bits != 0u) atomicMax(p.amax_bits, bits);
}

// The 16 elements of block b of a row, as float32 (exact for every input type): two items.
template <FloatInput kType>
__device__ __forceinline__ void load_block(const void* row, int b, float (&f)[kNvfp4Block]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint4 raw[2];
    load_item<kType>(row, 2 * b + h, raw);
    item_to_float<kType>(raw, reinterpret_cast<float(&)[8]>(f[8 * h]));
  }
}

// float32 value of an E4M3 code (finite, non-negative: a block scale).
__device__ __forceinline__ float e4m3_value(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// Stores the 8 packed bytes `v` at p with the widest stores its alignment `align` (8, 4 or 1) allows.
__device__ __forceinline__ void store_packed(uint8_t* p, uint2 v, int align) {
  if (align >= 8) {
    *reinterpret_cast<uint2*>(p) = v;
  } else if (align >= 4) {
    reinterpret_cast<uint32_t*>(p)[0] = v.x;
    reinterpret_cast<uint32_t*>(p)[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = static_cast<uint8_t>(v.x >> (8 * i));
      p[4 + i] = static_cast<uint8_t>(v.y >> (8 * i));
    }
  }
}

template <FloatInput kType>
__global__ void __launch_bounds__(kThreads) sm90_quantize_nvfp4_rows_kernel(const QuantizeNvfp4RowsParams p) {
  const int lane = threadIdx.x & 31;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.tokens) return;
  const int blocks = p.hidden / kNvfp4Block;
  const float gs = __fdiv_rn(__uint_as_float(*p.amax_bits), kGlobalDenom);
  const double gs6 = 6.0 * static_cast<double>(gs);  // exact
  const size_t elem = kType == FloatInput::kFloat32 ? 4 : 2;
  const void* xrow = static_cast<const char*>(p.x) + static_cast<size_t>(t) * p.x_stride * elem;
  uint8_t* orow = p.out + t * p.out_stride;
  uint8_t* srow = orow + p.hidden / 2;
  const uintptr_t a = reinterpret_cast<uintptr_t>(orow);
  const int align = (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 1;
  for (int b = lane; b < blocks; b += 32) {
    float f[kNvfp4Block];
    load_block<kType>(xrow, b, f);
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) amax = max(amax, __float_as_uint(f[i]) & 0x7FFFFFFFu);
    uint32_t scale_code;
    uint2 packed = make_uint2(0u, 0u);
    if (amax >= kFloatInfBits) {  // NaN or Inf in the block
      scale_code = kE4m3Nan;
    } else {
      const float bscale =
          gs > 0.0f ? __double2float_rn(__ddiv_rn(static_cast<double>(__uint_as_float(amax)), gs6)) : 0.0f;
      scale_code = e4m3x2(bscale, 0.0f) & 0xFFu;
      const float d = __fmul_rn(e4m3_value(scale_code), gs);
      if (d > 0.0f) {
        uint32_t w[2] = {0u, 0u};
        if (d >= kFastMin && d <= kFastMax) {
          // |x| / d correctly rounded without a division per element (Markstein): with y = RN(1/d)
          // and q0 = RN(|x| y) (within one ulp of |x| / d), the remainder |x| - q0 d is exact in
          // one FMA and q0 + r y rounds to RN(|x| / d). d in [2^-60, 2^60] keeps every step clear
          // of overflow and keeps the remainder normal wherever the quotient is near an E2M1
          // rounding boundary (q >= 1/4); below that every quotient gives code 0 anyway.
          const float y = __frcp_rn(d);
#pragma unroll
          for (int i = 0; i < kNvfp4Block; ++i) {
            const float a = fabsf(f[i]);
            const float q0 = __fmul_rn(a, y);
            const float q = __fmaf_rn(__fmaf_rn(-q0, d, a), y, q0);
            const uint32_t code = e2m1_magnitude(q) | ((__float_as_uint(f[i]) >> 28) & 8u);
            w[i / 8] |= code << (4 * (i % 8));
          }
        } else {
#pragma unroll
          for (int i = 0; i < kNvfp4Block; ++i) {
            const float q = __fdiv_rn(f[i], d);
            const uint32_t code = e2m1_magnitude(fabsf(q)) | ((__float_as_uint(q) >> 28) & 8u);
            w[i / 8] |= code << (4 * (i % 8));
          }
        }
        packed = make_uint2(w[0], w[1]);
      }
    }
    store_packed(orow + b * 8, packed, align);
    srow[b] = static_cast<uint8_t>(scale_code);
  }
  if (lane == 0) {
    const uint32_t g = __float_as_uint(gs);
    uint8_t* gp = srow + blocks;
#pragma unroll
    for (int i = 0; i < 4; ++i) gp[i] = static_cast<uint8_t>(g >> (8 * i));
  }
}

template <FloatInput kType>
cudaError_t launch_typed(const QuantizeNvfp4RowsParams& p, cudaStream_t stream) {
  const int sms = sm_count();
  const long long row_blocks = (p.tokens + kWarps - 1) / kWarps;
  const long long amax_blocks = row_blocks < 8LL * sms ? row_blocks : 8LL * sms;
  sm90_quantize_nvfp4_rows_amax_kernel<kType><<<static_cast<unsigned>(amax_blocks), kThreads, 0, stream>>>(p);
  sm90_quantize_nvfp4_rows_kernel<kType><<<static_cast<unsigned>(row_blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// One warp per row; lane l of a pass takes chunk base + l: 32 elements (16 packed bytes, the scale
// bytes of 2 blocks), 4 consecutive lanes one 1x128 group. Each element is the float32 product of its
// E2M1 value and the block divisor (exact decode), then the group's FP8 1x128 (the spec's rounding).
__global__ void __launch_bounds__(kThreads) sm90_nvfp4_rows_to_fp8_blockwise_kernel(const Nvfp4RowsToFp8BlockwiseParams p) {
  const int lane = threadIdx.x & 31;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= p.tokens) return;
  const uint8_t* row = p.rows + t * p.row_stride;
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(row);
  const uint16_t* block_scales = reinterpret_cast<const uint16_t*>(row + p.hidden / 2);  // 2 per chunk
  const float gs = __ldg(reinterpret_cast<const float*>(row + p.hidden / 2 + p.hidden / 16));
  const int chunks = p.hidden / 32;
  uint4* orow = reinterpret_cast<uint4*>(p.out + t * p.hidden);
  float* srow = p.out_scales + t * (p.hidden / kFp8Group);
  // the next pass's codes and scale bytes are loaded before this pass converts (two passes in flight)
  uint32_t nw[4] = {0u, 0u, 0u, 0u};
  uint32_t nsc = 0u;
  if (lane < chunks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) nw[i] = __ldcs(codes + 4 * lane + i);
    nsc = __ldg(block_scales + lane);
  }
  for (int base = 0; base < chunks; base += 32) {  // chunks is a multiple of 4: a group's lanes all take part
    const int q = base + lane;
    const bool valid = q < chunks;
    const uint32_t w[4] = {nw[0], nw[1], nw[2], nw[3]};
    const uint32_t sc = nsc;
    if (q + 32 < chunks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) nw[i] = __ldcs(codes + 4 * (q + 32) + i);
      nsc = __ldg(block_scales + q + 32);
    }
    const float d0 = __fmul_rn(e4m3_value(sc & 0xFFu), gs), d1 = __fmul_rn(e4m3_value(sc >> 8), gs);
    float f[32];
    uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      f[j] = __fmul_rn(e2m1_value((w[j >> 3] >> (4 * (j & 7))) & 0xFu), j < 16 ? d0 : d1);
      amax = max(amax, __float_as_uint(f[j]) & 0x7FFFFFFFu);
    }
    if (!valid) amax = 0u;
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
    const uint32_t sbyte = e4m3_scale_byte(amax);
    uint32_t o[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};  // NaN/Inf group: zero data, NaN scale
    if (sbyte != kUe8m0Nan) {
      const float inv = ue8m0_inverse(sbyte);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o[k] = e4m3x4(__fmul_rn(f[4 * k], inv), __fmul_rn(f[4 * k + 1], inv), __fmul_rn(f[4 * k + 2], inv),
                      __fmul_rn(f[4 * k + 3], inv));
      }
    }
    if (valid) {
      orow[2 * q] = make_uint4(o[0], o[1], o[2], o[3]);
      orow[2 * q + 1] = make_uint4(o[4], o[5], o[6], o[7]);
      if ((lane & 3) == 0) srow[q >> 2] = ue8m0_value(sbyte);
    }
  }
}

}  // namespace

cudaError_t launch_nvfp4_rows_to_fp8_blockwise(const Nvfp4RowsToFp8BlockwiseParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  const long long blocks = (p.tokens + kWarps - 1) / kWarps;
  sm90_nvfp4_rows_to_fp8_blockwise_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_quantize_nvfp4_rows(const QuantizeNvfp4RowsParams& p, cudaStream_t stream) {
  if (p.tokens <= 0) return cudaSuccess;
  const cudaError_t cleared = cudaMemsetAsync(p.amax_bits, 0, sizeof(uint32_t), stream);
  if (cleared != cudaSuccess) return cleared;
  switch (p.x_type) {
    case FloatInput::kFloat32: return launch_typed<FloatInput::kFloat32>(p, stream);
    case FloatInput::kBFloat16: return launch_typed<FloatInput::kBFloat16>(p, stream);
    case FloatInput::kFloat16: return launch_typed<FloatInput::kFloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace moe_fp4
