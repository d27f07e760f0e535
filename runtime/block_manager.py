"""KV block accounting: a free list of fixed-size cache blocks and one block table per
request. The model never sees requests, only slots (`block * block_size + offset`);
this module is the one place that maps a request's token positions to slots.

A request's table always covers its committed tokens plus whatever the current step
writes (a prefill chunk, one decode token or a whole draft tree); after acceptance the
table is cut back to the committed tokens (`truncate`), so a rejected tree branch never
holds a block past its step.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are handed out first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover positions `[0, num_tokens)`. Returns False, and
        allocates nothing, when too few blocks are free."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            return False
        for _ in range(missing):
            table.append(self._free.pop())
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past those holding positions `[0, num_tokens)`."""
        table = self._tables.get(request_id, [])
        keep = self.blocks_for(num_tokens)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]

    def free(self, request_id: str) -> None:
        """Give back every block of the request (finished, cancelled or preempted)."""
        self.truncate(request_id, 0)
        self._tables.pop(request_id, None)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots `[end - start]` of the request's positions `[start, end)` (int64).
        Built in numpy: a step asks once per request for the target and once more per
        request for a draft LM, and five small torch ops cost ~22 us a call, this ~5."""
        table = np.asarray(self._tables[request_id], dtype=np.int64)
        every = (table[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        if end > every.shape[0]:
            raise IndexError(f"positions up to {end} exceed the {every.shape[0]} slots of {request_id}'s blocks")
        return torch.from_numpy(every[start:end])
