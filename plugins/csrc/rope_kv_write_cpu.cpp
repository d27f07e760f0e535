// specpipe_cpu::rope_kv_write: the CPU kernel of `specpipe::rope_kv_write`; plugins/kv_write.py
// has the contract and the plain-torch reference this is tested against bit for bit
// (tests/plugins/test_kv_write.py).
//
// One layer's fused q/k/v projection `qkv [N, (H + 2 H_kv) D]` (a row: H query heads, then
// H_kv key heads, then H_kv value heads) becomes the rotated queries `[N, H, D]`, returned,
// while the rotated keys and the values go straight to their cache slots. RoPE with the
// half rotation of HF Llama (Su et al. 2021, eq. 34, in the layout transformers uses): for
// i < D/2,
//   y_i       = x_i       cos_i       - x_{i+D/2} sin_i
//   y_{i+D/2} = x_{i+D/2} cos_{i+D/2} + x_i       sin_{i+D/2}
// each product rounded, then the sum: what `x * cos + rotate_half(x) * sin` computes in
// torch, so the results are the same bits. Contraction into fused multiply-adds would round
// once instead of twice, hence fp-contract=off for this file.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

inline void rotate(const float* x, const float* cos, const float* sin, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i + half] * sin[i];
    y[i] = a - b;
  }
  for (int64_t i = half; i < D; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i - half] * sin[i];
    y[i] = a + b;
  }
}

at::Tensor rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "specpipe_cpu::rope_kv_write takes fp32 CPU tensors");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "contiguous qkv [N, (H + 2 H_kv) D], cos/sin [N, D] and int64 slots [N]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2),
              "caches [slots, H_kv, D] with dense [H_kv, D] slots, both one layout");
  const int64_t N = qkv.size(0), H = num_heads, H_kv = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * H_kv) * D, "qkv has ", qkv.size(1), " features, expected (",
              H, " + 2 x ", H_kv, ") x ", D);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == N && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos and sin must be [N, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == N, "one slot per row");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)  // raw writes below: every slot must be in range
    TORCH_CHECK(sl[n] >= 0 && sl[n] < k_cache.size(0), "slot ", sl[n], " out of range for ", k_cache.size(0), " slots");
  auto q = at::empty({N, H, D}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  const int64_t row = qkv.size(1), slot_stride = k_cache.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* xn = x + n * row;
      const float* cn = c + n * D;
      const float* sn = s + n * D;
      for (int64_t h = 0; h < H; ++h) rotate(xn + h * D, cn, sn, qp + (n * H + h) * D, D);
      float* kn = kp + sl[n] * slot_stride;
      for (int64_t h = 0; h < H_kv; ++h) rotate(xn + (H + h) * D, cn, sn, kn + h * D, D);
      std::memcpy(vp + sl[n] * slot_stride, xn + (H + H_kv) * D, sizeof(float) * H_kv * D);
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("rope_kv_write", &rope_kv_write); }
