"""`draft_rsd_trees` drafts a whole batch level by level with batched tensor ops (one
warp, one Gumbel-top-k or beam step, one host transfer per level), drawing only each
request's Gumbel noise from its own generator. Two checks on a drafter whose logits for a
node depend on that node alone (so every difference comes from the tree-building code):

- against a per-request reference (the level loop as it was before batching: one
  `gumbel_top_k` per frontier node, one beam step per request), a batch of mixed requests
  (greedy, sampled, top-k / top-p laws with fewer tokens than the branching factor or the
  beam width, a sampled request inside a deterministic redrafter spec) gives identical
  trees: tokens, parents, draft-law rows, flags. Greedy trees on any device; sampled
  trees on the CPU, where one RNG call of F x 2k uniforms is the same stream as F calls of 2k
  (a GPU generator splits the stream differently, which changes the draws but not their law);
- batch invariance of the draws: sampled trees of a batch of 3 requests equal, token for
  token, the trees drawn one request at a time with the same seeds (each request keeps
  its own RNG stream whatever else is in its batch).
"""

from __future__ import annotations

import pytest
import torch

from runtime.gumbel import draw_rows, gumbel_top_k, gumbel_top_k_rows, level_uniforms, top_k_valid, truncated_gumbel
from runtime.proposers.rsd import TreeSpec, draft_probs, draft_rsd_trees
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from tests.device import ON_CPU, TEST_DEVICE

V = 64


