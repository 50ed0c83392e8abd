// Probe (not used by onecopy yet): Hopper's warpgroup MMA (wgmma) on onecopy's tile-ordered int4 weights, the first
// step towards a packed GEMM whose dequantization hides under tensor-core time at 64 rows and in prefill (see
// docs/research/wgmma_packed_gemm.md). It checks the three things a real kernel rests on, against a CPU reference:
//   1. the weight as wgmma's A from registers: warp w of the warpgroup gives rows 16w..16w+15 of the 64 in the
//      m16n8k16 A-fragment layout, which is what the tile order's 16-byte fragment unpacks into (dequant_step);
//   2. x's rows as B from shared memory, K-major, no swizzle: 8x8 core matrices of 128 contiguous bytes, LBO the
//      step between the two core matrices of a k16 along K, SBO the step between 8-row groups;
//   3. the tile order's K permutation: a lane's fragment holds k = 4t..4t+3 of each 16 (one 8-byte load of x in the
//      GEMV), i.e. the MMA's logical k 2t, 2t+1, 2t+8, 2t+9; wgmma reads B in logical k, so x is staged with the
//      same permutation (4-byte pairs: physical pair q -> logical pair q / 2 + 4 (q % 2) within each 16 values).
// One CTA = one warpgroup = 64 outputs (4 tiles of 16) x 64 rows; K in 64-value chunks (one 4-bit chunk of the tile
// order a warp step), no pipelining: a correctness probe first, then a timing of the plain loop.
// Build and run (H100/H200, repository root):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ionecopy/kernels/native -o /tmp/wgp \
//     benchmarks/wgmma_probe.cu && /tmp/wgp
// Prints the max error against float64 (q4a g128, 256 outputs x 1024 K x 64 rows, then 4096 x 4096 x 64) and us a call.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "mma_common.cuh"

using namespace onecopy_native;
using namespace onecopy_native::mma;

namespace {

constexpr int kRows = 64;     // x rows a CTA: wgmma's N
constexpr int kChunk = 64;    // 4-bit values of K a chunk of the tile order (4 k16 steps)
constexpr int kGroup = 128;   // scale group
constexpr int kCoreBytes = 128;                      // a core matrix: 8 rows x 8 bf16
constexpr int kLbo = (kRows / 8) * kCoreBytes;       // next core matrix along K: after all 8-row groups
constexpr int kSbo = kCoreBytes;                     // next 8-row group
constexpr int kStageBytes = (kChunk / 8) * kLbo;     // a chunk of x: 8 KB

// The shared-memory matrix descriptor (no swizzle): start address, LBO and SBO in 16-byte units, layout type 0.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((kLbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((kSbo & 0x3FFFF) >> 4) << 32;
  return d;  // base offset 0 (bits 49-51), layout type 0: no swizzle (bits 62-63)
}

struct Params {
  const uint4* w;     // q4a_mma values
  const float* s;     // scales, tile order [N / 16, K / group, 16]
  const float* mn;    // mins, the same
  const __nv_bfloat16* x;  // [M, K]
  float* out;         // [M, N] (fp32 here: the probe compares the sums)
  int m, n, k;
};

