"""Lyanna drafting ("Make Every Draft Count"): trees from one hidden-state chain by
token-info sampling (Algorithm 1), and re-sampling of rejected drafts (Algorithm 2)
verified fused into the next step's target forward (§6.2).

The drafter (`model_defs/lyanna.py`) turns the target's hidden state h_0 and the bonus
token t_1 into a chain h_1..h_k whose logits come from ONE LM-head product; the chain does
not depend on the drafted tokens, so which token a node follows enters only through the
token-info bias: the logits of a node's children are `l_i + E'(token of the node)`.

Algorithm 1 (token-info sampling), per request, as the paper writes it:
    frontier = [root]
    for depth i = 1..k:
        for each frontier node n: scores = log_softmax(l_i + E'(token(n))); its top-w
            children ALL enter the tree (`children.add`)
        frontier = the w best of those children by joint log-probability (`TopkByJointProb`)
    prune the tree to the B best drafted nodes by joint log-probability (the budget)

Algorithm 2 (re-sampling): when verification stops at depth j (a draft rejected, or the
tree ran out), the target's bonus token t_gt sits at depth j+1 and the chain rows
l_{j+2}..l_k are unused. If more than r of them remain, a small subtree rooted at t_gt is
built from them with t_gt's token info (Algorithm 1 again) — no drafter forward. With
*fusion* it is merged into the next step's regular draft (same root t_gt, shared prefixes
deduplicated) and verified in that step's forward; without fusion it is the next step's
tree on its own (its verification spends a target forward).

Load-aware speculation picks each request's size per step (`LyannaParams.sizes`): up to
`depth` drafted nodes a chain (the tree at width 1: `LyannaParams.chains`), then the whole
step; with `LyannaParams.prunes`, also the regular draft pruned to fewer nodes by joint
probability in between, the larger one cut (`prune` labels node budgets); each drafted
from a drafter chain only as deep as its size needs.
The re-sampled subtree is fused only at the whole step's size.

Why this stays exactly lossless: every node of the merged tree is a deterministic
candidate (a point mass), siblings are distinct tokens (the merge is a trie), and
verification is the same rule as for every other deterministic tree: greedy takes the
target's argmax path; sampling runs recursive rejection with point-mass drafts, which
emits each level's token exactly from the target's distribution whatever the candidates
are (`runtime/verify.py`). Re-sampling only changes *which* candidates are offered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from functools import cached_property, partial
from typing import Any

import torch

from model_defs.lyanna import HotTokenTable
from plugins.lyanna_chain import Int8Chain
from plugins.token_info_top_k import best_chains, top_children
from runtime.block_manager import BlockManager
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.proposer import CHAINS, KVMoves, Proposer, target_hidden
from runtime.request import Request
from runtime.speculation_policy import DraftCall, largest_fitting
from runtime.tree import DraftTree, merge, prune
from runtime.verify import Acceptance

Bias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(previous tokens [M], logits [M, V]) -> logits with their token-info bias added."""


