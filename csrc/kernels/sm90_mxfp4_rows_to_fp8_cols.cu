// mxfp4_rows_to_fp8_cols: MXFP4 rows grouped by expert -> FP8 1x128 columns, dequantize + transpose +
// requantize in one pass through shared memory (formats.mxfp4_rows_to_fp8_cols).
//   One pass (every segment starting on a 16-row boundary): one CTA per scale group (<= 128 rows of
//     one expert, found on the device from the split lengths) and 256 hidden columns reads the group's
//     rows as coalesced 128-byte pieces, takes the columns' maxima, converts, and writes the group's
//     part of the column-major output through a transposed tile in shared memory (one tensor copy per
//     tile of 128 rows starting on a 16-row boundary).
//   Two passes (any segments): first one CTA per scale group and 256 hidden columns reads the group's
//     rows as coalesced 128-byte pieces and writes the FP32 scales, small records of the scale bytes
//     and each row's group; then one CTA per aligned window of 128 tokens and 256 hidden columns
//     converts each row with its group's record and writes whole aligned 16-byte pieces of the output
//     that no other CTA touches, whatever the segment boundaries. See the kernels' comments.
#include "sm90_common.cuh"
#include "sm90_device_queries.h"
#include "sm90_divide.cuh"
#include "sm90_launchers.h"

#include <cuda.h>  // CUtensorMap; the encoder comes through the runtime's driver entry point
#include <cudaTypedefs.h>

#include <climits>

