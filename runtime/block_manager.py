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
        self._slots: dict[str, np.ndarray] = {}
        """Every slot of each request's table, in position order, kept as the table grows and
        is cut (`slots`); never written in place, so the tensors `slots` gave stay valid."""
        self._offsets = np.arange(block_size)

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
        if missing <= 0:
            return True
        new = [self._free.pop() for _ in range(missing)]
        table += new
        every = self._slots.get(request_id)
        if every is not None:
            self._slots[request_id] = np.concatenate((every, self._slots_of(new)))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past those holding positions `[0, num_tokens)`."""
        table = self._tables.get(request_id, [])
        keep = self.blocks_for(num_tokens)
        if keep >= len(table):
            return
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        if (every := self._slots.get(request_id)) is not None:
            self._slots[request_id] = every[: keep * self.block_size]

    def free(self, request_id: str) -> None:
        """Give back every block of the request (finished, cancelled or preempted)."""
        self.truncate(request_id, 0)
        self._tables.pop(request_id, None)
        self._slots.pop(request_id, None)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots `[end - start]` of the request's positions `[start, end)` (int64): a
        view of its table's slots, built in numpy when first asked and then kept up to date
        as the table grows and is cut. A step asks once per request for the target and once
        more per request for a draft LM; five small torch ops cost ~22 us a call, rebuilding
        the table's slots in numpy each time ~5-10 (a 200-token context), a view ~2."""
        every = self._slots.get(request_id)
        if every is None:
            every = self._slots[request_id] = self._slots_of(self._tables[request_id])
        if end > every.shape[0]:
            raise IndexError(f"positions up to {end} exceed the {every.shape[0]} slots of {request_id}'s blocks")
        return torch.from_numpy(every[start:end])

    def _slots_of(self, blocks: list[int]) -> np.ndarray:
        """Every slot of `blocks`, in order: `block * block_size + offset`."""
        return (np.asarray(blocks, dtype=np.int64)[:, None] * self.block_size + self._offsets).reshape(-1)
