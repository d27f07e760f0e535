"""Command-line flags for `RuntimeConfig`, shared by every entry point that runs an engine
(generation CLI, benchmarks, servers), named like TensorRT-LLM's executor options."""

from __future__ import annotations

import argparse

from runtime.kv_budget import KVBudget
from runtime.llm_engine import SPECULATION_MODES, RuntimeConfig


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


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        block_size=args.block_size,
        kv=KVBudget(args.max_tokens_in_kv_cache, args.kv_cache_free_mem_fraction),
        max_queue_size=args.max_queue_size,
        speculation=args.speculation,
    )
