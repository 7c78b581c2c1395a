"""A replica's side of peer pulls (cluster/kv_pull.py `ReplicaPulls.start`): a pull that names the
replica itself, one the cost model declines, one out of bounds after unpickling and one whose peer
cannot be asked (here: no Serve deployment to ask through) all leave the request to compute its
prompt: no transfer is expected for it and nothing is held.

Two requests for the same forked context on one replica ask its peer once (cluster/pull_asks.py):
the second waits for the first's blocks and finds them as a prefix hit, or computes when the ask
fails; the tokens are the peer's either way. A wait cancelled, or a first request cancelled while
it asks, leaves nothing held. The peer here is a second engine in this process, asked directly
instead of through a Serve handle."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from cluster.kv_pull import ReplicaPulls
from cluster.pull_asks import AsksInFlight
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.peer_pull import PeerSource
from router.config import RoutingConfig
from router.peer_pull import PeerPull, PullCommand
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from workers.kv_transfer import InProcessTransport, TransferHandle

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


# ---- two requests for one forked context: one ask --------------------------------------------

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
CONTEXT_BLOCKS = 4
PAYS = RoutingConfig(peer_pulls=True, prefill_tokens_per_s=1e-3)  # any pull pays


@pytest.fixture(scope="module")
def transport():
    return InProcessTransport()


@pytest.fixture(scope="module")
def peer(tiny_model_dir, transport):
    """Engine A, the peer: it holds the contexts the tests pull."""
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=tiny_model_dir, device="cpu", load_progress=False, num_gpu_blocks=48
        )
    )
    yield PeerSource(core, transport)
    core.shutdown()


class Peer:
    """How the replica asks A: each ask recorded, answered once `gate` opens (A's export, or
    None as a peer that evicted the blocks answers)."""

    def __init__(self, source: PeerSource, answers: bool = True) -> None:
        self.source = source
        self.answers = answers
        self.asked: list[PeerPull] = []
        self.gate = asyncio.Event()

    async def __call__(self, command: PullCommand) -> TransferHandle | None:
        self.asked.append(command.pull)
        await self.gate.wait()
        if not self.answers:
            return None
        return self.source.export(command.pull.hashes, command.pull.first)


def drain(engine) -> dict[str, tuple[list[int], int]]:
    """Each request's (tokens, prefix-cache hit in tokens), run to the end."""
    got: dict[str, tuple[list[int], int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _ = got.get(out.request_id, ([], 0))
            got[out.request_id] = (tokens + out.new_token_ids, out.num_cached_tokens)
    return got


def forked(peer: PeerSource, seed: int) -> tuple[list[EngineRequest], PeerPull, dict]:
    """Two forks of a context A holds, the pull of that context, and A's tokens for each."""
    rng = random.Random(seed)
    context = [rng.randrange(3, 2000) for _ in range(CONTEXT_BLOCKS * BLOCK)]
    reqs = [
        EngineRequest(f"s{seed}-{i}", context + [rng.randrange(3, 2000) for _ in range(10)], GREEDY)
        for i in range(3)
    ]
    drain_one = drain  # A runs each alone: its tokens are what B must give
    peer.engine.add_request(reqs[0])  # A computes the context
    drain_one(peer.engine)
    expected = {}
    for r in reqs[1:]:
        peer.engine.add_request(r)
        expected[r.request_id] = drain_one(peer.engine)[r.request_id][0]
    hashes = hash_prompt_blocks(reqs[1].prompt_token_ids, BLOCK)[:CONTEXT_BLOCKS]
    return reqs[1:], PeerPull("a", tuple(hashes)), expected


async def both(pulls: ReplicaPulls, ask: Peer, reqs: list[EngineRequest], pull: PeerPull):
    """Start both requests' pulls, the second while the first's ask is in flight."""
    first = asyncio.create_task(pulls.start(reqs[0], pull))
    await asyncio.sleep(0)  # the first has asked
    second = asyncio.create_task(pulls.start(reqs[1], pull))
    await asyncio.sleep(0)  # the second waits
    ask.gate.set()
    return [await first, await second]


def assert_nothing_held(pulls: ReplicaPulls) -> None:
    engine = pulls.engine
    assert engine.held == {} and engine.joins == {} and engine.phase.handoffs == {}
    assert pulls.pulls.sink.pending == set() and pulls.pulls.sink.connector.expected == {}
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("answers", [True, False], ids=["pulled", "peer-evicted"])
def test_two_forks_on_one_replica_ask_the_peer_once_and_get_the_peers_tokens(
    engine, peer, transport, answers
):
    ask = Peer(peer, answers)
    pulls = ReplicaPulls(engine, "b", PAYS, transport, ask)
    reqs, pull, expected = forked(peer, 11 if answers else 12)
    started = asyncio.run(both(pulls, ask, reqs, pull))
    assert started == [answers, answers] and ask.asked == [pull]  # one ask, not two
    for r in reqs:  # added in the order their starts returned, as the replica adds them
        pulls.engine.add_request(r)
    got = drain(pulls.engine)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == expected
    hit = CONTEXT_BLOCKS * BLOCK if answers else 0
    assert [got[r.request_id][1] for r in reqs] == [hit, hit]
    assert pulls.counts.joined == int(answers) and pulls.counts.pulled == int(answers)
    assert pulls.counts.failed == (0 if answers else 2)
    assert pulls.pulls.sink.connector.num_remote_loaded == (CONTEXT_BLOCKS if answers else 0)
    assert len(pulls.asks) == int(answers)  # a failed ask is forgotten at once
    assert_nothing_held(pulls)


def test_a_cancelled_wait_or_a_cancelled_first_ask_leaves_nothing_held(engine, peer, transport):
    ask = Peer(peer)
    pulls = ReplicaPulls(engine, "b", PAYS, transport, ask)
    (first, second), pull, expected = forked(peer, 13)

    async def cancel(victim: int) -> list[object]:
        ask.gate = asyncio.Event()  # of this run's event loop
        tasks = [asyncio.create_task(pulls.start(r, pull)) for r in (first, second)]
        await asyncio.sleep(0)
        tasks[victim].cancel()  # its client went away while it waited
        await asyncio.sleep(0)
        ask.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    # The waiting second request is cancelled: the first goes on, alone.
    results = asyncio.run(cancel(1))
    assert results[0] is True and isinstance(results[1], asyncio.CancelledError)
    pulls.engine.add_request(first)
    assert drain(pulls.engine)[first.request_id][0] == expected[first.request_id]
    assert pulls.counts.joined == 0
    assert_nothing_held(pulls)
    # The first request is cancelled while it asks: the second computes, the ask is forgotten.
    pulls.asks.close(first.request_id)  # answered: later requests would join it, not ask
    results = asyncio.run(cancel(0))
    assert isinstance(results[0], asyncio.CancelledError) and results[1] is False
    assert len(pulls.asks) == 0 and pulls.counts.joined == 0
    pulls.engine.add_request(second)
    assert drain(pulls.engine)[second.request_id][0] == expected[second.request_id]
    assert_nothing_held(pulls)


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 1 << 40, 0, "8"])
def test_the_asks_table_bound_is_checked(bad):
    with pytest.raises(ValueError, match="max_blocks"):
        AsksInFlight(1.0, max_blocks=bad)


def test_the_asks_table_forgets_its_oldest_asks_past_its_bound():
    async def fill() -> AsksInFlight:
        asks = AsksInFlight(1.0, max_blocks=6)
        first = asks.open("r1", PeerPull("a", (1, 2, 3, 4)))
        asks.open("r2", PeerPull("a", (5, 6, 7, 8)))  # 8 blocks > 6: r1 is forgotten
        assert first.answer.done() and first.answer.result() is None  # its waiters compute
        return asks

    asks = asyncio.run(fill())
    assert len(asks) == 1 and asks.num_blocks == 4
    assert asks.find(PeerPull("a", (1, 2, 3, 4))) is None
    assert asks.find(PeerPull("a", (5, 6, 7, 8))) is not None
    assert asks.find(PeerPull("a", (5, 6, 7, 8, 9))) is None  # moves a block r2 does not
