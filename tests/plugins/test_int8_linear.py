"""`specpipe::int8_linear` (`plugins/int8_linear.py`, kernel `plugins/csrc/int8_linear.h`): the
C++ kernel equals the plain-torch reference bit for bit (its integer sums are exact) over
awkward sizes and strided input; the weights are fbgemm's own; the result is the fp32 product
to int8 rounding; a kernel that forgot to take back its unsigned offset (128 x the row sums)
would fail; opcheck. 4-bit weights (`quantize_int8(bits=4)`): the kernel on their nibble
copy equals the same reference bit for bit, a nibble copy with its halves swapped or the +8
left in fails, and a tree search on them is the Python search on them."""

from __future__ import annotations

import pytest
import torch

from plugins import cpu_kernels
from plugins.cpu_linear import int8_available, quantize_int8
from plugins.cpu_linear import int8_linear as cpu_int8_linear
from plugins.int8_linear import (
    Int8Weight,
    block_weight,
    block_weight4,
    int8_linear,
    int8_linear_reference,
    nibbles,
    vectorized,
)

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels are not built"),
    pytest.mark.skipif(not int8_available(), reason="the int8 weights come from fbgemm's packed copies"),
]

SIZES = [(1, 256, 512), (3, 64, 8192), (7, 19, 83), (19, 769, 7), (5, 96, 100), (40, 256, 33), (300, 83, 40)]
"""(rows M, inputs I, outputs O): one row, a vocabulary head, sizes no block divides (I not a
multiple of 4 or 64, O not of 16), more rows than a tile holds, and more rows than one
thread quantizes (a draft LM catching up on a prompt: rows spread over the threads)."""


def weight_of(o: int, i: int) -> Int8Weight:
    torch.manual_seed(o * 7 + i)
    copy = quantize_int8(torch.randn(o, i))
    assert copy is not None
    return Int8Weight.of(copy.packed)


@pytest.mark.parametrize(("m", "i", "o"), SIZES)
def test_the_kernel_is_the_reference_bit_for_bit(m: int, i: int, o: int) -> None:
    w = weight_of(o, i)
    x = torch.randn(m, i) * torch.logspace(-3, 1, m)[:, None]  # rows of very different scales
    got = torch.ops.specpipe_cpu.int8_linear(x, *w)
    assert got.shape == (m, o) and torch.equal(got, int8_linear_reference(x, *w))
    strided = torch.randn(i, m).T  # a transposed (non-contiguous) input goes through the custom op
    assert torch.equal(int8_linear(strided, *w), int8_linear_reference(strided.contiguous(), *w))


