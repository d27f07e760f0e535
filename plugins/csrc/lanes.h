// 16 fp32 lanes (GCC/Clang vector extension): one AVX-512 register, or four SSE ones; what
// the CPU kernels that compare or accumulate 16 values at a time share.
#pragma once

#include <cstdint>

namespace specpipe_lanes {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline v16 load(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof(x)); }

inline v16 splat(float x) { return v16{} + x; }

}  // namespace specpipe_lanes
