// The torch.ops.onecopy_native ops: the 8-bit paged decode attention of decode_q8.cu, with and without the
// RoPE + quantize + cache write of the new position. AOTInductor packages call them by name through their
// proxy executor, so a process that loads such a package loads this library first (kernels/native/__init__.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <utility>
#include <vector>

#include "decode_q8.h"
#include "packed_gemm.h"
#include "packed_linear.h"

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

at::Tensor fp8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, bool glu);  // below

// Whether the current device has FP8 tensor cores and e4m3 conversions (sm_89+): the f8r weights' kernels need them.
bool fp8_device() {
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major * 10 + minor >= 89;
}

// x's rows as the kernels read them, 16 bytes at a time: unit inner stride, every outer stride a multiple of 8
// values, an aligned start (a contiguous view that starts off 16 bytes is copied: .contiguous() would return it
// as it is).
at::Tensor copyable_rows(const at::Tensor& x) {
  bool ok = x.stride(-1) == 1 && aligned16(x);
  for (int64_t i = 0; ok && i + 1 < x.dim(); ++i) ok = x.stride(i) % 8 == 0;
  if (ok) return x;
  return x.is_contiguous() ? x.clone() : x.contiguous();
}

at::Tensor decode_q8(const at::Tensor& q, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                     const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k_scale,
                     const at::Tensor& v_scale, const at::Tensor& table, const at::Tensor& rows,
                     const at::Tensor& lengths, int64_t splits, int64_t block) {
  const bool new_kv = cos.has_value();
  const int64_t d = k_pool.size(3), hkv = k_pool.size(1), bs = k_pool.size(2), b = q.size(0);
  const int64_t hq = new_kv ? q.size(1) / d - 2 * hkv : q.size(1);
  TORCH_CHECK(q.is_cuda() && q.stride(-1) == 1, "q must be a CUDA tensor with unit last stride");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bfloat16 or float16");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "the K and V pools must be contiguous [NB, HKV, BS, D] tensors of one shape and dtype");
  const bool fp8 = k_pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || k_pool.scalar_type() == at::kChar, "the pools must be int8 or float8_e4m3fn");
  TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.scalar_type() == at::kFloat &&
                  k_scale.sizes() == v_scale.sizes() && k_scale.size(0) == k_pool.size(0),
              "the scale pools must be contiguous float32 [NB, HKV, BS]");
  TORCH_CHECK(bs >= 16 && (bs & (bs - 1)) == 0, "the page size must be a power of two >= 16");
  TORCH_CHECK(hq % hkv == 0 && onecopy_native::decode_q8_supported(static_cast<int>(d), static_cast<int>(hq / hkv)),
              "unsupported head size or group (decode_q8_supported)");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.stride(-1) == 1 && rows.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && rows.is_contiguous() && lengths.is_contiguous(),
              "table, rows and lengths must be int64 (unit inner stride)");
  TORCH_CHECK(k_pool.stride(0) < (int64_t{1} << 32) && k_scale.stride(0) < (int64_t{1} << 32), "page too large");
  TORCH_CHECK(splits >= 1 && splits <= 256 && block >= 1, "splits must be in 1..256 and block positive");
  c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({b, hq, d}, q.options());
  at::Tensor po, pml;
  if (splits > 1) {
    po = at::empty({b, hq, splits, d}, q.options().dtype(at::kFloat));
    pml = at::empty({b, hq, splits, 2}, q.options().dtype(at::kFloat));
  }
  const at::Tensor qa = copyable_rows(q);  // the kernel reads q, cos and sin 16 bytes at a time
  at::Tensor c, s;
  if (new_kv) {
    c = copyable_rows(cos->contiguous());
    s = copyable_rows(sin->contiguous());
    TORCH_CHECK(c.scalar_type() == q.scalar_type() && s.scalar_type() == q.scalar_type() && c.size(-1) == d,
                "cos and sin must be [B, D] in q's dtype");
  }
  onecopy_native::DecodeQ8Params p{};
  p.q = qa.data_ptr();
  p.stride_qb = qa.stride(0);
  p.stride_qh = new_kv ? d : qa.stride(1);
  p.k = k_pool.data_ptr();
  p.v = v_pool.data_ptr();
  p.stride_kh = k_pool.stride(1);
  p.stride_vh = v_pool.stride(1);
  p.ks = k_scale.data_ptr<float>();
  p.vs = v_scale.data_ptr<float>();
  p.stride_sh = k_scale.stride(1);
  p.table = table.data_ptr<int64_t>();
  p.stride_t = table.stride(0);
  p.rows = rows.data_ptr<int64_t>();
  p.lens = lengths.data_ptr<int64_t>();
  p.cos = new_kv ? c.data_ptr() : nullptr;
  p.sin = new_kv ? s.data_ptr() : nullptr;
  p.stride_cb = new_kv ? c.stride(0) : 0;
  p.po = splits > 1 ? po.data_ptr<float>() : nullptr;
  p.pml = splits > 1 ? pml.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.b = static_cast<int>(b); p.hq = static_cast<int>(hq); p.hkv = static_cast<int>(hkv);
  p.g = static_cast<int>(hq / hkv); p.d = static_cast<int>(d);
  p.page_bytes = static_cast<uint32_t>(k_pool.stride(0));
  p.page_scales = static_cast<uint32_t>(k_scale.stride(0));
  p.bs_shift = __builtin_ctzll(static_cast<unsigned long long>(bs));
  p.nse = static_cast<int>(splits);
  p.block = static_cast<int>(block);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  p.fp8 = fp8;
  p.new_kv = new_kv;
  p.bf16 = q.scalar_type() == at::kBFloat16;
  const int err = onecopy_native::decode_q8_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "decode_q8 launch failed: ", err == 1 ? "unsupported head size" : cudaGetErrorString(
      static_cast<cudaError_t>(err)));
  return out;
}

