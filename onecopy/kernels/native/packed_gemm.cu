// Packed int4 / int8 weights times many rows (a wide decode step: 9 to 64 rows), in the structure of Marlin
// (vLLM's GPTQ GEMM): x's rows and the weight tiles both stream through a multi-stage cp.async pipeline in shared
// memory, each warp dequantizes its weight fragments once a stage and multiplies each against every row block's
// fragments, so a weight byte is read from HBM once per 64 rows and x once per 256 output features.
//
// Why a second kernel: packed_linear.cu's GEMV gives each CTA one 16-feature tile and reads x per tile (from L2,
// or staged whole per CTA); past 32 rows that re-reads x 16x more than the weight's own bytes, and the op fell back
// to unpacking the weight to bf16 for cuBLAS every step (a write and a read of the bf16 copy). H200, int4 g128
// (benchmarks/packed_gemm_cuda.py): the fused gate/up weight at 64 rows 155 -> 79 us (bf16 cuBLAS 64), at 32 rows
// 106 (GEMV) -> 61; the LM head at 64 rows 676 -> 317 (bf16 283).
//
// Weights of few 256-feature blocks (4096 or 6144 outputs: 16-24 CTAs for 132 SMs) split K over a thread-block
// cluster (Hopper): its CTAs each multiply a share of K for the same outputs, then add their fp32 partial sums
// through distributed shared memory, in rank order (the same bits every call), each CTA taking the epilogue of
// 1 / k_splits of the warps' outputs. H100, int4 g128, 4 splits (benchmarks/results/packed_gemm_splits_h100.txt):
// at 64 rows o 67.7 -> 25.3 us, qkv 67.2 -> 26.6, down 224 -> 65 (bf16 cuBLAS on H200 15 / 21 / 47; unpacking for
// cuBLAS was 27 / 43 / 105), at 32 rows 16.5 / 18.1 / 42.5 against the GEMV's 17.1 / 29.6 / 49.5; the result is
// still ~40% of mma.sync's rate (below). An earlier split over plain CTAs reduced through global memory in the last
// CTA to finish and measured slower than unpacking (o at 64 rows 53 vs 23.5 us: the 16 reducing CTAs read 512 KB
// each after the others were done). At 128 rows and more cuBLAS on the unpacked weight is as fast or faster:
// with one CTA an SM (8 warps: 2 a scheduler) the MMA chains are latency-bound (ncu: an instruction every 2.6 cycles
// a scheduler, 40% of stalls on fixed-latency dependencies), ~36% of mma.sync's rate.
//
// Numbers: each weight fragment is dequantized to bf16 with its group's scale (and min) on the way, s q (+ m) in one
// bf16x2 FMA from the exact integer q (the LOP3 trick of packed_linear.cu, less its 128 bias), rounded once, with s
// and m rounded to bf16 first (Marlin's arithmetic); fp32 accumulation over K in order. So a row's result is that of
// the eager bf16 product with the weight dequantized that way, and does not depend on the other rows; the
// batch-invariant decode still keeps the GEMV at every row count (one kernel's arithmetic for every batch).
//
// A CTA: 8 warps, 16 tiles of 16 output features (two a warp), `8 NT` rows (NT 8-row n-tiles), K in stages of 128
// values (as many in flight as fit ONECOPY_GEMM_RING_KB). Grid: row blocks x 256-feature blocks x K splits.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mma_common.cuh"
#include "packed_gemm.h"
#include "packed_linear.h"

