"""Export our target + ReDrafter checkpoints as a TensorRT-LLM checkpoint for `ReDrafterForLLaMALM`.

    python -m build.trtllm_export --checkpoint models/demo-target --drafter models/demo-redrafter \\
        --output exports/demo-trtllm [--tp-size 2 --dtype bfloat16 --beam-width 4 --beam-length 4]

What runs here (plain PyTorch, no GPU, no TensorRT): the checkpoint itself, i.e. `config.json` and
one `rank{i}.safetensors` per tensor-parallel rank, in exactly the format TensorRT-LLM's own
`examples/llama/convert_checkpoint.py` + `examples/redrafter/convert_checkpoint.py` produce; an
executable `build_engine.sh` holding the `trtllm-build` command; and, when `triton_repo.trtllm_repository`
is present, a Triton `tensorrtllm` backend model repository pointing at the engine directory.

What needs TensorRT-LLM (an NVIDIA GPU, compute capability >= 8.0): running `build_engine.sh`
(`trtllm-build --speculative_decoding_mode explicit_draft_tokens`, which compiles the engine into
`<output>/engine`) and serving that engine.

Formats as read in github.com/NVIDIA/TensorRT-LLM:
- `examples/redrafter/convert_checkpoint.py` @ 31a9cd42fb507b50df39df4e03066fa370e4683c
  (`REDRAFTER_MAP`, `hf_redrafter_config`, `hf_drafter`);
- `tensorrt_llm/models/llama/config.py` @ 04100fd0a70976e86e0ac117f34942d06c21545d (`LLaMAConfig.to_dict`);
- `tensorrt_llm/models/modeling_utils.py` @ 01ea6d79d454bb3ab10c7510a6f706ba039090c2 (`PretrainedConfig`);
- `tensorrt_llm/models/redrafter/model.py` @ 06255cb759835a9797b656aa5d1dc8f7e75fdca6 (the config it reads);
- `examples/redrafter/README.md` @ 2d234357c6e69fa514f6e9b4d4a5ad3bc431c4a6 (the `trtllm-build` call);
- `tensorrt_llm/commands/build.py` and `tensorrt_llm/builder.py` (the versions indexed): ReDrafter's
  max_draft_len is derived from `redrafter_num_beams * redrafter_draft_len_per_beam`, so the command
  passes no `--max_draft_len`, and the builder adds it to `--max_seq_len` ("Increasing max_seq_len ...
  by max_draft_len"); `--kv_cache_type paged` replaces the deprecated `--paged_kv_cache enable`.

Sequence length: the engine's positions go up to max_seq_len + max_draft_len, which must stay within
the model's max_position_embeddings (its rotary table). `--max-seq-len` defaults to
max_position_embeddings - max_draft_len (the export prints so); a larger value is refused, naming
the numbers and the fix.
Weight names and splits: see `build.trtllm_weights`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from build.engine import BuildError
from build.trtllm_weights import TpSizeError, check_tp_size, drafter_rank_tensors, target_rank_tensors
from model_defs.checkpoint import load_checkpoint_dir, load_llama_checkpoint, read_llama_config
from model_defs.llama import LlamaConfig
from model_defs.redrafter import ReDrafterConfig, expected_shapes
from runtime.engine_dir import DTYPES

ARCHITECTURE = "ReDrafterForLLaMALM"
"""`REDRAFTER_MAP["LlamaForCausalLM"]` in TRT-LLM's ReDrafter converter (older releases: `ReDrafterForCausalLM`)."""
BASE_ARCHITECTURE = "LlamaForCausalLM"
SCRIPT_NAME = "build_engine.sh"
ENGINE_SUBDIR = "engine"


@dataclass(frozen=True)
class ReDrafterSettings:
    """Build-time ReDrafter parameters: TensorRT unrolls the beam search, so they are baked into the engine."""

    num_beams: int = 4
    """`redrafter_num_beams` (our beam width W)."""
    draft_len_per_beam: int = 4
    """`redrafter_draft_len_per_beam` (our beam length L, not counting the verified token)."""
    greedy_search: bool = False
    """`redrafter_greedy_search`: argmax drafting; TRT-LLM's converter defaults to True, we sample as Apple does."""

    def __post_init__(self) -> None:
        if self.num_beams < 1 or self.draft_len_per_beam < 1:
            raise BuildError(
                f"num_beams and draft_len_per_beam must be >= 1, got {self.num_beams}, {self.draft_len_per_beam}"
            )

    @property
    def max_draft_len(self) -> int:
        """What `trtllm-build` derives from the checkpoint (num_beams x draft_len_per_beam) and adds to max_seq_len."""
        return self.num_beams * self.draft_len_per_beam