class NodeLogits:
    """A `LevelDrafter` whose logits at a node are a fixed function of the node's token,
    its parent's token and its request's context token (`A[token] + B[parent token] +
    C[context]`): rows are computed by lookups and adds alone, so they are bit-identical
    whatever the batch."""

    def __init__(self, contexts: list[int], roots: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        a, b, c = (3 * torch.randn(V, V, generator=gen) for _ in range(3))
        self.a, self.b, self.c = a.to(TEST_DEVICE), b.to(TEST_DEVICE), c.to(TEST_DEVICE)
        self.contexts, self.tokens = contexts, [{0: root} for root in roots]
        self.parent_tokens = [{0: ctx} for ctx in contexts]

    def _logits(self, rows: list[int], nodes: list[int]) -> torch.Tensor:
        token = torch.tensor([self.tokens[r][n] for r, n in zip(rows, nodes, strict=True)], device=TEST_DEVICE)
        prev = torch.tensor([self.parent_tokens[r][n] for r, n in zip(rows, nodes, strict=True)], device=TEST_DEVICE)
        ctx = torch.tensor([self.contexts[r] for r in rows], device=TEST_DEVICE)
        return self.a[token] + self.b[prev] + self.c[ctx]

    def first(self) -> torch.Tensor:
        return self._logits(list(range(len(self.tokens))), [0] * len(self.tokens))

    def extend(self, rows: list[int], parents: list[int], nodes: list[int], tokens: list[int]) -> torch.Tensor:
        for r, p, n, t in zip(rows, parents, nodes, tokens, strict=True):
            self.tokens[r][n] = t
            self.parent_tokens[r][n] = self.tokens[r][p]
        return self._logits(rows, nodes)

    def chain(self, tokens: list[int], levels: list[int], at_root: bool = False) -> None:
        return None  # level by level: the tree-building code under test

    def sampled_chain(self, first: torch.Tensor | None, levels: list[int], t: list[float], u: torch.Tensor) -> None:
        return None

    def feeds_roots(self) -> bool:
        return False

    def chains(self) -> bool:
        return False


class ChainedNodeLogits(NodeLogits):
    """`NodeLogits` that also feeds chains a level per call (`chain_level`), as the draft
    LM's C++ op does: node `depth` of a chain, its parent the node before."""

    def chains(self) -> bool:
        return True

    def chain_level(self, rows: list[int], tokens: list[int], depth: int) -> torch.Tensor:
        for r, t in zip(rows, tokens, strict=True):
            self.tokens[r][depth] = t
            self.parent_tokens[r][depth] = self.tokens[r][depth - 1]
        return self._logits(rows, [depth] * len(rows))


class LateChainedNodeLogits(ChainedNodeLogits):
    """A wrong chain level: each fed token is read as its parent's child one node late."""

    def chain_level(self, rows: list[int], tokens: list[int], depth: int) -> torch.Tensor:
        for r, t in zip(rows, tokens, strict=True):
            self.tokens[r][depth] = t
            self.parent_tokens[r][depth] = self.tokens[r][max(depth - 2, 0)]
        return self._logits(rows, [depth] * len(rows))


def reference_trees(
    drafter: NodeLogits, roots: list[int], params: list[SamplingParams], gens: list[torch.Generator], spec: TreeSpec
) -> list[DraftTree]:
    """The level loop before batching: per request, per frontier node `gumbel_top_k` over
    the law's log (rsd-c, sd; one child of a sampled request: `draw_rows` from the law
    itself, as the batch draws it) or one beam step per request (rsd-s, redrafter), host
    floats for the beams."""
    grown = [([r], [-1], [torch.zeros(0)], [0], [0.0], [0.0]) for r in roots]  # tokens, parents, laws, frontier, ...
    logits, owners = drafter.first(), [(i, 0) for i in range(len(roots))]
    for depth in range(spec.length):
        rows = draft_probs(logits, [params[i] for i, _ in owners])
        law = {owner: row for owner, row in zip(owners, rows, strict=True)}
        new = []
        for i, (tokens, parents, laws, frontier, scores, gumbels) in enumerate(grown):
            gen = gens[i] if spec.stochastic and not params[i].greedy else None
            picks = []
            if not spec.beamed:
                for node in frontier:
                    b = spec.branching[depth]
                    drawn = draw_rows(law[i, node][None], [gen]) if b == 1 and gen else None
                    chosen = drawn if drawn is not None else gumbel_top_k(law[i, node].log(), b, gen)
                    picks += [(node, t) for t in chosen.tolist()]
            else:
                phi = torch.stack([scores[k] + law[i, n].log().double() for k, n in enumerate(frontier)])
                if gen is None:  # every token a candidate
                    keys, cand = phi, torch.arange(V, device=phi.device).expand(len(frontier), V)
                else:  # each frontier node's top-W perturbed children, drawn top-down
                    rows_law = torch.stack([law[i, n].log() for n in frontier])
                    cand, values = gumbel_top_k_rows(rows_law, [len(frontier)], [gen], spec.beam_width)
                    cand = cand.clamp(min=0)
                    perturbed = torch.tensor(scores, dtype=torch.float64, device=phi.device)[:, None] + values
                    keys = truncated_gumbel(perturbed, torch.tensor(gumbels, dtype=torch.float64, device=phi.device))
                index, _ = top_k_valid(keys.flatten(), spec.beam_width)
                c = keys.shape[1]
                ks, cs = (index // c).tolist(), (index % c).tolist()
                ts = [int(cand[k, j]) for k, j in zip(ks, cs, strict=True)]
                scores[:] = [float(phi[k, t]) for k, t in zip(ks, ts, strict=True)]
                gumbels[:] = [float(keys[k, j]) for k, j in zip(ks, cs, strict=True)]
                picks = [(frontier[k], t) for k, t in zip(ks, ts, strict=True)]
            frontier.clear()
            for parent, token in picks:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                laws.append(law[i, parent])
                frontier.append(node)
                new.append((i, parent, node, token))
        if depth + 1 == spec.length or not new:
            break
        cols = [list(c) for c in zip(*new, strict=True)]
        logits = drafter.extend(*cols)
        owners = list(zip(cols[0], cols[2], strict=True))
    out = []
    for (tokens, parents, laws, *_), prm in zip(grown, params, strict=True):
        sampled = spec.stochastic and not prm.greedy  # a ranked tree carries no law: verification reads none
        table = torch.stack([torch.zeros_like(laws[1]), *laws[1:]]) if len(tokens) > 1 and sampled else None
        out.append(DraftTree(tokens, parents, table, sampled=sampled))
    return out


SPECS = [
    TreeSpec("rsd-c", branching=(3, 2, 1), length=3),
    TreeSpec("sd", branching=(1, 1, 1, 1), length=4),
    TreeSpec("rsd-s", beam_width=3, length=4),
    TreeSpec("redrafter", beam_width=4, length=3),
]
MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.0, top_k=2),  # greedy: top-k does not narrow the ranking law
    SamplingParams(temperature=0.7, top_p=0.3, seed=2),  # laws of a few tokens: fewer children / beams
    SamplingParams(temperature=1.3, top_k=2, seed=3),  # 2 tokens: fewer than b_0 = 3 children
    SamplingParams(temperature=1.0, seed=4),
]


