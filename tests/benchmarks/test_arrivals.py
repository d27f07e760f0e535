"""Arrival processes: the offered load has the requested rate and variability, reproducibly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from benchmarks.arrivals import ArrivalProcess

N = 20_000
RATE = 8.0


def _gaps(process: ArrivalProcess, n: int = N) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], process.schedule(n)]))


def test_constant_rate_is_exactly_constant() -> None:
    times = ArrivalProcess(rate=4.0, kind="constant").schedule(9)
    assert times == [i * 0.25 for i in range(9)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_mean_and_cv(seed: int) -> None:
    gaps = _gaps(ArrivalProcess(rate=RATE, kind="poisson", seed=seed))
    assert gaps.mean() == pytest.approx(1 / RATE, rel=0.03)
    assert 0.97 <= gaps.std() / gaps.mean() <= 1.03


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gamma_cv_follows_burstiness(seed: int) -> None:
    gaps = _gaps(ArrivalProcess(rate=RATE, kind="gamma", burstiness=4.0, seed=seed))
    assert gaps.mean() == pytest.approx(1 / RATE, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.03)


def test_schedule_is_non_decreasing_and_sized() -> None:
    times = ArrivalProcess(rate=RATE, kind="gamma", burstiness=0.5).schedule(1000)
    assert len(times) == 1000 and all(isinstance(t, float) for t in times)
    assert times[0] >= 0 and all(a <= b for a, b in itertools.pairwise(times))
    assert ArrivalProcess(rate=RATE).schedule(0) == []


def test_infinite_rate_sends_everything_at_once() -> None:
    for kind in ("constant", "poisson", "gamma"):
        assert ArrivalProcess(rate=float("inf"), kind=kind).schedule(5) == [0.0] * 5


@pytest.mark.parametrize("kind", ["poisson", "gamma"])
def test_seed_reproducibility(kind: str) -> None:
    def sched(seed: int) -> list[float]:
        return ArrivalProcess(rate=RATE, kind=kind, seed=seed).schedule(100)

    assert sched(7) == sched(7)
    assert sched(7) != sched(8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate": 0.0}, "rate"),
        ({"rate": -1.0}, "rate"),
        ({"rate": float("nan")}, "rate"),
        ({"rate": 1.0, "kind": "uniform"}, "kind"),
        ({"rate": 1.0, "kind": "gamma", "burstiness": 0.0}, "burstiness"),
        ({"rate": 1.0, "kind": "gamma", "burstiness": float("inf")}, "burstiness"),
        ({"rate": 1.0, "kind": "poisson", "burstiness": 2.0}, "burstiness"),
    ],
)
def test_bad_arguments_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArrivalProcess(**kwargs)


def test_negative_count_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ArrivalProcess(rate=1.0).schedule(-1)
