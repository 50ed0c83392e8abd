// Device and launch helpers the packed-weight kernels share (packed_linear.cu: up to 32 rows, one weight tile a
// CTA; packed_gemm.cu: 9 to 64 rows, many tiles a CTA): tensor-core MMA, cp.async copies, programmatic dependent
// launch, bf16 pair arithmetic, and the tile order's int4 / int8 unpacking (packed_linear.cu's header draws it).
#pragma once

#include <cooperative_groups.h>
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


constexpr uint32_t kOne2 = 0x3f803f80u;       // bf16 1, 1
constexpr uint32_t kNegZero2 = 0x80008000u;   // bf16 -0, -0: s q + (-0) = s q, signed zeros kept
constexpr uint32_t kMinus128 = 0xc300c300u;   // bf16 -128
constexpr uint32_t kMinus136 = 0xc308c308u;   // bf16 -136

// Fragment register r of MMA step j of a chunk as bf16 s q (+ m), the packed GEMMs' arithmetic (Marlin's: s and m
// rounded to bf16, s q + m in one bf16x2 FMA from the exact integer q): s, m for the tile's rows g (even r) and g + 8.
template <int L>
__device__ __forceinline__ void dequant_scaled(const uint4& w, int j, const uint32_t (&s)[2], const uint32_t (&m)[2],
                                               uint32_t (&a)[4]) {
  dequant_step<L>(w, j, a);  // int4: the exact bf16 128 + q; int8: q
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    uint32_t q = a[r];
    if constexpr (L == kQ4aMma) q = fma2(q, kOne2, kMinus128);       // q in 0..15
    else if constexpr (L == kQ4zMma) q = fma2(q, kOne2, kMinus136);  // q - 8
    a[r] = fma2(q, s[r & 1], L == kQ4aMma ? m[r & 1] : kNegZero2);
  }
}

// The first kStages - 1 stages of a cp.async ring (the packed GEMMs): the weights' copies (load_weights(slot, stage))
// before the kernels this one follows have finished (programmatic dependent launch: they do not depend on them), x's
// (load_x) after; group 0 then holds those weights and x's first stage, group s x's stage s, so that waiting for group
// s is waiting for all of stage s. n_st: this CTA's stages, st0 its first.
template <int kStages, typename LoadWeights, typename LoadX>
__device__ __forceinline__ void fill_ring(int n_st, int st0, const LoadWeights& load_weights, const LoadX& load_x) {
  allow_dependents();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < n_st) load_weights(s, st0 + s);
  wait_for_inputs();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_st) load_x(s, st0 + s);
    copies_commit();
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// K split over a cluster of gridDim.z CTAs (Hopper): each warp's fp32 sums `acc` go to its CTA's shared memory
// `smem` ([warp][acc's float4s][lane]; every warp must be done with it), and rank w % splits adds warp w's up over the
// cluster through distributed shared memory, in rank order (the same bits every call). Returns whether this warp now
// holds the total; the others are done (no CTA leaves while another still reads its shared memory).
template <int N>
__device__ __forceinline__ bool cluster_sum(float (&acc)[N], void* smem, int warp, int lane) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const unsigned splits = gridDim.z;
  __syncthreads();
  float4* part = reinterpret_cast<float4*>(smem) + warp * (N / 4) * 32 + lane;
#pragma unroll
  for (int i = 0; i < N / 4; ++i) part[i * 32] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  cluster.sync();
  const bool mine = warp % splits == cluster.block_rank();
  if (mine)
    for (unsigned q = 0; q < splits; ++q) {
      const float4* from = cluster.map_shared_rank(part, q);
#pragma unroll
      for (int i = 0; i < N / 4; ++i) {
        const float4 v = from[i * 32];
        const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * i + e] = q == 0 ? vs[e] : acc[4 * i + e] + vs[e];
      }
    }
  cluster.sync();
  return mine;
}
#endif

// Hopper's warpgroup MMA (wgmma: packed_wgmma.cu; benchmarks/wgmma_probe.cu), for sm_90a alone: built for another
// target each traps (the callers refuse other devices before launching). ONECOPY_WGMMA: compiled for sm_90a here.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ONECOPY_WGMMA 1
#endif

__device__ __forceinline__ void wgmma_fence() {
#ifdef ONECOPY_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef ONECOPY_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_wait0() {
#ifdef ONECOPY_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_wait1() {
#ifdef ONECOPY_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#else
  __trap();
#endif
}
// Shared memory written by ordinary stores or cp.async, made visible to the async proxy (wgmma's reads of B).
__device__ __forceinline__ void proxy_fence() {
#ifdef ONECOPY_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();
#endif
}
// The accumulators pinned in place around the asynchronous MMAs (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A step's A registers, written before the fence that precedes its MMA.
template <int N>
__device__ __forceinline__ void pin(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// D[64 x N] += A[64 x 16] * B[16 x N], N = 64, 128 or 256: A from registers (this warp's 16 rows of the warpgroup's 64, in
// mma.sync m16n8k16's A layout), B from shared memory through its descriptor (K-major), fp32 accumulators.
__device__ __forceinline__ void wgmma_step(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#ifdef ONECOPY_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_step(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
#ifdef ONECOPY_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_step(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
#ifdef ONECOPY_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
#else
  __trap();
#endif
}

// A kernel instance for a runtime layout (q4z, q4a, else q8s) and group (32, 64, else 128): the packed GEMMs' kernels
// are templates on both; `pick.template get<L, GROUP>()` names the instance (and its shared memory).
template <int L, typename Pick>
const void* for_group(int group, const Pick& pick) {
  if (group == 32) return pick.template get<L, 32>();
  if (group == 64) return pick.template get<L, 64>();
  return pick.template get<L, 128>();
}
template <typename Pick>
const void* for_layout_and_group(int layout, int group, const Pick& pick) {
  switch (layout) {
    case kQ4zMma: return for_group<kQ4zMma>(group, pick);
    case kQ4aMma: return for_group<kQ4aMma>(group, pick);
    default: return for_group<kQ8sMma>(group, pick);
  }
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

// How many CTAs of a cluster share each block's K (1, 2 or 4) for `blocks` blocks of this kernel over `stages`
// stages of K: on Hopper, where the blocks fill under half the SMs, the most (4, else 2) that divide the stages and
// whose clusters are all resident at once (packed_gemm_plan's measurements: at 64 rows 4 splits, not 8).
inline int cluster_splits(const void* kernel, size_t smem, int threads, int blocks, int stages) {
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) < 9 || 2 * blocks >= device_attribute(cudaDevAttrMultiProcessorCount))
    return 1;
  allow_smem(kernel, smem);  // the occupancy query counts the opt-in shared memory
  for (int s : {4, 2})
    if (stages % s == 0 && blocks <= resident_clusters(kernel, smem, s, threads)) return s;
  return 1;
}

}  // namespace mma
}  // namespace onecopy_native
