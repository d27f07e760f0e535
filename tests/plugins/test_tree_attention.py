"""`specpipe::tree_attention` over the paged KV cache: packed beam trees of several requests
verified in one flat forward (block-diagonal mask, one long prefill chunk riding along in
its own group) give the logits of running each beam on its own."""

from __future__ import annotations

import pytest
import torch

from plugins.beam_packing import pack, unpack
from plugins.tree_attention import tree_attention
from tests.paged import Chunk, PagedModel
from tests.tiny_models import tiny_target

TOL = 1e-4


@pytest.mark.parametrize(("width", "length", "context"), [(3, 4, 1), (4, 3, 7), (6, 5, 19), (1, 4, 5), (7, 2, 12)])
def test_packed_trees_of_a_batch_equal_per_beam_logits(width: int, length: int, context: int) -> None:
    model = tiny_target(width * 100 + length)
    gen = torch.Generator().manual_seed(context)
    batch = 2
    ctx = torch.randint(0, 11, (batch, context + 3), generator=gen)
    contexts = [context, context + 3]  # rows with different context lengths
    beams = torch.randint(0, 3, (batch, width, length), generator=gen)  # small vocab: shared prefixes
    beams[:, :, 0] = beams[:, :1, 0]  # every beam starts at the same root
    packed = pack(beams)
    paged = PagedModel(model, num_blocks=64, block_size=4)
    paged.forward([Chunk(f"r{b}", 0, ctx[b, : contexts[b]], torch.arange(contexts[b])) for b in range(batch)])
    prefill = torch.randint(0, 11, (80,), generator=gen)  # a long chunk: its own attention group
    trees = [
        Chunk(
            f"r{b}",
            contexts[b],
            packed.tokens[b, : packed.num_nodes[b]],
            contexts[b] + packed.depths[b, : packed.num_nodes[b]],
            packed.tree_mask[b, : packed.num_nodes[b], : packed.num_nodes[b]],
        )
        for b in range(batch)
    ]
    outs = paged.forward([trees[0], Chunk("long", 0, prefill, torch.arange(80)), trees[1]])
    tree_outs = [outs[0], outs[2]]
    with torch.no_grad():
        ref_long = model(prefill[None], torch.arange(80)[None]).logits[0]
        assert (outs[1].logits - ref_long).abs().max() <= TOL
        n = packed.tokens.shape[1]
        for b in range(batch):
            logits = torch.zeros(n, 11)
            logits[: packed.num_nodes[b]] = tree_outs[b].logits
            per_beam = unpack(logits[None], packed.unpack_index[b : b + 1])[0]  # [W, L, V]
            for w in range(width):
                seq = torch.cat([ctx[b, : contexts[b]], beams[b, w]])[None]
                ref = model(seq, torch.arange(seq.shape[1])[None]).logits[0, contexts[b] :]
                assert (per_beam[w] - ref).abs().max() <= TOL
    assert (packed.num_nodes < width * length).any() or width == 1


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 8, generator=gen)
    k = torch.randn(20, 2, 8, generator=gen)
    v = torch.randn(20, 2, 8, generator=gen)
    query_index = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]])
    key_slots = torch.tensor([[9, 10, 0, 1, 2, 3], [4, 5, 6, 7, 8, 0]])
    mask = torch.ones(2, 4, 6, dtype=torch.bool).tril(diagonal=2)
    torch.library.opcheck(tree_attention, (q, k, v, query_index, key_slots, mask))


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(2, 3, 8)
    k = torch.randn(4, 2, 8)
    index = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q, k, k, index, index, torch.ones(1, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[G, T, S\]"):
        tree_attention(torch.randn(2, 4, 8), k, k, index, index, torch.ones(1, 2, 3, dtype=torch.bool))