namespace onecopy_native {

namespace {

using namespace mma;

constexpr int kGemmThreads = 256;  // 8 warps
constexpr int kTiles = 16;         // 16-feature weight tiles a CTA (two a warp)
constexpr int kStageK = 128;       // values of K a pipeline stage
// Shared memory for the ring: as many stages as fit (2 to 8). The loads are latency-bound, not bandwidth-bound,
// with one CTA an SM: H200, 4 stages (3 in flight, 48 KB of int4 weights) read the 8B projections at 0.9-1.7 TB/s.
#ifndef ONECOPY_GEMM_RING_KB
#define ONECOPY_GEMM_RING_KB 200
#endif
// A staged row of x, in bf16: 288 bytes, so that the 8-byte fragment loads of a half-warp (rows g = 0..3, t = 0..3:
// words 72 g + 2 t + ...) fall in 32 distinct banks.
constexpr int kXStride = kStageK + 16;

template <int L, int GROUP, int NT>
struct GemmShape {
  static constexpr int kCh = L == kQ8sMma ? 32 : 64;                    // values a chunk of the tile order
  static constexpr int kChunks = kStageK / kCh;                         // chunks a stage: 2 (int4), 4 (int8)
  static constexpr int kSteps = kCh / 16;                               // MMA steps a chunk
  static constexpr int kWords = kTiles * kChunks * 32;                  // 16-byte weight words a stage
  static constexpr int kGroups = kStageK / GROUP;                       // scale groups a stage
  static constexpr int kScaleRows = L == kQ4aMma ? 2 : 1;               // scales (and mins)
  static constexpr int kScaleWords = kScaleRows * kTiles * kGroups * 4;  // 16 floats a tile and group
  static constexpr int kRows = 8 * NT;
  static constexpr int kXWords = kRows * kStageK / 8;                   // 16-byte words of x a stage
  static constexpr int kStageBytes = 16 * (kWords + kScaleWords) + kRows * kXStride * 2;
  static constexpr int kFit = ONECOPY_GEMM_RING_KB * 1024 / kStageBytes;
  static constexpr int kStages = kFit > 8 ? 8 : kFit < 2 ? 2 : kFit;
  static constexpr int kPartialBytes = 8 * 2 * NT * 32 * 16;  // a K split's partial sums: [warp][tile][n-tile][lane]
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kBytes = kRingBytes > kPartialBytes ? kRingBytes : kPartialBytes;
};

// The RMSNorm of x's rows before a folded projection, with the eager model's roundings: xn = bf16(bf16(x * rstd) * w),
// rstd = rsqrtf(sum of the row's partial sums of squares / K + eps) (the eager norm's ops in one kernel; its rstd may
// differ from ATen's in the last bit: sum order, rsqrtf). One CTA a row.
__global__ void __launch_bounds__(256) norm_rows_kernel(PackedGemmParams p) {
  __shared__ float total;
  const int row = blockIdx.x;
  allow_dependents();
  wait_for_inputs();
  if (threadIdx.x < 32) {
    float s = 0.f;
    for (int i = threadIdx.x; i < p.p_in; i += 32) s += p.ss[row * p.stride_ss + i];
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) total = s;
  }
  __syncthreads();
  const float rstd = rsqrtf(total / p.k + p.eps);
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x) + row * p.stride_x;
  const __nv_bfloat16* nw = static_cast<const __nv_bfloat16*>(p.nw);
  __nv_bfloat16* xn = static_cast<__nv_bfloat16*>(p.xn) + static_cast<int64_t>(row) * p.k;
  for (int k8 = 8 * threadIdx.x; k8 < p.k; k8 += 8 * 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(x + k8), w = *reinterpret_cast<const uint4*>(nw + k8);
    const uint32_t vs[4] = {v.x, v.y, v.z, v.w}, ws[4] = {w.x, w.y, w.z, w.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      o[i] = pack_bf16(round_bf16(lo_f(vs[i]) * rstd) * lo_f(ws[i]), round_bf16(hi_f(vs[i]) * rstd) * hi_f(ws[i]));
    *reinterpret_cast<uint4*>(xn + k8) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Sixteen bfloat16 values from 16-byte aligned memory, as floats.
__device__ __forceinline__ void load16(const __nv_bfloat16* from, float (&v)[16]) {
  const uint4 a = *reinterpret_cast<const uint4*>(from), b = *reinterpret_cast<const uint4*>(from + 8);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = lo_f(w[i]);
    v[2 * i + 1] = hi_f(w[i]);
  }
}

// The folds after cuBLAS's product of the unpacked weight (FoldRowsParams), one thread a row's 16 outputs: what were
// ATen ops with fp32 temporaries (8 kernels for SwiGLU, 4 for the residual, 3 for the sums), with their roundings:
// silu(g) = g * (1 / (1 + exp(-g))) in fp32 (ATen's sigmoid, then the product) rounded to bf16, times up rounded; the
// residual added in fp32 and rounded. The sums of squares run in another order than ATen's reduction did (they feed
// the next norm's rstd, which packed_gemm's epilogue sums in its own order too).
__global__ void __launch_bounds__(256) fold_rows_kernel(FoldRowsParams p) {
  const int row = blockIdx.x, i = blockIdx.y * 256 + threadIdx.x, groups = p.n_out / 16;
  allow_dependents();
  wait_for_inputs();
  if (i >= groups) return;
  float v[16];
  const __nv_bfloat16* acc = static_cast<const __nv_bfloat16*>(p.acc) + row * p.stride_acc + 16 * i;
  load16(acc, v);
  if (p.glu) {
    float up[16];
    load16(acc + p.n_out, up);
#pragma unroll
    for (int e = 0; e < 16; ++e) v[e] = round_bf16(round_bf16(v[e] * (1.f / (1.f + expf(-v[e])))) * up[e]);
  }
  if (p.res != nullptr) {
    float r[16];
    load16(static_cast<const __nv_bfloat16*>(p.res) + row * p.stride_r + 16 * i, r);
#pragma unroll
    for (int e = 0; e < 16; ++e) v[e] = round_bf16(r[e] + v[e]);
  }
  if (p.out != nullptr) {
    uint32_t o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = pack_bf16(v[2 * j], v[2 * j + 1]);
    uint4* to = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + row * p.stride_o + 16 * i);
    to[0] = make_uint4(o[0], o[1], o[2], o[3]);
    to[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
  if (p.ss_out != nullptr) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) s = fmaf(v[e], v[e], s);
    p.ss_out[static_cast<int64_t>(row) * groups + i] = s;
  }
}

template <int L, int GROUP, int NT>
__global__ void __launch_bounds__(kGemmThreads, 1) packed_gemm_kernel(PackedGemmParams p) {
  using S = GemmShape<L, GROUP, NT>;
  constexpr int kStages = S::kStages;
  constexpr int kWPer = S::kWords / kGemmThreads;                                  // weight copies a thread
  constexpr int kSPer = (S::kScaleWords + kGemmThreads - 1) / kGemmThreads;        // scale copies
  constexpr int kXPer = (S::kXWords + kGemmThreads - 1) / kGemmThreads;            // x copies
  constexpr int kPerTile = S::kGroups * 4;                                         // scale words a tile and stage
  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * S::kRows;
  const int mb = min(p.m - row0, S::kRows);
  const int n_out = p.glu ? p.n / 2 : p.n;  // outputs
  const int tiles_out = n_out / 16;
  const int chunks = p.k / S::kCh;
  const int groups = p.k / GROUP;
  // This CTA's stages of K: all, or (a cluster of gridDim.z CTAs splitting K) its share; st0 + i is absolute.
  const int n_st = p.k / kStageK / gridDim.z, st0 = blockIdx.z * n_st;
  // A CTA's 16 weight tiles (local lt): its 16 output tiles, or (glu) 8 gate tiles and their 8 up tiles. Warp w
  // multiplies local tiles lt_of(w, 0) and lt_of(w, 1); live: the tile lies inside the weight.
  const int blk = blockIdx.y;
  const auto global_tile = [&](int lt) {
    return p.glu ? (lt < 8 ? 8 * blk + lt : tiles_out + 8 * blk + lt - 8) : kTiles * blk + lt;
  };
  const auto tile_live = [&](int lt) { return p.glu ? 8 * blk + lt % 8 < tiles_out : kTiles * blk + lt < tiles_out; };

  // Each thread's copies, their sources and destinations fixed but for the stage (offsets added per stage).
  const uint4* w = static_cast<const uint4*>(p.w);
  uint32_t w_off[kWPer];
  uint32_t w_live = 0;
#pragma unroll
  for (int c = 0; c < kWPer; ++c) {
    const int i = tid + c * kGemmThreads, lt = i / (S::kChunks * 32);
    w_off[c] = static_cast<uint32_t>(global_tile(lt)) * chunks * 32 + i % (S::kChunks * 32);
    w_live |= tile_live(lt) ? 1u << c : 0u;
  }
  const float* s_src[kSPer];
  uint32_t s_live = 0;
#pragma unroll
  for (int c = 0; c < kSPer; ++c) {
    const int i = tid + c * kGemmThreads, which = i / (kTiles * kPerTile), j = i % (kTiles * kPerTile);
    const int lt = j / kPerTile;
    s_src[c] = (which ? p.mn : p.s) + static_cast<int64_t>(global_tile(lt)) * groups * 16 + 4 * (j % kPerTile);
    s_live |= i < S::kScaleWords && tile_live(lt) ? 1u << c : 0u;
  }
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.nw != nullptr ? p.xn : p.x);
  const int64_t stride_x = p.nw != nullptr ? p.k : p.stride_x;
  const __nv_bfloat16* x_base = x + row0 * stride_x;
  int x_off[kXPer];
  uint32_t x_live = 0;
#pragma unroll
  for (int c = 0; c < kXPer; ++c) {
    const int i = tid + c * kGemmThreads, r = i / 16;
    x_off[c] = static_cast<int>(r * stride_x) + 8 * (i % 16);
    x_live |= i < S::kXWords && r < mb ? 1u << c : 0u;  // rows past M are not copied: their columns are not written
  }
  const uint32_t smem_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 16 * tid;
  // A stage: the weight words [tile][chunk][lane], the scale rows [scales, mins][tile][group][16], x [row][kXStride].
  const auto load_weights = [&](int slot, int st) {
    const uint32_t at = smem_at + slot * S::kStageBytes;
#pragma unroll
    for (int c = 0; c < kWPer; ++c)
      if (w_live >> c & 1) copy_async16(at + 16 * c * kGemmThreads, w + w_off[c] + st * S::kChunks * 32);
#pragma unroll
    for (int c = 0; c < kSPer; ++c)
      if (s_live >> c & 1) copy_async16(at + 16 * (S::kWords + c * kGemmThreads), s_src[c] + st * S::kGroups * 16);
  };
  const auto load_x = [&](int slot, int st) {
    const uint32_t at = smem_at - 16 * tid + slot * S::kStageBytes + 16 * (S::kWords + S::kScaleWords);
#pragma unroll
    for (int c = 0; c < kXPer; ++c) {
      const int i = tid + c * kGemmThreads;
      if (x_live >> c & 1)
        copy_async16(at + 2 * ((i / 16) * kXStride + 8 * (i % 16)), x_base + x_off[c] + st * kStageK);
    }
  };

