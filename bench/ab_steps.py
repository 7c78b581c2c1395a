"""Interleaved A/B timing of model steps on a shared machine.

Two (or more) step callables run in turns, A, B, A, B ..., round by round in one process, so load
from other processes falls on both alike; each run reports its wall time and this process's CPU
time (which other processes inflate only through shared caches and memory bandwidth, not through
waiting for a core). A comparison prints the best and the median of each, their ratios, and the
machine's load average before and after, so a reader can tell a quiet run from a loaded one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    """One step: wall-clock ms and this process's CPU ms (all its threads)."""

    wall_ms: float
    cpu_ms: float


Clock = tuple[float, float]


def start() -> Clock:
    return time.perf_counter(), time.process_time()


def since(t0: Clock) -> Sample:
    return Sample((time.perf_counter() - t0[0]) * 1e3, (time.process_time() - t0[1]) * 1e3)


def interleave(
    runs: Sequence[Callable[[], Sample]], rounds: int, warmup: int = 2
) -> list[list[Sample]]:
    """Each run's samples over `rounds` rounds, the runs taking turns within every round, after
    `warmup` untimed rounds (oneDNN primitives, the paged kernel, the allocator)."""
    if not 1 <= rounds <= 10_000:
        raise ValueError(f"rounds: must be in [1, 10000], got {rounds!r}")
    for _ in range(warmup):
        for run in runs:
            run()
    samples: list[list[Sample]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, out in zip(runs, samples):
            out.append(run())
    return samples


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


def figures(samples: list[Sample]) -> tuple[float, float, float]:
    """(best wall, median wall, median CPU) in ms."""
    wall = [s.wall_ms for s in samples]
    return min(wall), statistics.median(wall), statistics.median(s.cpu_ms for s in samples)


def compare(name: str, labels: tuple[str, str], base: list[Sample], other: list[Sample]) -> str:
    """One line: each side's best / median wall ms and median CPU ms, and other / base of each."""
    b, o = figures(base), figures(other)
    ratios = "  ".join(f"{x / y:.2f}x" for x, y in zip(o, b))
    return (
        f"{name:>14}: {labels[0]} {b[0]:7.2f} / {b[1]:7.2f} ms (cpu {b[2]:7.2f})   "
        f"{labels[1]} {o[0]:7.2f} / {o[1]:7.2f} ms (cpu {o[2]:7.2f})   "
        f"{labels[1]} / {labels[0]} best, median, cpu: {ratios}"
    )
