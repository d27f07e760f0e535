"""TensorRT-LLM repository generator: every config parses with Triton's protobuf schema, the
ensemble's steps are wired consistently, the engine model is set up for ReDrafter with
in-flight batching and sets every parameter upstream's template has and the backend reads (as
the backend would parse them), the tensors match upstream's (upstream_trtllm_keys.json, refreshed
by upstream_trtllm_keys.py), the tokenizer models produce upstream's layouts, the launch line
follows upstream's leader mode, and the tensors our client and load tester send fit the ensemble.
Slow: the whole ensemble served by the bundled tritonserver, with a Python stand-in for the C++
`tensorrtllm` backend (echo_tensorrtllm_backend/model.py)."""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from benchmarks.loadtest import RequestSettings
from tests.host_tools import skip_without_tritonserver
from triton_repo.client import make_inputs, stream_completion
from triton_repo.trtllm.tokenizer_models import (
    MULTIMODAL_INPUTS,
    Postprocessor,
    Preprocessor,
    bool_parameter,
    load_tokenizer,
)
from triton_repo.trtllm_repository import (
    DECODING_MODES,
    MODELS,
    OMITTED_ENGINE_INPUTS,
    TOKENIZER_MODELS,
    launch_command,
    main,
    write_trtllm_repository,
)

UPSTREAM = json.loads((Path(__file__).parent / "upstream_trtllm_keys.json").read_text())
"""Upstream's keys and tensors; refresh with tests/triton_repo/upstream_trtllm_keys.py (see its docstring)."""
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "models" / "demo-target"
LOGITS_TYPE = "TYPE_FP32"
"""What upstream's `${logits_datatype}` is for our engine: build.trtllm_export writes logits_dtype float32."""
ACCEPTED_VALUES = {
    "gpt_model_type": {"V1", "v1", "inflight_batching", "inflight_fused_batching"},
    "batch_scheduler_policy": {"max_utilization", "guaranteed_no_evict"},
    "decoding_mode": {"top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle"},
}
"""String parameters the backend compares with fixed values (model_instance_state.cc)."""
EMPTY_STRINGS_MEAN_UNSET = {
    "encoder_model_path": "decoder-only engine (the backend checks the path exists, else leaves it empty)",
    "gpu_device_ids": "split on ';' into no device lists: automatic",
    "participant_ids": "split on ';' into no lists: automatic",
    "lora_prefetch_dir": "read only by the LoRA cache, which an engine without the LoRA plugin does not create",
    "guided_decoding_backend": "'' = no guided decoding",
    "xgrammar_tokenizer_info_path": "'' = no guided decoding",
}
"""String parameters the backend reads as they are, for which "" is a meaningful value."""
NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_STRING": np.object_}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trtllm_repository(tmp_path_factory.mktemp("trtllm"), Path("/engines/redrafter"), Path("/tok"))


def parse(repo: Path, name: str) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def tensors(declared: Any) -> dict[str, dict[str, Any]]:
    """A config's inputs or outputs as upstream_trtllm_keys.json records them (outputs are never optional)."""
    return {
        t.name: {
            "data_type": mc.DataType.Name(t.data_type),
            "dims": list(t.dims),
            "optional": bool(getattr(t, "optional", False)),
        }
        for t in declared
    }


@pytest.mark.parametrize("name", MODELS)
def test_configs_parse_complete_and_unique(repo: Path, name: str) -> None:
    assert "${" not in (repo / name / "config.pbtxt").read_text()
    config = parse(repo, name)
    assert config.name == name
    assert config.max_batch_size == 8
    for declared in (config.input, config.output):
        names = [t.name for t in declared]
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
    assert p["tokenizer_dir"] == "/tok"
    assert p["guided_decoding_backend"] == p["xgrammar_tokenizer_info_path"] == ""
    assert params(parse(repo, "preprocessing"))["tokenizer_dir"] == "/tok"


