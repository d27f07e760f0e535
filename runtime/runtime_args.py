"""`RuntimeConfig` as command-line flags (generation CLI, benchmarks, servers; named like
TensorRT-LLM's executor options) and as the string parameters of a Triton model config
("" = the runtime's default)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from runtime.config import SPECULATION_MODES, RuntimeConfig
from runtime.kv_budget import KVBudget


def add_runtime_args(ap: argparse.ArgumentParser) -> None:
    defaults = RuntimeConfig()
    g = ap.add_argument_group("runtime (in-flight batching, KV cache, speculation)")
    g.add_argument("--max-batch-size", type=int, help="most running requests (default: the engine's build limit)")
    g.add_argument(
        "--max-num-tokens",
        type=int,
        default=defaults.max_num_tokens,
        help="token budget of one step: prefill chunks + draft trees (default: %(default)s)",
    )
    g.add_argument(
        "--max-tokens-in-kv-cache", type=int, help="KV cache size in tokens (default: max-batch-size full requests)"
    )
    g.add_argument(
        "--kv-cache-free-mem-fraction", type=float, help="give the KV cache this fraction of free device memory"
    )
    g.add_argument(
        "--block-size", type=int, default=defaults.block_size, help="tokens per KV block (default: %(default)s)"
    )
    g.add_argument(
        "--max-queue-size",
        type=int,
        default=defaults.max_queue_size,
        help="waiting requests beyond which new ones are refused (default: %(default)s)",
    )
    g.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default=defaults.speculation,
        help="load-aware: drafting width chosen per step from load and measured costs (down to none); "
        "fixed: always the request's width (default: %(default)s)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="target forwards whose per-token result does not depend on the batch (fixed reduction order): "
        "bf16/fp16 speculative greedy output then equals auto-regressive greedy output token for token; "
        "slower (CPU: 2.75x per 1-token bf16 forward)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run every target forward eagerly instead of replaying CUDA graphs",
    )


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        block_size=args.block_size,
        kv=KVBudget(args.max_tokens_in_kv_cache, args.kv_cache_free_mem_fraction),
        max_queue_size=args.max_queue_size,
        speculation=args.speculation,
        cuda_graphs=not args.enforce_eager,
        batch_invariant=args.batch_invariant,
    )


def runtime_parameters(config: RuntimeConfig) -> dict[str, str]:
    """The settings as strings, for config.pbtxt `parameters`; None becomes ""."""
    values = {
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "max_tokens_in_kv_cache": config.kv.max_tokens,
        "kv_cache_free_mem_fraction": config.kv.free_mem_fraction,
        "block_size": config.block_size,
        "max_queue_size": config.max_queue_size,
        "speculation": config.speculation,
        "cuda_graphs": config.cuda_graphs,
        "batch_invariant": config.batch_invariant,
    }
    return {k: "" if v is None else str(v) for k, v in values.items()}


def runtime_from_parameters(params: dict[str, str]) -> RuntimeConfig:
    """The inverse of `runtime_parameters` (missing or "" = the default)."""
    defaults = RuntimeConfig()

    def flag(value: str) -> bool:
        return value.lower() == "true"

    def get(name: str, kind: Callable[[str], Any], default: object) -> Any:
        value = params.get(name, "")
        return kind(value) if value != "" else default

    return RuntimeConfig(
        max_batch_size=get("max_batch_size", int, None),
        max_num_tokens=get("max_num_tokens", int, defaults.max_num_tokens),
        block_size=get("block_size", int, defaults.block_size),
        kv=KVBudget(get("max_tokens_in_kv_cache", int, None), get("kv_cache_free_mem_fraction", float, None)),
        max_queue_size=get("max_queue_size", int, defaults.max_queue_size),
        speculation=get("speculation", str, defaults.speculation),
        cuda_graphs=get("cuda_graphs", flag, defaults.cuda_graphs),
        batch_invariant=get("batch_invariant", flag, defaults.batch_invariant),
    )
