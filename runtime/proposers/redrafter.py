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

import functools
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_defs.redrafter import ReDrafter
from plugins.beam_packing import pack, unpacked
from plugins.redrafter_beam_search import int8_beam_search
from runtime.block_manager import BlockManager
from runtime.cuda_graphs import BUCKETS, CapturedCalls, GraphLimits, bucket_of
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.beam_search import beam_search
from runtime.proposers.proposer import CHAINS, Proposer, target_hidden
from runtime.request import Request
from runtime.speculation_policy import DraftCall, largest_fitting
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


def search_trees(
    drafter: ReDrafter,
    embed: nn.Embedding,
    hidden: torch.Tensor,  # [B, D]
    bonus: torch.Tensor,  # [B] int64
    width: int,
    length: int,
    packing: bool = True,
    with_dists: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Beam search and packing on the device, up to what the host reads, with no read-back
    (so `CapturedCalls` can capture it as one CUDA graph): `[5, B, N]` int64 (per packed
    node: token, parent, depth, node budget; then the tree's node count, repeated) and the
    tree masks `[B, N, N]`; with `with_dists`, the draft laws `[B, N, V]` too."""
    drafts = beam_search(drafter, embed, hidden, bonus, width, length, with_dists)
    tree = pack(drafts.beams) if packing else unpacked(drafts.beams)
    b, w, d = tree.unpack_index.shape
    beam = torch.arange(w, device=hidden.device)[None, :, None].expand(b, w, d).reshape(b, w * d)
    first = torch.full((b, w * d), w, device=hidden.device)
    first_beam = first.scatter_reduce(1, tree.unpack_index.reshape(b, w * d), beam, "amin")
    # smallest size that holds a node (`ReDrafterProposer.sizes`): the first beam's node at depth d is
    # the one-beam chain cut at d (d + 1 nodes); a node first in beam k > 0, the first k + 1 beams
    node_budget = torch.where(first_beam == 0, tree.depths + 1, 1 + (first_beam + 1) * length)
    num_nodes = tree.num_nodes[:, None].expand(b, w * d)
    fields = torch.stack([tree.tokens, tree.parents, tree.depths, node_budget, num_nodes])
    if drafts.step_log_probs is None:
        return fields, tree.tree_mask
    return fields, tree.tree_mask, node_probs(drafts.step_log_probs, tree.unpack_index, w * d)


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
    graphs: CapturedCalls | None = None,
) -> list[DraftTree]:
    """One packed tree per request (`packing=False`: beams unmerged); `with_dists` attaches
    the per-node draft distributions. The proposer never asks for them: beams are
    deterministic, so verification treats each as a point mass at any temperature
    (`runtime/verify.py`), and the laws only serve the test that Apple's per-beam rule,
    which reads them, fails. Asked for, the search builds `[B, W, V]` log-distributions a
    level and leaves the C++ path: on the demo engine at T=1 that made drafting 2-5x
    dearer (batch 1, one beam of 5: 2.36 -> 0.68 ms; batch 32: 19.0 -> 4.3 ms).

    With `graphs` (a GPU), the search replays a CUDA graph captured for the batch padded
    to its bucket (`runtime/cuda_graphs.py`), one per (bucket, width, length, packing): an
    eager search launches ~12 kernels a level from Python and cost ~2.4 ms of an H100
    host's ~5 ms ReDrafter step (W=4, L=5, batch 1). The padding rows' trees are dropped.
    Without graphs, one beam's trees are chains, built from the beams alone (`DraftTree.chain`:
    on the CPU the ~15 small ops of packing cost ~150-300 us of a ~1 ms search)."""
    rows = len(bonus)
    roots = torch.tensor(bonus, device=hidden.device)
    if graphs is None and width == 1 and not with_dists:
        # the C++ search straight (`beam_search`'s own first step, less its argument checks
        # and the beams' concatenation: ~25 us of a ~0.5 ms search)
        fast = int8_beam_search(drafter, embed, hidden, roots, 1, length)
        if fast is not None:
            drafts = fast[0].tolist()  # [B][1][L]: one read-back, no views
            return [DraftTree.chain([root, *d[0]], budgets=True) for root, d in zip(bonus, drafts, strict=True)]
        beams = beam_search(drafter, embed, hidden, roots, 1, length, False).beams[:, 0].tolist()
        return [DraftTree.chain(beam, budgets=True) for beam in beams]
    padded = None if graphs is None or with_dists else bucket_of(rows)
    if graphs is None or padded is None:
        found = search_trees(drafter, embed, hidden, roots, width, length, packing, with_dists)
    else:
        if padded > rows:
            hidden = torch.cat([hidden, hidden.new_zeros(padded - rows, hidden.shape[1])])
            roots = torch.cat([roots, roots.new_zeros(padded - rows)])
        search = functools.partial(search_trees, drafter, embed, width=width, length=length, packing=packing)
        fields, masks = graphs((width, length, packing), search, hidden, roots)
        found = (fields[:, :rows], masks[:rows])
    # everything the host needs in two copies (one per dtype): each .tolist() on a GPU would sync
    tokens, parents, depths, budgets, counts = found[0].tolist()
    masks = found[1].cpu()
    dists = found[2] if with_dists else None
    return [
        DraftTree(
            tokens[b][:num],
            parents[b][:num],
            None if dists is None else dists[b, :num],
            depths[b][:num],
            masks[b, :num, :num],
            budgets[b][:num],
        )
        for b, num in enumerate(c[0] for c in counts)
    ]


def beam_widths(width: int) -> list[int]:
    """Widths load-aware speculation may pick for a request of `width` beams: the powers of
    two below it, and itself."""
    return sorted({width, *(1 << i for i in range(width.bit_length()) if 1 << i < width)})


class ReDrafterProposer(Proposer):
    """ReDrafter on the RNN drafter. Load-aware speculation may draft less than the request's
    W beams of L tokens: the one beam cut at any depth d < L (d + 1 nodes; a one-beam search
    is greedy, so its first d drafts are the search of length d: exact cuts), or fewer
    beams at full length (beams are best first, so the first w beams form a nested tree,
    though not the tree a search of width w keeps).

    Why depths: at batch 32 every tree node is a row of the target's forward, and on this
    CPU that forward is compute-bound, ~linear in its rows. On 32 held-out prompts at T = 0
    one beam of 1 / 2 / 3 / 5 drafts for every request ran 1.07 / 1.09 / 1.03 / 0.99x
    auto-regression (3 rounds in one process, same prompts), where the sizes were beam widths only
    (1 + w L nodes: 6, 11, 21) and no choice but no drafting paid."""

    def __init__(self, engine: LoadedEngine, blocks: BlockManager) -> None:
        super().__init__(engine, blocks)
        self.searches: CapturedCalls | None = None
        """The beam searches captured as CUDA graphs (`capture_graphs`), on a GPU."""

    def setting_names(self, method: str) -> Collection[str]:
        return ("beam_width", "beam_length", "packing")

    def capture_graphs(self, limits: GraphLimits) -> None:
        """Capture the search of every tree size the engine's default settings offer
        (`sizes`), for every batch bucket up to the engine's batch: ~40 graphs for W=4,
        L=5 up to batch 32. A request's own settings are captured on their first call."""
        self.searches = CapturedCalls()
        params = self.default_params("redrafter")
        shapes = [self.shape(params, size) for size in self.sizes(params)[1:]]
        top = bucket_of(limits.max_requests) or limits.max_requests
        for rows in (b for b in BUCKETS if b <= top):
            for width, length in shapes:
                self._draft([0] * rows, self._zeros(rows), width, length, params.packing)

    def _zeros(self, rows: int) -> torch.Tensor:
        model = self.engine.model
        return torch.zeros(rows, model.config.hidden_size, dtype=model.lm_head.weight.dtype, device=self.engine.device)

    def _draft(self, roots: list[int], hidden: torch.Tensor, width: int, length: int, packing: bool) -> list[DraftTree]:
        drafter = self.engine.redrafter
        assert drafter is not None
        embed = self.engine.model.model.embed_tokens
        return draft_trees(drafter, embed, hidden, roots, width, length, False, packing, self.searches)

    def params(self, method: str, settings: Mapping[str, Any]) -> ReDrafterParams:
        return ReDrafterParams(**settings)

    def sizes(self, params: ReDrafterParams) -> list[int]:
        """The root alone, the one beam cut at every depth (2 ... L + 1 nodes), then w beams of
        L drafts for each wider width of `beam_widths` (at most 1 + w L nodes each)."""
        length = params.beam_length
        widths = beam_widths(params.beam_width)[1:]
        return [1, *range(2, length + 2), *(max_tree_nodes(w, length) for w in widths)]

    def levels(self, params: ReDrafterParams) -> list[int]:
        return [self.shape(params, s)[1] for s in self.sizes(params)]

    def cuts(self, params: ReDrafterParams) -> int:
        """The one beam cut at every depth: its sizes up to L + 1 are cuts of each other; the
        wider sizes are beam widths, and a wider search keeps a different top beam."""
        return params.beam_length + 1

    @staticmethod
    def shape(params: ReDrafterParams, size: int) -> tuple[int, int]:
        """(beams, drafts per beam) of the tree of `size` (one of `sizes`; 1: (0, 0), no drafting)."""
        length = params.beam_length
        if size <= length + 1:
            return (1, size - 1) if size > 1 else (0, 0)
        return (size - 1) // length, length

    def cost_paths(self, params: ReDrafterParams, sampled: bool = False) -> list[str]:
        """One beam's chains are drafted apart from wider beams: the C++ search straight,
        built as chains (`draft_trees`), ~0.15 ms a level at batch 1, where wider beams pack
        their trees. Fitted together (levels, nodes), a batch-1 step of the 6-node chain
        (five levels) was priced at 1.17 ms of drafting where it took 0.74, its 4-node chain
        at 0.94 where it took 0.66 (2-core Sapphire Rapids), and load-aware ReDrafter drafted
        11- and 21-node beams in ~22% of its batch-1 steps, at 1.65x auto-regression where
        6-node chains throughout ran 1.98x. Beams are deterministic: greedy and sampled
        requests search alike, in one call."""
        return [self._path(self.shape(params, size)[0]) for size in self.sizes(params)]

    @staticmethod
    def _path(width: int) -> str:
        """The drafting path (`cost_paths`) of a search of `width` beams (0: no drafting)."""
        return CHAINS if width == 1 else ""

    def draft_cost_samples(self, method: str) -> dict[str, list[DraftCall]]:
        """Beam searches from zero states, twice each, per drafting path (`cost_paths`).
        Chains: one beam for 1, 8 and 32 requests, and short ones (1 draft for one request,
        2 for 8 and 32: so the per-level price is fitted apart from the per-node one). Wider
        beams: every width load-aware speculation may pick for one request, and the widest
        for 8 (so the fit sees nodes drafted by more requests as well as by wider beams)."""
        spec = self.engine.config.drafter
        settings = spec.settings if spec else {}
        length = settings.get("beam_length", ReDrafterParams.beam_length)
        wider = beam_widths(settings.get("beam_width", ReDrafterParams.beam_width))[1:]
        shapes = [(1, 1, length), (8, 1, length), (32, 1, length), (1, 1, 1), (8, 1, 2), (32, 1, 2)]
        shapes += [(1, w, length) for w in wider] + [(8, w, length) for w in wider[-1:]]
        samples: dict[str, list[DraftCall]] = {}
        for rows, width, depth in shapes:  # (requests, beams, drafts per beam)
            hidden = self._zeros(rows)
            for _ in range(2):
                start = time.perf_counter()
                self._draft([0] * rows, hidden, width, depth, True)
                elapsed = time.perf_counter() - start
                samples.setdefault(self._path(width), []).append(
                    (depth, rows * width * depth, 0, rows * depth, elapsed)
                )
        return samples

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        trees: dict[Request, DraftTree] = {}
        groups: dict[tuple[int, int, bool], list[Request]] = {}
        for request, budget in zip(requests, budgets, strict=True):
            if budget < 2:  # the root alone (most requests of a busy batch): nothing to work out
                trees[request] = DraftTree.root(request.pending)
                continue
            params = request.draft_params
            width, length = self.shape(params, largest_fitting(self.sizes(params), budget))
            groups.setdefault((width, length, params.packing), []).append(request)
        for (width, length, packing), group in groups.items():
            # no draft laws, whatever the temperature: beams are deterministic, verified as point masses
            drafted = self._draft([r.pending for r in group], target_hidden(group), width, length, packing)
            trees |= dict(zip(group, drafted, strict=True))
        return [trees[r] for r in requests]
