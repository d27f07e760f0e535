"""Turning one step's work into attention metadata for the flat batch: which slots each
request's new tokens are written to and read from, and the block-diagonal mask.

Each request contributes a `Segment`: `num_new` consecutive tokens of the flat batch,
written to the slots of its positions `[context, context + num_new)`, attending to its
committed context plus, among its new tokens, a causal chunk (prefill, decode) or its
draft tree's ancestor mask (which may also cover tree nodes already cached: a drafter
fed one tree level at a time). Tree nodes occupy consecutive slots in packed order; their
RoPE positions (context + depth) are the caller's business.

Requests are grouped so that padding stays small: every segment of at most
`SHORT_SEGMENT` new tokens (decode tokens and draft trees) joins one padded group, each
longer one (a prefill chunk) gets a group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_defs.paged_kv_cache import AttentionGroup

SHORT_SEGMENT = 64


@dataclass
class Segment:
    start: int
    """Index of the request's first new token in the flat batch."""
    context_len: int
    """Committed tokens before the new ones."""
    slots: torch.Tensor
    """[context_len + num_new] cache slots of positions 0 .. context_len + num_new - 1."""
    tree_mask: torch.Tensor | None = None
    """[num_new, K] bool over the last K key columns (K >= num_new: the new tokens and the
    K - num_new cached ones before them, e.g. a draft tree's earlier levels); every
    earlier column is visible. None = causal."""

    @property
    def num_new(self) -> int:
        return int(self.slots.shape[0]) - self.context_len


def write_slots(segments: list[Segment]) -> torch.Tensor:
    """[N] slot of every new token of the flat batch, in batch order."""
    return torch.cat([s.slots[s.context_len :] for s in segments])


def group(segments: list[Segment], device: torch.device | str = "cpu") -> AttentionGroup:
    """One padded attention group over `segments`."""
    t = max(s.num_new for s in segments)
    width = max(int(s.slots.shape[0]) for s in segments)
    query_index = torch.zeros(len(segments), t, dtype=torch.long)
    key_slots = torch.zeros(len(segments), width, dtype=torch.long)
    mask = torch.zeros(len(segments), t, width, dtype=torch.bool)
    valid = torch.zeros(len(segments), t, dtype=torch.bool)
    mask[:, :, 0] = True  # padding queries attend slot column 0 (their output is dropped)
    for g, s in enumerate(segments):
        n, c = s.num_new, s.context_len
        query_index[g, :n] = torch.arange(s.start, s.start + n)
        key_slots[g, : c + n] = s.slots
        own = torch.ones(n, n, dtype=torch.bool).tril_() if s.tree_mask is None else s.tree_mask
        k = own.shape[1]
        mask[g, :n, : c + n - k] = True
        mask[g, :n, c + n - k : c + n] = own
        valid[g, :n] = True
    return AttentionGroup(
        query_index.to(device), key_slots.to(device), mask.to(device), valid.to(device), query_index[valid].to(device)
    )


def build_groups(segments: list[Segment], device: torch.device | str = "cpu") -> list[AttentionGroup]:
    short = [s for s in segments if s.num_new <= SHORT_SEGMENT]
    long = [s for s in segments if s.num_new > SHORT_SEGMENT]
    return [group(g, device) for g in ([short] if short else []) + [[s] for s in long]]
