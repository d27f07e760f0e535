"""Synthetic runs of the load-aware policy (the worlds of `test_speculation_policy.py`) whose
every choice and final state `test_native_policy.py` compares between the policy's Python
and compiled forms (`runtime.native_policy`). Run as a script, it prints them as JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from benchmarks.lockstep import parse_config
from benchmarks.policy_replay import fingerprint
from runtime import native_policy
from runtime.speculation_policy import SpeculationPolicy
from tests.runtime import test_speculation_policy as t


def _scenarios() -> dict[str, Callable[[SpeculationPolicy], tuple[float, list]]]:
    shift = [t.GOOD] * 150 + [t.POOR] * 150  # acceptance collapses: re-probing, going plain
    return {
        "batch 1, steady": lambda p: t.run(p, t.GOOD, batch=1, steps=300),
        "batch 1, shift": lambda p: t.run(p, shift, batch=1, steps=300),
        "batch 8, jitter": lambda p: t.run(p, t.CPU_BATCH, batch=8, steps=150, jitter=0.3, slow_after_trees=1.5),
        "batch 32, costly": lambda p: t.run(p, t.COSTLY, batch=32, steps=60),
        "batch 4, new requests": lambda p: t.run(p, t.LIGHT, batch=4, steps=200, lag=t.Lag(renew_every=40)),
        "batch 1, shift, stands of 4": _patched(STANDS_OF_4, lambda p: t.run(p, shift, batch=1, steps=300)),
    }


STANDS_OF_4 = "redrafter@runtime.speculation_policy.DRAFTING_STANDS=4"
"""A configuration with a policy constant patched, as `benchmarks.lockstep` takes one."""


def _patched(
    config: str, scenario: Callable[[SpeculationPolicy], tuple[float, list]]
) -> Callable[[SpeculationPolicy], tuple[float, list]]:
    """`scenario` under `config`'s patches, set and restored by `benchmarks.lockstep` itself."""

    def run(p: SpeculationPolicy) -> tuple[float, list]:
        with parse_config(config).patched():
            return scenario(p)

    return run


def results() -> dict[str, Any]:
    """Per scenario: tokens per second (repr: exact), the sizes chosen at each step, the full
    solves by cause, and the policy's fingerprint after the run."""
    out: dict[str, Any] = {"compiled": native_policy.active()}
    for name, scenario in _scenarios().items():
        p = t.calibrated(t.CPU_BATCH if "batch 8" in name else t.GOOD)
        rate, history = scenario(p)
        out[name] = {"rate": repr(rate), "sizes": history, "solves": dict(p.solves), "state": fingerprint(p)}
    return out


if __name__ == "__main__":
    print(json.dumps(results()))
