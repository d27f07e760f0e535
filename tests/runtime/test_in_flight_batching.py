"""In-flight batching on the bundled demo models: requests with different prompts, methods,
temperatures and lengths join at different steps; greedy outputs equal each request's
solo output token for token, also when KV pressure forces preemptions; cancellation and
completion return every KV block; a full queue refuses at once; streaming callbacks see
every token once and one final event."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from build.engine import build_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.kv_budget import KVBudget
from runtime.llm_engine import OTHER_THREAD, LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.request import Request, RequestEvent
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFullError, ScheduledWork
from tests.device import TEST_DEVICE
from training.corpus import heldout_prompts

MODELS = Path(__file__).resolve().parents[2] / "models"
BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=640)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LoadedEngine:
    out = tmp_path_factory.mktemp("engines") / "demo-redrafter"
    engine_dir = build_engine(MODELS / "demo-target", out, BUILD, drafter=MODELS / "demo-redrafter")
    return LoadedEngine.load(engine_dir, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def prompts(engine: LoadedEngine) -> list[list[int]]:
    return [engine.encode(t) for t in heldout_prompts(12)]


# (method, temperature, max_tokens, arrival step, overrides) per request
MIX = [
    ("redrafter", 0.0, 24, 0, {}),
    ("ar", 0.0, 17, 0, {}),
    ("redrafter", 0.9, 20, 1, {}),
    ("redrafter", 0.0, 31, 2, {"beam_width": 2, "beam_length": 5}),
    ("ar", 0.7, 12, 2, {}),
    ("redrafter", 0.0, 9, 3, {"beam_width": 8, "beam_length": 3}),
    ("ar", 0.0, 28, 5, {}),
    ("redrafter", 0.0, 22, 5, {}),
    ("redrafter", 0.0, 16, 6, {}),
    ("ar", 0.0, 20, 9, {}),
    ("redrafter", 1.0, 14, 9, {}),
    ("redrafter", 0.0, 26, 12, {"beam_width": 1, "beam_length": 2}),
]


def params_of(i: int) -> SamplingParams:
    _, temperature, max_tokens, _, _ = MIX[i]
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=100 + i)


def solo(engine: LoadedEngine, prompt: list[int], i: int) -> list[int]:
    method, _, _, _, overrides = MIX[i]
    result = LLMEngine(engine, RuntimeConfig(max_batch_size=1)).generate([prompt], [params_of(i)], method, **overrides)
    return result[0].output_ids


def run_mix(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[int, list[int]], dict[int, list[RequestEvent]]]:
    """Submit MIX[i] at its arrival step, step until all finish; outputs and events by index."""
    events: dict[int, list[RequestEvent]] = {i: [] for i in range(len(MIX))}
    requests = {}
    step = 0
    while len(requests) < len(MIX) or engine.has_unfinished():
        for i, (method, _, _, arrival, overrides) in enumerate(MIX):
            if arrival == step:
                requests[i] = engine.add_request(
                    prompts[i], params_of(i), method, callback=events[i].append, request_id=f"mix-{i}", **overrides
                )
        engine.step()
        step += 1
    return {i: r.result.output_ids for i, r in requests.items()}, events


@pytest.fixture(scope="module")
def solo_outputs(engine: LoadedEngine, prompts: list[list[int]]) -> dict[int, list[int]]:
    return {i: solo(engine, prompts[i], i) for i, (_, t, _, _, _) in enumerate(MIX) if t == 0}


@pytest.mark.parametrize("speculation", ["load-aware", "fixed"])
def test_mixed_arrivals_equal_solo_runs(
    engine: LoadedEngine, prompts: list[list[int]], solo_outputs: dict[int, list[int]], speculation: str
) -> None:
    llm = LLMEngine(engine, RuntimeConfig(max_num_tokens=160, speculation=speculation))
    outputs, events = run_mix(llm, prompts)
    for i, expected in solo_outputs.items():
        assert outputs[i] == expected, f"greedy request {i} ({MIX[i][0]}) diverged from its solo run"
    for i, evs in events.items():
        assert [t for e in evs for t in e.tokens] == outputs[i], "streamed tokens = final output"
        assert [e.finished for e in evs].count(True) == 1 and evs[-1].finished
        assert evs[-1].finish_reason in ("length", "stop")
    assert any(len(e.tokens) > 1 for evs in events.values() for e in evs), "speculation emits several per step"
    assert llm.blocks.num_used == 0
    # the clock's split of steps (prompt chunks in the forward or not) holds every step and token
    kinds = llm.clock.kinds
    assert set(kinds) == {"prefilling", "decoding"}
    assert sum(k.steps for k in kinds.values()) == llm.clock.steps
    assert sum(k.tokens for k in kinds.values()) == sum(len(o) for o in outputs.values())
    assert kinds["prefilling"].tokens >= len(MIX)  # every request's first token comes from its prefill


def test_kv_pressure_preempts_and_loses_nothing(
    engine: LoadedEngine, prompts: list[list[int]], solo_outputs: dict[int, list[int]]
) -> None:
    """A cache of 1.5 max-length requests for 8 running ones: requests get preempted and
    recomputed, every one still completes with its solo output."""
    budget = KVBudget(max_tokens=1000)
    llm = LLMEngine(engine, RuntimeConfig(max_num_tokens=160, kv=budget, speculation="fixed"))
    outputs, events = run_mix(llm, prompts)
    assert llm.scheduler.num_preemptions > 0, "the budget must force preemption for this test to mean anything"
    for i, expected in solo_outputs.items():
        assert outputs[i] == expected, f"request {i} changed under preemption"
    assert all(evs[-1].finish_reason in ("length", "stop") for evs in events.values())
    assert llm.blocks.num_used == 0


def test_preempted_decoding_requests_resume_exactly(engine: LoadedEngine, prompts: list[list[int]]) -> None:
    """Eight requests growing to 150 tokens each in a cache of 720 tokens: requests are
    preempted in the middle of decoding, recompute their context and continue with the
    same tokens as when run alone."""
    short = [p[:40] for p in prompts[:8]]
    params = [SamplingParams(max_tokens=110, ignore_eos=True)] * 8
    methods = ["redrafter", "ar"] * 4
    llm = LLMEngine(engine, RuntimeConfig(kv=KVBudget(max_tokens=720), speculation="fixed"))
    requests = [llm.add_request(p, s, m) for p, s, m in zip(short, params, methods, strict=True)]
    while llm.has_unfinished():
        llm.step()
    assert llm.scheduler.num_decode_preemptions > 0
    for p, s, m, r in zip(short, params, methods, requests, strict=True):
        assert r.result.output_ids == LLMEngine(engine).generate([p], [s], m)[0].output_ids
    assert llm.blocks.num_used == 0


def test_cancellation_frees_blocks_and_sends_final_event(engine: LoadedEngine, prompts: list[list[int]]) -> None:
    llm = LLMEngine(engine, RuntimeConfig(speculation="fixed"))
    events: list[RequestEvent] = []
    cancelled = llm.add_request(prompts[0], SamplingParams(max_tokens=200, ignore_eos=True), callback=events.append)
    other = llm.add_request(prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        llm.step()
    assert llm.blocks.table(cancelled.request_id), "running request holds blocks"
    held = len(llm.blocks.table(cancelled.request_id))
    used = llm.blocks.num_used
    llm.cancel(cancelled.request_id)
    llm.step()
    assert not llm.blocks.table(cancelled.request_id)
    assert llm.blocks.num_used <= used - held + len(llm.blocks.table(other.request_id))
    assert events[-1].finish_reason == "cancelled" and sum(e.finished for e in events) == 1
    assert 0 < len(cancelled.result.output_ids) < 200
    while llm.has_unfinished():
        llm.step()
    assert other.result.finish_reason == "length" and len(other.result.output_ids) == 40
    assert llm.blocks.num_used == 0


def test_full_queue_refuses_at_once(engine: LoadedEngine, prompts: list[list[int]]) -> None:
    llm = LLMEngine(engine, RuntimeConfig(max_queue_size=3))
    for p in prompts[:3]:
        llm.add_request(p, SamplingParams(max_tokens=4))
    with pytest.raises(QueueFullError, match="max_queue_size 3"):
        llm.add_request(prompts[3], SamplingParams(max_tokens=4))
    assert len(llm.scheduler.waiting) == 3, "the refused request was not queued"
    llm.step()  # admits the waiting requests: room again
    llm.add_request(prompts[3], SamplingParams(max_tokens=4))


def test_bad_requests_and_budgets_are_refused_clearly(engine: LoadedEngine, prompts: list[list[int]]) -> None:
    llm = LLMEngine(engine)
    with pytest.raises(ValueError, match="max_seq_len 640"):
        llm.add_request(prompts[0], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="max_draft_tokens 64"):
        llm.add_request(prompts[0], SamplingParams(), "redrafter", beam_width=16, beam_length=5)
    with pytest.raises(ValueError, match="unknown method"):
        llm.add_request(prompts[0], SamplingParams(), "medusa")
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLMEngine(engine, RuntimeConfig(kv=KVBudget(max_tokens=200)))
    with pytest.raises(ValueError, match="build limit 8"):
        LLMEngine(engine, RuntimeConfig(max_batch_size=9))


def test_requests_added_from_another_thread_while_stepping(
    engine: LoadedEngine, prompts: list[list[int]], solo_outputs: dict[int, list[int]]
) -> None:
    """A server's shape: one thread steps the engine, others add requests and wait on their events."""
    llm = LLMEngine(engine, RuntimeConfig(max_num_tokens=160))
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if not llm.has_unfinished():
                time.sleep(0.001)
            llm.step()

    stepper = threading.Thread(target=loop, daemon=True)
    stepper.start()
    done = {i: threading.Event() for i in solo_outputs}
    streamed: dict[int, list[int]] = {i: [] for i in solo_outputs}

    def on_event(i: int) -> Callable[[RequestEvent], None]:
        def callback(event: RequestEvent) -> None:
            streamed[i] += event.tokens
            if event.finished:
                done[i].set()

        return callback

    for i in solo_outputs:
        method, _, _, _, overrides = MIX[i]
        llm.add_request(prompts[i], params_of(i), method, callback=on_event(i), **overrides)
        time.sleep(0.01)
    assert all(d.wait(timeout=120) for d in done.values())
    stop.set()
    stepper.join(timeout=10)
    assert streamed == solo_outputs
    assert llm.blocks.num_used == 0


