"""A real engine's KV events (cluster/kv_event_pub.py) keep the router's exact index equal to what
its device pool and its CPU and disk tiers hold, through eviction churn, and the hit the router
predicts is the hit the engine counts."""

from __future__ import annotations

import random

import pytest

from cluster.kv_event_pub import attach_kv_events
from engine.config import EngineConfig
from engine.core import EngineCore
from router.config import RoutingConfig
from router.fleet import FleetState
from router.stats import RoutingStats
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from scheduler.kv_events import CPU, DEVICE, DISK

BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    path, _ = tiny_checkpoint("llama")
    config = EngineConfig.from_kwargs(
        model=path,
        device="cpu",
        load_progress=False,
        block_size=BLOCK,
        num_gpu_blocks=40,  # a few prompts' worth: every new prompt evicts
        num_cpu_tier_blocks=12,
        num_disk_tier_blocks=24,
        kv_disk_tier_dir=str(tmp_path_factory.mktemp("kv-disk")),
    )
    core = EngineCore(config)
    yield core
    core.shutdown()


def holdings(engine: EngineCore) -> dict[int, int]:
    """hash -> tier bits of what the engine's tiers hold now."""
    held: dict[int, int] = {}
    connector = engine.scheduler.connector
    assert connector is not None and connector.disk is not None
    for tier, hashes in (
        (DEVICE, engine.scheduler.kv.pool.cached),
        (CPU, connector.cpu.slots),
        (DISK, connector.disk.slots),
    ):
        for h in hashes:
            held[h] = held.get(h, 0) | tier
    return held


def run(engine: EngineCore, request: EngineRequest) -> int:
    """Run the request to its end; its prefix hit in tokens."""
    engine.add_request(request)
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached = out.num_cached_tokens
    return cached


def test_the_index_follows_the_engine_exactly_through_churn_and_predicts_every_hit(engine):
    log = attach_kv_events(engine)
    router = FleetState(RoutingConfig())
    rng = random.Random(7)
    shared = [[rng.randrange(10, 200) for _ in range(4 * BLOCK)] for _ in range(8)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    hits = tiers_hit = 0
    for i in range(40):
        prompt = rng.choice(shared) + [rng.randrange(10, 200) for _ in range(rng.randrange(8, 40))]
        capped = hash_prompt_blocks(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
        predicted = router.kv.match(capped, ["r"])["r"]
        cached = run(engine, EngineRequest(f"churn-{i}", prompt, params))
        assert predicted.blocks * BLOCK == cached, f"request {i}"
        hits += cached > 0
        tiers_hit += predicted.cpu + predicted.disk > 0
        sent = RoutingStats(engine.stats(), kv_events=log.report()).to_dict()  # through Serve
        router.on_stats("r", RoutingStats.from_dict(sent), now=float(i))
        assert router.kv.in_sync("r") and router.kv.holdings("r") == holdings(engine)
    # The workload did what the test is for: hits from the device pool and from the lower tiers.
    assert hits > 10 and tiers_hit > 3
    assert router.kv.num_snapshots == 1  # synced once, from the first report, then events only


def test_each_last_outputs_tail_brings_the_index_to_the_engine_before_the_next_request(engine):
    """What a served replica does (cluster/kv_event_pub.py TailingEngine): after a request's last
    step, the log's tail; the router, given nothing else after its first report, predicts every
    next hit exactly."""
    log = attach_kv_events(engine)
    router = FleetState(RoutingConfig())
    router.on_stats("r", RoutingStats(engine.stats(), kv_events=log.report()), now=0.0)
    rng = random.Random(11)
    shared = [[rng.randrange(10, 200) for _ in range(4 * BLOCK)] for _ in range(6)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    hits = 0
    for i in range(16):
        prompt = rng.choice(shared) + [rng.randrange(10, 200) for _ in range(rng.randrange(8, 40))]
        capped = hash_prompt_blocks(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
        predicted = router.kv.match(capped, ["r"])["r"]
        cached = run(engine, EngineRequest(f"tail-{i}", prompt, params))
        assert predicted.blocks * BLOCK == cached, f"request {i}"
        hits += cached > 0
        router.on_kv_tail(log.tail("r"), now=float(i + 1))
        assert router.kv_seen_at["r"] == i + 1 and router.kv.holdings("r") == holdings(engine)
    assert hits > 4 and router.kv.num_snapshots == 1
