// Packed int4 / int8 weights times many rows on Hopper's warpgroup MMA (wgmma, sm_90a): the weight dequantized in
// registers as wgmma's A, x's rows read by the tensor cores from shared memory as B, so that past 64 rows and in
// prefill the weight is never written out in bf16 (the op unpacks it for cuBLAS there: at 1k rows 6.5 ms of an 8B
// model's 31.5 ms TTFT on the H100, 95% of copy bandwidth). Design and sources: docs/research/wgmma_packed_gemm.md.
// ops.cpp's packed_gemm and the decode op take it for the rows where it measures fastest (wgmma_serves).
//
// Why it fits the tile order: wgmma's register A for m64nNk16 is, for warp w of the warpgroup, rows 16w..16w+15 in
// mma.sync m16n8k16's A layout, which is what a lane's 16-byte fragment unpacks into (dequant_step) -- but for the
// tile order's K permutation: a lane holds k = 4t..4t+3 of each 16 (the MMA's slots 2t, 2t+1, 2t+8, 2t+9), which the
// GEMV matches with one 8-byte load of x, while wgmma reads B in the MMA's own k order. So each lane rebuilds its
// fragment words from the words of lanes 4g + t/2 and 4g + 2 + t/2 (one byte permute a word; the same selector for
// int4 and int8), and x stays in its natural order in shared memory.
//
// A CTA: 2 warpgroups (8 warps, warp w one 16-feature tile: 128 outputs), NB rows of x (64, 128 or 256: wgmma's N), K in
// stages of 128 values through a cp.async ring (weights, scales, x in two 64-K boxes of NB rows x 128 bytes with the
// 128-byte swizzle). A stage: each warp's 8 A fragments (its tile, 8 k16 steps) dequantized with their groups' scale
// and min (s q + m in one bf16x2 FMA, s and m rounded to bf16 first: packed_gemm's arithmetic), one wgmma a step for
// its warpgroup's 64 outputs issued as soon as its A is ready (the next step's dequantization overlaps it), then
// wait at the stage's end. Where the blocks fill under half the SMs (a 4096-output weight at up to a
// few hundred rows: 32-64 CTAs) K is split over a cluster of 2-4 CTAs and their fp32 sums added in rank order through
// distributed shared memory, as packed_gemm does. No folds (the op's norm and fold kernels run around it).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mma_common.cuh"
#include "packed_gemm.h"
#include "packed_linear.h"

