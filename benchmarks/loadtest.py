"""Fixed-QPS load test of a Triton server speaking the TensorRT-LLM ensemble's tensor names,
or of an OpenAI-compatible server (`--backend openai`: specpipe's `python -m triton_repo.openai`).

    python -m benchmarks.loadtest --url localhost:8001 --rate 2 --num-requests 100 \\
        [--arrivals poisson|constant|gamma --burstiness B --seed S] [--max-concurrency C] [--duration S] \\
        [--prompts bundled|question.jsonl|sharegpt.json] [--method redrafter] [--protocol grpc|http] \\
        [--goodput ttft:500 tpot:50] --out benchmarks/results/loadtest
    python -m benchmarks.loadtest --backend openai --url localhost:9000 --rate 2 ...

Requests are sent on a schedule (vLLM `bench serve` conventions: constant, Poisson, or
gamma with a burstiness factor), each on its own stream, optionally capped at
`--max-concurrency` in flight (a capped request waits, and its latency clock starts when it
is sent). Per request: TTFT, E2E latency, TPOT = (E2E - TTFT) / (output tokens - 1), and ITL
per *token*: a response carrying k tokens (one speculative step) contributes k gaps of
(its delay / k). Token counts come from the server's `num_output_tokens` output when it
sends one (specpipe does, on every streamed response); otherwise each non-empty response
counts as one token, which is exact for servers that stream one token per response. Through
the OpenAI door, streamed `/v1/completions` with vLLM's `continuous_usage_stats` give the
running count (`usage.completion_tokens` of every chunk), and specpipe's `speculation`
object the draft / accepted counts.
Writes `<out>.json` (vLLM's benchmark keys plus ours), `<out>.md` and `<out>_cdf.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm
from tritonclient.utils import InferenceServerException

from benchmarks.arrivals import ArrivalProcess
from benchmarks.prompts import Prompt, load_prompts
from benchmarks.report import machine, save_figure, subplots, write_report
from triton_repo.client import make_inputs

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a run asks for."""

    max_tokens: int = 64
    temperature: float = 0.0
    method: str | None = None
    """specpipe's `method` input; None sends none (the server's default; other servers)."""
    ignore_eos: bool = True
    """Fixed-length outputs, so methods and rates are compared on equal work."""
    model: str = "specpipe"
    server_inputs: frozenset[str] = frozenset()
    """Inputs the served model declares (read from its config before the run); requests send
    only those, so a TensorRT-LLM ensemble gets no specpipe-only tensors."""
    batched: bool = False
    """The served model batches (max_batch_size > 0, e.g. the ensemble): tensors get a batch dim."""

    def request_fields(self) -> dict[str, Any]:
        """make_inputs() keyword arguments this server accepts. A fixed length is asked for
        with specpipe's `ignore_eos`, or else the ensemble's `min_tokens`."""
        fields: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.method is not None:
            if "method" not in self.server_inputs:
                raise ValueError(f"model {self.model!r} has no 'method' input; drop --method for this server")
            fields["method"] = self.method
        if self.ignore_eos and "ignore_eos" in self.server_inputs:
            fields["ignore_eos"] = True
        elif self.ignore_eos and "min_tokens" in self.server_inputs:
            fields["min_tokens"] = self.max_tokens
        return fields


@dataclass
class RequestRecord:
    prompt_id: str
    sent: float = 0.0
    """Seconds since the run started."""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    input_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int | None = None
    """Engine steps the request took part in, as the server counts them (specpipe's
    `num_forwards`), or None where it sends none (then its responses count: one per step)."""
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since sent, tokens) of every response that carried tokens."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def add_chunk(self, at: float, total_tokens: int | None) -> None:
        """A response arrived `at` s after sending; `total_tokens` is the server's running
        count, None when it sends none (then the response is one token)."""
        tokens = 1 if total_tokens is None else total_tokens - self.output_tokens
        if tokens <= 0:
            return
        if self.ttft is None:
            self.ttft = at
        self.chunks.append((at, tokens))
        self.output_tokens += tokens

    def itl(self) -> list[float]:
        """Inter-token latencies: a chunk of k tokens spreads its delay over k gaps."""
        gaps, last = [], None
        for at, tokens in self.chunks:
            if last is not None:
                gaps += [(at - last) / tokens] * tokens
            elif tokens > 1:
                gaps += [0.0] * (tokens - 1)  # the first response's extra tokens came with the first
            last = at
        return gaps


def _scalar(result: Any, name: str) -> Any:
    try:
        value = result.as_numpy(name)
    except Exception:  # a server that does not declare this output
        return None
    return None if value is None or value.size == 0 else value.reshape(-1)[0]