def test_stepping_off_the_thread_that_built_the_engine_is_warned_about_once(
    engine: LoadedEngine, prompts: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """OpenMP's per-thread worker pools make an engine stepped off the thread that built it
    ~2x slower on a CPU (`OTHER_THREAD`); the server builds and steps on its engine thread,
    and anyone who does not hears why, once."""
    llm = LLMEngine(engine, RuntimeConfig())
    params = SamplingParams(max_tokens=4)
    with caplog.at_level("WARNING", logger="runtime.llm_engine"):
        llm.generate([prompts[0]], [params], "ar")
        assert OTHER_THREAD not in caplog.text
        worker = threading.Thread(target=lambda: llm.generate([prompts[0]] * 2, [params] * 2, "ar"))
        worker.start()
        worker.join()
    assert caplog.text.count(OTHER_THREAD) == 1


def decoding(llm: LLMEngine, prompt: list[int]) -> Request:
    """A ReDrafter request of 40 tokens on `prompt`, stepped until it decodes."""
    request = llm.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True), "redrafter")
    while request.in_prefill or not request.result.output_ids:
        llm.step()
    return request


def scheduled(llm: LLMEngine) -> list[tuple[int, int]]:
    """From now on, each step's (prompt tokens of its chunks, tree nodes beyond the roots), as
    `Scheduler.schedule` gives them."""
    steps: list[tuple[int, int]] = []
    schedule = llm.scheduler.schedule

    def recorded(sizes: dict[str, Sequence[int]]) -> list[ScheduledWork]:
        work = schedule(sizes)
        steps.append((sum(item.chunk for item in work), sum(item.budget - 1 for item in work if not item.prefill)))
        return work

    llm.scheduler.schedule = recorded  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("speculation", ["fixed", "load-aware"])
