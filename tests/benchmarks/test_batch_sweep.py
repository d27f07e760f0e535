"""The batch sweep, run for real for a method other than ReDrafter (n-gram drafting on a
target-only engine built from the bundled demo target, tiny settings): AR, fixed and
load-aware rows per batch size, named after the method, with the command that reproduces
them; a method the engine cannot run is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.batch_sweep import main
from build.engine import build_engine
from runtime.engine_dir import BuildConfig

TARGET = Path(__file__).resolve().parents[2] / "models" / "demo-target"


def test_sweep_of_another_method_writes_its_report(tmp_path: Path) -> None:
    engine = build_engine(TARGET, tmp_path / "demo", BuildConfig(max_batch_size=2))
    out = tmp_path / "sweep"
    argv = ["--engine", str(engine), "--method", "ngram", "--batch-sizes", "1,2", "--max-tokens", "6"]
    argv += ["--rounds", "1", "--min-prompts", "2", "--out", str(out)]
    main(argv)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [r["batch_size"] for r in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        assert set(row["tokens_per_s"]) == {"ar", "ngram-fixed", "ngram-load-aware"}
        assert row["tau"]["ar"] == 1.0 and row["tau"]["ngram-fixed"] >= 1.0
    assert doc["meta"]["method"] == "ngram"
    assert doc["meta"]["command"] == "python -m benchmarks.batch_sweep " + " ".join(argv)
    assert "method `ngram`" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="does not speculate"):
        main(["--engine", str(engine), "--method", "sd", "--out", str(out)])
