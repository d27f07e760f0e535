"""The Lyanna §7 sweep, run for real on engines built from the bundled demo models with
tiny settings: the reports are written and their numbers are sane (conditional
acceptances in [0, 1], tau >= 1, latencies > 0, a missing ablation is skipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.lyanna.table1 import conditional_acceptance
from benchmarks.lyanna_sweep import main, only

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_conditional_acceptance() -> None:
    # steps accepted 0, 1, 3, 3: >=1: 3/4, >=2: 2/3, >=3: 2/2
    assert conditional_acceptance([0, 1, 3, 3], 3) == [0.75, 2 / 3, 1.0]
    assert conditional_acceptance([0, 0], 3) == [0.0, 0.0, 0.0]  # no step reached 1: 0, not a division by 0


def test_only_accepts_repeats_and_comma_lists() -> None:
    assert only(["fig13a,table1", "table2"]) == ["table1", "table2", "fig13a"]
    assert only(None) == ["table1", "fig12", "table2", "fig13a"]
    with pytest.raises(SystemExit):
        only(["table3"])


def test_sweep_table1_and_fig13a(tmp_path: Path) -> None:
    """One thread: on a busy shared runner, intra-op threads waiting for a descheduled sibling
    turn every small op into a scheduler quantum; main() restores the thread count."""
    out = tmp_path / "results"
    threads = torch.get_num_threads()
    main(
        ["--only", "table1,fig13a", "--target", str(MODELS / "demo-target"), "--lyanna", str(MODELS / "demo-lyanna"),
         "--ablation", f"missing={tmp_path / 'no-such-drafter'}", "--engine-dir", str(tmp_path / "engines"),
         "--num-prompts", "1", "--table1-prompts", "1", "--max-tokens", "8", "--rounds", "1", "--ks", "3",
         "--batches", "1,2", "--repeats", "10", "--threads", "1", "--out-dir", str(out)]
    )  # fmt: skip
    assert torch.get_num_threads() == threads
    assert sorted(p.name for p in out.iterdir()) == [
        "lyanna_fig13a.json", "lyanna_fig13a.md", "lyanna_table1.json", "lyanna_table1.md",
    ]  # fmt: skip

    doc = json.loads((out / "lyanna_table1.json").read_text())
    assert doc["meta"]["machine"]["cpu"] and doc["meta"]["skipped"]
    (row,) = doc["rows"]  # the missing ablation is skipped, not an error
    assert row["model"] == "full model"
    assert len(row["conditional_acceptance"]) == 3
    assert all(0.0 <= a <= 1.0 for a in row["conditional_acceptance"]), row
    assert row["reached"][0] == row["steps"] and row["reached"] == sorted(row["reached"], reverse=True)
    assert row["tau"] >= 1.0 and row["steps"] >= 1
    assert 0 < row["drafted_per_step"] <= 16
    md = (out / "lyanna_table1.md").read_text()
    assert "| full model |" in md and "Skipped" in md

    rows = json.loads((out / "lyanna_fig13a.json").read_text())["rows"]
    assert {(r["batch"], r["k"]) for r in rows} == {(1, 3), (2, 3)}
    for r in rows:
        assert r["one_pass_ms"] > 0 and r["per_step_ms"] > 0 and r["ratio"] > 0, r
    assert "per-step / one-pass" in (out / "lyanna_fig13a.md").read_text()
