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

`BATCH_HINT` is the row count oneDNN blocks for: with a hint of 1 it picks a GEMV layout
that is 1.6-2x slower from 2 rows on; 32 is as fast as 8 at every size we measured
(1-64 rows). A blocked weight is a copy: pack after the weights are final (at engine
load), never while training.
"""

from __future__ import annotations

import torch

BATCH_HINT = 32
LARGE_WEIGHT = 1 << 21
"""Elements of a weight from which the blocked copy wins even for one row (an LM head:
0.89 vs 1.39 ms for 8192 x 384); a one-row product with a smaller weight is a GEMV that
`F.linear` does faster (e.g. 52 vs 85 us for 1024 x 384)."""


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of an fp32 CPU weight `[out, in]`; None where packing does not
    apply (another dtype or device, or a torch without oneDNN)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not cpu_packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def packed_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the blocked weight is the faster way to multiply fp32 CPU rows `x`: from 2
    rows on, or for a large weight (`LARGE_WEIGHT`)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    return x.numel() >= 2 * x.shape[-1] or weight.numel() >= LARGE_WEIGHT


def cpu_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack_cpu_weight(weight)`; x `[..., in]` fp32."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
