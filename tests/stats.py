"""Statistics shared by the distribution tests (no SciPy needed)."""

from __future__ import annotations

import math

import torch

Z_999 = 3.0902  # standard normal quantile for p = 0.001 (one-sided)


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Chi-square critical value (Wilson-Hilferty approximation; within ~1% for df >= 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of `counts` against `probs` (flattened).
    Fails outright if an outcome with zero probability was observed. Computed on the CPU."""
    counts, probs = counts.flatten().double().cpu(), probs.flatten().double().cpu()
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "an outcome with zero target probability was observed"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def passes_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, df = chi_square(counts, probs)
    return stat < chi2_critical(df)
