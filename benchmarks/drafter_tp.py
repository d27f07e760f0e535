"""ReDrafter beam search under tensor parallelism: the drafter replicated on every rank
(ours) vs. sharded across ranks (TensorRT-LLM's layout).

    OMP_NUM_THREADS=1 mpirun --bind-to none -n 2 python -m benchmarks.drafter_tp --engine engines/demo-redrafter

(`--bind-to none`: Open MPI pins each of 2 ranks to one core by default, where gloo's worker
thread then queues behind the main thread: a small all-reduce took 2.3 ms instead of 0.9 ms here.)

Replicated: each rank holds the whole drafter and runs the beam search alone, with no
communication (our runtime runs it on rank 0 only; the drafted trees reach the other ranks
inside the step's `StepInput`). Sharded: every
drafter GEMM (RNN, input projection, residual blocks, vocabulary head) holds 1/tp of its
output columns and its output is all-gathered, so each of the L beam steps pays one
all-gather per GEMM. Same weights, inputs and W x L on both; the sharded beams are checked
against the replicated ones. Reported: median ms per beam search (the slowest rank's time
per iteration) at several batch sizes, and sharded / replicated. Writes `<out>.json` and
`<out>.md` from rank 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model_defs.redrafter import ReDrafter, ResBlock, warp_logits
from runtime.loaded_engine import LoadedEngine
from runtime.proposers.beam_search import beam_search
from runtime.tensor_parallel import exit_process, join_process_group


class ShardedReDrafter(ReDrafter):
    """TensorRT-LLM's layout: each Linear keeps this rank's slice of its output columns
    (`shard`); `step` and `logits` all-gather every GEMM's output before using it."""

    def shard(self, rank: int, world_size: int) -> ShardedReDrafter:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(module.weight.tensor_split(world_size, 0)[rank].contiguous())
                if module.bias is not None:
                    module.bias = nn.Parameter(module.bias.tensor_split(world_size, 0)[rank].contiguous())
        return self

    @staticmethod
    def gather(y: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1)

    def step(self, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        token_emb = token_emb.to(state.dtype)
        return self.gather(F.silu(self.rnn_w(token_emb) + self.rnn_u(state)))

    def logits(self, h_target: torch.Tensor, state: torch.Tensor, warp: bool = True) -> torch.Tensor:
        x = torch.cat([h_target.to(state.dtype), state], dim=-1)
        if self.input_proj is not None:
            x = self.gather(self.input_proj(x))
        *blocks, head = self.lm_head
        for block in blocks:
            assert isinstance(block, ResBlock)
            x = x + F.silu(self.gather(block.linear(x)))
        out = self.gather(head(x))
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        return warp_logits(out) if warp else out


def time_ms(variants: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median over iterations of the slowest rank's time, in ms, per variant. The variants
    alternate iteration by iteration, so background load hits them alike."""
    for fn in variants.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(iters):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, t in times.items():
        slowest = torch.tensor(t, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = statistics.median(slowest.tolist()) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="engine with a drafter")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="rows drafted (default: 1 8 32)")
    ap.add_argument("--beam-width", type=int, default=4, help="beams W (default: %(default)s)")
    ap.add_argument("--beam-length", type=int, default=4, help="draft tokens per beam L (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=30, help="timed beam searches per variant (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/drafter_tp"), help="output path stem")
    args = ap.parse_args()

    rank, world_size = join_process_group()
    engine = LoadedEngine.load(args.engine)  # every rank: the whole drafter and embedding, one source of truth
    drafter, embed = engine.redrafter, engine.model.model.embed_tokens
    assert drafter is not None and drafter.config.rnn, "needs an engine with an RNN ReDrafter drafter"
    sharded = ShardedReDrafter.from_tensors(drafter.config, drafter.state_dict(), drafter.dtype)
    assert isinstance(sharded, ShardedReDrafter)
    sharded.shard(rank, world_size)
    w, length = args.beam_width, args.beam_length

    rows = []
    for b in args.batch_sizes:
        gen = torch.Generator().manual_seed(b)  # same inputs on every rank
        hidden = torch.randn(b, drafter.config.hidden_size, generator=gen)
        bonus = torch.randint(0, drafter.config.vocab_size, (b,), generator=gen)
        with torch.inference_mode():
            same = torch.equal(
                beam_search(drafter, embed, hidden, bonus, w, length).beams,
                beam_search(sharded, embed, hidden, bonus, w, length).beams,
            )
            ms = time_ms(
                {
                    "replicated": lambda: beam_search(drafter, embed, hidden, bonus, w, length),  # noqa: B023
                    "sharded": lambda: beam_search(sharded, embed, hidden, bonus, w, length),  # noqa: B023
                },
                args.iters,
            )
        rows.append(
            {
                "batch_size": b,
                "replicated_ms": round(ms["replicated"], 3),
                "sharded_ms": round(ms["sharded"], 3),
                "sharded_over_replicated": round(ms["sharded"] / ms["replicated"], 3),
                "same_beams": same,
            }
        )
    if rank != 0:
        return
    gemms = 1 + drafter.config.has_input_proj + drafter.config.num_draft_layers + 1
    meta = {
        "engine": str(args.engine),
        "world_size": world_size,
        "backend": dist.get_backend(),
        "beam_width": w,
        "beam_length": length,
        "drafter_dtype": str(drafter.dtype).removeprefix("torch."),
        "all_gathers_per_beam_search": gemms * length,
        "torch_threads_per_rank": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "iters": args.iters,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# ReDrafter beam search under tensor parallelism: replicated vs sharded drafter",
        "",
        f"Engine `{meta['engine']}`, {world_size} ranks ({meta['backend']}, {meta['torch_threads_per_rank']} "
        f"thread(s) each), W={w} L={length}, drafter {meta['drafter_dtype']}. Sharded = TensorRT-LLM's layout, "
        f"{meta['all_gathers_per_beam_search']} all-gathers per beam search. Median of {args.iters} runs, "
        "slowest rank, the two variants alternating.",
        "",
        "| batch | replicated ms | sharded ms | sharded / replicated | same beams |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | {r['replicated_ms']:.2f} | {r['sharded_ms']:.2f} | "
            f"{r['sharded_over_replicated']:.2f}x | {r['same_beams']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
    exit_process(0)
