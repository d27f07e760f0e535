"""Where an engine step's time goes, per method and batch size: milliseconds per step of
each phase (`runtime/step_clock.py`: schedule, draft, assemble, forward, verify, commit,
emit), tokens per step and tokens per second, on held-out prompts, with the defaults a
user gets (load-aware speculation).

    python -m benchmarks.step_profile            # `make profile`
    python -m benchmarks.step_profile --batches 1 --methods ar redrafter --max-tokens 32

Each (method, batch) decodes `batch` held-out prompts for `--max-tokens` tokens (EOS
ignored) after a warm-up, twice; the faster run is reported (the phases of that run). On a
GPU the device is synchronised at every phase (`RuntimeConfig.profile`), so kernels are
charged to the phase that launched them. Its steps are also split by kind, as in
`benchmarks.lockstep` (prefill: the forward held prompt chunks; drafting: some request
verified a tree; plain: neither), with milliseconds a step in each phase: the row's mean
mixes them, and at batch 8-32 the prefill steps (24-30 ms each) take a third to a half of
a short run's time, a speculative method's more than AR's (session 37: ReDrafter at batch
8 43% against 34%). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lockstep import STEP_KINDS, StepPhases, by_kind, counters, kinds_table, tally
from benchmarks.report import Cell, command, machine, write_report
from benchmarks.timing import sampling_params, synchronize, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import tokens_per_step
from runtime.step_clock import PHASES
from training.corpus import heldout_prompts

DRAFTERS = {
    "ar": "redrafter",
    "redrafter": "redrafter",
    "ngram": "redrafter",
    "sd": "draft-lm",
    "rsd-c": "draft-lm",
    "rsd-s": "draft-lm",
    "lyanna": "lyanna",
}
"""Method -> the drafter kind of the engine it runs on."""
ENGINES = {"redrafter": "engines/demo-redrafter", "draft-lm": "engines/demo-draft-lm", "lyanna": "engines/demo-lyanna"}
"""Drafter kind -> its demo engine (`make engine` builds them; `--engine KIND=DIR` another)."""


def add_engine_argument(ap: argparse.ArgumentParser) -> None:
    """`--engine KIND=DIR` (repeatable): the engine of a drafter kind (`engine_paths`)."""
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KIND=DIR",
        help=f"the engine of a drafter kind ({', '.join(ENGINES)}), repeatable "
        f"(default: {', '.join(ENGINES.values())})",
    )


def engine_paths(ap: argparse.ArgumentParser, given: list[str]) -> dict[str, str]:
    """Drafter kind -> engine directory: `ENGINES`, with the `--engine KIND=DIR` values given
    (a malformed one, or a kind not in `ENGINES`, exits through `ap.error`)."""
    paths = dict(ENGINES)
    for value in given:
        kind, _, path = value.partition("=")
        if kind not in ENGINES or not path:
            ap.error(f"--engine {value!r}: expected KIND=DIR with a kind of {', '.join(ENGINES)}")
        paths[kind] = path
    return paths


@dataclass
class Row(Cell):  # engine: one of `ENGINES`
    steps: int
    ms_per_step: float
    phases_ms: dict[str, float]
    """Milliseconds per step of each phase."""
    tau: float
    """Tokens per decoding step per request (bonus included)."""
    tokens_per_s: float
    sizes: dict[int, int]
    """Tree size (root included) -> request-steps drafted at it (load-aware choices)."""
    plain_ms: float | None = None
    """Milliseconds per decoding step that drafted nothing (speculation switched off for
    every request; for AR, every decoding step), None if there was none."""
    plain_steps: int = 0
    steady_ms: float | None = None
    """The same over steady no-draft steps (`StepClock.steady_steps`: more than
    `AFTER_PREFILL` steps after one that prefilled or verified trees), None if none."""
    steady_steps: int = 0
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Its steps by kind (`STEP_KINDS`, `lockstep.by_kind`): steps, share of the step time,
    milliseconds a step in all and in each phase."""