namespace onecopy_native {

namespace {

using namespace mma;

constexpr int kWgThreads = 256;  // 2 warpgroups
constexpr int kWgTiles = 8;      // 16-feature tiles a CTA (one a warp): 128 outputs
constexpr int kWgStageK = 128;   // K values a stage
#ifndef ONECOPY_WGMMA_RING_KB
#define ONECOPY_WGMMA_RING_KB 200
#endif
// Build-time variants (benchmarks/packed_wgmma_harness.cu times them; -D0/-D1 to A/B): two CTAs a SM for 64-row
// blocks (the ring split between them), and a stage's MMAs left in flight while the next stage is dequantized (A
// double-buffered in registers, the ring one stage shallower; blocks of up to 128 rows: 256 have no registers left).
// Both on by default: on an H100 (q4a g128, 16-128 rows) they took gate_up from 52.7-72.9 to 41.1-68.0 us and down
// from 46.4-62.6 to 39.7-58.2 us (benchmarks/results/packed_wgmma_variants_h100.txt), 256+ rows unchanged.
#ifndef ONECOPY_WGMMA_MIN_BLOCKS
#define ONECOPY_WGMMA_MIN_BLOCKS 2
#endif
#ifndef ONECOPY_WGMMA_PIPELINE
#define ONECOPY_WGMMA_PIPELINE 1
#endif

template <int L, int GROUP, int NB>
struct WgShape {
  static constexpr int kCh = L == kQ8sMma ? 32 : 64;                   // values a chunk of the tile order
  static constexpr int kChunks = kWgStageK / kCh;                      // 2 (int4) or 4 (int8) a stage
  static constexpr int kSteps = kCh / 16;                              // k16 steps a chunk
  static constexpr int kXBytes = 2 * NB * 128;                         // x: two 64-K boxes of NB rows x 128 B
  static constexpr int kWords = kWgTiles * kChunks * 32;               // 16-byte weight words
  static constexpr int kGroups = kWgStageK / GROUP;                    // scale groups a stage
  static constexpr int kScaleRows = L == kQ4aMma ? 2 : 1;              // scales (and mins)
  static constexpr int kScaleWords = kScaleRows * kWgTiles * kGroups * 4;
  static constexpr int kRaw = kXBytes + 16 * (kWords + kScaleWords);
  static constexpr int kStageBytes = (kRaw + 1023) / 1024 * 1024;     // each stage's x 1024-byte aligned
  // 256 rows' x (64 KB a stage) take the most shared memory the H100 gives a block (227 KB): three stages for int4
  // with groups of 64 or 128, two for q4a g32 and int8 (their weights and scales make a stage 76-81 KB)
  static constexpr int kBlocksPerSm = NB == 64 ? ONECOPY_WGMMA_MIN_BLOCKS : 1;
  static constexpr int kFit = (NB == 256 ? 225 : ONECOPY_WGMMA_RING_KB / kBlocksPerSm) * 1024 / kStageBytes;
  static constexpr int kStages = kFit > 6 ? 6 : kFit < 2 ? 2 : kFit;
  static constexpr bool kPipe = ONECOPY_WGMMA_PIPELINE && NB <= 128 && kStages >= 3;
  static constexpr int kAhead = kPipe ? kStages - 2 : kStages - 1;     // stages in flight ahead of the one in use
  static constexpr int kPartialBytes = 8 * (NB / 8) * 32 * 16;          // a K split's sums: [warp][n8 block][lane]
  static constexpr int kRing = kStages * kStageBytes > kPartialBytes ? kStages * kStageBytes : kPartialBytes;
  static constexpr int kBytes = kRing + 1024;                            // + room to align the base to 1024
};

// The shared-memory descriptor of a k16 step of B in a 128-byte-swizzled box: start address, LBO 1 (unused with a
// swizzle), SBO 1024 bytes (the next 8 rows), layout 1 (128B); the box starts 1024-byte aligned (base offset 0).
[[maybe_unused]] __device__ __forceinline__ uint64_t b_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

template <int L, int GROUP, int NB>
__global__ void __launch_bounds__(kWgThreads, WgShape<L, GROUP, NB>::kBlocksPerSm) packed_wgmma_kernel(PackedGemmParams p) {
  using S = WgShape<L, GROUP, NB>;
  static_assert(S::kChunks * S::kSteps == 8 && NB % 64 == 0, "a stage is 8 k16 steps; NB a multiple of 64");
#ifdef ONECOPY_WGMMA
  constexpr int kStages = S::kStages;
  constexpr int kWPer = S::kWords / kWgThreads;
  constexpr int kSPer = (S::kScaleWords + kWgThreads - 1) / kWgThreads;
  constexpr int kXPer = NB * 16 / kWgThreads;  // 16-byte pieces of x a stage: NB rows x 16
  constexpr int kPerTile = S::kGroups * 4;
  extern __shared__ uint4 smem_raw[];
  const uint32_t raw_at = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base_at = (raw_at + 1023) & ~1023u;
  unsigned char* base = reinterpret_cast<unsigned char*>(smem_raw) + (base_at - raw_at);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * NB, blk = blockIdx.y;
  const int chunks = p.k / S::kCh, groups = p.k / GROUP;
  // This CTA's stages of K: all, or (a cluster of gridDim.z CTAs splitting K) its share; st0 + i is absolute.
  const int n_st = p.k / kWgStageK / gridDim.z, st0 = blockIdx.z * n_st;

  // Each thread's copies (as packed_gemm's): weight words [tile][chunk][lane], scale rows [scales, mins][tile][group]
  // [16], x pieces (row r, 16-byte piece c of the stage's 128 K) to the 128-byte-swizzled boxes.
  const uint4* w = static_cast<const uint4*>(p.w);
  uint32_t w_off[kWPer];
#pragma unroll
  for (int c = 0; c < kWPer; ++c) {
    const int i = tid + c * kWgThreads, lt = i / (S::kChunks * 32);
    w_off[c] = static_cast<uint32_t>(kWgTiles * blk + lt) * chunks * 32 + i % (S::kChunks * 32);
  }
  const float* s_src[kSPer];
  uint32_t s_live = 0;
#pragma unroll
  for (int c = 0; c < kSPer; ++c) {
    const int i = tid + c * kWgThreads, which = i / (kWgTiles * kPerTile), j = i % (kWgTiles * kPerTile);
    s_src[c] = (which ? p.mn : p.s) + static_cast<int64_t>(kWgTiles * blk + j / kPerTile) * groups * 16 + 4 * (j % kPerTile);
    s_live |= i < S::kScaleWords ? 1u << c : 0u;
  }
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(row0) * p.stride_x;
  const int mb = min(p.m - row0, NB);
  // piece (tid % 16) of rows tid / 16 + 16 c: the row's swizzle (r % 8) is the same for every c
  constexpr int kRowStep = kWgThreads / 16;
  const int r0 = tid / 16, piece = tid % 16;
  const int x_src0 = static_cast<int>(r0 * p.stride_x) + 8 * piece;
  const uint32_t x_dst0 = (piece / 8) * NB * 128 + 128 * r0 + 16 * ((piece % 8) ^ (r0 & 7));
  const auto load_weights = [&](int slot, int st) {
    const uint32_t at = base_at + slot * S::kStageBytes + S::kXBytes + 16 * tid;
#pragma unroll
    for (int c = 0; c < kWPer; ++c) copy_async16(at + 16 * c * kWgThreads, w + w_off[c] + st * S::kChunks * 32);
#pragma unroll
    for (int c = 0; c < kSPer; ++c)
      if (s_live >> c & 1) copy_async16(at + 16 * (S::kWords + c * kWgThreads), s_src[c] + st * S::kGroups * 16);
  };
  const auto load_x = [&](int slot, int st) {
    const uint32_t at = base_at + slot * S::kStageBytes;
#pragma unroll
    for (int c = 0; c < kXPer; ++c)
      if (r0 + kRowStep * c < mb)
        copy_async16(at + x_dst0 + 128 * kRowStep * c, x + x_src0 + static_cast<int64_t>(kRowStep * c) * p.stride_x +
                                                           st * kWgStageK);
  };

  fill_ring<S::kAhead + 1>(n_st, st0, load_weights, load_x);

  const int lt = warp;                 // this warp's tile in the CTA
  const int pick_a = 4 * g + (t >> 1), pick_b = pick_a + 2;  // the lanes whose words hold this lane's k slots
  const uint32_t sel = 0x6240u + 0x1111u * (t & 1);
  float acc[NB / 2];
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) acc[i] = 0.f;
  // Stage `it` in ring slot it % kStages, its A in `a`: the stages after it are copied ahead (kAhead); the slot
  // refilled here held stage it - 1 (it - 2 pipelined), whose MMAs every warp retired before the barrier.
  const auto run_stage = [&](int it, uint32_t (&a)[8][4]) {
    copies_wait<S::kAhead - 1>();
    proxy_fence();    // this thread's landed x bytes, to wgmma's async proxy
    __syncthreads();  // everyone's stage it is in; every warpgroup is done with the slot the next copies overwrite
    const int next = it + S::kAhead;
    if (next < n_st) {
      load_weights(next % kStages, st0 + next);
      load_x(next % kStages, st0 + next);
    }
    copies_commit();
    unsigned char* stage = base + (it % kStages) * S::kStageBytes;
    const uint4* ws = reinterpret_cast<const uint4*>(stage + S::kXBytes);
    const float* ss = reinterpret_cast<const float*>(ws + S::kWords);
    const uint32_t x_at = base_at + (it % kStages) * S::kStageBytes;
    // Each k16 step's A is dequantized while the tensor cores run the steps before it (wgmma is asynchronous and
    // every step has its own registers): the fence orders the step's register writes before its MMA.
    pin(acc);
#pragma unroll
    for (int cc = 0; cc < S::kChunks; ++cc) {
      const uint4 wa = ws[(lt * S::kChunks + cc) * 32 + pick_a], wb = ws[(lt * S::kChunks + cc) * 32 + pick_b];
      const uint4 wv = make_uint4(__byte_perm(wa.x, wb.x, sel), __byte_perm(wa.y, wb.y, sel),
                                  __byte_perm(wa.z, wb.z, sel), __byte_perm(wa.w, wb.w, sel));
#pragma unroll
      for (int j = 0; j < S::kSteps; ++j) {
        const int js = cc * S::kSteps + j;
        const float* sc = ss + (lt * S::kGroups + 16 * js / GROUP) * 16;
        const float* mn = sc + kWgTiles * S::kGroups * 16;
        const uint32_t s2[2] = {pack_bf16(sc[g], sc[g]), pack_bf16(sc[g + 8], sc[g + 8])};
        const uint32_t m2[2] = {L == kQ4aMma ? pack_bf16(mn[g], mn[g]) : 0u, L == kQ4aMma ? pack_bf16(mn[g + 8], mn[g + 8]) : 0u};
        dequant_scaled<L>(wv, j, s2, m2, a[js]);
        pin(a[js]);
        wgmma_fence();
        wgmma_step(acc, a[js], b_desc(x_at + (js / 4) * NB * 128 + 32 * (js % 4)));
      }
    }
    wgmma_commit();
    // retire this stage's MMAs before `a` is rewritten and its slot refilled; pipelined, the previous stage's (the
    // other `a`, the slot refilled next)
    if constexpr (S::kPipe) wgmma_wait1(); else wgmma_wait0();
    pin(acc);
  };
  if constexpr (S::kPipe) {
    // pairs of stages with no branch between them (a group in flight across a conditional made ptxas serialize
    // the MMAs: C7513), then an odd last stage
    uint32_t a0[8][4], a1[8][4];
    int it = 0;
    for (; it + 1 < n_st; it += 2) {
      run_stage(it, a0);
      run_stage(it + 1, a1);
    }
    if (it < n_st) run_stage(it, a0);
    wgmma_wait0();
    pin(acc);
  } else {
    uint32_t a[8][4];
    for (int it = 0; it < n_st; ++it) run_stage(it, a);
  }
  copies_wait<0>();
  // K split over the cluster: warp w's sums added up, in rank order, by rank w % splits
  if (gridDim.z > 1 && !cluster_sum(acc, base, warp, lane)) return;

