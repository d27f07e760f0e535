"""What the Lyanna reports share: the tree shape of the paper's runs, the engines they build,
and per-step counts of a set of results."""

from __future__ import annotations

from pathlib import Path

from build.engine import build_engine
from runtime.engine_dir import BuildConfig
from runtime.results import GenerationResult

DEPTH, WIDTH = 3, 4
"""Lyanna's drafting depth k and tree width (Algorithm 1 keeps WIDTH nodes per level)."""
BUILD = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)


def build(target: Path, out: Path, lyanna: Path | None = None, redrafter: Path | None = None) -> Path:
    """A batch-1 engine of `target` with a Lyanna or a ReDrafter drafter, (re)built into `out`."""
    return build_engine(target, out, BUILD, force=True, lyanna=lyanna, drafter=redrafter)


def steps_of(results: list[GenerationResult]) -> list[int]:
    """Drafted tokens accepted at every decoding step of `results`."""
    return [a for r in results for a in r.accepted_per_step]


def drafted_per_step(results: list[GenerationResult]) -> float:
    """Mean drafted nodes verified per decoding step (tree nodes without the root)."""
    return sum(r.num_drafted for r in results) / max(1, len(steps_of(results)))


def ints(text: str) -> list[int]:
    """A comma list of integers (a CLI value)."""
    return [int(x) for x in text.split(",")]
