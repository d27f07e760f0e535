"""Load-aware speculation picks large trees when extra verified tokens are nearly free and
no drafting at all when every token costs and drafts are rarely accepted; a step drafting
a nested tree measures what every smaller size would have accepted."""

from __future__ import annotations

from runtime.speculation_policy import SpeculationPolicy, StepStats

L = 4
"""Draft length: a ReDrafter tree of w beams has at most 1 + w * L nodes."""
BEAMS = [1, 5, 9, 17]
"""Tree sizes a request of 4 beams offers (widths 0, 1, 2, 4)."""


def size(width: int) -> int:
    return 1 + width * L


def policy(forward_ms: tuple[float, float], draft_ms: tuple[float, float], tau: dict[int, float]) -> SpeculationPolicy:
    """Forward costs a + b * tokens, drafting c + d * drafted nodes (ms), acceptance tau[width]."""
    p = SpeculationPolicy()
    a, b = forward_ms
    c, d = draft_ms
    for n in (1, 16, 64, 256):
        p.forward_cost.add(n, (a + b * n) / 1000)
    for rows in (1, 8, 32):
        p.draft_cost.add(rows * L, (c + d * rows) / 1000)
    for w, t in tau.items():
        p.tau[size(w)] = t
        p.tree_nodes[size(w)] = 1 + 3 * w
    return p


GOOD_DRAFTS = {1: 2.5, 2: 3.0, 4: 3.4}


def test_light_load_drafts_the_full_tree() -> None:
    p = policy(forward_ms=(8.0, 0.01), draft_ms=(1.0, 0.05), tau=GOOD_DRAFTS)
    assert p.budget([BEAMS], 0) == size(4)


def test_heavy_load_with_costly_tokens_stops_drafting() -> None:
    p = policy(forward_ms=(8.0, 0.5), draft_ms=(1.0, 0.2), tau={1: 1.3, 2: 1.4, 4: 1.5})
    assert p.budget([BEAMS] * 32, 0) == 1
    assert p.rate(1, [BEAMS] * 32, 0) > p.rate(size(4), [BEAMS] * 32, 0)


def test_budget_shrinks_as_the_batch_grows() -> None:
    p = policy(forward_ms=(8.0, 0.08), draft_ms=(2.0, 0.1), tau=GOOD_DRAFTS)
    chosen = [p.budget([BEAMS] * b, 0) for b in (1, 8, 64)]
    assert chosen[0] == size(4) and chosen == sorted(chosen, reverse=True) and chosen[-1] < size(4)


def test_whole_trees_are_never_turned_off() -> None:
    """A request offering one size (an RSD or Lyanna tree) drafts it at any budget."""
    p = policy(forward_ms=(8.0, 0.5), draft_ms=(1.0, 0.2), tau={1: 1.3, 2: 1.4, 4: 1.5})
    assert p.budget([BEAMS] * 32 + [[15]], 0) == 1
    assert p.budget([[15]] * 32, 0) == 15


def test_fixed_mode_always_drafts_the_largest_tree() -> None:
    p = policy(forward_ms=(8.0, 0.5), draft_ms=(1.0, 0.2), tau={1: 1.0})
    p.adaptive = False
    assert p.budget([BEAMS] * 32, 0) == size(4)
    assert p.budgets_chosen[size(4)] == 1


def test_one_step_measures_every_smaller_size() -> None:
    stats = StepStats(num_tokens=13, draft_seconds=0.001, forward_seconds=0.01)
    # accepted path of 3 drafts: first reached by beams 0, 2 and 2 (node budgets 5, 13, 13)
    # -> widths 1, 2 accept 1; width 4 accepts 3
    stats.record(size(4), nodes=13, accepted=3, smaller=[size(1), size(2)], path_budgets=[5, 13, 13])
    assert stats.accepted == {size(4): [3], size(1): [1], size(2): [1]}
    p = SpeculationPolicy()
    p.observe(stats)
    assert p.tau == {size(1): 2.0, size(2): 2.0, size(4): 4.0}
    assert p.tree_nodes == {size(4): 13.0}
