"""RSD-C, RSD-S and SD are exactly lossless under sampling, through the production loop,
with both drafters (the ReDrafter RNN and a draft LM with its own paged cache) and with
temperature + top-p applied to draft and target alike.

Same protocol as `test_redrafter_sampling.py`: the first three tokens of 20,000 seeded
requests in flight together (the prefill token, then one or two speculative steps of
2-level trees) are chi-square tested (p = 0.001, 64 cells) against the target's exact
sequence law. Test of the test: the same run with the draft law not renormalised after
a rejection (a plausible bug in recursive rejection sampling) is rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from plugins.cpu_linear import int8_available
from plugins.int8_linear import vectorized
from plugins.llama_forward import Int8DraftLM
from runtime import llm_engine, verify
from runtime.config import RuntimeConfig
from runtime.proposers import level_drafters, rsd
from runtime.proposers.level_drafters import DraftLMLevels
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams
from tests import toy_sampling
from tests.device import TEST_DEVICE
from tests.stats import chi_square, passes_chi_square

SETTINGS = {"beam_width": 3, "beam_length": 2, "branching": (3, 2)}
PARAMS = SamplingParams(temperature=0.9, top_p=0.9)


# the draft LM exercises the most code (its own cache, catch-up, compaction); the RNN runs
# the same verifier, so its three runs (~1 min each) are in the slow suite
@pytest.mark.parametrize("drafter", [pytest.param("redrafter", marks=pytest.mark.slow), "draft-lm"])
# SD (a one-child-per-level chain of RSD-C's code path) runs in the slow suite
@pytest.mark.parametrize("method", ["rsd-c", "rsd-s", pytest.param("sd", marks=pytest.mark.slow)])
def test_rsd_follows_target_distribution(method: str, drafter: str) -> None:
    engine = toy_sampling.toy_engine(drafter, SETTINGS)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, method)
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    assert passes_chi_square(counts, law), chi_square(counts, law)


def test_rsd_s_chains_drafted_as_draws_follow_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stochastic beam is drafted as a chain of draws from the draft law (sd's path in
    `draft_rsd_trees`, no beam step): the law Gumbel-top-1 of its one path draws from, so
    the output is still the target's (load-aware rsd-s drafts these chains most). Test of
    the test: the chain taken as one beam's top path without its Gumbels (the likeliest
    child, verified as if drawn) is rejected."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS | {"beam_width": 1})
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "rsd-s")
    assert passes_chi_square(counts, law), chi_square(counts, law)
    monkeypatch.setattr(rsd, "draw_rows", lambda probs, gens: probs.argmax(-1))  # the tree code's draws
    monkeypatch.setattr(rsd, "inverse_cdf_rows", lambda probs, u: probs.argmax(-1))  # a chain a level a call's (GPU)
    assert not passes_chi_square(toy_sampling.emitted_first_three(engine, PARAMS, "rsd-s"), law)


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not int8_available(), reason="int8 drafters run on the CPU with fbgemm")
def test_rsd_with_an_int8_draft_lm_follows_target_distribution() -> None:
    """Built engines run their drafter's linears in int8 (`BuildConfig.drafter_layers`):
    the draft law verification divides by is then the int8 drafter's own, and the output
    is still the target's law. Its forward is the one C++ call (`plugins/llama_forward.py`),
    whose logits are the law drafts are drawn from and divided by."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS, int8=True)
    assert engine.draft_model is not None
    assert (Int8DraftLM.of(engine.draft_model) is not None) == vectorized()  # the op where it runs
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "rsd-s")
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    assert passes_chi_square(counts, law), chi_square(counts, law)


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not vectorized(), reason="the draft LM's C++ chain op runs on the CPU")
def test_sampled_chains_a_level_per_call_follow_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """sd through an int8 draft LM, under a top-p warp (which the one-call op does not
    take), drafts its chains a level per C++ call (`rsd._sampled_chains`,
    `specpipe_cpu::draft_lm_chain_level`): the output is still the target's law. Test of
    the test: the same chains with each level's likeliest token in place of a draw
    (verified as if drawn) are rejected."""
    chained = []
    real = rsd._sampled_chains
    monkeypatch.setattr(rsd, "_sampled_chains", lambda *a: chained.append(1) or real(*a))
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS, int8=True)
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "sd")
    assert chained and passes_chi_square(counts, law), chi_square(counts, law)
    monkeypatch.setattr(rsd, "inverse_cdf_rows", lambda probs, u: probs.argmax(-1))
    assert not passes_chi_square(toy_sampling.emitted_first_three(engine, PARAMS, "sd"), law)


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not vectorized(), reason="the draft LM's C++ chain op runs on the CPU")
def test_sampled_chains_in_one_call_follow_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """sd through an int8 draft LM at a temperature alone drafts each step's chains in one
    C++ call (`specpipe_cpu::draft_lm_sampled_chain`: warp, draw and next level inside):
    the output is still the target's law. Test of the test: the same op fed uniforms of 0
    (each level's first token of non-zero mass, verified as if drawn) is rejected."""
    params = SamplingParams(temperature=0.9)
    calls = []
    real = DraftLMLevels.sampled_chain

    def counted(self: DraftLMLevels, *args: object) -> object:
        out = real(self, *args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DraftLMLevels, "sampled_chain", counted)
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS, int8=True)
    law = toy_sampling.exact_first_three(engine.model, params)
    counts = toy_sampling.emitted_first_three(engine, params, "sd")
    assert calls and all(calls) and passes_chi_square(counts, law), chi_square(counts, law)

    def at_zero(self: DraftLMLevels, first: torch.Tensor, levels: list[int], t: list[float], u: torch.Tensor) -> object:
        return real(self, first, levels, t, torch.zeros_like(u))

    monkeypatch.setattr(DraftLMLevels, "sampled_chain", at_zero)
    assert not passes_chi_square(toy_sampling.emitted_first_three(engine, params, "sd"), law)


