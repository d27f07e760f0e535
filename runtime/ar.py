"""Auto-regressive batched generation: the baseline every speculative method is compared
with, and the reference its output must equal.

    prefill (all prompts, right-padded, one forward) -> repeat: pick one token per row,
    forward that token through the KV cache -> until every row hit EOS/stop or max_tokens
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from model_defs.kv_cache import KVCache
from runtime.engine import Engine
from runtime.results import GenerationResult, stop_ids
from runtime.sampling import SamplingParams, next_token


def check_request(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    """Reject requests the engine was not built for, with the limit and the fix."""
    build = engine.config.build
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    if len(prompt) > build.max_input_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens > max_input_len {build.max_input_len}; "
            "rebuild with a larger --max-input-len"
        )
    if len(prompt) + params.max_tokens > build.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > max_seq_len {build.max_seq_len}; "
            "lower max_tokens or rebuild with a larger --max-seq-len"
        )
    vocab = engine.model.config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")


class Prefilled(NamedTuple):
    cache: KVCache  # prompts committed
    logits: torch.Tensor  # [B, V] target logits after each prompt's last token
    hidden: torch.Tensor  # [B, D] target hidden state at each prompt's last token


def prefill(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], extra_slots: int = 0) -> Prefilled:
    """Validate a batch and run its prompts (right-padded) through the target in one
    forward. The cache has room for every request's max_tokens plus `extra_slots`
    uncommitted columns (a speculative step writes a whole tree before committing)."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    if len(prompts) > engine.config.build.max_batch_size:
        raise ValueError(f"{len(prompts)} prompts > max_batch_size {engine.config.build.max_batch_size}")
    for prompt, p in zip(prompts, params, strict=True):
        check_request(engine, prompt, p)
    model, device = engine.model, engine.device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lens.max())
    cache = model.new_kv_cache(len(prompts), width + max(p.max_tokens for p in params) + extra_slots)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)  # [B, T] right-padded
    for b, prompt in enumerate(prompts):
        ids[b, : len(prompt)] = torch.tensor(prompt)
    positions = torch.arange(width, device=device).expand(len(prompts), -1)
    out = model(ids, positions, cache, logits_indices=(lens - 1)[:, None])
    cache.commit(lens)
    last_hidden = out.hidden[torch.arange(len(prompts), device=device), lens - 1]
    return Prefilled(cache, out.logits[:, 0], last_hidden)


@torch.inference_mode()
def generate_batch(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
    """Generate for up to `max_batch_size` prompts together."""
    model, device = engine.model, engine.device
    cache, logits, _ = prefill(engine, prompts, params)
    generators = [p.generator(device) for p in params]
    stops = [stop_ids(p, engine.eos_token_ids) for p in params]
    results = [GenerationResult(list(prompt), num_forwards=1) for prompt in prompts]
    while True:
        feed = []
        for b, r in enumerate(results):
            token = 0  # finished rows ride along; their cache columns are never read
            if not r.finish_reason:
                token = next_token(logits[b], params[b], generators[b])
                r.extend([token], params[b], stops[b])
            feed.append(token)
        if all(r.finish_reason for r in results):
            return results
        for r in results:
            r.num_forwards += not r.finish_reason
        tokens = torch.tensor(feed, device=device)[:, None]  # [B, 1]
        logits = model(tokens, cache.lengths[:, None], cache).logits[:, -1]
        cache.commit(torch.ones_like(cache.lengths))


def in_batches(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    run: Callable[[list[list[int]], list[SamplingParams]], list[GenerationResult]],
) -> list[GenerationResult]:
    """Apply a batch decoder to any number of prompts, `max_batch_size` at a time."""
    size = engine.config.build.max_batch_size
    results: list[GenerationResult] = []
    for i in range(0, len(prompts), size):
        results += run(prompts[i : i + size], params[i : i + size])
    return results


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
    """Generate for any number of prompts, `max_batch_size` at a time."""
    return in_batches(engine, prompts, params, lambda p, s: generate_batch(engine, p, s))
