// Weight-only packed projections for a decode step's rows (int4 / int8 values with per-group scales, FP8 e4m3
// values with a scale per output feature; bf16 activations, fp32 accumulation), on the tensor cores' register
// fragments.
//
// Why CUDA: the Triton small-linear kernel dequantizes every value in fp32 (shift, mask, convert, multiply,
// add, round: ~8 instructions a value) and so reads int4 weights at ~1 TB/s, a fifth of what HBM gives.
// Here a warp copies each weight tile with one 16-byte cp.async per thread into a ring in shared memory, each
// thread's 16 bytes being the register fragments the MMA reads (the export writes the weights in that order:
// models/mma_order.py), several chunks in flight a warp; it turns two 4-bit values into two
// exact bf16 integers with one LOP3 and one bf16x2 FMA (the 0x4300 | q = 128 + q trick), and multiplies the
// integers on the tensor cores; each group's scale (and min) is applied to the fp32 sums after the MMAs,
// which is both fewer instructions and one rounding fewer than dequantizing to bf16 first.
//
// Swap A and B: the weight is the MMA's A (16 output features x 16 values), the rows of x its B (8 rows per
// n-tile): one row uses one column of the n-tile, so a row's arithmetic never depends on the others (batch
// invariance: each row's bits are the same whatever the batch; the folds' sums are per row as well).
// One CTA per 16 output features (and, for a fused gate/up weight, the 16 matching up features) and block of
// rows; its 8 warps take the reduction dimension's 64-value chunks in turn (split-K inside the CTA) and add
// their sums in a fixed tree at the end, so that every SM streams weights even for the 4096-wide projections.
//
// Tile order (one 16-feature tile, one chunk of CH values: 32 lanes x 16 bytes; lane = 4 g + t):
//   int4 (CH 64): word j (one 16-value MMA step) nibble 4r + 16e = element e of fragment register r, i.e.
//     W[g + 8 (r & 1)][16 j + 4 t + 2 (r >> 1) + e]; x's matching values are x[row][16 j + 4 t + 0..3].
//   int8 (CH 32): word 2 j + h, byte 2 e + p = W[g + 8 h][16 j + 4 t + 2 p + e].
//   scales (and mins): [tile][K / group][16].
// The reduction index is permuted (a thread's fragment slots 2t, 2t+1, 2t+8, 2t+9 hold 4 consecutive values)
// identically in A and B, so the products are the same; a step's 16 values stay inside one group.
//   f8r (row-major e4m3 [N, K], as stored: cuBLAS's FP8 GEMM reads the same bytes for more rows): a stage is 64
//     values, a thread's two 16-byte copies rows g and g + 8 at values 16 t .. 16 t + 15; step j's fragment is
//     word j of each, W[g (+ 8)][16 t + 4 j + 0..3], and x's matching values x[row][16 t + 4 j + 0..3].

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mma_common.cuh"
#include "packed_linear.h"

namespace onecopy_native {

namespace {

using namespace mma;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

// A block's partial sums, added in a fixed tree over its W warps (w += w + W / 2, then + W / 4, ...; for 8 warps
// ((w0 + w4) + (w2 + w6)) + ((w1 + w5) + (w3 + w7))): the order never depends on the rows. `red` holds W / 2 x N x
// 32 floats; warp 0 returns with the totals.
template <int W, int N>
__device__ __forceinline__ void reduce_warps(float (&v)[N], float* red, int warp, int lane) {
#pragma unroll
  for (int half = W / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int i = 0; i < N; ++i) red[((warp - half) * N + i) * 32 + lane] = v[i];
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] += red[(warp * N + i) * 32 + lane];
    }
    __syncthreads();
  }
}

// reduce_warps's sum of C values v[0], v[St], v[2 St], ... in its order (the same bits).
template <int C, int St>
__device__ __forceinline__ float tree_sum(const float* v) {
  if constexpr (C == 1) return v[0];
  else return tree_sum<C / 2, 2 * St>(v) + tree_sum<C / 2, 2 * St>(v + St);
}

// x's rows staged in shared memory (one coalesced read per CTA, the norm's weight applied once) where that pays
// and they fit (plan_for, smem_fits); other blocks read their B fragments from global memory (L2) in the loop. Same values
// either way: a row's bits do not depend on which.

// x times the norm's weight w, each product rounded to bf16 as the eager x * w (8 values).
__device__ __forceinline__ uint4 times_norm(uint4 v, uint4 w) {
  v.x = pack_bf16(lo_f(v.x) * lo_f(w.x), hi_f(v.x) * hi_f(w.x));
  v.y = pack_bf16(lo_f(v.y) * lo_f(w.y), hi_f(v.y) * hi_f(w.y));
  v.z = pack_bf16(lo_f(v.z) * lo_f(w.z), hi_f(v.z) * hi_f(w.z));
  v.w = pack_bf16(lo_f(v.w) * lo_f(w.w), hi_f(v.w) * hi_f(w.w));
  return v;
}

// A packed kernel's stage: a pair of a warp's chunks (2 p and 2 p + 1: 1 KB of a tile's int4 weights, read as
// one piece), so that the bookkeeping of a copy, a wait and the scales is paid once for 128 int4 values (64 int8)
// and a g128 group's scale is applied once. Per stage: each thread's 2 G weight words (16 bytes each) and each
// warp's scale rows (the 16 scales, and mins, of the pair's tile and scale periods: 64 bytes each, copied 16
// bytes a lane); as many stages as fit kRingBytes (2 to 8). 54 KB: 6 stages of a one-weight CTA (5 pairs a warp
// in flight), 3 of a fused gate/up one; three CTAs an SM with a row of x. H200, one row, q4a, ring of 36 / 54 / 72
// / 100 KB (benchmarks/packed_linear_rings.sh): down 4096x14336 23.6 / 16.5 / 18.8 / 18.8 us, o 8.0 / 7.8 / 7.1 /
// 7.1, gate/up 27.5 / 26.0 / 25.9 / 30.5, the LM head 94 at all four. A 16-warp CTA (`plan_for`) has a ring
// of its own size.
#ifndef ONECOPY_RING_KB
#define ONECOPY_RING_KB 54
#endif
#ifndef ONECOPY_RING16_KB
#define ONECOPY_RING16_KB 72
#endif
#ifndef ONECOPY_RING_WIDE_KB
#define ONECOPY_RING_WIDE_KB 112
#endif
// G: weight tiles a stage (the kernel's G x T); Wide: T > 1, one CTA an SM: 3 stages of 4 int4 tiles (2 stages, a
// 74 KB ring, measured the same: results/packed_linear_wide_h100.txt).
template <int L, int GS, int G, int W, bool Wide = false>
struct Ring {
  static constexpr int kRingBytes = (Wide ? ONECOPY_RING_WIDE_KB : W == 8 ? ONECOPY_RING_KB : ONECOPY_RING16_KB) * 1024;
  static constexpr int kCh = L == kQ8sMma || L == kF8r ? 32 : 64;     // values a chunk of the tile order
  static constexpr int kStageSteps = 2 * kCh / 16;                     // MMA steps a stage
  static constexpr int kP = kStageSteps / GS;                          // scale periods a stage
  static constexpr int kScaleRows = L == kQ4aMma ? 2 : L == kF8r ? 0 : 1;  // scales (and mins); f8r's: at the end
  static constexpr int kScaleCopies = G * kP * kScaleRows * 4;         // 16-byte copies a stage and warp
  static constexpr int kPerStage = 32 * W * 32 * G + W * kScaleCopies * 16;
  static constexpr int kFit = kRingBytes / kPerStage;
  static constexpr int kStages = kFit > 8 ? 8 : kFit < 2 ? 2 : kFit;
  static constexpr int kBytes = kStages * kPerStage;
  static_assert(kScaleCopies <= 128, "at most four 16-byte scale copies a lane and stage");
};

