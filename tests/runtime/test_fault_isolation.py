"""One failing request cannot take the engine down, nor change anyone else's output.

Faults are injected by seed (`runtime/faults.py`) into real engines stepping real batches:
the victim ends with finish reason "error" and a message naming the fault, every other
request's greedy output stays token-identical to auto-regressive decoding, and no KV block
is left in use. A fault of a whole step fails everything in flight but the engine serves
the next requests; a fault that keeps coming back makes the engine dead, and it says so."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from build.engine import build_engine
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.faults import SLOW_S, FaultInjector
from runtime.llm_engine import MAX_STEP_FAILURES, EngineDeadError, LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from tests.device import TEST_DEVICE
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILD = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512)
MAX_TOKENS = 20
VICTIM_SEED = 7
FIXED = RuntimeConfig(speculation="fixed")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedEngine]:
    root = tmp_path_factory.mktemp("engines")
    return {
        "rnn": LoadedEngine.load(
            build_engine(MODELS / "demo-target", root / "rnn", BUILD, drafter=MODELS / "demo-redrafter"),
            device=TEST_DEVICE,
        ),
        "draft-lm": LoadedEngine.load(
            build_engine(MODELS / "demo-target", root / "lm", BUILD, draft_model=MODELS / "demo-draft-lm"),
            device=TEST_DEVICE,
        ),
    }


@pytest.fixture(scope="module")
def prompts(engines: dict[str, LoadedEngine]) -> list[list[int]]:
    return [engines["rnn"].encode(t) for t in heldout_prompts(6)]


@pytest.fixture(scope="module")
def reference(engines: dict[str, LoadedEngine], prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    return [r.output_ids for r in llm_engine.generate(engines["rnn"], prompts, params, "ar")]


def with_victim(n: int, victim: int) -> list[SamplingParams]:
    """Greedy requests; the victim's seed (meaningless for greedy) marks it for the fault."""
    return [SamplingParams(max_tokens=MAX_TOKENS, seed=VICTIM_SEED if i == victim else None) for i in range(n)]


@pytest.mark.parametrize(
    ("stage", "drafter", "method"),
    [
        ("draft", "rnn", "redrafter"),
        ("draft", "draft-lm", "rsd-s"),
        ("draft", "draft-lm", "sd"),
        ("verify", "rnn", "redrafter"),
        ("verify", "draft-lm", "rsd-c"),
        ("sample", "rnn", "redrafter"),
    ],
)
def test_a_fault_ends_only_its_request(
    engines: dict[str, LoadedEngine],
    prompts: list[list[int]],
    reference: list[list[int]],
    stage: str,
    drafter: str,
    method: str,
) -> None:
    llm = LLMEngine(engines[drafter], FIXED)
    llm.faults = FaultInjector({stage: frozenset({VICTIM_SEED})})
    victim = 2
    results = llm.generate(prompts, with_victim(len(prompts), victim), method)
    assert results[victim].finish_reason == "error"
    assert results[victim].error is not None and f"fault injected at {stage}" in results[victim].error
    for i, r in enumerate(results):
        if i != victim:
            assert r.finish_reason in ("length", "stop") and r.output_ids == reference[i], f"request {i} changed"
    assert llm.blocks.num_used == 0 and not llm.has_unfinished()
    assert sum(r.num_drafted for r in results) > 0, "the others kept speculating"


def test_a_failed_forward_fails_its_step_and_the_engine_goes_on(
    engines: dict[str, LoadedEngine], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLMEngine(engines["rnn"], FIXED)
    llm.faults = FaultInjector({"forward": frozenset({VICTIM_SEED})})
    failed = llm.generate(prompts[:3], with_victim(3, 1), "redrafter")
    assert [r.finish_reason for r in failed] == ["error"] * 3  # all three share the victim's first forward
    assert all(r.error and "fault injected at forward" in r.error for r in failed)
    assert llm.blocks.num_used == 0
    again = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts), "redrafter")
    assert [r.output_ids for r in again] == reference


def test_a_failed_step_fails_everything_in_flight_then_serving_resumes(
    engines: dict[str, LoadedEngine], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLMEngine(engines["rnn"], RuntimeConfig(speculation="fixed", max_batch_size=3))
    llm.faults = FaultInjector({"step": frozenset({VICTIM_SEED})})
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    running = [llm.add_request(p, long) for p in prompts[:2]]
    for _ in range(3):
        llm.step()
    victim = llm.add_request(prompts[2], SamplingParams(max_tokens=MAX_TOKENS, seed=VICTIM_SEED))
    waiting = llm.add_request(prompts[3], long)  # no batch slot left: it waits
    finished = llm.step()
    assert {r.request_id for r in finished} == {r.request_id for r in [*running, victim, waiting]}
    assert all(r.result.finish_reason == "error" for r in finished), "running and waiting requests all fail"
    assert all("fault injected at step" in (r.result.error or "") for r in finished)
    assert llm.blocks.num_used == 0 and llm.dead is None
    again = llm.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts), "redrafter")
    assert [r.output_ids for r in again] == reference


def test_a_fault_that_keeps_failing_every_step_makes_the_engine_dead(
    engines: dict[str, LoadedEngine], prompts: list[list[int]]
) -> None:
    llm = LLMEngine(engines["rnn"], FIXED)
    llm.faults = FaultInjector({"step": frozenset({VICTIM_SEED})})
    victim = SamplingParams(max_tokens=MAX_TOKENS, seed=VICTIM_SEED)
    for _ in range(MAX_STEP_FAILURES - 1):
        request = llm.add_request(prompts[0], victim)
        assert request in llm.step() and request.result.finish_reason == "error"
    last = llm.add_request(prompts[0], victim)
    with pytest.raises(EngineDeadError, match="every step fails"):
        llm.step()
    assert last.result.finish_reason == "error"
    with pytest.raises(EngineDeadError, match="restart the server"):
        llm.add_request(prompts[1], SamplingParams(max_tokens=4))
    with pytest.raises(EngineDeadError):
        llm.step()


def test_a_slow_fault_slows_each_step_of_its_request_and_changes_nothing(
    engines: dict[str, LoadedEngine], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """What the serving tests lean on to cancel a request before it can finish."""
    llm = LLMEngine(engines["rnn"], FIXED)
    llm.faults = FaultInjector({"slow": frozenset({VICTIM_SEED})})
    start = time.monotonic()
    results = llm.generate(prompts, with_victim(len(prompts), 1), "redrafter")
    elapsed = time.monotonic() - start
    assert [r.output_ids for r in results] == reference
    assert results[1].num_forwards > 1 and elapsed >= results[1].num_forwards * SLOW_S


def test_fault_spec_from_the_environment() -> None:
    faults = FaultInjector.from_env({"SPECPIPE_INJECT_FAULTS": "draft:7, verify:8,draft:9"})
    assert faults.seeds == {"draft": frozenset({7, 9}), "verify": frozenset({8})}
    assert not FaultInjector.from_env({}).seeds
    with pytest.raises(ValueError, match="<stage>:<seed>"):
        FaultInjector.from_env({"SPECPIPE_INJECT_FAULTS": "drafting:7"})