def test_trees_take_only_the_budget_that_waiting_prompts_leave(
    engine: LoadedEngine, prompts: list[list[int]], speculation: str
) -> None:
    """A step serves running requests first, so a decoding request's tree beyond its root
    may take only the token budget that the prompts waiting for it leave
    (`Scheduler.tree_room`): a prompt that arrives while a request drafts is prefilled in
    the same full chunks as beside an auto-regressive one, and where its last chunk leaves
    room the tree is drafted beside it. Output stays auto-regression's."""
    budget = 48
    config = RuntimeConfig(max_batch_size=4, max_num_tokens=budget, max_draft_tokens=24, speculation=speculation)
    llm = LLMEngine(engine, config)
    first = decoding(llm, prompts[0][:20])
    long_prompt = prompts[1][: 2 * (budget - 1) + 5]  # chunks of 47, 47 and 5 beside one decoding root
    second = llm.add_request(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True), "ar")
    steps = scheduled(llm)
    while llm.has_unfinished():
        llm.step()
    chunks = [(chunk, trees) for chunk, trees in steps if chunk]
    assert [chunk for chunk, _ in chunks] == [budget - 1, budget - 1, 5], steps
    done = itertools.accumulate((chunk for chunk, _ in chunks), initial=0)  # prompt tokens in before each chunk
    # the trees of the steps whose prompt was owed more than their chunk
    owed_more = [t for (chunk, t), before in zip(chunks, done, strict=False) if chunk < len(long_prompt) - before]
    assert owed_more == [0, 0], "a tree delayed a prompt"
    if speculation == "fixed":
        assert chunks[-1][1] > 0, "the last chunk left room, and no tree was drafted in it"
    ar = LLMEngine(engine, RuntimeConfig(max_batch_size=1))
    assert first.result.output_ids == ar.generate([prompts[0][:20]], [first.params], "ar")[0].output_ids
    assert second.result.output_ids == ar.generate([long_prompt], [second.params], "ar")[0].output_ids


