// A Llama forward over the paged KV cache in one call, two ops sharing one body:
//   specpipe_cpu::draft_lm_forward  a draft LM on int8 linears (plugins/llama_forward.py;
//                                   tests/plugins/test_llama_forward.py: the model's own
//                                   forward's logits and cache to fp32 rounding);
//   specpipe_cpu::target_forward    the target on its blocked fp32 weights
//                                   (plugins/llama_forward.py; tests/plugins/test_llama_forward.py).
// The reference of both is the model's own forward (`LlamaForCausalLM.forward` with a
// `PagedBatch`).
//
// Per layer (Touvron et al. 2023, "LLaMA", §2: pre-norm, SwiGLU, RoPE):
//   a = RMSNorm(x);  q, k, v = a W_qkv         RoPE on q, k; K/V to their slots (rope_kv_write)
//   x = x + Attn(q, K, V) W_o                  over the paged cache (tree_attention)
//   x = x + (SiLU(a' W_gate) * a' W_up) W_down, a' = RMSNorm(x)
// hidden = RMSNorm(x);  logits = hidden[logits rows] W_head.
// The products are the model's own kernels (int8: `specpipe::int8_linear`, int8_linear.h;
// fp32: fp32_linear.h's for few rows, else `mkldnn::_linear_pointwise`, on the blocked copies
// `pack_cpu_weights` made), attention and RoPE the project's own kernels, so what this saves
// is the Python and the decomposed ATen ops between the products (a forward of the demo
// target makes ~80 of them; its RMSNorm alone is six ATen ops, ~30 us a call): the norms,
// SiLU-times-up, residual adds and RoPE tables are plain loops here (llama_loops.h), equal to
// the ATen ops' up to fp32 rounding (another summation order), like any other kernel choice.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "fp32_linear.h"
#include "int8_linear.h"
#include "inverse_cdf.h"
#include "llama_loops.h"

namespace {

using specpipe::add_into;
using specpipe::rms_norm;
using specpipe::silu_times_up;

// RoPE tables [N, D] of `positions` [N] (`model_defs.rope.RotaryEmbedding.forward`): angle
// p * inv_freq_i for i < D/2, repeated over the second half, times the variant's scale.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq, double scale) {
  const int64_t N = positions.size(0), half = inv_freq.size(0), D = 2 * half;
  at::Tensor cos = at::empty({N, D}, inv_freq.options());
  at::Tensor sin = at::empty({N, D}, inv_freq.options());
  const int64_t* p = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  float* cp = cos.data_ptr<float>();
  float* sp = sin.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(p[n]) * f[i];
      cp[n * D + i] = cp[n * D + half + i] = std::cos(angle) * s;
      sp[n * D + i] = sp[n * D + half + i] = std::sin(angle) * s;
    }
  return {cos, sin};
}

// table[index] [N, E] of a dense fp32 table [V, E]: `at::index_select`'s rows (the same
// bits), copied in a loop. Its dispatch and checks cost ~10 us a call (torch profiler),
// about what a draft level's attention does, and a draft LM embeds one token a request at
// each level: the demo draft LM's greedy chain of 4 levels at batch 1, three alternating
// builds, medians of 400 hot / 150 cold calls, 635-750 / 738-822 -> 501-617 / 630-719 us;
// in the engine's steps (sd, batch 1) the drafting phase moved within its noise.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous(),
              "gather_rows takes a dense [V, E] float32 table");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "gather_rows takes [N] int64 indices");
  const int64_t N = index.size(0), V = table.size(0), E = table.size(1);
  at::Tensor out = at::empty({N, E}, table.options());
  const at::Tensor ids = index.contiguous();
  const int64_t* i = ids.data_ptr<int64_t>();
  const float* t = table.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(i[n] >= 0 && i[n] < V, "index ", i[n], " is out of range for ", V, " rows");
    std::copy(t + i[n] * E, t + (i[n] + 1) * E, o + n * E);
  }
  return out;
}

const auto& rope_kv_write_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("specpipe_cpu::rope_kv_write", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                            const at::Tensor&, int64_t)>();
  return op;
}

const auto& tree_attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specpipe_cpu::tree_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

