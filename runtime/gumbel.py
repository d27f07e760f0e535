"""Sampling without replacement with Gumbel perturbations, the drafting half of Recursive
Speculative Decoding (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating
LLM Inference via Sampling Without Replacement", arXiv 2402.14160).

- **Gumbel-top-k** (Vieira 2014; Kool et al. 2019 §2; RSD Algorithm 3/4): perturb every
  log-probability with independent Gumbel(0) noise and keep the k largest. The tokens in
  descending order of perturbed value are distributed exactly as k draws *without
  replacement* from the distribution (the first is a plain sample, the second a sample
  from the rest renormalised, ...). RSD-C drafts each tree level this way.
- **Truncated Gumbel** (Kool et al. 2019, "Stochastic Beams and Where to Find Them",
  eq. 23 and Appendix B.3): Stochastic Beam Search perturbs a *sequence's* log-prob
  with a Gumbel conditioned on its children's maximum equalling the parent's perturbed
  value, so top-W over all children of a beam samples W sequences without replacement.
  RSD-S drafts with it (RSD Algorithms 8/9).

Every draw takes the request's own generator, so a request's draft (and output) does not
depend on which other requests share its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.sampling import inverse_cdf_rows


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Independent Gumbel(0, 1) samples `-log(-log U)`, U uniform on (0, 1)."""
    return _gumbel(torch.rand(shape, generator=generator, device=device, dtype=torch.float64))


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) samples `-log(-log u)` from float64 uniforms `u` on [0, 1), computed
    in place (`u` is overwritten and returned)."""
    return u.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()


def gumbel_noise_rows(
    counts: list[int], generators: list[torch.Generator | None], width: int, device: torch.device | str
) -> torch.Tensor | None:
    """Gumbel noise `[sum(counts), width]` (float64) for consecutive blocks of rows: block i
    (`counts[i]` rows) is `gumbel_noise((counts[i], width), generators[i], device)`, the
    same uniforms from the same stream, zeros where `generators[i]` is None (a request
    ranked, not sampled). None when every generator is None.

    Each block's uniforms are drawn from its own generator (one RNG call per block: a
    request's noise never depends on the other rows of the batch); the Gumbel transform
    is one op over all rows."""
    if all(g is None for g in generators):
        return None
    u = torch.empty((sum(counts), width), dtype=torch.float64, device=device)
    start = 0
    for count, gen in zip(counts, generators, strict=True):
        if gen is not None and count:
            u[start : start + count].uniform_(0.0, 1.0, generator=gen)  # = torch.rand((count, width))
        start += count
    noise = _gumbel(u)
    start = 0
    for count, gen in zip(counts, generators, strict=True):
        if gen is None and count:
            noise[start : start + count] = 0.0
        start += count
    return noise


def top_k_valid(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and values of the (at most) k largest finite entries of `keys` `[V]`, best
    first. A distribution with fewer than k tokens of non-zero probability (top-p, top-k,
    a peaked drafter) yields fewer: sampling without replacement cannot draw more."""
    values, index = torch.topk(keys, min(k, keys.shape[-1]))
    finite = values > float("-inf")
    return index[finite], values[finite]


def top_k_valid_rows(keys: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k_valid` of every row of `keys` `[M, V]` at once: `[M, min(k, V)]` indices, best
    first, -1 past a row's last finite entry (its valid indices are a prefix). Same
    ranking rule as `top_k_valid` (one `torch.topk` along the row)."""
    values, index = torch.topk(keys, min(k, keys.shape[-1]), dim=-1)
    return index.masked_fill(~(values > float("-inf")), -1)


def gumbel_top_k(log_probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k tokens drawn without replacement from `exp(log_probs)` `[V]`, in draw order (RSD
    Algorithm 4: argtop-k of log p + Gumbel). `generator=None` means deterministic: the
    k most likely tokens (the temperature-0 limit, used for greedy requests). One token
    (k = 1) is a plain draw, the law of the Gumbel argmax: `draw_one`."""
    if k == 1 and generator is not None:
        return draw_one(log_probs[None], [generator])
    keys = log_probs.double()
    if generator is not None:
        keys = keys + gumbel_noise(tuple(keys.shape), generator, keys.device)
    return top_k_valid(keys, k)[0]


def draw_one(log_probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `exp(log_probs)` `[M, V]`, row m with one uniform from
    `generators[m]`: the law of Gumbel-top-1 (the argmax of log p + Gumbel is a sample
    from p), by inverse CDF (`runtime.sampling.inverse_cdf_rows`) instead of V Gumbels
    per row (~15 vs ~60 us a row over 8192 tokens: SD and the last levels of RSD-C draw
    one child per node)."""
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=log_probs.device) for g in generators])
    return inverse_cdf_rows(log_probs.exp(), u)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a <= 0, accurate on both sides of -log 2 (Maechler 2012)."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def truncated_gumbel(perturbed: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Condition Gumbels on their maximum being `upper` (Kool et al. 2019, eq. 23):

        G = -log(exp(-T) - exp(-Z) + exp(-G~)),   Z = max G~,  T = upper

    in the numerically stable form of their Appendix B.3:

        v = T - G~ + log1mexp(G~ - Z),   G = T - max(0, v) - log1pexp(-|v|).

    `perturbed` `[..., V]` are the children's Gumbel-perturbed log-probs G~ (-inf for
    tokens of zero probability, which stay -inf), `upper` `[...]` the parent's perturbed
    value T. The transform is increasing in G~, so the children's order — a sample
    without replacement — is kept, and the largest child gets exactly T."""
    z = perturbed.amax(dim=-1, keepdim=True)
    t = upper[..., None]
    v = t - perturbed + log1mexp((perturbed - z).clamp(max=0.0))
    out = t - v.clamp(min=0.0) - F.softplus(-v.abs())
    return out.masked_fill(perturbed == float("-inf"), float("-inf"))
