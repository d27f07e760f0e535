"""Recursive rejection sampling is exact (RSD Theorem 3.1), and the samplers that feed it
draw without replacement.

- Exact enumeration: for K = 1..4 candidates drawn without replacement from p, the law of
  the emitted token is computed in closed form from `rejection_step` over every ordered
  K-tuple and must equal q to 1e-12, including adversarial p (mass where q is zero,
  p = q, disjoint supports, p with zeros). Two plausible bugs (not renormalising the
  draft after a rejection; not removing the rejected token from it) fail the same check.
- Monte Carlo through the production code: single-level trees drafted by Gumbel-top-k
  and verified by `accept_sampled_batch` (chi-square, p = 0.001).
- Gumbel-top-k orders follow the without-replacement law; truncated Gumbels keep order
  and hit the parent's value; Stochastic Beam Search's best beam is a sample of the
  sequence law.

Everything runs on the test device (generators included); log_probs are compared on the CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from runtime.gumbel import draw_one, draw_rows, gumbel_noise, gumbel_top_k, gumbel_top_k_rows, truncated_gumbel
from runtime.proposers.rsd import _beam_level, _Growing
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree
from runtime.verify import accept_sampled_batch, rejection_step
from tests.device import TEST_DEVICE
from tests.stats import passes_chi_square

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def output_law(q: torch.Tensor, p: torch.Tensor, k: int, step: Step = rejection_step) -> torch.Tensor:
    """Exact law of the emitted token when k candidates are drawn from p without
    replacement and tried in order with `step`, the residual sampled if all fail."""
    law = torch.zeros_like(q)
    support = p.nonzero().flatten().tolist()
    for xs in itertools.permutations(support, k):
        prob_tuple, remaining = 1.0, 1.0
        for x in xs:  # probability of this ordered draw without replacement
            prob_tuple *= float(p[x]) / remaining
            remaining -= float(p[x])
        reach = 1.0  # probability every earlier candidate was rejected
        q_k, p_k = q.clone(), p.clone()
        for x in xs:
            a, q_next, p_next = step(q_k, p_k, torch.tensor(x, device=q.device))
            law[x] += prob_tuple * reach * float(a)
            reach *= 1 - float(a)
            q_k, p_k = q_next, p_next
        law += prob_tuple * reach * q_k
    return law


def generator(seed: int) -> torch.Generator:
    return torch.Generator(TEST_DEVICE).manual_seed(seed)


def cpu_generator(seed: int) -> torch.Generator:
    """For noise the test itself draws on the CPU (a CUDA generator cannot draw there)."""
    return torch.Generator().manual_seed(seed)


def on_device(*log_probs: torch.Tensor) -> list[torch.Tensor]:
    return [law.to(TEST_DEVICE) for law in log_probs]


def random_law(gen: torch.Generator, v: int, zeros: int = 0) -> torch.Tensor:
    w = torch.rand(v, generator=gen, dtype=torch.float64) ** 3  # uneven
    w[torch.randperm(v, generator=gen)[:zeros]] = 0
    return w / w.sum()


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    v = 6
    out = [(f"random-{i}", random_law(gen, v), random_law(gen, v)) for i in range(4)]
    q = random_law(gen, v, zeros=2)
    out.append(("draft-mass-where-target-is-zero", q, random_law(gen, v)))
    out.append(("draft-equals-target", q, q.clone()))
    disjoint_q = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0], dtype=torch.float64)
    disjoint_p = torch.tensor([0, 0, 0, 0.1, 0.6, 0.3], dtype=torch.float64)
    out.append(("disjoint-supports", disjoint_q, disjoint_p))
    out.append(("draft-with-zeros", random_law(gen, v), random_law(gen, v, zeros=1)))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize(("name", "q", "p"), cases(), ids=[c[0] for c in cases()])
def test_theorem_3_1_exact_by_enumeration(name: str, q: torch.Tensor, p: torch.Tensor, k: int) -> None:
    k = min(k, int((p > 0).sum()))  # cannot draw more distinct tokens than p's support
    torch.testing.assert_close(output_law(*on_device(q, p), k).cpu(), q, atol=1e-12, rtol=0)


def step_without_renormalising(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, q_next, _ = rejection_step(q, p, x)
    return a, q_next, p.scatter(-1, x[..., None], 0.0)  # bug: x removed, p not renormalised


def step_with_replacement(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, q_next, _ = rejection_step(q, p, x)
    return a, q_next, p  # bug: the draft law is not updated at all


@pytest.mark.parametrize("wrong", [step_without_renormalising, step_with_replacement])
def test_wrong_variants_fail_the_enumeration(wrong: Step) -> None:
    errors = [
        float((output_law(*on_device(q, p), k, wrong).cpu() - q).abs().max()) for _, q, p in cases() for k in (2, 3)
    ]
    assert max(errors) > 1e-2


def test_point_mass_step_removes_the_token() -> None:
    q, p = on_device(torch.tensor([0.1, 0.6, 0.3]).double(), torch.tensor([0.0, 1.0, 0.0]).double())
    a, q_next, _ = rejection_step(q, p, torch.tensor(1, device=TEST_DEVICE))
    assert float(a) == pytest.approx(0.6)
    torch.testing.assert_close(q_next.cpu(), torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64))


def test_batched_acceptance_of_sampled_siblings_is_exact() -> None:
    """Production path: a root with K = 3 children drawn by Gumbel-top-k from p, verified
    by `accept_sampled_batch` many trees at once; the emitted token must follow q, and a
    test of the test: the same counts are far from p."""
    v, k, trials = 5, 3, 12000
    logits = torch.tensor([1.2, -0.3, 0.4, 0.9, -1.5], device=TEST_DEVICE)  # target at the root
    p = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.2], device=TEST_DEVICE)  # a draft that disagrees
    params = SamplingParams(temperature=1.0)
    gens = [generator(i) for i in range(trials)]
    trees = []
    for g in gens:
        kids = gumbel_top_k(p.log(), k, g).tolist()
        trees.append(DraftTree([0, *kids], [-1] + [0] * k, p.expand(k + 1, v).clone(), sampled=True))
    rows = [logits.expand(k + 1, v)] * trials  # children's rows unused: they are leaves of one level
    accs = accept_sampled_batch(trees, rows, [params] * trials, gens)
    counts = torch.zeros(v)
    for acc in accs:
        counts[acc.tokens[0]] += 1
    q, p = torch.softmax(logits, -1).cpu(), p.cpu()
    assert passes_chi_square(counts, q)
    assert not passes_chi_square(counts, p)
    assert sum(a.num_accepted for a in accs) > trials // 3


def test_gumbel_top_k_draws_without_replacement() -> None:
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    gen, log_p = generator(1), p.log().to(TEST_DEVICE)
    counts = torch.zeros(4, 4)
    for _ in range(8000):
        a, b = gumbel_top_k(log_p, 2, gen).tolist()
        counts[a, b] += 1
    law = p[:, None] * p[None, :] / (1 - p[:, None])  # P(x1) P(x2 | x1 removed)
    law.fill_diagonal_(0)
    assert passes_chi_square(counts, law)


def _uniform_bins(u: torch.Tensor, bins: int = 10) -> torch.Tensor:
    """Counts of `u` in `bins` equal bins of [0, 1] (values past 1 land in the last)."""
    return torch.bincount((u * bins).long().clamp(0, bins - 1), minlength=bins).double()


def test_top_down_gumbel_top_k_has_the_law_of_v_perturbations() -> None:
    """`gumbel_top_k_rows` (the top k of log p + Gumbel drawn top-down, what RSD-C and RSD-S
    draft with) against the exact law of the V-perturbation process: the token triple is
    drawn without replacement; the largest value is Gumbel(log 1) whatever its token
    (probability integral transform exp(-exp(-g1)) uniform, jointly with the token); the
    j-th is Gumbel(log p(rest)) truncated at the (j-1)-th (its conditional CDF uniform);
    a token of probability 0 never comes and its slot is -1 / -inf. A wrong variant, the
    second value drawn untruncated, fails; the V-perturbation process itself passes."""
    p = torch.tensor([0.45, 0.25, 0.0, 0.18, 0.12], dtype=torch.float64)
    n, k = 20000, 4
    log_p = p.log().float().to(TEST_DEVICE).expand(n, 5).contiguous()
    gen = generator(11)
    tokens, values = (t.cpu() for t in gumbel_top_k_rows(log_p, [n // 2, n - n // 2], [gen, generator(12)], k + 1))
    assert bool((tokens[:, k] == -1).all()) and bool((values[:, k] == float("-inf")).all())
    assert not bool((tokens[:, :k] == 2).any())
    pf = p.float().double()  # the law the float32 log-probs carry

    def pit(values: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Conditional CDF of each value given the earlier ones (uniform under the right law)."""
        out, taken, upper = [], torch.zeros(n, dtype=torch.float64), torch.full((n,), float("inf"), dtype=torch.float64)
        for j in range(3):
            mu = (1 - taken).log()  # Gumbel(mu)'s CDF exp(-exp(mu - g)), truncated at `upper`
            out.append(torch.exp(torch.exp(mu - upper) - torch.exp(mu - values[:, j])))
            taken, upper = taken + pf[tokens[:, j]], values[:, j]
        return out

    u1, u2, u3 = pit(values, tokens)
    uniform = torch.full((10,), 0.1, dtype=torch.float64)
    assert all(passes_chi_square(_uniform_bins(u), uniform) for u in (u1, u2, u3))
    joint = torch.zeros(5, 10, dtype=torch.float64)  # first token x first value's bin: independent
    joint.index_put_((tokens[:, 0], (u1 * 10).long().clamp(0, 9)), torch.ones(n, dtype=torch.float64), accumulate=True)
    assert passes_chi_square(joint, pf[:, None] * uniform[None])
    law = pf[:, None] * pf[None, :] / (1 - pf[:, None])
    law.fill_diagonal_(0)
    pairs = torch.zeros(5, 5, dtype=torch.float64)
    pairs.index_put_((tokens[:, 0], tokens[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    assert passes_chi_square(pairs, law)
    wrong = values.clone()  # the second value untruncated: Gumbel(log p(rest)) alone
    wrong[:, 1] = (1 - pf[tokens[:, 0]]).log() + gumbel_noise((n,), cpu_generator(13), "cpu")
    assert not passes_chi_square(_uniform_bins(pit(wrong, tokens)[1]), uniform)
    perturbed = log_p.cpu().double() + gumbel_noise((n, 5), cpu_generator(14), "cpu")  # the V-perturbation process
    ref_values, ref_tokens = torch.topk(perturbed, k, dim=-1)
    assert all(passes_chi_square(_uniform_bins(u), uniform) for u in pit(ref_values, ref_tokens))


def test_one_draw_follows_the_law_like_the_gumbel_argmax() -> None:
    """k = 1 draws by inverse CDF (`draw_one` from log p; `draw_rows` from p itself, what
    SD and RSD-C's one-child levels use, drawing from the probabilities their trees keep):
    the same law as the argmax of log p + Gumbel, zeros never drawn, rows batched each
    with its own generator; the Gumbel argmax itself passes the same test, and a draw
    from the untempered law (the wrong p) fails it."""
    p = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.1])
    log_p = p.log().to(TEST_DEVICE)
    drawn, from_p, argmax, wrong = torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(5)
    gen = generator(3)
    for _ in range(4000):
        drawn[int(gumbel_top_k(log_p, 1, gen))] += 1
        from_p[int(draw_rows(p.to(TEST_DEVICE)[None], [gen])[0])] += 1
        argmax[int((log_p.double() + gumbel_noise((5,), gen, TEST_DEVICE)).argmax())] += 1
        wrong[int(draw_one((log_p / 2)[None], [gen])[0])] += 1
    assert passes_chi_square(drawn, p) and passes_chi_square(from_p, p) and passes_chi_square(argmax, p)
    assert from_p[1] == 0
    assert not passes_chi_square(wrong, p)
    rows = torch.stack([log_p, log_p.flip(0)])
    a, b = generator(5), generator(5)
    batched = [draw_one(rows, [a, b]).tolist() for _ in range(50)]
    a, b = generator(5), generator(5)
    alone = [[int(draw_one(rows[:1], [a])[0]), int(draw_one(rows[1:], [b])[0])] for _ in range(50)]
    assert batched == alone


def test_gumbel_top_k_never_draws_zero_probability_tokens() -> None:
    log_p = torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")], device=TEST_DEVICE)
    assert gumbel_top_k(log_p, 3, generator(0)).tolist() == [0]
    assert gumbel_top_k(torch.tensor([-1.0, -0.1, -3.0], device=TEST_DEVICE), 2, None).tolist() == [1, 0]


def test_truncated_gumbel_keeps_order_and_hits_the_bound() -> None:
    gen = generator(2)
    perturbed = torch.tensor([[-1.0, 0.5, float("-inf"), -3.0]], dtype=torch.float64, device=TEST_DEVICE)
    perturbed = perturbed + gumbel_noise((1, 4), gen, TEST_DEVICE)
    upper = torch.tensor([-0.7], dtype=torch.float64, device=TEST_DEVICE)
    out = truncated_gumbel(perturbed, upper)
    assert float(out.max()) == pytest.approx(-0.7, abs=1e-12)
    assert out[0, 2] == float("-inf")
    finite = perturbed[0] > float("-inf")
    assert torch.equal(torch.argsort(out[0, finite]), torch.argsort(perturbed[0, finite]))
    assert bool((out <= upper[:, None] + 1e-12).all())


def test_stochastic_beam_search_best_beam_is_a_sample_of_the_sequence_law() -> None:
    """Two SBS levels over a 3-token Markov law: the best surviving beam (first in the
    returned order) must be distributed as the 2-token sequence law (Kool et al. 2019)."""
    first = torch.tensor([0.6, 0.3, 0.1])
    after = torch.tensor([[0.2, 0.5, 0.3], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])  # row = previous token
    first_log, after_log = on_device(first.log(), after.log())
    counts = torch.zeros(3, 3)
    gen = generator(3)
    for _ in range(6000):
        tree = _Growing([0], [-1], [torch.zeros(0)], [0], [0.0], [0.0])
        log_probs = {(0, 0): first_log}
        picks = _beam_level(tree, log_probs, 0, 2, gen)
        tree.tokens += [t for _, t in picks]
        tree.frontier = [1, 2][: len(picks)]
        for node, (_, t) in zip(tree.frontier, picks, strict=True):
            log_probs[0, node] = after_log[t]
        second = _beam_level(tree, log_probs, 0, 2, gen)
        parent, token = second[0]
        counts[tree.tokens[parent], token] += 1
    assert passes_chi_square(counts, first[:, None] * after)
