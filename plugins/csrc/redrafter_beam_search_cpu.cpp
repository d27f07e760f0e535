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
// The same arithmetic in the same order as the Python form, so the same bits: the products
// are `specpipe::int8_linear`'s, SiLU and log_softmax ATen's own ops on rows laid out as the
// Python form lays them out, and the adds, the embedding rows, the concatenation, the top-K
// and the beam step are plain loops over buffers allocated once per call. The top-K of the
// rows' logits (`specpipe_lanes::top_k`: a vector of logits a compare) runs on the threads
// of the products, rows apart: with one scalar compare a logit on one thread it was ~20%
// of a batch-32 search (one beam of 5: 4.5 -> 3.5 ms; batch 8: 1.24 -> 0.98 ms). A level is then
// its products plus three ATen calls; as ~25 ATen ops (topk ~28 us, embedding ~11 us, cat,
// views, adds) it cost ~100 us more a level on the 2-core CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "int8_linear.h"
#include "lanes.h"
#include "llama_loops.h"

namespace {

// y = linear k of x's rows (x [M, I] dense), then y += bias (broadcast over rows) if given:
// `plugins.cpu_linear.int8_linear`, the bias added after the product.
at::Tensor linear(const specpipe::Int8Linears& linears, int64_t k, const at::Tensor& x, const at::Tensor* bias) {
  at::Tensor y = linears(k, x);
  if (bias != nullptr) {
    const int64_t O = y.size(1);
    float* yp = y.data_ptr<float>();
    const float* bp = bias->data_ptr<float>();
    for (int64_t m = 0; m < y.size(0); ++m)
      for (int64_t o = 0; o < O; ++o) yp[m * O + o] += bp[o];
  }
  return y;
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
  const specpipe::Int8Linears linears{weight, blocked, scale, sum};
  const int64_t rnn_w = 0, rnn_u = 1, proj = 2, head = n - 1;
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h must be a dense [B, D] float32");
  TORCH_CHECK(bonus.dim() == 1 && bonus.size(0) == h.size(0) && bonus.scalar_type() == at::kLong, "bonus must be [B] int64");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
              "embed must be a dense [V, D] float32");
  const int64_t b = h.size(0), w = width, rows = b * w, H = h.size(1), D = weight[rnn_u].size(0);
  const int64_t V = weight[head].size(0), E = weight[proj].size(0);
  TORCH_CHECK(width >= 1 && length >= 1 && k >= width && k <= V, "need 1 <= width <= k <= V and length >= 1");
  TORCH_CHECK(embed.size(1) == D && weight[rnn_w].size(1) == D && weight[proj].size(1) == H + D,
              "embedding [V, D], rnn_w [D, D], proj [E, H + D]");
  for (const at::Tensor& bias : {rnn_b, proj_b})
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous(), "biases must be dense float32");
  TORCH_CHECK(rnn_b.numel() == D && proj_b.numel() == E, "rnn_u's bias [D], proj's bias [E]");
  for (const at::Tensor& bias : res_b)
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == E, "residual biases [E]");

  const at::TensorOptions f32 = h.options();
  at::Tensor state = at::zeros({rows, D}, f32), next = at::empty({rows, D}, f32);
  at::Tensor emb = at::empty({rows, D}, f32), joined = at::empty({rows, H + D}, f32);
  at::Tensor top = at::empty({rows, k}, f32);
  std::vector<int64_t> index(rows * k), tokens(rows), step_tokens(length * rows), step_parents(length * rows);
  std::vector<float> scores(rows, -std::numeric_limits<float>::infinity()), step_lps(length * rows);
  std::vector<float> cand(w * k), best(w);
  std::vector<int64_t> flat(w);
  const int64_t* bonus_p = bonus.data_ptr<int64_t>();
  const float* h_p = h.data_ptr<float>();
  const float* embed_p = embed.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    tokens[r] = bonus_p[r / w];
    TORCH_CHECK(tokens[r] >= 0 && tokens[r] < embed.size(0), "bonus token ", tokens[r], " is out of the vocabulary");
    if (r % w == 0) scores[r] = 0.0f;  // only beam 0 is live before the first level
    std::memcpy(joined.data_ptr<float>() + r * (H + D), h_p + (r / w) * H, H * sizeof(float));  // the [h; s] rows' h
  }
  for (int64_t t = 0; t < length; ++t) {
    float* e_p = emb.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) std::memcpy(e_p + r * D, embed_p + tokens[r] * D, D * sizeof(float));
    at::Tensor pre = linear(linears, rnn_u, state, &rnn_b);
    specpipe::add_into(pre, linear(linears, rnn_w, emb, nullptr));  // (U s + b_U) + W E(x)
    at::silu_out(state, pre);
    float* j_p = joined.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) std::memcpy(j_p + r * (H + D) + H, state.data_ptr<float>() + r * D, D * sizeof(float));
    at::Tensor z = linear(linears, proj, joined, &proj_b);
    for (int64_t i = 0; i < nres; ++i) {
      at::Tensor g = linear(linears, 3 + i, z, &res_b[i]);
      specpipe::add_into(z, at::silu_(g));
    }
    const at::Tensor logits = linears(head, z);  // [rows, V]
    const float* l_p = logits.data_ptr<float>();
    float* t_p = top.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {  // rows apart: a few us each
      for (int64_t r = r0; r < r1; ++r) specpipe_lanes::top_k(l_p + r * V, V, k, t_p + r * k, index.data() + r * k);
    });
    const at::Tensor lp = at::log_softmax(top, -1);  // [rows, K] the warped log-probs of the support
    const float* lp_p = lp.data_ptr<float>();
    int64_t* kept_t = step_tokens.data() + t * rows;
    float* kept_lp = step_lps.data() + t * rows;
    int64_t* parents = step_parents.data() + t * rows;
    if (w == 1) {  // the best extension of the one beam is its support's top token
      for (int64_t r = 0; r < rows; ++r) {
        scores[r] = scores[r] + lp_p[r * k];
        tokens[r] = kept_t[r] = index[r * k];
        kept_lp[r] = lp_p[r * k];
        parents[r] = 0;
      }
      continue;
    }
    const float* s_p = state.data_ptr<float>();
    float* n_p = next.data_ptr<float>();
    for (int64_t i = 0; i < b; ++i) {  // the best W of request i's W x K extensions
      for (int64_t j = 0; j < w; ++j)
        for (int64_t c = 0; c < k; ++c) cand[j * k + c] = scores[i * w + j] + lp_p[(i * w + j) * k + c];
      specpipe_lanes::top_k(cand.data(), w * k, w, best.data(), flat.data());
      for (int64_t j = 0; j < w; ++j) {
        const int64_t r = i * w + j, from = i * w + flat[j] / k;
        scores[r] = best[j];
        tokens[r] = kept_t[r] = index[from * k + flat[j] % k];
        kept_lp[r] = lp_p[from * k + flat[j] % k];
        parents[r] = flat[j] / k;
        std::memcpy(n_p + r * D, s_p + from * D, D * sizeof(float));  // it inherits its parent's state
      }
    }
    std::swap(state, next);
  }
  at::Tensor drafted = at::empty({b, w, length}, bonus.options()), kept = at::empty({b, w, length}, f32);
  at::Tensor final_scores = at::empty({b, w}, f32);
  int64_t* d_p = drafted.data_ptr<int64_t>();
  float* k_p = kept.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {  // backwards from each final beam through its ancestors
    final_scores.data_ptr<float>()[r] = scores[r];
    int64_t beam = r % w;
    for (int64_t t = length - 1; t >= 0; --t) {
      const int64_t at = (r / w) * w + beam;
      d_p[r * length + t] = step_tokens[t * rows + at];
      k_p[r * length + t] = step_lps[t * rows + at];
      beam = step_parents[t * rows + at];
    }
  }
  return {drafted, kept, final_scores};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "redrafter_beam_search(Tensor h, Tensor embed, Tensor bonus, int width, int length, int k, "
      "Tensor[] weight, Tensor[] blocked, Tensor[] scale, Tensor[] sum, Tensor rnn_b, Tensor proj_b, "
      "Tensor[] res_b) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("redrafter_beam_search", &redrafter_beam_search); }
