"""Distillation data: the target's own greedy continuations, with its hidden states.

ReDrafter (arXiv 2403.09919, §4.4.3) trains the drafter on what the *target* would
generate: at every position p of a training sequence, the next T tokens the target
produces greedily. Generating T tokens separately at every position costs T forwards per
position; instead we let the target continue random corpus windows greedily for
`gen_tokens` tokens. Inside a greedy continuation the tokens after any position p *are*
the target's greedy continuation of the prefix up to p, so every position of the
generated part yields one example from a single decoding pass.

One example = (h_p, x_{p+1}, ..., x_{p+1+T}): the target's final hidden state at p, the
bonus token x_{p+1} the target itself emits there, and the T tokens the drafter must
predict after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import ARCHITECTURE, LlamaForCausalLM
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig, EngineConfig
from runtime.llm_engine import generate
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams


class DistillData(NamedTuple):
    hidden: torch.Tensor  # [E, D] target hidden state at position p
    tokens: torch.Tensor  # [E, T + 1] bonus token x_{p+1}, then the T tokens to predict


def corpus_windows(ids: torch.Tensor, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`count` random windows of `[min_len, max_len]` tokens from a token stream `[N]`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen)
    starts = torch.randint(0, len(ids) - max_len, (count,), generator=gen)
    return [ids[s : s + n].tolist() for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


@torch.inference_mode()
def make_distill_data(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    gen_tokens: int,
    draft_len: int,
    batch_size: int = 64,
) -> DistillData:
    """Greedy-continue every prompt by `gen_tokens` and cut examples with `draft_len`
    tokens to predict from the generated part."""
    longest = max(map(len, prompts))
    build = BuildConfig(max_batch_size=batch_size, max_input_len=longest, max_seq_len=longest + gen_tokens)
    engine = LoadedEngine(EngineConfig(ARCHITECTURE, target.config.to_hf(), build), target, tokenizer)
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)  # fixed length: EOS is just a token here
    hidden, tokens = [], []
    for i in tqdm(range(0, len(prompts), batch_size), desc="distill data", unit="batch"):
        chunk = prompts[i : i + batch_size]
        results = generate(engine, chunk, [params] * len(chunk), method="ar", config=RuntimeConfig())
        for prompt, r in zip(chunk, results, strict=True):
            seq = torch.tensor(prompt + r.output_ids)
            h = target(seq[None], torch.arange(len(seq))[None]).hidden[0]  # [S, D]
            first = len(prompt) - 1  # h at the prompt's last token predicts the first generated token
            last = len(seq) - draft_len - 2
            windows = torch.arange(first, last + 1)[:, None] + torch.arange(1, draft_len + 2)  # [E_i, T + 1]
            hidden.append(h[first : last + 1].to(torch.bfloat16))
            tokens.append(seq[windows])
    return DistillData(torch.cat(hidden), torch.cat(tokens))
