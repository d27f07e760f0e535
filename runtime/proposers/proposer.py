"""The boundary between the engine loop and the drafting methods (the idea of vLLM v1's
proposers and SGLang's spec workers): the loop schedules, verifies and commits; a proposer
only proposes trees and keeps its own per-request draft state.

A step, as the loop sees it (`runtime/engine_core.py`):

    sizes  = proposer.sizes(request.draft_params)       tree sizes it can draft (ascending)
    budget = scheduler / policy pick one of them        (1 = the root alone: auto-regressive)
    trees  = proposer.propose(requests, budgets)        one DraftTree each, <= its budget
                                                        (budget 1: the loop's root, no call)
    ... one target forward verifies every tree; `runtime/verify.py` accepts a path ...
    proposer.on_accept(request, tree, acceptance, moves)

Verification is the same for every method, so a proposer cannot break losslessness as
long as each tree says truthfully how it was drawn (`DraftTree.sampled` + its laws, or
deterministic candidates verified as point masses).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from runtime.block_manager import BlockManager
from runtime.cuda_graphs import GraphLimits
from runtime.loaded_engine import LoadedEngine
from runtime.request import Request
from runtime.speculation_policy import DraftCall
from runtime.tree import DraftTree
from runtime.verify import Acceptance

CHAINS = "chains"
"""The drafting path (`Proposer.cost_paths`) of a method's one-token-a-level chains where
its wider trees cost differently per level (ReDrafter's one beam, Lyanna's width-1 trees,
rsd-s's chain levels)."""


@dataclass(frozen=True)
class KVMoves:
    """Accepted-path compaction of one request: the cache slots `src[i]` were copied to `dst[i]`."""

    src: torch.Tensor
    dst: torch.Tensor


class Proposer(ABC):
    """One drafting method (or a family sharing one drafter, like the RSD trees), for one
    loaded engine. Owns the method's typed parameters and each request's draft state
    (`Request.draft_state`, reset to None when the request is preempted)."""

    def __init__(self, engine: LoadedEngine, blocks: BlockManager) -> None:
        self.engine, self.blocks = engine, blocks

    @abstractmethod
    def params(self, method: str, settings: Mapping[str, Any]) -> Any:
        """The request's typed parameters from its settings (engine defaults already merged
        by `settings_for`); raises ValueError naming the fix for a bad value."""

    def setting_names(self, method: str) -> Collection[str]:
        """Per-request settings `method` takes (others are refused)."""
        return ()

    def default_params(self, method: str) -> Any:
        """`method`'s parameters with the engine's defaults and no request's own settings
        (what a request that sets none drafts with: captured graphs, start-up timings)."""
        spec = self.engine.config.drafter
        return self.params(method, settings_for(method, self.setting_names(method), spec.settings if spec else {}, {}))

    @abstractmethod
    def sizes(self, params: Any) -> list[int]:
        """Tree sizes (root included) this request can draft, ascending, starting at 1 (the
        root alone: no drafting). They are nested (each tree contains the smaller ones), so
        load-aware speculation may pick any of them per request and step; a tree whose
        nodes carry `DraftTree.node_budget` also measures every smaller size."""

    def levels(self, params: Any) -> list[int]:
        """Sequential drafter calls to draft each of `sizes(params)` (a drafting-cost feature
        of load-aware speculation). Default: none for the root, one for any tree."""
        return [0 if s == 1 else 1 for s in self.sizes(params)]

    @abstractmethod
    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        """One tree per request, rooted at its pending token (`request.pending`): the
        tree of the largest of its sizes within `budgets[i]` (a budget of 1: the root alone).
        The engine loop asks only for budgets > 1: a request at budget 1 (auto-regression,
        most of a busy batch) gets the root alone from the loop, without a call here, and
        `on_accept` as at every step (its draft state may then still be None)."""

    def cuts(self, params: Any) -> int:
        """The largest of its sizes up to which the tree of each smaller size is the larger
        tree cut (trees cut after fewer levels, chains cut shorter), so that a larger tree
        measures exactly what a smaller one would have accepted (`Offer.cut`). Not sizes
        that are beam widths: a wider search keeps a different top beam, and load-aware
        speculation prices those sizes by each size's own measurements
        (`SpeculationPolicy.kind_taus`). Default: every size (its largest)."""
        return self.sizes(params)[-1]

    def lag(self, request: Request) -> int:
        """Tokens of `request` its drafter must read before it can draft again (a draft LM's
        catch-up on what was decoded without it; load-aware speculation charges them to a
        probe in full, and to a steady choice spread over a run of drafting, not to the
        levels). Default: none (drafters that read the target's state)."""
        return 0

    def cost_paths(self, params: Any, sampled: bool = False) -> list[str]:
        """Per size of `sizes(params)`, the drafting path that drafts it for a greedy or a
        `sampled` request, where a method's paths cost differently per level (load-aware
        speculation fits each path's drafting cost apart, `speculation_policy.draft_fit`, and
        the engine drafts each path's requests in one call). Default: one path ("")."""
        return [""] * len(self.sizes(params))

    def draft_cost_samples(self, method: str) -> dict[str, list[DraftCall]]:
        """A few timed drafting calls of `method` at engine start, per drafting path
        (`cost_paths`), to seed load-aware speculation's draft-cost fits (vLLM's profiling
        run). Default: none (the fits then learn from live steps)."""
        return {}

    def capture_graphs(self, limits: GraphLimits) -> None:  # noqa: B027 (an optional hook)
        """On a GPU with CUDA graphs on, `EngineCore` hands every proposer the engine's
        graph limits once, at start: a proposer captures its drafter's device work as CUDA
        graphs (`runtime/cuda_graphs.py`: a draft LM's forwards as the target's, a
        fixed-shape search per shape) and replays them. Default: nothing (eager drafting)."""

    def on_accept(  # noqa: B027 (an optional hook)
        self, request: Request, tree: DraftTree, accepted: Acceptance, moves: KVMoves | None
    ) -> None:
        """After verification: `accepted.path` was committed (its KV moved by `moves`);
        update the draft state (a draft cache, re-sampled candidates). Default: nothing."""


def settings_for(
    method: str, names: Collection[str], defaults: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """A request's settings: the engine's defaults for `names`, then its own overrides
    (None = not given). A setting `method` does not take is refused, not ignored."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if unknown := sorted(set(given) - set(names)):
        takes = f"takes {sorted(names)}" if names else "takes no settings"
        raise ValueError(f"method {method!r} {takes}; got {unknown}")
    return {k: v for k, v in defaults.items() if k in names} | given


def target_hidden(requests: list[Request]) -> torch.Tensor:
    """[B, D] target hidden states at the requests' last committed tokens (what hidden-state
    drafters read)."""
    states = [r.hidden for r in requests]
    if any(h is None for h in states):
        raise RuntimeError("a decoding request has no target hidden state (its prefill did not finish)")
    if len(states) == 1:  # a view, not a copy (~14 -> ~4 us at batch 1): the drafter only reads it
        return states[0][None]  # type: ignore[index]
    return torch.stack(states)  # type: ignore[arg-type]
