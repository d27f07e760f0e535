"""Prompt-lookup (n-gram) decoding: the lookup itself, greedy output token-identical to
auto-regression on a target-only engine (held-out prompts), and sampled output following
the target's law (chi-square against the exact law), with a wrong verification of its
drafts failing the same test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from build.engine import build_engine
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.ngram import NgramParams, NgramProposer, lookup
from runtime.results import tokens_per_step
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from tests import toy_sampling
from tests.device import TEST_DEVICE
from tests.stats import passes_chi_square
from training.corpus import heldout_prompts

DEMO_TARGET = Path(__file__).resolve().parents[2] / "models" / "demo-target"


def test_lookup_takes_the_latest_match_of_the_longest_suffix() -> None:
    params = NgramParams(num_draft_tokens=2, max_ngram=3, min_ngram=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert lookup(tokens, params) == [8, 2]  # (5, 6) last seen at 4 -> 8, 2 (not 7, 1 from 0)
    assert lookup([1, 2, 3, 1, 2, 3, 4, 9, 2, 3], params) == [4, 9]  # (2, 3): latest earlier match, 3-gram none
    assert lookup([1, 2, 3], params) == []  # nothing repeats
    assert lookup([4, 4], params) == [4]  # the match may overlap the suffix; the draft stops at the end
    assert lookup([1, 2, 9, 2], NgramParams(min_ngram=2)) == []  # a 1-gram match is too short


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="method 'ngram' takes"):
        toy = toy_sampling.toy_engine("redrafter", {})
        llm_engine.LLMEngine(toy, RuntimeConfig(max_batch_size=1)).add_request(
            [1, 2], SamplingParams(max_tokens=4), "ngram", beam_width=2
        )


@pytest.fixture(scope="module")
def target_only(tmp_path_factory: pytest.TempPathFactory) -> LoadedEngine:
    out = tmp_path_factory.mktemp("engines") / "demo"
    return LoadedEngine.load(build_engine(DEMO_TARGET, out, BuildConfig(max_batch_size=8)), device=TEST_DEVICE)


def test_greedy_ngram_equals_autoregressive_on_a_target_only_engine(target_only: LoadedEngine) -> None:
    prompts = [target_only.encode(text) for text in heldout_prompts(8)]
    params = [SamplingParams(max_tokens=32)] * len(prompts)
    drafting = RuntimeConfig(speculation="fixed")  # always draft, so the test means something whatever the timings
    ngram = llm_engine.generate(target_only, prompts, params, "ngram", drafting)
    ar = llm_engine.generate(target_only, prompts, params, "ar")
    assert [r.output_ids for r in ngram] == [r.output_ids for r in ar]
    assert sum(r.num_accepted for r in ngram) > 0, "some drafts must be accepted for the test to mean anything"
    assert tokens_per_step(ngram) > 1.0


# ~2 min on 2 cores: ngram's point-mass drafts go through the verifier redrafter's default-suite test covers
@pytest.mark.slow
def test_sampled_ngram_follows_target_distribution() -> None:
    engine = toy_sampling.toy_engine("redrafter", {})  # ngram ignores the drafter: any engine runs it
    params = SamplingParams(temperature=1.0)
    counts = toy_sampling.emitted_first_three(engine, params, "ngram")
    assert passes_chi_square(counts, toy_sampling.exact_first_three(engine.model, params))


@pytest.mark.slow
def test_ngram_drafts_verified_as_sampled_fail_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claiming the lookup's drafts were drawn from a uniform law (they were not) breaks the law."""
    real = NgramProposer.propose

    def claim_uniform(self: NgramProposer, requests: list, budgets: list[int]) -> list[DraftTree]:
        trees = real(self, requests, budgets)
        for tree in trees:
            if len(tree.tokens) > 1:
                tree.draft_probs = torch.full((len(tree.tokens), toy_sampling.V), 0.25)
                tree.sampled = True
        return trees

    monkeypatch.setattr(NgramProposer, "propose", claim_uniform)
    engine = toy_sampling.toy_engine("redrafter", {})
    params = SamplingParams(temperature=1.0)
    counts = toy_sampling.emitted_first_three(engine, params, "ngram")
    assert not passes_chi_square(counts, toy_sampling.exact_first_three(engine.model, params))
