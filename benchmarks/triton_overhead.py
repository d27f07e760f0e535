"""What serving through Triton costs at batch 1: tokens/s of the same requests decoded
in-process (`LLMEngine.generate`) and through a running Triton server (gRPC streaming,
one request at a time), in alternating rounds, so that load on a shared machine hits both
alike.

    python -m benchmarks.triton_overhead --engine engines/demo-redrafter   # `make bench-triton-overhead`

Each round decodes the same held-out prompts (fixed length, EOS ignored, greedy) one after
another, for every method: in-process, then through Triton. Reported per method: tokens/s
both ways (over all rounds), the median over rounds of the Triton / in-process ratio, and
through Triton the mean time from a request's send to its first response and between its
streamed responses (one per engine step). Writes `<out>.json` and `<out>.md`.
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

MODEL = "specpipe"


@dataclass
class Row:
    method: str
    in_process_tokens_per_s: float
    triton_tokens_per_s: float
    ratio: float
    """Median over rounds of Triton's tokens/s over in-process tokens/s in that round."""
    ratios: list[float]
    mean_first_response_ms: float
    mean_response_gap_ms: float
    """Mean time between two streamed responses of one request (one engine step)."""
    tokens: tuple[int, int]
    """Output tokens of one round, in-process and through Triton (the same when EOS is ignored)."""


@dataclass
class Timed:
    tokens: int
    seconds: float
    first_ms: list[float]
    gaps_ms: list[float]


def in_process(llm: LLMEngine, prompts: list[list[int]], max_tokens: int, method: str) -> Timed:
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(llm.generate([prompt], sampling_params(1, max_tokens, 0.0), method)[0].output_ids)
    return Timed(tokens, time.perf_counter() - start, [], [])


class TritonClient:
    """One gRPC stream to the server; requests go one at a time."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error, time.perf_counter()))
        )

    def run(self, texts: list[str], max_tokens: int, method: str) -> Timed:
        from triton_repo.client import make_inputs

        timed = Timed(0, 0.0, [], [])
        start = time.perf_counter()
        for text in texts:
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
                    timed.tokens += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    break
            timed.first_ms.append(1e3 * (arrivals[0] - sent))
            timed.gaps_ms += [1e3 * (b - a) for a, b in itertools.pairwise(arrivals)]
        timed.seconds = time.perf_counter() - start
        return timed

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


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
        f"over gRPC streaming on the same machine; {meta['machine']['cpu']} "
        f"({meta['machine']['torch_threads']} threads). Ratio: median over rounds of Triton / in-process "
        f"tokens/s within a round. Command: `{meta['command']}`",
        "",
        "| method | in-process tok/s | Triton tok/s | Triton / in-process | first response ms | ms between responses |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.in_process_tokens_per_s:.1f} | {r.triton_tokens_per_s:.1f} | {r.ratio:.2f} "
            f"| {r.mean_first_response_ms:.1f} | {r.mean_response_gap_ms:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="(default: %(default)s)")
    ap.add_argument("--methods", nargs="+", default=["ar", "redrafter"], help="(default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=6, help="prompts per round (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--url", help="a running server's gRPC endpoint (default: start one on the engine)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/triton_overhead"), help="output path stem")
    args = ap.parse_args(argv)

    from triton_repo.repository import ServingConfig
    from triton_repo.server import TritonServer

    loaded = LoadedEngine.load(args.engine)
    llm = LLMEngine(loaded, RuntimeConfig())
    texts = heldout_prompts(args.num_prompts)
    prompts = [loaded.encode(t) for t in texts]
    local: dict[str, list[Timed]] = {m: [] for m in args.methods}
    served: dict[str, list[Timed]] = {m: [] for m in args.methods}
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            url = stack.enter_context(TritonServer(ServingConfig(args.engine), run_dir)).grpc_url
        client = TritonClient(url)
        stack.callback(client.close)
        for method in args.methods:  # warm-up both ways
            warm_up(llm, prompts[0], method, 0.0)
            client.run(texts[:1], 8, method)
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for method in args.methods:
                local[method].append(in_process(llm, prompts, args.max_tokens, method))
                served[method].append(client.run(texts, args.max_tokens, method))
    rows = []
    for method in args.methods:
        ratios = rate_ratios(served[method], local[method])
        rows.append(
            Row(
                method=method,
                in_process_tokens_per_s=tokens_per_s(local[method]),
                triton_tokens_per_s=tokens_per_s(served[method]),
                ratio=statistics.median(ratios),
                ratios=[round(r, 3) for r in ratios],
                mean_first_response_ms=statistics.mean(x for t in served[method] for x in t.first_ms),
                mean_response_gap_ms=statistics.mean(x for t in served[method] for x in t.gaps_ms),
                tokens=(local[method][0].tokens, served[method][0].tokens),
            )
        )
    meta = {
        "engine": str(args.engine),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "command": command("benchmarks.triton_overhead", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
