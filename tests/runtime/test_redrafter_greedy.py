"""Greedy ReDrafter on the bundled demo models is token-identical to the target's own
greedy decoding, on 32 held-out prompts, for several (W, L), batched and one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from build.engine import build_engine
from runtime import ar, redrafter
from runtime.engine import Engine
from runtime.engine_dir import BuildConfig
from runtime.sampling import SamplingParams
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
PARAMS = SamplingParams(max_tokens=32)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    out = tmp_path_factory.mktemp("engines") / "demo-redrafter"
    build = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024)
    return Engine.load(build_engine(MODELS / "demo-target", out, build, drafter=MODELS / "demo-redrafter"))


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode(t) for t in heldout_prompts(32)]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in ar.generate(engine, prompts, [PARAMS] * len(prompts))]


@pytest.mark.parametrize(("width", "length"), [(1, 3), (4, 4), (8, 5), (16, 2)])
def test_batched_greedy_equals_target(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]], width: int, length: int
) -> None:
    assert engine.drafter is not None
    results = redrafter.generate(
        engine, engine.drafter, prompts, [PARAMS] * len(prompts), redrafter.ReDrafterParams(width, length)
    )
    for i, r in enumerate(results):
        assert r.output_ids == reference[i], f"prompt {i} diverged at W={width} L={length}"
    steps = [a for r in results for a in r.accepted_per_step]
    assert sum(steps) / len(steps) > 0.3, "the trained drafter should get drafts accepted"


def test_mixed_lengths_in_one_batch(engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Rows finish at different steps (and may accept past max_tokens); the others go on."""
    assert engine.drafter is not None
    lengths = [3, 32, 9, 1, 17, 32, 5, 26]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    results = redrafter.generate_batch(engine, engine.drafter, prompts[:8], params, redrafter.ReDrafterParams(8, 5))
    for i, r in enumerate(results):
        assert r.output_ids == reference[i][: lengths[i]]


def test_one_by_one_greedy_equals_target(engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    assert engine.drafter is not None
    spec = redrafter.ReDrafterParams(4, 4)
    for i, prompt in enumerate(prompts):
        assert redrafter.generate_batch(engine, engine.drafter, [prompt], [PARAMS], spec)[0].output_ids == reference[i]
