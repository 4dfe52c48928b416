// The expert-parallel dispatch's routing tables, built on the device by counting (no sort, no host
// work): the sender's send order and count rows (send_layout) and the receiver's expert-order tables
// (expand_layout). moe_fp4.ops.routing holds the torch reference both are tested against.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90_device_queries.h"
#include "sm90_launchers.h"

namespace moe_fp4 {
namespace {

constexpr int kSendThreads = 256;     // tokens per tile of the send layout (a thread per token; small
                                      // tiles: more blocks to hide the latency of each token's loads)
constexpr int kExpandThreads = 256;   // 8 warps per tile of the expand layout
constexpr int kExpandWarps = kExpandThreads / 32;
constexpr int kExpandPerWarp = 128;   // entries per warp: 4 rounds of 32, in entry order (short
                                      // warp chains: the rounds run one after the other)
constexpr int kExpandRounds = kExpandPerWarp / 32;
constexpr int kExpandTile = kExpandWarps * kExpandPerWarp;
static_assert(kMaxExpandEntries <= INT32_MAX - 2LL * kExpandTile, "the entry indices are 32-bit");
constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ __forceinline__ long long load_index(const void* p, bool is64, long long i) {
  return is64 ? static_cast<const long long*>(p)[i] : static_cast<long long>(static_cast<const int*>(p)[i]);
}

__device__ __forceinline__ uint32_t weight_bits(const void* w, FloatInput type, long long i) {
  if (w == nullptr) return 0u;
  float v;
  switch (type) {
    case FloatInput::kFloat32: v = static_cast<const float*>(w)[i]; break;
    case FloatInput::kBFloat16: v = __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16); break;
    default: v = __half2float(static_cast<const __half*>(w)[i]);
  }
  return __float_as_uint(v);
}

// Per-tile statistics of the send layout, one int32 row of send_tile_width ints per tile:
// [E expert counts | W*k slot counts (rank-major) | W rank counts | invalid ids].
__host__ __device__ __forceinline__ long long send_tile_width(int e, int w, int k) {
  return static_cast<long long>(e) + static_cast<long long>(w) * k + w + 1;
}

// Pass 1: each tile counts its tokens per destination rank, its (token, slot) pairs per expert and per
// (rank, slot), its invalid ids, and keeps each token's set of destination ranks as a bit mask.
__global__ void __launch_bounds__(kSendThreads) sm90_send_layout_count_kernel(SendLayoutParams p) {
  extern __shared__ int s_stats[];
  const int e_all = p.num_experts, w = p.world_size, k = p.topk, per_rank = e_all / w;
  const long long width = send_tile_width(e_all, w, k);
  int* s_slot = s_stats + e_all;
  int* s_rank = s_slot + w * k;
  int* s_inv = s_rank + w;
  for (long long i = threadIdx.x; i < width; i += blockDim.x) s_stats[i] = 0;
  __syncthreads();
  const long long t = static_cast<long long>(blockIdx.x) * kSendThreads + threadIdx.x;
  unsigned long long mask = 0;
  int invalid = 0;
  if (t < p.tokens) {
    for (int j = 0; j < k; ++j) {
      const long long id = load_index(p.topk_idx, p.idx_is64, t * k + j);
      if (id >= 0 && id < e_all) {
        const int r = static_cast<int>(id) / per_rank;
        mask |= 1ull << r;
        atomicAdd(&s_stats[id], 1);
        atomicAdd(&s_slot[r * k + j], 1);
      } else if (id != -1) {
        ++invalid;
      }
    }
    reinterpret_cast<unsigned long long*>(p.scratch)[t] = mask;
  }
  const int lane = threadIdx.x & 31;
  for (int r = 0; r < w; ++r) {
    const unsigned b = __ballot_sync(kFull, (mask >> r) & 1ull);
    if (lane == 0 && b) atomicAdd(&s_rank[r], __popc(b));
  }
  invalid = __reduce_add_sync(kFull, invalid);
  if (lane == 0 && invalid) atomicAdd(s_inv, invalid);
  __syncthreads();
  int* tile = p.scratch + 2 * p.tokens + blockIdx.x * width;
  for (long long i = threadIdx.x; i < width; i += blockDim.x) tile[i] = s_stats[i];
}

// Pass 2: each token's row in each destination's block of the send buffer (blocks by rank, tokens
// ascending within a block: the tile's base from the earlier tiles' counts, then a scan of the tile),
// the send order, the metadata rows, and the count rows exchanged with the peers.
__global__ void __launch_bounds__(kSendThreads) sm90_send_layout_order_kernel(SendLayoutParams p, int tiles) {
  __shared__ long long s_base[kMaxLayoutRanks];
  __shared__ long long s_total[kMaxLayoutRanks];
  __shared__ long long s_start[kMaxLayoutRanks];  // first row of each block laid back to back
  __shared__ int s_warp[kMaxLayoutRanks][32];
  const int e_all = p.num_experts, w = p.world_size, k = p.topk, per_rank = e_all / w;
  const long long width = send_tile_width(e_all, w, k);
  const int* stats = p.scratch + 2 * p.tokens;
  const int rank_col = e_all + w * k;
  if (threadIdx.x < w) {
    long long total = 0, before = 0;
    for (int c = 0; c < tiles; ++c) {
      const int v = stats[c * width + rank_col + threadIdx.x];
      total += v;
      before += c < static_cast<int>(blockIdx.x) ? v : 0;
    }
    s_total[threadIdx.x] = total;
    s_base[threadIdx.x] = before;
  }
  __syncthreads();
  if (threadIdx.x < w) {
    long long offset = 0;
    for (int r = 0; r < static_cast<int>(threadIdx.x); ++r) offset += s_total[r];
    s_base[threadIdx.x] += offset;
    s_start[threadIdx.x] = offset;
  }
  const long long t = static_cast<long long>(blockIdx.x) * kSendThreads + threadIdx.x;
  const bool live = t < p.tokens;
  const unsigned long long mask = live ? reinterpret_cast<const unsigned long long*>(p.scratch)[t] : 0ull;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = 0; r < w; ++r) {
    const unsigned b = __ballot_sync(kFull, (mask >> r) & 1ull);
    if (lane == 0) s_warp[r][warp] = __popc(b);
  }
  __syncthreads();
  if (threadIdx.x < w) {  // exclusive scan over the tile's warps
    int acc = 0;
    for (int i = 0; i < kSendThreads / 32; ++i) {
      const int v = s_warp[threadIdx.x][i];
      s_warp[threadIdx.x][i] = acc;
      acc += v;
    }
  }
  __syncthreads();
  const unsigned below = (1u << lane) - 1u;
  const int meta_width = 2 * k + 1;
  const long long block = p.block_rows;
  for (int r = 0; r < w; ++r) {
    const bool sent = (mask >> r) & 1ull;
    const unsigned b = __ballot_sync(kFull, sent);
    if (!live) continue;
    long long row = -1;
    if (sent) {
      row = s_base[r] + s_warp[r][warp] + __popc(b & below);
      if (block > 0) {  // the token's place in block r, at the block's fixed start
        row -= s_start[r];
        row = row < block ? r * block + row : -1;
      }
    }
    p.rank_table[t * w + r] = row;
    if (row < 0) continue;
    p.send_token[row] = t;
    int* meta = p.meta + row * meta_width;
#pragma unroll 4
    for (int j = 0; j < k; ++j) {
      const long long id = load_index(p.topk_idx, p.idx_is64, t * k + j);
      const bool here = id >= 0 && id < e_all && static_cast<int>(id) / per_rank == r;
      meta[j] = here ? static_cast<int>(id) % per_rank : -1;
      meta[k + j] = static_cast<int>(weight_bits(p.topk_weights, p.weights_type, t * k + j));
    }
    meta[2 * k] = static_cast<int>(t);
  }
  if (block > 0) {  // the unused rows of each block
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (int r = 0; r < w; ++r) {
      const long long used = s_total[r] < block ? s_total[r] : block;
      for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < block - used; i += stride) {
        const long long row = r * block + used + i;
        p.send_token[row] = 0;
        int* meta = p.meta + row * meta_width;
        for (int j = 0; j < k; ++j) {
          meta[j] = -1;
          meta[k + j] = 0;
        }
        meta[2 * k] = -1;
      }
    }
  }
  // the count rows (every block writes the rows r = blockIdx.x, blockIdx.x + gridDim.x, ...)
  for (int r = blockIdx.x; r < w; r += gridDim.x) {
    long long* info = p.info + static_cast<long long>(r) * p.info_width;
    for (int col = threadIdx.x; col < p.info_width; col += blockDim.x) {
      long long v = 0;
      long long src = -1;  // the column of the tile statistics summed into this one
      if (col >= kInfoHeader && col < kInfoHeader + kLayoutHeader) {
        v = p.header[col - kInfoHeader];
      } else if (col == kInfoInvalid) {
        src = width - 1;
      } else if (col == kInfoDropped) {
        v = p.block_rows > 0 && s_total[r] > p.block_rows ? s_total[r] - p.block_rows : 0;
      } else if (col >= kInfoRanks && col < kInfoRanks + w) {
        src = rank_col + (col - kInfoRanks);
      } else if (col >= kInfoRanks + w && col < kInfoRanks + w + per_rank) {
        src = static_cast<long long>(r) * per_rank + (col - kInfoRanks - w);
      } else if (col >= kInfoRanks + w + per_rank && col < kInfoRanks + w + per_rank + k) {
        src = e_all + static_cast<long long>(r) * k + (col - kInfoRanks - w - per_rank);
      }
      if (src >= 0)
        for (int c = 0; c < tiles; ++c) v += stats[c * width + src];
      info[col] = v;
    }
  }
}

