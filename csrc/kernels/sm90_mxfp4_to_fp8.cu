// Direct MXFP4 -> FP8 conversions (formats.convert):
//   FP4RowToFP8Row: one warp per row, half an MX block (8 packed bytes in, one 16-byte store out) per
//     lane and item; the E4M3 byte of each E2M1 code comes from a byte permute over a small remap
//     table indexed by the block's shift below the group's largest scale (no float arithmetic).
//   FP4RowToFP8Col: two passes. The first: independent warp tasks of one scale group (<= 128 rows of
//     one expert) times one MX block column (32 hidden columns) over every expert's groups (the group
//     of a task found on the device from the split lengths), writing the FP32 scales, small per-group
//     records of the scale bytes and each row's group. The second: warp tasks of one aligned window of
//     128 tokens times 32 hidden columns convert each row with its group's record and write whole
//     32-byte sectors of the column-major output that no other task touches, whatever the segment
//     boundaries. (Without the scratch buffers, one pass does both with stores at the groups' own
//     unaligned edges.) See the kernels' comments.
#include "sm90_common.cuh"
#include "sm90_launchers.h"

#include <type_traits>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kRowUnroll = 8;  // items (8-byte loads) in flight per lane

struct RemapTable {
  uint32_t word[kRemapRows][2];  // bytes: E4M3 magnitude of E2M1 magnitude code c at shift d
  uint32_t zero[kRemapRows];     // bit c: nonzero code c becomes zero at shift d (an underflow)
};

constexpr RemapTable make_remap_table() {
  RemapTable t{};
  for (int d = 0; d < kRemapRows; ++d) {
    const int shift = d < kRemapRows - 1 ? d : 64;
    t.word[d][0] = remap_word(shift, 0);
    t.word[d][1] = remap_word(shift, 1);
    uint32_t z = 0;
    for (int c = 1; c < 8; ++c) z |= (e4m3_of_shifted_e2m1(c, shift) == 0u ? 1u : 0u) << c;
    t.zero[d] = z;
  }
  return t;
}

__constant__ RemapTable kRemap = make_remap_table();

// FP32 scale of a group from its largest UE8M0 byte: 2^(emax - 127 - 6) (subnormal below emax 7).
__device__ __forceinline__ float group_scale(uint32_t emax) {
  if (emax == kUe8m0Nan) return __uint_as_float(kFloatNanBits);
  return __uint_as_float(emax >= 7u ? (emax - 6u) << 23 : 1u << (emax + 16u));
}

// 8 packed bytes (16 E2M1 codes) of a row.
template <bool kVec8>
__device__ __forceinline__ uint2 load_packed8(const uint8_t* p) {
  if constexpr (kVec8) {
    return __ldcs(reinterpret_cast<const uint2*>(p));
  } else {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
    return make_uint2(__ldcs(q), __ldcs(q + 1));
  }
}

// Eight E2M1 codes (one word) -> eight E4M3 bytes (two words) through the remap row (lo, hi).
__device__ __forceinline__ void remap8(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& out0, uint32_t& out1) {
  const uint32_t sel = w & 0x77777777u;
  out0 = __byte_perm(lo, hi, sel) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x1100));
  out1 = __byte_perm(lo, hi, sel >> 16) | nibble_signs_to_bytes(__byte_perm(w, 0, 0x3322));
}

__device__ __forceinline__ uint32_t count_underflow(uint32_t w, uint32_t zero_mask) {
  uint32_t n = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) n += (zero_mask >> ((w >> (4 * i)) & 7u)) & 1u;
  return n;
}

