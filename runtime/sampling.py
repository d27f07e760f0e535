"""Per-request sampling settings and the target distribution they define.

`target_probs` is the single definition of "the target's distribution" for a request
(temperature, then top-k, then top-p, in that order, as transformers and vLLM apply
them). Auto-regressive sampling draws from it; speculative verification must reproduce
it exactly, so every strategy calls this function rather than re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens."""

    max_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 scales logits before softmax."""
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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


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
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[tuple[float, int, float], list[int]] = {}
    for m, prm in enumerate(params):
        groups.setdefault((prm.temperature, prm.top_k, prm.top_p), []).append(m)
    for rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        out[index] = target_probs(logits[index], params[rows[0]])
    return out


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from `probs` `[V]` with the request's own generator, so a request's
    tokens do not depend on which other requests share its batch."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Auto-regressive choice from one row of logits `[V]`."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample(target_probs(logits, params), generator)
