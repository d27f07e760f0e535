"""`specpipe::copy_kv_slots`: accepted-path compaction of the KV cache in one launch.

The cache is one tensor `kv [2, L, num_slots, H_kv, D]` (K and V of every layer). After
verification the K/V of the accepted tree nodes, at slots `src [M]`, move to the slots right
after the committed context, `dst [M]`, in every layer, K and V alike. Contract: every source
is read before any destination is written, so a path moving onto slots it overlaps (e.g.
`src = [5, 6, 7]`, `dst = [4, 5, 6]`) is safe. Duplicate destinations are undefined.

The reference body `kv[:, :, dst] = kv[:, :, src]` gathers into a temporary first, so it keeps
the contract. The Triton kernel (the CUDA implementation, `copy_kv_slots_triton`) runs one
program per (K or V of a layer, chunk of the H_kv * D columns); each program loads all M
source rows of its chunk as one tile, waits at a barrier, then stores them: no other program
touches those columns, so reads precede writes everywhere. Its grid depends only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_TILE = 8192  # elements per program: BLOCK_M * BLOCK_C
NUM_WARPS = 4
WARM_SLOTS = 256
"""`warm_up` compiles the kernel for every tile of up to this many moved slots (a step that
moves more compiles its tile on first use)."""


def _check(kv: Tensor, src: Tensor, dst: Tensor) -> None:
    if kv.ndim != 5 or kv.shape[0] != 2:
        raise ValueError(f"kv {tuple(kv.shape)} must be [2, L, num_slots, H_kv, D]")
    if src.ndim != 1 or dst.shape != src.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must both be [M]")
    for name, t in (("src", src), ("dst", dst)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64 slots, got {t.dtype}")
        if t.device != kv.device:
            raise ValueError(f"{name} is on {t.device}, kv on {kv.device}")


@torch.library.custom_op("specpipe::copy_kv_slots", mutates_args=("kv",))
def copy_kv_slots(
    kv: Tensor,  # [2, L, num_slots, H_kv, D] K and V of every layer, updated in place
    src: Tensor,  # [M] int32/int64 slots to read
    dst: Tensor,  # [M] int32/int64 slots to write
) -> None:
    _check(kv, src, dst)
    kv[:, :, dst] = kv[:, :, src]  # the right side is gathered into a new tensor first


@copy_kv_slots.register_fake
def _(kv: Tensor, src: Tensor, dst: Tensor) -> None:
    _check(kv, src, dst)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per tile size, whatever M's divisibility
def _copy_kv_slots_kernel(
    kv_ptr,
    src_ptr,
    dst_ptr,
    M,
    num_layers,
    stride_kv,
    stride_layer,
    stride_slot,
    stride_head,
    stride_d,
    HEAD_DIM: tl.constexpr,
    COLUMNS: tl.constexpr,  # H_kv * D
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    plane = tl.program_id(0).to(tl.int64)  # K/V x layer
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    src = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + m, mask=m_ok, other=0).to(tl.int64)
    base = kv_ptr + (plane // num_layers) * stride_kv + (plane % num_layers) * stride_layer
    column = ((c // HEAD_DIM) * stride_head + (c % HEAD_DIM) * stride_d).to(tl.int64)
    mask = m_ok[:, None] & (c < COLUMNS)[None, :]
    rows = tl.load(base + src[:, None] * stride_slot + column[None, :], mask=mask)
    tl.debug_barrier()  # every thread of the program has read before any writes (overlapping src/dst)
    tl.store(base + dst[:, None] * stride_slot + column[None, :], rows, mask=mask)


_INTERPRETED = not isinstance(_copy_kv_slots_kernel, triton.runtime.JITFunction)


def copy_kv_slots_triton(kv: Tensor, src: Tensor, dst: Tensor) -> None:
    """Launch `_copy_kv_slots_kernel` on kv in place: grid (2 * L, column chunks). CUDA
    tensors, or CPU tensors under the Triton interpreter. More than MAX_TILE slots (one
    tile no longer fits a program) fall back to the reference indexing."""
    _check(kv, src, dst)
    m = src.shape[0]
    if m == 0 or kv.numel() == 0:
        return
    if m > MAX_TILE:
        kv[:, :, dst] = kv[:, :, src]
        return
    if kv.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing plugins")
    _, num_layers, _, h_kv, d = kv.shape
    block_m = triton.next_power_of_2(m)
    block_c = min(triton.next_power_of_2(h_kv * d), MAX_TILE // block_m)
    _copy_kv_slots_kernel[(2 * num_layers, triton.cdiv(h_kv * d, block_c))](
        kv,
        src,
        dst,
        m,
        num_layers,
        *kv.stride(),
        HEAD_DIM=d,
        COLUMNS=h_kv * d,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=NUM_WARPS,
    )


def warm_up(kv: Tensor, slot: int, most: int = WARM_SLOTS) -> None:
    """Compile the kernel for `kv`'s shape now, for every power-of-two tile of up to `most`
    moved slots, by moving `slot` onto itself (K/V unchanged). Triton compiles a kernel on
    its first launch of each tile size (~0.1-1 s, less from its disk cache): unwarmed, the
    first steps that accepted drafts paid for it, inside a request's latency (and inside
    the first timed round of a benchmark)."""
    m = 1
    while m <= min(most, MAX_TILE):
        index = torch.full((m,), slot, dtype=torch.int64, device=kv.device)
        copy_kv_slots(kv, index, index)
        m *= 2


@copy_kv_slots.register_kernel("cuda")
def _(kv: Tensor, src: Tensor, dst: Tensor) -> None:
    copy_kv_slots_triton(kv, src, dst)
