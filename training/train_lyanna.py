"""Train a Lyanna drafter (`model_defs/lyanna.py`) for a target by distillation.

    python -m training.train_lyanna --target models/demo-target --out models/demo-lyanna

Data: random windows of the training split of the target's corpus (tokenised exactly as
`training/train_target.py` does), run through the frozen target every step (inference
mode, bf16 autocast): its final-norm hidden states H [T, D] and logits L [T, V] at every
position are the labels.

Unrolling (§4.1): every start position p of a window is its own chain, teacher-forced at
step 1 with the true next token: h_0 = H_p, t_1 = t_{p+1}; the chain then runs k steps on
its own outputs, exactly as at inference (no teacher forcing of the hidden states), and

    h_i   should match H_{p+i}                              (feature regression)
    l'_i  = lm_head(h_i) + E'(t_{p+i})  should match softmax(L_{p+i})   (t_{p+i} = the
                                          true token row i follows)
    loss  = sum_i  alpha * MSE(h_i, H_{p+i}) + beta * CE(softmax(L_{p+i}), softmax(l'_i))

All B x S chains of a batch go through the layer together ([B*S, 1, D] per step over the
per-call chain KV), so a step costs k layer passes over B*S rows plus one LM-head matmul
over B*S*k rows. The target's embedding and LM head are frozen and are not saved (they
come from the target at load time).

Loss weights: alpha = 1, beta = 0.1 by default (EAGLE's ratio). The CE term is what decides
acceptance; the MSE term keeps the chain's states in the target's feature space, so that
later steps, which read nothing but h_{i-1}, stay on-distribution. Two 25-step pilots (lr
1e-3, 8 x 64 chains per step, 8 held-out windows) gave the same held-out acceptance per
step for beta = 0.1 (0.231, 0.200, 0.195) and beta = 1 (0.227, 0.200, 0.197), while beta =
0.1 kept the hidden states closer (MSE 2.03/2.22/2.29 vs 2.50/2.67/2.71) and had the better
step-1 top-1 (0.114 vs 0.098): with acceptance a tie, the better-anchored chain wins. At
initialisation the terms are ~3.4 (MSE per step) and ~10 (CE per step), so at beta = 0.1
the regression dominates the early gradient.

Evaluation on non-overlapping held-out windows (fp32), every `eval_every` steps and at the
end, per chain step i = 1..k: top-1 agreement of argmax(l'_i) with argmax(L_{p+i}) and the
expected acceptance E[sum_x min(p(x), q(x))] at temperature 1 (the "k-step accuracy"); at
the end also with the collapsed hot-token table in place of E' (what inference runs).

Hot tokens: the `hot_tokens` most frequent tokens of the training split; their ids are
stored in the checkpoint (`hot_token_ids`) and their coverage in `config.json`. Inference
adds E' only through the hot-token table (§6.1): after a hot token, to the hot columns;
after a cold one, nothing. Training applies the bias the same way (sparse-aware training,
the paper's sparse model of Table 2), so no column learns to lean on a bias that inference
drops; `--no-sparse-token-info` trains the dense bias over all V columns instead.

Ablations (Table 1): `--no-token-info` (no E' bias: TokenInfo neither trained nor saved)
and `--no-first-token-fusion` (step 1 is Layer(fuse(h_0)), fuse = Linear(D -> D)).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import LlamaForCausalLM
from model_defs.lyanna import DEFAULT_HOT_TOKENS, DEFAULT_TOKEN_INFO_RANK, LyannaConfig, LyannaDrafter
from training import corpus
from training.cli import distill_main, write_training_log
from training.model_card import write_lyanna_card
from training.train_target import tokenize


@dataclass
class LyannaTrainConfig:
    """Drafter options, distillation loss and optimisation settings."""

    chain_steps: int = 3
    """k: chain steps unrolled per start position (draft depth trained)."""
    token_info: bool = True
    """Train the token-info logits bias E' (--no-token-info: ablation)."""
    first_token_fusion: bool = True
    """Fuse h_0 with E(t_1) at step 1 (--no-first-token-fusion: h_0 only, ablation)."""
    token_info_rank: int = DEFAULT_TOKEN_INFO_RANK
    """d of E' = RMSNorm(W_E W1 W2)."""
    hot_tokens: int = DEFAULT_HOT_TOKENS
    """H: most frequent training tokens kept in the hot-token table."""
    sparse_token_info: bool = True
    """Train E' as inference applies it: only after hot tokens, only on hot columns
    (--no-sparse-token-info: dense over all V columns, as inference would not use it)."""
    init_from_target: bool = True
    """Initialise the drafter layer and norm from the target's last layer and final norm."""
    init_from: str = ""
    """Start from this trained drafter directory instead (fine-tuning, e.g. a dense-trained
    drafter made sparse-aware); its shape options must match these."""
    autocast: bool = True
    """bf16 autocast of the target and drafter forwards. On CPUs without native bf16 matmul
    (no AVX512-BF16 / AMX) it is ~10x slower than fp32: pass --no-autocast there."""
    alpha: float = 1.0
    """Weight of the hidden-state MSE per chain step."""
    beta: float = 0.1
    """Weight of the soft cross-entropy against the target's distribution per chain step."""
    seq_len: int = 128
    """Window length (start positions per window, before subsampling)."""
    starts_per_window: int = 64
    """Start positions (chains) sampled per window per step; <= seq_len."""
    batch_size: int = 8
    """Windows per step."""
    steps: int = 1200
    """Optimiser steps (~0.8 s each on 2 idle CPU cores: ~20 min with evaluations; 5 s each
    when the cores are shared with other jobs)."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    warmup_steps: int = 30
    """Linear warm-up."""
    weight_decay: float = 0.01
    """AdamW decay on matrices."""
    eval_every: int = 60
    """Held-out evaluation interval (steps); also before training and at the end."""
    eval_windows: int = 16
    """Held-out windows of seq_len start positions per evaluation."""
    seed: int = 0
    """Seeds data order and init."""

    def __post_init__(self) -> None:
        if self.chain_steps < 1:
            raise ValueError(f"chain_steps must be >= 1, got {self.chain_steps}")
        if not 1 <= self.starts_per_window <= self.seq_len:
            raise ValueError(f"starts_per_window must be in 1..seq_len ({self.seq_len}), got {self.starts_per_window}")


def lr_at(step: int, cfg: LyannaTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def hot_token_ids(train_ids: torch.Tensor, vocab_size: int, count: int) -> tuple[torch.Tensor, float]:
    """The `count` most frequent tokens of `train_ids` and the fraction of occurrences they cover."""
    counts = torch.bincount(train_ids, minlength=vocab_size)
    top = counts.topk(count)
    return top.indices, top.values.sum().item() / len(train_ids)


class ChainBatch:
    """Chains of one batch of windows: for each sampled start p, h_0 = H_p, t_1 = t_{p+1},
    and for i = 1..k the labels H_{p+i}, L_{p+i} and the previous token t_{p+i}."""

    def __init__(
        self, target: LlamaForCausalLM, windows: torch.Tensor, starts: torch.Tensor, k: int, autocast: bool
    ) -> None:
        # windows [B, seq_len + k]; starts [B, S] in 0..seq_len-1
        positions = torch.arange(windows.shape[1]).expand(windows.shape[0], -1)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = target(windows, positions)
        hidden, logits = out.hidden.float(), out.logits.float()  # [B, W, D], [B, W, V]
        idx = starts[..., None] + torch.arange(k + 1)  # [B, S, k + 1]: p, p+1, .., p+k
        b = torch.arange(windows.shape[0])[:, None, None]
        self.h0 = hidden[b[..., 0], starts].flatten(0, 1).clone()  # [N, D]
        tokens = windows[b, idx].flatten(0, 1)  # [N, k + 1]: t_p .. t_{p+k}
        self.t1 = tokens[:, 1].clone()  # [N]
        self.prev = tokens[:, 1:].clone()  # [N, k]: t_{p+1} .. t_{p+k}
        self.hidden = hidden[b, idx[..., 1:]].flatten(0, 1).clone()  # [N, k, D]: H_{p+1..p+k}
        self.logits = logits[b, idx[..., 1:]].flatten(0, 1).clone()  # [N, k, V]: L_{p+1..p+k}


def hot_mask(drafter: LyannaDrafter, prev: torch.Tensor) -> torch.Tensor:
    """`[..., V]` bool: where the hot-token table adds E'(prev) (hot previous token, hot column)."""
    hot = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    hot[drafter.hot_token_ids] = True
    return hot[prev][..., None] & hot


