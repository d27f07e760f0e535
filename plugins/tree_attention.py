"""`specpipe::tree_attention`: attention of new (tree) tokens over a paged KV cache.

One call serves a group of G requests. Request g's new tokens are rows
`query_index[g]` of the flat query tensor; it reads the cache slots `key_slots[g]` (its
committed context in block-table order, then its new tokens, whose K/V are already
written) under `mask[g]`: a new token sees the whole context and, among the new tokens,
its ancestors and itself (a packed draft tree) or the tokens before it (a prefill chunk).
Rows of different requests never see each other: the batch mask is block-diagonal.

`tree_attention_reference` gathers the slots into padded `[G, H_kv, S, D]` keys and calls
`scaled_dot_product_attention`: the oracle, and the path for long groups (prefill chunks,
where SDPA's flash kernel does well) and for what the C++ kernel does not take. Short
groups (decode tokens and draft trees, T <= `KERNEL_MAX_T`) in fp32 run
`specpipe_cpu::tree_attention` (`plugins/csrc/tree_attention_cpu.cpp`, built by
`plugins/cpu_kernels.py`), which reads K/V straight from their slots with no padded copy,
and for each request only up to the last key column its rows see (a group pads to its longest):
on the 2-core CI machine, 8 requests of ~370 keys (demo target: 6 query heads, 2 KV heads,
D = 64) cost ~100 us per layer for one new token each against ~300-700 us for the
reference, ~370 us for 6 tree tokens each against ~600-900 us, and one request ~15 us
against ~150 us. Both are exact attention in fp32; they differ by summation order (~1e-7).
The model's layers call it through `attend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from plugins import cpu_kernels

KERNEL_MAX_T = 64
"""New tokens per request up to which a group runs the C++ kernel (the engine's short
segments: `runtime.attention_batch.SHORT_SEGMENT`); past it SDPA's flash kernel is as fast."""


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, query_index: torch.Tensor, key_slots: torch.Tensor, mask: torch.Tensor
) -> None:
    if q.ndim != 3 or k_cache.ndim != 3 or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} must be [N, H, D] and the cache {tuple(k_cache.shape)} [slots, H_kv, D]")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k_cache.shape[1]} KV heads")
    g, t = query_index.shape
    if key_slots.shape[0] != g or mask.shape != (g, t, key_slots.shape[1]) or mask.dtype != torch.bool:
        raise ValueError(
            f"query_index {tuple(query_index.shape)}, key_slots {tuple(key_slots.shape)} and bool mask "
            f"{tuple(mask.shape)} must be [G, T], [G, S] and [G, T, S]"
        )


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` for `x` [M, ...] and `index` [G, S]: one `index_select` of whole rows, which
    on the CPU copies 2-3x faster than advanced indexing (same values)."""
    return x.reshape(x.shape[0], -1).index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def tree_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, index: Tensor, slots: Tensor, mask: Tensor
) -> Tensor:
    """Plain torch: gather, pad, `scaled_dot_product_attention` (same arguments as the op)."""
    qg = _rows(q, index).transpose(1, 2)  # [G, H, T, D]
    kg = _rows(k_cache, slots).transpose(1, 2)  # [G, H_kv, S, D]
    vg = _rows(v_cache, slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask[:, None], enable_gqa=qg.shape[1] != kg.shape[1])
    return out.transpose(1, 2).contiguous()


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("tree_attention", _fake)


def kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_index: torch.Tensor) -> bool:
    """Whether `specpipe_cpu::tree_attention` takes these arguments (and is built): fp32 on
    the CPU, a head size it is compiled for, T <= `KERNEL_MAX_T`, caches with dense
    `[H_kv, D]` slots (the paged cache's layers are)."""
    dense = k_cache.stride(-1) == 1 and k_cache.stride(1) == k_cache.shape[-1] and v_cache.stride() == k_cache.stride()
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and q.shape[-1] in (32, 64, 128)
        and query_index.dtype == torch.long
        and query_index.is_contiguous()
        and query_index.shape[1] <= KERNEL_MAX_T
        and dense
        and _kernel_built()
    )


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_index: Tensor, key_slots: Tensor, mask: Tensor) -> Tensor:
    """`tree_attention` by the shortest route, for the model's layers: the C++ op itself
    where it applies (the Python custom op around it costs ~15-25 us a call, and a draft-LM
    step at batch 8 makes 14 such calls), else the custom op. The C++ op checks shapes and
    index ranges itself."""
    if kernel_applies(q, k_cache, v_cache, query_index) and key_slots.is_contiguous() and mask.is_contiguous():
        return torch.ops.specpipe_cpu.tree_attention(q.contiguous(), k_cache, v_cache, query_index, key_slots, mask)
    return tree_attention(q, k_cache, v_cache, query_index, key_slots, mask)


@torch.library.custom_op("specpipe::tree_attention", mutates_args=())
def tree_attention(
    q: torch.Tensor,  # [N, H, D] queries of the whole flat batch
    k_cache: torch.Tensor,  # [num_slots, H_kv, D] one layer's keys, new tokens included
    v_cache: torch.Tensor,  # [num_slots, H_kv, D]
    query_index: torch.Tensor,  # [G, T] int64 rows of q per request (padding: any row)
    key_slots: torch.Tensor,  # [G, S] int64 slots per request (padding: any slot)
    mask: torch.Tensor,  # [G, T, S] bool, True = attend; every row needs one True
) -> torch.Tensor:  # [G, T, H, D]
    _check(q, k_cache, query_index, key_slots, mask)
    if kernel_applies(q, k_cache, v_cache, query_index):
        slots, visible = key_slots.contiguous(), mask.contiguous()  # kernel_applies: query_index is
        return torch.ops.specpipe_cpu.tree_attention(q.contiguous(), k_cache, v_cache, query_index, slots, visible)
    return tree_attention_reference(q, k_cache, v_cache, query_index, key_slots, mask)


@tree_attention.register_fake
def _fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_index: torch.Tensor,
    key_slots: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    _check(q, k_cache, query_index, key_slots, mask)
    return q.new_empty(*query_index.shape, *q.shape[1:])
