"""Generate text from an engine directory.

    python -m runtime.generate --engine engines/demo --prompt "def fib(n):" --max-tokens 64
    python -m runtime.generate --engine engines/demo-redrafter --method redrafter --beam-width 4 ...
    python -m runtime.generate --engine engines/demo-draft-lm --method rsd-c --branching 2,2,1,1 ...

An engine built with --tp-size N runs under `mpirun -n N python -m runtime.generate ...`:
rank 0 schedules, drafts and prints, the other ranks run their shards of each forward.

Several --prompt flags are decoded together as one batch. Temperature 0 (the default)
is greedy decoding; --temperature/--top-k/--top-p/--seed sample. Speculative methods
emit exactly what auto-regressive decoding would (greedy) or the same distribution
(sampling); they only change how many target forwards it takes. --stop ends each text
before the first stop string, with finish reason "stop": tokens become text through the
output stage the servers use (`runtime/output.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, deque
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from runtime.engine_dir import EngineConfig
from runtime.llm_engine import EngineDeadError, LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.output import RequestOutput
from runtime.proposers.registry import METHODS
from runtime.proposers.rsd import parse_branching
from runtime.request import RequestEvent
from runtime.results import tokens_per_step
from runtime.runtime_args import add_runtime_args, runtime_config
from runtime.sampling import SamplingParams
from runtime.tensor_parallel import exit_process, init_tensor_parallel, rank_device, serve_worker, start_workers


def run(
    engine: LoadedEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    args: argparse.Namespace,
    world_size: int,
) -> tuple[list[RequestOutput], float]:
    """Rank 0's generation, each request through its output stage, and its seconds (start-up
    calibration excluded, like engine loading); with tensor parallelism it drives the other
    ranks' forwards. Requests are queued as fast as the waiting queue takes them."""
    overrides = {
        "beam_width": args.beam_width,
        "beam_length": args.beam_length,
        "branching": args.branching,
        "packing": args.packing,
        "depth": args.lyanna_depth,
        "width": args.lyanna_width,
        "budget": args.lyanna_budget,
        "resample": args.lyanna_resample,
        "fuse": args.lyanna_fuse,
        "num_draft_tokens": args.ngram_num_draft_tokens,
        "max_ngram": args.ngram_max,
        "min_ngram": args.ngram_min,
    }
    with ExitStack() as stack:
        config, broadcast = runtime_config(args), None
        if world_size > 1:
            config, broadcast = stack.enter_context(start_workers(engine, config))
        outputs = [RequestOutput(engine.tokenizer, args.stop or ()) for _ in prompts]
        llm = LLMEngine(engine, config, broadcast)
        llm.prepare()  # a one-off at start-up, not part of the timed generation
        start = time.perf_counter()
        pending = deque(zip(prompts, params, outputs, strict=True))
        while pending or llm.has_unfinished():
            while pending and llm.stats().waiting < config.max_queue_size:
                prompt, p, output = pending.popleft()
                llm.add_request(prompt, p, args.method, callback=partial(_on_event, llm, output), **overrides)
            llm.step()
        return outputs, time.perf_counter() - start


