"""LoopLag: how late a replica's event loop wakes a 50 ms timer, over its first minute and its last.

Serve's routers skip a replica that does not answer a queue-length probe within 0.1 s
(RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S). The probe runs on a thread of Serve's own, so it
waits only for the GIL; the replica's streams, aborts and stats calls wait for its event loop.
A callback that runs long on the loop, or a thread that holds the GIL, shows here as lag.
Serve's own histogram (ray_serve_event_loop_scheduling_latency_ms) has fixed buckets; this keeps
the samples, so stats() can say the max and p99 of a replica's first 60 s and of its last 60 s
(bench/replica_loop_lag.py reads them).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

# 50 ms: fine enough to see a loop held past the 0.1 s probe, at a fifth of a 10 ms timer's wakeups
# (every replica runs it for its whole life).
PERIOD_S = 0.05
WINDOW_S = 60.0
# Samples in one window (a blocked loop takes fewer): bounds the memory and the cost of a report.
MAX_SAMPLES = int(WINDOW_S / PERIOD_S)


@dataclass(slots=True, frozen=True)
class LagSummary:
    """Lag over a window: samples taken, and the max and 99th percentile, in milliseconds."""

    samples: int
    max_ms: float
    p99_ms: float

    @classmethod
    def of(cls, lags: list[float]) -> LagSummary:
        if not lags:
            return cls(0, 0.0, 0.0)
        ranked = sorted(lags)
        p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
        return cls(len(ranked), 1000 * ranked[-1], 1000 * p99)


class LoopLag:
    """Samples the running loop's lag every PERIOD_S from start() on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self._first: list[float] = []  # the lags of the first WINDOW_S
        self._recent: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, lag)

    def start(self) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._run(), name="raylm-loop-lag")

    async def _run(self) -> None:
        while True:
            before = self._clock()
            await asyncio.sleep(PERIOD_S)
            now = self._clock()
            self.add(now, max(0.0, now - before - PERIOD_S))

    def add(self, now: float, lag: float) -> None:
        if now - self.started <= WINDOW_S:
            self._first.append(lag)
        self._recent.append((now, lag))

    def report(self) -> dict[str, dict[str, float]]:
        """The first WINDOW_S of the loop's life (final once it is past) and the last WINDOW_S."""
        since = self._clock() - WINDOW_S
        recent = [lag for at, lag in self._recent if at >= since]
        return {
            "first_60s": asdict(LagSummary.of(self._first)),
            "last_60s": asdict(LagSummary.of(recent)),
        }
