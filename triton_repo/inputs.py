"""Turning a Triton request's tensors into a generation request, with messages that say
what to fix. Tensor names are those of Triton's TensorRT-LLM ensemble (`text_input`,
`max_tokens`, `temperature`, `top_k`, `top_p`, `random_seed`, `stream`, `end_id`,
`stop_words`) plus specpipe's `ignore_eos`, `method`, `redrafter_beam_width`,
`redrafter_beam_length`, `rsd_branching`, so existing clients work unchanged. Triton
itself rejects wrong dtypes and shapes against config.pbtxt before the model sees a
request; what remains is checked here (limits the engine knows are checked when the
request is added).

Every door refuses what cannot be served before it costs anything: non-finite floats and
out-of-range values (`SamplingParams`), and prompts longer in bytes than the engine's
`max_input_len` could ever hold, before they are decoded or tokenized (`prompt_byte_limit`).
What Triton converts before our code sees it is out of our reach: its HTTP `/generate`
JSON parser wraps integers into the declared INT32 and answers 500 on a wrong JSON type
(README, "Input validation")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from runtime.config import check_request
from runtime.engine_dir import EngineConfig
from runtime.proposers.registry import METHODS
from runtime.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 64
"""When a request gives no max_tokens (the TensorRT-LLM ensemble requires it; we default)."""


MAX_STOP_WORDS = 256
MAX_STOP_BYTES = 16384
"""Bounds on `stop_words`: the response thread searches the text for each of them after
every step, so one request with a million stop words would slow every stream."""


class InvalidInput(ValueError):
    """The request cannot be served as sent; the message names the input and the fix."""


@dataclass
class GenerateRequest:
    text: str
    params: SamplingParams
    stream: bool = False
    stop_words: list[str] = field(default_factory=list)
    method: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def _scalar(get: Callable[[str], np.ndarray | None], name: str) -> Any:
    value = get(name)
    if value is None:
        return None
    if value.size != 1:
        raise InvalidInput(f"{name} must hold exactly one value, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _text(raw: Any, name: str) -> str:
    if not isinstance(raw, bytes | np.bytes_):
        raise InvalidInput(f"{name} must be BYTES (UTF-8 text)")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from None


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """Most UTF-8 bytes one token of `tokenizer` decodes to."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(tokenizer.get_vocab_size()))


def prompt_byte_limit(config: EngineConfig, tokenizer: Tokenizer) -> int:
    """Longest prompt, in bytes, that can tokenize to at most `max_input_len` tokens: longer
    ones are refused before decoding or tokenizing them (no token covers more bytes than
    the longest one)."""
    return config.build.max_input_len * longest_token_bytes(tokenizer)


def parse_request(get: Callable[[str], np.ndarray | None], max_prompt_bytes: int | None = None) -> GenerateRequest:
    """`get(name)` returns the input tensor as a numpy array, or None when absent; a
    `text_input` over `max_prompt_bytes` is refused before it is decoded."""
    raw = _scalar(get, "text_input")
    if raw is None:
        raise InvalidInput("text_input is required: the prompt as a BYTES tensor of shape [1]")
    if max_prompt_bytes is not None and isinstance(raw, bytes | np.bytes_) and len(raw) > max_prompt_bytes:
        raise InvalidInput(
            f"text_input is {len(raw)} bytes, more than the {max_prompt_bytes} bytes the engine's max_input_len "
            "tokens can hold; send a shorter prompt or rebuild with a larger --max-input-len"
        )
    text = _text(raw, "text_input")
    if not text:
        raise InvalidInput("text_input is empty: send a prompt of at least one character")
    max_tokens = _scalar(get, "max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    if max_tokens <= 0:
        raise InvalidInput(f"max_tokens must be >= 1, got {max_tokens}")
    temperature = _scalar(get, "temperature")
    top_k = _scalar(get, "top_k")
    top_p = _scalar(get, "top_p")
    seed = _scalar(get, "random_seed")
    end_id = _scalar(get, "end_id")
    ignore_eos = _scalar(get, "ignore_eos")
    if end_id is not None and int(end_id) < 0:
        raise InvalidInput(f"end_id must be a token id >= 0, got {int(end_id)} (INT32: larger values wrap negative)")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature is None else float(temperature),
            top_k=0 if top_k is None else int(top_k),
            top_p=1.0 if top_p is None else float(top_p),
            seed=None if seed is None else int(seed),
            stop_token_ids=() if end_id is None else (int(end_id),),
            ignore_eos=bool(ignore_eos) or end_id is not None,  # end_id replaces the engine's EOS
        )
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    stop = get("stop_words")
    if stop is not None and (stop.size > MAX_STOP_WORDS or sum(len(w) for w in stop.reshape(-1)) > MAX_STOP_BYTES):
        raise InvalidInput(
            f"stop_words: send at most {MAX_STOP_WORDS} words of {MAX_STOP_BYTES} bytes in all "
            "(every streamed delta is searched for each of them)"
        )
    stop_words = [] if stop is None else [_text(w, "stop_words") for w in stop.reshape(-1)]
    if any(not w for w in stop_words):
        raise InvalidInput("stop_words must not contain empty strings")
    method = _scalar(get, "method")
    method = None if method is None else _text(method, "method")
    if method is not None and method not in METHODS:
        raise InvalidInput(f"method {method!r} is not one of {METHODS}")
    overrides: dict[str, Any] = {}
    for name in ("beam_width", "beam_length"):  # prefixed: the TRT-LLM ensemble's beam_width means beam search
        value = _scalar(get, f"redrafter_{name}")
        if value is not None:
            overrides[name] = int(value)
    branching = get("rsd_branching")
    if branching is not None:
        factors = tuple(int(b) for b in branching.reshape(-1))
        if not factors or min(factors) < 1:
            raise InvalidInput(f"rsd_branching must be factors >= 1 (children per node at each depth), got {factors}")
        overrides["branching"] = factors
    stream = _scalar(get, "stream")
    return GenerateRequest(text, params, bool(stream), stop_words, method, overrides)


@dataclass
class AdmissionCheck:
    """Everything a front end can check without the engine's weights: the prompt's size in
    bytes, the inputs, then the tokenized prompt against the engine's build limits."""

    config: EngineConfig
    tokenizer: Tokenizer
    max_prompt_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_prompt_bytes = prompt_byte_limit(self.config, self.tokenizer)

    @classmethod
    def for_engine(cls, engine_dir: str | Path) -> AdmissionCheck:
        config = EngineConfig.load(Path(engine_dir))
        return cls(config, Tokenizer.from_file(str(Path(engine_dir) / config.tokenizer)))

    def parse(self, get: Callable[[str], np.ndarray | None]) -> tuple[GenerateRequest, list[int]]:
        """The request and its prompt ids; raises InvalidInput (a ValueError) naming the fix."""
        request = parse_request(get, self.max_prompt_bytes)
        prompt = self.tokenizer.encode(request.text).ids
        try:
            check_request(self.config, prompt, request.params)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        return request, prompt

    def __call__(self, get: Callable[[str], np.ndarray | None]) -> str | None:
        """None if the request is acceptable, else what to fix."""
        try:
            self.parse(get)
        except ValueError as e:  # InvalidInput included
            return str(e)
        return None
