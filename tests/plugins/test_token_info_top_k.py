"""`specpipe::token_info_top_k` (plugins/token_info_top_k.py): the C++ kernel picks the same
children as the plain-torch reference (gather, hot-token bias, log-softmax, top-k) with
log-probabilities within fp32 rounding, for hot and cold previous tokens, no table at all,
rows of every length (vector bodies and tails), strided chain rows like Lyanna's `[B, k, V]`
and widths 1..16; a wrong variant (the bias left out) is caught; other dtypes take the
reference. `token_info_trees` builds through it, and the Lyanna greedy and chi-square
suites test it end to end."""

from __future__ import annotations

import pytest
import torch

from model_defs.lyanna import HotTokenTable
from plugins import cpu_kernels
from plugins.token_info_top_k import kernel_applies, token_info_top_k, token_info_top_k_reference, top_children
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
