"""The load-aware policy's own host time, from its calls in a real run replayed alone.

    python -m benchmarks.policy_replay record --engine engines/demo-redrafter --batch 8 \\
        --rounds 6 redrafter --recording work_dirs/policy/rd_b8_t0.pkl
    python -m benchmarks.policy_replay replay work_dirs/policy/*.pkl --out benchmarks/results/policy_replay

`record`: a lockstep run (`benchmarks.lockstep`: an AR engine and the configuration's, on the
same weights, stepping in turn) in which every call of the configuration's policy
(`choose`, `observe`, `forget`) is kept with its arguments and what it returned, and the
policy as it stood before the first (after the engine's calibration and warm-up); pickled.
`replay`: each recording's calls, in their order, on a copy of that policy, each timed after
a 48 MB read (the caches a target forward leaves the policy; `--warm`: without, ~4x less),
best of `--reps`: microseconds a step of `choose` (standing decisions and full solves apart),
`observe` and `forget`; how many choices differ from the recorded ones; and a fingerprint of
the policy's state after the last call (every field, recursively, after `learn`), and its
full solves by what ended the decision before each (`speculation_policy.SOLVE_CAUSES`).

Why: in the engine the policy's share of a step is ~3-8% and moves by less than the noise
of a whole run, and a change meant to cut its host work must leave every decision and
estimate as they were. Replaying one recording with the code before and after a change
shows both: the time, alone and cooled as in the engine, and the same fingerprint where
the change is exact (a choice that differs from the recording is expected of a change that
decides differently: the recorded steps then no longer follow from its choices). A
recording holds the policy's own classes: record again after changing their fields (a
field added since is filled with its default), and replay it in the form it was recorded
with (`runtime.native_policy`: compiled, or Python with `SPECPIPE_COMPILED_POLICY=0`; the
two forms leave the same fingerprint). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import pickle
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.lockstep import Config, lockstep, parse_config, prepared
from benchmarks.report import by_count, command, machine, write_report
from benchmarks.timing import add_decoding_arguments
from runtime import native_policy
from runtime.loaded_engine import LoadedEngine
from runtime.speculation_policy import SpeculationPolicy
from training.corpus import heldout_prompts

CALLS = ("choose", "observe", "forget")
"""The policy's calls an engine makes every step (`EngineCore`), recorded and replayed."""
COLD_BYTES = 48 << 20
"""Read before each replayed call: more than this machine's caches, as a forward's weights are."""


@dataclasses.dataclass(frozen=True)
class Row:
    recording: str
    steps: int
    us_per_step: float
    """`choose` + `observe` + `forget` over the recording, per `choose`."""
    choose_standing_us: float
    choose_solving_us: float
    """A `choose` that solved in full, per call (standing: every other, a plain probe's run and
    a step with nothing to decide included)."""
    solves: int
    causes: dict[str, int]
    """Full solves by what ended the decision before them (`speculation_policy.SOLVE_CAUSES`)."""
    observe_us: float
    forget_us: float
    differing_choices: int
    fingerprint: str
    cold: bool


def record(
    engine_dir: str, config: Config, batch: int, temperature: float, max_tokens: int, rounds: int, device: str = "cpu"
) -> dict[str, Any]:
    """A lockstep run of AR and `config` whose policy's calls are kept (module docstring).
    Raises ValueError for a fixed `config` (its policy decides nothing), before loading anything."""
    if config.speculation != "load-aware":
        raise ValueError(f"config {config.name!r}: a fixed policy decides nothing; record a load-aware one")
    engine = LoadedEngine.load(engine_dir, device=device)
    prompts = [engine.encode(t) for t in heldout_prompts(max(batch, 8))]
    configs = {"ar": Config("ar", "ar", "fixed", ()), "recorded": config}
    engines = prepared(engine, configs, batch, prompts[0], temperature)
    policy = engines["recorded"].policy
    start, calls = copy.deepcopy(policy), []
    originals = {name: getattr(SpeculationPolicy, name) for name in CALLS}

    def recorded(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: SpeculationPolicy, *args: Any) -> Any:
            if self is not policy:
                return call(self, *args)
            kept = copy.deepcopy(args)  # before the call: the engine's objects, as they were handed over
            out = call(self, *args)
            calls.append((name, kept, copy.deepcopy(out)))
            return out

        return wrapper

    for name, call in originals.items():
        setattr(SpeculationPolicy, name, recorded(name, call))
    try:
        lockstep(engines, configs, prompts, max_tokens, temperature, rounds)
    finally:
        for name, call in originals.items():
            setattr(SpeculationPolicy, name, call)
    return {
        "policy": start,
        "calls": calls,
        "config": config.name,
        "batch": batch,
        "temperature": temperature,
        "compiled": native_policy.active(),
    }


