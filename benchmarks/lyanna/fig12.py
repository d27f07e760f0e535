"""Lyanna Figure 12: tau and speedup vs AR and vs ReDrafter at equal verification budgets B,
measured in one run (`benchmarks.timing.bracketed_round` on each engine, engines alternating
by round)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from benchmarks.lyanna.common import DEPTH, WIDTH, build, drafted_per_step, ints
from benchmarks.report import write_report
from benchmarks.timing import ONE_AT_A_TIME, Timings, bracketed_round, grouped, round_params, warm_up
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import tokens_per_step

VARIANTS: dict[str, dict[str, bool]] = {
    "no re-sampling": {"resample": False, "fuse": False},
    "re-sampling + fusion": {"resample": True, "fuse": True},
    "re-sampling, no fusion": {"resample": True, "fuse": False},
}
"""Lyanna variants of fig12 (LyannaParams overrides)."""


@dataclass(frozen=True)
class Fig12Config:
    engine: str  # "lyanna" | "redrafter"
    variant: str
    budget: int
    width: int = WIDTH

    def overrides(self) -> dict[str, Any]:
        if self.engine == "redrafter":
            return {"beam_width": self.width, "beam_length": self.budget // self.width}
        return {"depth": DEPTH, "width": self.width, "budget": self.budget, **VARIANTS[self.variant]}

    @property
    def method(self) -> str:
        return self.engine


@dataclass
class Fig12Row:
    temperature: float
    method: str
    budget: int
    shape: str
    tau: float
    drafted_per_step: float
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float
    """Median over rounds of tokens/s over the bracketing AR tokens/s (same engine)."""
    vs_redrafter: float
    """Median over rounds of this speedup / ReDrafter's at the same B (1.0 for ReDrafter)."""
    speedup_per_round: list[float] = field(default_factory=list)