// grid (N / 64, ceil(M / 64)), 128 threads.
__global__ void __launch_bounds__(128) probe_kernel(Params p) {
  __shared__ __align__(128) unsigned char xs[kStageBytes];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * 4 + warp, row0 = blockIdx.y * kRows;
  const int chunks = p.k / kChunk, groups = p.k / kGroup;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  const uint32_t xs_at = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  for (int c = 0; c < chunks; ++c) {
    // x's chunk: each thread 4 x 16 bytes (row r, physical k 8 b .. 8 b + 7), scattered as 4-byte pairs into the
    // logical order of the core-matrix layout
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int item = tid + 128 * i, r = item / 8, b = item % 8;  // 64 rows x 8 pieces of 8 values
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row0 + r < p.m) v = *reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(row0 + r) * p.k + c * kChunk + 8 * b);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = (b % 2) * 4 + e;             // physical pair within the 16 values of k16 step b / 2
        const int lk = 16 * (b / 2) + 2 * (q / 2 + 4 * (q % 2));  // its logical k
        const int off = ((lk / 8) * (kRows / 8) + r / 8) * kCoreBytes + (r % 8) * 16 + (lk % 8) * 2;
        *reinterpret_cast<uint32_t*>(xs + off) = words[e];
      }
    }
    proxy_fence();  // ordinary stores, read by wgmma through the async proxy; then the barrier for the warpgroup
    __syncthreads();
    const uint4 wv = p.w[(static_cast<int64_t>(tile) * chunks + c) * 32 + lane];
    const int grp = c * kChunk / kGroup;
    const float* sc = p.s + (static_cast<int64_t>(tile) * groups + grp) * 16;
    const float* mn = p.mn + (static_cast<int64_t>(tile) * groups + grp) * 16;
    const uint32_t s2[2] = {pack_bf16(sc[g], sc[g]), pack_bf16(sc[g + 8], sc[g + 8])};
    const uint32_t m2[2] = {pack_bf16(mn[g], mn[g]), pack_bf16(mn[g + 8], mn[g + 8])};
    uint32_t a[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) dequant_scaled<kQ4aMma>(wv, j, s2, m2, a[j]);  // s q + m in bf16
    wgmma_fence();  // the A registers and the accumulators were written by ordinary instructions
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_step(d, a[j], smem_desc(xs_at + 2 * j * kLbo));
    wgmma_commit();
    wgmma_wait0();  // before the next chunk overwrites xs (and a)
    __syncthreads();
  }
  // D: warp w rows (outputs) 16 w + g and + 8; n8 block i: columns (x rows) 8 i + 2 t, + 1
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int f = tile * 16 + g + 8 * (e >> 1), r = row0 + 8 * i + 2 * t + (e & 1);
      if (r < p.m) p.out[static_cast<int64_t>(r) * p.n + f] = d[4 * i + e];
    }
}

float bf16_round(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7fff + ((u >> 16) & 1);
  u &= 0xffff0000u;
  std::memcpy(&v, &u, 4);
  return v;
}

