// specpipe_cpu::gumbel_top_k: the CPU kernel of `specpipe::gumbel_top_k`; plugins/gumbel_top_k.py
// has the contract and the plain-torch reference this is tested against
// (tests/plugins/test_gumbel_top_k.py: the same tokens, values within a few ulps).
//
// Per row of `probs [M, V]` (a law, not necessarily normalised) and its uniforms `u [M, 2k]`,
// the k largest of log p_x + G_x (G: Gumbel(0) per token) drawn top-down (Maddison et al.
// 2014; Kool et al. 2019): the j-th is the token at `u[2j] * (mass left)` on the line of
// the tokens not drawn yet (inverse CDF over one running sum, stepping over the drawn
// tokens' intervals), its value Gumbel(log mass left) truncated at the (j-1)-th value:
//   g_j = mu_j - log(exp(mu_j - g_(j-1)) + E_j),   mu_j = log(mass left),  E_j = -log u[2j+1].
// Rows past their last token of non-zero probability get token -1 and value -inf. One pass
// per row instead of V uniforms per row, the cost of the torch form at a handful of rows
// being its ~50 small ops a draw.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr double kTiny = std::numeric_limits<double>::min();

// The first index i with cdf[i] > x (torch.searchsorted(..., right=True)); V if none.
inline int64_t upper_index(const double* cdf, int64_t V, double x) {
  return std::upper_bound(cdf, cdf + V, x) - cdf;
}

// log(exp(a) + exp(b)) as torch.logaddexp computes it for doubles.
inline double logaddexp(double a, double b) {
  if (std::isinf(a) && a == b) return a;
  const double m = std::max(a, b);
  return m + std::log1p(std::exp(-std::abs(a - b)));
}

void draw_row(const float* p, const double* u, int64_t V, int64_t k, std::vector<double>& cdf,
              std::vector<double>& rest, int64_t* tokens, double* values) {
  double total = 0.0;
  int64_t support = 0;
  for (int64_t i = 0; i < V; ++i) {
    total += static_cast<double>(p[i]);
    cdf[i] = total;
    support += p[i] != 0.0f;
  }
  double taken = 0.0, upper = std::numeric_limits<double>::infinity();
  std::vector<int64_t> drawn;
  for (int64_t j = 0; j < k; ++j) {
    if (j >= support || j >= V) {
      tokens[j] = -1;
      values[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double mass = std::max(total - taken, kTiny);
    double x = u[2 * j] * mass;
    std::vector<int64_t> sorted(drawn);
    std::sort(sorted.begin(), sorted.end());
    for (int64_t r : sorted) {
      const double start = r > 0 ? cdf[r - 1] : 0.0;
      if (x >= start) x = x + (cdf[r] - start);
    }
    int64_t token = upper_index(cdf.data(), V, x);
    if (token >= V || std::find(drawn.begin(), drawn.end(), token) != drawn.end()) {
      // rounding past the end or onto a drawn interval's edge: inverse CDF over the rest
      double run = 0.0;
      for (int64_t i = 0; i < V; ++i) {
        const bool gone = std::find(drawn.begin(), drawn.end(), i) != drawn.end();
        run += gone ? 0.0 : static_cast<double>(p[i]);
        rest[i] = run;
      }
      token = upper_index(rest.data(), V, u[2 * j] * run);
      if (token >= V) {  // u * total rounded up to the total: the last token with mass
        token = V - 1;
        while (token > 0 && (p[token] == 0.0f || std::find(drawn.begin(), drawn.end(), token) != drawn.end()))
          --token;
      }
      mass = run;
    }
    const double mu = std::log(mass);
    const double g = mu - logaddexp(mu - upper, std::log(-std::log(std::max(u[2 * j + 1], kTiny))));
    tokens[j] = token;
    values[j] = g;
    taken = taken + (cdf[token] - (token > 0 ? cdf[token - 1] : 0.0));
    upper = g;
    drawn.push_back(token);
  }
}

std::tuple<at::Tensor, at::Tensor> gumbel_top_k(const at::Tensor& probs, const at::Tensor& uniforms, int64_t k) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous(),
              "specpipe_cpu::gumbel_top_k takes contiguous fp32 CPU probs [M, V]");
  TORCH_CHECK(k >= 1, "k must be >= 1, got ", k);
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.dim() == 2 &&
                  uniforms.size(0) == probs.size(0) && uniforms.size(1) == 2 * k,
              "uniforms must be contiguous float64 [M, 2k] = [", probs.size(0), ", ", 2 * k, "]");
  const int64_t M = probs.size(0), V = probs.size(1);
  auto tokens = at::empty({M, k}, probs.options().dtype(at::kLong));
  auto values = at::empty({M, k}, probs.options().dtype(at::kDouble));
  const float* p = probs.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* t = tokens.data_ptr<int64_t>();
  double* v = values.data_ptr<double>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(V), rest(V);
    for (int64_t m = begin; m < end; ++m) draw_row(p + m * V, u + m * 2 * k, V, k, cdf, rest, t + m * k, v + m * k);
  });
  return {tokens, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def("gumbel_top_k(Tensor probs, Tensor uniforms, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("gumbel_top_k", &gumbel_top_k); }
