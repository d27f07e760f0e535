"""ReDrafter-paper Table 2 on this machine: ms/token and speedup over auto-regressive
decoding at light, medium and saturating request rates, through a real Triton server.

    python -m benchmarks.table2 --engine engines/demo-redrafter [--door grpc|http|openai]   (make bench-table2)

1. Serve the engine with Triton (`triton_repo.server`), default runtime settings; requests go
   through `--door`: Triton's gRPC streaming (default), its HTTP `generate_stream`, or the
   OpenAI-compatible API (`python -m triton_repo.openai` attached to that Triton).
2. Measure capacity: auto-regressive requests sent all at once, `--capacity-concurrency`
   in flight, gives this machine's saturated request rate C.
3. For each rate in `--fractions` x C (the paper's QPS 0.1 / 0.5 / 1.0 relative to what the
   machine sustains), `--rounds` rounds: in each, every method runs the same Poisson load
   (the round's seed, the same prompts; the methods' order reverses every other round) and
   its ms/token = mean over requests of E2E latency / output tokens. A method's speedup is
   the median over rounds of AR's ms/token over its own in that round (`round_speedups`):
   16 requests a cell, a single pair moved by ~0.2 between runs minutes apart on a 2-core
   VM, the drift of the machine between the two runs included. ms/token, TTFT/TPOT
   percentiles and tokens per step are over every round's requests.
Writes `<out>.json`, `<out>.md` and `<out>.png` (ms/token vs QPS per method).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.arrivals import ArrivalProcess
from benchmarks.loadtest import RequestRecord, RequestSettings, run_load, summarize
from benchmarks.prompts import load_prompts
from benchmarks.report import machine, save_figure, subplots, write_report
from runtime.config import RuntimeConfig
from runtime.proposers.registry import METHODS
from triton_repo.openai.launch import OpenAIFrontend
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer


def measure(
    url: str, prompts: list[Any], rate: float, method: str, args: argparse.Namespace, seed: int = 0, **kw: Any
) -> tuple[list[RequestRecord], float]:
    """The records and duration of `prompts` sent at `rate` (Poisson, `seed`) with `method`."""
    settings = RequestSettings(max_tokens=args.max_tokens, method=method)
    return run_load(url, prompts, ArrivalProcess(rate, "poisson", seed=seed), settings, **kw)


def round_speedups(rounds: list[dict[str, float | None]], method: str) -> list[float]:
    """Per round, AR's ms/token over `method`'s (each round: method -> its ms/token; a round
    where either completed no request, None, is left out)."""
    return [ar / spec for r in rounds if (ar := r["ar"]) and (spec := r[method])]


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    methods = meta["methods"]
    spec = [m for m in methods if m != "ar"]
    lines = [
        "# Table 2 on this machine: ms/token under load, speculative vs auto-regressive",
        "",
        f"Engine `{meta['engine']}` served by Triton (runtime speculation: {meta['speculation']}; requests "
        f"through {meta.get('door', 'grpc')}), "
        f"{meta['num_requests']} Poisson requests per cell and round, {meta['rounds']} rounds (the "
        f"methods' order reversed every other round), {meta['max_tokens']} output tokens each, greedy, "
        f"bundled prompts; {meta['machine']['cpu']} ({meta['machine']['torch_threads']} threads). Capacity C = "
        f"{meta['capacity_req_s']:.2f} req/s (auto-regressive, all sent at once, "
        f"{meta['capacity_concurrency']} in flight). ms/token = mean over requests of E2E latency / output tokens, "
        f"over every round; speedup = median over rounds of AR's ms/token over the method's in that round "
        f"(least-most in brackets).",
        "",
        "| QPS (x C) | "
        + " | ".join(f"{m} ms/token" for m in methods)
        + " | "
        + " | ".join(f"{m} speedup (least-most) | {m} tokens/step" for m in spec)
        + " |",
        "|---|" + "---|" * (len(methods) + 2 * len(spec)),
    ]
    for row in rows:
        cells = [f"{row['qps']:.2f} ({row['fraction']:g})"]
        cells += ["-" if row[m]["ms_per_token"] is None else f"{row[m]['ms_per_token']:.1f}" for m in methods]
        for m in spec:
            ratios = row["speedups"][m]
            speedup = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
            tokens = row[m]["mean_tokens_per_step"]
            cells += [speedup, "-" if tokens is None else f"{tokens:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    failed = sum(row[m]["failed"] for row in rows for m in methods)
    lines += ["", f"Failed requests: {failed}."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], methods: list[str], path: Path) -> None:
    fig, ax = subplots(1, (6, 4))
    for m in methods:
        ax.plot([r["qps"] for r in rows], [r[m]["ms_per_token"] for r in rows], marker="o", label=m)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms / token")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.table2", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="engine with a drafter")
    ap.add_argument("--methods", default="ar,redrafter", help="comma-separated, ar first (default: %(default)s)")
    ap.add_argument("--fractions", default="0.1,0.5,1.0", help="rates as fractions of capacity (default: %(default)s)")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per cell and round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell, methods alternating (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--capacity-concurrency", type=int, default=8, help="in flight while measuring capacity")
    ap.add_argument("--speculation", choices=("load-aware", "fixed"), default="load-aware", help="server runtime mode")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    ap.add_argument("--door", choices=("grpc", "http", "openai"), default="grpc", help="(default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/table2"), help="output path stem")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    if methods[0] != "ar" or any(m not in METHODS for m in methods):
        raise SystemExit(f"error: --methods must start with ar and use {METHODS}")
    if args.rounds < 1 or args.num_requests < 1:
        raise SystemExit("error: --rounds and --num-requests must be at least 1")
    fractions = [float(f) for f in args.fractions.split(",")]
    prompts = load_prompts("bundled", args.num_requests, args.seed)
    serving = ServingConfig(args.engine, runtime=RuntimeConfig(speculation=args.speculation))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specpipe-table2-")))
        server = stack.enter_context(TritonServer(serving, tmp))
        url = {"grpc": server.grpc_url, "http": server.http_url}.get(args.door, "")
        if args.door == "openai":
            url = stack.enter_context(OpenAIFrontend(["--triton-url", server.grpc_url], tmp / "openai.log")).url
        door = {"protocol": args.door}
        measure(url, prompts[:2], float("inf"), "ar", args, progress=False, **door)  # warm-up
        records, duration = measure(
            url, prompts, float("inf"), "ar", args, max_concurrency=args.capacity_concurrency, progress=False, **door
        )
        capacity = summarize(records, duration, {})["request_throughput"]
        rows = []
        for fraction in fractions:
            runs: dict[str, tuple[list[RequestRecord], float]] = {m: ([], 0.0) for m in methods}
            rounds = []
            for r in range(args.rounds):
                ms_per_token = {}
                for m in methods if r % 2 == 0 else methods[::-1]:
                    got, seconds = measure(url, prompts, fraction * capacity, m, args, seed=args.seed + r, **door)
                    runs[m] = (runs[m][0] + got, runs[m][1] + seconds)
                    ms_per_token[m] = summarize(got, seconds, {})["ms_per_token"]
                rounds.append(ms_per_token)
            row: dict[str, Any] = {"fraction": fraction, "qps": fraction * capacity, "rounds": rounds}
            row |= {m: summarize(*runs[m], {}) for m in methods}
            row["speedups"] = {m: round_speedups(rounds, m) for m in methods if m != "ar"}
            rows.append(row)
    meta = {
        "engine": str(args.engine),
        "methods": methods,
        "speculation": args.speculation,
        "num_requests": args.num_requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "capacity_req_s": capacity,
        "capacity_concurrency": args.capacity_concurrency,
        "seed": args.seed,
        "door": args.door,
        "machine": machine(),
    }
    write_report(args.out, meta, rows, markdown(rows, meta))
    plot(rows, methods, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