def test_engine_model_has_every_key_upstream_has_and_the_backend_reads(repo: Path) -> None:
    """Upstream's template keys and the backend's reads, less those it reads only to warn or refuse,
    are all set; nothing else is."""
    ours = set(params(parse(repo, "tensorrt_llm")))
    not_to_set = set(UPSTREAM["not_to_set"])
    wanted = (set(UPSTREAM["models"]["tensorrt_llm"]["parameters"]) | set(UPSTREAM["backend_reads"])) - not_to_set
    missing = sorted(wanted - ours)
    assert not missing, f"tensorrt_llm.config.pbtxt.template lacks the parameters {missing} (upstream_trtllm_keys.json)"
    assert not sorted(ours - wanted), "parameters neither upstream's template has nor the backend reads"
    assert not sorted(ours & not_to_set)


def backend_parse(cpp_type: str, value: str) -> object:
    """What the backend's `GetParameter<cpp_type>` (model_state.cc) makes of `value`; ValueError
    where it throws (its callers then fall back to a default, or fail the load if unguarded)."""
    if cpp_type == "std::string":
        return value
    if cpp_type == "bool":
        if value in ("True", "true", "TRUE", "1", "False", "false", "FALSE", "0"):
            return value in ("True", "true", "TRUE", "1")
        raise ValueError(f"Cannot convert {value} to a boolean.")
    if cpp_type in ("int", "int32_t", "uint32_t", "SizeType32", "size_t"):
        return int(value)
    if cpp_type == "float":
        return float(value)
    if cpp_type == "std::vector<int32_t>":
        if not value:
            raise ValueError("Cannot convert empty string to vector of vector of ints")
        return [int(v) for v in value.split(",")]
    if cpp_type in ("executor::MedusaChoices", "executor::EagleChoices"):  # "{0, 1}, {0, 2}"
        if not value:
            raise ValueError("Cannot convert empty string to vector of vector of ints")
        return json.loads(f"[{value.replace('{', '[').replace('}', ']')}]")
    raise AssertionError(f"a backend read of type {cpp_type}: teach backend_parse how the backend parses it")


def test_engine_parameters_load_as_the_backend_reads_them(repo: Path) -> None:
    """Unguarded reads find their key; every set value parses as the backend parses it and is one
    the backend accepts; "" leaves a typed setting at its default and a string setting unset only
    where that means something (EMPTY_STRINGS_MEAN_UNSET)."""
    ours = params(parse(repo, "tensorrt_llm"))
    assert "lookahead" not in DECODING_MODES  # its three lookahead_* parameters are left empty: refused at load
    for key, read in UPSTREAM["backend_reads"].items():
        if key in UPSTREAM["not_to_set"]:
            continue
        assert key in ours or read["guarded"], f"{key}: read unguarded, so the load fails without it"
        value = ours.get(key, "")
        if value == "":
            if read["type"] == "std::string":
                assert key in EMPTY_STRINGS_MEAN_UNSET, f'{key}: "" reaches the backend as a value'
            continue
        parsed = backend_parse(read["type"], value)
        if key in ACCEPTED_VALUES:
            assert parsed in ACCEPTED_VALUES[key], f"{key}: {value!r}"


@pytest.mark.parametrize("name", ["tensorrt_llm", "preprocessing", "postprocessing"])
def test_tensors_match_upstream(repo: Path, name: str) -> None:
    """Upstream's inputs and outputs, by name, data type, dims and optionality; the engine model
    leaves out only OMITTED_ENGINE_INPUTS (and those are still upstream's)."""
    config, theirs = parse(repo, name), UPSTREAM["models"][name]
    omitted = {t for group in OMITTED_ENGINE_INPUTS.values() for t in group} if name == "tensorrt_llm" else set()
    for kind, ours in (("inputs", tensors(config.input)), ("outputs", tensors(config.output))):
        missing = sorted(set(theirs[kind]) - set(ours) - (omitted if kind == "inputs" else set()))
        assert not missing, f"{name}: upstream's {kind} {missing} are missing (upstream_trtllm_keys.json)"
        assert not sorted(set(ours) - set(theirs[kind])), f"{name}: {kind} upstream does not have"
        for tensor, spec in ours.items():
            expected = dict(theirs[kind][tensor])
            if expected["data_type"] == "${logits_datatype}":
                expected["data_type"] = LOGITS_TYPE
            assert spec == expected, f"{name} {tensor}"
    assert not sorted(omitted - set(theirs["inputs"])), "OMITTED_ENGINE_INPUTS names inputs upstream no longer has"


