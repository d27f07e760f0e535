// Plain loops of a Llama layer between its products, shared by the C++ drafter forwards
// (draft_lm_forward_cpu.cpp, lyanna_chain_cpu.cpp): each replaces several small ATen ops
// (fp32 RMSNorm alone is six, ~30 us a call) with one pass over dense fp32 rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

namespace specpipe {

// y = x / sqrt(mean(x^2) + eps) * w, row by row: x [N, E] dense.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), E = x.size(1);
  TORCH_CHECK(w.numel() == E && w.is_contiguous() && w.scalar_type() == at::kFloat, "a norm's weight must be [", E, "]");
  at::Tensor y = at::empty({N, E}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * E;
    float* yr = yp + n * E;
    float squares = 0.0f;
    for (int64_t i = 0; i < E; ++i) squares += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(squares / static_cast<float>(E) + static_cast<float>(eps));
    for (int64_t i = 0; i < E; ++i) yr[i] = xr[i] * r * wp[i];
  }
  return y;
}

// x += y, both [N, E] dense.
inline void add_into(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] += yp[i];
}

// SwiGLU's inner activation: gate_up [N, 2I] (gate columns, then up) -> SiLU(gate) * up [N, I].
inline at::Tensor silu_times_up(const at::Tensor& gate_up) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor h = at::empty({N, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) {
      const float gate = g[n * 2 * I + i];
      hp[n * I + i] = gate / (1.0f + std::exp(-gate)) * g[n * 2 * I + I + i];
    }
  return h;
}

}  // namespace specpipe
