"""Recursive Speculative Decoding, the seed paper's Exp1 and Exp2 (Jeon et al. 2024,
arXiv 2402.14160): block efficiency and wall-clock speedup over auto-regressive decoding
of sd, rsd-c, rsd-s and redrafter, on both demo drafters.

    python -m benchmarks.rsd_sweep                      # both experiments, both engines
    python -m benchmarks.rsd_sweep --exp 1 --lengths 3  # one draft length only

- Exp1, draft length L (default 2,3,4,5): sd = one chain of L tokens; rsd-c with
  b = (2, 2, 1, ..., 1) of length L; rsd-s and redrafter with W = 4 beams of L tokens.
- Exp2, target budget B = draft tokens verified per step, tree nodes without the root
  (default 6,10,14,21,30): sd with L = B; rsd-c with constant-branching trees of exactly
  B nodes; rsd-s and redrafter with W x L = B beams; three shapes per tree method and
  budget (`EXP2_BRANCHING`, `EXP2_BEAMS`), and, as in the paper, each cell reports the
  best shape (best tau and best speedup separately, each with its shape; the JSON has
  every shape).

For each engine (drafter "rnn": engines/demo-redrafter, "draft-lm": engines/demo-draft-lm)
and temperature, held-out prompts are decoded one request at a time (batch 1, the
latency-bound regime), fixed output length (EOS ignored), each prompt seeded by its
index, so every method decodes the same number of tokens from the same prompts. Reported:
- tau: tokens emitted per target forward (bonus included, prefill excluded; 1 for AR),
  hardware-independent;
- speedup: the method's output tokens/s / AR's output tokens/s (prefill included, as a
  user sees it). Shared machines are noisy, so AR is timed on the same engine and prompts
  in the same run, interleaved with the methods: each round times AR, then every method
  at one L (or B), then AR again, then the next L, ... ; a method's ratio within a round
  is its rate over the mean of the two AR rates bracketing it, and the reported speedup is
  the median of that ratio over rounds.
Writes `<out-dir>/rsd_exp1.{json,md}` and `<out-dir>/rsd_exp2.{json,md}`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.prompts import bundled
from benchmarks.report import machine, write_report
from benchmarks.timing import ONE_AT_A_TIME, Timings, bracketed_round, grouped, round_params, warm_up
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.rsd import TreeSpec
from runtime.results import tokens_per_step

ENGINES = ("engines/demo-redrafter", "engines/demo-draft-lm")
DRAFTER_NAMES = {"redrafter": "rnn", "draft-lm": "draft-lm"}
METHODS = ("sd", "rsd-c", "rsd-s", "redrafter")
EXP1_WIDTH = 4
EXP2_BRANCHING: dict[int, tuple[tuple[int, ...], ...]] = {
    6: ((2, 2), (3, 1), (6,)),
    10: ((2, 1, 1, 1, 1), (2, 2, 1), (5, 1)),
    14: ((2, 2, 1, 1), (2, 3, 1), (7, 1)),
    21: ((3, 2, 1, 1), (3, 1, 1, 1, 1, 1, 1), (7, 2)),
    30: ((3, 3, 1, 1), (5, 1, 1, 1, 1, 1), (10, 2)),
}
"""rsd-c trees of each Exp2 budget B (b0 + b0*b1 + ... = B nodes): deep and narrow, balanced,
wide and shallow. The paper reports, per budget, the best of a few shapes; so does Exp2."""
EXP2_BEAMS: dict[int, tuple[tuple[int, int], ...]] = {
    6: ((2, 3), (3, 2), (6, 1)),
    10: ((2, 5), (5, 2), (10, 1)),
    14: ((2, 7), (7, 2), (14, 1)),
    21: ((3, 7), (7, 3), (21, 1)),
    30: ((5, 6), (6, 5), (10, 3)),
}
"""rsd-s / redrafter (W, L) shapes of each Exp2 budget B: W * L = B."""


@dataclass(frozen=True)
class Config:
    """One method with one tree shape, at one column (L in Exp1, B in Exp2) of an experiment."""

    experiment: int
    column: int
    method: str
    branching: tuple[int, ...] = ()
    beam_width: int = 0
    beam_length: int = 0

    @property
    def spec(self) -> TreeSpec:
        return TreeSpec.for_method(self.method, self.beam_width, self.beam_length, self.branching)

    @property
    def draft_tokens(self) -> int:
        """Draft tokens verified per step at most: tree nodes without the root."""
        return self.spec.max_nodes - 1

    @property
    def shape(self) -> str:
        if self.method == "rsd-c":
            return "b=(" + ",".join(map(str, self.branching)) + ")"
        if self.method == "sd":
            return f"L={self.beam_length}"
        return f"W={self.beam_width} L={self.beam_length}"

    def overrides(self) -> dict[str, Any]:
        """The settings this method takes (a method refuses another's)."""
        if self.method == "ar":
            return {}
        if self.method == "rsd-c":
            return {"branching": self.branching}
        if self.method == "sd":
            return {"beam_length": self.beam_length}
        return {"beam_width": self.beam_width or None, "beam_length": self.beam_length}


def exp1_configs(lengths: list[int]) -> list[Config]:
    out = []
    for n in lengths:
        branching = ((2, 2) + (1,) * n)[:n]
        out += [
            Config(1, n, "sd", beam_length=n),
            Config(1, n, "rsd-c", branching=branching),
            Config(1, n, "rsd-s", beam_width=EXP1_WIDTH, beam_length=n),
            Config(1, n, "redrafter", beam_width=EXP1_WIDTH, beam_length=n),
        ]
    return out


def exp2_configs(budgets: list[int]) -> list[Config]:
    out = []
    for b in budgets:
        if b not in EXP2_BRANCHING:
            raise SystemExit(f"error: no Exp2 tree shapes for budget {b}; choose from {sorted(EXP2_BRANCHING)}")
        group = [Config(2, b, "sd", beam_length=b)]
        group += [Config(2, b, "rsd-c", branching=shape) for shape in EXP2_BRANCHING[b]]
        group += [
            Config(2, b, method, beam_width=w, beam_length=n)
            for method in ("rsd-s", "redrafter")
            for w, n in EXP2_BEAMS[b]
        ]
        for c in group:
            assert c.draft_tokens == b, f"{c.method} {c.shape} drafts {c.draft_tokens} tokens, not the budget {b}"
        out += group
    return out


@dataclass
class Row:
    experiment: int
    engine: str
    drafter: str
    temperature: float
    method: str
    shape: str
    column: int
    """L (Exp1) or B (Exp2); 0 for the AR baseline."""
    draft_tokens: int
    tau: float
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float
    """Median over rounds of the within-round ratio to AR's tokens/s."""
    rounds: int
    speedup_per_round: list[float] = field(default_factory=list)


def sweep_engine(
    path: str,
    configs: list[Config],
    temperatures: list[float],
    num_prompts: int,
    max_tokens: int,
    rounds: int,
    bar: tqdm,
) -> list[Row]:
    """Every config on one engine at every temperature, AR interleaved (module docstring)."""
    loaded = LoadedEngine.load(path)
    if loaded.config.drafter is None:
        raise SystemExit(f"error: {path} has no drafter; build it with --drafter or --draft-model")
    drafter = DRAFTER_NAMES[loaded.config.drafter.kind]
    llm = LLMEngine(loaded, ONE_AT_A_TIME)  # one engine: one KV cache, one set of lazily built kernels
    prompts = [loaded.encode(p.text) for p in bundled(num_prompts)]
    columns = grouped(configs, lambda c: (c.experiment, c.column))
    for c in [Config(0, 0, "ar"), *configs]:
        warm_up(llm, prompts[0], c.method, **c.overrides())
    rows = []
    for temperature in temperatures:
        timings = {c: Timings() for c in configs}
        ar = Timings()
        for r in range(rounds):
            params = round_params(len(prompts), max_tokens, temperature, r)
            bracketed_round(llm, prompts, params, columns, timings, ar, bar.update)
        for experiment in sorted({c.experiment for c in configs}):
            ar_row = Row(experiment, path, drafter, temperature, "ar", "", 0, 0, tokens_per_step(ar.results),
                         ar.tokens_per_s, ar.tokens_per_s, 1.0, rounds)  # fmt: skip
            rows.append(ar_row)
        for c, t in timings.items():
            rows.append(
                Row(
                    experiment=c.experiment,
                    engine=path,
                    drafter=drafter,
                    temperature=temperature,
                    method=c.method,
                    shape=c.shape,
                    column=c.column,
                    draft_tokens=c.draft_tokens,
                    tau=tokens_per_step(t.results),
                    tokens_per_s=t.tokens_per_s,
                    ar_tokens_per_s=statistics.mean(t.ar_rates),
                    speedup=t.speedup,
                    rounds=rounds,
                    speedup_per_round=t.ratios,
                )
            )
            tqdm.write(
                f"{drafter} T={temperature:g} exp{c.experiment} {c.method} {c.shape}: "
                f"tau {rows[-1].tau:.2f}, {rows[-1].speedup:.2f}x"
            )
    return rows


def _row_label(method: str, experiment: int) -> str:
    if experiment == 1:
        return {
            "sd": "sd (chain of L)",
            "rsd-c": "rsd-c b=(2,2,1,...)[:L]",
            "rsd-s": f"rsd-s W={EXP1_WIDTH}",
            "redrafter": f"redrafter W={EXP1_WIDTH}",
        }[method]
    return {"sd": "sd (chain of B)", "rsd-c": "rsd-c", "rsd-s": "rsd-s W x L", "redrafter": "redrafter W x L"}[method]


def _short(row: Row) -> str:
    """A shape in few characters: "2,2,1" for rsd-c, "4x3" for beams."""
    if row.shape.startswith("b=("):
        return row.shape[3:-1]
    return row.shape.replace("W=", "").replace(" L=", "x")


def _winners(rows: list[Row], key: str) -> str:
    """'method (columns won)' for the method with the highest `key` in most columns, plus the best cell."""
    wins: dict[str, int] = {}
    for column in sorted({r.column for r in rows}):
        best = max((r for r in rows if r.column == column), key=lambda r: getattr(r, key))
        wins[best.method] = wins.get(best.method, 0) + 1
    top = max(rows, key=lambda r: getattr(r, key))
    counts = ", ".join(f"{m} {n}/{sum(wins.values())}" for m, n in sorted(wins.items(), key=lambda kv: -kv[1]))
    value = f"{top.tau:.2f}" if key == "tau" else f"{top.speedup:.2f}x"
    return f"{counts} columns (best cell: {top.method} {top.shape}, {value})"


def markdown(experiment: int, rows: list[Row], meta: dict[str, Any]) -> str:
    axis = "L" if experiment == 1 else "B"
    title = "draft length L" if experiment == 1 else "target budget B (draft tokens per step)"
    m = meta["machine"]
    lines = [
        f"# RSD Exp{experiment}: block efficiency and speedup vs {title}",
        "",
        f"{meta['num_prompts']} held-out prompts x {meta['max_tokens']} tokens (EOS ignored), batch 1, fixed "
        f"speculation, {meta['rounds']} rounds; {m['cpu']} ({m['torch_threads']} threads), sweep took "
        f"{meta['elapsed_s'] / 60:.1f} min. Cells: **tau** (tokens per target forward) / **speedup** (tokens/s over "
        "auto-regressive tokens/s on the same engine and prompts, AR timed before and after each column in every "
        "round; median over rounds of the within-round ratio). Bold: best of the column for that drafter.",
    ]
    if experiment == 2:
        lines += [
            "",
            "Shapes, all with exactly B draft nodes, best of them per cell (shape in brackets): rsd-c b = "
            + "; ".join(
                f"B={b}: " + ", ".join(f"({','.join(map(str, s))})" for s in shapes)
                for b, shapes in EXP2_BRANCHING.items()
            )
            + "; rsd-s / redrafter W x L = "
            + "; ".join(f"B={b}: " + ", ".join(f"{w}x{n}" for w, n in shapes) for b, shapes in EXP2_BEAMS.items())
            + ".",
        ]
    for temperature in sorted({r.temperature for r in rows}):
        at_t = [r for r in rows if r.temperature == temperature]
        columns = sorted({r.column for r in at_t if r.method != "ar"})
        lines += [
            "",
            f"## Temperature {temperature:g}",
            "",
            "| drafter | method | " + " | ".join(f"{axis}={c}" for c in columns) + " |",
            "|---|---|" + "---|" * len(columns),
        ]
        summaries = []
        for drafter in dict.fromkeys(r.drafter for r in at_t):
            mine = [r for r in at_t if r.drafter == drafter and r.method != "ar"]
            ar = next(r for r in at_t if r.drafter == drafter and r.method == "ar")
            best_tau = {c: max(r.tau for r in mine if r.column == c) for c in columns}
            best_speed = {c: max(r.speedup for r in mine if r.column == c) for c in columns}
            for method in METHODS:
                cells = []
                for c in columns:
                    shapes = [r for r in mine if r.method == method and r.column == c]
                    if not shapes:
                        cells.append("")
                        continue
                    t, v = max(shapes, key=lambda r: r.tau), max(shapes, key=lambda r: r.speedup)
                    tau = f"**{t.tau:.2f}**" if t.tau == best_tau[c] else f"{t.tau:.2f}"
                    speed = f"**{v.speedup:.2f}x**" if v.speedup == best_speed[c] else f"{v.speedup:.2f}x"
                    if len(shapes) > 1:
                        tau, speed = f"{tau} ({_short(t)})", f"{speed} ({_short(v)})"
                    cells.append(f"{tau} / {speed}")
                lines.append(f"| {drafter} | {_row_label(method, experiment)} | " + " | ".join(cells) + " |")
            summaries.append(
                f"- **{drafter}** (AR {ar.tokens_per_s:.1f} tok/s, tau {ar.tau:.2f}): highest tau: "
                f"{_winners(mine, 'tau')}; highest speedup: {_winners(mine, 'speedup')}."
            )
        lines += ["", *summaries]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.rsd_sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated engine dirs with a drafter (default: %(default)s)"
    )
    ap.add_argument("--temperatures", default="0.3,1.0", help="sampling temperatures (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=8, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating timing rounds (default: %(default)s)")
    ap.add_argument("--exp", choices=("1", "2", "both"), default="both", help="experiment(s) (default: %(default)s)")
    ap.add_argument("--lengths", default="2,3,4,5", help="Exp1 draft lengths L (default: %(default)s)")
    ap.add_argument(
        "--budgets",
        default=",".join(map(str, EXP2_BRANCHING)),
        help="Exp2 target budgets B, draft tokens per step (default: %(default)s)",
    )
    ap.add_argument(
        "--out-dir", type=Path, default=Path("benchmarks/results"), help="output dir (default: %(default)s)"
    )
    args = ap.parse_args(argv)

    experiments = [1, 2] if args.exp == "both" else [int(args.exp)]
    configs = (exp1_configs(_ints(args.lengths)) if 1 in experiments else []) + (
        exp2_configs(_ints(args.budgets)) if 2 in experiments else []
    )
    engines = args.engines.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    columns = len({(c.experiment, c.column) for c in configs})
    runs = len(engines) * len(temperatures) * args.rounds * (len(configs) + columns + 1)
    start = time.perf_counter()
    rows: list[Row] = []
    with tqdm(total=runs, desc="rsd sweep", unit="run") as bar:
        for path in engines:
            rows += sweep_engine(path, configs, temperatures, args.num_prompts, args.max_tokens, args.rounds, bar)
    meta = {
        "engines": engines,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "batch_size": 1,
        "speculation": "fixed",
        "elapsed_s": time.perf_counter() - start,
        "machine": machine(),
    }
    for experiment in experiments:
        mine = [r for r in rows if r.experiment == experiment]
        write_report(
            args.out_dir / f"rsd_exp{experiment}",
            {**meta, "experiment": experiment},
            [asdict(r) for r in mine],
            markdown(experiment, mine, meta),
        )


if __name__ == "__main__":
    main()
