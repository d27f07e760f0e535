"""`benchmarks/compiled_forward.py`, run for real on the CPU on the demo target: the target's
forward traces as one graph (the custom ops through their fakes, no graph break), every way
of running it gives eager's logits, and the report holds a row per way and token count."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch._dynamo

from benchmarks.compiled_forward import main, model_forward, plain, prepared
from runtime.loaded_engine import LoadedEngine


def test_the_targets_forward_traces_as_one_graph(engines: dict[str, Path]) -> None:
    with torch.inference_mode():
        engine, bare = LoadedEngine.load(engines["redrafter"]), LoadedEngine.load(engines["redrafter"])
        for model in (engine.model, plain(bare.model)):
            cache, step = prepared(model, 3, 20)  # (its ops asked eagerly first, as in the engine)
            explained = torch._dynamo.explain(model_forward)(model, cache, step)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_every_way_gives_eagers_logits(engines: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "compiled"
    main(["--engine", str(engines["redrafter"]), "--tokens", "2", "--context", "20", "--repeats", "1",
          "--out", str(out)])  # fmt: skip
    assert torch.is_grad_enabled()  # measured under inference mode, not switched off for its caller
    doc = json.loads(out.with_suffix(".json").read_text())
    ways = ["c++ op", "eager", "eager, plain", "inductor", "inductor, frozen"]
    assert [(r["tokens"], r["way"]) for r in doc["rows"]] == [(2, w) for w in ways]
    for r in doc["rows"]:
        assert r["same_argmax"] and r["max_abs_diff"] < 1e-3 and r["ms"] > 0, r
    assert "| 2 | inductor, frozen |" in out.with_suffix(".md").read_text()
