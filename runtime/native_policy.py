"""The load-aware policy (`speculation_policy`, `step_costs`) compiled to C with mypyc: the
same source, the same decisions, less host time per step.

Why: at batch 1 the policy's own Python is what keeps load-aware speculation a few percent
behind the best fixed size (its choice, learning and full solves: ~65 us of a ~2 ms
drafting step over a fixed policy's, ReDrafter at T=0 on a 2-thread EPYC). Compiled, the
two modules run ~3x faster warm and ~1.5x with the cold caches a forward leaves (recorded
calls replayed, `benchmarks.policy_replay`). mypyc compiles the annotated Python as it is;
the modules stay the reference, read and tested as Python.

`build()` runs mypyc (through setuptools and the C compiler) on copies of the two sources
into `~/.cache/specpipe/policy/<hash>`, the hash covering the sources and the interpreter:
~15 s on 2 cores, once per machine; `make setup` builds it (`python -m runtime.native_policy`).
`activate()`, at `import runtime`, puts the build of the current sources ahead of them, or
nothing where there is none (the modules then run as Python): an edited source is never
shadowed by an older build. `SPECPIPE_COMPILED_POLICY=0` keeps the Python modules (the test
suite does: its tests replace methods, which compiled classes do not see; the equivalence
test runs both, `tests/runtime/test_native_policy.py`).

Module constants (`speculation_policy.DRAFTING_STANDS`, ...) stay module attributes that the
compiled code reads at each use, so `benchmarks.lockstep`'s `@module.ATTR=VALUE` patches
still apply. Recordings of `benchmarks.policy_replay` hold the classes of the form they were
recorded with and replay only in that form.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

MODULES = ("step_costs", "speculation_policy")
"""The compiled modules of `runtime`, in import order (the policy imports the costs)."""
GROUP = "specpipe_policy"
"""mypyc's shared library of the modules: `<GROUP>__mypyc`, a top-level extension module."""
ENV = "SPECPIPE_COMPILED_POLICY"
SETUP = f"""from setuptools import setup
from mypyc.build import mypycify

setup(name="{GROUP}", packages=[], py_modules=[],
      ext_modules=mypycify([{", ".join(repr(f"runtime/{m}.py") for m in MODULES)}], group_name="{GROUP}"))
"""


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def sources() -> list[Path]:
    return [Path(__file__).parent / f"{m}.py" for m in MODULES]


def build_directory() -> Path:
    """`~/.cache/specpipe/policy/<hash>` of the sources and the interpreter."""
    digest = hashlib.sha256()
    for source in sources():
        digest.update(source.read_bytes())
    digest.update(sys.version.encode())
    digest.update(SETUP.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specpipe" / "policy"
    return root / digest.hexdigest()[:16]


def _libraries(directory: Path) -> list[Path]:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return [directory / f"{GROUP}__mypyc{suffix}", *(directory / "runtime" / f"{m}{suffix}" for m in MODULES)]


def built(directory: Path | None = None) -> bool:
    return all(path.exists() for path in _libraries(directory or build_directory()))


def activate(package_path: list[str]) -> bool:
    """Load the compiled modules where they are enabled and built for the current sources:
    `runtime`'s `package_path` (its `__path__`) searches the build first, and the modules
    are imported here, so that a build that does not load falls back to the Python with a
    warning instead of failing every import. Whether they are compiled."""
    if not enabled():
        return False
    directory = build_directory()
    if not built(directory):
        return False
    package_path.insert(0, str(directory / "runtime"))
    sys.path.append(str(directory))
    try:
        for module in MODULES:
            importlib.import_module(f"runtime.{module}")
    except ImportError as e:
        package_path.remove(str(directory / "runtime"))
        sys.path.remove(str(directory))
        for module in MODULES:
            sys.modules.pop(f"runtime.{module}", None)
        warnings.warn(
            f"the compiled load-aware policy in {directory} does not load ({e}); it runs as Python. "
            f"Rebuild it with `python -m runtime.native_policy --force`, or set {ENV}=0.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def active() -> bool:
    """Whether this process runs the compiled policy."""
    from runtime import speculation_policy

    return not str(speculation_policy.__file__).endswith(".py")


def build(force: bool = False) -> Path | None:
    """Compile the modules into `build_directory()` (nothing to do where they are built,
    unless `force`): the directory, or None with a warning naming the fix where the build
    fails (no C compiler, no mypyc)."""
    directory = build_directory()
    if built(directory) and not force:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=directory.parent) as tmp:
        work = Path(tmp)
        (work / "runtime").mkdir()
        (work / "runtime" / "__init__.py").write_text("")
        for source in sources():
            shutil.copy(source, work / "runtime" / source.name)
        (work / "setup.py").write_text(SETUP)
        done = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=work, capture_output=True, text=True
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
            reason = next((line for line in lines if "error" in line.lower()), lines[-1])
            warnings.warn(
                f"the load-aware policy could not be compiled ({reason.strip()}); it runs as Python, "
                "a few percent slower at batch 1. Install a C compiler and the pinned requirements "
                f"(`make setup`), or set {ENV}=0 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        staged = work / "staged"
        (staged / "runtime").mkdir(parents=True)
        for path in _libraries(staged):
            shutil.move(work / path.relative_to(staged), path)
        if force and directory.exists():
            shutil.rmtree(directory)
        try:
            staged.rename(directory)  # whole, at once: a process never loads half a build
        except OSError:
            if not built(directory):  # (another process's build landed first: keep it)
                raise
    return directory


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=f"Set {ENV}=0 to run the policy as Python. Built once per machine and source; `make setup` runs this.",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even where a build of these sources exists")
    args = ap.parse_args(argv)
    if built() and not args.force:
        print(f"compiled policy: up to date in {build_directory()}")
        return
    print("compiling the load-aware policy with mypyc (~15 s on 2 cores, once) ...", flush=True)
    start = time.perf_counter()
    directory = build(force=args.force)
    if directory is not None:
        print(f"compiled policy: built in {time.perf_counter() - start:.0f} s into {directory}")


if __name__ == "__main__":
    main()