QUEUES = ("_unlearned", "_plain_unlearned")
"""The policy's queues of steps not learned yet: empty after `learn`, left out of the
fingerprint (a queue added or removed does not change what the policy decided or learned)."""


def fingerprint(policy: SpeculationPolicy) -> str:
    """A hash of every field of `policy`, recursively (dicts by sorted items, floats by
    `repr`: exact), after it learned what it queued (`QUEUES`)."""
    policy.learn()
    assert not any(getattr(policy, name, None) for name in QUEUES), "learn() left steps queued"
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name not in QUEUES}
    return hashlib.sha1((type(policy).__name__ + _canonical(fields)).encode()).hexdigest()[:16]


def _canonical(value: Any) -> str:
    if isinstance(value, dict):
        items = ",".join(sorted(_canonical(k) + ":" + _canonical(v) for k, v in value.items()))
        extra = _canonical(vars(value)) if hasattr(value, "__dict__") else ""  # a dict subclass's own fields
        return "{" + items + "}" + extra
    if isinstance(value, (list, tuple, deque)):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(_canonical(v) for v in value)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return type(value).__name__ + _canonical(fields)
    if hasattr(value, "__dict__"):
        return type(value).__name__ + _canonical(vars(value))
    if (names := getattr(type(value), "__mypyc_attrs__", None)) is not None:  # compiled (`runtime.native_policy`)
        fields = {name: getattr(value, name) for name in names if hasattr(value, name)}
        return type(value).__name__ + _canonical(fields)
    return repr(value)


def _fresh(policy: SpeculationPolicy) -> SpeculationPolicy:
    """A copy of a recorded policy, with any field added since the recording at its default."""
    out = copy.deepcopy(policy)
    for f in dataclasses.fields(out):
        if not hasattr(out, f.name):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(out, f.name, default)
    return out


def load(path: Path) -> dict[str, Any]:
    """A recording, in the form of the policy it was recorded with (`runtime.native_policy`:
    compiled classes and Python ones do not unpickle as each other); SystemExit naming the
    fix where this process runs the other form."""
    compiled = native_policy.active()
    recording: dict[str, Any] = pickle.loads(path.read_bytes())
    if (recorded := bool(recording.get("compiled", False))) != compiled:
        form = {True: "compiled", False: "Python"}
        raise SystemExit(
            f"{path}: recorded with the {form[recorded]} policy, and this process runs the {form[compiled]} one; "
            f"replay it with {native_policy.ENV}={int(recorded)}"
        )
    return recording


