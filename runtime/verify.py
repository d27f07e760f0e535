"""Accepting a verified draft tree: which drafted tokens the target keeps, and its bonus.

Terms (used the same way everywhere in specpipe):
- *root*: node 0 of a packed tree, the bonus token of the previous step, emitted then
  and processed (its KV written) in this step's verification forward;
- *accepted* tokens: drafted tokens the target keeps, a path down from the root;
- *bonus* token: one token the target itself picks at the last accepted node (on a
  mismatch, a leaf, or after every child was rejected). A step always emits
  `accepted + 1` tokens, so speculation never emits fewer than auto-regression.

Greedy: walk down while some child equals the target's argmax. Exact by construction.

Sampling: recursive rejection sampling over *point-mass* (deterministic) candidates —
RSD (Jeon et al. 2024, Algorithm 1) with draft distributions that are deltas on the
children, tried in their order. Child x is accepted with probability
min(1, q(x)/p(x)) = q(x); on rejection the residual is q <- norm([q - δ_x]^+), i.e. x is
zeroed out and q renormalised; if every child is rejected the bonus is drawn from the
last residual. Because siblings are distinct tokens (dedup_prefix guarantees it), the
emitted token at every level is distributed exactly as q, the target's distribution
after temperature/top-k/top-p (`runtime.sampling.target_probs`). Apple's ReDrafter
instead flips independent coins per beam and keeps the longest beam; its README notes
that "might not give the exact distribution match", so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.sampling import SamplingParams, sample, target_probs


@dataclass
class DraftTree:
    """One request's packed draft tree (root first, parents before children). An
    auto-regressive step is the one-node tree `[root]`: verifying it is sampling the next token."""

    tokens: list[int]
    """[N] token of every node; node 0 is the root (the previous bonus token)."""
    parents: list[int]
    """[N] parent node index, -1 for the root."""
    draft_log_probs: torch.Tensor | None = None
    """[N, V] draft log-distribution each node was drawn from (row 0 unused); None when
    the acceptance rule does not need it (greedy, point-mass candidates)."""
    depths: list[int] = field(default_factory=list)
    """[N] distance from the root (RoPE position = context length + depth); derived from parents if empty."""
    mask: torch.Tensor | None = None
    """[N, N] bool ancestor-or-self mask for verification; derived from parents if None."""
    first_beam: list[int] = field(default_factory=list)
    """[N] first (best) drafted beam through each node; empty when not drafted as beams.
    Lets load-aware speculation tell what a narrower tree would have accepted."""

    def __post_init__(self) -> None:
        if not self.depths:
            for parent in self.parents:
                self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        if self.mask is None:
            mask = torch.eye(len(self.tokens), dtype=torch.bool)
            for node, parent in enumerate(self.parents):
                if parent >= 0:
                    mask[node] |= mask[parent]
            self.mask = mask

    @classmethod
    def root(cls, token: int) -> DraftTree:
        return cls([token], [-1], depths=[0], mask=torch.ones(1, 1, dtype=torch.bool))


@dataclass
class Acceptance:
    path: list[int]
    """Packed node indices kept, root first (their KV is compacted and committed)."""
    tokens: list[int]
    """Emitted this step: accepted drafted tokens, then the bonus token."""

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children of every node in packed order (= the drafter's preference order)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """logits `[N, V]`: target logits at every node."""
    tokens, argmax = tree.tokens, logits.argmax(dim=-1).tolist()
    children = children_lists(tree.parents)
    node, path, out = 0, [0], list[int]()
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, [*out, want])
        path.append(nxt)
        out.append(want)
        node = nxt


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """logits `[N, V]`: target logits at every node."""
    tokens, children = tree.tokens, children_lists(tree.parents)
    node, path, out = 0, [0], list[int]()
    while True:
        q = target_probs(logits[node], params)  # [V] target distribution at this node
        for child in children[node]:
            x = tokens[child]
            if torch.rand((), generator=generator, device=q.device) < q[x]:
                path.append(child)
                out.append(x)
                node = child
                break
            q[x] = 0.0  # residual norm([q - δ_x]^+)
            q /= q.sum()
        else:
            return Acceptance(path, [*out, sample(q, generator)])


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Acceptance:
    """Greedy or sampled acceptance, as the request's sampling parameters ask."""
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, logits, params, generator)
