"""`specpipe_cpu::lyanna_chain` (`plugins/lyanna_chain.py`) against its reference, the
Python chain (`LyannaDrafter.draft_chain` without it) on the same int8 layer: the same
hidden states h_1..h_k to int8 rounding, for one and several requests, chains of 1 and 5
steps, grouped-query heads; variants with the norms in the wrong order or RoPE one position
off fail; it stands aside (None) where it does not apply; and the demo Lyanna engine's
proposer takes it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model_defs.llama import quantize_linears_int8
from model_defs.lyanna import LyannaConfig, LyannaDrafter
from plugins import cpu_kernels
from plugins.int8_linear import vectorized
from plugins.lyanna_chain import Int8Chain
from tests.tiny_models import tiny_target

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load() or not vectorized(),
    reason="the op runs where the C++ kernels are built with AVX-512 VNNI or AVX2",
)

TOLERANCE = 3e-3
"""Largest |difference| allowed between hidden states (RMSNorm'd: entries of spread ~1). The
products quantize their activations per row, so a last-bit difference in a norm or the
attention (the op's loops sum in another order than ATen) can move one activation across a
rounding step of the int8 grid; such a flip moves a state by ~1e-3. Wrong arithmetic moves
them by ~1."""


def drafter(int8: bool = True, bias: bool = False) -> tuple[LyannaDrafter, torch.nn.Embedding]:
    target = tiny_target(seed=2, vocab_size=64, head_dim=16)
    cfg = LyannaConfig.from_target(target.config, token_info_rank=0)
    model = LyannaDrafter(cfg).eval()
    with torch.no_grad():  # trained-looking weights: states of spread ~1, norms away from 1
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
        if bias:
            q_proj = model.layer.self_attn.q_proj
            q_proj.bias = torch.nn.Parameter(torch.randn(q_proj.out_features))
    if int8:
        quantize_linears_int8(model)
    return model, target.model.embed_tokens


def chains(
    model: LyannaDrafter, embed: torch.nn.Embedding, batch: int, k: int, fused: Int8Chain
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 10 + k)
    h0, t1 = torch.randn(batch, 32, generator=gen), torch.randint(0, 64, (batch,), generator=gen)
    with torch.inference_mode():
        return model.draft_chain(h0, t1, embed, k), model.draft_chain(h0, t1, embed, k, fused)


@pytest.mark.parametrize(("batch", "k"), [(1, 1), (1, 5), (3, 4)])
def test_the_op_is_the_python_chain(batch: int, k: int) -> None:
    model, embed = drafter()
    fused = Int8Chain.of(model.layer, model.norm)
    assert fused is not None and model.layer.self_attn.num_heads != model.layer.self_attn.num_kv_heads
    want, got = chains(model, embed, batch, k, fused)
    assert got.shape == want.shape == (batch, k, 32)
    assert want.abs().mean() > 0.3 and (got - want).abs().max() < TOLERANCE


def test_wrong_variants_fail() -> None:
    model, embed = drafter()
    fused = Int8Chain.of(model.layer, model.norm)
    assert fused is not None
    swapped = replace(fused, norms=[fused.norms[1], fused.norms[0], fused.norms[2]])  # the layer's two norms
    unnormed = replace(fused, norms=[*fused.norms[:2], torch.ones_like(fused.norms[2])])  # the final norm's gain
    want, good = chains(model, embed, 2, 4, fused)
    for wrong in (swapped, unnormed):
        _, bad = chains(model, embed, 2, 4, wrong)
        assert (good - want).abs().max() < TOLERANCE < (bad - want).abs().max()


def test_it_stands_aside_where_it_does_not_apply() -> None:
    for model, _ in (drafter(int8=False), drafter(bias=True)):  # fp32 linears; a biased q/k/v
        assert Int8Chain.of(model.layer, model.norm) is None


@pytest.mark.parametrize("batch", [1, 3])
def test_the_first_input_in_the_op_has_the_python_paths_bits(batch: int) -> None:
    """Given the drafter's `fuse` linear, the op makes the first input too
    (`specpipe_cpu::lyanna_draft`): the same bits as the chain op after the Python first
    input (its gather, concatenation and int8 `Linear`), and the reference's states to int8
    rounding; an op that read another token's embedding, or left the fuse bias out, would
    differ (both checked)."""
    model, embed = drafter()
    chain_only = Int8Chain.of(model.layer, model.norm)
    whole = Int8Chain.of(model.layer, model.norm, model.fuse)
    assert chain_only is not None and whole is not None and whole.fuse is not None and chain_only.fuse is None
    gen = torch.Generator().manual_seed(batch)
    h0, t1 = torch.randn(batch, 32, generator=gen), torch.randint(0, 64, (batch,), generator=gen)
    with torch.inference_mode():
        want = model.draft_chain(h0, t1, embed, 4)
        apart = model.draft_chain(h0, t1, embed, 4, chain_only)
        got = model.draft_chain(h0, t1, embed, 4, whole)
        assert torch.equal(got, apart) and (got - want).abs().max() < TOLERANCE
        cos, sin = model._chain_rope(4, torch.float32, h0.device)
        other_token = whole.draft(h0, (t1 + 1) % 64, embed.weight, cos, sin)  # another row of the embedding
        no_bias = replace(whole, fuse_bias=torch.zeros_like(whole.fuse_bias)).draft(h0, t1, embed.weight, cos, sin)
    assert (other_token - want).abs().max() > 0.1 and (no_bias - want).abs().max() > 0.1
