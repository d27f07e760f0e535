"""`benchmarks/churn.py` (`make bench-churn`), run for real on the CPU on an engine built from
the bundled demo models: a row per (method, batch, T), every request of every round decoded
to its own length by both engines, the ratio their tokens/s."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.churn import main


def test_a_row_per_cell_from_both_engines_every_token(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "churn"
    argv = ["--engine", f"redrafter={engines['redrafter']}", "--methods", "redrafter", "--batches", "1", "2"]
    main([*argv, "--temperatures", "0", "--rounds", "1", "--min-tokens", "4", "--max-tokens", "12", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [("redrafter", 1), ("redrafter", 2)]
    for r in rows:
        assert abs(r["ratio"] - r["tok_s"] / r["ar_tok_s"]) < 1e-9 and r["ratio"] > 0
        assert 0 <= r["solved"] <= 1 and r["tokens_per_step"] >= 1 and r["schedule_us"] > 0
    assert "| redrafter | 2 | 0 |" in out.with_suffix(".md").read_text()
