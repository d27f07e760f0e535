"""Prometheus metrics of the served model, through the Python backend's `MetricFamily`
(they appear on Triton's metrics port next to Triton's own `nv_*` metrics).

`pb_utils` is passed in rather than imported: it exists only inside the backend's stub
process, while this module's names are what tests and dashboards rely on."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

from runtime.llm_engine import EngineStats
from runtime.output import RequestStats
from runtime.request import FINISH_REASONS

OUTCOMES = (*FINISH_REASONS, "invalid", "rejected")
"""Request outcomes: the finish reasons, plus refused at admission (bad input / queue full)."""
LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
ACCEPTED_BUCKETS = [0, 1, 2, 3, 4, 5, 6, 8, 12, 16]


class ServingMetrics:
    def __init__(self, pb_utils: Any) -> None:
        family = pb_utils.MetricFamily
        self._families: list[Any] = []  # a family must outlive its metrics

        def new_family(name: str, kind: Any, description: str) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1]

        def metric(name: str, kind: Any, description: str, **kwargs: Any) -> Any:
            return new_family(name, kind, description).Metric(labels={}, **kwargs)

        requests = new_family("specpipe_requests_total", family.COUNTER, "Requests by outcome")
        self.requests = {o: requests.Metric(labels={"outcome": o}) for o in OUTCOMES}
        self.prompt_tokens = metric("specpipe_prompt_tokens_total", family.COUNTER, "Prompt tokens admitted")
        self.output_tokens = metric("specpipe_output_tokens_total", family.COUNTER, "Tokens generated")
        self.ttft = metric(
            "specpipe_time_to_first_token_seconds",
            family.HISTOGRAM,
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = metric(
            "specpipe_time_per_output_token_seconds",
            family.HISTOGRAM,
            "Mean time between output tokens after the first, per request",
            buckets=LATENCY_BUCKETS,
        )
        self.accepted_per_step = metric(
            "specpipe_accepted_tokens_per_step",
            family.HISTOGRAM,
            "Draft tokens accepted per speculative step",
            buckets=ACCEPTED_BUCKETS,
        )
        self.drafted = metric("specpipe_draft_tokens_total", family.COUNTER, "Draft tokens verified by the target")
        self.accepted = metric("specpipe_accepted_tokens_total", family.COUNTER, "Draft tokens accepted")
        self.queue_depth = metric("specpipe_queue_depth", family.GAUGE, "Requests waiting for admission")
        self.running = metric("specpipe_running_requests", family.GAUGE, "Requests in the in-flight batch")
        self.engine_up = metric(
            "specpipe_engine_up",
            family.GAUGE,
            "1 while the engine steps normally; 0 once it is dead or a step stalled (the launcher stops the server)",
        )
        self.engine_up.set(1)
        self.policy_errors = metric(
            "specpipe_speculation_policy_errors",
            family.GAUGE,
            "Calls of the load-aware policy that raised; each such step decoded auto-regressively (no request failed)",
        )
        self._values: dict[int, float] = {id(self.engine_up): 1}
        """The value each gauge was last set to (`_set`), by `id` of the gauge."""
        self._sizes = new_family(
            "specpipe_speculation_steps",
            family.GAUGE,
            "Request-steps drafted at each tree size (nodes, root included; 1: no drafting) by load-aware speculation",
        )
        self._estimates = new_family(
            "specpipe_speculation_expected_tokens_per_step",
            family.GAUGE,
            "Tokens per step load-aware speculation expects at each tree size, by kind of request (method/greedy)",
        )
        self._labelled: dict[tuple[Any, ...], Any] = {}
        blocks = new_family("specpipe_kv_blocks", family.GAUGE, "KV-cache blocks by state")
        self.kv_used = blocks.Metric(labels={"state": "used"})
        self.kv_free = blocks.Metric(labels={"state": "free"})

    def observe_finished(self, stats: RequestStats, reason: str, first_token_at: float | None, now: float) -> None:
        """A request ended with `reason` (the output stage's: "stop" for a stop word too)."""
        self.requests[reason].increment(1)
        self.output_tokens.increment(stats.num_output_tokens)
        self.drafted.increment(stats.num_draft_tokens)
        self.accepted.increment(stats.num_accepted_tokens)
        if stats.num_draft_tokens:  # speculative requests only: auto-regressive steps accept nothing by design
            for accepted in stats.accepted_per_step:
                self.accepted_per_step.observe(accepted)
        if first_token_at is not None and stats.num_output_tokens > 1:
            self.tpot.observe((now - first_token_at) / (stats.num_output_tokens - 1))

    def observe_engine(self, stats: EngineStats, up: bool) -> None:
        """The gauges, from a `LLMEngine.stats()` snapshot. Only a gauge whose value changed
        is set: the backend's `Metric.set` is one round trip to tritonserver that holds the
        GIL (its `increment` and `observe` release it), so every set stalls the engine
        thread's Python for that long (~0.03 ms each on the 2-core EPYC, ~19 gauges with
        ReDrafter's sizes and estimates, every `HOUSEKEEPING_SECONDS`)."""
        self._set(self.engine_up, int(up))
        self._set(self.queue_depth, stats.waiting)
        self._set(self.running, stats.running)
        self._set(self.kv_used, stats.kv_blocks_used)
        self._set(self.kv_free, stats.kv_blocks_free)
        self._set(self.policy_errors, stats.policy_errors)
        for (method, size), steps in stats.tree_sizes.items():
            self._set(self._gauge(self._sizes, method=method, size=str(size)), steps)
        for kind, sizes in stats.estimated_tokens_per_step.items():
            for size, tau in sizes.items():
                self._set(self._gauge(self._estimates, kind=kind, size=str(size)), tau)

    def _set(self, gauge: Any, value: float) -> None:
        if self._values.get(id(gauge)) != value:
            gauge.set(value)
            self._values[id(gauge)] = value

    def _gauge(self, family: Any, **labels: str) -> Any:
        key = (id(family), *sorted(labels.items()))
        if key not in self._labelled:
            self._labelled[key] = family.Metric(labels=labels)
        return self._labelled[key]


def parse_metrics(text: str) -> dict[str, float]:
    """The specpipe_* samples of a Prometheus exposition: 'name{labels}' -> value."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(specpipe_\S+) (\S+)$", text, re.M)}


def read_metrics(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """`parse_metrics` of a metrics endpoint (Triton's metrics port serves ours next to its own)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_metrics(response.read().decode(errors="replace"))
