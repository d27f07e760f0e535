"""The OpenAI-compatible API, end to end with the official `openai` client: `python -m
triton_repo.openai` under real uvicorn, starting a real tritonserver on the demo ReDrafter
engine (one server for the module). Greedy text and log probs equal the in-process runtime's,
streamed or not, for completions and chat; bad parameters are 400 with the engine's own
message; an unknown model is 404; a failure inside the engine is 500 (or an error event once
a stream has started); no Triton is 503; a client that goes away frees the engine (Triton's
`specpipe_*` gauges); the README's curl commands work as written."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="needs the OpenAI client: pip install openai (requirements.txt)")
pytest.importorskip("tritonclient.grpc", reason="needs the Triton client: pip install tritonclient[grpc,http]")
import openai

from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.faults import ENV
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams
from tests.demo_engines import demo_redrafter_engine
from tests.host_tools import skip_without_tritonserver
from triton_repo.metrics import read_metrics
from triton_repo.openai import __main__ as cli
from triton_repo.openai.launch import OpenAIFrontend
from triton_repo.server import free_ports

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL = "specpipe"
MAX_TOKENS = 16
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "system", "content": "Fibonacci numbers"}, {"role": "user", "content": PROMPT}]
CHAT_PROMPT = "# Fibonacci numbers\n" + PROMPT
"""What the demo model's chat template (models/demo-target/tokenizer_config.json) makes of CHAT."""
FAIL_AT_START, FAIL_MIDWAY = 4242, 4243
"""Seeds of requests the engine fails (runtime/faults.py): at their first token, after it."""
SLOW = 4244
"""Seed of requests whose every step the engine makes 50 ms longer (runtime/faults.py)."""


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_redrafter_engine(tmp_path_factory, BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512))


@pytest.fixture(scope="module")
def engine(engine_dir: Path) -> LoadedEngine:
    return LoadedEngine.load(engine_dir)


@dataclass
class Served:
    frontend: OpenAIFrontend
    metrics_url: str
    """Triton's metrics endpoint, with the engine's `specpipe_*` gauges."""


