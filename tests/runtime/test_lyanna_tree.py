"""Lyanna's tree construction on hand-made chain logits: token-info sampling (Algorithm 1)
keeps the best nodes by joint probability with each node's own token-info bias, the
budget prune keeps a tree, re-sampling reads only the unused chain rows (Algorithm 2), and
fusion merges trees as a trie (siblings stay distinct, which exact verification needs).
The chain logits live on the test device, as the drafter's do in the engine."""

from __future__ import annotations

import torch

from runtime.proposers.lyanna import LyannaParams, resample_subtree, token_info_tree
from runtime.tree import DraftTree, children_lists, merge, prune
from tests.device import TEST_DEVICE

V = 6


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for n in range(1, len(tree.tokens)):
        path, m = [], n
        while m > 0:
            path.append(tree.tokens[m])
            m = tree.parents[m]
        out.add(tuple(reversed(path)))
    return out


def distinct_siblings(tree: DraftTree) -> bool:
    return all(len({tree.tokens[c] for c in cs}) == len(cs) for cs in children_lists(tree.parents))


def chain() -> torch.Tensor:
    # depth-1 favours 1 then 2; depth-2 favours 3 then 4 (whatever the previous token)
    return torch.tensor([[0, 5, 4, 0, 0, 0], [0, 0, 0, 5, 4, 0]], dtype=torch.float, device=TEST_DEVICE)


def test_without_bias_the_tree_is_the_joint_top() -> None:
    tree = token_info_tree(0, chain(), None, width=2, budget=10)
    assert tree.tokens[:3] == [0, 1, 2]  # depth 1, best first
    assert paths(tree) == {(1,), (2,), (1, 3), (1, 4)}  # level 2 keeps the 2 best joints
    assert distinct_siblings(tree)


def test_token_info_steers_each_node_by_its_own_token() -> None:
    def bias(prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[prev == 2, 5] += 20.0  # after token 2, token 5 is near certain
        return out

    tree = token_info_tree(0, chain(), bias, width=2, budget=10)
    assert (2, 5) in paths(tree) and (1, 5) not in paths(tree)


def test_budget_keeps_the_best_nodes_and_a_tree() -> None:
    tree = token_info_tree(0, chain(), None, width=3, budget=3)
    assert len(tree.tokens) == 4
    assert all(p < n for n, p in enumerate(tree.parents) if p >= 0)  # parents before children
    assert paths(tree) == {(1,), (2,), (1, 3)}


def test_prune_breaks_ties_towards_the_parent() -> None:
    tree = DraftTree([0, 7, 8], [-1, 0, 1])
    assert prune(tree, [0.0, -1.0, -1.0], budget=1).tokens == [0, 7]


def test_merge_is_a_trie_union() -> None:
    a = DraftTree([9, 1, 2, 3], [-1, 0, 0, 1])
    b = DraftTree([9, 1, 4, 5], [-1, 0, 1, 0])  # shares (1,), adds (1, 4) and (5,)
    merged = merge(a, b)
    assert paths(merged) == {(1,), (2,), (1, 3), (1, 4), (5,)}
    assert len(merged.tokens) == 6 and distinct_siblings(merged)
    assert all(p < n for n, p in enumerate(merged.parents) if p >= 0)


def test_resampling_reads_only_the_unused_rows() -> None:
    rows = torch.zeros(4, V, device=TEST_DEVICE)
    rows[3, 5] = 9.0  # depth 4 prefers token 5
    params = LyannaParams(depth=4, width=1, resample_budget=2)
    # 1 accepted + bonus at depth 2: rows for depths 3, 4 remain -> a 2-level chain
    sub = resample_subtree(7, rows, 1, None, params)
    assert sub is not None and sub.tokens[0] == 7 and len(sub.tokens) == 3 and sub.tokens[2] == 5
    assert resample_subtree(7, rows, 3, None, params) is None  # nothing left after the bonus
    assert resample_subtree(7, rows, 2, None, LyannaParams(depth=4, min_remaining=1)) is None
