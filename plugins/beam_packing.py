"""Dynamic tree attention for ReDrafter (arXiv 2403.09919, Appendix A.1): the W drafted beams of a
request share prefixes (at least the root token in column 0), so the target should verify each
distinct prefix once. `dedup_prefix` finds, per (beam, depth), the first beam with the same prefix;
`pack_beams` turns that into a packed token tree with a causal tree mask and the index that maps
per-node verification results back onto the beams.

Both are `specpipe::` custom ops with loop-free tensor code (the CPU path and the test oracle) and a
fake kernel with static shapes: the packed size is padded to N = W * L, the number of distinct
nodes of each request is returned in `num_nodes`.

Packed order is depth-major (all depth-0 nodes, then depth 1, ...), within a depth by the beam that
first reaches the prefix, so parents precede children and node 0 is the root whenever every beam
starts with the same token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def _check_beams(beams: Tensor) -> None:
    """Fail early with the expected layout; both kernels share it so fake and real agree."""
    if beams.dim() != 3:
        raise ValueError(f"beams must be [B, W, L], got shape {tuple(beams.shape)}")
    if beams.dtype != torch.int64:
        raise ValueError(f"beams must be int64 token ids, got {beams.dtype}")


def _dedup_prefix(beams: Tensor) -> Tensor:
    """[B, W, L] -> [B, W, L]: smallest beam k whose first j+1 tokens equal those of beam i."""
    w = beams.shape[1]
    same = beams.unsqueeze(2) == beams.unsqueeze(1)  # [B, W(i), W(k), L]: same token at depth j
    prefix_same = same.to(torch.int64).cummin(dim=-1).values.bool()  # [B, W, W, L]: same up to j
    k = torch.arange(w, device=beams.device).view(1, 1, w, 1)
    # k == i always matches, so the min is a real beam index (never the sentinel w).
    return torch.where(prefix_same, k, w).amin(dim=2)  # [B, W, L]


@torch.library.custom_op("specpipe::dedup_prefix", mutates_args=())
def dedup_prefix(beams: Tensor) -> Tensor:
    """beams [B, W, L] int64 -> prefix_tree [B, W, L] int64.

    prefix_tree[b, i, j] is the smallest k with beams[b, k, :j+1] == beams[b, i, :j+1]; (i, j) is a
    distinct tree node iff prefix_tree[b, i, j] == i.
    """
    _check_beams(beams)
    return _dedup_prefix(beams)


@dedup_prefix.register_fake
def _(beams: Tensor) -> Tensor:
    _check_beams(beams)
    return beams.new_empty(beams.shape)


def _pack_beams(beams: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Loop-free packing; see `pack_beams` for the outputs."""
    b, w, seq = beams.shape
    n = w * seq
    dev = beams.device
    prefix_tree = _dedup_prefix(beams)  # [B, W, L]
    beam_ids = torch.arange(w, device=dev).view(1, w, 1)
    is_node = prefix_tree == beam_ids  # [B, W, L]

    # Depth-major flat position f = j * W + i; a node's packed index is its rank among nodes in f order.
    is_node_dm = is_node.transpose(1, 2).reshape(b, n)  # [B, N]
    rank_dm = is_node_dm.to(torch.int64).cumsum(dim=1) - 1  # [B, N]
    rank = rank_dm.view(b, seq, w).transpose(1, 2)  # [B, W, L]: valid where is_node
    # (i, j) maps to the node (prefix_tree[i, j], j), which is a node by construction.
    unpack_index = rank.gather(1, prefix_tree)  # [B, W, L]
    num_nodes = is_node_dm.sum(dim=1)  # [B]

    # order[b, p] = depth-major flat position of packed node p (for p < num_nodes); stable keeps f order.
    order = torch.sort((~is_node_dm).to(torch.int64), dim=1, stable=True).indices  # [B, N]
    slot = torch.arange(n, device=dev).unsqueeze(0)  # [1, N]
    real = slot < num_nodes.unsqueeze(1)  # [B, N]
    node_depth = order // w  # [B, N]
    node_beam = order % w  # [B, N]

    beams_dm = beams.transpose(1, 2).reshape(b, n)  # [B, N]
    tokens = torch.where(real, beams_dm.gather(1, order), 0)  # [B, N]
    depths = torch.where(real, node_depth, 0)  # [B, N]

    # path[b, p, d] = packed index of node p's ancestor at depth d: beam node_beam's node at depth d.
    path = unpack_index.gather(1, node_beam.unsqueeze(-1).expand(b, n, seq))  # [B, N, L]
    parent_pos = (node_beam * seq + node_depth - 1).clamp(min=0)  # [B, N]: flat (i, j-1)
    parents = unpack_index.reshape(b, n).gather(1, parent_pos)  # [B, N]
    parents = torch.where(real & (node_depth > 0), parents, -1)

    # Rows see their ancestors and themselves; deeper entries and padding rows point at the row itself.
    d = torch.arange(seq, device=dev).view(1, 1, seq)
    keep = real.unsqueeze(-1) & (d <= node_depth.unsqueeze(-1))  # [B, N, L]
    path = torch.where(keep, path, slot.unsqueeze(-1))  # [B, N, L]
    tree_mask = torch.zeros(b, n, n, dtype=torch.bool, device=dev).scatter_(2, path, True)  # [B, N, N]
    return tokens, parents, depths, tree_mask, unpack_index, num_nodes


