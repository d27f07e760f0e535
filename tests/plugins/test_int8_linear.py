"""`specpipe::int8_linear` (`plugins/int8_linear.py`, kernel `plugins/csrc/int8_linear.h`): the
C++ kernel equals the plain-torch reference bit for bit (its integer sums are exact) over
awkward sizes and strided input; the weights are fbgemm's own; the result is the fp32 product
to int8 rounding; a kernel that forgot to take back its unsigned offset (128 x the row sums)
would fail; opcheck."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels
from plugins.cpu_linear import int8_available, quantize_int8
from plugins.int8_linear import Int8Weight, block_weight, int8_linear, int8_linear_reference

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels are not built"),
    pytest.mark.skipif(not int8_available(), reason="the int8 weights come from fbgemm's packed copies"),
]

SIZES = [(1, 256, 512), (3, 64, 8192), (7, 19, 83), (19, 769, 7), (5, 96, 100), (40, 256, 33)]
"""(rows M, inputs I, outputs O): one row, a vocabulary head, sizes no block divides (I not a
multiple of 4 or 64, O not of 16), more rows than a tile holds."""


def weight_of(o: int, i: int) -> Int8Weight:
    torch.manual_seed(o * 7 + i)
    return Int8Weight.of(quantize_int8(torch.randn(o, i)))


@pytest.mark.parametrize(("m", "i", "o"), SIZES)
def test_the_kernel_is_the_reference_bit_for_bit(m: int, i: int, o: int) -> None:
    w = weight_of(o, i)
    x = torch.randn(m, i) * torch.logspace(-3, 1, m)[:, None]  # rows of very different scales
    got = torch.ops.specpipe_cpu.int8_linear(x, *w)
    assert got.shape == (m, o) and torch.equal(got, int8_linear_reference(x, *w))
    strided = torch.randn(i, m).T  # a transposed (non-contiguous) input goes through the custom op
    assert torch.equal(int8_linear(strided, *w), int8_linear_reference(strided.contiguous(), *w))


def test_weights_are_fbgemms_and_the_product_is_the_fp32_one_to_int8_rounding() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(300, 128), torch.randn(4, 128)
    packed = quantize_int8(weight)
    w = Int8Weight.of(packed)
    assert torch.equal(w.weight.float() * w.scale[:, None], packed.unpack()[0].dequantize())
    assert torch.equal(w.sum, w.weight.sum(1, dtype=torch.int32))
    assert torch.equal(block_weight(w.weight)[1, 2, 3], w.weight[16 + 3, 8:12])  # [b, j, r, c] = w[16b + r, 4j + c]
    exact = x @ weight.T
    assert (int8_linear(x, *w) - exact).abs().max() < 0.03 * exact.abs().max()


def test_a_kernel_that_keeps_its_unsigned_offset_fails() -> None:
    w = weight_of(64, 256)
    x = torch.randn(2, 256)
    got, want = torch.ops.specpipe_cpu.int8_linear(x, *w), int8_linear_reference(x, *w)
    s = x.abs().amax(1, keepdim=True) / 127
    forgot = want + 128 * w.sum.float() * (s * w.scale)  # (q + 128) . w without the 128 * sum(w) back
    assert torch.equal(got, want) and not torch.allclose(forgot, want, atol=1e-3)


def test_opcheck_and_bad_arguments() -> None:
    w = weight_of(33, 40)
    torch.library.opcheck(int8_linear, (torch.randn(3, 40), *w))
    with pytest.raises(ValueError, match="int8"):
        int8_linear(torch.randn(3, 41), *w)
    with pytest.raises(RuntimeError, match="blocked"):
        torch.ops.specpipe_cpu.int8_linear(torch.randn(3, 40), w.weight, w.weight, w.scale, w.sum)
