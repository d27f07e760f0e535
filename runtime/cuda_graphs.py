"""CUDA graphs: the target's (and a draft LM's) forwards captured once per token-count
bucket and replayed (`CudaGraphs`); any other fixed-shape device work, such as ReDrafter's
beam search, captured per shape on its first call (`CapturedCalls`).

A step of N new tokens (decode tokens, draft trees, prefill chunks of any mix) runs the
graph of the smallest bucket >= N. The graph reads fixed device buffers: tokens,
positions, write slots, the row-form attention metadata (`RowMetadata`) and the logits
rows. A step copies its inputs into the first N rows and pads the rest with inert rows:
token 0 at position 0, writing its K/V to the cache's scratch slot and attending to one
key, logits at row 0; their outputs are dropped. The attention kernel reads each row's
key count from the metadata buffers, so one graph serves every context length.

Each bucket of up to `gpu_linear.MAX_ROWS` tokens is captured twice, its linears on
cuBLAS and as `plugins/gpu_linear.py` (per product shape, cuBLAS or a split-K Triton
matmul, whichever is faster: cuBLAS's fp32 kernels for 8-16 rows of some shapes take
~10x what others do on an H200), and the graph that replays faster is kept
(`CudaGraphs.linears` says which, per bucket; cuBLAS unless the other saves `TRITON_SAVES`).

Steps the graphs do not cover run eagerly: more tokens than the largest bucket, more
requests or longer block tables than the buffers hold, deeper trees than `max_tree`.
Under tensor parallelism the forwards stay eager (each rank would need to capture its
all-reduces in the same order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model_defs.llama import LlamaForCausalLM, LlamaOutput
from model_defs.paged_kv_cache import Attention, PagedBatch, PagedKVCache, RowMetadata
from plugins import gpu_linear

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token counts a graph is captured for (those up to the step token budget)."""
TRITON_SAVES = 0.1
"""The share of a bucket's replay time the Triton linears must save to be kept: near a
tie cuBLAS stays, so one engine does not flip kernels (and last bits) from start to start."""
TIMED_REPLAYS = 20
"""Replays timed per captured alternative (after 3 untimed)."""


