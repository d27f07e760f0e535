"""ReDrafter Table 5 and Fig. 6 (right) analogues: beam width x batch size, with and without
dynamic tree attention (beam packing).

    python -m benchmarks.redrafter_grid --engine engines/demo-redrafter

For each batch size B, max(B, --min-prompts) held-out prompts are decoded with at most B
running at once (in-flight batching), fixed output length (EOS ignored), greedy, fixed
speculation, by: auto-regression; ReDrafter with W = 1, 2, 4, 8 beams of L = 4 packed into
a tree (the default); and the same W > 1 with `packing=False` (every beam's drafts verified
apart, 1 + W * L nodes: the paper's "without tree attention"). Greedy acceptance is the
same with and without packing (the deepest duplicate is kept), so the packing columns
differ only in what the target verifies. AR is timed before and after every batch size's
configurations (`bracketed_round`); a configuration's ratio is its tokens/s over the mean
of the two AR rates around it, median over rounds. Reported per cell: tokens/s ratio to
AR, tau (tokens per step per request) and nodes verified per step (root included).
Writes `<out>.json` and `<out>.md`.
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

LENGTH = 4


@dataclass(frozen=True)
class Config:
    """ReDrafter with W beams of LENGTH, packed or not."""

    beam_width: int
    packing: bool = True
    method: str = "redrafter"

    def overrides(self) -> dict[str, Any]:
        return {"beam_width": self.beam_width, "beam_length": LENGTH, "packing": self.packing}

    @property
    def name(self) -> str:
        return f"W={self.beam_width}" + ("" if self.packing else " unpacked")


@dataclass
class Cell:
    batch_size: int
    beam_width: int
    packing: bool
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float
    """Median over rounds of the ratio to the AR runs bracketing it."""
    tau: float
    nodes_per_step: float
    """Tree nodes verified per request-step, root included."""


def configs(widths: list[int]) -> list[Config]:
    return [Config(w) for w in widths] + [Config(w, packing=False) for w in widths if w > 1]


def run_batch(loaded: LoadedEngine, batch: int, prompts: list[list[int]], cfgs: list[Config], args: Any) -> list[Cell]:
    timings, ar = batch_rounds(loaded, batch, prompts, cfgs, args.max_tokens, [0.0], args.rounds)[0.0]
    cells = []
    for c, t in timings.items():
        results = t.results
        steps = sum(len(r.accepted_per_step) for r in results)
        cells.append(
            Cell(
                batch,
                c.beam_width,
                c.packing,
                t.tokens_per_s,
                ar.tokens_per_s,
                t.speedup,
                tokens_per_step(results),
                (sum(r.num_drafted for r in results) + steps) / steps,
            )
        )
    return cells


def markdown(cells: list[Cell], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    batches = sorted({c.batch_size for c in cells})
    lines = [
        "# ReDrafter: beam width x batch size, with and without tree attention",
        "",
        f"Engine `{meta['engine']}`, held-out prompts (max(B, {meta['min_prompts']}) per batch size B) x "
        f"{meta['max_tokens']} tokens, greedy, fixed speculation, L = {LENGTH}, {meta['rounds']} rounds, "
        f"{m['cpu']} ({m['torch_threads']} threads). Cell: **speedup** over AR at the same B (median of "
        "within-round ratios) / tau / nodes verified per step. *unpacked*: every beam verified apart "
        "(1 + W x L nodes), the paper's run without dynamic tree attention; greedy acceptance is the same.",
        "",
        "| config | " + " | ".join(f"B={b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    keys = sorted({(c.beam_width, c.packing) for c in cells}, key=lambda k: (not k[1], k[0]))
    for width, packing in keys:
        row = []
        for b in batches:
            c = next(c for c in cells if (c.batch_size, c.beam_width, c.packing) == (b, width, packing))
            row.append(f"**{c.speedup:.2f}x** / {c.tau:.2f} / {c.nodes_per_step:.1f}")
        lines.append(f"| W={width}{'' if packing else ' unpacked'} | " + " | ".join(row) + " |")
    ar = {b: next(c.ar_tokens_per_s for c in cells if c.batch_size == b) for b in batches}
    lines += ["", "AR tokens/s: " + ", ".join(f"B={b}: {ar[b]:.0f}" for b in batches) + "."]
    best = {b: max((c for c in cells if c.batch_size == b), key=lambda c: c.speedup) for b in batches}
    lines.append(
        "Best W per batch size: "
        + ", ".join(
            f"B={b}: W={c.beam_width}{'' if c.packing else ' unpacked'} ({c.speedup:.2f}x)" for b, c in best.items()
        )
        + "."
    )
    lines += ["", f"Command: `{meta.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.redrafter_grid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engine", type=Path, default=Path("engines/demo-redrafter"), help="engine with a ReDrafter drafter"
    )
    ap.add_argument("--batch-sizes", default="1,4,16", help="batch sizes B (default: %(default)s)")
    ap.add_argument("--widths", default="1,2,4,8", help="beam widths W (default: %(default)s)")
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/redrafter_grid"), help="output path stem")
    args = ap.parse_args(argv)

    loaded = LoadedEngine.load(args.engine)
    if loaded.redrafter is None:
        raise SystemExit(f"error: {args.engine} has no ReDrafter RNN drafter; build it with --drafter")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if max(batches) > loaded.config.build.max_batch_size:
        raise SystemExit(
            f"error: batch {max(batches)} > the engine's max_batch_size {loaded.config.build.max_batch_size}"
        )
    cfgs = configs([int(w) for w in args.widths.split(",")])
    texts = heldout_prompts(max(max(batches), args.min_prompts))
    cells: list[Cell] = []
    for batch in tqdm(batches, desc="redrafter grid", unit="batch size"):
        prompts = [loaded.encode(t) for t in texts[: max(batch, args.min_prompts)]]
        cells += run_batch(loaded, batch, prompts, cfgs, args)
        for c in cells[-len(cfgs) :]:
            tqdm.write(f"B={batch} W={c.beam_width} packing={c.packing}: {c.speedup:.2f}x tau {c.tau:.2f}")
    meta = {
        "command": command("benchmarks.redrafter_grid", argv),
        "engine": str(args.engine),
        "min_prompts": args.min_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "beam_length": LENGTH,
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(c) for c in cells], markdown(cells, meta))


if __name__ == "__main__":
    main()
