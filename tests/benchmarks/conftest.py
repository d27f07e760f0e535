"""The demo engines the benchmark tests run: one per drafter kind, built once for them all."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine_dir import BuildConfig
from tests.demo_engines import demo_engines

BUILD = BuildConfig(max_batch_size=2, max_input_len=512, max_seq_len=1024)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`demo_engines` with `BUILD` limits ("redrafter", "draft-lm", "lyanna"); tests only read them."""
    return demo_engines(tmp_path_factory, BUILD)