at::Tensor paged_decode_q8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& table,
                           const at::Tensor& rows, const at::Tensor& lengths, int64_t splits, int64_t block) {
  return decode_q8(q, std::nullopt, std::nullopt, k_pool, v_pool, k_scale, v_scale, table, rows, lengths, splits, block);
}

at::Tensor paged_decode_rope_q8(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                                at::Tensor& v_pool, at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& table,
                                const at::Tensor& rows, const at::Tensor& lengths, int64_t splits, int64_t block) {
  return decode_q8(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, table, rows, lengths, splits, block);
}

void check_launch(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " launch failed: ", err == -1 ? "unsupported shape or layout" :
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// A tile-ordered packed weight as a float matrix [N, K] in `dtype` (a prefill's cuBLAS GEMM reads it).
// (The output dtype is a flag, not a ScalarType: AOTInductor's proxy executor did not hand the op a ScalarType
// argument intact.)
at::Tensor unpack_weight(const at::Tensor& qweight_in, const at::Tensor& scales_in, const std::optional<at::Tensor>& mins_in,
                         int64_t layout, int64_t group, bool half) {
  const int64_t per_byte = layout == onecopy_native::kQ8sMma ? 1 : 2;
  const at::ScalarType dtype = half ? at::kHalf : at::kBFloat16;
  const auto qweight = qweight_in.contiguous(), scales = scales_in.contiguous();
  const std::optional<at::Tensor> mins = mins_in.has_value() ? std::optional<at::Tensor>(mins_in->contiguous()) : std::nullopt;
  const int64_t n = qweight.size(0), k = qweight.size(1) * per_byte;
  TORCH_CHECK(qweight.is_cuda() && qweight.dim() == 2, "unpack_weight: qweight must be a CUDA [N, K / values per byte] tensor");
  TORCH_CHECK(group > 0, "unpack_weight: group must be positive, got ", group);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n * (k / group),
              "unpack_weight: scales must be float32 [N, K / group] (", n, " x ", k / group, "), got ", scales.sizes());
  TORCH_CHECK((layout == onecopy_native::kQ4aMma) == mins.has_value(), "unpack_weight: mins go with q4a_mma alone");
  c10::cuda::CUDAGuard guard(qweight.device());
  auto out = at::empty({n, k}, qweight.options().dtype(dtype));
  onecopy_native::UnpackParams p{};
  p.w = qweight.data_ptr();
  p.s = scales.data_ptr<float>();
  p.mn = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.n = static_cast<int>(n); p.k = static_cast<int>(k); p.group = static_cast<int>(group);
  p.layout = static_cast<int>(layout); p.bf16 = dtype == at::kBFloat16;
  check_launch(onecopy_native::unpack_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "unpack_weight");
  return out;
}

// The packed GEMM (packed_gemm.cu) serves up to kGemmMaxRows rows, where its CTAs fill enough SMs (one CTA a block of
// 256 outputs, 128 with SwiGLU, times the K splits of a weight of few blocks on Hopper); H200, int4 g128,
// benchmarks/packed_gemm_cuda.py: the fused gate/up weight at 64 rows 79 us against 155 unpacked for cuBLAS, bf16
// 64; 4096-output weights in 16 CTAs 2x slower than unpacking); at 128 rows and more cuBLAS on the unpacked weight
// is as fast or faster.
constexpr int64_t kGemmMaxRows = 64;

