"""Per-request sampling settings and the target distribution they define.

`target_probs` is the single definition of "the target's distribution" for a request
(temperature, then top-k, then top-p, in that order, as transformers and vLLM apply
them). Auto-regressive sampling draws from it; speculative verification must reproduce
it exactly, so every strategy calls this function rather than re-deriving it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral

import torch

from plugins.inverse_cdf import draw

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a
tiny temperature overflows to inf/NaN, and the distribution is a point mass anyway."""
MAX_SEED = 2**64 - 1
"""torch generators take 64-bit seeds."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens."""

    max_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 scales logits before softmax. Below MIN_TEMPERATURE it is
    greedy (stored as 0.0)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set with cumulative probability >= top_p (1.0 = off)."""
    seed: int | None = None
    """Seed of this request's own generator (None = nondeterministic)."""
    stop_token_ids: tuple[int, ...] = field(default=())
    """Extra ids that end generation (the engine's EOS always does, unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that need fixed output lengths)."""
    min_tokens: int = 0
    """EOS and the stop tokens cannot be generated before this many output tokens
    (TensorRT-LLM's `min_length`, vLLM's `min_tokens`): their logits are -inf until then."""
    repetition_penalty: float = 1.0
    """> 0; 1 = off. Logits of tokens already in the prompt or the output are divided by it
    when positive, multiplied when negative (CTRL, Keskar et al. 2019; as transformers/vLLM)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's definition; 0 = off)."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence in the output (OpenAI's definition; 0 = off)."""
    bad_words: tuple[tuple[int, ...], ...] = field(default=())
    """Token sequences never generated: the last token of each is masked wherever the
    tokens before it end the sequence so far (a one-token word is masked everywhere)."""
    logprobs: bool = False
    """Return each generated token's log-probability (`GenerationResult.output_log_probs`)."""

    def __post_init__(self) -> None:
        """Refuse what cannot be served (non-finite floats, out-of-range or non-integer
        values) with a message naming the field, before any of it reaches a kernel."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("top_k", self.top_k, low=0, note=" (0 = off)")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, low=0)
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:  # 0 < T < eps: greedy, as vLLM does
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        rp = self.repetition_penalty
        if not isinstance(rp, int | float) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number (0 = off), got {value!r}")
        for word in self.bad_words:
            if not word:
                raise ValueError("bad_words must not contain empty token sequences")
            for token in word:
                _check_int("bad_words", token, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def temperature_alone(self) -> bool:
        """Whether the warp (`target_probs`) is softmax(logits / temperature) alone: no top-k
        or top-p (no sort of the row), what the C++ chain ops compute (`draft_lm_sampled_chain`,
        `verify_sampled_chains`)."""
        return not self.top_k and self.top_p >= 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits depend on the tokens so far (penalties, min_tokens,
        bad_words): then every tree node gets its own, along its own path
        (`runtime/logits_processing.py`)."""
        return bool(
            self.min_tokens
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.bad_words
        )

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def _check_int(name: str, value: object, low: int, high: int | None = None, note: str = "") -> None:
    """`value` is an integer (not a bool or a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}{note}, got {value}")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits `[..., V]` -> probabilities `[..., V]` after temperature, top-k and top-p.
    Not for greedy requests (temperature 0 has no distribution; use argmax)."""
    if params.greedy:
        raise ValueError("greedy requests have no sampling distribution")
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p  # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def target_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`target_probs` of every row of `logits` `[M, V]` under its own `params[m]`, one call
    per distinct setting (a batch usually shares a few)."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for m, prm in enumerate(params):
        groups.setdefault((prm.temperature, prm.top_k, prm.top_p), []).append(m)
    if len(groups) == 1:  # one setting (the usual batch): no scatter into a copy
        return target_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = target_probs(logits[index], params[rows[0]])
    return out


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from `probs` `[V]` (non-negative, not necessarily normalised) with the
    request's own generator, so a request's tokens do not depend on which other requests
    share its batch: `inverse_cdf` at a 53-bit uniform. `torch.multinomial` draws from the
    same law but costs ~15x as much on the CPU (~180 vs ~12 us over 8192 tokens), and this
    runs once per sampled request per step (~10% of an auto-regressive step at batch 8)."""
    return inverse_cdf(probs, uniform(generator, probs.device))


def uniform(generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 53-bit uniform `sample` draws from `generator`: a 0-d fp64 tensor. Drawn apart,
    it lets a batch of draws share one `inverse_cdf_rows` (each request's uniform still
    comes from its own generator, in its own order)."""
    return torch.rand((), dtype=torch.float64, generator=generator, device=device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The token i with cdf[i-1] <= u * total < cdf[i] (cumulative sums in fp64), for u in
    [0, 1): P(i) = p_i / total up to fp64 rounding for a uniform u, and a token of
    probability 0 (an empty interval) is never returned. One row of `inverse_cdf_rows`."""
    return int(inverse_cdf_rows(probs[None], u.reshape(1))[0])


def inverse_cdf_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` of every row of `probs` `[M, V]` at its own `u` `[M]`: tokens `[M]`
    (`plugins/inverse_cdf.py`: a C++ kernel on the CPU, the same tokens bit for bit)."""
    return draw(probs, u)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Auto-regressive choice from one row of logits `[V]`."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(target_probs(logits, params), generator)
