"""The batch-1 floor, run for real on CPU on engines built from the bundled demo models:
the bytes it counts are the kernels' own weights, its times are positive, and each step
floor adds the drafter's levels to a forward of the chain's tokens."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.floor import TOKENS, main
from plugins.llama_forward import FusedTarget, Int8DraftLM
from runtime.loaded_engine import LoadedEngine


def test_floor_of_every_drafter_kind(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "floor"
    argv = [a for path in engines.values() for a in ("--engine", str(path))]
    main([*argv, "--context", "20", "--repeats", "2", "--out", str(out)])
    assert torch.is_grad_enabled()  # measured under inference mode, not with autograd switched off for its caller
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = {r["engine"]: r for r in doc["rows"]}
    assert doc["meta"]["command"].startswith("python -m benchmarks.floor --engine")
    for kind, path in engines.items():
        row, engine = rows[str(path)], LoadedEngine.load(path)
        fused = FusedTarget.of(engine.model)
        assert fused is not None and row["target_mb"] == pytest.approx(sum(w.nbytes for w in fused.small) / 1e6)
        for mode in ("cold", "hot"):
            assert sorted(int(n) for n in row[f"forward_ms_{mode}"]) == list(TOKENS)
            assert all(ms > 0 for ms in row[f"forward_ms_{mode}"].values())
        assert row["drafter"] == kind
        floors = {f["drafts"]: f for f in row["floors"]}
        assert sorted(floors) == [1, 5, 15]
        for f in floors.values():
            assert f["tau_for_2x"] == pytest.approx(2 * f["over_forward1"])
        if kind == "lyanna":  # no one-beam chain op: forward-only floors, no drafter columns
            assert "level_ms_cold" not in row
            assert floors[5]["step_ms"] == pytest.approx(row["forward_ms_cold"]["6"])
            continue
        for mode in ("cold", "hot"):  # the line is fitted through the calls' timings (2 each here: on a busy
            times = row[f"levels_ms_{mode}"]  # machine its slope can even dip below 0, so no sign is asserted)
            assert sorted(int(n) for n in times) == [1, 2, 3, 4, 5] and all(ms > 0 for ms in times.values())
            fit = statistics.linear_regression([int(n) for n in times], list(times.values()))
            assert (row[f"level_ms_{mode}"], row[f"call_ms_{mode}"]) == pytest.approx(tuple(fit))
        if kind == "draft-lm":
            assert engine.draft_model is not None
            lm = Int8DraftLM.of(engine.draft_model)
            assert lm is not None
            assert row["drafter_mb"] == pytest.approx(sum(w.blocked.nbytes for w in lm.linears) / 1e6)
        else:
            assert row["drafter_mb"] > 1.0  # the head alone: 8192 x 384 int8
        # the floor of a 5-token chain: a 6-token forward (a timed size) plus one call of 5 levels
        want = row["forward_ms_cold"]["6"] + 5 * row["level_ms_cold"] + row["call_ms_cold"]
        assert floors[5]["step_ms"] == pytest.approx(want)
        assert floors[5]["over_forward1"] == pytest.approx(want / row["forward_ms_cold"]["1"])
    md = out.with_suffix(".md").read_text()
    assert md.count("| `") == 3 + 3 * 3  # a row per engine, three floors each
    assert "| - | - | - | - |" in md  # Lyanna's drafter columns