onecopy_native::PackedGemmPlan gemm_plan_for(int64_t m, int64_t n, int64_t k, int64_t layout, int64_t group, bool glu) {
  const onecopy_native::PackedGemmPlan none{0, 0, 0, 1};
  if (m > kGemmMaxRows) return none;
  const auto plan = onecopy_native::packed_gemm_plan(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                                     static_cast<int>(layout), static_cast<int>(group), glu);
  int device = 0, sms = 0;  // the current device: the caller's guard set it
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // CTAs on at least half the SMs, or a quarter where K is split (a 4096-output weight: 64 CTAs, measured faster than
  // unpacking for cuBLAS; packed_gemm_plan splits only where all the clusters are resident at once)
  const int64_t ctas = static_cast<int64_t>(plan.row_blocks) * plan.col_blocks * plan.k_splits;
  return plan.rows > 0 && (plan.k_splits > 1 ? 4 : 2) * ctas >= sms ? plan : none;
}

// Hopper's warpgroup-MMA kernel (packed_wgmma.cu) takes kWgmmaMinRows..kWgmmaMaxRows rows: there it beats both the
// mma.sync GEMM with its folds and the unpacked weight with cuBLAS (H100, int4 g128, benchmarks/packed_gemm_cuda.py,
// benchmarks/results/packed_gemm_wgmma_h100.json). Past the range cuBLAS on the unpacked weight is faster (its MMA
// rate beats re-dequantizing the weight once per 128 rows); below it the GEMM's folds and short K loop pay.
constexpr int64_t kWgmmaMinRows = 33;
constexpr int64_t kWgmmaMaxRows = 512;

// Whether the packed GEMMs can copy the weight, scales and mins 16 bytes at a time (cp.async): contiguous, aligned.
bool copyable_weight(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins) {
  return qweight.is_contiguous() && scales.is_contiguous() && aligned16(qweight) && aligned16(scales) &&
         (!mins.has_value() || (mins->is_contiguous() && aligned16(*mins)));
}

bool wgmma_serves(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t layout, int64_t group) {
  const int64_t m = x.size(0);
  return m >= kWgmmaMinRows && m <= kWgmmaMaxRows && copyable_weight(qweight, scales, mins) &&
         onecopy_native::packed_wgmma_supported(static_cast<int>(m), static_cast<int>(qweight.size(0)),
                                                static_cast<int>(x.size(1)), static_cast<int>(layout),
                                                static_cast<int>(group));
}

// A packed weight's float32 scales (and mins) for [N, K] in groups of `group`: the checks every packed op makes.
void check_scales(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t layout, int64_t group) {
  TORCH_CHECK(group > 0 && (group & (group - 1)) == 0, "group must be a positive power of two, got ", group);
  const int64_t per_byte = layout == onecopy_native::kQ8sMma ? 1 : 2;
  const int64_t n = qweight.size(0), k = x.size(1);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * per_byte == k && scales.scalar_type() == at::kFloat &&
                  scales.numel() == n * (k / group),
              "qweight [N, K / values per byte] and float32 scales [N, K / group] must match x's K");
  TORCH_CHECK((layout == onecopy_native::kQ4aMma) == mins.has_value(), "mins go with the q4a layout alone");
  TORCH_CHECK(!mins.has_value() || (mins->scalar_type() == at::kFloat && mins->numel() == scales.numel()),
              "mins must be float32, shaped as the scales");
  TORCH_CHECK(qweight.device() == x.device() && scales.device() == x.device() &&
                  (!mins.has_value() || mins->device() == x.device()),
              "x, qweight, scales and mins must be on one CUDA device");
}

