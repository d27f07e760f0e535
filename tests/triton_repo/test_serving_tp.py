"""A TP=2 engine served by Triton in leader mode (rank 0 inside the Triton model, rank 1 a
`runtime.tp_worker` started by the launcher under mpirun) streams the same greedy text as
the TP=1 engine in-process, for every method."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from build.engine import build_engine
from runtime.engine import Engine
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine, RuntimeConfig
from runtime.sampling import SamplingParams
from tests.triton_repo.streams import PROMPTS, stream_grpc
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILD = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160)
MAX_TOKENS = 20

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun not on PATH; `make setup` installs OpenMPI"
)


def engine_dir(root: Path, tp_size: int) -> Path:
    out = root / f"tp{tp_size}"
    return build_engine(MODELS / "demo-target", out, replace(BUILD, tp_size=tp_size), drafter=MODELS / "demo-redrafter")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp-engines")
    return engine_dir(root, 1), engine_dir(root, 2)


@pytest.fixture(scope="module")
def server(engines: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with TritonServer(ServingConfig(engine_dir=engines[1]), tmp_path_factory.mktemp("triton-tp")) as running:
        yield running


@pytest.mark.parametrize("method", ["ar", "redrafter"])
def test_tp2_through_triton_equals_tp1(server: TritonServer, engines: tuple[Path, Path], method: str) -> None:
    tp1 = Engine.load(engines[0])
    llm = LLMEngine(tp1, RuntimeConfig(speculation="fixed"))
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS)
    expected = [tp1.decode(r.output_ids) for r in llm.generate([tp1.encode(p) for p in PROMPTS], params, method)]
    streamed = stream_grpc(
        server.grpc_url, [{"prompt": p, "max_tokens": MAX_TOKENS, "method": method} for p in PROMPTS]
    )
    assert [s["text"] for s in streamed] == expected
    if method == "redrafter":
        assert sum(s["num_draft_tokens"] for s in streamed) > 0
