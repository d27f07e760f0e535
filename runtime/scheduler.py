"""Token-budget scheduling in the style of vLLM v1: every step is one target forward over
a flat batch that mixes prefill chunks of new requests with decoding steps (draft trees)
of running ones. There are no prefill/decode phases; a step is bounded by
`max_batch_size` running requests and `max_num_tokens` new tokens.

Order of service each step:
1. running requests, oldest first: a decoding step (the largest tree size the request
   offers that fits the token budget, down to its root alone: an auto-regressive token)
   or the next chunk of an unfinished prefill;
2. waiting requests, oldest first, while a batch slot, budget and KV blocks remain.

Trees come first but never delay a prompt: the engine offers each decoding request only
the sizes that fit the budget the prompts waiting for it leave (`tree_room`), so a step
holds as many prompt tokens as it would beside auto-regressive requests.

KV pressure: a running request that cannot get blocks for its step takes them from the
most recently admitted running request, which is *preempted*: its blocks are freed and it
goes back to the head of the waiting queue, to be recomputed from its tokens when
readmitted. Requests are never failed or dropped for lack of KV.

The waiting queue is bounded; `add` refuses a request at once when it is full.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.block_manager import BlockManager
from runtime.request import Request
from runtime.speculation_policy import largest_fitting


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue_size`: the request was not accepted."""


@dataclass
class ScheduledWork:
    request: Request
    chunk: int = 0
    """Prefill: prompt tokens of this step's chunk (0 for a decoding step)."""
    budget: int = 0
    """Decoding: most tree nodes this step may verify, root included (1 = auto-regressive)."""
    sizes: Sequence[int] = ()
    """Decoding: the tree sizes the request was offered this step (`budget` is the largest that fit)."""

    @property
    def prefill(self) -> bool:
        return self.chunk > 0

    @property
    def num_new(self) -> int:
        """Positions this step writes at most (the KV blocks reserved for it)."""
        return self.chunk or self.budget


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_tokens: int, max_queue_size: int) -> None:
        self.blocks = blocks
        self.max_batch_size, self.max_num_tokens, self.max_queue_size = max_batch_size, max_num_tokens, max_queue_size
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # by id, in admission order
        self.num_preemptions = 0
        self.num_decode_preemptions = 0
        """Preemptions of requests that had emitted tokens (their whole context is recomputed)."""
        self._lock = threading.Lock()  # add() may be called from other threads (servers)

    def add(self, request: Request) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_queue_size:
                raise QueueFullError(
                    f"request {request.request_id!r} refused: {len(self.waiting)} requests already waiting "
                    f"(max_queue_size {self.max_queue_size}); retry later or raise max_queue_size"
                )
            self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out and free its blocks."""
        with self._lock:
            if self.running.pop(request.request_id, None) is None and request in self.waiting:
                self.waiting.remove(request)
        self.blocks.free(request.request_id)

    def _preempt(self, request: Request) -> None:
        del self.running[request.request_id]
        self.blocks.free(request.request_id)
        request.num_computed = 0
        request.hidden = request.draft_state = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_decode_preemptions += bool(request.result.output_ids)
        with self._lock:
            self.waiting.appendleft(request)

    def _fit(self, request: Request, num_tokens: int) -> bool:
        """Get blocks for `num_tokens` positions, preempting later requests if needed.
        False when `request` itself had to be preempted."""
        while not self.blocks.ensure(request.request_id, num_tokens):
            victim = next(reversed(self.running.values()))
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def tree_room(self, decoding: int, prompts: int) -> int | None:
        """Nodes beyond their roots that `decoding` requests' trees may take this step without
        delaying a prompt (None: no prompt waits for the budget): the token budget less a root
        per decoding request, the running prefills' `prompts` tokens, and the prompts of the
        waiting requests that a free batch slot and the free KV blocks could admit. Trees come
        before prompts in a step (`schedule`), so a tree that took more would push a prompt's
        chunk to later steps (`engine_core.PROMPTS_FIRST`). A prompt that waits for blocks
        waits whatever the trees take: counted, a queue held back by a full cache kept the
        requests that would free it from drafting."""
        slots = self.max_batch_size - len(self.running)
        if slots > 0 and self.waiting:
            free = self.blocks.num_free
            with self._lock:
                for request in self.waiting:  # admitted as `schedule` admits them: in order, while blocks last
                    owed = request.prefill_target - request.num_computed
                    free -= self.blocks.blocks_for(request.num_computed + min(owed, self.max_num_tokens))
                    if free < 0:
                        break  # it waits for blocks, not for the budget: trees there hold up no prompt
                    prompts += owed
                    slots -= 1
                    if not slots:
                        break
        if not prompts:
            return None
        return self.max_num_tokens - decoding - prompts

    def schedule(self, sizes: dict[str, Sequence[int]]) -> list[ScheduledWork]:
        """This step's work. `sizes[request_id]`: the tree sizes (ascending) a decoding
        request may draft this step; it gets the largest that fits the token budget, or 1."""
        budget = self.max_num_tokens
        work: list[ScheduledWork] = []
        for request in list(self.running.values()):
            if request.request_id not in self.running:  # preempted by an earlier request this step
                continue
            if request.in_prefill:
                item = ScheduledWork(request, chunk=min(request.prefill_target - request.num_computed, budget))
            else:
                offered = sizes.get(request.request_id, (1,))
                item = ScheduledWork(request, budget=largest_fitting(offered, budget), sizes=offered)
            n = item.num_new
            if n == 0 or n > budget:
                continue
            if self._fit(request, request.num_computed + n):
                work.append(item)
                budget -= n
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            request = self.waiting[0]
            n = min(request.prefill_target - request.num_computed, budget)
            if not self.blocks.ensure(request.request_id, request.num_computed + n):
                break  # new work never preempts running requests
            with self._lock:
                self.waiting.popleft()
            self.running[request.request_id] = request
            work.append(ScheduledWork(request, chunk=n))
            budget -= n
        return work