namespace moe_fp4 {
namespace {

constexpr int kThreads = 256;

constexpr int kTileRows = kFp8Group;  // tokens per tile: one FP8 scale group
static_assert(kTileRows == kColumnTileRows, "mxfp4_rows_to_fp8_cols_fits counts these tiles");

// Programmatic dependent launch: the two-pass path's kernels start while the previous one finishes.
// A kernel launched with launch_dependent waits in grid_wait() until the previous kernel has
// completed and its writes are visible (without the attribute both are no-ops); grid_launch_next()
// lets the next kernel's CTAs be scheduled once every CTA of this one has issued it.
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_next() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// One segment-group prefix pass (a single block): group offsets (output), first row of each segment,
// the rows they cover in all, and for every scale group its first row and row count.
__global__ void __launch_bounds__(1024) sm90_mxfp4_rows_to_fp8_cols_prepare_kernel(const Mxfp4RowsToFp8ColsParams p) {
  __shared__ long long warp_groups[32], warp_rows[32];
  __shared__ long long carry_groups, carry_rows;
  const Segments& seg = p.segments;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  grid_launch_next();  // the scale kernel's CTAs wait for this one's group rows
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
  // Two-pass path with back-to-back segments: every row below carry_rows is in a group (the scale
  // kernel writes its group); the rest of the padded windows are outside every segment. With offsets
  // the launcher clears the whole array first.
  if (p.row_groups != nullptr && seg.offsets == nullptr) {
    const long long padded = (p.rows + kTileRows - 1) / kTileRows * kTileRows;
    for (long long r = carry_rows + threadIdx.x; r < padded; r += blockDim.x) p.row_groups[r] = -1;
  }
}

// ---- Shared pieces of the column kernels ----
// No float arithmetic per element:
//   1. column maxima as byte keys: a column's FP8 scale byte depends only on the binade of its
//      largest magnitude, so an element of E2M1 code c in a row of scale byte S keys as S + b(c),
//      b(c) = floor(log2 |E2M1|) + 2 (1..4; code 0 keys 0 whatever S). A row's key table is two
//      multiply-adds, a word's 8 keys two byte permutes, and the maxima run on the keys' byte pairs
//      as 16-bit lanes (only the high byte of a lane is a column's key; the low byte can only break
//      ties). Exact while S + 4 fits a byte: the columns of a lane that met a scale byte 252..254
//      take exact 16-bit keys 4 S + k(c) instead, k(c) = 4 (ev + 2) + 2 mh + 1 for the E2M1
//      magnitude (1 + mh / 2) 2^ev (a monotone image of the value; code 0 maps to a negative key),
//      rebuilt from the group's rows;
//   2. a column whose largest byte key is K > 0 takes the FP8 scale byte max(K - 10, 0) (the spec's
//      rounding up for every S and code, checked by the tests); an exact key decodes to its float32,
//      which gives the scale byte through e4m3_scale_byte, as for any FP8 1x128 group;
//   3. the E4M3 byte of E2M1 code c in a row of scale S is base(c) + 8 (S - sb) whenever that lands
//      in E4M3's normal range (every S - sb in [-5, 10] for the rows and columns of a lane, the
//      common case): computed for four columns at once with a byte permute, one subtract and one
//      multiply-add; otherwise a per-element table (subnormal results, underflow, saturated or NaN
//      columns);
//   4. 4x4 byte transposes turn four rows of four columns into four columns of four rows.
constexpr int kColWarps = kThreads / 32;
constexpr int kColKRows = 24;                       // shifts k = S - sb in [-14, 9]

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

// E4M3 magnitudes of E2M1 code (i & 7) times 2^((i >> 3) - 14), as 32-bit words (copied to shared
// memory by the kernels that convert per element). In global memory, not the constant bank: the
// threads read different words, which one coalesced load brings at once and the constant cache
// serves one after another (the tile kernel's copy, before its row loads, held back its first two
// warps; the tile kernel now copies it only when a lane needs it).
struct KTable {
  uint32_t word[kColKRows * 2];
};
constexpr KTable make_ktable() {
  KTable t{};
  for (int i = 0; i < kColKRows * 8; ++i) {
    t.word[i >> 2] |= e4m3_of_e2m1_times_pow2(i & 7, (i >> 3) - 14) << (8 * (i & 3));
  }
  return t;
}
__device__ const KTable kKTable = make_ktable();

// The PRMT instruction itself: selector nibble bit 3 replicates the sign of the selected byte, which
// __byte_perm does not promise (it masks each nibble to 3 bits: one more instruction per call). Table
// look-ups pass selectors already masked to 3-bit nibbles.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Bytes of k(c) for codes 0..7 (code 0's is never used: a zero has no key).
constexpr uint32_t kKeyLo = 0x0B090500u, kKeyHi = 0x13110F0Du;
// base(c) - 40 for codes 1..7 (base(c) = E4M3 byte of the code's value times 2^0 minus... see above:
// ((ev + 7) << 3) | (mh << 2)), and 0x80 for code 0 (its result then has bit 7 set and is cleared).
constexpr uint32_t kBaseLo = 0x14100880u, kBaseHi = 0x24201C18u;

// The byte formula for one packed word w (8 columns of one row): the E4M3 bytes of columns 0-3 (lo)
// and 4-7 (hi), given each column's shift S - sb + 5 as bytes x_lo, x_hi, every one in [0, 15].
__device__ __forceinline__ void fast_word_e4m3(uint32_t w, uint32_t x_lo, uint32_t x_hi, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = w & 0x77777777u;
  const uint32_t sg_e = (w << 4) & 0x80808080u, sg_o = w & 0x80808080u;  // signs of even, odd columns
  const uint32_t r_lo = x_lo * 8u + prmt(kBaseLo, kBaseHi, sel);
  const uint32_t r_hi = x_hi * 8u + prmt(kBaseLo, kBaseHi, sel >> 16);
  lo = (r_lo & ~prmt(r_lo, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x5140);  // code 0: zero
  hi = (r_hi & ~prmt(r_hi, 0u, 0xBA98u)) | __byte_perm(sg_e, sg_o, 0x7362);
}

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

// The fast formula's shift test ORs the bytes S - sb + 5 of a word and rejects bits 4-7. A shift below
// -240 could wrap into [0, 15] undetected; a lane whose largest column byte is more than kShiftWrap
// above its smallest row scale takes the per-element path instead.
constexpr int kShiftWrap = 240;
constexpr uint32_t kBinLo = 0x02020100u, kBinHi = 0x04040303u;  // b(c) for codes 0..3 and 4..7
constexpr uint32_t kByteKeyMaxScale = 251u;                       // S + 4 <= 255

// One row's byte keys of the 8 columns of a packed word with magnitude codes sel, folded into k:
// columns 0, 2 in the high bytes of k[0]'s lanes, 1, 3 in k[1], 4, 6 in k[2], 5, 7 in k[3].
__device__ __forceinline__ void add_row_byte_keys(uint32_t sel, uint32_t s, uint32_t (&k)[4]) {
  const uint32_t t_lo = s * 0x01010100u + kBinLo, t_hi = s * 0x01010101u + kBinHi;
  const uint32_t k03 = prmt(t_lo, t_hi, sel), k47 = prmt(t_lo, t_hi, sel >> 16);
  k[0] = max_u16x2(k[0], k03 << 8);
  k[1] = max_u16x2(k[1], k03);
  k[2] = max_u16x2(k[2], k47 << 8);
  k[3] = max_u16x2(k[3], k47);
}
// Where column j's key sits in that layout: word byte_key_word(j), bits byte_key_shift(j) .. + 7.
__host__ __device__ constexpr int byte_key_word(int j) { return 2 * (j >> 2) + (j & 1); }
__host__ __device__ constexpr int byte_key_shift(int j) { return 8 + 16 * ((j >> 1) & 1); }
// Step 2 for a column whose largest byte key is key: its FP8 scale byte, 0x100 for an all-zero column.
__device__ __forceinline__ uint32_t byte_key_scale_byte(uint32_t key) {
  return key == 0u ? 0x100u : key > 10u ? key - 10u : 0u;
}

// Step 1's exact fallback: the FP8 scale byte of column col over the group's rows [row0, row0 + cnt),
// from the largest 16-bit key 4 S + k(c) of its nonzero codes (0x100 for an all-zero column). Reads the
// rows again (from the L2), a byte per row; for lanes that met a scale byte 252..254, outside NaN blocks.
__device__ __forceinline__ uint32_t exact_column_scale_byte(const Mxfp4RowsToFp8ColsParams& p, long long row0, int cnt,
                                                            int col) {
  const uint8_t* pc = p.packed + row0 * p.packed_stride + col / 2;
  const uint8_t* sc = p.scales + row0 * p.scales_stride + col / kMxBlock;
  int key = 0;
  for (int r = 0; r < cnt; ++r) {
    const uint32_t c = (pc[static_cast<long long>(r) * p.packed_stride] >> (4 * (col & 1))) & 7u;
    if (c != 0u) {
      const int kc = static_cast<int>(__byte_perm(kKeyLo, kKeyHi, c) & 0xFFu);
      key = max(key, 4 * static_cast<int>(sc[static_cast<long long>(r) * p.scales_stride]) + kc);
    }
  }
  return key > 0 ? e4m3_scale_byte(key_to_float_bits(key)) : 0x100u;
}

// Scale-byte loads kept in the L2 (evict_last): a CTA uses 8 bytes of each row's 32-byte sector, the
// other 24 belong to the CTAs of the next three column chunks, which in column raster run a quarter of
// the grid later. The scale pass keeps __ldg: the policy register would make it spill at 48 registers.
__device__ __forceinline__ uint64_t keep_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint32_t ld_keep_u8(const uint8_t* q, uint64_t pol) {
  uint16_t v;
  asm("ld.global.nc.L2::cache_hint.u8 %0, [%1], %2;" : "=h"(v) : "l"(q), "l"(pol));
  return v;
}

// A lane's row i: its 4 packed bytes (one 4-byte load, or bytes when rows are not 4-byte aligned) and
// the row's scale byte of the lane's MX block.
template <bool kVec4>
__device__ __forceinline__ void load_lane_row(const Mxfp4RowsToFp8ColsParams& p, const uint8_t* prow, const uint8_t* srow,
                                              int i, uint32_t& w, uint32_t& s) {
  const uint8_t* q = prow + static_cast<long long>(i) * p.packed_stride;
  if constexpr (kVec4) {
    w = __ldcs(reinterpret_cast<const uint32_t*>(q));
  } else {
    w = static_cast<uint32_t>(q[0]) | (static_cast<uint32_t>(q[1]) << 8) | (static_cast<uint32_t>(q[2]) << 16) |
        (static_cast<uint32_t>(q[3]) << 24);
  }
  s = ld_keep_u8(srow + static_cast<long long>(i) * p.scales_stride, keep_policy());
}

// ---- First pass of the two-pass path: scales and records, row-major. ----
// One CTA per (scale group, 256 hidden columns). Warp w reads rows w, w + 8, ... of the group, each as
// one coalesced 128-byte load (4 packed bytes, 8 columns per lane) plus the row's scale byte of the
// lane's MX block, and keeps the column maxima of its rows as byte keys (step 1 above); the 8 warps'
// maxima meet in shared memory, and warp 0 writes the FP32 scales and the 16-byte records of its
// lanes' 8 columns (per column the byte the second pass converts with, an all-zero column taking the
// largest finite byte of the 8, or 5 when there is none, never 0xFF; then their minimum and maximum)
// and, for the first 256 columns, each row's group. The group's first row and row count come from the
// prepare kernel's group_rows.
// Byte keys rather than 16-bit ones (ten byte permutes per word) measured faster; 48 registers keep 5
// CTAs per SM; an epilogue of one thread per column over all 8 warps (in place of warp 0 alone) was
// slower.
constexpr int kScaleCols = 256;   // hidden columns per CTA: 8 per lane
constexpr int kScaleRowsPerWarp = kTileRows / kColWarps;

__global__ void __launch_bounds__(kThreads, 5)
    sm90_mxfp4_rows_to_fp8_cols_scales_kernel(const Mxfp4RowsToFp8ColsParams p, DivU32 by_chunks) {
  __shared__ uint4 s_max[kColWarps - 1][32];  // warps 1..7: column keys of each lane
  __shared__ uint32_t s_nan[kColWarps - 1];   // warps 1..7: a NaN scale byte seen, per lane (bit)
  __shared__ uint32_t s_big[kColWarps - 1];   // warps 1..7: a scale byte above kByteKeyMaxScale, per lane
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (p.hidden + kScaleCols - 1) / kScaleCols;
  const long long g = div_u32(blockIdx.x, by_chunks);
  const int ch = static_cast<int>(blockIdx.x - g * chunks);
  grid_launch_next();  // the window kernel's CTAs load their rows, then wait for this kernel's end
  grid_wait();         // the prepare kernel's group rows
  const long long row0 = p.group_rows[2 * g];
  const int cnt = static_cast<int>(p.group_rows[2 * g + 1]);
  const int col0 = ch * kScaleCols + 8 * lane;  // this lane's 8 columns
  const bool active = col0 < p.hidden;
  uint32_t k[4] = {0u, 0u, 0u, 0u};
  uint32_t sall = 0u;  // the largest scale byte of the lane's rows: NaN (0xFF), or above 251
  if (active) {
    const uint8_t* prow = p.packed + row0 * p.packed_stride + col0 / 2;
    const uint8_t* srow = p.scales + row0 * p.scales_stride + col0 / kMxBlock;
    uint32_t wv[kScaleRowsPerWarp], sv[kScaleRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kScaleRowsPerWarp; ++i) {
      const int r = warp + kColWarps * i;
      wv[i] = sv[i] = 0u;
      if (r < cnt) {
        wv[i] = __ldg(reinterpret_cast<const uint32_t*>(prow + static_cast<long long>(r) * p.packed_stride));
        sv[i] = __ldg(srow + static_cast<long long>(r) * p.scales_stride);
      }
    }
#pragma unroll
    for (int i = 0; i < kScaleRowsPerWarp; ++i) {
      sall = max(sall, sv[i]);
      add_row_byte_keys(wv[i] & 0x77777777u, sv[i], k);  // rows past cnt: all-zero codes, keys 0
    }
  }
  const uint32_t nan_bits_w = __ballot_sync(0xFFFFFFFFu, sall == kUe8m0Nan);
  const uint32_t big_bits_w = __ballot_sync(0xFFFFFFFFu, sall > kByteKeyMaxScale);  // NaN too: its block is NaN
  if (warp > 0) {
    s_max[warp - 1][lane] = make_uint4(k[0], k[1], k[2], k[3]);
    if (lane == 0) {
      s_nan[warp - 1] = nan_bits_w;
      s_big[warp - 1] = big_bits_w;
    }
  }
  if (ch == 0) {  // each row's group (the array was set to -1 first)
    for (int r = threadIdx.x; r < cnt; r += kThreads) p.row_groups[row0 + r] = static_cast<int>(g);
  }
  __syncthreads();
  if (warp != 0) return;
  uint32_t nan_bits = nan_bits_w, big_bits = big_bits_w;
#pragma unroll
  for (int w = 0; w < kColWarps - 1; ++w) {
    const uint4 v = s_max[w][lane];
    k[0] = max_u16x2(k[0], v.x);
    k[1] = max_u16x2(k[1], v.y);
    k[2] = max_u16x2(k[2], v.z);
    k[3] = max_u16x2(k[3], v.w);
    nan_bits |= s_nan[w];
    big_bits |= s_big[w];
  }
  if (!active) return;
  // Every row of the group with scale 0xFF in this MX block (4 lanes) makes the whole block NaN.
  const bool nan_block = ((nan_bits >> (lane & ~3)) & 0xFu) != 0u;
  uint32_t sb[8];
  if (nan_block) {
#pragma unroll
    for (int j = 0; j < 8; ++j) sb[j] = kUe8m0Nan;
  } else if ((big_bits >> lane) & 1u) {  // rare: exact keys from the rows
    for (int j = 0; j < 8; ++j) sb[j] = exact_column_scale_byte(p, row0, cnt, col0 + j);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) sb[j] = byte_key_scale_byte((k[byte_key_word(j)] >> byte_key_shift(j)) & 0xFFu);
  }
  uint32_t fmax = 0u;
  bool fany = false;
  // The lane's 8 FP32 scales: 32 contiguous bytes of group g's row of the [G, H] buffer.
  float4* srow = reinterpret_cast<float4*>(p.out_scales + static_cast<long long>(g) * p.hidden + col0);
  srow[0] = make_float4(ue8m0_value(sb[0] & 0xFFu), ue8m0_value(sb[1] & 0xFFu), ue8m0_value(sb[2] & 0xFFu),
                        ue8m0_value(sb[3] & 0xFFu));
  srow[1] = make_float4(ue8m0_value(sb[4] & 0xFFu), ue8m0_value(sb[5] & 0xFFu), ue8m0_value(sb[6] & 0xFFu),
                        ue8m0_value(sb[7] & 0xFFu));
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const bool finite = sb[j] < kUe8m0Nan;
    if (finite) fmax = max(fmax, sb[j]);
    fany |= finite;
  }
  // Record: per column the byte the second pass converts with (an all-zero column takes the largest
  // finite byte of the 8, or 5 when there is none; never 0xFF), then their minimum and maximum.
  uint32_t word = 0u, word_hi = 0u, fmin = 0xFFu, fmx = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t fb = sb[j] == 0x100u ? (fany ? fmax : 5u) : sb[j];
    fmin = min(fmin, fb);
    fmx = max(fmx, fb);
    if (j < 4) word |= fb << (8 * j);
    else word_hi |= fb << (8 * (j - 4));
  }
  reinterpret_cast<uint4*>(p.col_records)[g * (p.hidden / 8) + col0 / 8] = make_uint4(word, word_hi, fmin | (fmx << 8), 0u);
}

