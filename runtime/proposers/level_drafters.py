"""Drafters fed one tree level at a time (`runtime.proposers.rsd.LevelDrafter`), for the RSD methods.

- `RNNLevels`: the ReDrafter RNN drafter. A node's state is the recurrence over its path
  (s_node = step(s_parent, E(token))); every node reads the target hidden state of its
  request, exactly as ReDrafter's beam search does.
- `DraftLMLevels`: a small draft LM with its own paged KV cache that shares the target's
  block tables, so a position has the same slot in both caches: tree node i of a request
  with `context` committed tokens sits at slot `context + i` in each. `first()` catches
  the draft cache up on the request's tokens it has not seen (after prefill: the prompt;
  later: the last accepted token, if it was a leaf, and the pending root; where chains
  start at the roots, a token or two behind go in before them, in the chain op's first level
  or as chain levels: `feeds_roots`); `extend()` runs
  one level of every tree in one forward, each node attending to the context and its own
  ancestors. The proposer applies the target's accepted-path compaction to this cache too,
  and keeps in `Request.draft_state` how many of the request's tokens the cache holds.
  A forward is one C++ call where the draft LM runs on int8 copies on the CPU
  (`plugins/llama_forward.py`), the replay of a captured CUDA graph on a GPU
  (`runtime/cuda_graphs.py`, as the target's steps), else the model's own forward. Chains
  (a node per level) skip the tree code: a level is one `chain_level` call, and on the CPU
  a greedy or temperature-only chain is one C++ call for all its levels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from model_defs.llama import LlamaForCausalLM
from model_defs.paged_kv_cache import PagedKVCache
from model_defs.redrafter import ReDrafter
from plugins.argmax_rows import greedy_rows
from plugins.llama_forward import Int8DraftLM
from runtime.attention_batch import Segment
from runtime.block_manager import BlockManager
from runtime.cuda_graphs import CudaGraphs
from runtime.model_runner import forward
from runtime.request import Request
from runtime.step_batch import step_input
from runtime.tree import bit_rows

_Out = TypeVar("_Out")


class RNNLevels:
    def __init__(
        self, drafter: ReDrafter, embed: nn.Embedding, hidden: torch.Tensor, roots: list[int], max_nodes: int
    ) -> None:
        self.drafter, self.embed, self.hidden = drafter, embed, hidden  # hidden [B, D]
        self.roots = torch.tensor(roots, device=hidden.device)
        self.states = drafter.init_state((len(roots), max_nodes))  # [B, N, D] per node

    @torch.inference_mode()
    def first(self) -> torch.Tensor:
        s = self.drafter.step(self.drafter.init_state(len(self.roots)), self.embed(self.roots))
        self.states[:, 0] = s
        return self.drafter.logits(self.hidden, s)

    @torch.inference_mode()
    def extend(self, rows: list[int], parents: list[int], nodes: list[int], tokens: list[int]) -> torch.Tensor:
        r, p, n, t = torch.tensor([rows, parents, nodes, tokens], device=self.hidden.device)  # one copy
        s = self.drafter.step(self.states[r, p], self.embed(t))
        self.states[r, n] = s
        return self.drafter.logits(self.hidden[r], s)

    def chain(self, tokens: list[int], levels: list[int], at_root: bool = False) -> list[list[int]] | None:
        return None  # the RNN's levels are a few small products each: drafted level by level

    def sampled_chain(
        self, first: torch.Tensor | None, levels: list[int], temperatures: list[float], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def feeds_roots(self) -> bool:
        return False

    def chains(self) -> bool:
        return False

    def chain_level(self, rows: list[int], tokens: list[int] | torch.Tensor, depth: int) -> torch.Tensor:
        raise NotImplementedError("the RNN drafts sampled levels through extend (chains() is False)")


SHORT_CATCH_UP = 2
"""Most tokens before its root a request may be behind for chains to start at the roots
after a level per token (`DraftLMLevels.feeds_roots`); further behind (a prompt, a run
decoded without drafting), `first`'s one forward over every request's catch-up."""


class DraftLMLevels:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        blocks: BlockManager,
        requests: list[Request],
        fused: Int8DraftLM | None = None,
        graphs: CudaGraphs | None = None,
    ) -> None:
        self.model, self.cache, self.blocks, self.requests = model, cache, blocks, requests
        self.fused, self.graphs = fused, graphs
        self.device = model.lm_head.weight.device
        self.depths: list[list[int]] = [[0] for _ in requests]
        self.ancestors: list[list[int]] = [[1] for _ in requests]
        """Per request and node, its ancestors and itself as a bit set (bit j: node j)."""
        self.slots: list[torch.Tensor] = []
        """Per request, the slots of every position its block table covers (the tree's
        included: the scheduler allocated them before drafting), looked up once."""
        self.pending: list[list[int]] | None = None
        """Per request, the tokens behind its root not yet fed (`_feed_behind`): the next
        C++ chain op feeds them in its first level, any other forward first as chain levels."""

    @torch.inference_mode()
    def _run(
        self, tokens: list[int] | torch.Tensor, positions: list[int], segments: list[Segment], rows: list[int]
    ) -> torch.Tensor:
        """One draft-LM forward over the flat batch; logits [len(rows), V] at `rows`.
        `tokens` may be a tensor on the draft LM's device (`chain_level_at`)."""
        self._flush()
        step = step_input(
            torch.as_tensor(tokens),
            torch.tensor(positions),
            segments,
            torch.tensor(rows, dtype=torch.long),
            self.device,
            self.blocks.block_size,
        )
        if self.fused is not None:  # the whole forward in one C++ call (`plugins/llama_forward.py`)
            logits = self.fused(
                step.tokens, step.positions, step.slots, step.attention, step.logits_indices, self.cache
            )
            if logits is not None:
                return logits
        return forward(self.model, self.cache, step, self.graphs).logits[0]

    def _catch_up(self) -> list[int]:
        """Per request, the first position its catch-up feeds (its root sits at
        `num_computed`); looks up the requests' slots (`slots`) on the first call."""
        if not self.slots:
            block_size = self.blocks.block_size
            self.slots = [
                self.blocks.slots(r.request_id, 0, len(self.blocks.table(r.request_id)) * block_size)
                for r in self.requests
            ]
        return [min(r.draft_state or 0, r.num_computed) for r in self.requests]

    def feeds_roots(self) -> bool:
        """Whether chains may start at the roots (`chain` / `sampled_chain` from the roots,
        in place of `first`): every request's catch-up is its root alone (its cache caught
        up: the steady state of a request that drafts) and the draft LM's C++ chain ops run.
        Fed as a chain level, the roots give the logits and K/V `first`'s forward gives, bit
        for bit, without its metadata built in Python (~0.1 ms a step at batch 1).
        A request a few tokens behind (`SHORT_CATCH_UP`) is caught up here first, a chain
        level per token (`_feed_behind`)."""
        if not self.chains():
            return False
        behind = [r.num_computed - start for start, r in zip(self._catch_up(), self.requests, strict=True)]
        if max(behind, default=0) > SHORT_CATCH_UP:
            return False
        self._feed_behind(behind)
        return True

    def _feed_behind(self, behind: list[int]) -> None:
        """Feed each request's `behind[i]` tokens before its root, so that its cache holds
        every token before the root. What a request that drafted is behind after its step is
        the last draft of its chain where all of them were kept (a leaf: drafted, never fed)
        and nothing else, so at batch 8 nearly every step had one such request, and `first`
        then ran the general forward over every request's catch-up (~0.6 ms at batch 8, sd:
        its metadata in Python and a forward of ~16 tokens) where a level takes ~0.22 ms.
        Where the C++ chain ops run, they are held (`pending`) and the next chain op feeds
        them in its first level, before each root (`Int8DraftLM.chain`'s `behind`): one call
        where a chain level per position back from the root made two, a call's own cost
        (~0.1 ms at batch 1) for a row more. Elsewhere, and before any other forward
        (`_flush`), a chain level (`chain_level_at`) per position back from the root. The K/V
        are those the general forward writes (a token attends to the same cache entries;
        products are per row); the levels' logits are not used."""
        held = [
            [r.token_at(r.num_computed - d) for d in range(b, 0, -1)]
            for r, b in zip(self.requests, behind, strict=True)
        ]
        for r, b in zip(self.requests, behind, strict=True):
            if b:
                r.draft_state = r.num_computed
        if any(held):  # (a later call finds them fed or held: their draft_state moved on)
            self.pending = held
        if self.fused is None:
            self._flush()

    def _flush(self) -> None:
        """Feed the `pending` tokens behind as chain levels, a level per position back from
        the root (before a forward that does not take them)."""
        held, self.pending = self.pending, None
        if held is None:
            return
        for depth in range(max(len(h) for h in held), 0, -1):
            rows = [i for i, h in enumerate(held) if len(h) >= depth]
            positions = [self.requests[i].num_computed - depth for i in rows]
            self.chain_level_at(rows, [held[i][-depth] for i in rows], positions)

    def _roots_fed(self) -> list[int]:
        """`first`'s bookkeeping for a call that feeds the roots itself: each request's cache
        then holds everything up to its root. The roots' positions."""
        self._catch_up()
        for r in self.requests:
            r.draft_state = r.num_computed + 1
        return [r.num_computed for r in self.requests]

    @torch.inference_mode()
    def first(self) -> torch.Tensor:
        """Every request's catch-up and root in one forward; as one chain level
        (`chain_level_at`) where `feeds_roots`."""
        if self.feeds_roots():
            positions = self._roots_fed()
            rows = list(range(len(self.requests)))
            return self.chain_level_at(rows, [r.token_at(r.num_computed) for r in self.requests], positions)
        starts = self._catch_up()
        tokens: list[int] = []
        positions = []
        segments, rows = [], []
        for r, start, slots in zip(self.requests, starts, self.slots, strict=True):
            context = r.num_computed  # the root (pending token) sits at position `context`
            segments.append(Segment(len(tokens), start, slots[: context + 1]))
            tokens += r.tokens[start : context + 1]
            positions += range(start, context + 1)
            rows.append(len(tokens) - 1)
            r.draft_state = context + 1
        return self._run(tokens, positions, segments, rows)

    @torch.inference_mode()
    def chain(self, tokens: list[int], levels: list[int], at_root: bool = False) -> list[list[int]] | None:
        """Greedy chains on from `tokens` (each request's first draft, node 1 of its tree,
        after `first`; `at_root`: its root, in place of `first`, where `feeds_roots`):
        request i's node j is fed at position context + j, seeing its whole cache up to
        there, for j = 1 .. `levels[i]` (from the root: j = 0 .. `levels[i]` - 1); returns the
        argmax after each (request i's next `levels[i]` drafts). Every level in one C++ call
        (`Int8DraftLM.chain`), else a level a call where `chains()` (`_chain_by_levels`);
        None where neither applies (the caller drafts the chain as a tree, level by level)."""
        if self.fused is None and not self.chains():
            return None
        starts = self._roots_fed() if at_root else [r.num_computed + 1 for r in self.requests]
        if self.fused is None:
            return self._chain_by_levels(tokens, starts, levels)
        fused = self.fused
        return self._behind_roots(
            at_root, lambda behind: fused.chain(tokens, starts, self.slots, levels, self.cache, behind)
        )

    def _behind_roots(self, at_root: bool, op: Callable[[list[list[int]] | None], _Out | None]) -> _Out | None:
        """Run a C++ chain `op` with the tokens behind the roots (`pending`) where it feeds
        the roots (`at_root`: it feeds them in its first level, and they are then fed), else
        with none, fed first as chain levels (`_flush`). Where the op stands aside (None),
        they stay pending for the forward that drafts instead."""
        if not at_root:
            self._flush()
            return op(None)
        out = op(self.pending)
        if out is not None:
            self.pending = None  # fed before the roots
        return out

    def _chain_by_levels(self, tokens: list[int], starts: list[int], levels: list[int]) -> list[list[int]]:
        """`chain` a level per `chain_level_at` call (request i's `tokens[i]` fed at
        `starts[i]`): where no C++ op drafts a whole chain (a GPU, its levels replaying a
        captured graph). Each level's argmax (`argmax_rows`) stays on the device and is fed
        to the next level as it is, so the host packs level after level without waiting
        for one (read back once, at the end; on an H200 no faster beyond noise: a level's
        host work, its packing and small ops, is what its time is, `benchmarks/HISTORY.md`)."""
        out: list[list[int]] = [[] for _ in tokens]
        fed, holds = torch.tensor(tokens, device=self.device), list(range(len(tokens)))  # `fed` row k: request holds[k]
        drawn: list[torch.Tensor] = []
        for depth in range(max(levels, default=0)):
            active = [i for i in holds if levels[i] > depth]
            if active != holds:  # chains that ended leave the batch
                fed = fed[torch.tensor([k for k, i in enumerate(holds) if levels[i] > depth], device=self.device)]
            fed = greedy_rows([self.chain_level_at(active, fed, [starts[i] + depth for i in active])])
            drawn.append(fed)
            holds = active
        flat = torch.cat(drawn).tolist() if drawn else []
        k = 0
        for depth in range(len(drawn)):
            for i, n in enumerate(levels):
                if n > depth:
                    out[i].append(flat[k])
                    k += 1
        return out

    @torch.inference_mode()
    def sampled_chain(
        self, first: torch.Tensor | None, levels: list[int], temperatures: list[float], uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sampled chains from `first` (`first()`'s logits; None: from the roots, fed as the
        op's first level, where `feeds_roots`): request i draws `levels[i]` tokens, level j
        from softmax(logits / `temperatures[i]`) at `uniforms[i, j]`, each draw fed at
        position context + 1 + j for the next level. The draws `[B, max(levels)]` and their
        laws `[B, max(levels) + 1, V]` (row 0 zeros) in one C++ call
        (`Int8DraftLM.sampled_chain`); None where that does not apply."""
        if self.fused is None:
            return None
        roots = None
        if first is None:
            self._roots_fed()
            roots = [r.token_at(r.num_computed) for r in self.requests]
        starts, fused = [r.num_computed + 1 for r in self.requests], self.fused
        return self._behind_roots(
            roots is not None,
            lambda behind: fused.sampled_chain(
                first, roots, starts, self.slots, levels, temperatures, uniforms, self.cache, behind
            ),
        )

    def chains(self) -> bool:
        """Whether chains are drafted a level per call (`chain_level`) instead of through
        `extend`'s trees: where a level is one cheap call, the draft LM's one-call C++
        forward on the CPU or the replay of a captured graph on a GPU (there a level of the
        tree code, its masks, segments, top-k and bookkeeping on the host, cost more than the
        level's forward)."""
        if self.fused is not None:  # as `chain_level` runs: under inference mode (here a
            # decorator's context cost ~10 us a call, twice a step)
            return self.fused.takes_chain_level(inference=True)
        return self.graphs is not None

    @torch.inference_mode()
    def chain_level(self, rows: list[int], tokens: list[int] | torch.Tensor, depth: int) -> torch.Tensor:
        """One level of chains (sampled ones: the caller draws between levels): request
        `rows[k]`'s draft `tokens[k]` (a list, or the draws as a tensor on the device: fed
        without reading them back), node `depth` of its chain (after `first`), fed at
        position context + depth, seeing its whole cache up to there; logits `[len(rows), V]`
        in one C++ call (`Int8DraftLM.chain_level`) or one forward of the draft LM (a
        captured graph's replay on a GPU), without `extend`'s tree masks and level
        bookkeeping. Only where `chains()`."""
        return self.chain_level_at(rows, tokens, [self.requests[r].num_computed + depth for r in rows])

    @torch.inference_mode()
    def chain_level_at(self, rows: list[int], tokens: list[int] | torch.Tensor, positions: list[int]) -> torch.Tensor:
        """`chain_level` with each fed token's position given: one token per request, causal
        over its slots up to there (a chain node's ancestors are every node before it)."""
        self._flush()
        if self.fused is not None:
            return self.fused.chain_level(tokens, positions, [self.slots[r] for r in rows], self.cache)
        segments = [Segment(k, p, self.slots[r][: p + 1]) for k, (r, p) in enumerate(zip(rows, positions, strict=True))]
        return self._run(tokens, positions, segments, list(range(len(rows))))

    def extend(self, rows: list[int], parents: list[int], nodes: list[int], tokens: list[int]) -> torch.Tensor:
        """One level per request, every request's in one forward: a request's nodes are
        consecutive in packed (breadth-first) order."""
        by_row: dict[int, list[int]] = {}
        for k, row in enumerate(rows):
            by_row.setdefault(row, []).append(k)
        flat_tokens: list[int] = []
        positions: list[int] = []
        segments, order = [], []
        for row, ks in by_row.items():
            r, depths, anc = self.requests[row], self.depths[row], self.ancestors[row]
            first, width = nodes[ks[0]], nodes[ks[0]] + len(ks)
            if [nodes[k] for k in ks] != list(range(first, width)) or first != len(depths):
                raise ValueError("a level's nodes must follow the earlier ones consecutively")
            for k in ks:
                depths.append(depths[parents[k]] + 1)
                anc.append(anc[parents[k]] | 1 << nodes[k])
            mask = bit_rows(anc[first:width], width)  # [m, width] over the whole tree so far
            context = r.num_computed
            segments.append(Segment(len(flat_tokens), context + first, self.slots[row][: context + width], mask))
            flat_tokens += [tokens[k] for k in ks]
            positions += [context + depths[n] for n in range(first, width)]
            order += ks
        logits = self._run(flat_tokens, positions, segments, list(range(len(flat_tokens))))
        if order == list(range(len(order))):  # requests in row order (as `draft_rsd_trees` feeds them)
            return logits
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=logits.device)] = logits
        return out