// The operands the two packed kernels' parameter blocks (PackedLinearParams, PackedGemmParams) name alike: x, the
// weight, the norm's weight and partial sums, the residual. The copies it has to make (a norm weight that starts
// off 16 bytes: read 16 bytes at a time; a residual with a non-unit inner stride) go to `keep`, which the caller
// holds until the launch.
template <typename P>
void set_operands(P& p, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& residual,
                  const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& ss, double eps,
                  std::vector<at::Tensor>& keep) {
  p.x = x.data_ptr();
  p.stride_x = x.stride(0);
  p.w = qweight.data_ptr();
  p.s = scales.data_ptr<float>();
  p.mn = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  if (norm_weight.has_value()) {
    const auto nw = norm_weight->contiguous();
    keep.push_back(aligned16(nw) ? nw : nw.clone());
    p.nw = keep.back().data_ptr();
    p.ss = ss->data_ptr<float>();
    p.stride_ss = ss->stride(0);
    p.p_in = static_cast<int>(ss->size(1));
    p.eps = static_cast<float>(eps);
  }
  if (residual.has_value()) {
    keep.push_back(residual->stride(1) == 1 ? *residual : residual->contiguous());
    p.res = keep.back().data_ptr();
    p.stride_r = keep.back().stride(0);
  }
}

// The packed GEMM with its folds (packed_gemm.h): out [M, N'] and, with `want_ss`, each row's sums of squares per
// 16 outputs. The weight, scales and mins are contiguous and 16-byte aligned (the callers check).
std::tuple<at::Tensor, at::Tensor> run_gemm(const onecopy_native::PackedGemmPlan& plan, const at::Tensor& x_in,
                                            const at::Tensor& qweight, const at::Tensor& scales,
                                            const std::optional<at::Tensor>& mins,
                                            const std::optional<at::Tensor>& residual,
                                            const std::optional<at::Tensor>& norm_weight,
                                            const std::optional<at::Tensor>& ss, double eps, bool glu, int64_t layout,
                                            int64_t group, bool want_ss) {
  const auto x = copyable_rows(x_in);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0), n_out = glu ? n / 2 : n;
  auto out = at::empty({m, n_out}, x.options());
  at::Tensor ss_out, xn;
  std::vector<at::Tensor> keep;
  onecopy_native::PackedGemmParams p{};
  set_operands(p, x, qweight, scales, mins, residual, norm_weight, ss, eps, keep);
  if (norm_weight.has_value()) {  // the normed rows' buffer
    xn = at::empty({m, k}, x.options());
    p.xn = xn.data_ptr();
  }
  if (want_ss) {
    ss_out = at::empty({m, n_out / 16}, x.options().dtype(at::kFloat));
    p.ss_out = ss_out.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.m = static_cast<int>(m); p.n = static_cast<int>(n); p.k = static_cast<int>(k);
  p.group = static_cast<int>(group); p.layout = static_cast<int>(layout); p.glu = glu;
  check_launch(onecopy_native::packed_gemm_launch(p, plan, c10::cuda::getCurrentCUDAStream().stream()), "packed_gemm");
  return {out, ss_out};
}

// x [M, K] @ W^T on Hopper's warpgroup MMA once the operands are checked (packed_wgmma, or wgmma_serves).
at::Tensor run_wgmma(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, int64_t layout, int64_t group, int64_t block_rows) {
  const auto x = copyable_rows(x_in);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  auto out = at::empty({m, n}, x.options());
  onecopy_native::PackedGemmParams p{};
  std::vector<at::Tensor> keep;  // no folds: set_operands copies nothing
  set_operands(p, x, qweight, scales, mins, std::nullopt, std::nullopt, std::nullopt, 0.0, keep);
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.m = static_cast<int>(m); p.n = static_cast<int>(n); p.k = static_cast<int>(k);
  p.group = static_cast<int>(group); p.layout = static_cast<int>(layout);
  check_launch(onecopy_native::packed_wgmma_launch(p, c10::cuda::getCurrentCUDAStream().stream(),
                                                   static_cast<int>(block_rows)), "packed_wgmma");
  return out;
}

// x [M, K] (bfloat16) @ W^T on Hopper's warpgroup MMA (packed_wgmma.cu), the weight dequantized in registers, any M:
// packed_gemm takes it for the rows it serves (wgmma_serves); the op itself is for the GPU tests and benchmarks.
at::Tensor packed_wgmma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t layout, int64_t group, int64_t block_rows) {
  TORCH_CHECK(block_rows == 0 || block_rows == 64 || block_rows == 128 || block_rows == 256,
              "packed_wgmma: block_rows must be 64, 128 or 256 (0: the kernel picks), got ", block_rows);
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  check_scales(x, qweight, scales, mins, layout, group);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  if (m == 0) return at::empty({0, n}, x.options());
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(onecopy_native::packed_wgmma_supported(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                                     static_cast<int>(layout), static_cast<int>(group)),
              "packed_wgmma: needs compute capability 9.0 (sm_90a), N a multiple of 128 and K of 128, got [", n, ", ",
              k, "]");
  TORCH_CHECK(copyable_weight(qweight, scales, mins),
              "packed_wgmma: qweight, scales and mins must be contiguous and 16-byte aligned");
  return run_wgmma(x, qweight, scales, mins, layout, group, block_rows);
}

