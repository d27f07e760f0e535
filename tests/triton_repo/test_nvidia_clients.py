"""NVIDIA's genai-perf, unchanged, against specpipe under a real tritonserver: `genai-perf
profile --endpoint-type kserve --backend tensorrtllm --streaming` completes and reports time
to first token, inter-token latency and throughput. (perf_analyzer, which it drives, is also
tested alone against the serving tests' server: tests/triton_repo/test_serving.py.)

genai-perf lives in `.venv-perf` (`make perf-tools`, ~4 minutes and 1.1 GB, so not part of
`make test`'s set-up); without it the run is skipped, saying so. The run takes ~75 s (server
start included), hence `slow`; the offline tokenizer it needs is checked in the default suite."""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.engine_dir import BuildConfig, EngineConfig
from tests.demo_engines import demo_redrafter_engine
from tests.host_tools import skip_without_tritonserver
from triton_repo.nvidia_perf import genai_perf_command, hf_tokenizer_dir, tool_env, tool_problem
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_redrafter_engine(tmp_path_factory, BuildConfig(max_batch_size=8, max_input_len=128, max_seq_len=256))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    problem = tool_problem("genai-perf")
    if problem is not None:
        pytest.skip(f"NVIDIA genai-perf is not installed: {problem}")
    skip_without_tritonserver()
    with TritonServer(ServingConfig(engine_dir=engine_dir), tmp_path_factory.mktemp("triton")) as running:
        yield running


def test_the_tokenizer_for_genai_perf_loads_offline_and_matches_the_engines(engine_dir: Path, tmp_path: Path) -> None:
    """genai-perf counts tokens with `transformers.AutoTokenizer`; given a directory it loads
    without a network. Engines without a tokenizer_config.json get a minimal one."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    bare = tmp_path / "bare-engine"
    bare.mkdir()
    for name in ("config.json", EngineConfig.load(engine_dir).tokenizer):
        (bare / name).write_bytes((engine_dir / name).read_bytes())
    engine_tokenizer = Tokenizer.from_file(str(engine_dir / EngineConfig.load(engine_dir).tokenizer))
    text = "def fibonacci(n):\n    return n"
    for source in (engine_dir, bare):
        loaded = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir(source, tmp_path / source.name / "tok"))
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == engine_tokenizer.encode(text, add_special_tokens=False).ids
        assert loaded.decode(ids) == text


@pytest.mark.slow
def test_genai_perf_profiles_the_server(server: TritonServer, engine_dir: Path, tmp_path: Path) -> None:
    tokenizer = hf_tokenizer_dir(engine_dir, tmp_path / "tokenizer")  # offline: the engine's own
    command = genai_perf_command(
        server.grpc_url,
        tokenizer,
        tmp_path / "artifacts",
        request_count=6,
        warmup=1,
        concurrency=2,
        input_tokens=24,
        output_tokens=16,
    )
    proc = subprocess.run(command, env=tool_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "NVIDIA GenAI-Perf | LLM Metrics" in proc.stdout
    [report] = (tmp_path / "artifacts").glob("*/profile_export_genai_perf.csv")
    rows = {row[0]: row[1:] for row in csv.reader(report.read_text().splitlines()) if row}
    for metric in ("Time To First Token (ms)", "Inter Token Latency (ms)", "Request Latency (ms)"):
        assert float(rows[metric][0].replace(",", "")) > 0, (metric, rows[metric])
    throughput = {k: float(v[0].replace(",", "")) for k, v in rows.items() if k.endswith("Throughput (per sec)")}
    assert throughput.get("Request Throughput (per sec)", 0) > 0, rows
    count = {k: v for k, v in rows.items() if k.startswith("Request Count")}
    assert count and float(next(iter(count.values()))[0]) == 6, rows