def bucket_of(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket >= n (None: larger than every bucket)."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class GraphLimits:
    """What one engine's captured graphs hold (`EngineCore` sets them from its config and
    hands them to every proposer: `Proposer.capture_graphs`)."""

    max_requests: int
    max_blocks: int
    """Block-table entries of the longest request."""
    max_tree: int
    """Tree columns of a query row (the most draft nodes a step verifies, plus one)."""
    max_tokens: int
    """The step token budget: the largest bucket a forward is captured for."""

    def forwards(self, model: LlamaForCausalLM, cache: PagedKVCache) -> CudaGraphs:
        """`model`'s forwards over `cache`, captured per bucket."""
        return CudaGraphs(model, cache, self.max_requests, self.max_blocks, self.max_tree, self.max_tokens)


class CapturedCalls:
    """Calls of functions of device tensors that never read back to the host: each (key,
    input shapes and dtypes) is captured as one CUDA graph on its first call (after one
    eager warm-up run) and replayed after. A replay copies the inputs into the graph's own
    and returns the graph's outputs, which the next call of the same key overwrites: read
    them first. Past `limit` graphs, new keys run eagerly. All share one memory pool (the
    calls run one at a time on one stream)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def __call__(self, key: Hashable, fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:
        """`fn(*inputs)`, through the graph of `key` (`fn` must be the same function for one key)."""
        full = (key, *((tuple(t.shape), t.dtype) for t in inputs))
        entry = self.graphs.get(full)
        if entry is None:
            if len(self.graphs) >= self.limit:
                return fn(*inputs)
            entry = self.graphs[full] = self._capture(fn, inputs)
        graph, static, outputs = entry
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(
        self, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]
    ) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]]:
        static = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*static)  # warm-up: lazy initialisation, Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static)
        return graph, static, outputs


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
        self.buckets = tuple(b for b in BUCKETS if b <= max_tokens) or BUCKETS[:1]
        n, device = self.buckets[-1], cache.kv.device
        self.max_requests, self.max_blocks, self.max_tree = max_requests, max_blocks, max_tree
        self.host64 = torch.zeros(4, n, dtype=torch.long, pin_memory=True)
        self.host32 = torch.zeros(max_requests * max_blocks + n * (3 + max_tree), dtype=torch.int32, pin_memory=True)
        self.dev64, self.dev32 = self.host64.to(device), self.host32.to(device)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()  # views of the pinned memory
        self._pack(self.np64, self.np32, 0, n)  # all padding: what the captures run on
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        self._copied = torch.cuda.Event()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, LlamaOutput]] = {}
        self.linears: dict[int, str] = {}
        """Per bucket, the linears its graph runs: "cublas" or "triton" (`plugins/gpu_linear.py`)."""
        self.replay_ms: dict[int, dict[str, float]] = {}
        """Per bucket captured both ways, each alternative's measured replay time (ms, padding rows)."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.graphs[b] = self._capture_fastest(b, pool)

    def _capture_fastest(self, b: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, LlamaOutput]:
        """Bucket b's graph with cuBLAS's linears, and with `gpu_linear`'s where it applies (at
        most `gpu_linear.MAX_ROWS` rows, not in batch-invariant mode, whose linears are
        `bi_linear` already): the one `faster_linears` keeps. A Triton capture that fails is
        logged and left out."""
        captured = {"cublas": self._capture(b, pool)}
        if (
            b <= gpu_linear.MAX_ROWS
            and gpu_linear.applies(self.model.lm_head.weight)
            and not self.model.batch_invariant
        ):
            self.model.set_triton_linears(True)
            try:
                captured["triton"] = self._capture(b, pool)
            except Exception as e:  # any failure of the alternative leaves cuBLAS's graph
                log.warning("bucket %d: capturing the forward with Triton linears failed, cuBLAS's kept: %r", b, e)
            finally:
                self.model.set_triton_linears(False)
        if len(captured) > 1:  # one alternative alone needs no timing
            self.replay_ms[b] = {kind: _replay_ms(graph) for kind, (graph, _) in captured.items()}
        self.linears[b] = faster_linears(self.replay_ms.get(b, {}))
        return captured[self.linears[b]]

    def _views(self, buf32: torch.Tensor, b: int) -> RowMetadata:
        """The row metadata of the first b rows over the device's int32 buffer."""
        n, r, w = self.buckets[-1], self.max_requests, self.max_blocks
        tables = buf32[: r * w].view(r, w)
        rows = buf32[r * w : r * w + 3 * n].view(3, n)
        tree = buf32[r * w + 3 * n :].view(n, self.max_tree)
        return RowMetadata(tables, rows[0, :b], rows[1, :b], tree[:b], rows[2, :b], self.cache.block_size)

    def _pack(self, host64: np.ndarray, host32: np.ndarray, n: int, b: int) -> None:
        """Padding rows n .. b-1: token 0 at position 0 writing the scratch slot, logits at
        row 0, attending to key 0 of request 0 (a real slot: row 0 of the block tables is
        always a real table or the scratch block's)."""
        host64[0:2, n:b] = 0
        host64[2, n:b] = self.cache.scratch_slot
        tables, rows, tree = self._host_views(host32)
        rows[0, n:b] = 0  # row_request
        rows[1:, n:b] = 1  # row_prefix, row_len
        if n == 0:
            host64[3, :b] = 0
            tables.fill(self.cache.scratch_slot // self.cache.block_size)
            tree.fill(-1)

    def _host_views(self, host32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block_tables, rows [request, prefix, len], row_tree) over the pinned int32
        buffer, as numpy views: a step is packed with ~15 slice assignments, ~0.5 us each in
        numpy against ~4 us as torch ops."""
        n, r, w = self.buckets[-1], self.max_requests, self.max_blocks
        return (
            host32[: r * w].reshape(r, w),
            host32[r * w : r * w + 3 * n].reshape(3, n),
            host32[r * w + 3 * n :].reshape(n, self.max_tree),
        )

    def _forward(self, b: int) -> LlamaOutput:
        meta = self._views(self.dev32, b)
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
        return bucket_of(num_tokens, self.buckets)

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
        change them. `tokens` may be on the graphs' device instead (a draft LM's chain fed
        its last level's draws: `DraftLMLevels.chain_level_at`): copied there after the
        packed inputs, in stream order, with no wait for them on the host."""
        assert isinstance(meta, RowMetadata)
        n, k = tokens.shape[0], rows.shape[0]
        b = self.bucket(n)
        assert b is not None
        on_device = tokens.device.type != "cpu"
        self._copied.synchronize()  # the last step's copies have left the pinned buffers
        h64 = self.np64
        h64[0, :n] = 0 if on_device else tokens.numpy()
        h64[1, :n], h64[2, :n], h64[3, :k] = positions.numpy(), slots.numpy(), rows.numpy()
        h64[3, k:b] = 0
        tables, meta_rows, tree = self._host_views(self.np32)
        r, w = meta.block_tables.shape
        t = meta.row_tree.shape[1]
        tables[:r, :w] = meta.block_tables.numpy()
        meta_rows[0, :n], meta_rows[1, :n], meta_rows[2, :n] = (
            meta.row_request.numpy(),
            meta.row_prefix.numpy(),
            meta.row_len.numpy(),
        )
        tree[:n, :t] = meta.row_tree.numpy()
        tree[:n, t:] = -1
        self._pack(h64, self.np32, n, b)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self._copied.record()
        if on_device:
            self.dev64[0, :n].copy_(tokens)
        graph, out = self.graphs[b]
        graph.replay()
        return LlamaOutput(out.logits[:, :k].clone(), out.hidden[:, :n].clone())


def faster_linears(replay_ms: dict[str, float]) -> str:
    """The linears a bucket keeps from each alternative's replay time: "triton" where both
    were timed and it saves `TRITON_SAVES` of cuBLAS's time, else "cublas"."""
    triton, cublas = replay_ms.get("triton"), replay_ms.get("cublas")
    return "triton" if triton is not None and cublas is not None and triton < (1 - TRITON_SAVES) * cublas else "cublas"


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds per replay of `graph` (`TIMED_REPLAYS` after 3 untimed, the device
    waited for at both ends)."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / TIMED_REPLAYS
