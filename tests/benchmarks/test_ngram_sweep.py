"""The n-gram sweep, run for real on a target-only engine built from the bundled demo target
with tiny settings: the report has a row per setting, tau >= 1, and the command that
reproduces it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.ngram_sweep import main
from build.engine import build_engine
from runtime.engine_dir import BuildConfig

TARGET = Path(__file__).resolve().parents[2] / "models" / "demo-target"


def test_sweep_writes_its_report(tmp_path: Path) -> None:
    engine = build_engine(TARGET, tmp_path / "demo", BuildConfig(max_batch_size=2))
    out = tmp_path / "ngram"
    argv = ["--engine", str(engine), "--prompts", "2", "--max-tokens", "6", "--batches", "1", "2"]
    main([*argv, "--temperatures", "0", "--out", str(out)])
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [(r["batch"], r["temperature"], r["num_draft_tokens"]) for r in doc["rows"]] == [(1, 0.0, 4), (2, 0.0, 4)]
    assert all(r["tau"] >= 1.0 and r["speedup"] > 0 for r in doc["rows"])
    assert doc["meta"]["command"].startswith("python -m benchmarks.ngram_sweep --engine")
    assert "| batch | T | k |" in out.with_suffix(".md").read_text()
