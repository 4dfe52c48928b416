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
#include "sm90_device_queries.h"
#include "sm90_launchers.h"

namespace moe_fp4 {
namespace {

constexpr int kTile = 128;
constexpr int kTileThreads = 256;  // 8 warps; a half-warp loads one 128-element row of the tile
constexpr int kRowsPerThread = kTile / (kTileThreads / 16);  // 8 tile rows per half-warp
constexpr int kParts = kTileThreads / kTile;                 // column phase: 128 columns x 2 row parts
constexpr int kPartRows = kTile / kParts;                     // 64
constexpr int kStagePitch = kTile + 16;  // bytes per staged row of the transpose: 16-byte stores of 8
                                         // consecutive columns' rows fall in distinct banks

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

// One element of the shared-memory tile as float32 (exact).
__device__ __forceinline__ float to_float(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
__device__ __forceinline__ float to_float(float v) { return v; }

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
  E* tile = reinterpret_cast<E*>(smem_raw);                                 // [128][128]
  uint32_t* col_amax = reinterpret_cast<uint32_t*>(tile + kTile * kTile);  // [2][128]
  uint32_t* warp_amax = col_amax + kParts * kTile;                          // [8]
  uint8_t* staged = reinterpret_cast<uint8_t*>(warp_amax + kTileThreads / 32);  // [128][kStagePitch]

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

  // Transposed copy: thread (c, part) takes column c over rows 64*part .. 64*part+63: the column's
  // maximum, then its E4M3 bytes into a staging tile (one padded row per column), then 8 threads per
  // row store whole 128-byte rows of the transpose.
  const int c = threadIdx.x & (kTile - 1), part = threadIdx.x / kTile;
  const E* src = tile + part * kPartRows * kTile + c;
  uint32_t sbyte = tile_byte;
  if constexpr (!kTiles) {
    uint32_t amax = 0;
#pragma unroll 16
    for (int j = 0; j < kPartRows; ++j) amax = max(amax, magnitude_bits(to_float(src[j * kTile])));
    col_amax[part * kTile + c] = amax;
    __syncthreads();
    sbyte = e4m3_scale_byte(max(col_amax[c], col_amax[kTile + c]));
    if (part == 0) p.out_t_scales[(k0 + c) * (p.ld_t / kTile) + blockIdx.y] = ue8m0_value(sbyte);
  }
  uint8_t* staged_col = staged + c * kStagePitch + part * kPartRows;
#pragma unroll
  for (int h = 0; h < kPartRows / 16; ++h) {
    float f[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) f[j] = to_float(src[(16 * h + j) * kTile]);
    reinterpret_cast<uint4*>(staged_col)[h] =
        make_uint4(encode4(f, sbyte), encode4(f + 4, sbyte), encode4(f + 8, sbyte), encode4(f + 12, sbyte));
  }
  __syncthreads();
  // (with stacked matrices, this tile's rows belong to matrix m0 / t_group_rows: its own transpose)
  uint8_t* out_t = p.out_t;
  long long t_col = m0, ld_t = p.ld_t;
  if (p.t_group_rows > 0) {
    const long long g = m0 / p.t_group_rows;
    out_t += g * p.cols * p.t_group_rows;
    t_col = m0 - g * p.t_group_rows;
    ld_t = p.t_group_rows;
  }
  const int chunk = threadIdx.x & 7;
#pragma unroll
  for (int r = threadIdx.x >> 3; r < kTile; r += kTileThreads / 8) {
    *reinterpret_cast<uint4*>(out_t + (k0 + r) * ld_t + t_col + chunk * 16) =
        *reinterpret_cast<const uint4*>(staged + r * kStagePitch + chunk * 16);
  }
}

template <typename E, bool kTiles>
cudaError_t launch_2d(const QuantizeFp8TwoAxisParams& p, dim3 grid, cudaStream_t stream) {
  auto kernel = sm90_quantize_fp8_2d_kernel<E, kTiles>;
  const size_t smem = sizeof(E) * kTile * kTile + sizeof(uint32_t) * (kParts * kTile + kTileThreads / 32) +
                      size_t(kTile) * kStagePitch;
  const cudaError_t err = allow_dynamic_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kTileThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_fp8_2d(const QuantizeFp8TwoAxisParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.cols <= 0) return cudaSuccess;
  const long long row_tiles = (p.rows + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(p.cols / kTile), static_cast<unsigned>(row_tiles));
  if (p.x_type == FloatInput::kBFloat16) {
    return p.tiles ? launch_2d<uint16_t, true>(p, grid, stream) : launch_2d<uint16_t, false>(p, grid, stream);
  }
  return p.tiles ? launch_2d<float, true>(p, grid, stream) : launch_2d<float, false>(p, grid, stream);
}

}  // namespace moe_fp4
