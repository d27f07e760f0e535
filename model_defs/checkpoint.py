"""Loading Hugging Face checkpoint directories with errors that name file and tensor.

A directory holds `config.json` plus either `model.safetensors` or a sharded
`model.safetensors.index.json` (its `weight_map` names the shard of every tensor).
Validation compares what is there with what the architecture expects, so a bad
checkpoint fails here, with every problem listed, instead of deep inside a forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from model_defs.llama import LlamaConfig, expected_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; they are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed or does not match its config."""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def tensor_files(ckpt_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file that holds it."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory not found")
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: ckpt_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} not found")
        return files
    single = ckpt_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{ckpt_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_tensors(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Read every tensor named in `files` (one open per shard)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in the index but not in the file")
                tensors[name] = f.get_tensor(name)
    return tensors


def validate_tensors(tensors: dict[str, torch.Tensor], files: dict[str, Path], expected: dict[str, torch.Size]) -> None:
    """Raise CheckpointError listing every missing, unexpected or mis-shaped tensor."""
    problems = []
    for name in sorted(expected.keys() - tensors.keys()):
        problems.append(f"missing tensor {name!r} (expected shape {list(expected[name])})")
    for name in sorted(tensors.keys() - expected.keys()):
        problems.append(f"{files[name]}: unexpected tensor {name!r} {list(tensors[name].shape)}")
    for name in sorted(expected.keys() & tensors.keys()):
        if tensors[name].shape != expected[name]:
            problems.append(
                f"{files[name]}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"config implies {list(expected[name])}"
            )
    if problems:
        raise CheckpointError("checkpoint does not match its config:\n  " + "\n  ".join(problems))


C = TypeVar("C")


def load_checkpoint_dir(
    path: str | Path, config_from_json: Callable[[dict[str, Any]], C], shapes: Callable[[C], dict[str, torch.Size]]
) -> tuple[C, dict[str, torch.Tensor]]:
    """A drafter directory (`config.json` + safetensors): its config and validated tensors;
    every missing, unexpected or mis-shaped tensor is reported with its file."""
    ckpt_dir = Path(path)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory not found")
    config_path = ckpt_dir / "config.json"
    try:
        cfg = config_from_json(read_json(config_path))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: {e}") from e
    files = tensor_files(ckpt_dir)
    tensors = load_tensors(files)
    validate_tensors(tensors, files, shapes(cfg))
    return cfg, tensors


def read_llama_config(ckpt_dir: Path) -> LlamaConfig:
    """The `config.json` of a checkpoint directory, checked for a supported architecture."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory not found")
    config_path = ckpt_dir / "config.json"
    try:
        return LlamaConfig.from_hf(read_json(config_path))
    except KeyError as e:
        raise CheckpointError(f"{config_path}: missing key {e}") from e
    except ValueError as e:
        raise CheckpointError(f"{config_path}: {e}") from e


def load_llama_checkpoint(ckpt_dir: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read and validate a HF `LlamaForCausalLM` directory."""
    cfg = read_llama_config(ckpt_dir)
    files = {n: p for n, p in tensor_files(ckpt_dir).items() if not n.endswith(IGNORED_SUFFIXES)}
    tensors = load_tensors(files)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some exporters write the tied head anyway; it must really be the embedding.
        if not torch.equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight", torch.empty(0))):
            raise CheckpointError(
                f"{files['lm_head.weight']}: 'lm_head.weight' differs from the embedding "
                "but config.json says tie_word_embeddings=true"
            )
        del tensors["lm_head.weight"]
    validate_tensors(tensors, files, expected_shapes(cfg))
    return cfg, tensors
