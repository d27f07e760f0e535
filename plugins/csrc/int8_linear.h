// The int8 product of `specpipe_cpu::int8_linear` (plugins/int8_linear.py has the contract and
// the plain-torch reference it is tested against bit for bit), shared by the ops that run a
// drafter's linears (draft_lm_forward_cpu.cpp).
//
//   x [M, I] fp32, w [O, I] int8 (symmetric, one scale per output row: w_scale [O]),
//   w_sum [O] int32 = sum_i w[o, i]
//   per row m:  s_m = max(max_i |x[m, i]|, FLT_MIN) / 127,  q[m, i] = round_half_even(x[m, i] / s_m)
//   y[m, o] = float(sum_i q[m, i] w[o, i]) * (s_m * w_scale[o])
//
// The integer sums are exact, so any summation order gives the same bits. With AVX-512 VNNI
// `vpdpbusd` multiplies unsigned by signed bytes: the kernel feeds q + 128 (0..255) and takes
// 128 w_sum[o] back off. With AVX2 only (no VNNI), `vpmaddubsw` multiplies |q| (0..127) by
// w carrying q's sign (`vpsignb`), so a pair sum is at most 2 x 127 x 127 < 2^15 and never
// saturates: exact too, given w in [-127, 127] (`Int8Weight.of` checks; fbgemm's symmetric
// scales give that), and `vpmaddwd` by ones widens the pairs to 32 bits. Unlike fbgemm's
// dynamic linear, activations keep 8 bits (fbgemm's x86 path uses 7 to stay clear of int16
// saturation, which vpdpbusd does not have) and nothing is allocated or packed per call:
// fbgemm spends ~13 us a call before its first product, which on the demo draft LM's
// 256-wide layers is most of the call.
//
// 4-bit weights (`--drafter-head int4`): w in [-8, 7] with the same per-row scales (max|w| / 7),
// so the same formula and the same exact sums; only the blocked copy differs. Under VNNI it
// holds two weights a byte ([ceil(O/16), ceil(I/8), 16, 4] uint8, `block_weight4`): the low
// nibbles of a 64-byte line are int8 line 2j's w + 8, the high nibbles line 2j + 1's. A line
// is unpacked with two ANDs and a shift, and `vpdpbusd` takes the nibbles as its unsigned
// operand and q as its signed one: sum (w + 8) q, less 8 sum q. A draft level is a stream of
// its weights, so half the head's bytes is what it is for.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lanes.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECPIPE_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define SPECPIPE_AVX2 1
#endif

namespace specpipe {

// One row: q = round(x / s), returns s; x and q [I]. The largest |x| is taken a vector of
// lanes at a time (a max is exact in any order; a NaN lane is passed over, as the scalar
// std::max(top, |x|) passes it over), then each x / s rounded half to even: the same division
// and rounding as the reference, so the same bits. `qu` (when given): q + 128 as unsigned
// bytes, what vpdpbusd reads (`int8_tile`).
inline float quantize_row(const float* x, int64_t I, int8_t* q, uint8_t* qu = nullptr) {
  using specpipe_lanes::kWide;
  using specpipe_lanes::vw;
  vw tops = {};
  int64_t i = 0;
  for (; i + kWide <= I; i += kWide) {
    const vw v = specpipe_lanes::load_w(x + i);
    const vw a = v < 0.0f ? -v : v;  // |x| (a -0 stays -0: no max above +0 differs)
    tops = a > tops ? a : tops;
  }
  float top = 0.0f;
  for (int l = 0; l < kWide; ++l) top = std::max(top, tops[l]);
  for (; i < I; ++i) top = std::max(top, std::fabs(x[i]));
  const float scale = std::max(top, FLT_MIN) / 127.0f;
  for (int64_t k = 0; k < I; ++k) q[k] = static_cast<int8_t>(std::nearbyint(x[k] / scale));
  if (qu != nullptr)
    for (int64_t k = 0; k < I; ++k) qu[k] = static_cast<uint8_t>(q[k]) ^ 0x80u;  // q + 128 in two's complement
  return scale;
}

// The arguments' layout, which the kernel reads as raw memory: w [O, I] int8 dense, its
// blocked copy [ceil(O/16), ceil(I/4), 16, 4], w_scale [O] fp32, w_sum [O] int32.
inline void check_int8_weight(const at::Tensor& w, const at::Tensor& blocked, const at::Tensor& w_scale,
                              const at::Tensor& w_sum) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be a dense [O, I] int8 tensor");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt && w_scale.is_contiguous() &&
                  w_sum.is_contiguous() && w_scale.numel() == w.size(0) && w_sum.numel() == w.size(0),
              "w_scale [O] float32 and w_sum [O] int32");
  const int64_t blocks = (w.size(0) + 15) / 16;
  if (blocked.scalar_type() == at::kByte) {
#ifndef SPECPIPE_VNNI
    TORCH_CHECK(false, "4-bit blocked weights need AVX-512 VNNI; take the int8 layout (plugins.int8_linear.block_weight)");
#endif
    TORCH_CHECK(blocked.is_contiguous() && blocked.sizes() == at::IntArrayRef({blocks, (w.size(1) + 7) / 8, 16, 4}),
                "a uint8 blocked copy must be w's [ceil(O/16), ceil(I/8), 16, 4] nibbles (plugins.int8_linear.block_weight4)");
    return;
  }
  TORCH_CHECK(blocked.scalar_type() == at::kChar && blocked.is_contiguous() &&
                  blocked.sizes() == at::IntArrayRef({blocks, (w.size(1) + 3) / 4, 16, 4}),
              "blocked must be w's [ceil(O/16), ceil(I/4), 16, 4] int8 copy (plugins.int8_linear.block_weight)");
}

