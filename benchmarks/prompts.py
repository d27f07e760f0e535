"""Prompt sets for load tests: the bundled held-out set, MT-Bench / Spec-Bench and ShareGPT.

The bundled set needs no download and matches what the demo model was trained for (Python
source), so speculation acceptance is meaningful; MT-Bench and ShareGPT files are the
formats vLLM `bench serve` and the speculative-decoding literature report on. Loaders fail
with the file and line (or entry) at fault, since these files are often hand-edited or
converted, and a silently skipped malformed prompt would change the benchmark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.corpus import heldout_prompts


@dataclass
class Prompt:
    text: str
    id: str


def bundled(n: int) -> list[Prompt]:
    """`n` prompts cut from the held-out Python stdlib files (never trained on); deterministic."""
    return [Prompt(text, f"heldout-{i}") for i, text in enumerate(heldout_prompts(n))]


def load_mt_bench(path: str | Path) -> list[Prompt]:
    """MT-Bench / Spec-Bench `question.jsonl`: one `{"question_id": ..., "turns": [str, ...]}`
    per line. Only the first turn is used: later turns depend on the model's first answer."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or "question_id" not in obj or "turns" not in obj:
            raise ValueError(f"{where}: expected an object with 'question_id' and 'turns'")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise ValueError(f"{where}: 'turns' must be a list whose first item is a non-empty string")
        prompts.append(Prompt(turns[0], str(obj["question_id"])))
    return prompts


def load_sharegpt(path: str | Path) -> list[Prompt]:
    """ShareGPT JSON: a list of `{"id": ... (optional), "conversations": [{"from", "value"}, ...]}`.

    The first "human" turn is the prompt; conversations without one are skipped (ShareGPT
    dumps contain some). Entries without an id get their index in the list.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    prompts = []
    for i, entry in enumerate(data):
        where = f"{path}: entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise ValueError(f"{where}: expected an object with a 'conversations' list")
        text = _first_human_turn(entry["conversations"], where)
        if text is not None:
            prompts.append(Prompt(text, str(entry.get("id", i))))
    return prompts


def _first_human_turn(turns: list[Any], where: str) -> str | None:
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or not isinstance(turn.get("value"), str):
            raise ValueError(f"{where}, turn {j}: expected an object with 'from' and a string 'value'")
        if turn["from"] == "human":
            return turn["value"]
    return None


def load_prompts(source: str, n: int | None, seed: int) -> list[Prompt]:
    """Prompts from `source`: "bundled", a `.jsonl` (MT-Bench) or a `.json` (ShareGPT) path.

    `n=None` takes every prompt in the file (the bundled set needs an `n`: it is generated).
    When `n` exceeds the prompts available they are repeated in file order (ids repeat too:
    same prompt, same id); when it is smaller, a random sample without replacement seeded by
    `seed`, so a subset is representative of the file rather than its first lines.
    """
    if n is not None and n < 0:
        raise ValueError(f"number of prompts must be >= 0, got {n}")
    if source == "bundled":
        if n is None:
            raise ValueError("the bundled prompt set needs a number of prompts")
        return bundled(n)
    suffix = Path(source).suffix
    if suffix == ".jsonl":
        prompts = load_mt_bench(source)
    elif suffix == ".json":
        prompts = load_sharegpt(source)
    else:
        raise ValueError(f"prompt source must be 'bundled', a .jsonl (MT-Bench) or a .json (ShareGPT) file: {source}")
    if not prompts:
        raise ValueError(f"{source}: no prompts")
    if n is None or n == len(prompts):
        return prompts
    if n > len(prompts):
        return [prompts[i % len(prompts)] for i in range(n)]
    return [prompts[i] for i in np.random.default_rng(seed).choice(len(prompts), size=n, replace=False)]
