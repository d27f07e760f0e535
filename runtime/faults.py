"""Fault injection: how the tests prove that one failing request cannot take the engine,
or the server, down (the fault-isolation contract of `LLMEngine.step`).

Off unless the environment names faults, read once when an engine starts:

    SPECPIPE_INJECT_FAULTS="draft:7,verify:8,forward:9"

makes stage `draft` raise `InjectedFault` for requests whose sampling seed is 7, and so on.
A seed is a per-request value every door already carries (`--seed`, Triton's
`random_seed`), so a test picks the victim without a test-only input. Stages:

    draft       drafting a batch that holds the request (the engine isolates the culprit)
    verify      accepting a batch of trees that holds the request (isolated the same way)
    sample      choosing the request's first token after its prefill
    forward     the target forward of a step that holds the request (fails that step's
                requests; under tensor parallelism it is fatal for the engine)
    step        anywhere in a step that holds the request (fails every request in flight)
    hang        a step that holds the request never returns (a wedged engine: HANG_S)
    slow        a step that holds the request takes SLOW_S longer (a request that cannot
                finish before a client gives up on it, however fast the machine)
    detokenize  the server's response thread turning the request's tokens into text
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

ENV = "SPECPIPE_INJECT_FAULTS"
STAGES = ("draft", "verify", "sample", "forward", "step", "hang", "slow", "detokenize")
HANG_S = 3600.0
"""How long a `hang` fault blocks its step: longer than any test waits."""
SLOW_S = 0.05
"""How much longer a `slow` fault makes each of its steps: 80 steps (400 tokens at 5 a
step) take 4 s."""


class InjectedFault(RuntimeError):
    """Raised on purpose by `FaultInjector.check`."""


@dataclass(frozen=True)
class FaultInjector:
    seeds: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """stage -> seeds of the requests that fail there."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector:
        spec = environ.get(ENV, "").strip()
        seeds: dict[str, set[int]] = {}
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            stage, _, seed = entry.partition(":")
            if stage not in STAGES or not seed.isdigit():
                raise ValueError(f"{ENV}: {entry!r} is not <stage>:<seed> with a stage in {STAGES}")
            seeds.setdefault(stage, set()).add(int(seed))
        return cls({stage: frozenset(s) for stage, s in seeds.items()})

    def check(self, stages: str | tuple[str, ...], params: Iterable[SamplingParams]) -> None:
        """Raise InjectedFault if a request with one of these settings is to fail at one of
        `stages`, taken in order (stage `hang`: block for HANG_S first; stage `slow`: sleep
        SLOW_S once, then go on)."""
        if not self.seeds:
            return
        seeds = [p.seed for p in params]
        for stage in (stages,) if isinstance(stages, str) else stages:
            victim = next((seed for seed in seeds if seed in self.seeds.get(stage, ())), None)
            if victim is None:
                continue
            if stage == "slow":
                time.sleep(SLOW_S)
                continue
            if stage == "hang":
                time.sleep(HANG_S)
            raise InjectedFault(f"fault injected at {stage} for seed {victim} ({ENV})")


def describe(e: BaseException) -> str:
    """An exception as a request's error message."""
    return f"{type(e).__name__}: {e}"


def each_alone(
    run: Callable[[list[T]], list[R]], items: Sequence[T], what: str
) -> tuple[list[tuple[T, R]], list[tuple[T, str]]]:
    """`run` on all items at once; if that fails, on each item alone, to find the culprit.
    Returns (item, result) pairs and (item, error message) for the items that failed."""
    try:
        return list(zip(items, run(list(items)), strict=True)), []
    except Exception:
        log.exception("%s %d item(s) together failed; trying each alone", what, len(items))
    done, failed = [], []
    for item in items:
        try:
            done.append((item, run([item])[0]))
        except Exception as e:
            log.exception("%s one item failed", what)
            failed.append((item, describe(e)))
    return done, failed
