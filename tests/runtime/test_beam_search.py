"""Beam search over the ReDrafter drafter: exact against brute-force enumeration where beam search
is exact (W >= V^(L-1)), W=1 is greedy drafting, rows are independent, the returned
log-probs are the drafter's own, shapes and validation. On the test device; the brute-force
reference computes there too, one token at a time."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from model_defs.redrafter import ReDrafter, ReDrafterConfig
from runtime.proposers.beam_search import beam_search
from tests.device import TEST_DEVICE

D = 8
BATCH_TOL = {"rtol": 1e-5, "atol": 1e-5}
"""A row's fp32 log-probs, batched vs alone: the BLAS may pick another GEMM kernel (another
reduction order) for 1 row than for 3. On an AMD EPYC the CPU's were identical; on an Intel
Xeon with AVX-512 one log-prob of ~7 moved by 3e-5 (seen), on an H100 one of ~5 by 2e-5: a
few ulps. The beams stay exactly equal."""


def setup(vocab: int, exit_dim: int = 2 * D, rnn: bool = True, seed: int = 0) -> tuple[ReDrafter, nn.Embedding]:
    torch.manual_seed(seed)
    cfg = ReDrafterConfig(vocab_size=vocab, hidden_size=D, exit_dim=exit_dim, num_draft_layers=2, rnn=rnn)
    drafter, embed = ReDrafter(cfg).eval(), nn.Embedding(vocab, D)
    with torch.no_grad():  # wider than nn.Linear's init: spread-out log-probs, no near ties
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 2 / p.shape[-1] ** 0.5)
    return drafter.to(TEST_DEVICE), embed.to(TEST_DEVICE)


def inputs(b: int, bonus: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target hidden states `[b, D]` (drawn on the CPU) and bonus tokens, on the test device."""
    return torch.randn(b, D).to(TEST_DEVICE), torch.tensor(bonus, device=TEST_DEVICE)


@torch.no_grad()
def sequence_log_probs(drafter: ReDrafter, embed: nn.Embedding, h: torch.Tensor, bonus: int, seq: list[int]) -> list:
    """Per-token draft log-probs of `seq` after `bonus`, one token at a time (the definition)."""
    state, prev, out = drafter.init_state(1), bonus, []
    for tok in seq:
        state = drafter.step(state, embed(torch.tensor([prev], device=h.device)))
        out.append(drafter.log_probs(h[None], state)[0, tok].item())
        prev = tok
    return out


@pytest.mark.parametrize(
    ("vocab", "width", "length", "rnn"),
    [(5, 3, 1, True), (5, 5, 2, True), (4, 7, 2, False), (3, 9, 3, True), (3, 11, 3, False)],
)
@torch.no_grad()
def test_matches_brute_force_when_exact(vocab: int, width: int, length: int, rnn: bool) -> None:
    drafter, embed = setup(vocab, rnn=rnn)
    h, bonus = inputs(2, [1, 2])
    res = beam_search(drafter, embed, h, bonus, width, length)
    for b in range(2):
        scored = sorted(
            (
                (sum(sequence_log_probs(drafter, embed, h[b], int(bonus[b]), list(s))), s)
                for s in itertools.product(range(vocab), repeat=length)
            ),
            reverse=True,
        )
        live = min(width, vocab**length)  # the rest are -inf padding
        assert [list(s) for _, s in scored[:live]] == res.beams[b, :live, 1:].tolist()
        torch.testing.assert_close(res.scores[b, :live].cpu(), torch.tensor([sc for sc, _ in scored[:live]]))
        assert (res.scores[b, live:] == float("-inf")).all()
        assert (res.beams[b, :, 0] == bonus[b]).all()


