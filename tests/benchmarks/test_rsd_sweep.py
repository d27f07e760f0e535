"""The RSD Exp1/Exp2 sweep, run for real on engines built from the bundled demo models
with tiny settings: both reports are written, every method and drafter has its row, tau
is at least 1 (exactly 1 for auto-regression), the Exp2 trees have exactly B nodes and every
Exp2 shape of a budget runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rsd_sweep import EXP2_BRANCHING, METHODS, exp1_configs, exp2_configs, main
from build.engine import build_engine
from runtime.engine_dir import BuildConfig

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILD = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("engines")
    target = MODELS / "demo-target"
    return [
        build_engine(target, out / "rnn", BUILD, drafter=MODELS / "demo-redrafter"),
        build_engine(target, out / "lm", BUILD, draft_model=MODELS / "demo-draft-lm"),
    ]


def test_tree_shapes() -> None:
    """Exp2 spends exactly B draft tokens per step with every method; Exp1's rsd-c tree is
    (2, 2, 1, ...) cut to L."""
    for c in exp2_configs(list(EXP2_BRANCHING)):
        assert c.draft_tokens == c.column, (c.method, c.shape)
    rsd_c = {c.column: c.branching for c in exp1_configs([2, 3, 5]) if c.method == "rsd-c"}
    assert rsd_c == {2: (2, 2), 3: (2, 2, 1), 5: (2, 2, 1, 1, 1)}


def test_sweep_writes_both_reports(engines: list[Path], tmp_path: Path) -> None:
    main(
        ["--engines", ",".join(map(str, engines)), "--temperatures", "1.0", "--max-tokens", "8", "--num-prompts", "1",
         "--rounds", "1", "--exp", "both", "--lengths", "3", "--budgets", "6", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    for experiment, column in ((1, 3), (2, 6)):
        doc = json.loads((tmp_path / f"rsd_exp{experiment}.json").read_text())
        rows = doc["rows"]
        assert doc["meta"]["machine"]["cpu"]
        assert {(r["drafter"], r["method"]) for r in rows} == {
            (d, m) for d in ("rnn", "draft-lm") for m in ("ar", *METHODS)
        }
        for r in rows:
            assert r["tau"] >= 1.0, r
            assert r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0 and r["speedup"] > 0, r
            if r["method"] == "ar":
                assert r["tau"] == 1.0 and r["speedup"] == 1.0
            else:
                assert r["column"] == column and len(r["speedup_per_round"]) == r["rounds"] == 1
                if experiment == 2:
                    assert r["draft_tokens"] == 6
        if experiment == 2:  # every shape of the budget ran; the report shows the best one's
            shapes = {(r["drafter"], r["method"], r["shape"]) for r in rows}
            assert sum(m == "rsd-c" for _, m, _ in shapes) == 2 * len(EXP2_BRANCHING[6])
        md = (tmp_path / f"rsd_exp{experiment}.md").read_text()
        axis = "L" if experiment == 1 else "B"
        assert f"| drafter | method | {axis}={column} |" in md
        assert "**rnn**" in md and "**draft-lm**" in md and "highest speedup" in md
