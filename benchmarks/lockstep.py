"""Speed against auto-regression, measured in lockstep: an AR engine and one engine per
configuration, all on the same loaded weights, step in turn, so every configuration meets
the same machine at the same moments.

    python -m benchmarks.lockstep --engine engines/demo-redrafter --batch 1 --temperature 1 \\
        redrafter "redrafter@runtime.speculation_policy.EXPLORERS=0" "redrafter:fixed[beam_width=1]"

A configuration is `METHOD[:SPECULATION][[KEY=VALUE,...]][@MODULE.ATTR=VALUE;...]`: a decoding
method, its speculation (`load-aware`, the default, or `fixed`), its method's settings over
the engine's (as `--fixed-also` of `benchmarks.batch_sweep`: `[beam_width=1]`, one-beam
chains), and module attributes set around each of its steps (and restored after), so
variants of a policy constant run side by side in one process. Each round (seeded apart)
every engine decodes the same `--batch` held-out prompts of `--max-tokens` tokens (EOS
ignored). A configuration's ratio is its tokens per second of its own step time over AR's:
overall, and per round (median, range, standard error).

Why: runs of their own, even alternating, read one configuration 3-10% apart from itself on
a shared 2-core VM (AR against itself: 0.96 vs 1.07 ms a step); in lockstep, stepping in a
fixed cyclic order read two identical configurations 2.3% apart (the engine that steps
after another meets the caches it warmed: the drafter's weights, shared), so the order
rotates by round and reverses every other cycle. At T=0 every configuration's output is
checked against AR's. Writes `<out>.json` and `<out>.md`.

`--turns rounds`: each engine runs its whole round alone, in the same rotating order, as a
server of its own would: no other engine's step comes between two of its own. Stepping in
turn, every step meets the caches the engine before it left. Lyanna at batch 1, T=0, 12
rounds each way (session 38): AR's plain step took 1.094 ms stepping in turn and 0.999 in
whole rounds, the fixed 4-node chain's drafting step 1.914 and 1.663, load-aware's 2.232 and
1.814; the chain read 1.208x AR against 1.265x, load-aware 1.072x against 1.188x. Whole
rounds pay for it with the machine's drift between rounds: a wider spread (the chain's
standard error 0.019 against 0.011).

Where each configuration's time goes: its steps by kind (prefilling, drafting: some request
verified a tree, plain: neither), each kind's steps, share of the configuration's step time
and milliseconds a step in each phase of `runtime.step_clock` (schedule, draft, assemble,
forward, verify, commit, emit), AR's beside them. Stepping in turn, each engine meets the
caches the others left, so the milliseconds read higher than a run of its own: compare them
across configurations of one run.

Sizes chosen: each configuration's request-steps by the tree size its policy gave them in the
timed rounds (`SpeculationPolicy.chosen`), so a load-aware configuration's choices sit beside
its speed.

First tokens: a round's requests all arrive at its start (a burst), and each configuration
times a request's first token on its own step clock (the seconds of its own steps from the
round's start through the step that gave it): the median request, and a round's last.
ReDrafter at batch 32, T=0 (session 39): trees that came before prompts held the round's last
first token back (`runtime.engine_core.PROMPTS_FIRST`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from tqdm import tqdm

from benchmarks.batch_sweep import parse_settings
from benchmarks.report import command, machine, write_report
from benchmarks.timing import add_decoding_arguments, round_params, warm_up
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine
from runtime.request import Request
from runtime.results import tokens_per_step
from runtime.step_clock import PHASES
from training.corpus import heldout_prompts

Patch = tuple[ModuleType, str, Any]
STEP_KINDS = ("prefill", "drafting", "plain")
"""Kinds of step (module docstring): one that prefilled (drafting or not), one in which some
request verified a tree, and a decoding step with neither."""


@dataclass(frozen=True)
class Config:
    name: str
    method: str
    speculation: str
    patches: tuple[Patch, ...]
    settings: tuple[tuple[str, Any], ...] = ()
    """The method's settings over the engine's (`LLMEngine.add_request`'s)."""

    def apply(self) -> list[Patch]:
        """Set the patches; returns what they replaced (to `restore`)."""
        old = [(module, attr, getattr(module, attr)) for module, attr, _ in self.patches]
        for module, attr, value in self.patches:
            setattr(module, attr, value)
        return old

    @contextmanager
    def patched(self) -> Iterator[None]:
        """The patches set for the block, what they replaced restored after it (however it ends)."""
        old = self.apply()
        try:
            yield
        finally:
            restore(old)


def restore(old: list[Patch]) -> None:
    for module, attr, value in reversed(old):
        setattr(module, attr, value)


SYNTAX = "METHOD[:load-aware|fixed][[KEY=VALUE,...]][@MODULE.ATTR=VALUE;...]"


def parse_config(text: str) -> Config:
    """`METHOD[:SPECULATION][[KEY=VALUE,...]][@MODULE.ATTR=VALUE;...]`; a setting's VALUE as
    `parse_settings` reads it, a patch's a Python literal. Raises ValueError naming what is
    wrong."""
    main, _, patch = text.partition("@")
    main, bracket, rest = main.partition("[")
    if bracket and not rest.endswith("]"):
        raise ValueError(f"config {text!r}: the method's settings end with ']', as in redrafter:fixed[beam_width=1]")
    try:
        settings = parse_settings(rest[:-1]) if bracket else {}
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"config {text!r}: {e}") from e
    method, _, speculation = main.partition(":")
    speculation = speculation or "load-aware"
    if not method or speculation not in ("load-aware", "fixed"):
        raise ValueError(f"config {text!r}: expected {SYNTAX}")
    patches = []
    for item in filter(None, patch.split(";")):
        target, sep, value = item.partition("=")
        module_name, _, attr = target.rpartition(".")
        if not sep or not module_name:
            raise ValueError(f"config {text!r}: {item!r} is not MODULE.ATTR=VALUE")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"config {text!r}: module {module_name} has no {attr!r}")
        try:
            literal = ast.literal_eval(value)
        except Exception as e:
            raise ValueError(f"config {text!r}: {value!r} is not a Python literal ({e})") from e
        patches.append((module, attr, literal))
    return Config(text, method, speculation, tuple(patches), tuple(settings.items()))


