"""Throughput vs batch size: auto-regressive, a method with a fixed tree (its largest; with
`--fixed-also`, a second fixed setting too, e.g. `beam_width=1`), and the same method with
load-aware speculation, on the in-flight batching engine.

    python -m benchmarks.batch_sweep --engine engines/demo-redrafter
    python -m benchmarks.batch_sweep --engine engines/demo-draft-lm --method rsd-c --batch-sizes 1,8 \
        --out benchmarks/results/batch_sweep_rsd-c

For each batch size B, max(B, --min-prompts) held-out prompts are decoded with at most B
running at once (in-flight batching: a finished request's place goes to the next; so
batch 1 averages over several prompts instead of timing one), fixed output length, EOS
ignored, greedy or at --temperature, by each of the three configurations, in alternating
rounds on the same engine so machine noise hits them alike (each round's requests seeded
apart from the other rounds', the same for every configuration: `round_runs`). Reported per B:
- output tokens/s of each configuration (prefill included, as a user sees it) and its
  ratio to auto-regressive decoding: the median over rounds of the ratio measured within
  one round (robust to bursts of load on a shared machine); load-aware's ratio over the
  best of AR and the fixed configurations (what adaptive speculation must match within 3%);
- tau: tokens emitted per decoding step per request (bonus included; 1 for AR);
- the tree sizes (nodes, root included) load-aware speculation chose, as a histogram over request-steps;
- no-draft step / AR step: the mean time of load-aware's decoding steps in which no request
  drafted over the mean time of AR's decoding steps, same rounds, first of the steady ones
  (more than 4 steps after a step that prefilled or verified trees, on both sides:
  `StepClock.steady_steps`), then of all (`StepClock.count_plain`): what speculation costs
  while it is switched off. Probing steps are in neither; the slow steps right after a
  probe's (its cost: the CPU's caches hold the probe step's data) are in the second;
- where the time goes, per configuration: the share of its time in steps whose forward
  held prompt chunks (the ramp while a batch's prompts prefill, chunked by the token
  budget) and the milliseconds per emitted token in those steps and in decode-only steps
  (`StepClock.count_step`): a method that drafts while prompts prefill pays its trees'
  tokens out of the prefill budget, and in a closed batch uneven progress leaves a tail of
  small steps; the columns show which of the two a loss to AR comes from.
Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from benchmarks.timing import Run, alternate, round_params, timed, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.registry import DEFAULT_METHOD, methods_for
from runtime.results import tokens_per_step
from runtime.step_clock import StepClock
from training.corpus import heldout_prompts

Config = tuple[str, str, dict[str, Any]]
"""(method, speculation mode, the method's settings over the engine's)."""


def configs(method: str, also: dict[str, Any] | None = None) -> dict[str, Config]:
    """Configuration name -> `Config`: AR, `method` fixed (its largest tree), `method` fixed
    with the settings `also` (`--fixed-also`: e.g. one beam, the best fixed tree of a
    batch-1 CPU), `method` load-aware."""
    out: dict[str, Config] = {"ar": ("ar", "fixed", {}), f"{method}-fixed": (method, "fixed", {})}
    if also:
        out[fixed_name(method, also)] = (method, "fixed", also)
    out[f"{method}-load-aware"] = (method, "load-aware", {})
    return out


def fixed_name(method: str, settings: dict[str, Any]) -> str:
    return f"{method}-fixed[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]"


def parse_settings(text: str) -> dict[str, Any]:
    """`key=value[,key=value]` (ints, floats, true/false, else strings) -> dict."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value[,key=value], got {text!r}")
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key] = lowered == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


@dataclass
class Row:
    batch_size: int
    tokens_per_s: dict[str, float]
    ratio_to_ar: dict[str, float]
    """Every configuration's (AR's is 1)."""
    tau: dict[str, float]
    load_aware_budgets: dict[int, int] = field(default_factory=dict)
    plain_step_ratio: float | None = None
    """Load-aware's no-draft decoding step over AR's decoding step (None: it always drafted)."""
    plain_steps: int = 0
    """Load-aware's no-draft decoding steps that ratio averages."""
    steady_step_ratio: float | None = None
    """The same of the steady steps on both sides (`StepClock.steady_steps`)."""
    steady_steps: int = 0
    """Load-aware's steady no-draft decoding steps that ratio averages."""
    phases: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """configuration -> "prefilling" / "decoding" -> share of its time, ms per emitted token."""
    round_ratios: dict[str, list[float]] = field(default_factory=dict)
    """configuration -> its ratio to AR in each round (`ratio_to_ar` is their median): the
    spread a single cell reads from run to run on a shared machine."""


