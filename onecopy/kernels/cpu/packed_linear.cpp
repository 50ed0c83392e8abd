// y = x @ W.T for a packed (quantized) W on the CPU, read as the bundle stores it: onecopy_cpu::packed_linear.
//
// Layouts (onecopy/layouts.py): q8s int8, value s * q; q8a uint8, s * q + m; q4z two nibbles per byte (low
// nibble first: byte j holds k = 2j and 2j + 1), s * (q - 8); q4a nibbles, s * q + m; one float32 s (and m)
// per `group` values of a row. x is float32 [M, K], y float32 [M, N].
//
// Few rows (a decode step): every output is one dot product over the packed row, 32 values at a time
// (AVX-512: four rows per weight chunk, or four output features for one row, nibbles through a table; AVX2 +
// FMA: two rows; plain C++ without them; output features split over torch's OpenMP threads), summed per group
// and scaled once:
//   y[m, n] = sum_g s[n, g] * (x_g . q_g)  (+ sum_g m[n, g] * sum(x_g) for the affine layouts),
// in an order fixed by the row alone: a row's bits never depend on the other rows (nor on the threads),
// so the batched decode equals the solo one. Many rows (a prefill): the weight is dequantized once into a
// float copy (exactly `models.packed.dequantize`) and multiplied by ATen's GEMM, as the float model is.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ONECOPY_X86 1
#endif

namespace {

enum Layout : int64_t { Q8S = 1, Q4Z = 2, Q4A = 3, Q8A = 4 };
// More rows: dequantize once and GEMM. The fused path costs ~2.4 ms a row for SmolLM2's projections, the
// dequantized copy ~175 ms and then little a row (2 cores): they cross near 75 rows.
constexpr int64_t kKernelRows = 64;

bool nibbles(int64_t layout) { return layout == Q4Z || layout == Q4A; }
bool affine(int64_t layout) { return layout == Q4A || layout == Q8A; }

// The row's operand as the dot products read it: for nibble layouts the even-k values, then the odd-k ones
// ([K/2] each), so that a byte's low and high nibbles meet contiguous x values; else x as it is.
struct Row {
  const float* a;  // even k (nibbles) or all of x
  const float* b;  // odd k (nibbles)
  const float* sums;  // sum of x over each group (affine layouts; null otherwise)
};

float dot_scalar(const Row& r, const uint8_t* q, const float* s, const float* mn, int64_t groups, int64_t group,
                 int64_t layout) {
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float acc = 0.f;
    if (nibbles(layout)) {
      const int64_t half = group / 2;
      for (int64_t j = g * half; j < (g + 1) * half; ++j) {
        float lo = float(q[j] & 0x0F), hi = float(q[j] >> 4);
        if (layout == Q4Z) { lo -= 8.f; hi -= 8.f; }
        acc += r.a[j] * lo + r.b[j] * hi;
      }
    } else {
      for (int64_t k = g * group; k < (g + 1) * group; ++k)
        acc += r.a[k] * (layout == Q8S ? float(int8_t(q[k])) : float(q[k]));
    }
    total += s[g] * acc;
  }
  if (affine(layout))
    for (int64_t g = 0; g < groups; ++g) total += mn[g] * r.sums[g];
  return total;
}

enum class Isa { Scalar, Avx2, Avx512 };

#ifdef ONECOPY_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) inline __m256 to_float(__m128i bytes8, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