  fill_ring<kStages>(n_st, st0, load_weights, load_x);

  const int lt_a = p.glu ? warp : 2 * warp, lt_b = p.glu ? 8 + warp : 2 * warp + 1;  // this warp's two tiles
  const bool live_a = tile_live(lt_a), live_b = tile_live(lt_b);
  float acc[2][NT][4] = {};
  for (int it = 0; it < n_st; ++it) {
    copies_wait<kStages - 2>();  // this thread's copies of stage it are in,
    __syncthreads();             // everyone's too, and everyone is done with the slot the next copies overwrite
    const int next = it + kStages - 1;
    if (next < n_st) {
      load_weights(next % kStages, st0 + next);
      load_x(next % kStages, st0 + next);
    }
    copies_commit();
    if (!live_a) continue;  // a block's last tiles past N (warp-uniform)
    const uint4* ws = smem + (it % kStages) * (S::kStageBytes / 16);
    const float* ss = reinterpret_cast<const float*>(ws + S::kWords);
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(ws + S::kWords + S::kScaleWords);
    uint32_t s2[2][2], m2[2][2] = {};  // [tile][rows g, g + 8]: the step's group's scale (and min) as bf16 pairs
#pragma unroll
    for (int cc = 0; cc < S::kChunks; ++cc) {
      uint4 wv[2];
      wv[0] = ws[(lt_a * S::kChunks + cc) * 32 + lane];
      wv[1] = ws[(lt_b * S::kChunks + cc) * 32 + lane];
#pragma unroll
      for (int j = 0; j < S::kSteps; ++j) {
        const int js = cc * S::kSteps + j;  // the stage's MMA step
        if (16 * js % GROUP == 0) {         // a new scale group
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float* sc = ss + ((h ? lt_b : lt_a) * S::kGroups + 16 * js / GROUP) * 16;
            s2[h][0] = pack_bf16(sc[g], sc[g]);
            s2[h][1] = pack_bf16(sc[g + 8], sc[g + 8]);
            if constexpr (L == kQ4aMma) {
              const float* mn = sc + kTiles * S::kGroups * 16;
              m2[h][0] = pack_bf16(mn[g], mn[g]);
              m2[h][1] = pack_bf16(mn[g + 8], mn[g + 8]);
            }
          }
        }
        uint32_t b[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2 v = *reinterpret_cast<const uint2*>(xs + (nt * 8 + g) * kXStride + 16 * js + 4 * t);
          b[nt][0] = v.x;
          b[nt][1] = v.y;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 1 && !live_b) break;
          uint32_t a[4];
          dequant_scaled<L>(wv[h], j, s2[h], m2[h], a);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[h][nt], a, b[nt][0], b[nt][1]);
        }
      }
    }
  }
  copies_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // K split over the cluster: warp w's sums added up, in rank order, by rank w % splits (acc as one flat array)
  if (gridDim.z > 1 && !cluster_sum(reinterpret_cast<float (&)[2 * NT * 4]>(acc), smem, warp, lane)) return;
