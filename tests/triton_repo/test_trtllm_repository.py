"""TensorRT-LLM repository generator: every config parses with Triton's protobuf schema, the
ensemble's steps are wired consistently, the engine model is set up for ReDrafter with
in-flight batching, the launch line follows upstream's leader mode, and the tensors our
client and load tester send fit the ensemble by name, datatype and shape."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from benchmarks.loadtest import RequestSettings
from triton_repo.client import make_inputs
from triton_repo.trtllm_repository import MODELS, launch_command, main, write_trtllm_repository


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trtllm_repository(tmp_path_factory.mktemp("trtllm"), Path("/engines/redrafter"), Path("/tok"))


def parse(repo: Path, name: str) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


@pytest.mark.parametrize("name", MODELS)
def test_configs_parse_complete_and_unique(repo: Path, name: str) -> None:
    assert "${" not in (repo / name / "config.pbtxt").read_text()
    config = parse(repo, name)
    assert config.name == name
    assert config.max_batch_size == 8
    for tensors in (config.input, config.output):
        names = [t.name for t in tensors]
        assert len(names) == len(set(names))


def test_ensemble_steps_are_wired(repo: Path) -> None:
    ensemble = parse(repo, "ensemble")
    available = {i.name for i in ensemble.input}
    produced: set[str] = set()
    for step in ensemble.ensemble_scheduling.step:
        model = parse(repo, step.model_name)
        assert set(step.input_map) <= {i.name for i in model.input}, step.model_name
        assert set(step.input_map.values()) <= available, step.model_name
        assert {i.name for i in model.input if not i.optional} <= set(step.input_map), step.model_name
        assert set(step.output_map) <= {o.name for o in model.output}, step.model_name
        available |= set(step.output_map.values())
        produced |= set(step.output_map.values())
    assert {o.name for o in ensemble.output} <= produced
    assert "text_output" in {o.name for o in ensemble.output}


def test_engine_model_runs_redrafter_in_flight(repo: Path) -> None:
    config = parse(repo, "tensorrt_llm")
    assert config.backend == "tensorrtllm"
    assert config.model_transaction_policy.decoupled
    p = params(config)
    assert p["decoding_mode"] == "redrafter"
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["gpt_model_path"] == "/engines/redrafter"
    assert p["max_beam_width"] == "1"
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert p["max_tokens_in_paged_kv_cache"] == ""
    assert params(parse(repo, "preprocessing"))["tokenizer_dir"] == "/tok"


def test_python_models_come_from_upstream(repo: Path, tmp_path: Path) -> None:
    for name in ("preprocessing", "postprocessing"):
        assert "TensorRT-LLM" in (repo / name / "1" / "README.txt").read_text()
        (tmp_path / "up" / name / "1").mkdir(parents=True)
        (tmp_path / "up" / name / "1" / "model.py").write_text(f"# {name}\n")
    out = write_trtllm_repository(tmp_path / "r", Path("e"), Path("t"), upstream_models=tmp_path / "up")
    assert (out / "postprocessing" / "1" / "model.py").read_text() == "# postprocessing\n"


def test_launch_lines() -> None:
    assert launch_command(Path("/r"), 1) == [
        "/opt/tritonserver/bin/tritonserver", "--model-repository=/r",
        "--grpc-port=8001", "--http-port=8000", "--metrics-port=8002",
    ]  # fmt: skip
    cmd = launch_command(Path("/r"), 2, grpc_port=9001)
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    segments = " ".join(cmd[2:]).split(" : ")
    assert len(segments) == 2
    assert all(s.startswith("-n 1 /opt/tritonserver/bin/tritonserver --model-repository=/r") for s in segments)
    assert all("--grpc-port=9001" in s for s in segments)
    assert [s.split("shm-region-prefix-name=")[1] for s in segments] == ["prefix0_", "prefix1_"]
    assert "--load-model=tensorrt_llm" in segments[1] and "--load-model" not in segments[0]


def test_bad_settings_write_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="decoding_mode"):
        write_trtllm_repository(tmp_path / "r", Path("e"), Path("t"), decoding_mode="greedy")
    assert not (tmp_path / "r").exists()


def test_cli_writes_launch_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine-dir", "e", "--tokenizer-dir", "t", "--out", str(tmp_path / "r"), "--tp-size", "2"]
    assert main(argv) == 0
    assert "mpirun" in (tmp_path / "r" / "launch_triton.sh").read_text()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Running it needs" in capsys.readouterr().out


def _gaps(ensemble: mc.ModelConfig, inputs: list[grpcclient.InferInput]) -> set[str]:
    """Why Triton would refuse each client tensor: name, datatype, or shape (with the batch dimension)."""
    declared = {i.name: i for i in ensemble.input}
    batch = [-1] if ensemble.max_batch_size > 0 else []
    gaps = set()
    for tensor in inputs:
        name, dtype, shape = tensor.name(), tensor.datatype(), tensor.shape()
        if name not in declared:
            gaps.add(f"{name}: not an ensemble input")
            continue
        want = declared[name]
        if mc.DataType.Name(want.data_type) != "TYPE_" + ("STRING" if dtype == "BYTES" else dtype):
            gaps.add(f"{name}: {dtype} is not {mc.DataType.Name(want.data_type)}")
        dims = batch + list(want.dims)
        if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=True)):
            gaps.add(f"{name}: shape {list(shape)} does not fit {dims}")
    return gaps


def test_the_load_testers_requests_fit_the_ensemble(repo: Path) -> None:
    """`benchmarks.loadtest` reads the served model's config and sends only declared inputs,
    batched when the model batches: against the ensemble every tensor fits by name, datatype
    and shape (fixed length through `min_tokens`, no specpipe-only inputs)."""
    ensemble = parse(repo, "ensemble")
    settings = RequestSettings(
        model="ensemble", server_inputs=frozenset(i.name for i in ensemble.input), batched=ensemble.max_batch_size > 0
    )
    inputs = make_inputs("def f():", stream=True, batched=settings.batched, **settings.request_fields())
    assert {t.name() for t in inputs} == {"text_input", "stream", "max_tokens", "temperature", "min_tokens"}
    assert _gaps(ensemble, inputs) == set()


def test_client_options_fit_the_ensemble(repo: Path) -> None:
    """Sampling, end id and stop words fit too, with the seed under its current upstream name."""
    inputs = make_inputs(
        "def f():", max_tokens=8, temperature=0.7, top_k=1, top_p=0.9, seed=3, end_id=2,
        stop_words=["\n\n", "def "], seed_name="seed", batched=True,
    )  # fmt: skip
    assert _gaps(parse(repo, "ensemble"), inputs) == set()