// f8r values as bf16, exactly, in one of two forms (ONECOPY_F8R_CVT, the harness's A/B builds):
// - 0: bytes 1 and 3 of a word (each the high byte of a 16-bit half) keep their signs and move their exponent and
//   mantissa down 4 bits into bf16's, so each is the e4m3 value times 2^-120 (bf16's exponent bias is 127, e4m3's
//   7; e4m3's subnormals become bf16's), in three integer instructions a pair (Marlin's FP8 dequantization, with
//   bf16's wider exponent); bytes 0 and 2 the same after a shift. A register then holds values 0 and 2 (or 1 and 3)
//   of a step's 4, and x's B fragment is permuted alike (two byte permutes).
// - 1: cvt.rn.f16x2.e4m3x2 (exact), then f16 -> bf16 by moving exponent and mantissa down 3 bits, keeping f16's
//   bias: the value times 2^-112, normal. The same bits (12 dumped cases with random bytes, e4m3's subnormals
//   among them: the tensor cores take bf16's exactly), slower (H200, one row: gate/up 45.0 us against 42.5, int8's
//   35.2; results/packed_linear_f8r_h200.txt).
// The epilogue multiplies the 2^120 (2^112) back with the feature's scale. sm_89+ (the f8r ops check it).
#ifndef ONECOPY_F8R_CVT
#define ONECOPY_F8R_CVT 0
#endif
constexpr float kF8rUnscale = ONECOPY_F8R_CVT ? 0x1p112f : 0x1p120f;

__device__ __forceinline__ uint32_t e4m3_high_bytes_bf16x2(uint32_t v) {
  return (v & 0x80008000u) | ((v & 0x7f007f00u) >> 4);
}

__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t two) {  // (the cvt form) the low 16 bits' two values
  uint32_t h = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<unsigned short>(two)));
#endif
  return ((h >> 3) & 0x0fff0fffu) | (h & 0x80008000u);
}

// MMA step j's A fragment of an f8r stage (lo: row g's 16 bytes, hi: row g + 8's): values 4 j .. 4 j + 3 of each,
// in the order x_frags gives B's (0 and 2, then 1 and 3; the cvt form 0 and 1, then 2 and 3).
__device__ __forceinline__ void f8r_step(const uint4& lo, const uint4& hi, int j, uint32_t (&a)[4]) {
  const uint32_t l[4] = {lo.x, lo.y, lo.z, lo.w}, h[4] = {hi.x, hi.y, hi.z, hi.w};
#if ONECOPY_F8R_CVT
  a[0] = e4m3x2_bf16x2(l[j]);
  a[1] = e4m3x2_bf16x2(h[j]);
  a[2] = e4m3x2_bf16x2(l[j] >> 16);
  a[3] = e4m3x2_bf16x2(h[j] >> 16);
#else
  a[0] = e4m3_high_bytes_bf16x2(l[j] << 8);
  a[1] = e4m3_high_bytes_bf16x2(h[j] << 8);
  a[2] = e4m3_high_bytes_bf16x2(l[j]);
  a[3] = e4m3_high_bytes_bf16x2(h[j]);
#endif
}

