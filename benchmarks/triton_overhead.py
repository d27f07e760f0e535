"""What serving through Triton costs at batch 1: tokens/s of the same requests decoded
in-process (`LLMEngine.generate`) and through a running Triton server (gRPC streaming,
one request at a time), in alternating rounds, so that load on a shared machine hits both
alike.

    python -m benchmarks.triton_overhead --engine engines/demo-redrafter   # `make bench-triton-overhead`

Each round decodes the same held-out prompts (fixed length, EOS ignored, greedy) one after
another, for every method: in-process, then through Triton with each client:

- `perf_analyzer`: NVIDIA's C++ client (`make perf-analyzer-install`), at concurrency 1
  (the next request goes when the last one's final response is in), its times from its
  profile export. It cannot count tokens; each request's are the in-process run's of the
  same prompt in that round (EOS ignored: `max_tokens`, or fewer only where the engine's
  length limit ends a request the same way both ways; the `python` client checks this);
- `python`: `tritonclient.grpc` with a streaming callback, as most Python users write it,
  counting the tokens each final response reports.

The clients run on the same machine as the server; on a small one a client's own CPU per
streamed response is taken from the engine, and the Python client spends more of it than
perf_analyzer. Reported per method and client: tokens/s both ways (over all rounds), the
median over rounds of the Triton / in-process ratio, and through Triton the mean time from
a request's send to its first response and between its streamed responses. Each
`--stream-interval-ms` gets a server of its own (all running, used in turn within a
round): 0 streams a response per engine step; the serving default holds a request's
text for that long between responses (`ServingConfig.stream_interval_ms`), so a response
carries several steps' tokens. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import queue
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from benchmarks.timing import sampling_params, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from training.corpus import heldout_prompts
from triton_repo.repository import STREAM_INTERVAL_MS, ServingConfig

MODEL = "specpipe"


CLIENTS = ("perf_analyzer", "python")


@dataclass
class Row:
    method: str
    client: str
    stream_interval_ms: float | None
    """The server's least time between two streamed responses of a request (0: one per step;
    None: a running server's, `--url`, not known here)."""
    in_process_tokens_per_s: float
    triton_tokens_per_s: float
    ratio: float
    """Median over rounds of Triton's tokens/s over in-process tokens/s in that round."""
    ratios: list[float]
    mean_first_response_ms: float
    mean_response_gap_ms: float | None
    """Mean time between two streamed responses of one request (None: none streamed twice)."""
    tokens: tuple[int, int]
    """Output tokens of one round, in-process and through Triton (the same when EOS is ignored;
    perf_analyzer's are the in-process ones, see the module docstring)."""


@dataclass
class Timed:
    tokens: int
    seconds: float
    first_ms: list[float]
    gaps_ms: list[float]


def in_process(llm: LLMEngine, prompts: list[list[int]], max_tokens: int, method: str) -> tuple[Timed, list[int]]:
    """The run, and each prompt's output tokens."""
    start, tokens = time.perf_counter(), []
    for prompt in prompts:
        tokens.append(len(llm.generate([prompt], sampling_params(1, max_tokens, 0.0), method)[0].output_ids))
    return Timed(sum(tokens), time.perf_counter() - start, [], []), tokens


