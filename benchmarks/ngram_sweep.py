"""Prompt-lookup (n-gram) decoding vs auto-regression on held-out prompts: tau and speedup,
one request at a time and a batch, on any engine (the method needs no drafter).

    python -m benchmarks.ngram_sweep --engine engines/demo

Each round runs the same prompts with ngram and with AR on the same engine (alternating,
`benchmarks.timing.alternate`), fixed output length (EOS ignored). Reported per (batch,
temperature, draft tokens k): tau (tokens per decoding forward, bonus included), the share
of steps that found a match and drafted, ms/token of both, and the median per-round
speedup. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from benchmarks.timing import alternate, sampling_params, timed, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import tokens_per_step
from training.corpus import heldout_prompts


@dataclass
class Row:
    batch: int
    temperature: float
    num_draft_tokens: int
    tau: float
    drafted_per_step: float
    """Mean drafted tokens verified per decoding step (0 when no n-gram matched)."""
    ar_ms_per_token: float
    ngram_ms_per_token: float
    speedup: float


def run_setting(
    llm: LLMEngine, prompts: list[list[int]], batch: int, temperature: float, k: int, max_tokens: int
) -> Row:
    params = sampling_params(len(prompts), max_tokens, temperature)
    groups = [(prompts[i : i + batch], params[i : i + batch]) for i in range(0, len(prompts), batch)]
    timings = alternate(
        (
            {
                "ngram": functools.partial(timed, llm, ps, prm, "ngram", num_draft_tokens=k),
                "ar": functools.partial(timed, llm, ps, prm, "ar"),
            }
            for ps, prm in groups
        ),
        "ar",
    )
    ar, ngram = timings["ar"], timings["ngram"]
    steps = sum(r.num_forwards - 1 for r in ngram.results)
    return Row(
        batch=batch,
        temperature=temperature,
        num_draft_tokens=k,
        tau=tokens_per_step(ngram.results),
        drafted_per_step=sum(r.num_drafted for r in ngram.results) / max(1, steps),
        ar_ms_per_token=1000 * ar.seconds / ar.tokens,
        ngram_ms_per_token=1000 * ngram.seconds / ngram.tokens,
        speedup=ngram.speedup,
    )


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# Prompt-lookup (n-gram) decoding vs auto-regressive",
        "",
        f"Engine `{meta['engine']}`, {meta['prompts']} held-out prompts x {meta['max_tokens']} tokens "
        f"(EOS ignored), in groups of `batch` requests, ngram and AR alternating group by group on the same "
        f"engine (speedup: median of the per-group ratios). Command: `{meta['command']}`",
        "",
        "| batch | T | k | tau (tokens/step) | drafted/step | AR ms/token | ngram ms/token | speedup vs AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.batch} | {r.temperature:g} | {r.num_draft_tokens} | {r.tau:.2f} | {r.drafted_per_step:.2f} "
            f"| {r.ar_ms_per_token:.1f} "
            f"| {r.ngram_ms_per_token:.1f} | {r.speedup:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="engines/demo", help="engine dir; any engine (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default: %(default)s)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="(default: %(default)s)")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[4], help="k values (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ngram_sweep"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    engine = LoadedEngine.load(args.engine)
    prompts = [engine.encode(t) for t in heldout_prompts(args.prompts)]
    rows = []
    settings = [(b, t, k) for b in args.batches for t in args.temperatures for k in args.draft_tokens]
    engines = {b: LLMEngine(engine, RuntimeConfig(max_batch_size=b, speculation="fixed")) for b in args.batches}
    for llm in engines.values():
        warm_up(llm, prompts[0], "ngram")
        warm_up(llm, prompts[0], "ar")
    for b, t, k in tqdm(settings, desc="ngram sweep"):
        rows.append(run_setting(engines[b], prompts, b, t, k, args.max_tokens))
    meta = {
        "engine": args.engine,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "command": command("benchmarks.ngram_sweep", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
