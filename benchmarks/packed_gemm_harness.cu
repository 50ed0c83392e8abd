// Timing harness for the native packed GEMM (kernels/native/packed_gemm.cu) without torch: build-time variants
// (-DONECOPY_GEMM_RING_KB=...), random bytes, q4a g128 and q8s g128, a CUDA graph of calls over 600 MB of weight
// copies (cold weights), per call microseconds, and the plan each shape and row count gets (the kernel alone, also
// where the op leaves the weight to cuBLAS).
// Usage: packed_gemm_harness [rows, default 16,64] [layouts, default q4a,q8s] [shapes, default all]
//   [K splits, default 0: the plan's; e.g. 0,1,2,4,8 to compare the cluster splits of a weight of few blocks]
//   [rows a block, default 0: the plan's; e.g. 0,32,64]
// Build (CUDA machine, repository root):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -Ionecopy/kernels/native -o /tmp/pgh \
//     benchmarks/packed_gemm_harness.cu onecopy/kernels/native/packed_gemm.cu onecopy/kernels/native/packed_linear.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include "harness.h"
#include "packed_gemm.h"
#include "packed_linear.h"
using namespace onecopy_native;
using harness::listed;

int main(int argc, char** argv) {
  // gate_up with its folds (the norm before, SwiGLU after, the rows' sums of squares), as the decode step runs it
  struct Shape { const char* name; int n, k; bool folds; } shapes[] = {
      {"o", 4096, 4096, false}, {"qkv", 6144, 4096, false}, {"down", 4096, 14336, false},
      {"gate_up", 28672, 4096, true}, {"lm", 128256, 4096, false}};
  const std::vector<int> rows = harness::ints(argc > 1 ? argv[1] : "16,64");
  const char* layout_list = argc > 2 ? argv[2] : "q4a,q8s";
  const char* shape_list = argc > 3 ? argv[3] : "o,qkv,down,gate_up,lm";
  const std::vector<int> splits = harness::ints(argc > 4 ? argv[4] : "0");
  const std::vector<int> blocks = harness::ints(argc > 5 ? argv[5] : "0");
  for (int layout : {kQ4aMma, kQ8sMma}) for (auto& sh : shapes) for (int m : rows) for (int ks : splits)
  for (int rb : blocks) {
    if (!listed(layout_list, layout == kQ8sMma ? "q8s" : "q4a") || !listed(shape_list, sh.name)) continue;
    const int n = sh.n, k = sh.k, group = 128;
    const size_t wbytes = layout == kQ8sMma ? (size_t)n * k : (size_t)n * k / 2;
    const size_t sbytes = (size_t)n * (k / group) * 4;
    const harness::WeightCopies c(wbytes, sbytes);
    PackedGemmPlan plan = packed_gemm_plan(m, n, k, layout, group, sh.folds);
    if (ks > 0 && ks != plan.k_splits) {
      if ((k / 128) % ks != 0) continue;
      plan.k_splits = ks;
    }
    if (rb > 0 && rb != plan.rows) {  // 16, 32 or 64
      plan.rows = rb;
      plan.row_blocks = (m + rb - 1) / rb;
    }
    void *x, *out, *nw, *ss, *xn, *ss_out;
    cudaMalloc(&x, (size_t)m * k * 2); cudaMemset(x, 0, (size_t)m * k * 2);
    cudaMalloc(&out, (size_t)m * n * 2);
    cudaMalloc(&nw, (size_t)k * 2); cudaMemset(nw, 0, (size_t)k * 2);
    cudaMalloc(&ss, (size_t)m * 4); cudaMemset(ss, 0, (size_t)m * 4);
    cudaMalloc(&xn, (size_t)m * k * 2);
    cudaMalloc(&ss_out, (size_t)m * (n / 16) * 4);
    cudaStream_t st; cudaStreamCreate(&st);
    int refused = 0;  // a plan the launch refuses (e.g. an override): no time printed
    const double us = harness::graph_us(st, c.count(), [&](int i, cudaStream_t stream) {
      PackedGemmParams p = {};
      p.x = x; p.stride_x = k; p.w = c.w[i]; p.s = (const float*)c.s[i]; p.mn = (const float*)c.mn[i];
      p.out = out; p.stride_o = sh.folds ? n / 2 : n;
      if (sh.folds) {
        p.glu = true; p.nw = nw; p.ss = (const float*)ss; p.stride_ss = 1; p.p_in = 1; p.eps = 1e-5f; p.xn = xn;
        p.ss_out = (float*)ss_out;
      }
      p.m = m; p.n = n; p.k = k; p.group = group; p.layout = layout;
      refused |= packed_gemm_launch(p, plan, stream) != 0;
    });
    if (refused) printf("refused: ");
    printf("%s %s m=%d rows=%d blocks=%dx%dx%d %.2f us %.0f GB/s err=%s\n", layout == kQ8sMma ? "q8s" : "q4a",
           sh.name, m, plan.rows, plan.row_blocks, plan.col_blocks, plan.k_splits, us,
           (wbytes + sbytes * (layout == kQ4aMma ? 2 : 1)) / us / 1e3, cudaGetErrorString(cudaGetLastError()));
    cudaFree(x); cudaFree(out); cudaFree(nw); cudaFree(ss); cudaFree(xn); cudaFree(ss_out);
    cudaStreamDestroy(st);
  }
  return 0;
}
