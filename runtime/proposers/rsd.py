"""Recursive Speculative Decoding drafts (Jeon et al. 2024, arXiv 2402.14160): draft trees
whose siblings are drawn *without replacement*, built level by level over any drafter
that gives a next-token distribution per node (`LevelDrafter`: the ReDrafter RNN or a
draft LM, `runtime/proposers/level_drafters.py`).

    method     tree                                            siblings drawn by
    rsd-c      constant branching b = (b_0, ..., b_{L-1})       Gumbel-top-k (RSD Alg. 3/4)
    rsd-s      W beams of L tokens                              Stochastic Beam Search (RSD Alg. 8/9)
    sd         one chain of L tokens (= rsd-c, b = (1,)*L)       one sample per level
    redrafter  W beams of L tokens, deterministic (draft LM)    beam search (top-W), point masses

One proposer (`LevelTreeProposer`) drafts all four, on either drafter.

Every node's row of `DraftTree.draft_probs` is the law its siblings were drawn from:
the drafter's logits under the request's own temperature/top-k/top-p
(`runtime.sampling.target_probs`, the same warp as the target's), so verification
(`runtime.verify`, recursive rejection sampling) recovers the target law exactly
(RSD Theorem 3.1). Nodes are packed breadth-first and, within a parent, in draw order,
which is the order verification tries them. Greedy requests draft deterministically (the
temperature-0 limit: top-b / beam search) and are verified by argmax matching.

Why RSD-S is still exact although the number of children per node is random: a child's
perturbed value orders it among its siblings (a draw without replacement), and whether
the k-th child survives the top-W cut depends on the values of the first k children and
of other beams, never on the k-th child's identity (for Gumbels, the k-th largest
perturbed value is independent of which token holds it given the first k-1), so stopping
after k children is a stopping rule the recursive rejection sampler allows.
"""

from __future__ import annotations

import argparse
import bisect
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from model_defs.paged_kv_cache import PagedKVCache
from plugins.argmax_rows import greedy_tokens
from plugins.argmax_rows import kernel_applies as argmax_applies
from plugins.llama_forward import Int8DraftLM
from runtime.block_manager import BlockManager
from runtime.cuda_graphs import CudaGraphs, GraphLimits
from runtime.gumbel import draw_rows, gumbel_top_k_rows, level_uniforms, top_k_valid_rows, truncated_gumbel
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.level_drafters import DraftLMLevels, RNNLevels
from runtime.proposers.proposer import CHAINS, KVMoves, Proposer, target_hidden
from runtime.request import Request
from runtime.sampling import SamplingParams, inverse_cdf_rows, target_probs, target_probs_rows
from runtime.speculation_policy import DraftCall
from runtime.tree import DraftTree, children_lists
from runtime.verify import Acceptance, accept_batch

RSD_METHODS = ("rsd-c", "rsd-s", "sd")
CONTEXTS = (192, 64)
"""Context tokens of the requests a draft LM's drafting is timed on at engine start: the
first that fits the block pool (a draft LM attends over the context: at batch 8, four
levels of sd drafted in 4.8 ms after 64 tokens, 5.4 after 192, and live prompts are
~100-300 tokens)."""
DEFAULT_BRANCHING = (2, 2, 1, 1)
"""rsd-c's default b: 15 nodes, about the budget of ReDrafter's default 4 x 4 beams."""


