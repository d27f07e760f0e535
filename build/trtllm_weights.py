"""Our checkpoints' tensors renamed, fused and tensor-parallel split the way NVIDIA TensorRT-LLM's
converters write a `rank{i}.safetensors`, plus the inverse operations that prove the round trip.

Read at these TensorRT-LLM commits (github.com/NVIDIA/TensorRT-LLM):

- `tensorrt_llm/models/llama/convert.py` @ 04a2cacbfd3b9ac76191bd8498ad871607b63a04
  (`load_weights_from_hf_model`, `get_prefix_and_param_name_map`, `split`, `dup_kv_weight`):
  the base model, i.e. what `examples/llama/convert_checkpoint.py` writes;
- `examples/redrafter/convert_checkpoint.py` @ 31a9cd42fb507b50df39df4e03066fa370e4683c (`hf_drafter`):
  the drafter, appended under `drafter.` to the base model's rank files;
- `tensorrt_llm/models/redrafter/drafter.py` @ 8fcf9fc21589b366c3f79da100e289b78b7d118c: every drafter
  linear is a `ColumnLinear(gather_output=True)`, hence the dim-0 splits below.

Layout per rank r of T (TRT-LLM's `split(v, T, r, dim)` = the r-th of T equal contiguous chunks):

    transformer.vocab_embedding.weight        embed_tokens, whole (use_parallel_embedding=False, the default)
    transformer.layers.{l}.attention.qkv      cat(split(q,0), split(k,0), split(v,0)): this rank's Q heads,
                                              then its KV heads (KV heads repeated first when T > KV heads)
    transformer.layers.{l}.attention.dense    split(o_proj, 1)
    transformer.layers.{l}.mlp.fc             split(gate_proj, 0)  -- TRT-LLM's GatedMLP: act(fc(x)) * gate(x),
    transformer.layers.{l}.mlp.gate           split(up_proj, 0)       so HF gate_proj is `fc`, up_proj is `gate`
    transformer.layers.{l}.mlp.proj           split(down_proj, 1)
    transformer.layers.{l}.input_layernorm    whole
    transformer.layers.{l}.post_layernorm     post_attention_layernorm, whole
    transformer.ln_f.weight                   model.norm, whole
    lm_head.weight                            split(lm_head or the tied embedding, 0): vocab-parallel
    drafter.input_proj.{weight,bias}          split(input_proj, 0)        (only when exit_dim != 2 * hidden)
    drafter.layers.{i}.linear.{weight,bias}   split(lm_head.{i}.linear, 0)
    drafter.lm_head.weight                    split(lm_head.{N}.weight, 0)
    drafter.rnn_u.{weight,bias}               split(rnn_u, 0)             (only when rnn)
    drafter.rnn_w.weight                      split(rnn_w, 0)             (only when rnn)

TRT-LLM pads the target LM head to a multiple of T but not the drafter's (whose `ColumnLinear` is
built with the padded vocab), so a vocab that T does not divide cannot load; `check_tp_size` refuses it.
"""

from __future__ import annotations

import torch

from model_defs.llama import LlamaConfig
from model_defs.redrafter import ReDrafterConfig

DRAFTER_PREFIX = "drafter."
"""`DRAFTER_TLLM_WEIGHT_PREFIX` of TRT-LLM's `examples/redrafter/convert_checkpoint.py`."""

