"""KV cache seen by the model, and the attention mask over it.

Layout: one contiguous buffer per layer, `[max_batch, num_kv_heads, max_len, head_dim]`.
Row `b` holds `lengths[b]` committed tokens in columns `[0, lengths[b])`. A forward over
`T` new tokens writes their K/V into columns `[lengths[b], lengths[b] + T)` but does
*not* commit them: the caller decides how many to keep (`commit`). That split is what
speculative verification needs — a tree is written, only the accepted path is kept —
and it lets rows of a batch carry different numbers of new tokens (right padding: a
padded query writes into a column that the next forward overwrites).

Mask convention (`tree_mask`): `[B, T, T]` bool over the *new* tokens, True = query may
attend that new token. Committed context is always visible. Without a tree mask the new
tokens are causal among themselves.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-row contiguous KV cache for a fixed batch of sequences."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        # [B] committed tokens per row
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def prepare(self, num_new: int) -> tuple[torch.Tensor, int]:
        """Columns to write `num_new` tokens per row into (`[B, T]`) and the number of key
        columns attention must read. Raises if a row would overflow."""
        need = int(self.lengths.max()) + num_new
        if need > self.max_len:
            raise ValueError(
                f"KV cache overflow: {need} tokens needed, capacity {self.max_len}; "
                "raise max_seq_len or shorten the request"
            )
        arange = torch.arange(num_new, device=self.lengths.device)
        return self.lengths[:, None] + arange, need

    def update(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v `[B, H_kv, T, D]` at `slots` `[B, T]`; return keys, values
        `[B, H_kv, num_keys, D]` (views of the cache)."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        self.k[layer][rows, :, slots] = k.transpose(1, 2)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)
        return self.k[layer][:, :, :num_keys], self.v[layer][:, :, :num_keys]

    def commit(self, num_tokens: torch.Tensor) -> None:
        """Keep the first `num_tokens[b]` tokens written by the last forward in row b."""
        self.lengths += num_tokens.to(self.lengths)

    def commit_path(self, path: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Keep an accepted tree path: new token `path[b, i]` (index among the last
        forward's new tokens) moves to column `lengths[b] + i`, for i < num_tokens[b];
        everything else the forward wrote is dropped. `path` `[B, P]` must be increasing
        within a row (parents precede children in a packed tree), so no source column is
        overwritten before it is read; entries past num_tokens[b] are ignored."""
        rows = torch.arange(self.batch_size, device=path.device)[:, None]  # [B, 1]
        src = self.lengths[:, None] + path  # [B, P]
        dst = self.lengths[:, None] + torch.arange(path.shape[1], device=path.device)  # [B, P]
        for cache in (*self.k, *self.v):
            cache[rows, :, dst] = cache[rows, :, src]  # gather happens before the scatter
        self.commit(num_tokens)


def attention_mask(lengths: torch.Tensor, num_new: int, num_keys: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean mask `[B, 1, T, num_keys]` (True = attend) for `num_new` tokens written at
    columns `lengths[b] + t`; see the module docstring for `tree_mask` `[B, T, T]`."""
    device = lengths.device
    cols = torch.arange(num_keys, device=device)  # [S]
    context = cols[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    rel = cols[None, :] - lengths[:, None]  # [B, S] column index relative to the new tokens
    in_new = (rel >= 0) & (rel < num_new)  # [B, S]
    if tree_mask is None:
        t = torch.arange(num_new, device=device)
        new_visible = in_new[:, None, :] & (rel[:, None, :] <= t[None, :, None])  # [B, T, S]
    else:
        if tree_mask.shape != (lengths.shape[0], num_new, num_new):
            raise ValueError(
                f"tree_mask shape {tuple(tree_mask.shape)} != (batch, new, new) = "
                f"({lengths.shape[0]}, {num_new}, {num_new})"
            )
        idx = rel.clamp(0, num_new - 1)[:, None, :].expand(-1, num_new, -1)  # [B, T, S]
        new_visible = in_new[:, None, :] & torch.gather(tree_mask, 2, idx)
    return (context | new_visible)[:, None]
