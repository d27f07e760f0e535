"""`benchmarks/no_draft.py` (`make bench-no-draft`), run for real on the CPU on engines built
from the bundled demo models: a row per (method, batch, T) whose ratio is the method's steady
no-draft milliseconds over AR's, each the sum of its phases, AR's steady steps every decoding
step past the prefill's few."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.no_draft import main
from runtime.speculation_policy import AFTER_PREFILL
from runtime.step_clock import PHASES

TOKENS, ROUNDS = 24, 2


def test_a_row_per_cell_with_the_ratio_of_its_phases(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "no_draft"
    kinds = ["--engine", f"lyanna={engines['lyanna']}", "--engine", f"redrafter={engines['redrafter']}"]
    main([*kinds, "--methods", "lyanna", "ngram", "--batches", "1", "2", "--temperatures", "1",
          "--max-tokens", str(TOKENS), "--rounds", str(ROUNDS), "--out", str(out)])  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [("lyanna", 1), ("lyanna", 2), ("ngram", 1), ("ngram", 2)]
    for r in rows:
        # one prefill step a round, then TOKENS - 1 decoding steps; steady past AFTER_PREFILL of them
        assert r["ar_steps"] == ROUNDS * (TOKENS - 1 - AFTER_PREFILL), r
        assert set(r["phases_ms"]) == set(r["ar_phases_ms"]) == set(PHASES)
        assert math.isclose(r["ar_ms"], sum(r["ar_phases_ms"].values()), rel_tol=1e-3)
        assert 0 <= r["drafted"] <= 1
        if r["steps"]:
            assert math.isclose(r["ms"], sum(r["phases_ms"].values()), rel_tol=1e-3)
            assert math.isclose(r["ratio"], r["ms"] / r["ar_ms"], rel_tol=1e-3) and r["ratio"] > 0
            assert r["median_ratio"] > 0
        else:
            assert r["ratio"] is None and r["median_ratio"] is None and r["drafted"] > 0
    assert any(r["steps"] for r in rows), "some cell should have had steady no-draft steps"
    md = out.with_suffix(".md").read_text()
    assert "| method | batch | T | no-draft / AR | medians' ratio |" in md and md.count("\n| lyanna | ") == 2


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--engine", f"medusa={tmp_path}", "--out", str(tmp_path / "n")])
    with pytest.raises(SystemExit):
        main(["--rounds", "0", "--out", str(tmp_path / "n")])