// x [M, K] (bfloat16) @ W^T for a tile-ordered packed weight, any M: on Hopper the warpgroup-MMA kernel where it
// serves (wgmma_serves: 33-512 rows), else the packed GEMM where it serves (gemm_plan_for: up to 64 rows, weights of
// many output blocks or, on Hopper, of few with K split), else the weight unpacked to bf16 (one kernel) and cuBLAS.
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, int64_t layout, int64_t group) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  check_scales(x, qweight, scales, mins, layout, group);
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  c10::cuda::CUDAGuard guard(x.device());
  if (wgmma_serves(x, qweight, scales, mins, layout, group)) return run_wgmma(x, qweight, scales, mins, layout, group, 0);
  const auto plan = gemm_plan_for(m, n, k, layout, group, false);
  if (plan.rows == 0 || !copyable_weight(qweight, scales, mins))
    return at::matmul(x, unpack_weight(qweight, scales, mins, layout, group, false).t());
  return std::get<0>(run_gemm(plan, x, qweight, scales, mins, std::nullopt, std::nullopt, std::nullopt, 0.0, false,
                              layout, group, false));
}

// Past kKernelMaxRows rows, where the GEMM does not serve the weight (gemm_plan_for), the weight is unpacked for
// cuBLAS (packed_gemm) between two kernels of packed_gemm.cu with the eager model's roundings: the norm's rows before
// (packed_gemm's own norm kernel), SwiGLU, the residual and the rows' sums of squares after (fold_rows). These were
// ATen ops with fp32 temporaries, ~58 kernels a layer of the 8B shape where these four make 14.
std::tuple<at::Tensor, at::Tensor> packed_linear_by_gemm(const at::Tensor& x, const at::Tensor& qweight,
                                                         const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                                                         const std::optional<at::Tensor>& residual,
                                                         const std::optional<at::Tensor>& norm_weight,
                                                         const std::optional<at::Tensor>& ss, double eps, bool glu,
                                                         int64_t layout, int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), n_out = glu ? qweight.size(0) / 2 : qweight.size(0);
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<at::Tensor> keep;
  at::Tensor xin = x;  // x's rows are copyable_rows: 16-byte aligned, strides multiples of 8
  if (norm_weight.has_value()) {
    onecopy_native::PackedGemmParams np{};
    set_operands(np, x, qweight, scales, mins, std::nullopt, norm_weight, ss, eps, keep);
    xin = at::empty({m, k}, x.options());
    np.xn = xin.data_ptr();
    np.m = static_cast<int>(m); np.k = static_cast<int>(k);
    check_launch(onecopy_native::norm_rows_launch(np, stream), "norm_rows");
  }
  const auto acc = (layout == onecopy_native::kF8r ? fp8_matmul(xin, qweight, scales, false)  // its rows in e4m3
                                                   : packed_gemm(xin, qweight, scales, mins, layout, group))
                       .contiguous();  // bf16, as the eager linear
  const bool fold = glu || residual.has_value();
  at::Tensor res = residual.has_value() ? copyable_rows(*residual) : at::Tensor();
  auto out = fold ? at::empty({m, n_out}, x.options()) : acc;
  auto ss_out = at::empty({m, n_out / 16}, x.options().dtype(at::kFloat));
  onecopy_native::FoldRowsParams fp{};
  fp.acc = acc.data_ptr();
  fp.stride_acc = acc.stride(0);
  fp.res = residual.has_value() ? res.data_ptr() : nullptr;
  fp.stride_r = residual.has_value() ? res.stride(0) : 0;
  fp.out = fold ? out.data_ptr() : nullptr;
  fp.stride_o = out.stride(0);
  fp.ss_out = ss_out.data_ptr<float>();
  fp.m = static_cast<int>(m); fp.n_out = static_cast<int>(n_out); fp.glu = glu;
  check_launch(onecopy_native::fold_rows_launch(fp, stream), "fold_rows");
  return {out, ss_out};
}