// sum_i q[i] w[i] over I (any I), exact.
inline int32_t dot_i8(const int8_t* q, const int8_t* w, int64_t I) {
  int32_t acc = 0;
  for (int64_t i = 0; i < I; ++i) acc += static_cast<int32_t>(q[i]) * static_cast<int32_t>(w[i]);
  return acc;
}

#ifdef SPECPIPE_VNNI
// NB blocks of 16 output rows (from b) for R rows of x (from m0): NB x R independent
// accumulators, so consecutive `vpdpbusd`s do not wait on each other. The loops over them are
// unrolled by pragma: left to itself GCC 12 kept the accumulators on the stack, a store and
// a reload around every `vpdpbusd` (perf annotate), and a one-row product with the demo
// drafter's 8192 x 384 head took 26.9 us where it takes 20.3 (384 x 384: 4.4 -> 3.6 us).
template <bool Nibbles, int NB, int R>
inline void int8_tile(const uint8_t* x, const int32_t* sums, const float* s, int64_t Ip, const uint8_t* blocked,
                      const float* w_scale, float* y, int64_t O, int64_t b, int64_t m0) {
  // int8: x = q + 128, one line of 4 inputs a step, sums = w_sum (128 w_sum taken back per output).
  // Nibbles (4-bit weights): x = q, a line of 8 inputs a step (low nibbles: inputs 0-3, high: 4-7,
  // each w + 8), `vpdpbusd` takes the nibbles as its unsigned operand; sums = q_sum (8 q_sum
  // taken back per row).
  constexpr int64_t kInputs = Nibbles ? 8 : 4;
  const int64_t J = Ip / kInputs;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i acc[NB][R];
  #pragma GCC unroll 16
  for (int n = 0; n < NB; ++n) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < J; ++j) {
    __m512i lo_x[R], hi_x[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t four[2];
      std::memcpy(four, x + (m0 + r) * Ip + kInputs * j, kInputs);
      lo_x[r] = _mm512_set1_epi32(four[0]);
      if constexpr (Nibbles) hi_x[r] = _mm512_set1_epi32(four[1]);
    }
    #pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) {
      const __m512i line = _mm512_loadu_si512(blocked + ((b + n) * J + j) * 64);
      if constexpr (Nibbles) {
        const __m512i lo = _mm512_and_si512(line, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[n][r], lo, lo_x[r]), hi, hi_x[r]);
      } else {
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_dpbusd_epi32(acc[n][r], lo_x[r], line);
      }
    }
  }
  #pragma GCC unroll 16
  for (int n = 0; n < NB; ++n) {
    const int64_t o = 16 * (b + n), lanes_n = std::min<int64_t>(16, O - o);
    const __mmask16 lanes = static_cast<__mmask16>((1u << lanes_n) - 1u);
    const __m512 scales = _mm512_maskz_loadu_ps(lanes, w_scale + o);
    __m512i w_offset = _mm512_setzero_si512();  // int8: 128 w_sum of this block's outputs, once for all rows
    if constexpr (!Nibbles) w_offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, sums + o), 7);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i offset = Nibbles ? _mm512_set1_epi32(8 * sums[m0 + r]) : w_offset;
      const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[n][r], offset));
      _mm512_mask_storeu_ps(y + (m0 + r) * O + o, lanes, _mm512_mul_ps(exact, _mm512_mul_ps(_mm512_set1_ps(s[m0 + r]), scales)));
    }
  }
}

