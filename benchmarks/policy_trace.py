"""Why load-aware speculation chose what it chose: one engine, one method, one batch.

    python -m benchmarks.policy_trace --engine engines/demo-draft-lm --method sd --batch 1
    python -m benchmarks.policy_trace --engine engines/demo-lyanna --method lyanna --device cuda

Runs `--rounds` rounds of `--batch` held-out prompts (`--max-tokens` each, EOS ignored) with
the default speculation and records every step the policy learns from
(`SpeculationPolicy.observe`): the sizes it gave, whether a probe or a plain probe ran, the
forward's and each drafting call's milliseconds, the seconds its choice predicted and what
its standing decision expected of its trees (`promised`). Then, per drafting-cost fit
(`SpeculationPolicy.draft_cost`: per method and drafting path, greedy and sampled apart), its
samples (start-up or live) by shape and its price of a few shapes; the forward table
calibrated at start; the estimated tokens per step of each kind and size. Writes `<out>.json`
and `<out>.md`.

A fit priced far above its live calls, or one sample alone, is what switched speculation off
where it pays: session 24 found two this way on an H200 (a draft LM's greedy levels priced by
sampled ones timed at start-up, ~3x dear; Lyanna's one cold first call, 92-154 ms).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.report import by_count, command, machine, write_report
from benchmarks.timing import add_decoding_arguments, round_params, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.speculation_policy import SpeculationPolicy, StepStats
from training.corpus import heldout_prompts

PRICED = [(1, 1, 0, 1), (3, 3, 0, 3), (5, 5, 0, 5), (3, 12, 0, 3)]
"""Drafting-call shapes each fit is asked to price: (levels, drafted nodes, tokens caught up,
request-levels), i.e. a 1-, 3- and 5-level chain of one request and a 3-level 12-node tree."""
TABLE_TOKENS = [1, 2, 4, 8, 16, 32]
"""Token counts of the calibrated forward table reported."""


def trace(llm: LLMEngine, prompts: list[list[int]], method: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The steps the policy observed over `args.rounds` rounds, one row each."""
    policy, steps = llm.policy, []
    observe = SpeculationPolicy.observe

    def recorded(self: SpeculationPolicy, stats: StepStats) -> None:
        if self is not policy:
            return observe(self, stats)
        probes, plain = policy.probes, policy.plain_probes
        # what the choice promised: its step's seconds, and its standing decision's trees' tokens
        settled, predicted = policy._settled, policy._expected
        expecting = settled.expecting if settled is not None else None
        observe(policy, stats)
        priced = stats.priced_seconds
        steps.append({
            "requests": stats.num_requests,
            "tokens": stats.num_tokens,
            "prefill": stats.prefill,
            "sizes": sorted(o.size for o in stats.outcomes),
            "forward_ms": stats.forward_seconds * 1e3,
            "drafting_ms": {fit: call[-1] * 1e3 for fit, call in stats.drafting.items()},
            "choose_ms": stats.choose_seconds * 1e3,
            "probes_after": policy.probes - probes,
            "plain_probes_after": policy.plain_probes - plain,
            "predicted_ms": None if predicted is None else predicted * 1e3,
            "priced_ms": None if priced is None else priced * 1e3,
            "trees_expected": expecting[0] if expecting else None,
            "trees_made": float(sum(1 + o.accepted for o in stats.outcomes)) if expecting else None,
        })  # fmt: skip

    # on the class, for this engine's policy only: a compiled policy's instances take no
    # attributes of their own (`runtime.native_policy`), and the engine calls it through the class
    SpeculationPolicy.observe = recorded  # type: ignore[method-assign]
    try:
        for r in tqdm(range(args.rounds), desc="policy trace", unit="round"):
            start = len(steps)
            llm.generate(prompts, round_params(len(prompts), args.max_tokens, args.temperature, r), method)
            for step in steps[start:]:
                step["round"] = r
    finally:
        SpeculationPolicy.observe = observe  # type: ignore[method-assign]
    return steps


