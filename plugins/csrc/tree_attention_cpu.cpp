// specpipe_cpu::tree_attention: the CPU kernel of `specpipe::tree_attention` for short
// groups (decode tokens, draft trees); plugins/tree_attention.py has the contract and the
// plain-torch reference this is tested against (tests/plugins/test_tree_attention.py).
//
// Work items are (request g, KV head kh), spread over ATen's threads. An item's R =
// T x (H / H_kv) query rows go four at a time, reading keys and values straight from their
// cache slots (no padded copy of the paged cache), at the CPU's own vector width (`kWide`:
// 8 lanes on AVX2, where 16-lane vectors spilled and compiled to scalar compares): scores a
// chunk of kWide keys at a time (kWide partial-dot vectors summed across lanes together,
// `lane_sums`), outputs with each value loaded once for the four rows. For each row, over
// the keys j it may see (Vaswani et al. 2017, eq. 1):
//   s_j = (q . k_j) / sqrt(D)
//   p_j = exp(s_j - max_i s_i), exactly 0 for masked keys
//   out = (sum_j p_j v_j) / (sum_j p_j)
// Accumulation in fp32 in a fixed order (keys ascending), so a row's result depends only on
// its own query, keys and mask, never on the other rows of the launch.
// A tile of rows reads keys up to the last any of them sees (`last_seen`; the keys past it
// would add exact zeros): a prompt chunk's causal rows see half its keys on average, and
// skipping the rest took a 512-token prefill of the demo target 44 -> 38 ms.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {

using namespace specpipe_lanes;

inline int64_t padded(int64_t keys) { return (keys + kWide - 1) / kWide * kWide; }  // whole key chunks

inline float lane_max(vw x) {
  float m = x[0];
  for (int l = 1; l < kWide; ++l) m = std::max(m, x[l]);
  return m;
}