// The residual stream x [N, E] after the last layer (before the final norm); `linear(k, a)`
// is the k-th product: per layer qkv, o, gate_up, down (then the head, which callers apply).
template <typename Linear>
at::Tensor layers(const Linear& linear, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                  at::TensorList query_index, at::TensorList key_slots, at::TensorList mask, at::TensorList valid,
                  at::TensorList rows, const at::Tensor& embed, const at::Tensor& inv_freq, double rope_scale,
                  at::TensorList norms, at::TensorList k_cache, at::TensorList v_cache, int64_t num_heads, double eps) {
  const int64_t L = static_cast<int64_t>(k_cache.size()), N = tokens.size(0), G = static_cast<int64_t>(rows.size());
  TORCH_CHECK(L >= 1, "a Llama has at least one layer");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && positions.sizes() == tokens.sizes() &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous() && slots.sizes() == tokens.sizes(),
              "tokens, positions and slots must be [N] int64");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
              "embed must be a dense [V, E] float32 table");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && static_cast<int64_t>(v_cache.size()) == L,
              "per layer: two norms, a K and a V cache");
  TORCH_CHECK(static_cast<int64_t>(query_index.size()) == G && static_cast<int64_t>(key_slots.size()) == G &&
                  static_cast<int64_t>(mask.size()) == G && static_cast<int64_t>(valid.size()) == G && G >= 1,
              "one query_index, key_slots, mask, valid and rows per attention group");
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous(),
              "inv_freq must be [D/2] float32");
  const int64_t H = num_heads, D = k_cache[0].size(2);
  TORCH_CHECK(2 * inv_freq.size(0) == D, "inv_freq has ", inv_freq.size(0), " entries for head_dim ", D);
  auto [cos, sin] = rope_tables(positions, inv_freq, rope_scale);
  at::Tensor x = gather_rows(embed, tokens);  // [N, E]
  const bool whole = G == 1 && query_index[0].numel() == N && rows[0].size(0) == N;  // one group, rows in order
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor a = linear(4 * l, rms_norm(x, norms[2 * l], eps));  // [N, (H + 2 H_kv) D]
    at::Tensor k = k_cache[l], v = v_cache[l];
    const at::Tensor q = rope_kv_write_op().call(a, cos, sin, k, v, slots, H);  // [N, H, D]
    at::Tensor attended;
    if (whole) {
      attended = tree_attention_op().call(q, k, v, query_index[0], key_slots[0], mask[0]);
    } else {
      attended = at::empty({N, H, D}, q.options());
      for (int64_t g = 0; g < G; ++g) {
        const at::Tensor part =
            tree_attention_op().call(q, k, v, query_index[g], key_slots[g], mask[g]);
        attended.index_copy_(0, rows[g], part.reshape({-1, H, D}).index({valid[g].reshape({-1})}));
      }
    }
    add_into(x, linear(4 * l + 1, attended.reshape({N, H * D})));
    add_into(x, linear(4 * l + 3, silu_times_up(linear(4 * l + 2, rms_norm(x, norms[2 * l + 1], eps)))));
  }
  return x;
}

// A draft LM's int8 products, checked: per layer qkv, o, gate_up, down; then the head.
specpipe::Int8Linears int8_linears(at::TensorList weights, at::TensorList blocked, at::TensorList scales,
                                   at::TensorList sums, size_t num_layers) {
  TORCH_CHECK(weights.size() == 4 * num_layers + 1 && scales.size() == weights.size() &&
                  blocked.size() == weights.size() && sums.size() == weights.size(),
              "per layer four int8 linears (qkv, o, gate_up, down); then the head");
  for (size_t k = 0; k < weights.size(); ++k) specpipe::check_int8_weight(weights[k], blocked[k], scales[k], sums[k]);
  return specpipe::Int8Linears{weights, blocked, scales, sums};
}

at::Tensor draft_lm_forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                            at::TensorList query_index, at::TensorList key_slots,
                            at::TensorList mask, at::TensorList valid,
                            at::TensorList rows, const at::Tensor& logits_indices,
                            const at::Tensor& embed, const at::Tensor& inv_freq, double rope_scale,
                            at::TensorList norms, at::TensorList weights, at::TensorList blocked,
                            at::TensorList scales, at::TensorList sums, at::TensorList k_cache, at::TensorList v_cache,
                            const at::Tensor& final_norm, int64_t num_heads, double eps) {
  const specpipe::Int8Linears linear = int8_linears(weights, blocked, scales, sums, k_cache.size());
  const at::Tensor x = layers(linear, tokens, positions, slots, query_index, key_slots, mask, valid, rows, embed,
                              inv_freq, rope_scale, norms, k_cache, v_cache, num_heads, eps);
  const int64_t head = static_cast<int64_t>(weights.size()) - 1;
  return linear(head, rms_norm(gather_rows(x, logits_indices), final_norm, eps));
}

