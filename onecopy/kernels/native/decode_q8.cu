// Decode attention over an 8-bit paged KV cache (int8 or fp8 e4m3, a float32 scale per position and head),
// written for the tensor cores' register fragments instead of through Triton's layouts.
//
// Why CUDA: the Triton split kernel spends ~54 warp instructions per cached position (8-bit -> bf16
// conversions, shared-memory round trips of the 8-bit tiles, per-position address arithmetic), about what
// the SM can issue while HBM delivers that position's 264 bytes, so it read at ~0.5 of copy bandwidth. Here
// each warp loads K and V with 16-byte loads straight into the registers the MMA reads, converts them with
// two integer instructions per pair (or one hardware cvt for fp8), and runs no barrier in its loop.
//
// One CTA per (row, KV head, split) (the splits: kernels/tiles.py, native_decode_splits; several are merged as
// kernels/decode.py merges them); inside it the warps take 32-position steps in turn, each with its own online
// softmax, combined at the end.
// Per 16 positions (one page of BS >= 16, or part of one):
//   S^T[16 pos x 8 heads] = K[16 x D] q^T      mma.m16n8k16, A = K (rows g, g+8 of the page), B = q^T
//   P^T via movmatrix.trans (S^T's accumulator layout is P's transpose of the B layout the next MMA needs)
//   O^T[D x 8 heads]     += V^T[D x 16] P^T     A = V^T, from 16 bytes of 4 positions per thread
// The reduction index of each product is permuted so that a thread's fragment is contiguous bytes in memory:
// in S^T a thread's k-step j covers d = 64 (j / 4) + 16 t + 4 (j % 4) + {0..3}; in O^T row g of m-tile i is
// d = (D / 8) g + 2 i (row g + 8: that + 1). q is permuted the same way, and the output un-permuted at the end.
// Numerics: q scaled into fp16 by its head's max |q| (undone on the scores), 8-bit values converted exactly
// to fp16, P' = p * v_scale / (the step's max v_scale) in fp16 (undone on the accumulator), fp32 accumulation,
// exp2 with the scores in log2 units. The new position (with RoPE, `new_kv`) is quantized exactly as
// models/kv_quant.py does, cached, and attended last from registers, as the Triton kernel does.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_q8.h"

namespace onecopy_native {

namespace {

// Warps per CTA: with 248 registers a thread, 4 CTAs of 2 warps share an SM; one CTA's start and end then
// idle a quarter of it, not half as with 2 CTAs of 4 (H100, 256 sessions x 1k: 0.83 vs 0.77 of copy bandwidth,
// benchmarks/results/native_decode_sweep_h100.json).
constexpr int kWarps = 2;
constexpr int kStep = 32;  // positions per warp step (two 16-position halves)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
// x rounded to T and back: what a value stored in the model's dtype holds.
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f<T>(from_f<T>(x)); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: what Triton's exp uses too
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// Two 8-bit values (bytes 0 and 1, or 2 and 3 with hi) of w -> fp16x2, exactly. int8: w was xor-ed with
// 0x80808080 (x + 128 as unsigned); [byte, 0x64] is the fp16 1024 + byte, minus 1152 gives x.
template <bool FP8, bool HI>
__device__ __forceinline__ uint32_t cvt2(uint32_t w) {
  if constexpr (FP8) {
    uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    // no e4m3 conversion before sm_89 (ptxas refuses the cvt, so the library would not build for an A100): the
    // host never launches fp8 there (native.supported)
    r = w;
    __trap();
#else
    if constexpr (HI) {
      asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(w));
    } else {
      asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(w));
    }
#endif
    return r;
  } else {
    uint32_t h = prmt(w, 0x64646464u, HI ? 0x4342u : 0x4140u);
    __half2 v = __hsub2(*reinterpret_cast<__half2*>(&h), __floats2half2_rn(1152.f, 1152.f));
    return half2_bits(v);
  }
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float warp_max_g(float x) {  // over the 8 lanes that share t (lane bits 2..4)
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float warp_sum_g(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// 16 consecutive values of T from a 16-byte aligned address (the host checks q's and cos / sin's alignment).
template <typename T>
__device__ __forceinline__ void load16(float (&dst)[16], const T* src) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(src)), b = __ldg(reinterpret_cast<const uint4*>(src) + 1);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffffu), hi = static_cast<uint16_t>(w[i] >> 16);
    dst[2 * i] = to_f<T>(*reinterpret_cast<const T*>(&lo));
    dst[2 * i + 1] = to_f<T>(*reinterpret_cast<const T*>(&hi));
  }
}

