"""`specpipe::gpu_linear`: a linear for the few-row products of decoding on a GPU: per
product shape, cuBLAS or a split-K Triton matmul, whichever replays faster there.

Why: for fp32 products of a few rows cuBLAS's choice is fine for most shapes and far off
for some. On an H200 (fp32, CUDA-graph replays, `benchmarks/HISTORY.md`, session 22) a
384 x 384 product took 2.7 us at 1 row, 31 us at 8 and 4.1 at 16; a 128 x 384 one (the
demo target's k / v) 2.7 us at 1 row and 52-53 us at 8 and 16; a 768 x 256 one 26 us at 8.
Those products ran ~1 ms of a ~1.4 ms decode forward at batch 8, and of a draft tree's
verification at batch 1 (16 rows). The split-K kernel here takes 6.3-6.8 us at any of
those row counts; elsewhere cuBLAS is faster (2.7-4 us at 1 row, 34+ us against 10 for the
8192-wide LM head), so the op measures, per shape, and keeps cuBLAS unless Triton saves
`TRITON_SAVES` of its time. The session's first kernel (`bi_linear_triton` fitted to the
rows, one [16, 64] tile per program, no split) took 17 us at K = 384 and 44 at 1024 on
every shape: slower than cuBLAS on all but the worst, so graphs with it were kept for
bucket 8 alone.

- CUDA, at most `MAX_ROWS` rows, unit-stride fp16 / bf16 / fp32 operands of one dtype: the
  faster, per (rows, N, K, dtype, bias), of `F.linear` and `rows_linear` at each of
  `CONFIGS`, timed once as CUDA-graph replays (`choice`) at the first eager call of that
  shape (a CUDA-graph capture's warm-up run), cached for the process. A shape first met
  while a graph is being captured runs `F.linear` (it cannot be timed then).
- everything else, and the reference: `F.linear`.

`rows_linear` accumulates in fp32 (fp32 inputs not rounded to tf32): program (j, s)
computes columns [j BN, (j + 1) BN) of every row over K-slice s, walked in BK steps; the
SPLIT partial sums are then added in slice order, so a result depends on the
configuration, not on the timing that chose it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from plugins.batch_invariant import _TRITON_DTYPES, HAVE_TRITON

tl: Any = None
"""`triton.language`, imported at the kernel's first launch (as in `plugins/batch_invariant.py`:
Triton fixes interpreter-or-compiler when it is imported)."""

MAX_ROWS = 16
"""Rows up to which the Triton kernel is a candidate (one tile height of `tl.dot`); taller
products are cuBLAS's, which handles them well (session 19's profile)."""

CONFIGS: tuple[tuple[int, int, int], ...] = ((16, 64, 4), (16, 64, 2))
"""(BLOCK_N, BLOCK_K, SPLIT) timed per shape: the fastest two of a grid of 18 on the demo
models' shapes (H200, session 22: BN 16 / 32 / 64, BK 64 / 128, split 1 / 2 / 4). Narrow
tiles and a split K put 100-400 programs on the device where a [16, 64] tile put 6-16."""

TRITON_SAVES = 0.25
"""The share of cuBLAS's time Triton must save for a shape to run it: far enough from a
tie that the choice does not flip from one engine start to the next."""

_choices: dict[tuple[Any, ...], tuple[int, int, int] | None] = {}


def applies(weight: torch.Tensor) -> bool:
    """Whether `gpu_linear` on this weight may run the Triton kernel (a CUDA weight of a
    dtype it takes, Triton installed) rather than cuBLAS."""
    return HAVE_TRITON and weight.is_cuda and weight.dtype in _TRITON_DTYPES


def _rows_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    K_SLICE,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_ys,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Partial sum s of a [BM, BN] output tile: K from s K_SLICE to (s + 1) K_SLICE in BK
    steps, each one `tl.dot` into an fp32 accumulator; slice 0 adds the bias."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = s * K_SLICE
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + (k_lo + rk)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K_SLICE, BK):
        kk = k_lo + k0 + rk
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if DOT_IN_FP32:  # interpreter only (see `bi_linear_triton`)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")  # ieee: fp32 inputs are not rounded to tf32
        x_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        acc += tl.where(s == 0, tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32), 0.0)[None, :]
    y_ptrs = y_ptr + s * stride_ys + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_rows_kernel)


def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple[int, int, int]
) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] and weight [N, K] of one dtype, unit stride along K; bias [N] or
    None -> [M, N] in x.dtype, by the Triton kernel at `config` = (BLOCK_N, BLOCK_K, SPLIT):
    SPLIT fp32 partial sums [SPLIT, M, N], added in slice order. On CPU tensors it runs
    under Triton's interpreter (tests)."""
    bn, bk, split = config
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"rows_linear takes at most {MAX_ROWS} rows with unit stride along K, got {tuple(x.shape)}")
    per_split = -(-k // split)
    k_slice = -(-per_split // bk) * bk  # whole BK steps: the last slice may be short or empty
    partial = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _kernel()[(-(-n // bn), split)](
        x,
        weight,
        partial if bias is None else bias,  # any pointer when there is no bias: never read
        partial,
        m,
        n,
        k,
        k_slice,
        x.stride(0),
        weight.stride(0),
        partial.stride(1),
        partial.stride(0),
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=not x.is_cuda and x.dtype == torch.bfloat16,
        BM=16,
        BN=bn,
        BK=bk,
        num_warps=4,
        num_stages=3,
    )
    y = partial[0] if split == 1 else partial.sum(0)
    return y.to(x.dtype)


def _replay_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """Microseconds a call of `fn` takes as `calls` calls replayed in one CUDA graph (no
    launch costs: how it runs in the engine's graphs), best of 6 replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int] | None:
    """The configuration this product's shape runs on (None: cuBLAS), timed at its first
    eager call and cached; None without caching while a graph is being captured."""
    key = (x.shape[0], *weight.shape, x.dtype, bias is not None, x.device.index)
    if key not in _choices:
        if torch.cuda.is_current_stream_capturing():
            return None
        times = {c: _replay_us(functools.partial(rows_linear, x, weight, bias, c)) for c in CONFIGS}
        best = min(CONFIGS, key=times.__getitem__)
        cublas = _replay_us(functools.partial(F.linear, x, weight, bias))
        _choices[key] = best if times[best] < (1 - TRITON_SAVES) * cublas else None
    return _choices[key]


@torch.library.custom_op("specpipe::gpu_linear", mutates_args=())
def gpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on 2-D input: x [M, K], weight [N, K], bias [N] or None -> [M, N]. This
    body is the reference (and every device but CUDA); CUDA runs the shape's `choice`."""
    return F.linear(x, weight, bias)


@gpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@gpu_linear.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not applies(weight) or x.dtype != weight.dtype or not 0 < x.shape[0] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.shape[1] == 0:
        return F.linear(x, weight, bias)
    config = choice(x, weight, bias)
    return F.linear(x, weight, bias) if config is None else rows_linear(x, weight, bias, config)


def gpu_linear_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gpu_linear` on `[..., K]` input (flattened to 2-D and back), like `F.linear`."""
    y = gpu_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
