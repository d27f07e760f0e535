"""The load tester against a real Triton server: every request is accounted for, tokens
are counted per token (a speculative step streams several in one response), the JSON
has vLLM's keys, and a server-side error is a recorded failure, not a crash; the same
through the OpenAI door (`--backend openai`, `python -m triton_repo.openai` attached)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")

from benchmarks.arrivals import ArrivalProcess
from benchmarks.loadtest import RequestSettings, main, run_load, summarize
from benchmarks.prompts import Prompt, load_prompts
from benchmarks.triton_overhead import main as overhead_main
from build.engine import build_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from tests.host_tools import skip_without_tritonserver
from triton_repo.openai.launch import OpenAIFrontend
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer

MODELS = Path(__file__).resolve().parents[2] / "models"
MAX_TOKENS = 24
VLLM_KEYS = [
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    skip_without_tritonserver()
    out = tmp_path_factory.mktemp("engines") / "demo-redrafter"
    build = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512)
    engine = build_engine(MODELS / "demo-target", out, build, drafter=MODELS / "demo-redrafter")
    # fixed speculation: every step drafts, so the drafted and accepted tokens these tests count
    # do not hang on load-aware timings (beside another CPU job, it ran every step plain: 0 drafted)
    config = ServingConfig(engine, runtime=RuntimeConfig(speculation="fixed"))
    with TritonServer(config, tmp_path_factory.mktemp("triton")) as running:
        yield running


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_every_request_is_accounted_for_and_tokens_are_counted(server: TritonServer, protocol: str) -> None:
    prompts = load_prompts("bundled", 6, seed=0)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    settings = RequestSettings(max_tokens=MAX_TOKENS, method="redrafter")
    records, duration = run_load(url, prompts, ArrivalProcess(20.0, seed=1), settings, protocol, progress=False)
    summary = summarize(records, duration, {"ttft": 60_000})
    assert summary["completed"] + summary["failed"] == len(prompts) and summary["failed"] == 0
    for r in records:
        assert r.output_tokens == sum(t for _, t in r.chunks) == MAX_TOKENS  # ignore_eos: fixed length
        assert len(r.itl()) == MAX_TOKENS - 1
    assert any(t > 1 for r in records for _, t in r.chunks), "speculative steps stream several tokens at once"
    assert summary["mean_tokens_per_step"] > 1 and summary["total_output_tokens"] == 6 * MAX_TOKENS
    # tokens/step from the server's step counts: a step emits at most its accepted drafts and
    # one token; streamed responses are held up to 20 ms, so they would count fewer steps
    assert all(r.steps is not None and r.steps <= r.output_tokens <= r.steps + r.accepted for r in records)
    assert summary["mean_tokens_per_step"] == pytest.approx(6 * MAX_TOKENS / sum(r.steps or 0 for r in records))
    assert any(len(r.chunks) < r.steps for r in records if r.steps), "held responses carry several steps"
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])


def test_server_errors_are_failures_with_their_message(server: TritonServer) -> None:
    prompts = [Prompt("def f():", "ok-1"), Prompt("x " * 2000, "too-long"), Prompt("import os", "ok-2")]
    records, duration = run_load(
        server.grpc_url, prompts, ArrivalProcess(float("inf")), RequestSettings(max_tokens=8), progress=False
    )
    summary = summarize(records, duration, {})
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert records[1].error is not None and "max_input_len 256" in records[1].error
    assert summary["errors"] == [records[1].error]


def test_cli_writes_json_markdown_and_plot(server: TritonServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["--url", server.grpc_url, "--rate", "10", "--num-requests", "4", "--warmup", "1"]
    argv += ["--max-tokens", "12", "--goodput", "ttft:60000", "tpot:60000", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert all(k in doc for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in doc]
    assert doc["completed"] == 4 and len(doc["rows"]) == 4 and doc["request_goodput"] > 0
    assert "| TTFT ms |" in out.with_suffix(".md").read_text()
    assert (tmp_path / "run_cdf.png").stat().st_size > 1000


def test_requests_send_only_what_the_server_declares() -> None:
    """Against a TensorRT-LLM ensemble (no specpipe extras) a fixed length is asked for with
    `min_tokens`, and a specpipe-only option is refused before anything is sent."""
    ensemble = frozenset({"text_input", "max_tokens", "temperature", "stream", "min_tokens", "end_id"})
    fields = RequestSettings(max_tokens=32, server_inputs=ensemble).request_fields()
    assert fields == {"max_tokens": 32, "temperature": 0.0, "min_tokens": 32}
    specpipe = ensemble - {"min_tokens"} | {"ignore_eos", "method"}
    assert RequestSettings(method="ar", server_inputs=specpipe).request_fields()["ignore_eos"] is True
    with pytest.raises(ValueError, match="no 'method' input"):
        RequestSettings(method="redrafter", server_inputs=ensemble).request_fields()


def test_the_openai_backend_writes_the_same_report(server: TritonServer, tmp_path: Path) -> None:
    with OpenAIFrontend(["--triton-url", server.grpc_url, "--log-level", "warning"], tmp_path / "openai.log") as door:
        out = tmp_path / "openai"
        argv = ["--backend", "openai", "--url", door.url, "--rate", "10", "--num-requests", "3", "--warmup", "1"]
        assert main([*argv, "--max-tokens", str(MAX_TOKENS), "--method", "redrafter", "--out", str(out)]) == 0
        assert main([*argv, "--model", "gpt-4o", "--out", str(tmp_path / "none")]) == 2  # not served there
        prompts = [Prompt("def f():", "ok"), Prompt("x " * 2000, "too-long")]
        settings = RequestSettings(max_tokens=8)
        records, _ = run_load(door.url, prompts, ArrivalProcess(float("inf")), settings, "openai", progress=False)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert all(k in doc for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in doc]
    assert (doc["completed"], doc["failed"]) == (3, 0) and doc["total_output_tokens"] == 3 * MAX_TOKENS
    for row in doc["rows"]:
        assert row["output_tokens"] == sum(t for _, t in row["chunks"]) == MAX_TOKENS and row["input_tokens"] > 0
        assert row["steps"] <= row["output_tokens"] <= row["steps"] + row["accepted"]
    assert doc["total_draft_tokens"] >= doc["total_accepted_tokens"] > 0
    assert records[0].ok and records[1].error is not None and "max_input_len 256" in records[1].error


def test_triton_overhead_report_times_the_same_requests_both_ways(server: TritonServer, tmp_path: Path) -> None:
    """`benchmarks/triton_overhead.py` against the running server: each method decodes the
    same fixed-length requests in-process and through Triton, with NVIDIA perf_analyzer and
    the Python gRPC client, and the report says so."""
    out = tmp_path / "overhead"
    # 24 tokens: a ReDrafter request of 6 made them in one step or two, and where its first
    # token and its end went out together there was no time between responses to report
    overhead_main(
        ["--engine", str(server.cfg.engine_dir), "--url", server.grpc_url, "--num-prompts", "2",
         "--max-tokens", "24", "--rounds", "1", "--out", str(out)]
    )  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["method"], r["client"]) for r in rows] == [
        ("ar", "perf_analyzer"), ("ar", "python"), ("redrafter", "perf_analyzer"), ("redrafter", "python")
    ]  # fmt: skip
    for r in rows:
        assert r["tokens"] == [48, 48]
        assert r["ratio"] > 0 and r["mean_response_gap_ms"] > 0 and r["mean_first_response_ms"] > 0
    md = out.with_suffix(".md").read_text()
    assert "python -m benchmarks.triton_overhead --engine" in md and "| redrafter | perf_analyzer |" in md
