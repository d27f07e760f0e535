"""The target's logits as a request's history changes them: `min_tokens`, `bad_words` and
the repetition / presence / frequency penalties (`SamplingParams`), applied before the
distribution (`runtime.sampling.target_probs`) and before greedy's argmax.

They depend on the tokens so far, so under speculation every tree node gets its own: node
j's history is the prompt, the output so far (its last token is the tree's root), then
the drafted tokens on the path from the root down to j, j included. Verifying every node
with the logits auto-regression would have seen after that same path is what keeps
speculation exact (greedy equal, sampled in distribution); using the root's history for
every node would not be, and `tests/runtime/test_logits_processing.py` shows the difference.

Order, as vLLM applies them: min_tokens and bad words mask (-inf), then the repetition
penalty (CTRL, Keskar et al. 2019, eq. in section 4.1: a seen token's logit is divided by
the penalty when positive, multiplied when negative; seen = prompt + output), then the
frequency and presence penalties (OpenAI's definition, over the output only:
logit - count * frequency - [count > 0] * presence).

Drafters are not penalized: their proposals are checked against the penalized target, so
exactness does not depend on them (only acceptance does).
"""

from __future__ import annotations

import torch

from runtime.sampling import SamplingParams
from runtime.tree import DraftTree


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    stop_ids: set[int],
    tree: DraftTree | None = None,
) -> torch.Tensor:
    """`logits` `[N, V]` at the nodes of `tree` (None: one row, the next token after
    prompt + output) -> a new float32 `[N, V]` with `params`' masks and penalties applied
    along each node's own path. `output` holds the generated tokens so far (while decoding
    its last one is the tree's root); `stop_ids` are the tokens `min_tokens` holds back."""
    out = logits.float().clone()
    n, vocab = out.shape
    tokens = torch.tensor((tree.tokens if tree is not None else [0])[1:], dtype=torch.long)
    if tree is not None:
        assert tree.mask is not None and len(tree.tokens) == n
        on_path = tree.mask[:, 1:].to(torch.float32)  # [N, N-1]: ancestors-or-self, root excluded
        depths = tree.depths
    else:
        on_path, depths = torch.zeros(n, 0), [0] * n
    # [N, V] occurrences of each token on each node's path (drafted tokens count as output)
    path_counts = on_path @ torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)
    path_counts = path_counts.to(out.device)

    if params.min_tokens and stop_ids:
        early = [j for j in range(n) if len(output) + depths[j] < params.min_tokens]
        if early:
            rows = torch.tensor(early, device=out.device)
            cols = torch.tensor(sorted(stop_ids), device=out.device)
            out[rows[:, None], cols[None, :]] = float("-inf")
    if params.bad_words:
        _mask_bad_words(out, params.bad_words, prompt + output, tree)
    if params.repetition_penalty != 1.0:
        seen = path_counts > 0
        seen[:, torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=out.device)] = True
        penalty = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if params.presence_penalty or params.frequency_penalty:
        counts = path_counts + torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(
            out.device, torch.float32
        )
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return out


def _mask_bad_words(
    logits: torch.Tensor, words: tuple[tuple[int, ...], ...], history: list[int], tree: DraftTree | None
) -> None:
    """-inf at each word's last token wherever the node's history ends with the rest of it."""
    longest = max(len(w) for w in words) - 1
    tail = history[max(0, len(history) - longest) :] if longest else []
    parents = tree.parents if tree is not None else [-1]
    drafted = tree.tokens if tree is not None else [0]
    rows: list[int] = []
    cols: list[int] = []
    for j in range(logits.shape[0]):
        path: list[int] = []  # drafted tokens from the root's child down to j
        node = j
        while node > 0 and len(path) < longest:
            path.append(drafted[node])
            node = parents[node]
        recent = (tail + path[::-1])[-longest:] if longest else []
        for word in words:
            prefix = list(word[:-1])
            if not prefix or recent[len(recent) - len(prefix) :] == prefix:
                rows.append(j)
                cols.append(word[-1])
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")


def token_log_probs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """Log-probability of `tokens[i]` under row i of processed `logits` `[K, V]`: the
    target's own distribution after masks and penalties, before temperature/top-k/top-p
    (what `SamplingParams.logprobs` returns, the same for greedy and sampled requests and
    for speculative and auto-regressive decoding)."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=rows.device)[:, None]
    return rows.gather(-1, index).squeeze(-1).tolist()
