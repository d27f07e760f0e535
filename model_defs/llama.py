"""Llama-family target model: RMSNorm, RoPE (with rope_scaling variants), grouped-query
attention, SwiGLU, tied or untied embeddings.

Module and parameter names mirror transformers' `LlamaForCausalLM` (`model.layers.0.
self_attn.q_proj.weight`, ...) so a Hugging Face checkpoint loads with no renaming and
transformers stays a drop-in oracle in the tests.

Forward signature (shared by every decoding strategy):

    input_ids  [B, T]       new tokens
    positions  [B, T]       RoPE position of each new token (tree siblings share one)
    paged      PagedBatch   optional: B = 1 flat batch of many requests' new tokens over
                            the paged KV cache (their K/V are written to the cache)
    tree_mask  [B, T, T]    without a cache: optional mask among the tokens (True = attend)
    logits_indices [B, K]   optional: only compute logits at these new-token indices
 -> LlamaOutput(logits [B, T or K, V], hidden [B, T, D])

`hidden` is the final-norm output (what the LM head sees), which is what ReDrafter and
Lyanna drafters condition on.

Tensor parallelism (Megatron-LM): a model built with `tp_size` > 1 holds one rank's shard
(`build/tp_shard.py`): heads / tp_size query and KV heads, intermediate_size / tp_size
MLP columns. Its o_proj and down_proj are row-parallel: the partial sums of all ranks are
added by an all-reduce over the default `torch.distributed` group. Embedding, norms and
LM head are whole on every rank, so inputs, hidden states and logits are the same on all.

Batch-invariant mode (`LlamaForCausalLM.set_batch_invariant(True)`, off by default): every
linear runs `plugins.batch_invariant.bi_linear` and every RMSNorm `bi_rms_norm`, whose
rows do not depend on how many tokens share the forward, and the dense (no-cache)
attention runs in fp64, so a token's logits are the same bits in a T-token tree forward
and in a 1-token forward (greedy speculative decoding then reproduces greedy
auto-regression). Paged attention (`PagedBatch`) is left as it is: batch-invariant with
the row-wise `specpipe::paged_attention` (`RowMetadata`), not with the CPU's grouped SDPA
(`AttentionGroup`s). Under tensor parallelism the local product is `bi_linear` and the
row-parallel all-reduce stays as it is (NCCL may pick its algorithm, hence its summation
order, by message size). Off, the forward is the normal one: one attribute test per
linear and norm.

Int8 drafters (`quantize_linears_int8`, `BuildConfig.drafter_layers`): a Llama used as a
draft LM, or a drafter built from these layers, may run its linears on fbgemm int8 copies
of the weights, with q/k/v and gate/up each one stacked product (`LinearStack`, which fp32
models on the CPU get too, on blocked copies: `pack_cpu_weights`, oneDNN's and, for products
of up to `plugins.fp32_linear.SMALL_M` rows, `fp32_linear.block16`'s). A drafter's
numerics only change which tokens are proposed; a target never runs in int8.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model_defs.paged_kv_cache import PagedBatch, PagedKVCache
from model_defs.rope import RopeConfig, RotaryEmbedding, apply_rope
from plugins import fp32_linear
from plugins.batch_invariant import bi_linear_nd, bi_rms_norm
from plugins.cpu_linear import Int8Copy, cpu_packed_linear, int8_linear, pack_cpu_weight, packed_pays, quantize_int8
from plugins.gpu_linear import gpu_linear_nd
from plugins.int8_linear import Int8Weight

ARCHITECTURE = "LlamaForCausalLM"


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters, with HF `LlamaConfig` field names."""

    vocab_size: int
    """Rows of the embedding and the LM head."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (< query heads: grouped-query attention)."""
    head_dim: int
    """Per-head width (usually hidden_size // num_attention_heads)."""
    max_position_embeddings: int = 2048
    """Longest context the model was trained for."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = None
    """HF `rope_scaling` dict (`rope_type` + parameters) or None."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections."""
    mlp_bias: bool = False
    """Bias on the MLP projections."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token(s)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other HF config keys, kept so a round trip loses nothing."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        _ = self.rope  # validates rope_scaling early

    @property
    def rope(self) -> RopeConfig:
        scaling = dict(self.rope_scaling or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        scaling.pop("rope_theta", None)
        return RopeConfig(self.head_dim, self.rope_theta, rope_type, scaling)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a HF `config.json` dict (transformers 4 or 5 style)."""
        archs = hf.get("architectures") or [ARCHITECTURE]
        if hf.get("model_type", "llama") != "llama" or ARCHITECTURE not in archs:
            raise ValueError(
                f"unsupported architecture {archs} (model_type {hf.get('model_type')!r}); "
                f"specpipe targets {ARCHITECTURE}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; Llama uses 'silu'")
        rope = RopeConfig.from_hf(hf, head_dim=1)
        heads = hf["num_attention_heads"]
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        known |= {"rope_parameters", "architectures", "model_type", "hidden_act"}
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=None if rope.rope_type == "default" else {"rope_type": rope.rope_type, **rope.params},
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        """HF `config.json` dict (transformers 5 style, `rope_parameters`)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_theta", "rope_scaling")}
        d.update(self.extra)
        d.update(self.rope.to_hf())
        d.update(architectures=[ARCHITECTURE], model_type="llama", hidden_act="silu")
        return d

    def num_parameters(self) -> int:
        return sum(s.numel() for s in expected_shapes(self).values())

    def check_tp_size(self, tp_size: int) -> None:
        """Every rank gets the same number of query heads, KV heads and MLP columns."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        sizes = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
        }
        bad = [f"{name} {n}" for name, n in sizes.items() if n % tp_size]
        if bad:
            raise ValueError(
                f"tp_size {tp_size} does not divide {', '.join(bad)}; "
                f"choose a tp_size that divides {', '.join(f'{k} ({v})' for k, v in sizes.items())}"
            )


