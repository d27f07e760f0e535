"""Lyanna drafting ("Make Every Draft Count"): trees from one hidden-state chain by
token-info sampling (Algorithm 1), and re-sampling of rejected drafts (Algorithm 2)
verified fused into the next step's target forward (§6.2).

The drafter (`model_defs/lyanna.py`) turns the target's hidden state h_0 and the bonus
token t_1 into a chain h_1..h_k whose logits come from ONE LM-head product; the chain does
not depend on the drafted tokens, so which token a node follows enters only through the
token-info bias: the logits of a node's children are `l_i + E'(token of the node)`.

Algorithm 1 (token-info sampling), per request:
    frontier = [root]
    for depth i = 1..k:
        for each frontier node n: scores = log_softmax(l_i + E'(token(n))); its top-w children
        keep the w best (node, child) pairs by joint log-probability -> the next frontier
    keep the B best drafted nodes by joint log-probability (the verification budget)

Algorithm 2 (re-sampling): when verification stops at depth j (a draft rejected, or the
tree ran out), the target's bonus token t_gt sits at depth j+1 and the chain rows
l_{j+2}..l_k are unused. If more than r of them remain, a small subtree rooted at t_gt is
built from them with t_gt's token info (Algorithm 1 again) — no drafter forward. With
*fusion* it is merged into the next step's regular draft (same root t_gt, shared prefixes
deduplicated) and verified in that step's forward; without fusion it is the next step's
tree on its own (its verification spends a target forward).

Why this stays exactly lossless: every node of the merged tree is a deterministic
candidate (a point mass), siblings are distinct tokens (the merge is a trie), and
verification is the same rule as for every other deterministic tree: greedy takes the
target's argmax path; sampling runs recursive rejection with point-mass drafts, which
emits each level's token exactly from the target's distribution whatever the candidates
are (`runtime/verify.py`). Re-sampling only changes *which* candidates are offered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.verify import DraftTree

Bias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(previous tokens [M], logits [M, V]) -> logits with their token-info bias added."""


