// specpipe_cpu::int8_linear: the CPU kernel of `specpipe::int8_linear` (int8_linear.h has the
// arithmetic; plugins/int8_linear.py the contract and the reference it equals bit for bit).
#include <torch/library.h>

#include "int8_linear.h"

namespace {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& blocked, const at::Tensor& w_scale,
                       const at::Tensor& w_sum) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a dense [M, I] float32 CPU tensor");
  specpipe::check_int8_weight(w, blocked, w_scale, w_sum);
  TORCH_CHECK(w.size(1) == x.size(1), "w takes ", w.size(1), " inputs, x has ", x.size(1));
  return specpipe::int8_linear(x, w, blocked, w_scale, w_sum);
}

// Whether the kernel was built with its AVX-512 VNNI or AVX2 tiles (else a scalar loop, slower than fbgemm).
bool int8_linear_vectorized() {
#if defined(SPECPIPE_VNNI) || defined(SPECPIPE_AVX2)
  return true;
#else
  return false;
#endif
}

// Whether the kernel takes 4-bit blocked copies (`block_weight4`): AVX-512 VNNI builds only.
bool int8_linear_nibbles() {
#ifdef SPECPIPE_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor blocked, Tensor w_scale, Tensor w_sum) -> Tensor");
  m.def("int8_linear_vectorized() -> bool", &int8_linear_vectorized);
  m.def("int8_linear_nibbles() -> bool", &int8_linear_nibbles);
}

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
