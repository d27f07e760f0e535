"""How many KV-cache blocks an engine gets, from an explicit token budget or a fraction of
free device memory (TensorRT-LLM's `max_tokens_in_paged_kv_cache` and
`kv_cache_free_gpu_mem_fraction`; when both are given the smaller wins, as there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model_defs.paged_kv_cache import PagedKVCache
from runtime.loaded_engine import LoadedEngine


@dataclass(frozen=True)
class KVBudget:
    max_tokens: int | None = None
    """Tokens the KV cache holds (all requests together)."""
    free_mem_fraction: float | None = None
    """Fraction of the device's free memory to give the KV cache (0, 1]. With neither set,
    the cache holds max_batch_size full-length requests."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens_in_kv_cache must be >= 1, got {self.max_tokens}")
        if self.free_mem_fraction is not None and not 0 < self.free_mem_fraction <= 1:
            raise ValueError(f"kv_cache_free_mem_fraction must be in (0, 1], got {self.free_mem_fraction}")


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, or MemAvailable of this host for CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set max_tokens_in_kv_cache instead")


def kv_cache_blocks(
    engine: LoadedEngine, budget: KVBudget, block_size: int, max_batch_size: int, max_draft_tokens: int
) -> int:
    """Blocks to allocate; at least enough for one request of max_seq_len plus a full
    draft tree, so preemption can always make progress. A draft LM's cache has as many
    blocks (it shares the block tables), so its bytes count against the same budget."""
    per_token = sum(
        PagedKVCache.bytes_per_token(
            m.config.num_hidden_layers, m.num_local_kv_heads, m.config.head_dim, m.lm_head.weight.dtype
        )
        for m in (engine.model, engine.draft_model)
        if m is not None
    )
    longest = engine.config.build.max_seq_len + max_draft_tokens + 1
    limits = []
    if budget.max_tokens is not None:
        limits.append(budget.max_tokens)
    if budget.free_mem_fraction is not None:
        limits.append(int(free_memory_bytes(engine.device) * budget.free_mem_fraction) // per_token)
    need = -(-longest // block_size)
    tokens = min(limits) if limits else max_batch_size * need * block_size
    if tokens // block_size < need:
        raise ValueError(
            f"KV cache of {tokens} tokens ({tokens * per_token / 2**20:.1f} MiB) cannot hold one request of "
            f"max_seq_len {engine.config.build.max_seq_len} plus a {max_draft_tokens}-token draft tree "
            f"({need * block_size} tokens); raise the KV budget or rebuild with a smaller --max-seq-len"
        )
    return tokens // block_size
