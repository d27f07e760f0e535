"""`specpipe::paged_attention`: the reference against a dense per-row oracle, the Triton kernel
against the reference, and the kernel's batch invariance (bitwise) on ragged batches of decode
rows, prefill chunk rows and draft-tree rows whose ancestors sit at scattered slots.

On the CPU test device the kernel runs on CPU tensors under the Triton interpreter, which must
be on before the plugin's kernels are decorated (tests/conftest.py sets it; so does this module)."""

from __future__ import annotations

import os

from tests.device import ON_CPU, TEST_DEVICE

if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from plugins.paged_attention import (
    BLOCK_N,
    _paged_attention_reference,
    paged_attention,
    paged_attention_triton,
)

DEVICE = TEST_DEVICE  # SPECPIPE_TEST_DEVICE: "cpu" (kernels in the interpreter) or "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Case(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    row_request: torch.Tensor
    row_prefix: torch.Tensor
    row_tree: torch.Tensor
    row_len: torch.Tensor
    block_size: int


def ancestors(parents: list[int], node: int) -> list[int]:
    """Ancestors of `node` in a packed tree, root first, `node` last."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def make_case(
    rows: list[tuple[int, int, list[int]]],  # (request, row_prefix, tree indices)
    request_tokens: list[int],
    h: int = 4,
    h_kv: int = 2,
    d: int = 16,
    dtype: torch.dtype = torch.float32,
    block_size: int = 4,
    seed: int = 0,
) -> Case:
    """Random q/K/V; each request's blocks are a random scatter over the pool."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(request_tokens) // block_size)
    num_blocks = len(request_tokens) * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(request_tokens) * max_blocks]
    num_slots = num_blocks * block_size
    width = max(1, *(len(t) for _, _, t in rows))
    row_tree = torch.full((len(rows), width), -1, dtype=torch.int32)
    for n, (_, _, tree) in enumerate(rows):
        row_tree[n, : len(tree)] = torch.tensor(tree, dtype=torch.int32)
    meta = [
        block_tables.view(len(request_tokens), max_blocks),
        torch.tensor([r for r, _, _ in rows]),
        torch.tensor([p for _, p, _ in rows]),
        row_tree,
        torch.tensor([p + len(t) for _, p, t in rows]),
    ]
    return Case(
        torch.randn(len(rows), h, d, generator=gen).to(DEVICE, dtype),
        torch.randn(num_slots, h_kv, d, generator=gen).to(DEVICE, dtype),
        torch.randn(num_slots, h_kv, d, generator=gen).to(DEVICE, dtype),
        *(m.to(DEVICE, torch.int32) for m in meta),
        block_size,
    )


def ragged_rows() -> tuple[list[tuple[int, int, list[int]]], list[int]]:
    """Rows of four requests, interleaved: a draft tree (context 10, 5 nodes), a decode token
    (13 keys: over 3 block boundaries), a prefill chunk (context 5, 4 tokens) and a tree over a
    long context (66 keys before it: the kernel needs two BLOCK_N steps)."""
    parents = [-1, 0, 0, 1, 3]
    tree = [(2, 10, [10 + a for a in ancestors(parents, i)]) for i in range(5)]
    decode = [(0, 13, [])]
    chunk = [(1, 5 + t + 1, []) for t in range(4)]
    long_parents = [-1, 0, 0]
    long_tree = [(3, 66, [66 + a for a in ancestors(long_parents, i)]) for i in range(3)]
    rows = tree[:2] + decode + chunk[:2] + long_tree + tree[2:] + chunk[2:]
    return rows, [13, 9, 15, 69]


def visible_indices(case: Case, n: int) -> list[int]:
    prefix, length = int(case.row_prefix[n]), int(case.row_len[n])
    return list(range(min(prefix, length))) + case.row_tree[n, : max(0, length - prefix)].tolist()


