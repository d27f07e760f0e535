"""Model card (README.md) for the bundled demo target, written from its training log so
the numbers in it are the ones measured, never typed by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from training import corpus


def optimiser(cfg: dict[str, Any]) -> str:
    """The optimiser row of a model card from a training config (AdamW, the schedule, the
    precision, and the drafter it was fine-tuned from, if any)."""
    precision = "bf16 autocast" if cfg.get("autocast", True) else "fp32"
    line = (
        f"AdamW (lr {cfg['lr']}, cosine to {cfg['min_lr_ratio']}x, warm-up {cfg['warmup_steps']}, "
        f"wd {cfg['weight_decay']}), {precision}, seed {cfg['seed']}"
    )
    return line + (f", fine-tuned from `{cfg['init_from']}`" if cfg.get("init_from") else "")


def write_model_card(model_dir: Path, command: str) -> Path:
    log = json.loads((model_dir / "training_log.json").read_text())
    cfg, m = log["config"], log["metrics"]
    files = corpus.load_manifest()
    held = sum(f.split == "test" for f in files)
    size_mb = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e6
    curve = "\n".join(f"| {r['step']} | {r['train_loss']:.3f} | {r['heldout_loss']:.3f} |" for r in log["log"])
    shape = (
        f"{cfg['num_hidden_layers']} layers, width {cfg['hidden_size']}, SwiGLU {cfg['intermediate_size']}, "
        f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads, tied embeddings"
    )
    rows = [
        ("parameters", f"{m['parameters']:,} ({shape})"),
        ("vocabulary", f"{cfg['vocab_size']} byte-level BPE tokens; `<\\|endoftext\\|>` (id 0) is BOS, EOS and pad"),
        ("weights", f"bfloat16 safetensors, {size_mb:.1f} MB"),
        (
            "data",
            f"{len(files)} non-test `.py` files of the standard library, listed with sha256 in "
            f"`training/data/stdlib_manifest.json`; {held} files held out by path hash",
        ),
        (
            "tokens",
            f"{m['corpus_train_tokens']:,} train / {m['corpus_heldout_tokens']:,} held-out; "
            f"{m['train_tokens']:,} seen in training "
            f"(batch {cfg['batch_size']} x {cfg['seq_len']}, {cfg['steps']} steps)",
        ),
        (
            "optimiser",
            optimiser(cfg),
        ),
        ("held-out loss", f"{m['heldout_loss']:.3f} nats/token (perplexity {m['heldout_perplexity']:.1f})"),
        ("training time", f"{m['train_minutes']:.1f} min on 2 CPU cores"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    python = json.loads(corpus.MANIFEST.read_text())["python"]
    text = f"""# specpipe demo target

A small Llama (`LlamaForCausalLM`, Hugging Face format) trained from scratch by
`training/train_target.py` on the Python {python} standard library, so specpipe runs
end to end with no downloads. It writes plausible-looking Python; it is a test bed for
speculative decoding, not a useful code model.

| | |
|---|---|
{table}

Reproduce (`make model` runs exactly this):

```
{command}
```

| step | train loss | held-out loss |
|---|---|---|
{curve}
"""
    path = model_dir / "README.md"
    path.write_text(text)
    return path


if __name__ == "__main__":
    print(write_model_card(Path(sys.argv[1]), " ".join(sys.argv[2:]) or "make model"))


def write_drafter_card(drafter_dir: Path, command: str) -> Path:
    """README.md for a distilled ReDrafter drafter, from its training log."""
    log = json.loads((drafter_dir / "training_log.json").read_text())
    cfg, m = log["config"], log["metrics"]
    drafter_cfg = json.loads((drafter_dir / "config.json").read_text())
    size_mb = sum(p.stat().st_size for p in drafter_dir.glob("*.safetensors")) / 1e6
    agreement = ", ".join(f"{a:.3f}" for a in m["heldout_top1_agreement"])
    kd = cfg.get("kd", "greedy")
    t1 = m.get("heldout_t1_acceptance")
    curve = "\n".join(
        f"| {r['epoch']} | {r['heldout_loss']:.3f} | {', '.join(f'{a:.3f}' for a in r['heldout_top1_agreement'])} | "
        f"{', '.join(f'{a:.3f}' for a in r.get('heldout_t1_acceptance', [])) or '-'} |"
        for r in log["log"]
    )
    temperature = cfg.get("kd_temperature", 1.0)
    source = {
        "greedy": "the target's greedy continuations",
        "ground-truth": "the corpus's own continuations",
    }.get(kd, f"continuations sampled from the target at T={temperature}")
    loss = {
        "greedy": "cross-entropy against the target's greedy tokens at every draft position (sequence-level KD)",
        "sampled": "cross-entropy against the target's sampled tokens at every draft position (KD on samples)",
        "soft": "cross-entropy against the target's whole distribution at every draft position (soft-label KD)",
        "ground-truth": "cross-entropy against the corpus tokens (no distillation)",
    }[kd]
    rows = [
        ("target", f"`{log['target']}`"),
        (
            "architecture",
            f"Apple ReDrafter drafter (`{drafter_cfg['model_type']}`): RNN state over the target's embeddings, "
            f"{drafter_cfg['num_draft_layers']} residual blocks of width {drafter_cfg['exit_dim']}, "
            f"rnn={drafter_cfg['rnn']}",
        ),
        ("parameters", f"{m['parameters']:,} (bfloat16 safetensors, {size_mb:.1f} MB)"),
        (
            "data",
            f"{source} ({cfg['gen_tokens']} tokens) of {cfg['train_sequences']} random "
            f"training-corpus windows: {m['train_examples']:,} examples of {cfg['draft_len']} draft positions; "
            f"held out: {m['heldout_examples']:,} examples from the held-out files",
        ),
        ("loss", f"`--kd {kd}`: {loss}"),
        ("held-out top-1 agreement per draft position (greedy continuations)", agreement),
        (
            "held-out expected acceptance at T=1 per draft position (sampled continuations)",
            ", ".join(f"{a:.3f}" for a in t1 or []),
        ),
        (
            "held-out target mass on the drafter's top token at T=1 (a beam's acceptance)",
            ", ".join(f"{a:.3f}" for a in m.get("heldout_t1_top1_mass", [])),
        ),
        ("time", f"{m['data_minutes']:.1f} min data generation + {m['train_minutes']:.1f} min training on 2 CPU cores"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v)  # metrics older logs lack are left out
    text = f"""# specpipe demo ReDrafter drafter{" (soft-label KD, for sampling)" if kd == "soft" else ""}

