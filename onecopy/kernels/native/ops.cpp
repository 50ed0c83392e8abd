// The torch.ops.onecopy_native ops: the 8-bit paged decode attention of decode_q8.cu, with and without the
// RoPE + quantize + cache write of the new position. AOTInductor packages call them by name through their
// proxy executor, so a process that loads such a package loads this library first (kernels/native/__init__.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "decode_q8.h"

namespace {

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
  at::Tensor c, s;
  if (new_kv) {
    c = cos->contiguous();
    s = sin->contiguous();
    TORCH_CHECK(c.scalar_type() == q.scalar_type() && s.scalar_type() == q.scalar_type() && c.size(-1) == d,
                "cos and sin must be [B, D] in q's dtype");
  }
  onecopy_native::DecodeQ8Params p{};
  p.q = q.data_ptr();
  p.stride_qb = q.stride(0);
  p.stride_qh = new_kv ? d : q.stride(1);
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

}  // namespace

TORCH_LIBRARY(onecopy_native, m) {
  m.def("paged_decode_q8(Tensor q, Tensor k_pool, Tensor v_pool, Tensor k_scale, Tensor v_scale, Tensor table, "
        "Tensor rows, Tensor lengths, SymInt splits, int block) -> Tensor");
  m.def("paged_decode_rope_q8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor table, Tensor rows, Tensor lengths, SymInt splits, "
        "int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(onecopy_native, CUDA, m) {
  m.impl("paged_decode_q8", &paged_decode_q8);
  m.impl("paged_decode_rope_q8", &paged_decode_rope_q8);
}
