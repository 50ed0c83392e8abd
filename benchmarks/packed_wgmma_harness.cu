// Timing harness for the warpgroup-MMA packed kernel (kernels/native/packed_wgmma.cu) without torch, for build-time
// variants compared in one GPU call: -DONECOPY_WGMMA_RING_KB=... (the cp.async ring), -DONECOPY_WGMMA_MIN_BLOCKS=2
// (two CTAs a SM for 64-row blocks, the ring halved), -DONECOPY_WGMMA_PIPELINE=1 (a stage's MMAs left in flight
// while the next stage is dequantized, A double-buffered: blocks of up to 128 rows). Random bytes (the time does
// not depend on the values), q4a g128 and q8s g128, a CUDA graph of calls over 600 MB of weight copies (cold
// weights), microseconds a call and GB/s of packed bytes. No folds (the op's norm and fold kernels run around it).
// Usage: packed_wgmma_harness [rows, default 64,256,1024] [layouts, default q4a,q8s] [shapes, default o,qkv,down,gate_up]
//   [rows a block, default 0: the launch's pick; e.g. 0,64,128,256]
// Build (H100 / H200, repository root; one binary a variant):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ionecopy/kernels/native [-D...] -o /tmp/pwh \
//     benchmarks/packed_wgmma_harness.cu onecopy/kernels/native/packed_wgmma.cu onecopy/kernels/native/packed_linear.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include "harness.h"
#include "packed_gemm.h"
#include "packed_linear.h"
using namespace onecopy_native;
using harness::listed;

int main(int argc, char** argv) {
  struct Shape { const char* name; int n, k; } shapes[] = {
      {"o", 4096, 4096}, {"qkv", 6144, 4096}, {"down", 4096, 14336}, {"gate_up", 28672, 4096}, {"lm", 128256, 4096}};
  const std::vector<int> rows = harness::ints(argc > 1 ? argv[1] : "64,256,1024");
  const char* layout_list = argc > 2 ? argv[2] : "q4a,q8s";
  const char* shape_list = argc > 3 ? argv[3] : "o,qkv,down,gate_up";
  const std::vector<int> blocks = harness::ints(argc > 4 ? argv[4] : "0");
  for (int layout : {kQ4aMma, kQ8sMma}) for (auto& sh : shapes) for (int m : rows) for (int nb : blocks) {
    if (!listed(layout_list, layout == kQ8sMma ? "q8s" : "q4a") || !listed(shape_list, sh.name)) continue;
    const int n = sh.n, k = sh.k, group = 128;
    const size_t wbytes = layout == kQ8sMma ? (size_t)n * k : (size_t)n * k / 2;
    const size_t sbytes = (size_t)n * (k / group) * 4;
    const harness::WeightCopies c(wbytes, sbytes);
    void *x, *out;
    cudaMalloc(&x, (size_t)m * k * 2); cudaMemset(x, 0, (size_t)m * k * 2);
    cudaMalloc(&out, (size_t)m * n * 2);
    cudaStream_t st; cudaStreamCreate(&st);
    int refused = 0;
    const double us = harness::graph_us(st, c.count(), [&](int i, cudaStream_t stream) {
      PackedGemmParams p = {};
      p.x = x; p.stride_x = k; p.w = c.w[i]; p.s = (const float*)c.s[i];
      p.mn = layout == kQ4aMma ? (const float*)c.mn[i] : nullptr;
      p.out = out; p.stride_o = n;
      p.m = m; p.n = n; p.k = k; p.group = group; p.layout = layout;
      refused |= packed_wgmma_launch(p, stream, nb) != 0;
    });
    if (refused) printf("refused: ");
    printf("%s %s m=%d block_rows=%d %.2f us %.0f GB/s %.0f TFLOP/s err=%s\n", layout == kQ8sMma ? "q8s" : "q4a",
           sh.name, m, nb, us, (wbytes + sbytes * (layout == kQ4aMma ? 2 : 1)) / us / 1e3,
           2.0 * m * n * k / us / 1e6, cudaGetErrorString(cudaGetLastError()));
    cudaFree(x); cudaFree(out);
    cudaStreamDestroy(st);
  }
  return 0;
}
