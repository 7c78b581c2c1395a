"""with_deadline: a generation's deltas until its deadline, then the generation is cancelled."""

import asyncio
import time

import pytest

from deploy.errors import RequestTimeoutError
from deploy.generation import with_deadline


def test_every_delta_passes_before_the_deadline():
    async def deltas():
        for i in range(5):
            await asyncio.sleep(0)
            yield i

    async def go():
        return [d async for d in with_deadline(deltas(), time.monotonic() + 60)]

    assert asyncio.run(go()) == [0, 1, 2, 3, 4]


def test_a_stalled_generation_times_out_and_is_cancelled():
    """The first delta passes; the generation then waits forever: the deadline raises
    RequestTimeoutError and the generation sees its cancellation (its finally runs, where
    Choice cancels the replica's stream)."""
    seen: list[str] = []

    async def deltas():
        try:
            yield "first"
            await asyncio.Event().wait()
            yield "never"
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def go():
        got = []
        with pytest.raises(RequestTimeoutError, match="request_timeout_s"):
            async for d in with_deadline(deltas(), time.monotonic() + 0.05):
                got.append(d)
        return got

    assert asyncio.run(go()) == ["first"]
    assert seen == ["cancelled"]
