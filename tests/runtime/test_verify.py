"""Acceptance rules on hand-made trees: greedy walks the argmax path; recursive
rejection sampling over point-mass candidates emits exactly the target's distribution.

The toy target is a Markov chain over V=4 tokens (next-token logits depend only on the
current token), so the exact law of the first two emitted tokens is Q[r, x1] * Q[x1, x2].
Logits and generators live on the test device; counts and laws are compared on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime import verify
from runtime.sampling import SamplingParams, sample, target_probs
from runtime.tree import DraftTree, children_lists
from runtime.verify import (
    Acceptance,
    _tree_laws,
    _walk_tree,
    accept_greedy,
    accept_sampled_batch,
    acceptance,
    host_acceptance,
    rejection_step,
    residual,
)
from tests.device import ON_CPU, TEST_DEVICE
from tests.plugins.test_chain_verify import batch as chain_batch
from tests.stats import passes_chi_square

V = 4
# Markov target: row t = logits of the token after t
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.3], [0.1, 1.2, 0.0, -1.0], [-0.3, 0.4, 0.9, 0.2], [0.5, -0.2, 0.1, 1.1]])
# Packed tree, root token 0: children of the root are 2, 0, 1 (drafter order), then
# node 1 (token 2) has children 3 and 2, node 2 (token 0) has child 1.
TOKENS = [0, 2, 0, 1, 3, 2, 1]
PARENTS = [-1, 0, 0, 0, 1, 1, 2]
TREE = DraftTree(TOKENS, PARENTS)


def node_logits() -> torch.Tensor:
    return LOGITS[torch.tensor(TOKENS)].to(TEST_DEVICE)  # [N, V]


def test_children_lists_keep_packed_order() -> None:
    assert children_lists(PARENTS) == [[1, 2, 3], [4, 5], [6], [], [], [], []]


def test_greedy_follows_argmax_path() -> None:
    logits = node_logits()
    # argmax after 0 is 0 -> node 2 (token 0); argmax after 0 again is 0, node 2 has only
    # child token 1 -> stop with bonus 0.
    acc = accept_greedy(TREE, logits)
    assert acc.path == [0, 2] and acc.tokens == [0, 0]
    # make the root prefer token 2 and token 2 prefer token 2: path root -> node1 -> node5
    logits = logits.clone()
    logits[0] = torch.tensor([0.0, 0.0, 5.0, 0.0])
    logits[1] = torch.tensor([0.0, 0.0, 5.0, 0.0])
    logits[5] = torch.tensor([0.0, 5.0, 0.0, 0.0])  # leaf: bonus is its argmax
    acc = accept_greedy(TREE, logits)
    assert acc.path == [0, 1, 5] and acc.tokens == [2, 2, 1]
    # a root alone (an auto-regressive step): its argmax, with or without the caller's
    root = DraftTree([3], [-1])
    assert accept_greedy(root, logits[1:2]) == accept_greedy(root, logits[1:2], [2]) == Acceptance([0], [2])


def accept_without_residual(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> Acceptance:
    """A plausible bug: try each child with probability q(x) but never update the
    residual after a rejection (and draw the bonus from q itself)."""
    tokens, children = tree.tokens, children_lists(tree.parents)
    node, path, out = 0, [0], []
    while True:
        q = target_probs(logits[node], params)
        for child in children[node]:
            if torch.rand((), generator=gen, device=gen.device) < q[tokens[child]]:
                path.append(child)
                out.append(tokens[child])
                node = child
                break
        else:
            return Acceptance(path, [*out, int(torch.multinomial(q, 1, generator=gen))])


def first_two(params: SamplingParams, trials: int, seed: int, rule=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Counts of the first two emitted tokens; when a step emits only one, the next
    token comes from the target itself (what the next step's root would produce). The
    production rule verifies every trial's tree in one batched call, each tree with its
    own generator (as requests have); `rule` replaces it with a one-tree rule."""
    gen = torch.Generator(TEST_DEVICE).manual_seed(seed)
    logits, markov = node_logits(), LOGITS.to(TEST_DEVICE)
    if rule is None:
        gens = [torch.Generator(TEST_DEVICE).manual_seed(seed * trials + i) for i in range(trials)]
        outs = [acc.tokens for acc in accept_sampled_batch([TREE] * trials, [logits] * trials, [params] * trials, gens)]
    else:
        outs = [rule(TREE, logits, params, gen).tokens for _ in range(trials)]
    counts = torch.zeros(V, V)
    for out in outs:
        if len(out) == 1:
            out.append(int(torch.multinomial(target_probs(markov[out[0]], params), 1, generator=gen)))
        counts[out[0], out[1]] += 1
    return counts