@pytest.fixture(scope="module")
def served(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`python -m triton_repo.openai --engine ...`: starts Triton, then serves on a free port."""
    skip_without_tritonserver()
    run_dir = tmp_path_factory.mktemp("openai")
    http, grpc, metrics = free_ports(3)
    args = ["--engine", str(engine_dir), "--run-dir", str(run_dir), "--log-level", "warning"]
    args += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    faults = {ENV: f"sample:{FAIL_AT_START},verify:{FAIL_MIDWAY},slow:{SLOW}"}  # only requests with these seeds fail
    with OpenAIFrontend(args, run_dir / "frontend.log", env=faults) as running:
        yield Served(running, f"http://localhost:{metrics}/metrics")


@pytest.fixture(scope="module")
def client(served: Served) -> Any:
    return openai.OpenAI(base_url=served.frontend.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def runtime(engine: LoadedEngine) -> LLMEngine:
    """The in-process engine the served text must equal (lossless: any speculation mode)."""
    return LLMEngine(engine, RuntimeConfig(max_batch_size=1, speculation="fixed"))


def solo(runtime: LLMEngine, prompt: str, max_tokens: int = MAX_TOKENS) -> GenerationResult:
    engine = runtime.engine
    return runtime.generate([engine.encode(prompt)], [SamplingParams(max_tokens=max_tokens, logprobs=True)])[0]


def solo_text(runtime: LLMEngine, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return runtime.engine.decode(solo(runtime, prompt, max_tokens).output_ids)


def test_greedy_completions_equal_the_runtime_streamed_or_not(client: Any, runtime: LLMEngine) -> None:
    expected = solo_text(runtime, PROMPT)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(runtime.engine.encode(PROMPT)) and done.usage.completion_tokens == MAX_TOKENS
    spec = done.model_extra["speculation"]
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] and spec["mean_tokens_per_step"] >= 1
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_greedy_chat_equals_the_runtime_on_the_templated_prompt(client: Any, runtime: LLMEngine) -> None:
    expected = solo_text(runtime, CHAT_PROMPT)
    done = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.content == expected and done.choices[0].message.role == "assistant"
    assert done.usage.prompt_tokens == len(runtime.engine.encode(CHAT_PROMPT))
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_stop_strings_end_the_text(client: Any, runtime: LLMEngine) -> None:
    # auto-regressive: a speculative step's random draws depend on the tree the load-aware policy chose
    kw = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "extra_body": {"method": "ar"},
    }
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
    full = solo_text(runtime, PROMPT)
    word = "list"
    assert word in full, "the stop string must occur in the greedy text for this test to mean anything"
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[word])
    assert done.choices[0].text == full[: full.index(word)] and done.choices[0].finish_reason == "stop"


def test_log_probs_are_the_runtime_ones(client: Any, runtime: LLMEngine) -> None:
    expected = solo(runtime, PROMPT).output_log_probs
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    lp = done.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4) and len(expected) == MAX_TOKENS
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0
    assert lp.top_logprobs[1] == {lp.tokens[1]: lp.token_logprobs[1]}  # the chosen token only
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, stream=True,
    )  # fmt: skip
    content = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in content] == pytest.approx(expected, abs=1e-4)
    assert all(t.top_logprobs == [] and bytes(t.bytes).decode() == t.token for t in content)


BAD = [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),  # the engine's own words, through Triton
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"max_tokens": 5000}, "max_seq_len 512"),
    ({"extra_body": {"method": "medusa"}}, "method 'medusa' is not one of"),
    ({"n": 2}, "n must be 1"),
    ({"logprobs": 3}, "logprobs must be 0 or 1"),
    ({"max_tokens": 2**40}, "max_tokens must be in [-2147483648, 2147483647]"),
    ({"extra_body": {"best_of_n": 2}}, "Unrecognized request argument supplied: best_of_n"),
    ({"extra_body": {"max_tokens": "8"}}, "max_tokens: Input should be a valid integer"),
]


def error_of(e: openai.APIStatusError) -> dict[str, Any]:
    """The `error` object of the response (the client keeps it as `body`)."""
    assert isinstance(e.body, dict)
    return e.body


@pytest.mark.parametrize(("kw", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_parameters_are_400_with_the_message(client: Any, kw: dict[str, Any], message: str) -> None:
    for stream in (False, True):  # a stream is answered once Triton has: refusals keep their status
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", stream=stream, **kw)
        assert err.value.status_code == 400 and message in error_of(err.value)["message"], err.value.body


def test_chat_refusals_and_unknown_models(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be 0"):
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="role tool is not supported"):  # the template refuses it
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="x")
    assert error_of(err.value)["code"] == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_failure_inside_the_engine_is_500_or_an_error_event(client: Any) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    for stream in (False, True):  # before any output: the status says it
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(seed=FAIL_AT_START, stream=stream, **kw)
        assert err.value.status_code == 500 and "fault injected at sample" in error_of(err.value)["message"]
    with pytest.raises(openai.InternalServerError):
        client.completions.create(seed=FAIL_MIDWAY, **kw)
    texts = []
    with pytest.raises(openai.APIError, match="fault injected at verify"):  # streaming: an error event
        for chunk in client.completions.create(seed=FAIL_MIDWAY, stream=True, **kw):
            texts.append(chunk.choices[0].text)
    assert texts, "the stream had started: its status was 200 already"
    assert client.completions.create(**kw).choices[0].finish_reason == "length"  # the server goes on


def engine_gauges(served: Served) -> dict[str, float]:
    return read_metrics(served.metrics_url, timeout_s=30)


def wait_until_freed(served: Served, cancelled_before: float) -> None:
    """Until the engine counts one more cancelled request and runs none."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = engine_gauges(served)
        cancelled = m.get('specpipe_requests_total{outcome="cancelled"}', 0.0)
        if cancelled > cancelled_before and m["specpipe_running_requests"] == 0:
            assert m['specpipe_kv_blocks{state="used"}'] == 0
            return
        time.sleep(0.1)
    pytest.fail(f"the abandoned request still runs: {m}")


def wait_until_running(served: Served) -> None:
    """Until the engine gauges show the one open request (they lag the engine by up to 0.1 s)."""
    deadline = time.monotonic() + 10
    while (m := engine_gauges(served))["specpipe_running_requests"] != 1:
        assert time.monotonic() < deadline, f"the open request does not run: {m}"
        time.sleep(0.02)


def test_a_client_that_goes_away_frees_the_engine(client: Any, served: Served) -> None:
    """The request is slowed (seed SLOW: >= 4 s for its 400 tokens) so that it cannot finish
    before the client leaves, however fast the machine: unslowed, ReDrafter's drafts made its
    400 tokens take ~0.2 s, and it sometimes ended before the server saw the stream close."""
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "seed": SLOW}
    long |= {"extra_body": {"ignore_eos": True}}
    before = engine_gauges(served).get('specpipe_requests_total{outcome="cancelled"}', 0.0)
    stream = client.completions.create(stream=True, **long)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    wait_until_running(served)  # the gauges are published every 0.1 s: the first read may predate the request
    stream.close()  # closes the HTTP response: the server closes its Triton stream
    wait_until_freed(served, before)
    with pytest.raises(openai.APITimeoutError):  # non-streaming: the client gives up waiting
        client.with_options(timeout=0.5).completions.create(**long)
    wait_until_freed(served, before + 1)


