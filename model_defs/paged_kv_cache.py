"""Paged KV cache: the K/V storage of every layer cut into fixed-size blocks, and the
per-forward description of which cache slots each new token writes and reads.

Storage: per layer one tensor `[num_blocks * block_size, H_kv, D]`; slot
`block * block_size + offset` holds one token's K (and V). Which blocks belong to which
request is the runtime's business (`runtime/block_manager.py`); the model only sees slots.

A forward over a flat batch of N new tokens (prefill chunks, single decode tokens and
draft trees of many requests, concatenated) gets a `PagedBatch`: the slot each new token
writes, and which slots each token attends to, in one of two forms:

- `RowMetadata` (GPU): per query row, the ordered key indices it sees (a contiguous
  prefix, then explicit tree ancestors) through its request's block table, for the
  row-wise kernel `specpipe::paged_attention`. Fixed-size tensors, no host reads: what a
  CUDA graph replays, and a row's result does not depend on the other rows.
- `AttentionGroup`s (CPU): requests padded into groups (all short trees together, each
  long prefill chunk alone) for `specpipe::tree_attention` (a C++ kernel for short
  groups, one SDPA per long one; `plugins/tree_attention.py`); within a group the mask
  is block-diagonal by construction, since every row of the group is one request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from plugins import kv_compaction
from plugins.kv_compaction import copy_kv_slots
from plugins.kv_write import write_new_tokens
from plugins.paged_attention import paged_attention
from plugins.tree_attention import attend


class PagedKVCache:
    """Block pool: K and V of every layer in one tensor `kv [2, layers, (num_blocks + 1) *
    block_size, H_kv, D]`; `k[layer]` and `v[layer]` are views of it. The block past the
    pool is scratch: padding rows of a captured forward write there (`scratch_slot`)."""

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
        shape = (2, num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_slot = num_blocks * block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K + V of one token over all layers: what sizing from a memory budget divides by."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[N, H_kv, D]` of N new tokens at `slots` `[N]`."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def warm_up(self) -> None:
        """On a GPU, compile the compaction kernel for this cache now (`kv_compaction.warm_up`)."""
        if self.kv.device.type == "cuda":
            kv_compaction.warm_up(self.kv, self.scratch_slot)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the K/V at slots `src` `[M]` to slots `dst` `[M]` in every layer (accepted-path
        compaction), in one launch. All sources are read before any destination is
        written, so a path moving onto its own slots is safe."""
        device = self.kv.device
        src, dst = src.to(device, non_blocking=True), dst.to(device, non_blocking=True)
        if device.type == "cuda":  # the kernel itself: no custom-op dispatch each step
            kv_compaction.copy_kv_slots_triton(self.kv, src, dst)
        else:
            copy_kv_slots(self.kv, src, dst)


class AttentionGroup(NamedTuple):
    """G requests whose new tokens attend in one padded call of `specpipe::tree_attention`.
    Requests keep their flat-batch order and their rows are consecutive, so `query_index`
    lists real rows in ascending order (`runtime.attention_batch.group`)."""

    query_index: torch.Tensor  # [G, T] index of each request's new tokens in the flat batch (padding: 0)
    key_slots: torch.Tensor  # [G, S] cache slots each request reads: context, then its new tokens
    mask: torch.Tensor  # [G, T, S] bool, True = attend (padding queries see slot column 0 only)
    valid: torch.Tensor  # [G, T] bool, real (non-padding) queries
    rows: torch.Tensor  # [sum(valid)] = query_index[valid]: where the results go in the flat batch


class RowMetadata(NamedTuple):
    """Per query row of the flat batch, the ordered keys it attends to (`specpipe::
    paged_attention`): key j of row n is its request's token index `j` for
    `j < row_prefix[n]`, else `row_tree[n, j - row_prefix[n]]`; `row_len[n]` keys in all.
    A token index i of request r lives in slot `block_tables[r, i // block_size] *
    block_size + i % block_size`. All int32, on the model's device."""

    block_tables: torch.Tensor  # [R, max_blocks]
    row_request: torch.Tensor  # [N] request of each query row
    row_prefix: torch.Tensor  # [N] contiguous keys 0 .. prefix-1 (context, or causal chunk)
    row_tree: torch.Tensor  # [N, T] further keys (draft-tree ancestors, itself last), -1 = padding
    row_len: torch.Tensor  # [N] keys in all
    block_size: int


Attention = list[AttentionGroup] | RowMetadata
"""Which keys each new token attends to, in the form the device's kernel takes."""


class PagedBatch(NamedTuple):
    """Attention metadata of one forward over the paged cache, shared by all layers."""

    cache: PagedKVCache
    slots: torch.Tensor  # [N] slot each new token's K/V is written to
    attention: Attention
    fp64: bool = False
    """Groups form only: attend in float64 over the gathered keys (the CPU's batch-invariant
    mode: the padded key count of a group then cannot change a row's rounded result). The
    row form's kernel is batch-invariant as it is: every row is reduced on its own."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q `[1, H, N, D]`, k/v `[1, H_kv, N, D]` of the flat batch -> attention output `[1, H, N, D]`."""
        self.cache.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        return self.attend_written(layer, q[0].transpose(0, 1)).transpose(0, 1)[None]

    def attend_projected(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
    ) -> torch.Tensor:
        """From a layer's fused q/k/v projection `[N, (H + 2 H_kv) D]` and RoPE tables `[N, D]`
        to its attention output `[N, H, D]`: RoPE, K/V written (`plugins/kv_write.py`, one C++
        pass on the CPU), attention. Same values as `__call__` on the split, rotated q/k/v."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        return self.attend_written(layer, write_new_tokens(qkv, cos, sin, k_cache, v_cache, self.slots, num_heads))

    def attend_written(self, layer: int, q_flat: torch.Tensor) -> torch.Tensor:
        """q `[N, H, D]` of the flat batch, whose K/V are in the cache -> output `[N, H, D]`."""
        if isinstance(self.attention, RowMetadata):
            m = self.attention
            return paged_attention(
                q_flat.contiguous(),
                self.cache.k[layer],
                self.cache.v[layer],
                m.block_tables,
                m.row_request,
                m.row_prefix,
                m.row_tree,
                m.row_len,
                m.block_size,
            )
        n = q_flat.shape[0]
        if len(self.attention) == 1 and self.attention[0].query_index.numel() == n == self.attention[0].rows.shape[0]:
            # one group of every row, no padding: its rows are 0 .. N-1 in order (AttentionGroup)
            return self._attend_group(layer, q_flat, self.attention[0]).view(q_flat.shape)
        out = torch.empty_like(q_flat)
        for g in self.attention:
            out[g.rows] = self._attend_group(layer, q_flat, g)[g.valid]
        return out

    def _attend_group(self, layer: int, q_flat: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """`[G, T, H, D]`: the group's rows (padding included) attending."""
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        if not self.fp64:
            return attend(q_flat, k_cache, v_cache, g.query_index, g.key_slots, g.mask)
        kg, vg = (c[g.key_slots].transpose(1, 2).double() for c in (k_cache, v_cache))
        qg = q_flat[g.query_index].transpose(1, 2).double()
        res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask[:, None], enable_gqa=True)
        return res.transpose(1, 2).to(q_flat.dtype)
