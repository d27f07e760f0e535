"""The engine directory format, shared by `build/` (writes it) and `runtime/` (loads it).

    engines/<name>/
      config.json        EngineConfig below (format_version, architecture, model, build, ...)
      rank0.safetensors  weights of rank 0 (HF tensor names, engine dtype) ... rank{tp-1}
      tokenizer.json     Hugging Face `tokenizers` file

It mirrors TensorRT-LLM's engine dir: one config with the architecture and the build
settings, one weight file per tensor-parallel rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""Hugging Face tokenizer settings, copied into the engine when the checkpoint has one: its
`chat_template` (Jinja) is what the OpenAI server's chat endpoint renders messages with."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


DRAFTER_HEADS = ("int8", "int4", "drafter-dtype")
DRAFTER_LAYERS = ("int8", "int4", "drafter-dtype")
DRAFTER_BITS = {"int8": 8, "int4": 4}
"""Bits of the quantized choices of `drafter_head` and `drafter_layers` (the drafter dtype: none)."""


@dataclass(frozen=True)
class BuildConfig:
    """Limits and numerics fixed at build time (TensorRT-LLM `trtllm-build` equivalents)."""

    max_batch_size: int = 8
    """Most requests decoded together."""
    max_input_len: int = 512
    """Longest prompt, in tokens."""
    max_seq_len: int = 1024
    """Longest prompt + generated tokens."""
    dtype: str = "float32"
    """Target weight and activation dtype: float32 | bfloat16 | float16."""
    drafter_dtype: str = "float32"
    """Drafter dtype. Its precision only changes which tokens are proposed, never what is
    emitted. float32 by default: on CPUs without native bf16 arithmetic a bf16 drafter is
    no faster at batch 1 and ~1.3x slower at batch 8 (demo engines: ReDrafter 109 vs 144
    tok/s, rsd-c 153 vs 205); on GPUs with bf16 tensor cores choose bfloat16."""
    tp_size: int = 1
    """Tensor-parallel ranks (one weight file each, `build/tp_shard.py`); the runtime is
    launched with exactly that many MPI processes."""
    drafter_head: str = "int8"
    """The drafter's vocabulary projection (ReDrafter's head, a draft LM's LM head) on the
    CPU: "int8" (fbgemm int8 weights, ~5x faster for the few rows of a draft level; the
    demo ReDrafter went from 1.55x to 1.73x AR at batch 1, tau 3.37 either way), "int4"
    (4-bit weights, one scale per row: half the bytes of a level's largest product where the
    CPU has AVX-512 VNNI, `plugins/int8_linear.py`; the demo ReDrafter's tau on 32 held-out
    prompts 3.50 vs 3.51, the demo draft LM's 3.27 -> 3.14, so its engine keeps int8) or
    "drafter-dtype" (as the rest of the drafter). Like `drafter_dtype` it changes only the
    proposals, never the output; the weights are stored unquantized either way, and on a
    GPU or with a non-fp32 drafter the head stays in the drafter dtype."""
    drafter_layers: str = "int8"
    """The drafter's other linears on the CPU (a draft LM's and Lyanna's attention and MLP
    projections, q/k/v and gate/up each one stacked product; ReDrafter's RNN, input
    projection and residual blocks): "int8", "int4" or "drafter-dtype", as `drafter_head`. A
    draft level's few rows are bound by reading the weights; int8 reads a quarter of the
    bytes (demo engines, batch 1, fixed trees, same acceptance: sd 1.62x -> 2.00x AR,
    ReDrafter 2.20x -> 2.47x, Lyanna 1.58x -> 1.80x), int4 half that again. Engines built
    before this setting existed get int8 on load."""

    def __post_init__(self) -> None:
        for name in ("dtype", "drafter_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {sorted(DTYPES)}")
        if self.drafter_head not in DRAFTER_HEADS:
            raise ValueError(f"drafter_head {self.drafter_head!r} is not one of {DRAFTER_HEADS}")
        if self.drafter_layers not in DRAFTER_LAYERS:
            raise ValueError(f"drafter_layers {self.drafter_layers!r} is not one of {DRAFTER_LAYERS}")
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} <= max_input_len {self.max_input_len}: "
                "raise --max-seq-len or lower --max-input-len (no room to generate)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def drafter_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.drafter_dtype]

    @property
    def drafter_head_bits(self) -> int | None:
        """The bits of the drafter head's weights (`drafter_head`; None: the drafter dtype)."""
        return DRAFTER_BITS.get(self.drafter_head)

    @property
    def drafter_layers_bits(self) -> int | None:
        """The bits of the drafter layers' weights (`drafter_layers`; None: the drafter dtype)."""
        return DRAFTER_BITS.get(self.drafter_layers)


DRAFTER_KINDS = ("redrafter", "draft-lm", "lyanna")
DRAFTER_PREFIX = "drafter."
"""Drafter tensors live in the rank files under this prefix (TensorRT-LLM's convention)."""


@dataclass(frozen=True)
class DrafterSpec:
    """The drafter an engine carries, and the default effort of its method."""

    kind: str
    """What the weights are: "redrafter" (the RNN drafter), "draft-lm" (a small Llama
    sharing the target's vocabulary) or "lyanna" (the one-layer hidden-state drafter)."""
    config: dict[str, Any]
    """The drafter's own config.json (Apple's keys for ReDrafter, HF Llama keys for a draft
    LM, `LyannaConfig` keys for Lyanna)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Default method settings, overridable per request: method, beam_width, beam_length,
    branching; Lyanna: the `runtime.proposers.lyanna.LyannaParams` fields."""

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind {self.kind!r} is not one of {DRAFTER_KINDS}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `runtime/` needs to rebuild the engine from its directory."""

    architecture: str
    """Target architecture (`LlamaForCausalLM`)."""
    model: dict[str, Any]
    """The target's HF config dict."""
    build: BuildConfig
    """Build-time limits and dtype."""
    source: str = ""
    """Checkpoint directory the engine was built from (informational)."""
    tokenizer: str = TOKENIZER_FILE
    """Tokenizer file name inside the engine dir."""
    drafter: DrafterSpec | None = None
    """The speculative drafter, if the engine has one."""
    format_version: int = FORMAT_VERSION
    """Bumped on incompatible layout changes."""

    def save(self, engine_dir: Path) -> None:
        doc = asdict(self)
        (engine_dir / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n")

    @classmethod
    def load(cls, engine_dir: Path) -> EngineConfig:
        path = engine_dir / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not an engine directory (no {CONFIG_FILE}); build one with `make engine`")
        doc = json.loads(path.read_text())
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path}: engine format_version {version}, this runtime reads {FORMAT_VERSION}; rebuild the engine"
            )
        unknown = doc.keys() - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}; rebuild the engine with this version")
        doc["build"] = BuildConfig(**doc["build"])
        if doc.get("drafter"):
            doc["drafter"] = DrafterSpec(**doc["drafter"])
        return cls(**doc)
