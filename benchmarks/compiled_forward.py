"""Does `torch.compile` (inductor) make the target's forward faster? The same forward, one
request after `--context` cached positions, `--tokens` new tokens (1: an auto-regressive
step; 8 and 40: batch-8 steps and their trees), run five ways:

- `c++ op`: what the engine runs on the CPU (`plugins/llama_forward.py`'s `FusedTarget`:
  the whole forward in one C++ call, the few-row products on `plugins/fp32_linear.py`);
- `eager`: the model's own forward (`LlamaForCausalLM.forward` over a `PagedBatch`) on the
  engine's weights, as the engine runs it where the op stands aside (and on a GPU, where
  CUDA graphs replay it);
- `eager, plain`: the same on plain weights (every blocked copy dropped: `F.linear`);
- `inductor`: `torch.compile(dynamic=True)` of that plain forward, one graph (the custom ops
  traced through their fake kernels); inductor brings its own GEMMs and fuses the small
  ops between them;
- `inductor, frozen`: the same with inductor's `freezing` (the weights taken as constants,
  prepacked for oneDNN at compile time: inductor's own blocked copies).

    python -m benchmarks.compiled_forward                    # demo target, 1 / 8 / 40 tokens
    python -m benchmarks.compiled_forward --tokens 1,6,16 --device cuda

Each row: the median milliseconds of a forward (after warm-up), the first call's seconds
(the compile, for `inductor`), and the largest |logit - eager's| with whether every
argmax is eager's. Writes `<out>.json` and `<out>.md`. Compiling the engine's own weights
(the blocked copies) is not a row: its logits were off by up to ~9 (demo target, torch
2.13), though each product and norm compiled alone agreed; the cause was not found.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.report import command, machine, write_report
from model_defs.llama import MLP, Attention, Linear, LlamaForCausalLM
from model_defs.paged_kv_cache import PagedBatch, PagedKVCache
from plugins.llama_forward import FusedTarget
from runtime.attention_batch import Segment
from runtime.loaded_engine import LoadedEngine
from runtime.model_runner import StepInput
from runtime.step_batch import step_input

Forward = Callable[[LlamaForCausalLM, PagedKVCache, StepInput], torch.Tensor]


def model_forward(model: LlamaForCausalLM, cache: PagedKVCache, step: StepInput) -> torch.Tensor:
    """Logits `[1, N, V]` of `model`'s own forward of `step` over `cache`."""
    paged = PagedBatch(cache, step.slots, step.attention)
    return model(step.tokens[None], step.positions[None], paged, logits_indices=step.logits_indices[None]).logits


