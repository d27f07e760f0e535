"""Load-aware speculation: how many beams to draft this step, from the current batch and
measured step costs.

Speculation trades target work for fewer steps: a tree of n nodes costs n tokens of the
step's forward (plus drafting) and returns tau tokens (accepted + bonus). With few
requests the forward is latency-bound and extra tokens are nearly free, so wide trees
win; with many, the forward is compute-bound, every node costs, and the best width
shrinks — to none (auto-regressive) when drafting cannot pay for itself. vLLM and SGLang
keep a fixed tree and lose their speedup at batch 24-56; here the width is chosen per
step to maximise expected tokens per second:

    rate(w) = sum_r tau_r(w) / (forward_time(tokens(w)) + draft_time(beams(w)))

- forward_time(n) = a + b n and draft_time(rows) = c + d rows are least-squares fits
  over recent measured steps (seeded by a short calibration when the engine starts);
- tau(w) and nodes(w) are running means per width. A step at width W also measures
  every w < W exactly for greedy acceptance: beams come best first, so the tree of the
  first w beams is a sub-tree, and the accepted path stays accepted as long as each of
  its nodes is reached by one of those beams (`first_beam` of the node < w).
  Widths never tried start optimistic (every draft accepted), so they get tried.

Whatever the width, acceptance is lossless; the policy only moves speed.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

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
    beams: int = 0
    """Beams drafted this step, over all requests."""
    accepted: dict[int, list[int]] = field(default_factory=dict)
    """width -> accepted drafts of each tree that could have been drafted at that width."""
    nodes: dict[int, list[int]] = field(default_factory=dict)
    """width -> tree sizes observed at exactly that width."""

    def record(self, width: int, nodes: int, first_beam_on_path: list[int]) -> None:
        """One verified tree: drafted at `width`; `first_beam_on_path[j]` is the first beam
        reaching the (j+1)-th accepted draft."""
        self.beams += width
        self.nodes.setdefault(width, []).append(nodes)
        for w in range(1, width + 1):
            self.accepted.setdefault(w, []).append(sum(b < w for b in first_beam_on_path))


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
    """False: always draft each request's own width."""
    forward_cost: LinearCost = field(default_factory=LinearCost)
    draft_cost: LinearCost = field(default_factory=LinearCost)
    tau: dict[int, float] = field(default_factory=dict)
    """width -> mean accepted drafts + 1."""
    tree_nodes: dict[int, float] = field(default_factory=dict)
    """width -> mean tree size (root included)."""
    length: int = 4
    """Draft length assumed for widths not seen yet (the engine's default beam length)."""
    widths_chosen: Counter[int] = field(default_factory=Counter)
    """Steps run at each width (for reports)."""

    def width(self, num_running: int, wanted: list[int]) -> int:
        """Beams to draft this step (requests draft min(this, their own width)); 0 = auto-regressive."""
        if not wanted:
            return 0
        top = max(wanted)
        if self.adaptive:
            others = num_running - len(wanted)  # auto-regressive and prefilling requests: ~1 token each
            candidates = sorted({0, top, *(1 << i for i in range(top.bit_length()) if 1 << i < top)})
            top = max(candidates, key=lambda w: self.rate(w, wanted, others))
        self.widths_chosen[top] += 1
        return top

    def rate(self, width: int, wanted: list[int], others: int) -> float:
        """Expected tokens per second of the decoding requests at this width."""
        widths = [min(width, w) for w in wanted]
        gain = sum(self.tau.get(w, 1.0 + self.length) if w else 1.0 for w in widths)
        tokens = others + sum(self.tree_nodes.get(w, 1.0 + w * self.length) if w else 1.0 for w in widths)
        seconds = self.forward_cost(tokens) + (self.draft_cost(sum(widths)) if width else 0.0)
        return gain / max(seconds, 1e-9)

    def observe(self, stats: StepStats) -> None:
        self.forward_cost.add(stats.num_tokens, stats.forward_seconds)
        if stats.beams:
            self.draft_cost.add(stats.beams, stats.draft_seconds)
        for w, values in stats.accepted.items():
            self._mean(self.tau, w, 1.0 + sum(values) / len(values))
        for w, values in stats.nodes.items():
            self._mean(self.tree_nodes, w, sum(values) / len(values))

    @staticmethod
    def _mean(table: dict[int, float], key: int, value: float) -> None:
        table[key] = value if key not in table else (1 - EMA) * table[key] + EMA * value