template <bool kVec8>
__global__ void __launch_bounds__(kThreads) sm90_mxfp4_to_fp8_rows_kernel(const Mxfp4ToFp8RowsParams p) {
  __shared__ RemapTable remap;
  for (int i = threadIdx.x; i < kRemapRows; i += kThreads) {
    remap.word[i][0] = kRemap.word[i][0];
    remap.word[i][1] = kRemap.word[i][1];
    remap.zero[i] = kRemap.zero[i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  // An item is half an MX block: 8 packed bytes in, 16 E4M3 bytes out (one 16-byte store per lane,
  // contiguous over the warp); 8 items per FP8 group.
  const int items = p.hidden / 16;
  const int groups = p.hidden / kFp8Group;
  const Segments& seg = p.segments;
  const long long covered =
      (seg.lens != nullptr && seg.offsets == nullptr) ? warp_sum_lengths(seg.lens, seg.is64, seg.num) : p.rows;
  unsigned long long underflow = 0;
  for (long long row = warp; row < p.rows; row += num_warps) {
    uint8_t* orow = p.out + row * p.hidden;
    float* srow = p.out_scales + row * groups;
    const bool in_segment =
        seg.lens == nullptr || warp_row_in_segments(row, seg.lens, seg.offsets, seg.is64, seg.num, covered);
    if (!in_segment) {  // rows outside every segment: zero data and zero scales
      for (int item = lane; item < items; item += 32) reinterpret_cast<uint4*>(orow)[item] = make_uint4(0, 0, 0, 0);
      for (int g = lane; g < groups; g += 32) srow[g] = 0.0f;
      continue;
    }
    const uint8_t* prow = p.packed + row * p.packed_stride;
    const uint8_t* scrow = p.scales + row * p.scales_stride;
    // kFull: every item of the pass lies in the row (no bounds checks).
    auto pass = [&](int base, auto full) {
      constexpr bool kFull = decltype(full)::value;
      uint2 raw[kRowUnroll];
      uint32_t s4[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (kFull || item < items) {
          raw[u] = load_packed8<kVec8>(prow + item * 8);
          s4[u] = __ldg(reinterpret_cast<const uint32_t*>(scrow + (item >> 3) * 4));  // the group's 4 scales
        } else {
          raw[u] = make_uint2(0, 0);
          s4[u] = 0;
        }
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (!kFull && item >= items) continue;
        const uint32_t m = max_u16x2(s4[u] & 0x00FF00FFu, (s4[u] >> 8) & 0x00FF00FFu);
        const uint32_t emax = max(m & 0xFFFFu, m >> 16);  // the group's largest scale byte
        uint4 o = make_uint4(0, 0, 0, 0);  // NaN group: zero data
        if (emax != kUe8m0Nan) {
          const uint32_t e = (s4[u] >> (8 * ((item >> 1) & 3))) & 0xFFu;
          const uint32_t d = min(emax - e, static_cast<uint32_t>(kRemapRows - 1));
          const uint32_t lo = remap.word[d][0], hi = remap.word[d][1];
          remap8(raw[u].x, lo, hi, o.x, o.y);
          remap8(raw[u].y, lo, hi, o.z, o.w);
          const uint32_t zero_mask = remap.zero[d];
          if (zero_mask != 0u) underflow += count_underflow(raw[u].x, zero_mask) + count_underflow(raw[u].y, zero_mask);
        }
        reinterpret_cast<uint4*>(orow)[item] = o;
      }
    };
    int base = 0;
    for (; base + 32 * kRowUnroll <= items; base += 32 * kRowUnroll) pass(base, std::true_type{});
    if (base < items) pass(base, std::false_type{});
    // The group scales, one per lane: 2^(emax - 127 - 6) of the group's largest scale byte.
    for (int g = lane; g < groups; g += 32) {
      const uint32_t s4 = __ldg(reinterpret_cast<const uint32_t*>(scrow) + g);
      const uint32_t m = max_u16x2(s4 & 0x00FF00FFu, (s4 >> 8) & 0x00FF00FFu);
      srow[g] = group_scale(max(m & 0xFFFFu, m >> 16));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) underflow += __shfl_xor_sync(0xFFFFFFFFu, underflow, m);
  if (lane == 0 && underflow != 0ull) atomicAdd(p.underflow, underflow);
}

// ------------------------------------------------------------------------------------------------
// FP4RowToFP8Col
// ------------------------------------------------------------------------------------------------

constexpr int kTileRows = kFp8Group;     // tokens per tile: one FP8 scale group


// One segment-group prefix pass (a single block): group offsets (output), first row of each segment,
// the rows they cover in all, and for every scale group its first row and row count.
__global__ void __launch_bounds__(1024) sm90_cols_prepare_kernel(const Mxfp4ToFp8ColsParams p) {
  __shared__ long long warp_groups[32], warp_rows[32];
  __shared__ long long carry_groups, carry_rows;
  const Segments& seg = p.segments;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (threadIdx.x == 0) carry_groups = carry_rows = 0;
  __syncthreads();
  for (int start = 0; start < seg.num; start += 1024) {
    const int e = start + threadIdx.x;
    const long long len = e < seg.num ? load_index(seg.lens, seg.is64, e) : 0;
    const long long own_groups = (len + kFp8Group - 1) / kFp8Group;
    long long ng = own_groups, nr = len;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {  // inclusive warp scan
      const long long a = __shfl_up_sync(0xFFFFFFFFu, ng, m), b = __shfl_up_sync(0xFFFFFFFFu, nr, m);
      if (lane >= m) { ng += a; nr += b; }
    }
    if (lane == 31) { warp_groups[wid] = ng; warp_rows[wid] = nr; }
    __syncthreads();
    if (wid == 0) {
      long long g = warp_groups[lane], r = warp_rows[lane];
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
        const long long a = __shfl_up_sync(0xFFFFFFFFu, g, m), b = __shfl_up_sync(0xFFFFFFFFu, r, m);
        if (lane >= m) { g += a; r += b; }
      }
      warp_groups[lane] = g;  // inclusive prefix over warps
      warp_rows[lane] = r;
    }
    __syncthreads();
    const long long goff = carry_groups + (wid > 0 ? warp_groups[wid - 1] : 0) + ng - own_groups;
    const long long roff = carry_rows + (wid > 0 ? warp_rows[wid - 1] : 0) + nr - len;
    if (e < seg.num) {
      const long long first = seg.offsets != nullptr ? load_index(seg.offsets, seg.is64, e) : roff;
      p.group_offsets[e] = goff;
      p.workspace[e] = first;
      for (long long j = 0; j < own_groups && goff + j < p.num_groups; ++j) {
        p.group_rows[2 * (goff + j)] = first + j * kFp8Group;
        p.group_rows[2 * (goff + j) + 1] = min(static_cast<long long>(kFp8Group), len - j * kFp8Group);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_groups += warp_groups[31];
      carry_rows += warp_rows[31];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.group_offsets[seg.num] = carry_groups;
    p.workspace[seg.num] = carry_rows;  // back-to-back segments cover rows [0, this)
  }
}

// Asynchronous global -> shared copies (cp.async): `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// ---- The column kernel proper: independent warp tasks. ----
// A task is one scale group (up to 128 rows of one expert) times one MX block column (32 hidden
// columns, 16 packed bytes per row): 2 KB of packed bytes, copied by cp.async into a warp-private
// stage (two stages per warp: the next task's copy overlaps this task's work) and 128 scale bytes
// loaded into registers one task ahead. Lane (o, tb) = (lane >> 3, lane & 7) owns hidden columns
// 8o .. 8o+7 of the block and rows 8tb .. 8tb+7 and 64+8tb .. 64+8tb+7 of the group. No CTA-wide barrier after the
// prologue, no float arithmetic per element:
//   1. column maxima as 16-bit keys, 4 S + k(c) with S the row's scale byte and k(c) = 4 (ev + 2) +
//      2 mh + 1 for the E2M1 magnitude (1 + mh / 2) 2^ev (a monotone image of the value; code 0 maps
//      to a negative key), reduced over the 8 lanes of a column by shuffles;
//   2. each lane decodes one column's maximum to its exact float32 and takes the FP8 scale byte sb
//      (e4m3_scale_byte, as for any FP8 1x128 group);
//   3. the E4M3 byte of E2M1 code c in a row of scale S is base(c) + 8 (S - sb) whenever that lands
//      in E4M3's normal range (every S - sb in [-5, 10] in the lane, the common case): computed for
//      four columns at once with a byte permute, one subtract and one multiply-add; otherwise a
//      per-element table (subnormal results, underflow, saturated or NaN columns);
//   4. a 4x4 byte transpose per four rows and one 8-byte store per column, lane and half.
constexpr int kColWarps = kThreads / 32;
constexpr int kColHalf = kTileRows * 16;           // packed bytes of one MX block column of a group
constexpr int kColMaxExperts = 1024;               // larger expert counts use the prepare kernel
constexpr int kColKRows = 24;                       // shifts k = S - sb in [-14, 9]
// Shared memory ahead of the expert tables: two stages per warp of kB block columns, then the k table.
__host__ __device__ constexpr int col_smem_fixed(int kB) { return kColWarps * 2 * kB * kColHalf + kColKRows * 8; }
// MX block columns per task of the column kernel and of the second pass's window kernel. Two (64
// columns: a row's 32 packed bytes are one whole sector) was measured slower on an H200 than one:
// the column kernel's doubled stages fit 24 warps per SM instead of 32 (195 vs 192 us, 32 equal
// experts at 32768 tokens), the window kernel's 4 steps per task hid less latency (375 vs 287 us for
// the two passes).
constexpr int kColTaskBlocks = 1;
constexpr int kWriteTaskBlocks = 1;

// E4M3 byte (no sign) of the E2M1 magnitude code c times 2^k: round to nearest even, saturating.
__host__ __device__ constexpr uint32_t e4m3_of_e2m1_times_pow2(int c, int k) {
  if (k <= 6) return e4m3_of_shifted_e2m1(c, 6 - k);
  const int n = c == 0 ? 0 : c == 1 ? 1 : c == 2 ? 2 : c == 3 ? 3 : c == 4 ? 4 : c == 5 ? 6 : c == 6 ? 8 : 12;
  if (n == 0) return 0u;
  long long units = static_cast<long long>(n) << (8 + k);  // value / 2^-9, exact
  if (units >= 448 * 512) return 0x7Eu;
  int e = 1;
  while (units >= 16) {
    units >>= 1;
    ++e;
  }
  return static_cast<uint32_t>((e << 3) | static_cast<int>(units - 8));
}

// PRMT with the sign-replicating selector bit (nibble bit 3), which __byte_perm does not promise.
__device__ __forceinline__ uint32_t prmt_sign(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint32_t max_s16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.s16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Key planes: bytes of k(c) (codes 0..7) and the high byte 0xF0 of code 0 (key 0xF000 + 4 S < 0).
constexpr uint32_t kKeyLo = 0x0B090500u, kKeyHi = 0x13110F0Du, kKeyZeroHigh = 0x000000F0u;
// base(c) - 40 for codes 1..7 (base(c) = E4M3 byte of the code's value times 2^0 minus... see above:
// ((ev + 7) << 3) | (mh << 2)), and 0x80 for code 0 (its result then has bit 7 set and is cleared).
constexpr uint32_t kBaseLo = 0x14100880u, kBaseHi = 0x24201C18u;

// Exact float32 bits of the value with key `key` (> 0): (1 + mh/2) 2^(E - 129), E = key >> 2.
__device__ __forceinline__ uint32_t key_to_float_bits(int key) {
  const uint32_t e = static_cast<uint32_t>(key) >> 2, mh = (static_cast<uint32_t>(key) >> 1) & 1u;
  if (e >= 257u) return kFloatInfBits;  // 2 * 2^128 and more overflow float32, as in the spec
  if (e >= 3u) return ((e - 2u) << 23) | (mh << 22);
  return (2u + mh) << (19u + e);  // subnormal: 2^-128 or 2^-127 times 1 or 1.5
}

// 4x4 byte transpose: r0..r3 are four rows of four bytes; returns the columns in c0..c3.
__device__ __forceinline__ void transpose4x4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t& c0,
                                             uint32_t& c1, uint32_t& c2, uint32_t& c3) {
  const uint32_t t0 = __byte_perm(r0, r1, 0x5140), t1 = __byte_perm(r0, r1, 0x7362);
  const uint32_t t2 = __byte_perm(r2, r3, 0x5140), t3 = __byte_perm(r2, r3, 0x7362);
  c0 = __byte_perm(t0, t2, 0x5410);
  c1 = __byte_perm(t0, t2, 0x7632);
  c2 = __byte_perm(t1, t3, 0x5410);
  c3 = __byte_perm(t1, t3, 0x7632);
}

// Bytes [0, n) of v (n <= 8) to dst, any alignment: one 8-byte store when dst is 8-byte aligned and n
// is 8, else the fewest naturally aligned pieces (the bytes around belong to other segments).
__device__ __forceinline__ void store_bytes8(uint8_t* dst, uint2 v, int n) {
  if (n <= 0) return;
  if (n == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) = v;
    return;
  }
  unsigned long long x = (static_cast<unsigned long long>(v.y) << 32) | v.x;
  int i = 0;
  while (i < n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(dst + i);
    const int left = n - i;
    if ((a & 3) == 0 && left >= 4) {
      *reinterpret_cast<uint32_t*>(dst + i) = static_cast<uint32_t>(x);
      x >>= 32;
      i += 4;
    } else if ((a & 1) == 0 && left >= 2) {
      *reinterpret_cast<uint16_t*>(dst + i) = static_cast<uint16_t>(x);
      x >>= 16;
      i += 2;
    } else {
      dst[i] = static_cast<uint8_t>(x);
      x >>= 8;
      i += 1;
    }
  }
}

// 64 bytes of one output column (8 per lane, lanes tb = 0..7 of an aligned group of 8 consecutive
// lanes; every lane of the warp must call this, it shuffles) to col, any alignment; nvalid: how many
// of the 64 belong to the group (the rest are another segment's). A whole unaligned half is realigned
// across the 8 lanes: lane tb writes the aligned 8-byte word starting inside its chunk (its last r
// bytes, the next lane's first 8 - r), lane 0 also the head before the first boundary and lane 7 the
// tail after the last, both as a few naturally aligned stores.
__device__ __forceinline__ void store_column_half(uint8_t* col, uint2 v, int tb, int nvalid) {
  const int r = static_cast<int>(reinterpret_cast<uintptr_t>(col) & 7);
  const unsigned long long x = (static_cast<unsigned long long>(v.y) << 32) | v.x;
  const unsigned long long nx = __shfl_down_sync(0xFFFFFFFFu, x, 1);
  if (nvalid < 64) {  // the group's last rows: byte ranges, no realignment
    store_bytes8(col + 8 * tb, v, min(8, nvalid - 8 * tb));
    return;
  }
  if (r == 0) {
    *reinterpret_cast<uint2*>(col + 8 * tb) = v;
    return;
  }
  if (tb < 7) {
    const unsigned long long w = (x >> (8 * (8 - r))) | (nx << (8 * r));
    *reinterpret_cast<unsigned long long*>(col + 8 * tb + 8 - r) = w;
  }
  if (tb == 0) {  // bytes 0 .. 7-r of the chunk end the aligned word that holds col: offsets r .. 7
    const int len = 8 - r;
    unsigned long long y = x;
    uint8_t* d = col;
    if (len & 1) {
      *d = static_cast<uint8_t>(y);
      y >>= 8;
      d += 1;
    }
    if (len & 2) {
      *reinterpret_cast<uint16_t*>(d) = static_cast<uint16_t>(y);
      y >>= 16;
      d += 2;
    }
    if (len & 4) *reinterpret_cast<uint32_t*>(d) = static_cast<uint32_t>(y);
  } else if (tb == 7) {  // the last r bytes start the aligned word after the chunk: offsets 0 .. r-1
    unsigned long long y = x >> (8 * (8 - r));
    uint8_t* d = col + 64 - r;
    if (r & 4) {
      *reinterpret_cast<uint32_t*>(d) = static_cast<uint32_t>(y);
      y >>= 32;
      d += 4;
    }
    if (r & 2) {
      *reinterpret_cast<uint16_t*>(d) = static_cast<uint16_t>(y);
      y >>= 16;
      d += 2;
    }
    if (r & 1) *d = static_cast<uint8_t>(y);
  }
}

struct ColTask {  // cnt == 0: no task
  int row0 = 0, g = 0, b = 0, cnt = 0;
};

// kScales (the first pass of the two-pass path): steps 1 and 2 only; the group's scales, its 16-byte
// records (col_records: per 8 hidden columns the scale bytes the second pass converts with, where an
// all-zero column takes the largest byte of its 8, or 5 when all 8 are zero, then their minimum and
// maximum) and, from the tasks of block column 0, each row's group (row_groups).
template <bool kVec16, bool kScales, int kB>
__global__ void __launch_bounds__(kThreads, kB == 1 ? 4 : 3) sm90_mxfp4_to_fp8_cols_kernel(const Mxfp4ToFp8ColsParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kStage = kB * kColHalf;  // packed bytes of one task: kB block columns, each kColHalf bytes
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint8_t* stages = smem + warp * 2 * kStage;
  uint8_t* ktable = smem + kColWarps * 2 * kStage;  // [kColKRows][8] E4M3 magnitudes
  int* goff = reinterpret_cast<int*>(smem + col_smem_fixed(kB));
  const Segments& seg = p.segments;
  const bool table = seg.num <= kColMaxExperts;
  int* first = goff + (seg.num + 1);
  int* lens = first + seg.num;
  __shared__ long long s_covered;
  __shared__ int s_warp_rows[kColWarps], s_warp_groups[kColWarps];
  __shared__ int4 s_next[kColWarps];  // each warp's next task (kept out of registers)

  for (int i = tid; i < kColKRows * 8; i += kThreads) {
    ktable[i] = static_cast<uint8_t>(e4m3_of_e2m1_times_pow2(i & 7, (i >> 3) - 14));
  }
  if (table) {
    // Block-wide exclusive prefix of lengths and group counts over the experts.
    const int per = (seg.num + kThreads - 1) / kThreads;
    const int e0 = min(tid * per, seg.num), e1 = min(e0 + per, seg.num);
    long long rows = 0, groups = 0;
    for (int e = e0; e < e1; ++e) {
      const long long len = load_index(seg.lens, seg.is64, e);
      rows += len;
      groups += (len + kFp8Group - 1) / kFp8Group;
    }
    long long ir = rows, ig = groups;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      const long long a = __shfl_up_sync(0xFFFFFFFFu, ir, m), c = __shfl_up_sync(0xFFFFFFFFu, ig, m);
      if (lane >= m) {
        ir += a;
        ig += c;
      }
    }
    if (lane == 31) {
      s_warp_rows[warp] = static_cast<int>(ir);
      s_warp_groups[warp] = static_cast<int>(ig);
    }
    __syncthreads();
    long long br = 0, bg = 0, tr = 0, tg = 0;
    for (int w = 0; w < kColWarps; ++w) {
      if (w < warp) {
        br += s_warp_rows[w];
        bg += s_warp_groups[w];
      }
      tr += s_warp_rows[w];
      tg += s_warp_groups[w];
    }
    long long r = br + ir - rows, gsum = bg + ig - groups;
    for (int e = e0; e < e1; ++e) {
      const long long len = load_index(seg.lens, seg.is64, e);
      const long long f = seg.offsets != nullptr ? load_index(seg.offsets, seg.is64, e) : r;
      goff[e] = static_cast<int>(gsum);
      first[e] = static_cast<int>(f);
      lens[e] = static_cast<int>(len);
      if (blockIdx.x == 0) p.group_offsets[e] = gsum;
      r += len;
      gsum += (len + kFp8Group - 1) / kFp8Group;
    }
    if (tid == 0) {
      goff[seg.num] = static_cast<int>(tg);
      s_covered = tr;
      if (blockIdx.x == 0) p.group_offsets[seg.num] = tg;
    }
  } else if (tid == 0) {
    s_covered = p.workspace[seg.num];
  }
  __syncthreads();

  const unsigned nb = p.hidden / (kMxBlock * kB);  // task columns: kB MX blocks each
  const unsigned num_tasks = static_cast<unsigned>(p.num_groups) * nb;  // < 2^31 (checked by the launcher)
  // Two scale bytes per row in one load (kB == 2): both pointers' rows 2-byte aligned.
  const bool scales16 = ((reinterpret_cast<uintptr_t>(p.scales) | static_cast<uintptr_t>(p.scales_stride)) & 1) == 0;
  const long long n_out = p.rows;
  const bool out8 = ((n_out & 7) == 0) && ((reinterpret_cast<uintptr_t>(p.out) & 7) == 0);
  const int o = lane >> 3, tb = lane & 7;

  auto locate = [&](unsigned v) {
    ColTask t;
    if (v >= num_tasks) return t;
    t.g = static_cast<int>(v / nb);
    t.b = static_cast<int>(v - static_cast<unsigned>(t.g) * nb);
    if (table) {
      if (t.g >= goff[seg.num]) return t;
      int lo = 0, hi = seg.num - 1;  // the last expert e with goff[e] <= g
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (goff[mid] <= t.g) lo = mid; else hi = mid - 1;
      }
      const int j = t.g - goff[lo];
      t.row0 = first[lo] + j * kFp8Group;
      t.cnt = min(kFp8Group, lens[lo] - j * kFp8Group);
    } else {
      t.row0 = static_cast<int>(p.group_rows[2 * t.g]);
      t.cnt = static_cast<int>(p.group_rows[2 * t.g + 1]);
    }
    return t;
  };
  // cp.async of a task's packed bytes into stage st (rows past cnt zero-filled): kB lanes per row, so
  // that a warp's copy reads whole 32-byte sectors when kB == 2; block column h of the task lands at
  // stage + h * kColHalf, row r at the XOR-swizzled 16-byte slot r ^ ((r >> 3) & 7). Its scale bytes
  // (rows 4 lane .. 4 lane + 3, block column h in sc[h]) are loaded into registers.
  auto issue = [&](const ColTask& t, int st, uint32_t (&sc)[kB]) {
    uint8_t* stage = stages + st * kStage;
#pragma unroll
    for (int h = 0; h < kB; ++h) sc[h] = 0;
    if (t.cnt == 0) return;
    const int h = lane % kB;
    const uint8_t* src0 = p.packed + static_cast<long long>(t.row0 + lane / kB) * p.packed_stride + t.b * 16 * kB + 16 * h;
    const long long step = (32 / kB) * p.packed_stride;
#pragma unroll
    for (int k = 0; k < 4 * kB; ++k) {
      const int r = lane / kB + (32 / kB) * k;
      const bool valid = r < t.cnt;
      const uint8_t* src = valid ? src0 + k * step : p.packed;
      uint8_t* dst = stage + h * kColHalf + (r ^ ((r >> 3) & 7)) * 16;
      if constexpr (kVec16) {
        cp_async16(dst, src, valid);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async4(dst + 4 * j, valid ? src + 4 * j : src, valid);
      }
    }
    const uint8_t* s0 = p.scales + static_cast<long long>(t.row0 + 4 * lane) * p.scales_stride + t.b * kB;
    if (kB == 2 && scales16) {
      uint32_t v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = 4 * lane + j < t.cnt ? static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(s0 + j * p.scales_stride))) : 0u;
      }
      const uint32_t x01 = __byte_perm(v[0], v[1], 0x5140), x23 = __byte_perm(v[2], v[3], 0x5140);
      sc[0] = __byte_perm(x01, x23, 0x5410);
      sc[kB - 1] = __byte_perm(x01, x23, 0x7632);
    } else {
#pragma unroll
      for (int h2 = 0; h2 < kB; ++h2) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (4 * lane + j < t.cnt) sc[h2] |= static_cast<uint32_t>(__ldg(s0 + h2 + j * p.scales_stride)) << (8 * j);
        }
      }
    }
  };

  const unsigned gw = blockIdx.x * kColWarps + warp, nw = gridDim.x * kColWarps;
  ColTask cur = locate(gw);
  uint32_t sc_cur[kB], sc_nxt[kB];
  issue(cur, 0, sc_cur);
  cp_async_commit();
  for (int it = 0; cur.cnt > 0; ++it) {
    const int st = it & 1;
    {
      const ColTask nxt = locate(gw + static_cast<unsigned>(it + 1) * nw);
      issue(nxt, st ^ 1, sc_nxt);
      if (lane == 0) s_next[warp] = make_int4(nxt.row0, nxt.g, nxt.b, nxt.cnt);
    }
    cp_async_commit();
    cp_async_wait_one();
    __syncwarp();
#pragma unroll 1
    for (int hb = 0; hb < kB; ++hb) {
    const uint8_t* stage = stages + st * kStage + hb * kColHalf;
    const uint32_t sc_h = hb == 0 ? sc_cur[0] : sc_cur[kB - 1];
    const int blk = cur.b * kB + hb;  // this MX block column

    // Scale bytes of this lane's 16 rows (word j: rows 64 (j >> 1) + 8tb + 4 (j & 1) + 0..3), and
    // whether any row of the group is NaN.
    uint32_t sw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) sw[j] = __shfl_sync(0xFFFFFFFFu, sc_h, 16 * (j >> 1) + 2 * tb + (j & 1));
    const bool nan_block = __any_sync(0xFFFFFFFFu, ((~sc_h - 0x01010101u) & sc_h & 0x80808080u) != 0u);

    // 1. Column keys.
    uint32_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;
    int smin = 255, smax = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = 64 * (i >> 3) + 8 * tb + ((i & 7) ^ tb);  // physical row
      const uint32_t w = *reinterpret_cast<const uint32_t*>(stage + r * 16 + 4 * o);
      const uint32_t s = (sw[i >> 2] >> (8 * (i & 3))) & 0xFFu;
      const uint32_t sel = w & 0x77777777u;
      if (sel != 0u) {
        smin = min(smin, static_cast<int>(s));
        smax = max(smax, static_cast<int>(s));
      }
      const uint32_t s4 = s * 0x00040004u;
      const uint32_t lo0 = __byte_perm(kKeyLo, kKeyHi, sel), hi0 = __byte_perm(kKeyZeroHigh, 0u, sel);
      const uint32_t sel_hi = __umulhi(sel, 0x10000u);  // sel >> 16 on the multiply pipe (the ALU one is busier)
      const uint32_t lo1 = __byte_perm(kKeyLo, kKeyHi, sel_hi), hi1 = __byte_perm(kKeyZeroHigh, 0u, sel_hi);
      m0 = max_s16x2(m0, __byte_perm(lo0, hi0, 0x5140) + s4);
      m1 = max_s16x2(m1, __byte_perm(lo0, hi0, 0x7362) + s4);
      m2 = max_s16x2(m2, __byte_perm(lo1, hi1, 0x5140) + s4);
      m3 = max_s16x2(m3, __byte_perm(lo1, hi1, 0x7362) + s4);
    }