// One level of a draft LM's chains: fed[i] is fed at position pos[i] of request active[i]
// (its K/V to slots[active[i]][pos[i]]), seeing its whole cache up to there (a chain node's ancestors
// are every node before it). `draft_lm_forward`'s step of one token per request, with the
// one attention group `runtime.attention_batch.group` builds for those segments. Logits [n, V].
struct ChainModel {
  const specpipe::Int8Linears& linear;
  const at::Tensor& embed;
  const at::Tensor& inv_freq;
  double rope_scale;
  at::TensorList norms, k_cache, v_cache;
  const at::Tensor& final_norm;
  int64_t num_heads;
  double eps;

  // With `before`, request active[i] first feeds before[i] (its tokens behind: a chain's last
  // draft, kept and never fed) at the positions just before pos[i], causal, in the same call:
  // one attention group of n requests x T rows (T = 1 + the most behind; a request's padding
  // rows see its first key and are dropped), logits at each request's fed[i] alone. Every row
  // is reduced over its own keys, so fed[i]'s logits and the K/V written are those of feeding
  // before[i] in a level of their own first, bit for bit, in one call instead of two (a
  // call's own cost, ~0.1 ms at batch 1, where a row more costs ~nothing).
  at::Tensor level(at::TensorList slots, const std::vector<int64_t>& active, const std::vector<int64_t>& fed,
                   const std::vector<int64_t>& pos, const std::vector<std::vector<int64_t>>* before = nullptr) const {
    const int64_t n = static_cast<int64_t>(active.size());
    const auto behind = [&](int64_t i) { return before ? static_cast<int64_t>((*before)[i].size()) : int64_t{0}; };
    int64_t T = 1, N = 0, width = 0;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(pos[i] - behind(i) >= 0, "request ", active[i], " feeds tokens before position 0");
      T = std::max(T, behind(i) + 1);
      N += behind(i) + 1;
      width = std::max(width, pos[i] + 1);
    }
    // The metadata in this call's own buffers, wrapped (`from_blob`: no allocation and no
    // dispatched op each, where eight ATen ops made them): a greedy level of the demo draft
    // LM 0.191-0.199 -> 0.170-0.175 ms after a flush (`benchmarks.floor`, alternating builds).
    // The tensors live until `layers` returns.
    std::vector<int64_t> tokens(N), positions(N), written(N), query(n * T, 0), rows(N), last(n), keys(n * width, 0);
    std::vector<uint8_t> seen(n * T * width, 0), valid(n * T, 0);
    int64_t row = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* table = slots[active[i]].data_ptr<int64_t>();
      const int64_t fed_here = behind(i) + 1, p0 = pos[i] - fed_here + 1;
      std::copy(table, table + pos[i] + 1, keys.begin() + i * width);
      for (int64_t t = 0; t < T; ++t) {
        uint8_t* mask_row = seen.data() + (i * T + t) * width;
        if (t >= fed_here) {  // padding: sees the first key, dropped
          query[i * T + t] = row - fed_here;  // (this request's first row)
          mask_row[0] = 1;
          continue;
        }
        const int64_t p = p0 + t;
        tokens[row] = t + 1 < fed_here ? (*before)[i][t] : fed[i];
        positions[row] = p;
        written[row] = table[p];
        query[i * T + t] = row;
        rows[row] = row;
        valid[i * T + t] = 1;
        std::fill(mask_row, mask_row + p + 1, 1);
        ++row;
      }
      last[i] = row - 1;
    }
    const at::TensorOptions i64 = embed.options().dtype(at::kLong), flags = embed.options().dtype(at::kBool);
    const at::Tensor token_t = at::from_blob(tokens.data(), {N}, i64), position_t = at::from_blob(positions.data(), {N}, i64);
    const at::Tensor written_t = at::from_blob(written.data(), {N}, i64);
    const at::Tensor query_t = at::from_blob(query.data(), {n, T}, i64), rows_t = at::from_blob(rows.data(), {N}, i64);
    const at::Tensor keys_t = at::from_blob(keys.data(), {n, width}, i64);
    const at::Tensor mask_t = at::from_blob(seen.data(), {n, T, width}, flags);
    const at::Tensor valid_t = at::from_blob(valid.data(), {n, T}, flags);
    const at::Tensor x = layers(linear, token_t, position_t, written_t, {query_t}, {keys_t}, {mask_t}, {valid_t},
                                {rows_t}, embed, inv_freq, rope_scale, norms, k_cache, v_cache, num_heads, eps);
    const int64_t head = static_cast<int64_t>(linear.weight.size()) - 1;
    const at::Tensor fed_rows = N == n ? x : gather_rows(x, at::from_blob(last.data(), {n}, i64));
    return linear(head, rms_norm(fed_rows, final_norm, eps));  // [n, V]
  }
};

