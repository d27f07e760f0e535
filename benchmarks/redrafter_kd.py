"""ReDrafter Table 6 analogue: what the drafter is trained on (`--kd`), at matched budgets.

    python -m benchmarks.redrafter_kd            # after the four drafters exist (make bench-redrafter-kd)

The ReDrafter paper's Table 6 trains the drafter on ground-truth text and by knowledge
distillation from the target and reports tau and speedup. Here one drafter per
`training.train_redrafter --kd` choice (greedy, sampled, soft, ground-truth), all with the
same data size and epochs (the Makefile's REDRAFTER_KD), goes into a batch-1 engine with
the demo target, and the same held-out prompts run with ReDrafter (W=4, L=4, fixed) and
auto-regressively, alternating prompt by prompt on the same engine, at T=0 and T=1
(`benchmarks.redrafter_sweep.run_setting`), and rsd-s (the same W x L, beams *sampled*
without replacement and verified against the drafter's law) at T=1. Reported per drafter: its held-out top-1
agreement (greedy continuations) and expected T=1 acceptance (sampled ones) from its
training log, tau, acceptance@k and speedup vs AR measured in the same run.
Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.redrafter_sweep import SweepRow, run_setting
from benchmarks.report import command, machine, named_dirs, write_report
from benchmarks.timing import ONE_AT_A_TIME
from build.engine import build_engine
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.redrafter import ReDrafterParams
from training.corpus import heldout_prompts

KDS = ("greedy", "sampled", "soft", "ground-truth")
DEFAULT_DRAFTERS = tuple(f"{kd}=work_dirs/redrafter-kd-{kd}" for kd in KDS)
BUILD = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)


@dataclass
class KDRow:
    kd: str
    drafter_dir: str
    train_examples: int
    epochs: int
    heldout_top1_agreement: list[float]
    """Per draft position, greedy held-out continuations (training log)."""
    heldout_t1_acceptance: list[float]
    """Per draft position, E[sum_x min(p, q)] at T=1 on sampled held-out continuations (training log)."""
    runs: list[SweepRow]
    """redrafter at T=0 and T=1."""
    rsd_s: SweepRow
    """rsd-s (sampled beams, which verify against the drafter's law) on the same drafter at T=1."""


def drafters(values: list[str] | None) -> dict[str, Path]:
    """`--drafter NAME=DIR` values (DEFAULT_DRAFTERS when None) -> {NAME: DIR}, each trained."""
    out = named_dirs(values, DEFAULT_DRAFTERS, "--drafter")
    for path in out.values():
        if not (path / "training_log.json").exists():
            raise SystemExit(f"error: {path} holds no trained drafter; make {path}/model.safetensors")
    return out


def markdown(rows: list[KDRow], meta: dict[str, object]) -> str:
    m = meta["machine"]
    lines = [
        "# ReDrafter Table 6 analogue: training labels (`--kd`)",
        "",
        f"Target `{meta['target']}`; "
        + (
            f"every drafter trained with the same budget ({rows[0].train_examples:,} examples x {rows[0].epochs} "
            f"epochs, `{meta['train_flags']}`). "
            if len({(r.train_examples, r.epochs) for r in rows}) == 1
            else "budgets differ: "
            + ", ".join(f"{r.kd} {r.train_examples:,} examples x {r.epochs} epochs" for r in rows)
            + ". "
        )
        + f"{meta['prompts']} held-out prompts x "
        f"{meta['max_tokens']} tokens, batch 1, W={meta['beam_width']}, L={meta['beam_length']} fixed, "
        f"{m['cpu']} ({m['torch_threads']} threads). Held-out top-1 agreement (T=0's acceptance per position) and "  # type: ignore[index]
        "expected T=1 acceptance per position come from the training logs; tau and speedup (AR ms/token / "
        "method ms/token, alternating prompt by prompt on one engine) are measured here, for redrafter (deterministic "
        "beams, verified as point masses) and for rsd-s (sampled beams, verified against the drafter's law).",
        "",
        "| --kd | held-out top-1 (pos 1..5) | held-out T=1 acceptance (pos 1..5) | T=0 tau | T=0 speedup "
        "| T=1 tau | T=1 speedup | rsd-s T=1 tau | rsd-s T=1 speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t0, t1 = r.runs
        agree = " / ".join(f"{a:.3f}" for a in r.heldout_top1_agreement)
        accept = " / ".join(f"{a:.3f}" for a in r.heldout_t1_acceptance)
        lines.append(
            f"| {r.kd} | {agree} | {accept or '-'} | {t0.tau:.2f} | {t0.speedup:.2f}x | {t1.tau:.2f} "
            f"| {t1.speedup:.2f}x | {r.rsd_s.tau:.2f} | {r.rsd_s.speedup:.2f}x |"
        )
    lines += ["", f"Command: `{meta.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--drafter", action="append", metavar="NAME=DIR",
        help=f"a trained drafter, repeatable (default: {' '.join(DEFAULT_DRAFTERS)})",
    )  # fmt: skip
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"), help="target (default: %(default)s)")
    ap.add_argument(
        "--engine-dir", type=Path, default=Path("work_dirs/redrafter-kd-engines"),
        help="where the engines are built (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/redrafter_kd"), help="output path stem")
    args = ap.parse_args()

    spec = ReDrafterParams()
    rows: list[KDRow] = []
    flags = set()
    for name, path in tqdm(drafters(args.drafter).items(), desc="drafters", unit="drafter"):
        log = json.loads((path / "training_log.json").read_text())
        cfg, metrics = log["config"], log["metrics"]
        flags.add(f"--train-sequences {cfg['train_sequences']} --epochs {cfg['epochs']}")
        loaded = LoadedEngine.load(build_engine(args.target, args.engine_dir / name, BUILD, force=True, drafter=path))
        engine = LLMEngine(loaded, ONE_AT_A_TIME)
        prompts = [loaded.encode(t) for t in heldout_prompts(args.prompts)]
        run_setting(engine, prompts[:2], ReDrafterParams(2, 2), 0.0, 8)  # warm-up
        runs = [run_setting(engine, prompts, spec, t, args.max_tokens) for t in (0.0, 1.0)]
        rsd_s = run_setting(engine, prompts, spec, 1.0, args.max_tokens, method="rsd-s")
        rows.append(
            KDRow(
                cfg.get("kd", "greedy"),
                str(path),
                metrics["train_examples"],
                cfg["epochs"],
                metrics["heldout_top1_agreement"],
                metrics.get("heldout_t1_acceptance", []),
                runs,
                rsd_s,
            )
        )
        tqdm.write(json.dumps({"kd": name, "tau": [r.tau for r in runs], "speedup": [r.speedup for r in runs]}))
    if len(flags) > 1:
        tqdm.write(f"warning: the drafters were trained with different budgets: {sorted(flags)}")
    meta = {
        "command": command("benchmarks.redrafter_kd", None),
        "target": str(args.target),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "beam_width": spec.beam_width,
        "beam_length": spec.beam_length,
        "train_flags": "; ".join(sorted(flags)),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
