"""Greedy ReDrafter on the bundled demo models is token-identical to the target's own
greedy decoding, on 32 held-out prompts, for several (W, L), with in-flight batching
(8 running at a time, requests joining as others finish) and one by one; and so is it on a
4-bit head (`--drafter-head int4`, the demo engine's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from build.engine import build_engine
from plugins.int8_linear import nibbles
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from tests.device import TEST_DEVICE
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
PARAMS = SamplingParams(max_tokens=32)
FIXED = RuntimeConfig(speculation="fixed")  # every step drafts the full (W, L)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LoadedEngine:
    out = tmp_path_factory.mktemp("engines") / "demo-redrafter"
    build = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024)
    engine_dir = build_engine(MODELS / "demo-target", out, build, drafter=MODELS / "demo-redrafter")
    return LoadedEngine.load(engine_dir, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def prompts(engine: LoadedEngine) -> list[list[int]]:
    return [engine.encode(t) for t in heldout_prompts(32)]


@pytest.fixture(scope="module")
def reference(engine: LoadedEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in llm_engine.generate(engine, prompts, [PARAMS] * len(prompts), "ar")]


@pytest.mark.parametrize(("width", "length"), [(1, 3), (4, 4), (8, 5), (16, 2)])
def test_batched_greedy_equals_target(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]], width: int, length: int
) -> None:
    results = llm_engine.generate(
        engine, prompts, [PARAMS] * len(prompts), "redrafter", FIXED, beam_width=width, beam_length=length
    )
    for i, r in enumerate(results):
        assert r.output_ids == reference[i], f"prompt {i} diverged at W={width} L={length}"
    steps = [a for r in results for a in r.accepted_per_step]
    assert sum(steps) / len(steps) > 0.3, "the trained drafter should get drafts accepted"


def test_mixed_lengths_in_one_batch(engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Rows finish at different steps (and may accept past max_tokens); the others go on."""
    lengths = [3, 32, 9, 1, 17, 32, 5, 26]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    results = llm_engine.generate(engine, prompts[:8], params, "redrafter", FIXED, beam_width=8, beam_length=5)
    for i, r in enumerate(results):
        assert r.output_ids == reference[i][: lengths[i]]


def test_one_by_one_greedy_equals_target(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    for i, prompt in enumerate(prompts):
        result = llm_engine.generate(engine, [prompt], [PARAMS], "redrafter", FIXED, beam_width=4, beam_length=4)[0]
        assert result.output_ids == reference[i]


def test_without_packing_greedy_equals_target_and_verifies_every_beam(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """`packing=False` (dynamic tree attention off) verifies 1 + W * L nodes per step, accepts
    exactly what the packed tree accepts (the same beams), and stays token-identical."""
    spec = {"beam_width": 4, "beam_length": 4}
    params = [PARAMS] * 8
    packed = llm_engine.generate(engine, prompts[:8], params, "redrafter", FIXED, **spec)
    plain = llm_engine.generate(engine, prompts[:8], params, "redrafter", FIXED, packing=False, **spec)
    for i, (a, b) in enumerate(zip(packed, plain, strict=True)):
        assert b.output_ids == reference[i]
        assert b.accepted_per_step == a.accepted_per_step
        assert b.num_drafted == 16 * len(b.accepted_per_step) > a.num_drafted


@pytest.mark.parametrize(("width", "length"), [(1, 5), (4, 4)])
def test_a_4_bit_head_changes_proposals_not_output(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]], width: int, length: int, tmp_path: Path
) -> None:
    build = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, drafter_head="int4")
    out = build_engine(MODELS / "demo-target", tmp_path / "int4", build, drafter=MODELS / "demo-redrafter")
    four = LoadedEngine.load(out, device=TEST_DEVICE)
    assert four.redrafter is not None
    head = four.redrafter.lm_head[-1].int8
    if TEST_DEVICE == "cpu" and head is not None and head.kernel is not None:
        assert head.kernel.weight.abs().max() <= 7
        assert nibbles() == (head.kernel.blocked.dtype == torch.uint8)  # two weights a byte under VNNI
    results = llm_engine.generate(
        four, prompts, [PARAMS] * len(prompts), "redrafter", FIXED, beam_width=width, beam_length=length
    )
    assert [r.output_ids for r in results] == reference
    drafts = [a for r in results for a in r.accepted_per_step]
    assert sum(drafts) / len(drafts) > 0.3
