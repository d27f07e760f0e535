"""`specpipe::argmax_rows` (plugins/argmax_rows.py): the C++ kernel returns torch.argmax's
index at every row of every tensor of a list, on rows with ties (the first maximum), NaN
(the first NaN), infinities, -0.0 beside 0.0, lengths that are not a multiple of 16 and
strided views like the engine's; a wrong variant (the last maximum of a tie) is caught;
bad arguments are refused; other dtypes take the reference. Greedy acceptance reads every
target argmax through it (`runtime.verify.accept_batch`), so the greedy suites (output ==
transformers' greedy) test it end to end."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels
from plugins.argmax_rows import argmax_rows, argmax_rows_reference, greedy_tokens

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")


def rows(m: int, v: int, seed: int) -> torch.Tensor:
    """Random rows, then rows of every special kind (where m allows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=gen)
    specials = [
        lambda r: r.fill_(1.0),  # all tied: index 0
        lambda r: r.__setitem__(slice(v // 3, None, 7), 9.0),  # ties past the first chunk
        lambda r: r.__setitem__(v // 2, float("nan")),  # one NaN
        lambda r: (r.__setitem__(v - 1, float("nan")), r.__setitem__(1, float("nan"))),  # two: the first
        lambda r: r.fill_(float("-inf")),  # all -inf: index 0
        lambda r: r.__setitem__(v - 1, float("inf")),  # +inf in the tail
        lambda r: (r.fill_(-1.0), r.__setitem__(v - 2, 0.0), r.__setitem__(v // 2, -0.0)),  # -0.0 == 0.0: the first
    ]
    for i, special in enumerate(specials[: max(m - 1, 0)]):
        special(x[i + 1])
    return x


@needs_kernels
@pytest.mark.parametrize(("m", "v"), [(1, 8192), (8, 8192), (9, 8192), (5, 3), (33, 1000), (8, 17)])
def test_cpu_kernel_returns_torch_argmax(m: int, v: int) -> None:
    x = rows(m, v, seed=m + v)
    assert torch.equal(torch.ops.specpipe_cpu.argmax_rows([x]), x.argmax(-1))
    parts = [x[:1], x[1 : m // 2 + 1], x[m // 2 + 1 :]]  # the engine's per-request row ranges
    assert torch.equal(torch.ops.specpipe_cpu.argmax_rows(parts), argmax_rows_reference(parts))
    assert greedy_tokens(parts) == x.argmax(-1).tolist()


@needs_kernels
def test_strided_views_and_the_custom_op() -> None:
    """Rows of a wider tensor (row stride > V) and every other row (the same kernel reads them)."""
    wide = rows(16, 8200, seed=3)
    views = [wide[:5, :8192], wide[5::2, :8192]]
    assert torch.equal(argmax_rows(views), argmax_rows_reference(views))
    torch.library.opcheck(argmax_rows, ([wide[:4, :100].contiguous()],))


def test_the_last_maximum_of_a_tie_is_caught() -> None:
    """The test above has teeth: the last index of a tied maximum differs on the tied rows."""
    x = rows(8, 8192, seed=5)
    last = x.shape[-1] - 1 - x.flip(-1).argmax(-1)
    assert not torch.equal(last, argmax_rows_reference([x]))


def test_bad_arguments_are_refused_and_other_dtypes_take_the_reference() -> None:
    with pytest.raises(ValueError, match="one V"):
        greedy_tokens([torch.zeros(2, 5), torch.zeros(2, 6)])
    with pytest.raises(ValueError, match="one or more"):
        greedy_tokens([])
    x = rows(6, 300, seed=7).double()
    assert greedy_tokens([x[:2], x[2:]]) == x.argmax(-1).tolist()
