// The launch interface of packed_linear.cu (no torch headers, so that nvcc compiles it alone and quickly).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace onecopy_native {

// Weight layouts the kernels read, as layouts.NATIVE_LAYOUT_IDS numbers them: the tile-ordered ("_mma")
// forms of layouts.LAYOUTS' q4z, q4a, q8s (models/mma_order.py writes them), and f8r as stored (row-major e4m3
// [N, K], one float32 scale per output feature: group K).
enum PackedLayout : int { kQ4zMma = 1, kQ4aMma = 2, kQ8sMma = 3, kF8r = 4 };

// y = x @ W^T for a decode step's rows, W a tile-ordered packed weight, with the folds of kernels/linear.py:
// an RMSNorm of x before (its weight `nw`, and the partial sums of squares `ss` [M, p_in] of x's rows),
// SwiGLU of a fused gate/up weight after (`glu`: W has 2 n_out rows, the up rows after the gate rows), or a
// residual add (`res` [M, n_out]). Writes out [M, n_out] and, unless null, ss_out [M, n_out / 16] (each row's sum
// of squares over each 16 outputs, for the next norm). x, nw, res, out: bfloat16; strides in elements. An f8r
// weight (layout kF8r, group K, `s` its scales [N], `mn` null) takes bf16 rows, as the others: no quantization.
struct PackedLinearParams {
  const void* x;
  int64_t stride_x;
  const void* w;
  const float* s;
  const float* mn;
  const void* nw;
  const float* ss;
  int64_t stride_ss;
  int p_in;
  float eps;
  const void* res;
  int64_t stride_r;
  void* out;
  int64_t stride_o;
  float* ss_out;
  int m, n_out, k, group, layout;
  bool glu;
  bool invariant;  // the batch-invariant decode: every launch choice that sets a row's bits independent of M
};

// Each row of x [M, K] (bf16, or fp16 with `bf16` false; 16-byte aligned rows, K a multiple of 8) quantized to
// e4m3 `q` [M, K] (contiguous) with its float32 scale `scales` [M], as models/packed.py's quantize_rows does.
// With `glu`, x [M, 2K] is a gate/up GEMM's output and the rows quantized are its SwiGLU, silu(x[:, :K]) *
// x[:, K:] (the silu and the product each rounded to x's dtype, as the eager ops and the packed kernels' folds
// round them); with `q` null those rows are written to `out` [M, K] in x's dtype instead (the FP8 kernel's
// input, which it quantizes as it reads).
struct QuantizeRowsParams {
  const void* x;
  int64_t stride_x;
  void* q;
  float* scales;
  int m, k;
  bool bf16;
  bool glu;
  void* out;
  int64_t stride_o;
};

// A tile-ordered packed weight [N, K] dequantized to `out` (row-major, bf16 or fp16): s * q (+ m) in fp32,
// one rounding, as models/packed.py's dequantize.
struct UnpackParams {
  const void* w;
  const float* s;
  const float* mn;
  void* out;
  int n, k, group, layout;
  bool bf16;
};

// Rows the packed-projection op runs this GEMV for at most (more: the packed GEMM of packed_gemm.cu where it serves
// the weight, else the weight unpacked for cuBLAS; ops.cpp, which also takes the GEMM past 8 rows where it serves),
// except in the batch-invariant decode, which runs it at every size. H200, 8B projections
// (benchmarks/results/native_linear_h200.json): ahead up to 16 rows, 1.3-2x behind bf16 cuBLAS at 64.
constexpr int kKernelMaxRows = 32;
// Rows the GEMV takes for an f8r weight of N outputs (`fp8_gemv_rows`; past them the norm kernel, the rows quantized
// to e4m3, cuBLAS's FP8 GEMM and the fold kernel: ops.cpp's packed_linear_by_gemm and fp8_matmul): up to
// kFp8MaxRows (9-16 rows: two n-tiles a CTA) for N <= kFp8NarrowN, 8 (one n-tile) for wider weights. H100, the
// decode step's folds, 9-16 rows, GEMV / GEMM path (benchmarks/fp8_rows_cuda.py, results/fp8_rows_max*_h100.json):
// qkv 16.8-19.0 / 23.4-24.1 us, o 11.9-13.1 / 18.0-18.8, down 44.4-45.9 / 50.3-52.7; but the fused gate/up weight
// (N 28672) 60.2-63.4 / 56.7-61.1 and the LM head (128256) 226.8-237.2 / 211.8-218.9.
#ifndef ONECOPY_FP8_MAX_ROWS
#define ONECOPY_FP8_MAX_ROWS 16
#endif
constexpr int kFp8MaxRows = ONECOPY_FP8_MAX_ROWS;
constexpr int kFp8WideMaxRows = 8;
constexpr int kFp8NarrowN = 8192;
inline int fp8_gemv_rows(int64_t n) { return n <= kFp8NarrowN ? kFp8MaxRows : kFp8WideMaxRows; }
// Widest SwiGLU rows the fused quantization takes (their K products in shared memory: 2 bytes each, 96 KiB).
constexpr int kGluMaxK = 48 * 1024;

// Whether the kernels take this weight: layout, group, shape (N a multiple of 16, K of the layout's chunk).
bool packed_linear_supported(int layout, int group, int n, int k);
// 0, or the CUDA error of the launch (-1: an unsupported shape or layout).
int packed_linear_launch(const PackedLinearParams& p, cudaStream_t stream);
int unpack_launch(const UnpackParams& p, cudaStream_t stream);
int quantize_rows_launch(const QuantizeRowsParams& p, cudaStream_t stream);

}  // namespace onecopy_native