def trees_for(spec: TreeSpec, indices: list[int], params: list[SamplingParams], batched: bool) -> list[DraftTree]:
    roots, contexts = [(7 * i + 3) % V for i in indices], [(11 * i + 5) % V for i in indices]
    gens = [params[i].generator(TEST_DEVICE) for i in indices]  # (greedy ones: unseeded, unused)
    prms = [params[i] for i in indices]
    if batched:
        return draft_rsd_trees(NodeLogits(contexts, roots), roots, prms, gens, spec)
    return reference_trees(NodeLogits(contexts, roots), roots, prms, gens, spec)


def assert_same(got: DraftTree, want: DraftTree, what: str) -> None:
    assert got.tokens == want.tokens, what
    assert got.parents == want.parents, what
    assert got.depths == want.depths, what
    assert got.sampled == want.sampled, what
    assert got.mask is not None and want.mask is not None and torch.equal(got.mask, want.mask), what
    if want.draft_probs is None:
        assert got.draft_probs is None, what
    else:
        assert got.draft_probs is not None, what
        assert torch.equal(got.draft_probs.cpu(), want.draft_probs.cpu()), what


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_batched_levels_equal_the_per_request_reference(spec: TreeSpec) -> None:
    indices = list(range(len(MIXED)))
    got = trees_for(spec, indices, MIXED, batched=True)
    want = trees_for(spec, indices, MIXED, batched=False)
    if spec.method != "sd":  # (a chain always has one token to draw)
        assert any(len(t.tokens) < spec.max_nodes for t in want), "some law should be narrower than the tree"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if MIXED[i].greedy or not spec.stochastic or ON_CPU:
            assert_same(g, w, f"request {i} ({MIXED[i]})")


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.method)
def test_sampled_draws_do_not_depend_on_the_batch(spec: TreeSpec) -> None:
    params = [SamplingParams(temperature=1.0, seed=10 + i) for i in range(3)]
    params[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=12)
    together = trees_for(spec, [0, 1, 2], params, batched=True)
    for i in range(3):
        (alone,) = trees_for(spec, [i], params, batched=True)
        assert alone.sampled
        assert_same(together[i], alone, f"request {i}")
    assert len({tuple(t.tokens) for t in together}) == 3


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_greedy_batches_rank_by_the_logits_alone(spec: TreeSpec) -> None:
    """A batch of greedy requests only ranks (SD, RSD-C: no warp, no laws kept); its trees are
    those of the per-request reference, which ranks by the softmax's log-probabilities."""
    greedy = [SamplingParams(), SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.5)]
    got = trees_for(spec, [0, 1, 2, 3], greedy, batched=True)
    want = trees_for(spec, [0, 1, 2, 3], greedy, batched=False)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g.tokens) == spec.max_nodes and g.draft_probs is None
        assert_same(g, w, f"request {i}")


SAMPLED = [SamplingParams(temperature=1.0, seed=20 + i) for i in range(5)]


