"""The output stage (`runtime/output.py`) on the demo engines' real tokenizer (byte-level
BPE): deltas add up to the decoded text, multi-byte characters split across tokens come out
whole, stop strings cut the text even when they span tokens or deltas, a stop string is
finish reason "stop" and the engine's events after it add nothing; cancelling with "stop"
ends the request in the engine as "stop", and the CLI's --stop cuts its text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from build.engine import build_engine
from runtime.engine_dir import BuildConfig
from runtime.generate import main
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.output import OutputDelta, RequestOutput, RequestStats
from runtime.request import RequestEvent
from runtime.results import GenerationResult
from runtime.sampling import SamplingParams
from tests.demo_engines import MODELS

TEXT = "def list_files(path): return 'héllo wörld € 😀'"
PROMPT = [0, 1, 2]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODELS / "demo-target" / "tokenizer.json"))  # what engines/demo carries


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def final(tokens: list[int], reason: str, output_ids: list[int], error: str | None = None) -> RequestEvent:
    """The engine's last event: `output_ids` is everything the request generated."""
    result = GenerationResult(PROMPT, list(output_ids), reason, error, num_forwards=5, num_drafted=6)
    result.accepted_per_step = [2, 1]
    return RequestEvent("r", tokens, reason, error, result)


def run(output: RequestOutput, ids: list[int], reason: str = "length", step: int = 1) -> list[OutputDelta]:
    """Feed `ids` `step` tokens per event, the last event final with `reason`."""
    chunks = [ids[i : i + step] for i in range(0, len(ids), step)]
    deltas = [output.push(RequestEvent("r", chunk)) for chunk in chunks[:-1]]
    return [*deltas, output.push(final(chunks[-1], reason, ids))]


@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_add_up_to_the_decoded_text_and_characters_come_out_whole(tokenizer: Tokenizer, step: int) -> None:
    ids = ids_of(tokenizer, TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text must split characters across tokens"
    output = RequestOutput(tokenizer)
    deltas = run(output, ids, step=step)
    assert "".join(d.text for d in deltas) == output.text == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d.text for d in deltas)
    assert [d.num_tokens for d in deltas] == [min(len(ids), step * (i + 1)) for i in range(len(deltas))]
    assert output.token_ids == ids and output.finish_reason == "length"
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_a_stop_string_spanning_tokens_cuts_the_text_and_later_events_add_nothing(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, TEXT)
    stop = "st_fi"  # 'list' + '_' + 'files'
    output = RequestOutput(tokenizer, [stop])
    deltas, hit_at = [], None
    for i, token in enumerate(ids):
        deltas.append(delta := output.push(RequestEvent("r", [token])))
        if delta.stop_hit:
            hit_at = i
            break
    assert hit_at is not None and tokenizer.decode(ids[: hit_at + 1]).endswith("files")
    assert "".join(d.text for d in deltas) == output.text == TEXT[: TEXT.index(stop)] == "def li"
    assert deltas[-1].finish_reason is None, "the request ends with the engine's next event"
    assert output.token_ids == ids[: hit_at + 1]
    late = output.push(RequestEvent("r", ids[hit_at + 1 : hit_at + 3]))  # the engine stepped before the cancel
    assert late == OutputDelta("", [], hit_at + 1)
    last = output.push(final([], "stop", ids[: hit_at + 3]))  # its echo of cancel(id, "stop")
    assert last.text == "" and last.finish_reason == "stop" and not last.stop_hit and last.error is None
    assert last.stats == RequestStats(3, hit_at + 3, 6, 3, 5, (2, 1)), "the engine's work, past the stop string too"
    with pytest.raises(ValueError, match="already finished"):
        output.push(final([], "stop", ids))


@pytest.mark.parametrize("reason", ["length", "cancelled", "error"])
def test_a_stop_string_is_finish_reason_stop_whatever_ended_the_request_after_it(
    tokenizer: Tokenizer, reason: str
) -> None:
    ids = ids_of(tokenizer, TEXT)
    output = RequestOutput(tokenizer, ["files"])
    deltas = [output.push(RequestEvent("r", ids[:5]))]
    assert deltas[0].stop_hit
    last = output.push(final([], reason, ids, "boom" if reason == "error" else None))
    assert (last.finish_reason, last.error, output.text) == ("stop", None, "def list_")


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, "x = list_files")  # 'x', ' =', ' list', '_', 'files'
    output = RequestOutput(tokenizer, ["st_q", "list_z"])
    texts = [output.push(RequestEvent("r", [token])).text for token in ids]
    assert texts == ["x", " =", " ", "", "list_file"], "'list', 'list_', then 's' may begin a stop string"
    assert output.push(final([], "length", ids)).text == "s", "the final delta releases what was held back"
    assert output.text == "x = list_files" and output.finish_reason == "length"


def test_a_stop_string_in_the_final_event_ends_it_at_once(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, "héllo wörld")
    output = RequestOutput(tokenizer, ["wö"])  # 'ö' is split across two tokens
    deltas = run(output, ids, reason="length", step=len(ids))
    assert deltas[-1].stop_hit and deltas[-1].finish_reason == "stop" and deltas[-1].text == "héllo "


def test_the_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, TEXT)
    output = RequestOutput(tokenizer, ["path", "list_files", "(p"])
    run(output, ids, step=4)
    assert output.text == "def " and output.finish_reason == "stop"


