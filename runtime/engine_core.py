"""One step of the in-flight batching engine. The loop knows no method: a request's
proposer (`runtime/proposers/`) drafts its trees; everything else is shared.

    schedule -> propose -> assemble -> forward -> verify -> commit -> emit

- schedule: load-aware node budgets (`speculation_policy.py`) within what waiting prompts
  leave of the token budget, prefill chunks and decoding steps under it (`scheduler.py`);
- propose: one `DraftTree` per decoding request (`proposers/*.py`; the root alone = auto-regressive);
- assemble + forward: prefill chunks and trees of every request in ONE target forward over
  the paged cache (`step_batch.py`, `model_runner.py`);
- verify: greedy or recursive rejection sampling on the target's own logits (`verify.py`),
  penalized along each node's own path when the request asks (`logits_processing.py`), so
  output is lossless whatever the batch, the budgets or preemptions;
- commit: the accepted path's KV compacted to consecutive positions (`ModelRunner.move`),
  the rest of the tree's blocks freed, the proposer told (`Proposer.on_accept`);
- emit: the tokens go to the request's callback.

A failure while serving one request (drafting, sampling, acceptance, committing) ends that
request with "error"; a failed forward fails that step's requests (`LLMEngine.step` handles
what escapes).
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right

import torch

from runtime import native_policy
from runtime.attention_batch import Segment
from runtime.block_manager import BlockManager
from runtime.config import RuntimeConfig
from runtime.cuda_graphs import GraphLimits
from runtime.faults import FaultInjector, describe, each_alone
from runtime.kv_budget import kv_cache_blocks
from runtime.loaded_engine import LoadedEngine
from runtime.logits_processing import process_logits, token_log_probs
from runtime.model_runner import ModelRunner, StepSender
from runtime.proposers.proposer import KVMoves, Proposer
from runtime.proposers.registry import methods_for, proposer_class
from runtime.request import Request
from runtime.sampling import next_token
from runtime.scheduler import ScheduledWork, Scheduler
from runtime.speculation_policy import (
    AFTER_PREFILL,
    DraftCall,
    Offer,
    Outcome,
    SpeculationPolicy,
    StepStats,
    draft_fit,
    within_room,
)
from runtime.step_batch import Batch, assemble, step_input
from runtime.step_clock import StepClock
from runtime.tree import DraftTree
from runtime.verify import Acceptance, accept_batch

log = logging.getLogger(__name__)

PROMPTS_FIRST = True
"""Trees take only the token budget that prompts waiting for it leave (`Scheduler.tree_room`;
False: the largest tree that fits what the running requests before it left, prompts after).
Trees first, ReDrafter at batch 32, T=0 (12 closed rounds of 32 held-out prompts, each
engine's round alone in turn, 2-thread EPYC) took 108 steps holding prompt chunks at 30.4 ms
where auto-regression took 96 at 27.8: a prompt pushed a step later by trees of requests
it outweighed, in steps whose forward it already filled. Prompts first: 96 steps at 28.1 ms;
load-aware 0.966 -> 0.993x auto-regression, its fixed one-beam chains 0.971 -> 0.988 (two
more runs of load-aware: 0.986 -> 1.000, 0.979 -> 0.979). At batch 8 (sd, T=0) the prompts
leave room and nothing moved (1.167 / 1.166x); at batch 1 a prompt waits for no tree. A
prompt's chunks, so its first token, come as beside auto-regressive requests: a round's last
first token 223.7 ms against 234.4 trees first (AR's 212.7; fixed chains 222.6 against 288.3)."""

Options = tuple[tuple[int, ...], tuple[int, ...], int, tuple[str, ...]]
"""What a request's proposer offers (`EngineCore._offered`): tree sizes, drafter levels,
the largest size up to which smaller sizes are cuts of larger ones (`Proposer.cuts`), each
size's drafting-cost fit."""


class EngineCore:
    """Owns the paged KV cache, the scheduler, the model runner and the proposers of one
    loaded engine, and runs one step; `LLMEngine` adds the request API and fault handling."""

    def __init__(self, engine: LoadedEngine, config: RuntimeConfig | None = None, broadcast: StepSender | None = None):
        self.engine = engine
        self.config = config = config or RuntimeConfig()
        self.max_batch_size = config.batch_limit(engine.config.build)
        num_blocks = kv_cache_blocks(engine, config.kv, config.block_size, self.max_batch_size, config.max_draft_tokens)
        self.blocks = BlockManager(num_blocks, config.block_size)
        cache = engine.model.new_kv_cache(num_blocks, config.block_size)
        cache.warm_up()
        engine.model.set_batch_invariant(config.batch_invariant)
        limits = None
        if config.cuda_graphs and engine.device.type == "cuda" and broadcast is None:
            longest = engine.config.build.max_seq_len + config.max_draft_tokens + 1
            limits = GraphLimits(
                self.max_batch_size, self.blocks.blocks_for(longest), config.max_draft_tokens + 1, config.max_num_tokens
            )
        graphs = limits.forwards(engine.model, cache) if limits is not None else None
        if graphs is not None:
            log.info("target forwards captured per token bucket, linears on: %s", graphs.linears)
        self.runner = ModelRunner(engine.model, cache, broadcast, graphs)
        self.scheduler = Scheduler(self.blocks, self.max_batch_size, config.max_num_tokens, config.max_queue_size)
        self.kind = engine.config.drafter.kind if engine.config.drafter else None
        instances: dict[type[Proposer], Proposer] = {}  # one per class: methods sharing a drafter share its state
        self.proposers = {
            m: instances.setdefault(cls, cls(engine, self.blocks))
            for m in methods_for(self.kind)
            if (cls := proposer_class(m, self.kind))
        }
        if limits is not None:
            for proposer in instances.values():
                proposer.capture_graphs(limits)
        self.policy = SpeculationPolicy(adaptive=config.speculation == "load-aware")
        self.clock = StepClock(torch.cuda.synchronize if engine.device.type == "cuda" else None, config.profile)
        """Seconds per step phase (`make profile`)."""
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self.faults = FaultInjector.from_env()
        self.dead: str | None = None
        """Why the engine cannot step any more (None while it can)."""
        self._failed_steps = 0
        self._calibrated = False
        self._choose_seconds = 0.0
        """Seconds of the last step's `SpeculationPolicy.choose` (left out of its host overhead)."""
        self.policy_errors = 0
        """Calls of the policy that raised (`_policy_failed`): each cost its step's speculation, no request."""
        self._options: dict[tuple[str, object, bool], Options] = {}
        """(method, draft params, sampled) -> what it offers (`_offered`)."""

    def prepare(self) -> None:
        """Calibrate load-aware speculation now, as vLLM profiles at start-up, rather than at
        the first step that could draft, so that no request's latency (and no timed run)
        pays for it: ~0.6 s on the demo engines (~0.3 s before the forward was timed on both
        sides of each cost step, `SpeculationPolicy.calibrate`), ~1.3 s on the draft-LM
        engine (its four methods' drafting is timed too; greedy and sampled apart since
        session 24: 0.7 -> 0.95 s on a 2-thread AMD EPYC where the demo engines take 0.35).
        Servers and the CLI call it before serving; idempotent."""
        if not self._calibrated and self.policy.adaptive and any(m != "ar" for m in self.proposers):
            self._calibrate()

    def _calibrate(self) -> None:
        """Seed load-aware speculation's cost fits (like vLLM's profiling run), before the
        first step that could draft; the timed forwards write into free blocks only."""
        self._calibrated = True
        scratch = "\0calibration"
        most = min(self.config.max_num_tokens, self.blocks.num_free * self.blocks.block_size)
        if most < 1 or not self.blocks.ensure(scratch, most):
            return  # no room now: the fits learn from live steps
        slots = self.blocks.slots(scratch, 0, most)

        def forward(n: int) -> None:
            segments, rows = [Segment(0, 0, slots[:n])], torch.arange(n)
            step = step_input(torch.zeros_like(rows), rows, segments, rows, self.engine.device, self.blocks.block_size)
            self.runner.execute(step)
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize()  # what is timed is the forward's kernels, not their launch

        try:
            self.policy.calibrate(forward, most, self.runner.cost_steps())
        finally:
            self.blocks.free(scratch)
        # after the scratch is freed: the drafters time their calls in blocks of their own,
        # and a small engine's scratch took every block (at max_batch_size 1 no draft-LM
        # sample ran, and the first live call, cold and catching up on a whole prompt, priced
        # drafting at batch 1 ~5x too dear)
        for method, proposer in self.proposers.items():
            for path, samples in proposer.draft_cost_samples(method).items():
                self.policy.add_draft_samples(draft_fit(method, path), samples)

    # ---- one step -------------------------------------------------------------------

    def _step(self) -> list[Request]:
        clock = self.clock
        clock.start()
        calibrating = not self._calibrated  # a step that calibrates (`_schedule`) reports no host overhead
        finished = self._drop_cancelled()
        work = self._schedule()
        self.faults.check(("step", "hang", "slow"), (item.request.params for item in work))
        clock.lap("schedule")
        trees, failures, drafting = self._propose([item for item in work if not item.prefill])
        finished += [self._finish(r, "error", message) for r, message in failures]
        work = [item for item in work if item.prefill or item.request in trees]
        clock.lap("draft")
        if not work:
            return finished
        try:
            self.faults.check("forward", (item.request.params for item in work))
            batch = assemble(work, trees, self.blocks, self.engine.device)
            clock.lap("assemble")
            out = self.runner.execute(batch.step)
            logits, hidden = out.logits[0], out.hidden[0]
        except Exception as e:  # a failed forward fails its requests, not the engine ...
            if self.runner.broadcast is not None:
                raise  # ... except under TP: the other ranks may be inside that forward, out of step
            log.exception("forward failed; failing its %d request(s)", len(work))
            return finished + [self._finish(item.request, "error", describe(e)) for item in work]
        stats = StepStats(
            len(batch.step.tokens),
            clock.lap("forward", wait=True),
            drafting,
            num_requests=len(work),
            prefill=any(item.prefill for item in work),
        )
        rows = {r: self._processed(r, logits[span.logits_start : span.logits_start + len(trees[r].tokens)], trees[r])
                for r, span in zip((i.request for i in work), batch.spans, strict=True) if r in trees}  # fmt: skip
        acceptances = self._verify(trees, rows)
        verify_seconds = clock.lap("verify")
        if drafting:  # verifying drafts is part of what drafting costs: each method pays its nodes' share
            nodes = sum(len(t.tokens) for t in trees.values())
            for method, (levels, drafted, caught_up, request_levels, seconds) in drafting.items():
                share = verify_seconds * drafted / nodes
                drafting[method] = (levels, drafted, caught_up, request_levels, seconds + share)
        for item, span in zip(work, batch.spans, strict=True):
            request = item.request
            try:
                if item.prefill:
                    self._commit_prefill(
                        request, item.chunk, logits, span.logits_start, hidden[span.start + item.chunk - 1]
                    )
                elif isinstance(acc := acceptances[request], str):  # its verification failed
                    finished.append(self._finish(request, "error", acc))
                    continue
                else:
                    self._commit(
                        item, trees[request], acc, rows[request], hidden[span.start + acc.path[-1]], batch, stats
                    )
            except Exception as e:  # this request only
                log.exception("request %s failed", request.request_id)
                finished.append(self._finish(request, "error", describe(e)))
                continue
            if request.finished:
                finished.append(self._finish(request, request.result.finish_reason))
        clock.lap("commit")
        clock.count_step(stats.prefill)
        if not (calibrating and self._calibrated):
            drafted_seconds = sum(seconds for *_, seconds in drafting.values())
            # less the policy's own choice: paid whatever it chooses (and far less on steps whose
            # decision stands), it made the plain steps timed where a decision changed (~0.5 ms
            # at batch 32) price auto-regression ~7% high
            spent = stats.forward_seconds + drafted_seconds + self._choose_seconds
            stats.overhead_seconds = max(sum(clock.step.values()) - spent, 0.0)
            stats.choose_seconds = self._choose_seconds
        try:
            self.policy.observe(stats)
        except Exception:
            self._policy_failed("observe")
        if not drafting and not stats.prefill:
            clock.count_plain(steady=self.policy.since_heavy > AFTER_PREFILL)
        return finished

    def _schedule(self) -> list[ScheduledWork]:
        """Tree sizes the decoding requests may draft (load-aware), then the scheduler's work."""
        running = list(self.scheduler.running.values())
        offers = []
        prompts = 0  # prompt tokens the running prefills still owe
        for r in running:
            if r.in_prefill:
                prompts += r.prefill_target - r.num_computed
                continue
            lag = self.proposers[r.method].lag(r)
            sizes, levels, cuts, costs = self._offered(r)
            left = r.params.max_tokens - len(r.result.output_ids)  # (no step emits more)
            kind = (r.method, r.params.greedy)
            offers.append(Offer(r.request_id, kind, r.method, sizes, levels, lag, left, costs, cuts))
        if PROMPTS_FIRST and offers and (room := self.scheduler.tree_room(len(offers), prompts)) is not None:
            offers = [within_room(o, room // len(offers)) for o in offers]
        if not self._calibrated and self.policy.adaptive and any(len(o.sizes) > 1 for o in offers):
            self._calibrate()
        start = time.perf_counter()
        try:
            chosen = self.policy.choose(offers, len(running) - len(offers))
        except Exception:
            self._policy_failed("choose")
            chosen = {o.key: 1 for o in offers}
        self._choose_seconds = time.perf_counter() - start
        # sizes ascend: the offered ones up to the chosen, as a slice (~1 us a request as a comprehension)
        return self.scheduler.schedule({o.key: o.sizes[: bisect_right(o.sizes, chosen[o.key])] for o in offers})

    def _offered(self, request: Request) -> Options:
        """(tree sizes, drafter levels, the size up to which smaller sizes are cuts of larger
        ones, each size's drafting-cost fit) the request's proposer offers, greedy or sampled
        (`Proposer.cost_paths`); params are frozen, so each proposer is asked once per
        setting, and each request looks its setting up once (hashing a params dataclass
        costs ~1 us: ~30 us a step at batch 32)."""
        if request.options is not None:
            return request.options
        key = (request.method, request.draft_params, not request.params.greedy)
        options = self._options.get(key)
        if options is None:
            proposer, params = self.proposers[request.method], request.draft_params
            # tuples: the policy's signature of a settled decision takes them as they are, every step
            fits = tuple(draft_fit(request.method, path) for path in proposer.cost_paths(params, key[2]))
            options = tuple(proposer.sizes(params)), tuple(proposer.levels(params)), proposer.cuts(params), fits
            self._options[key] = options
        request.options = options
        return options

    def _propose(
        self, work: list[ScheduledWork]
    ) -> tuple[dict[Request, DraftTree], list[tuple[Request, str]], dict[str, DraftCall]]:
        """Trees of the decoding requests, one batched call per method (per drafting path of
        a method, `Proposer.cost_paths`), the requests whose drafting failed (with what went
        wrong), and each call's timing for load-aware speculation (per drafting-cost fit)."""
        groups: dict[str, list[ScheduledWork]] = {}
        levels_of: dict[Request, int] = {}  # drafter levels of each request's tree this step
        roots: list[ScheduledWork] = []
        for item in work:
            if item.budget == 1:
                roots.append(item)
                continue
            sizes, levels, _, fits = self._offered(item.request)
            k = sizes.index(item.budget)
            groups.setdefault(fits[k], []).append(item)
            levels_of[item.request] = levels[k]

        def root_trees(items: list[ScheduledWork]) -> list[DraftTree]:
            self.faults.check("draft", (item.request.params for item in items))
            return [DraftTree.root(item.request.pending) for item in items]

        # the root alone (auto-regression, and most requests of a busy batch): the loop's own
        # tree, no proposer call (`Proposer.propose`; ~2-5 us a request in the proposers'
        # own loops, ngram's ~8: a chain tree built for no draft)
        done, failed = each_alone(root_trees, roots, "drafting")
        trees: dict[Request, DraftTree] = {item.request: tree for item, tree in done}
        failures: list[tuple[Request, str]] = [(item.request, message) for item, message in failed]
        drafting: dict[str, DraftCall] = {}
        for fit, items in groups.items():
            proposer = self.proposers[items[0].request.method]
            caught_up = sum(proposer.lag(item.request) for item in items if item.budget > 1)

            def propose(items: list[ScheduledWork], proposer: Proposer = proposer) -> list[DraftTree]:
                self.faults.check("draft", (item.request.params for item in items))
                return proposer.propose([item.request for item in items], [item.budget for item in items])

            start = time.perf_counter()
            done, failed = each_alone(propose, items, "drafting")
            seconds = time.perf_counter() - start
            trees |= {item.request: tree for item, tree in done}
            failures += [(item.request, message) for item, message in failed]
            if drafted := sum(len(t.tokens) - 1 for _, t in done):
                depths = [levels_of[i.request] for i in items]
                drafting[fit] = (max(depths), drafted, caught_up, sum(depths), seconds)
        return trees, failures, drafting

    def _verify(
        self, trees: dict[Request, DraftTree], logits: dict[Request, torch.Tensor]
    ) -> dict[Request, Acceptance | str]:
        """`accept_batch` over the decoding requests (each alone if that fails, so only the
        culprit gets an error message instead of its acceptance)."""

        def accept(requests: list[Request]) -> list[Acceptance]:
            self.faults.check("verify", (r.params for r in requests))
            return accept_batch([trees[r] for r in requests], [logits[r] for r in requests],
                                [r.params for r in requests], [r.generator for r in requests])  # fmt: skip

        if not logits:
            return {}
        done, failed = each_alone(accept, list(logits), "verifying")
        return dict(done) | dict(failed)

    @staticmethod
    def _processed(request: Request, logits: torch.Tensor, tree: DraftTree | None) -> torch.Tensor:
        """The target's logits at `tree`'s nodes (None: after the prompt) as the request's
        penalties and masks change them along each node's path (`logits_processing.py`)."""
        if not request.params.processes_logits:
            return logits
        return process_logits(logits, request.params, request.prompt, request.result.output_ids, request.stop_ids, tree)

    def _commit_prefill(
        self, request: Request, chunk: int, logits: torch.Tensor, row: int, hidden: torch.Tensor
    ) -> None:
        request.num_computed += chunk
        if request.in_prefill:
            return
        request.hidden = hidden
        if not request.result.output_ids:  # a fresh prompt (not a recompute): its first token
            request.result.num_forwards = 1
            self.faults.check("sample", [request.params])
            row_logits = self._processed(request, logits[row : row + 1], None)
            token = next_token(row_logits[0], request.params, request.generator)
            log_probs = token_log_probs(row_logits, [token]) if request.params.logprobs else None
            self._notify(request, request.emit([token], log_probs))

    def _commit(
        self,
        item: ScheduledWork,
        tree: DraftTree,
        acc: Acceptance,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        batch: Batch,
        stats: StepStats,
    ) -> None:
        """Keep the accepted path: its KV compacted to consecutive positions, the rest of the
        tree's blocks freed, the proposer told, the tokens emitted (with their log-probabilities
        under the tree's verified `logits` when asked for)."""
        request = item.request
        context, slots = request.num_computed, batch.slots[request.request_id]
        moved = [(context + p, context + i) for i, p in enumerate(acc.path) if p != i]
        moves = None
        if moved:
            src, dst = zip(*moved, strict=True)
            moves = KVMoves(slots[list(src)], slots[list(dst)])
            self.runner.move(moves.src, moves.dst)
        request.num_computed = context + len(acc.path)
        self.proposers[request.method].on_accept(request, tree, acc, moves)
        self.blocks.truncate(request.request_id, request.num_computed)  # rejected nodes' blocks
        request.hidden = hidden
        result = request.result
        result.num_forwards += 1
        result.num_drafted += len(tree.tokens) - 1
        result.accepted_per_step.append(acc.num_accepted)
        result.sizes_per_step.append(item.budget)
        if len(tree.tokens) > 1:
            sizes, _, cuts, _ = self._offered(request)
            stats.outcomes.append(Outcome(
                request.request_id, (request.method, request.params.greedy), item.budget,
                sizes, acc.num_accepted, tree.node_budget, acc.path, len(tree.tokens), cuts,
            ))  # fmt: skip
        log_probs = token_log_probs(logits[acc.path], acc.tokens) if request.params.logprobs else None
        self._notify(request, request.emit(acc.tokens, log_probs))

    def _notify(self, request: Request, tokens: list[int], error: str | None = None) -> None:
        self.clock.emitted(len(tokens))
        start = self.clock.mark()
        try:
            request.notify(tokens, error)
        except Exception:  # a broken consumer must not take the engine (or other requests) down
            log.exception("callback of request %s failed; cancelling it", request.request_id)
            request.callback = None
            request.cancel_requested = "cancelled"
        finally:
            self.clock.nested("emit", start)

    def _policy_failed(self, call: str) -> None:
        """A fault in the load-aware policy (its `call` raised) costs speed, never a request:
        a failed `choose` leaves every request of its step at size 1 (auto-regression, the
        same tokens), a failed `observe` or `forget` only what it would have learned. The
        first is logged with its traceback and the fix, the rest counted (`policy_errors`,
        `LLMEngine.stats()`). Before, it failed every request in flight, and repeated,
        killed the engine. Call from an `except` block."""
        self.policy_errors += 1
        if self.policy_errors == 1:
            log.exception(
                "the speculation policy's %s failed (it runs %s); this step decodes auto-regressively, its "
                "tokens unchanged, and later failures are only counted (policy_errors). Report it; "
                "%s=0 runs the policy as Python, --speculation fixed without choices",
                call,
                "compiled" if native_policy.active() else "as Python",
                native_policy.ENV,
            )

    def _finish(self, request: Request, reason: str, error: str | None = None) -> Request:
        """Take the request out, free its blocks, send its final event."""
        self.scheduler.remove(request)
        try:
            self.policy.forget(request.request_id)
        except Exception:
            self._policy_failed("forget")
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
