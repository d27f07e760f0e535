"""`specpipe::gumbel_top_k`: the k largest of `log p + G` in every row of a law `p`
(G: independent Gumbel(0) noise per token), drawn top-down from 2k uniforms a row
instead of V Gumbels: tokens `[M, k]` best first (-1 past a row's last token of non-zero
probability) and their perturbed values `[M, k]` (float64; -inf there). What RSD-C and
RSD-S draft siblings with (`runtime.gumbel.gumbel_top_k_rows`, which draws the uniforms).

Top-down sampling (Maddison et al. 2014, "A* Sampling", §3-4; Kool et al. 2019,
"Stochastic Beams and Where to Find Them", §2-3): over a token set S the maximum of
log p_x + G_x is Gumbel(log p_S) and its argmax is a draw from p restricted to S,
independent of the maximum; given the maximum g, the other perturbed values are
independent Gumbels conditioned on being below g. So the j-th largest is the argmax x_j
of p over S_j = V minus the earlier picks (inverse CDF at `u[2j]`) with value

    g_j = mu_j - log(exp(mu_j - g_(j-1)) - log u[2j+1]),   mu_j = log p(S_j),  g_0 = +inf

(the inverse CDF of Gumbel(mu_j) truncated at g_(j-1)): the joint law of the top k of the
V perturbations (tested against it, tests/runtime/test_recursive_rejection.py). The j-th
draw maps its point of the line without the drawn tokens' intervals onto the whole line
(stepping over them), so one cumulative sum of the row serves all k draws.

Why: a uniform from a CPU generator costs ~6 ns, so V = 8192 Gumbels a row made RSD-S's
noise ~0.27 ms a level at 4 beams and ~2 ms at 32 (batch 8). `gumbel_top_k_reference` is
the plain-torch form (~50 small ops a draw: fine on a GPU, ~0.6 ms for 4 rows on the CPU);
on the CPU a C++ kernel (`plugins/csrc/gumbel_top_k_cpu.cpp`) does a row in one pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels

TINY = torch.finfo(torch.float64).tiny


def _check(probs: Tensor, uniforms: Tensor, k: int) -> None:
    if probs.ndim != 2 or k < 1 or uniforms.shape != (probs.shape[0], 2 * k):
        raise ValueError(
            f"probs {tuple(probs.shape)} must be [M, V] and uniforms {tuple(uniforms.shape)} [M, 2k] "
            f"with k >= 1 (k = {k})"
        )


def gumbel_top_k_reference(probs: Tensor, uniforms: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Plain torch (same arguments and results as the op)."""
    _check(probs, uniforms, k)
    m, v = probs.shape
    f64, device = torch.float64, probs.device
    u = uniforms.double()
    cdf = probs.double().cumsum(-1)  # token x owns [cdf[x - 1], cdf[x]) (cdf[-1] = 0)
    total, support = cdf[:, -1], torch.count_nonzero(probs, dim=-1)
    tokens = torch.full((m, k), -1, dtype=torch.long, device=device)
    values = torch.full((m, k), float("-inf"), dtype=f64, device=device)
    upper = torch.full((m,), float("inf"), dtype=f64, device=device)
    exp1 = -u[:, 1::2].clamp(min=TINY).log()  # Exp(1) = -log U
    taken = torch.zeros(m, dtype=f64, device=device)  # mass of the tokens drawn so far
    for j in range(min(k, v)):
        alive = support > j
        if not bool(alive.any()):
            break
        mass = (total - taken).clamp(min=TINY)
        x = u[:, 2 * j] * mass  # a point of the line without the drawn tokens' intervals ...
        if j:  # ... mapped onto the whole line: step over each drawn interval at or before it
            drawn_before = tokens[:, :j].clamp(min=0).sort(dim=1).values
            ends = cdf.gather(1, drawn_before)
            starts = torch.where(drawn_before > 0, cdf.gather(1, (drawn_before - 1).clamp(min=0)), 0.0)
            for t in range(j):
                x = torch.where(x >= starts[:, t], x + (ends[:, t] - starts[:, t]), x)
        token = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]
        # rounding may land past the end or on a drawn interval's edge: those rows draw again
        # by inverse CDF over the remaining tokens recomputed (the same law by another map)
        off = alive & ((token >= v) | (token[:, None] == tokens[:, :j]).any(1))
        if bool(off.any()):
            rows = off.nonzero()[:, 0]
            rest = probs[rows].scatter(1, tokens[rows, :j].clamp(min=0), 0.0)
            rest_cdf = rest.double().cumsum(-1)
            redrawn = torch.searchsorted(rest_cdf, (u[rows, 2 * j] * rest_cdf[:, -1])[:, None], right=True)[:, 0]
            last = v - 1 - (rest > 0).flip(-1).int().argmax(-1)  # u * total rounded up to the total
            token[rows] = torch.where(redrawn >= v, last, redrawn)
            mass[rows] = rest_cdf[:, -1]
        token = token.clamp(max=v - 1)
        mu = mass.log()
        g = mu - torch.logaddexp(mu - upper, exp1[:, j].log())
        tokens[:, j] = torch.where(alive, token, -1)
        values[:, j] = torch.where(alive, g, float("-inf"))
        start = torch.where(token > 0, cdf.gather(1, (token - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        taken = taken + (cdf.gather(1, token[:, None])[:, 0] - start)
        upper = g
    return tokens, values


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("gumbel_top_k", _fake)


def kernel_applies(probs: Tensor) -> bool:
    """Whether `specpipe_cpu::gumbel_top_k` takes these probabilities (and is built): fp32 on the CPU."""
    return probs.device.type == "cpu" and probs.dtype == torch.float32 and _kernel_built()


def draw_top_k(probs: Tensor, uniforms: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`gumbel_top_k` by the shortest route, for the drafters: the C++ op itself where it
    applies, else the plain-torch form (no custom-op dispatch; through it, a call read ~0.5 ms
    under cProfile on an H200, rsd-c at T=1, batch 1)."""
    if kernel_applies(probs):
        _check(probs, uniforms, k)
        return torch.ops.specpipe_cpu.gumbel_top_k(probs.contiguous(), uniforms.double().contiguous(), k)
    return gumbel_top_k_reference(probs, uniforms, k)


@torch.library.custom_op("specpipe::gumbel_top_k", mutates_args=())
def gumbel_top_k(
    probs: Tensor,  # [M, V] a law per row (non-negative, not necessarily normalised)
    uniforms: Tensor,  # [M, 2k] float64 on [0, 1): a row's token draws at even, its values' at odd columns
    k: int,
) -> tuple[Tensor, Tensor]:  # tokens [M, k] int64, values [M, k] float64
    _check(probs, uniforms, k)
    if kernel_applies(probs):
        return torch.ops.specpipe_cpu.gumbel_top_k(probs.contiguous(), uniforms.double().contiguous(), k)
    return gumbel_top_k_reference(probs, uniforms, k)


@gumbel_top_k.register_fake
def _fake(probs: Tensor, uniforms: Tensor, k: int) -> tuple[Tensor, Tensor]:
    _check(probs, uniforms, k)
    m = probs.shape[0]
    return probs.new_empty(m, k, dtype=torch.long), probs.new_empty(m, k, dtype=torch.float64)
