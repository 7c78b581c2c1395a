"""A learned probe of output length on the model's hidden state at the prompt's last token.

Issue 35's learned probe: ridge regression of log(output length) on the hidden state, trained
online from finished requests. The state (hundreds to thousands of floats) is first projected to
`rank` dimensions by a fixed random matrix drawn from the seed, so an update costs O(rank^2) and
the whole model O(rank x hidden + rank^2) floats however many requests it has seen: bounded memory
and pure Python (no numpy in the scheduler). The fit is kept current by recursive least squares
(a rank-one update of the inverse of the regularised Gram matrix per observation, so a prediction
is one dot product and no observation costs a solve); the inverse is recomputed exactly from the
Gram matrix every REFRESH observations, so rounding cannot drift. The spread comes from the
probe's own errors: each observation's residual is taken *before* it is learned (an honest
out-of-sample error) and the last `window` of them give the median and upper quantile around the
fitted log length.

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
from settings import check_settings, setting

REFRESH = 1024  # observations between exact recomputations of the inverse


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
        # The ridge solution and the inverse of the Gram matrix, kept current by rank-one updates.
        self._weights = [0.0] * k
        self._inverse = [[1.0 / cfg.ridge if i == j else 0.0 for j in range(k)] for i in range(k)]
        self._residuals: deque[float] = deque(maxlen=cfg.window)
        self._spread: tuple[float, float] | None = None
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

    def _log_length(self, z: list[float]) -> float:
        return sum(w * v for w, v in zip(self._weights, z))

    def _refit(self) -> None:
        """The inverse and the weights exactly from the Gram matrix and the targets."""
        self._inverse = _invert(self._gram)
        self._weights = _matvec(self._inverse, self._target)

    def observe(self, hidden: Sequence[float], output_len: int) -> None:
        """A request whose prompt ended in this hidden state finished after output_len tokens."""
        z = self._features(hidden)
        if z is None or output_len < 1:
            return
        y = math.log(output_len)
        if self.num_observed:
            self._residuals.append(y - self._log_length(z))
            self._spread = None
        for i, zi in enumerate(z):
            row = self._gram[i]
            for j, zj in enumerate(z):
                row[j] += zi * zj
            self._target[i] += zi * y
        self.num_observed += 1
        if self.num_observed % REFRESH == 0:
            self._refit()
        else:
            self._rank_one_update(z, y)

    def _rank_one_update(self, z: list[float], y: float) -> None:
        """The inverse and the weights after one observation (z, y), without a refit."""
        # Sherman-Morrison: (G + z z^T)^-1 = P - (P z)(P z)^T / (1 + z^T P z), P symmetric.
        pz = _matvec(self._inverse, z)
        scale = 1.0 / (1.0 + sum(a * b for a, b in zip(z, pz)))
        error = (y - self._log_length(z)) * scale
        self._weights = [w + p * error for w, p in zip(self._weights, pz)]
        for row, pi in zip(self._inverse, pz):
            f = pi * scale
            for j, pj in enumerate(pz):
                row[j] -= f * pj

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
        mid, high = self._residual_spread()
        median = math.exp(min(mean + mid, 50.0))
        upper = math.exp(min(mean + high, 50.0))
        left = max(1, max_tokens - generated)
        if median <= generated:  # past the fitted length: as many again as it has made
            guess = float(max(generated, 1))
            return LengthEstimate(min(guess, left), min(2 * guess, left))
        return LengthEstimate(
            min(median - generated, left), min(max(upper, median) - generated, left)
        )

    def _residual_spread(self) -> tuple[float, float]:
        """The residuals' median and configured quantile, kept until the next observation."""
        if self._spread is None:
            ordered = sorted(self._residuals)
            self._spread = (_quantile(ordered, 0.5), _quantile(ordered, self.config.quantile))
        return self._spread

    def state(self) -> dict[str, object]:
        """What it has learned, as plain lists (scheduler/length_state.py saves it)."""
        return {
            "gram": [row[:] for row in self._gram],
            "target": self._target[:],
            "inverse": [row[:] for row in self._inverse],
            "weights": self._weights[:],
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
        # The running inverse and weights as they were (so a restart answers exactly as before).
        inverse = state.get("inverse")
        if not isinstance(inverse, list) or len(inverse) != k:
            raise ValueError(f"probe state: expected a {k}x{k} inverse")
        inv = [_finite_floats(row, k) for row in inverse]
        weights = _finite_floats(state.get("weights"), k)
        self._gram, self._target, self._inverse, self._weights = rows, vector, inv, weights
        self._residuals = deque(spread[-self.config.window :], maxlen=self.config.window)
        self._spread = None
        self.num_observed = num


def _finite_floats(values: object, n: int) -> list[float]:
    """values as n finite floats, else ValueError."""
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"probe state: expected a list of {n} numbers")
    out = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if len(out) != n or not all(math.isfinite(v) for v in out):
        raise ValueError("probe state: expected finite numbers")
    return out


def _matvec(m: list[list[float]], v: list[float]) -> list[float]:
    return [sum(a * b for a, b in zip(row, v)) for row in m]


def _invert(a: list[list[float]]) -> list[list[float]]:
    """The inverse of a, by Gauss-Jordan elimination with partial pivoting; ValueError when a is
    singular or the result is not finite."""
    n = len(a)
    m = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if not abs(m[pivot][col]) > 1e-300:
            raise ValueError("probe state: the Gram matrix is singular")
        m[col], m[pivot] = m[pivot], m[col]
        inv = 1.0 / m[col][col]
        mc = m[col] = [v * inv for v in m[col]]
        for r in range(n):
            f = m[r][col]
            if r != col and f:
                mr = m[r]
                m[r] = [x - f * y for x, y in zip(mr, mc)]
    out = [row[n:] for row in m]
    if not all(math.isfinite(v) for row in out for v in row):
        raise ValueError("probe state: the Gram matrix is not invertible in floats")
    return out
