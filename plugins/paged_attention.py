"""`specpipe::paged_attention`: attention of a flat batch of new tokens over a paged KV cache,
one query row at a time.

Row n (a new token of request `row_request[n]`) attends to an ordered list of *key indices*
into its request's token sequence; index i lives in cache slot
`block_tables[r, i // block_size] * block_size + i % block_size`. The list is the contiguous
indices `0 .. row_prefix[n] - 1` followed by the `row_len[n] - row_prefix[n]` explicit indices
`row_tree[n, :]` (ascending, padding -1), so logical key j of row n has index
`j if j < row_prefix[n] else row_tree[n, j - row_prefix[n]]`:

- a prefill chunk row t over `context` cached tokens: `row_prefix = context + t + 1`, no tree;
- a decode token at index i: `row_prefix = i + 1`, no tree;
- a draft-tree node: `row_prefix = context` (the committed tokens), `row_tree` = the indices
  of its ancestors, then itself.

Why rows, not padded groups with masks: every row is computed on its own, over the same
partition of its logical keys into blocks of `BLOCK_N` starting at logical key 0, so its
result does not depend on which other rows share the launch (batch invariance): a tree node
whose visible keys equal those of a decode token, position by position, gets a bitwise
identical output, whatever slots its ancestors sit in. The Triton kernel reads all metadata
on the device and its grid depends only on shapes (one program per query row and KV head),
so it can be captured in a CUDA graph.

Query head h reads KV head `h // (H // H_kv)` (GQA); scale 1/sqrt(D); softmax and
accumulation in fp32, output in q's dtype. A row with `row_len == 0` (padding) outputs zeros.

`_paged_attention_reference` (plain torch, the CPU path and the oracle) is the op's body; the
Triton kernel `paged_attention_triton` is its CUDA implementation, and runs on CPU tensors
under the Triton interpreter (`TRITON_INTERPRET=1` set before this module is imported).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64  # logical keys per step of the kernel's loop: fixed, the partition batch invariance rests on
NUM_WARPS = 4
_MIN_DOT = 16  # tl.dot wants every dimension >= 16: GQA groups and small head dims are padded to it
_REFERENCE_BUDGET = 1 << 22  # gathered K (and V) elements per chunk of rows in the reference


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_request: Tensor,
    row_prefix: Tensor,
    row_tree: Tensor,
    row_len: Tensor,
    block_size: int,
) -> None:
    """Shapes, dtypes and devices only (no values), so the fake kernel and the real ones agree."""
    if q.ndim != 3 or k_cache.ndim != 3 or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} must be [N, H, D] and the cache {tuple(k_cache.shape)} [slots, H_kv, D]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have the shape of k_cache {tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k_cache.shape[1]} KV heads")
    if not q.dtype.is_floating_point or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one floating dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    n = q.shape[0]
    if block_tables.ndim != 2 or row_tree.ndim != 2 or row_tree.shape[0] != n or row_tree.shape[1] < 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and row_tree {tuple(row_tree.shape)} must be [R, max_blocks] "
            f"and [N, T] with N = {n} rows and T >= 1"
        )
    for name, t in (("row_request", row_request), ("row_prefix", row_prefix), ("row_len", row_len)):
        if t.shape != (n,):
            raise ValueError(f"{name} {tuple(t.shape)} must be [N] with N = {n} rows")
    for name, t in (
        ("block_tables", block_tables),
        ("row_request", row_request),
        ("row_prefix", row_prefix),
        ("row_tree", row_tree),
        ("row_len", row_len),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("row_request", row_request),
        ("row_prefix", row_prefix),
        ("row_tree", row_tree),
        ("row_len", row_len),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: every tensor must be on q's device")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_request: Tensor,
    row_prefix: Tensor,
    row_tree: Tensor,
    row_len: Tensor,
    block_size: int,
) -> Tensor:
    """Plain torch: per chunk of rows, the `[rows, S]` key index matrix -> slots -> gathered
    K/V -> masked fp32 softmax. Chunks keep the gathered K/V under `_REFERENCE_BUDGET` elements."""
    _check(q, k_cache, v_cache, block_tables, row_request, row_prefix, row_tree, row_len, block_size)
    n, h, d = q.shape
    h_kv = k_cache.shape[1]
    group = h // h_kv
    out = q.new_zeros(q.shape)
    if n == 0:
        return out
    lens, prefix, tree = row_len.long(), row_prefix.long(), row_tree.long()
    num_tree = (lens - prefix).clamp(min=0)
    if bool((num_tree > tree.shape[1]).any()):
        bad = int((num_tree > tree.shape[1]).nonzero()[0, 0])
        raise ValueError(f"row {bad} has {int(num_tree[bad])} tree keys but row_tree holds {tree.shape[1]}")
    width = max(int(lens.max()), 1)
    step = max(1, min(64, _REFERENCE_BUDGET // (width * h_kv * d)))
    tables = block_tables.long()
    scale = 1.0 / math.sqrt(d)
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        j = torch.arange(width, device=q.device)[None, :]  # [1, S] logical keys
        p = prefix[rows, None]
        from_tree = tree[rows].gather(1, (j - p).clamp(0, tree.shape[1] - 1))
        valid = j < lens[rows, None]  # [c, S]
        index = torch.where(valid, torch.where(j < p, j, from_tree), 0)
        if bool((index < 0).any()):
            raise ValueError(f"a visible key of rows {rows.start}..{rows.stop - 1} has a negative row_tree index")
        blocks = tables[row_request[rows].long()[:, None], index // block_size]
        slots = blocks * block_size + index % block_size  # [c, S]
        k = k_cache[slots].float()  # [c, S, H_kv, D]
        v = v_cache[slots].float()
        qc = q[rows].float().view(-1, h_kv, group, d)  # query head h = kv head h // group
        scores = torch.einsum("ckgd,cskd->ckgs", qc, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        o = torch.einsum("ckgs,cskd->ckgd", scores.softmax(-1), v).reshape(-1, h, d)
        out[rows] = o.masked_fill((lens[rows] == 0)[:, None, None], 0.0).to(q.dtype)  # padding rows: 0, not NaN
    return out


@torch.library.custom_op("specpipe::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,  # [N, H, D] queries of the flat batch
    k_cache: Tensor,  # [num_slots, H_kv, D] one layer's keys, new tokens included
    v_cache: Tensor,  # [num_slots, H_kv, D]
    block_tables: Tensor,  # [R, max_blocks] int32 blocks of each request
    row_request: Tensor,  # [N] int32 request of each row
    row_prefix: Tensor,  # [N] int32 visible contiguous indices 0 .. row_prefix - 1
    row_tree: Tensor,  # [N, T] int32 then these indices (ascending, padding -1)
    row_len: Tensor,  # [N] int32 visible keys in all
    block_size: int,
) -> Tensor:  # [N, H, D]
    return _paged_attention_reference(
        q, k_cache, v_cache, block_tables, row_request, row_prefix, row_tree, row_len, block_size
    )


@paged_attention.register_fake
def _(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_request: Tensor,
    row_prefix: Tensor,
    row_tree: Tensor,
    row_len: Tensor,
    block_size: int,
) -> Tensor:
    _check(q, k_cache, v_cache, block_tables, row_request, row_prefix, row_tree, row_len, block_size)
    return q.new_empty(q.shape)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    row_request_ptr,
    row_prefix_ptr,
    row_tree_ptr,
    row_len_ptr,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_on,
    stride_oh,
    stride_table,
    stride_tree,
    qk_scale,  # 1/sqrt(D) * log2(e): the softmax runs in base 2
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to >= 16
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot: the cache's, fp32 under the interpreter
    DOT_PRECISION: tl.constexpr,
):
    """One program: query row n, the GROUP query heads of KV head `kvh`, all logical keys of the row."""
    n = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + n * stride_qn + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(DOT_DTYPE)
    request = tl.load(row_request_ptr + n).to(tl.int64)
    prefix = tl.load(row_prefix_ptr + n)
    length = tl.load(row_len_ptr + n)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every step holds at least one visible key (j = start < length), so m_i is finite after the first.
    for start in range(0, length, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        visible = j < length
        in_tree = j >= prefix
        tree_index = tl.load(row_tree_ptr + n * stride_tree + (j - prefix), mask=visible & in_tree, other=0)
        index = tl.where(visible, tl.where(in_tree, tree_index, j), 0)
        block = tl.load(block_tables_ptr + request * stride_table + index // BLOCK_SIZE, mask=visible, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + index % BLOCK_SIZE
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_kn + kvh * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vn + kvh * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        # p is rounded to the cache dtype (as on tensor cores) before it meets V
        pv = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # row_len == 0 (padding row): zeros
    tl.store(
        out_ptr + n * stride_on + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_request: Tensor,
    row_prefix: Tensor,
    row_tree: Tensor,
    row_len: Tensor,
    block_size: int,
) -> Tensor:
    """Launch `_paged_attention_kernel`: grid (N, H_kv), no host reads of the metadata.
    CUDA tensors, or CPU tensors under the Triton interpreter."""
    _check(q, k_cache, v_cache, block_tables, row_request, row_prefix, row_tree, row_len, block_size)
    n, h, d = q.shape
    h_kv = k_cache.shape[1]
    if d & (d - 1):
        raise ValueError(f"the Triton paged attention kernel needs a power-of-two head_dim, got {d}")
    if q.dtype not in _TL_DTYPES:
        raise ValueError(f"the Triton paged attention kernel supports fp32, fp16 and bf16, got {q.dtype}")
    if q.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing plugins")
    out = q.new_empty(q.shape)
    if n == 0:
        return out
    group = h // h_kv
    # bf16/fp16 tl.dot is wrong under the interpreter (numpy multiplies the raw bits): upcast there.
    dot_dtype = tl.float32 if _INTERPRETED else _TL_DTYPES[q.dtype]
    _paged_attention_kernel[(n, h_kv)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        row_request,
        row_prefix,
        row_tree,
        row_len,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        row_tree.stride(0),
        (1.0 / math.sqrt(d)) * math.log2(math.e),
        GROUP=group,
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=max(_MIN_DOT, d),
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32) on the GPU
        num_warps=NUM_WARPS,
    )
    return out


@paged_attention.register_kernel("cuda")
def _(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    row_request: Tensor,
    row_prefix: Tensor,
    row_tree: Tensor,
    row_len: Tensor,
    block_size: int,
) -> Tensor:
    return paged_attention_triton(
        q, k_cache, v_cache, block_tables, row_request, row_prefix, row_tree, row_len, block_size
    )
