"""A request's last output carries its replica's newest KV events, taken on the engine's thread
right after the step that finished it (cluster/kv_event_pub.py `TailingEngine`): nothing waits
for the engine, and a router fed by these tails alone holds exactly what the pool holds after
each request, so it predicts the next request's hit."""

from __future__ import annotations

import random

import pytest

from cluster.kv_event_pub import TailingEngine, attach_kv_events
from engine.config import EngineConfig
from engine.core import EngineCore
from router.kv_events import KVIndex
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from scheduler.kv_events import DEVICE
from scheduler.outputs import RequestOutput

BLOCK = 16
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tailing(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    config = EngineConfig.from_kwargs(
        model=path, device="cpu", load_progress=False, block_size=BLOCK, num_gpu_blocks=24
    )
    core = EngineCore(config)
    log = attach_kv_events(core)
    yield TailingEngine(core, log, "r0"), log
    core.shutdown()


def drain(engine: TailingEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_tails_alone_keep_the_index_exact_and_predict_each_hit(tailing):
    engine, log = tailing
    index = KVIndex()
    index.apply("r0", log.report())  # the first report's snapshot: in sync from here
    rng = random.Random(3)
    contexts = [[rng.randrange(10, 200) for _ in range(3 * BLOCK)] for _ in range(4)]
    for i in range(6):  # 4 contexts of 3 blocks + tails, a pool of 24: every few evict
        prompt = rng.choice(contexts) + [
            rng.randrange(10, 200) for _ in range(rng.randrange(1, 30))
        ]
        hashes = hash_prompt_blocks(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
        predicted = index.match(hashes, ["r0"])["r0"].device
        engine.add_request(EngineRequest(f"t{i}", prompt, PARAMS))
        outs = drain(engine)
        last = outs[-1]
        assert last.finished and last.finish_reason == "length"
        assert all(o.kv_events is None for o in outs[:-1])  # only the last output carries them
        assert last.kv_events is not None and last.kv_events.seq == log.seq
        assert predicted * BLOCK == last.num_cached_tokens, f"request {i}"
        assert index.apply_tail(last.kv_events)
        held = {h for h, bits in index.holdings("r0").items() if bits & DEVICE}
        assert held == set(engine.scheduler.kv.pool.cached), f"after request {i}"


def test_requests_finishing_in_one_step_share_its_tail_and_an_abort_carries_none(tailing):
    engine, _ = tailing
    rng = random.Random(5)
    for i in range(2):
        engine.add_request(
            EngineRequest(f"pair{i}", [rng.randrange(10, 200) for _ in range(20)], PARAMS)
        )
    engine.add_request(EngineRequest("gone", [rng.randrange(10, 200) for _ in range(20)], PARAMS))
    engine.step()
    aborted = engine.abort_requests(["gone"])
    assert [o.kv_events for o in aborted] == [None]
    finished = [o for o in drain(engine) if o.finished]
    assert sorted(o.request_id for o in finished) == ["pair0", "pair1"]
    assert finished[0].kv_events is finished[1].kv_events is not None
