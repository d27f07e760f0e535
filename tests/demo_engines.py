"""Engines built from the bundled demo models, for tests that need a real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from build.engine import build_engine
from runtime.engine_dir import BuildConfig

MODELS = Path(__file__).resolve().parents[1] / "models"


def demo_redrafter_engine(tmp_path_factory: pytest.TempPathFactory, build: BuildConfig) -> Path:
    """The demo target + its trained ReDrafter (drafts get accepted), built with `build`
    limits into a fresh temporary directory."""
    out = tmp_path_factory.mktemp("engines") / "demo-redrafter"
    return build_engine(MODELS / "demo-target", out, build, drafter=MODELS / "demo-redrafter")


def demo_engines(tmp_path_factory: pytest.TempPathFactory, build: BuildConfig) -> dict[str, Path]:
    """One engine per drafter kind ("redrafter", "draft-lm", "lyanna"), each the demo target
    with its bundled drafter, built with `build` limits into a fresh temporary directory."""
    out, target = tmp_path_factory.mktemp("engines"), MODELS / "demo-target"
    return {
        "redrafter": build_engine(target, out / "rnn", build, drafter=MODELS / "demo-redrafter"),
        "draft-lm": build_engine(target, out / "lm", build, draft_model=MODELS / "demo-draft-lm"),
        "lyanna": build_engine(target, out / "lyanna", build, lyanna=MODELS / "demo-lyanna"),
    }
