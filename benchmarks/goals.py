"""Where speculation stands against issue 16's CPU goals, every cell in one run: each cell
is a lockstep run (`benchmarks.lockstep.measure`: an AR engine and one engine per
configuration on the same weights step in turn, so all meet the same machine at the same
moments) of the default, load-aware methods beside fixed speculation, on held-out prompts
(64 tokens a request, EOS ignored).

    python -m benchmarks.goals                                 # `make bench-goals`
    python -m benchmarks.goals --cells redrafter-b1-t0 sd-b8-t1 --rounds 8
    python -m benchmarks.goals --repeats 3                    # every cell three times, a pass apart
    python -m benchmarks.goals --turns rounds                 # each engine's whole round alone in turn

The goals (issue 16, CPU, demo engines, default settings):
- the default method (ReDrafter) at T=0: >= 2.0x AR at batch 1, >= 1.0x at batch 32; at
  T=1, batch 8: >= 0.97x;
- each draft-LM method (sd, rsd-c, rsd-s): >= 1.5x AR at batch 1 and >= 1.0x at batch 8, T=0
  and T=1;
- load-aware speculation, every method and cell (batch 1, 8 and 32, T=0 and T=1): at least
  0.97 of the best of AR and the fixed configurations beside it (ReDrafter: one-beam chains
  and its W=4 trees; the draft LM: sd's chains; Lyanna: a 4-node chain and its whole tree).

A ratio to AR moves with AR's own speed (the hour's machine: AR's tokens/s are in the
table), and single cells by ~1-2% between runs; the share of the best is the steadier
figure (both sides in one run). `--repeats N` runs every cell N times, a whole pass of the
cells apart (~7 min a pass), and judges each configuration by its medians over the passes,
each pass's figures beside them: on a shared 2-core VM one configuration read 1.70x AR in
one hour and 2.05x in another (ReDrafter at batch 1, T=0, session 31), and a batch-32
cell's four rounds (~10 s) moved by 5% between runs minutes apart. At T=0 every
configuration's output is checked against AR's. The step-cost goals have their own
benchmarks: `make bench-no-draft` (a no-draft step against AR's), `make profile` (a
drafting step's phases), `make bench-floor` (what the hardware allows at batch 1).
`--turns rounds` runs each cell's engines a whole round each in turn instead of a step each
(`benchmarks.lockstep`'s `--turns`): each engine's steps then meet the caches its own steps
left, as in a server of its own, at the price of a wider spread. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lockstep import TITLES, TURNS, Row, add_turns_argument, measure, parse_config
from benchmarks.report import command, machine, write_report
from benchmarks.step_profile import add_engine_argument, engine_paths

WITHIN = 0.97
"""Load-aware's least share of the best of AR and fixed speculation (issue 16: within 3%)."""
ROUNDS = {1: 16, 8: 12, 32: 4}
"""Rounds a cell runs by batch size (a round: the batch's held-out prompts, at least 8):
~15-60 s a cell on a 2-core EPYC; single cells of 16 rounds moved ~1.5% between runs."""


@dataclass(frozen=True)
class Cell:
    name: str
    kind: str
    """The drafter kind whose engine it runs on (`step_profile.ENGINES`)."""
    batch: int
    temperature: float
    load_aware: tuple[str, ...]
    fixed: tuple[str, ...]
    goals: dict[str, float] = field(default_factory=dict)
    """Load-aware configuration -> the least ratio to AR the issue asks of it."""


REDRAFTER_FIXED = ("redrafter:fixed[beam_width=1]", "redrafter:fixed")
DRAFT_LM = ("sd", "rsd-c", "rsd-s")
LYANNA_FIXED = ("lyanna:fixed[budget=3,width=1,resample=False]", "lyanna:fixed")
"""Lyanna's 4-node chain (1.10-1.13x AR at batch 1, T=0 in an hour of session 30 when AR ran
slow) and its whole tree."""


def _cells() -> list[Cell]:
    cells = []
    for t in (0.0, 1.0):
        for b in (1, 8, 32):
            goal = {(0.0, 1): 2.0, (0.0, 32): 1.0, (1.0, 8): 0.97}.get((t, b))
            goals = {"redrafter": goal} if goal else {}
            cells.append(Cell(f"redrafter-b{b}-t{t:g}", "redrafter", b, t, ("redrafter",), REDRAFTER_FIXED, goals))
        for b in (1, 8, 32):
            goal = {1: 1.5, 8: 1.0}.get(b)  # (batch 32: within 3% of the best alone, no ratio to AR asked)
            goals = dict.fromkeys(DRAFT_LM, goal) if goal else {}
            cells.append(Cell(f"sd-b{b}-t{t:g}", "draft-lm", b, t, DRAFT_LM, ("sd:fixed",), goals))
        for b in (1, 8, 32):
            cells.append(Cell(f"lyanna-b{b}-t{t:g}", "lyanna", b, t, ("lyanna",), LYANNA_FIXED))
    return cells


