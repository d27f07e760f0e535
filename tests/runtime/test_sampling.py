"""The target distribution (temperature, top-k, top-p) and the sampler that draws from it.

transformers' logits warpers are the oracle for the distribution; an empirical
total-variation bound checks the sampler, and the same bound is shown to reject a
sampler that ignores the temperature (so the test can fail). Logits and generators live on
the test device; laws are compared on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from runtime.sampling import MIN_TEMPERATURE, SamplingParams, inverse_cdf, next_token, sample, target_probs
from tests.device import TEST_DEVICE
from tests.stats import passes_chi_square


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6)]
)
def test_target_probs_match_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3).to(TEST_DEVICE)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours.cpu(), torch.softmax(ref, dim=-1).cpu(), rtol=0, atol=1e-6)


def empirical(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    gen = params.generator(logits.device)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        counts[next_token(logits, params, gen)] += 1
    return counts / n


def test_sampler_follows_target_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], device=TEST_DEVICE)
    params = SamplingParams(temperature=0.6, top_k=6, top_p=0.95, seed=3)
    probs = target_probs(logits, params).cpu()
    n = 20000
    # TV of an n-sample empirical law over 8 outcomes is ~0.01; 0.02 leaves room and still
    # rejects the untempered distribution (TV ~0.13 from the target), checked below.
    bound = 0.02
    tv = 0.5 * (empirical(logits, params, n) - probs).abs().sum()
    assert tv < bound
    wrong = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, seed=3)
    assert 0.5 * (empirical(logits, wrong, n) - probs).abs().sum() > bound


def draws(
    probs: torch.Tensor, n: int, seed: int, draw: Callable[[torch.Tensor, torch.Generator], int] = sample
) -> torch.Tensor:
    gen = torch.Generator(probs.device).manual_seed(seed)
    counts = torch.zeros(probs.shape[-1])
    for _ in range(n):
        counts[draw(probs, gen)] += 1
    return counts


def test_sample_draws_unnormalised_weights_in_law_and_never_a_zero() -> None:
    """`sample` (inverse CDF) against the weights' own law by chi-square, zeros at the
    start, inside and at the end never drawn (`chi_square` fails on one); the same test
    rejects an inverse CDF that forgets to scale u by the total (weights summing to 0.6)."""
    weights = torch.tensor([0.0, 0.05, 0.2, 0.0, 0.25, 0.05, 0.05, 0.0], device=TEST_DEVICE)
    law = (weights / weights.sum()).cpu()
    assert passes_chi_square(draws(weights, 20000, seed=0), law)

    def unscaled(probs: torch.Tensor, gen: torch.Generator) -> int:
        u = torch.rand((), dtype=torch.float64, generator=gen, device=probs.device)
        token = int(torch.searchsorted(probs.double().cumsum(0), u, right=True))
        return min(token, int(probs.nonzero().max()))  # past the total: the last token with mass

    assert not passes_chi_square(draws(weights, 20000, seed=0, draw=unscaled), law)


def test_inverse_cdf_at_the_ends_of_the_unit_interval() -> None:
    """u = 0 gives the first token with mass; the largest u below 1 (where u * total may
    round up to total) gives the last token with mass, never a zero-weight tail."""
    weights = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0], dtype=torch.float64)
    below_one = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    assert inverse_cdf(weights, torch.tensor(0.0, dtype=torch.float64)) == 2
    assert inverse_cdf(weights, below_one) == 4
    assert inverse_cdf(weights * 3.0, below_one) == 4
    grid = torch.linspace(0, 1, 1001, dtype=torch.float64)[:-1]
    assert {inverse_cdf(weights, u) for u in grid} == {2, 4}


def test_seeded_requests_repeat_and_greedy_is_argmax() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0)).to(TEST_DEVICE)
    params = SamplingParams(temperature=1.0, seed=42)
    g1, g2 = params.generator(TEST_DEVICE), params.generator(TEST_DEVICE)
    assert [next_token(logits, params, g1) for _ in range(20)] == [next_token(logits, params, g2) for _ in range(20)]
    assert next_token(logits, SamplingParams(), g1) == int(logits.argmax())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": 4.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": 2**64}, "seed must be in"),
        ({"stop_token_ids": (-5,)}, "stop_token_ids"),
    ],
)
def test_invalid_params_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 9.9e-6])
def test_temperature_below_epsilon_is_greedy(temperature: float) -> None:
    """1e-38 once overflowed `logits / T` to NaN inside the engine; now it is argmax."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0.0
    logits = torch.randn(50).to(TEST_DEVICE)
    assert next_token(logits, params, params.generator(TEST_DEVICE)) == int(logits.argmax())
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