def default_max_seq_len(max_position_embeddings: int, spec: ReDrafterSettings) -> int:
    """The longest max_seq_len whose engine (max_seq_len + max_draft_len positions) the model covers."""
    return max_position_embeddings - spec.max_draft_len


@dataclass(frozen=True)
class BuildLimits:
    """The `trtllm-build` size limits; the engine allocates for them."""

    max_batch_size: int = 8
    max_input_len: int = 512
    max_seq_len: int = 1024
    """Prompt + generated tokens; `trtllm-build` adds max_draft_len on top by itself."""
    max_num_tokens: int = 4096
    """Tokens per engine step across the batch (context chunks + draft trees)."""

    def check(self, max_position_embeddings: int, spec: ReDrafterSettings) -> None:
        """Sizes the engine could never serve are refused here rather than after a long build."""
        if min(self.max_batch_size, self.max_input_len, self.max_seq_len, self.max_num_tokens) < 1:
            raise BuildError(f"build limits must be >= 1: {self}")
        if self.max_input_len >= self.max_seq_len:
            raise BuildError(f"max_input_len {self.max_input_len} must be < max_seq_len {self.max_seq_len}")
        if self.max_seq_len + spec.max_draft_len > max_position_embeddings:
            raise BuildError(
                f"max_seq_len {self.max_seq_len} + max_draft_len {spec.max_draft_len} (which trtllm-build adds: "
                f"{spec.num_beams} beams x {spec.draft_len_per_beam} tokens) exceeds the model's "
                f"max_position_embeddings {max_position_embeddings}: use --max-seq-len "
                f"{default_max_seq_len(max_position_embeddings, spec)} or less, or fewer/shorter draft beams"
            )


def load_drafter(drafter_dir: Path, target: LlamaConfig) -> tuple[ReDrafterConfig, dict[str, torch.Tensor]]:
    """Apple's drafter directory, validated and checked against the target it drafts for."""
    cfg, tensors = load_checkpoint_dir(drafter_dir, ReDrafterConfig.from_json, expected_shapes)
    if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise BuildError(
            f"{drafter_dir / 'config.json'}: drafter hidden_size/vocab_size {cfg.hidden_size}/{cfg.vocab_size} do "
            f"not match the target's {target.hidden_size}/{target.vocab_size}"
        )
    return cfg, tensors


def trtllm_config(
    target: LlamaConfig, drafter: ReDrafterConfig, spec: ReDrafterSettings, tp_size: int, dtype: str
) -> dict[str, Any]:
    """`config.json`: `LLaMAConfig.from_hugging_face(...).to_dict()` as the Llama converter writes it,
    then `hf_redrafter_config`'s additions. `moe` is left out: `LLaMAConfig` then builds its no-MoE default."""
    return {
        "architecture": ARCHITECTURE,
        "base_model_architecture": BASE_ARCHITECTURE,
        "dtype": dtype,
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_hidden_layers": target.num_hidden_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_size": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "hidden_act": target.extra.get("hidden_act", "silu"),
        "logits_dtype": "float32",
        "norm_epsilon": target.rms_norm_eps,
        "runtime_defaults": None,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": target.max_position_embeddings,
        "rotary_embedding_dim": target.head_dim,
        "rotary_base": target.rope_theta,
        "rotary_scaling": target.rope_scaling,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "qk_layernorm": False,
        "tie_word_embeddings": target.tie_word_embeddings,
        "mlp_bias": target.mlp_bias,
        "attn_bias": target.attention_bias,
        "residual_mlp": False,
        "disable_weight_only_quant_plugin": False,
        "remove_duplicated_kv_heads": False,
        "fc_after_embed": False,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "layer_idx_offset": 0,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "output_multiplier_scale": 1.0,
        "redrafter_num_layers": drafter.num_draft_layers,
        "redrafter_hidden_size": drafter.hidden_size,
        "redrafter_exit_dim": drafter.exit_dim,
        "redrafter_is_rnn": drafter.rnn,
        "redrafter_num_beams": spec.num_beams,
        "redrafter_draft_len_per_beam": spec.draft_len_per_beam,
        "redrafter_greedy_search": spec.greedy_search,
    }


