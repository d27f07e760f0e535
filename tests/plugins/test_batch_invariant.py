"""`plugins/batch_invariant.py`: each row of `bi_linear` (the Triton kernel and the fp64
CPU reference), `bi_rms_norm` and `bi_log_softmax` is the same bits whatever the number
of rows in the call, and stays close to the plain formula.

Without CUDA the Triton kernel runs on CPU tensors under Triton's interpreter, which must
be on before `triton.language` is imported."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from plugins.batch_invariant import bi_linear, bi_linear_triton, bi_log_softmax, bi_rms_norm
from tests.device import TEST_DEVICE

K, N = 96, 80  # odd sizes: partial tiles in N (80 = 64 + 16) and K (96 = 64 + 32)
ROWS = 64
PREFIXES = (1, 3, 17, 64)
SINGLE_ROWS = (0, 5, 40, 63)  # rows at other positions in their tile than when alone


def _data(dtype: torch.dtype, device: str, k: int = K, n: int = N, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    return x, w, b


def _assert_row_invariant(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, moved: bool = True) -> None:
    """Rows of x[:m] equal the same rows of x; with `moved`, also row i called alone (the
    speculative-decoding case: a token is row 0 of a 1-token forward, row j of a tree)."""
    full = f(x)
    for m in PREFIXES:
        assert torch.equal(f(x[:m]), full[:m]), f"rows of a {m}-row call differ from the same rows of {len(x)}"
    for i in SINGLE_ROWS if moved else ():
        assert torch.equal(f(x[i : i + 1]), full[i : i + 1]), f"row {i} alone differs from row {i} of {len(x)}"


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


ULP_RTOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}  # ~1 ulp of the output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_triton_kernel_rows_do_not_depend_on_the_number_of_rows(dtype: torch.dtype, with_bias: bool) -> None:
    """On the GPU also a row moved to another place in its tile (row i alone is row 0). Not
    under the interpreter: its `tl.dot` is numpy's matmul (OpenBLAS), whose fp32 result for a
    row depends on where in the block the row sits (its micro-kernel's row slot)."""
    x, w, b = _data(dtype, TEST_DEVICE)
    bias = b if with_bias else None
    _assert_row_invariant(lambda rows: bi_linear_triton(rows, w, bias), x, moved=x.is_cuda)
    y = bi_linear_triton(x, w, bias)
    assert y.dtype == dtype and y.shape == (ROWS, N)
    # fp32 accumulation vs the exact (fp64) sum: within about one output rounding step
    torch.testing.assert_close(y.double(), _reference(x, w, bias), rtol=ULP_RTOL[dtype], atol=1e-3)


def test_triton_kernel_takes_strided_operands() -> None:
    x, w, b = _data(torch.bfloat16, TEST_DEVICE)
    w_t = w.T.contiguous().T  # same values, column-major
    x_wide = torch.cat([x, x], 1)[:, ::2]  # stride 2 along K
    assert not w_t.is_contiguous() and not x_wide.is_contiguous()
    expected = bi_linear_triton(x_wide.contiguous(), w, b)
    assert torch.equal(bi_linear_triton(x_wide, w_t, b), expected)


def _bi_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bi_linear(x, weight, bias)


def test_cpu_reference_rows_do_not_depend_on_the_number_of_rows() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for k, n in ((K, N), (384, 1024)):
            x, w, b = _data(dtype, "cpu", k, n, seed=1)
            _assert_row_invariant(functools.partial(_bi_linear_rows, weight=w, bias=b), x)
            torch.testing.assert_close(
                bi_linear(x, w, b).double(), _reference(x, w, b), rtol=ULP_RTOL[dtype] / 2, atol=1e-6
            )


def test_plain_fp32_linear_on_this_cpu_is_not_row_invariant_but_bi_linear_is() -> None:
    """The problem itself, where this machine shows it: a row computed alone (M = 1: a
    matrix-vector kernel) and inside a 64-row GEMM can differ in the last bits."""
    x, w, _ = _data(torch.float32, "cpu", 384, 1024, seed=2)
    full, bi_full = F.linear(x, w), bi_linear(x, w, None)
    plain_differs = [i for i in range(ROWS) if not torch.equal(F.linear(x[i : i + 1], w), full[i : i + 1])]
    assert all(torch.equal(bi_linear(x[i : i + 1], w, None), bi_full[i : i + 1]) for i in range(ROWS))
    if not plain_differs:
        pytest.skip("this machine's fp32 F.linear happens to be row-invariant for these shapes")
    assert plain_differs  # (on the 2-core CI machine: every row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype: torch.dtype) -> None:
    x, w, b = _data(dtype, "cpu")
    torch.library.opcheck(bi_linear, (x[:5], w, b))
    torch.library.opcheck(bi_linear, (x[:1], w, None))


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="the CUDA kernel of the op needs a GPU")
def test_op_on_cuda_runs_the_triton_kernel() -> None:
    x, w, b = _data(torch.bfloat16, TEST_DEVICE)
    assert torch.equal(bi_linear(x, w, b), bi_linear_triton(x, w, b))
    torch.library.opcheck(bi_linear, (x[:5], w, b))


def test_bad_shapes_are_refused() -> None:
    x, w, b = _data(torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"must be \[M, K\] and \[N, K\]"):
        bi_linear(x, w[:, :-1], b)
    with pytest.raises(ValueError, match=r"bias \(79,\) must be \[80\]"):
        bi_linear(x, w, b[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_and_log_softmax_rows_do_not_depend_on_the_number_of_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(ROWS, 384, generator=g) * 3).to(TEST_DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(384, generator=g)).to(TEST_DEVICE, dtype)
    _assert_row_invariant(lambda rows: bi_rms_norm(rows, weight, 1e-5), x)
    _assert_row_invariant(bi_log_softmax, x)

    x32 = x.float()  # the plain formulas (model_defs.llama.RMSNorm: fp32, cast, scale)
    plain_norm = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    normed = bi_rms_norm(x, weight, 1e-5)
    assert normed.dtype == plain_norm.dtype
    torch.testing.assert_close(normed, plain_norm, rtol=ULP_RTOL[dtype], atol=1e-6)
    log_probs = bi_log_softmax(x)
    assert log_probs.dtype == dtype
    torch.testing.assert_close(log_probs.float(), torch.log_softmax(x32, -1), rtol=ULP_RTOL[dtype], atol=1e-5)
    torch.testing.assert_close(bi_log_softmax(x.T, dim=0).T, log_probs, rtol=0, atol=0)
