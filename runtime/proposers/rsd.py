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

Every node's row of `DraftTree.draft_log_probs` is the law its siblings were drawn from:
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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from model_defs.paged_kv_cache import PagedKVCache
from runtime.block_manager import BlockManager
from runtime.gumbel import gumbel_noise, gumbel_top_k, top_k_valid, truncated_gumbel
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.level_drafters import DraftLMLevels, RNNLevels
from runtime.proposers.proposer import KVMoves, Proposer, target_hidden
from runtime.request import Request
from runtime.sampling import SamplingParams, target_probs_rows
from runtime.tree import DraftTree
from runtime.verify import Acceptance

RSD_METHODS = ("rsd-c", "rsd-s", "sd")
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
        if self.beamed:
            return 1 + self.beam_width * self.length
        total, level = 1, 1
        for b in self.branching:
            level *= b
            total += level
        return total


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


@dataclass
class _Growing:
    """One request's tree under construction."""

    tokens: list[int]
    parents: list[int]
    log_probs: list[torch.Tensor]  # [V] log of the draft law each node was drawn from (root: zeros)
    frontier: list[int]  # nodes of the deepest level
    scores: list[float]  # rsd-s / beams: log-prob of each frontier node's path
    gumbels: list[float]  # rsd-s: perturbed (truncated-Gumbel) value of each frontier node


def draft_log_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[M, V] log of the law siblings are drawn from, row m under `params[m]`: the request's
    own warp of the drafter's logits (greedy requests: the plain softmax, only ranked)."""
    warped = [prm if not prm.greedy else SamplingParams(temperature=1.0) for prm in params]
    return target_probs_rows(logits, warped).log()


def draft_rsd_trees(
    drafter: LevelDrafter,
    roots: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator],
    spec: TreeSpec,
) -> list[DraftTree]:
    """One tree per request, `spec.length` levels, one drafter call per level."""
    trees = [_Growing([r], [-1], [torch.zeros(0)], [0], [0.0], [0.0]) for r in roots]
    logits = drafter.first()  # [B, V]
    owners = [(i, 0) for i in range(len(roots))]  # (request row, node) of every logits row
    for depth in range(spec.length):
        rows_log_probs = draft_log_probs(logits, [params[i] for i, _ in owners])
        log_probs = {owner: lp for owner, lp in zip(owners, rows_log_probs, strict=True)}
        new: list[tuple[int, int, int, int]] = []  # (row, parent, node, token)
        for i, tree in enumerate(trees):
            sample = not params[i].greedy and spec.stochastic
            gen = generators[i] if sample else None
            picks = (
                _beam_level(tree, log_probs, i, spec.beam_width, gen)
                if spec.beamed
                else _branch_level(tree, log_probs, i, spec.branching[depth], gen)
            )
            tree.frontier = []
            for parent, token in picks:
                node = len(tree.tokens)
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.log_probs.append(log_probs[i, parent])
                tree.frontier.append(node)
                new.append((i, parent, node, token))
        if depth + 1 == spec.length or not new:
            break
        rows, parents, nodes, tokens = (list(col) for col in zip(*new, strict=True))
        logits = drafter.extend(rows, parents, nodes, tokens)
        owners = [(i, node) for i, node in zip(rows, nodes, strict=True)]
    out = []
    for tree, prm in zip(trees, params, strict=True):
        table = None  # [N, V], row 0 (the root, not drawn) zeros
        if len(tree.tokens) > 1:
            table = torch.stack([torch.zeros_like(tree.log_probs[1]), *tree.log_probs[1:]])
        out.append(DraftTree(tree.tokens, tree.parents, table, sampled=spec.stochastic and not prm.greedy))
    return out


def _branch_level(
    tree: _Growing, log_probs: dict[tuple[int, int], torch.Tensor], row: int, b: int, gen: torch.Generator | None
) -> list[tuple[int, int]]:
    """RSD-C: `b` children per frontier node by Gumbel-top-k (RSD Algorithm 4), in draw order."""
    picks = []
    for node in tree.frontier:
        for token in gumbel_top_k(log_probs[row, node], b, gen).tolist():
            picks.append((node, token))
    return picks


def _beam_level(
    tree: _Growing, log_probs: dict[tuple[int, int], torch.Tensor], row: int, width: int, gen: torch.Generator | None
) -> list[tuple[int, int]]:
    """RSD-S: one level of Stochastic Beam Search (Kool et al. 2019 Algorithm 2; RSD
    Algorithm 8/9). Each frontier node i has path log-prob phi_i and perturbed value G_i;
    its children get phi_i + log p_i(x), perturbed by Gumbels truncated to max G_i; the W
    largest over all children survive, best first (so each parent's children are in draw
    order). `gen=None`: plain beam search (top-W by path log-prob)."""
    phi = torch.stack([tree.scores[k] + log_probs[row, n].double() for k, n in enumerate(tree.frontier)])  # [F, V]
    if gen is None:
        keys = phi
    else:
        perturbed = phi + gumbel_noise(tuple(phi.shape), gen, phi.device)
        keys = truncated_gumbel(perturbed, torch.tensor(tree.gumbels, dtype=torch.float64, device=phi.device))
    index, _ = top_k_valid(keys.flatten(), width)
    v = phi.shape[-1]
    parents_k, tokens = (index // v).tolist(), (index % v).tolist()
    tree.scores = [float(phi[k, t]) for k, t in zip(parents_k, tokens, strict=True)]
    tree.gumbels = [float(keys[k, t]) for k, t in zip(parents_k, tokens, strict=True)]
    return [(tree.frontier[k], t) for k, t in zip(parents_k, tokens, strict=True)]


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

    def setting_names(self, method: str) -> Collection[str]:
        return SETTINGS[method]

    def params(self, method: str, settings: Mapping[str, Any]) -> TreeSpec:
        s = DEFAULTS | dict(settings)
        return TreeSpec.for_method(method, s["beam_width"], s["beam_length"], tuple(s["branching"]))

    def sizes(self, params: TreeSpec) -> list[int]:
        return [params.max_nodes]

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        trees: dict[Request, DraftTree] = {}
        groups: dict[TreeSpec, list[Request]] = {}
        for request, budget in zip(requests, budgets, strict=True):
            if budget < request.draft_params.max_nodes:
                trees[request] = DraftTree.root(request.tokens[-1])
            else:
                groups.setdefault(request.draft_params, []).append(request)
        for spec, group in groups.items():
            roots = [r.tokens[-1] for r in group]
            levels: RNNLevels | DraftLMLevels
            if self.draft_cache is not None:
                assert self.engine.draft_model is not None
                levels = DraftLMLevels(self.engine.draft_model, self.draft_cache, self.blocks, group)
            else:
                assert self.engine.redrafter is not None
                embed = self.engine.model.model.embed_tokens
                levels = RNNLevels(self.engine.redrafter, embed, target_hidden(group), roots, spec.max_nodes)
            params, gens = [r.params for r in group], [r.generator for r in group]
            trees |= dict(zip(group, draft_rsd_trees(levels, roots, params, gens, spec), strict=True))
        return [trees[r] for r in requests]

    def on_accept(self, request: Request, tree: DraftTree, accepted: Acceptance, moves: KVMoves | None) -> None:
        if self.draft_cache is None:
            return
        if moves is not None:  # local, so at once (before any block is reused)
            self.draft_cache.copy(moves.src, moves.dst)
        if len(tree.tokens) > 1:
            # the draft LM fed every node above the last level; a last-level leaf it did not
            fed = tree.depths[accepted.path[-1]] < request.draft_params.length
            request.draft_state = request.num_computed - (0 if fed else 1)