// ---- The one-pass kernel as CTA tiles: one CTA per (scale group, 256 hidden columns). ----
// Warp 0 first finds the CTA's group from the split lengths (a prefix over the experts, 32 at a time);
// with full_groups, or a group table from the caller (GroupHints), the other warps do not wait for it
// (step 1 runs on the rows loaded early, and the look-up is checked at step 1's barrier, so the
// loads do not wait for the look-up).
// Warp w loads rows 16 w .. 16 w + 15 of the group as coalesced 128-byte row pieces (lane l: the 4
// packed bytes of hidden columns 8 l .. 8 l + 7, all in one MX block, and that block's scale byte); no
// staging. Then:
//   1. column maxima of the lane's 16 rows as byte keys (step 1 above; fewer permutes than 16-bit
//      keys), met in shared memory;
//   2. thread t takes column t's maximum over the 8 warps, its FP8 scale byte (written as the FP32
//      scale: the CTA's 256 scales are 1 KB in one piece of the outer-dim-major [H, G], where a
//      row-major [H, G] would take 4-byte stores 4 G bytes apart) and whether the column is all zero;
//      the 8 threads of lane l's columns then build that lane's step-3 setup by shuffles (once per
//      column, not by every lane from the 8 columns' bytes after the barrier);
//   3. each lane converts its 16 rows x 8 columns by the byte formula base(c) + 8 (S - sb), testing
//      the shifts as it goes (their bytes ORed, so step 1 need not track each row's scale range),
//      or, when a shift leaves E4M3's normal range, loads its rows again
//      and converts per element through the table; it transposes them 4x4 in registers and stores
//      16 bytes per column into a [256 column][128 row] E4M3 tile in shared memory (16-byte slots
//      XOR-swizzled by column);
//   4. the CTA writes the tile's columns to the column-major output: one tensor copy of the whole tile
//      (128 rows, or the input's last rows, starting on a 16-byte boundary; the tile is laid out as the
//      copy's box, tile_slot<true>), else whole aligned 16-byte stores (a group starting on a 16-byte
//      boundary: 4 full lines per warp instruction with 128 rows), else 16-byte pieces aligned in global
//      memory, shifted out of the tile, with byte stores only at the group's two ends (the bytes around
//      belong to the neighbouring groups).
constexpr int kTileCols = kColumnTileCols;                  // hidden columns per CTA: 8 per lane
constexpr int kTileBytes = kTileCols * kTileRows;           // the E4M3 tile
constexpr int kTileKeys = kTileBytes;                       // [8 warps][32 lanes] uint4 column keys
constexpr int kTileInfo = kTileKeys + kColWarps * 32 * 16;  // [256] uint16: scale byte | all-zero << 8
constexpr int kTileKtab = kTileInfo + kTileCols * 2;        // [kColKRows][8] E4M3 magnitudes
constexpr int kTileSmem = kTileKtab + kColKRows * 8 + 1024;  // dynamic shared memory in all (the tile 1024-aligned)

// Byte offset of the 16-byte slot of column c's rows 16 chunk .. 16 chunk + 15, XOR-swizzled by c >> 3
// (the lanes' stores, one column each 8 apart, and a warp's loads of 4 whole columns are free of bank
// conflicts). kBox: the columns' 128-byte rows in the order (c & 7) * 32 + (c >> 3); with the same
// swizzle (16-byte chunk ^ row % 8) that is the shared-memory image of a tensor-copy box [8][32][128
// bytes] of the output viewed as [8 (c & 7)][H / 8 (c >> 3)][N] with the 128-byte swizzle.
template <bool kBox>
__device__ __forceinline__ uint32_t tile_slot(int c, int chunk) {
  const int row = kBox ? (c & 7) * 32 + (c >> 3) : c;
  return static_cast<uint32_t>(row * kTileRows + ((chunk ^ ((c >> 3) & 7)) << 4));
}

// Bytes [lo, hi) of the 16 bytes v to dst (16-byte aligned), the fewest naturally aligned stores.
__device__ __forceinline__ void store_range16(uint8_t* dst, const uint32_t (&v)[4], int lo, int hi) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int a = max(lo, 4 * m), b = min(hi, 4 * m + 4);
    if (a >= b) continue;
    if (a == 4 * m && b == 4 * m + 4) {
      *reinterpret_cast<uint32_t*>(dst + 4 * m) = v[m];
    } else {
      for (int i = a; i < b; ++i) dst[i] = static_cast<uint8_t>(v[m] >> (8 * (i - 4 * m)));
    }
  }
}

