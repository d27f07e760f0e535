"""`LlamaForCausalLM.set_batch_invariant`: a token's logits are the same bits whatever else
shares its forward (a longer prefix after it, or a draft tree around it), and the mode's
logits stay close to the normal ones.

The tiny model is random bf16 (fp32 for the meaning check), built with `from_tensors`."""

from __future__ import annotations

import pytest
import torch

import model_defs.llama as llama
from model_defs.llama import LlamaConfig, LlamaForCausalLM, expected_shapes
from plugins.batch_invariant import bi_linear
from tests.device import TEST_DEVICE

CFG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=True,
)
T = 16


def make_model(dtype: torch.dtype) -> LlamaForCausalLM:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(CFG).items():
        if len(shape) == 2:  # unit-variance activations through the layers: spread-out logits
            tensors[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
        elif "norm" in name:
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.1 * torch.randn(shape, generator=g)
    return LlamaForCausalLM.from_tensors(CFG, tensors, dtype).to(TEST_DEVICE)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (1, T), generator=torch.Generator().manual_seed(1)).to(TEST_DEVICE)


def logits(model: LlamaForCausalLM, ids: torch.Tensor, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    return logits_at(model, ids, torch.arange(ids.shape[1], device=ids.device)[None], tree_mask)


def logits_at(
    model: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None = None
) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, positions, tree_mask=tree_mask).logits[0].cpu()


def prefix_mismatches(model: LlamaForCausalLM, ids: torch.Tensor) -> list[int]:
    """Lengths t whose last-token logits differ from row t-1 of the whole sequence's forward."""
    full = logits(model, ids)
    return [t for t in range(1, T + 1) if not torch.equal(logits(model, ids[:, :t])[-1], full[t - 1])]


def test_last_token_logits_do_not_depend_on_the_tokens_after_it(ids: torch.Tensor) -> None:
    model = make_model(torch.bfloat16).set_batch_invariant(True)
    assert prefix_mismatches(model, ids) == []


def test_tree_rows_equal_the_forward_of_their_own_path(ids: torch.Tensor) -> None:
    """The speculative-decoding case: a draft tree after a prefix, verified in one forward
    under a tree mask, gives each node the logits of the dense forward of prefix + its path."""
    model = make_model(torch.bfloat16).set_batch_invariant(True)
    prefix = 8
    parent = [-1, 0, 0, 1, 1, 2, 3, 5]  # tree nodes after the prefix; -1: child of the prefix's end
    n = len(parent)
    depth: list[int] = []
    paths: list[list[int]] = []
    for i, p in enumerate(parent):
        depth.append(0 if p < 0 else depth[p] + 1)
        paths.append([i] if p < 0 else [*paths[p], i])
    mask = torch.zeros(prefix + n, prefix + n, dtype=torch.bool)
    mask[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    mask[prefix:, :prefix] = True
    for i, path in enumerate(paths):
        mask[prefix + i, [prefix + j for j in path]] = True
    tree_ids = ids[:, : prefix + n]
    positions = torch.tensor([*range(prefix), *(prefix + d for d in depth)], device=ids.device)[None]
    tree = logits_at(model, tree_ids, positions, mask[None].to(ids.device))
    for i, path in enumerate(paths):
        path_ids = torch.cat([tree_ids[:, :prefix], tree_ids[:, [prefix + j for j in path]]], 1)
        assert torch.equal(logits(model, path_ids)[-1], tree[prefix + i]), f"tree node {i} (path {path})"


def test_mode_stays_close_to_normal_and_switches_back(ids: torch.Tensor) -> None:
    model, other = make_model(torch.bfloat16), make_model(torch.bfloat16)
    assert not model.batch_invariant
    normal = logits(model, ids)
    truth = logits(make_model(torch.float32), ids)
    invariant = logits(model.set_batch_invariant(True), ids)
    assert model.batch_invariant and all(
        m.batch_invariant for m in model.modules() if isinstance(m, llama.Linear | llama.RMSNorm)
    )
    assert not other.batch_invariant and torch.equal(logits(other, ids), normal)  # a value on one model only
    # bf16 noise: the mode is no further from the fp32 model than the normal bf16 path is
    err_normal, err_invariant = (normal - truth).abs().max(), (invariant - truth).abs().max()
    assert err_invariant <= 1.5 * err_normal, (err_invariant, err_normal)
    torch.testing.assert_close(invariant, normal, rtol=0, atol=0.05 * truth.abs().max().item())
    assert torch.equal(logits(model.set_batch_invariant(False), ids), normal)


def test_mode_keeps_fp32_meaning(ids: torch.Tensor) -> None:
    model = make_model(torch.float32)
    normal = logits(model, ids)
    torch.testing.assert_close(logits(model.set_batch_invariant(True), ids), normal, rtol=0, atol=1e-4)


def test_row_parallel_linear_uses_bi_linear_then_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    reduced = []
    monkeypatch.setattr(llama.dist, "all_reduce", lambda y: reduced.append(y.clone()))
    layer = llama.RowParallelLinear(32, 8, bias=True).to(torch.bfloat16)
    layer.batch_invariant = True
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    expected = bi_linear(x.reshape(10, 32), layer.weight, None).view(2, 5, 8)
    assert len(reduced) == 1 and torch.equal(reduced[0], expected)
    assert torch.equal(y, expected + layer.bias)
