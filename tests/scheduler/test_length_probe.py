"""The hidden-state length probe: cold and mismatched states answer None, it learns a log-linear
relation, its memory is bounded, and it is deterministic under its seed."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.length_probe import HiddenStateProbe, ProbeConfig


def data(n: int, dim: int = 16, seed: int = 1) -> list[tuple[list[float], int]]:
    """States whose log length is linear in them (plus a little noise)."""
    rng = random.Random(seed)
    w = [rng.gauss(0, 1) for _ in range(dim)]
    out = []
    for _ in range(n):
        h = [rng.gauss(0, 1) for _ in range(dim)]
        y = 3.0 + 0.5 * sum(a * b for a, b in zip(w, h)) / math.sqrt(dim) + rng.gauss(0, 0.1)
        out.append((h, max(1, round(math.exp(y)))))
    return out


def test_cold_and_mismatched_states_answer_none() -> None:
    probe = HiddenStateProbe(16, ProbeConfig(rank=4, min_samples=8))
    assert probe.predict([0.0] * 16, max_tokens=100) is None
    for h, n in data(10):
        probe.observe(h, n)
    assert probe.predict([0.0] * 16, max_tokens=100) is not None
    assert probe.predict([0.0] * 15, max_tokens=100) is None  # wrong size
    assert probe.predict([math.nan] * 16, max_tokens=100) is None
    probe.observe([math.inf] * 16, 5)  # ignored, not raised
    probe.observe([0.0] * 16, 0)
    assert probe.num_observed == 10


def test_learns_a_log_linear_relation_and_caps_by_max_tokens() -> None:
    probe = HiddenStateProbe(16, ProbeConfig(rank=16, min_samples=8))
    rows = data(300)
    for h, n in rows[:200]:
        probe.observe(h, n)
    errors = []
    for h, n in rows[200:]:
        est = probe.predict(h, max_tokens=10_000)
        assert est is not None and 0 < est.median <= est.upper
        errors.append(abs(math.log(est.median) - math.log(n)))
    assert sum(errors) / len(errors) < 0.3
    est = probe.predict(rows[0][0], max_tokens=5)
    assert est is not None and est.upper <= 5
    # Remaining given generated: past the fitted length it expects as many again.
    est = probe.predict(rows[0][0], max_tokens=100_000, generated=50_000)
    assert est is not None and est.median == 50_000


def test_memory_is_bounded_and_answers_deterministic() -> None:
    cfg = ProbeConfig(rank=4, window=8, min_samples=4, seed=7)
    a, b = HiddenStateProbe(16, cfg), HiddenStateProbe(16, cfg)
    for h, n in data(50):
        a.observe(h, n)
        b.observe(h, n)
    assert len(a._residuals) == 8 and len(a._gram) == 5
    h = data(1, seed=9)[0][0]
    assert a.predict(h, 1000) == b.predict(h, 1000)


@pytest.mark.parametrize("field,value", [("rank", 0), ("ridge", 0.0), ("quantile", 1.0)])
def test_bad_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ProbeConfig(**{field: value})
    with pytest.raises(ValueError, match="hidden_size"):
        HiddenStateProbe(0)


def test_recursive_updates_keep_the_exact_ridge_solution() -> None:
    from scheduler import length_probe

    probe = HiddenStateProbe(16, ProbeConfig(rank=8, min_samples=1), project=False)
    for h, n in data(200, seed=4):
        probe.observe(h, n)
    exact = length_probe._matvec(length_probe._invert(probe._gram), probe._target)
    assert max(abs(a - b) for a, b in zip(probe._weights, exact)) < 1e-9
    with pytest.raises(ValueError, match="singular"):
        length_probe._invert([[0.0, 0.0], [0.0, 0.0]])
