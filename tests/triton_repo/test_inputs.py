"""Request tensors -> a generation request, refused with a message naming the input and the
fix before anything costly happens (the same checks run behind every Triton door; the
server tests send them through a real tritonserver)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.engine_dir import BuildConfig
from tests.demo_engines import demo_redrafter_engine
from triton_repo.inputs import (
    BEAM_SEARCH_REFUSED,
    MAX_STOP_WORDS,
    UNSUPPORTED,
    AdmissionCheck,
    InvalidInput,
    longest_token_bytes,
    parse_request,
)

DTYPES = {
    "max_tokens": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "end_id": np.int32,
    "pad_id": np.int32,
    "random_seed": np.uint64,
    "seed": np.uint64,
    "min_length": np.int32,
    "min_tokens": np.int32,
    "beam_width": np.int32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "length_penalty": np.float32,
    "return_log_probs": np.bool_,
    "exclude_input_in_output": np.bool_,
    "return_num_input_tokens": np.bool_,
    "return_num_output_tokens": np.bool_,
    "stream": np.bool_,
}
"""config.pbtxt's dtypes of the scalar inputs these tests send."""


def tensors(**values: Any) -> Any:
    """`get` over numpy tensors of the dtypes config.pbtxt declares (arrays pass as they are)."""
    arrays = {}
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, list):
            arrays[name] = np.array([v.encode() for v in value], dtype=np.object_)
        elif isinstance(value, str | bytes):
            arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        else:
            arrays[name] = np.array([value], dtype=DTYPES[name])
    return arrays.get