def test_the_engines_finish_reason_and_error_pass_through(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, "x = 1")
    output = RequestOutput(tokenizer, ["zzz"])
    delta = output.push(final(ids, "error", ids, "boom"))
    assert delta.finished and (delta.finish_reason, delta.error, delta.text) == ("error", "boom", "x = 1")
    assert delta.stats is not None and delta.stats.num_output_tokens == len(ids)
    assert output.result is not None and output.stats == delta.stats


def with_log_probs(ids: list[int], reason: str = "length", step: int = 1) -> list[RequestEvent]:
    """Events feeding `ids` with log prob -(i + 1) for the i-th token (so each is traceable)."""
    lps = [-(i + 1.0) for i in range(len(ids))]
    events = [RequestEvent("r", ids[i : i + step], log_probs=lps[i : i + step]) for i in range(0, len(ids), step)]
    last = events[-1]
    events[-1] = RequestEvent("r", last.tokens, reason, None, final([], reason, ids).result, last.log_probs)
    return events


@pytest.mark.parametrize("step", [1, 2])
def test_log_probs_go_out_with_the_text_of_their_tokens(tokenizer: Tokenizer, step: int) -> None:
    """A token whose character is incomplete has its log prob sent with the delta that
    completes the character; all of them, in order, by the end."""
    ids = ids_of(tokenizer, TEXT)
    output = RequestOutput(tokenizer)
    deltas = [output.push(e) for e in with_log_probs(ids, step=step)]
    assert [lp for d in deltas for lp in d.log_probs] == output.log_probs == [-(i + 1.0) for i in range(len(ids))]
    assert output.cum_log_prob == sum(output.log_probs)
    sent = 0
    for d in deltas:  # the tokens behind the text so far are exactly those whose log probs went out
        sent += len(d.log_probs)
        if not d.finished:
            assert tokenizer.decode(ids[:sent]) == "".join(x.text for x in deltas[: deltas.index(d) + 1])
    held = [d for d in deltas if not d.text]
    assert held and all(not d.log_probs for d in held), "an incomplete character holds its tokens' log probs back"


def test_log_probs_held_with_a_possible_stop_string_prefix_and_cut_with_it(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, "x = list_files")  # 'x', ' =', ' list', '_', 'files'
    output = RequestOutput(tokenizer, ["st_q", "list_z"])
    deltas = [output.push(e) for e in with_log_probs(ids)]
    assert [d.log_probs for d in deltas] == [[-1.0], [-2.0], [], [], [-3.0, -4.0, -5.0]]
    output = RequestOutput(tokenizer, ["st_"])  # begins inside ' list': the tokens before it and ' list' count
    deltas = [output.push(e) for e in with_log_probs(ids)[:4]]
    assert deltas[-1].stop_hit and output.text == "x = li"
    assert output.log_probs == [-1.0, -2.0, -3.0] and output.cum_log_prob == -6.0
    assert output.push(final([], "stop", ids)).log_probs == []


def test_events_without_log_probs_give_none(tokenizer: Tokenizer) -> None:
    output = RequestOutput(tokenizer)
    assert all(not d.log_probs for d in run(output, ids_of(tokenizer, TEXT)))
    assert output.log_probs == [] and output.cum_log_prob == 0.0
    with pytest.raises(ValueError, match="1 log probs for 2 tokens"):
        RequestOutput(tokenizer).push(RequestEvent("r", [5, 6], log_probs=[-1.0]))


def test_bad_use_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        RequestOutput(tokenizer, ["x", ""])
    with pytest.raises(ValueError, match="carries no result"):
        RequestOutput(tokenizer).push(RequestEvent("r", [5], "length"))


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=96)
    return build_engine(MODELS / "demo-target", tmp_path_factory.mktemp("engines") / "demo", build)


def test_cancel_with_stop_ends_the_request_in_the_engine_as_stop(engine_dir: Path) -> None:
    """The contract with `LLMEngine`: on `stop_hit` the caller cancels with "stop"; the engine's
    final event then ends the output, and the engine's own result says "stop" too."""
    engine = LoadedEngine.load(engine_dir)
    llm = LLMEngine(engine)
    output = RequestOutput(engine.tokenizer, ["list of the"])

    def on_event(event: RequestEvent) -> None:
        if output.push(event).stop_hit:
            llm.cancel(event.request_id, "stop")

    llm.add_request(engine.encode("def fibonacci(n):"), SamplingParams(max_tokens=32), "ar", callback=on_event)
    while llm.has_unfinished():
        llm.step()
    assert output.finish_reason == "stop" and output.text.endswith("Return a list of a ")
    assert output.result is not None and output.result.finish_reason == "stop"
    assert output.result.output_ids == output.token_ids, "auto-regressive: nothing generated after the hit"
    assert llm.stats().kv_blocks_used == 0


def test_the_cli_stop_flag_cuts_the_text(engine_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--engine", str(engine_dir), "--prompt", "def fibonacci(n):", "--json", "--max-tokens", "32"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    stop = "list of the"  # 'list', ' of', ' the'
    assert stop in full["text"], "the stop string must occur in the greedy text for this test to mean anything"
    assert main([*args, "--stop", "zzz", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["text"] == full["text"][: full["text"].index(stop)] and cut["finish_reason"] == "stop"
    assert cut["output_ids"] == full["output_ids"][: len(cut["output_ids"])] != full["output_ids"]