@dataclass(frozen=True)
class TreeSpec:
    """Shape of a tree drafted level by level: constant branching (`branching`) or beams
    (`beam_width` x `length`)."""

    method: str
    """"rsd-c", "rsd-s", "sd" or "redrafter" (deterministic beams, for a draft LM)."""
    branching: tuple[int, ...] = ()
    """rsd-c / sd: children per node at depth 0, 1, ... (its length is the draft length)."""
    beam_width: int = 0
    """rsd-s / redrafter: beams kept per level (W)."""
    length: int = 0
    """Draft tokens per path (L)."""

    def __post_init__(self) -> None:
        if self.method not in (*RSD_METHODS, "redrafter"):
            raise ValueError(f"tree method {self.method!r} is not one of {(*RSD_METHODS, 'redrafter')}")
        if self.length < 1:
            raise ValueError(f"draft length must be >= 1, got {self.length}")
        if self.beamed:
            if self.beam_width < 1:
                raise ValueError(f"{self.method} needs beam_width >= 1, got {self.beam_width}")
        elif len(self.branching) != self.length or min(self.branching) < 1:
            raise ValueError(f"{self.method} needs {self.length} branching factors >= 1, got {self.branching}")

    @classmethod
    def for_method(cls, method: str, beam_width: int, beam_length: int, branching: tuple[int, ...]) -> TreeSpec:
        """The tree of `method` from the per-request settings (W, L for beams and sd's
        length; b for rsd-c)."""
        if method == "rsd-c":
            return cls(method, branching=tuple(branching), length=len(branching))
        if method == "sd":
            return cls(method, branching=(1,) * beam_length, length=beam_length)
        return cls(method, beam_width=beam_width, length=beam_length)

    @property
    def beamed(self) -> bool:
        return self.method in ("rsd-s", "redrafter")

    @property
    def stochastic(self) -> bool:
        """Siblings are sampled (verified with their draft law); False: deterministic beams."""
        return self.method != "redrafter"

    @property
    def max_nodes(self) -> int:
        """Most nodes of the tree, root included."""
        return self.level_sizes[-1]

    @property
    def level_sizes(self) -> list[int]:
        """Most nodes of the tree cut after 0, 1, ..., `length` levels (nested trees: the
        first k levels of a tree are the tree drafted with k levels)."""
        sizes, level = [1], 1
        for depth in range(self.length):
            level = self.beam_width if self.beamed else level * self.branching[depth]
            sizes.append(sizes[-1] + level)
        return sizes

    @cached_property
    def ladder(self) -> list[tuple[TreeSpec, int]]:
        """The trees load-aware speculation chooses among for this spec, smallest first, each
        as (tree, levels it is drafted): one chain cut at every depth (sd's tree; RSD with
        one child per node is plain speculative sampling), then the tree widened from the
        root down, one sibling at a time: rsd-c b = (2, 1, ..., 1), ..., (b_0, 1, ..., 1),
        (b_0, 2, 1, ..., 1), ..., b; beams W = 2, ..., W at full length. The spec's own
        tree is the last (what `--speculation fixed` drafts).

        Why chains first rather than the spec's tree cut after fewer levels: at batch 8
        every drafted node is a row of the target's forward, and on held-out prompts sd's
        5-node chains ran 1.09-1.25x auto-regression where rsd-c's and rsd-s's smallest
        cuts (2 and 4 siblings at depth 1) ran 0.97-1.00x; at T = 1, batch 1, sd ran 1.80x
        where rsd-s's cuts ran 1.36x. Widening one sibling at a time keeps the trees nested
        for rsd-c (Gumbel-top-(b+1)'s first b children are Gumbel-top-b's: `node_budgets`),
        so every tree measures every smaller one; wider beams keep other top beams, so
        rsd-s's widths are measured each on its own (`LevelTreeProposer.cuts`)."""
        if self.beamed:
            chain = TreeSpec(self.method, beam_width=1, length=self.length)
            wider = [TreeSpec(self.method, beam_width=w, length=self.length) for w in range(2, self.beam_width + 1)]
        else:
            chain = TreeSpec(self.method, branching=(1,) * self.length, length=self.length)
            ones = (1,) * self.length
            wider = [
                TreeSpec(self.method, (*self.branching[:k], w, *ones[k + 1 :]), length=self.length)
                for k in range(self.length)
                for w in range(2, self.branching[k] + 1)
            ]
        return [(chain, depth) for depth in range(1, self.length + 1)] + [(tree, self.length) for tree in wider]

    @cached_property
    def sizes(self) -> list[int]:
        """Most nodes (root included) of each tree of the `ladder`, after the root alone (1)."""
        return [1] + [tree.level_sizes[levels] for tree, levels in self.ladder]

    def rung(self, budget: int) -> tuple[TreeSpec, int] | None:
        """The largest tree of the `ladder` within `budget` nodes (None: the root alone)."""
        k = bisect.bisect_right(self.sizes, budget) - 1
        return self.ladder[k - 1] if k > 0 else None

    def node_budgets(self, drafted: TreeSpec, parents: list[int], depths: list[int]) -> list[int]:
        """`DraftTree.node_budget` of a tree drafted as `drafted`, one of this spec's
        `ladder`: each node's smallest tree of the ladder that holds it. A node whose
        siblings before it (in draw order) number r_k at depth k + 1 is held by the chain
        of its depth if every r_k is 0, else first by the tree widened to r_k + 1 siblings
        at the deepest k with r_k > 0 (widenings go root down, each holding every earlier
        one). Empty for wider beams, which hold no smaller tree."""
        if drafted.beamed and drafted.beam_width > 1:
            return []
        where: dict[tuple[int, int], int] = {}  # widened tree: (level widened, its width) -> size
        if not self.beamed:
            for tree, _ in self.ladder[self.length :]:
                level = max(d for d in range(self.length) if tree.branching[d] > 1)
                where[(level, tree.branching[level])] = tree.max_nodes
        keys: list[tuple[int, int] | None] = []
        seen = [0] * len(parents)  # children met so far, per node
        out: list[int] = []
        for node, parent in enumerate(parents):
            if parent < 0:
                keys.append(None)
                out.append(1)
                continue
            rank, seen[parent] = seen[parent], seen[parent] + 1
            key = keys[parent] if rank == 0 else (depths[node] - 1, rank + 1)
            keys.append(key)
            out.append(depths[node] + 1 if key is None else where[key])
        return out

    def truncated(self, levels: int) -> TreeSpec:
        """The same tree drafted `levels` levels deep."""
        if levels == self.length:
            return self
        branching = self.branching[:levels] if not self.beamed else ()
        return TreeSpec(self.method, branching, self.beam_width, levels)


def parse_branching(text: str) -> tuple[int, ...]:
    """ "2,2,1" -> (2, 2, 1): the --branching flag of the CLIs."""
    try:
        out = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"branching must be comma-separated integers like 2,2,1, got {text!r}"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"branching factors must be >= 1, got {text!r}")
    return out


