"""The load-aware policy compiled with mypyc (`runtime/native_policy.py`) against its Python
form: the same choices, costs and state, to the bit, in synthetic runs; the policy's own
tests pass on the form the rest of the suite does not run; a build is never loaded for
sources other than its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import native_policy

ROOT = Path(__file__).resolve().parents[2]
POLICY_TESTS = ["tests/runtime/test_speculation_policy.py", "tests/runtime/test_step_costs.py"]


def _in(compiled: bool, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, native_policy.ENV: "1" if compiled else "0"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built() -> Path:
    """The build of the current sources (`make setup` made it; built here where it did not)."""
    directory = native_policy.build()
    assert directory is not None, "the policy does not compile: see the warning above (`make setup`)"
    return directory


def test_the_compiled_policy_decides_and_learns_as_the_python_one(built: Path) -> None:
    """Six synthetic runs (`policy_scenarios.py`: batch 1 steady and after acceptance
    collapses, batch 8 with jitter and slow plain steps after trees, batch 32 where drafting
    does not pay, batch 4 with requests replaced, and the collapse again with a module
    constant patched by `benchmarks.lockstep`'s own patching): every step's sizes, the tokens per second, the
    solves by cause and a fingerprint of the whole state equal the Python form's. Test of
    the test: the compiled run is compiled (and mypyc checks the declared types the Python
    does not: an int constant that was a float, a float sum started at int 0, each failed
    here before it was fixed)."""
    runs = {}
    for compiled in (False, True):
        done = _in(compiled, "-m", "tests.runtime.policy_scenarios")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[compiled] = json.loads(done.stdout)
    assert runs[True].pop("compiled") is True and runs[False].pop("compiled") is False
    assert runs[True].keys() == runs[False].keys()
    for name in runs[False]:
        assert runs[True][name] == runs[False][name], name
    # the patched constant reached the compiled code: that run differs from the one without it
    assert runs[True]["batch 1, shift, stands of 4"]["sizes"] != runs[True]["batch 1, shift"]["sizes"]


def test_the_policys_own_tests_pass_on_the_other_form(built: Path) -> None:
    """The suite runs the policy in one form (compiled where it is built, as an engine does);
    its own tests run here on the other, those that replace its functions included."""
    other = not native_policy.active()
    done = _in(other, "-m", "pytest", "-q", "-p", "no:cacheprovider", *POLICY_TESTS, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
    if other:  # compiled: the tests that replace functions are skipped, the rest pass
        assert "skipped" in done.stdout.splitlines()[-1]


def test_a_build_is_loaded_only_for_its_own_sources(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`build_directory` hashes the sources: a copy edited by one character has its own
    (not built), so `activate` leaves the Python modules in place; the build of the current
    sources loads. `SPECPIPE_COMPILED_POLICY=0` loads nothing."""
    assert native_policy.built(built)
    edited = []
    for source in native_policy.sources():
        copy = tmp_path / source.name
        copy.write_text(source.read_text() + "\n")
        edited.append(copy)
    monkeypatch.setattr(native_policy, "sources", lambda: edited)
    assert native_policy.build_directory() != built and not native_policy.built()
    assert native_policy.activate([]) is False
    monkeypatch.undo()
    assert native_policy.build_directory() == built
    check = "from runtime import native_policy; print(native_policy.active())"
    assert _in(True, "-c", check).stdout.strip() == "True"
    assert _in(False, "-c", check).stdout.strip() == "False"
