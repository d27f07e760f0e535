"""`specpipe::gpu_linear`: a linear for the few-row products of decoding on a GPU, as the
Triton matmul of `plugins/batch_invariant.py` with its tile height fitted to the rows.

Why: for fp32 products of a few rows cuBLAS picks kernels far from what streaming the
weight once costs. In a demo-target decode step at batch 8 on an H200 (torch.profiler,
2026-11-27; `benchmarks/HISTORY.md`, session 19) its `sm80_xmma_gemm_f32f32..._tilesize32x128x8`
took ~40 us a call for 8 x 384 x 1024 and 23 of the forward's 43 products ran it: ~1.0 ms
of a ~1.5 ms forward, where the 1-row forward's products (gemv) took ~2.7 us each. A
draft tree's verification (6-21 rows at batch 1) lands on the same kernels, so on a GPU a
tree step cost ~3x an auto-regressive one instead of about one.

Which kernel runs is measured, not assumed: `runtime/cuda_graphs.py` captures every token
bucket's forward with cuBLAS and with this op (`LlamaForCausalLM.set_triton_linears`) and
keeps the graph that replays faster.

- CUDA: `bi_linear_triton(x, weight, bias, block_m)`, `block_m` the smallest of 16 / 32 / 64
  holding the rows (taller tiles only multiply padding rows); fp32 accumulation, K walked
  in fixed BLOCK_K steps, fp32 inputs not rounded to tf32.
- everything else (the reference): `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.batch_invariant import _TRITON_DTYPES, HAVE_TRITON, bi_linear_triton


def block_m(rows: int) -> int:
    """The Triton tile's height for `rows` rows: the smallest of 16, 32, 64 that holds them
    (64 past that: more tiles)."""
    return next((b for b in (16, 32) if rows <= b), 64)


def applies(weight: torch.Tensor) -> bool:
    """Whether `gpu_linear` on this weight runs the Triton kernel (a CUDA weight of a dtype
    it takes, Triton installed) rather than its reference."""
    return HAVE_TRITON and weight.is_cuda and weight.dtype in _TRITON_DTYPES


@torch.library.custom_op("specpipe::gpu_linear", mutates_args=())
def gpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on 2-D input: x [M, K], weight [N, K], bias [N] or None -> [M, N]. This
    body is the reference (and every device but CUDA); CUDA runs the Triton matmul."""
    return F.linear(x, weight, bias)


@gpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@gpu_linear.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not applies(weight) or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return bi_linear_triton(x, weight, bias, block_m(x.shape[0]))


def gpu_linear_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gpu_linear` on `[..., K]` input (flattened to 2-D and back), like `F.linear`."""
    y = gpu_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