// L: layout; NT: 8-row n-tiles per CTA; GS: MMA steps per scale (a group's share of a stage); G: 2 with a
// fused gate/up weight; W: warps (8, or 16 where the tiles are too few to fill the SMs: `plan_for`); S: x staged in shared memory (dynamic, after the ring; rows K + 8 values apart: no bank
// conflicts), and for int4 each row's sums over each scale period computed there once.
//
// Persistent: a CTA takes tiles blockIdx.y, + gridDim.y, ... (the launch sizes the grid to the CTAs that fit at
// once), so x is staged, the norm's 1 / rms found and the ring filled once a CTA, not once a tile; a warp's stage
// stream runs on across its CTA's tiles, so the ring never drains between them.
//
// int4 values enter the MMA as the exact bf16 integers 128 + q (one LOP3 a pair, no bias subtraction): the
// bias comes back per scale period through x's sum over the period, s (sum x (128 + q) - b sum x) + m sum x
// (b = 136 for q4z's q - 8, 128 for q4a), exact algebra; the sums stay far inside fp32's range and precision.
//
// T > 1 (wide, 9-16 rows): a CTA takes T neighbouring tiles at once and each B fragment of x read feeds the MMAs of
// all T, so x's traffic from L2 is a T-th of one tile's (at 16 rows, one tile at a time read 4 bytes of x for each
// byte of int4 weight). A tile's sums keep the same order (the warps' pairs, reduce_warps's tree): the same bits as
// T = 1, so T may follow the rows.
template <int L, int NT, int GS, int G, bool S, int W, int T = 1>
__global__ void __launch_bounds__(32 * W, T > 1 ? 1 : (NT == 1 ? 4 : 2) * 8 / W)
    packed_linear_kernel(PackedLinearParams p) {
  constexpr int GT = G * T;  // weight tiles a stage: slot h T + u is weight h's tile u of the CTA's T
  using R = Ring<L, GS, GT, W, (T > 1)>;
  constexpr int kWarps = W;  // this kernel's (the FP8 kernel keeps 8)
  constexpr int kThreads = 32 * W;
  constexpr int kCh = R::kCh;
  constexpr int kSteps = kCh / 16;  // a chunk's
  constexpr bool kAffine = L == kQ4aMma;
  constexpr bool kInt4 = L == kQ4zMma || L == kQ4aMma;
  constexpr bool kF8 = L == kF8r;  // no scale periods: the feature's scale in the epilogue
  constexpr float kBias = L == kQ4zMma ? 136.f : 128.f;
  constexpr int kRows = 8 * NT;
  constexpr int kP = R::kP;
  constexpr int kSR = R::kScaleRows;
  constexpr int kSC = R::kScaleCopies;
  constexpr int kStages = R::kStages;
  constexpr int kAcc = GT * NT * 4;
  static_assert(T == 1 || NT > 1, "wide CTAs take the reduce_warps path");
  extern __shared__ uint4 dyn[];
  __shared__ float red[NT == 1 ? 1 : W / 2 * kAcc * 32];
  __shared__ float red1[NT == 1 ? 2 * kWarps * kAcc * 32 : 1];
  __shared__ float fin[GT][16][kRows + 1];
  __shared__ float rstd[kRows];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * kRows;
  const int tiles_out = p.n_out / 16;
  const int spans = tiles_out / T;  // a CTA's units of work: T tiles each (the launch checks T divides the tiles)
  int tiles_done = 0;
  const int chunks = p.k / kCh;
  const int pairs = (chunks + 1) / 2;           // stages a tile (the last one half when chunks is odd)
  const int groups = p.k / p.group;
  const int periods = p.k / (16 * GS);          // scale periods a row
  const int group_shift = 31 - __clz(p.group);  // groups are powers of two: no division in the loop
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x);
  const uint4* w = static_cast<const uint4*>(p.w);

  // The ring: stage-major; weights by (h, half, thread) (a warp's 32 threads side by side: no bank conflicts),
  // then the scale rows by warp. Copy u (lanes u and u - 32) of a stage's scales: row u / 4 = (h, period, scale or
  // min), part u % 4.
  uint4* ring_w = dyn;
  float* ring_s = reinterpret_cast<float*>(dyn + kStages * 2 * GT * kThreads);
  const uint32_t ring_w_at = static_cast<uint32_t>(__cvta_generic_to_shared(ring_w)) + 16 * threadIdx.x;
  const uint32_t ring_s_at = static_cast<uint32_t>(__cvta_generic_to_shared(ring_s)) + 16 * (warp * kSC + lane);
  constexpr int kCopies = kSC > 0 ? (kSC + 31) / 32 : 1;  // scale copies a lane (f8r: none, s_on false)
  constexpr int kSRd = kSR > 0 ? kSR : 1;
  const float* s_src[kCopies];
  int s_off[kCopies];                         // (h tile offset, period) part of the source offset, in floats
  int s_k[kCopies];                           // the period's first value in the stage
  bool s_on[kCopies];
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int u = lane + 32 * i;
    const int su = u >> 2, which = su % kSRd, pp = (su / kSRd) % kP, slot = su / (kSRd * kP);
    s_on[i] = u < kSC;
    s_k[i] = pp * GS * 16;
    s_src[i] = (kAffine && which ? p.mn : p.s) + 4 * (u & 3);
    s_off[i] = (slot % T + slot / T * tiles_out) * groups * 16 + (((pp * GS * 16) >> group_shift) << 4);
  }
  // The next stage this warp copies: (span of T tiles, pair), advanced over this CTA's spans.
  int is_tile = blockIdx.y, is_p = warp, wr = 0;
  auto issue_next = [&]() {
    if (is_tile < spans && is_p < pairs) {
      const int c = 2 * is_p;
      const bool second = c + 1 < chunks;
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        const int64_t wt = static_cast<int64_t>(is_tile) * T + h % T + h / T * tiles_out;
        const uint32_t dst = ring_w_at + (wr * 2 * GT + 2 * h) * kThreads * 16;
        if constexpr (kF8) {  // rows g and g + 8, values 16 t .. of the stage's 64 (chunks is even: K % 64 == 0)
          const uint8_t* src = static_cast<const uint8_t*>(p.w) + (wt * 16 + g) * p.k + c * kCh + 16 * t;
          copy_async16(dst, src);
          copy_async16(dst + kThreads * 16, src + 8 * static_cast<int64_t>(p.k));
        } else {
          const uint4* src = w + (wt * chunks + c) * 32 + lane;
          copy_async16(dst, src);
          if (second) copy_async16(dst + kThreads * 16, src + 32);
        }
      }
      const int s_base = (is_tile * T * groups + ((c * kCh) >> group_shift)) * 16;
#pragma unroll
      for (int i = 0; i < kCopies; ++i)
        if (s_on[i] && c * kCh + s_k[i] < p.k)  // not the missing half's periods of a tile's odd last chunk
          copy_async16(ring_s_at + (wr * kWarps * kSC + 32 * i) * 16, s_src[i] + s_base + s_off[i]);
      is_p += kWarps;
      if (is_p >= pairs) {
        is_p = warp;
        is_tile += gridDim.y;
      }
    }
    copies_commit();
    wr = wr + 1 == kStages ? 0 : wr + 1;
  };
  allow_dependents();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();  // in flight while x is staged and the norm's sums are read
  wait_for_inputs();  // x, the norm's sums and the residual come from the kernels before this one

  const int mb = min(p.m - row0, kRows);  // this block's rows
  const int sk = p.k + 8;                 // staged row stride
  const __nv_bfloat16* xs_smem = reinterpret_cast<const __nv_bfloat16*>(dyn + R::kBytes / 16);
  float* xsum = reinterpret_cast<float*>(reinterpret_cast<char*>(dyn) + R::kBytes) +
                (S ? mb * sk / 2 : 0);  // [mb][periods] after the staged rows (int4)
  const __nv_bfloat16* norm_w = static_cast<const __nv_bfloat16*>(p.nw);
  // The prologue's global loads in one round trip: the norm's partial sums of squares (a warp a row, the first
  // kSsAhead a lane) are requested before x's rows are staged and added after, and x's sums over each scale period
  // come from the staged copy in shared memory (they were read from global memory again, and warp 0 did both in
  // turn while the others waited). H200, q4a g128, one row: qkv 11.3 -> 8.3 us, gate/up 27.9 -> 25.2, o 7.1 -> 6.4,
  // down 14.7 -> 13.5, the LM head 96 -> 88; int8 within +-2 us (results/packed_linear_prologue_h200.txt).
  constexpr int kRowsPerWarp = (kRows + kWarps - 1) / kWarps;
  constexpr int kSsAhead = 8;
  float part[kRowsPerWarp][kSsAhead];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    const bool on = norm_w != nullptr && r < kRows && row0 + r < p.m;