@dataclass
class Row:
    config: str
    method: str
    speculation: str
    ratio: float
    """Tokens per second of its summed step time over AR's, all rounds."""
    median: float
    least: float
    most: float
    stderr: float
    """Standard error of the mean of the per-round ratios."""
    per_round: list[float]
    tokens_per_step: float
    steps: int
    same_as_ar: bool | None
    """At T=0: every request's output equals AR's (None at T > 0)."""
    tokens_per_second: float = 0.0
    """Its tokens over its summed step time, all rounds (AR's: the machine's speed that hour)."""
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Step kind (`STEP_KINDS`, those it had) -> its steps, share of the step time, and
    milliseconds a step in all and in each phase (`StepPhases.summary`)."""
    first_token_ms: float = 0.0
    """Milliseconds of its own steps from a round's start (every request of the round
    arrives then) to a request's first token, median over every request of every round."""
    last_first_token_ms: float = 0.0
    """The same for the last request of each round to get its first token, median over rounds."""
    sizes: dict[int, int] = field(default_factory=dict)
    """Tree size (root included; 1: no drafting) -> request-steps its policy gave that size
    in the timed rounds (`SpeculationPolicy.chosen`): what load-aware speculation chose."""


@dataclass
class StepPhases:
    """One configuration's steps of one kind: how many, and their seconds in each phase."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, phases: dict[str, float]) -> None:
        self.steps += 1
        for phase, seconds in phases.items():
            self.seconds[phase] += seconds

    def summary(self, total: float) -> dict[str, Any]:
        """Steps, share of `total` seconds, milliseconds a step and in each phase."""
        per = 1e3 / max(self.steps, 1)
        return {
            "steps": self.steps,
            "share": round(sum(self.seconds.values()) / total, 4) if total else 0.0,
            "ms": round(per * sum(self.seconds.values()), 4),
            "phases_ms": {phase: round(per * seconds, 4) for phase, seconds in self.seconds.items()},
        }


def step_kind(llm: LLMEngine, step: tuple[int, int, int]) -> str | None:
    """The kind (`STEP_KINDS`) of the step `llm` just took, from its clock's counters before
    it (`step`: `counters(llm)`); None for a step that ran no forward."""
    prefills, decodes, plain = step
    now_prefills, now_decodes, now_plain = counters(llm)
    if now_prefills > prefills:
        return "prefill"
    if now_decodes == decodes:
        return None
    return "plain" if now_plain > plain else "drafting"


def tally(kinds: dict[str, StepPhases], llm: LLMEngine, before: tuple[int, int, int]) -> None:
    """The step `llm` just took into `kinds`, by its kind (`step_kind`; `before`: `counters(llm)`
    before it); nothing for a step that ran no forward."""
    if (kind := step_kind(llm, before)) is not None:
        kinds.setdefault(kind, StepPhases()).add(llm.clock.step)


def counters(llm: LLMEngine) -> tuple[int, int, int]:
    """(prefilling steps, decoding steps, plain steps) so far on `llm`'s clock."""
    kinds = llm.clock.kinds
    prefill, decode = kinds.get("prefilling"), kinds.get("decoding")
    return (prefill.steps if prefill else 0), (decode.steps if decode else 0), llm.clock.plain_steps


