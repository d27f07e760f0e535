"""Lyanna under sampling is exactly lossless, with and without re-sampling and fusion:
same protocol as `test_rsd_sampling.py` (first three tokens of 20,000 seeded requests in
flight together, chi-square at p = 0.001 against the target's exact law), with a random
drafter whose token info covers every token, and temperature + top-p on. With 2-level
trees the second step often verifies a tree fused with the first step's re-sampled
candidates, so a re-sampling bug that broke exactness (e.g. repeated siblings) would show."""

from __future__ import annotations

import pytest

from runtime.sampling import SamplingParams
from tests import toy_sampling
from tests.stats import chi_square, passes_chi_square

PARAMS = SamplingParams(temperature=0.9, top_p=0.9)


# re-sampling fused into the next step is the new path; the other two (~2 min each on
# 2 cores) run in the slow suite
@pytest.mark.parametrize(
    ("resample", "fuse"),
    [
        (True, True),
        pytest.param(True, False, marks=pytest.mark.slow),
        pytest.param(False, False, marks=pytest.mark.slow),
    ],
)
def test_lyanna_follows_target_distribution(resample: bool, fuse: bool) -> None:
    settings = {"depth": 3, "width": 2, "budget": 4, "resample": resample, "fuse": fuse, "resample_budget": 2}
    engine = toy_sampling.toy_engine("lyanna", settings)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "lyanna")
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    assert passes_chi_square(counts, law), chi_square(counts, law)


def test_lyanna_chains_follow_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LyannaParams.chains`: every step cut to a chain size (3 and 4 nodes in turn: the
    tree at width 1, a point mass a level) stays exactly lossless under sampling."""
    from runtime.proposers.lyanna import LyannaProposer

    propose, shapes, calls = LyannaProposer.propose, set(), [0]

    def chains(self: LyannaProposer, requests: list, budgets: list[int]) -> list:
        size, calls[0] = 3 + calls[0] % 2, calls[0] + 1
        trees = propose(self, requests, [min(size, b) for b in budgets])
        shapes.update(tuple(t.parents) for t in trees)
        return trees

    monkeypatch.setattr(LyannaProposer, "propose", chains)
    settings = {"depth": 3, "width": 2, "budget": 4, "resample": False, "resample_budget": 2}
    engine = toy_sampling.toy_engine("lyanna", settings)
    counts = toy_sampling.emitted_first_three(engine, PARAMS, "lyanna")
    law = toy_sampling.exact_first_three(engine.model, PARAMS)
    assert passes_chi_square(counts, law), chi_square(counts, law)
    assert shapes <= {(-1,), (-1, 0), (-1, 0, 1), (-1, 0, 1, 2)} and (-1, 0, 1, 2) in shapes, shapes  # chains
