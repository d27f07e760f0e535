"""Choosing a decoding method for a run: auto-regressive or a speculative method the
engine carries a drafter for, with the engine's default settings overridable per run."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from runtime import ar, redrafter
from runtime.engine import Engine
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams

METHODS = ("ar", "redrafter")


def default_method(engine: Engine) -> str:
    return engine.config.drafter.kind if engine.config.drafter else "ar"


def redrafter_params(engine: Engine, overrides: dict[str, Any]) -> redrafter.ReDrafterParams:
    """The engine's built-in W/L, with any non-None override applied."""
    assert engine.config.drafter is not None
    spec = redrafter.ReDrafterParams(**engine.config.drafter.settings)
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


def generate(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    method: str | None = None,
    **overrides: Any,
) -> list[GenerationResult]:
    """Run `method` (default: the engine's drafter, else auto-regressive)."""
    method = method or default_method(engine)
    if method == "ar":
        return ar.generate(engine, prompts, params)
    if method == "redrafter":
        if engine.drafter is None:
            raise ValueError("this engine has no ReDrafter drafter; rebuild it with --drafter, or use --method ar")
        return redrafter.generate(engine, engine.drafter, prompts, params, redrafter_params(engine, overrides))
    raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
