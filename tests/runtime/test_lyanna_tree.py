"""Lyanna's tree construction on hand-made chain logits: token-info sampling (Algorithm 1)
keeps the best nodes by joint probability with each node's own token-info bias, the
budget prune keeps a tree, re-sampling reads only the unused chain rows (Algorithm 2), and
fusion merges trees as a trie (siblings stay distinct, which exact verification needs).
The chain logits live on the test device, as the drafter's do in the engine."""

from __future__ import annotations

import math
import random

import torch

from runtime.proposers.lyanna import LyannaParams, resample_subtree, token_info_tree, token_info_trees
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
    # every expanded node's 2 best children enter the tree (Algorithm 1's children.add)
    assert paths(tree) == {(1,), (2,), (1, 3), (1, 4), (2, 3), (2, 4)}
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


def literal_algorithm_1(root: int, rows: list[list[float]], bias: list[list[float]], w: int, b: int) -> set:
    """The paper's Algorithm 1 transcribed line by line in plain Python (no torch, no
    shared code): per depth, for each frontier node, the top-w children of
    softmax(l_i + E'(token)) are all added to the tree; the frontier becomes the top-w of
    the added children by joint probability; at the end the B best nodes by joint
    probability are kept. Returns the kept nodes as token paths."""

    def log_softmax(x: list[float]) -> list[float]:
        m = max(x)
        z = m + math.log(sum(math.exp(v - m) for v in x))
        return [v - z for v in x]

    nodes = [((), 0.0)]  # (path of tokens below the root, joint log-prob)
    frontier = [((), 0.0, root)]
    for row in rows:
        children = []
        for path, joint, token in frontier:
            scores = log_softmax([v + e for v, e in zip(row, bias[token], strict=True)])
            for t in sorted(range(len(scores)), key=lambda t: -scores[t])[:w]:
                children.append(((*path, t), joint + scores[t], t))
        nodes += [(path, joint) for path, joint, _ in children]  # children.add(...)
        frontier = sorted(children, key=lambda c: -c[1])[:w]  # TopkByJointProb(children, w)
    drafted = sorted(nodes[1:], key=lambda n: -n[1])[:b]  # prune to the budget
    return {path for path, _ in drafted}


def frontier_only(root: int, rows: list[list[float]], bias: list[list[float]], w: int, b: int) -> set:
    """The variant we used to run: only the w frontier nodes of each depth enter the tree."""
    nodes, frontier = [], [((), 0.0, root)]
    for row in rows:
        children = []
        for path, joint, token in frontier:
            x = [v + e for v, e in zip(row, bias[token], strict=True)]
            z = max(x) + math.log(sum(math.exp(v - max(x)) for v in x))
            children += [((*path, t), joint + x[t] - z, t) for t in range(len(x))]
        frontier = sorted(children, key=lambda c: -c[1])[:w]
        nodes += [(p, j) for p, j, _ in frontier]
    return {p for p, _ in sorted(nodes, key=lambda n: -n[1])[:b]}


def test_token_info_tree_is_the_papers_algorithm_1() -> None:
    """200 random chains with random token-info biases (k=3, w=4, B=12 and the paper's
    B=16): the tree is exactly the literal transcription's; the frontier-only variant is
    not (it differs in most cases, so the comparison can fail)."""
    rng = random.Random(0)
    vocab, differs = 12, 0
    for case in range(200):
        budget = 12 if case % 2 else 16
        rows = [[rng.gauss(0, 2) for _ in range(vocab)] for _ in range(3)]
        table = [[rng.gauss(0, 1) for _ in range(vocab)] for _ in range(vocab)]
        table_t = torch.tensor(table, device=TEST_DEVICE)

        def bias(prev: torch.Tensor, logits: torch.Tensor, table_t: torch.Tensor = table_t) -> torch.Tensor:
            return logits + table_t[prev]

        root = rng.randrange(vocab)
        tree = token_info_tree(root, torch.tensor(rows, device=TEST_DEVICE), bias, width=4, budget=budget)
        want = literal_algorithm_1(root, rows, table, 4, budget)
        assert paths(tree) == want, case
        assert len(tree.tokens) == 1 + budget and distinct_siblings(tree)
        differs += frontier_only(root, rows, table, 4, budget) != want
    assert differs > 100, differs


