"""A TP=2 engine served by Triton in leader mode (rank 0 inside the Triton model, rank 1 a
`runtime.tp_worker` started by the launcher under mpirun) streams the same greedy text as
the TP=1 engine in-process, for every method; a killed follower fails the request in flight
at once and the server reports itself down."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
import tritonclient.grpc as grpcclient

from build.engine import build_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from tests.host_tools import needs_mpirun, skip_without_tritonserver
from tests.triton_repo.streams import MODEL, PROMPTS, stream_grpc
from triton_repo.client import make_inputs
from triton_repo.processes import launched_processes
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILD = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160)
MAX_TOKENS = 20

pytestmark = needs_mpirun


def engine_dir(root: Path, tp_size: int) -> Path:
    out = root / f"tp{tp_size}"
    return build_engine(MODELS / "demo-target", out, replace(BUILD, tp_size=tp_size), drafter=MODELS / "demo-redrafter")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp-engines")
    return engine_dir(root, 1), engine_dir(root, 2)


@pytest.fixture(scope="module")
def server(engines: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    skip_without_tritonserver()
    with TritonServer(ServingConfig(engine_dir=engines[1]), tmp_path_factory.mktemp("triton-tp")) as running:
        yield running


@pytest.mark.parametrize("method", ["ar", "redrafter"])
def test_tp2_through_triton_equals_tp1(server: TritonServer, engines: tuple[Path, Path], method: str) -> None:
    tp1 = LoadedEngine.load(engines[0])
    llm = LLMEngine(tp1, RuntimeConfig(speculation="fixed"))
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS)
    expected = [tp1.decode(r.output_ids) for r in llm.generate([tp1.encode(p) for p in PROMPTS], params, method)]
    streamed = stream_grpc(
        server.grpc_url, [{"prompt": p, "max_tokens": MAX_TOKENS, "method": method} for p in PROMPTS]
    )
    assert [s["text"] for s in streamed] == expected
    if method == "redrafter":
        assert sum(s["num_draft_tokens"] for s in streamed) > 0


def test_a_killed_follower_fails_the_request_in_flight_and_stops_the_server(server: TritonServer) -> None:
    """Last in this module: it kills the module server's follower rank. The leader's next
    all-reduce fails at once (gloo sees the peer gone): the stream in flight gets an error
    FINAL within seconds instead of hanging, the engine reports itself down, and the
    launcher's supervision (`check_alive`, which makes `python -m triton_repo.server` tear
    everything down and exit 3) notices. Recovery is a restart of the server."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, make_inputs(PROMPTS[0], max_tokens=140, ignore_eos=True, stream=True))
    for _ in range(2):
        assert responses.get(timeout=60)[1] is None
    followers = [
        p
        for p in launched_processes(server.launch_id)
        if "runtime.tp_worker" in p.cmdline and "mpirun" not in p.cmdline
    ]
    assert len(followers) == 1, followers
    os.kill(followers[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        result, error = responses.get(timeout=30)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            break
    assert error is not None and "engine step failed" in error.message(), "the request in flight must fail"
    assert time.monotonic() - killed < 15
    client.stop_stream()
    deadline = time.monotonic() + 15
    with pytest.raises(RuntimeError):
        while time.monotonic() < deadline:
            server.check_alive()
            time.sleep(0.2)
