"""`specpipe::fp32_linear`: an fp32 linear for the few-row products of decoding, with a C++
kernel (`plugins/csrc/fp32_linear.h`) that streams the weight once per 6 rows.

    x [M, I] fp32; weight [O, I] fp32, kept blocked as [ceil(O/16), I, 16] (`block16`)
    y = x weight^T, each output's sum in input order

On the CPU a decode step's products read every weight once for a few rows: memory-bound
work that oneDNN's blocked kernels (`plugins/cpu_linear.py`, what every fp32 CPU model
packs at engine load) do at about half the memory's speed. The demo target's 25 products
(6 layers + LM head, ~50 MB, 2-core AVX2 EPYC, alternating): 1 row 3.9 -> 1.9 ms, 5 rows
4.4 -> 2.2, 8 rows 4.8 -> 3.2, 16 rows 6.9 -> 5.2, 24 rows 8.2 -> 7.3; 40 rows 11.7 vs 12.0
and 128 rows 26 vs 37 (oneDNN's cache blocking wins there). So `Linear` and `LinearStack`
take this kernel up to `SMALL_M` rows and oneDNN's above, on a second blocked copy of the
weight (`pack_cpu_weights`: the model's fp32 linear weights are then held three times, as
parameters, oneDNN's copy and this one).

The result equals `x @ weight.T` up to fp32 rounding (another summation order), like any
other GEMM kernel choice; a row's result does not depend on the other rows of the call
(every output is summed in the same order whatever the tile), unlike oneDNN's.
`fp32_linear_reference` is plain torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels

SMALL_M = 48 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
"""Rows up to which a product takes this kernel. With AVX2 it loses to oneDNN from ~40 rows
(module docstring). Under AVX-512 its 6-row x 4-block tile (`fp32_linear.h`) wins to ~56:
the demo target's 25 products on a 2-core Sapphire Rapids, this kernel vs oneDNN, 40 rows
4.72 vs 5.16 ms, 48 rows 5.54 vs 5.86, 64 rows 7.36 vs 6.94. Up to `SMALL_M` rows a row's
result is the bits of a one-row product (the kernel's rows are independent), so a verify
forward of that many tokens gives each token the logits a one-token forward does."""


TILE_ROWS = 6
"""Rows of x the kernel's register tile holds (`fp32_linear.h`'s `kRows`): a product of M rows
makes ceil(M / 6) passes over the weight, and a pass costs about the same for 1 row as for 6
(the demo target's forward at 1 / 6 / 7 / 12 / 13 tokens: 1.45 / 1.63 / 1.87 / 2.33 / ~2.9 ms,
2-core Sapphire Rapids), so a forward's cost steps up after every multiple of 6 tokens."""


def block16(weight: Tensor) -> Tensor:
    """`[O, I]` -> `[ceil(O/16), I, 16]`, element [b, i, r] = weight[16 b + r, i] (zero past O):
    16 output rows per 64-byte line, what the kernel's register tile multiplies."""
    o, i = weight.shape
    padded = torch.nn.functional.pad(weight.detach().float(), (0, 0, 0, -o % 16))
    return padded.view(-1, 16, i).transpose(1, 2).contiguous()


def fp32_linear_reference(x: Tensor, blocked: Tensor, out_features: int) -> Tensor:
    """Plain torch: the weight unblocked, `x @ weight.T`."""
    weight = blocked.transpose(1, 2).reshape(-1, blocked.shape[1])[:out_features]
    return x @ weight.T


def _check(x: Tensor, blocked: Tensor, out_features: int) -> None:
    if x.ndim != 2 or blocked.ndim != 3 or blocked.shape[2] != 16 or blocked.shape[1] != x.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} must be [M, I] and the weight {tuple(blocked.shape)} [ceil(O/16), I, 16] (block16)"
        )
    if not 16 * (blocked.shape[0] - 1) < out_features <= 16 * blocked.shape[0]:
        raise ValueError(f"{out_features} outputs do not fit {blocked.shape[0]} blocks of 16")


def kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("fp32_linear", _fake)


def takes(x: Tensor) -> bool:
    """Whether rows `x` `[..., I]` take the kernel: fp32 on the CPU, no autograd, at most
    `SMALL_M` rows, the kernels built."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not x.requires_grad
        and x.numel() <= SMALL_M * x.shape[-1]
        and kernel_built()
    )


def product(x: Tensor, blocked: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """`fp32_linear` of rows `x` `[..., I]` (plus `bias`, added after) by the shortest route:
    the C++ op itself, as `plugins.tree_attention.attend` calls its kernel (there the custom
    op's Python measured ~15-25 us a call; a forward makes 25 products)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.specpipe_cpu.fp32_linear(rows, blocked, out_features).view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


@torch.library.custom_op("specpipe::fp32_linear", mutates_args=())
def fp32_linear(x: Tensor, blocked: Tensor, out_features: int) -> Tensor:
    """`x [M, I] @ weight.T` with `blocked = block16(weight)`: the C++ kernel where it is
    built, else the reference."""
    _check(x, blocked, out_features)
    if x.dtype == blocked.dtype == torch.float32 and x.device.type == "cpu" and kernel_built():
        return torch.ops.specpipe_cpu.fp32_linear(x.contiguous(), blocked, out_features)
    return fp32_linear_reference(x, blocked, out_features)


@fp32_linear.register_fake
def _fake(x: Tensor, blocked: Tensor, out_features: int) -> Tensor:
    _check(x, blocked, out_features)
    return x.new_empty(x.shape[0], out_features)