def promised(steps: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """What the choices promised against what they made: the tokens the trees of decisions
    that stood (or were just settled) yielded over what those decisions expected of them
    (a probe's step expects nothing); drafting and plain decoding steps' seconds (forward,
    drafting, host work: what the policy prices) over what their choice predicted. Below 1
    for trees or above 1 for seconds, the policy drafts on promises the steps do not keep
    (Lyanna at batch 8, T=0, 2-thread EPYC, 6 rounds: trees 0.79, drafting steps 1.12, plain
    1.03; a lockstep run of 6 rounds read 0.94, 1.06 and 1.04)."""
    out: dict[str, float | int | None] = {}
    standing = [s for s in steps if s["trees_expected"]]
    expected = sum(s["trees_expected"] for s in standing)
    out["tree_steps"] = len(standing)
    out["trees_made_over_expected"] = sum(s["trees_made"] for s in standing) / expected if expected else None
    decoding = [s for s in steps if not s["prefill"] and s["predicted_ms"] and s["priced_ms"] is not None]
    for name, drafts in (("drafting", True), ("plain", False)):
        group = [s for s in decoding if bool(s["drafting_ms"]) == drafts]
        predicted = sum(s["predicted_ms"] for s in group)
        out[f"{name}_steps"] = len(group)
        out[f"{name}_seconds_over_predicted"] = sum(s["priced_ms"] for s in group) / predicted if predicted else None
    return out


def fits(llm: LLMEngine) -> dict[str, Any]:
    """Each drafting-cost fit's samples by shape (start-up or live, milliseconds) and prices."""
    out = {}
    for name, fit in sorted(llm.policy.draft_cost.items()):
        shapes = [
            {"shape": list(shape), "start_up": start_up, "ms": [round(s * 1e3, 3) for s in seconds]}
            for shape, (start_up, seconds) in fit.by_shape().items()
        ]
        out[name] = {
            "samples": len(fit),
            "shapes": shapes,
            "price_ms": {str(x): round(fit(*x) * 1e3, 3) for x in PRICED} if len(fit) else {},
        }
    return out


def markdown(meta: dict[str, Any], steps: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    decoding = [s for s in steps if not s["prefill"]]
    drafted = [s for s in decoding if s["drafting_ms"]]
    lines = [
        "# Policy trace: what load-aware speculation chose, and the prices it chose by",
        "",
        f"`{meta['command']}`",
        "",
        f"Engine `{meta['engine']}`, method `{meta['method']}`, batch {meta['batch']}, T={meta['temperature']:g}, "
        f"{meta['rounds']} rounds of {meta['max_tokens']} tokens; {meta['machine']['cpu']}"
        + (f", {meta['machine']['gpu']}" if "gpu" in meta["machine"] else "")
        + f". {len(decoding)} decoding steps, {len(drafted)} with drafting; probes {summary['probes']}, "
        f"plain probes {summary['plain_probes']}; full solves by cause (`speculation_policy.SOLVE_CAUSES`): "
        + by_count(summary["solves"])
        + "; sizes (request-steps): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(summary["sizes"].items(), key=lambda kv: int(kv[0]))),
        "",
        "| fit | samples | start-up shapes | "
        + " | ".join(f"price {x} ms" for x in PRICED)
        + " | live calls (ms, first 8) |",
        "|---|---|---|" + "---|" * len(PRICED) + "---|",
    ]
    for name, f in summary["fits"].items():
        live = [ms for shape in f["shapes"] if not shape["start_up"] for ms in shape["ms"]]
        start_up = sum(shape["start_up"] for shape in f["shapes"])
        prices = [str(f["price_ms"].get(str(x), "-")) for x in PRICED]
        lines.append(f"| {name} | {f['samples']} | {start_up} | " + " | ".join(prices) + f" | {live[:8]} |")
    table = summary["forward_table_ms"]

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    kept = summary["promised"]
    lines += [
        "",
        f"Promised and made (`promised`): the trees of standing decisions made "
        f"{ratio(kept['trees_made_over_expected'])} x the tokens they were expected to ({kept['tree_steps']} "
        f"steps); drafting steps took {ratio(kept['drafting_seconds_over_predicted'])} x their predicted seconds "
        f"({kept['drafting_steps']} steps), plain steps {ratio(kept['plain_seconds_over_predicted'])} x "
        f"({kept['plain_steps']} steps; the choice itself left out of both).",
        "",
        "Forward table (ms, calibrated on one request): " + ", ".join(f"{n} tokens {ms}" for n, ms in table.items()),
        "",
        "Estimated tokens per step (kind: size -> tokens): "
        + "; ".join(
            f"{k}: " + ", ".join(f"{s} -> {t:.2f}" for s, t in v.items()) for k, v in summary["estimates"].items()
        ),
        "",
        "| step | round | requests | sizes drafted | forward ms | drafting ms | probe | plain probe |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(decoding[:200]):
        drafting = ", ".join(f"{fit} {ms:.2f}" for fit, ms in s["drafting_ms"].items()) or "-"
        lines.append(
            f"| {i} | {s['round']} | {s['requests']} | {s['sizes'] or '-'} | {s['forward_ms']:.2f} | {drafting} | "
            f"{s['probes_after'] or ''} | {s['plain_probes_after'] or ''} |"
        )
    if len(decoding) > 200:
        lines.append(f"| ... {len(decoding) - 200} more steps in the JSON | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="engines/demo-redrafter", help="(default: %(default)s)")
    ap.add_argument("--method", default=None, help="decoding method (default: the engine's own)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (default: %(default)s)")
    add_decoding_arguments(ap, rounds=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/policy_trace"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 1 or args.max_tokens < 1 or args.temperature < 0:
        ap.error("need --batch, --rounds and --max-tokens >= 1 and --temperature >= 0")
    loaded = LoadedEngine.load(args.engine, device=args.device)
    if args.batch > loaded.config.build.max_batch_size:
        ap.error(f"--batch {args.batch} > the engine's max_batch_size {loaded.config.build.max_batch_size}")
    llm = LLMEngine(loaded, RuntimeConfig(max_batch_size=args.batch))
    method = args.method or llm.default_method
    if method not in llm.proposers:
        ap.error(f"--method {method!r}: {args.engine} decodes {', '.join(sorted(llm.proposers))}")
    prompts = [loaded.encode(t) for t in heldout_prompts(args.batch)]
    llm.prepare()
    warm_up(llm, prompts[0], method, temperature=args.temperature)
    steps = trace(llm, prompts, method, args)
    decoding = [s for s in steps if not s["prefill"]]
    sizes = Counter(size for s in decoding for size in s["sizes"])
    plain = sum(s["requests"] - len(s["sizes"]) for s in decoding)
    llm.policy.learn()  # (the steps it has not learned yet: the tables below read them)
    summary = {
        "probes": llm.policy.probes,
        "plain_probes": llm.policy.plain_probes,
        "solves": dict(llm.policy.solves.most_common()),
        "sizes": {str(k): v for k, v in ({1: plain} | dict(sizes)).items() if v},
        "fits": fits(llm),
        "forward_table_ms": {n: round(llm.policy.forward_cost(n) * 1e3, 3) for n in TABLE_TOKENS},
        "estimates": llm.policy.estimates(),
        "promised": promised(steps),
    }
    meta = {
        "command": command("benchmarks.policy_trace", argv),
        "engine": str(args.engine),
        "method": method,
        "batch": args.batch,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "machine": machine(),
    }
    write_report(args.out, meta, steps, markdown(meta, steps, summary), summary)


if __name__ == "__main__":
    main()
