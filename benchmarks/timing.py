"""How the sweeps time decoding: one clock around a `generate` call, a warm-up request,
and speculative-vs-AR ratios measured in the same run, so that load on a shared machine
hits both sides of a ratio alike.

- `alternate`: rounds in which every configuration runs once, each compared to AR's
  rate in the same round (batch_sweep, device_sweep, redrafter_sweep).
- `bracketed_round`: AR, a group of configurations, AR, the next group, ..., AR; each
  configuration is compared to the mean of the two AR rates around its group (rsd_sweep,
  Lyanna fig12).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams

ONE_AT_A_TIME = RuntimeConfig(max_batch_size=1, speculation="fixed")
"""Batch 1, fixed speculation: the latency-bound regime the papers' speedups are measured in."""
WARMUP_TOKENS = 8
"""Output tokens of a warm-up request."""

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Method(Protocol):
    """A decoding method with its tree-shape overrides (a sweep's configuration)."""

    @property
    def method(self) -> str: ...

    def overrides(self) -> dict[str, Any]: ...


M = TypeVar("M", bound=Method)


@dataclass(frozen=True)
class Run:
    """One timed `generate` call."""

    results: list[GenerationResult]
    seconds: float

    @property
    def tokens(self) -> int:
        """Output tokens of every request."""
        return sum(len(r.output_ids) for r in self.results)

    @property
    def rate(self) -> float:
        """Output tokens/s, prefill included (as a user sees it)."""
        return self.tokens / self.seconds


@dataclass
class Timings:
    """Every timed run of one configuration, each with the AR rate it is compared to."""

    runs: list[Run] = field(default_factory=list)
    ar_rates: list[float] = field(default_factory=list)

    def add(self, run: Run, ar_rate: float) -> None:
        self.runs.append(run)
        self.ar_rates.append(ar_rate)

    @property
    def results(self) -> list[GenerationResult]:
        """The results of every run, in order."""
        return [r for run in self.runs for r in run.results]

    @property
    def tokens(self) -> int:
        return sum(run.tokens for run in self.runs)

    @property
    def seconds(self) -> float:
        return sum(run.seconds for run in self.runs)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens/s over all runs."""
        return self.tokens / self.seconds

    @property
    def rates(self) -> list[float]:
        """Output tokens/s of each run."""
        return [run.rate for run in self.runs]

    @property
    def ratios(self) -> list[float]:
        """Each run's rate over the AR rate it is compared to."""
        return [run.rate / ar for run, ar in zip(self.runs, self.ar_rates, strict=True)]

    @property
    def speedup(self) -> float:
        """Median of `ratios`: robust to a burst of load during one run."""
        return statistics.median(self.ratios)


def sampling_params(num: int, max_tokens: int, temperature: float, first_seed: int = 0) -> list[SamplingParams]:
    """`num` requests of exactly `max_tokens` tokens (EOS ignored), request i seeded with
    `first_seed` + i, so every method decodes the same number of tokens from the same seeds."""
    return [
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=first_seed + i, ignore_eos=True)
        for i in range(num)
    ]


def round_params(num: int, max_tokens: int, temperature: float, round_: int) -> list[SamplingParams]:
    """Round `round_`'s requests (`sampling_params`): every configuration of a round decodes
    the same seeds, and each round seeds apart from the others. Sampled text follows the
    seeds (and what was drafted), and acceptance follows the text: with one seed set for
    every round, each configuration saw one text per prompt in every round, and a lucky set
    flattered whichever configuration it was lucky for (sd's fixed 5-node chains at T=1,
    batch 8: 2.86-3.30 tokens a step over 8 seed sets of the same prompts, mean 3.07; the
    set every round used read 3.30)."""
    return sampling_params(num, max_tokens, temperature, first_seed=round_ * num)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so the clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(llm: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], method: str, **overrides: Any) -> Run:
    """`llm.generate(prompts, params, method, **overrides)` under the clock."""
    device = llm.engine.device
    synchronize(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params, method, **overrides)
    synchronize(device)
    return Run(results, time.perf_counter() - start)