// A [256 column][128 row] tile (tile_slot layout) to the column-major output: columns [0, ncols) at
// out0 + c n (n: the output's row stride), rows [0, cnt) of each. Whole aligned 16-byte chunks when every column starts 16-byte
// aligned (4 full 128-byte lines per warp instruction with cnt 128; a partial last chunk by bytes),
// else 16-byte pieces aligned in global memory, shifted out of the tile, with byte stores only at the
// two ends (the bytes around belong to neighbouring groups).
template <bool kBox>
__device__ __forceinline__ void tile_store(const uint8_t* tile, uint8_t* out0, long long n, int ncols, int cnt, int tid) {
  if (((n & 15) == 0) && ((reinterpret_cast<uintptr_t>(out0) & 15) == 0)) {
#pragma unroll
    for (int k = 0; k < kTileCols * 8 / kThreads; ++k) {
      const int idx = tid + kThreads * k, c = idx >> 3, chunk = idx & 7;
      if (c < ncols && 16 * chunk < cnt) {
        const uint4 v = *reinterpret_cast<const uint4*>(tile + tile_slot<kBox>(c, chunk));
        uint8_t* dst = out0 + c * n + 16 * chunk;
        if (16 * chunk + 16 <= cnt) {
          *reinterpret_cast<uint4*>(dst) = v;
        } else {
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
          store_range16(dst, w, 0, cnt - 16 * chunk);
        }
      }
    }
    return;
  }
#pragma unroll 1
  for (int idx = tid; idx < ncols * 9; idx += kThreads) {
    const int c = idx / 9, pc = idx - 9 * c;
    uint8_t* dst = out0 + c * n;
    const int a = static_cast<int>(reinterpret_cast<uintptr_t>(dst) & 15);
    const int q = 16 * pc - a;  // the piece's first byte as a row of the tile (may be negative)
    if (q >= cnt) continue;
    const int u0 = ((q + 16) >> 2) - 4;  // floor(q / 4)
    uint32_t w5[5];
#pragma unroll
    for (int m = 0; m < 5; ++m) {
      const int u = u0 + m;
      w5[m] = (u >= 0 && u < 32) ? *reinterpret_cast<const uint32_t*>(tile + tile_slot<kBox>(c, u >> 2) + 4 * (u & 3)) : 0u;
    }
    const uint32_t sh = 8u * static_cast<uint32_t>(q & 3);
    uint32_t v[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = __funnelshift_r(w5[m], w5[m + 1], sh);
    const int lo = max(0, -q), hi = min(16, cnt - q);
    uint8_t* piece = dst + q;  // 16-byte aligned
    if (lo == 0 && hi == 16) {
      *reinterpret_cast<uint4*>(piece) = make_uint4(v[0], v[1], v[2], v[3]);
    } else {
      store_range16(piece, v, lo, hi);
    }
  }
}

// Per element through the table (subnormal results, underflow, saturated or NaN columns): the lane's
// 16 rows x 8 columns into the tile, row i converted with the record rec_of(i).
template <bool kBox, typename RecordOf>
__device__ __forceinline__ void window_rows_per_element(uint8_t* tile, const uint8_t* ktable, const uint32_t (&wd)[16],
                                                        const uint32_t (&sv)[16], int lane, int warp, RecordOf rec_of) {
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    uint32_t r[2][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = 4 * a + q;
      const uint32_t w = wd[i];
      const int s = static_cast<int>(sv[i]);
      const uint4 rec = rec_of(i);
      r[0][q] = r[1][q] = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t bj = ((j < 4 ? rec.x : rec.y) >> (8 * (j & 3))) & 0xFFu;
        const int k = min(max(s - static_cast<int>(bj), -14), 9);
        const uint32_t e = static_cast<uint32_t>(ktable[(k + 14) * 8 + ((w >> (4 * j)) & 7u)]) |
                           (((w >> (4 * j + 3)) & 1u) << 7);
        r[j >> 2][q] |= (bj == kUe8m0Nan ? 0u : e) << (8 * (j & 3));
      }
    }
    uint32_t c0[4], c1[4];
    transpose4x4(r[0][0], r[0][1], r[0][2], r[0][3], c0[0], c0[1], c0[2], c0[3]);
    transpose4x4(r[1][0], r[1][1], r[1][2], r[1][3], c1[0], c1[1], c1[2], c1[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint32_t*>(tile + tile_slot<kBox>(8 * lane + j, warp) + 4 * a) = c0[j];
      *reinterpret_cast<uint32_t*>(tile + tile_slot<kBox>(8 * lane + 4 + j, warp) + 4 * a) = c1[j];
    }
  }
}

// The one-pass kernel's zero pass with offsets splits each 32-row window's output rows into this many
// tasks (a warp each): about 8192 tasks in all, so that few rows still get many warps (one warp per
// window would store its output rows in series) and many rows do not spend a warp per (window, 256
// output rows) on the windows' look-ups.
// windows >= 1: the launcher returns before it for an input without rows.
__host__ __device__ inline int zero_hsplit(long long windows, int chunks) {
  const long long want = (8192 + windows - 1) / windows;
  return static_cast<int>(want < 1 ? 1 : want > chunks ? chunks : want);
}

// The [8][32][128-byte] box at (row0, column block cb: columns 8 cb ..) of the output, from the tile (a
// 1024-byte aligned kBox image), by the tensor-copy engine; returns once the tile has been read (the
// CTA's shared memory may then be released).
__device__ __forceinline__ void store_box(const CUtensorMap& map, const uint8_t* tile, int row0, int cb) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                   reinterpret_cast<uint64_t>(&map)),
               "r"(row0), "r"(cb), "r"(0), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(tile)))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// The caller's group table, a kernel parameter (constant bank): each CTA loads its group's rows before
// warp 0's look-up answers, as with full_groups, and checks them against it.
struct GroupHints {
  int num;                       // groups described (0: none)
  int2 g[kMaxColumnGroupHints];  // first row, row count
};

