"""ReDrafter sweep: acceptance, beam-packing compression and speedup over auto-regressive
decoding, per (beam width W, beam length L, temperature T).

    python -m benchmarks.redrafter_sweep --engine engines/demo-redrafter

For every setting the same held-out prompts run once with ReDrafter and once
auto-regressively, alternating prompt by prompt on the same engine, one request at a
time (the latency-bound regime of the ReDrafter paper's Table 2), with a fixed output
length (EOS ignored) so both decode the same number of tokens. Reported:
- tau: tokens emitted per target forward (bonus included), hardware-independent;
- acceptance@k: fraction of speculative steps that accepted at least k draft tokens;
- compression: beam tokens W*(L+1) / tree nodes actually verified (dynamic tree attention);
- speedup: auto-regressive ms/token / ReDrafter ms/token, measured in the same run.
Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from benchmarks.timing import ONE_AT_A_TIME, alternate, sampling_params, timed
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.redrafter import ReDrafterParams
from training.corpus import heldout_prompts


@dataclass
class SweepRow:
    beam_width: int
    beam_length: int
    temperature: float
    tau: float
    acceptance_at: list[float]  # [L]: P(accepted >= k), k = 1..L
    compression: float
    ar_ms_per_token: float
    spec_ms_per_token: float
    speedup: float


def run_setting(
    engine: LLMEngine,
    prompts: list[list[int]],
    spec: ReDrafterParams,
    temperature: float,
    max_tokens: int,
    method: str = "redrafter",
) -> SweepRow:
    """`method` (W x L beams: redrafter, or rsd-s) against AR, alternating prompt by prompt."""
    shape = {"beam_width": spec.beam_width, "beam_length": spec.beam_length}
    params = sampling_params(len(prompts), max_tokens, temperature)
    timings = alternate(  # prompt by prompt: machine noise hits both methods alike
        (
            {
                method: functools.partial(timed, engine, [prompt], [p], method, **shape),
                "ar": functools.partial(timed, engine, [prompt], [p], "ar"),
            }
            for prompt, p in zip(prompts, params, strict=True)
        ),
        "ar",
    )
    ar, spec_runs = timings["ar"], timings[method]
    steps = [a for r in spec_runs.results for a in r.accepted_per_step]
    nodes = sum(r.num_drafted for r in spec_runs.results) / len(steps) + 1  # + root
    return SweepRow(
        beam_width=spec.beam_width,
        beam_length=spec.beam_length,
        temperature=temperature,
        tau=sum(a + 1 for a in steps) / len(steps),
        acceptance_at=[sum(a >= k for a in steps) / len(steps) for k in range(1, spec.beam_length + 1)],
        compression=spec.beam_width * (spec.beam_length + 1) / nodes,
        ar_ms_per_token=1000 * ar.seconds / ar.tokens,
        spec_ms_per_token=1000 * spec_runs.seconds / spec_runs.tokens,
        speedup=(ar.seconds / ar.tokens) / (spec_runs.seconds / spec_runs.tokens),
    )


def markdown(rows: list[SweepRow], meta: dict[str, object]) -> str:
    lines = [
        "# ReDrafter sweep",
        "",
        f"Engine `{meta['engine']}`, {meta['prompts']} held-out prompts x {meta['max_tokens']} tokens, batch 1, "
        f"{meta['machine']['cpu']} ({meta['machine']['torch_threads']} threads). Speedup = auto-regressive ms/token "  # type: ignore[index]
        "/ ReDrafter ms/token, measured alternately in the same run; tau = tokens per target forward. "
        f"Command: `{meta['command']}`",
        "",
        "| T | W | L | tau | acceptance@1..L | compression | AR ms/tok | ReDrafter ms/tok | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r.acceptance_at)
        lines.append(
            f"| {r.temperature:g} | {r.beam_width} | {r.beam_length} | {r.tau:.2f} | {acc} | {r.compression:.2f} "
            f"| {r.ar_ms_per_token:.2f} | {r.spec_ms_per_token:.2f} | {r.speedup:.2f}x |"
        )
    best = max(rows, key=lambda r: r.speedup)
    setting = f"T={best.temperature:g}, W={best.beam_width}, L={best.beam_length}"
    lines += ["", f"Best speedup: {best.speedup:.2f}x at {setting} (tau {best.tau:.2f})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine", type=Path, default=Path("engines/demo-redrafter"), help="engine with a ReDrafter drafter"
    )
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--widths", default="1,2,4,8,16", help="beam widths W (default: %(default)s)")
    ap.add_argument("--lengths", default="3,4,5", help="beam lengths L (default: %(default)s)")
    ap.add_argument("--temperatures", default="0,1", help="temperatures T (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/redrafter_sweep"), help="output path stem")
    args = ap.parse_args(argv)

    loaded = LoadedEngine.load(args.engine)
    if loaded.redrafter is None:
        raise SystemExit(f"error: {args.engine} has no ReDrafter RNN drafter; build it with --drafter")
    prompts = [loaded.encode(t) for t in heldout_prompts(args.prompts)]
    grid = list(
        itertools.product(
            [float(t) for t in args.temperatures.split(",")],
            [int(w) for w in args.widths.split(",")],
            [int(n) for n in args.lengths.split(",")],
        )
    )
    largest = max(w * n for _, w, n in grid)  # the widest tree must fit a step (W=16, L=5: 80 drafts)
    config = replace(ONE_AT_A_TIME, max_draft_tokens=max(largest, ONE_AT_A_TIME.max_draft_tokens))
    engine = LLMEngine(loaded, config)
    # warm-up: first calls pay for allocator growth and lazy initialisation
    run_setting(engine, prompts[:2], ReDrafterParams(2, 2), 0.0, 8)
    rows = []
    for temperature, width, length in tqdm(grid, desc="redrafter sweep", unit="setting"):
        rows.append(run_setting(engine, prompts, ReDrafterParams(width, length), temperature, args.max_tokens))
        tqdm.write(json.dumps(asdict(rows[-1])))
    meta = {
        "engine": str(args.engine),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "command": command("benchmarks.redrafter_sweep", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
