"""`specpipe::tree_attention`: attention of N new (tree) tokens over the cached context.

A new token sees the whole committed context of its row (`context_lens[b]` columns) and,
among the new tokens, exactly what `tree_mask` allows (its ancestors and itself for a
packed draft tree; a lower triangle for a plain causal chunk). The new tokens' K/V must
already be written at columns `[context_lens[b], context_lens[b] + N)` of the cache.

The reference below builds the dense `[B, 1, N, S]` mask and calls
`scaled_dot_product_attention`; it is the CPU path and the oracle for faster kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_defs.kv_cache import attention_mask


@torch.library.custom_op("specpipe::tree_attention", mutates_args=())
def tree_attention(
    q: torch.Tensor,  # [B, H, N, D]
    k: torch.Tensor,  # [B, H_kv, S, D] cache, new tokens included
    v: torch.Tensor,  # [B, H_kv, S, D]
    context_lens: torch.Tensor,  # [B] committed tokens per row
    tree_mask: torch.Tensor | None,  # [B, N, N] bool; None = causal among the new tokens
) -> torch.Tensor:  # [B, H, N, D]
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [B, H, T, D]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    mask = attention_mask(context_lens, q.shape[2], k.shape[2], tree_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.contiguous()


@tree_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor, tree_mask: torch.Tensor | None
) -> torch.Tensor:
    return torch.empty_like(q)
