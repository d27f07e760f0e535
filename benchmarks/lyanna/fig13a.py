"""Lyanna Figure 13a: latency of the drafter chain + ONE LM-head product over the k states
(what the engine runs) vs the same chain with the LM head applied after every step."""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
from tqdm import tqdm

from benchmarks.lyanna.common import ints
from benchmarks.report import write_report
from benchmarks.timing import median_ms
from model_defs.llama import Attend
from model_defs.lyanna import ChainKV, LyannaDrafter, embedding_weight
from runtime.loaded_engine import LoadedEngine


@dataclass
class Fig13aRow:
    batch: int
    k: int
    one_pass_ms: float
    per_step_ms: float
    ratio: float
    """per-step / one-pass."""


@dataclass(frozen=True)
class Chain:
    """The inputs of a drafter chain: h0 `[B, D]`, t1 `[B]`, the target's embedding and LM head."""

    drafter: LyannaDrafter
    h0: torch.Tensor
    t1: torch.Tensor
    embed: torch.nn.Embedding
    lm_head: torch.nn.Linear

    def one_pass(self, k: int) -> torch.Tensor:
        """What the engine runs: `draft_chain`, then ONE `head_logits` product over the k states."""
        return self.drafter.head_logits(self.drafter.draft_chain(self.h0, self.t1, self.embed, k), self.lm_head)

    def per_step(self, k: int) -> torch.Tensor:
        """`draft_chain` with the LM head applied after every step: k `[B, D] x [D, V]` products
        (what a drafter that feeds its drafted token back needs) -> logits `[B, k, V]`."""
        drafter = self.drafter
        x = self.h0.to(drafter.dtype)
        if drafter.config.first_token_fusion:
            x = torch.cat([x, torch.nn.functional.embedding(self.t1, embedding_weight(self.embed)).to(x.dtype)], dim=-1)
        x = drafter.fuse(x)[:, None]
        positions = torch.arange(1, k + 1, device=x.device).expand(x.shape[0], -1)
        cos, sin = drafter.rotary_emb(positions, x.dtype)
        attend = cast(Attend, ChainKV())
        logits = []
        for i in range(k):
            x = drafter.norm(drafter.layer(x, cos[:, i : i + 1], sin[:, i : i + 1], attend))
            logits.append(drafter.head_logits(x, self.lm_head))
        return torch.cat(logits, dim=1)


@torch.inference_mode()
def run(engine: LoadedEngine, ks: list[int], batches: list[int], repeats: int) -> list[Fig13aRow]:
    drafter, model = engine.lyanna_drafter, engine.model
    assert drafter is not None
    embed, lm_head = model.model.embed_tokens, model.lm_head
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        h0 = torch.randn(batch, drafter.config.hidden_size, generator=gen)
        t1 = torch.randint(0, drafter.config.vocab_size, (batch,), generator=gen)
        chain = Chain(drafter, h0, t1, embed, lm_head)
        for k in tqdm(ks, desc=f"fig13a batch {batch}", unit="k"):
            torch.testing.assert_close(chain.per_step(k), chain.one_pass(k))  # the two compute the same logits
            times: dict[str, list[float]] = {"one": [], "step": []}
            one_pass = functools.partial(chain.one_pass, k)
            per_step = functools.partial(chain.per_step, k)
            for _ in range(max(1, repeats // 10)):  # alternate blocks: machine noise hits both alike
                times["one"].append(median_ms(one_pass, 10))
                times["step"].append(median_ms(per_step, 10))
            one_ms, step_ms = statistics.median(times["one"]), statistics.median(times["step"])
            rows.append(Fig13aRow(batch, k, one_ms, step_ms, step_ms / one_ms))
    return rows


def markdown(rows: list[Fig13aRow], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Figure 13a: one-pass vs per-step LM head",
        "",
        f"Drafter chain (`draft_chain`) + LM head, {meta['fig13a_repeats']} timed calls per cell (median of medians "
        f"of 10-call blocks, the two variants alternating by block); {m['cpu']} ({m['torch_threads']} threads), "
        "drafter in its engine dtype, LM head the target's. One-pass: ONE [B*k, D] x [D, V] product after the "
        "chain (`head_logits`); per-step: a [B, D] x [D, V] product after every chain step. Both give the same logits.",
        "",
        "| batch | k | one-pass ms | per-step ms | per-step / one-pass |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.batch} | {r.k} | {r.one_pass_ms:.3f} | {r.per_step_ms:.3f} | {r.ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, meta: dict[str, Any], engine: LoadedEngine) -> None:
    """Time `engine`'s Lyanna drafter, write `<out-dir>/lyanna_fig13a.{json,md}`."""
    rows = run(engine, ints(args.ks), ints(args.batches), args.repeats)
    meta = {**meta, "fig13a_repeats": args.repeats, "drafter_dtype": str(engine.lyanna_drafter.dtype)}  # type: ignore[union-attr]
    write_report(args.out_dir / "lyanna_fig13a", meta, [asdict(r) for r in rows], markdown(rows, meta))
