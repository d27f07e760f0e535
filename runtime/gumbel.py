"""Sampling without replacement with Gumbel perturbations, the drafting half of Recursive
Speculative Decoding (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating
LLM Inference via Sampling Without Replacement", arXiv 2402.14160).

- **Gumbel-top-k** (Vieira 2014; Kool et al. 2019 §2; RSD Algorithm 3/4): perturb every
  log-probability with independent Gumbel(0) noise and keep the k largest. The tokens in
  descending order of perturbed value are distributed exactly as k draws *without
  replacement* from the distribution (the first is a plain sample, the second a sample
  from the rest renormalised, ...). RSD-C drafts each tree level this way. Only the k
  largest are ever used, so they are drawn top-down (`gumbel_top_k_rows`: k inverse-CDF
  draws and k truncated Gumbels a row), in the same joint law as V perturbations.
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
from torch.nn.utils.rnn import pad_sequence

from plugins.gumbel_top_k import draw_top_k
from runtime.sampling import inverse_cdf_rows


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Independent Gumbel(0, 1) samples `-log(-log U)`, U uniform on (0, 1) (computed in place)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    return u.clamp_(min=torch.finfo(torch.float64).tiny).log_().neg_().log_().neg_()


def gumbel_top_k_rows(
    log_probs: torch.Tensor, counts: list[int], generators: list[torch.Generator], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of `log p + G` in every row of `log_probs` `[M, V]` (G: independent
    Gumbel(0) noise per token), best first, drawn top-down instead of from V Gumbels a row:
    tokens `[M, k]` (-1 past a row's last token of non-zero probability) and their perturbed
    values `[M, k]` (float64; -inf there). Rows come request by request (`counts[i]` rows of
    request i), each request's uniforms from its own `generators[i]` in one call of
    `2 k` per row, so a request's draws do not depend on its batch.

    Top-down sampling (Maddison et al. 2014; Kool et al. 2019 §2-3): the j-th largest is a
    draw from p without the earlier picks, its value Gumbel(log p(rest)) truncated at the
    (j-1)-th (`plugins/gumbel_top_k.py`, a C++ kernel on the CPU): the joint law of the top
    k of V perturbations, from 2k uniforms a row instead of V (~6 ns each from a CPU
    generator: V Gumbels a row made RSD-S's noise ~0.27 ms a level at 4 beams, ~2 ms at 32)."""
    m = log_probs.shape[0]
    if len(generators) != len(counts) or sum(counts) != m:
        raise ValueError(f"{len(generators)} generators and counts {counts} for {m} rows")
    f64, device = torch.float64, log_probs.device
    drawn = [(c, g) for c, g in zip(counts, generators, strict=True) if c]
    u = torch.cat([torch.rand((c, 2 * k), dtype=f64, generator=g, device=device) for c, g in drawn])
    return draw_top_k(log_probs.exp(), u, k)


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
    (k = 1) is a plain draw, the law of the Gumbel argmax: `draw_one`; more are drawn
    top-down (`gumbel_top_k_rows`)."""
    if generator is None:
        return top_k_valid(log_probs.double(), k)[0]
    if k == 1:
        return draw_one(log_probs[None], [generator])
    tokens = gumbel_top_k_rows(log_probs[None], [1], [generator], k)[0][0]
    return tokens[tokens >= 0]


def draw_one(log_probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `exp(log_probs)` `[M, V]` (`draw_rows`)."""
    return draw_rows(log_probs.exp(), generators)


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` `[M, V]`, row m with one uniform from `generators[m]`:
    the law of Gumbel-top-1 (the argmax of log p + Gumbel is a sample from p), by inverse
    CDF (`runtime.sampling.inverse_cdf_rows`) instead of V Gumbels per row (~15 vs ~60 us a
    row over 8192 tokens: SD and the last levels of RSD-C draw one child per node, from
    the probabilities their tree keeps, with no log and exp in between)."""
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    return inverse_cdf_rows(probs, u)


def level_uniforms(generators: list[torch.Generator], counts: list[int]) -> torch.Tensor:
    """`[len(generators), max(counts)]` float64: row i holds `counts[i]` uniforms from
    `generators[i]` (zeros after them), the numbers `counts[i]` calls of one `torch.rand(1)`
    each (`draw_rows`' draws, one a level) give, in that order. On the CPU one call of n gives
    exactly those (the mt19937 generator draws one double per element, in order:
    `tests/runtime/test_rsd_batched_levels.py` checks it), so a row is one call: 8 requests of
    4 levels ~61 -> ~11 us a step. A CUDA generator's one call of n is another stream than n
    calls of one (Philox offsets), so there each level is a call of its own."""
    device = generators[0].device
    if device.type == "cpu":
        rows = [torch.rand(n, dtype=torch.float64, generator=g) for g, n in zip(generators, counts, strict=True)]
    else:
        rows = [
            torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=device) for _ in range(n)])
            for g, n in zip(generators, counts, strict=True)
        ]
    if len(set(counts)) == 1:  # (as long as each other: ~20 us less than padding at batch 1)
        return torch.stack(rows)
    return pad_sequence(rows, batch_first=True)  # zeros after a row's counts


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
