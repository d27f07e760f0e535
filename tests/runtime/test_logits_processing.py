"""Penalties, min_tokens and bad words keep speculation exact: every tree node is verified
with the logits auto-regression would have seen after that node's own path.

Oracle: `reference_logits`, a plain one-row transcription of the definitions
(`SamplingParams` docstrings), applied to the history of one token at a time. Tests of the
tests: the same checks with each node given the root's history (the plausible bug: one
penalty per request and step) fail."""

from __future__ import annotations

import random

import pytest
import torch

from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.logits_processing import process_logits, token_log_probs
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from tests import toy_sampling
from tests.stats import chi_square, passes_chi_square


def reference_logits(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int], stop_ids: set[int]
) -> torch.Tensor:
    """The next token's logits after `prompt + generated`, one definition at a time."""
    out = logits.float().clone()
    if len(generated) < params.min_tokens:
        for t in stop_ids:
            out[t] = float("-inf")
    history = prompt + generated
    for word in params.bad_words:
        before = list(word[:-1])
        if not before or (len(history) >= len(before) and history[len(history) - len(before) :] == before):
            out[word[-1]] = float("-inf")
    for t in set(history):
        if params.repetition_penalty != 1.0:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t in set(generated):
        out[t] -= params.frequency_penalty * generated.count(t) + params.presence_penalty
    return out


def random_tree(rng: random.Random, size: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(n) for n in range(1, size)]  # parents before children
    return DraftTree([rng.randrange(vocab) for _ in range(size)], parents)


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """Drafted tokens from the root's child down to `node`."""
    out = []
    while node > 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


PARAMS = SamplingParams(
    min_tokens=7,
    repetition_penalty=1.4,
    presence_penalty=0.6,
    frequency_penalty=0.35,
    bad_words=((3,), (1, 2), (4, 4, 5)),
)


@pytest.mark.parametrize("seed", range(5))
def test_every_tree_node_gets_the_logits_of_its_own_path(seed: int) -> None:
    rng = random.Random(seed)
    vocab, prompt, stop = 8, [rng.randrange(8) for _ in range(5)], {0, 6}
    output = [rng.randrange(vocab) for _ in range(5)]  # its last one is the root
    tree = random_tree(rng, 14, vocab)
    tree.tokens[0] = output[-1]
    logits = torch.randn(len(tree.tokens), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    got = process_logits(logits, PARAMS, prompt, output, stop, tree)
    paths = [output + path_tokens(tree, j) for j in range(len(tree.tokens))]
    want = torch.stack(
        [reference_logits(row, PARAMS, prompt, path, stop) for row, path in zip(logits, paths, strict=True)]
    )
    torch.testing.assert_close(got, want)
    # test of the test: the root's history for every node is wrong on the deeper nodes
    root_only = torch.stack([reference_logits(row, PARAMS, prompt, output, stop) for row in logits])
    assert not torch.equal(root_only[1:], want[1:])


def test_the_first_token_after_the_prompt() -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    prompt = [4, 4, 1, 2, 3]
    got = process_logits(logits, PARAMS, prompt, [], {0}, None)
    torch.testing.assert_close(got[0], reference_logits(logits[0], PARAMS, prompt, [], {0}))
    assert got[0, 0] == float("-inf") and got[0, 3] == float("-inf")  # min_tokens; a one-token bad word
    assert token_log_probs(got, [5])[0] == pytest.approx(float(torch.log_softmax(got[0], -1)[5]))


def oracle_greedy(engine: object, prompt: list[int], params: SamplingParams, stop_ids: set[int]) -> list[int]:
    """Auto-regression by hand: the whole sequence through the target every token."""
    target = engine.model  # type: ignore[attr-defined]
    device = target.lm_head.weight.device
    generated: list[int] = []
    while len(generated) < params.max_tokens:
        ids = prompt + generated
        with torch.no_grad():
            logits = target(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None]).logits
        token = int(reference_logits(logits[0, -1].cpu(), params, prompt, generated, stop_ids).argmax())
        if token in stop_ids:
            break
        generated.append(token)
    return generated


