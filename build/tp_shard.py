"""Split a Llama checkpoint into Megatron-LM tensor-parallel shards, one per rank file.

    q/k/v_proj, gate/up_proj   column-parallel: output rows split, rank r gets the r-th
                               contiguous run of heads (q: num_attention_heads / tp,
                               k and v: num_key_value_heads / tp) or of MLP columns
    o_proj, down_proj          row-parallel: input columns split the same way, so each
                               rank's partial product covers exactly its heads / columns
    their biases               column-parallel biases are split with their rows; the
                               row-parallel bias is kept whole on every rank and added
                               once, after the all-reduce (`model_defs.llama.RowParallelLinear`),
                               which is exact where bias / tp on every rank would round
    everything else            replicated: norms, embedding, LM head, `drafter.*`

Contiguous head runs keep grouped-query attention local: rank r's query heads
[r*H/tp, (r+1)*H/tp) read exactly KV heads [r*KV/tp, (r+1)*KV/tp).

The embedding and the LM head are replicated rather than vocab-split:
- the embedding feeds the drafter too: ReDrafter's beam search embeds every drafted token
  with `target.model.embed_tokens` at each of its L steps, and a vocab-parallel embedding
  would cost an all-reduce per lookup there and in the target forward;
- tied checkpoints (the demo target) share one matrix between the two, so a whole
  embedding is a whole LM head for free;
- only rank 0 samples and verifies, so vocab-split logits would need a gather of
  `[K, V]` logits to rank 0 every step; whole logits on rank 0 are computed from the same
  hidden state by the same GEMM as without tensor parallelism, and the other ranks skip
  the LM head (`runtime.tensor_parallel.serve_steps`), so replication costs memory
  (V x D per rank), not time.
"""

from __future__ import annotations

import torch

from model_defs.llama import LlamaConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Output rows (weight dim 0, and the bias) split across ranks."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Input columns (weight dim 1) split across ranks; the bias stays whole."""


def split_dim(name: str) -> int | None:
    """The axis of tensor `name` that is split across ranks, or None if it is replicated."""
    if not name.startswith("model.layers."):
        return None  # embedding, final norm, LM head, drafter tensors
    module, kind = name.split(".")[-2:]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and kind == "weight":
        return 1
    return None


def shard_tensors(
    tensors: dict[str, torch.Tensor], cfg: LlamaConfig, tp_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of a whole checkpoint (target tensors and `drafter.*` tensors);
    contiguous, ready for `safetensors.save_file`."""
    cfg.check_tp_size(tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside [0, {tp_size})")
    out = {}
    for name, tensor in tensors.items():
        dim = split_dim(name)
        out[name] = tensor if dim is None else tensor.tensor_split(tp_size, dim)[rank].contiguous()
    return out