MLP_NAMES = {"mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}
"""TRT-LLM name -> HF name (`get_prefix_and_param_name_map`, the LLaMA branch)."""


class TpSizeError(ValueError):
    """The tensor-parallel size cannot split the model the way TRT-LLM requires."""


def kv_heads_per_rank(cfg: LlamaConfig, tp_size: int) -> int:
    """KV heads in one rank's fused QKV: TRT-LLM repeats KV heads when there are fewer than ranks."""
    return max(cfg.num_key_value_heads // tp_size, 1)


def check_tp_size(cfg: LlamaConfig, tp_size: int) -> None:
    """The divisibility TRT-LLM's converters assert (`split` asserts equal chunks, `dup_kv_weight`
    asserts `tp_size % num_kv_heads == 0`), checked up front with a message that says what to choose."""
    if tp_size < 1:
        raise TpSizeError(f"tp_size must be >= 1, got {tp_size}")
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % tp_size]
    kv = cfg.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        bad.append(f"num_key_value_heads ({kv}) (nor is tp_size a multiple of it, for KV-head duplication)")
    if bad:
        raise TpSizeError(f"tp_size {tp_size} does not divide {', '.join(bad)}; TensorRT-LLM needs equal shards")


def split(t: torch.Tensor, tp_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """TRT-LLM's `split`: the `rank`-th of `tp_size` equal contiguous chunks along `dim`."""
    if t.shape[dim] % tp_size:
        raise TpSizeError(f"cannot split shape {tuple(t.shape)} along dim {dim} into {tp_size} equal parts")
    return t.chunk(tp_size, dim)[rank].clone(memory_format=torch.contiguous_format)  # own storage, as TRT-LLM's


def unsplit(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `split` over all ranks."""
    return torch.cat(shards, dim)


def dup_kv(t: torch.Tensor, num_kv_heads: int, tp_size: int) -> torch.Tensor:
    """TRT-LLM's `dup_kv_weight`: repeat each KV head `tp_size // num_kv_heads` times, in place
    (head 0, head 0, head 1, head 1, ...), so that rank r gets a copy of KV head r * KV // T."""
    reps = tp_size // num_kv_heads
    head = t.shape[0] // num_kv_heads
    return t.reshape(num_kv_heads, 1, head, -1).expand(-1, reps, -1, -1).reshape(num_kv_heads * reps * head, -1)


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: LlamaConfig, tp_size: int, rank: int
) -> torch.Tensor:
    """One rank's `attention.qkv.weight`: [its Q rows; its K rows; its V rows]. TRT-LLM's MHA path
    (`split_qkv_tp`) yields the same layout as this GQA path."""
    if cfg.num_key_value_heads < tp_size:
        k, v = dup_kv(k, cfg.num_key_value_heads, tp_size), dup_kv(v, cfg.num_key_value_heads, tp_size)
    return torch.cat([split(q, tp_size, rank), split(k, tp_size, rank), split(v, tp_size, rank)])


def unfuse_qkv(qkv: torch.Tensor, cfg: LlamaConfig, tp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's fused QKV back into its (q, k, v) rows."""
    q_rows = cfg.num_attention_heads // tp_size * cfg.head_dim
    kv_rows = kv_heads_per_rank(cfg, tp_size) * cfg.head_dim
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
    return q, k, v


def target_rank_tensors(
    tensors: dict[str, torch.Tensor], cfg: LlamaConfig, tp_size: int, rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s base-model tensors with TRT-LLM names, from our HF-named tensors
    (`model_defs.checkpoint.load_llama_checkpoint`, which drops a tied `lm_head.weight`)."""
    t = {name: x.to(dtype) for name, x in tensors.items()}
    embed = t["model.embed_tokens.weight"]
    out = {"transformer.vocab_embedding.weight": embed.contiguous()}
    for layer in range(cfg.num_hidden_layers):
        hf, tl = f"model.layers.{layer}.", f"transformer.layers.{layer}."
        q, k, v = (t[f"{hf}self_attn.{p}_proj.weight"] for p in "qkv")
        out[tl + "attention.qkv.weight"] = fuse_qkv(q, k, v, cfg, tp_size, rank)
        out[tl + "attention.dense.weight"] = split(t[hf + "self_attn.o_proj.weight"], tp_size, rank, dim=1)
        for trt_name, hf_name in MLP_NAMES.items():
            dim = 1 if trt_name == "mlp.proj" else 0  # proj is row-parallel, fc and gate column-parallel
            out[f"{tl}{trt_name}.weight"] = split(t[f"{hf}{hf_name}.weight"], tp_size, rank, dim)
        out[tl + "input_layernorm.weight"] = t[hf + "input_layernorm.weight"].contiguous()
        out[tl + "post_layernorm.weight"] = t[hf + "post_attention_layernorm.weight"].contiguous()
    out["transformer.ln_f.weight"] = t["model.norm.weight"].contiguous()
    out["lm_head.weight"] = split(t.get("lm_head.weight", embed), tp_size, rank)
    return out


def drafter_rank_tensors(
    tensors: dict[str, torch.Tensor], cfg: ReDrafterConfig, tp_size: int, rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s drafter tensors, `drafter.`-prefixed, every one split on dim 0 (`hf_drafter`)."""
    n = cfg.num_draft_layers
    renames = {
        f"lm_head.{i}.linear.{kind}": f"layers.{i}.linear.{kind}" for i in range(n) for kind in ("weight", "bias")
    }
    renames[f"lm_head.{n}.weight"] = "lm_head.weight"
    out = {}
    for name, x in tensors.items():
        out[DRAFTER_PREFIX + renames.get(name, name)] = split(x.to(dtype), tp_size, rank)
    return out