// What one thread loads for a 16-position half: K rows g and g + 8 (its D / 4 bytes of each), V at positions
// 2t, 2t + 1, 2t + 8, 2t + 9 (its D / 8 bytes of each), and the scales of positions g and g + 8.
template <int D>
struct Half {
  static_assert(D == 64 || D == 128, "head sizes 64 and 128");
  static constexpr int KW = D / 16;  // 32-bit words of a K row slice (one per k-step)
  static constexpr int VW = D / 32;  // 32-bit words of a V row slice (two m-tiles each)
  uint32_t k[2][KW];
  uint32_t v[4][VW];
  float ks[2], vs[2];
};

template <int N>
__device__ __forceinline__ void load_words(uint32_t (&dst)[N], const uint8_t* src) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + c);
      dst[4 * c] = x.x; dst[4 * c + 1] = x.y; dst[4 * c + 2] = x.z; dst[4 * c + 3] = x.w;
    }
  } else {
    static_assert(N == 2, "8 or 16-byte multiples");
    uint2 x = __ldg(reinterpret_cast<const uint2*>(src));
    dst[0] = x.x; dst[1] = x.y;
  }
}

// Where this thread reads in its KV head: the pools are contiguous [NB, HKV, BS, D] (checked on the host), so
// within a page rows are D bytes apart and every offset below but the page's is an immediate.
struct Bases {
  const uint8_t* k;  // K row g, d 16 t of page 0
  const uint8_t* v;  // V position 2 t, d (D / 8) g of page 0
  const float* ks;   // scale of position g of page 0
  const float* vs;
};

template <int D>
__device__ __forceinline__ void load_half(Half<D>& h, const Bases& a, int64_t page_kv, int64_t page_s, int off) {
  constexpr int KW = Half<D>::KW;
  const uint8_t* kp = a.k + page_kv + off * D;
  const uint8_t* vp = a.v + page_kv + off * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int c = 0; c < KW / 4; ++c) {  // chunk c: d in [64 c + 16 t, + 16): a warp's load reads 64 bytes of 8 rows
      uint4 x = __ldg(reinterpret_cast<const uint4*>(kp + 8 * r * D + 64 * c));
      h.k[r][4 * c] = x.x; h.k[r][4 * c + 1] = x.y; h.k[r][4 * c + 2] = x.z; h.k[r][4 * c + 3] = x.w;
    }
  }
  constexpr int vrow[4] = {0, 1, 8, 9};  // positions 2t + these
#pragma unroll
  for (int r = 0; r < 4; ++r) load_words(h.v[r], vp + vrow[r] * D);
  const int64_t so = page_s + off;
  h.ks[0] = __ldg(a.ks + so); h.ks[1] = __ldg(a.ks + so + 8);
  h.vs[0] = __ldg(a.vs + so); h.vs[1] = __ldg(a.vs + so + 8);
}

