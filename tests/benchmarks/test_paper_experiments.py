"""The paper-experiment benchmarks, run for real with tiny settings on engines built from the
bundled demo models: ReDrafter's W x batch grid with and without packing (Table 5 / Fig. 6),
its KD-labels table (Table 6) and Lyanna's throughput vs batch size (Figs. 8-11). Each
writes its JSON and markdown with a cell per configuration; unpacked trees verify more
nodes than packed ones at the same tau (greedy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import lyanna_throughput, redrafter_grid, redrafter_kd
from tests.demo_engines import MODELS


def test_redrafter_grid(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "grid"
    redrafter_grid.main(
        ["--engine", str(engines["redrafter"]), "--batch-sizes", "1,2", "--widths", "1,4", "--min-prompts", "2",
         "--max-tokens", "8", "--rounds", "1", "--out", str(out)]
    )  # fmt: skip
    cells = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(c["batch_size"], c["beam_width"], c["packing"]) for c in cells} == {
        (b, w, p) for b in (1, 2) for w, p in ((1, True), (4, True), (4, False))
    }
    for b in (1, 2):
        packed, plain = (next(c for c in cells if (c["batch_size"], c["beam_width"], c["packing"]) == (b, 4, p))
                         for p in (True, False))  # fmt: skip
        assert plain["tau"] == packed["tau"] > 1.0
        assert plain["nodes_per_step"] == 17 > packed["nodes_per_step"]
    assert "W=4 unpacked" in out.with_suffix(".md").read_text()


def test_redrafter_kd_table(engines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "kd"
    argv = ["redrafter_kd", "--drafter", f"greedy={MODELS / 'demo-redrafter'}", "--prompts", "2", "--max-tokens", "8",
            "--engine-dir", str(tmp_path / "engines"), "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    redrafter_kd.main()
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["kd"] == "greedy" and len(row["heldout_top1_agreement"]) == 5
    assert [r["temperature"] for r in row["runs"]] == [0.0, 1.0] and all(r["tau"] >= 1 for r in row["runs"])
    assert row["rsd_s"]["temperature"] == 1.0 and row["rsd_s"]["tau"] >= 1
    with pytest.raises(SystemExit, match="no trained drafter"):
        redrafter_kd.drafters([f"x={tmp_path}"])


def test_lyanna_throughput(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "lt"
    lyanna_throughput.main(
        ["--lyanna-engine", str(engines["lyanna"]), "--draft-lm-engine", str(engines["draft-lm"]),
         "--redrafter-engine", str(engines["redrafter"]), "--batch-sizes", "1,2", "--temperatures", "0",
         "--min-prompts", "2", "--max-tokens", "8", "--rounds", "1", "--out", str(out)]
    )  # fmt: skip
    cells = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(c["method"], c["batch_size"]) for c in cells} == {
        (m, b) for m in ("lyanna", "ngram", "sd", "redrafter") for b in (1, 2)
    }
    assert all(c["speedup"] > 0 and c["tau"] >= 1 for c in cells)
    assert "| lyanna |" in out.with_suffix(".md").read_text()
