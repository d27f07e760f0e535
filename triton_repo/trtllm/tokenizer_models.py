"""Tokenizer and detokenizer of the TensorRT-LLM Triton repository: the `preprocessing` (text ->
token ids) and `postprocessing` (token ids -> text) Python-backend models around `tensorrt_llm`.

`triton_repo.trtllm_repository` copies this file into both models' version directories, next to
a two-line model.py that picks the class (`TritonPreprocessing` or `TritonPostprocessing`).

Our code, written to the interface of TensorRT-LLM's own models (triton_backend/all_models/
inflight_batcher_llm/{preprocessing,postprocessing}: config.pbtxt and 1/model.py, commits in
triton_repo/trtllm_repository.py): the same tensor names and dtypes, the same parameters, the same
layouts (right-padded INPUT_ID, [batch, 2, n] word lists of flat ids + end offsets, end and pad ids
from the tokenizer unless the request gives them), for text-only decoder models: the multimodal
inputs are refused and the encoder-decoder outputs are a single pad token as upstream's are when
there is no DECODER_QUERY. The tokenizer is Hugging Face's `AutoTokenizer` from the models'
`tokenizer_dir` parameter (the target checkpoint's directory).

Only `TritonPreprocessing` and `TritonPostprocessing` touch `triton_python_backend_utils`, which
exists only inside Triton's Python-backend stub; `Preprocessor` and `Postprocessor` map numpy
arrays to numpy arrays and are tested without Triton (tests/triton_repo/test_trtllm_repository.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton: Preprocessor and Postprocessor still work
    pb_utils = None

TRUE_WORDS = ("true", "1", "t", "y", "yes")
FALSE_WORDS = ("false", "0", "f", "n", "no")
"""The spellings upstream's models accept for a boolean parameter."""
MULTIMODAL_INPUTS = ("IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES")
"""Declared by upstream's preprocessing config (so are ours), refused here: text-only models."""


def parameter(config: Mapping[str, Any], key: str) -> str:
    """A model config parameter's string value ("" when absent)."""
    return str(config.get("parameters", {}).get(key, {}).get("string_value", ""))


