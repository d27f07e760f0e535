"""`specpipe_cpu::verify_sampled_chains` (plugins/chain_verify.py): recursive rejection
sampling down chains in one C++ call accepts the drafts and draws the bonus tokens the
Python walk does (`runtime.verify._walk_tree` over `_tree_laws`), bit for bit, and leaves
every request's generator where the walk leaves it: sampled chains (drafts drawn from a
law close to the target's, so walks end at every depth, all accepted included), point-mass
chains (one-beam trees at T > 0), temperatures other than 1, in batches with roots alone
and branching trees (walked in Python beside it). A walk at other uniforms gives other
tokens (the comparison sees the draws). The law of what it emits is tested end to end by
the sampling suites (`tests/runtime/test_rsd_sampling.py`: sd through the int8 draft LM).
"""

from __future__ import annotations

import pytest
import torch

from plugins import chain_verify, cpu_kernels
from runtime import verify
from runtime.sampling import SamplingParams, target_probs
from runtime.tree import DraftTree

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")

V = 48


def chain(gen: torch.Generator, n: int, temperature: float, sampled: bool) -> tuple[DraftTree, torch.Tensor]:
    """A chain of n nodes and the target logits at its nodes: drafts drawn from a law near
    the target's (sampled) or its likeliest tokens (point masses)."""
    logits = torch.randn(n, V, generator=gen) * 2
    q = target_probs(logits, SamplingParams(temperature=temperature))
    noisy = torch.softmax(torch.log(q) + 0.7 * torch.randn(n, V, generator=gen), -1)
    tokens = [int(torch.randint(V, (1,), generator=gen))]
    laws = torch.zeros(n, V)
    for c in range(1, n):
        law = noisy[c - 1]
        tokens.append(int(torch.multinomial(law, 1, generator=gen)) if sampled else int(law.argmax()))
        laws[c] = law
    tree = DraftTree(tokens, list(range(-1, n - 1)), laws if sampled else None, depths=list(range(n)), sampled=sampled)
    return tree, logits


def batch(seed: int) -> tuple[list[DraftTree], list[torch.Tensor], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    trees, logits, params = [], [], []
    for k in range(12):
        temperature = (1.0, 0.7, 1.6)[k % 3]
        tree, rows = chain(gen, 2 + k % 6, temperature, sampled=k % 4 != 3)
        trees.append(tree)
        logits.append(rows)
        params.append(SamplingParams(temperature=temperature))
    root = torch.randn(1, V, generator=gen)  # a root alone and a branching tree, walked in Python
    trees.append(DraftTree([3], [-1]))
    logits.append(root)
    params.append(SamplingParams(temperature=1.0))
    trees.append(DraftTree([3, 5, 9, 11], [-1, 0, 0, 1]))
    logits.append(torch.randn(4, V, generator=gen))
    params.append(SamplingParams(temperature=0.8))
    return trees, logits, params


def accept(trees: list[DraftTree], logits: list[torch.Tensor], params: list[SamplingParams], seed: int, one_call: bool):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(trees))]
    with pytest.MonkeyPatch.context() as m:
        if not one_call:
            m.setattr(verify, "chain_kernel_applies", lambda rows: False)
        out = verify.accept_sampled_batch(trees, logits, params, gens)
    return [(a.path, a.tokens) for a in out], [float(torch.rand((), generator=g)) for g in gens]


@needs_kernels
def test_chains_in_one_call_accept_what_the_walk_accepts() -> None:
    called = []
    real = chain_verify.verify_chains
    depths: set[tuple[int, int]] = set()  # (chain length, drafts accepted) seen
    with pytest.MonkeyPatch.context() as m:
        m.setattr(verify, "verify_chains", lambda *a: called.append(len(a[0])) or real(*a))
        for seed in range(40):
            trees, logits, params = batch(seed)
            fast, fast_next = accept(trees, logits, params, 1000 * seed, one_call=True)
            walked, walked_next = accept(trees, logits, params, 1000 * seed, one_call=False)
            assert fast == walked, f"seed {seed}"
            assert fast_next == walked_next, f"seed {seed}: the generators were left elsewhere"
            depths |= {(len(t.tokens), len(path) - 1) for t, (path, _) in zip(trees[:12], fast[:12], strict=True)}
            assert fast != accept(trees, logits, params, 1000 * seed + 7, one_call=True)[0]
    assert called and all(n == 12 for n in called)  # the chains, not the root alone or the branching tree
    for n in range(2, 8):  # every length stopped at every depth, all accepted included
        assert {(n, k) for k in range(n)} <= depths, n


@needs_kernels
def test_bad_chains_are_refused() -> None:
    tree, logits = chain(torch.Generator().manual_seed(0), 4, 1.0, sampled=True)
    u, bonus = torch.rand(3), torch.rand(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"one fp32 uniform a draft"):
        chain_verify.verify_chains([logits], [tree.draft_probs], [tree.tokens], [1.0], [torch.rand(2)], bonus)
    with pytest.raises(RuntimeError, match=r"out of the vocabulary"):
        chain_verify.verify_chains([logits], [tree.draft_probs], [[0, V, 1, 2]], [1.0], [u], bonus)
    with pytest.raises(RuntimeError, match=r"no sampling law"):
        chain_verify.verify_chains([logits], [tree.draft_probs], [tree.tokens], [0.0], [u], bonus)
