"""The device sweep, run for real on CPU on engines built from the bundled demo models
(one per drafter kind) with tiny settings: every supported (method, batch, temperature)
cell is there, ratios are positive, tau >= 1 (exactly 1 for AR), and greedy outputs of
every method equal AR's for every prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pytest import CaptureFixture

from benchmarks.device_sweep import cast, main
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.registry import METHODS

EXPECTED = {  # drafter kind -> methods its engine runs (ngram needs no drafter: every engine)
    "redrafter": {"ar", "redrafter", "rsd-c", "rsd-s", "sd", "ngram"},
    "draft-lm": {"ar", "redrafter", "rsd-c", "rsd-s", "sd", "ngram"},
    "lyanna": {"ar", "lyanna", "ngram"},
}


def test_greedy_sweep_every_engine(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "device_sweep"
    argv = [a for path in engines.values() for a in ("--engine", str(path))]
    main(
        [*argv, "--device", "cpu", "--batch-sizes", "1,2", "--temperatures", "0", "--max-tokens", "8",
         "--rounds", "1", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    meta, rows = doc["meta"], doc["rows"]
    assert meta["machine"]["cpu"] and meta["command"].startswith("python -m benchmarks.device_sweep --engine")
    assert meta["args"]["batch_sizes"] == "1,2" and meta["device"] == "cpu"
    for kind, path in engines.items():
        info = meta["engines"][str(path)]
        assert info["drafter"] == kind and set(info["methods"]) == EXPECTED[kind], info
        assert set(info["skipped"]) == set(METHODS) - EXPECTED[kind], info
        cells = {(r["method"], r["batch_size"], r["temperature"]) for r in rows if r["engine"] == str(path)}
        assert cells == {(m, b, 0.0) for m in EXPECTED[kind] for b in (1, 2)}
    for r in rows:
        assert r["ratio_to_ar"] > 0 and r["tokens_per_s"] > 0 and r["tau"] >= 1.0, r
        assert r["greedy_equal_ar"] == r["prompts"] == r["batch_size"], r  # lossless: greedy == AR, every prompt
        assert r["output_tokens"] == 8 * r["batch_size"] and not r["errors"], r
        if r["method"] == "ar":
            assert r["tau"] == 1.0 and r["ratio_to_ar"] == 1.0
    md = out.with_suffix(".md").read_text()
    assert "WARNING" not in md and md.count("| T | batch | AR tok/s |") == 3
    assert "| lyanna tok/s | lyanna ratio | lyanna tau | lyanna greedy==AR |" in md


def test_sampled_sweep_cast_to_float32(engines: dict[str, Path], tmp_path: Path, capsys: CaptureFixture[str]) -> None:
    """At T > 0 there is no exactness column; --dtype float32 casts the bfloat16 Lyanna
    drafter and its hot-token table too. The report is rewritten after every cell but
    printed once, at the end."""
    out, threads = tmp_path / "device_sweep", torch.get_num_threads()
    main(
        ["--engine", str(engines["lyanna"]), "--device", "cpu", "--batch-sizes", "2", "--temperatures", "1",
         "--max-tokens", "8", "--rounds", "1", "--dtype", "float32", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    assert torch.get_num_threads() == threads  # --threads is restored (main runs in-process)
    assert capsys.readouterr().out.count("# AR vs every method") == 1
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(r["method"], r["batch_size"], r["temperature"]) for r in rows} == {(m, 2, 1.0) for m in EXPECTED["lyanna"]}
    for r in rows:
        assert r["greedy_equal_ar"] is None and r["ratio_to_ar"] > 0 and r["tau"] >= 1.0, r
    md = out.with_suffix(".md").read_text()
    assert "| 1 | 2 | " in md and md.rstrip().endswith(" | - |")  # no exactness at T > 0


def test_cast_reaches_every_drafter_kind(engines: dict[str, Path]) -> None:
    """--dtype casts the target, the drafter of each kind and Lyanna's hot-token table."""
    for path in engines.values():
        engine = LoadedEngine.load(path)
        cast(engine, torch.float16)
        modules = [engine.model, engine.redrafter, engine.draft_model, engine.lyanna_drafter]
        for module in (m for m in modules if m is not None):
            assert {p.dtype for p in module.parameters()} == {torch.float16}, path
        if engine.token_table is not None:
            assert engine.token_table.table.dtype == torch.float16


def test_methods_narrow_the_sweep(engines: dict[str, Path], tmp_path: Path) -> None:
    """`--methods` compares only those with AR (a GPU's device time is scarce): one method's
    cells, no others tried or listed as skipped, and the command that repeats the run names
    it; an unknown method is refused with the valid ones."""
    out = tmp_path / "device_sweep"
    main(
        ["--engine", str(engines["draft-lm"]), "--methods", "sd", "--device", "cpu", "--batch-sizes", "1",
         "--temperatures", "0", "--max-tokens", "4", "--rounds", "1", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    doc = json.loads(out.with_suffix(".json").read_text())
    assert {r["method"] for r in doc["rows"]} == {"ar", "sd"}
    info = doc["meta"]["engines"][str(engines["draft-lm"])]
    assert info["methods"] == ["ar", "sd"] and info["skipped"] == {}
    assert "--methods sd" in doc["meta"]["command"]
    with pytest.raises(SystemExit):
        main(["--engine", str(engines["draft-lm"]), "--methods", "sd,eagle", "--out", str(out)])