def oracle(case: Case, gqa: str = "group") -> torch.Tensor:
    """Per row: gather the visible keys explicitly, repeat KV heads, dense SDPA in fp32."""
    h, h_kv = case.q.shape[1], case.k_cache.shape[1]
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    for n in range(case.q.shape[0]):
        r = int(case.row_request[n])
        index = visible_indices(case, n)
        if not index:
            continue
        slots = [int(case.block_tables[r, i // case.block_size]) * case.block_size + i % case.block_size for i in index]
        k = case.k_cache[slots].float().cpu().transpose(0, 1)  # [H_kv, S, D]
        v = case.v_cache[slots].float().cpu().transpose(0, 1)
        heads = torch.arange(h) // (h // h_kv) if gqa == "group" else torch.arange(h) % h_kv
        q = case.q[n].float().cpu()[:, None]  # [H, 1, D]
        out[n] = F.scaled_dot_product_attention(q, k[heads], v[heads])[:, 0]
    return out


GQA = [(4, 2), (6, 2), (2, 2)]
DTYPES = [torch.float32, torch.bfloat16]
# with the tree-vs-decode test (H=4, H_kv=2, both dtypes) and the MHA test: every GQA shape and dtype
KERNEL_CASES = [(4, 2, torch.float32), (6, 2, torch.bfloat16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "h_kv"), GQA)
def test_reference_matches_dense_oracle(h: int, h_kv: int, dtype: torch.dtype) -> None:
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens, h=h, h_kv=h_kv, dtype=dtype)
    out = _paged_attention_reference(*case)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float().cpu(), oracle(case), atol=TOL[dtype], rtol=TOL[dtype])


def test_wrong_variants_are_caught() -> None:
    """The oracle tells an off-by-one prefix and a wrong GQA head mapping apart."""
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens)
    out = _paged_attention_reference(*case).cpu()
    assert not torch.allclose(out, oracle(case, gqa="modulo"), atol=1e-2)
    chunk_rows = [n for n, (r, _, _) in enumerate(rows) if r == 1]
    shifted = case._replace(row_prefix=case.row_prefix + 1, row_len=case.row_len + 1)  # sees one future token
    assert not torch.allclose(out[chunk_rows], oracle(shifted)[chunk_rows], atol=1e-2)
    torch.testing.assert_close(out, oracle(case), atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize(("h", "h_kv", "dtype"), KERNEL_CASES)
def test_kernel_matches_reference(h: int, h_kv: int, dtype: torch.dtype) -> None:
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens, h=h, h_kv=h_kv, dtype=dtype, seed=1)
    out = paged_attention_triton(*case)
    assert out.dtype == dtype and out.shape == case.q.shape
    ref = _paged_attention_reference(*case)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernel_mha_small_head_dim_and_block_size() -> None:
    """One query head per KV head, head_dim 8 (padded to 16 for tl.dot), block_size 16."""
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens, h=2, h_kv=2, d=8, block_size=16, seed=2)
    torch.testing.assert_close(paged_attention_triton(*case), _paged_attention_reference(*case), atol=2e-5, rtol=2e-5)


def test_op_dispatches_on_the_device() -> None:
    """On CPU the op is the reference, on CUDA the Triton kernel."""
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens, seed=3)
    expected = paged_attention_triton(*case) if DEVICE == "cuda" else _paged_attention_reference(*case)
    assert torch.equal(paged_attention(*case), expected)


def single_row(case: Case, n: int) -> Case:
    """Row n alone: its request's block table only, its tree entries only."""
    r = int(case.row_request[n])
    tree_len = max(1, int(case.row_len[n]) - int(case.row_prefix[n]))
    return case._replace(
        q=case.q[n : n + 1].clone(),
        block_tables=case.block_tables[r : r + 1].clone(),
        row_request=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        row_prefix=case.row_prefix[n : n + 1].clone(),
        row_tree=case.row_tree[n : n + 1, :tree_len].clone(),
        row_len=case.row_len[n : n + 1].clone(),
    )