def exact_first_two(params: SamplingParams) -> torch.Tensor:
    q = target_probs(LOGITS, params)  # [V, V] row = distribution after that token
    return q[TOKENS[0]][:, None] * q  # P(x1, x2) = Q[root, x1] Q[x1, x2]


def test_sampled_acceptance_is_exact() -> None:
    for params, seed in [(SamplingParams(temperature=1.0), 0), (SamplingParams(temperature=0.7, top_k=3), 1)]:
        assert passes_chi_square(first_two(params, trials=12000, seed=seed), exact_first_two(params))


def test_the_chi_square_test_has_power() -> None:
    """The same test, same sample size, rejects a rule that forgets the residual."""
    params = SamplingParams(temperature=1.0)
    counts = first_two(params, trials=12000, seed=0, rule=accept_without_residual)
    assert not passes_chi_square(counts, exact_first_two(params))


def test_a_root_alone_draws_its_bonus_from_the_target_and_ignores_its_batch() -> None:
    """Auto-regressive steps (a root alone) skip the walk: their token follows q at the
    root (chi-square), and a batch mixing them with trees gives every request what it gets
    verified alone with the same generator state (the walk's draws are untouched)."""
    params = SamplingParams(temperature=0.8)
    root, q = DraftTree([0], [-1]), target_probs(LOGITS[0], params)
    logits, root_logits = node_logits(), LOGITS[:1].to(TEST_DEVICE)
    trials = 8000
    gens = [torch.Generator(TEST_DEVICE).manual_seed(i) for i in range(trials)]
    counts = torch.zeros(V)
    for acc in accept_sampled_batch([root] * trials, [root_logits] * trials, [params] * trials, gens):
        assert acc.path == [0]
        counts[acc.tokens[0]] += 1
    assert passes_chi_square(counts, q)

    trees, rows = [root, TREE, root, TREE], [root_logits, logits, root_logits, logits]

    def gens_() -> list[torch.Generator]:
        return [torch.Generator(TEST_DEVICE).manual_seed(100 + i) for i in range(len(trees))]

    mixed = accept_sampled_batch(trees, rows, [params] * len(trees), gens_())
    alone = [accept_sampled_batch([t], [r], [params], [g])[0] for t, r, g in zip(trees, rows, gens_(), strict=True)]
    assert mixed == alone


def test_the_batched_bonus_is_what_sample_draws_tree_by_tree() -> None:
    """The bonus tokens of a batch are one inverse CDF over every tree's final law; each
    must be the token `sample` draws from that law with the request's generator right
    after its walk, bit for bit: on the toy trees mixed with roots alone, and on
    full-vocabulary roots (8192 tokens, where fp64 cumulative sums of another length or
    order would move draws)."""
    params = SamplingParams(temperature=0.9)
    root = DraftTree([0], [-1])
    wide = list(torch.randn(5, 1, 8192, generator=torch.Generator().manual_seed(7)).to(TEST_DEVICE))
    toy = [node_logits(), LOGITS[:1].to(TEST_DEVICE), node_logits(), LOGITS[2:3].to(TEST_DEVICE), node_logits()]
    for trees, rows in [([TREE, root, TREE, root, TREE], toy), ([root] * len(wide), wide)]:

        def gens(n: int = len(trees)) -> list[torch.Generator]:
            return [torch.Generator(TEST_DEVICE).manual_seed(300 + i) for i in range(n)]

        want = []
        for tree, r, g in zip(trees, rows, gens(), strict=True):
            path, q = _walk_tree(tree, r, params, g) if len(tree.tokens) > 1 else ([0], target_probs(r[0], params))
            want.append(Acceptance(path, [*(tree.tokens[c] for c in path[1:]), sample(q, g)]))
        assert accept_sampled_batch(trees, rows, [params] * len(trees), gens()) == want
        backwards = accept_sampled_batch(trees[::-1], rows[::-1], [params] * len(trees), gens()[::-1])
        assert backwards == want[::-1]


