"""Peer-to-peer prefix pulls between two engines in one process (engine/peer_pull.py): engine A
holds a context, engine B pulls the blocks of it that A still holds instead of computing them.
B's tokens equal A's, the pulled blocks count as B's prefix hits, and a pull that finds the blocks
evicted, or whose transfer is lost or damaged, is computed with the same tokens; no block,
transfer or expectation is left held on either side. A request on B that joined another's pull
is held until that pull lands (a prefix hit, one copy loaded) or fails or is aborted (computed):
the same tokens either way, and an aborted wait leaves nothing held."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.peer_pull import PeerPulls, PeerSource
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from scheduler.outputs import RequestOutput
from workers.kv_transfer import InProcessTransport, TransferHandle

BLOCK = 16
CONTEXT_BLOCKS = 4
POOL = dict(device="cpu", load_progress=False, num_gpu_blocks=48, max_model_len=256)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def peers(tiny_model_dir):
    """(source A, pulls of B, transport)."""
    a, b = (EngineCore(EngineConfig.from_kwargs(model=tiny_model_dir, **POOL)) for _ in range(2))
    transport = InProcessTransport()
    yield PeerSource(a, transport), PeerPulls(b, transport, timeout_s=1.0), transport
    a.shutdown()
    b.shutdown()


def drain(engine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def run(engine, request: EngineRequest) -> tuple[list[int], int]:
    """(tokens, prefix-cache hit in tokens) of the request run to its end."""
    engine.add_request(request)
    return finish(engine, request.request_id)


def finish(engine, rid: str) -> tuple[list[int], int]:
    """(tokens, prefix-cache hit in tokens) of request rid, added already, run to its end."""
    outs = [o for o in drain(engine) if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


def forks(seed: int, n: int) -> list[EngineRequest]:
    """n prompts forking one context of CONTEXT_BLOCKS blocks, each with its own question."""
    rng = random.Random(seed)
    context = [rng.randrange(3, 2000) for _ in range(CONTEXT_BLOCKS * BLOCK)]
    prompts = [context + [rng.randrange(3, 2000) for _ in range(10)] for _ in range(n)]
    return [EngineRequest(f"s{seed}-f{i}", p, GREEDY) for i, p in enumerate(prompts)]


def pulled(peers, request: EngineRequest, first: int = 0, damage=None) -> tuple[list[int], int]:
    """Run request on B, pulling from A the blocks of its prompt A holds past `first`."""
    source, pulls, transport = peers
    hashes = hash_prompt_blocks(request.prompt_token_ids, BLOCK)
    handle = source.export(hashes, first)
    if damage is not None and handle is not None:
        damage(transport, handle)
    pulls.sink.add(request, handle)
    return finish(pulls.sink.engine, request.request_id)


def assert_nothing_held(peers) -> None:
    source, pulls, transport = peers
    for engine in (source.engine, pulls.sink.engine):
        assert not engine.has_unfinished_requests()
        assert engine.stats().num_free_blocks == engine.num_gpu_blocks
    connector = pulls.sink.connector
    assert transport.payloads == {} and pulls.sink.receiver.handles == {}
    assert connector.expected == {} and connector.remote == {} and connector.plans == {}
    assert pulls.sink.engine.scheduler.loading == {}


def test_a_pull_gives_the_tokens_the_peer_computes_and_counts_as_prefix_hits(peers):
    source, pulls, _ = peers
    first, fork = forks(1, 2)
    run(source.engine, first)  # A computes the context
    expected, a_hit = run(source.engine, fork)
    assert a_hit == CONTEXT_BLOCKS * BLOCK
    loaded = pulls.sink.connector.num_remote_loaded
    got, b_hit = pulled(peers, fork)
    assert got == expected
    # A holds the context and the fork's prompt blocks: every full block arrived, none computed.
    assert b_hit == (len(fork.prompt_token_ids) // BLOCK) * BLOCK
    assert pulls.sink.connector.num_remote_loaded - loaded == b_hit // BLOCK
    assert_nothing_held(peers)


def test_blocks_the_puller_holds_already_are_not_sent(peers):
    source, pulls, _ = peers
    first, fork = forks(2, 2)
    run(source.engine, first)
    expected, _ = run(source.engine, fork)
    # B computes the context's first two blocks' worth with a short prompt of its own.
    run(pulls.sink.engine, EngineRequest("b-own", first.prompt_token_ids[: 2 * BLOCK + 1], GREEDY))
    sent = source.num_blocks_sent
    got, b_hit = pulled(peers, fork, first=2)
    assert got == expected and b_hit == (len(fork.prompt_token_ids) // BLOCK) * BLOCK
    assert source.num_blocks_sent - sent == len(fork.prompt_token_ids) // BLOCK - 2
    assert_nothing_held(peers)


def test_evicted_meanwhile_on_either_side_the_prompt_is_computed(peers):
    source = peers[0]
    (fork,) = forks(3, 1)  # A never computed this context: nothing to send
    hashes = hash_prompt_blocks(fork.prompt_token_ids, BLOCK)
    assert source.export(hashes, 0) is None
    expected, _ = run(source.engine, fork)
    assert source.export(hashes, len(hashes)) is None  # nothing held past `first`
    # B was thought to hold the first 3 blocks but does not (evicted since): the block sent after
    # them cannot be used past the gap, and the prompt is computed.
    sent = source.num_blocks_sent
    again = EngineRequest("s3-again", fork.prompt_token_ids, GREEDY)
    got, b_hit = pulled(peers, again, first=3)
    assert source.num_blocks_sent - sent == len(hashes) - 3
    assert got == expected and b_hit == 0
    assert_nothing_held(peers)


def lose(transport: InProcessTransport, handle) -> None:
    transport.payloads.pop(handle.key)


def corrupt(transport: InProcessTransport, handle) -> None:
    transport.payloads[handle.key].data[0, 5] ^= 0xFF  # the first block fails its CRC


@pytest.mark.parametrize("damage", [lose, corrupt], ids=["lost", "corrupt"])
def test_a_failed_pull_is_computed_with_the_same_tokens(peers, damage):
    _, pulls, _ = peers
    seed = 4 if damage is lose else 5
    first, fork = forks(seed, 2)
    run(peers[0].engine, first)
    expected, _ = run(peers[0].engine, fork)
    failed = pulls.sink.connector.num_remote_failed
    got, b_hit = pulled(peers, fork, damage=damage)
    assert got == expected and b_hit == 0
    assert pulls.sink.connector.num_remote_failed > failed
    assert_nothing_held(peers)


# ---- joins: a request whose blocks another request on the replica is pulling waits for them ----


def joined_pair(peers, seed: int, damage=None):
    """(lead, joined, their tokens on A): two forks of one context A holds, both on B, the lead
    pulling the context from A (its transfer damaged if asked) and the joined one held behind it."""
    source, pulls, transport = peers
    first, lead, joined = forks(seed, 3)
    run(source.engine, first)  # A holds the context (and first's own blocks)
    expected = {r.request_id: run(source.engine, r)[0] for r in (lead, joined)}
    context = hash_prompt_blocks(lead.prompt_token_ids, BLOCK)[:CONTEXT_BLOCKS]
    handle = source.export(context, 0)
    assert handle is not None
    if damage is not None:
        damage(transport, handle)
    engine = pulls.engine
    engine.phase.handoffs[lead.request_id] = handle  # as ReplicaPulls.start names them
    engine.joins[joined.request_id] = lead.request_id
    engine.add_request(lead)
    engine.add_request(joined)
    assert set(engine.held) == {joined.request_id}  # outside the scheduler until the lead lands
    assert joined.request_id not in pulls.sink.engine.scheduler.requests
    return lead, joined, expected


def finish_all(engine) -> dict[str, tuple[list[int], int]]:
    """Each request's (tokens, prefix-cache hit in tokens), run to the end."""
    got: dict[str, tuple[list[int], int]] = {}
    for out in drain(engine):
        tokens, _ = got.get(out.request_id, ([], 0))
        got[out.request_id] = (tokens + out.new_token_ids, out.num_cached_tokens)
    return got