#pragma unroll
    for (int x = 1; x < 8; x <<= 1) {
      m0 = max_s16x2(m0, __shfl_xor_sync(0xFFFFFFFFu, m0, x));
      m1 = max_s16x2(m1, __shfl_xor_sync(0xFFFFFFFFu, m1, x));
      m2 = max_s16x2(m2, __shfl_xor_sync(0xFFFFFFFFu, m2, x));
      m3 = max_s16x2(m3, __shfl_xor_sync(0xFFFFFFFFu, m3, x));
    }
    // 2. This lane's column tb: its scale byte, written out; then every lane gathers its 8 columns'.
    const uint32_t mm = tb < 2 ? m0 : tb < 4 ? m1 : tb < 6 ? m2 : m3;
    const int key = static_cast<int16_t>(static_cast<uint16_t>(mm >> (16 * (tb & 1))));
    const uint32_t sb = nan_block ? kUe8m0Nan : key > 0 ? e4m3_scale_byte(key_to_float_bits(key)) : 0u;
    const long long col = static_cast<long long>(blk) * kMxBlock + 8 * o + tb;
    p.out_scales[col * p.num_groups + cur.g] = ue8m0_value(sb);
    if constexpr (kScales) {
      // Fill byte of an all-zero column: the largest finite byte of the 8 columns of this o (never
      // 0xFF: the zeros of a NaN column's neighbours stay zeros of sign), 5 if there is none.
      const bool nz = !nan_block && key > 0;
      const bool finite = nz && sb != kUe8m0Nan;
      uint32_t fmax = finite ? sb : 0u, fany = finite ? 1u : 0u;
#pragma unroll
      for (int x = 1; x < 8; x <<= 1) {
        fmax = max(fmax, __shfl_xor_sync(0xFFFFFFFFu, fmax, x));
        fany |= __shfl_xor_sync(0xFFFFFFFFu, fany, x);
      }
      const uint32_t fb = nan_block ? kUe8m0Nan : nz ? sb : (fany != 0u ? fmax : 5u);
      uint32_t fmin = fb, fmx = fb;
#pragma unroll
      for (int x = 1; x < 8; x <<= 1) {
        fmin = min(fmin, __shfl_xor_sync(0xFFFFFFFFu, fmin, x));
        fmx = max(fmx, __shfl_xor_sync(0xFFFFFFFFu, fmx, x));
      }
      uint32_t word = fb << (8 * (tb & 3));  // lanes tb 0..3: columns 0..3's bytes; 4..7: columns 4..7's
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 1);
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 2);
      const uint32_t word_hi = __shfl_xor_sync(0xFFFFFFFFu, word, 4);
      if (tb == 0) {
        const long long rec = static_cast<long long>(cur.g) * (p.hidden / 8) + 4 * blk + o;
        reinterpret_cast<uint4*>(p.col_records)[rec] = make_uint4(word, word_hi, fmin | (fmx << 8), 0u);
      }
      if (blk == 0) {
        for (int r = lane; r < cur.cnt; r += 32) p.row_groups[cur.row0 + r] = cur.g;
      }
    } else {
      const int wsmax = static_cast<int>(__reduce_max_sync(0xFFFFFFFFu, static_cast<unsigned>(smax)));
      // Byte used in the fast formula: an all-zero column (every result zero) takes one that keeps
      // the lane's shifts in range.
      const uint32_t sbc = key > 0 ? sb : static_cast<uint32_t>(max(wsmax - 5, 5));

      if (nan_block) {
        // Every column of the block is NaN: zero data.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint8_t* dst = p.out + (col - tb + j) * n_out + cur.row0;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) store_column_half(dst + 64 * hh, make_uint2(0, 0), tb, cur.cnt - 64 * hh);
        }
      } else {
        uint32_t sbw_lo = 0, sbw_hi = 0, cw_lo = 0, cw_hi = 0;
        int cmin = 255, cmax = 0;
        bool special = false;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t b = __shfl_sync(0xFFFFFFFFu, sb, (lane & ~7) + j);
          const uint32_t c = __shfl_sync(0xFFFFFFFFu, sbc, (lane & ~7) + j);
          special |= b == kUe8m0Nan;
          cmin = min(cmin, static_cast<int>(c));
          cmax = max(cmax, static_cast<int>(c));
          if (j < 4) {
            sbw_lo |= b << (8 * j);
            cw_lo |= (c - 5u) << (8 * j);  // only used when every c >= 5
          } else {
            sbw_hi |= b << (8 * (j - 4));
            cw_hi |= (c - 5u) << (8 * (j - 4));
          }
        }
        const bool fast = !special && cmin >= 5 && cmax - cmin <= 15 && smin + 5 >= cmax && smax + 5 - cmin <= 15;
        const int s_idle = cmax - 5;  // rows whose 8 codes are all zero: any shift in range will do
        const bool aligned = out8 && cur.cnt == kTileRows && ((cur.row0 & 7) == 0);

        // 3. E4M3 bytes of four rows at a time, transposed into the columns' words; 4. stored per half.
        auto row_word = [&](int hh, int t) {  // packed word of row 64 hh + 8 tb + t
          return *reinterpret_cast<const uint32_t*>(stage + (64 * hh + 8 * tb + (t ^ tb)) * 16 + 4 * o);
        };
        auto store_half = [&](int hh, const uint32_t (&out)[8][2]) {
          uint8_t* dst = p.out + (col - tb) * n_out + cur.row0 + 64 * hh;
#pragma unroll
          for (int j = 0; j < 8; ++j, dst += n_out) {
            const uint2 v = make_uint2(out[j][0], out[j][1]);
            if (aligned) {
              *reinterpret_cast<uint2*>(dst + 8 * tb) = v;
            } else {
              store_column_half(dst, v, tb, cur.cnt - 64 * hh);
            }
          }
        };
        if (fast) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            uint32_t out[8][2];