#pragma unroll
    for (int b = 0; b < kSsAhead; ++b) {
      const int i = lane + 32 * b;
      part[j][b] = on && i < p.p_in ? p.ss[(row0 + r) * p.stride_ss + i] : 0.f;
    }
  }
  if constexpr (S) {
    __nv_bfloat16* st = const_cast<__nv_bfloat16*>(xs_smem);
    const int per_row = p.k / 8;
#pragma unroll 4
    for (int i = threadIdx.x; i < mb * per_row; i += kThreads) {
      const int r = i / per_row, k8 = (i - r * per_row) * 8;
      uint4 v = *reinterpret_cast<const uint4*>(x + (row0 + r) * p.stride_x + k8);
      if (norm_w != nullptr) v = times_norm(v, *reinterpret_cast<const uint4*>(norm_w + k8));
      *reinterpret_cast<uint4*>(st + r * sk + k8) = v;
    }
  }
  if (norm_w != nullptr) {  // each row's 1 / rms from the partial sums of squares: one warp a row, a fixed order
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int r = warp + j * kWarps;
      if (r >= kRows) break;  // (warp-uniform)
      float s = 0.f;
#pragma unroll
      for (int b = 0; b < kSsAhead; ++b) s += part[j][b];  // past p_in or the rows: + 0, the same bits
      if (row0 + r < p.m)
        for (int i = lane + 32 * kSsAhead; i < p.p_in; i += 32) s += p.ss[(row0 + r) * p.stride_ss + i];
#pragma unroll
      for (int o = 16; o >= 1; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) rstd[r] = rsqrtf(s / p.k + p.eps);
    }
  }
  if constexpr (S && kInt4) {
    // x's sum over each scale period of each row, from the staged rows: a period a quad, lane t of it the
    // values 4 t .. 4 t + 3 of each step in turn, then the quad's four sums (s0 + s1) + (s2 + s3) -- the order in
    // which the loop below adds them when x is not staged: the same bits.
    __syncthreads();  // the staged rows are in
    const int quads = mb * periods, tq = threadIdx.x & 3;
    for (int base = 0; base < quads; base += kThreads / 4) {  // (every lane runs every round: the shuffles)
      const int i = base + (threadIdx.x >> 2);
      float s = 0.f;
      if (i < quads) {
        const int r = i / periods, k0 = (i - r * periods) * 16 * GS;
        const __nv_bfloat16* xr = xs_smem + r * sk + k0 + 4 * tq;
#pragma unroll
        for (int j = 0; j < GS; ++j) {
          const uint2 v = *reinterpret_cast<const uint2*>(xr + 16 * j);
          s += (lo_f(v.x) + hi_f(v.x)) + (lo_f(v.y) + hi_f(v.y));
        }
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (i < quads && tq == 0) xsum[i] = s;
    }
  }
  const __nv_bfloat16* nw = S ? nullptr : static_cast<const __nv_bfloat16*>(p.nw);  // staged: applied already
  __syncthreads();

  // The rows this thread's B fragments read: past the block's last row, that row again (those MMA columns
  // are never written out; a column's sums depend on its own row only), so the loads need no branch.
  int xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xrow[nt] = min(nt * 8 + g, mb - 1);
  int xr0[NT], xr1[NT];  // the rows of the sums this thread's accumulator columns 2 t and 2 t + 1 take
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xr0[nt] = min(nt * 8 + 2 * t, mb - 1) * periods;
    xr1[nt] = min(nt * 8 + 2 * t + 1, mb - 1) * periods;
  }
  int rd = 0;
  for (int span = blockIdx.y; span < spans; span += gridDim.y) {
    float acc[GT][NT][4] = {};
    for (int pr = warp; pr < pairs; pr += kWarps) {
      __syncwarp();  // every lane has read the stage the next copy overwrites (the scale rows are shared)
      issue_next();
      copies_wait<kStages - 1>();  // this stage's copies (this thread's) are in,
      __syncwarp();                // and the other lanes' scale rows too
      const bool second = 2 * pr + 1 < chunks;
      const uint4* wsrc = ring_w + rd * 2 * GT * kThreads + threadIdx.x;
      const float* sr = ring_s + (rd * kWarps + warp) * kSC * 4;
      rd = rd + 1 == kStages ? 0 : rd + 1;
      float tmp[GT][NT][4] = {};
      float xs[NT] = {};
      // x's B fragments at value k: 4 values of each n-tile's row for this thread (the norm's weight applied)
      auto x_frags = [&](int k, uint32_t(&b)[NT][2]) {
        uint2 nv = make_uint2(0, 0);
        if (nw != nullptr) nv = *reinterpret_cast<const uint2*>(nw + k);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint2 v = S ? *reinterpret_cast<const uint2*>(xs_smem + xrow[nt] * sk + k)
                      : *reinterpret_cast<const uint2*>(x + (row0 + xrow[nt]) * p.stride_x + k);
          if (nw != nullptr) {  // the norm's weight, one rounding, as the eager x * w
            v.x = pack_bf16(lo_f(v.x) * lo_f(nv.x), hi_f(v.x) * hi_f(nv.x));
            v.y = pack_bf16(lo_f(v.y) * lo_f(nv.y), hi_f(v.y) * hi_f(nv.y));
          }
          if constexpr (kF8 && !ONECOPY_F8R_CVT) {  // values 0 and 2, then 1 and 3, as f8r_step pairs them
            b[nt][0] = __byte_perm(v.x, v.y, 0x5410);
            b[nt][1] = __byte_perm(v.x, v.y, 0x7632);
          } else {
            b[nt][0] = v.x;
            b[nt][1] = v.y;
          }
          if constexpr (kInt4 && !S) xs[nt] += (lo_f(v.x) + hi_f(v.x)) + (lo_f(v.y) + hi_f(v.y));
        }
      };
      if constexpr (kF8) {  // a stage: rows g and g + 8 of 64 values, 4 steps, straight into the sums
        uint4 lo[GT], hi[GT];
#pragma unroll
        for (int h = 0; h < GT; ++h) {
          lo[h] = wsrc[(2 * h) * kThreads];
          hi[h] = wsrc[(2 * h + 1) * kThreads];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t b[NT][2];
          x_frags(pr * 2 * kCh + 16 * t + 4 * j, b);
#pragma unroll
          for (int h = 0; h < GT; ++h) {
            uint32_t a[4];
            f8r_step(lo[h], hi[h], j, a);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[h][nt], a, b[nt][0], b[nt][1]);
          }
        }
      } else {  // (the int4 / int8 tile order: a stage is two chunks, scales applied per period)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (half == 1 && !second) break;
        const int c = 2 * pr + half;
        uint4 wv[GT];
#pragma unroll
        for (int h = 0; h < GT; ++h) wv[h] = wsrc[(2 * h + half) * kThreads];
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const int js = half * kSteps + j;  // the stage's step
          const int k = c * kCh + 16 * j + 4 * t;
          uint32_t b[NT][2];
          x_frags(k, b);
#pragma unroll
          for (int h = 0; h < GT; ++h) {
            uint32_t a[4];
            dequant_step<L>(wv[h], j, a);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_bf16(tmp[h][nt], a, b[nt][0], b[nt][1]);
          }
          if ((js + 1) % GS == 0) {  // the group's scale (and min) on its sums
            const int period = (js + 1) / GS - 1;
            float xc0[NT], xc1[NT];
            if constexpr (kInt4) {  // x's sum over the period's values, for the columns this thread holds
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                if constexpr (S) {
                  const int pi = pr * kP + period;
                  xc0[nt] = xsum[xr0[nt] + pi];
                  xc1[nt] = xsum[xr1[nt] + pi];
                } else {
                  float s = xs[nt];
                  s += __shfl_xor_sync(0xffffffffu, s, 1);
                  s += __shfl_xor_sync(0xffffffffu, s, 2);
                  xc0[nt] = __shfl_sync(0xffffffffu, s, 8 * t);
                  xc1[nt] = __shfl_sync(0xffffffffu, s, 8 * t + 4);
                  xs[nt] = 0.f;
                }
              }
            }
#pragma unroll
            for (int h = 0; h < GT; ++h) {
              const float* sc = sr + (h * kP + period) * kSR * 16;
              const float s0 = sc[g], s1 = sc[g + 8];
              // q4a: s (128 + q) + (m - 128 s) = s q + m; q4z: s (128 + q - 136)
              const float m0 = kAffine ? fmaf(-kBias, s0, sc[16 + g]) : -kBias * s0;
              const float m1 = kAffine ? fmaf(-kBias, s1, sc[16 + g + 8]) : -kBias * s1;
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                float* d = acc[h][nt];
                float* e = tmp[h][nt];
                d[0] = fmaf(s0, e[0], d[0]);
                d[1] = fmaf(s0, e[1], d[1]);
                d[2] = fmaf(s1, e[2], d[2]);
                d[3] = fmaf(s1, e[3], d[3]);
                if constexpr (kInt4) {
                  d[0] = fmaf(m0, xc0[nt], d[0]);
                  d[1] = fmaf(m0, xc1[nt], d[1]);
                  d[2] = fmaf(m1, xc0[nt], d[2]);
                  d[3] = fmaf(m1, xc1[nt], d[3]);
                }
                e[0] = e[1] = e[2] = e[3] = 0.f;
              }
            }
          }
        }
      }
      }
    }

    float* flat = &acc[0][0][0];
    if constexpr (NT == 1) {
      // One barrier a tile: the warps' sums into one of two buffers (the other may still be read for the tile
      // before), warp 0 adds them in reduce_warps's tree order (the same bits as the wider blocks) while the
      // others go on to the next tile.
      float* rb = red1 + (tiles_done & 1) * kWarps * kAcc * 32;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) rb[(warp * kAcc + i) * 32 + lane] = flat[i];
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          flat[i] = tree_sum<W, kAcc * 32>(rb + i * 32 + lane);
        }
      }
    } else {
      reduce_warps<W, kAcc>(reinterpret_cast<float(&)[kAcc]>(*flat), red, warp, lane);
    }
    ++tiles_done;
    if (warp == 0) {
#pragma unroll
      for (int h = 0; h < GT; ++h)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) fin[h][g + 8 * (e >> 1)][nt * 8 + 2 * t + (e & 1)] = acc[h][nt][e];
    }
    // Wide CTAs: warp u writes tile u of the span (fin is read by the T warps after the barrier, and written again
    // only after the next span's reduce_warps, whose barriers they reach once done); else warp 0 alone.
    if constexpr (T > 1) __syncthreads(); else __syncwarp();
    if (warp < T) {
      const int u = warp, tile = span * T + u;
      // Epilogue: a row's 16 outputs in four quarters of 4 (lanes 4 r .. 4 r + 3 for the 8 rows of a block of 8;
      // one lane a row, the quarters in turn, for wider blocks); each quarter's sum of squares in order, then
      // (q0 + q1) + (q2 + q3): the same bits either way.
      const __nv_bfloat16* res = static_cast<const __nv_bfloat16*>(p.res);
      auto quarter = [&](int r, int f0, uint2& out) {  // outputs f0 .. f0 + 3 of block row r; their squares' sum
        const int64_t row = row0 + r;
        const float scale = p.nw != nullptr ? rstd[r] : 1.f;
        float y[4];
        float ssq = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // f8r: the feature's scale, and the power of two its bf16 values lack (f8r_step); others: times 1, exact
          const int f = tile * 16 + f0 + i;
          const float wg = kF8 ? p.s[f] * kF8rUnscale : 1.f;
          float v = round_bf16(fin[u][f0 + i][r] * scale * wg);
          if constexpr (G == 2) {  // silu(gate) * up, each rounded to bf16 as the eager ops are
            const float wu = kF8 ? p.s[p.n_out + f] * kF8rUnscale : 1.f;
            const float up = round_bf16(fin[T + u][f0 + i][r] * scale * wu);
            v = round_bf16(round_bf16(v / (1.f + __expf(-v))) * up);
          }
          if (res != nullptr) v = round_bf16(__bfloat162float(res[row * p.stride_r + tile * 16 + f0 + i]) + v);
          y[i] = v;
          ssq = fmaf(v, v, ssq);
        }
        out = make_uint2(pack_bf16(y[0], y[1]), pack_bf16(y[2], y[3]));
        return ssq;
      };
      __nv_bfloat16* outp = static_cast<__nv_bfloat16*>(p.out);
      if constexpr (NT == 1) {
        const int r = lane >> 2, f0 = 4 * (lane & 3);
        uint2 o = make_uint2(0, 0);
        float ssq = r < mb ? quarter(r, f0, o) : 0.f;
        ssq += __shfl_xor_sync(0xffffffffu, ssq, 1);
        ssq += __shfl_xor_sync(0xffffffffu, ssq, 2);
        if (r < mb) {
          const int64_t row = row0 + r;
          *reinterpret_cast<uint2*>(outp + row * p.stride_o + tile * 16 + f0) = o;
          if (f0 == 0 && p.ss_out != nullptr) p.ss_out[row * tiles_out + tile] = ssq;
        }
      } else {
        const int r = lane;
        if (r < mb) {
          const int64_t row = row0 + r;
          uint2 o[4];
          float q[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) q[i] = quarter(r, 4 * i, o[i]);
          uint2* dst = reinterpret_cast<uint2*>(outp + row * p.stride_o + tile * 16);
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[i] = o[i];
          if (p.ss_out != nullptr) p.ss_out[row * tiles_out + tile] = (q[0] + q[1]) + (q[2] + q[3]);
        }
      }
      __syncwarp();  // fin is read before the next tile's sums land there
    }
  }
  copies_wait<0>();  // the empty groups past this warp's last chunk
}

