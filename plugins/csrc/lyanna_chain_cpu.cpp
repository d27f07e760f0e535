// specpipe_cpu::lyanna_chain: Lyanna's drafter chain (one decoder layer on int8 linears, k
// sequential steps over a per-call KV) in one call; plugins/lyanna_chain.py has the contract,
// and `LyannaDrafter.draft_chain` (model_defs/lyanna.py) is its reference
// (tests/plugins/test_lyanna_chain.py: the same hidden states to int8 rounding).
//
// Per step i = 1..k ("Make Every Draft Count" §4: h_{i+1} = norm(Layer(h_i)); the Llama
// layer of Touvron et al. 2023, pre-norm, SwiGLU, RoPE at position i):
//   a = RMSNorm(x);  q, k, v = a W_qkv;  RoPE on q, k;  k, v appended to the chain's KV
//   x = x + Attn(q, K_1..i, V_1..i) W_o                    each query sees the whole chain so far
//   x = x + (SiLU(a' W_gate) * a' W_up) W_down, a' = RMSNorm(x)
//   h_i = x = RMSNorm_final(x)                             the next step's input
// The products are `specpipe::int8_linear` (int8_linear.h), the rest plain loops
// (llama_loops.h): what it saves is ~25 small ATen ops and the Python between them per step.
// Only proposals depend on it (verification is the target's).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "int8_linear.h"
#include "llama_loops.h"

namespace {

// In place, every head of `x` [B, heads * D] at one position: x * cos + rotate_half(x) * sin,
// rotate_half(x) = (-x[D/2:], x[:D/2]) (`model_defs.rope.apply_rope`); cos, sin [D].
void rope(float* x, int64_t B, int64_t stride, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  std::vector<float> u(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      float* r = x + b * stride + h * D;
      std::copy(r, r + D, u.begin());
      for (int64_t j = 0; j < half; ++j) {
        r[j] = u[j] * cos[j] - u[j + half] * sin[j];
        r[j + half] = u[j + half] * cos[j + half] + u[j] * sin[j + half];
      }
    }
}

at::Tensor lyanna_chain(const at::Tensor& x1, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                        at::TensorList weights, at::TensorList blocked, at::TensorList scales, at::TensorList sums,
                        int64_t num_heads, int64_t num_kv_heads, double eps) {
  TORCH_CHECK(x1.dim() == 2 && x1.scalar_type() == at::kFloat, "x1 must be [B, E] float32 (the fused first input)");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos and sin must be [k, head_dim] float32 (RoPE at positions 1..k)");
  TORCH_CHECK(norms.size() == 3, "three norms: input, post-attention, final");
  TORCH_CHECK(weights.size() == 4 && blocked.size() == 4 && scales.size() == 4 && sums.size() == 4,
              "four int8 linears: qkv (stacked), o, gate_up (stacked), down");
  for (size_t i = 0; i < 4; ++i) specpipe::check_int8_weight(weights[i], blocked[i], scales[i], sums[i]);
  const int64_t B = x1.size(0), E = x1.size(1), K = cos.size(0), D = cos.size(1), H = num_heads, G = num_kv_heads;
  TORCH_CHECK(K >= 1 && D % 2 == 0 && H >= 1 && G >= 1 && H % G == 0, "need k >= 1, an even head_dim, heads a multiple of kv heads");
  TORCH_CHECK(weights[0].size(0) == (H + 2 * G) * D && weights[1].size(1) == H * D,
              "qkv must give (heads + 2 kv heads) x head_dim outputs and o take heads x head_dim");
  const specpipe::Int8Linears linear{weights, blocked, scales, sums};
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor keys = at::empty({B, G, K, D}, x1.options()), values = at::empty({B, G, K, D}, x1.options());
  at::Tensor states = at::empty({B, K, E}, x1.options());
  at::Tensor x = x1.contiguous().clone();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> p(K);
  for (int64_t i = 0; i < K; ++i) {
    at::Tensor qkv = linear(0, specpipe::rms_norm(x, norms[0], eps));  // [B, (H + 2G) D]
    float* a = qkv.data_ptr<float>();
    const int64_t width = (H + 2 * G) * D;
    rope(a, B, width, H + G, D, c.data_ptr<float>() + i * D, s.data_ptr<float>() + i * D);  // q and k heads
    at::Tensor attended = at::empty({B, H * D}, x1.options());
    float* out = attended.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t g = 0; g < G; ++g) {  // this step's key and value join the chain's KV
        std::copy(a + b * width + (H + g) * D, a + b * width + (H + g + 1) * D, kp + ((b * G + g) * K + i) * D);
        std::copy(a + b * width + (H + G + g) * D, a + b * width + (H + G + g + 1) * D, vp + ((b * G + g) * K + i) * D);
      }
      for (int64_t h = 0; h < H; ++h) {  // softmax(q K^T / sqrt(D)) V over entries 0..i of its kv head
        const float* q = a + b * width + h * D;
        const float* kh = kp + (b * G + h / (H / G)) * K * D;
        const float* vh = vp + (b * G + h / (H / G)) * K * D;
        float top = -INFINITY;
        for (int64_t t = 0; t <= i; ++t) {
          float dot = 0.0f;
          for (int64_t j = 0; j < D; ++j) dot += q[j] * kh[t * D + j];
          p[t] = dot * scale;
          top = std::max(top, p[t]);
        }
        float total = 0.0f;
        for (int64_t t = 0; t <= i; ++t) total += (p[t] = std::exp(p[t] - top));
        float* o = out + b * H * D + h * D;
        std::fill(o, o + D, 0.0f);
        for (int64_t t = 0; t <= i; ++t)
          for (int64_t j = 0; j < D; ++j) o[j] += p[t] / total * vh[t * D + j];
      }
    }
    specpipe::add_into(x, linear(1, attended));
    specpipe::add_into(x, linear(3, specpipe::silu_times_up(linear(2, specpipe::rms_norm(x, norms[1], eps)))));
    x = specpipe::rms_norm(x, norms[2], eps);
    states.select(1, i).copy_(x);
  }
  return states;
}

