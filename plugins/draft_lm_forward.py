"""`specpipe_cpu::draft_lm_forward`: a draft LM's whole forward over the paged KV cache in one
C++ call (`plugins/csrc/draft_lm_forward_cpu.cpp`), for a Llama drafter whose linears have
int8 copies (`model_defs.llama.quantize_linears_int8`: the CPU default for draft LMs). Its
reference is the model's own forward (`LlamaForCausalLM.forward` with a `PagedBatch`), whose
int8 products are the op's (`specpipe::int8_linear`'s kernel on the same int8 weights,
`plugins.cpu_linear.int8_linear`): the same RoPE/K-V writes
(`specpipe_cpu::rope_kv_write`) and attention (`specpipe_cpu::tree_attention`), with RMSNorm,
SiLU-times-up, the residual adds and the RoPE tables as plain loops in between; logits and
cache agree to fp32 rounding (tests/plugins/test_draft_lm_forward.py).

What it saves is the Python, fbgemm's per-call set-up and the small decomposed ops between
the products (~45 a forward of the demo draft LM, its RMSNorm alone six ATen ops): a
forward of the demo draft LM at batch 1 0.91 -> ~0.3 ms in the engine on the 2-core CPU,
and an SD / RSD step drafts 3-5 levels.
Drafting is only proposals: the emitted tokens never depend on the drafter's rounding
(verification is the target's), so the loops need not be the reference's bits.

`Int8DraftLM.of(model)` is None where the op does not apply (not fp32 on the CPU, a linear
without an int8 copy, biases, tensor parallelism, a head size the attention kernel is not
built for, kernels off, a CPU with neither AVX-512 VNNI nor AVX2:
`plugins.int8_linear.vectorized`);
`__call__` is None for a step it does not take (the row form of attention metadata, a
prefill chunk longer than the attention kernel's `KERNEL_MAX_T`), and the caller runs the
model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from model_defs.llama import DecoderLayer, LlamaForCausalLM, int8_kernel
from model_defs.paged_kv_cache import Attention, AttentionGroup, PagedKVCache
from model_defs.rope import RotaryEmbedding
from plugins import cpu_kernels
from plugins.int8_linear import Int8Weight, vectorized
from plugins.tree_attention import KERNEL_MAX_T


def _fake(tokens: Tensor, positions: Tensor, slots: Tensor, *rest: Any) -> Tensor:
    logits_indices, embed = rest[5], rest[6]
    return embed.new_empty((logits_indices.shape[0], embed.shape[0]))


@dataclass(frozen=True)
class Int8DraftLM:
    """The op's arguments that do not change from step to step: one draft LM's weights."""

    model: LlamaForCausalLM
    inv_freq: Tensor  # [head_dim // 2]
    rope_scale: float
    norms: list[Tensor]  # per layer: input, post-attention RMSNorm weights [E]
    linears: list[Int8Weight]
    """Per layer: q/k/v (stacked), o, gate/up (stacked), down; then the LM head."""

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> Int8DraftLM | None:
        """The op's view of `model`, or None where the op does not apply (module docstring)."""
        w, rope = model.lm_head.weight, model.model.rotary_emb
        if w.device.type != "cpu" or w.dtype != torch.float32 or model.tp_size != 1:
            return None
        if model.config.head_dim not in (32, 64, 128) or not isinstance(rope, RotaryEmbedding):
            return None
        layers = [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]
        packed = [
            int8_kernel(linear)
            for layer in layers
            for linear in (
                layer.self_attn.qkv_stack,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_stack,
                layer.mlp.down_proj,
            )
        ]
        packed.append(int8_kernel(model.lm_head))
        if any(p is None for p in packed) or not cpu_kernels.load_with_fake("draft_lm_forward", _fake):
            return None
        if not vectorized():  # its products would be a scalar loop: fbgemm's, through the model, are faster
            return None
        norms = [n.weight.detach() for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        linears = [p for p in packed if p is not None]
        return cls(model, rope.inv_freq.float().contiguous(), rope.scale, norms, linears)

    def __call__(
        self,
        tokens: Tensor,  # [N] int64
        positions: Tensor,  # [N] int64
        slots: Tensor,  # [N] int64 cache slot each token's K/V is written to
        attention: Attention,
        logits_indices: Tensor,  # [K] int64
        cache: PagedKVCache,
    ) -> Tensor | None:  # [K, V]
        """Logits at `logits_indices`, the K/V of the tokens written to `cache`: what
        `LlamaForCausalLM.forward` with `PagedBatch(cache, slots, attention)` returns (its
        logits rows), or None for a step the op does not take (module docstring)."""
        if not isinstance(attention, list) or self.model.batch_invariant or torch.is_grad_enabled():
            return None
        if any(g.query_index.shape[1] > KERNEL_MAX_T for g in attention):
            return None
        model = self.model
        return torch.ops.specpipe_cpu.draft_lm_forward(
            tokens, positions, slots, *_columns(attention), logits_indices,
            model.model.embed_tokens.weight, self.inv_freq, self.rope_scale, self.norms,
            *(list(column) for column in zip(*self.linears, strict=True)), cache.k, cache.v,
            model.model.norm.weight, model.config.num_attention_heads, model.config.rms_norm_eps,
        )  # fmt: skip


def _columns(groups: list[AttentionGroup]) -> tuple[list[Tensor], ...]:
    """query_index, key_slots, mask, valid and rows of every group: the op's five lists."""
    return tuple(list(column) for column in zip(*groups, strict=True))
