"""Runs one step's target forward over the paged KV cache, on every tensor-parallel rank.

`StepInput` is everything a rank needs for a step, so under tensor parallelism rank 0
(which schedules) broadcasts it and every rank runs the same forward on its shard of
the weights and of the KV cache (`runtime/tensor_parallel.py`). Accepted-path compaction
moves of the previous step ride along (`copies`) and are applied before the forward
writes anything, so blocks freed after acceptance can be reused at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from model_defs.llama import LlamaForCausalLM, LlamaOutput
from model_defs.paged_kv_cache import AttentionGroup, PagedBatch, PagedKVCache


@dataclass
class StepInput:
    tokens: torch.Tensor  # [N] new tokens of all scheduled requests, concatenated
    positions: torch.Tensor  # [N] RoPE positions
    slots: torch.Tensor  # [N] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    logits_indices: torch.Tensor  # [K] new tokens that need logits
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # (src, dst) slots to move first


class StepBroadcast(Protocol):
    """Rank 0 sends each step to the other ranks (None = shut down)."""

    def send_step(self, step: StepInput | None) -> None: ...


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, broadcast: StepBroadcast | None = None) -> None:
        self.model, self.cache, self.broadcast = model, cache, broadcast
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue a K/V move (src -> dst slots) for the start of the next step."""
        self._copies.append((src, dst))

    def discard_moves(self) -> None:
        """Forget the queued moves (their requests were failed and their blocks freed)."""
        self._copies.clear()

    def execute(self, step: StepInput) -> LlamaOutput:
        """Rank 0: send the step to the other ranks (if any) and run it here."""
        if self._copies:
            step.copies = (torch.cat([s for s, _ in self._copies]), torch.cat([d for _, d in self._copies]))
            self._copies.clear()
        if self.broadcast is not None:
            self.broadcast.send_step(step)
        return self.run(step)

    @torch.inference_mode()
    def run(self, step: StepInput) -> LlamaOutput:
        """Logits `[1, K, V]` at `logits_indices` and hidden states `[1, N, D]`."""
        if step.copies is not None:
            self.cache.copy(*step.copies)
        paged = PagedBatch(self.cache, step.slots, step.groups)
        return self.model(step.tokens[None], step.positions[None], paged, logits_indices=step.logits_indices[None])

    def shutdown(self) -> None:
        if self.broadcast is not None:
            self.broadcast.send_step(None)
