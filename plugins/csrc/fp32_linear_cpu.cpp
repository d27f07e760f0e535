// specpipe_cpu::fp32_linear: the CPU kernel of `specpipe::fp32_linear` (fp32_linear.h has the
// arithmetic; plugins/fp32_linear.py the contract and the plain-torch reference).
#include <torch/library.h>

#include "fp32_linear.h"

namespace {

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& blocked, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu(), "specpipe_cpu::fp32_linear takes CPU tensors");
  return specpipe::fp32_linear(x, blocked, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_cpu, m) { m.def("fp32_linear(Tensor x, Tensor blocked, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(specpipe_cpu, CPU, m) { m.impl("fp32_linear", &fp32_linear); }
