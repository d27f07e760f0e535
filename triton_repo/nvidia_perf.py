"""NVIDIA's own benchmark clients, unchanged, against specpipe's Triton server.

    make perf-tools          # .venv-perf: perf_analyzer (tritonclient 2.50.0's wheel) + genai-perf 0.0.16
    python -m triton_repo.nvidia_perf genai-perf --engine engines/demo-redrafter [--out DIR] [-- GENAI_PERF_ARGS]
    python -m triton_repo.nvidia_perf perf-analyzer --engine engines/demo-redrafter [--out DIR] [-- PA_ARGS]

Each command starts the engine's server on free ports (`triton_repo.server.TritonServer`),
runs the tool against the decoupled model over gRPC streaming, prints its report and the
tokens-level summary, and stops the server. `--url host:port` uses a running server instead.

The tools live in their own virtual environment (`.venv-perf`, or `SPECPIPE_PERF_VENV`):
genai-perf pins packages of its own, and perf_analyzer is the Linux binary shipped inside
the `tritonclient` 2.50.0 wheel (later wheels need a newer glibc than Debian 12's). That
binary links `libb64.so.0d` (Debian's `libb64-0d`) and `libcudart.so.12` even on a CPU
(the `nvidia-cuda-runtime-cu12` wheel); `.venv-perf/tools/perf_analyzer` and
`.venv-perf/tools/genai-perf`, written by `make perf-tools`, set `LD_LIBRARY_PATH` and
`PATH` so that either runs from anywhere, and `tool_env` does the same here.

genai-perf needs a Hugging Face tokenizer to make prompts and count tokens, and would
download one; `hf_tokenizer_dir` writes the engine's own `tokenizer.json` with a
`tokenizer_config.json` into a directory that `transformers.AutoTokenizer` loads offline,
and `--tokenizer` points there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.engine_dir import EngineConfig
from training.corpus import heldout_prompts
from triton_repo.repository import PROJECT_ROOT, ServingConfig, add_stream_interval_arg

PERF_VENV = Path(os.environ.get("SPECPIPE_PERF_VENV", PROJECT_ROOT / ".venv-perf"))
"""Where `make perf-tools` installs the NVIDIA clients."""
MODEL = "specpipe"
"""The decoupled model: genai-perf's `kserve` endpoint and perf_analyzer `--streaming` need one."""
RESULTS = PROJECT_ROOT / "benchmarks" / "results"
GENAI_PERF_OUT = RESULTS / "genai_perf"
PERF_ANALYZER_OUT = RESULTS / "perf_analyzer"
DEFAULT_PROMPT = "import os\n\n\ndef list_python_files(path):"


