"""The ReDrafter W x L x T sweep, run for real on an engine built from the bundled demo
models with tiny settings: a tree wider than the runtime's default draft budget (W=16,
L=5: 80 drafts > 64) still runs (the sweep sizes the engine for its largest tree; it
once stopped there), every setting has its row, and the report names its command."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.redrafter_sweep import main
from build.engine import build_engine
from runtime.engine_dir import BuildConfig

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_sweep_runs_trees_beyond_the_default_draft_budget(tmp_path: Path) -> None:
    engine = build_engine(MODELS / "demo-target", tmp_path / "rnn", BuildConfig(max_batch_size=1),
                          drafter=MODELS / "demo-redrafter")  # fmt: skip
    out = tmp_path / "sweep"
    argv = ["--engine", str(engine), "--prompts", "1", "--max-tokens", "6", "--widths", "1,16", "--lengths", "5"]
    argv += ["--temperatures", "0", "--out", str(out)]
    main(argv)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [(r["beam_width"], r["beam_length"]) for r in doc["rows"]] == [(1, 5), (16, 5)]
    assert all(r["tau"] >= 1.0 and r["speedup"] > 0 for r in doc["rows"])
    assert doc["meta"]["command"] == "python -m benchmarks.redrafter_sweep " + " ".join(argv)
    assert "Command: `python -m benchmarks.redrafter_sweep" in out.with_suffix(".md").read_text()
