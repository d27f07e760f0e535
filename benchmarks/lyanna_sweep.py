"""Lyanna ("Make Every Draft Count") §7 on the demo model: conditional acceptance, tau and
speedup vs auto-regression and ReDrafter, the hot-token table, and the one-pass LM head.

    python -m benchmarks.lyanna_sweep                       # all four reports
    python -m benchmarks.lyanna_sweep --only table1,fig13a  # a subset

Engines for the main drafter and every ablation are built from `--target` into
`--engine-dir` (batch 1); ReDrafter runs on `--redrafter-engine` (built there from
`--redrafter` when that directory does not exist). Decoding is one request at a time
(batch 1, fixed speculation) on seeded held-out prompts (`benchmarks.prompts.bundled`,
prompt i sampled with seed i), fixed output length (EOS ignored).

- table1 (paper Table 1): conditional acceptance at steps 1..3, depth 3, width 4, budget
  16, no re-sampling, greedy, for the full drafter and each ablation (`--ablation
  NAME=DIR`: no token info, no first-token fusion, and the full model trained like them,
  the fair reference when the ablations had a shorter training run). Conditional acceptance at step i =
  #decoding steps that accepted >= i drafted tokens / #steps that accepted >= i-1; tau =
  tokens per target forward (bonus included, prefill excluded).
- fig12 (paper Figure 12): tau and speedup at verification budgets B (default 12, 16)
  for Lyanna depth 3 width 4 budget B without re-sampling, with re-sampling + fusion and
  with re-sampling without fusion, and ReDrafter W x L = B (4 x B/4), at temperatures 0
  and 1 (where B > depth x width = 12, which that tree cannot fill, also width
  ceil(B/3) without re-sampling). Speed is measured in the same run: every round times, on each engine, AR, then
  its methods at one B, then AR again, then the next B, ...; a method's ratio within a
  round is its tokens/s over the mean of the two bracketing AR rates on its own engine
  (both engines hold the same target), and the reported speedup is the median over rounds.
  "vs ReDrafter" is the median over rounds of Lyanna's ratio / ReDrafter's ratio at the
  same B. Re-sampling may verify up to `resample_budget` nodes beyond B, so the mean
  verified drafted nodes per step (num_drafted / decoding steps) is reported next to tau.
- table2 (paper Table 2): memory of the dense [V, V] token-info table vs the hot [H, H]
  table (bf16, `hot_table_bytes`), and 3-step top-1 agreement with the target on held-out
  corpus windows (teacher forcing: for every position p the chain runs from (H_p,
  t_{p+1}); step i is right when argmax(l_i + bias(t_{p+i})) = the target's argmax at
  p+i) with the dense low-rank bias, the hot-table bias and no bias.
- fig13a (paper Figure 13a): latency of `draft_chain` + ONE `head_logits` product over
  the k states vs the same chain with the LM head applied after every step (implemented
  here from the drafter's pieces), k = 3, 5, 8, batch 1 and 8; median of `--repeats`.

Writes `<out-dir>/lyanna_{table1,fig12,table2,fig13a}.{json,md}`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from benchmarks.prompts import bundled
from benchmarks.report import machine, torch_threads, write_report
from build.engine import build_engine
from model_defs.llama import Attend
from model_defs.lyanna import LyannaDrafter, _ChainKV, embedding_weight, hot_table_bytes
from runtime.engine import Engine
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine, RuntimeConfig
from runtime.results import GenerationResult, tokens_per_step
from runtime.sampling import SamplingParams
from training import corpus
from training.train_lyanna import ChainBatch
from training.train_target import tokenize

REPORTS = ("table1", "fig12", "table2", "fig13a")
DEFAULT_ABLATIONS = (
    "no-token-info=work_dirs/lyanna-no-token-info",
    "no-fusion=work_dirs/lyanna-no-fusion",
    "full-ablation-run=work_dirs/lyanna-full",
)
"""NAME=DIR of the ablated drafters (and the full model trained like them, the fair reference)."""
ABLATION_LABELS = {
    "no-token-info": "w/o token info",
    "no-fusion": "w/o first-token fusion",
    "full-ablation-run": "full model (ablation training run)",
}
DEPTH, WIDTH, TABLE1_BUDGET = 3, 4, 16
ONE_AT_A_TIME = RuntimeConfig(max_batch_size=1, speculation="fixed")
BUILD = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)
VARIANTS: dict[str, dict[str, bool]] = {
    "no re-sampling": {"resample": False, "fuse": False},
    "re-sampling + fusion": {"resample": True, "fuse": True},
    "re-sampling, no fusion": {"resample": True, "fuse": False},
}
"""Lyanna variants of fig12 (LyannaParams overrides)."""


def steps_of(results: list[GenerationResult]) -> list[int]:
    """Drafted tokens accepted at every decoding step of `results`."""
    return [a for r in results for a in r.accepted_per_step]


def conditional_acceptance(steps: list[int], depth: int) -> list[float]:
    """[depth]: #steps with >= i accepted / #steps with >= i-1 accepted, i = 1..depth (0 when
    no step reached i-1)."""
    out = []
    for i in range(1, depth + 1):
        reached = sum(a >= i - 1 for a in steps)
        out.append(sum(a >= i for a in steps) / reached if reached else 0.0)
    return out


def drafted_per_step(results: list[GenerationResult]) -> float:
    """Mean drafted nodes verified per decoding step (tree nodes without the root)."""
    return sum(r.num_drafted for r in results) / max(1, len(steps_of(results)))


def sampling(num: int, max_tokens: int, temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True) for i in range(num)]


def timed(
    llm: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], method: str, **overrides: Any
) -> tuple[list[GenerationResult], float]:
    """Results and output tokens/s (prefill included, as a user sees it)."""
    start = time.perf_counter()
    results = llm.generate(prompts, params, method, **overrides)
    return results, sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)


def build(target: Path, out: Path, lyanna: Path | None = None, redrafter: Path | None = None) -> Path:
    return build_engine(target, out, BUILD, force=True, lyanna=lyanna, drafter=redrafter)


# ---- table1 -------------------------------------------------------------------------


@dataclass
class Table1Row:
    model: str
    drafter_dir: str
    conditional_acceptance: list[float]
    """Steps 1..depth."""
    reached: list[int]
    """Steps 1..depth: #decoding steps that accepted >= i-1 drafted tokens (the denominators)."""
    tau: float
    steps: int
    drafted_per_step: float


