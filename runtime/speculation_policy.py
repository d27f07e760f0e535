"""Load-aware speculation: how large a tree to draft this step (its node budget), from the
current batch and measured step costs.

Speculation trades target work for fewer steps: a tree of n nodes costs n tokens of the
step's forward (plus drafting) and returns tau tokens (accepted + bonus). With few
requests the forward is latency-bound and extra tokens are nearly free, so large trees
win; with many, the forward is compute-bound, every node costs, and the best size
shrinks — to none (auto-regressive) when drafting cannot pay for itself. vLLM and SGLang
keep a fixed tree and lose their speedup at batch 24-56; here the budget is chosen per
step to maximise expected tokens per second:

    rate(c) = sum_r tau_r(c) / (forward_time(tokens(c)) + draft_time(drafted(c)))

- a request offers the tree sizes its proposer can draft (`Proposer.sizes`); at budget c
  it drafts the largest size <= c. Several sizes are nested trees (ReDrafter's beams,
  best first), which the policy may shrink down to 1 (no drafting); a single size is a
  whole tree (RSD, Lyanna, n-gram), always drafted and only counted here;
- forward_time(n) = a + b n and draft_time(d) = c + e d (d drafted nodes) are
  least-squares fits over recent measured steps (forward costs seeded by a short
  calibration when the engine starts);
- tau(size) and nodes(size) are running means per size. A nested tree also measures
  every smaller size exactly for greedy acceptance: the accepted path stays accepted at
  budget c as long as each of its nodes is in the tree of that budget
  (`DraftTree.node_budget` <= c). Sizes never tried start optimistic (as many tokens
  as the request's smallest tree has nodes: one whole ReDrafter beam accepted), so they
  get tried.

Whatever the budget, acceptance is lossless; the policy only moves speed.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

DraftSamples = Iterable[tuple[int, float]]
"""(drafted nodes, seconds) measurements of drafting (`Proposer.draft_cost_samples`)."""

WINDOW = 64
"""Recent steps the cost fits use: enough to average noise, few enough to follow drift."""
EMA = 0.1
"""Weight of a new observation in the acceptance/node means."""


@dataclass
class StepStats:
    """Measurements of one step, reported by the engine."""

    num_tokens: int
    draft_seconds: float
    forward_seconds: float
    drafted: int = 0
    """Drafted nodes this step (roots excluded), over all requests."""
    accepted: dict[int, list[int]] = field(default_factory=dict)
    """size -> accepted drafts of each tree that could have been drafted at that size."""
    nodes: dict[int, list[int]] = field(default_factory=dict)
    """size -> tree sizes observed at exactly that size (duplicate beams merge)."""

    def record(self, size: int, nodes: int, accepted: int, smaller: list[int], path_budgets: list[int]) -> None:
        """One verified tree drafted at `size` with `nodes` nodes, `accepted` drafts kept;
        for nested trees, `smaller` are the request's smaller sizes and `path_budgets` the
        `node_budget` of each accepted draft (what each smaller size would have kept)."""
        self.drafted += nodes - 1
        self.nodes.setdefault(size, []).append(nodes)
        self.accepted.setdefault(size, []).append(accepted)
        if path_budgets:
            for c in smaller:
                self.accepted.setdefault(c, []).append(sum(b <= c for b in path_budgets))


class LinearCost:
    """seconds = intercept + slope * x, fitted on a window of (x, seconds) samples (refitted
    once per new sample, not per query: the policy queries it several times a step)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._fit: tuple[float, float] | None = None

    def add(self, x: float, seconds: float) -> None:
        self.samples.append((x, seconds))
        self._fit = None

    def __call__(self, x: float) -> float:
        if not self.samples:
            return 0.0
        if self._fit is None:
            xs, ts = np.array(self.samples).T
            if np.ptp(xs) == 0:  # no spread: assume proportional cost through the origin
                self._fit = (0.0, float(ts.mean() / max(xs[0], 1.0)))
            else:
                slope, intercept = np.polyfit(xs, ts, 1)
                self._fit = (max(float(intercept), 0.0), max(float(slope), 0.0))
        intercept, slope = self._fit
        return intercept + slope * x


