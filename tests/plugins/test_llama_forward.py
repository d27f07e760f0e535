"""`specpipe_cpu::target_forward` and `specpipe_cpu::draft_lm_forward` (`plugins/llama_forward.py`)
against their reference, the model's own paged forward (`LlamaForCausalLM.forward` with a
`PagedBatch`). The target op, on an fp32 model with oneDNN-blocked weights: the same logits,
hidden states and K/V to fp32 rounding and the same greedy tokens. The draft op, on an int8
draft LM whose reference products are the op's (`specpipe::int8_linear`'s kernel,
`plugins.cpu_linear.int8_linear`): the same logits and K/V to rounding. Both for decode
tokens, a draft-tree level over cached tree nodes, and batches whose requests fall into
several attention groups; a variant that feeds the norms in the wrong order fails; and each
stands aside (None: the model's forward runs) wherever it does not apply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from model_defs.llama import LlamaConfig, LlamaForCausalLM, pack_cpu_weights, quantize_linears_int8
from model_defs.paged_kv_cache import PagedBatch, PagedKVCache
from plugins import cpu_kernels, llama_forward
from plugins.int8_linear import vectorized
from plugins.llama_forward import FusedTarget, Int8DraftLM
from plugins.tree_attention import KERNEL_MAX_T
from runtime.attention_batch import Segment, build_rows
from runtime.block_manager import BlockManager
from runtime.model_runner import StepInput
from runtime.proposers.level_drafters import DraftLMLevels
from runtime.request import Request
from runtime.step_batch import step_input

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load() or not vectorized(),
    reason="the op runs where the C++ kernels are built with AVX-512 VNNI or AVX2",
)

VOCAB, SPAN = 211, 80
"""Vocabulary; cache slots per request (request r owns slots r * SPAN ...)."""
TOLERANCE = 2e-3
"""Largest |logit difference| allowed, on logits of spread ~1: the products quantize their
activations per row, so a last-bit difference in a norm (the op's loops sum in another order
than ATen) can move one activation across a rounding step of the int8 grid; such a flip
moves a logit by ~1e-3 here. Wrong arithmetic moves them by ~1."""


def draft_lm(int8: bool = True, bias: bool = False, head_dim: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=bias,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # logits spread ~1, norms away from 1
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    if int8:
        quantize_linears_int8(model)
    return model


def target(bias: bool = False, head_dim: int = 32) -> LlamaForCausalLM:
    """An fp32 model with oneDNN-blocked weights, as engine load makes them."""
    model = draft_lm(int8=False, bias=bias, head_dim=head_dim)
    pack_cpu_weights(model)
    return model


def slots(request: int, length: int) -> torch.Tensor:
    return torch.arange(request * SPAN, request * SPAN + length)


@torch.inference_mode()
def prefilled(model: LlamaForCausalLM, contexts: list[int]) -> PagedKVCache:
    """A cache holding each request's context of random tokens (by the model's own forward)."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, len(contexts) * SPAN // 4, 4, cfg.num_key_value_heads, cfg.head_dim)
    tokens = [torch.randint(0, VOCAB, (c,)).tolist() for c in contexts]
    start, segments, flat, positions = 0, [], [], []
    for r, ids in enumerate(tokens):
        segments.append(Segment(start, 0, slots(r, len(ids))))
        flat += ids
        positions += range(len(ids))
        start += len(ids)
    step = step_input(torch.tensor(flat), torch.tensor(positions), segments, torch.tensor([0]), "cpu")
    model(step.tokens[None], step.positions[None], PagedBatch(cache, step.slots, step.attention))
    return cache


