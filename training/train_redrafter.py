"""Train a ReDrafter drafter for a target by distillation.

    python -m training.train_redrafter --target models/demo-target --out models/demo-redrafter

Data: the target's greedy continuations of random training-corpus windows
(`training/distill_data.py`); held-out data the same way from the held-out files.
Loss (ReDrafter §3.1/§4.4.3): at every draft position k = 1..T, cross-entropy of the
drafter's (unwarped) logits against the token the target generated there — the
sequence-level knowledge-distillation loss of the seed. Reported: held-out top-1
agreement per draft position, the quantity beam search turns into acceptance.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import LlamaForCausalLM
from model_defs.redrafter import ReDrafter, ReDrafterConfig
from training import corpus
from training.cli import distill_main, write_training_log
from training.distill_data import DistillData, corpus_windows, make_distill_data
from training.model_card import write_drafter_card
from training.train_target import tokenize


@dataclass
class DrafterTrainConfig:
    """Drafter shape, distillation data size and optimisation settings."""

    exit_dim: int = 384
    """Residual-block width (!= 2*hidden adds Apple's input_proj)."""
    num_draft_layers: int = 2
    """Residual blocks."""
    draft_len: int = 5
    """Draft positions trained (T); inference may use any L <= T."""
    train_sequences: int = 3072
    """Corpus windows continued by the target for training data."""
    heldout_sequences: int = 128
    """Held-out windows for evaluation."""
    gen_tokens: int = 64
    """Greedy tokens generated per window."""
    batch_size: int = 512
    """Examples per step."""
    epochs: int = 3
    """Passes over the training examples."""
    lr: float = 2e-3
    """Peak learning rate (cosine to 10%)."""
    weight_decay: float = 0.01
    """AdamW decay."""
    seed: int = 0
    """Seeds data and init."""


def draft_logits(drafter: ReDrafter, embed: torch.nn.Embedding, batch: DistillData) -> torch.Tensor:
    """Teacher-forced drafter logits `[E, T, V]`: step k consumes token x_{p+k} (k=1 is the
    bonus) and predicts x_{p+k+1}."""
    h = batch.hidden.float()  # [E, D]
    state = drafter.init_state(h.shape[0])
    out = []
    for k in range(batch.tokens.shape[1] - 1):
        state = drafter.step(state, embed(batch.tokens[:, k]))
        out.append(drafter.logits(h, state, warp=False))
    return torch.stack(out, dim=1)


def loss_and_agreement(
    drafter: ReDrafter, embed: torch.nn.Embedding, batch: DistillData
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE over draft positions and per-position top-1 agreement `[T]`."""
    logits = draft_logits(drafter, embed, batch)  # [E, T, V]
    labels = batch.tokens[:, 1:]  # [E, T]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss, (logits.argmax(-1) == labels).float().mean(0)


@torch.no_grad()
def evaluate(drafter: ReDrafter, embed: torch.nn.Embedding, data: DistillData) -> tuple[float, list[float]]:
    """Held-out loss and per-position top-1 agreement, example-weighted over chunks."""
    drafter.eval()
    loss_sum, agree_sum = 0.0, torch.zeros(data.tokens.shape[1] - 1)
    for i in range(0, len(data.hidden), 1024):
        chunk = DistillData(data.hidden[i : i + 1024], data.tokens[i : i + 1024])
        loss, agree = loss_and_agreement(drafter, embed, chunk)
        loss_sum += loss.item() * len(chunk.hidden)
        agree_sum += agree * len(chunk.hidden)
    drafter.train()
    return loss_sum / len(data.hidden), (agree_sum / len(data.hidden)).tolist()


def train(cfg: DrafterTrainConfig, target_dir: Path, out: Path) -> dict[str, object]:
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM.from_pretrained(target_dir)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eot = target.config.eos_token_ids[0]
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    streams = {s: tokenize(corpus.read_texts(files, root, s), tokenizer, eot) for s in ("train", "test")}
    prompts = {
        "train": corpus_windows(streams["train"], cfg.train_sequences, 16, 128, cfg.seed),
        "test": corpus_windows(streams["test"], cfg.heldout_sequences, 16, 128, cfg.seed + 1),
    }
    start = time.time()
    data = {s: make_distill_data(target, tokenizer, p, cfg.gen_tokens, cfg.draft_len) for s, p in prompts.items()}
    data_minutes = (time.time() - start) / 60
    print(f"distillation data: {len(data['train'].hidden):,} train / {len(data['test'].hidden):,} held-out examples")

    mcfg = target.config
    drafter = ReDrafter(
        ReDrafterConfig(
            vocab_size=mcfg.vocab_size,
            hidden_size=mcfg.hidden_size,
            exit_dim=cfg.exit_dim,
            num_draft_layers=cfg.num_draft_layers,
            rnn=True,
        )
    ).train()
    embed = target.model.embed_tokens.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = len(data["train"].hidden)
    steps = cfg.epochs * math.ceil(n / cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(cfg.seed)
    log = []
    start = time.time()
    bar = tqdm(total=steps, desc="train drafter", unit="step")
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            loss, _ = loss_and_agreement(
                drafter, embed, DistillData(data["train"].hidden[idx], data["train"].tokens[idx])
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        heldout_loss, agreement = evaluate(drafter, embed, data["test"])
        log.append({"epoch": epoch + 1, "heldout_loss": heldout_loss, "heldout_top1_agreement": agreement})
        tqdm.write(json.dumps(log[-1]))
    bar.close()
    metrics = {
        "heldout_loss": log[-1]["heldout_loss"],
        "heldout_top1_agreement": log[-1]["heldout_top1_agreement"],
        "train_examples": n,
        "heldout_examples": len(data["test"].hidden),
        "data_minutes": data_minutes,
        "train_minutes": (time.time() - start) / 60,
        "parameters": sum(p.numel() for p in drafter.parameters()),
    }
    drafter.to(torch.bfloat16).save_pretrained(out)
    write_training_log(out, cfg, target_dir, metrics, log)
    return metrics


def main() -> None:
    distill_main(
        __doc__ or "",
        "training.train_redrafter",
        "models/demo-redrafter",
        DrafterTrainConfig,
        train,
        write_drafter_card,
    )


if __name__ == "__main__":
    main()