class LevelDrafter(Protocol):
    """A drafter seen one tree level at a time (state per node lives inside)."""

    def first(self) -> torch.Tensor:
        """[B, V] draft logits for the children of every request's root."""
        ...

    def extend(self, rows: list[int], parents: list[int], nodes: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed new nodes (request row, parent node, own node index, token), one level of
        every request, parents already fed; returns [M, V] draft logits for their children."""
        ...

    def chain(self, tokens: list[int], levels: list[int], at_root: bool = False) -> list[list[int]] | None:
        """Greedy chains on from `tokens` (each request's first draft, after `first`; `at_root`:
        its root, in place of `first`, where `feeds_roots`): request i's next `levels[i]`
        drafts, each the argmax after the token before, in one call; None where the drafter
        has no such call (the caller goes level by level)."""
        ...

    def feeds_roots(self) -> bool:
        """Whether chains may start at the roots (`chain`, `sampled_chain`) in place of `first`."""
        ...

    def sampled_chain(
        self, first: torch.Tensor | None, levels: list[int], temperatures: list[float], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sampled chains on from `first` (`first()`'s logits; None: from the roots, where
        `feeds_roots`), every level in one call: request
        i's `levels[i]` draws, level j from its temperature's warp at `uniforms[i, j]`; the
        draws `[B, max(levels)]` and their laws `[B, max(levels) + 1, V]` (row 0 zeros).
        None where the drafter has no such call (the caller goes level by level)."""
        ...

    def chains(self) -> bool:
        """Whether `chain_level` runs (else sampled chains go level by level through `extend`)."""
        ...

    def chain_level(self, rows: list[int], tokens: list[int] | torch.Tensor, depth: int) -> torch.Tensor:
        """One level of chains: request `rows[k]`'s draft `tokens[k]` (host integers or a
        tensor of the draws) as node `depth` of its chain (its parent the node before);
        [len(rows), V] draft logits for its child."""
        ...


@dataclass
class _Growing:
    """One request's tree under construction, in the per-request form `_beam_level` takes
    (`draft_rsd_trees` holds the whole batch's trees in lists and level tensors instead)."""

    tokens: list[int]
    parents: list[int]
    log_probs: list[torch.Tensor]  # [V] log of the draft law each node was drawn from (root: zeros)
    frontier: list[int]  # nodes of the deepest level
    scores: list[float]  # rsd-s / beams: log-prob of each frontier node's path
    gumbels: list[float]  # rsd-s: perturbed (truncated-Gumbel) value of each frontier node


_RANKED = SamplingParams(temperature=1.0)
"""The law a greedy request's drafts are ranked by: the drafter's plain softmax."""


def draft_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[M, V] the law siblings are drawn from, row m under `params[m]`: the request's own
    warp of the drafter's logits (greedy requests: the plain softmax, only ranked). One
    warp of all rows when they share a setting (the usual batch), else one per distinct
    setting (`target_probs_rows`)."""
    warped = [_RANKED if prm.greedy else prm for prm in params]
    if warped and all(_warp(prm) == _warp(warped[0]) for prm in warped):
        return target_probs(logits, warped[0])
    return target_probs_rows(logits, warped)


def _warp(prm: SamplingParams) -> tuple[float, int, float]:
    return prm.temperature, prm.top_k, prm.top_p


def draft_rsd_trees(
    drafter: LevelDrafter,
    roots: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator],
    spec: TreeSpec,
    lengths: list[int] | None = None,
) -> list[DraftTree]:
    """One tree per request, `spec.length` levels, or `lengths[i]` for request i (its tree
    is then `spec.truncated(lengths[i])`'s: the first levels of a tree are the tree drafted
    that deep, and a request's draws come from its own generator level by level, so the
    batch drafts every depth in one call, as the load-aware cost model prices it; one call
    per depth ran 2 + 3 + 4 draft-LM forwards where sd's 3-, 4- and 5-node chains mixed at
    batch 8). A level is one drafter call for the
    frontier nodes of every request, then a handful of tensor ops over all of them at
    once: one warp (`draft_probs`; none when every request only ranks, greedy SD and
    RSD-C: the top b of the logits are those of their softmax), its log only where a level
    ranks or perturbs log-probs (beams, b > 1, greedy rows: one-child draws and
    verification read the probabilities), one Gumbel-top-k
    (`_branch_step`) or beam step (`_beam_step`), and one device-to-host transfer (the
    drawn parents and tokens). Only
    the uniforms are drawn request by request, each request's from its own generator
    (`gumbel_top_k_rows`, `draw_rows`), so a request's tree does not depend on its batch."""
    gens = [gen if spec.stochastic and not prm.greedy else None for prm, gen in zip(params, generators, strict=True)]
    tokens = [[root] for root in roots]
    parents = [[-1] for _ in roots]
    depths = [[0] for _ in roots]
    laws = [[-1] for _ in roots]  # row of the stacked levels' laws each node was drawn from
    frontier = [[0] for _ in roots]  # per request, the nodes the logits rows are for, in order
    levels: list[torch.Tensor] = []  # [M, V] probabilities of each level, rows request by request
    stored = 0  # rows in `levels`
    sampled = [spec.stochastic and not p.greedy for p in params]
    # one stochastic beam is a chain of draws: each level's Gumbel-top-1 of its one path is
    # a draw from q (greedy: its argmax), so rsd-s's chains are sd's, drafted as sd drafts
    # them (no log, no beam step: fixed rsd-s W=1 at T=1, batch 1 went 1.58x -> 1.76x AR)
    beamed = spec.beamed and not (spec.stochastic and spec.beam_width == 1)
    branching = spec.branching if not spec.beamed else (1,) * spec.length
    ranked = not beamed and not any(sampled)  # only ranks: the logits' order is the law's
    lengths = lengths or [spec.length] * len(roots)
    one_child = set(branching[: max(lengths)]) == {1}  # chains: sd, and rsd-c's / rsd-s's cuts
    at_root = one_child and not beamed and drafter.feeds_roots()  # chains fed from the roots: no `first`
    if ranked and at_root and (chains := drafter.chain(roots, lengths, at_root=True)) is not None:
        return [DraftTree.chain([root, *chain]) for root, chain in zip(roots, chains, strict=True)]
    if not beamed and all(sampled) and one_child and drafter.chains():
        first = None if at_root else drafter.first()
        return _sampled_chains(drafter, first, roots, params, generators, lengths)  # every gens[i] is generators[i]
    logits = drafter.first()  # [B, V]
    if ranked and one_child and (chains := _greedy_chains(drafter, logits, lengths)):
        return [DraftTree.chain([root, *chain]) for root, chain in zip(roots, chains, strict=True)]
    scores = torch.zeros(len(roots), dtype=torch.float64, device=logits.device)  # beams: path log-prob per row
    gumbels = torch.zeros_like(scores)  # rsd-s: perturbed value per row
    for depth in range(max(lengths)):
        counts = [len(f) for f in frontier]
        probs = None if ranked else draft_probs(logits, [params[i] for i, c in enumerate(counts) for _ in range(c)])
        one_draw = not beamed and branching[depth] == 1 and all(sampled[i] for i, c in enumerate(counts) if c)
        log_probs = logits if probs is None else None if one_draw else probs.log()
        if beamed:
            assert log_probs is not None
            picks, scores, gumbels = _beam_step(log_probs, counts, scores, gumbels, spec.beam_width, gens)
        else:
            picks = _branch_step(log_probs, probs, counts, branching[depth], gens)
        rows: list[int] = []  # the level's new nodes, request by request: request row, parent, node, token
        new_parents: list[int] = []
        nodes: list[int] = []
        new_tokens: list[int] = []
        start = stored  # the request's first row in the stacked levels
        kept: list[int] = []  # the picks (in pick order) that go on to the next level
        picked = 0  # picks of the requests before
        for i, request_picks in enumerate(picks):
            front, frontier[i] = frontier[i], []
            goes_on = depth + 1 < lengths[i]  # else its tree ends at this level: its nodes are not fed
            if goes_on:
                kept += range(picked, picked + len(request_picks))
            picked += len(request_picks)
            for k, token in request_picks:
                node, parent = len(tokens[i]), front[k]
                tokens[i].append(token)
                parents[i].append(parent)
                depths[i].append(depth + 1)
                laws[i].append(start + k)
                if goes_on:
                    frontier[i].append(node)
                    rows.append(i)
                    new_parents.append(parent)
                    nodes.append(node)
                    new_tokens.append(token)
            start += len(front)
        if probs is not None:
            levels.append(probs)
        stored = start
        if depth + 1 == max(lengths) or not nodes:
            break
        if beamed and len(kept) < len(scores):  # beams of trees that ended leave the scores
            index = torch.tensor(kept, device=scores.device)
            scores, gumbels = scores[index], gumbels[index]
        logits = drafter.extend(rows, new_parents, nodes, new_tokens)
    return _packed_trees(tokens, parents, depths, laws, levels, sampled)


def _greedy_chains(drafter: LevelDrafter, logits: torch.Tensor, lengths: list[int]) -> list[list[int]] | None:
    """Ranked one-child levels are greedy chains: each request's `lengths[i]` drafts, the
    first its root's argmax (`logits`, `drafter.first()`'s), the rest the drafter's own
    chain on from it where it drafts one (`DraftLMLevels.chain`: every level in one C++
    call, ~0.4-0.5 ms of host work a level less at batch 1); None: draft level by level."""
    if not (argmax_applies([logits]) or drafter.chains()):
        return None  # the first drafts' argmax would be read back for a tree drafted level by level anyway
    firsts = greedy_tokens([logits])
    rest = drafter.chain(firsts, [n - 1 for n in lengths])
    return None if rest is None else [[first, *more] for first, more in zip(firsts, rest, strict=True)]


def _sampled_chains(
    drafter: LevelDrafter,
    logits: torch.Tensor | None,
    roots: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator],
    lengths: list[int],
) -> list[DraftTree]:
    """Sampled one-child levels (sd at T > 0, rsd-c's and rsd-s's chains, every request
    sampling): per level the law of every chain still drafting (`draft_probs`, its
    request's own warp: the one definition verification uses), one draw each at a uniform
    from its own generator, then the next level's forward in one call
    (`LevelDrafter.chain_level`), with none of the tree code's per-level bookkeeping. The
    same laws and draws, in the same order, as the level loop of `draft_rsd_trees` takes
    for these trees, so the same trees (`tests/runtime/test_rsd_batched_levels.py`).

    A request's uniforms, one a level, are drawn up front from its generator, the numbers
    `draw_rows` would draw a level at a time, in the same order, on any device
    (`level_uniforms`: one call a request on the CPU, one a level on a GPU).
    Where every warp is a temperature alone, the whole loop is one drafter call
    (`LevelDrafter.sampled_chain`, the draft LM's C++ op: the same softmax, the same
    inverse-CDF draw, so the same trees and laws bit for bit), where the loop paid ~0.1 ms
    of Python a level (sd at T=1, batch 1: ~0.4 ms of a ~3.4 ms step). Elsewhere (a GPU)
    each level's draws stay on the device and feed the next level as they are
    (`LevelDrafter.chain_level` takes a tensor): one read-back for the whole chain, so the
    host packs the next level while the device still computes this one."""
    uniforms = level_uniforms(generators, lengths)  # one draw a level, as `draw_rows`
    if all(prm.temperature_alone for prm in params):
        fused = drafter.sampled_chain(logits, lengths, [prm.temperature for prm in params], uniforms)
        if fused is not None:
            drawn, tables = fused[0].tolist(), fused[1]
            return [
                DraftTree(
                    [root, *row[:n]], list(range(-1, n)), tables[i, : n + 1], depths=list(range(n + 1)), sampled=True
                )
                for i, (root, row, n) in enumerate(zip(roots, drawn, lengths, strict=True))
            ]
    if logits is None:  # the roots were to be fed as the op's first level: fed by `first` instead
        logits = drafter.first()
    active = list(range(len(roots)))  # requests whose chains go on, in row order
    laws: list[list[int]] = [[-1] for _ in roots]  # row of the stacked levels' laws each node was drawn from
    levels: list[torch.Tensor] = []
    draws: list[torch.Tensor] = []  # each level's draws, on the device: fed on as they are, read back once
    stored = 0
    for depth in range(max(lengths)):
        probs = draft_probs(logits, [params[i] for i in active])  # [len(active), V]
        picked = inverse_cdf_rows(probs, uniforms[active, depth])
        levels.append(probs)
        draws.append(picked)
        for k, i in enumerate(active):
            laws[i].append(stored + k)
        stored += len(active)
        going = [k for k, i in enumerate(active) if depth + 1 < lengths[i]]
        if not going:
            break
        if len(going) < len(active):
            picked = picked[torch.tensor(going, device=picked.device)]
        active = [active[k] for k in going]
        logits = drafter.chain_level(active, picked, depth + 1)
    drawn_all = torch.cat(draws).tolist()  # a node's token sits at its law's row
    tokens = [[root, *(drawn_all[row] for row in rows[1:])] for root, rows in zip(roots, laws, strict=True)]
    depths = [list(range(len(t))) for t in tokens]
    parents = [[n - 1 for n in range(len(t))] for t in tokens]
    return _packed_trees(tokens, parents, depths, laws, levels, [True] * len(roots))


