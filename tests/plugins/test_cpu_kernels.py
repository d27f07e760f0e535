"""The C++ kernels' build is shared by every process on the machine: a process whose PATH
finds another ninja first (a plain shell's system ninja, where Triton's stub runs with the
venv's bin/ first) loads the cached library and builds nothing."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugins import cpu_kernels

REPO = Path(__file__).resolve().parents[2]
LIBRARY = "specpipe_cpu_kernels.so"


def in_subprocess(path: str) -> list[str]:
    """`load()` in a fresh python with PATH=`path`: its build directory and ninja."""
    code = "from plugins import cpu_kernels as k; assert k.load(); print(k.build_directory(), k.use_pinned_ninja())"
    env = os.environ | {"PATH": path, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")
def test_a_process_with_another_ninja_first_on_path_builds_nothing() -> None:
    library = cpu_kernels.build_directory() / LIBRARY
    built = library.stat().st_mtime_ns
    venv_bin = str(Path(sys.executable).parent)
    others = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    for path in (os.pathsep.join(others), os.pathsep.join([venv_bin, *others])):
        assert in_subprocess(path) == [str(cpu_kernels.build_directory()), cpu_kernels.use_pinned_ninja()]
    assert library.stat().st_mtime_ns == built, "a process with another PATH rebuilt the kernels"


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    """Torch's extension builder takes a `lock` file for every load and deletes it after: a
    process killed in between left it, and every later process slept on it forever at its
    first kernel (a fresh clone's `make demo` hung so). Under the build directory's flock,
    which no live process of ours holds, such a lock is stale and goes."""
    directory = cpu_kernels.build_directory()
    library = directory / LIBRARY
    built = library.stat().st_mtime_ns
    with open(directory / cpu_kernels.GUARD, "w") as guard:  # (no other process of ours loads meanwhile)
        fcntl.flock(guard, fcntl.LOCK_EX)
        (directory / "lock").touch()
    path = os.environ.get("PATH", "")
    code = "from plugins import cpu_kernels as k; assert k.load()"
    env = os.environ | {"PATH": path, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not (directory / "lock").exists()
    assert library.stat().st_mtime_ns == built, "the load rebuilt the kernels"