// Tokens behind per request from an optional [B, K] int64 tensor (-1 past a request's own,
// which come first): what a chain op's first level feeds before each request's token.
std::vector<std::vector<int64_t>> behind_rows(const std::optional<at::Tensor>& behind, int64_t B) {
  std::vector<std::vector<int64_t>> out(B);
  if (!behind) return out;
  TORCH_CHECK(behind->dim() == 2 && behind->size(0) == B && behind->scalar_type() == at::kLong &&
                  behind->is_contiguous(),
              "behind must be dense int64 [B, K] (-1 past a request's tokens)");
  const int64_t K = behind->size(1);
  const int64_t* b = behind->data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r)
    for (int64_t k = 0; k < K && b[r * K + k] >= 0; ++k) out[r].push_back(b[r * K + k]);
  return out;
}

// The check the chain ops share: one dense int64 slots tensor per request (each op checks
// that they cover the positions it feeds).
void check_chain_slots(at::TensorList slots, int64_t B) {
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == B, "one slots tensor per request");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slots[b].dim() == 1 && slots[b].scalar_type() == at::kLong && slots[b].is_contiguous(),
                "slots must be dense [positions] int64 tensors");
}

// A draft LM's greedy chains (SD at temperature 0), every level in one call: request b's
// token tokens[b] is fed at position starts[b] (after its tokens `behind`, if any, at the
// positions just before, in the same level: `ChainModel::level`), and its argmax (the
// first index of the row's largest logit) is fed next, one position on: levels[b] tokens fed
// in all. Returns [B, max(levels)]: the argmax after each fed token, -1 past a request's
// levels. A level is `ChainModel::level`; what it saves is the Python between levels (the
// metadata, the argmax, the level's tree bookkeeping: ~0.4-0.5 ms a level at batch 1).
at::Tensor draft_lm_chain(const at::Tensor& tokens, const at::Tensor& starts, at::TensorList slots,
                          at::IntArrayRef levels, const std::optional<at::Tensor>& behind, const at::Tensor& embed,
                          const at::Tensor& inv_freq, double rope_scale, at::TensorList norms,
                          at::TensorList weights, at::TensorList blocked, at::TensorList scales, at::TensorList sums,
                          at::TensorList k_cache, at::TensorList v_cache, const at::Tensor& final_norm,
                          int64_t num_heads, double eps) {
  const specpipe::Int8Linears linear = int8_linears(weights, blocked, scales, sums, k_cache.size());
  const int64_t B = tokens.size(0);
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  starts.sizes() == tokens.sizes() && starts.scalar_type() == at::kLong && starts.is_contiguous() &&
                  static_cast<int64_t>(levels.size()) == B,
              "tokens and starts dense [B] int64, one level count per request");
  check_chain_slots(slots, B);
  const int64_t* start = starts.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(levels[b] >= 0 && start[b] >= 0 && start[b] + levels[b] <= slots[b].size(0),
                "request ", b, " feeds positions past the slots its blocks cover");
    most = std::max(most, levels[b]);
  }
  const ChainModel model{linear, embed, inv_freq, rope_scale, norms, k_cache, v_cache, final_norm, num_heads, eps};
  const std::vector<std::vector<int64_t>> fed_before = behind_rows(behind, B);
  at::Tensor out = at::full({B, most}, -1, tokens.options());
  std::vector<int64_t> current(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + B);
  for (int64_t j = 0; j < most; ++j) {
    std::vector<int64_t> active, fed, pos;
    std::vector<std::vector<int64_t>> before;  // level 0: each active request's tokens behind
    for (int64_t b = 0; b < B; ++b)
      if (levels[b] > j) {
        active.push_back(b);
        fed.push_back(current[b]);
        pos.push_back(start[b] + j);
        if (j == 0) before.push_back(fed_before[b]);
      }
    const at::Tensor logits = model.level(slots, active, fed, pos, j == 0 ? &before : nullptr);
    const int64_t V = logits.size(1);
    const float* lp = logits.data_ptr<float>();
    for (size_t i = 0; i < active.size(); ++i) {
      const float* row = lp + i * V;
      int64_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (row[v] > row[best]) best = v;
      current[active[i]] = best;
      out.data_ptr<int64_t>()[active[i] * most + j] = best;
    }
  }
  return out;
}

