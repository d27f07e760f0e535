"""Linear layers on the CPU with oneDNN's pre-blocked weights.

`F.linear` on an fp32 `[V, D]` weight repacks the weight into the GEMM's blocked layout
on every call; for the few-row products of decoding (1 token per request, a 5-17 node
draft tree) that repacking and MKL's small-M path dominate: on the 2-core CI machine a
forward's GEMM chain (demo target, 6 layers + LM head) costs 5.2 ms at 1 row, 12 ms at
5 rows and 19 ms at 16 rows with `F.linear`, but 4.7, 5.7 and 9.6 ms with the weights
blocked once at load (`torch.ops.mkldnn._reorder_linear_weight`, the layout inductor's
CPU freezing pass uses) and `torch.ops.mkldnn._linear_pointwise` per call. A draft tree
then costs little more than one token, which is what speculative decoding needs.

The result equals `F.linear`'s up to fp32 rounding (another summation order), like any
other GEMM kernel choice; rows are not batch-invariant (`plugins/batch_invariant.py` is
the mode for that, and takes precedence in `model_defs.llama.Linear`).

One row too: in a whole forward the weights come from memory, not cache (the demo
target's 50 MB exceed the L3 of the machines we run on), and there the blocked copy beats
MKL's GEMV on the plain weight although it loses on hot-cache micro-benchmarks of small
weights (384 x 384: 23 vs 14 us). A 1-token forward of the demo target: median 6.3 vs
8.3 ms (six alternating rounds); auto-regressive decoding at batch 1: 125-143 vs
110-120 tok/s (four).

Since 2026-11-26 products of up to `plugins.fp32_linear.SMALL_M` rows take that module's
kernel instead, on a second blocked copy (`pack_cpu_weights` makes both): a stream of the
weights once per 6 rows, ~2x as fast as this one at 1-8 rows in a forward of the demo
target. This one serves the larger products (prefill chunks, big batches).

`BATCH_HINT` is the row count oneDNN blocks for: with a hint of 1 it picks a GEMV layout
that is 1.6-2x slower from 2 rows on; 32 is as fast as 8 at every size we measured
(1-64 rows). A blocked weight is a copy: pack after the weights are final (at engine
load), never while training.

Drafter linears may also run in int8 (`quantize_int8` / `int8_linear`): int8 weights per
output row, activations quantized per row per call. The product is `specpipe::int8_linear`'s
kernel (`plugins/int8_linear.py`: 8-bit activations, exact integer sums, AVX-512 VNNI or AVX2)
where this CPU has it, else fbgemm's dynamic quantized linear (7-bit activations). A one-row
product with the 8192 x 384 head of the demo drafters is memory-bound: ~0.9 ms in fp32
inside a draft loop, ~0.17 ms in fbgemm's int8, and a ReDrafter draft calls it once per
level; on the 2-core AMD EPYC without VNNI, 1 x 256 x 768 / 1 x 256 x 8192 cost 14 / 52 us
a call through the kernel and 46 / 123 us through fbgemm. Only proposals change (demo
ReDrafter, 8 held-out prompts at batch 1: tau 3.37 either way, 1.55x -> 1.73x AR);
verification and output never see it, so it is for drafters only, never for the target.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from plugins.int8_linear import Int8Weight, vectorized

BATCH_HINT = 32


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of an fp32 CPU weight `[out, in]`; None where packing does not
    apply (another dtype or device, or a torch without oneDNN)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not cpu_packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def packed_pays(x: torch.Tensor) -> bool:
    """Whether rows `x` may take a blocked weight: fp32 on the CPU (any number of rows:
    module docstring)."""
    return x.dtype == torch.float32 and x.device.type == "cpu"


def cpu_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack_cpu_weight(weight)`; x `[..., in]` fp32."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


class Int8Copy(NamedTuple):
    """A drafter weight's int8 copy (`quantize_int8`)."""

    packed: Any
    """fbgemm's packed copy: the weights and scales, and fbgemm's product where `kernel` is None."""
    kernel: Int8Weight | None
    """The same weights in `specpipe::int8_linear`'s layout, where its kernel is vectorized on
    this CPU (decided once, at quantization); else None."""


def quantize_int8(weight: torch.Tensor, bits: int = 8) -> Int8Copy | None:
    """The int8 copy of an fp32 CPU weight `[out, in]` (symmetric, one scale per output row,
    values in [-127, 127]; `bits=4`: in [-7, 7], stored two a byte where the kernel takes that,
    `plugins/int8_linear.py`), for `int8_linear`; None where it does not apply (another dtype
    or device, a torch without fbgemm)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not int8_available():
        return None
    w = weight.detach().contiguous()
    top = 127 if bits == 8 else 7
    scales = (w.abs().amax(dim=1) / top).clamp_min(torch.finfo(torch.float32).tiny).double()
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor creation is deprecated, the fbgemm kernels are not
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    return Int8Copy(packed, Int8Weight.of(packed, bits) if vectorized() else None)


def int8_linear(x: torch.Tensor, copy: Int8Copy, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T + bias` with `copy = quantize_int8(W)`; x `[..., in]` fp32 on the CPU."""
    if copy.kernel is not None:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.specpipe_cpu.int8_linear(rows, *copy.kernel).view(*x.shape[:-1], copy.kernel.weight.shape[0])
    else:
        # reduce_range: 7-bit activations, as torch's own dynamic quantization uses on x86. With
        # 8 bits, AVX2's u8 x s8 pair sums saturate int16 (255 * 127 * 2 > 32767) and a few
        # outputs come out wrong by far more than the rounding (4.5 vs 0.3 on a random test).
        y = torch.ops.quantized.linear_dynamic(x, copy.packed, reduce_range=True)
    return y if bias is None else y + bias
