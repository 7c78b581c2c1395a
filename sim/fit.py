"""Fit a CostModel to timed engine steps (pure Python: `sim calibrate` times, this fits).

The cost model is linear in its nine coefficients once each step's binding regime is known:

    t = overhead + per_seq * seqs
        + [prefill] (prefill_overhead + prefill_step_per_seq * seqs
                     + per_prefill_seq * prefill_seqs + per_pair * prefill_pairs)
        + (compute-bound: sec_per_token * tokens
           | memory-bound: weight_read + sec_per_kv_token * (kv_read + tokens))

The fit alternates between weighted non-negative least squares over all steps (residuals relative
to the step's time, so 2 ms decode steps weigh as much as 2 s prefills) and re-assigning each step
to the regime whose term is larger, from several starting assignments, keeping the best.
"""

from __future__ import annotations

import statistics
from dataclasses import MISSING, asdict, dataclass, fields

from scheduler.config import MAX_NUM_SEQS, MAX_STEP_TOKENS
from scheduler.sampling_params import MAX_TOKENS
from settings import check_settings, setting
from sim.cost import CostModel

# A measured step of an hour is a broken measurement, not a step.
MAX_STEP_S = 3600.0


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step's shape (as the simulator counts it) and its measured time."""

    prefill_tokens: int = setting(MISSING, "prompt tokens computed", ge=0, le=MAX_STEP_TOKENS)
    decode_tokens: int = setting(MISSING, "decode tokens computed", ge=0, le=MAX_STEP_TOKENS)
    kv_read_tokens: int = setting(
        MISSING,
        "context tokens whose KV the step read",
        ge=0,
        le=MAX_NUM_SEQS * MAX_TOKENS,  # every sequence at a full context
    )
    num_seqs: int = setting(MISSING, "sequences scheduled", ge=0, le=MAX_NUM_SEQS)
    seconds: float = setting(MISSING, "the measured step time", gt=0, le=MAX_STEP_S)
    prefill_pairs: int = setting(
        0,
        "prefill attention (query token, key) pairs",
        ge=0,
        le=MAX_STEP_TOKENS * MAX_TOKENS,  # a full step's queries, each over a full context
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.prefill_tokens + self.decode_tokens == 0:
            raise ValueError("prefill_tokens/decode_tokens: a step computes at least one token")
        if self.decode_tokens > self.num_seqs:
            raise ValueError(
                f"num_seqs: at least decode_tokens ({self.decode_tokens}), got {self.num_seqs}"
            )

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True, slots=True)
class Coefficients:
    """Seconds per unit of each term of the step-time model (the order of the fit's columns)."""

    step_overhead_s: float
    per_seq_s: float
    prefill_overhead_s: float
    prefill_step_per_seq_s: float
    per_prefill_seq_s: float
    per_prefill_pair_s: float
    sec_per_token: float  # compute time of one token (2 * num_params / flops_per_s)
    weight_read_s: float  # reading the weights once (weight_bytes / bytes_per_s)
    sec_per_kv_token: float  # reading one token's K and V (kv_bytes_per_token / bytes_per_s)

    def compute_bound(self, s: StepSample) -> bool:
        memory = self.weight_read_s + self.sec_per_kv_token * (s.kv_read_tokens + s.tokens)
        return self.sec_per_token * s.tokens > memory

    def predict(self, s: StepSample) -> float:
        return sum(c * x for c, x in zip(_values(self), _row(s, self.compute_bound(s))))

    def to_cost_model(
        self, name: str, num_params: float, weight_bytes: float, source: str
    ) -> CostModel:
        """The profile: bandwidth from the weight read; KV bytes per token at that bandwidth
        (effective)."""
        bytes_per_s = weight_bytes / self.weight_read_s if self.weight_read_s > 0 else 1e18
        flops_per_s = 2.0 * num_params / self.sec_per_token if self.sec_per_token > 0 else 1e30
        return CostModel(
            name=name,
            num_params=float(num_params),
            weight_bytes=float(weight_bytes),
            kv_bytes_per_token=self.sec_per_kv_token * bytes_per_s,
            flops_per_s=flops_per_s,
            bytes_per_s=bytes_per_s,
            step_overhead_s=self.step_overhead_s,
            per_seq_overhead_s=self.per_seq_s,
            prefill_step_overhead_s=self.prefill_overhead_s,
            prefill_step_per_seq_s=self.prefill_step_per_seq_s,
            per_prefill_seq_overhead_s=self.per_prefill_seq_s,
            prefill_pair_s=self.per_prefill_pair_s,
            source=source,
        )

    @classmethod
    def of(cls, model: CostModel) -> Coefficients:
        """The coefficients a profile implies (inverse of to_cost_model)."""
        return cls(
            model.step_overhead_s,
            model.per_seq_overhead_s,
            model.prefill_step_overhead_s,
            model.prefill_step_per_seq_s,
            model.per_prefill_seq_overhead_s,
            model.prefill_pair_s,
            2.0 * model.num_params / model.flops_per_s,
            model.weight_bytes / model.bytes_per_s,
            model.kv_bytes_per_token / model.bytes_per_s,
        )


_NAMES = tuple(f.name for f in fields(Coefficients))


def _values(c: Coefficients) -> tuple[float, ...]:
    return tuple(getattr(c, n) for n in _NAMES)