// f(std::integral_constant<int, R>) for R = rows (1-4): a tile's rows as a template argument.
template <typename F>
inline void by_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

#endif

#ifdef SPECPIPE_AVX2
// NB blocks of 16 output rows (from b) for R rows of x (from m0), each 64-byte line of the
// blocked weight taken as two 32-byte halves (outputs 0-7 and 8-15): 2 NB x R independent
// accumulators. Two blocks a tile for one or two rows: on the AVX2 EPYC, 1 x 256 x 1536
// 16-19 -> 11-16 us and 2 x 256 x 8192 73-80 -> 50-57 us a call (alternating runs).
template <int NB, int R>
inline void int8_tile_avx2(const int8_t* q, const float* s, int64_t Ip, const int8_t* blocked, const float* w_scale,
                           float* y, int64_t O, int64_t b, int64_t m0) {
  const int64_t J = Ip / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[2 * NB][R];
  #pragma GCC unroll 16
  for (int h = 0; h < 2 * NB; ++h) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_si256();
  }
  for (int64_t j = 0; j < J; ++j) {
    __m256i xs[R], xa[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, q + (m0 + r) * Ip + 4 * j, 4);
      xs[r] = _mm256_set1_epi32(four);
      xa[r] = _mm256_abs_epi8(xs[r]);
    }
    #pragma GCC unroll 16
    for (int h = 0; h < 2 * NB; ++h) {  // half h of block b + h / 2
      const __m256i wv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocked + ((b + h / 2) * J + j) * 64 + 32 * (h % 2)));
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(xa[r], _mm256_sign_epi8(wv, xs[r]));
        acc[h][r] = _mm256_add_epi32(acc[h][r], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < 2 * NB; ++h) {
    const int64_t o = 16 * b + 8 * h, lanes = std::min<int64_t>(8, O - o);
    if (lanes <= 0) break;
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float* out = y + (m0 + r) * O + o;
      const __m256 exact = _mm256_cvtepi32_ps(acc[h][r]);
      if (lanes == 8) {
        _mm256_storeu_ps(out, _mm256_mul_ps(exact, _mm256_mul_ps(_mm256_set1_ps(s[m0 + r]), _mm256_loadu_ps(w_scale + o))));
      } else {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, exact);
        for (int64_t l = 0; l < lanes; ++l) out[l] = sums[l] * (s[m0 + r] * w_scale[o + l]);
      }
    }
  }
}
#endif

// Output rows are taken 16 at a time from the blocked copy of w, `blocked [ceil(O/16),
// ceil(I/4), 16, 4]` (`plugins.int8_linear.block_weight`: element [b, j, r, c] = w[16 b + r,
// 4 j + c], zero past w's edges), so one `vpdpbusd` adds 4 inputs' products into 16 outputs'
// lanes: no horizontal sums. Tiles of 4 blocks x 4 rows of x (padded to 4 ceil(I/4) with
// q = 0). y [M, O] dense, output blocks [b0, b1).
inline void int8_blocks(const uint8_t* qu, const int8_t* q, const int32_t* q_sum, const float* s, int64_t M,
                        int64_t I, int64_t Ip, const int8_t* blocked, bool nibbles, const int8_t* w,
                        const float* w_scale, const int32_t* w_sum, float* y, int64_t O, int64_t b0, int64_t b1) {
#ifdef SPECPIPE_VNNI
  (void)w;
  (void)I;
  const auto* lines = reinterpret_cast<const uint8_t*>(blocked);
  const auto* q_bytes = reinterpret_cast<const uint8_t*>(q);
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    by_rows(std::min<int64_t>(4, M - m0), [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      int64_t b = b0;
      if (nibbles) {
        for (; b + 4 <= b1; b += 4) int8_tile<true, 4, R>(q_bytes, q_sum, s, Ip, lines, w_scale, y, O, b, m0);
        for (; b < b1; ++b) int8_tile<true, 1, R>(q_bytes, q_sum, s, Ip, lines, w_scale, y, O, b, m0);
        return;
      }
      for (; b + 4 <= b1; b += 4) int8_tile<false, 4, R>(qu, w_sum, s, Ip, lines, w_scale, y, O, b, m0);
      for (; b < b1; ++b) int8_tile<false, 1, R>(qu, w_sum, s, Ip, lines, w_scale, y, O, b, m0);
    });
  }
