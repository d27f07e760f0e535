"""Load-aware speculation against auto-regression while requests come and go, in lockstep.

    python -m benchmarks.churn                       # `make bench-churn`
    python -m benchmarks.churn --methods lyanna --batches 32 --temperatures 1 --rounds 2

A server's batch changes every few steps: requests finish at their own lengths and waiting
ones take their places. Here each round sends `4 x batch` held-out prompts, each asking for a
length drawn from `--min-tokens`..`--max-tokens` (EOS ignored, seeded by round), to an engine
of at most `batch` requests in flight, so the batch churns from start to end. Two engines on
the same weights, one auto-regressive and one with the method (load-aware), take the same
requests and step in turn (`benchmarks.lockstep.in_turn`). Reported per cell: tokens/s of
each and their ratio, tokens per step, the share of the method's steps whose sizes were
solved afresh (not a standing decision: `SpeculationPolicy.reused`), and each engine's
milliseconds of schedule phase per step. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lockstep import in_turn
from benchmarks.report import Cell, command, machine, write_report
from benchmarks.step_profile import DRAFTERS, add_engine_argument, engine_paths
from benchmarks.timing import warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from training.corpus import heldout_prompts

PER_SLOT = 4
"""Requests a round sends per request the batch holds (`4 x batch`): the batch churns from start to end."""


@dataclass
class Row(Cell):
    ratio: float
    """The method's tokens/s over AR's, all rounds."""
    tok_s: float
    ar_tok_s: float
    tokens_per_step: float
    """The method's tokens per forward a request took part in (its prefill's included)."""
    solved: float
    """Share of the method's steps whose sizes were solved afresh."""
    schedule_us: float
    """The method's schedule phase, microseconds per step."""
    ar_schedule_us: float


def cell(loaded: LoadedEngine, engine: str, method: str, batch: int, temperature: float, args: Any) -> Row:
    config = RuntimeConfig(max_batch_size=batch, max_num_tokens=2048, speculation="load-aware")
    engines = {"ar": LLMEngine(loaded, config), method: LLMEngine(loaded, config)}
    prompts = [loaded.encode(t) for t in heldout_prompts(16)]
    for key, llm in engines.items():
        llm.prepare()
        warm_up(llm, prompts[0], key, temperature)
        llm.clock.reset()
    seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    policy = engines[method].policy
    decided, reused = policy.steps, policy.reused
    requests = []
    for r in range(args.rounds):
        rng = random.Random(r)
        n = PER_SLOT * batch
        lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(n)]
        for key, llm in engines.items():
            for i, length in enumerate(lengths):
                params = SamplingParams(max_tokens=length, temperature=temperature, seed=1000 * r + i, ignore_eos=True)
                request = llm.add_request(prompts[i % len(prompts)], params, key)
                if key == method:
                    requests.append(request)
            tokens[key] += sum(lengths)
        for key, llm in in_turn(engines, r):
            start = time.perf_counter()
            llm.step()
            seconds[key] += time.perf_counter() - start
    clock = {key: llm.clock for key, llm in engines.items()}
    emitted = tokens[method]
    return Row(
        method,
        engine,
        batch,
        temperature,
        ratio=(emitted / seconds[method]) / (tokens["ar"] / seconds["ar"]),
        tok_s=emitted / seconds[method],
        ar_tok_s=tokens["ar"] / seconds["ar"],
        tokens_per_step=emitted / max(1, sum(q.result.num_forwards for q in requests)),
        solved=1 - (policy.reused - reused) / max(1, policy.steps - decided),
        schedule_us=clock[method].totals["schedule"] / max(1, clock[method].steps) * 1e6,
        ar_schedule_us=clock["ar"].totals["schedule"] / max(1, clock["ar"].steps) * 1e6,
    )


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# Load-aware speculation against auto-regression while requests come and go, in lockstep",
        "",
        f"Each round {PER_SLOT} x batch held-out prompts of "
        f"{meta['args']['min_tokens']}-{meta['args']['max_tokens']} tokens "
        f"(uniform, EOS ignored) through at most `batch` requests in flight, {meta['args']['rounds']} rounds; "
        f"an AR engine and a load-aware one step in turn. Command: `{meta['command']}`",
        "",
        "| method | batch | T | vs AR | tok/s | AR tok/s | tokens/step | steps solved | schedule us/step "
        "| AR schedule us/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.batch} | {r.temperature:g} | **{r.ratio:.3f}** | {r.tok_s:.0f} | {r.ar_tok_s:.0f} "
            f"| {r.tokens_per_step:.2f} | {r.solved:.0%} | {r.schedule_us:.0f} | {r.ar_schedule_us:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["redrafter", "lyanna"], choices=sorted(set(DRAFTERS) - {"ar"}))
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of 4 x batch requests per cell")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/churn", help="output stem (.json, .md)")
    add_engine_argument(ap)
    args = ap.parse_args(argv)
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error(f"--min-tokens {args.min_tokens} and --max-tokens {args.max_tokens}: need 1 <= min <= max")
    paths = engine_paths(ap, args.engine)
    rows: list[Row] = []
    cells = [(m, b, t) for m in args.methods for b in args.batches for t in args.temperatures]
    loaded: dict[str, LoadedEngine] = {}
    for method, batch, temperature in tqdm(cells, desc="cells"):
        path = paths[DRAFTERS[method]]
        if path not in loaded:  # (setdefault would load it again for every cell)
            loaded[path] = LoadedEngine.load(path)
        rows.append(cell(loaded[path], path, method, batch, temperature, args))
    meta = {"command": command("benchmarks.churn", argv), "args": vars(args), "machine": machine()}
    text = markdown(rows, meta)  # (printed by write_report)
    write_report(Path(args.out), meta, [asdict(r) for r in rows], text)


if __name__ == "__main__":
    main()