def test_unnormalised_draft_law_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    def without_renormalising(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        accept_prob, q_next, _ = real_step(q, p, x)
        return accept_prob, q_next, p.scatter(-1, x[..., None], 0.0)

    real_step = verify.rejection_step
    monkeypatch.setattr(verify, "rejection_step", without_renormalising)
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "rsd-c")
    assert not passes_chi_square(counts, toy_sampling.exact_first_three(engine.model, PARAMS))


def sd_runs(temperature: float) -> Callable[[], list[GenerationResult]]:
    """A run of 48 seeded sd requests of 12 tokens at `temperature` on the toy engine's int8
    draft LM (its forward the one C++ call built engines make), fixed speculation."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS, int8=True)
    n = 48
    params = [SamplingParams(temperature=temperature, max_tokens=12, seed=i, ignore_eos=True) for i in range(n)]
    config = RuntimeConfig(speculation="fixed", max_num_tokens=16 * n, max_queue_size=n)
    return lambda: llm_engine.generate(engine, [toy_sampling.PROMPT] * n, params, "sd", config)


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not vectorized(), reason="the draft LM's C++ chain ops run on the CPU")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chains_fed_from_the_roots_draft_what_first_and_chain_draft(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DraftLMLevels.feeds_roots`: where every request's catch-up is its root alone, sd's
    chains (greedy: `draft_lm_chain`; sampled at a temperature alone:
    `draft_lm_sampled_chain`) feed the roots as their first level in place of `first`'s
    forward. The roots' logits and K/V are the same bits, so the drafts are the same (every
    request accepts as many) and the output is the same, token for token and seed for
    seed, as with `first`; the roots' path ran. Roots fed one position early draft other
    chains."""
    generate = sd_runs(temperature)
    real = DraftLMLevels.feeds_roots
    fed: list[bool] = []

    def counted(self: DraftLMLevels) -> bool:
        fed.append(real(self))
        return fed[-1]

    monkeypatch.setattr(DraftLMLevels, "feeds_roots", counted)
    rooted = generate()
    monkeypatch.setattr(DraftLMLevels, "feeds_roots", lambda self: False)
    plain = generate()
    assert any(fed) and not all(fed)  # steady steps from the roots; first drafts (a prompt to read) not
    assert [r.output_ids for r in rooted] == [r.output_ids for r in plain]
    assert [r.num_accepted for r in rooted] == [r.num_accepted for r in plain]
    assert sum(r.num_accepted for r in rooted) > len(rooted)  # drafts were accepted: the chains mattered
    fed_at, sampled_chain = DraftLMLevels._roots_fed, Int8DraftLM.sampled_chain

    def early_roots(self: Int8DraftLM, first: object, roots: object, starts: list[int], *rest: object) -> object:
        return sampled_chain(self, first, roots, [s - (roots is not None) for s in starts], *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(DraftLMLevels, "feeds_roots", real)
    monkeypatch.setattr(DraftLMLevels, "_roots_fed", lambda self: [p - 1 for p in fed_at(self)])  # greedy chains
    monkeypatch.setattr(Int8DraftLM, "sampled_chain", early_roots)  # sampled chains
    early = generate()
    assert [r.num_accepted for r in early] != [r.num_accepted for r in plain]


@pytest.mark.skipif(TEST_DEVICE != "cpu" or not vectorized(), reason="the draft LM's C++ chain ops run on the CPU")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_request_a_token_behind_is_caught_up_in_the_chain_ops_first_level(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DraftLMLevels._feed_behind`: a request that kept its whole chain is behind by the
    chain's last draft (never fed to the draft LM); that token goes in before its root, in
    the chain op's first level (`Int8DraftLM.chain` / `sampled_chain`'s `behind`), in place
    of `first`'s forward over every request's catch-up. The K/V it writes and the roots'
    logits after it are the general forward's bits, so output and acceptances are those
    with the general forward (`SHORT_CATCH_UP` 0) and those with the token fed as a chain
    level of its own first (`_flush`, the path off the CPU), token for token and seed for
    seed; the folded path ran; and where the chain ops stand aside, the tokens held for them
    are fed before the next forward. Test of the test: token 0 fed in place of each behind
    token draws other sampled chains."""
    generate = sd_runs(temperature)
    real = DraftLMLevels._feed_behind
    behind: list[int] = []
    folded: list[bool] = []

    def counted(self: DraftLMLevels, b: list[int]) -> None:
        behind.extend(b)
        real(self, b)

    def eager(self: DraftLMLevels, b: list[int]) -> None:  # fed at once, a chain level per position
        real(self, b)
        self._flush()

    def wrong(self: DraftLMLevels, b: list[int]) -> None:  # each behind token fed as token 0
        real(self, b)
        if self.pending is not None:
            self.pending = [[0] * len(h) for h in self.pending]

    chain, sampled_chain = Int8DraftLM.chain, Int8DraftLM.sampled_chain

    def chain_seen(self: Int8DraftLM, *args: Any) -> Any:
        folded.append(bool(args[5:] and args[5]))
        return chain(self, *args)

    def sampled_seen(self: Int8DraftLM, *args: Any) -> Any:
        folded.append(bool(args[8:] and args[8]))
        return sampled_chain(self, *args)

    def run() -> list[tuple[list[int], int]]:
        return [(r.output_ids, r.num_accepted) for r in generate()]

    monkeypatch.setattr(DraftLMLevels, "_feed_behind", counted)
    monkeypatch.setattr(Int8DraftLM, "chain", chain_seen)
    monkeypatch.setattr(Int8DraftLM, "sampled_chain", sampled_seen)
    short = run()
    assert any(k > 0 for k in behind) and any(folded)  # chains kept whole: their last drafts fed by the chain op
    monkeypatch.setattr(DraftLMLevels, "_feed_behind", eager)
    assert run() == short
    monkeypatch.setattr(DraftLMLevels, "_feed_behind", real)
    monkeypatch.setattr(Int8DraftLM, "chain", lambda *args: None)  # the ops stand aside: `first` and levels feed them
    monkeypatch.setattr(Int8DraftLM, "sampled_chain", lambda *args: None)
    assert run() == short
    monkeypatch.setattr(Int8DraftLM, "chain", chain_seen)
    monkeypatch.setattr(Int8DraftLM, "sampled_chain", sampled_seen)
    monkeypatch.setattr(level_drafters, "SHORT_CATCH_UP", 0)
    assert run() == short
    if temperature > 0:  # (the toy draft LM's argmax chains here read the same either way)
        monkeypatch.setattr(level_drafters, "SHORT_CATCH_UP", 2)
        monkeypatch.setattr(DraftLMLevels, "_feed_behind", wrong)
        assert [a for _, a in run()] != [a for _, a in short]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chains_a_forward_a_level_draft_what_the_tree_code_drafts(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no C++ op drafts chains (a GPU, whose levels replay a captured graph; here an
    fp32 draft LM, `chains()` forced as a GPU's graphs make it), sd's chains go a level per
    draft-LM forward (`DraftLMLevels.chain_level_at`: one token per request, causal over
    its slots; greedy: `_chain_by_levels`, each level's argmax; sampled: `rsd._sampled_chains`)
    instead of through `extend`'s trees. Same logits, same draws: the same output, token
    for token and seed for seed, with as many drafts accepted as the tree code's, and the
    level path ran. Test of the test: each chain level's logits taken one token id off
    (rolled) accept other drafts. The draft LM is the target's copy, so that
    greedy drafts are accepted too."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS)
    assert engine.draft_model is not None
    engine.draft_model.load_state_dict(engine.model.state_dict())
    n = 48
    params = [SamplingParams(temperature=temperature, max_tokens=12, seed=i, ignore_eos=True) for i in range(n)]
    config = RuntimeConfig(speculation="fixed", max_num_tokens=16 * n, max_queue_size=n)
    trees = llm_engine.generate(engine, [toy_sampling.PROMPT] * n, params, "sd", config)
    real, levels = DraftLMLevels.chain_level_at, []

    def counted(self: DraftLMLevels, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        assert self.fused is None  # the draft LM's own forward, as on a GPU
        levels.append(len(rows))
        return real(self, rows, tokens, positions)

    monkeypatch.setattr(DraftLMLevels, "chains", lambda self: True)
    monkeypatch.setattr(DraftLMLevels, "chain_level_at", counted)
    chained = llm_engine.generate(engine, [toy_sampling.PROMPT] * n, params, "sd", config)
    assert levels  # drafted a level per forward
    assert [r.output_ids for r in chained] == [r.output_ids for r in trees]
    assert [r.num_accepted for r in chained] == [r.num_accepted for r in trees]
    assert sum(r.num_accepted for r in chained) > n  # drafts were accepted: the chains mattered

    def misfed(self: DraftLMLevels, rows: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        return real(self, rows, tokens, positions).roll(1, dims=-1)

    monkeypatch.setattr(DraftLMLevels, "chain_level_at", misfed)
    shifted = llm_engine.generate(engine, [toy_sampling.PROMPT] * n, params, "sd", config)
    assert [r.num_accepted for r in shifted] != [r.num_accepted for r in trees]