// The metadata entry q = (token q / k, slot q % k) of the received rows: its local expert (-1: none),
// or -2 past the last entry.
__device__ __forceinline__ int entry_expert(const ExpandLayoutParams& p, int q) {
  if (q >= p.tokens * p.topk) return -2;  // (the launcher keeps the entries' count below 2^31)
  const int e = p.meta[static_cast<long long>(q / p.topk) * (2 * p.topk + 1) + q % p.topk];
  return e >= 0 && e < p.num_local ? e : -1;
}

// Pass 1: entries per local expert in each tile of kExpandTile (token, slot) entries.
__global__ void __launch_bounds__(kExpandThreads) sm90_expand_layout_count_kernel(ExpandLayoutParams p) {
  extern __shared__ int s_hist[];
  for (int e = threadIdx.x; e < p.num_local; e += blockDim.x) s_hist[e] = 0;
  __syncthreads();
  const int first = blockIdx.x * kExpandTile;
  for (int i = threadIdx.x; i < kExpandTile; i += blockDim.x) {
    const int e = entry_expert(p, first + i);
    if (e >= 0) atomicAdd(&s_hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_local; e += blockDim.x) p.scratch[blockIdx.x * p.num_local + e] = s_hist[e];
}

// Exclusive block scan of one value per thread (kExpandThreads threads); returns the block's total in *total.
__device__ __forceinline__ long long block_exclusive_scan(long long v, long long* s_warps, long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long incl = v;
  for (int d = 1; d < 32; d <<= 1) {
    const long long o = __shfl_up_sync(kFull, incl, d);
    if (lane >= d) incl += o;
  }
  if (lane == 31) s_warps[warp] = incl;
  __syncthreads();
  long long before = 0, all = 0;
  for (int i = 0; i < kExpandWarps; ++i) {
    before += i < warp ? s_warps[i] : 0;
    all += s_warps[i];
  }
  __syncthreads();
  *total = all;
  return before + incl - v;
}

// Pass 2: the rows of each expert start at the aligned prefix of the experts' lengths; within an
// expert the entries keep their order (received token, then slot). Each warp ranks its kExpandPerWarp entries
// round by round (lanes of equal expert matched, the earlier lanes counted), after the tile's warps
// and the earlier tiles.
__global__ void __launch_bounds__(kExpandThreads) sm90_expand_layout_order_kernel(ExpandLayoutParams p, int tiles) {
  extern __shared__ long long s_dyn[];
  __shared__ long long s_warps[kExpandWarps];
  const int num_local = p.num_local;
  long long* s_base = s_dyn;                                           // [L] first row of the tile's entries
  int* s_cur = reinterpret_cast<int*>(s_base + num_local);             // [warps][L] per-warp offsets
  // the warp's entries and their weights' bits, loaded first: one latency, overlapping the prefix work
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k = p.topk, meta_width = 2 * k + 1;
  const int first = blockIdx.x * kExpandTile + warp * kExpandPerWarp;
  int expert[kExpandRounds];
  uint32_t bits[kExpandRounds];
#pragma unroll
  for (int r = 0; r < kExpandRounds; ++r) {
    const int q = first + r * 32 + lane;
    expert[r] = entry_expert(p, q);
    bits[r] = expert[r] != -2 ? static_cast<uint32_t>(p.meta[static_cast<long long>(q / k) * meta_width + k + q % k]) : 0u;
  }
  // lengths and tile prefix of each expert
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    long long total = 0, before = 0;
    for (int c = 0; c < tiles; ++c) {
      const int v = p.scratch[c * num_local + e];
      total += v;
      before += c < static_cast<int>(blockIdx.x) ? v : 0;
    }
    s_base[e] = before;
    s_cur[e] = static_cast<int>(total);  // (lengths parked in warp 0's row until the scan below)
  }
  __syncthreads();
  // each thread scans a run of consecutive experts: aligned starts and plain starts
  const int run = (num_local + kExpandThreads - 1) / kExpandThreads;
  const int e0 = threadIdx.x * run;
  long long aligned_sum = 0, plain_sum = 0;
  for (int e = e0; e < e0 + run && e < num_local; ++e) {
    const long long len = s_cur[e];
    aligned_sum += (len + p.alignment - 1) / p.alignment * p.alignment;
    plain_sum += len;
  }
  long long aligned_total, plain_total;
  long long aligned_start = block_exclusive_scan(aligned_sum, s_warps, &aligned_total);
  long long plain_start = block_exclusive_scan(plain_sum, s_warps, &plain_total);
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.rows_needed != nullptr) *p.rows_needed = aligned_total;
  if (p.gap_rows != nullptr) {  // the gap list's entries past the gaps: num_rows
    for (long long i = aligned_total - plain_total + static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < p.num_gap; i += static_cast<long long>(gridDim.x) * blockDim.x)
      p.gap_rows[i] = p.num_rows;
  }
  // rows past the experts' rows (a capacity above the rows needed)
  for (long long row = aligned_total + static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; row < p.num_rows;
       row += static_cast<long long>(gridDim.x) * blockDim.x) {
    p.expand_row[row] = -1;
    p.expand_slot[row] = -1;
    if (p.row_weights != nullptr) p.row_weights[row] = 0.0f;
  }
  for (int e = e0; e < e0 + run && e < num_local; ++e) {
    const long long len = s_cur[e], aligned = (len + p.alignment - 1) / p.alignment * p.alignment;
    if (blockIdx.x == 0) {
      p.split_lens[e] = len;
      p.split_offsets[e] = aligned_start;
    }
    // the gap rows after expert e (experts split over the blocks); one past the capacity: num_rows
    if (e % gridDim.x == blockIdx.x && aligned > len) {
      const long long gap_first = aligned_start - plain_start;
      for (long long i = len; i < aligned; ++i) {
        const long long row = aligned_start + i;
        if (row < p.num_rows) {
          p.expand_row[row] = -1;
          p.expand_slot[row] = -1;
          if (p.row_weights != nullptr) p.row_weights[row] = 0.0f;
        }
        if (p.gap_rows != nullptr && gap_first + i - len < p.num_gap)
          p.gap_rows[gap_first + i - len] = row < p.num_rows ? row : p.num_rows;
      }
    }
    s_base[e] += aligned_start;
    aligned_start += aligned;
    plain_start += len;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kExpandWarps * num_local; i += blockDim.x) s_cur[i] = 0;
  __syncthreads();
  const unsigned below = (1u << lane) - 1u;
  int* cur = s_cur + warp * num_local;