// The decode step's packed projection (packed_linear.cu): out [M, N'] and its rows' sums of squares per 16
// outputs [M, N' / 16] (float32), N' = N or N / 2 with `glu`; past kKernelMaxRows rows (unless `invariant`)
// packed_linear_by_gemm.
std::tuple<at::Tensor, at::Tensor> packed_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                                                 const std::optional<at::Tensor>& mins,
                                                 const std::optional<at::Tensor>& residual,
                                                 const std::optional<at::Tensor>& norm_weight,
                                                 const std::optional<at::Tensor>& ss, double eps, bool glu,
                                                 int64_t layout, int64_t group, bool invariant) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  const bool f8r = layout == onecopy_native::kF8r;  // group K (any K a multiple of 64), e4m3 values
  TORCH_CHECK(f8r || (group > 0 && (group & (group - 1)) == 0), "group must be a positive power of two, got ", group);
  TORCH_CHECK(f8r == (qweight.scalar_type() == at::kFloat8_e4m3fn),
              "an f8r weight (layout ", onecopy_native::kF8r, ") is float8_e4m3fn, the others are not; got layout ",
              layout, " with ", qweight.scalar_type());
  TORCH_CHECK(!f8r || !invariant, "f8r weights have no batch-invariant decode (their GEMM quantizes the rows)");
  const auto x = copyable_rows(x_in);  // 8- and 16-byte row loads
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  const int64_t per_byte = layout == onecopy_native::kQ8sMma || f8r ? 1 : 2;
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) * per_byte == k && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.numel() == n * (k / group),
              "qweight [N, K / values per byte] and float32 scales [N, K / group] (contiguous) must match x's K");
  TORCH_CHECK((layout == onecopy_native::kQ4aMma) == mins.has_value(), "mins go with the q4a layout alone");
  TORCH_CHECK(!mins.has_value() || (mins->is_contiguous() && mins->scalar_type() == at::kFloat &&
                                    mins->numel() == scales.numel()),
              "mins must be float32 and contiguous, shaped as the scales");
  // the kernels copy weights, scales and mins 16 bytes at a time (cp.async)
  TORCH_CHECK(aligned16(qweight) && aligned16(scales) && (!mins.has_value() || aligned16(*mins)),
              "packed_linear: qweight, scales and mins must start at 16-byte aligned addresses (a view into a larger "
              "tensor may not): pass a copy (.clone())");
  const int64_t n_out = glu ? n / 2 : n;
  TORCH_CHECK(onecopy_native::packed_linear_supported(static_cast<int>(layout), static_cast<int>(group),
                                                      static_cast<int>(n), static_cast<int>(k)) && n_out % 16 == 0,
              "unsupported packed weight (packed_linear_supported): layout ", layout, ", group ", group, ", [", n, ", ",
              k, "]");
  c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(!f8r || fp8_device(), "f8r weights need an sm_89+ GPU (e4m3 conversions and FP8 tensor cores)");
  if (norm_weight.has_value())
    TORCH_CHECK(ss.has_value() && norm_weight->is_contiguous() && norm_weight->numel() == k &&
                    norm_weight->scalar_type() == at::kBFloat16 && ss->scalar_type() == at::kFloat &&
                    ss->dim() == 2 && ss->size(0) == m && ss->stride(1) == 1,
                "a norm needs its bfloat16 weight [K] and float32 partial sums of squares [M, P]");
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->dim() == 2 && residual->size(0) == m &&
                    residual->size(1) == n_out, "residual must be bfloat16 [M, N]");
  // Past 8 rows the packed GEMM with the same folds where it serves the weight (H200, int4 g128, the 8B shape's fused
  // gate/up weight with its norm and SwiGLU: 16 rows ~42 us against the GEMV's 59, 32 rows 53 against 104; the LM
  // head at 32 rows 195 against 355, bf16 258). A weight of few blocks (K split over a cluster) keeps the GEMV up to
  // 16 rows (H100, int4 g128 at 16 rows, GEMV / GEMM: o 10.7 / 12.8 us, qkv 14.1 (4 tiles a CTA) / 14.6, down 29.8 / 32.8; at 32
  // rows the GEMM: 17.1 / 16.5, 29.6 / 18.1, 49.5 / 42.5). Past kKernelMaxRows (32) the GEMV re-reads each weight
  // tile once per 32 rows: the unpacked weight and cuBLAS. The batch-invariant decode keeps the GEMV.
  // f8r: the GEMV up to fp8_gemv_rows(N) rows, then cuBLAS's FP8 GEMM on the rows quantized to e4m3, the folds around it
  if (f8r && m > onecopy_native::fp8_gemv_rows(n))
    return packed_linear_by_gemm(x, qweight, scales, mins, residual, norm_weight, ss, eps, glu, layout, group);
  if (!f8r && !invariant && wgmma_serves(x, qweight, scales, mins, layout, group))  // folds around it, as around cuBLAS
    return packed_linear_by_gemm(x, qweight, scales, mins, residual, norm_weight, ss, eps, glu, layout, group);
  if (!f8r && !invariant && m > 8) {
    const auto plan = gemm_plan_for(m, n, k, layout, group, glu);
    if (plan.rows > 0 && (plan.k_splits == 1 || m > 16))
      return run_gemm(plan, x, qweight, scales, mins, residual, norm_weight, ss, eps, glu, layout, group, true);
  }
  if (!invariant && m > onecopy_native::kKernelMaxRows)
    return packed_linear_by_gemm(x, qweight, scales, mins, residual, norm_weight, ss, eps, glu, layout, group);
  auto out = at::empty({m, n_out}, x.options());
  auto ss_out = at::empty({m, n_out / 16}, x.options().dtype(at::kFloat));
  onecopy_native::PackedLinearParams p{};
  std::vector<at::Tensor> keep;
  set_operands(p, x, qweight, scales, mins, residual, norm_weight, ss, eps, keep);
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.ss_out = ss_out.data_ptr<float>();
  p.m = static_cast<int>(m); p.n_out = static_cast<int>(n_out); p.k = static_cast<int>(k);
  p.group = static_cast<int>(group); p.layout = static_cast<int>(layout); p.glu = glu; p.invariant = invariant;
  check_launch(onecopy_native::packed_linear_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "packed_linear");
  return {out, ss_out};
}