def test_kernel_row_alone_equals_row_in_batch_bitwise() -> None:
    rows, tokens = ragged_rows()
    case = make_case(rows, tokens, dtype=torch.bfloat16, seed=4)
    batch = paged_attention_triton(*case)
    kinds = {rows[n][0]: n for n in range(len(rows))}  # one row of each request: tree, decode, chunk, long tree
    assert int(case.row_len[kinds[3]]) > BLOCK_N  # it takes more than one key block
    for n in kinds.values():
        assert torch.equal(paged_attention_triton(*single_row(case, n)), batch[n : n + 1]), n


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_tree_row_equals_decode_row_bitwise(dtype: torch.dtype) -> None:
    """Tree node 5 of request 0 (ancestors 0, 2, 5 at scattered slots after a 67-token context)
    and a decode token of request 1 holding the same K/V at contiguous indices 0 .. 69."""
    context, parents = 67, [-1, 0, 0, 1, 2, 2]
    path = [context + a for a in ancestors(parents, 5)]
    assert path == [context, context + 2, context + 5]
    rows = [(1, 40, []), (0, context, path), (2, 3, [5, 9]), (1, context + 3, [])]
    case = make_case(rows, [context + 6, context + 3, 12], dtype=dtype, seed=5)

    def slot(r: int, i: int) -> int:
        return int(case.block_tables[r, i // case.block_size]) * case.block_size + i % case.block_size

    for i_b, i_a in enumerate([*range(context), *path]):
        for cache in (case.k_cache, case.v_cache):
            cache[slot(1, i_b)] = cache[slot(0, i_a)]
    case.q[3] = case.q[1]
    out = paged_attention_triton(*case)
    assert torch.equal(out[1], out[3])
    assert torch.equal(paged_attention_triton(*single_row(case, 1)), paged_attention_triton(*single_row(case, 3)))
    assert not torch.equal(out[0], out[3])
    torch.testing.assert_close(out.float(), _paged_attention_reference(*case).float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_padding_rows_output_zeros() -> None:
    rows, tokens = [(0, 0, []), (0, 5, [7]), (1, 0, [])], [9, 4]
    case = make_case(rows, tokens, seed=6)
    for out in (_paged_attention_reference(*case), paged_attention_triton(*case)):
        assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
        torch.testing.assert_close(out[1].cpu(), oracle(case)[1], atol=2e-5, rtol=2e-5)
    empty = case._replace(
        **{f: getattr(case, f)[:0] for f in ("q", "row_request", "row_prefix", "row_tree", "row_len")}
    )
    assert paged_attention_triton(*empty).shape == (0, 4, 16)
    assert _paged_attention_reference(*empty).shape == (0, 4, 16)


def test_opcheck() -> None:
    rows, tokens = [(0, 6, []), (1, 2, [4, 6]), (0, 3, [])], [7, 7]
    case = make_case(rows, tokens, d=8)
    case = case._replace(**{f: getattr(case, f).cpu() for f in Case._fields[:-1]})
    torch.library.opcheck(paged_attention, tuple(case))


def test_bad_inputs_are_refused() -> None:
    rows, tokens = [(0, 6, []), (1, 2, [4, 6])], [7, 7]
    case = make_case(rows, tokens)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(*case._replace(q=case.q[:, :3]))
    with pytest.raises(ValueError, match="must be int32"):
        paged_attention(*case._replace(block_tables=case.block_tables.long()))
    with pytest.raises(ValueError, match=r"row_len .* must be \[N\]"):
        paged_attention(*case._replace(row_len=case.row_len[:1]))
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        paged_attention(*case._replace(row_tree=case.row_tree[:, :0]))
    with pytest.raises(ValueError, match="one floating dtype"):
        paged_attention(*case._replace(k_cache=case.k_cache.double()))
    with pytest.raises(ValueError, match="tree keys"):  # a value check: the reference only
        _paged_attention_reference(*case._replace(row_len=case.row_len + 1))
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(*case._replace(block_size=0))
    odd = make_case(rows, tokens, d=12)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention_triton(*odd)
