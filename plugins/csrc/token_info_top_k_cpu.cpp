// specpipe_cpu::token_info_top_k: the CPU kernel of `specpipe::token_info_top_k`;
// plugins/token_info_top_k.py has the contract and the plain-torch reference this is tested
// against (tests/plugins/test_token_info_top_k.py: the same children, log-probabilities
// within fp32 rounding).
//
// One depth of Lyanna's token-info sampling (Algorithm 1) for every frontier node m of a
// batch: its chain row rows[owners[m]] plus, where its token is hot, its row of the hot-token
// table added at the hot columns (one fp32 add per cell, as `HotTokenTable.bias`), then the
// k best children and their log-softmax values. Per node one pass keeps the k best values
// (ascending index on ties, a vector of values compared at a time) and a second sums
// exp(x - max), a vector at a time (a Cephes-style exp). In torch the same depth is a
// gather, a clone, an index_add_, a log_softmax over [M, V] and a top-k (~1.3 ms for 32
// nodes of 8192 logits on 2 cores, most of Lyanna's tree building at batch 8).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "lanes.h"

namespace {

using specpipe_lanes::iw;
using specpipe_lanes::kWide;
using specpipe_lanes::vw;

constexpr int64_t kMaxK = 16;  // plugins/token_info_top_k.py MAX_K

void node(const float* x, int64_t V, int64_t k, float* values, int64_t* indices) {
  float best[kMaxK];
  int64_t at[kMaxK];
  specpipe_lanes::top_k(x, V, k, best, at);
  const float top = best[0];
  const int64_t body = V / kWide * kWide;
  vw acc{};
  for (int64_t j = 0; j < body; j += kWide)
    acc += specpipe_lanes::exp_nonpositive<vw, iw>(specpipe_lanes::load_w(x + j) - top);
  double sum = 0.0;
  for (int l = 0; l < kWide; ++l) sum += acc[l];
  for (int64_t j = body; j < V; ++j) sum += std::exp(x[j] - top);
  const float log_sum = static_cast<float>(std::log(sum));
  for (int64_t j = 0; j < k; ++j) values[j] = (best[j] - top) - log_sum, indices[j] = at[j];
}

std::tuple<at::Tensor, at::Tensor> token_info_top_k(const at::Tensor& rows, const at::Tensor& owners,
                                                    const at::Tensor& hot_rows, const at::Tensor& hot_ids,
                                                    const at::Tensor& table, int64_t k) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.stride(1) == 1,
              "specpipe_cpu::token_info_top_k takes fp32 CPU [R, V] rows with contiguous rows");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.is_contiguous() &&
                  table.size(1) == hot_ids.size(0),
              "the hot-token table must be a contiguous fp32 [H, H] tensor over hot_ids");
  const int64_t V = rows.size(1), M = owners.size(0), H = hot_ids.size(0);
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= V, "k must be in 1..min(", kMaxK, ", V), got ", k);
  TORCH_CHECK(hot_rows.size(0) == M, "one hot row (or -1) per node");
  const auto own = owners.contiguous(), hot = hot_rows.contiguous(), ids = hot_ids.contiguous();
  const int64_t *o = own.data_ptr<int64_t>(), *h = hot.data_ptr<int64_t>(), *cols = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(o[m] >= 0 && o[m] < rows.size(0) && h[m] >= -1 && h[m] < table.size(0), "node ", m,
                ": owner or hot row out of range");
  }
  for (int64_t j = 0; j < H; ++j) TORCH_CHECK(cols[j] >= 0 && cols[j] < V, "hot id out of range");
  auto values = at::empty({M, k}, rows.options());
  auto indices = at::empty({M, k}, rows.options().dtype(at::kLong));
  const float *base = rows.data_ptr<float>(), *tab = table.data_ptr<float>();
  float* vo = values.data_ptr<float>();
  int64_t* io = indices.data_ptr<int64_t>();
  const int64_t stride = rows.stride(0);
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x(V);
    for (int64_t m = begin; m < end; ++m) {
      std::memcpy(x.data(), base + o[m] * stride, V * sizeof(float));
      if (h[m] >= 0) {
        const float* add = tab + h[m] * H;
        for (int64_t j = 0; j < H; ++j) x[cols[j]] += add[j];
      }
      node(x.data(), V, k, vo + m * k, io + m * k);
    }
  });
  return {values, indices};
}

