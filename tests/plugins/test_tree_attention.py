"""`specpipe::tree_attention` over the paged KV cache: packed beam trees of several requests
verified in one flat forward (block-diagonal mask, one long prefill chunk riding along in
its own group) give the logits of running each beam on its own."""

from __future__ import annotations

import pytest
import torch

from plugins.beam_packing import pack, unpack
from plugins.tree_attention import KERNEL_MAX_T, attend, kernel_applies, tree_attention, tree_attention_reference
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


def _random_groups(
    gen: torch.Generator, groups: int, t: int, s: int, heads: int, kv_heads: int, d: int
) -> tuple[torch.Tensor, ...]:
    """A launch like the engine's: requests with their own context lengths (padded to S),
    draft-tree masks over their new tokens, padding queries that see column 0 only."""
    slots = 4 * groups * s + 8
    q = torch.randn(groups * t + 3, heads, d, generator=gen)
    k = torch.randn(slots, kv_heads, d, generator=gen)
    v = torch.randn(slots, kv_heads, d, generator=gen)
    query_index = torch.randperm(q.shape[0], generator=gen)[: groups * t].view(groups, t)
    key_slots = torch.randperm(slots, generator=gen)[: groups * s].view(groups, s)
    mask = torch.zeros(groups, t, s, dtype=torch.bool)
    for g in range(groups):
        n = int(torch.randint(1, t + 1, (1,), generator=gen))  # real new tokens; the rest pad
        width = int(torch.randint(n, s + 1, (1,), generator=gen))  # context + new tokens
        tree = (torch.rand(n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
        mask[g, :n, : width - n] = True
        mask[g, :n, width - n : width] = tree
        mask[g, n:, 0] = True
    return q, k, v, query_index, key_slots, mask


@pytest.mark.parametrize(
    ("groups", "t", "s", "heads", "kv_heads", "d"),
    [(1, 1, 5, 6, 2, 64), (8, 1, 37, 6, 2, 64), (8, 6, 300, 6, 2, 64), (3, 17, 70, 4, 4, 32), (2, 64, 129, 8, 1, 128)],
)
def test_cpu_kernel_equals_the_reference(groups: int, t: int, s: int, heads: int, kv_heads: int, d: int) -> None:
    """The C++ kernel against the gather + SDPA reference, over tree masks, GQA, padding
    queries and key counts on either side of its key chunks (8 or 16 keys). A masking slip (one key a
    row must not see) moves the result by ~1e-1, far past the tolerance."""
    gen = torch.Generator().manual_seed(groups * 1000 + t * 10 + s)
    args = _random_groups(gen, groups, t, s, heads, kv_heads, d)
    assert kernel_applies(*args[:4]), "the C++ CPU kernel must build here (make setup: a compiler and ninja)"
    ref = tree_attention_reference(*args)
    out = tree_attention(*args)
    assert (out - ref).abs().max() <= 2e-6
    leaky = args[5].clone()
    leaky[0, 0] = True  # the first row sees every key of its request
    assert (tree_attention(*args[:5], leaky) - ref).abs().max() > 1e-2


def test_cpu_kernel_row_does_not_depend_on_the_rest_of_the_launch() -> None:
    """A request alone, or padded into a group beside a longer one: bitwise the same rows
    (the kernel reduces each row over its own keys in a fixed order)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, query_index, key_slots, mask = _random_groups(gen, 2, 5, 90, 6, 2, 64)
    mask[0] = False  # request 0: 35 keys of context and a 5-node tree; request 1 pads to 90
    mask[0, :, :35] = True
    tree = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    mask[0, :, 35:40] = torch.tensor(tree, dtype=torch.bool)
    together = tree_attention(q, k, v, query_index, key_slots, mask)
    alone = tree_attention(q, k, v, query_index[:1], key_slots[:1, :40], mask[:1, :, :40].contiguous())
    assert torch.equal(together[:1], alone)


def test_causal_rows_skip_the_keys_they_do_not_see() -> None:
    """A prompt chunk's causal rows (each sees the context and the chunk up to itself): a
    tile of rows stops at the last key any of them sees, which adds nothing but exact zeros.
    Every row equals the reference, and bitwise equals itself launched alone over every key
    of its request, where no key is skipped but its own mask's."""
    gen = torch.Generator().manual_seed(11)
    context, t, heads, kv_heads, d = 45, 37, 6, 2, 64
    s = context + t
    q = torch.randn(t, heads, d, generator=gen)
    k = torch.randn(s + 5, kv_heads, d, generator=gen)
    v = torch.randn(s + 5, kv_heads, d, generator=gen)
    key_slots = torch.randperm(s + 5, generator=gen)[:s].view(1, s)
    mask = torch.ones(1, t, s, dtype=torch.bool)
    mask[0, :, context:] = torch.ones(t, t, dtype=torch.bool).tril()
    query_index = torch.arange(t).view(1, t)
    out = tree_attention(q, k, v, query_index, key_slots, mask)
    assert (out - tree_attention_reference(q, k, v, query_index, key_slots, mask)).abs().max() <= 2e-6
    for row in (0, 1, 17, t - 1):
        alone = tree_attention(q, k, v, query_index[:, row : row + 1], key_slots, mask[:, row : row + 1].contiguous())
        assert torch.equal(out[:, row : row + 1], alone), row


def test_opcheck_cpu_kernel() -> None:
    gen = torch.Generator().manual_seed(1)
    args = _random_groups(gen, 3, 4, 21, 4, 2, 32)
    assert kernel_applies(*args[:4])
    torch.library.opcheck(tree_attention, args)
    torch.library.opcheck(torch.ops.specpipe_cpu.tree_attention.default, args)


def test_long_groups_and_other_dtypes_take_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, index, _, _ = _random_groups(gen, 1, KERNEL_MAX_T + 1, KERNEL_MAX_T + 10, 4, 2, 32)
    assert not kernel_applies(q, k, v, index)
    assert not kernel_applies(q.double(), k.double(), v.double(), index[:, :4])
    assert not kernel_applies(q[..., :16].contiguous(), k[..., :16].contiguous(), v[..., :16].contiguous(), index)


def test_the_layers_route_equals_the_op_and_refuses_bad_indices() -> None:
    """`attend` (what the model's layers call: the C++ op directly) gives the op's result,
    and the C++ op refuses out-of-range indices instead of reading past the cache."""
    gen = torch.Generator().manual_seed(3)
    args = _random_groups(gen, 4, 3, 50, 6, 2, 64)
    assert torch.equal(attend(*args), tree_attention(*args))
    q, k, v, query_index, key_slots, mask = args
    bad_slots = key_slots.clone()
    bad_slots[1, 3] = k.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        attend(q, k, v, query_index, bad_slots, mask)
    with pytest.raises(RuntimeError, match=r"mask \[G, T, S\]"):
        torch.ops.specpipe_cpu.tree_attention(q, k, v, query_index, key_slots, mask[:, :, :-1].contiguous())