def plain(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """`model` with every blocked and stacked copy of its weights dropped (in place): its
    products are `F.linear` on the weights themselves, what inductor can see and replace."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed = m.small = None
        elif isinstance(m, Attention):
            m.qkv_stack = None
        elif isinstance(m, MLP):
            m.gate_up_stack = None
    return model


def prepared(model: LlamaForCausalLM, n: int, context: int, seed: int = 0) -> tuple[PagedKVCache, StepInput]:
    """A cache holding `context` positions of random tokens (prefilled by `model`) and the
    step of the `n` tokens after them, one request, causal."""
    gen = torch.Generator().manual_seed(seed)
    device = model.lm_head.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (context + n,), generator=gen)
    cache = model.new_kv_cache((context + n) // 16 + 2, 16)
    slots = torch.arange(context + n)
    prefill = step_input(tokens[:context], torch.arange(context), [Segment(0, 0, slots[:context])],
                         torch.arange(context), device, 16)  # fmt: skip
    model_forward(model, cache, prefill.to(device))
    step = step_input(tokens[context:], torch.arange(context, context + n), [Segment(0, context, slots)],
                      torch.arange(n), device, 16)  # fmt: skip
    return cache, step.to(device)


def timed(fn: Callable[[], torch.Tensor], repeats: int, sync: Callable[[], None]) -> tuple[torch.Tensor, float, float]:
    """(first call's output, its seconds, median seconds of `repeats` calls after two more)."""
    start = time.perf_counter()
    out = fn()
    sync()
    first = time.perf_counter() - start
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return out, first, statistics.median(times)


def measure(engine_dir: Path, tokens: list[int], context: int, repeats: int, device: str) -> list[dict[str, Any]]:
    """One row per token count and way of running the forward."""
    with torch.inference_mode():  # as the engine runs (the C++ op stands aside under autograd)
        return _measure(engine_dir, tokens, context, repeats, device)


def _measure(engine_dir: Path, tokens: list[int], context: int, repeats: int, device: str) -> list[dict[str, Any]]:
    engine = LoadedEngine.load(engine_dir, device=device)
    model, bare = engine.model, plain(LoadedEngine.load(engine_dir, device=device).model)
    fused = FusedTarget.of(model)
    compiled: Forward = torch.compile(model_forward, dynamic=True)
    frozen_forward: Forward = torch.compile(lambda *args: model_forward(*args), dynamic=True)  # (a code object of
    # its own: compiled code is cached per code object, and `model_forward`'s is `compiled`'s)

    def frozen(model: LlamaForCausalLM, cache: PagedKVCache, step: StepInput) -> torch.Tensor:
        with torch._inductor.config.patch(freezing=True):  # read when a call compiles
            return frozen_forward(model, cache, step)

    def c_op(model: LlamaForCausalLM, cache: PagedKVCache, step: StepInput) -> torch.Tensor:
        out = (
            fused(step.tokens, step.positions, step.slots, step.attention, step.logits_indices, cache)
            if fused
            else None
        )
        if out is None:
            raise SystemExit("error: the target's C++ forward does not take this step (see plugins/llama_forward.py)")
        return out.logits

    ways: dict[str, tuple[Forward, LlamaForCausalLM]] = {
        "eager": (model_forward, model),
        "eager, plain": (model_forward, bare),
        "inductor": (compiled, bare),
        "inductor, frozen": (frozen, bare),
    }
    if fused is not None:
        ways = {"c++ op": (c_op, model)} | ways
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    rows = []
    for n in tqdm(tokens, desc="token counts"):
        cache, step = prepared(model, n, context)
        reference = model_forward(model, cache, step)
        for way, (forward, weights) in ways.items():
            out, first, median = timed(partial(forward, weights, cache, step), repeats, sync)
            rows.append({
                "tokens": n,
                "way": way,
                "ms": round(median * 1e3, 3),
                "first_call_s": round(first, 3),
                "max_abs_diff": float((out - reference).abs().max()),
                "same_argmax": bool((out.argmax(-1) == reference.argmax(-1)).all()),
            })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The target's forward: the C++ op, eager, and torch.compile (inductor)",
        "",
        f"Engine `{meta['engine']}` on {meta['device']}, one request after {meta['context']} cached positions, median "
        f"of {meta['repeats']} forwards after warm-up; first call: the compile, for inductor (dynamic shapes: later "
        "token counts reuse it). |diff|: the largest |logit - eager's|. "
        f"Command: `{meta['command']}`",
        "",
        "| tokens | way | ms | x eager | first call s | max abs diff | argmax == eager |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = {r["tokens"]: r["ms"] for r in rows if r["way"] == "eager"}
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['way']} | **{r['ms']:.3f}** | {r['ms'] / eager[r['tokens']]:.2f} "
            f"| {r['first_call_s']:.2f} | {r['max_abs_diff']:.1e} | {'yes' if r['same_argmax'] else '**NO**'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/demo-redrafter"), help="(default: %(default)s)")
    ap.add_argument("--tokens", default="1,8,40", help="new tokens per forward, comma-separated (default: %(default)s)")
    ap.add_argument("--context", type=int, default=128, help="cached positions before them (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=30, help="timed forwards per row (default: %(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_forward"), help="output path stem")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    if min(tokens) < 1 or args.context < 1 or args.repeats < 1:
        ap.error("--tokens, --context and --repeats must be >= 1")
    if not (args.engine / "config.json").exists():
        ap.error(f"no engine at {args.engine} (make engine builds the demo engines)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    rows = measure(args.engine, tokens, args.context, args.repeats, args.device)
    meta = {"engine": str(args.engine), "device": args.device, "context": args.context, "repeats": args.repeats,
            "command": command("benchmarks.compiled_forward", argv), "machine": machine()}  # fmt: skip
    write_report(args.out, meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