// The quantize_rows kernel's parameters for x's rows (the caller's `fp8_matmul` made x's strides the kernel's:
// unit inner stride, rows 8 values apart); whether it takes them: K a multiple of 8 and an aligned start.
onecopy_native::QuantizeRowsParams rows_params(const at::Tensor& x, int64_t k, bool glu) {
  onecopy_native::QuantizeRowsParams qp{};
  qp.x = x.data_ptr();
  qp.stride_x = x.stride(0);
  qp.m = static_cast<int>(x.size(0)); qp.k = static_cast<int>(k);
  qp.bf16 = x.scalar_type() == at::kBFloat16;
  qp.glu = glu;
  return qp;
}
bool kernel_takes_rows(const at::Tensor& x, int64_t k) { return k % 8 == 0 && aligned16(x); }

// x's rows [M, K] (bf16/fp16), or with `glu` the SwiGLU rows of a gate/up output x [M, 2K], quantized to e4m3 as
// models/packed.py's quantize_rows does, with their float32 scales [M, 1]: one kernel where it takes the rows,
// else ATen's ops.
std::pair<at::Tensor, at::Tensor> quantized_rows(const at::Tensor& x, int64_t k, bool glu) {
  if (!kernel_takes_rows(x, k) || (glu && k > onecopy_native::kGluMaxK)) {
    auto xf = (glu ? at::silu(x.narrow(1, 0, k)) * x.narrow(1, k, k) : x).to(at::kFloat);
    auto s = xf.abs().amax({-1}, true).clamp_min(1e-12) / 448.0;
    return {(xf / s).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn), s};
  }
  auto q = at::empty({x.size(0), k}, x.options().dtype(at::kFloat8_e4m3fn));
  auto s = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  auto qp = rows_params(x, k, glu);
  qp.q = q.data_ptr();
  qp.scales = s.data_ptr<float>();
  check_launch(onecopy_native::quantize_rows_launch(qp, c10::cuda::getCurrentCUDAStream().stream()), "quantize_rows");
  return {q, s};
}

// The SwiGLU rows of a gate/up output x [M, 2K] in x's dtype (the FP8 kernel's input): one kernel where it takes them.
at::Tensor glu_rows(const at::Tensor& x, int64_t k) {
  if (!kernel_takes_rows(x, k)) return at::silu(x.narrow(1, 0, k)) * x.narrow(1, k, k);
  auto out = at::empty({x.size(0), k}, x.options());
  auto qp = rows_params(x, k, true);
  qp.out = out.data_ptr();
  qp.stride_o = out.stride(0);
  check_launch(onecopy_native::quantize_rows_launch(qp, c10::cuda::getCurrentCUDAStream().stream()), "glu_rows");
  return out;
}