@pytest.mark.parametrize("params", [MIXED, SAMPLED], ids=["mixed", "sampled"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.method)
def test_every_depth_of_a_batch_in_one_call_is_each_request_drafted_that_deep(
    spec: TreeSpec, params: list[SamplingParams]
) -> None:
    """Load-aware speculation gives requests of one spec different depths; they are drafted
    in one call (`draft_rsd_trees(..., lengths)`, one drafter call per level for all), and
    each request's tree must be the tree it gets drafted alone at its depth
    (`spec.truncated`), bit for bit: mixed greedy and sampled batches and all-sampled ones,
    beams whose trees end while others go on included. Ignoring the lengths (every tree
    at the deepest) fails."""
    indices = list(range(len(params)))
    lengths = [1 + i % spec.length for i in indices]  # every depth, mixed
    roots, contexts = [(7 * i + 3) % V for i in indices], [(11 * i + 5) % V for i in indices]

    def draft(members: list[int], at: TreeSpec, depths: list[int] | None) -> list[DraftTree]:
        gens = [params[i].generator(TEST_DEVICE) for i in members]
        drafter = NodeLogits([contexts[i] for i in members], [roots[i] for i in members])
        return draft_rsd_trees(drafter, [roots[i] for i in members], [params[i] for i in members], gens, at, depths)

    together = draft(indices, spec, lengths)
    for i in indices:
        if params[i].greedy or not spec.stochastic or ON_CPU:
            (alone,) = draft([i], spec.truncated(lengths[i]), None)
            assert_same(together[i], alone, f"request {i} at depth {lengths[i]}")
            assert max(together[i].depths) <= lengths[i]
    deepest = draft(indices, spec, None)
    assert any(len(d.tokens) != len(t.tokens) for d, t in zip(deepest, together, strict=True))


@pytest.mark.parametrize("method", ["sd", "rsd-c", "rsd-s"])
def test_sampled_chains_a_level_per_call_are_the_level_loops_trees(method: str) -> None:
    """`_sampled_chains` (every request sampling one child a level: sd, and rsd-c's and
    rsd-s's chains, the next level fed through `chain_level`) drafts the trees the level
    loop does through `extend`: the same tokens, parents, depths and draft-law rows, bit
    for bit, with the same generators; chains ending at different depths, requests with
    top-k / top-p laws. A chain level that feeds a token as a child of the wrong node drafts
    other trees."""
    roots, contexts = [5, 17, 40, 9], [3, 60, 21, 33]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=2, top_p=0.5),
    ]
    spec = TreeSpec.for_method(method, beam_width=1, beam_length=4, branching=(1, 1, 1, 1))
    lengths = [4, 1, 3, 4]

    def trees(drafter: NodeLogits) -> list[DraftTree]:
        gens = [torch.Generator(device=TEST_DEVICE).manual_seed(100 + i) for i in range(len(roots))]
        return draft_rsd_trees(drafter, roots, params, gens, spec, lengths)

    def same(a: list[DraftTree], b: list[DraftTree]) -> bool:
        return all(
            x.tokens == y.tokens
            and x.parents == y.parents
            and x.depths == y.depths
            and x.sampled == y.sampled
            and x.draft_probs is not None
            and y.draft_probs is not None
            and torch.equal(x.draft_probs, y.draft_probs)
            for x, y in zip(a, b, strict=True)
        )

    levels = trees(NodeLogits(contexts, roots))
    chained = trees(ChainedNodeLogits(contexts, roots))
    assert [len(t.tokens) for t in chained] == [n + 1 for n in lengths]
    assert same(chained, levels)
    assert not same(trees(LateChainedNodeLogits(contexts, roots)), levels)


@pytest.mark.parametrize("counts", [[4], [5, 5, 5], [1, 4, 2, 7], [3, 0, 2]])
def test_level_uniforms_are_what_a_draw_a_level_draws(counts: list[int]) -> None:
    """`level_uniforms` (a request's chain uniforms up front, one call a row on the CPU) gives
    each row the numbers of one `torch.rand(1)` a level from the request's generator, in order,
    and leaves each generator where those calls would: the chains' draws stay `draw_rows`'."""
    seeds = [11 * i + 3 for i in range(len(counts))]
    gens = [torch.Generator(device=TEST_DEVICE).manual_seed(s) for s in seeds]
    got = level_uniforms(gens, counts)
    assert got.shape == (len(counts), max(counts)) and got.dtype == torch.float64
    for i, (seed, n) in enumerate(zip(seeds, counts, strict=True)):
        ref = torch.Generator(device=TEST_DEVICE).manual_seed(seed)
        want = [torch.rand(1, dtype=torch.float64, generator=ref, device=TEST_DEVICE) for _ in range(n)]
        assert got[i, :n].tolist() == torch.cat(want).tolist() if n else got[i].abs().sum() == 0
        assert (got[i, n:] == 0).all()
        after = torch.rand(1, dtype=torch.float64, generator=gens[i], device=TEST_DEVICE)
        assert after.item() == torch.rand(1, dtype=torch.float64, generator=ref, device=TEST_DEVICE).item()
