"""One request's life in the in-flight batch: what it asked for, where it stands, and the
events its caller receives.

    waiting --admit--> running (prefill chunks ... then one decoding step per engine step)
       ^                  |
       +---preempted------+   (KV blocks taken back; recomputed when readmitted)
    running --> finished: "length" | "stop" | "cancelled" | "error"

Token bookkeeping: `tokens = prompt + output`. Once decoding, the last output token is
*pending*: emitted to the caller but not yet run through the target (it is the root of
the next draft tree, or the next auto-regressive input), so `num_computed` (tokens with
K/V in the cache) is `len(tokens) - 1`. A preempted request recomputes `tokens[:-1]`
and carries on from its pending token, so its output is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.results import GenerationResult
from runtime.sampling import SamplingParams

FINISH_REASONS = ("length", "stop", "cancelled", "error")


@dataclass(frozen=True)
class RequestEvent:
    """What a streaming callback receives after every step the request emitted in, and
    once more, with `finish_reason` set, when it ends."""

    request_id: str
    tokens: list[int]
    """Tokens emitted this step (several under speculation; may be empty on the final event)."""
    finish_reason: str | None = None
    """None while running; then one of FINISH_REASONS."""
    error: str | None = None
    """What went wrong, when finish_reason is "error"."""
    result: GenerationResult | None = None
    """On the final event: the request's whole result (ids, draft/accept counts per step)."""
    log_probs: list[float] = field(default_factory=list)
    """Log-probability of each of `tokens` when the request asked for them
    (`SamplingParams.logprobs`), else empty."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Callback = Callable[[RequestEvent], None]


@dataclass(eq=False)  # identity: requests are compared and hashed as themselves
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    method: str
    """Its decoding method (`runtime.proposers.registry.METHODS`)."""
    draft_params: Any
    """The method's typed parameters (its proposer's `params`); None for ar."""
    generator: torch.Generator
    """The request's own sampling generator (its tokens do not depend on its batch)."""
    stop_ids: set[int]
    callback: Callback | None = None
    arrival: float = field(default_factory=time.perf_counter)
    result: GenerationResult = field(init=False)
    num_computed: int = 0
    """Tokens whose K/V are committed in the cache."""
    hidden: torch.Tensor | None = None
    """[D] target final-norm hidden state at the last computed token (the drafter's input)."""
    draft_state: Any = None
    """Owned by the request's proposer (a draft cache's progress, re-sampled candidates);
    None when fresh or after a preemption."""
    num_preemptions: int = 0
    options: Any = None
    """What its proposer offers it, cached by the engine (`EngineCore._offered`) at its first
    decoding step: its params are frozen."""
    cancel_requested: str | None = None
    """Why the caller ended it early ("cancelled", or "stop" for a stop string the output
    stage found), set by `LLMEngine.cancel`; the request ends with it at the next step."""

    def __post_init__(self) -> None:
        self.result = GenerationResult(list(self.prompt))

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.result.output_ids

    @property
    def pending(self) -> int:
        """`tokens[-1]` (once decoding, the pending token: the root of its next tree) without
        building `tokens` (~1 us a request and step at a few hundred tokens)."""
        return (self.result.output_ids or self.prompt)[-1]

    def token_at(self, position: int) -> int:
        """`tokens[position]` (position >= 0) without building `tokens`."""
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.result.output_ids[position - n]

    @property
    def prefill_target(self) -> int:
        """Tokens to have in the cache before decoding: the prompt, or after a preemption
        everything but the pending token."""
        return len(self.prompt) + max(0, len(self.result.output_ids) - 1)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return bool(self.result.finish_reason)

    def emit(self, tokens: list[int], log_probs: list[float] | None = None) -> list[int]:
        """Record tokens produced by the target (cut at stop / max_tokens), with their
        log-probabilities when the request asked for them; returns the tokens actually
        appended, which is what the caller is sent."""
        before = len(self.result.output_ids)
        self.result.extend(tokens, self.params, self.stop_ids, log_probs)
        return self.result.output_ids[before:]

    def notify(self, tokens: list[int], error: str | None = None) -> None:
        """Send one event; the final one once the request has a finish reason."""
        if self.callback is not None:
            reason = self.result.finish_reason or None
            n = len(self.result.output_ids)
            log_probs = self.result.output_log_probs[n - len(tokens) : n] if self.params.logprobs and tokens else []
            event = RequestEvent(self.request_id, tokens, reason, error, self.result if reason else None, log_probs)
            self.callback(event)
