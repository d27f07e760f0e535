"""`StepClock` on an asynchronous device: the laps that wait (the forward) are charged the
device's queued work; the others are not synchronised, except in profiles (every lap)."""

from __future__ import annotations

import time

import pytest

from runtime import step_clock
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.sampling import SamplingParams
from runtime.speculation_policy import AFTER_PREFILL, SpeculationPolicy, StepStats
from runtime.step_clock import StepClock
from tests import toy_sampling


class SlowDevice:
    """Stands in for `torch.cuda.synchronize` (no GPU here): each call drains 20 ms of work."""

    def __init__(self) -> None:
        self.syncs = 0

    def __call__(self) -> None:
        self.syncs += 1
        time.sleep(0.02)


def test_the_forward_lap_waits_for_the_device_and_the_others_do_not() -> None:
    device = SlowDevice()
    clock = StepClock(device)
    clock.start()
    clock.lap("draft")
    forward = clock.lap("forward", wait=True)
    clock.lap("verify")
    assert device.syncs == 1
    assert forward >= 0.02  # the queued kernels are the forward's, not verification's
    profiling = StepClock(device, every_lap=True)
    profiling.start()
    for phase in ("draft", "forward", "verify"):
        profiling.lap(phase)
    assert device.syncs == 1 + 4  # start and every lap


def test_steady_plain_steps_leave_out_the_few_after_a_heavy_step() -> None:
    """`StepClock.steady_steps`: a plain decoding step counts as steady only when more than
    `AFTER_PREFILL` steps came after the last that prefilled or verified trees
    (`SpeculationPolicy.since_heavy`, as `EngineCore._step` asks it; the CPU runs the next
    few slow); every plain step counts in `plain_steps`."""
    clock, policy = StepClock(), SpeculationPolicy()
    kinds = [(True, False)] + [(False, False)] * 6 + [(False, True)] + [(False, False)] * 5
    steady = []
    for prefill, trees in kinds:
        clock.start()
        clock.lap("forward")
        clock.count_step(prefill)
        policy.observe(StepStats(2 if trees else 1, 0.001, prefill=prefill))
        if not prefill and not trees:
            before = clock.steady_steps
            clock.count_plain(steady=policy.since_heavy > AFTER_PREFILL)
            steady.append(clock.steady_steps > before)
    assert clock.plain_steps == 11
    assert steady == [False] * AFTER_PREFILL + [True] * 2 + [False] * AFTER_PREFILL + [True]
    assert clock.steady_ms() is not None and clock.plain_ms() is not None


def test_an_engines_plain_steps_after_its_prefill_are_steady_after_a_few() -> None:
    """The engine's wiring: one auto-regressive request of 12 tokens is a prefill step (its
    first token) and 11 plain steps, the first `AFTER_PREFILL` of them not steady."""
    engine = toy_sampling.toy_engine("redrafter", {})
    llm = LLMEngine(engine, RuntimeConfig())
    llm.generate([toy_sampling.PROMPT], [SamplingParams(max_tokens=12, ignore_eos=True)], "ar")
    assert llm.clock.plain_steps == 11
    assert llm.clock.steady_steps == 11 - AFTER_PREFILL


def test_a_nested_stretch_goes_to_its_phase_and_out_of_the_enclosing_lap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callbacks inside the commit lap (`EngineCore._notify`: `mark`, then `nested`) are
    the emit phase's time, not the commit's, and the step's total stays what it took."""
    now = [100.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    clock.start()
    now[0] += 1.0
    start = clock.mark()
    now[0] += 2.0
    clock.nested("emit", start)
    now[0] += 4.0
    clock.lap("commit")
    assert (clock.step["emit"], clock.step["commit"], clock.totals["emit"]) == (2.0, 5.0, 2.0)
