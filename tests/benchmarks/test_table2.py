"""`benchmarks/table2.py`'s speedup: the median over rounds of AR's ms/token over the
method's in the same round (the machine's drift between rounds cancels within a pair), not
the ratio of ms/token pooled over rounds."""

from __future__ import annotations

from benchmarks.table2 import markdown, round_speedups

META = {
    "engine": "e",
    "methods": ["ar", "redrafter"],
    "speculation": "load-aware",
    "num_requests": 16,
    "rounds": 3,
    "max_tokens": 64,
    "capacity_req_s": 10.0,
    "capacity_concurrency": 8,
    "machine": {"cpu": "cpu", "torch_threads": 2},
}


def test_the_speedup_is_the_median_of_paired_rounds() -> None:
    rounds = [{"ar": 2.0, "redrafter": 1.0}, {"ar": 4.0, "redrafter": 3.0}, {"ar": 3.0, "redrafter": 1.5}]
    assert round_speedups(rounds, "redrafter") == [2.0, 4.0 / 3.0, 2.0]
    pooled = {
        "ar": {"ms_per_token": 3.0, "failed": 0},
        "redrafter": {"ms_per_token": 1.8333, "failed": 0, "mean_tokens_per_step": 3.5},
    }
    speedups = {"redrafter": round_speedups(rounds, "redrafter")}
    row = {"fraction": 0.1, "qps": 1.0, "rounds": rounds, "speedups": speedups}
    table = markdown([row | pooled], META)
    assert "| 2.00x (1.33-2.00) | 3.50 |" in table  # the pooled ratio would read 1.64x


def test_a_round_that_completed_nothing_is_left_out() -> None:
    """All requests of a round failed (ms/token None): the speedup is over the other rounds,
    and a cell with none reads "-" instead of the report failing after the whole run."""
    assert round_speedups([{"ar": 2.0, "redrafter": None}, {"ar": 3.0, "redrafter": 1.5}], "redrafter") == [2.0]
    row = {
        "fraction": 1.0,
        "qps": 5.0,
        "ar": {"ms_per_token": None, "failed": 16},
        "redrafter": {"ms_per_token": None, "failed": 16, "mean_tokens_per_step": None},
        "speedups": {"redrafter": []},
    }
    table = markdown([row], META)
    assert "| 5.00 (1) | - | - | - | - |" in table and "Failed requests: 32." in table
