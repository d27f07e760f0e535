"""A Llama's whole forward over the paged KV cache in one C++ call
(`plugins/csrc/llama_forward_cpu.cpp`): `FusedTarget` for the target on the CPU (fp32, on the
blocked weights `pack_cpu_weights` made), `Int8DraftLM` for a draft LM.

`specpipe_cpu::target_forward` (`FusedTarget`) returns what `LlamaForCausalLM.forward` with a
`PagedBatch` returns, logits at `logits_indices` and the final-norm hidden states, with the
same products (`plugins/fp32_linear.py`'s kernel up to `SMALL_M` rows, else
`mkldnn::_linear_pointwise`, on the same blocked copies), RoPE/K-V writes and attention
kernels; RMSNorm, SiLU-times-up, the residual adds and the RoPE tables are plain
loops between them, equal to the ATen ops' up to fp32 rounding (another summation order;
tests/plugins/test_llama_forward.py), as any other kernel choice. What it saves is the Python
and ~80 small ATen ops of a forward of the demo target: auto-regressive decoding at batch 1
went 123 -> 204 tok/s, at batch 8 509 -> 643 (2-core AVX2 EPYC, one process, the runner's
`fused` on and off, alternating rounds; README).

`specpipe_cpu::draft_lm_forward` (`Int8DraftLM`) is the same body for a Llama drafter whose linears have
int8 copies (`model_defs.llama.quantize_linears_int8`: the CPU default for draft LMs). Its
reference is the model's own forward (`LlamaForCausalLM.forward` with a `PagedBatch`), whose
int8 products are the op's (`specpipe::int8_linear`'s kernel on the same int8 weights,
`plugins.cpu_linear.int8_linear`): the same RoPE/K-V writes
(`specpipe_cpu::rope_kv_write`) and attention (`specpipe_cpu::tree_attention`), with RMSNorm,
SiLU-times-up, the residual adds and the RoPE tables as plain loops in between; logits and
cache agree to fp32 rounding (tests/plugins/test_llama_forward.py).

What it saves is the Python, fbgemm's per-call set-up and the small decomposed ops between
the products (~45 a forward of the demo draft LM, its RMSNorm alone six ATen ops): a
forward of the demo draft LM at batch 1 0.91 -> ~0.3 ms in the engine on the 2-core CPU,
and an SD / RSD step drafts 3-5 levels.
Drafting is only proposals: the emitted tokens never depend on the drafter's rounding
(verification is the target's), so the loops need not be the reference's bits.

`.of(model)` is None where an op does not apply (not fp32 on the CPU, tensor parallelism, a
head size the attention kernel is not built for, kernels off; for the target a linear
without a blocked copy or with a bias, for a drafter one without an int8 copy, biases or a
CPU with neither AVX-512 VNNI nor AVX2: `plugins.int8_linear.vectorized`); `__call__` is
None for a step it does not take (the row form of attention metadata, a prefill chunk
longer than `MAX_T`, batch-invariant mode, autograd), and the
caller runs the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import Tensor

from model_defs.llama import DecoderLayer, Linear, LinearStack, LlamaForCausalLM, LlamaOutput, int8_kernel
from model_defs.paged_kv_cache import Attention, AttentionGroup, PagedKVCache
from model_defs.rope import RotaryEmbedding
from plugins import cpu_kernels, fp32_linear
from plugins.int8_linear import Int8Weight, vectorized

MAX_T = 512
"""New tokens per request up to which the ops take a step: prefill chunks too, whose
attention runs the C++ kernel past `plugins.tree_attention.KERNEL_MAX_T` here. A prompt
chunk through the demo target (2-core AVX2 EPYC, one process, the op vs the model's
forward): 64 tokens 14.9 vs 19.1 ms, 100: 20.2 vs 28.3, 150: 32.6 vs 39.7, 256: 54 vs 58,
512: 121 vs 141; 768: 234 vs 201 (there SDPA's flash kernel wins: the C++ kernel is not
blocked for long sequences). The engine's prompts are at most 512 tokens (`max_input_len`)."""


def _fake(tokens: Tensor, positions: Tensor, slots: Tensor, *rest: Any) -> Tensor:
    logits_indices, embed = rest[5], rest[6]
    return embed.new_empty((logits_indices.shape[0], embed.shape[0]))


