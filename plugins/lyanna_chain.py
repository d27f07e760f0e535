"""`specpipe_cpu::lyanna_chain`: Lyanna's drafter chain ("Make Every Draft Count" §4:
h_{i+1} = norm(Layer(h_i)), k sequential steps of one decoder layer over a per-call KV) in
one C++ call (`plugins/csrc/lyanna_chain_cpu.cpp`), for a drafter whose layer runs on int8
copies (`BuildConfig.drafter_layers`, the CPU default). Its reference is the Python chain
(`LyannaDrafter.draft_chain` without it), whose int8 products are the op's
(`plugins.cpu_linear.int8_linear`): the same hidden states to int8 rounding
(tests/plugins/test_lyanna_chain.py). What it saves is ~25 small ATen ops and their Python
per step (the chain's steps are sequential, one row per request each).

The fused first input (`fuse`, one product) and the one-pass LM head stay outside: the op
takes x_1 and returns h_1..h_k. Drafting is only proposals, so the loops need not be the
reference's bits. `Int8Chain.of(drafter)` is None where the op does not apply (not fp32 on
the CPU, a linear without the kernel's int8 copy, biases, kernels off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from model_defs.llama import DecoderLayer, RMSNorm, int8_kernel
from plugins import cpu_kernels
from plugins.int8_linear import Int8Weight


def _fake(x1: Tensor, cos: Tensor, *rest: Any) -> Tensor:
    return x1.new_empty((x1.shape[0], cos.shape[0], x1.shape[1]))


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

    @classmethod
    def of(cls, layer: DecoderLayer, norm: RMSNorm) -> Int8Chain | None:
        """The op's view of the chain's `layer` and final `norm`, or None where it does not apply."""
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
        return cls(norms, linears, attn.num_heads, attn.num_kv_heads, float(norm.eps))

    def __call__(self, x1: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x1 `[B, D]` (the fused first input), cos/sin `[k, head_dim]` (RoPE at positions
        1..k) -> h_1..h_k `[B, k, D]`."""
        weights, blocked, scales, sums = (list(field) for field in zip(*self.linears, strict=True))
        return torch.ops.specpipe_cpu.lyanna_chain(
            x1.contiguous(), cos, sin, self.norms, weights, blocked, scales, sums,
            self.num_heads, self.num_kv_heads, self.eps,
        )  # fmt: skip