def assert_no_join_held(peers) -> None:
    engine = peers[1].engine
    assert engine.held == {} and engine.joins == {} and engine.phase.handoffs == {}
    assert_nothing_held(peers)


def test_a_joined_request_loads_nothing_and_finds_the_leads_blocks_as_a_prefix_hit(peers):
    pulls = peers[1]
    loaded, held = pulls.sink.connector.num_remote_loaded, pulls.engine.num_held
    lead, joined, expected = joined_pair(peers, 6)
    got = finish_all(pulls.engine)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == expected
    # The context crossed once, for the lead; the joined fork found it on the device.
    assert pulls.sink.connector.num_remote_loaded - loaded == CONTEXT_BLOCKS
    assert got[lead.request_id][1] == got[joined.request_id][1] == CONTEXT_BLOCKS * BLOCK
    assert pulls.engine.num_held - held == 1
    assert_no_join_held(peers)


def test_the_leads_pull_failing_makes_the_joined_request_compute_the_same_tokens(peers):
    pulls = peers[1]
    failed = pulls.sink.connector.num_remote_failed
    lead, joined, expected = joined_pair(peers, 7, damage=lose)
    got = finish_all(pulls.engine)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == expected
    assert pulls.sink.connector.num_remote_failed - failed == CONTEXT_BLOCKS
    # Let go when the lead landed with nothing, both compute the context in the same step.
    assert got[lead.request_id][1] == got[joined.request_id][1] == 0
    assert_no_join_held(peers)


def test_an_aborted_lead_lets_the_joined_request_compute_and_an_aborted_wait_leaks_nothing(peers):
    pulls = peers[1]
    engine = pulls.engine
    lead, joined, expected = joined_pair(peers, 8)
    outs = engine.abort_requests([lead.request_id])  # the lead's client went away
    assert [(o.request_id, o.finish_reason) for o in outs] == [(lead.request_id, "abort")]
    assert engine.held == {}  # the joined request was let go at once: it computes
    got = finish_all(engine)
    assert got[joined.request_id][0] == expected[joined.request_id]
    assert_no_join_held(peers)
    # The joined request's own client goes away while it waits: it is dropped from the hold.
    lead, joined, expected = joined_pair(peers, 9)
    outs = engine.abort_requests([joined.request_id])
    assert [(o.request_id, o.finish_reason) for o in outs] == [(joined.request_id, "abort")]
    got = finish_all(engine)
    assert set(got) == {lead.request_id} and got[lead.request_id][0] == expected[lead.request_id]
    assert_no_join_held(peers)


def test_a_hold_past_the_pull_timeout_lets_the_joined_request_compute(peers):
    source, pulls, _ = peers
    engine = pulls.engine
    (fork,) = forks(10, 1)
    expected, _ = run(source.engine, fork)
    # Its lead named a transfer it has not added yet (still in the replica's hands).
    engine.phase.handoffs["lead"] = TransferHandle("k", [1])
    engine.joins[fork.request_id] = "lead"
    engine.add_request(fork)
    assert set(engine.held) == {fork.request_id}
    clock = engine.clock
    engine.clock = lambda: clock() + engine.timeout_s  # the hold's deadline has come
    try:
        got = finish_all(engine)
    finally:
        engine.clock = clock
        engine.phase.handoffs.pop("lead")
    assert got[fork.request_id] == (expected, 0)
    assert_no_join_held(peers)
