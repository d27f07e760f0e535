"""`plugins/cpu_linear.py`: oneDNN-blocked weights for CPU inference linears. The product
equals `F.linear`'s to fp32 rounding for every row count, input shape and stride the
engine produces; the blocked copy is used only where it pays and never under autograd;
and a packed model's forward matches the unpacked one (greedy equality on the demo
engines is in tests/runtime/test_ar_greedy.py and the method suites, which load engines
packed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_defs.llama import Linear, pack_cpu_weights, quantize_linears_int8, stack_linears
from plugins.cpu_linear import (
    cpu_packed_linear,
    cpu_packing_available,
    int8_available,
    int8_linear,
    pack_cpu_weight,
    packed_pays,
    quantize_int8,
)
from tests.tiny_models import tiny_target

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    packed = pack_cpu_weight(weight)
    assert packed is not None
    x = torch.randn(1, rows, 40, generator=gen)
    torch.testing.assert_close(cpu_packed_linear(x, packed, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 80, generator=gen)[:, ::2]  # a non-contiguous view
    torch.testing.assert_close(
        cpu_packed_linear(strided, packed, b), F.linear(strided, weight, b), rtol=1e-5, atol=1e-5
    )


def test_a_wrong_weight_is_caught() -> None:
    """The comparison above can fail: a transposed-then-reshaped weight (a plausible packing
    mistake) gives another product."""
    weight = torch.randn(48, 48)
    x = torch.randn(3, 48)
    packed = pack_cpu_weight(weight.t().contiguous())
    assert packed is not None
    assert not torch.allclose(cpu_packed_linear(x, packed, None), F.linear(x, weight), atol=1e-3)


def test_packing_applies_to_fp32_cpu_weights_only() -> None:
    assert pack_cpu_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    assert packed_pays(torch.randn(1, 1, 4))  # one row too (the module docstring's timings)
    assert packed_pays(torch.randn(1, 2, 4))
    assert not packed_pays(torch.randn(2, 4, dtype=torch.bfloat16))
    assert not packed_pays(torch.randn(2, 4, device="meta"))


def test_autograd_never_uses_the_copy() -> None:
    """Training keeps differentiating the live weight: after an update the packed copy is
    stale, and a forward with gradients must not read it."""
    layer = Linear(16, 8)
    layer.pack_cpu_weight()
    with torch.no_grad():
        layer.weight.mul_(2)
    x = torch.randn(4, 16, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert x.grad is not None
    with torch.inference_mode():
        stale = layer(x.detach())  # documented: pack after the weights are final
    assert not torch.allclose(stale, F.linear(x.detach(), layer.weight, layer.bias))


def test_packed_model_matches_unpacked() -> None:
    model = tiny_target(seed=3, vocab_size=64)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    with torch.inference_mode():
        plain = model(ids, positions).logits
        assert pack_cpu_weights(model) == 2 * 7 + 1  # 7 per layer + the LM head
        packed = model(ids, positions).logits
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


@pytest.mark.skipif(not int8_available(), reason="this torch has no fbgemm")
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_int8_product_is_the_rounded_weights_product(rows: int) -> None:
    """`int8_linear` multiplies by the weight rounded to int8 per output row (plus the
    activations' own 8-bit rounding): close to `F.linear` with the dequantized weight,
    much closer to it than to a wrong weight, and it keeps bias and shape."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(512, 64, generator=gen), torch.randn(512, generator=gen)
    packed = quantize_int8(weight)
    assert packed is not None
    x = torch.randn(2, rows, 64, generator=gen)
    got = int8_linear(x, packed, bias)
    scale = weight.abs().amax(1, keepdim=True) / 127
    exact = F.linear(x, torch.round(weight / scale) * scale, bias)
    assert got.shape == exact.shape and (got - exact).abs().max() < 0.05 * exact.abs().max()
    wrong = F.linear(x, weight.roll(1, 0), bias)
    assert (wrong - exact).abs().max() > 0.2 * exact.abs().max()
    lin = Linear(64, 512)
    lin.weight.data.copy_(weight), lin.bias.data.copy_(bias)
    lin.pack_cpu_weight()
    assert lin.quantize_int8() and lin.packed is None  # the int8 copy replaces the blocked one
    with torch.no_grad():
        assert torch.equal(lin(x), got)
    assert quantize_int8(weight.bfloat16()) is None
    x.requires_grad_(True)
    torch.testing.assert_close(lin(x), F.linear(x, weight, bias))  # autograd: the fp32 weight


@pytest.mark.skipif(not int8_available(), reason="this torch has no fbgemm")
@pytest.mark.parametrize("rows", [1, 3, 19])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_int8_equals_each_linears_int8_product(rows: int, bias: bool) -> None:
    """`LinearStack` (q/k/v or gate/up as one product) gives bitwise what each Linear's own
    int8 copy gives: weights quantized per output row, activations once from the shared
    input, int32 sums exact. A stack in another order than it splits fails."""
    gen = torch.Generator().manual_seed(rows)
    linears = [Linear(40, n, bias=bias) for n in (48, 16, 16)]
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
            if bias:
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
    stack = stack_linears(linears, int8=True)
    assert stack is not None and stack.sizes == [48, 16, 16] and (stack.bias is not None) == bias
    for m in linears:
        assert m.quantize_int8()
    x = torch.randn(1, rows, 40, generator=gen)
    with torch.no_grad():
        for got, m in zip(stack(x), linears, strict=True):
            assert torch.equal(got, m(x))
        swapped = stack_linears([linears[0], linears[2], linears[1]], int8=True)
        assert swapped is not None
        assert not torch.equal(swapped(x)[1], linears[1](x))
    assert stack_linears([Linear(40, 8).bfloat16()], int8=True) is None


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_stacked_blocked_product_equals_each_linears_blocked_product(rows: int) -> None:
    """The fp32 `LinearStack` (`pack_cpu_weights` gives every q/k/v and gate/up one) gives
    what each Linear's own blocked product gives, to fp32 rounding (on the machines we run
    on, bitwise: oneDNN keeps the summation order along the input); a stack split in another
    order than it was stacked fails."""
    gen = torch.Generator().manual_seed(rows)
    linears = [Linear(384, n) for n in (384, 128, 128)]
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(0.05 * torch.randn(m.weight.shape, generator=gen))
            m.pack_cpu_weight()
    stack = stack_linears(linears, int8=False)
    assert stack is not None and not stack.int8 and stack.sizes == [384, 128, 128]
    x = torch.randn(1, rows, 384, generator=gen)
    with torch.no_grad():
        for got, m in zip(stack(x), linears, strict=True):
            torch.testing.assert_close(got, m(x), rtol=1e-6, atol=1e-6)
        swapped = stack_linears([linears[0], linears[2], linears[1]], int8=False)
        assert swapped is not None
        assert not torch.allclose(swapped(x)[1], linears[1](x))
    assert stack_linears([Linear(40, 8).bfloat16()], int8=False) is None


@pytest.mark.skipif(not int8_available(), reason="this torch has no fbgemm")
def test_int8_drafter_layers_stay_close_and_keep_what_they_are_told() -> None:
    """`quantize_linears_int8` on a whole Llama (a draft LM): every Linear but the kept ones
    gets an int8 copy, every attention and MLP a stack; logits stay within int8 rounding of
    fp32's and the greedy tokens mostly agree; autograd and batch-invariant mode use fp32."""
    model = tiny_target(seed=3, vocab_size=64)
    ids, positions = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0)), torch.arange(12)[None]
    with torch.no_grad():
        fp32 = model(ids, positions).logits
    assert quantize_linears_int8(model, keep=[model.lm_head]) == 2 * 7
    assert model.lm_head.int8 is None
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_stack is not None and layer.mlp.gate_up_stack is not None
    assert layer.self_attn.qkv_stack.int8 and layer.mlp.gate_up_stack.int8
    with torch.no_grad():
        int8 = model(ids, positions).logits
    assert 0 < (int8 - fp32).abs().max() < 0.05 * fp32.abs().max()
    assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.75
    with torch.no_grad():
        assert torch.equal(model.set_batch_invariant(True)(ids, positions).logits.argmax(-1), fp32.argmax(-1))
    model.set_batch_invariant(False)
    torch.testing.assert_close(model(ids, positions).logits, fp32, rtol=1e-4, atol=1e-4)  # autograd: fp32
