"""`benchmarks/policy_replay.py`, run for real on the CPU on a demo engine: a recording's
calls replay to the choices they made and to one fingerprint of the policy's state, a
policy that learns differently (a changed constant) shows another fingerprint though its
choices may not show it yet, and bad input is refused with what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.policy_replay import main
from runtime import step_costs
from runtime.speculation_policy import SOLVE_CAUSES


def test_a_recording_replays_to_its_choices_and_one_fingerprint(
    engines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = tmp_path / "rd.pkl"
    main(["record", "redrafter", "--engine", str(engines["redrafter"]), "--batch", "2", "--max-tokens", "16",
          "--rounds", "1", "--recording", str(recording)])  # fmt: skip

    def replayed(name: str) -> dict:
        out = tmp_path / name
        main(["replay", str(recording), "--reps", "1", "--warm", "--out", str(out)])
        (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
        return row

    first, again = replayed("a"), replayed("b")
    assert first["steps"] > 0 and first["solves"] > 0 and first["differing_choices"] == 0
    assert sum(first["causes"].values()) == first["solves"] and set(first["causes"]) <= set(SOLVE_CAUSES)
    assert first["fingerprint"] == again["fingerprint"] and first["us_per_step"] > 0
    assert f"`{first['fingerprint']}`" in (tmp_path / "a.md").read_text()
    # the wrong variant: a forward's timing moves its price by another weight
    monkeypatch.setattr(step_costs, "FORWARD_EMA", step_costs.FORWARD_EMA / 2)
    assert replayed("c")["fingerprint"] != first["fingerprint"]


def test_bad_input_is_refused_with_what_to_do(
    engines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["record", "redrafter:fixed", "--engine", str(engines["redrafter"]), "--recording", str(tmp_path / "x")])
    assert "record a load-aware one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(tmp_path / "missing.pkl")])
    assert "no such recording" in capsys.readouterr().err