def test_a_prompt_waiting_for_kv_blocks_holds_up_no_tree(engine: LoadedEngine, prompts: list[list[int]]) -> None:
    """A waiting prompt whose first chunk the free KV blocks cannot hold is not admitted,
    however much budget the step has (`Scheduler.schedule`), so trees beside it take
    nothing it could use: the decoding request drafts while it waits (`Scheduler.tree_room`),
    and both come out as auto-regression's."""
    config = RuntimeConfig(max_batch_size=4, max_num_tokens=160, max_draft_tokens=24, speculation="fixed")
    llm = LLMEngine(engine, config)
    first = decoding(llm, prompts[0][:20])
    long_prompt = (prompts[1] + prompts[2])[:200]  # a first chunk of 160 tokens: 10 blocks
    held = "\0held by others"  # blocks other work holds: 6 stay free
    assert llm.blocks.ensure(held, (llm.blocks.num_free - 6) * llm.blocks.block_size)
    waiting = llm.add_request(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True), "ar")
    steps = scheduled(llm)
    for _ in range(5):
        llm.step()
        assert waiting in llm.scheduler.waiting, "the prompt must wait for blocks for this test to mean anything"
    assert all(trees for _, trees in steps), f"a prompt waiting for KV blocks kept the request from drafting: {steps}"
    llm.blocks.free(held)
    while llm.has_unfinished():
        llm.step()
    ar = LLMEngine(engine, RuntimeConfig(max_batch_size=1))
    assert first.result.output_ids == ar.generate([prompts[0][:20]], [first.params], "ar")[0].output_ids
    assert waiting.result.output_ids == ar.generate([long_prompt], [waiting.params], "ar")[0].output_ids
