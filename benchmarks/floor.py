"""Where the floor of a batch-1 decoding step is on this machine: how many bytes of weights
the target's forward and each drafter level read, how long they take, and what that
leaves a speculative step.

    python -m benchmarks.floor                           # the demo engines with a drafter
    python -m benchmarks.floor --engine engines/demo-redrafter --context 200

At batch 1 a step reads every weight once and does little arithmetic per byte, so the
time of the target's forward and of each drafter level follows from the bytes its
products read and the bandwidth the cache hierarchy gives them. Measured with the
engine's own kernels (the C++ forward of the target, `specpipe_cpu::redrafter_beam_search`,
the draft LM's chain op), one request at `--context` positions:
- target: its products' weights (the few-row fp32 copies a decoding forward reads) and
  the milliseconds of a forward of 1, 2, 6 and 16 tokens (a draft chain's verification
  with its root); `cold` runs each after reading `FLUSH_MB` of other memory, as in a step
  whose drafter and host work came in between, `hot` back to back;
- drafter (ReDrafter's RNN, a draft LM): the int8 bytes one level reads and the
  milliseconds per level (the slope over 1 .. `LEVELS` levels of a one-beam greedy
  chain, the same cold and hot) and per call (the line's intercept: the op's arguments,
  its set-up, the Python around it);
- the floor of a speculative step drafting a chain of L tokens: forward(L + 1 tokens) +
  a drafter call of L levels, as a multiple of forward(1 token) (AR's step less its host
  work), and the tokens per step (tau) it needs to run 2x auto-regression at that floor.
Host work (scheduling, metadata, verification, the policy) comes on top of every step,
AR's included: `make profile` times it. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import command, machine, write_report
from model_defs.llama import LlamaForCausalLM
from plugins.llama_forward import FusedTarget, Int8DraftLM
from plugins.redrafter_beam_search import int8_beam_search
from runtime.attention_batch import Segment
from runtime.loaded_engine import LoadedEngine
from runtime.step_batch import step_input

TOKENS = (1, 2, 6, 16)
"""Forward sizes timed: one token (AR), and a chain's verification with its root."""
LEVELS = 5
"""Drafter levels timed (1 .. LEVELS): the per-level cost is the slope."""
FLUSH_MB = 64
"""Memory read between cold timings: more than the L2 caches hold, as a step's other work
(the drafter, the target's other forward, the host) reads between two forwards."""
DEFAULT_ENGINES = ("engines/demo-redrafter", "engines/demo-draft-lm")


def timing(fn: Callable[[], object], repeats: int, cold: bool, flush: torch.Tensor) -> float:
    """Median seconds of `fn()` over `repeats` calls (after two untimed), each after reading
    `flush` when `cold`."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if cold:
            flush.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_call(model: LlamaForCausalLM, fused: FusedTarget, n: int, context: int) -> Callable[[], object]:
    """A target forward of `n` new tokens after `context` cached ones (one request, causal)."""
    cache = model.new_kv_cache((context + n) // 16 + 2, 16)
    slots = torch.arange(context + n)
    step = step_input(
        torch.zeros(n, dtype=torch.long), torch.arange(context, context + n),
        [Segment(0, context, slots)], torch.arange(n), "cpu", 16,
    )  # fmt: skip

    def run() -> object:
        out = fused(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
        if out is None:
            raise SystemExit("error: the target's C++ forward does not apply here (no C++ compiler, or a GPU engine)")
        return out

    return run


def measure(path: Path, context: int, repeats: int, flush: torch.Tensor) -> dict[str, Any]:
    """One engine's row: target bytes and forward times, drafter bytes and level times."""
    with torch.inference_mode():  # as the engine runs them (the ops stand aside under autograd)
        return _measure(LoadedEngine.load(path), path, context, repeats, flush)