#pragma unroll
  for (int r = 0; r < kExpandRounds; ++r) {  // the warp's counts per expert
    const int e = expert[r];
    const unsigned same = __match_any_sync(kFull, e);
    if (e >= 0 && (same >> lane) == 1u) cur[e] += __popc(same);  // the group's last lane
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {  // exclusive scan over the warps
    int acc = 0;
    for (int i = 0; i < kExpandWarps; ++i) {
      const int v = s_cur[i * num_local + e];
      s_cur[i * num_local + e] = acc;
      acc += v;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kExpandRounds; ++r) {
    const int q = first + r * 32 + lane;
    const int e = expert[r];
    const unsigned same = __match_any_sync(kFull, e);
    if (e != -2) {
      const int token = q / k, slot = q % k;
      long long row = -1;
      if (e >= 0) {
        row = s_base[e] + cur[e] + __popc(same & below);
        if (row >= p.num_rows) row = -1;
      }
      __syncwarp(same);
      if (e >= 0 && (same >> lane) == 1u) cur[e] += __popc(same);
      p.slot_table[q] = row;
      p.recv_topk_idx[q] = e;
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[q] = __uint_as_float(bits[r]);
      if (slot == 0) p.recv_src_token[token] = p.meta[static_cast<long long>(token) * meta_width + 2 * k];
      if (row >= 0) {
        p.expand_row[row] = token;
        p.expand_slot[row] = slot;
        if (p.row_weights != nullptr) p.row_weights[row] = __uint_as_float(bits[r]);
      }
    }
    __syncwarp();
  }
}

}  // namespace