def replay(recording: dict[str, Any], name: str, reps: int = 3, cold: bool = True) -> Row:
    """`recording`'s calls on a copy of its policy (module docstring); the best of `reps`."""
    junk = np.ones(COLD_BYTES // 8)
    best: Row | None = None
    for _ in range(reps):
        policy = _fresh(recording["policy"])
        before = policy.solves.copy()  # (the warm-up's, in the recording)
        seconds = dict.fromkeys(("standing", "solving", "observe", "forget"), 0.0)
        counts = dict.fromkeys(seconds, 0)
        differing = 0
        for call, args, out in recording["calls"]:
            args = copy.deepcopy(args) if call != "forget" else args  # (the policy keeps what observe gets)
            if cold:
                junk.sum()
            solved = policy.solves.total()
            start = time.perf_counter()
            got = getattr(policy, call)(*args)
            elapsed = time.perf_counter() - start
            kind = call if call != "choose" else ("solving" if policy.solves.total() > solved else "standing")
            seconds[kind] += elapsed
            counts[kind] += 1
            differing += call == "choose" and got != out
        steps = counts["standing"] + counts["solving"]
        total = sum(seconds.values())
        row = Row(
            recording=name,
            steps=steps,
            us_per_step=round(total / max(steps, 1) * 1e6, 1),
            choose_standing_us=round(seconds["standing"] / max(counts["standing"], 1) * 1e6, 1),
            choose_solving_us=round(seconds["solving"] / max(counts["solving"], 1) * 1e6, 1),
            solves=counts["solving"],
            causes=dict(policy.solves - before),
            observe_us=round(seconds["observe"] / max(counts["observe"], 1) * 1e6, 1),
            forget_us=round(seconds["forget"] / max(counts["forget"], 1) * 1e6, 1),
            differing_choices=differing,
            fingerprint=fingerprint(policy),
            cold=cold,
        )
        if best is None or row.us_per_step < best.us_per_step:
            best = row
    assert best is not None
    return best


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# The load-aware policy's host time, replayed",
        "",
        f"Recorded calls replayed alone, each after a {COLD_BYTES >> 20} MB read"
        f"{'' if meta['cold'] else ' (here: none, warm caches)'}, best of {meta['reps']}; microseconds. "
        "Fingerprint: the policy's whole state after the calls (equal for code that decides and "
        f"learns alike). Command: `{meta['command']}`",
        "",
        "| recording | steps | per step | choose, standing | choose, solving (solves) | solves by cause | observe "
        "| forget | choices differing | fingerprint |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.recording}` | {r.steps} | **{r.us_per_step:.1f}** | {r.choose_standing_us:.1f} "
            f"| {r.choose_solving_us:.1f} ({r.solves}) "
            f"| {by_count(r.causes)} "
            f"| {r.observe_us:.1f} | {r.forget_us:.1f} "
            f"| {r.differing_choices} | `{r.fingerprint}` |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="a lockstep run of AR and a load-aware configuration, its policy's calls kept")
    rec.add_argument("config", help="a load-aware configuration, as benchmarks.lockstep takes them (e.g. redrafter)")
    rec.add_argument("--engine", default="engines/demo-redrafter", help="(default: %(default)s)")
    rec.add_argument("--batch", type=int, default=1, help="requests at once (default: %(default)s)")
    add_decoding_arguments(rec, rounds=6)
    rec.add_argument("--recording", type=Path, required=True, help="where to write the recording (a pickle)")
    rep = sub.add_parser("replay", help="replay recordings: the policy's host time and a fingerprint of its state")
    rep.add_argument("recordings", type=Path, nargs="+", help="files `record` wrote")
    rep.add_argument("--reps", type=int, default=3, help="replays of each, the fastest kept (default: %(default)s)")
    rep.add_argument("--warm", action="store_true", help="no cache-cooling read before each call")
    rep.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/policy_replay"), help="(default: %(default)s)"
    )
    args = ap.parse_args(argv)
    if args.action == "record":
        if args.batch < 1 or args.rounds < 1 or args.max_tokens < 1:
            ap.error("--batch, --rounds and --max-tokens must be >= 1")
        try:
            config = parse_config(args.config)
            kept = record(args.engine, config, args.batch, args.temperature, args.max_tokens, args.rounds, args.device)
        except (ValueError, ImportError) as e:
            ap.error(str(e))
        args.recording.parent.mkdir(parents=True, exist_ok=True)
        args.recording.write_bytes(pickle.dumps(kept))
        print(f"{len(kept['calls'])} calls of {config.name!r} -> {args.recording}")
        return
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    missing = [str(p) for p in args.recordings if not p.is_file()]
    if missing:
        ap.error(f"no such recording: {', '.join(missing)} (write one with `record`)")
    rows = []
    for path in tqdm(args.recordings, desc="replaying"):
        rows.append(replay(load(path), path.stem, args.reps, cold=not args.warm))
    meta = {"reps": args.reps, "cold": not args.warm, "command": command("benchmarks.policy_replay", argv),
            "machine": machine()}  # fmt: skip
    write_report(args.out, meta, [dataclasses.asdict(r) for r in rows], markdown(rows, meta))


if __name__ == "__main__":
    main()