def cuda_runtime_lib(venv: Path = PERF_VENV) -> Path | None:
    """The folder with `libcudart.so.12` from the `nvidia-cuda-runtime-cu12` wheel, if installed."""
    found = sorted(venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    return found[0] if found else None


def tool_env(venv: Path = PERF_VENV) -> dict[str, str]:
    """The environment the NVIDIA tools run in: the venv's `bin/` first on PATH (genai-perf
    runs `perf_analyzer` by name) and its CUDA runtime on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env.setdefault("COLUMNS", "160")  # genai-perf's table (rich) is 80 columns wide off a terminal
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    lib = cuda_runtime_lib(venv)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def tool_problem(tool: str, venv: Path = PERF_VENV) -> str | None:
    """Why `tool` ("perf_analyzer" or "genai-perf") cannot run here, or None."""
    binary = venv / "bin" / tool
    if not binary.exists():
        return f"{binary} is missing; `make perf-tools` installs it"
    try:
        proc = subprocess.run(
            [str(binary), "--version"], env=tool_env(venv), capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{binary} does not start: {e}"
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        hint = ""
        if "libb64" in proc.stderr:
            hint = " (install Debian's libb64-0d: `make perf-tools` does, as root)"
        return f"{binary} --version exited {proc.returncode}: {said[-1] if said else ''}{hint}"
    return None


def hf_tokenizer_dir(engine_dir: str | Path, out: str | Path) -> Path:
    """A directory `transformers.AutoTokenizer.from_pretrained` loads without a network: the
    engine's tokenizer.json, and its tokenizer_config.json when the engine has one, else a
    minimal one naming the fast tokenizer class."""
    engine_dir, out = Path(engine_dir), Path(out)
    config = EngineConfig.load(engine_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(engine_dir / config.tokenizer, out / "tokenizer.json")
    source_config = engine_dir / "tokenizer_config.json"
    if source_config.is_file():
        shutil.copyfile(source_config, out / "tokenizer_config.json")
    else:
        (out / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}) + "\n"
        )
    return out


def genai_perf_command(
    url: str,
    tokenizer: Path,
    artifact_dir: Path,
    *,
    model: str = MODEL,
    request_count: int = 24,
    warmup: int = 2,
    concurrency: int | None = 2,
    request_rate: float | None = None,
    input_tokens: int = 64,
    output_tokens: int = 64,
    extra: Sequence[str] = (),
    venv: Path = PERF_VENV,
) -> list[str]:
    """`genai-perf profile` against the TensorRT-LLM-style model at `url` (gRPC), streaming.
    With a concurrency, at least that many warm-up requests are sent: perf_analyzer 2.50
    never ends its warm-up when it asks for fewer requests than it keeps in flight."""
    if request_rate:
        load = ["--request-rate", str(request_rate)]
    else:
        load = ["--concurrency", str(concurrency or 1)]
        warmup = max(warmup, concurrency or 1)
    return [
        str(venv / "bin" / "genai-perf"),
        "profile",
        "-m",
        model,
        "--endpoint-type",
        "kserve",
        "--backend",
        "tensorrtllm",
        "--streaming",
        "-u",
        url,
        "--tokenizer",
        str(tokenizer),
        "--synthetic-input-tokens-mean",
        str(input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(output_tokens),
        "--output-tokens-stddev",
        "0",
        "--random-seed",
        "0",
        "--request-count",
        str(request_count),
        "--warmup-request-count",
        str(warmup),
        *load,
        "--artifact-dir",
        str(artifact_dir),
        *extra,
    ]


def perf_analyzer_input(path: Path, prompts: Sequence[str], max_tokens: int, **inputs: object) -> Path:
    """perf_analyzer's `--input-data` JSON: one streaming request per prompt (Triton's
    TensorRT-LLM tensor names, shapes without a batch dimension); `inputs` are more inputs
    every request carries (name -> value, e.g. `ignore_eos=True`, `method="redrafter"`)."""
    data = [{"text_input": [p], "max_tokens": [max_tokens], "stream": [True]} for p in prompts]
    for request in data:
        request.update({name: [value] for name, value in inputs.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": data}, indent=1) + "\n")
    return path


def benchmark_input(path: Path, prompts: str, count: int, max_tokens: int, method: str | None = None) -> Path:
    """`perf_analyzer_input` for a benchmark: the first `count` held-out prompts (`prompts`
    "heldout": the in-process benchmarks' set, never trained on; perf_analyzer sends them in
    turn) or the one `DEFAULT_PROMPT` ("demo"), `max_tokens` tokens each with EOS ignored
    (as in the in-process benchmarks, so every method makes the same tokens), and `method`
    (e.g. "ar") as every request's `method` input where given. One short prompt measured
    ReDrafter at 1.46-1.51x AR through Triton where the held-out set reads ~2x in-process."""
    texts = heldout_prompts(count) if prompts == "heldout" else [DEFAULT_PROMPT]
    inputs: dict[str, object] = {"ignore_eos": True} | ({"method": method} if method else {})
    return perf_analyzer_input(path, texts, max_tokens, **inputs)


def perf_analyzer_command(
    url: str,
    input_data: Path,
    export: Path,
    *,
    model: str = MODEL,
    request_rate: float = 1.0,
    request_count: int = 8,
    concurrency: int | None = None,
    extra: Sequence[str] = (),
    venv: Path = PERF_VENV,
) -> list[str]:
    """perf_analyzer at a fixed request rate (or, with `concurrency`, that many requests in
    flight at all times) over gRPC streaming, `request_count` requests in one measurement
    (no stability search), each response's time exported to `export`."""
    load = ["--concurrency-range", str(concurrency)] if concurrency else ["--request-rate-range", str(request_rate)]
    return [
        str(venv / "bin" / "perf_analyzer"),
        "-m",
        model,
        "-u",
        url,
        "-i",
        "grpc",
        "--streaming",
        *load,
        "--request-count",
        str(request_count),
        "--input-data",
        str(input_data),
        "--profile-export-file",
        str(export),
        *extra,
    ]