def configs_for(budgets: list[int]) -> list[Fig12Config]:
    """Every Lyanna variant and ReDrafter W x L = B, per budget B."""
    out = []
    for b in budgets:
        if b % WIDTH:
            raise SystemExit(f"error: budget {b} is not a multiple of the width {WIDTH} (ReDrafter W x L = B)")
        out += [Fig12Config("lyanna", v, b) for v in VARIANTS]
        if b > DEPTH * WIDTH:  # width 4 keeps at most DEPTH * WIDTH nodes: also fill the budget
            out.append(Fig12Config("lyanna", "no re-sampling", b, width=-(-b // DEPTH)))
        out.append(Fig12Config("redrafter", "W x L", b))
    return out


def row(temperature: float, c: Fig12Config, t: Timings, ref: Timings) -> Fig12Row:
    """The row of `c` from its timings and ReDrafter's (`ref`) at the same budget."""
    return Fig12Row(
        temperature=temperature,
        method="redrafter" if c.engine == "redrafter" else f"lyanna, {c.variant}",
        budget=c.budget,
        shape=f"W={c.width} L={c.budget // c.width}" if c.engine == "redrafter" else f"k={DEPTH} w={c.width}",
        tau=tokens_per_step(t.results),
        drafted_per_step=drafted_per_step(t.results),
        tokens_per_s=statistics.mean(t.rates),
        ar_tokens_per_s=statistics.mean(t.ar_rates),
        speedup=t.speedup,
        vs_redrafter=statistics.median(a / b for a, b in zip(t.ratios, ref.ratios, strict=True)),
        speedup_per_round=t.ratios,
    )


def run(
    lyanna: LLMEngine,
    redrafter: LLMEngine,
    prompts: list[list[int]],
    budgets: list[int],
    temperatures: list[float],
    max_tokens: int,
    rounds: int,
) -> list[Fig12Row]:
    configs = configs_for(budgets)
    engines = {"lyanna": lyanna, "redrafter": redrafter}
    columns = {name: grouped((c for c in configs if c.engine == name), lambda c: c.budget) for name in engines}
    for c in configs:
        warm_up(engines[c.engine], prompts[0], c.method, **c.overrides())
    for llm in engines.values():
        warm_up(llm, prompts[0], "ar")
    runs = len(temperatures) * rounds * (len(configs) + sum(len(groups) + 1 for groups in columns.values()))
    rows = []
    with tqdm(total=runs, desc="fig12", unit="run") as bar:
        for temperature in temperatures:
            timings = {c: Timings() for c in configs}
            for r in range(rounds):
                params = round_params(len(prompts), max_tokens, temperature, r)
                order = ["lyanna", "redrafter"] if r % 2 == 0 else ["redrafter", "lyanna"]
                for name in order:
                    bracketed_round(engines[name], prompts, params, columns[name], timings, Timings(), bar.update)
            for c in configs:
                rows.append(row(temperature, c, timings[c], timings[Fig12Config("redrafter", "W x L", c.budget)]))
                tqdm.write(
                    f"fig12 T={temperature:g} B={c.budget} {rows[-1].method}: tau {rows[-1].tau:.2f}, "
                    f"{rows[-1].speedup:.2f}x AR, {rows[-1].vs_redrafter:.2f}x ReDrafter"
                )
    return rows


def markdown(rows: list[Fig12Row], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Figure 12: tau and speedup vs AR and ReDrafter at equal verification budgets",
        "",
        f"{meta['num_prompts']} held-out prompts x {meta['max_tokens']} tokens (EOS ignored), batch 1, "
        f"{meta['rounds']} rounds; {m['cpu']} ({m['torch_threads']} threads). Lyanna: depth {DEPTH}, width "
        f"{WIDTH}, budget B; ReDrafter: W x L = {WIDTH} x B/{WIDTH}. Speedup: tokens/s over AR tokens/s on the same "
        "engine (same target), AR timed before and after each B in every round, median over rounds of the "
        "within-round ratio; vs ReDrafter: median over rounds of (Lyanna speedup / ReDrafter speedup). Nodes/step: "
        "drafted nodes actually verified per decoding step (re-sampling may add up to resample_budget = 4 beyond B). "
        f"A depth-{DEPTH} width-{WIDTH} tree has at most {DEPTH * WIDTH} nodes (Algorithm 1 keeps {WIDTH} per level), "
        f"so where B > {DEPTH * WIDTH} a row with width ceil(B/{DEPTH}) that fills the budget is added.",
    ]
    for temperature in sorted({r.temperature for r in rows}):
        lines += [
            "",
            f"## Temperature {temperature:g}",
            "",
            "| B | method | shape | tau | nodes/step | tok/s | AR tok/s | speedup vs AR | vs ReDrafter |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r.temperature == temperature):
            lines.append(
                f"| {r.budget} | {r.method} | {r.shape} | {r.tau:.2f} | {r.drafted_per_step:.1f} "
                f"| {r.tokens_per_s:.1f} | {r.ar_tokens_per_s:.1f} | {r.speedup:.2f}x | {r.vs_redrafter:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, meta: dict[str, Any], llm: LLMEngine, prompts: list[list[int]]) -> None:
    """Load (or build) the ReDrafter engine, measure against `llm` (the main Lyanna drafter),
    write `<out-dir>/lyanna_fig12.{json,md}`."""
    path = args.redrafter_engine
    if not (path / "config.json").is_file():
        path = build(args.target, args.engine_dir / "redrafter", redrafter=args.redrafter)
    redrafter = LLMEngine(LoadedEngine.load(path), ONE_AT_A_TIME)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    rows = run(llm, redrafter, prompts, ints(args.budgets), temperatures, args.max_tokens, args.rounds)
    meta = {**meta, "redrafter_engine": str(path), "budgets": ints(args.budgets), "temperatures": temperatures}
    write_report(args.out_dir / "lyanna_fig12", meta, [asdict(r) for r in rows], markdown(rows, meta))
