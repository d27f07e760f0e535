"""`benchmarks/first_round.py`, run for real on the CPU on the ReDrafter demo engine: a row per
fresh engine and one for the fixed reference, each with its slowest request's steps, and bad
input refused with what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.first_round import main
from runtime.speculation_policy import SOLVE_CAUSES


def test_each_fresh_engine_and_the_reference_decode_one_round(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fr"
    main(["--engine", str(engines["redrafter"]), "--batch", "2", "--engines", "2", "--max-tokens", "12",
          "--out", str(out)])  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = doc["rows"]
    assert [r["engine"] for r in rows] == [-1, 0, 1]
    reference, *fresh = rows
    assert reference["config"] == "redrafter:fixed[beam_width=1]" and reference["plain_share"] == 0.0
    assert reference["solves"] == {}  # a fixed policy never solves
    for r in fresh:
        assert 1 <= r["slowest_steps"] <= 11 and 0.0 <= r["plain_share"] <= 1.0  # 12 tokens: the first from prefill
        assert r["solves"] and set(r["solves"]) <= set(SOLVE_CAUSES)
    assert "| reference | `redrafter:fixed[beam_width=1]` |" in out.with_suffix(".md").read_text()


def test_bad_input_is_refused_with_what_to_do(
    engines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, says in (
        (["--engines", "0"], "must be >= 1"),
        (["--rounds", "2"], "run more engines"),
        (["--engine", str(tmp_path / "none")], "make engine"),
        (["redrafter:warp"], "expected"),
    ):
        with pytest.raises(SystemExit):
            main(argv if "--engine" in argv else [*argv, "--engine", str(engines["redrafter"])])
        assert says in capsys.readouterr().err
