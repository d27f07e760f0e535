// specpipe_cpu::inverse_cdf: the CPU kernel of `specpipe::inverse_cdf`; plugins/inverse_cdf.py
// has the contract and the plain-torch reference this is tested against
// (tests/plugins/test_inverse_cdf.py: the same tokens, bit for bit).
//
// Per row of `probs [M, V]` (non-negative, not necessarily normalised) and its uniform
// `u [M]`: the token i with cdf[i-1] <= u * total < cdf[i], the running sums in fp64 in
// the order torch's cumsum takes (so the same sums to the bit), and where u * total
// rounds up to the total, the last token of non-zero probability. One pass over a row
// (its running sums) and a binary search, where the torch form costs ~8 small ops (a copy to fp64, the
// cumsum, searchsorted, a host sync for the rounding case): ~25-60 us at 1-8 rows of
// 8192 tokens, paid by every sampled token of the engine (auto-regression, bonus tokens,
// drafts drawn one per node, rejection re-draws).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "inverse_cdf.h"

namespace {

at::Tensor inverse_cdf(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous(),
              "specpipe_cpu::inverse_cdf takes contiguous fp32 CPU probs [M, V]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.dim() == 1 && u.size(0) == probs.size(0),
              "u must be contiguous float64 [M] = [", probs.size(0), "]");
  const int64_t M = probs.size(0), V = probs.size(1);
  TORCH_CHECK(V >= 1, "probs must have at least one token per row");
  auto tokens = at::empty({M}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* t = tokens.data_ptr<int64_t>();
  at::parallel_for(0, M, 2, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(V);
    for (int64_t m = begin; m < end; ++m) t[m] = specpipe::draw_row(p + m * V, up[m], V, cdf);
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) { m.def("inverse_cdf(Tensor probs, Tensor u) -> Tensor"); }

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("inverse_cdf", &inverse_cdf); }