def test_a_rows_largest_magnitude_is_found_in_any_lane() -> None:
    """The row's scale is its largest |x|, read a vector of lanes at a time and then the
    tail: placed (negative, so |x| and x differ) in the first lane, the last full vector's
    last lane and the tail, over rows quantized on one thread and over several, every row
    is the reference's."""
    for i in (19, 35, 256):
        w = weight_of(24, i)
        for m in (3, 200):
            x = torch.randn(m, i)
            for row, at in enumerate((0, i // 16 * 16 - 1, i - 1) * m):
                if row < m:
                    x[row, at] = -50.0 - row
            assert torch.equal(torch.ops.specpipe_cpu.int8_linear(x, *w), int8_linear_reference(x, *w)), (i, m)


def test_extreme_products_are_exact() -> None:
    """Every q and w at +-127: a pair of products sums to +-32258, just inside int16, so AVX2's
    `vpmaddubsw` on |q| and sign-carrying w stays exact; q + 128 into `vpmaddubsw` (VNNI's
    unsigned trick) would saturate there, and 7-bit activations (fbgemm's) round: both differ."""
    gen = torch.Generator().manual_seed(5)
    signs = lambda *shape: torch.randint(0, 2, shape, generator=gen).float() * 2 - 1  # noqa: E731
    copy = quantize_int8(signs(48, 256))
    assert copy is not None
    w = Int8Weight.of(copy.packed)
    assert w.weight.abs().min() == 127
    x = signs(5, 256)
    want = int8_linear_reference(x, *w)
    assert torch.equal(torch.ops.specpipe_cpu.int8_linear(x, *w), want)
    exact = x @ (w.weight.float() * w.scale[:, None]).T  # x is exactly on the 8-bit grid: no rounding at all
    torch.testing.assert_close(want, exact, rtol=1e-6, atol=1e-6)
    seven_bits = torch.ops.quantized.linear_dynamic(x, copy.packed, reduce_range=True)
    assert not torch.allclose(seven_bits, exact, rtol=1e-3, atol=1e-3)


def test_weights_are_fbgemms_and_the_product_is_the_fp32_one_to_int8_rounding() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(300, 128), torch.randn(4, 128)
    copy = quantize_int8(weight)
    assert copy is not None
    packed, w = copy.packed, Int8Weight.of(copy.packed)
    assert copy.kernel is None or all(torch.equal(a, b) for a, b in zip(copy.kernel, w, strict=True))
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


def test_the_model_path_takes_the_kernel_where_it_is_vectorized() -> None:
    """`plugins.cpu_linear.int8_linear` (every int8 `Linear` and stack of a drafter) is the
    kernel's product, bitwise, where the kernel is vectorized (AVX-512 VNNI or AVX2), and
    fbgemm's 7-bit one elsewhere; a weight at -128 (which AVX2's sign trick cannot negate)
    is refused with the fix named."""
    torch.manual_seed(1)
    copy = quantize_int8(torch.randn(40, 72))
    assert copy is not None and (copy.kernel is not None) == vectorized()
    x, bias = torch.randn(2, 3, 72), torch.randn(40)
    got = cpu_int8_linear(x, copy, bias)
    if copy.kernel is not None:
        assert torch.equal(got, int8_linear_reference(x.reshape(6, 72), *copy.kernel).view(2, 3, 40) + bias)
    else:
        assert torch.equal(got, torch.ops.quantized.linear_dynamic(x, copy.packed, reduce_range=True) + bias)
    w = Int8Weight.of(copy.packed)
    at_min = w.weight.clone()
    at_min[0, 0] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        Int8Weight.of(torch.ops.quantized.linear_prepack(
            torch._make_per_channel_quantized_tensor(at_min, w.scale.double(), torch.zeros(40, dtype=torch.long), 0),
            None,
        ))  # fmt: skip


def test_opcheck_and_bad_arguments() -> None:
    w = weight_of(33, 40)
    torch.library.opcheck(int8_linear, (torch.randn(3, 40), *w))
    with pytest.raises(ValueError, match="int8"):
        int8_linear(torch.randn(3, 41), *w)
    with pytest.raises(RuntimeError, match="blocked"):
        torch.ops.specpipe_cpu.int8_linear(torch.randn(3, 40), w.weight, w.weight, w.scale, w.sum)


def weight4_of(o: int, i: int) -> Int8Weight:
    torch.manual_seed(o * 5 + i)
    copy = quantize_int8(torch.randn(o, i), bits=4)
    assert copy is not None
    return Int8Weight.of(copy.packed, bits=4)


@pytest.mark.parametrize(("m", "i", "o"), [*SIZES, (4, 384, 8192), (2, 12, 17)])
def test_4_bit_weights_are_the_reference_bit_for_bit(m: int, i: int, o: int) -> None:
    """Weights in [-7, 7] at scale max|w| / 7; under VNNI blocked two a byte (half the bytes),
    elsewhere the int8 layout: the same bits out either way."""
    w = weight4_of(o, i)
    assert w.weight.abs().max() <= 7 and w.weight.abs().max() == 7
    assert w.blocked.dtype == (torch.uint8 if nibbles() else torch.int8)
    if nibbles():
        assert w.blocked.numel() == block_weight(torch.nn.functional.pad(w.weight, (0, -i % 8))).numel() // 2
    x = torch.randn(m, i) * torch.logspace(-3, 1, m)[:, None]
    assert torch.equal(torch.ops.specpipe_cpu.int8_linear(x, *w), int8_linear_reference(x, *w))


def test_4_bit_layout_and_its_wrong_variants() -> None:
    """Byte [b, j, r, c] holds w[16b + r, 8j + c] + 8 low and w[16b + r, 8j + 4 + c] + 8 high; a
    copy with the halves swapped, or a product that keeps the +8 of each nibble, differs."""
    if not nibbles():
        pytest.skip("4-bit blocked copies need AVX-512 VNNI")
    w = weight4_of(40, 24)
    packed = block_weight4(w.weight)
    assert int(packed[1, 2, 3, 1]) == (int(w.weight[19, 17]) + 8) | (int(w.weight[19, 21]) + 8) << 4
    x = torch.randn(3, 24)
    want = int8_linear_reference(x, *w)
    swapped = (packed >> 4) | (packed << 4)
    assert not torch.equal(torch.ops.specpipe_cpu.int8_linear(x, w.weight, swapped, w.scale, w.sum), want)
    s = x.abs().amax(1, keepdim=True) / 127
    kept = want + 8 * torch.round(x / s).sum(1, keepdim=True) * (s * w.scale)  # sum (w + 8) q, no 8 sum q back
    assert not torch.allclose(kept, want, atol=1e-3)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        Int8Weight.of(quantize_int8(torch.randn(40, 24)).packed, bits=4)  # an int8 copy is not 4-bit
    with pytest.raises(RuntimeError, match="nibbles"):
        torch.ops.specpipe_cpu.int8_linear(x, w.weight, packed[:, :1].contiguous(), w.scale, w.sum)
