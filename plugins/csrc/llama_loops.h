// Plain loops of a Llama layer between its products, shared by the C++ forwards
// (llama_forward_cpu.cpp, lyanna_chain_cpu.cpp): each replaces several small ATen ops
// (fp32 RMSNorm alone is six, ~30 us a call) with one pass over dense fp32 rows, a vector of
// the CPU's width at a time (lanes.h): scalar, the SiLU's expf and the norms' serial sums
// were ~0.6 ms of a demo-target forward of 5 rows.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lanes.h"

namespace specpipe {

// Elements of a loop's work per thread below which its rows stay on one thread: a
// decoding step's few rows are faster without the fork, a prompt chunk's hundreds are not
// (a 224-token prefill of the demo target spent ~3.1 ms of its ~24 in the forward op's own
// code, mostly these loops, on one thread; split, 2.1-2.9). Rows are independent, so the
// split changes no result.
constexpr int64_t kLoopGrain = 16384;

// f(r0, r1) over rows [0, N) of E elements each: on ATen's threads where there is work enough.
template <typename F>
inline void by_row_blocks(int64_t N, int64_t E, const F& f) {
  at::parallel_for(0, N, std::max<int64_t>(1, kLoopGrain / std::max<int64_t>(E, 1)), f);
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row: x [N, E] dense. The sum of squares in
// kWide partial sums (lane l: elements l, l + kWide, ...), then across lanes, then the tail.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  using specpipe_lanes::kWide;
  using specpipe_lanes::load_w;
  using specpipe_lanes::vw;
  const int64_t N = x.size(0), E = x.size(1), body = E / kWide * kWide;
  TORCH_CHECK(w.numel() == E && w.is_contiguous() && w.scalar_type() == at::kFloat, "a norm's weight must be [", E, "]");
  at::Tensor y = at::empty({N, E}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  by_row_blocks(N, E, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* xr = xp + n * E;
      float* yr = yp + n * E;
      vw partial = {};
      for (int64_t i = 0; i < body; i += kWide) {
        const vw v = load_w(xr + i);
        partial += v * v;
      }
      float squares = 0.0f;
      for (int l = 0; l < kWide; ++l) squares += partial[l];
      for (int64_t i = body; i < E; ++i) squares += xr[i] * xr[i];
      const float r = 1.0f / std::sqrt(squares / static_cast<float>(E) + static_cast<float>(eps));
      for (int64_t i = 0; i < E; ++i) yr[i] = xr[i] * r * wp[i];
    }
  });
  return y;
}

// x += y, both [N, E] dense.
inline void add_into(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), kLoopGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) xp[i] += yp[i];
  });
}

// SwiGLU's inner activation: gate_up [N, 2I] (gate columns, then up) -> SiLU(gate) * up [N, I].
// SiLU(g) = g sigmoid(g), with t = exp(-|g|) (lanes.h's exp, ~2 ulp): sigmoid(g) = 1 / (1 + t)
// for g >= 0 and t / (1 + t) below, so the exp never overflows.
inline at::Tensor silu_times_up(const at::Tensor& gate_up) {
  using specpipe_lanes::iw;
  using specpipe_lanes::kWide;
  using specpipe_lanes::load_w;
  using specpipe_lanes::store_w;
  using specpipe_lanes::vw;
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2, body = I / kWide * kWide;
  at::Tensor h = at::empty({N, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  by_row_blocks(N, I, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* gate = g + n * 2 * I;
      const float* up = gate + I;
      float* out = hp + n * I;
      for (int64_t i = 0; i < body; i += kWide) {
        const vw x = load_w(gate + i);
        const vw t = specpipe_lanes::exp_nonpositive<vw, iw>(x < 0.0f ? x : -x);
        const vw sigmoid = (x < 0.0f ? t : vw{} + 1.0f) / (1.0f + t);
        store_w(out + i, x * sigmoid * load_w(up + i));
      }
      for (int64_t i = body; i < I; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return h;
}

}  // namespace specpipe
