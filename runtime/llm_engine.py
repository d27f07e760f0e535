"""The in-flight batching engine: requests join and leave the batch at every step, each
with its own prompt, sampling settings and decoding method.

One `step()`:
1. drop cancelled requests (their KV blocks are freed now);
2. pick this step's drafting width (`runtime/speculation_policy.py`, load-aware);
3. schedule prefill chunks and decoding steps under the token budget (`runtime/scheduler.py`);
4. **draft**: one tree per decoding request (ReDrafter beams; an RSD tree sampled without
   replacement from the RNN drafter or a draft LM, `runtime/rsd.py`; a Lyanna token-info
   tree, `runtime/lyanna.py`; or the root alone for an auto-regressive step);
5. **pack + verify**: all prefill chunks and trees in one flat target forward over the
   paged cache with a block-diagonal tree mask (`runtime/step_batch.py`);
6. **accept** (`runtime/verify.py`), **compact** the accepted path's KV to consecutive
   positions and free the rest of the tree's blocks, **stream** the emitted tokens.

Lossless whatever the batch, the width chosen or the preemptions: every emitted token
comes from `verify.accept` on the target's own logits.

Faults (`step`'s docstring): an exception while serving one request ends that request with
finish reason "error" and frees its blocks; the others go on. An exception that may have
corrupted shared state fails every request in flight; under tensor parallelism, or when
it keeps happening, the engine is dead (`EngineDeadError`) and refuses new requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from runtime.attention_batch import Segment
from runtime.block_manager import BlockManager
from runtime.cuda_graphs import CudaGraphs
from runtime.engine import Engine
from runtime.engine_dir import BuildConfig, EngineConfig
from runtime.faults import FaultInjector
from runtime.kv_budget import KVBudget, kv_cache_blocks
from runtime.level_drafters import DraftLMLevels, RNNLevels
from runtime.lyanna import LyannaParams, merge, resample_subtree, to_draft_tree, token_info_tree
from runtime.model_runner import ModelRunner, StepBroadcast
from runtime.redrafter import ReDrafterParams, draft_trees, max_tree_nodes
from runtime.request import Callback, Request, SpecParams
from runtime.results import GenerationResult, stop_ids
from runtime.rsd import DEFAULT_BRANCHING, RSD_METHODS, TreeSpec, draft_rsd_trees
from runtime.sampling import SamplingParams, next_token
from runtime.scheduler import ScheduledWork, Scheduler
from runtime.speculation_policy import SpeculationPolicy, StepStats
from runtime.step_batch import assemble, step_input
from runtime.verify import Acceptance, DraftTree, accept_batch

log = logging.getLogger(__name__)

METHODS = ("ar", "redrafter", *RSD_METHODS, "lyanna")
DEFAULT_METHOD = {"redrafter": "redrafter", "draft-lm": "sd", "lyanna": "lyanna"}
"""Method of requests that name none, by the engine's drafter kind."""
SPECULATION_MODES = ("load-aware", "fixed")
MAX_STEP_FAILURES = 3
"""Steps in a row that may fail as a whole (every request in flight failed) before the
engine declares itself dead: a fault that survives a clean slate will not go away."""


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a failed forward under tensor parallelism left the
    ranks out of step, or every step fails); restart the process to recover."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Serving-time limits (TensorRT-LLM executor / vLLM engine-argument equivalents)."""

    max_batch_size: int | None = None
    """Most running requests; default (None): the engine's build limit."""
    max_num_tokens: int = 512
    """Most new tokens in one forward (prefill chunks + draft trees), the step's token budget."""
    max_draft_tokens: int = 64
    """Most drafted tokens a request may ask for per step (tree nodes besides the root)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv: KVBudget = field(default_factory=KVBudget)
    """How much memory the KV cache gets."""
    max_queue_size: int = 256
    """Most waiting requests; more are refused at once (QueueFullError)."""
    speculation: str = "load-aware"
    """"load-aware": choose the drafting width per step from the batch and measured step
    costs (down to none); "fixed": always draft the request's own width."""
    cuda_graphs: bool = True
    """On a GPU, replay captured target forwards (`runtime/cuda_graphs.py`); False = eager
    (vLLM's --enforce-eager)."""
    batch_invariant: bool = False
    """Target forwards whose per-token result does not depend on how many tokens share
    them (`LlamaForCausalLM.set_batch_invariant`), so bf16/fp16 speculative greedy output
    equals bf16/fp16 auto-regressive greedy output. Off by default: on the CPU it costs
    2.75x per 1-token forward (bf16 demo target)."""

    def batch_limit(self, build: BuildConfig) -> int:
        """Running requests this engine may hold: `max_batch_size`, or the build's limit."""
        limit = self.max_batch_size or build.max_batch_size
        if limit > build.max_batch_size:
            raise ValueError(
                f"max_batch_size {limit} > the engine's build limit {build.max_batch_size}; "
                "rebuild with a larger --max-batch-size"
            )
        return limit

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation {self.speculation!r} is not one of {SPECULATION_MODES}")
        for name in ("max_num_tokens", "max_draft_tokens", "block_size", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_tokens <= self.max_draft_tokens:
            raise ValueError(
                f"max_num_tokens {self.max_num_tokens} must exceed max_draft_tokens {self.max_draft_tokens}: "
                "one full draft tree has to fit in a step"
            )


def check_request(config: EngineConfig, prompt: list[int], params: SamplingParams) -> None:
    """Reject requests the engine was not built for, with the limit and the fix (needs only
    the engine's config, so front ends can check before forwarding)."""
    build = config.build
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    if len(prompt) > build.max_input_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens > max_input_len {build.max_input_len}; "
            "rebuild with a larger --max-input-len"
        )
    if len(prompt) + params.max_tokens > build.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > max_seq_len {build.max_seq_len}; "
            "lower max_tokens or rebuild with a larger --max-seq-len"
        )
    vocab = config.model["vocab_size"]
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop token ids {list(params.stop_token_ids)} must be in [0, {vocab}) (the vocabulary)")


