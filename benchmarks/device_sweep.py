"""Auto-regressive decoding vs every speculative method an engine supports, at several
batch sizes and temperatures, on one device (a GPU by default when there is one).

    python -m benchmarks.device_sweep                                   # the three demo engines
    python -m benchmarks.device_sweep --engine engines/demo-redrafter --dtype bfloat16
    python -m benchmarks.device_sweep --enforce-eager                   # no CUDA graphs
    python -m benchmarks.device_sweep --engine engines/demo-draft-lm --methods sd,rsd-c

For each engine, the methods are those of `runtime.proposers.registry.METHODS` (or of
`--methods`, AR always with them) the engine accepts (a method whose request the engine
refuses, e.g. lyanna on a ReDrafter engine, is listed as skipped with the engine's reason).
One `LLMEngine` per engine serves every cell (its KV cache and, on a GPU, its CUDA graphs
are made once), after a warm-up request per method
and, before each batch size's cells, one short untimed auto-regressive batch of that size.
For each batch size B and temperature T, B held-out prompts (never trained on) are decoded
together, fixed output length, EOS ignored, prompt i seeded with i, by AR and by each
method in alternating rounds, so machine noise hits them alike. Reported per cell:
- output tokens/s (prefill included, as a user sees it; the device is synchronized
  before the clock is read) over all rounds;
- ratio to AR: the median over rounds of the method's rate / AR's rate in that round;
- tau: tokens emitted per decoding step per request (bonus included; 1 for AR);
- at T = 0, greedy == AR: prompts whose output ids equal AR's in every round (all of
  them, or the method is not lossless on this device: the markdown says so loudly).
Writes `<out>.json` (machine, arguments and the command line that reproduces it) and
`<out>.md` (one table per engine).
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.report import machine, torch_threads, write_report
from benchmarks.timing import WARMUP_TOKENS, Timings, alternate, round_params, sampling_params, timed, warm_up
from runtime.config import RuntimeConfig
from runtime.engine_dir import DTYPES
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.registry import METHODS
from runtime.results import tokens_per_step
from training.corpus import heldout_prompts

ENGINES = ("engines/demo-redrafter", "engines/demo-draft-lm", "engines/demo-lyanna")
SPECULATION_MODES = ("fixed", "load-aware")


@dataclass
class Cell:
    """One (engine, method, batch, temperature) measurement."""

    engine: str
    drafter: str
    method: str
    batch_size: int
    temperature: float
    tokens_per_s: float
    ar_tokens_per_s: float
    ratio_to_ar: float
    """Median over rounds of the within-round rate ratio to AR (1 for AR)."""
    ratio_per_round: list[float]
    tau: float
    greedy_equal_ar: int | None
    """Prompts whose outputs equal AR's in every round (T = 0 only; None at T > 0)."""
    prompts: int
    output_tokens: int
    """Output tokens of one round (batch size x max tokens unless a request failed)."""
    errors: list[str] = field(default_factory=list)
    """Requests that finished with "error" (there should be none)."""


def cast(engine: LoadedEngine, dtype: torch.dtype) -> None:
    """Cast the loaded target and drafter (whichever kind) to `dtype`, in place."""
    engine.model = engine.model.to(dtype)
    if engine.redrafter is not None:
        engine.redrafter = engine.redrafter.to(dtype)
    if engine.draft_model is not None:
        engine.draft_model = engine.draft_model.to(dtype)
    if engine.lyanna_drafter is not None:
        engine.lyanna_drafter = engine.lyanna_drafter.to(dtype)
    if engine.token_table is not None:
        engine.token_table = engine.token_table._replace(table=engine.token_table.table.to(dtype))


