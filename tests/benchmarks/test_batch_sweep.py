"""The batch sweep, run for real for a method other than ReDrafter (n-gram drafting on a
target-only engine built from the bundled demo target, tiny settings): AR, fixed (and a
second fixed setting, `--fixed-also`) and load-aware rows per batch size, named after the
method, with the command that reproduces them and load-aware against the best of AR and
the fixed ones; a method the engine cannot run is refused with the fix."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.batch_sweep import configs, main, parse_settings, round_runs
from benchmarks.device_sweep import run_cell
from benchmarks.timing import Run, alternate, batch_rounds
from build.engine import build_engine
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import GenerationResult

TARGET = Path(__file__).resolve().parents[2] / "models" / "demo-target"


def test_sweep_of_another_method_writes_its_report(tmp_path: Path) -> None:
    engine = build_engine(TARGET, tmp_path / "demo", BuildConfig(max_batch_size=2))
    out = tmp_path / "sweep"
    argv = ["--engine", str(engine), "--method", "ngram", "--batch-sizes", "1,2", "--max-tokens", "6"]
    argv += ["--rounds", "2", "--min-prompts", "2", "--out", str(out), "--fixed-also", "num_draft_tokens=1"]
    main(argv)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [r["batch_size"] for r in doc["rows"]] == [1, 2]
    also = "ngram-fixed[num_draft_tokens=1]"
    for row in doc["rows"]:
        assert set(row["tokens_per_s"]) == {"ar", "ngram-fixed", also, "ngram-load-aware"}
        assert row["tau"]["ar"] == 1.0 and row["tau"]["ngram-fixed"] >= 1.0
        assert 1.0 <= row["tau"][also] <= 2.0  # one drafted token a step at most
        for split in row["phases"].values():  # where the time goes: both kinds of step, shares summing to 1
            assert set(split) == {"prefilling", "decoding"}
            assert sum(k["share"] for k in split.values()) == pytest.approx(1.0)
            assert all(k["ms_per_token"] > 0 for k in split.values())
    assert doc["meta"]["method"] == "ngram"
    assert doc["meta"]["command"] == "python -m benchmarks.batch_sweep " + " ".join(argv)
    assert "method `ngram`" in out.with_suffix(".md").read_text()
    report = out.with_suffix(".md").read_text()
    assert "| 2 | ngram-load-aware |" in report and f"| {also} / AR |" in report
    best = max(1.0, *(doc["rows"][0]["ratio_to_ar"][n] for n in ("ngram-fixed", also)))
    aware = doc["rows"][0]["ratio_to_ar"]["ngram-load-aware"]
    assert "load-aware / best of AR and fixed" in report and f" | {aware / best:.2f} | " in report
    rounds = doc["rows"][0]["round_ratios"]["ngram-load-aware"]  # each round's ratio, their median the cell's
    assert len(rounds) == 2 and aware == pytest.approx(sum(rounds) / 2)
    assert f" | {aware:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) | " in report
    assert parse_settings("beam_width=1,packing=false,x=0.5,y=a") == {
        "beam_width": 1,
        "packing": False,
        "x": 0.5,
        "y": "a",
    }
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        parse_settings("beam_width")
    with pytest.raises(SystemExit, match="does not speculate"):
        main(["--engine", str(engine), "--method", "sd", "--out", str(out)])


def test_rounds_rotate_which_configuration_runs_first() -> None:
    """`alternate`: round i starts at its i-th configuration, so a machine that speeds up or
    slows down within a round favours none of them; every run is still compared to its
    own round's AR."""
    order: list[str] = []

    def run(name: str, seconds: float) -> Callable[[], Run]:
        return lambda: (order.append(name), Run([GenerationResult([1], [2] * 10)], seconds))[1]

    rounds = [{"ar": run("ar", 1.0), "a": run("a", 0.5), "b": run("b", 2.0)}] * 3
    timings = alternate(rounds, "ar")
    assert order == ["ar", "a", "b", "a", "b", "ar", "b", "ar", "a"]
    assert timings["a"].ratios == [2.0] * 3 and timings["b"].ratios == [0.5] * 3


def test_each_round_seeds_its_requests_apart_and_alike_for_every_configuration(tmp_path: Path) -> None:
    """At T > 0 the text, and so acceptance, follows the seeds: every configuration of a
    round decodes the same seeds, and each round other seeds than the rounds before (one
    seed set for every round let a lucky set make fixed sd chains look ~7% faster)."""
    loaded = LoadedEngine.load(build_engine(TARGET, tmp_path / "demo", BuildConfig(max_batch_size=2)))
    engines = {name: LLMEngine(loaded) for name in configs("ngram")}
    prompts = [[5, 6, 7], [8, 9]]
    seeds = []
    for i in range(2):
        runs = round_runs(engines, configs("ngram"), prompts, 4, 1.0, i)
        params = {name: run.args[2] for name, run in runs.items()}
        assert all(p is params["ar"] for p in params.values())
        seeds.append([p.seed for p in params["ar"]])
        run = runs["ngram-fixed"]()
        assert [len(r.output_ids) for r in run.results] == [4, 4]
    assert seeds == [[0, 1], [2, 3]]


@dataclass(frozen=True)
class _Method:
    method: str

    def overrides(self) -> dict[str, object]:
        return {}


def test_bracketed_and_alternating_rounds_seed_each_round_apart(tmp_path: Path) -> None:
    """The other sweeps' rounds (`batch_rounds`, which `bracketed_round` runs for the RSD and
    Lyanna sweeps too, and the device sweep's `run_cell`) seed like `round_runs`: at T=1 the
    two AR runs around a round's configurations decode the same text, and the next round
    another."""
    loaded = LoadedEngine.load(build_engine(TARGET, tmp_path / "demo", BuildConfig(max_batch_size=2)))
    prompts = [[5, 6, 7], [8, 9]]
    _, ar = batch_rounds(loaded, 2, prompts, [_Method("ngram")], 6, [1.0], 2)[1.0]
    texts = [[r.output_ids for r in run.results] for run in ar.runs]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    cell = run_cell(LLMEngine(loaded), ["ar", "ngram"], prompts, 1.0, 6, 2)
    assert [[r.output_ids for r in run.results] for run in cell["ar"].runs] == [texts[0], texts[2]]
