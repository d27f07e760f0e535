"""The one draft-tree type every method proposes and `runtime/verify.py` accepts, with the
tree helpers the proposers share (depths, children, prune, trie merge, breadth-first order).

Packed order: the root (node 0) first, parents before children, siblings in the order the
drafter prefers (= the order verification tries them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DraftTree:
    """One request's packed draft tree. An auto-regressive step is the one-node tree
    `[root]`: verifying it is sampling the next token."""

    tokens: list[int]
    """[N] token of every node; node 0 is the root (the previous bonus token)."""
    parents: list[int]
    """[N] parent node index, -1 for the root."""
    draft_probs: torch.Tensor | None = None
    """[N, V] draft law (probabilities) each node was proposed from (row 0 unused; siblings
    share a row); None when nothing needs it. Probabilities, not logs: verification reads
    p, and SD's one-child levels draw from it, so neither pays an exp (nor drafting a log)."""
    depths: list[int] = field(default_factory=list)
    """[N] distance from the root (RoPE position = context length + depth); derived from parents if empty."""
    mask: torch.Tensor | None = None
    """[N, N] bool ancestor-or-self mask for verification; derived from parents if None."""
    node_budget: list[int] = field(default_factory=list)
    """[N] smallest tree size (node budget, root included) whose tree also holds this node;
    empty when only the whole tree is known. Nested trees (ReDrafter's best-first beams)
    let load-aware speculation tell what a smaller budget would have accepted."""
    sampled: bool = False
    """True: every node was *drawn* from its `draft_probs` row, siblings without
    replacement in packed order, so verification uses those laws; False: nodes are
    deterministic candidates, verified as point masses."""

    def __post_init__(self) -> None:
        if not self.depths:
            self.depths = depths_of(self.parents)
        if self.mask is None:  # a chain's is shared (`chain_mask`), any other tree's built
            n = len(self.parents)
            self.mask = chain_mask(n) if self.parents == list(range(-1, n - 1)) else ancestor_mask(self.parents)

    @classmethod
    def root(cls, token: int) -> DraftTree:
        return cls.chain([token])

    @classmethod
    def chain(cls, tokens: list[int], budgets: bool = False) -> DraftTree:
        """The deterministic tree of one child per level: node j is `tokens[j]`, child of
        node j - 1; `budgets`: each node labelled with the chain cut at its depth (j + 1 nodes)."""
        n = len(tokens)
        node_budget = list(range(1, n + 1)) if budgets else []
        return cls(tokens, list(range(-1, n - 1)), None, list(range(n)), chain_mask(n), node_budget)


_CHAIN_MASKS: dict[int, torch.Tensor] = {}


