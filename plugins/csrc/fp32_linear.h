// The fp32 product of `specpipe_cpu::fp32_linear` for the few-row products of decoding
// (plugins/fp32_linear.py has the contract and the plain-torch reference), shared by the
// target's one-call forward (llama_forward_cpu.cpp).
//
//   x [M, I] fp32 dense, weight [O, I] blocked as [ceil(O/16), I, 16] (`block16`: 16 output
//   rows per 64-byte line, zero past O), y [M, O] = x weight^T
//   y[m, o] = sum_i x[m, i] w[o, i], the sum in order i = 0 .. I-1, one fp32 accumulator
//
// A register tile of up to 6 rows x 16 outputs (12 AVX2 vectors; BLIS's Haswell shape), or
// under AVX-512 6 rows x 4 blocks of 16 (24 of its 32 registers), runs down the whole input
// dimension, so each weight line is read once per 6 rows, from memory for the first tile and
// from cache for the next. On a 2-core Sapphire Rapids the 4-block tile took the demo
// target's 25 products at 6 rows 1.97 -> 1.59 ms, 11 rows 3.59 -> 2.30, 16 rows 5.26 -> 3.04,
// 32 rows 9.4 -> 5.4 (1 row 1.28 -> 1.22; a randn of each input inside the timed loop
// included); with inputs made beforehand, 6 rows cost what 1 row does (~1.2 ms, the stream). At decoding's
// few rows the product is a stream of the weights: oneDNN's blocked kernels (what
// `pack_cpu_weights` makes for every M) took ~2x as long there (the demo target's 25
// products, 1 row: 3.9 vs 1.9 ms; 5 rows 4.4 vs 2.2) and win from ~40 rows up.
// Each output's sum runs in the same order whatever M is and wherever its row falls in a
// tile, so a row's result does not depend on the other rows of the call.
//
// A call of 2-6 rows (one tile: a draft tree's tokens at batch 1, a few requests' plain
// step) reads each weight line once and streams it non-temporally (`kStream`: a prefetch
// with locality 0, PREFETCHNTA on x86, 32 lines ahead), so the forward's ~50 MB of weights
// do not flush the last-level cache of what the step's host work and the drafter use next.
// Measured in one process, alternating (2-thread AMD EPYC, demo engines, 8-10 rounds):
// load-aware ReDrafter at batch 1, T=0 +3.8% / +7.2% tokens/s, auto-regression at batch 4
// +7.4%; at batch 1 and 2 auto-regression unchanged (1.000 / 0.994, 1.013). Not at one row:
// there consecutive decoding forwards reuse part of the weights from that cache (the
// batch-1 forward runs ~0.74 ms hot against ~1.07 cold), and streaming every one-row
// product cost auto-regression at batch 1 3-4%. Past one tile (7-48 rows: a batch of plain
// steps, a few requests' trees) the first tile of each group of blocks prefetches the same
// 32 lines ahead, but temporally (locality 3, PREFETCHT0: the tiles after it read those
// lines from cache), and the others none. Measured in lockstep against the same engine
// without it (session 44, 2-thread AMD EPYC, demo engines): auto-regression at batch 8
// +3.0% tokens/s (its forward 1.63 -> 1.53 ms), load-aware ReDrafter at batch 4 +3.0%,
// auto-regression at batch 32 within noise (1.000 against 1.003 without; forward 3.82 ->
// 3.77 ms). A prefetch is a hint: the arithmetic, and so the result, is the same.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "lanes.h"

namespace specpipe {

namespace fp32_linear_detail {

using specpipe_lanes::kWide;
using specpipe_lanes::load_w;
using specpipe_lanes::store_w;
using specpipe_lanes::vw;

constexpr int64_t kBlock = 16;               // outputs per weight line
constexpr int64_t kVectors = kBlock / kWide;  // 2 on AVX2, 1 under AVX-512
constexpr int kRows = 6;                     // rows per register tile
// 16-output blocks per register tile: under AVX-512's 32 registers, 4 blocks x 6 rows = 24
// accumulators, so each broadcast row value feeds 4 FMAs and one row still has 4 independent
// sums in flight; AVX2's 16 registers hold one block (12 accumulators).
constexpr int kBlocks = kWide == 16 ? 4 : 1;

constexpr int64_t kAhead = 32;  // lines ahead of the one read that a prefetching tile prefetches

enum Prefetch { kNone, kStream, kKeep };  // the weight lines ahead: not, non-temporally, temporally

// MR rows of x (row stride ldx) times NB consecutive 16-output blocks wb [NB][I, 16] -> out
// (row stride ldy), `cols` <= 16 NB of its outputs stored. Each output is one accumulator
// summed over i in order, whatever MR and NB are. `P`: how the weight lines ahead are
// prefetched (the header's note).
template <int MR, int NB, Prefetch P>
void tile(const float* x, int64_t ldx, const float* wb, int64_t I, float* out, int64_t ldy, int64_t cols) {
  vw acc[MR][NB][kVectors] = {};
  for (int64_t i = 0; i < I; ++i) {
    if (P != kNone && i + kAhead < I)
      for (int b = 0; b < NB; ++b) __builtin_prefetch(wb + (b * I + i + kAhead) * kBlock, 0, P == kKeep ? 3 : 0);
    vw w[NB][kVectors];
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < kVectors; ++j) w[b][j] = load_w(wb + (b * I + i) * kBlock + j * kWide);
    for (int m = 0; m < MR; ++m) {
      const vw xm = vw{} + x[m * ldx + i];
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < kVectors; ++j) acc[m][b][j] += xm * w[b][j];
    }
  }
  if (cols == NB * kBlock) {
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < kVectors; ++j) store_w(out + m * ldy + b * kBlock + j * kWide, acc[m][b][j]);
    return;
  }
  for (int m = 0; m < MR; ++m) {
    float line[NB * kBlock];
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < kVectors; ++j) store_w(line + b * kBlock + j * kWide, acc[m][b][j]);
    std::copy(line, line + cols, out + m * ldy);
  }
}

