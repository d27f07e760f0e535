"""What a step costs (`runtime/step_costs.py`), each price against what it must equal or
must not do: the draft-cost fit against a least-squares refit of its kept samples, every
shape kept, live samples replacing start-up ones; the per-request-count tables' means and
extrapolation; calibration's pooling into a non-decreasing table."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import step_costs
from runtime.step_costs import PER_SHAPE, ForwardCost, LinearCost, monotone

L = 4
"""Drafter levels of the drafting calls the fits learn from."""


def test_a_residual_seen_at_fewer_requests_is_not_multiplied_up() -> None:
    """Above the request counts measured, a one-token step is priced with the largest
    count's residual as it is: mostly per step, scaled per request a batch-1 warm-up's
    2.2 ms priced 8 one-token requests at ~22 ms where they took ~6, so auto-regression
    was never chosen at batch 8 and never measured there. Priced low instead, the first
    step at that count measures it."""
    cost = ForwardCost()
    for n in (1, 8):
        cost.calibrate(n, n / 1e4)
    cost.observe(1, 1, 1 / 1e4 + 0.0022)
    assert cost(8, 8) == pytest.approx(8 / 1e4 + 0.0022)
    cost.observe(8, 8, 8 / 1e4 + 0.001)
    assert cost(8, 8) == pytest.approx(8 / 1e4 + 0.001)
    assert cost(4, 4) == pytest.approx(4 / 1e4 + 0.0022 + (0.001 - 0.0022) * 3 / 7)


def test_draft_cost_fit_keeps_every_shape_it_saw() -> None:
    """A long run of one drafting shape must not push the others out of the fit: with only
    16-node drafts left, the per-node slope is undetermined and a 4-node draft looks as dear
    as a 16-node one, so the policy would never leave the larger tree (seen at batch 1)."""
    cost = LinearCost()
    for _ in range(3):
        cost.add((L, 4), 0.005)
    for _ in range(200):
        cost.add((L, 16), 0.008)
    assert len(cost.slopes()) == 2
    assert cost(L, 4) == pytest.approx(0.005, abs=2e-4)
    assert cost(L, 16) == pytest.approx(0.008, abs=2e-4)
    assert len(cost) == 3 + step_costs.PER_SHAPE


def test_monotone_pools_what_decreases_and_keeps_what_does_not() -> None:
    assert monotone([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    assert monotone([9.0, 7.0, 8.0, 10.0]) == [8.0, 8.0, 8.0, 10.0]
    assert monotone([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    out = monotone(list(np.random.default_rng(0).normal(size=50)))
    assert out == sorted(out)


def test_draft_cost_fit_equals_a_refit_from_its_samples() -> None:
    """The normal equations kept as samples come and go (a shape's oldest leaves after
    `PER_SHAPE`) give the coefficients a least-squares refit of the kept samples gives,
    the non-negative fallback included."""
    rng = np.random.default_rng(0)
    cost = LinearCost()
    for k in range(200):
        x = (float(rng.choice([1, 2, 5])), float(rng.choice([4, 8, 40])), float(rng.choice([0, 150])))
        cost.add(x, 0.001 * rng.random() + 0.0008 * x[0] + 2e-5 * x[1] * rng.random(), (x[0], x[1], x[2] > 0))
        if k % 9 == 0:
            samples = cost.samples
            a, t = np.array([(1.0, *f) for f, _ in samples]), np.array([s for _, s in samples])
            refit = LinearCost()
            for f, s in samples:
                refit.add(f, s)
            assert np.allclose(cost.slopes(), refit.slopes(), atol=1e-12)
            free = np.linalg.lstsq(a, t, rcond=None)[0]
            if free.min() >= 0:
                assert np.allclose(cost.slopes(), free[1:], atol=1e-6)


@pytest.mark.python_policy
def test_a_price_by_the_last_fit_is_that_fits_price_and_refits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LinearCost.recent`: the price by the last fit made, however many samples came since
    (a bound on one more sample needs no refit of the 5 x 5 system every step); a fit is
    made only where none was yet, and the next query refits as before."""
    cost = LinearCost()
    x = (5.0, 5.0, 0.0, 5.0)
    for levels in (1.0, 2.0, 5.0):
        cost.add((levels, levels, 0.0, levels), 0.0002 + 0.00015 * levels)
    assert cost.recent(*x) == cost(*x)  # the first query fits
    fitted = cost(*x)
    solves = []
    substitute = step_costs._substitute
    monkeypatch.setattr(step_costs, "_substitute", lambda f, b: solves.append(1) or substitute(f, b))
    for _ in range(3):
        cost.add(x, 0.004)  # slower calls move the fit
    assert cost.recent(*x) == fitted and not solves
    assert cost(*x) > fitted and solves
    refits = len(solves)
    assert cost.recent(*x) == cost(*x) and len(solves) == refits