def run_table1(llms: dict[str, tuple[str, LLMEngine]], prompts: list[list[int]], max_tokens: int) -> list[Table1Row]:
    rows = []
    params = sampling(len(prompts), max_tokens, 0.0)
    for name, (path, llm) in tqdm(llms.items(), desc="table1", unit="model"):
        results = llm.generate(
            prompts, params, "lyanna", depth=DEPTH, width=WIDTH, budget=TABLE1_BUDGET, resample=False, fuse=False
        )
        steps = steps_of(results)
        rows.append(
            Table1Row(
                name, path, conditional_acceptance(steps, DEPTH),
                [sum(a >= i - 1 for a in steps) for i in range(1, DEPTH + 1)],
                tokens_per_step(results), len(steps), drafted_per_step(results),
            )
        )  # fmt: skip
        tqdm.write(f"table1 {name}: {rows[-1].conditional_acceptance} tau {rows[-1].tau:.2f}")
    return rows


def table1_markdown(rows: list[Table1Row], meta: dict[str, Any], skipped: list[str]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Table 1: conditional acceptance per drafting step",
        "",
        f"{meta['table1_prompts']} held-out prompts x {meta['max_tokens']} tokens (EOS ignored), greedy, batch 1; "
        f"depth {DEPTH}, width {WIDTH}, budget {TABLE1_BUDGET}, no re-sampling; {m['cpu']}. Step i: #decoding steps "
        "that accepted >= i drafted tokens / #steps that accepted >= i-1 (counts in brackets). tau: tokens per "
        "target forward. "
        f"nodes/step: drafted nodes verified per step (a depth-{DEPTH} width-{WIDTH} tree has at most "
        f"{DEPTH * WIDTH}, so budget {TABLE1_BUDGET} is not binding).",
        "",
        "| model | drafter | step 1 | step 2 | step 3 | tau | nodes/step | decoding steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{a:.3f} ({round(a * n)}/{n})" for a, n in zip(r.conditional_acceptance, r.reached, strict=True)
        )
        lines.append(
            f"| {r.model} | `{r.drafter_dir}` | {cells} | {r.tau:.2f} | {r.drafted_per_step:.1f} | {r.steps} |"
        )
    if skipped:
        lines += ["", "Skipped (drafter directory missing): " + ", ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


# ---- fig12 --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fig12Config:
    engine: str  # "lyanna" | "redrafter"
    variant: str
    budget: int
    width: int = WIDTH

    def overrides(self) -> dict[str, Any]:
        if self.engine == "redrafter":
            return {"beam_width": self.width, "beam_length": self.budget // self.width}
        return {"depth": DEPTH, "width": self.width, "budget": self.budget, **VARIANTS[self.variant]}

    @property
    def method(self) -> str:
        return self.engine


@dataclass
class Fig12Row:
    temperature: float
    method: str
    budget: int
    shape: str
    tau: float
    drafted_per_step: float
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float
    """Median over rounds of tokens/s over the bracketing AR tokens/s (same engine)."""
    vs_redrafter: float
    """Median over rounds of this speedup / ReDrafter's at the same B (1.0 for ReDrafter)."""
    speedup_per_round: list[float] = field(default_factory=list)


@dataclass
class _Timing:
    results: list[GenerationResult] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    ar_rates: list[float] = field(default_factory=list)


def fig12_configs(budgets: list[int]) -> list[Fig12Config]:
    out = []
    for b in budgets:
        if b % WIDTH:
            raise SystemExit(f"error: budget {b} is not a multiple of the width {WIDTH} (ReDrafter W x L = B)")
        out += [Fig12Config("lyanna", v, b) for v in VARIANTS]
        if b > DEPTH * WIDTH:  # width 4 keeps at most DEPTH * WIDTH nodes: also fill the budget
            out.append(Fig12Config("lyanna", "no re-sampling", b, width=-(-b // DEPTH)))
        out.append(Fig12Config("redrafter", "W x L", b))
    return out


def _interleaved(
    llm: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    configs: list[Fig12Config],
    timings: dict[Fig12Config, _Timing],
    bar: tqdm,
) -> None:
    """One round on one engine: AR, the configs of the first B, AR, the next B, ..., AR."""
    _, before = timed(llm, prompts, params, "ar")
    bar.update()
    for budget in dict.fromkeys(c.budget for c in configs):
        rates = {}
        for c in (c for c in configs if c.budget == budget):
            results, rates[c] = timed(llm, prompts, params, c.method, **c.overrides())
            timings[c].results += results
            bar.update()
        _, after = timed(llm, prompts, params, "ar")
        bar.update()
        for c, rate in rates.items():
            t = timings[c]
            t.rates.append(rate)
            t.ar_rates.append((before + after) / 2)
            t.ratios.append(rate / t.ar_rates[-1])
        before = after


def run_fig12(
    lyanna: LLMEngine,
    redrafter: LLMEngine,
    prompts: list[list[int]],
    budgets: list[int],
    temperatures: list[float],
    max_tokens: int,
    rounds: int,
) -> list[Fig12Row]:
    configs = fig12_configs(budgets)
    mine = {
        "lyanna": [c for c in configs if c.engine == "lyanna"],
        "redrafter": [c for c in configs if c.engine == "redrafter"],
    }
    engines = {"lyanna": lyanna, "redrafter": redrafter}
    warm = sampling(1, 8, 1.0)
    for c in configs:  # warm-up: allocator growth, lazy initialisation
        engines[c.engine].generate(prompts[:1], warm, c.method, **c.overrides())
    for llm in engines.values():
        llm.generate(prompts[:1], warm, "ar")
    runs = len(temperatures) * rounds * sum(len(cs) + len(budgets) + 1 for cs in mine.values())
    rows = []
    with tqdm(total=runs, desc="fig12", unit="run") as bar:
        for temperature in temperatures:
            params = sampling(len(prompts), max_tokens, temperature)
            timings = {c: _Timing() for c in configs}
            for r in range(rounds):
                order = ["lyanna", "redrafter"] if r % 2 == 0 else ["redrafter", "lyanna"]
                for name in order:
                    _interleaved(engines[name], prompts, params, mine[name], timings, bar)
            for c in configs:
                t = timings[c]
                ref = timings[Fig12Config("redrafter", "W x L", c.budget)]
                rows.append(
                    Fig12Row(
                        temperature=temperature,
                        method="redrafter" if c.engine == "redrafter" else f"lyanna, {c.variant}",
                        budget=c.budget,
                        shape=f"W={c.width} L={c.budget // c.width}"
                        if c.engine == "redrafter"
                        else f"k={DEPTH} w={c.width}",
                        tau=tokens_per_step(t.results),
                        drafted_per_step=drafted_per_step(t.results),
                        tokens_per_s=statistics.mean(t.rates),
                        ar_tokens_per_s=statistics.mean(t.ar_rates),
                        speedup=statistics.median(t.ratios),
                        vs_redrafter=statistics.median(a / b for a, b in zip(t.ratios, ref.ratios, strict=True)),
                        speedup_per_round=t.ratios,
                    )
                )
                tqdm.write(
                    f"fig12 T={temperature:g} B={c.budget} {rows[-1].method}: tau {rows[-1].tau:.2f}, "
                    f"{rows[-1].speedup:.2f}x AR, {rows[-1].vs_redrafter:.2f}x ReDrafter"
                )
    return rows


def fig12_markdown(rows: list[Fig12Row], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Figure 12: tau and speedup vs AR and ReDrafter at equal verification budgets",
        "",
        f"{meta['num_prompts']} held-out prompts x {meta['max_tokens']} tokens (EOS ignored), batch 1, "
        f"{meta['rounds']} rounds; {m['cpu']} ({m['torch_threads']} threads). Lyanna: depth {DEPTH}, width "
        f"{WIDTH}, budget B; ReDrafter: W x L = {WIDTH} x B/{WIDTH}. Speedup: tokens/s over AR tokens/s on the same "
        "engine (same target), AR timed before and after each B in every round, median over rounds of the "
        "within-round ratio; vs ReDrafter: median over rounds of (Lyanna speedup / ReDrafter speedup). Nodes/step: "
        "drafted nodes actually verified per decoding step (re-sampling may add up to resample_budget = 4 beyond B). "
        f"A depth-{DEPTH} width-{WIDTH} tree has at most {DEPTH * WIDTH} nodes (Algorithm 1 keeps {WIDTH} per level), "
        f"so where B > {DEPTH * WIDTH} a row with width ceil(B/{DEPTH}) that fills the budget is added.",
    ]
    for temperature in sorted({r.temperature for r in rows}):
        lines += [
            "",
            f"## Temperature {temperature:g}",
            "",
            "| B | method | shape | tau | nodes/step | tok/s | AR tok/s | speedup vs AR | vs ReDrafter |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r.temperature == temperature):
            lines.append(
                f"| {r.budget} | {r.method} | {r.shape} | {r.tau:.2f} | {r.drafted_per_step:.1f} "
                f"| {r.tokens_per_s:.1f} | {r.ar_tokens_per_s:.1f} | {r.speedup:.2f}x | {r.vs_redrafter:.2f}x |"
            )
    return "\n".join(lines) + "\n"


# ---- table2 -------------------------------------------------------------------------


@dataclass
class Table2Row:
    bias: str
    table_shape: str
    table_bytes: int
    top1: list[float]
    """Steps 1..3: top-1 agreement with the target's argmax."""


def heldout_ids(engine: Engine) -> torch.Tensor:
    root, files = corpus.stdlib_root(), corpus.load_manifest()
    corpus.verify_manifest(files, root)
    return tokenize(corpus.read_texts(files, root, "test"), engine.tokenizer, engine.eos_token_ids[0])


@torch.inference_mode()
def run_table2(engine: Engine, num_windows: int, seq_len: int) -> tuple[list[Table2Row], dict[str, Any]]:
    drafter, model = engine.lyanna_drafter, engine.model
    assert drafter is not None
    if drafter.token_info is None or not drafter.config.num_hot_tokens:
        raise SystemExit("error: table2 needs a drafter with a token-info embedding and hot tokens")
    embed = model.model.embed_tokens
    vocab, hot = drafter.config.vocab_size, drafter.config.num_hot_tokens
    table = drafter.hot_table(embed, torch.bfloat16)
    ids = heldout_ids(engine)
    k, w = DEPTH, seq_len + DEPTH
    n = min(num_windows, len(ids) // w)
    if n < 1:
        raise SystemExit(f"error: the held-out stream ({len(ids)} tokens) is shorter than one window of {w}")
    correct = {name: torch.zeros(k) for name in ("none", "dense", "hot")}
    starts = torch.arange(seq_len)
    for i in tqdm(range(0, n, 4), desc="table2", unit="4 windows"):
        windows = ids[i * w : min(n, i + 4) * w].view(-1, w)
        batch = ChainBatch(model, windows, starts.expand(len(windows), -1), k, autocast=False)
        base = drafter.head_logits(drafter.draft_chain(batch.h0, batch.t1, embed, k), model.lm_head)  # [N, k, V]
        want = batch.logits.argmax(-1)
        variants = {
            "none": base,
            "dense": base + drafter.token_bias(batch.prev, embed),
            "hot": table.bias(batch.prev.flatten(), base.flatten(0, 1)).view_as(base),
        }
        for name, logits in variants.items():
            correct[name] += (logits.argmax(-1) == want).float().sum(0)
    total = n * seq_len
    top1 = {name: [round(v / total, 4) for v in c.tolist()] for name, c in correct.items()}
    rank = drafter.config.token_info_rank
    rows = [
        Table2Row("dense low-rank E'(t) (all V columns)", f"[{vocab}, {vocab}]", hot_table_bytes(vocab), top1["dense"]),
        Table2Row(f"hot-token table (H = {hot})", f"[{hot}, {hot}]", hot_table_bytes(hot), top1["hot"]),
        Table2Row("no token info", "-", 0, top1["none"]),
    ]
    n_embed = embedding_weight(embed).shape[1]
    extra = {
        "positions": total,
        "windows": n,
        "seq_len": seq_len,
        "hot_tokens": hot,
        "hot_token_coverage": drafter.config.hot_token_coverage,
        "token_info_rank": rank,
        "low_rank_factor_bytes_bf16": (n_embed * rank + rank * vocab + vocab) * 2,
    }
    return rows, extra


def table2_markdown(rows: list[Table2Row], meta: dict[str, Any]) -> str:
    x = meta["table2"]
    cov = x["hot_token_coverage"]
    lines = [
        "# Lyanna Table 2: hot-token sparse vs dense token-info table",
        "",
        f"Held-out corpus, {x['windows']} windows x {x['seq_len']} positions = {x['positions']} chains (teacher "
        "forcing with the target): for every position p the chain runs 3 steps from (H_p, t_{p+1}); step i counts when "
        "argmax(l_i + bias(t_{p+i})) equals the target's argmax at p+i. Memory: the table in bf16 "
        f"(`hot_table_bytes`). H = {x['hot_tokens']} hot tokens"
        + (f" ({cov:.1%} of training-token occurrences)" if cov else "")
        + f"; the rank-{x['token_info_rank']} factors the dense bias is computed from take "
        f"{x['low_rank_factor_bytes_bf16'] / 2**20:.2f} MiB in bf16, but evaluating them costs a [n x d] x [d x V] "
        "product per drafted node.",
        "",
        "| token-info bias | table | memory (bf16) | top-1 step 1 | step 2 | step 3 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = f"{r.table_bytes / 2**20:.0f} MiB" if r.table_bytes else "-"
        cells = " | ".join(f"{a:.3f}" for a in r.top1)
        lines.append(f"| {r.bias} | {r.table_shape} | {mem} | {cells} |")
    return "\n".join(lines) + "\n"


# ---- fig13a -------------------------------------------------------------------------


@dataclass
class Fig13aRow:
    batch: int
    k: int
    one_pass_ms: float
    per_step_ms: float
    ratio: float
    """per-step / one-pass."""


def one_pass_head(
    drafter: LyannaDrafter,
    h0: torch.Tensor,
    t1: torch.Tensor,
    embed: torch.nn.Embedding,
    lm_head: torch.nn.Linear,
    k: int,
) -> torch.Tensor:
    """What the engine runs: `draft_chain`, then ONE `head_logits` product over the k states."""
    return drafter.head_logits(drafter.draft_chain(h0, t1, embed, k), lm_head)


def per_step_head(
    drafter: LyannaDrafter,
    h0: torch.Tensor,
    t1: torch.Tensor,
    embed: torch.nn.Embedding,
    lm_head: torch.nn.Linear,
    k: int,
) -> torch.Tensor:
    """`draft_chain` with the LM head applied after every step: k `[B, D] x [D, V]` products
    (what a drafter that feeds its drafted token back needs) -> logits `[B, k, V]`."""
    x = h0.to(drafter.dtype)
    if drafter.config.first_token_fusion:
        x = torch.cat([x, torch.nn.functional.embedding(t1, embedding_weight(embed)).to(x.dtype)], dim=-1)
    x = drafter.fuse(x)[:, None]
    positions = torch.arange(1, k + 1, device=x.device).expand(x.shape[0], -1)
    cos, sin = drafter.rotary_emb(positions, x.dtype)
    attend = cast(Attend, _ChainKV())
    logits = []
    for i in range(k):
        x = drafter.norm(drafter.layer(x, cos[:, i : i + 1], sin[:, i : i + 1], attend))
        logits.append(drafter.head_logits(x, lm_head))
    return torch.cat(logits, dim=1)


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def run_fig13a(engine: Engine, ks: list[int], batches: list[int], repeats: int) -> list[Fig13aRow]:
    drafter, model = engine.lyanna_drafter, engine.model
    assert drafter is not None
    embed, lm_head = model.model.embed_tokens, model.lm_head
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        h0 = torch.randn(batch, drafter.config.hidden_size, generator=gen)
        t1 = torch.randint(0, drafter.config.vocab_size, (batch,), generator=gen)
        for k in tqdm(ks, desc=f"fig13a batch {batch}", unit="k"):
            torch.testing.assert_close(
                per_step_head(drafter, h0, t1, embed, lm_head, k), one_pass_head(drafter, h0, t1, embed, lm_head, k)
            )  # the two variants compute the same logits
            times: dict[str, list[float]] = {"one": [], "step": []}
            one_pass = functools.partial(one_pass_head, drafter, h0, t1, embed, lm_head, k)
            per_step = functools.partial(per_step_head, drafter, h0, t1, embed, lm_head, k)
            for _ in range(max(1, repeats // 10)):  # alternate blocks: machine noise hits both alike
                times["one"].append(_median_ms(one_pass, 10))
                times["step"].append(_median_ms(per_step, 10))
            one_ms, step_ms = statistics.median(times["one"]), statistics.median(times["step"])
            rows.append(Fig13aRow(batch, k, one_ms, step_ms, step_ms / one_ms))
    return rows


def fig13a_markdown(rows: list[Fig13aRow], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Lyanna Figure 13a: one-pass vs per-step LM head",
        "",
        f"Drafter chain (`draft_chain`) + LM head, {meta['fig13a_repeats']} timed calls per cell (median of medians "
        f"of 10-call blocks, the two variants alternating by block); {m['cpu']} ({m['torch_threads']} threads), "
        "drafter in its engine dtype, LM head the target's. One-pass: ONE [B*k, D] x [D, V] product after the "
        "chain (`head_logits`); per-step: a [B, D] x [D, V] product after every chain step. Both give the same logits.",
        "",
        "| batch | k | one-pass ms | per-step ms | per-step / one-pass |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.batch} | {r.k} | {r.one_pass_ms:.3f} | {r.per_step_ms:.3f} | {r.ratio:.2f}x |")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _only(values: list[str] | None) -> list[str]:
    if not values:
        return list(REPORTS)
    chosen = [v.strip() for text in values for v in text.split(",") if v.strip()]
    bad = sorted(set(chosen) - set(REPORTS))
    if bad:
        raise SystemExit(f"error: --only {','.join(bad)}: choose from {','.join(REPORTS)}")
    return [r for r in REPORTS if r in chosen]


def _ablations(values: list[str] | None) -> dict[str, Path]:
    out = {}
    for text in values if values is not None else list(DEFAULT_ABLATIONS):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --ablation {text!r}: expected NAME=DIR")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lyanna_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--only", action="append", help=f"reports to run, repeatable or comma list of {','.join(REPORTS)}")
    ap.add_argument(
        "--target", type=Path, default=Path("models/demo-target"), help="target checkpoint (default: %(default)s)"
    )
    ap.add_argument(
        "--lyanna", type=Path, default=Path("models/demo-lyanna"), help="main drafter (default: %(default)s)"
    )
    ap.add_argument(
        "--ablation",
        action="append",
        metavar="NAME=DIR",
        help="ablated drafter for table1, repeatable (default: "
        + " ".join(DEFAULT_ABLATIONS)
        + "); a missing DIR is skipped",
    )
    ap.add_argument(
        "--redrafter-engine", type=Path, default=Path("engines/demo-redrafter"),
        help="ReDrafter engine for fig12; built from --redrafter into --engine-dir if missing (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--redrafter", type=Path, default=Path("models/demo-redrafter"), help="ReDrafter drafter (default: %(default)s)"
    )
    ap.add_argument(
        "--engine-dir", type=Path, default=Path("work_dirs/lyanna-engines"),
        help="where the Lyanna engines are built (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=4, help="held-out prompts (default: %(default)s)")
    ap.add_argument(
        "--table1-prompts", type=int, default=16,
        help="held-out prompts for table1 (no timing there, so more of them are cheap) (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2, help="fig12 alternating timing rounds (default: %(default)s)")
    ap.add_argument("--budgets", default="12,16", help="fig12 verification budgets B (default: %(default)s)")
    ap.add_argument("--temperatures", default="0,1.0", help="fig12 temperatures (default: %(default)s)")
    ap.add_argument("--windows", type=int, default=16, help="table2 held-out windows (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="table2 positions per window (default: %(default)s)")
    ap.add_argument("--ks", default="3,5,8", help="fig13a chain lengths k (default: %(default)s)")
    ap.add_argument("--batches", default="1,8", help="fig13a batch sizes (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=300, help="fig13a timed calls per cell (default: %(default)s)")
    ap.add_argument(
        "--out-dir", type=Path, default=Path("benchmarks/results"), help="output dir (default: %(default)s)"
    )
    ap.add_argument(
        "--threads", type=int, default=0,
        help="torch intra-op threads; 0 = torch's default. On a machine shared with other jobs 1 avoids threads "
        "spin-waiting for a descheduled sibling at every op (default: %(default)s)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    with torch_threads(args.threads):
        run(args)


def run(args: argparse.Namespace) -> None:
    reports = _only(args.only)
    start = time.perf_counter()
    meta: dict[str, Any] = {
        "target": str(args.target),
        "lyanna": str(args.lyanna),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "batch_size": 1,
        "speculation": "fixed",
        "machine": machine(),
    }
    main_engine = Engine.load(build(args.target, args.engine_dir / "full", lyanna=args.lyanna))
    prompts = [main_engine.encode(p.text) for p in bundled(args.num_prompts)]
    main_llm = LLMEngine(main_engine, ONE_AT_A_TIME)

    if "table1" in reports:
        llms = {"full model": (str(args.lyanna), main_llm)}
        skipped = []
        for name, path in _ablations(args.ablation).items():
            label = ABLATION_LABELS.get(name, name)
            if not (path / "model.safetensors").is_file():
                skipped.append(f"{label} ({path})")
                tqdm.write(f"table1: skipping {label}: {path}/model.safetensors does not exist")
                continue
            engine = Engine.load(build(args.target, args.engine_dir / name, lyanna=path))
            llms[label] = (str(path), LLMEngine(engine, ONE_AT_A_TIME))
        table1_prompts = [main_engine.encode(p.text) for p in bundled(args.table1_prompts)]
        rows1 = run_table1(llms, table1_prompts, args.max_tokens)
        meta1 = {
            **meta,
            "table1_prompts": args.table1_prompts,
            "depth": DEPTH,
            "width": WIDTH,
            "budget": TABLE1_BUDGET,
            "skipped": skipped,
        }
        write_report(
            args.out_dir / "lyanna_table1", meta1, [asdict(r) for r in rows1], table1_markdown(rows1, meta1, skipped)
        )

    if "fig12" in reports:
        path = args.redrafter_engine
        if not (path / "config.json").is_file():
            path = build(args.target, args.engine_dir / "redrafter", redrafter=args.redrafter)
        redrafter = LLMEngine(Engine.load(path), ONE_AT_A_TIME)
        temperatures = [float(t) for t in args.temperatures.split(",")]
        rows12 = run_fig12(
            main_llm, redrafter, prompts, _ints(args.budgets), temperatures, args.max_tokens, args.rounds
        )
        meta12 = {**meta, "redrafter_engine": str(path), "budgets": _ints(args.budgets), "temperatures": temperatures}
        write_report(args.out_dir / "lyanna_fig12", meta12, [asdict(r) for r in rows12], fig12_markdown(rows12, meta12))

    if "table2" in reports:
        rows2, extra = run_table2(main_engine, args.windows, args.seq_len)
        meta2 = {**meta, "table2": extra}
        write_report(args.out_dir / "lyanna_table2", meta2, [asdict(r) for r in rows2], table2_markdown(rows2, meta2))

    if "fig13a" in reports:
        rows13 = run_fig13a(main_engine, _ints(args.ks), _ints(args.batches), args.repeats)
        meta13 = {**meta, "fig13a_repeats": args.repeats, "drafter_dtype": str(main_engine.lyanna_drafter.dtype)}  # type: ignore[union-attr]
        write_report(
            args.out_dir / "lyanna_fig13a", meta13, [asdict(r) for r in rows13], fig13a_markdown(rows13, meta13)
        )
    tqdm.write(f"lyanna sweep took {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
