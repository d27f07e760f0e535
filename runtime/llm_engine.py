"""The in-flight batching engine's public API (`LLMEngine`): requests join and leave the
batch at every step, each with its own prompt, sampling settings and decoding method.
One step is `runtime/engine_core.py`.

Faults (`step`): an exception while serving one request ends that request with finish reason
"error"; the others go on. One that may have corrupted shared state fails every request in
flight; under tensor parallelism, or when it keeps happening, the engine is dead
(`EngineDeadError`) and refuses new requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from runtime.config import RuntimeConfig, check_request
from runtime.engine_core import EngineCore
from runtime.loaded_engine import LoadedEngine
from runtime.model_runner import StepSender
from runtime.proposers.proposer import settings_for
from runtime.proposers.registry import DEFAULT_METHOD, proposer_class
from runtime.request import Callback, Request
from runtime.results import GenerationResult, stop_ids
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

OTHER_THREAD = (
    "LLMEngine.step() runs on another thread than the one that built the engine: on a CPU, OpenMP keeps a "
    "worker pool per thread that has run torch work, and while two pools live their workers stop spin-waiting "
    "between parallel regions, which makes small GEMMs ~2x slower (demo target at batch 1 on 2 threads: 120 vs "
    "270 tok/s); load and build the engine on the thread that steps it (triton_repo/serving_model.py does)"
)
"""Logged once by an engine stepped off the thread that built it."""

MAX_STEP_FAILURES = 3
"""Steps in a row that may fail as a whole before the engine declares itself dead: a fault
that survives a clean slate will not go away."""


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a failed forward under tensor parallelism left the
    ranks out of step, or every step fails); restart the process to recover."""


@dataclass(frozen=True)
class EngineStats:
    """What `LLMEngine.stats` reports (gauges, health checks)."""

    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int
    dead: str | None
    """Why the engine cannot step any more; None while it can."""
    tree_sizes: dict[tuple[str, int], int] = field(default_factory=dict)
    """(method, tree size) -> request-steps load-aware speculation drafted at that size (1: none)."""
    estimated_tokens_per_step: dict[str, dict[int, float]] = field(default_factory=dict)
    """kind of request (method/greedy) -> tree size -> tokens per step it expects (what it chooses by)."""
    probes: int = 0
    """Request-steps drafted larger than chosen, to re-measure acceptance."""
    plain_probes: int = 0
    """Steps kept auto-regressive where the batch would draft, to time its plain step."""
    policy_errors: int = 0
    """Calls of the load-aware policy that raised: each such step ran auto-regressively
    (`EngineCore._policy_failed`)."""


