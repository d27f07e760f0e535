"""Lyanna drafter on the real demo target: chain shapes, the one-pass LM head against
per-step heads, independence of the chain from drafted tokens, save/load, and the
collapsed hot-token table against the low-rank token-info computation. Target and drafters
run on the test device; inputs are drawn on the CPU, so they are the same on every device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_defs.llama import Linear, LlamaForCausalLM
from model_defs.lyanna import (
    DEFAULT_HOT_TOKENS,
    LyannaConfig,
    LyannaDrafter,
    collapse,
    expected_shapes,
    hot_table_bytes,
)
from plugins.cpu_linear import int8_available
from tests.device import TEST_DEVICE

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "demo-target"


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(TARGET).requires_grad_(False).to(TEST_DEVICE)


def make_drafter(target: LlamaForCausalLM, hot: int = 64, **kwargs: object) -> LyannaDrafter:
    torch.manual_seed(0)
    drafter = LyannaDrafter(LyannaConfig.from_target(target.config, num_hot_tokens=hot, **kwargs))  # type: ignore[arg-type]
    drafter.hot_token_ids.copy_(torch.randperm(target.config.vocab_size)[:hot])
    if drafter.token_info is not None:
        with torch.no_grad():  # a trained-looking (non-zero) gain
            drafter.token_info.norm.weight.uniform_(0.5, 1.5)
    return drafter.eval().to(TEST_DEVICE)


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(TEST_DEVICE) for t in tensors]


def test_chain_shapes_and_one_pass_head(target: LlamaForCausalLM) -> None:
    drafter = make_drafter(target)
    h0, t1 = on_device(torch.randn(3, 384), torch.tensor([5, 17, 300]))
    with torch.no_grad():
        hidden = drafter.draft_chain(h0, t1, target.model.embed_tokens, 4)
        logits = drafter.head_logits(hidden, target.lm_head)
        assert hidden.shape == (3, 4, 384) and logits.shape == (3, 4, 8192)
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        # the per-step reference: chain of length i, LM head on its last state only
        for i in range(1, 5):
            step = drafter.draft_chain(h0, t1, target.model.embed_tokens, i)[:, -1]
            torch.testing.assert_close(logits[:, i - 1], target.lm_head(step), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not int8_available(), reason="no int8 kernels here")
def test_an_int8_heads_one_pass_is_its_linears_product() -> None:
    """An int8 head (the engine's `lyanna_head`) takes its kernel straight in `head_logits`:
    the same bits as the `Linear`'s own product of each state, and not an fp32 head's."""
    gen = torch.Generator().manual_seed(3)
    head = Linear(32, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 32, generator=gen))
    fp32 = head(torch.ones(1, 32))
    if not head.quantize_int8() or head.int8 is None or head.int8.kernel is None:
        pytest.skip("no int8 kernel for this CPU")
    hidden = torch.randn(3, 4, 32, generator=gen)
    with torch.inference_mode():
        logits = LyannaDrafter.head_logits(hidden, head)
        assert logits.shape == (3, 4, 50)
        assert torch.equal(logits, torch.stack([head(hidden[:, i]) for i in range(4)], dim=1))
        assert not torch.equal(LyannaDrafter.head_logits(torch.ones(1, 32), head), fp32)


def test_chain_ignores_tokens_after_step_one(target: LlamaForCausalLM) -> None:
    """Only h_0 and t_1 enter the chain: the draft can be re-sampled without a new forward."""
    drafter = make_drafter(target)
    h0, t56, t76, t91 = on_device(torch.randn(2, 384), torch.tensor([5, 6]), torch.tensor([7, 6]), torch.tensor([9, 1]))
    with torch.no_grad():
        a = drafter.draft_chain(h0, t56, target.model.embed_tokens, 3)
        b = drafter.draft_chain(h0, t56, target.model.embed_tokens.weight, 3)
        c = drafter.draft_chain(h0, t76, target.model.embed_tokens, 3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a[0], c[0]) and torch.equal(a[1], c[1])  # t_1 matters, per row

    no_fusion = make_drafter(target, first_token_fusion=False)
    with torch.no_grad():
        x = no_fusion.draft_chain(h0, t56, target.model.embed_tokens, 3)
        y = no_fusion.draft_chain(h0, t91, target.model.embed_tokens, 3)
    assert torch.equal(x, y) and no_fusion.fuse.weight.shape == (384, 384)


def test_save_load_round_trip(target: LlamaForCausalLM, tmp_path: Path) -> None:
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = LyannaDrafter.from_pretrained(tmp_path).to(TEST_DEVICE)
    assert loaded.config == drafter.config
    assert set(loaded.state_dict()) == set(expected_shapes(drafter.config))
    assert "lm_head.weight" not in loaded.state_dict() and "embed_tokens.weight" not in str(loaded.state_dict())
    assert loaded.hot_token_ids.dtype == torch.long and torch.equal(loaded.hot_token_ids, drafter.hot_token_ids)
    h0, t1 = on_device(torch.randn(2, 384), torch.tensor([1, 2]))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.draft_chain(h0, t1, target.model.embed_tokens, 3),
            drafter.draft_chain(h0, t1, target.model.embed_tokens, 3),
        )
    # bf16 on disk (the default), no token info: the ablation's checkpoint
    bare = make_drafter(target, hot=0, token_info_rank=0)
    bare.save_pretrained(tmp_path / "bare")
    reloaded = LyannaDrafter.from_pretrained(tmp_path / "bare", torch.bfloat16)
    assert reloaded.token_info is None and reloaded.dtype == torch.bfloat16


def test_hot_table_equals_low_rank_on_hot_tokens(target: LlamaForCausalLM) -> None:
    drafter = make_drafter(target, hot=256)
    embed = target.model.embed_tokens
    hot = drafter.hot_token_ids
    table = collapse(drafter.token_info, embed, hot, dtype=torch.float32)  # type: ignore[arg-type]
    assert table.table.shape == (256, 256)

    (cold,) = on_device(torch.tensor([t for t in range(50) if t not in set(hot.tolist())][:4]))
    prev = torch.cat([hot[:12], cold])
    (logits,) = on_device(torch.randn(len(prev), 8192))
    biased = table.bias(prev, logits)
    with torch.no_grad():
        exact = logits + drafter.token_bias(prev, embed)
    # hot previous token: exactly the low-rank bias on every hot next token ...
    torch.testing.assert_close(biased[:12][:, hot], exact[:12][:, hot], rtol=1e-5, atol=1e-5)
    assert torch.equal(biased[:12][:, hot], logits[:12][:, hot] + table.table[:12])  # one fp32 add each
    assert torch.equal(table.bias(prev[:12], logits[:12]), biased[:12])  # every row hot: the same
    # ... and nothing on the cold columns; a cold previous token gets no bias at all
    cold_cols = torch.ones(8192, dtype=torch.bool, device=TEST_DEVICE)
    cold_cols[hot] = False
    assert torch.equal(biased[:12][:, cold_cols], logits[:12][:, cold_cols])
    assert torch.equal(biased[12:], logits[12:])
    assert drafter.token_bias(prev[:1], embed).abs().sum() > 0  # the comparison was not trivial


def test_hot_table_memory() -> None:
    mib = 2**20
    assert DEFAULT_HOT_TOKENS == 2048
    assert hot_table_bytes(DEFAULT_HOT_TOKENS) / mib == 2048 * 2048 * 2 / mib == 8
    assert hot_table_bytes(8192) / mib == 128
    assert hot_table_bytes(2048, torch.float32) == 2 * hot_table_bytes(2048)
