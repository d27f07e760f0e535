"""specpipe as a decoupled Triton Python-backend model (in the style of Triton's
vllm_backend): `max_batch_size 0`, the runtime's scheduler does the batching. The
repository's `model.py` is a shim that puts the project on `sys.path` and delegates here.

Threads:
- Triton's `execute` only parses each request and hands it to the engine (or answers at
  once with INVALID_ARG / UNAVAILABLE);
- the engine thread loads the engine and runs the in-flight batching loop (`LLMEngine.step`),
  whose per-request callbacks only queue events, waking the response thread only for an
  event it must act on now (`_queue_event`); every torch op runs on it (`_engine_main` says
  why), on every core unless the `torch_threads` parameter says otherwise;
- the response thread turns events into responses through each request's output stage
  (`runtime/output.py`: text deltas, stop words, finish reason, statistics, log probs; deltas
  when streaming, one response otherwise, with the prompt in front when the request set
  `exclude_input_in_output` false), ends every request with exactly one FINAL response, notices
  cancelled requests and cancels them in the engine, and updates the metrics. A streamed
  request's deltas go out together when several wait (the thread fell behind the engine)
  or when its last response left less than `stream_interval_ms` ago (`_flush`): each
  response costs the stub, Triton and the client CPU that, on a small machine, the engine
  would otherwise have (`benchmarks/triton_overhead.py`).

Under tensor parallelism this process is rank 0 (it joins the other ranks at the address
in the `tp_master` parameter); ranks 1..N-1 are `runtime.tp_worker` processes.

Faults: a request that fails inside the engine gets an error FINAL (INTERNAL) and the
others go on (`LLMEngine.step`); so does one whose response fails to build. If the engine
dies (`EngineDeadError`, or anything escaping the loop) every request in flight gets an
error FINAL, new ones are refused with UNAVAILABLE, and the gauge `specpipe_engine_up`
drops to 0, as it does while one step has run longer than the `stall_timeout_s` parameter; the launcher
(`triton_repo/server.py`) watches that gauge and stops the server, which exits non-zero.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from runtime.llm_engine import EngineDeadError, EngineStats, LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.output import OutputDelta, RequestOutput
from runtime.request import RequestEvent
from runtime.runtime_args import runtime_from_parameters
from runtime.scheduler import QueueFullError
from triton_repo.inputs import AdmissionCheck, GenerateRequest
from triton_repo.metrics import ServingMetrics

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02
"""How long the idle threads wait for work before looking again."""
HOUSEKEEPING_SECONDS = 0.1
"""How often the response thread asks Triton which requests were cancelled (one IPC round
trip per request in flight) and refreshes the gauges."""
STATS_OUTPUTS = ("num_input_tokens", "num_output_tokens", "num_draft_tokens", "num_accepted_tokens", "num_forwards")
"""The final response's statistics (`RequestStats` fields of the same names)."""
CANCEL_INPUT = "cancel_request_id"
"""A request holding this input only cancels the requests in flight with that Triton request id."""


def joined(first: OutputDelta | None, then: OutputDelta) -> OutputDelta:
    """`then` with `first`'s text and log probs in front (consecutive deltas of one request:
    the token count is cumulative, so `then`'s stands)."""
    if first is None:
        return then
    return replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        log_probs=first.log_probs + then.log_probs,
    )


@dataclass(eq=False)
class Stream:
    """One Triton request in flight."""

    triton_request: Any
    sender: Any
    parsed: GenerateRequest
    output: RequestOutput
    """Text deltas, stop words, finish reason and statistics (`runtime/output.py`)."""
    arrival: float
    request_id: str = ""
    """The engine's id of the request, once added."""
    first_token_at: float | None = None
    done: bool = False
    """Its FINAL response went out (the engine may still send an event, which is ignored)."""
    triton_id: str = ""
    """Triton's id of the request (what `cancel_request_id` names)."""
    unsent: OutputDelta | None = None
    """Streamed deltas not sent yet, joined (`_flush` sends them)."""
    sent_at: float = float("-inf")
    """When its last streamed response went out."""


