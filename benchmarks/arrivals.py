"""Request arrival processes for fixed-QPS load tests, following vLLM `bench serve`.

A load test at a given rate should send requests as an open-loop process, independent of
how fast the server answers, so that queueing shows up in latency instead of silently
lowering the offered load. Send times are computed up front from a seeded generator,
which makes a run's offered load reproducible and comparable across engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("constant", "poisson", "gamma")


@dataclass(frozen=True)
class ArrivalProcess:
    """Inter-arrival times with mean 1/`rate` seconds.

    - "constant": exactly 1/rate apart, first request at t=0.
    - "poisson": exponential inter-arrivals (CV 1), the usual model of independent users.
    - "gamma": Gamma(shape=burstiness, scale=1/(rate*burstiness)) inter-arrivals, as vLLM's
      `--burstiness`: the mean stays 1/rate while the coefficient of variation is
      1/sqrt(burstiness), so burstiness < 1 is burstier than Poisson and > 1 smoother.

    `rate=inf` sends every request at t=0 (vLLM's default: a pure throughput test).
    """

    rate: float
    kind: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind must be one of {KINDS}, got {self.kind!r}")
        if not self.rate > 0:  # also refuses NaN
            raise ValueError(f"rate must be > 0 requests/s (inf: all at t=0), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.kind != "gamma" and self.burstiness != 1.0:
            raise ValueError(f"burstiness only applies to kind='gamma' (got {self.burstiness} for {self.kind!r})")

    def schedule(self, n: int) -> list[float]:
        """Send times of `n` requests in seconds from the start of the run, non-decreasing.

        "constant" starts at 0.0; "poisson" and "gamma" are cumulative sums of `n` sampled
        inter-arrivals (so the first request also waits one inter-arrival), drawn from
        `numpy.random.default_rng(seed)`: the same seed gives the same schedule.
        """
        if n < 0:
            raise ValueError(f"number of requests must be >= 0, got {n}")
        if math.isinf(self.rate):
            return [0.0] * n
        if self.kind == "constant":
            return [i / self.rate for i in range(n)]
        shape = 1.0 if self.kind == "poisson" else self.burstiness  # Gamma(1, 1/rate) is exponential
        gaps = np.random.default_rng(self.seed).gamma(shape, 1.0 / (self.rate * shape), size=n)
        return [float(t) for t in np.cumsum(gaps)]
