"""`benchmarks/lockstep.py`, run for real on the CPU on a demo engine: AR's row reads 1, a
configuration's patch holds during its steps only and its settings reach its requests,
greedy outputs are checked against AR's, and malformed configurations are refused with what
is wrong."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import lockstep
from benchmarks.lockstep import main, parse_config
from runtime import speculation_policy
from runtime.llm_engine import LLMEngine


def test_configurations_step_in_turn_against_ar(
    engines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int]] = []  # (method of the stepping engine's requests, EXPLORERS during its step)
    widths: set[int] = set()  # the beam widths of its ReDrafter requests
    step = LLMEngine.step

    def spy(self: LLMEngine) -> list:
        requests = [*self.scheduler.running.values(), *self.scheduler.waiting]
        seen.extend((m, speculation_policy.EXPLORERS) for m in {r.method for r in requests})
        widths.update(r.draft_params.beam_width for r in requests if r.method == "redrafter")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", spy)
    before = speculation_policy.EXPLORERS
    out = tmp_path / "lockstep"
    configs = [
        "redrafter",
        "redrafter:fixed",
        "redrafter:fixed[beam_width=1]",
        "ngram@runtime.speculation_policy.EXPLORERS=7",
    ]
    main(["--engine", str(engines["redrafter"]), "--batch", "2", "--max-tokens", "12", "--rounds", "3", *configs,
          "--out", str(out)])  # fmt: skip
    assert before == speculation_policy.EXPLORERS, "a patch outlived its steps"
    assert {x for m, x in seen if m == "ngram"} == {7} and {x for m, x in seen if m != "ngram"} == {before}
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == ["ar", *configs]
    assert widths == {1, 4}  # the engine's beams, and one where the configuration set it
    assert rows["ar"]["ratio"] == 1 and rows["ar"]["per_round"] == [1.0] * 3 and rows["ar"]["tokens_per_step"] == 1
    for r in rows.values():
        assert r["same_as_ar"] is True, r  # greedy: every configuration's output is AR's
        assert r["ratio"] > 0 and len(r["per_round"]) == 3 and r["least"] <= r["median"] <= r["most"]
    for fixed in ("redrafter:fixed", "redrafter:fixed[beam_width=1]"):
        assert rows[fixed]["tokens_per_step"] > 1  # fixed speculation drafts every step
        assert set(rows[fixed]["kinds"]) == {"prefill", "drafting"}  # every decoding step drafts
    assert set(rows["ar"]["kinds"]) == {"prefill", "plain"}  # AR never drafts
    for r in rows.values():  # where the step time goes: the kinds' shares make it whole, the phases each step
        kinds = r["kinds"]
        assert sum(k["share"] for k in kinds.values()) == pytest.approx(1, abs=1e-3)
        for k in kinds.values():
            assert k["steps"] > 0 and sum(k["phases_ms"].values()) == pytest.approx(k["ms"], abs=1e-3)
            assert k["phases_ms"]["forward"] > 0
    assert rows["redrafter:fixed"]["kinds"]["drafting"]["phases_ms"]["draft"] > 0  # its drafter runs there
    # the sizes chosen in the timed rounds: AR offers only the root (no choice to count); fixed
    # one-beam chains their one (largest) size
    assert rows["ar"]["sizes"] == {}
    chains = rows["redrafter:fixed[beam_width=1]"]["sizes"]
    assert len(chains) == 1 and int(next(iter(chains))) > 1
    assert sum(rows["redrafter"]["sizes"].values()) > 0
    text = out.with_suffix(".md").read_text()
    assert "| `redrafter:fixed` |" in text and "| `redrafter:fixed` | drafting |" in text
    assert "## Sizes chosen" in text and "| `ar` | - |" in text


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("redrafter:sometimes", "expected METHOD"),
        ("redrafter@runtime.speculation_policy.NO_SUCH=1", "has no 'NO_SUCH'"),
        ("redrafter@EXPLORERS=1", "is not MODULE.ATTR=VALUE"),
        ("redrafter@runtime.speculation_policy.EXPLORERS=two", "is not a Python literal"),
        ("redrafter:fixed[beam_width=1", r"end with '\]'"),
        ("redrafter:fixed[beam_width]", "expected key=value"),
    ],
)
def test_a_malformed_configuration_is_refused(text: str, wrong: str) -> None:
    with pytest.raises(ValueError, match=wrong):
        parse_config(text)


def test_a_configuration_patches_and_restores() -> None:
    config = parse_config("sd:fixed@runtime.speculation_policy.PROBE_SHARE=0.5")
    assert (config.method, config.speculation, config.settings) == ("sd", "fixed", ())
    assert parse_config("redrafter:fixed[beam_width=1,beam_length=3]").settings == (
        ("beam_width", 1),
        ("beam_length", 3),
    )
    before = speculation_policy.PROBE_SHARE
    old = config.apply()
    assert speculation_policy.PROBE_SHARE == 0.5
    lockstep.restore(old)
    assert before == speculation_policy.PROBE_SHARE
    with pytest.raises(RuntimeError), config.patched():  # restored however the block ends
        assert speculation_policy.PROBE_SHARE == 0.5
        raise RuntimeError
    assert before == speculation_policy.PROBE_SHARE


def test_a_setting_the_method_does_not_take_is_refused(
    engines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--engine", str(engines["redrafter"]), "--rounds", "1", "--max-tokens", "4",
              "redrafter:fixed[beam_wdth=1]", "--out", str(tmp_path / "x")])  # fmt: skip
    assert "takes ['beam_length', 'beam_width', 'packing']; got ['beam_wdth']" in capsys.readouterr().err


def test_whole_rounds_in_turn(engines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--turns rounds`: each engine runs its round's steps with no other engine's step between
    them, the engines one after another in the order that rotates by round; the rows read as
    stepping in turn's do (AR 1, greedy outputs AR's), and the report says how they took turns."""
    stepped: list[str] = []  # the method of each stepping engine's requests, step by step
    step = LLMEngine.step

    def spy(self: LLMEngine) -> list:
        requests = [*self.scheduler.running.values(), *self.scheduler.waiting]
        stepped.append(requests[0].method)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", spy)
    out = tmp_path / "rounds"
    main(["--engine", str(engines["redrafter"]), "--prompts", "2", "--max-tokens", "6", "--rounds", "3",
          "--turns", "rounds", "redrafter", "ngram", "--out", str(out)])  # fmt: skip
    runs = [m for i, m in enumerate(stepped) if i == 0 or stepped[i - 1] != m]  # one entry per unbroken run
    order = ["ar", "redrafter", "ngram"]
    rounds = [*order, *order[1:], *order[:1], *order[2:], *order[:2]]  # whole rounds, the order rotating
    assert runs == [*order, *rounds]  # (after each engine's warm-up)
    assert len(stepped) > len(runs)  # (each run is several steps: 2 prompts of 6 tokens at batch 1)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["meta"]["turns"] == "rounds"
    rows = {r["config"]: r for r in doc["rows"]}
    assert rows["ar"]["ratio"] == 1 and all(r["same_as_ar"] is True for r in rows.values())
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Speed against auto-regression, in whole rounds in turn")
    assert "run each round alone in turn" in text


def test_first_tokens_are_timed_on_each_configurations_own_steps(
    engines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's requests all arrive at its start, and a request's first token is timed on its
    configuration's own step clock. On a clock that reads one second a step, AR at batch 1
    gives 3 prompts of 5 tokens their first tokens after 1, 6 and 11 of its steps (a prefill
    step, then 4 decoding steps each): the median request 6 s, a round's last 11 s; a chain
    that drafts gets its last one sooner."""
    monkeypatch.setattr(lockstep, "time", SimpleNamespace(perf_counter=itertools.count().__next__))
    out = tmp_path / "firsts"
    main(["--engine", str(engines["redrafter"]), "--batch", "1", "--prompts", "3", "--max-tokens", "5", "--rounds",
          "2", "redrafter:fixed[beam_width=1]", "--out", str(out)])  # fmt: skip
    rows = {r["config"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert (rows["ar"]["first_token_ms"], rows["ar"]["last_first_token_ms"]) == (6000, 11000)
    chain = rows["redrafter:fixed[beam_width=1]"]
    assert chain["first_token_ms"] <= 6000 and chain["last_first_token_ms"] < 11000
    assert "| 6000.0 / 11000.0 |" in out.with_suffix(".md").read_text()
