"""Turning a Triton request's tensors into a generation request, with messages that say
what to fix. Tensor names and dtypes are those of Triton's TensorRT-LLM ensemble and BLS
models (`text_input`, `max_tokens`, `temperature`, `top_k`, `top_p`, `random_seed` or
`seed`, `stream`, `end_id`, `pad_id`, `stop_words`, `bad_words`, `min_length` or
`min_tokens`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`,
`length_penalty`, `beam_width`, `return_log_probs`, `exclude_input_in_output`, ...) plus
specpipe's `ignore_eos`, `method`, `redrafter_beam_width`, `redrafter_beam_length`,
`rsd_branching`, so existing clients work unchanged. Inputs of the ensemble that cannot
apply to this engine (logits, prompt tables, LoRA, multimodal, guided decoding, external
draft tokens: `UNSUPPORTED`) are declared too, so clients that send them get an answer
rather than Triton's "unexpected input": an empty or false value is accepted, anything
else is refused naming the input and why; nothing is ignored silently. Triton itself
rejects wrong dtypes and shapes against config.pbtxt before the model sees a request;
what remains is checked here (limits the engine knows are checked when the request is
added).

Every door refuses what cannot be served before it costs anything: non-finite floats and
out-of-range values (`SamplingParams`), and prompts longer in bytes than the engine's
`max_input_len` could ever hold, before they are decoded or tokenized (`prompt_byte_limit`).
What Triton converts before our code sees it is out of our reach: its HTTP `/generate`
JSON parser wraps integers into the declared INT32 and answers 500 on a wrong JSON type
(README, "Input validation")."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
"""Bounds on `stop_words` and on `bad_words` (each): the response thread searches the text
for each stop word after every step, and every bad word is matched at every drafted tree
node, so one request with a million of them would slow every stream."""

EXCLUDE_INPUT_DEFAULT = True
"""`exclude_input_in_output` when a request does not send it: the text without the prompt.
TensorRT-LLM's backend defaults to including it (its `exclude_input_in_output` model
parameter unset), but the repositories NVIDIA documents set it to true, genai-perf sends
true, and specpipe's clients have always received the completion alone."""

BEAM_SEARCH_REFUSED = (
    "beam_width {width}: specpipe decodes one beam; beam search is not supported; use beam_width 1 or omit it "
    "(redrafter_beam_width sets ReDrafter's draft beams)"
)


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
    exclude_input_in_output: bool = EXCLUDE_INPUT_DEFAULT
    """False: a non-streaming response's `text_output` starts with the prompt text (as
    TensorRT-LLM; streamed deltas never repeat the prompt, as there)."""
    bad_words: list[str] = field(default_factory=list)
    """As sent; `AdmissionCheck.parse` tokenizes them into `params.bad_words`."""


Get = Callable[[str], np.ndarray | None]


def _scalar(get: Get, name: str) -> Any:
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


def _float(get: Get, name: str, default: float) -> float:
    value = _scalar(get, name)
    return default if value is None else float(value)


def _one_of(get: Get, names: tuple[str, str]) -> Any:
    """The value of whichever of two synonymous inputs was sent (older and newer TensorRT-LLM
    ensembles name them differently); both with different values is refused."""
    first, second = (_scalar(get, n) for n in names)
    if first is not None and second is not None and first != second:
        raise InvalidInput(f"{names[0]} ({first}) and {names[1]} ({second}) name the same setting; send one of them")
    return first if first is not None else second


def _words(get: Get, name: str) -> list[str]:
    """A STRING list input (`stop_words`, `bad_words`): bounded, UTF-8; empty strings are
    skipped, as TensorRT-LLM's preprocessing skips words that tokenize to nothing (its
    clients send [""] for "none")."""
    value = get(name)
    if value is None:
        return []
    flat = value.reshape(-1)
    if flat.size > MAX_STOP_WORDS or sum(len(w) if isinstance(w, bytes | np.bytes_) else 0 for w in flat) > (
        MAX_STOP_BYTES
    ):
        raise InvalidInput(
            f"{name}: send at most {MAX_STOP_WORDS} words of {MAX_STOP_BYTES} bytes in all "
            "(every request's words are matched at every step)"
        )
    return [w for w in (_text(w, name) for w in flat) if w]