def bool_parameter(config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean parameter: one of TRUE_WORDS or FALSE_WORDS (any case); absent or "" gives `default`."""
    value = parameter(config, key).strip().lower()
    if not value:
        return default
    if value not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"parameter {key}: {value!r} is not a boolean ({'/'.join(TRUE_WORDS + FALSE_WORDS)})")
    return value in TRUE_WORDS


def load_tokenizer(config: Mapping[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer in the `tokenizer_dir` parameter's directory, loaded as upstream's models load
    it (`legacy=False`; no pad token -> the EOS token pads), less `trust_remote_code`."""
    tokenizer_dir = parameter(config, "tokenizer_dir")
    if not tokenizer_dir:
        raise ValueError("parameter tokenizer_dir is missing or empty: regenerate the repository")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, legacy=False)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no eos_token (the engine's default end id)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _strings(array: np.ndarray) -> list[str]:
    """A TYPE_STRING tensor's strings (UTF-8), flattened."""
    return [s.decode() if isinstance(s, bytes) else str(s) for s in array.reshape(-1)]


class Preprocessor:
    """Text to token ids, tensor by tensor as upstream's preprocessing model does it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, add_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.end_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [batch, longest] int32, right-padded with the pad id, and lengths [batch, 1] int32."""
        ids = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens) for t in texts]
        longest = max(len(i) for i in ids)
        padded = np.full((len(ids), longest), self.pad_id, dtype=np.int32)
        for row, tokens in zip(padded, ids, strict=True):
            row[: len(tokens)] = tokens
        return padded, np.array([[len(i)] for i in ids], dtype=np.int32)

    def word_lists(self, words: np.ndarray | None, batch_size: int) -> np.ndarray:
        """TensorRT-LLM's [batch, 2, n] int32 word lists from a [batch, words] TYPE_STRING tensor:
        row 0 the words' ids end to end (0-padded), row 1 where each word ends (-1-padded); words
        are tokenized alone, without special tokens; empty strings pad ragged lists. No tensor ->
        [batch, 2, 0]."""
        if words is None:
            return np.empty((batch_size, 2, 0), dtype=np.int32)
        flat: list[list[int]] = []
        ends: list[list[int]] = []
        for item in words:
            ids = [self.tokenizer.encode(text, add_special_tokens=False) for text in _strings(item)]
            ids = [i for i in ids if i]
            flat.append([t for i in ids for t in i])
            ends.append(np.cumsum([len(i) for i in ids]).tolist())
        width = max(1, *(len(f) for f in flat))
        out = np.zeros((len(flat), 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for row, ids_, ends_ in zip(out, flat, ends, strict=True):
            row[0, : len(ids_)] = ids_
            row[1, : len(ends_)] = ends_
        return out

    def embedding_bias(self, words: np.ndarray | None, weights: np.ndarray | None, batch_size: int) -> np.ndarray:
        """[batch, vocab] float32 logit biases: each word's weight added to each of its tokens (tokenized
        without special tokens); without both tensors [batch, 0], which the engine ignores."""
        if words is None or weights is None:
            return np.empty((batch_size, 0), dtype=np.float32)
        bias = np.zeros((len(words), len(self.tokenizer)), dtype=np.float32)
        for row, item_words, item_weights in zip(bias, words, weights, strict=True):
            if len(item_words) != len(item_weights):
                raise ValueError(
                    f"EMBEDDING_BIAS_WORDS has {len(item_words)} words but EMBEDDING_BIAS_WEIGHTS {len(item_weights)}"
                )
            for text, weight in zip(_strings(item_words), item_weights, strict=True):
                for token in self.tokenizer.encode(text, add_special_tokens=False):
                    row[token] += weight
        return bias

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's output tensors from its input tensors (by upstream's names)."""
        refused = [name for name in MULTIMODAL_INPUTS if name in inputs]
        if refused:
            raise ValueError(f"{', '.join(refused)}: this preprocessing model serves a text-only engine")
        query = inputs["QUERY"]
        batch = len(query)
        input_id, input_len = self.encode(_strings(query))
        end_id = inputs.get("END_ID", np.full((batch, 1), self.end_id, dtype=np.int32)).astype(np.int32)
        pad_id = inputs.get("PAD_ID", np.full((batch, 1), self.pad_id, dtype=np.int32)).astype(np.int32)
        if "DECODER_QUERY" in inputs:
            decoder_id, decoder_len = self.encode(_strings(inputs["DECODER_QUERY"]))
        else:
            decoder_id, decoder_len = pad_id.copy(), np.ones((batch, 1), dtype=np.int32)
        outputs = {
            "INPUT_ID": input_id,
            "REQUEST_INPUT_LEN": input_len,
            "DECODER_INPUT_ID": decoder_id,
            "REQUEST_DECODER_INPUT_LEN": decoder_len,
            "BAD_WORDS_IDS": self.word_lists(inputs.get("BAD_WORDS_DICT"), batch),
            "STOP_WORDS_IDS": self.word_lists(inputs.get("STOP_WORDS_DICT"), batch),
            "EMBEDDING_BIAS": self.embedding_bias(
                inputs.get("EMBEDDING_BIAS_WORDS"), inputs.get("EMBEDDING_BIAS_WEIGHTS"), batch
            ),
            "REQUEST_OUTPUT_LEN": inputs["REQUEST_OUTPUT_LEN"].astype(np.int32),
            "OUT_END_ID": end_id,
            "OUT_PAD_ID": pad_id,
        }
        if "PROMPT_TABLE_EXTRA_ID" in inputs:  # as upstream: the id on prompt-table tokens (past the vocab), else 0
            extra = inputs["PROMPT_TABLE_EXTRA_ID"].astype(np.uint64)
            table_tokens = input_id >= len(self.tokenizer)
            outputs["OUT_PROMPT_TABLE_EXTRA_IDS"] = np.where(table_tokens, extra, 0).astype(np.uint64)
        return outputs


class Postprocessor:
    """Token ids to text, as upstream's postprocessing model does it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """OUTPUT [batch, beams] UTF-8 bytes from TOKENS_BATCH [batch, beams, tokens] and
        SEQUENCE_LENGTH [batch, beams] (the tokens of each beam that count). In streaming each
        response's new tokens are decoded alone, as upstream does: a character split across two
        responses comes out as replacement characters."""
        tokens, lengths = inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"]
        beams = [
            beam[:length].tolist()
            for item, item_lengths in zip(tokens, lengths, strict=True)
            for beam, length in zip(item, item_lengths, strict=True)
        ]
        texts = self.tokenizer.batch_decode(beams, skip_special_tokens=self.skip_special_tokens)
        output = np.array([t.encode() for t in texts], dtype=object).reshape(tokens.shape[:2])
        return {"OUTPUT": output}


class _TritonModel:
    """The Python-backend side: parameters in, one response per request, errors as error responses."""

    step: Preprocessor | Postprocessor

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            try:
                outputs = self.step(inputs)
            except ValueError as e:  # bad input (UnicodeDecodeError included): this request fails, not the model
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses


class TritonPreprocessing(_TritonModel):
    """The `preprocessing` model: parameters tokenizer_dir, add_special_tokens (default true)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.step = Preprocessor(load_tokenizer(config), bool_parameter(config, "add_special_tokens", True))


class TritonPostprocessing(_TritonModel):
    """The `postprocessing` model: parameters tokenizer_dir, skip_special_tokens (default true)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.step = Postprocessor(load_tokenizer(config), bool_parameter(config, "skip_special_tokens", True))
