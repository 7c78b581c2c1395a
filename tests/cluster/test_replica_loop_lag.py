"""LoopLag (cluster/loop_lag.py): a replica's event-loop lag over its first 60 s and its last 60 s,
as stats() reports it."""

import asyncio
import time

from cluster.loop_lag import MAX_SAMPLES, PERIOD_S, WINDOW_S, LagSummary, LoopLag


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_summary_is_the_max_and_the_99th_percentile_in_ms():
    lags = [i / 1000 for i in range(1, 201)]  # 1 .. 200 ms
    assert LagSummary.of(lags) == LagSummary(200, 200.0, 198.0)
    assert LagSummary.of([0.25]) == LagSummary(1, 250.0, 250.0)
    assert LagSummary.of([]) == LagSummary(0, 0.0, 0.0)


def test_the_first_minute_is_kept_and_the_last_minute_slides():
    clock = Clock()
    lag = LoopLag(clock)
    clock.now += 1.0
    lag.add(clock.now, 0.5)  # a long block in the first minute
    for _ in range(3):
        clock.now += 0.6 * WINDOW_S  # at 37, 73 and 109 s of its life
        lag.add(clock.now, 0.002)
    report = lag.report()
    assert report["first_60s"] == {"samples": 2, "max_ms": 500.0, "p99_ms": 500.0}
    assert report["last_60s"] == {"samples": 2, "max_ms": 2.0, "p99_ms": 2.0}


def test_a_window_holds_at_most_one_sample_per_period():
    clock = Clock()
    lag = LoopLag(clock)
    for _ in range(MAX_SAMPLES + 500):
        clock.now += PERIOD_S / 2  # faster than the sampler can run: the oldest go
        lag.add(clock.now, 0.001)
    assert lag.report()["last_60s"]["samples"] == MAX_SAMPLES


def test_a_callback_that_blocks_the_loop_shows_as_lag():
    async def go() -> dict:
        lag = LoopLag()
        task = lag.start()
        await asyncio.sleep(3 * PERIOD_S)
        time.sleep(0.15)  # what a blocking call on the replica's loop does
        await asyncio.sleep(3 * PERIOD_S)
        task.cancel()
        return lag.report()

    first = asyncio.run(go())["first_60s"]
    assert first["samples"] >= 2
    # The sampler slept PERIOD_S and woke at least 0.15 s after it started sleeping.
    assert first["max_ms"] >= 1000 * (0.15 - PERIOD_S)
