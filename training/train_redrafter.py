"""Train a ReDrafter drafter for a target by distillation.

    python -m training.train_redrafter --target models/demo-target --out models/demo-redrafter

Data: continuations of random training-corpus windows (`training/distill_data.py`);
`--kd` picks what the drafter learns at every draft position k = 1..T (ReDrafter §3.1
Eq. 1-2, §4.4.3; Table 6 compares KD with ground-truth training):

- `greedy`: cross-entropy against the target's greedy token (sequence-level KD, the
  paper's recipe for greedy decoding);
- `sampled`: cross-entropy against a token sampled from the target at `--kd-temperature`;
- `soft`: on sampled continuations, cross-entropy against the target's whole
  distribution softmax(L_{p+k}) there (= KL to the target up to a constant): the drafter
  learns the law that verification accepts against at T > 0, not one draw of it;
- `ground-truth`: cross-entropy against the corpus text (no target: the baseline).

The drafter's logits are scored unwarped; the soft labels are the target's unwarped (T=1)
distribution, and a temperature divides both at inference. Reported on held-out files:
top-1 agreement with the target's greedy token per draft position (greedy held-out
continuations: what beam search turns into acceptance at T=0) and the expected acceptance
sum_x min(p(x), q(x)) at T=1 per position (sampled held-out continuations: what
verification turns into acceptance at T=1).
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
from training.distill_data import Continuation, DistillData, corpus_windows, make_distill_data
from training.model_card import write_drafter_card
from training.train_target import tokenize

KD_CHOICES = ("greedy", "sampled", "soft", "ground-truth")


@dataclass
class DrafterTrainConfig:
    """Drafter shape, distillation data size and optimisation settings."""

    exit_dim: int = 384
    """Residual-block width (!= 2*hidden adds Apple's input_proj)."""
    num_draft_layers: int = 2
    """Residual blocks."""
    draft_len: int = 5
    """Draft positions trained (T); inference may use any L <= T."""
    train_sequences: int = 18432
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
    kd: str = "greedy"
    """What the drafter learns: greedy | sampled | soft | ground-truth (see the module doc)."""
    kd_temperature: float = 1.0
    """Temperature the target samples training continuations at (--kd sampled/soft)."""
    seed: int = 0
    """Seeds data and init."""

    def __post_init__(self) -> None:
        if self.kd not in KD_CHOICES:
            raise ValueError(f"--kd must be one of {', '.join(KD_CHOICES)}, got {self.kd!r}")
        if self.kd_temperature <= 0:
            raise ValueError(f"--kd-temperature must be > 0, got {self.kd_temperature}")

    @property
    def continuation(self) -> Continuation:
        """The training continuations --kd needs."""
        return {"greedy": "greedy", "ground-truth": "ground-truth"}.get(self.kd, "sampled")  # type: ignore[return-value]


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


def teacher_logits(lm_head: torch.Tensor, batch: DistillData) -> torch.Tensor:
    """The target's logits `[E, T, V]` over the T tokens to predict (its LM head on g_{p+k})."""
    return batch.teacher.float() @ lm_head.t()


def kd_loss(
    drafter: ReDrafter, embed: torch.nn.Embedding, lm_head: torch.Tensor, batch: DistillData, kd: str
) -> torch.Tensor:
    """Mean cross-entropy over draft positions against the labels `kd` names: the
    continuation's tokens, or (`soft`) the target's distribution at every position."""
    logits = draft_logits(drafter, embed, batch).flatten(0, 1)  # [E*T, V]
    if kd == "soft":
        return F.cross_entropy(logits, F.softmax(teacher_logits(lm_head, batch).flatten(0, 1), dim=-1))
    return F.cross_entropy(logits, batch.tokens[:, 1:].flatten())


@torch.no_grad()
def evaluate(
    drafter: ReDrafter, embed: torch.nn.Embedding, lm_head: torch.Tensor, greedy: DistillData, sampled: DistillData
) -> dict[str, object]:
    """Held-out metrics, example-weighted over chunks: on greedy continuations the
    cross-entropy and top-1 agreement with the target's token per position; on sampled ones
    per position the expected acceptance sum_x min(p, q) of a token *drawn* from the drafter
    at T=1 (sampled trees: rsd-c / rsd-s / sd on this drafter) and the target's mass
    q(argmax p) on the drafter's top token (what a deterministic candidate, ReDrafter's
    first beam, is accepted with at T=1)."""
    drafter.eval()
    loss_sum, agree_sum = 0.0, torch.zeros(greedy.tokens.shape[1] - 1)
    accept_sum, mass_sum = torch.zeros(sampled.tokens.shape[1] - 1), torch.zeros(sampled.tokens.shape[1] - 1)
    for i in range(0, len(greedy.hidden), 1024):
        chunk = greedy.rows(slice(i, i + 1024))
        logits, labels = draft_logits(drafter, embed, chunk), chunk.tokens[:, 1:]
        loss_sum += F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item() * len(labels)
        agree_sum += (logits.argmax(-1) == labels).float().sum(0)
    for i in range(0, len(sampled.hidden), 1024):
        chunk = sampled.rows(slice(i, i + 1024))
        logits = draft_logits(drafter, embed, chunk)
        q = F.softmax(teacher_logits(lm_head, chunk), dim=-1)
        accept_sum += torch.minimum(F.softmax(logits, dim=-1), q).sum(-1).sum(0)
        mass_sum += q.gather(-1, logits.argmax(-1, keepdim=True))[..., 0].sum(0)
    drafter.train()
    return {
        "heldout_loss": loss_sum / len(greedy.hidden),
        "heldout_top1_agreement": (agree_sum / len(greedy.hidden)).tolist(),
        "heldout_t1_acceptance": (accept_sum / len(sampled.hidden)).tolist(),
        "heldout_t1_top1_mass": (mass_sum / len(sampled.hidden)).tolist(),
    }


def train(cfg: DrafterTrainConfig, target_dir: Path, out: Path) -> dict[str, object]:
    torch.manual_seed(cfg.seed)
    target = LlamaForCausalLM.from_pretrained(target_dir)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eot = target.config.eos_token_ids[0]
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    streams = {s: tokenize(corpus.read_texts(files, root, s), tokenizer, eot) for s in ("train", "test")}
    extra = cfg.gen_tokens if cfg.kd == "ground-truth" else 0  # the corpus plays the continuation
    train_prompts = corpus_windows(streams["train"], cfg.train_sequences, 16 + extra, 128 + extra, cfg.seed)
    test_prompts = corpus_windows(streams["test"], cfg.heldout_sequences, 16, 128, cfg.seed + 1)
    start = time.time()

    def distill(prompts: list[list[int]], continuation: Continuation, seed: int, temperature: float) -> DistillData:
        return make_distill_data(
            target, tokenizer, prompts, cfg.gen_tokens, cfg.draft_len, continuation, temperature, seed
        )

    data = {
        "train": distill(train_prompts, cfg.continuation, cfg.seed, cfg.kd_temperature),
        "test": distill(test_prompts, "greedy", 0, 1.0),
        "test_sampled": distill(test_prompts, "sampled", 10**6, 1.0),  # T=1 acceptance is scored at temperature 1
    }
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
    lm_head = target.lm_head.weight.detach().float()
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
            loss = kd_loss(drafter, embed, lm_head, data["train"].rows(idx), cfg.kd)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        log.append({"epoch": epoch + 1} | evaluate(drafter, embed, lm_head, data["test"], data["test_sampled"]))
        tqdm.write(json.dumps(log[-1]))
    bar.close()
    metrics = {
        "heldout_loss": log[-1]["heldout_loss"],
        "heldout_top1_agreement": log[-1]["heldout_top1_agreement"],
        "heldout_t1_acceptance": log[-1]["heldout_t1_acceptance"],
        "heldout_t1_top1_mass": log[-1]["heldout_t1_top1_mass"],
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
