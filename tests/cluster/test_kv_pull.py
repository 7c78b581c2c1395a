"""A replica's side of peer pulls (cluster/kv_pull.py `ReplicaPulls.start`): a pull that names the
replica itself, one the cost model declines, one out of bounds after unpickling and one whose peer
cannot be asked (here: no Serve deployment to ask through) all leave the request to compute its
prompt: no transfer is expected for it and nothing is held."""

from __future__ import annotations

import asyncio

import pytest

from cluster.kv_pull import ReplicaPulls
from engine.config import EngineConfig
from engine.core import EngineCore
from router.config import RoutingConfig
from router.peer_pull import PeerPull
from scheduler import EngineRequest, SamplingParams

BLOCK = 16
CONTEXT = tuple(range(1000, 1008))  # 8 block hashes


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=tiny_model_dir, device="cpu", load_progress=False, num_gpu_blocks=16
        )
    )
    yield core
    core.shutdown()


def request() -> EngineRequest:
    return EngineRequest("q", list(range(10, 10 + 8 * BLOCK + 3)), SamplingParams(max_tokens=2))


def test_every_pull_that_cannot_or_should_not_go_ahead_leaves_the_prompt_to_compute(engine):
    # A prefill rate so slow that any pull pays, then one so fast that none does.
    pays = ReplicaPulls(engine, "me", RoutingConfig(peer_pulls=True, prefill_tokens_per_s=1e-3))
    bad = PeerPull("peer", CONTEXT)
    object.__setattr__(bad, "first", 2**64)  # as an unpickled pull may hold it
    cases = [PeerPull("me", CONTEXT), bad, PeerPull("peer", CONTEXT)]
    assert [asyncio.run(pays.start(request(), pull)) for pull in cases] == [False] * 3
    # The last one was worth it, but there is no Serve deployment to ask the peer through.
    assert pays.counts.failed == 1 and pays.counts.pulled == 0
    declines = ReplicaPulls(engine, "me", RoutingConfig(peer_pulls=True, prefill_tokens_per_s=1e9))
    assert not asyncio.run(declines.start(request(), PeerPull("peer", CONTEXT)))
    assert declines.counts.declined == 1 and declines.counts.failed == 0
    for pulls in (pays, declines):
        assert pulls.engine.handoffs == {} and pulls.pulls.sink.pending == set()
        assert pulls.pulls.sink.connector.expected == {}
