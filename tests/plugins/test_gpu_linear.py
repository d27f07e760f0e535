"""`plugins/gpu_linear.py`: the Triton matmul with its tile height fitted to the rows
computes `F.linear` (within fp32 rounding) for every row count around the tile heights,
and on a GPU the op runs it.

Without CUDA the kernel runs on CPU tensors under Triton's interpreter (`tests/conftest.py`
turns it on), where the op itself is its reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugins.batch_invariant import bi_linear_triton
from plugins.gpu_linear import block_m, gpu_linear, gpu_linear_nd
from tests.device import ON_CPU, TEST_DEVICE

K, N = 96, 80  # partial tiles in N (80 = 64 + 16) and K (96 = 64 + 32)
ROW_COUNTS = (1, 5, 16, 17, 32, 33, 64, 70)  # each side of every tile height, and two tiles


def data(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    return x.to(TEST_DEVICE), w.to(TEST_DEVICE), b.to(TEST_DEVICE)


def test_the_tile_is_the_smallest_height_that_holds_the_rows() -> None:
    assert [block_m(m) for m in (1, 16, 17, 32, 33, 64, 65, 512)] == [16, 16, 32, 32, 64, 64, 64, 64]


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_triton_rows_are_f_linear(rows: int, with_bias: bool) -> None:
    """fp32 inputs, fp32 accumulation, no tf32 rounding: within ~1 ulp-scale of the fp64
    product. Test of the test: a kernel that dropped a partial K tile (the last 32 of 96
    columns) is far off."""
    x, w, b = data(rows)
    bias = b if with_bias else None
    y = gpu_linear(x, w, bias) if not ON_CPU else bi_linear_triton(x, w, bias, block_m(rows))
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(y.double(), exact, rtol=2**-18, atol=1e-4)
    torch.testing.assert_close(F.linear(x, w, bias).double(), exact, rtol=2**-18, atol=1e-4)
    short = bi_linear_triton(x[:, :64].contiguous(), w[:, :64].contiguous(), bias, block_m(rows))
    assert not torch.allclose(short.double(), exact, rtol=2**-18, atol=1e-4)


def test_the_op_on_many_dims_and_its_fake() -> None:
    x, w, b = data(12)
    y = gpu_linear_nd(x.view(3, 4, K), w, b)
    assert y.shape == (3, 4, N)
    torch.testing.assert_close(y.view(12, N), F.linear(x, w, b))
    torch.library.opcheck(gpu_linear, (x[:5], w, b))


@pytest.mark.skipif(ON_CPU, reason="the op runs the Triton kernel on CUDA only (SPECPIPE_TEST_DEVICE=cuda)")
def test_on_a_gpu_the_op_is_the_triton_kernel_whatever_the_tile() -> None:
    """The op is the kernel at its fitted tile; and a row's K is walked in the same BLOCK_K
    steps whatever the tile's height, so each row of a 1-, 17- or 40-row call is the same
    bits as in the 70-row call (the verification of a tree and an auto-regressive step
    compute a token's logits alike)."""
    x, w, b = data(70)
    full = gpu_linear(x, w, b)
    assert torch.equal(full, bi_linear_triton(x, w, b, 64))
    for m in (1, 3, 17, 40):
        assert torch.equal(gpu_linear(x[:m], w, b), full[:m]), m