// 4 CTAs per SM (64 registers) with word loads; 2 with byte loads, which spill at 3 (the binding sends
// them only one-row views with an odd stride). kAtOffsets: the segments have offsets (an instance of
// its own, so that the back-to-back path keeps its code: compiling the offsets' zero pass and 32-row
// fill into it slowed it down).
template <bool kVec4, bool kAtOffsets>
__global__ void __launch_bounds__(kThreads, kVec4 ? 4 : 2)
    sm90_mxfp4_rows_to_fp8_cols_tile_kernel(const Mxfp4RowsToFp8ColsParams p, DivU32 by_groups, const GroupHints hints,
                          const __grid_constant__ CUtensorMap out_box, bool box_store) {
  extern __shared__ __align__(16) uint8_t smem_raw[];  // the tile at a 1024-byte boundary (128-byte swizzle)
  uint8_t* smem = smem_raw + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u)) & 1023u);
  uint8_t* tile = smem;
  uint4* keys = reinterpret_cast<uint4*>(smem + kTileKeys);
  uint16_t* info = reinterpret_cast<uint16_t*>(smem + kTileInfo);
  uint8_t* ktable = smem + kTileKtab;
  const Segments& seg = p.segments;
  __shared__ long long s_covered;
  __shared__ int s_row0, s_cnt;
  __shared__ bool s_fill32;  // (kAtOffsets) every segment starting on a multiple of 32 rows (see step 4)
  __shared__ uint32_t s_nan[kColWarps], s_big[kColWarps];  // (kAtOffsets) per warp, lanes with such bytes
  __shared__ uint4 s_lane_info[32];  // per lane: fast-formula bytes of its 8 columns, their range, NaN
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = (p.hidden + kTileCols - 1) / kTileCols;
  // Column raster: consecutive CTAs take consecutive groups of one 256-column chunk, so that the CTAs
  // running at once write long runs of each output row (rather than consecutive chunks of one
  // group). CTAs past the tiles (row zeroing) take no group, and their
  // chunk index stays at `chunks` (no column arithmetic past the hidden size).
  const int ch = p.num_groups > 0 ? min(static_cast<int>(div_u32(blockIdx.x, by_groups)), chunks) : chunks;
  const int g = ch < chunks ? static_cast<int>(blockIdx.x - static_cast<long long>(ch) * p.num_groups) : INT_MAX;
  // Each warp's 16 rows of the group starting at row r0 with n rows (lane: 4 packed bytes, 8 columns of
  // one MX block, and that block's scale byte). With full_groups (segments back to back from row 0,
  // lengths multiples of 128) the group's rows are known before the look-up: they are loaded while
  // warp 0 runs it, and again after it only if it disagrees. Without, a load at 128 g would be a
  // guess, and a wasted load when it misses.
  const int c8 = ch * kTileCols + 8 * lane;  // this lane's first hidden column
  const bool active = c8 < p.hidden;
  const int rbase = 16 * warp;               // this warp's first row of the group
  uint32_t wd[16], sv[16];
  auto load_rows = [&](long long r0, int n) {
    const uint8_t* prow = p.packed + static_cast<long long>(r0 + rbase) * p.packed_stride + c8 / 2;
    const uint8_t* srow = p.scales + static_cast<long long>(r0 + rbase) * p.scales_stride + c8 / kMxBlock;
    const int nrows = active ? min(16, n - rbase) : 0;
    auto load_row = [&](int i) { load_lane_row<kVec4>(p, prow, srow, i, wd[i], sv[i]); };
    if (nrows == 16) {  // the common case without per-row tests
#pragma unroll
      for (int i = 0; i < 16; ++i) load_row(i);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        wd[i] = sv[i] = 0u;
        if (i < nrows) load_row(i);
      }
    }
  };
  long long early_row0 = static_cast<long long>(g) * kTileRows;
  int early_cnt = kTileRows;
  if (!p.full_groups && g < hints.num) {
    const int2 h = hints.g[g];
    early_row0 = h.x;
    early_cnt = h.y;
  }
  const bool early = kVec4 && (p.full_groups || g < hints.num) && ch < chunks && g < p.num_groups &&
                     early_row0 >= 0 && early_cnt > 0 && early_cnt <= kTileRows && early_row0 + early_cnt <= p.rows;
  if (early) load_rows(early_row0, early_cnt);
  // Full groups back to back (every length a multiple of 128): group g is rows [128 g, 128 g + 128)
  // if g < G, and the segments cover 128 G rows; a vote on the lengths and a sum of their groups
  // check the flag and give G, without the prefix's dependent shuffles (block 0 takes the prefix for
  // the group offsets; a flag the lengths disagree with takes it too).
  bool looked_up = false;
  if (!kAtOffsets && p.full_groups && blockIdx.x != 0 && warp == 0) {
    long long part = 0;  // this lane's groups
    bool whole = true;
    for (int base = 0; base < seg.num; base += 32) {
      const int e = base + lane;
      const long long len = e < seg.num ? load_index(seg.lens, seg.is64, e) : 0;
      whole &= len >= 0 && (len & (kFp8Group - 1)) == 0;
      part += len / kFp8Group;
    }
    whole &= part < (1LL << 26);  // the warp's sum fits 31 bits
    if (__all_sync(0xFFFFFFFFu, whole)) {
      const long long groups = __reduce_add_sync(0xFFFFFFFFu, static_cast<unsigned>(part));
      if (lane == 0) {
        const bool mine = g < groups && g < p.num_groups;
        s_row0 = mine ? g * kFp8Group : 0;
        s_cnt = mine ? kFp8Group : 0;
        s_fill32 = false;
        s_covered = groups * kFp8Group;
      }
      looked_up = true;
    }
  }
  if (warp == 0 && !looked_up) {
    // The experts' exclusive prefix of rows and scale groups, 32 at a time: the group offsets (block
    // 0), this CTA's group (its expert's lane), the rows the segments cover.
    if (lane == 0) s_cnt = 0;
    __syncwarp();
    long long carry_rows = 0;
    int carry_groups = 0;
    bool on32 = true;  // (kAtOffsets)
    for (int base = 0; base < seg.num; base += 32) {
      const int e = base + lane;
      const long long len = e < seg.num ? load_index(seg.lens, seg.is64, e) : 0;
      const int ng = static_cast<int>((len + kFp8Group - 1) / kFp8Group);
      long long ir = len;
      int ig = ng;
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
        const long long a = __shfl_up_sync(0xFFFFFFFFu, ir, m);
        const int c = __shfl_up_sync(0xFFFFFFFFu, ig, m);
        if (lane >= m) {
          ir += a;
          ig += c;
        }
      }
      const int g_first = carry_groups + ig - ng;
      if (kAtOffsets && len > 0) on32 &= (load_index(seg.offsets, seg.is64, e) & 31) == 0;
      if (e < seg.num) {
        if (blockIdx.x == 0) p.group_offsets[e] = g_first;
        if (g >= g_first && g < g_first + ng && g < p.num_groups) {
          const long long f = seg.offsets != nullptr ? load_index(seg.offsets, seg.is64, e) : carry_rows + ir - len;
          const int j = g - g_first;
          s_row0 = static_cast<int>(f) + j * kFp8Group;
          s_cnt = static_cast<int>(min(static_cast<long long>(kFp8Group), len - static_cast<long long>(j) * kFp8Group));
        }
      }
      carry_rows += __shfl_sync(0xFFFFFFFFu, ir, 31);
      carry_groups += __shfl_sync(0xFFFFFFFFu, ig, 31);
    }
    on32 = __all_sync(0xFFFFFFFFu, on32);
    if (lane == 0) {
      s_fill32 = kAtOffsets && on32;
      s_covered = carry_rows;
      if (blockIdx.x == 0) p.group_offsets[seg.num] = carry_groups;
    }
  }
  // 1. Column keys of the lane's rows (byte keys, as the scale pass) into shared memory; the largest
  // and smallest scale bytes of its rows.
  uint32_t sall = 0u;    // the largest scale byte of all the lane's rows: NaN (0xFF) and above 251
  uint32_t smn = 255u;   // the smallest
  auto column_keys = [&]() {
    uint32_t k[4] = {0u, 0u, 0u, 0u};
    sall = 0u;
    smn = 255u;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t s = sv[i], sel = wd[i] & 0x77777777u;
      sall = max(sall, s);
      smn = min(smn, s);
      add_row_byte_keys(sel, s, k);
    }
    if constexpr (kAtOffsets) {  // (this instance spills 16 bytes with the flags in the keys)
      keys[warp * 32 + lane] = make_uint4(k[0], k[1], k[2], k[3]);
      const uint32_t nan_bits = __ballot_sync(0xFFFFFFFFu, sall == kUe8m0Nan);
      const uint32_t big_bits = __ballot_sync(0xFFFFFFFFu, sall > kByteKeyMaxScale);
      if (lane == 0) {
        s_nan[warp] = nan_bits;
        s_big[warp] = big_bits;
      }
    } else {
      // k[0]'s byte 0 is always zero (its keys sit in bytes 1 and 3): it carries the largest scale
      // byte, for step 2 (no ballots or per-warp flags in shared memory).
      keys[warp * 32 + lane] = make_uint4(k[0] | sall, k[1], k[2], k[3]);
    }
  };
  int row0, cnt;
  if (early) {  // CTA-uniform. The keys of the early rows do not wait for warp 0's look-up: one barrier
    // serves both; a look-up that disagrees (a wrongly set flag) loads the rows and takes the keys again.
    column_keys();
    __syncthreads();
    row0 = s_row0;
    cnt = s_cnt;
    if (row0 != early_row0 || cnt != early_cnt) {
      if (cnt > 0) {
        load_rows(row0, cnt);
        column_keys();
      }
      __syncthreads();
    }
  } else {
    __syncthreads();
    row0 = s_row0;
    cnt = s_cnt;
    if (cnt > 0) {
      load_rows(row0, cnt);
      column_keys();
    }
    __syncthreads();
  }
  if (cnt > 0) {  // CTA-uniform
    // Rows of the output this CTA writes in step 4. With segments at offsets that all start on multiples
    // of 32, the rows from a segment's end to the next multiple of 32 lie outside every segment: the
    // group that ends there writes them too, as the zeros its tile holds past its rows, so that its last
    // 32-byte sector is whole (the zero pass below leaves them; a warp per row writing those bytes one
    // by one cost more than the conversion).
    const int stored = kAtOffsets && s_fill32 ? static_cast<int>(min((row0 + cnt + 31LL) & ~31LL, p.rows) - row0) : cnt;
    // Step 4 as one tensor copy of the tile when its box holds exactly these rows (128 of them, or the
    // last rows of the input: the copy stops at N) and they start on a 16-byte boundary (copies at
    // other rows stopped the kernel with an illegal-instruction error): the tile's way out of the SM is
    // what bounds the kernel, and one copy takes it faster than the threads' 16-byte stores.
    const bool boxed = box_store && stored == cnt && (row0 & 15) == 0 && (cnt == kTileRows || row0 + cnt == p.rows);
    // 2. Column tid: lane tid / 8 of each warp, key tid % 8.
    {
      const int o = tid >> 3, j = tid & 7, col = ch * kTileCols + tid;
      const uint32_t* kp = reinterpret_cast<const uint32_t*>(keys) + 4 * o + byte_key_word(j);
      // A NaN scale byte in any row of lanes 4k .. 4k+3 (MX block k) makes the block NaN; a byte above
      // 251 in lane o's rows takes exact keys.
      bool nan_block, lane_big;
      uint32_t kw = 0u;
      if constexpr (kAtOffsets) {
        uint32_t nb = 0u, bb = 0u;
#pragma unroll
        for (int w = 0; w < kColWarps; ++w) {
          kw = max_u16x2(kw, kp[w * 32 * 4]);
          nb |= s_nan[w];
          bb |= s_big[w];
        }
        nan_block = ((nb >> (o & ~3)) & 0xFu) != 0u;
        lane_big = ((bb >> o) & 1u) != 0u;
      } else {
        uint32_t smax = 0u;  // lane o's largest scale byte over the 8 warps (in threads j = 0)
#pragma unroll
        for (int w = 0; w < kColWarps; ++w) {
          const uint32_t v = kp[w * 32 * 4];
          kw = max_u16x2(kw, v);
          smax = max(smax, v & 0xFFu);
        }
        // This warp's threads are the columns of lanes 4k .. 4k+3.
        nan_block = __any_sync(0xFFFFFFFFu, j == 0 && smax == kUe8m0Nan);
        lane_big = __shfl_sync(0xFFFFFFFFu, smax, tid & 24) > kByteKeyMaxScale;
      }
      uint32_t x = kUe8m0Nan;  // the scale byte, 0x100 for an all-zero column
      if (!nan_block) {
        x = lane_big && col < p.hidden ? exact_column_scale_byte(p, row0, cnt, col)  // rare
                                       : byte_key_scale_byte((kw >> byte_key_shift(j)) & 0xFFu);
      }
      const uint32_t sb = x & 0xFFu;
      const bool zero = x == 0x100u;
      if (col < p.hidden) p.out_scales[static_cast<long long>(g) * p.hidden + col] = ue8m0_value(sb);  // 1 KB per CTA
      info[tid] = static_cast<uint16_t>(sb | (zero ? 0x100u : 0u));
      // Step 3's per-lane setup, made here by the 8 threads of lane o's columns (consecutive threads
      // of one warp): the fast formula's bytes (an all-zero column takes the largest byte of the
      // lane's other columns, or 5), their range, and whether a column is NaN.
      const int q = tid & 24;  // the 8 threads' bits in a warp ballot
      const bool any_special = ((__ballot_sync(0xFFFFFFFFu, sb == kUe8m0Nan) >> q) & 0xFFu) != 0u;
      const bool any_live = ((__ballot_sync(0xFFFFFFFFu, !zero) >> q) & 0xFFu) != 0u;
      uint32_t fm = zero ? 0u : sb;
      fm = max(fm, __shfl_xor_sync(0xFFFFFFFFu, fm, 1));
      fm = max(fm, __shfl_xor_sync(0xFFFFFFFFu, fm, 2));
      fm = max(fm, __shfl_xor_sync(0xFFFFFFFFu, fm, 4));
      const uint32_t c = zero ? (any_live ? fm : 5u) : sb;
      uint32_t cmn = c, cmx = c;
#pragma unroll
      for (int m = 1; m < 8; m <<= 1) {
        cmn = min(cmn, __shfl_xor_sync(0xFFFFFFFFu, cmn, m));
        cmx = max(cmx, __shfl_xor_sync(0xFFFFFFFFu, cmx, m));
      }
      uint32_t word = (c - 5u) << (8 * (j & 3));
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 1);
      word |= __shfl_xor_sync(0xFFFFFFFFu, word, 2);
      uint32_t* li = reinterpret_cast<uint32_t*>(&s_lane_info[o]);
      if ((j & 3) == 0) li[j >> 2] = word;
      if (j == 0) li[2] = cmn | (cmx << 8) | (any_special ? 0x10000u : 0u);
    }
    __syncthreads();
    // 3. Convert the lane's 16 rows x 8 columns; 16 bytes per column into the tile.
    bool fast;
    {
      const uint4 li = s_lane_info[lane];
      const uint32_t cw_lo = li.x, cw_hi = li.y;
      const int cmin = static_cast<int>(li.z & 0xFFu), cmax = static_cast<int>((li.z >> 8) & 0xFFu);
      const bool special = (li.z >> 16) != 0u;
      fast = !special && cmin >= 5 && cmax - cmin <= 15 && cmax - static_cast<int>(smn) <= kShiftWrap;
      const uint32_t s_idle = static_cast<uint32_t>(cmax - 5);
      uint32_t out[8][4];
      if (fast) {
        uint32_t range = 0u;  // the shifts' bytes ORed: bits 4-7 set by a shift outside [0, 15]
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          uint32_t rlo[4], rhi[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t w = wd[4 * a + q];
            const uint32_t srep = ((w & 0x77777777u) != 0u ? sv[4 * a + q] : s_idle) * 0x01010101u;
            const uint32_t x_lo = srep - cw_lo, x_hi = srep - cw_hi;  // bytes S - sb + 5, checked below
            range |= x_lo | x_hi;
            fast_word_e4m3(w, x_lo, x_hi, rlo[q], rhi[q]);
          }
          transpose4x4(rlo[0], rlo[1], rlo[2], rlo[3], out[0][a], out[1][a], out[2][a], out[3][a]);
          transpose4x4(rhi[0], rhi[1], rhi[2], rhi[3], out[4][a], out[5][a], out[6][a], out[7][a]);
        }
        fast = (range & 0xF0F0F0F0u) == 0u;
      }
      if (fast) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<uint4*>(tile + tile_slot<true>(8 * lane + j, warp)) =
              make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
        }
        if (boxed) fence_proxy_async_shared();  // the tile's bytes, for the tensor copy
      }
    }
    if (__syncthreads_or(!fast)) {  // CTA-uniform, rare
      // Per element through the table (subnormal results, underflow, saturated or NaN columns), for
      // the lanes the fast formula does not cover. The table is copied only here, not in step 2 of
      // every CTA; the rows are loaded again (from the L2): the fast attempt did not keep them.
      if (tid < kColKRows * 2) reinterpret_cast<uint32_t*>(ktable)[tid] = __ldg(&kKTable.word[tid]);
      __syncthreads();
      if (!fast) {
        load_rows(row0, cnt);
        const uint4 iv = reinterpret_cast<const uint4*>(info)[lane];  // the 8 columns' scale bytes
        const uint32_t sbw_lo = __byte_perm(iv.x, iv.y, 0x6420), sbw_hi = __byte_perm(iv.z, iv.w, 0x6420);
        window_rows_per_element<true>(tile, ktable, wd, sv, lane, warp,
                                      [=](int) { return make_uint4(sbw_lo, sbw_hi, 0u, 0u); });
        if (boxed) fence_proxy_async_shared();
      }
      __syncthreads();
    }
    // 4. The tile's columns to the output (rows [0, stored) of each).
    if (boxed) {
      if (tid == 0) store_box(out_box, tile, static_cast<int>(row0), ch * (kTileCols / 8));
    } else {
      tile_store<true>(tile, p.out + static_cast<long long>(ch) * kTileCols * p.out_stride + row0, p.out_stride,
                       min(kTileCols, p.hidden - ch * kTileCols), stored, tid);
    }
  }

  // Columns of rows outside every segment are zero.
  const long long covered = s_covered;
  if (!kAtOffsets && covered >= p.rows) return;
  const long long gwarp = (static_cast<long long>(blockIdx.x) * kThreads + tid) >> 5;
  const long long num_warps = (static_cast<long long>(gridDim.x) * kThreads) >> 5;
  if (!kAtOffsets) {
    // Back to back: rows [covered, N) are outside, bytes [covered, N) of every output row; a warp per
    // output row, whole 16-byte pieces between the ends (not a warp per input row storing single bytes
    // H apart).
    const bool al = ((reinterpret_cast<uintptr_t>(p.out) | static_cast<uintptr_t>(p.out_stride)) & 15) == 0;
    const long long a = al ? (covered + 15) & ~15LL : p.rows, e = al ? p.rows & ~15LL : p.rows;
    for (long long hr = gwarp; hr < p.hidden; hr += num_warps) {
      uint8_t* o = p.out + hr * p.out_stride;
      for (long long b = covered + lane; b < min(a, p.rows); b += 32) o[b] = 0;
      for (long long b = a + 16 * lane; b < e; b += 512) *reinterpret_cast<uint4*>(o + b) = make_uint4(0u, 0u, 0u, 0u);
      for (long long b = max(a, e) + lane; b < p.rows; b += 32) o[b] = 0;
    }
    return;
  }
  // At offsets: a warp per (32-row window, part of the output rows), which finds the window's rows to
  // zero (outside every segment and, with s_fill32, past every segment's filled end; each lane takes a
  // segment's rows in the window as a bit mask, ORed over the warp) and writes them in its output rows,
  // by whole 16-byte pieces where they cover one (not a warp per row storing its bytes H rows apart).
  const bool fill32 = s_fill32;
  const bool al = ((reinterpret_cast<uintptr_t>(p.out) | static_cast<uintptr_t>(p.out_stride)) & 15) == 0;
  const long long windows32 = (p.rows + 31) / 32;
  const int hsplit = zero_hsplit(windows32, chunks);
  const long long hstep = static_cast<long long>((chunks + hsplit - 1) / hsplit) * kTileCols;  // output rows per task
  for (long long task = gwarp; task < windows32 * hsplit; task += num_warps) {
    const long long w = task / hsplit, r0 = 32 * w;
    const long long h0 = (task - w * hsplit) * hstep;
    uint32_t covered_rows = 0u;
    for (int base = 0; base < seg.num; base += 32) {
      const int e = base + lane;
      uint32_t mk = 0u;
      const long long len = e < seg.num ? load_index(seg.lens, seg.is64, e) : 0;
      if (len > 0) {
        const long long off = load_index(seg.offsets, seg.is64, e);
        const long long end = fill32 ? (off + len + 31) & ~31LL : off + len;
        const int lo = static_cast<int>(max(off - r0, 0LL)), hi = static_cast<int>(min(end - r0, 32LL));
        if (lo < hi) mk = (hi - lo == 32 ? 0xFFFFFFFFu : (1u << (hi - lo)) - 1u) << lo;
      }
      covered_rows |= __reduce_or_sync(0xFFFFFFFFu, mk);
    }
    const long long nvalid = min(32LL, p.rows - r0);
    const uint32_t m = (nvalid >= 32 ? 0xFFFFFFFFu : (1u << nvalid) - 1u) & ~covered_rows;  // warp-uniform
    if (m == 0u) continue;
    // Lanes 2 i and 2 i + 1 take the window's two 16-byte pieces in output rows h0 + i, h0 + i + 16, ...:
    // a whole piece by one store, else its bytes one by one.
    const int piece = lane & 1;
    const uint32_t pm = (m >> (16 * piece)) & 0xFFFFu;
    const long long h_end = min(static_cast<long long>(p.hidden), h0 + hstep);
    for (long long h = h0 + (lane >> 1); pm != 0u && h < h_end; h += 16) {
      uint8_t* o = p.out + h * p.out_stride + r0 + 16 * piece;
      if (pm == 0xFFFFu && al && r0 + 16 * piece + 16 <= p.rows) {
        *reinterpret_cast<uint4*>(o) = make_uint4(0u, 0u, 0u, 0u);
      } else {
        for (int b = 0; b < 16; ++b) {
          if ((pm >> b) & 1u) o[b] = 0;
        }
      }
    }
  }
}

