// Direct MXFP4 -> FP8 conversions (formats.convert):
//   FP4RowToFP8Row: one warp per row, one MX block (16 packed bytes) per lane and item; the E4M3 byte
//     of each E2M1 code comes from a byte permute over a small remap table indexed by the block's
//     shift below the group's largest scale (no float arithmetic).
//   FP4RowToFP8Col: tiles of 128 tokens x 128 hidden per CTA: dequantize (exact, as bf16) into a
//     swizzled shared-memory tile, then each thread reads 16 tokens of two hidden columns, reduces the
//     column maximum over the 128 tokens with warp shuffles and writes 16 E4M3 bytes per column.
#include "sm90_common.cuh"
#include "sm90_launchers.h"

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kRowUnroll = 4;

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

template <bool kVec16>
__device__ __forceinline__ uint4 load_packed(const uint8_t* p) {
  if constexpr (kVec16) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
  } else {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
    return make_uint4(__ldcs(q), __ldcs(q + 1), __ldcs(q + 2), __ldcs(q + 3));
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

template <bool kVec16>
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
  const int items = p.hidden / kMxBlock;  // 4 items per FP8 group
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
      for (int item = lane; item < items; item += 32) {
        reinterpret_cast<uint4*>(orow + item * 32)[0] = make_uint4(0, 0, 0, 0);
        reinterpret_cast<uint4*>(orow + item * 32)[1] = make_uint4(0, 0, 0, 0);
      }
      for (int g = lane; g < groups; g += 32) srow[g] = 0.0f;
      continue;
    }
    const uint8_t* prow = p.packed + row * p.packed_stride;
    const uint8_t* scrow = p.scales + row * p.scales_stride;
    for (int base = 0; base < items; base += 32 * kRowUnroll) {
      uint4 raw[kRowUnroll];
      uint32_t s4[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item < items) {
          raw[u] = load_packed<kVec16>(prow + item * 16);
          s4[u] = __ldg(reinterpret_cast<const uint32_t*>(scrow + (item >> 2) * 4));  // the group's 4 scales
        } else {
          raw[u] = make_uint4(0, 0, 0, 0);
          s4[u] = 0;
        }
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int item = base + u * 32 + lane;
        if (item >= items) continue;
        uint32_t m = __vmaxu4(s4[u], s4[u] >> 16);
        m = __vmaxu4(m, m >> 8);
        const uint32_t emax = m & 0xFFu;
        uint4 o0 = make_uint4(0, 0, 0, 0), o1 = make_uint4(0, 0, 0, 0);  // NaN group: zero data
        if (emax != kUe8m0Nan) {
          const uint32_t e = (s4[u] >> (8 * (item & 3))) & 0xFFu;
          const uint32_t d = min(emax - e, static_cast<uint32_t>(kRemapRows - 1));
          const uint32_t lo = remap.word[d][0], hi = remap.word[d][1];
          remap8(raw[u].x, lo, hi, o0.x, o0.y);
          remap8(raw[u].y, lo, hi, o0.z, o0.w);
          remap8(raw[u].z, lo, hi, o1.x, o1.y);
          remap8(raw[u].w, lo, hi, o1.z, o1.w);
          const uint32_t zero_mask = remap.zero[d];
          if (zero_mask != 0u) {
            underflow += count_underflow(raw[u].x, zero_mask) + count_underflow(raw[u].y, zero_mask) +
                         count_underflow(raw[u].z, zero_mask) + count_underflow(raw[u].w, zero_mask);
          }
        }
        uint4* dst = reinterpret_cast<uint4*>(orow + item * 32);
        dst[0] = o0;
        dst[1] = o1;
        if ((item & 3) == 0) srow[item >> 2] = group_scale(emax);
      }
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
constexpr int kTileCols = 128;           // hidden columns per tile
constexpr int kTileRowBytes = kTileCols * 2;  // bf16

