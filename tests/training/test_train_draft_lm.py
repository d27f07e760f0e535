"""Draft-LM distillation: a few steps on a tiny student write a checkpoint that the
model loaders accept, with the target's vocabulary and tokenizer, and the KL to the
target goes down. Training runs on the CPU (the trainers take no device); the trained
checkpoint is run on the test device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_defs.checkpoint import load_llama_checkpoint
from model_defs.llama import LlamaForCausalLM
from tests.device import TEST_DEVICE
from training.model_card import write_draft_lm_card
from training.train_draft_lm import DraftLMTrainConfig, train

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "demo-target"


def test_distil_tiny_draft_lm(tmp_path: Path) -> None:
    cfg = DraftLMTrainConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        seq_len=32,
        batch_size=4,
        steps=12,
        lr=3e-3,
        warmup_steps=2,
        eval_every=6,
        eval_windows=8,
    )
    metrics = train(cfg, TARGET, tmp_path)

    target_cfg, _ = load_llama_checkpoint(TARGET)
    cfg_loaded, tensors = load_llama_checkpoint(tmp_path)
    assert cfg_loaded.vocab_size == target_cfg.vocab_size == 8192
    assert (cfg_loaded.bos_token_id, cfg_loaded.eos_token_id) == (target_cfg.bos_token_id, target_cfg.eos_token_id)
    assert cfg_loaded.max_position_embeddings == target_cfg.max_position_embeddings
    assert (cfg_loaded.hidden_size, cfg_loaded.num_hidden_layers) == (64, 1)
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "model.safetensors")).values())
    assert tensors["model.embed_tokens.weight"].shape == (8192, 64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TARGET / name).read_bytes()

    model = LlamaForCausalLM.from_pretrained(tmp_path).to(TEST_DEVICE)
    ids = torch.tensor([[0, 5, 17, 300]], device=TEST_DEVICE)
    with torch.no_grad():
        logits = model(ids, torch.arange(4, device=TEST_DEVICE)[None]).logits
    assert logits.shape == (1, 4, 8192) and torch.isfinite(logits).all()

    log = json.loads((tmp_path / "training_log.json").read_text())
    steps = [r["step"] for r in log["log"]]
    assert steps == [0, 6, 12]
    assert log["log"][-1]["train_kl"] < log["log"][1]["train_kl"]
    assert log["log"][-1]["heldout_kl"] < log["log"][0]["heldout_kl"]
    assert 0.0 <= metrics["heldout_acceptance"] <= 1.0 and 0.0 <= metrics["heldout_top1_agreement"] <= 1.0
    assert metrics["heldout_acceptance"] > log["log"][0]["heldout_acceptance"]

    card = write_draft_lm_card(tmp_path, "python -m training.train_draft_lm --steps 12").read_text()
    assert f"{metrics['heldout_acceptance']:.3f}" in card and "--steps 12" in card
