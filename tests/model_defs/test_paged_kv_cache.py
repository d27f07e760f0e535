"""Paged KV cache: compacting an accepted tree path to consecutive positions leaves the
cache exactly as if only that path had been decoded, and freeing the rejected nodes'
blocks for reuse does not disturb it. The model and its cache are on the test device;
logits are compared on the CPU."""

from __future__ import annotations

import torch

from plugins.beam_packing import pack
from tests.device import TEST_DEVICE
from tests.paged import Chunk, PagedModel
from tests.tiny_models import tiny_target

TOL = 1e-4


def test_compacted_path_equals_decoding_only_the_path() -> None:
    model = tiny_target(3, device=TEST_DEVICE)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 11, (2, 6), generator=gen)
    beams = torch.randint(0, 3, (2, 4, 4), generator=gen)
    beams[:, :, 0] = 5
    packed = pack(beams)
    chosen_beam, keep = [2, 1], [3, 4]  # row 0 keeps root + 2 drafted tokens, row 1 the whole beam
    paged = PagedModel(model, num_blocks=16, block_size=4)
    paged.forward([Chunk(f"r{b}", 0, ctx[b], torch.arange(6)) for b in range(2)])
    paged.forward([Chunk(f"r{b}", 6, packed.tokens[b], 6 + packed.depths[b], packed.tree_mask[b]) for b in range(2)])
    used_with_trees = paged.blocks.num_used
    for b in range(2):
        path = packed.unpack_index[b, chosen_beam[b], : keep[b]]  # packed nodes along the beam
        slots = paged.blocks.slots(f"r{b}", 0, 6 + packed.tokens.shape[1])
        paged.cache.copy(slots[6 + path].to(TEST_DEVICE), slots[6 + torch.arange(keep[b])].to(TEST_DEVICE))
        paged.blocks.truncate(f"r{b}", 6 + keep[b])
    assert paged.blocks.num_used < used_with_trees, "rejected nodes' blocks are freed"
    # another request takes the freed blocks and writes into them
    paged.forward([Chunk("other", 0, torch.randint(0, 11, (12,), generator=gen), torch.arange(12))])
    nxt = [7, 8]
    outs = paged.forward(
        [Chunk(f"r{b}", 6 + keep[b], torch.tensor([nxt[b]]), torch.tensor([6 + keep[b]])) for b in range(2)]
    )
    with torch.no_grad():
        for b in range(2):
            kept = beams[b, chosen_beam[b], : keep[b]]
            seq = torch.cat([ctx[b], kept, torch.tensor([nxt[b]])])[None].to(TEST_DEVICE)
            ref = model(seq, torch.arange(seq.shape[1], device=TEST_DEVICE)[None]).logits[0, -1].cpu()
            assert (outs[b].logits[0] - ref).abs().max() <= TOL