CELLS = _cells()


@dataclass
class Result:
    cell: str
    engine: str
    batch: int
    temperature: float
    config: str
    ratio: float
    """Tokens per second over AR's, all rounds."""
    least: float
    most: float
    stderr: float
    tokens_per_step: float
    best: str
    """The best of AR and the cell's fixed configurations."""
    best_ratio: float
    of_best: float
    """`ratio` over `best_ratio`."""
    goal: float | None
    """The least `ratio` the issue asks of it (None: only `WITHIN` of the best)."""
    met: bool | None
    """`of_best` >= `WITHIN`, and `ratio` >= `goal` where there is one (None: a fixed
    configuration, there for reference)."""
    ar_tokens_per_second: float
    same_as_ar: bool | None
    passes: list[dict[str, Any]] = field(default_factory=list)
    """Each pass's ratio, share of the best, verdict and AR tokens/s (`--repeats`; the
    figures above are then their medians: `over_passes`)."""


def judge(cell: Cell, engine: str, rows: list[Row]) -> list[Result]:
    """A result per configuration of `cell` (`rows`: its lockstep rows, AR's first); the
    fixed ones are not judged."""
    ar = rows[0]
    best = max((r for r in rows if r.speculation == "fixed"), key=lambda r: r.ratio)  # AR is fixed too
    results = []
    for r in rows[1:]:
        goal = cell.goals.get(r.config)
        of_best = r.ratio / best.ratio
        load_aware = r.speculation == "load-aware"
        met = (of_best >= WITHIN and (goal is None or r.ratio >= goal)) if load_aware else None
        results.append(
            Result(
                cell.name,
                engine,
                cell.batch,
                cell.temperature,
                r.config,
                r.ratio,
                r.least,
                r.most,
                r.stderr,
                r.tokens_per_step,
                best.config,
                best.ratio,
                round(of_best, 4),
                goal,
                met,
                ar.tokens_per_second,
                r.same_as_ar,
            )
        )
    return results


PASS_FIELDS = ("ratio", "of_best", "met", "ar_tokens_per_second")
"""A pass's own figures kept beside the medians (`Result.passes`)."""


def over_passes(passes: list[list[Result]]) -> list[Result]:
    """One result per configuration of `passes` (each pass's results, of the same cells in the
    same order, the last pass possibly cut short): its medians over the passes that ran it,
    judged by them (`judge`'s rule: at least `WITHIN` of the best, and the goal against AR),
    each pass's figures in `passes`; least-most: over every round of every pass."""
    runs: dict[tuple[str, str], list[Result]] = {}
    for results in passes:
        for r in results:
            runs.setdefault((r.cell, r.config), []).append(r)
    out = []
    for rs in runs.values():
        first = rs[0]
        ratio = statistics.median(r.ratio for r in rs)
        of_best = statistics.median(r.of_best for r in rs)
        met = None
        if first.met is not None:
            met = of_best >= WITHIN and (first.goal is None or ratio >= first.goal)
        sames = [r.same_as_ar for r in rs]
        out.append(
            Result(
                first.cell,
                first.engine,
                first.batch,
                first.temperature,
                first.config,
                round(ratio, 4),
                min(r.least for r in rs),
                max(r.most for r in rs),
                round(statistics.median(r.stderr for r in rs), 4),
                round(statistics.median(r.tokens_per_step for r in rs), 3),
                Counter(r.best for r in rs).most_common(1)[0][0],
                round(statistics.median(r.best_ratio for r in rs), 4),
                round(of_best, 4),
                first.goal,
                met,
                round(statistics.median(r.ar_tokens_per_second for r in rs), 1),
                None if sames[0] is None else all(sames),
                [{k: getattr(r, k) for k in PASS_FIELDS} for r in rs],
            )
        )
    return out


