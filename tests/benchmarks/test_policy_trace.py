"""`benchmarks/policy_trace.py`, run for real on the CPU on the draft-LM demo engine: a row per
step the policy observed, and per drafting-cost fit its samples by shape (start-up ones
marked) and its prices; greedy and sampled fits apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.policy_trace import PRICED, main
from runtime.speculation_policy import SOLVE_CAUSES


def test_every_observed_step_and_every_fit_is_reported(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "trace"
    main(["--engine", str(engines["draft-lm"]), "--method", "sd", "--batch", "2", "--max-tokens", "12",
          "--rounds", "2", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    steps = doc["rows"]
    assert {s["round"] for s in steps} == {0, 1} and all(s["forward_ms"] > 0 for s in steps)
    decoding = [s for s in steps if not s["prefill"]]
    assert sum(doc["sizes"].values()) == sum(s["requests"] for s in decoding)  # every request-step, plain ones as 1
    for s in decoding:
        assert bool(s["sizes"]) == bool(s["drafting_ms"]) and all(size > 1 for size in s["sizes"])
    assert {"sd", "sd/sampled"} <= set(doc["fits"])  # greedy and sampled levels priced apart
    for name in ("sd", "sd/sampled"):
        fit = doc["fits"][name]
        assert fit["samples"] == sum(len(shape["ms"]) for shape in fit["shapes"])
        assert any(shape["start_up"] for shape in fit["shapes"])  # timed at engine start
        assert set(fit["price_ms"]) == {str(x) for x in PRICED} and all(p > 0 for p in fit["price_ms"].values())
    assert list(doc["forward_table_ms"].values()) == sorted(doc["forward_table_ms"].values())
    assert doc["solves"] and set(doc["solves"]) <= set(SOLVE_CAUSES)  # a fresh policy solves at least once
    # what each choice promised, against what its step took and its standing decision's trees made
    kept = doc["promised"]
    standing = [s for s in steps if s["trees_expected"]]
    assert kept["tree_steps"] == len(standing) and all(s["sizes"] and s["trees_made"] >= 1 for s in standing)
    if standing:
        made = sum(s["trees_made"] for s in standing) / sum(s["trees_expected"] for s in standing)
        assert kept["trees_made_over_expected"] == pytest.approx(made)
    timed = [s for s in decoding if s["predicted_ms"] and s["priced_ms"] is not None]
    assert kept["drafting_steps"] + kept["plain_steps"] == len(timed) > 0
    assert all(s["priced_ms"] >= s["forward_ms"] for s in timed)
    md = out.with_suffix(".md").read_text()
    assert "| fit | samples | start-up shapes |" in md and "\n| sd/sampled | " in md and "Promised and made" in md
    assert md.count("\n| 0 | 0 | 2 |") == 1 and doc["meta"]["command"].startswith("python -m benchmarks.policy_trace")


def test_bad_arguments_are_refused(engines: dict[str, Path], tmp_path: Path) -> None:
    for bad in (
        ["--batch", "0"],
        ["--rounds", "0"],
        ["--temperature", "-1"],
        ["--batch", "64"],
        ["--method", "lyanna"],
    ):
        with pytest.raises(SystemExit):
            main(["--engine", str(engines["draft-lm"]), *bad, "--out", str(tmp_path / "t")])