@dataclass(frozen=True)
class LyannaParams:
    """Drafting effort per step."""

    depth: int = 3
    """Chain steps k (tree depth)."""
    width: int = 4
    """Nodes kept per level (w), and children tried per node."""
    budget: int = 12
    """Drafted nodes verified per step (B), the best by joint probability among the up to
    width + (depth - 1) x width^2 candidates Algorithm 1 adds (the paper's Table 1: depth
    3, width 4, B 16)."""
    resample: bool = True
    """Re-sample rejected drafts from the unused chain rows (Algorithm 2)."""
    fuse: bool = True
    """Verify the re-sampled subtree inside the next step's forward (merged with the regular
    draft); False: it is the next step's whole tree."""
    min_remaining: int = 0
    """r: re-sample only when more than r chain rows remain after the bonus token."""
    resample_budget: int = 4
    """Most nodes of a re-sampled subtree."""
    chains: bool = True
    """Load-aware speculation's smallest sizes, up to `depth` drafted nodes (`chain_most`),
    are drafted as chains of the drafter's best token at each depth (the tree at width 1),
    not as the width-`width` tree pruned to as few nodes. On the demo engine at batch 1, T=0
    (2-core EPYC, lockstep, 12 rounds, an hour when AR ran slow): the 4-node chain kept 2.16
    tokens a step and ran 1.10x auto-regression, where the 4-node prune kept 2.02 and ran
    0.95x (its width-4 tree is built, then pruned), and load-aware Lyanna, offered only
    prunes, ran 0.96x."""
    prunes: bool = False
    """Load-aware speculation's sizes between the largest chain and the whole step (the
    regular draft pruned to 4, 8 and `budget` nodes) are offered only where this is set, or
    where no size is a chain (`chain_most` 0). Offered, they were drafted in up to half the
    steps of a run (priced by a prune's tokens over the chain's estimate, which goes stale
    while prunes are drafted: prunes do not measure chains) and never ran faster than the
    4-node chain. Demo engine, 2-core EPYC, lockstep, load-aware offered the chains and
    the whole step against the same with the prunes (session 41): batch 1, T=0 1.259x
    against 1.091x AR (12 rounds; the fixed 4-node chain 1.327x), batch 8, T=0 0.960
    against 0.949, batch 1, T=1 0.973 against 0.966, batch 8, T=1 0.980 against 0.984.
    Offered the chains alone (`width=1`), load-aware read 1.385x and 1.159x in two 16-round
    runs where this default read 1.327x and 1.164x (the fixed chain 1.400x and 1.204x): the
    whole step, chosen in ~0.5% of the request-steps, costs within the runs' spread here, and
    on a GPU, where a 17-node forward costs about a 4-node one, it is the tree that pays."""

    def __post_init__(self) -> None:
        for name in ("depth", "width", "budget", "resample_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_remaining < 0:
            raise ValueError(f"min_remaining must be >= 0, got {self.min_remaining}")

    @property
    def max_nodes(self) -> int:
        """Most nodes a step verifies, root included (regular draft + a fused subtree)."""
        return 1 + self.budget + (self.resample_budget if self.resample else 0)

    @cached_property  # read per request every step; the params are frozen
    def sizes(self) -> list[int]:
        """Tree sizes load-aware speculation may pick (root included, ascending): the root
        alone, the regular draft of 1, 2, 3, 4 and 8 nodes and of `budget`, and the whole
        step (with a fused re-sampled subtree). Up to `chain_most` drafted nodes a size is a
        chain, each a cut of the next; above, the regular draft pruned to its best nodes by
        joint probability, each smaller prune the larger one cut (`prune`'s node budgets),
        offered only with `prunes` (or without chains): else the chains, then the whole step."""
        drafted = {b for b in (1, 2, 3, 4, 8) if b < self.budget} | {self.budget}
        if self.chain_most and not self.prunes:
            drafted = {b for b in drafted if b <= self.chain_most}
        return sorted({1, self.max_nodes} | {1 + b for b in drafted})

    @property
    def chain_most(self) -> int:
        """Drafted nodes of its largest chain size (`chains`; 0: none): `depth`, and fewer
        than `budget` (the regular draft itself stays the pruned tree, what fixed
        speculation drafts). At width 1 every size is a chain already."""
        return min(self.depth, self.budget - 1) if self.chains and self.width > 1 else 0

    def is_chain(self, size: int) -> bool:
        """Whether load-aware speculation's `size` is drafted as a chain (`chains`)."""
        return 1 < size <= 1 + self.chain_most

    def depth_for(self, size: int) -> int:
        """Chain steps a tree of `size` nodes needs: a tree of b drafted nodes is no deeper
        than b, and the chain's first d rows do not depend on later ones, so drafting
        min(depth, size - 1) rows builds the same pruned tree (none for the root alone)."""
        return min(self.depth, size - 1)


def token_info_tree(
    root: int, logits: torch.Tensor, bias: Bias | HotTokenTable | None, width: int, budget: int
) -> DraftTree:
    """Algorithm 1 for one request: `logits` `[k, V]` are the chain rows for depths 1..k.
    Every expanded node's top-`width` children enter the tree; the `width` best of them
    by joint log-probability are expanded at the next depth; the tree is then pruned to
    `budget` drafted nodes by joint log-probability (a child never scores above its parent,
    so the kept nodes form a tree). One request of `token_info_trees`."""
    return token_info_trees([root], logits[None], bias, width, budget)[0]


def token_info_trees(
    roots: list[int], logits: torch.Tensor, bias: Bias | HotTokenTable | None, width: int, budget: int | list[int]
) -> list[DraftTree]:
    """`token_info_tree` of every request at once (`logits` `[B, k, V]`; `budget`: one for
    all, or one per request): a depth is one bias, log-softmax and top-k over the frontier
    nodes of every request (`_best_children`: one C++ call on the CPU) and one read to the
    host; each row is what its request computes alone, bit for bit. Request by request, the
    ~4 small tensor ops of each depth cost ~0.8 ms a tree, ~7 ms of a ~39 ms step at batch 8
    (the demo Lyanna engine)."""
    tokens = [[root] for root in roots]
    parents: list[list[int]] = [[-1] for _ in roots]
    joint = [[0.0] for _ in roots]
    frontier = [[0] for _ in roots]
    device = logits.device
    for depth in range(logits.shape[1]):
        owners = torch.tensor([i for i, nodes in enumerate(frontier) for _ in nodes], device=device)
        prev = torch.tensor([tokens[i][n] for i, nodes in enumerate(frontier) for n in nodes], device=device)
        best, children = _best_children(logits[:, depth], owners, prev, bias, min(width, logits.shape[-1]))
        picked, values = children.tolist(), best.tolist()  # the depth's one read to the host
        m = 0
        for i, nodes in enumerate(frontier):
            first = len(tokens[i])
            for node in nodes:
                for token, value in zip(picked[m], values[m], strict=True):  # children.add: all of them
                    tokens[i].append(token)
                    parents[i].append(node)
                    joint[i].append(joint[i][node] + value)
                m += 1
            scores = joint[i]
            frontier[i] = sorted(range(first, len(scores)), key=lambda n: -scores[n])[:width]  # TopkByJointProb
    budgets = budget if isinstance(budget, list) else [budget] * len(roots)
    return [prune(DraftTree(t, p), j, b) for t, p, j, b in zip(tokens, parents, joint, budgets, strict=True)]


def token_info_chains(
    roots: list[int],
    logits: torch.Tensor,
    bias: Bias | HotTokenTable | None,
    budgets: list[int],
    root_ids: torch.Tensor | None = None,
) -> list[DraftTree]:
    """`token_info_trees` at width 1, each chain cut to its request's budget: the best child
    of the last node a depth (its token-info bias steering it), as a chain labelled with its
    cuts (`DraftTree.chain`), the same trees node for node. A depth is one `_best_children`
    call for the batch and the host reads the chains once at the end, without the general
    path's frontier lists, joint scores, per-depth reads and prune: a batch-1 chain of three
    on the demo Lyanna engine 66 -> 45 us with caches hot, 144 -> 117 us after a flush
    (2-core EPYC). With a hot-token table (or none) every depth is one C++ call
    (`best_chains`, the same picks). `root_ids`: `roots` as a tensor on the logits' device,
    where the caller has one (a tensor from a list costs ~20 us after a forward)."""
    prev = torch.tensor(roots, device=logits.device) if root_ids is None else root_ids
    if isinstance(bias, HotTokenTable) or bias is None:  # every depth in one call (`best_chains`)
        table = bias if bias is not None else HotTokenTable(prev[:0], prev[:0], logits.new_zeros(0, 0))
        drafts = best_chains(logits, prev, table.hot_index, table.hot_ids, table.table).tolist()
    else:
        owners, picked = torch.arange(len(roots), device=logits.device), []
        for depth in range(logits.shape[1]):
            prev = _best_children(logits[:, depth], owners, prev, bias, 1)[1][:, 0]
            picked.append(prev)
        drafts = torch.stack(picked, dim=1).tolist()
    return [
        DraftTree.chain([root, *drafted[:budget]], budgets=True)
        for root, drafted, budget in zip(roots, drafts, budgets, strict=True)
    ]


def _best_children(
    rows: torch.Tensor, owners: torch.Tensor, prev: torch.Tensor, bias: Bias | HotTokenTable | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frontier node's `k` best children and their log-probabilities: node m's logits
    are its request's chain row `rows[owners[m]]` with the token-info bias of its token
    `prev[m]`. A hot-token table (or no bias) goes to `specpipe::token_info_top_k` (one C++
    call on the CPU); another bias (tests' dense tables) is applied, then log-softmax, top-k."""
    if isinstance(bias, HotTokenTable) or bias is None:
        if bias is None:
            hot_rows, hot_ids, table = torch.full_like(prev, -1), prev[:0], rows.new_zeros(0, 0)
        else:
            hot_rows, hot_ids, table = bias.hot_index[prev], bias.hot_ids, bias.table
        return top_children(rows, owners, hot_rows, hot_ids, table, k)
    top = torch.log_softmax(bias(prev, rows[owners]).float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def resample_subtree(
    bonus: int, logits: torch.Tensor, accepted: int, bias: Bias | HotTokenTable | None, params: LyannaParams
) -> DraftTree | None:
    """Algorithm 2: after `accepted` drafted tokens and the bonus token (at depth accepted+1),
    a subtree rooted at the bonus from the chain rows still unused (depths accepted+2..k),
    or None when no more than `min_remaining` rows remain."""
    rest = logits[accepted + 1 :]
    if len(rest) <= params.min_remaining or len(rest) == 0:
        return None
    return token_info_tree(bonus, rest, bias, params.width, params.resample_budget)


@dataclass
class LyannaState:
    """A request's draft state between steps."""

    chain_logits: torch.Tensor | None = None
    """[k, V] logits of the chain drafted this step (re-sampling reads its unused rows)."""
    _resampled: DraftTree | None = None
    _resample: Callable[[], DraftTree | None] | None = None
    """Algorithm 2's re-sampling, not yet run (`resampled` runs it when first read)."""

    @property
    def resampled(self) -> DraftTree | None:
        """Candidates re-sampled after the last step's rejection, rooted at the pending token.
        Worked out when first read: only a step of the whole size reads them (fused in, or
        verified alone), and at batch 1 Lyanna drafted that size in ~5% of its steps while the
        re-sampling ran every step (~0.1 ms of a ~3.9 ms step)."""
        if self._resample is not None:
            self._resampled, self._resample = self._resample(), None
        return self._resampled

    @resampled.setter
    def resampled(self, tree: DraftTree | None) -> None:
        self._resampled, self._resample = tree, None


class LyannaProposer(Proposer):
    """Lyanna on its hidden-state drafter: one chain per request (`depth` layer steps), ONE
    LM-head product over all of them, token-info sampling per request; a pending re-sampled
    subtree is merged in (fusion) or verified alone."""

    def __init__(self, engine: LoadedEngine, blocks: BlockManager) -> None:
        super().__init__(engine, blocks)
        drafter = engine.lyanna_drafter
        self.fused = Int8Chain.of(drafter.layer, drafter.norm, drafter.fuse) if drafter is not None else None
        """The drafter's chain as one C++ call, where it applies (`plugins/lyanna_chain.py`)."""

    def setting_names(self, method: str) -> Collection[str]:
        return [f.name for f in fields(LyannaParams)]

    def params(self, method: str, settings: Mapping[str, Any]) -> LyannaParams:
        return LyannaParams(**settings)

    def sizes(self, params: LyannaParams) -> list[int]:
        return params.sizes

    def levels(self, params: LyannaParams) -> list[int]:
        return [0 if size == 1 else params.depth_for(size) for size in params.sizes]

    def cuts(self, params: LyannaParams) -> int:
        """Its chains (`LyannaParams.chains`) are cuts of each other; a pruned tree holds no
        chain (it keeps siblings where the chain goes deeper)."""
        return 1 + params.chain_most if params.chain_most else params.sizes[-1]

    def cost_paths(self, params: LyannaParams, sampled: bool = False) -> list[str]:
        """Chains are drafted apart from pruned trees ("chains"): a chain's token-info
        step keeps one node a depth, where a pruned tree's builds its whole width first."""
        return [CHAINS if params.is_chain(size) else "" for size in params.sizes]

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        trees: dict[Request, DraftTree] = {}
        groups: dict[tuple[LyannaParams, int, bool], list[tuple[Request, int]]] = {}
        for request, budget in zip(requests, budgets, strict=True):
            params, state = request.draft_params, request.draft_state or LyannaState()
            request.draft_state = state
            size = largest_fitting(params.sizes, budget)
            if size == 1:
                trees[request] = DraftTree.root(request.pending)
                state.resampled = state.chain_logits = None  # rooted at a token this step moves past
            elif size == params.max_nodes and state.resampled is not None and not params.fuse:
                trees[request], state.chain_logits = state.resampled, None  # verified alone, no new chain
            else:  # one drafter chain per depth: a request's tree is pruned to its own size
                groups.setdefault((params, params.depth_for(size), params.is_chain(size)), []).append((request, size))
        for (params, depth, chain), group in groups.items():
            trees |= self._draft(params, depth, group, chain)
        return [trees[r] for r in requests]

    def draft_cost_samples(self, method: str) -> dict[str, list[DraftCall]]:
        """Chains from zero hidden states for 1 and 8 requests, at each depth the sizes
        need (`levels`), each pruned to its depth's largest size; one untimed call first.
        Without them, the fit's first sample was the first live call, cold: on an H200 that
        call took 92-154 ms (a whole step of fixed trees: ~4 ms), priced every tree at
        150-300 ms of drafting, and load-aware Lyanna never drafted again, not even a probe
        (its expected loss never covered). Greedy and sampled requests draft alike; chains
        and pruned trees apart (`cost_paths`), each at every depth its sizes need."""
        params = self.default_params(method)
        samples: dict[str, list[DraftCall]] = {}
        for chain in (True, False):
            # ascending: each depth's largest size of the path
            deepest = {params.depth_for(s): s for s in params.sizes if s > 1 and params.is_chain(s) == chain}
            shapes = [(rows, depth, size) for rows in (1, 8) for depth, size in deepest.items()]
            calls: list[DraftCall] = []
            for n, (rows, depth, size) in enumerate(shapes[-1:] + shapes):  # the first call is untimed
                hidden = torch.zeros(rows, self.engine.model.config.hidden_size, device=self.engine.device,
                                     dtype=self.engine.model.lm_head.weight.dtype)  # fmt: skip
                budget = min(size - 1, params.budget)
                start = time.perf_counter()
                self._trees(params, depth, [0] * rows, hidden, [budget] * rows, chain)
                if n:
                    calls.append((depth, rows * budget, 0, rows * depth, time.perf_counter() - start))
            if calls:
                samples[CHAINS if chain else ""] = calls
        return samples

    @torch.inference_mode()
    def _trees(
        self, params: LyannaParams, depth: int, roots: list[int], hidden: torch.Tensor, budgets: list[int],
        chain: bool = False,
    ) -> tuple[list[DraftTree], torch.Tensor]:  # fmt: skip
        """The chain of `depth` steps from each root's target `hidden` state, ONE head
        product, the token-info trees (of width 1 where `chain`) pruned to `budgets`
        drafted nodes; and the chain rows."""
        drafter, model = self.engine.lyanna_drafter, self.engine.model
        assert drafter is not None
        tokens = torch.tensor(roots, device=self.engine.device)
        states = drafter.draft_chain(hidden, tokens, model.model.embed_tokens, depth, self.fused)
        head = self.engine.lyanna_head or model.lm_head  # an int8 copy, if the engine has one
        logits = drafter.head_logits(states, head)  # [B, depth, V]
        if chain or params.width == 1:
            return token_info_chains(roots, logits, self._bias, budgets, tokens), logits
        return token_info_trees(roots, logits, self._bias, params.width, budgets), logits

    def _draft(
        self, params: LyannaParams, depth: int, group: list[tuple[Request, int]], chain: bool = False
    ) -> dict[Request, DraftTree]:
        """The chain of `depth` steps for every request of `group` (`_trees`), each tree
        pruned to its request's size (a chain where `chain`); at the whole step's size the
        pending re-sampled subtree is merged in (fusion), its nodes labelled with that size.
        Where its smallest sizes are chains, a pruned tree carries no node budgets: its cuts
        are not what those sizes draft, so it measures only its own size."""
        requests = [r for r, _ in group]
        drafted, logits = self._trees(
            params, depth, [r.pending for r in requests], target_hidden(requests),
            [min(size - 1, params.budget) for _, size in group], chain,
        )  # fmt: skip
        trees = {}
        for (r, size), rows, tree in zip(group, logits, drafted, strict=True):
            r.draft_state.chain_logits = rows
            if not chain and params.chain_most:
                tree.node_budget = []
            if size == params.max_nodes and r.draft_state.resampled is not None:
                tree = merge(tree, r.draft_state.resampled, extra_budget=params.max_nodes)
            trees[r] = tree
        return trees

    @property
    def _bias(self) -> HotTokenTable | None:
        return self.engine.token_table

    def on_accept(self, request: Request, tree: DraftTree, accepted: Acceptance, moves: KVMoves | None) -> None:
        """Algorithm 2: candidates for the next step from the chain rows this step left unused."""
        state: LyannaState | None = request.draft_state
        if state is None:  # it never drafted (the loop verifies a root alone without `propose`)
            return
        rows, state.resampled, state.chain_logits = state.chain_logits, None, None
        if request.draft_params.resample and rows is not None:
            bonus, bias, params = accepted.tokens[-1], self._bias, request.draft_params
            state._resample = partial(resample_subtree, bonus, rows, accepted.num_accepted, bias, params)