#else
  if (gridDim.z > 1) __trap();  // no clusters before sm_90 (launch_overlapped refuses such a launch)
#endif

  // Epilogue: acc[h][nt][e] is feature g + 8 (e >> 1) of tile h's 16, row 8 nt + 2 t + (e & 1) of the block; each
  // output rounded to bf16 as the eager linear, then SwiGLU (glu: h 0 the gate, 1 the up projection of one output)
  // and the residual add, each rounded as the eager ops; each row's sum of squares over each 16 outputs.
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
  const __nv_bfloat16* res = static_cast<const __nv_bfloat16*>(p.res);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (p.glu && h == 1) break;
    const int lt = h ? lt_b : lt_a;
    const int tile = p.glu ? 8 * blk + warp : kTiles * blk + lt;  // the output tile
    const bool live = h ? live_b : live_a;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int rb = 0; rb < 2; ++rb) {  // row 8 nt + 2 t + rb: elements rb (feature g) and rb + 2 (g + 8)
        const int r = 8 * nt + 2 * t + rb;
        const int64_t row = row0 + r;
        float ssq = 0.f;
#pragma unroll
        for (int e = rb; e < 4; e += 2) {
          const int f = tile * 16 + g + 8 * (e >> 1);
          float v = round_bf16(acc[h][nt][e]);
          if (p.glu) {
            const float up = round_bf16(acc[1][nt][e]);
            v = round_bf16(round_bf16(v / (1.f + __expf(-v))) * up);
          }
          if (res != nullptr && live && r < mb) v = round_bf16(__bfloat162float(res[row * p.stride_r + f]) + v);
          if (live && r < mb) out[row * p.stride_o + f] = __float2bfloat16_rn(v);
          ssq = fmaf(v, v, ssq);
        }
        if (p.ss_out != nullptr) {  // the 8 lanes of a t hold the tile's 16 features of this row
          ssq += __shfl_xor_sync(0xffffffffu, ssq, 4);
          ssq += __shfl_xor_sync(0xffffffffu, ssq, 8);
          ssq += __shfl_xor_sync(0xffffffffu, ssq, 16);
          if (g == 0 && live && r < mb) p.ss_out[row * tiles_out + tile] = ssq;
        }
      }
  }
}

