"""What a step costs, as load-aware speculation (`speculation_policy.py`) prices it, each
part learned from the engine's own timings:

- the target forward (`ForwardCost`): a table of seconds over tokens timed at engine start
  on one request (`TokenCost`), plus what live steps of r requests cost beyond it
  (`ByRequests`, per request count, kept apart for one-token steps and steps with trees);
- a step's host work outside the forward and drafting (`ByRequests`, read by `by_requests`);
- each drafting path's calls (`LinearCost`: intercept + per level + per drafted node + per
  token caught up + per request-level, least squares over recent calls of every shape).

Nothing here decides anything: the policy reads these prices. Compiled with the policy where
built (`native_policy.py`: declared types hold at run time there; a float sum starts at 0.0)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Sequence

PER_SHAPE = 16
"""Recent drafting calls per shape (levels, drafted nodes) the draft-cost fits keep: enough
to average noise, few enough to follow drift. Per shape, so that a run of one shape cannot
push every other shape out of the fit (a single shape leaves the per-node slope undetermined,
and a fit that believes drafting 4 nodes costs what 16 did never leaves the 16)."""
FORWARD_EMA = 0.2
"""Weight of a new timing of a forward size."""
SPIKE = 1.5
"""Most a live step's timing may exceed the price of its shape (forward, host work, or a
drafting call: `SpeculationPolicy._add_draft_sample`) once that price rests on
`PLAIN_SAMPLES` timings: a timing above counts as this much. A shared CPU has single slow
steps: one plain forward of 8 requests at 6.0 ms where they take ~1.8 (2-core Sapphire
Rapids) took the plain price from 2.2 to 3.1 ms; the batch then drafted (rsd-s, 4-node
chains at ~3.4 tokens/ms, where auto-regression makes ~3.5) and, drafting, never timed a
plain step again that round: load-aware 0.91x auto-regression where other runs read
0.96-0.98x. A slowdown that lasts still moves the price (each step up to 10%). The first
tree step at a request count is capped the same way against its extrapolated price
(`ForwardCost.observe`)."""
PLAIN_SAMPLES = 3
"""Timings of a request count's auto-regressive step (forward residual and host overhead)
below which a batch that drafts spends its exploration credit on plain steps
(`_plain_probe`); also the timings a price (a drafting call's shape's too) rests on before
`SPIKE` caps new ones against it (a drafting call's shape with fewer: `LinearCost.bound`)."""
SPIKE_OVER_START_UP = 3.0
"""Most a drafting call's first live timing of a shape may exceed the start-up stand-ins it
replaces (`LinearCost.bound`): live calls meet longer contexts and colder caches than
start-up ones (ReDrafter's beam searches for 32 requests: 7.5 ms live, 4.1 at start-up)."""


class TokenCost:
    """Seconds of a target forward of n tokens: a table of measured sizes (decayed means),
    linear in between, extrapolated from the two largest beyond."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}
        self._sorted: list[int] = []

    def add(self, n: int, seconds: float) -> None:
        if n in self.points:
            self.points[n] += FORWARD_EMA * (seconds - self.points[n])
        else:
            self.points[n] = seconds
            self._sorted = sorted(self.points)

    def __call__(self, n: float) -> float:
        xs = self._sorted
        if not xs:
            return 0.0
        if n in self.points:
            return self.points[n]  # type: ignore[index]
        i = bisect.bisect_left(xs, n)
        if i == 0:
            return self.points[xs[0]]
        if i == len(xs):
            if len(xs) == 1:
                return self.points[xs[0]] * n / xs[0]
            i -= 1
        lo, hi = xs[i - 1], xs[i]
        a, b = self.points[lo], self.points[hi]
        return max(a + (b - a) * (n - lo) / (hi - lo), 0.0)

    def slope(self, lo: float, hi: float) -> float:
        """Marginal seconds per token between lo and hi tokens."""
        return max((self(hi) - self(lo)) / (hi - lo), 0.0) if hi > lo else 0.0


class ForwardCost:
    """Seconds of a target forward of n tokens from r requests: `tokens` (one request,
    timed at engine start) plus the decayed mean of what live forwards of r requests cost
    beyond it (interpolated between measured r; above them, the largest count's; below
    them, proportional to r for one-token steps; what trees add unscaled, `residual`), kept apart for
    steps of one token per request (`extra`) and steps with trees (`extra_trees`: each
    request's rows attend over its own context, so r requests of several tokens cost more
    beyond the one-request table than r single tokens). One residual for both charged a
    run of drafting steps' attention to auto-regressive steps too, which made drafting
    look cheap by comparison and kept the demo engine drafting one-beam trees at batch 16
    and 32 where they lost 8-15% to auto-regression."""

    def __init__(self) -> None:
        self.tokens = TokenCost()
        self.extra = ByRequests(least_first=True)
        self.extra_trees = ByRequests()

    def __call__(self, n: float, requests: int = 1) -> float:
        return self.tokens(n) + self.residual(requests, n > requests)

    def residual(self, requests: int, trees: bool = False) -> float:
        """What r requests add beyond the table: for `trees`, from steps with trees but never
        less than one-token steps' (more rows per request attend more; an estimate carried
        over from a few small early batches must not make trees look cheap). Beyond the
        request counts measured with trees, trees add what they added at the nearest one
        over its one-token steps, unscaled: at batch 1 a tree step's residual (~1.6 ms) is
        mostly per step, and scaled by the requests like the one-token residual it priced
        the first tree steps at batch 8 ~13 ms over the table where they cost 1-2.5 ms, so
        load-aware sd at batch 8 stayed auto-regressive (504 of 506 request-steps) where
        5-node chains ran 1.06x. Priced too low instead, the first tree step at that count
        measures it."""
        one_token = by_requests(self.extra, requests)
        if not trees or not self.extra_trees:
            return one_token
        known = sorted(self.extra_trees)
        if known[0] <= requests <= known[-1]:
            tree = by_requests(self.extra_trees, requests)
        else:
            near = known[0] if requests < known[0] else known[-1]
            tree = one_token + self.extra_trees[near] - by_requests(self.extra, near)
        return max(tree, one_token)

    def slope(self, lo: float, hi: float) -> float:
        """Marginal seconds per token between lo and hi tokens (the request count fixed)."""
        return self.tokens.slope(lo, hi)

    def calibrate(self, n: int, seconds: float) -> None:
        self.tokens.add(n, seconds)

    def observe(self, n: int, requests: int, seconds: float, probe: bool = False) -> bool:
        """Learn a live forward's timing (a plain `probe`'s: `ByRequests.add`; one over
        `SPIKE` times the price of a shape timed `PLAIN_SAMPLES` times or more counts as that
        much, and so does the first tree step at a request count, against its extrapolated
        price); whether it is the first of its shape (trees or one token per request) at this
        request count (until then, `residual` extrapolated). The first tree step of a batch
        after a warm-up runs slow at times: rsd-c at T=0, batch 1 (2-core Sapphire Rapids),
        a 5-node tree's forward of 21.7 ms where they take ~1.8 set the tree residual at 20
        ms; trees looked ~10x dearer than they are, the batch went auto-regressive and only
        probes timed trees again (tree steps after long plain runs, slow themselves: still
        5.7 ms after three). 3 sweeps of 7 ran 0.94-0.97x, where the others read 1.34-1.44x;
        with the cap, 5 of 5 read 1.49-1.56x. Priced above it, the second and third timings
        (a mean until `PLAIN_SAMPLES`) show it."""
        table = self.extra_trees if n > requests else self.extra
        first = requests not in table
        if not self.tokens.points:  # never calibrated (a cost fit learning from live steps only)
            self.tokens.add(n, seconds)
            return first
        base = self.tokens(n)
        if table.timed(requests) or (first and n > requests):  # the first tree timing: against the extrapolation
            seconds = min(seconds, SPIKE * (base + self.residual(requests, n > requests)))
        table.add(requests, seconds - base, probe)
        return first


class ByRequests(dict[int, float]):
    """Seconds learned per request count (read by `by_requests`), with how many timings
    each count rests on (`seen`)."""

    def __init__(self, least_first: bool = False) -> None:
        super().__init__()
        self.seen: Counter[int] = Counter()
        self.least_first = least_first
        """Plain steps' tables: a count's first `PLAIN_SAMPLES` timings keep their least,
        not their mean. Those are the first steps a batch runs plain, mostly right after its
        prefill, and a CPU runs them slow for longer than `AFTER_PREFILL` (8 one-token
        rsd-s requests: 4.9, 4.3, 3.5, 3.0, 2.8, 2.6, 2.7, then ~2.3-2.4 ms); their mean priced
        auto-regression ~10% high, and the batch drafted chains no faster than it (rsd-s at
        batch 8: 0.94x). Priced low, auto-regression only has drafting prove itself by more.
        Steps with trees keep the mean: priced low, trees would look cheap."""

    def timed(self, requests: int) -> bool:
        """Whether there is a value at `requests` and it rests on `PLAIN_SAMPLES` timings or
        more (what `SPIKE` caps a new timing against)."""
        return requests in self and self.seen[requests] >= PLAIN_SAMPLES

    def add(self, requests: int, seconds: float, probe: bool = False) -> None:
        """A new timing for `requests`: the mean of its timings so far (of the first
        `PLAIN_SAMPLES`, their least where `least_first`), then a decayed mean (weight
        `FORWARD_EMA`); a `probe`'s (`_plain_probe`) below the value replaces it
        (`PLAIN_EVERY`: taken at its decayed weight, four re-timings 32 steps apart brought
        a price doubled by a burst down to where auto-regression won, 130 steps of drafting
        at a loss; one above it only adds like any other). Taken with that weight from the
        second timing on, a count's first timing weighed ~80% for several more: the first
        steps after a batch's prefill run slow (a 2-core Sapphire Rapids: 8 one-token
        requests 3.0, 2.9, 2.5, 2.2 ms, then ~1.9), so the first auto-regressive timing of 8
        requests stood ~50% high."""
        self.seen[requests] += 1
        old = self.get(requests, 0.0)
        if self.least_first and requests in self and self.seen[requests] <= PLAIN_SAMPLES:
            self[requests] = min(old, seconds)
            return
        if probe and requests in self and seconds < old:
            self[requests] = seconds
            return
        self[requests] = old + max(FORWARD_EMA, 1.0 / self.seen[requests]) * (seconds - old)


def by_requests(table: dict[int, float], requests: int, per_request: bool = True) -> float:
    """`table`'s value (seconds, learned per request count) at `requests`: linear between
    measured counts; above them, the largest count's (`per_request`; below them, the
    smallest count's non-negative part per request times `requests` plus its negative part
    unscaled), or else the line through
    the nearest two counts (flat from a single one; never decreasing, never negative). 0
    before any."""
    if requests in table:
        return table[requests]
    if not table:
        return 0.0
    known = sorted(table)
    if not per_request and (requests < known[0] or requests > known[-1]):
        near, other = (known[0], known[1:2]) if requests < known[0] else (known[-1], known[-2:-1])
        slope = max((table[near] - table[other[0]]) / (near - other[0]), 0.0) if other else 0.0  # flat from one
        return max(table[near] + slope * (requests - near), 0.0)
    if requests > known[-1]:  # above the measured: the nearest count's, unscaled
        # priced high, auto-regression is never chosen, so never measured: scaled per
        # request, a warm-up's batch-1 residual (2.2 ms, mostly per step) priced a one-token
        # step of 8 requests at 22 ms where it took 6, and load-aware Lyanna drafted at
        # batch 8 at a loss from its first step on. Priced low, the first step at that count
        # measures it
        return table[known[-1]]
    if requests < known[0]:  # below the measured: per request like the nearest
        # what requests add scales with them; a negative residual is the table's own bias
        # (its timing was slow), the same for any batch
        value = table[known[0]]
        return max(value, 0.0) * requests / known[0] + min(value, 0.0)
    i = bisect.bisect_left(known, requests)  # between two measured counts: linear (np.interp cost ~10 us a call)
    lo, hi = known[i - 1], known[i]
    return table[lo] + (table[hi] - table[lo]) * (requests - lo) / (hi - lo)


class LinearCost:
    """seconds = c0 + c . x (non-negative coefficients), least squares over the latest
    `PER_SHAPE` (features, seconds) samples of every shape seen (the feature vector, or
    the coarser `shape` its caller gives). The normal equations (A^T A, A^T t) are kept
    up to date as samples come and go, so a refit (once per new sample, not per query) is
    a 5 x 5 solve: rebuilding A from every kept sample cost ~0.1 ms a drafting step."""

    def __init__(self) -> None:
        self._shapes: dict[tuple[float, ...], deque[tuple[tuple[float, ...], float]]] = {}
        self._start_up: set[tuple[float, ...]] = set()
        """Shapes holding start-up samples only (`add(..., start_up=True)`)."""
        self._gram: list[list[float]] = []  # A^T A over the kept samples (rows (1, *features))
        self._moment: list[float] = []  # A^T t
        self._coef: tuple[float, ...] | None = None  # [intercept, slopes...] of the last fit
        self._stale = True  # samples came or went since that fit
        self._factors: dict[tuple[int, ...], _Elimination] = {}
        """A^T A's elimination per set of kept features (`_fitted`), while A^T A stays: a
        steady choice's calls move A^T t alone, and a refit is then a substitution."""

    @property
    def samples(self) -> list[tuple[tuple[float, ...], float]]:
        """The (features, seconds) samples the fit uses."""
        return [sample for samples in self._shapes.values() for sample in samples]

    def __len__(self) -> int:
        return sum(len(samples) for samples in self._shapes.values())

    def by_shape(self) -> dict[tuple[float, ...], tuple[bool, list[float]]]:
        """Each shape kept (`add`'s key): whether its samples are start-up stand-ins, and
        their seconds (what `benchmarks/policy_trace.py` reports)."""
        return {key: (key in self._start_up, [s for _, s in kept]) for key, kept in self._shapes.items()}

    def live(self, shape: tuple[float, ...]) -> int:
        """Live samples kept of `shape` (`add`'s key; none while it holds start-up stand-ins)."""
        return 0 if shape in self._start_up else len(self._shapes.get(shape, ()))

    def bound(self, shape: tuple[float, ...], x: tuple[float, ...]) -> float | None:
        """The most a new live sample of `shape` (features `x`) counts as, a single slow call
        being a pause of the process, not a price (None: no bound, a shape never timed):
        `SPIKE` times the fit's price once the shape rests on `PLAIN_SAMPLES` live samples,
        `SPIKE` times the slowest of its fewer ones, `SPIKE_OVER_START_UP` times the mean of
        the start-up stand-ins a first live one replaces. Unbounded before `PLAIN_SAMPLES`,
        one 30 ms pause in ReDrafter's second live call of its 6-node chain (~0.45 ms) kept
        the chain priced at ~6 ms: load-aware drafted the wider beams (another fit, whose
        calls never time a chain) or nothing for the rest of the run, at ~0.6 of the chains'
        speed (batch 1, T=0: 1 lockstep run in ~20 here, and each time a pause was injected)."""
        kept = self._shapes.get(shape)
        if not kept:
            return None
        if shape in self._start_up:
            return SPIKE_OVER_START_UP * sum((s for _, s in kept), 0.0) / len(kept)
        if len(kept) >= PLAIN_SAMPLES:
            return SPIKE * self.recent(*x)
        return SPIKE * max(s for _, s in kept)

    def add(
        self, x: tuple[float, ...], seconds: float, shape: tuple[float, ...] | None = None, start_up: bool = False
    ) -> None:
        """A sample; `start_up`: timed at engine start, a stand-in until a live sample of its
        shape comes, which replaces every start-up sample of that shape at once (start-up
        calls miss what live ones meet: longer contexts, colder caches, the verification of
        real trees; ReDrafter's beam searches for 32 requests read 4.1 ms where live ones
        took 7.5, and 16 live samples would have been needed to outvote them)."""
        key = tuple(x) if shape is None else shape
        if start_up:
            self._start_up.add(key)
        elif key in self._start_up:
            self._start_up.discard(key)
            for sample in self._shapes.pop(key, ()):
                self._account(*sample, -1.0)
        kept = self._shapes.get(key)
        if kept is None:
            kept = self._shapes[key] = deque(maxlen=PER_SHAPE)
        x = tuple(x)
        if len(kept) == PER_SHAPE:  # the oldest of its shape leaves the fit
            old_x, old_seconds = kept[0]
            if old_x == x:  # a steady choice's call: A^T A stays, only A^T t moves (~half the work)
                kept.append((x, seconds))
                self._account_seconds(x, seconds - old_seconds)
                self._stale = True  # refit at the next query (`_fitted`); `recent` keeps the last fit
                return
            self._account(old_x, old_seconds, -1.0)
        kept.append((x, seconds))
        self._account(x, seconds, 1.0)
        self._stale = True

    def _account_seconds(self, x: tuple[float, ...], seconds: float) -> None:
        """A^T t for a sample's seconds moved by `seconds` (its features the same)."""
        moment = self._moment
        moment[0] += seconds
        for i, a in enumerate(x, 1):
            moment[i] += seconds * a

    def _account(self, x: tuple[float, ...], seconds: float, sign: float) -> None:
        """A sample in (`sign` 1) or out (-1) of A^T A and A^T t."""
        row = (1.0, *x)
        if not self._gram:
            self._gram, self._moment = [[0.0] * len(row) for _ in row], [0.0] * len(row)
        self._factors.clear()
        self._account_seconds(x, sign * seconds)
        for a, gram_i in zip(row, self._gram, strict=True):
            for j, b in enumerate(row):
                gram_i[j] += sign * a * b

    def __call__(self, *x: float) -> float:
        return _price(self._fitted(), x) if self._shapes else 0.0

    def recent(self, *x: float) -> float:
        """`self(*x)` by the last fit made, which may predate the latest samples (a refit
        only when none was made yet): for a bound on a new sample, where one sample more or
        less moves nothing that matters. Asked with every live drafting call
        (`SpeculationPolicy._add_draft_sample`), `self(*x)` refitted the 5 x 5 system every
        step (~20 us a batch-1 step on a 2-thread EPYC), where the choice, mostly a
        decision that stands, needs a fit every few steps."""
        return self(*x) if self._coef is None else _price(self._coef, x)

    def slopes(self) -> tuple[float, ...]:
        return self._fitted()[1:] if self._shapes else ()

    def _fitted(self) -> tuple[float, ...]:
        """[intercept, slopes...], refitted after a new sample (there is at least one). Plain
        floats and a 5 x 5 elimination: numpy's solve cost ~0.16 ms a refit in the engine
        (its per-call overhead, with caches cold after a forward), ~2% of a batch-1 step.
        The elimination of A^T A is kept while it stays (`_factors`): the refit is then its
        substitution alone (the same operations on A^T t, in the same order: the same fit)."""
        if self._stale or self._coef is None:
            n = len(self._moment)
            keep: tuple[int, ...] = tuple(range(n))
            while True:
                factor = self._factors.get(keep)
                if factor is None:
                    ridge = 1e-6  # features without spread: shrink their coefficient, not blow up
                    gram = [[self._gram[i][j] + (ridge if i == j else 0.0) for j in keep] for i in keep]
                    factor = self._factors[keep] = _eliminate(gram)
                coef = dict(zip(keep, _substitute(factor, [self._moment[i] for i in keep]), strict=True))
                if min(coef.values(), default=0.0) >= 0 or len(keep) < n:  # costs never shrink with work:
                    break  # a negative intercept/slope is refitted once without every negative one
                keep = tuple(i for i in keep if coef[i] > 0)
            self._coef, self._stale = tuple(max(coef.get(i, 0.0), 0.0) for i in range(n)), False
        return self._coef


