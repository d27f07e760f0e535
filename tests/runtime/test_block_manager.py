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


def test_slots_asked_between_every_change_follow_the_table() -> None:
    """The slots kept per request (`BlockManager.slots` builds them once, then grows and cuts
    them with the table) equal the block-table formula after every grow, cut and free in
    any order, a cut block's place taken by another one included, and a tensor given
    before a change keeps the values it had."""
    import random

    rng = random.Random(0)
    blocks = BlockManager(num_blocks=24, block_size=4)
    sizes = {"a": 0, "b": 0, "c": 0}
    given: list[tuple[torch.Tensor, list[int]]] = []
    for _ in range(300):
        rid = rng.choice(list(sizes))
        op = rng.random()
        if op < 0.5 and blocks.ensure(rid, n := sizes[rid] + rng.randint(1, 9)):
            sizes[rid] = n
        elif op < 0.85:
            sizes[rid] = rng.randint(0, sizes[rid])
            blocks.truncate(rid, sizes[rid])
        else:
            blocks.free(rid)
            sizes[rid] = 0
        for r in sizes:
            table = blocks.table(r)
            every = [table[p // 4] * 4 + p % 4 for p in range(len(table) * 4)]
            if every:
                slots = blocks.slots(r, 0, len(every))
                assert slots.tolist() == every
                given.append((slots, every))
    assert all(t.tolist() == values for t, values in given)  # none changed under a later grow or cut
