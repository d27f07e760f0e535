"""Load-aware speculation picks each request's tree size every step (a tree cut after fewer
levels, fewer beams, a shorter chain, or no drafting at all). Whatever it picks, output
stays exact: here the choice is replaced by a seeded coin per request and step (the most
erratic policy there is: drafters fall behind and catch up, trees change shape step by
step) and greedy output must equal auto-regression, sampled output the target's law."""

from __future__ import annotations

import random
import time

import pytest

from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.proposers.rsd import CONTEXTS
from runtime.sampling import SamplingParams
from runtime.speculation_policy import Offer, SpeculationPolicy, StepStats
from tests import toy_sampling
from tests.policy_spy import spy_on
from tests.stats import chi_square, passes_chi_square

SETTINGS = {"beam_width": 3, "beam_length": 3, "branching": (2, 2, 1)}


@pytest.fixture
def random_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every step, every request gets a random one of the sizes it offers (a quarter of the
    steps: none drafts); returns the choices made."""
    rng = random.Random(0)
    made: list[int] = []

    def choose(self: SpeculationPolicy, offers: list[Offer], others: int = 0) -> dict[str, int]:
        if rng.random() < 0.25:  # a whole step without drafting (every proposer still sees its requests)
            chosen = {o.key: 1 for o in offers}
        else:
            chosen = {o.key: rng.choice(list(o.sizes)) for o in offers}
        made.extend(chosen.values())
        return chosen

    monkeypatch.setattr(SpeculationPolicy, "choose", choose)
    return made


@pytest.mark.parametrize(
    ("drafter", "method"),
    [
        ("draft-lm", "rsd-s"),
        ("draft-lm", "rsd-c"),
        ("draft-lm", "sd"),
        ("redrafter", "redrafter"),
        ("redrafter", "ngram"),
        ("lyanna", "lyanna"),
    ],
)
def test_greedy_output_does_not_depend_on_the_sizes(random_sizes: list[int], drafter: str, method: str) -> None:
    engine = toy_sampling.toy_engine(drafter, SETTINGS)
    prompts = [[1 + i % 3, 3, 2, i % 4] for i in range(12)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts)
    config = RuntimeConfig(max_num_tokens=512)
    spec = llm_engine.generate(engine, prompts, params, method, config)
    ar = llm_engine.generate(engine, prompts, params, "ar", config)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert 1 in random_sizes and len(set(random_sizes)) >= 2, "no drafting and drafting must both have been chosen"


@pytest.mark.slow  # ~1-4 min each: 20,000 requests
@pytest.mark.parametrize(("method", "drawn"), [("rsd-s", {1, 2, 4, 7}), ("rsd-c", {1, 2, 4, 7, 11})])
def test_sampled_output_follows_the_target_law_whatever_the_sizes(
    random_sizes: list[int], method: str, drawn: set[int]
) -> None:
    """Over the draft LM, every tree of the ladder (`TreeSpec.ladder`): chains, wider
    beams (rsd-s) or siblings (rsd-c), AR steps that leave the draft cache behind."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    counts = toy_sampling.emitted_first_three(engine, params, method, accepted_share=8)
    law = toy_sampling.exact_first_three(engine.model, params)
    assert passes_chi_square(counts, law), chi_square(counts, law)
    assert drawn.issubset(random_sizes)