def _accepting_logits(tree: DraftTree, vocab: int, device: torch.device | str) -> torch.Tensor:
    """Target logits `[N, V]` under which verification at temperature 1 accepts the first
    child of every node it reaches, so the walk is its longest: in a sampled `tree`, the
    law the children were drawn from (q = p: the acceptance min(1, q/p) is 1); in a
    deterministic one, nearly all the mass on the first child's token; uniform at leaves."""
    laws = tree.draft_probs if tree.sampled else None
    rows = torch.zeros((len(tree.tokens), vocab), device=device) if laws is None else torch.zeros_like(laws)
    for node, kids in enumerate(children_lists(tree.parents)):
        if kids and laws is not None:
            rows[node] = laws[kids[0]].log()
        elif kids:
            rows[node, tree.tokens[kids[0]]] = 40.0  # q = 1 - ~V e^-40
    return rows


def _packed_trees(
    tokens: list[list[int]],
    parents: list[list[int]],
    depths: list[list[int]],
    laws: list[list[int]],
    levels: list[torch.Tensor],
    sampled: list[bool],
) -> list[DraftTree]:
    """The `DraftTree`s, each `sampled` tree's node's `draft_probs` row gathered from the
    levels' rows (`laws`: row of the stacked levels; the root's row is zeros) in one index for
    the batch. A ranked tree (greedy, or deterministic beams) gets none: verification matches
    its nodes against the target's argmax and never reads a draft law."""
    sizes = [len(t) for t in tokens]
    tables: list[torch.Tensor | None] = [None] * len(tokens)
    drafted = [i for i, size in enumerate(sizes) if size > 1 and sampled[i]]
    if drafted:
        stacked = torch.cat([levels[0].new_zeros(1, levels[0].shape[-1]), *levels])  # row 0: zeros
        index = torch.tensor([row + 1 for i in drafted for row in laws[i]], device=stacked.device)
        for i, table in zip(drafted, stacked.index_select(0, index).split([sizes[i] for i in drafted]), strict=True):
            tables[i] = table
    return [
        DraftTree(t, p, table, depths=d, sampled=s)
        for t, p, d, table, s in zip(tokens, parents, depths, tables, sampled, strict=True)
    ]


