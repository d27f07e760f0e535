"""`specpipe::token_info_top_k`: one depth of Lyanna's token-info sampling (Algorithm 1 of
"Make Every Draft Count") for every frontier node of a batch: node m's logits are its chain
row `rows[owners[m]]` plus, where its token is hot (`hot_rows[m] >= 0`), that row of the
hot-token table at the hot columns (`HotTokenTable.bias`, §6.1); the op returns each node's
`k` best children and their log-probabilities log_softmax(l_i + E'(token))[child].

`token_info_top_k_reference` is the plain-torch form (a gather, `HotTokenTable.bias`'s
clone and index_add_, a log_softmax over `[M, V]`, a top-k: ~1.3 ms a depth for 32 nodes of
8192 logits on 2 cores). On the CPU a C++ kernel (`plugins/csrc/token_info_top_k_cpu.cpp`)
builds each node's row once, keeps its k best in one pass and sums its exps in a second,
a vector of the CPU's width at a time: the same children (the smaller index first on
ties, where torch's top-k leaves the order open), log-probabilities within fp32 rounding
of torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plugins import cpu_kernels

MAX_K = 16
"""Most children per node the kernel keeps (Lyanna's widths are a few)."""


def token_info_top_k_reference(
    rows: Tensor, owners: Tensor, hot_rows: Tensor, hot_ids: Tensor, table: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """Plain torch (same arguments and result as the op): `rows` `[R, V]` chain rows,
    `owners` `[M]` each node's row, `hot_rows` `[M]` its table row or -1, `hot_ids` `[H]`,
    `table` `[H, H]` -> (log-probabilities `[M, k]` descending, children `[M, k]`)."""
    x = rows[owners].float()
    hit = (hot_rows >= 0).nonzero().squeeze(-1)
    if hit.numel():
        x[hit] = x[hit].index_add_(1, hot_ids, table[hot_rows[hit]].to(x.dtype))
    top = torch.log_softmax(x, dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def _kernel_built() -> bool:
    """Build and load the CPU kernels (once); the C++ op gets this op's fake."""
    return cpu_kernels.load_with_fake("token_info_top_k", _fake)


def kernel_applies(rows: Tensor, table: Tensor, k: int) -> bool:
    """Whether `specpipe_cpu::token_info_top_k` takes these (and is built): fp32 CPU rows with
    contiguous rows, an fp32 table, k <= `MAX_K`."""
    return (
        rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and rows.stride(-1) == 1
        and table.dtype == torch.float32
        and 1 <= k <= min(MAX_K, rows.shape[-1])
        and _kernel_built()
    )


def top_children(
    rows: Tensor, owners: Tensor, hot_rows: Tensor, hot_ids: Tensor, table: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    """`token_info_top_k` by the shortest route (no custom-op dispatch): the C++ op itself
    where it applies, else the reference."""
    if kernel_applies(rows, table, k):
        return torch.ops.specpipe_cpu.token_info_top_k(rows, owners, hot_rows, hot_ids, table.contiguous(), k)
    return token_info_top_k_reference(rows, owners, hot_rows, hot_ids, table, k)


@torch.library.custom_op("specpipe::token_info_top_k", mutates_args=())
def token_info_top_k(
    rows: Tensor, owners: Tensor, hot_rows: Tensor, hot_ids: Tensor, table: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    return top_children(rows, owners, hot_rows, hot_ids, table, k)


@token_info_top_k.register_fake
def _fake(
    rows: Tensor, owners: Tensor, hot_rows: Tensor, hot_ids: Tensor, table: Tensor, k: int
) -> tuple[Tensor, Tensor]:
    m = owners.shape[0]
    return rows.new_empty(m, k, dtype=torch.float32), rows.new_empty(m, k, dtype=torch.long)