class SpecpipeModel:
    """The model behind the shim; `pb_utils` is the backend's `triton_python_backend_utils`
    (importable only inside the stub process, hence passed in)."""

    def __init__(self, args: dict[str, Any], pb_utils: Any) -> None:
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.stall_timeout_s = float(params["stall_timeout_s"])
        self.stream_interval_s = float(params.get("stream_interval_ms") or 0.0) / 1e3
        self.unsent: dict[Stream, None] = {}
        """Streams holding deltas not sent yet (response thread only; a dict: ordered, O(1) removal)."""
        self.metrics = ServingMetrics(pb_utils)
        self.step_started: float | None = None
        """When the step now running began (None between steps): a stall shows here."""
        self.events: deque[tuple[Stream, RequestEvent]] = deque()
        """The engine's events, oldest first (appended by the engine thread, taken by the response thread)."""
        self.events_due = threading.Event()
        """Set by the engine thread when an event must be handled now (`_queue_event`)."""
        self.streams: dict[str, Stream] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.running = True
        started: queue.Queue[BaseException | None] = queue.Queue()
        self.engine_thread = threading.Thread(
            target=self._engine_main, args=(params, started), name="specpipe-engine", daemon=True
        )
        self.engine_thread.start()
        if (error := started.get()) is not None:  # the model fails to load with the engine's error
            raise error
        self.admission = AdmissionCheck(self.engine.config, self.engine.tokenizer)
        self.response_thread = threading.Thread(target=self._response_loop, name="specpipe-responses", daemon=True)
        self.response_thread.start()

    def _start_engine(self, params: dict[str, str]) -> None:
        """Load, build and warm the engine (`prepare`, before the model reports ready: the
        first request does not pay for it). Runs on the engine thread, like every step: see
        `_engine_main`."""
        broadcast = None
        if threads := int(params.get("torch_threads") or 0):
            torch.set_num_threads(threads)
        self.engine = LoadedEngine.load(params["engine_dir"], device=params.get("device") or "cpu")
        settings = runtime_from_parameters(params)
        if self.engine.config.build.tp_size > 1:
            from runtime.tp_worker import start_leader

            settings, broadcast = start_leader(self.engine, settings, params.get("tp_master", ""))
        self.llm = LLMEngine(self.engine, settings, broadcast)
        self.llm.prepare()

    # ---- Triton entry points ------------------------------------------------------------

    def execute(self, requests: list[Any]) -> None:
        for triton_request in requests:
            self._admit(triton_request, time.perf_counter())
        return None

    def finalize(self) -> None:
        self.running = False
        self.wake.set()
        self.events_due.set()
        self.engine_thread.join(timeout=10)
        self.response_thread.join(timeout=10)
        self.llm.close()

    # ---- admission ----------------------------------------------------------------------

    def _admit(self, triton_request: Any, arrival: float) -> None:
        sender = triton_request.get_response_sender()

        def get(name: str) -> np.ndarray | None:
            tensor = self.pb.get_input_tensor_by_name(triton_request, name)
            return None if tensor is None else tensor.as_numpy()

        if (cancel := get(CANCEL_INPUT)) is not None:
            self._cancel_by_triton_id(bytes(cancel.reshape(-1)[0]).decode(errors="replace"))
            sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        try:
            parsed, prompt = self.admission.parse(get)  # size limit first, then tokenizing
            output = RequestOutput(self.engine.tokenizer, parsed.stop_words)
            stream = Stream(triton_request, sender, parsed, output, arrival)
            stream.triton_id = triton_request.request_id()
            with self.lock:
                request = self.llm.add_request(
                    prompt,
                    parsed.params,
                    parsed.method,
                    callback=partial(self._queue_event, stream),
                    **parsed.overrides,
                )
                stream.request_id = request.request_id
                self.streams[request.request_id] = stream
        except (QueueFullError, EngineDeadError) as e:
            self._reject(sender, str(e), self.pb.TritonError.UNAVAILABLE, "rejected")
            return
        except ValueError as e:  # InvalidInput included
            self._reject(sender, str(e), self.pb.TritonError.INVALID_ARG, "invalid")
            return
        self.metrics.prompt_tokens.increment(len(prompt))
        self.wake.set()

    def _cancel_by_triton_id(self, triton_id: str) -> None:
        """Cancel the requests in flight that Triton knows as `triton_id`: the non-streaming
        front sends this when its client goes away (a BLS request cannot be cancelled
        otherwise in this Triton)."""
        with self.lock:
            streams = [s for s in self.streams.values() if triton_id and s.triton_id == triton_id]
        for stream in streams:
            if stream.request_id:
                self.llm.cancel(stream.request_id)

    def _queue_event(self, stream: Stream, event: RequestEvent) -> None:
        """The engine thread's callback: hand the event to the response thread, and wake it
        only when the event must be handled now: a request's first tokens (its first
        response and time to first token), its end, an event of a request with stop words
        (found sooner, generated past less), or a streamed delta whose `stream_interval_ms`
        has passed. Other events wait for the next of those or for the response thread's
        poll: each wake-up costs the engine the response thread's Python work under the GIL,
        on a small machine a core's share, while the text it would handle is held anyway
        (auto-regressive, batch 1, 2 cores: 64 wake-ups a 64-token request)."""
        self.events.append((stream, event))
        if (
            event.finished
            or stream.first_token_at is None
            or stream.parsed.stop_words
            or (stream.parsed.stream and time.perf_counter() - stream.sent_at >= self.stream_interval_s)
        ):
            self.events_due.set()

    def _reject(self, sender: Any, message: str, code: Any, outcome: str) -> None:
        error = self.pb.TritonError(message, code)
        sender.send(
            self.pb.InferenceResponse(output_tensors=[], error=error),
            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
        self.metrics.requests[outcome].increment(1)

    # ---- engine thread ------------------------------------------------------------------

    def _engine_main(self, params: dict[str, str], started: queue.Queue[BaseException | None]) -> None:
        """The engine thread: build the engine, report to `__init__`, then step. Every torch
        op of the engine runs on this one thread. On a CPU, OpenMP keeps a pool of worker
        threads per thread that has run a parallel region, and while two pools live their
        workers stop spin-waiting between regions; loading on Triton's thread and stepping
        here made every step's small GEMMs wait on sleeping workers (demo target, batch 1,
        2 threads: 120 vs 270 tok/s auto-regressive)."""
        try:
            self._start_engine(params)
        except BaseException as e:
            started.put(e)
            return
        started.put(None)
        self._engine_loop()

    def _engine_loop(self) -> None:
        """Step while there is work; never dies silently: whatever ends it fails the
        requests in flight and leaves the engine dead (`llm.stats().dead`; the gauge shows it)."""
        try:
            while self.running:
                if not self.llm.has_unfinished():
                    self.wake.wait(POLL_SECONDS)
                    self.wake.clear()
                    continue
                self.step_started = time.perf_counter()
                self.llm.step()
                self.step_started = None
        except EngineDeadError as e:
            log.error("engine is dead: %s; refusing new requests", e)
        except BaseException as e:
            log.exception("engine thread failed")
            self.llm.shut_down(f"engine thread failed: {type(e).__name__}: {e}")
        self.step_started = None

    def engine_up(self, stats: EngineStats) -> bool:
        """The engine can serve: its thread runs, it is not dead, no step is stalled."""
        started = self.step_started
        stalled = started is not None and time.perf_counter() - started > self.stall_timeout_s
        return self.engine_thread.is_alive() and stats.dead is None and not stalled

    # ---- response thread ----------------------------------------------------------------

    def _response_loop(self) -> None:
        last_housekeeping = 0.0
        while self.running:
            self.events_due.wait(self._wait_seconds())
            self.events_due.clear()  # before taking the events: one queued after this wakes the next wait
            while self.events:
                stream, event = self.events.popleft()
                self._handle(stream, partial(self._on_event, stream, event))
            self._flush()
            if time.perf_counter() - last_housekeeping >= HOUSEKEEPING_SECONDS:
                last_housekeeping = time.perf_counter()
                self._check_cancelled()
                stats = self.llm.stats()
                self.metrics.observe_engine(stats, self.engine_up(stats))

    def _wait_seconds(self) -> float:
        """How long the response thread may wait for events due: until the first held delta is due."""
        if not self.unsent:
            return POLL_SECONDS
        due = min(stream.sent_at for stream in self.unsent) + self.stream_interval_s
        return min(max(due - time.perf_counter(), 0.0), POLL_SECONDS)

    def _flush(self) -> None:
        """Send the held deltas of every stream whose last response is `stream_interval_ms` old."""
        now = time.perf_counter()
        for stream in list(self.unsent):
            if now - stream.sent_at < self.stream_interval_s:
                continue
            self._handle(stream, partial(self._send_unsent, stream, now))

    def _send_unsent(self, stream: Stream, now: float) -> None:
        delta, stream.unsent = stream.unsent, None
        self.unsent.pop(stream, None)
        if delta is not None and not stream.done:
            stream.sent_at = now
            stream.sender.send(self._response(stream, delta.text, delta, delta.log_probs))

    def _handle(self, stream: Stream, action: Callable[[], None]) -> None:
        """One event or send for `stream`; a failure to respond (a detokenizer error, the
        client went away) ends that request only: it is cancelled in the engine and, if the
        sender still works, gets an error FINAL."""
        try:
            action()
        except Exception as e:
            log.exception("responding to %s failed", stream.request_id or "?")
            if stream.request_id:
                self.llm.cancel(stream.request_id)
            if not stream.done:
                stream.done = True
                error = self.pb.TritonError(f"{type(e).__name__}: {e}", self.pb.TritonError.INTERNAL)
                try:
                    stream.sender.send(
                        self.pb.InferenceResponse(output_tensors=[], error=error),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
                except Exception:
                    log.exception("could not send the error FINAL")
                if stream.request_id:
                    self.metrics.requests["error"].increment(1)
            self.unsent.pop(stream, None)
            if stream.request_id:
                with self.lock:
                    self.streams.pop(stream.request_id, None)

    def _check_cancelled(self) -> None:
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            if not stream.done and stream.triton_request.is_cancelled() and stream.request_id:
                self.llm.cancel(stream.request_id)

    def _on_event(self, stream: Stream, event: RequestEvent) -> None:
        """Text deltas are held for `_flush` when streaming; the final delta (for a stop
        word, the engine's event after `cancel(id, "stop")`) becomes the FINAL response,
        with whatever deltas were still held in front."""
        if stream.done:
            return  # an error FINAL went out already; this is the engine's "cancelled" echo
        self.llm.faults.check("detokenize", [stream.parsed.params])
        if event.tokens and stream.first_token_at is None:
            stream.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(stream.first_token_at - stream.arrival)
        delta = stream.output.push(event)
        if delta.stop_hit:
            self.llm.cancel(event.request_id, "stop")  # frees its KV at the next step, which ends it
        if delta.finished:
            self._finish(stream, joined(stream.unsent, delta))
        elif stream.parsed.stream and (delta.text or delta.log_probs):
            stream.unsent = joined(stream.unsent, delta)
            self.unsent.setdefault(stream)

    def _finish(self, stream: Stream, delta: OutputDelta) -> None:
        stream.done = True
        stream.unsent = None
        self.unsent.pop(stream, None)
        assert delta.finish_reason is not None and delta.stats is not None
        if delta.error is not None:
            if stream.parsed.stream and (delta.text or delta.log_probs):  # text held back goes out before the error
                streamed = replace(delta, finish_reason=None, stats=None)
                stream.sender.send(self._response(stream, delta.text, streamed, delta.log_probs))
            response = self.pb.InferenceResponse(
                output_tensors=[], error=self.pb.TritonError(delta.error, self.pb.TritonError.INTERNAL)
            )
        elif stream.parsed.stream:  # deltas never repeat the prompt, whatever exclude_input_in_output says
            response = self._response(stream, delta.text, delta, delta.log_probs)
        else:
            prompt = "" if stream.parsed.exclude_input_in_output else stream.parsed.text
            response = self._response(stream, prompt + stream.output.text, delta, stream.output.log_probs)
        stream.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self.lock:
            self.streams.pop(stream.request_id, None)
        self.metrics.observe_finished(delta.stats, delta.finish_reason, stream.first_token_at, time.perf_counter())

    def _response(self, stream: Stream, text: str, delta: OutputDelta, log_probs: list[float]) -> Any:
        """`text` with the final delta's statistics and finish reason, or a streamed delta's
        output-token count (clients count tokens, not chunks, when one step streams several);
        with `return_log_probs`, TensorRT-LLM's `output_log_probs` ([beam, tokens]: those of
        `text`'s tokens) and `cum_log_probs` ([beam]: the sum over every token sent so far)."""
        tensors = [self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if stream.parsed.params.logprobs:
            tensors.append(
                self.pb.Tensor("output_log_probs", np.array([log_probs], dtype=np.float32).reshape(1, len(log_probs)))
            )
            tensors.append(self.pb.Tensor("cum_log_probs", np.array([stream.output.cum_log_prob], dtype=np.float32)))
        if delta.stats is not None and delta.finish_reason is not None:
            stats = {name: getattr(delta.stats, name) for name in STATS_OUTPUTS}
            tensors += [self.pb.Tensor(k, np.array([v], dtype=np.int32)) for k, v in stats.items()]
            tensors.append(self.pb.Tensor("finish_reason", np.array([delta.finish_reason.encode()], dtype=np.object_)))
        else:
            tensors.append(self.pb.Tensor("num_output_tokens", np.array([delta.num_tokens], dtype=np.int32)))
        return self.pb.InferenceResponse(output_tensors=tensors)
