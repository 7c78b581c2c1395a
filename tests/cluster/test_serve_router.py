"""FleetRouter inside real Ray Serve on loopback.

First two replicas of a small streaming deployment that reports routing stats like LLMReplica does:
concurrent streams spread over both replicas, a shared prompt prefix sticks to one replica while
load
stays balanced, and a killed replica is routed around. Then two real LLMReplicas of the tiny
random Llama (what is proved is routing and the replicas' KV caches, not the model): streams
spread, and a tenant's requests find its system prompt in the replica's KV cache."""

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.kv_event_pub import deliver_kv_tail
from cluster.outcomes import report_outcome
from cluster.replica import LLMReplica
from cluster.serve_router import ROUTER_CLASS_PATH, FleetRouter
from deploy.config import AppConfig
from deploy.generation import _route_as_own_request
from router.stats import ReplicaState, RoutingStats
from scheduler import SamplingParams, hash_prompt_blocks
from scheduler.block_manager import PrefixReport
from scheduler.outputs import SchedulerStats
from scheduler.request import EngineRequest
from tests.deploy.conftest import delete_app, run_app
from workers.distributed import free_port

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
APP = "router_test"
CIRCUIT_COOLDOWN_S = 3.0
# While this file exists every StreamingReplica reports itself draining (the test's switch).
DRAINING_FLAG = "/tmp/raylm-router-test-draining"  # a constant: replicas import this module


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=64,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=1,
    request_router_config=RequestRouterConfig(
        request_router_class=FleetRouter,
        request_router_kwargs={
            "router_policy": "prefix_affinity",
            "imbalance_threshold": 4.0,
            "circuit_breaker_failures": 2,
            "circuit_breaker_cooldown_s": CIRCUIT_COOLDOWN_S,
        },
        request_routing_stats_period_s=0.5,
    ),
)
class StreamingReplica:
    """Streams max_tokens items, one per tick; each item names the replica that produced it."""

    def __init__(self, tick_s: float = 0.02):
        self.tick_s = tick_s
        self.name = ray.get_runtime_context().get_actor_name()
        self.running = 0
        self.resident: dict[int, None] = {}
        self.reports = 0

    async def generate(self, request: EngineRequest):
        self.running += 1
        self.resident.update(dict.fromkeys(request.block_hashes))
        try:
            for _ in range(request.sampling_params.max_tokens):
                await asyncio.sleep(self.tick_s)  # a stream's pace: concurrent streams overlap
                yield self.name
        finally:
            self.running -= 1

    def record_routing_stats(self) -> dict:
        self.reports += 1
        prefix = PrefixReport(list(self.resident)[-256:], self.reports)
        state = ReplicaState.DRAINING if os.path.exists(DRAINING_FLAG) else ReplicaState.OK
        return RoutingStats(
            SchedulerStats(0, self.running, 0, 0.0, 0.0, 0), state=state, prefix=prefix
        ).to_dict()


@pytest.fixture(scope="module")
def handle(ray_cluster):
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1", "port": free_port()})
    h = run_app(StreamingReplica.bind(), APP, None)
    yield h
    delete_app(APP)


def request(prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        block_hashes=hash_prompt_blocks(prompt, BLOCK_SIZE),
    )


def prompt_for(tenant: int, question: int, prefix_blocks: int = 8) -> list[int]:
    system = [1000 * (tenant + 1) + i for i in range(prefix_blocks * BLOCK_SIZE)]
    return system + [7, question, 9]


async def stream(handle, req: EngineRequest) -> str:
    """Consume a stream; the replica that served it."""
    names = [name async for name in handle.options(stream=True).generate.remote(req)]
    assert len(set(names)) == 1 and len(names) == req.sampling_params.max_tokens
    return names[0]


def run(coro):
    return asyncio.run(coro)


def fleet_router(handle) -> FleetRouter:
    """The FleetRouter that Serve built for this handle in this process (a Serve-internal path)."""
    return handle._router._asyncio_router.request_router


