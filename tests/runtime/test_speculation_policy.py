"""Load-aware speculation picks wide trees when extra verified tokens are nearly free and
no drafting at all when every token costs and drafts are rarely accepted; a step at
width W measures what every narrower width would have accepted."""

from __future__ import annotations

from runtime.speculation_policy import SpeculationPolicy, StepStats


def policy(forward_ms: tuple[float, float], draft_ms: tuple[float, float], tau: dict[int, float]) -> SpeculationPolicy:
    """Forward costs a + b * tokens, drafting c + d * beams (ms), acceptance tau[w]."""
    p = SpeculationPolicy(length=4)
    a, b = forward_ms
    c, d = draft_ms
    for n in (1, 16, 64, 256):
        p.forward_cost.add(n, (a + b * n) / 1000)
    for rows in (1, 8, 32):
        p.draft_cost.add(rows, (c + d * rows) / 1000)
    for w, t in tau.items():
        p.tau[w] = t
        p.tree_nodes[w] = 1 + 3 * w
    return p


GOOD_DRAFTS = {1: 2.5, 2: 3.0, 4: 3.4}


def test_light_load_drafts_the_full_width() -> None:
    p = policy(forward_ms=(8.0, 0.01), draft_ms=(1.0, 0.05), tau=GOOD_DRAFTS)
    assert p.width(1, [4]) == 4


def test_heavy_load_with_costly_tokens_stops_drafting() -> None:
    p = policy(forward_ms=(8.0, 0.5), draft_ms=(1.0, 0.2), tau={1: 1.3, 2: 1.4, 4: 1.5})
    assert p.width(32, [4] * 32) == 0
    assert p.rate(0, [4] * 32, 0) > p.rate(4, [4] * 32, 0)


def test_width_shrinks_as_the_batch_grows() -> None:
    p = policy(forward_ms=(8.0, 0.08), draft_ms=(2.0, 0.1), tau=GOOD_DRAFTS)
    chosen = [p.width(b, [4] * b) for b in (1, 8, 64)]
    assert chosen[0] == 4 and chosen == sorted(chosen, reverse=True) and chosen[-1] < 4


def test_fixed_mode_always_drafts_the_request_width() -> None:
    p = policy(forward_ms=(8.0, 0.5), draft_ms=(1.0, 0.2), tau={1: 1.0})
    p.adaptive = False
    assert p.width(32, [4] * 32) == 4
    assert p.widths_chosen[4] == 1


def test_one_step_measures_every_narrower_width() -> None:
    stats = StepStats(num_tokens=13, draft_seconds=0.001, forward_seconds=0.01)
    # accepted path of 3 drafts: first reached by beams 0, 2 and 2 -> widths 1, 2 accept 1; 3, 4 accept 3
    stats.record(width=4, nodes=13, first_beam_on_path=[0, 2, 2])
    assert stats.accepted == {1: [1], 2: [1], 3: [3], 4: [3]}
    p = SpeculationPolicy()
    p.observe(stats)
    assert p.tau == {1: 2.0, 2: 2.0, 3: 4.0, 4: 4.0}
    assert p.tree_nodes == {4: 13.0}