template <int D, bool FP8, bool NEW, typename T>
__global__ void __launch_bounds__(kWarps * 32) decode_q8_kernel(const DecodeQ8Params p) {
  constexpr int KW = Half<D>::KW, VW = Half<D>::VW;
  constexpr int MT = D / 16;  // m-tiles of O^T
  const int b = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t row = p.rows[b];
  const int length = static_cast<int>(p.lens[b]);
  const int split = ((length + p.nse - 1) / p.nse + p.block - 1) / p.block * p.block;
  const int start = sp * split;
  int end = min(start + split, length);
  const int cur = length - 1;
  const bool own = NEW && start <= cur && cur < end;
  if (NEW) end = min(end, cur);  // the pool holds positions < cur; the new one comes from registers
  const int G = p.g;

  const Bases bases{reinterpret_cast<const uint8_t*>(p.k) + kvh * p.stride_kh + g * D + 16 * t,
                    reinterpret_cast<const uint8_t*>(p.v) + kvh * p.stride_vh + 2 * t * D + (D / 8) * g,
                    p.ks + kvh * p.stride_sh + g, p.vs + kvh * p.stride_sh + g};
  const int64_t* tab = p.table + row * p.stride_t;

  const int nsteps = end > start ? (end - start + kStep - 1) / kStep : 0;
  const int bs_mask = (1 << p.bs_shift) - 1;
  // Page ids come a group of the warp's steps ahead of the KV loads that use them, one per lane (lane 2i + h:
  // half h of the warp's i-th step from s0), so that a step's loads wait for one memory latency, not for a table
  // read and then the loads (H200, 1024 rows x 200 positions: the kernel read at 0.4 of copy bandwidth that way).
  constexpr int kGroup = 16;  // steps per page group: 32 lanes, two halves each
  auto pages_of = [&](int s0) -> uint32_t {
    const int base = start + (s0 + (lane >> 1) * kWarps) * kStep + 16 * (lane & 1);
    return base < end ? static_cast<uint32_t>(__ldg(tab + (base >> p.bs_shift))) : 0u;  // < 2^32, as the page strides
  };
  uint32_t pages[2] = {pages_of(warp), 0u};  // groups of even and odd index
  auto fetch = [&](Half<D> (&hh)[2], int s) {
    const int k = (s - warp) / kWarps;  // the warp's k-th step
    const int slot = k % kGroup, grp = k / kGroup;
    if (slot == 0 && s + kGroup * kWarps < nsteps) {  // the next group's ids, a group ahead
      if (grp & 1) pages[0] = pages_of(s + kGroup * kWarps);
      else pages[1] = pages_of(s + kGroup * kWarps);
    }
    const uint32_t mine = (grp & 1) ? pages[1] : pages[0];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int base = start + s * kStep + 16 * hf;
      const uint32_t page = __shfl_sync(0xffffffffu, mine, 2 * slot + hf);
      if (base < end) {
        load_half<D>(hh[hf], bases, static_cast<uint64_t>(page) * p.page_bytes, static_cast<uint64_t>(page) * p.page_scales,
                     base & bs_mask);
      }
    }
  };
  // The warp's first loads go out before q is read, so their latencies overlap.
  Half<D> buf_a[2], buf_b[2];
  int s = warp;
  if (s < nsteps) fetch(buf_a, s);

  // q for head g of this KV head (rows g >= G are padding), RoPE'd with the new position's angles.
  const T* qrow = reinterpret_cast<const T*>(p.q) + b * p.stride_qb;
  const T* cs = reinterpret_cast<const T*>(p.cos) + b * p.stride_cb;
  const T* sn = reinterpret_cast<const T*>(p.sin) + b * p.stride_cb;
  const int head = kvh * G + (g < G ? g : 0);
  float qv[KW][4];
  float qmax = 0.f;
  // A thread's d are runs of 16 (k-steps 4c..4c+3 cover d in [64 c + 16 t, + 16)), read 16 bytes at a time: a
  // short row's CTA otherwise issued more loads for q than for its K and V.
#pragma unroll
  for (int c = 0; c < KW / 4; ++c) {
    const int d0 = 64 * c + 16 * t;
    float x[16];
    load16<T>(x, qrow + head * p.stride_qh + d0);
    if constexpr (NEW) {  // RoPE: x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1), rounded to T
      float xr[16], cv[16], sv[16];
      load16<T>(xr, qrow + head * p.stride_qh + (d0 + D / 2) % D);
      load16<T>(cv, cs + d0);
      load16<T>(sv, sn + d0);
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = round_t<T>(x[i] * cv[i] + xr[i] * (d0 < D / 2 ? -sv[i] : sv[i]));
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      qv[4 * c + i / 4][i % 4] = g < G ? x[i] : 0.f;
      qmax = fmaxf(qmax, fabsf(qv[4 * c + i / 4][i % 4]));
    }
  }
  qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 1));
  qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 2));
  const float qinv = qmax > 0.f ? 1.f / qmax : 0.f;
  uint32_t qf[KW][2];  // the B fragments of q^T, q / max|q| in fp16
