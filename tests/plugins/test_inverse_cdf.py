"""`specpipe::inverse_cdf` (plugins/inverse_cdf.py): the C++ kernel draws the plain-torch
reference's tokens bit for bit, on laws with zeros, unnormalised, one token only, and at
uniforms that put u * total on a running sum or round it up to the total (the last token
with mass); a wrong variant (running sums in fp32) is caught; bad arguments are refused;
other dtypes take the reference. Every sampler of the engine goes through it
(`runtime.sampling.inverse_cdf_rows`), so the sampling suites (chi-square against the
target law) test its law."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels
from plugins.inverse_cdf import draw, inverse_cdf, inverse_cdf_reference
from tests.device import ON_CPU, TEST_DEVICE

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")


def laws(m: int, v: int, seed: int) -> torch.Tensor:
    """Rows of several kinds: peaked, flat, with zeros (a top-k/top-p law), trailing zeros,
    one token only (not normalised)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(m, v, generator=gen) * torch.linspace(0.5, 8, m)[:, None], -1)
    if m >= 4:
        probs[m // 2 :, : v // 3] = 0.0
        probs[1, v // 2 :] = 0.0  # the last tokens without mass: a draw rounded up lands before them
        probs[-1] = 0.0
        probs[-1, v // 2] = 0.7
    return probs


def uniforms(m: int, n: int, seed: int) -> list[torch.Tensor]:
    """`n` uniform vectors `[m]`, the last ones at the edges: 0 and the largest double below 1."""
    gen = torch.Generator().manual_seed(seed)
    out = [torch.rand(m, dtype=torch.float64, generator=gen) for _ in range(n)]
    return [*out, torch.zeros(m, dtype=torch.float64), torch.full((m,), 1 - 2**-53, dtype=torch.float64)]


@needs_kernels
@pytest.mark.parametrize(("m", "v"), [(1, 8192), (8, 8192), (6, 64), (5, 3), (33, 1000)])
def test_cpu_kernel_draws_the_references_tokens(m: int, v: int) -> None:
    probs = laws(m, v, seed=m + v)
    for u in uniforms(m, 200, seed=v):
        assert torch.equal(torch.ops.specpipe_cpu.inverse_cdf(probs, u), inverse_cdf_reference(probs, u))
        assert torch.equal(draw(probs, u), inverse_cdf(probs, u))
    for u in uniforms(m, 5, seed=1):  # never a token without mass
        tokens = draw(probs, u)
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())


@needs_kernels
def test_a_running_sum_on_the_line_picks_the_next_token() -> None:
    """u * total exactly on a running sum: the token after it (the interval [cdf[i-1], cdf[i])
    is half-open), as searchsorted(right=True) does; at the total, the last token with mass."""
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.5, 0.0]])
    for u, token in ((0.0, 0), (0.25, 1), (0.5, 3), (0.75, 3), (1.0, 3)):
        x = torch.tensor([u], dtype=torch.float64)
        assert int(draw(probs, x)[0]) == token == int(inverse_cdf_reference(probs, x)[0])


def test_running_sums_in_fp32_are_caught() -> None:
    """The test above has teeth: a kernel summing in fp32 picks other tokens on some rows."""
    probs = laws(8, 8192, seed=3)
    wrong_rows = 0
    for u in uniforms(8, 200, seed=4):
        cdf = probs.cumsum(-1)  # fp32
        wrong = torch.searchsorted(cdf, (u.float() * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=8191)
        wrong_rows += int((wrong != inverse_cdf_reference(probs, u)).sum())
    assert wrong_rows > 0


def test_bad_arguments_are_refused_and_other_dtypes_take_the_reference() -> None:
    probs = laws(4, 64, seed=0)
    with pytest.raises(ValueError, match=r"u \(3,\) \[M\]"):
        inverse_cdf(probs, torch.rand(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be"):
        inverse_cdf(probs[0], torch.rand(1, dtype=torch.float64))
    u = torch.rand(4, dtype=torch.float64)
    assert torch.equal(draw(probs.double(), u), inverse_cdf_reference(probs.double(), u))
    torch.library.opcheck(inverse_cdf, (probs, u))


@pytest.mark.skipif(ON_CPU, reason="the reference's sync-free branch runs off the CPU (SPECPIPE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize(("m", "v"), [(1, 8192), (8, 8192), (5, 3)])
def test_draws_on_the_device_are_the_cpu_references_tokens(m: int, v: int) -> None:
    """Off the CPU, `draw` is the reference without its check for the rounding case (the
    last token with mass is put in wherever u * total reached the total, without a host
    sync to ask first): the same tokens as on the CPU, the edge uniforms included."""
    probs = laws(m, v, seed=m + v)
    for u in uniforms(m, 50, seed=v):
        assert torch.equal(draw(probs.to(TEST_DEVICE), u.to(TEST_DEVICE)).cpu(), inverse_cdf_reference(probs, u))
