"""`specpipe::token_info_top_k` (plugins/token_info_top_k.py): the C++ kernel picks the same
children as the plain-torch reference (gather, hot-token bias, log-softmax, top-k) with
log-probabilities within fp32 rounding, for hot and cold previous tokens, no table at all,
rows of every length (vector bodies and tails), strided chain rows like Lyanna's `[B, k, V]`
and widths 1..16; a wrong variant (the bias left out) is caught; other dtypes take the
reference. `token_info_trees` builds through it, and the Lyanna greedy and chi-square
suites test it end to end. `specpipe::token_info_chain` (width 1, every depth in one call)
picks the chains of its reference and of the per-depth op, ties included; a table left out
or read at the root's token only is caught."""

from __future__ import annotations

import pytest
import torch

from model_defs.lyanna import HotTokenTable
from plugins import cpu_kernels
from plugins.token_info_top_k import (
    best_chains,
    kernel_applies,
    token_info_chain,
    token_info_chain_reference,
    token_info_top_k,
    token_info_top_k_reference,
    top_children,
)
from runtime.proposers.lyanna import token_info_trees

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")


def table_of(v: int, hot: int, gen: torch.Generator) -> HotTokenTable:
    hot_ids = torch.randperm(v, generator=gen)[:hot]
    hot_index = torch.full((v,), -1, dtype=torch.long)
    hot_index[hot_ids] = torch.arange(hot)
    return HotTokenTable(hot_ids, hot_index, torch.randn(hot, hot, generator=gen) * 2)


