"""Tiny random models for tests that need real components but not trained weights."""

from __future__ import annotations

import torch

from model_defs.llama import LlamaConfig, LlamaForCausalLM


def tiny_target(
    seed: int = 0, vocab_size: int = 11, device: torch.device | str = "cpu", head_dim: int = 8
) -> LlamaForCausalLM:
    """A 2-layer GQA Llama with weights ~N(0, 0.3): peaked enough that trees get accepted.
    The weights are drawn on the CPU, so a seed gives the same model on every `device`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(device)
