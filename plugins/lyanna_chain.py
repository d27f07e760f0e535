"""`specpipe_cpu::lyanna_chain`: Lyanna's drafter chain ("Make Every Draft Count" §4:
h_{i+1} = norm(Layer(h_i)), k sequential steps of one decoder layer over a per-call KV) in
one C++ call (`plugins/csrc/lyanna_chain_cpu.cpp`), for a drafter whose layer runs on int8
copies (`BuildConfig.drafter_layers`, the CPU default). Its reference is the Python chain
(`LyannaDrafter.draft_chain` without it), whose int8 products are the op's
(`plugins.cpu_linear.int8_linear`): the same hidden states to int8 rounding
(tests/plugins/test_lyanna_chain.py). What it saves is ~25 small ATen ops and their Python
per step (the chain's steps are sequential, one row per request each).

The op takes x_1 and returns h_1..h_k; `specpipe_cpu::lyanna_draft` makes x_1 first (the
fused first input, `fuse([h0, E(t_1)])`, with the bits of the Python path's int8 `Linear`:
~30-50 us less a call after a 48 MB read). The one-pass LM head stays outside. Drafting is
only proposals, so the loops need not be the reference's bits.
`Int8Chain.of(layer, norm, fuse)` is None where the op does not apply (not fp32 on the CPU,
a linear without the kernel's int8 copy, biases, kernels off).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from model_defs.llama import DecoderLayer, Linear, RMSNorm, int8_kernel
from plugins import cpu_kernels
from plugins.int8_linear import Int8Weight


def _fake(x1: Tensor, cos: Tensor, *rest: Any) -> Tensor:
    return x1.new_empty((x1.shape[0], cos.shape[0], x1.shape[1]))


def _draft_fake(h0: Tensor, tokens: Tensor, embed: Tensor, fuse_weight: Tensor, *rest: Any) -> Tensor:
    cos = rest[4]  # (after the fuse linear's blocked copy, scale, sum and bias)
    return h0.new_empty((h0.shape[0], cos.shape[0], fuse_weight.shape[0]))


@dataclass(frozen=True)
class Int8Chain:
    """The op's arguments that do not change from call to call: one drafter's layer."""

    norms: list[Tensor]
    """Input, post-attention and the drafter's final RMSNorm weights."""
    linears: list[Int8Weight]
    """q/k/v (stacked), o, gate/up (stacked), down."""
    num_heads: int
    num_kv_heads: int
    eps: float
    fuse: Int8Weight | None = None
    """The drafter's `fuse` linear (int8), where `of` was given it: `draft` makes the first
    input in the op too (`specpipe_cpu::lyanna_draft`)."""
    fuse_bias: Tensor | None = None

    @classmethod
    def of(cls, layer: DecoderLayer, norm: RMSNorm, fuse: Linear | None = None) -> Int8Chain | None:
        """The op's view of the chain's `layer` and final `norm` (and of the `fuse` linear,
        where it has an int8 copy and fp32 weights), or None where it does not apply."""
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_proj.weight.device.type != "cpu" or attn.q_proj.weight.dtype != torch.float32:
            return None
        kernels = [int8_kernel(m) for m in (attn.qkv_stack, attn.o_proj, mlp.gate_up_stack, mlp.down_proj)]
        linears = [k for k in kernels if k is not None]
        if len(linears) < len(kernels) or not cpu_kernels.load_with_fake("lyanna_chain", _fake):
            return None
        norms = [n.weight.detach() for n in (layer.input_layernorm, layer.post_attention_layernorm, norm)]
        if any(n.dtype != torch.float32 for n in norms):
            return None
        first, bias = None, None
        if (
            fuse is not None
            and fuse.int8 is not None
            and fuse.int8.kernel is not None
            and (fuse.bias is None or fuse.bias.dtype == torch.float32)
            and cpu_kernels.load_with_fake("lyanna_draft", _draft_fake)
        ):
            first = fuse.int8.kernel
            bias = fuse.bias.detach() if fuse.bias is not None else torch.zeros(fuse.out_features)
        return cls(norms, linears, attn.num_heads, attn.num_kv_heads, float(norm.eps), first, bias)

    @cached_property
    def columns(self) -> tuple[list[Tensor], ...]:
        """The linears' weights, blocked copies, scales and sums, four lists in the ops'
        order (both ops take them so), gathered once."""
        return tuple(list(field) for field in zip(*self.linears, strict=True))

    def drafts_from(self, h0: Tensor, embed: Tensor | None) -> bool:
        """Whether `draft` takes these: a fuse linear, fp32 CPU states and embeddings."""
        return (
            self.fuse is not None
            and h0.dtype == torch.float32
            and h0.device.type == "cpu"
            and (embed is None or embed.dtype == torch.float32)
        )

    def draft(self, h0: Tensor, tokens: Tensor, embed: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
        """`LyannaDrafter.draft_chain` whole: h0 `[B, D]` (the target's states), `tokens` `[B]`
        (the bonus tokens, read where `embed` `[V, D]` is given: first-token fusion), cos/sin as
        `__call__` -> h_1..h_k `[B, k, D]`; x_1 = fuse([h0, E(t_1)]) with the bits of the
        Python path's `Linear` (its int8 product, then the bias)."""
        assert self.fuse is not None and self.fuse_bias is not None
        return torch.ops.specpipe_cpu.lyanna_draft(
            h0, tokens, h0.new_empty(0, 0) if embed is None else embed, *self.fuse, self.fuse_bias, cos, sin,
            self.norms, *self.columns, self.num_heads, self.num_kv_heads, self.eps,
        )  # fmt: skip

    def __call__(self, x1: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x1 `[B, D]` (the fused first input), cos/sin `[k, head_dim]` (RoPE at positions
        1..k) -> h_1..h_k `[B, k, D]`."""
        return torch.ops.specpipe_cpu.lyanna_chain(
            x1.contiguous(), cos, sin, self.norms, *self.columns,
            self.num_heads, self.num_kv_heads, self.eps,
        )  # fmt: skip
