"""Distil a small draft language model from a target, for speculative sampling.

    python -m training.train_draft_lm --target models/demo-target --out models/demo-draft-lm

The student is a `LlamaForCausalLM` with the target's vocabulary, tokenizer and BOS/EOS
ids (2 layers, width 256 by default). Standard speculative sampling and Recursive
Speculative Decoding accept a drafted token with probability min(1, q/p), so what
matters is how close the student's next-token *distribution* p is to the target's q at
temperature 1, not the student's own perplexity. Hence:

- data: random windows of the training split of the corpus (the target's own training
  text, tokenised exactly as `training/train_target.py` does);
- teacher: the target, frozen, run on the same batch every step (bf16 autocast, no grad)
  for soft labels at every position;
- loss: forward KL(q_target || p_student) at temperature 1, averaged over all positions
  (= soft cross-entropy minus the target's entropy, so 0 means a perfect match). Forward
  KL is mass-covering: it penalises the student for missing tokens the target likes,
  which is what lowers rejections. `hard_weight` > 0 adds that much ordinary
  next-token cross-entropy on the corpus tokens (off by default: it pulls p towards the
  data, not towards q);
- init: the student's (tied) embedding is the target's embedding projected onto its top
  `hidden_size` principal directions, so the LM head starts out ranking tokens roughly
  as the target's does; everything else GPT-2 style;
- evaluation on non-overlapping held-out windows (fp32): KL(q || p) in nats/token, top-1
  agreement with the target's argmax, and the expected speculative-sampling acceptance
  rate E[sum_x min(p(x), q(x))] (= 1 - total variation distance) at temperature 1.

AdamW + cosine schedule under bf16 autocast with fp32 master weights, seeded; writes a
Hugging Face directory (bf16 safetensors, the target's tokenizer files) with a model card.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import LlamaConfig, LlamaForCausalLM
from training import corpus
from training.cli import distill_main, write_training_log
from training.model_card import write_draft_lm_card
from training.train_target import save_checkpoint, tokenize

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class DraftLMTrainConfig:
    """Student shape, distillation loss and optimisation settings."""

    hidden_size: int = 256
    """Student width."""
    intermediate_size: int = 768
    """SwiGLU width."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads (head_dim 64)."""
    num_key_value_heads: int = 2
    """KV heads (grouped-query attention, like the target)."""
    seq_len: int = 256
    """Training window."""
    batch_size: int = 16
    """Windows per step."""
    steps: int = 2000
    """Optimiser steps (~31 min on 2 CPU cores). The cosine schedule spans them: runs of 450,
    1000 and 2000 steps ended at held-out acceptance 0.824, 0.867 and 0.886."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    warmup_steps: int = 30
    """Linear warm-up."""
    weight_decay: float = 0.1
    """AdamW decay on matrices."""
    hard_weight: float = 0.0
    """Weight of the extra hard-label (corpus next-token) cross-entropy; 0 = pure KL."""
    init_from_target: bool = True
    """Initialise the embedding from a PCA projection of the target's embedding."""
    eval_every: int = 75
    """Held-out evaluation interval (steps); also evaluated before training and at the end."""
    eval_windows: int = 64
    """Held-out windows of seq_len tokens per evaluation."""
    seed: int = 0
    """Seeds data order and init."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")

    def model_config(self, target: LlamaConfig) -> LlamaConfig:
        """Student config: this shape, the target's vocabulary, special ids, context and RoPE."""
        if self.seq_len > target.max_position_embeddings:
            raise ValueError(
                f"seq_len {self.seq_len} > target max_position_embeddings {target.max_position_embeddings}"
            )
        return LlamaConfig(
            vocab_size=target.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            max_position_embeddings=target.max_position_embeddings,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            tie_word_embeddings=True,
            bos_token_id=target.bos_token_id,
            eos_token_id=target.eos_token_id,
        )


