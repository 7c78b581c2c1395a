"""Disaggregation under tensor parallelism, on real Ray (two gloo ranks a side, CPU): a TP=2 prefill
engine and a TP=2 decode engine of a tiny Llama with two KV heads (one per rank) give the text of
the colocated TP=2 engine, greedy and seeded, each rank's KV shard moved through the object store
from the prefill's rank to the decode's; a transfer that fails on one rank only is recomputed on
both (no rank keeps KV the other lacks), with the same text; nothing is left held on any rank.

Different sizes, over torch.distributed (gloo pairs between processes, workers/kv_collective.py):
TP=2 prefill -> TP=1 decode (the one decode rank joins both prefill ranks' heads, every layer) and
TP=1 -> TP=2 (each decode rank cuts its head from the one shard) give the colocated text of the
decode side's size; a sender that never answers costs a bounded wait and a recompute."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from cluster.disagg_transport import ObjectStoreTransport
from cluster.ray_executor import ray_executor
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.disagg import DecodeSide, PrefillSide, decode_request, needs_decode, prefill_request
from scheduler import EngineRequest, SamplingParams
from scheduler.block_manager import hash_prompt_blocks
from scheduler.outputs import RequestOutput
from workers import kv_pairs
from workers.kv_collective import CollectiveTransport
from workers.kv_pairs import CollectiveRef, machine_id
from workers.kv_transfer import TransferHandle

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_LEN = 40  # two full blocks to move, and a partial third
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True),
}


def tiny_config(model_dir: str, tp: int) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=model_dir,
        device="cpu",
        load_progress=False,
        num_gpu_blocks=32,
        max_model_len=128,
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def sides(ray_cluster, tiny_checkpoint):
    """A TP=2 prefill engine (also the colocated reference) sending through the object store,
    and a TP=2 decode engine that takes object-store and collective transfers alike."""
    model_dir, _ = tiny_checkpoint("llama")  # 4 heads over 2 KV heads: one KV head per rank
    config = tiny_config(model_dir, 2)
    # Built side by side: most of an engine's start is waiting for its workers to start and
    # answer, which the two engines' workers can do at once.
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(lambda _: EngineCore(config, ray_executor), range(2)))
    store = ObjectStoreTransport()
    yield PrefillSide(engines[0], store), DecodeSide(engines[1], CollectiveTransport(store))
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def tp1(sides, tiny_checkpoint):
    """Two TP=1 engines in this process: the colocated TP=1 reference (also a TP=1 prefill) and a
    TP=1 decode engine; and the TP=2 prefill engine sending over gloo pairs (no fallback)."""
    model_dir, _ = tiny_checkpoint("llama")
    reference, decode = (EngineCore(tiny_config(model_dir, 1)) for _ in range(2))
    gloo = CollectiveTransport()
    yield (
        PrefillSide(reference, gloo),
        DecodeSide(decode, gloo),
        PrefillSide(sides[0].engine, gloo),
    )
    for engine in (reference, decode):
        engine.shutdown()


def drain(engine: EngineCore, rid: str) -> tuple[list[int], RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    mine = [o for o in outs if o.request_id == rid]
    return [t for o in mine for t in o.new_token_ids], mine[-1]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]


def disaggregated(
    sides, request: EngineRequest, damage=None
) -> tuple[list[int], RequestOutput, TransferHandle]:
    prefill, decode = sides
    prefill.engine.add_request(prefill_request(request))
    first, last = drain(prefill.engine, request.request_id)
    assert needs_decode(request, last, prefill.engine.max_model_len)
    handle = prefill.export(request)
    # one payload per prefill rank
    assert handle is not None and len(handle.parts) == prefill.engine.config.world_size
    if damage is not None:
        damage(handle)
    decode.add(decode_request(request, first), handle)
    rest, last = drain(decode.engine, request.request_id)
    return first + rest, last, handle


def assert_nothing_held(sides) -> None:
    prefill, decode = sides
    for engine in (prefill.engine, decode.engine):
        assert engine.stats().num_free_blocks == engine.num_gpu_blocks
    assert decode.pending == set() and decode.connector.expected == {}
    assert decode.connector.remote == {} and decode.engine.scheduler.loading == {}
    assert set(decode.ranks(lambda runner: len(runner.kv_receiver.handles))) == {0}
    # No outbox (of this process or of any rank) holds a payload
    assert outbox_bytes() == 0 and set(prefill.ranks(lambda runner: outbox_bytes())) == {0}


def outbox_bytes() -> int:
    return sum(server.held_bytes() for server in kv_pairs._servers.values())


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_tp2_prefill_then_tp2_decode_gives_the_colocated_tp2_text(
    sides, sampling, smollm2_tokenizer
):
    prefill, decode = sides
    params = SAMPLINGS[sampling]
    tokens = prompt(sum(map(ord, sampling)))
    prefill.engine.add_request(EngineRequest(f"colocated-{sampling}", tokens, params))
    expected, _ = drain(prefill.engine, f"colocated-{sampling}")
    loaded = decode.connector.num_remote_loaded
    got, last, _ = disaggregated(sides, EngineRequest(f"disagg-{sampling}", tokens, params))
    assert smollm2_tokenizer.decode(got) == smollm2_tokenizer.decode(expected)
    assert got == expected and len(got) == params.max_tokens
    # Both full blocks arrived on both ranks: the decode engine computed from the last prompt
    # token on.
    assert last.num_cached_tokens == 2 * BLOCK
    assert decode.connector.num_remote_loaded - loaded == 2
    assert decode.received()[0] > 0
    assert_nothing_held(sides)


def rank1_lost(handle: TransferHandle) -> None:
    handle.shards[1].ref.clear()  # rank 1's fetch fails; rank 0's succeeds


def ranks_swapped(handle: TransferHandle) -> None:
    handle.shards.reverse()  # each rank gets the other's heads: both fail the rank check


@pytest.mark.parametrize("damage", [rank1_lost, ranks_swapped], ids=lambda f: f.__name__)
def test_a_transfer_failed_on_any_rank_is_recomputed_on_all_with_the_same_text(sides, damage):
    prefill, decode = sides
    params = SAMPLINGS["seeded"]
    tokens = prompt(sum(map(ord, damage.__name__)))
    prefill.engine.add_request(EngineRequest(f"colocated-{damage.__name__}", tokens, params))
    expected, _ = drain(prefill.engine, f"colocated-{damage.__name__}")
    failed = decode.connector.num_remote_failed
    request = EngineRequest(f"disagg-{damage.__name__}", tokens, params)
    got, last, _ = disaggregated(sides, request, damage)
    assert got == expected
    assert last.num_cached_tokens == 0  # rank 0's blocks were not kept without rank 1's
    assert decode.connector.num_remote_failed - failed == 2
    assert_nothing_held(sides)


def colocated_text(engine: EngineCore, tokens: list[int], params: SamplingParams, rid: str):
    engine.add_request(EngineRequest(rid, tokens, params))
    return drain(engine, rid)[0]


def over_gloo(handle: TransferHandle) -> None:
    """Every prefill rank's part waits in its outbox for a pull (no object-store copy)."""
    assert all(len(p.ref) == 1 and isinstance(p.ref[0], CollectiveRef) for p in handle.parts)


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_tp2_prefill_then_tp1_decode_over_gloo_gives_the_colocated_tp1_text(tp1, sampling):
    reference, decode, tp2_prefill = tp1
    params, tokens = SAMPLINGS[sampling], prompt(7 + sum(map(ord, sampling)))
    expected = colocated_text(reference.engine, tokens, params, f"tp1-{sampling}")
    loaded = decode.connector.num_remote_loaded
    request = EngineRequest(f"tp2-to-tp1-{sampling}", tokens, params)
    got, last, _ = disaggregated((tp2_prefill, decode), request, over_gloo)
    assert got == expected and len(got) == params.max_tokens
    # Both full blocks landed whole: the one decode rank joined the two ranks' heads per layer.
    assert last.num_cached_tokens == 2 * BLOCK
    assert decode.connector.num_remote_loaded - loaded == 2
    assert_nothing_held((tp2_prefill, decode))


