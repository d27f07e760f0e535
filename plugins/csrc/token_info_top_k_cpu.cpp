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

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def(
      "token_info_top_k(Tensor rows, Tensor owners, Tensor hot_rows, Tensor hot_ids, Tensor table, int k) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("token_info_top_k", &token_info_top_k); }