// The same sums as dot_scalar with 8 lanes, for R rows at once (y[r] to out[r * stride]): each 32-value chunk (16 bytes of nibbles, 32
// bytes of 8-bit) is converted to floats once and multiplied into every row. A row's operations and their
// order are the same whatever R is, so its bits are too.
template <int R>
__attribute__((target("avx2,fma"))) void dot_avx2(const Row* rows, float* out, int64_t stride, const uint8_t* q,
                                                  const float* s, const float* mn, int64_t groups, int64_t group,
                                                  int64_t layout) {
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  const int64_t chunks = group / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(layout == Q4Z ? 8.f : 0.f);
  const bool sg = layout == Q8S;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 w0, w1, w2, w3;
      int64_t o0, o1, o2, o3;  // where each w's 8 x values start in the row's operand (a or b)
      bool odd23;  // w2, w3 read the odd-k operand (nibbles)
      if (nibbles(layout)) {
        const int64_t j = (g * chunks + c) * 16;
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j));
        const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        w0 = _mm256_sub_ps(to_float(lo, false), eight);
        w1 = _mm256_sub_ps(to_float(_mm_srli_si128(lo, 8), false), eight);
        w2 = _mm256_sub_ps(to_float(hi, false), eight);
        w3 = _mm256_sub_ps(to_float(_mm_srli_si128(hi, 8), false), eight);
        o0 = j, o1 = j + 8, o2 = j, o3 = j + 8, odd23 = true;
      } else {
        const int64_t k = (g * chunks + c) * 32;
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16));
        w0 = to_float(b0, sg);
        w1 = to_float(_mm_srli_si128(b0, 8), sg);
        w2 = to_float(b1, sg);
        w3 = to_float(_mm_srli_si128(b1, 8), sg);
        o0 = k, o1 = k + 8, o2 = k + 16, o3 = k + 24, odd23 = false;
      }
      for (int r = 0; r < R; ++r) {
        const float* a = rows[r].a;
        const float* b = odd23 ? rows[r].b : rows[r].a;
        acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + o0), w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(a + o1), w1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(b + o2), w2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(b + o3), w3, acc[r][3]);
      }
    }
    const __m256 sc = _mm256_set1_ps(s[g]);
    for (int r = 0; r < R; ++r)
      total[r] = _mm256_fmadd_ps(sc, _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])),
                                 total[r]);
  }
  for (int r = 0; r < R; ++r) {
    float y = hsum(total[r]);
    if (affine(layout))
      for (int64_t g = 0; g < groups; ++g) y += mn[g] * rows[r].sums[g];
    out[r * stride] = y;
  }
}

// AVX-512 conversions shared by the one-row and many-row paths. A nibble's value (q, or q - 8 for q4z) from
// a 16-entry table; 16 bytes give the low nibbles (even k) in w0 and the high ones (odd k) in w1.
__attribute__((target("avx512f"), always_inline)) inline __m512 nibble_table(int64_t layout) {
  const float b = layout == Q4Z ? -8.f : 0.f;
  return _mm512_setr_ps(b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8, b + 9, b + 10, b + 11, b + 12,
                        b + 13, b + 14, b + 15);
}

__attribute__((target("avx512f"), always_inline)) inline void nibbles16(const uint8_t* p, __m512 lut, __m512& w0, __m512& w1) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)), lut);
  w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)), lut);
}

// 32 bytes of 8-bit values as floats: the first 16 in w0, the next in w1.
__attribute__((target("avx512f"), always_inline)) inline void bytes32(const uint8_t* p, bool is_signed, __m512& w0, __m512& w1) {
  const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  w0 = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0));
  w1 = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1));
}

