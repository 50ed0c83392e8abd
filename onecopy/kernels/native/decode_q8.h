// The launch interface of decode_q8.cu (no torch headers, so that nvcc compiles it alone and quickly).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace onecopy_native {

// Strides are in elements of their tensor (bytes for the 8-bit pools). `q`: with `new_kv`, the decode step's
// qkv rows [B, (HQ + 2 HKV) D] (stride_qh = D), else q [B, HQ, D]. Pools [NB, HKV, BS, D] and scales [NB, HKV, BS],
// contiguous (checked by ops.cpp): a page is page_bytes / page_scales apart, its positions D bytes / 1 apart,
// table [P, NBMAX] (unit column stride), po [B, HQ, NSE, D] and pml [B, HQ, NSE, 2] (contiguous; unused with
// nse == 1, when the kernel writes `out` [B, HQ, D] itself).
struct DecodeQ8Params {
  const void* q;
  int64_t stride_qb, stride_qh;
  void* k;
  void* v;
  int64_t stride_kh, stride_vh;
  float* ks;
  float* vs;
  int64_t stride_sh;
  const int64_t* table;
  int64_t stride_t;
  const int64_t* rows;
  const int64_t* lens;
  const void* cos;
  const void* sin;
  int64_t stride_cb;
  float* po;
  float* pml;
  void* out;
  int b, hq, hkv, g, d;
  uint32_t page_bytes;   // the pools' page stride (K and V alike), < 2^32
  uint32_t page_scales;  // the scale pools' page stride, < 2^32
  int bs_shift;  // log2 of the page size (a power of two >= 16)
  int nse;       // splits launched per (row, KV head)
  int block;     // a split's positions are a multiple of this (kernels.tiles.native_decode_splits)
  float scale;   // softmax scale
  bool fp8, new_kv, bf16;
};

bool decode_q8_supported(int head_dim, int group);
// 0, or the CUDA error of the launch (1: unsupported head size).
int decode_q8_launch(const DecodeQ8Params& p, cudaStream_t stream);

}  // namespace onecopy_native