class TritonClient:
    """One gRPC stream to the server; requests go one at a time."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error, time.perf_counter()))
        )

    def run(self, texts: list[str], max_tokens: int, method: str, tokens: list[int] | None = None) -> Timed:
        """`texts` once each, in order; with `tokens` (what each decodes in-process), a request
        whose final response reports another count is an error."""
        from triton_repo.client import make_inputs

        timed = Timed(0, 0.0, [], [])
        start = time.perf_counter()
        for i, text in enumerate(texts):
            inputs = make_inputs(text, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, method=method)
            sent = time.perf_counter()
            self.client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
            arrivals = []
            while True:
                result, error, at = self.responses.get(timeout=300)
                if error is not None:
                    raise SystemExit(f"error: the server answered {error}")
                arrivals.append(at)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    decoded = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    if tokens is not None and decoded != tokens[i]:
                        raise SystemExit(f"error: prompt {i}: {decoded} tokens through Triton, {tokens[i]} in-process")
                    timed.tokens += decoded
                    break
            timed.first_ms.append(1e3 * (arrivals[0] - sent))
            timed.gaps_ms += [1e3 * (b - a) for a, b in itertools.pairwise(arrivals)]
        timed.seconds = time.perf_counter() - start
        return timed

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class PerfAnalyzerClient:
    """NVIDIA perf_analyzer at concurrency 1 on the same server, one run per round."""

    def __init__(self, url: str, work: Path) -> None:
        from triton_repo.nvidia_perf import tool_problem

        if (problem := tool_problem("perf_analyzer")) is not None:
            raise SystemExit(f"error: {problem} (or leave it out: --clients python)")
        self.url, self.work = url, work

    def run(self, texts: list[str], max_tokens: int, method: str, tokens: list[int]) -> Timed:
        """`texts` once each, in order; `tokens[i]`: what request i decodes (see the module docstring)."""
        from triton_repo.nvidia_perf import (
            export_requests,
            perf_analyzer_command,
            perf_analyzer_input,
            run_perf_analyzer,
        )

        data = perf_analyzer_input(
            self.work / "input_data.json", texts, max_tokens, temperature=0.0, ignore_eos=True, method=method
        )
        export = self.work / "profile_export.json"
        command = perf_analyzer_command(self.url, data, export, concurrency=1, request_count=len(texts))
        proc = run_perf_analyzer(command, export, capture=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"error: perf_analyzer exited {proc.returncode}: {proc.stderr.strip() or proc.stdout[-2000:]}"
            )
        requests = export_requests(export)
        if len(requests) != len(texts) or any(not r.responses for r in requests):
            raise SystemExit(
                f"error: perf_analyzer recorded {len(requests)} requests (or one without a response), not {len(texts)}"
            )
        end = max(r.responses[-1] for r in requests)
        return Timed(
            tokens=sum(tokens),
            seconds=(end - requests[0].sent) / 1e9,
            first_ms=[r.first_ms for r in requests],
            gaps_ms=[gap for r in requests for gap in r.gaps_ms],
        )


def tokens_per_s(runs: list[Timed]) -> float:
    """Output tokens/s over all `runs`."""
    return sum(t.tokens for t in runs) / sum(t.seconds for t in runs)


def rate_ratios(runs: list[Timed], baseline: list[Timed]) -> list[float]:
    """Tokens/s of each run over that of the baseline run of the same round."""
    return [tokens_per_s([r]) / tokens_per_s([b]) for r, b in zip(runs, baseline, strict=True)]


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# Triton vs in-process at batch 1",
        "",
        f"Engine `{meta['engine']}`, {meta['num_prompts']} held-out prompts decoded one at a time, "
        f"{meta['max_tokens']} tokens each (greedy, EOS ignored), {meta['rounds']} alternating rounds; Triton "
        f"over gRPC streaming, each client on the same machine as the server; {meta['machine']['cpu']} "
        f"({meta['machine']['torch_threads']} threads). Ratio: median over rounds of Triton / in-process "
        f"tokens/s within a round. Clients: `perf_analyzer` is NVIDIA's (C++, concurrency 1), `python` is "
        f"`tritonclient.grpc` with a streaming callback. Command: `{meta['command']}`",
        "",
        "| method | client | stream interval ms | in-process tok/s | Triton tok/s | Triton / in-process "
        "| first response ms | ms between responses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "-" if r.mean_response_gap_ms is None else f"{r.mean_response_gap_ms:.1f}"
        interval = "?" if r.stream_interval_ms is None else f"{r.stream_interval_ms:g}"
        lines.append(
            f"| {r.method} | {r.client} | {interval} | {r.in_process_tokens_per_s:.1f} "
            f"| {r.triton_tokens_per_s:.1f} | {r.ratio:.2f} | {r.mean_first_response_ms:.1f} | {gap} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="(default: %(default)s)")
    ap.add_argument("--methods", nargs="+", default=["ar", "redrafter"], help="(default: %(default)s)")
    ap.add_argument(
        "--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), help="Triton clients (default: %(default)s)"
    )
    ap.add_argument("--num-prompts", type=int, default=6, help="prompts per round (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    ap.add_argument(
        "--stream-interval-ms",
        type=float,
        nargs="+",
        default=[0.0, STREAM_INTERVAL_MS],
        help="a server per interval, each the least ms between a request's streamed responses (default: %(default)s)",
    )
    ap.add_argument("--url", help="a running server's gRPC endpoint (default: start one on the engine)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/triton_overhead"), help="output path stem")
    args = ap.parse_args(argv)

    from triton_repo.server import TritonServer

    intervals = [None] if args.url else args.stream_interval_ms  # a running server's own is not known
    loaded = LoadedEngine.load(args.engine)
    llm = LLMEngine(loaded, RuntimeConfig())
    texts = heldout_prompts(args.num_prompts)
    prompts = [loaded.encode(t) for t in texts]
    local: dict[str, list[Timed]] = {m: [] for m in args.methods}
    keys = [(m, c, i) for m in args.methods for c in args.clients for i in intervals]
    served: dict[tuple[str, str, float | None], list[Timed]] = {key: [] for key in keys}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        clients: dict[tuple[str, float | None], TritonClient | PerfAnalyzerClient] = {}
        for interval in intervals:
            url = args.url
            if interval is not None:
                config = ServingConfig(args.engine, stream_interval_ms=interval)
                url = stack.enter_context(TritonServer(config, work / f"triton-{interval:g}")).grpc_url
            python = TritonClient(url)
            stack.callback(python.close)
            if "python" in args.clients:
                clients["python", interval] = python
            if "perf_analyzer" in args.clients:
                clients["perf_analyzer", interval] = PerfAnalyzerClient(url, work)
            for method in args.methods:  # warm-up
                python.run(texts[:1], 8, method)
        for method in args.methods:
            warm_up(llm, prompts[0], method, 0.0)
        for turn in tqdm(range(args.rounds), desc="rounds"):
            order = list(clients)[turn % len(clients) :] + list(clients)[: turn % len(clients)]
            for method in args.methods:
                timed, tokens = in_process(llm, prompts, args.max_tokens, method)
                local[method].append(timed)
                for name, interval in order:
                    run = clients[name, interval].run(texts, args.max_tokens, method, tokens)
                    served[method, name, interval].append(run)
    rows = []
    for (method, name, interval), runs in served.items():
        ratios = rate_ratios(runs, local[method])
        gaps = [x for t in runs for x in t.gaps_ms]
        rows.append(
            Row(
                method=method,
                client=name,
                stream_interval_ms=interval,
                in_process_tokens_per_s=tokens_per_s(local[method]),
                triton_tokens_per_s=tokens_per_s(runs),
                ratio=statistics.median(ratios),
                ratios=[round(r, 3) for r in ratios],
                mean_first_response_ms=statistics.mean(x for t in runs for x in t.first_ms),
                mean_response_gap_ms=statistics.mean(gaps) if gaps else None,
                tokens=(local[method][0].tokens, runs[0].tokens),
            )
        )
    meta = {
        "engine": str(args.engine),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "clients": args.clients,
        "stream_interval_ms": intervals,
        "command": command("benchmarks.triton_overhead", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