#pragma unroll
            for (int a = 0; a < 2; ++a) {
              uint32_t rlo[4], rhi[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const uint32_t w = row_word(hh, 4 * a + i);
                const uint32_t s = (sw[2 * hh + a] >> (8 * i)) & 0xFFu;
                const uint32_t sel = w & 0x77777777u;
                const uint32_t sg_e = (w << 4) & 0x80808080u, sg_o = w & 0x80808080u;
                const uint32_t srep = (sel != 0u ? s : static_cast<uint32_t>(s_idle)) * 0x01010101u;
                const uint32_t x_lo = srep - cw_lo, x_hi = srep - cw_hi;  // bytes S - sb + 5 in [0, 15]
                const uint32_t r_lo = x_lo * 8u + __byte_perm(kBaseLo, kBaseHi, sel);
                const uint32_t r_hi = x_hi * 8u + __byte_perm(kBaseLo, kBaseHi, __umulhi(sel, 0x10000u));
                rlo[i] = (r_lo & ~prmt_sign(r_lo, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x5140);
                rhi[i] = (r_hi & ~prmt_sign(r_hi, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x7362);
              }
              transpose4x4(rlo[0], rlo[1], rlo[2], rlo[3], out[0][a], out[1][a], out[2][a], out[3][a]);
              transpose4x4(rhi[0], rhi[1], rhi[2], rhi[3], out[4][a], out[5][a], out[6][a], out[7][a]);
            }
            store_half(hh, out);
          }
        } else {
          // Per element through the table (subnormal results, underflow, saturated or NaN columns).
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            uint32_t out[8][2];
#pragma unroll
            for (int a = 0; a < 2; ++a) {
              uint32_t r[2][4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const uint32_t w = row_word(hh, 4 * a + i);
                const int s = static_cast<int>((sw[2 * hh + a] >> (8 * i)) & 0xFFu);
                r[0][i] = r[1][i] = 0u;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                  const uint32_t b = ((j < 4 ? sbw_lo : sbw_hi) >> (8 * (j & 3))) & 0xFFu;
                  const int k = min(max(s - static_cast<int>(b), -14), 9);
                  const uint32_t e = static_cast<uint32_t>(ktable[(k + 14) * 8 + ((w >> (4 * j)) & 7u)]) |
                                     (((w >> (4 * j + 3)) & 1u) << 7);
                  r[j >> 2][i] |= (b == kUe8m0Nan ? 0u : e) << (8 * (j & 3));
                }
              }
              transpose4x4(r[0][0], r[0][1], r[0][2], r[0][3], out[0][a], out[1][a], out[2][a], out[3][a]);
              transpose4x4(r[1][0], r[1][1], r[1][2], r[1][3], out[4][a], out[5][a], out[6][a], out[7][a]);
            }
            store_half(hh, out);
          }
        }
      }
    }
    }  // block columns of the task
    __syncwarp();  // every lane is done with this stage before the next copy into it
    const int4 nx = s_next[warp];
    cur.row0 = nx.x;
    cur.g = nx.y;
    cur.b = nx.z;
    cur.cnt = nx.w;