// Four floats as e4m3 bytes (RN, saturating to +-448 as the reference's clamp), the first in the low byte.
__device__ __forceinline__ uint32_t to_e4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t d = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1; cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3; "
      "mov.b32 %0, {lo, hi}; }" : "=r"(d) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
#endif
  return d;
}

__device__ __forceinline__ float half_f(uint16_t v, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<uint32_t>(v) << 16) : __half2float(__ushort_as_half(v));
}

// The end of a row's quantization by a CTA of T threads, with `a` this thread's part of the row's max |x|: the max
// over the CTA, the scale written (max(max |x|, 1e-12) * fl(1 / 448)), and the row quantized from `load(i)` (its
// values i..i + 7 in x's dtype, as 16 bytes) to e4m3(x / scale), saturating.
template <int T, typename Load>
__device__ __forceinline__ void quantize_row(float a, const QuantizeRowsParams& p, float* wmax, Load load) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  if (lane == 0) wmax[warp] = a;
  __syncthreads();
  a = 0.f;
#pragma unroll
  for (int i = 0; i < T / 32; ++i) a = fmaxf(a, wmax[i]);
  const float s = fmaxf(a, 1e-12f) * (1.f / 448.f);
  if (threadIdx.x == 0) p.scales[blockIdx.x] = s;
  uint8_t* q = static_cast<uint8_t*>(p.q) + static_cast<int64_t>(blockIdx.x) * p.k;
  for (int i = threadIdx.x * 8; i < p.k; i += T * 8) {
    const uint4 v = load(i);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
    const uint32_t lo = to_e4m3x4(half_f(h[0], p.bf16) / s, half_f(h[1], p.bf16) / s, half_f(h[2], p.bf16) / s,
                                  half_f(h[3], p.bf16) / s);
    const uint32_t hi = to_e4m3x4(half_f(h[4], p.bf16) / s, half_f(h[5], p.bf16) / s, half_f(h[6], p.bf16) / s,
                                  half_f(h[7], p.bf16) / s);
    *reinterpret_cast<uint2*>(q + i) = make_uint2(lo, hi);
  }
}