#pragma unroll
  for (int j = 0; j < KW; ++j) {
    qf[j][0] = half2_bits(__floats2half2_rn(qv[j][0] * qinv, qv[j][1] * qinv));
    qf[j][1] = half2_bits(__floats2half2_rn(qv[j][2] * qinv, qv[j][3] * qinv));
  }
  // Score scale of this thread's accumulator columns (heads 2t, 2t + 1): max |q| * softmax scale, log2 units.
  float colscale[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) colscale[e] = __shfl_sync(0xffffffffu, qmax, (2 * t + e) * 4) * p.scale * kLog2e;

  __shared__ float sm_m[kWarps][8], sm_l[kWarps][8];
  // The warps' accumulators by head: head h's d at h * kAccRow + d + d / 16. A store of the combine writes d = 16 g
  // + 2 i of heads 2 t + e from the 32 lanes; with rows D apart those fell in 2 banks (ncu, 1024 rows x 200
  // positions: 11-way conflicts, 85% of the kernel's shared-store wavefronts); rows 24 mod 32 banks apart and the
  // 16-value runs skewed by one bank put the 32 lanes in 32 banks (D = 128; at most 2 a bank for D = 64).
  constexpr int kAccRow = D + 12;
  __shared__ float sm_acc[kWarps][8 * kAccRow];
  // The new position: its score per head (log2 units), its v scale, its v and k values (as stored, dequantized
  // up to the scale)
  __shared__ float sm_new[8 + 1 + 2 * D];
  if constexpr (NEW) {
    if (own && warp == kWarps - 1) {
      // The new k (RoPE'd) and v, rounded to the model's dtype, quantized per head as models/kv_quant.py
      // does, cached at position cur (each lane D / 32 values), and q . k_q per head from the q registers.
      // Before the loop (the last warp has the fewest steps), so that it overlaps the loads in flight: the
      // loop reads only positions before cur.
      constexpr int E = D / 32;
      const T* kn = qrow + (p.hq + kvh) * D;
      const T* vn = qrow + (p.hq + p.hkv + kvh) * D;
      float kf[E], vf[E], kmx = 0.f, vmx = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        const float sd = d < D / 2 ? -to_f<T>(sn[d]) : to_f<T>(sn[d]);
        kf[e] = round_t<T>(to_f<T>(kn[d]) * to_f<T>(cs[d]) + to_f<T>(kn[(d + D / 2) % D]) * sd);
        vf[e] = to_f<T>(vn[d]);
        kmx = fmaxf(kmx, fabsf(kf[e]));
        vmx = fmaxf(vmx, fabsf(vf[e]));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        kmx = fmaxf(kmx, __shfl_xor_sync(0xffffffffu, kmx, o));
        vmx = fmaxf(vmx, __shfl_xor_sync(0xffffffffu, vmx, o));
      }
      // max / QMAX as torch computes it for a CUDA tensor over a Python number (kv_quant.quantize): times the
      // float reciprocal; then the values divided by the scale, correctly rounded (torch's tensor division).
      constexpr float inv_qmax = 1.f / (FP8 ? 448.f : 127.f);
      const float k_sc = fmaxf(kmx, 1e-30f) * inv_qmax, v_sc = fmaxf(vmx, 1e-30f) * inv_qmax;
      const int64_t page = tab[cur >> p.bs_shift];
      const int off = cur & bs_mask;
      uint8_t* kd = reinterpret_cast<uint8_t*>(p.k) + kvh * p.stride_kh + page * p.page_bytes + off * D + lane * E;
      uint8_t* vd = reinterpret_cast<uint8_t*>(p.v) + kvh * p.stride_vh + page * p.page_bytes + off * D + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float yk = __fdiv_rn(kf[e], k_sc), yv = __fdiv_rn(vf[e], v_sc);
        if constexpr (FP8) {
          const __nv_fp8_e4m3 a(yk), c(yv);  // round to nearest even, saturating
          kd[e] = a.__x; vd[e] = c.__x;
          sm_new[9 + D + lane * E + e] = float(a);
          sm_new[9 + lane * E + e] = float(c);
        } else {  // round half to even, clamp
          yk = fminf(fmaxf(rintf(yk), -127.f), 127.f);
          yv = fminf(fmaxf(rintf(yv), -127.f), 127.f);
          kd[e] = static_cast<uint8_t>(static_cast<int8_t>(yk));
          vd[e] = static_cast<uint8_t>(static_cast<int8_t>(yv));
          sm_new[9 + D + lane * E + e] = yk;
          sm_new[9 + lane * E + e] = yv;
        }
      }
      if (lane == 0) {
        p.ks[kvh * p.stride_sh + page * p.page_scales + off] = k_sc;
        p.vs[kvh * p.stride_sh + page * p.page_scales + off] = v_sc;
        sm_new[8] = v_sc;
      }
      __syncwarp();
      float dot = 0.f;  // head g's q . k_q over this thread's d (the S^T permutation), summed over t