def tree_nodes(request: Request, width: int) -> int:
    """Most tree nodes (root included) a decoding step of `request` at `width` writes."""
    spec = request.spec
    if width == 0 or spec is None:
        return 1
    if isinstance(spec, TreeSpec | LyannaParams):
        return spec.max_nodes
    return max_tree_nodes(width, spec.beam_length)


def full_width(request: Request, policy_width: int) -> int:
    """Drafting width of a decoding request: ReDrafter beams follow the load-aware policy;
    an RSD or Lyanna tree (width 1 = its whole tree) is drafted whole, or not at all (0)
    when the step's token budget cannot hold it."""
    spec = request.spec
    if spec is None:
        return 0
    return min(policy_width, spec.beam_width) if isinstance(spec, ReDrafterParams) else 1


@dataclass(frozen=True)
class EngineStats:
    """What `LLMEngine.stats` reports."""

    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int
    dead: str | None
    """Why the engine cannot step any more; None while it can."""


class LLMEngine:
    """Owns the paged KV cache, the scheduler and the model runner of one loaded engine."""

    def __init__(self, engine: Engine, config: RuntimeConfig | None = None, broadcast: StepBroadcast | None = None):
        self.engine = engine
        self.config = config = config or RuntimeConfig()
        self.max_batch_size = config.batch_limit(engine.config.build)
        num_blocks = kv_cache_blocks(engine, config.kv, config.block_size, self.max_batch_size, config.max_draft_tokens)
        self.blocks = BlockManager(num_blocks, config.block_size)
        cache = engine.model.new_kv_cache(num_blocks, config.block_size)
        engine.model.set_batch_invariant(config.batch_invariant)
        graphs = None
        if config.cuda_graphs and engine.device.type == "cuda" and broadcast is None:
            graphs = CudaGraphs(
                engine.model,
                cache,
                max_requests=self.max_batch_size,
                max_blocks=self.blocks.blocks_for(engine.config.build.max_seq_len + config.max_draft_tokens + 1),
                max_tree=config.max_draft_tokens + 1,
                max_tokens=config.max_num_tokens,
            )
        self.runner = ModelRunner(engine.model, cache, broadcast, graphs)
        # a draft LM's own cache, same blocks and slots as the target's (rank 0 only drafts)
        draft = engine.draft_model
        self.draft_cache = draft.new_kv_cache(num_blocks, config.block_size) if draft is not None else None
        self.scheduler = Scheduler(self.blocks, self.max_batch_size, config.max_num_tokens, config.max_queue_size)
        settings = engine.config.drafter.settings if engine.config.drafter else {}
        self.policy = SpeculationPolicy(
            adaptive=config.speculation == "load-aware", length=settings.get("beam_length", ReDrafterParams.beam_length)
        )
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self.faults = FaultInjector.from_env()
        self.dead: str | None = None
        """Why the engine cannot step any more (None while it can)."""
        self._failed_steps = 0
        if self.policy.adaptive and engine.drafter is not None:
            self._calibrate()

    def _calibrate(self) -> None:
        """Seed the load-aware cost fits with a few timed forwards and beam searches (like
        vLLM's profiling run). The forwards write into free blocks only."""
        device, d = self.engine.device, self.engine.model.config.hidden_size
        capacity = self.blocks.num_blocks * self.blocks.block_size
        for n in (1, 16, 64, 256):
            n = min(n, self.config.max_num_tokens, capacity)
            step = step_input(
                torch.zeros(n, dtype=torch.long),
                torch.arange(n),
                [Segment(0, 0, torch.arange(n))],
                torch.arange(n),
                device,
                self.blocks.block_size,
            )
            for _ in range(2):
                start = time.perf_counter()
                self.runner.execute(step)
                self.policy.forward_cost.add(n, time.perf_counter() - start)
        drafter, embed = self.engine.drafter, self.engine.model.model.embed_tokens
        assert drafter is not None
        for rows in (1, 8, 32):
            hidden = torch.zeros(rows, d, dtype=self.engine.model.lm_head.weight.dtype, device=device)
            for _ in range(2):
                start = time.perf_counter()
                draft_trees(drafter, embed, hidden, [0] * rows, 1, self.policy.length, False)
                self.policy.draft_cost.add(rows, time.perf_counter() - start)

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        method: str | None = None,
        callback: Callback | None = None,
        request_id: str | None = None,
        **overrides: Any,
    ) -> Request:
        """Queue a request. Raises ValueError for a request the engine cannot serve and
        QueueFullError when the waiting queue is full (nothing is queued then), and
        EngineDeadError once the engine cannot step any more."""
        check_request(self.engine.config, prompt, params)
        method = method or self.default_method
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(
            request_id,
            list(prompt),
            params,
            method,
            self._spec(method, overrides),
            params.generator(self.engine.device),
            stop_ids(params, self.engine.eos_token_ids),
            callback,
        )
        with self._lock:  # servers add from their own threads while step() runs
            if self.dead is not None:
                raise EngineDeadError(f"engine is down ({self.dead}); restart the server")
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self.scheduler.add(request)
            self._requests[request_id] = request
        return request

    @property
    def default_method(self) -> str:
        drafter = self.engine.config.drafter
        return drafter.settings.get("method", DEFAULT_METHOD[drafter.kind]) if drafter else "ar"

    def _spec(self, method: str, overrides: dict[str, Any]) -> SpecParams | None:
        """The request's drafting parameters: the engine's defaults, then its overrides
        (beam_width, beam_length, branching)."""
        if method == "ar":
            return None
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
        drafter = self.engine.config.drafter
        if drafter is None:
            raise ValueError(
                f"method {method!r} needs a drafter; rebuild the engine with --drafter or --draft-model, or use ar"
            )
        settings = asdict(ReDrafterParams()) | {"branching": DEFAULT_BRANCHING} | drafter.settings
        settings |= {k: v for k, v in overrides.items() if v is not None}
        if (method == "lyanna") != (drafter.kind == "lyanna"):
            raise ValueError(f"method {method!r} does not run on this engine's {drafter.kind} drafter")
        if method == "lyanna":
            lyanna = LyannaParams(**{f.name: settings[f.name] for f in fields(LyannaParams) if f.name in settings})
            if lyanna.max_nodes - 1 > self.config.max_draft_tokens:
                raise ValueError(
                    f"lyanna verifies up to {lyanna.max_nodes - 1} drafted tokens per step, more than "
                    f"max_draft_tokens {self.config.max_draft_tokens}"
                )
            return lyanna
        beams = ReDrafterParams(settings["beam_width"], settings["beam_length"])
        spec: SpecParams
        if method == "redrafter" and drafter.kind == "redrafter":
            spec, drafted = beams, beams.beam_width * beams.beam_length
        else:
            spec = TreeSpec.for_method(method, beams.beam_width, beams.beam_length, tuple(settings["branching"]))
            drafted = spec.max_nodes - 1
        if drafted > self.config.max_draft_tokens:
            raise ValueError(
                f"{method} with {settings} drafts {drafted} tokens, more than max_draft_tokens "
                f"{self.config.max_draft_tokens} per step"
            )
        return spec

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early; its KV blocks are freed and its final event sent at the next
        step, with finish reason `reason` ("cancelled", or "stop" when an output stage
        found a stop string)."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"a request is ended early as 'cancelled' or 'stop', not {reason!r}")
        request = self._requests.get(request_id)
        if request is not None:
            request.cancel_requested = reason

    def stats(self) -> EngineStats:
        """A snapshot for gauges and health checks (front ends read this, never the
        scheduler or block manager themselves)."""
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_free=self.blocks.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            dead=self.dead,
        )

    def close(self) -> None:
        """Release what outlives the object: the other tensor-parallel ranks are told to exit."""
        if self.runner.broadcast is not None:
            self.runner.shutdown()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one scheduling + forward step; returns the requests that finished in it.

        A failure while serving one request (drafting, sampling, acceptance, committing)
        ends that request with "error" and the step goes on for the others; a failed
        forward fails that step's requests. Anything else that escapes fails every request
        in flight (their blocks are freed: a clean slate). That is fatal, `EngineDeadError`
        (also raised by every later call), under tensor parallelism, where the other ranks
        may be inside a forward rank 0 left, and after MAX_STEP_FAILURES such steps in a row."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            finished = self._step()
        except Exception as e:
            log.exception("engine step failed; failing every request in flight")
            reason = f"engine step failed: {type(e).__name__}: {e}"
            self._failed_steps += 1
            if self.runner.broadcast is not None or self._failed_steps >= MAX_STEP_FAILURES:
                why = "tensor-parallel ranks out of step" if self.runner.broadcast is not None else "every step fails"
                self.shut_down(f"{reason} ({why})")
                raise EngineDeadError(self.dead) from e
            return self.abort_all(reason)
        self._failed_steps = 0
        return finished

    def abort_all(self, error: str) -> list[Request]:
        """End every request in flight, waiting or running, with finish reason "error"."""
        with self._lock:
            requests = [r for r in self._requests.values() if not r.finished]
        self.runner.discard_moves()  # compaction moves of requests that are gone
        return [self._finish(r, "error", error) for r in requests]

    def shut_down(self, reason: str) -> list[Request]:
        """Declare the engine dead (`reason`): later requests are refused, and every request
        in flight ends with "error". Under the lock `add_request` takes, so none slips between."""
        with self._lock:
            self.dead = reason
        return self.abort_all(reason)

    def _step(self) -> list[Request]:
        finished = self._drop_cancelled()
        running = self.scheduler.running.values()
        beams = [r.spec.beam_width for r in running if not r.in_prefill and isinstance(r.spec, ReDrafterParams)]
        width = self.policy.width(len(self.scheduler.running), beams)
        work = self.scheduler.schedule(lambda r: full_width(r, width), tree_nodes)
        self.faults.check("step", (item.request.params for item in work))
        self.faults.check("hang", (item.request.params for item in work))
        start = time.perf_counter()
        trees, failures = self._draft(work)
        if failures:
            finished += [self._finish(r, "error", message) for r, message in failures.items()]
            work = [item for item in work if item.request not in failures]
        if not work:
            return finished
        drafted = time.perf_counter()
        try:
            self.faults.check("forward", (item.request.params for item in work))
            batch = assemble(work, trees, self.blocks, self.engine.device)
            out = self.runner.execute(batch.step)
            logits, hidden = out.logits[0], out.hidden[0]
        except Exception as e:  # a failed forward fails its requests, not the engine ...
            if self.runner.broadcast is not None:
                raise  # ... except under TP: the other ranks may be inside that forward, out of step
            log.exception("forward failed; failing its %d request(s)", len(work))
            return finished + [self._finish(item.request, "error", _describe(e)) for item in work]
        done = time.perf_counter()
        stats = StepStats(len(batch.step.tokens), drafted - start, done - drafted)
        decodes = [(item, span) for item, span in zip(work, batch.spans, strict=True) if not item.prefill]
        acceptances = self._verify(
            [item.request for item, _ in decodes],
            trees,
            [
                logits[span.logits_start : span.logits_start + len(trees[item.request.request_id].tokens)]
                for item, span in decodes
            ],
        )
        for item, span in zip(work, batch.spans, strict=True):
            request = item.request
            try:
                if item.prefill:
                    self._after_prefill(request, item.num_new, logits, hidden, span.logits_start, span.start)
                else:
                    acc = acceptances[request.request_id]
                    if isinstance(acc, str):  # its verification failed
                        finished.append(self._finish(request, "error", acc))
                        continue
                    tree = trees[request.request_id]
                    self._after_decode(
                        request, tree, acc, hidden, span.start, batch.slots[request.request_id], item.width, stats
                    )
            except Exception as e:  # this request only
                log.exception("request %s failed", request.request_id)
                finished.append(self._finish(request, "error", _describe(e)))
                continue
            if request.finished:
                finished.append(self._finish(request, request.result.finish_reason))
        self.policy.observe(stats)
        return finished

    def _verify(
        self, requests: list[Request], trees: dict[str, DraftTree], logits: list[torch.Tensor]
    ) -> dict[str, Acceptance | str]:
        """`accept_batch` over the decoding requests; if it fails, each request is verified
        on its own, so only the one whose verification fails gets its error message."""

        def accept(rs: list[Request], ls: list[torch.Tensor]) -> list[Acceptance]:
            self.faults.check("verify", (r.params for r in rs))
            return accept_batch(
                [trees[r.request_id] for r in rs], ls, [r.params for r in rs], [r.generator for r in rs]
            )

        if not requests:
            return {}
        try:
            return {r.request_id: acc for r, acc in zip(requests, accept(requests, logits), strict=True)}
        except Exception:
            log.exception("verifying %d trees together failed; verifying each alone", len(requests))
        out: dict[str, Acceptance | str] = {}
        for r, rows in zip(requests, logits, strict=True):
            try:
                out[r.request_id] = accept([r], [rows])[0]
            except Exception as e:
                log.exception("verifying request %s failed", r.request_id)
                out[r.request_id] = _describe(e)
        return out

    def _draft(self, work: list[ScheduledWork]) -> tuple[dict[str, DraftTree], dict[Request, str]]:
        """Trees for the decoding requests, and the requests whose drafting failed (with
        what went wrong). Drafting is batched by group: ReDrafter beams by (width, length),
        RSD trees by shape, Lyanna chains by settings (a pending re-sampled subtree verified
        on its own, without fusion, needs none); the root alone for auto-regressive steps.
        A group that fails is drafted again one request at a time, to find the culprit."""
        trees: dict[str, DraftTree] = {}
        groups: dict[tuple[Any, ...], list[Request]] = {}
        for item in work:
            if item.prefill:
                continue
            request, spec = item.request, item.request.spec
            if item.width == 0 or spec is None:
                trees[request.request_id] = DraftTree.root(request.tokens[-1])
                request.resampled = request.chain_logits = None  # rooted at a token this step moves past
            elif isinstance(spec, LyannaParams):
                if request.resampled is not None and not spec.fuse:  # verified alone, no new chain
                    trees[request.request_id] = to_draft_tree(request.resampled)
                    request.chain_logits = None
                else:
                    groups.setdefault(("lyanna", spec), []).append(request)
            elif isinstance(spec, TreeSpec):
                groups.setdefault(("tree", spec), []).append(request)
            else:
                groups.setdefault(("beams", item.width, spec.beam_length), []).append(request)
        failures: dict[Request, str] = {}
        for group, requests in groups.items():
            try:
                trees |= self._draft_group(group, requests)
                continue
            except Exception:
                log.exception("drafting %d request(s) together failed; drafting each alone", len(requests))
            for request in requests:
                try:
                    trees |= self._draft_group(group, [request])
                except Exception as e:
                    log.exception("drafting request %s failed", request.request_id)
                    failures[request] = _describe(e)
        return trees, failures

    def _draft_group(self, group: tuple[Any, ...], requests: list[Request]) -> dict[str, DraftTree]:
        """One batched drafting call for requests of one group (see `_draft`)."""
        self.faults.check("draft", (r.params for r in requests))
        kind, spec = group[0], group[1]
        if kind == "lyanna":
            return self._draft_lyanna(spec, requests)
        drafter, embed = self.engine.drafter, self.engine.model.model.embed_tokens
        roots = [r.tokens[-1] for r in requests]
        if kind == "beams":
            assert drafter is not None
            width, length = group[1], group[2]
            with_dists = any(not r.params.greedy for r in requests)  # per-node draft laws, for rules that use them
            drafted = draft_trees(drafter, embed, self._hidden(requests), roots, width, length, with_dists)
        else:
            levels: RNNLevels | DraftLMLevels
            if self.engine.draft_model is not None:
                assert self.draft_cache is not None
                levels = DraftLMLevels(self.engine.draft_model, self.draft_cache, self.blocks, requests)
            else:
                assert drafter is not None
                levels = RNNLevels(drafter, embed, self._hidden(requests), roots, spec.max_nodes)
            params, gens = [r.params for r in requests], [r.generator for r in requests]
            drafted = draft_rsd_trees(levels, roots, params, gens, spec)
        return {r.request_id: tree for r, tree in zip(requests, drafted, strict=True)}

    @torch.inference_mode()
    def _draft_lyanna(self, params: LyannaParams, requests: list[Request]) -> dict[str, DraftTree]:
        """One chain per request (`depth` layer steps), ONE LM-head product over all of them,
        then token-info sampling per request; a pending re-sampled subtree is merged in."""
        drafter, model = self.engine.lyanna_drafter, self.engine.model
        assert drafter is not None
        roots = torch.tensor([r.tokens[-1] for r in requests], device=self.engine.device)
        chain = drafter.draft_chain(self._hidden(requests), roots, model.model.embed_tokens, params.depth)
        logits = drafter.head_logits(chain, model.lm_head)  # [B, k, V]
        bias = self.engine.token_table.bias if self.engine.token_table is not None else None
        trees = {}
        for r, rows in zip(requests, logits, strict=True):
            r.chain_logits = rows
            tree = token_info_tree(r.tokens[-1], rows, bias, params.width, params.budget)
            if r.resampled is not None:
                tree = merge(tree, r.resampled)
            trees[r.request_id] = to_draft_tree(tree)
        return trees

    @staticmethod
    def _hidden(requests: list[Request]) -> torch.Tensor:
        """[B, D] target hidden states at the requests' last committed tokens (the RNN's input)."""
        states = [r.hidden for r in requests]
        if any(h is None for h in states):
            raise RuntimeError("a decoding request has no target hidden state (its prefill did not finish)")
        return torch.stack(states)  # type: ignore[arg-type]

    def _after_prefill(
        self, request: Request, num_new: int, logits: torch.Tensor, hidden: torch.Tensor, logits_row: int, start: int
    ) -> None:
        request.num_computed += num_new
        if request.in_prefill:
            return
        request.hidden = hidden[start + num_new - 1]
        if not request.result.output_ids:  # a fresh prompt (not a recompute): its first token
            request.result.num_forwards = 1
            self.faults.check("sample", [request.params])
            token = next_token(logits[logits_row], request.params, request.generator)
            self._notify(request, request.emit([token]))

    def _after_decode(
        self,
        request: Request,
        tree: DraftTree,
        acc: Acceptance,
        hidden: torch.Tensor,
        start: int,
        slots: torch.Tensor,  # [context + N] slots of the request's positions
        width: int,
        stats: StepStats,
    ) -> None:
        context = request.num_computed
        moved = [(context + p, context + i) for i, p in enumerate(acc.path) if p != i]
        if moved:  # accepted path -> consecutive positions
            src, dst = zip(*moved, strict=True)
            self.runner.move(slots[list(src)], slots[list(dst)])
            if self.draft_cache is not None:  # local, so at once (before any block is reused)
                self.draft_cache.copy(slots[list(src)], slots[list(dst)])
        if isinstance(request.spec, LyannaParams):
            self._resample(request, request.spec, acc)
        if isinstance(request.spec, TreeSpec) and len(tree.tokens) > 1:
            # the draft LM fed every node above the last level; a last-level leaf it did not
            fed = tree.depths[acc.path[-1]] < request.spec.length
            request.draft_computed = context + len(acc.path) - (0 if fed else 1)
        request.num_computed = context + len(acc.path)
        self.blocks.truncate(request.request_id, request.num_computed)  # rejected nodes' blocks
        request.hidden = hidden[start + acc.path[-1]]
        result = request.result
        result.num_forwards += 1
        result.num_drafted += len(tree.tokens) - 1
        result.accepted_per_step.append(acc.num_accepted)
        if tree.first_beam:
            stats.record(width, len(tree.tokens), [tree.first_beam[node] for node in acc.path[1:]])
        self._notify(request, request.emit(acc.tokens))

    def _resample(self, request: Request, params: LyannaParams, acc: Acceptance) -> None:
        """Algorithm 2: candidates for the next step from the chain rows this step left unused."""
        rows, request.resampled, request.chain_logits = request.chain_logits, None, None
        if params.resample and rows is not None:
            bias = self.engine.token_table.bias if self.engine.token_table is not None else None
            request.resampled = resample_subtree(acc.tokens[-1], rows, acc.num_accepted, bias, params)

    def _notify(self, request: Request, tokens: list[int], error: str | None = None) -> None:
        try:
            request.notify(tokens, error)
        except Exception:  # a broken consumer must not take the engine (or other requests) down
            log.exception("callback of request %s failed; cancelling it", request.request_id)
            request.callback = None
            request.cancel_requested = "cancelled"

    def _finish(self, request: Request, reason: str, error: str | None = None) -> Request:
        """Take the request out, free its blocks, send its final event."""
        self.scheduler.remove(request)
        with self._lock:
            self._requests.pop(request.request_id, None)
        if request.result.finish_reason != reason:  # "length"/"stop" went out with the last tokens
            request.result.finish_reason, request.result.error = reason, error
            self._notify(request, [], error)
        return request

    def _drop_cancelled(self) -> list[Request]:
        with self._lock:
            cancelled = [r for r in self._requests.values() if r.cancel_requested and not r.finished]
        return [self._finish(r, r.cancel_requested or "cancelled") for r in cancelled]

    # ---- blocking helpers -----------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], method: str | None = None, **overrides: Any
    ) -> list[GenerationResult]:
        """Submit all prompts (as fast as the waiting queue takes them), run to completion;
        results in prompt order."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        pending = deque(zip(prompts, params, strict=True))
        requests = []
        while pending or self.has_unfinished():
            while pending and len(self.scheduler.waiting) < self.config.max_queue_size:
                requests.append(self.add_request(*pending.popleft(), method, **overrides))
            self.step()
        return [r.result for r in requests]


def _describe(e: BaseException) -> str:
    """An exception as a request's error message."""
    return f"{type(e).__name__}: {e}"
