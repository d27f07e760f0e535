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
from triton_repo.inputs import MAX_STOP_WORDS, AdmissionCheck, InvalidInput, longest_token_bytes, parse_request


def tensors(**values: Any) -> Any:
    """`get` over numpy tensors of the dtypes config.pbtxt declares."""
    dtypes = {"max_tokens": np.int32, "temperature": np.float32, "top_p": np.float32, "end_id": np.int32}
    arrays = {}
    for name, value in values.items():
        if isinstance(value, list):
            arrays[name] = np.array([v.encode() for v in value], dtype=np.object_)
        elif isinstance(value, str | bytes):
            arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        else:
            arrays[name] = np.array([value], dtype=dtypes[name])
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