def grpc_request(url: str, prompt: Prompt, settings: RequestSettings, record: RequestRecord) -> None:
    """One streamed request over gRPC (`ModelStreamInfer`); fills `record`."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    start = time.perf_counter()
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = make_inputs(prompt.text, stream=True, batched=settings.batched, **settings.request_fields())
        client.async_stream_infer(settings.model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=600)
            at = time.perf_counter() - start
            if error is not None:
                record.error = error.message() if hasattr(error, "message") else str(error)
                return
            count = _scalar(result, "num_output_tokens")
            text = result.as_numpy("text_output")
            if count is not None or (text is not None and b"".join(text)):
                record.add_chunk(at, None if count is None else int(count))
            if result.get_response().parameters["triton_final_response"].bool_param:
                record.e2e = at
                record.input_tokens = int(_scalar(result, "num_input_tokens") or 0)
                record.drafted = int(_scalar(result, "num_draft_tokens") or 0)
                record.accepted = int(_scalar(result, "num_accepted_tokens") or 0)
                steps = _scalar(result, "num_forwards")
                record.steps = None if steps is None else int(steps)
                return
    except Exception as e:  # the load tester records failures; it never dies of one
        record.error = f"{type(e).__name__}: {e}"
        while not responses.empty():  # the stream's callback holds the real cause
            _, error = responses.get_nowait()
            if error is not None:
                record.error = error.message() if hasattr(error, "message") else str(error)
    finally:
        client.stop_stream()
        client.close()


def http_request(url: str, prompt: Prompt, settings: RequestSettings, record: RequestRecord) -> None:
    """One streamed request over HTTP `generate_stream` (server-sent events)."""
    body: dict[str, Any] = {"text_input": prompt.text, "stream": True, **settings.request_fields()}
    req = urllib.request.Request(
        f"http://{url}/v2/models/{settings.model}/generate_stream", data=json.dumps(body).encode(), method="POST"
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: ") :])
                at = time.perf_counter() - start
                if "error" in event:
                    record.error = event["error"]
                    return
                count = event.get("num_output_tokens")
                if count is not None or event.get("text_output"):
                    record.add_chunk(at, None if count is None else int(count))
                if "finish_reason" in event:
                    record.input_tokens = int(event.get("num_input_tokens", 0))
                    record.drafted = int(event.get("num_draft_tokens", 0))
                    record.accepted = int(event.get("num_accepted_tokens", 0))
                    record.steps = int(event["num_forwards"]) if "num_forwards" in event else None
            record.e2e = time.perf_counter() - start
    except urllib.error.HTTPError as e:
        record.error = json.loads(e.read() or b"{}").get("error", str(e))
    except Exception as e:
        record.error = f"{type(e).__name__}: {e}"


def openai_request(url: str, prompt: Prompt, settings: RequestSettings, record: RequestRecord) -> None:
    """One streamed `/v1/completions` request to an OpenAI-compatible server (server-sent events)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "prompt": prompt.text,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **settings.request_fields(),
    }
    req = urllib.request.Request(
        f"http://{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                at = time.perf_counter() - start
                if "error" in event:
                    record.error = event["error"].get("message", str(event["error"]))
                    return
                usage = event.get("usage") or {}
                count = usage.get("completion_tokens")
                if event.get("choices") and (count is not None or event["choices"][0].get("text")):
                    record.add_chunk(at, None if count is None else int(count))
                if usage.get("prompt_tokens") is not None:
                    record.input_tokens = int(usage["prompt_tokens"])
                spec = event.get("speculation") or {}
                record.drafted = int(spec.get("draft_tokens", record.drafted))
                record.accepted = int(spec.get("accepted_tokens", record.accepted))
                record.steps = int(spec["target_steps"]) if "target_steps" in spec else record.steps
            record.e2e = time.perf_counter() - start
    except urllib.error.HTTPError as e:
        error = json.loads(e.read() or b"{}").get("error", {})
        record.error = error.get("message", str(e)) if isinstance(error, dict) else str(error)
    except Exception as e:
        record.error = f"{type(e).__name__}: {e}"


PROTOCOLS: dict[str, Callable[[str, Prompt, RequestSettings, RequestRecord], None]] = {
    "grpc": grpc_request,
    "http": http_request,
    "openai": openai_request,
}
OPENAI_EXTENSIONS = frozenset({"method", "ignore_eos"})
"""specpipe's OpenAI server takes these Triton inputs as request fields of the same name."""


def server_model(url: str, model: str, protocol: str) -> tuple[frozenset[str], bool]:
    """Input names the served model declares, and whether it batches (its config, over the
    run's protocol). An OpenAI server must list the model; it takes specpipe's extensions."""
    if protocol == "openai":
        with urllib.request.urlopen(f"http://{url}/v1/models", timeout=30) as response:
            ids = [m["id"] for m in json.loads(response.read())["data"]]
        if model not in ids:
            raise ValueError(f"model {model!r} is not served at {url} (it has {ids}); pass --model")
        return OPENAI_EXTENSIONS, False
    if protocol == "grpc":
        config = grpcclient.InferenceServerClient(url).get_model_config(model).config
        return frozenset(i.name for i in config.input), config.max_batch_size > 0
    with urllib.request.urlopen(f"http://{url}/v2/models/{model}/config", timeout=30) as response:
        doc = json.loads(response.read())
    return frozenset(i["name"] for i in doc["input"]), doc.get("max_batch_size", 0) > 0


def run_load(
    url: str,
    prompts: list[Prompt],
    arrivals: ArrivalProcess,
    settings: RequestSettings,
    protocol: str = "grpc",
    max_concurrency: int | None = None,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt on the arrival schedule; returns the records (in prompt order) and
    the run's duration (first send to last completion)."""
    send = PROTOCOLS[protocol]
    inputs, batched = server_model(url, settings.model, protocol)
    settings = replace(settings, server_inputs=inputs, batched=batched)
    settings.request_fields()  # refuse a run the server cannot take before sending anything
    records = [RequestRecord(p.id) for p in prompts]
    cap = threading.Semaphore(max_concurrency or len(prompts))
    bar = tqdm(total=len(prompts), desc=f"load {arrivals.rate:g} req/s", unit="req", disable=not progress)
    start = time.perf_counter()

    def one(i: int) -> None:
        try:
            records[i].sent = time.perf_counter() - start
            send(url, prompts[i], settings, records[i])
        finally:
            cap.release()
            bar.update(1)

    with ThreadPoolExecutor(max_workers=max_concurrency or len(prompts)) as pool:
        for i, at in enumerate(arrivals.schedule(len(prompts))):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            cap.acquire()
            pool.submit(one, i)
    bar.close()
    return records, time.perf_counter() - start


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    """vLLM-style mean/median/std/p<k> of `name`, in ms."""
    ms = np.array(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    out |= {f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}
    return out


def tpot(r: RequestRecord) -> float | None:
    if r.e2e is None or r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def summarize(records: list[RequestRecord], duration: float, slos_ms: dict[str, float]) -> dict[str, Any]:
    """Aggregates with vLLM's benchmark JSON keys (`request_throughput`, `mean_ttft_ms`,
    `p99_tpot_ms`, ..., `request_goodput`) plus ours (`failed`, `errors`, `ms_per_token`,
    `mean_tokens_per_step`, `acceptance_rate`)."""
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := tpot(r)) is not None]
    good = [r for r in done if _meets(r, slos_ms)]
    steps = sum(len(r.chunks) if r.steps is None else r.steps for r in done)  # streamed responses may hold several
    drafted, accepted = sum(r.drafted for r in done), sum(r.accepted for r in done)
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error}),
        "total_input_tokens": sum(r.input_tokens for r in done),
        "total_output_tokens": output,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + sum(r.input_tokens for r in done)) / duration,
        "request_goodput": len(good) / duration if slos_ms else None,
        "goodput_slos_ms": slos_ms,
        "ms_per_token": statistics.mean(1000 * r.e2e / r.output_tokens for r in done if r.e2e and r.output_tokens)
        if done
        else None,
        "mean_tokens_per_step": output / steps if steps else None,
        "total_draft_tokens": drafted,
        "total_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
    summary["mean_accepted_tokens_per_step"] = (
        None if summary["mean_tokens_per_step"] is None else summary["mean_tokens_per_step"] - 1
    )
    summary |= _stats("ttft", [r.ttft for r in done if r.ttft is not None])
    summary |= _stats("tpot", tpots)
    summary |= _stats("itl", [g for r in done for g in r.itl()])
    summary |= _stats("e2el", [r.e2e for r in done if r.e2e is not None])
    return summary