def lr_at(step: int, cfg: DraftLMTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def init_student(student: LlamaForCausalLM, target: LlamaForCausalLM, from_target: bool) -> None:
    """GPT-2 style init; with `from_target` the embedding is the target's projected onto
    its top principal directions (a linear map, so token-token inner products survive)."""
    cfg = student.config
    for name, p in student.named_parameters():
        if p.ndim == 2:
            deep = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers) if deep else 0.02)
    if from_target:
        emb = target.model.embed_tokens.weight.detach().float()  # [V, D_target]
        k = min(cfg.hidden_size, emb.shape[1])
        _, _, vh = torch.linalg.svd(emb, full_matrices=False)
        with torch.no_grad():
            student.model.embed_tokens.weight[:, :k] = emb @ vh[:k].T


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(q_teacher || p_student) at temperature 1 (fp32)."""
    logp = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    logq = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(logp, logq, log_target=True, reduction="batchmean")


@torch.no_grad()
def evaluate(
    student: LlamaForCausalLM, target: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_windows: int
) -> dict[str, float]:
    """Held-out agreement with the target over non-overlapping windows, fp32, per token:
    KL(q || p) (nats), top-1 agreement, expected acceptance sum_x min(p, q), and both
    models' cross-entropy on the corpus tokens."""
    student.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"held-out stream of {len(data)} tokens is shorter than one window of {seq_len}")
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1 : n * seq_len + 1].view(n, seq_len)
    sums = dict.fromkeys(("kl", "top1_agreement", "acceptance", "student_loss", "target_loss"), 0.0)
    for i in range(0, n, 8):
        xb, yb = x[i : i + 8], y[i : i + 8]
        pos = torch.arange(seq_len).expand(len(xb), -1)
        logp = F.log_softmax(student(xb, pos).logits, dim=-1)
        logq = F.log_softmax(target(xb, pos).logits, dim=-1)
        p, q = logp.exp(), logq.exp()
        sums["kl"] += (q * (logq - logp)).sum().item()
        sums["top1_agreement"] += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
        sums["acceptance"] += torch.minimum(p, q).sum().item()
        sums["student_loss"] += F.nll_loss(logp.flatten(0, 1), yb.flatten(), reduction="sum").item()
        sums["target_loss"] += F.nll_loss(logq.flatten(0, 1), yb.flatten(), reduction="sum").item()
    student.train()
    return {f"heldout_{k}": v / (n * seq_len) for k, v in sums.items()}


def train(cfg: DraftLMTrainConfig, target_dir: Path, out: Path) -> dict[str, float]:
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM.from_pretrained(target_dir).requires_grad_(False).eval()
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eot = target.config.eos_token_ids[0]
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    train_ids, test_ids = (tokenize(corpus.read_texts(files, root, s), tokenizer, eot) for s in ("train", "test"))
    print(f"corpus: {len(train_ids):,} train tokens, {len(test_ids):,} held-out tokens")

    mcfg = cfg.model_config(target.config)
    student = LlamaForCausalLM(mcfg)
    init_student(student, target, cfg.init_from_target)
    student.train()
    decay = [p for p in student.parameters() if p.ndim == 2]
    no_decay = [p for p in student.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    positions = torch.arange(cfg.seq_len).expand(cfg.batch_size, -1)
    offsets = torch.arange(cfg.seq_len + 1)
    log: list[dict[str, float]] = [{"step": 0} | evaluate(student, target, test_ids, cfg.seq_len, cfg.eval_windows)]
    tqdm.write(json.dumps(log[-1]))
    start = time.time()
    kl_sum, kl_count = 0.0, 0
    bar = tqdm(range(cfg.steps), desc="distil draft LM", unit="step")
    for step in bar:
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = train_ids[starts[:, None] + offsets]  # [B, seq_len + 1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                teacher_logits = target(batch[:, :-1], positions).logits
            logits = student(batch[:, :-1], positions).logits
        kl = distill_loss(logits, teacher_logits)
        loss = kl
        if cfg.hard_weight:
            loss = loss + cfg.hard_weight * F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        kl_sum, kl_count = kl_sum + kl.item(), kl_count + 1
        bar.set_postfix(kl=f"{kl.item():.3f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            log.append(
                {"step": step + 1, "train_kl": kl_sum / kl_count}
                | evaluate(student, target, test_ids, cfg.seq_len, cfg.eval_windows)
            )
            kl_sum, kl_count = 0.0, 0
            tqdm.write(json.dumps(log[-1]))
    bar.close()
    metrics = {k: v for k, v in log[-1].items() if k.startswith("heldout_")} | {
        "train_minutes": (time.time() - start) / 60,
        "torch_threads": torch.get_num_threads(),
        "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "corpus_train_tokens": len(train_ids),
        "heldout_tokens": min(cfg.eval_windows, (len(test_ids) - 1) // cfg.seq_len) * cfg.seq_len,
        "parameters": sum(p.numel() for p in student.parameters()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(student, out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(target_dir / name, out / name)
    write_training_log(out, cfg, target_dir, metrics, log)
    return metrics


def main() -> None:
    distill_main(
        __doc__ or "", "training.train_draft_lm", "models/demo-draft-lm", DraftLMTrainConfig, train, write_draft_lm_card
    )


if __name__ == "__main__":
    main()
