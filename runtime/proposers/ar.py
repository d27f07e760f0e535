"""Auto-regressive decoding as a proposer: the tree is the pending token alone, so
verification samples (or takes the argmax of) exactly one next token per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime.proposers.proposer import Proposer
from runtime.request import Request
from runtime.tree import DraftTree


class ARProposer(Proposer):
    def params(self, method: str, settings: Mapping[str, Any]) -> None:
        return None

    def sizes(self, params: None) -> list[int]:
        return [1]

    def propose(self, requests: list[Request], budgets: list[int]) -> list[DraftTree]:
        return [DraftTree.root(r.pending) for r in requests]