@pytest.mark.parametrize("name", ["preprocessing", "postprocessing"])
def test_tokenizer_models_have_upstreams_parameters(repo: Path, name: str) -> None:
    """Upstream's keys, so that its own model.py (--upstream-models) finds them too."""
    missing = sorted(set(UPSTREAM["models"][name]["parameters"]) - set(params(parse(repo, name))))
    assert not missing, f"{name}.config.pbtxt.template lacks the parameters {missing}"


def test_python_models_are_ours_unless_upstreams_are_given(repo: Path, tmp_path: Path) -> None:
    for name, cls in (("preprocessing", "TritonPreprocessing"), ("postprocessing", "TritonPostprocessing")):
        version = repo / name / "1"
        assert sorted(p.name for p in version.iterdir()) == ["model.py", "tokenizer_models.py"]
        assert (version / "tokenizer_models.py").read_text() == TOKENIZER_MODELS.read_text()
        assert f"from tokenizer_models import {cls} as TritonPythonModel" in (version / "model.py").read_text()
        (tmp_path / "up" / name / "1").mkdir(parents=True)
        (tmp_path / "up" / name / "1" / "model.py").write_text(f"# {name}\n")
    out = write_trtllm_repository(tmp_path / "r", Path("e"), Path("t"), upstream_models=tmp_path / "up")
    assert (out / "postprocessing" / "1" / "model.py").read_text() == "# postprocessing\n"
    assert not (out / "postprocessing" / "1" / "tokenizer_models.py").exists()
    with pytest.raises(ValueError, match="--upstream-models"):
        write_trtllm_repository(tmp_path / "r2", Path("e"), Path("t"), upstream_models=tmp_path / "nowhere")
    assert not (tmp_path / "r2").exists()


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
    for mode in ("greedy", "lookahead"):
        with pytest.raises(ValueError, match="decoding_mode"):
            write_trtllm_repository(tmp_path / "r", Path("e"), Path("t"), decoding_mode=mode)
    assert not (tmp_path / "r").exists()


def test_cli_writes_launch_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine-dir", "e", "--tokenizer-dir", "t", "--out", str(tmp_path / "r"), "--tp-size", "2"]
    assert main(argv) == 0
    assert "mpirun" in (tmp_path / "r" / "launch_triton.sh").read_text()
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Serving it needs" in capsys.readouterr().out


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


# The tokenizer models, as plain Python on the demo checkpoint's tokenizer.

needs_tokenizer = pytest.mark.skipif(not (TOKENIZER_DIR / "tokenizer.json").is_file(), reason="demo model not present")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer({"parameters": {"tokenizer_dir": {"string_value": str(TOKENIZER_DIR)}}})


def strings(*rows: list[str]) -> np.ndarray:
    return np.array([[s.encode() for s in row] for row in rows], dtype=object)


def check_against_config(outputs: dict[str, np.ndarray], config: mc.ModelConfig, batch: int) -> None:
    """Each output is declared, with the declared numpy dtype, rank and fixed dims (batch first)."""
    declared = {o.name: o for o in config.output}
    for name, array in outputs.items():
        spec = declared[name]
        assert array.dtype == NUMPY_TYPES[mc.DataType.Name(spec.data_type)], name
        assert array.shape[0] == batch and array.ndim == 1 + len(spec.dims), (name, array.shape)
        assert all(d in (-1, s) for d, s in zip(spec.dims, array.shape[1:], strict=True)), (name, array.shape)


