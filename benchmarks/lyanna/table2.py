"""Lyanna Table 2: memory of the dense [V, V] token-info table vs the hot [H, H] table, and
3-step top-1 agreement with the target (teacher forcing on held-out corpus windows) with the
dense low-rank bias, the hot-table bias and no bias, for two drafters: the main one (trained
sparse, as it is used) and one trained dense (`--dense-drafter`). The paper's comparison is
dense-trained-used-dense vs sparse-trained-used-sparse."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.lyanna.common import DEPTH
from benchmarks.report import write_report
from model_defs.lyanna import LyannaDrafter, embedding_weight, hot_table_bytes
from runtime.loaded_engine import LoadedEngine
from training import corpus
from training.train_lyanna import ChainBatch
from training.train_target import tokenize


@dataclass
class Table2Row:
    trained: str
    """How the drafter's bias was trained: "sparse" (hot-token table in the loss) or "dense"."""
    drafter_dir: str
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


def trained_as(drafter: LyannaDrafter, drafter_dir: str) -> str:
    """ "sparse" or "dense", from the drafter's training log (a drafter without one predates
    sparse-aware training: dense)."""
    log = Path(drafter_dir) / "training_log.json"
    cfg = json.loads(log.read_text())["config"] if log.exists() else {}
    return "sparse" if cfg.get("sparse_token_info") and drafter.config.num_hot_tokens else "dense"


@torch.inference_mode()
def top1_per_bias(
    drafter: LyannaDrafter, engine: LoadedEngine, ids: torch.Tensor, n: int, seq_len: int
) -> dict[str, list[float]]:
    """Top-1 agreement per chain step with no bias, the dense bias and the hot-token table."""
    model, embed, k, w = engine.model, engine.model.model.embed_tokens, DEPTH, seq_len + DEPTH
    table = drafter.hot_table(embed, torch.bfloat16)
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
    return {name: [round(v / (n * seq_len), 4) for v in c.tolist()] for name, c in correct.items()}


def run(
    engine: LoadedEngine, drafter_dir: str, dense_dir: Path | None, num_windows: int, seq_len: int
) -> tuple[list[Table2Row], dict[str, Any]]:
    drafters = {drafter_dir: engine.lyanna_drafter}
    if dense_dir is not None:
        drafters[str(dense_dir)] = LyannaDrafter.from_pretrained(dense_dir).to(engine.device)
    for path, d in drafters.items():
        if d is None or d.token_info is None or not d.config.num_hot_tokens:
            raise SystemExit(f"error: table2 needs drafters with a token-info embedding and hot tokens ({path})")
    main = engine.lyanna_drafter
    assert main is not None
    vocab, hot, rank = main.config.vocab_size, main.config.num_hot_tokens, main.config.token_info_rank
    ids = heldout_ids(engine)
    w = seq_len + DEPTH
    n = min(num_windows, len(ids) // w)
    if n < 1:
        raise SystemExit(f"error: the held-out stream ({len(ids)} tokens) is shorter than one window of {w}")
    rows = []
    for path, drafter in drafters.items():
        assert drafter is not None
        trained, top1 = trained_as(drafter, path), top1_per_bias(drafter, engine, ids, n, seq_len)
        dense_bias = ("dense low-rank E'(t) (all V columns)", f"[{vocab}, {vocab}]", hot_table_bytes(vocab))
        hot_bias = (f"hot-token table (H = {hot})", f"[{hot}, {hot}]", hot_table_bytes(hot))
        rows += [
            Table2Row(trained, path, *dense_bias, top1["dense"]),
            Table2Row(trained, path, *hot_bias, top1["hot"]),
            Table2Row(trained, path, "no token info", "-", 0, top1["none"]),
        ]
    n_embed = embedding_weight(engine.model.model.embed_tokens).shape[1]
    extra = {
        "positions": n * seq_len,
        "windows": n,
        "seq_len": seq_len,
        "hot_tokens": hot,
        "hot_token_coverage": main.config.hot_token_coverage,
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
        "Rows in **bold** are each drafter as it is meant to be used: the dense-trained one with its dense bias "
        "(the paper's dense model), the sparse-trained one with the hot-token table (the paper's sparse model, "
        "and what inference runs).",
        "",
        "| trained | drafter | bias at evaluation | table | memory (bf16) | top-1 step 1 | step 2 | step 3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = f"{r.table_bytes / 2**20:.0f} MiB" if r.table_bytes else "-"
        cells = " | ".join(f"{a:.3f}" for a in r.top1)
        as_used = (r.trained == "dense" and r.bias.startswith("dense")) or (
            r.trained == "sparse" and r.bias.startswith("hot")
        )
        if as_used:
            cells = " | ".join(f"**{a:.3f}**" for a in r.top1)
        lines.append(f"| {r.trained} | `{r.drafter_dir}` | {r.bias} | {r.table_shape} | {mem} | {cells} |")
    used = {r.trained: r for r in rows if (r.trained == "dense") == r.bias.startswith("dense") and r.table_bytes}
    if "dense" in used and "sparse" in used:
        d, sp = used["dense"].top1, used["sparse"].top1
        verdict = "better than" if sum(sp) > sum(d) else "not better than"
        lines += [
            "",
            f"Sparse as trained and used ({', '.join(f'{a:.3f}' for a in sp)}) is {verdict} dense as trained and used "
            f"({', '.join(f'{a:.3f}' for a in d)}), summed over the three steps (the paper's Table 2: sparse better).",
        ]
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, meta: dict[str, Any], engine: LoadedEngine) -> None:
    """Measure on `engine`'s Lyanna drafter, write `<out-dir>/lyanna_table2.{json,md}`."""
    dense = args.dense_drafter if args.dense_drafter.exists() else None
    if dense is None:
        tqdm.write(
            f"table2: no dense-trained drafter at {args.dense_drafter} (make {args.dense_drafter}/model.safetensors)"
        )
    rows, extra = run(engine, str(args.lyanna), dense, args.windows, args.seq_len)
    meta = {**meta, "table2": extra}
    write_report(args.out_dir / "lyanna_table2", meta, [asdict(r) for r in rows], markdown(rows, meta))
