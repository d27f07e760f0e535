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

`specpipe::token_info_chain` is width 1 whole (Lyanna's chains): every depth of a batch's
chains in one call, each pick the best child of the last (`token_info_top_k` at k = 1, the
same child; no exp pass), with `token_info_chain_reference` its plain-torch form.
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


def token_info_chain_reference(
    logits: Tensor, roots: Tensor, hot_index: Tensor, hot_ids: Tensor, table: Tensor
) -> Tensor:
    """Plain torch (same arguments and result as `token_info_chain`): `logits` `[B, D, V]`
    chain rows, `roots` `[B]`, `hot_index` `[V]` (a token's table row or -1; empty: no
    table), `hot_ids` `[H]`, `table` `[H, H]` -> `[B, D]`: at each depth d the best child
    (`token_info_top_k_reference` at k = 1) of the last pick under row d."""
    owners = torch.arange(logits.shape[0], device=logits.device)
    prev, picks = roots, []
    for depth in range(logits.shape[1]):
        hot_rows = hot_index[prev] if hot_index.numel() else torch.full_like(prev, -1)
        prev = token_info_top_k_reference(logits[:, depth], owners, hot_rows, hot_ids, table, 1)[1][:, 0]
        picks.append(prev)
    return torch.stack(picks, dim=1) if picks else roots.new_empty(len(roots), 0)


def _chain_fake(logits: Tensor, roots: Tensor, hot_index: Tensor, hot_ids: Tensor, table: Tensor) -> Tensor:
    return roots.new_empty(logits.shape[0], logits.shape[1])


def best_chains(logits: Tensor, roots: Tensor, hot_index: Tensor, hot_ids: Tensor, table: Tensor) -> Tensor:
    """`token_info_chain` by the shortest route: the C++ op (`specpipe_cpu::token_info_chain`,
    plugins/csrc/token_info_top_k_cpu.cpp) where it applies, else the reference. Lyanna's
    chains took a `token_info_top_k` call, a hot-row gather and a read a depth: ~145 us for a
    batch-1 chain of three after a 48 MB read, most of it the calls around ~10 us of work."""
    if (
        logits.shape[1]
        and kernel_applies(logits[:, 0], table, 1)
        and cpu_kernels.load_with_fake("token_info_chain", _chain_fake)
    ):
        return torch.ops.specpipe_cpu.token_info_chain(logits, roots, hot_index, hot_ids, table.contiguous())
    return token_info_chain_reference(logits, roots, hot_index, hot_ids, table)


@torch.library.custom_op("specpipe::token_info_chain", mutates_args=())
def token_info_chain(logits: Tensor, roots: Tensor, hot_index: Tensor, hot_ids: Tensor, table: Tensor) -> Tensor:
    return best_chains(logits, roots, hot_index, hot_ids, table)


token_info_chain.register_fake(_chain_fake)
