"""Greedy (temperature 0) RSD, SD and draft-LM beams on the bundled demo models are
token-identical to the target's own greedy decoding: 24 held-out prompts, 8 running at a
time with requests joining as others finish, with the ReDrafter RNN drafter and with the
distilled draft LM (its own paged KV cache)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from build.engine import build_engine
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from runtime.speculation_policy import draft_fit
from tests.device import TEST_DEVICE
from tests.policy_spy import spy_on
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
PARAMS = SamplingParams(max_tokens=32)
FIXED = RuntimeConfig(speculation="fixed")
BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedEngine]:
    out = tmp_path_factory.mktemp("engines")
    target = MODELS / "demo-target"
    return {
        "rnn": LoadedEngine.load(
            build_engine(target, out / "rnn", BUILD, drafter=MODELS / "demo-redrafter"), device=TEST_DEVICE
        ),
        "draft-lm": LoadedEngine.load(
            build_engine(target, out / "lm", BUILD, draft_model=MODELS / "demo-draft-lm"), device=TEST_DEVICE
        ),
    }


@pytest.fixture(scope="module")
def prompts(engines: dict[str, LoadedEngine]) -> list[list[int]]:
    return [engines["rnn"].encode(t) for t in heldout_prompts(24)]


@pytest.fixture(scope="module")
def reference(engines: dict[str, LoadedEngine], prompts: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in llm_engine.generate(engines["rnn"], prompts, [PARAMS] * len(prompts), "ar")]


@pytest.mark.parametrize(
    ("drafter", "method", "settings"),
    [
        ("rnn", "sd", {"beam_length": 4}),
        ("rnn", "rsd-c", {"branching": (2, 2, 1, 1)}),
        ("rnn", "rsd-s", {"beam_width": 4, "beam_length": 4}),
        ("draft-lm", "sd", {"beam_length": 5}),
        ("draft-lm", "rsd-c", {"branching": (3, 2, 1)}),
        ("draft-lm", "rsd-s", {"beam_width": 3, "beam_length": 4}),
        ("draft-lm", "redrafter", {"beam_width": 4, "beam_length": 3}),
    ],
)
def test_batched_greedy_equals_target(
    engines: dict[str, LoadedEngine],
    prompts: list[list[int]],
    reference: list[list[int]],
    drafter: str,
    method: str,
    settings: dict[str, Any],
) -> None:
    results = llm_engine.generate(engines[drafter], prompts, [PARAMS] * len(prompts), method, FIXED, **settings)
    for i, r in enumerate(results):
        assert r.output_ids == reference[i], f"prompt {i} diverged ({drafter}, {method}, {settings})"
    steps = [a for r in results for a in r.accepted_per_step]
    assert sum(steps) / len(steps) > 0.5, "the trained drafters should get drafts accepted"


@pytest.mark.parametrize(("method", "settings"), [("sd", {"beam_length": 5}), ("rsd-c", {"branching": (3, 2, 1)})])
def test_greedy_requests_batched_with_sampled_ones_equal_target(
    engines: dict[str, LoadedEngine],
    prompts: list[list[int]],
    reference: list[list[int]],
    method: str,
    settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy and sampled requests of one draft-LM method in one batch draft in a call each
    (`LevelTreeProposer.cost_paths`: their drafting paths are apart), greedy ones still the
    target's own greedy output; each call's timing is handed to the policy as its own fit's."""
    n = 12
    params = [PARAMS if i % 2 == 0 else SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(n)]
    llm = llm_engine.LLMEngine(engines["draft-lm"], FIXED)
    calls: Counter[str] = Counter()  # drafting calls handed to the policy, by fit (a fixed one learns no prices)
    spy_on(monkeypatch, llm.policy, "observe", lambda stats: calls.update(stats.drafting.keys()))
    results = llm.generate(prompts[:n], params, method, **settings)
    for i in range(0, n, 2):
        assert results[i].output_ids == reference[i], f"greedy prompt {i} diverged beside sampled ones ({method})"
    proposer = llm.proposers[method]
    spec = proposer.params(method, settings)
    fits = {sampled: draft_fit(method, proposer.cost_paths(spec, sampled)[-1]) for sampled in (False, True)}
    assert fits[False] != fits[True] and set(calls) == set(fits.values())  # fixed: the largest tree
    assert all(calls[fit] > 1 for fit in fits.values())
