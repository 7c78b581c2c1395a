"""Small statistics shared by the benchmark scripts."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by rank: the value below which a share q of the sorted values lies."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