@pytest.fixture(scope="module")
def admission(tmp_path_factory: pytest.TempPathFactory) -> AdmissionCheck:
    build = BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=64)
    engine_dir: Path = demo_redrafter_engine(tmp_path_factory, build)
    return AdmissionCheck.for_engine(engine_dir)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
        ({"end_id": -(2**31)}, "end_id must be a token id >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop_words": ["x"] * (MAX_STOP_WORDS + 1)}, f"at most {MAX_STOP_WORDS} words"),
        ({"stop_words": ["y" * 20000]}, "bytes in all"),
        ({"bad_words": ["x"] * (MAX_STOP_WORDS + 1)}, f"bad_words: send at most {MAX_STOP_WORDS} words"),
        ({"beam_width": 2}, BEAM_SEARCH_REFUSED.format(width=2)),
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"min_length": 9, "max_tokens": 8}, "min_tokens (9) must be <= max_tokens (8)"),
        ({"min_length": -1}, "min_length / min_tokens must be >= 0"),
        ({"min_length": 3, "min_tokens": 4}, "min_length (3) and min_tokens (4) name the same setting"),
        ({"random_seed": 1, "seed": 2}, "random_seed (1) and seed (2) name the same setting"),
        ({"pad_id": -5}, "pad_id must be a token id >= 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number"),
        ({"length_penalty": float("inf")}, "length_penalty must be a finite number"),
    ],
)
def test_bad_values_are_refused(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        parse_request(tensors(text_input="x", **inputs))


def test_tiny_temperature_parses_as_greedy() -> None:
    assert parse_request(tensors(text_input="x", temperature=1e-38)).params.greedy


def test_a_prompt_too_long_in_bytes_is_refused_before_decoding(admission: AdmissionCheck) -> None:
    assert admission.max_prompt_bytes == 32 * longest_token_bytes(admission.tokenizer)
    too_long = b"\xff" * (admission.max_prompt_bytes + 1)  # not even UTF-8: never decoded
    with pytest.raises(InvalidInput, match=r"more than the .* bytes the engine's max_input_len"):
        admission.parse(tensors(text_input=too_long))
    with pytest.raises(InvalidInput, match="max_input_len 32"):  # fits in bytes, not in tokens
        admission.parse(tensors(text_input="x " * 40))
    request, prompt = admission.parse(tensors(text_input="def f(x):", max_tokens=8))
    assert request.params.max_tokens == 8 and prompt == admission.tokenizer.encode("def f(x):").ids


def test_tensorrt_llm_inputs_map_to_the_request() -> None:
    request = parse_request(
        tensors(
            text_input="x",
            max_tokens=16,
            min_length=5,
            repetition_penalty=1.25,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            return_log_probs=True,
            exclude_input_in_output=False,
            seed=7,
            pad_id=0,
            beam_width=1,
            length_penalty=1.5,  # beam search only: nothing to do with one beam, as in TensorRT-LLM
            return_num_input_tokens=True,  # every final response carries the counts anyway
            return_num_output_tokens=False,
            stop_words=["", "\n\n"],  # an empty word is no word, as in TensorRT-LLM's preprocessing
            bad_words=["", " list", "x"],
        )
    )
    p = request.params
    assert (p.min_tokens, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (5, 1.25, 0.5, -0.25)
    assert p.logprobs and p.seed == 7 and p.max_tokens == 16
    assert not request.exclude_input_in_output
    assert request.stop_words == ["\n\n"] and request.bad_words == [" list", "x"]
    assert parse_request(tensors(text_input="x", min_tokens=3)).params.min_tokens == 3
    assert parse_request(tensors(text_input="x", random_seed=4, seed=4)).params.seed == 4


def test_defaults_exclude_the_prompt_and_change_nothing() -> None:
    request = parse_request(tensors(text_input="x"))
    assert request.exclude_input_in_output and request.bad_words == [] and request.stop_words == []
    p = request.params
    assert (p.min_tokens, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logprobs) == (
        0,
        1.0,
        0.0,
        0.0,
        False,
    )


f16, u8 = np.float16, np.uint8
SENT_AND_EMPTY: dict[str, tuple[np.ndarray, np.ndarray]] = {
    "return_context_logits": (np.array([True]), np.array([False])),
    "return_generation_logits": (np.array([True]), np.array([False])),
    "return_perf_metrics": (np.array([True]), np.array([False])),
    "num_return_sequences": (np.array([2], np.int32), np.array([1], np.int32)),
    "prompt_embedding_table": (np.ones((2, 4), f16), np.zeros((0, 4), f16)),
    "prompt_vocab_size": (np.array([2], np.int32), np.array([0], np.int32)),
    "prompt_table_extra_id": (np.array([3], np.uint64), np.array([0], np.uint64)),
    "embedding_bias_words": (np.array([b"x"], np.object_), np.array([b""], np.object_)),
    "embedding_bias_weights": (np.array([0.5], np.float32), np.zeros((0,), np.float32)),
    "lora_task_id": (np.array([1], np.uint64), np.zeros((0,), np.uint64)),
    "lora_weights": (np.ones((1, 8), f16), np.zeros((0, 8), f16)),
    "lora_config": (np.array([[0, 0, 8]], np.int32), np.zeros((0, 3), np.int32)),
    "guided_decoding_guide_type": (np.array([b"json"], np.object_), np.array([b""], np.object_)),
    "guided_decoding_guide": (np.array([b"{}"], np.object_), np.array([b""], np.object_)),
    "decoder_text_input": (np.array([b"x"], np.object_), np.array([b""], np.object_)),
    "image_input": (np.ones((1, 3, 2, 2), f16), np.zeros((0, 3, 2, 2), f16)),
    "image_bytes_input": (np.ones((1, 2, 2, 3), u8), np.zeros((0, 2, 2, 3), u8)),
    "image_url_input": (np.array([b"file:///x.png"], np.object_), np.array([b""], np.object_)),
    "video_bytes_input": (np.ones((1, 2, 2, 3), u8), np.zeros((0, 2, 2, 3), u8)),
    "draft_input_ids": (np.array([1, 2], np.int32), np.zeros((0,), np.int32)),
    "draft_logits": (np.ones((1, 4), np.float32), np.zeros((0, 4), np.float32)),
    "use_draft_logits": (np.array([True]), np.array([False])),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_inputs_that_cannot_apply_are_refused_when_sent_and_accepted_when_empty(name: str) -> None:
    assert set(SENT_AND_EMPTY) == set(UNSUPPORTED)
    sent, empty = SENT_AND_EMPTY[name]
    with pytest.raises(InvalidInput, match=f"^{name}: specpipe "):
        parse_request(tensors(text_input="x", **{name: sent}))
    parse_request(tensors(text_input="x", **{name: empty}))


def test_bad_words_are_tokenized_without_special_tokens(admission: AdmissionCheck) -> None:
    request, _ = admission.parse(tensors(text_input="def f(x):", max_tokens=8, bad_words=[" list", "", "x"]))
    encode = admission.tokenizer.encode
    assert request.params.bad_words == (
        tuple(encode(" list", add_special_tokens=False).ids),
        tuple(encode("x", add_special_tokens=False).ids),
    )
    assert all(0 not in word for word in request.params.bad_words), "no BOS"