  // acc[4 i + 2 h + e]: feature 16 lt + g + 8 h of the block, x row 8 i + 2 t + e; rounded to bf16 as a linear's output
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
  const int f0 = (kWgTiles * blk + lt) * 16 + g;
#pragma unroll
  for (int i = 0; i < NB / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 8 * i + 2 * t + (e & 1);
      if (r < mb) out[static_cast<int64_t>(row0 + r) * p.stride_o + f0 + 8 * (e >> 1)] = __float2bfloat16_rn(acc[4 * i + e]);
    }
#else
  __trap();  // not sm_90a: packed_wgmma_launch refuses such a device
#endif
}

template <int L, int GROUP>
const void* wg_kernel(int nb, size_t& smem) {
  if (nb == 64) { smem = WgShape<L, GROUP, 64>::kBytes; return reinterpret_cast<const void*>(packed_wgmma_kernel<L, GROUP, 64>); }
  if (nb == 256) { smem = WgShape<L, GROUP, 256>::kBytes; return reinterpret_cast<const void*>(packed_wgmma_kernel<L, GROUP, 256>); }
  smem = WgShape<L, GROUP, 128>::kBytes;
  return reinterpret_cast<const void*>(packed_wgmma_kernel<L, GROUP, 128>);
}

struct WgPick {  // the kernel for blocks of `nb` rows, and its shared memory
  int nb;
  size_t* smem;
  template <int L, int GROUP>
  const void* get() const { return wg_kernel<L, GROUP>(nb, *smem); }
};

}  // namespace

