// The launch interface of packed_gemm.cu (no torch headers, so that nvcc compiles it alone and quickly).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace onecopy_native {

// y = x @ W^T for many rows (a wide decode step), W a tile-ordered packed weight (the layouts of packed_linear.h,
// models/mma_order.py's order), with packed_linear.h's folds: an RMSNorm of x before (`nw`, the partial sums of
// squares `ss` [M, p_in], eps; the normed rows go to `xn` [M, K], the caller's buffer), SwiGLU of a fused gate/up
// weight after (`glu`: W has 2 N' rows, the up rows after the gate rows), a residual add (`res` [M, N']), each
// row's sum of squares per 16 outputs (`ss_out` [M, N' / 16], optional). x, nw, xn, res, out: bfloat16 (out
// [M, N'], N' = N or N / 2 with glu); strides in elements.
struct PackedGemmParams {
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
  void* xn;
  const void* res;
  int64_t stride_r;
  void* out;
  int64_t stride_o;
  float* ss_out;
  int m, n, k, group, layout;
  bool glu;
};

// How a launch covers [M, N']: blocks of `rows` rows (16, 32 or 64) by 256 outputs (128 with glu), each block's K
// split over a cluster of `k_splits` CTAs (the plan: 1, 2 or 4, a weight of few blocks on Hopper, so that more SMs
// read it; a launch takes up to 8, each a whole number of 128-value stages; the partial sums are added through
// distributed shared memory in a fixed order). `rows` is 0 where the GEMM does not take the weight
// (K a multiple of 128, the layouts and groups of packed_linear_supported) or its shared memory does not fit.
struct PackedGemmPlan {
  int rows;
  int row_blocks, col_blocks;
  int k_splits;
};

// The plan for these rows and this weight on the current device (rows 0: unsupported, use another path).
PackedGemmPlan packed_gemm_plan(int m, int n, int k, int layout, int group, bool glu);
// 0, or the CUDA error of the launch (-1: a plan of no rows).
int packed_gemm_launch(const PackedGemmParams& p, const PackedGemmPlan& plan, cudaStream_t stream);

// Past the GEMM's rows the op unpacks the weight for cuBLAS; these two kernels are its folds around that GEMM.
// The RMSNorm of x's rows into `xn` alone (the first kernel of packed_gemm_launch where `nw` is set): reads x,
// stride_x, nw, ss, stride_ss, p_in, eps, m, k. 0, or the CUDA error of the launch.
int norm_rows_launch(const PackedGemmParams& p, cudaStream_t stream);

// The folds after the linear: `acc` [M, N] (bfloat16, the linear's rounded output) -> `out` [M, N'] with SwiGLU
// (`glu`: N' = N / 2, the up columns after the gate columns) and the residual add `res` [M, N'] (optional), and each
// row's sum of squares per 16 outputs into `ss_out` [M, N' / 16]; each step rounded to bfloat16 as the eager ops
// round. `out` nullptr: neither glu nor res, only the sums of `acc` itself. acc, res, out: rows 16-byte aligned
// (strides in elements, multiples of 8); N' a multiple of 16.
struct FoldRowsParams {
  const void* acc;
  int64_t stride_acc;
  const void* res;
  int64_t stride_r;
  void* out;
  int64_t stride_o;
  float* ss_out;
  int m, n_out;
  bool glu;
};
int fold_rows_launch(const FoldRowsParams& p, cudaStream_t stream);

// packed_wgmma.cu (sm_90a, the H100 / H200): y = x @ W^T for any rows on the warpgroup MMA, the weight dequantized in
// registers (no bf16 copy of it); PackedGemmParams' x, w, s, mn, out and sizes, no folds (nw, res, glu, ss_out unset).
// Supported: compute capability 9.0, N a multiple of 128, K of 128, packed_linear_supported's layouts and groups.
bool packed_wgmma_supported(int m, int n, int k, int layout, int group);
// block_rows: x rows a CTA (64, 128 or 256; 0: the launch picks)
int packed_wgmma_launch(const PackedGemmParams& p, cudaStream_t stream, int block_rows = 0);  // 0, -1 or a CUDA error

}  // namespace onecopy_native
