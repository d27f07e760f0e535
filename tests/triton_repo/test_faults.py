"""Fault injection through a real tritonserver: a request that fails inside the engine (or
while its response is built) gets an error FINAL naming the fault while the requests
streaming next to it finish with their solo greedy text; a failed forward or a failed step
costs only the requests in flight, and the next request is served. A fault that fails
every step makes the engine dead: `specpipe_engine_up` drops to 0, new requests are
refused (UNAVAILABLE), and the launcher's supervision reports it (it then stops the
server). Faults are chosen by seed through SPECPIPE_INJECT_FAULTS (`runtime/faults.py`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")

from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.faults import ENV
from runtime.llm_engine import MAX_STEP_FAILURES, LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from tests.demo_engines import demo_redrafter_engine
from tests.host_tools import skip_without_tritonserver
from tests.triton_repo.streams import PROMPTS, stream_grpc
from triton_repo.metrics import read_metrics
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer

MAX_TOKENS = 16
SEEDS = {"draft": 101, "verify": 102, "sample": 103, "detokenize": 104, "forward": 105, "step": 106}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_redrafter_engine(tmp_path_factory, BuildConfig(max_batch_size=8, max_input_len=128, max_seq_len=320))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    skip_without_tritonserver()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, ",".join(f"{stage}:{seed}" for stage, seed in SEEDS.items()))
        with TritonServer(ServingConfig(engine_dir=engine_dir), tmp_path_factory.mktemp("triton")) as running:
            yield running


@pytest.fixture(scope="module")
def solo(engine_dir: Path) -> list[str]:
    engine = LoadedEngine.load(engine_dir)
    llm = LLMEngine(engine, RuntimeConfig(speculation="fixed"))
    results = llm.generate([engine.encode(p) for p in PROMPTS], [SamplingParams(max_tokens=MAX_TOKENS)] * 3)
    return [engine.decode(r.output_ids) for r in results]


def good(i: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % 3], "max_tokens": MAX_TOKENS, "method": "redrafter"}


def victim(stage: str) -> dict[str, Any]:
    """Greedy (the seed only marks it), streamed next to the good ones."""
    return {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "seed": SEEDS[stage], "method": "redrafter"}


def wait_idle(server: TritonServer) -> dict[str, float]:
    deadline = time.monotonic() + 10  # gauges refresh every 100 ms
    while (m := read_metrics(server.metrics_url))["specpipe_running_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def test_a_failing_request_ends_alone_while_the_others_stream(server: TritonServer, solo: list[str]) -> None:
    before = read_metrics(server.metrics_url).get('specpipe_requests_total{outcome="error"}', 0.0)
    stages = ["draft", "verify", "sample", "detokenize"]
    requests = [good(i) for i in range(6)] + [victim(s) for s in stages]
    results = stream_grpc(server.grpc_url, requests)
    for i, r in enumerate(results[:6]):
        assert "error" not in r and r["finals"] == 1 and r["text"] == solo[i % 3], f"good request {i}: {r}"
    for stage, r in zip(stages, results[6:], strict=True):
        assert "error" in r, f"{stage} victim was not failed: {r}"
        assert f"fault injected at {stage}" in r["error"].message()
    m = wait_idle(server)
    assert m['specpipe_requests_total{outcome="error"}'] - before == len(stages)
    assert m['specpipe_kv_blocks{state="used"}'] == 0 and m["specpipe_engine_up"] == 1


@pytest.mark.parametrize("stage", ["forward", "step"])
def test_a_failed_forward_or_step_costs_only_the_requests_in_flight(
    server: TritonServer, solo: list[str], stage: str
) -> None:
    [failed] = stream_grpc(server.grpc_url, [victim(stage)])
    assert f"fault injected at {stage}" in failed["error"].message()
    after = stream_grpc(server.grpc_url, [good(i) for i in range(3)])
    assert [r["text"] for r in after] == solo
    m = wait_idle(server)
    assert m['specpipe_kv_blocks{state="used"}'] == 0 and m["specpipe_engine_up"] == 1


def test_an_engine_that_fails_every_step_is_reported_down(server: TritonServer) -> None:
    """Last in this module: it leaves the engine dead."""
    for _ in range(MAX_STEP_FAILURES):
        [failed] = stream_grpc(server.grpc_url, [victim("step")])
        assert "fault injected at step" in failed["error"].message()
    deadline = time.monotonic() + 10
    while read_metrics(server.metrics_url)["specpipe_engine_up"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_metrics(server.metrics_url)["specpipe_engine_up"] == 0
    [refused] = stream_grpc(server.grpc_url, [good(0)])
    assert "engine is down" in refused["error"].message() and "restart the server" in refused["error"].message()
    with pytest.raises(RuntimeError, match="engine"):
        server.check_alive()  # the launcher's supervision: `python -m triton_repo.server` now stops, exit 1
