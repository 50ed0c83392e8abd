// What the torch-free kernel harnesses (packed_linear_harness.cu, packed_gemm_harness.cu) share: their arguments,
// cold weight copies, and the timing of a CUDA graph of calls over those copies.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace harness {

// Whether `item` is in the comma-separated `list`.
inline bool listed(const char* list, const std::string& item) {
  const std::string l = std::string(",") + list + ",";
  return l.find("," + item + ",") != std::string::npos;
}

// A comma-separated list of integers.
inline std::vector<int> ints(const char* list) {
  std::vector<int> out;
  for (const char* r = list; *r;) {
    out.push_back(std::atoi(r));
    while (*r && *r != ',') ++r;
    if (*r) ++r;
  }
  return out;
}

// Copies of a packed weight (random-ish bytes, zero scales and mins) enough for 600 MB: each call of a replayed
// graph reads its own, cold in L2, as a decode step's layers do.
struct WeightCopies {
  std::vector<void*> w, s, mn;
  WeightCopies(size_t wbytes, size_t sbytes) {
    const int n = static_cast<int>((600e6 / (wbytes + 2 * sbytes)) + 2);
    w.resize(n); s.resize(n); mn.resize(n);
    for (int i = 0; i < n; ++i) {
      cudaMalloc(&w[i], wbytes); cudaMemset(w[i], 0x37, wbytes);
      cudaMalloc(&s[i], sbytes); cudaMemset(s[i], 0, sbytes);
      cudaMalloc(&mn[i], sbytes); cudaMemset(mn[i], 0, sbytes);
    }
  }
  ~WeightCopies() {
    for (size_t i = 0; i < w.size(); ++i) { cudaFree(w[i]); cudaFree(s[i]); cudaFree(mn[i]); }
  }
  int count() const { return static_cast<int>(w.size()); }
};

// Microseconds a call of `launch(i, stream)` (i: the copy) takes inside a CUDA graph of one call per copy, replayed
// 20 times (the calls run once eagerly first: function attributes, occupancy).
template <typename Launch>
double graph_us(cudaStream_t st, int copies, Launch launch) {
  for (int i = 0; i < copies; ++i) launch(i, st);
  cudaStreamSynchronize(st);
  cudaGraph_t graph; cudaGraphExec_t exec;
  cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < copies; ++i) launch(i, st);
  cudaStreamEndCapture(st, &graph);
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphLaunch(exec, st); cudaStreamSynchronize(st);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int reps = 20;
  cudaEventRecord(a, st);
  for (int r = 0; r < reps; ++r) cudaGraphLaunch(exec, st);
  cudaEventRecord(b, st); cudaEventSynchronize(b);
  float ms = 0; cudaEventElapsedTime(&ms, a, b);
  cudaGraphExecDestroy(exec); cudaGraphDestroy(graph);
  cudaEventDestroy(a); cudaEventDestroy(b);
  return 1000.0 * ms / reps / copies;
}

}  // namespace harness
