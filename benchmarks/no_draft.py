"""What speculation costs while it is switched off: the steady no-draft step of each method
under load-aware speculation against an auto-regressive step, measured in lockstep.

    python -m benchmarks.no_draft                 # `make bench-no-draft`
    python -m benchmarks.no_draft --methods lyanna --batches 1 --temperatures 1 --rounds 4

Two engines on the same loaded weights, one decoding auto-regressively and one with the
method (default, load-aware speculation), step in turn (A, B, A, B ...), each with `batch`
held-out prompts of `--max-tokens` tokens (EOS ignored) in flight, for `--rounds` rounds
(seeded apart; which engine steps first alternates: `benchmarks.lockstep.in_turn`). Each
reports the per-phase seconds of its steady no-draft steps (`StepClock.steady_phases`: decoding steps in which no
request drafted, more than a few steps after the last that prefilled or verified trees).
The ratio of the two is the issue's "width-0 step / AR step".

Why lockstep: on a shared 2-core VM consecutive runs of the same AR configuration differ by
up to ~10% (batch 1: 0.96 vs 1.07 ms a step in one process), so a method's plain steps
timed in runs of their own, even alternating with AR's, carry that noise and any drift; in
lockstep the two engines' steps are interleaved within milliseconds. (Each engine's steps
then run with caches the other's step left, so both read slower than alone: the ratio is
what this reports, not the milliseconds.) Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lockstep import add_round, in_turn
from benchmarks.report import Cell, command, machine, write_report
from benchmarks.step_profile import DRAFTERS, add_engine_argument, engine_paths
from benchmarks.timing import warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.step_clock import PHASES
from training.corpus import heldout_prompts


@dataclass
class Row(Cell):
    steps: int
    """Steady no-draft steps of the method."""
    ar_steps: int
    """Steady steps of AR (every decoding step a few steps past the prefill)."""
    ms: float
    """Milliseconds per steady no-draft step of the method."""
    ar_ms: float
    ratio: float | None
    """`ms` / `ar_ms` (None: the method drafted at every step, or AR had no steady step)."""
    median_ratio: float | None
    """The ratio of the two engines' median steady steps: what one slow step (a stall of the
    machine, ~0.16 s once in a cell of ~200 steps) does not move."""
    phases_ms: dict[str, float]
    ar_phases_ms: dict[str, float]
    drafted: float
    """Share of the method's decoding request-steps that drafted a tree (load-aware's choice)."""


def lockstep(
    ar: LLMEngine,
    spec: LLMEngine,
    method: str,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    rounds: int,
) -> tuple[dict[str, float], list[float], dict[str, float], list[float], float]:
    """Per-phase seconds and each step's seconds of the steady no-draft steps of `spec`
    (decoding `method`) and of `ar`, stepped in turn; and the share of `spec`'s request-steps
    that drafted."""
    engines = {"ar": ar, method: spec}
    seconds: dict[str, list[float]] = {"ar": [], method: []}
    for m, llm in engines.items():
        warm_up(llm, prompts[0], m, temperature)
        llm.clock.reset()
    drafted = steps = 0
    for r in range(rounds):
        add_round(ar, "ar", prompts, max_tokens, temperature, r)
        requests = add_round(spec, method, prompts, max_tokens, temperature, r)
        for m, llm in in_turn(engines, r):
            counted = llm.clock.steady_steps
            llm.step()
            if llm.clock.steady_steps > counted:
                seconds[m].append(sum(llm.clock.step.values()))
        for request in requests:
            sizes = request.result.sizes_per_step
            drafted, steps = drafted + sum(s > 1 for s in sizes), steps + len(sizes)
    return (
        dict(spec.clock.steady_phases),
        seconds[method],
        dict(ar.clock.steady_phases),
        seconds["ar"],
        drafted / max(steps, 1),
    )


def per_step_ms(phases: dict[str, float], steps: int) -> dict[str, float]:
    return {p: round(1e3 * phases[p] / max(steps, 1), 4) for p in PHASES}


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# No-draft step / auto-regressive step, in lockstep",
        "",
        f"Held-out prompts, {meta['max_tokens']} tokens per request (EOS ignored), {meta['rounds']} rounds; "
        "an AR engine and a load-aware engine of the method on the same weights step in turn. "
        "Steady no-draft steps: decoding steps in which no request drafted, more than a few steps after one "
        "that prefilled or verified trees (AR: its decoding steps past the prefill's few); the ratio of "
        "their mean milliseconds, and of their medians (which one stall of the machine does not move). Milliseconds "
        "read high (each engine's step runs with caches the other's left); the ratio is the measure. "
        f"Command: `{meta['command']}`",
        "",
        "| method | batch | T | no-draft / AR | medians' ratio | no-draft ms (steps) | AR ms (steps) "
        "| drafted request-steps | " + " | ".join(f"{p} +us" for p in PHASES) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES),
    ]
    for r in rows:
        if r.ratio is None:
            lines.append(f"| {r.method} | {r.batch} | {r.temperature:g} | - | - | - ({r.steps}) | {r.ar_ms:.3f} "
                         f"({r.ar_steps}) | {100 * r.drafted:.0f}% |" + " - |" * len(PHASES))  # fmt: skip
            continue
        extra = " | ".join(f"{1e3 * (r.phases_ms[p] - r.ar_phases_ms[p]):+.1f}" for p in PHASES)
        lines.append(
            f"| {r.method} | {r.batch} | {r.temperature:g} | **{r.ratio:.3f}** | {r.median_ratio:.3f} "
            f"| {r.ms:.3f} ({r.steps}) | {r.ar_ms:.3f} ({r.ar_steps}) | {100 * r.drafted:.0f}% | {extra} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = [m for m in DRAFTERS if m != "ar"]
    ap.add_argument(
        "--methods", nargs="+", default=["redrafter", "sd", "lyanna"], choices=methods, help="(default: %(default)s)"
    )
    add_engine_argument(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default: %(default)s)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="(default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per cell (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/no_draft"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    paths = engine_paths(ap, args.engine)
    if args.rounds < 1 or args.max_tokens < 2 or min(args.batches) < 1:
        ap.error("--rounds and --batches must be >= 1, --max-tokens >= 2")
    texts = heldout_prompts(max(args.batches))
    loaded: dict[str, LoadedEngine] = {}
    rows: list[Row] = []
    cells = [(m, b, t) for m in args.methods for b in args.batches for t in args.temperatures]
    for method, batch, temperature in tqdm(cells, desc="no-draft steps in lockstep"):
        path = paths[DRAFTERS[method]]
        if path not in loaded:
            loaded[path] = LoadedEngine.load(path, device=args.device)
        engine = loaded[path]
        config = RuntimeConfig(max_batch_size=batch, speculation="load-aware")
        ar, spec = LLMEngine(engine, config), LLMEngine(engine, config)
        spec.prepare()
        prompts = [engine.encode(t) for t in texts[:batch]]
        phases, times, ar_phases, ar_times, drafted = lockstep(
            ar, spec, method, prompts, args.max_tokens, temperature, args.rounds
        )
        steps, ar_steps = len(times), len(ar_times)
        ms, ar_ms = 1e3 * sum(phases.values()) / max(steps, 1), 1e3 * sum(ar_phases.values()) / max(ar_steps, 1)
        both = bool(steps and ar_steps)
        row = Row(
            method=method,
            engine=path,
            batch=batch,
            temperature=temperature,
            steps=steps,
            ar_steps=ar_steps,
            ms=round(ms, 4),
            ar_ms=round(ar_ms, 4),
            ratio=round(ms / ar_ms, 4) if both else None,
            median_ratio=round(statistics.median(times) / statistics.median(ar_times), 4) if both else None,
            phases_ms=per_step_ms(phases, steps),
            ar_phases_ms=per_step_ms(ar_phases, ar_steps),
            drafted=round(drafted, 4),
        )
        rows.append(row)
        tqdm.write(f"{method} batch {batch} T={temperature:g}: no-draft / AR {row.ratio} ({steps} steps)")
    meta = {
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "command": command("benchmarks.no_draft", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