def expected_shapes(cfg: LlamaConfig, tp_size: int = 1) -> dict[str, torch.Size]:
    """Tensor name -> shape of a complete checkpoint (HF names), or of one rank's shard
    when `tp_size` > 1. With tied embeddings `lm_head.weight` is absent."""
    cfg.check_tp_size(tp_size)
    d, kv = cfg.hidden_size, cfg.num_key_value_heads // tp_size * cfg.head_dim
    q = cfg.num_attention_heads // tp_size * cfg.head_dim
    inner = cfg.intermediate_size // tp_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (inner, d),
            p + "mlp.up_proj.weight": (inner, d),
            p + "mlp.down_proj.weight": (d, inner),
        }
        if cfg.attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in zip("qkvo", (q, kv, kv, d), strict=True)}
        if cfg.mlp_bias:
            shapes |= {p + f"mlp.{n}_proj.bias": (s,) for n, s in (("gate", inner), ("up", inner), ("down", d))}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return {k: torch.Size(v) for k, v in shapes.items()}


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back (as transformers does); in
    batch-invariant mode `bi_rms_norm` (fp64). An fp32 input takes `F.rms_norm`, one op
    for the five of the formula (~3.5 us less a call on the CPU, 13 calls a demo target
    forward), bitwise the same on the CPU (`tests/model_defs/test_llama_oracle.py`)."""

    batch_invariant = False
    """Set per instance by `LlamaForCausalLM.set_batch_invariant`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return bi_rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) that runs `bi_linear` in
    batch-invariant mode, and oneDNN's blocked copy of its weight once `pack_cpu_weights`
    made one (fp32 on the CPU, no autograd)."""

    batch_invariant = False
    """Set per instance by `LlamaForCausalLM.set_batch_invariant`."""
    triton = False
    """CUDA rows take `plugins.gpu_linear` instead of cuBLAS: set per instance by
    `LlamaForCausalLM.set_triton_linears` (while `runtime/cuda_graphs.py` captures a bucket)."""
    packed: torch.Tensor | None = None
    """oneDNN-layout copy of `weight` (`pack_cpu_weights`), or None."""
    small: torch.Tensor | None = None
    """`plugins.fp32_linear.block16` copy of `weight` for few-row products (`pack_cpu_weights`), or None."""
    int8: Int8Copy | None = None
    """int8 copy of `weight` (`quantize_int8`; drafters only), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` by the mode's kernel: `bi_linear`, `gpu_linear` (CUDA rows, `triton`),
        the int8 copy, the blocked copy, or `F.linear` (the copies only for fp32 CPU rows
        without autograd)."""
        if self.batch_invariant:
            return bi_linear_nd(x, self.weight, bias)
        if self.triton and x.is_cuda:
            return gpu_linear_nd(x, self.weight, bias)
        if self.int8 is not None and takes_cpu_copy(x):
            return int8_linear(x, self.int8, bias)
        if self.small is not None and fp32_linear.takes(x):
            return fp32_linear.product(x, self.small, self.out_features, bias)
        if self.packed is not None and packed_pays(x) and not x.requires_grad:
            return cpu_packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def pack_cpu_weight(self) -> None:
        """Keep a oneDNN-blocked copy of the weight for inference, and one for few-row
        products (`pack_cpu_weights`)."""
        self.packed = pack_cpu_weight(self.weight.detach())
        self.small = None if self.packed is None else fp32_linear.block16(self.weight)

    def quantize_int8(self, bits: int = 8) -> bool:
        """Keep an int8 copy of the weight for inference (a drafter's: `plugins/cpu_linear.py`;
        `bits=4`: values in [-7, 7], two a byte in the kernel's copy); False where it does not
        apply (not fp32 on the CPU). The int8 copy serves every input the blocked copy would,
        so that one is dropped."""
        self.int8 = quantize_int8(self.weight, bits)
        if self.int8 is not None:
            self.packed = self.small = None
        return self.int8 is not None


def takes_cpu_copy(x: torch.Tensor) -> bool:
    """Whether rows `x` may take an int8 or blocked copy of a weight: fp32 on the CPU, no autograd."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad


class LinearStack(NamedTuple):
    """Several `Linear`s that read the same input (q/k/v, gate/up) as one product on a
    stacked copy of their weights, split back apart: oneDNN's blocked fp32 copy
    (`pack_cpu_weights`: every fp32 model on the CPU) or an int8 copy
    (`quantize_linears_int8`: drafters). One call instead of two or three: a 1-token forward
    of the demo target makes 25 GEMM calls instead of 43 (q/k/v 83 -> 29 us, gate/up 100 ->
    61 us a layer). Every output element is the same dot product either way; int8 stacks are
    bitwise each Linear's own int8 product (weights quantized per output row, activations
    once per call, int32 sums exact); fp32 stacks are tested equal to the separate products
    too (oneDNN keeps the summation order along the input dimension)."""

    packed: Any
    """`pack_cpu_weight` or `quantize_int8` of the stacked weights."""
    int8: bool
    """Which of the two `packed` is."""
    bias: torch.Tensor | None
    """The stacked biases (None: none of them has one)."""
    sizes: list[int]
    """Output features of each stacked Linear, in order."""
    small: torch.Tensor | None = None
    """fp32 stacks: the `plugins.fp32_linear.block16` copy for few-row products."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, -1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked outputs `[..., sum(sizes)]`, not split."""
        if self.int8:
            return int8_linear(x, self.packed, self.bias)
        if self.small is not None and fp32_linear.takes(x):
            return fp32_linear.product(x, self.small, sum(self.sizes), self.bias)
        return cpu_packed_linear(x, self.packed, self.bias)


def stack_linears(linears: list[Linear], int8: bool, bits: int = 8) -> LinearStack | None:
    """One product for `linears` (same input width), on an int8 (`bits=4`: 4-bit) or a
    blocked fp32 copy of their stacked weights, or None where that copy does not apply (not
    fp32 on the CPU, or a torch without fbgemm / oneDNN)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    packed = quantize_int8(weight, bits) if int8 else pack_cpu_weight(weight)
    if packed is None:
        return None
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears])
    small = None if int8 else fp32_linear.block16(weight)
    return LinearStack(packed, int8, bias, [m.out_features for m in linears], small)


def int8_kernel(linear: Linear | LinearStack | None) -> Int8Weight | None:
    """The int8 kernel's weights (`Int8Copy.kernel`) of a bias-free int8 `Linear` or
    `LinearStack`, else None: what the C++ drafter forwards take (`plugins/llama_forward.py`,
    `plugins/lyanna_chain.py`)."""
    if isinstance(linear, LinearStack):
        return linear.packed.kernel if linear.int8 and linear.bias is None else None
    if isinstance(linear, Linear) and linear.bias is None and linear.int8 is not None:
        return linear.int8.kernel
    return None


def quantize_linears_int8(module: nn.Module, keep: Collection[nn.Module] = (), bits: int = 8) -> int:
    """Give every `Linear` of `module` but those in `keep` an int8 copy of its weight
    (`bits=4`: 4-bit values), and every attention's q/k/v and every MLP's gate/up one stacked
    int8 product (`LinearStack`), for a drafter's layers (`BuildConfig.drafter_layers`): only
    proposals change, so this is for drafters, never for a target. Returns how many Linears
    were quantized."""
    count = 0
    for m in module.modules():
        if isinstance(m, Linear) and not any(m is k for k in keep):
            count += m.quantize_int8(bits)
        elif isinstance(m, Attention):
            m.qkv_stack = stack_linears([m.q_proj, m.k_proj, m.v_proj], int8=True, bits=bits) or m.qkv_stack
        elif isinstance(m, MLP):
            m.gate_up_stack = stack_linears([m.gate_proj, m.up_proj], int8=True, bits=bits) or m.gate_up_stack
    return count


class RowParallelLinear(Linear):
    """Megatron's row-parallel linear: this rank holds the weight's columns for its slice of
    the input, the ranks' partial products are summed by an all-reduce, and the bias (whole
    on every rank) is added once after the sum, which is exact where adding bias / tp_size
    on every rank would not be. In batch-invariant mode the local product is `bi_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x, None)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def pack_cpu_weights(module: nn.Module) -> int:
    """Give every `Linear` in `module` oneDNN's blocked copy of its weight
    (`plugins/cpu_linear.py`), or, for every attention's q/k/v and MLP's gate/up, one
    blocked stacked product (`LinearStack`; the members keep no copy of their own, which
    that path never reads), for fp32 inference on the CPU; returns how many Linears run on
    a blocked copy. Call it once the weights are final (engine load): the copies do not
    follow later changes to the weights."""
    stacked: list[Linear] = []
    for layer in module.modules():
        if isinstance(layer, Attention):
            members = [layer.q_proj, layer.k_proj, layer.v_proj]
            layer.qkv_stack = stack_linears(members, int8=False)
            stacked += members if layer.qkv_stack is not None else []
        elif isinstance(layer, MLP):
            members = [layer.gate_proj, layer.up_proj]
            layer.gate_up_stack = stack_linears(members, int8=False)
            stacked += members if layer.gate_up_stack is not None else []
    linears = [m for m in module.modules() if isinstance(m, Linear) and not any(m is s for s in stacked)]
    for m in linears:
        m.pack_cpu_weight()
    return len(stacked) + sum(m.packed is not None for m in linears)