def trtllm_build_command(checkpoint_dir: str, engine_dir: str, dtype: str, limits: BuildLimits) -> list[str]:
    """`trtllm-build` for a ReDrafter checkpoint. Paged KV cache, packed (unpadded) inputs and paged
    context FMHA are what TRT-LLM's ReDrafter needs (`ReDrafterForLLaMALM._fwd_helper` requires
    remove_input_padding; the support matrix lists PAGED_KV_CACHE)."""
    return [
        "trtllm-build",
        *("--checkpoint_dir", checkpoint_dir),
        *("--output_dir", engine_dir),
        *("--speculative_decoding_mode", "explicit_draft_tokens"),
        *("--gemm_plugin", dtype),
        *("--gpt_attention_plugin", dtype),
        *("--use_paged_context_fmha", "enable"),
        *("--remove_input_padding", "enable"),
        *("--kv_cache_type", "paged"),
        *("--max_batch_size", str(limits.max_batch_size)),
        *("--max_input_len", str(limits.max_input_len)),
        *("--max_seq_len", str(limits.max_seq_len)),
        *("--max_num_tokens", str(limits.max_num_tokens)),
    ]


def build_script(dtype: str, limits: BuildLimits) -> str:
    """`build_engine.sh`: the checkpoint is the script's own directory; ENGINE_DIR defaults to `engine/` in it."""
    cmd = trtllm_build_command("$CHECKPOINT_DIR", "$ENGINE_DIR", dtype, limits)
    words = [f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in cmd]
    line = " \\\n    ".join(
        [words[0], *(f"{flag} {value}" for flag, value in zip(words[1::2], words[2::2], strict=True))]
    )
    return (
        "#!/usr/bin/env bash\n"
        "# Compile this TensorRT-LLM checkpoint into an engine. Needs TensorRT-LLM (trtllm-build) and an NVIDIA GPU.\n"
        "# Usage: ./build_engine.sh            (engine goes to ./engine)\n"
        "#        ENGINE_DIR=/path ./build_engine.sh\n"
        "set -euo pipefail\n"
        'CHECKPOINT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
        f'ENGINE_DIR="${{ENGINE_DIR:-$CHECKPOINT_DIR/{ENGINE_SUBDIR}}}"\n'
        f"exec {line}\n"
    )