#pragma unroll
    for (int h = 0; h < kB; ++h) sc_cur[h] = sc_nxt[h];
  }
  asm volatile("cp.async.wait_all;\n" ::);
  if constexpr (kScales) return;  // the second pass writes every output byte

  // Columns of rows outside every segment are zero.
  const long long covered = s_covered;
  if (seg.offsets == nullptr && covered >= p.rows) return;
  const long long gwarp = (static_cast<long long>(blockIdx.x) * kThreads + tid) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  for (long long row = gwarp; row < p.rows; row += num_warps) {
    if (warp_row_in_segments(row, seg.lens, seg.offsets, seg.is64, seg.num, covered)) continue;
    for (int h = lane; h < p.hidden; h += 32) p.out[static_cast<long long>(h) * n_out + row] = 0;
  }
}

// ---- Second pass of the two-pass path: whole aligned output windows. ----
// A task is one window of 128 tokens [128 w, 128 w + 128) times kB MX block columns (32 kB hidden
// columns); the tasks of a window own every byte of its output columns (the rows of any number of
// scale groups and experts, and rows outside every segment, which become zero), so with N a multiple
// of 32 every store fills whole 32-byte sectors that no other task writes. Lane (o, tb) = (lane % 4kB,
// lane / 4kB) converts the 8 hidden columns 8 (4kB bp + o) .. +7 of 8 rows per step (rows 8 (32 / 4kB)
// hh + 8 tb .. +7 of the window), each row with its own group's record from the first pass: E4M3 byte
// = base(c) + 8 (S - sb + 5) - 40 per column (the first pass's step 3) when every row of the step has
// its shifts in range, else the per-element table; 4x4 byte transposes and one 8-byte store per column
// and step. With kB == 2 the 8 lanes of a row read its 32 packed bytes (one sector) and the 4 lanes of
// a column write 32 consecutive output bytes (one sector). A step's 8 rows take the records of the
// groups of its first and last rows (two loads; rows of a third group, possible only with groups
// shorter than 8 rows, load their own). Both steps' loads are issued before either is converted (80
// registers, 24 warps per SM: latency, not bandwidth, bounds this kernel).
template <int kB>
__global__ void __launch_bounds__(kThreads, 3) sm90_cols_write_kernel(const Mxfp4ToFp8ColsParams p) {
  __shared__ uint8_t ktable[kColKRows * 8];  // E4M3 magnitudes of code (i & 7) times 2^((i >> 3) - 14)
  for (int i = threadIdx.x; i < kColKRows * 8; i += kThreads) {
    ktable[i] = static_cast<uint8_t>(e4m3_of_e2m1_times_pow2(i & 7, (i >> 3) - 14));
  }
  __syncthreads();
  constexpr int kOct = 4 * kB;                 // 8-column groups per task
  constexpr int kTb = 32 / kOct;               // lanes per column: 8-row slices per step
  constexpr int kSteps = kTileRows / (8 * kTb);
  const int lane = threadIdx.x & 31, o = lane % kOct, tb = lane / kOct;
  const int nbp = p.hidden / (kMxBlock * kB);
  const long long n = p.rows;
  const long long tasks = ((n + kTileRows - 1) / kTileRows) * nbp;
  const long long gw = (static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  const uint4* records = reinterpret_cast<const uint4*>(p.col_records);
  const long long rec_stride = p.hidden / 8;
  const uint4 outside = make_uint4(0x05050505u, 0x05050505u, 0x0505u, 0u);  // rows outside: zero codes
  auto record = [&](int g, long long c8) { return g >= 0 ? __ldg(records + g * rec_stride + c8) : outside; };
  for (long long t = gw; t < tasks; t += num_warps) {
    // Last windows first: the rows the first pass read last (the last groups) may still be in the L2.
    const long long v = tasks - 1 - t;
    const long long w = v / nbp;
    const int bp = static_cast<int>(v - w * nbp);
    const long long c8 = static_cast<long long>(kOct) * bp + o;  // this lane's 8-column group
    const int blk = static_cast<int>(c8 >> 2);                    // its MX block column
    // Every step's packed words, scale bytes and row groups are loaded before any step is converted:
    // 2 kSteps x 8 loads in flight per lane.
    uint32_t wd_all[kSteps][8], sv_all[kSteps][8];
    int grp_all[kSteps][8];
#pragma unroll
    for (int hh = 0; hh < kSteps; ++hh) {
      const long long row0 = w * kTileRows + 8 * kTb * hh + 8 * tb;  // this lane's 8 rows: row0 .. row0 + 7
      // Row groups (-1 outside every segment and past N: the array is padded to whole windows).
      const int4 ga = *reinterpret_cast<const int4*>(p.row_groups + row0);
      const int4 gb = *reinterpret_cast<const int4*>(p.row_groups + row0 + 4);
      grp_all[hh][0] = ga.x, grp_all[hh][1] = ga.y, grp_all[hh][2] = ga.z, grp_all[hh][3] = ga.w;
      grp_all[hh][4] = gb.x, grp_all[hh][5] = gb.y, grp_all[hh][6] = gb.z, grp_all[hh][7] = gb.w;
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // rows below N exist (their group is read meanwhile)
        const long long row = row0 + i;
        wd_all[hh][i] = sv_all[hh][i] = 0u;
        if (row < n) {
          wd_all[hh][i] = __ldg(reinterpret_cast<const uint32_t*>(p.packed + row * p.packed_stride + 4 * c8));
          sv_all[hh][i] = __ldg(p.scales + row * p.scales_stride + blk);
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < kSteps; ++hh) {
      const long long row0 = w * kTileRows + 8 * kTb * hh + 8 * tb;
      uint32_t(&wd)[8] = wd_all[hh];
      uint32_t(&sv)[8] = sv_all[hh];
      const int(&grp)[8] = grp_all[hh];
      const uint4 rec_a = record(grp[0], c8);
      const uint4 rec_b = grp[7] != grp[0] ? record(grp[7], c8) : rec_a;
      // A row's record: its group is the first or the last row's, or (groups shorter than 8 rows) its own.
      auto rec_of = [&](int i) {
        return grp[i] == grp[0] ? rec_a : grp[i] == grp[7] ? rec_b : record(grp[i], c8);
      };
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (grp[i] < 0) wd[i] = sv[i] = 0u;  // rows outside every segment: zero codes
      }
      // Fast formula valid for every row: the record's bytes in [5, 254] within 15 of each other, and
      // S - byte + 5 in [0, 15] for each byte of a row with a nonzero code (all-zero rows take S =
      // max - 5, which puts every shift in range).
      bool fast = true;
      uint32_t s_use[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t rz = rec_of(i).z, mn = rz & 0xFFu, mx = (rz >> 8) & 0xFFu;
        const bool nonzero_row = (wd[i] & 0x77777777u) != 0u;
        fast = fast && mx != kUe8m0Nan && mn >= 5u && mx - mn <= 15u &&
               (!nonzero_row || (sv[i] + 5u >= mx && sv[i] + 5u - mn <= 15u));
        s_use[i] = nonzero_row ? sv[i] : mx - 5u;
      }
      uint32_t out[8][2];
      if (fast) {
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          uint32_t rlo[4], rhi[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int i = 4 * a + q;
            const uint32_t wv = wd[i], sel = wv & 0x77777777u;
            const uint32_t sg_e = (wv << 4) & 0x80808080u, sg_o = wv & 0x80808080u;
            const uint32_t srep = s_use[i] * 0x01010101u;
            const uint4 rec = rec_of(i);
            const uint32_t x_lo = srep - (rec.x - 0x05050505u);  // bytes S - sb + 5 in [0, 15]
            const uint32_t x_hi = srep - (rec.y - 0x05050505u);
            const uint32_t r_lo = x_lo * 8u + __byte_perm(kBaseLo, kBaseHi, sel);
            const uint32_t r_hi = x_hi * 8u + __byte_perm(kBaseLo, kBaseHi, sel >> 16);
            rlo[q] = (r_lo & ~prmt_sign(r_lo, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x5140);
            rhi[q] = (r_hi & ~prmt_sign(r_hi, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x7362);
          }
          transpose4x4(rlo[0], rlo[1], rlo[2], rlo[3], out[0][a], out[1][a], out[2][a], out[3][a]);
          transpose4x4(rhi[0], rhi[1], rhi[2], rhi[3], out[4][a], out[5][a], out[6][a], out[7][a]);
        }
      } else {
        // Per element through the table (subnormal results, underflow, saturated or NaN columns).
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          uint32_t r[2][4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int i = 4 * a + q;
            const uint32_t wv = wd[i];
            const int s = static_cast<int>(sv[i]);
            const uint4 rec = rec_of(i);
            r[0][q] = r[1][q] = 0u;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const uint32_t bj = ((j < 4 ? rec.x : rec.y) >> (8 * (j & 3))) & 0xFFu;
              const int k = min(max(s - static_cast<int>(bj), -14), 9);
              const uint32_t e = static_cast<uint32_t>(ktable[(k + 14) * 8 + ((wv >> (4 * j)) & 7u)]) |
                                 (((wv >> (4 * j + 3)) & 1u) << 7);
              r[j >> 2][q] |= (bj == kUe8m0Nan ? 0u : e) << (8 * (j & 3));
            }
          }
          transpose4x4(r[0][0], r[0][1], r[0][2], r[0][3], out[0][a], out[1][a], out[2][a], out[3][a]);
          transpose4x4(r[1][0], r[1][1], r[1][2], r[1][3], out[4][a], out[5][a], out[6][a], out[7][a]);
        }
      }
      const long long left = n - row0;
      if (left > 0) {
        const int cnt = left < 8 ? static_cast<int>(left) : 8;
        uint8_t* dst = p.out + 8 * c8 * n + row0;
#pragma unroll
        for (int j = 0; j < 8; ++j, dst += n) store_bytes8(dst, make_uint2(out[j][0], out[j][1]), cnt);
      }
    }
  }
}