// Each row of x quantized to e4m3 for cuBLAS's FP8 GEMM, as models/packed.py's quantize_rows (and the FP8 kernel
// above) do: scale = max(max |x|, 1e-12) * fl(1 / 448), q = e4m3(x / scale), saturating. One CTA of T threads a
// row, in one kernel (the ATen ops took six, each a pass over x).
template <int T>
__global__ void __launch_bounds__(T) quantize_rows_kernel(QuantizeRowsParams p) {
  __shared__ float wmax[T / 32];
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + blockIdx.x * p.stride_x;
  float a = 0.f;
  for (int i = threadIdx.x * 8; i < p.k; i += T * 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(x + i);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int e = 0; e < 8; ++e) a = fmaxf(a, fabsf(half_f(h[e], p.bf16)));
  }
  quantize_row<T>(a, p, wmax, [&](int i) { return *reinterpret_cast<const uint4*>(x + i); });
}

// quantize_rows_kernel's quantization of SwiGLU rows (QuantizeRowsParams::glu): one pass over the gate/up
// output, the row's products kept in shared memory (K values in x's dtype) between the max and the
// quantization. Unfused, Inductor's SwiGLU kernel wrote the products and quantize_rows read them back: at
// 8192 rows of the 8B shape 1.5x the bytes, in two kernels (benchmarks/decode_profile_cuda.py --prefill).
__device__ __forceinline__ uint16_t half_bits(float v, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

// silu(gate) * up of 8 values (gate's and up's 16 bytes), silu and the product each rounded to x's dtype as the
// eager ops round them; `a` takes the max |product|.
__device__ __forceinline__ uint4 glu8(uint4 gv, uint4 uv, bool bf16, float& a) {
  const uint16_t* g = reinterpret_cast<const uint16_t*>(&gv);
  const uint16_t* u = reinterpret_cast<const uint16_t*>(&uv);
  uint4 yv;
  uint16_t* y = reinterpret_cast<uint16_t*>(&yv);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float gf = half_f(g[e], bf16);
    const float silu = half_f(half_bits(gf / (1.f + __expf(-gf)), bf16), bf16);
    y[e] = half_bits(silu * half_f(u[e], bf16), bf16);
    a = fmaxf(a, fabsf(half_f(y[e], bf16)));
  }
  return yv;
}

template <int T>
__global__ void __launch_bounds__(T) glu_quantize_rows_kernel(QuantizeRowsParams p) {
  extern __shared__ uint4 products[];  // K values in x's dtype, 8 a word
  __shared__ float wmax[T / 32];
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + blockIdx.x * p.stride_x;
  float a = 0.f;
  for (int i = threadIdx.x * 8; i < p.k; i += T * 8)
    products[i / 8] = glu8(*reinterpret_cast<const uint4*>(x + i), *reinterpret_cast<const uint4*>(x + p.k + i),
                           p.bf16, a);
  quantize_row<T>(a, p, wmax, [&](int i) { return products[i / 8]; });  // its barrier: every product is stored
}

// The SwiGLU rows alone, in x's dtype (the FP8 GEMV's input, up to fp8_gemv_rows): 8 values a thread, a row over
// blockIdx.y's CTAs (one CTA a row read 14336-value rows at 1 and 64 rows slower than Inductor's kernel).
__global__ void __launch_bounds__(kThreads) glu_rows_kernel(QuantizeRowsParams p) {
  const int i = (blockIdx.y * kThreads + threadIdx.x) * 8;
  if (i >= p.k) return;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + blockIdx.x * p.stride_x;
  float a = 0.f;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.out) + blockIdx.x * p.stride_o + i) =
      glu8(*reinterpret_cast<const uint4*>(x + i), *reinterpret_cast<const uint4*>(x + p.k + i), p.bf16, a);
}

// One thread per 16-byte word of the tile order: its values dequantized in fp32 (s * q, + m), one rounding.
template <int L>
__global__ void unpack_kernel(UnpackParams p) {
  constexpr int kCh = L == kQ8sMma ? 32 : 64;
  const int chunks = p.k / kCh, groups = p.k / p.group;
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<int64_t>(p.n / 16) * chunks * 32) return;
  const int lane = i % 32, c = (i / 32) % chunks;
  const int64_t tile = i / (32 * chunks);
  const int g = lane >> 2, t = lane & 3;
  const uint4 w = static_cast<const uint4*>(p.w)[i];
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < kCh / 16; ++j) {
    const int k = c * kCh + 16 * j + 4 * t;
    const int q = k / p.group;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
      const int64_t n = tile * 16 + g + 8 * h;
      const float s = p.s[(tile * groups + q) * 16 + g + 8 * h];
      const float m = L == kQ4aMma ? p.mn[(tile * groups + q) * 16 + g + 8 * h] : 0.f;
      float v[4];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          float qv;
          if constexpr (L == kQ8sMma) {
            qv = static_cast<float>(static_cast<int8_t>((words[2 * j + h] >> (8 * (2 * e + pp))) & 0xff));
          } else {
            const int r = h + 2 * pp;
            qv = static_cast<float>((words[j] >> (4 * r + 16 * e)) & 0xf) - (L == kQ4zMma ? 8.f : 0.f);
          }
          const float sq = __fmul_rn(s, qv);  // two roundings, as torch's s * q + m (no contraction)
          v[2 * pp + e] = L == kQ4aMma ? __fadd_rn(sq, m) : sq;
        }
      uint2 outv;
      if (p.bf16) {
        outv = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
      } else {
        __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
        outv = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
      }
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + n * p.k + k) = outv;
    }
  }
}