def export_checkpoint(
    target_dir: Path,
    drafter_dir: Path,
    out_dir: Path,
    tp_size: int = 1,
    dtype: str = "float16",
    num_beams: int = 4,
    draft_len_per_beam: int = 4,
    greedy_search: bool = False,
    limits: BuildLimits | None = None,
) -> Path:
    """Write `config.json`, `rank{i}.safetensors` and `build_engine.sh` into `out_dir`; returns `out_dir`.
    Everything is validated before the first file is written."""
    if dtype not in DTYPES:
        raise BuildError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    spec = ReDrafterSettings(num_beams, draft_len_per_beam, greedy_search)
    target_cfg, target_tensors = load_llama_checkpoint(Path(target_dir))
    if target_cfg.attention_bias or target_cfg.mlp_bias:
        raise BuildError(
            f"{target_dir}: attention/MLP biases are not exported (TRT-LLM's GQA bias split is unverified)"
        )
    try:
        check_tp_size(target_cfg, tp_size)
    except TpSizeError as e:
        raise BuildError(f"{target_dir}: {e}") from e
    limits = limits or BuildLimits(max_seq_len=default_max_seq_len(target_cfg.max_position_embeddings, spec))
    limits.check(target_cfg.max_position_embeddings, spec)
    drafter_cfg, drafter_tensors = load_drafter(Path(drafter_dir), target_cfg)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = trtllm_config(target_cfg, drafter_cfg, spec, tp_size, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    torch_dtype = DTYPES[dtype]
    for rank in range(tp_size):
        weights = target_rank_tensors(target_tensors, target_cfg, tp_size, rank, torch_dtype)
        weights |= drafter_rank_tensors(drafter_tensors, drafter_cfg, tp_size, rank, torch_dtype)
        save_file(weights, str(out / f"rank{rank}.safetensors"))
        print(f"  wrote rank{rank}.safetensors ({len(weights)} tensors)")
    script = out / SCRIPT_NAME
    script.write_text(build_script(dtype, limits))
    script.chmod(0o755)
    return out


def write_triton_repository(out_dir: Path, target_dir: Path, tp_size: int, max_batch_size: int) -> Path | None:
    """The Triton `tensorrtllm` repository for the engine `build_engine.sh` will write, when
    `triton_repo.trtllm_repository` is available (it is developed separately); None otherwise."""
    if importlib.util.find_spec("triton_repo.trtllm_repository") is None:
        return None
    from triton_repo.trtllm_repository import write_trtllm_repository

    repo: Path = write_trtllm_repository(
        out_dir / "triton_repo",
        engine_dir=out_dir / ENGINE_SUBDIR,
        tokenizer_dir=target_dir,
        tp_size=tp_size,
        max_batch_size=max_batch_size,
        decoding_mode="redrafter",
    )
    return repo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m build.trtllm_export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", type=Path, required=True, help="HF LlamaForCausalLM target directory")
    ap.add_argument("--drafter", type=Path, required=True, help="Apple ml-recurrent-drafter directory")
    ap.add_argument("--output", type=Path, required=True, help="TensorRT-LLM checkpoint directory to write")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (default: %(default)s)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="weight dtype (default: %(default)s)")
    spec = ReDrafterSettings()
    ap.add_argument("--beam-width", type=int, default=spec.num_beams, help="redrafter_num_beams (default: %(default)s)")
    ap.add_argument(
        "--beam-length",
        type=int,
        default=spec.draft_len_per_beam,
        help="redrafter_draft_len_per_beam (default: %(default)s)",
    )
    ap.add_argument("--greedy", action="store_true", help="redrafter_greedy_search: argmax drafting")
    defaults = BuildLimits()
    ap.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size, help="(default: %(default)s)")
    ap.add_argument("--max-input-len", type=int, default=defaults.max_input_len, help="(default: %(default)s)")
    ap.add_argument(
        "--max-seq-len", type=int, help="(default: the model's max_position_embeddings - beam width x beam length)"
    )
    ap.add_argument("--max-num-tokens", type=int, default=defaults.max_num_tokens, help="(default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        max_seq_len = args.max_seq_len
        if max_seq_len is None:
            positions = read_llama_config(args.checkpoint).max_position_embeddings
            spec = ReDrafterSettings(args.beam_width, args.beam_length, args.greedy)
            max_seq_len = default_max_seq_len(positions, spec)
            print(
                f"max_seq_len {max_seq_len} = max_position_embeddings {positions} - max_draft_len "
                f"{spec.max_draft_len} (trtllm-build adds it for the draft tokens)"
            )
        limits = BuildLimits(args.max_batch_size, args.max_input_len, max_seq_len, args.max_num_tokens)
        print(f"exporting {args.checkpoint} + {args.drafter} -> {args.output} (tp {args.tp_size}, {args.dtype})")
        out = export_checkpoint(
            args.checkpoint,
            args.drafter,
            args.output,
            args.tp_size,
            args.dtype,
            args.beam_width,
            args.beam_length,
            args.greedy,
            limits,
        )
        repo = write_triton_repository(out, args.checkpoint, args.tp_size, args.max_batch_size)
    except ValueError as e:  # BuildError, CheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"TensorRT-LLM checkpoint: {out} (config.json, rank0..{args.tp_size - 1}.safetensors)")
    print(f"engine build script:     {out / SCRIPT_NAME} (needs trtllm-build; writes {out / ENGINE_SUBDIR})")
    print(
        f"Triton repository:       {repo}"
        if repo
        else "Triton repository:       skipped (no triton_repo.trtllm_repository)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
