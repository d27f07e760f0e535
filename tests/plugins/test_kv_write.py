"""`specpipe::rope_kv_write` (plugins/kv_write.py): the C++ kernel gives the plain-torch
reference's bits (queries returned, keys and values in the cache, every other slot
untouched), a wrong rotation fails the comparison, bad arguments are refused with the fix,
and a paged forward through the fused path equals the split one."""

from __future__ import annotations

import pytest
import torch

from model_defs.llama import Attention, pack_cpu_weights
from model_defs.rope import RopeConfig, RotaryEmbedding
from plugins import cpu_kernels
from plugins.cpu_linear import pack_cpu_weight
from plugins.kv_write import rope_kv_write, rope_kv_write_reference, write_new_tokens
from tests.paged import Chunk, PagedModel
from tests.tiny_models import tiny_target

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")


def case(n: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.randint(0, 900, (1, n), generator=gen)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0, head_dim=d))(positions, torch.float32)
    k_cache, v_cache = torch.randn(2, 64, kv_heads, d, generator=gen).unbind(0)
    slots = torch.randperm(64, generator=gen)[:n]
    return qkv, cos[0], sin[0], k_cache, v_cache, slots


@needs_kernels
@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "d"), [(1, 6, 2, 64), (5, 4, 2, 64), (17, 6, 2, 64), (40, 2, 1, 32)]
)
def test_cpu_kernel_gives_the_references_bits(n: int, heads: int, kv_heads: int, d: int) -> None:
    qkv, cos, sin, k_cache, v_cache, slots = case(n, heads, kv_heads, d, seed=n)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = rope_kv_write_reference(qkv, cos, sin, k_ref, v_ref, slots, heads)
    got = torch.ops.specpipe_cpu.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, heads)
    assert got.shape == (n, heads, d)
    assert torch.equal(got, want) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], case(n, heads, kv_heads, d, seed=n)[3][untouched])
    # a rotation with the halves' signs swapped (rotate_half the other way) is caught
    half = d // 2
    q = qkv[:, : heads * d].view(n, heads, d)
    wrong = q * cos[:, None] + torch.cat((q[..., half:], -q[..., :half]), -1) * sin[:, None]
    assert not torch.allclose(got, wrong)


@needs_kernels
def test_custom_op_routes_and_opcheck() -> None:
    args = case(7, 6, 2, 64, seed=3)
    qkv, cos, sin, k_cache, v_cache, slots = args
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = rope_kv_write_reference(qkv, cos, sin, k_ref, v_ref, slots, 6)
    assert torch.equal(write_new_tokens(*args, 6), want) and torch.equal(k_cache, k_ref)
    assert torch.equal(rope_kv_write(*case(7, 6, 2, 64, seed=3), 6), want)
    torch.library.opcheck(rope_kv_write, (*case(7, 6, 2, 64, seed=3), 6))
    torch.library.opcheck(torch.ops.specpipe_cpu.rope_kv_write.default, (*case(7, 6, 2, 64, seed=3), 6))


def test_other_dtypes_take_the_reference() -> None:
    qkv, cos, sin, k_cache, v_cache, slots = (t.double() if t.is_floating_point() else t for t in case(4, 4, 2, 32, 1))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = rope_kv_write_reference(qkv, cos, sin, k_ref, v_ref, slots, 4)
    assert torch.equal(rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, 4), want)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_kernels
def test_bad_arguments_are_refused() -> None:
    qkv, cos, sin, k_cache, v_cache, slots = case(3, 6, 2, 64, seed=0)
    with pytest.raises(ValueError, match=r"must be \[N, \(H \+ 2 H_kv\) D\]"):
        rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, 4)  # wrong head count
    with pytest.raises(RuntimeError, match="out of range"):
        write_new_tokens(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 64]), 6)
    with pytest.raises(RuntimeError, match="one slot per row"):
        write_new_tokens(qkv, cos, sin, k_cache, v_cache, slots[:2], 6)


@needs_kernels
def test_a_paged_forward_through_the_fused_path_equals_the_split_one() -> None:
    """`Attention` takes `PagedBatch.attend_projected` (fused RoPE + K/V write) when its q/k/v
    run as one stacked product; without the stack it splits, rotates and writes in torch.
    The split products run on each Linear's own blocked copy (bitwise the stacked product's
    here). Same tokens, same cache: same logits, bit for bit, and the same K/V in the cache (the
    second forward reads the first's), for decode rows, a prefill chunk and a tree."""
    model = tiny_target(seed=5, vocab_size=64)
    pack_cpu_weights(model)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    stacks = [m.qkv_stack for m in attentions]
    assert all(s is not None for s in stacks)
    gen = torch.Generator().manual_seed(0)
    prompt, tree = torch.randint(0, 64, (2, 9), generator=gen), torch.randint(0, 64, (5,), generator=gen)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    outputs = []
    for fused in (True, False):
        for m, s in zip(attentions, stacks, strict=True):
            m.qkv_stack = s if fused else None
            for proj in (m.q_proj, m.k_proj, m.v_proj):  # split: each its own blocked product
                proj.packed = None if fused else pack_cpu_weight(proj.weight.detach())
        paged = PagedModel(model, num_blocks=16, block_size=4)
        first = paged.forward([Chunk(f"r{i}", 0, prompt[i], torch.arange(9)) for i in range(2)])
        second = paged.forward(
            [
                Chunk("r0", 9, tree, 9 + torch.tensor([0, 1, 1, 2, 2]), mask),
                Chunk("r1", 9, tree[:1], torch.tensor([9])),
            ]
        )
        outputs.append([o.logits for o in (*first, *second)])
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)
