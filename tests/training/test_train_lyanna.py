"""Lyanna drafter training: a few steps on the real demo target write a checkpoint that
loads, without the target's embedding or LM head, with the hot tokens and a model card,
and the held-out loss goes down. Training runs on the CPU (the trainers take no device);
the trained drafter is run on the test device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from model_defs.llama import LlamaForCausalLM
from model_defs.lyanna import LyannaDrafter
from tests.device import TEST_DEVICE
from training.model_card import write_lyanna_card
from training.train_lyanna import LyannaTrainConfig, train

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "demo-target"


def test_train_tiny_lyanna(tmp_path: Path) -> None:
    cfg = LyannaTrainConfig(
        chain_steps=2,
        hot_tokens=128,
        seq_len=16,
        starts_per_window=8,
        batch_size=4,
        steps=8,
        lr=3e-3,
        warmup_steps=1,
        eval_every=4,
        eval_windows=2,
    )
    metrics = train(cfg, TARGET, tmp_path)

    drafter = LyannaDrafter.from_pretrained(tmp_path)
    assert drafter.config.vocab_size == 8192 and drafter.config.first_token_fusion
    assert drafter.config.num_hot_tokens == 128 and 0 < (drafter.config.hot_token_coverage or 0) < 1
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert not any("embed" in name or "lm_head" in name for name in tensors)
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n != "hot_token_ids")
    assert tensors["hot_token_ids"].dtype == torch.long and len(set(tensors["hot_token_ids"].tolist())) == 128

    target, drafter = LlamaForCausalLM.from_pretrained(TARGET).to(TEST_DEVICE), drafter.to(TEST_DEVICE)
    h0, t1 = torch.randn(2, 384).to(TEST_DEVICE), torch.tensor([3, 4], device=TEST_DEVICE)
    with torch.no_grad():
        hidden = drafter.draft_chain(h0, t1, target.model.embed_tokens, 2)
    table = drafter.hot_table(target.model.embed_tokens)
    assert hidden.shape == (2, 2, 384) and table.table.shape == (128, 128)

    log = json.loads((tmp_path / "training_log.json").read_text())
    assert [r["step"] for r in log["log"]] == [0, 4, 8]
    first, last = log["log"][0], log["log"][-1]
    assert sum(last["heldout_ce"]) < sum(first["heldout_ce"])
    assert sum(last["heldout_mse"]) < sum(first["heldout_mse"])
    assert len(metrics["heldout_top1"]) == 2 and all(0 <= a <= 1 for a in metrics["heldout_acceptance"])
    assert len(metrics["heldout_hot_top1"]) == 2

    card = write_lyanna_card(tmp_path, "python -m training.train_lyanna --steps 8").read_text()
    assert f"{metrics['heldout_top1'][0]:.3f}" in card and "--steps 8" in card


def test_train_ablations(tmp_path: Path) -> None:
    cfg = LyannaTrainConfig(
        chain_steps=2,
        token_info=False,
        first_token_fusion=False,
        seq_len=16,
        starts_per_window=4,
        batch_size=2,
        steps=1,
        eval_every=1,
        eval_windows=1,
    )
    train(cfg, TARGET, tmp_path)
    drafter = LyannaDrafter.from_pretrained(tmp_path)
    assert drafter.token_info is None and drafter.config.num_hot_tokens == 0
    assert drafter.fuse.weight.shape == (384, 384)
    assert not any("token_info" in n for n in load_file(str(tmp_path / "model.safetensors")))