def test_the_residual_alone_is_the_rejection_steps_bit_for_bit() -> None:
    """After a node's last child the walk computes only the residual (`residual`, one row);
    it must be the q^(k+1) of `rejection_step` over a batch row, bits included, for draft
    laws and point masses, and where the residual's mass is 0 (q == p: q kept). Bits
    included on the CPU; on a GPU the sum's reduction order depends on the number of rows
    (one row's sum is split across threads another way), so there to fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(6, 8192, generator=gen) * 3, -1).to(TEST_DEVICE)
    p = torch.softmax(torch.randn(6, 8192, generator=gen) * 3, -1).to(TEST_DEVICE)
    x = torch.randint(0, 8192, (6,), generator=gen).to(TEST_DEVICE)
    point = torch.nn.functional.one_hot(x, 8192).to(q.dtype)
    for law in (p, point, q):
        _, q_next, _ = rejection_step(q, law, x)
        for row in range(6):
            alone = residual(q[row], law[row])
            if ON_CPU:
                assert torch.equal(alone, q_next[row])
            else:
                torch.testing.assert_close(alone, q_next[row], rtol=1e-5, atol=1e-12)


def test_the_walks_host_acceptance_is_the_fp32_acceptance() -> None:
    """The per-tree walk decides u < min(1, q(x)/p(x)) on the host (`host_acceptance`); for
    fp32 q(x), p(x) it must be the fp32 value `acceptance` computes, bit for bit (else a
    uniform between the two roundings would be accepted by one and rejected by the other),
    tiny and zero p(x) included. Dividing in fp64 without the fp32 rounding differs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(20000, generator=gen) ** 3
    p = torch.cat([torch.rand(19990, generator=gen) ** 3, torch.tensor([0.0, 1e-39, 1e-38] + [1e-30] * 7)])
    want = acceptance(q, p).tolist()
    assert [host_acceptance(a, b) for a, b in zip(q.tolist(), p.tolist(), strict=True)] == want
    unrounded = [min(1.0, a / max(b, 1.1754943508222875e-38)) for a, b in zip(q.tolist(), p.tolist(), strict=True)]
    assert unrounded != want


def test_laws_read_up_front_walk_as_the_node_by_node_walk() -> None:
    """Where every node's laws are computed before the walks (`_tree_laws`: temperature-only
    warps, one softmax for the batch), each walk must be the node-by-node walk
    bit for bit: the same path and the same law for its bonus, for sampled chains and
    point-mass chains over 8192 tokens, and a sampled tree with siblings (rejections that
    move to the next sibling), mixed in one batch with a top-k request (which keeps the
    node-by-node walk, as branching trees do)."""
    gen = torch.Generator().manual_seed(11)
    vocab = 8192

    def random_tree(n: int, sampled: bool, chain: bool) -> tuple[DraftTree, torch.Tensor]:
        if chain:
            parents = list(range(-1, n - 1))
        else:
            parents = [-1] + [int(torch.randint(0, c, (1,), generator=gen)) for c in range(1, n)]
        tokens = [0, *torch.randperm(vocab, generator=gen)[: n - 1].tolist()]  # siblings distinct
        peaked = torch.randn(n, vocab, generator=gen) * 4
        laws = torch.softmax(peaked, -1) if sampled else None
        logits = peaked + torch.randn(n, vocab, generator=gen)  # the target near the drafter
        if sampled:  # siblings share their first sibling's row (the law they were drawn from)
            assert laws is not None
            for c in range(1, n):
                laws[c] = laws[children_lists(parents)[parents[c]][0]]
        laws = laws.to(TEST_DEVICE) if laws is not None else None  # where a drafter's laws are
        return DraftTree(tokens, parents, laws, sampled=sampled), logits.to(TEST_DEVICE)

    shapes = [(6, True), (15, True), (1, True), (9, False), (5, True), (17, True), (12, False), (6, True)]
    trees, rows = zip(*(random_tree(n, s, chain=n != 15) for n, s in shapes), strict=True)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 0.8, 1.0)]
    params[5] = SamplingParams(temperature=1.0, top_k=50)
    tables = _tree_laws(list(trees), list(rows), params)
    assert sorted(tables) == [0, 3, 4, 6, 7]  # the branching tree, the root alone and the top-k chain have none
    tables |= {1: _tree_laws([trees[1]], [rows[1]], [params[1]], chains_only=False)[0]}  # a branching tree's table too
    walked_to = set()
    for seed in range(40):
        for i, (tree, r, prm) in enumerate(zip(trees, rows, params, strict=True)):
            if i not in tables:
                continue
            by_node = _walk_tree(tree, r, prm, torch.Generator(TEST_DEVICE).manual_seed(seed))
            up_front = _walk_tree(tree, r, prm, torch.Generator(TEST_DEVICE).manual_seed(seed), tables[i])
            assert by_node[0] == up_front[0] and torch.equal(by_node[1], up_front[1])
            walked_to.add(len(by_node[0]))
    assert max(walked_to) >= 3 and 1 in walked_to  # deep walks and walks that rejected at the root


