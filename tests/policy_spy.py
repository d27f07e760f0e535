"""A spy on one engine's load-aware policy, for tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.speculation_policy import SpeculationPolicy


def spy_on(
    monkeypatch: pytest.MonkeyPatch, policy: SpeculationPolicy, name: str, before: Callable[..., object]
) -> None:
    """`before(*args)` ahead of each call of `policy`'s method `name` (this policy's only): on
    the class, where the engine's calls go, since a compiled policy's instances take no
    attributes of their own (`runtime.native_policy`)."""
    method = getattr(SpeculationPolicy, name)

    def spied(self: SpeculationPolicy, *args: object) -> object:
        if self is policy:
            before(*args)
        return method(self, *args)

    monkeypatch.setattr(SpeculationPolicy, name, spied)
