"""A learned probe of output length on the model's hidden state at the prompt's last token.

Issue 35's learned probe: ridge regression of log(output length) on the hidden state, trained
online from finished requests. The state (hundreds to thousands of floats) is first projected to
`rank` dimensions by a fixed random matrix drawn from the seed, so an update costs O(rank^2) and
the whole model O(rank x hidden + rank^2) floats however many requests it has seen: bounded memory
and pure Python (no numpy in the scheduler). The spread comes from the probe's own errors: each
observation's residual is taken *before* it is learned (an honest out-of-sample error) and the
last `window` of them give the median and upper quantile around the fitted log length.

Deterministic under the seed: the same observations in the same order give the same answers.
It answers None until it has seen `min_samples` requests, and for a state of the wrong size, so a
cold or mismatched probe costs its ordering (FCFS), never a request.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.length_prediction import LengthEstimate, _quantile
from scheduler.settings import check_settings, setting


@dataclass(slots=True)
class ProbeConfig:
    """Settings of the hidden-state length probe."""

    rank: int = setting(32, "dimensions the hidden state is projected to", ge=1, le=512)
    ridge: float = setting(1.0, "L2 penalty of the regression", gt=0, le=1e9)
    quantile: float = setting(0.9, "the upper quantile it reports", gt=0.5, lt=1)
    window: int = setting(
        512, "recent out-of-sample residuals kept for the spread", ge=8, le=1 << 16
    )
    min_samples: int = setting(32, "observations before it answers", ge=1, le=1 << 20)
    seed: int = setting(0, "seed of the random projection", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)


class HiddenStateProbe:
    """Online ridge regression of log output length on a projected hidden state."""

    def __init__(
        self, hidden_size: int, config: ProbeConfig | None = None, project: bool = True
    ) -> None:
        """project=False: the state arrives projected already (workers/length_features.py) and
        is regressed on as it is; `rank` is then hidden_size."""
        if not 1 <= hidden_size <= 1 << 16:
            raise ValueError(f"hidden_size: must be in [1, 65536], got {hidden_size}")
        self.config = cfg = config or ProbeConfig()
        self.hidden_size = hidden_size
        self._proj: list[list[float]] | None = None
        rank = hidden_size
        if project:
            rng = random.Random(cfg.seed)
            scale = 1.0 / math.sqrt(cfg.rank)
            self._proj = [
                [rng.gauss(0.0, scale) for _ in range(hidden_size)] for _ in range(cfg.rank)
            ]
            rank = cfg.rank
        k = rank + 1  # the projection plus a bias term
        self._gram = [[cfg.ridge if i == j else 0.0 for j in range(k)] for i in range(k)]
        self._target = [0.0] * k
        self._weights: list[float] | None = None  # solved lazily after updates
        self._residuals: deque[float] = deque(maxlen=cfg.window)
        self.num_observed = 0

    def _features(self, hidden: Sequence[float]) -> list[float] | None:
        if len(hidden) != self.hidden_size:
            return None
        if self._proj is None:
            z = [float(h) for h in hidden]
        else:
            z = [sum(p * h for p, h in zip(row, hidden)) for row in self._proj]
        if not all(math.isfinite(v) for v in z):
            return None
        z.append(1.0)
        return z

    def _fit(self) -> list[float]:
        if self._weights is None:
            self._weights = _solve(self._gram, self._target)
        return self._weights

    def _log_length(self, z: list[float]) -> float:
        return sum(w * v for w, v in zip(self._fit(), z))

    def observe(self, hidden: Sequence[float], output_len: int) -> None:
        """A request whose prompt ended in this hidden state finished after output_len tokens."""
        z = self._features(hidden)
        if z is None or output_len < 1:
            return
        y = math.log(output_len)
        if self.num_observed:
            self._residuals.append(y - self._log_length(z))
        for i, zi in enumerate(z):
            row = self._gram[i]
            for j, zj in enumerate(z):
                row[j] += zi * zj
            self._target[i] += zi * y
        self._weights = None
        self.num_observed += 1

    def predict(
        self, hidden: Sequence[float], max_tokens: int, generated: int = 0
    ) -> LengthEstimate | None:
        """Remaining output tokens after `generated`, capped by what max_tokens leaves; None while
        cold or for a state it cannot read."""
        if self.num_observed < self.config.min_samples or len(self._residuals) < 2:
            return None
        z = self._features(hidden)
        if z is None:
            return None
        mean = self._log_length(z)
        spread = sorted(self._residuals)
        median = math.exp(min(mean + _quantile(spread, 0.5), 50.0))
        upper = math.exp(min(mean + _quantile(spread, self.config.quantile), 50.0))
        left = max(1, max_tokens - generated)
        if median <= generated:  # past the fitted length: as many again as it has made
            guess = float(max(generated, 1))
            return LengthEstimate(min(guess, left), min(2 * guess, left))
        return LengthEstimate(
            min(median - generated, left), min(max(upper, median) - generated, left)
        )

    def state(self) -> dict[str, object]:
        """What it has learned, as plain lists (scheduler/length_state.py saves it)."""
        return {
            "gram": [row[:] for row in self._gram],
            "target": self._target[:],
            "residuals": list(self._residuals),
            "num_observed": self.num_observed,
        }

    def load_state(self, state: dict[str, object]) -> None:
        """Take over a state() of a probe of the same shape; ValueError (nothing changed) when it
        does not fit."""
        k = len(self._target)
        gram, target = state.get("gram"), state.get("target")
        residuals, num = state.get("residuals"), state.get("num_observed")
        if not (isinstance(gram, list) and len(gram) == k and isinstance(target, list)):
            raise ValueError(f"probe state: expected a {k}x{k} gram matrix")
        if not (isinstance(residuals, list) and isinstance(num, int) and num >= 0):
            raise ValueError("probe state: residuals or num_observed malformed")
        rows = [_finite_floats(row, k) for row in gram]
        vector = _finite_floats(target, k)
        spread = _finite_floats(residuals, len(residuals))
        self._gram, self._target, self._weights = rows, vector, None
        self._residuals = deque(spread[-self.config.window :], maxlen=self.config.window)
        self.num_observed = num


def _finite_floats(values: object, n: int) -> list[float]:
    """values as n finite floats, else ValueError."""
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"probe state: expected a list of {n} numbers")
    out = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(out) != n or not all(math.isfinite(v) for v in out):
        raise ValueError("probe state: expected finite numbers")
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, by Gaussian elimination with partial pivoting (a is symmetric positive
    definite here: the ridge term keeps it so)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                mr, mc = m[r], m[col]
                for c in range(col, n + 1):
                    mr[c] -= f * mc[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
