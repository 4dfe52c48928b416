// MXFP4 -> BF16 (formats.dequantize_mxfp4 then a cast to bfloat16): one warp per row, 8 elements (4
// packed bytes in, one 16-byte store out) per lane and item, several items in flight per lane. The
// bf16 bits of a code's value come from a byte permute over per-block tables of the 8 exact products
// (E2M1 value times the block scale); a NaN block (scale byte 0xFF) takes the spec's own arithmetic.
#include "sm90_common.cuh"
#include "sm90_device_queries.h"
#include "sm90_launchers.h"

#include <cuda_bf16.h>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__global__ void __launch_bounds__(kThreads) sm90_dequantize_mxfp4_kernel(const DequantizeMxfp4Params p) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const int items = p.hidden / 8;  // 4 items per MX block
  for (long long row = warp; row < p.rows; row += num_warps) {
    const uint32_t* prow = reinterpret_cast<const uint32_t*>(p.packed + row * p.packed_stride);
    const uint8_t* srow = p.scales + row * p.scales_stride;
    uint4* orow = reinterpret_cast<uint4*>(p.out + row * p.hidden);
    for (int base = 0; base < items; base += 32 * kUnroll) {
      uint32_t w[kUnroll], s[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        w[u] = item < items ? __ldcs(prow + item) : 0u;
        s[u] = item < items ? __ldg(srow + (item >> 2)) : 0u;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item >= items) continue;
        uint4 o;
        if (s[u] != kUe8m0Nan) {
          uint32_t hlo, hhi, llo, lhi;
          block_tables(s[u], hlo, hhi, llo, lhi);
          o = dequant8_bf16(w[u], hlo, hhi, llo, lhi);
        } else {  // value times NaN, then the float32 -> bfloat16 conversion, as the spec computes it
          const float nan = __uint_as_float(kFloatNanBits);
          uint32_t h[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            h[i] = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(e2m1_value((w[u] >> (4 * i)) & 15u), nan)));
          }
          o = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
        }
        __stcs(orow + item, o);
      }
    }
  }
}

}  // namespace

cudaError_t launch_dequantize_mxfp4(const DequantizeMxfp4Params& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.hidden <= 0) return cudaSuccess;
  const int sms = sm_count(), per_sm = blocks_per_sm(sm90_dequantize_mxfp4_kernel, kThreads, 0);
  const long long need = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
  const long long cap = static_cast<long long>(sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  sm90_dequantize_mxfp4_kernel<<<static_cast<int>(need < cap ? need : cap), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe_fp4