#pragma unroll
      for (int j = 0; j < KW; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dot += qv[j][e] * sm_new[9 + D + 64 * (j / 4) + 16 * t + 4 * (j % 4) + e];
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      if (t == 0 && g < G) sm_new[g] = dot * p.scale * k_sc * kLog2e;
    }
  }

  float m[2] = {-INFINITY, -INFINITY};  // running max per head column (log2 units), uniform over the warp
  float l[2] = {0.f, 0.f};              // this thread's part of the running sum
  float sigma = 1.f;                    // acc holds O^T / sigma: sigma is the last step's max v scale
  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // One 32-position step of this warp from what fetch loaded.
  auto step = [&](Half<D> (&hh)[2], int s) {
    const int lim0 = end - (start + s * kStep);  // live positions of the step (> 0)
    const bool tail = lim0 < kStep;              // warp-uniform: only the last step masks
    // Scores sc[hf][0..1]: position g of half hf, [2..3] position g + 8; columns heads 2t, 2t + 1.
    float sc[2][4], vsc[2][2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int lim = lim0 - 16 * hf;
      const Half<D>& h = hh[hf];
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      if (lim > 0) {
#pragma unroll
        for (int j = 0; j < KW; ++j) {
          uint32_t k0 = h.k[0][j], k1 = h.k[1][j];
          if constexpr (!FP8) { k0 ^= 0x80808080u; k1 ^= 0x80808080u; }
          mma16816(c, cvt2<FP8, false>(k0), cvt2<FP8, false>(k1), cvt2<FP8, true>(k0), cvt2<FP8, true>(k1),
                   qf[j][0], qf[j][1]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool ok = !tail || g + 8 * r < lim;
        const float ks = ok ? h.ks[r] : 0.f;
        vsc[hf][r] = ok ? h.vs[r] : 0.f;
#pragma unroll
        for (int e = 0; e < 2; ++e) sc[hf][2 * r + e] = ok ? c[2 * r + e] * (colscale[e] * ks) : -INFINITY;
      }
    }
    // Online softmax per head column (a step's first position is live, so m becomes finite); the step's
    // max v scale renormalizes P' into fp16's range and is undone on the accumulator (sigma).
    float muse[2], f[2];
    float vmax = warp_max_g(fmaxf(fmaxf(vsc[0][0], vsc[0][1]), fmaxf(vsc[1][0], vsc[1][1])));
    vmax = vmax > 0.f ? vmax : 1.f;
    const float vinv = 1.f / vmax;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float mx = fmaxf(fmaxf(sc[0][e], sc[0][2 + e]), fmaxf(sc[1][e], sc[1][2 + e]));
      const float mnew = fmaxf(m[e], warp_max_g(mx));
      muse[e] = mnew == -INFINITY ? 0.f : mnew;
      const float alpha = fast_exp2(m[e] - muse[e]);
      m[e] = mnew;
      l[e] *= alpha;
      f[e] = alpha * (sigma * vinv);
    }
    sigma = vmax;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      acc[i][0] *= f[0]; acc[i][1] *= f[1]; acc[i][2] *= f[0]; acc[i][3] *= f[1];
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int lim = lim0 - 16 * hf;
      if (lim <= 0) continue;
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) pr[e] = fast_exp2(sc[hf][e] - muse[e & 1]);
      l[0] += pr[0] + pr[2];
      l[1] += pr[1] + pr[3];
      const float w0 = vsc[hf][0] * vinv, w1 = vsc[hf][1] * vinv;
      const uint32_t p0 = movmatrix_trans(half2_bits(__floats2half2_rn(pr[0] * w0, pr[1] * w0)));
      const uint32_t p1 = movmatrix_trans(half2_bits(__floats2half2_rn(pr[2] * w1, pr[3] * w1)));
      uint32_t v[4][VW];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int w = 0; w < VW; ++w) v[r][w] = hh[hf].v[r][w];
      }
      if (tail) {  // masked positions' V bytes may be anything (fp8 NaN codes): zeroed; their P' is zero already
        constexpr int vrow[4] = {0, 1, 8, 9};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const bool ok = 2 * t + vrow[r] < lim;
#pragma unroll
          for (int w = 0; w < VW; ++w) v[r][w] = ok ? v[r][w] : 0u;
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int w = i / 2;
        const uint32_t sel = (i & 1) ? 0x7362u : 0x5140u;  // bytes 2i', 2i'+1 of two positions, interleaved
        uint32_t lo = prmt(v[0][w], v[1][w], sel), hi = prmt(v[2][w], v[3][w], sel);
        if constexpr (!FP8) { lo ^= 0x80808080u; hi ^= 0x80808080u; }
        mma16816(acc[i], cvt2<FP8, false>(lo), cvt2<FP8, true>(lo), cvt2<FP8, false>(hi), cvt2<FP8, true>(hi), p0, p1);
      }
    }
  };
  // Steps warp, warp + W, ...: two register buffers, the next step's loads in flight while one computes.
  for (; s < nsteps; s += 2 * kWarps) {
    if (s + kWarps < nsteps) fetch(buf_b, s + kWarps);
    step(buf_a, s);
    if (s + kWarps >= nsteps) break;
    if (s + 2 * kWarps < nsteps) fetch(buf_a, s + 2 * kWarps);
    step(buf_b, s + kWarps);
  }
  // Warps that ran no step keep m = -inf, l = 0, acc = 0.
