"""Write a Triton model repository that serves a TensorRT-LLM engine with Triton's
`tensorrtllm` backend (in-flight batching; ReDrafter via `decoding_mode: redrafter`).

    python -m triton_repo.trtllm_repository --engine-dir ENGINE --tokenizer-dir TOK --out REPO [--tp-size N]

gives REPO/{preprocessing,tensorrt_llm,postprocessing,ensemble}/config.pbtxt from
triton_repo/trtllm/*.config.pbtxt.template, the preprocessing and postprocessing models' code
(1/model.py + 1/tokenizer_models.py, from triton_repo/trtllm/tokenizer_models.py) and
REPO/launch_triton.sh. Serving it needs TensorRT-LLM: a tritonserver with the tensorrtllm
backend (NGC's tritonserver:<yy.mm>-trtllm-python-py3 image) and an engine built for it. Without
them, the preprocessing and postprocessing models load and run in any tritonserver with the
Python backend (numpy and transformers installed): tests/triton_repo/test_trtllm_repository.py
serves the whole ensemble with a stand-in for the engine model.

Our templates and code follow the models of the backend's `inflight_batcher_llm`, read at
NVIDIA/TensorRT-LLM triton_backend/ (where triton-inference-server/tensorrtllm_backend now points):
- all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt and ensemble/config.pbtxt at
  2a9abd9536aa62ad3e4b9314be9286b1b1be523b: tensor names and types (inputs: a text-only subset,
  OMITTED_ENGINE_INPUTS), and every parameter key of the engine model;
- inflight_batcher_llm/src/model_instance_state.cc at c8c6df08bd0ead54cd47f7973e1e425c28a174cd and
  model_state.cc at 5cdd69218f8815d6c8c101ca1facf2ec4ac4b622: which parameters the backend reads,
  how it parses them and which it needs (gpt_model_type, tokenizer_dir, guided_decoding_backend
  and xgrammar_tokenizer_info_path are read unguarded: the load fails without them);
- preprocessing/config.pbtxt at 08dc37e368e4718ae680bdb9be8da24ebd420a53, 1/model.py at
  01259b1557671a5742aa61fa993d342b9c90dbba; postprocessing/config.pbtxt at
  89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0, 1/model.py at 2e2327b93c0a9aa9abbf4c4672f734b03c1e441f:
  the tokenizer models' interface (our tokenizer_models.py is our own code);
- the launch line follows triton_backend/scripts/launch_triton_server.py at
  0a2e2c1f1268b34586393794045691b666ba28be; parameter meanings: triton-inference-server/
  tensorrtllm_backend docs/model_config.md at 0b9d7d5a195820d53abadfcf7208d0ccdbfd5332.
tests/triton_repo/upstream_trtllm_keys.json holds upstream's key lists for the tests to diff against.

`--upstream-models DIR` puts upstream's own preprocessing/postprocessing model.py (from a
TensorRT-LLM checkout's triton_backend/all_models/inflight_batcher_llm) in place of ours, e.g.
for multimodal models.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from triton_repo.template import pbtxt_string, render_template

TEMPLATES = Path(__file__).resolve().parent / "trtllm"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble")
PYTHON_MODELS = {"preprocessing": "TritonPreprocessing", "postprocessing": "TritonPostprocessing"}
"""The Python-backend models and their class in tokenizer_models.py."""
TOKENIZER_MODELS = TEMPLATES / "tokenizer_models.py"
ENGINE_MODEL = "tensorrt_llm"
"""The model ranks other than 0 load: they only run the engine's shards."""
DECODING_MODES = ("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "eagle")
"""The backend's decoding_mode values, less lookahead: it needs the lookahead_* parameters, which
this generator leaves empty (the backend then refuses to load)."""
OMITTED_ENGINE_INPUTS = {
    "encoder and multimodal models": (
        "encoder_input_features", "encoder_output_lengths", "decoder_input_ids", "decoder_input_lengths",
        "prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size", "cross_attention_mask",
        "mrope_rotary_cos_sin", "mrope_position_deltas", "skip_cross_attn_blocks",
    ),
    "LoRA adapters (the export builds no LoRA plugin)": ("lora_task_id", "lora_weights", "lora_config"),
    "disaggregated serving": ("context_phase_params",),
    "KV-cache retention priorities (block reuse is off)": (
        "retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
        "retention_token_range_durations_ms", "retention_decode_priority", "retention_decode_duration_ms",
    ),
    "guided decoding (guided_decoding_backend is empty)": ("guided_decoding_guide_type", "guided_decoding_guide"),
    "lookahead decoding (a ReDrafter engine)": (
        "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size",
    ),
}  # fmt: skip
"""Inputs of upstream's tensorrt_llm model that ours leaves out, by the feature they serve: all
optional, for features a text-only ReDrafter engine does not have."""
TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
"""Where NGC's TensorRT-LLM Triton images install it."""


def _fields(
    engine_dir: Path,
    tokenizer_dir: Path,
    max_batch_size: int,
    decoding_mode: str,
    kv_cache_free_gpu_mem_fraction: float,
    max_tokens_in_paged_kv_cache: int | None,
) -> dict[str, object]:
    if decoding_mode not in DECODING_MODES:
        raise ValueError(f"decoding_mode {decoding_mode!r} is not one of {DECODING_MODES}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if not 0.0 < kv_cache_free_gpu_mem_fraction <= 1.0:
        raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {kv_cache_free_gpu_mem_fraction}")
    return {
        "engine_dir": pbtxt_string(str(Path(engine_dir).resolve())),
        "tokenizer_dir": pbtxt_string(str(Path(tokenizer_dir).resolve())),
        "max_batch_size": max_batch_size,
        "decoupled_mode": "true",  # clients stream (stream = true), which the backend allows only decoupled
        "batching_strategy": "inflight_fused_batching",
        "decoding_mode": decoding_mode,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "max_tokens_in_paged_kv_cache": "" if max_tokens_in_paged_kv_cache is None else max_tokens_in_paged_kv_cache,
        "enable_kv_cache_reuse": "false",
        "instance_count": 1,
    }


def _python_model_files(name: str, upstream_models: Path | None) -> dict[str, str]:
    """`name`'s version-directory files: ours (tokenizer_models.py and a model.py that picks its
    class), or upstream's model.py from `upstream_models`."""
    if upstream_models is not None:
        source = Path(upstream_models) / name / "1" / "model.py"
        if not source.is_file():
            raise ValueError(f"no {source}: --upstream-models takes TensorRT-LLM's inflight_batcher_llm directory")
        return {"model.py": source.read_text()}
    model_py = (
        f'"""Entry point of `{name}`, written by triton_repo.trtllm_repository: see tokenizer_models.py."""\n\n'
        f"from tokenizer_models import {PYTHON_MODELS[name]} as TritonPythonModel\n\n"
        '__all__ = ["TritonPythonModel"]\n'
    )
    return {"model.py": model_py, TOKENIZER_MODELS.name: TOKENIZER_MODELS.read_text()}


def launch_command(
    repo: Path, tp_size: int, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002
) -> list[str]:
    """tritonserver serving `repo`; for tp_size > 1 upstream's MPI leader mode: one rank per
    GPU, each with its own Python-backend shared-memory prefix, ranks > 0 loading only the engine."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    ports = [f"--grpc-port={grpc_port}", f"--http-port={http_port}", f"--metrics-port={metrics_port}"]
    if tp_size == 1:
        return [TRITONSERVER, f"--model-repository={repo}", *ports]
    cmd = ["mpirun", "--allow-run-as-root"]
    for rank in range(tp_size):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", TRITONSERVER, f"--model-repository={repo}", *ports]
        if rank:
            cmd += ["--model-control-mode=explicit", f"--load-model={ENGINE_MODEL}"]
        cmd += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
    return cmd


def write_trtllm_repository(
    out_dir: Path,
    engine_dir: Path,
    tokenizer_dir: Path,
    tp_size: int = 1,
    max_batch_size: int = 8,
    decoding_mode: str = "redrafter",
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    max_tokens_in_paged_kv_cache: int | None = None,
    upstream_models: Path | None = None,
) -> Path:
    """Write (or overwrite) the four models and launch_triton.sh under `out_dir`; return `out_dir`.
    Settings are checked before anything is written."""
    fields = _fields(
        engine_dir, tokenizer_dir, max_batch_size, decoding_mode, kv_cache_free_gpu_mem_fraction,
        max_tokens_in_paged_kv_cache,
    )  # fmt: skip
    out_dir = Path(out_dir)
    command = launch_command(out_dir.resolve(), tp_size)
    configs = {name: render_template(TEMPLATES / f"{name}.config.pbtxt.template", fields) for name in MODELS}
    code = {name: _python_model_files(name, upstream_models) for name in PYTHON_MODELS}
    for name, config in configs.items():
        version_dir = out_dir / name / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name / "config.pbtxt").write_text(config)
        for stale in ("model.py", TOKENIZER_MODELS.name, "README.txt"):  # from an earlier run
            (version_dir / stale).unlink(missing_ok=True)
        for file_name, text in code.get(name, {}).items():
            (version_dir / file_name).write_text(text)
    script = out_dir / "launch_triton.sh"
    script.write_text(
        f"#!/bin/sh\n# Needs TensorRT-LLM's tritonserver image; {tp_size} GPU(s).\nexec {shlex.join(command)}\n"
    )
    script.chmod(0o755)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.trtllm_repository",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engine-dir", type=Path, required=True, help="TensorRT-LLM engine directory (trtllm-build)")
    ap.add_argument("--tokenizer-dir", type=Path, required=True, help="Hugging Face tokenizer directory")
    ap.add_argument("--out", type=Path, required=True, help="model repository directory to write")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (GPUs) (default: %(default)s)")
    ap.add_argument("--max-batch-size", type=int, default=8, help="Triton max_batch_size (default: %(default)s)")
    ap.add_argument("--decoding-mode", choices=DECODING_MODES, default="redrafter", help="(default: %(default)s)")
    ap.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9, help="(default: %(default)s)")
    ap.add_argument("--max-tokens-in-paged-kv-cache", type=int, help="(default: the backend's, unbounded)")
    ap.add_argument(
        "--upstream-models",
        type=Path,
        help="use upstream's preprocessing/postprocessing model.py from this directory "
        "(TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm) instead of ours",
    )
    args = ap.parse_args(argv)
    try:
        repo = write_trtllm_repository(
            args.out, args.engine_dir, args.tokenizer_dir, args.tp_size, args.max_batch_size, args.decoding_mode,
            args.kv_cache_free_gpu_mem_fraction, args.max_tokens_in_paged_kv_cache, args.upstream_models,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {repo}; serve with TensorRT-LLM's tritonserver: {repo / 'launch_triton.sh'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
