"""`benchmarks/step_profile.py` (`make profile`), run for real on the CPU on engines built
from the bundled demo models: a row per (method, batch) with each phase's milliseconds
within the step's, AR's no-draft steps every decoding step (ratio 1 to itself), steady
ones among them, and each method compared with AR on its own engine; each row's steps by
kind, whose phases add up to the row's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.step_profile import main
from runtime.step_clock import PHASES


def test_a_row_per_method_and_batch(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "step_profile"
    kinds = ["--engine", f"redrafter={engines['redrafter']}", "--engine", f"draft-lm={engines['draft-lm']}"]
    main([*kinds, "--methods", "ar", "redrafter", "sd", "--batches", "1", "2", "--max-tokens", "12", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    cells = [(r["method"], Path(r["engine"]).name, r["batch"]) for r in rows]
    assert cells == [  # AR just before the methods of each engine
        ("ar", "rnn", 1), ("redrafter", "rnn", 1), ("ar", "rnn", 2), ("redrafter", "rnn", 2),
        ("ar", "lm", 1), ("sd", "lm", 1), ("ar", "lm", 2), ("sd", "lm", 2),
    ]  # fmt: skip
    for r in rows:
        assert set(r["phases_ms"]) == set(PHASES)
        assert 0 < sum(r["phases_ms"].values()) <= r["ms_per_step"] * 1.05, r
        assert r["tau"] >= 1 and r["tokens_per_s"] > 0
        if r["method"] == "ar":
            assert r["tau"] == 1 and r["plain_steps"] == r["steps"] - 1  # every step but the prefill
            assert 0 < r["steady_steps"] < r["plain_steps"] and r["steady_ms"] > 0
        kinds = r["kinds"]
        # the kinds partition the row's steps and time: prefill, then (AR) plain only
        assert sum(k["steps"] for k in kinds.values()) == r["steps"], r
        assert abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-3, r
        for k in kinds.values():
            assert abs(sum(k["phases_ms"].values()) - k["ms"]) < 1e-3 * max(k["ms"], 1), k
        steps_ms = sum(k["ms"] * k["steps"] for k in kinds.values()) / r["steps"]
        assert abs(steps_ms - sum(r["phases_ms"].values())) < 0.01 * steps_ms, (steps_ms, r["phases_ms"])
        if r["method"] == "ar":
            assert list(kinds) == ["prefill", "plain"] and kinds["plain"]["steps"] == r["plain_steps"], kinds
        else:  # greedy ReDrafter and sd chains pay at batch 1 and 2: load-aware drafts
            assert kinds["prefill"]["steps"] >= 1 and kinds["drafting"]["steps"] >= 1, kinds
    md = out.with_suffix(".md").read_text()
    assert "| no-draft / AR | steady no-draft / AR (steps) | sizes |" in md
    assert md.count("| ar (") == 4 + 8 and "| 1.00x | " in md  # 4 rows, each 2 kinds below
    assert "| method | batch | T | kind | steps | share | ms a step | schedule |" in md


def test_an_engine_kind_it_does_not_know_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--engine", f"medusa={tmp_path}", "--methods", "ar", "--out", str(tmp_path / "p")])
