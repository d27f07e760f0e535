"""The sizes load-aware speculation chooses among for ReDrafter (`ReDrafterProposer.sizes`):
the root alone, the one beam cut at every depth, then wider beams at full length. One beam
is greedy drafting, so its search of d drafts is its search of L drafts cut at depth d,
and `DraftTree.node_budget` labels every node with the smallest size that holds it, so
one tree measures what every smaller chain would have accepted
(`SpeculationPolicy.observe`). Checked here on a random drafter, tree for tree."""

from __future__ import annotations

import itertools

import pytest
import torch

from runtime.cuda_graphs import CapturedCalls
from runtime.proposers.redrafter import ReDrafterParams, ReDrafterProposer, draft_trees, search_trees
from tests.device import ON_CPU
from tests.runtime.test_beam_search import inputs, setup
from tests.runtime.test_tree_ladder import _within

ROOTS = [3, 8, 0, 5]


@pytest.mark.parametrize(
    ("width", "length", "sizes", "levels"),
    [
        (4, 5, [1, 2, 3, 4, 5, 6, 11, 21], [0, 1, 2, 3, 4, 5, 5, 5]),
        (3, 3, [1, 2, 3, 4, 7, 10], [0, 1, 2, 3, 3, 3]),
        (1, 2, [1, 2, 3], [0, 1, 2]),
    ],
)
def test_sizes_are_the_beam_cut_at_every_depth_then_wider_beams(
    width: int, length: int, sizes: list[int], levels: list[int]
) -> None:
    proposer, params = ReDrafterProposer.__new__(ReDrafterProposer), ReDrafterParams(width, length)
    assert proposer.sizes(params) == sizes and proposer.levels(params) == levels
    shapes = [proposer.shape(params, s) for s in sizes]
    assert shapes[0] == (0, 0) and shapes[-1] == (width, length)
    assert shapes[1 : length + 1] == [(1, d) for d in range(1, length + 1)]
    assert all(1 + w * d == s or w == 1 for (w, d), s in zip(shapes[1:], sizes[1:], strict=True))


@torch.no_grad()
def test_every_chain_is_the_longest_chain_cut_at_its_node_budgets() -> None:
    """A chain drafted d deep is exactly the nodes of the L-deep chain labelled within
    d + 1; the old labels (every node of the first beam held only by the whole beam,
    1 + L) put the deeper nodes into the short chains and fail."""
    drafter, embed = setup(vocab=9)
    h, _ = inputs(len(ROOTS), ROOTS)
    length = 4
    whole = draft_trees(drafter, embed, h, ROOTS, 1, length, with_dists=False)
    for depth in range(1, length + 1):
        for got, full in zip(draft_trees(drafter, embed, h, ROOTS, 1, depth, False), whole, strict=True):
            assert full.node_budget == [d + 1 for d in full.depths]
            assert _within(full, full.node_budget, depth + 1) == (got.tokens, got.parents)
            assert got.node_budget == list(range(1, depth + 2))
    old = [[1] + [1 + length] * (len(full.tokens) - 1) for full in whole]
    assert all(_within(full, wrong, 3)[0] != full.tokens[:3] for full, wrong in zip(whole, old, strict=True))


@torch.no_grad()
def test_one_beam_trees_are_the_packed_searches_trees() -> None:
    """One beam's trees are built from the beams alone (`DraftTree.chain`, the CPU's path): node
    for node (tokens, parents, depths, budgets, mask) the trees `search_trees` packs."""
    drafter, embed = setup(vocab=40)
    h, _ = inputs(len(ROOTS), ROOTS)
    for length in (1, 4):
        fields, masks = search_trees(drafter, embed, h, torch.tensor(ROOTS, device=h.device), 1, length)
        tokens, parents, depths, budgets, counts = fields.tolist()
        for b, tree in enumerate(draft_trees(drafter, embed, h, ROOTS, 1, length, False)):
            n = counts[b][0]
            assert n == length + 1 and tree.mask is not None and torch.equal(tree.mask, masks[b, :n, :n].cpu())
            assert (tree.tokens, tree.parents, tree.depths, tree.node_budget) == (
                tokens[b][:n], parents[b][:n], depths[b][:n], budgets[b][:n],
            )  # fmt: skip


@torch.no_grad()
def test_a_wider_tree_labels_its_first_beam_by_depth_and_the_others_by_beam() -> None:
    """Nodes of the first beam are held by the chain of their depth; a node first drawn by
    beam k > 0 by the tree of k + 1 beams (1 + (k + 1) L nodes): the labels within each
    size form the tree of that many beams (or that deep a first beam)."""
    drafter, embed = setup(vocab=9)
    h, _ = inputs(len(ROOTS), ROOTS)
    width, length = 3, 3
    for tree in draft_trees(drafter, embed, h, ROOTS, width, length, with_dists=False):
        first = [n for n, b in enumerate(tree.node_budget) if b <= length + 1]
        assert [tree.depths[n] for n in first] == list(range(length + 1))  # one chain, root to leaf
        assert all(tree.parents[b] == a for a, b in itertools.pairwise(first))
        for k in range(2, width + 1):
            held = [n for n, b in enumerate(tree.node_budget) if b <= 1 + k * length]
            assert len(held) <= 1 + k * length and all(tree.parents[n] in held for n in held[1:])
        assert max(tree.node_budget) <= 1 + width * length


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU (SPECPIPE_TEST_DEVICE=cuda)")
@torch.no_grad()
def test_captured_searches_draft_the_eager_searches_trees() -> None:
    """On a GPU the proposer replays its beam searches as CUDA graphs, the batch padded to
    a bucket (`draft_trees(graphs=...)`): every tree, for batches on and between buckets,
    every width and depth and both packings, is the eager search's, node for node; a
    replay that read the previous call's inputs (or a padding row's tree) would not be."""
    drafter, embed = setup(vocab=40)
    graphs = CapturedCalls()
    for rows, width, length in [(1, 1, 3), (3, 4, 4), (4, 4, 4), (5, 2, 3), (3, 4, 4)]:
        for packing in (True, False):
            roots = [(7 * i + rows) % 40 for i in range(rows)]
            h, _ = inputs(rows, roots)
            eager = draft_trees(drafter, embed, h, roots, width, length, False, packing)
            replayed = draft_trees(drafter, embed, h, roots, width, length, False, packing, graphs)
            for got, want in zip(replayed, eager, strict=True):
                assert (got.tokens, got.parents, got.depths, got.node_budget) == (
                    want.tokens, want.parents, want.depths, want.node_budget,
                )  # fmt: skip
                assert got.mask is not None and want.mask is not None and torch.equal(got.mask, want.mask)
    assert len(graphs.graphs) == 6  # (1 row, 3 and 4 rows padded to 4, 5 to 8) x packing; the rest replay