def chain_mask(n: int) -> torch.Tensor:
    """The ancestor-or-self mask of a chain of `n` nodes (causal: lower-triangular), shared by
    every chain of that length (masks are read, never written: `runtime/step_batch.py`,
    `runtime/logits_processing.py`); every chain `DraftTree` gets it. Made per chain, the
    mask was ~half of building a ReDrafter chain in the engine (~40 us at batch 1, caches
    cold after the forward), and ~25 us of a sampled draft-LM chain's (`ancestor_mask`)."""
    mask = _CHAIN_MASKS.get(n)
    if mask is None:
        mask = _CHAIN_MASKS[n] = torch.ones(n, n, dtype=torch.bool).tril_()
    return mask


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool ancestor-or-self mask of a packed tree (parents before their children),
    from each node's ancestors as a bit set (`bit_rows`): one numpy unpack, where a row
    update per node as torch ops cost ~3 us a node (~50 us for a 17-node tree)."""
    sets: list[int] = []
    for node, parent in enumerate(parents):
        sets.append((sets[parent] if parent >= 0 else 0) | 1 << node)
    return bit_rows(sets, len(parents))


def bit_rows(sets: list[int], width: int) -> torch.Tensor:
    """`[len(sets), width]` bool: row i, column j is bit j of `sets[i]` (e.g. a node's
    ancestors). Unpacked from the sets' bytes in numpy: ~4 us for a level of a few
    requests, where a nested list through `torch.tensor` cost ~5 us for one 6-bit row and
    ~17 for four 17-bit ones."""
    size = (width + 7) // 8
    packed = np.frombuffer(b"".join(bits.to_bytes(size, "little") for bits in sets), dtype=np.uint8)
    rows = np.unpackbits(packed.reshape(len(sets), size), axis=1, count=width, bitorder="little")
    return torch.from_numpy(rows.view(np.bool_))


def depths_of(parents: list[int]) -> list[int]:
    """Distance of every node from the root (parents come before their children)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children of every node in packed order (= the drafter's preference order)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def _repack(tree: DraftTree, order: list[int], budgets: Mapping[int, int] | None = None) -> DraftTree:
    """The deterministic tree of `tree`'s nodes `order` (a subset closed under parents, root
    first), with `budgets[n]` (or `tree.node_budget[n]`, if it has them) as node budgets."""
    index = {n: i for i, n in enumerate(order)}
    budgets = budgets if budgets is not None else dict(enumerate(tree.node_budget)) or None
    return DraftTree(
        [tree.tokens[n] for n in order],
        [index.get(tree.parents[n], -1) for n in order],
        node_budget=[budgets[n] for n in order] if budgets is not None else [],
    )


def prune(tree: DraftTree, scores: list[float], budget: int) -> DraftTree:
    """Keep the `budget` best non-root nodes by score (a child never scores above its
    parent, so the kept set is a tree; ties go to the shallower node), packed breadth-first
    with siblings best first. The k-th node kept is labelled with node budget k + 1: the
    prune to any smaller budget keeps exactly the nodes labelled within it (nested trees)."""
    depth = depths_of(tree.parents)
    kept = {0: 1}  # node -> its node budget (the root: 1)
    for n in sorted(range(1, len(tree.tokens)), key=lambda n: (-scores[n], depth[n], n)):
        if len(kept) > budget:
            break
        if tree.parents[n] in kept:
            kept[n] = len(kept) + 1
    return _repack(tree, sorted(kept, key=lambda n: (depth[n], -scores[n], n)), kept)


def breadth_first(tree: DraftTree) -> DraftTree:
    """Repack so that levels are contiguous (parents before children, sibling order kept)."""
    depth = depths_of(tree.parents)
    return _repack(tree, sorted(range(len(tree.tokens)), key=lambda n: (depth[n], n)))


def merge(base: DraftTree, extra: DraftTree, extra_budget: int | None = None) -> DraftTree:
    """Trie union of two candidate trees with the same root: a path of `extra` already in
    `base` is not added again, so siblings stay distinct tokens. With `extra_budget` (and
    node budgets on `base`), the nodes only `extra` brings are labelled with it."""
    if base.tokens[0] != extra.tokens[0]:
        raise ValueError(f"cannot merge trees with roots {base.tokens[0]} and {extra.tokens[0]}")
    tokens, parents = list(base.tokens), list(base.parents)
    labelled = extra_budget is not None and bool(base.node_budget)
    budgets = list(base.node_budget) if labelled else []
    child = {(p, t): n for n, (t, p) in enumerate(zip(tokens, parents, strict=True)) if p >= 0}
    where = {0: 0}  # node of `extra` -> node of the merged tree
    for n in range(1, len(extra.tokens)):
        parent, token = where[extra.parents[n]], extra.tokens[n]
        if (parent, token) not in child:
            tokens.append(token)
            parents.append(parent)
            if labelled:
                budgets.append(extra_budget)  # type: ignore[arg-type]
            child[parent, token] = len(tokens) - 1
        where[n] = child[parent, token]
    return breadth_first(DraftTree(tokens, parents, node_budget=budgets))


def chain(root: int, drafts: list[int]) -> DraftTree:
    """A single path: the root, then `drafts` in order (point-mass candidates)."""
    return DraftTree([root, *drafts], list(range(-1, len(drafts))))
