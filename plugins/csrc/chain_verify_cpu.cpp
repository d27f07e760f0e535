// specpipe_cpu::verify_sampled_chains: recursive rejection sampling down chains (one child a
// node) whose warp is a temperature alone, every chain of a step in one call;
// plugins/chain_verify.py has the contract, and the walk it replaces (runtime/verify.py:
// `_walk_tree` over `_tree_laws`'s laws) is its reference (tests/plugins/test_chain_verify.py:
// the same accepted paths and bonus tokens, bit for bit).
//
// Chain b, target logits [N, V] at its nodes, draft laws p [N, V] (row 0 the root's; absent:
// every draft a point mass, p = delta_x), temperature T, one uniform u_c a node (fp32, as
// `torch.rand` draws them) and one for the bonus (fp64):
//   q = softmax(logits[0] / T)                                  the target law at the root
//   for c = 1 .. N-1: x = token c
//     accept c if u_c < min(1, q(x) / p_c(x))                  (RSD eq. 3; fp32 quotient)
//       then q = softmax(logits[c] / T)
//     else q = norm([q - p_c]^+) and stop                       (RSD eq. 4: c had no sibling)
//   bonus = inverse CDF of q at the bonus uniform               (`specpipe::draw_row`)
// The laws are the Python walk's, bit for bit: its softmax and sums are the same ATen calls on
// the same rows, its elementwise steps (the residual's difference, clamp and division: IEEE
// operations) plain loops. What it saves is the walk's Python (~0.25 ms a step for one chain
// of five drafts), the laws of nodes past the first rejection, which the walk's table
// computed anyway, and ATen calls: ~7 us each with the caches a forward leaves, the eight of
// a rejection's residual and a division by T = 1 took half of a call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "inverse_cdf.h"