async def settle(handle) -> None:
    """Until every replica has reported nothing running since this call: the previous test's
    streams are out of the routing stats (reported every 0.5 s) that steer this test's requests."""
    await reported(handle, lambda stats: stats.scheduler.num_running == 0)


async def reported(handle, holds: Callable[[RoutingStats], bool]) -> None:
    """Until this process's router holds a report from each of two replicas, taken after this call,
    for which holds is true (a fixed sleep waited 1.5 s where a report comes within 0.5 s)."""
    if handle._router is None:  # no request sent through this handle yet: nothing to drain
        return
    router = fleet_router(handle)
    before = {replica: _report_id(stats) for replica, stats in router.fleet.reports().items()}
    for _ in range(600):
        reports = router.fleet.reports()
        fresh = [r for r, s in reports.items() if _report_id(s) > before.get(r, -1) and holds(s)]
        if len(fresh) >= 2:
            return
        await asyncio.sleep(0.05)  # a bounded poll: the reports come through Serve's controller
    raise AssertionError(f"no fresh report that holds from two replicas in 30 s: {reports}")


def _report_id(stats: RoutingStats) -> int:
    """The replica's count of its reports (-1 when it could not ask its engine in time)."""
    return -1 if stats.prefix is None else stats.prefix.report_id


def test_router_class_path_is_importable_by_serve():
    # What `serve deploy` does with the string in deploy.yaml: import, then ship the class by value.
    config = RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH)
    assert config.get_request_router_class().__name__ == FleetRouter.__name__


def test_sixteen_concurrent_streams_spread_over_both_replicas(handle):
    async def go():
        reqs = [request(prompt_for(100 + i, i), max_tokens=20) for i in range(16)]
        return await asyncio.gather(*(stream(handle, r) for r in reqs))

    served = run(go())
    counts = {name: served.count(name) for name in set(served)}
    assert len(counts) == 2, counts
    assert min(counts.values()) >= 6, counts  # in-flight counting keeps the split near 8/8


def test_shared_prefix_sticks_to_one_replica_while_load_stays_balanced(handle):
    async def go():
        await settle(handle)
        # Tenant 0 warms a replica; tenant 1, a prefix nobody holds, goes to the replica holding
        # fewer blocks.
        first = await stream(handle, request(prompt_for(0, 0), max_tokens=2))
        reqs = [request(prompt_for(t, q), max_tokens=15) for q in range(1, 5) for t in (0, 1)]
        return first, await asyncio.gather(*(stream(handle, r) for r in reqs))

    first, served = run(go())
    tenant0, tenant1 = set(served[0::2]), set(served[1::2])
    assert tenant0 == {first}
    assert len(tenant1) == 1 and tenant1 != tenant0
    assert served.count(first) == 4


def test_a_sessions_turns_stay_on_one_replica_though_each_turn_is_a_new_prefix(handle):
    """The session travels as Serve's session_id (what the ingress sets from a body's session_id);
    without it each new prefix would go to the replica holding fewer blocks, in turn."""

    async def go():
        await settle(handle)
        agent = handle.options(session_id="agent-7")
        return [
            await stream(agent, request(prompt_for(200 + turn, turn), max_tokens=2))
            for turn in range(4)
        ]

    served = run(go())
    assert len(set(served)) == 1, served
    # The router names replicas by Serve's unique id, the end of the actor's name.
    assert served[0].endswith("#" + fleet_router(handle).fleet.sessions.replica_of("agent-7"))