def _price(coef: tuple[float, ...], x: tuple[float, ...]) -> float:
    """coef[0] + coef[1:] . x: the slopes' sum, then the intercept (`sum`'s order, without its generator)."""
    total = 0.0
    for c, v in zip(coef[1:], x, strict=True):
        total += c * v
    return coef[0] + total


_Elimination = tuple[list[int], list[list[float]], list[list[float]]]
"""Gaussian elimination of a matrix (`_eliminate`): each column's pivot row, each column's
multipliers of the rows below it, and the upper triangle left."""


def _eliminate(a: list[list[float]]) -> _Elimination:
    """`a` (small, symmetric positive definite) eliminated with partial pivoting, for
    `_substitute` to solve a x = b for any b."""
    n = len(a)
    m = [list(row) for row in a]
    pivots, multipliers = [], []
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        pivots.append(pivot)
        column = []
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            column.append(f)
            for c in range(col, n):
                m[r][c] -= f * m[col][c]
        multipliers.append(column)
    return pivots, multipliers, m


def _substitute(factor: _Elimination, b: list[float]) -> list[float]:
    """x with a x = b, `factor` = `_eliminate(a)`: the row swaps and eliminations on b, then
    back substitution (what eliminating the augmented [a | b] does to b, in its order)."""
    pivots, multipliers, m = factor
    n = len(b)
    rhs = list(b)
    for col in range(n):
        pivot = pivots[col]
        rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        for r, f in zip(range(col + 1, n), multipliers[col], strict=True):
            rhs[r] -= f * rhs[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rhs[r] - sum((m[r][c] * x[c] for c in range(r + 1, n)), 0.0)) / m[r][r]
    return x


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent
    violators: a run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]