// One level of sampled chains (SD at temperature > 0: the caller warps and draws between
// levels): request b's token tokens[b] fed at position positions[b]; logits [B, V].
at::Tensor draft_lm_chain_level(const at::Tensor& tokens, const at::Tensor& positions, at::TensorList slots,
                                const at::Tensor& embed, const at::Tensor& inv_freq, double rope_scale,
                                at::TensorList norms, at::TensorList weights, at::TensorList blocked,
                                at::TensorList scales, at::TensorList sums, at::TensorList k_cache,
                                at::TensorList v_cache, const at::Tensor& final_norm, int64_t num_heads, double eps) {
  const specpipe::Int8Linears linear = int8_linears(weights, blocked, scales, sums, k_cache.size());
  const int64_t B = tokens.size(0);
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  positions.sizes() == tokens.sizes() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "tokens and positions dense [B] int64");
  check_chain_slots(slots, B);
  const int64_t* p = positions.data_ptr<int64_t>();
  std::vector<int64_t> active(B), fed(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + B), pos(p, p + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < slots[b].size(0), "request ", b, " feeds a position past the slots its blocks cover");
    active[b] = b;
  }
  const ChainModel model{linear, embed, inv_freq, rope_scale, norms, k_cache, v_cache, final_norm, num_heads, eps};
  return model.level(slots, active, fed, pos);
}