// Physical 16-byte chunk of logical chunk k (0..15) in tile row r. Phase A writes chunks 4q..4q+3 of
// rows r, r+1 from 8 lanes; phase B reads the same chunk of rows 16 apart from 8 lanes: both touch 8
// distinct 16-byte bank groups.
__device__ __forceinline__ int tile_chunk(int r, int k) {
  return k ^ ((k >> 3) << 1) ^ (((r >> 4) & 7) ^ (r & 1));
}

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

// Bytes [lo, hi) of a 16-byte block held in w[0..3] (byte i of the block in w[i / 4]) to block + lo,
// 0 <= lo <= hi <= 16, with the fewest naturally aligned stores of 8, 4, 2 and 1 bytes (the rest of
// the block belongs to another segment and is written by another thread block).
__device__ __forceinline__ void store_block_range(uint8_t* block, const uint32_t (&w)[4], int lo, int hi) {
  while (lo < hi) {
    const int n = hi - lo;
    const uint32_t word = lo < 4 ? w[0] : lo < 8 ? w[1] : lo < 12 ? w[2] : w[3];
    if ((lo & 7) == 0 && n >= 8) {
      const uint32_t next = lo < 8 ? w[1] : w[3];
      *reinterpret_cast<uint2*>(block + lo) = make_uint2(word, next);
      lo += 8;
    } else if ((lo & 3) == 0 && n >= 4) {
      *reinterpret_cast<uint32_t*>(block + lo) = word;
      lo += 4;
    } else if ((lo & 1) == 0 && n >= 2) {
      *reinterpret_cast<uint16_t*>(block + lo) = static_cast<uint16_t>(word >> (8 * (lo & 3)));
      lo += 2;
    } else {
      block[lo] = static_cast<uint8_t>(word >> (8 * (lo & 3)));
      lo += 1;
    }
  }
}