def _meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.e2e}
    return all(values[k] is not None and 1000 * values[k] <= limit for k, limit in slos_ms.items())  # type: ignore[operator]


def parse_slos(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` (ms) -> dict; the metric names of vLLM's --goodput."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput {item!r}: use ttft:<ms>, tpot:<ms> or e2el:<ms>")
        slos[name] = float(value)
    return slos


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Load test",
        "",
        f"`{meta['url']}` ({meta['protocol']}), model `{meta['settings']['model']}`, method "
        f"`{meta['settings']['method'] or 'server default'}`, {meta['num_requests']} requests, "
        f"{meta['arrivals']['kind']} arrivals at {meta['arrivals']['rate']:g} req/s, "
        f"max_tokens {meta['settings']['max_tokens']}, temperature {meta['settings']['temperature']}.",
        "",
        f"- completed {summary['completed']}, failed {summary['failed']} in {summary['duration']:.1f} s",
        f"- request throughput {summary['request_throughput']:.2f} req/s, "
        f"output {summary['output_throughput']:.1f} tok/s",
        f"- ms/token {summary['ms_per_token'] or 0:.1f}, tokens/step {summary['mean_tokens_per_step'] or 0:.2f}",
        "",
        "| metric | mean | median | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(
            f"| {name.upper()} ms | {summary[f'mean_{name}_ms']:.1f} | {summary[f'median_{name}_ms']:.1f} "
            f"| {summary[f'p90_{name}_ms']:.1f} | {summary[f'p99_{name}_ms']:.1f} |"
        )
    if summary["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in summary["errors"]]]
    return "\n".join(lines) + "\n"


def plot_cdfs(records: list[RequestRecord], path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) of one run."""
    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "TPOT": [t for r in done if (t := tpot(r)) is not None],
        "ITL": [g for r in done for g in r.itl()],
        "E2E": [r.e2e for r in done if r.e2e is not None],
    }
    fig, axes = subplots(4, (16, 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ms = np.sort(np.array(values, dtype=float) * 1000)
        ax.plot(ms, np.arange(1, len(ms) + 1) / max(1, len(ms)))
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--url", default="localhost:8001", help="gRPC (or, with --protocol http / --backend openai, HTTP) host:port"
    )
    ap.add_argument(
        "--backend",
        choices=("triton", "openai"),
        default="triton",
        help="triton: Triton's own API over --protocol; openai: an OpenAI-compatible server's streamed "
        "/v1/completions (default: %(default)s)",
    )
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="Triton's (default: %(default)s)")
    ap.add_argument("--model", default="specpipe", help="Triton model name / OpenAI model id (default: %(default)s)")
    ap.add_argument("--rate", type=float, required=True, help="requests per second (inf = all at once)")
    ap.add_argument(
        "--arrivals", choices=("poisson", "constant", "gamma"), default="poisson", help="(default: %(default)s)"
    )
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson (default: %(default)s)")
    ap.add_argument("--num-requests", type=int, default=100, help="(default: %(default)s)")
    ap.add_argument("--duration", type=float, help="seconds of load instead: num-requests = rate x duration")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured (default: %(default)s)")
    ap.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    ap.add_argument("--prompts", default="bundled", help="bundled | MT-Bench question.jsonl | ShareGPT .json")
    ap.add_argument("--seed", type=int, default=0, help="arrivals and prompt sampling (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    ap.add_argument("--method", help="specpipe decoding method (ar, redrafter); default: the server's")
    ap.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS (default: fixed length)")
    ap.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/loadtest"), help="output path stem")
    args = ap.parse_args(argv)
    if args.duration is not None:
        if args.duration <= 0 or args.rate == float("inf"):
            print("error: --duration needs a finite --rate and a positive number of seconds", flush=True)
            return 2
        args.num_requests = max(1, math.ceil(args.rate * args.duration))
    try:
        slos = parse_slos(args.goodput)
        arrivals = ArrivalProcess(args.rate, args.arrivals, args.burstiness, args.seed)
        prompts = load_prompts(args.prompts, args.num_requests + args.warmup, args.seed)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", flush=True)
        return 2
    settings = RequestSettings(args.max_tokens, args.temperature, args.method, not args.stop_at_eos, args.model)
    if args.backend == "openai":
        args.protocol = "openai"
    try:
        if args.warmup:
            warm = prompts[: args.warmup]
            run_load(args.url, warm, ArrivalProcess(float("inf")), settings, args.protocol, progress=False)
        records, duration = run_load(
            args.url, prompts[args.warmup :], arrivals, settings, args.protocol, args.max_concurrency
        )
    except (InferenceServerException, OSError, ValueError, KeyError) as e:  # no server / model / input there
        print(f"error: {args.url} ({args.protocol}): {e}", flush=True)
        return 2
    summary = summarize(records, duration, slos)
    meta = {
        "url": args.url,
        "protocol": args.protocol,
        "num_requests": args.num_requests,
        "max_concurrency": args.max_concurrency,
        "prompts": args.prompts,
        "arrivals": asdict(arrivals),
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("server_inputs", "batched")},
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in records], markdown(summary, meta), summary=summary)
    plot_cdfs(records, args.out.with_name(args.out.name + "_cdf.png"))
    return 1 if summary["completed"] == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