def prepared(
    engine: LoadedEngine, configs: dict[str, Config], batch: int, prompt: list[int], temperature: float
) -> dict[str, LLMEngine]:
    """One engine per configuration on `engine`'s weights, calibrated and warmed up on
    `prompt` with its patches set. Raises ValueError naming the configuration whose method
    or setting the engine does not take (the engine's message names the fix)."""
    engines = {}
    for name, config in configs.items():
        try:
            with config.patched():
                llm = LLMEngine(engine, RuntimeConfig(max_batch_size=batch, speculation=config.speculation))
                llm.prepare()
                warm_up(llm, prompt, config.method, temperature, **dict(config.settings))
        except ValueError as e:
            raise ValueError(f"config {name!r}: {e}") from e
        engines[name] = llm
    return engines


def in_turn(engines: dict[str, LLMEngine], round_: int, whole: bool = False) -> Iterator[tuple[str, LLMEngine]]:
    """Each engine that has unfinished requests, in turn, until none has: the order rotates
    by `round_` and reverses every other cycle of rounds, so each engine steps after each
    other as often (the one that steps after another meets the caches it warmed). `whole`:
    each engine's every step of the round before the next engine's (`--turns rounds`)."""
    keys = list(engines)
    order = keys[round_ % len(keys) :] + keys[: round_ % len(keys)]
    if (round_ // len(keys)) % 2:
        order.reverse()
    if whole:
        for k in order:
            while engines[k].has_unfinished():
                yield k, engines[k]
        return
    while any(engines[k].has_unfinished() for k in order):
        for k in order:
            if engines[k].has_unfinished():
                yield k, engines[k]


def add_round(
    llm: LLMEngine,
    method: str,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    round_: int,
    **settings: Any,
) -> list[Request]:
    """Round `round_`'s requests of `prompts` (`round_params`: seeded apart by round), added to
    `llm` with the method's `settings` over the engine's."""
    params = round_params(len(prompts), max_tokens, temperature, round_)
    return [llm.add_request(p, s, method, **settings) for p, s in zip(prompts, params, strict=True)]


def lockstep(
    engines: dict[str, LLMEngine],
    configs: dict[str, Config],
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    rounds: int,
    kinds: dict[str, dict[str, StepPhases]] | None = None,
    whole: bool = False,
    first_tokens: dict[str, list[list[float]]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[int]], dict[str, list[list[int]]], dict[str, list[Request]]]:
    """Per configuration (AR's key "ar" included): seconds and tokens of each round, and the
    outputs and requests of all rounds; into `kinds` (if given), its steps by kind; into
    `first_tokens` (if given), each round's seconds of its own steps until each request's
    first token (the requests of a round all arrive at its start: a burst). `whole`: whole
    rounds in turn (`in_turn`)."""
    seconds = {k: [0.0] * rounds for k in engines}
    tokens = {k: [0] * rounds for k in engines}
    outputs: dict[str, list[list[int]]] = {k: [] for k in engines}
    done: dict[str, list[Request]] = {k: [] for k in engines}
    keys = list(engines)
    for r in tqdm(range(rounds), desc="lockstep rounds"):
        requests = {
            k: add_round(
                engines[k], configs[k].method, prompts, max_tokens, temperature, r, **dict(configs[k].settings)
            )
            for k in keys
        }
        waiting = {k: list(requests[k]) for k in keys}  # no first token yet
        for k, llm in in_turn(engines, r, whole):
            before = counters(llm)
            with configs[k].patched():
                start = time.perf_counter()
                llm.step()
                seconds[k][r] += time.perf_counter() - start
            if kinds is not None:
                tally(kinds.setdefault(k, {}), llm, before)
            if first_tokens is not None and any(q.result.output_ids for q in waiting[k]):
                first_tokens.setdefault(k, [[] for _ in range(rounds)])[r] += [
                    seconds[k][r] for q in waiting[k] if q.result.output_ids
                ]
                waiting[k] = [q for q in waiting[k] if not q.result.output_ids]
        for k in keys:
            tokens[k][r] = sum(len(q.result.output_ids) for q in requests[k])
            outputs[k] += [q.result.output_ids for q in requests[k]]
            done[k] += requests[k]
    return seconds, tokens, outputs, done


def measure(
    engine_dir: str | Path,
    parsed: list[Config],
    batch: int,
    temperature: float,
    rounds: int,
    max_tokens: int = 64,
    prompts: int | None = None,
    device: str = "cpu",
    whole: bool = False,
) -> tuple[list[Row], int]:
    """AR (first row) and each of `parsed` in lockstep on `engine_dir`'s weights: a row each,
    and the held-out prompts a round (`prompts`, default the batch, at least 8). Raises
    ValueError naming a configuration the engine does not take."""
    configs = {"ar": Config("ar", "ar", "fixed", ())} | {c.name: c for c in parsed}
    engine = LoadedEngine.load(engine_dir, device=device)
    count = prompts or max(batch, 8)  # at batch 1, one prompt a round read 0.79-1.05 between rounds
    encoded = [engine.encode(t) for t in heldout_prompts(count)]
    engines = prepared(engine, configs, batch, encoded[0], temperature)
    chosen_before = {name: llm.policy.chosen.copy() for name, llm in engines.items()}  # (the warm-up's)
    kinds: dict[str, dict[str, StepPhases]] = {}
    firsts: dict[str, list[list[float]]] = {}
    seconds, tokens, outputs, done = lockstep(
        engines, configs, encoded, max_tokens, temperature, rounds, kinds, whole, firsts
    )
    ar_rate = sum(tokens["ar"]) / sum(seconds["ar"])
    rows = []
    for name, config in configs.items():
        per_round = [(n / s) / (a / t) for n, s, a, t in zip(tokens[name], seconds[name], tokens["ar"], seconds["ar"],
                                                              strict=True)]  # fmt: skip
        rows.append(
            Row(
                config=name,
                method=config.method,
                speculation=config.speculation,
                ratio=round(sum(tokens[name]) / sum(seconds[name]) / ar_rate, 4),
                median=round(statistics.median(per_round), 4),
                least=round(min(per_round), 4),
                most=round(max(per_round), 4),
                stderr=round(statistics.stdev(per_round) / len(per_round) ** 0.5, 4) if len(per_round) > 1 else 0.0,
                per_round=[round(x, 4) for x in per_round],
                tokens_per_step=round(tokens_per_step([q.result for q in done[name]]), 3),
                steps=sum(q.result.num_forwards for q in done[name]),
                same_as_ar=outputs[name] == outputs["ar"] if temperature == 0 else None,
                tokens_per_second=round(sum(tokens[name]) / sum(seconds[name]), 1),
                kinds=by_kind(kinds.get(name, {})),
                first_token_ms=round(statistics.median(t for run in firsts[name] for t in run) * 1e3, 2),
                last_first_token_ms=round(statistics.median(max(run) for run in firsts[name]) * 1e3, 2),
                sizes=sizes_chosen(chosen_before[name], engines[name].policy.chosen),
            )
        )
    return rows, count


def sizes_chosen(before: Counter[tuple[str, int]], after: Counter[tuple[str, int]]) -> dict[int, int]:
    """Request-steps by tree size between two readings of `SpeculationPolicy.chosen`."""
    sizes: Counter[int] = Counter()
    for (_, size), n in (after - before).items():
        sizes[size] += n
    return dict(sorted(sizes.items()))


def by_kind(kinds: dict[str, StepPhases]) -> dict[str, dict[str, Any]]:
    """`Row.kinds` of one configuration's steps by kind, in `STEP_KINDS` order."""
    total = sum(sum(k.seconds.values()) for k in kinds.values())
    return {kind: kinds[kind].summary(total) for kind in STEP_KINDS if kind in kinds}


TURNS = {"steps": "step in turn", "rounds": "run each round alone in turn (`--turns rounds`)"}
"""How the engines take turns (`--turns`), as a report says it."""
TITLES = {"steps": "in lockstep", "rounds": "in whole rounds in turn"}
"""A report's title by `--turns`."""
CACHES = {"steps": " (stepping in turn: each engine meets the caches the others left)", "rounds": ""}
"""What the step milliseconds met, by `--turns`."""


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        f"# Speed against auto-regression, {TITLES[meta.get('turns', 'steps')]}",
        "",
        f"Engine `{meta['engine']}`, batch {meta['batch']}, T={meta['temperature']:g}, {meta['prompts']} held-out "
        f"prompts a round of {meta['max_tokens']} tokens (EOS ignored), {meta['rounds']} rounds; an AR engine and "
        f"one engine per configuration on the same weights {TURNS[meta.get('turns', 'steps')]} (the order rotates "
        "by round and reverses every other cycle). Ratio: tokens per "
        "second of a configuration's own step time over AR's. "
        f"Command: `{meta['command']}`",
        "",
        "First token: milliseconds of a configuration's own steps from a round's start, where all its "
        "requests arrive, to a request's first token: the median request, and the median over rounds of "
        "the round's last.",
        "",
        "| configuration | ratio | median of rounds | least-most | stderr | tokens/step/request | first token ms "
        "(median / last) | greedy == AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = "-" if r.same_as_ar is None else ("yes" if r.same_as_ar else "**NO**")
        lines.append(
            f"| `{r.config}` | **{r.ratio:.3f}** | {r.median:.3f} | {r.least:.3f}-{r.most:.3f} | {r.stderr:.3f} "
            f"| {r.tokens_per_step:.2f} | {r.first_token_ms:.1f} / {r.last_first_token_ms:.1f} | {same} |"
        )
    lines += [
        "",
        "## Where the step time goes",
        "",
        "Each configuration's steps by kind: prefill (its forward held prompt chunks), drafting (some request "
        "verified a tree), plain (neither); their share of its step time, and milliseconds a step in all and in "
        f"each phase{CACHES[meta.get('turns', 'steps')]}.",
        "",
        *kinds_table(["configuration"], [([f"`{r.config}`"], r.kinds) for r in rows]),
        "",
        "## Sizes chosen",
        "",
        "Request-steps of each configuration by the tree size (root included; 1: no drafting) its policy gave "
        "them in the timed rounds (-: only the root offered, as for AR).",
        "",
        "| configuration | size: request-steps |",
        "|---|---|",
        *(f"| `{r.config}` | {', '.join(f'{k}: {v}' for k, v in r.sizes.items()) or '-'} |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def kinds_table(leading: list[str], rows: list[tuple[list[str], dict[str, dict[str, Any]]]]) -> list[str]:
    """Markdown lines of steps by kind (`by_kind`): a header of the `leading` columns, then
    kind, steps, share, milliseconds a step in all and in each phase; a line per kind of
    each row, after its leading cells."""
    lines = [
        "| " + " | ".join(leading) + " | kind | steps | share | ms a step | " + " | ".join(PHASES) + " |",
        "|" + "---|" * (len(leading) + 4 + len(PHASES)),
    ]
    for cells, kinds in rows:
        for kind, k in kinds.items():
            phases = " | ".join(f"{k['phases_ms'][p]:.3f}" for p in PHASES)
            lines.append(
                "| " + " | ".join(cells) + f" | {kind} | {k['steps']} | {k['share']:.1%} | {k['ms']:.3f} | {phases} |"
            )
    return lines


def add_turns_argument(ap: argparse.ArgumentParser) -> None:
    """`--turns` (`TURNS`): the engines step in turn, or each runs its whole round alone in turn
    (`in_turn`'s `whole`: `args.turns == "rounds"`)."""
    ap.add_argument(
        "--turns",
        choices=tuple(TURNS),
        default="steps",
        help="steps: the engines step in turn (default); rounds: each runs its whole round alone in turn, as a "
        "server of its own would (no other engine's step between two of its own)",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help=f"{SYNTAX}, one or more")
    ap.add_argument("--engine", default="engines/demo-redrafter", help="(default: %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (default: %(default)s)")
    ap.add_argument(
        "--prompts", type=int, default=None, help="held-out prompts a round (default: the batch, at least 8)"
    )
    add_decoding_arguments(ap, rounds=10)
    add_turns_argument(ap)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lockstep"), help="(default: %(default)s)")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 1 or args.max_tokens < 1 or (args.prompts is not None and args.prompts < 1):
        ap.error("--batch, --prompts, --rounds and --max-tokens must be >= 1")
    try:
        parsed = [parse_config(c) for c in args.configs]
    except (ValueError, ImportError) as e:
        ap.error(str(e))
    try:
        rows, count = measure(args.engine, parsed, args.batch, args.temperature, args.rounds, args.max_tokens,
                              args.prompts, args.device, args.turns == "rounds")  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    meta = {
        "engine": args.engine,
        "batch": args.batch,
        "prompts": count,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "turns": args.turns,
        "command": command("benchmarks.lockstep", argv),
        "machine": machine(),
    }
    write_report(args.out, meta, [asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