@needs_tokenizer
def test_preprocessing_tokenizes_as_upstream(tokenizer: Any, repo: Path) -> None:
    """Right-padded ids with the tokenizer's special tokens, lengths, end/pad ids from the tokenizer
    unless given, a one-token decoder input, and the request's output length passed on."""
    pre = Preprocessor(tokenizer)
    queries = ["def fibonacci(n):", "x"]
    out = pre({"QUERY": strings(*([q] for q in queries)), "REQUEST_OUTPUT_LEN": np.array([[16], [8]], np.int32)})
    check_against_config(out, parse(repo, "preprocessing"), batch=2)
    ids = [tokenizer.encode(q) for q in queries]
    assert ids[0][0] == tokenizer.bos_token_id  # add_special_tokens: the BOS the engine was trained with
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(ids[0])], [len(ids[1])]]
    assert out["INPUT_ID"][0].tolist() == ids[0]
    assert out["INPUT_ID"][1].tolist() == ids[1] + [tokenizer.pad_token_id] * (len(ids[0]) - len(ids[1]))
    assert out["OUT_END_ID"].tolist() == [[tokenizer.eos_token_id]] * 2
    assert out["OUT_PAD_ID"].tolist() == [[tokenizer.pad_token_id]] * 2
    assert out["DECODER_INPUT_ID"].tolist() == out["OUT_PAD_ID"].tolist()
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1], [1]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[16], [8]]
    assert out["BAD_WORDS_IDS"].shape == out["STOP_WORDS_IDS"].shape == (2, 2, 0)
    assert out["EMBEDDING_BIAS"].shape == (2, 0)
    assert "OUT_PROMPT_TABLE_EXTRA_IDS" not in out
    given = pre(
        {
            "QUERY": strings(["a"]),
            "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32),
            "END_ID": np.array([[7]], np.int32),
            "PAD_ID": np.array([[9]], np.int32),
            "PROMPT_TABLE_EXTRA_ID": np.array([[5]], np.uint64),
        }
    )
    assert given["OUT_END_ID"].tolist() == [[7]] and given["OUT_PAD_ID"].tolist() == [[9]]
    assert given["OUT_PROMPT_TABLE_EXTRA_IDS"].tolist() == [[0] * given["INPUT_ID"].shape[1]]  # no table tokens
    no_bos = Preprocessor(tokenizer, add_special_tokens=False)(
        {"QUERY": strings(["a"]), "REQUEST_OUTPUT_LEN": given["REQUEST_OUTPUT_LEN"]}
    )
    assert no_bos["INPUT_ID"][0].tolist() == tokenizer.encode("a", add_special_tokens=False)


@needs_tokenizer
def test_word_lists_have_tensorrt_llms_layout(tokenizer: Any) -> None:
    """[batch, 2, n]: each item's words' ids end to end, then where each word ends; 0 / -1 padding."""
    pre = Preprocessor(tokenizer)
    words = pre.word_lists(strings(["\n\n", "def "], ["return", ""]), batch_size=2)
    a, b, c = (tokenizer.encode(w, add_special_tokens=False) for w in ("\n\n", "def ", "return"))
    width = len(a) + len(b)
    assert words.dtype == np.int32 and words.shape == (2, 2, width)
    assert words[0].tolist() == [a + b, [len(a), len(a) + len(b)] + [-1] * (width - 2)]
    assert words[1].tolist() == [c + [0] * (width - len(c)), [len(c)] + [-1] * (width - 1)]
    assert pre.word_lists(strings([""]), 1).tolist() == [[[0], [-1]]]


