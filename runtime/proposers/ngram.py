"""Prompt-lookup (n-gram) decoding (Saxena 2023; vLLM's `ngram`, TensorRT-LLM's prompt
lookup): no drafter model. The draft is what followed the most recent earlier occurrence of
the request's last n tokens in its own prompt + output, for the longest n in
[min_ngram, max_ngram] that occurs; no match, no draft (the root alone).

    tokens = prompt + output            last n tokens: s = tokens[-n:]
    j = the last j < len - n with tokens[j : j + n] == s
    draft = tokens[j + n : j + n + num_draft_tokens]

The draft is a chain of deterministic candidates (point masses), verified by the same rule
as every other tree: greedy keeps the target's argmax path; sampling accepts a drafted
token x with probability q(x) and otherwise draws from q without x (`runtime/verify.py`),
so emitted tokens follow the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.proposers.proposer import Proposer
from runtime.request import Request
from runtime.tree import DraftTree


@dataclass(frozen=True)
class NgramParams:
    num_draft_tokens: int = 4
    """Most tokens drafted per step (k)."""
    max_ngram: int = 3
    """Longest suffix matched (tried first)."""
    min_ngram: int = 1
    """Shortest suffix matched."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1 or self.min_ngram < 1:
            raise ValueError(
                f"num_draft_tokens and min_ngram must be >= 1, got {self.num_draft_tokens}, {self.min_ngram}"
            )
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram {self.max_ngram} < min_ngram {self.min_ngram}")


def lookup(tokens: list[int], params: NgramParams) -> list[int]:
    """The draft after the latest earlier match of the longest suffix (empty: no match)."""
    for n in range(min(params.max_ngram, len(tokens) - 1), params.min_ngram - 1, -1):
        suffix = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + params.num_draft_tokens]
    return []


class NgramProposer(Proposer):
    def setting_names(self, method: str) -> Collection[str]:
        return ("num_draft_tokens", "max_ngram", "min_ngram")

    def params(self, method: str, settings: Mapping[str, Any]) -> NgramParams:
        return NgramParams(**settings)

    def sizes(self, params: NgramParams) -> list[int]:
        return list(range(1, 2 + params.num_draft_tokens))  # chains of 0 .. k drafts

    def levels(self, params: NgramParams) -> list[int]:
        return [0] * (1 + params.num_draft_tokens)  # a lookup, no drafter

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        trees = []
        for request, budget in zip(requests, budgets, strict=True):
            tokens = request.tokens
            drafts = lookup(tokens, request.draft_params)[: budget - 1] if budget > 1 else []
            # node budgets: the chain of size d + 1 holds depth d
            trees.append(DraftTree.chain([tokens[-1], *drafts], budgets=True))
        return trees
