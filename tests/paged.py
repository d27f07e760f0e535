"""Running the target over the paged KV cache in tests, one flat forward for several
requests, through the same metadata builders and runner the engine uses. The forward runs
on the model's device; chunks go in and outputs come back on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_defs.llama import LlamaForCausalLM, LlamaOutput
from model_defs.paged_kv_cache import PagedKVCache
from runtime.attention_batch import Segment
from runtime.block_manager import BlockManager
from runtime.model_runner import ModelRunner
from runtime.step_batch import step_input


@dataclass
class Chunk:
    """One request's new tokens in a forward."""

    request_id: str
    context_len: int
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    tree_mask: torch.Tensor | None = None  # [T, T]; None = causal


class PagedModel:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache: PagedKVCache = model.new_kv_cache(num_blocks, block_size)
        self.runner = ModelRunner(model, self.cache)
        self.device = model.lm_head.weight.device

    def forward(self, chunks: list[Chunk]) -> list[LlamaOutput]:
        """One forward over all chunks; per chunk its logits `[T, V]` and hidden `[T, D]`, on the CPU."""
        segments, start = [], 0
        for c in chunks:
            n = len(c.tokens)
            assert self.blocks.ensure(c.request_id, c.context_len + n)
            segments.append(
                Segment(start, c.context_len, self.blocks.slots(c.request_id, 0, c.context_len + n), c.tree_mask)
            )
            start += n
        tokens, positions = torch.cat([c.tokens for c in chunks]), torch.cat([c.positions for c in chunks])
        step = step_input(tokens.cpu(), positions.cpu(), segments, torch.arange(start), self.device)
        with torch.no_grad():
            out = self.runner.run(step)
        logits, hidden = out.logits.cpu(), out.hidden.cpu()
        return [
            LlamaOutput(logits[0, s.start : s.start + s.num_new], hidden[0, s.start : s.start + s.num_new])
            for s in segments
        ]