// 16 E4M3 bytes o (tokens 16tb .. 16tb+15 of one hidden column, `cnt` valid tokens in the group) to
// `row` (the column's first token in the output, any alignment). The 8 lanes of a column are
// consecutive (tb = lane & 7) and every lane must call this (it shuffles). With the column start at
// r bytes past a 16-byte boundary, lane tb writes the aligned block that starts inside its chunk,
// made of its last r bytes and the first 16 - r of lane tb + 1; lane 0 also writes the head before
// the first boundary. Blocks that reach outside [0, cnt) are written byte by byte: they share their
// other bytes with neighbouring segments, written by other blocks.
__device__ __forceinline__ void store_column(uint8_t* row, const uint4& o, int tb, int cnt) {
  uint4 nx;
  nx.x = __shfl_down_sync(0xFFFFFFFFu, o.x, 1);
  nx.y = __shfl_down_sync(0xFFFFFFFFu, o.y, 1);
  nx.z = __shfl_down_sync(0xFFFFFFFFu, o.z, 1);
  nx.w = __shfl_down_sync(0xFFFFFFFFu, o.w, 1);
  uint8_t* mine = row + 16 * tb;
  const int r = static_cast<int>(reinterpret_cast<uintptr_t>(mine) & 15);
  const uint32_t ow[4] = {o.x, o.y, o.z, o.w};
  if (r == 0) {
    const int n = cnt - 16 * tb;
    if (n >= 16) {
      *reinterpret_cast<uint4*>(mine) = o;
    } else if (n > 0) {
      store_block_range(mine, ow, 0, n);
    }
    return;
  }
  if (tb == 0) {  // head: tokens [0, 16 - r) fill bytes r .. 15 of the aligned block before `mine`
    // That block is the own 16 bytes shifted up by r bytes: word k takes own words k - q - 1, k - q.
    const int q = r >> 2, sh = 8 * (r & 3);
    auto own = [&](int i) { return i == 0 ? ow[0] : i == 1 ? ow[1] : i == 2 ? ow[2] : i == 3 ? ow[3] : 0u; };
    const uint32_t hw[4] = {__funnelshift_l(own(-q - 1), own(-q), sh), __funnelshift_l(own(-q), own(1 - q), sh),
                            __funnelshift_l(own(1 - q), own(2 - q), sh), __funnelshift_l(own(2 - q), own(3 - q), sh)};
    store_block_range(mine - r, hw, r, min(16, r + cnt));
  }
  const int first = 16 * tb + 16 - r;  // first token of the aligned block this lane writes
  if (first >= cnt) return;
  // Bytes 16 - r .. 31 - r of (own 16 bytes, next lane's 16 bytes).
  const uint32_t w0 = o.x, w1 = o.y, w2 = o.z, w3 = o.w, w4 = nx.x, w5 = nx.y, w6 = nx.z, w7 = nx.w;
  const int off = 16 - r, q = off >> 2, sh = 8 * (off & 3);
  const uint32_t t0 = q == 0 ? w0 : q == 1 ? w1 : q == 2 ? w2 : w3;
  const uint32_t t1 = q == 0 ? w1 : q == 1 ? w2 : q == 2 ? w3 : w4;
  const uint32_t t2 = q == 0 ? w2 : q == 1 ? w3 : q == 2 ? w4 : w5;
  const uint32_t t3 = q == 0 ? w3 : q == 1 ? w4 : q == 2 ? w5 : w6;
  const uint32_t t4 = q == 0 ? w4 : q == 1 ? w5 : q == 2 ? w6 : w7;
  const uint32_t bw[4] = {__funnelshift_r(t0, t1, sh), __funnelshift_r(t1, t2, sh), __funnelshift_r(t2, t3, sh),
                          __funnelshift_r(t3, t4, sh)};
  uint8_t* block = mine + off;
  const int n = cnt - first;
  if (n >= 16) {
    *reinterpret_cast<uint4*>(block) = make_uint4(bw[0], bw[1], bw[2], bw[3]);
  } else {
    store_block_range(block, bw, 0, n);
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

// Shared memory of the column kernel: the dequantized tile and two stages of raw MXFP4 input (packed bytes and scales of 128 rows x 128 hidden) filled by cp.async.
constexpr int kRawPackedBytes = kTileRows * (kTileCols / 2);     // 8 KB
constexpr int kRawScaleBytes = kTileRows * (kTileCols / kMxBlock);  // 512 B
constexpr int kRawStageBytes = kRawPackedBytes + kRawScaleBytes;
constexpr int kColsSmemBytes = kTileRows * kTileRowBytes + 2 * kRawStageBytes;

struct ColTile {
  long long g = 0, row0 = 0;  // scale group (output scale column) and its first input row
  int ht = 0, cnt = 0;        // hidden tile and rows in the group (<= 128)
};

template <bool kVec16>
__global__ void __launch_bounds__(kThreads, 4) sm90_mxfp4_to_fp8_cols_kernel(const Mxfp4ToFp8ColsParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* tile = smem;                                    // 128 tokens x 128 bf16, swizzled chunks
  uint8_t* raw_stages = tile + kTileRows * kTileRowBytes;  // 2 x (packed [128][64], scales [128][4])
  const int tid = threadIdx.x, lane = tid & 31;
  const Segments& seg = p.segments;
  const int htiles = p.hidden / kTileCols;
  const long long num_tiles = p.num_groups * htiles;
  const long long n_out = p.rows;
  const long long grid = gridDim.x;

  auto locate = [&](long long v) {
    ColTile t;
    t.g = v / htiles;
    t.ht = static_cast<int>(v - t.g * htiles);
    t.row0 = p.group_rows[2 * t.g];
    t.cnt = static_cast<int>(p.group_rows[2 * t.g + 1]);
    return t;
  };
  // Copies of one tile's input into raw stage `st`; rows past the group's end are zero-filled (the
  // spec pads the last group with zeros).
  auto issue = [&](const ColTile& t, int st) {
    uint8_t* stage = raw_stages + st * kRawStageBytes;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int u = tid + s * kThreads, r = u >> 2, q = u & 3;
      const bool valid = r < t.cnt;
      const uint8_t* src =
          valid ? p.packed + (t.row0 + r) * p.packed_stride + t.ht * (kTileCols / 2) + q * 16 : p.packed;
      uint8_t* dst = stage + r * (kTileCols / 2) + q * 16;
      if constexpr (kVec16) {
        cp_async16(dst, src, valid);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async4(dst + 4 * j, valid ? src + 4 * j : src, valid);
      }
    }
    if (tid < kTileRows) {
      const bool valid = tid < t.cnt;
      const uint8_t* src = valid ? p.scales + (t.row0 + tid) * p.scales_stride + t.ht * 4 : p.scales;
      cp_async4(stage + kRawPackedBytes + tid * 4, src, valid);
    }
  };

  ColTile cur, nxt;
  long long v = blockIdx.x;
  if (v < num_tiles) {
    cur = locate(v);
    issue(cur, 0);
  }
  cp_async_commit();
  if (v + grid < num_tiles) {
    nxt = locate(v + grid);
    issue(nxt, 1);
  }
  cp_async_commit();

  for (int it = 0; v < num_tiles; v += grid, ++it) {
    const int st = it & 1;
    cp_async_wait_one();  // this thread's copies of the current stage have landed
    __syncthreads();      // ... and everybody's

    // Phase A: dequantize the stage (exactly, as bf16) into the swizzled tile.
    const uint8_t* stage = raw_stages + st * kRawStageBytes;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int u = tid + s * kThreads, r = u >> 2, q = u & 3;
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + r * (kTileCols / 2) + q * 16);
      uint32_t hlo, hhi, llo, lhi;
      block_tables(stage[kRawPackedBytes + r * 4 + q], hlo, hhi, llo, lhi);
      uint8_t* trow = tile + r * kTileRowBytes;
      *reinterpret_cast<uint4*>(trow + tile_chunk(r, 4 * q + 0) * 16) = dequant8_bf16(raw.x, hlo, hhi, llo, lhi);
      *reinterpret_cast<uint4*>(trow + tile_chunk(r, 4 * q + 1) * 16) = dequant8_bf16(raw.y, hlo, hhi, llo, lhi);
      *reinterpret_cast<uint4*>(trow + tile_chunk(r, 4 * q + 2) * 16) = dequant8_bf16(raw.z, hlo, hhi, llo, lhi);
      *reinterpret_cast<uint4*>(trow + tile_chunk(r, 4 * q + 3) * 16) = dequant8_bf16(raw.w, hlo, hhi, llo, lhi);
    }
    __syncthreads();  // the tile is complete and the stage is free again
    ColTile after;
    if (v + 2 * grid < num_tiles) {  // two tiles ahead into the stage just consumed
      after = locate(v + 2 * grid);
      issue(after, st);
    }
    cp_async_commit();

    // Phase B: thread (hp, tb) owns hidden columns 2hp, 2hp+1 and tokens 16tb .. 16tb+15.
#pragma unroll 1
    for (int s = 0; s < 2; ++s) {
      const int u = tid + s * kThreads, tb = u & 7, hp = u >> 3;
      const int k = hp >> 2;
      uint32_t w[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int t = tb * 16 + i;
        w[i] = *reinterpret_cast<const uint32_t*>(tile + t * kTileRowBytes + tile_chunk(t, k) * 16 + (hp & 3) * 4);
      }
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = max_u16x2(m, w[i] & 0x7FFF7FFFu);  // |bf16| bits, NaN on top
#pragma unroll
      for (int x = 1; x < 8; x <<= 1) m = max_u16x2(m, __shfl_xor_sync(0xFFFFFFFFu, m, x));
      const uint32_t s_lo = e4m3_scale_byte(m << 16), s_hi = e4m3_scale_byte(m & 0xFFFF0000u);
      uint4 o_lo = make_uint4(0, 0, 0, 0), o_hi = make_uint4(0, 0, 0, 0);
      if (s_lo != kUe8m0Nan) {
        const float inv = ue8m0_inverse(s_lo);
        uint32_t o[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          o[c] = e4m3x4(__fmul_rn(__uint_as_float(w[4 * c] << 16), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 1] << 16), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 2] << 16), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 3] << 16), inv));
        }
        o_lo = make_uint4(o[0], o[1], o[2], o[3]);
      }
      if (s_hi != kUe8m0Nan) {
        const float inv = ue8m0_inverse(s_hi);
        uint32_t o[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          o[c] = e4m3x4(__fmul_rn(__uint_as_float(w[4 * c] & 0xFFFF0000u), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 1] & 0xFFFF0000u), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 2] & 0xFFFF0000u), inv),
                        __fmul_rn(__uint_as_float(w[4 * c + 3] & 0xFFFF0000u), inv));
        }
        o_hi = make_uint4(o[0], o[1], o[2], o[3]);
      }
      const long long col = static_cast<long long>(cur.ht) * kTileCols + 2 * hp;
      uint8_t* dst = p.out + col * n_out + cur.row0;
      store_column(dst, o_lo, tb, cur.cnt);
      store_column(dst + n_out, o_hi, tb, cur.cnt);
      if (tb == 0) {
        p.out_scales[col * p.num_groups + cur.g] = ue8m0_value(s_lo);
        p.out_scales[(col + 1) * p.num_groups + cur.g] = ue8m0_value(s_hi);
      }
    }
    __syncthreads();
    cur = nxt;
    nxt = after;
  }
  asm volatile("cp.async.wait_all;\n" ::);

  // Columns of rows outside every segment are zero.
  const long long covered = p.workspace[seg.num];
  if (seg.offsets == nullptr && covered >= p.rows) return;
  const long long warp = (static_cast<long long>(blockIdx.x) * kThreads + tid) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  for (long long row = warp; row < p.rows; row += num_warps) {
    if (warp_row_in_segments(row, seg.lens, seg.offsets, seg.is64, seg.num, covered)) continue;
    for (int h = lane; h < p.hidden; h += 32) p.out[static_cast<long long>(h) * n_out + row] = 0;
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
  const bool vec16 = ((p.packed_stride & 15) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 15) == 0);
  const long long blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
  if (vec16) {
    auto k = sm90_mxfp4_to_fp8_rows_kernel<true>;
    k<<<persistent_grid(k, blocks), kThreads, 0, stream>>>(p);
  } else {
    auto k = sm90_mxfp4_to_fp8_rows_kernel<false>;
    k<<<persistent_grid(k, blocks), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_mxfp4_to_fp8_cols(const Mxfp4ToFp8ColsParams& p, cudaStream_t stream) {
  sm90_cols_prepare_kernel<<<1, 1024, 0, stream>>>(p);
  if (p.rows <= 0 || p.hidden <= 0) return cudaGetLastError();
  const bool vec16 = ((p.packed_stride & 15) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 15) == 0);
  const long long tiles = p.num_groups * (p.hidden / kTileCols);
  const long long zero_blocks = (p.rows + kThreads / 32 - 1) / (kThreads / 32);
  const long long work = tiles > zero_blocks ? tiles : zero_blocks;
  if (vec16) {
    auto k = sm90_mxfp4_to_fp8_cols_kernel<true>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kColsSmemBytes);
    k<<<persistent_grid(k, work, kColsSmemBytes), kThreads, kColsSmemBytes, stream>>>(p);
  } else {
    auto k = sm90_mxfp4_to_fp8_cols_kernel<false>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kColsSmemBytes);
    k<<<persistent_grid(k, work, kColsSmemBytes), kThreads, kColsSmemBytes, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace moe_fp4