def supported_methods(
    llm: LLMEngine, prompt: list[int], wanted: Sequence[str] = METHODS
) -> tuple[list[str], dict[str, str]]:
    """Warm up AR and every method of `wanted` (default: METHODS) with one short greedy
    request; those the engine refuses (ValueError at submission, nothing queued) come back
    as skipped, with the reason."""
    methods, skipped = [], {}
    for method in [m for m in METHODS if m == "ar" or m in wanted]:
        try:
            warm_up(llm, prompt, method, temperature=0.0)
        except ValueError as e:
            skipped[method] = str(e)
            continue
        methods.append(method)
    if "ar" not in methods:
        raise SystemExit(f"error: the engine refuses auto-regressive decoding: {skipped.get('ar')}")
    return methods, skipped


def run_cell(
    llm: LLMEngine, methods: list[str], prompts: list[list[int]], temperature: float, max_tokens: int, rounds: int
) -> dict[str, Timings]:
    """Alternating rounds over `methods` (AR first) on one batch, each round seeded apart
    (`round_params`): per method, its runs, each compared to AR's run in the same round."""
    rounds_runs = []
    for r in range(rounds):
        params = round_params(len(prompts), max_tokens, temperature, r)
        rounds_runs.append({m: functools.partial(timed, llm, prompts, params, m) for m in methods})
    return alternate(rounds_runs, "ar")


def cells_of(engine: str, drafter: str, batch: int, temperature: float, measured: dict[str, Timings]) -> list[Cell]:
    ar_runs = [run.results for run in measured["ar"].runs]
    cells = []
    for method, m in measured.items():
        runs = [run.results for run in m.runs]
        greedy_equal = None
        if temperature == 0:
            greedy_equal = sum(
                all(run[i].output_ids == ar_run[i].output_ids for run, ar_run in zip(runs, ar_runs, strict=True))
                for i in range(batch)
            )
        cells.append(
            Cell(
                engine=engine,
                drafter=drafter,
                method=method,
                batch_size=batch,
                temperature=temperature,
                tokens_per_s=m.tokens_per_s,
                ar_tokens_per_s=measured["ar"].tokens_per_s,
                ratio_to_ar=m.speedup,
                ratio_per_round=m.ratios,
                tau=statistics.mean(tokens_per_step(run) for run in runs),
                greedy_equal_ar=greedy_equal,
                prompts=batch,
                output_tokens=sum(len(r.output_ids) for r in runs[-1]),
                errors=sorted({r.error or "" for run in runs for r in run if r.finish_reason == "error"}),
            )
        )
    return cells