def level_of(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a packed tree (the columns: the tree's nodes)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def step_for(contexts: list[int], new: list[tuple[int, torch.Tensor | None]]) -> StepInput:
    """One step: request r, holding contexts[r] cached tokens, adds new[r] = (n tokens, their
    tree mask over the last mask-width slots, the new ones included; None: causal)."""
    segments, flat, positions, rows, start = [], [], [], [], 0
    for r, ((n, mask), c) in enumerate(zip(new, contexts, strict=True)):
        segments.append(Segment(start, c, slots(r, c + n), mask))
        flat += torch.randint(0, VOCAB, (n,)).tolist()
        base = c + n - (n if mask is None else mask.shape[1])  # tokens before the tree (or the chunk)
        positions += range(c, c + n) if mask is None else [base - 1 + int(m.sum()) for m in mask]
        rows += range(start, start + n)
        start += n
    return step_input(torch.tensor(flat), torch.tensor(positions), segments, torch.tensor(rows), "cpu")


@torch.inference_mode()
def outputs(
    op: Int8DraftLM | FusedTarget | LlamaForCausalLM, step: StepInput, cache: PagedKVCache
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Logits `[K, V]` and hidden states `[N, E]` (None from the draft op, which returns
    logits only) of `step` by an op or the model's paged forward, on `cache`; None where the
    op stands aside."""
    if isinstance(op, Int8DraftLM):
        logits = op(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
        return None if logits is None else (logits, None)
    if isinstance(op, FusedTarget):
        out = op(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
    else:
        paged = PagedBatch(cache, step.slots, step.attention)
        out = op(step.tokens[None], step.positions[None], paged, logits_indices=step.logits_indices[None])
    return None if out is None else (out.logits[0], out.hidden[0])


def run(op: Int8DraftLM | FusedTarget | LlamaForCausalLM, step: StepInput, cache: PagedKVCache) -> torch.Tensor | None:
    """The logits of `outputs`."""
    out = outputs(op, step, cache)
    return None if out is None else out[0]


def copy_of(cache: PagedKVCache) -> PagedKVCache:
    other = PagedKVCache(1, cache.num_blocks, cache.block_size, 1, 1)
    other.kv = cache.kv.clone()
    other.k, other.v = list(other.kv[0].unbind(0)), list(other.kv[1].unbind(0))
    return other


TREE = level_of([-1, 0, 0, 1, 2])[3:]
"""The third level (nodes 3, 4) of a tree whose first two levels (nodes 0-2) are cached."""
CASES = {
    "decode, one group": ([9, 14, 5], [(1, None)] * 3),
    "a prefill chunk and decode tokens: two groups": ([9, 14, 5], [(1, None), (6, None), (1, None)]),
    "a tree level over cached nodes, beside a decode token": ([15, 7], [(2, TREE), (1, None)]),
    "a prompt chunk longer than the attention kernel's short groups": ([2, 3], [(SPAN - 2, None), (1, None)]),
    # 155 rows: the layer loops split their rows over threads (`llama_loops.h` kLoopGrain)
    "two prompt chunks, rows enough to split the layer loops": ([2, 3], [(SPAN - 2, None), (SPAN - 3, None)]),
}


OPS: dict[
    str, tuple[Callable[[], LlamaForCausalLM], Callable[[LlamaForCausalLM], Int8DraftLM | FusedTarget | None], float]
] = {
    "draft_lm_forward": (draft_lm, Int8DraftLM.of, TOLERANCE),
    "target_forward": (target, FusedTarget.of, 1e-4),
}
"""op -> (its model, its view of the model, the largest |logit| or |hidden| difference allowed).
The target's: fp32 rounding of another summation order in the norms and products moves
them by ~1e-6; wrong arithmetic by ~1."""


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", list(CASES))
def test_the_op_is_the_models_paged_forward(op: str, case: str) -> None:
    make, view, tolerance = OPS[op]
    contexts, new = CASES[case]
    model = make()
    fused = view(model)
    assert fused is not None
    cache = prefilled(model, contexts)
    step, reference = step_for(contexts, new), copy_of(cache)
    got, want = outputs(fused, step, cache), outputs(model, step, reference)
    assert got is not None and want is not None
    assert got[0].shape == want[0].shape == (sum(n for n, _ in new), VOCAB)
    assert (got[0] - want[0]).abs().max() < tolerance
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    if got[1] is not None:  # the target's hidden states
        assert want[1] is not None and got[1].shape == want[1].shape == (step.tokens.shape[0], model.config.hidden_size)
        assert (got[1] - want[1]).abs().max() < tolerance
    written = cache.kv[:, :, step.slots]
    assert written.abs().max() > 0.1 and torch.allclose(written, reference.kv[:, :, step.slots], atol=1e-4)
    assert torch.allclose(cache.kv, reference.kv, atol=1e-4)  # and nothing else moved


@pytest.mark.parametrize("op", list(OPS))
def test_a_variant_with_the_norms_swapped_fails(op: str) -> None:
    make, view, tolerance = OPS[op]
    model = make()
    fused = view(model)
    assert fused is not None
    norms = fused.llama.norms
    broken = replace(fused, llama=replace(fused.llama, norms=[norms[i ^ 1] for i in range(len(norms))]))
    cache = prefilled(model, [9, 4])
    step = step_for([9, 4], [(1, None), (3, None)])
    want = run(model, step, copy_of(cache))
    good, bad = run(fused, step, copy_of(cache)), run(broken, step, copy_of(cache))
    assert want is not None and good is not None and bad is not None
    assert (good - want).abs().max() < tolerance < (bad - want).abs().max()


def test_each_op_stands_aside_for_models_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # a CPU with neither VNNI nor AVX2: fbgemm's products, through the model
        m.setattr(llama_forward, "vectorized", lambda: False)
        assert Int8DraftLM.of(draft_lm()) is None
    assert Int8DraftLM.of(draft_lm(int8=False)) is None  # fp32 linears
    assert Int8DraftLM.of(draft_lm(bias=True)) is None  # biases
    assert Int8DraftLM.of(draft_lm(head_dim=16)) is None  # a head size the attention kernel is not built for
    assert FusedTarget.of(draft_lm(int8=False)) is None  # no blocked copies (engine load makes them)
    assert FusedTarget.of(draft_lm()) is None  # int8 copies: a drafter's
    assert FusedTarget.of(target(bias=True)) is None  # biases
    assert FusedTarget.of(target(head_dim=16)) is None


@pytest.mark.parametrize("op", list(OPS))
def test_it_stands_aside_for_steps_it_does_not_take(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, view, _ = OPS[op]
    model = make()
    fused = view(model)
    assert fused is not None
    cache = prefilled(model, [1])
    chunk = step_for([0], [(SPAN, None)])  # past the attention kernel's short groups: still the op's
    assert SPAN > KERNEL_MAX_T and run(fused, chunk, cache) is not None
    with monkeypatch.context() as m:  # a chunk past MAX_T: the model's forward
        m.setattr(llama_forward, "MAX_T", SPAN - 1)
        assert run(fused, chunk, cache) is None
    decode = step_for([1], [(1, None)])
    row_form = build_rows([Segment(0, 1, slots(0, 2))], 1)  # the GPU's metadata form
    with torch.inference_mode():
        assert fused(decode.tokens, decode.positions, decode.slots, row_form, decode.logits_indices, cache) is None
    model.set_batch_invariant(True)
    assert run(fused, decode, cache) is None


def test_the_ops_arguments_are_gathered_once_a_cache() -> None:
    """`model_arguments` (the weights, a cache's K/V, the settings) is gathered once per cache
    and given again while the step's cache is that one; another cache (another engine on
    the same model, a test's copy) gets its own K/V, not the first one's."""
    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    a, b = prefilled(model, [5]), prefilled(model, [5])
    first = fused.model_arguments(a)
    assert fused.model_arguments(a) is first and any(x is a.k for x in first)
    other = fused.model_arguments(b)
    assert any(x is b.k for x in other) and any(x is b.v for x in other)
    assert not any(x is a.k or x is a.v for x in other)
    assert fused.model_arguments(a) is not other


def test_a_linear_of_the_wrong_width_is_refused_not_read_past() -> None:
    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    linears = list(fused.linears)
    linears[1] = linears[3]  # layer 0's o_proj (128 inputs) given the down projection's weights (192 inputs)
    cache = prefilled(model, [5])
    with pytest.raises(RuntimeError, match="takes 192 inputs, got 128"):
        run(replace(fused, linears=linears), step_for([5], [(1, None)]), cache)


@torch.inference_mode()
def chain_by_levels(
    fused: Int8DraftLM, cache: PagedKVCache, firsts: list[int], starts: list[int], levels: list[int]
) -> list[list[int]]:
    """`Int8DraftLM.chain`'s reference: its levels one `draft_lm_forward` step at a time (each
    request still drafting feeds one token at its next position, causal over its slots), the
    next token each row's argmax."""
    out: list[list[int]] = [[] for _ in firsts]
    current = list(firsts)
    for j in range(max(levels)):
        active = [r for r, n in enumerate(levels) if n > j]
        segments = [Segment(i, starts[r] + j, slots(r, starts[r] + j + 1)) for i, r in enumerate(active)]
        step = step_input(
            torch.tensor([current[r] for r in active]), torch.tensor([starts[r] + j for r in active]), segments,
            torch.arange(len(active)), "cpu",
        )  # fmt: skip
        logits = fused(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
        assert logits is not None
        for r, token in zip(active, logits.argmax(-1).tolist(), strict=True):
            current[r] = token
            out[r].append(token)
    return out


def test_the_draft_chain_is_its_levels_one_step_at_a_time() -> None:
    """`specpipe_cpu::draft_lm_chain` (SD's greedy chains, every level in one call) drafts
    the tokens and writes the K/V its levels do one `draft_lm_forward` step at a time, for
    requests of different depths (one drafting nothing); chains fed one position late (RoPE
    and the keys one slot off) draft other tokens."""
    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    contexts, levels, firsts = [9, 30, 17], [4, 0, 6], [3, 7, 11]
    cache = prefilled(model, contexts)
    reference = copy_of(cache)
    table = [slots(r, SPAN) for r in range(len(contexts))]
    with torch.inference_mode():
        got = fused.chain(firsts, contexts, table, levels, cache)
        late = fused.chain(firsts, [c + 1 for c in contexts], table, levels, copy_of(cache))
    want = chain_by_levels(fused, reference, firsts, contexts, levels)
    assert got == want and [len(t) for t in got] == levels
    assert late is not None and late != got
    assert torch.equal(cache.kv, reference.kv)


def test_chains_a_forward_a_level_are_the_chain_ops_chains() -> None:
    """Where no C++ op drafts chains (a GPU: `DraftLMLevels` without the op, its levels
    replaying a captured graph), `DraftLMLevels._chain_by_levels` drafts a level per forward
    of the draft LM's own (one token per request at its next position, causal over its
    slots), each level's argmax fed next: the chains `specpipe_cpu::draft_lm_chain`
    drafts, for requests of different depths (one drafting nothing), and the K/V it writes
    to rounding. Fed one position late, other chains."""
    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    contexts, levels, firsts = [9, 30, 17], [4, 0, 6], [3, 7, 11]
    cache = prefilled(model, contexts)
    reference, late_cache = copy_of(cache), copy_of(cache)
    table = [slots(r, SPAN) for r in range(len(contexts))]
    with torch.inference_mode():
        want = fused.chain(firsts, contexts, table, levels, reference)

    def drafter(on: PagedKVCache) -> DraftLMLevels:
        requests = [SimpleNamespace(num_computed=c - 1, draft_state=c) for c in contexts]
        blocks = SimpleNamespace(block_size=cache.block_size)  # `_run`'s step metadata reads the block size alone
        levels_of = DraftLMLevels(model, on, cast(BlockManager, blocks), cast(list[Request], requests))
        levels_of.slots = table  # each request's slots, as `_catch_up` looks them up
        return levels_of

    with torch.inference_mode():
        got = drafter(cache)._chain_by_levels(firsts, contexts, levels)
        late = drafter(late_cache)._chain_by_levels(firsts, [c + 1 for c in contexts], levels)
    assert got == want and [len(t) for t in got] == levels
    assert late != got
    assert (cache.kv - reference.kv).abs().max() < TOLERANCE


def test_a_chain_level_is_a_draft_lm_forward_step() -> None:
    """`specpipe_cpu::draft_lm_chain_level` (one level of sampled chains: the caller draws
    between levels) gives the logits and writes the K/V of one `draft_lm_forward` step of
    one token per request at its next position, bit for bit; fed one position late, other
    logits."""
    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    contexts, fed = [9, 30, 17], [3, 7, 11]
    cache = prefilled(model, contexts)
    reference = copy_of(cache)
    table = [slots(r, SPAN) for r in range(len(contexts))]
    with torch.inference_mode():
        assert fused.takes_chain_level()
        got = fused.chain_level(fed, contexts, table, cache)
        late = fused.chain_level(fed, [c + 1 for c in contexts], table, copy_of(cache))
        segments = [Segment(i, c, slots(i, c + 1)) for i, c in enumerate(contexts)]
        step = step_input(torch.tensor(fed), torch.tensor(contexts), segments, torch.arange(len(fed)), "cpu")
        want = fused(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, reference)
    assert want is not None and torch.equal(got, want) and not torch.equal(late, got)
    assert torch.equal(cache.kv, reference.kv)


def test_the_sampled_chain_is_its_levels_drawn_one_at_a_time() -> None:
    """`specpipe_cpu::draft_lm_sampled_chain` (sampled chains, every level in one call) draws
    the tokens, returns the laws and writes the K/V of its levels taken one at a time in
    Python: each level's law the one definition of a warp (`target_probs` at the request's
    temperature), its draw `inverse_cdf_rows` at the request's uniform, the next level one
    `draft_lm_chain_level`; bit for bit, for requests of different temperatures and
    depths. Given the roots in place of their logits, it feeds them as its first level: the
    same draws, laws and cache. Fed one position late (RoPE and the keys one slot off),
    other draws or laws."""
    from runtime.sampling import SamplingParams, inverse_cdf_rows, target_probs

    model = draft_lm()
    fused = Int8DraftLM.of(model)
    assert fused is not None
    contexts, levels, roots = [9, 30, 17], [4, 1, 6], [3, 7, 11]
    temperatures = [1.0, 0.6, 1.7]
    cache = prefilled(model, contexts)
    reference = copy_of(cache)
    table = [slots(r, SPAN) for r in range(len(contexts))]
    uniforms = torch.rand(len(roots), max(levels), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    from_roots = copy_of(cache)
    with torch.inference_mode():
        first = fused.chain_level(roots, contexts, table, cache)  # the roots' logits (what `first()` gives)
        reference.kv.copy_(cache.kv)
        starts = [c + 1 for c in contexts]
        result = fused.sampled_chain(first, None, starts, table, levels, temperatures, uniforms, cache)
        assert result is not None
        drawn, laws = result
        # the roots fed as the op's first level: the same draws, laws and cache
        rooted = fused.sampled_chain(None, roots, starts, table, levels, temperatures, uniforms, from_roots)
        assert rooted is not None and torch.equal(rooted[0], drawn) and torch.equal(rooted[1], laws)
        assert torch.equal(from_roots.kv, cache.kv)
        late_starts = [s + 1 for s in starts]
        late = fused.sampled_chain(first, None, late_starts, table, levels, temperatures, uniforms, copy_of(cache))
        assert late is not None
        want_tokens: list[list[int]] = [[] for _ in roots]
        want_laws = torch.zeros_like(laws)
        active, logits = list(range(len(roots))), first
        for j in range(max(levels)):
            probs = torch.cat([target_probs(logits[k : k + 1], SamplingParams(temperature=temperatures[r]))
                               for k, r in enumerate(active)])  # fmt: skip
            tokens = inverse_cdf_rows(probs, uniforms[active, j]).tolist()
            for k, (r, token) in enumerate(zip(active, tokens, strict=True)):
                want_tokens[r].append(token)
                want_laws[r, j + 1] = probs[k]
            going = [k for k, r in enumerate(active) if j + 1 < levels[r]]
            if not going:
                break
            active = [active[k] for k in going]
            fed = [tokens[k] for k in going]
            logits = fused.chain_level(fed, [starts[r] + j for r in active], [table[r] for r in active], reference)
    assert [row[:n] for row, n in zip(drawn.tolist(), levels, strict=True)] == want_tokens
    assert all(row[n:] == [-1] * (max(levels) - n) for row, n in zip(drawn.tolist(), levels, strict=True))
    assert torch.equal(laws, want_laws)
    assert torch.equal(cache.kv, reference.kv)
    assert not (torch.equal(late[0], drawn) and torch.equal(late[1], laws))
