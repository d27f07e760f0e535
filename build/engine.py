"""Build an engine directory from a Hugging Face Llama checkpoint.

    python -m build.engine --checkpoint models/demo-target --output engines/demo
    python -m build.engine --checkpoint models/demo-target --output engines/demo-tp2 --tp-size 2
    python -m build.engine --checkpoint models/demo-target --output engines/demo-redrafter \
        --drafter models/demo-redrafter
    python -m build.engine --checkpoint models/demo-target --output engines/demo-draft-lm \
        --draft-model models/demo-draft-lm

Validates everything first (config, tensor names and shapes, tokenizer vocabulary) and
writes into a temporary sibling directory that is renamed into place only when complete,
so a failed build never leaves an engine directory behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import save_file
from tokenizers import Tokenizer

from build.tp_shard import shard_tensors
from model_defs.checkpoint import CheckpointError, load_llama_checkpoint, read_llama_config
from model_defs.llama import ARCHITECTURE, LlamaConfig
from model_defs.lyanna import LyannaDrafter
from model_defs.redrafter import ReDrafter
from runtime.engine_dir import (
    DRAFTER_HEADS,
    DRAFTER_LAYERS,
    DRAFTER_PREFIX,
    DTYPES,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    BuildConfig,
    DrafterSpec,
    EngineConfig,
    rank_file,
)
from runtime.proposers.lyanna import LyannaParams
from runtime.proposers.redrafter import ReDrafterParams
from runtime.proposers.registry import METHODS
from runtime.proposers.rsd import DEFAULT_BRANCHING, parse_branching


class BuildError(ValueError):
    """The inputs cannot make a valid engine; the message names the file and tensor."""


def check_tokenizer(path: Path, cfg: LlamaConfig) -> None:
    """The tokenizer must load and every token id it can produce must have an embedding
    row (a larger embedding is fine: checkpoints often pad the vocabulary)."""
    if not path.is_file():
        raise BuildError(f"{path}: tokenizer file not found (pass --tokenizer)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise BuildError(f"{path}: cannot load tokenizer ({e})") from e
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise BuildError(
            f"{path}: tokenizer has {size} tokens but the model's vocab_size is {cfg.vocab_size} "
            "(tensor 'model.embed_tokens.weight'); tokenizer and weights do not belong together"
        )
    bad = [t for t in [*cfg.eos_token_ids, cfg.bos_token_id or 0] if not 0 <= t < cfg.vocab_size]
    if bad:
        raise BuildError(f"config.json: special token ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")


def check_tokenizer_config(path: Path) -> None:
    """A tokenizer_config.json must be a JSON object, and its `chat_template`, if any, a
    Jinja template that compiles (a string, or Hugging Face's list of named templates)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(doc, dict):
        raise BuildError(f"{path}: must hold a JSON object")
    templates = doc.get("chat_template")
    if templates is None:
        return
    if isinstance(templates, str):
        templates = [{"name": "default", "template": templates}]
    if not isinstance(templates, list) or not all(isinstance(t, dict) and "template" in t for t in templates):
        raise BuildError(f"{path}: chat_template must be a Jinja string or a list of {{name, template}} objects")
    for t in templates:
        try:
            ImmutableSandboxedEnvironment().parse(t["template"])
        except TemplateSyntaxError as e:
            raise BuildError(f"{path}: chat_template {t.get('name')!r} line {e.lineno}: {e.message}") from e


def load_draft_model(
    path: Path, target: LlamaConfig, target_tokenizer: Path, settings: dict[str, Any]
) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    """Load and check a draft LM (a smaller HF Llama) against the target: it must share the
    vocabulary, since its token ids are verified by the target as they are."""
    try:
        cfg, tensors = load_llama_checkpoint(path)
    except CheckpointError as e:
        raise BuildError(str(e)) from e
    if cfg.vocab_size != target.vocab_size:
        raise BuildError(
            f"{path / 'config.json'}: draft model vocab_size {cfg.vocab_size} != target vocab_size "
            f"{target.vocab_size}; a draft LM must share the target's tokenizer"
        )
    own = path / TOKENIZER_FILE
    if (
        own.is_file()
        and Tokenizer.from_file(str(own)).get_vocab() != Tokenizer.from_file(str(target_tokenizer)).get_vocab()
    ):
        raise BuildError(f"{own}: the draft model's tokenizer differs from the target's ({target_tokenizer})")
    spec = DrafterSpec("draft-lm", cfg.to_hf(), settings)
    return spec, {DRAFTER_PREFIX + k: v for k, v in tensors.items()}


def load_hidden_state_drafter(
    kind: str, path: Path, target: LlamaConfig, settings: dict[str, Any]
) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    """Load and check a drafter that reads the target's hidden states and embedding
    ("redrafter": Apple's RNN checkpoint; "lyanna": a Lyanna drafter) against that target."""
    drafter: ReDrafter | LyannaDrafter
    try:
        drafter = ReDrafter.from_pretrained(path) if kind == "redrafter" else LyannaDrafter.from_pretrained(path)
    except CheckpointError as e:
        raise BuildError(str(e)) from e
    cfg = drafter.config
    for name, ours, theirs in (
        ("vocab_size", cfg.vocab_size, target.vocab_size),
        ("hidden_size", cfg.hidden_size, target.hidden_size),
    ):
        if ours != theirs:
            raise BuildError(f"{path / 'config.json'}: drafter {name} {ours} != target {name} {theirs}; wrong target?")
    if kind == "lyanna":
        settings = asdict(LyannaParams()) | settings
    spec = DrafterSpec(kind, cfg.to_json(), settings)
    return spec, {DRAFTER_PREFIX + k: v for k, v in drafter.state_dict().items()}


def build_engine(
    checkpoint: Path,
    output: Path,
    build: BuildConfig,
    tokenizer: Path | None = None,
    force: bool = False,
    drafter: Path | None = None,
    drafter_settings: dict[str, Any] | None = None,
    draft_model: Path | None = None,
    lyanna: Path | None = None,
) -> Path:
    """Validate `checkpoint` (and at most one of `drafter`, the ReDrafter RNN, `draft_model`,
    a draft LM, and `lyanna`, a Lyanna drafter) and write the engine dir `output`."""
    if output.exists() and not force:
        raise BuildError(f"{output}: already exists (pass --force to replace it)")
    try:
        cfg, tensors = load_llama_checkpoint(checkpoint)
    except CheckpointError as e:
        raise BuildError(str(e)) from e
    try:
        cfg.check_tp_size(build.tp_size)
    except ValueError as e:
        raise BuildError(f"{checkpoint / 'config.json'}: {e}") from e
    tok_path = tokenizer or checkpoint / TOKENIZER_FILE
    check_tokenizer(tok_path, cfg)
    tok_config = tok_path.parent / TOKENIZER_CONFIG_FILE
    if tok_config.is_file():
        check_tokenizer_config(tok_config)
    spec = None
    if sum(d is not None for d in (drafter, draft_model, lyanna)) > 1:
        raise BuildError("give one of --drafter (ReDrafter RNN), --draft-model (draft LM) or --lyanna, not both")
    if drafter is not None:
        spec, drafter_tensors = load_hidden_state_drafter("redrafter", drafter, cfg, drafter_settings or {})
        tensors = tensors | drafter_tensors
    if draft_model is not None:
        spec, drafter_tensors = load_draft_model(draft_model, cfg, tok_path, drafter_settings or {})
        tensors = tensors | drafter_tensors
    if lyanna is not None:
        spec, drafter_tensors = load_hidden_state_drafter("lyanna", lyanna, cfg, drafter_settings or {})
        tensors = tensors | drafter_tensors
    if build.max_seq_len > cfg.max_position_embeddings:
        print(
            f"warning: max_seq_len {build.max_seq_len} > max_position_embeddings {cfg.max_position_embeddings}; "
            "quality beyond the trained context is not guaranteed",
            file=sys.stderr,
        )

    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        weights = {
            k: v.to(build.drafter_torch_dtype if k.startswith(DRAFTER_PREFIX) else build.torch_dtype).contiguous()
            if v.is_floating_point()
            else v.contiguous()  # integer tensors (Lyanna's hot token ids) keep their dtype
            for k, v in tensors.items()
        }
        for rank in range(build.tp_size):
            shard = shard_tensors(weights, cfg, build.tp_size, rank)
            save_file(shard, str(partial / rank_file(rank)), metadata={"format": "pt"})
        shutil.copyfile(tok_path, partial / TOKENIZER_FILE)
        if tok_config.is_file():
            shutil.copyfile(tok_config, partial / TOKENIZER_CONFIG_FILE)
        model = cfg.to_hf() | {"dtype": build.dtype}  # the engine's dtype, not the checkpoint's
        EngineConfig(ARCHITECTURE, model, build, source=str(checkpoint), drafter=spec).save(partial)
        if output.exists():
            shutil.rmtree(output)
        partial.rename(output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output


BUILD_HELP = {
    "max_batch_size": "most requests decoded together (default: %(default)s)",
    "max_input_len": "longest prompt in tokens (default: min(512, max_seq_len - 1))",
    "max_seq_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "dtype": "target dtype: float32 | bfloat16 | float16 (default: %(default)s: matches transformers fp32 to 1e-4)",
    "tp_size": "tensor-parallel ranks: one weight file each, run with `mpirun -n TP_SIZE` (default: %(default)s)",
    "drafter_dtype": "drafter dtype; never changes the output, only the proposals (default: %(default)s)",
    "drafter_head": "the drafter's vocabulary projection on the CPU: int8 weights (~5x faster per draft level), "
    "int4 (half the bytes again, on CPUs with AVX-512 VNNI; the demo ReDrafter's engine uses it) or the drafter "
    "dtype; never changes the output, only the proposals (default: %(default)s)",
    "drafter_layers": "the drafter's other linears on the CPU (layers, RNN, residual blocks): int8 weights "
    "(a draft level reads a quarter of the bytes), int4 (an eighth, on CPUs with AVX-512 VNNI; the demo Lyanna's "
    "engine uses it) or the drafter dtype; never changes the output, only the proposals (default: %(default)s)",
}


def build_config_from_args(args: argparse.Namespace) -> BuildConfig:
    """Fill the context-dependent defaults from the checkpoint's config."""
    max_seq_len = args.max_seq_len or read_llama_config(args.checkpoint).max_position_embeddings
    return BuildConfig(
        max_batch_size=args.max_batch_size,
        max_input_len=args.max_input_len or min(512, max_seq_len - 1),
        max_seq_len=max_seq_len,
        dtype=args.dtype,
        tp_size=args.tp_size,
        drafter_dtype=args.drafter_dtype,
        drafter_head=args.drafter_head,
        drafter_layers=args.drafter_layers,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m build.engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint", type=Path, required=True, help="HF LlamaForCausalLM directory (config.json + safetensors)"
    )
    ap.add_argument("--output", type=Path, required=True, help="engine directory to create, e.g. engines/demo")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json (default: the one in --checkpoint); a tokenizer_config.json beside it (chat template) "
        "is copied too",
    )
    ap.add_argument("--force", action="store_true", help="replace --output if it exists")
    defaults = BuildConfig()
    ap.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size, help=BUILD_HELP["max_batch_size"])
    ap.add_argument("--max-input-len", type=int, help=BUILD_HELP["max_input_len"])
    ap.add_argument("--max-seq-len", type=int, help=BUILD_HELP["max_seq_len"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype, help=BUILD_HELP["dtype"])
    ap.add_argument("--tp-size", type=int, default=defaults.tp_size, help=BUILD_HELP["tp_size"])
    drafting = ap.add_argument_group("speculative decoding")
    drafting.add_argument(
        "--drafter", type=Path, help="ReDrafter drafter directory (Apple's config.json + model.safetensors)"
    )
    drafting.add_argument(
        "--draft-model",
        type=Path,
        help="draft LM directory (HF LlamaForCausalLM sharing the target's vocabulary), for sd / rsd-c / rsd-s",
    )
    drafting.add_argument(
        "--lyanna",
        type=Path,
        help="Lyanna drafter directory (config.json + model.safetensors, training/train_lyanna.py)",
    )
    drafting.add_argument(
        "--drafter-dtype", choices=sorted(DTYPES), default=defaults.drafter_dtype, help=BUILD_HELP["drafter_dtype"]
    )
    drafting.add_argument(
        "--drafter-head", choices=DRAFTER_HEADS, default=defaults.drafter_head, help=BUILD_HELP["drafter_head"]
    )
    drafting.add_argument(
        "--drafter-layers",
        choices=DRAFTER_LAYERS,
        default=defaults.drafter_layers,
        help=BUILD_HELP["drafter_layers"],
    )
    spec = ReDrafterParams()
    drafting.add_argument(
        "--beam-width", type=int, default=spec.beam_width, help="default beams per step (W) (default: %(default)s)"
    )
    drafting.add_argument(
        "--beam-length",
        type=int,
        default=spec.beam_length,
        help="default draft tokens per beam (L) (default: %(default)s)",
    )
    drafting.add_argument(
        "--method",
        choices=[m for m in METHODS if m != "ar"],
        help="the engine's default decoding method (requests may name another); "
        "default: redrafter with --drafter, sd with --draft-model, lyanna with --lyanna",
    )
    drafting.add_argument(
        "--branching",
        type=parse_branching,
        default=DEFAULT_BRANCHING,
        help=f"default rsd-c children per node at each depth, e.g. 2,2,1,1 "
        f"(default: {','.join(map(str, DEFAULT_BRANCHING))})",
    )
    args = ap.parse_args(argv)
    try:
        settings = asdict(ReDrafterParams(args.beam_width, args.beam_length)) | {"branching": list(args.branching)}
        if args.method:
            settings["method"] = args.method
        out = build_engine(
            args.checkpoint,
            args.output,
            build_config_from_args(args),
            args.tokenizer,
            args.force,
            args.drafter,
            settings,
            args.draft_model,
            args.lyanna,
        )
    except ValueError as e:  # BuildError, CheckpointError and config validation
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"engine written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