template <int L, int GROUP, int NT>
const void* gemm_kernel() {
  return reinterpret_cast<const void*>(packed_gemm_kernel<L, GROUP, NT>);
}

// The kernel and its dynamic shared memory for a layout, group and rows a block (nullptr: none built).
template <int L, int GROUP>
const void* kernel_for_rows(int rows, size_t& smem) {
  if (rows == 16) { smem = GemmShape<L, GROUP, 2>::kBytes; return gemm_kernel<L, GROUP, 2>(); }
  if (rows == 32) { smem = GemmShape<L, GROUP, 4>::kBytes; return gemm_kernel<L, GROUP, 4>(); }
  smem = GemmShape<L, GROUP, 8>::kBytes;
  return gemm_kernel<L, GROUP, 8>();
}

struct GemmPick {  // the kernel for blocks of `rows` rows, and its shared memory
  int rows;
  size_t* smem;
  template <int L, int GROUP>
  const void* get() const { return kernel_for_rows<L, GROUP>(rows, *smem); }
};

const void* kernel_for(int layout, int group, int rows, size_t& smem) {
  return for_layout_and_group(layout, group, GemmPick{rows, &smem});
}

}  // namespace

PackedGemmPlan packed_gemm_plan(int m, int n, int k, int layout, int group, bool glu) {
  PackedGemmPlan plan{0, 0, 0, 1};
  if (m < 1 || !packed_linear_supported(layout, group, n, k) || k % kStageK != 0 || (glu && n % 32 != 0)) return plan;
  const int rows = m <= 16 ? 16 : m <= 32 ? 32 : 64;
  size_t smem = 0;
  const void* kernel = kernel_for(layout, group, rows, smem);  // sets smem: not in smem_fits' own arguments
  if (!smem_fits(kernel, smem)) return plan;
  plan.rows = rows;
  plan.row_blocks = (m + rows - 1) / rows;
  plan.col_blocks = glu ? (n / 32 + 7) / 8 : (n / 16 + kTiles - 1) / kTiles;
  // Fewer blocks than SMs / 2 (Hopper: clusters): split K over up to 4 CTAs a block where all the clusters are
  // resident at once (a cluster's CTAs share a GPC: with one CTA an SM fewer clusters fit than SMs / splits). H100,
  // int4 g128 at 64 rows, 1 / 2 / 4 / 8 splits: o 67.7 / 38.9 / 25.3 / 38.5 us, down 224 / 118 / 65 / 78; two
  // 32-row blocks of 4 splits (32 clusters) o 32.7 us.
  plan.k_splits = cluster_splits(kernel, smem, kGemmThreads, plan.row_blocks * plan.col_blocks, k / kStageK);
  return plan;
}

