"""CUDA graphs for the target forward: captured once per token-count bucket, replayed.

A step of N new tokens (decode tokens, draft trees, prefill chunks of any mix) runs the
graph of the smallest bucket >= N. The graph reads fixed device buffers: tokens,
positions, write slots, the row-form attention metadata (`RowMetadata`) and the logits
rows. A step copies its inputs into the first N rows and pads the rest with inert rows:
token 0 at position 0, writing its K/V to the cache's scratch slot and attending to one
key, logits at row 0; their outputs are dropped. The attention kernel reads each row's
key count from the metadata buffers, so one graph serves every context length.

Steps the graphs do not cover run eagerly: more tokens than the largest bucket, more
requests or longer block tables than the buffers hold, deeper trees than `max_tree`.
Under tensor parallelism the forwards stay eager (each rank would need to capture its
all-reduces in the same order).
"""

from __future__ import annotations

from typing import Any

import torch

from model_defs.llama import LlamaForCausalLM, LlamaOutput
from model_defs.paged_kv_cache import Attention, PagedBatch, PagedKVCache, RowMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token counts a graph is captured for (those up to the step token budget)."""


class CudaGraphs:
    """Captured forwards of `model` over `cache`, one per bucket of token counts.

    The graphs' inputs live in two device buffers (int64: tokens, positions, write slots,
    logits rows; int32: the row metadata), each mirrored by a pinned host buffer: a step
    is packed on the host and reaches the device in two asynchronous copies."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        max_requests: int,
        max_blocks: int,
        max_tree: int,
        max_tokens: int,
    ) -> None:
        self.model, self.cache = model, cache
        self.buckets = [b for b in BUCKETS if b <= max_tokens] or [BUCKETS[0]]
        n, device = self.buckets[-1], cache.kv.device
        self.max_requests, self.max_blocks, self.max_tree = max_requests, max_blocks, max_tree
        self.host64 = torch.zeros(4, n, dtype=torch.long, pin_memory=True)
        self.host32 = torch.zeros(max_requests * max_blocks + n * (3 + max_tree), dtype=torch.int32, pin_memory=True)
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        self._pack(self.host64, self.host32, 0, n)  # all padding: what the captures run on
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        self._copied = torch.cuda.Event()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, LlamaOutput]] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.graphs[b] = self._capture(b, pool)

    def _views(self, buf32: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, RowMetadata]:
        """(block_tables, row_tree, metadata of the first b rows) over an int32 buffer."""
        n, r, w = self.buckets[-1], self.max_requests, self.max_blocks
        tables = buf32[: r * w].view(r, w)
        rows = buf32[r * w : r * w + 3 * n].view(3, n)
        tree = buf32[r * w + 3 * n :].view(n, self.max_tree)
        meta = RowMetadata(tables, rows[0, :b], rows[1, :b], tree[:b], rows[2, :b], self.cache.block_size)
        return tables, tree, meta

    def _pack(self, host64: torch.Tensor, host32: torch.Tensor, n: int, b: int) -> None:
        """Padding rows n .. b-1: token 0 at position 0 writing the scratch slot, logits at
        row 0, attending to key 0 of request 0 (a real slot: row 0 of the block tables is
        always a real table or the scratch block's)."""
        host64[0, n:b] = 0
        host64[1, n:b] = 0
        host64[2, n:b] = self.cache.scratch_slot
        _, _, meta = self._views(host32, b)
        meta.row_request[n:] = 0
        meta.row_prefix[n:] = 1
        meta.row_len[n:] = 1
        if n == 0:
            host64[3, :b] = 0
            meta.block_tables.fill_(self.cache.scratch_slot // self.cache.block_size)
            meta.row_tree.fill_(-1)

    def _forward(self, b: int) -> LlamaOutput:
        _, _, meta = self._views(self.dev32, b)
        paged = PagedBatch(self.cache, self.dev64[2, :b], meta)
        tokens, positions, rows = self.dev64[0, :b][None], self.dev64[1, :b][None], self.dev64[3, :b][None]
        return self.model(tokens, positions, paged, logits_indices=rows)

    @torch.inference_mode()
    def _capture(self, b: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, LlamaOutput]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(b)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(b)
        return graph, out

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def fits(self, num_tokens: int, meta: Attention) -> bool:
        """A step the graphs can run: row form, within the buckets and the buffers."""
        if not isinstance(meta, RowMetadata):
            return False
        r, w = meta.block_tables.shape
        return (
            self.bucket(num_tokens) is not None
            and r <= self.max_requests
            and w <= self.max_blocks
            and meta.row_tree.shape[1] <= self.max_tree
        )

    @torch.inference_mode()
    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: Attention, rows: torch.Tensor
    ) -> LlamaOutput:
        """Replay the bucket's graph on this step (host tensors; `fits` must hold): logits
        `[1, K, V]` at `rows` `[K]`, hidden `[1, N, D]` — copies, so the next replay cannot
        change them."""
        assert isinstance(meta, RowMetadata)
        n, k = tokens.shape[0], rows.shape[0]
        b = self.bucket(n)
        assert b is not None
        self._copied.synchronize()  # the last step's copies have left the pinned buffers
        h64, h32 = self.host64, self.host32
        h64[0, :n], h64[1, :n], h64[2, :n], h64[3, :k] = tokens, positions, slots, rows
        h64[3, k:b] = 0
        tables, tree, view = self._views(h32, b)
        r, w = meta.block_tables.shape
        t = meta.row_tree.shape[1]
        tables[:r, :w] = meta.block_tables
        view.row_request[:n], view.row_prefix[:n], view.row_len[:n] = meta.row_request, meta.row_prefix, meta.row_len
        tree[:n, :t] = meta.row_tree
        self._pack(h64, h32, n, b)
        self.dev64.copy_(h64, non_blocking=True)
        self.dev32.copy_(h32, non_blocking=True)
        self._copied.record()
        graph, out = self.graphs[b]
        graph.replay()
        return LlamaOutput(out.logits[:, :k].clone(), out.hidden[:, :n].clone())