// A draft LM's sampled chains (SD at temperature > 0, RSD-C's and RSD-S's chains), every
// level in one call. Level j of request b: its law q = softmax(logits / temperatures[b]) (the
// warp `runtime.sampling.target_probs` makes of a temperature alone: the same ATen kernels,
// written straight into the law's row, so the same bits), a draw from q at the uniform
// uniforms[b][j] (`specpipe::draw_row`, what `runtime.gumbel.draw_rows` draws), and, while
// j + 1 < levels[b], the draw fed at position starts[b] + j for the next level's logits.
// Level 0's logits are `first` (the roots', rows in request order), or, given `roots`, those
// of the roots fed at starts[b] - 1 (a chain level, as `draft_lm_chain_level` feeds them),
// after each request's tokens `behind`, if any, in the same level (`draft_lm_chain`'s).
// Returns the draws [B, max(levels)] (-1 past a request's levels) and the laws
// [B, max(levels) + 1, V]: row j + 1 the law draw j came from, row 0 (the root, not drawn)
// zeros, so request b's first levels[b] + 1 rows are its tree's `draft_probs`.
// What it saves is the Python of the level loop it replaces (`rsd._sampled_chains`): per
// level the metadata, the warp, the draw and the device-to-host read.
std::tuple<at::Tensor, at::Tensor> draft_lm_sampled_chain(
    const std::optional<at::Tensor>& first, const std::optional<at::Tensor>& roots, const at::Tensor& starts, at::TensorList slots, at::IntArrayRef levels,
    const std::optional<at::Tensor>& behind, at::ArrayRef<double> temperatures, const at::Tensor& uniforms, const at::Tensor& embed,
    const at::Tensor& inv_freq, double rope_scale, at::TensorList norms, at::TensorList weights,
    at::TensorList blocked, at::TensorList scales, at::TensorList sums, at::TensorList k_cache,
    at::TensorList v_cache, const at::Tensor& final_norm, int64_t num_heads, double eps) {
  const specpipe::Int8Linears linear = int8_linears(weights, blocked, scales, sums, k_cache.size());
  const int64_t B = starts.size(0);
  TORCH_CHECK(first.has_value() != roots.has_value(), "give the roots' logits (first) or the roots, not both");
  TORCH_CHECK(!behind || roots, "tokens behind are fed before the roots: give the roots");
  TORCH_CHECK(!first || (first->dim() == 2 && first->size(0) == B && first->scalar_type() == at::kFloat),
              "first must be the roots' fp32 logits [B, V]");
  TORCH_CHECK(!roots || (roots->dim() == 1 && roots->size(0) == B && roots->scalar_type() == at::kLong &&
                         roots->is_contiguous()),
              "roots must be dense int64 [B]");
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous() &&
                  static_cast<int64_t>(levels.size()) == B && static_cast<int64_t>(temperatures.size()) == B,
              "starts dense [B] int64, one level count and one temperature per request");
  check_chain_slots(slots, B);
  const int64_t* start = starts.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(levels[b] >= 1 && start[b] >= 1 && start[b] + levels[b] - 1 <= slots[b].size(0),
                "request ", b, " drafts no level, or feeds positions past the slots its blocks cover");
    TORCH_CHECK(temperatures[b] > 0.0, "request ", b, " has no sampling law (temperature ", temperatures[b], ")");
    most = std::max(most, levels[b]);
  }
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) >= most &&
                  uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous(),
              "uniforms must be dense float64 [B, max(levels)]");
  const ChainModel model{linear, embed, inv_freq, rope_scale, norms, k_cache, v_cache, final_norm, num_heads, eps};
  std::vector<int64_t> active(B);
  for (int64_t b = 0; b < B; ++b) active[b] = b;
  at::Tensor logits;
  if (first) {
    logits = first->contiguous();
  } else {
    const int64_t* r = roots->data_ptr<int64_t>();
    std::vector<int64_t> fed(r, r + B), pos(B);
    for (int64_t b = 0; b < B; ++b) pos[b] = start[b] - 1;
    const std::vector<std::vector<int64_t>> before = behind_rows(behind, B);
    logits = model.level(slots, active, fed, pos, &before).contiguous();
  }
  const int64_t V = logits.size(1);
  at::Tensor drawn = at::full({B, most}, -1, starts.options());
  at::Tensor laws = at::zeros({B, most + 1, V}, logits.options());
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = drawn.data_ptr<int64_t>();
  const at::ThreadLocalState state;  // the caller's (its inference mode), for the threads below
  for (int64_t j = 0; j < most; ++j) {
    // each request's law and draw apart, its rows and uniform its own: requests split over
    // the threads (a draw's fp64 running sum over V is one dependent chain, ~10 us at V = 8192)
    at::parallel_for(0, static_cast<int64_t>(active.size()), 2, [&](int64_t begin, int64_t end) {
      at::ThreadLocalStateGuard caller(state);  // the caller's inference mode on every thread
      std::vector<double> cdf(V);
      at::Tensor scaled;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = active[i];
        // [V]: the law written in place (no copy); rows by pointer, not by `select` (an ATen
        // call each, ~2-7 us with the caches a forward leaves)
        const at::Tensor q =
            at::from_blob(laws.data_ptr<float>() + (b * (most + 1) + j + 1) * V, {V}, logits.options());
        specpipe::temperature_law(q, logits.data_ptr<float>() + i * V, V, temperatures[b], scaled);
        out[b * most + j] = specpipe::draw_row(q.data_ptr<float>(), u[b * uniforms.size(1) + j], V, cdf);
      }
    });
    std::vector<int64_t> going, fed, pos;
    for (const int64_t b : active) {
      if (j + 1 < levels[b]) {
        going.push_back(b);
        fed.push_back(out[b * most + j]);
        pos.push_back(start[b] + j);
      }
    }
    if (going.empty()) break;
    logits = model.level(slots, going, fed, pos).contiguous();
    active = std::move(going);
  }
  return {drawn, laws};
}

// The products of an fp32 target: `fp32_linear.h`'s kernel on the `block16` copies up to
// `small_m` rows, oneDNN's blocked copies (`mkldnn::_linear_pointwise`) above, as
// `model_defs.llama.Linear` chooses.
struct Fp32Linears {
  at::TensorList packed, small;
  at::IntArrayRef out_features;
  int64_t small_m;
  at::Tensor operator()(int64_t k, const at::Tensor& x) const {
    if (x.size(0) <= small_m) return specpipe::fp32_linear(x, small[k], out_features[k]);
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                                 c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                                 std::optional<c10::string_view>)>();
    return op.call(x, packed[k], std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), "");
  }
};

