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

import itertools
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from plugins.argmax_rows import greedy_tokens
from plugins.chain_verify import kernel_applies as chain_kernel_applies
from plugins.chain_verify import verify_chains
from runtime.sampling import SamplingParams, inverse_cdf_rows, target_probs, target_probs_rows, uniform
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


def accept_greedy(tree: DraftTree, logits: torch.Tensor, argmax: list[int] | None = None) -> Acceptance:
    """logits `[N, V]`: target logits at every node (`argmax`: their argmax per node, where
    the caller has it). Siblings are distinct in a packed tree, so at most one child
    matches; when several do (duplicates: unpacked beams), the one with the deepest
    accepted path below it is kept, as verifying every beam apart would."""
    tokens = tree.tokens
    if argmax is None:
        argmax = greedy_tokens([logits])
    if len(tokens) == 1:  # a root alone (auto-regression): its argmax, no walk (~5 us a request)
        return Acceptance([0], [argmax[0]])
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
    rest = p.scatter(-1, x[..., None], 0.0)
    p_next = rest / rest.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    return acceptance(qx, px), residual(q, p), p_next


def residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The next target residual q^(k+1) = norm([q^(k) - p^(k)]^+) (RSD eq. 4) alone: what
    `rejection_step` returns second, for a walk whose rejected child was its node's last
    (the bonus needs q^(k+1), no next draft law: a chain's every rejection)."""
    positive = (q - p).clamp(min=0.0)
    mass = positive.sum(-1, keepdim=True)
    # mass 0 only when q == p, where nothing is ever rejected; keep q rather than divide by 0
    return torch.where(mass > 0, positive / mass.clamp(min=torch.finfo(q.dtype).tiny), q)


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

    Tree by tree (`_walk_tree`), with one-row laws and the decisions read on the host. Every
    uniform comes from the request's own generator (one per node: a node is tried at most
    once, then one for the bonus), so a request's tokens do not depend on its batch.

    A root alone (an auto-regressive step) has no child to try: its token is the bonus
    drawn from q at the root, as the walk would draw it; the roots' laws are one softmax
    over all their rows. The bonus tokens of every tree are one `inverse_cdf_rows` over the
    batch's final laws, each at the uniform its request drew after its walk: what `sample`
    draws row by row, bit for bit (its cumulative sums run along each row), for ~80 us at
    batch 8 instead of ~260 (8 calls of ~5 ATen ops each).

    Chains at a temperature alone (sd's, rsd-c's and rsd-s's cuts, one-beam ReDrafter trees
    at T > 0) are accepted at once for the batch instead (`_chains_in_one_call`: one C++ call
    on the CPU, tensor ops off it), with the same uniforms, laws, tests and draws, so the
    same tokens."""
    if not trees:
        return []
    alone = [i for i, t in enumerate(trees) if len(t.tokens) == 1]
    roots = iter(target_probs_rows(torch.cat([logits[i] for i in alone]), [params[i] for i in alone]) if alone else ())
    done = _chains_in_one_call(trees, logits, params, generators)
    tables = _tree_laws(trees, logits, params, skip=done)
    walked = [i for i in range(len(trees)) if i not in done]
    # per tree walked here: its accepted path, the law its bonus is drawn from
    walks: dict[int, tuple[list[int], torch.Tensor]] = {}
    draws = []
    for i in walked:
        tree, rows, prm, gen = trees[i], logits[i], params[i], generators[i]
        walks[i] = ([0], next(roots)) if len(tree.tokens) == 1 else _walk_tree(tree, rows, prm, gen, tables.get(i))
        draws.append(uniform(gen, rows.device))  # after the walk's node uniforms, as `sample` would
    if walked:
        bonus = inverse_cdf_rows(torch.stack([walks[i][1] for i in walked]), torch.stack(draws)).tolist()
        for i, token in zip(walked, bonus, strict=True):
            path = walks[i][0]
            done[i] = Acceptance(path, [*(trees[i].tokens[c] for c in path[1:]), token])
    return [done[i] for i in range(len(trees))]


def _is_chain(tree: DraftTree) -> bool:
    """A tree of one node a depth (packed: node c's parent is c - 1), more than the root."""
    return len(tree.tokens) > 1 and len(tree.tokens) == max(tree.depths) + 1


def _chains_in_one_call(
    trees: list[DraftTree], logits: list[torch.Tensor], params: list[SamplingParams], generators: list[torch.Generator]
) -> dict[int, Acceptance]:
    """The acceptance of every chain whose warp is a temperature alone at once, by tree
    index: in one C++ call on the CPU (`plugins/chain_verify.py`: the walk's laws, tests and
    draw, bit for bit, without its Python), as tensor ops over the batch off it
    (`_verify_chains_batched`); none where neither applies (the walk takes them). Each
    request's uniforms are drawn as its walk draws them: one a draft, then the bonus's."""
    chosen = [i for i, t in enumerate(trees) if _is_chain(t) and params[i].temperature_alone]
    rows = [logits[i] for i in chosen]
    laws = [trees[i].draft_probs if trees[i].sampled else None for i in chosen]
    one_call = bool(chosen) and chain_kernel_applies(rows)
    if not one_call and not (
        _batched_applies(rows) and all(law is None or law.dtype == torch.float32 for law in laws)
    ):  # (the walk's laws keep their own dtype, promoting q's: other dtypes are walked)
        return {}
    uniforms, bonus_uniforms = [], []
    for i in chosen:
        gen, device = generators[i], logits[i].device
        uniforms.append(torch.rand(len(trees[i].tokens) - 1, generator=gen, device=device))
        bonus_uniforms.append(uniform(gen, device))
    tokens, bonus = [trees[i].tokens for i in chosen], torch.stack(bonus_uniforms)
    if one_call:
        found = verify_chains(rows, laws, tokens, [params[i].temperature for i in chosen], uniforms, bonus)
        assert found is not None  # the kernel applies (checked above)
    else:
        found = _verify_chains_batched(rows, laws, tokens, [params[i] for i in chosen], uniforms, bonus)
    return {
        i: Acceptance(list(range(n + 1)), [*trees[i].tokens[1 : n + 1], token])
        for i, n, token in zip(chosen, *found, strict=True)
    }


def _batched_applies(logits: list[torch.Tensor]) -> bool:
    """Whether chains are accepted by `_verify_chains_batched`: off the CPU, where the C++ op
    does not run and each walk's reads to the host wait for the device."""
    return bool(logits) and logits[0].device.type != "cpu"


def _verify_chains_batched(
    logits: list[torch.Tensor],
    laws: list[torch.Tensor | None],
    tokens: list[list[int]],
    params: list[SamplingParams],
    uniforms: list[torch.Tensor],
    bonus_uniforms: torch.Tensor,
) -> tuple[list[int], list[int]]:
    """`verify_chains` as tensor ops over the batch (its arguments, each chain's warp as its
    `params`), for a device the C++ op does not run on (`_batched_applies`: a GPU): the
    walk's laws (`_tree_laws`' one softmax; the residual norm([q - p]^+) at the first
    rejection, RSD eq. 4, else q at the leaf), fp32 acceptance test (`host_acceptance`: u <
    min(1, q(x) / p(x))) and inverse-CDF bonus draw, with one read to the host for the batch
    where the walk reads 2-3 a tree (`_tree_laws`' pairs, its uniforms, the bonus; walked,
    sd at T=1, batch 1 verified in ~1.0 ms a step on an H200 where AR's sampling took ~0.5;
    this path is not yet timed on a GPU). Forced on the CPU, the same tokens bit for bit as
    the walk (`tests/runtime/test_verify.py`). (drafts accepted, bonus token) per chain."""
    device = logits[0].device
    sizes = [len(t) for t in tokens]
    warps = [prm for prm, n in zip(params, sizes, strict=True) for _ in range(n)]
    q = target_probs_rows(torch.cat(logits), warps)  # [R, V], `_tree_laws`' softmax
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    width = max(sizes) - 1  # drafts of the longest chain
    u = torch.nn.utils.rnn.pad_sequence(uniforms, batch_first=True, padding_value=1.0)  # 1: never below an acceptance
    index = torch.tensor(_draft_rows(tokens, starts, width), device=device)
    parent, own, x = index[0], index[1], index[2]
    qx = q[parent, x]
    drawn = [k for k, law in enumerate(laws) if law is not None]
    p, sampled = None, None
    px = torch.ones_like(qx)
    if drawn:  # the draft laws at their chains' rows
        p = torch.zeros_like(q)
        rows = torch.tensor([starts[k] + r for k in drawn for r in range(sizes[k])], device=device)
        p[rows] = torch.cat([laws[k] for k in drawn])  # type: ignore[misc]
        sampled = torch.zeros(len(tokens), 1, dtype=torch.bool, device=device)
        sampled[drawn] = True
        px = torch.where(sampled, p[own, x], px)
    keep = (qx.double() / px.double().clamp(min=_TINY)).float().clamp(max=1.0)  # `host_acceptance`, in fp32
    accepted = (u < keep).int().cumprod(1).sum(1)  # [B] drafts kept before the first rejection
    at = torch.tensor(starts, device=device) + accepted  # the walk's last node (row)
    leaf = accepted == torch.tensor(sizes, device=device) - 1
    # the rejected child (none at a leaf): its draft law, or a point mass at its token
    child_token = torch.cat([x, torch.zeros_like(x[:, :1])], 1).gather(1, accepted[:, None].long())[:, 0]
    p_child = F.one_hot(child_token, q.shape[-1]).to(q.dtype)
    if p is not None and sampled is not None:
        p_child = torch.where(sampled, p[(at + 1).clamp(max=q.shape[0] - 1)], p_child)
    law = torch.where(leaf[:, None], q[at], residual(q[at], p_child))
    bonus = inverse_cdf_rows(law, bonus_uniforms)
    kept, drawn_tokens = torch.stack((accepted, bonus)).tolist()  # the one read to the host
    return kept, drawn_tokens


def _draft_rows(tokens: list[list[int]], starts: list[int], width: int) -> list[list[list[int]]]:
    """`_verify_chains_batched`'s index `[3, B, width]`: draft c of chain k (node c + 1, its tokens
    `tokens[k]`, its rows from `starts[k]`) at its parent's row, its own row (its draft
    law's) and its token; 0 past a chain's end."""
    parents, own, drafted = [], [], []
    for chain, s in zip(tokens, starts, strict=True):
        n = len(chain)
        parents.append([s + c if c + 1 < n else 0 for c in range(width)])
        own.append([s + c + 1 if c + 1 < n else 0 for c in range(width)])
        drafted.append([chain[c + 1] if c + 1 < n else 0 for c in range(width)])
    return [parents, own, drafted]


@dataclass
class _Laws:
    """One tree's laws, computed before its walk (`_tree_laws`)."""

    q: torch.Tensor
    """[N, V] the target law at every node."""
    p: torch.Tensor | None
    """[N, V] the draft law every node was drawn from (None: point masses)."""
    first: list[tuple[float, float]]
    """Per node c >= 1: (q at its parent at its token, p at its token; 1 for a point mass),
    what the walk tests c against when c is the first child its parent tries."""


def _tree_laws(
    trees: list[DraftTree],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    chains_only: bool = True,
    skip: Collection[int] = (),
) -> dict[int, _Laws]:
    """Every node's laws of the chains (by index) whose warp is a temperature alone, in one
    softmax and one read to the host for the batch, where the walk computed them
    node by node (~40 us a visited node: ~1.4 ms a step at batch 8 over 6-node sd chains,
    ~0.45 ms with the table). Rows of one softmax are the values each row gets alone, bit
    for bit, so the walk is unchanged. Only chains (sd, one-beam trees): a walk
    visits about half of a chain's nodes at T=1, a quarter of a branching tree's, whose
    table costs more than its walk (~12 us a row: rsd-c's 15-node trees at batch 8
    verified in 3.1 ms with it, 2.3 without); top-k/top-p warps sort every row.
    `chains_only=False` tables every tree (the walk over siblings is tested through it);
    trees in `skip` are accepted elsewhere (`_chains_in_one_call`)."""
    chosen = [
        i
        for i, t in enumerate(trees)
        if i not in skip and len(t.tokens) > 1 and (_is_chain(t) or not chains_only) and params[i].temperature_alone
    ]
    if not chosen:
        return {}
    sizes = [len(trees[i].tokens) for i in chosen]
    warps = [params[i] for i, n in zip(chosen, sizes, strict=True) for _ in range(n)]
    q = target_probs_rows(torch.cat([logits[i] for i in chosen]), warps)
    drafts = {i: t.draft_probs for i in chosen if (t := trees[i]).sampled and t.draft_probs is not None}
    p = torch.cat(list(drafts.values())) if drafts else None
    p_start: dict[int, int] = {}  # tree -> its first row in p
    rows_before = 0
    for i, table in drafts.items():
        p_start[i], rows_before = rows_before, rows_before + table.shape[0]
    q_rows, p_rows, columns = [], [], []  # per non-root node: its parent's q row, its own p row, its token
    offset = 0
    for i, n in zip(chosen, sizes, strict=True):
        tree = trees[i]
        for c in range(1, n):
            q_rows.append(offset + tree.parents[c])
            p_rows.append(p_start[i] + c if i in p_start else 0)
            columns.append(tree.tokens[c])
        offset += n
    cols = torch.tensor(columns, device=q.device)
    qx = q[torch.tensor(q_rows, device=q.device), cols]
    px = p[torch.tensor(p_rows, device=q.device), cols] if p is not None else torch.ones_like(qx)
    pairs = torch.stack((qx, px), 1).tolist()  # the one read to the host
    out: dict[int, _Laws] = {}
    offset = at = 0
    for i, n in zip(chosen, sizes, strict=True):
        drawn_here = i in p_start
        first = [(0.0, 0.0), *((a, b if drawn_here else 1.0) for a, b in pairs[at : at + n - 1])]
        laws = p[p_start[i] : p_start[i] + n] if p is not None and drawn_here else None
        out[i] = _Laws(q[offset : offset + n], laws, first)
        offset, at = offset + n, at + n - 1
    return out


def _walk_tree(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, laws: _Laws | None = None
) -> tuple[list[int], torch.Tensor]:
    """Recursive rejection sampling down one tree: the accepted path and the law q its
    bonus token is drawn from (the caller draws it, `accept_sampled_batch`). The laws are
    read from `laws` where the batch computed them up front (`_tree_laws`), else computed
    where the walk reaches them: q and the children's draft law p at the root,
    then at each accepted node; a rejected child changes them to the residuals
    (`rejection_step`; `residual` alone after a node's last child). The tensors are one
    row each, and the accept/reject decisions are read on the host: a [B, N, V] table of
    every node's laws cost more to fill than the walk (4-9 ms a step at batch 8 x 18 nodes),
    and a walk vectorised over the batch paid ~25 small tensor ops per level (~1.4 ms for a
    5-node chain at batch 1, where this costs ~0.2 ms).

    The uniforms are one per node, drawn up front (`torch.rand`) from the request's own
    generator (the bonus's comes after them); the acceptance test u < min(1, q(x)/p(x)) is
    computed as in fp32 (a correctly rounded fp32 quotient: the fp64 quotient rounded to
    fp32, which double rounding cannot change for a division)."""
    kids = children_lists(tree.parents)
    uniform = torch.rand(len(tree.tokens) - 1, generator=gen, device=logits.device).tolist()  # node c: [c - 1]
    draft = tree.draft_probs if tree.sampled else None

    def laws_at(node: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q at `node`, and the draft law its children were drawn from (None: point masses)."""
        if laws is not None:
            return laws.q[node], (laws.p[kids[node][0]] if laws.p is not None and kids[node] else None)
        q = target_probs(logits[node : node + 1], params)[0]
        return q, (draft[kids[node][0]] if draft is not None and kids[node] else None)

    path = [0]
    q, p = laws_at(0)
    tried = 0  # children of the path's last node rejected so far
    while tried < len(kids[path[-1]]):
        c = kids[path[-1]][tried]
        x = tree.tokens[c]
        if laws is not None and not tried:  # the node's own laws, read up front
            qx, px = laws.first[c]
        else:
            qx, px = (q[x].item(), 1.0) if p is None else torch.stack((q[x], p[x])).tolist()
        if uniform[c - 1] < host_acceptance(qx, px):
            path.append(c)
            q, p = laws_at(c)
            tried = 0
            continue
        p_k = F.one_hot(torch.tensor(x, device=q.device), q.shape[-1]).to(q.dtype) if p is None else p
        tried += 1
        if tried == len(kids[path[-1]]):  # no sibling left to try: only the residual is needed
            q = residual(q, p_k)
            continue
        _, q_next, p_next = rejection_step(q[None], p_k[None], torch.tensor([x], device=q.device))
        q, p = q_next[0], (None if p is None else p_next[0])
    return path, q  # a leaf, or every child rejected: the bonus comes from q


def host_acceptance(qx: float, px: float) -> float:
    """`acceptance` of fp32 values read to the host, with the same fp32 result: the fp64
    quotient rounded to fp32 is the correctly rounded fp32 quotient (double rounding cannot
    change a division when the wider format has more than twice the bits, plus two)."""
    return min(1.0, float(np.float32(qx / max(px, _TINY))))


_TINY = float(torch.finfo(torch.float32).tiny)


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
    greedy = [i for i, prm in enumerate(params) if prm.greedy]
    if greedy:  # every greedy tree's argmax in one call
        argmax = iter(greedy_tokens([logits[i] for i in greedy]))
        for i in greedy:
            out[i] = accept_greedy(trees[i], logits[i], list(itertools.islice(argmax, logits[i].shape[0])))
    if sampled:
        pick = [trees[i] for i in sampled], [logits[i] for i in sampled], [params[i] for i in sampled]
        for i, acc in zip(sampled, accept_sampled_batch(*pick, [generators[i] for i in sampled]), strict=True):
            out[i] = acc
    return [acc for acc in out if acc is not None]
