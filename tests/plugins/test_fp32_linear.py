"""`specpipe::fp32_linear` (`plugins/fp32_linear.py`, kernel `plugins/csrc/fp32_linear.h`): the
C++ kernel equals the plain-torch product to fp32 rounding over awkward sizes (outputs no
16-block divides, every row-tile remainder, more rows than a tile); a row's result is bitwise
the same alone or among others; a weight blocked the wrong way round fails; bad shapes are
refused; `Linear` and `LinearStack` take it up to `SMALL_M` rows and oneDNN's copy above;
opcheck."""

from __future__ import annotations

import pytest
import torch

from model_defs.llama import Linear, pack_cpu_weights, stack_linears
from plugins import cpu_kernels, fp32_linear
from plugins.cpu_linear import cpu_packed_linear, cpu_packing_available
from plugins.fp32_linear import SMALL_M, block16, fp32_linear_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels are not built")

SIZES = [(1, 384, 8192), (5, 384, 640), (6, 1024, 384), (7, 19, 83), (13, 96, 16), (40, 256, 33), (2, 3, 1)]
"""(rows M, inputs I, outputs O): one row and a vocabulary head, a draft tree's rows, one
whole tile, a tile and a remainder with O no 16-block divides, more rows than a tile holds."""


def weight(o: int, i: int) -> torch.Tensor:
    torch.manual_seed(o * 7 + i)
    return torch.randn(o, i) / i**0.5


@pytest.mark.parametrize(("m", "i", "o"), SIZES)
def test_the_kernel_is_the_product_to_rounding(m: int, i: int, o: int) -> None:
    w = weight(o, i)
    x = torch.randn(m, i)
    got = torch.ops.specpipe_cpu.fp32_linear(x, block16(w), o)
    want = x.double() @ w.double().T
    assert got.shape == (m, o)
    assert (got.double() - want).abs().max() < 1e-5
    assert torch.equal(fp32_linear.fp32_linear(x, block16(w), o), got)  # the custom op: the same kernel
    assert (fp32_linear_reference(x, block16(w), o).double() - want).abs().max() < 1e-5


def test_a_row_does_not_depend_on_the_others() -> None:
    """Every output is summed in input order whatever the row's tile: rows alone, in a full
    tile, in a remainder, or in a call of 2-6 rows (one tile whose weights are streamed with
    non-temporal prefetches; past one tile, the first tile prefetches temporally) are
    bitwise the same."""
    w = block16(weight(100, 384))
    x = torch.randn(23, 384)  # tiles of 6: three whole ones and a remainder of 5
    together = torch.ops.specpipe_cpu.fp32_linear(x, w, 100)
    for r in (0, 5, 17, 22):
        alone = torch.ops.specpipe_cpu.fp32_linear(x[r : r + 1].contiguous(), w, 100)
        assert torch.equal(together[r : r + 1], alone)
    for m in range(2, 7):
        streamed = torch.ops.specpipe_cpu.fp32_linear(x[:m].contiguous(), w, 100)
        assert torch.equal(together[:m], streamed)


def test_a_weight_blocked_the_wrong_way_round_fails() -> None:
    w = weight(64, 64)
    x = torch.randn(4, 64)
    want = x @ w.T
    assert (torch.ops.specpipe_cpu.fp32_linear(x, block16(w), 64) - want).abs().max() < 1e-5
    assert (torch.ops.specpipe_cpu.fp32_linear(x, block16(w.T), 64) - want).abs().max() > 1e-1


def test_bad_shapes_are_refused() -> None:
    w = block16(weight(40, 32))
    with pytest.raises(RuntimeError, match="takes 32 inputs, got 31"):
        torch.ops.specpipe_cpu.fp32_linear(torch.randn(2, 31), w, 40)
    with pytest.raises(RuntimeError, match="50 outputs do not fit 3 blocks"):
        torch.ops.specpipe_cpu.fp32_linear(torch.randn(2, 32), w, 50)
    with pytest.raises(ValueError, match=r"\[ceil\(O/16\), I, 16\]"):
        fp32_linear.fp32_linear(torch.randn(2, 32), w[:, :, :8], 40)


def test_opcheck() -> None:
    w = weight(33, 20)
    torch.library.opcheck(fp32_linear.fp32_linear, (torch.randn(3, 20), block16(w), 33))


@pytest.mark.skipif(not cpu_packing_available(), reason="oneDNN's blocked copies")
def test_linears_take_it_up_to_small_m_rows_and_onednn_above() -> None:
    torch.manual_seed(0)
    linear = Linear(64, 80, bias=True)
    stack_members = [Linear(64, 48, bias=False), Linear(64, 16, bias=False)]
    pack_cpu_weights(linear)
    stack = stack_linears(stack_members, int8=False)
    assert linear.small is not None and linear.packed is not None and stack is not None and stack.small is not None
    with torch.inference_mode():
        for m in (1, 7, SMALL_M, SMALL_M + 1):
            x = torch.randn(m, 64)
            got, stacked = linear(x), stack.product(x)
            if m <= SMALL_M:
                assert torch.equal(got, torch.ops.specpipe_cpu.fp32_linear(x, linear.small, 80) + linear.bias)
                assert torch.equal(stacked, torch.ops.specpipe_cpu.fp32_linear(x, stack.small, 64))
            else:
                assert torch.equal(got, cpu_packed_linear(x, linear.packed, linear.bias))
                assert torch.equal(stacked, cpu_packed_linear(x, stack.packed, None))
            assert torch.allclose(got, x @ linear.weight.T + linear.bias, atol=1e-5)