def _true(value: np.ndarray) -> bool:
    return bool(np.any(value))


def _non_empty(value: np.ndarray) -> bool:
    return value.size > 0


def _non_empty_text(value: np.ndarray) -> bool:
    return any(len(w) > 0 if isinstance(w, bytes | np.bytes_ | str) else True for w in value.reshape(-1))


def _non_zero(value: np.ndarray) -> bool:
    return bool(np.any(value != 0))


UNSUPPORTED: dict[str, tuple[Callable[[np.ndarray], bool], str]] = {
    "return_context_logits": (_true, "specpipe returns no logits; use return_log_probs for per-token log probs"),
    "return_generation_logits": (_true, "specpipe returns no logits; use return_log_probs for per-token log probs"),
    "return_perf_metrics": (
        _true,
        "specpipe returns num_input_tokens, num_output_tokens, num_draft_tokens, num_accepted_tokens and "
        "num_forwards on every final response and per-request timings as Prometheus metrics, not TensorRT-LLM's "
        "perf-metric outputs",
    ),
    "num_return_sequences": (
        lambda v: bool(np.any(v != 1)),
        "specpipe returns one sequence per request; send 1 or omit it, and send several requests for several",
    ),
    "prompt_embedding_table": (_non_empty, "specpipe engines have no prompt-tuning (p-tuning) tables"),
    "prompt_vocab_size": (_non_zero, "specpipe engines have no prompt-tuning (p-tuning) tables"),
    "prompt_table_extra_id": (_non_zero, "specpipe engines have no prompt-tuning (p-tuning) tables"),
    "embedding_bias_words": (_non_empty_text, "specpipe does not bias logits by word; use bad_words to ban words"),
    "embedding_bias_weights": (_non_zero, "specpipe does not bias logits by word; use bad_words to ban words"),
    "lora_task_id": (_non_empty, "specpipe engines serve no LoRA adapters"),
    "lora_weights": (_non_empty, "specpipe engines serve no LoRA adapters"),
    "lora_config": (_non_empty, "specpipe engines serve no LoRA adapters"),
    "guided_decoding_guide_type": (_non_empty_text, "specpipe has no guided (structured) decoding"),
    "guided_decoding_guide": (_non_empty_text, "specpipe has no guided (structured) decoding"),
    "decoder_text_input": (_non_empty_text, "specpipe serves decoder-only models (no encoder-decoder input)"),
    "image_input": (_non_empty, "specpipe serves text-only models (no multimodal input)"),
    "image_bytes_input": (_non_empty, "specpipe serves text-only models (no multimodal input)"),
    "image_url_input": (_non_empty_text, "specpipe serves text-only models (no multimodal input)"),
    "video_bytes_input": (_non_empty, "specpipe serves text-only models (no multimodal input)"),
    "draft_input_ids": (
        _non_empty,
        "specpipe drafts its own tokens (method, redrafter_beam_width, ...); external draft tokens are not taken",
    ),
    "draft_logits": (_non_empty, "specpipe drafts its own tokens; external draft logits are not taken"),
    "use_draft_logits": (_true, "specpipe drafts its own tokens; external draft logits are not taken"),
}
"""Inputs of TensorRT-LLM's ensemble / BLS / tensorrt_llm models that this engine cannot
honour: declared in config.pbtxt, accepted when empty/false (what their clients send by
default), else refused with (input, why). `return_num_input_tokens` and
`return_num_output_tokens` are not here: every final response carries both counts."""


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """Most UTF-8 bytes one token of `tokenizer` decodes to."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(tokenizer.get_vocab_size()))


def prompt_byte_limit(config: EngineConfig, tokenizer: Tokenizer) -> int:
    """Longest prompt, in bytes, that can tokenize to at most `max_input_len` tokens: longer
    ones are refused before decoding or tokenizing them (no token covers more bytes than
    the longest one)."""
    return config.build.max_input_len * longest_token_bytes(tokenizer)


def _refuse_unsupported(get: Get) -> None:
    for name, (sent, why) in UNSUPPORTED.items():
        value = get(name)
        if value is not None and sent(value):
            raise InvalidInput(f"{name}: {why}")
    beam_width = _scalar(get, "beam_width")
    if beam_width is not None and int(beam_width) != 1:
        if int(beam_width) < 1:
            raise InvalidInput(f"beam_width must be >= 1, got {int(beam_width)}; use beam_width 1 or omit it")
        raise InvalidInput(BEAM_SEARCH_REFUSED.format(width=int(beam_width)))
    length_penalty = _scalar(get, "length_penalty")
    if length_penalty is not None and not math.isfinite(float(length_penalty)):
        raise InvalidInput(f"length_penalty must be a finite number, got {float(length_penalty)}")
    pad_id = _scalar(get, "pad_id")
    if pad_id is not None and int(pad_id) < 0:
        raise InvalidInput(f"pad_id must be a token id >= 0, got {int(pad_id)} (INT32: larger values wrap negative)")


def parse_request(get: Get, max_prompt_bytes: int | None = None) -> GenerateRequest:
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
    _refuse_unsupported(get)
    max_tokens = _scalar(get, "max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    if max_tokens <= 0:
        raise InvalidInput(f"max_tokens must be >= 1, got {max_tokens}")
    top_k = _scalar(get, "top_k")
    seed = _one_of(get, ("random_seed", "seed"))
    end_id = _scalar(get, "end_id")
    ignore_eos = _scalar(get, "ignore_eos")
    if end_id is not None and int(end_id) < 0:
        raise InvalidInput(f"end_id must be a token id >= 0, got {int(end_id)} (INT32: larger values wrap negative)")
    min_tokens = _one_of(get, ("min_length", "min_tokens"))
    if min_tokens is not None and int(min_tokens) < 0:
        raise InvalidInput(f"min_length / min_tokens must be >= 0, got {int(min_tokens)}")
    return_log_probs = _scalar(get, "return_log_probs")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_float(get, "temperature", 0.0),
            top_k=0 if top_k is None else int(top_k),
            top_p=_float(get, "top_p", 1.0),
            seed=None if seed is None else int(seed),
            stop_token_ids=() if end_id is None else (int(end_id),),
            ignore_eos=bool(ignore_eos) or end_id is not None,  # end_id replaces the engine's EOS
            min_tokens=0 if min_tokens is None else int(min_tokens),
            repetition_penalty=_float(get, "repetition_penalty", 1.0),
            presence_penalty=_float(get, "presence_penalty", 0.0),
            frequency_penalty=_float(get, "frequency_penalty", 0.0),
            logprobs=bool(return_log_probs),
        )
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    stop_words = _words(get, "stop_words")
    bad_words = _words(get, "bad_words")
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
    exclude = _scalar(get, "exclude_input_in_output")
    return GenerateRequest(
        text,
        params,
        bool(stream),
        stop_words,
        method,
        overrides,
        exclude_input_in_output=EXCLUDE_INPUT_DEFAULT if exclude is None else bool(exclude),
        bad_words=bad_words,
    )


def tokenize_bad_words(tokenizer: Tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids without special tokens, as TensorRT-LLM's preprocessing does:
    a word is banned as that exact token sequence, so " list" and "list" are two words to a
    byte-level BPE tokenizer. Words that tokenize to nothing are skipped."""
    encoded = (tuple(tokenizer.encode(w, add_special_tokens=False).ids) for w in words)
    return tuple(ids for ids in encoded if ids)


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

    def parse(self, get: Get) -> tuple[GenerateRequest, list[int]]:
        """The request (bad words tokenized into its params) and its prompt ids; raises
        InvalidInput (a ValueError) naming the fix."""
        request = parse_request(get, self.max_prompt_bytes)
        if request.bad_words:
            try:
                request.params = replace(
                    request.params, bad_words=tokenize_bad_words(self.tokenizer, request.bad_words)
                )
            except ValueError as e:
                raise InvalidInput(str(e)) from None
        prompt = self.tokenizer.encode(request.text).ids
        try:
            check_request(self.config, prompt, request.params)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        return request, prompt

    def __call__(self, get: Get) -> str | None:
        """None if the request is acceptable, else what to fix."""
        try:
            self.parse(get)
        except ValueError as e:  # InvalidInput included
            return str(e)
        return None