// ---- Second pass of the two-pass path as CTA tiles: one CTA per (aligned window of 128 tokens, 256
// hidden columns). ----
// The tile kernel's loads, conversion and stores (steps 3 and 4) without its maxima: each row takes
// its group's record from the first pass (the group of every row from row_groups, -1 outside every
// segment: zero codes). The window owns every byte of its output columns (rows of any number of
// groups and experts, and rows outside every segment, which become zero), so every store is a whole
// aligned 16-byte piece that no other CTA writes (the output's row stride is a multiple of 32; only
// the last window's tail, past N, is stored by bytes). A warp's 16 rows take the
// records of the groups of its first and last rows (a warp whose rows meet a third group, possible
// only with groups shorter than 16 rows, converts per element with each row's own record). Windows
// run last first: the rows the first pass read last may still be in the L2.
// 4 CTAs per SM (64 registers) with word loads (more loads in flight than at 3); 2 for byte loads,
// which would spill at 3 (the binding sends them only one-row views with an odd stride). Full windows
// load their rows without a test per row, and each warp takes its rows' groups by ballots (the per-row
// tests cost about 300 instructions per thread).
template <bool kVec4>
__global__ void __launch_bounds__(kThreads, kVec4 ? 4 : 2)
    sm90_mxfp4_rows_to_fp8_cols_window_kernel(const Mxfp4RowsToFp8ColsParams p, DivU32 by_windows) {
  __shared__ __align__(16) uint8_t tile[kTileBytes];
  __shared__ __align__(4) uint8_t ktable[kColKRows * 8];  // E4M3 magnitudes (kKTable)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long n = p.rows;
  const long long windows = (n + kTileRows - 1) / kTileRows;
  // Column raster, as the one-pass kernel.
  const int ch = static_cast<int>(div_u32(blockIdx.x, by_windows));
  const long long v = blockIdx.x - static_cast<long long>(ch) * windows;
  const long long row0 = (windows - 1 - v) * kTileRows;
  const int cnt = static_cast<int>(min(static_cast<long long>(kTileRows), n - row0));
  const int c8 = ch * kTileCols + 8 * lane;  // this lane's first hidden column
  const bool active = c8 < p.hidden;
  const int rbase = 16 * warp;
  const uint4* records = reinterpret_cast<const uint4*>(p.col_records);
  const long long rec_stride = p.hidden / 8;
  const uint4 outside = make_uint4(0x05050505u, 0x05050505u, 0x0505u, 0u);  // rows outside: zero codes
  auto record = [&](int g) { return (g >= 0 && active) ? __ldg(records + g * rec_stride + c8 / 8) : outside; };
  uint32_t wd[16], sv[16];
  {
    const uint8_t* prow = p.packed + (row0 + rbase) * p.packed_stride + c8 / 2;
    const uint8_t* srow = p.scales + (row0 + rbase) * p.scales_stride + c8 / kMxBlock;
    if (active && rbase + 16 <= cnt) {  // the common case without per-row tests
#pragma unroll
      for (int i = 0; i < 16; ++i) load_lane_row<kVec4>(p, prow, srow, i, wd[i], sv[i]);
    } else {
      const int last = cnt - 1 - rbase;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        wd[i] = sv[i] = 0u;
        if (active && i <= last) load_lane_row<kVec4>(p, prow, srow, i, wd[i], sv[i]);
      }
    }
  }
  // The per-element path's table, copied while the rows are in flight (its barrier after the loads
  // are issued, so they do not wait for it).
  if (tid < kColKRows * 2) reinterpret_cast<uint32_t*>(ktable)[tid] = __ldg(&kKTable.word[tid]);
  __syncthreads();
  grid_wait();  // the rows are in flight; the groups and records come from the scale kernel
  // The warp's 16 rows' groups, one per lane (lanes 16-31 repeat them): the same for every lane, so
  // taken once by ballots rather than by every lane per row.
  const int grp_l = p.row_groups[row0 + rbase + (lane & 15)];  // padded to whole windows
  const int g_first = __shfl_sync(0xFFFFFFFFu, grp_l, 0), g_last = __shfl_sync(0xFFFFFFFFu, grp_l, 15);
  // Rows of the groups of the warp's first and last rows take those two records (the common case,
  // the same for every lane); a warp whose rows meet a third group (groups shorter than 16 rows)
  // converts per element with each row's own record.
  const bool two = __all_sync(0xFFFFFFFFu, grp_l == g_first || grp_l == g_last);
  const uint32_t use_b = __ballot_sync(0xFFFFFFFFu, grp_l != g_first) & 0xFFFFu;
  const uint32_t out_rows = __ballot_sync(0xFFFFFFFFu, grp_l < 0) & 0xFFFFu;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if ((out_rows >> i) & 1u) wd[i] = sv[i] = 0u;  // rows outside every segment: zero codes
  }
  if (two) {
    const uint4 rec_a = record(g_first);
    const uint4 rec_b = g_last != g_first ? record(g_last) : rec_a;
    // Fast formula valid for every row: the record's bytes in [5, 254] within 15 of each other, and
    // S - byte + 5 in [0, 15] for each byte of a row with a nonzero code (all-zero rows take S =
    // max - 5, which puts every shift in range).
    const uint32_t mn_a = rec_a.z & 0xFFu, mx_a = (rec_a.z >> 8) & 0xFFu;
    const uint32_t mn_b = rec_b.z & 0xFFu, mx_b = (rec_b.z >> 8) & 0xFFu;
    bool fast = mx_a != kUe8m0Nan && mn_a >= 5u && mx_a - mn_a <= 15u && mx_b != kUe8m0Nan && mn_b >= 5u &&
                mx_b - mn_b <= 15u;
    // Every row's S - byte + 5 in [0, 15] for both records' bytes: the rows' smallest and largest
    // scale bytes against both records' ranges (conservative when the warp's rows meet two groups;
    // one test for the warp's rows, not one per row).
    uint32_t smn = 255u, smx = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t mx = ((use_b >> i) & 1u) ? mx_b : mx_a;
      sv[i] = (wd[i] & 0x77777777u) != 0u ? sv[i] : mx - 5u;
      smn = min(smn, sv[i]);
      smx = max(smx, sv[i]);
    }
    fast = fast && smn + 5u >= max(mx_a, mx_b) && smx + 5u - min(mn_a, mn_b) <= 15u;
    const uint32_t cwa_lo = rec_a.x - 0x05050505u, cwa_hi = rec_a.y - 0x05050505u;
    const uint32_t cwb_lo = rec_b.x - 0x05050505u, cwb_hi = rec_b.y - 0x05050505u;
    if (fast) {
      uint32_t out[8][4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        uint32_t rlo[4], rhi[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int i = 4 * a + q;
          const bool b = (use_b >> i) & 1u;
          const uint32_t srep = sv[i] * 0x01010101u;
          const uint32_t x_lo = srep - (b ? cwb_lo : cwa_lo);  // bytes S - sb + 5 in [0, 15]
          const uint32_t x_hi = srep - (b ? cwb_hi : cwa_hi);
          fast_word_e4m3(wd[i], x_lo, x_hi, rlo[q], rhi[q]);
        }
        transpose4x4(rlo[0], rlo[1], rlo[2], rlo[3], out[0][a], out[1][a], out[2][a], out[3][a]);
        transpose4x4(rhi[0], rhi[1], rhi[2], rhi[3], out[4][a], out[5][a], out[6][a], out[7][a]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<uint4*>(tile + tile_slot<false>(8 * lane + j, warp)) = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
      }
    } else {
      window_rows_per_element<false>(tile, ktable, wd, sv, lane, warp, [=](int i) { return ((use_b >> i) & 1u) ? rec_b : rec_a; });
    }
  } else {
    int grp[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) grp[i] = __shfl_sync(0xFFFFFFFFu, grp_l, i);
    window_rows_per_element<false>(tile, ktable, wd, sv, lane, warp, [&](int i) { return record(grp[i]); });
  }
  __syncthreads();
  tile_store<false>(tile, p.out + static_cast<long long>(ch) * kTileCols * p.out_stride + row0, p.out_stride,
             min(kTileCols, p.hidden - ch * kTileCols), cnt, tid);
}


