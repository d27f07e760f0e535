"""ReDrafter decoding (arXiv 2403.09919): draft beams with the RNN drafter, verify their
deduplicated tree in one target forward, keep the accepted path.

    prefill -> bonus token + target hidden h at the prompt's last token
    repeat:  beams = beam_search(drafter, h, bonus)       [B, W, L+1], column 0 = bonus
             tree  = pack_beams(beams)                     shared prefixes verified once
             logits, hidden = target(tree tokens, context + depth, tree mask)
             accept (greedy / recursive rejection)         path + new bonus token
             commit the path's KV, h = hidden at the path's last node

Lossless: acceptance never emits a token the target would not (see runtime/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_defs.redrafter import ReDrafter
from plugins.beam_packing import pack
from runtime.ar import in_batches, prefill
from runtime.beam_search import beam_search
from runtime.engine import Engine
from runtime.results import GenerationResult, stop_ids
from runtime.sampling import SamplingParams, next_token
from runtime.verify import DraftTree, accept


@dataclass(frozen=True)
class ReDrafterParams:
    """Drafting effort per step."""

    beam_width: int = 4
    """Beams drafted (W)."""
    beam_length: int = 4
    """Draft tokens per beam (L); beams carry the bonus token in front."""

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.beam_length < 1:
            raise ValueError(f"beam_width and beam_length must be >= 1, got {self.beam_width}, {self.beam_length}")

    @property
    def max_tree_nodes(self) -> int:
        return self.beam_width * (self.beam_length + 1)


def node_log_probs(
    step_log_probs: torch.Tensor,  # [B, W, L, V] beam search's draft distribution at every step
    unpack_index: torch.Tensor,  # [B, W, L+1] packed node of (beam, depth)
    num_nodes: int,
) -> torch.Tensor:  # [B, num_nodes, V]; row of the root is zero (it was not drawn)
    """The draft distribution each packed node was drawn from. Beams sharing a node share
    its prefix, hence (the drafter being deterministic) the same distribution."""
    b, w, length, v = step_log_probs.shape
    out = step_log_probs.new_zeros(b, w * (length + 1), v)
    index = unpack_index[:, :, 1:].reshape(b, w * length, 1).expand(-1, -1, v)
    return out.scatter_(1, index, step_log_probs.reshape(b, w * length, v))[:, :num_nodes]


@torch.inference_mode()
def generate_batch(
    engine: Engine, drafter: ReDrafter, prompts: list[list[int]], params: list[SamplingParams], spec: ReDrafterParams
) -> list[GenerationResult]:
    """Speculative generation for up to `max_batch_size` prompts together."""
    model, device = engine.model, engine.device
    cache, logits, hidden = prefill(engine, prompts, params, extra_slots=spec.max_tree_nodes)
    generators = [p.generator(device) for p in params]
    stops = [stop_ids(p, engine.eos_token_ids) for p in params]
    results = [GenerationResult(list(prompt), num_forwards=1) for prompt in prompts]
    bonus = [next_token(logits[b], params[b], generators[b]) for b in range(len(prompts))]
    for b, r in enumerate(results):
        r.extend([bonus[b]], params[b], stops[b])
    rows = torch.arange(len(prompts), device=device)
    while not all(r.finish_reason for r in results):
        drafts = beam_search(
            drafter,
            model.model.embed_tokens,
            hidden,
            torch.tensor(bonus, device=device),
            spec.beam_width,
            spec.beam_length,
        )
        tree = pack(drafts.beams)
        n = int(tree.num_nodes.max())  # nodes are packed first: trim the common padding
        node_dists = (
            None if all(p.greedy for p in params) else node_log_probs(drafts.step_log_probs, tree.unpack_index, n)
        )
        out = model(
            tree.tokens[:, :n], cache.lengths[:, None] + tree.depths[:, :n], cache, tree_mask=tree.tree_mask[:, :n, :n]
        )
        paths = torch.zeros(len(prompts), spec.beam_length + 1, dtype=torch.long, device=device)
        keep = torch.zeros(len(prompts), dtype=torch.long, device=device)
        last = torch.zeros(len(prompts), dtype=torch.long, device=device)
        for b, r in enumerate(results):
            if r.finish_reason:
                continue  # finished rows ride along and commit nothing
            num = int(tree.num_nodes[b])
            draft = DraftTree(
                tree.tokens[b, :num].tolist(),
                tree.parents[b, :num].tolist(),
                None if node_dists is None else node_dists[b, :num],
            )
            acc = accept(draft, out.logits[b, :num], params[b], generators[b])
            r.extend(acc.tokens, params[b], stops[b])
            r.num_forwards += 1
            r.num_drafted += num - 1
            r.accepted_per_step.append(acc.num_accepted)
            if r.finish_reason:
                continue  # commit nothing: a finished row's cache must not grow past its budget
            paths[b, : len(acc.path)] = torch.tensor(acc.path)
            keep[b], last[b], bonus[b] = len(acc.path), acc.path[-1], acc.tokens[-1]
        cache.commit_path(paths, keep)
        hidden = out.hidden[rows, last]  # [B, D] target state at each row's last accepted node
    return results


def generate(
    engine: Engine, drafter: ReDrafter, prompts: list[list[int]], params: list[SamplingParams], spec: ReDrafterParams
) -> list[GenerationResult]:
    """Any number of prompts, `max_batch_size` at a time."""
    return in_batches(engine, prompts, params, lambda p, s: generate_batch(engine, drafter, p, s, spec))