def output_linear(in_features: int, out_features: int, bias: bool, tp_size: int) -> Linear:
    """o_proj / down_proj: row-parallel under tensor parallelism, a plain Linear otherwise."""
    cls = RowParallelLinear if tp_size > 1 else Linear
    return cls(in_features, out_features, bias=bias)


class Attention(nn.Module):
    """Grouped-query attention over the KV cache plus the new (possibly tree) tokens. Under
    tensor parallelism: this rank's contiguous run of query heads and the KV heads they read."""

    qkv_stack: LinearStack | None = None
    """q/k/v as one product (`pack_cpu_weights`, `quantize_linears_int8`), or None."""

    def __init__(self, cfg: LlamaConfig, layer: int, tp_size: int = 1) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = cfg.num_key_value_heads // tp_size
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = output_linear(self.num_heads * self.head_dim, cfg.hidden_size, bias, tp_size)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, T, head_dim]
        sin: torch.Tensor,  # [B, T, head_dim]
        attend: Attend,
    ) -> torch.Tensor:  # [B, T, D]
        b, t, _ = x.shape
        if self.qkv_stack is not None and takes_cpu_copy(x) and not self.q_proj.batch_invariant:
            if isinstance(attend, PagedBatch):  # fused: no split, no transposes, one RoPE + K/V pass
                qkv = self.qkv_stack.product(x)[0]
                out = attend.attend_projected(self.layer, qkv, cos[0], sin[0], self.num_heads)
                return self.o_proj(out.view(1, t, -1))
            q, k, v = self.qkv_stack(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(self.layer, q, k, v)  # [B, H, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); under tensor parallelism over this rank's
    intermediate_size / tp_size columns."""

    gate_up_stack: LinearStack | None = None
    """gate and up as one product (`pack_cpu_weights`, `quantize_linears_int8`), or None."""

    def __init__(self, cfg: LlamaConfig, tp_size: int = 1) -> None:
        super().__init__()
        bias, inner = cfg.mlp_bias, cfg.intermediate_size // tp_size
        self.gate_proj = Linear(cfg.hidden_size, inner, bias=bias)
        self.up_proj = Linear(cfg.hidden_size, inner, bias=bias)
        self.down_proj = output_linear(inner, cfg.hidden_size, bias, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_stack is not None and takes_cpu_copy(x) and not self.gate_proj.batch_invariant:
            gate, up = self.gate_up_stack(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseAttention(NamedTuple):
    """No cache (training, oracle tests): the tokens attend among themselves, causally or
    under an explicit `[B, 1, T, T]` mask.

    `fp64` (batch-invariant mode): q, k, v upcast to fp64 and the output cast back. SDPA's
    kernels pick their blocking by T, so a row's attention output changes in the last bits
    with the number of tokens; in fp64 those differences (~2^-52 relative) are far below
    the model dtype's rounding step and the cast result is the same for any T (but for a
    value within ~2^-50 of a rounding boundary)."""

    mask: torch.Tensor | None
    fp64: bool = False

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa, causal = q.shape[1] != k.shape[1], self.mask is None
        if self.fp64:
            out = F.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), attn_mask=self.mask, is_causal=causal, enable_gqa=gqa
            )
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=causal, enable_gqa=gqa)


Attend = DenseAttention | PagedBatch
"""How a layer's attention runs: `attend(layer, q, k, v) -> out`, all `[B, heads, T, D]`."""


