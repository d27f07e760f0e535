"""`benchmarks/acceptance_by_position.py`, run for real on the CPU on the ReDrafter demo engine:
every verified tree lands in the bucket of the tokens its request had emitted before it (read
back from each request's own record), and bad input is refused with what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.acceptance_by_position import bucketed, main, positions
from runtime.results import GenerationResult


def test_a_requests_steps_are_placed_by_the_tokens_before_them() -> None:
    """The first token comes from the prefill; each step emits its kept drafts and one more;
    a step that drafted nothing (size 1) is no tree."""
    result = GenerationResult([1], accepted_per_step=[2, 0, 0, 3], sizes_per_step=[6, 1, 6, 6])
    assert positions(result) == [(1, 2), (5, 0), (6, 3)]
    rows = bucketed([(1, 2), (5, 0), (6, 3)], width=4, most=12)
    assert [(r.first, r.last, r.trees, r.kept) for r in rows] == [(0, 3, 1, 2.0), (4, 7, 2, 1.5)]


def test_every_tree_is_reported_by_position(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "abp"
    main(["redrafter:fixed[beam_width=1]", "--engine", str(engines["redrafter"]), "--batch", "2",
          "--prompts", "4", "--max-tokens", "12", "--bucket", "4", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = doc["rows"]
    assert rows and all(0 <= r["kept"] <= 5 and r["tokens_per_step"] == pytest.approx(r["kept"] + 1) for r in rows)
    assert rows[0]["first"] == 0 and sum(r["trees"] for r in rows) >= 4  # every request drafts at least once
    again = tmp_path / "twice"
    main(["redrafter:fixed[beam_width=1]", "--engine", str(engines["redrafter"]), "--batch", "2",
          "--prompts", "4", "--max-tokens", "12", "--bucket", "4", "--rounds", "2", "--out", str(again)])  # fmt: skip
    twice = json.loads(again.with_suffix(".json").read_text())["rows"]
    assert sum(r["trees"] for r in twice) == 2 * sum(r["trees"] for r in rows)  # T=0: the same trees again
    assert doc["meta"]["command"].startswith("python -m benchmarks.acceptance_by_position")
    assert "| tokens emitted before | trees |" in out.with_suffix(".md").read_text()


def test_bad_input_is_refused_with_what_to_do(
    engines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, says in (
        (["redrafter"], "measure a fixed one"),
        (["redrafter:fixed", "--bucket", "0"], "must be >= 1"),
        (["redrafter:fixed", "--engine", str(tmp_path / "none")], "make engine"),
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--engine", str(engines["redrafter"])] if "--engine" not in argv else argv)
        assert says in capsys.readouterr().err