def test_prepare_calibrates_once_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare()` (servers and the CLI, at start-up) times the forward sizes load-aware
    speculation chooses by; the first drafting step then has nothing left to calibrate."""
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), RuntimeConfig(max_num_tokens=512))
    llm.prepare()
    assert llm.policy.forward_cost.tokens.points and llm.blocks.num_free == llm.blocks.num_blocks
    calls: list[int] = []
    monkeypatch.setattr(llm, "_calibrate", lambda: calls.append(1))
    llm.prepare()
    llm.generate([[1, 3, 2]], [SamplingParams(max_tokens=6, ignore_eos=True)], "rsd-s")
    assert not calls
    fixed = llm_engine.LLMEngine(llm.engine, RuntimeConfig(speculation="fixed"))
    fixed.prepare()  # nothing to choose, nothing to time
    assert not fixed.policy.forward_cost.tokens.points


@pytest.mark.parametrize("max_batch_size", [None, 1])
def test_a_draft_lm_times_its_levels_and_a_catch_up_at_start_up(max_batch_size: int | None) -> None:
    """`prepare()` seeds each draft-LM method's drafting-cost fit with real drafting calls in
    scratch blocks (`LevelTreeProposer.draft_cost_samples`): the method's default tree cut at
    every depth with nothing to read, and one call that first reads a context per
    request, so a token read is priced from a measured catch-up (not from a live call's
    whole prompt); every scratch block is free again. Also at batch 1, whose block pool the
    forward calibration's scratch once took whole: no drafting call could be timed, and
    the first live one (cold, reading a whole prompt) priced drafting ~5x too dear. Greedy
    and sampled levels are paths apart, each timed at its own temperature (on an H200, 4
    greedy levels ~1.1 ms a step where sampled ones took 3.5: priced by the sampled ones
    alone, sd at T=0 stayed off)."""
    config = RuntimeConfig(max_batch_size=max_batch_size, max_num_tokens=512)
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), config)
    llm.prepare()
    assert llm.blocks.num_free == llm.blocks.num_blocks
    # rsd-c and rsd-s: chains drafted apart from wider trees (`LevelTreeProposer.cost_paths`)
    greedy = {"sd": ["sd"], "rsd-c": ["rsd-c/chains", "rsd-c"], "rsd-s": ["rsd-s/chains", "rsd-s"]}
    sampled = {
        m: [f.replace("/", "/sampled-") if "/" in f else f"{f}/sampled" for f in fits] for m, fits in greedy.items()
    }
    assert set(llm.policy.draft_cost) >= {f for fits in (*greedy.values(), *sampled.values()) for f in fits}
    for method, fits in [*greedy.items(), *sampled.items()]:
        spec = llm.proposers[method].params(method, {})
        levels_seen = set()
        for fit in (llm.policy.draft_cost[f] for f in fits):
            shapes = {x for x, _ in fit.samples}
            levels_seen |= {levels for levels, _, caught_up, _ in shapes if caught_up == 0}
            catch_ups = {caught_up for _, _, caught_up, _ in shapes} - {0}
            assert catch_ups and catch_ups <= {rows * c for c in CONTEXTS for rows in (1, 8)}  # each fit's own
            assert all(seconds > 0 for _, seconds in fit.samples)
        assert levels_seen == set(range(1, spec.length + 1))


def test_redrafter_prices_its_chains_apart_from_its_wider_beams(monkeypatch: pytest.MonkeyPatch) -> None:
    """ReDrafter's one-beam chains (the C++ search straight) and its wider beams (packed
    trees) are two drafting paths (`ReDrafterProposer.cost_paths`), each seeded at start-up
    with searches of its own shape and each priced by its own fit: fitted together, the
    demo engine's batch-1 6-node chain was priced at 1.17 ms of drafting where it took
    0.74, and load-aware ReDrafter drafted wider beams in ~22% of its batch-1 steps. A
    live step's drafting timing is handed to the policy as the fit of the path that drafted it."""
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("redrafter", {"beam_width": 4, "beam_length": 3}))
    proposer = llm.proposers["redrafter"]
    params = proposer.params("redrafter", {"beam_width": 4, "beam_length": 3})
    assert proposer.sizes(params) == [1, 2, 3, 4, 7, 13]
    assert proposer.cost_paths(params) == ["", "chains", "chains", "chains", "", ""]
    llm.prepare()
    chains, beams = llm.policy.draft_cost["redrafter/chains"], llm.policy.draft_cost["redrafter"]
    # (levels, nodes, caught up, request-levels): a chain drafts one node a level, wider beams more
    assert all(nodes == rl for (_, nodes, _, rl), _ in chains.samples) and len(chains.samples) == 12
    assert all(nodes > rl for (_, nodes, _, rl), _ in beams.samples) and len(beams.samples) == 6
    fixed = llm_engine.LLMEngine(llm.engine, RuntimeConfig(speculation="fixed"))  # its largest tree, every step
    live: dict[str, set[bool]] = {}  # (a fixed policy learns no prices: the timings it is handed are read)

    def spy(stats: StepStats) -> None:
        for fit, (_, nodes, _, rl, _) in stats.drafting.items():
            live.setdefault(fit, set()).add(nodes > rl)

    spy_on(monkeypatch, fixed.policy, "observe", spy)
    request = ([[1, 3, 2]], [SamplingParams(max_tokens=8, ignore_eos=True)], "redrafter")
    fixed.generate(*request, beam_width=1)
    fixed.generate(*request, beam_width=4)
    assert live == {"redrafter/chains": {False}, "redrafter": {True}}


def test_start_up_drafting_samples_carry_their_share_of_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start-up sample holds what a live one holds: the drafting call plus its drafted
    nodes' share of verifying the trees (`verify_seconds * drafted / nodes`), verified
    against target laws equal to the draft laws, so that every node is accepted (the
    longest walk). With verification made 20 ms slower, every sample carries that share;
    without it (the samples before), a 3-node chain at batch 8, T=1 was priced at 2.3 ms
    where live steps took 3.7-4.4."""
    from runtime.proposers import rsd

    real, delay, paths = rsd.accept_batch, 0.020, []

    def slow(trees, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        accepted = real(trees, *args, **kwargs)
        paths.extend((len(a.path), max(t.depths) + 1) for a, t in zip(accepted, trees, strict=True))
        return accepted

    monkeypatch.setattr(rsd, "accept_batch", slow)
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), RuntimeConfig(max_num_tokens=512))
    llm.prepare()
    fit = llm.policy.draft_cost["sd"]  # chains: a request's nodes are its drafted nodes + its root
    for (levels, drafted, _, request_levels), seconds in fit.samples:
        rows = request_levels // levels
        assert seconds > delay * drafted / (drafted + rows)
    assert paths and all(walked == deepest for walked, deepest in paths)  # every node accepted


def test_verifying_drafts_is_charged_to_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's drafting cost includes the drafted nodes' share of verification (which
    at temperature > 0 walks full-vocabulary laws): with verification made 100 ms slower,
    every drafting call the policy learns from carries that share of it (at 20 ms, a toy
    drafting call on a machine busy with another test run took 40 ms, over the bound for
    one without the delay)."""
    from runtime import engine_core

    real, delay = engine_core.accept_batch, 0.100

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        return real(*args, **kwargs)

    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), RuntimeConfig(speculation="fixed"))
    seen: list[tuple[int, int, int, int, float]] = []
    spy_on(monkeypatch, llm.policy, "observe", lambda stats: seen.extend(stats.drafting.values()))
    prompt, params = [[1, 3, 2]], [SamplingParams(max_tokens=6, ignore_eos=True)]
    llm.generate(prompt, params, "sd")  # warm-up: a shape's first forward pays one-off set-up (seen at 10 ms)
    seen[:] = []
    llm.generate(prompt, params, "sd")
    quick, seen[:] = list(seen), []
    monkeypatch.setattr(engine_core, "accept_batch", slow)
    llm.generate(prompt, params, "sd")
    assert quick and seen
    assert max(seconds for *_, seconds in quick) < delay / 2
    for _, drafted, *_, seconds in seen:
        assert seconds >= delay * drafted / (drafted + 1)  # one request: the root and its drafted nodes


def test_the_host_overhead_a_step_reports_leaves_out_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decoding step reports its host seconds outside the forward and drafting; the
    step that calibrates the policy on the way (no `prepare()` first) reports none, else
    its ~0.2-0.8 s of timed forwards became a per-step cost: at the next batch size the
    policy priced an auto-regressive step at ~5 s."""
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), RuntimeConfig(max_num_tokens=512))
    reported: list[float | None] = []
    spy_on(monkeypatch, llm.policy, "observe", lambda stats: reported.append(stats.overhead_seconds))
    llm.generate([[1, 3, 2]], [SamplingParams(max_tokens=12, ignore_eos=True)], "sd")
    assert None in reported[:2]  # the step that calibrated (after the prompt's)
    measured = [r for r in reported if r is not None]
    assert measured and max(measured) < 0.05 and llm.policy.overhead


def test_the_host_overhead_a_step_reports_leaves_out_the_policys_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's own choice is paid whatever it chooses (and rarely in full: a decision
    stands for several steps), so a step's reported host overhead leaves it out; counted
    in, the plain steps timed where a decision changed priced auto-regression ~7% high at
    batch 32 (~0.5 ms of a full solve). Here a choice made 30 ms slower leaves every
    reported overhead under it."""
    llm = llm_engine.LLMEngine(toy_sampling.toy_engine("draft-lm", SETTINGS), RuntimeConfig(max_num_tokens=512))
    llm.prepare()
    reported: list[float | None] = []
    spy_on(monkeypatch, llm.policy, "observe", lambda stats: reported.append(stats.overhead_seconds))
    spy_on(monkeypatch, llm.policy, "choose", lambda *a: time.sleep(0.030))
    llm.generate([[1, 3, 2]], [SamplingParams(max_tokens=12, ignore_eos=True)], "sd")
    measured = [r for r in reported if r is not None]
    assert len(measured) >= 3 and max(measured) < 0.020, measured


@pytest.mark.parametrize("call", ["choose", "observe", "forget"])
def test_a_fault_in_the_policy_costs_speed_not_requests(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """`EngineCore._policy_failed`: the policy only moves speed, so one of its calls that
    raises (a bug, or a declared type the compiled form checks: `runtime.native_policy`)
    leaves that step auto-regressive (`choose`) or unlearned (`observe`, `forget`). Every
    request still ends with the target's own greedy tokens, the engine stays alive, the
    first fault is logged and all are counted. Test of the test: the same fault escaping
    the engine's step (as before) fails every request in flight, and out of `forget` (which
    failing them calls again) escapes the engine itself."""
    engine = toy_sampling.toy_engine("draft-lm", SETTINGS)
    prompts = [[1 + i % 3, 3, 2, i % 4] for i in range(6)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts)
    config = RuntimeConfig(max_num_tokens=512)
    ar = llm_engine.generate(engine, prompts, params, "ar", config)
    llm = llm_engine.LLMEngine(engine, config)

    def fault(*args: object) -> None:
        raise TypeError("int object expected; got float")

    spy_on(monkeypatch, llm.policy, call, fault)
    with caplog.at_level("ERROR", logger="runtime.engine_core"):
        spec = llm.generate(prompts, params, "sd")
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert all(r.finish_reason == "length" for r in spec)
    stats = llm.stats()
    assert stats.dead is None and stats.policy_errors >= len(prompts if call == "forget" else [0, 1])
    assert sum(f"policy's {call} failed" in r.getMessage() for r in caplog.records) == 1
    if call == "choose":
        assert set(s for (_, s) in stats.tree_sizes) <= {1}
    monkeypatch.setattr(llm, "_policy_failed", lambda name: (_ for _ in ()).throw(RuntimeError(name)))
    if call == "forget":
        with pytest.raises(RuntimeError, match="forget"):
            llm.generate(prompts[:2], params[:2], "sd")
    else:
        assert all(r.finish_reason == "error" for r in llm.generate(prompts[:2], params[:2], "sd"))