// specpipe_cpu::token_info_chain: Lyanna's width-1 trees (chains) whole: for each request b,
// from its root, at every depth d the best child of the last pick under row logits[b, d] plus
// the pick's hot-token table row (as token_info_top_k at k = 1, the same best child: the
// smaller index on ties), [B, D] picks. Only the argmax is kept, so no exp pass; the depths
// are sequential, so one call does what D calls of token_info_top_k and D reads of their
// picks did.
at::Tensor token_info_chain(const at::Tensor& logits, const at::Tensor& roots, const at::Tensor& hot_index,
                            const at::Tensor& hot_ids, const at::Tensor& table) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 3 &&
                  logits.stride(2) == 1,
              "specpipe_cpu::token_info_chain takes fp32 CPU [B, D, V] logits with contiguous rows");
  const int64_t B = logits.size(0), D = logits.size(1), V = logits.size(2), H = hot_ids.size(0);
  TORCH_CHECK(roots.dim() == 1 && roots.size(0) == B && roots.scalar_type() == at::kLong, "one int64 root per row");
  TORCH_CHECK(hot_index.numel() == 0 || (hot_index.numel() == V && hot_index.scalar_type() == at::kLong),
              "hot_index must be empty (no table) or int64 [V]");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.is_contiguous() && table.size(1) == H &&
                  (hot_index.numel() == 0 || table.size(0) == H),
              "the hot-token table must be a contiguous fp32 [H, H] tensor over hot_ids");
  const auto root = roots.contiguous(), index = hot_index.contiguous(), ids = hot_ids.contiguous();
  const int64_t *r = root.data_ptr<int64_t>(), *cols = ids.data_ptr<int64_t>();
  const int64_t* hot = index.numel() ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < V, "row ", b, ": root out of range");
  for (int64_t j = 0; j < H; ++j) TORCH_CHECK(cols[j] >= 0 && cols[j] < V, "hot id out of range");
  auto picks = at::empty({B, D}, roots.options());
  int64_t* out = picks.data_ptr<int64_t>();
  const float *base = logits.data_ptr<float>(), *tab = table.data_ptr<float>();
  const int64_t sb = logits.stride(0), sd = logits.stride(1);
  at::parallel_for(0, B, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x(V);
    for (int64_t b = begin; b < end; ++b) {
      int64_t prev = r[b];
      for (int64_t d = 0; d < D; ++d) {
        const float* row = base + b * sb + d * sd;
        const int64_t h = hot ? hot[prev] : -1;
        TORCH_CHECK(h >= -1 && h < H, "hot_index out of range at token ", prev);
        if (h >= 0) {  // the row with its table row added at the hot columns (token_info_top_k's copy)
          std::memcpy(x.data(), row, V * sizeof(float));
          const float* add = tab + h * H;
          for (int64_t j = 0; j < H; ++j) x[cols[j]] += add[j];
          row = x.data();
        }
        float best;
        specpipe_lanes::top_k(row, V, 1, &best, &prev);
        out[b * D + d] = prev;
      }
    }
  });
  return picks;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "token_info_top_k(Tensor rows, Tensor owners, Tensor hot_rows, Tensor hot_ids, Tensor table, int k) -> "
      "(Tensor, Tensor)");
  m.def("token_info_chain(Tensor logits, Tensor roots, Tensor hot_index, Tensor hot_ids, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) {
  m.impl("token_info_top_k", &token_info_top_k);
  m.impl("token_info_chain", &token_info_chain);
}