namespace {

// `runtime.verify.host_acceptance`: min(1, q(x) / p(x)) as fp32, the quotient taken in fp64
// and rounded once (the correctly rounded fp32 quotient).
double acceptance(float qx, float px) {
  const double quotient = static_cast<double>(qx) / std::max(static_cast<double>(px),
                                                              static_cast<double>(std::numeric_limits<float>::min()));
  return std::min(1.0, static_cast<double>(static_cast<float>(quotient)));
}

// `runtime.verify.residual` into `law`: norm([q - p]^+), or q where nothing is left (q == p);
// p the draft law `p` (nullptr: a point mass at x). The elementwise steps are IEEE operations
// (the same bits by hand as ATen's); the sum stays ATen's, whose order sets its bits. Written
// as ~7 ATen calls, each ~7 us with the caches a forward leaves, it was half of the call.
void residual(const float* q, const float* p, int64_t x, int64_t V, std::vector<float>& law) {
  for (int64_t i = 0; i < V; ++i) law[i] = std::max(q[i] - (p != nullptr ? p[i] : (i == x ? 1.0f : 0.0f)), 0.0f);
  const float mass = at::from_blob(law.data(), {V}, at::TensorOptions().dtype(at::kFloat)).sum(-1, true).item<float>();
  if (!(mass > 0.0f)) {
    std::copy(q, q + V, law.begin());
    return;
  }
  const float norm = std::max(mass, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < V; ++i) law[i] /= norm;
}

std::tuple<at::Tensor, at::Tensor> verify_sampled_chains(at::TensorList logits, at::TensorList laws,
                                                         at::TensorList tokens, at::ArrayRef<double> temperatures,
                                                         at::TensorList uniforms, const at::Tensor& bonus_uniforms) {
  const int64_t B = static_cast<int64_t>(logits.size());
  TORCH_CHECK(static_cast<int64_t>(laws.size()) == B && static_cast<int64_t>(tokens.size()) == B &&
                  static_cast<int64_t>(temperatures.size()) == B && static_cast<int64_t>(uniforms.size()) == B,
              "one logits, laws, tokens, temperature and uniforms entry per chain");
  TORCH_CHECK(bonus_uniforms.dim() == 1 && bonus_uniforms.size(0) == B &&
                  bonus_uniforms.scalar_type() == at::kDouble && bonus_uniforms.is_contiguous(),
              "bonus_uniforms must be dense float64 [", B, "]");
  at::Tensor accepted = at::zeros({B}, bonus_uniforms.options().dtype(at::kLong));
  at::Tensor bonus = at::empty({B}, accepted.options());
  const double* bonus_u = bonus_uniforms.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {  // every chain's arguments checked before any walk
    const at::Tensor& rows = logits[b];
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.device().is_cpu() && rows.is_contiguous(),
                "chain ", b, ": logits must be dense fp32 CPU [N, V]");
    const int64_t N = rows.size(0), V = rows.size(1);
    TORCH_CHECK(laws[b].numel() == 0 || (laws[b].sizes() == rows.sizes() && laws[b].scalar_type() == at::kFloat &&
                                         laws[b].is_contiguous()),
                "chain ", b, ": draft laws must be dense fp32 [N, V] like its logits (or empty: point masses)");
    TORCH_CHECK(tokens[b].dim() == 1 && tokens[b].size(0) == N && tokens[b].scalar_type() == at::kLong &&
                    tokens[b].is_contiguous(),
                "chain ", b, ": tokens must be dense int64 [N]");
    TORCH_CHECK(uniforms[b].dim() == 1 && uniforms[b].size(0) == N - 1 && uniforms[b].scalar_type() == at::kFloat &&
                    uniforms[b].is_contiguous(),
                "chain ", b, ": one fp32 uniform a draft, [N - 1]");
    TORCH_CHECK(temperatures[b] > 0.0, "chain ", b, " has no sampling law (temperature ", temperatures[b], ")");
    const int64_t* tok = tokens[b].data_ptr<int64_t>();
    for (int64_t c = 1; c < N; ++c) {
      TORCH_CHECK(tok[c] >= 0 && tok[c] < V, "chain ", b, ": token ", tok[c], " is out of the vocabulary");
    }
  }
  // each chain's walk apart (its own rows, uniforms and outputs): chains split over the threads
  const at::ThreadLocalState state;
  at::parallel_for(0, B, 2, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard caller(state);  // the caller's inference mode on every thread
    std::vector<double> cdf;
    std::vector<float> law;
    at::Tensor q, scaled;  // the target law at the node reached (`specpipe::temperature_law`), row / T
    for (int64_t b = begin; b < end; ++b) {
      const int64_t N = logits[b].size(0), V = logits[b].size(1);
      const float* rows = logits[b].data_ptr<float>();
      const float* p = laws[b].numel() > 0 ? laws[b].data_ptr<float>() : nullptr;  // else point masses
      const int64_t* tok = tokens[b].data_ptr<int64_t>();
      const float* u = uniforms[b].data_ptr<float>();
      if (!q.defined() || q.numel() != V) q = at::empty({V}, logits[b].options());
      specpipe::temperature_law(q, rows, V, temperatures[b], scaled);
      const float* draw = nullptr;  // the law the bonus is drawn from
      int64_t c = 1;
      for (; c < N; ++c) {
        const int64_t x = tok[c];
        const float* p_c = p != nullptr ? p + c * V : nullptr;
        if (static_cast<double>(u[c - 1]) < acceptance(q.data_ptr<float>()[x], p_c != nullptr ? p_c[x] : 1.0f)) {
          specpipe::temperature_law(q, rows + c * V, V, temperatures[b], scaled);
          continue;
        }
        law.resize(V);
        residual(q.data_ptr<float>(), p_c, x, V, law);
        draw = law.data();
        break;
      }
      accepted.data_ptr<int64_t>()[b] = c - 1;
      cdf.resize(V);
      bonus.data_ptr<int64_t>()[b] = specpipe::draw_row(draw != nullptr ? draw : q.data_ptr<float>(), bonus_u[b], V, cdf);
    }
  });
  return {accepted, bonus};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "verify_sampled_chains(Tensor[] logits, Tensor[] laws, Tensor[] tokens, float[] temperatures, "
      "Tensor[] uniforms, Tensor bonus_uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("verify_sampled_chains", &verify_sampled_chains); }
