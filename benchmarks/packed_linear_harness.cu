// Timing harness for the native packed projection (kernels/native/packed_linear.cu) without torch: build-time
// variants (-DONECOPY_RING_KB=..., benchmarks/packed_linear_variants.sh), random bytes, q4a g128 and q8s g128, a CUDA
// graph of calls over 600 MB of weight copies (cold weights, the gaps a decode step has), per call microseconds.
// Usage: packed_linear_harness [rows, default 1,16] [layouts, default q4a,q8s] [shapes, default all]
// Build and run (CUDA machine, repository root): bash benchmarks/packed_linear_rings.sh
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include "harness.h"
#include "packed_linear.h"
using namespace onecopy_native;
using harness::listed;

int main(int argc, char** argv) {
  struct Shape { const char* name; int n, k; bool glu; } shapes[] = {
      {"o", 4096, 4096, false}, {"qkv", 6144, 4096, false}, {"down", 4096, 14336, false},
      {"gate_up", 28672, 4096, true}, {"lm", 128256, 4096, false}};
  const std::vector<int> rows = harness::ints(argc > 1 ? argv[1] : "1,16");
  const char* layout_list = argc > 2 ? argv[2] : "q4a,q8s";
  const char* shape_list = argc > 3 ? argv[3] : "o,qkv,down,gate_up,lm";
  int layouts[] = {kQ4aMma, kQ8sMma};
  for (int layout : layouts) for (auto& sh : shapes) for (int m : rows) {
    if (!listed(layout_list, layout == kQ8sMma ? "q8s" : "q4a") || !listed(shape_list, sh.name)) continue;
    const int n = sh.n, k = sh.k, group = 128;
    const size_t wbytes = layout == kQ8sMma ? (size_t)n * k : (size_t)n * k / 2;
    const size_t sbytes = (size_t)n * (k / group) * 4;
    const harness::WeightCopies c(wbytes, sbytes);
    const int n_out = sh.glu ? n / 2 : n;
    void *x, *out, *ssout;
    cudaMalloc(&x, (size_t)m * k * 2); cudaMemset(x, 0, (size_t)m * k * 2);
    cudaMalloc(&out, (size_t)m * n_out * 2);
    cudaMalloc(&ssout, (size_t)m * (n_out / 16) * 4);
    cudaStream_t st; cudaStreamCreate(&st);
    const double us = harness::graph_us(st, c.count(), [&](int i, cudaStream_t stream) {
      PackedLinearParams p = {};
      p.x = x; p.stride_x = k; p.w = c.w[i]; p.s = (const float*)c.s[i]; p.mn = (const float*)c.mn[i];
      p.out = out; p.stride_o = n_out; p.ss_out = (float*)ssout; p.m = m; p.n_out = n_out; p.k = k;
      p.group = group; p.layout = layout; p.glu = sh.glu; p.eps = 1e-5f;
      packed_linear_launch(p, stream);
    });
    printf("%s %s m=%d %.2f us %.0f GB/s err=%s\n", layout == kQ8sMma ? "q8s" : "q4a", sh.name, m, us,
           (wbytes + sbytes * (layout == kQ4aMma ? 2 : 1)) / us / 1e3, cudaGetErrorString(cudaGetLastError()));
    cudaFree(x); cudaFree(out); cudaFree(ssout); cudaStreamDestroy(st);
  }
  return 0;
}