@dataclass
class SpeculationPolicy:
    adaptive: bool = True
    """False: every request drafts its largest size."""
    forward_cost: LinearCost = field(default_factory=LinearCost)
    draft_cost: LinearCost = field(default_factory=LinearCost)
    tau: dict[int, float] = field(default_factory=dict)
    """size -> mean accepted drafts + 1."""
    tree_nodes: dict[int, float] = field(default_factory=dict)
    """size -> mean tree size (root included)."""
    budgets_chosen: Counter[int] = field(default_factory=Counter)
    """Steps run at each budget (for reports)."""

    def budget(self, options: list[list[int]], others: int) -> int:
        """This step's node budget for the decoding requests, whose tree sizes are
        `options` (ascending each); `others` (prefilling) requests add ~1 token each."""
        if not options:
            return 1
        top = max(o[-1] for o in options)
        if self.adaptive:
            nested = {s for o in options if len(o) > 1 for s in o}
            if nested:
                top = max(sorted(nested | {1}), key=lambda c: self.rate(c, options, others))
        self.budgets_chosen[top] += 1
        return top

    def rate(self, budget: int, options: list[list[int]], others: int) -> float:
        """Expected tokens per second of the decoding requests at this budget."""
        sizes = [fitting(o, budget) for o in options]
        gain = sum(self.tau.get(s, optimistic(o)) if s > 1 else 1.0 for s, o in zip(sizes, options, strict=True))
        tokens = others + sum(self.tree_nodes.get(s, float(s)) if s > 1 else 1.0 for s in sizes)
        drafted = sum(s - 1 for s in sizes)
        seconds = self.forward_cost(tokens) + (self.draft_cost(drafted) if drafted else 0.0)
        return gain / max(seconds, 1e-9)

    def calibrate(self, forward: Callable[[int], None], sizes: list[int], draft_samples: DraftSamples) -> None:
        """Seed the cost fits: `forward(n)` runs a target forward of n tokens (timed twice per
        size); `draft_samples` are (drafted nodes, seconds) measured by the proposers."""
        for n in sizes:
            for _ in range(2):
                start = time.perf_counter()
                forward(n)
                self.forward_cost.add(n, time.perf_counter() - start)
        for drafted, seconds in draft_samples:
            self.draft_cost.add(drafted, seconds)

    def observe(self, stats: StepStats) -> None:
        self.forward_cost.add(stats.num_tokens, stats.forward_seconds)
        if stats.drafted:
            self.draft_cost.add(stats.drafted, stats.draft_seconds)
        for c, values in stats.accepted.items():
            self._mean(self.tau, c, 1.0 + sum(values) / len(values))
        for c, values in stats.nodes.items():
            self._mean(self.tree_nodes, c, sum(values) / len(values))

    @staticmethod
    def _mean(table: dict[int, float], key: int, value: float) -> None:
        table[key] = value if key not in table else (1 - EMA) * table[key] + EMA * value


def optimistic(sizes: list[int]) -> float:
    """Tokens per step assumed for a size never measured: the request's smallest drafted
    tree accepted whole (one beam of a nested tree; a whole tree)."""
    return float(min(s for s in sizes if s > 1))


def largest_fitting(sizes: list[int], budget: int) -> int:
    """The largest of `sizes` within `budget`, or 1 (the root alone)."""
    return max((s for s in sizes if s <= budget), default=1)


def fitting(sizes: list[int], budget: int) -> int:
    """The size a request offering `sizes` drafts at `budget`: the largest within it (nested
    sizes start at 1); a whole tree (one size) is drafted whatever the budget (the step's
    token budget may still cut it to the root)."""
    return largest_fitting(sizes, budget) if len(sizes) > 1 else sizes[0]
