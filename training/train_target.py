"""Train the bundled demo target: a small Llama on the Python standard library.

    python -m training.train_target --out models/demo-target

Trains the tokenizer, tokenizes the manifest's files (documents joined by
`<|endoftext|>`), trains with AdamW + cosine schedule under bf16 autocast (fp32 master
weights: ~1.9x faster than fp32 on this CPU), evaluates held-out loss in fp32, and writes
a Hugging Face `LlamaForCausalLM` directory (bf16 safetensors) with a model card.
Everything is seeded; the same machine kind and thread count reproduce the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import LlamaConfig, LlamaForCausalLM
from training import corpus
from training.cli import add_dataclass_args, dataclass_from_args
from training.model_card import write_model_card
from training.tokenizer import EOT, save_hf_tokenizer, train_tokenizer


@dataclass
class TargetTrainConfig:
    """Model shape and optimisation settings for the demo target."""

    vocab_size: int = 8192
    """BPE vocabulary (byte-level, one special token)."""
    hidden_size: int = 384
    """Model width."""
    intermediate_size: int = 1024
    """SwiGLU width."""
    num_hidden_layers: int = 6
    """Decoder layers."""
    num_attention_heads: int = 6
    """Query heads (head_dim 64)."""
    num_key_value_heads: int = 2
    """KV heads: grouped-query attention, so the demo exercises GQA."""
    max_position_embeddings: int = 1024
    """Context the model is declared for (RoPE extrapolates a little beyond seq_len)."""
    seq_len: int = 256
    """Training window."""
    batch_size: int = 16
    """Windows per step."""
    steps: int = 1100
    """Optimiser steps (~4.5M tokens, ~1.2 epochs; ~35 min on 2 CPU cores)."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of lr."""
    warmup_steps: int = 50
    """Linear warm-up."""
    weight_decay: float = 0.1
    """AdamW decay on matrices."""
    eval_every: int = 250
    """Held-out evaluation interval (steps)."""
    seed: int = 0
    """Seeds data order and init."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} > max_position_embeddings {self.max_position_embeddings}")

    def model_config(self, eot_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=eot_id,
            eos_token_id=eot_id,
        )


def tokenize(texts: list[str], tok: Tokenizer, eot_id: int) -> torch.Tensor:
    """Concatenate documents as `<eot> doc <eot> doc ...` -> `[N]` int64 ids."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(eot_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, cfg: TargetTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, data: torch.Tensor, seq_len: int, max_windows: int = 512) -> float:
    """Mean next-token loss (nats) over non-overlapping held-out windows, fp32."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq_len)
    windows = data[: n * seq_len + 1]
    x = windows[:-1].view(n, seq_len)
    y = windows[1:].view(n, seq_len)
    total = 0.0
    for i in range(0, n, 16):
        logits = model(x[i : i + 16], torch.arange(seq_len).expand(len(x[i : i + 16]), -1)).logits
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y[i : i + 16].reshape(-1), reduction="sum"
        ).item()
    model.train()
    return total / (n * seq_len)


def train(cfg: TargetTrainConfig, out: Path) -> dict[str, float]:
    torch.manual_seed(cfg.seed)
    root = corpus.stdlib_root()
    files = corpus.load_manifest()
    corpus.verify_manifest(files, root)
    train_texts, test_texts = corpus.read_texts(files, root, "train"), corpus.read_texts(files, root, "test")

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise RuntimeError(f"tokenizer lost its special token {EOT}")
    save_hf_tokenizer(tok, out, cfg.max_position_embeddings)
    train_ids, test_ids = tokenize(train_texts, tok, eot_id), tokenize(test_texts, tok, eot_id)
    print(f"corpus: {len(train_ids):,} train tokens, {len(test_ids):,} held-out tokens")

    mcfg = cfg.model_config(eot_id)
    model = LlamaForCausalLM(mcfg)
    for name, p in model.named_parameters():  # GPT-2 style init
        if p.ndim == 2:
            std = (
                0.02 / math.sqrt(2 * mcfg.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else 0.02
            )
            torch.nn.init.normal_(p, std=std)
    model.train()
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    positions = torch.arange(cfg.seq_len).expand(cfg.batch_size, -1)
    offsets = torch.arange(cfg.seq_len + 1)
    log: list[dict[str, float]] = []
    start = time.time()
    bar = tqdm(range(cfg.steps), desc="train target", unit="step")
    for step in bar:
        starts = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = train_ids[starts[:, None] + offsets]  # [B, seq_len + 1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1], positions).logits
        loss = F.cross_entropy(logits.reshape(-1, mcfg.vocab_size), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            log.append(
                {
                    "step": step + 1,
                    "train_loss": loss.item(),
                    "heldout_loss": heldout_loss(model, test_ids, cfg.seq_len),
                }
            )
            tqdm.write(json.dumps(log[-1]))
    minutes = (time.time() - start) / 60
    final = log[-1]["heldout_loss"]
    metrics = {
        "heldout_loss": final,
        "heldout_perplexity": math.exp(final),
        "train_minutes": minutes,
        "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "corpus_train_tokens": len(train_ids),
        "corpus_heldout_tokens": len(test_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    save_checkpoint(model, out)
    (out / "training_log.json").write_text(
        json.dumps({"config": asdict(cfg), "metrics": metrics, "log": log}, indent=2) + "\n"
    )
    return metrics


def save_checkpoint(model: LlamaForCausalLM, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a HF `LlamaForCausalLM` directory: config.json + model.safetensors (tied
    head omitted, as transformers does)."""
    cfg = model.config
    hf = cfg.to_hf() | {"dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models/demo-target"), help="output HF model directory")
    add_dataclass_args(ap, TargetTrainConfig)
    args = ap.parse_args()
    cfg = dataclass_from_args(TargetTrainConfig, args)
    metrics = train(cfg, args.out)
    print(json.dumps(metrics, indent=2))
    print(f"model card: {write_model_card(args.out, 'python -m training.train_target ' + ' '.join(sys.argv[1:]))}")


if __name__ == "__main__":
    main()
