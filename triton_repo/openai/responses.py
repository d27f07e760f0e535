"""OpenAI's response shapes, built from Triton's deltas: completions and chat, whole or as
stream chunks, with `usage`, log probabilities and specpipe's `speculation` object."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from triton_repo.openai.protocol import GenerationRequest
from triton_repo.openai.triton_backend import Delta


def usage(stats: dict[str, int]) -> dict[str, int]:
    prompt, completion = stats.get("num_input_tokens", 0), stats.get("num_output_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def running_usage(completion_tokens: int | None) -> dict[str, int | None]:
    return {"prompt_tokens": None, "completion_tokens": completion_tokens, "total_tokens": None}


def speculation(stats: dict[str, int]) -> dict[str, Any]:
    """The request's target steps (`num_forwards`, its prefill's included; without it, each
    step counted as its accepted draft tokens plus one of its own)."""
    drafted, accepted = stats.get("num_draft_tokens", 0), stats.get("num_accepted_tokens", 0)
    steps = stats.get("num_forwards", stats.get("num_output_tokens", 0) - accepted)
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "target_steps": steps,
        "mean_tokens_per_step": stats.get("num_output_tokens", 0) / steps if steps > 0 else None,
    }


class Format:
    """OpenAI's shapes of one endpoint."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, logprobs: int | None, tokenizer: Tokenizer | None) -> None:
        self.logprobs = logprobs
        """None: no log probs; else completions' `logprobs` (0 or 1), chat's 0."""
        self.tokenizer = tokenizer
        self.offset = 0

    def tokens(self, delta: Delta) -> list[tuple[str, float]]:
        """(token text, log prob) of the delta's tokens. Triton sends text pieces, not token ids:
        a piece is re-tokenized, and if that gives another count, its first token carries it."""
        k = len(delta.log_probs)
        pieces = [delta.text] + [""] * (k - 1) if k else []
        if self.tokenizer is not None and k:
            ids = self.tokenizer.encode(delta.text, add_special_tokens=False).ids
            if len(ids) == k:
                pieces = [self.tokenizer.decode([i]) for i in ids]
        return list(zip(pieces, delta.log_probs, strict=True))

    def start(self) -> list[dict[str, Any]]:
        return []

    def choice(self, text: str, tokens: list[tuple[str, float]], reason: str | None, chunk: bool) -> dict:
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def _logprobs(self, tokens: list[tuple[str, float]]) -> dict[str, Any]:
        offsets = []
        for token, _ in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": [t for t, _ in tokens],
            "token_logprobs": [lp for _, lp in tokens],
            "top_logprobs": [{t: lp} for t, lp in tokens] if self.logprobs else None,
            "text_offset": offsets,
        }

    def choice(self, text: str, tokens: list[tuple[str, float]], reason: str | None, chunk: bool) -> dict:
        logprobs = None if self.logprobs is None else self._logprobs(tokens)
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}


class ChatFormat(Format):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def start(self) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def choice(self, text: str, tokens: list[tuple[str, float]], reason: str | None, chunk: bool) -> dict:
        logprobs = None
        if self.logprobs is not None:
            content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in tokens]
            logprobs = {"content": content}
        message = ({"content": text} if text else {}) if chunk else {"role": "assistant", "content": text}
        return {"index": 0, "delta" if chunk else "message": message, "logprobs": logprobs, "finish_reason": reason}


@dataclass
class Reply:
    """One request's response, built from its Triton deltas."""

    body: GenerationRequest
    fmt: Format
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.fmt.id_prefix}-{uuid.uuid4().hex}"

    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.body.model, "choices": choices}
        return head | extra

    def full(self, deltas: list[Delta]) -> dict[str, Any]:
        final = deltas[-1]
        tokens = [t for d in deltas for t in self.fmt.tokens(d)]
        choice = self.fmt.choice("".join(d.text for d in deltas), tokens, final.finish_reason, chunk=False)
        return self.envelope(self.fmt.object, [choice], usage=usage(final.stats), speculation=speculation(final.stats))

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        tokens = self.fmt.tokens(delta)
        if not (delta.text or tokens or delta.final):
            return []
        extra: dict[str, Any] = {"usage": None} if self.body.include_usage else {}
        if self.body.continuous_usage:
            extra["usage"] = usage(delta.stats) if delta.final else running_usage(delta.num_tokens)
        if delta.final:
            extra["speculation"] = speculation(delta.stats)
        choice = self.fmt.choice(delta.text, tokens, delta.finish_reason if delta.final else None, chunk=True)
        out = [self.envelope(self.fmt.chunk_object, [choice], **extra)]
        if delta.final and self.body.include_usage:
            out.append(self.envelope(self.fmt.chunk_object, [], usage=usage(delta.stats)))
        return out