def test_a_batch_of_trees_is_each_request_drafting_alone() -> None:
    """`token_info_trees` (one bias, log-softmax and top-k a depth for the batch) gives each
    request the tree it gets alone, node for node, under a token-info bias that steers each
    node by its own token; requests with different chains get different trees."""
    gen = torch.Generator().manual_seed(5)
    vocab, batch = 64, 6
    logits = (torch.randn(batch, 3, vocab, generator=gen) * 3).to(TEST_DEVICE)
    table = torch.randn(vocab, vocab, generator=gen).to(TEST_DEVICE)

    def bias(prev: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return rows + table[prev]

    roots = [int(t) for t in torch.randint(0, vocab, (batch,), generator=gen)]
    together = token_info_trees(roots, logits, bias, width=4, budget=12)
    for i, tree in enumerate(together):
        alone = token_info_tree(roots[i], logits[i], bias, width=4, budget=12)
        assert (tree.tokens, tree.parents) == (alone.tokens, alone.parents), i
        assert distinct_siblings(tree) and len(tree.tokens) == 13
    assert len({tuple(t.tokens) for t in together}) == batch


def test_every_size_is_the_whole_draft_cut_at_its_node_budgets() -> None:
    """Load-aware speculation's sizes (`LyannaParams.sizes`) drafted as prunes (`chains`
    off): the draft of each size, from a chain only `depth_for(size)` steps deep, is
    exactly the whole draft's nodes labelled within that size (so one verified tree tells
    what every smaller size would have accepted); a wrong label or a chain cut too short
    fails this."""
    params = LyannaParams(depth=3, width=3, budget=8, resample=False, chains=False)
    assert params.sizes == [1, 2, 3, 4, 5, 9] and params.chain_most == 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = (3 * torch.randn(2, params.depth, V, generator=gen)).to(TEST_DEVICE)
        roots = [0, 1]
        whole = token_info_trees(roots, logits, None, params.width, params.budget)
        for size in params.sizes[1:]:
            depth = params.depth_for(size)
            drafted = token_info_trees(roots, logits[:, :depth], None, params.width, size - 1)
            for tree, full in zip(drafted, whole, strict=True):
                kept = DraftTree(*_cut(full, size))
                assert paths(tree) == paths(kept) and len(tree.tokens) == size
                assert sorted(tree.node_budget) == sorted(b for b in full.node_budget if b <= size)


def _cut(tree: DraftTree, size: int) -> tuple[list[int], list[int]]:
    """`tree`'s nodes of node budget <= `size` (a tree: parents are labelled lower)."""
    keep = [n for n, b in enumerate(tree.node_budget) if b <= size]
    index = {n: i for i, n in enumerate(keep)}
    return [tree.tokens[n] for n in keep], [index.get(tree.parents[n], -1) for n in keep]


def test_the_resampled_subtree_is_worked_out_when_first_read() -> None:
    """`LyannaState.resampled`: the proposer's `on_accept` leaves Algorithm 2's re-sampling
    pending; it runs when the next step first reads it (a step of the whole size), once,
    and gives what running it at once gave; setting the state (a step that moves past the
    token) drops it unrun."""
    from runtime.proposers.lyanna import LyannaState

    rows = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = LyannaParams(depth=4, width=2, resample_budget=3)
    runs: list[int] = []

    def pending() -> DraftTree | None:
        runs.append(1)
        return resample_subtree(7, rows, 1, None, params)

    state = LyannaState(_resample=pending)
    assert not runs
    tree, again = state.resampled, state.resampled
    eager = resample_subtree(7, rows, 1, None, params)
    assert runs == [1] and tree is again and tree is not None and eager is not None
    assert (tree.tokens, tree.parents) == (eager.tokens, eager.parents)
    dropped = LyannaState(_resample=pending)
    dropped.resampled = None
    assert dropped.resampled is None and runs == [1]


def test_the_smallest_sizes_are_chains() -> None:
    """`LyannaParams.chains`: sizes of up to `depth` drafted nodes, fewer than `budget`, are
    chains (`is_chain`), cuts of each other (`LyannaProposer.cuts`) and drafted apart
    (`cost_paths`); the regular draft itself, and everything at width 1 or without
    `chains`, is as before. The prunes between the chains and the whole step are offered
    only with `prunes` (or without chains)."""
    from runtime.proposers.lyanna import LyannaProposer

    params = LyannaParams(prunes=True)  # depth 3, width 4, budget 12, re-sampling on
    assert params.sizes == [1, 2, 3, 4, 5, 9, 13, 17] and params.chain_most == 3
    assert [s for s in params.sizes if params.is_chain(s)] == [2, 3, 4]
    proposer = LyannaProposer.__new__(LyannaProposer)  # cuts and paths read only the params
    assert proposer.cuts(params) == 4
    assert proposer.cost_paths(params) == ["", "chains", "chains", "chains", "", "", "", ""]
    default = LyannaParams()  # no prunes offered: the chains, then the whole step
    assert default.sizes == [1, 2, 3, 4, 17] and proposer.cuts(default) == 4
    assert proposer.cost_paths(default) == ["", "chains", "chains", "chains", ""]
    assert LyannaParams(resample=False).sizes == [1, 2, 3, 4, 13]
    small = LyannaParams(depth=3, budget=3, resample=False)  # its regular draft stays the prune
    assert small.sizes == [1, 2, 3, 4] and small.chain_most == 2 and not small.is_chain(4)
    for plain in (LyannaParams(width=1), LyannaParams(chains=False)):
        assert plain.chain_most == 0 and proposer.cuts(plain) == plain.sizes[-1]
        assert set(proposer.cost_paths(plain)) == {""}


def test_chains_are_the_width_one_trees() -> None:
    """`token_info_chains` (the proposer's path for chains and width 1) gives the trees
    `token_info_trees` gives at width 1 pruned to each budget, node for node and label for
    label, under the engine's hot-token table and under a dense bias that steers each node
    by its own token; a chain that skipped the bias would differ (checked)."""
    from model_defs.lyanna import HotTokenTable
    from runtime.proposers.lyanna import token_info_chains
    from tests.plugins.test_token_info_top_k import table_of

    gen = torch.Generator().manual_seed(11)
    vocab, batch, depth = 64, 5, 4
    dense = torch.randn(vocab, vocab, generator=gen).to(TEST_DEVICE) * 4
    hot = HotTokenTable(*(t.to(TEST_DEVICE) for t in table_of(vocab, 16, gen)))

    def steer(prev: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return rows + dense[prev]

    skipped = 0
    for _ in range(30):
        logits = (torch.randn(batch, depth, vocab, generator=gen) * 2).to(TEST_DEVICE)
        roots = [int(t) for t in torch.randint(0, vocab, (batch,), generator=gen)]
        budgets = [int(b) for b in torch.randint(1, depth + 2, (batch,), generator=gen)]
        for bias in (hot, steer, None):
            fast = token_info_chains(roots, logits, bias, budgets)
            slow = [token_info_trees([r], logits[i : i + 1], bias, 1, b)[0]
                    for i, (r, b) in enumerate(zip(roots, budgets, strict=True))]  # fmt: skip
            for f, s in zip(fast, slow, strict=True):
                assert (f.tokens, f.parents, f.depths, f.node_budget) == (s.tokens, s.parents, s.depths, s.node_budget)
                assert torch.equal(f.mask.cpu(), s.mask.cpu())
        plain = token_info_chains(roots, logits, None, budgets)
        skipped += [t.tokens for t in plain] != [t.tokens for t in token_info_chains(roots, logits, steer, budgets)]
    assert skipped > 20, skipped