Distilled from the demo target by `training/train_redrafter.py`; saved with Apple's
`ml-recurrent-drafter` config keys and tensor names.

| | |
|---|---|
{table}

Reproduce (`{"make drafter-soft" if kd == "soft" else "make drafter"}` runs exactly this):

```
{command}
```

| epoch | held-out loss | held-out top-1 agreement per position | held-out T=1 acceptance per position |
|---|---|---|---|
{curve}
"""
    path = drafter_dir / "README.md"
    path.write_text(text)
    return path


def write_draft_lm_card(model_dir: Path, command: str) -> Path:
    """README.md for a draft LM distilled from a target, from its training log."""
    log = json.loads((model_dir / "training_log.json").read_text())
    cfg, m = log["config"], log["metrics"]
    model_cfg = json.loads((model_dir / "config.json").read_text())
    size_mb = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e6
    shape = (
        f"{model_cfg['num_hidden_layers']} layers, width {model_cfg['hidden_size']}, "
        f"SwiGLU {model_cfg['intermediate_size']}, {model_cfg['num_attention_heads']} query / "
        f"{model_cfg['num_key_value_heads']} KV heads, tied embeddings"
    )
    loss = "forward KL(target ‖ draft) at temperature 1 over every position of each window"
    if cfg["hard_weight"]:
        loss += f" + {cfg['hard_weight']} x cross-entropy on the corpus tokens"
    init = "embedding = the target's, projected onto its top principal directions" if cfg["init_from_target"] else ""
    rows = [
        ("target", f"`{log['target']}` ({m['target_parameters']:,} parameters); same tokenizer and vocabulary"),
        ("parameters", f"{m['parameters']:,} ({shape})"),
        ("weights", f"bfloat16 safetensors, {size_mb:.1f} MB"),
        (
            "data",
            f"random windows of the training split of the target's corpus: {m['train_tokens']:,} tokens seen "
            f"(batch {cfg['batch_size']} x {cfg['seq_len']}, {cfg['steps']} steps) of "
            f"{m['corpus_train_tokens']:,}",
        ),
        ("loss", loss + (f"; {init}" if init else "")),
        (
            "optimiser",
            optimiser(cfg),
        ),
        (
            "held-out expected acceptance",
            f"**{m['heldout_acceptance']:.3f}**: E[Σ_x min(p_draft(x), p_target(x))] at temperature 1, "
            "the probability that speculative sampling accepts one drafted token",
        ),
        ("held-out KL(target ‖ draft)", f"{m['heldout_kl']:.3f} nats/token"),
        ("held-out top-1 agreement", f"{m['heldout_top1_agreement']:.3f} (draft argmax = target argmax)"),
        (
            "held-out loss on the corpus",
            f"draft {m['heldout_student_loss']:.3f}, target {m['heldout_target_loss']:.3f} nats/token "
            f"({m['heldout_tokens']:,} held-out tokens)",
        ),
        (
            "training time",
            f"{m['train_minutes']:.1f} min on a 2-core CPU"
            + (f" ({m['torch_threads']} torch threads)" if "torch_threads" in m else "")
            + ", teacher forward and evaluations included",
        ),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    curve = "\n".join(
        f"| {r['step']} | {r['train_kl']:.3f} | {r['heldout_kl']:.3f} | {r['heldout_top1_agreement']:.3f} | "
        f"{r['heldout_acceptance']:.3f} |"
        if "train_kl" in r
        else f"| {r['step']} | – | {r['heldout_kl']:.3f} | {r['heldout_top1_agreement']:.3f} | "
        f"{r['heldout_acceptance']:.3f} |"
        for r in log["log"]
    )
    text = f"""# specpipe demo draft LM

