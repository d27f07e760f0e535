"""The soak against a real Triton server, short: every request gets exactly one FINAL, the
server's outcome counters equal the client's, the gauges return to 0 and the engine's RSS
stays bounded, with cancellations and every unusual input in the mix. Also: the mix is
what the flags ask for, and the checks fail on a lost request, a second FINAL or a
counter that disagrees."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")

from benchmarks.soak import (
    GAUGES,
    INPUT_CASES,
    PlannedRequest,
    SoakRecord,
    SoakSettings,
    checks,
    idle,
    main,
    plan_requests,
    rss_report,
    scrape_metrics,
    send_request,
    summarize,
    wait_until,
)
from runtime.engine_dir import BuildConfig
from tests.demo_engines import demo_redrafter_engine
from tests.host_tools import skip_without_tritonserver
from triton_repo.inputs import AdmissionCheck
from triton_repo.metrics import OUTCOMES
from triton_repo.repository import ServingConfig
from triton_repo.server import TritonServer


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_redrafter_engine(tmp_path_factory, BuildConfig(max_batch_size=16, max_input_len=256, max_seq_len=640))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    skip_without_tritonserver()
    with TritonServer(ServingConfig(engine_dir=engine_dir), tmp_path_factory.mktemp("triton")) as running:
        yield running


def test_short_soak_passes_every_check(server: TritonServer, engine_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    argv = ["--engine", str(engine_dir), "--url", server.grpc_url, "--metrics-url", server.metrics_url]
    argv += ["--num-requests", "48", "--rate", "4", "--bad-fraction", "0.25", "--cancel-fraction", "0.15"]
    argv += ["--request-timeout", "60", "--no-progress", "--out", str(out)]
    assert main(argv) == 0, out.with_suffix(".md").read_text()
    doc = json.loads(out.with_suffix(".json").read_text())
    status = {c["check"]: c["status"] for c in doc["checks"]}
    assert all(s == "pass" for name, s in status.items() if name != "engine up"), status
    assert status["engine up"] != "fail"  # the gauge may not exist: unknown
    assert doc["sent"] == len(doc["rows"]) == 48 and doc["lost"] == doc["double_final"] == 0
    assert all(c["match"] for c in doc["counters"].values())
    expected = Counter(r["expect"] for r in doc["rows"])
    assert doc["cancelled"] == expected["cancelled"] == 7 and doc["invalid"] == expected["invalid"] >= 10
    assert all(v == 0 for v in doc["gauges_end"].values()) and doc["rss_mib"]["growth"] <= 256
    outcomes = {(r["case"], r["outcome"]) for r in doc["rows"] if r["case"] in INPUT_CASES}
    assert outcomes == {(case, "length" if want == "served" else want) for case, (want, _) in INPUT_CASES.items()}
    assert "**PASS**" in out.with_suffix(".md").read_text()


def test_a_request_without_responses_is_lost_and_cancelled(server: TritonServer) -> None:
    """No response within the timeout: "lost", in bounded time, and the server is told (it
    cancels the request and frees its blocks)."""
    plan = PlannedRequest("served", "served", {"prompt": "def f():", "max_tokens": 200, "ignore_eos": True})
    record = SoakRecord("served", "served", None, None, 200)
    start = time.monotonic()
    send_request(server.grpc_url, "specpipe", plan, record, SoakSettings(request_timeout_s=0.001))
    assert record.outcome == "lost" and record.finals == 0 and time.monotonic() - start < 30
    assert idle(wait_until(server.metrics_url, idle, 30)), scrape_metrics(server.metrics_url)


def test_the_mix_follows_the_settings(engine_dir: Path) -> None:
    engine = AdmissionCheck.for_engine(engine_dir)
    settings = SoakSettings(num_requests=200, bad_fraction=0.1, cancel_fraction=0.1, skip_cases=("top_p_nan",))
    plans, reference = plan_requests(settings, engine)
    cases = Counter(p.case for p in plans)
    assert cases["cancel"] == 20 and sum(cases[c] for c in INPUT_CASES) == 20 and "top_p_nan" not in cases
    assert {c for c in INPUT_CASES if c != "top_p_nan"} <= set(cases)
    assert [p.fields for p in plan_requests(settings, engine)[0]] == [p.fields for p in plans], "seeded"
    build = engine.config.build
    for p in plans:
        tokens = len(engine.tokenizer.encode(p.fields["prompt"]).ids)
        if p.case == "prompt_too_long":
            assert tokens > build.max_input_len
        elif p.expect != "invalid":
            assert p.fields["method"] in settings.methods and p.fields["temperature"] in (0.0, 0.7, 1.0, 1e-38)
            assert 0 < tokens <= build.max_input_len and tokens + p.fields["max_tokens"] <= build.max_seq_len
    assert all(p.fields["prompt"] == reference for p in plans if p.case == "temperature_tiny")


def test_checks_fail_on_lost_double_final_and_counter_mismatch() -> None:
    def record(outcome: str, finals: int = 1) -> SoakRecord:
        return SoakRecord("served", "served", "ar", 0.0, 8, outcome=outcome, finals=finals, output_tokens=8)

    idle = dict.fromkeys(GAUGES, 0.0)
    before = {f'specpipe_requests_total{{outcome="{o}"}}': 0.0 for o in OUTCOMES} | idle
    after = before | {'specpipe_requests_total{outcome="length"}': 3.0}
    good = [record("length"), record("length"), record("length")]
    bad = [record("length", finals=2), record("lost"), record("length")]
    status = {}
    for name, records in (("good", good), ("bad", bad)):
        summary = summarize(records, before, after, 1.0, SoakSettings())
        summary["rss_mib"] = rss_report(1, 100.0, 100.0 + (10 if name == "good" else 500), 256)
        status[name] = {c["check"]: c["status"] for c in checks(summary, records, {})}
    assert set(status["good"].values()) == {"pass", "unknown"}
    failed = {"no request lost", "one FINAL each", "counters match", "expected outcomes", "RSS growth bounded"}
    assert {c for c, s in status["bad"].items() if s == "fail"} == failed
