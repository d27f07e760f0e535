"""Lyanna drafter training: a few steps on the real demo target write a checkpoint that
loads, without the target's embedding or LM head, with the hot tokens and a model card,
and the held-out loss goes down. Training runs on the CPU (the trainers take no device);
the trained drafter is run on the test device."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_defs.llama import LlamaForCausalLM
from model_defs.lyanna import LyannaConfig, LyannaDrafter
from tests.device import TEST_DEVICE
from training.model_card import write_lyanna_card
from training.train_lyanna import ChainBatch, LyannaTrainConfig, draft_logits, train

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

    # --init-from: fine-tuning starts from these (bf16-saved) weights, so its step-0 loss is the
    # end's, not a fresh start's; a drafter of another shape is refused
    tuned = train(replace(cfg, steps=1, eval_every=1, init_from=str(tmp_path), autocast=False), TARGET, tmp_path / "ft")
    start = json.loads((tmp_path / "ft" / "training_log.json").read_text())["log"][0]
    assert abs(sum(start["heldout_ce"]) - sum(last["heldout_ce"])) < 0.05 * sum(last["heldout_ce"])
    assert sum(first["heldout_ce"]) - sum(last["heldout_ce"]) > 0.1 * sum(last["heldout_ce"])
    assert len(tuned["heldout_top1"]) == 2
    with pytest.raises(ValueError, match="differs"):
        train(replace(cfg, token_info_rank=8, init_from=str(tmp_path)), TARGET, tmp_path / "bad")


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


@torch.no_grad()
def test_sparse_training_bias_is_the_inference_table() -> None:
    """Sparse-aware training (`sparse=True`) adds E' exactly where the hot-token table adds it
    at inference; the dense training bias (the variant inference never applies) differs."""
    target = LlamaForCausalLM.from_pretrained(TARGET).eval()
    torch.manual_seed(0)
    drafter = LyannaDrafter(LyannaConfig.from_target(target.config, num_hot_tokens=256)).eval()
    drafter.hot_token_ids.copy_(torch.randperm(8192)[:256])
    assert drafter.token_info is not None
    for w in drafter.token_info.parameters():
        w.normal_()  # E' starts at zero; a trained one is not
    windows = torch.randint(0, 8192, (2, 12))
    windows[:, 3:7] = drafter.hot_token_ids[:8].view(2, 4)  # some hot previous tokens, the rest mostly cold
    batch = ChainBatch(target, windows, torch.arange(8).expand(2, -1), 3, autocast=False)
    hidden, sparse = draft_logits(drafter, target, batch, 3, sparse=True)
    _, dense = draft_logits(drafter, target, batch, 3, sparse=False)
    base = drafter.head_logits(hidden, target.lm_head)
    table = drafter.hot_table(target.model.embed_tokens, torch.float32)
    inference = table.bias(batch.prev.flatten(), base.flatten(0, 1)).view_as(base)
    torch.testing.assert_close(sparse, inference, rtol=1e-5, atol=1e-5)
    assert (dense - inference).abs().max() > 1e-2