// 16 lanes: a nibble becomes its float through a 16-entry table (one permute for 16 values), 8-bit values
// through one conversion. R rows against NB consecutive output features (q, s and mn at the first; weight rows
// row_bytes apart), y[r, t] written to out[r * stride + t]: rows in blocks of up to four per weight chunk, or,
// for one row, four output features at a time (NB independent chains where one row alone has one). An output's
// operations and their order are the same whatever R and NB are, so its bits are too.
template <int R, int NB>
__attribute__((target("avx512f"))) void dot_avx512(const Row* rows, float* out, int64_t stride, const uint8_t* q,
                                                 int64_t row_bytes, const float* s, const float* mn, int64_t groups,
                                                 int64_t group, int64_t layout) {
  __m512 total[NB][R];
  for (int t = 0; t < NB; ++t)
    for (int r = 0; r < R; ++r) total[t][r] = _mm512_setzero_ps();
  const int64_t chunks = group / 32;
  const __m512 lut = nibble_table(layout);
  const bool sg = layout == Q8S;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[NB][R][2];
    for (int t = 0; t < NB; ++t)
      for (int r = 0; r < R; ++r) acc[t][r][0] = acc[t][r][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const bool nib = nibbles(layout);
      // where w0's and w1's 16 x values start in a row's operand (w1 reads the odd-k half for nibbles)
      const int64_t o0 = nib ? (g * chunks + c) * 16 : (g * chunks + c) * 32, o1 = nib ? o0 : o0 + 16;
      for (int t = 0; t < NB; ++t) {
        __m512 w0, w1;
        if (nib)
          nibbles16(q + t * row_bytes + o0, lut, w0, w1);
        else
          bytes32(q + t * row_bytes + o0, sg, w0, w1);
        for (int r = 0; r < R; ++r) {
          acc[t][r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[r].a + o0), w0, acc[t][r][0]);
          acc[t][r][1] = _mm512_fmadd_ps(_mm512_loadu_ps((nib ? rows[r].b : rows[r].a) + o1), w1, acc[t][r][1]);
        }
      }
    }
    for (int t = 0; t < NB; ++t) {
      const __m512 sc = _mm512_set1_ps(s[t * groups + g]);
      for (int r = 0; r < R; ++r)
        total[t][r] = _mm512_fmadd_ps(sc, _mm512_add_ps(acc[t][r][0], acc[t][r][1]), total[t][r]);
    }
  }
  for (int t = 0; t < NB; ++t)
    for (int r = 0; r < R; ++r) {
      float y = _mm512_reduce_add_ps(total[t][r]);
      if (affine(layout))
        for (int64_t g = 0; g < groups; ++g) y += mn[t * groups + g] * rows[r].sums[g];
      out[r * stride + t] = y;
    }
}

// The widest path this CPU runs, held to AVX2 (or plain C++) where $ATEN_CPU_CAPABILITY holds ATen there, as
// the CI's AVX2 rerun does: then the kernel's bits are an AVX2 machine's too.
Isa isa() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string held = cap ? cap : "";
  if (held == "default") return Isa::Scalar;
  if (avx512 && held != "avx2") return Isa::Avx512;
  return avx2 ? Isa::Avx2 : Isa::Scalar;
}
#endif

void check(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
           int64_t layout, int64_t group) {
  TORCH_CHECK(layout >= Q8S && layout <= Q8A, "packed_linear: unknown layout id ", layout);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_linear: x must be a float32 CPU matrix [M, K], got ", x.sizes(), " ", x.scalar_type());
  const int64_t k = x.size(1), per_byte = nibbles(layout) ? 2 : 1;
  TORCH_CHECK(group % 32 == 0 && k % group == 0, "packed_linear: group ", group, " must be a multiple of 32 dividing K=", k);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * per_byte == k && qweight.element_size() == 1 && qweight.is_contiguous(),
              "packed_linear: qweight must be contiguous [N, K/", per_byte, "] bytes, got ", qweight.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == qweight.size(0) && scales.size(1) == k / group,
              "packed_linear: scales must be contiguous float32 [N, K/group], got ", scales.sizes());
  TORCH_CHECK(affine(layout) == (mins.has_value() && mins->defined()), "packed_linear: mins go with the affine layouts only");
  if (affine(layout))
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat && mins->is_contiguous(),
                "packed_linear: mins must be like scales");
}