def test_replica_failures_reported_by_the_caller_open_its_circuit_until_the_cool_down(handle):
    """What the ingress does when a replica fails a choice: report_outcome(ok=False) on the
    request's
    internal id. Two in a row on one replica and this process's FleetRouter skips it; after the
    cool-down it takes requests again."""

    async def trip():
        await settle(handle)
        victim = None
        failures = 0
        for tenant in range(20, 60):
            internal_id = _route_as_own_request()
            served = await stream(handle, request(prompt_for(tenant, 0), max_tokens=2))
            if victim in (None, served):
                victim = served
                report_outcome(internal_id, ok=False)
                failures += 1
                if failures == 2:
                    break
        assert failures == 2
        # Fresh prefixes go to the replica holding fewer blocks, but not to one with an open
        # circuit.
        open_circuit = [
            await stream(handle, request(prompt_for(t, 0), max_tokens=2)) for t in range(60, 66)
        ]
        # Nor does a prefix the victim holds.
        open_circuit.append(await stream(handle, request(prompt_for(20, 1), max_tokens=2)))
        router = fleet_router(handle)
        router.clock = lambda: time.monotonic() + CIRCUIT_COOLDOWN_S  # the cool-down has passed
        closed = []
        for tenant in (
            70,
            71,
            72,
        ):  # the victim now holds the fewest blocks: fresh prefixes go there
            internal_id = _route_as_own_request()
            closed.append(await stream(handle, request(prompt_for(tenant, 0), max_tokens=2)))
            report_outcome(internal_id, ok=True)
        router.clock = time.monotonic
        return victim, open_circuit, closed

    victim, open_circuit, closed = run(trip())
    assert victim not in open_circuit, open_circuit
    assert closed.count(victim) >= 2, (
        closed
    )  # the probe, then (its success closed the circuit) more


def test_a_request_waits_while_every_replica_drains_and_goes_to_the_first_back(handle):
    """With every replica reporting itself draining the router ranks none; Serve must back off
    and poll again (not retry in a loop that never yields, which starved the loop that brings
    the replicas' new reports: the request hung for good), so the request is served once one
    reports itself healthy."""

    async def go():
        await settle(handle)
        with open(DRAINING_FLAG, "w"):
            pass
        try:
            await reported(handle, lambda stats: stats.state is ReplicaState.DRAINING)
            pending = asyncio.ensure_future(stream(handle, request(prompt_for(80, 0), 2)))
            await asyncio.sleep(1.0)
            assert not pending.done()  # nowhere to go yet
        finally:
            os.remove(DRAINING_FLAG)
        return await asyncio.wait_for(pending, timeout=30)

    assert run(go()) in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_killed_replica_is_routed_around(handle):
    async def go():
        await settle(handle)
        victim = await stream(handle, request(prompt_for(5, 0), max_tokens=2))
        # A prefix the other replica holds, so that a stream is surely there when the kill strikes
        # (fresh prefixes go to the smaller footprint, which earlier tests may leave one-sided).
        for t in range(6, 40):
            if await stream(handle, request(prompt_for(t, 0), max_tokens=2)) != victim:
                break
        in_flight = [
            asyncio.ensure_future(stream(handle, request(prompt_for(u, 1), max_tokens=200)))
            for u in (5, t, 5, t)
        ]
        await asyncio.sleep(0.5)  # the streams reach both replicas before one is killed
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
        # The dead replica's prefix and fresh prefixes alike are served by live replicas.
        after = await asyncio.gather(
            *(
                stream(handle, request(prompt_for(t, 2), max_tokens=5))
                for t in (5, 5, 5, 6, 7, 8, 9, 10)
            )
        )
        return victim, outcomes, after

    victim, outcomes, after = run(go())
    assert any(isinstance(o, Exception) for o in outcomes)  # streams cut by the kill fail
    assert any(
        o != victim and isinstance(o, str) for o in outcomes
    )  # the other replica kept streaming
    assert victim not in after


# ---------------------------------------------------------------- the real LLMReplica

REAL_APP = "router_test_llm"
PREFIX_BLOCKS = 8


def routed_counts(handle) -> Counter:
    """Requests per replica so far, as counted by the handle's FleetRouter (empty until the handle
    sends its first request)."""
    if handle._router is None:
        return Counter()
    return Counter(fleet_router(handle).fleet.routed)