@dataclass(frozen=True)
class StreamSummary:
    """What perf_analyzer's profile export says per request (times from its own clock)."""

    requests: int
    responses: int
    ttft_ms: float
    """Mean time from sending a request to its first response."""
    itl_ms: float
    """Mean time between consecutive responses of a request (one response may carry several
    tokens: a speculative step streams all its accepted tokens at once)."""
    e2e_ms: float
    duration_s: float
    request_throughput: float

    def lines(self) -> list[str]:
        return [
            f"requests {self.requests}, responses {self.responses}",
            f"time to first response  mean {self.ttft_ms:.1f} ms",
            f"inter-response latency  mean {self.itl_ms:.1f} ms",
            f"request latency         mean {self.e2e_ms:.1f} ms",
            f"request throughput      {self.request_throughput:.2f} req/s over {self.duration_s:.1f} s",
        ]


@dataclass(frozen=True)
class RequestTimes:
    """One request of perf_analyzer's profile export, on its clock (nanoseconds)."""

    sent: int
    responses: list[int]

    @property
    def first_ms(self) -> float:
        """From sending the request to its first response (it must have one)."""
        return (self.responses[0] - self.sent) / 1e6

    @property
    def gaps_ms(self) -> list[float]:
        """Between its consecutive responses."""
        return [(b - a) / 1e6 for a, b in itertools.pairwise(self.responses)]


def export_requests(export: Path) -> list[RequestTimes]:
    """Every request of perf_analyzer's `--profile-export-file`, in the order sent; raises
    ValueError when it recorded none."""
    doc = json.loads(export.read_text())
    requests = [
        RequestTimes(r["timestamp"], r["response_timestamps"]) for exp in doc["experiments"] for r in exp["requests"]
    ]
    if not requests:
        raise ValueError(f"{export}: perf_analyzer recorded no request")
    return sorted(requests, key=lambda r: r.sent)


def summarize_export(export: Path) -> StreamSummary:
    """TTFT / inter-response latency / throughput from perf_analyzer's `--profile-export-file`."""
    requests = export_requests(export)
    answered = [r for r in requests if r.responses]
    ttft = [r.first_ms for r in answered]
    e2e = [(r.responses[-1] - r.sent) / 1e6 for r in answered]
    itl = [gap for r in answered for gap in r.gaps_ms]
    responses = sum(len(r.responses) for r in requests)
    start = min(r.sent for r in requests)
    end = max(max(r.responses, default=r.sent) for r in requests)
    duration = max((end - start) / 1e9, 1e-9)
    return StreamSummary(
        requests=len(requests),
        responses=responses,
        ttft_ms=statistics.fmean(ttft) if ttft else float("nan"),
        itl_ms=statistics.fmean(itl) if itl else float("nan"),
        e2e_ms=statistics.fmean(e2e) if e2e else float("nan"),
        duration_s=duration,
        request_throughput=len(requests) / duration,
    )


def _run(command: list[str], venv: Path, timeout_s: float | None) -> int:
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, env=tool_env(venv), timeout=timeout_s).returncode


