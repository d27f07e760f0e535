"""Batch-invariant linear, RMSNorm and log-softmax: each row's result does not depend on
how many rows share the call.

Why: speculative decoding verifies a draft tree of T tokens in one forward while greedy
auto-regression runs 1-token forwards. Ordinary GEMM and reduction kernels pick their
tiling, split-K and reduction order from the problem's shape, so the same token's logits
differ in the last bits between a T-row and a 1-row call, and greedy speculative output
drifts away from greedy auto-regressive output. The functions here compute every row in
an order that does not depend on the number of rows (the idea of Thinking Machines'
batch_invariant_ops and of vLLM's / SGLang's deterministic modes).

- `specpipe::bi_linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]`, `F.linear`
  on 2-D input, a custom op:
    * CUDA: `bi_linear_triton`, one Triton matmul with a single fixed configuration
      (`BLOCK_M/N/K`, `NUM_WARPS`, `NUM_STAGES` below; no autotuning, no split-K), fp32
      accumulation, K reduced in the same BLOCK_K order for every output element. A row's
      result is a function of that row and the weight alone: bitwise identical for any M.
    * everything else (CPU, the reference): see `_bi_linear_reference`, fp64 accumulation.
- `bi_rms_norm`, `bi_log_softmax`: plain torch, computed in fp64 and cast back; any device.

Why fp64 then cast is batch-invariant in practice: every product of two bf16 / fp16 /
fp32 numbers is exact in fp64 (at most 2 x 24 significand bits <= 53), so the only
shape-dependent part left is the order of the fp64 additions, whose effect is bounded by
about K * 2^-53 times the sum of the terms' magnitudes: ~2^-40 relative for K = 8192 with
no cancellation. That is far below the output's rounding step (2^-8 relative in bf16,
2^-11 in fp16), so rounding the fp64 sum to the output dtype gives the same value for any
M *unless* the exact sum lies within that tiny distance of a rounding boundary (half-way
between two bf16 numbers). This is not a guarantee, it is a probability: per output
element about 2^-30 for bf16 with K ~ 8192 and no heavy cancellation, far larger for fp32
outputs (step 2^-24: ~2^-14 per element), where only the Triton kernel is exactly
invariant. Under heavy cancellation (|sum| << sum of |terms|) the margin shrinks by the
cancellation ratio.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

tl: Any = None
"""`triton.language`, imported at the first launch of the Triton kernel, not here: Triton
fixes interpreter-or-compiler (`TRITON_INTERPRET`) when `triton.language` is imported, so
importing this module (as `model_defs.llama` does) must not import it."""

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
"""The one configuration of the Triton matmul. Fixed on purpose: autotuning by shape would
pick a different reduction order for a different number of rows."""

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def _bi_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` accumulated in fp64 and rounded once to x.dtype: the
    products are exact, and the fp64 sum's order effects (~2^-52 relative per addition, at
    most ~K * 2^-53 in all) are far below the output dtype's rounding step, so the rounded
    row is the same for any M except when the exact sum is that close (~2^-50 relative
    for small K) to a rounding boundary (module docstring)."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


@torch.library.custom_op("specpipe::bi_linear", mutates_args=())
def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Batch-invariant `F.linear` on 2-D input: x [M, K], weight [N, K], bias [N] -> [M, N].
    This body is the CPU path (fp64 accumulation); CUDA runs `bi_linear_triton`."""
    _check(x, weight, bias)
    return _bi_linear_reference(x, weight, bias)


@bi_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)
    return x.new_empty(x.shape[0], weight.shape[0])


@bi_linear.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)
    if not HAVE_TRITON or x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype:
        return _bi_linear_reference(x, weight, bias)
    return bi_linear_triton(x, weight, bias)


def bi_linear_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bi_linear` on `[..., K]` input (flattened to 2-D and back), like `F.linear`."""
    y = bi_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------- Triton


def _bi_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One [BM, BN] output tile: K is walked in BK steps from 0 upwards, each step one
    `tl.dot` into an fp32 accumulator, so every output element sees the same reduction
    order whatever M is (masked rows and columns are zeros and never mix into others)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None] * stride_wk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
        if DOT_IN_FP32:  # interpreter only: its dot multiplies bf16's raw uint16 bits; bf16 -> fp32 is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # ieee: fp32 inputs are not rounded to tf32
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, made at first launch (see `tl`): compiled for CUDA tensors, or a
    Triton-interpreter function when `TRITON_INTERPRET=1` was set before `triton.language`
    was first imported (the only way tensors on the CPU can run it)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_bi_linear_kernel)


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def bi_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the Triton kernel: x [M, K] and weight [N, K] of one dtype (fp16, bf16 or
    fp32), bias [N] or None -> [M, N] in x.dtype. On CUDA tensors it is compiled; on CPU
    tensors it runs under Triton's interpreter (slow: for tests), with two quirks: its
    `tl.dot` is numpy's matmul, which multiplies bf16's raw uint16 bits (so bf16 operands
    are widened to fp32 first, exactly), and OpenBLAS's result for a row depends on the
    row's slot in the [BLOCK_M, BLOCK_K] block, so there a row keeps its bits only at the
    same position in its tile (e.g. x[:m] vs x), not moved (x[i:i+1] vs row i of x), which
    on the GPU it does."""
    _check(x, weight, bias)
    if x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"bi_linear_triton takes x and weight of one of {_TRITON_DTYPES}, got {x.dtype}, {weight.dtype}"
        )
    m, n = x.shape[0], weight.shape[0]
    y = x.new_empty(m, n)
    if m == 0 or n == 0:
        return y
    if x.shape[1] == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    kernel, interpreting = _kernel(), _interpreting()
    if not x.is_cuda and not interpreting:
        raise RuntimeError(
            "bi_linear_triton on CPU tensors runs under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before anything imports triton.language"
        )
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    kernel[grid](
        x,
        weight,
        y if bias is None else bias,  # any pointer when there is no bias: never read
        y,
        m,
        n,
        x.shape[1],
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        y.stride(1),
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=interpreting and x.dtype == torch.bfloat16,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return y


# --------------------------------------------------------------------------- row-wise ops


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim: the mean of squares is taken in fp64
    (squares of bf16/fp16/fp32 values are exact there, the sum's order effects ~2^-52 are
    far below the output's rounding step), the normalised row cast to x.dtype and scaled
    by `weight`, the same formula as `model_defs.llama.RMSNorm` (which reduces in fp32)."""
    x64 = x.double()
    x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x64.to(x.dtype)


def bi_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Batch-invariant `log_softmax`: computed in fp64 and cast back to x.dtype (the max,
    exp-sum and log of a row in fp64 round to the same x.dtype values whatever the number
    of rows, but for an exact value within ~2^-50 of a rounding boundary)."""
    return torch.log_softmax(x.double(), dim).to(x.dtype)
