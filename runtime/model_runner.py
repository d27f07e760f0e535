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
from model_defs.paged_kv_cache import Attention, AttentionGroup, PagedBatch, PagedKVCache, RowMetadata
from plugins.llama_forward import FusedTarget
from runtime.cuda_graphs import CudaGraphs


@dataclass
class StepInput:
    """Built on the host; the runner moves it to its device (or packs it into a CUDA graph's buffers)."""

    tokens: torch.Tensor  # [N] new tokens of all scheduled requests, concatenated
    positions: torch.Tensor  # [N] RoPE positions
    slots: torch.Tensor  # [N] cache slot each new token's K/V is written to
    attention: Attention  # which keys each new token attends to (rows on a GPU, groups on the CPU)
    logits_indices: torch.Tensor  # [K] new tokens that need logits
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # (src, dst) slots to move first

    def to(self, device: torch.device | str) -> StepInput:
        """A copy with every tensor on `device`."""
        copies = None if self.copies is None else (self.copies[0].to(device), self.copies[1].to(device))
        attention = self.attention
        if isinstance(attention, RowMetadata):
            fields = attention._asdict()
            attention = attention._replace(**{k: v.to(device) for k, v in fields.items() if k != "block_size"})
        else:
            attention = [AttentionGroup(*(t.to(device) for t in g)) for g in attention]
        return StepInput(
            self.tokens.to(device),
            self.positions.to(device),
            self.slots.to(device),
            attention,
            self.logits_indices.to(device),
            copies,
        )


class StepSender(Protocol):
    """What the runner sends each step through to the other tensor-parallel ranks (None =
    shut down); `tensor_parallel.StepBroadcaster` is the implementation."""

    def send_step(self, step: StepInput | None) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        broadcast: StepSender | None = None,
        graphs: CudaGraphs | None = None,
    ) -> None:
        self.model, self.cache, self.broadcast, self.graphs = model, cache, broadcast, graphs
        self.fused = FusedTarget.of(model)
        """The whole forward in one C++ call (fp32 on the CPU: `plugins/llama_forward.py`), or None."""
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def cost_steps(self) -> list[int]:
        """Token counts n at which a forward of n + 1 tokens costs a step more than one of n
        (what calibration times on both sides): the captured graphs' buckets on a GPU (n
        tokens replay the smallest bucket holding them), the few-row products' passes on
        the CPU (`FusedTarget.cost_steps`); none known elsewhere."""
        if self.graphs is not None:
            return list(self.graphs.buckets)
        return self.fused.cost_steps() if self.fused is not None else []

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
        return forward(self.model, self.cache, step, self.graphs, self.fused)

    def shutdown(self) -> None:
        if self.broadcast is not None:
            self.broadcast.send_step(None)


@torch.inference_mode()
def forward(
    model: LlamaForCausalLM,
    cache: PagedKVCache,
    step: StepInput,
    graphs: CudaGraphs | None = None,
    fused: FusedTarget | None = None,
) -> LlamaOutput:
    """`model`'s forward of `step` (host tensors; a draft LM's chain level may bring its
    tokens on the device: `CudaGraphs.run`) over `cache`: the replay of a captured graph
    where `graphs` covers the step, the one-call C++ forward where `fused` takes it, else
    eagerly on the cache's device. Logits `[1, K, V]` at `logits_indices`, hidden states
    `[1, N, D]`. The target's steps and the draft LM's levels
    (`runtime/proposers/level_drafters.py`) both run through here."""
    if graphs is not None and graphs.fits(step.tokens.shape[0], step.attention):
        return graphs.run(step.tokens, step.positions, step.slots, step.attention, step.logits_indices)
    if fused is not None:
        out = fused(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
        if out is not None:
            return out
    step = step.to(cache.kv.device)
    paged = PagedBatch(cache, step.slots, step.attention, fp64=model.batch_invariant)
    return model(step.tokens[None], step.positions[None], paged, logits_indices=step.logits_indices[None])