def profile(
    llm: LLMEngine, method: str, prompts: list[list[int]], max_tokens: int, temperature: float, engine: str
) -> Row:
    best: Row | None = None
    for _ in range(2):
        llm.clock.reset()
        llm.policy.chosen.clear()
        params = sampling_params(len(prompts), max_tokens, temperature)
        kinds: dict[str, StepPhases] = {}
        synchronize(llm.engine.device)
        start = time.perf_counter()
        requests = [llm.add_request(p, sp, method) for p, sp in zip(prompts, params, strict=True)]
        while llm.has_unfinished():
            before = counters(llm)
            llm.step()
            tally(kinds, llm, before)
        synchronize(llm.engine.device)
        seconds = time.perf_counter() - start
        results = [q.result for q in requests]
        steps = llm.clock.steps
        sizes: dict[int, int] = {}
        for (_, size), n in sorted(llm.policy.chosen.items()):
            sizes[size] = sizes.get(size, 0) + n
        row = Row(
            method=method,
            engine=engine,
            batch=len(prompts),
            temperature=temperature,
            steps=steps,
            ms_per_step=1e3 * seconds / max(steps, 1),
            phases_ms={p: round(v, 3) for p, v in llm.clock.mean_ms().items()},
            tau=tokens_per_step(results),
            tokens_per_s=sum(len(r.output_ids) for r in results) / seconds,
            sizes=sizes,
            plain_ms=llm.clock.plain_ms(),
            plain_steps=llm.clock.plain_steps,
            steady_ms=llm.clock.steady_ms(),
            steady_steps=llm.clock.steady_steps,
            kinds=by_kind(kinds),
        )
        if best is None or row.tokens_per_s > best.tokens_per_s:
            best = row
    assert best is not None
    return best


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# Step profile: milliseconds per engine step, by phase",
        "",
        f"Held-out prompts, {meta['max_tokens']} tokens per request (EOS ignored), default (load-aware) "
        f"speculation; the faster of two runs. Phases as in `runtime/step_clock.py` (prefill steps included). "
        f"No-draft step: the mean of the decoding steps in which no request drafted (for AR, every decoding "
        f"step), and its ratio to AR's: what speculation costs while it is switched off; steady: the same over "
        f"the no-draft steps more than a few steps after one that prefilled or verified trees. Each method is "
        f"compared with AR on its own engine, run just before it (the demo engines share the target's weights, "
        f"but a cell run minutes apart on another engine read plain steps 1.14-1.33x AR's where the same engine "
        f"read 1.01-1.04x). "
        f"Command: `{meta['command']}`",
        "",
        "| method | batch | T | ms/step | " + " | ".join(PHASES) + " | tokens/step/request | tok/s | vs AR "
        "| no-draft ms/step (steps) | no-draft / AR | steady no-draft / AR (steps) | sizes |",
        "|---|---|---|---|" + "---|" * len(PHASES) + "---|---|---|---|---|---|---|",
    ]
    ar = {(r.engine, r.batch, r.temperature): r for r in rows if r.method == "ar"}
    for r in rows:
        base = ar.get((r.engine, r.batch, r.temperature))
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        plain = f"{r.plain_ms:.2f} ({r.plain_steps})" if r.plain_ms is not None else "-"
        plain_ratio = f"{r.plain_ms / base.plain_ms:.3f}" if base and base.plain_ms and r.plain_ms else "-"
        steady = "-"
        if base and base.steady_ms and r.steady_ms:
            steady = f"{r.steady_ms / base.steady_ms:.3f} ({r.steady_steps})"
        sizes = ", ".join(f"{s}: {n}" for s, n in r.sizes.items())
        phases = " | ".join(f"{r.phases_ms[p]:.2f}" for p in PHASES)
        name = _name(r)
        lines.append(
            f"| {name} | {r.batch} | {r.temperature:g} | {r.ms_per_step:.2f} | {phases} | {r.tau:.2f} "
            f"| {r.tokens_per_s:.0f} | {ratio} | {plain} | {plain_ratio} | {steady} | {sizes} |"
        )
    lines += [
        "",
        "## By kind of step",
        "",
        "Each row's steps by kind (" + ", ".join(STEP_KINDS) + ": the forward held prompt chunks; some request "
        "verified a tree; neither), their share of its step time, and milliseconds a step in all and in each "
        "phase: the decoding steps' phases without the prefill's.",
        "",
        *kinds_table(
            ["method", "batch", "T"], [([_name(r), str(r.batch), f"{r.temperature:g}"], r.kinds) for r in rows]
        ),
    ]
    return "\n".join(lines) + "\n"


def _name(row: Row) -> str:
    """A row's method as its tables name it (AR with its engine: each engine's methods have their own)."""
    return row.method if row.method != "ar" else f"ar ({Path(row.engine).name})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS), help="(default: all)")
    add_engine_argument(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default: %(default)s)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="(default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step_profile"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    paths = engine_paths(ap, args.engine)
    prompts_text = heldout_prompts(max(args.batches))
    loaded: dict[str, LoadedEngine] = {}
    rows = []
    # AR on each engine a method runs on, just before that engine's methods
    engine_of = {m: paths[DRAFTERS[m]] for m in DRAFTERS}
    order = list(dict.fromkeys(engine_of[m] for m in args.methods))
    methods = {path: ["ar", *(m for m in args.methods if m != "ar" and engine_of[m] == path)] for path in order}
    settings = [
        (m, path, b, t) for path in order for b in args.batches for t in args.temperatures for m in methods[path]
    ]
    engines: dict[tuple[str, int], LLMEngine] = {}
    for method, path, batch, temperature in tqdm(settings, desc="step profile"):
        if path not in loaded:
            loaded[path] = LoadedEngine.load(path, device=args.device)
        engine = loaded[path]
        if (path, batch) not in engines:
            engines[(path, batch)] = LLMEngine(engine, RuntimeConfig(max_batch_size=batch, profile=True))
        llm = engines[(path, batch)]
        prompts = [engine.encode(t) for t in prompts_text[:batch]]
        warm_up(llm, prompts[0], method, temperature)
        rows.append(profile(llm, method, prompts, args.max_tokens, temperature, path))
        tqdm.write(f"{method} batch {batch} T={temperature:g}: {rows[-1].ms_per_step:.2f} ms/step {rows[-1].phases_ms}")
    meta = {
        "max_tokens": args.max_tokens,
        "command": command("benchmarks.step_profile", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