uint16_t bf16_bits(float v) {  // v already a bf16 value
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Check one shape against float64 and time it; returns false on a wrong result.
bool run(int n, int k, int m, int reps) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> nib(0, 15);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int groups = k / kGroup, chunks = k / kChunk;
  std::vector<uint8_t> q(static_cast<size_t>(n) * k);
  for (auto& v : q) v = static_cast<uint8_t>(nib(rng));
  std::vector<float> s(static_cast<size_t>(n) * groups), mn(s.size());
  for (auto& v : s) v = bf16_round(0.01f * (1.f + std::fabs(nd(rng))));
  for (auto& v : mn) v = bf16_round(-0.08f * (1.f + 0.1f * nd(rng)));
  std::vector<float> x(static_cast<size_t>(m) * k);
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = bf16_round(nd(rng));
    xb[i] = bf16_bits(x[i]);
  }
  // the tile order (models/mma_order.py): row = 16 f + 8 h + g, k = 64 c + 16 j + 4 t + 2 p + e ->
  // byte ((f * chunks + c) * 32 + 4 g + t) * 16 + 4 j + 2 e + p, nibble h
  std::vector<uint8_t> w(static_cast<size_t>(n) * k / 2, 0);
  for (int row = 0; row < n; ++row)
    for (int kk = 0; kk < k; ++kk) {
      const int f = row / 16, h = (row % 16) / 8, gg = row % 8, c = kk / 64, r = kk % 64;
      const int j = r / 16, tt = (r % 16) / 4, pp = (r % 4) / 2, e = r % 2;
      const size_t byte = ((static_cast<size_t>(f) * chunks + c) * 32 + 4 * gg + tt) * 16 + 4 * j + 2 * e + pp;
      w[byte] |= static_cast<uint8_t>(q[static_cast<size_t>(row) * k + kk] << (4 * h));
    }
  std::vector<float> so(s.size()), mo(s.size());  // [N / 16, groups, 16]
  for (int row = 0; row < n; ++row)
    for (int gi = 0; gi < groups; ++gi) {
      so[(static_cast<size_t>(row / 16) * groups + gi) * 16 + row % 16] = s[static_cast<size_t>(row) * groups + gi];
      mo[(static_cast<size_t>(row / 16) * groups + gi) * 16 + row % 16] = mn[static_cast<size_t>(row) * groups + gi];
    }
  void *dw, *ds, *dm, *dx, *dout;
  cudaMalloc(&dw, w.size()); cudaMemcpy(dw, w.data(), w.size(), cudaMemcpyHostToDevice);
  cudaMalloc(&ds, so.size() * 4); cudaMemcpy(ds, so.data(), so.size() * 4, cudaMemcpyHostToDevice);
  cudaMalloc(&dm, mo.size() * 4); cudaMemcpy(dm, mo.data(), mo.size() * 4, cudaMemcpyHostToDevice);
  cudaMalloc(&dx, xb.size() * 2); cudaMemcpy(dx, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice);
  cudaMalloc(&dout, static_cast<size_t>(m) * n * 4); cudaMemset(dout, 0, static_cast<size_t>(m) * n * 4);
  Params p{static_cast<const uint4*>(dw), static_cast<const float*>(ds), static_cast<const float*>(dm),
           static_cast<const __nv_bfloat16*>(dx), static_cast<float*>(dout), m, n, k};
  const dim3 grid(n / 64, (m + kRows - 1) / kRows);
  probe_kernel<<<grid, 128>>>(p);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("%dx%dx%d: launch failed: %s\n", n, k, m, cudaGetErrorString(err));
    return false;
  }
  std::vector<float> out(static_cast<size_t>(m) * n);
  cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost);
  // reference: the weight as the kernel dequantizes it (bf16(s q + m), one rounding), float64 sums
  double max_err = 0, max_ref = 0;
  int bad_row = -1, bad_col = -1;
  for (int row = 0; row < n; ++row) {
    std::vector<float> wr(k);
    for (int kk = 0; kk < k; ++kk) {
      const size_t gi = static_cast<size_t>(row) * groups + kk / kGroup;
      wr[kk] = bf16_round(std::fma(s[gi], static_cast<float>(q[static_cast<size_t>(row) * k + kk]), mn[gi]));
    }
    for (int r = 0; r < m; ++r) {
      double acc = 0;
      for (int kk = 0; kk < k; ++kk) acc += static_cast<double>(wr[kk]) * x[static_cast<size_t>(r) * k + kk];
      const double e = std::fabs(acc - out[static_cast<size_t>(r) * n + row]);
      if (e > max_err) { max_err = e; bad_row = r; bad_col = row; }
      max_ref = std::fmax(max_ref, std::fabs(acc));
    }
  }
  const bool ok = max_err <= 1e-3 * max_ref;
  std::printf("%dx%dx%d rows: max |err| %.3g of max |ref| %.3g (worst at x row %d, output %d): %s\n", n, k, m,
              max_err, max_ref, bad_row, bad_col, ok ? "ok" : "WRONG");
  if (reps > 0) {
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) probe_kernel<<<grid, 128>>>(p);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    std::printf("  %.1f us a call (warm weights, plain loop: no pipeline, one warpgroup a CTA)\n", 1000 * ms / reps);
  }
  cudaFree(dw); cudaFree(ds); cudaFree(dm); cudaFree(dx); cudaFree(dout);
  return ok;
}

}  // namespace

int main() {
  bool ok = run(256, 1024, 64, 0);
  ok = run(256, 1024, 40, 0) && ok;  // a partial row block
  ok = run(4096, 4096, 64, 50) && ok;
  return ok ? 0 : 1;
}