bool packed_wgmma_supported(int m, int n, int k, int layout, int group) {
  if (m < 1 || n % (16 * kWgTiles) != 0 || k % kWgStageK != 0 || !packed_linear_supported(layout, group, n, k))
    return false;
  return device_attribute(cudaDevAttrComputeCapabilityMajor) == 9 && device_attribute(cudaDevAttrComputeCapabilityMinor) == 0;
}

int packed_wgmma_launch(const PackedGemmParams& p, cudaStream_t stream, int block_rows) {
  if (!packed_wgmma_supported(p.m, p.n, p.k, p.layout, p.group)) return -1;
  if (p.nw != nullptr || p.res != nullptr || p.glu || p.ss_out != nullptr) return -1;  // no folds here
  if (block_rows != 0 && block_rows != 64 && block_rows != 128 && block_rows != 256) return -1;
  // A block's rows: the fewest that hold them all up to 128; past that 256 (the weight dequantized once per 256
  // rows) where that still makes 64 blocks, else 128 (H100, int4 g128, 256 rows: the 4096-output weights 22 / 67 us
  // at 128 rows a CTA against 33 / 100 at 256; the gate/up weight 121 against 151; packed_gemm_wgmma_h100.json).
  const int col_blocks = p.n / (16 * kWgTiles);
  const int nb = block_rows                                 ? block_rows
                 : p.m <= 64                                ? 64
                 : p.m <= 128                               ? 128
                 : col_blocks * ((p.m + 255) / 256) >= 64   ? 256
                                                            : 128;
  size_t smem = 0;
  const void* kernel = for_layout_and_group(p.layout, p.group, WgPick{nb, &smem});
  if (!smem_fits(kernel, smem)) return -1;
  allow_smem(kernel, smem);
  const dim3 grid((p.m + nb - 1) / nb, p.n / (16 * kWgTiles));
  const unsigned splits = cluster_splits(kernel, smem, kWgThreads, static_cast<int>(grid.x * grid.y), p.k / kWgStageK);
  void* args[] = {const_cast<PackedGemmParams*>(&p)};
  return static_cast<int>(launch_overlapped(kernel, dim3(grid.x, grid.y, splits), kWgThreads, smem, stream, args, splits));
}

}  // namespace onecopy_native
