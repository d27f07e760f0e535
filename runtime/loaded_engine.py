"""A loaded engine: target model + tokenizer + build limits, from an engine directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from model_defs import lyanna, redrafter
from model_defs.checkpoint import validate_tensors
from model_defs.llama import (
    Linear,
    LlamaConfig,
    LlamaForCausalLM,
    expected_shapes,
    pack_cpu_weights,
    quantize_linears_int8,
)
from runtime.engine_dir import DRAFTER_PREFIX, DrafterSpec, EngineConfig, rank_file


@dataclass
class LoadedEngine:
    config: EngineConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    redrafter: redrafter.ReDrafter | None = None
    """The ReDrafter RNN drafter (engines built with --drafter; drafter kind "redrafter")."""
    draft_model: LlamaForCausalLM | None = None
    """A draft LM (engines built with --draft-model); it keeps its own KV cache."""
    lyanna_drafter: lyanna.LyannaDrafter | None = None
    """The Lyanna drafter (engines built with --lyanna)."""
    token_table: lyanna.HotTokenTable | None = None
    """Lyanna's token-info bias collapsed to its hot tokens (computed at load)."""
    lyanna_head: Linear | None = None
    """The vocabulary projection Lyanna drafts through: an int8 copy of the target's head
    (`--drafter-head int8`, fp32 on the CPU: ~3x faster, proposals change, never the
    output), or None: the target's own head."""

    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", rank: int = 0) -> LoadedEngine:
        """Load tensor-parallel rank `rank`'s shard of the target (the whole target when the
        engine was built with --tp-size 1) and the drafter (RNN or draft LM), which every
        rank file carries whole."""
        engine_dir = Path(engine_dir)
        config = EngineConfig.load(engine_dir)
        model_cfg = LlamaConfig.from_hf(config.model)
        tp_size = config.build.tp_size
        if not 0 <= rank < tp_size:
            raise ValueError(f"{engine_dir}: rank {rank} does not exist, the engine was built with --tp-size {tp_size}")
        weights_path = engine_dir / rank_file(rank)
        if not weights_path.is_file():
            raise FileNotFoundError(
                f"{weights_path}: missing the weights of rank {rank} of an engine built with --tp-size {tp_size}; "
                "rebuild the engine"
            )
        tensors, drafter_tensors = {}, {}
        for name, tensor in load_file(str(weights_path), device=device).items():
            if name.startswith(DRAFTER_PREFIX):
                drafter_tensors[name.removeprefix(DRAFTER_PREFIX)] = tensor
            else:
                tensors[name] = tensor
        validate_tensors(tensors, dict.fromkeys(tensors, weights_path), expected_shapes(model_cfg, tp_size))
        model = LlamaForCausalLM.from_tensors(model_cfg, tensors, config.build.torch_dtype, tp_size).to(device)
        tokenizer = Tokenizer.from_file(str(engine_dir / config.tokenizer))
        drafter: dict[str, Any] = {}
        if config.drafter is not None:
            validate = partial(_validate, drafter_tensors, weights_path)
            load = DRAFTER_LOADERS[config.drafter.kind]
            drafter = load(config.drafter, drafter_tensors, config.build.drafter_torch_dtype, model, validate)
        for module in (model, *drafter.values()):
            if isinstance(module, torch.nn.Module):
                pack_cpu_weights(module)  # fp32 on the CPU only: plugins/cpu_linear.py
        heads = drafter_heads(drafter)
        if (bits := config.build.drafter_head_bits) is not None:
            for head in heads:
                head.quantize_int8(bits)  # fp32 on the CPU only; proposals change, never the output
            if "lyanna_drafter" in drafter and (copy := int8_copy(model.lm_head, bits)) is not None:
                drafter["lyanna_head"] = copy  # verification keeps the target's own head
        if (bits := config.build.drafter_layers_bits) is not None:
            for module in drafter.values():
                if isinstance(module, torch.nn.Module):
                    quantize_linears_int8(module, keep=heads, bits=bits)  # the heads follow drafter_head
        return cls(config, model, tokenizer, **drafter)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model.config.eos_token_ids

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, with the special tokens the tokenizer adds (BOS)."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


Validate = Callable[[dict[str, torch.Size]], None]
"""Checks the drafter's tensors against their expected shapes (naming the file)."""


def _validate(tensors: dict[str, torch.Tensor], path: Path, shapes: dict[str, torch.Size]) -> None:
    validate_tensors(tensors, dict.fromkeys(tensors, path), shapes)


def int8_copy(head: Linear, bits: int = 8) -> Linear | None:
    """A `Linear` reading an int8 (`bits=4`: 4-bit) copy of `head`'s weight (the fp32 weight
    shared, not copied), or None where int8 does not apply (not fp32 on the CPU)."""
    copy = Linear(head.in_features, head.out_features, bias=False, device="meta")
    copy.weight = head.weight
    return copy if copy.quantize_int8(bits) else None


def drafter_heads(drafter: dict[str, Any]) -> list[Linear]:
    """The vocabulary projections that belong to the drafter alone (`BuildConfig.drafter_head`):
    ReDrafter's head and a draft LM's LM head. Lyanna drafts through the target's own head,
    which verification uses too, so it has none (`--drafter-head int8` gives it an int8
    copy: `LoadedEngine.lyanna_head`)."""
    heads = []
    if (rnn := drafter.get("redrafter")) is not None:
        heads.append(rnn.lm_head[-1])
    if (lm := drafter.get("draft_model")) is not None:
        heads.append(lm.lm_head)
    return heads


def _load_redrafter(
    spec: DrafterSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype, target: LlamaForCausalLM, check: Validate
) -> dict[str, Any]:
    cfg = redrafter.ReDrafterConfig.from_json(spec.config)
    check(redrafter.expected_shapes(cfg))
    return {"redrafter": redrafter.ReDrafter.from_tensors(cfg, tensors, dtype).to(target.lm_head.weight.device)}


def _load_draft_lm(
    spec: DrafterSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype, target: LlamaForCausalLM, check: Validate
) -> dict[str, Any]:
    cfg = LlamaConfig.from_hf(spec.config)
    check(expected_shapes(cfg))
    return {"draft_model": LlamaForCausalLM.from_tensors(cfg, tensors, dtype).to(target.lm_head.weight.device)}


def _load_lyanna(
    spec: DrafterSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype, target: LlamaForCausalLM, check: Validate
) -> dict[str, Any]:
    cfg = lyanna.LyannaConfig.from_json(spec.config)
    check(lyanna.expected_shapes(cfg))
    drafter = lyanna.LyannaDrafter.from_tensors(cfg, tensors, dtype).to(target.lm_head.weight.device)
    if drafter.token_info is None or not cfg.num_hot_tokens:
        return {"lyanna_drafter": drafter}
    return {"lyanna_drafter": drafter, "token_table": drafter.hot_table(target.model.embed_tokens, dtype)}


DRAFTER_LOADERS: dict[str, Callable[..., dict[str, Any]]] = {
    "redrafter": _load_redrafter,
    "draft-lm": _load_draft_lm,
    "lyanna": _load_lyanna,
}
"""Drafter kind -> its loader: (spec, tensors, dtype, target, check) -> LoadedEngine fields,
on the target's device."""
