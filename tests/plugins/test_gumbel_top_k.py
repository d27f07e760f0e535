"""`specpipe::gumbel_top_k` (plugins/gumbel_top_k.py): the C++ kernel draws the plain-torch
reference's tokens with its values (within a few ulps: libm's and torch's logs), on laws
with zeros, fewer tokens than k, and a draw that rounds past the end of the line (the
re-draw over the remaining tokens); a wrong variant (no stepping over drawn tokens) is
caught; bad arguments are refused with the fix; other dtypes take the reference. The law
itself is tested against V Gumbel perturbations in tests/runtime/test_recursive_rejection.py."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels
from plugins.gumbel_top_k import draw_top_k, gumbel_top_k, gumbel_top_k_reference

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")


def laws(m: int, v: int, seed: int) -> torch.Tensor:
    """Rows of several kinds: peaked, flat, with zeros (a top-k/top-p law), one token only."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(m, v, generator=gen) * torch.linspace(0.5, 6, m)[:, None], -1)
    if m >= 4:
        probs[m // 2 :, : v // 3] = 0.0  # zeros
        probs[-1] = 0.0
        probs[-1, v // 2] = 0.7  # one token (not normalised)
    return probs


@needs_kernels
@pytest.mark.parametrize(("m", "v", "k"), [(1, 8192, 4), (6, 64, 3), (32, 8192, 4), (5, 3, 5)])
def test_cpu_kernel_draws_the_references_tokens(m: int, v: int, k: int) -> None:
    probs = laws(m, v, seed=m + v)
    uniforms = torch.rand(m, 2 * k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    want_tokens, want_values = gumbel_top_k_reference(probs, uniforms, k)
    tokens, values = torch.ops.specpipe_cpu.gumbel_top_k(probs, uniforms, k)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(values, want_values, rtol=1e-13, atol=0)
    support = (probs > 0).sum(-1)
    for row in range(m):  # distinct tokens of non-zero probability, then -1 / -inf
        drawn = tokens[row][tokens[row] >= 0].tolist()
        assert len(drawn) == min(k, int(support[row])) == len(set(drawn))
        assert all(probs[row, t] > 0 for t in drawn)
        assert bool((values[row, len(drawn) :] == float("-inf")).all())
        assert bool((values[row, 1 : len(drawn)] <= values[row, : len(drawn) - 1]).all())  # best first
    if m < 6:
        return
    # a second draw that does not step over the first token lands elsewhere on some row: caught
    cdf = probs.double().cumsum(-1)
    first = tokens[:, 0]
    rest = cdf[:, -1] - probs[torch.arange(m), first].double()
    unstepped = torch.searchsorted(cdf, (uniforms[:, 2] * rest)[:, None], right=True)[:, 0]
    assert not torch.equal(unstepped, tokens[:, 1])


@needs_kernels
def test_a_draw_rounded_past_the_end_is_drawn_again_from_the_rest() -> None:
    probs = torch.tensor([[0.5, 0.5]])
    uniforms = torch.tensor([[0.0, 0.5, 1.0 - 2.0**-53, 0.5]], dtype=torch.float64)  # x + 0.5 rounds up to 1.0
    for tokens, _ in (
        gumbel_top_k_reference(probs, uniforms, 2),
        torch.ops.specpipe_cpu.gumbel_top_k(probs, uniforms, 2),
    ):
        assert tokens.tolist() == [[0, 1]]


@needs_kernels
def test_custom_op_routes_and_opcheck() -> None:
    probs, uniforms = laws(4, 32, seed=1), torch.rand(4, 6, dtype=torch.float64)
    want = gumbel_top_k_reference(probs, uniforms, 3)
    for got in (gumbel_top_k(probs, uniforms, 3), draw_top_k(probs, uniforms, 3)):
        assert torch.equal(got[0], want[0])
    torch.library.opcheck(gumbel_top_k, (probs, uniforms, 3))
    torch.library.opcheck(torch.ops.specpipe_cpu.gumbel_top_k.default, (probs, uniforms, 3))


def test_other_dtypes_take_the_reference() -> None:
    probs, uniforms = laws(3, 16, seed=2).double(), torch.rand(3, 4, dtype=torch.float64)
    got, want = gumbel_top_k(probs, uniforms, 2), gumbel_top_k_reference(probs, uniforms, 2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"uniforms .* \[M, 2k\]"):
        gumbel_top_k(torch.rand(2, 8), torch.rand(2, 3, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="k >= 1"):
        gumbel_top_k(torch.rand(2, 8), torch.rand(2, 0, dtype=torch.float64), 0)