def phases(clock: StepClock) -> dict[str, dict[str, float]]:
    """Share of the time and ms per emitted token of the steps that prefilled and the others."""
    total = sum(k.seconds for k in clock.kinds.values()) or 1.0
    return {
        name: {"share": k.seconds / total, "ms_per_token": 1e3 * k.seconds / max(k.tokens, 1)}
        for name, k in sorted(clock.kinds.items())
    }


def run_batch(
    engines: dict[str, LLMEngine],
    names: dict[str, Config],
    method: str,
    prompts: list[list[int]],
    max_tokens: int,
    rounds: int,
    temperature: float,
) -> tuple[dict[str, float], dict[str, float], dict[str, float], Counter[int], dict[str, list[float]]]:
    """tokens/s over all rounds, median per-round ratio to AR, tau, load-aware budget
    histogram, each round's ratio to AR."""
    for llm in engines.values():
        llm.clock.reset()
    timings = alternate([round_runs(engines, names, prompts, max_tokens, temperature, i) for i in range(rounds)], "ar")
    widths = Counter[int]()
    for (_, size), n in engines[f"{method}-load-aware"].policy.chosen.items():
        widths[size] += n
    taus = {name: [tokens_per_step(run.results) for run in t.runs] for name, t in timings.items()}
    return (
        {name: t.tokens_per_s for name, t in timings.items()},
        {name: t.speedup for name, t in timings.items()},
        {name: sum(t) / len(t) for name, t in taus.items()},
        widths,
        {name: t.ratios for name, t in timings.items()},
    )


