"""The draft LM's own paged KV cache stays right through in-flight batching, chunked
prefill, accepted-path compaction and preemption.

Losslessness cannot see a corrupted draft cache (a bad draft is merely rejected), so this
test uses a draft LM *identical* to the target: then no drafted token may ever be
rejected (every accepted path runs to a leaf of its tree), at every step of every
request, and any stale, misplaced or missing draft K/V shows up as a rejection. Greedy
(argmax) and sampled (q = p, so min(1, q/p) = 1) alike.
Outputs must also equal the target's own greedy output.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models

from model_defs.llama import ARCHITECTURE
from runtime import engine_core
from runtime.config import RuntimeConfig
from runtime.cuda_graphs import CudaGraphs
from runtime.engine_dir import BuildConfig, DrafterSpec, EngineConfig
from runtime.kv_budget import KVBudget
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.level_drafters import DraftLMLevels
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree, children_lists
from runtime.verify import Acceptance
from tests.device import ON_CPU, TEST_DEVICE
from tests.tiny_models import tiny_target

V = 11
SETTINGS: dict[str, Any] = {"beam_width": 2, "beam_length": 3, "branching": (2, 2, 1)}


def self_drafting_engine() -> LoadedEngine:
    target, draft = tiny_target(7, V, TEST_DEVICE), tiny_target(7, V, TEST_DEVICE)
    build = BuildConfig(max_batch_size=6, max_input_len=64, max_seq_len=128)
    spec = DrafterSpec("draft-lm", draft.config.to_hf(), SETTINGS)
    config = EngineConfig(ARCHITECTURE, target.config.to_hf(), build, drafter=spec)
    return LoadedEngine(config, target, Tokenizer(models.BPE()), draft_model=draft)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 17, 40, 9, 25, 60, 5, 33]
    return [torch.randint(1, V, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("method", ["sd", "rsd-c", "rsd-s"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_identical_draft_is_always_accepted(method: str, temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    verified: list[bool] = []  # per drafted tree: was its accepted path cut by a rejection?

    def recording(trees: list[DraftTree], *args: Any) -> list[Acceptance]:
        accs = real_accept(trees, *args)
        for tree, acc in zip(trees, accs, strict=True):
            if len(tree.tokens) > 1:
                verified.append(bool(children_lists(tree.parents)[acc.path[-1]]))
        return accs

    real_accept = engine_core.accept_batch
    monkeypatch.setattr(engine_core, "accept_batch", recording)
    engine = self_drafting_engine()
    # 6 running of 8, 48-token steps (prompts are chunked), a KV cache small enough to preempt
    config = RuntimeConfig(
        max_batch_size=6, max_num_tokens=48, max_draft_tokens=16, kv=KVBudget(max_tokens=240), speculation="fixed"
    )
    llm = LLMEngine(engine, config)
    params = [SamplingParams(max_tokens=40, temperature=temperature, seed=i, ignore_eos=True) for i in range(8)]
    results = llm.generate(prompts(), params, method)
    assert llm.scheduler.num_decode_preemptions > 0, "the KV budget must force preemption mid-decode"
    assert len(verified) > 50
    assert not any(verified), f"{sum(verified)} of {len(verified)} trees had a drafted token rejected"
    if temperature == 0:
        reference = LLMEngine(engine, RuntimeConfig(max_batch_size=6)).generate(prompts(), params, "ar")
        assert [r.output_ids for r in results] == [r.output_ids for r in reference]


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU (SPECPIPE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("method", ["sd", "rsd-s"])
def test_draft_lm_graphs_draft_what_eager_forwards_draft(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the draft LM's levels replay captured CUDA graphs (`Proposer.capture_graphs`).
    Greedy drafting is the argmax of the draft logits, so an engine whose graphs read stale
    inputs or a misplaced K/V drafts other trees than one that runs the same forwards eagerly;
    the outputs stay AR's either way (verification is the target's)."""
    drafted: dict[bool, list[list[int]]] = {True: [], False: []}
    replays: list[int] = []

    def recording(trees: list[DraftTree], *args: Any) -> list[Acceptance]:
        drafted[graphs_on].extend(tree.tokens for tree in trees)
        return real_accept(trees, *args)

    def counting(self: CudaGraphs, tokens: torch.Tensor, *args: Any) -> Any:
        replays.append(self.model is engine.draft_model)
        return real_run(self, tokens, *args)

    real_accept, real_run = engine_core.accept_batch, CudaGraphs.run
    monkeypatch.setattr(engine_core, "accept_batch", recording)
    monkeypatch.setattr(CudaGraphs, "run", counting)
    engine = self_drafting_engine()
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in range(6)]
    outputs = {}
    for graphs_on in (True, False):
        config = RuntimeConfig(max_batch_size=6, max_num_tokens=128, speculation="fixed", cuda_graphs=graphs_on)
        outputs[graphs_on] = [r.output_ids for r in LLMEngine(engine, config).generate(prompts()[:6], params, method)]
    assert sum(replays) > 20, "the draft LM's levels must replay its graphs"
    assert drafted[True] == drafted[False]
    assert outputs[True] == outputs[False]


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU (SPECPIPE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_fed_device_draws_draft_what_host_tokens_draft(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's draft-LM chains feed each level's draws (greedy: `_chain_by_levels`'s
    argmax; sampled: `rsd._sampled_chains`'s inverse-CDF draws) to the next level's graph
    as a device tensor, copied into the graph's inputs after the packed ones
    (`CudaGraphs.run`), with no read-back between levels. Fed the same draws as host
    integers (read back each level), the graphs must draft the same trees, token for token
    and seed for seed. Levels of tokens the host holds anyway (a catch-up's, the roots':
    `DraftLMLevels._feed_behind` and `first`, chain levels since session 18) are fed from
    the host. Test of the test: device draws fed one token id off draft other trees."""
    drafted: list[list[int]] = []
    fed_on_device: list[bool] = []
    known = [0]  # calls feeding tokens the host holds under way (`first` calls `_feed_behind`)

    def feeding_known(fn: Any) -> Any:
        def wrapped(self: DraftLMLevels, *args: Any) -> Any:
            known[0] += 1
            try:
                return fn(self, *args)
            finally:
                known[0] -= 1

        return wrapped

    def recording(trees: list[DraftTree], *args: Any) -> list[Acceptance]:
        drafted.extend(tree.tokens for tree in trees)
        return real_accept(trees, *args)

    def host_fed(self: DraftLMLevels, rows: list[int], tokens: Any, positions: list[int]) -> torch.Tensor:
        return real_level(self, rows, tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens, positions)

    def device_fed(self: DraftLMLevels, rows: list[int], tokens: Any, positions: list[int]) -> torch.Tensor:
        if known[0] == 0:
            fed_on_device.append(isinstance(tokens, torch.Tensor) and tokens.device.type == "cuda")
        return real_level(self, rows, tokens, positions)

    def off_by_one(self: DraftLMLevels, rows: list[int], tokens: Any, positions: list[int]) -> torch.Tensor:
        return real_level(self, rows, (tokens + 1) % V if isinstance(tokens, torch.Tensor) else tokens, positions)

    real_accept, real_level = engine_core.accept_batch, DraftLMLevels.chain_level_at
    monkeypatch.setattr(engine_core, "accept_batch", recording)
    for name in ("first", "_feed_behind"):
        monkeypatch.setattr(DraftLMLevels, name, feeding_known(getattr(DraftLMLevels, name)))
    engine = self_drafting_engine()
    params = [SamplingParams(max_tokens=40, temperature=temperature, seed=i, ignore_eos=True) for i in range(6)]
    config = RuntimeConfig(max_batch_size=6, max_num_tokens=128, speculation="fixed", cuda_graphs=True)
    runs: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
    for name, level in (("device", device_fed), ("host", host_fed), ("off", off_by_one)):
        monkeypatch.setattr(DraftLMLevels, "chain_level_at", level)
        drafted.clear()
        outputs = [r.output_ids for r in LLMEngine(engine, config).generate(prompts()[:6], params, "sd")]
        runs[name] = (list(drafted), outputs)
    assert len(fed_on_device) >= 10 and all(fed_on_device), "every chain level must be fed the device's draws"
    assert runs["device"] == runs["host"]
    assert runs["off"][0] != runs["device"][0]