class LlamaOutput(NamedTuple):
    logits: torch.Tensor  # [B, T or K, V] (fp32)
    hidden: torch.Tensor  # [B, T, D] final-norm hidden states


class LlamaModel(nn.Module):
    """Embedding + decoder stack + final norm (HF `model.*`)."""

    def __init__(self, cfg: LlamaConfig, tp_size: int = 1) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp_size) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope)


class LlamaForCausalLM(nn.Module):
    """The target model, or one tensor-parallel rank's shard of it (`tp_size` > 1). See the
    module docstring for the forward contract and the batch-invariant mode."""

    batch_invariant = False
    """Batch-invariant mode: change it with `set_batch_invariant`."""

    def __init__(self, cfg: LlamaConfig, tp_size: int = 1) -> None:
        super().__init__()
        cfg.check_tp_size(tp_size)
        self.config, self.tp_size = cfg, tp_size
        self.model = LlamaModel(cfg, tp_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        paged: PagedBatch | None = None,
        tree_mask: torch.Tensor | None = None,  # [B, T, T] bool
        logits_indices: torch.Tensor | None = None,  # [B, K]
    ) -> LlamaOutput:
        if input_ids.ndim != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [B, T]"
            )
        attend: Attend
        if paged is None:
            attend = DenseAttention(None if tree_mask is None else tree_mask[:, None], self.batch_invariant)
        elif input_ids.shape[0] != 1 or tree_mask is not None:
            raise ValueError("a paged forward takes one flat batch [1, N]; tree masks live in its attention groups")
        else:
            attend = paged
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        hidden = self.model.norm(x)
        head_in = hidden
        if logits_indices is not None:
            head_in = torch.gather(hidden, 1, logits_indices[..., None].expand(-1, -1, hidden.shape[-1]))
        return LlamaOutput(self.lm_head(head_in).float(), hidden)

    def set_batch_invariant(self, on: bool = True) -> LlamaForCausalLM:
        """Switch this model's batch-invariant mode (module docstring) on or off; returns
        the model. A value on this model only: other models in the process are untouched."""
        self.batch_invariant = on
        for module in self.modules():
            if isinstance(module, Linear | RMSNorm):
                module.batch_invariant = on
        return self

    def set_triton_linears(self, on: bool = True) -> LlamaForCausalLM:
        """Run this model's linears on CUDA rows as `plugins.gpu_linear` (the Triton matmul)
        instead of cuBLAS, or back; returns the model. `runtime/cuda_graphs.py` captures
        each bucket both ways and keeps the faster."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.triton = on
        return self

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads of this rank: what its KV cache holds."""
        return self.config.num_key_value_heads // self.tp_size

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """An empty paged cache sized for this model (this rank's KV heads), on its device and dtype."""
        cfg, w = self.config, self.lm_head.weight
        return PagedKVCache(
            cfg.num_hidden_layers, num_blocks, block_size, self.num_local_kv_heads, cfg.head_dim, w.dtype, w.device
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
        """Load a HF `LlamaForCausalLM` directory (config.json + safetensors, sharded or not)."""
        from model_defs.checkpoint import load_llama_checkpoint

        cfg, tensors = load_llama_checkpoint(Path(path))
        return cls.from_tensors(cfg, tensors, dtype)

    @classmethod
    def from_tensors(
        cls, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, tp_size: int = 1
    ) -> LlamaForCausalLM:
        """Build from an already validated name -> tensor dict: the whole model, or with
        `tp_size` > 1 one rank's shard (`build.tp_shard.shard_tensors`)."""
        with torch.device("meta"):
            model = cls(cfg, tp_size)
        model.load_state_dict(tensors, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # buffers are not in checkpoints: recompute them on the real device
        model.model.rotary_emb = RotaryEmbedding(cfg.rope)
        return model.to(dtype).eval()