@torch.library.custom_op("specpipe::pack_beams", mutates_args=())
def pack_beams(beams: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """beams [B, W, L] int64 -> the distinct prefix-tree nodes of each request, packed to N = W * L.

    Returns (tokens [B, N] int64, pad 0; parents [B, N] int64, -1 at depth 0 and padding;
    depths [B, N] int64, pad 0; tree_mask [B, N, N] bool, self + ancestors, padding rows see only
    themselves; unpack_index [B, W, L] int64, packed node of (beam, depth); num_nodes [B] int64).
    """
    _check_beams(beams)
    return _pack_beams(beams)


@pack_beams.register_fake
def _(beams: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_beams(beams)
    b, w, seq = beams.shape
    n = w * seq
    return (
        beams.new_empty(b, n),
        beams.new_empty(b, n),
        beams.new_empty(b, n),
        beams.new_empty(b, n, n, dtype=torch.bool),
        beams.new_empty(b, w, seq),
        beams.new_empty(b),
    )


class PackedBeams(NamedTuple):
    """The outputs of `specpipe::pack_beams`, named."""

    tokens: Tensor  # [B, N] int64
    parents: Tensor  # [B, N] int64
    depths: Tensor  # [B, N] int64
    tree_mask: Tensor  # [B, N, N] bool
    unpack_index: Tensor  # [B, W, L] int64
    num_nodes: Tensor  # [B] int64


def pack(beams: Tensor) -> PackedBeams:
    """beams [B, W, L] int64 -> PackedBeams (N = W * L), via the registered op; one beam
    (what load-aware speculation picks most at batch 1) is its own tree, a chain, built
    directly (the same outputs as the op's, ~15x cheaper on the CPU)."""
    if beams.shape[1] == 1:
        _check_beams(beams)
        return chain(beams)
    return PackedBeams(*torch.ops.specpipe.pack_beams(beams))


def chain(beams: Tensor) -> PackedBeams:
    """`pack_beams` of a single beam [B, 1, L]: node j is token j, child of node j - 1."""
    b, _, seq = beams.shape
    j = torch.arange(seq, device=beams.device)
    return PackedBeams(
        beams[:, 0].clone(),
        (j - 1).expand(b, seq).clone(),
        j.expand(b, seq).clone(),
        torch.ones(seq, seq, dtype=torch.bool, device=beams.device).tril_().expand(b, seq, seq).clone(),
        j.view(1, 1, seq).expand(b, 1, seq).clone(),
        torch.full((b,), seq, dtype=torch.int64, device=beams.device),
    )


def unpacked(beams: Tensor) -> PackedBeams:
    """beams [B, W, L] -> the tree *without* packing: the shared root (every beam's first
    token, the bonus) and each beam's L - 1 drafts as its own chain, duplicates kept, so
    1 + W * (L - 1) nodes are verified whatever the beams share (padded to N = W * L like
    `pack_beams`). ReDrafter's ablation of dynamic tree attention (§3.3, Fig. 6);
    verification treats duplicates as the point masses they are (a duplicate of a rejected
    sibling is rejected), so output stays exact."""
    _check_beams(beams)
    b, w, seq = beams.shape
    dev, per = beams.device, seq - 1
    real, n = 1 + w * per, w * seq
    node = torch.arange(n, device=dev)
    depth = torch.where((node >= 1) & (node < real), (node - 1) % max(per, 1) + 1, 0)  # [N]
    parents = torch.where(depth == 1, 0, node - 1).masked_fill(depth == 0, -1)
    beam = (node - 1).div(max(per, 1), rounding_mode="floor")
    row, col = node[:, None], node[None, :]
    same = (beam[:, None] == beam[None, :]) & (depth[None, :] >= 1) & (col <= row) & (row < real)
    tree_mask = (row == col) | ((col == 0) & (row < real)) | same  # self + root + own chain
    tokens = torch.zeros(b, n, dtype=beams.dtype, device=dev)
    tokens[:, 0] = beams[:, 0, 0]
    tokens[:, 1:real] = beams[:, :, 1:].reshape(b, w * per)
    unpack_index = torch.cat(
        [torch.zeros(w, 1, dtype=torch.int64, device=dev), 1 + torch.arange(w * per, device=dev).view(w, per)], dim=1
    )
    return PackedBeams(
        tokens,
        parents.expand(b, n).clone(),
        depth.expand(b, n).clone(),
        tree_mask.expand(b, n, n).clone(),
        unpack_index.expand(b, w, seq).clone(),
        torch.full((b,), real, dtype=torch.int64, device=dev),
    )


def unpack(values: Tensor, unpack_index: Tensor) -> Tensor:
    """Per-node results [B, N, ...] -> per-beam [B, W, L, ...], e.g. verification logits back to beams."""
    b, w, seq = unpack_index.shape
    idx = unpack_index.reshape(b, w * seq, *([1] * (values.dim() - 2)))
    idx = idx.expand(b, w * seq, *values.shape[2:])
    return values.gather(1, idx).view(b, w, seq, *values.shape[2:])
