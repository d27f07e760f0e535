"""`specpipe_cpu::verify_sampled_chains`: recursive rejection sampling (RSD, Jeon et al.
2024, Algorithm 1; one candidate a node, so SD's rule, Leviathan et al. 2023) down chains
whose warp is a temperature alone, every chain of a step in one C++ call
(`plugins/csrc/chain_verify_cpu.cpp`).

Its reference is the walk in `runtime/verify.py` (`_walk_tree` over `_tree_laws`'s laws,
then the bonus drawn by `inverse_cdf_rows`): the same laws by the same ATen ops on the same
rows (softmax(logits / T), the residual norm([q - p]^+)), the same fp32 acceptance test at the same
uniforms, the same inverse-CDF draw (`specpipe::draw_row`), so the same accepted drafts and
bonus tokens bit for bit (`tests/plugins/test_chain_verify.py`). What it saves is the walk's
Python, ~0.25 ms a step for one 5-node chain on the 2-core CPU (sd at T=1, batch 1: ~8% of
the step), and the laws of the nodes past the first rejection, which the walk's table computed.

The caller draws the uniforms from each request's generator in the order the walk draws them
(`torch.rand(N - 1)`, then the bonus's fp64 uniform): a request's tokens stay independent of
its batch. `verify_chains` returns None where the kernel does not apply (not the CPU, not fp32,
not built), and the caller walks in Python.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels


def _fake(logits: list[Tensor], *rest: object) -> tuple[Tensor, Tensor]:
    b = len(logits)
    return logits[0].new_empty(b, dtype=torch.long), logits[0].new_empty(b, dtype=torch.long)


def kernel_applies(logits: list[Tensor]) -> bool:
    """Whether the op takes these chains' logits (and is built): fp32 on the CPU."""
    return (
        bool(logits)
        and all(x.is_cpu and x.dtype == torch.float32 for x in logits)
        and cpu_kernels.load_with_fake("verify_sampled_chains", _fake)
    )


def verify_chains(
    logits: list[Tensor],  # per chain [N, V]: the target's logits at its nodes
    laws: list[Tensor | None],  # per chain [N, V]: the law each draft was drawn from (None: point masses)
    tokens: list[list[int]],  # per chain its N tokens, the root first
    temperatures: list[float],
    uniforms: list[Tensor],  # per chain [N - 1] fp32: one a draft, as the walk draws them
    bonus_uniforms: Tensor,  # [B] fp64: one a chain, drawn after its node uniforms
) -> tuple[list[int], list[int]] | None:
    """(accepted drafts, bonus token) of every chain, or None where the kernel does not apply."""
    if not kernel_applies(logits):
        return None
    empty = logits[0].new_empty(0)
    accepted, bonus = torch.ops.specpipe_cpu.verify_sampled_chains(
        [x.contiguous() for x in logits],
        [empty if p is None else p.contiguous() for p in laws],
        [torch.tensor(t) for t in tokens],
        temperatures,
        uniforms,
        bonus_uniforms.contiguous(),
    )
    return accepted.tolist(), bonus.tolist()
