"""Disaggregation under tensor parallelism, on real Ray (two gloo ranks a side, CPU): a TP=2 prefill
engine and a TP=2 decode engine of a tiny Llama with two KV heads (one per rank) give the text of
the colocated TP=2 engine, greedy and seeded, each rank's KV shard moved through the object store
from the prefill's rank to the decode's; a transfer that fails on one rank only is recomputed on
both (no rank keeps KV the other lacks), with the same text; nothing is left held on any rank."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.disagg_transport import ObjectStoreTransport
from cluster.ray_executor import ray_executor
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.disagg import DecodeSide, PrefillSide, decode_request, needs_decode, prefill_request
from scheduler import EngineRequest, SamplingParams
from scheduler.outputs import RequestOutput
from workers.kv_transfer import TransferHandle

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_LEN = 40  # two full blocks to move, and a partial third
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True),
}


@pytest.fixture(scope="module")
def sides(ray_cluster, tiny_checkpoint):
    """A TP=2 prefill engine (also the colocated reference) and a TP=2 decode engine."""
    model_dir, _ = tiny_checkpoint("llama")  # 4 heads over 2 KV heads: one KV head per rank
    config = EngineConfig.from_kwargs(
        model=model_dir,
        device="cpu",
        load_progress=False,
        num_gpu_blocks=32,
        max_model_len=128,
        tensor_parallel_size=2,
    )
    # Built side by side: most of an engine's start is waiting for its workers to start and
    # answer, which the two engines' workers can do at once.
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(lambda _: EngineCore(config, ray_executor), range(2)))
    transport = ObjectStoreTransport()
    yield PrefillSide(engines[0], transport), DecodeSide(engines[1], transport)
    for engine in engines:
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
    assert handle is not None and len(handle.shards) == 2  # one payload per rank
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
    assert decode.ranks(lambda runner: len(runner.kv_receiver.handles)) == [0, 0]


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
