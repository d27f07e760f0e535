"""Shared fixtures: small real checkpoints written by transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from training.tokenizer import save_hf_tokenizer, train_tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer GQA Llama saved by transformers, with a byte-level BPE tokenizer
    of 300 tokens (model vocab 320: padded, as real checkpoints often are)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = train_tokenizer(
        ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 50, vocab_size=300
    )
    save_hf_tokenizer(tok, out, model_max_length=128)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out
