"""Where a decoding run's time goes, kernel by kernel: torch.profiler over one timed run
per (method, batch), after a warm-up and an untimed run, on held-out prompts at T=0.

For each (method, batch) it prints the run's wall time, steps and tok/s, how its target
forwards ran (the captured graph of which token bucket, or eagerly and why: no graphs, or
the step does not fit them), then two torch.profiler tables: the top device kernels by
device time (GPU only) and the top host ops by their own time. `make profile`
(`benchmarks/step_profile.py`) splits steps by engine phase; this says which kernels and
host calls fill a phase. An H200 run of 2026-11-27 is `benchmarks/results/torch_profile_h200_s19.txt`
(cuBLAS's fp32 GEMM for 8 rows at ~40 us a call: `plugins/gpu_linear.py`).

    python -m benchmarks.torch_profile --device cuda --runs ar:1 ar:8 redrafter:8
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import round_params, warm_up
from runtime import model_runner
from runtime.config import RuntimeConfig
from runtime.cuda_graphs import CudaGraphs
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.proposers import level_drafters
from training.corpus import heldout_prompts


@contextlib.contextmanager
def counting_forwards() -> Iterator[collections.Counter[str]]:
    """Within the block, count each target or draft-LM forward by how it runs: "graph bN"
    (the replay of bucket N's graph) or "eager: why"."""
    calls: collections.Counter[str] = collections.Counter()
    real_run, real_forward = CudaGraphs.run, model_runner.forward

    def run(self: CudaGraphs, tokens: torch.Tensor, *args: Any) -> Any:
        calls[f"graph b{self.bucket(tokens.shape[0])}"] += 1
        return real_run(self, tokens, *args)

    def forward(model: Any, cache: Any, step: model_runner.StepInput, graphs: Any = None, fused: Any = None) -> Any:
        n = step.tokens.shape[0]
        if graphs is None:
            calls["eager: no graphs (CPU, tensor parallel or --enforce-eager)"] += 1
        elif not graphs.fits(n, step.attention):
            calls[f"eager: {n} tokens do not fit the graphs (largest bucket {graphs.buckets[-1]})"] += 1
        return real_forward(model, cache, step, graphs, fused)

    CudaGraphs.run = run  # type: ignore[method-assign,assignment]
    model_runner.forward = level_drafters.forward = forward
    try:
        yield calls
    finally:
        CudaGraphs.run = real_run  # type: ignore[method-assign]
        model_runner.forward = level_drafters.forward = real_forward


def profile_run(
    llm: LLMEngine, prompts: list[list[int]], method: str, tokens: int, calls: collections.Counter[str]
) -> str:
    """The report of one (method, batch): `calls` is `counting_forwards`' counter."""
    batch, cuda = len(prompts), llm.engine.device.type == "cuda"
    warm_up(llm, prompts[0], method, 0.0)
    llm.generate(prompts, round_params(batch, tokens, 0.0, 0), method)
    calls.clear()
    steps = llm.clock.steps
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, round_params(batch, tokens, 0.0, 1), method)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out = sum(len(r.output_ids) for r in results)
    lines = [
        f"== {method} batch {batch}: {seconds * 1e3:.1f} ms, {llm.clock.steps - steps} steps, {out / seconds:.0f} tok/s"
    ]
    lines += [f"   {n:5d} {how}" for how, n in calls.most_common(8)]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, round_params(batch, tokens, 0.0, 2), method)
    table = prof.key_averages()
    if cuda:
        lines.append(table.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    lines.append(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.torch_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engine", default="engines/demo-redrafter", help="engine dir (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)")
    ap.add_argument(
        "--runs", nargs="+", default=["ar:1", "ar:8", "redrafter:8"], help="method:batch pairs (default: %(default)s)"
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--stdlib-root", type=Path, help="where the held-out prompt files are (as in device_sweep)")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    runs = []
    for run in args.runs:
        method, _, batch = run.partition(":")
        if not batch.isdigit() or int(batch) < 1:
            ap.error(f"--runs {run!r}: expected method:batch, e.g. ar:8")
        runs.append((method, int(batch)))
    loaded = LoadedEngine.load(args.engine, device=args.device)
    prompts = [loaded.encode(t) for t in heldout_prompts(max(b for _, b in runs), args.stdlib_root)]
    cuda = loaded.device.type == "cuda"
    report = [f"# {args.engine} on {torch.cuda.get_device_name() if cuda else 'the CPU'}"]
    with counting_forwards() as calls:
        for method, batch in runs:
            llm = LLMEngine(loaded, RuntimeConfig(max_batch_size=batch))
            report.append(profile_run(llm, prompts[:batch], method, args.max_tokens, calls))
            print(report[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
