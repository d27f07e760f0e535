"""The output stage every front end shares (the CLI, Triton, an OpenAI server): one
request's engine events in, text deltas out.

Per request, a `RequestOutput` turns each `RequestEvent` into an `OutputDelta`:

- **incremental detokenizing**: the new text the event's tokens add. Byte-level BPE splits
  multi-byte characters across tokens, so the whole output is re-decoded and what grew is
  emitted, holding back a trailing U+FFFD until the next token completes the character
  (`IncrementalDetokenizer`). Concatenating every delta's text equals decoding all tokens at
  once, up to the stop string if one is hit.
- **stop strings**: the text ends before the first stop string, which may span deltas. While
  the text so far ends with the beginning of a stop string, that tail is held back, so no
  delta ever carries part of a stop string; it is released if the request ends otherwise.
- **finish reasons**: a stop string is finish reason "stop", like an EOS or stop token; any
  other finish reason is the engine's ("length", "cancelled", "error").
- **statistics**: the final delta carries the request's `RequestStats`, from the final
  event's `result`.
- **log probabilities** (when the request asked for them, `SamplingParams.logprobs`): each
  delta carries the log probs of the tokens whose text it completes (`OutputDelta.log_probs`),
  so a token whose text is held back (an incomplete character, a possible stop-string
  prefix) has its log prob sent with the delta that releases that text, and the deltas'
  log probs concatenated are those of the tokens behind the concatenated text. After a stop
  string, the log probs kept are those of the tokens whose text lies at least partly before
  it (the tokens needed to produce the text sent); later tokens' are dropped, like their
  text. `RequestOutput.log_probs` and `cum_log_prob` are what was sent so far.

The stop-string contract with the engine: the delta in which a stop string is found has
`stop_hit` set; the caller then ends the request with `LLMEngine.cancel(request_id, "stop")`
(a no-op if it has ended meanwhile). Later events add no text or tokens, and the engine's
final event (its echo of that cancel, or whatever ended the request first) becomes the final
delta with finish reason "stop" and the statistics. When the stop string is found in the
final event itself, that one delta has both `stop_hit` and the finish reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from runtime.request import RequestEvent
from runtime.results import GenerationResult

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, the text they add out (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.held = False
        """The last push held back an incomplete character."""

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """The text `ids` add (possibly empty while a character is incomplete)."""
        self.ids += ids
        text = self.text
        end = len(text) - 1 if text.endswith(REPLACEMENT) else len(text)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        self.held = end < len(text)
        return delta

    def flush(self) -> str:
        """Everything not yet emitted (at the end of a request)."""
        text = self.text
        delta = text[self.sent :]
        self.sent = len(text)
        self.held = False
        return delta

    def prefix_length(self, n: int) -> int:
        """Characters the first `n` tokens decode to (an incomplete trailing character counts as one)."""
        return len(self.tokenizer.decode(self.ids[:n], skip_special_tokens=True))


@dataclass(frozen=True)
class RequestStats:
    """What one request cost, from its final `GenerationResult`. Counts are the engine's work:
    tokens generated after a stop string (in the same or a later step) are included."""

    num_input_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    """Draft tokens proposed to the target."""
    num_accepted_tokens: int
    """Draft tokens the target accepted."""
    num_forwards: int
    """Target forward passes the request took part in (prefill included)."""
    accepted_per_step: tuple[int, ...]
    """Draft tokens accepted at each speculative step."""

    @classmethod
    def of(cls, result: GenerationResult) -> RequestStats:
        return cls(
            num_input_tokens=len(result.prompt_ids),
            num_output_tokens=len(result.output_ids),
            num_draft_tokens=result.num_drafted,
            num_accepted_tokens=result.num_accepted,
            num_forwards=result.num_forwards,
            accepted_per_step=tuple(result.accepted_per_step),
        )


@dataclass(frozen=True)
class OutputDelta:
    """What one engine event adds to a request's output."""

    text: str
    """New text (may be empty: an incomplete character, a held-back stop-string prefix)."""
    token_ids: list[int]
    """The event's tokens; none once a stop string was hit."""
    num_tokens: int
    """Output tokens so far, this delta's included (streamed responses report it)."""
    finish_reason: str | None = None
    """None until the final delta; then "stop" for a stop string, else the engine's reason."""
    stop_hit: bool = False
    """A stop string was found in this delta: the caller ends the request (`cancel(id, "stop")`)."""
    stats: RequestStats | None = None
    """On the final delta."""
    error: str | None = None
    """What went wrong, when finish_reason is "error"."""
    log_probs: list[float] = field(default_factory=list)
    """Log probs of the tokens whose text this delta completes (module docstring); empty
    unless the request asked for them."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    """One request's output stage: feed it every event of the request, in order."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Iterable[str] = ()) -> None:
        self.stop_strings = tuple(stop_strings)
        if not all(self.stop_strings):
            raise ValueError("stop strings must not be empty")
        self.token_ids: list[int] = []
        """Output tokens so far, up to the event in which a stop string was hit."""
        self.stop_hit = False
        self.finish_reason: str | None = None
        """Set by the final delta, like `error` and `stats`."""
        self.error: str | None = None
        self.stats: RequestStats | None = None
        self.result: GenerationResult | None = None
        """The final event's result (its output ids go on past a stop string)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._decoded = ""  # the text decoded so far (complete characters)
        self._emitted = 0  # characters of it sent in deltas
        self._token_log_probs: list[float] = []  # of every token in token_ids, when the request asked
        self._log_probs_sent = 0  # how many of them went out in deltas

    @property
    def log_probs(self) -> list[float]:
        """Log probs sent so far: those of the tokens behind `text` (module docstring)."""
        return self._token_log_probs[: self._log_probs_sent]

    @property
    def cum_log_prob(self) -> float:
        """Their sum."""
        return float(sum(self.log_probs))

    @property
    def text(self) -> str:
        """The text of every delta so far, concatenated."""
        return self._decoded[: self._emitted]

    def push(self, event: RequestEvent) -> OutputDelta:
        """The delta `event` makes; raises ValueError after the final event, or for a final
        event without its result."""
        if self.finish_reason is not None:
            raise ValueError(f"request {event.request_id} already finished ({self.finish_reason})")
        if event.finished and event.result is None:
            raise ValueError(f"the final event of request {event.request_id} carries no result")
        if event.log_probs and len(event.log_probs) != len(event.tokens):
            raise ValueError(
                f"request {event.request_id}: {len(event.log_probs)} log probs for {len(event.tokens)} tokens"
            )
        if self.stop_hit:  # only the final event still matters: it ends the request
            return self._delta("", [], event, hit=False, log_probs=[])
        previous = len(self._decoded)
        self.token_ids += event.tokens
        self._token_log_probs += event.log_probs
        self._decoded += self._detokenizer.push(event.tokens)
        if event.finished:
            self._decoded += self._detokenizer.flush()
        cut = self._find_stop(previous)
        self.stop_hit = cut is not None
        held = False
        if cut is None:
            held_back = 0 if event.finished else self._stop_prefix_length()
            held = held_back > 0 or self._detokenizer.held
            cut = len(self._decoded) - held_back
        text = self._decoded[self._emitted : cut]
        self._emitted = max(self._emitted, cut)
        return self._delta(text, event.tokens, event, hit=self.stop_hit, log_probs=self._release_log_probs(held))

    def _release_log_probs(self, held: bool) -> list[float]:
        """The log probs of the tokens whose text the delta being made completes: every token
        pushed when no text is held back; else those whose text lies wholly within what was
        emitted; after a stop string, those whose text begins before it."""
        if len(self._token_log_probs) <= self._log_probs_sent:
            return []  # not asked for, or nothing new
        n = len(self._token_log_probs)
        if self.stop_hit:
            end = next(
                (k for k in range(self._log_probs_sent, n + 1) if self._detokenizer.prefix_length(k) >= self._emitted),
                n,
            )
        elif held:
            end = next(
                (k for k in range(n, self._log_probs_sent, -1) if self._detokenizer.prefix_length(k) <= self._emitted),
                self._log_probs_sent,
            )
        else:
            end = n
        released = self._token_log_probs[self._log_probs_sent : end]
        self._log_probs_sent = max(self._log_probs_sent, end)
        return released

    def _delta(
        self, text: str, tokens: list[int], event: RequestEvent, hit: bool, log_probs: list[float]
    ) -> OutputDelta:
        if not event.finished:
            return OutputDelta(text, tokens, len(self.token_ids), stop_hit=hit, log_probs=log_probs)
        assert event.result is not None
        self.result, self.stats = event.result, RequestStats.of(event.result)
        self.finish_reason = "stop" if self.stop_hit else event.finish_reason
        self.error = None if self.stop_hit else event.error
        return OutputDelta(
            text, tokens, len(self.token_ids), self.finish_reason, hit, self.stats, self.error, log_probs
        )

    def _find_stop(self, previous: int) -> int | None:
        """Where the first stop string begins in the decoded text, if one ends after its
        first `previous` characters (one ending earlier would have been found then)."""
        found = [i for s in self.stop_strings if (i := self._decoded.find(s, max(0, previous - len(s) + 1))) >= 0]
        return min(found, default=None)

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the decoded text that begins a stop string (held back)."""
        text, longest = self._decoded, 0
        for s in self.stop_strings:
            i = text.find(s[0], max(0, len(text) - len(s) + 1))
            while i >= 0 and len(text) - i > longest:
                if s.startswith(text[i:]):
                    longest = len(text) - i
                    break
                i = text.find(s[0], i + 1)
        return longest
