"""`specpipe::int8_linear`: a drafter's linear on int8 weights, for the few-row products of
drafting, with a C++ kernel (`plugins/csrc/int8_linear.h`: AVX-512 VNNI where the CPU has
it, else AVX2) that the draft LM's one-call forward uses (`plugins/llama_forward.py`).

    x [M, I] fp32; w [O, I] int8, symmetric, one scale per output row (`Int8Weight`)
    per row m: s_m = max(max |x_m|, FLT_MIN) / 127, q_m = round_half_even(x_m / s_m)
    y[m, o] = float(q_m . w_o) * (s_m * w_scale[o])

The integer dot products are exact, so the kernel equals the plain-torch reference
(`int8_linear_reference`) bit for bit.

4-bit weights (`BuildConfig.drafter_head = "int4"`) are int8 weights in [-7, 7], scale
max|w| / 7 per row (`plugins.cpu_linear.quantize_int8(bits=4)`): the same formula, the same
reference. Only their blocked copy differs: two weights a byte (`block_weight4`) where the
kernel has AVX-512 VNNI (`nibbles`), so a product that streams its weights reads half the
bytes; elsewhere the int8 layout, with the same bits out. Weights are those of fbgemm's packed copies
(`plugins.cpu_linear.quantize_int8`, read back with `Int8Weight.of`), the activations are
quantized per row to 8 bits (fbgemm's dynamic linear: per call, 7 bits), and nothing is
allocated or packed per call: on the demo draft LM's products (256-768 wide) fbgemm's call
costs 16-40 us on the 2-core CPU, this one ~2-12 us. Drafters only: proposals change in
the last bits, never the output (verification is the target's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from plugins import cpu_kernels


class Int8Weight(NamedTuple):
    """One linear's int8 weight, as the op takes it."""

    weight: Tensor  # [O, I] int8
    blocked: Tensor
    """The kernel's layout: `block_weight` ([ceil(O / 16), ceil(I / 4), 16, 4] int8), or for
    4-bit weights under VNNI `block_weight4` ([ceil(O / 16), ceil(I / 8), 16, 4] uint8)."""
    scale: Tensor  # [O] fp32, one per output row
    sum: Tensor  # [O] int32 = weight.sum(1): what the kernel's unsigned products take back off

    @classmethod
    def of(cls, packed: Any, bits: int = 8) -> Int8Weight:
        """From fbgemm's packed copy (`quantize_int8`): the same int8 weights and scales;
        `bits=4`: weights in [-8, 7], blocked two a byte where the kernel takes that (`nibbles`)."""
        qweight, _ = packed.unpack()
        weight = qweight.int_repr().contiguous()
        if weight.numel() and int(weight.min()) == -128:  # AVX2's vpsignb cannot negate -128
            raise ValueError("int8 weights must lie in [-127, 127]: quantize with scale max|w| / 127 (quantize_int8)")
        if bits == 4 and weight.numel() and (int(weight.min()) < -8 or int(weight.max()) > 7):
            raise ValueError("4-bit weights must lie in [-8, 7]: quantize with quantize_int8(weight, bits=4)")
        scale = qweight.q_per_channel_scales().float().contiguous()
        blocked = block_weight4(weight) if bits == 4 and nibbles() else block_weight(weight)
        return cls(weight, blocked, scale, weight.sum(1, dtype=torch.int32))


def block_weight(weight: Tensor) -> Tensor:
    """`[O, I]` -> `[ceil(O/16), ceil(I/4), 16, 4]`, element [b, j, r, c] = weight[16 b + r, 4 j + c]
    (zero past the edges): 16 output rows x 4 inputs per 64-byte line, what one AVX-512 VNNI
    `vpdpbusd` multiplies (`plugins/csrc/int8_linear.h`)."""
    o, i = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -i % 4, 0, -o % 16))
    return padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 4, 4).transpose(1, 2).contiguous()


def block_weight4(weight: Tensor) -> Tensor:
    """4-bit `[O, I]` (values in [-8, 7]) -> `[ceil(O/16), ceil(I/8), 16, 4]` uint8: byte [b, j, r, c]
    holds w + 8 of `block_weight`'s line 2j (element [b, 2j, r, c]) in its low nibble and of
    line 2j + 1 in its high one (the padding's zeros too: 8 and 8)."""
    lines = block_weight(torch.nn.functional.pad(weight, (0, -weight.shape[1] % 8)))  # [B, 2J, 16, 4]
    biased = (lines.to(torch.int16) + 8).to(torch.uint8)
    return (biased[:, 0::2] | (biased[:, 1::2] << 4)).contiguous()


def int8_linear_reference(x: Tensor, weight: Tensor, blocked: Tensor, scale: Tensor, total: Tensor) -> Tensor:
    """Plain torch (module docstring); `blocked` and `total` (the row sums) are the kernel's
    business only."""
    s = x.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [M]
    q = torch.round(x / s[:, None])
    acc = q.double() @ weight.double().T  # exact: |sums| < 2^53
    return acc.float() * (s[:, None] * scale[None, :])


def _kernel_built() -> bool:
    return cpu_kernels.load_with_fake("int8_linear", _fake)


def vectorized() -> bool:
    """Whether the kernel is built with its AVX-512 VNNI or AVX2 tiles on this CPU; without
    them it is a scalar loop, slower than fbgemm, and the ops that would call it stand aside."""
    return _kernel_built() and bool(torch.ops.specpipe_cpu.int8_linear_vectorized())


def nibbles() -> bool:
    """Whether the kernel takes 4-bit blocked copies (`block_weight4`: built with AVX-512 VNNI)."""
    return _kernel_built() and bool(torch.ops.specpipe_cpu.int8_linear_nibbles())


@torch.library.custom_op("specpipe::int8_linear", mutates_args=())
def int8_linear(
    x: Tensor,  # [M, I] fp32
    weight: Tensor,  # [O, I] int8
    blocked: Tensor,  # block_weight(weight)
    scale: Tensor,  # [O] fp32
    total: Tensor,  # [O] int32 row sums of weight
) -> Tensor:  # [M, O] fp32
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or weight.dtype != torch.int8:
        raise ValueError(f"x {tuple(x.shape)} must be [M, I] and weight {tuple(weight.shape)} int8 [O, I]")
    if x.device.type == "cpu" and x.dtype == torch.float32 and _kernel_built():
        return torch.ops.specpipe_cpu.int8_linear(x.contiguous(), weight.contiguous(), blocked, scale, total)
    return int8_linear_reference(x, weight, blocked, scale, total)


@int8_linear.register_fake
def _fake(x: Tensor, weight: Tensor, blocked: Tensor, scale: Tensor, total: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
