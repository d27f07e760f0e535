"""Lyanna ("Make Every Draft Count") §7 on the demo model: conditional acceptance, tau and
speedup vs auto-regression and ReDrafter, the hot-token table, and the one-pass LM head.

    python -m benchmarks.lyanna_sweep                       # all four reports
    python -m benchmarks.lyanna_sweep --only table1,fig13a  # a subset

Engines for the main drafter and every ablation are built from `--target` into
`--engine-dir` (batch 1); ReDrafter runs on `--redrafter-engine` (built there from
`--redrafter` when that directory does not exist). Decoding is one request at a time
(batch 1, fixed speculation) on seeded held-out prompts (`benchmarks.prompts.bundled`,
prompt i sampled with seed i), fixed output length (EOS ignored).

- table1 (paper Table 1): conditional acceptance at steps 1..3, depth 3, width 4, budget
  16, no re-sampling, greedy, for the full drafter and each ablation (`--ablation
  NAME=DIR`: no token info, no first-token fusion, and the full model trained like them,
  the fair reference when the ablations had a shorter training run). Conditional acceptance at step i =
  #decoding steps that accepted >= i drafted tokens / #steps that accepted >= i-1; tau =
  tokens per target forward (bonus included, prefill excluded).
- fig12 (paper Figure 12): tau and speedup at verification budgets B (default 12, 16)
  for Lyanna depth 3 width 4 budget B without re-sampling, with re-sampling + fusion and
  with re-sampling without fusion, and ReDrafter W x L = B (4 x B/4), at temperatures 0
  and 1 (where B > depth x width = 12, which that tree cannot fill, also width
  ceil(B/3) without re-sampling). Speed is measured in the same run: every round times, on each engine, AR, then
  its methods at one B, then AR again, then the next B, ...; a method's ratio within a
  round is its tokens/s over the mean of the two bracketing AR rates on its own engine
  (both engines hold the same target), and the reported speedup is the median over rounds.
  "vs ReDrafter" is the median over rounds of Lyanna's ratio / ReDrafter's ratio at the
  same B. Re-sampling may verify up to `resample_budget` nodes beyond B, so the mean
  verified drafted nodes per step (num_drafted / decoding steps) is reported next to tau.
- table2 (paper Table 2): memory of the dense [V, V] token-info table vs the hot [H, H]
  table (bf16, `hot_table_bytes`), and 3-step top-1 agreement with the target on held-out
  corpus windows (teacher forcing: for every position p the chain runs from (H_p,
  t_{p+1}); step i is right when argmax(l_i + bias(t_{p+i})) = the target's argmax at
  p+i) with the dense low-rank bias, the hot-table bias and no bias, for the main drafter
  (trained sparse) and one trained dense (`--dense-drafter`).
- fig13a (paper Figure 13a): latency of `draft_chain` + ONE `head_logits` product over
  the k states vs the same chain with the LM head applied after every step (implemented
  here from the drafter's pieces), k = 3, 5, 8, batch 1 and 8; median of `--repeats`.

Writes `<out-dir>/lyanna_{table1,fig12,table2,fig13a}.{json,md}`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.lyanna import fig12, fig13a, table1, table2
from benchmarks.lyanna.common import build
from benchmarks.prompts import bundled
from benchmarks.report import machine, torch_threads
from benchmarks.timing import ONE_AT_A_TIME
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine

REPORTS = ("table1", "fig12", "table2", "fig13a")


def only(values: list[str] | None) -> list[str]:
    """`--only` values (repeatable, comma lists) -> the chosen reports in REPORTS order (all when None)."""
    if not values:
        return list(REPORTS)
    chosen = [v.strip() for text in values for v in text.split(",") if v.strip()]
    bad = sorted(set(chosen) - set(REPORTS))
    if bad:
        raise SystemExit(f"error: --only {','.join(bad)}: choose from {','.join(REPORTS)}")
    return [r for r in REPORTS if r in chosen]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lyanna_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--only", action="append", help=f"reports to run, repeatable or comma list of {','.join(REPORTS)}")
    ap.add_argument(
        "--target", type=Path, default=Path("models/demo-target"), help="target checkpoint (default: %(default)s)"
    )
    ap.add_argument(
        "--lyanna", type=Path, default=Path("models/demo-lyanna"), help="main drafter (default: %(default)s)"
    )
    ap.add_argument(
        "--ablation",
        action="append",
        metavar="NAME=DIR",
        help="ablated drafter for table1, repeatable (default: "
        + " ".join(table1.DEFAULT_ABLATIONS)
        + "); a missing DIR is skipped",
    )
    ap.add_argument(
        "--redrafter-engine", type=Path, default=Path("engines/demo-redrafter"),
        help="ReDrafter engine for fig12; built from --redrafter into --engine-dir if missing (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--redrafter", type=Path, default=Path("models/demo-redrafter"), help="ReDrafter drafter (default: %(default)s)"
    )
    ap.add_argument(
        "--engine-dir", type=Path, default=Path("work_dirs/lyanna-engines"),
        help="where the Lyanna engines are built (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=4, help="held-out prompts (default: %(default)s)")
    ap.add_argument(
        "--table1-prompts", type=int, default=16,
        help="held-out prompts for table1 (no timing there, so more of them are cheap) (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="fig12 alternating timing rounds (default: %(default)s)")
    ap.add_argument("--budgets", default="12,16", help="fig12 verification budgets B (default: %(default)s)")
    ap.add_argument("--temperatures", default="0,1.0", help="fig12 temperatures (default: %(default)s)")
    ap.add_argument("--windows", type=int, default=16, help="table2 held-out windows (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="table2 positions per window (default: %(default)s)")
    ap.add_argument(
        "--dense-drafter", type=Path, default=Path("work_dirs/lyanna-dense-ft"),
        help="table2: a drafter trained with --no-sparse-token-info, compared with --lyanna (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--ks", default="3,5,8", help="fig13a chain lengths k (default: %(default)s)")
    ap.add_argument("--batches", default="1,8", help="fig13a batch sizes (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=300, help="fig13a timed calls per cell (default: %(default)s)")
    ap.add_argument(
        "--out-dir", type=Path, default=Path("benchmarks/results"), help="output dir (default: %(default)s)"
    )
    ap.add_argument(
        "--threads", type=int, default=0,
        help="torch intra-op threads; 0 = torch's default. On a machine shared with other jobs 1 avoids threads "
        "spin-waiting for a descheduled sibling at every op (default: %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    with torch_threads(args.threads):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Build the main engine, then run the chosen reports on it (each writes its own files)."""
    reports = only(args.only)
    start = time.perf_counter()
    meta: dict[str, Any] = {
        "target": str(args.target),
        "lyanna": str(args.lyanna),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "batch_size": 1,
        "speculation": "fixed",
        "machine": machine(),
    }
    engine = LoadedEngine.load(build(args.target, args.engine_dir / "full", lyanna=args.lyanna))
    prompts = [engine.encode(p.text) for p in bundled(args.num_prompts)]
    llm = LLMEngine(engine, ONE_AT_A_TIME)
    if "table1" in reports:
        table1.report(args, meta, engine, llm)
    if "fig12" in reports:
        fig12.report(args, meta, llm, prompts)
    if "table2" in reports:
        table2.report(args, meta, engine)
    if "fig13a" in reports:
        fig13a.report(args, meta, engine)
    tqdm.write(f"lyanna sweep took {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
