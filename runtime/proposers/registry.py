"""Which proposer runs which method on which drafter: the one table loading, building, the
CLIs, Triton and the benchmarks ask. Adding a method = a proposer module + a line here.

Drafter kinds (`runtime.engine_dir.DRAFTER_KINDS`): "redrafter" (the RNN), "draft-lm",
"lyanna"; None is a target-only engine.
"""

from __future__ import annotations

from runtime.engine_dir import DRAFTER_KINDS
from runtime.proposers.ar import ARProposer
from runtime.proposers.lyanna import LyannaProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.proposer import Proposer
from runtime.proposers.redrafter import ReDrafterProposer
from runtime.proposers.rsd import LevelTreeProposer

ANY_ENGINE: tuple[str | None, ...] = (None, *DRAFTER_KINDS)
RSD_DRAFTERS = ("redrafter", "draft-lm")

PROPOSERS: dict[str, dict[str | None, type[Proposer]]] = {
    "ar": dict.fromkeys(ANY_ENGINE, ARProposer),
    "redrafter": {"redrafter": ReDrafterProposer, "draft-lm": LevelTreeProposer},
    "rsd-c": dict.fromkeys(RSD_DRAFTERS, LevelTreeProposer),
    "rsd-s": dict.fromkeys(RSD_DRAFTERS, LevelTreeProposer),
    "sd": dict.fromkeys(RSD_DRAFTERS, LevelTreeProposer),
    "lyanna": {"lyanna": LyannaProposer},
    "ngram": dict.fromkeys(ANY_ENGINE, NgramProposer),
}
"""method -> drafter kind -> its proposer."""

METHODS = tuple(PROPOSERS)
DEFAULT_METHOD: dict[str | None, str] = {None: "ar", "redrafter": "redrafter", "draft-lm": "sd", "lyanna": "lyanna"}
"""Method of requests that name none, by the engine's drafter kind."""


def methods_for(kind: str | None) -> tuple[str, ...]:
    """Methods an engine with this drafter kind runs."""
    return tuple(m for m, by_kind in PROPOSERS.items() if kind in by_kind)


def proposer_class(method: str, kind: str | None) -> type[Proposer]:
    """The proposer of `method` on an engine whose drafter is `kind`; ValueError naming the fix."""
    if method not in PROPOSERS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if kind not in PROPOSERS[method]:
        what = f"this engine's {kind} drafter" if kind else "an engine without a drafter"
        needs = sorted(k for k in PROPOSERS[method] if k)
        raise ValueError(
            f"method {method!r} does not run on {what}; it needs a drafter of kind {needs} "
            f"(rebuild with --drafter, --draft-model or --lyanna), or use one of {methods_for(kind)}"
        )
    return PROPOSERS[method][kind]