def _branch_step(
    log_probs: torch.Tensor | None,
    probs: torch.Tensor | None,
    counts: list[int],
    b: int,
    gens: list[torch.Generator | None],
) -> list[list[tuple[int, int]]]:
    """RSD-C / SD, one level of every request at once: `b` children per frontier row by
    Gumbel-top-k (RSD Algorithm 4) over `log_probs` `[M, V]` (rows request by request,
    `counts[i]` of request i), each request's Gumbels from its own generator (`gens[i]`;
    None: the `b` most likely, the greedy limit), drawn top-down (`gumbel_top_k_rows`).
    One child (b = 1) is a plain draw from `probs` (`draw_rows`, the law of the Gumbel
    argmax); `log_probs` may then be None where every row is drawn, `probs` None where
    none is. Per request, its picks (row within its frontier, token), parent by parent and
    within a parent in draw order."""
    sampled = [(count, gen) for count, gen in zip(counts, gens, strict=True) if count and gen is not None]
    rows = log_probs if log_probs is not None else probs
    assert rows is not None
    width = min(b, rows.shape[-1])
    if sum(count for count, _ in sampled) == len(rows):  # every row drawn (a batch at T > 0)
        listed = _draw_rows(log_probs, probs, sampled, b)[:, :width].tolist()  # the level's one device-to-host transfer
    elif b == 1 and not sampled and argmax_applies([rows]):  # greedy chains: each row's argmax, as host ints
        listed = [[token] for token in greedy_tokens([rows])]  # (C++: ~5 us where topk over doubles took 26-135)
    else:  # ranked rows (greedy requests): the b most likely
        assert log_probs is not None
        index = top_k_valid_rows(log_probs, b)
        if sampled:
            owners = _row_owners(counts)
            drawn = [m for m, i in enumerate(owners) if gens[i] is not None]
            index[drawn] = _draw_rows(log_probs[drawn], None if probs is None else probs[drawn], sampled, b)[:, :width]
        listed = index.tolist()
    out, start = [], 0
    for count in counts:
        out.append([(k, token) for k in range(count) for token in listed[start + k] if token >= 0])
        start += count
    return out


def _draw_rows(
    log_probs: torch.Tensor | None, probs: torch.Tensor | None, sampled: list[tuple[int, torch.Generator]], b: int
) -> torch.Tensor:
    """`b` children of every row of the law (rows of the requests of `sampled`, as (rows,
    generator) in order): `[M, b]` tokens in draw order, -1 past a row's last token of
    non-zero probability; one child is a plain draw from `probs` (`draw_rows`), more a
    Gumbel-top-k over `log_probs`."""
    if b == 1 and probs is not None:
        return draw_rows(probs, [gen for count, gen in sampled for _ in range(count)])[:, None]
    assert log_probs is not None
    return gumbel_top_k_rows(log_probs, [c for c, _ in sampled], [g for _, g in sampled], b)[0]


def _row_owners(counts: list[int]) -> list[int]:
    """The request of every row, for rows request by request (`counts[i]` of request i)."""
    return [i for i, count in enumerate(counts) for _ in range(count)]