std::tuple<at::Tensor, at::Tensor> target_forward(
    const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots, at::TensorList query_index,
    at::TensorList key_slots, at::TensorList mask, at::TensorList valid, at::TensorList rows,
    const at::Tensor& logits_indices, const at::Tensor& embed, const at::Tensor& inv_freq, double rope_scale,
    at::TensorList norms, at::TensorList packed, at::TensorList small, at::IntArrayRef out_features, int64_t small_m,
    at::TensorList k_cache, at::TensorList v_cache, const at::Tensor& final_norm, int64_t num_heads, double eps) {
  TORCH_CHECK(packed.size() == 4 * k_cache.size() + 1 && small.size() == packed.size() &&
                  out_features.size() == packed.size(),
              "per layer four linears (qkv, o, gate_up, down), then the head, each with both blocked copies");
  for (size_t k = 0; k < small.size(); ++k) specpipe::check_fp32_blocked(small[k], out_features[k]);
  const Fp32Linears linear{packed, small, out_features, small_m};
  const at::Tensor x = layers(linear, tokens, positions, slots, query_index, key_slots, mask, valid, rows, embed,
                              inv_freq, rope_scale, norms, k_cache, v_cache, num_heads, eps);
  const at::Tensor hidden = rms_norm(x, final_norm, eps);  // [N, E]
  return {linear(static_cast<int64_t>(packed.size()) - 1, gather_rows(hidden, logits_indices)), hidden};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "draft_lm_forward(Tensor tokens, Tensor positions, Tensor slots, Tensor[] query_index, Tensor[] key_slots, "
      "Tensor[] mask, Tensor[] valid, Tensor[] rows, Tensor logits_indices, Tensor embed, Tensor inv_freq, "
      "float rope_scale, Tensor[] norms, Tensor[] weights, Tensor[] blocked, Tensor[] scales, Tensor[] sums, "
      "Tensor(a!)[] k_cache, "
      "Tensor(b!)[] v_cache, Tensor final_norm, int num_heads, float eps) -> Tensor");
  m.def(
      "draft_lm_chain(Tensor tokens, Tensor starts, Tensor[] slots, int[] levels, Tensor? behind, Tensor embed, "
      "Tensor inv_freq, "
      "float rope_scale, Tensor[] norms, Tensor[] weights, Tensor[] blocked, Tensor[] scales, Tensor[] sums, "
      "Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor final_norm, int num_heads, float eps) -> Tensor");
  m.def(
      "draft_lm_chain_level(Tensor tokens, Tensor positions, Tensor[] slots, Tensor embed, Tensor inv_freq, "
      "float rope_scale, Tensor[] norms, Tensor[] weights, Tensor[] blocked, Tensor[] scales, Tensor[] sums, "
      "Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor final_norm, int num_heads, float eps) -> Tensor");
  m.def(
      "draft_lm_sampled_chain(Tensor? first, Tensor? roots, Tensor starts, Tensor[] slots, int[] levels, Tensor? behind, "
      "float[] temperatures, "
      "Tensor uniforms, Tensor embed, Tensor inv_freq, float rope_scale, Tensor[] norms, Tensor[] weights, "
      "Tensor[] blocked, Tensor[] scales, Tensor[] sums, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, "
      "Tensor final_norm, int num_heads, float eps) -> (Tensor, Tensor)");
  m.def(
      "target_forward(Tensor tokens, Tensor positions, Tensor slots, Tensor[] query_index, Tensor[] key_slots, "
      "Tensor[] mask, Tensor[] valid, Tensor[] rows, Tensor logits_indices, Tensor embed, Tensor inv_freq, "
      "float rope_scale, Tensor[] norms, Tensor[] packed, Tensor[] small, int[] out_features, int small_m, "
      "Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor final_norm, int num_heads, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) {
  m.impl("draft_lm_forward", &draft_lm_forward);
  m.impl("draft_lm_chain", &draft_lm_chain);
  m.impl("draft_lm_chain_level", &draft_lm_chain_level);
  m.impl("draft_lm_sampled_chain", &draft_lm_sampled_chain);
  m.impl("target_forward", &target_forward);
}

// The blocked weights are oneDNN (MkldnnCPU) tensors, whose key the dispatcher picks first.
TORCH_LIBRARY_IMPL(specpipe_cpu, MkldnnCPU, m) { m.impl("target_forward", &target_forward); }
