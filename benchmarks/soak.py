"""Bounded fixed-QPS soak of the real Triton server: nothing lost, one FINAL per request,
the server's counters agree with the client, and the server returns to idle.

    python -m benchmarks.soak --engine engines/demo-redrafter [--rate 2 --duration 300]
    python -m benchmarks.soak --engine E --url localhost:8001 --metrics-url http://localhost:8002/metrics

    plan_requests     seeded mix: methods x temperatures x max_tokens, ~10% cancelled by the
         |            client after a few streamed responses, ~7% unusual inputs (INPUT_CASES)
    warm-up           one greedy request per method (also the reference for temperature 1e-38)
         |            -> counters snapshot, RSS of the engine's stub process
    Poisson arrivals  each request on its own gRPC stream; a second FINAL within a grace
         |            window is counted; no response for --request-timeout s = "lost" (so
         |            soak at a rate the server sustains: a long queue wait reads as lost)
    settle            gauges back to 0 and counter deltas equal to the client's outcomes
                      (polled: gauges refresh every 100 ms) -> RSS again -> checks

Outcomes are the server's (`specpipe_requests_total{outcome=...}`): length, stop, cancelled,
error, invalid (INVALID_ARG at admission), rejected (UNAVAILABLE: queue full, engine down).
A streamed error carries its message but not its status code, so the client calls it
rejected by its message, invalid when it is the request's first response, else error.
NOTE: not Triton's `triton_grpc_error` stream mode, which would send the code: in the
bundled tritonserver 2.51 every error ended that way logs "HandleCancellation called even
when the context was not cancelled", and with other streams running it crashed the server
(SIGSEGV).

A check whose quantity cannot be measured (no local stub process, no `specpipe_engine_up`
gauge) is "unknown" and does not fail the run. Writes `<out>.json` and `<out>.md`; exits 1
if any check fails. Send no other traffic to the server during a soak: the counters are
compared as deltas.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import queue
import shlex
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm
from tritonclient.utils import InferenceServerException

from benchmarks.arrivals import ArrivalProcess
from benchmarks.prompts import load_prompts
from benchmarks.report import machine, write_report
from triton_repo.client import Completion, make_inputs, stream_completion
from triton_repo.inputs import AdmissionCheck
from triton_repo.metrics import OUTCOMES, read_metrics
from triton_repo.processes import list_processes
from triton_repo.repository import add_serving_args, serving_config
from triton_repo.server import ENGINE_UP_GAUGE, TritonServer

GREEDY_TOKENS = 16
"""Warm-up and temperature_tiny requests: this many tokens (ignore_eos) of the reference prompt."""
KEEP_TEXT = ("warmup", "temperature_tiny")
INPUT_CASES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (what the server must do, fields it sends)
    "temperature_nan": ("invalid", {"temperature": math.nan}),
    "temperature_inf": ("invalid", {"temperature": math.inf}),
    "temperature_negative": ("invalid", {"temperature": -0.5}),
    "top_p_zero": ("invalid", {"top_p": 0.0}),
    "top_p_nan": ("invalid", {"top_p": math.nan}),
    "max_tokens_zero": ("invalid", {"max_tokens": 0}),
    "max_tokens_over_seq_len": ("invalid", {}),  # max_seq_len: from the engine (plan_requests)
    "unknown_method": ("invalid", {"method": "medusa"}),
    "empty_prompt": ("invalid", {"prompt": ""}),
    "prompt_too_long": ("invalid", {}),  # > max_input_len tokens: from the engine (plan_requests)
    # 1e-38 (a float32 subnormal) is served as greedy: the greedy text of the reference prompt
    "temperature_tiny": ("served", {"temperature": 1e-38, "max_tokens": GREEDY_TOKENS, "ignore_eos": True}),
}
UNAVAILABLE_MARKERS = ("max_queue_size", "engine is down")
"""In the messages of the server's UNAVAILABLE refusals (outcome "rejected"): keep in sync with
QueueFullError (runtime/scheduler.py) and EngineDeadError (runtime/llm_engine.py)."""
GAUGES = ("specpipe_running_requests", "specpipe_queue_depth", 'specpipe_kv_blocks{state="used"}')


@dataclass(frozen=True)
class SoakSettings:
    """One soak: its load, its request mix and its pass bounds."""

    rate: float = 2.0
    """Poisson arrivals, requests per second."""
    num_requests: int = 600
    seed: int = 0
    """Arrivals, the request mix, prompts and per-request sampling seeds."""
    model: str = "specpipe"
    prompts: str = "bundled"
    """benchmarks.prompts source; the bundled held-out set was never trained on."""
    methods: tuple[str, ...] = ("ar", "redrafter", "rsd-s", "rsd-c", "sd")
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    max_tokens: tuple[int, int] = (8, 48)
    """Inclusive range of a served request's max_tokens."""
    stop_word_fraction: float = 0.1
    """Served requests that also send a stop word ("\\n\\n")."""
    cancel_fraction: float = 0.1
    cancel_after: tuple[int, int] = (1, 4)
    """Inclusive range of streamed responses a cancelled request reads before cancelling."""
    cancel_max_tokens: int = 256
    """Cancelled requests ask for this many tokens (ignore_eos), so they cannot end first."""
    bad_fraction: float = 0.07
    skip_cases: tuple[str, ...] = ()
    """INPUT_CASES left out of the mix."""
    request_timeout_s: float = 120.0
    """A request with no response for this long is lost."""
    grace_s: float = 0.3
    """A stream stays open this long after its FINAL, to catch a second one."""
    settle_timeout_s: float = 15.0
    max_rss_growth_mib: float = 256.0
    max_in_flight: int = 128
    """Threads (one stream each); beyond this, sends wait for a free one."""

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a finite number > 0 requests/s, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("cancel_fraction", "bad_fraction", "stop_word_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.cancel_fraction + self.bad_fraction > 1:
            raise ValueError(f"cancel_fraction + bad_fraction = {self.cancel_fraction + self.bad_fraction} > 1")
        for name in ("max_tokens", "cancel_after"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo} {hi}")
        unknown = set(self.skip_cases) - set(INPUT_CASES)
        if unknown:
            raise ValueError(f"skip_cases {sorted(unknown)} are not among {list(INPUT_CASES)}")
        if not self.methods or not self.temperatures:
            raise ValueError("give at least one method and one temperature")


@dataclass(frozen=True)
class SoakTarget:
    """A running server: its endpoints and, when local, its process (for the RSS check)."""

    grpc_url: str
    metrics_url: str
    engine_dir: Path
    """The served engine, read for its limits and tokenizer."""
    stub_pid: int | None = None
    """The engine model's stub process (RSS); None: looked up by the gRPC port among local processes."""


@dataclass
class PlannedRequest:
    case: str
    """"warmup", "served", "cancel", or a name in INPUT_CASES."""
    expect: str
    """"served", "cancelled" or "invalid"."""
    fields: dict[str, Any]
    """make_inputs() keyword arguments."""
    cancel_after: int = 0
    """Streamed responses to read before cancelling (0: not cancelled)."""


@dataclass
class SoakRecord:
    case: str
    expect: str
    method: str | None
    temperature: float | str | None
    """str when not finite (JSON has no NaN)."""
    max_tokens: int | None
    sent: float = 0.0
    """Seconds since the run started."""
    e2e: float | None = None
    outcome: str = ""
    """An OUTCOMES name, or "lost"."""
    finals: int = 0
    responses: int = 0
    output_tokens: int = 0
    error: str | None = None
    text: str | None = None
    """Kept for the greedy comparisons only."""


def plan_requests(settings: SoakSettings, engine: AdmissionCheck) -> tuple[list[PlannedRequest], str]:
    """The seeded request mix, and the greedy reference prompt; every served prompt fits the
    engine's max_input_len with room for cancel_max_tokens within max_seq_len."""
    build = engine.config.build
    if settings.cancel_max_tokens + 1 > build.max_seq_len or settings.max_tokens[1] > settings.cancel_max_tokens:
        raise ValueError(
            f"need max_tokens high {settings.max_tokens[1]} <= cancel_max_tokens {settings.cancel_max_tokens} "
            f"< max_seq_len {build.max_seq_len}: lower them"
        )
    n = settings.num_requests
    bundled = settings.prompts == "bundled"
    candidates = load_prompts(settings.prompts, 2 * n + 32 if bundled else None, settings.seed)
    room = min(build.max_input_len, build.max_seq_len - settings.cancel_max_tokens)
    prompts = [p.text for p in candidates if len(engine.tokenizer.encode(p.text).ids) <= room]
    if not prompts:
        raise ValueError(f"no prompt of {settings.prompts!r} fits in {room} tokens")
    long_prompt = prompts[0]
    while len(engine.tokenizer.encode(long_prompt).ids) <= build.max_input_len:
        long_prompt += long_prompt
    from_engine: dict[str, dict[str, Any]] = {
        "prompt_too_long": {"prompt": long_prompt},
        "max_tokens_over_seq_len": {"max_tokens": build.max_seq_len},
    }
    rng = np.random.default_rng(settings.seed)
    order = rng.permutation(n)
    n_bad, n_cancel = round(n * settings.bad_fraction), round(n * settings.cancel_fraction)
    cases = [c for c in INPUT_CASES if c not in settings.skip_cases]
    cases = [cases[i] for i in rng.permutation(len(cases))]
    case_at = {int(i): cases[j % len(cases)] for j, i in enumerate(order[:n_bad])} if cases else {}
    cancel_at = {int(i) for i in order[n_bad : n_bad + n_cancel]}
    plans = []
    for i in range(n):
        temperature = float(rng.choice(settings.temperatures))
        fields: dict[str, Any] = {
            "prompt": prompts[i % len(prompts)],
            "max_tokens": int(rng.integers(settings.max_tokens[0], settings.max_tokens[1] + 1)),
            "method": str(rng.choice(settings.methods)),
            "temperature": temperature,
            "seed": int(rng.integers(0, 2**31)) if temperature > 0 else None,
        }
        stop_word = rng.random() < settings.stop_word_fraction
        if i in case_at:
            case = case_at[i]
            expect, changes = INPUT_CASES[case]
            if case == "temperature_tiny":
                fields["prompt"] = prompts[0]
            fields |= changes | from_engine.get(case, {})
            plans.append(PlannedRequest(case, expect, fields))
        elif i in cancel_at:
            fields |= {"max_tokens": settings.cancel_max_tokens, "ignore_eos": True}
            k = int(rng.integers(settings.cancel_after[0], settings.cancel_after[1] + 1))
            plans.append(PlannedRequest("cancel", "cancelled", fields, cancel_after=k))
        else:
            plans.append(PlannedRequest("served", "served", fields | ({"stop_words": ["\n\n"]} if stop_word else {})))
    return plans, prompts[0]


def _is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _take_finish(record: SoakRecord, done: Completion) -> None:
    record.outcome = done.finish_reason if done.finish_reason in OUTCOMES else "error"
    record.output_tokens = done.stats.get("num_output_tokens", 0)
    record.finals = 1


def _finite(x: float | None) -> float | str | None:
    return str(x) if x is not None and not math.isfinite(x) else x


def send_request(url: str, model: str, plan: PlannedRequest, record: SoakRecord, settings: SoakSettings) -> None:
    """One request on its own stream; fills `record` and never raises or blocks for longer
    than the timeouts (a request cancelled after its final response counts as finished)."""
    responses: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()

    def count(_: str) -> None:
        record.responses += 1

    cancel = True  # unless the request ended on its own
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = make_inputs(**plan.fields, stream=True)
        if plan.cancel_after:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
            for _ in range(plan.cancel_after):
                result, error = responses.get(timeout=settings.request_timeout_s)
                if error is not None:
                    raise error
                record.responses += 1
                if _is_final(result):  # NOTE: by construction (cancel_max_tokens) this should not happen
                    reason = result.as_numpy("finish_reason")
                    record.outcome, record.finals = reason.reshape(-1)[0].decode(), 1
                    cancel = False
                    return
            record.outcome = "cancelled"  # by the stream's cancellation below
            return
        done = stream_completion(client, responses, inputs, model, count, timeout_s=settings.request_timeout_s)
        cancel = False
        record.e2e = time.perf_counter() - start
        _take_finish(record, done)
        if plan.case in KEEP_TEXT:
            record.text = done.text
        time.sleep(settings.grace_s)
        record.finals += sum(r is not None and _is_final(r) for r, _ in list(responses.queue))
    except queue.Empty:
        record.outcome = "lost"
    except InferenceServerException as e:
        cancel = False  # an error response is the request's FINAL
        record.outcome, record.error = error_outcome(e, record.responses), e.message()
    except Exception as e:  # a soak records failures; it never dies of one
        record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
    finally:
        close_stream(client, cancel, settings.request_timeout_s)


def error_outcome(error: InferenceServerException, responses_before: int) -> str:
    """The outcome of a streamed error: "error" when the RPC itself failed (it has a gRPC
    status: connection lost, server gone), "rejected" (UNAVAILABLE) by the server's message,
    "invalid" when it is the request's first response (refused at admission), else "error"."""
    if error.status() is not None:
        return "error"
    if any(marker in error.message() for marker in UNAVAILABLE_MARKERS):
        return "rejected"
    return "invalid" if responses_before == 0 else "error"


def close_stream(client: grpcclient.InferenceServerClient, cancel: bool, timeout_s: float) -> None:
    """Cancel the stream (`stop_stream(cancel_requests=True)`), or close it the way a client
    does after its FINAL: half-close and wait for the server to end it, cancelling if that
    takes longer than `timeout_s` (so a request that is over is never also cancelled)."""
    if not cancel:
        closer = threading.Thread(target=client.stop_stream, daemon=True)
        closer.start()
        closer.join(timeout_s)
        cancel = closer.is_alive()
    with contextlib.suppress(Exception):  # a racing graceful close may have cleared the stream
        if cancel:
            client.stop_stream(cancel_requests=True)
        client.close()


def run_requests(
    target: SoakTarget, settings: SoakSettings, plans: list[PlannedRequest], at: list[float], progress: bool = False
) -> tuple[list[SoakRecord], float]:
    """Send plan i at time at[i]; returns the records and the run's duration."""
    records = [
        SoakRecord(
            p.case, p.expect, p.fields.get("method"), _finite(p.fields.get("temperature")), p.fields.get("max_tokens")
        )
        for p in plans
    ]
    bar = tqdm(total=len(plans), desc=f"soak {settings.rate:g} req/s", unit="req", disable=not progress)
    lock = threading.Lock()
    start = time.perf_counter()

    def one(i: int) -> None:
        records[i].sent = time.perf_counter() - start
        send_request(target.grpc_url, settings.model, plans[i], records[i], settings)
        with lock:
            bar.update(1)
            if records[i].outcome in ("lost", "error"):
                bar.set_postfix_str(f"last failure: {records[i].outcome}")

    with ThreadPoolExecutor(max_workers=settings.max_in_flight) as pool:
        for i, when in enumerate(at):
            time.sleep(max(0.0, when - (time.perf_counter() - start)))
            pool.submit(one, i)
    bar.close()
    return records, time.perf_counter() - start


def scrape_metrics(url: str) -> dict[str, float]:
    """specpipe_* samples of the metrics endpoint ({} when it cannot be read)."""
    try:
        return read_metrics(url)
    except OSError:
        return {}


def requests_total(metrics: dict[str, float], outcome: str) -> float | None:
    return metrics.get(f'specpipe_requests_total{{outcome="{outcome}"}}')


def wait_until(metrics_url: str, done: Callable[[dict[str, float]], bool], timeout_s: float) -> dict[str, float]:
    """Poll the metrics until `done(metrics)` or the timeout; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while not done(m := scrape_metrics(metrics_url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return m


def idle(metrics: dict[str, float]) -> bool:
    return all(metrics.get(g) == 0 for g in GAUGES)


def engine_stub_pid(grpc_url: str, model: str) -> int | None:
    """The engine model's Python-backend stub (`/<model>/1/model.py`, TritonServer.stub_script)
    under the local tritonserver listening on this gRPC port; None unless exactly one."""
    port = f"--grpc-port={grpc_url.rsplit(':', 1)[-1]}"
    procs = [p for p in list_processes() if p.alive]
    servers = {
        p.pid for p in procs if p.cmdline.split(" ", 1)[0].endswith("tritonserver") and port in p.cmdline.split()
    }
    stubs = [p.pid for p in procs if p.ppid in servers and f"/{model}/1/model.py" in p.cmdline]
    return stubs[0] if len(stubs) == 1 else None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def warm_up(target: SoakTarget, settings: SoakSettings, prompt: str) -> dict[str, str]:
    """One greedy request per method, one after another (a small queue refuses none):
    method -> its text, the reference for temperature_tiny. Raises if one is not served."""
    texts = {}
    for method in settings.methods:
        fields = {"prompt": prompt, "max_tokens": GREEDY_TOKENS, "ignore_eos": True, "method": method}
        record = SoakRecord("warmup", "served", method, 0.0, GREEDY_TOKENS)
        send_request(target.grpc_url, settings.model, PlannedRequest("warmup", "served", fields), record, settings)
        if record.outcome != "length":
            raise RuntimeError(f"warm-up request ({method}) failed: {record.outcome} {record.error or ''}")
        texts[method] = record.text or ""
    return texts


def run_soak(target: SoakTarget, settings: SoakSettings, progress: bool = True) -> dict[str, Any]:
    """Warm up, soak, settle, check; the summary (with `checks` and `passed`) and the records."""
    engine = AdmissionCheck.for_engine(target.engine_dir)
    plans, reference = plan_requests(settings, engine)
    greedy = warm_up(target, settings, reference)
    before = wait_until(target.metrics_url, idle, settings.settle_timeout_s)
    stub = target.stub_pid or engine_stub_pid(target.grpc_url, settings.model)
    rss_before = rss_mib(stub)
    at = ArrivalProcess(settings.rate, "poisson", seed=settings.seed).schedule(len(plans))
    records, duration = run_requests(target, settings, plans, at, progress)
    client = Counter(r.outcome for r in records)

    def settled(m: dict[str, float]) -> bool:
        return idle(m) and all(_delta(m, before, o) == client[o] for o in OUTCOMES)

    after = wait_until(target.metrics_url, settled, settings.settle_timeout_s)
    summary = summarize(records, before, after, duration, settings)
    summary["rss_mib"] = rss_report(stub, rss_before, rss_mib(stub), settings.max_rss_growth_mib)
    summary["checks"] = checks(summary, records, greedy)
    summary["passed"] = all(c["status"] != "fail" for c in summary["checks"])
    summary["rows"] = [asdict(r) for r in records]
    return summary


def _delta(after: dict[str, float], before: dict[str, float], outcome: str) -> int | None:
    a, b = requests_total(after, outcome), requests_total(before, outcome)
    return None if a is None or b is None else round(a - b)


def rss_report(pid: int | None, before: float | None, after: float | None, bound: float) -> dict[str, Any]:
    growth = None if before is None or after is None else after - before
    return {"pid": pid, "before": before, "after": after, "growth": growth, "bound": bound}


def summarize(
    records: list[SoakRecord],
    before: dict[str, float],
    after: dict[str, float],
    duration: float,
    settings: SoakSettings,
) -> dict[str, Any]:
    client = Counter(r.outcome for r in records)
    sends = sorted(r.sent for r in records)
    tokens = sum(r.output_tokens for r in records)
    e2e = [r.e2e for r in records if r.e2e is not None]
    return {
        "sent": len(records),
        "completed": client["length"] + client["stop"],
        "cancelled": client["cancelled"],
        "invalid": client["invalid"],
        "rejected": client["rejected"],
        "errors": client["error"],
        "lost": client["lost"],
        "double_final": sum(r.finals > 1 for r in records),
        "counters": {
            o: {"client": client[o], "server": _delta(after, before, o), "match": client[o] == _delta(after, before, o)}
            for o in OUTCOMES
        },
        "gauges_end": {g: after.get(g) for g in GAUGES},
        "engine_up": after.get(ENGINE_UP_GAUGE),
        "duration_s": duration,
        "offered_rate": settings.rate,
        "achieved_rate": (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None,
        "completion_rate": (client["length"] + client["stop"]) / duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "e2e_s": {f"p{q}": float(np.percentile(e2e, q)) if e2e else None for q in (50, 90, 99)},
        "error_messages": sorted({r.error for r in records if r.error and r.outcome == "error"})[:20],
    }


def checks(summary: dict[str, Any], records: list[SoakRecord], greedy: dict[str, str]) -> list[dict[str, str]]:
    """Every check: name, status (pass | fail | unknown) and what was seen."""

    def check(name: str, ok: bool | None, detail: str) -> dict[str, str]:
        return {"check": name, "status": "unknown" if ok is None else "pass" if ok else "fail", "detail": detail}

    wrong = Counter(f"{r.case}->{r.outcome}" for r in records if r.outcome not in _allowed(r.expect))
    tiny = [r for r in records if r.case == "temperature_tiny" and r.outcome != "rejected"]
    tiny_bad = [r for r in tiny if r.outcome != "length" or r.text != greedy.get(str(r.method))]
    mismatched = {o: c for o, c in summary["counters"].items() if not c["match"]}
    rss, up = summary["rss_mib"], summary["engine_up"]
    return [
        check("no request lost", summary["lost"] == 0, f"{summary['lost']} lost"),
        check("one FINAL each", summary["double_final"] == 0, f"{summary['double_final']} with a second FINAL"),
        check("counters match", not mismatched, f"mismatched: {mismatched}" if mismatched else "every outcome"),
        check("expected outcomes", not wrong, f"unexpected: {dict(wrong)}" if wrong else "all"),
        check(
            "temperature 1e-38 is greedy",
            None if not tiny else not tiny_bad,
            f"{len(tiny) - len(tiny_bad)}/{len(tiny)} served with the greedy text",
        ),
        check("gauges back to 0", idle(summary["gauges_end"]), str(summary["gauges_end"])),
        check(
            "RSS growth bounded",
            None if rss["growth"] is None else rss["growth"] <= rss["bound"],
            "stub not found" if rss["growth"] is None else f"{rss['growth']:+.1f} MiB (bound {rss['bound']:g})",
        ),
        check(
            "engine up", None if up is None else up == 1, f"{ENGINE_UP_GAUGE} = {up}" if up is not None else "no gauge"
        ),
    ]


def _allowed(expect: str) -> tuple[str, ...]:
    """Outcomes that are right for a request meant to be `expect` (a full queue may refuse any)."""
    return {"served": ("length", "stop", "rejected"), "cancelled": ("cancelled", "rejected")}.get(expect, (expect,))


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    s, rss = meta["settings"], summary["rss_mib"]
    failed = [c["check"] for c in summary["checks"] if c["status"] == "fail"]
    achieved = summary["achieved_rate"]
    lines = [
        "# Soak test",
        "",
        f"`{meta['engine_dir']}` served at `{meta['grpc_url']}`: {summary['sent']} requests, Poisson arrivals at "
        f"{s['rate']:g} req/s (achieved {achieved or 0:.2f}) over {summary['duration_s']:.1f} s; methods "
        f"{', '.join(s['methods'])}; temperatures {', '.join(f'{t:g}' for t in s['temperatures'])}; max_tokens "
        f"{s['max_tokens'][0]}-{s['max_tokens'][1]}; {s['cancel_fraction']:.0%} cancelled after "
        f"{s['cancel_after'][0]}-{s['cancel_after'][1]} responses; {s['bad_fraction']:.0%} unusual inputs.",
        "",
        "**PASS**" if not failed else f"**FAIL**: {', '.join(failed)}",
        "",
        "| check | status | detail |",
        "|---|---|---|",
        *[f"| {c['check']} | {c['status']} | {c['detail']} |" for c in summary["checks"]],
        "",
        "| outcome | client | server counter delta | match |",
        "|---|---:|---:|---|",
        *[
            f"| {o} | {c['client']} | {c['server']} | {'yes' if c['match'] else 'NO'} |"
            for o, c in summary["counters"].items()
        ],
        f"| lost | {summary['lost']} | | |",
        f"| double FINAL | {summary['double_final']} | | |",
        "",
        f"Sent {summary['sent']}: completed {summary['completed']}, cancelled {summary['cancelled']}, invalid "
        f"{summary['invalid']}, rejected {summary['rejected']}, errors {summary['errors']}, lost {summary['lost']}, "
        f"double FINAL {summary['double_final']}. {summary['output_tokens']} tokens out "
        f"({summary['output_tokens_per_s']:.1f} tok/s). Completed requests' latency (send to FINAL): "
        + ", ".join(f"{q} {v:.1f} s" for q, v in summary["e2e_s"].items() if v is not None)
        + "; at a rate the server sustains it stays near a request's own generation time.",
        "",
        f"Gauges at the end: {summary['gauges_end']}; {ENGINE_UP_GAUGE} = {summary['engine_up']}.",
        "",
        f"RSS of the engine's stub process (pid {rss['pid']}): {_mib(rss['before'])} after warm-up, "
        f"{_mib(rss['after'])} at the end (bound on growth {rss['bound']:g} MiB).",
    ]
    if summary["error_messages"]:
        lines += ["", "Errors:", *[f"- {e}" for e in summary["error_messages"]]]
    if meta.get("command"):
        lines += ["", f"Reproduce: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def _mib(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f} MiB"


def _pair(kind: type) -> Any:
    return {"nargs": 2, "type": kind, "metavar": ("LOW", "HIGH")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    d = SoakSettings()
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_args(ap)  # --engine, --model-name, --device and the runtime flags of a started server
    g = ap.add_argument_group("soak (--engine is also read for its limits and tokenizer when --url is given)")
    flag = g.add_argument
    flag("--url", help="gRPC host:port of a running server that serves --engine (default: start one on free ports)")
    flag(
        "--metrics-url", default="http://localhost:8002/metrics", help="its metrics, with --url (default: %(default)s)"
    )
    flag("--rate", type=float, default=d.rate, help="Poisson arrivals, requests/s (default: %(default)s)")
    flag("--duration", type=float, default=300.0, help="seconds of arrivals: rate x duration requests (default: 300)")
    flag("--num-requests", type=int, help="send this many requests instead of rate x duration")
    flag("--seed", type=int, default=d.seed, help="seeds arrivals, the mix, prompts, sampling (default: %(default)s)")
    flag("--prompts", default=d.prompts, help="bundled (held-out, never trained on) | MT-Bench .jsonl | ShareGPT .json")
    flag("--methods", default=",".join(d.methods), help="decoding methods drawn from (default: %(default)s)")
    flag("--temperatures", default="0,0.7,1.0", help="temperatures drawn from; > 0 gets a seed (default: %(default)s)")
    flag("--max-tokens", **_pair(int), default=d.max_tokens, help="a served request's max_tokens range (default: 8 48)")
    flag(
        "--stop-word-fraction",
        type=float,
        default=d.stop_word_fraction,
        help='served requests that also send the stop word "\\n\\n" (default: 0.1)',
    )
    flag("--cancel-fraction", type=float, default=d.cancel_fraction, help="requests the client cancels (default: 0.1)")
    flag("--cancel-after", **_pair(int), default=d.cancel_after, help="streamed responses read first (default: 1 4)")
    flag(
        "--cancel-max-tokens",
        type=int,
        default=d.cancel_max_tokens,
        help="cancelled requests' max_tokens, ignore_eos (default: 256)",
    )
    flag(
        "--bad-fraction",
        type=float,
        default=d.bad_fraction,
        help="unusual inputs, cycling through every --skip-case name (default: 0.07)",
    )
    flag("--skip-case", action="append", default=[], choices=list(INPUT_CASES), help="leave a case out; repeatable")
    flag("--request-timeout", type=float, default=d.request_timeout_s, help="s with no response: lost (default: 120)")
    flag(
        "--settle-timeout",
        type=float,
        default=d.settle_timeout_s,
        help="s to wait for gauges and counters to settle (default: 15)",
    )
    flag(
        "--max-rss-growth-mib",
        type=float,
        default=d.max_rss_growth_mib,
        help="bound on the engine stub's RSS growth from after warm-up to the end (default: 256)",
    )
    flag("--max-in-flight", type=int, default=d.max_in_flight, help="client threads, one stream each (default: 128)")
    flag("--no-progress", action="store_true", help="no progress bar")
    flag("--out", type=Path, default=Path("benchmarks/results/soak"), help="writes <out>.json, <out>.md")
    args = ap.parse_args(argv)
    try:
        settings = SoakSettings(
            rate=args.rate,
            num_requests=args.num_requests or max(1, math.ceil(args.rate * args.duration)),
            seed=args.seed,
            model=args.model_name,
            prompts=args.prompts,
            methods=tuple(args.methods.split(",")),
            temperatures=tuple(float(t) for t in args.temperatures.split(",")),
            max_tokens=(args.max_tokens[0], args.max_tokens[1]),
            stop_word_fraction=args.stop_word_fraction,
            cancel_fraction=args.cancel_fraction,
            cancel_after=(args.cancel_after[0], args.cancel_after[1]),
            cancel_max_tokens=args.cancel_max_tokens,
            bad_fraction=args.bad_fraction,
            skip_cases=tuple(args.skip_case),
            request_timeout_s=args.request_timeout,
            settle_timeout_s=args.settle_timeout,
            max_rss_growth_mib=args.max_rss_growth_mib,
            max_in_flight=args.max_in_flight,
        )
        with contextlib.ExitStack() as stack:
            if args.url:
                target = SoakTarget(args.url, args.metrics_url, args.engine)
            else:
                run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specpipe-soak-")))
                print(f"starting tritonserver on {args.engine} ...", flush=True)
                server = stack.enter_context(TritonServer(serving_config(args), run_dir))
                target = SoakTarget(server.grpc_url, server.metrics_url, args.engine, server.stub_pid)
            summary = run_soak(target, settings, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError, InferenceServerException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = summary.pop("rows")
    meta = {
        "engine_dir": str(args.engine),
        "grpc_url": target.grpc_url,
        "settings": asdict(settings),
        "machine": machine(),
        "command": shlex.join(["python", "-m", "benchmarks.soak", *argv]),
    }
    write_report(args.out, meta, rows, markdown(summary, meta), summary=summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
