"""Accepting a verified draft tree: which drafted tokens the target keeps, and its bonus.

Terms (used the same way everywhere in specpipe):
- *root*: node 0 of a packed tree, the bonus token of the previous step, emitted then
  and processed (its KV written) in this step's verification forward;
- *accepted* tokens: drafted tokens the target keeps, a path down from the root;
- *bonus* token: one token the target itself picks at the last accepted node (on a
  mismatch, a leaf, or after every child was rejected). A step always emits
  `accepted + 1` tokens, so speculation never emits fewer than auto-regression.

Greedy: walk down while some child equals the target's argmax. Exact by construction.

Sampling: recursive rejection sampling (RSD, Jeon et al. 2024, Algorithm 1) at every
accepted node: its children are tried in packed order (their draw order), child x with
probability min(1, q(x)/p(x)); on rejection the target residual becomes
q <- norm([q - p]^+) and the draft law p drops x and renormalises; when every child is
rejected (or at a leaf) the bonus is drawn from the residual. The emitted token at every
level is then distributed exactly as q, the target's distribution after
temperature/top-k/top-p (`runtime.sampling.target_probs`), whichever way the candidates
were proposed, as long as p is the law they were really drawn from:
- *sampled* trees (RSD-C, RSD-S, SD: `DraftTree.sampled`) carry p, the drafter's
  distribution, and siblings are draws *without replacement* from it;
- *deterministic* candidates (ReDrafter's beam search, an auto-regressive root) are point
  masses, p = delta_x: acceptance q(x), residual = q with x removed. Siblings are distinct
  tokens (dedup_prefix guarantees it), except in ReDrafter's no-packing ablation, where a
  duplicate of a rejected sibling meets residual mass 0 and is rejected: still exact.
Apple's ReDrafter instead flips independent coins per beam and keeps the longest beam; its
README notes that "might not give the exact distribution match", so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.sampling import SamplingParams, sample, target_probs_rows
from runtime.tree import DraftTree, children_lists


@dataclass
class Acceptance:
    path: list[int]
    """Packed node indices kept, root first (their KV is compacted and committed)."""
    tokens: list[int]
    """Emitted this step: accepted drafted tokens, then the bonus token."""

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """logits `[N, V]`: target logits at every node. Siblings are distinct in a packed tree,
    so at most one child matches; when several do (duplicates: unpacked beams), the one with
    the deepest accepted path below it is kept, as verifying every beam apart would."""
    tokens, argmax = tree.tokens, logits.argmax(dim=-1).tolist()
    children = children_lists(tree.parents)

    def deepest(node: int) -> list[int]:
        best: list[int] = []
        for c in children[node]:
            if tokens[c] == argmax[node]:
                below = [c, *deepest(c)]
                best = below if len(below) > len(best) else best
        return best

    path = [0, *deepest(0)]
    return Acceptance(path, [*(tokens[c] for c in path[1:]), argmax[path[-1]]])


def rejection_step(
    q: torch.Tensor, p: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One trial of recursive rejection sampling (RSD, Jeon et al. 2024, Algorithm 1),
    batched over leading dims: `q` `[..., V]` the current target residual q^(k), `p`
    `[..., V]` the distribution the k-th candidate `x` `[...]` was drawn from, p^(k).

    Returns
    - the acceptance probability min(1, q^(k)(x) / p^(k)(x))                  (RSD eq. 3),
    - the next target residual q^(k+1) = norm([q^(k) - p^(k)]^+)              (RSD eq. 4),
    - the next draft law p^(k+1) = norm(p^(k) without x): sampling without replacement
      removes x and renormalises (RSD Algorithm 1, line 9).

    Theorem 3.1 of the paper: trying candidates x^(1..K) drawn this way, in order, and
    drawing from q^(K+1) when all are rejected, emits a token distributed exactly as q^(1).
    A point-mass candidate is p^(k) = delta_x: acceptance q(x), residual q without x."""
    qx = q.gather(-1, x[..., None]).squeeze(-1)
    px = p.gather(-1, x[..., None]).squeeze(-1)
    accept_prob = acceptance(qx, px)
    residual = (q - p).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass 0 only when q == p, where nothing is ever rejected; keep q rather than divide by 0
    q_next = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(q.dtype).tiny), q)
    rest = p.scatter(-1, x[..., None], 0.0)
    p_next = rest / rest.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    return accept_prob, q_next, p_next


