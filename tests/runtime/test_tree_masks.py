"""Tree masks from bit sets (`runtime.tree.ancestor_mask`, `bit_rows`): every node sees
exactly itself and the chain of parents up to the root, for trees of any size (bit sets
wider than 64 bits included), and `bit_rows` unpacks bit j of each set into column j. A
chain's mask, shared by every chain of its length (`runtime.tree.chain_mask`), is the same."""

from __future__ import annotations

import random

import torch

from runtime import tree
from runtime.tree import DraftTree, ancestor_mask, bit_rows


def chain_mask(parents: list[int]) -> torch.Tensor:
    """The definition: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        j = node
        while j >= 0:
            out[node, j] = True
            j = parents[j]
    return out


def test_the_ancestor_mask_is_each_nodes_chain_to_the_root() -> None:
    rng = random.Random(0)
    for n in (1, 2, 5, 9, 17, 33, 64, 65, 130):
        for _ in range(20):
            parents = [-1] + [rng.randrange(i) for i in range(1, n)]
            assert torch.equal(ancestor_mask(parents), chain_mask(parents))
            assert torch.equal(DraftTree(list(range(n)), parents).mask, chain_mask(parents))


def test_bit_rows_puts_bit_j_in_column_j() -> None:
    rng = random.Random(1)
    for width in (1, 7, 8, 9, 63, 64, 65, 130):
        sets = [rng.getrandbits(width) for _ in range(rng.randint(1, 6))]
        rows = bit_rows(sets, width)
        assert rows.shape == (len(sets), width) and rows.dtype == torch.bool
        assert rows.tolist() == [[bool(s >> j & 1) for j in range(width)] for s in sets]


def test_a_chains_shared_mask_is_its_ancestor_mask() -> None:
    """What every chain `DraftTree` carries instead of building a mask per tree
    (`DraftTree.chain`, or built from a chain's parents, as the draft LM's sampled chains
    are): for every length, the definition's mask of a chain, one object a length (read,
    never written); a tree that is no chain still gets its own."""
    for n in range(1, 20):
        parents = list(range(-1, n - 1))
        assert torch.equal(tree.chain_mask(n), chain_mask(parents))
        assert tree.chain_mask(n) is DraftTree.chain(list(range(n))).mask is DraftTree(list(range(n)), parents).mask
    branched = [-1, 0, 0, 1]
    assert torch.equal(DraftTree([1, 2, 3, 4], branched).mask, chain_mask(branched))
