"""A fresh engine's first round: how many steps its slowest request takes, engine after engine.

    python -m benchmarks.first_round --engine engines/demo-redrafter --batch 8 --engines 10
    python -m benchmarks.first_round sd --engine engines/demo-draft-lm --batch 8 --temperature 1

Builds `--engines` engines of one configuration in turn (as `benchmarks.lockstep` takes
them; default: load-aware `redrafter`), each calibrated and warmed up as lockstep's are
(`lockstep.prepared`), and decodes one round of `--batch` held-out prompts (`--max-tokens`
each, EOS ignored) on each: the steps its slowest request took, its request-steps that
drafted nothing, and its full solves by cause (`SpeculationPolicy.solves`). A fixed
`--reference` (default: one-beam ReDrafter chains, `redrafter:fixed[beam_width=1]`; none
for another method unless given) decodes the same round once, for the steps it takes.

Why: a closed batch's first trees are every request's first at once, and a request's first
tokens keep the fewest drafts (`benchmarks.acceptance_by_position`); in fresh engines at
batch 8, T=0, load-aware ReDrafter's first round took 25-58 steps where the fixed chains
take 24, >= 45 in 3 of 10 (session 28, `benchmarks/HISTORY.md`): an auto-regressive decision
made on those trees stood, and brought no trees to lift them. Which engine it happens in
varies with the timings of its first steps, so one run says little: this runs many.
Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.lockstep import Config, add_round, parse_config, prepared
from benchmarks.report import by_count, command, machine, write_report
from benchmarks.timing import add_decoding_arguments
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from training.corpus import heldout_prompts

REFERENCE = "redrafter:fixed[beam_width=1]"
"""The fixed configuration a ReDrafter run is compared with (`--reference`)."""


@dataclass(frozen=True)
class Row:
    engine: int
    """Which engine (0 the first built; -1 the reference)."""
    config: str
    slowest_steps: int
    """Decoding steps of the round's slowest request."""
    plain_share: float
    """Its request-steps that drafted nothing, of all its decoding request-steps."""
    solves: dict[str, int]


def first_round(
    number: int, llm: LLMEngine, config: Config, prompts: list[list[int]], max_tokens: int, temperature: float
) -> Row:
    """One round of `prompts` on a freshly prepared `llm`, engine `number` (`Row.engine`)."""
    requests = add_round(llm, config.method, prompts, max_tokens, temperature, 0, **dict(config.settings))
    while llm.has_unfinished():
        with config.patched():
            llm.step()
    sizes = [s for q in requests for s in q.result.sizes_per_step]
    return Row(
        engine=number,
        config=config.name,
        slowest_steps=max(len(q.result.sizes_per_step) for q in requests),
        plain_share=round(sum(s == 1 for s in sizes) / max(len(sizes), 1), 3),
        solves=dict(llm.policy.solves.most_common()),
    )


def markdown(rows: list[Row], meta: dict[str, object]) -> str:
    runs = [r for r in rows if r.engine >= 0]
    steps = [r.slowest_steps for r in runs]
    lines = [
        "# A fresh engine's first round",
        "",
        f"Engine `{meta['engine']}`, `{meta['config']}`, batch {meta['batch']}, T={meta['temperature']:g}, one round "
        f"of {meta['batch']} held-out prompts of {meta['max_tokens']} tokens (EOS ignored) on each of "
        f"{len(runs)} fresh engines, calibrated and warmed up as lockstep's are. Slowest request's steps: median "
        f"{statistics.median(steps):g}, {min(steps)}-{max(steps)}. Command: `{meta['command']}`",
        "",
        "| engine | configuration | slowest request's steps | plain request-steps | full solves by cause |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        name = "reference" if r.engine < 0 else str(r.engine)
        lines.append(f"| {name} | `{r.config}` | {r.slowest_steps} | {r.plain_share:.0%} | {by_count(r.solves)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "config", nargs="?", default="redrafter", help="as benchmarks.lockstep takes them (default: %(default)s)"
    )
    ap.add_argument("--engine", default="engines/demo-redrafter", help="(default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="requests at once (default: %(default)s)")
    ap.add_argument("--engines", type=int, default=10, help="fresh engines, one round each (default: %(default)s)")
    ap.add_argument(
        "--reference", default=None, help=f"a fixed configuration run once (default: {REFERENCE} for redrafter; 'none')"
    )
    add_decoding_arguments(ap, rounds=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/first_round"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    if min(args.batch, args.engines, args.max_tokens) < 1 or args.temperature < 0:
        ap.error("--batch, --engines and --max-tokens must be >= 1, --temperature >= 0")
    if args.rounds != 1:
        ap.error("--rounds: a first round is one round; run more engines (--engines) instead")
    try:
        config = parse_config(args.config)
        reference_name = args.reference or (REFERENCE if config.method == "redrafter" else "none")
        reference = None if reference_name == "none" else parse_config(reference_name)
    except (ValueError, ImportError) as e:
        ap.error(str(e))
    if not Path(args.engine, "config.json").exists():
        ap.error(f"no engine at {args.engine}: build one with `make engine`")
    engine = LoadedEngine.load(args.engine, device=args.device)
    prompts = [engine.encode(t) for t in heldout_prompts(args.batch)]
    rows = []
    try:
        if reference is not None:
            (llm,) = prepared(engine, {reference.name: reference}, args.batch, prompts[0], args.temperature).values()
            rows.append(first_round(-1, llm, reference, prompts, args.max_tokens, args.temperature))
        for i in tqdm(range(args.engines), desc="fresh engines"):
            (llm,) = prepared(engine, {config.name: config}, args.batch, prompts[0], args.temperature).values()
            rows.append(first_round(i, llm, config, prompts, args.max_tokens, args.temperature))
    except ValueError as e:
        ap.error(str(e))
    meta = {
        "engine": args.engine,
        "config": args.config,
        "reference": reference_name,
        "batch": args.batch,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "command": command("benchmarks.first_round", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
