"""ReDrafter under sampling is exactly lossless (statistical test on a toy model).

A tiny-vocabulary (V=4) random target and a random drafter that disagrees with it; the
first three tokens emitted by the production loop (prefill token + one or two
speculative steps) are counted over 20,000 seeded requests and compared by chi-square
(p = 0.001) with the exactly computed target law q(x1) q(x2|x1) q(x3|x1,x2) (64 cells,
~300 expected per cell). Power: the noncentral chi-square needs lambda = n * sum((p-q)^2/q)
~ 66 to reject with probability 0.9 at df 63, i.e. moving ~0.5% of probability mass
between two average cells is caught nine times in ten. The same test must reject
Apple's per-beam rule (independent coin flips per beam, keep the longest): that is the
test of the test (it scores ~38,700 against a critical value of ~103.5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from runtime import engine_core
from runtime.loaded_engine import LoadedEngine
from runtime.proposers import redrafter
from runtime.sampling import SamplingParams, sample, target_probs
from runtime.tree import DraftTree, children_lists
from runtime.verify import Acceptance
from tests import toy_sampling
from tests.stats import passes_chi_square

SPEC = {"beam_width": 3, "beam_length": 2}


def toy_engine() -> LoadedEngine:
    return toy_sampling.toy_engine("redrafter", SPEC)


def emitted_first_three(engine: LoadedEngine, params: SamplingParams) -> torch.Tensor:
    return toy_sampling.emitted_first_three(engine, params, "redrafter")


@pytest.mark.parametrize(
    "params",
    [  # ~1.5 min each on 2 cores: T=1 runs in the slow suite, T=0.8 + top-k (more of the warp) by default
        pytest.param(SamplingParams(temperature=1.0), id="t1", marks=pytest.mark.slow),
        pytest.param(SamplingParams(temperature=0.8, top_k=3), id="t0.8-k3"),
    ],
)
def test_sampled_redrafter_follows_target_distribution(params: SamplingParams) -> None:
    engine = toy_engine()
    counts = emitted_first_three(engine, params)
    assert passes_chi_square(counts, toy_sampling.exact_first_three(engine.model, params))


def apple_per_beam_accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> Acceptance:
    """Apple's ml-recurrent-drafter rule: every beam flips its own coins min(1, q/p) per
    token, the beam with the longest accepted prefix wins, the bonus comes from
    norm([q - p]^+) at its first rejection (or q after a full accept)."""
    assert tree.draft_probs is not None
    children = children_lists(tree.parents)
    leaves = [n for n in range(len(tree.tokens)) if not children[n]]
    best: list[int] = []
    best_len, best_reject = -1, -1
    for leaf in leaves:
        path = [leaf]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path = path[::-1]  # root ... leaf
        accepted = 0
        for node in path[1:]:
            q = target_probs(logits[tree.parents[node]], params)
            p = tree.draft_probs[node]
            x = tree.tokens[node]
            if torch.rand((), generator=gen, device=gen.device) >= min(1.0, float(q[x] / p[x])):
                break
            accepted += 1
        if accepted > best_len:
            best, best_len = path, accepted
            best_reject = path[accepted + 1] if accepted + 1 < len(path) else -1
    kept = best[: best_len + 1]
    q = target_probs(logits[kept[-1]], params)
    if best_reject >= 0:
        q = (q - tree.draft_probs[best_reject]).clamp(min=0)
        q /= q.sum()
    return Acceptance(kept, [tree.tokens[n] for n in kept[1:]] + [sample(q, gen)])


def _with_laws(draft_trees: Callable[..., list[DraftTree]], *args: Any) -> list[DraftTree]:
    """`redrafter.draft_trees` with the per-node draft laws (`with_dists`, its 7th argument) attached."""
    return draft_trees(*args[:6], True, *args[7:])


def apple_rule_batch(
    trees: list[DraftTree], logits: list[torch.Tensor], params: list[SamplingParams], gens: list[torch.Generator]
) -> list[Acceptance]:
    return [apple_per_beam_accept(*args) for args in zip(trees, logits, params, gens, strict=True)]


def test_apple_per_beam_rule_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0)
    engine = toy_engine()
    monkeypatch.setattr(engine_core, "accept_batch", apple_rule_batch)
    # Apple's rule reads the draft laws, which the proposer does not build (point-mass verification needs none)
    monkeypatch.setattr(redrafter, "draft_trees", functools.partial(_with_laws, redrafter.draft_trees))
    counts = emitted_first_three(engine, params)
    assert not passes_chi_square(counts, toy_sampling.exact_first_three(engine.model, params))