def _fake_chain(tokens: Tensor, starts: Tensor, slots: list[Tensor], levels: list[int], *rest: Any) -> Tensor:
    return tokens.new_empty((tokens.shape[0], max(levels, default=0)))


def _fake_chain_level(tokens: Tensor, positions: Tensor, slots: list[Tensor], embed: Tensor, *rest: Any) -> Tensor:
    return embed.new_empty((tokens.shape[0], embed.shape[0]))


def _fake_sampled_chain(
    first: Tensor | None, roots: Tensor | None, starts: Tensor, slots: list[Tensor], levels: list[int], *rest: Any
) -> tuple[Tensor, Tensor]:
    most, b, embed = max(levels, default=0), starts.shape[0], rest[3]
    return starts.new_empty((b, most)), embed.new_empty((b, most + 1, embed.shape[0]))


def _fake_target(tokens: Tensor, positions: Tensor, slots: Tensor, *rest: Any) -> tuple[Tensor, Tensor]:
    logits_indices, embed = rest[5], rest[6]
    hidden = embed.new_empty((tokens.shape[0], embed.shape[1]))
    return embed.new_empty((logits_indices.shape[0], embed.shape[0])), hidden


@dataclass(frozen=True)
class _Llama:
    """What both ops take of a model that does not change from step to step."""

    model: LlamaForCausalLM
    layers: list[DecoderLayer]
    inv_freq: Tensor  # [head_dim // 2]
    rope_scale: float
    norms: list[Tensor]  # per layer: input, post-attention RMSNorm weights [E]

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> _Llama | None:
        """None where neither op applies: not fp32 on the CPU, tensor parallelism, a head size
        the attention kernel is not built for, another RoPE."""
        w, rope = model.lm_head.weight, model.model.rotary_emb
        if w.device.type != "cpu" or w.dtype != torch.float32 or model.tp_size != 1:
            return None
        if model.config.head_dim not in (32, 64, 128) or not isinstance(rope, RotaryEmbedding):
            return None
        layers = [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]
        norms = [n.weight.detach() for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return cls(model, layers, rope.inv_freq.float().contiguous(), rope.scale, norms)

    def products(self) -> list[Linear | LinearStack | None]:
        """Per layer: q/k/v (stacked), o, gate/up (stacked), down; then the LM head."""
        per_layer = [
            p
            for layer in self.layers
            for p in (layer.self_attn.qkv_stack, layer.self_attn.o_proj, layer.mlp.gate_up_stack, layer.mlp.down_proj)
        ]
        return [*per_layer, self.model.lm_head]


def _blocked(product: Linear | LinearStack | None) -> tuple[Tensor, Tensor, int] | None:
    """The two blocked fp32 copies (oneDNN's, `block16`'s) and the output width of a
    bias-free `Linear` or `LinearStack`, else None."""
    if isinstance(product, LinearStack):
        if product.int8 or product.bias is not None or product.small is None:
            return None
        return product.packed, product.small, sum(product.sizes)
    if isinstance(product, Linear) and product.bias is None and product.int8 is None:
        if product.packed is None or product.small is None:
            return None
        return product.packed, product.small, product.out_features
    return None


Out = TypeVar("Out")


@dataclass(frozen=True)
class _Op(Generic[Out]):
    """One op's view of a model; calling it runs a step: `(tokens, positions, slots,
    attention, logits_indices, cache)` -> the op's result, or None for a step it does not take."""

    llama: _Llama
    op: ClassVar[str]
    _arguments: list[Any] = field(default_factory=list, init=False, compare=False, repr=False)
    """(cache K, cache V, `model_arguments` for that cache), once asked."""

    def products(self) -> list[Any]:
        """The op's weight arguments."""
        raise NotImplementedError

    def finish(self, out: Any) -> Out:
        return cast(Out, out)

    def __call__(
        self,
        tokens: Tensor,  # [N] int64
        positions: Tensor,  # [N] int64
        slots: Tensor,  # [N] int64 cache slot each token's K/V is written to
        attention: Attention,
        logits_indices: Tensor,  # [K] int64
        cache: PagedKVCache,
    ) -> Out | None:
        if not isinstance(attention, list) or self.stands_aside():
            return None
        if any(g.query_index.shape[1] > MAX_T for g in attention):
            return None
        out = getattr(torch.ops.specpipe_cpu, self.op)(
            tokens, positions, slots, *_columns(attention), logits_indices, *self.model_arguments(cache)
        )
        return None if out is None else self.finish(out)

    def stands_aside(self) -> bool:
        """Whether the ops leave every step to the model's forward: batch-invariant mode, autograd."""
        return self.llama.model.batch_invariant or torch.is_grad_enabled()

    def model_arguments(self, cache: PagedKVCache) -> list[Any]:
        """The ops' arguments after the step's own: the model's weights, `cache`'s K/V and
        the settings, in the schemas' order. Gathered once per cache (the model does not
        change from step to step: `_Llama`): gathered at every call, through the modules'
        attributes, they cost ~12 us, at batch 1 a call of the target's forward and one or
        two of a draft LM's a step."""
        memo = self._arguments
        if memo and memo[0] is cache.k and memo[1] is cache.v:
            return memo[2]
        llama, cfg, model = self.llama, self.llama.model.config, self.llama.model.model
        arguments = [
            model.embed_tokens.weight, llama.inv_freq, llama.rope_scale, llama.norms, *self.products(),
            cache.k, cache.v, model.norm.weight, cfg.num_attention_heads, cfg.rms_norm_eps,
        ]  # fmt: skip
        memo[:] = [cache.k, cache.v, arguments]
        return arguments


def _view(
    model: LlamaForCausalLM, convert: Callable[[Any], Any], op: str, fake: Callable[..., Any]
) -> tuple[_Llama, list[Any]] | None:
    """`model`'s `_Llama` and `convert` of each of its products; None where the ops do not
    apply, a product does not convert (None) or the kernels are not built."""
    llama = _Llama.of(model)
    if llama is None:
        return None
    converted = [convert(p) for p in llama.products()]
    if any(c is None for c in converted) or not cpu_kernels.load_with_fake(op, fake):
        return None
    return llama, converted


@dataclass(frozen=True)
class FusedTarget(_Op[LlamaOutput]):
    """`specpipe_cpu::target_forward`'s view of a target: a step gives what
    `LlamaForCausalLM.forward` with `PagedBatch(cache, slots, attention)` and `logits_indices`
    returns (logits `[1, K, V]`, hidden states `[1, N, E]`), the K/V of its tokens written."""

    packed: list[Tensor]
    """oneDNN's copies: per layer q/k/v (stacked), o, gate/up (stacked), down; then the LM head."""
    small: list[Tensor]
    """The same products' `plugins.fp32_linear.block16` copies (up to `fp32_linear.SMALL_M` rows)."""
    out_features: list[int]
    op: ClassVar[str] = "target_forward"

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> FusedTarget | None:
        """The op's view of `model`, or None where the op does not apply (module docstring)."""
        view = _view(model, _blocked, cls.op, _fake_target)
        if view is None:
            return None
        packed, small, outs = zip(*view[1], strict=True)
        return cls(view[0], list(packed), list(small), list(outs))

    def products(self) -> list[Any]:
        return [self.packed, self.small, self.out_features, fp32_linear.SMALL_M]

    @staticmethod
    def cost_steps() -> list[int]:
        """Token counts after which a forward of one token more makes one more pass of its
        few-row products (`fp32_linear.TILE_ROWS` rows a pass), up to `SMALL_M` rows, after
        which oneDNN's products take over."""
        return list(range(fp32_linear.TILE_ROWS, fp32_linear.SMALL_M + 1, fp32_linear.TILE_ROWS))

    def finish(self, out: Any) -> LlamaOutput:
        logits, hidden = out
        return LlamaOutput(logits[None], hidden[None])


@dataclass(frozen=True)
class Int8DraftLM(_Op[Tensor]):
    """`specpipe_cpu::draft_lm_forward`'s view of a draft LM: a step gives the logits `[K, V]`
    at `logits_indices` that `LlamaForCausalLM.forward` with `PagedBatch(cache, slots,
    attention)` returns, the K/V of its tokens written."""

    linears: list[Int8Weight]
    """Per layer: q/k/v (stacked), o, gate/up (stacked), down; then the LM head."""
    op: ClassVar[str] = "draft_lm_forward"

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> Int8DraftLM | None:
        """The op's view of `model`, or None where the op does not apply (module docstring)."""
        if not vectorized():  # its products would be a scalar loop: fbgemm's, through the model, are faster
            return None
        view = _view(model, int8_kernel, cls.op, _fake)
        return None if view is None else cls(view[0], view[1])

    def products(self) -> list[Any]:
        return [list(column) for column in zip(*self.linears, strict=True)]

    def chain(
        self,
        tokens: list[int],
        starts: list[int],
        slots: list[Tensor],
        levels: list[int],
        cache: PagedKVCache,
        behind: list[list[int]] | None = None,
    ) -> list[list[int]] | None:
        """`specpipe_cpu::draft_lm_chain`: greedy chains, every level in one call. Request i's
        `tokens[i]` is fed at position `starts[i]` (`slots[i]`: the slots of its positions),
        after its `behind[i]` tokens at the positions just before (the same level), then the
        argmax after each fed token, `levels[i]` tokens in all; returns those argmaxes
        (`levels[i]` per request), or None where the op does not take the step (as `__call__`)."""
        if self.stands_aside() or not cpu_kernels.load_with_fake("draft_lm_chain", _fake_chain):
            return None
        out = torch.ops.specpipe_cpu.draft_lm_chain(
            torch.tensor(tokens), torch.tensor(starts), slots, levels, _behind(behind), *self.model_arguments(cache)
        )
        return [row[:n] for row, n in zip(out.tolist(), levels, strict=True)]

    def takes_chain_level(self, inference: bool = False) -> bool:
        """Whether `chain_level` runs: the kernels built, the op not standing aside (`inference`:
        asked for a call under inference mode, where autograd is off whatever it is here)."""
        aside = self.llama.model.batch_invariant if inference else self.stands_aside()
        return not aside and cpu_kernels.load_with_fake("draft_lm_chain_level", _fake_chain_level)

    def chain_level(
        self, tokens: list[int] | Tensor, positions: list[int], slots: list[Tensor], cache: PagedKVCache
    ) -> Tensor:
        """`specpipe_cpu::draft_lm_chain_level`: one level of chains, request i's `tokens[i]`
        fed at `positions[i]` seeing its cache up to there (`slots[i]`: the slots of its
        positions); logits `[B, V]`, the caller drawing the next tokens (sampled chains).
        Only where `takes_chain_level()`."""
        return torch.ops.specpipe_cpu.draft_lm_chain_level(
            torch.as_tensor(tokens), torch.tensor(positions), slots, *self.model_arguments(cache)
        )

    def sampled_chain(
        self,
        first: Tensor | None,
        roots: list[int] | None,
        starts: list[int],
        slots: list[Tensor],
        levels: list[int],
        temperatures: list[float],
        uniforms: Tensor,
        cache: PagedKVCache,
        behind: list[list[int]] | None = None,
    ) -> tuple[Tensor, Tensor] | None:
        """`specpipe_cpu::draft_lm_sampled_chain`: sampled chains, every level in one call.
        Request i draws `levels[i]` tokens, level j from softmax(logits / `temperatures[i]`)
        at `uniforms[i, j]` (level 0's logits `first[i]`, or those of `roots[i]` fed at
        `starts[i]` - 1 after its `behind[i]` tokens; the next ones those after feeding each
        draw at `starts[i]` + j). Returns the draws `[B, max(levels)]` and their laws
        `[B, max(levels) + 1, V]` (row 0 zeros: the root's), or None where the op does not
        take the step (as `__call__`)."""
        if self.stands_aside() or not cpu_kernels.load_with_fake("draft_lm_sampled_chain", _fake_sampled_chain):
            return None
        fed = None if roots is None else torch.tensor(roots)
        return torch.ops.specpipe_cpu.draft_lm_sampled_chain(
            first, fed, torch.tensor(starts), slots, levels, _behind(behind), temperatures, uniforms,
            *self.model_arguments(cache),
        )  # fmt: skip


def _behind(rows: list[list[int]] | None) -> Tensor | None:
    """The chain ops' `behind` `[B, K]` (-1 past a request's tokens), None where none is behind."""
    if rows is None or not any(rows):
        return None
    most = max(len(r) for r in rows)
    return torch.tensor([[*r, *[-1] * (most - len(r))] for r in rows])


def _columns(groups: list[AttentionGroup]) -> tuple[list[Tensor], ...]:
    """query_index, key_slots, mask, valid and rows of every group: the op's five lists."""
    return tuple(list(column) for column in zip(*groups, strict=True))
