"""Packing one step's scheduled work into the flat batch of a single target forward.

Every request contributes consecutive new tokens: a prefill chunk (causal) or a draft
tree (packed order, RoPE position = context + depth, ancestor mask). Logits are computed
only where they are used: every tree node, and the last token of a chunk that completes
a fresh prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention_batch import Segment, build_attention, write_slots
from runtime.block_manager import BlockManager
from runtime.model_runner import StepInput
from runtime.request import Request
from runtime.scheduler import ScheduledWork
from runtime.tree import DraftTree


@dataclass
class Span:
    start: int
    """First new token of the request in the flat batch."""
    logits_start: int
    """First logits row of the request (-1: none)."""


@dataclass
class Batch:
    step: StepInput
    spans: list[Span]
    """One per scheduled item, in order."""
    slots: dict[str, torch.Tensor]
    """[context + num_new] slots of every request's positions (for compaction)."""


def assemble(
    work: list[ScheduledWork], trees: dict[Request, DraftTree], blocks: BlockManager, device: torch.device
) -> Batch:
    tokens: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    segments: list[Segment] = []
    spans: list[Span] = []
    slots: dict[str, torch.Tensor] = {}
    for item in work:
        request, start, context = item.request, len(tokens), item.request.num_computed
        logits_start, mask = -1, None
        if item.prefill:
            chunk = request.tokens[context : context + item.chunk]
            tokens += chunk
            positions += range(context, context + len(chunk))
            if context + len(chunk) == request.prefill_target and not request.result.output_ids:
                logits_start = len(logit_rows)
                logit_rows.append(start + len(chunk) - 1)
        else:
            tree = trees[request]
            tokens += tree.tokens
            positions += [context + d for d in tree.depths]
            logits_start = len(logit_rows)
            logit_rows += range(start, start + len(tree.tokens))
            mask = tree.mask if len(tree.tokens) > 1 else None  # a root alone: causal (`attention_batch._decode`)
        seq_slots = blocks.slots(request.request_id, 0, len(tokens) - start + context)
        slots[request.request_id] = seq_slots
        segments.append(Segment(start, context, seq_slots, mask))
        spans.append(Span(start, logits_start))
    step = step_input(
        torch.tensor(tokens),
        torch.tensor(positions),
        segments,
        torch.tensor(logit_rows, dtype=torch.long),
        device,
        blocks.block_size,
    )
    return Batch(step, spans, slots)


def step_input(
    tokens: torch.Tensor,  # [N]
    positions: torch.Tensor,  # [N]
    segments: list[Segment],
    logits_indices: torch.Tensor,  # [K]
    device: torch.device | str,
    block_size: int = 1,
) -> StepInput:
    """A forward's input, on the host: the write slots and the attention metadata (in
    the form `device`'s kernel takes) follow from the segments (`block_size`: the
    cache's, so block tables stay short; 1 fits any slots)."""
    return StepInput(
        tokens, positions, write_slots(segments), build_attention(segments, block_size, device), logits_indices
    )
