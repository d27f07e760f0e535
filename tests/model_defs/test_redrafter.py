"""The ReDrafter drafter: Apple-compatible checkpoint layout (tensor names, config keys), round trip,
errors that name the bad tensor, and the logits formula against a re-computation written here with
transformers' `TopKLogitsWarper` as the oracle for Apple's top-50 warp. Drafters compute on the
test device; their inputs are drawn on the CPU, so they are the same on every device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.generation.logits_process import TopKLogitsWarper

from model_defs.checkpoint import CheckpointError
from model_defs.redrafter import LOG_0, ReDrafter, ReDrafterConfig
from tests.device import TEST_DEVICE

D, V = 8, 80  # V > 50 so the top-50 warp masks something

APPLE_KEYS = {
    "architectures",
    "exit_dim",
    "hidden_size",
    "model_type",
    "num_draft_layers",
    "num_lookback_tokens",
    "rnn",
    "torch_dtype",
    "vocab_size",
}


def make(exit_dim: int = 2 * D, layers: int = 2, rnn: bool = True, seed: int = 0) -> ReDrafter:
    torch.manual_seed(seed)
    drafter = ReDrafter(
        ReDrafterConfig(vocab_size=V, hidden_size=D, exit_dim=exit_dim, num_draft_layers=layers, rnn=rnn)
    )
    with torch.no_grad():  # wider than nn.Linear's init, so the logits are spread and far from ties
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 2 / p.shape[-1] ** 0.5)
    return drafter.eval()


@pytest.mark.parametrize(
    ("exit_dim", "rnn", "names"),
    [
        (
            2 * D,
            True,
            {
                "lm_head.0.linear.weight",
                "lm_head.0.linear.bias",
                "lm_head.1.linear.weight",
                "lm_head.1.linear.bias",
                "lm_head.2.weight",
                "rnn_u.weight",
                "rnn_u.bias",
                "rnn_w.weight",
            },
        ),
        (
            24,
            True,
            {
                "input_proj.weight",
                "input_proj.bias",
                "lm_head.0.linear.weight",
                "lm_head.0.linear.bias",
                "lm_head.1.linear.weight",
                "lm_head.1.linear.bias",
                "lm_head.2.weight",
                "rnn_u.weight",
                "rnn_u.bias",
                "rnn_w.weight",
            },
        ),
        (
            24,
            False,
            {
                "input_proj.weight",
                "input_proj.bias",
                "lm_head.0.linear.weight",
                "lm_head.0.linear.bias",
                "lm_head.1.weight",
            },
        ),
    ],
)
def test_save_writes_apple_names_and_round_trips(tmp_path: Path, exit_dim: int, rnn: bool, names: set[str]) -> None:
    layers = 2 if rnn else 1
    drafter = make(exit_dim, layers, rnn)
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == names
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) == APPLE_KEYS
    assert config["model_type"] == "recurrent_drafting_drafter" and config["architectures"] == ["Drafter"]
    assert (config["exit_dim"], config["hidden_size"], config["rnn"], config["torch_dtype"]) == (
        exit_dim,
        D,
        rnn,
        "float32",
    )

    loaded, drafter = ReDrafter.from_pretrained(tmp_path).to(TEST_DEVICE), drafter.to(TEST_DEVICE)
    assert loaded.config == drafter.config
    h, s, emb = (torch.randn(3, D).to(TEST_DEVICE) for _ in range(3))
    torch.testing.assert_close(loaded.logits(h, s), drafter.logits(h, s), rtol=0, atol=0)
    torch.testing.assert_close(loaded.step(s, emb), drafter.step(s, emb), rtol=0, atol=0)


def test_config_json_round_trip_keeps_unknown_keys() -> None:
    apple = {
        "architectures": ["Drafter"],
        "exit_dim": 16,
        "hidden_size": 8,
        "model_type": "recurrent_drafting_drafter",
        "num_draft_layers": 2,
        "num_lookback_tokens": -1,
        "rnn": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "vocab_size": 80,
    }
    cfg = ReDrafterConfig.from_json(apple)
    assert not cfg.has_input_proj and cfg.rnn
    assert cfg.to_json() == apple
    with pytest.raises(ValueError, match="model_type"):
        ReDrafterConfig.from_json({**apple, "model_type": "llama"})
    with pytest.raises(ValueError, match="num_draft_layers"):
        ReDrafterConfig(vocab_size=8, hidden_size=4, exit_dim=8, num_draft_layers=-1, rnn=True)


def test_bad_checkpoint_names_the_tensor(tmp_path: Path) -> None:
    make(exit_dim=24).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    good = load_file(str(path))

    missing = {k: v for k, v in good.items() if k != "rnn_u.bias"}
    save_file(missing, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensor 'rnn_u\.bias'"):
        ReDrafter.from_pretrained(tmp_path)

    save_file({**good, "input_proj.weight": torch.zeros(24, 2 * D + 1)}, str(path))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'input_proj\.weight' has shape \[24, 17\]"):
        ReDrafter.from_pretrained(tmp_path)

    save_file({**good, "lm_head.3.weight": torch.zeros(V, 24)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'lm_head\.3\.weight'"):
        ReDrafter.from_pretrained(tmp_path)

    save_file(good, str(path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": V, "hidden_size": D, "exit_dim": 24}))
    with pytest.raises(CheckpointError, match=r"config\.json: missing keys \['num_draft_layers'\]"):
        ReDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize(("exit_dim", "rnn"), [(2 * D, True), (24, True), (2 * D, False)])
def test_logits_and_recurrence_match_recomputation(exit_dim: int, rnn: bool) -> None:
    drafter = make(exit_dim, 2, rnn, seed=1).double().to(TEST_DEVICE)  # float64: compare at ~1e-12, not fp32 noise
    sd = {k: v.clone() for k, v in drafter.state_dict().items()}
    embeds = torch.randn(4, 3, D, dtype=torch.float64).to(TEST_DEVICE)  # [T, B, D] embeddings of consumed tokens
    h = torch.randn(3, D, dtype=torch.float64).to(TEST_DEVICE)

    s_ref, s = torch.zeros(3, D, dtype=torch.float64, device=TEST_DEVICE), drafter.init_state(3)
    for e in embeds:
        # rnn: s_t = SiLU(W e_t + U s_{t-1} + b); otherwise s_t = s_{t-1} + e_t
        rnn_in = e @ sd["rnn_w.weight"].T + s_ref @ sd["rnn_u.weight"].T + sd["rnn_u.bias"] if rnn else None
        s_ref = F.silu(rnn_in) if rnn_in is not None else s_ref + e
        s = drafter.step(s, e)
    torch.testing.assert_close(s, s_ref)

    x = torch.cat([h, s_ref], dim=-1)
    if exit_dim != 2 * D:
        x = x @ sd["input_proj.weight"].T + sd["input_proj.bias"]
    for i in range(2):
        x = x + F.silu(x @ sd[f"lm_head.{i}.linear.weight"].T + sd[f"lm_head.{i}.linear.bias"])
    raw = x @ sd["lm_head.2.weight"].T
    torch.testing.assert_close(drafter.logits(h, s, warp=False), raw)

    # Apple: maintain_logits (subtract the max) then top-50 with LOG_0, i.e. HF's TopKLogitsWarper.
    warped = TopKLogitsWarper(top_k=50, filter_value=LOG_0)(None, raw - raw.amax(-1, keepdim=True))
    ours = drafter.logits(h, s)
    torch.testing.assert_close(ours, warped)
    assert ((ours > LOG_0).sum(-1) == 50).all() and (ours.amax(-1) == 0).all()
    lp = drafter.log_probs(h, s)
    torch.testing.assert_close(lp.exp().sum(-1).cpu(), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(lp, torch.log_softmax(warped, -1))
