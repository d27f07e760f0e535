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
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// `plugins.cpu_linear.int8_linear`: 7-bit activations (reduce_range), the bias added after.
at::Tensor int8_linear(const Packed& w, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = w->apply_dynamic(x, /*reduce_range=*/true);
  return bias.has_value() ? y + *bias : y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> redrafter_beam_search(
    const at::Tensor& h, const at::Tensor& embed, const at::Tensor& bonus, int64_t width, int64_t length,
    int64_t k, const Packed& rnn_w, const Packed& rnn_u, const at::Tensor& rnn_b, const Packed& proj,
    const at::Tensor& proj_b, const c10::List<Packed>& res, const std::vector<at::Tensor>& res_b,
    const Packed& head) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be [B, D] float32");
  TORCH_CHECK(bonus.dim() == 1 && bonus.size(0) == h.size(0), "bonus must be [B]");
  TORCH_CHECK(res.size() == res_b.size(), "one bias per residual block");
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
    state = at::silu(int8_linear(rnn_w, e, c10::nullopt) + int8_linear(rnn_u, state, rnn_b));
    at::Tensor z = int8_linear(proj, at::cat({context, state}, -1), proj_b);
    for (size_t i = 0; i < res.size(); ++i) {
      z = z + at::silu(int8_linear(res.get(i), z, res_b[i]));
    }
    auto [top, index] = at::topk(int8_linear(head, z, c10::nullopt), k, -1);  // [B, W, K]
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
      "__torch__.torch.classes.quantized.LinearPackedParamsBase rnn_w, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase rnn_u, Tensor rnn_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase proj, Tensor proj_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase[] res, Tensor[] res_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase head) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("redrafter_beam_search", &redrafter_beam_search); }
