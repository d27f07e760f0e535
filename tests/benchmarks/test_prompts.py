"""Prompt loaders: each format parses, malformed files fail naming the place, sizing is as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.prompts import Prompt, bundled, load_mt_bench, load_prompts, load_sharegpt


def _write_mt_bench(path: Path, n: int) -> Path:
    lines = [
        json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"q{i}", "follow-up"]}) for i in range(n)
    ]
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")  # with a blank line
    return path


def _write_sharegpt(path: Path) -> Path:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "second"}]},
    ]
    path.write_text(json.dumps(data))
    return path


def test_mt_bench_first_turns(tmp_path: Path) -> None:
    prompts = load_mt_bench(_write_mt_bench(tmp_path / "question.jsonl", 4))
    assert prompts == [Prompt(f"q{i}", str(81 + i)) for i in range(4)]


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"turns": ["x"]}), "question_id"),
        (json.dumps({"question_id": 9}), "turns"),
        (json.dumps({"question_id": 9, "turns": []}), "turns"),
        (json.dumps({"question_id": 9, "turns": [3]}), "turns"),
        (json.dumps(["a list"]), "question_id"),
    ],
)
def test_mt_bench_malformed_line_named(tmp_path: Path, bad_line: str, match: str) -> None:
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["ok"]}) + "\n\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=match) as err:
        load_mt_bench(path)
    assert f"{path}:3" in str(err.value)


def test_sharegpt_first_human_turns(tmp_path: Path) -> None:
    prompts = load_sharegpt(_write_sharegpt(tmp_path / "sg.json"))
    assert prompts == [Prompt("hi", "a"), Prompt("second", "2")]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('[{"conversations": []},\n  {', "sg.json:2: not valid JSON"),
        (json.dumps({"conversations": []}), "expected a JSON list"),
        (json.dumps([{"id": "x"}]), "entry 0: expected an object with a 'conversations' list"),
        (json.dumps([{"conversations": []}, {"conversations": [{"value": "v"}]}]), "entry 1, turn 0"),
        (json.dumps([{"conversations": [{"from": "human", "value": None}]}]), "entry 0, turn 0"),
    ],
)
def test_sharegpt_malformed(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "sg.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_sharegpt(path)
    assert str(path) in str(err.value)


def test_bundled_set() -> None:
    prompts = bundled(12)
    assert [p.id for p in prompts] == [f"heldout-{i}" for i in range(12)]
    assert all(p.text.strip() for p in prompts)
    assert load_prompts("bundled", 12, seed=5) == prompts


def test_load_prompts_dispatch_and_sizing(tmp_path: Path) -> None:
    mt = str(_write_mt_bench(tmp_path / "question.jsonl", 10))
    everything = load_mt_bench(mt)
    assert load_prompts(mt, None, seed=0) == everything
    assert load_prompts(mt, 10, seed=0) == everything
    assert load_prompts(str(_write_sharegpt(tmp_path / "sg.json")), None, seed=0) == [
        Prompt("hi", "a"),
        Prompt("second", "2"),
    ]

    cycled = load_prompts(mt, 25, seed=0)
    assert [p.id for p in cycled] == [p.id for p in everything] * 2 + [p.id for p in everything[:5]]

    sample = load_prompts(mt, 4, seed=3)
    assert len({p.id for p in sample}) == 4 and all(p in everything for p in sample)
    assert load_prompts(mt, 4, seed=3) == sample
    assert any(load_prompts(mt, 4, seed=s) != sample for s in range(4, 10))


def test_load_prompts_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a number"):
        load_prompts("bundled", None, seed=0)
    with pytest.raises(ValueError, match=">= 0"):
        load_prompts("bundled", -1, seed=0)
    with pytest.raises(ValueError, match="bundled"):
        load_prompts(str(tmp_path / "prompts.txt"), 3, seed=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(empty), 3, seed=0)
