"""Auto-regressive runtime on the bundled demo model: greedy output is token-identical to
`transformers` `generate(do_sample=False)`, for 24 held-out prompts of different lengths,
batched and one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from build.engine import build_engine
from runtime import llm_engine
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams
from tests.device import TEST_DEVICE
from training.corpus import heldout_prompts

DEMO_TARGET = Path(__file__).resolve().parents[2] / "models" / "demo-target"
MAX_NEW = 24


def generate(engine: LoadedEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
    return llm_engine.generate(engine, prompts, params, "ar")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LoadedEngine:
    out = tmp_path_factory.mktemp("engines") / "demo"
    return LoadedEngine.load(
        build_engine(DEMO_TARGET, out, BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024)),
        device=TEST_DEVICE,
    )


@pytest.fixture(scope="module")
def reference(engine: LoadedEngine) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and transformers' greedy continuations (stop token included, as HF returns it),
    computed on the test device like the engine's."""
    hf = transformers.LlamaForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval().to(TEST_DEVICE)
    prompts = [engine.encode(text) for text in heldout_prompts(24)]
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            ids_t = torch.tensor([ids], device=TEST_DEVICE)
            out = hf.generate(ids_t, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        outputs.append(out[0, len(ids) :].tolist())
    return prompts, outputs


def with_stop(result_ids: list[int], finish_reason: str, eos: int) -> list[int]:
    return [*result_ids, eos] if finish_reason == "stop" else result_ids


def test_prompts_have_varied_lengths(reference: tuple[list[list[int]], list[list[int]]]) -> None:
    lengths = sorted(len(p) for p in reference[0])
    assert len(lengths) >= 20 and lengths[0] < 40 and lengths[-1] > 150


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
def test_greedy_matches_transformers(
    engine: LoadedEngine, reference: tuple[list[list[int]], list[list[int]]], batched: bool
) -> None:
    prompts, expected = reference
    params = SamplingParams(max_tokens=MAX_NEW)
    if batched:
        results = generate(engine, prompts, [params] * len(prompts))
    else:
        results = [generate(engine, [p], [params])[0] for p in prompts]
    eos = engine.eos_token_ids[0]
    for i, r in enumerate(results):
        assert with_stop(r.output_ids, r.finish_reason, eos) == expected[i], f"prompt {i} diverged"


def test_seeded_sampling_does_not_depend_on_batch(engine: LoadedEngine) -> None:
    prompts = [engine.encode(t) for t in heldout_prompts(3)]
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    together = generate(engine, prompts, params)
    alone = [generate(engine, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]


def test_limits_are_enforced_with_clear_errors(engine: LoadedEngine) -> None:
    with pytest.raises(ValueError, match="max_input_len 512"):
        generate(engine, [[1] * 513], [SamplingParams()])
    with pytest.raises(ValueError, match="max_seq_len 1024"):
        generate(engine, [[1] * 100], [SamplingParams(max_tokens=1000)])
    with pytest.raises(ValueError, match="empty prompt"):
        generate(engine, [[]], [SamplingParams()])
