"""Greedy Lyanna on the bundled demo models is token-identical to the target's own greedy
decoding: 32 held-out prompts, 8 running at a time with requests joining as others
finish, without re-sampling, with re-sampling fused into the next step's forward, and with
re-sampled drafts verified on their own. Each test runs on an engine drafting in int8 and on
one drafting in 4 bits (`--drafter-head int4 --drafter-layers int4`, what `make engine`
builds the demo Lyanna engine with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from build.engine import build_engine
from plugins import cpu_kernels
from plugins.int8_linear import vectorized
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.lyanna import LyannaProposer
from runtime.request import Request
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from tests.device import TEST_DEVICE
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
PARAMS = SamplingParams(max_tokens=32)
FIXED = RuntimeConfig(speculation="fixed")


@pytest.fixture(scope="module", params=["int8", "int4"])
def engine(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> LoadedEngine:
    out = tmp_path_factory.mktemp("engines") / f"demo-lyanna-{request.param}"
    build = BuildConfig(
        max_batch_size=8, max_input_len=512, max_seq_len=1024, drafter_head=request.param, drafter_layers=request.param
    )
    engine_dir = build_engine(MODELS / "demo-target", out, build, lyanna=MODELS / "demo-lyanna")
    return LoadedEngine.load(engine_dir, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def prompts(engine: LoadedEngine) -> list[list[int]]:
    return [engine.encode(t) for t in heldout_prompts(32)]


@pytest.fixture(scope="module")
def reference(engine: LoadedEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [r.output_ids for r in llm_engine.generate(engine, prompts, [PARAMS] * len(prompts), "ar")]


@pytest.mark.parametrize(("resample", "fuse"), [(False, False), (True, True), (True, False)])
def test_batched_greedy_equals_target(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]], resample: bool, fuse: bool
) -> None:
    results = llm_engine.generate(
        engine, prompts, [PARAMS] * len(prompts), "lyanna", FIXED, resample=resample, fuse=fuse, budget=12
    )
    for i, r in enumerate(results):
        assert r.output_ids == reference[i], f"prompt {i} diverged (resample={resample}, fuse={fuse})"
    steps = [a for r in results for a in r.accepted_per_step]
    assert sum(steps) / len(steps) > 0.5, "the trained drafter should get drafts accepted"


def test_the_chain_is_one_call_where_the_op_applies(engine: LoadedEngine) -> None:
    """On the CPU with the int8 kernel the proposer drafts its chains through
    `specpipe_cpu::lyanna_chain` (the greedy test above then checks its output)."""
    fused = llm_engine.LLMEngine(engine, FIXED).proposers["lyanna"].fused  # type: ignore[attr-defined]
    assert (fused is not None) == (TEST_DEVICE == "cpu" and cpu_kernels.load() and vectorized())


def test_roots_alone_never_reach_the_proposer(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop verifies a root alone without calling `propose` (the no-draft path): under
    load-aware speculation every request's last step is one (one token left), and a request
    of 2 tokens never drafts, so its proposer's `on_accept` meets a request with no draft
    state. Greedy output stays the target's."""
    budgets: list[int] = []
    propose = LyannaProposer.propose

    def spy(self: LyannaProposer, requests: list[Request], sizes: list[int]) -> list[DraftTree]:
        budgets.extend(sizes)
        return propose(self, requests, sizes)

    monkeypatch.setattr(LyannaProposer, "propose", spy)
    params = [SamplingParams(max_tokens=2 if i % 2 else 32) for i in range(16)]
    results = llm_engine.generate(engine, prompts[:16], params, "lyanna", resample=True)
    for i, r in enumerate(results):
        assert r.output_ids == reference[i][: params[i].max_tokens], f"prompt {i} diverged"
    roots = [s for r in results for s in r.sizes_per_step if s == 1]
    assert roots and budgets, "both roots alone and drafted trees should have been verified"
    assert min(budgets) > 1, "a root alone went through the proposer"
    assert all(r.num_drafted == 0 for r in results[1::2]), "the 2-token requests never drafted"


def test_small_sizes_are_chains_and_stay_exact(
    engine: LoadedEngine, prompts: list[list[int]], reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LyannaParams.chains`: load-aware speculation's sizes up to `depth` drafted nodes are
    chains (one node a depth, each a cut of the next, node budgets depth + 1), the sizes
    above (`prunes`) the width-w tree pruned, with no node budgets (what they measure is their own
    size only). Every step of fixed speculation here is cut to a chain size or a pruned one
    in turn; greedy output stays the target's. Without `chains` the same sizes are prunes (siblings)."""
    sizes: list[int] = []
    trees: list[tuple[int, DraftTree]] = []
    propose = LyannaProposer.propose

    def forced(self: LyannaProposer, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        size = [2, 3, 4, 5, 9][len(sizes) % 5]
        sizes.append(size)
        given = [min(size, b) for b in budgets]  # within the nodes the step holds for each
        out = propose(self, requests, given)
        trees.extend((g, t) for g, t in zip(given, out, strict=True) if g > 1)
        return out

    monkeypatch.setattr(LyannaProposer, "propose", forced)
    results = llm_engine.generate(engine, prompts[:16], [PARAMS] * 16, "lyanna", FIXED, resample=False, prunes=True)
    for i, r in enumerate(results):
        assert r.output_ids == reference[i], f"prompt {i} diverged"
    assert {s for s, _ in trees} == {2, 3, 4, 5, 9}
    for size, tree in trees:
        if size <= 4:
            assert len(tree.tokens) == size and tree.parents == list(range(-1, size - 1))  # a chain
            assert tree.node_budget == [d + 1 for d in range(size)], tree.node_budget
        else:
            assert tree.node_budget == [] and len(tree.tokens) <= size
    assert any(len(set(t.parents)) < len(t.parents) - 1 for s, t in trees if s > 4), "no pruned tree had siblings"
    trees.clear()
    llm_engine.generate(engine, prompts[:4], [PARAMS] * 4, "lyanna", FIXED, resample=False, chains=False)
    assert any(len(set(t.parents)) < len(t.parents) - 1 for s, t in trees if s <= 4), "prunes without chains"
