"""`specpipe::argmax_rows`: the greedy token at every row of a list of logits tensors (each
request's verified tree, or its one decode token) in one call: `torch.argmax` row by row,
the first index of a row's largest value, or of its first NaN where it has one.

Greedy acceptance (`runtime.verify.accept_batch`) needs the target's argmax at every
node of every greedy request's tree. `argmax_rows_reference` is the plain-torch form (one
`argmax` per tensor: ~10 us a call plus ~7 us a row of 8192 logits on the demo machine,
~1 ms a step for 32 requests of 3-node trees); on the CPU a C++ kernel
(`plugins/csrc/argmax_rows_cpu.cpp`) reads every row at once, a vector of the CPU's width at a time, with the
same indices (ties and NaN included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels


def _check(logits: list[Tensor]) -> None:
    if not logits or any(t.ndim != 2 or t.shape[-1] != logits[0].shape[-1] for t in logits):
        shapes = [tuple(t.shape) for t in logits]
        raise ValueError(f"logits {shapes} must be one or more [rows, V] tensors of one V")


def argmax_rows_reference(logits: list[Tensor]) -> Tensor:
    """Plain torch (same arguments and result as the op)."""
    _check(logits)
    return torch.cat([t.argmax(-1) for t in logits])


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("argmax_rows", _fake)


def kernel_applies(logits: list[Tensor]) -> bool:
    """Whether `specpipe_cpu::argmax_rows` takes these logits (and is built): fp32 CPU rows,
    each contiguous."""
    return all(t.is_cpu and t.dtype == torch.float32 and t.stride(-1) == 1 for t in logits) and _kernel_built()


def greedy_tokens(logits: list[Tensor]) -> list[int]:
    """`greedy_rows` as host integers: the rows of every tensor in order."""
    return greedy_rows(logits).tolist()


def greedy_rows(logits: list[Tensor]) -> Tensor:
    """`argmax_rows` by the shortest route (the C++ op itself where it applies, else the
    plain-torch form: no custom-op dispatch), on the logits' device."""
    _check(logits)
    if kernel_applies(logits):
        return torch.ops.specpipe_cpu.argmax_rows(logits)
    return argmax_rows_reference(logits)


@torch.library.custom_op("specpipe::argmax_rows", mutates_args=())
def argmax_rows(logits: list[Tensor]) -> Tensor:  # [sum of rows] int64
    _check(logits)
    if kernel_applies(logits):
        return torch.ops.specpipe_cpu.argmax_rows(logits)
    return argmax_rows_reference(logits)


@argmax_rows.register_fake
def _fake(logits: list[Tensor]) -> Tensor:
    _check(logits)
    return logits[0].new_empty(sum(t.shape[0] for t in logits), dtype=torch.long)
