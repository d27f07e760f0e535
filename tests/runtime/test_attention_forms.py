"""The two attention-metadata forms of a flat batch (`runtime/attention_batch.py`): the
CPU's padded groups (`specpipe::tree_attention`) and the GPU's per-row key lists
(`specpipe::paged_attention`) give the same forward, for prefill chunks, decode tokens,
draft trees and a drafter's level-by-level tree (mask columns over cached nodes)."""

from __future__ import annotations

import torch

from model_defs.paged_kv_cache import PagedBatch, RowMetadata
from plugins.beam_packing import pack
from runtime.attention_batch import Segment, build_groups, build_rows, group, padded, write_slots
from runtime.block_manager import BlockManager
from tests.tiny_models import tiny_target


def test_tree_rows_see_context_then_their_ancestors() -> None:
    # a tree of 4 nodes: 0 root, 1 and 2 children of 0, 3 child of 2; context 5
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree = Segment(0, 5, torch.arange(9), mask)
    chunk = Segment(4, 2, torch.arange(16, 19))  # context 2, one causal token
    rows = build_rows([tree, chunk], block_size=4)
    assert rows.row_prefix.tolist() == [5, 5, 5, 5, 3]
    assert rows.row_len.tolist() == [6, 7, 7, 8, 3]
    assert rows.row_tree[:4].tolist() == [[5, -1, -1], [5, 6, -1], [5, 7, -1], [5, 7, 8]]
    assert rows.row_request.tolist() == [0, 0, 0, 0, 1]
    assert rows.block_tables.tolist() == [[0, 1, 2], [4, 0, 0]]


def _segments(blocks: BlockManager) -> tuple[list[Segment], torch.Tensor, torch.Tensor]:
    """Prefill chunk (request a), decode token (b), packed beam tree (c), one level of a
    drafter's tree whose mask also covers its cached first level (d)."""
    gen = torch.Generator().manual_seed(0)
    packed = pack(torch.randint(0, 3, (1, 3, 3), generator=gen).index_fill_(2, torch.tensor([0]), 4))
    tree_len = int(packed.num_nodes[0])
    cases = [("a", 3, 6, None), ("b", 9, 1, None), ("c", 7, tree_len, packed.tree_mask[0, :tree_len, :tree_len])]
    level = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)  # 2 new over 4 cached
    segments, tokens, positions, start = [], [], [], 0
    for rid, context, n, mask in cases:
        assert blocks.ensure(rid, context + n)
        segments.append(Segment(start, context, blocks.slots(rid, 0, context + n), mask))
        depth = torch.arange(n) if mask is None else packed.depths[0, :n]
        positions.append(context + depth)
        start += n
    assert blocks.ensure("d", 12)
    segments.append(Segment(start, 10, blocks.slots("d", 0, 12), level))
    positions.append(torch.tensor([8, 8]))
    start += 2
    tokens = torch.randint(0, 11, (start,), generator=gen)
    return segments, tokens, torch.cat(positions)


def test_rows_and_groups_give_the_same_forward() -> None:
    model = tiny_target(5)
    blocks = BlockManager(24, 4)
    segments, tokens, positions = _segments(blocks)
    cache = model.new_kv_cache(24, 4)
    gen = torch.Generator().manual_seed(1)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))  # the cached context every row reads
    slots = write_slots(segments)
    outputs = []
    for attention in (build_groups(segments), build_rows(segments, 4)):
        snapshot = cache.kv.clone()
        with torch.no_grad():
            out = model(tokens[None], positions[None], PagedBatch(cache, slots, attention))
        outputs.append(out.logits[0])
        cache.kv.copy_(snapshot)
    assert isinstance(build_rows(segments, 4), RowMetadata)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    # a wrong row form (one context key fewer for every row) is caught
    rows = build_rows(segments, 4)
    wrong = rows._replace(row_prefix=rows.row_prefix - 1, row_len=rows.row_len - 1)
    with torch.no_grad():
        bad = model(tokens[None], positions[None], PagedBatch(cache, slots, wrong)).logits[0]
    assert (bad - outputs[0]).abs().max() > 1e-3


def test_one_segment_and_decode_groups_are_the_padded_group() -> None:
    """`group` builds one request's group, and one of decode tokens alone, with fewer host
    ops than `padded`: the same arrays, every field, for a decode token, a causal chunk
    from position 0, a packed tree, a drafter level over cached nodes, and batches of
    decode tokens of different contexts. A `_decode` that took every request's context to
    be the first's fails this."""
    blocks = BlockManager(64, 4)
    segments, _, _ = _segments(blocks)
    assert blocks.ensure("e", 5)
    fresh = Segment(0, 0, blocks.slots("e", 0, 5))  # a first prefill chunk: no context, its mask all causal
    singles = [*segments, fresh]
    decodes = []
    for i, context in enumerate((3, 11, 6, 1)):
        assert blocks.ensure(f"t{i}", context + 1)
        decodes.append(Segment(i, context, blocks.slots(f"t{i}", 0, context + 1)))
    for batch in [[s] for s in singles] + [decodes, decodes[:2], decodes[1:3]]:
        want = padded(batch)
        got = group(batch)
        for field, a, b in zip(got._fields, got, want, strict=True):
            assert torch.equal(a, torch.from_numpy(b)), (field, batch)