def add_decoding_arguments(ap: argparse.ArgumentParser, rounds: int) -> None:
    """`--temperature`, `--max-tokens`, `--rounds` (default `rounds`) and `--device`: how the
    lockstep-like benchmarks decode their held-out prompts (`lockstep`, `policy_trace`)."""
    ap.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=rounds, help="(default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")


def warm_up(llm: LLMEngine, prompt: list[int], method: str, temperature: float = 1.0, **overrides: Any) -> None:
    """One short request of `method`: the first calls pay for allocator growth and lazy
    initialisation, which no timed run should."""
    llm.generate([prompt], sampling_params(1, WARMUP_TOKENS, temperature), method, **overrides)


def alternate(rounds: Iterable[Mapping[K, Callable[[], Run]]], ar: K) -> dict[K, Timings]:
    """Run every entry of each round once, round i starting at its i-th entry (rotated: no
    configuration always runs first, or always last, where a machine warming up or slowing
    down over a round would favour one); each run is compared to the rate of the round's
    `ar` entry (so AR's own ratio is 1)."""
    timings: dict[K, Timings] = {}
    for i, round_ in enumerate(rounds):
        keys = list(round_)
        shift = i % len(keys) if keys else 0
        runs = {key: round_[key]() for key in keys[shift:] + keys[:shift]}
        for key, run in runs.items():
            timings.setdefault(key, Timings()).add(run, runs[ar].rate)
    return timings


def grouped(configs: Iterable[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """`configs` grouped by `key`, groups and members in first-seen order."""
    out: dict[Hashable, list[T]] = {}
    for c in configs:
        out.setdefault(key(c), []).append(c)
    return list(out.values())


def bracketed_round(
    llm: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    groups: Sequence[Sequence[M]],
    timings: Mapping[M, Timings],
    ar: Timings,
    tick: Callable[[], object] = lambda: None,
) -> None:
    """One round on one engine: AR, the configurations of the first group, AR, the next
    group, ..., AR. A configuration's run is compared to the mean of the two AR rates
    around its group; AR's own runs go to `ar`. `tick` is called after every run."""

    def run_ar() -> float:
        run = timed(llm, prompts, params, "ar")
        ar.add(run, run.rate)
        tick()
        return run.rate

    before = run_ar()
    for group in groups:
        runs = {}
        for c in group:
            runs[c] = timed(llm, prompts, params, c.method, **c.overrides())
            tick()
        after = run_ar()
        for c, run in runs.items():
            timings[c].add(run, (before + after) / 2)
        before = after


def batch_rounds(
    loaded: LoadedEngine,
    batch: int,
    prompts: list[list[int]],
    cfgs: Sequence[M],
    max_tokens: int,
    temperatures: Sequence[float],
    rounds: int,
    tick: Callable[[], object] = lambda: None,
) -> dict[float, tuple[dict[M, Timings], Timings]]:
    """`cfgs` against AR with at most `batch` requests running (in-flight batching, fixed
    speculation): warm-up of AR and every configuration, then at each temperature `rounds`
    bracketed rounds (`bracketed_round`), each seeded apart (`round_params`).
    {temperature: (timings per configuration, AR)}."""
    llm = LLMEngine(loaded, RuntimeConfig(max_batch_size=batch, speculation="fixed"))
    warm_up(llm, prompts[0], "ar")
    for c in cfgs:
        warm_up(llm, prompts[0], c.method, **c.overrides())
    out = {}
    for temperature in temperatures:
        timings, ar = {c: Timings() for c in cfgs}, Timings()
        for r in range(rounds):
            params = round_params(len(prompts), max_tokens, temperature, r)
            bracketed_round(llm, prompts, params, [cfgs], timings, ar, tick)
        out[temperature] = (timings, ar)
    return out


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of `repeats` calls of `fn`, in ms, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)
