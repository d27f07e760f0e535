"""Write a Triton model repository that serves a TensorRT-LLM engine with Triton's
`tensorrtllm` backend (in-flight batching; ReDrafter via `decoding_mode: redrafter`).

    python -m triton_repo.trtllm_repository --engine-dir ENGINE --tokenizer-dir TOK --out REPO [--tp-size N]

gives REPO/{preprocessing,tensorrt_llm,postprocessing,ensemble}/config.pbtxt from
triton_repo/trtllm/*.config.pbtxt.template, and REPO/launch_triton.sh. Running it needs
TensorRT-LLM: a tritonserver with the tensorrtllm backend (NGC's tritonserver:<yy.mm>-trtllm-python-py3
image) and an engine built for it; nothing here runs without them.

The templates are our own, derived from the configs of the backend's `inflight_batcher_llm`
models (same tensor names and types, text-only subset), read at NVIDIA/TensorRT-LLM
triton_backend/all_models/inflight_batcher_llm/ — tensorrt_llm/ and ensemble/config.pbtxt at
2a9abd9536aa62ad3e4b9314be9286b1b1be523b, preprocessing/config.pbtxt at
08dc37e368e4718ae680bdb9be8da24ebd420a53, postprocessing/config.pbtxt at
89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0, preprocessing/1/model.py at
01259b1557671a5742aa61fa993d342b9c90dbba; the launch line follows triton_backend/scripts/
launch_triton_server.py at 0a2e2c1f1268b34586393794045691b666ba28be; parameter meanings from
triton-inference-server/tensorrtllm_backend docs/model_config.md at 0b9d7d5a195820d53abadfcf7208d0ccdbfd5332
(that repository now points to TensorRT-LLM's triton_backend/ for the models).

The preprocessing and postprocessing models' 1/model.py (tokenizer and detokenizer) are
upstream's Python code, not ours: `--upstream-models DIR` copies them from a checkout's
inflight_batcher_llm/ directory; without it each version directory gets a README.txt
saying where to get them.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from triton_repo.template import pbtxt_string, render_template

TEMPLATES = Path(__file__).resolve().parent / "trtllm"
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble")
PYTHON_MODELS = ("preprocessing", "postprocessing")
"""Models whose 1/model.py is upstream's code."""
ENGINE_MODEL = "tensorrt_llm"
"""The model ranks other than 0 load: they only run the engine's shards."""
DECODING_MODES = ("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle")
UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/tree/main/triton_backend/all_models/inflight_batcher_llm"
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


def _python_model(version_dir: Path, name: str, upstream_models: Path | None) -> None:
    """Copy upstream's model.py for `name`, or leave a README.txt that says where it comes from."""
    source = None if upstream_models is None else Path(upstream_models) / name / "1" / "model.py"
    if source is not None and source.is_file():
        shutil.copyfile(source, version_dir / "model.py")
        return
    (version_dir / "README.txt").write_text(
        f"Put TensorRT-LLM's {name}/1/model.py here: {UPSTREAM}/{name}/1/model.py\n"
        "(or regenerate with `python -m triton_repo.trtllm_repository ... --upstream-models "
        "<TensorRT-LLM>/triton_backend/all_models/inflight_batcher_llm`).\n"
    )


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
    for name, config in configs.items():
        version_dir = out_dir / name / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name / "config.pbtxt").write_text(config)
        if name in PYTHON_MODELS:
            _python_model(version_dir, name, upstream_models)
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
        "--upstream-models", type=Path, help="TensorRT-LLM's triton_backend/all_models/inflight_batcher_llm"
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