def round_runs(
    engines: dict[str, LLMEngine],
    names: dict[str, Config],
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    round_: int,
) -> dict[str, functools.partial[Run]]:
    """Round `round_`'s runs: every configuration decodes the same requests, seeded apart
    from every other round's (`round_params` says why)."""
    params = round_params(len(prompts), max_tokens, temperature, round_)
    return {
        name: functools.partial(timed, engine, prompts, params, names[name][0], **names[name][2])
        for name, engine in engines.items()
    }


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    method = meta["method"]
    names = list(configs(method, meta.get("fixed_also")))
    fixed = [n for n in names if n.startswith(f"{method}-fixed")]
    aware = f"{method}-load-aware"
    lines = [
        "# Throughput vs batch size",
        "",
        f"Engine `{meta['engine']}`, method `{method}`, temperature {meta['temperature']}, "
        f"{meta['max_tokens']} output tokens per request, max(batch, {meta['min_prompts']}) prompts from the "
        f"held-out files with at most `batch` running, {meta['rounds']} alternating rounds (each seeded apart); "
        f"{meta['machine']['cpu']} ({meta['machine']['torch_threads']} threads). Ratios: median over rounds of "
        "the ratio to auto-regressive decoding within a round (load-aware's: least-most over the rounds in "
        "brackets, what one cell moves between runs); tau = tokens per decoding step per request. "
        f"Command: `{meta['command']}`",
        "",
        "| batch | "
        + " | ".join(f"{n} tok/s" for n in names)
        + "".join(f" | {n} / AR" for n in fixed)
        + " | load-aware / AR | load-aware / best of AR and fixed | "
        + "".join(f"tau {n} | " for n in fixed)
        + "tau load-aware | load-aware tree sizes (request-steps) | "
        + "no-draft step / AR step: steady (steps); all (steps) |",
        "|---|" + "---|" * (len(names) + 2 * len(fixed) + 5),
    ]
    for r in rows:
        widths = ", ".join(f"{b} nodes: {n}" for b, n in sorted(r.load_aware_budgets.items()))
        steady = f"{r.steady_step_ratio:.3f} ({r.steady_steps})" if r.steady_step_ratio is not None else "-"
        every = f"{r.plain_step_ratio:.3f} ({r.plain_steps})" if r.plain_step_ratio is not None else "-"
        plain = f"{steady}; all {every}"
        best = max(1.0, *(r.ratio_to_ar[n] for n in fixed))
        lines.append(
            f"| {r.batch_size} | "
            + " | ".join(f"{r.tokens_per_s[n]:.0f}" for n in names)
            + "".join(f" | {r.ratio_to_ar[n]:.2f}x" for n in fixed)
            + f" | {r.ratio_to_ar[aware]:.2f}x{spread(r.round_ratios.get(aware, []))}"
            + f" | {r.ratio_to_ar[aware] / best:.2f}"
            + "".join(f" | {r.tau[n]:.2f}" for n in fixed)
            + f" | {r.tau[aware]:.2f} | {widths} | {plain} |"
        )
    lines += [
        "",
        "Where the time goes: share of each configuration's time in steps that prefilled (prompt chunks in "
        "the forward), and milliseconds per emitted token in those steps and in decode-only steps.",
        "",
        "| batch | configuration | time in steps that prefill | ms/token there | ms/token in decode-only steps |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for n in names:
            p = r.phases.get(n, {})
            pre, dec = p.get("prefilling"), p.get("decoding")
            lines.append(
                f"| {r.batch_size} | {n} | {pre['share'] if pre else 0:.0%} | "
                + (f"{pre['ms_per_token']:.2f}" if pre else "-")
                + " | "
                + (f"{dec['ms_per_token']:.3f}" if dec else "-")
                + " |"
            )
    return "\n".join(lines) + "\n"


def spread(ratios: list[float]) -> str:
    """ " (least-most)" of per-round ratios, where there are two or more."""
    return f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="engine with a drafter")
    ap.add_argument(
        "--method", default=None, help="method to compare with AR (default: the engine's, e.g. redrafter, sd, lyanna)"
    )
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="batch sizes (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="alternating rounds per batch size: the report takes the median of the rounds' ratios, and a shared "
        "machine's speed moves within a sweep (default: %(default)s)",
    )
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch_sweep"), help="output path stem")
    ap.add_argument(
        "--fixed-also",
        type=parse_settings,
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more fixed configuration, the method's settings overridden (e.g. beam_width=1: ReDrafter's "
        "one-beam chain); the report's 'best of AR and fixed' then includes it",
    )
    args = ap.parse_args(argv)

    loaded = LoadedEngine.load(args.engine)
    kind = loaded.config.drafter.kind if loaded.config.drafter else None
    method = args.method or DEFAULT_METHOD[kind]
    if method == "ar" or method not in methods_for(kind):
        raise SystemExit(
            f"error: --method {method} does not speculate on {args.engine}; choose one of "
            f"{[m for m in methods_for(kind) if m != 'ar']} or an engine built with its drafter"
        )
    names = configs(method, args.fixed_also)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(sizes) > loaded.config.build.max_batch_size:
        raise SystemExit(
            f"error: batch size {max(sizes)} > the engine's max_batch_size {loaded.config.build.max_batch_size}; "
            "rebuild it with a larger --max-batch-size"
        )
    texts = heldout_prompts(max(*sizes, args.min_prompts))
    rows = []
    for size in tqdm(sizes, desc="batch sweep", unit="batch size"):
        # one engine per configuration: each keeps its own cost and acceptance measurements
        engines = {
            name: LLMEngine(loaded, RuntimeConfig(max_batch_size=size, max_num_tokens=2048, speculation=mode))
            for name, (_, mode, _) in names.items()
        }
        prompts = [loaded.encode(t) for t in texts[: max(size, args.min_prompts)]]
        for name, llm in engines.items():  # warm-up (allocator growth, first-step measurements)
            warm_up(llm, prompts[0], names[name][0], args.temperature, **names[name][2])
        engines[f"{method}-load-aware"].policy.chosen.clear()
        rate, ratio, taus, widths, per_round = run_batch(
            engines, names, method, prompts, args.max_tokens, args.rounds, args.temperature
        )
        plain, ar = engines[f"{method}-load-aware"].clock, engines["ar"].clock
        plain_ms, ar_ms = plain.plain_ms(), ar.plain_ms()
        plain_ratio = plain_ms / ar_ms if plain_ms and ar_ms else None
        steady_ms, ar_steady_ms = plain.steady_ms(), ar.steady_ms()
        steady_ratio = steady_ms / ar_steady_ms if steady_ms and ar_steady_ms else None
        split = {name: phases(llm.clock) for name, llm in engines.items()}
        rows.append(
            Row(
                size, rate, ratio, taus, dict(widths), plain_ratio, plain.plain_steps,
                steady_ratio, plain.steady_steps, split, per_round,
            )
        )  # fmt: skip
        tqdm.write(str(asdict(rows[-1])))
    meta = {
        "engine": str(args.engine),
        "method": method,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "min_prompts": args.min_prompts,
        "fixed_also": args.fixed_also,
        "command": command("benchmarks.batch_sweep", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
