"""KV cache: committing an accepted tree path leaves the cache exactly as if only that
path had ever been decoded (the next forward's logits match a plain causal run)."""

from __future__ import annotations

import torch

from model_defs.kv_cache import attention_mask
from plugins.beam_packing import pack
from tests.tiny_models import tiny_target

TOL = 1e-4


def test_commit_path_equals_decoding_only_the_path() -> None:
    model = tiny_target(3)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 11, (2, 6), generator=gen)
    beams = torch.randint(0, 3, (2, 4, 4), generator=gen)
    beams[:, :, 0] = 5
    packed = pack(beams)
    chosen_beam = torch.tensor([2, 1])
    keep = torch.tensor([3, 4])  # row 0 keeps root + 2 drafted tokens, row 1 the whole beam
    path = packed.unpack_index[torch.arange(2), chosen_beam]  # [B, L] packed indices along the beam
    with torch.no_grad():
        cache = model.new_kv_cache(2, 32)
        model(ctx, torch.arange(6).expand(2, -1), cache)
        cache.commit(torch.tensor([6, 6]))
        model(packed.tokens, 6 + packed.depths, cache, tree_mask=packed.tree_mask)
        cache.commit_path(path, keep)
        assert cache.lengths.tolist() == [9, 10]
        nxt = torch.tensor([[7], [8]])
        logits = model(nxt, cache.lengths[:, None], cache).logits[:, 0]
        for b in range(2):
            kept = beams[b, chosen_beam[b], : keep[b]]
            seq = torch.cat([ctx[b], kept, nxt[b]])[None]
            ref = model(seq, torch.arange(seq.shape[1])[None]).logits[0, -1]
            assert (logits[b] - ref).abs().max() <= TOL


def test_attention_mask_context_and_tree() -> None:
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    mask = attention_mask(torch.tensor([2]), 3, 6, tree)[0, 0]
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected)
