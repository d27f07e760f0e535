"""The device the model and runtime tests compute on: `SPECPIPE_TEST_DEVICE`, "cpu" (the
default), "cuda" or "cuda:N".

    SPECPIPE_TEST_DEVICE=cuda pytest -m "not slow" tests/runtime tests/model_defs tests/plugins

Tests that load engines or build models put them on `TEST_DEVICE` and bring results back
with `.cpu()` to compare them; host-side tests (serving, gloo/mpirun tensor parallelism,
engine builds, benchmarks) run on the CPU whatever the setting. `tests/conftest.py` calls
`check_test_device` before collection, so a device this machine lacks fails the run at
once with a message saying why, instead of erroring in every test.

This module imports no torch (only `check_test_device` does): the conftest reads `ON_CPU`
before anything imports triton, to choose Triton's interpreter or native kernels.
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "SPECPIPE_TEST_DEVICE"
TEST_DEVICE: str = os.environ.get(ENV, "cpu")
ON_CPU: bool = TEST_DEVICE == "cpu"


def check_test_device() -> None:
    """Raise `pytest.UsageError` (pytest prints it and stops before collecting) unless
    `TEST_DEVICE` names a device this machine has."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", TEST_DEVICE):
        raise pytest.UsageError(f"{ENV}={TEST_DEVICE!r}: expected 'cpu' (the default), 'cuda' or 'cuda:N'")
    if ON_CPU:
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{ENV}={TEST_DEVICE} asks for a GPU, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}): run on a machine with an "
            f"NVIDIA GPU and a CUDA build of torch, or unset {ENV} to test on the CPU"
        )
    index, count = torch.device(TEST_DEVICE).index or 0, torch.cuda.device_count()
    if index >= count:
        raise pytest.UsageError(
            f"{ENV}={TEST_DEVICE}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise pytest.UsageError(
            f"{ENV}={TEST_DEVICE} with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: the Triton kernels would run "
            "in the interpreter instead of on the GPU; unset TRITON_INTERPRET"
        )


def cpu_only(reason: str) -> pytest.MarkDecorator:
    """Skip a test (or, as `pytestmark`, a module) unless the test device is the CPU."""
    return pytest.mark.skipif(not ON_CPU, reason=f"runs on the CPU only ({ENV}={TEST_DEVICE}): {reason}")


def cuda_only(reason: str) -> pytest.MarkDecorator:
    """Skip a test (or a module) unless the test device is a GPU."""
    return pytest.mark.skipif(ON_CPU, reason=f"needs {ENV}=cuda: {reason}")