def _on_event(llm: LLMEngine, output: RequestOutput, event: RequestEvent) -> None:
    """A request's callback: its output stage takes the event; a stop string ends the request."""
    if output.push(event).stop_hit:
        llm.cancel(event.request_id, "stop")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m runtime.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", type=Path, required=True, help="engine directory (from `python -m build.engine`)")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text; repeat to batch several")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus filter, 1.0 = off (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed; request i uses seed + i")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    ap.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop token before this many (default: 0)")
    ap.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="CTRL penalty on prompt+output tokens, 1 = off"
    )
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty, 0 = off")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty, 0 = off")
    ap.add_argument(
        "--bad-word", action="append", default=[], help="text never generated (its tokens); repeat for several"
    )
    ap.add_argument("--logprobs", action="store_true", help="with --json: each output token's log-probability")
    ap.add_argument(
        "--stop", action="append", metavar="TEXT", help="end the text before this string; repeat for several"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    ap.add_argument("--device", default="cpu", help="torch device to run on, e.g. cuda (default: %(default)s)")
    ap.add_argument(
        "--method",
        choices=METHODS,
        help="decoding method: ar; redrafter (beam search, point-mass verification); rsd-c (constant "
        "branching, Gumbel-top-k); rsd-s (stochastic beam search); sd (one sampled chain); lyanna "
        "(hidden-state chain + token info); ngram (prompt lookup, no drafter: any engine). "
        "Default: the engine's (set at build), else ar",
    )
    ap.add_argument("--beam-width", type=int, help="beams per step W of redrafter / rsd-s (default: the engine's)")
    ap.add_argument(
        "--beam-length", type=int, help="draft tokens per beam L of redrafter / rsd-s / sd (default: the engine's)"
    )
    ap.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        help="redrafter on the RNN: verify the prefixes beams share once (default), or every beam apart "
        "(--no-packing: the paper's run without dynamic tree attention)",
    )
    ap.add_argument(
        "--branching",
        type=parse_branching,
        help="rsd-c children per node at each depth, e.g. 2,2,1,1 (default: the engine's)",
    )
    lyanna = ap.add_argument_group("lyanna (defaults: the engine's)")
    lyanna.add_argument("--lyanna-depth", type=int, help="chain steps k = tree depth")
    lyanna.add_argument("--lyanna-width", type=int, help="nodes kept per level")
    lyanna.add_argument("--lyanna-budget", type=int, help="drafted nodes verified per step (B)")
    lyanna.add_argument(
        "--lyanna-resample", action=argparse.BooleanOptionalAction, help="re-sample rejected drafts (Algorithm 2)"
    )
    lyanna.add_argument(
        "--lyanna-fuse",
        action=argparse.BooleanOptionalAction,
        help="verify re-sampled drafts inside the next step's forward (else as the next step's own tree)",
    )
    ngram = ap.add_argument_group("ngram (prompt lookup; defaults: 4 tokens, n-grams of 3 down to 1)")
    ngram.add_argument("--ngram-num-draft-tokens", type=int, help="tokens drafted per step (k)")
    ngram.add_argument("--ngram-max", type=int, help="longest suffix n-gram looked up (tried first)")
    ngram.add_argument("--ngram-min", type=int, help="shortest suffix n-gram looked up")
    add_runtime_args(ap)
    args = ap.parse_args(argv)
    try:
        rank, world_size = init_tensor_parallel(EngineConfig.load(args.engine).build.tp_size, args.device)
        engine = LoadedEngine.load(args.engine, device=rank_device(args.device), rank=rank)
        if rank > 0:
            serve_worker(engine)
            return 0
        params = [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=None if args.seed is None else args.seed + i,
                ignore_eos=args.ignore_eos,
                min_tokens=args.min_tokens,
                repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                bad_words=tuple(tuple(engine.tokenizer.encode(w, add_special_tokens=False).ids) for w in args.bad_word),
                logprobs=args.logprobs,
            )
            for i in range(len(args.prompt))
        ]
        prompts = [engine.encode(p) for p in args.prompt]
        outputs, seconds = run(engine, prompts, params, args, world_size)
    except (ValueError, FileNotFoundError, EngineDeadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = [o.result for o in outputs if o.result is not None]
    for prompt, o in zip(args.prompt, outputs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": o.text,
                        "output_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "error": o.error,
                        "tokens_per_step": o.result.tokens_per_step if o.result else None,
                        "num_drafted": o.stats.num_draft_tokens if o.stats else 0,
                        "num_accepted": o.stats.num_accepted_tokens if o.stats else 0,
                        "tree_sizes": dict(sorted(Counter(o.result.sizes_per_step).items())) if o.result else {},
                        **(
                            {"output_log_probs": o.result.output_log_probs if o.result else []} if args.logprobs else {}
                        ),
                    }
                )
            )
        else:
            print(f"--- prompt: {prompt!r} ({len(o.token_ids)} tokens, {o.finish_reason})")
            if o.error is not None:
                print(f"error: {o.error}", file=sys.stderr)
            print(prompt + o.text, flush=True)
    total = sum(len(r.output_ids) for r in results)
    print(
        f"# {len(results)} prompt(s), {total} tokens in {seconds:.2f} s ({total / seconds:.1f} tokens/s), "
        f"{tokens_per_step(results):.2f} tokens per decoding forward",
        file=sys.stderr,
    )
    return 1 if any(o.finish_reason in ("error", None) for o in outputs) else 0


if __name__ == "__main__":
    exit_process(main())
