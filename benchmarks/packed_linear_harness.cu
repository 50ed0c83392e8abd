// Timing harness for the native packed projection (kernels/native/packed_linear.cu) without torch: build-time
// variants (-DONECOPY_RING_KB=..., benchmarks/packed_linear_variants.sh), random bytes, q4a / q4z / q8s g128 and f8r
// (e4m3, a scale per feature), a CUDA graph of calls over 600 MB of weight copies (cold weights, the gaps a decode
// step has), per call microseconds.
// Usage: packed_linear_harness [rows, default 1,16] [layouts, default q4a,q8s] [shapes, default all] [folds]
// Built with -DONECOPY_HARNESS_FP8_OLD against the packed_linear.cu of 8d40b74 (and its header), `f8r` times that
// tree's FP8 kernel instead (fp8_linear_launch: e4m3 rows, no folds, a gate/up weight as one of 28672 outputs).
// `folds`: the model's folds on each call (the norm before qkv and gate_up: its weight and the rows' partial sums
// of squares; the residual after o and down), as a decode step runs them. With $ONECOPY_HARNESS_DUMP set to a
// folder, each case first runs once on random weights, scales, mins and rows and writes its outputs there
// (out and ss_out, raw): two builds' folders compared with `cmp` tell whether a change kept every bit.
// Build and run (CUDA machine, repository root): bash benchmarks/packed_linear_rings.sh
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "harness.h"
#include "packed_linear.h"
using namespace onecopy_native;
using harness::listed;
#ifdef ONECOPY_HARNESS_FP8_OLD
constexpr int kF8rId = 4;
#else
constexpr int kF8rId = kF8r;
#endif

