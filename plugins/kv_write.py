"""`specpipe::rope_kv_write`: one layer's new queries, keys and values, from the fused
q/k/v projection to what attention reads. RoPE on q and k (`model_defs.rope.apply_rope`),
the rotated keys and the values written to their paged-cache slots, the rotated queries
returned `[N, H, D]`.

`rope_kv_write_reference` is the plain-torch form: split, reshape, `apply_rope`, an indexed
store per cache (the model's layers did exactly this). On the CPU a C++ kernel
(`plugins/csrc/rope_kv_write_cpu.cpp`, built by `plugins/cpu_kernels.py`) does it in one
pass over the rows, rounding every product and sum as torch does, so the results are the
same bits; it replaces ~20 small torch ops a layer (~4 us each on the 2-core CI machine,
plus Python), which in a 1-token forward of the 2-layer demo draft LM cost about as much
as its GEMMs. `write_new_tokens` is the model's entry point: the C++ op where it applies,
else the custom op (whose kernel is the reference where the C++ one does not apply).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model_defs.rope import apply_rope
from plugins import cpu_kernels


def _split(qkv: Tensor, num_heads: int, k_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """qkv `[N, (H + 2 H_kv) D]` -> q `[N, H, D]`, k, v `[N, H_kv, D]` (views)."""
    h_kv, d = k_cache.shape[1], k_cache.shape[2]
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * h_kv) * d:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} must be [N, (H + 2 H_kv) D] = [N, {(num_heads + 2 * h_kv) * d}] for "
            f"{num_heads} query heads and a cache of {h_kv} KV heads of size {d}"
        )
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * d, h_kv * d, h_kv * d], -1)
    return q.reshape(n, num_heads, d), k.reshape(n, h_kv, d), v.reshape(n, h_kv, d)


def rope_kv_write_reference(
    qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, num_heads: int
) -> Tensor:
    """Plain torch (same arguments as the op): the model's own RoPE and an indexed store."""
    q, k, v = _split(qkv, num_heads, k_cache)
    # apply_rope takes [B, H, T, D] and [B, T, D]: heads in the batch position, rows as T
    q = apply_rope(q.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)
    k_cache[slots] = apply_rope(k.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)
    v_cache[slots] = v
    return q.contiguous()


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("rope_kv_write", _fake)


def kernel_applies(qkv: Tensor, cos: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether `specpipe_cpu::rope_kv_write` takes these arguments (and is built): fp32 CPU
    tensors, contiguous qkv and cos, caches with dense `[H_kv, D]` slots in one layout."""
    dense = k_cache.stride(-1) == 1 and k_cache.stride(1) == k_cache.shape[-1] and v_cache.stride() == k_cache.stride()
    return (
        qkv.device.type == "cpu"
        and qkv.dtype == cos.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and qkv.is_contiguous()
        and cos.is_contiguous()
        and dense
        and _kernel_built()
    )


def write_new_tokens(
    qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, num_heads: int
) -> Tensor:
    """`rope_kv_write` by the shortest route, for the model's layers: the C++ op itself where
    it applies (it checks shapes and slot ranges), else the custom op."""
    if kernel_applies(qkv, cos, k_cache, v_cache) and sin.is_contiguous() and slots.is_contiguous():
        return torch.ops.specpipe_cpu.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, num_heads)
    return rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, num_heads)


@torch.library.custom_op("specpipe::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write(
    qkv: Tensor,  # [N, (H + 2 H_kv) D] one layer's q/k/v projection of N new tokens
    cos: Tensor,  # [N, D] RoPE tables at the tokens' positions
    sin: Tensor,  # [N, D]
    k_cache: Tensor,  # [num_slots, H_kv, D] the layer's keys: rotated k written at `slots`
    v_cache: Tensor,  # [num_slots, H_kv, D] the layer's values: v written at `slots`
    slots: Tensor,  # [N] int64 cache slot of each new token
    num_heads: int,  # H
) -> Tensor:  # [N, H, D] rotated queries
    _split(qkv, num_heads, k_cache)
    if kernel_applies(qkv, cos, k_cache, v_cache):
        args = (cos, sin.contiguous(), k_cache, v_cache, slots.contiguous())
        return torch.ops.specpipe_cpu.rope_kv_write(qkv, *args, num_heads)
    return rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, slots, num_heads)


@rope_kv_write.register_fake
def _fake(
    qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, num_heads: int
) -> Tensor:
    _split(qkv, num_heads, k_cache)
    return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[-1])
