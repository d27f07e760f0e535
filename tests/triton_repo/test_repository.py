"""Model repository generator: config.pbtxt parses with Triton's own protobuf schema and
matches the model's tensor contract; settings reach model.py as parameters; bad engines
fail before anything is written. Also: the bundled tritonserver is found."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from build.engine import build_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.kv_budget import KVBudget
from runtime.runtime_args import runtime_from_parameters
from triton_repo.repository import INFER_SOURCE, MODEL_SOURCE, PROJECT_ROOT, ServingConfig, main, write_repository
from triton_repo.server import backend_directory, find_tritonserver

T = mc.DataType
INPUTS = {
    "text_input": (T.TYPE_STRING, [1]),
    "max_tokens": (T.TYPE_INT32, [1]),
    "temperature": (T.TYPE_FP32, [1]),
    "top_k": (T.TYPE_INT32, [1]),
    "top_p": (T.TYPE_FP32, [1]),
    "random_seed": (T.TYPE_UINT64, [1]),
    "stream": (T.TYPE_BOOL, [1]),
    "end_id": (T.TYPE_INT32, [1]),
    "stop_words": (T.TYPE_STRING, [-1]),
    "ignore_eos": (T.TYPE_BOOL, [1]),
    "method": (T.TYPE_STRING, [1]),
    "redrafter_beam_width": (T.TYPE_INT32, [1]),
    "redrafter_beam_length": (T.TYPE_INT32, [1]),
    "rsd_branching": (T.TYPE_INT32, [-1]),
    "cancel_request_id": (T.TYPE_STRING, [1]),
}
# Triton's TensorRT-LLM ensemble and tensorrt_llm_bls inputs (names, dtypes, dims without the
# batch dimension), from NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/
# {ensemble,tensorrt_llm_bls}/config.pbtxt, plus the older ensemble's random_seed and min_length
# and the tensorrt_llm model's draft_input_ids / draft_logits. All are declared by ours with the
# same dtype and dims, except `num_draft_tokens` (BLS input), which is specpipe's output of that
# name, and `max_tokens`, which is optional here.
TRTLLM_INPUTS = {
    "text_input": (T.TYPE_STRING, [1]),
    "decoder_text_input": (T.TYPE_STRING, [1]),
    "image_input": (T.TYPE_FP16, [-1, 3, -1, -1]),
    "image_bytes_input": (T.TYPE_UINT8, [-1, -1, -1, -1]),
    "image_url_input": (T.TYPE_STRING, [1]),
    "video_bytes_input": (T.TYPE_UINT8, [-1, -1, -1, -1]),
    "max_tokens": (T.TYPE_INT32, [1]),
    "num_return_sequences": (T.TYPE_INT32, [1]),
    "bad_words": (T.TYPE_STRING, [-1]),
    "stop_words": (T.TYPE_STRING, [-1]),
    "exclude_input_in_output": (T.TYPE_BOOL, [1]),
    "end_id": (T.TYPE_INT32, [1]),
    "pad_id": (T.TYPE_INT32, [1]),
    "top_k": (T.TYPE_INT32, [1]),
    "top_p": (T.TYPE_FP32, [1]),
    "temperature": (T.TYPE_FP32, [1]),
    "length_penalty": (T.TYPE_FP32, [1]),
    "repetition_penalty": (T.TYPE_FP32, [1]),
    "min_tokens": (T.TYPE_INT32, [1]),
    "min_length": (T.TYPE_INT32, [1]),
    "presence_penalty": (T.TYPE_FP32, [1]),
    "frequency_penalty": (T.TYPE_FP32, [1]),
    "seed": (T.TYPE_UINT64, [1]),
    "random_seed": (T.TYPE_UINT64, [1]),
    "return_log_probs": (T.TYPE_BOOL, [1]),
    "return_context_logits": (T.TYPE_BOOL, [1]),
    "return_generation_logits": (T.TYPE_BOOL, [1]),
    "return_perf_metrics": (T.TYPE_BOOL, [1]),
    "return_num_input_tokens": (T.TYPE_BOOL, [1]),
    "return_num_output_tokens": (T.TYPE_BOOL, [1]),
    "beam_width": (T.TYPE_INT32, [1]),
    "stream": (T.TYPE_BOOL, [1]),
    "prompt_embedding_table": (T.TYPE_FP16, [-1, -1]),
    "prompt_table_extra_id": (T.TYPE_UINT64, [1]),
    "prompt_vocab_size": (T.TYPE_INT32, [1]),
    "embedding_bias_words": (T.TYPE_STRING, [-1]),
    "embedding_bias_weights": (T.TYPE_FP32, [-1]),
    "use_draft_logits": (T.TYPE_BOOL, [1]),
    "draft_input_ids": (T.TYPE_INT32, [-1]),
    "draft_logits": (T.TYPE_FP32, [-1, -1]),
    "lora_task_id": (T.TYPE_UINT64, [1]),
    "lora_weights": (T.TYPE_FP16, [-1, -1]),
    "lora_config": (T.TYPE_INT32, [-1, 3]),
    "guided_decoding_guide_type": (T.TYPE_STRING, [1]),
    "guided_decoding_guide": (T.TYPE_STRING, [1]),
}
INPUTS.update(TRTLLM_INPUTS)
TRTLLM_OUTPUTS = {
    "text_output": (T.TYPE_STRING, [-1]),
    "cum_log_probs": (T.TYPE_FP32, [-1]),
    "output_log_probs": (T.TYPE_FP32, [-1, -1]),
    "context_logits": (T.TYPE_FP32, [-1, -1]),
    "generation_logits": (T.TYPE_FP32, [-1, -1, -1]),
}
OUTPUTS = {
    **TRTLLM_OUTPUTS,
    "finish_reason": (T.TYPE_STRING, [-1]),
    "num_input_tokens": (T.TYPE_INT32, [-1]),
    "num_output_tokens": (T.TYPE_INT32, [-1]),
    "num_draft_tokens": (T.TYPE_INT32, [-1]),
    "num_accepted_tokens": (T.TYPE_INT32, [-1]),
    "num_forwards": (T.TYPE_INT32, [-1]),
}


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine") / "tiny"
    return build_engine(tiny_checkpoint, out, BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=64))


def parse(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def test_config_matches_the_model_contract(engine_dir: Path, tmp_path: Path) -> None:
    model_dir = write_repository(ServingConfig(engine_dir), tmp_path / "repo")
    assert model_dir == tmp_path / "repo" / "specpipe"
    config = parse(model_dir)
    assert config.name == "specpipe"
    assert config.backend == "python"
    assert config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]
    inputs = [i.name for i in config.input]
    assert len(inputs) == len(set(inputs))
    assert {i.name: (i.data_type, list(i.dims)) for i in config.input} == INPUTS
    assert [i.name for i in config.input if not i.optional] == ["text_input"]
    outputs = [o.name for o in config.output]
    assert len(outputs) == len(set(outputs))
    assert {o.name: (o.data_type, list(o.dims)) for o in config.output} == OUTPUTS
    assert (model_dir / "1" / "model.py").read_bytes() == MODEL_SOURCE.read_bytes()
    assert not (model_dir / "1" / "model.py").is_symlink()


def test_infer_front_forwards_to_the_engine_model(engine_dir: Path, tmp_path: Path) -> None:
    """HTTP/gRPC `infer` refuse decoupled models: the repository also holds a non-decoupled
    front with the same tensors that forwards to the engine model."""
    write_repository(ServingConfig(engine_dir, model_name="code-llm", device="cuda"), tmp_path / "repo")
    front = parse(tmp_path / "repo" / "code-llm_infer")
    assert front.name == "code-llm_infer" and not front.model_transaction_policy.decoupled
    assert front.max_batch_size == 0 and front.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert params(front)["target_model"] == "code-llm"
    assert {i.name: (i.data_type, list(i.dims)) for i in front.input} == INPUTS
    assert {o.name: (o.data_type, list(o.dims)) for o in front.output} == OUTPUTS
    assert (tmp_path / "repo" / "code-llm_infer" / "1" / "model.py").read_bytes() == INFER_SOURCE.read_bytes()


def test_defaults_are_empty_and_settings_round_trip(engine_dir: Path, tmp_path: Path) -> None:
    assert params(parse(write_repository(ServingConfig(engine_dir), tmp_path / "a"))) == {
        "target_model": "",
        "project_root": str(PROJECT_ROOT),
        "engine_dir": str(engine_dir.resolve()),
        "device": "cpu",
        "max_batch_size": "",
        "max_num_tokens": "512",
        "max_tokens_in_kv_cache": "",
        "kv_cache_free_mem_fraction": "",
        "block_size": "16",
        "max_queue_size": "256",
        "speculation": "load-aware",
        "cuda_graphs": "True",
        "batch_invariant": "False",
        "tp_master": "",
        "stall_timeout_s": "120.0",
        "torch_threads": "0",
        "stream_interval_ms": "20.0",
    }
    runtime = RuntimeConfig(
        max_batch_size=4,
        max_num_tokens=256,
        kv=KVBudget(max_tokens=4096, free_mem_fraction=0.5),
        block_size=8,
        max_queue_size=10,
        speculation="fixed",
    )
    cfg = ServingConfig(engine_dir, model_name="code-llm", device="cuda", runtime=runtime, tp_master="127.0.0.1:29500")
    config = parse(write_repository(cfg, tmp_path / "b"))
    assert config.name == "code-llm"
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_MODEL
    assert params(config) == {"target_model": "", **cfg.parameters()}
    assert params(config)["kv_cache_free_mem_fraction"] == "0.5"
    assert runtime_from_parameters(params(config)) == runtime  # what the served model reads back


def test_paths_needing_escapes_round_trip(engine_dir: Path, tmp_path: Path) -> None:
    odd = tmp_path / 'dir "quoted" \\ back'
    engine_dir.rename(odd)
    try:
        config = parse(write_repository(ServingConfig(odd), tmp_path / "repo"))
        assert params(config)["engine_dir"] == str(odd)
    finally:
        odd.rename(engine_dir)


def test_cli_uses_the_runtime_flags(engine_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", str(engine_dir), "--out", str(tmp_path), "--max-batch-size", "3", "--speculation", "fixed"]
    assert main(argv) == 0
    got = params(parse(tmp_path / "specpipe"))
    assert (got["max_batch_size"], got["speculation"]) == ("3", "fixed")


def test_missing_engine_dir_fails_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="not an engine directory"):
        write_repository(ServingConfig(tmp_path / "nope"), tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert main(["--engine", str(tmp_path / "nope"), "--out", str(tmp_path / "repo")]) == 2
    assert "not an engine directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("device", "tpu", "device 'tpu'"),
        ("model_name", "a/b", "model name"),
        ("torch_threads", -1, "torch threads"),
        ("stream_interval_ms", -1.0, "stream interval"),
        ("stream_interval_ms", float("nan"), "stream interval"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ServingConfig(tmp_path, **{field: value})  # type: ignore[arg-type]


def test_finds_tritonserver_and_the_stub_for_this_python(tmp_path: Path) -> None:
    install = find_tritonserver()
    assert install.binary.is_file()
    assert install.stub.is_file()
    if not install.stub_in_place:  # the wheel: stubs per Python version, linked into a backend dir of ours
        assert install.stub.parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"
    python_dir = backend_directory(install, tmp_path) / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        assert (python_dir / name).is_file(), name


def test_parameter_keys_are_unique(engine_dir: Path, tmp_path: Path) -> None:
    """Protobuf text format keeps the last of repeated map keys silently: check the text."""
    text = (write_repository(ServingConfig(engine_dir), tmp_path / "repo") / "config.pbtxt").read_text()
    keys = re.findall(r'parameters \{ key: "([^"]+)"', text)
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
