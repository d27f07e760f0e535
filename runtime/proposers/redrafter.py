"""ReDrafter drafting (arXiv 2403.09919): beams from the RNN drafter, deduplicated into one
packed tree per request that the target verifies in the step's forward.

    h = target hidden state at the last committed token, bonus = the pending token
    beams = beam_search(drafter, h, bonus)   [B, W, L+1], column 0 = bonus
    tree  = pack_beams(beams)                shared prefixes verified once

Verification, acceptance and KV compaction are the same for every method
(`runtime/engine_core.py`, `runtime/verify.py`); this module only proposes. On an engine
whose drafter is a draft LM, "redrafter" means deterministic beams drafted level by level
(`runtime/proposers/rsd.py`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_defs.redrafter import ReDrafter
from plugins.beam_packing import pack, unpacked
from runtime.proposers.beam_search import beam_search
from runtime.proposers.proposer import Proposer, target_hidden
from runtime.request import Request
from runtime.speculation_policy import largest_fitting
from runtime.tree import DraftTree


@dataclass(frozen=True)
class ReDrafterParams:
    """Drafting effort per step (the most a request may use; load-aware speculation may draft fewer beams)."""

    beam_width: int = 4
    """Beams drafted (W)."""
    beam_length: int = 4
    """Draft tokens per beam (L); beams carry the bonus token in front."""
    packing: bool = True
    """Dynamic tree attention (§3.3): verify the prefixes beams share once. False verifies
    every beam's drafts on their own (1 + W * L nodes): the paper's ablation (Fig. 6)."""

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.beam_length < 1:
            raise ValueError(f"beam_width and beam_length must be >= 1, got {self.beam_width}, {self.beam_length}")


def max_tree_nodes(width: int, length: int) -> int:
    """Most distinct nodes of a tree of `width` beams of `length` drafts (root included)."""
    return 1 + width * length


def node_probs(
    step_log_probs: torch.Tensor,  # [B, W, L, V] beam search's draft distribution at every step
    unpack_index: torch.Tensor,  # [B, W, L+1] packed node of (beam, depth)
    num_nodes: int,
) -> torch.Tensor:  # [B, num_nodes, V]; row of the root is zero (it was not drawn)
    """The draft law each packed node was drawn from, as probabilities (`DraftTree.draft_probs`).
    Beams sharing a node share its prefix, hence (the drafter being deterministic) the same law."""
    b, w, length, v = step_log_probs.shape
    out = step_log_probs.new_zeros(b, w * (length + 1), v)
    index = unpack_index[:, :, 1:].reshape(b, w * length, 1).expand(-1, -1, v)
    return out.scatter_(1, index, step_log_probs.reshape(b, w * length, v).exp())[:, :num_nodes]


@torch.inference_mode()
def draft_trees(
    drafter: ReDrafter,
    embed: nn.Embedding,
    hidden: torch.Tensor,  # [B, D] target hidden state at each request's last committed token
    bonus: list[int],  # [B] each request's pending token (the tree root)
    width: int,
    length: int,
    with_dists: bool,
    packing: bool = True,
) -> list[DraftTree]:
    """One packed tree per request (`packing=False`: beams unmerged); `with_dists` attaches
    the per-node draft distributions (sampling requests' verification may use them)."""
    drafts = beam_search(drafter, embed, hidden, torch.tensor(bonus, device=hidden.device), width, length, with_dists)
    tree = pack(drafts.beams) if packing else unpacked(drafts.beams)
    b, w, d = tree.unpack_index.shape
    beam = torch.arange(w, device=hidden.device)[None, :, None].expand(b, w, d).reshape(b, w * d)
    first = torch.full((b, w * d), w, device=hidden.device)
    first_beam = first.scatter_reduce(1, tree.unpack_index.reshape(b, w * d), beam, "amin")
    node_budget = 1 + (first_beam + 1) * length  # the tree of the first k beams has 1 + k * length nodes at most
    node_budget[:, 0] = 1
    # everything the host needs in two copies (one per dtype): each .tolist() on a GPU would sync
    num_nodes = tree.num_nodes[:, None].expand(b, w * d)
    tokens, parents, depths, budgets, counts = torch.stack(
        [tree.tokens, tree.parents, tree.depths, node_budget, num_nodes]
    ).tolist()
    masks = tree.tree_mask.cpu()
    sizes = [c[0] for c in counts]
    dists = None if drafts.step_log_probs is None else node_probs(drafts.step_log_probs, tree.unpack_index, max(sizes))
    return [
        DraftTree(
            tokens[b][:num],
            parents[b][:num],
            None if dists is None else dists[b, :num],
            depths[b][:num],
            masks[b, :num, :num],
            budgets[b][:num],
        )
        for b, num in enumerate(sizes)
    ]


def beam_widths(width: int) -> list[int]:
    """Widths load-aware speculation may pick for a request of `width` beams: the powers of
    two below it, and itself."""
    return sorted({width, *(1 << i for i in range(width.bit_length()) if 1 << i < width)})


class ReDrafterProposer(Proposer):
    """ReDrafter on the RNN drafter: beams are best first, so the first w beams form a
    nested smaller tree, and load-aware speculation may draft fewer of them."""

    def setting_names(self, method: str) -> Collection[str]:
        return ("beam_width", "beam_length", "packing")

    def params(self, method: str, settings: Mapping[str, Any]) -> ReDrafterParams:
        return ReDrafterParams(**settings)

    def sizes(self, params: ReDrafterParams) -> list[int]:
        return [1, *(max_tree_nodes(w, params.beam_length) for w in beam_widths(params.beam_width))]

    def levels(self, params: ReDrafterParams) -> list[int]:
        return [0 if s == 1 else params.beam_length for s in self.sizes(params)]

    def exact_cuts(self, params: ReDrafterParams) -> bool:
        return False  # sizes are beam widths, and a wider search keeps a different top beam

    def draft_cost_samples(self, method: str) -> list[tuple[int, int, int, float]]:
        """Beam searches from zero states, twice each: every width load-aware speculation may
        pick for one request, and one beam for 8 and 32 requests (so the fit sees nodes
        drafted by wider beams as well as by more requests)."""
        drafter, model = self.engine.redrafter, self.engine.model
        assert drafter is not None
        spec = self.engine.config.drafter
        settings = spec.settings if spec else {}
        length = settings.get("beam_length", ReDrafterParams.beam_length)
        widths = beam_widths(settings.get("beam_width", ReDrafterParams.beam_width))
        samples = []
        for rows, width in [(1, w) for w in widths] + [(8, 1), (32, 1)]:
            hidden = torch.zeros(
                rows, model.config.hidden_size, dtype=model.lm_head.weight.dtype, device=self.engine.device
            )
            for _ in range(2):
                start = time.perf_counter()
                draft_trees(drafter, model.model.embed_tokens, hidden, [0] * rows, width, length, False)
                samples.append((length, rows * width * length, 0, time.perf_counter() - start))
        return samples

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        drafter = self.engine.redrafter
        assert drafter is not None
        trees: dict[Request, DraftTree] = {}
        groups: dict[tuple[int, int, bool], list[Request]] = {}
        for request, budget in zip(requests, budgets, strict=True):
            length = request.draft_params.beam_length
            width = (largest_fitting(self.sizes(request.draft_params), budget) - 1) // length
            if width == 0:
                trees[request] = DraftTree.root(request.tokens[-1])
            else:
                groups.setdefault((width, length, request.draft_params.packing), []).append(request)
        embed = self.engine.model.model.embed_tokens
        for (width, length, packing), group in groups.items():
            with_dists = any(not r.params.greedy for r in group)  # per-node draft laws, for rules that use them
            roots = [r.tokens[-1] for r in group]
            drafted = draft_trees(drafter, embed, target_hidden(group), roots, width, length, with_dists, packing)
            trees |= dict(zip(group, drafted, strict=True))
        return [trees[r] for r in requests]
