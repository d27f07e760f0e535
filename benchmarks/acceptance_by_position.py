"""How many drafts a tree keeps by where in its request's output it is drafted.

    python -m benchmarks.acceptance_by_position "redrafter:fixed[beam_width=1]" --batch 8
    python -m benchmarks.acceptance_by_position sd:fixed --engine engines/demo-draft-lm --temperature 1

Decodes `--prompts` held-out prompts `--rounds` times (`--max-tokens` each, EOS ignored,
`--batch` at once; each round seeded apart) with
one fixed configuration (as `benchmarks.lockstep` takes them: every request drafts the same
tree every step, so that position is all that differs), and buckets every verified tree by
the tokens its request had emitted before it (`--bucket` wide): trees, mean drafts kept,
mean tokens a step. Read from each request's own record (`GenerationResult.accepted_per_step`:
its first token comes from the prefill, each step emits its kept drafts and one more).

Why: the load-aware policy prices a kind of request by the mean of its trees, whatever their
position. A request's first tokens are the hardest to guess (held-out prompts end at a line:
the next line's start), so a closed batch's first trees, every request's first at once,
keep the fewest: the demo ReDrafter's 6-node chains at T=0 kept ~1.9 drafts in tokens 0-3
and ~3.3 after 16 (session 28), and the decision those trees led to could stand long after
(`benchmarks/HISTORY.md`). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.lockstep import parse_config, prepared
from benchmarks.report import command, machine, write_report
from benchmarks.timing import add_decoding_arguments, round_params
from runtime.loaded_engine import LoadedEngine
from runtime.results import GenerationResult
from training.corpus import heldout_prompts


@dataclass(frozen=True)
class Row:
    first: int
    """Tokens emitted before the trees of this bucket, at least."""
    last: int
    """... and at most."""
    trees: int
    kept: float
    """Mean drafts kept."""
    tokens_per_step: float
    """Mean tokens a step (kept drafts and one more)."""


def positions(result: GenerationResult) -> list[tuple[int, int]]:
    """(tokens emitted before it, drafts kept) of each step of a request that drafted a
    tree: its first token comes from the prefill, each step emits what it kept and one more."""
    out, emitted = [], 1
    for kept, size in zip(result.accepted_per_step, result.sizes_per_step, strict=True):
        if size > 1:
            out.append((emitted, kept))
        emitted += kept + 1
    return out


def bucketed(trees: list[tuple[int, int]], width: int, most: int) -> list[Row]:
    """`trees` in buckets of `width` tokens emitted before them, up to `most`."""
    rows = []
    for first in range(0, most, width):
        kept = [k for e, k in trees if first <= e < first + width]
        if kept:
            mean = statistics.mean(kept)
            rows.append(Row(first, first + width - 1, len(kept), round(mean, 3), round(mean + 1, 3)))
    return rows


def markdown(rows: list[Row], meta: dict[str, object]) -> str:
    lines = [
        "# Drafts kept by position in the output",
        "",
        f"Engine `{meta['engine']}`, `{meta['config']}`, batch {meta['batch']}, T={meta['temperature']:g}, "
        f"{meta['prompts']} held-out prompts of {meta['max_tokens']} tokens (EOS ignored), {meta['rounds']} "
        "round(s); every verified tree by "
        f"the tokens its request had emitted before it. Command: `{meta['command']}`",
        "",
        "| tokens emitted before | trees | drafts kept | tokens a step |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r.first}-{r.last} | {r.trees} | {r.kept:.2f} | {r.tokens_per_step:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a fixed configuration, as benchmarks.lockstep takes them (e.g. sd:fixed)")
    ap.add_argument("--engine", default="engines/demo-redrafter", help="(default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="requests at once (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--bucket", type=int, default=4, help="tokens a bucket spans (default: %(default)s)")
    add_decoding_arguments(ap, rounds=1)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/acceptance_by_position"),
        help="(default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if min(args.batch, args.prompts, args.bucket, args.max_tokens) < 1 or args.temperature < 0:
        ap.error("--batch, --prompts, --bucket and --max-tokens must be >= 1, --temperature >= 0")
    try:
        config = parse_config(args.config)
    except (ValueError, ImportError) as e:
        ap.error(str(e))
    if config.speculation != "fixed":
        ap.error(f"{args.config!r} is load-aware: its sizes move with position; measure a fixed one (e.g. sd:fixed)")
    if not Path(args.engine, "config.json").exists():
        ap.error(f"no engine at {args.engine}: build one with `make engine`")
    engine = LoadedEngine.load(args.engine, device=args.device)
    prompts = [engine.encode(t) for t in heldout_prompts(args.prompts)]
    try:
        (llm,) = prepared(engine, {config.name: config}, args.batch, prompts[0], args.temperature).values()
    except ValueError as e:
        ap.error(str(e))
    results = []
    for round_ in range(args.rounds):  # (at T > 0 each round's seeds apart: another text per prompt)
        params = round_params(len(prompts), args.max_tokens, args.temperature, round_)
        results += llm.generate(prompts, params, config.method, **dict(config.settings))
    trees = [t for r in results for t in positions(r)]
    rows = bucketed(trees, args.bucket, args.max_tokens)
    meta = {
        "engine": args.engine,
        "config": args.config,
        "batch": args.batch,
        "prompts": args.prompts,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "command": command("benchmarks.acceptance_by_position", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
