"""Turning one step's work into attention metadata for the flat batch: which slots each
request's new tokens are written to and read from, and the block-diagonal mask.

Each request contributes a `Segment`: `num_new` consecutive tokens of the flat batch,
written to the slots of its positions `[context, context + num_new)`, attending to its
committed context plus, among its new tokens, a causal chunk (prefill, decode) or its
draft tree's ancestor mask (which may also cover tree nodes already cached: a drafter
fed one tree level at a time). Tree nodes occupy consecutive slots in packed order; their
RoPE positions (context + depth) are the caller's business.

Both forms are built on the host (the model runner moves them to its device, or packs
them into a CUDA graph's buffers); see `model_defs/paged_kv_cache.py`. For a GPU,
`build_rows` gives every query row its ordered key list (`RowMetadata`, int32). For the
CPU, `build_groups` pads requests into groups: segments of at most `SHORT_SEGMENT` new
tokens (decode tokens and draft trees) join one padded group per power-of-two bucket of
their new-token count, each longer one (a prefill chunk) gets a group of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from model_defs.paged_kv_cache import Attention, AttentionGroup, RowMetadata

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
    """[N] slot of every new token of the flat batch, in batch order (one request's: a view
    of its slots, no copy)."""
    if len(segments) == 1:
        return segments[0].slots[segments[0].context_len :]
    return torch.cat([s.slots[s.context_len :] for s in segments])


def group(segments: list[Segment], device: torch.device | str = "cpu") -> AttentionGroup:
    """One padded attention group over `segments` (`padded`; one segment's, or one of decode
    tokens alone, with fewer host ops: `_one`, `_decode`)."""
    if len(segments) == 1:
        arrays = _one(segments[0])
    elif all(s.tree_mask is None and s.num_new == 1 for s in segments):
        arrays = _decode(segments)
    else:
        arrays = padded(segments)
    if getattr(device, "type", device) == "cpu":  # (`.to` for the CPU: for nothing; `torch.device(...)`: ~10 us cold)
        return AttentionGroup(*(torch.from_numpy(a) for a in arrays))
    return AttentionGroup(*(torch.from_numpy(a).to(device) for a in arrays))


GroupArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""`AttentionGroup`'s fields as numpy arrays (query_index, key_slots, mask, valid, rows)."""


def padded(segments: list[Segment]) -> GroupArrays:
    """The group's arrays, any segments. Filled in numpy (a slice assignment costs ~0.5 us
    there, ~4 us as a torch op): a draft-LM step at batch 8 builds a group per draft level
    and one for the target, ~0.25 ms each with torch ops, ~0.14 with numpy and ~0.07 with
    each segment's size read once and causal masks built once per size."""
    news = [s.num_new for s in segments]
    t = max(news)
    width = max(int(s.slots.shape[0]) for s in segments)
    query_index = np.zeros((len(segments), t), dtype=np.int64)
    key_slots = np.zeros((len(segments), width), dtype=np.int64)
    mask = np.zeros((len(segments), t, width), dtype=np.bool_)
    valid = np.zeros((len(segments), t), dtype=np.bool_)
    mask[:, :, 0] = True  # padding queries attend slot column 0 (their output is dropped)
    for g, (s, n) in enumerate(zip(segments, news, strict=True)):
        c = s.context_len
        query_index[g, :n] = np.arange(s.start, s.start + n)
        key_slots[g, : c + n] = s.slots.numpy()
        own = _causal(n) if s.tree_mask is None else s.tree_mask.numpy()
        k = own.shape[1]
        mask[g, :n, : c + n - k] = True
        mask[g, :n, c + n - k : c + n] = own
        valid[g, :n] = True
    return query_index, key_slots, mask, valid, query_index[valid]


def _one(s: Segment) -> GroupArrays:
    """`padded([s])` without padding: its slots as they are (a view), a mask of ones with its
    own block last. The steps of batch 1 build one group a forward (and a draft LM's levels
    one each); after a forward has left the caches cold, `padded`'s dozen numpy ops cost ~90
    us here (2-core EPYC), ~10% of an auto-regressive step."""
    n, w = s.num_new, int(s.slots.shape[0])
    query_index = np.arange(s.start, s.start + n)[None]
    own = _causal(n) if s.tree_mask is None else s.tree_mask.numpy()
    mask = np.ones((1, n, w), dtype=np.bool_)
    mask[0, :, w - own.shape[1] :] = own
    return query_index, s.slots.numpy()[None], mask, np.ones((1, n), dtype=np.bool_), query_index[0]


