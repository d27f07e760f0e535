"""Lyanna Table 1: conditional acceptance at drafting steps 1..3 (depth 3, width 4, budget
16, no re-sampling, greedy) of the full drafter and of each ablation."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lyanna.common import DEPTH, WIDTH, build, drafted_per_step, steps_of
from benchmarks.prompts import bundled
from benchmarks.report import named_dirs, write_report
from benchmarks.timing import ONE_AT_A_TIME, sampling_params
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import tokens_per_step

BUDGET = 16
DEFAULT_ABLATIONS = (
    "no-token-info=work_dirs/lyanna-no-token-info",
    "no-fusion=work_dirs/lyanna-no-fusion",
    "full-ablation-run=work_dirs/lyanna-full",
)
"""NAME=DIR of the ablated drafters (and the full model trained like them, the fair reference)."""
ABLATION_LABELS = {
    "no-token-info": "w/o token info",
    "no-fusion": "w/o first-token fusion",
    "full-ablation-run": "full model (ablation training run)",
}


@dataclass
class Table1Row:
    model: str
    drafter_dir: str
    conditional_acceptance: list[float]
    """Steps 1..depth."""
    reached: list[int]
    """Steps 1..depth: #decoding steps that accepted >= i-1 drafted tokens (the denominators)."""
    tau: float
    steps: int
    drafted_per_step: float


def conditional_acceptance(steps: list[int], depth: int) -> list[float]:
    """[depth]: #steps with >= i accepted / #steps with >= i-1 accepted, i = 1..depth (0 when
    no step reached i-1)."""
    out = []
    for i in range(1, depth + 1):
        reached = sum(a >= i - 1 for a in steps)
        out.append(sum(a >= i for a in steps) / reached if reached else 0.0)
    return out


def ablations(values: list[str] | None) -> dict[str, Path]:
    """`--ablation NAME=DIR` values (DEFAULT_ABLATIONS when None) -> {NAME: DIR}."""
    return named_dirs(values, DEFAULT_ABLATIONS, "--ablation")


def run(llms: dict[str, tuple[str, LLMEngine]], prompts: list[list[int]], max_tokens: int) -> list[Table1Row]:
    """One row per drafter: {name: (drafter dir, engine)}, greedy, no re-sampling."""
    rows = []
    params = sampling_params(len(prompts), max_tokens, 0.0)
    for name, (path, llm) in tqdm(llms.items(), desc="table1", unit="model"):
        results = llm.generate(
            prompts, params, "lyanna", depth=DEPTH, width=WIDTH, budget=BUDGET, resample=False, fuse=False
        )
        steps = steps_of(results)
        rows.append(
            Table1Row(
                name, path, conditional_acceptance(steps, DEPTH),
                [sum(a >= i - 1 for a in steps) for i in range(1, DEPTH + 1)],
                tokens_per_step(results), len(steps), drafted_per_step(results),
            )
        )  # fmt: skip
        tqdm.write(f"table1 {name}: {rows[-1].conditional_acceptance} tau {rows[-1].tau:.2f}")
    return rows


def markdown(rows: list[Table1Row], meta: dict[str, Any], skipped: list[str]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Table 1: conditional acceptance per drafting step",
        "",
        f"{meta['table1_prompts']} held-out prompts x {meta['max_tokens']} tokens (EOS ignored), greedy, batch 1; "
        f"depth {DEPTH}, width {WIDTH}, budget {BUDGET}, no re-sampling; {m['cpu']}. Step i: #decoding steps "
        "that accepted >= i drafted tokens / #steps that accepted >= i-1 (counts in brackets). tau: tokens per "
        "target forward. "
        f"nodes/step: drafted nodes verified per step (a depth-{DEPTH} width-{WIDTH} tree has at most "
        f"{DEPTH * WIDTH}, so budget {BUDGET} is not binding).",
        "",
        "| model | drafter | step 1 | step 2 | step 3 | tau | nodes/step | decoding steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{a:.3f} ({round(a * n)}/{n})" for a, n in zip(r.conditional_acceptance, r.reached, strict=True)
        )
        lines.append(
            f"| {r.model} | `{r.drafter_dir}` | {cells} | {r.tau:.2f} | {r.drafted_per_step:.1f} | {r.steps} |"
        )
    if skipped:
        lines += ["", "Skipped (drafter directory missing): " + ", ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, meta: dict[str, Any], engine: LoadedEngine, llm: LLMEngine) -> None:
    """Build an engine per ablation found (`llm` runs the main drafter), measure, write
    `<out-dir>/lyanna_table1.{json,md}`."""
    llms = {"full model": (str(args.lyanna), llm)}
    skipped = []
    for name, path in ablations(args.ablation).items():
        label = ABLATION_LABELS.get(name, name)
        if not (path / "model.safetensors").is_file():
            skipped.append(f"{label} ({path})")
            tqdm.write(f"table1: skipping {label}: {path}/model.safetensors does not exist")
            continue
        ablated = LoadedEngine.load(build(args.target, args.engine_dir / name, lyanna=path))
        llms[label] = (str(path), LLMEngine(ablated, ONE_AT_A_TIME))
    prompts = [engine.encode(p.text) for p in bundled(args.table1_prompts)]
    rows = run(llms, prompts, args.max_tokens)
    meta = {
        **meta,
        "table1_prompts": args.table1_prompts,
        "depth": DEPTH,
        "width": WIDTH,
        "budget": BUDGET,
        "skipped": skipped,
    }
    write_report(args.out_dir / "lyanna_table1", meta, [asdict(r) for r in rows], markdown(rows, meta, skipped))