def test_tp1_prefill_then_tp2_decode_over_gloo_gives_the_colocated_tp2_text(sides, tp1):
    reference, _, _ = tp1
    tp2, decode = sides
    params, tokens = SAMPLINGS["seeded"], prompt(1234)
    expected = colocated_text(tp2.engine, tokens, params, "tp2-colocated")
    loaded = decode.connector.num_remote_loaded
    request = EngineRequest("tp1-to-tp2", tokens, params)
    got, last, handle = disaggregated((reference, decode), request, over_gloo)
    assert handle.shards == []  # one shard, pulled by both decode ranks
    assert got == expected
    assert last.num_cached_tokens == 2 * BLOCK  # each rank cut its KV head from the one shard
    assert decode.connector.num_remote_loaded - loaded == 2
    assert_nothing_held((reference, decode))


def test_a_sender_that_never_answers_costs_a_bounded_wait_and_a_recompute(tp1):
    """The handle names a store where nobody serves pulls: forming the pair times out, the
    blocks are recomputed, the text is the colocated one and nothing is held."""
    reference, decode, _ = tp1
    params, tokens = SAMPLINGS["greedy"], prompt(99)
    expected = colocated_text(reference.engine, tokens, params, "silent-colocated")
    request = EngineRequest("silent", tokens, params)
    reference.engine.add_request(prefill_request(request))
    first, _ = drain(reference.engine, "silent")
    silent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key = "5" * 32
    ref = CollectiveRef("127.0.0.1", silent.port, machine_id(), "gloo", key, 1 << 20, "{}")
    handle = TransferHandle(key, hash_prompt_blocks(tokens, BLOCK), [ref])
    assert decode.receiver is not None
    decode.receiver.timeout_s, failed = 1.0, decode.connector.num_remote_failed
    try:
        decode.add(decode_request(request, first), handle)
        rest, last = drain(decode.engine, "silent")
    finally:
        decode.receiver.timeout_s = 10.0
    assert first + rest == expected
    assert last.num_cached_tokens == 0 and decode.connector.num_remote_failed - failed == 2
    assert_nothing_held((reference, decode))
