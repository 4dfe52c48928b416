// Division of 32-bit unsigned integers by an invariant divisor: one high multiply and shifts, for
// kernels that split a CTA index into two coordinates (the division instruction sequence, I2F,
// MUFU.RCP, F2I and a dozen integer operations, stalled each CTA's first warps on the H200).
// Host and device code alike; tests/test_divide_native.py checks it against `/` on the host.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MOE_FP4_HOST_DEVICE __host__ __device__
#else
#define MOE_FP4_HOST_DEVICE
#endif

namespace moe_fp4 {

// The round-up method: with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, for every 32-bit n
// n / d = (t + ((n - t) >> s1)) >> s2, where t = umulhi(n, m), s1 = min(l, 1), s2 = max(l - 1, 0).
struct DivU32 {
  uint32_t m, s1, s2;
};

// d >= 1 (a divisor of 0 gives the identity, never a trap).
inline DivU32 make_div_u32(uint32_t d) {
  if (d == 0u) return {0u, 0u, 0u};
  uint32_t l = 0;
  while (l < 32u && (uint64_t{1} << l) < d) ++l;
  const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1u;
  return {static_cast<uint32_t>(m), l < 1u ? l : 1u, l > 1u ? l - 1u : 0u};
}

MOE_FP4_HOST_DEVICE inline uint32_t umulhi_u32(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

MOE_FP4_HOST_DEVICE inline uint32_t div_u32(uint32_t n, DivU32 v) {
  const uint32_t t = umulhi_u32(n, v.m);
  return (t + ((n - t) >> v.s1)) >> v.s2;
}

}  // namespace moe_fp4
