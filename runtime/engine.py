"""A loaded engine: target model + tokenizer + build limits, from an engine directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from model_defs import lyanna, redrafter
from model_defs.checkpoint import validate_tensors
from model_defs.llama import LlamaConfig, LlamaForCausalLM, expected_shapes
from runtime.engine_dir import DRAFTER_PREFIX, EngineConfig, rank_file


@dataclass
class Engine:
    config: EngineConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    drafter: redrafter.ReDrafter | None = None
    """The ReDrafter RNN drafter (engines built with --drafter)."""
    draft_model: LlamaForCausalLM | None = None
    """A draft LM (engines built with --draft-model); it keeps its own KV cache."""
    lyanna_drafter: lyanna.LyannaDrafter | None = None
    """The Lyanna drafter (engines built with --lyanna)."""
    token_table: lyanna.HotTokenTable | None = None
    """Lyanna's token-info bias collapsed to its hot tokens (computed at load)."""

    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", rank: int = 0) -> Engine:
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
        drafter, draft_model, lyanna_drafter, table = None, None, None, None
        if config.drafter is not None and config.drafter.kind == "lyanna":
            lyanna_cfg = lyanna.LyannaConfig.from_json(config.drafter.config)
            validate_tensors(
                drafter_tensors, dict.fromkeys(drafter_tensors, weights_path), lyanna.expected_shapes(lyanna_cfg)
            )
            dtype = config.build.drafter_torch_dtype
            lyanna_drafter = lyanna.LyannaDrafter.from_tensors(lyanna_cfg, drafter_tensors, dtype).to(device)
            if lyanna_drafter.token_info is not None and lyanna_cfg.num_hot_tokens:
                table = lyanna_drafter.hot_table(model.model.embed_tokens, dtype)
        elif config.drafter is not None and config.drafter.kind == "draft-lm":
            draft_cfg = LlamaConfig.from_hf(config.drafter.config)
            validate_tensors(drafter_tensors, dict.fromkeys(drafter_tensors, weights_path), expected_shapes(draft_cfg))
            draft_model = LlamaForCausalLM.from_tensors(draft_cfg, drafter_tensors, config.build.drafter_torch_dtype)
            draft_model = draft_model.to(device)
        elif config.drafter is not None:
            drafter_cfg = redrafter.ReDrafterConfig.from_json(config.drafter.config)
            validate_tensors(
                drafter_tensors, dict.fromkeys(drafter_tensors, weights_path), redrafter.expected_shapes(drafter_cfg)
            )
            drafter = redrafter.ReDrafter.from_tensors(
                drafter_cfg, drafter_tensors, config.build.drafter_torch_dtype
            ).to(device)
        return cls(config, model, tokenizer, drafter, draft_model, lyanna_drafter, table)

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
