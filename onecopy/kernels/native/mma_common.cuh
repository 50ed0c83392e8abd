// Device and launch helpers the packed-weight kernels share (packed_linear.cu: up to 32 rows, one weight tile a
// CTA; packed_gemm.cu: 9 to 64 rows, many tiles a CTA): tensor-core MMA, cp.async copies, programmatic dependent
// launch, bf16 pair arithmetic, and the tile order's int4 / int8 unpacking (packed_linear.cu's header draws it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "packed_linear.h"

namespace onecopy_native {
namespace mma {

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+): a projection's weights do not depend on the kernel before it, so its
// CTAs start (and issue their weight loads) while that kernel finishes, and wait for its results only before
// reading x; each kernel lets the next one start as soon as all its CTAs run. No-ops on older GPUs, and where the
// launch did not allow overlap (then the kernel started after its predecessor anyway).
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// (a & b) | c in one instruction.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// a * b + c on two bf16 lanes (exact here: small integers).
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The weights stream through a ring in shared memory (cp.async: the copy needs no registers while in flight, so a
// warp keeps several chunks on the way while it multiplies an earlier one; a register double buffer kept one
// chunk's worth a warp in flight and read int4 weights at ~1.6 TB/s on the H200). Each thread copies exactly the
// bytes it reads back, so waiting for its own copies is all the synchronization a slot needs.
__device__ __forceinline__ void copy_async16(uint32_t dst, const void* src) {  // dst: a shared-memory address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  copy_async16(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src);
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float lo_f(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

constexpr uint32_t kMagic = 0x43004300u;   // bf16 128 | q: 128 + q for q < 128
constexpr uint32_t kMinusOne = 0xbf80bf80u;

// Fragment register r of MMA step j of a chunk (the tile order: packed_linear.cu's header), as bf16x2 exact integers:
// int4 128 + q; int8 q.
template <int L>
__device__ __forceinline__ void dequant_step(const uint4& w, int j, uint32_t (&a)[4]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  if constexpr (L == kQ8sMma) {
    // byte q: (128 + q's low 7 bits) - (128, or 256 for a negative q) = q, both exact in bf16
    const uint32_t lo = words[2 * j], hi = words[2 * j + 1];
    const uint32_t src[4] = {lo, hi, lo >> 8, hi >> 8};
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[r] = fma2(and_or(src[r], 0x00800080u, kMagic), kMinusOne, and_or(src[r], 0x007f007fu, kMagic));
  } else {
    const uint32_t v = words[j];  // 128 + q (the kernel takes the 128, or 136 for q4z, off per scale period)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = and_or(v >> (4 * r), 0x000f000fu, kMagic);
  }
}

// An attribute of the current device (SM count, compute capability, shared memory limits).
inline int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&value, attribute, device);
  return value;
}

// Launch with programmatic stream serialization allowed (sm_90+: see allow_dependents), else plainly; `args` as
// cudaLaunchKernel takes them (the address of each parameter); `cluster_z` > 1: clusters of that many CTAs along z
// (sm_90+; refused before, where the CTAs would run apart).
inline cudaError_t launch_overlapped(const void* kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                                     void** args, unsigned cluster_z = 1) {
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor);
  if (cluster_z > 1 && major < 9) return cudaErrorNotSupported;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = 1;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = cluster_z;
  cfg.attrs = attr;
  cfg.numAttrs = major < 9 ? 0 : cluster_z > 1 ? 2 : 1;
  return cudaLaunchKernelExC(&cfg, kernel, args);
}

// The same for a kernel taking one parameter block.
template <typename Params>
cudaError_t launch_overlapped(void (*kernel)(Params), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                              const Params& p) {
  void* args[] = {const_cast<Params*>(&p)};
  return launch_overlapped(reinterpret_cast<const void*>(kernel), grid, threads, smem, stream, args);
}

// Whether a kernel with this much dynamic shared memory fits a block on this device (the opt-in limit: 227 KB on
// Hopper, 163 KB on the A100, 99 KB on sm_86 / sm_89 / sm_120), its static shared memory counted.
inline bool smem_fits(const void* kernel, size_t smem) {
  const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, kernel);
  return attr.sharedSizeBytes + smem <= static_cast<size_t>(optin);
}

// Static and dynamic shared memory past 48 KB need the opt-in (its default is 48 KB less the static part). The
// limit is a property of the function, shared by every launch of it: only ever raised, so that a smaller launch
// never lowers it under a larger one.
inline void allow_smem(const void* kernel, size_t smem) {
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, kernel);
  if (smem > static_cast<size_t>(attr.maxDynamicSharedSizeBytes))
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}


// How many clusters of `splits` CTAs (of `threads` threads, clustered along z) of this kernel the device holds at
// once (0 where the query fails): a K split over a cluster is taken only where all its clusters are resident (a
// cluster's CTAs share a GPC, so with one CTA an SM fewer clusters fit than SMs / splits).
inline int resident_clusters(const void* kernel, size_t smem, int splits, int threads) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1, 1, splits);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = splits;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return 0;
  }
  return n;
}

}  // namespace mma
}  // namespace onecopy_native