long long send_layout_scratch_ints(long long tokens, int topk, int num_experts, int world_size) {
  const long long tiles = (tokens + kSendThreads - 1) / kSendThreads;
  return 2 * tokens + tiles * send_tile_width(num_experts, world_size, topk);
}

long long expand_layout_scratch_ints(long long tokens, int topk, int num_local) {
  const long long tiles = (tokens * topk + kExpandTile - 1) / kExpandTile;
  return (tiles > 0 ? tiles : 1) * num_local;
}

cudaError_t launch_send_layout(const SendLayoutParams& p, cudaStream_t stream) {
  const long long tiles = (p.tokens + kSendThreads - 1) / kSendThreads;
  const long long smem = send_tile_width(p.num_experts, p.world_size, p.topk) * sizeof(int);
  if (tiles > 0) {
    const cudaError_t err = allow_dynamic_smem(sm90_send_layout_count_kernel, static_cast<size_t>(smem));
    if (err != cudaSuccess) return err;
    sm90_send_layout_count_kernel<<<static_cast<unsigned>(tiles), kSendThreads, smem, stream>>>(p);
  }
  const int blocks = static_cast<int>(tiles > p.world_size ? tiles : p.world_size);
  sm90_send_layout_order_kernel<<<blocks, kSendThreads, 0, stream>>>(p, static_cast<int>(tiles));
  return cudaGetLastError();
}

cudaError_t launch_expand_layout(const ExpandLayoutParams& p, cudaStream_t stream) {
  const long long tiles = (p.tokens * p.topk + kExpandTile - 1) / kExpandTile;
  if (tiles > 0)
    sm90_expand_layout_count_kernel<<<static_cast<unsigned>(tiles), kExpandThreads, p.num_local * sizeof(int), stream>>>(p);
  const long long smem = p.num_local * (sizeof(long long) + kExpandWarps * sizeof(int));
  const cudaError_t err = allow_dynamic_smem(sm90_expand_layout_order_kernel, static_cast<size_t>(smem));
  if (err != cudaSuccess) return err;
  const unsigned blocks = static_cast<unsigned>(tiles > 0 ? tiles : 1);
  sm90_expand_layout_order_kernel<<<blocks, kExpandThreads, smem, stream>>>(p, static_cast<int>(tiles));
  return cudaGetLastError();
}

}  // namespace moe_fp4