// The float weight [N, K], as models.packed.dequantize computes it (s * q exact, then + m).
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      int64_t layout, int64_t group, int64_t k) {
  const int64_t n = qweight.size(0), groups = k / group;
  at::Tensor w = at::empty({n, k}, scales.options());
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* s = scales.data_ptr<float>();
  const float* mn = affine(layout) ? mins->data_ptr<float>() : nullptr;
  float* out = w.data_ptr<float>();
  const int64_t row_bytes = qweight.size(1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* qi = q + i * row_bytes;
      float* oi = out + i * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = s[i * groups + g];
        const float mg = mn ? mn[i * groups + g] : 0.f;
        for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
          float v;
          if (nibbles(layout)) {
            const uint8_t byte = qi[kk >> 1];
            v = float((kk & 1) ? (byte >> 4) : (byte & 0x0F));
          } else {
            v = layout == Q8S ? float(int8_t(qi[kk])) : float(qi[kk]);
          }
          // s * q, then + m: two roundings, as gguf (built with -ffp-contract=off: no fused multiply-add here)
          oi[kk] = (layout == Q4Z ? sc * (v - 8.f) : sc * v) + mg;
        }
      }
    }
  });
  return w;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins, int64_t layout, int64_t group) {
  check(x, qweight, scales, mins, layout, group);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0), groups = k / group;
  if (m > kKernelRows)
    return at::matmul(x, dequantize(qweight, scales, mins, layout, group, k).t());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  // Each row's operand: x deinterleaved for the nibble layouts, and its sum per group for the affine ones.
  at::Tensor prep = nibbles(layout) ? at::empty({m, k}, x.options()) : xc;
  at::Tensor sums = affine(layout) ? at::empty({m, groups}, x.options()) : at::Tensor();
  const float* xp = xc.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* row = xp + r * k;
    if (nibbles(layout)) {
      float* dst = prep.data_ptr<float>() + r * k;
      for (int64_t j = 0; j < k / 2; ++j) {
        dst[j] = row[2 * j];
        dst[k / 2 + j] = row[2 * j + 1];
      }
    }
    if (affine(layout)) {
      float* sr = sums.data_ptr<float>() + r * groups;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) acc += row[i];
        sr[g] = acc;
      }
    }
  }
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* s = scales.data_ptr<float>();
  const float* mn = affine(layout) ? mins->data_ptr<float>() : nullptr;
  const float* pp = prep.data_ptr<float>();
  const float* sp = affine(layout) ? sums.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = qweight.size(1);
#ifdef ONECOPY_X86
  const Isa path = isa();
#else
  const Isa path = Isa::Scalar;
#endif
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef ONECOPY_X86
    if (path == Isa::Avx512 && m == 1) {  // one row: four output features at a time (the rest below)
      const Row row{pp, pp + k / 2, sp};
      for (; i + 4 <= end; i += 4)
        dot_avx512<1, 4>(&row, yp + i, n, q + i * row_bytes, row_bytes, s + i * groups, mn ? mn + i * groups : nullptr,
                         groups, group, layout);
    }
#endif
    for (; i < end; ++i) {
      const uint8_t* qi = q + i * row_bytes;
      const float* si = s + i * groups;
      const float* mi = mn ? mn + i * groups : nullptr;
      for (int64_t r = 0; r < m;) {
        const int64_t left = m - r;
        Row rows[4];
        for (int64_t t = 0; t < 4 && t < left; ++t)
          rows[t] = Row{pp + (r + t) * k, pp + (r + t) * k + k / 2, sp ? sp + (r + t) * groups : nullptr};
        float* o = yp + r * n + i;  // y[r, i]; the next rows' are n apart
        int64_t did = 1;
#ifdef ONECOPY_X86
        if (path == Isa::Avx512) {
          did = left >= 4 ? 4 : left;
          if (did == 4) dot_avx512<4, 1>(rows, o, n, qi, row_bytes, si, mi, groups, group, layout);
          else if (did == 3) dot_avx512<3, 1>(rows, o, n, qi, row_bytes, si, mi, groups, group, layout);
          else if (did == 2) dot_avx512<2, 1>(rows, o, n, qi, row_bytes, si, mi, groups, group, layout);
          else dot_avx512<1, 1>(rows, o, n, qi, row_bytes, si, mi, groups, group, layout);
        } else if (path == Isa::Avx2) {
          did = left >= 2 ? 2 : 1;
          if (did == 2) dot_avx2<2>(rows, o, n, qi, si, mi, groups, group, layout);
          else dot_avx2<1>(rows, o, n, qi, si, mi, groups, group, layout);
        } else
#endif
        {
          o[0] = dot_scalar(rows[0], qi, si, mi, groups, group, layout);
        }
        r += did;
      }
    }
  });
  return y;
}

}  // namespace

// The schema is defined in Python (onecopy/kernels/cpu/__init__.py), so export traces the op with no compiler.
TORCH_LIBRARY_IMPL(onecopy_cpu, CPU, lib) {
  lib.impl("packed_linear", &packed_linear);
}