// The last M - r rows (at most kRows) times NB consecutive blocks, prefetching as `P` says.
static_assert(kRows == 6, "`rest` takes up to kRows rows, one case each");
template <int NB, Prefetch P>
void rest(const float* x, int64_t M, int64_t r, const float* wb, int64_t I, float* out, int64_t O, int64_t cols) {
  switch (M - r) {
    case 6: tile<6, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    case 5: tile<5, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    case 4: tile<4, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    case 3: tile<3, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    case 2: tile<2, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    case 1: tile<1, NB, P>(x + r * I, I, wb, I, out + r * O, O, cols); break;
    default: break;
  }
}

// All M rows times NB consecutive blocks, in tiles of kRows rows and then the rest: one row
// not prefetched, one tile of 2-6 streamed, more tiles the first prefetched temporally
// (the header's note).
template <int NB>
void rows(const float* x, int64_t M, const float* wb, int64_t I, float* out, int64_t O, int64_t cols) {
  if (M <= kRows) {
    if (M > 1)
      rest<NB, kStream>(x, M, 0, wb, I, out, O, cols);
    else
      rest<NB, kNone>(x, M, 0, wb, I, out, O, cols);
    return;
  }
  tile<kRows, NB, kKeep>(x, I, wb, I, out, O, cols);
  int64_t r = kRows;
  for (; r + kRows <= M; r += kRows) tile<kRows, NB, kNone>(x + r * I, I, wb, I, out + r * O, O, cols);
  rest<NB, kNone>(x, M, r, wb, I, out, O, cols);
}

}  // namespace fp32_linear_detail

// The layout the kernel reads as raw memory: blocked [ceil(O/16), I, 16] fp32 dense.
inline void check_fp32_blocked(const at::Tensor& blocked, int64_t out_features) {
  TORCH_CHECK(blocked.scalar_type() == at::kFloat && blocked.dim() == 3 && blocked.size(2) == 16 &&
                  blocked.is_contiguous() && blocked.device().is_cpu(),
              "a blocked fp32 weight must be a dense [ceil(O/16), I, 16] CPU tensor (plugins.fp32_linear.block16)");
  TORCH_CHECK(out_features > 16 * (blocked.size(0) - 1) && out_features <= 16 * blocked.size(0),
              out_features, " outputs do not fit ", blocked.size(0), " blocks of 16");
}

// y [M, O] = x [M, I] times the blocked weight's transpose; blocks spread over ATen's threads.
inline at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& blocked, int64_t out_features) {
  using namespace fp32_linear_detail;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be a dense [M, I] float32 tensor");
  check_fp32_blocked(blocked, out_features);
  const int64_t M = x.size(0), I = x.size(1), O = out_features, B = blocked.size(0);
  TORCH_CHECK(blocked.size(1) == I, "the weight takes ", blocked.size(1), " inputs, got ", I);
  at::Tensor y = at::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = blocked.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Groups of kBlocks blocks over ATen's threads; a group holding the last, partial block goes
  // a block at a time.
  const int64_t groups = (B + kBlocks - 1) / kBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * kBlocks, b1 = std::min(B, b0 + kBlocks);
      if (b1 - b0 == kBlocks && O >= b1 * kBlock) {
        rows<kBlocks>(xp, M, wp + b0 * I * kBlock, I, yp + b0 * kBlock, O, kBlocks * kBlock);
        continue;
      }
      for (int64_t b = b0; b < b1; ++b)
        rows<1>(xp, M, wp + b * I * kBlock, I, yp + b * kBlock, O, std::min(kBlock, O - b * kBlock));
    }
  });
  return y;
}

}  // namespace specpipe