int device_sms() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

template <typename Kernel>
int persistent_grid(Kernel kernel, long long work_blocks, int smem_bytes = 0) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem_bytes);
  const long long cap = static_cast<long long>(device_sms()) * (per_sm > 0 ? per_sm : 1);
  return static_cast<int>(work_blocks < cap ? (work_blocks > 0 ? work_blocks : 1) : cap);
}

}  // namespace

cudaError_t launch_mxfp4_to_fp8_rows(const Mxfp4ToFp8RowsParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.hidden <= 0) return cudaSuccess;
  const bool vec8 = ((p.packed_stride & 7) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 7) == 0);
  // One row per warp and the hardware's block scheduler, not a persistent grid: with 7-8 rows per
  // persistent warp at 32768 tokens the warps holding 8 finished last (H200: 105.6 -> 99.9 us).
  const long long blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
  const int grid = static_cast<int>(blocks < (1LL << 30) ? blocks : (1LL << 30));  // the kernel strides past it
  if (vec8) {
    sm90_mxfp4_to_fp8_rows_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    sm90_mxfp4_to_fp8_rows_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_mxfp4_to_fp8_cols(const Mxfp4ToFp8ColsParams& p, cudaStream_t stream) {
  const bool table = p.segments.num <= kColMaxExperts;
  if (!table || p.rows <= 0 || p.hidden <= 0) sm90_cols_prepare_kernel<<<1, 1024, 0, stream>>>(p);
  if (p.rows <= 0 || p.hidden <= 0) return cudaGetLastError();
  // Task indices and row numbers are 32-bit in the kernel.
  if (p.rows >= (1LL << 31) || p.num_groups * (p.hidden / kMxBlock) >= (1LL << 31)) return cudaErrorInvalidValue;
  const bool two_pass = p.col_records != nullptr && p.row_groups != nullptr;
  const bool vec16 = ((p.packed_stride & 15) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 15) == 0);
  constexpr int kB = kColTaskBlocks, kW = kWriteTaskBlocks;
  const long long tasks = p.num_groups * (p.hidden / (kMxBlock * kB));
  const long long zero_warps = (p.segments.offsets != nullptr && !two_pass) ? p.rows : 0;
  const long long warps = tasks > zero_warps ? tasks : zero_warps;
  const long long blocks = (warps + kColWarps - 1) / kColWarps;
  const int smem = col_smem_fixed(kB) + (table ? 12 * (p.segments.num + 1) : 0);
  auto launch = [&](auto kernel) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<persistent_grid(kernel, blocks, smem), kThreads, smem, stream>>>(p);
  };
  if (!two_pass) {
    if (vec16) launch(sm90_mxfp4_to_fp8_cols_kernel<true, false, kB>);
    else launch(sm90_mxfp4_to_fp8_cols_kernel<false, false, kB>);
    return cudaGetLastError();
  }
  // Pass 1: every row's group (-1 by default) and the groups' scales and records; pass 2: the output.
  const long long windows = (p.rows + kTileRows - 1) / kTileRows;
  cudaError_t err = cudaMemsetAsync(p.row_groups, 0xFF, static_cast<size_t>(windows * kTileRows) * sizeof(int), stream);
  if (err != cudaSuccess) return err;
  if (vec16) launch(sm90_mxfp4_to_fp8_cols_kernel<true, true, kB>);
  else launch(sm90_mxfp4_to_fp8_cols_kernel<false, true, kB>);
  const long long write_blocks = (windows * (p.hidden / (kMxBlock * kW)) + kColWarps - 1) / kColWarps;
  auto write = sm90_cols_write_kernel<kW>;
  write<<<persistent_grid(write, write_blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe_fp4