#ifdef __AVX512F__
inline float lane_sum(vw x) {  // pairwise: lanes 8 apart, then 4, 2, 1
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// Lane i of the result = the sum of x[i]'s 16 lanes: a butterfly of shuffles, each level
// halving the vectors and doubling the keys per vector (x[i]: key i's 16 partial dots).
// A key's sum takes the same additions in the same order wherever its chunk is.
inline vw lane_sums(const vw (&x)[kWide]) {
  vw a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i]: lanes 0-7 key 2i, 8-15 key 2i+1
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // b[i]: quarters hold keys 4i, 4i+2, 4i+1, 4i+3
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // c[i]: pairs hold keys 8i + 0, 4, 2, 6, 1, 5, 3, 7
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vw d =  // lane L holds key bitreverse4(L)
      __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
      __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#else
inline float lane_sum(vw x) {  // pairwise: lanes 4 apart, then 2, 1
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
  return x[0];
}

// The same butterfly over 8 keys of 8 partial dots.
inline vw lane_sums(const vw (&x)[kWide]) {
  vw a[4], b[2];
  for (int i = 0; i < 4; ++i)  // a[i]: lanes 0-3 key 2i, 4-7 key 2i+1
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // b[i]: pairs hold keys 4i, 4i+2, 4i+1, 4i+3
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const vw d =  // lane L holds key bitreverse3(L)
      __builtin_shufflevector(b[0], b[1], 0, 8, 2, 10, 4, 12, 6, 14) +
      __builtin_shufflevector(b[0], b[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(d, d, 0, 4, 2, 6, 1, 5, 3, 7);
}
#endif

// Output vectors a row keeps in registers at once: the largest power of two <= C and <= the
// accumulators the register file holds for NR rows (AVX2: 16 registers, 8 for accumulators;
// AVX-512: 32 and 16), so it divides C.
constexpr int64_t column_block(int64_t C, int NR) {
  int64_t cb = 1;
  while (cb * 2 <= C && cb * 2 * NR <= (kWide == 16 ? 16 : 8)) cb *= 2;
  return cb;
}

// 1 + the last key column any of the first `nr` rows sees (at least 1), of S.
inline int64_t last_seen(const bool* const (&mask_rows)[4], int nr, int64_t S) {
  int64_t last = 1;
  for (int r = 0; r < nr; ++r)
    for (int64_t j = S - 1; j >= last; --j)
      if (mask_rows[r][j]) {
        last = j + 1;
        break;
      }
  return last;
}

// NR query rows (at most 4) of one KV head against its S keys, a chunk of kWide keys at a
// time; `rows[r]` = (query row of the flat batch, query head), `mask_rows[r]` = that row's
// S visibility flags, `scores` room for NR rows of S rounded up to the chunk. Keys past S
// (the last chunk's padding) read key 0 and are masked. Blocked for the register file:
// a chunk's kWide partial-dot vectors for one row at a time, and the outputs in column
// blocks (`column_block`).
template <int64_t D, int NR>
void attend_rows(const float* q, int64_t q_row_stride, const float* k, const float* v, int64_t c_slot_stride,
                 const int64_t* key_slots, int64_t S, const int64_t (&rows)[4][2], const bool* const (&mask_rows)[4],
                 float* const (&dst)[4], float* scores) {
  constexpr int64_t C = D / kWide;
  constexpr int64_t CB = column_block(C, NR);
  typedef uint8_t u8w __attribute__((vector_size(kWide)));
  const int64_t sp = padded(S);  // the scores' row stride
  // Keys past the last any of these rows sees add exact zeros: skipped (causal rows of a
  // prompt chunk see half their group's keys on average).
  S = last_seen(mask_rows, NR, S);
  const int64_t chunks = padded(S);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float* qr[NR];
  for (int r = 0; r < NR; ++r) qr[r] = q + rows[r][0] * q_row_stride + rows[r][1] * D;
  vw running_max[NR];
  for (int r = 0; r < NR; ++r) running_max[r] = splat_w(neg_inf);
  for (int64_t j0 = 0; j0 < chunks; j0 += kWide) {  // s_j = q . k_j / sqrt(D)
    const float* kp[kWide];
    for (int64_t l = 0; l < kWide; ++l) kp[l] = k + key_slots[j0 + l < S ? j0 + l : 0] * c_slot_stride;
    for (int r = 0; r < NR; ++r) {
      vw acc[kWide];
      const vw q0 = load_w(qr[r]);
      for (int64_t l = 0; l < kWide; ++l) acc[l] = q0 * load_w(kp[l]);
      for (int64_t c = 1; c < C; ++c) {
        const vw qc = load_w(qr[r] + c * kWide);
        for (int64_t l = 0; l < kWide; ++l) acc[l] += qc * load_w(kp[l] + c * kWide);
      }
      u8w seen = {};
      __builtin_memcpy(&seen, mask_rows[r] + j0, static_cast<size_t>(std::min<int64_t>(kWide, S - j0)));
      const vw sc = __builtin_convertvector(seen, iw) != 0 ? lane_sums(acc) * scale : splat_w(neg_inf);
      store_w(scores + r * sp + j0, sc);
      running_max[r] = running_max[r] > sc ? running_max[r] : sc;
    }
  }
  float inv[NR];
  for (int r = 0; r < NR; ++r) {  // p_j = exp(s_j - m), exactly 0 where masked
    const float m = lane_max(running_max[r]);
    float* s = scores + r * sp;
    vw total = {};
    for (int64_t j0 = 0; j0 < chunks; j0 += kWide) {
      const vw x = load_w(s + j0);
      const vw p = x == neg_inf ? vw{} : exp_nonpositive<vw, iw>(x - m);
      total += p;
      store_w(s + j0, p);
    }
    inv[r] = 1.0f / lane_sum(total);
  }
  for (int64_t c0 = 0; c0 < C; c0 += CB) {  // sum_j p_j v_j, keys in order, CB columns at a time
    vw o[NR][CB] = {};
    for (int64_t j = 0; j < S; ++j) {
      const float* vj = v + key_slots[j] * c_slot_stride + c0 * kWide;
      vw vv[CB];
      for (int64_t c = 0; c < CB; ++c) vv[c] = load_w(vj + c * kWide);
      for (int r = 0; r < NR; ++r) {
        const vw p = splat_w(scores[r * sp + j]);
        for (int64_t c = 0; c < CB; ++c) o[r][c] += p * vv[c];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int64_t c = 0; c < CB; ++c) store_w(dst[r] + (c0 + c) * kWide, o[r][c] * inv[r]);
  }
}

// One (request, KV head): its R = T x group query rows, four at a time.
template <int64_t D>
void attend_item(const float* q, int64_t q_row_stride, const float* k, const float* v, int64_t c_slot_stride,
                 const int64_t* query_index, const int64_t* key_slots, const bool* mask, int64_t mask_row_stride,
                 float* out, int64_t out_row_stride, int64_t T, int64_t S, int64_t group, int64_t kh,
                 std::vector<float>& scores) {
  static_assert(D % kWide == 0);
  scores.resize(4 * padded(S));
  const int64_t R = T * group;
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, R - r0));
    int64_t rows[4][2] = {};
    const bool* mask_rows[4] = {};
    float* dst[4] = {};
    for (int r = 0; r < nr; ++r) {
      const int64_t t = (r0 + r) / group, h = kh * group + (r0 + r) % group;
      rows[r][0] = query_index[t];
      rows[r][1] = h;
      mask_rows[r] = mask + t * mask_row_stride;
      dst[r] = out + t * out_row_stride + h * D;
    }
    const float* kh_k = k + kh * D;
    const float* kh_v = v + kh * D;
    switch (nr) {
      case 4: attend_rows<D, 4>(q, q_row_stride, kh_k, kh_v, c_slot_stride, key_slots, S, rows, mask_rows, dst, scores.data()); break;
      case 3: attend_rows<D, 3>(q, q_row_stride, kh_k, kh_v, c_slot_stride, key_slots, S, rows, mask_rows, dst, scores.data()); break;
      case 2: attend_rows<D, 2>(q, q_row_stride, kh_k, kh_v, c_slot_stride, key_slots, S, rows, mask_rows, dst, scores.data()); break;
      default: attend_rows<D, 1>(q, q_row_stride, kh_k, kh_v, c_slot_stride, key_slots, S, rows, mask_rows, dst, scores.data());
    }
  }
}

// 1 + the last key column any of a request's T rows sees (at least 1): a group pads every
// request's keys to its longest, and the columns past a request's own are masked for all
// its rows, so they add exact zeros and are skipped (at batch 32 of held-out prompts the
// padding was more than half the columns: 366-416 for 127-175 keys a request on average).
inline int64_t keys_seen(const bool* mask, int64_t T, int64_t S) {
  for (int64_t j = S - 1; j > 0; --j)
    for (int64_t t = 0; t < T; ++t)
      if (mask[t * S + j]) return j + 1;
  return 1;
}

template <int64_t D>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& query_index, const at::Tensor& key_slots, const at::Tensor& mask, at::Tensor& out) {
  const int64_t G = query_index.size(0), T = query_index.size(1), S = key_slots.size(1);
  const int64_t H = q.size(1), H_kv = k_cache.size(1), group = H / H_kv;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* qi = query_index.data_ptr<int64_t>();
  const int64_t* ks = key_slots.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, G * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / H_kv, kh = item % H_kv;
      const bool* m = mk + g * T * S;
      attend_item<D>(qp, q.stride(0), kp, vp, k_cache.stride(0), qi + g * T, ks + g * S, m, S, op + g * T * H * D,
                     H * D, T, keys_seen(m, T, S), group, kh, buffer);
    }
  });
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& query_index, const at::Tensor& key_slots, const at::Tensor& mask) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat, "specpipe_cpu::tree_attention takes fp32 CPU q");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat, "fp32 caches only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "q [N,H,D], caches [slots,H_kv,D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.stride(2) == 1 &&
                  k_cache.stride(1) == k_cache.size(2) && v_cache.strides() == k_cache.strides(),
              "q and the caches need dense [heads, D] rows, and both caches one layout");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query_index.scalar_type() == at::kLong && key_slots.scalar_type() == at::kLong &&
                  mask.scalar_type() == at::kBool && query_index.is_contiguous() && key_slots.is_contiguous() &&
                  mask.is_contiguous(),
              "contiguous int64 query_index/key_slots and bool mask");
  const int64_t G = query_index.size(0), T = query_index.size(1), S = key_slots.size(1);
  TORCH_CHECK(query_index.dim() == 2 && key_slots.dim() == 2 && key_slots.size(0) == G && mask.dim() == 3 &&
                  mask.size(0) == G && mask.size(1) == T && mask.size(2) == S,
              "query_index [G, T], key_slots [G, S] and mask [G, T, S]");
  const int64_t* qi = query_index.data_ptr<int64_t>();
  const int64_t* ks = key_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < G * T; ++i)  // the kernel reads raw memory: every index must be in range
    TORCH_CHECK(qi[i] >= 0 && qi[i] < q.size(0), "query_index ", qi[i], " out of range for ", q.size(0), " rows");
  for (int64_t i = 0; i < G * S; ++i)
    TORCH_CHECK(ks[i] >= 0 && ks[i] < k_cache.size(0), "key slot ", ks[i], " out of range for ", k_cache.size(0), " slots");
  const int64_t D = q.size(2);
  auto out = at::empty({G, T, q.size(1), D}, q.options());
  switch (D) {
    case 32: attend_all<32>(q, k_cache, v_cache, query_index, key_slots, mask, out); break;
    case 64: attend_all<64>(q, k_cache, v_cache, query_index, key_slots, mask, out); break;
    case 128: attend_all<128>(q, k_cache, v_cache, query_index, key_slots, mask, out); break;
    default: TORCH_CHECK(false, "specpipe_cpu::tree_attention supports head_dim 32, 64 or 128, got ", D);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specpipe_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_index, Tensor key_slots, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