def _beam_step(
    log_probs: torch.Tensor,
    counts: list[int],
    scores: torch.Tensor,
    gumbels: torch.Tensor,
    width: int,
    gens: list[torch.Generator | None],
) -> tuple[list[list[tuple[int, int]]], torch.Tensor, torch.Tensor]:
    """RSD-S: one level of Stochastic Beam Search (Kool et al. 2019 Algorithm 2; RSD
    Algorithm 8/9) for every request at once. Frontier row m (rows request by request,
    `counts[i]` of request i) has path log-prob phi_m (`scores`) and perturbed value G_m
    (`gumbels`); its children get phi_m + log p_m(x), perturbed by Gumbels (each request's
    from its generator `gens[i]`) truncated to max G_m; per request, the `width` largest
    over all its children survive, best first (so each parent's children are in draw
    order). Requests without a generator (`gens[i]` None): plain beam search (top-W by
    path log-prob). Returns per request its picks (row within its frontier, token), and the
    path log-prob and perturbed value of every pick `[sum of picks]`, in that order.

    Sampled and ranked requests are two batches (`_beam_group`) when both are present."""
    sampled = [gen is not None for gen in gens]
    if all(sampled) or not any(sampled):
        return _beam_group(log_probs, counts, scores, gumbels, width, [g for g in gens if g is not None] or None)
    out_picks: list[list[tuple[int, int]]] = [[] for _ in counts]
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # each group's new scores and perturbed values
    where = [(0, 0)] * len(counts)  # per request: (offset of its picks in the groups' concatenation, how many)
    seen = 0
    starts = [sum(counts[:i]) for i in range(len(counts))]
    for group_sampled in (False, True):
        members = [i for i, s in enumerate(sampled) if s == group_sampled and counts[i]]  # (a tree that ended: none)
        if not members:
            continue
        rows = torch.tensor([starts[i] + k for i in members for k in range(counts[i])], device=log_probs.device)
        picks, new_scores, new_gumbels = _beam_group(
            log_probs[rows],
            [counts[i] for i in members],
            scores[rows],
            gumbels[rows],
            width,
            [g for i in members if (g := gens[i]) is not None] if group_sampled else None,
        )
        for i, request_picks in zip(members, picks, strict=True):
            out_picks[i] = request_picks
            where[i] = (seen, len(request_picks))
            seen += len(request_picks)
        parts.append((new_scores, new_gumbels))
    order = [offset + n for offset, count in where for n in range(count)]  # back to request order
    index = torch.tensor(order, dtype=torch.long, device=log_probs.device)
    new_scores = torch.cat([s for s, _ in parts])[index]
    new_gumbels = torch.cat([g for _, g in parts])[index]
    return out_picks, new_scores, new_gumbels


