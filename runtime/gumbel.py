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


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Independent Gumbel(0, 1) samples `-log(-log U)`, U uniform on (0, 1)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    return -torch.log(-torch.log(u.clamp(min=tiny)))


def top_k_valid(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and values of the (at most) k largest finite entries of `keys` `[V]`, best
    first. A distribution with fewer than k tokens of non-zero probability (top-p, top-k,
    a peaked drafter) yields fewer: sampling without replacement cannot draw more."""
    values, index = torch.topk(keys, min(k, keys.shape[-1]))
    finite = values > float("-inf")
    return index[finite], values[finite]


def gumbel_top_k(log_probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k tokens drawn without replacement from `exp(log_probs)` `[V]`, in draw order (RSD
    Algorithm 4: argtop-k of log p + Gumbel). `generator=None` means deterministic: the
    k most likely tokens (the temperature-0 limit, used for greedy requests)."""
    keys = log_probs.double()
    if generator is not None:
        keys = keys + gumbel_noise(tuple(keys.shape), generator, keys.device)
    return top_k_valid(keys, k)[0]


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