def _decode(segments: list[Segment]) -> GroupArrays:
    """`padded(segments)` for one new token each (an auto-regressive batch, a draft LM's
    roots): no padding queries, each row sees its own slots, so the mask is one comparison."""
    lengths = np.array([int(s.slots.shape[0]) for s in segments])
    key_slots = np.zeros((len(segments), int(lengths.max())), dtype=np.int64)
    for g, s in enumerate(segments):
        key_slots[g, : lengths[g]] = s.slots.numpy()
    query_index = np.array([s.start for s in segments], dtype=np.int64)[:, None]
    mask = (np.arange(key_slots.shape[1]) < lengths[:, None])[:, None, :]
    return query_index, key_slots, mask, np.ones((len(segments), 1), dtype=np.bool_), query_index[:, 0]


@functools.lru_cache(maxsize=256)
def _causal(n: int) -> np.ndarray:
    """The causal mask of n new tokens among themselves (read only: copied into groups)."""
    out = np.tri(n, dtype=np.bool_)
    out.flags.writeable = False
    return out


def build_groups(segments: list[Segment], device: torch.device | str = "cpu") -> list[AttentionGroup]:
    """Short segments grouped by new-token count in power-of-two buckets (1, 2, 3-4, 5-8,
    ...): a group pads every request to its longest, so one request's 17-node tree must
    not make seven decode tokens attend as 17 rows each (at batch 8 that padding cost as
    much as all eight drafting); each long segment alone."""
    buckets: dict[int, list[Segment]] = {}
    long = []
    for s in segments:
        n = s.num_new
        if n <= SHORT_SEGMENT:
            buckets.setdefault((n - 1).bit_length(), []).append(s)
        else:
            long.append([s])
    return [group(g, device) for _, g in sorted(buckets.items())] + [group(g, device) for g in long]


def build_rows(segments: list[Segment], block_size: int) -> RowMetadata:
    """Row form: query row t of a segment with context c sees token indices `0 .. c + t`
    (causal), or `0 .. L - K - 1` and then the indices of its tree-mask columns (a draft
    tree node: its ancestors and itself, in packed order; L = c + num_new, K = mask
    columns). A tree node at depth d thus sees the same logical key sequence as the
    decode token at position c + d would, which is what makes the kernel's result for it
    equal to auto-regression's when the K/V agree.

    Filled in numpy, as `group` is: on a GPU this runs for every target step and every
    draft-LM level, and with ~20 torch ops a segment it took ~0.25 ms a call at batch 1 and
    ~0.6 ms at batch 8 under cProfile on an H100 host (whose auto-regressive step took ~1.5
    ms at batch 1); here, numpy is 2.5-4x faster (batch 1: 0.09 -> 0.02 ms)."""
    news = [s.num_new for s in segments]
    masks = [None if s.tree_mask is None else s.tree_mask.numpy() for s in segments]
    counts = [None if m is None else m.sum(1) for m in masks]
    width = max([1] + [int(c.max()) for c in counts if c is not None])
    lengths = [int(s.slots.shape[0]) for s in segments]
    total = sum(news)
    tables = np.zeros((len(segments), max(-(-n // block_size) for n in lengths)), dtype=np.int32)
    row_request = np.empty(total, dtype=np.int32)
    row_prefix = np.empty(total, dtype=np.int32)
    row_len = np.empty(total, dtype=np.int32)
    row_tree = np.full((total, width), -1, dtype=np.int32)
    row = 0
    for r, (s, n, mask, count) in enumerate(zip(segments, news, masks, counts, strict=True)):
        table = s.slots.numpy()[::block_size] // block_size
        tables[r, : table.shape[0]] = table
        rows = slice(row, row + n)
        row_request[rows] = r
        if mask is None or count is None:
            row_prefix[rows] = row_len[rows] = np.arange(s.context_len + 1, s.context_len + n + 1)
        else:
            base = lengths[r] - mask.shape[1]
            t, j = mask.nonzero()  # row-major: a row's columns ascending
            offsets = np.cumsum(count) - count
            row_tree[row + t, np.arange(t.shape[0]) - offsets[t]] = base + j
            row_prefix[rows] = base
            row_len[rows] = base + count
        row += n
    return RowMetadata(
        torch.from_numpy(tables),
        torch.from_numpy(row_request),
        torch.from_numpy(row_prefix),
        torch.from_numpy(row_tree),
        torch.from_numpy(row_len),
        block_size,
    )


def build_attention(
    segments: list[Segment], block_size: int, device: torch.device | str, rows: bool | None = None
) -> Attention:
    """The form `device`'s kernel takes, on the host (rows for a GPU, groups for the CPU;
    `rows` overrides, e.g. to run the row form's PyTorch reference on the CPU)."""
    if rows is None:
        rows = torch.device(device).type == "cuda"
    return build_rows(segments, block_size) if rows else build_groups(segments)
