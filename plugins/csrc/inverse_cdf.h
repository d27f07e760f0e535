// One draw by inverse CDF, shared by `specpipe_cpu::inverse_cdf` (inverse_cdf_cpu.cpp) and
// the draft LM's sampled chains (llama_forward_cpu.cpp), so both draw the same token from
// the same row and uniform, bit for bit; and the law a temperature alone makes of a row of
// logits, shared by those chains' draft laws and the target laws of sampled chain
// verification (chain_verify_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace specpipe {

// softmax(row / T) of `row [V]` fp32 into `out [V]`, as `runtime.sampling.target_probs`
// computes it for a temperature alone (`at::softmax` of the row divided by T: `at::_softmax`,
// which it calls; no division at T = 1, where x / 1 is x), so the same bits. `scaled` is
// scratch for row / T, allocated where it does not hold V values.
inline void temperature_law(at::Tensor out, const float* row, int64_t V, double temperature, at::Tensor& scaled) {
  at::Tensor logits = at::from_blob(const_cast<float*>(row), {V}, out.options());
  if (temperature != 1.0) {
    if (!scaled.defined() || scaled.numel() != V) scaled = at::empty({V}, out.options());
    logits = at::div_out(scaled, logits, temperature);
  }
  at::_softmax_out(out, logits, 0, false);
}

// The token i of `p [V]` (non-negative, not necessarily normalised) with
// cdf[i-1] <= u * total < cdf[i], the running sums in fp64 in the order torch's cumsum
// takes (so the same sums to the bit); where u * total rounds up to the total, the last
// token of non-zero probability. `cdf` is scratch of at least V entries.
inline int64_t draw_row(const float* p, double u, int64_t V, std::vector<double>& cdf) {
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    total += static_cast<double>(p[i]);
    cdf[i] = total;
  }
  const auto end = cdf.begin() + V;
  const int64_t token = std::upper_bound(cdf.begin(), end, u * total) - cdf.begin();  // searchsorted, right=True
  if (token < V) return token;
  int64_t last = V - 1;  // u * total rounded up to the total: the last token with mass
  while (last > 0 && !(p[last] > 0.0f)) --last;
  return last;
}

}  // namespace specpipe