@pytest.fixture(scope="module")
def llm_handle(ray_cluster, tiny_model_dir):
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1", "port": free_port()})
    config = AppConfig.from_args(
        {
            # Two layers instead of SmolLM2's thirty: each replica's start loads less.
            "model": tiny_model_dir,
            "device": "cpu",
            "num_replicas": 2,
            "cpu_threads": 1,
            "block_size": BLOCK_SIZE,
            "num_gpu_blocks": 128,
            "max_model_len": 256,
            "max_num_seqs": 16,
            "replica_num_cpus": 1,
            "router": "fleet",
            "router_kwargs": {"router_policy": "prefix_affinity", "imbalance_threshold": 4.0},
        }
    )
    replica = LLMReplica.options(
        num_replicas=2,
        ray_actor_options=config.replica_actor_options(),
        placement_group_bundles=config.placement_group_bundles(),
        max_ongoing_requests=64,
        request_router_config=config.request_router_config(),
        health_check_timeout_s=120,
    )
    yield run_app(replica.bind(config.engine), REAL_APP, None)
    delete_app(REAL_APP)  # stops in the background: no later test uses its name or replicas


async def generate(handle, req: EngineRequest):
    """(output token count, cached prompt tokens) of one streamed request; the KV events its last
    output carries go to the router, as the ingress sends them."""
    produced, cached = 0, 0
    async for out in handle.options(stream=True).generate.remote(req):
        produced += len(out.new_token_ids)
        cached = out.num_cached_tokens
        deliver_kv_tail(out)
    return produced, cached


async def synced(router: FleetRouter, replicas: list[str]) -> bool:
    """Whether the router's KV index is in sync for every replica, once what the router's loop
    was handed has run (the first report's snapshot takes up to a report period to come)."""
    for _ in range(300):
        assert router._loop is not None
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), router._loop))
        if all(router.fleet.kv.in_sync(r) for r in replicas):
            return True
        await asyncio.sleep(0.1)
    return False


def real_prompt(tenant: int, question: int) -> list[int]:
    system = [300 + 97 * tenant + i for i in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    return system + [500 + question, 600 + question, 700]


def greedy(prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        block_hashes=hash_prompt_blocks(prompt, BLOCK_SIZE),
    )


def test_real_replicas_share_sixteen_concurrent_streams(llm_handle):
    before = routed_counts(llm_handle)

    async def go():
        reqs = [greedy([1000 + 31 * i + j for j in range(40)], max_tokens=6) for i in range(16)]
        return await asyncio.gather(*(generate(llm_handle, r) for r in reqs))

    outputs = run(go())
    assert [produced for produced, _ in outputs] == [6] * 16
    split = sorted((routed_counts(llm_handle) - before).values())
    assert len(split) == 2 and split[0] >= 6, split


def test_real_replicas_keep_a_shared_prefix_on_the_replica_that_caches_it(llm_handle):
    async def go():
        await settle(llm_handle)
        # One request per tenant fills a cache each (the second tenant lands on the emptier
        # replica).
        for tenant in (0, 1):
            await generate(llm_handle, greedy(real_prompt(tenant, 0), max_tokens=2))
        before = routed_counts(llm_handle)
        reqs = [greedy(real_prompt(t, q), max_tokens=4) for q in range(1, 5) for t in (0, 1)]
        outputs = await asyncio.gather(*(generate(llm_handle, r) for r in reqs))
        return outputs, routed_counts(llm_handle) - before

    outputs, split = run(go())
    # Every request found its tenant's system prompt in the KV cache of the replica it reached,
    # and the two tenants kept the two replicas equally busy.
    assert [cached for _, cached in outputs] == [PREFIX_BLOCKS * BLOCK_SIZE] * 8
    assert sorted(split.values()) == [4, 4]
    # The replicas' KV events (reports, and the last outputs' tails) show each tenant's system
    # prompt on one replica, a different one for each tenant.
    router, replicas = fleet_router(llm_handle), sorted(split)
    assert run(synced(router, replicas))
    match = router.fleet.kv.match
    holders = [
        [r for r, got in match(hashes, replicas).items() if got.device >= PREFIX_BLOCKS]
        for hashes in (hash_prompt_blocks(real_prompt(t, 0), BLOCK_SIZE) for t in (0, 1))
    ]
    assert len(holders[0]) == len(holders[1]) == 1 and holders[0] != holders[1], holders