@pytest.mark.parametrize(("exit_dim", "rnn"), [(2 * D, True), (12, True), (2 * D, False)])
@torch.no_grad()
def test_width_one_is_greedy_drafting(exit_dim: int, rnn: bool) -> None:
    drafter, embed = setup(60, exit_dim, rnn, seed=1)
    (h, bonus), length = inputs(3, [0, 7, 59]), 5
    res = beam_search(drafter, embed, h, bonus, width=1, length=length)
    state, tok, greedy = drafter.init_state(3), bonus, [bonus]
    for _ in range(length):
        state = drafter.step(state, embed(tok))
        tok = drafter.logits(h, state).argmax(-1)
        greedy.append(tok)
    assert torch.equal(res.beams[:, 0], torch.stack(greedy, dim=-1))


@torch.no_grad()
def test_rows_are_independent_and_log_probs_are_the_drafters() -> None:
    vocab, width, length = 70, 6, 4
    drafter, embed = setup(vocab, exit_dim=12, seed=2)
    h, bonus = inputs(3, [5, 5, 41])
    res = beam_search(drafter, embed, h, bonus, width, length)
    assert res.beams.shape == (3, width, length + 1) and res.beams.dtype == torch.int64
    assert res.log_probs.shape == (3, width, length)
    assert res.step_log_probs.shape == (3, width, length, vocab)
    assert res.scores.shape == (3, width)
    assert (res.scores[:, :-1] >= res.scores[:, 1:]).all()  # best first
    torch.testing.assert_close(res.scores, res.log_probs.sum(-1))
    torch.testing.assert_close(res.step_log_probs.exp().sum(-1).cpu(), torch.ones(3, width, length))
    assert len({tuple(r) for r in res.beams[2].tolist()}) == width  # W <= V: distinct beams

    for b in range(3):
        alone = beam_search(drafter, embed, h[b : b + 1], bonus[b : b + 1], width, length)
        assert torch.equal(alone.beams[0], res.beams[b])
        for name in ("log_probs", "step_log_probs", "scores"):
            torch.testing.assert_close(getattr(alone, name)[0], getattr(res, name)[b], **BATCH_TOL)
        for w in range(width):  # every drafted token's log-prob is the drafter's along that beam
            ref = sequence_log_probs(drafter, embed, h[b], int(bonus[b]), res.beams[b, w, 1:].tolist())
            torch.testing.assert_close(res.log_probs[b, w].cpu(), torch.tensor(ref))


def test_rejects_bad_inputs() -> None:
    drafter, embed = setup(10)
    h, bonus = inputs(2, [1, 2])
    with pytest.raises(ValueError, match="h_target"):
        beam_search(drafter, embed, h[:, :4], bonus, 2, 2)
    with pytest.raises(ValueError, match="bonus"):
        beam_search(drafter, embed, h, bonus.int(), 2, 2)
    with pytest.raises(ValueError, match="embed_tokens"):
        beam_search(drafter, nn.Embedding(11, D).to(TEST_DEVICE), h, bonus, 2, 2)
    with pytest.raises(ValueError, match="width and length"):
        beam_search(drafter, embed, h, bonus, 2, 0)


@pytest.mark.parametrize("width", [1, 3, 4])
@torch.no_grad()
def test_without_dists_ranks_the_warp_support_alone(width: int) -> None:
    """`with_dists=False` (greedy verification) ranks only each beam's top WARP_TOP_K
    extensions: the same beams, scores and log-probs as the full search over the vocabulary
    (here 300 > K tokens), and no `[B, W, L, V]` distributions."""
    vocab, length = 300, 3
    drafter, embed = setup(vocab)
    h, bonus = inputs(3, [0, 7, 299])
    full = beam_search(drafter, embed, h, bonus, width, length)
    fast = beam_search(drafter, embed, h, bonus, width, length, with_dists=False)
    assert fast.step_log_probs is None and full.step_log_probs is not None
    assert torch.equal(fast.beams, full.beams)
    torch.testing.assert_close(fast.scores, full.scores)
    torch.testing.assert_close(fast.log_probs, full.log_probs)
    for w in range(width):  # the drafter's own warped log-probs, one token at a time
        ref = sequence_log_probs(drafter, embed, h[1], 7, fast.beams[1, w, 1:].tolist())
        torch.testing.assert_close(fast.log_probs[1, w].cpu(), torch.tensor(ref))