def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    rounds = ", ".join(f"{b}: {n}" for b, n in meta["rounds"].items())
    lines = [
        f"# Issue 16's CPU goals, {TITLES[meta.get('turns', 'steps')]}",
        "",
        f"Each cell: AR and the configurations on one engine's weights {TURNS[meta.get('turns', 'steps')]}, "
        "held-out prompts "
        f"of {meta['max_tokens']} tokens (EOS ignored), the batch's prompts a round (at least 8), rounds by "
        f"batch {rounds}. x AR: tokens per second over AR's (least-most of the rounds). Of best: over "
        f"the best of AR and the cell's fixed configurations. Met: load-aware at {WITHIN:g} of the best or more, "
        "and its goal against AR where the issue sets one (fixed rows: for reference). "
        f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine'].get('torch_threads', '?')} threads. "
        f"Command: `{meta['command']}`",
        "",
    ]
    repeats = meta.get("repeats", 1)
    if repeats > 1:
        lines[2] += (
            f" Passes: every cell {repeats} times, a pass of all cells apart; each figure is the median over the "
            "passes, judged by the medians; by pass: x AR / of best of each pass, and the passes whose own "
            "figures met the goals."
        )
    by_pass = " | x AR by pass | of best by pass | met in passes" if repeats > 1 else ""
    lines += [
        "| cell | configuration | x AR | least-most | tokens/step | best of AR and fixed | of best | goal x AR "
        f"| met | AR tok/s | greedy == AR{by_pass} |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if repeats > 1 else ""),
    ]
    for r in results:
        load_aware = r.met is not None
        same = "-" if r.same_as_ar is None else ("yes" if r.same_as_ar else "**NO**")
        met = ("yes" if r.met else "**no**") if load_aware else "-"
        goal = f"{r.goal:g}" if r.goal is not None else "-"
        name = f"**{r.config}**" if load_aware else f"`{r.config}`"
        passes = ""
        if repeats > 1:
            ratios = " / ".join(f"{p['ratio']:.3f}" for p in r.passes)
            shares = " / ".join(f"{p['of_best']:.3f}" for p in r.passes)
            times = f"{sum(1 for p in r.passes if p['met'])} of {len(r.passes)}" if load_aware else "-"
            passes = f" {ratios} | {shares} | {times} |"
        lines.append(
            f"| {r.cell} | {name} | {r.ratio:.3f} | {r.least:.2f}-{r.most:.2f} | {r.tokens_per_step:.2f} "
            f"| `{r.best}` {r.best_ratio:.3f} | {r.of_best:.3f} | {goal} | {met} | {r.ar_tokens_per_second:.0f} "
            f"| {same} |{passes}"
        )
    judged = [r for r in results if r.met is not None]
    lines += ["", f"Load-aware configurations meeting their goals: {sum(1 for r in judged if r.met)} of {len(judged)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cells",
        nargs="+",
        choices=[c.name for c in CELLS],
        metavar="CELL",
        help=f"cells to run (default: all {len(CELLS)}: {', '.join(c.name for c in CELLS)})",
    )
    ap.add_argument("--rounds", type=int, default=None, help=f"rounds of every cell (default: by batch, {ROUNDS})")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over the cells; each configuration is judged by its medians over them (default: %(default)s)",
    )
    add_turns_argument(ap)
    add_engine_argument(ap)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/goals"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    if (args.rounds is not None and args.rounds < 1) or args.max_tokens < 1 or args.repeats < 1:
        ap.error("--rounds, --max-tokens and --repeats must be >= 1")
    paths = engine_paths(ap, args.engine)
    cells = [c for c in CELLS if args.cells is None or c.name in args.cells]
    meta = {
        "command": command("benchmarks.goals", argv),
        "max_tokens": args.max_tokens,
        "rounds": {"all": args.rounds} if args.rounds else ROUNDS,
        "within": WITHIN,
        "repeats": args.repeats,
        "turns": args.turns,
        "machine": machine(),
    }
    passes: list[list[Result]] = []
    results: list[Result] = []
    runs = [(p, cell) for p in range(args.repeats) for cell in cells]
    for p, cell in tqdm(runs, desc="goal cells", position=1):
        if p == len(passes):
            passes.append([])
        configs = [parse_config(c) for c in (*cell.load_aware, *cell.fixed)]
        rounds = args.rounds or ROUNDS[cell.batch]
        try:
            rows, _ = measure(paths[cell.kind], configs, cell.batch, cell.temperature, rounds, args.max_tokens,
                              whole=args.turns == "rounds")  # fmt: skip
        except ValueError as e:
            ap.error(f"cell {cell.name}: {e}")
        passes[p] += judge(cell, paths[cell.kind], rows)
        results = passes[0] if args.repeats == 1 else over_passes(passes)
        # rewritten after every cell: a run cut short keeps the cells it finished
        write_report(args.out, meta, [asdict(r) for r in results], markdown(results, meta), echo=False)
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