def readme_curl(name: str) -> str:
    """The README's curl command that follows the `# <name>` comment line, continuation lines joined."""
    text = README.read_text()
    match = re.search(rf"# {re.escape(name)}\n(curl .*?[^\\])\n", text, re.S)
    assert match, f"README has no curl command after '# {name}'"
    return match[1].replace("\\\n", " ")


def test_readme_curl_commands_work_as_written(served: Served, runtime: LLMEngine) -> None:
    """Only the port differs: the README's server listens on 9000, this one on a free port."""
    port = served.frontend.port
    run = lambda cmd: subprocess.run(  # noqa: E731
        ["bash", "-c", cmd.replace("localhost:9000", f"localhost:{port}")], capture_output=True, text=True, timeout=120
    )
    done = run(readme_curl("openai-completion"))
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    prompt, max_tokens = body_of(readme_curl("openai-completion"))
    assert body["choices"][0]["text"] == solo_text(runtime, prompt, max_tokens)
    streamed = run(readme_curl("openai-chat-stream"))
    events = [line[len("data: ") :] for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def body_of(curl: str) -> tuple[str, int]:
    doc = json.loads(shlex.split(curl)[shlex.split(curl).index("-d") + 1])
    return doc["prompt"], doc["max_tokens"]


def test_exit_codes_match_the_triton_launcher() -> None:
    from triton_repo import server

    assert (cli.EXIT_STOPPED, cli.EXIT_START_FAILED, cli.EXIT_SERVING_FAILED) == (
        server.EXIT_STOPPED,
        server.EXIT_START_FAILED,
        server.EXIT_SERVING_FAILED,
    )


def test_without_triton_requests_are_503(tmp_path: Path) -> None:
    """Attached to a Triton that is not there: the API runs, and says the engine is unavailable."""
    nobody = free_ports(1)[0]
    args = ["--triton-url", f"localhost:{nobody}", "--log-level", "warning"]
    with OpenAIFrontend(args, tmp_path / "frontend.log", ready_path="/v1/models") as door:
        client = openai.OpenAI(base_url=door.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="x")
        assert err.value.status_code == 503 and "UNAVAILABLE" in error_of(err.value)["message"]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://{door.url}/health/ready", timeout=30)
        assert health.value.code == 503
