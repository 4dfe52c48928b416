// Device queries the launchers need, asked of the runtime once per device and process and kept: a
// launch costs a few microseconds of host time, an occupancy or attribute query about as much again.
// Host code only; thread-safe (std::call_once per device, a mutex around the per-kernel tables).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace moe_fp4 {

constexpr int kMaxQueriedDevices = 64;

// The calling thread's current device, or -1 (the error cleared) when it cannot be told or is past
// kMaxQueriedDevices.
inline int current_device() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return device >= 0 && device < kMaxQueriedDevices ? device : -1;
}

// Attribute kAttr of the current device (0 when the query fails).
template <cudaDeviceAttr kAttr>
int device_attribute() {
  static std::once_flag once[kMaxQueriedDevices];
  static int value[kMaxQueriedDevices];
  const int device = current_device();
  if (device < 0) return 0;
  std::call_once(once[device], [device] {
    if (cudaDeviceGetAttribute(&value[device], kAttr, device) != cudaSuccess) {
      (void)cudaGetLastError();
      value[device] = 0;
    }
  });
  return value[device];
}

inline int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

namespace detail {
struct KernelQuery {
  const void* kernel;
  int device;
  int threads;    // occupancy entries: threads per block; dynamic shared memory entries: -1
  size_t smem;    // occupancy: dynamic shared memory per block; else the largest size allowed so far
  int value;      // occupancy: blocks per SM
};
inline std::mutex& kernel_query_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<KernelQuery>& kernel_queries() {
  static std::vector<KernelQuery> v;
  return v;
}
}  // namespace detail

// Blocks of `kernel` resident on one SM of the current device at `threads` threads and `smem` bytes of
// dynamic shared memory (0 when the query fails; callers take at least 1).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  const int device = current_device();
  if (device < 0) return 0;
  std::lock_guard<std::mutex> lock(detail::kernel_query_mutex());
  for (const detail::KernelQuery& q : detail::kernel_queries()) {
    if (q.kernel == fn && q.device == device && q.threads == threads && q.smem == smem) return q.value;
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;  // not kept: asked again at the next launch
  }
  detail::kernel_queries().push_back({fn, device, threads, smem, per_sm});
  return per_sm;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory on the current device (above the default
// 48 KB: cudaFuncSetAttribute, once per kernel, device and larger size). Returns the runtime's error,
// cleared so that it is not left behind for the next launch check.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  const void* fn = reinterpret_cast<const void*>(kernel);
  const int device = current_device();
  std::lock_guard<std::mutex> lock(detail::kernel_query_mutex());
  detail::KernelQuery* entry = nullptr;
  for (detail::KernelQuery& q : detail::kernel_queries()) {
    if (q.kernel == fn && q.device == device && q.threads == -1) entry = &q;
  }
  if (device >= 0 && entry != nullptr && entry->smem >= smem) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return err;
  }
  if (device >= 0) {
    if (entry != nullptr) {
      entry->smem = smem;
    } else {
      detail::kernel_queries().push_back({fn, device, -1, smem, 0});
    }
  }
  return cudaSuccess;
}

}  // namespace moe_fp4
