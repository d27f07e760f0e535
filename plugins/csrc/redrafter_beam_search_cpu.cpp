// specpipe_cpu::redrafter_beam_search: ReDrafter's beam search over the warp's support on int8
// drafter weights, the whole search in one call; plugins/redrafter_beam_search.py has the
// contract, and the Python search it replaces (runtime/proposers/beam_search.py,
// `with_dists=False`) is its reference (tests/plugins/test_redrafter_beam_search.py: bitwise
// the same beams, log-probs and scores).
//
// Per level (arXiv 2403.09919 §3.2):
//   s      = SiLU(W E(x) + (U s + b_U))                            the RNN (`ReDrafter.step`)
//   z      = P [h; s] + b_P;  z = z + SiLU(R_i z + b_i), i = 1..N   input projection, ResBlocks
//   logits = H z;  top-K of each beam's logits, log_softmax over them (the warp's support)
//   one beam: its best extension; W beams: the best W of the W x K extensions by cumulative
//   log-prob, each inheriting its parent's state; the beams rebuilt backwards at the end.
// The same ATen ops in the same order as the Python form, so the same bits; what it saves is
// the Python between them (~20-30 ops a level: 1.7 -> 0.9 ms for five levels of one beam).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "int8_linear.h"

namespace {

// `plugins.cpu_linear.int8_linear`: the kernel on x's rows, the bias added after.
at::Tensor int8_linear(const specpipe::Int8Linears& linear, int64_t k, const at::Tensor& x,
                       const c10::optional<at::Tensor>& bias) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = linear.weight[k].size(0);
  at::Tensor y = linear(k, x.reshape({-1, x.size(-1)}).contiguous()).view(sizes);
  return bias.has_value() ? y + *bias : y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> redrafter_beam_search(
    const at::Tensor& h, const at::Tensor& embed, const at::Tensor& bonus, int64_t width, int64_t length,
    int64_t k, at::TensorList weight, at::TensorList blocked, at::TensorList scale, at::TensorList sum,
    const at::Tensor& rnn_b, const at::Tensor& proj_b, at::TensorList res_b) {
  // the drafter's int8 linears in order: rnn_w, rnn_u, proj, one per residual block, head
  const int64_t n = static_cast<int64_t>(weight.size()), nres = static_cast<int64_t>(res_b.size());
  TORCH_CHECK(n == nres + 4 && static_cast<int64_t>(blocked.size()) == n && static_cast<int64_t>(scale.size()) == n &&
                  static_cast<int64_t>(sum.size()) == n,
              "int8 linears rnn_w, rnn_u, proj, one per residual block, head (4 lists alike); a bias per residual block");
  for (int64_t i = 0; i < n; ++i) specpipe::check_int8_weight(weight[i], blocked[i], scale[i], sum[i]);
  const specpipe::Int8Linears linear{weight, blocked, scale, sum};
  const int64_t rnn_w = 0, rnn_u = 1, proj = 2, head = n - 1;
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be [B, D] float32");
  TORCH_CHECK(bonus.dim() == 1 && bonus.size(0) == h.size(0), "bonus must be [B]");
  TORCH_CHECK(width >= 1 && length >= 1 && k >= width, "need 1 <= width <= k and length >= 1");
  const int64_t b = h.size(0), w = width;
  const at::Tensor context = h.unsqueeze(1).expand({b, w, h.size(1)});  // [B, W, D]
  at::Tensor state = at::zeros({b, w, h.size(1)}, h.options());
  at::Tensor tokens = bonus.unsqueeze(1).expand({b, w});  // [B, W]
  at::Tensor scores = at::full({b, w}, -std::numeric_limits<float>::infinity(), h.options());
  scores.select(1, 0).fill_(0.0);  // only beam 0 is live before the first level
  std::vector<at::Tensor> step_tokens, step_parents, step_lps;
  for (int64_t t = 0; t < length; ++t) {
    const at::Tensor e = at::embedding(embed, tokens);
    state = at::silu(int8_linear(linear, rnn_w, e, c10::nullopt) + int8_linear(linear, rnn_u, state, rnn_b));
    at::Tensor z = int8_linear(linear, proj, at::cat({context, state}, -1), proj_b);
    for (int64_t i = 0; i < nres; ++i) {
      z = z + at::silu(int8_linear(linear, 3 + i, z, res_b[i]));
    }
    auto [top, index] = at::topk(int8_linear(linear, head, z, c10::nullopt), k, -1);  // [B, W, K]
    if (w == 1) {  // the best extension of the one beam is its support's top token
      const at::Tensor lp = at::log_softmax(top, -1).select(-1, 0);  // [B, 1]
      scores = scores + lp;
      tokens = index.select(-1, 0);
      step_tokens.push_back(tokens);
      step_lps.push_back(lp);
      continue;
    }
    const at::Tensor lp = at::log_softmax(top, -1);
    const at::Tensor cand = (scores.unsqueeze(-1) + lp).reshape({b, w * k});
    auto [best, flat] = at::topk(cand, w, -1);  // [B, W], best first
    scores = best;
    const at::Tensor parent = at::floor_divide(flat, k);
    tokens = at::gather(index.reshape({b, w * k}), 1, flat);
    step_lps.push_back(at::gather(lp.reshape({b, w * k}), 1, flat));
    state = at::gather(state, 1, parent.unsqueeze(-1).expand_as(state));
    step_tokens.push_back(tokens);
    step_parents.push_back(parent);
  }
  if (w == 1) {
    return {at::stack(step_tokens, -1), at::stack(step_lps, -1), scores};
  }
  at::Tensor ancestor = at::arange(w, bonus.options()).expand({b, w});  // into step t's kept beams
  std::vector<at::Tensor> drafted(length), kept(length);
  for (int64_t t = length - 1; t >= 0; --t) {
    drafted[t] = at::gather(step_tokens[t], 1, ancestor);
    kept[t] = at::gather(step_lps[t], 1, ancestor);
    ancestor = at::gather(step_parents[t], 1, ancestor);
  }
  return {at::stack(drafted, -1), at::stack(kept, -1), scores};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "redrafter_beam_search(Tensor h, Tensor embed, Tensor bonus, int width, int length, int k, "
      "Tensor[] weight, Tensor[] blocked, Tensor[] scale, Tensor[] sum, Tensor rnn_b, Tensor proj_b, "
      "Tensor[] res_b) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("redrafter_beam_search", &redrafter_beam_search); }
