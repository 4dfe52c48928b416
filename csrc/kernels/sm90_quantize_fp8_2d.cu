// FP8 blockwise quantization along both axes of a matrix in one pass: the operands of a linear
// layer's real FP8 GEMMs. Each 128x128 tile of x is read once into shared memory and written
//   * rows mode (activations, gradients): row-major with one scale per 1x128 group of a row (what
//     launch_quantize_fp8_blockwise writes) and/or transposed, [K, ld_t], with one scale per 128
//     consecutive entries of a column of x (the wgrad operand: x^T quantized along the tokens; rows
//     of x past M read as zeros, as the spec's zero padding of the token axis);
//   * tiles mode (weights): one scale per 128x128 tile; row-major and, optionally, transposed (the
//     transpose of a tile-quantized matrix is the tile quantization of its transpose: same tiles,
//     same scales).
// Bits as moe_fp4.formats.quantize_fp8_blockwise: scale byte from the group's absolute maximum
// (rounded up, no saturation), elements times the exact inverse power of two, E4M3 round to nearest
// even; a group holding NaN or Inf is zeros with a NaN scale.
#include "sm90_common.cuh"
#include "sm90_launchers.h"

namespace moe_fp4 {
namespace {

constexpr int kTile = 128;
constexpr int kTileThreads = 256;  // 8 warps; a half-warp loads one 128-element row of the tile
constexpr int kRowsPerThread = kTile / (kTileThreads / 16);  // 8 tile rows per half-warp
constexpr int kColQuarters = kTileThreads / (kTile / 2);     // column phase: 64 column pairs x 4 row quarters
constexpr int kQuarterRows = kTile / kColQuarters;           // 32

// 8 consecutive elements (one 16-byte load for bfloat16, two for float32) as float32 (exact).
template <typename E>
struct Eight {
  uint4 raw[sizeof(E) / 2];

  __device__ __forceinline__ void load(const E* src) {
#pragma unroll
    for (int i = 0; i < int(sizeof(E) / 2); ++i) raw[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < int(sizeof(E) / 2); ++i) raw[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void store(E* dst) const {
#pragma unroll
    for (int i = 0; i < int(sizeof(E) / 2); ++i) reinterpret_cast<uint4*>(dst)[i] = raw[i];
  }
  __device__ __forceinline__ void to_float(float (&f)[8]) const {
    if constexpr (sizeof(E) == 4) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = __uint_as_float(w[i]);
    } else {
      const uint32_t w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // bfloat16 -> float32: the upper half of the word
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    }
  }
};

// Two adjacent elements of a shared-memory tile row as float32.
__device__ __forceinline__ void pair_to_float(const uint16_t* p, float& a, float& b) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xFFFF0000u);
}
__device__ __forceinline__ void pair_to_float(const float* p, float& a, float& b) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  a = v.x;
  b = v.y;
}

// Bits of |v| ordered as unsigned integers: NaN and Inf sort above every finite value.
__device__ __forceinline__ uint32_t magnitude_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// E4M3 bytes of v * 2^(127 - sbyte) for 4 consecutive values (zeros for a NaN/Inf group).
__device__ __forceinline__ uint32_t encode4(const float* v, uint32_t sbyte) {
  if (sbyte == kUe8m0Nan) return 0u;
  const float inv = ue8m0_inverse(sbyte);
  return e4m3x4(__fmul_rn(v[0], inv), __fmul_rn(v[1], inv), __fmul_rn(v[2], inv), __fmul_rn(v[3], inv));
}

template <typename E, bool kTiles>
__global__ void __launch_bounds__(kTileThreads, sizeof(E) == 2 ? 4 : 2) sm90_quantize_fp8_2d_kernel(const QuantizeFp8TwoAxisParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  E* tile = reinterpret_cast<E*>(smem_raw);                                      // [128][128]
  uint32_t* col_amax = reinterpret_cast<uint32_t*>(tile + kTile * kTile);       // [4][128]
  uint32_t* warp_amax = col_amax + kColQuarters * kTile;                         // [8]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int half = lane >> 4, item = lane & 15;
  const long long m0 = static_cast<long long>(blockIdx.y) * kTile;
  const long long k0 = static_cast<long long>(blockIdx.x) * kTile;
  const long long groups = p.cols / kTile;
  const E* x = static_cast<const E*>(p.x);

  Eight<E> v[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const long long m = m0 + warp * 16 + 2 * i + half;
    if (m < p.rows) {
      v[i].load(x + m * p.x_stride + k0 + item * 8);
    } else {
      v[i].zero();
    }
  }

  // Row-major copy (rows mode: one scale per row of the tile; tiles mode: after the tile maximum).
  uint32_t tile_max = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = warp * 16 + 2 * i + half;
    float f[8];
    v[i].to_float(f);
    uint32_t amax = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = max(amax, magnitude_bits(f[j]));
    if constexpr (kTiles) {
      tile_max = max(tile_max, amax);
    } else {
#pragma unroll
      for (int s = 1; s < 16; s <<= 1) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, s));
      const long long m = m0 + r;
      if (p.out != nullptr && m < p.rows) {
        const uint32_t sbyte = e4m3_scale_byte(amax);
        *reinterpret_cast<uint2*>(p.out + m * p.cols + k0 + item * 8) = make_uint2(encode4(f, sbyte), encode4(f + 4, sbyte));
        if (item == 0) p.out_scales[m * groups + blockIdx.x] = ue8m0_value(sbyte);
      }
    }
    v[i].store(tile + r * kTile + item * 8);
  }

  uint32_t tile_byte = 0;
  if constexpr (kTiles) {
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) tile_max = max(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, s));
    if (lane == 0) warp_amax[warp] = tile_max;
    __syncthreads();
    uint32_t amax = 0;
