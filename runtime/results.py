"""What a request gets back, and the one place that decides when it is finished."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampling import SamplingParams


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    """Generated tokens, without the stop token."""
    finish_reason: str = ""
    """"stop" (EOS or a stop token), "length" (max_tokens), "cancelled", "error", or "" while running."""
    error: str | None = None
    """What went wrong, when finish_reason is "error"."""
    num_forwards: int = 0
    """Target forward passes this request took part in (prefill included)."""
    num_drafted: int = 0
    """Draft tokens proposed to the target (distinct tree nodes, root excluded)."""
    accepted_per_step: list[int] = field(default_factory=list)
    """Draft tokens accepted at each decoding step (acceptance histograms)."""
    sizes_per_step: list[int] = field(default_factory=list)
    """Tree size (nodes, root included) load-aware speculation chose at each decoding step (1: none)."""
    output_log_probs: list[float] = field(default_factory=list)
    """When `SamplingParams.logprobs`: log-probability of every output token under the
    target's distribution after penalties and masks, before temperature/top-k/top-p
    (`runtime.logits_processing.token_log_probs`), aligned with `output_ids`."""

    @property
    def cum_log_prob(self) -> float:
        return float(sum(self.output_log_probs))

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per decoding forward (bonus included), not counting the
        prefill forward and the token it emits: exactly 1.0 for auto-regression."""
        return (len(self.output_ids) - 1) / max(1, self.num_forwards - 1)

    def extend(
        self, tokens: list[int], params: SamplingParams, stop_ids: set[int], log_probs: list[float] | None = None
    ) -> None:
        """Append one step's emitted tokens (and their log-probabilities, when asked for),
        cutting at a stop token or max_tokens."""
        for i, token in enumerate(tokens):
            if token in stop_ids:
                self.finish_reason = "stop"
                return
            self.output_ids.append(token)
            if log_probs is not None:
                self.output_log_probs.append(log_probs[i])
            if len(self.output_ids) == params.max_tokens:
                self.finish_reason = "length"
                return


def tokens_per_step(results: list[GenerationResult]) -> float:
    """Tokens per decoding forward over a set of requests (each request's own
    `tokens_per_step`, weighted by its steps): what a run's tau is."""
    decoded = sum(len(r.output_ids) - 1 for r in results)  # tokens after each prefill's first one
    steps = sum(r.num_forwards - 1 for r in results)
    return decoded / max(1, steps)


def stop_ids(params: SamplingParams, eos_token_ids: list[int]) -> set[int]:
    """Tokens that end this request."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
