"""`specpipe::inverse_cdf`: one token per row of a law by inverse CDF at the row's own
uniform, what every sampled token of the engine is drawn with (`runtime.sampling`:
auto-regression, bonus tokens, rejection re-draws; `runtime.gumbel.draw_one`: drafts drawn
one per node).

Row m of `probs` `[M, V]` (non-negative, not necessarily normalised) at `u[m]` in [0, 1)
gives the token i with cdf[i-1] <= u * total < cdf[i] (cumulative sums in fp64): token i
with probability p_i / total up to fp64 rounding, and never a token of probability 0 (an
empty interval); where u * total rounds up to the total, the last token of non-zero
probability. `inverse_cdf_reference` is the plain-torch form (a copy to fp64, cumsum,
searchsorted and, on the CPU, a check for the rounding case: ~25 us for one row of 8192
tokens, ~57 for eight, on the demo machine; off the CPU it handles the case without
asking, so that drawing never waits for the device); on the CPU a C++ kernel (`plugins/csrc/inverse_cdf_cpu.cpp`)
draws the same tokens bit for bit in one pass over a row and a binary search.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels


def _check(probs: Tensor, u: Tensor) -> None:
    if probs.ndim != 2 or probs.shape[-1] < 1 or u.shape != (probs.shape[0],):
        raise ValueError(f"probs {tuple(probs.shape)} must be [M, V] (V >= 1) and u {tuple(u.shape)} [M]")


def inverse_cdf_reference(probs: Tensor, u: Tensor) -> Tensor:
    """Plain torch (same arguments and result as the op)."""
    _check(probs, u)
    cdf = probs.double().cumsum(-1)
    tokens = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    over = tokens == probs.shape[-1]  # u * total rounded up to total: the last token with mass
    if probs.device.type != "cpu" or bool(over.any()):  # off the CPU, no host sync to ask first
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
        tokens = torch.where(over, last, tokens)
    return tokens


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("inverse_cdf", _fake)


def kernel_applies(probs: Tensor) -> bool:
    """Whether `specpipe_cpu::inverse_cdf` takes these probabilities (and is built): fp32 on the CPU."""
    return probs.device.type == "cpu" and probs.dtype == torch.float32 and _kernel_built()


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """`inverse_cdf` by the shortest route, for the samplers: the C++ op itself where it
    applies (no custom-op dispatch, ~10 us of a ~5 us draw), else the plain-torch form
    (on a GPU, with no host sync: the custom op's dispatch and the reference's check for
    the rounding case cost ~0.2 ms a draw on an H200, a sampled chain's levels ~0.8 ms a step)."""
    if kernel_applies(probs):
        _check(probs, u)
        return torch.ops.specpipe_cpu.inverse_cdf(probs.contiguous(), u.double().contiguous())
    return inverse_cdf_reference(probs, u)


@torch.library.custom_op("specpipe::inverse_cdf", mutates_args=())
def inverse_cdf(
    probs: Tensor,  # [M, V] a law per row (non-negative, not necessarily normalised)
    u: Tensor,  # [M] uniforms on [0, 1)
) -> Tensor:  # tokens [M] int64
    _check(probs, u)
    if kernel_applies(probs):
        return torch.ops.specpipe_cpu.inverse_cdf(probs.contiguous(), u.double().contiguous())
    return inverse_cdf_reference(probs, u)


@inverse_cdf.register_fake
def _fake(probs: Tensor, u: Tensor) -> Tensor:
    _check(probs, u)
    return probs.new_empty(probs.shape[0], dtype=torch.long)