#pragma unroll
  for (int e = 0; e < 2; ++e) l[e] = warp_sum_g(l[e]);

  // Combine the warps: their m, l, and acc * sigma * exp2(m_w - M) summed in shared memory (d un-permuted).
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) { sm_m[warp][2 * t + e] = m[e]; sm_l[warp][2 * t + e] = l[e]; }
  }
  __syncthreads();
  float wself[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][2 * t + e]);
    wself[e] = mx == -INFINITY ? 0.f : fast_exp2(m[e] - mx) * sigma;
  }
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int d = (D / 8) * g + 2 * i;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      sm_acc[warp][(2 * t + e) * kAccRow + d + d / 16] = acc[i][e] * wself[e];  // d and d + 1: one 16-run
      sm_acc[warp][(2 * t + e) * kAccRow + d + 1 + d / 16] = acc[i][2 + e] * wself[e];
    }
  }
  __syncthreads();
  // One thread per (head, d) of the real heads.
  for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32) {
    const int hd = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][hd]);
    float L = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        L += sm_l[w][hd] * fast_exp2(sm_m[w][hd] - M);
        o += sm_acc[w][hd * kAccRow + d + d / 16];
      }
    }
    if constexpr (NEW) {
      if (own) {  // the new position last, as the loop would have taken it
        const float sn2 = sm_new[hd];
        const float mn = fmaxf(M, sn2);
        const float a = fast_exp2(M - mn), pn = fast_exp2(sn2 - mn);
        L = L * a + pn;
        o = o * a + (pn * sm_new[8]) * sm_new[9 + d];
        M = mn;
      }
    }
    const int64_t hq = kvh * G + hd;
    if (p.nse == 1) {
      reinterpret_cast<T*>(p.out)[(b * p.hq + hq) * D + d] = from_f<T>(o / L);
    } else {
      const int64_t at = (b * p.hq + hq) * p.nse + sp;
      p.po[at * D + d] = o;
      if (d == 0) {
        p.pml[at * 2] = M * kLn2;  // natural-log units, as the merge expects
        p.pml[at * 2 + 1] = L;
      }
    }
  }
}

