// specpipe_cpu::argmax_rows: the CPU kernel of `specpipe::argmax_rows`; plugins/argmax_rows.py
// has the contract and the plain-torch reference this is tested against
// (tests/plugins/test_argmax_rows.py: the same indices, ties and NaN included).
//
// The greedy token of every row of every tensor of a list (each request's verified tree
// or decode token), in one call: per row the first index of its largest value, or of its
// first NaN where it has one (torch.argmax's rule), in one pass over a row, a vector of the
// CPU's width at a time. torch.argmax over one request's rows at a time cost ~10 us a call
// plus ~7 us a row of 8192 logits here (32 requests: ~1 ms a step); this reads each row at
// memory speed.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "lanes.h"

namespace {

using namespace specpipe_lanes;

int64_t first_nan(const float* x, int64_t V) {
  for (int64_t i = 0; i < V; ++i)
    if (x[i] != x[i]) return i;
  return -1;
}

// One pass: each lane keeps the largest value it has seen and the first index holding it
// (strictly greater replaces), and whether it saw a NaN; then the lanes' best, the
// smallest index among the lanes that hold it, and the tail past the last whole chunk.
// At the CPU's own width (`kWide`): 16 lanes on an AVX2 CPU ran as scalar code, ~10x slower.
int64_t argmax_row(const float* x, int64_t V) {
  const int64_t body = V / kWide * kWide;
  float best = x[0];
  int64_t at = 0;
  bool nan = false;
  if (body > 0) {
    vw m = load_w(x);
    iw index;
    for (int l = 0; l < kWide; ++l) index[l] = l;
    iw seen_nan = m != m;
    iw here = index;
    for (int64_t i = kWide; i < body; i += kWide) {
      const vw v = load_w(x + i);
      here += static_cast<int32_t>(kWide);
      const iw wins = v > m;  // a NaN lane never wins here ...
      m = wins ? v : m;
      index = wins ? here : index;
      seen_nan |= v != v;  // ... it is flagged instead
    }
    for (int l = 0; l < kWide; ++l) {
      nan = nan || seen_nan[l] != 0;
      if (m[l] > best || (m[l] == best && index[l] < at)) best = m[l], at = index[l];
    }
  }
  for (int64_t i = body; i < V; ++i) {
    nan = nan || x[i] != x[i];
    if (x[i] > best) best = x[i], at = i;
  }
  return nan ? first_nan(x, V) : at;
}

at::Tensor argmax_rows(const std::vector<at::Tensor>& logits) {
  TORCH_CHECK(!logits.empty(), "specpipe_cpu::argmax_rows needs at least one tensor");
  const int64_t V = logits[0].size(-1);
  std::vector<const float*> rows;
  for (const auto& t : logits) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
                "specpipe_cpu::argmax_rows takes fp32 CPU [rows, V] tensors with contiguous rows");
    TORCH_CHECK(t.size(1) == V && V >= 1, "every tensor needs the same V >= 1, got ", t.size(1), " and ", V);
    const float* base = t.data_ptr<float>();
    for (int64_t r = 0; r < t.size(0); ++r) rows.push_back(base + r * t.stride(0));
  }
  const int64_t N = static_cast<int64_t>(rows.size());
  auto out = at::empty({N}, logits[0].options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(rows[r], V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) { m.def("argmax_rows(Tensor[] logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
