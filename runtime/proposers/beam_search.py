"""Batched beam search over the ReDrafter drafter (arXiv 2403.09919 §3.2), following
`Drafter.beam_search_candidates` in Apple's `apple/ml-recurrent-drafter`
(`recurrent_drafting/modeling_drafter.py`):

- every beam starts from the target's bonus token (column 0 of `beams`) and an all-zero RNN state;
- step 1 grows only beam 0 (the others start at log-prob -inf), so its top-W tokens become the W
  beams instead of W copies of the same ones;
- every later step scores all W x V one-token extensions by cumulative log-prob and keeps the best
  W overall; each kept beam inherits its parent's tokens and RNN state.

Deterministic (top-W), loops only over the L draft steps, vectorised over batch and beams. Parents
are recorded per step and the beams are rebuilt by one backward pass at the end (Apple instead
re-gathers the whole history every step; the result is the same).

The drafter's warped distribution is supported on each beam's top `WARP_TOP_K` tokens, so
the best W of the W x V extensions are among the W x K: `with_dists=False` (what the
proposer asks at any temperature: point-mass verification reads no draft law) ranks only
those, log_softmax over the K, and never builds the `[B, W, V]` log-distributions (at W =
4 the top-4 over 4 x 8192 alone cost 0.33 ms a level on the CPU). The beams are the same
up to float rounding (ties with the K-th logit, which the warp keeps, are left out of the
normaliser). With one beam (what load-aware speculation picks most at batch 1) the best
extension is the support's top token: no ranking of extensions, no parents, no state
gather, bitwise the general path's result (a W=1, L=5 search 2.04 -> 1.76 ms on the CPU).
On int8 drafter weights on the CPU the support-only search is one C++ call
(`plugins/redrafter_beam_search.py`: W=1, L=5 1.76 -> ~0.75 ms).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from model_defs.redrafter import WARP_TOP_K, ReDrafter
from plugins.redrafter_beam_search import int8_beam_search


class BeamSearchResult(NamedTuple):
    beams: torch.Tensor  # [B, W, L+1] int64: column 0 the bonus token, columns 1..L the drafts
    log_probs: torch.Tensor  # [B, W, L] warped draft log-prob of each drafted token
    step_log_probs: (
        torch.Tensor | None
    )  # [B, W, L, V] full warped draft log-distribution at each step (None: not asked for)
    scores: torch.Tensor  # [B, W] cumulative log-prob (sum of log_probs), descending along W


def beam_search(
    drafter: ReDrafter,
    embed: nn.Embedding,
    h_target: torch.Tensor,  # [B, D] target final-norm hidden state at the bonus token's position
    bonus: torch.Tensor,  # [B] int64 token sampled from the target (the shared root)
    width: int,
    length: int,
    with_dists: bool = True,
) -> BeamSearchResult:
    """Draft `width` beams of `length` tokens per row, best first; `with_dists=False` skips
    `step_log_probs` and ranks only the warp's support (module docstring).

    Beams are distinct whenever `width <= V`. A larger width is allowed (exhaustive searches in
    tests): beams beyond the V^t sequences that exist at step t are padding with score -inf.
    """
    cfg = drafter.config
    if h_target.ndim != 2 or h_target.shape[-1] != cfg.hidden_size:
        raise ValueError(f"h_target must be [B, {cfg.hidden_size}] (drafter hidden_size), got {tuple(h_target.shape)}")
    if bonus.shape != h_target.shape[:1] or bonus.dtype != torch.int64:
        raise ValueError(f"bonus must be int64 [{h_target.shape[0]}], got {bonus.dtype} {tuple(bonus.shape)}")
    if embed.num_embeddings != cfg.vocab_size or embed.embedding_dim != cfg.hidden_size:
        raise ValueError(
            f"embed is [{embed.num_embeddings}, {embed.embedding_dim}], the drafter needs the target's "
            f"[{cfg.vocab_size}, {cfg.hidden_size}] embedding (pass target.model.embed_tokens)"
        )
    if width < 1 or length < 1:
        raise ValueError(f"width and length must be >= 1, got width={width} length={length}")

    b, w, v = h_target.shape[0], width, cfg.vocab_size
    k = min(WARP_TOP_K, v)
    support_only = not with_dists and w <= k
    if support_only and (fast := int8_beam_search(drafter, embed, h_target, bonus, w, length)) is not None:
        beams = torch.cat([bonus[:, None, None].expand(b, w, 1), fast[0]], dim=-1)  # the loop below, in C++
        return BeamSearchResult(beams, fast[1], None, fast[2])

    device = h_target.device
    context = h_target[:, None, :].expand(b, w, -1)  # [B, W, D]
    state = drafter.init_state((b, w))  # [B, W, D]
    tokens = bonus[:, None].expand(b, w)  # [B, W] last token of each beam
    scores = torch.full((b, w), float("-inf"), device=device)  # [B, W]
    scores[:, 0] = 0.0  # only beam 0 is live before step 1 (Apple's LOG_1 / LOG_0 init)
    step_tokens, step_parents, step_lps = [], [], []
    one_beam = support_only and w == 1
    for _ in range(length):
        state = drafter.step(state, embed(tokens))  # [B, W, D]
        if one_beam:  # the best extension of the one beam is its support's top token (sorted)
            top, index = torch.topk(drafter.logits(context, state, warp=False), k, dim=-1)  # [B, 1, K]
            lp = torch.log_softmax(top, dim=-1)[..., 0]  # [B, 1]
            scores, tokens = scores + lp, index[..., 0]
            step_lps.append(lp)
            step_tokens.append(tokens)
            continue
        if support_only:
            top, index = torch.topk(drafter.logits(context, state, warp=False), k, dim=-1)  # [B, W, K]
            lp = torch.log_softmax(top, dim=-1)  # warped log-probs of the support
            cand = (scores[..., None] + lp).reshape(b, w * k)
            scores, flat = torch.topk(cand, w, dim=-1)  # [B, W], sorted best first
            parent, tokens = flat // k, torch.gather(index.reshape(b, w * k), 1, flat)
            step_lps.append(torch.gather(lp.reshape(b, w * k), 1, flat))  # [B, W] of the kept beams
        else:
            lp = drafter.log_probs(context, state)  # [B, W, V]
            cand = (scores[..., None] + lp).reshape(b, w * v)  # [B, W*V] cumulative log-prob of each extension
            scores, flat = torch.topk(cand, w, dim=-1)  # [B, W], sorted best first
            parent, tokens = flat // v, flat % v  # [B, W] each
            step_lps.append(lp)  # [B, W, V] of the parents
        state = torch.gather(state, 1, parent[..., None].expand_as(state))
        step_tokens.append(tokens)
        step_parents.append(parent)

    if one_beam:  # no parents to follow
        beams = torch.cat([bonus[:, None, None], torch.stack(step_tokens, dim=-1)], dim=-1)  # [B, 1, L+1]
        return BeamSearchResult(beams, torch.stack(step_lps, dim=-1), None, scores)
    # Backtrack: ancestor of each final beam at step t, from the last step down to the first.
    ancestor = torch.arange(w, device=device).expand(b, w)  # [B, W] index into step t's kept beams
    drafted, kept, dists = [], [], []
    for t in reversed(range(length)):
        drafted.append(torch.gather(step_tokens[t], 1, ancestor))  # [B, W]
        if support_only:
            kept.append(torch.gather(step_lps[t], 1, ancestor))  # [B, W]
        ancestor = torch.gather(step_parents[t], 1, ancestor)  # [B, W] index into step t's parents
        if not support_only:
            dists.append(torch.gather(step_lps[t], 1, ancestor[..., None].expand(b, w, v)))  # [B, W, V]
    drafted_t = torch.stack(drafted[::-1], dim=-1)  # [B, W, L]
    beams = torch.cat([bonus[:, None, None].expand(b, w, 1), drafted_t], dim=-1)  # [B, W, L+1]
    if support_only:
        return BeamSearchResult(beams, torch.stack(kept[::-1], dim=-1), None, scores)
    step_log_probs = torch.stack(dists[::-1], dim=2)  # [B, W, L, V]
    log_probs = torch.gather(step_log_probs, -1, drafted_t[..., None]).squeeze(-1)  # [B, W, L]
    if not with_dists:
        return BeamSearchResult(beams, log_probs, None, scores)
    return BeamSearchResult(beams, log_probs, step_log_probs, scores)