// The splits' partial results merged (kernels/decode.py's merge, the same weights): one CTA of D threads per
// (row, head). The splits' weights are computed once, in parallel, into shared memory; then each thread sums its
// d over the splits with independent loads (a serial loop over 60+ splits took several us at batch 1).
constexpr int kMergeSplits = 256;  // most splits a row can have (n_splits of a 16k pool in 64-position splits)

template <int D, typename T>
__global__ void __launch_bounds__(D) merge_kernel(const DecodeQ8Params p) {
  const int b = blockIdx.x, hq = blockIdx.y, d = threadIdx.x;
  const float* pml = p.pml + (static_cast<int64_t>(b) * p.hq + hq) * p.nse * 2;
  const float* po = p.po + (static_cast<int64_t>(b) * p.hq + hq) * p.nse * D;
  __shared__ float w[kMergeSplits];
  __shared__ float red[D / 32];
  float mx = -INFINITY;
  for (int s = d; s < p.nse; s += D) mx = fmaxf(mx, pml[2 * s]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((d & 31) == 0) red[d >> 5] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int i = 1; i < D / 32; ++i) mx = fmaxf(mx, red[i]);
  float den = 0.f;
  for (int s = d; s < p.nse; s += D) {
    const float ws = __expf(pml[2 * s] - mx);  // empty splits: m = -inf, weight 0
    w[s] = ws;
    den += ws * pml[2 * s + 1];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  __syncthreads();  // red[] read above, w[] written
  if ((d & 31) == 0) red[d >> 5] = den;
  __syncthreads();
  den = 0.f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) den += red[i];
  float num = 0.f;
#pragma unroll 8
  for (int s = 0; s < p.nse; ++s) num += po[s * D + d] * w[s];
  reinterpret_cast<T*>(p.out)[(static_cast<int64_t>(b) * p.hq + hq) * D + d] = from_f<T>(num / den);
}

template <int D, bool FP8, bool NEW, typename T>
void launch(const DecodeQ8Params& p, cudaStream_t stream) {
  decode_q8_kernel<D, FP8, NEW, T><<<dim3(p.b, p.hkv, p.nse), kWarps * 32, 0, stream>>>(p);
  if (p.nse > 1) merge_kernel<D, T><<<dim3(p.b, p.hq), D, 0, stream>>>(p);
}

template <int D, bool FP8, bool NEW>
void launch_t(const DecodeQ8Params& p, cudaStream_t stream) {
  if (p.bf16) launch<D, FP8, NEW, __nv_bfloat16>(p, stream);
  else launch<D, FP8, NEW, __half>(p, stream);
}

template <int D>
void launch_d(const DecodeQ8Params& p, cudaStream_t stream) {
  if (p.fp8) {
    if (p.new_kv) launch_t<D, true, true>(p, stream); else launch_t<D, true, false>(p, stream);
  } else {
    if (p.new_kv) launch_t<D, false, true>(p, stream); else launch_t<D, false, false>(p, stream);
  }
}

}  // namespace

bool decode_q8_supported(int head_dim, int group) { return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= 8; }

int decode_q8_launch(const DecodeQ8Params& p, cudaStream_t stream) {
  if (p.b == 0) return 0;
  if (p.d == 128) launch_d<128>(p, stream);
  else if (p.d == 64) launch_d<64>(p, stream);
  else return 1;
  return static_cast<int>(cudaGetLastError());
}

}  // namespace onecopy_native