// specpipe_cpu::lyanna_draft: the chain's fused first input, then the chain (`lyanna_chain`):
//   x_1 = [h0, E(t_1)] W_fuse + b_fuse        (E(t_1) left out where `embed` is empty: no first-token fusion)
// with the same int8 product and fp32 bias add as `Linear.product` (`plugins.cpu_linear.int8_linear`),
// so x_1 has the bits the Python path gives it. What it saves is a gather, a concatenation
// and the Linear's call (~100 us of a batch-1 chain after a 48 MB read, 2-core EPYC).
at::Tensor lyanna_draft(const at::Tensor& h0, const at::Tensor& tokens, const at::Tensor& embed,
                        const at::Tensor& fuse_weight, const at::Tensor& fuse_blocked, const at::Tensor& fuse_scale,
                        const at::Tensor& fuse_sum, const at::Tensor& fuse_bias, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList norms, at::TensorList weights, at::TensorList blocked,
                        at::TensorList scales, at::TensorList sums, int64_t num_heads, int64_t num_kv_heads,
                        double eps) {
  TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat && h0.device().is_cpu(), "h0 must be [B, D] float32");
  const bool fusion = embed.numel() > 0;
  const int64_t B = h0.size(0), Dt = h0.size(1), De = fusion ? embed.size(1) : 0;
  if (fusion) {
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat, "embed must be [V, D] float32");
    TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == B && tokens.scalar_type() == at::kLong, "one int64 token per row");
  }
  specpipe::check_int8_weight(fuse_weight, fuse_blocked, fuse_scale, fuse_sum);
  TORCH_CHECK(fuse_weight.size(1) == Dt + De, "the fuse linear takes ", fuse_weight.size(1), " inputs, got ", Dt + De);
  TORCH_CHECK(fuse_bias.dim() == 1 && fuse_bias.size(0) == fuse_weight.size(0) && fuse_bias.scalar_type() == at::kFloat,
              "fuse_bias must be [D] float32");
  at::Tensor x = at::empty({B, Dt + De}, h0.options());
  const at::Tensor h = h0.contiguous();
  float* xp = x.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const at::Tensor e = fusion ? embed.contiguous() : embed;
  const at::Tensor t = fusion ? tokens.contiguous() : tokens;
  for (int64_t b = 0; b < B; ++b) {
    std::copy(hp + b * Dt, hp + (b + 1) * Dt, xp + b * (Dt + De));
    if (fusion) {
      const int64_t token = t.data_ptr<int64_t>()[b];
      TORCH_CHECK(token >= 0 && token < e.size(0), "row ", b, ": token out of range");
      const float* row = e.data_ptr<float>() + token * De;
      std::copy(row, row + De, xp + b * (Dt + De) + Dt);
    }
  }
  at::Tensor x1 = specpipe::int8_linear(x, fuse_weight, fuse_blocked, fuse_scale, fuse_sum);
  const at::Tensor bias = fuse_bias.contiguous();
  float* yp = x1.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t O = x1.size(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t o = 0; o < O; ++o) yp[b * O + o] += bp[o];
  return lyanna_chain(x1, cos, sin, norms, weights, blocked, scales, sums, num_heads, num_kv_heads, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "lyanna_chain(Tensor x1, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor[] blocked, "
      "Tensor[] scales, Tensor[] sums, int num_heads, int num_kv_heads, float eps) -> Tensor");
  m.def(
      "lyanna_draft(Tensor h0, Tensor tokens, Tensor embed, Tensor fuse_weight, Tensor fuse_blocked, "
      "Tensor fuse_scale, Tensor fuse_sum, Tensor fuse_bias, Tensor cos, Tensor sin, Tensor[] norms, "
      "Tensor[] weights, Tensor[] blocked, Tensor[] scales, Tensor[] sums, int num_heads, int num_kv_heads, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) {
  m.impl("lyanna_chain", &lyanna_chain);
  m.impl("lyanna_draft", &lyanna_draft);
}