// The persistent grid: as many CTAs as fit at once (occupancy hides the MMA chains' latency; fewer CTAs an SM
// for a fuller last round measured slower), then no more than the last round of tiles needs.
inline unsigned persistent_ctas(const void* kernel, int threads, size_t smem, int tiles, int row_blocks) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  int fit = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, threads, smem);
  const int slots = fit * sms / row_blocks > 1 ? fit * sms / row_blocks : 1;
  const int rounds = (tiles + slots - 1) / slots;
  return static_cast<unsigned>((tiles + rounds - 1) / rounds);
}

template <int L, int NT, int GS, int G, bool S, int W, int T>
void launch_kernel(const PackedLinearParams& p, size_t smem, cudaStream_t stream) {
  auto kernel = packed_linear_kernel<L, NT, GS, G, S, W, T>;
  allow_smem(reinterpret_cast<const void*>(kernel), smem);
  const int row_blocks = (p.m + 8 * NT - 1) / (8 * NT);
  const unsigned ctas =
      persistent_ctas(reinterpret_cast<const void*>(kernel), 32 * W, smem, p.n_out / 16 / T, row_blocks);
  launch_overlapped(kernel, dim3(row_blocks, ctas), 32 * W, smem, stream, p);
}

// The launch's choices, none of which changes a row's bits except the warps (see `Plan`).
struct Plan {
  int nt;      // 8-row n-tiles a CTA: 1 up to 8 rows, 2 up to 16, past that 2 or 4
  int warps;   // 8, or 16: the order of a tile's sums, so a function of the weight and the GPU (and, outside the
               // batch-invariant decode, of the rows)
  bool stage;  // x's rows staged in shared memory (where they fit beside the ring: smem_fits)
  int wide;    // T: tiles a CTA takes at once (1, or ONECOPY_WIDE_T at 9-16 rows of int4 weights of many tiles)
};

// Wide CTAs at 9-16 rows (packed_linear_kernel's T; the harness's A/B builds): 1 = off.
#ifndef ONECOPY_WIDE_T
#define ONECOPY_WIDE_T 4
#endif

// H200, q4a / q8s g128, the 8B projections at 1 to 64 rows (benchmarks/packed_linear_variants.sh,
// results/packed_linear_variants_h200.json):
// - 16 warps a CTA where one round of two such CTAs an SM covers the tiles (o and down: 256 tiles) and a CTA has
//   one n-tile: each warp's part of a tile's reduction, a chain of dependent MMAs, is half as long (o 7.8 -> 6.9 us
//   at one row, down 16.5 -> 14.9; at 8 rows o 9.3 -> 6.9, down 28.6 -> 20.0); at 16 rows and more they were 20-30%
//   slower, and with 384 tiles (qkv: two rounds) slower too. The batch-invariant decode keeps 8 warps at every
//   size, so that a row's bits never depend on the batch.
// - x staged in shared memory costs occupancy (one CTA an SM at 8 and 16 rows of K = 4096) and, for int4, x's
//   sums per scale period once a CTA: one row always pays for it (gate/up 36.8 -> 26.0 us, down 18.4 -> 14.9); more
//   rows pay where a CTA has many weight tiles (int4: gate/up's 2 x 896 and the LM head at 8 rows, 43 -> 35 and
//   173 -> 130 us; the LM head at 16, 242 -> 187) and at int8 (o, qkv, gate/up, LM head at 8 and 16 rows,
//   10-30%), not for int4 weights of few tiles (o at 16 rows 12.5 -> 29.4 us).
// - 9-16 rows, int4: T = 4 tiles a CTA at once (x's L2 reads a quarter) where the spans of 4 tiles fill 2/3 of the
//   SMs in one round (H100, folds on, results/packed_linear_wide_h100.txt: qkv 19.0 -> 14.1 us at 16 rows, 17.4 ->
//   13.6 at 9; the packed GEMM 14.6). o and down (64 spans: half the SMs idle) were slower (10.8 -> 12.2, 30.7 ->
//   35.0), T = 2 no faster anywhere, and int8, whose rows are staged at T = 1 (no room beside a wide ring), slower.
// - past 16 rows, two row blocks of 16 staged rows where staging pays and fits (the LM head: int4 440 -> 353 us at
//   32 rows, 853 -> 687 at 64), else blocks of 32 rows read x from L2 (int8 down, K = 14336: 57 us, not 84).
template <int L, int GS>
Plan plan_for(const PackedLinearParams& p) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int tiles = p.n_out / 16, weight_tiles = (p.glu ? 2 : 1) * tiles;
  // byte weights: f8r is planned as int8 (its times: results/packed_linear_f8r_h200.txt)
  const bool int8 = L == kQ8sMma || L == kF8r;
  const auto stage_pays = [&](int nt) {
    return p.m == 1 || int8 || weight_tiles >= (nt == 1 ? 8 : 30) * sms;
  };
  // 16 staged rows beside the largest ring and the static buffers (an estimate; launch_glu checks the kernel's own)
  const int64_t staged16 = 16 * (static_cast<int64_t>(p.k) + 8) * 2 + (int8 ? 0 : 16 * (p.k / (16 * GS)) * 4);
  const bool fits16 = staged16 + 72 * 1024 + 24 * 1024 <= optin;
  Plan plan{};
  plan.nt = p.m <= 8 ? 1 : p.m <= 16 ? 2 : (stage_pays(2) && fits16 && !p.glu ? 2 : 4);
  // (a fused gate/up weight keeps 8: measured only for one-weight CTAs, and a 16-warp gate/up CTA outgrows a
  // 99 KB-shared-memory GPU; launch_rows checks the fit as well)
  plan.warps = !p.invariant && !p.glu && plan.nt == 1 && tiles <= 2 * sms ? 16 : 8;
  plan.stage = stage_pays(plan.nt);
  constexpr int wide = ONECOPY_WIDE_T;
  plan.wide = plan.nt == 2 && !int8 && !p.glu && wide > 1 && tiles % wide == 0 && 3 * (tiles / wide) >= 2 * sms
                  ? wide : 1;
  return plan;
}

