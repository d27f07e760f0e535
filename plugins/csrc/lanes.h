// fp32 and int32 vectors of the CPU's own width (GCC/Clang vector extension): what the CPU
// kernels that compare or accumulate a vector of values at a time share, and the exp they
// take of scores and logits (any lane count).
#pragma once

#include <cstdint>

namespace specpipe_lanes {

// The CPU's own vector width: 16 fp32 lanes under AVX-512, else 8 (AVX2). Code with int32
// lanes or float <-> int conversions runs at this width: at 16 lanes without AVX-512, GCC
// compiles those to scalar code (an AVX2 EPYC: a Cephes exp ~7x slower, an argmax ~10x).
#ifdef __AVX512F__
constexpr int64_t kWide = 16;
#else
constexpr int64_t kWide = 8;
#endif
typedef float vw __attribute__((vector_size(4 * kWide)));
typedef int32_t iw __attribute__((vector_size(4 * kWide)));

inline vw load_w(const float* p) {
  vw x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store_w(float* p, vw x) { __builtin_memcpy(p, &x, sizeof(x)); }

inline vw splat_w(float x) { return vw{} + x; }

// exp(x) for x <= 0 (scores or logits minus their row max), a vector VF of fp32 lanes at a
// time (VI: as many int32 lanes): Cephes' expf, a degree-6 polynomial on x = n ln2 + r,
// |r| <= ln2 / 2, times 2^n built in the exponent bits; ~2 ulp. x below -87 counts as -87
// (e^-87 ~ 2e-38: nothing next to the row's maximum, which contributes 1).
template <typename VF, typename VI>
inline VF exp_nonpositive(VF x) {
  x = x < -87.0f ? VF{} - 87.0f : x;
  const VF fx = x * 1.44269504088896341f + 0.5f;
  VF n = __builtin_convertvector(__builtin_convertvector(fx, VI), VF);  // truncate ...
  n += __builtin_convertvector(n > fx, VF);                             // ... to floor (true = -1)
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const VF z = x * x;
  VF y = VF{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

inline bool any_lane(iw mask) {
  uint64_t w[kWide / 2];
  __builtin_memcpy(w, &mask, sizeof(w));
  uint64_t seen = 0;
  for (int j = 0; j < kWide / 2; ++j) seen |= w[j];
  return seen != 0;
}

// The k largest of x[0, n), best first, ties in index order: vals[k], idx[k] (k <= n).
// Keeps the best k so far sorted (an entry goes after those it equals); past the first k a
// vector of lanes costs one compare with the k-th unless one of them beats it, so a row of
// logits costs ~n / kWide compares plus ~k log(n / k) inserts. `at::topk` agrees up to the
// order of tied values. Past the first k entries a NaN never enters (it beats nothing).
inline void top_k(const float* x, int64_t n, int64_t k, float* vals, int64_t* idx) {
  int64_t filled = 0;
  auto offer = [&](float v, int64_t i) {
    if (filled == k && !(v > vals[k - 1])) return;
    int64_t p = filled < k ? filled++ : k - 1;  // the slot it takes before moving up
    for (; p > 0 && vals[p - 1] < v; --p) {
      vals[p] = vals[p - 1];
      idx[p] = idx[p - 1];
    }
    vals[p] = v;
    idx[p] = i;
  };
  int64_t i = 0;
  for (; i < n && filled < k; ++i) offer(x[i], i);
  for (; i + kWide <= n; i += kWide) {
    const vw v = load_w(x + i);
    if (!any_lane(v > splat_w(vals[k - 1]))) continue;
    for (int l = 0; l < kWide; ++l) offer(v[l], i + l);
  }
  for (; i < n; ++i) offer(x[i], i);
}

}  // namespace specpipe_lanes