def case(b: int, depth: int, m: int, v: int, hot: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    chain = torch.randn(b, depth + 1, v, generator=gen) * 3
    table = table_of(v, hot, gen)
    owners = torch.randint(0, b, (m,), generator=gen)
    prev = torch.randint(0, v, (m,), generator=gen)
    prev[: m // 2] = table.hot_ids[torch.randint(0, hot, (m // 2,), generator=gen)]  # half hot, the rest mostly cold
    return chain[:, depth], owners, table.hot_index[prev], table.hot_ids, table.table


@needs_kernels
@pytest.mark.parametrize(
    ("b", "m", "v", "hot", "k"),
    [
        (1, 1, 8192, 2048, 4),
        (1, 4, 8192, 2048, 4),
        (8, 32, 8192, 2048, 4),
        (3, 7, 1003, 100, 1),
        (2, 5, 37, 9, 16),
        (4, 9, 5, 3, 5),
    ],
)
def test_cpu_kernel_picks_the_references_children(b: int, m: int, v: int, hot: int, k: int) -> None:
    args = case(b, 1, m, v, hot, seed=m * v + k)
    assert args[0].stride() == (2 * v, 1)  # a depth of [B, k, V] chain rows
    assert kernel_applies(args[0], args[4], k)
    want_values, want_children = token_info_top_k_reference(*args, k)
    values, children = torch.ops.specpipe_cpu.token_info_top_k(*args, k)
    assert torch.equal(children, want_children)
    torch.testing.assert_close(values, want_values, rtol=0, atol=2e-6)
    assert torch.equal(token_info_top_k(*args, k)[1], want_children)  # the custom op takes the kernel too


@needs_kernels
def test_no_table_and_a_dropped_bias_is_caught() -> None:
    rows, owners, hot_rows, hot_ids, table = case(2, 0, 6, 500, 200, seed=3)
    cold = (torch.full_like(hot_rows, -1), hot_ids[:0], table.new_zeros(0, 0))
    plain = torch.log_softmax(rows[owners], -1).topk(4, -1)
    values, children = top_children(rows, owners, *cold, 4)
    assert torch.equal(children, plain.indices)
    torch.testing.assert_close(values, plain.values, rtol=0, atol=2e-6)
    biased = top_children(rows, owners, hot_rows, hot_ids, table, 4)[1]
    assert not torch.equal(biased, children)  # the bias moves the children: leaving it out shows


def test_other_dtypes_take_the_reference() -> None:
    rows, owners, hot_rows, hot_ids, table = case(2, 0, 6, 300, 50, seed=4)
    assert not kernel_applies(rows.double(), table, 4)
    values, children = top_children(rows.double(), owners, hot_rows, hot_ids, table, 4)
    assert values.dtype == torch.float32 and torch.equal(
        children, token_info_top_k_reference(rows, owners, hot_rows, hot_ids, table, 4)[1]
    )


def test_trees_from_a_hot_table_are_the_dense_biass_trees() -> None:
    """`token_info_trees` given the table itself (the op) builds the trees it builds given
    `HotTokenTable.bias` as a plain callable (the reference's bias, then log-softmax, top-k)."""
    gen = torch.Generator().manual_seed(9)
    v, batch = 300, 5
    table = table_of(v, 120, gen)
    logits = torch.randn(batch, 3, v, generator=gen) * 3
    roots = [int(t) for t in table.hot_ids[:batch]]
    fast = token_info_trees(roots, logits, table, width=4, budget=12)
    plain = token_info_trees(roots, logits, table.bias, width=4, budget=12)
    assert [(t.tokens, t.parents) for t in fast] == [(t.tokens, t.parents) for t in plain]


def chain_case(b: int, depth: int, v: int, hot: int, seed: int, ties: bool = False) -> tuple:
    """`[B, depth, V]` chain rows (integers where `ties`: many equal best logits), roots half
    hot, and a table."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, depth, v, generator=gen) * 3
    if ties:
        logits = logits.round()
    table = table_of(v, hot, gen)
    if ties:
        table = HotTokenTable(table.hot_ids, table.hot_index, table.table.round())
    roots = torch.randint(0, v, (b,), generator=gen)
    roots[: b // 2 + 1] = table.hot_ids[torch.randint(0, hot, (b // 2 + 1,), generator=gen)]
    return logits, roots, table.hot_index, table.hot_ids, table.table


def per_depth(logits: torch.Tensor, roots: torch.Tensor, hot_index: torch.Tensor, hot_ids, table) -> torch.Tensor:
    """The chains as Lyanna drafted them before the chain op: `top_children` at k = 1 a depth."""
    owners, prev, picks = torch.arange(len(roots)), roots, []
    for d in range(logits.shape[1]):
        hot_rows = hot_index[prev] if hot_index.numel() else torch.full_like(prev, -1)
        prev = top_children(logits[:, d], owners, hot_rows, hot_ids, table, 1)[1][:, 0]
        picks.append(prev)
    return torch.stack(picks, dim=1)


@needs_kernels
@pytest.mark.parametrize(
    ("b", "depth", "v", "hot", "ties"),
    [(1, 3, 8192, 2048, False), (8, 3, 8192, 2048, False), (3, 5, 1003, 100, False), (5, 4, 37, 9, True),
     (4, 6, 300, 120, True), (2, 1, 5, 3, False)],
)  # fmt: skip
def test_chain_kernel_picks_the_references_chains(b: int, depth: int, v: int, hot: int, ties: bool) -> None:
    """`specpipe::token_info_chain` (every depth in one C++ call) picks the chains of the
    reference and of the per-depth op the proposer called before it, ties included (integer
    logits: the smaller index, as `token_info_top_k`)."""
    args = chain_case(b, depth, v, hot, seed=b * v + depth, ties=ties)
    got = torch.ops.specpipe_cpu.token_info_chain(*args)
    assert got.shape == (b, depth) and torch.equal(got, per_depth(*args))
    assert torch.equal(token_info_chain(*args), got)  # the custom op takes the kernel
    if not ties:  # (torch's top-k leaves the order of ties open)
        assert torch.equal(token_info_chain_reference(*args), got)
    torch.library.opcheck(token_info_chain, args)


@needs_kernels
def test_chain_without_a_table_and_a_dropped_bias_is_caught() -> None:
    """No table: each pick is its row's argmax. A chain op that left the table out, or read
    the root's table row at every depth, would pick other chains (each checked)."""
    logits, roots, hot_index, hot_ids, table = chain_case(6, 4, 200, 150, seed=5)
    plain = best_chains(logits, roots, hot_index[:0], hot_ids[:0], table.new_zeros(0, 0))
    assert torch.equal(plain, logits.argmax(-1))
    biased = best_chains(logits, roots, hot_index, hot_ids, table)
    assert not torch.equal(biased, plain)
    owners = torch.arange(len(roots))
    from_root = torch.stack(
        [top_children(logits[:, d], owners, hot_index[roots], hot_ids, table, 1)[1][:, 0] for d in range(4)], dim=1
    )
    assert not torch.equal(biased, from_root)
    assert torch.equal(biased, token_info_chain_reference(logits, roots, hot_index, hot_ids, table))


def test_chains_of_other_dtypes_take_the_reference() -> None:
    logits, roots, hot_index, hot_ids, table = chain_case(3, 3, 120, 40, seed=6)
    want = token_info_chain_reference(logits, roots, hot_index, hot_ids, table)
    assert torch.equal(best_chains(logits.double(), roots, hot_index, hot_ids, table), want)
    assert best_chains(logits[:, :0], roots, hot_index, hot_ids, table).shape == (3, 0)
