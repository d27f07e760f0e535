"""The C++ CPU kernels in `plugins/csrc/`, compiled on first use for this machine's CPU.

`load()` builds them with torch's extension builder (a C++ compiler and `ninja`, both in
`make setup`) into `~/.cache/specpipe/cpu_kernels/<hash>`, the hash covering the sources,
the compiler flags, torch's version, this CPU's instruction sets (the build uses
`-march=native`) and the ninja that builds them, and registers their ops
(`torch.ops.specpipe_cpu.*`). A build takes ~10 s on 16 cores, ~75 s on 2, once per
machine; later processes load the cached library in well under a second. `make setup`
builds it (`python -m plugins.cpu_kernels`). Processes build or load one at a time (an
`flock` on `GUARD`), and a lock torch's builder left behind when a build was killed is
removed, not waited on (`_unlocked`).

Each kernel has a plain-torch reference it is tested against, and the ops fall back to
it where the kernel does not apply (another dtype or head size) or cannot be built: with
no compiler, `load()` warns once with the fix and returns False. `SPECPIPE_CPU_KERNELS=0`
turns the kernels off (same outputs up to fp32 rounding; for A/B timings).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "tree_attention_cpu.cpp",
        "rope_kv_write_cpu.cpp",
        "gumbel_top_k_cpu.cpp",
        "inverse_cdf_cpu.cpp",
        "redrafter_beam_search_cpu.cpp",
        "int8_linear_cpu.cpp",
        "llama_forward_cpu.cpp",
        "lyanna_chain_cpu.cpp",
        "token_info_top_k_cpu.cpp",
        "argmax_rows_cpu.cpp",
        "fp32_linear_cpu.cpp",
        "chain_verify_cpu.cpp",
    )
]
HEADERS = [
    Path(__file__).parent / "csrc" / name
    for name in ("fp32_linear.h", "int8_linear.h", "inverse_cdf.h", "lanes.h", "llama_loops.h")
]
"""Headers the sources include: part of the build's hash like the sources."""
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
"""-fopenmp: `at::parallel_for` runs on the OpenMP runtime torch has loaded (libgomp)."""
ENV = "SPECPIPE_CPU_KERNELS"
GUARD = "build.flock"
"""File in the build directory whose `flock` a process holds while it builds or loads the
kernels there (`_unlocked`); the kernel drops it when the process dies, however it dies."""


def _cpu_signature() -> str:
    """This CPU's model and instruction-set flags (what `-march=native` compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def use_pinned_ninja() -> str:
    """Put the venv's pinned `ninja` (requirements.txt) first on PATH where it is there, and
    return the ninja builds will run. One ninja for every process: ninja 1.12 changed how
    it hashes command lines, so a system ninja 1.11 and the venv's 1.13 sharing a build
    directory each saw "command line changed" and rebuilt everything (~75 s on 2 cores),
    turn and turn about, whenever a Triton stub (venv bin/ first on PATH) and a plain
    process loaded the kernels."""
    venv_bin = Path(sys.executable).parent
    pinned = venv_bin / "ninja"
    if pinned.exists() and shutil.which("ninja") != str(pinned):
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("ninja") or ""


def build_directory() -> Path:
    """`~/.cache/specpipe/cpu_kernels/<hash>` of what the build depends on, the ninja that
    builds it included (a build directory is never shared by two ninjas, see
    `use_pinned_ninja`)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, _cpu_signature(), use_pinned_ninja()):
        digest.update(part.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specpipe" / "cpu_kernels"
    return root / digest.hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


@functools.cache
def load() -> bool:
    """Build (once per machine) and register the CPU kernels; False where they are off or
    cannot be built (the ops then run their plain-torch references)."""
    if not enabled():
        return False
    from torch.utils import cpp_extension

    directory = build_directory()  # puts the venv's ninja first on PATH
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with open(directory / GUARD, "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # (released when the file closes, or the process dies)
            _unlocked(directory)
            cpp_extension.load(
                name="specpipe_cpu_kernels",
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as e:
        lines = str(e).splitlines() or [repr(e)]
        reason = next((line.strip() for line in lines if "error" in line.lower() and ".cpp" in line), lines[-1])
        warnings.warn(
            f"specpipe's C++ CPU kernels could not be built ({reason}); "
            "attention runs its slower plain-torch reference. Install a C++ compiler and ninja "
            f"(`make setup`), or set {ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def _unlocked(directory: Path) -> None:
    """Remove a `lock` that torch's extension builder left in `directory`, where the caller
    holds the `GUARD` flock (so no process of ours is building there). Torch creates it for
    every load, built or not, and deletes it after; a process killed in between (SIGKILL or
    SIGTERM: a cancelled CI job, a `kill` of a stuck build) leaves it, and every later load
    waited on it forever, asleep (`FileBaton.wait`: session 37, `make demo` in a fresh clone
    hung so)."""
    lock = directory / "lock"
    if lock.exists():
        lock.unlink(missing_ok=True)
        print(f"specpipe: removed a stale build lock {lock} (a kernel build was interrupted)", file=sys.stderr)


def load_with_fake(op: str, fake: Callable[..., Any]) -> bool:
    """`load()`, then give the C++ op `specpipe_cpu::<op>` the fake kernel of the custom op
    it serves (once), so it traces like its custom op; False where the kernels are off.
    Once asked, the answer is a dict lookup, which `torch.compile` traces (`load` hashes
    the sources: a graph break at every op that asked, 17 in a forward of the demo target)."""
    ready = _with_fake.get(op)
    if ready is None:
        ready = load()
        if ready:
            torch.library.register_fake(f"specpipe_cpu::{op}")(fake)
        _with_fake[op] = ready
    return ready


_with_fake: dict[str, bool] = {}


def main() -> None:
    start = time.perf_counter()
    if not enabled():
        print(f"{ENV}=0: the CPU kernels are off")
        return
    if not load():
        raise SystemExit("the CPU kernels could not be built (see the warning above)")
    print(f"CPU kernels ready in {build_directory()} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