A small Llama (`LlamaForCausalLM`, Hugging Face format) distilled from the demo target by
`training/train_draft_lm.py`, to draft for standard speculative sampling and Recursive
Speculative Decoding. It is trained to match the target's next-token *distribution*, so
the figure that matters is the expected acceptance rate, not its own perplexity.

| | |
|---|---|
{table}

Reproduce (`make draft-lm` runs exactly this):

```
{command}
```

| step | train KL | held-out KL | held-out top-1 agreement | held-out expected acceptance |
|---|---|---|---|---|
{curve}
"""
    path = model_dir / "README.md"
    path.write_text(text)
    return path


def write_lyanna_card(drafter_dir: Path, command: str) -> Path:
    """README.md for a Lyanna drafter, from its training log."""
    log = json.loads((drafter_dir / "training_log.json").read_text())
    cfg, m = log["config"], log["metrics"]
    dcfg = json.loads((drafter_dir / "config.json").read_text())
    size_mb = sum(p.stat().st_size for p in drafter_dir.glob("*.safetensors")) / 1e6

    def steps(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    def num(row: dict[str, float], key: str) -> str:
        return f"{row[key]:.3f}" if key in row else "–"

    parts = ["one decoder layer of the target's shape over its own chain"]
    parts.append("step 1 fuses h_0 with E(t_1)" if dcfg["first_token_fusion"] else "step 1 reads h_0 only (no t_1)")
    if dcfg["token_info_rank"]:
        trained = "hot-token sparse" if cfg.get("sparse_token_info") and dcfg["num_hot_tokens"] else "dense"
        parts.append(f"token-info bias E' of rank {dcfg['token_info_rank']}, trained {trained}")
    else:
        parts.append("no token-info bias")
    rows = [
        ("target", f"`{log['target']}` ({m['target_parameters']:,} parameters); its embedding and LM head, not saved"),
        ("architecture", "; ".join(parts)),
        ("parameters", f"{m['parameters']:,} (bfloat16 safetensors, {size_mb:.1f} MB)"),
        (
            "data",
            f"random training-split windows through the frozen target: {m['train_chains']:,} chains of "
            f"{cfg['chain_steps']} steps (batch {cfg['batch_size']} windows x {cfg['starts_per_window']} starts, "
            f"{cfg['steps']} steps) from {m['corpus_train_tokens']:,} tokens",
        ),
        (
            "loss",
            f"per chain step {cfg['alpha']} x MSE(h_i, H_{{p+i}}) + {cfg['beta']} x CE(softmax(L_{{p+i}}), "
            "softmax(l'_i))",
        ),
        (
            "optimiser",
            optimiser(cfg),
        ),
        (
            "held-out top-1 agreement per chain step",
            f"**{steps(m['heldout_top1'])}** (argmax l'_i = target argmax, {m['heldout_chains']:,} chains)",
        ),
        (
            "held-out expected acceptance per chain step",
            f"**{steps(m['heldout_acceptance'])}**: E[Σ_x min(p_draft(x), p_target(x))] at temperature 1",
        ),
        ("training time", f"{m['train_minutes']:.1f} min on a 2-core CPU ({m['seconds_per_step']:.2f} s/step)"),
    ]
    if m.get("hot_tokens"):
        rows.append(
            (
                "hot tokens",
                f"{m['hot_tokens']} most frequent training tokens ({m['hot_token_coverage']:.1%} of occurrences), "
                f"stored as `hot_token_ids`; with the collapsed table: top-1 {steps(m['heldout_hot_top1'])}, "
                f"acceptance {steps(m['heldout_hot_acceptance'])}",
            )
        )
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    curve = "\n".join(
        f"| {r['step']} | {num(r, 'train_mse')} | {num(r, 'train_ce')} | "
        f"{steps(r['heldout_top1'])} | {steps(r['heldout_acceptance'])} |"
        for r in log["log"]
    )
    text = f"""# specpipe demo Lyanna drafter

Distilled from the demo target by `training/train_lyanna.py` (`model_defs/lyanna.py`): a
one-layer chain over the target's final hidden state, a one-pass LM head and a token-info
logits bias collapsed into a hot-token table at inference.

| | |
|---|---|
{table}

Reproduce (`make lyanna` runs exactly this):

```
{command}
```

| step | train MSE (Σ steps) | train CE (Σ steps) | held-out top-1 per step | held-out acceptance per step |
|---|---|---|---|---|
{curve}
"""
    path = drafter_dir / "README.md"
    path.write_text(text)
    return path
