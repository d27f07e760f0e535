"""`specpipe::tree_attention` and tree verification through the target: the logits of a
packed beam tree over a cached context equal the logits of running each beam on its own."""

from __future__ import annotations

import pytest
import torch

from plugins.beam_packing import pack, unpack
from plugins.tree_attention import tree_attention
from tests.tiny_models import tiny_target

TOL = 1e-4


@pytest.mark.parametrize(("width", "length", "context"), [(3, 4, 1), (4, 3, 7), (6, 5, 19), (1, 4, 5), (7, 2, 12)])
def test_packed_tree_logits_equal_per_beam_logits(width: int, length: int, context: int) -> None:
    model = tiny_target(width * 100 + length)
    gen = torch.Generator().manual_seed(context)
    batch = 2
    ctx = torch.randint(0, 11, (batch, context), generator=gen)
    beams = torch.randint(0, 3, (batch, width, length), generator=gen)  # small vocab: shared prefixes
    beams[:, :, 0] = beams[:, :1, 0]  # every beam starts at the same root
    packed = pack(beams)
    with torch.no_grad():
        cache = model.new_kv_cache(batch, context + width * length)
        model(ctx, torch.arange(context).expand(batch, -1), cache)
        cache.commit(torch.full((batch,), context))
        out = model(packed.tokens, context + packed.depths, cache, tree_mask=packed.tree_mask)
        per_beam = unpack(out.logits, packed.unpack_index)  # [B, W, L, V]
        for b in range(batch):
            for w in range(width):
                seq = torch.cat([ctx[b], beams[b, w]])[None]
                ref = model(seq, torch.arange(seq.shape[1])[None]).logits[0, context:]
                assert (per_beam[b, w] - ref).abs().max() <= TOL
    assert (packed.num_nodes < width * length).any() or width == 1


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k = torch.randn(2, 2, 12, 8, generator=gen)
    v = torch.randn(2, 2, 12, 8, generator=gen)
    lens = torch.tensor([3, 7])
    tree = torch.eye(5, dtype=torch.bool).expand(2, -1, -1).clone()
    tree[:, 1:, 0] = True
    for mask in (tree, None):
        torch.library.opcheck(tree_attention, (q, k, v, lens, mask))


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(1, 3, 2, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q, k, k, torch.tensor([1]), None)