// x [M, K] times an FP8 weight [N, K] (e4m3, a float32 scale per output feature): up to fp8_gemv_rows(N) bf16 rows
// the packed GEMV (layout kF8r: bf16 rows against the exact bf16 of each e4m3 value, the feature's scale after the
// sums); more rows, or fp16 ones, quantized to e4m3 as models/packed.py's quantize_rows does (one kernel) for
// torch._scaled_mm (cuBLAS's FP8 GEMM). With `glu` x is a gate/up output [M, 2K] and the rows are its SwiGLU
// (fp8_glu_linear: made in one kernel for the GEMV, made and quantized in one for the GEMM).
at::Tensor fp8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws, bool glu) {
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
                  w.scalar_type() == at::kFloat8_e4m3fn && w.dim() == 2 && x.size(1) == (glu ? 2 * k : k) &&
                  ws.scalar_type() == at::kFloat && ws.numel() == n,
              glu ? "fp8_glu_linear takes a bf16/fp16 gate/up output [M, 2K] and an e4m3 weight [N, K] with float32 "
                    "scales [N]"
                  : "fp8_linear takes bf16/fp16 rows [M, K] and an e4m3 weight [N, K] with float32 scales [N]");
  c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.stride(1) == 1 && x.stride(0) % 8 == 0 ? x : x.contiguous();
  const bool gemv = m <= onecopy_native::fp8_gemv_rows(n) && x.scalar_type() == at::kBFloat16 && fp8_device() &&
                    onecopy_native::packed_linear_supported(onecopy_native::kF8r, static_cast<int>(k),
                                                            static_cast<int>(n), static_cast<int>(k));
  if (!gemv) {
    auto [q, s] = quantized_rows(xc, k, glu);
    return at::_scaled_mm(q, w.t(), s, ws.reshape({1, n}), std::nullopt, std::nullopt, x.scalar_type());
  }
  xc = copyable_rows(glu ? glu_rows(xc, k) : xc);
  auto wc = w.is_contiguous() && aligned16(w) ? w : w.contiguous().clone();
  auto wsc = ws.is_contiguous() && aligned16(ws) ? ws : ws.contiguous().clone();
  auto out = at::empty({m, n}, x.options());
  onecopy_native::PackedLinearParams p{};
  p.x = xc.data_ptr();
  p.stride_x = xc.stride(0);
  p.w = wc.data_ptr();
  p.s = wsc.data_ptr<float>();
  p.out = out.data_ptr();
  p.stride_o = out.stride(0);
  p.m = static_cast<int>(m); p.n_out = static_cast<int>(n); p.k = static_cast<int>(k);
  p.group = static_cast<int>(k); p.layout = onecopy_native::kF8r;  // no folds, no sums of squares (ss_out null)
  check_launch(onecopy_native::packed_linear_launch(p, c10::cuda::getCurrentCUDAStream().stream()), "fp8_linear");
  return out;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws) { return fp8_matmul(x, w, ws, false); }

// w2's product in a SwiGLU MLP: x [M, 2K] the gate/up GEMM's output, silu(gate) * up quantized in one pass.
at::Tensor fp8_glu_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ws) {
  return fp8_matmul(x, w, ws, true);
}

}  // namespace

TORCH_LIBRARY(onecopy_native, m) {
  m.def("paged_decode_q8(Tensor q, Tensor k_pool, Tensor v_pool, Tensor k_scale, Tensor v_scale, Tensor table, "
        "Tensor rows, Tensor lengths, SymInt splits, int block) -> Tensor");
  m.def("paged_decode_rope_q8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor table, Tensor rows, Tensor lengths, SymInt splits, "
        "int block) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? residual, Tensor? norm_weight, "
        "Tensor? ss, float eps, bool glu, int layout, int group, bool invariant=False) -> (Tensor, Tensor)");
  m.def("unpack_weight(Tensor qweight, Tensor scales, Tensor? mins, int layout, int group, bool half) -> Tensor");
  m.def("packed_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int layout, int group) -> Tensor");
  m.def("packed_wgmma(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int layout, int group, int block_rows=0) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor w, Tensor ws) -> Tensor");
  m.def("fp8_glu_linear(Tensor x, Tensor w, Tensor ws) -> Tensor");
}

TORCH_LIBRARY_IMPL(onecopy_native, CUDA, m) {
  m.impl("paged_decode_q8", &paged_decode_q8);
  m.impl("paged_decode_rope_q8", &paged_decode_rope_q8);
  m.impl("packed_linear", &packed_linear);
  m.impl("unpack_weight", &unpack_weight);
  m.impl("packed_gemm", &packed_gemm);
  m.impl("packed_wgmma", &packed_wgmma);
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_glu_linear", &fp8_glu_linear);
}