#elif defined(SPECPIPE_AVX2)
  (void)qu;
  (void)q_sum;
  (void)nibbles;
  (void)w;
  (void)I;
  (void)w_sum;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t R = std::min<int64_t>(4, M - m0);
    int64_t b = b0;
    if (R <= 2) {  // few rows: two blocks a tile, four or eight independent accumulators
      for (; b + 2 <= b1; b += 2) {
        if (R == 2) int8_tile_avx2<2, 2>(q, s, Ip, blocked, w_scale, y, O, b, m0);
        else int8_tile_avx2<2, 1>(q, s, Ip, blocked, w_scale, y, O, b, m0);
      }
    }
    for (; b < b1; ++b) {
      switch (R) {
        case 4: int8_tile_avx2<1, 4>(q, s, Ip, blocked, w_scale, y, O, b, m0); break;
        case 3: int8_tile_avx2<1, 3>(q, s, Ip, blocked, w_scale, y, O, b, m0); break;
        case 2: int8_tile_avx2<1, 2>(q, s, Ip, blocked, w_scale, y, O, b, m0); break;
        default: int8_tile_avx2<1, 1>(q, s, Ip, blocked, w_scale, y, O, b, m0);
      }
    }
  }
#else
  (void)qu;
  (void)q_sum;
  (void)nibbles;
  (void)blocked;
  for (int64_t o = 16 * b0; o < std::min<int64_t>(16 * b1, O); ++o)
    for (int64_t m = 0; m < M; ++m)
      y[m * O + o] = static_cast<float>(dot_i8(q + m * Ip, w + o * I, I)) * (s[m] * w_scale[o]);
#endif
}

// The whole product: x [M, I] fp32 dense, w [O, I] int8 dense and its blocked copy,
// w_scale [O] fp32, w_sum [O] int32.
inline at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& blocked,
                              const at::Tensor& w_scale, const at::Tensor& w_sum) {
  const bool nibbles = blocked.scalar_type() == at::kByte;  // 4-bit weights (VNNI only: check_int8_weight)
  const int64_t M = x.size(0), I = x.size(1), O = w.size(0), Ip = nibbles ? (I + 7) / 8 * 8 : (I + 3) / 4 * 4;
  at::Tensor y = at::empty({M, O}, x.options());
  std::vector<int8_t> q(M * Ip, 0);
  std::vector<uint8_t> qu(nibbles ? 0 : M * Ip, 128);
  std::vector<int32_t> q_sum(M, 0);
  std::vector<float> s(M);
  const float* xp = x.data_ptr<float>();
  // Rows quantized over ATen's threads where there are many (a draft LM catching up on a
  // prompt: ~1000 rows; quantized on one thread while the other waited, they were ~1/4 of
  // the call). Only vpdpbusd reads the unsigned copy (int8) or the row sums (4-bit); the
  // unsigned copy's padding stays 128 (q's 0).
  const int64_t row_grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, I));
  const auto quantize = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* qm = q.data() + m * Ip;
#ifdef SPECPIPE_VNNI
      s[m] = quantize_row(xp + m * I, I, qm, nibbles ? nullptr : qu.data() + m * Ip);
      if (nibbles)
        for (int64_t i = 0; i < I; ++i) q_sum[m] += qm[i];
#else
      s[m] = quantize_row(xp + m * I, I, qm);
#endif
    }
  };
  if (M > row_grain)  // (a parallel_for that runs inline still costs ~0.4 us: a drafter level makes ~9 calls)
    at::parallel_for(0, M, row_grain, quantize);
  else
    quantize(0, M);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = w_scale.data_ptr<float>();
  const int32_t* sum = w_sum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  // a thread only for products worth it (~1 us of work per 256k products)
  const int64_t blocks = (O + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, 16 * M * Ip));
  const auto* bp = static_cast<const int8_t*>(blocked.const_data_ptr());
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int8_blocks(qu.data(), q.data(), q_sum.data(), s.data(), M, I, Ip, bp, nibbles, wp, sp, sum, yp, O, b0, b1);
  });
  return y;
}

// Linear k of an op's int8 lists (weight, blocked, scale, sum: `Int8Weight`'s fields, one
// entry per linear), on dense rows x [M, I].
struct Int8Linears {
  at::TensorList weight, blocked, scale, sum;
  at::Tensor operator()(int64_t k, const at::Tensor& x) const {  // the kernel reads raw memory: widths must agree
    TORCH_CHECK(x.size(1) == weight[k].size(1), "linear ", k, " takes ", weight[k].size(1), " inputs, got ", x.size(1));
    return int8_linear(x, weight[k], blocked[k], scale[k], sum[k]);
  }
};

}  // namespace specpipe