namespace {

// Deterministic pseudo-random bytes and values (the same in every build).
struct Lcg {
  uint64_t v;
  uint32_t next() { v = v * 6364136223846793005ull + 1442695040888963407ull; return static_cast<uint32_t>(v >> 33); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * (next() & 0xffffff) / float(0x1000000); }
};

uint16_t bf16(float f) {  // round to nearest even
  uint32_t u; std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

void* device_bf16(size_t count, Lcg& rng, float lo, float hi) {
  std::vector<uint16_t> h(count);
  for (auto& v : h) v = bf16(rng.uniform(lo, hi));
  void* d; cudaMalloc(&d, count * 2); cudaMemcpy(d, h.data(), count * 2, cudaMemcpyHostToDevice);
  return d;
}

void* device_f32(size_t count, Lcg& rng, float lo, float hi) {
  std::vector<float> h(count);
  for (auto& v : h) v = rng.uniform(lo, hi);
  void* d; cudaMalloc(&d, count * 4); cudaMemcpy(d, h.data(), count * 4, cudaMemcpyHostToDevice);
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  struct Shape { const char* name; int n, k; bool glu, norm; } shapes[] = {
      {"o", 4096, 4096, false, false}, {"qkv", 6144, 4096, false, true}, {"down", 4096, 14336, false, false},
      {"gate_up", 28672, 4096, true, true}, {"lm", 128256, 4096, false, true}};
  const std::vector<int> rows = harness::ints(argc > 1 ? argv[1] : "1,16");
  const char* layout_list = argc > 2 ? argv[2] : "q4a,q8s";
  const char* shape_list = argc > 3 ? argv[3] : "o,qkv,down,gate_up,lm";
  const bool folds = argc > 4 && std::string(argv[4]) == "folds";
  const char* dump = std::getenv("ONECOPY_HARNESS_DUMP");
  struct Layout { int id; const char* name; } layouts[] = {
      {kQ4aMma, "q4a"}, {kQ4zMma, "q4z"}, {kQ8sMma, "q8s"}, {kF8rId, "f8r"}};
  for (const Layout& lay : layouts) for (auto& sh : shapes) for (int m : rows) {
    if (!listed(layout_list, lay.name) || !listed(shape_list, sh.name)) continue;
    const int layout = lay.id;
    const bool f8r = layout == kF8rId;
    const int n = sh.n, k = sh.k, group = f8r ? k : 128;
    const size_t wbytes = layout == kQ8sMma || f8r ? (size_t)n * k : (size_t)n * k / 2;
    const size_t sbytes = (size_t)n * (k / group) * 4;
    const harness::WeightCopies c(wbytes, sbytes);
    const int n_out = sh.glu ? n / 2 : n;
    const int p_in = k / 16;
    Lcg rng{0x5eed0000ull + static_cast<uint64_t>(m) * 131 + n + k};
    void* x = device_bf16((size_t)m * k, rng, -1.f, 1.f);
    void* nw = folds && sh.norm ? device_bf16(k, rng, 0.5f, 1.5f) : nullptr;
    void* ss = folds && sh.norm ? device_f32((size_t)m * p_in, rng, 0.f, 2.f) : nullptr;
    void* res = folds && !sh.norm ? device_bf16((size_t)m * n_out, rng, -2.f, 2.f) : nullptr;
    void *out, *ssout;
    cudaMalloc(&out, (size_t)m * n * 2);  // (n: the old FP8 kernel writes a gate/up weight's 2 n_out outputs)
    cudaMalloc(&ssout, (size_t)m * (n_out / 16) * 4);
    auto params = [&](int i) {
      PackedLinearParams p = {};
      p.x = x; p.stride_x = k; p.w = c.w[i]; p.s = (const float*)c.s[i];
      p.mn = layout == kQ4aMma ? (const float*)c.mn[i] : nullptr;
      p.nw = nw; p.ss = (const float*)ss; p.stride_ss = p_in; p.p_in = p_in; p.res = res; p.stride_r = n_out;
      p.out = out; p.stride_o = n_out; p.ss_out = (float*)ssout; p.m = m; p.n_out = n_out; p.k = k;
      p.group = group; p.layout = layout; p.glu = sh.glu; p.eps = 1e-5f;
      return p;
    };
    auto launch = [&](const PackedLinearParams& q, cudaStream_t stream) {
#ifdef ONECOPY_HARNESS_FP8_OLD
      if (f8r) {
        Fp8LinearParams f{};
        f.x = q.x; f.stride_x = q.stride_x; f.w = q.w; f.ws = q.s; f.out = q.out; f.stride_o = n;
        f.m = q.m; f.n = n; f.k = k; f.bf16 = true;
        return fp8_linear_launch(f, stream);
      }
#endif
      return packed_linear_launch(q, stream);
    };
    if (dump != nullptr) {  // copy 0 random (its bytes, scales, mins), one call, the outputs written out
      std::vector<uint8_t> hw(wbytes);
      for (auto& b : hw) b = static_cast<uint8_t>(rng.next());
      if (f8r) for (auto& b : hw) if ((b & 0x7f) == 0x7f) b = 0;  // no e4m3 NaNs
      cudaMemcpy(c.w[0], hw.data(), wbytes, cudaMemcpyHostToDevice);
      void* s0 = device_f32(sbytes / 4, rng, 0.001f, 0.02f);
      void* m0 = device_f32(sbytes / 4, rng, -0.1f, 0.1f);
      cudaMemcpy(c.s[0], s0, sbytes, cudaMemcpyDeviceToDevice);
      cudaMemcpy(c.mn[0], m0, sbytes, cudaMemcpyDeviceToDevice);
      cudaFree(s0); cudaFree(m0);
      cudaStream_t st; cudaStreamCreate(&st);
      const int rc = launch(params(0), st);
      cudaStreamSynchronize(st); cudaStreamDestroy(st);
      std::vector<uint8_t> h((size_t)m * n_out * 2 + (size_t)m * (n_out / 16) * 4);
      cudaMemcpy(h.data(), out, (size_t)m * n_out * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(h.data() + (size_t)m * n_out * 2, ssout, (size_t)m * (n_out / 16) * 4, cudaMemcpyDeviceToHost);
      const std::string path = std::string(dump) + "/" + lay.name + "_" + sh.name + "_m" + std::to_string(m) +
                               (folds ? "_folds" : "") + ".bin";
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f) { std::fwrite(h.data(), 1, h.size(), f); std::fclose(f); }
      printf("dump %s rc=%d err=%s\n", path.c_str(), rc, cudaGetErrorString(cudaGetLastError()));
    }
    cudaStream_t st; cudaStreamCreate(&st);
    const double us = harness::graph_us(st, c.count(), [&](int i, cudaStream_t stream) {
      launch(params(i), stream);
    });
    printf("%s %s m=%d%s %.2f us %.0f GB/s err=%s\n", lay.name, sh.name, m, folds ? " folds" : "", us,
           (wbytes + sbytes * (layout == kQ4aMma ? 2 : 1)) / us / 1e3, cudaGetErrorString(cudaGetLastError()));
    cudaFree(x); cudaFree(out); cudaFree(ssout); cudaFree(nw); cudaFree(ss); cudaFree(res); cudaStreamDestroy(st);
  }
  return 0;
}
