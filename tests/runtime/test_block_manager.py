"""Block tables map a request's positions to cache slots (`block * block_size + offset`)."""

from __future__ import annotations

import pytest
import torch

from runtime.block_manager import BlockManager


def test_slots_follow_a_fragmented_table_position_by_position() -> None:
    """Two requests growing in turn get interleaved blocks; every slot range is the
    block-table formula, subranges included, and positions past the table are an error."""
    blocks = BlockManager(num_blocks=16, block_size=4)
    for n in (3, 9, 14):
        assert blocks.ensure("a", n) and blocks.ensure("b", n + 2)
    blocks.truncate("b", 6)
    assert blocks.ensure("b", 13)
    for rid in ("a", "b"):
        table = blocks.table(rid)
        every = [table[p // 4] * 4 + p % 4 for p in range(len(table) * 4)]
        for start, end in [(0, len(every)), (5, 11), (7, 7), (0, 1)]:
            slots = blocks.slots(rid, start, end)
            assert slots.dtype == torch.int64 and slots.tolist() == every[start:end]
        with pytest.raises(IndexError, match="exceed"):
            blocks.slots(rid, 0, len(every) + 1)
