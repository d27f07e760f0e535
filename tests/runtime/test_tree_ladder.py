"""`TreeSpec.ladder`: the trees load-aware speculation chooses among for one RSD spec, a
chain cut at every depth, then the tree widened from the root down one sibling at a
time. For rsd-c the trees are nested, and `TreeSpec.node_budgets` labels every node of a
drafted tree with the smallest tree of the ladder that holds it, so one tree measures
what every smaller one would have accepted (`SpeculationPolicy.observe`). Checked on
greedy trees of a drafter whose logits at a node depend on that node alone
(`NodeLogits`): each tree of the ladder, drafted on its own, is exactly the nodes of the
spec's whole tree its labels put within its size."""

from __future__ import annotations

import pytest

from runtime.proposers.rsd import TreeSpec, draft_rsd_trees
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from tests.device import TEST_DEVICE
from tests.runtime.test_rsd_batched_levels import NodeLogits


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        (TreeSpec("rsd-c", branching=(2, 2, 1, 1), length=4), [1, 2, 3, 4, 5, 9, 15]),
        (TreeSpec("rsd-c", branching=(3, 2, 1), length=3), [1, 2, 3, 4, 7, 10, 16]),
        (TreeSpec("rsd-s", beam_width=4, length=4), [1, 2, 3, 4, 5, 9, 13, 17]),
        (TreeSpec("sd", branching=(1, 1, 1), length=3), [1, 2, 3, 4]),
    ],
    ids=["rsd-c-2211", "rsd-c-321", "rsd-s", "sd"],
)
def test_the_ladder_is_chains_then_wider_trees_up_to_the_spec(spec: TreeSpec, sizes: list[int]) -> None:
    assert spec.sizes == sizes
    assert spec.ladder[-1] == (spec, spec.length)  # the spec's own tree last (what fixed speculation drafts)
    chains = spec.ladder[: spec.length]
    assert all(tree.max_nodes == 1 + tree.length and levels == d + 1 for d, (tree, levels) in enumerate(chains))
    assert spec.rung(1) is None and spec.rung(sizes[-1] + 5) == spec.ladder[-1]
    assert spec.rung(sizes[-2]) == spec.ladder[-2] and spec.rung(sizes[-1] - 1) == spec.ladder[-2]


def _within(tree: DraftTree, budgets: list[int], size: int) -> tuple[list[int], list[int]]:
    """Tokens and parents of the nodes of `tree` labelled within `size`, in packed order."""
    kept = [n for n, b in enumerate(budgets) if b <= size]
    index = {n: i for i, n in enumerate(kept)}
    return [tree.tokens[n] for n in kept], [index.get(tree.parents[n], -1) for n in kept]


@pytest.mark.parametrize(
    "spec",
    [TreeSpec("rsd-c", branching=(3, 2, 1), length=3), TreeSpec("rsd-c", branching=(2, 2, 1, 1), length=4)],
    ids=["321", "2211"],
)
def test_every_tree_of_the_ladder_is_the_whole_tree_cut_at_its_node_budgets(spec: TreeSpec) -> None:
    """Greedy rsd-c: the ladder's trees are nested, and the labels say exactly how. The
    labels of a tree cut by depth alone (what they were before the ladder) put nodes of
    the widened trees into the chains and fail."""
    roots, contexts = [5, 17, 40], [3, 9, 60]
    params = [SamplingParams()] * len(roots)

    def draft(tree: TreeSpec, levels: int) -> list[DraftTree]:
        gens = [p.generator(TEST_DEVICE) for p in params]
        return draft_rsd_trees(NodeLogits(contexts, roots), roots, params, gens, tree.truncated(levels))

    whole = draft(spec, spec.length)
    for tree, levels in spec.ladder:
        size = tree.level_sizes[levels]
        for got, full in zip(draft(tree, levels), whole, strict=True):
            budgets = spec.node_budgets(spec, full.parents, full.depths)
            assert _within(full, budgets, size) == (got.tokens, got.parents), (tree, levels)
            own = spec.node_budgets(tree, got.parents, got.depths)
            assert max(own) == size and _within(got, own, size) == (got.tokens, got.parents)
    by_depth = [[spec.level_sizes[d] for d in full.depths] for full in whole]
    assert any(
        _within(full, wrong, tree.level_sizes[levels]) != (got.tokens, got.parents)
        for tree, levels in spec.ladder
        for got, full, wrong in zip(draft(tree, levels), whole, by_depth, strict=True)
    )


def test_wider_beams_measure_no_smaller_tree() -> None:
    """rsd-s: a chain (one beam) is labelled by depth; wider beams keep other top beams, so
    their trees carry no labels (each width is measured on its own)."""
    spec = TreeSpec("rsd-s", beam_width=3, length=3)
    chain, wide = spec.ladder[0][0], spec.ladder[-1][0]
    assert spec.node_budgets(chain, [-1, 0, 1, 2], [0, 1, 2, 3]) == [1, 2, 3, 4]
    assert spec.node_budgets(wide, [-1, 0, 0, 1], [0, 1, 1, 2]) == []