def _measure(engine: LoadedEngine, path: Path, context: int, repeats: int, flush: torch.Tensor) -> dict[str, Any]:
    fused = FusedTarget.of(engine.model)
    if fused is None:
        raise SystemExit(f"error: {path}: the target's C++ forward does not apply (see plugins/llama_forward.py)")
    row: dict[str, Any] = {"engine": str(path), "target_mb": sum(w.nbytes for w in fused.small) / 1e6}
    calls = {n: forward_call(engine.model, fused, n, context) for n in TOKENS}  # one cache and step each
    for mode in ("cold", "hot"):
        row[f"forward_ms_{mode}"] = {n: 1e3 * timing(call, repeats, mode == "cold", flush) for n, call in calls.items()}
    drafter = engine.config.drafter.kind if engine.config.drafter else None
    row["drafter"] = drafter
    level: Callable[[int], Callable[[], object]] | None = None
    if drafter == "redrafter" and engine.redrafter is not None:
        rd, embed = engine.redrafter, engine.model.model.embed_tokens
        hidden, root = torch.randn(1, embed.weight.shape[1]), torch.tensor([17])
        if int8_beam_search(rd, embed, hidden, root, 1, 1) is None:
            raise SystemExit(f"error: {path}: the int8 beam search does not apply (build the drafter int8)")
        copies = [getattr(m, "int8", None) for m in rd.modules()]
        row["drafter_mb"] = sum(c.kernel.blocked.nbytes for c in copies if c is not None and c.kernel is not None)
        level = lambda n: lambda: int8_beam_search(rd, embed, hidden, root, 1, n)  # noqa: E731
    elif drafter == "draft-lm" and engine.draft_model is not None:
        lm = Int8DraftLM.of(engine.draft_model)
        if lm is None:
            raise SystemExit(f"error: {path}: the draft LM's C++ forward does not apply (build it int8)")
        cache = engine.draft_model.new_kv_cache((context + LEVELS) // 16 + 2, 16)
        slots = [torch.arange(context + LEVELS + 1)]
        row["drafter_mb"] = sum(w.blocked.nbytes for w in lm.linears)
        level = lambda n: lambda: lm.chain([17], [context], slots, [n], cache)  # noqa: E731
    if level is not None:
        row["drafter_mb"] /= 1e6
        levels = list(range(1, LEVELS + 1))
        for mode in ("cold", "hot"):
            times = [1e3 * timing(level(n), repeats, mode == "cold", flush) for n in levels]
            row[f"levels_ms_{mode}"] = dict(zip(levels, times, strict=True))  # a call of n levels: its time
            row[f"level_ms_{mode}"], row[f"call_ms_{mode}"] = statistics.linear_regression(levels, times)
    return row


def floors(row: dict[str, Any]) -> list[dict[str, float]]:
    """The cold floor of a step drafting a chain of L = 1, 5 and 15 tokens: forward(L + 1)
    (interpolated in the timed sizes) + one drafter call of L levels (the fitted line, past
    `LEVELS` extrapolated), over forward(1); and 2x that, the tau it needs to run 2x AR at
    its floor."""
    fwd = row["forward_ms_cold"]
    sizes = sorted(fwd)
    out = []
    for drafts in (1, 5, 15):
        n = drafts + 1
        lo = max(s for s in sizes if s <= n)
        hi = min((s for s in sizes if s >= n), default=lo)
        f = fwd[lo] if hi == lo else fwd[lo] + (fwd[hi] - fwd[lo]) * (n - lo) / (hi - lo)
        drafting = drafts * row["level_ms_cold"] + row["call_ms_cold"] if "level_ms_cold" in row else 0.0
        step = f + drafting
        out.append({"drafts": drafts, "step_ms": step, "over_forward1": step / fwd[1], "tau_for_2x": 2 * step / fwd[1]})
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The batch-1 floor",
        "",
        f"One request at {meta['context']} positions, {meta['repeats']} timings a point (medians); cold: after "
        f"reading {FLUSH_MB} MB of other memory, as in a step; {meta['machine']['cpu']} "
        f"({meta['machine']['torch_threads']} threads). Command: `{meta['command']}`",
        "",
        "| engine | target MB | forward ms cold (1 / 2 / 6 / 16 tokens) | GB/s at 1 token | hot | drafter | "
        "drafter MB a level | ms a level cold / hot | GB/s a level | ms a call cold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cold, hot = r["forward_ms_cold"], r["forward_ms_hot"]
        level = r.get("level_ms_cold")
        lines.append(
            f"| `{r['engine']}` | {r['target_mb']:.1f} | {' / '.join(f'{cold[n]:.2f}' for n in TOKENS)} | "
            f"{r['target_mb'] / cold[1]:.0f} | {' / '.join(f'{hot[n]:.2f}' for n in TOKENS)} | {r['drafter'] or '-'} | "
            + (
                f"{r['drafter_mb']:.2f} | {level:.3f} / {r['level_ms_hot']:.3f} | {r['drafter_mb'] / level:.0f} | "
                f"{r['call_ms_cold']:.3f} |"
                if level
                else "- | - | - | - |"
            )
        )
    lines += [
        "",
        "Floor of a step drafting a chain of L tokens (cold forward of L + 1 tokens + a drafter call of L levels), "
        "over a 1-token forward, and the tau it needs for 2x AR at that floor (host work comes on top of both):",
        "",
        "| engine | L | step ms | / forward(1) | tau for 2x |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for f in r["floors"]:
            lines.append(
                f"| `{r['engine']}` | {f['drafts']} | {f['step_ms']:.2f} | {f['over_forward1']:.2f} | "
                f"{f['tau_for_2x']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", type=Path, help=f"engine dir, repeatable (default: {DEFAULT_ENGINES})")
    ap.add_argument("--context", type=int, default=200, help="cached positions before the new tokens (default: 200)")
    ap.add_argument("--repeats", type=int, default=30, help="timings per point (default: 30)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/floor"), help="output path stem")
    args = ap.parse_args(argv)
    if args.context < 1 or args.repeats < 1:
        raise SystemExit("error: --context and --repeats must be >= 1")
    engines = args.engine or [Path(p) for p in DEFAULT_ENGINES]
    for path in engines:
        if not (path / "config.json").exists():
            raise SystemExit(f"error: no engine at {path} (make engine builds the demo engines)")
    flush = torch.ones(FLUSH_MB * 1_000_000 // 4)
    rows = []
    for path in engines:
        row = measure(path, args.context, args.repeats, flush)
        row["floors"] = floors(row)
        rows.append(row)
    meta = {"context": args.context, "repeats": args.repeats, "command": command("benchmarks.floor", argv),
            "machine": machine()}  # fmt: skip
    write_report(args.out, meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
