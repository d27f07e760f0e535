"""Paged KV cache: the K/V storage of every layer cut into fixed-size blocks, and the
per-forward description of which cache slots each new token writes and reads.

Storage: per layer one tensor `[num_blocks * block_size, H_kv, D]`; slot
`block * block_size + offset` holds one token's K (and V). Which blocks belong to which
request is the runtime's business (`runtime/block_manager.py`); the model only sees slots.

A forward over a flat batch of N new tokens (prefill chunks, single decode tokens and
draft trees of many requests, concatenated) gets a `PagedBatch`: the slot each new token
writes, and `AttentionGroup`s saying which slots each token attends to. Requests are
grouped so that one group pads to similar sizes (all short trees together, each long
prefill chunk alone); within a group the mask is block-diagonal by construction, since
every row of the group is one request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from plugins.tree_attention import tree_attention


class PagedKVCache:
    """Block pool: K and V of every layer, `[num_blocks * block_size, H_kv, D]` each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V of one token over all layers: what sizing from a memory budget divides by."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[N, H_kv, D]` of N new tokens at `slots` `[N]`."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the K/V at slots `src` `[M]` to slots `dst` `[M]` in every layer (accepted-path
        compaction). All sources are read before any destination is written, so a path
        moving onto its own slots is safe."""
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]


class AttentionGroup(NamedTuple):
    """G requests whose new tokens attend in one padded call of `specpipe::tree_attention`."""

    query_index: torch.Tensor  # [G, T] index of each request's new tokens in the flat batch (padding: 0)
    key_slots: torch.Tensor  # [G, S] cache slots each request reads: context, then its new tokens
    mask: torch.Tensor  # [G, T, S] bool, True = attend (padding queries see slot column 0 only)
    valid: torch.Tensor  # [G, T] bool, real (non-padding) queries
    rows: torch.Tensor  # [sum(valid)] = query_index[valid]: where the results go in the flat batch


class PagedBatch(NamedTuple):
    """Attention metadata of one forward over the paged cache, shared by all layers."""

    cache: PagedKVCache
    slots: torch.Tensor  # [N] slot each new token's K/V is written to
    groups: list[AttentionGroup]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[1, H, N, D]`, k/v `[1, H_kv, N, D]` of the flat batch -> attention output `[1, H, N, D]`."""
        self.cache.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        q_flat = q[0].transpose(0, 1)  # [N, H, D]
        out = torch.empty_like(q_flat)
        for g in self.groups:
            res = tree_attention(q_flat, self.cache.k[layer], self.cache.v[layer], g.query_index, g.key_slots, g.mask)
            out[g.rows] = res[g.valid]
        return out.transpose(0, 1)[None]
