"""Skips for the host-side tests (Triton serving, tensor parallelism under mpirun) on machines
that lack their tools, e.g. a GPU box with no Triton client, no bundled Triton server or no
MPI: those tests skip and say what is missing, instead of erroring. They run on the CPU
whatever `SPECPIPE_TEST_DEVICE` says.

A module that imports `tritonclient` (itself, or through `benchmarks.loadtest`,
`benchmarks.soak`, `triton_repo.client` or `tests/triton_repo/streams.py`) starts with

    pytest.importorskip("tritonclient.grpc", reason="...")

before those imports (it has to be a literal call there, not a helper from this module)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

MPIRUN = shutil.which("mpirun")


def _mpirun_problem() -> str | None:
    """Why the tensor-parallel tests cannot launch `mpirun -n N python ...` here, or None.
    An installed mpirun can still be unable to start processes (e.g. a container without
    ssh/rsh, which OpenMPI's launcher looks for): one `mpirun -n 1 true` (~0.1 s) tells."""
    if MPIRUN is None:
        return "mpirun not on PATH; `make setup` installs OpenMPI"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (requirements.txt)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}  # as the tests launch
    try:
        proc = subprocess.run(
            [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "1", "true"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mpirun cannot start a process here: {e}"
    if proc.returncode != 0:
        said = " ".join(w for w in (proc.stderr + proc.stdout).split() if not w.startswith("---"))
        return f"mpirun cannot start a process here (`mpirun -n 1 true` exited {proc.returncode}): {said[:300]}"
    return None


MPIRUN_PROBLEM = _mpirun_problem()
needs_mpirun = pytest.mark.skipif(MPIRUN_PROBLEM is not None, reason=f"needs a working mpirun: {MPIRUN_PROBLEM}")


def skip_without_tritonserver() -> None:
    """Skip the calling test or fixture when there is no tritonserver to launch: neither a
    system install (NVIDIA's container) nor the one bundled with nvidia-pytriton."""
    from triton_repo.server import find_tritonserver

    try:
        find_tritonserver()
    except FileNotFoundError as e:
        pytest.skip(f"no tritonserver: {e}")