class LLMEngine(EngineCore):
    """The engine's public API: requests in, events out, one `step()` at a time (servers
    call it from their engine thread; `generate` runs prompts to completion)."""

    def __init__(self, engine: LoadedEngine, config: RuntimeConfig | None = None, broadcast: StepSender | None = None):
        super().__init__(engine, config, broadcast)
        self._ids = itertools.count()
        self._thread: int | None = threading.get_ident()
        """The thread that built the engine, until a step on another thread was warned about."""

    # ---- requests -------------------------------------------------------------------

    @property
    def default_method(self) -> str:
        drafter = self.engine.config.drafter
        return drafter.settings.get("method", DEFAULT_METHOD[self.kind]) if drafter else "ar"

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        method: str | None = None,
        callback: Callback | None = None,
        request_id: str | None = None,
        **settings: Any,
    ) -> Request:
        """Queue a request; `settings` are its method's (e.g. beam_width), over the engine's
        defaults. Raises ValueError for a request the engine cannot serve (a setting its
        method does not take included), QueueFullError when the waiting queue is full
        (nothing is queued then), and EngineDeadError once the engine cannot step any more."""
        check_request(self.engine.config, prompt, params)
        method = method or self.default_method
        if method not in self.proposers:
            proposer_class(method, self.kind)  # raises ValueError naming the fix
        proposer = self.proposers[method]
        defaults = self.engine.config.drafter.settings if self.engine.config.drafter else {}
        draft_params = proposer.params(method, settings_for(method, proposer.setting_names(method), defaults, settings))
        if (drafted := proposer.sizes(draft_params)[-1] - 1) > self.config.max_draft_tokens:
            raise ValueError(
                f"{method} {draft_params} drafts up to {drafted} tokens per step, more than max_draft_tokens "
                f"{self.config.max_draft_tokens}; lower its settings or raise max_draft_tokens"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        gen, stops = params.generator(self.engine.device), stop_ids(params, self.engine.eos_token_ids)
        request = Request(request_id, list(prompt), params, method, draft_params, gen, stops, callback)
        with self._lock:  # servers add from their own threads while step() runs
            if self.dead is not None:
                raise EngineDeadError(f"engine is down ({self.dead}); restart the server")
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self.scheduler.add(request)
            self._requests[request_id] = request
        return request

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early; its KV blocks are freed and its final event sent at the next
        step, with finish reason `reason` ("cancelled", or "stop" when an output stage
        found a stop string)."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"a request is ended early as 'cancelled' or 'stop', not {reason!r}")
        request = self._requests.get(request_id)
        if request is not None:
            request.cancel_requested = reason

    def stats(self) -> EngineStats:
        """A snapshot for gauges and health checks (front ends read this, never the
        scheduler or block manager themselves)."""
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_free=self.blocks.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            dead=self.dead,
            tree_sizes=dict(self.policy.chosen),
            estimated_tokens_per_step=self.policy.estimates(),
            probes=self.policy.probes,
            plain_probes=self.policy.plain_probes,
            policy_errors=self.policy_errors,
        )

    def close(self) -> None:
        """Release what outlives the object: the other tensor-parallel ranks are told to exit."""
        if self.runner.broadcast is not None:
            self.runner.shutdown()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[Request]:
        """Run one step (`EngineCore`); returns the requests that finished in it.

        A failure while serving one request ends that request with "error" and the step goes
        on for the others; a failed forward fails that step's requests. Anything else that
        escapes fails every request in flight (their blocks are freed: a clean slate). That
        is fatal, `EngineDeadError` (also raised by every later call), under tensor
        parallelism, where the other ranks may be inside a forward rank 0 left, and after
        MAX_STEP_FAILURES such steps in a row."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self._thread is not None and threading.get_ident() != self._thread:
            log.warning(OTHER_THREAD)
            self._thread = None
        try:
            finished = self._step()
        except Exception as e:
            log.exception("engine step failed; failing every request in flight")
            reason = f"engine step failed: {type(e).__name__}: {e}"
            self._failed_steps += 1
            if self.runner.broadcast is not None or self._failed_steps >= MAX_STEP_FAILURES:
                why = "tensor-parallel ranks out of step" if self.runner.broadcast is not None else "every step fails"
                self.shut_down(f"{reason} ({why})")
                raise EngineDeadError(self.dead) from e
            return self.abort_all(reason)
        self._failed_steps = 0
        return finished

    def abort_all(self, error: str) -> list[Request]:
        """End every request in flight, waiting or running, with finish reason "error"."""
        with self._lock:
            requests = [r for r in self._requests.values() if not r.finished]
        self.runner.discard_moves()  # compaction moves of requests that are gone
        return [self._finish(r, "error", error) for r in requests]

    def shut_down(self, reason: str) -> list[Request]:
        """Declare the engine dead (`reason`): later requests are refused, and every request
        in flight ends with "error". Under the lock `add_request` takes, so none slips between."""
        with self._lock:
            self.dead = reason
        return self.abort_all(reason)

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], method: str | None = None, **settings: Any
    ) -> list[GenerationResult]:
        """Submit all prompts (as fast as the waiting queue takes them), run to completion;
        results in prompt order."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pending = deque(zip(prompts, params, strict=True))
        requests = []
        while pending or self.has_unfinished():
            while pending and len(self.scheduler.waiting) < self.config.max_queue_size:
                requests.append(self.add_request(*pending.popleft(), method, **settings))
            self.step()
        return [r.result for r in requests]


def generate(
    engine: LoadedEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    method: str | None = None,
    config: RuntimeConfig | None = None,
    **settings: Any,
) -> list[GenerationResult]:
    """Run `prompts` to completion with `method` (default: the engine's drafter's, else
    auto-regressive) on a fresh `LLMEngine`: the entry point of the CLI, the benchmarks and
    the tests (servers drive `LLMEngine` step by step instead)."""
    return LLMEngine(engine, config).generate(prompts, params, method, **settings)
