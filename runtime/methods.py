"""Running a list of prompts to completion with one decoding method: the entry point of
the CLI, the benchmarks and the tests (servers drive `LLMEngine` step by step instead)."""

from __future__ import annotations

from typing import Any

from runtime.engine import Engine
from runtime.llm_engine import METHODS, LLMEngine, RuntimeConfig
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams

__all__ = ["METHODS", "generate"]


def generate(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    method: str | None = None,
    config: RuntimeConfig | None = None,
    **overrides: Any,
) -> list[GenerationResult]:
    """Run `method` (default: the engine's drafter, else auto-regressive) with in-flight
    batching of up to max_batch_size requests."""
    return LLMEngine(engine, config).generate(prompts, params, method, **overrides)