def draft_logits(
    drafter: LyannaDrafter, target: LlamaForCausalLM, batch: ChainBatch, k: int, sparse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain hidden states `[N, k, D]` and biased logits l' `[N, k, V]` (fp32); `sparse` adds
    the bias only where the hot-token table does (`hot_mask`)."""
    embed = target.model.embed_tokens
    hidden = drafter.draft_chain(batch.h0, batch.t1, embed, k)
    logits = drafter.head_logits(hidden, target.lm_head)
    if drafter.token_info is not None:
        bias = drafter.token_bias(batch.prev, embed)
        logits = logits + (bias.masked_fill(~hot_mask(drafter, batch.prev), 0.0) if sparse else bias)
    return hidden, logits


def chain_losses(hidden: torch.Tensor, logits: torch.Tensor, batch: ChainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step MSE `[k]` and soft CE `[k]` (fp32, means over chains)."""
    mse = (hidden.float() - batch.hidden).pow(2).mean(dim=(0, 2))
    q = F.softmax(batch.logits, dim=-1)
    ce = -(q * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean(0)
    return mse, ce


@torch.no_grad()
def evaluate(
    drafter: LyannaDrafter, target: LlamaForCausalLM, data: torch.Tensor, cfg: LyannaTrainConfig, hot: bool = False
) -> dict[str, Any]:
    """Held-out per-step metrics over non-overlapping windows, fp32, every start position:
    top-1 agreement, expected acceptance sum_x min(p, q) at temperature 1, MSE and CE.
    `hot=True` also scores the logits biased by the collapsed hot-token table."""
    k, w = cfg.chain_steps, cfg.seq_len + cfg.chain_steps
    n = min(cfg.eval_windows, len(data) // w)
    if n < 1:
        raise ValueError(f"held-out stream of {len(data)} tokens is shorter than one window of {w}")
    drafter.eval()
    table = drafter.hot_table(target.model.embed_tokens, torch.float32) if hot else None
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor) -> None:
        sums[name] = sums.get(name, torch.zeros(k)) + value

    starts_all = torch.arange(cfg.seq_len)
    for i in range(0, n, 4):
        windows = data[i * w : min(n, i + 4) * w].view(-1, w)
        batch = ChainBatch(target, windows, starts_all.expand(len(windows), -1), k, autocast=False)
        hidden, logits = draft_logits(drafter, target, batch, k)
        mse, ce = chain_losses(hidden, logits, batch)
        rows = len(batch.h0)
        add("mse", mse * rows)
        add("ce", ce * rows)
        q = F.softmax(batch.logits, dim=-1)
        variants = {"": logits}
        if table is not None:
            base = drafter.head_logits(hidden, target.lm_head).flatten(0, 1)
            variants["hot_"] = table.bias(batch.prev.flatten(), base).view_as(logits)
        for prefix, lg in variants.items():
            add(prefix + "top1", (lg.argmax(-1) == batch.logits.argmax(-1)).float().sum(0))
            add(prefix + "acceptance", torch.minimum(F.softmax(lg, dim=-1), q).sum(-1).sum(0))
    drafter.train()
    total = n * cfg.seq_len
    return {f"heldout_{name}": [round(v / total, 5) for v in s.tolist()] for name, s in sums.items()}


def init_from_target(drafter: LyannaDrafter, target: LlamaForCausalLM) -> None:
    """Copy the target's last decoder layer and final norm into the drafter's: the chain then
    starts as "one more target layer", already speaking the target's feature space."""
    with torch.no_grad():
        drafter.layer.load_state_dict(target.model.layers[-1].state_dict())
        drafter.norm.weight.copy_(target.model.norm.weight)


@functools.cache
def corpus_ids(tokenizer_file: Path, eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out token streams of the corpus (cached: ablation runs and tests in one
    process tokenise it once)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    train_ids, test_ids = (tokenize(corpus.read_texts(files, root, s), tokenizer, eot) for s in ("train", "test"))
    return train_ids, test_ids


def train(cfg: LyannaTrainConfig, target_dir: Path, out: Path) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM.from_pretrained(target_dir).requires_grad_(False).eval()
    train_ids, test_ids = corpus_ids(target_dir.resolve() / "tokenizer.json", target.config.eos_token_ids[0])
    print(f"corpus: {len(train_ids):,} train tokens, {len(test_ids):,} held-out tokens")

    vocab = target.config.vocab_size
    hot_count = min(cfg.hot_tokens, vocab) if cfg.token_info else 0
    hot_ids, coverage = hot_token_ids(train_ids, vocab, hot_count) if hot_count else (torch.zeros(0), None)
    dcfg = LyannaConfig.from_target(
        target.config,
        first_token_fusion=cfg.first_token_fusion,
        token_info_rank=cfg.token_info_rank if cfg.token_info else 0,
        num_hot_tokens=hot_count,
        hot_token_coverage=None if coverage is None else round(coverage, 5),
    )
    if cfg.autocast and not torch.cpu._is_avx512_bf16_supported():
        tqdm.write("warning: this CPU has no native bf16 matmul; bf16 autocast is ~10x slower here (--no-autocast)")
    drafter = LyannaDrafter(dcfg)
    if cfg.init_from:
        start_from = LyannaDrafter.from_pretrained(cfg.init_from)
        if start_from.config != dcfg:
            raise ValueError(f"--init-from {cfg.init_from}: its config {start_from.config} differs from {dcfg}")
        drafter.load_state_dict(start_from.state_dict())
    elif cfg.init_from_target:
        init_from_target(drafter, target)
    drafter.hot_token_ids.copy_(hot_ids)
    drafter.train()
    decay = [p for n, p in drafter.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    k, w = cfg.chain_steps, cfg.seq_len + cfg.chain_steps
    offsets = torch.arange(w)
    log: list[dict[str, Any]] = [{"step": 0} | evaluate(drafter, target, test_ids, cfg)]
    tqdm.write(json.dumps(log[-1]))
    start = time.time()
    sums = {"train_mse": 0.0, "train_ce": 0.0}
    count = 0
    bar = tqdm(range(cfg.steps), desc="train Lyanna drafter", unit="step")
    for step in bar:
        first = torch.randint(0, len(train_ids) - w, (cfg.batch_size,), generator=gen)
        windows = train_ids[first[:, None] + offsets]  # [B, seq_len + k]
        starts = torch.rand(cfg.batch_size, cfg.seq_len, generator=gen).argsort(-1)[:, : cfg.starts_per_window]
        batch = ChainBatch(target, windows, starts, k, autocast=cfg.autocast)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            hidden, logits = draft_logits(drafter, target, batch, k, sparse=cfg.sparse_token_info and hot_count > 0)
        mse, ce = chain_losses(hidden, logits, batch)
        loss = (cfg.alpha * mse + cfg.beta * ce).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums["train_mse"] += mse.sum().item()
        sums["train_ce"] += ce.sum().item()
        count += 1
        bar.set_postfix(mse=f"{mse.sum().item():.3f}", ce=f"{ce.sum().item():.3f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            last = step + 1 == cfg.steps
            row = {"step": step + 1} | {n: v / count for n, v in sums.items()}
            log.append(row | evaluate(drafter, target, test_ids, cfg, hot=last and hot_count > 0))
            sums, count = dict.fromkeys(sums, 0.0), 0
            tqdm.write(json.dumps(log[-1]))
    bar.close()
    train_minutes = (time.time() - start) / 60
    metrics = {k: v for k, v in log[-1].items() if k.startswith("heldout_")} | {
        "train_minutes": train_minutes,
        "seconds_per_step": train_minutes * 60 / max(1, cfg.steps),
        "torch_threads": torch.get_num_threads(),
        "train_chains": cfg.steps * cfg.batch_size * cfg.starts_per_window,
        "corpus_train_tokens": len(train_ids),
        "heldout_chains": min(cfg.eval_windows, len(test_ids) // w) * cfg.seq_len,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "hot_tokens": hot_count,
        "hot_token_coverage": coverage,
    }
    drafter.save_pretrained(out)
    write_training_log(out, cfg, target_dir, metrics, log)
    return metrics


def main() -> None:
    distill_main(
        __doc__ or "", "training.train_lyanna", "models/demo-lyanna", LyannaTrainConfig, train, write_lyanna_card
    )


if __name__ == "__main__":
    main()
