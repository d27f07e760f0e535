"""Lyanna Table 2: memory of the dense [V, V] token-info table vs the hot [H, H] table, and
3-step top-1 agreement with the target (teacher forcing on held-out corpus windows) with the
dense low-rank bias, the hot-table bias and no bias."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.lyanna.common import DEPTH
from benchmarks.report import write_report
from model_defs.lyanna import embedding_weight, hot_table_bytes
from runtime.loaded_engine import LoadedEngine
from training import corpus
from training.train_lyanna import ChainBatch
from training.train_target import tokenize


@dataclass
class Table2Row:
    bias: str
    table_shape: str
    table_bytes: int
    top1: list[float]
    """Steps 1..3: top-1 agreement with the target's argmax."""


def heldout_ids(engine: LoadedEngine) -> torch.Tensor:
    """The held-out split of the training corpus as one token stream."""
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    return tokenize(corpus.read_texts(files, root, "test"), engine.tokenizer, engine.eos_token_ids[0])


@torch.inference_mode()
def run(engine: LoadedEngine, num_windows: int, seq_len: int) -> tuple[list[Table2Row], dict[str, Any]]:
    drafter, model = engine.lyanna_drafter, engine.model
    assert drafter is not None
    if drafter.token_info is None or not drafter.config.num_hot_tokens:
        raise SystemExit("error: table2 needs a drafter with a token-info embedding and hot tokens")
    embed = model.model.embed_tokens
    vocab, hot = drafter.config.vocab_size, drafter.config.num_hot_tokens
    table = drafter.hot_table(embed, torch.bfloat16)
    ids = heldout_ids(engine)
    k, w = DEPTH, seq_len + DEPTH
    n = min(num_windows, len(ids) // w)
    if n < 1:
        raise SystemExit(f"error: the held-out stream ({len(ids)} tokens) is shorter than one window of {w}")
    correct = {name: torch.zeros(k) for name in ("none", "dense", "hot")}
    starts = torch.arange(seq_len)
    for i in tqdm(range(0, n, 4), desc="table2", unit="4 windows"):
        windows = ids[i * w : min(n, i + 4) * w].view(-1, w)
        batch = ChainBatch(model, windows, starts.expand(len(windows), -1), k, autocast=False)
        base = drafter.head_logits(drafter.draft_chain(batch.h0, batch.t1, embed, k), model.lm_head)  # [N, k, V]
        want = batch.logits.argmax(-1)
        variants = {
            "none": base,
            "dense": base + drafter.token_bias(batch.prev, embed),
            "hot": table.bias(batch.prev.flatten(), base.flatten(0, 1)).view_as(base),
        }
        for name, logits in variants.items():
            correct[name] += (logits.argmax(-1) == want).float().sum(0)
    total = n * seq_len
    top1 = {name: [round(v / total, 4) for v in c.tolist()] for name, c in correct.items()}
    rank = drafter.config.token_info_rank
    rows = [
        Table2Row("dense low-rank E'(t) (all V columns)", f"[{vocab}, {vocab}]", hot_table_bytes(vocab), top1["dense"]),
        Table2Row(f"hot-token table (H = {hot})", f"[{hot}, {hot}]", hot_table_bytes(hot), top1["hot"]),
        Table2Row("no token info", "-", 0, top1["none"]),
    ]
    n_embed = embedding_weight(embed).shape[1]
    extra = {
        "positions": total,
        "windows": n,
        "seq_len": seq_len,
        "hot_tokens": hot,
        "hot_token_coverage": drafter.config.hot_token_coverage,
        "token_info_rank": rank,
        "low_rank_factor_bytes_bf16": (n_embed * rank + rank * vocab + vocab) * 2,
    }
    return rows, extra


def markdown(rows: list[Table2Row], meta: dict[str, Any]) -> str:
    x = meta["table2"]
    cov = x["hot_token_coverage"]
    lines = [
        "# Lyanna Table 2: hot-token sparse vs dense token-info table",
        "",
        f"Held-out corpus, {x['windows']} windows x {x['seq_len']} positions = {x['positions']} chains (teacher "
        "forcing with the target): for every position p the chain runs 3 steps from (H_p, t_{p+1}); step i counts when "
        "argmax(l_i + bias(t_{p+i})) equals the target's argmax at p+i. Memory: the table in bf16 "
        f"(`hot_table_bytes`). H = {x['hot_tokens']} hot tokens"
        + (f" ({cov:.1%} of training-token occurrences)" if cov else "")
        + f"; the rank-{x['token_info_rank']} factors the dense bias is computed from take "
        f"{x['low_rank_factor_bytes_bf16'] / 2**20:.2f} MiB in bf16, but evaluating them costs a [n x d] x [d x V] "
        "product per drafted node.",
        "",
        "| token-info bias | table | memory (bf16) | top-1 step 1 | step 2 | step 3 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = f"{r.table_bytes / 2**20:.0f} MiB" if r.table_bytes else "-"
        cells = " | ".join(f"{a:.3f}" for a in r.top1)
        lines.append(f"| {r.bias} | {r.table_shape} | {mem} | {cells} |")
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, meta: dict[str, Any], engine: LoadedEngine) -> None:
    """Measure on `engine`'s Lyanna drafter, write `<out-dir>/lyanna_table2.{json,md}`."""
    rows, extra = run(engine, args.windows, args.seq_len)
    meta = {**meta, "table2": extra}
    write_report(args.out_dir / "lyanna_table2", meta, [asdict(r) for r in rows], markdown(rows, meta))