SETTINGS = {"beam_width": 3, "beam_length": 3, "branching": (2, 2, 1)}
GREEDY = SamplingParams(
    max_tokens=12, min_tokens=4, stop_token_ids=(2,), ignore_eos=True,
    repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, bad_words=((1, 3), (0, 0)),
)  # fmt: skip


@pytest.mark.parametrize(
    ("drafter", "method"),
    [
        ("draft-lm", "rsd-s"),
        ("draft-lm", "rsd-c"),
        ("redrafter", "redrafter"),
        ("redrafter", "ngram"),
        ("lyanna", "lyanna"),
    ],
)
def test_greedy_speculation_with_penalties_equals_auto_regression(drafter: str, method: str) -> None:
    engine = toy_sampling.toy_engine(drafter, SETTINGS)
    prompts = [[1 + i % 3, 3, 2, i % 4] for i in range(8)]
    config = RuntimeConfig(max_num_tokens=512, speculation="fixed")
    spec = llm_engine.generate(engine, prompts, [GREEDY] * len(prompts), method, config)
    ar = llm_engine.generate(engine, prompts, [GREEDY] * len(prompts), "ar", config)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert sum(r.num_accepted for r in spec) > 0, "drafts must get accepted for the comparison to mean anything"
    oracle = [oracle_greedy(engine, p, GREEDY, {2}) for p in prompts[:3]]
    assert [r.output_ids for r in ar[:3]] == oracle
    plain = llm_engine.generate(engine, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 8, "ar", config)
    assert [r.output_ids for r in plain] != [r.output_ids for r in ar], "the penalties must change the output"


def test_log_probs_are_the_same_under_speculation() -> None:
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS)
    prompts = [[1, 3, 2, 0], [2, 3, 2, 1]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, repetition_penalty=1.3)] * 2
    config = RuntimeConfig(max_num_tokens=512, speculation="fixed")
    spec = llm_engine.generate(engine, prompts, params, "rsd-s", config)
    ar = llm_engine.generate(engine, prompts, params, "ar", config)
    for s, a in zip(spec, ar, strict=True):
        assert s.output_ids == a.output_ids and len(s.output_log_probs) == len(s.output_ids)
        assert s.output_log_probs == pytest.approx(a.output_log_probs, abs=1e-5)
        assert all(lp <= 0 for lp in s.output_log_probs) and s.cum_log_prob == pytest.approx(sum(a.output_log_probs))


SAMPLED = SamplingParams(
    temperature=0.9, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4, bad_words=((1, 3),)
)
TRIALS = 8000


def _penalized(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
    return reference_logits(logits, SAMPLED, toy_sampling.PROMPT, generated, set())


@pytest.mark.parametrize("method", ["rsd-s", pytest.param("redrafter", marks=pytest.mark.slow)])
def test_sampled_speculation_with_penalties_follows_the_penalized_law(method: str) -> None:
    drafter = "draft-lm" if method.startswith("rsd") else "redrafter"
    engine = toy_sampling.toy_engine(drafter, {"beam_width": 3, "beam_length": 2, "branching": (3, 2)})
    counts = toy_sampling.emitted_first_three(engine, SAMPLED, method, trials=TRIALS)
    law = toy_sampling.exact_first_three(engine.model, SAMPLED, _penalized)
    assert passes_chi_square(counts, law), chi_square(counts, law)
    # tests of the test: the unpenalized law, and the law with each token penalized only for
    # the tokens before the step's root (what verifying every node with the root's logits
    # samples from), are both rejected
    unpenalized = toy_sampling.exact_first_three(engine.model, SamplingParams(temperature=SAMPLED.temperature))
    first_only = toy_sampling.exact_first_three(engine.model, SAMPLED, lambda row, g: _penalized(row, g[:1]))
    for wrong in (unpenalized, first_only):
        impossible = bool((counts[wrong == 0] > 0).any())  # e.g. a bad word it does not mask was emitted
        assert impossible or not passes_chi_square(counts, wrong)
