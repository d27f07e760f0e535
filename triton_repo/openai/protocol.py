"""OpenAI request bodies (the subset specpipe serves, plus its extensions) and error objects.

Pydantic checks types strictly (`"5"` is no integer, `true` no number) and refuses unknown
fields, as OpenAI does. Ranges the engine checks (temperature >= 0 and finite, top_p in
(0, 1], max_tokens against the engine's limits, ...) are left to it: Triton's message
becomes the 400 message, so every door refuses a request with the same words.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Number = Annotated[float, Field(strict=True)]
"""A JSON number (an integer is fine, a string is not)."""


class APIError(Exception):
    """An OpenAI-style error: HTTP status + `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    """vLLM's extension: every chunk carries `usage` with the completion tokens so far
    (`prompt_tokens` is null until the last chunk: Triton reports it at the end)."""


class GenerationRequest(_Strict):
    """Fields both endpoints share."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    """OpenAI's default is 1 (sampling); send 0 for greedy."""
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    """Accepted and ignored."""
    # specpipe extensions (Triton inputs of the same meaning)
    top_k: StrictInt | None = None
    min_tokens: StrictInt | None = None
    repetition_penalty: Number | None = None
    bad_words: list[StrictStr] | None = None
    ignore_eos: StrictBool | None = None
    method: StrictStr | None = None
    redrafter_beam_width: StrictInt | None = None
    redrafter_beam_length: StrictInt | None = None
    rsd_branching: list[StrictInt] | None = None

    def check(self) -> None:
        """OpenAI-level checks the engine does not make; raises APIError (400)."""
        if self.n != 1:
            raise bad_request(f"n must be 1, got {self.n}: specpipe returns one choice per request", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported (use bad_words to forbid token sequences)", "logit_bias")

    def completion_limit(self) -> int | None:
        return self.max_tokens

    def triton_fields(self, default_max_tokens: int) -> dict[str, tuple[str, Any]]:
        """{Triton input: (request field, value)} of everything this request sets."""
        limit = self.completion_limit()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        fields: dict[str, tuple[str, Any]] = {
            "max_tokens": ("max_tokens", default_max_tokens if limit is None else limit),
            "temperature": ("temperature", self.temperature),
            "top_p": ("top_p", self.top_p),
            "top_k": ("top_k", self.top_k),
            "random_seed": ("seed", self.seed),
            "stop_words": ("stop", stop or None),
            "min_length": ("min_tokens", self.min_tokens),
            "repetition_penalty": ("repetition_penalty", self.repetition_penalty),
            "presence_penalty": ("presence_penalty", self.presence_penalty),
            "frequency_penalty": ("frequency_penalty", self.frequency_penalty),
            "bad_words": ("bad_words", self.bad_words or None),
            "ignore_eos": ("ignore_eos", self.ignore_eos),
            "method": ("method", self.method),
            "redrafter_beam_width": ("redrafter_beam_width", self.redrafter_beam_width),
            "redrafter_beam_length": ("redrafter_beam_length", self.redrafter_beam_length),
            "rsd_branching": ("rsd_branching", self.rsd_branching),
        }
        return {name: field for name, field in fields.items() if field[1] is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    logprobs: StrictInt | None = None
    """0 or 1: each generated token's log probability (we have no alternatives to list)."""
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= 1:
            raise bad_request(
                f"logprobs must be 0 or 1, got {self.logprobs}: specpipe returns the log probability of each "
                "generated token only, not of alternatives",
                "logprobs",
            )
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1 or not isinstance(self.prompt[0], str):
            raise bad_request("prompt must be one string (a list of one string; no token ids, no batches)", "prompt")
        return self.prompt[0]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs:
            raise bad_request(
                f"top_logprobs must be 0, got {self.top_logprobs}: specpipe returns the log probability of each "
                "generated token only, not of alternatives",
                "top_logprobs",
            )
        if self.tools or self.tool_choice not in (None, "none"):
            raise bad_request("tools are not supported", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