def acceptance(qx: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """min(1, q(x) / p(x)), the probability of keeping candidate x (RSD eq. 3)."""
    return (qx / px.clamp(min=torch.finfo(px.dtype).tiny)).clamp(max=1.0)


def accept_sampled_batch(
    trees: list[DraftTree],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Acceptance]:
    """Recursive rejection sampling down every tree at once (`logits[i]` `[N_i, V]`: target
    logits at tree i's nodes). At the accepted node the children are tried in packed
    order, each with `rejection_step`; an accepted child becomes the node (its target
    distribution q and its children's draft law p take over); a node whose children were
    all rejected, or a leaf, ends the walk with the bonus drawn from the residual q.

    Vectorised over the batch: one iteration tries one child in every unfinished tree, so
    the loop runs at most max N_i times. Every uniform comes from the request's own
    generator (one per node: a node is tried at most once), so a request's tokens do not
    depend on its batch.

    A root alone (an auto-regressive step) has no child to try: its token is the bonus
    drawn from q at the root, as the walk would draw it, without the walk's tables."""
    alone = [i for i, t in enumerate(trees) if len(t.tokens) == 1]
    if not alone:
        return _walk(trees, logits, params, generators)
    out: list[Acceptance | None] = [None] * len(trees)
    q_rows = target_probs_rows(torch.cat([logits[i] for i in alone]), [params[i] for i in alone])
    for i, q in zip(alone, q_rows, strict=True):
        out[i] = Acceptance([0], [sample(q, generators[i])])
    if walked := [i for i, t in enumerate(trees) if len(t.tokens) > 1]:
        pick = [[xs[i] for i in walked] for xs in (trees, logits, params, generators)]
        for i, acc in zip(walked, _walk(*pick), strict=True):  # type: ignore[arg-type]
            out[i] = acc
    return [acc for acc in out if acc is not None]


def _walk(
    trees: list[DraftTree],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Acceptance]:
    """`accept_sampled_batch`'s walk down trees of two or more nodes. The laws are computed
    where the walk reaches them (`laws`): q and the children's draft law p at the root,
    then at each accepted node; a rejected child needs neither. The walk visits one path
    and the children tried along it, so a [B, N, V] table of every node's laws cost more
    to fill than the walk itself (softmax and copies of 2 x 4.7 MB at batch 8 x 18 nodes,
    4-9 ms a step on the CPU)."""
    b, device = len(trees), logits[0].device
    sizes = [len(t.tokens) for t in trees]
    n, v = max(sizes), logits[0].shape[-1]
    kids = [children_lists(t.parents) for t in trees]
    k_max = max(1, max(len(c) for ks in kids for c in ks))
    child = [[[*cs, *[-1] * (k_max - len(cs))] for cs in ks] + [[-1] * k_max] * (n - len(ks)) for ks in kids]
    tokens = [[*t.tokens, *[0] * (n - len(t.tokens))] for t in trees]
    uniform = torch.ones(b, n, device=device)
    for i, gen in enumerate(generators):
        uniform[i, 1 : sizes[i]] = torch.rand(sizes[i] - 1, generator=gen, device=device)
    child_t = torch.tensor(child, dtype=torch.long, device=device)
    tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
    sampled = torch.tensor([t.sampled for t in trees], device=device)

    def laws(rows: list[int], nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """q at node `nodes[k]` of tree `rows[k]`, and the draft law its children were drawn
        from (siblings share it; zeros where the tree is not sampled or the node a leaf)."""
        q = target_probs_rows(torch.stack([logits[i][c] for i, c in zip(rows, nodes, strict=True)]),
                              [params[i] for i in rows])  # fmt: skip
        p = torch.zeros_like(q)
        for k, (i, c) in enumerate(zip(rows, nodes, strict=True)):
            if trees[i].sampled and kids[i][c]:
                draft = trees[i].draft_log_probs
                assert draft is not None
                p[k] = draft[kids[i][c][0]].exp()
        return q, p

    rows_ = torch.arange(b, device=device)
    node = torch.zeros(b, dtype=torch.long, device=device)
    tried = torch.zeros(b, dtype=torch.long, device=device)  # children of `node` rejected so far
    done = torch.zeros(b, dtype=torch.bool, device=device)
    q, p = laws(list(range(b)), [0] * b)
    paths: list[list[int]] = [[0] for _ in trees]
    while True:
        c = child_t[rows_, node, tried.clamp(max=k_max - 1)]
        c = torch.where(tried < k_max, c, -1)
        done |= c < 0  # leaf, or every child rejected: the bonus comes from q
        if bool(done.all()):
            break
        c = c.clamp(min=0)
        x = tokens_t[rows_, c]
        qx, px = q.gather(1, x[:, None])[:, 0], p.gather(1, x[:, None])[:, 0]
        accepted = ~done & (uniform[rows_, c] < acceptance(qx, torch.where(sampled, px, 1.0)))  # a point mass: p(x) = 1
        rejected = ~done & ~accepted
        node = torch.where(accepted, c, node)
        tried = torch.where(accepted, 0, tried + rejected.long())
        if (no := rejected.nonzero().flatten()).numel():  # the residuals, where a child was rejected
            p_k = torch.where(sampled[no, None], p[no], F.one_hot(x[no], v).to(p.dtype))
            _, q[no], p[no] = rejection_step(q[no], p_k, x[no])
        if moved := accepted.nonzero().flatten().tolist():
            nodes = [int(c[i]) for i in moved]
            for i, c_i in zip(moved, nodes, strict=True):
                paths[i].append(c_i)
            q[moved], p[moved] = laws(moved, nodes)
    out = []
    for i, (tree, gen) in enumerate(zip(trees, generators, strict=True)):
        drafted = [tree.tokens[c] for c in paths[i][1:]]
        out.append(Acceptance(paths[i], [*drafted, sample(q[i], gen)]))
    return out


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """`accept_sampled_batch` for one tree."""
    return accept_sampled_batch([tree], [logits], [params], [generator])[0]


def accept_batch(
    trees: list[DraftTree],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[Acceptance]:
    """Greedy or sampled acceptance of every tree, as each request's sampling parameters ask."""
    out: list[Acceptance | None] = [None] * len(trees)
    sampled = [i for i, prm in enumerate(params) if not prm.greedy]
    for i, prm in enumerate(params):
        if prm.greedy:
            out[i] = accept_greedy(trees[i], logits[i])
    if sampled:
        pick = [trees[i] for i in sampled], [logits[i] for i in sampled], [params[i] for i in sampled]
        for i, acc in zip(sampled, accept_sampled_batch(*pick, [generators[i] for i in sampled]), strict=True):
            out[i] = acc
    return [acc for acc in out if acc is not None]
