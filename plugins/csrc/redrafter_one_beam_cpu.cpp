// specpipe_cpu::redrafter_one_beam: one-beam ReDrafter drafting on int8 drafter weights, the
// whole search in one call; plugins/redrafter_one_beam.py has the contract, and the Python
// search it replaces (runtime/proposers/beam_search.py, one beam, `with_dists=False`) is its
// reference (tests/plugins/test_redrafter_one_beam.py: bitwise the same beams, log-probs and
// scores).
//
// Per level (arXiv 2403.09919 §3.2 with one beam: greedy drafting):
//   s_t    = SiLU(W E(x_t) + (U s_(t-1) + b_U))                  the RNN (`ReDrafter.step`)
//   z      = P [h; s_t] + b_P;  z = z + SiLU(R_i z + b_i), i = 1..N   input projection, ResBlocks
//   logits = H z;  top-K of the logits; x_(t+1) = the best;  log p = log_softmax(top-K)[0]
// The same ATen ops in the same order as the Python form, so the same bits; what it saves is
// the Python between them (~20 ops a level: 1.7 -> 0.7 ms for five levels on the CPU).
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// `plugins.cpu_linear.int8_linear`: 7-bit activations (reduce_range), the bias added after.
at::Tensor int8_linear(const Packed& w, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = w->apply_dynamic(x, /*reduce_range=*/true);
  return bias.has_value() ? y + *bias : y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> redrafter_one_beam(
    const at::Tensor& h, const at::Tensor& embed, const at::Tensor& bonus, int64_t length, int64_t k,
    const Packed& rnn_w, const Packed& rnn_u, const at::Tensor& rnn_b, const Packed& proj,
    const at::Tensor& proj_b, const c10::List<Packed>& res, const std::vector<at::Tensor>& res_b,
    const Packed& head) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be [B, D] float32");
  TORCH_CHECK(bonus.dim() == 1 && bonus.size(0) == h.size(0), "bonus must be [B]");
  TORCH_CHECK(res.size() == res_b.size(), "one bias per residual block");
  TORCH_CHECK(length >= 1 && k >= 1, "length and k must be >= 1");
  const at::Tensor context = h.unsqueeze(1);  // [B, 1, D]
  at::Tensor state = at::zeros_like(context);
  at::Tensor tokens = bonus.unsqueeze(1);  // [B, 1]
  at::Tensor scores = at::zeros({h.size(0), 1}, h.options());
  std::vector<at::Tensor> drafted, log_probs;
  for (int64_t t = 0; t < length; ++t) {
    const at::Tensor e = at::embedding(embed, tokens);
    state = at::silu(int8_linear(rnn_w, e, c10::nullopt) + int8_linear(rnn_u, state, rnn_b));
    at::Tensor z = int8_linear(proj, at::cat({context, state}, -1), proj_b);
    for (size_t i = 0; i < res.size(); ++i) {
      z = z + at::silu(int8_linear(res.get(i), z, res_b[i]));
    }
    auto [top, index] = at::topk(int8_linear(head, z, c10::nullopt), k, -1);
    const at::Tensor lp = at::log_softmax(top, -1).select(-1, 0);  // [B, 1]
    scores = scores + lp;
    tokens = index.select(-1, 0);
    drafted.push_back(tokens);
    log_probs.push_back(lp);
  }
  return {at::stack(drafted, -1), at::stack(log_probs, -1), scores};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "redrafter_one_beam(Tensor h, Tensor embed, Tensor bonus, int length, int k, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase rnn_w, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase rnn_u, Tensor rnn_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase proj, Tensor proj_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase[] res, Tensor[] res_b, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase head) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("redrafter_one_beam", &redrafter_one_beam); }