def _beam_group(
    log_probs: torch.Tensor,
    counts: list[int],
    scores: torch.Tensor,
    gumbels: torch.Tensor,
    width: int,
    gens: list[torch.Generator] | None,
) -> tuple[list[list[tuple[int, int]]], torch.Tensor, torch.Tensor]:
    """`_beam_step` for requests all sampled (their `gens`) or all ranked (None): one top-k of
    `[B, F * C]` over C candidate children per frontier row, requests with fewer rows
    padded with -inf. Ranked: every token is a candidate (C = V; the ranking, ties
    included, is that of one top-k over the request's `[F * V]` path log-probs).
    Sampled: the truncation is increasing along a row, so only a row's `width` largest
    perturbed children can survive; they are the candidates (drawn top-down,
    `gumbel_top_k_rows`), and only they are truncated (`truncated_gumbel` on them: their
    maximum is the row's)."""
    b, f = len(counts), max(counts)
    tokens: torch.Tensor | None = None  # [M, C] token of each candidate (None: C = V, the token itself)
    if gens is None:
        keys = cand_phi = scores[:, None] + log_probs.double()  # [M, V]
    else:
        tokens, values = gumbel_top_k_rows(log_probs, counts, gens, width)  # [M, C], the row's max first
        tokens = tokens.clamp(min=0)  # (a -1 past a row's last token has value -inf: never kept)
        keys = truncated_gumbel(scores[:, None] + values, gumbels)
        cand_phi = scores[:, None] + log_probs.gather(1, tokens).double()
    c = keys.shape[-1]
    if any(count != f for count in counts):  # pad each request to f rows of -inf
        dest = torch.tensor([i * f + k for i, count in enumerate(counts) for k in range(count)], device=keys.device)
        keys = keys.new_full((b * f, c), float("-inf")).index_copy_(0, dest, keys)
        cand_phi = cand_phi.new_zeros((b * f, c)).index_copy_(0, dest, cand_phi)
        if tokens is not None:
            tokens = tokens.new_zeros((b * f, c)).index_copy_(0, dest, tokens)
    index = top_k_valid_rows(keys.reshape(b, f * c), width)  # [B, W] position in the request's F x C
    safe = index.clamp(min=0)
    if tokens is None:
        flat = index.tolist()  # the level's one device-to-host transfer
        picks = [[(j // c, j % c) for j in row if j >= 0] for row in flat]
    else:
        token = tokens.reshape(b, f * c).gather(1, safe)
        flat, token_rows = torch.stack([index, token]).tolist()  # the level's one device-to-host transfer
        picks = [
            [(j // c, t) for j, t in zip(row, ts, strict=True) if j >= 0]
            for row, ts in zip(flat, token_rows, strict=True)
        ]
    new_scores = cand_phi.reshape(b, f * c).gather(1, safe).flatten()
    new_gumbels = keys.reshape(b, f * c).gather(1, safe).flatten()
    kept = [i * len(row) + n for i, row in enumerate(flat) for n, j in enumerate(row) if j >= 0]
    if len(kept) < new_scores.shape[0]:  # a law with fewer than W tokens of non-zero probability
        rows = torch.tensor(kept, device=keys.device)
        new_scores, new_gumbels = new_scores[rows], new_gumbels[rows]
    return picks, new_scores, new_gumbels


def _beam_level(
    tree: _Growing, log_probs: dict[tuple[int, int], torch.Tensor], row: int, width: int, gen: torch.Generator | None
) -> list[tuple[int, int]]:
    """RSD-S: one level of Stochastic Beam Search (`_beam_step`) for one request's tree
    held per request; updates its scores and perturbed values. `gen=None`: plain beam
    search (top-W by path log-prob)."""
    rows = torch.stack([log_probs[row, node] for node in tree.frontier])
    counts = [len(tree.frontier)]
    scores = torch.tensor(tree.scores, dtype=torch.float64, device=rows.device)
    gumbels = torch.tensor(tree.gumbels, dtype=torch.float64, device=rows.device)
    picks, new_scores, new_gumbels = _beam_step(rows, counts, scores, gumbels, width, [gen])
    tree.scores, tree.gumbels = new_scores.tolist(), new_gumbels.tolist()
    return [(tree.frontier[k], token) for k, token in picks[0]]


SETTINGS = {"rsd-c": ("branching",), "sd": ("beam_length",), "rsd-s": ("beam_width", "beam_length")}
SETTINGS["redrafter"] = SETTINGS["rsd-s"]
DEFAULTS: dict[str, Any] = {"beam_width": 4, "beam_length": 4, "branching": DEFAULT_BRANCHING}


class LevelTreeProposer(Proposer):
    """Trees drafted level by level (`draft_rsd_trees`) over the engine's drafter: the
    ReDrafter RNN, or a draft LM with its own paged KV cache that shares the target's block
    tables (`Request.draft_state`: tokens of the request that cache holds)."""

    def __init__(self, engine: LoadedEngine, blocks: BlockManager) -> None:
        super().__init__(engine, blocks)
        draft = engine.draft_model
        self.draft_cache: PagedKVCache | None = (
            draft.new_kv_cache(blocks.num_blocks, blocks.block_size) if draft is not None else None
        )
        if self.draft_cache is not None:
            self.draft_cache.warm_up()
        self.fused = Int8DraftLM.of(draft) if draft is not None else None
        """The draft LM's forward as one C++ call, where it applies (`plugins/llama_forward.py`)."""
        self.graphs: CudaGraphs | None = None
        """The draft LM's forwards captured as CUDA graphs (`capture_graphs`), on a GPU."""

    def capture_graphs(self, limits: GraphLimits) -> None:
        if self.draft_cache is not None:
            assert self.engine.draft_model is not None
            self.graphs = limits.forwards(self.engine.draft_model, self.draft_cache)

    def setting_names(self, method: str) -> Collection[str]:
        return SETTINGS[method]

    def params(self, method: str, settings: Mapping[str, Any]) -> TreeSpec:
        s = DEFAULTS | dict(settings)
        return TreeSpec.for_method(method, s["beam_width"], s["beam_length"], tuple(s["branching"]))

    def sizes(self, params: TreeSpec) -> list[int]:
        return params.sizes

    def levels(self, params: TreeSpec) -> list[int]:
        return [0] + [levels for _, levels in params.ladder]

    def cuts(self, params: TreeSpec) -> int:
        """Every size, but for beams of more than one width (`TreeSpec.ladder`): there the
        chains, the `ladder`'s first `length` trees, are cuts of each other, the widths not."""
        if not params.beamed or params.beam_width == 1:
            return params.sizes[-1]
        return params.sizes[params.length]

    def cost_paths(self, params: TreeSpec, sampled: bool = False) -> list[str]:
        """Chains (the `ladder`'s first `length` trees) are drafted apart from the wider
        trees: on a draft LM every level of a batch's chains in one C++ call (greedy:
        `_greedy_chains`; sampled at a temperature alone: `_sampled_chains`), ~0.2 ms a
        level at batch 1, where a wider tree's level goes through `extend` and the tree code
        (rsd-s's through a beam step too), each costing more a level. Fitted together
        (levels, nodes), the two mispriced each other: a batch-1 step of rsd-s's 5-node chain
        was predicted at 8.0 ms where it took 6.65, and load-aware rsd-s drafted 17-node
        beams at 1.45x auto-regression where chains ran 1.76x; rsd-c at T=1 priced its 15-
        and 9-node trees at 3.6-4.9 ms where they took 5.1-6.5, and its chains ~0.3 ms high.
        One path where the ladder is chains alone (sd), or its beams are deterministic.

        A sampled request's levels are paths of their own ("sampled", "sampled-chains"):
        they draw from the draft laws where greedy levels read back an argmax, and cost
        differently per level, most on a GPU (an H200, the draft LM's chains at batch 1:
        4 greedy levels ~1.1 ms a step, 4 sampled levels timed at start-up 3.5 ms; fitted
        together from start-up calls at T=1 alone, load-aware sd at T=0 priced its chains
        ~3x dear and drafted in 1 of ~130 steps, 0.97x auto-regression where fixed chains
        ran 1.7x). So greedy and sampled requests of a batch draft in a call each, greedy
        ones by the ranked path, sampled ones at a temperature alone by `_sampled_chains`
        (one call of both went level by level)."""
        if not params.stochastic or len(params.ladder) == params.length:
            paths = super().cost_paths(params)
        else:
            paths = ["", *(CHAINS if k < params.length else "" for k in range(len(params.ladder)))]
        return [f"sampled-{p}" if p else "sampled" for p in paths] if sampled else paths

    def draft_cost_samples(self, method: str) -> dict[str, list[DraftCall]]:
        """A draft LM's drafting timed at engine start, for 1 and 8 requests of `CONTEXTS`
        tokens in scratch blocks, greedy and sampled at temperature 1: per drafting path
        (`cost_paths`, greedy and sampled ones apart), one call that first catches the draft
        LM up on the whole context (its cost per token read), then every tree of the
        method's default `TreeSpec.ladder`. Without them the fit started from the
        first live call, which catches up on a whole prompt: one such sample priced a token
        read at ~0.45 ms (~50 us measured), so a probe of a request the policy had switched off looked
        far too dear and came too rarely to switch it back on. None for the RNN drafter.

        Each sample holds what a live one holds (`EngineCore`: the drafted nodes' share of
        the step's verification): the trees are verified (`accept_batch`) against target
        laws equal to their draft laws, so every node is accepted and the walk is its
        longest. Without that share, the start-up samples priced a 3-node chain at batch 8,
        T=1 at 2.3 ms where live steps took 3.7-4.4, and the fit crept up over ~12 drafting
        steps, drafting at a loss meanwhile."""
        if self.draft_cache is None:
            return {}
        spec: TreeSpec = self.params(method, {})
        samples: dict[str, list[DraftCall]] = {}
        for rows in (1, 8):
            ids = [f"\0draft-cost-{i}" for i in range(rows)]
            room = self.blocks.num_free // rows
            fitting = [c for c in CONTEXTS if self.blocks.blocks_for(c + spec.max_nodes) <= room]
            if not fitting:
                break  # no room now: the fit learns from live steps
            context = fitting[0]
            try:
                for i in ids:
                    self.blocks.ensure(i, context + spec.max_nodes)
                for temperature in (0.0, 1.0):
                    self._time_drafting(method, spec, ids, context, temperature, samples)
            finally:
                for i in ids:
                    self.blocks.free(i)
        return samples

    def _time_drafting(
        self,
        method: str,
        spec: TreeSpec,
        ids: list[str],
        context: int,
        temperature: float,
        samples: dict[str, list[DraftCall]],
    ) -> None:
        """`draft_cost_samples` for requests `ids` (their blocks held) at `temperature`."""
        vocab, device, rows = self.engine.model.config.vocab_size, self.engine.device, len(ids)
        paths = self.cost_paths(spec, sampled=temperature > 0)
        requests = []
        for n, request_id in enumerate(ids):
            prm = SamplingParams(temperature=temperature, seed=n)
            prompt = [(7 * k + n) % vocab for k in range(context + 1)]
            requests.append(Request(request_id, prompt, prm, method, spec, prm.generator(device), set()))
        for r in requests:
            r.num_computed = context  # the root sits at position `context`
        levels = self.levels(spec)
        largest = {paths[k]: k for k in range(1, len(levels))}  # each path's catch-up: its largest tree
        shapes = [(k, context) for k in largest.values()] + [(k, 0) for k in range(1, len(levels))]
        for n, (k, catch_up) in enumerate([shapes[0], *shapes]):  # the first call is untimed
            for r in requests:
                r.draft_state = context - catch_up
            start = time.perf_counter()
            trees = self.propose(requests, [spec.sizes[k]] * rows)
            drafting = time.perf_counter() - start
            logits = [_accepting_logits(tree, vocab, device) for tree in trees]
            start = time.perf_counter()
            accept_batch(trees, logits, [r.params for r in requests], [r.generator for r in requests])
            verify = time.perf_counter() - start
            if n:
                drafted = rows * (spec.sizes[k] - 1)
                share = verify * drafted / sum(len(tree.tokens) for tree in trees)
                call = (levels[k], drafted, rows * catch_up, rows * levels[k], drafting + share)
                samples.setdefault(paths[k], []).append(call)

    def lag(self, request: Request) -> int:
        """A draft LM's catch-up: the request's committed tokens its cache does not hold
        (`DraftLMLevels.first` feeds them with the root)."""
        if self.draft_cache is None:
            return 0
        return max(request.num_computed - (request.draft_state or 0), 0)

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        trees: dict[Request, DraftTree] = {}
        groups: dict[TreeSpec, list[tuple[Request, int]]] = {}  # every depth of a ladder's tree in one call
        for request, budget in zip(requests, budgets, strict=True):
            rung = request.draft_params.rung(budget)
            if rung is None:
                trees[request] = DraftTree.root(request.pending)
            else:
                groups.setdefault(rung[0], []).append((request, rung[1]))
        for tree_spec, members in groups.items():
            group, lengths = [r for r, _ in members], [d for _, d in members]
            spec = tree_spec.truncated(max(lengths))
            roots = [r.pending for r in group]
            drafter: RNNLevels | DraftLMLevels
            if self.draft_cache is not None:
                assert self.engine.draft_model is not None
                drafter = DraftLMLevels(
                    self.engine.draft_model, self.draft_cache, self.blocks, group, self.fused, self.graphs
                )
            else:
                assert self.engine.redrafter is not None
                embed = self.engine.model.model.embed_tokens
                drafter = RNNLevels(self.engine.redrafter, embed, target_hidden(group), roots, spec.max_nodes)
            params, gens = [r.params for r in group], [r.generator for r in group]
            drafted = draft_rsd_trees(drafter, roots, params, gens, spec, lengths)
            for request, tree in zip(group, drafted, strict=True):
                tree.node_budget = request.draft_params.node_budgets(tree_spec, tree.parents, tree.depths)
            trees |= dict(zip(group, drafted, strict=True))
        return [trees[r] for r in requests]

    def on_accept(self, request: Request, tree: DraftTree, accepted: Acceptance, moves: KVMoves | None) -> None:
        if self.draft_cache is None:
            return
        if moves is not None:  # local, so at once (before any block is reused)
            self.draft_cache.copy(moves.src, moves.dst)
        if len(tree.tokens) > 1:
            # the draft LM fed every node above the tree's last level (the tree may have been
            # drafted fewer levels deep than the request's spec); a last-level leaf it did not
            fed = tree.depths[accepted.path[-1]] < max(tree.depths)
            request.draft_state = request.num_computed - (0 if fed else 1)