int packed_gemm_launch(const PackedGemmParams& p, const PackedGemmPlan& plan, cudaStream_t stream) {
  if (plan.rows == 0) return -1;
  if (p.m == 0) return 0;
  if (p.nw != nullptr && (p.ss == nullptr || p.xn == nullptr)) return -1;
  if (plan.k_splits < 1 || plan.k_splits > 8 || p.k / kStageK % plan.k_splits != 0)
    return -1;  // a split needs whole stages a CTA (and clusters: launch_overlapped refuses one before sm_90)
  size_t smem = 0;
  const void* kernel = kernel_for(p.layout, p.group, plan.rows, smem);
  allow_smem(kernel, smem);
  if (p.nw != nullptr) {  // the norm's rows first, into xn
    const int e = norm_rows_launch(p, stream);
    if (e != 0) return e;
  }
  void* args[] = {const_cast<PackedGemmParams*>(&p)};
  return static_cast<int>(launch_overlapped(kernel, dim3(plan.row_blocks, plan.col_blocks, plan.k_splits),
                                            kGemmThreads, smem, stream, args, plan.k_splits));
}

int norm_rows_launch(const PackedGemmParams& p, cudaStream_t stream) {
  if (p.m == 0) return 0;
  if (p.nw == nullptr || p.ss == nullptr || p.xn == nullptr || p.k % 8 != 0) return -1;
  return static_cast<int>(launch_overlapped(norm_rows_kernel, dim3(p.m), 256, 0, stream, p));
}

int fold_rows_launch(const FoldRowsParams& p, cudaStream_t stream) {
  if (p.m == 0) return 0;
  if (p.n_out % 16 != 0 || (p.out == nullptr && (p.glu || p.res != nullptr))) return -1;
  const int groups = p.n_out / 16;
  return static_cast<int>(launch_overlapped(fold_rows_kernel, dim3(p.m, (groups + 255) / 256), 256, 0, stream, p));
}

}  // namespace onecopy_native