@needs_tokenizer
def test_embedding_bias_adds_each_words_weight_to_its_tokens(tokenizer: Any) -> None:
    pre = Preprocessor(tokenizer)
    words, weights = strings(["def", " return"]), np.array([[2.0, -1.5]], np.float32)
    bias = pre.embedding_bias(words, weights, 1)
    assert bias.shape == (1, len(tokenizer)) and bias.dtype == np.float32
    expected = np.zeros(len(tokenizer), np.float32)
    for word, weight in (("def", 2.0), (" return", -1.5)):
        for token in tokenizer.encode(word, add_special_tokens=False):
            expected[token] += weight
    assert np.array_equal(bias[0], expected)
    with pytest.raises(ValueError, match="EMBEDDING_BIAS_WEIGHTS"):
        pre.embedding_bias(words, np.array([[1.0]], np.float32), 1)


@needs_tokenizer
def test_preprocessing_refuses_multimodal_inputs(tokenizer: Any) -> None:
    for name in MULTIMODAL_INPUTS:
        with pytest.raises(ValueError, match=name):
            Preprocessor(tokenizer)(
                {"QUERY": strings(["a"]), "REQUEST_OUTPUT_LEN": np.ones((1, 1), np.int32), name: np.zeros(1)}
            )


@needs_tokenizer
def test_postprocessing_decodes_each_beam_to_its_length(tokenizer: Any, repo: Path) -> None:
    """TOKENS_BATCH as the backend sends it ([batch, beams, longest], -1 past each beam's end)."""
    texts = [["def f():", "x = 1"], ["import os", ""]]
    ids = [[[tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)] for t in item] for item in texts]
    longest = max(len(b) for item in ids for b in item)
    tokens = np.full((2, 2, longest), -1, np.int32)
    lengths = np.zeros((2, 2), np.int32)
    for i, item in enumerate(ids):
        for j, beam in enumerate(item):
            tokens[i, j, : len(beam)], lengths[i, j] = beam, len(beam)
    out = Postprocessor(tokenizer)({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths})
    check_against_config(out, parse(repo, "postprocessing"), batch=2)
    assert [[s.decode() for s in item] for item in out["OUTPUT"]] == texts
    kept = Postprocessor(tokenizer, skip_special_tokens=False)(
        {"TOKENS_BATCH": tokens[:1, :1], "SEQUENCE_LENGTH": lengths[:1, :1]}
    )
    assert kept["OUTPUT"][0, 0].decode() == tokenizer.decode(ids[0][0])


def test_parameters_of_the_tokenizer_models() -> None:
    def config(**values: str) -> dict[str, Any]:
        return {"parameters": {k: {"string_value": v} for k, v in values.items()}}

    assert bool_parameter(config(), "skip_special_tokens", True) is True
    assert bool_parameter(config(skip_special_tokens=""), "skip_special_tokens", False) is False
    assert bool_parameter(config(add_special_tokens="No"), "add_special_tokens", True) is False
    assert bool_parameter(config(add_special_tokens="yes"), "add_special_tokens", False) is True
    with pytest.raises(ValueError, match="add_special_tokens"):
        bool_parameter(config(add_special_tokens="maybe"), "add_special_tokens", True)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        load_tokenizer(config(tokenizer_dir=""))