@dataclass(frozen=True)
class LyannaParams:
    """Drafting effort per step."""

    depth: int = 3
    """Chain steps k (tree depth)."""
    width: int = 4
    """Nodes kept per level (w), and children tried per node."""
    budget: int = 12
    """Drafted nodes verified per step (B), the best by joint probability. The tree has at
    most depth x width nodes, so a larger B verifies them all (B = 16 needs depth 4 at width 4)."""
    resample: bool = True
    """Re-sample rejected drafts from the unused chain rows (Algorithm 2)."""
    fuse: bool = True
    """Verify the re-sampled subtree inside the next step's forward (merged with the regular
    draft); False: it is the next step's whole tree."""
    min_remaining: int = 0
    """r: re-sample only when more than r chain rows remain after the bonus token."""
    resample_budget: int = 4
    """Most nodes of a re-sampled subtree."""

    def __post_init__(self) -> None:
        for name in ("depth", "width", "budget", "resample_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_remaining < 0:
            raise ValueError(f"min_remaining must be >= 0, got {self.min_remaining}")

    @property
    def max_nodes(self) -> int:
        """Most nodes a step verifies, root included (regular draft + a fused subtree)."""
        return 1 + self.budget + (self.resample_budget if self.resample else 0)


@dataclass
class Subtree:
    """Candidate continuations of a root: `tokens[0]` is the root, parents before children."""

    tokens: list[int]
    parents: list[int]


def token_info_tree(root: int, logits: torch.Tensor, bias: Bias | None, width: int, budget: int) -> Subtree:
    """Algorithm 1 for one request: `logits` `[k, V]` are the chain rows for depths 1..k."""
    tokens, parents, joint = [root], [-1], [0.0]
    frontier = [0]
    for row in logits:
        prev = torch.tensor([tokens[n] for n in frontier], device=row.device)
        rows = row.expand(len(frontier), -1)
        rows = bias(prev, rows) if bias is not None else rows
        logp = torch.log_softmax(rows.float(), dim=-1)  # [F, V]
        top = logp.topk(min(width, logp.shape[-1]), dim=-1)  # each node's best children
        scores = torch.tensor([joint[n] for n in frontier], device=row.device)[:, None] + top.values
        best = scores.flatten().topk(min(width, scores.numel()))
        frontier_next = []
        for score, flat in zip(best.values.tolist(), best.indices.tolist(), strict=True):
            f, c = divmod(flat, top.indices.shape[1])
            tokens.append(int(top.indices[f, c]))
            parents.append(frontier[f])
            joint.append(score)
            frontier_next.append(len(tokens) - 1)
        frontier = frontier_next
    return prune(Subtree(tokens, parents), joint, budget)


def depths(parents: list[int]) -> list[int]:
    """Distance of every node from the root (parents come before their children)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def prune(tree: Subtree, joint: list[float], budget: int) -> Subtree:
    """Keep the `budget` best non-root nodes by joint log-probability (a child never scores
    above its parent, so the kept set is a tree; ties go to the shallower node), packed
    breadth-first with siblings best first."""
    depth = depths(tree.parents)
    order = sorted(range(1, len(tree.tokens)), key=lambda n: (-joint[n], depth[n], n))
    kept = {0}
    for n in order:
        if len(kept) > budget:
            break
        if tree.parents[n] in kept:
            kept.add(n)
    packed = sorted(kept, key=lambda n: (depth[n], -joint[n], n))
    index = {n: i for i, n in enumerate(packed)}
    return Subtree([tree.tokens[n] for n in packed], [index.get(tree.parents[n], -1) for n in packed])


def merge(base: Subtree, extra: Subtree) -> Subtree:
    """Trie union of two candidate trees with the same root (§6.2 fusion): a path of `extra`
    already in `base` is not added again, so siblings stay distinct tokens."""
    if base.tokens[0] != extra.tokens[0]:
        raise ValueError(f"cannot merge trees with roots {base.tokens[0]} and {extra.tokens[0]}")
    tokens, parents = list(base.tokens), list(base.parents)
    child = {(p, t): n for n, (t, p) in enumerate(zip(tokens, parents, strict=True)) if p >= 0}
    where = {0: 0}  # node of `extra` -> node of the merged tree
    for n in range(1, len(extra.tokens)):
        parent, token = where[extra.parents[n]], extra.tokens[n]
        if (parent, token) not in child:
            tokens.append(token)
            parents.append(parent)
            child[parent, token] = len(tokens) - 1
        where[n] = child[parent, token]
    return breadth_first(Subtree(tokens, parents))


def breadth_first(tree: Subtree) -> Subtree:
    """Repack so that levels are contiguous (parents before children, sibling order kept)."""
    depth = depths(tree.parents)
    packed = sorted(range(len(tree.tokens)), key=lambda n: (depth[n], n))
    index = {n: i for i, n in enumerate(packed)}
    return Subtree([tree.tokens[n] for n in packed], [index.get(tree.parents[n], -1) for n in packed])


def resample_subtree(
    bonus: int, logits: torch.Tensor, accepted: int, bias: Bias | None, params: LyannaParams
) -> Subtree | None:
    """Algorithm 2: after `accepted` drafted tokens and the bonus token (at depth accepted+1),
    a subtree rooted at the bonus from the chain rows still unused (depths accepted+2..k),
    or None when no more than `min_remaining` rows remain."""
    rest = logits[accepted + 1 :]
    if len(rest) <= params.min_remaining or len(rest) == 0:
        return None
    return token_info_tree(bonus, rest, bias, params.width, params.resample_budget)


def to_draft_tree(tree: Subtree) -> DraftTree:
    """A deterministic (point-mass) tree for verification."""
    return DraftTree(list(tree.tokens), list(tree.parents))
