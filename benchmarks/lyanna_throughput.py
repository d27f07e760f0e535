"""Lyanna Figs. 8-11 analogue: throughput vs batch size of Lyanna against SD with the draft
LM, prompt lookup (n-gram) and ReDrafter, each over auto-regression on its own engine.

    python -m benchmarks.lyanna_throughput

Each method runs on the engine of its drafter (Lyanna and n-gram: engines/demo-lyanna; SD:
engines/demo-draft-lm; ReDrafter: engines/demo-redrafter; `--KIND-engine` picks others),
all holding the same demo target, with the method's default tree and fixed speculation (the paper's setting: the
method's own throughput, not the load-aware policy's choice). For each batch size B and
temperature, max(B, --min-prompts) held-out prompts are decoded with at most B running at
once (in-flight batching), fixed output length (EOS ignored), each prompt seeded by its
index. AR is timed on the same engine before and after the engine's methods
(`bracketed_round`); a method's ratio is its tokens/s over the mean of the two AR rates
around it, median over rounds. Reported per cell: speedup over AR / tau (tokens per step
per request). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from benchmarks.timing import batch_rounds
from runtime.loaded_engine import LoadedEngine
from runtime.results import tokens_per_step
from training.corpus import heldout_prompts

ENGINE_METHODS = {"lyanna": ("lyanna", "ngram"), "draft-lm": ("sd",), "redrafter": ("redrafter",)}
"""drafter kind of an engine -> the methods run on it (each engine's AR is its methods' baseline)."""
METHOD_ORDER = ("lyanna", "sd", "ngram", "redrafter")


@dataclass(frozen=True)
class Config:
    method: str

    def overrides(self) -> dict[str, Any]:
        return {}


@dataclass
class Cell:
    engine: str
    method: str
    batch_size: int
    temperature: float
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float
    """Median over rounds of the ratio to the AR runs bracketing it."""
    tau: float


def run_engine(path: str, methods: tuple[str, ...], args: Any, bar: tqdm) -> list[Cell]:
    loaded = LoadedEngine.load(path)
    cells = []
    texts = heldout_prompts(max(max(args.batch_sizes), args.min_prompts))
    for batch in args.batch_sizes:
        if batch > loaded.config.build.max_batch_size:
            raise SystemExit(f"error: batch {batch} > {path}'s max_batch_size {loaded.config.build.max_batch_size}")
        prompts = [loaded.encode(t) for t in texts[: max(batch, args.min_prompts)]]
        cfgs = [Config(m) for m in methods]
        runs = batch_rounds(loaded, batch, prompts, cfgs, args.max_tokens, args.temperatures, args.rounds, bar.update)
        for temperature, (timings, ar) in runs.items():
            for c, t in timings.items():
                cells.append(
                    Cell(path, c.method, batch, temperature, t.tokens_per_s, ar.tokens_per_s, t.speedup,
                         tokens_per_step(t.results))
                )  # fmt: skip
                tqdm.write(f"{c.method} B={batch} T={temperature:g}: {t.speedup:.2f}x tau {cells[-1].tau:.2f}")
    return cells


def markdown(cells: list[Cell], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    batches = sorted({c.batch_size for c in cells})
    lines = [
        "# Lyanna Figs. 8-11 analogue: speedup over AR vs batch size",
        "",
        f"Held-out prompts (max(B, {meta['min_prompts']}) per batch size B) x {meta['max_tokens']} tokens, fixed "
        f"speculation with each method's default tree, {meta['rounds']} rounds, {m['cpu']} ({m['torch_threads']} "
        "threads). Cell: **speedup** (tokens/s over AR's on the method's own engine, median of within-round ratios) "
        "/ tau. Engines: " + ", ".join(f"`{e}`: {', '.join(ms)}" for e, ms in meta["engines"].items()) + ".",
    ]
    for temperature in sorted({c.temperature for c in cells}):
        lines += [
            "",
            f"## Temperature {temperature:g}",
            "",
            "| method | " + " | ".join(f"B={b}" for b in batches) + " |",
            "|---|" + "---|" * len(batches),
        ]
        at_t = [c for c in cells if c.temperature == temperature]
        best = {b: max(c.speedup for c in at_t if c.batch_size == b) for b in batches}
        for method in [m for m in METHOD_ORDER if any(c.method == m for c in at_t)]:
            row = []
            for b in batches:
                c = next(c for c in at_t if (c.method, c.batch_size) == (method, b))
                speed = f"**{c.speedup:.2f}x**" if c.speedup == best[b] else f"{c.speedup:.2f}x"
                row.append(f"{speed} / {c.tau:.2f}")
            lines.append(f"| {method} | " + " | ".join(row) + " |")
    lines += ["", f"Command: `{meta.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lyanna_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for kind in ENGINE_METHODS:
        ap.add_argument(
            f"--{kind}-engine", type=Path, default=Path(f"engines/demo-{kind}"),
            help=f"engine with the {kind} drafter, for {', '.join(ENGINE_METHODS[kind])} (default: %(default)s)",
        )  # fmt: skip
    ap.add_argument("--batch-sizes", default="1,2,4,8,16", help="batch sizes B (default: %(default)s)")
    ap.add_argument("--temperatures", default="0,1", help="temperatures (default: %(default)s)")
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lyanna_throughput"), help="output path stem")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    engines = {str(getattr(args, f"{kind.replace('-', '_')}_engine")): ms for kind, ms in ENGINE_METHODS.items()}
    for path in engines:
        if not (Path(path) / "config.json").exists():
            raise SystemExit(f"error: {path} is not built; run `make engine`")
    runs = sum(len(args.batch_sizes) * len(args.temperatures) * args.rounds * (2 + len(ms)) for ms in engines.values())
    cells: list[Cell] = []
    with tqdm(total=runs, desc="lyanna throughput", unit="run") as bar:
        for path, methods in engines.items():
            cells += run_engine(path, methods, args, bar)
    meta = {
        "command": command("benchmarks.lyanna_throughput", argv),
        "engines": engines,
        "min_prompts": args.min_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "speculation": "fixed",
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(c) for c in cells], markdown(cells, meta))


if __name__ == "__main__":
    main()
