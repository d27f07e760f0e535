"""The demo tokenizer's settings, as training writes them, are the ones committed with the
demo model (so `make model` keeps the chat template the OpenAI server renders)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from runtime.engine_dir import TOKENIZER_CONFIG_FILE
from training.tokenizer import save_hf_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-target"


def test_training_writes_the_committed_tokenizer_config(tmp_path: Path) -> None:
    committed = json.loads((DEMO / TOKENIZER_CONFIG_FILE).read_text())
    save_hf_tokenizer(Tokenizer.from_file(str(DEMO / "tokenizer.json")), tmp_path, committed["model_max_length"])
    assert json.loads((tmp_path / TOKENIZER_CONFIG_FILE).read_text()) == committed
    assert "messages" in committed["chat_template"]
