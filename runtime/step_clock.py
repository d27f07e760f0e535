"""Where an engine step's time goes: seconds per phase, summed over steps (`make profile`
reads it; the load-aware policy reads the draft and forward phases of each step).

    schedule  load-aware sizes + the scheduler's work
    draft     the proposers (`Proposer.propose`)
    assemble  packing the flat batch and its attention metadata (`step_batch.py`)
    forward   the target forward (`ModelRunner.execute`)
    verify    acceptance (`verify.accept_batch`)
    commit    KV compaction, block bookkeeping, the proposers' `on_accept`
    emit      the requests' callbacks (streaming, detokenizing in front ends)

On a GPU the work is asynchronous: without a synchronise a phase's kernels are paid by
whichever later phase first waits for them, so profiles synchronise the device at every lap,
and every step at the end of its forward (`lap(..., wait=True)`): load-aware speculation
prices forwards and drafting apart, and unsynchronised the forward's kernels were paid by
verification, whose time is charged to drafting. On an H100, a default sweep then drafted
almost nothing (ReDrafter tau 1.0-1.3, where fixed ReDrafter ran ~1.9x auto-regression);
with this wait and the compaction kernel compiled at start (not measured apart) it drafts
and runs 1.35-1.87x at T=0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("schedule", "draft", "assemble", "forward", "verify", "commit", "emit")


@dataclass
class StepKind:
    """Steps of one kind (`StepClock.count_step`): how many, their seconds, the tokens they emitted."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


class StepClock:
    def __init__(self, sync: Callable[[], None] | None = None, every_lap: bool = False) -> None:
        self.sync = sync
        """A device synchronise (None on the CPU): before every reading if `every_lap`
        (profiles), else before the laps that ask for it (`lap(wait=True)`)."""
        self.every_lap = every_lap
        self.totals = dict.fromkeys(PHASES, 0.0)
        """Seconds per phase since the last `reset`."""
        self.steps = 0
        self._last = 0.0
        self._nested = 0.0
        self.step = dict.fromkeys(PHASES, 0.0)
        """Seconds per phase of the current (or last) step."""
        self.plain_steps = 0
        self.plain_seconds = 0.0
        """Decoding steps that drafted nothing (`count_plain`), and their seconds: what a
        step costs when speculation is off, to set beside an auto-regressive step."""
        self.steady_steps = 0
        """Those of them the engine calls steady (`count_plain`): more than
        `speculation_policy.AFTER_PREFILL` steps after the last step that prefilled or
        verified trees (`SpeculationPolicy.since_heavy`). After such a step the CPU runs the
        next few slow (its caches hold the heavy step's data: a batch-2 ReDrafter step after
        a 21-node probe +0.55 ms, then +0.14, +0.10 on ~1.4 ms), a cost of that step
        (load-aware speculation charges it to the probe), not of speculation switched off."""
        self.steady_phases = dict.fromkeys(PHASES, 0.0)
        """Seconds per phase of the steady steps (summed: `steady_ms`; per phase:
        `benchmarks/no_draft.py`)."""
        self.kinds: dict[str, StepKind] = {}
        """"prefilling" (steps whose forward held prompt chunks) and "decoding" (the others):
        their steps, seconds and tokens emitted (`count_step`)."""
        self._emitted = 0

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.plain_steps, self.plain_seconds = 0, 0.0
        self.steady_steps = 0
        self.steady_phases = dict.fromkeys(PHASES, 0.0)
        self.kinds = {}

    def count_plain(self, steady: bool) -> None:
        """The step just timed decoded without drafting and without prefill; `steady`: far
        enough from the last heavy step (`steady_steps`)."""
        seconds = sum(self.step.values())
        self.plain_steps += 1
        self.plain_seconds += seconds
        if steady:
            self.steady_steps += 1
            for phase, spent in self.step.items():
                self.steady_phases[phase] += spent

    def emitted(self, tokens: int) -> None:
        """The current step sent `tokens` tokens to a request."""
        self._emitted += tokens

    def count_step(self, prefill: bool) -> None:
        """The step just timed ends; it held prompt chunks (`prefill`) or only decoding."""
        kind = self.kinds.setdefault("prefilling" if prefill else "decoding", StepKind())
        kind.steps += 1
        kind.seconds += sum(self.step.values())
        kind.tokens += self._emitted

    def plain_ms(self) -> float | None:
        """Milliseconds per step of the steps `count_plain` counted (None: there were none)."""
        return 1e3 * self.plain_seconds / self.plain_steps if self.plain_steps else None

    def steady_ms(self) -> float | None:
        """The same of the steady ones (`steady_steps`)."""
        return 1e3 * sum(self.steady_phases.values()) / self.steady_steps if self.steady_steps else None

    def start(self) -> None:
        """A step begins."""
        self.steps += 1
        self.step = dict.fromkeys(PHASES, 0.0)
        self._nested = 0.0
        self._emitted = 0
        self._last = self._now()

    def lap(self, phase: str, wait: bool = False) -> float:
        """The time since the last lap (less any `nested` time in it) goes to `phase`;
        `wait`: the device's work queued so far is part of it."""
        now = self._now(wait)
        seconds = now - self._last - self._nested
        self._last, self._nested = now, 0.0
        self._add(phase, seconds)
        return seconds

    def mark(self) -> float:
        """The start of a stretch `nested` gives to a phase."""
        return self._now()

    def nested(self, phase: str, start: float) -> None:
        """The time since `start` (`mark`) goes to `phase`, not to the enclosing lap (a call
        pair, not a context manager: it wraps every request's callback, and a generator's
        `with` costs ~1-2 us a request; AR in lockstep 1.009x / 1.002x at batch 8 / 32)."""
        seconds = self._now() - start
        self._nested += seconds
        self._add(phase, seconds)

    def mean_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase."""
        return {p: 1e3 * s / max(self.steps, 1) for p, s in self.totals.items()}

    def _add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds
        self.step[phase] += seconds

    def _now(self, wait: bool = False) -> float:
        if self.sync is not None and (wait or self.every_lap):
            self.sync()
        return time.perf_counter()
