"""Distillation data: continuations of corpus windows, with the target's hidden states.

ReDrafter (arXiv 2403.09919, §3.1 Eq. 1-2, §4.4.3) trains the drafter on what the *target*
would generate: at every position p of a training sequence, the next T tokens. Generating
T tokens separately at every position costs T forwards per position; instead the target
continues random corpus windows for `gen_tokens` tokens. Inside a continuation the tokens
after any position p *are* a continuation of the prefix up to p (greedy: *the* greedy one;
sampled: one draw from the target's law), so every generated position yields one example
from a single decoding pass.

Where the continuation comes from (`Continuation`, the `--kd` choice of the scripts):
- "greedy": the target's greedy continuation (the paper's sequence-level KD, §4.4.3);
- "sampled": a continuation sampled from the target at `temperature` (Eq. 1-2 with the
  expectation over the target's own samples: what a drafter meets at T > 0);
- "ground-truth": no generation, the corpus text itself (the paper's Table 6 baseline).

One example = (h_p, x_{p+1}, ..., x_{p+1+T}, g_{p+1}, ..., g_{p+T}): the target's final
hidden state at p, the bonus token x_{p+1}, the T tokens the drafter must predict after it,
and the target's hidden states at p+1..p+T, whose LM-head logits are the target's
distributions over those T tokens (the soft labels of `--kd soft`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from model_defs.llama import ARCHITECTURE, LlamaForCausalLM
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig, EngineConfig
from runtime.llm_engine import generate
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams

Continuation = Literal["greedy", "sampled", "ground-truth"]
CONTINUATIONS: tuple[Continuation, ...] = ("greedy", "sampled", "ground-truth")


class DistillData(NamedTuple):
    hidden: torch.Tensor  # [E, D] target hidden state at position p
    tokens: torch.Tensor  # [E, T + 1] bonus token x_{p+1}, then the T tokens to predict
    teacher: torch.Tensor  # [E, T, D] target hidden states at p+1..p+T (soft labels via the LM head)

    def rows(self, idx: torch.Tensor | slice) -> DistillData:
        return DistillData(self.hidden[idx], self.tokens[idx], self.teacher[idx])


def corpus_windows(ids: torch.Tensor, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`count` random windows of `[min_len, max_len]` tokens from a token stream `[N]`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen)
    starts = torch.randint(0, len(ids) - max_len, (count,), generator=gen)
    return [ids[s : s + n].tolist() for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


def continue_windows(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    gen_tokens: int,
    continuation: Continuation,
    temperature: float,
    seed: int,
    batch_size: int,
) -> list[list[int]]:
    """The target's `gen_tokens`-token continuation of every prompt (greedy or sampled at
    `temperature`, one seed per prompt: reproducible)."""
    longest = max(map(len, prompts))
    build = BuildConfig(max_batch_size=batch_size, max_input_len=longest, max_seq_len=longest + gen_tokens)
    engine = LoadedEngine(EngineConfig(ARCHITECTURE, target.config.to_hf(), build), target, tokenizer)
    out: list[list[int]] = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"distill data ({continuation})", unit="batch"):
        chunk = prompts[i : i + batch_size]
        params = [
            # fixed length: EOS is just a token here
            SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
            if continuation == "greedy"
            else SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=temperature, seed=seed + i + j)
            for j in range(len(chunk))
        ]
        results = generate(engine, chunk, params, method="ar", config=RuntimeConfig())
        out += [r.output_ids for r in results]
    return out


@torch.inference_mode()
def make_distill_data(
    target: LlamaForCausalLM,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    gen_tokens: int,
    draft_len: int,
    continuation: Continuation = "greedy",
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> DistillData:
    """Continue every prompt by `gen_tokens` and cut examples with `draft_len` tokens to
    predict from the continuation. "ground-truth" prompts must hold `gen_tokens` more
    corpus tokens, which play the continuation."""
    if continuation not in CONTINUATIONS:
        raise ValueError(f"continuation must be one of {CONTINUATIONS}, got {continuation!r}")
    if continuation == "ground-truth":
        if min(map(len, prompts)) <= gen_tokens:
            raise ValueError(f"ground-truth windows need more than gen_tokens={gen_tokens} tokens")
        pairs = [(p[:-gen_tokens], p[-gen_tokens:]) for p in prompts]
    else:
        gen = continue_windows(target, tokenizer, prompts, gen_tokens, continuation, temperature, seed, batch_size)
        pairs = list(zip(prompts, gen, strict=True))
    hidden, tokens, teacher = [], [], []
    for prompt, cont in pairs:
        seq = torch.tensor(prompt + cont)
        h = target(seq[None], torch.arange(len(seq))[None]).hidden[0].to(torch.bfloat16)  # [S, D]
        first = len(prompt) - 1  # h at the prompt's last token predicts the first generated token
        last = len(seq) - draft_len - 2
        windows = torch.arange(first, last + 1)[:, None] + torch.arange(1, draft_len + 2)  # [E_i, T + 1]
        hidden.append(h[first : last + 1])
        tokens.append(seq[windows])
        teacher.append(h[windows[:, :-1]])  # [E_i, T, D]: h at p+1..p+T predicts x_{p+2..p+T+1}
    return DistillData(torch.cat(hidden), torch.cat(tokens), torch.cat(teacher))