// Dynamic shared memory: the ring, then (staged) x's rows and, for int4, their sums over each scale period.
template <int L, int NT, int GS, int G, int W, int T = 1>
void launch_glu(const PackedLinearParams& p, bool stage, cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(p.m < 8 * NT ? p.m : 8 * NT);
  const size_t staged = rows * (p.k + 8) * 2;
  const size_t sums = L == kQ4zMma || L == kQ4aMma ? rows * (p.k / (16 * GS)) * 4 : 0;
  const size_t ring = Ring<L, GS, G * T, W, (T > 1)>::kBytes;
  if (stage &&
      smem_fits(reinterpret_cast<const void*>(packed_linear_kernel<L, NT, GS, G, true, W, T>), ring + staged + sums))
    launch_kernel<L, NT, GS, G, true, W, T>(p, ring + staged + sums, stream);
  else
    launch_kernel<L, NT, GS, G, false, W, T>(p, ring, stream);
}

template <int L, int NT, int GS>
int launch_rows(const PackedLinearParams& p, const Plan& plan, cudaStream_t stream) {
#if ONECOPY_WIDE_T > 1
  if constexpr (NT == 2) {
    if (plan.wide > 1) {
      launch_glu<L, NT, GS, 1, 8, ONECOPY_WIDE_T>(p, plan.stage, stream);
      return 0;
    }
  }
#endif
  if (p.glu) {
    launch_glu<L, NT, GS, 2, 8>(p, plan.stage, stream);
    return 0;
  }
  if constexpr (NT == 1) {  // 16 warps only ever take one n-tile (plan_for): no other 16-warp kernel is built
    // and only where its ring fits beside its static buffers (GPUs of 99 KB of shared memory a block)
    const bool fits = smem_fits(reinterpret_cast<const void*>(packed_linear_kernel<L, 1, GS, 1, false, 16>),
                                Ring<L, GS, 1, 16>::kBytes);
    if (plan.warps == 16 && fits) {
      launch_glu<L, 1, GS, 1, 16>(p, plan.stage, stream);
      return 0;
    }
  }
  launch_glu<L, NT, GS, 1, 8>(p, plan.stage, stream);
  return 0;
}

template <int L, int GS>
int launch_layout(const PackedLinearParams& p, cudaStream_t stream) {
  const Plan plan = plan_for<L, GS>(p);
  if (plan.nt == 1) return launch_rows<L, 1, GS>(p, plan, stream);
  if (plan.nt == 2) return launch_rows<L, 2, GS>(p, plan, stream);
  return launch_rows<L, 4, GS>(p, plan, stream);
}

}  // namespace

bool packed_linear_supported(int layout, int group, int n, int k) {
  if (layout == kF8r) return group == k && n > 0 && n % 16 == 0 && k > 0 && k % 64 == 0;
  const int ch = layout == kQ8sMma ? 32 : 64;
  const bool groups = group == 32 || group == 64 || group == 128;
  return (layout == kQ4zMma || layout == kQ4aMma || layout == kQ8sMma) && groups && n > 0 && n % 16 == 0 &&
         k > 0 && k % ch == 0 && k % group == 0;
}

int packed_linear_launch(const PackedLinearParams& p, cudaStream_t stream) {
  if (!packed_linear_supported(p.layout, p.group, p.glu ? 2 * p.n_out : p.n_out, p.k) || p.n_out % 16 != 0)
    return -1;
  if (p.m == 0) return 0;
  switch (p.layout) {
    // GS: MMA steps a scale period, the group's share of a stage (8 steps of int4, 4 of int8)
    case kQ4zMma:
      if (p.group == 32) launch_layout<kQ4zMma, 2>(p, stream);
      else if (p.group == 64) launch_layout<kQ4zMma, 4>(p, stream);
      else launch_layout<kQ4zMma, 8>(p, stream);
      break;
    case kQ4aMma:
      if (p.group == 32) launch_layout<kQ4aMma, 2>(p, stream);
      else if (p.group == 64) launch_layout<kQ4aMma, 4>(p, stream);
      else launch_layout<kQ4aMma, 8>(p, stream);
      break;
    case kF8r:
      launch_layout<kF8r, 4>(p, stream);  // (GS: no scale periods; 4 as int8 g128 for the ring's arithmetic)
      break;
    default:
      if (p.group == 32) launch_layout<kQ8sMma, 2>(p, stream); else launch_layout<kQ8sMma, 4>(p, stream);
  }
  return static_cast<int>(cudaGetLastError());
}

// A CTA of T threads a row: 1024 where the rows alone do not fill the device (at 64 rows of 14336 values the
// 256-thread CTAs made the fused SwiGLU slower than Inductor's kernel + quantize_rows).
template <int T>
int quantize_rows_with(const QuantizeRowsParams& p, cudaStream_t stream) {
  if (!p.glu) {
    quantize_rows_kernel<T><<<p.m, T, 0, stream>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  const int smem = p.k * 2;
  if (smem > 48 * 1024) {  // past the default limit: opted in per launch (cheap; the attribute is per function)
    const cudaError_t e = cudaFuncSetAttribute(glu_quantize_rows_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               smem);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  glu_quantize_rows_kernel<T><<<p.m, T, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int quantize_rows_launch(const QuantizeRowsParams& p, cudaStream_t stream) {
  if (p.k <= 0 || p.k % 8 != 0 || p.m < 0 || (p.glu && p.k > kGluMaxK)) return -1;
  if (p.m == 0) return 0;
  if (p.glu && p.q == nullptr) {  // the SwiGLU rows alone
    glu_rows_kernel<<<dim3(p.m, (p.k + kThreads * 8 - 1) / (kThreads * 8)), kThreads, 0, stream>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  return p.m < 2 * device_attribute(cudaDevAttrMultiProcessorCount) ? quantize_rows_with<1024>(p, stream)
                                                                      : quantize_rows_with<kThreads>(p, stream);
}

int unpack_launch(const UnpackParams& p, cudaStream_t stream) {
  if (!packed_linear_supported(p.layout, p.group, p.n, p.k)) return -1;
  const int ch = p.layout == kQ8sMma ? 32 : 64;
  const int64_t words = static_cast<int64_t>(p.n / 16) * (p.k / ch) * 32;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((words + threads - 1) / threads);
  switch (p.layout) {
    case kQ4zMma: unpack_kernel<kQ4zMma><<<blocks, threads, 0, stream>>>(p); break;
    case kQ4aMma: unpack_kernel<kQ4aMma><<<blocks, threads, 0, stream>>>(p); break;
    default: unpack_kernel<kQ8sMma><<<blocks, threads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace onecopy_native