@pytest.mark.skipif(not ON_CPU, reason="bit for bit against the walk on the CPU; on a GPU the sampling suites")
def test_chains_accepted_as_tensor_ops_accept_what_the_walk_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU, chains at a temperature alone are accepted by tensor ops over the batch
    (`_verify_chains_batched`: one read to the host) instead of a walk a tree. Forced on the CPU,
    it must accept the drafts and draw the bonus tokens the walk does, bit for bit, and
    leave each generator where the walk leaves it: sampled and point-mass chains of 2-7
    nodes at three temperatures, stopped at every depth (all accepted included), in
    batches with a root alone and a branching tree (walked beside it). On a GPU
    (`SPECPIPE_TEST_DEVICE=cuda`) the same on the device, with its generators, where the
    batched path is the one the engine takes. Test of the test: a variant testing each
    draft against its own row's target law (q at the node, not at its parent) accepts
    other drafts."""
    monkeypatch.setattr(verify, "chain_kernel_applies", lambda rows: False)

    def accept(seed: int, batched: bool) -> tuple[list[tuple[list[int], list[int]]], list[float]]:
        trees, logits, params = chain_batch(seed)
        for t in trees:
            t.draft_probs = None if t.draft_probs is None else t.draft_probs.to(TEST_DEVICE)
        logits = [rows.to(TEST_DEVICE) for rows in logits]
        gens = [torch.Generator(TEST_DEVICE).manual_seed(1000 * seed + i) for i in range(len(trees))]
        with pytest.MonkeyPatch.context() as m:
            m.setattr(verify, "_batched_applies", lambda rows: batched)
            out = verify.accept_sampled_batch(trees, logits, params, gens)
        return [(a.path, a.tokens) for a in out], [float(torch.rand((), generator=g, device=g.device)) for g in gens]

    calls: list[int] = []  # chains accepted by each call
    real = verify._verify_chains_batched

    def counted(*args: Any) -> tuple[list[int], list[int]]:
        found = real(*args)
        calls.append(len(found[0]))
        return found

    monkeypatch.setattr(verify, "_verify_chains_batched", counted)
    depths: set[tuple[int, int]] = set()
    for seed in range(40):
        batched, walked = accept(seed, batched=True), accept(seed, batched=False)
        assert batched == walked, f"seed {seed}"
        trees = chain_batch(seed)[0]
        depths |= {(len(t.tokens), len(path) - 1) for t, (path, _) in zip(trees[:12], batched[0][:12], strict=True)}
    assert calls == [12] * 40  # the chains, not the root alone or the branching tree
    for n in range(2, 8):
        assert {(n, k) for k in range(n)} <= depths, n
    real_rows = verify._draft_rows

    def own_rows(tokens: list[list[int]], starts: list[int], width: int) -> list[list[list[int]]]:
        _, own, drafted = real_rows(tokens, starts, width)
        return [own, own, drafted]  # each draft tested against q at itself, not at its parent

    monkeypatch.setattr(verify, "_draft_rows", own_rows)
    assert any(accept(seed, batched=True) != accept(seed, batched=False) for seed in range(10))