def markdown(cells: list[Cell], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['torch_threads']} threads)"
    lines = [
        "# AR vs every method, by batch size and temperature",
        "",
        f"Device `{meta['device']}` ({where}), dtype {meta['dtype']}, speculation {meta['speculation']}, "
        f"CUDA graphs {'off' if meta['enforce_eager'] else 'on (GPU only)'}; {meta['max_tokens']} output tokens "
        f"per request (EOS ignored), held-out prompts, {meta['rounds']} alternating rounds. tok/s: output tokens / "
        "wall seconds, prefill included; ratio: median over rounds of the within-round ratio to AR; tau: tokens "
        "per decoding step per request; greedy==AR (T=0): prompts whose outputs equal AR's.",
        "",
        f"Reproduce: `{meta['command']}`",
    ]
    mismatches = [
        c for c in cells if c.greedy_equal_ar is not None and c.greedy_equal_ar != c.prompts and c.method != "ar"
    ]
    if mismatches:
        lines += ["", "**WARNING: greedy outputs differ from AR (not lossless on this device/dtype):**"]
        lines += [
            f"- **{c.engine} {c.method} batch {c.batch_size}: {c.greedy_equal_ar}/{c.prompts} prompts equal AR**"
            for c in mismatches
        ]
    failed = [c for c in cells if c.errors]
    if failed:
        lines += ["", "**WARNING: requests failed:**"]
        lines += [f"- **{c.engine} {c.method} batch {c.batch_size} T={c.temperature}: {c.errors}**" for c in failed]
    for engine, info in meta["engines"].items():
        ours = [c for c in cells if c.engine == engine]
        methods = [x for x in info["methods"] if x != "ar"]
        lines += ["", f"## `{engine}` ({info['drafter']} drafter)", ""]
        if info["skipped"]:
            lines += [f"Skipped: {', '.join(f'{k} ({v})' for k, v in info['skipped'].items())}", ""]
        head = ["T", "batch", "AR tok/s"]
        for x in methods:
            head += [f"{x} tok/s", f"{x} ratio", f"{x} tau", f"{x} greedy==AR"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        keys = sorted({(c.temperature, c.batch_size) for c in ours})
        for t, b in keys:
            by = {c.method: c for c in ours if (c.temperature, c.batch_size) == (t, b)}
            row = [f"{t:g}", str(b), f"{by['ar'].tokens_per_s:.0f}"]
            for x in methods:
                c = by[x]
                same = "-" if c.greedy_equal_ar is None else f"{c.greedy_equal_ar}/{c.prompts}"
                if c.greedy_equal_ar is not None and c.greedy_equal_ar != c.prompts:
                    same = f"**{same} !!**"
                row += [f"{c.tokens_per_s:.0f}", f"{c.ratio_to_ar:.2f}x", f"{c.tau:.2f}", same]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def command_line(args: argparse.Namespace) -> str:
    """The explicit command that repeats this run (every option spelled out, so defaults
    that depend on the machine, like the device, do not change it)."""
    argv = ["python", "-m", "benchmarks.device_sweep"]
    for engine in args.engine:
        argv += ["--engine", str(engine)]
    if args.methods is not None:
        argv += ["--methods", args.methods]
    argv += ["--device", args.device, "--dtype", args.dtype, "--batch-sizes", args.batch_sizes]
    argv += ["--temperatures", args.temperatures, "--max-tokens", str(args.max_tokens)]
    argv += ["--rounds", str(args.rounds), "--speculation", args.speculation]
    argv += ["--max-num-tokens", str(args.max_num_tokens), "--out", str(args.out)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.stdlib_root:
        argv += ["--stdlib-root", str(args.stdlib_root)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return shlex.join(argv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.device_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engine", type=Path, action="append", help=f"engine dir, repeatable (default: {', '.join(ENGINES)})"
    )
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device (default: %(default)s)"
    )
    ap.add_argument(
        "--dtype",
        choices=("engine", *sorted(DTYPES)),
        default="engine",
        help="engine = as built; else cast target and drafter after loading (default: %(default)s)",
    )
    ap.add_argument(
        "--methods",
        help="comma-separated methods to compare with AR (default: every method each engine runs; "
        f"of {', '.join(m for m in METHODS if m != 'ar')}): fewer methods, a shorter sweep",
    )
    ap.add_argument("--batch-sizes", default="1,8,32", help="batch sizes (default: %(default)s)")
    ap.add_argument("--temperatures", default="0,1", help="temperatures, 0 = greedy (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell (default: %(default)s)")
    ap.add_argument("--speculation", choices=SPECULATION_MODES, default="fixed", help="(default: %(default)s)")
    ap.add_argument(
        "--max-num-tokens",
        type=int,
        default=2048,
        help="step token budget; it must hold one draft tree per request at the largest batch (default: %(default)s)",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (eager target forwards)")
    ap.add_argument(
        "--stdlib-root",
        type=Path,
        help="where the held-out prompt files are: the stdlib of the Python that training/corpus's manifest names "
        "(default: this interpreter's); on a machine with another Python, copy the held-out files over",
    )
    ap.add_argument(
        "--threads", type=int, default=0,
        help="torch intra-op threads; 0 = torch's default. On a CPU shared with other jobs 1 avoids threads "
        "spin-waiting for a descheduled sibling at every op (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/device_sweep"), help="output path stem (.json, .md)"
    )
    args = ap.parse_args(argv)
    args.engine = args.engine or [Path(e) for e in ENGINES]
    if args.methods is not None:
        wanted = _names(args.methods)
        unknown = [m for m in wanted if m not in METHODS]
        if not wanted or unknown:
            what = f"unknown {', '.join(unknown)}" if unknown else "no method"
            ap.error(f"--methods {args.methods!r}: {what}; give methods of {', '.join(METHODS)}")
    with torch_threads(args.threads):
        run(args)


def run(args: argparse.Namespace) -> None:
    sizes, temperatures = _ints(args.batch_sizes), _floats(args.temperatures)
    if not sizes or min(sizes) < 1 or not temperatures or min(temperatures) < 0 or args.rounds < 1:
        raise SystemExit("error: need batch sizes >= 1, temperatures >= 0 and --rounds >= 1")
    texts = heldout_prompts(max(sizes), args.stdlib_root)
    cells: list[Cell] = []
    engines_meta: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(args.engine) * len(sizes) * len(temperatures), desc="device sweep", unit="cell") as bar:
        for path in args.engine:
            loaded = LoadedEngine.load(path, device=args.device)
            if args.dtype != "engine":
                cast(loaded, DTYPES[args.dtype])
            if max(sizes) > loaded.config.build.max_batch_size:
                raise SystemExit(
                    f"error: batch size {max(sizes)} > {path}'s max_batch_size "
                    f"{loaded.config.build.max_batch_size}; rebuild it with a larger --max-batch-size"
                )
            config = RuntimeConfig(
                max_batch_size=max(sizes),
                max_num_tokens=args.max_num_tokens,
                speculation=args.speculation,
                cuda_graphs=not args.enforce_eager,
            )
            llm = LLMEngine(loaded, config)
            prompts = [loaded.encode(t) for t in texts]
            wanted = METHODS if args.methods is None else _names(args.methods)
            methods, skipped = supported_methods(llm, prompts[0], wanted)  # also the warm-up
            drafter = loaded.config.drafter.kind if loaded.config.drafter else "none"
            engines_meta[str(path)] = {"drafter": drafter, "methods": methods, "skipped": skipped}
            if llm.runner.graphs is not None:  # which linears each bucket's graph kept, and both replay times
                graphs = llm.runner.graphs
                engines_meta[str(path)] |= {"graph_linears": graphs.linears, "graph_replay_ms": graphs.replay_ms}
            for batch in sizes:
                batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
                # a batch's first steps pay its set-up (allocator growth; on an H100 the first
                # batch-8 AR cell of a one-round sweep read 206 tok/s where the others read ~2000-3000)
                llm.generate(batch_prompts, sampling_params(batch, WARMUP_TOKENS, 0.0), "ar")
                for temperature in temperatures:
                    bar.set_postfix_str(f"{path.name} B={batch} T={temperature:g}")
                    measured = run_cell(llm, methods, batch_prompts, temperature, args.max_tokens, args.rounds)
                    new = cells_of(str(path), drafter, batch, temperature, measured)
                    cells += new
                    tqdm.write(
                        f"{path.name} B={batch} T={temperature:g}: "
                        + ", ".join(f"{c.method} {c.tokens_per_s:.0f} tok/s {c.ratio_to_ar:.2f}x" for c in new)
                    )
                    # after every cell: a run cut short keeps what it measured
                    report(args, cells, engines_meta, echo=False)
                    bar.update()
            del llm, loaded
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    report(args, cells, engines_meta)


def report(
    args: argparse.Namespace, cells: list[Cell], engines_meta: dict[str, dict[str, Any]], echo: bool = True
) -> None:
    """Write `<out>.json` and `<out>.md` with the cells measured so far (printed if `echo`)."""
    meta = {
        "command": command_line(args),
        "args": {
            **vars(args),
            "engine": [str(p) for p in args.engine],
            "out": str(args.out),
            "stdlib_root": args.stdlib_root and str(args.stdlib_root),
        },
        "device": args.device,
        "dtype": args.dtype,
        "speculation": args.speculation,
        "enforce_eager": args.enforce_eager,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "engines": engines_meta,
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(c) for c in cells], markdown(cells, meta), echo=echo)


if __name__ == "__main__":
    main()
