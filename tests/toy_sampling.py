"""Toy engines and exact sequence laws for the sampling-distribution tests: a random
tiny-vocabulary target, drafters that disagree with it, and the exact law of the first
three emitted tokens, against which production runs are counted and chi-square tested.
The engines run on the test device (`tests/device.py`); laws and counts are on the CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, models

from model_defs.llama import ARCHITECTURE, LlamaForCausalLM, quantize_linears_int8
from model_defs.lyanna import LyannaConfig, LyannaDrafter
from model_defs.redrafter import ReDrafter, ReDrafterConfig
from runtime import llm_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig, DrafterSpec, EngineConfig
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams, target_probs
from tests.device import TEST_DEVICE
from tests.tiny_models import tiny_target

V = 4
PROMPT = [1, 3, 2]
TRIALS = 20000
"""Requests per distribution test: ~300 expected per cell of the 64 (x1, x2, x3) cells."""


def toy_engine(
    drafter_kind: str, settings: dict[str, Any], device: str = TEST_DEVICE, int8: bool = False
) -> LoadedEngine:
    """The toy target with a "redrafter" RNN drafter, a "draft-lm" (another random tiny
    Llama) or a "lyanna" drafter (random, token info over every token), all confident and
    often wrong, so acceptance rules are exercised hard. Weights are drawn on the CPU (the
    same on every device), then moved to `device`. `int8`: the draft LM runs on int8
    copies of its weights, as built engines' drafters do on the CPU (`drafter_layers`), with
    heads of 32 so that its forward is the one C++ call built engines make
    (`plugins/llama_forward.py`)."""
    target = tiny_target(seed=7, vocab_size=V, device=device)
    build = BuildConfig(max_batch_size=TRIALS, max_input_len=8, max_seq_len=16)
    torch.manual_seed(11)
    if drafter_kind == "redrafter":
        rnn = ReDrafter(ReDrafterConfig(vocab_size=V, hidden_size=32, exit_dim=64, num_draft_layers=1, rnn=True))
        with torch.no_grad():
            for p in rnn.parameters():
                p.normal_(0, 0.4)
        spec = DrafterSpec("redrafter", rnn.config.to_json(), settings)
        config = EngineConfig(ARCHITECTURE, target.config.to_hf(), build, drafter=spec)
        return LoadedEngine(config, target, Tokenizer(models.BPE()), redrafter=rnn.eval().to(device))
    if drafter_kind == "lyanna":
        lyanna = LyannaDrafter(LyannaConfig.from_target(target.config, num_hot_tokens=V, token_info_rank=4))
        with torch.no_grad():
            for p in lyanna.parameters():
                p.normal_(0, 0.4)
        lyanna.hot_token_ids = torch.arange(V)
        lyanna = lyanna.eval().to(device)
        spec = DrafterSpec("lyanna", lyanna.config.to_json(), settings)
        config = EngineConfig(ARCHITECTURE, target.config.to_hf(), build, drafter=spec)
        table = lyanna.hot_table(target.model.embed_tokens, torch.float32)
        return LoadedEngine(config, target, Tokenizer(models.BPE()), lyanna_drafter=lyanna, token_table=table)
    draft = tiny_target(seed=5, vocab_size=V, device=device, head_dim=32 if int8 else 8)
    if int8 and not quantize_linears_int8(draft):
        raise RuntimeError("int8 drafter layers need fp32 on the CPU and a torch with fbgemm")
    spec = DrafterSpec("draft-lm", draft.config.to_hf(), settings)
    config = EngineConfig(ARCHITECTURE, target.config.to_hf(), build, drafter=spec)
    return LoadedEngine(config, target, Tokenizer(models.BPE()), draft_model=draft)


Processor = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""(logits `[V]`, tokens generated so far) -> the logits the target's law is taken from."""


def exact_first_three(
    target: LlamaForCausalLM, params: SamplingParams, process: Processor | None = None
) -> torch.Tensor:
    """P(x1, x2, x3) under the target, `[V, V, V]` on the CPU, by enumerating prefixes
    (the target's conditionals computed on its own device, changed by `process` when given)."""
    device = target.lm_head.weight.device

    def q(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prefix], device=device)
        with torch.no_grad():
            logits = target(ids, torch.arange(len(prefix), device=device)[None]).logits[0, -1]
            if process is not None:
                logits = process(logits.cpu(), prefix[len(PROMPT) :])
            return target_probs(logits, params).cpu()

    law = torch.zeros(V, V, V)
    q1 = q(PROMPT)
    for a in range(V):
        q2 = q([*PROMPT, a])
        for b in range(V):
            law[a, b] = q1[a] * q2[b] * q([*PROMPT, a, b])
    return law


def emitted_first_three(
    engine: LoadedEngine, params: SamplingParams, method: str, trials: int = TRIALS, accepted_share: int = 4
) -> torch.Tensor:
    """Counts of the first three tokens of `trials` seeded requests, all in flight at once
    (at least trials / `accepted_share` drafts must be accepted, or the test means little)."""
    per_request = [dataclasses.replace(params, max_tokens=3, seed=i) for i in range(trials)]
    config = RuntimeConfig(max_num_tokens=16 * trials, max_queue_size=trials, speculation="fixed")
    results = llm_engine.generate(engine, [PROMPT] * trials, per_request, method, config)
    counts = torch.zeros(V, V, V)
    for r in results:
        counts[tuple(r.output_ids)] += 1
    accepted = sum(r.num_accepted for r in results)
    assert accepted > trials // accepted_share, "drafts must get accepted for the test to mean anything"
    return counts