// The tensor map of the one-pass kernel's tile stores: the output [H, N] (row stride out_stride) viewed as
// [8 (c % 8)][H / 8 (c / 8)][N bytes], boxes of [8][32][128] with the 128-byte swizzle (tile_slot<true>).
// False (the threads store the tiles) without p.box_store, without the driver's encoder, or for an
// output the map cannot describe (not 16-byte aligned).
bool output_box_map(const Mxfp4RowsToFp8ColsParams& p, CUtensorMap& map) {
  if (!p.box_store) return false;
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not sticky: the launch below must not report it
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(p.out) & 15) != 0 || (p.out_stride & 15) != 0 ||
      p.hidden % 8 != 0) {
    return false;
  }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.rows), static_cast<cuuint64_t>(p.hidden / 8), 8};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(8 * p.out_stride), static_cast<cuuint64_t>(p.out_stride)};
  const cuuint32_t box[3] = {kTileRows, kTileCols / 8, 8}, unit[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p.out, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

// A kernel of the two-pass path, launched as a programmatic dependent of the previous kernel.
template <typename Kernel>
cudaError_t launch_dependent(Kernel kernel, unsigned blocks, const Mxfp4RowsToFp8ColsParams& p, DivU32 div,
                             cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p, div);
}

}  // namespace