#pragma unroll
    for (int w = 0; w < kTileThreads / 32; ++w) amax = max(amax, warp_amax[w]);
    tile_byte = e4m3_scale_byte(amax);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const long long m = m0 + warp * 16 + 2 * i + half;
      float f[8];
      v[i].to_float(f);
      *reinterpret_cast<uint2*>(p.out + m * p.cols + k0 + item * 8) = make_uint2(encode4(f, tile_byte), encode4(f + 4, tile_byte));
    }
    if (threadIdx.x == 0) p.out_scales[blockIdx.y * groups + blockIdx.x] = ue8m0_value(tile_byte);
  }
  if (p.out_t == nullptr) return;  // the same for the whole block
  __syncthreads();

  // Transposed copy: thread (pair, quarter) takes columns 2*pair and 2*pair+1 over 32 rows, reading
  // the tile twice (the maxima, then the values to encode) to keep few values live.
  const int pair = threadIdx.x & (kTile / 2 - 1), quarter = threadIdx.x / (kTile / 2);
  const E* src = tile + quarter * kQuarterRows * kTile + 2 * pair;
  uint32_t b0 = tile_byte, b1 = tile_byte;
  if constexpr (!kTiles) {
    uint32_t a0 = 0, a1 = 0;
#pragma unroll 8
    for (int j = 0; j < kQuarterRows; ++j) {
      float f0, f1;
      pair_to_float(src + j * kTile, f0, f1);
      a0 = max(a0, magnitude_bits(f0));
      a1 = max(a1, magnitude_bits(f1));
    }
    col_amax[quarter * kTile + 2 * pair] = a0;
    col_amax[quarter * kTile + 2 * pair + 1] = a1;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < kColQuarters; ++q) {
      a0 = max(a0, col_amax[q * kTile + 2 * pair]);
      a1 = max(a1, col_amax[q * kTile + 2 * pair + 1]);
    }
    b0 = e4m3_scale_byte(a0);
    b1 = e4m3_scale_byte(a1);
  }
  const long long col = k0 + 2 * pair;
  uint8_t* dst0 = p.out_t + col * p.ld_t + m0 + quarter * kQuarterRows;
  uint8_t* dst1 = dst0 + p.ld_t;
#pragma unroll
  for (int h = 0; h < kQuarterRows / 16; ++h) {
    float c0[16], c1[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) pair_to_float(src + (16 * h + j) * kTile, c0[j], c1[j]);
    reinterpret_cast<uint4*>(dst0)[h] = make_uint4(encode4(c0, b0), encode4(c0 + 4, b0), encode4(c0 + 8, b0), encode4(c0 + 12, b0));
    reinterpret_cast<uint4*>(dst1)[h] = make_uint4(encode4(c1, b1), encode4(c1 + 4, b1), encode4(c1 + 8, b1), encode4(c1 + 12, b1));
  }
  if constexpr (!kTiles) {
    if (quarter == 0) {
      const long long per_col = p.ld_t / kTile;
      p.out_t_scales[col * per_col + blockIdx.y] = ue8m0_value(b0);
      p.out_t_scales[(col + 1) * per_col + blockIdx.y] = ue8m0_value(b1);
    }
  }
}

template <typename E, bool kTiles>
cudaError_t launch_2d(const QuantizeFp8TwoAxisParams& p, dim3 grid, cudaStream_t stream) {
  auto kernel = sm90_quantize_fp8_2d_kernel<E, kTiles>;
  const size_t smem = sizeof(E) * kTile * kTile + sizeof(uint32_t) * (kColQuarters * kTile + kTileThreads / 32);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kTileThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_fp8_2d(const QuantizeFp8TwoAxisParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.cols <= 0) return cudaSuccess;
  const long long row_tiles = (p.rows + kTile - 1) / kTile;
  if (p.cols % kTile != 0 || row_tiles > 65535 || (p.x_type != FloatInput::kBFloat16 && p.x_type != FloatInput::kFloat32) ||
      (p.tiles && (p.rows % kTile != 0 || p.out == nullptr || p.out_scales == nullptr)) ||
      (p.out != nullptr && p.out_scales == nullptr) ||
      (p.out_t != nullptr && (p.ld_t != row_tiles * kTile || (!p.tiles && p.out_t_scales == nullptr)))) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(p.cols / kTile), static_cast<unsigned>(row_tiles));
  if (p.x_type == FloatInput::kBFloat16) {
    return p.tiles ? launch_2d<uint16_t, true>(p, grid, stream) : launch_2d<uint16_t, false>(p, grid, stream);
  }
  return p.tiles ? launch_2d<float, true>(p, grid, stream) : launch_2d<float, false>(p, grid, stream);
}

}  // namespace moe_fp4
