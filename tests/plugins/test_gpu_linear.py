"""`plugins/gpu_linear.py`: the split-K Triton matmul computes `F.linear` (within fp32
rounding) for every row count up to `MAX_ROWS`, partial tiles and short or empty last
K-slices included, at each configuration; on a GPU the op runs, per shape, whichever of it
and cuBLAS its timing chose.

Without CUDA the kernel runs on CPU tensors under Triton's interpreter (`tests/conftest.py`
turns it on), where the op itself is its reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plugins import gpu_linear as gl
from plugins.gpu_linear import CONFIGS, MAX_ROWS, gpu_linear, gpu_linear_nd, rows_linear
from tests.device import ON_CPU, TEST_DEVICE

K, N = 200, 80  # partial tiles in N (80 = 64 + 16) and K (200: slices of 64 + 64 + 64 + 8 at split 4, 128 + 72 at 2)


def data(rows: int, k: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(N, k, generator=g), torch.randn(N, generator=g)
    return x.to(TEST_DEVICE), w.to(TEST_DEVICE), b.to(TEST_DEVICE)


def close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    return torch.allclose(y.double(), exact, rtol=2**-18, atol=1e-4)


@pytest.mark.parametrize("config", (*CONFIGS, (32, 64, 1)), ids=str)
@pytest.mark.parametrize("rows", (1, 5, 16))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_rows_linear_is_f_linear(config: tuple[int, int, int], rows: int, with_bias: bool) -> None:
    """fp32 inputs, fp32 accumulation, no tf32 rounding: within ~1 ulp-scale of the fp64
    product, as `F.linear` is; K = 24 leaves slices empty at split 4 (one BK step holds it
    all). Test of the test: a kernel that dropped the last 72 columns of K is far off."""
    for k in (K, 24):
        x, w, b = data(rows, k)
        bias = b if with_bias else None
        assert close_to_exact(rows_linear(x, w, bias, config), x, w, bias), k
        assert close_to_exact(F.linear(x, w, bias), x, w, bias)
    x, w, b = data(rows)
    short = rows_linear(x[:, :128].contiguous(), w[:, :128].contiguous(), b if with_bias else None, config)
    assert not close_to_exact(short, x, w, b if with_bias else None)


def test_rows_linear_refuses_what_it_cannot_run() -> None:
    x, w, _ = data(MAX_ROWS + 1)
    with pytest.raises(ValueError, match="at most 16 rows"):
        rows_linear(x, w, None, CONFIGS[0])
    with pytest.raises(ValueError, match="unit stride"):
        rows_linear(x[:4, ::2], w[:, ::2], None, CONFIGS[0])


def test_the_op_on_many_dims_and_its_fake() -> None:
    x, w, b = data(12)
    y = gpu_linear_nd(x.view(3, 4, K), w, b)
    assert y.shape == (3, 4, N)
    torch.testing.assert_close(y.view(12, N), F.linear(x, w, b))
    gpu_linear(x[:5], w, b)  # on a GPU: its shape timed here, not inside opcheck's modes
    torch.library.opcheck(gpu_linear, (x[:5], w, b))


@pytest.mark.skipif(ON_CPU, reason="the op chooses between kernels on CUDA only (SPECPIPE_TEST_DEVICE=cuda)")
def test_on_a_gpu_the_op_runs_its_shapes_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shape is timed once and its choice kept: a call runs cuBLAS's product or the
    Triton kernel's at the chosen configuration, bit for bit. Forced (Triton whatever it
    saves) every shape up to MAX_ROWS rows runs the kernel; forced the other way, none;
    more rows than MAX_ROWS always run cuBLAS, untimed."""
    x, w, b = data(40)
    for saves, forced in ((-1e9, "triton"), (1.0, "cublas"), (gl.TRITON_SAVES, None)):
        monkeypatch.setattr(gl, "TRITON_SAVES", saves)
        monkeypatch.setattr(gl, "_choices", {})
        for m in (1, 3, 8, 16):
            y = gpu_linear(x[:m], w, b)
            config = gl._choices[(m, N, K, x.dtype, True, x.device.index)]
            assert (config is None) == (forced == "cublas") or forced is None
            expected = F.linear(x[:m], w, b) if config is None else rows_linear(x[:m], w, b, config)
            assert torch.equal(y, expected), (m, config)
            assert close_to_exact(y, x[:m], w, b)
        assert torch.equal(gpu_linear(x, w, b), F.linear(x, w, b))
        assert len(gl._choices) == 4