# The whole repository in a real tritonserver, the engine model answered by a stand-in.


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(HTTP url, gRPC url) of the bundled tritonserver serving a generated repository. Its
    backend directory holds the Python backend (libtriton_python.so copied: Triton refuses a
    Python-based backend whose library resolves outside the directory) and `tensorrtllm/model.py`,
    echo_tensorrtllm_backend/model.py, which Triton loads for `backend: "tensorrtllm"`."""
    skip_without_tritonserver()
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip("demo model not present")
    from triton_repo.server import BACKEND_FILES, find_tritonserver, free_ports, log_tail, server_env, stop_process

    run = tmp_path_factory.mktemp("trtllm-served")
    install = find_tritonserver()
    repo = write_trtllm_repository(run / "repo", run / "engine", TOKENIZER_DIR)
    python_dir, echo_dir = run / "backends" / "python", run / "backends" / "tensorrtllm"
    python_dir.mkdir(parents=True)
    echo_dir.mkdir()
    for source in [install.backend_dir_source / "python" / n for n in BACKEND_FILES] + [install.stub]:
        if source.suffix == ".so":
            shutil.copyfile(source, python_dir / source.name)
        else:
            (python_dir / source.name).symlink_to(source)
    shutil.copyfile(Path(__file__).parent / "echo_tensorrtllm_backend" / "model.py", echo_dir / "model.py")
    http, grpc, metrics = free_ports(3)
    log = run / "tritonserver.log"
    command = [
        str(install.binary), f"--model-repository={repo}", f"--backend-directory={run / 'backends'}",
        f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}", "--exit-timeout-secs=5",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=server_env(install), start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600  # two Python stubs import transformers: ~1 min on a loaded machine
        while not _ready(f"http://127.0.0.1:{http}/v2/health/ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tritonserver did not get ready:\n{log_tail(log)}")
            time.sleep(0.5)
        yield f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
    finally:
        stop_process(proc, grace_s=10)


def _ready(url: str) -> bool:
    with (
        contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
        urllib.request.urlopen(url, timeout=2) as response,
    ):
        return bool(response.status == 200)
    return False


def _stream_text(grpc_url: str, inputs: list[grpcclient.InferInput]) -> str:
    """The ensemble's text for one request on a gRPC stream, as the demo client collects it."""
    responses: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            return stream_completion(client, responses, inputs, model="ensemble", timeout_s=120).text
        finally:
            client.stop_stream()


@pytest.mark.slow
def test_tritonserver_loads_the_repository_and_serves_text(served: tuple[str, str]) -> None:
    """All four models load (the ensemble's wiring checked by Triton itself); the tokenizer models
    answer directly, and refuse an image with an error response; text goes through the ensemble
    and back, over gRPC streaming (streamed or not) and HTTP generate (the stand-in engine echoes
    the prompt's tokens)."""
    http_url, grpc_url = served
    client = httpclient.InferenceServerClient(http_url)
    for name in MODELS:
        assert client.is_model_ready(name), name

    def tensor(name: str, array: np.ndarray, dtype: str) -> httpclient.InferInput:
        t = httpclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    output_len = tensor("REQUEST_OUTPUT_LEN", np.array([[4]], np.int32), "INT32")
    pre = client.infer("preprocessing", [tensor("QUERY", strings(["def f():"]), "BYTES"), output_len])
    ids = pre.as_numpy("INPUT_ID")
    assert pre.as_numpy("REQUEST_INPUT_LEN").tolist() == [[ids.shape[1]]]
    post = client.infer(
        "postprocessing",
        [
            tensor("TOKENS_BATCH", ids[:, None, :], "INT32"),
            tensor("SEQUENCE_LENGTH", pre.as_numpy("REQUEST_INPUT_LEN"), "INT32"),
        ],
    )
    assert post.as_numpy("OUTPUT").tolist() == [[b"def f():"]]
    image = tensor("IMAGE_URL", strings(["https://example.com/cat.png"]), "BYTES")
    with pytest.raises(InferenceServerException, match="text-only"):  # an error response; the model stays up
        client.infer("preprocessing", [tensor("QUERY", strings(["a"]), "BYTES"), output_len, image])

    prompt = "def f():\n    return 1"
    for stream in (False, True):
        inputs = make_inputs(prompt, max_tokens=4, stream=stream, stop_words=["\n\n"], seed_name="seed", batched=True)
        assert _stream_text(grpc_url, inputs) == prompt, stream
    body = json.dumps({"text_input": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/ensemble/generate", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        assert json.loads(response.read())["text_output"] == prompt