def run_perf_analyzer(
    command: list[str], export: Path, *, venv: Path = PERF_VENV, timeout_s: float | None = None, capture: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a `perf_analyzer_command`. perf_analyzer 2.50 sometimes exits 0 with complete
    statistics on stdout but an empty `--profile-export-file` (seen on its first run against
    a server that had just started, and in a loaded CI run): then it runs again, up to
    `attempts` times. perf_analyzer refuses an export path that already exists, so the empty
    file is removed before each run."""
    attempts = 3
    for attempt in range(1, attempts + 1):
        export.unlink(missing_ok=True)
        if not capture:
            print("$ " + " ".join(command), flush=True)
        proc = subprocess.run(command, env=tool_env(venv), timeout=timeout_s, capture_output=capture, text=True)
        if proc.returncode != 0 or (export.is_file() and export.stat().st_size > 0) or attempt == attempts:
            return proc
        print(
            f"perf_analyzer exited 0 with an empty profile export; running it again ({attempt}/{attempts})",
            file=sys.stderr,
        )
    raise AssertionError("unreachable")


def _with_server(args: argparse.Namespace, work: Path, body: Callable[[str], int]) -> int:
    """`body(grpc_url)` against `--url`, or against a server started for `--engine` meanwhile."""
    from triton_repo.server import TritonServer

    if args.url:
        return body(args.url)
    config = ServingConfig(engine_dir=args.engine, stream_interval_ms=args.stream_interval_ms)
    with TritonServer(config, work / "triton") as server:
        print(f"serving {args.engine} on gRPC {server.grpc_url}", flush=True)
        return body(server.grpc_url)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.nvidia_perf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("tool", choices=["genai-perf", "perf-analyzer"])
    ap.add_argument("--engine", type=Path, default=PROJECT_ROOT / "engines" / "demo-redrafter")
    ap.add_argument("--url", help="gRPC host:port of a running server (default: start one for --engine)")
    add_stream_interval_arg(ap)  # for the server it starts
    ap.add_argument("--out", type=Path, help="artifact directory (default: benchmarks/results/<tool>/)")
    ap.add_argument("--requests", type=int, default=24, help="requests measured (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="genai-perf: requests in flight (default: %(default)s)")
    ap.add_argument(
        "--rate", type=float, help="request rate, req/s (perf-analyzer default 1; genai-perf: not concurrency)"
    )
    ap.add_argument(
        "--input-tokens", type=int, default=64, help="genai-perf synthetic prompt length (default: %(default)s)"
    )
    ap.add_argument("--output-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    ap.add_argument(
        "--prompts",
        choices=["heldout", "demo"],
        default="heldout",
        help="perf-analyzer: the first --prompt-count held-out prompts, one request each in turn (the "
        "in-process benchmarks' set, never trained on), or the one demo prompt (default: %(default)s)",
    )
    ap.add_argument(
        "--prompt-count", type=int, default=8, help="perf-analyzer: held-out prompts (default: %(default)s)"
    )
    ap.add_argument(
        "--method", help="perf-analyzer: the `method` input of every request, e.g. ar (default: the engine's)"
    )
    ap.add_argument("--timeout", type=float, default=None, help="seconds the tool may run")
    ap.add_argument("extra", nargs="*", help="after --: more arguments for the tool")
    args = ap.parse_args(argv)
    tool = "genai-perf" if args.tool == "genai-perf" else "perf_analyzer"
    problem = tool_problem(tool)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = (args.out or (GENAI_PERF_OUT if tool == "genai-perf" else PERF_ANALYZER_OUT)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specpipe-nvidia-perf-") as tmp:
        code = _run_tool(args, tool, out, Path(tmp))
    print(f"artifacts: {out}", flush=True)
    return code


def _run_tool(args: argparse.Namespace, tool: str, out: Path, work: Path) -> int:
    if tool == "genai-perf":
        tokenizer = hf_tokenizer_dir(args.engine, work / "tokenizer")

        def body(url: str) -> int:
            command = genai_perf_command(
                url,
                tokenizer,
                out,
                request_count=args.requests,
                concurrency=args.concurrency,
                request_rate=args.rate,
                input_tokens=args.input_tokens,
                output_tokens=args.output_tokens,
                extra=args.extra,
            )
            return _run(command, PERF_VENV, args.timeout)

    else:

        def body(url: str) -> int:
            data = benchmark_input(
                work / "input_data.json", args.prompts, args.prompt_count, args.output_tokens, args.method
            )
            export = out / "profile_export.json"
            command = perf_analyzer_command(
                url, data, export, request_rate=args.rate or 1.0, request_count=args.requests, extra=args.extra
            )
            code = run_perf_analyzer(command, export, timeout_s=args.timeout).returncode
            if code == 0:
                summary = summarize_export(export)
                print("\n".join(["from the profile export:", *("  " + line for line in summary.lines())]))
            return code

    return _with_server(args, work, body)


if __name__ == "__main__":
    sys.exit(main())