def test_a_kept_elimination_fits_what_a_fresh_one_does() -> None:
    """`LinearCost._factors`: while A^T A stays (a steady choice's calls move A^T t alone),
    a refit substitutes into the kept elimination of A^T A; the fit is the one eliminating
    afresh gives, to the last bit (the same operations on A^T t, in the same order), and a
    sample of a new shape (A^T A moved) eliminates afresh."""
    rng = np.random.default_rng(2)
    cost = LinearCost()
    for levels in (1.0, 2.0, 3.0):
        cost.add((levels, levels, 0.0, levels), 0.0002 + 0.00015 * levels * (1 + 0.1 * rng.random()))
    steady = (5.0, 5.0, 0.0, 5.0)
    kept = 0
    for k in range(3 * PER_SHAPE):
        x = (5.0, 5.0, 1.0, 5.0) if k % 11 == 5 else steady
        cost.add(x, 0.0009 * (1 + 0.3 * rng.random()) + 0.0001 * x[2], shape=steady)
        kept += bool(cost._factors)
        fitted = cost.slopes()
        cost._factors.clear()
        cost._stale = True
        assert cost.slopes() == fitted
    assert kept > PER_SHAPE  # most refits substituted into a kept elimination


def test_a_steady_choices_calls_move_the_fit_as_a_refit_does() -> None:
    """A call with the features of the oldest sample of its shape, which it replaces (a
    steady choice's, every step: `LinearCost.add` then moves A^T t alone), leaves the fit a
    least-squares refit of the kept samples gives; so do calls of other features in the
    same shape, which take the full update. Skipping A^T t's move, or moving it by the new
    seconds without taking the old ones back, would fail."""
    rng = np.random.default_rng(1)
    cost = LinearCost()
    for levels in (1.0, 2.0, 3.0):  # other shapes, so the fit is determined
        for _ in range(4):
            cost.add((levels, levels, 0.0, levels), 0.0002 + 0.00015 * levels * (1 + 0.1 * rng.random()))
    steady, caught_up = (5.0, 5.0, 0.0, 5.0), (5.0, 5.0, 1.0, 5.0)
    for k in range(5 * PER_SHAPE):
        x = caught_up if k % 7 == 3 else steady
        cost.add(x, 0.0009 * (1 + 0.3 * rng.random()) + 0.0001 * x[2], shape=(5.0, 5.0, 0.0, 5.0))
        samples = cost.samples
        refit = LinearCost()
        for f, seconds in samples:
            refit.add(f, seconds)
        assert np.allclose(cost.slopes(), refit.slopes(), atol=1e-12)
        assert cost(*steady) == pytest.approx(refit(*steady), rel=1e-9)


def test_a_live_drafting_sample_replaces_the_start_up_samples_of_its_shape() -> None:
    """Start-up timings stand in for live ones until a live call of the same shape comes
    (ReDrafter's beam search for 32 requests: 4.1 ms at start-up, 7.5 ms live); then they
    leave the fit at once, while the start-up samples of other shapes stay. Kept as
    ordinary samples, two start-up samples outvote the live one for 15 more steps."""
    start_up = [((1, 4, 0), 0.001), ((4, 16, 0), 0.002), ((4, 128, 0), 0.0041)]
    replaced, outvoted = LinearCost(), LinearCost()
    for x, seconds in start_up * 2:
        replaced.add(x, seconds, start_up=True)
        outvoted.add(x, seconds)
    for fit in (replaced, outvoted):
        fit.add((4, 128, 0), 0.0075)
    assert replaced(4, 128, 0) == pytest.approx(0.0075, rel=1e-3)
    assert [x for x, _ in replaced.samples].count((4, 128, 0)) == 1
    assert replaced(1, 4, 0) == pytest.approx(0.001, rel=1e-2)
    assert outvoted(4, 128, 0) < 0.0055


def test_timings_of_a_request_count_are_their_mean_until_the_decay_takes_over() -> None:
    """`ByRequests.add`: a batch's first, slow steps must not outweigh the steps after them."""
    t = step_costs.ByRequests()
    for seconds in (0.004, 0.002, 0.002, 0.002):
        t.add(8, seconds)
    assert t[8] == pytest.approx(0.0025) and t.seen[8] == 4
    t.add(8, 0.012)
    assert t[8] == pytest.approx(0.0025 + step_costs.FORWARD_EMA * 0.0095)