cudaError_t launch_mxfp4_rows_to_fp8_cols(const Mxfp4RowsToFp8ColsParams& p, cudaStream_t stream) {
  const bool two_pass = p.col_records != nullptr && p.row_groups != nullptr;
  const bool empty = p.rows <= 0 || p.hidden <= 0;
  // Rows read as 4-byte words (else bytes: only one-row views with an odd stride reach here).
  const bool vec4 = ((p.packed_stride & 3) == 0) && ((reinterpret_cast<uintptr_t>(p.packed) & 3) == 0);
  const long long chunks = (p.hidden + kTileCols - 1) / kTileCols;
  const long long windows = (p.rows + kTileRows - 1) / kTileRows;
  // Two-pass path with offsets: every row's group starts at -1 (outside every segment); without
  // offsets the prepare kernel marks the rows past the segments.
  if (two_pass && !empty && p.segments.offsets != nullptr) {
    const cudaError_t err =
        cudaMemsetAsync(p.row_groups, 0xFF, static_cast<size_t>(windows * kTileRows) * sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  // The group offsets of an empty input, and the groups' rows for the two-pass path (the one-pass
  // kernel finds its group itself).
  if (two_pass || empty) sm90_mxfp4_rows_to_fp8_cols_prepare_kernel<<<1, 1024, 0, stream>>>(p);
  if (empty) return cudaGetLastError();
  if (!two_pass) {
    long long blocks = p.num_groups * chunks;
    // Rows outside every segment are zeroed by a grid-stride loop over warps after the tiles: a warp
    // per zero task with offsets (zero_hsplit), per output row without, at least (a grid sized by the
    // groups alone leaves one CTA for all of them when there are few groups).
    const long long windows32 = (p.rows + 31) / 32;
    const long long zero_warps =
        p.segments.offsets != nullptr ? windows32 * zero_hsplit(windows32, static_cast<int>(chunks)) : p.hidden;
    if (blocks * kColWarps < zero_warps) blocks = (zero_warps + kColWarps - 1) / kColWarps;
    if (blocks < 1) blocks = 1;
    GroupHints hints;
    hints.num = 0;
    if (p.host_splits != nullptr && p.rows <= INT_MAX) {  // the table from the caller's host splits
      int n = 0;
      const long long groups = column_groups_of(p.host_splits, p.host_splits + p.num_host_splits, p.num_host_splits,
                                                [&](long long first, long long count) {
                                                  if (n < kMaxColumnGroupHints) {
                                                    hints.g[n++] = make_int2(static_cast<int>(first), static_cast<int>(count));
                                                  }
                                                });
      hints.num = groups <= kMaxColumnGroupHints ? n : 0;
    }
    CUtensorMap out_box{};
    const bool box_store = output_box_map(p, out_box);
    auto launch = [&](auto kernel) -> cudaError_t {
      const cudaError_t err = allow_dynamic_smem(kernel, kTileSmem);
      if (err != cudaSuccess) return err;
      kernel<<<static_cast<unsigned>(blocks), kThreads, kTileSmem, stream>>>(
          p, make_div_u32(static_cast<uint32_t>(p.num_groups > 0 ? p.num_groups : 1)), hints, out_box, box_store);
      return cudaGetLastError();
    };
    const bool at_offsets = p.segments.offsets != nullptr;
    if (vec4) return at_offsets ? launch(sm90_mxfp4_rows_to_fp8_cols_tile_kernel<true, true>) : launch(sm90_mxfp4_rows_to_fp8_cols_tile_kernel<true, false>);
    return at_offsets ? launch(sm90_mxfp4_rows_to_fp8_cols_tile_kernel<false, true>) : launch(sm90_mxfp4_rows_to_fp8_cols_tile_kernel<false, false>);
  }
  // Pass 1: every row's group and the groups' scales and records; pass 2: the output. Each starts
  // while the previous kernel ends (programmatic dependent launch).
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const long long scale_blocks = p.num_groups * ((p.hidden + kScaleCols - 1) / kScaleCols);
  if (scale_blocks > 0) {
    err = launch_dependent(sm90_mxfp4_rows_to_fp8_cols_scales_kernel, static_cast<unsigned>(scale_blocks), p,
                           make_div_u32(static_cast<uint32_t>((p.hidden + kScaleCols - 1) / kScaleCols)), stream);
    if (err != cudaSuccess) return err;
  }
  const unsigned window_blocks = static_cast<unsigned>(windows * chunks);
  const DivU32 by_windows = make_div_u32(static_cast<uint32_t>(windows));
  return vec4 ? launch_dependent(sm90_mxfp4_rows_to_fp8_cols_window_kernel<true>, window_blocks, p, by_windows, stream)
              : launch_dependent(sm90_mxfp4_rows_to_fp8_cols_window_kernel<false>, window_blocks, p, by_windows, stream);
}

}  // namespace moe_fp4