def _row(s: StepSample, compute: bool) -> list[float]:
    has_prefill = 1.0 if s.prefill_tokens else 0.0
    linear = [
        1.0,
        float(s.num_seqs),
        has_prefill,
        has_prefill * s.num_seqs,
        has_prefill * (s.num_seqs - s.decode_tokens),
        has_prefill * s.prefill_pairs,
    ]
    if compute:
        return linear + [float(s.tokens), 0.0, 0.0]
    return linear + [0.0, 1.0, float(s.kv_read_tokens + s.tokens)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _least_squares(rows: list[list[float]], ys: list[float], free: list[int]) -> list[float] | None:
    """Minimise sum(((row . x) - y) / y)^2 over the free columns (the others are 0)."""
    ata = [[0.0] * len(free) for _ in free]
    atb = [0.0] * len(free)
    for row, y in zip(rows, ys):
        w = 1.0 / (y * y)
        for i, ci in enumerate(free):
            atb[i] += w * row[ci] * y
            for j, cj in enumerate(free):
                ata[i][j] += w * row[ci] * row[cj]
    sol = _solve(ata, atb)
    if sol is None:
        return None
    x = [0.0] * len(_NAMES)
    for i, ci in enumerate(free):
        x[ci] = sol[i]
    return x


def _nonnegative_fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: drop the most negative column and refit.

    Collinear columns (all steps memory-bound make the overhead and the weight read one constant)
    leave the system singular: then the column whose removal fits best goes.
    """
    free = [c for c in range(len(_NAMES)) if any(row[c] for row in rows)]
    while free:
        x = _least_squares(rows, ys, free)
        if x is None:
            # Ties go to dropping the overhead, so that the weight read (the bandwidth) stays
            # physical.
            trials = [(c, _least_squares(rows, ys, [f for f in free if f != c])) for c in free]
            ok = [(c, _sse(rows, ys, t)) for c, t in trials if t is not None]
            least = min((e for _, e in ok), default=0.0)
            free.remove(next((c for c, e in ok if e <= least * (1 + 1e-9) + 1e-18), free[-1]))
            continue
        worst = min(free, key=lambda c: x[c])
        if x[worst] >= 0:
            return x
        free.remove(worst)
    return [0.0] * len(_NAMES)


def _sse(rows: list[list[float]], ys: list[float], x: list[float]) -> float:
    return sum(((sum(r * v for r, v in zip(row, x)) - y) / y) ** 2 for row, y in zip(rows, ys))


def _relative_sse(c: Coefficients, samples: list[StepSample]) -> float:
    return sum(((c.predict(s) - s.seconds) / s.seconds) ** 2 for s in samples)


def fit_coefficients(samples: list[StepSample], max_iters: int = 50) -> Coefficients:
    """The coefficients that minimise the squared relative error of the step-time model."""
    if len(samples) < len(_NAMES):
        raise ValueError(
            f"samples: need at least {len(_NAMES)} timed steps to fit, got {len(samples)}"
        )
    ys = [s.seconds for s in samples]
    # Starting regimes: all memory-bound, all compute-bound, and "prefill steps of at least n tokens
    # are compute-bound" for every n seen (alternation alone can cycle between two wrong
    # partitions).
    sizes = sorted({s.prefill_tokens for s in samples if s.prefill_tokens})
    starts = [[False] * len(samples), [True] * len(samples)]
    starts += [[0 < n <= s.prefill_tokens for s in samples] for n in sizes]
    fits = []
    for regime in starts:
        for _ in range(max_iters):
            c = Coefficients(*_nonnegative_fit([_row(s, r) for s, r in zip(samples, regime)], ys))
            new = [c.compute_bound(s) for s in samples]
            if new == regime:
                break
            regime = new
        fits.append(c)
    return min(fits, key=lambda fit: _relative_sse(fit, samples))  # ties: the earlier start


@dataclass(frozen=True, slots=True)
class FitError:
    """How far a profile's predictions are from measured steps."""

    num_steps: int
    median_abs_pct: float  # median of |predicted - measured| / measured, in percent
    p90_abs_pct: float
    total_pct: float  # (sum predicted - sum measured) / sum measured, in percent

    def __str__(self) -> str:
        return (
            f"{self.num_steps} steps: median |error| {self.median_abs_pct:.1f}%, p90 "
            f"{self.p90_abs_pct:.1f}%, "
            f"total time {self.total_pct:+.1f}%"
        )


def prediction_error(model: CostModel, samples: list[StepSample]) -> FitError:
    """Per-step and total-time error of the profile on these steps (held-out steps, for a fair
    figure)."""
    if not samples:
        raise ValueError("samples: need at least one step")
    predicted = [
        model.step_time(
            s.prefill_tokens, s.decode_tokens, s.kv_read_tokens, s.num_seqs, s.prefill_pairs
        )
        for s in samples
    ]
    errs = sorted(abs(p - s.seconds) / s.seconds * 100 for p, s in zip(predicted, samples))
    total = sum(s.seconds for s in samples)
    return FitError(
        len(samples),
        statistics.median(errs),
        errs[min(len(errs) - 1, int(0.9 * len(errs)))],
        (sum(predicted) - total) / total * 100,
    )


def samples_to_json(samples: list[StepSample]) -> list[dict]:
    return [asdict(s) for s in samples]


def samples_from_json(rows: list) -> list[StepSample]:
    """StepSamples from their JSON form; a bad row raises ValueError naming its index and field."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"samples[{i}]: expected an object")
        try:
            out.append(StepSample(**row))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"samples[{i}]: {exc}") from None
    return out
